/* test_kv_fp8.c - the fp8 e4m3 KV cache (--kv-cache-dtype fp8; kernels.h tsr_kv_view,
 * models.md §4.5, §4.6) on the CPU backends and CUDA, and the e5m2 one (fp8_e5m2: the
 * same scales, e5m2 codes saturating at +-57344 as vLLM's __NV_SATFINITE stores) on the
 * CPU backends, the oracle and fast-vs-ref cases run again for it:
 *   - kv_write stores e4m3(x / scale) (round to nearest even, saturating at +-448, NaN
 *     to S.1111.111): the codes of §4.6's examples, with scale 1 and a scale != 1;
 *   - the reference attention on an fp8 cache against a float64 oracle that dequantizes
 *     the same stored codes (float(code) * scale), within the float32 error bound below;
 *   - the fast CPU backend bitwise the reference (kv_write bytes and attention floats)
 *     at 1 and 3 threads, over odd head_dim, block sizes, GQA groups and past lengths,
 *     one-sequence and batched;
 *   - bad views (zero, negative, NaN scales; an unknown dtype) refused with TSR_E_INVAL;
 *   - the CUDA backend (GPU 0; "[skip:no-gpu]" without one): the same codes bitwise, its
 *     attention within 4x the oracle's bound, batched bitwise alone, bad scales refused.
 * And the bfloat16 cache (--kv-cache-dtype bfloat16): kv_write's bits (round to nearest
 * even, ties, overflow to inf, NaN), the oracle on the widened values (no scale) and the
 * fast backend bitwise the reference, by the same cases; on CUDA the same shapes as fp8
 * (stored bits bitwise cpu-ref's, attention within 4x the oracle's bound, batched bitwise
 * alone).  CUDA refuses e5m2. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"
#include "tests/tsr_rand.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/quant/quant.h"

/* The format the cases below store (the e5m2 cases set it, then put it back). */
static tsr_dtype kv_dt = TSR_DTYPE_FP8_E4M3;

/* Bytes per stored element, and element i of a stored array as a value (an fp8 code
 * as float(code); a bf16 widened).  A bf16 view has no scale: kv_scale() is 1 there. */
static size_t elt_bytes(void) { return kv_dt == TSR_DTYPE_BF16 ? 2 : 1; }

static double elem_value(const uint8_t *base, size_t i) {
        if (kv_dt == TSR_DTYPE_BF16) {
                uint16_t h;
                memcpy(&h, base + 2 * i, sizeof h);
                return (double)tsr_bf16_to_f32(h);
        }
        return kv_dt == TSR_DTYPE_FP8_E5M2 ? (double)tsr_fp8_e5m2_to_f32(base[i])
                                           : (double)tsr_fp8_e4m3_to_f32(base[i]);
}

static double kv_scale(float scale) { return kv_dt == TSR_DTYPE_BF16 ? 1.0 : (double)scale; }

/* One contiguous block of `tokens` rows: the simplest fp8 view. */
static tsr_kv_view one_block(uint8_t *k, uint8_t *v, const uint32_t *table, size_t tokens, size_t heads, size_t hd,
                             float k_scale, float v_scale) {
        return (tsr_kv_view){.k8 = k, .v8 = v, .dtype = kv_dt, .k_scale = k_scale, .v_scale = v_scale,
                             .block_table = table, .n_table = 1, .n_blocks = 1, .block_size = tokens,
                             .n_kv_heads = heads, .head_dim = hd};
}

/* §4.6's examples through kv_write: K with scale 1, V with scale 2 (so V's input is
 * twice K's and the codes are the same). */
