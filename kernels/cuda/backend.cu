// backend.cu - the CUDA backend: kernels.h's tsr_backend on one device.
//
// The context: the device ordinal, ONE non-blocking stream, a cuBLAS handle bound to that
// stream, and small growable device scratch buffers (three for index arrays; the bf16
// copy of a matmul's activations; attention's run records).  Every call first makes the device current on the calling thread
// (cudaSetDevice is cheap when it already is), so a thread may drive backends on different
// devices in turn, and two threads each their own.  Threads: a backend is driven by one
// thread at a time (kernels.h), so the context needs no lock.
//
// Ordering: every kernel, cuBLAS call and copy of this backend is queued on its stream, in
// call order.  The stream is non-blocking (it does not synchronize with the legacy default
// stream), so nothing else in the process serializes against it.  upload and download
// wait for the stream (kernels.h: synchronous); copy and the ops return once queued; a
// fault inside a kernel shows as TSR_E_CUDA at the next upload/download/synchronize.
//
// Graphs (kernels.h): between graph_begin and graph_end the ops check their arguments,
// stage their index arrays in a pinned host buffer (at offsets that are part of the op's
// signature; the kernels read them from a device copy of that buffer at the same
// offsets) and fold everything else they would launch with (pointers, sizes, scalars,
// scratch buffers) into a 64-bit signature.  A capture records the signatures while the
// stream records the launches (cudaStreamBeginCapture, thread-local mode); a replay only
// compares them, launching nothing.  graph_end then copies the staged bytes up in one
// copy and launches the graph.  Any difference (another pointer, a grown scratch, a
// block table past its width) makes the run fail and the caller issue it eagerly: a
// replay can never read memory the recording did not.
//
// Host index arrays (embedding's ids, rope's pos, a batch's rows and block tables) are
// copied to an index scratch with cudaMemcpyAsync on the stream just before the kernel
// that reads them.  From pageable memory (what callers have) that call returns once the
// source is staged, so the caller may reuse its array at once; the next op's copy into
// the same scratch is queued after this op's kernel, so it cannot overwrite indices still
// in use.  (A pinned source would be read by the DMA later: callers must not pass pinned
// arrays they reuse before a synchronize.)  Each kind of array has its own scratch, which
// remembers what it holds: a forward passes every layer the same positions and the same
// rows, so one step uploads each once instead of once per op and layer.
#include <initializer_list>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>

#include "kernels/backend_impl.h"
#include "kernels/cpu/kv_view.h"        // kv_view_ok: the same view checks as the CPU backends
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/add_rmsnorm.cuh"
#include "kernels/cuda/fpmm.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/rmsnorm.cuh"
extern "C" {
#include "kernels/quant/fpmm.h"         // tsr_fpmm_scales_ok: the scales kernels.h accepts
}

// Device memory that grows to the largest request and is reused across ops.
struct cuda_scratch {
        void *p;
        size_t cap;     // bytes
};

// An index scratch and a host copy of the bytes its last upload queued: the first `held`
// bytes of dev.p hold them, or will once the stream gets there.
struct cuda_index_scratch {
        cuda_scratch dev;
        void *host;
        size_t host_cap, held;
};

// A recorded graph: its executable, the signatures of its ops in order and the staged
// bytes its launches read.
struct cuda_graph {
        uint64_t key;
        unsigned splits;                // attention's key splits: the length class
        uint64_t last_use;              // g_clock at its last launch
        cudaGraphExec_t exec;
        uint64_t *sigs;
        size_t n_sigs;
        size_t staged;
};

enum { GRAPH_OFF, GRAPH_CAPTURE, GRAPH_REPLAY };
#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define GRAPH_CAP 256                   // graphs kept (kernels.h): ~1.6 MB each for SmolLM2
enum { IDX_IDS, IDX_POS, IDX_ROWS, IDX_KINDS };

struct cuda_ctx {
        int device;
        cudaStream_t stream;
        cublasHandle_t blas;
        void *blas_ws;                  // cuBLAS's workspace (CUBLAS_WORKSPACE_BYTES)
        cuda_index_scratch ids;         // embedding's token ids
        cuda_index_scratch pos;         // rope's positions
        cuda_index_scratch rows;        // kv_write's and attention's rows (upload_rows)
        cuda_index_scratch gather;      // gather_rows' and scatter_add_rows' row indices
        cuda_index_scratch scales;      // gather_rows' and scatter_add_rows' scales (float bits)
        cuda_scratch act;       // a bf16 matmul's rounded activations, an fp8 / nvfp4 one's quantized ones
        tsr_cuda_fpmm_lt *lt;   // cuBLASLt's FP8 GEMM (fpmm.cu)
        bool fpmm_exact;        // TESSERA_CUDA_FPMM=exact: never cuBLASLt (the bitwise kernels only)
        cuda_scratch attn;      // attention's per-run records (attention.cu's split over the keys)
        cuda_scratch argmax;    // argmax's (and sample's) row results before their download
        cuda_scratch draws;     // sample's per-row parameters
        cuda_scratch rules;     // logit_rules' packed lists (ops.cuh) and their kept values
        cuda_scratch lp;        // logprobs' tokens and top counts, then its rows' results
        cuda_index_scratch mamba;       // mamba_mixer's sequence table, row map and saves
        cuda_scratch mamba_work;        // mamba_mixer's conv outputs and steps
        // graphs: the one in progress (state, key, block-table width, ops so far, whether
        // it failed, the capture's signatures, staging used and the last array of each
        // index kind staged in it), the staging (pinned host, its device copy, an event
        // after the last copy up) and the recorded graphs
        int g_state;
        uint64_t g_key, g_clock;
        uint32_t g_width;
        unsigned g_splits;
        size_t g_op;
        bool g_failed;
        cuda_graph *g_replay;
        uint64_t *g_sigs;
        size_t g_n_sigs, g_cap_sigs;
        size_t g_used, g_need;
        struct { size_t off, bytes; } g_last[IDX_KINDS];
        unsigned char *stage_host;
        cuda_scratch stage_dev;
        cudaEvent_t stage_done;
        bool stage_pending;
        cuda_graph *graphs;
        size_t n_graphs, cap_graphs;
};

static cuda_ctx *ctx_of(tsr_backend *be) { return static_cast<cuda_ctx *>(be->ctx); }

static tsr_status use_device(tsr_backend *be) {
        TSR_CUDA_TRY(cudaSetDevice(ctx_of(be)->device));
        return TSR_OK;
}

// At least `bytes` of s, growing it (to twice the old size at least, so a slowly growing
// batch reallocates rarely).  Growing first waits for the stream: queued kernels may still
// read the old buffer.  TSR_E_NOMEM (s emptied) or TSR_E_CUDA.
static tsr_status scratch_reserve(cuda_ctx *c, cuda_scratch *s, size_t bytes) {
        if (bytes <= s->cap)
                return TSR_OK;
        if (c->g_state != GRAPH_OFF) {  // no allocation inside a graph: the eager rerun grows it
                c->g_failed = true;
                return TSR_OK;
        }
        size_t want = bytes > 2 * s->cap ? bytes : 2 * s->cap;
        TSR_CUDA_TRY(cudaStreamSynchronize(c->stream));
        TSR_CUDA_TRY(cudaFree(s->p));
        s->p = NULL;
        s->cap = 0;
        cudaError_t e = cudaMalloc(&s->p, want);
        if (e == cudaErrorMemoryAllocation) {
                (void)cudaGetLastError();       // not sticky: clear it
                s->p = NULL;
                fprintf(stderr, "cuda: scratch of %zu bytes: out of device memory\n", want);
                return TSR_E_NOMEM;
        }
        TSR_CUDA_TRY(e);
        s->cap = want;
        return TSR_OK;
}

