// rmsnorm.cu - RMSNorm, one block per row.  Must match cpu/ref.c within tolerance
// (tests/kernels/test_rmsnorm.c runs both when a GPU is present).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/block_reduce.cuh"

// x (rows, dim), w (dim,) -> out (rows, dim).  Block-wide sum of squares in a fixed
// tree order, so the result for a row does not depend on how many rows there are.
__global__ static void rmsnorm_kernel(float *out, const float *x, const float *w, int dim, float eps) {
        extern __shared__ float partial[];
        const float *xr = x + (size_t)blockIdx.x * dim;
        float *outr = out + (size_t)blockIdx.x * dim;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
                ss += xr[i] * xr[i];
        float scale = rsqrtf(tsr_block_sum_fixed_tree(ss, partial) / (float)dim + eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
                outr[i] = xr[i] * scale * w[i];
}

extern "C" tsr_status tsr_cuda_rmsnorm(cudaStream_t stream, float *out, const float *x, const float *w, size_t rows,
                                       size_t dim, float eps) {
        const int threads = 256;   // a power of two: the tree reduction needs it
        if (!out || !x || !w || dim == 0 || dim > 0x7fffffff || rows > 0x7fffffff)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        rmsnorm_kernel<<<(unsigned)rows, threads, threads * sizeof(float), stream>>>(out, x, w, (int)dim, eps);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
