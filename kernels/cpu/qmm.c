/* cpu/qmm.c - the int8 matmul on GGUF blocks with AVX2 (and AVX-512 VNNI where the CPU
 * has it), bitwise quant/qmm.c's.
 *
 * Why it is bitwise the reference: the activation rows are quantized by the reference's
 * own function (tsr_qmm_quantize_row; for the 32-block formats quantize32_row, its
 * vectorised twin, step for step); the weight rows are unpacked to the same integers
 * and the same float scales (f16 -> f32 through F16C is exact, as tsr_f16_to_f32 is);
 * the integer block sums are exact in any order; and the float32 terms of each block are
 * computed with the same operations in the same order, eight blocks at a time in one
 * __m256 whose lane j is the reference's lane j (block b goes to lane b % 8; the 512-bit
 * tiles hold two activation rows' eight lanes side by side).  Lanes past
 * the last block add +0, which leaves a lane unchanged (a lane that starts at +0 is never
 * -0).  The final lane sum is the reference's pair tree.
 *
 * Work split: weight rows in tasks of QMM_ROWS_PER_TASK across the backend's pool, each
 * thread taking its tasks from one contiguous span of W (tsr_pool_run_spans: one long
 * stream per core for the prefetchers, rather than every other 16 rows), so W is read
 * from memory once per call.  Three paths: one activation row (the decode GEMV) decodes
 * the weight blocks in registers, eight at a time; several rows of any format
 * go through register tiles over interleaved copies of the task's rows (for the K
 * formats, lane j = sub-block j of a 256-block); and from QMM_AMX_MIN_ROWS rows of any
 * format, on CPUs with AMX-INT8, AMX tiles (cpu/qmm_amx.c).  No split of K,
 * and every path computes the reference's terms in its order, so the path, the tiling
 * and the thread count change nothing (kernels.h batch invariance).
 *
 * Thread: the backend's driving thread plus its pool's helpers (pool.h). */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/qmm.h"
#include "kernels/cpu/qmm_amx.h"
#include "kernels/quant/qmm.h"
#include "kernels/quant/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#define QMM_X86 1
#include <immintrin.h>
#endif

/* Weight rows per pool task: d = 576 still gives 36 tasks to share. */
#define QMM_ROWS_PER_TASK 16

/* Activation rows from which the AMX-INT8 tiles take over where the CPU has them.
 * Measured (SmolLM2's 576 x 1536 and 1536 x 576, one and two threads): at 16 rows the
 * VNNI tiles were 5-20% faster, at 32 about even, from 48 AMX won by 10-45%; the K
 * formats (q4_K, q6_K; 1536 x 576 and 2048 x 2048, one thread) at 32 rows 0-20% faster
 * on AMX, from 48 10-35%. */
#define QMM_AMX_MIN_ROWS 32

#ifdef QMM_X86

#include "kernels/cpu/qmm_blocks.h"

/* ---- dot products --------------------------------------------------------------------- */

/* The eight block sums of v[0..7] (eight int32 partials each) as one vector, lane j = block j. */
QMM_INLINE __m256i hsum8_epi32(const __m256i v[8]) {
        __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
        __m256i c = _mm256_hadd_epi32(v[4], v[5]), e = _mm256_hadd_epi32(v[6], v[7]);
        a = _mm256_hadd_epi32(a, b);    /* lo half: 0 1 2 3 of the low 128s; hi half: of the high 128s */
        c = _mm256_hadd_epi32(c, e);
        __m256i lo = _mm256_permute2x128_si256(a, c, 0x20), hi = _mm256_permute2x128_si256(a, c, 0x31);
        return _mm256_add_epi32(lo, hi);
}

QMM_INLINE int32_t hsum_epi32(__m256i v) {
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        return _mm_cvtsi128_si32(s);
}

/* The reference's ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). */
QMM_INLINE float lanes_sum(__m256 v) {
        __m256 t = _mm256_hadd_ps(v, v);
        t = _mm256_hadd_ps(t, t);
        return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* ---- one activation row: the weight blocks decoded in registers --------------------------
 * The decode GEMV (rows == 1) reads each weight row once and uses it once, so unpacking
 * it to scratch first only adds a store and a load per block: here each block goes from
 * the file's bytes to the integer sum directly (a horizontal sum per eight blocks), then
 * the reference's float terms and lanes.  Signed codes take the sign trick (maddubs of
 * |w| and q with w's sign: pairs at most 2 * 128 * 127, no saturation); q4_1 and q5_1
 * codes are unsigned (0..31): one maddubs as they are.  The row's whole groups of eight
 * blocks run without a tail check; only the last, partial group masks its lanes.
 *
 * The weights stream from memory at this batch (97 MB a token for SmolLM2 Q4_1), so each
 * group also prefetches the bytes QMM_PREFETCH ahead, the rows after it in its thread's
 * span (tsr_pool_run_spans): a few percent over the hardware prefetchers alone
 * (docs/benchmarks.md, issue #21). */

#define QMM_PREFETCH 4096

/* Blocks b..b+7 of one weight row (wrow at block b, q at the activations' block b) -> the
 * float32 terms t_b in lanes 0..7; lanes at and past `live` (8, or fewer at the row's
 * end) read nothing and are +0. */
QMM_INLINE __m256 dot32_group_t(const tsr_dtype T, const uint8_t *wrow, const int8_t *q, __m256 dx, __m256 sx,
                                size_t live) {
        const size_t bb = BLOCK32_BYTES(T);
        const bool has_m = T == TSR_DTYPE_Q4_1 || T == TSR_DTYPE_Q5_1;
        /* The eight blocks' first four bytes (f16 d, then f16 m or codes) in one gather;
         * bytes 0-1 / 2-3 of each lane packed into eight f16s. */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)bb));
        const __m256i pick_d = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m256i pick_m = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i v[8], head;

        /* A prefetch never faults, so one past the end of W is harmless. */
        for (size_t o = 0; o < 8 * bb; o += 64)
                _mm_prefetch((const char *)wrow + QMM_PREFETCH + o, _MM_HINT_T0);
        if (live == 8) {
                head = _mm256_i32gather_epi32((const int *)wrow, offs, 1);
        } else {        /* lanes past the row stay 0 (f16 0: a zero term) */
                __m256i on = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live), lane);
                head = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)wrow, offs, on, 1);
        }
#pragma GCC unroll 8
        for (size_t j = 0; j < 8; j++) {
                if (j >= live) {
                        v[j] = _mm256_setzero_si256();
                        continue;
                }
                __m256i w = codes32(T, wrow + j * bb), qv = _mm256_load_si256((const __m256i *)(q + 32 * j));
                __m256i p16 = has_m ? _mm256_maddubs_epi16(w, qv)
                                    : _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(qv, w));
                v[j] = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
        }
        __m256 s = _mm256_cvtepi32_ps(hsum8_epi32(v));
        __m256i dp = _mm256_shuffle_epi8(head, pick_d);
        __m256 dw = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(dp), _mm256_extracti128_si256(dp, 1)));
        __m256 mw = _mm256_setzero_ps();
        if (has_m) {
                __m256i mp = _mm256_shuffle_epi8(head, pick_m);
                mw = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(mp), _mm256_extracti128_si256(mp, 1)));
        }
        __m256 dd = _mm256_mul_ps(dw, dx);
        return _mm256_add_ps(_mm256_mul_ps(dd, s), _mm256_mul_ps(mw, sx));
}

QMM_INLINE float dot32_fused_t(const tsr_dtype T, const uint8_t *wrow, const tsr_qmm_act *a, size_t n) {
        const size_t bb = BLOCK32_BYTES(T);
        size_t nb = n / 32, b = 0;
        __m256 acc = _mm256_setzero_ps();

        for (; b + 8 <= nb; b += 8)
                acc = _mm256_add_ps(acc, dot32_group_t(T, wrow + b * bb, a->q + 32 * b, _mm256_load_ps(a->dx + b),
                                                       _mm256_load_ps(a->sx + b), 8));
        if (b < nb)
                acc = _mm256_add_ps(acc, dot32_group_t(T, wrow + b * bb, a->q + 32 * b, _mm256_load_ps(a->dx + b),
                                                       _mm256_load_ps(a->sx + b), nb - b));
        return lanes_sum(acc);
}

QMM_FN static float dot32_fused(tsr_dtype t, const uint8_t *wrow, const tsr_qmm_act *a, size_t n) {
        switch (t) {
        case TSR_DTYPE_Q8_0: return dot32_fused_t(TSR_DTYPE_Q8_0, wrow, a, n);
        case TSR_DTYPE_Q4_0: return dot32_fused_t(TSR_DTYPE_Q4_0, wrow, a, n);
        case TSR_DTYPE_Q4_1: return dot32_fused_t(TSR_DTYPE_Q4_1, wrow, a, n);
        case TSR_DTYPE_Q5_0: return dot32_fused_t(TSR_DTYPE_Q5_0, wrow, a, n);
        default: return dot32_fused_t(TSR_DTYPE_Q5_1, wrow, a, n);
        }
}