// The host index array a (count,) in the index scratch x; *dev points at it.  Copied
// unless x's last upload was these very bytes (then the copy on the device, or the one
// queued ahead, is theirs).
// ---- graph runs: signatures and staging -----------------------------------------------

// A signature: the op, then each argument's bits folded in (a 64-bit multiply-xorshift).
static uint64_t sig_of(int op, std::initializer_list<uint64_t> args) {
        uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)op;
        for (uint64_t v : args) {
                h = (h ^ v) * 0xff51afd7ed558ccdull;
                h ^= h >> 33;
        }
        return h;
}
static uint64_t ptr_bits(const void *p) { return (uint64_t)(uintptr_t)p; }
static uint64_t float_bits(float f) {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        return u;
}

enum { SIG_RMSNORM = 1, SIG_ADD_RMSNORM, SIG_EMBEDDING, SIG_MATMUL, SIG_ROPE, SIG_KV_WRITE, SIG_ATTENTION,
       SIG_SILU_MUL, SIG_ADD, SIG_SOFTMAX, SIG_COPY, SIG_MATMUL_SCALED };

// Outside a graph run: true (queue the op).  In one: record (capture) or check (replay)
// the op's signature h; true when the op is to be queued, i.e. in a capture that has not
// failed (its launches go into the graph).  A replay never queues.
static bool graph_op(cuda_ctx *c, uint64_t h) {
        if (c->g_state == GRAPH_OFF)
                return true;
        if (c->g_failed)
                return false;
        if (c->g_state == GRAPH_REPLAY) {
                if (c->g_op >= c->g_replay->n_sigs || c->g_replay->sigs[c->g_op] != h)
                        c->g_failed = true;
                c->g_op++;
                return false;
        }
        if (c->g_n_sigs == c->g_cap_sigs) {
                size_t cap = c->g_cap_sigs ? 2 * c->g_cap_sigs : 1024;
                uint64_t *p = static_cast<uint64_t *>(realloc(c->g_sigs, cap * sizeof *p));
                if (!p) {
                        c->g_failed = true;
                        return false;
                }
                c->g_sigs = p;
                c->g_cap_sigs = cap;
        }
        c->g_sigs[c->g_n_sigs++] = h;
        c->g_op++;
        return true;
}

// In a graph run: the index array a (bytes) in the staging, at the offset of the run's
// last array of this kind when that held the same bytes (a forward passes every layer
// the same positions and rows), else at the next free offset; returns the device address
// the launches read it at (part of the op's signature).  Past the staging's capacity the
// run fails and g_need says what it wanted (graph_end grows the staging for the next).
static const uint32_t *graph_stage(cuda_ctx *c, int kind, const uint32_t *a, size_t bytes) {
        size_t off = c->g_last[kind].off;
        if (!(bytes && c->g_last[kind].bytes == bytes && memcmp(c->stage_host + off, a, bytes) == 0)) {
                off = (c->g_used + 15) & ~(size_t)15;
                c->g_used = off + bytes;
                if (c->g_used > c->stage_dev.cap) {
                        c->g_need = c->g_used > c->g_need ? c->g_used : c->g_need;
                        c->g_failed = true;
                        return static_cast<const uint32_t *>(c->stage_dev.p);   // never launched
                }
                if (bytes)
                        memcpy(c->stage_host + off, a, bytes);
                c->g_last[kind].off = off;
                c->g_last[kind].bytes = bytes;
        }
        return reinterpret_cast<const uint32_t *>(static_cast<unsigned char *>(c->stage_dev.p) + off);
}

static tsr_status upload_indices(cuda_ctx *c, cuda_index_scratch *x, const uint32_t *a, size_t count,
                                 const uint32_t **dev) {
        size_t bytes = count * sizeof *a;
        if (c->g_state != GRAPH_OFF) {
                *dev = graph_stage(c, x == &c->ids ? IDX_IDS : x == &c->pos ? IDX_POS : IDX_ROWS, a, bytes);
                return TSR_OK;
        }
        if (x->dev.p && bytes == x->held && bytes && memcmp(x->host, a, bytes) == 0) {
                *dev = static_cast<const uint32_t *>(x->dev.p);
                return TSR_OK;
        }
        x->held = 0;
        if (bytes > x->host_cap) {
                void *h = realloc(x->host, bytes);
                if (!h)
                        return TSR_E_NOMEM;
                x->host = h;
                x->host_cap = bytes;
        }
        tsr_status st = scratch_reserve(c, &x->dev, bytes ? bytes : sizeof *a);
        if (st != TSR_OK)
                return st;
        if (bytes) {
                TSR_CUDA_TRY(cudaMemcpyAsync(x->dev.p, a, bytes, cudaMemcpyHostToDevice, c->stream));
                memcpy(x->host, a, bytes);
                x->held = bytes;
        }
        *dev = static_cast<const uint32_t *>(x->dev.p);
        return TSR_OK;
}

static void index_scratch_free(cuda_index_scratch *x) {
        (void)cudaFree(x->dev.p);
        free(x->host);
}

static void graph_free(cuda_graph *g) {
        if (g->exec)
                (void)cudaGraphExecDestroy(g->exec);
        free(g->sigs);
        *g = cuda_graph{};
}

static void graphs_drop(cuda_ctx *c) {
        for (size_t i = 0; i < c->n_graphs; i++)
                graph_free(&c->graphs[i]);
        c->n_graphs = 0;
}

static cuda_graph *graph_find(cuda_ctx *c, uint64_t key, unsigned splits) {
        for (size_t i = 0; i < c->n_graphs; i++)
                if (c->graphs[i].key == key && c->graphs[i].splits == splits)
                        return &c->graphs[i];
        return NULL;
}

static void cuda_ctx_free(void *ctx) {
        cuda_ctx *c = static_cast<cuda_ctx *>(ctx);
        if (!c)
                return;
        if (cudaSetDevice(c->device) == cudaSuccess) {
                if (c->g_state == GRAPH_CAPTURE) {      // a run left open: end the capture
                        cudaGraph_t g = NULL;
                        if (cudaStreamEndCapture(c->stream, &g) == cudaSuccess && g)
                                (void)cudaGraphDestroy(g);
                        (void)cudaGetLastError();
                }
                if (c->stream)
                        (void)cudaStreamSynchronize(c->stream);
                graphs_drop(c);
                free(c->graphs);
                free(c->g_sigs);
                (void)cudaFreeHost(c->stage_host);
                (void)cudaFree(c->stage_dev.p);
                if (c->stage_done)
                        (void)cudaEventDestroy(c->stage_done);
                tsr_cuda_fpmm_lt_free(c->lt);
                if (c->blas)
                        (void)cublasDestroy(c->blas);
                (void)cudaFree(c->blas_ws);
                index_scratch_free(&c->ids);
                index_scratch_free(&c->pos);
                index_scratch_free(&c->rows);
                index_scratch_free(&c->gather);
                index_scratch_free(&c->scales);
                (void)cudaFree(c->act.p);
                (void)cudaFree(c->attn.p);
                (void)cudaFree(c->argmax.p);
                (void)cudaFree(c->draws.p);
                (void)cudaFree(c->rules.p);
                (void)cudaFree(c->lp.p);
                index_scratch_free(&c->mamba);
                (void)cudaFree(c->mamba_work.p);
                if (c->stream)
                        (void)cudaStreamDestroy(c->stream);
        }
        free(c);
}

