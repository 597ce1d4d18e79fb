/* cpu/qmm.c - the int8 matmul on GGUF blocks with AVX2, bitwise quant/qmm.c's.
 *
 * Why it is bitwise the reference: the activation rows are quantized by the reference's
 * own function (tsr_qmm_quantize_row; for the 32-block formats quantize32_row, its
 * vectorised twin, step for step); the weight rows are unpacked to the same integers
 * and the same float scales (f16 -> f32 through F16C is exact, as tsr_f16_to_f32 is);
 * the integer block sums are exact in any order; and the float32 terms of each block are
 * computed with the same operations in the same order, eight blocks at a time in one
 * __m256 whose lane j is the reference's lane j (block b goes to lane b % 8).  Lanes past
 * the last block add +0, which leaves a lane unchanged (a lane that starts at +0 is never
 * -0).  The final lane sum is the reference's pair tree.
 *
 * Work split: weight rows in tasks of QMM_ROWS_PER_TASK across the backend's pool, each
 * thread taking its tasks from one contiguous span of W (tsr_pool_run_spans: one long
 * stream per core for the prefetchers, rather than every other 16 rows); each task
 * unpacks one weight row into its thread's scratch and dots it with every activation
 * row, so W is read from memory once per call.  No split of K, so the tiling and the
 * thread count change nothing (kernels.h batch invariance).
 *
 * Thread: the backend's driving thread plus its pool's helpers (pool.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/qmm.h"
#include "kernels/quant/qmm.h"
#include "kernels/quant/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#define QMM_X86 1
#include <immintrin.h>
#endif

/* Weight rows per pool task: d = 576 still gives 36 tasks to share. */
#define QMM_ROWS_PER_TASK 16

#ifdef QMM_X86

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

/* Bytes of a 32-block of type T (dtype.c's table, as a constant for the compiler). */
#define BLOCK32_BYTES(T) ((T) == TSR_DTYPE_Q8_0 ? 34 : (T) == TSR_DTYPE_Q4_0 ? 18 : (T) == TSR_DTYPE_Q4_1 ? 20 \
                          : (T) == TSR_DTYPE_Q5_0 ? 22 : 24)

/* One row of 32-blocks of type T (a constant after inlining) -> the unpacked row, padding
 * zeroed (quant/qmm.h). */
QMM_INLINE void unpack32_row_t(const tsr_dtype T, const uint8_t *p, size_t n, tsr_qmm_w *u) {
        const size_t bb = BLOCK32_BYTES(T);
        size_t nb = n / 32;

        for (size_t b = 0; b < nb; b++) {
                const uint8_t *blk = p + b * bb;
                u->dw[b] = f16_at(blk);
                u->mw[b] = T == TSR_DTYPE_Q4_1 || T == TSR_DTYPE_Q5_1 ? f16_at(blk + 2) : 0.0f;
                _mm256_store_si256((__m256i *)(u->w + 32 * b), codes32(T, blk));
        }
        for (size_t b = nb; b % 8; b++) {
                _mm256_store_si256((__m256i *)(u->w + 32 * b), _mm256_setzero_si256());
                u->dw[b] = u->mw[b] = 0.0f;
        }
}

QMM_FN static void unpack32_row(tsr_dtype t, const uint8_t *p, size_t n, tsr_qmm_w *u) {
        switch (t) {
        case TSR_DTYPE_Q8_0: unpack32_row_t(TSR_DTYPE_Q8_0, p, n, u); break;
        case TSR_DTYPE_Q4_0: unpack32_row_t(TSR_DTYPE_Q4_0, p, n, u); break;
        case TSR_DTYPE_Q4_1: unpack32_row_t(TSR_DTYPE_Q4_1, p, n, u); break;
        case TSR_DTYPE_Q5_0: unpack32_row_t(TSR_DTYPE_Q5_0, p, n, u); break;
        default: unpack32_row_t(TSR_DTYPE_Q5_1, p, n, u); break;
        }
}

/* ---- unpacking K blocks (quant/qmm.c unpack256, vectorised) ------------------------------ */

/* Sub-block j's scale for its 16 pairs and its min for its two groups of 16. */
QMM_INLINE void k_scales(const uint8_t *scales, int16_t *sc, int16_t *mn) {
        for (int j = 0; j < 8; j++) {
                int s, m;
                tsr_gguf_k_scale_min(j, scales, &s, &m);
                _mm256_store_si256((__m256i *)(sc + 16 * j), _mm256_set1_epi16((short)s));
                mn[2 * j] = mn[2 * j + 1] = (int16_t)m;
        }
}