static void test_write_codes(void **state) {
        (void)state;
        static const float x[] = {1.0f, 448.0f, -2.0f, 0x1p-9f, 500.0f, -1e30f, 0.0f, -0.0f, 0x1p-11f};
        static const uint8_t want[] = {0x38, 0x7e, 0xc0, 0x01, 0x7e, 0xfe, 0x00, 0x80, 0x00};
        enum { N = sizeof x / sizeof *x };
        float x2[N];
        uint8_t k[N + 1], v[N + 1];
        uint32_t zero = 0;
        tsr_backend *ref = NULL;

        for (size_t i = 0; i < N; i++)
                x2[i] = 2.0f * x[i];
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        tsr_kv_view kv = one_block(k, v, &zero, 1, 1, N, 1.0f, 2.0f);
        assert_int_equal(tsr_backend_kv_write(ref, &kv, x, x2, 1, 0), TSR_OK);
        for (size_t i = 0; i < N; i++) {
                if (k[i] != want[i] || v[i] != want[i])
                        fail_msg("e4m3 of %a: k 0x%02x v 0x%02x, want 0x%02x", x[i], k[i], v[i], want[i]);
        }
        /* NaN as the weights' encoder: S.1111.111 */
        float nan_in = NAN;
        kv = one_block(k, v, &zero, 1, 1, 1, 1.0f, 1.0f);
        assert_int_equal(tsr_backend_kv_write(ref, &kv, &nan_in, &nan_in, 1, 0), TSR_OK);
        assert_int_equal(k[0] & 0x7f, 0x7f);
        assert_int_equal(k[0], tsr_f32_to_fp8_e4m3(NAN));
        tsr_backend_free(&ref);
}

/* e5m2 through kv_write: 1, its largest finite 57344, -2, its smallest subnormal 2^-16,
 * 60000 (rounds down to 57344), 61440 (halfway to 2^16: ties to the even 2^16, past the
 * largest, saturates), -1e30 and -inf (saturate), the zeros, 2^-18 (below half the
 * smallest subnormal: 0); NaN stays NaN.  K with scale 1, V with scale 2. */
static void test_write_codes_e5m2(void **state) {
        (void)state;
        static const float x[] = {1.0f,    57344.0f, -2.0f, 0x1p-16f, 60000.0f, 61440.0f,
                                  -1e30f,  -INFINITY, 0.0f, -0.0f,    0x1p-18f};
        static const uint8_t want[] = {0x3c, 0x7b, 0xc0, 0x01, 0x7b, 0x7b, 0xfb, 0xfb, 0x00, 0x80, 0x00};
        enum { N = sizeof x / sizeof *x };
        float x2[N], nan_in = NAN;
        uint8_t k[N + 1], v[N + 1];
        uint32_t zero = 0;
        tsr_backend *ref = NULL;

        kv_dt = TSR_DTYPE_FP8_E5M2;
        for (size_t i = 0; i < N; i++)
                x2[i] = 2.0f * x[i];
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        tsr_kv_view kv = one_block(k, v, &zero, 1, 1, N, 1.0f, 2.0f);
        assert_int_equal(tsr_backend_kv_write(ref, &kv, x, x2, 1, 0), TSR_OK);
        for (size_t i = 0; i < N; i++)
                if (k[i] != want[i] || v[i] != want[i])
                        fail_msg("e5m2 of %a: k 0x%02x v 0x%02x, want 0x%02x", x[i], k[i], v[i], want[i]);
        kv = one_block(k, v, &zero, 1, 1, 1, 1.0f, 1.0f);
        assert_int_equal(tsr_backend_kv_write(ref, &kv, &nan_in, &nan_in, 1, 0), TSR_OK);
        assert_true(isnan(tsr_fp8_e5m2_to_f32(k[0])));
        kv_dt = TSR_DTYPE_FP8_E4M3;
        tsr_backend_free(&ref);
}

/* A paged fp8 cache and its queries. */
struct kvc {
        size_t n, past_len, n_heads, n_kv_heads, head_dim, block_size;
        float k_scale, v_scale;
        size_t n_table, n_blocks, width, cache;
        uint32_t *table;
        uint8_t *k8, *v8;
        float *k_in, *v_in, *q;
};

static void kvc_init(struct kvc *c) {
        size_t total = c->past_len + c->n;
        c->width = c->n_kv_heads * c->head_dim;
        c->n_table = (total + c->block_size - 1) / c->block_size;
        c->n_blocks = c->n_table + 2;
        c->cache = c->n_blocks * c->block_size * c->width;
        c->table = malloc(c->n_table * sizeof *c->table);
        c->k8 = calloc(c->cache, elt_bytes());
        c->v8 = calloc(c->cache, elt_bytes());
        assert_true(c->table && c->k8 && c->v8);
        for (size_t i = 0; i < c->n_table; i++)
                c->table[i] = (uint32_t)(c->n_blocks - 1 - i);  /* reversed, distinct, never block 0 */
        /* magnitudes up to 3x the scale, with every 29th element past 448 * scale: saturates */
        c->k_in = rand_vec(total * c->width, 3.0f * c->k_scale);
        c->v_in = rand_vec(total * c->width, 3.0f * c->v_scale);
        for (size_t i = 0; i < total * c->width; i += 29)
                c->k_in[i] *= 200.0f, c->v_in[i] *= 200.0f;
        c->q = rand_vec(c->n * c->n_heads * c->head_dim, 0.3f / c->k_scale);
}