// ---- memory --------------------------------------------------------------------------

static tsr_status cuda_mem_alloc(tsr_backend *be, size_t bytes, void **ret) {
        if (ctx_of(be)->g_state != GRAPH_OFF)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, bytes);     // 256-byte aligned
        if (e == cudaErrorMemoryAllocation) {
                (void)cudaGetLastError();          // not sticky: clear it
                return TSR_E_NOMEM;
        }
        TSR_CUDA_TRY(e);
        *ret = p;
        return TSR_OK;
}

// cudaFree waits for the device to finish work that may use p.
static void cuda_mem_free(tsr_backend *be, void *p) {
        if (use_device(be) == TSR_OK)
                (void)cudaFree(p);
}

// Queue the copy on the stream; wait for it when `wait` (upload, download: synchronous).
static tsr_status cuda_memcpy(tsr_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                              bool wait) {
        cuda_ctx *c = ctx_of(be);
        if (c->g_state != GRAPH_OFF && (wait || kind != cudaMemcpyDeviceToDevice))
                return TSR_E_INVAL;     // kernels.h: no upload or download inside a graph run
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        if (!graph_op(c, sig_of(SIG_COPY, {ptr_bits(dst), ptr_bits(src), bytes})))
                return TSR_OK;
        cudaStream_t s = c->stream;
        TSR_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind, s));
        if (wait)
                TSR_CUDA_TRY(cudaStreamSynchronize(s));
        return TSR_OK;
}

static tsr_status cuda_upload(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_memcpy(be, dst, src, bytes, cudaMemcpyHostToDevice, true);
}

static tsr_status cuda_download(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_memcpy(be, dst, src, bytes, cudaMemcpyDeviceToHost, true);
}

static tsr_status cuda_copy_d2d(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_memcpy(be, dst, src, bytes, cudaMemcpyDeviceToDevice, false);
}

// Queued on the stream as the ops are; refused inside a graph run, as the row ops.
static tsr_status cuda_zero(tsr_backend *be, void *p, size_t bytes) {
        cuda_ctx *c = ctx_of(be);
        if (c->g_state != GRAPH_OFF)
                return TSR_E_UNSUPPORTED;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaMemsetAsync(p, 0, bytes, c->stream));
        return TSR_OK;
}

// cudaMemGetInfo of the backend's device: free and total bytes, other processes' use included.
static tsr_status cuda_mem_info(tsr_backend *be, size_t *free_bytes, size_t *total_bytes) {
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes));
        return TSR_OK;
}

static tsr_status cuda_synchronize(tsr_backend *be) {
        if (ctx_of(be)->g_state != GRAPH_OFF)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaStreamSynchronize(ctx_of(be)->stream));
        return TSR_OK;
}

// ---- operators -----------------------------------------------------------------------
// Each checks its arguments as the CPU reference does (TSR_E_INVAL, nothing queued),
// makes the device current, uploads its index array if it has one, and launches.

static tsr_status cuda_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                               float eps) {
        tsr_status st = use_device(be);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_RMSNORM, {ptr_bits(out), ptr_bits(x), ptr_bits(w), rows,
                                                                       dim, float_bits(eps)})))
                return st;
        return tsr_cuda_rmsnorm(ctx_of(be)->stream, out, x, w, rows, dim, eps);
}

static tsr_status cuda_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps) {
        tsr_status st = use_device(be);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_ADD_RMSNORM, {ptr_bits(out), ptr_bits(residual), ptr_bits(x),
                                                                           ptr_bits(w), rows, dim, float_bits(eps)})))
                return st;
        return tsr_cuda_add_rmsnorm(ctx_of(be)->stream, out, residual, x, w, rows, dim, eps);
}

static tsr_status cuda_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                 size_t dim, const uint32_t *ids, size_t rows) {
        const uint32_t *dids = NULL;
        if (!out || !table || (!ids && rows) || dim == 0 || rows > INT_MAX)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++)       // every id before anything is queued
                if (ids[r] >= vocab)
                        return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = upload_indices(ctx_of(be), &ctx_of(be)->ids, ids, rows, &dids);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_EMBEDDING, {ptr_bits(out), ptr_bits(table), vocab, dim,
                                                                         ptr_bits(dids), rows, (uint64_t)dtype})))
                return st;
        return tsr_cuda_embedding(ctx_of(be)->stream, out, table, dtype, dim, dids, rows);
}

// cuBLAS and cuBLASLt take int sizes, and a launch at most INT_MAX blocks (grids_fit): a
// matmul past either is refused with a line.
static bool sizes_fit(const char *op, size_t rows, size_t n, size_t d, bool grids_fit) {
        if (rows <= INT_MAX && n <= INT_MAX && d <= INT_MAX && grids_fit)
                return true;
        fprintf(stderr, "cuda: %s rows %zu n %zu d %zu: a size past INT_MAX (or a launch past INT_MAX blocks) is not "
                "supported\n", op, rows, n, d);
        return false;
}

static tsr_status cuda_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                              size_t rows, size_t n, size_t d) {
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        if (w_dtype != TSR_DTYPE_F32 && w_dtype != TSR_DTYPE_BF16)
                return TSR_E_UNSUPPORTED;
        if (!sizes_fit("matmul", rows, n, d, true))
                return TSR_E_UNSUPPORTED;
        if (rows == 0)
                return TSR_OK;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        cuda_ctx *c = ctx_of(be);
        if (w_dtype == TSR_DTYPE_F32) {
                if (!graph_op(c, sig_of(SIG_MATMUL, {ptr_bits(out), ptr_bits(x), ptr_bits(w), (uint64_t)w_dtype, rows, n,
                                                     d})))
                        return TSR_OK;
                return tsr_cuda_matmul_f32(c->blas, out, x, static_cast<const float *>(w), rows, n, d);
        }
        // bf16: round x to bf16 in the activation scratch (kernels.h's b()), then the GEMM.
        st = scratch_reserve(c, &c->act, rows * n * sizeof(uint16_t));
        if (st != TSR_OK || !graph_op(c, sig_of(SIG_MATMUL, {ptr_bits(out), ptr_bits(x), ptr_bits(w), (uint64_t)w_dtype,
                                                             rows, n, d, ptr_bits(c->act.p)})))
                return st;
        uint16_t *xb = static_cast<uint16_t *>(c->act.p);
        st = tsr_cuda_f32_to_bf16(c->stream, xb, x, rows * n);
        return st != TSR_OK ? st
                            : tsr_cuda_matmul_bf16(c->blas, out, xb, static_cast<const uint16_t *>(w), rows, n, d);
}

