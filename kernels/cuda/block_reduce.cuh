// block_reduce.cuh - the block-wide reductions the row kernels share (rmsnorm.cu,
// add_rmsnorm.cu, softmax.cu, argmax.cu, logits.cu).
#ifndef TSR_CUDA_BLOCK_REDUCE_CUH
#define TSR_CUDA_BLOCK_REDUCE_CUH

#include <stdint.h>

// The sum of every thread's `v` over the block, returned to all threads: a tree in a
// fixed order (stride blockDim.x / 2 down to 1), so a row's result never depends on how
// many rows or blocks run.  blockDim.x must be a power of two; `partial` is the block's
// shared array of blockDim.x elements.  Every thread of the block must call it.  T is
// float for the norms, double for softmax's sum (cpu/ref.c sums in double there).
template <typename T> __device__ static inline T tsr_block_sum_fixed_tree(T v, T *partial) {
        partial[threadIdx.x] = v;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
                if (threadIdx.x < stride)
                        partial[threadIdx.x] += partial[threadIdx.x + stride];
                __syncthreads();
        }
        T r = partial[0];
        __syncthreads();        // partial may be reused by the caller's next reduction
        return r;
}

// The block's maximum with cpu/ref.c's softmax semantics: `b > a ? b : a` everywhere, so a
// NaN is never picked over a number (and a NaN start stays NaN, as in ref, whose running
// maximum starts from x[0]).  Same rules as the sum above.
__device__ static inline float tsr_block_max_fixed_tree(float v, float *partial) {
        partial[threadIdx.x] = v;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
                if (threadIdx.x < stride) {
                        float b = partial[threadIdx.x + stride];
                        if (b > partial[threadIdx.x])
                                partial[threadIdx.x] = b;
                }
                __syncthreads();
        }
        float r = partial[0];
        __syncthreads();
        return r;
}

// Whether candidate (v, i) goes before (bv, bi) in a first-maximum order: larger, or as
// large at a lower index.  An index of UINT32_MAX (TSR_ARGMAX_NONE: nothing seen) never
// goes before a real one.
__device__ static inline bool tsr_first_max_before(float v, uint32_t i, float bv, uint32_t bi) {
        return i != UINT32_MAX && (bi == UINT32_MAX || v > bv || (v == bv && i < bi));
}

// The block's first maximum of every thread's candidate (*v, *i), returned to all threads
// in *v, *i: a tree in a fixed order, so the answer is the first maximum whatever the
// threads' shares.  Same rules as the sum above; `vals` and `idx` are the block's shared
// arrays of blockDim.x elements.
__device__ static inline void tsr_block_first_max(float *v, uint32_t *i, float *vals, uint32_t *idx) {
        vals[threadIdx.x] = *v;
        idx[threadIdx.x] = *i;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
                if (threadIdx.x < stride && tsr_first_max_before(vals[threadIdx.x + stride], idx[threadIdx.x + stride],
                                                                 vals[threadIdx.x], idx[threadIdx.x])) {
                        vals[threadIdx.x] = vals[threadIdx.x + stride];
                        idx[threadIdx.x] = idx[threadIdx.x + stride];
                }
                __syncthreads();
        }
        *v = vals[0];
        *i = idx[0];
        __syncthreads();        // vals, idx may be reused by the caller's next reduction
}

#endif
