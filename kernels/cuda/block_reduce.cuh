// block_reduce.cuh - the block-wide sum the norms share (rmsnorm.cu, add_rmsnorm.cu).
#ifndef TSR_CUDA_BLOCK_REDUCE_CUH
#define TSR_CUDA_BLOCK_REDUCE_CUH

// The sum of every thread's `v` over the block, returned to all threads: a tree in a
// fixed order (stride blockDim.x / 2 down to 1), so a row's result never depends on how
// many rows or blocks run.  blockDim.x must be a power of two; `partial` is the block's
// shared array of blockDim.x floats.  Every thread of the block must call it.
__device__ static inline float tsr_block_sum_fixed_tree(float v, float *partial) {
        partial[threadIdx.x] = v;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
                if (threadIdx.x < stride)
                        partial[threadIdx.x] += partial[threadIdx.x + stride];
                __syncthreads();
        }
        return partial[0];
}

#endif