/* The K formats' GEMV the same way: blocks b..b+7 of one weight row straight from the
 * file's bytes.  Per block, with its codes unsigned (k_codes: q6_K before its -32) and
 * the activation codes signed, each sub-block of 32 takes one maddubs (pairs at most
 * 2 * 63 * 127: no saturation) and one madd against its scale (q6_K: the scale of each
 * half, its two groups of 16), exact in int32 (|I1| < 2^28); the mins (q6_K: the scales,
 * as the -32 comes back out: I1 = sum sc (c - 32) q = that - 32 sum_g sc_g qsum_g) meet
 * the activation sums of 16 in one madd.  The eight blocks' partial sums then go through
 * hsum8_epi32 (lane j = block b + j's I1 / I2) and the reference's float terms,
 * t = (d*dx) * (float)I1 - (dmin*dx) * (float)I2 (q6_K: dmin = 0 and I2 = 0, as
 * unpack256 has them).  Lanes past `live` are +0: d = dmin = 0 and dx's padding 0. */
/* A q4_K / q5_K block's eight 6-bit scales and mins (tsr_gguf_k_scale_min), byte j of
 * *scs / *mns = sub-block j's, four at a time from 32-bit words. */
QMM_INLINE void k45_scale_bytes(const uint8_t *blk, uint64_t *scs, uint64_t *mns) {
        uint32_t u0, u1, u2;
        memcpy(&u0, blk + 4, 4), memcpy(&u1, blk + 8, 4), memcpy(&u2, blk + 12, 4);
        *scs = (uint64_t)(u0 & 0x3f3f3f3f) | (uint64_t)((u2 & 0x0f0f0f0f) | ((u0 >> 6) & 0x03030303) << 4) << 32;
        *mns = (uint64_t)(u1 & 0x3f3f3f3f) |
               (uint64_t)(((u2 >> 4) & 0x0f0f0f0f) | ((u1 >> 6) & 0x03030303) << 4) << 32;
}

/* I2's partials: each sub-block's min (twice, for its two groups of 16) times the
 * activation sums of 16, one madd. */
QMM_INLINE __m256i k45_min_sums(uint64_t mns, __m256i qsum) {
        __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mns));     /* mn_0 .. mn_7 */
        return _mm256_madd_epi16(_mm256_setr_m128i(_mm_unpacklo_epi16(m8, m8), _mm_unpackhi_epi16(m8, m8)), qsum);
}

/* Eight blocks' I1 / I2 partials (v1[j], v2[j]: block j's) -> their float terms,
 * t = (d*dx) * (float)I1 - (dmin*dx) * (float)I2; q6: v2 holds sum_g sc_g qsum_g, so
 * I1 -= 32 * that and I2 = 0 (dmin is 0). */
QMM_INLINE __m256 k_group_terms(bool q6, const __m256i v1[8], const __m256i v2[8], const float d[8],
                                const float dmin[8], __m256 dx) {
        __m256i i1 = hsum8_epi32(v1), i2 = hsum8_epi32(v2);
        if (q6) {
                i1 = _mm256_sub_epi32(i1, _mm256_slli_epi32(i2, 5));
                i2 = _mm256_setzero_si256();
        }
        __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(d), dx), dm = _mm256_mul_ps(_mm256_loadu_ps(dmin), dx);
        return _mm256_sub_ps(_mm256_mul_ps(dd, _mm256_cvtepi32_ps(i1)), _mm256_mul_ps(dm, _mm256_cvtepi32_ps(i2)));
}

QMM_INLINE __m256 dotk_group_t(const tsr_dtype T, const uint8_t *wrow, const tsr_qmm_act *a, size_t b0,
                               size_t live) {
        const size_t bb = KBLOCK_BYTES(T);
        __m256i v1[8], v2[8];
        float d[8] = {0}, dmin[8] = {0};

#pragma GCC unroll 8
        for (size_t j = 0; j < 8; j++) {
                if (j >= live) {
                        v1[j] = v2[j] = _mm256_setzero_si256();
                        continue;
                }
                const uint8_t *blk = wrow + j * bb;
                const int8_t *q = a->q + 256 * (b0 + j);
                __m256i qsum = _mm256_loadu_si256((const __m256i *)(a->qsum + 16 * (b0 + j)));
                __m256i c[8], acc = _mm256_setzero_si256();
                for (size_t o = 0; o < bb; o += 64)
                        _mm_prefetch((const char *)blk + QMM_PREFETCH + o, _MM_HINT_T0);
                k_codes(T, blk, c);
                if (T == TSR_DTYPE_Q6_K) {
                        const int8_t *sc = (const int8_t *)blk + 192;
                        for (int s = 0; s < 8; s++) {
                                __m256i p16 = _mm256_maddubs_epi16(c[s], _mm256_loadu_si256((const __m256i *)(q + 32 * s)));
                                __m256i scv = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * s]), _mm_set1_epi16(sc[2 * s + 1]));
                                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, scv));
                        }
                        v2[j] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)), qsum);
                        d[j] = f16_at(blk + 208);
                } else {
                        /* the eight 6-bit scales and mins (tsr_gguf_k_scale_min), four at a time */
                        uint64_t scs, mns;
                        k45_scale_bytes(blk, &scs, &mns);
                        for (int s = 0; s < 8; s++) {
                                __m256i p16 = _mm256_maddubs_epi16(c[s], _mm256_loadu_si256((const __m256i *)(q + 32 * s)));
                                __m256i scv = _mm256_set1_epi16((short)(scs >> 8 * s & 0xff));
                                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, scv));
                        }
                        v2[j] = k45_min_sums(mns, qsum);
                        d[j] = f16_at(blk);
                        dmin[j] = f16_at(blk + 2);
                }
                v1[j] = acc;
        }
        return k_group_terms(T == TSR_DTYPE_Q6_K, v1, v2, d, dmin, _mm256_load_ps(a->dx + b0));
}

QMM_INLINE float dotk_fused_t(const tsr_dtype T, const uint8_t *wrow, const tsr_qmm_act *a, size_t n) {
        const size_t bb = KBLOCK_BYTES(T);
        size_t nb = n / 256, b = 0;
        __m256 acc = _mm256_setzero_ps();

        for (; b + 8 <= nb; b += 8)
                acc = _mm256_add_ps(acc, dotk_group_t(T, wrow + b * bb, a, b, 8));
        if (b < nb)
                acc = _mm256_add_ps(acc, dotk_group_t(T, wrow + b * bb, a, b, nb - b));
        return lanes_sum(acc);
}

QMM_FN static float dotk_fused(tsr_dtype t, const uint8_t *wrow, const tsr_qmm_act *a, size_t n) {
        switch (t) {
        case TSR_DTYPE_Q4_K: return dotk_fused_t(TSR_DTYPE_Q4_K, wrow, a, n);
        case TSR_DTYPE_Q5_K: return dotk_fused_t(TSR_DTYPE_Q5_K, wrow, a, n);
        default: return dotk_fused_t(TSR_DTYPE_Q6_K, wrow, a, n);
        }
}

/* q4_K / q5_K the same with 512-bit vectors where the backend runs AVX-512 (BW): a zmm
 * holds a pair of sub-blocks' codes (the low and the high nibbles of 32 bytes), so each
 * pair takes one maddubs and one madd against the two scales side by side (vpermw out of
 * the block's eight); the pair's int32 partials fold into eight lanes (exact, any order)
 * and go on as above: the same integers, so the same terms and bits.  Measured on a Xeon
 * (docs/benchmarks.md, issue #21): q4_K 17% faster than the ymm loop on one thread, q5_K
 * even; q6_K, whose codes take more shuffling per pair, was 14% slower and keeps the ymm
 * loop. */
#define QMM_Z_TARGET "avx2,f16c,avx512f,avx512bw,avx512vl"
#define QMM_Z_INLINE static inline __attribute__((always_inline, target(QMM_Z_TARGET)))

/* Sub-blocks 2c and 2c + 1 of a q4_K / q5_K block (codes unsigned). */
QMM_Z_INLINE __m512i kz_codes(const tsr_dtype T, const uint8_t *blk, int c) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (T == TSR_DTYPE_Q5_K ? 48 : 16) + 32 * c));
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
        __m512i codes = _mm512_and_si512(
                _mm512_srlv_epi16(z, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1)),
                _mm512_set1_epi8(0x0f));
        if (T == TSR_DTYPE_Q5_K) {
                __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 16));
                __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hv), hv, 1);
                __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
                __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hz, sh), _mm512_set1_epi8(1));
                codes = _mm512_or_si512(codes, _mm512_slli_epi16(hi, 4));
        }
        return codes;
}

