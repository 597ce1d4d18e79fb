/* kernels.h - the operator interface the forward pass is written against.
 *
 * A backend is an object with a handle (tsr_backend *), in the style of ggml's backend
 * interface: one per device or per CPU thread pool, created by tsr_backend_cpu_new,
 * tsr_backend_cpu_ref_new or tsr_backend_cuda_new and freed by tsr_backend_free.  Every
 * operator takes the backend first; so do memory (alloc/free, upload/download) and
 * synchronize.  A backend holds all of its state (thread pool, ISA, device ordinal):
 * kernels/ keeps no mutable state of its own but each thread's scratch buffer (cpu/pool.h
 * tsr_thread_scratch, which no two calls hold at once), so two backends (tensor-parallel
 * ranks as threads of one worker, two engines in one test) run side by side in one process.
 *
 * cpu/ref.c is the specification: scalar, plain, with shape comments.  Fast CPU paths
 * and CUDA kernels are judged against it (tests/kernels).  Functions return a tsr_status
 * and never exit or abort on bad input: NULL pointers and zero or inconsistent sizes
 * are TSR_E_INVAL, an op or weight dtype the backend does not implement is
 * TSR_E_UNSUPPORTED, and an op that fails writes nothing -- but for TSR_E_NOMEM from a
 * fast CPU op whose thread could not grow its scratch mid-run, which may leave the
 * output partly written (no op's output is also its input, so only the output is lost).
 *
 * Activations are float32, row-major, in the backend's memory (host for cpu, device for
 * cuda; tsr_backend_mem_alloc gives such memory).  Shapes are written (rows, cols) with
 * the last index varying fastest.  Weights of a matmul come in one of tsr_dtype's
 * formats; the backend picks the kernel for the format (a new format is a new kernel
 * behind tsr_backend_matmul, not a new entry point).
 *
 * Batch invariance: every op computes each row of its output from that row's inputs
 * alone, with one fixed reduction order per output element (no split-K, no blocking
 * that depends on the number of rows).  A row's result is therefore bitwise the same
 * whether it is computed alone or among other rows; tests enforce this.
 *
 * Threads: a backend is driven by one thread at a time (the engine thread, or one rank's
 * thread); its ops may use the backend's own helper threads.  Different backends may be
 * driven from different threads at once.  Creating and freeing: any thread, while no op
 * of that backend runs.
 *
 * Why an opaque struct with functions rather than a visible { ops, ctx } pair: the
 * operator table (kernels/backend_impl.h) stays private to kernels/, so adding an op or
 * a weight format changes no caller; the wrappers here check the handle and answer
 * TSR_E_UNSUPPORTED for an op a backend lacks instead of every caller testing a NULL
 * slot; and the handle's queries (name, ISA, threads) are plain reads of fields set at
 * creation.  The price is one direct call per op on top of the indirect one, nothing
 * next to a kernel's run time. */
#ifndef TSR_KERNELS_H
#define TSR_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How RoPE pairs the dimensions of one head of size d (models.md §0).
 * NEOX ("rotate_half", HF Llama): dimension i rotates with i + d/2.
 * INTERLEAVED (GPT-J, Meta and GGUF Llama checkpoints): dimension 2i rotates with 2i+1.
 * Pair i turns by pos * inv_freq[i] in both layouts. */
typedef enum tsr_rope_layout {
        TSR_ROPE_NEOX = 0,
        TSR_ROPE_INTERLEAVED = 1,
} tsr_rope_layout;

/* Where one layer of one sequence's cached keys and values live: vLLM's paged layout.
 * Token t of the sequence is row (t % block_size) of block block_table[t / block_size];
 * a row holds n_kv_heads * head_dim elements of `dtype` (head-major).  A contiguous
 * cache is the special case of one block of block_size >= the sequence length and
 * table {0}.  K is stored after RoPE.
 *
 * dtype TSR_DTYPE_F32 (0, what a zeroed view has): k and v hold floats as they are.
 * dtype TSR_DTYPE_FP8_E4M3 (--kv-cache-dtype fp8, models.md §4.5): k8 and v8 hold one
 * e4m3fn byte per element; kv_write stores e4m3(k / k_scale) (round to nearest even,
 * saturating at +-448: tsr_f32_to_fp8_e4m3) and attention reads float(code) * k_scale
 * (a float32 product), V the same with v_scale; the scores, softmax and P.V are then
 * the float32 ones on those values.  Scales finite and > 0; unused for f32.  Every
 * backend: the CPU ones and CUDA store the same codes (bitwise).
 * dtype TSR_DTYPE_FP8_E5M2 (--kv-cache-dtype fp8_e5m2): the same with e5m2 codes,
 * saturating at +-57344 (tsr_f32_to_fp8_e5m2_sat, vLLM's __NV_SATFINITE store); the CPU
 * backends only (CUDA answers TSR_E_UNSUPPORTED).
 * dtype TSR_DTYPE_BF16 (--kv-cache-dtype bfloat16): k16 and v16 hold bfloat16 bits;
 * kv_write stores tsr_f32_to_bf16(k) (round to nearest even; no scale) and attention
 * reads them widened, then the float32 math as for f32.  The CPU backends only. */