QMM_FN static void unpackk_row(tsr_dtype t, const uint8_t *p, size_t n, tsr_qmm_w *u) {
        const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
        size_t bb = tsr_dtype_get_info(t)->block_bytes;

        for (size_t b = 0; b < n / 256; b++) {
                const uint8_t *blk = p + b * bb;
                int8_t *w = u->w + 256 * b;
                int16_t *sc = u->sc + 128 * b, *mn = u->mn + 16 * b;
                if (t == TSR_DTYPE_Q6_K) {
                        const uint8_t *ql = blk, *qh = blk + 128;
                        u->d[b] = f16_at(blk + 208);
                        u->dmin[b] = 0.0f;
                        for (int h = 0; h < 2; h++) {
                                __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                                for (int k = 0; k < 4; k++) {
                                        __m256i lb = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (k % 2)));
                                        __m256i lo = k < 2 ? _mm256_and_si256(lb, m4)
                                                           : _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4);
                                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * k), _mm256_set1_epi8(3));
                                        __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                                        _mm256_store_si256((__m256i *)(w + 128 * h + 32 * k),
                                                           _mm256_sub_epi8(q, _mm256_set1_epi8(32)));
                                }
                        }
                        for (int g = 0; g < 16; g++) {
                                _mm_store_si128((__m128i *)(sc + 8 * g), _mm_set1_epi16((int8_t)blk[192 + g]));
                                mn[g] = 0;
                        }
                        continue;
                }
                const uint8_t *qs = blk + (t == TSR_DTYPE_Q5_K ? 48 : 16);
                __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 16));   /* q5_K: qh[32] */
                u->d[b] = f16_at(blk);
                u->dmin[b] = f16_at(blk + 2);
                k_scales(blk + 4, sc, mn);
                for (int c = 0; c < 4; c++) {           /* sub-blocks 2c (low nibbles), 2c+1 (high) */
                        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        if (t == TSR_DTYPE_Q5_K) {
                                __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), one);
                                __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c + 1), one);
                                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                        }
                        _mm256_store_si256((__m256i *)(w + 64 * c), lo);
                        _mm256_store_si256((__m256i *)(w + 64 * c + 32), hi);
                }
        }
}

/* ---- dot products --------------------------------------------------------------------- */

/* sum over 32 bytes of w[k] * q[k] (both int8, |q| <= 127) as eight int32 partial sums:
 * |w| * (q with w's sign), pairs in int16 (at most 2 * 128 * 127, no saturation). */
QMM_INLINE __m256i dot32_epi32(const int8_t *w, const int8_t *q) {
        __m256i wv = _mm256_load_si256((const __m256i *)w), qv = _mm256_load_si256((const __m256i *)q);
        __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
        return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

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

/* 32-blocks: t_b = (dw*dx) * (float)I_b + mw*sx, eight blocks per step (the padding
 * makes the last step whole).  UNSIGNED (a constant after inlining): the codes are 0..31
 * (q4_1, q5_1), so one maddubs takes them as they are, without the sign trick. */
QMM_INLINE float dot32_row_t(const bool UNSIGNED, const tsr_qmm_w *u, const tsr_qmm_act *a, size_t n) {
        size_t nb = n / 32;
        __m256 acc = _mm256_setzero_ps();

        for (size_t b = 0; b < nb; b += 8) {
                __m256i v[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                        const int8_t *w = u->w + 32 * (b + j), *q = a->q + 32 * (b + j);
                        v[j] = UNSIGNED ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)w),
                                                                                 _mm256_load_si256((const __m256i *)q)),
                                                            _mm256_set1_epi16(1))
                                        : dot32_epi32(w, q);
                }
                __m256 s = _mm256_cvtepi32_ps(hsum8_epi32(v));
                __m256 dd = _mm256_mul_ps(_mm256_load_ps(u->dw + b), _mm256_load_ps(a->dx + b));
                __m256 t = _mm256_add_ps(_mm256_mul_ps(dd, s),
                                         _mm256_mul_ps(_mm256_load_ps(u->mw + b), _mm256_load_ps(a->sx + b)));
                acc = _mm256_add_ps(acc, t);
        }
        return lanes_sum(acc);
}