QMM_Z_INLINE __m256 dotk_group_z_t(const tsr_dtype T, const uint8_t *wrow, const tsr_qmm_act *a, size_t b0,
                                   size_t live) {
        const size_t bb = KBLOCK_BYTES(T);
        __m256i v1[8], v2[8];
        float d[8] = {0}, dmin[8] = {0};

#pragma GCC unroll 8
        for (size_t j = 0; j < 8; j++) {
                if (j >= live) {
                        v1[j] = v2[j] = _mm256_setzero_si256();
                        continue;
                }
                const uint8_t *blk = wrow + j * bb;
                const int8_t *q = a->q + 256 * (b0 + j);
                __m256i qsum = _mm256_loadu_si256((const __m256i *)(a->qsum + 16 * (b0 + j)));
                __m512i acc = _mm512_setzero_si512();
                for (size_t o = 0; o < bb; o += 64)
                        _mm_prefetch((const char *)blk + QMM_PREFETCH + o, _MM_HINT_T0);
                uint64_t scs, mns;
                k45_scale_bytes(blk, &scs, &mns);
                __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scs)));
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                        __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)),
                                                         _mm256_set1_epi16((short)(2 * c + 1)), 1);
                        __m512i p16 = _mm512_maddubs_epi16(kz_codes(T, blk, c),
                                                           _mm512_loadu_si512((const void *)(q + 64 * c)));
                        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_permutexvar_epi16(idx, scales)));
                }
                v2[j] = k45_min_sums(mns, qsum);
                d[j] = f16_at(blk);
                dmin[j] = f16_at(blk + 2);
                v1[j] = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
        }
        return k_group_terms(false, v1, v2, d, dmin, _mm256_load_ps(a->dx + b0));
}

QMM_Z_INLINE float dotk_fused_z_t(const tsr_dtype T, const uint8_t *wrow, const tsr_qmm_act *a, size_t n) {
        const size_t bb = KBLOCK_BYTES(T);
        size_t nb = n / 256, b = 0;
        __m256 acc = _mm256_setzero_ps();

        for (; b + 8 <= nb; b += 8)
                acc = _mm256_add_ps(acc, dotk_group_z_t(T, wrow + b * bb, a, b, 8));
        if (b < nb)
                acc = _mm256_add_ps(acc, dotk_group_z_t(T, wrow + b * bb, a, b, nb - b));
        return lanes_sum(acc);
}

/* q4_K or q5_K only. */
__attribute__((target(QMM_Z_TARGET))) static float dotk_fused_z(tsr_dtype t, const uint8_t *wrow,
                                                                const tsr_qmm_act *a, size_t n) {
        return t == TSR_DTYPE_Q4_K ? dotk_fused_z_t(TSR_DTYPE_Q4_K, wrow, a, n)
                                   : dotk_fused_z_t(TSR_DTYPE_Q5_K, wrow, a, n);
}

/* ---- many activation rows: register tiles over block-interleaved rows ---------------------
 * With a batch, each weight row meets every activation row, and the GEMV's way (one
 * block per vector, then a horizontal sum to turn eight vectors of partial sums into the
 * eight block sums) spends most of each (weight row, activation row, eight blocks) on
 * that sum.  Here both operands are laid out so that no horizontal sum is needed: per
 * group of eight blocks, 32-byte step
 * s holds bytes 4s..4s+3 of block 0, of block 1, ..., of block 7, so one four-byte
 * multiply-add per 32-bit lane (maddubs + madd, or VNNI's vpdpbusd) adds to lane j a
 * part of block j's sum, and eight steps leave lane j = block j's integer sum I_j: the
 * block sums of the reference, exactly (integers, any order).  The float32 terms and
 * lanes are then the reference's, in its order, so the result is bitwise the reference's
 * and the same for a row alone or in any batch or tile.
 *
 * Codes are stored as unsigned bytes (maddubs and vpdpbusd take one unsigned operand):
 * q4_1 / q5_1 as they are, q4_0 + 8, q5_0 + 16, q8_0 + 128 (VNNI only), and the offset
 * is taken back out in integers, I_j = sum (w + o) q - o * sum q, with the activation
 * block's sum of codes kept (times o) beside it.  Without VNNI, q8_0 keeps signed codes
 * and the sign trick (maddubs of 255 * 127 pairs would saturate).
 *
 * A task unpacks its (up to QMM_ROWS_PER_TASK) weight rows once, then walks the
 * activation rows QMM_TILE_A at a time and, for each such tile, its weight rows
 * QMM_TILE_W_* at a time: RW x RA accumulators in registers, each weight step loaded
 * once per RA rows and each activation step once per RW rows.  A partial tile repeats
 * its last row and drops the repeated results.
 *
 * Measured (docs/benchmarks.md, issue #21): SmolLM2 Q4_1, one thread, Zen 5 with VNNI,
 * decode batch 8 235 -> 320 tok/s, batch 32 245 -> 400, prefill 128 394 -> 690; batch
 * 2-3 even.  Unpacking the weight rows is what a small batch pays for: whole groups take
 * plain loads and a 4 x 4 transpose (gathers were 10% slower), only a row's last,
 * partial group gathers under a mask. */

#define QMM_TILE_A 4
#define QMM_TILE_W_AVX2 2               /* 8 accumulators + operands in 16 ymm registers */
#define QMM_TILE_W_VNNI 4               /* the zmm tiles (below): 4 x 2 pairs of accumulators */
#define QMM_TILE_W_MAX 4

/* Bytes per interleaved row: codes (groups x 256), then dw and mw for weights or the
 * offset sums o * S (int32) for activations (groups x 8 each). */
static inline size_t ilv_groups(size_t n) { return (n / 32 + 7) / 8; }
static inline size_t ilv_w_bytes(size_t n) { return ilv_groups(n) * (256 + 2 * 32); }
static inline size_t ilv_a_bytes(size_t n) { return ilv_groups(n) * (256 + 32); }

/* The offset o of T's stored codes (above) with VNNI or without. */
static int32_t ilv_offset(tsr_dtype t, bool vnni) {
        switch (t) {
        case TSR_DTYPE_Q4_0: return 8;
        case TSR_DTYPE_Q5_0: return 16;
        case TSR_DTYPE_Q8_0: return vnni ? 128 : 0;
        default: return 0;
        }
}

/* Step s of a group from its eight blocks' fifth bits: byte k of lane j gets 0x10 when
 * bit 4s + k of qh (lane j: block j's 32 fifth bits) is set. */
QMM_INLINE __m256i ilv_q5_high(__m256i qh, int s) {
        const __m256i low_byte = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                  0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
        const __m256i bit = _mm256_set1_epi32(0x08040201);
        __m256i v = _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 4 * s), low_byte);
        v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
        return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

static inline uint32_t rd32(const uint8_t *p) {
        uint32_t v;
        memcpy(&v, p, 4);
        return v;
}

/* Dword `off` of each of eight whole blocks at p (block stride bb) as lane j. */
QMM_INLINE __m256i ilv_dwords8(const uint8_t *p, size_t bb, size_t off) {
        p += off;
        return _mm256_setr_epi32((int)rd32(p), (int)rd32(p + bb), (int)rd32(p + 2 * bb), (int)rd32(p + 3 * bb),
                                 (int)rd32(p + 4 * bb), (int)rd32(p + 5 * bb), (int)rd32(p + 6 * bb),
                                 (int)rd32(p + 7 * bb));
}

/* The 16 nibble bytes at `off` of each of eight whole blocks as four vectors: v[s] lane
 * j = dword s of block j (a 4 x 4 transpose in each 128-bit half). */
QMM_INLINE void ilv_nibble_dwords8(const uint8_t *p, size_t bb, size_t off, __m256i v[4]) {
        p += off;
#define ILV_LD(j) _mm_loadu_si128((const __m128i *)(p + (j) * bb))
        __m256i y0 = _mm256_set_m128i(ILV_LD(4), ILV_LD(0)), y1 = _mm256_set_m128i(ILV_LD(5), ILV_LD(1));
        __m256i y2 = _mm256_set_m128i(ILV_LD(6), ILV_LD(2)), y3 = _mm256_set_m128i(ILV_LD(7), ILV_LD(3));
#undef ILV_LD
        __m256i a0 = _mm256_unpacklo_epi32(y0, y1), a1 = _mm256_unpackhi_epi32(y0, y1);
        __m256i a2 = _mm256_unpacklo_epi32(y2, y3), a3 = _mm256_unpackhi_epi32(y2, y3);
        v[0] = _mm256_unpacklo_epi64(a0, a2);
        v[1] = _mm256_unpackhi_epi64(a0, a2);
        v[2] = _mm256_unpacklo_epi64(a1, a3);
        v[3] = _mm256_unpackhi_epi64(a1, a3);
}

/* One weight row of 32-blocks -> its interleaved row: codes, dw, mw (padding zero).
 * The 4-bit formats need only a 4 x 4 transpose: byte k of a block's nibbles holds
 * elements k (low) and 16 + k (high), so dword s of every block holds steps s and 4 + s.
 * A row's last group, when partial, gathers under a mask instead (absent blocks: zero
 * codes and scales).  q8_0's 32 code bytes take the whole 8 x 8 transpose. */