// fp8_e4m3 / nvfp4 weights with their scales (fpmm.cuh): the activations quantized into
// the act scratch, then cuBLASLt's FP8 GEMM where it applies, else the exact kernels.
static tsr_status cuda_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                     const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        if (!out || !x || !w || n == 0 || d == 0 || !tsr_fpmm_scales_ok(s))
                return TSR_E_INVAL;
        if (w_dtype != TSR_DTYPE_FP8_E4M3 && w_dtype != TSR_DTYPE_NVFP4)
                return TSR_E_UNSUPPORTED;
        if (w_dtype == TSR_DTYPE_NVFP4 && n % 16 != 0)
                return TSR_E_INVAL;
        if (!sizes_fit("matmul_scaled", rows, n, d, tsr_cuda_fpmm_fits(rows, n, d)))
                return TSR_E_UNSUPPORTED;
        if (rows == 0)
                return TSR_OK;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        cuda_ctx *c = ctx_of(be);
        bool quantized_x = s->input > 0;
        size_t need = tsr_cuda_fpmm_scratch_bytes(w_dtype, quantized_x, rows, n);
        if (need && (st = scratch_reserve(c, &c->act, need)) != TSR_OK)
                return st;
        bool use_lt = !c->fpmm_exact &&
                      tsr_cuda_fpmm_lt_applies(c->lt, out, w, c->act.p, w_dtype, quantized_x, rows, n, d);
        if (!graph_op(c, sig_of(SIG_MATMUL_SCALED, {ptr_bits(out), ptr_bits(x), ptr_bits(w), (uint64_t)w_dtype,
                                                    float_bits(s->weight), float_bits(s->input), rows, n, d,
                                                    ptr_bits(c->act.p), use_lt})))
                return TSR_OK;
        return tsr_cuda_fpmm(c->stream, c->lt, use_lt, out, x, w, w_dtype, s->weight, s->input, rows, n, d, c->act.p);
}

static tsr_status cuda_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                            const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        const uint32_t *dpos = NULL;
        if (!x || !pos || !inv_freq || head_dim == 0 || head_dim % 2 != 0)
                return TSR_E_INVAL;
        if (layout != TSR_ROPE_NEOX && layout != TSR_ROPE_INTERLEAVED)
                return TSR_E_INVAL;
        if (rows == 0 || n_heads == 0)
                return TSR_OK;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = upload_indices(ctx_of(be), &ctx_of(be)->pos, pos, rows, &dpos);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_ROPE, {ptr_bits(x), rows, n_heads, head_dim, ptr_bits(dpos),
                                                                    ptr_bits(inv_freq), (uint64_t)layout})))
                return st;
        return tsr_cuda_rope(ctx_of(be)->stream, x, rows, n_heads, head_dim, dpos, inv_freq, layout);
}

// Sequence i's view: the shared cache arrays and geometry with its own block table.
static tsr_kv_view seq_view(const tsr_kv_view *kv, const tsr_kv_seq *s) {
        tsr_kv_view v = *kv;
        v.block_table = s->block_table;
        v.n_table = s->n_table;
        return v;
}

// Every sequence's view usable for its tokens (kv_view_ok: tables long enough, block ids
// inside the cache), positions and offsets within uint32 (the kernels' index type).
static bool seqs_ok(const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs) {
        size_t rows = 0, entries = 0;
        if (!kv || (!seqs && n_seqs))
                return false;
        for (size_t i = 0; i < n_seqs; i++) {
                tsr_kv_view sv = seq_view(kv, &seqs[i]);
                size_t end = seqs[i].past_len + seqs[i].n;
                if (end < seqs[i].past_len || end > UINT32_MAX || !kv_view_ok(&sv, end))
                        return false;
                rows += seqs[i].n;
                entries += kv->block_size ? (end + kv->block_size - 1) / kv->block_size : 0;
        }
        return rows <= INT_MAX && 3 * rows + entries <= UINT32_MAX;
}

// Lay the sequences' rows out for the kernels (ops.cuh's tsr_cuda_rows) in the index
// scratch: pos (rows), end (rows), table_off (rows), then each sequence's table entries
// for its tokens.  Built in a host array, uploaded in one copy (staged before the call
// returns, so the array may be freed at once).  With `host`, the caller gets that array
// (its first rows->n entries are the positions) and frees it; without, it is freed here.
// Sequences checked by seqs_ok.
static tsr_status upload_rows(tsr_backend *be, const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs,
                              tsr_cuda_rows *rows, uint32_t **host) {
        cuda_ctx *c = ctx_of(be);
        size_t width = c->g_state != GRAPH_OFF ? c->g_width : 0;       // a graph run's fixed table size
        size_t n = 0, entries = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                n += seqs[i].n;
                entries += width ? width : (seqs[i].past_len + seqs[i].n + kv->block_size - 1) / kv->block_size;
        }
        uint32_t *h = static_cast<uint32_t *>(malloc((3 * n + entries) * sizeof *h + 1));
        if (!h)
                return TSR_E_NOMEM;
        size_t r = 0, off = 3 * n;
        for (size_t i = 0; i < n_seqs; i++) {
                size_t end = seqs[i].past_len + seqs[i].n, used = (end + kv->block_size - 1) / kv->block_size;
                for (size_t t = 0; t < seqs[i].n; t++, r++) {
                        h[r] = (uint32_t)(seqs[i].past_len + t);
                        h[n + r] = (uint32_t)end;
                        h[2 * n + r] = (uint32_t)(off - 3 * n);
                }
                if (width && (used > width || tsr_cuda_attention_splits(end) > c->g_splits)) { // past the recording
                        c->g_failed = true;
                        used = width;
                }
                for (size_t e = 0; e < used; e++)
                        h[off + e] = seqs[i].block_table[e];
                for (size_t e = used; e < width; e++)
                        h[off + e] = 0;         // never read: past the row's end
                off += width ? width : used;
        }
        const uint32_t *d = NULL;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = upload_indices(c, &c->rows, h, off, &d);
        if (st != TSR_OK || !host)
                free(h);
        if (st != TSR_OK)
                return st;
        if (host)
                *host = h;
        rows->pos = d;
        rows->end = d + n;
        rows->table_off = d + 2 * n;
        rows->tables = d + 3 * n;
        rows->n = n;
        return TSR_OK;
}

// kv_write for every sequence at once: one launch over all rows.
static tsr_status cuda_kv_write_batch(tsr_backend *be, const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs,
                                      const float *k, const float *v) {
        tsr_cuda_rows rows;
        if (kv && kv->dtype == TSR_DTYPE_FP8_E5M2)     // the CPU backends only (the worker refuses it here)
                return TSR_E_UNSUPPORTED;
        if (!k || !v || !seqs_ok(kv, seqs, n_seqs))
                return TSR_E_INVAL;
        tsr_status st = upload_rows(be, kv, seqs, n_seqs, &rows, NULL);
        if (st != TSR_OK ||
            !graph_op(ctx_of(be), sig_of(SIG_KV_WRITE, {ptr_bits(kv->k), ptr_bits(kv->v), (uint64_t)kv->dtype,
                                                        float_bits(kv->k_scale), float_bits(kv->v_scale),
                                                        ptr_bits(rows.pos), rows.n, n_seqs, kv->block_size,
                                                        kv->n_kv_heads, kv->head_dim, ptr_bits(k), ptr_bits(v)})))
                return st;
        return tsr_cuda_kv_write(ctx_of(be)->stream, kv->k, kv->v, kv->dtype, kv->k_scale, kv->v_scale, rows,
                                 kv->block_size, kv->n_kv_heads * kv->head_dim, k, v);
}

