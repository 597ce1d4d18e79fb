/* exp.h - the exp() of the attention softmax and of silu: one definition, in three forms
 * that give the same bits.  Internal to kernels/cpu: ref.c runs the scalar form (the
 * specification), fast.c the 8-lane AVX2 and 16-lane AVX-512 forms.
 *
 * libm's expf cannot be the reference's once the fast backend must match it bit for bit:
 * no vector form gives its bits, and it cost fast.c's attention about a fifth of its time
 * in scalar calls.  This one is the same few operations in every form, so lane i of the
 * vector forms is the scalar form of x[i] (every step is an IEEE operation rounded once:
 * fmaf is one fused multiply-add in each form, the integer steps are exact):
 *
 *   x clamped to [-104, 89] (exp(-104) rounds to 0 and exp(89) overflows, so nothing
 *     changes; a NaN stays NaN: the comparisons are written so that it falls through)
 *   n = round-to-nearest-even(x / ln2), by fmaf(x, 1/ln2, 1.5 * 2^23) (the shift leaves n
 *     in the low bits of the sum's significand)
 *   r = x - n ln2 in two fmaf steps (ln2 split in a float and the rest), |r| <= 0.35
 *   exp(r) = 1 + (r + r^2 P(r)), P Cephes' degree-5 expf polynomial, Horner with fmaf
 *   times 2^n as two factors 2^(n >> 1) and 2^(n - (n >> 1)), each a normal float, so a
 *     result in the subnormal range is rounded once, like any other, and one past FLT_MAX
 *     is +inf
 *
 * Accuracy (every float in [-104, 89], 2.24e9 of them, against exp() in double; the
 * unit test samples them): at most 1.013 ulp (1.010 for x <= 0), 99.2% correctly
 * rounded (glibc's expf: 0.502 ulp); exp(0) = 1, exp(-inf) = 0, exp(+inf) = +inf,
 * exp(NaN) = NaN.  The softmax's inputs are s - max s
 * <= 0, so its terms are in (0, 1] and the largest is exactly 1. */
#ifndef TSR_KERNELS_CPU_EXP_H
#define TSR_KERNELS_CPU_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TSR_EXP_LO (-104.0f)
#define TSR_EXP_HI 89.0f
#define TSR_EXP_INV_LN2 0x1.715476p+0f
#define TSR_EXP_SHIFT 0x1.8p23f         /* 1.5 * 2^23: n + shift has n in its low bits */
#define TSR_EXP_LN2_HI 0x1.62e43p-1f    /* float(ln 2) */
#define TSR_EXP_LN2_LO (-0x1.05c61p-29f) /* ln 2 - float(ln 2) */
/* Cephes expf: exp(r) ~ 1 + r + r^2 (P5 + r (P4 + r (P3 + ...))) on |r| <= ln2 / 2 */
#define TSR_EXP_P0 1.9875691500e-4f
#define TSR_EXP_P1 1.3981999507e-3f
#define TSR_EXP_P2 8.3334519073e-3f
#define TSR_EXP_P3 4.1665795894e-2f
#define TSR_EXP_P4 1.6666665459e-1f
#define TSR_EXP_P5 5.0000001201e-1f

static inline float tsr_exp_bits_f(uint32_t u) {
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
}

/* exp(x), the specification (see above). */
static inline float tsr_exp(float x) {
        x = TSR_EXP_LO > x ? TSR_EXP_LO : x;    /* NaN compares false and stays */
        x = TSR_EXP_HI < x ? TSR_EXP_HI : x;
        float z = fmaf(x, TSR_EXP_INV_LN2, TSR_EXP_SHIFT);
        float n = z - TSR_EXP_SHIFT;
        float r = fmaf(n, -TSR_EXP_LN2_HI, x);
        r = fmaf(n, -TSR_EXP_LN2_LO, r);
        float p = TSR_EXP_P0;
        p = fmaf(p, r, TSR_EXP_P1);
        p = fmaf(p, r, TSR_EXP_P2);
        p = fmaf(p, r, TSR_EXP_P3);
        p = fmaf(p, r, TSR_EXP_P4);
        p = fmaf(p, r, TSR_EXP_P5);
        float y = fmaf(p, r * r, r) + 1.0f;
        uint32_t zb, sb;
        float shift = TSR_EXP_SHIFT;
        memcpy(&zb, &z, sizeof zb);
        memcpy(&sb, &shift, sizeof sb);
        /* n in [-150, 128]; both halves in [-75, 64], so 127 + half is a normal exponent */
        int32_t k = (int32_t)(zb - sb), k1 = k >> 1, k2 = k - k1;
        return y * tsr_exp_bits_f((uint32_t)(k1 + 127) << 23) * tsr_exp_bits_f((uint32_t)(k2 + 127) << 23);
}