QMM_INLINE void ilv_unpack_row_t(const tsr_dtype T, const uint8_t *p, size_t n, bool vnni, uint8_t *dst) {
        const size_t bb = BLOCK32_BYTES(T), nb = n / 32, ng = ilv_groups(n);
        const bool has_m = T == TSR_DTYPE_Q4_1 || T == TSR_DTYPE_Q5_1, q5 = T == TSR_DTYPE_Q5_0 || T == TSR_DTYPE_Q5_1;
        const size_t qs = T == TSR_DTYPE_Q4_0 ? 2 : T == TSR_DTYPE_Q4_1 ? 4 : T == TSR_DTYPE_Q5_0 ? 6 : 8;
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)bb)), m4 = _mm256_set1_epi8(0x0f);
        const __m256i pick_d = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m256i pick_m = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
        float *dw = (float *)(dst + ng * 256), *mw = dw + 8 * ng;

        for (size_t g = 0; g < ng; g++) {
                const uint8_t *base = p + 8 * g * bb;
                size_t live = nb - 8 * g < 8 ? nb - 8 * g : 8;
                for (size_t o = 0; o < 8 * bb; o += 64)         /* as dot32_group_t */
                        _mm_prefetch((const char *)base + QMM_PREFETCH + o, _MM_HINT_T0);
                __m256i on = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live), lane), z = _mm256_setzero_si256();
                __m256i head = live == 8 ? ilv_dwords8(base, bb, 0)
                                         : _mm256_mask_i32gather_epi32(z, (const int *)base, offs, on, 1);
                __m256i dp = _mm256_shuffle_epi8(head, pick_d), mp = _mm256_shuffle_epi8(head, pick_m);
                _mm256_store_ps(dw + 8 * g, _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(dp),
                                                                               _mm256_extracti128_si256(dp, 1))));
                _mm256_store_ps(mw + 8 * g, has_m ? _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(mp),
                                                                                       _mm256_extracti128_si256(mp, 1)))
                                                  : _mm256_setzero_ps());
                if (T == TSR_DTYPE_Q8_0) {
                        __m256i v[8];
                        for (size_t j = 0; j < 8; j++) {
                                v[j] = j < live ? codes32(T, base + j * bb) : z;
                                if (vnni)
                                        v[j] = _mm256_xor_si256(v[j], _mm256_set1_epi8((char)0x80));
                        }
                        transpose8_epi32(v);
                        for (int s = 0; s < 8; s++)
                                _mm256_store_si256((__m256i *)(dst + 256 * g + 32 * s), v[s]);
                        continue;
                }
                __m256i qh = z;         /* q5: the fifth bits, the dword before the nibbles */
                if (q5)
                        qh = live == 8 ? ilv_dwords8(base, bb, qs - 4)
                                       : _mm256_mask_i32gather_epi32(z, (const int *)(base + qs - 4), offs, on, 1);
                __m256i nib[4];
                if (live == 8)
                        ilv_nibble_dwords8(base, bb, qs, nib);
                else
                        for (int s = 0; s < 4; s++)
                                nib[s] = _mm256_mask_i32gather_epi32(z, (const int *)(base + qs + 4 * s), offs, on, 1);
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                        __m256i v = nib[s];
                        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        if (q5) {
                                lo = _mm256_or_si256(lo, ilv_q5_high(qh, s));
                                hi = _mm256_or_si256(hi, ilv_q5_high(qh, 4 + s));
                        }
                        _mm256_store_si256((__m256i *)(dst + 256 * g + 32 * s), lo);
                        _mm256_store_si256((__m256i *)(dst + 256 * g + 32 * (4 + s)), hi);
                }
        }
}

QMM_FN static void ilv_unpack_row(tsr_dtype t, const uint8_t *p, size_t n, bool vnni, uint8_t *dst) {
        switch (t) {
        case TSR_DTYPE_Q8_0: ilv_unpack_row_t(TSR_DTYPE_Q8_0, p, n, vnni, dst); break;
        case TSR_DTYPE_Q4_0: ilv_unpack_row_t(TSR_DTYPE_Q4_0, p, n, vnni, dst); break;
        case TSR_DTYPE_Q4_1: ilv_unpack_row_t(TSR_DTYPE_Q4_1, p, n, vnni, dst); break;
        case TSR_DTYPE_Q5_0: ilv_unpack_row_t(TSR_DTYPE_Q5_0, p, n, vnni, dst); break;
        default: ilv_unpack_row_t(TSR_DTYPE_Q5_1, p, n, vnni, dst); break;
        }
}

/* Group g of a quantized activation row (the reference's layout) -> its interleaved
 * steps at codes + step * s, and o * (each block's sum of codes) at os. */
QMM_INLINE void ilv_act_group(const tsr_qmm_act *a, size_t g, int32_t o, uint8_t *codes, size_t step, int32_t *os) {
        __m256i v[8], sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++)
                v[j] = _mm256_load_si256((const __m256i *)(a->q + 256 * g + 32 * j));
        transpose8_epi32(v);
        for (int s = 0; s < 8; s++) {
                _mm256_store_si256((__m256i *)(codes + step * s), v[s]);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v[s]),
                                                              _mm256_set1_epi16(1)));
        }
        _mm256_store_si256((__m256i *)os, _mm256_mullo_epi32(sum, _mm256_set1_epi32(o)));
}

/* One quantized activation row -> its interleaved codes and o * (each block's sum of
 * codes). */
QMM_FN static void ilv_act_row(const tsr_qmm_act *a, size_t n, int32_t o, uint8_t *dst) {
        const size_t ng = ilv_groups(n);
        int32_t *os = (int32_t *)(dst + ng * 256);

        for (size_t g = 0; g < ng; g++)
                ilv_act_group(a, g, o, dst + 256 * g, 32, os + 8 * g);
}

/* ---- many activation rows of the K formats: the same tiles, lane j = sub-block j -----------
 * A 256-block has eight sub-blocks of 32, and the interleaving above, applied to one K
 * block instead of eight 32-blocks, puts sub-block j in lane j: step s holds bytes
 * 4s..4s+3 of each sub-block, of the weight codes and of the activation codes alike (the
 * activation rows take ilv_act_row itself, with o = 0 and its sums unused).  So eight
 * steps of the same multiply-adds leave lane j = sub-block j's sum of w q for each pair
 * of the tile, with the codes stored unsigned: q4_K, q5_K as they are, q6_K before its
 * -32.  Per block and pair, then, exactly in int32:
 *   q4_K, q5_K:  P1 = lane j's sum * sub-block j's scale (one vpmulld), P2 = the
 *                sixteen mn_g * qsum_g in eight lanes (one vpmaddwd of the weight row's
 *                mins and the activation row's sums of 16);
 *   q6_K:        its scale is per 16: lane j's sum after steps 0-3 (group 2j) times
 *                scale 2j, plus its sum over steps 4-7 times scale 2j + 1; P2 = the
 *                sixteen sc_g * qsum_g, as the -32 comes back out:
 *                I1 = sum sc_g sum (q - 32) x = (sum of P1) - 32 (sum of P2), I2 = 0.
 * The eight blocks of a group then go through one 8 x 8 transpose-and-add
 * (hsum8_epi32), which leaves lane b = block b's I1 (I2): the reference's integers,
 * exactly (|I1| < 2^28, every partial sum smaller), in the reference's lanes, where the
 * float terms are its own: t_b = (d*dx) * (float)I1 - (dmin*dx) * (float)I2.
 *
 * Layout of an interleaved weight row: per block (ILVK_BLOCK bytes) the 256 codes, then
 * int32 sc[2][8] (q4_K, q5_K: sc[0] lane j = sub-block j's scale, sc[1] zero; q6_K: the
 * scales of groups 2j and 2j + 1), then int16 m[16] (q4_K, q5_K: the min of each 16, as
 * unpack256's mn; q6_K: the 16 scales); after the blocks, float d and dmin per group of
 * eight blocks (8 each, padding zero: a block past the row's end adds
 * (0*0)*0 - (0*0)*0 = +0 to its lane). */

#define ILVK_BLOCK (256 + 64 + 32)

static inline size_t ilvk_groups(size_t n) { return (n / 256 + 7) / 8; }
static inline size_t ilvk_w_bytes(size_t n) { return n / 256 * ILVK_BLOCK + ilvk_groups(n) * 64; }