typedef struct tsr_kv_view {
        union {
                float *k;               /* (n_blocks, block_size, n_kv_heads, head_dim) */
                uint8_t *k8;            /* the same shape, fp8 */
                uint16_t *k16;          /* the same shape, bf16 */
        };
        union {
                float *v;               /* (n_blocks, block_size, n_kv_heads, head_dim) */
                uint8_t *v8;
                uint16_t *v16;
        };
        tsr_dtype dtype;                /* TSR_DTYPE_F32, _FP8_E4M3, _FP8_E5M2 or _BF16 */
        float k_scale, v_scale;         /* fp8 only */
        const uint32_t *block_table;    /* (n_table,) block ids, each < n_blocks; host memory */
        size_t n_table;                 /* entries in block_table */
        size_t n_blocks;                /* blocks the k and v arrays hold */
        size_t block_size;              /* token rows per block, >= 1 */
        size_t n_kv_heads;
        size_t head_dim;
} tsr_kv_view;

/* Weight formats of tsr_backend_matmul: tsr_dtype (kernels/dtype.h, with their block
 * sizes in tsr_dtype_info; layouts and scalar dequantization in kernels/quant/quant.h).
 * A backend has a matmul kernel for some of them (tsr_backend_supports): on the CPU
 * backends f32, bf16 and the GGUF blocks q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K,
 * and, with their per-tensor scales (tsr_backend_matmul_scaled), fp8_e4m3 and nvfp4; on
 * CUDA f32, bf16, fp8_e4m3 and nvfp4; each other dtype a later kernel behind the same
 * entry point. */

/* The CPU instruction set a CPU backend's kernels use. */
typedef enum tsr_cpu_isa {
        TSR_CPU_ISA_SCALAR = 0,         /* the reference functions (also: not a CPU backend) */
        TSR_CPU_ISA_AVX2 = 1,           /* 8-wide float32, no FMA (it would change rounding) */
        TSR_CPU_ISA_AVX512_BF16 = 2,    /* AVX2 float32 + AVX512_BF16 dot products for bf16 weights */
        TSR_CPU_ISA_AMX_BF16 = 3,       /* AVX512_BF16 + AMX tiles (TDPBF16PS) for the bf16 matmul and,
                                         * where the CPU has AMX-INT8, for the int8 matmul of the
                                         * 32-block GGUF formats from 32 activation rows; needs Linux's
                                         * grant of the tile state (arch_prctl) */
} tsr_cpu_isa;

/* "scalar", "avx2", "avx512_bf16", "amx_bf16"; "?" for a value out of range. */
const char *tsr_cpu_isa_name(tsr_cpu_isa isa);
/* The best ISA this CPU (and Linux's AMX grant) offers.  Any thread. */
tsr_cpu_isa tsr_cpu_isa_best(void);

typedef struct tsr_backend tsr_backend;

/* ---- creating and freeing ------------------------------------------------------------- */

/* The fast CPU backend (cpu/fast.c): SIMD kernels picked at run time (__builtin_cpu_supports;
 * AMX: CPUID and the Linux grant of the tile state) plus a thread pool of its own that
 * splits OUTPUT elements only (weight rows of a matmul, (row, head) pairs of attention),
 * so every float32 result is bitwise that of cpu/ref.c whatever the ISA, the thread count
 * or the batch (tests/kernels/test_cpu_fast.c).  Ops without a fast version are the
 * reference's.  The bf16 matmul follows its own fixed order on AVX512_BF16 and on AMX
 * (within the float32 summation error of the reference's) and is bitwise the reference's
 * elsewhere. */
/* The default kernel thread count: one per physical core this process may run on
 * (sched_getaffinity, each (package, core) counted once: SMT siblings share one core's
 * vector units); the allowed CPUs where Linux gives no topology.  Any thread. */
int tsr_cpu_default_threads(void);
/* The distinct (physical_package_id, core_id) pairs of cpus[0..n) under sysfs_cpu_root
 * (normally /sys/devices/system/cpu); n when a CPU's topology cannot be read. */
int tsr_cpu_cores_of(const int *cpus, size_t n, const char *sysfs_cpu_root);

typedef struct tsr_cpu_backend_config {
        int n_threads;          /* threads in all, the calling thread included; 0 = tsr_cpu_default_threads() */
        tsr_cpu_isa max_isa;    /* use at most this ISA (what the CPU lacks is never used) */
} tsr_cpu_backend_config;

/* A fast CPU backend with its own pool of cfg->n_threads - 1 helper threads (started
 * here, stopped by tsr_backend_free).  *ret written only on success.  TSR_E_INVAL for a
 * NULL argument or n_threads < 0; TSR_E_NOMEM when the backend or its threads cannot be
 * made (a caller may then retry with n_threads = 1, which starts no thread). */