static void kvc_done(struct kvc *c) {
        free(c->table), free(c->k8), free(c->v8), free(c->k_in), free(c->v_in), free(c->q);
}

static tsr_kv_view kvc_view(const struct kvc *c, uint8_t *k8, uint8_t *v8) {
        return (tsr_kv_view){.k8 = k8, .v8 = v8, .dtype = kv_dt, .k_scale = c->k_scale,
                             .v_scale = c->v_scale, .block_table = c->table, .n_table = c->n_table,
                             .n_blocks = c->n_blocks, .block_size = c->block_size, .n_kv_heads = c->n_kv_heads,
                             .head_dim = c->head_dim};
}

/* Token t's row offset, as the view's paging says. */
static size_t row_of(const struct kvc *c, size_t t) {
        return ((size_t)c->table[t / c->block_size] * c->block_size + t % c->block_size) * c->width;
}

/* Fill the cache with tokens 0..past_len+n-1 through be's kv_write: the past in one
 * call, the new rows in a second (as a prefill then a step). */
static void kvc_write(tsr_backend *be, struct kvc *c, uint8_t *k8, uint8_t *v8) {
        tsr_kv_view kv = kvc_view(c, k8, v8);
        if (c->past_len)
                assert_int_equal(tsr_backend_kv_write(be, &kv, c->k_in, c->v_in, c->past_len, 0), TSR_OK);
        assert_int_equal(tsr_backend_kv_write(be, &kv, c->k_in + c->past_len * c->width,
                                              c->v_in + c->past_len * c->width, c->n, c->past_len),
                         TSR_OK);
}

/* out (c->n, n_heads, head_dim), an attention over c's stored codes (c->k8, c->v8),
 * against float64 on the dequantized codes.  Bound: each score is a float32 dot of
 * head_dim terms (error <= head_dim * eps * sum|q k| * scale), the softmax adds a few ulp
 * per term and sums p+1 terms in float32, and P.V sums p+1 float32 products:
 * |out - exact| <= (head_dim * sum|qk| scale + p + 8) * 2 eps * max|V| with room to spare,
 * per (row, head), times `slack` (1 for the reference's plain order). */
static void check_vs_oracle(const struct kvc *c, const float *out, double slack, const char *who) {
        size_t hd = c->head_dim, group = c->n_heads / c->n_kv_heads, total = c->past_len + c->n;
        float scale = 1.0f / sqrtf((float)hd);
        double *s = malloc(total * sizeof *s);
        assert_non_null(s);
        for (size_t t = 0; t < c->n; t++)
                for (size_t h = 0; h < c->n_heads; h++) {
                        size_t p = c->past_len + t, g = h / group;
                        const float *qh = c->q + (t * c->n_heads + h) * hd;
                        double max = -INFINITY, sum = 0, qk_abs = 0, vmax = 0;
                        for (size_t j = 0; j <= p; j++) {
                                double dot = 0, a = 0;
                                for (size_t i = 0; i < hd; i++) {
                                        double kd = elem_value(c->k8, row_of(c, j) + g * hd + i) * kv_scale(c->k_scale);
                                        dot += (double)qh[i] * kd, a += fabs((double)qh[i] * kd);
                                }
                                s[j] = dot * scale;
                                qk_abs = fmax(qk_abs, a * scale);
                                max = fmax(max, s[j]);
                        }
                        for (size_t j = 0; j <= p; j++)
                                sum += (s[j] = exp(s[j] - max));
                        for (size_t i = 0; i < hd; i++) {
                                double want = 0;
                                for (size_t j = 0; j <= p; j++) {
                                        double vd = elem_value(c->v8, row_of(c, j) + g * hd + i) * kv_scale(c->v_scale);
                                        want += s[j] / sum * vd;
                                        vmax = fmax(vmax, fabs(vd));
                                }
                                double got = out[(t * c->n_heads + h) * hd + i];
                                double bound =
                                        slack * ((double)hd * qk_abs + (double)p + 8) * 2 * FLT_EPSILON * vmax;
                                if (!(fabs(got - want) <= bound))
                                        fail_msg("%s: shape (n %zu past %zu hd %zu) t %zu h %zu i %zu: %.9g, want "
                                                 "%.9g (bound %.3g)", who, c->n, c->past_len, hd, t, h, i, got, want,
                                                 bound);
                        }
                }
        free(s);
}

