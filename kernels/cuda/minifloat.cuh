// minifloat.cuh - fp8 e4m3 and NVFP4's e2m1 on the device, bit for bit quant/fp8.c's
// encoders and decoders (the CPU reference): shared by paged.cu (fp8 KV stores),
// attention.cu (fp8 KV loads) and fpmm.cu (the fp8 / NVFP4 matmul's activations and
// weights).  The encoders run quant/fp8.c's steps in the same double arithmetic (frexp,
// ldexp and the division by a power of two are exact, rint rounds to nearest even), so
// every code is the CPU's.
#ifndef TSR_CUDA_MINIFLOAT_CUH
#define TSR_CUDA_MINIFLOAT_CUH

#include <math.h>
#include <stdint.h>

// |x| (finite, > 0) rounded to the grid of a minifloat with `mbits` mantissa bits and
// exponent bias `bias`; may exceed the format's largest value (the caller saturates).
__device__ static inline double tsr_cuda_mini_round(double a, int mbits, int bias) {
        int e2;
        frexp(a, &e2);
        int exp = e2 - 1 < 1 - bias ? 1 - bias : e2 - 1;        // subnormals: the smallest quantum
        double quantum = ldexp(1.0, exp - mbits);
        return rint(a / quantum) * quantum;
}

// The code (without sign) of a magnitude r exactly on the grid and finite.
__device__ static inline uint8_t tsr_cuda_mini_code(double r, int mbits, int bias) {
        if (r == 0)
                return 0;
        int e2;
        frexp(r, &e2);
        int exp = e2 - 1;
        if (exp < 1 - bias)                                     // subnormal: E = 0
                return (uint8_t)ldexp(r, bias - 1 + mbits);
        unsigned m = (unsigned)(ldexp(r, mbits - exp) - ldexp(1.0, mbits));
        return (uint8_t)((unsigned)(exp + bias) << mbits | m);
}

// A non-NaN x as sign | the code of its magnitude rounded to the grid, an infinity or a
// magnitude past `max` saturating there (e4m3fn and e2m1 have no infinity).
__device__ static inline uint8_t tsr_cuda_mini_encode(float x, uint8_t sign, int mbits, int bias, double max) {
        if (x == 0)
                return sign;
        double r = isinf(x) ? max : tsr_cuda_mini_round(fabs((double)x), mbits, bias);
        return sign | tsr_cuda_mini_code(r > max ? max : r, mbits, bias);
}

// tsr_f32_to_fp8_e4m3: e4m3fn, saturating at +-448, NaN -> S.1111.111.
__device__ static inline uint8_t tsr_cuda_f32_to_e4m3(float x) {
        uint8_t sign = signbit(x) ? 0x80 : 0;
        return isnan(x) ? sign | 0x7f : tsr_cuda_mini_encode(x, sign, 3, 7, 448.0);
}

// tsr_fp8_e4m3_to_f32: (-1)^S 2^(E-7) (1 + M/8), E = 0: (-1)^S 2^-6 (M/8); S.1111.111 is NaN.
__device__ static inline float tsr_cuda_e4m3_to_f32(unsigned v) {
        unsigned e = (v >> 3) & 0xf, m = v & 7;
        float s = v & 0x80 ? -1.0f : 1.0f;
        if (e == 15 && m == 7)
                return copysignf(NAN, s);
        return s * (e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 | m), (int)e - 10));
}

// tsr_f32_to_e2m1: saturating at +-6; NaN -> +6 (0x7), as quant/fp8.c.
__device__ static inline uint8_t tsr_cuda_f32_to_e2m1(float x) {
        return isnan(x) ? 0x7 : tsr_cuda_mini_encode(x, signbit(x) ? 0x8 : 0, 1, 1, 6.0);
}

// tsr_e2m1_to_f32 of a code's low 4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 with its sign (code
// 8 is -0).
__device__ static inline float tsr_cuda_e2m1_to_f32(unsigned code) {
        float mag = (code & 6) == 0 ? 0.5f * (float)(code & 1) : ldexpf((float)(2 | (code & 1)), (int)((code >> 1) & 3) - 2);
        return code & 8 ? -mag : mag;
}

// tsr_fpmm_e2m1_x2: twice the e2m1 value, an integer in -12..12.
__device__ static inline int tsr_cuda_e2m1_x2(unsigned code) {
        int mag = (code & 6) == 0 ? (int)(code & 1) : (2 | (int)(code & 1)) << (((code >> 1) & 3) - 1);
        return code & 8 ? -mag : mag;
}

#endif
