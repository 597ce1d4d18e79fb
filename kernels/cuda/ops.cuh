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
tsr_status tsr_cuda_f32_to_bf16(cudaStream_t stream, uint16_t *out, const float *x, size_t n);

/* softmax.cu: row-wise softmax (log_softmax when `log`), x (rows, n) -> out; out may alias x. */
tsr_status tsr_cuda_softmax(cudaStream_t stream, float *out, const float *x, size_t rows, size_t n, bool log_out);

/* rope.cu: x (rows, n_heads, head_dim) rotated in place by pos (rows,) and inv_freq (head_dim/2,). */
tsr_status tsr_cuda_rope(cudaStream_t stream, float *x, size_t rows, size_t n_heads, size_t head_dim,
                         const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout);

/* paged.cu: the row copies through an index table.
 * embedding: out[r,:] = table[ids[r],:], ids already checked < vocab.
 * kv_write: k, v (n, width) -> cache rows of tokens past_len .. past_len+n-1, where token t
 * is row t % block_size of block blocks[t / block_size] (width = n_kv_heads * head_dim). */
tsr_status tsr_cuda_embedding(cudaStream_t stream, float *out, const float *table, size_t dim, const uint32_t *ids,
                              size_t rows);
tsr_status tsr_cuda_kv_write(cudaStream_t stream, float *k_cache, float *v_cache, const uint32_t *blocks,
                             size_t block_size, size_t width, const float *k, const float *v, size_t n,
                             size_t past_len);

/* attention.cu: kernels.h's attention over the paged cache (blocks: the device copy of the
 * view's table).  head_dim <= TSR_CUDA_ATTN_MAX_HEAD_DIM. */
tsr_status tsr_cuda_attention(cudaStream_t stream, float *out, const float *q, const float *k_cache,
                              const float *v_cache, const uint32_t *blocks, size_t block_size, size_t n_kv_heads,
                              size_t head_dim, size_t n, size_t past_len, size_t n_heads, float scale);

#ifdef __cplusplus
}
#endif

#endif
