// paged.cu - the two row copies through an index table: embedding (a row of the token
// table per id) and kv_write (a token's keys and values into its paged cache row).  The
// index arrays are device copies backend.cu made of the caller's host arrays, after it
// checked every index (nothing is checked here).  Copies: bitwise cpu/ref.c's memcpy.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;

// table (vocab, dim), ids (rows,) -> out (rows, dim).  Block r copies row r, its threads
// striding over the dim columns.
__global__ static void embedding_kernel(float *out, const float *table, size_t dim, const uint32_t *ids) {
        const float *src = table + (size_t)ids[blockIdx.x] * dim;
        float *dst = out + (size_t)blockIdx.x * dim;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
                dst[i] = src[i];
}

// k, v (n, width) -> the cache rows of tokens past_len + t.  Block t copies token t's key
// row and value row; its cache row is (blocks[p / block_size] * block_size + p % block_size).
// A table that names one block twice maps two tokens of the call to one row; ref's loop
// leaves the later token there, so a token whose row a later token of this call also
// writes skips its copy (uniform over the block: all its threads return together).
__global__ static void kv_write_kernel(float *k_cache, float *v_cache, const uint32_t *blocks, size_t block_size,
                                       size_t width, const float *k, const float *v, size_t n, size_t past_len) {
        size_t t = blockIdx.x, p = past_len + t;
        uint32_t b = blocks[p / block_size];
        for (size_t later = p + block_size; later < past_len + n; later += block_size)
                if (blocks[later / block_size] == b)
                        return;
        size_t row = (size_t)b * block_size + p % block_size;
        for (size_t i = threadIdx.x; i < width; i += blockDim.x) {
                k_cache[row * width + i] = k[t * width + i];
                v_cache[row * width + i] = v[t * width + i];
        }
}

extern "C" tsr_status tsr_cuda_embedding(cudaStream_t stream, float *out, const float *table, size_t dim,
                                         const uint32_t *ids, size_t rows) {
        if (rows == 0)
                return TSR_OK;
        embedding_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, table, dim, ids);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_kv_write(cudaStream_t stream, float *k_cache, float *v_cache, const uint32_t *blocks,
                                        size_t block_size, size_t width, const float *k, const float *v, size_t n,
                                        size_t past_len) {
        if (n == 0)
                return TSR_OK;
        kv_write_kernel<<<(unsigned)n, threads, 0, stream>>>(k_cache, v_cache, blocks, block_size, width, k, v, n,
                                                             past_len);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
