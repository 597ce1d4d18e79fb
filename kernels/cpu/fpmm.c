/* cpu/fpmm.c - the fp8 e4m3 and NVFP4 matmul with AVX2, bitwise quant/fpmm.c's.
 *
 * Why bitwise: the activation rows are quantized by the reference's own functions; the
 * weights are decoded to the same floats / integers in registers (e4m3 -> float through
 * F16C: the e4m3 bits shifted into a binary16 are the value / 256, exact, subnormals
 * included; e2m1 through a 16-entry table); the products are the reference's products,
 * added into a __m256 whose lane j is the reference's lane j (element k, or block b, goes
 * to lane k % 8 or b % 8); padding adds +0, which leaves a lane unchanged (a lane that
 * starts at +0 is never -0); the final lane sum is the reference's pair tree, then the
 * same one multiplication by the scale.
 *
 * Work split: weight rows in tasks of FPMM_ROWS_PER_TASK across the backend's pool; with
 * one activation row (decode) each weight row is decoded in registers and used once;
 * with several, each weight row is decoded once into its thread's one-row scratch
 * (n floats or n int8: never a copy of the matrix) and dotted with every activation row.
 * No split of K: tiling and threads change nothing (kernels.h batch invariance).
 *
 * Thread: the backend's driving thread plus its pool's helpers (pool.h). */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/fpmm.h"
#include "kernels/quant/fpmm.h"
#include "kernels/quant/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#define FPMM_X86 1
#include <immintrin.h>
#endif

#define FPMM_ROWS_PER_TASK 16

#ifdef FPMM_X86

#define FPMM_FN __attribute__((target("avx2,f16c")))
#define FPMM_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* The reference's ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). */
FPMM_INLINE float lanes_sum(__m256 v) {
        __m256 t = _mm256_hadd_ps(v, v);
        t = _mm256_hadd_ps(t, t);
        return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* Eight e4m3 bytes -> eight floats, exact; S.1111.111 -> NaN. */
FPMM_INLINE __m256 e4m3x8(const uint8_t *p) {
        __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
        __m128i mag = _mm_and_si128(v, _mm_set1_epi16(0x7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
        __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
        __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
        return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(nan));
}

/* ---- FP8 ------------------------------------------------------------------------------- */

/* Eight weights from k: e4m3 bytes (w8) or floats already decoded (wf). */
FPMM_INLINE __m256 w_at8(const uint8_t *w8, const float *wf, size_t k) {
        return w8 ? e4m3x8(w8 + k) : _mm256_loadu_ps(wf + k);
}

/* A weight row (e4m3 bytes w8, or floats wf when w8 is NULL: a row decoded once for
 * several activation rows) . x (n floats), the reference's lanes; the tail through
 * zero-padded copies (0 * 0 = +0 for the padding lanes). */
FPMM_INLINE float dot_fp8_row(const uint8_t *w8, const float *wf, const float *x, size_t n) {
        __m256 acc = _mm256_setzero_ps();
        size_t k = 0;
        for (; k + 8 <= n; k += 8)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + k), w_at8(w8, wf, k)));
        if (k < n) {
                uint8_t bt[8] = {0};
                float ft[8] = {0}, xt[8] = {0};
                if (w8)
                        memcpy(bt, w8 + k, n - k);
                else
                        memcpy(ft, wf + k, (n - k) * sizeof(float));
                memcpy(xt, x + k, (n - k) * sizeof(float));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(xt), w_at8(w8 ? bt : NULL, ft, 0)));
        }
        return lanes_sum(acc);
}

/* Two weight rows (e4m3 bytes) . one activation row: dot_fp8_row's lanes for each, the
 * two chains interleaved (the decode's add latency hidden), each bitwise its own. */
FPMM_INLINE void dot_fp8_2rows(const uint8_t *wa, const uint8_t *wb, const float *x, size_t n, float *a, float *b) {
        __m256 aa = _mm256_setzero_ps(), ab = aa;
        size_t k = 0;
        for (; k + 8 <= n; k += 8) {
                __m256 xv = _mm256_loadu_ps(x + k);
                aa = _mm256_add_ps(aa, _mm256_mul_ps(xv, e4m3x8(wa + k)));
                ab = _mm256_add_ps(ab, _mm256_mul_ps(xv, e4m3x8(wb + k)));
        }
        if (k < n) {
                uint8_t ta[8] = {0}, tb[8] = {0};
                float xt[8] = {0};
                memcpy(ta, wa + k, n - k);
                memcpy(tb, wb + k, n - k);
                memcpy(xt, x + k, (n - k) * sizeof(float));
                __m256 xv = _mm256_loadu_ps(xt);
                aa = _mm256_add_ps(aa, _mm256_mul_ps(xv, e4m3x8(ta)));
                ab = _mm256_add_ps(ab, _mm256_mul_ps(xv, e4m3x8(tb)));
        }
        *a = lanes_sum(aa);
        *b = lanes_sum(ab);
}

