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
// Host index arrays (embedding's ids, rope's pos, a batch's rows and block tables) are
// copied to an index scratch with cudaMemcpyAsync on the stream just before the kernel
// that reads them.  From pageable memory (what callers have) that call returns once the
// source is staged, so the caller may reuse its array at once; the next op's copy into
// the same scratch is queued after this op's kernel, so it cannot overwrite indices still
// in use.  (A pinned source would be read by the DMA later: callers must not pass pinned
// arrays they reuse before a synchronize.)  Each kind of array has its own scratch, which
// remembers what it holds: a forward passes every layer the same positions and the same
// rows, so one step uploads each once instead of once per op and layer.
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>

#include "kernels/backend_impl.h"
#include "kernels/cpu/kv_view.h"        // kv_view_ok: the same view checks as the CPU backends
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/add_rmsnorm.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/rmsnorm.cuh"

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

struct cuda_ctx {
        int device;
        cudaStream_t stream;
        cublasHandle_t blas;
        cuda_index_scratch ids;         // embedding's token ids
        cuda_index_scratch pos;         // rope's positions
        cuda_index_scratch rows;        // kv_write's and attention's rows (upload_rows)
        cuda_scratch act;       // a bf16 matmul's rounded activations
        cuda_scratch attn;      // attention's per-run records (attention.cu's split over the keys)
        cuda_scratch argmax;    // argmax's (and sample's) row results before their download
        cuda_scratch draws;     // sample's per-row parameters
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
static tsr_status upload_indices(cuda_ctx *c, cuda_index_scratch *x, const uint32_t *a, size_t count,
                                 const uint32_t **dev) {
        size_t bytes = count * sizeof *a;
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

static void cuda_ctx_free(void *ctx) {
        cuda_ctx *c = static_cast<cuda_ctx *>(ctx);
        if (!c)
                return;
        if (cudaSetDevice(c->device) == cudaSuccess) {
                if (c->stream)
                        (void)cudaStreamSynchronize(c->stream);
                if (c->blas)
                        (void)cublasDestroy(c->blas);
                index_scratch_free(&c->ids);
                index_scratch_free(&c->pos);
                index_scratch_free(&c->rows);
                (void)cudaFree(c->act.p);
                (void)cudaFree(c->attn.p);
                (void)cudaFree(c->argmax.p);
                (void)cudaFree(c->draws.p);
                if (c->stream)
                        (void)cudaStreamDestroy(c->stream);
        }
        free(c);
}

// ---- memory --------------------------------------------------------------------------

static tsr_status cuda_mem_alloc(tsr_backend *be, size_t bytes, void **ret) {
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
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        cudaStream_t s = ctx_of(be)->stream;
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

// cudaMemGetInfo of the backend's device: free and total bytes, other processes' use included.
static tsr_status cuda_mem_info(tsr_backend *be, size_t *free_bytes, size_t *total_bytes) {
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes));
        return TSR_OK;
}

static tsr_status cuda_synchronize(tsr_backend *be) {
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
        return st != TSR_OK ? st : tsr_cuda_rmsnorm(ctx_of(be)->stream, out, x, w, rows, dim, eps);
}

static tsr_status cuda_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps) {
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_add_rmsnorm(ctx_of(be)->stream, out, residual, x, w, rows, dim, eps);
}

static tsr_status cuda_embedding(tsr_backend *be, float *out, const float *table, size_t vocab, size_t dim,
                                 const uint32_t *ids, size_t rows) {
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
        return st != TSR_OK ? st : tsr_cuda_embedding(ctx_of(be)->stream, out, table, dim, dids, rows);
}

