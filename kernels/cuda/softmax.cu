// softmax.cu - row-wise softmax and log_softmax, one block of 256 threads per row,
// cpu/ref.c's arithmetic: the row maximum (ref's comparison rule), exp of x - max in
// float32 (softmax) or double (log_softmax), their sum in double, then the quotient
// (softmax) or x - max - log(sum) (log_softmax).  Only the order of the double sum
// (a fixed tree, not index order) and the device's expf differ from ref.
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;   // a power of two: the tree reductions need it

// x (rows, n) -> out (rows, n), block r owns row r; thread t owns elements t, t + 256, ...
// out may alias x: a thread writes only its own elements, and only after the block-wide
// maximum (whose barrier follows every thread's reads of x for it).
__global__ static void softmax_kernel(float *out, const float *x, int n, bool log_out) {
        __shared__ float fpart[threads];
        __shared__ double dpart[threads];
        const float *xr = x + (size_t)blockIdx.x * n;
        float *outr = out + (size_t)blockIdx.x * n;

        float m = xr[0];        // ref's running maximum starts from x[0]
        for (int i = threadIdx.x; i < n; i += blockDim.x)
                if (xr[i] > m)
                        m = xr[i];
        float max = tsr_block_max_fixed_tree(m, fpart);

        double s = 0.0;
        if (!log_out) {
                for (int i = threadIdx.x; i < n; i += blockDim.x) {
                        float e = expf(__fsub_rn(xr[i], max));
                        outr[i] = e;
                        s += (double)e;
                }
                double sum = tsr_block_sum_fixed_tree(s, dpart);
                for (int i = threadIdx.x; i < n; i += blockDim.x)
                        outr[i] = (float)((double)outr[i] / sum);
        } else {
                for (int i = threadIdx.x; i < n; i += blockDim.x)
                        s += exp((double)xr[i] - (double)max);
                float lse = (float)log(tsr_block_sum_fixed_tree(s, dpart));
                for (int i = threadIdx.x; i < n; i += blockDim.x)
                        outr[i] = __fsub_rn(__fsub_rn(xr[i], max), lse);
        }
}

extern "C" tsr_status tsr_cuda_softmax(cudaStream_t stream, float *out, const float *x, size_t rows, size_t n,
                                       bool log_out) {
        if (rows == 0)
                return TSR_OK;
        softmax_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, x, (int)n, log_out);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