/* One weight row of K blocks -> its interleaved row (above). */
QMM_FN static void ilvk_unpack_row(tsr_dtype t, const uint8_t *p, size_t n, uint8_t *dst) {
        const size_t bb = tsr_dtype_get_info(t)->block_bytes, nb = n / 256;
        float *d = (float *)(dst + nb * ILVK_BLOCK), *dmin = d + 8 * ilvk_groups(n);

        memset(d, 0, ilvk_groups(n) * 64);
        for (size_t b = 0; b < nb; b++) {
                const uint8_t *blk = p + b * bb;
                uint8_t *o = dst + b * ILVK_BLOCK;
                int32_t *sc = (int32_t *)(o + 256);
                int16_t *m = (int16_t *)(o + 320);
                __m256i v[8];
                for (size_t k = 0; k < bb; k += 64)     /* as dot32_group_t */
                        _mm_prefetch((const char *)blk + QMM_PREFETCH + k, _MM_HINT_T0);
                k_codes(t, blk, v);
                transpose8_epi32(v);
                for (int s = 0; s < 8; s++)
                        _mm256_store_si256((__m256i *)(o + 32 * s), v[s]);
                if (t == TSR_DTYPE_Q6_K) {
                        d[b] = f16_at(blk + 208);
                        dmin[b] = 0.0f;
                        for (int g = 0; g < 16; g++) {
                                sc[8 * (g % 2) + g / 2] = (int8_t)blk[192 + g];
                                m[g] = (int8_t)blk[192 + g];
                        }
                        continue;
                }
                d[b] = f16_at(blk);
                dmin[b] = f16_at(blk + 2);
                for (int j = 0; j < 8; j++) {
                        int s, mn;
                        tsr_gguf_k_scale_min(j, blk + 4, &s, &mn);
                        sc[j] = s;
                        sc[8 + j] = 0;
                        m[2 * j] = m[2 * j + 1] = (int16_t)mn;
                }
        }
}

/* A tile's operands: RW interleaved weight rows, RA interleaved activation rows with
 * their dx / sx (the reference layout's), and the float accumulators. */
struct ilv_tile {
        const uint8_t *w[QMM_TILE_W_MAX];
        const uint8_t *q[QMM_TILE_A];
        const float *dx[QMM_TILE_A], *sx[QMM_TILE_A];   /* sx: 32-blocks only */
        size_t ng;                                      /* 32-blocks: groups */
        /* K blocks only (after the 32-blocks' fields, which keep main's offsets) */
        const int16_t *qsum[QMM_TILE_A];
        size_t nb;                                      /* blocks */
};

/* The float32 terms of group g for every pair of the tile, added to its lanes as the
 * reference adds them: t = (dw*dx) * (float)I + mw*sx. */
QMM_INLINE void ilv_group_terms(const int RW, const int RA, const struct ilv_tile *tl, size_t g,
                                __m256i acc[][QMM_TILE_A], __m256 facc[][QMM_TILE_A]) {
        const size_t ng = tl->ng;
#pragma GCC unroll 4
        for (int r = 0; r < RA; r++) {
                __m256 dx = _mm256_load_ps(tl->dx[r] + 8 * g), sx = _mm256_load_ps(tl->sx[r] + 8 * g);
                __m256i os = _mm256_load_si256((const __m256i *)(tl->q[r] + 256 * ng + 32 * g));
#pragma GCC unroll 4
                for (int i = 0; i < RW; i++) {
                        const float *dw = (const float *)(tl->w[i] + 256 * ng) + 8 * g, *mw = dw + 8 * ng;
                        __m256 s = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][r], os));
                        __m256 dd = _mm256_mul_ps(_mm256_load_ps(dw), dx);
                        __m256 t = _mm256_add_ps(_mm256_mul_ps(dd, s), _mm256_mul_ps(_mm256_load_ps(mw), sx));
                        facc[i][r] = _mm256_add_ps(facc[i][r], t);
                }
        }
}

/* The K tiles' group g: p1[i][r][j], p2[i][r][j] (block 8g + j's P1, P2 above, zero past
 * the row's end) -> I1, I2 in lanes, and their float32 terms added as the reference adds
 * them: t = (d*dx) * (float)I1 - (dmin*dx) * (float)I2. */
/* Block j of a K group past the row's end: its P1 and P2 are zero for every pair (its
 * terms then add +0). */
QMM_INLINE void ilvk_absent_block(const int RW, const int RA, __m256i p1[][QMM_TILE_A][8],
                                  __m256i p2[][QMM_TILE_A][8], size_t j) {
        for (int i = 0; i < RW; i++)
                for (int r = 0; r < RA; r++)
                        p1[i][r][j] = p2[i][r][j] = _mm256_setzero_si256();
}

/* Block b's P2 of one weight row (its K block at wb) with each activation row: the
 * sixteen mins (or q6_K scales) times the row's sums of 16, one vpmaddwd, into p2[r][j]. */
QMM_INLINE void ilvk_p2(const int RA, const struct ilv_tile *tl, const uint8_t *wb, size_t b, __m256i p2[][8],
                        size_t j) {
        __m256i m = _mm256_load_si256((const __m256i *)(wb + 320));
#pragma GCC unroll 4
        for (int r = 0; r < RA; r++)
                p2[r][j] = _mm256_madd_epi16(m, _mm256_load_si256((const __m256i *)(tl->qsum[r] + 16 * b)));
}

QMM_INLINE void ilvk_group_terms(const int RW, const int RA, const bool q6, const struct ilv_tile *tl, size_t g,
                                 __m256i p1[][QMM_TILE_A][8], __m256i p2[][QMM_TILE_A][8],
                                 __m256 facc[][QMM_TILE_A]) {
        const size_t kg = (tl->nb + 7) / 8;
#pragma GCC unroll 4
        for (int r = 0; r < RA; r++) {
                __m256 dx = _mm256_load_ps(tl->dx[r] + 8 * g);
#pragma GCC unroll 4
                for (int i = 0; i < RW; i++) {
                        const float *d = (const float *)(tl->w[i] + tl->nb * ILVK_BLOCK) + 8 * g, *dmin = d + 8 * kg;
                        __m256i i1 = hsum8_epi32(p1[i][r]), i2 = hsum8_epi32(p2[i][r]);
                        if (q6) {
                                i1 = _mm256_sub_epi32(i1, _mm256_slli_epi32(i2, 5));
                                i2 = _mm256_setzero_si256();
                        }
                        __m256 dd = _mm256_mul_ps(_mm256_load_ps(d), dx), dm = _mm256_mul_ps(_mm256_load_ps(dmin), dx);
                        __m256 t = _mm256_sub_ps(_mm256_mul_ps(dd, _mm256_cvtepi32_ps(i1)),
                                                 _mm256_mul_ps(dm, _mm256_cvtepi32_ps(i2)));
                        facc[i][r] = _mm256_add_ps(facc[i][r], t);
                }
        }
}

/* out[r][i] = lanes_sum(facc[i][r]) for the tile's RW x RA pairs: the same pair tree,
 * RW sums at once (hadds of the RW accumulators of activation row r put pair k of the
 * tree for accumulator i in one lane; commutative float adds, so bitwise lanes_sum's),
 * and each activation row's RW outputs side by side, as they lie in the output row. */
QMM_INLINE void ilv_tile_sums(const int RW, const int RA, __m256 facc[][QMM_TILE_A], float out[][QMM_TILE_W_MAX]) {
#pragma GCC unroll 4
        for (int r = 0; r < RA; r++) {
                if (RW == 4) {
                        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(facc[0][r], facc[1][r]),
                                                  _mm256_hadd_ps(facc[2][r], facc[3][r]));
                        _mm_storeu_ps(out[r], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
                } else {        /* RW == 2: lanes 0, 1 = rows 0, 1 (2, 3 repeat them) */
                        __m256 h = _mm256_hadd_ps(facc[0][r], facc[1][r]);
                        h = _mm256_hadd_ps(h, h);
                        _mm_storel_pi((__m64 *)out[r], _mm_add_ps(_mm256_castps256_ps128(h),
                                                                  _mm256_extractf128_ps(h, 1)));
                }
        }
}

/* The tile kernels, one per way of multiplying bytes (qmm_tile.h; each inclusion defines
 * ilv_tile_<NAME>4 and ilv_tile_<NAME>2, for tiles of four and two activation rows). */
QMM_INLINE __m256i ilv_dot_avx2(__m256i acc, __m256i w, __m256i q) {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1)));
}

QMM_INLINE __m256i ilv_dot_avx2_signed(__m256i acc, __m256i w, __m256i q) {
        __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

#define QMM_VNNI_TARGET "avx2,f16c,avx512f,avx512vl,avx512vnni"


typedef void ilv_tile_fn(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]);

#define ILV_NAME avx2_
#define ILV_TARGET "avx2,f16c"
#define ILV_RW QMM_TILE_W_AVX2
#define ILV_DOT ilv_dot_avx2
#define ILV_K 1
#include "kernels/cpu/qmm_tile.h"

#define ILV_NAME avx2_signed_
#define ILV_TARGET "avx2,f16c"
#define ILV_RW QMM_TILE_W_AVX2
#define ILV_DOT ilv_dot_avx2_signed
#include "kernels/cpu/qmm_tile.h"

