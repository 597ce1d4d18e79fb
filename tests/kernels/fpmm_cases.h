/* fpmm_cases.h - the inputs test_cuda_fpmm.c (the device) and test_fpmm_host.cc (the
 * device's arithmetic on the host) give kernels/quant/fpmm.h's matmul: random fp8 / NVFP4
 * weights and activations over magnitudes, with an infinity or a NaN in row 0, from one
 * xorshift stream, and a bitwise comparison that takes NaN for NaN.  C and C++. */
#ifndef TSR_TEST_FPMM_CASES_H
#define TSR_TEST_FPMM_CASES_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

static uint64_t fpmm_rng = 0x9e3779b97f4a7c15ull;
static inline uint64_t fpmm_rnd(void) {     /* xorshift64* */
        fpmm_rng ^= fpmm_rng >> 12, fpmm_rng ^= fpmm_rng << 25, fpmm_rng ^= fpmm_rng >> 27;
        return fpmm_rng * 0x2545f4914f6cdd1dull;
}
static inline float fpmm_frand(void) { return (float)(fpmm_rnd() >> 40) / (float)(1u << 23) - 1.0f; }

/* Random weights of t for (d, n), malloc'd: fp8 codes off the NaN code; NVFP4 blocks with
 * a non-NaN e4m3 scale up to 2^2 and random e2m1 codes.  nan_w: byte 0 (a code, or row
 * 0's first block scale) is the NaN code. */
static inline uint8_t *fpmm_make_w(tsr_dtype t, size_t d, size_t n, bool nan_w, size_t *bytes) {
        size_t row = t == TSR_DTYPE_NVFP4 ? n / 16 * 9 : n;
        uint8_t *w = (uint8_t *)malloc(d * row);
        for (size_t i = 0; i < d * row; i++) {
                uint8_t b = (uint8_t)fpmm_rnd();
                bool scale_byte = t == TSR_DTYPE_NVFP4 && i % row % 9 == 0;
                if ((t == TSR_DTYPE_FP8_E4M3 || scale_byte) && (b & 0x7f) == 0x7f)
                        b ^= 1;
                if (scale_byte && (b & 0x78) > 0x48)
                        b = (uint8_t)((b & 0x87) | 0x40);
                w[i] = b;
        }
        if (nan_w)
                w[0] = 0x7f;
        *bytes = d * row;
        return w;
}

/* x (rows, n), malloc'd: values over magnitudes; xvar 1: +inf at row 0's end, 2: a NaN there. */
static inline float *fpmm_make_x(size_t rows, size_t n, int xvar) {
        float *x = (float *)malloc(rows * n * sizeof(float));
        for (size_t i = 0; i < rows * n; i++) {
                float m = fpmm_frand();
                x[i] = fpmm_frand() * (m > 0.6f ? 30.0f : m < -0.6f ? 1e-3f : 1.0f);
        }
        if (xvar == 1)
                x[n - 1] = INFINITY;
        if (xvar == 2)
                x[n > 2 ? n - 2 : 0] = NAN;
        return x;
}

/* The scales of a case: a weight scale from the stream; the input scale calibrated for
 * |x| <= 30 (fp8: 30 / 448; NVFP4: 30 / (6 x 448)), or 0 (weight-only). */
static inline tsr_matmul_scales fpmm_scales(tsr_dtype t, bool act) {
        tsr_matmul_scales s;
        s.weight = 0.01f + (float)(fpmm_rnd() % 7) * 0.3f;
        s.input = act ? (t == TSR_DTYPE_NVFP4 ? 30.0f / 2688.0f : 30.0f / 448.0f) : 0.0f;
        return s;
}

/* Mismatches of got against want, bit for bit (NaN for NaN); the first few printed. */
static inline size_t fpmm_compare_bitwise(const char *what, const float *got, const float *want, size_t len) {
        size_t bad = 0;
        for (size_t i = 0; i < len; i++) {
                uint32_t a, b;
                memcpy(&a, &got[i], 4), memcpy(&b, &want[i], 4);
                if (a != b && !(isnan(got[i]) && isnan(want[i])) && bad++ < 4)
                        printf("FAIL %s [%zu]: %.9g, cpu-ref %.9g\n", what, i, got[i], want[i]);
        }
        return bad;
}

#endif
