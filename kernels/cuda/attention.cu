// attention.cu - causal grouped-query attention over the paged KV cache (kernels.h), in
// float32, one block per (query row t, head h).  The math of cpu/ref.c's attention with
// the softmax done online (running max and sum, rescaled as the max grows), which needs no
// score array whatever the context length:
//   s_j = (q . k_j) * scale for j = 0 .. past_len + t;  out = sum_j exp(s_j - max) v_j / sum_j exp(s_j - max)
// Each block's order is fixed by (head_dim, the row's position) alone, never by the
// number of rows or sequences in the call, so a row's output does not depend on the rows
// beside it.
#include <math.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

/* 16 warps (512 threads) per (row, head): each warp's serial walk over its keys is what a
 * decode step waits for.  H200, SmolLM2 shape, bf16, 2048 tokens of context
 * (tessera-bench-engine --kernels cuda --context 2048): decode batch 1 39.1 -> 71.1 tok/s,
 * batch 32 1139 -> 1534 tok/s against 4 warps.  A split over the keys across blocks
 * (flash-decoding) is the next step. */
#define ATTN_WARPS 16
#define ATTN_PER_LANE (TSR_CUDA_ATTN_MAX_HEAD_DIM / 32)   // head dims a lane owns: lane, lane + 32, ...

// q (rows.n, n_heads, hd), the cache (n_blocks, block_size, n_kv_heads, hd) through row
// t's sequence's block table -> out (rows.n, n_heads, hd).  Block (t, h), ATTN_WARPS warps:
// warp w takes keys w, w + ATTN_WARPS, ... up to p = rows.pos[t]; for each, the warp's 32
// lanes split the dot product over the head dims (lane owns dims lane + 32 c) and sum it
// with a butterfly, then every lane
// updates the warp's running (max m, sum l) and its own dims of the weighted sum of V.
// Finally the warps' (m, l, acc) are merged in shared memory: thread i < hd writes
// out[i] = sum_w acc_w[i] e^(m_w - M) / sum_w l_w e^(m_w - M), M = max_w m_w.
__global__ static void attention_kernel(float *out, const float *q, const float *k_cache, const float *v_cache,
                                        tsr_cuda_rows rows, size_t block_size, int n_kv_heads, int hd, int n_heads,
                                        float scale) {
        __shared__ float qs[TSR_CUDA_ATTN_MAX_HEAD_DIM];
        __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
        __shared__ float wacc[ATTN_WARPS][TSR_CUDA_ATTN_MAX_HEAD_DIM];
        size_t t = blockIdx.x, p = rows.pos[t];
        const uint32_t *blocks = rows.tables + rows.table_off[t];
        int h = blockIdx.y, g = h / (n_heads / n_kv_heads), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        size_t width = (size_t)n_kv_heads * hd;
        const float *qh = q + (t * n_heads + h) * hd;

        for (int i = threadIdx.x; i < hd; i += blockDim.x)
                qs[i] = qh[i];
        __syncthreads();

        float m = -INFINITY, l = 0.0f, acc[ATTN_PER_LANE];
        for (int c = 0; c < ATTN_PER_LANE; c++)
                acc[c] = 0.0f;
        for (size_t j = warp; j <= p; j += ATTN_WARPS) {
                size_t row = (size_t)blocks[j / block_size] * block_size + j % block_size;
                const float *kj = k_cache + row * width + (size_t)g * hd;
                const float *vj = v_cache + row * width + (size_t)g * hd;
                float dot = 0.0f;
                for (int c = 0; c < ATTN_PER_LANE; c++) {
                        int i = lane + 32 * c;
                        if (i < hd)
                                dot += qs[i] * kj[i];
                }
                for (int off = 16; off > 0; off /= 2)   // butterfly: every lane ends with the same sum
                        dot += __shfl_xor_sync(0xffffffffu, dot, off);
                float s = dot * scale;
                float m_new = fmaxf(m, s);
                if (m_new == -INFINITY)                 // nothing seen yet but -inf scores: weight 0
                        continue;
                float corr = expf(m - m_new), pj = expf(s - m_new);
                l = l * corr + pj;
                for (int c = 0; c < ATTN_PER_LANE; c++) {
                        int i = lane + 32 * c;
                        if (i < hd)
                                acc[c] = acc[c] * corr + pj * vj[i];
                }
                m = m_new;
        }
        if (lane == 0) {
                wm[warp] = m;
                wl[warp] = l;
        }
        for (int c = 0; c < ATTN_PER_LANE; c++) {
                int i = lane + 32 * c;
                if (i < hd)
                        wacc[warp][i] = acc[c];
        }
        __syncthreads();

        float M = wm[0];
        for (int w = 1; w < ATTN_WARPS; w++)
                M = fmaxf(M, wm[w]);
        float L = 0.0f, f[ATTN_WARPS];
        for (int w = 0; w < ATTN_WARPS; w++) {
                f[w] = wm[w] == -INFINITY ? 0.0f : expf(wm[w] - M);    // a warp with no key weighs 0
                L += wl[w] * f[w];
        }
        float *oh = out + (t * n_heads + h) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                float o = 0.0f;
                for (int w = 0; w < ATTN_WARPS; w++)
                        o += wacc[w][i] * f[w];
                oh[i] = o / L;
        }
}

extern "C" tsr_status tsr_cuda_attention(cudaStream_t stream, float *out, const float *q, const float *k_cache,
                                         const float *v_cache, tsr_cuda_rows rows, size_t block_size,
                                         size_t n_kv_heads, size_t head_dim, size_t n_heads, float scale) {
        if (rows.n == 0)
                return TSR_OK;
        dim3 grid((unsigned)rows.n, (unsigned)n_heads);
        attention_kernel<<<grid, ATTN_WARPS * 32, 0, stream>>>(out, q, k_cache, v_cache, rows, block_size,
                                                                (int)n_kv_heads, (int)head_dim, (int)n_heads, scale);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