/* ---- many activation rows on 512-bit vectors (VNNI, 32-blocks) ---------------------------
 * The same integers and the same float terms as the tiles above, two activation rows per
 * vector: lanes 0-7 belong to the pair's first row, lanes 8-15 to its second.  For that
 * the activation rows are interleaved in pairs (ilv2_act_half): per group, step s of the
 * first row and step s of the second fill 64 contiguous bytes, then the pair's o * S,
 * dx and sx the same way.  A weight step (32 bytes) is broadcast to both halves, so one
 * vpdpbusd on a zmm does the work of two on ymm, and each float operation of
 * ilv_group_terms serves two pairs of the tile; every lane still computes exactly its
 * pair's block terms in the reference's order (nothing crosses halves until the end,
 * where each half goes to ilv_tile_sums as its own row).  An odd last row is paired with
 * itself and its copy dropped, as the ymm tiles repeat a row.
 *
 * Measured on Zen 5 (512-bit datapaths: a zmm vpdpbusd issues as fast as a ymm one),
 * SmolLM2 Q4_1, one thread: decode batch 32 at context 512 396 -> 451 tok/s, prefill 512
 * 775 -> 1018 (docs/benchmarks.md, issue #21).  Four pairs a tile instead of two read
 * +1%, within noise: not kept.  The K formats use the same pairs (ilv2_tile_k_t below). */

#define ILV2_GROUP (512 + 3 * 64)       /* codes, o * S, dx, sx of one group of a pair */

static inline size_t ilv2_pair_bytes(size_t n) { return ilv_groups(n) * ILV2_GROUP; }

/* Activation row a (quantized, the reference's layout) -> half `half` of its pair's
 * interleaved rows at dst; o: the weight codes' offset (ilv_offset). */
QMM_FN static void ilv2_act_half(const tsr_qmm_act *a, size_t n, int32_t o, uint8_t *dst, int half) {
        for (size_t g = 0; g < ilv_groups(n); g++) {
                uint8_t *gd = dst + g * ILV2_GROUP + 32 * half;
                ilv_act_group(a, g, o, gd, 64, (int32_t *)(gd + 512));
                if (!a->sx)             /* a K row: group g is block g; the K tiles read dx, qsum in place */
                        continue;
                _mm256_store_ps((float *)(gd + 576), _mm256_load_ps(a->dx + 8 * g));   /* padded (qmm.h) */
                _mm256_store_ps((float *)(gd + 640), _mm256_load_ps(a->sx + 8 * g));
        }
}

/* Steps s0..s1-1 of a tile into acc: weight step s broadcast from tl->w[i] + wo + 32s,
 * pair p's step s at tl->q[2p] + qo + 64s. */
__attribute__((always_inline, target(QMM_VNNI_TARGET))) static inline void ilv2_steps(const int P,
                                                                                      const struct ilv_tile *tl,
                                                                                      size_t wo, size_t qo,
                                                                                      const int s0, const int s1,
                                                                                      __m512i acc[][2]) {
#pragma GCC unroll 8
        for (int s = s0; s < s1; s++) {
                __m512i w[QMM_TILE_W_VNNI];
#pragma GCC unroll 4
                for (int i = 0; i < QMM_TILE_W_VNNI; i++)
                        w[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(tl->w[i] + wo + 32 * s)));
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) {
                        __m512i q = _mm512_load_si512(tl->q[2 * p] + qo + 64 * s);
#pragma GCC unroll 4
                        for (int i = 0; i < QMM_TILE_W_VNNI; i++)
                                acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], w[i], q);
                }
        }
}

/* A tile of QMM_TILE_W_VNNI weight rows x P pairs of activation rows (tl->q[2p]: pair p). */
__attribute__((always_inline, target(QMM_VNNI_TARGET))) static inline void ilv2_tile_t(const int P,
                                                                                       const struct ilv_tile *tl,
                                                                                       float out[][QMM_TILE_W_MAX]) {
        enum { RW = QMM_TILE_W_VNNI };
        const size_t ng = tl->ng;
        __m512 facc[RW][2];
        __m256 half[RW][QMM_TILE_A];

#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 2
                for (int p = 0; p < P; p++)
                        facc[i][p] = _mm512_setzero_ps();
        for (size_t g = 0; g < ng; g++) {
                __m512i acc[RW][2];
#pragma GCC unroll 4
                for (int i = 0; i < RW; i++)
#pragma GCC unroll 2
                        for (int p = 0; p < P; p++)
                                acc[i][p] = _mm512_setzero_si512();
                ilv2_steps(P, tl, 256 * g, g * ILV2_GROUP, 0, 8, acc);
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) {   /* ilv_group_terms, two pairs per vector */
                        const uint8_t *pg = tl->q[2 * p] + g * ILV2_GROUP;
                        __m512i os = _mm512_load_si512(pg + 512);
                        __m512 dx = _mm512_load_ps(pg + 576), sx = _mm512_load_ps(pg + 640);
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++) {
                                const float *dwp = (const float *)(tl->w[i] + 256 * ng) + 8 * g, *mwp = dwp + 8 * ng;
                                __m512 dw = _mm512_castsi512_ps(_mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)dwp)));
                                __m512 mw = _mm512_castsi512_ps(_mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)mwp)));
                                __m512 sv = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][p], os));
                                __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(dw, dx), sv), _mm512_mul_ps(mw, sx));
                                facc[i][p] = _mm512_add_ps(facc[i][p], t);
                        }
                }
        }