static tsr_status cuda_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                                size_t past_len) {
        if (!kv)
                return TSR_E_INVAL;
        tsr_kv_seq one = {kv->block_table, kv->n_table, n, past_len};
        return cuda_kv_write_batch(be, kv, &one, 1, k, v);
}

// attention for every sequence at once: one launch over (all rows) x (heads) x (runs), and
// one merging the runs where a row has several (attention.cu), per group of rows that
// fits the run records' scratch.
static tsr_status cuda_attention_batch(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv,
                                       const tsr_kv_seq *seqs, size_t n_seqs, size_t n_heads, float scale) {
        tsr_cuda_rows rows;
        if (kv && kv->dtype == TSR_DTYPE_FP8_E5M2)     // the CPU backends only (the worker refuses it here)
                return TSR_E_UNSUPPORTED;
        if (!out || !q || n_heads == 0 || !seqs_ok(kv, seqs, n_seqs) || kv->n_kv_heads == 0 ||
            n_heads % kv->n_kv_heads != 0)
                return TSR_E_INVAL;
        if (kv->head_dim > TSR_CUDA_ATTN_MAX_HEAD_DIM || n_heads > 65535) {
                fprintf(stderr, "cuda: attention head_dim %zu n_heads %zu: the kernel takes head_dim <= %d, "
                        "n_heads <= 65535\n", kv->head_dim, n_heads, TSR_CUDA_ATTN_MAX_HEAD_DIM);
                return TSR_E_UNSUPPORTED;
        }
        // The run records' scratch first (attention.cu: at most 32 MiB, whatever the batch),
        // so that a failure to grow it queues nothing.
        cuda_ctx *c = ctx_of(be);
        size_t n_rows = 0;
        for (size_t i = 0; i < n_seqs; i++)
                n_rows += seqs[i].n;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->attn, tsr_cuda_attention_work_bytes(n_rows ? n_rows : 1, n_heads,
                                                                                 kv->head_dim));
        uint32_t *host = NULL;
        if (st == TSR_OK)
                st = upload_rows(be, kv, seqs, n_seqs, &rows, &host);
        // In a graph the launches cover every split a row may have (host NULL): the same bits.
        if (st == TSR_OK &&
            graph_op(c, sig_of(SIG_ATTENTION, {ptr_bits(out), ptr_bits(c->attn.p), c->attn.cap, ptr_bits(q),
                                               ptr_bits(kv->k), ptr_bits(kv->v), (uint64_t)kv->dtype,
                                               float_bits(kv->k_scale), float_bits(kv->v_scale), ptr_bits(rows.pos),
                                               rows.n, n_seqs, kv->block_size, kv->n_kv_heads, kv->head_dim, n_heads,
                                               float_bits(scale), c->g_splits})))
                st = tsr_cuda_attention(c->stream, out, static_cast<float *>(c->attn.p), c->attn.cap, q, kv->k, kv->v,
                                        kv->dtype, kv->k_scale, kv->v_scale, rows,
                                        c->g_state == GRAPH_OFF ? host : NULL, c->g_splits, kv->block_size,
                                        kv->n_kv_heads, kv->head_dim, n_heads, scale);
        free(host);
        return st;
}

static tsr_status cuda_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                 size_t past_len, size_t n_heads, float scale) {
        if (!kv)
                return TSR_E_INVAL;
        tsr_kv_seq one = {kv->block_table, kv->n_table, n, past_len};
        return cuda_attention_batch(be, out, q, kv, &one, 1, n_heads, scale);
}

static tsr_status cuda_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n) {
        if (!out || !gate || !up)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_SILU_MUL, {ptr_bits(out), ptr_bits(gate), ptr_bits(up), n})))
                return st;
        return tsr_cuda_silu_mul(ctx_of(be)->stream, out, gate, up, n);
}

// The row ops' host arrays on the device: idx and scales (either NULL: none), queued on the
// stream.  Eager only: a graph run refuses them (no family records them in one yet; their
// arrays have no staging kind).
static tsr_status row_op_arrays(tsr_backend *be, const uint32_t *idx, const float *scales, size_t n,
                                const uint32_t **didx, const float **dscales) {
        cuda_ctx *c = ctx_of(be);
        const uint32_t *ds = NULL;
        *didx = NULL;
        *dscales = NULL;
        if (c->g_state != GRAPH_OFF)
                return TSR_E_UNSUPPORTED;
        tsr_status st = use_device(be);
        if (st == TSR_OK && idx)
                st = upload_indices(c, &c->gather, idx, n, didx);
        if (st == TSR_OK && scales)
                st = upload_indices(c, &c->scales, reinterpret_cast<const uint32_t *>(scales), n, &ds);
        *dscales = reinterpret_cast<const float *>(ds);
        return st;
}

static tsr_status cuda_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                   const uint32_t *idx, const float *scales, size_t n) {
        const uint32_t *didx;
        const float *dscales;
        (void)rows;
        tsr_status st = row_op_arrays(be, idx, scales, n, &didx, &dscales);
        return st != TSR_OK ? st : tsr_cuda_gather_rows(ctx_of(be)->stream, out, x, didx, dscales, n, dim);
}

static tsr_status cuda_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                        const uint32_t *idx, const float *scales, size_t n) {
        const uint32_t *didx;
        const float *dscales;
        (void)rows;
        tsr_status st = row_op_arrays(be, idx, scales, n, &didx, &dscales);
        return st != TSR_OK ? st : tsr_cuda_scatter_add_rows(ctx_of(be)->stream, dst, src, didx, dscales, n, dim);
}

static tsr_status cuda_relu_sq(tsr_backend *be, float *x, size_t n) {
        if (ctx_of(be)->g_state != GRAPH_OFF)
                return TSR_E_UNSUPPORTED;       // eager only, as the row ops
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_relu_sq(ctx_of(be)->stream, x, n);
}

static tsr_status cuda_round_bf16(tsr_backend *be, float *x, size_t n) {
        if (ctx_of(be)->g_state != GRAPH_OFF)
                return TSR_E_UNSUPPORTED;
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_round_bf16(ctx_of(be)->stream, x, n);
}

