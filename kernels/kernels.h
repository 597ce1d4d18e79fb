/* kernels.h - the operator interface the forward pass is written against.
 *
 * One vtable per backend, in the style of ggml's backend interface.  cpu/ref.c is the
 * specification: scalar, plain, with shape comments.  Fast CPU paths and CUDA kernels
 * are judged against it (tests/kernels).  Functions return a tsr_status and never
 * exit or abort on bad input: NULL pointers and zero or inconsistent sizes are
 * TSR_E_INVAL, and an op that fails writes nothing.
 *
 * All tensors are float32, row-major, in the backend's memory (host for cpu, device for
 * cuda).  Shapes are written (rows, cols) with the last index varying fastest.
 *
 * Batch invariance: every op computes each row of its output from that row's inputs
 * alone, with one fixed reduction order per output element (no split-K, no blocking
 * that depends on the number of rows).  A row's result is therefore bitwise the same
 * whether it is computed alone or among other rows; tests enforce this.
 *
 * The CUDA table initialises the first three members positionally: keep `name`,
 * `rmsnorm` and `sync` first, in that order, and append new ops after them.  An op a
 * backend does not implement is NULL (the CUDA table sets rmsnorm and add_rmsnorm). */
#ifndef TSR_KERNELS_H
#define TSR_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

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
 * a row holds n_kv_heads * head_dim floats (head-major).  A contiguous cache is the
 * special case of one block of block_size >= the sequence length and table {0}.
 * K is stored after RoPE. */
typedef struct tsr_kv_view {
        float *k;                       /* (n_blocks, block_size, n_kv_heads, head_dim) */
        float *v;                       /* (n_blocks, block_size, n_kv_heads, head_dim) */
        const uint32_t *block_table;    /* (n_table,) block ids, each < n_blocks */
        size_t n_table;                 /* entries in block_table */
        size_t n_blocks;                /* blocks the k and v arrays hold */
        size_t block_size;              /* token rows per block, >= 1 */
        size_t n_kv_heads;
        size_t head_dim;
} tsr_kv_view;

typedef struct tsr_kernels_ops {
        const char *name;
        /* out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w[:]
         * x (rows, dim), w (dim,) -> out (rows, dim); out may alias x. */
        tsr_status (*rmsnorm)(float *out, const float *x, const float *w, size_t rows, size_t dim, float eps);
        /* Wait for queued work (no-op on the CPU). */
        tsr_status (*sync)(void);

        /* ---- appended ops: the CUDA table does not set these yet (NULL) up to matmul_bf16 ---- */

        /* out[r,:] = table[ids[r],:]
         * table (vocab, dim), ids (rows,) -> out (rows, dim).  An id >= vocab is TSR_E_INVAL. */
        tsr_status (*embedding)(float *out, const float *table, size_t vocab, size_t dim,
                                const uint32_t *ids, size_t rows);
        /* out[r,i] = sum_k w[i,k] * x[r,k]: W (d,n) @ x[r] (n,) -> out[r] (d,), for each row r.
         * x (rows, n), w (d, n) -> out (rows, d).  rows == 1 is the decode GEMV, rows > 1 the
         * prefill GEMM; both use the same per-element reduction order.  out must not alias
         * x or w. */
        tsr_status (*matmul)(float *out, const float *x, const float *w, size_t rows, size_t n, size_t d);
        /* Rotate, in place, each head of each row by its position.
         * x (rows, n_heads, head_dim), pos (rows,), inv_freq (head_dim/2,).  head_dim even. */
        tsr_status (*rope)(float *x, size_t rows, size_t n_heads, size_t head_dim,
                           const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout);
        /* Store the keys and values of tokens past_len .. past_len+n-1 in the cache.
         * k, v (n, n_kv_heads, head_dim) -> kv rows past_len.. past_len+n-1.  The view's
         * table must cover past_len + n tokens. */
        tsr_status (*kv_write)(const tsr_kv_view *kv, const float *k, const float *v, size_t n, size_t past_len);
        /* Causal grouped-query attention for a chunk of n new tokens of one sequence, at
         * positions past_len .. past_len+n-1, whose keys and values are already in the
         * cache.  Query row t sees cached tokens 0 .. past_len+t.  Query head h reads kv
         * head h / (n_heads / n_kv_heads).  scores = q.k * scale, softmax in float32 after
         * subtracting the row maximum, out = P.v.
         * q (n, n_heads, head_dim) -> out (n, n_heads, head_dim); out must not alias q. */
        tsr_status (*attention)(float *out, const float *q, const tsr_kv_view *kv, size_t n, size_t past_len,
                                size_t n_heads, float scale);
        /* out[i] = silu(gate[i]) * up[i], silu(a) = a / (1 + exp(-a)).
         * gate, up (n,) -> out (n,); out may alias gate or up. */
        tsr_status (*silu_mul)(float *out, const float *gate, const float *up, size_t n);
        /* out[i] = a[i] + b[i].  a, b (n,) -> out (n,); out may alias a or b. */
        tsr_status (*add)(float *out, const float *a, const float *b, size_t n);
        /* Row-wise softmax and log-softmax (max subtracted first).
         * x (rows, n) -> out (rows, n); out may alias x. */
        tsr_status (*softmax)(float *out, const float *x, size_t rows, size_t n);
        tsr_status (*log_softmax)(float *out, const float *x, size_t rows, size_t n);

        /* ---- bf16 weights (--dtype bfloat16) ---- */

        /* out[r,i] = sum_k f(w[i,k]) * f(b(x[r,k])): W (d,n) in bfloat16 @ x[r] (n,).
         * x (rows, n) float32, w (d, n) bfloat16 bits -> out (rows, d) float32, where
         * b() rounds a float32 to bfloat16 (nearest, ties to even; NaN stays NaN) and f()
         * widens bfloat16 to float32 (exact).  Each product is exact in float32.
         * Reference order (cpu/ref.c): dot_f32's eight lanes over the widened values.
         * A fast backend may use its own order (e.g. AVX512_BF16 pairs) provided that
         * order is fixed per element: independent of rows, d, tiling and threads.
         * out must not alias x or w. */
        tsr_status (*matmul_bf16)(float *out, const float *x, const uint16_t *w, size_t rows, size_t n, size_t d);

        /* ---- fused ops ---- */

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
        tsr_status (*add_rmsnorm)(float *out, float *residual, const float *x, const float *w, size_t rows,
                                  size_t dim, float eps);
} tsr_kernels_ops;

