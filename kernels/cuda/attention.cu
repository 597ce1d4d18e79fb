// attention.cu - causal grouped-query attention over the paged KV cache (kernels.h), in
// float32, the cache holding floats, bf16 values (widened, exact) or fp8 e4m3 codes (each
// read as float(code) * scale, as cpu/ref.c reads them).  The math of cpu/ref.c's attention with the softmax done
// online (running max and sum, rescaled as the max grows), which needs no score array:
//   s_j = (q . k_j) * scale for j = 0 .. pos;  out = sum_j exp(s_j - max) v_j / sum_j exp(s_j - max)
//
// Split over the keys (flash-decoding): a row with n = pos + 1 keys is cut into
// attn_splits(n) runs of consecutive keys, one block each per head; a block with the
// row's only run writes the output itself, otherwise it writes its run's (max, sum,
// weighted V sum) and a second kernel merges the runs in order.  A decode step has one
// row per sequence, so without the split a batch of one kept only n_heads blocks busy
// (9 of an H200's 132 multiprocessors for SmolLM2) however long the context.
//
// Batch invariance: the number of runs, their bounds and every block's order depend on
// (the row's position, head_dim) alone, never on the other rows or sequences of the call,
// so a row's output is bitwise the same alone or in any batch, and the same whether its
// token came in a prefill or a decode step.
#include <math.h>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/minifloat.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

/* 8 warps per (row, head, run); runs of at least ATTN_MIN_RUN keys (16 per warp), at most
 * ATTN_MAX_SPLITS of them: up to 4096 keys a row gets one run per 128 keys, past that the
 * runs grow.  SmolLM2 (9 heads) at 2048 keys: 16 runs, 144 blocks for a batch of one.
 * H200, SmolLM2 shape, bf16 weights (docs/benchmarks.md, GPU, 2026-11-27), against one
 * block of 16 warps per (row, head): decode b32 at 2048 cached tokens 2765-2824 ->
 * 3977-3991 tok/s, b1 at 8000 cached 50.8 -> 226.1 tok/s (with backend.cu's index copies
 * once per step); runs of 64 keys lost 10% at b32 and 12% of prefill. */
#define ATTN_WARPS 8
#define ATTN_UNROLL 4           // keys a warp has in flight at once
#define ATTN_MIN_RUN 128
#define ATTN_MAX_SPLITS 32
#define ATTN_PER_LANE (TSR_CUDA_ATTN_MAX_HEAD_DIM / 32)   // head dims a lane owns: lane, lane + 32, ...
/* Bytes of run records one launch may use: the rows of a call go in groups that fit. */
#define ATTN_WORK_BYTES ((size_t)32 << 20)

// Element i of a cached head as float32: the float itself, or an fp8 code through the
// block's table of the 256 codes' values (quant/fp8.c's decoding) times the scale, the
// float32 product cpu/ref.c's kv_fp8_load computes.
__device__ static inline float kv_load(const float *p, int i, float, const float *) { return p[i]; }
__device__ static inline float kv_load(const uint16_t *p, int i, float, const float *) {
        return tsr_cuda_bf16_bits_to_f32(p[i]);
}
__device__ static inline float kv_load(const uint8_t *p, int i, float scale, const float *codes) {
        return codes[p[i]] * scale;
}

// The number of runs for a row with n >= 1 keys.
__host__ __device__ static inline unsigned attn_splits(size_t n) {
        size_t s = (n + ATTN_MIN_RUN - 1) / ATTN_MIN_RUN;
        return (unsigned)(s < ATTN_MAX_SPLITS ? s : ATTN_MAX_SPLITS);
}

// A run's record in the work array: max m, sum l, then acc[hd] (the run's sum of
// exp(s_j - m) v_j, not yet divided by l).
__host__ __device__ static inline size_t attn_record_floats(size_t hd) { return hd + 2; }