// The mixer's host arrays as mamba.cu takes them (ops.cuh), in one upload: the sequence
// table, each row's sequence, the saves.  Eager only (no family records it in a graph).
static tsr_status cuda_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                                   const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                                   const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves,
                                   size_t n_leaves) {
        cuda_ctx *c = ctx_of(be);
        (void)n_slots;
        if (c->g_state != GRAPH_OFF)
                return TSR_E_UNSUPPORTED;
        if (rows > UINT32_MAX || n_seqs > UINT32_MAX)
                return TSR_E_LIMIT;
        size_t n_saves = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                if (seqs[i].past_len + seqs[i].n > UINT32_MAX)
                        return TSR_E_LIMIT;
                n_saves += seqs[i].n_saves;
        }
        size_t words = n_seqs * TSR_CUDA_MAMBA_SEQ_WORDS + rows + 2 * n_saves;
        uint32_t *h = static_cast<uint32_t *>(malloc(words * sizeof *h));
        if (!h)
                return TSR_E_NOMEM;
        uint32_t *row_seq = h + n_seqs * TSR_CUDA_MAMBA_SEQ_WORDS, *sv = row_seq + rows;
        for (size_t r = 0; r < rows; r++)       // rows of no sequence: left as they are
                row_seq[r] = TSR_CUDA_MAMBA_NO_SEQ;
        for (size_t i = 0, k = 0; i < n_seqs; i++) {
                const tsr_mamba_seq *q = &seqs[i];
                uint32_t *e = h + i * TSR_CUDA_MAMBA_SEQ_WORDS;
                e[TSR_CUDA_MAMBA_ROW] = (uint32_t)q->row;
                e[TSR_CUDA_MAMBA_N] = (uint32_t)q->n;
                e[TSR_CUDA_MAMBA_PAST] = (uint32_t)q->past_len;
                e[TSR_CUDA_MAMBA_SLOT] = q->slot;
                e[TSR_CUDA_MAMBA_SAVE_FIRST] = (uint32_t)k;
                e[TSR_CUDA_MAMBA_N_SAVES] = (uint32_t)q->n_saves;
                for (size_t t = 0; t < q->n; t++)
                        row_seq[q->row + t] = (uint32_t)i;
                for (size_t j = 0; j < q->n_saves; j++, k++) {
                        sv[2 * k] = q->saves[j].pos;
                        sv[2 * k + 1] = q->saves[j].slot;
                }
        }
        const uint32_t *dev = NULL;
        size_t cd = d->heads * d->head_dim + 2 * d->groups * d->state;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = upload_indices(c, &c->mamba, h, words, &dev);
        free(h);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->mamba_work, rows * (cd + d->heads) * sizeof(float));
        if (st != TSR_OK)
                return st;
        tsr_cuda_mamba_shape shape = {d->heads, d->head_dim, d->state, d->groups, d->conv_kernel, n_leaves,
                                      d->eps, d->dt_min, d->dt_max};
        return tsr_cuda_mamba_mixer(c->stream, &shape, w, proj, rows, conv, ssm, dev, n_seqs,
                                    dev + n_seqs * TSR_CUDA_MAMBA_SEQ_WORDS,
                                    dev + n_seqs * TSR_CUDA_MAMBA_SEQ_WORDS + rows, y, leaves,
                                    static_cast<float *>(c->mamba_work.p));
}

static tsr_status cuda_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        if (!out || !a || !b)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st != TSR_OK || !graph_op(ctx_of(be), sig_of(SIG_ADD, {ptr_bits(out), ptr_bits(a), ptr_bits(b), n})))
                return st;
        return tsr_cuda_add(ctx_of(be)->stream, out, a, b, n);
}

static tsr_status softmax_any(tsr_backend *be, float *out, const float *x, size_t rows, size_t n, bool log_out) {
        if (!out || !x || n == 0 || n > INT_MAX || rows > INT_MAX)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st != TSR_OK ||
            !graph_op(ctx_of(be), sig_of(SIG_SOFTMAX, {ptr_bits(out), ptr_bits(x), rows, n, (uint64_t)log_out})))
                return st;
        return tsr_cuda_softmax(ctx_of(be)->stream, out, x, rows, n, log_out);
}

static tsr_status cuda_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return softmax_any(be, out, x, rows, n, false);
}

static tsr_status cuda_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return softmax_any(be, out, x, rows, n, true);
}

// The rows' argmax into the scratch, then their rows * 4 bytes to the host (waits).
static tsr_status cuda_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        cuda_ctx *c = ctx_of(be);
        if (rows > INT_MAX || c->g_state != GRAPH_OFF)  // a host result: not in a graph run
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->argmax, rows * sizeof(uint32_t));
        if (st == TSR_OK)
                st = tsr_cuda_argmax(c->stream, static_cast<uint32_t *>(c->argmax.p), x, rows, n);
        return st != TSR_OK ? st : cuda_download(be, out, c->argmax.p, rows * sizeof(uint32_t));
}

// The draws up, the rows drawn into the scratch, their tokens down (waits).
static tsr_status cuda_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        cuda_ctx *c = ctx_of(be);
        if (rows > INT_MAX || c->g_state != GRAPH_OFF)  // a host result: not in a graph run
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->argmax, rows * sizeof(uint32_t));
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->draws, rows * sizeof(tsr_draw));
        if (st == TSR_OK)
                st = cuda_upload(be, c->draws.p, draws, rows * sizeof(tsr_draw));
        if (st == TSR_OK)
                st = tsr_cuda_sample(c->stream, static_cast<uint32_t *>(c->argmax.p), x, rows, n,
                                     static_cast<const tsr_draw *>(c->draws.p));
        return st != TSR_OK ? st : cuda_download(be, out, c->argmax.p, rows * sizeof(uint32_t));
}

// n 4-byte words from src (NULL when n is 0: memcpy's arguments may not be).
static void copy_words(uint32_t *dst, const void *src, size_t n) {
        if (n)
                memcpy(dst, src, n * sizeof(uint32_t));
}

// The rules packed as ops.cuh lays them out (a header per row, then the lists, then a
// float per allowed id for the kernel to keep its value in), up in one copy; the rows
// changed on the stream.  The host buffer is freed once the copy is done (it waits).
static tsr_status cuda_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules) {
        cuda_ctx *c = ctx_of(be);
        if (rows > INT_MAX || c->g_state != GRAPH_OFF)  // host lists: not in a graph run
                return TSR_E_INVAL;
        size_t words = rows * TSR_CUDA_RULE_WORDS, kept = 0;
        for (size_t r = 0; r < rows; r++) {
                const tsr_logit_rules *q = &rules[r];
                words += (size_t)q->n_allowed + q->n_masked + 2 * (size_t)q->n_bias + 2 * (size_t)q->n_pen;
                kept += q->n_allowed;
        }
        if (words + kept > UINT32_MAX)
                return TSR_E_INVAL;
        uint32_t *pack = static_cast<uint32_t *>(malloc((words + kept) * sizeof(uint32_t)));
        if (!pack)
                return TSR_E_NOMEM;
        uint32_t at = (uint32_t)(rows * TSR_CUDA_RULE_WORDS), at_kept = 0;
        for (size_t r = 0; r < rows; r++) {
                const tsr_logit_rules *q = &rules[r];
                uint32_t *h = pack + r * TSR_CUDA_RULE_WORDS;
                // the lists at word offsets (the headers come first), the row's kept
                // values at a float offset into the kept area
                h[TSR_CUDA_RULE_ALLOWED] = at;
                h[TSR_CUDA_RULE_N_ALLOWED] = q->n_allowed;
                h[TSR_CUDA_RULE_KEPT] = at_kept;
                copy_words(pack + at, q->allowed, q->n_allowed);
                at += q->n_allowed;
                at_kept += q->n_allowed;
                h[TSR_CUDA_RULE_MASKED] = at;
                h[TSR_CUDA_RULE_N_MASKED] = q->n_masked;
                copy_words(pack + at, q->masked, q->n_masked);
                at += q->n_masked;
                h[TSR_CUDA_RULE_BIAS] = at;
                h[TSR_CUDA_RULE_N_BIAS] = q->n_bias;
                copy_words(pack + at, q->bias_ids, q->n_bias);
                copy_words(pack + at + q->n_bias, q->bias, q->n_bias);
                at += 2 * q->n_bias;
                h[TSR_CUDA_RULE_PEN] = at;
                h[TSR_CUDA_RULE_N_PEN] = q->n_pen;
                copy_words(pack + at, q->pen_ids, q->n_pen);
                copy_words(pack + at + q->n_pen, q->pen_counts, q->n_pen);
                at += 2 * q->n_pen;
                memcpy(&h[TSR_CUDA_RULE_REP], &q->repetition, sizeof(float));
                memcpy(&h[TSR_CUDA_RULE_FREQ], &q->frequency, sizeof(float));
                memcpy(&h[TSR_CUDA_RULE_PRES], &q->presence, sizeof(float));
        }
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->rules, (words + kept) * sizeof(uint32_t));
        if (st == TSR_OK)
                st = cuda_upload(be, c->rules.p, pack, words * sizeof(uint32_t));
        free(pack);
        uint32_t *dev = static_cast<uint32_t *>(c->rules.p);
        if (st == TSR_OK)
                st = tsr_cuda_logit_rules(c->stream, x, rows, n, dev, dev, reinterpret_cast<float *>(dev + words));
        return st;
}

