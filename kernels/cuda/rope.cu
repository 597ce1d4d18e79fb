// rope.cu - rotary position embedding in place, NEOX and INTERLEAVED, cpu/ref.c's math:
// θ = pos * inv_freq[i] as a float32 product, cos θ and sin θ computed in double and
// rounded once to float32 (as ref does; the device's double cos/sin are within an ulp of
// glibc's, so c and s almost always match ref bit for bit), then the rotation with the
// _rn intrinsics so nvcc does not fuse it into FMAs that ref does not have.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;

// x (rows, n_heads, head_dim), pos (rows,), inv_freq (half,) with half = head_dim / 2.
// One thread per (row r, head h, pair i), i fastest: it reads and writes only its pair
// (a, b) = (x[i], x[i + half]) for NEOX, (x[2i], x[2i+1]) for INTERLEAVED.
__global__ static void rope_kernel(float *x, size_t rows, size_t n_heads, size_t head_dim, const uint32_t *pos,
                                   const float *inv_freq, bool neox) {
        size_t half = head_dim / 2, total = rows * n_heads * half;
        for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
                size_t i = t % half, rh = t / half, r = rh / n_heads;
                float theta = __fmul_rn((float)pos[r], inv_freq[i]);
                float c = (float)cos((double)theta), s = (float)sin((double)theta);
                float *xh = x + rh * head_dim;
                size_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
                float a = xh[ia], b = xh[ib];
                xh[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
                xh[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
        }
}

extern "C" tsr_status tsr_cuda_rope(cudaStream_t stream, float *x, size_t rows, size_t n_heads, size_t head_dim,
                                    const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        size_t total = rows * n_heads * (head_dim / 2), blocks = (total + threads - 1) / threads;
        if (total == 0)
                return TSR_OK;
        rope_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), threads, 0, stream>>>(
                x, rows, n_heads, head_dim, pos, inv_freq, layout == TSR_ROPE_NEOX);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