tsr_status tsr_backend_cpu_new(const tsr_cpu_backend_config *cfg, tsr_backend **ret);
/* The scalar reference backend (cpu/ref.c): one thread, ISA scalar.  Always available;
 * TSR_E_NOMEM or TSR_E_INVAL only. */
tsr_status tsr_backend_cpu_ref_new(tsr_backend **ret);
/* The reference kernels behind a backend whose memory counts as a device's
 * (tsr_backend_host_memory false, name "cpu-devlike"), for tests: code with a device
 * path (the forward's tsr_llama_to_backend) runs it on a machine without a GPU.  The
 * memory is still the host's, so a host pointer passed where device memory belongs is
 * not caught here; the GPU suite catches that.  It has the graphs below too, as their
 * CPU reference (cpu/devlike.c: records replayed through the reference kernels). */
tsr_status tsr_backend_cpu_devlike_new(tsr_backend **ret);
/* A CUDA backend on device `device` (an ordinal): every call of this backend first makes
 * that device current on the calling thread.  TSR_E_UNSUPPORTED when CUDA is not built,
 * TSR_E_NOTFOUND when there is no such device, TSR_E_CUDA on a runtime error. */
tsr_status tsr_backend_cuda_new(int device, tsr_backend **ret);
/* The CUDA backend's fp8 / NVFP4 matmuls so far (tsr_backend_matmul_scaled): how many ran
 * as cuBLASLt's FP8 GEMM and how many on the exact kernels (kernels/cuda/fpmm.cuh).  Both
 * 0 for another backend.  TESSERA_CUDA_FPMM=exact in the environment when the backend is
 * made: the exact kernels only (bitwise cpu-ref's; the GPU suite compares both ways). */
void tsr_backend_cuda_fpmm_counts(const tsr_backend *be, uint64_t *cublaslt, uint64_t *exact);
/* Stop the backend's threads and free it; accepts NULL and *be == NULL, clears *be.
 * Memory from tsr_backend_mem_alloc must be freed before.  Not while an op runs. */
void tsr_backend_free(tsr_backend **be);

/* ---- queries: fixed at creation, any thread ------------------------------------------- */

/* "cpu-fast", "cpu-ref", "cuda". */
const char *tsr_backend_name(const tsr_backend *be);
/* The ISA a CPU backend runs (TSR_CPU_ISA_SCALAR for the reference and for CUDA). */
tsr_cpu_isa tsr_backend_cpu_isa(const tsr_backend *be);
/* Threads an op may use, the caller included (1 for the reference and for CUDA). */
int tsr_backend_threads(const tsr_backend *be);
/* True when the backend's memory is the host's (pointers from malloc work in its ops). */
bool tsr_backend_host_memory(const tsr_backend *be);
/* The ops the callers name when asking tsr_backend_supports. */
typedef enum tsr_op {
        TSR_OP_RMSNORM,
        TSR_OP_EMBEDDING,
        TSR_OP_MATMUL,          /* with a weight dtype */
        TSR_OP_ROPE,
        TSR_OP_KV_WRITE,
        TSR_OP_ATTENTION,
        TSR_OP_SILU_MUL,
        TSR_OP_ADD,
        TSR_OP_SOFTMAX,
        TSR_OP_LOG_SOFTMAX,
        TSR_OP_ADD_RMSNORM,
        TSR_OP_ARGMAX,
        TSR_OP_SAMPLE,
        TSR_OP_GATHER_ROWS,
        TSR_OP_SCATTER_ADD_ROWS,
        TSR_OP_RELU_SQ,
        TSR_OP_ROUND_BF16,
        TSR_OP_MAMBA_MIXER,
        TSR_OP_LOGIT_RULES,
        TSR_OP_LOGPROBS,
        TSR_OP_COUNT
} tsr_op;
/* Whether `op` runs on this backend; for TSR_OP_MATMUL, with weights of `w_dtype` (ignored
 * for the other ops).  False for a NULL backend. */
bool tsr_backend_supports(const tsr_backend *be, tsr_op op, tsr_dtype w_dtype);

/* ---- memory --------------------------------------------------------------------------- */

/* `bytes` of backend memory, 64-byte aligned, uninitialised.  *ret written only on
 * success.  TSR_E_NOMEM (TSR_E_CUDA for other CUDA errors), TSR_E_INVAL for bytes == 0. */
tsr_status tsr_backend_mem_alloc(tsr_backend *be, size_t bytes, void **ret);
/* Free memory from tsr_backend_mem_alloc of the same backend; NULL is a no-op. */
void tsr_backend_mem_free(tsr_backend *be, void *p);
/* Copy host -> backend memory (upload) and backend -> host memory (download): memcpy on
 * the CPU.  Synchronous: when they return, `src` may be reused (upload) and `dst` holds
 * the data, after all work queued on the backend before the call (download). */