// q (rows.n, n_heads, hd), the cache (n_blocks, block_size, n_kv_heads, hd) through row
// t's sequence's block table.  Block (t - r0, h, s) takes run s of row t = r0 + blockIdx.x
// for head h: keys [j0, j1).  Warp w takes keys j0 + w, j0 + w + ATTN_WARPS, ...,
// ATTN_UNROLL of them at a time; for each, the warp's 32 lanes split the dot product over
// the head dims (lane owns dims lane + 32 c) and sum it with a butterfly, then every lane
// rescales the warp's running (max m, sum l) once for the new maximum of those keys and
// adds their terms to l and to its own dims of the weighted sum of V.  The warps' (m, l,
// acc) are then merged in shared memory, M = max_w m_w: with one run, thread i < hd
// writes out[i] = sum_w acc_w[i] e^(m_w - M) / sum_w l_w e^(m_w - M); with several, the
// run's record (M, that denominator, that numerator) goes to `work`.  T: the cache's
// element, float, uint16_t (bf16 bits) or uint8_t (fp8 e4m3 codes), read through kv_load.
template <typename T>
__global__ static void attention_kernel(float *out, float *work, const float *q, const T *k_cache, const T *v_cache,
                                        float k_scale, float v_scale, tsr_cuda_rows rows, size_t r0,
                                        size_t block_size, int n_kv_heads, int hd, int n_heads, float scale) {
        __shared__ float qs[TSR_CUDA_ATTN_MAX_HEAD_DIM];
        __shared__ float codes[256];            // fp8 only: every code's value
        __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
        __shared__ float wacc[ATTN_WARPS][TSR_CUDA_ATTN_MAX_HEAD_DIM];
        size_t t = r0 + blockIdx.x, n = (size_t)rows.pos[t] + 1;
        unsigned splits = attn_splits(n), s = blockIdx.z;
        if (s >= splits)        // a shorter row than the group's longest: uniform over the block
                return;
        size_t run = (n + splits - 1) / splits, j0 = s * run, j1 = j0 + run < n ? j0 + run : n;
        const uint32_t *blocks = rows.tables + rows.table_off[t];
        int h = blockIdx.y, g = h / (n_heads / n_kv_heads), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        size_t width = (size_t)n_kv_heads * hd;
        const float *qh = q + (t * n_heads + h) * hd;

        for (int i = threadIdx.x; i < hd; i += blockDim.x)
                qs[i] = qh[i];
        if constexpr (sizeof(T) == 1)
                for (int i = threadIdx.x; i < 256; i += blockDim.x)
                        codes[i] = tsr_cuda_e4m3_to_f32((unsigned)i);
        __syncthreads();

        float m = -INFINITY, l = 0.0f, acc[ATTN_PER_LANE];
        for (int c = 0; c < ATTN_PER_LANE; c++)
                acc[c] = 0.0f;
        for (size_t j = j0 + warp; j < j1; j += ATTN_WARPS * ATTN_UNROLL) {
                // ATTN_UNROLL keys at once (j, j + ATTN_WARPS, ...): their loads and
                // butterflies are independent, so their latencies overlap.
                float sc[ATTN_UNROLL];
                const T *vp[ATTN_UNROLL];
                for (int u = 0; u < ATTN_UNROLL; u++) {
                        size_t ju = j + (size_t)u * ATTN_WARPS;
                        float dot = 0.0f;
                        vp[u] = NULL;
                        if (ju < j1) {          // uniform over the warp
                                size_t row = (size_t)blocks[ju / block_size] * block_size + ju % block_size;
                                const T *kj = k_cache + row * width + (size_t)g * hd;
                                vp[u] = v_cache + row * width + (size_t)g * hd;
                                for (int c = 0; c < ATTN_PER_LANE; c++) {
                                        int i = lane + 32 * c;
                                        if (i < hd)
                                                dot += qs[i] * kv_load(kj, i, k_scale, codes);
                                }
                        }
                        sc[u] = dot;
                }
                for (int off = 16; off > 0; off /= 2)   // butterflies: every lane ends with the same sums
                        for (int u = 0; u < ATTN_UNROLL; u++)
                                sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], off);
                float m_new = m;
                for (int u = 0; u < ATTN_UNROLL; u++) {
                        sc[u] = vp[u] ? sc[u] * scale : -INFINITY;
                        m_new = fmaxf(m_new, sc[u]);
                }
                if (m_new == -INFINITY)                 // nothing seen yet but -inf scores: weight 0
                        continue;
                float corr = expf(m - m_new);
                l *= corr;
                for (int c = 0; c < ATTN_PER_LANE; c++)
                        acc[c] *= corr;
                for (int u = 0; u < ATTN_UNROLL; u++) {
                        if (!vp[u])
                                continue;
                        float pj = expf(sc[u] - m_new);
                        l += pj;
                        for (int c = 0; c < ATTN_PER_LANE; c++) {
                                int i = lane + 32 * c;
                                if (i < hd)
                                        acc[c] += pj * kv_load(vp[u], i, v_scale, codes);
                        }
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
        float *dst;
        if (splits == 1) {
                dst = out + (t * n_heads + h) * hd;
        } else {
                float *rec = work + ((blockIdx.x * (size_t)n_heads + h) * ATTN_MAX_SPLITS + s) * attn_record_floats(hd);
                if (threadIdx.x == 0) {
                        rec[0] = M;
                        rec[1] = L;
                }
                dst = rec + 2;
        }
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                float o = 0.0f;
                for (int w = 0; w < ATTN_WARPS; w++)
                        o += wacc[w][i] * f[w];
                dst[i] = splits == 1 ? o / L : o;
        }
}

