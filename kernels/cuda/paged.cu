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

// k, v (rows.n, width) -> the cache row of each row's position.  Block r copies row r's
// key and value; its cache row is (table[p / block_size] * block_size + p % block_size),
// table its sequence's.  A table that names one block twice maps two tokens of one
// sequence to one row; ref's loop leaves the later token there, so a row whose cache row
// a later token of its sequence in this call also writes skips its copy (uniform over the
// block: all its threads return together).
__global__ static void kv_write_kernel(float *k_cache, float *v_cache, tsr_cuda_rows rows, size_t block_size,
                                       size_t width, const float *k, const float *v) {
        size_t r = blockIdx.x, p = rows.pos[r];
        const uint32_t *blocks = rows.tables + rows.table_off[r];
        uint32_t b = blocks[p / block_size];
        for (size_t later = p + block_size; later < rows.end[r]; later += block_size)
                if (blocks[later / block_size] == b)
                        return;
        size_t row = (size_t)b * block_size + p % block_size;
        for (size_t i = threadIdx.x; i < width; i += blockDim.x) {
                k_cache[row * width + i] = k[r * width + i];
                v_cache[row * width + i] = v[r * width + i];
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

extern "C" tsr_status tsr_cuda_kv_write(cudaStream_t stream, float *k_cache, float *v_cache, tsr_cuda_rows rows,
                                        size_t block_size, size_t width, const float *k, const float *v) {
        if (rows.n == 0)
                return TSR_OK;
        kv_write_kernel<<<(unsigned)rows.n, threads, 0, stream>>>(k_cache, v_cache, rows, block_size, width, k, v);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