tsr_status tsr_backend_upload(tsr_backend *be, void *dst, const void *src, size_t bytes);
tsr_status tsr_backend_download(tsr_backend *be, void *dst, const void *src, size_t bytes);
/* Copy backend -> backend memory (both from this backend; they must not overlap): memcpy
 * on the CPU, a device-to-device copy queued on the backend's stream on CUDA (ordered
 * with the ops; not waited for). */
tsr_status tsr_backend_copy(tsr_backend *be, void *dst, const void *src, size_t bytes);
/* Set `bytes` of backend memory at p to zero: memset on the CPU, queued on the stream on
 * CUDA (ordered with the ops; not waited for); refused inside a graph run. */
tsr_status tsr_backend_zero(tsr_backend *be, void *p, size_t bytes);
/* The backend's memory now free and in all, in bytes (CUDA: cudaMemGetInfo of its
 * device, other processes' use included).  TSR_E_UNSUPPORTED on the CPU backends, whose
 * memory is the host's (sized from the RAM by the caller). */
tsr_status tsr_backend_mem_info(tsr_backend *be, size_t *free_bytes, size_t *total_bytes);
/* Wait for all work queued on this backend (no-op on the CPU, whose ops return when done). */
tsr_status tsr_backend_synchronize(tsr_backend *be);

/* ---- graphs: record a run of ops once, replay it (CUDA graphs; issue #16) --------------
 * A caller that issues the same ops on the same memory step after step (a decode step of
 * one batch size) records them once and then replays them, paying the host's launch cost
 * once per step instead of once per op.  Between tsr_backend_graph_begin and
 * tsr_backend_graph_end every op checks its arguments as always (TSR_E_INVAL, ...) and
 * copies its host index arrays (ids, positions, rows and block tables) into the graph's
 * staging memory, but queues nothing:
 *  - TSR_GRAPH_CAPTURE records the ops as graph `key`, replacing any graph of that key;
 *  - TSR_GRAPH_REPLAY checks each op against graph `key`'s record: the same op with the
 *    same memory, sizes and scalars, index arrays of the same sizes (their values may
 *    differ: they are what changes from step to step).
 * In both, the kv ops' block tables are laid out `table_width` entries per sequence (a
 * fixed size whatever the sequences' lengths: a sequence with more blocks fails the
 * recording), and attention's launches are sized for the backend's length class of
 * `max_len` (the longest sequence of the step, in tokens): a graph is kept per key and
 * class, and serves the steps whose longest sequence is in its class (CUDA's class is the
 * number of key splits such a row gets: one per 128 keys up to 32; a row's result is the
 * bits of the same call outside a graph; a longer sequence fails the recording).  Not
 * allowed inside (TSR_E_INVAL): upload, download, synchronize, argmax, sample,
 * mem_alloc; mem_free must not free what a recorded op reads.
 * tsr_backend_graph_end(be, launch, &launched) leaves the mode.  When the capture
 * succeeded (or every replayed op matched) and `launch`, it queues the staged index
 * arrays' copy and the graph: *launched = true, and the work is ordered with the ops as
 * if issued one by one.  Otherwise nothing of the run was queued (*launched = false:
 * the caller issues the ops again outside a graph); a failed capture leaves no graph of
 * that key, a failed replay keeps its graph.  A capture without `launch` records only
 * (start-up).  TSR_E_UNSUPPORTED (begin): a backend without graphs, the CPU's.  Graphs
 * are the backend's: freed with it, or by tsr_backend_graph_drop (all); past 256 of them
 * recording one drops the one replayed longest ago.
 * One thread, the backend's (kernels.h). */
typedef enum tsr_graph_mode { TSR_GRAPH_CAPTURE, TSR_GRAPH_REPLAY } tsr_graph_mode;
tsr_status tsr_backend_graph_begin(tsr_backend *be, uint64_t key, tsr_graph_mode mode, uint32_t table_width,
                                   uint32_t max_len);
tsr_status tsr_backend_graph_end(tsr_backend *be, bool launch, bool *launched);
/* Whether graph `key` is recorded for the length class of max_len. */
bool tsr_backend_graph_has(tsr_backend *be, uint64_t key, uint32_t max_len);
void tsr_backend_graph_drop(tsr_backend *be);

/* ---- operators ------------------------------------------------------------------------ */

/* out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w[:]
 * x (rows, dim), w (dim,) -> out (rows, dim); out may alias x. */
tsr_status tsr_backend_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                               float eps);
/* out[r,:] = table[ids[r],:] as float32
 * table (vocab, dim) of `dtype`, float32 or bf16 (each element widened: exact), ids
 * (rows,) host memory -> out (rows, dim).  An id >= vocab is TSR_E_INVAL (checked before
 * anything is written); another dtype TSR_E_UNSUPPORTED. */