/* Four activation rows x0..x3 against one decoded weight row wf: four independent
 * chains of the reference's lanes (each row's sums in dot_fp8_row's order, so bitwise
 * its results), the weight chunk loaded once for the four. */
FPMM_INLINE void dot_fp8_rows4(const float *wf, const float *x, size_t n, float *out4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *x0 = x, *x1 = x + n, *x2 = x + 2 * n, *x3 = x + 3 * n;
        size_t k = 0;
        for (; k + 8 <= n; k += 8) {
                __m256 w = _mm256_loadu_ps(wf + k);
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(x0 + k), w));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(x1 + k), w));
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(x2 + k), w));
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(x3 + k), w));
        }
        if (k < n) {
                float ft[8] = {0}, xt[4][8] = {{0}};
                memcpy(ft, wf + k, (n - k) * sizeof(float));
                for (int r = 0; r < 4; r++)
                        memcpy(xt[r], x + (size_t)r * n + k, (n - k) * sizeof(float));
                __m256 w = _mm256_loadu_ps(ft);
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(xt[0]), w));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(xt[1]), w));
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(xt[2]), w));
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(xt[3]), w));
        }
        out4[0] = lanes_sum(a0), out4[1] = lanes_sum(a1), out4[2] = lanes_sum(a2), out4[3] = lanes_sum(a3);
}

/* ---- NVFP4 ----------------------------------------------------------------------------- */

/* A block's 8 code bytes -> 16 codes, element 2i from the low nibble of byte i. */
FPMM_INLINE __m128i nvfp4_codes(const uint8_t *codes) {
        __m128i v = _mm_loadl_epi64((const __m128i *)codes), m = _mm_set1_epi8(0x0f);
        return _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
}

/* 16 codes -> 2*e2m1 as int8 (tsr_fpmm_e2m1_x2). */
FPMM_INLINE __m128i e2m1x2_16(__m128i codes) {
        const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        return _mm_shuffle_epi8(lut, codes);
}

/* 16 codes (as int8 2*e2m1) -> two vectors of eight floats (e2m1 values). */
FPMM_INLINE void e2m1_f32_16(__m128i x2, __m256 *lo, __m256 *hi) {
        *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x2)), _mm256_set1_ps(0.5f));
        *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x2, 8))), _mm256_set1_ps(0.5f));
}

/* One e4m3 byte -> float, exact, as e4m3x8 (F16C; a block scale per 16 weights, so
 * the reference's ldexpf-based decoder would dominate the NVFP4 dot). */
FPMM_INLINE float e4m3_1(uint8_t b) {
        if ((b & 0x7f) == 0x7f)
                return NAN;
        return _cvtsh_ss((unsigned short)((b & 0x80) << 8 | (b & 0x7f) << 7)) * 256.0f;
}

/* W4A16: one 9-byte-block row . x (n floats). Elements 16b..16b+15 go to lanes 0..7 twice. */
FPMM_INLINE float dot_nvfp4_w4a16(const uint8_t *w, const float *x, size_t n) {
        __m256 acc = _mm256_setzero_ps();
        for (size_t b = 0; b < n / 16; b++) {
                const uint8_t *blk = w + 9 * b;
                __m256 lo, hi, s = _mm256_set1_ps(e4m3_1(blk[0]));
                e2m1_f32_16(e2m1x2_16(nvfp4_codes(blk + 1)), &lo, &hi);
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + 16 * b), _mm256_mul_ps(lo, s)));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + 16 * b + 8), _mm256_mul_ps(hi, s)));
        }
        return lanes_sum(acc);
}

/* sum over 16 int8 pairs (|a|, |w| <= 12) as four int32 partials. */
FPMM_INLINE __m128i dot16_epi32(__m128i w, __m128i a) {
        __m128i p16 = _mm_maddubs_epi16(_mm_abs_epi8(w), _mm_sign_epi8(a, w));
        return _mm_madd_epi16(p16, _mm_set1_epi16(1));
}

/* Block b of a weight row as 2*e2m1 int8 codes and its scale: from the stored 9-byte
 * blocks (w), or from the row decoded once into wq / wsf (w NULL; several activation
 * rows). */
FPMM_INLINE __m128i blk_codes(const uint8_t *w, const int8_t *wq, size_t b) {
        return w ? e2m1x2_16(nvfp4_codes(w + 9 * b + 1)) : _mm_loadu_si128((const __m128i *)(wq + 16 * b));
}
FPMM_INLINE float blk_scale(const uint8_t *w, const float *wsf, size_t b) {
        return w ? e4m3_1(w[9 * b]) : wsf[b];
}