static tsr_status cuda_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                              size_t rows, size_t n, size_t d) {
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        if (w_dtype != TSR_DTYPE_F32 && w_dtype != TSR_DTYPE_BF16)
                return TSR_E_UNSUPPORTED;
        if (rows > INT_MAX || n > INT_MAX || d > INT_MAX) {     // cuBLAS takes int sizes
                fprintf(stderr, "cuda: matmul rows %zu n %zu d %zu: a size past INT_MAX is not supported\n", rows,
                        n, d);
                return TSR_E_UNSUPPORTED;
        }
        if (rows == 0)
                return TSR_OK;
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        cuda_ctx *c = ctx_of(be);
        if (w_dtype == TSR_DTYPE_F32)
                return tsr_cuda_matmul_f32(c->blas, out, x, static_cast<const float *>(w), rows, n, d);
        // bf16: round x to bf16 in the activation scratch (kernels.h's b()), then the GEMM.
        st = scratch_reserve(c, &c->act, rows * n * sizeof(uint16_t));
        if (st != TSR_OK)
                return st;
        uint16_t *xb = static_cast<uint16_t *>(c->act.p);
        st = tsr_cuda_f32_to_bf16(c->stream, xb, x, rows * n);
        return st != TSR_OK ? st
                            : tsr_cuda_matmul_bf16(c->blas, out, xb, static_cast<const uint16_t *>(w), rows, n, d);
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
        return st != TSR_OK ? st : tsr_cuda_rope(ctx_of(be)->stream, x, rows, n_heads, head_dim, dpos, inv_freq,
                                                 layout);
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
        size_t n = 0, entries = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                n += seqs[i].n;
                entries += (seqs[i].past_len + seqs[i].n + kv->block_size - 1) / kv->block_size;
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
                for (size_t e = 0; e < used; e++)
                        h[off + e] = seqs[i].block_table[e];
                off += used;
        }
        const uint32_t *d = NULL;
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = upload_indices(ctx_of(be), &ctx_of(be)->rows, h, off, &d);
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
        return st != TSR_OK ? st
                            : tsr_cuda_kv_write(ctx_of(be)->stream, kv->k, kv->v, kv->dtype, kv->k_scale,
                                                kv->v_scale, rows, kv->block_size, kv->n_kv_heads * kv->head_dim, k,
                                                v);
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
        if (st == TSR_OK)
                st = tsr_cuda_attention(c->stream, out, static_cast<float *>(c->attn.p), c->attn.cap, q, kv->k, kv->v,
                                        kv->dtype, kv->k_scale, kv->v_scale, rows, host, kv->block_size,
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
        return st != TSR_OK ? st : tsr_cuda_silu_mul(ctx_of(be)->stream, out, gate, up, n);
}

static tsr_status cuda_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        if (!out || !a || !b)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_add(ctx_of(be)->stream, out, a, b, n);
}

static tsr_status softmax_any(tsr_backend *be, float *out, const float *x, size_t rows, size_t n, bool log_out) {
        if (!out || !x || n == 0 || n > INT_MAX || rows > INT_MAX)
                return TSR_E_INVAL;
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_softmax(ctx_of(be)->stream, out, x, rows, n, log_out);
}

static tsr_status cuda_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return softmax_any(be, out, x, rows, n, false);
}

static tsr_status cuda_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return softmax_any(be, out, x, rows, n, true);
}

// The rows' argmax into the scratch, then their rows * 4 bytes to the host (waits).
static tsr_status cuda_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        if (rows > INT_MAX)
                return TSR_E_INVAL;
        cuda_ctx *c = ctx_of(be);
        tsr_status st = use_device(be);
        if (st == TSR_OK)
                st = scratch_reserve(c, &c->argmax, rows * sizeof(uint32_t));
        if (st == TSR_OK)
                st = tsr_cuda_argmax(c->stream, static_cast<uint32_t *>(c->argmax.p), x, rows, n);
        return st != TSR_OK ? st : cuda_download(be, out, c->argmax.p, rows * sizeof(uint32_t));
}

// The draws up, the rows drawn into the scratch, their tokens down (waits).
static tsr_status cuda_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        if (rows > INT_MAX)
                return TSR_E_INVAL;
        cuda_ctx *c = ctx_of(be);
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

// Built by assignment: C++17 has no designated initialisers.  matmul_scaled stays NULL
// (fp8/nvfp4 kernels come later: kernels.h's TSR_E_UNSUPPORTED).
static tsr_backend_ops make_cuda_ops(void) {
        tsr_backend_ops o = {};
        o.name = "cuda";
        o.host_memory = false;
        o.matmul_dtypes = 1u << TSR_DTYPE_F32 | 1u << TSR_DTYPE_BF16;
        o.ctx_free = cuda_ctx_free;
        o.mem_alloc = cuda_mem_alloc;
        o.mem_free = cuda_mem_free;
        o.upload = cuda_upload;
        o.download = cuda_download;
        o.copy = cuda_copy_d2d;
        o.mem_info = cuda_mem_info;
        o.synchronize = cuda_synchronize;
        o.rmsnorm = cuda_rmsnorm;
        o.embedding = cuda_embedding;
        o.matmul = cuda_matmul;
        o.rope = cuda_rope;
        o.kv_write = cuda_kv_write;
        o.attention = cuda_attention;
        o.kv_write_batch = cuda_kv_write_batch;
        o.attention_batch = cuda_attention_batch;
        o.silu_mul = cuda_silu_mul;
        o.add = cuda_add;
        o.softmax = cuda_softmax;
        o.log_softmax = cuda_log_softmax;
        o.argmax = cuda_argmax;
        o.sample = cuda_sample;
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
        return TSR_OK;
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