tsr_status tsr_backend_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                 size_t dim, const uint32_t *ids, size_t rows);
/* out[r,i] = sum_k w[i,k] * x[r,k]: W (d,n) @ x[r] (n,) -> out[r] (d,), for each row r.
 * x (rows, n) float32, w (d, n) in `w_dtype`, -> out (rows, d) float32.  rows == 1 is the
 * decode GEMV, rows > 1 the prefill GEMM; both use the same per-element reduction order.
 * out must not alias x or w.  A dtype the backend has no kernel for is TSR_E_UNSUPPORTED.
 *
 * TSR_DTYPE_F32: reference order (cpu/ref.c dot_f32); the fast CPU backend is bitwise it.
 * TSR_DTYPE_BF16: w holds bfloat16 bits; out[r,i] = sum_k f(w[i,k]) * f(b(x[r,k])), where
 * b() rounds a float32 to bfloat16 (nearest, ties to even; NaN stays NaN) and f() widens
 * bfloat16 to float32 (exact).  Each product is exact in float32.  Reference order:
 * dot_f32's eight lanes over the widened values.  A fast backend may use its own order
 * (e.g. AVX512_BF16 pairs) provided that order is fixed per element: independent of rows,
 * d, tiling and threads.
 * GGUF blocks (q8_0 .. q6_K): each row of x is quantized to int8 blocks (32 elements for
 * the q*_0/q*_1 weights, 256 for the K ones), each block of W dotted with its x block in
 * integers, and the per-block float32 terms summed in dot_f32's eight-lane order: the
 * exact specification and its error bound against the dequantized weights are in
 * kernels/quant/qmm.h.  The fast CPU backend is bitwise the reference at every ISA. */
tsr_status tsr_backend_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                              size_t rows, size_t n, size_t d);
/* Per-tensor scales of a weight stored as fp8_e4m3 or nvfp4 (NVIDIA ModelOpt's FP8 and
 * NVFP4 checkpoints, models.md §4).  Plain data. */
typedef struct tsr_matmul_scales {
        float weight;   /* fp8: W = e4m3(w) * weight (weight_scale); nvfp4: the global
                         * weight_scale_2 (W = e2m1 * block scale * weight).  Finite, > 0. */
        float input;    /* the static activation scale (input_scale): x is quantized with it
                         * (fp8: per tensor; nvfp4: as the global of per-16 block scales);
                         * 0: x is not quantized (weight-only).  Finite, >= 0. */
} tsr_matmul_scales;

/* The matmul of tsr_backend_matmul on weights of a scaled format: fp8_e4m3 (one byte
 * per element, (d, n)) or nvfp4 (dtype.h's blocks: per row n/16 blocks of an e4m3 scale
 * and 16 e2m1 codes), with `s`'s scales.  The exact computation (activation
 * quantization with s->input, exact products, float32 sums in dot_f32's eight lanes, one
 * final scale) is in kernels/quant/fpmm.h; the fast CPU backend is bitwise the
 * reference at every ISA and thread count.  tsr_backend_matmul on these dtypes is this
 * with s = {1, 0}.  TSR_E_INVAL also for scales outside their ranges and for an nvfp4 n
 * that is not a multiple of 16. */
tsr_status tsr_backend_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                     const tsr_matmul_scales *s, size_t rows, size_t n, size_t d);
/* Rotate, in place, each head of each row by its position.
 * x (rows, n_heads, head_dim), inv_freq (head_dim/2,) backend memory; pos (rows,) host
 * memory (as every index array: embedding's ids, a KV view's block table).  head_dim even. */
tsr_status tsr_backend_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                            const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout);
/* Store the keys and values of tokens past_len .. past_len+n-1 in the cache.
 * k, v (n, n_kv_heads, head_dim) -> kv rows past_len.. past_len+n-1.  The view's
 * table must cover past_len + n tokens. */
tsr_status tsr_backend_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                                size_t past_len);
/* Causal grouped-query attention for a chunk of n new tokens of one sequence, at
 * positions past_len .. past_len+n-1, whose keys and values are already in the
 * cache.  Query row t sees cached tokens 0 .. past_len+t.  Query head h reads kv
 * head h / (n_heads / n_kv_heads).  scores = q.k * scale, softmax in float32 after
 * subtracting the row maximum, out = P.v.
 * q (n, n_heads, head_dim) -> out (n, n_heads, head_dim); out must not alias q. */
tsr_status tsr_backend_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                 size_t past_len, size_t n_heads, float scale);
/* One sequence of a batched step (continuous batching): its n new rows at positions
 * past_len .. past_len + n - 1 through its block table (host memory, n_table entries). */