/* The reference attention against the float64 oracle. */
static void test_ref_vs_oracle(void **state) {
        (void)state;
        static const struct kvc shapes[] = {
                {1, 0, 2, 1, 8, 16, 1.0f, 1.0f},    {3, 5, 4, 2, 17, 3, 0.25f, 3.5f},
                {2, 40, 6, 2, 64, 16, 1.0f, 1.0f},  {1, 77, 3, 3, 33, 7, 0.037f, 0.5f},
                {4, 9, 2, 2, 1, 1, 2.0f, 0.125f},
        };
        tsr_backend *ref = NULL;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
                struct kvc c = shapes[si];
                kvc_init(&c);
                kvc_write(ref, &c, c.k8, c.v8);
                tsr_kv_view kv = kvc_view(&c, c.k8, c.v8);
                float *out = malloc(c.n * c.n_heads * c.head_dim * sizeof *out);
                assert_non_null(out);
                assert_int_equal(tsr_backend_attention(ref, out, c.q, &kv, c.n, c.past_len, c.n_heads,
                                                       1.0f / sqrtf((float)c.head_dim)),
                                 TSR_OK);
                check_vs_oracle(&c, out, 1.0, "cpu-ref");
                free(out);
                kvc_done(&c);
        }
        tsr_backend_free(&ref);
}

static void expect_same_bits(const char *what, const void *got, const void *want, size_t bytes) {
        if (memcmp(got, want, bytes) != 0) {
                const uint8_t *a = got, *b = want;
                size_t i = 0;
                while (a[i] == b[i])
                        i++;
                fail_msg("%s: byte %zu differs (0x%02x, want 0x%02x)", what, i, a[i], b[i]);
        }
}

/* The fast backend bitwise the reference: the stored codes and the attention output,
 * one sequence and two sequences batched, at 1 and 3 threads. */
static void test_fast_bitwise(void **state) {
        (void)state;
        static const struct kvc shapes[] = {
                {1, 0, 9, 3, 64, 16, 1.0f, 1.0f},   {1, 37, 9, 3, 64, 16, 0.5f, 2.0f},
                {5, 0, 9, 3, 33, 7, 1.0f, 1.0f},    {17, 40, 9, 3, 64, 4, 0.3f, 0.7f},
                {3, 5, 4, 4, 40, 3, 1.0f, 1.0f},    {2, 9, 8, 1, 12, 5, 4.0f, 0.0625f},
                {1, 70, 2, 2, 3, 1, 1.0f, 1.0f},    {9, 0, 6, 2, 17, 7, 1.5f, 1.5f},
                {1, 200, 3, 1, 96, 16, 0.02f, 0.05f},
        };
        static const int threads[] = {1, 3};
        tsr_backend *ref = NULL;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        for (size_t ti = 0; ti < sizeof threads / sizeof *threads; ti++) {
                tsr_backend *fast = NULL;
                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads[ti],
                                                                                 .max_isa = TSR_CPU_ISA_AMX_BF16},
                                                     &fast),
                                 TSR_OK);
                for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
                        struct kvc c = shapes[si];
                        char what[160];
                        kvc_init(&c);
                        uint8_t *k2 = calloc(c.cache, elt_bytes()), *v2 = calloc(c.cache, elt_bytes());
                        size_t out_n = c.n * c.n_heads * c.head_dim;
                        float *o1 = malloc(out_n * sizeof *o1), *o2 = malloc(out_n * sizeof *o2);
                        float scale = 1.0f / sqrtf((float)c.head_dim);
                        assert_true(k2 && v2 && o1 && o2);
                        kvc_write(ref, &c, c.k8, c.v8);
                        kvc_write(fast, &c, k2, v2);
                        snprintf(what, sizeof what, "%s shape %zu %s t%d", tsr_dtype_get_info(kv_dt)->name, si,
                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), tsr_backend_threads(fast));
                        expect_same_bits(what, k2, c.k8, c.cache * elt_bytes());
                        expect_same_bits(what, v2, c.v8, c.cache * elt_bytes());
                        tsr_kv_view kv = kvc_view(&c, c.k8, c.v8);
                        assert_int_equal(tsr_backend_attention(ref, o1, c.q, &kv, c.n, c.past_len, c.n_heads, scale),
                                         TSR_OK);
                        assert_int_equal(tsr_backend_attention(fast, o2, c.q, &kv, c.n, c.past_len, c.n_heads, scale),
                                         TSR_OK);
                        expect_same_bits(what, o2, o1, out_n * sizeof *o1);
                        /* batched: the same sequence twice gives its rows twice */
                        float *qq = malloc(2 * out_n * sizeof *qq), *ob = malloc(2 * out_n * sizeof *ob);
                        assert_true(qq && ob);
                        memcpy(qq, c.q, out_n * sizeof *qq), memcpy(qq + out_n, c.q, out_n * sizeof *qq);
                        tsr_kv_seq seqs[2] = {{c.table, c.n_table, c.n, c.past_len}, {c.table, c.n_table, c.n, c.past_len}};
                        assert_int_equal(tsr_backend_attention_batch(fast, ob, qq, &kv, seqs, 2, c.n_heads, scale), TSR_OK);
                        expect_same_bits(what, ob, o1, out_n * sizeof *o1);
                        expect_same_bits(what, ob + out_n, o1, out_n * sizeof *o1);
                        free(qq), free(ob), free(k2), free(v2), free(o1), free(o2);
                        kvc_done(&c);
                }
                tsr_backend_free(&fast);
        }
        tsr_backend_free(&ref);
}