// The runs of row t = r0 + blockIdx.x, head blockIdx.y, merged in run order as the warps
// are above: out[i] = sum_s acc_s[i] e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
// Rows with one run were written by attention_kernel.
__global__ static void attention_merge_kernel(float *out, const float *work, tsr_cuda_rows rows, size_t r0, int hd,
                                              int n_heads) {
        size_t t = r0 + blockIdx.x;
        unsigned splits = attn_splits((size_t)rows.pos[t] + 1);
        if (splits == 1)
                return;
        int h = blockIdx.y;
        size_t rf = attn_record_floats(hd);
        const float *rec = work + (blockIdx.x * (size_t)n_heads + h) * ATTN_MAX_SPLITS * rf;
        float M = rec[0];
        for (unsigned s = 1; s < splits; s++)
                M = fmaxf(M, rec[s * rf]);
        float L = 0.0f;
        for (unsigned s = 0; s < splits; s++) {
                float ms = rec[s * rf];
                L += ms == -INFINITY ? 0.0f : rec[s * rf + 1] * expf(ms - M);
        }
        float *oh = out + (t * n_heads + h) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                float o = 0.0f;
                for (unsigned s = 0; s < splits; s++) {
                        float ms = rec[s * rf];
                        if (ms != -INFINITY)
                                o += rec[s * rf + 2 + i] * expf(ms - M);
                }
                oh[i] = o / L;
        }
}

extern "C" unsigned tsr_cuda_attention_splits(size_t n) { return attn_splits(n ? n : 1); }

extern "C" size_t tsr_cuda_attention_work_bytes(size_t rows, size_t n_heads, size_t head_dim) {
        size_t per_row = n_heads * ATTN_MAX_SPLITS * attn_record_floats(head_dim) * sizeof(float);
        size_t group = ATTN_WORK_BYTES / per_row;
        if (group == 0)
                group = 1;
        return (rows < group ? rows : group) * per_row;
}

extern "C" tsr_status tsr_cuda_attention(cudaStream_t stream, float *out, float *work, size_t work_bytes,
                                         const float *q, const void *k_cache, const void *v_cache, tsr_dtype dtype,
                                         float k_scale, float v_scale, tsr_cuda_rows rows, const uint32_t *host_pos,
                                         unsigned fixed_splits, size_t block_size, size_t n_kv_heads, size_t head_dim, size_t n_heads,
                                         float scale) {
        size_t per_row = n_heads * ATTN_MAX_SPLITS * attn_record_floats(head_dim) * sizeof(float);
        size_t group = work_bytes / per_row;
        if (rows.n == 0)
                return TSR_OK;
        if (group == 0)
                return TSR_E_INVAL;
        for (size_t r0 = 0; r0 < rows.n; r0 += group) {
                size_t g = rows.n - r0 < group ? rows.n - r0 : group;
                unsigned splits = fixed_splits;
                if (host_pos) {
                        uint32_t longest = 0;
                        for (size_t r = r0; r < r0 + g; r++)
                                longest = host_pos[r] > longest ? host_pos[r] : longest;
                        splits = attn_splits((size_t)longest + 1);
                }
                dim3 grid((unsigned)g, (unsigned)n_heads, splits);
                if (dtype == TSR_DTYPE_FP8_E4M3)
                        attention_kernel<<<grid, ATTN_WARPS * 32, 0, stream>>>(
                                out, work, q, static_cast<const uint8_t *>(k_cache),
                                static_cast<const uint8_t *>(v_cache), k_scale, v_scale, rows, r0, block_size,
                                (int)n_kv_heads, (int)head_dim, (int)n_heads, scale);
                else if (dtype == TSR_DTYPE_BF16)
                        attention_kernel<<<grid, ATTN_WARPS * 32, 0, stream>>>(
                                out, work, q, static_cast<const uint16_t *>(k_cache),
                                static_cast<const uint16_t *>(v_cache), k_scale, v_scale, rows, r0, block_size,
                                (int)n_kv_heads, (int)head_dim, (int)n_heads, scale);
                else
                        attention_kernel<<<grid, ATTN_WARPS * 32, 0, stream>>>(
                                out, work, q, static_cast<const float *>(k_cache), static_cast<const float *>(v_cache),
                                k_scale, v_scale, rows, r0, block_size, (int)n_kv_heads, (int)head_dim, (int)n_heads,
                                scale);
                TSR_CUDA_TRY(cudaGetLastError());
                if (splits > 1) {
                        attention_merge_kernel<<<dim3((unsigned)g, (unsigned)n_heads), 128, 0, stream>>>(
                                out, work, rows, r0, (int)head_dim, (int)n_heads);
                        TSR_CUDA_TRY(cudaGetLastError());
                }
        }
        return TSR_OK;
}
