/* ops.cuh - the launchers of the CUDA ops beyond the norms (one .cu file each, beside
 * cpu/ref.c's function of the same name in spirit).  Called by backend.cu only, after it
 * has checked the arguments (kernels.h's TSR_E_INVAL rules) and copied every host index
 * array (ids, pos, block tables) to device memory.  All pointers here are device
 * pointers; every launcher queues on `stream` and returns TSR_E_CUDA when the launch
 * fails (a fault inside a kernel shows at the next synchronizing call). */
#ifndef TSR_CUDA_OPS_CUH
#define TSR_CUDA_OPS_CUH

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"

/* The largest head_dim attention.cu takes (each lane keeps head_dim / 32 accumulators). */
#define TSR_CUDA_ATTN_MAX_HEAD_DIM 256

#ifdef __cplusplus
extern "C" {
#endif

/* elementwise.cu: out = a + b; out = silu(gate) * up; out = bf16 bits of x (RNE, NaN quiet). */
tsr_status tsr_cuda_add(cudaStream_t stream, float *out, const float *a, const float *b, size_t n);
tsr_status tsr_cuda_silu_mul(cudaStream_t stream, float *out, const float *gate, const float *up, size_t n);
// kernels.h tsr_backend_gather_rows / scatter_add_rows with idx and scales in device memory.
tsr_status tsr_cuda_gather_rows(cudaStream_t stream, float *out, const float *x, const uint32_t *idx,
                                const float *scales, size_t n, size_t dim);
tsr_status tsr_cuda_scatter_add_rows(cudaStream_t stream, float *dst, const float *src, const uint32_t *idx,
                                     const float *scales, size_t n, size_t dim);
tsr_status tsr_cuda_f32_to_bf16(cudaStream_t stream, uint16_t *out, const float *x, size_t n);

/* mamba.cu: kernels.h's relu_sq, and its Mamba-2 mixer with the sequences as backend.cu
 * lays them out in device memory: seq (n_seqs, TSR_CUDA_MAMBA_SEQ_WORDS) each sequence's
 * first row, n, past_len, slot, first save and its count of saves; row_seq (rows,) each
 * row's sequence (TSR_CUDA_MAMBA_NO_SEQ: none; that row is left as it is); saves (all the sequences' saves in order, 2 words each: pos, slot).
 * work: (rows, conv_dim + heads) floats.  The recurrence for every token (mamba.cu). */
tsr_status tsr_cuda_relu_sq(cudaStream_t stream, float *x, size_t n);
tsr_status tsr_cuda_round_bf16(cudaStream_t stream, float *x, size_t n);
enum { TSR_CUDA_MAMBA_ROW, TSR_CUDA_MAMBA_N, TSR_CUDA_MAMBA_PAST, TSR_CUDA_MAMBA_SLOT, TSR_CUDA_MAMBA_SAVE_FIRST,
       TSR_CUDA_MAMBA_N_SAVES, TSR_CUDA_MAMBA_SEQ_WORDS };
#define TSR_CUDA_MAMBA_NO_SEQ UINT32_MAX        /* row_seq of a row no sequence covers */
typedef struct tsr_cuda_mamba_shape {
        size_t heads, head_dim, state, groups, conv_kernel;
        size_t n_leaves;                /* with leaves */
        float eps, dt_min, dt_max;
} tsr_cuda_mamba_shape;
tsr_status tsr_cuda_mamba_mixer(cudaStream_t stream, const tsr_cuda_mamba_shape *s, const tsr_mamba_weights *w,
                                const float *proj, size_t rows, float *conv, float *ssm, const uint32_t *seq,
                                size_t n_seqs, const uint32_t *row_seq, const uint32_t *saves, float *y,
                                float *leaves, float *work);

/* softmax.cu: row-wise softmax (log_softmax when `log`), x (rows, n) -> out; out may alias x. */
tsr_status tsr_cuda_softmax(cudaStream_t stream, float *out, const float *x, size_t rows, size_t n, bool log_out);

/* argmax.cu: x (rows, n) -> out (rows,) device memory, kernels.h's tsr_backend_argmax rule. */
tsr_status tsr_cuda_argmax(cudaStream_t stream, uint32_t *out, const float *x, size_t rows, size_t n);

/* sample.cu: kernels.h's tsr_backend_sample, draws (rows,) and out (rows,) device memory. */
tsr_status tsr_cuda_sample(cudaStream_t stream, uint32_t *out, float *x, size_t rows, size_t n,
                           const tsr_draw *draws);

/* logits.cu: kernels.h's tsr_backend_logit_rules with each row's rules as backend.cu
 * packs them in device memory: hdr (rows, TSR_CUDA_RULE_WORDS), its lists at word offsets
 * into `words` (the bias values after the bias ids, the counts after the penalty ids, as
 * float bits), kept: a float for every allowed id at the row's KEPT offset (scratch); and
 * tsr_backend_logprobs with tokens, top and out (rows,) in device memory (a row whose
 * token is >= n is left unwritten). */
enum { TSR_CUDA_RULE_ALLOWED, TSR_CUDA_RULE_N_ALLOWED, TSR_CUDA_RULE_MASKED, TSR_CUDA_RULE_N_MASKED,
       TSR_CUDA_RULE_BIAS, TSR_CUDA_RULE_N_BIAS, TSR_CUDA_RULE_PEN, TSR_CUDA_RULE_N_PEN, TSR_CUDA_RULE_REP,
       TSR_CUDA_RULE_FREQ, TSR_CUDA_RULE_PRES, TSR_CUDA_RULE_KEPT, TSR_CUDA_RULE_WORDS };
tsr_status tsr_cuda_logit_rules(cudaStream_t stream, float *x, size_t rows, size_t n, const uint32_t *hdr,
                                const uint32_t *words, float *kept);
tsr_status tsr_cuda_logprobs(cudaStream_t stream, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                             const uint32_t *tokens, const uint32_t *top);

/* rope.cu: x (rows, n_heads, head_dim) rotated in place by pos (rows,) and inv_freq (head_dim/2,). */
tsr_status tsr_cuda_rope(cudaStream_t stream, float *x, size_t rows, size_t n_heads, size_t head_dim,
                         const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout);

/* The rows of a kv_write or attention call, one sequence or a batch of them, as backend.cu
 * lays them out in device memory.  Row r is the r-th new token of the call (the
 * sequences' rows stacked in order): pos[r] its position, end[r] its sequence's
 * past_len + n, and its sequence's block table starts at tables + table_off[r]. */
typedef struct tsr_cuda_rows {
        const uint32_t *pos, *end, *table_off, *tables;
        size_t n;
} tsr_cuda_rows;

/* paged.cu: the row copies through an index table.
 * embedding: out[r,:] = table[ids[r],:] as float32 (a float32 or a bf16 table, dtype), ids
 * already checked < vocab.
 * kv_write: k, v (rows.n, width) -> row r into the cache row of its position p: row
 * p % block_size of block table[p / block_size] (width = n_kv_heads * head_dim).  The
 * cache holds dtype TSR_DTYPE_F32 (floats, the scales unused), TSR_DTYPE_BF16
 * (tsr_f32_to_bf16(x), the scales unused) or TSR_DTYPE_FP8_E4M3 (bytes e4m3(x / k_scale),
 * V with v_scale: kernels.h's fp8 view). */
tsr_status tsr_cuda_embedding(cudaStream_t stream, float *out, const void *table, tsr_dtype dtype, size_t dim,
                              const uint32_t *ids, size_t rows);
tsr_status tsr_cuda_kv_write(cudaStream_t stream, void *k_cache, void *v_cache, tsr_dtype dtype, float k_scale,
                             float v_scale, tsr_cuda_rows rows, size_t block_size, size_t width, const float *k,
                             const float *v);

/* attention.cu: kernels.h's attention for every row of `rows` over the paged cache:
 * q (rows.n, n_heads, head_dim) -> out (rows.n, n_heads, head_dim), row r seeing cached
 * tokens 0 .. pos[r] of its own sequence.  head_dim <= TSR_CUDA_ATTN_MAX_HEAD_DIM.  The
 * cache as kv_write's (dtype, scales): a bf16 element reads as its exact float32, an fp8
 * one as float(code) * scale.
 * host_pos: a host copy of rows.pos (the launcher sizes each launch from it), or NULL:
 * launches of fixed_splits key splits whatever the rows (a CUDA graph's: the blocks past
 * a row's own splits return at once; the bits are the same; a row with more splits,
 * tsr_cuda_attention_splits, is the caller's error).  work: a
 * device array of work_bytes, at least tsr_cuda_attention_work_bytes(1, n_heads,
 * head_dim), for the runs of rows split over their keys; with
 * tsr_cuda_attention_work_bytes(rows.n, ...) bytes the call is at its fewest launches. */
size_t tsr_cuda_attention_work_bytes(size_t rows, size_t n_heads, size_t head_dim);
/* The key splits (1 .. 32) of a row with n >= 1 keys. */
unsigned tsr_cuda_attention_splits(size_t n);
tsr_status tsr_cuda_attention(cudaStream_t stream, float *out, float *work, size_t work_bytes, const float *q,
                              const void *k_cache, const void *v_cache, tsr_dtype dtype, float k_scale,
                              float v_scale, tsr_cuda_rows rows, const uint32_t *host_pos, unsigned fixed_splits,
                              size_t block_size,
                              size_t n_kv_heads, size_t head_dim, size_t n_heads, float scale);

#ifdef __cplusplus
}
#endif

#endif
