// bf16.cuh - bfloat16 on the device, bit for bit the host's (kernels.h tsr_f32_to_bf16 /
// tsr_bf16_to_f32): shared by elementwise.cu (a bf16 matmul's rounded activations),
// paged.cu (a bf16 KV cache's stores) and attention.cu (its loads).
#ifndef TSR_CUDA_BF16_CUH
#define TSR_CUDA_BF16_CUH

#include <stdint.h>

// Round to nearest, ties to even; a NaN keeps its sign and top payload and is made quiet.
__device__ static inline uint16_t tsr_cuda_f32_to_bf16_bits(float x) {
        uint32_t u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u)
                return (uint16_t)((u >> 16) | 0x0040u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (uint16_t)(u >> 16);
}

// Exact: a bf16 is the top half of a float32.
__device__ static inline float tsr_cuda_bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

#endif
