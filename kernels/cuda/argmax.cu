// argmax.cu - each row's greedy token on the device (kernels.h tsr_backend_argmax): the
// index of the first maximum, or TSR_ARGMAX_NONE for a row with a NaN or +inf or only
// -inf, exactly cpu/ref.c's tsr_ref_argmax (a comparison, so no rounding can differ).
// One block of 256 threads per row; thread t scans elements t, t + 256, ... keeping
// the first maximum it sees, then a tree keeps the larger value, the lower index on ties
// (block_reduce.cuh tsr_block_first_max).
#include <math.h>
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;   // a power of two: the tree needs it

__global__ static void argmax_kernel(uint32_t *out, const float *x, int n) {
        __shared__ float val[threads];
        __shared__ uint32_t idx[threads];
        __shared__ int bad;
        const float *xr = x + (size_t)blockIdx.x * n;
        if (threadIdx.x == 0)
                bad = 0;
        __syncthreads();
        float bv = -INFINITY;
        uint32_t bi = TSR_ARGMAX_NONE;
        bool mine_bad = false;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
                float v = xr[i];
                if (isnan(v) || v == INFINITY)
                        mine_bad = true;
                else if (v > bv) {      // ascending i: the first maximum of this thread's share
                        bv = v;
                        bi = (uint32_t)i;
                }
        }
        if (mine_bad)
                bad = 1;        // any thread's write: all write the same value
        tsr_block_first_max(&bv, &bi, val, idx);        // its first barrier follows the writes of bad
        if (threadIdx.x == 0)
                out[blockIdx.x] = bad ? TSR_ARGMAX_NONE : bi;
}

extern "C" tsr_status tsr_cuda_argmax(cudaStream_t stream, uint32_t *out, const float *x, size_t rows, size_t n) {
        if (rows == 0)
                return TSR_OK;
        argmax_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, x, (int)n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
