// elementwise.cu - add, silu_mul, the row gather / scatter-add and the bf16 rounding of
// matmul's activations: one
// thread per element (grid-stride), the arithmetic of cpu/ref.c spelled with the _rn
// intrinsics so nvcc cannot fuse a multiply and an add into one FMA (one rounding
// instead of ref's two): add is bitwise ref's, silu_mul differs only by expf's ulps.
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;

// Enough blocks to cover n, capped: the grid-stride loops pick up the rest.
static unsigned grid_for(size_t n) {
        size_t b = (n + threads - 1) / threads;
        return (unsigned)(b < 65536 ? b : 65536);
}

// a, b (n,) -> out (n,); out may alias a or b (each thread reads its element before writing it).
__global__ static void add_kernel(float *out, const float *a, const float *b, size_t n) {
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
                out[i] = __fadd_rn(a[i], b[i]);
}

// gate, up (n,) -> out (n,): g * (1 / (1 + exp(-g))) * up, in ref's order.
__global__ static void silu_mul_kernel(float *out, const float *gate, const float *up, size_t n) {
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
                float g = gate[i];
                float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
                out[i] = __fmul_rn(__fmul_rn(g, sig), up[i]);
        }
}

// x (n,) float32 -> out (n,) bfloat16 bits: tsr_f32_to_bf16's rounding (nearest, ties to
// even; a NaN keeps its sign and top payload and is made quiet), bit for bit.
__global__ static void f32_to_bf16_kernel(uint16_t *out, const float *x, size_t n) {
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
                out[i] = tsr_cuda_f32_to_bf16_bits(x[i]);
}

// out row i = x row idx[i] (idx NULL: row i) * scales[i] (scales NULL: copied): one
// element per thread, one rounding (ref's multiply).  out may be x only with idx NULL.
__global__ static void gather_rows_kernel(float *out, const float *x, const uint32_t *idx, const float *scales,
                                          size_t n, size_t dim) {
        for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n * dim;
             e += (size_t)gridDim.x * blockDim.x) {
                size_t i = e / dim, d = e % dim;
                float v = x[(idx ? (size_t)idx[i] : i) * dim + d];
                out[e] = scales ? __fmul_rn(v, scales[i]) : v;
        }
}

// dst row idx[i] += src row i (* scales[i]: rounded, then added: ref's two roundings);
// the idx distinct (kernels.h), so no two threads add to one element.
__global__ static void scatter_add_rows_kernel(float *dst, const float *src, const uint32_t *idx,
                                               const float *scales, size_t n, size_t dim) {
        for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n * dim;
             e += (size_t)gridDim.x * blockDim.x) {
                size_t i = e / dim, d = e % dim;
                float *t = dst + (size_t)idx[i] * dim + d;
                *t = __fadd_rn(*t, scales ? __fmul_rn(src[e], scales[i]) : src[e]);
        }
}

extern "C" tsr_status tsr_cuda_gather_rows(cudaStream_t stream, float *out, const float *x, const uint32_t *idx,
                                           const float *scales, size_t n, size_t dim) {
        if (n == 0)
                return TSR_OK;
        gather_rows_kernel<<<grid_for(n * dim), threads, 0, stream>>>(out, x, idx, scales, n, dim);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_scatter_add_rows(cudaStream_t stream, float *dst, const float *src,
                                                const uint32_t *idx, const float *scales, size_t n, size_t dim) {
        if (n == 0)
                return TSR_OK;
        scatter_add_rows_kernel<<<grid_for(n * dim), threads, 0, stream>>>(dst, src, idx, scales, n, dim);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_add(cudaStream_t stream, float *out, const float *a, const float *b, size_t n) {
        if (n == 0)
                return TSR_OK;
        add_kernel<<<grid_for(n), threads, 0, stream>>>(out, a, b, n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_silu_mul(cudaStream_t stream, float *out, const float *gate, const float *up,
                                        size_t n) {
        if (n == 0)
                return TSR_OK;
        silu_mul_kernel<<<grid_for(n), threads, 0, stream>>>(out, gate, up, n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_f32_to_bf16(cudaStream_t stream, uint16_t *out, const float *x, size_t n) {
        if (n == 0)
                return TSR_OK;
        f32_to_bf16_kernel<<<grid_for(n), threads, 0, stream>>>(out, x, n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