typedef struct tsr_kv_seq {
        const uint32_t *block_table;
        size_t n_table;
        size_t n;
        size_t past_len;
} tsr_kv_seq;
/* kv_write and attention for every sequence of a step at once: the rows of k, v, q and
 * out are the sequences' rows stacked in `seqs` order (sum of n rows); the view gives
 * the cache arrays and geometry (its block_table and n_table are not read: each
 * sequence brings its own).  Each sequence's rows are what the one-sequence op gives
 * for them; a backend without a batched kernel runs exactly those ops in turn, so the
 * CPU results are bitwise the per-sequence ones.  A device backend runs one kernel for
 * all rows (the per-sequence launches and table copies are what a decode step of many
 * sequences would otherwise spend its time on). */
tsr_status tsr_backend_kv_write_batch(tsr_backend *be, const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs,
                                      const float *k, const float *v);
tsr_status tsr_backend_attention_batch(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv,
                                       const tsr_kv_seq *seqs, size_t n_seqs, size_t n_heads, float scale);
/* A model's own host loops (work with no kernel op yet: NemotronH's Mamba mixer) on a CPU
 * backend's threads: task(ctx, i, worker) for every i in [0, n_tasks), returning when all
 * have run.  `worker` < tsr_backend_threads(be) indexes per-thread scratch; two tasks of
 * one worker never overlap.  Which thread runs which task is not fixed, so a task writes
 * only its own outputs, computed from its own index (then the bits never depend on the
 * thread count).  The reference runs the tasks in order on the calling thread; a device
 * backend answers TSR_E_UNSUPPORTED (its memory is not the host's). */
typedef void (*tsr_backend_task_fn)(void *ctx, size_t i, int worker);
tsr_status tsr_backend_host_tasks(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx);
/* out[i] = silu(gate[i]) * up[i], silu(a) = a / (1 + exp(-a)).
 * gate, up (n,) -> out (n,); out may alias gate or up. */
tsr_status tsr_backend_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n);
/* out[i] = a[i] + b[i].  a, b (n,) -> out (n,); out may alias a or b. */
tsr_status tsr_backend_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n);
/* Rows moved between a batch and a subset of it (a MoE layer's rows routed to one
 * expert, a per-row scale), one float32 operation per element, so every backend gives
 * the same bits.  idx and scales are HOST memory (as every index array); x, out, dst and
 * src backend memory.
 * gather_rows: out row i = x row idx[i] (idx NULL: row i) times scales[i] (scales NULL:
 * copied), for i < n; x (rows, dim), out (n, dim), idx[i] < rows (else TSR_E_INVAL, before
 * anything runs); out may be x only with idx NULL (a scale in place).
 * scatter_add_rows: dst row idx[i] += src row i times scales[i] (scales NULL: src row
 * i; else the product rounded, then the sum: two roundings, no fused multiply-add), for
 * i < n; dst (rows, dim), src (n, dim); the idx < rows (else TSR_E_INVAL) and DISTINCT
 * (a device adds the rows at once; not checked). */
tsr_status tsr_backend_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                   const uint32_t *idx, const float *scales, size_t n);
tsr_status tsr_backend_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                        const uint32_t *idx, const float *scales, size_t n);
/* x[i] = max(x[i], 0)^2: the ReLU² activation of NemotronH's experts and dense MLP
 * (vLLM's ReLUSquaredActivation), one float32 product per element, so every backend
 * gives the same bits.  x (n,) in place. */
tsr_status tsr_backend_relu_sq(tsr_backend *be, float *x, size_t n);
/* x[i] = tsr_bf16_to_f32(tsr_f32_to_bf16(x[i])): each element rounded to the nearest
 * bfloat16 (ties to even, NaN kept quiet), held as float32 - a residual stream kept in
 * bf16 precision (NemotronH with residual_in_fp32 false).  Bitwise on every backend. */
tsr_status tsr_backend_round_bf16(tsr_backend *be, float *x, size_t n);

/* ---- the Mamba-2 mixer (NemotronH's 'M' layers) ------------------------------------------
 *
 * Between a layer's in_proj and its out_proj: the causal depthwise conv1d with SiLU, the
 * selective scan and the gated group RMSNorm, over the rows of a batch of sequences, each
 * continuing its own state slot.  In the names of transformers' NemotronHMamba2Mixer:
 * H heads of P channels, d_inner = H * P, G groups of B and C (each NS wide), a conv of
 * K taps over conv_dim = d_inner + 2 * G * NS channels.
 *   proj row (in_proj's output): [z (d_inner) | xBC (conv_dim) | dt (H)]
 *   xBC' = silu(conv_b + sum_k conv_w[., k] * window[t + k])   window: the K-1 rows of the
 *          slot's conv state, then the sequence's own xBC rows
 *   Δ_h  = clamp(softplus(dt_h + dt_bias_h), dt_min, dt_max)     softplus threshold 20
 *   S_h  = S_h * exp(Δ_h A_h) + Δ_h x_h B_gᵀ;   y_h = S_h C_g + D_h x_h     (A = -exp(A_log))
 *   y   *= silu(z); then per group of d_inner / G channels y = norm * y / rms(y)
 * and the slot's conv state moves on to the last K-1 raw xBC rows.  Whole chunks of
 * `chunk` tokens (aligned to absolute positions, before chunked_end, no save strictly
 * inside) run the scan's chunked (SSD) form, the same sum in another order; the other
 * tokens the recurrence.  Only positions decide which, so a prompt cut into steps at
 * chunk multiples gives the bits of the prompt in one step; the CPU backends give the
 * same bits at every thread count (cpu/mamba.c is the specification).  CUDA runs the
 * recurrence throughout: within tolerance of them. */