/* W4A4: one weight row (w, or decoded: wq, wsf) . one activation row (a: 2*e2m1 int8,
 * sfa: block scales), eight blocks per step into the lanes (block b -> lane b % 8), the
 * tail one block at a time. */
FPMM_INLINE float dot_nvfp4_w4a4(const uint8_t *w, const int8_t *wq, const float *wsf, const int8_t *a,
                                 const float *sfa, size_t n) {
        size_t nb = n / 16, b = 0;
        __m256 acc = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8) {
                __m128i s[8];
                float sw[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                        sw[j] = blk_scale(w, wsf, b + j);
                        s[j] = dot16_epi32(blk_codes(w, wq, b + j), _mm_loadu_si128((const __m128i *)(a + 16 * (b + j))));
                }
                /* eight blocks' four partials each -> one sum per block, lane j = block j */
                __m128i h01 = _mm_hadd_epi32(s[0], s[1]), h23 = _mm_hadd_epi32(s[2], s[3]);
                __m128i h45 = _mm_hadd_epi32(s[4], s[5]), h67 = _mm_hadd_epi32(s[6], s[7]);
                __m256i I = _mm256_set_m128i(_mm_hadd_epi32(h45, h67), _mm_hadd_epi32(h01, h23));
                __m256 ss = _mm256_mul_ps(_mm256_loadu_ps(sfa + b), _mm256_loadu_ps(sw));
                __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(I), ss), _mm256_set1_ps(0.25f));
                acc = _mm256_add_ps(acc, t);
        }
        if (b < nb) {
                float lane[8];
                _mm256_storeu_ps(lane, acc);
                for (; b < nb; b++) {
                        __m128i s4 = dot16_epi32(blk_codes(w, wq, b), _mm_loadu_si128((const __m128i *)(a + 16 * b)));
                        s4 = _mm_hadd_epi32(s4, s4);
                        s4 = _mm_hadd_epi32(s4, s4);
                        float t = ((float)_mm_cvtsi128_si32(s4) * (sfa[b] * blk_scale(w, wsf, b))) * 0.25f;
                        lane[b % 8] += t;
                }
                acc = _mm256_loadu_ps(lane);
        }
        return lanes_sum(acc);
}

/* ---- the driver ------------------------------------------------------------------------ */

struct fpmm_ctx {
        tsr_dtype t;
        bool act;                       /* activations quantized (s.input > 0) */
        float scale;                    /* the final multiplier */
        float *out;                     /* (rows, d) */
        const uint8_t *w;               /* (d, row_bytes) */
        const float *x;                 /* (rows, n): x, or its fp8 values (FP8 W8A8) */
        const int8_t *a;                /* NVFP4 W4A4: (rows, n) */
        const float *sfa;               /* NVFP4 W4A4: (rows, n/16) */
        /* With several activation rows each weight row is decoded once into its thread's
         * own scratch (tsr_thread_scratch; pool.h says why not one block per call): FP8 as n
         * floats (wf), NVFP4 W4A4 as its n 2*e2m1 codes (wq) and n / 16 block scales (wsf). */
        bool decode_fp8, decode_nvfp4;
        _Atomic bool no_memory;         /* set by a task whose scratch could not grow */
        size_t rows, n, d, row_bytes;
};