#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) {
                        half[i][2 * p] = _mm512_castps512_ps256(facc[i][p]);
                        half[i][2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(facc[i][p]), 1));
                }
        ilv_tile_sums(RW, 2 * P, half, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_4(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_t(2, tl, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_2(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_t(1, tl, out);
}

/* The K tiles on 512-bit vectors: a K block is a group of the pair layout (its eight
 * sub-blocks in the lanes, as ilv_tile_<NAME>k_t has them), each block's integer sums
 * times their scales in zmm for two rows at once, then split into the rows' P1 of the
 * ymm K tiles; P2 (one vpmaddwd of 16 int16 per row) and the group terms as there. */
__attribute__((always_inline, target(QMM_VNNI_TARGET))) static inline void ilv2_tile_k_t(const int P, const bool Q6,
                                                                                         const struct ilv_tile *tl,
                                                                                         float out[][QMM_TILE_W_MAX]) {
        enum { RW = QMM_TILE_W_VNNI };
        const int RA = 2 * P;
        const size_t nb = tl->nb;
        __m256 facc[RW][QMM_TILE_A];
        __m256i p1[RW][QMM_TILE_A][8], p2[RW][QMM_TILE_A][8];

#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                for (int r = 0; r < RA; r++)
                        facc[i][r] = _mm256_setzero_ps();
        for (size_t g = 0; g < (nb + 7) / 8; g++) {
                for (size_t j = 0; j < 8; j++) {
                        const size_t b = 8 * g + j;
                        __m512i acc[RW][2], prod[RW][2];
                        if (b >= nb) {
                                ilvk_absent_block(RW, RA, p1, p2, j);
                                continue;
                        }
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++)
#pragma GCC unroll 2
                                for (int p = 0; p < P; p++)
                                        acc[i][p] = prod[i][p] = _mm512_setzero_si512();
                        if (Q6) {       /* groups 2j: times their scales, then groups 2j + 1 */
                                ilv2_steps(P, tl, ILVK_BLOCK * b, b * ILV2_GROUP, 0, 4, acc);
#pragma GCC unroll 4
                                for (int i = 0; i < RW; i++) {
                                        __m512i sc = _mm512_broadcast_i64x4(
                                                _mm256_load_si256((const __m256i *)(tl->w[i] + ILVK_BLOCK * b + 256)));
#pragma GCC unroll 2
                                        for (int p = 0; p < P; p++) {
                                                prod[i][p] = _mm512_mullo_epi32(acc[i][p], sc);
                                                acc[i][p] = _mm512_setzero_si512();
                                        }
                                }
                        }
                        ilv2_steps(P, tl, ILVK_BLOCK * b, b * ILV2_GROUP, Q6 ? 4 : 0, 8, acc);
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++) {
                                const uint8_t *wb = tl->w[i] + ILVK_BLOCK * b;
                                __m512i sc = _mm512_broadcast_i64x4(
                                        _mm256_load_si256((const __m256i *)(wb + 256 + (Q6 ? 32 : 0))));
#pragma GCC unroll 2
                                for (int p = 0; p < P; p++) {
                                        __m512i v = _mm512_mullo_epi32(acc[i][p], sc);
                                        if (Q6)
                                                v = _mm512_add_epi32(prod[i][p], v);
                                        p1[i][2 * p][j] = _mm512_castsi512_si256(v);
                                        p1[i][2 * p + 1][j] = _mm512_extracti64x4_epi64(v, 1);
                                }
                                ilvk_p2(RA, tl, wb, b, p2[i], j);
                        }
                }
                ilvk_group_terms(RW, RA, Q6, tl, g, p1, p2, facc);
        }
        ilv_tile_sums(RW, RA, facc, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_k4(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_k_t(2, false, tl, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_k2(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_k_t(1, false, tl, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_k6_4(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_k_t(2, true, tl, out);
}

__attribute__((target(QMM_VNNI_TARGET))) static void ilv2_tile_k6_2(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ilv2_tile_k_t(1, true, tl, out);
}

/* ---- the driver ----------------------------------------------------------------------- */

struct qmm_ctx {
        tsr_dtype t;
        float *out;                     /* (rows, d) */
        const uint8_t *w;               /* (d, row_bytes) */
        const uint8_t *xq;              /* (rows, act_bytes) */
        const uint8_t *xi;              /* the interleaved activations (tiles): (rows, ilv_a_bytes), or
                                         * with VNNI in pairs ((rows + 1) / 2, ilv2_pair_bytes) */
        size_t rows, n, d, row_bytes, act_bytes, wu_bytes;   /* wu_bytes: a task's interleaved weight rows (tiles) */
        bool tiles, vnni, zmm;          /* rows > 1; vpdpbusd; AVX-512 (BW) */
        _Atomic bool *no_memory;        /* set by a task whose scratch could not grow */
};

/* Weight rows i0..i1 with every activation row, in tiles (above); k: the K formats'
 * tiles (a constant: the 32-blocks' driver is compiled as it was before them). */
QMM_INLINE void qmm_tiles_t(const struct qmm_ctx *c, size_t i0, size_t i1, uint8_t *wu, const bool k) {
        const bool q6 = c->t == TSR_DTYPE_Q6_K;
        const size_t wb = k ? ilvk_w_bytes(c->n) : ilv_w_bytes(c->n), ab = ilv_a_bytes(c->n), nw = i1 - i0;
        const int rw = c->vnni ? QMM_TILE_W_VNNI : QMM_TILE_W_AVX2;
        bool sgn = !c->vnni && c->t == TSR_DTYPE_Q8_0;
        const bool zmm = c->vnni;       /* with VNNI the tiles are the 512-bit ones, in pairs */
        ilv_tile_fn *tile4, *tile2;
        struct ilv_tile tl = {.ng = ilv_groups(c->n), .nb = c->n / 256};
        float o[QMM_TILE_A][QMM_TILE_W_MAX];    /* [activation row][weight row] */

        if (zmm) {
                tile4 = k ? (q6 ? ilv2_tile_k6_4 : ilv2_tile_k4) : ilv2_tile_4;
                tile2 = k ? (q6 ? ilv2_tile_k6_2 : ilv2_tile_k2) : ilv2_tile_2;
        } else if (k) {
                tile4 = q6 ? ilv_tile_avx2_k6_4 : ilv_tile_avx2_k4;
                tile2 = q6 ? ilv_tile_avx2_k6_2 : ilv_tile_avx2_k2;
        } else {
                tile4 = sgn ? ilv_tile_avx2_signed_4 : ilv_tile_avx2_4;
                tile2 = sgn ? ilv_tile_avx2_signed_2 : ilv_tile_avx2_2;
        }
        for (size_t i = 0; i < nw; i++) {
                const uint8_t *row = c->w + (i0 + i) * c->row_bytes;
                if (k)
                        ilvk_unpack_row(c->t, row, c->n, wu + i * wb);
                else
                        ilv_unpack_row(c->t, row, c->n, c->vnni, wu + i * wb);
        }
        for (size_t r0 = 0, ra; r0 < c->rows; r0 += ra) {
                ra = c->rows - r0 >= 4 ? 4 : 2;         /* a last row alone: a tile of two, repeated */
                for (int r = 0; r < (int)ra; r++) {
                        size_t rr = r0 + r < c->rows ? r0 + r : c->rows - 1;
                        tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq + rr * c->act_bytes, c->n);
                        tl.q[r] = zmm ? c->xi + (r0 / 2 + (size_t)r / 2) * ilv2_pair_bytes(c->n) : c->xi + rr * ab;
                        tl.dx[r] = a.dx;
                        tl.sx[r] = a.sx;
                        if (k)
                                tl.qsum[r] = a.qsum;
                }
                for (size_t w0 = 0; w0 < nw; w0 += (size_t)rw) {
                        for (int i = 0; i < rw; i++)
                                tl.w[i] = wu + (w0 + i < nw ? w0 + i : nw - 1) * wb;
                        (ra == 4 ? tile4 : tile2)(&tl, o);
                        float *out = c->out + r0 * c->d + i0 + w0;
                        if (w0 + (size_t)rw <= nw && r0 + ra <= c->rows) {      /* a whole tile */
                                for (size_t r = 0; r < ra; r++)
                                        if (rw == 4)
                                                memcpy(out + r * c->d, o[r], 4 * sizeof(float));
                                        else
                                                memcpy(out + r * c->d, o[r], 2 * sizeof(float));
                                continue;
                        }
                        for (int i = 0; i < rw && w0 + i < nw; i++)
                                for (int r = 0; r < (int)ra && r0 + r < c->rows; r++)
                                        out[r * c->d + i] = o[r][i];
                }
        }
}

QMM_FN static void qmm_tiles(const struct qmm_ctx *c, size_t i0, size_t i1, uint8_t *wu) {
        qmm_tiles_t(c, i0, i1, wu, false);
}

__attribute__((noinline)) QMM_FN static void qmm_tiles_k(const struct qmm_ctx *c, size_t i0, size_t i1, uint8_t *wu) {
        qmm_tiles_t(c, i0, i1, wu, true);
}

QMM_FN static void qmm_task(void *ctx, size_t task, int worker) {
        const struct qmm_ctx *c = ctx;
        size_t i0 = task * QMM_ROWS_PER_TASK, i1 = i0 + QMM_ROWS_PER_TASK < c->d ? i0 + QMM_ROWS_PER_TASK : c->d;
        (void)worker;
        if (c->tiles) {                 /* a batch */
                /* the task's interleaved rows, in the thread's own scratch (pool.h says
                 * why not one malloc'd per call) */
                uint8_t *wu = tsr_thread_scratch(c->wu_bytes);
                if (!wu) {
                        atomic_store_explicit(c->no_memory, true, memory_order_relaxed);
                        return;
                }
                if (tsr_qmm_is_k(c->t))
                        qmm_tiles_k(c, i0, i1, wu);
                else
                        qmm_tiles(c, i0, i1, wu);
                return;
        }
        if (!tsr_qmm_is_k(c->t)) {      /* the decode GEMV (rows == 1): blocks decoded in registers */
                tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq, c->n);
                for (size_t i = i0; i < i1; i++)
                        c->out[i] = dot32_fused(c->t, c->w + i * c->row_bytes, &a, c->n);
                return;
        }
        tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq, c->n);     /* K blocks, the decode GEMV: the same */
        const bool z = c->zmm && c->t != TSR_DTYPE_Q6_K;
        for (size_t i = i0; i < i1; i++)
                c->out[i] = z ? dotk_fused_z(c->t, c->w + i * c->row_bytes, &a, c->n)
                              : dotk_fused(c->t, c->w + i * c->row_bytes, &a, c->n);
}

/* ---- step 1: tsr_qmm_quantize_row, eight lanes at a time --------------------------------
 * Bitwise the reference's quantize_block: max |x| is exact in any order; id = 127 / amax
 * and dx = amax / 127 are the same scalar divisions; x * id rounds once, and vroundps to
 * nearest-even is rintf (the default rounding mode); the clamp to +-127 comes before the
 * (then exact) conversion; the integer sums are exact; sx = dx * (float)sum as there,
 * also for a zero block (0 * 0) and a non-finite one (NaN * 0).  The K formats' blocks
 * (256) take the same per-32 steps as the 32-blocks; their sums of 16 codes are the
 * reference's own loop (the scalar rintf per element was what cost: 6.8% of a b32 step of
 * a Q4_K_M SmolLM2 before). */

/* One block of 32 * chunks floats at x -> q; returns dx (NaN: non-finite) and, in *sum,
 * the sum of its codes (zero for a zero or non-finite block, whose codes stay 0). */
QMM_INLINE float quantize_block_simd(const float *x, int chunks, int8_t *q, int32_t *sum) {
        const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
        const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256 m = _mm256_setzero_ps(), fin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));

        for (int k = 0; k < 4 * chunks; k++) {
                __m256 av = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k));
                fin = _mm256_and_ps(fin, _mm256_cmp_ps(av, inf, _CMP_LT_OQ));     /* NaN: false */
                m = _mm256_max_ps(m, av);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        bool finite = _mm256_movemask_ps(fin) == 0xff;
        float idf = 127.0f / amax;
        *sum = 0;
        if (!finite || amax == 0.0f || isinf(idf))      /* q stays 0 (quant/qmm.h) */
                return finite ? 0.0f : NAN;
        __m256 id = _mm256_set1_ps(idf);
        __m256i acc = _mm256_setzero_si256();
        for (int c = 0; c < chunks; c++) {
                __m256i qi[4];
                for (int k = 0; k < 4; k++) {
                        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * k), id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        qi[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                        acc = _mm256_add_epi32(acc, qi[k]);
                }
                /* packs work per 128-bit half: dwords 0..7 then hold elements 0-3, 8-11,
                 * 16-19, 24-27, 4-7, ...; the permute puts them back in order. */
                __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
                _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_permutevar8x32_epi32(q8, order));
        }
        *sum = hsum_epi32(acc);
        return amax / 127.0f;
}