QMM_FN static float dot32_row(bool unsigned_codes, const tsr_qmm_w *u, const tsr_qmm_act *a, size_t n) {
        return unsigned_codes ? dot32_row_t(true, u, a, n) : dot32_row_t(false, u, a, n);
}

/* K blocks: I1 with the per-pair int16 scales in the multiply-add (|pair sum| <= 2*32*127,
 * times |sc| <= 128: int32), I2 from the 16 mins and activation sums; the float terms one
 * block at a time into the reference's lanes (a few per row: not worth vectorising). */
QMM_FN static float dotk_row(const tsr_qmm_w *u, const tsr_qmm_act *a, size_t n) {
        float lane[8] = {0};

        for (size_t b = 0; b < n / 256; b++) {
                __m256i acc = _mm256_setzero_si256();
                const int8_t *w = u->w + 256 * b, *q = a->q + 256 * b;
                const int16_t *sc = u->sc + 128 * b;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                        __m256i wv = _mm256_load_si256((const __m256i *)(w + 32 * c));
                        __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                        __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_load_si256((const __m256i *)(sc + 16 * c))));
                }
                int32_t i1 = hsum_epi32(acc);
                int32_t i2 = hsum_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)(u->mn + 16 * b)),
                                                          _mm256_loadu_si256((const __m256i *)(a->qsum + 16 * b))));
                float t_b = (u->d[b] * a->dx[b]) * (float)i1 - (u->dmin[b] * a->dx[b]) * (float)i2;
                lane[b % 8] += t_b;
        }
        return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* ---- one activation row: the weight blocks decoded in registers --------------------------
 * The decode GEMV (rows == 1) reads each weight row once and uses it once, so unpacking
 * it to scratch first only adds a store and a load per block: here each block goes from
 * the file's bytes to the integer sum directly.  Same integers, same scales, same float
 * terms and lanes as dot32_row (so still bitwise the reference).  q4_1 and q5_1 codes are
 * unsigned (0..31): one maddubs without the sign trick.  The row's whole groups of eight
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

/* ---- the driver ----------------------------------------------------------------------- */

struct qmm_ctx {
        tsr_dtype t;
        float *out;                     /* (rows, d) */
        const uint8_t *w;               /* (d, row_bytes) */
        const uint8_t *xq;              /* (rows, act_bytes) */
        uint8_t *scratch;               /* (threads, wu_bytes): one unpacked weight row per thread */
        size_t rows, n, d, row_bytes, act_bytes, wu_bytes;
};

QMM_FN static void qmm_task(void *ctx, size_t task, int worker) {
        const struct qmm_ctx *c = ctx;
        size_t i0 = task * QMM_ROWS_PER_TASK, i1 = i0 + QMM_ROWS_PER_TASK < c->d ? i0 + QMM_ROWS_PER_TASK : c->d;
        uint8_t *wu = c->scratch + (size_t)worker * c->wu_bytes;
        bool k = tsr_qmm_is_k(c->t), unsigned_codes = c->t == TSR_DTYPE_Q4_1 || c->t == TSR_DTYPE_Q5_1;
        tsr_qmm_w u = tsr_qmm_w_at(c->t, wu, c->n);

        if (!k && c->rows == 1) {       /* the decode GEMV: blocks decoded in registers */
                tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq, c->n);
                for (size_t i = i0; i < i1; i++)
                        c->out[i] = dot32_fused(c->t, c->w + i * c->row_bytes, &a, c->n);
                return;
        }
        for (size_t i = i0; i < i1; i++) {
                const uint8_t *wi = c->w + i * c->row_bytes;
                if (k)
                        unpackk_row(c->t, wi, c->n, &u);
                else
                        unpack32_row(c->t, wi, c->n, &u);
                for (size_t r = 0; r < c->rows; r++) {
                        tsr_qmm_act a = tsr_qmm_act_at(c->t, c->xq + r * c->act_bytes, c->n);
                        c->out[r * c->d + i] = k ? dotk_row(&u, &a, c->n) : dot32_row(unsigned_codes, &u, &a, c->n);
                }
        }
}

/* ---- step 1 for the 32-block formats: tsr_qmm_quantize_row, eight lanes at a time --------
 * Bitwise the reference's quantize_block: max |x| is exact in any order; id = 127 / amax
 * and dx = amax / 127 are the same scalar divisions; x * id rounds once, and vroundps to
 * nearest-even is rintf (the default rounding mode); the clamp to +-127 comes before the
 * (then exact) conversion; the integer sum is exact; sx = dx * (float)sum as there, also
 * for a zero block (0 * 0) and a non-finite one (NaN * 0). */
