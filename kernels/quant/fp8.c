/* quant/fp8.c - the OCP 8-bit floats (E4M3 "fn" and E5M2) and NVFP4's e2m1, to and from
 * float32: the scalar reference (quant.h has the encodings).
 *
 * Decoding is the formula of each format, (-1)^S * 2^(E - bias) * (1 + M / 2^m) for
 * E > 0 and (-1)^S * 2^(1 - bias) * (M / 2^m) for E = 0, computed with ldexpf: every
 * code's value is exact in float32.  Encoding rounds the magnitude to the format's
 * quantum in its binade with rint() (the default rounding mode: nearest, ties to even),
 * in double so that the division by a power of two is exact, then reads the code back
 * off the rounded value; what happens past the largest finite value is the format's
 * rule (e4m3fn saturates, e5m2 overflows to inf). */
#include <math.h>

#include "kernels/quant/quant.h"

/* A minifloat with `mbits` mantissa bits and exponent bias `bias`: code (without its
 * sign bit) -> magnitude.  e = exponent field, m = mantissa field. */
static float mini_decode(unsigned e, unsigned m, int mbits, int bias) {
        if (e == 0)
                return ldexpf((float)m, 1 - bias - mbits);
        return ldexpf((float)((1u << mbits) | m), (int)e - bias - mbits);
}

/* Round |x| (finite, > 0) to the minifloat grid; returns the rounded magnitude, which
 * may exceed the format's largest finite value (the caller decides what that means). */
static double mini_round(double a, int mbits, int bias) {
        int e2;
        frexp(a, &e2);                          /* a = f * 2^e2, f in [0.5, 1): binade 2^(e2-1) */
        int exp = e2 - 1;
        if (exp < 1 - bias)                     /* subnormal range: the smallest quantum */
                exp = 1 - bias;
        double quantum = ldexp(1.0, exp - mbits);
        return rint(a / quantum) * quantum;
}

/* The code (without sign) of a magnitude r that is exactly on the grid and finite. */
static uint8_t mini_code(double r, int mbits, int bias) {
        if (r == 0)
                return 0;
        int e2;
        frexp(r, &e2);
        int exp = e2 - 1;
        if (exp < 1 - bias)                     /* subnormal: E = 0, M = r / 2^(1-bias-m) */
                return (uint8_t)ldexp(r, bias - 1 + mbits);
        unsigned m = (unsigned)(ldexp(r, mbits - exp) - ldexp(1.0, mbits));
        return (uint8_t)((unsigned)(exp + bias) << mbits | m);
}

float tsr_fp8_e4m3_to_f32(uint8_t v) {
        unsigned e = (v >> 3) & 0xf, m = v & 7;
        float s = v & 0x80 ? -1.0f : 1.0f;
        if (e == 15 && m == 7)                  /* the only NaN; E = 15 is otherwise normal */
                return copysignf(NAN, s);
        return s * mini_decode(e, m, 3, 7);
}

uint8_t tsr_f32_to_fp8_e4m3(float x) {
        uint8_t sign = signbit(x) ? 0x80 : 0;
        if (isnan(x))
                return sign | 0x7f;
        if (x == 0)
                return sign;
        double r = isinf(x) ? 448.0 : mini_round(fabs((double)x), 3, 7);
        if (r > 448.0)                          /* saturate: 480 would be the NaN code */
                r = 448.0;
        return sign | mini_code(r, 3, 7);
}

float tsr_fp8_e5m2_to_f32(uint8_t v) {
        unsigned e = (v >> 2) & 0x1f, m = v & 3;
        float s = v & 0x80 ? -1.0f : 1.0f;
        if (e == 31)
                return copysignf(m ? NAN : INFINITY, s);
        return s * mini_decode(e, m, 2, 15);
}

uint8_t tsr_f32_to_fp8_e5m2(float x) {
        uint8_t sign = signbit(x) ? 0x80 : 0;
        if (isnan(x))
                return sign | 0x7e;             /* quiet: the top mantissa bit set */
        if (x == 0)
                return sign;
        if (isinf(x))
                return sign | 0x7c;
        double r = mini_round(fabs((double)x), 2, 15);
        if (r > 57344.0)                        /* rounded past the largest finite: IEEE overflow */
                return sign | 0x7c;
        return sign | mini_code(r, 2, 15);
}

uint8_t tsr_f32_to_fp8_e5m2_sat(float x) {
        uint8_t c = tsr_f32_to_fp8_e5m2(x);
        return (c & 0x7f) == 0x7c ? (uint8_t)((c & 0x80) | 0x7b) : c;      /* inf -> S.11110.11 = 57344 */
}

float tsr_e2m1_to_f32(uint8_t code) {
        float s = code & 8 ? -1.0f : 1.0f;
        return s * mini_decode((code >> 1) & 3, code & 1, 1, 1);
}

uint8_t tsr_f32_to_e2m1(float x) {
        uint8_t sign = signbit(x) ? 0x8 : 0;
        if (isnan(x))
                return 0x7;
        if (x == 0)
                return sign;
        double r = isinf(x) ? 6.0 : mini_round(fabs((double)x), 1, 1);
        if (r > 6.0)
                r = 6.0;
        return sign | mini_code(r, 1, 1);
}

tsr_status tsr_dequant_fp8_e4m3(const void *src, size_t n, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n))
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++)
                out[i] = tsr_fp8_e4m3_to_f32(p[i]);
        return TSR_OK;
}

tsr_status tsr_dequant_fp8_e5m2(const void *src, size_t n, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n))
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++)
                out[i] = tsr_fp8_e5m2_to_f32(p[i]);
        return TSR_OK;
}