QMM_FN static void quantize32_row(const float *x, size_t n, void *dst) {
        tsr_qmm_act a = tsr_qmm_act_at(TSR_DTYPE_Q8_0, dst, n);

        memset(dst, 0, tsr_qmm_act_bytes(TSR_DTYPE_Q8_0, n));   /* the padding (qmm.h) */
        for (size_t b = 0; b < n / 32; b++) {
                int32_t sum;
                a.dx[b] = quantize_block_simd(x + 32 * b, 1, a.q + 32 * b, &sum);
                a.sx[b] = a.dx[b] * (float)sum;
        }
}

QMM_FN static void quantizek_row(tsr_dtype t, const float *x, size_t n, void *dst) {
        tsr_qmm_act a = tsr_qmm_act_at(t, dst, n);

        memset(dst, 0, tsr_qmm_act_bytes(t, n));
        for (size_t b = 0; b < n / 256; b++) {
                int32_t sum;
                a.dx[b] = quantize_block_simd(x + 256 * b, 8, a.q + 256 * b, &sum);
        }
        for (size_t g = 0; g < n / 16; g++) {
                int s = 0;
                for (int k = 0; k < 16; k++)
                        s += a.q[16 * g + k];
                a.qsum[g] = (int16_t)s;
        }
}

/* A row of any format, quantized for the matmul (tsr_qmm_quantize_row's bits). */
QMM_FN static void quantize_row(tsr_dtype t, const float *x, size_t n, void *dst) {
        if (tsr_qmm_is_k(t))
                quantizek_row(t, x, n, dst);
        else
                quantize32_row(x, n, dst);
}

/* Rows of x quantized across the pool too, row by row. */
struct quant_ctx {
        tsr_dtype t;
        const float *x;
        uint8_t *xq, *xi;               /* xi: the interleaved rows too, for the tiles; else NULL */
        size_t n, act_bytes, rows;
        int32_t offset;                 /* the tiles' code offset (ilv_offset) */
};

QMM_FN static void quant_task(void *ctx, size_t r, int worker) {
        const struct quant_ctx *c = ctx;
        (void)worker;
        quantize_row(c->t, c->x + r * c->n, c->n, c->xq + r * c->act_bytes);
        if (c->xi) {
                tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq + r * c->act_bytes, c->n);
                ilv_act_row(&a, c->n, c->offset, c->xi + r * ilv_a_bytes(c->n));
        }
}

/* The zmm tiles' rows, a pair per task: the two halves of a pair share every cache line,
 * so one thread writes both rather than two bouncing the lines.  An odd last row fills
 * both halves. */
QMM_FN static void quant_pair_task(void *ctx, size_t p, int worker) {
        const struct quant_ctx *c = ctx;
        uint8_t *pair = c->xi + p * ilv2_pair_bytes(c->n);
        (void)worker;
        for (size_t h = 0; h < 2; h++) {
                size_t r = 2 * p + h < c->rows ? 2 * p + h : c->rows - 1;
                if (r == 2 * p + h)
                        quantize_row(c->t, c->x + r * c->n, c->n, c->xq + r * c->act_bytes);
                tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq + r * c->act_bytes, c->n);
                ilv2_act_half(&a, c->n, c->offset, pair, (int)h);
        }
}

/* ---- many activation rows with AMX-INT8 (cpu/qmm_amx.c) ----------------------------------
 * The rows are quantized as for the other paths (the reference's layout, which the A
 * tiles read in place), padded with zero rows to whole tiles of TSR_QMM_AMX_ROWS. */

static tsr_status qmm_amx(tsr_pool *pool, float *out, const float *x, const void *w, tsr_dtype t, size_t rows,
                          size_t n, size_t d) {
        size_t ab = tsr_qmm_act_bytes(t, n), row_bytes;
        size_t padded = (rows + TSR_QMM_AMX_ROWS - 1) / TSR_QMM_AMX_ROWS * TSR_QMM_AMX_ROWS;

        if (padded > SIZE_MAX / ab || tsr_dtype_row_bytes(t, n, &row_bytes) != TSR_OK)
                return TSR_E_LIMIT;
        uint8_t *xq = aligned_alloc(64, (padded * ab + 63) / 64 * 64);
        if (!xq)
                return TSR_E_NOMEM;
        memset(xq + rows * ab, 0, (padded - rows) * ab);
        struct quant_ctx qc = {.t = t, .x = x, .xq = xq, .n = n, .act_bytes = ab, .rows = rows};
        tsr_pool_run(rows >= 8 ? pool : NULL, rows, quant_task, &qc);
        tsr_status st = tsr_qmm_amx(pool, out, xq, ab, w, row_bytes, t, rows, n, d);
        free(xq);
        return st;
}

/* VNNI for the zmm tiles: every CPU at the avx512_bf16 level so far has it, but ask (two
 * reads of libgcc's CPU model: no cache of our own). */
static bool cpu_has_vnni(void) {
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}

#endif

tsr_status tsr_cpu_qmm(tsr_pool *pool, tsr_cpu_isa isa, float *out, const float *x, const void *w, tsr_dtype t,
                       size_t rows, size_t n, size_t d) {
#ifdef QMM_X86
        const tsr_dtype_info *info = tsr_dtype_get_info(t);

        if (isa < TSR_CPU_ISA_AVX2)
                return tsr_qmm_ref(out, x, w, t, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0 || !tsr_qmm_supported(t) || n % info->block_elems != 0)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        /* n < 2^26: the AMX path gathers scales 16 weight rows apart with 32-bit offsets */
        if (rows >= QMM_AMX_MIN_ROWS && isa >= TSR_CPU_ISA_AMX_BF16 && n < (1u << 26) &&
            tsr_amx_int8())
                return qmm_amx(pool, out, x, w, t, rows, n, d);
        struct qmm_ctx c = {.t = t, .out = out, .w = w, .rows = rows, .n = n, .d = d,
                            .act_bytes = tsr_qmm_act_bytes(t, n),
                            .tiles = rows > 1,
                            .vnni = isa >= TSR_CPU_ISA_AVX512_BF16 && cpu_has_vnni(),
                            .zmm = isa >= TSR_CPU_ISA_AVX512_BF16};
        const bool pairs = c.tiles && c.vnni;   /* the zmm tiles' activation layout */
        /* per row: its quantized copy, and its interleaved one (in pairs: half a pair's
         * bytes, an odd last row taking a whole pair) */
        size_t xi_bytes = !c.tiles ? 0 : pairs ? ilv2_pair_bytes(n) : ilv_a_bytes(n);
        if (rows > SIZE_MAX / (c.act_bytes + xi_bytes) - 1 || tsr_dtype_row_bytes(t, n, &c.row_bytes) != TSR_OK)
                return TSR_E_LIMIT;
        if (c.tiles)
                c.wu_bytes = QMM_ROWS_PER_TASK * (tsr_qmm_is_k(t) ? ilvk_w_bytes(n) : ilv_w_bytes(n));
        /* 64-byte aligned: the zmm tiles load whole cache lines of the pairs (704 bytes a
         * group, starting at xq_bytes) and of wu (tsr_thread_scratch's; wu_bytes is 16 x
         * 320 or 352 bytes a group or block) */
        size_t xq_bytes = (rows * c.act_bytes + 63) / 64 * 64;
        size_t xi_total = pairs ? (rows + 1) / 2 * xi_bytes : rows * xi_bytes;
        uint8_t *xq = aligned_alloc(64, xq_bytes + (xi_total + 63) / 64 * 64);
        _Atomic bool no_memory = false;
        if (!xq)
                return TSR_E_NOMEM;
        c.no_memory = &no_memory;
        struct quant_ctx qc = {.t = t, .x = x, .xq = xq, .xi = c.tiles ? xq + xq_bytes : NULL, .n = n,
                               .act_bytes = c.act_bytes, .rows = rows, .offset = ilv_offset(t, c.vnni)};
        if (pairs)
                tsr_pool_run(rows >= 8 ? pool : NULL, (rows + 1) / 2, quant_pair_task, &qc);
        else
                tsr_pool_run(rows >= 8 ? pool : NULL, rows, quant_task, &qc);
        c.xq = xq;
        c.xi = qc.xi;
        tsr_pool_run_spans(pool, (d + QMM_ROWS_PER_TASK - 1) / QMM_ROWS_PER_TASK, qmm_task, &c);
        free(xq);
        return atomic_load(&no_memory) ? TSR_E_NOMEM : TSR_OK;
#else
        (void)pool, (void)isa;
        return tsr_qmm_ref(out, x, w, t, rows, n, d);
#endif
}