// The tokens and top counts up, the rows' results down (waits); a skipped row's place in
// out stays as it was.
static tsr_status cuda_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                                const uint32_t *tokens, const uint32_t *top) {
        cuda_ctx *c = ctx_of(be);
        if (rows > INT_MAX || c->g_state != GRAPH_OFF)  // host results: not in a graph run
                return TSR_E_INVAL;
        size_t idx_bytes = 2 * rows * sizeof(uint32_t), res_bytes = rows * sizeof(tsr_row_logprobs);
        idx_bytes = (idx_bytes + 15) / 16 * 16;
        tsr_row_logprobs *res = static_cast<tsr_row_logprobs *>(malloc(res_bytes));
        uint32_t *idx = static_cast<uint32_t *>(malloc(2 * rows * sizeof(uint32_t)));
        tsr_status st = res && idx ? use_device(be) : TSR_E_NOMEM;
        if (st == TSR_OK) {
                memcpy(idx, tokens, rows * sizeof(uint32_t));
                memcpy(idx + rows, top, rows * sizeof(uint32_t));
                st = scratch_reserve(c, &c->lp, idx_bytes + res_bytes);
        }
        char *dev = static_cast<char *>(c->lp.p);
        if (st == TSR_OK)
                st = cuda_upload(be, dev, idx, 2 * rows * sizeof(uint32_t));
        if (st == TSR_OK)
                st = tsr_cuda_logprobs(c->stream, reinterpret_cast<tsr_row_logprobs *>(dev + idx_bytes), x, rows, n,
                                       reinterpret_cast<const uint32_t *>(dev),
                                       reinterpret_cast<const uint32_t *>(dev) + rows);
        if (st == TSR_OK)
                st = cuda_download(be, res, dev + idx_bytes, res_bytes);
        for (size_t r = 0; st == TSR_OK && r < rows; r++)
                if (tokens[r] < n)
                        out[r] = res[r];
        free(res);
        free(idx);
        return st;
}

// ---- graphs (kernels.h) ------------------------------------------------------------------

// Staging of at least `bytes`: a pinned host buffer and its device copy.  Every recorded
// graph reads the old device copy, so they all go.  Outside a graph run.
static tsr_status stage_grow(cuda_ctx *c, size_t bytes) {
        graphs_drop(c);
        if (c->stage_pending) {
                TSR_CUDA_TRY(cudaEventSynchronize(c->stage_done));
                c->stage_pending = false;
        }
        (void)cudaFreeHost(c->stage_host);
        c->stage_host = NULL;
        c->stage_dev.cap = 0;           // scratch_reserve frees the old device copy
        void *h = NULL;
        cudaError_t e = cudaHostAlloc(&h, bytes, cudaHostAllocDefault);
        if (e != cudaSuccess) {
                (void)cudaGetLastError();
                return TSR_E_NOMEM;
        }
        c->stage_host = static_cast<unsigned char *>(h);
        return scratch_reserve(c, &c->stage_dev, bytes);
}

static tsr_status cuda_graph_begin(tsr_backend *be, uint64_t key, tsr_graph_mode mode, uint32_t table_width,
                                   uint32_t max_len) {
        cuda_ctx *c = ctx_of(be);
        if (c->g_state != GRAPH_OFF || table_width == 0 || max_len == 0)
                return TSR_E_INVAL;
        unsigned splits = tsr_cuda_attention_splits(max_len);
        cuda_graph *g = graph_find(c, key, splits);
        if (mode == TSR_GRAPH_REPLAY && !g)
                return TSR_E_NOTFOUND;
        tsr_status st = use_device(be);
        if (st == TSR_OK && !c->stage_done)
                TSR_CUDA_TRY(cudaEventCreateWithFlags(&c->stage_done, cudaEventDisableTiming));
        if (st == TSR_OK && !c->stage_host)
                st = stage_grow(c, (size_t)1 << 20);
        if (st != TSR_OK)
                return st;
        if (c->stage_pending) {         // the last launch's copy up still reads the staging
                TSR_CUDA_TRY(cudaEventSynchronize(c->stage_done));
                c->stage_pending = false;
        }
        c->g_key = key;
        c->g_width = table_width;
        c->g_splits = splits;
        c->g_op = 0;
        c->g_failed = false;
        c->g_used = 0;
        c->g_need = 0;
        c->g_n_sigs = 0;
        memset(c->g_last, 0, sizeof c->g_last);
        c->g_replay = g;
        if (mode == TSR_GRAPH_CAPTURE)
                TSR_CUDA_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
        c->g_state = mode == TSR_GRAPH_CAPTURE ? GRAPH_CAPTURE : GRAPH_REPLAY;
        return TSR_OK;
}

// A capture's end: the graph instantiated and kept under the run's key, or (failed) no
// graph of that key.  Whether it is kept.
static bool capture_end(cuda_ctx *c) {
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        bool ok = !c->g_failed;
        if (cudaStreamEndCapture(c->stream, &graph) != cudaSuccess) {   // an op the capture refused
                (void)cudaGetLastError();
                ok = false;
        }
        if (ok && cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
                (void)cudaGetLastError();
                ok = false;
        }
        if (graph)
                (void)cudaGraphDestroy(graph);
        cuda_graph *g = graph_find(c, c->g_key, c->g_splits);
        if (g) {                        // the key's old recording goes either way
                graph_free(g);
                *g = c->graphs[--c->n_graphs];
        }
        if (ok && c->n_graphs == GRAPH_CAP) {   // full: the one replayed longest ago goes
                size_t lru = 0;
                for (size_t i = 1; i < c->n_graphs; i++)
                        lru = c->graphs[i].last_use < c->graphs[lru].last_use ? i : lru;
                graph_free(&c->graphs[lru]);
                c->graphs[lru] = c->graphs[--c->n_graphs];
        }
        if (ok && c->n_graphs == c->cap_graphs) {
                size_t cap = c->cap_graphs ? 2 * c->cap_graphs : 16;
                cuda_graph *p = static_cast<cuda_graph *>(realloc(c->graphs, cap * sizeof *p));
                if (p) {
                        c->graphs = p;
                        c->cap_graphs = cap;
                } else {
                        ok = false;
                }
        }
        if (!ok) {
                if (exec)
                        (void)cudaGraphExecDestroy(exec);
                return false;
        }
        c->graphs[c->n_graphs++] = cuda_graph{c->g_key, c->g_splits, c->g_clock, exec, c->g_sigs, c->g_n_sigs,
                                              c->g_used};
        c->g_sigs = NULL;               // the graph owns them now
        c->g_n_sigs = c->g_cap_sigs = 0;
        return true;
}