#define TSR_MAMBA_MAX_CONV 16           /* conv taps */
#define TSR_MAMBA_MAX_CHUNK 1024        /* the chunked form's chunk */
typedef struct tsr_mamba_dims {
        size_t heads, head_dim, state, groups, conv_kernel;     /* H, P, NS, G, K */
        size_t chunk;                   /* 2 .. TSR_MAMBA_MAX_CHUNK; 0: the recurrence only */
        float eps, dt_min, dt_max;
} tsr_mamba_dims;
/* The layer's parameters, backend memory, float32. */
typedef struct tsr_mamba_weights {
        const float *conv_w;            /* (conv_dim, K) */
        const float *conv_b;            /* (conv_dim,), or NULL: no bias */
        const float *dt_bias, *A, *D;   /* (H,) each */
        const float *norm;              /* (d_inner,) the gated norm's weight */
} tsr_mamba_weights;
/* Prefix caching of a Mamba hybrid: the state after the first `pos` tokens of a
 * sequence, copied into state slot `slot` while a step that reaches pos runs. */
typedef struct tsr_state_save {
        uint32_t pos;
        uint32_t slot;
} tsr_state_save;
/* One sequence of the step, host memory: its n rows of proj and y from `row`, at
 * positions past_len .. past_len + n - 1, continuing state slot `slot` (the caller zeroes
 * a fresh one).  saves: positions increasing, in (past_len, past_len + n], slots
 * distinct.  chunked_end: the chunked form only on chunks that end by it (0: no limit). */
typedef struct tsr_mamba_seq {
        size_t row, n, past_len, chunked_end;
        uint32_t slot;
        const tsr_state_save *saves;
        size_t n_saves;
} tsr_mamba_seq;
/* The mixer over `rows` rows of n_seqs sequences.  proj (rows, d_inner + conv_dim + H),
 * y (rows, d_inner), the state arrays conv (n_slots, K-1, conv_dim) and ssm (n_slots, H,
 * P, NS): backend memory.  leaves NULL: y is gated and normed; else (G must be 1) y is
 * left gated, not normed, and leaves (n_leaves, rows) gets each row's sums of squares of
 * its n_leaves equal channel slices, for a norm whose group spans tensor-parallel ranks.
 * TSR_E_INVAL (nothing run): a size 0 or out of range, H % G, d_inner % n_leaves, a row or
 * slot out of range, a save out of order, a slot used twice by the step.  Sequences'
 * rows must not overlap; a row no sequence covers is left as it is. */
tsr_status tsr_backend_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                                   const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                                   const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves,
                                   size_t n_leaves);
/* Row-wise softmax and log-softmax (max subtracted first).
 * x (rows, n) -> out (rows, n); out may alias x. */
tsr_status tsr_backend_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n);
tsr_status tsr_backend_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n);
/* Each row's greedy token, with the sampler's rules (worker/engine/sampler.h): out[r] the
 * index of the first maximum of x[r, :], or TSR_ARGMAX_NONE when the row holds a NaN or
 * +inf or is -inf everywhere (no distribution: the sampler's TSR_E_INVAL).  x (rows, n)
 * backend memory -> out (rows,) HOST memory, as the other index arrays; synchronous (the
 * only op that waits: a decode step reads back rows * 4 bytes instead of its logits).
 * n <= INT32_MAX; rows == 0 is TSR_OK. */
#define TSR_ARGMAX_NONE UINT32_MAX
tsr_status tsr_backend_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n);

/* One draw of a row's token (tsr_backend_sample): the request's sampling parameters and
 * its uniform u in [0, 1) (the engine's Philox stream: the same u, the same token, for a
 * given row on a given backend).  temperature 0: the row is not drawn (left as it is). */
#define TSR_SAMPLE_CHUNKS 256       /* tsr_backend_sample's summation chunks (one CUDA thread each) */
typedef struct tsr_draw {
        float temperature;      /* > 0 */
        int32_t top_k;          /* <= 0 or >= n: off */
        float top_p;            /* (0, 1]; 1: off */
        float min_p;            /* [0, 1]; 0: off */
        double u;
} tsr_draw;
/* Each row's sampled token on the backend, by one definition every backend computes to
 * the same bits (cpu/ref.c tsr_ref_sample is the specification; CUDA's sample.cu the
 * same steps in the same order): w = x / T; e_i = tsr_exp(w_i - max w) (exp.h's exp, no
 * libm); min_p drops e_i with (float)(e_i / Z) < (float)(1 / Z) * min_p; top_k keeps
 * e_i >= the k-th largest e (ties kept); top_p keeps e_i >= the largest threshold t whose
 * kept mass sum(e_j >= t) is at least top_p x the mass before it (ties kept); the token
 * is the first i whose running sum passes u x the total.  Every sum is in double over
 * 256 chunks of ceil(n / 256) consecutive entries, each chunk in index order, the chunk
 * sums added in order.  out[r] = TSR_ARGMAX_NONE for a row with a NaN or +inf or only
 * -inf; unspecified for a row not drawn (temperature 0).  x (rows, n) backend memory, CLOBBERED for the drawn rows (their e); draws
 * (rows,) and out (rows,) host memory; synchronous.  n <= INT32_MAX. */
