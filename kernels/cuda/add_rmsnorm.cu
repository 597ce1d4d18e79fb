// add_rmsnorm.cu - the residual add fused with the RMSNorm after it, one block per row.
// The sums written back to the residual are float adds, bitwise cpu/ref.c's; the normed
// row matches ref within tolerance (tests/kernels/test_add_rmsnorm.c runs both when a
// GPU is present).
#include "kernels/cuda/add_rmsnorm.cuh"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cuda_check.h"

// residual, x (rows, dim), w (dim,) -> residual += x, out = rmsnorm(residual) * w.
// Thread t owns elements t, t + blockDim.x, ... in both passes, so out may alias x: the
// element a thread writes in pass 2 is one it alone read in pass 1.  The block-wide sum
// of squares is rmsnorm.cu's fixed tree, so a row's result does not depend on the batch.
__global__ static void add_rmsnorm_kernel(float *out, float *residual, const float *x, const float *w, int dim,
                                          float eps) {
        extern __shared__ float partial[];
        size_t row = (size_t)blockIdx.x * dim;
        float *res = residual + row;
        const float *xr = x + row;
        float *outr = out + row;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
                float s = res[i] + xr[i];
                res[i] = s;
                ss += s * s;
        }
        float scale = rsqrtf(tsr_block_sum_fixed_tree(ss, partial) / (float)dim + eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
                outr[i] = res[i] * scale * w[i];
}

extern "C" tsr_status tsr_cuda_add_rmsnorm(cudaStream_t stream, float *out, float *residual, const float *x,
                                           const float *w, size_t rows, size_t dim, float eps) {
        const int threads = 256;   // a power of two: the tree reduction needs it
        if (!out || !residual || !x || !w || dim == 0 || dim > 0x7fffffff || rows > 0x7fffffff)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        add_rmsnorm_kernel<<<(unsigned)rows, threads, threads * sizeof(float), stream>>>(out, residual, x, w,
                                                                                        (int)dim, eps);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