FPMM_FN static void fpmm_task(void *ctx, size_t task, int worker) {
        const struct fpmm_ctx *c = ctx;
        size_t i0 = task * FPMM_ROWS_PER_TASK, i1 = i0 + FPMM_ROWS_PER_TASK < c->d ? i0 + FPMM_ROWS_PER_TASK : c->d;
        size_t n = c->n, codes = (n + 63) / 64 * 64;
        float *wf = NULL, *wsf = NULL;
        int8_t *wq = NULL;
        (void)worker;

        if (c->t == TSR_DTYPE_FP8_E4M3 && c->rows == 1) {      /* decode: weight rows in pairs */
                size_t i = i0;
                for (; i + 2 <= i1; i += 2) {
                        float a, b;
                        dot_fp8_2rows(c->w + i * c->row_bytes, c->w + (i + 1) * c->row_bytes, c->x, n, &a, &b);
                        c->out[i] = a * c->scale;
                        c->out[i + 1] = b * c->scale;
                }
                if (i < i1)
                        c->out[i] = dot_fp8_row(c->w + i * c->row_bytes, NULL, c->x, n) * c->scale;
                return;
        }
        if (c->decode_fp8 || c->decode_nvfp4) {
                uint8_t *buf = tsr_thread_scratch(c->decode_fp8 ? n * sizeof(float) : codes + n / 16 * sizeof(float));
                if (!buf) {
                        atomic_store_explicit(&((struct fpmm_ctx *)ctx)->no_memory, true, memory_order_relaxed);
                        return;
                }
                if (c->decode_fp8)
                        wf = (float *)buf;
                else
                        wq = (int8_t *)buf, wsf = (float *)(buf + codes);
        }
        for (size_t i = i0; i < i1; i++) {
                const uint8_t *wi = c->w + i * c->row_bytes;
                if (wq)                 /* NVFP4 W4A4 with several rows: decode once, reuse */
                        for (size_t b = 0; b < n / 16; b++) {
                                _mm_storeu_si128((__m128i *)(wq + 16 * b), blk_codes(wi, NULL, b));
                                wsf[b] = blk_scale(wi, NULL, b);
                        }
                if (wf) {               /* FP8 with several rows: decode once, reuse */
                        size_t k = 0;
                        for (; k + 8 <= n; k += 8)
                                _mm256_storeu_ps(wf + k, e4m3x8(wi + k));
                        for (; k < n; k++)
                                wf[k] = tsr_fp8_e4m3_to_f32(wi[k]);
                }
                size_t r = 0;
                for (; wf && r + 4 <= c->rows; r += 4) {        /* FP8 tiles of four activation rows */
                        float acc4[4];
                        dot_fp8_rows4(wf, c->x + r * n, n, acc4);
                        for (int j = 0; j < 4; j++)
                                c->out[(r + j) * c->d + i] = acc4[j] * c->scale;
                }
                for (; r < c->rows; r++) {
                        float acc;
                        if (c->t == TSR_DTYPE_NVFP4 && c->act)
                                acc = dot_nvfp4_w4a4(wq ? NULL : wi, wq, wsf, c->a + r * n, c->sfa + r * (n / 16), n);
                        else if (c->t == TSR_DTYPE_NVFP4)
                                acc = dot_nvfp4_w4a16(wi, c->x + r * n, n);
                        else if (wf)
                                acc = dot_fp8_row(NULL, wf, c->x + r * n, n);
                        else
                                acc = dot_fp8_row(wi, NULL, c->x + r * n, n);
                        c->out[r * c->d + i] = acc * c->scale;
                }
        }
}

#endif

tsr_status tsr_cpu_fpmm(tsr_pool *pool, tsr_cpu_isa isa, float *out, const float *x, const void *w, tsr_dtype t,
                        const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
#ifdef FPMM_X86
        bool nv = t == TSR_DTYPE_NVFP4;

        if (isa < TSR_CPU_ISA_AVX2)
                return tsr_fpmm_ref(out, x, w, t, s, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0 || !tsr_fpmm_supported(t) || !tsr_fpmm_scales_ok(s) ||
            (nv && n % 16 != 0))
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        struct fpmm_ctx c = {.t = t, .act = s->input > 0, .out = out, .w = w, .x = x, .rows = rows, .n = n, .d = d};
        if (tsr_dtype_row_bytes(t, n, &c.row_bytes) != TSR_OK || rows > SIZE_MAX / n / sizeof(float) ||
            n > SIZE_MAX / 8)
                return TSR_E_LIMIT;
        c.scale = c.act ? s->input * s->weight : s->weight;
        float *xq = NULL, *sfa = NULL;
        int8_t *a = NULL;
        if (c.act && nv) {
                a = malloc(rows * n);
                sfa = malloc(rows * (n / 16) * sizeof(float));
        } else if (c.act) {
                xq = malloc(rows * n * sizeof(float));
        }
        c.decode_fp8 = !nv && rows > 1;
        c.decode_nvfp4 = nv && c.act && rows > 1;
        if ((c.act && nv && (!a || !sfa)) || (c.act && !nv && !xq)) {
                free(a), free(sfa), free(xq);
                return TSR_E_NOMEM;
        }
        for (size_t r = 0; c.act && r < rows; r++) {       /* O(rows * n): the reference's own quantizers */
                if (nv)
                        tsr_fpmm_nvfp4_quantize_row(x + r * n, n, s->input, a + r * n, sfa + r * (n / 16));
                else
                        tsr_fpmm_fp8_quantize_row(x + r * n, n, s->input, xq + r * n);
        }
        if (xq)
                c.x = xq;
        c.a = a;
        c.sfa = sfa;
        tsr_pool_run_spans(pool, (d + FPMM_ROWS_PER_TASK - 1) / FPMM_ROWS_PER_TASK, fpmm_task, &c);
        free(a), free(sfa), free(xq);
        return atomic_load(&c.no_memory) ? TSR_E_NOMEM : TSR_OK;
#else
        (void)pool, (void)isa;
        return tsr_fpmm_ref(out, x, w, t, s, rows, n, d);
#endif
}