tsr_status tsr_backend_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws);

/* A request's logits processors and penalties on its row (tsr_backend_logit_rules), as
 * the engine's sampler applies them before it picks a token (worker/engine/sampler.c,
 * steps 2-3), so that a device picks the token of such a request without the row's
 * download.  In this order:
 *   allowed (n_allowed > 0): every entry not listed becomes -inf;
 *   masked: the listed entries become -inf (min_tokens' EOS and stop ids);
 *   bias: bias[j] added to entry bias_ids[j], j in order (an id listed twice gets both);
 *   penalties, for each listed id t (distinct ids; pen_counts[j] is how often t was
 *     generated, or -1 for a token of the prompt only): with repetition != 1, x_t =
 *     x_t > 0 ? x_t / repetition : x_t * repetition; then, for a count c > 0, x_t -=
 *     frequency * c and x_t -= presence, two roundings each (vLLM's order).
 * Every id < n.  A row whose lists are empty is left as it is. */
typedef struct tsr_logit_rules {
        const uint32_t *allowed;
        uint32_t n_allowed;
        const uint32_t *masked;
        uint32_t n_masked;
        const uint32_t *bias_ids;
        const float *bias;
        uint32_t n_bias;
        const uint32_t *pen_ids;
        const float *pen_counts;
        uint32_t n_pen;
        float repetition, frequency, presence;
} tsr_logit_rules;
/* x (rows, n) backend memory, changed in place by rules (rows,) (host memory, lists
 * too), on every backend to the same bits (each step a single IEEE operation).
 * TSR_E_INVAL for an id >= n, a count that is neither -1 nor >= 1, a repetition
 * penalty <= 0 or non-finite factors.  Synchronous on the host's lists: they may be
 * freed when it returns. */
tsr_status tsr_backend_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules);

/* One row's logprobs (tsr_backend_logprobs), OpenAI's: the token's and the top k. */
#define TSR_LOGPROBS_TOP_MAX 20
typedef struct tsr_row_logprobs {
        float logprob;                  /* the token's */
        uint32_t rank;                  /* entries whose logprob is >= the token's (itself
                                         * included, as vLLM counts); 0: the row has no
                                         * distribution (a NaN or +inf, or only -inf) */
        uint32_t top_ids[TSR_LOGPROBS_TOP_MAX]; /* the k largest, the lower id first on ties */
        float top_logprobs[TSR_LOGPROBS_TOP_MAX];
} tsr_row_logprobs;
/* Row r's logprobs of tokens[r] and its top[r] (<= TSR_LOGPROBS_TOP_MAX and <= n) best
 * entries, the logprobs being exactly what this backend's tsr_backend_log_softmax writes
 * for the row (rank and order are comparisons of those values: no rounding of their own).
 * A row whose token is >= n is skipped (out[r] unwritten).  x (rows, n) backend memory,
 * read only; tokens, top and out (rows,) host memory; synchronous.  Only the k entries
 * and the token's value come back, not the row. */
tsr_status tsr_backend_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                                const uint32_t *tokens, const uint32_t *top);
/* The residual add of a pre-norm transformer and the RMSNorm that follows it:
 *     residual[r,:] = residual[r,:] + x[r,:]             (the running hidden state, in place)
 *     out[r,:]      = rmsnorm(residual[r,:]) * w[:]      (the next sublayer's input)
 * residual, x (rows, dim), w (dim,) -> residual (rows, dim) updated, out (rows, dim).
 * Defined as add(residual, residual, x, rows * dim) then rmsnorm(out, residual, w,
 * rows, dim, eps): the CPU backends give bitwise that sequence's result (cpu/ref.c
 * composes the two), CUDA its rmsnorm's within tolerance.  The gain is memory
 * traffic: the sum row is squared while it is in registers, not read back from memory.
 * out may alias x (the forward writes the normed row over the sublayer's output);
 * residual must alias neither.  rows == 0 is TSR_OK. */
tsr_status tsr_backend_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps);

/* float32 <-> bfloat16 bits: round to nearest even (NaN kept a quiet NaN); widen exactly. */
uint16_t tsr_f32_to_bf16(float x);
float tsr_bf16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif

#endif