QMM_FN static void quantize32_row(const float *x, size_t n, void *dst) {
        tsr_qmm_act a = tsr_qmm_act_at(TSR_DTYPE_Q8_0, dst, n);
        const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
        const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);

        memset(dst, 0, tsr_qmm_act_bytes(TSR_DTYPE_Q8_0, n));   /* the padding (qmm.h) */
        for (size_t b = 0; b < n / 32; b++) {
                __m256 v[4], m = _mm256_setzero_ps(), fin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                for (int k = 0; k < 4; k++) {
                        v[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
                        __m256 av = _mm256_andnot_ps(sign, v[k]);
                        fin = _mm256_and_ps(fin, _mm256_cmp_ps(av, inf, _CMP_LT_OQ));     /* NaN: false */
                        m = _mm256_max_ps(m, av);
                }
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
                bool finite = _mm256_movemask_ps(fin) == 0xff;
                if (!finite || amax == 0.0f) {          /* q stays 0 */
                        a.dx[b] = finite ? 0.0f : NAN;
                        a.sx[b] = a.dx[b] * 0.0f;
                        continue;
                }
                __m256 id = _mm256_set1_ps(127.0f / amax);
                __m256i qi[4], sum = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        qi[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                        sum = _mm256_add_epi32(sum, qi[k]);
                }
                /* packs work per 128-bit half: dwords 0..7 then hold elements 0-3, 8-11, 16-19,
                 * 24-27, 4-7, ...; the permute puts them back in order. */
                __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
                _mm256_store_si256((__m256i *)(a.q + 32 * b), _mm256_permutevar8x32_epi32(q8, order));
                a.dx[b] = amax / 127.0f;
                a.sx[b] = a.dx[b] * (float)hsum_epi32(sum);
        }
}

/* Rows of x quantized across the pool too, row by row. */
struct quant_ctx {
        tsr_dtype t;
        const float *x;
        uint8_t *xq;
        size_t n, act_bytes;
};

QMM_FN static void quant_task(void *ctx, size_t r, int worker) {
        const struct quant_ctx *c = ctx;
        (void)worker;
        if (tsr_qmm_is_k(c->t))
                tsr_qmm_quantize_row(c->t, c->x + r * c->n, c->n, c->xq + r * c->act_bytes);
        else
                quantize32_row(c->x + r * c->n, c->n, c->xq + r * c->act_bytes);
}

#endif

tsr_status tsr_cpu_qmm(tsr_pool *pool, tsr_cpu_isa isa, float *out, const float *x, const void *w, tsr_dtype t,
                       size_t rows, size_t n, size_t d) {
#ifdef QMM_X86
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        size_t threads = (size_t)tsr_pool_threads(pool);

        if (isa < TSR_CPU_ISA_AVX2)
                return tsr_qmm_ref(out, x, w, t, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0 || !tsr_qmm_supported(t) || n % info->block_elems != 0)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        struct qmm_ctx c = {.t = t, .out = out, .w = w, .rows = rows, .n = n, .d = d,
                            .act_bytes = tsr_qmm_act_bytes(t, n), .wu_bytes = tsr_qmm_unpacked_bytes(t, n)};
        if (rows > SIZE_MAX / c.act_bytes || tsr_dtype_row_bytes(t, n, &c.row_bytes) != TSR_OK)
                return TSR_E_LIMIT;
        uint8_t *xq = aligned_alloc(32, rows * c.act_bytes);
        c.scratch = aligned_alloc(32, threads * c.wu_bytes);
        if (!xq || !c.scratch) {
                free(xq), free(c.scratch);
                return TSR_E_NOMEM;
        }
        struct quant_ctx qc = {.t = t, .x = x, .xq = xq, .n = n, .act_bytes = c.act_bytes};
        tsr_pool_run(rows >= 8 ? pool : NULL, rows, quant_task, &qc);
        c.xq = xq;
        tsr_pool_run_spans(pool, (d + QMM_ROWS_PER_TASK - 1) / QMM_ROWS_PER_TASK, qmm_task, &c);
        free(xq), free(c.scratch);
        return TSR_OK;
#else
        (void)pool, (void)isa;
        return tsr_qmm_ref(out, x, w, t, rows, n, d);
#endif
}