#if defined(__x86_64__)
#include <immintrin.h>

/* tsr_exp on 8 lanes (tsr_exp8: AVX2 + FMA) and on 16 (tsr_exp16: AVX-512F), one body
 * for both so that they cannot drift apart: V(op) is _mm256_op or _mm512_op, CASTI / CASTF
 * the width's float <-> int reinterpretations.  max_ps(a, b) is a > b ? a : b and
 * min_ps(a, b) a < b ? a : b: the scalar form's comparisons, a NaN x returned as it is. */
#define TSR_EXP_VEC(NAME, TARGET, VF, VI, V, CASTI, CASTF)                                                  \
        static inline __attribute__((always_inline, target(TARGET))) VF NAME(VF x) {                        \
                x = V(max_ps)(V(set1_ps)(TSR_EXP_LO), x);                                                    \
                x = V(min_ps)(V(set1_ps)(TSR_EXP_HI), x);                                                    \
                VF z = V(fmadd_ps)(x, V(set1_ps)(TSR_EXP_INV_LN2), V(set1_ps)(TSR_EXP_SHIFT));               \
                VF n = V(sub_ps)(z, V(set1_ps)(TSR_EXP_SHIFT));                                              \
                VF r = V(fmadd_ps)(n, V(set1_ps)(-TSR_EXP_LN2_HI), x);                                       \
                r = V(fmadd_ps)(n, V(set1_ps)(-TSR_EXP_LN2_LO), r);                                          \
                VF p = V(set1_ps)(TSR_EXP_P0);                                                               \
                p = V(fmadd_ps)(p, r, V(set1_ps)(TSR_EXP_P1));                                               \
                p = V(fmadd_ps)(p, r, V(set1_ps)(TSR_EXP_P2));                                               \
                p = V(fmadd_ps)(p, r, V(set1_ps)(TSR_EXP_P3));                                               \
                p = V(fmadd_ps)(p, r, V(set1_ps)(TSR_EXP_P4));                                               \
                p = V(fmadd_ps)(p, r, V(set1_ps)(TSR_EXP_P5));                                               \
                VF y = V(add_ps)(V(fmadd_ps)(p, V(mul_ps)(r, r), r), V(set1_ps)(1.0f));                      \
                VI k = V(sub_epi32)(CASTI(z), CASTI(V(set1_ps)(TSR_EXP_SHIFT)));                             \
                VI k1 = V(srai_epi32)(k, 1), k2 = V(sub_epi32)(k, k1), bias = V(set1_epi32)(127);            \
                VF s1 = CASTF(V(slli_epi32)(V(add_epi32)(k1, bias), 23));                                    \
                VF s2 = CASTF(V(slli_epi32)(V(add_epi32)(k2, bias), 23));                                    \
                return V(mul_ps)(V(mul_ps)(y, s1), s2);                                                      \
        }

#define TSR_EXP_V256(op) _mm256_##op
#define TSR_EXP_V512(op) _mm512_##op
TSR_EXP_VEC(tsr_exp8, "avx2,fma", __m256, __m256i, TSR_EXP_V256, _mm256_castps_si256, _mm256_castsi256_ps)
TSR_EXP_VEC(tsr_exp16, "avx512f", __m512, __m512i, TSR_EXP_V512, _mm512_castps_si512, _mm512_castsi512_ps)
#undef TSR_EXP_V256
#undef TSR_EXP_V512
#undef TSR_EXP_VEC
#endif

#endif
