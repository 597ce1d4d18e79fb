/* qmm_blocks.h - the GGUF blocks' codes in AVX2 registers, shared by the int8
 * matmul's paths: cpu/qmm.c (the GEMV, the VNNI and AVX2 tiles) and cpu/qmm_amx.c (the
 * AMX tiles).  Internal to kernels/cpu, x86 only.  Every function is always-inline with
 * target "avx2,f16c", so a caller of that target or of a superset of it inlines it. */
#ifndef TSR_KERNELS_CPU_QMM_BLOCKS_H
#define TSR_KERNELS_CPU_QMM_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dtype.h"

#define QMM_FN __attribute__((target("avx2,f16c")))
#define QMM_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* An f16 scale -> float32, exact (as tsr_f16_to_f32). */
QMM_INLINE float f16_at(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* ---- unpacking 32-blocks (quant/qmm.c unpack32, vectorised) ---------------------------- */

/* The 32 fifth bits of a q5 block, bit j -> 0x10 in byte j. */
QMM_INLINE __m256i q5_high(uint32_t qh) {
        const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                              3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
        v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
        return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* 16 bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31. */
QMM_INLINE __m256i nibbles(const uint8_t *qs) {
        __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Block j's codes of type T as int8 (q4_0, q5_0, q8_0: signed; q4_1, q5_1: 0..31). */
QMM_INLINE __m256i codes32(const tsr_dtype T, const uint8_t *blk) {
        uint32_t qh;
        if (T == TSR_DTYPE_Q8_0)
                return _mm256_loadu_si256((const __m256i *)(blk + 2));
        if (T == TSR_DTYPE_Q4_0)
                return _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8));
        if (T == TSR_DTYPE_Q4_1)
                return nibbles(blk + 4);
        if (T == TSR_DTYPE_Q5_0) {
                memcpy(&qh, blk + 2, 4);
                return _mm256_sub_epi8(_mm256_or_si256(nibbles(blk + 6), q5_high(qh)), _mm256_set1_epi8(16));
        }
        memcpy(&qh, blk + 4, 4);
        return _mm256_or_si256(nibbles(blk + 8), q5_high(qh));
}

/* ---- the K formats' codes (quant/qmm.c unpack256, vectorised) --------------------------- */

/* Sub-block 4h + k of a q6_K block (0..63, before its -32); hv = qh[32h..32h+31]. */
QMM_INLINE __m256i k6_codes(const uint8_t *blk, __m256i hv, int h, int k) {
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        __m256i lb = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (k % 2)));
        __m256i lo = k < 2 ? _mm256_and_si256(lb, m4) : _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * k), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

/* Sub-blocks 2c (low nibbles) and 2c + 1 (high) of a q4_K / q5_K block (0..15 / 0..31);
 * hv = q5_K's qh[32]. */
QMM_INLINE void k45_codes(tsr_dtype t, const uint8_t *blk, __m256i hv, int c, __m256i *lo, __m256i *hi) {
        const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (t == TSR_DTYPE_Q5_K ? 48 : 16) + 32 * c));
        *lo = _mm256_and_si256(v, m4);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (t == TSR_DTYPE_Q5_K) {
                __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), one);
                __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c + 1), one);
                *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(b0, 4));
                *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(b1, 4));
        }
}

/* Block blk's 256 codes as eight vectors, v[j] = sub-block j's 32 (elements 32j..32j+31),
 * unsigned: q4_K 0..15, q5_K 0..31, q6_K 0..63 (before its -32). */
QMM_INLINE void k_codes(tsr_dtype t, const uint8_t *blk, __m256i v[8]) {
        if (t == TSR_DTYPE_Q6_K) {
                for (int h = 0; h < 2; h++) {
                        __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                        for (int k = 0; k < 4; k++)
                                v[4 * h + k] = k6_codes(blk, hv, h, k);
                }
                return;
        }
        __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int c = 0; c < 4; c++)
                k45_codes(t, blk, hv, c, &v[2 * c], &v[2 * c + 1]);
}

/* Bytes of a 32-block of type T (dtype.c's table, as a constant for the compiler). */
#define BLOCK32_BYTES(T) ((T) == TSR_DTYPE_Q8_0 ? 34 : (T) == TSR_DTYPE_Q4_0 ? 18 : (T) == TSR_DTYPE_Q4_1 ? 20 \
                          : (T) == TSR_DTYPE_Q5_0 ? 22 : 24)
/* Bytes of a K block of type T (q4_K, q5_K, q6_K), the same way. */
#define KBLOCK_BYTES(T) ((T) == TSR_DTYPE_Q4_K ? 144 : (T) == TSR_DTYPE_Q5_K ? 176 : 210)

/* An 8 x 8 transpose of 32-bit elements: afterwards v[s] lane j = the old v[j] lane s. */
QMM_INLINE void transpose8_epi32(__m256i v[8]) {
        __m256i t[8], u[8];
        for (int k = 0; k < 8; k += 2) {
                t[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]);
                t[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);
        }
        for (int k = 0; k < 8; k += 4) {
                u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
                u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
                u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
                u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
        }
        for (int k = 0; k < 4; k++) {
                v[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
                v[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
        }
}

#endif