/* The scalar reference backend.  Always available. */
const tsr_kernels_ops *tsr_kernels_cpu_ref(void);

/* float32 <-> bfloat16 bits: round to nearest even (NaN kept a quiet NaN); widen exactly. */
uint16_t tsr_f32_to_bf16(float x);
float tsr_bf16_to_f32(uint16_t h);

/* ---- the fast CPU backend (cpu/fast.c) ----------------------------------------------
 * SIMD kernels picked at run time (__builtin_cpu_supports; AMX: CPUID and the Linux
 * grant of the tile state) plus a thread pool that splits OUTPUT elements only (weight
 * rows of a matmul, (row, head) pairs of attention), so every float32 result is bitwise
 * that of cpu/ref.c whatever the ISA, the thread count or the batch
 * (tests/kernels/test_cpu_fast.c).  Ops without a fast version are the reference's.
 * matmul_bf16 follows its own fixed order on AVX512_BF16 and on AMX (within the float32
 * summation error of the reference's) and is bitwise the reference's elsewhere. */

typedef enum tsr_cpu_isa {
        TSR_CPU_ISA_SCALAR = 0,         /* the reference functions */
        TSR_CPU_ISA_AVX2 = 1,           /* 8-wide float32, no FMA (it would change rounding) */
        TSR_CPU_ISA_AVX512_BF16 = 2,    /* AVX2 float32 + AVX512_BF16 dot products for bf16 weights */
        TSR_CPU_ISA_AMX_BF16 = 3,       /* AVX512_BF16 + AMX tiles (TDPBF16PS) for the bf16 matmul; needs
                                         * Linux's grant of the tile state (arch_prctl) */
} tsr_cpu_isa;

/* (Re)configure the fast backend: `n_threads` threads in all, the caller included
 * (0 = the online cores), using at most `max_isa` (what the CPU lacks is never used).
 * Starts the pool; any earlier pool is stopped first.  Call from one thread while no op
 * of this backend runs (startup, or between ops in tests).  TSR_E_INVAL for
 * n_threads < 0, TSR_E_NOMEM/TSR_E_IO when threads cannot be made (the backend then
 * runs single-threaded and still works). */
tsr_status tsr_kernels_cpu_configure(int n_threads, tsr_cpu_isa max_isa);
/* The fast table.  Configures with (0, the best ISA) on first use if not configured. */
const tsr_kernels_ops *tsr_kernels_cpu_fast(void);
/* What the fast table runs now: its ISA, by name too ("scalar", "avx2", "avx512_bf16", "amx_bf16"),
 * and its thread count. */
tsr_cpu_isa tsr_kernels_cpu_isa(void);
const char *tsr_cpu_isa_name(tsr_cpu_isa isa);
int tsr_kernels_cpu_threads(void);
/* Stop the pool's threads (at exit; the table keeps working, single-threaded). */
void tsr_kernels_cpu_shutdown(void);

/* The CUDA backend, or NULL when not built or no device is present. */
const tsr_kernels_ops *tsr_kernels_cuda(void);

#ifdef __cplusplus
}
#endif

#endif
