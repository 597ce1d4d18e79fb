// paged.cu - the two row copies through an index table: embedding (a row of the token
// table per id) and kv_write (a token's keys and values into its paged cache row, as
// they are, as bf16 values or as fp8 e4m3 codes).  The index arrays are device copies
// backend.cu made of the caller's host arrays, after it checked every index (nothing is
// checked here).  Copies: bitwise cpu/ref.c's memcpy; bf16: bitwise tsr_f32_to_bf16; fp8
// codes: bitwise quant/fp8.c's encoder.
#include <math.h>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/minifloat.cuh"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;

// An element of a float32 or a bf16 table as float32 (bf16 widens exactly).
__device__ static inline float table_elem(const float *t, size_t i) { return t[i]; }
__device__ static inline float table_elem(const uint16_t *t, size_t i) { return tsr_cuda_bf16_bits_to_f32(t[i]); }

// table (vocab, dim) of T (float or bf16 bits), ids (rows,) -> out (rows, dim) float32.
// Block r copies row r, its threads striding over the dim columns.
template <typename T>
__global__ static void embedding_kernel(float *out, const T *table, size_t dim, const uint32_t *ids) {
        const T *src = table + (size_t)ids[blockIdx.x] * dim;
        float *dst = out + (size_t)blockIdx.x * dim;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
                dst[i] = table_elem(src, i);
}

__device__ static inline void kv_store(float *dst, const float *src, size_t i, float) { dst[i] = src[i]; }
__device__ static inline void kv_store(uint16_t *dst, const float *src, size_t i, float) {
        dst[i] = tsr_cuda_f32_to_bf16_bits(src[i]);
}
__device__ static inline void kv_store(uint8_t *dst, const float *src, size_t i, float scale) {
        dst[i] = tsr_cuda_f32_to_e4m3(src[i] / scale);
}

// k, v (rows.n, width) -> the cache row of each row's position.  Block r copies row r's
// key and value; its cache row is (table[p / block_size] * block_size + p % block_size),
// table its sequence's.  A table that names one block twice maps two tokens of one
// sequence to one row; ref's loop leaves the later token there, so a row whose cache row
// a later token of its sequence in this call also writes skips its copy (uniform over the
// block: all its threads return together).
// T: float (the values), uint16_t (their bf16 bits) or uint8_t (e4m3(x / scale),
// kernels.h's fp8 view).
template <typename T>
__global__ static void kv_write_kernel(T *k_cache, T *v_cache, tsr_cuda_rows rows, size_t block_size, size_t width,
                                       const float *k, const float *v, float k_scale, float v_scale) {
        size_t r = blockIdx.x, p = rows.pos[r];
        const uint32_t *blocks = rows.tables + rows.table_off[r];
        uint32_t b = blocks[p / block_size];
        for (size_t later = p + block_size; later < rows.end[r]; later += block_size)
                if (blocks[later / block_size] == b)
                        return;
        size_t row = (size_t)b * block_size + p % block_size;
        for (size_t i = threadIdx.x; i < width; i += blockDim.x) {
                kv_store(k_cache + row * width, k + r * width, i, k_scale);
                kv_store(v_cache + row * width, v + r * width, i, v_scale);
        }
}

extern "C" tsr_status tsr_cuda_embedding(cudaStream_t stream, float *out, const void *table, tsr_dtype dtype,
                                         size_t dim, const uint32_t *ids, size_t rows) {
        if (rows == 0)
                return TSR_OK;
        if (dtype == TSR_DTYPE_BF16)
                embedding_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, (const uint16_t *)table, dim, ids);
        else if (dtype == TSR_DTYPE_F32)
                embedding_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, (const float *)table, dim, ids);
        else
                return TSR_E_UNSUPPORTED;
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_kv_write(cudaStream_t stream, void *k_cache, void *v_cache, tsr_dtype dtype,
                                        float k_scale, float v_scale, tsr_cuda_rows rows, size_t block_size,
                                        size_t width, const float *k, const float *v) {
        if (rows.n == 0)
                return TSR_OK;
        if (dtype == TSR_DTYPE_FP8_E4M3)
                kv_write_kernel<<<(unsigned)rows.n, threads, 0, stream>>>(
                        static_cast<uint8_t *>(k_cache), static_cast<uint8_t *>(v_cache), rows, block_size, width, k,
                        v, k_scale, v_scale);
        else if (dtype == TSR_DTYPE_BF16)
                kv_write_kernel<<<(unsigned)rows.n, threads, 0, stream>>>(
                        static_cast<uint16_t *>(k_cache), static_cast<uint16_t *>(v_cache), rows, block_size, width,
                        k, v, k_scale, v_scale);
        else
                kv_write_kernel<<<(unsigned)rows.n, threads, 0, stream>>>(
                        static_cast<float *>(k_cache), static_cast<float *>(v_cache), rows, block_size, width, k, v,
                        k_scale, v_scale);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