/* The oracle and fast-vs-ref cases on an e5m2 cache (the same shapes and scales). */
static void test_e5m2_ref_and_fast(void **state) {
        kv_dt = TSR_DTYPE_FP8_E5M2;
        test_ref_vs_oracle(state);
        test_fast_bitwise(state);
        kv_dt = TSR_DTYPE_FP8_E4M3;
}

/* bfloat16 through kv_write on both CPU backends (the scales are not used): 1, 1 + 2^-8
 * (a tie: to the even 1), 1 + 3 * 2^-8 (a tie: to the even 1 + 2^-6), 1 + 2^-8 + 2^-20
 * (past the tie: up), -2, FLT_MAX (rounds past the largest bf16: inf), -inf, the zeros,
 * float's smallest subnormal 2^-149 (below half of bf16's smallest, 2^-133: 0); NaN
 * stays a quiet NaN. */
static void test_write_bf16(void **state) {
        (void)state;
        static const float x[] = {1.0f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.0f, FLT_MAX,
                                  -INFINITY, 0.0f, -0.0f, 0x1p-149f};
        static const uint16_t want[] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0xc000, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0000};
        enum { N = sizeof x / sizeof *x };
        uint16_t k[N + 1], v[N + 1];
        float nan_in = NAN;
        uint32_t zero = 0;
        tsr_backend *ref = NULL, *fast = NULL;

        kv_dt = TSR_DTYPE_BF16;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &fast),
                         TSR_OK);
        tsr_backend *bes[2] = {ref, fast};
        for (size_t b = 0; b < 2; b++) {
                tsr_kv_view kv = one_block((uint8_t *)k, (uint8_t *)v, &zero, 1, 1, N, 7.0f, 0.5f);
                assert_int_equal(tsr_backend_kv_write(bes[b], &kv, x, x, 1, 0), TSR_OK);
                for (size_t i = 0; i < N; i++)
                        if (k[i] != want[i] || v[i] != want[i])
                                fail_msg("bf16 of %a: k 0x%04x v 0x%04x, want 0x%04x", x[i], k[i], v[i], want[i]);
                kv = one_block((uint8_t *)k, (uint8_t *)v, &zero, 1, 1, 1, 1.0f, 1.0f);
                assert_int_equal(tsr_backend_kv_write(bes[b], &kv, &nan_in, &nan_in, 1, 0), TSR_OK);
                assert_true(isnan(tsr_bf16_to_f32(k[0])) && (k[0] & 0x0040));
        }
        kv_dt = TSR_DTYPE_FP8_E4M3;
        tsr_backend_free(&ref);
        tsr_backend_free(&fast);
}

/* The oracle and fast-vs-ref cases on a bfloat16 cache (the same shapes; the scales in
 * them are not used). */
static void test_bf16_ref_and_fast(void **state) {
        kv_dt = TSR_DTYPE_BF16;
        test_ref_vs_oracle(state);
        test_fast_bitwise(state);
        kv_dt = TSR_DTYPE_FP8_E4M3;
}