static tsr_status cuda_graph_end(tsr_backend *be, bool launch, bool *launched) {
        cuda_ctx *c = ctx_of(be);
        if (c->g_state == GRAPH_OFF)
                return TSR_E_INVAL;
        bool capture = c->g_state == GRAPH_CAPTURE;
        c->g_state = GRAPH_OFF;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        bool ok = capture ? capture_end(c) : !c->g_failed && c->g_op == c->g_replay->n_sigs;
        if (c->g_need > c->stage_dev.cap)       // for the next run (drops every graph)
                return stage_grow(c, 2 * c->g_need);
        if (!ok || !launch)
                return TSR_OK;
        cuda_graph *g = graph_find(c, c->g_key, c->g_splits);
        g->last_use = ++c->g_clock;
        if (g->staged)
                TSR_CUDA_TRY(cudaMemcpyAsync(c->stage_dev.p, c->stage_host, g->staged, cudaMemcpyHostToDevice,
                                             c->stream));
        TSR_CUDA_TRY(cudaGraphLaunch(g->exec, c->stream));
        TSR_CUDA_TRY(cudaEventRecord(c->stage_done, c->stream));
        c->stage_pending = true;
        *launched = true;
        return TSR_OK;
}

static bool cuda_graph_has(tsr_backend *be, uint64_t key, uint32_t max_len) {
        return graph_find(ctx_of(be), key, tsr_cuda_attention_splits(max_len ? max_len : 1)) != NULL;
}

static void cuda_graph_drop(tsr_backend *be) {
        if (ctx_of(be)->g_state == GRAPH_OFF && use_device(be) == TSR_OK)
                graphs_drop(ctx_of(be));
}

// Built by assignment: C++17 has no designated initialisers.
static tsr_backend_ops make_cuda_ops(void) {
        tsr_backend_ops o = {};
        o.name = "cuda";
        o.host_memory = false;
        o.matmul_dtypes = 1u << TSR_DTYPE_F32 | 1u << TSR_DTYPE_BF16 | TSR_FPMM_DTYPES;
        o.ctx_free = cuda_ctx_free;
        o.mem_alloc = cuda_mem_alloc;
        o.mem_free = cuda_mem_free;
        o.upload = cuda_upload;
        o.download = cuda_download;
        o.copy = cuda_copy_d2d;
        o.zero = cuda_zero;
        o.mem_info = cuda_mem_info;
        o.synchronize = cuda_synchronize;
        o.graph_begin = cuda_graph_begin;
        o.graph_end = cuda_graph_end;
        o.graph_has = cuda_graph_has;
        o.graph_drop = cuda_graph_drop;
        o.rmsnorm = cuda_rmsnorm;
        o.embedding = cuda_embedding;
        o.matmul = cuda_matmul;
        o.matmul_scaled = cuda_matmul_scaled;
        o.rope = cuda_rope;
        o.kv_write = cuda_kv_write;
        o.attention = cuda_attention;
        o.kv_write_batch = cuda_kv_write_batch;
        o.attention_batch = cuda_attention_batch;
        o.silu_mul = cuda_silu_mul;
        o.add = cuda_add;
        o.gather_rows = cuda_gather_rows;
        o.scatter_add_rows = cuda_scatter_add_rows;
        o.relu_sq = cuda_relu_sq;
        o.round_bf16 = cuda_round_bf16;
        o.mamba_mixer = cuda_mamba_mixer;
        o.softmax = cuda_softmax;
        o.log_softmax = cuda_log_softmax;
        o.argmax = cuda_argmax;
        o.sample = cuda_sample;
        o.logit_rules = cuda_logit_rules;
        o.logprobs = cuda_logprobs;
        o.add_rmsnorm = cuda_add_rmsnorm;
        return o;
}

static const tsr_backend_ops cuda_ops = make_cuda_ops();

// The stream and the cuBLAS handle of a new context on the current device.  Default math
// (no TF32: results are compared with float32 CPU ones); the handle queues on our stream.
static tsr_status ctx_init(cuda_ctx *c) {
        TSR_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
        TSR_CUBLAS_TRY(cublasCreate(&c->blas));
        TSR_CUBLAS_TRY(cublasSetStream(c->blas, c->stream));
        TSR_CUBLAS_TRY(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH));
        // A workspace of our own (after cublasSetStream, which resets it): the same one in
        // and out of a graph capture, which then allocates nothing (32 MiB, PyTorch's for
        // Hopper).
        TSR_CUDA_TRY(cudaMalloc(&c->blas_ws, CUBLAS_WORKSPACE_BYTES));
        TSR_CUBLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, CUBLAS_WORKSPACE_BYTES));
        // cuBLASLt shares the workspace: both queue on the one stream, one call at a time.
        // Without it (its own line on stderr) the fp8 matmuls run the exact kernels.
        const char *mode = getenv("TESSERA_CUDA_FPMM");
        c->fpmm_exact = mode && strcmp(mode, "exact") == 0;
        if (tsr_cuda_fpmm_lt_new(c->blas_ws, CUBLAS_WORKSPACE_BYTES, &c->lt) != TSR_OK)
                c->lt = NULL;
        return TSR_OK;
}

extern "C" void tsr_backend_cuda_fpmm_counts(const tsr_backend *be, uint64_t *cublaslt, uint64_t *exact) {
        bool cuda = be && be->ops == &cuda_ops;
        tsr_cuda_fpmm_lt_counts(cuda ? static_cast<const cuda_ctx *>(be->ctx)->lt : NULL, cublaslt, exact);
}

extern "C" tsr_status tsr_backend_cuda_new(int device, tsr_backend **ret) {
        int n = 0;
        if (!ret || device < 0)
                return TSR_E_INVAL;
        // Any failure to count devices (no driver, no device, a driver too old for this
        // runtime) means no usable device here, as before the backend had a handle.
        if (cudaGetDeviceCount(&n) != cudaSuccess || device >= n) {
                (void)cudaGetLastError();
                return TSR_E_NOTFOUND;
        }
        TSR_CUDA_TRY(cudaSetDevice(device));
        cuda_ctx *c = static_cast<cuda_ctx *>(calloc(1, sizeof *c));
        if (!c)
                return TSR_E_NOMEM;
        c->device = device;
        tsr_status st = ctx_init(c);
        if (st != TSR_OK) {
                cuda_ctx_free(c);
                return st;
        }
        return tsr_backend_make(&cuda_ops, c, TSR_CPU_ISA_SCALAR, 1, ret);
}