/* A NaN in K and V (stored as e4m3's NaN codes, or a bf16 NaN): the fast attention gives
 * the reference's bits, NaNs included, reading the cache in place (bf16; e4m3 at one
 * query row) and through its float32 copy (e4m3 at two rows).  With head_dim 16 the two
 * rows go through cpu/fast.c's pairs on AVX-512, and V of the last token is also +inf:
 * only the second row sees that token, so the first must stay free of it. */
static void test_nan_codes_bitwise(void **state) {
        static const tsr_dtype dts[] = {TSR_DTYPE_FP8_E4M3, TSR_DTYPE_BF16};
        tsr_backend *ref = NULL, *fast = NULL;
        (void)state;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &fast),
                         TSR_OK);
        for (size_t d = 0; d < 8; d++) {
                kv_dt = dts[d % 2];
                struct kvc c = {d % 4 < 2 ? 1 : 2, 5, 4, 2, d < 4 ? 17 : 16, 3, 0.5f, 2.0f};
                kvc_init(&c);
                c.k_in[3] = NAN;                        /* token 0, KV head 0 */
                c.v_in[c.width + 20] = -NAN;            /* token 1, KV head 1 */
                if (d >= 4)                             /* the last token, KV head 0 */
                        c.v_in[(c.past_len + c.n - 1) * c.width + 2] = INFINITY;
                kvc_write(ref, &c, c.k8, c.v8);
                size_t out_n = c.n * c.n_heads * c.head_dim;
                float *o1 = malloc(out_n * sizeof *o1), *o2 = malloc(out_n * sizeof *o2);
                assert_true(o1 && o2);
                tsr_kv_view kv = kvc_view(&c, c.k8, c.v8);
                float scale = 1.0f / sqrtf((float)c.head_dim);
                assert_int_equal(tsr_backend_attention(ref, o1, c.q, &kv, c.n, c.past_len, c.n_heads, scale), TSR_OK);
                assert_int_equal(tsr_backend_attention(fast, o2, c.q, &kv, c.n, c.past_len, c.n_heads, scale), TSR_OK);
                size_t nans = 0;        /* V's NaN reaches group 1's outputs (K's is clamped by exp.h) */
                for (size_t i = 0; i < out_n; i++)
                        nans += isnan(o1[i]) != 0;
                assert_true(nans > 0);
                expect_same_bits(tsr_dtype_get_info(kv_dt)->name, o2, o1, out_n * sizeof *o1);
                free(o1), free(o2);
                kvc_done(&c);
        }
        kv_dt = TSR_DTYPE_FP8_E4M3;
        tsr_backend_free(&ref);
        tsr_backend_free(&fast);
}

/* Views the CPU backends refuse, and the CUDA backend's answer. */
static void test_bad_views(void **state) {
        (void)state;
        static const float bad[] = {0.0f, -1.0f, NAN, INFINITY};
        uint8_t k[8], v[8];
        float x[8] = {0}, out[8];
        uint32_t zero = 0;
        tsr_backend *bes[2] = {NULL, NULL};
        assert_int_equal(tsr_backend_cpu_ref_new(&bes[0]), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &bes[1]),
                         TSR_OK);
        for (size_t b = 0; b < 2; b++) {
                for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
                        tsr_kv_view kv = one_block(k, v, &zero, 1, 1, 8, bad[i], 1.0f);
                        assert_int_equal(tsr_backend_kv_write(bes[b], &kv, x, x, 1, 0), TSR_E_INVAL);
                        kv.k_scale = 1.0f, kv.v_scale = bad[i];
                        assert_int_equal(tsr_backend_attention(bes[b], out, x, &kv, 1, 0, 1, 1.0f), TSR_E_INVAL);
                }
                tsr_kv_view kv = one_block(k, v, &zero, 1, 1, 8, 1.0f, 1.0f);
                kv.dtype = TSR_DTYPE_F16;               /* a KV dtype no backend stores */
                assert_int_equal(tsr_backend_kv_write(bes[b], &kv, x, x, 1, 0), TSR_E_INVAL);
                assert_int_equal(tsr_backend_attention(bes[b], out, x, &kv, 1, 0, 1, 1.0f), TSR_E_INVAL);
                tsr_backend_free(&bes[b]);
        }
}

/* Backend memory of `bytes`, holding src when given (else zeros). */
static void *dev_copy(tsr_backend *be, const void *src, size_t bytes) {
        void *d = NULL;
        assert_int_equal(tsr_backend_mem_alloc(be, bytes, &d), TSR_OK);
        void *zeros = src ? NULL : calloc(1, bytes);
        assert_true(src || zeros);
        assert_int_equal(tsr_backend_upload(be, d, src ? src : zeros, bytes), TSR_OK);
        free(zeros);
        return d;
}

/* The CUDA backend on an fp8 cache: its kv_write codes bitwise the reference's (written
 * as a prefill then a step, through a scattered table), its attention within four times
 * the oracle's bound (its online softmax, its splits over the keys: attention.cu), a
 * batch of the same sequence twice bitwise each alone, and bad scales refused. */
static void test_cuda(void **state) {
        (void)state;
        static const struct kvc shapes[] = {
                {1, 0, 9, 3, 64, 16, 1.0f, 1.0f},      {1, 37, 9, 3, 64, 16, 0.5f, 2.0f},
                {5, 0, 9, 3, 33, 7, 1.0f, 1.0f},       {17, 40, 9, 3, 64, 4, 0.3f, 0.7f},
                {3, 5, 4, 4, 40, 3, 1.0f, 1.0f},       {2, 9, 8, 1, 12, 5, 4.0f, 0.0625f},
                {1, 70, 2, 2, 3, 1, 1.0f, 1.0f},       {9, 0, 6, 2, 17, 7, 1.5f, 1.5f},
                {1, 200, 3, 1, 96, 16, 0.02f, 0.05f},  {1, 1000, 9, 3, 64, 16, 0.5f, 2.0f},
                {4, 300, 4, 2, 128, 16, 0.3f, 0.7f},
        };
        tsr_backend *ref = NULL, *cuda = NULL;
        tsr_status st = tsr_backend_cuda_new(0, &cuda);
        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND)
                TSR_SKIP("no-gpu", "no CUDA device: %s", tsr_status_str(st));
        assert_int_equal(st, TSR_OK);
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        {       /* e5m2 is the CPU backends' only: refused */
                uint32_t zero = 0;
                uint8_t *dk8 = dev_copy(cuda, NULL, 64), *dv8 = dev_copy(cuda, NULL, 64);
                float *dx = dev_copy(cuda, NULL, 64 * sizeof(float));
                kv_dt = TSR_DTYPE_FP8_E5M2;
                tsr_kv_view kv = one_block(dk8, dv8, &zero, 1, 1, 8, 1.0f, 1.0f);
                kv_dt = TSR_DTYPE_FP8_E4M3;
                tsr_kv_seq one = {&zero, 1, 1, 0};
                assert_int_equal(tsr_backend_kv_write_batch(cuda, &kv, &one, 1, dx, dx), TSR_E_UNSUPPORTED);
                assert_int_equal(tsr_backend_attention_batch(cuda, dx, dx, &kv, &one, 1, 1, 1.0f), TSR_E_UNSUPPORTED);
                tsr_backend_mem_free(cuda, dk8), tsr_backend_mem_free(cuda, dv8), tsr_backend_mem_free(cuda, dx);
        }
        for (size_t ci = 0; ci < 2 * (sizeof shapes / sizeof *shapes); ci++) {
                size_t si = ci % (sizeof shapes / sizeof *shapes);
                kv_dt = ci < sizeof shapes / sizeof *shapes ? TSR_DTYPE_FP8_E4M3 : TSR_DTYPE_BF16;
                struct kvc c = shapes[si];
                char what[160];
                kvc_init(&c);
                size_t total = c.past_len + c.n, in_n = total * c.width, out_n = c.n * c.n_heads * c.head_dim;
                size_t bytes = c.cache * elt_bytes();
                float scale = 1.0f / sqrtf((float)c.head_dim);
                snprintf(what, sizeof what, "cuda %s shape %zu", tsr_dtype_get_info(kv_dt)->name, si);
                kvc_write(ref, &c, c.k8, c.v8);

                uint8_t *dk = dev_copy(cuda, NULL, bytes), *dv = dev_copy(cuda, NULL, bytes);
                float *dk_in = dev_copy(cuda, c.k_in, in_n * sizeof(float));
                float *dv_in = dev_copy(cuda, c.v_in, in_n * sizeof(float));
                float *dq = dev_copy(cuda, c.q, out_n * sizeof(float));
                float *dout = dev_copy(cuda, NULL, 2 * out_n * sizeof(float));
                tsr_kv_view kv = kvc_view(&c, dk, dv);
                if (c.past_len)
                        assert_int_equal(tsr_backend_kv_write(cuda, &kv, dk_in, dv_in, c.past_len, 0), TSR_OK);
                assert_int_equal(tsr_backend_kv_write(cuda, &kv, dk_in + c.past_len * c.width,
                                                      dv_in + c.past_len * c.width, c.n, c.past_len),
                                 TSR_OK);
                uint8_t *k2 = malloc(bytes), *v2 = malloc(bytes);
                float *o = malloc(2 * out_n * sizeof *o);
                assert_true(k2 && v2 && o);
                assert_int_equal(tsr_backend_download(cuda, k2, dk, bytes), TSR_OK);
                assert_int_equal(tsr_backend_download(cuda, v2, dv, bytes), TSR_OK);
                expect_same_bits(what, k2, c.k8, bytes);
                expect_same_bits(what, v2, c.v8, bytes);

                assert_int_equal(tsr_backend_attention(cuda, dout, dq, &kv, c.n, c.past_len, c.n_heads, scale), TSR_OK);
                assert_int_equal(tsr_backend_download(cuda, o, dout, out_n * sizeof *o), TSR_OK);
                check_vs_oracle(&c, o, 4.0, what);

                /* batched: the same sequence twice gives its rows twice, bitwise */
                float *dqq = dev_copy(cuda, NULL, 2 * out_n * sizeof(float)), *ob = malloc(2 * out_n * sizeof *ob);
                assert_non_null(ob);
                assert_int_equal(tsr_backend_copy(cuda, dqq, dq, out_n * sizeof(float)), TSR_OK);
                assert_int_equal(tsr_backend_copy(cuda, dqq + out_n, dq, out_n * sizeof(float)), TSR_OK);
                tsr_kv_seq seqs[2] = {{c.table, c.n_table, c.n, c.past_len}, {c.table, c.n_table, c.n, c.past_len}};
                assert_int_equal(tsr_backend_attention_batch(cuda, dout, dqq, &kv, seqs, 2, c.n_heads, scale), TSR_OK);
                assert_int_equal(tsr_backend_download(cuda, ob, dout, 2 * out_n * sizeof *ob), TSR_OK);
                expect_same_bits(what, ob, o, out_n * sizeof *o);
                expect_same_bits(what, ob + out_n, o, out_n * sizeof *o);

                if (si == 0 && kv_dt == TSR_DTYPE_FP8_E4M3) {   /* bad scales: refused as on the CPU */
                        tsr_kv_view bad = kv;
                        bad.k_scale = 0.0f;
                        assert_int_equal(tsr_backend_kv_write(cuda, &bad, dk_in, dv_in, 1, 0), TSR_E_INVAL);
                        bad.k_scale = 1.0f, bad.v_scale = NAN;
                        assert_int_equal(tsr_backend_attention(cuda, dout, dq, &bad, 1, 0, c.n_heads, scale),
                                         TSR_E_INVAL);
                }
                tsr_backend_mem_free(cuda, dk), tsr_backend_mem_free(cuda, dv);
                tsr_backend_mem_free(cuda, dk_in), tsr_backend_mem_free(cuda, dv_in);
                tsr_backend_mem_free(cuda, dq), tsr_backend_mem_free(cuda, dqq), tsr_backend_mem_free(cuda, dout);
                free(k2), free(v2), free(o), free(ob);
                kvc_done(&c);
        }
        kv_dt = TSR_DTYPE_FP8_E4M3;
        printf("cuda: fp8 e4m3 and bf16 kv_write bitwise cpu-ref and attention within the bound over %zu shapes "
               "each\n", sizeof shapes / sizeof *shapes);
        tsr_backend_free(&cuda);
        tsr_backend_free(&ref);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_write_codes),
                cmocka_unit_test(test_write_codes_e5m2),
                cmocka_unit_test(test_e5m2_ref_and_fast),
                cmocka_unit_test(test_ref_vs_oracle),
                cmocka_unit_test(test_fast_bitwise),
                cmocka_unit_test(test_write_bf16),
                cmocka_unit_test(test_bf16_ref_and_fast),
                cmocka_unit_test(test_nan_codes_bitwise),
                cmocka_unit_test(test_bad_views),
                cmocka_unit_test(test_cuda),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
