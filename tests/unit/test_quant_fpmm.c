/* test_quant_fpmm.c - the fp8 e4m3 and NVFP4 matmul of ModelOpt checkpoints
 * (kernels/quant/fpmm.h): the scalar reference against float64 oracles written here from
 * models.md §4, and the fast CPU backend (each ISA level, 1 and 3 threads) against the
 * reference BITWISE, over odd shapes, every e2m1 code, e4m3 NaN / saturation /
 * subnormals, a zero block, the largest block scale, and non-finite activations.
 *
 * Oracle bound for the reference: every product it sums is exact (fpmm.h), so it differs
 * from the exact sum only by float32 summation, at most n * 2^-24 * sum |terms| per
 * output (n - 1 additions, each off by at most half an ulp of a partial sum bounded by
 * sum |terms|), plus the one rounding of the final scale: 2^-24 |result|. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/quant/fpmm.h"
#include "kernels/quant/quant.h"

static uint64_t rng_state;

static uint64_t rnd(void) {
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return rng_state * 0x2545f4914f6cdd1dull;
}

static float frand(void) { return (float)(rnd() >> 40) / (float)(1u << 23) - 1.0f; }

static void seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }

/* Activations over magnitudes; `special` puts inf / NaN near the end of row 0. */
static float *rand_x(size_t rows, size_t n, int special) {
        float *x = malloc(rows * n * sizeof *x);
        assert_non_null(x);
        for (size_t i = 0; i < rows * n; i++) {
                float m = frand();
                x[i] = frand() * (m > 0.6f ? 30.0f : m < -0.6f ? 1e-3f : 1.0f);
        }
        if (special == 1)
                x[n - 1] = INFINITY;
        if (special == 2)
                x[n > 2 ? n - 2 : 0] = NAN;
        return x;
}

/* ---- e2m1 and e4m3 ------------------------------------------------------------------ */

static void test_e2m1_codes(void **state) {
        static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
        (void)state;
        for (uint8_t c = 0; c < 16; c++) {
                float v = tsr_e2m1_to_f32(c);
                assert_true(v == (c & 8 ? -mag[c & 7] : mag[c & 7]));
                assert_int_equal(tsr_fpmm_e2m1_x2(c), (int)(2 * v));
                assert_int_equal(tsr_f32_to_e2m1(v), c);              /* every code round-trips, -0 too */
        }
        /* ties to the even code (ModelOpt's _cast_fp4 bounds), saturation */
        static const struct { float x; uint8_t c; } cases[] = {
                {0.25f, 0}, {0.26f, 1}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6},
                {5.0f, 6}, {5.01f, 7}, {7.0f, 7}, {1e30f, 7}, {INFINITY, 7}, {-INFINITY, 15}, {-0.3f, 9},
                {0.1f, 0}, {-0.1f, 8},
        };
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
                if (tsr_f32_to_e2m1(cases[i].x) != cases[i].c)
                        fail_msg("e2m1(%g) = 0x%x, want 0x%x", cases[i].x, tsr_f32_to_e2m1(cases[i].x), cases[i].c);
}

static void test_e4m3_spec_checks(void **state) {
        (void)state;
        /* models.md §4.6 */
        assert_int_equal(tsr_f32_to_fp8_e4m3(1.0f), 0x38);
        assert_int_equal(tsr_f32_to_fp8_e4m3(448.0f), 0x7e);
        assert_int_equal(tsr_f32_to_fp8_e4m3(-2.0f), 0xc0);
        assert_int_equal(tsr_f32_to_fp8_e4m3(0x1p-9f), 0x01);
        assert_int_equal(tsr_f32_to_fp8_e4m3(500.0f), 0x7e);
        float xq;
        float x = 1e6f;
        tsr_fpmm_fp8_quantize_row(&x, 1, 1.0f, &xq);
        assert_true(xq == 448.0f);                                      /* saturates, never NaN */
        x = -INFINITY;
        tsr_fpmm_fp8_quantize_row(&x, 1, 0.5f, &xq);
        assert_true(xq == -448.0f);
        x = NAN;
        tsr_fpmm_fp8_quantize_row(&x, 1, 0.5f, &xq);
        assert_true(isnan(xq));
}

/* ---- oracles (float64, from the formulas) ------------------------------------------- */

static double e4m3d(uint8_t b) { return (double)tsr_fp8_e4m3_to_f32(b); }

/* The weight of row i, column k as a double; NaN for a NaN code. */
static double w_at(tsr_dtype t, const uint8_t *w, size_t n, size_t i, size_t k) {
        if (t == TSR_DTYPE_FP8_E4M3)
                return e4m3d(w[i * n + k]);
        const uint8_t *blk = w + i * (n / 16) * 9 + 9 * (k / 16);
        uint8_t byte = blk[1 + k % 16 / 2];
        return (double)tsr_e2m1_to_f32(k % 2 ? byte >> 4 : byte & 0xf) * e4m3d(blk[0]);
}

/* The activation as the kernel sees it (quantized or not), from the formulas. */
static void x_seen(tsr_dtype t, const float *x, size_t n, float input, double *xs) {
        if (input == 0) {
                for (size_t k = 0; k < n; k++)
                        xs[k] = x[k];
                return;
        }
        if (t == TSR_DTYPE_FP8_E4M3) {
                for (size_t k = 0; k < n; k++) {
                        float q = x[k] / input;                 /* clamp, then nearest even */
                        q = q > 448.0f ? 448.0f : q < -448.0f ? -448.0f : q;
                        xs[k] = isnan(q) ? NAN : e4m3d(tsr_f32_to_fp8_e4m3(q));
                }
                return;
        }
        float gs = 1.0f / input;
        for (size_t b = 0; b < n / 16; b++) {
                float amax = 0;
                bool fin = true;
                for (int k = 0; k < 16; k++) {
                        fin = fin && isfinite(x[16 * b + k]);
                        amax = fmaxf(amax, fabsf(x[16 * b + k]));
                }
                double sf = e4m3d(tsr_f32_to_fp8_e4m3(gs * amax / 6.0f));
                float os = sf != 0 ? 1.0f / ((float)sf * (1.0f / gs)) : 0.0f;
                for (int k = 0; k < 16; k++)
                        xs[16 * b + k] = fin ? (double)tsr_e2m1_to_f32(tsr_f32_to_e2m1(x[16 * b + k] * os)) * sf : NAN;
        }
}

/* ---- the matrix -------------------------------------------------------------------------- */

enum wvar { WV_RANDOM, WV_SPECIAL, WV_COUNT };

/* Random weights; WV_SPECIAL: fp8 NaN code in row 0, subnormals, +-448; NVFP4 a zero
 * block (scale 0), the largest scale 448, a subnormal scale, a NaN scale in row 0. */
static uint8_t *make_w(tsr_dtype t, size_t d, size_t n, int var, size_t *bytes) {
        assert_int_equal(tsr_dtype_row_bytes(t, d * n, bytes), TSR_OK);
        uint8_t *w = malloc(*bytes);
        assert_non_null(w);
        for (size_t i = 0; i < *bytes; i++) {
                w[i] = (uint8_t)rnd();
                if (t == TSR_DTYPE_FP8_E4M3 && (w[i] & 0x7f) == 0x7f)
                        w[i] &= 0xbf;                           /* no NaN by chance */
        }
        if (t == TSR_DTYPE_NVFP4)
                for (size_t b = 0; b < *bytes / 9; b++)
                        w[9 * b] = (uint8_t)(w[9 * b] & 0x3f);  /* scales positive, moderate */
        if (var == WV_SPECIAL) {
                if (t == TSR_DTYPE_FP8_E4M3) {
                        w[0] = 0x7f;                            /* NaN */
                        for (size_t k = 1; k < n && k < 9; k++)
                                w[(d > 1 ? n : 0) + k] = (uint8_t)(k % 2 ? 0x7e : 0x80 | (k & 7));
                } else {
                        size_t nb = *bytes / 9;
                        w[0] = 0x7f;                            /* NaN scale, block 0 of row 0 */
                        if (nb > 1)
                                w[9] = 0x00, memset(w + 10, 0x77, 8);   /* zero scale */
                        if (nb > 2)
                                w[18] = 0x7e;                   /* 448 */
                        if (nb > 3)
                                w[27] = 0x03;                   /* subnormal scale */
                        for (size_t c = 0; c < 16 && 4 * 9 + 1 + c / 2 < *bytes; c++)      /* all 16 codes */
                                w[36 + 1 + c / 2] = (uint8_t)(c % 2 ? (w[36 + 1 + c / 2] & 0x0f) | c << 4
                                                                  : (w[36 + 1 + c / 2] & 0xf0) | c);
                }
        }
        return w;
}

static void check_ref_vs_oracle(tsr_dtype t, const uint8_t *w, const float *x, const tsr_matmul_scales *s,
                                const float *got, size_t rows, size_t n, size_t d, const char *what) {
        double *xs = malloc(n * sizeof *xs);
        assert_non_null(xs);
        size_t bad = 0;
        for (size_t r = 0; r < rows; r++) {
                x_seen(t, x + r * n, n, s->input, xs);
                for (size_t i = 0; i < d; i++) {
                        double sum = 0, abs_sum = 0;
                        for (size_t k = 0; k < n; k++) {
                                double p = xs[k] * w_at(t, w, n, i, k);
                                sum += p;
                                abs_sum += fabs(p);
                        }
                        double scale = s->input > 0 ? (double)(s->input * s->weight) : (double)s->weight;
                        double want = sum * scale, g = got[r * d + i];
                        if (isnan(want) || isinf(want) || isnan(abs_sum)) {
                                if (!isnan(g) && !isinf(g) && !isnan(want)) {
                                        if (bad++ < 5)
                                                print_message("%s: [%zu,%zu] got %g, want non-finite\n", what, r, i, g);
                                }
                                continue;
                        }
                        double bound = (double)n * 0x1p-24 * abs_sum * scale + 0x1p-24 * fabs(want) + 1e-37;
                        if (!(fabs(g - want) <= bound) && bad++ < 5)
                                print_message("%s: [%zu,%zu] got %.9g want %.9g bound %.3g\n", what, r, i, g, want,
                                              bound);
                }
        }
        free(xs);
        if (bad)
                fail_msg("%s: %zu outputs off the oracle", what, bad);
}

static size_t compare_bitwise(const float *got, const float *want, size_t len, const char *what) {
        size_t bad = 0;
        for (size_t i = 0; i < len; i++) {
                uint32_t a, b;
                memcpy(&a, &got[i], 4), memcpy(&b, &want[i], 4);
                if (a == b || (isnan(got[i]) && isnan(want[i])))
                        continue;
                if (bad++ < 5)
                        print_message("%s: [%zu] got %.9g (0x%08x) want %.9g (0x%08x)\n", what, i, got[i], a,
                                      want[i], b);
        }
        return bad;
}

/* Every shape x variant x scale mode for dtype t: reference vs oracle, each candidate
 * backend vs reference bitwise, and each row alone vs in the batch. */
static void run_matrix(tsr_dtype t, tsr_backend **cands, size_t n_cands) {
        static const size_t n_fp8[] = {1, 3, 7, 8, 9, 17, 33, 129}, n_nv[] = {16, 48, 128, 144, 272};
        static const size_t d_list[] = {1, 3, 17, 37}, rows_list[] = {1, 3, 4, 5, 9};   /* 4, 9: the tiles */
        const size_t *n_list = t == TSR_DTYPE_NVFP4 ? n_nv : n_fp8;
        size_t n_n = t == TSR_DTYPE_NVFP4 ? sizeof n_nv / sizeof *n_nv : sizeof n_fp8 / sizeof *n_fp8;
        tsr_backend *ref;
        uint64_t k = 0;

        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        for (size_t a = 0; a < n_n; a++)
                for (size_t b = 0; b < sizeof d_list / sizeof *d_list; b++)
                        for (size_t c = 0; c < sizeof rows_list / sizeof *rows_list; c++)
                                for (int wv = 0; wv < WV_COUNT; wv++)
                                        for (int xv = 0; xv < 3; xv++)
                                                for (int act = 0; act < 2; act++) {
                        size_t n = n_list[a], d = d_list[b], rows = rows_list[c], bytes;
                        seed(++k + 1000 * t);
                        uint8_t *w = make_w(t, d, n, wv, &bytes);
                        float *x = rand_x(rows, n, xv);
                        /* input scale from the data (as calibration would), or weight-only;
                         * a large weight scale on some cases */
                        tsr_matmul_scales s = {.weight = k % 5 == 0 ? 3.0e4f : 0.01f + (float)(k % 7) * 0.3f,
                                               .input = act ? (t == TSR_DTYPE_NVFP4 ? 30.0f / 2688.0f : 30.0f / 448.0f)
                                                            : 0.0f};
                        float *want = malloc(rows * d * sizeof *want), *got = malloc(rows * d * sizeof *got);
                        float *one = malloc(d * sizeof *one);
                        char what[200];
                        snprintf(what, sizeof what, "%s %s rows %zu n %zu d %zu wvar %d xvar %d", tsr_dtype_name(t),
                                 act ? "act-quant" : "weight-only", rows, n, d, wv, xv);
                        assert_int_equal(tsr_backend_matmul_scaled(ref, want, x, w, t, &s, rows, n, d), TSR_OK);
                        check_ref_vs_oracle(t, w, x, &s, want, rows, n, d, what);
                        for (size_t ci = 0; ci < n_cands; ci++) {
                                char w2[260];
                                snprintf(w2, sizeof w2, "%s on %s/%s/%d", what, tsr_backend_name(cands[ci]),
                                         tsr_cpu_isa_name(tsr_backend_cpu_isa(cands[ci])),
                                         tsr_backend_threads(cands[ci]));
                                memset(got, 0xff, rows * d * sizeof *got);
                                assert_int_equal(tsr_backend_matmul_scaled(cands[ci], got, x, w, t, &s, rows, n, d),
                                                 TSR_OK);
                                if (compare_bitwise(got, want, rows * d, w2))
                                        fail_msg("%s: not bitwise the reference", w2);
                                /* batch invariance: the last row alone */
                                assert_int_equal(tsr_backend_matmul_scaled(cands[ci], one, x + (rows - 1) * n, w, t, &s,
                                                                           1, n, d), TSR_OK);
                                if (compare_bitwise(one, want + (rows - 1) * d, d, w2))
                                        fail_msg("%s: a row alone differs from the batch", w2);
                        }
                        free(w), free(x), free(want), free(got), free(one);
                }
        tsr_backend_free(&ref);
}

static size_t make_cands(tsr_backend **c) {
        size_t k = 0;
        int threads[] = {1, 3};
        tsr_cpu_isa isas[] = {TSR_CPU_ISA_SCALAR, TSR_CPU_ISA_AVX2};
        for (int i = 0; i < 2; i++) {
                if (isas[i] > tsr_cpu_isa_best())
                        continue;
                for (int j = 0; j < 2; j++) {
                        tsr_cpu_backend_config cfg = {.n_threads = threads[j], .max_isa = isas[i]};
                        assert_int_equal(tsr_backend_cpu_new(&cfg, &c[k]), TSR_OK);
                        k++;
                }
        }
        return k;
}

static void free_cands(tsr_backend **c, size_t n) {
        for (size_t i = 0; i < n; i++)
                tsr_backend_free(&c[i]);
}

static void test_fp8_matrix(void **state) {
        tsr_backend *c[4];
        size_t n = make_cands(c);
        (void)state;
        run_matrix(TSR_DTYPE_FP8_E4M3, c, n);
        free_cands(c, n);
        if (tsr_cpu_isa_best() < TSR_CPU_ISA_AVX2)
                TSR_SKIP("cpu-lacks:avx2", "this CPU runs %s at most", tsr_cpu_isa_name(tsr_cpu_isa_best()));
}

static void test_nvfp4_matrix(void **state) {
        tsr_backend *c[4];
        size_t n = make_cands(c);
        (void)state;
        run_matrix(TSR_DTYPE_NVFP4, c, n);
        free_cands(c, n);
        if (tsr_cpu_isa_best() < TSR_CPU_ISA_AVX2)
                TSR_SKIP("cpu-lacks:avx2", "this CPU runs %s at most", tsr_cpu_isa_name(tsr_cpu_isa_best()));
}

/* Exact cases worked by hand: fp8 1.0 (0x38) weights and x = input * {1, 2, ..}. */
static void test_hand_cases(void **state) {
        tsr_backend *ref;
        (void)state;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        uint8_t w8[4] = {0x38, 0x40, 0xc0, 0x01};       /* 1, 2, -2, 2^-9 */
        float x[4] = {0.5f, 1.0f, 0.25f, 512.0f}, out;
        tsr_matmul_scales s = {.weight = 2.0f, .input = 0.5f};
        /* xq = e4m3(x / 0.5) = {1, 2, 0.5, 448 (saturated)}; sum = 1 + 4 - 1 + 448 * 2^-9 */
        assert_int_equal(tsr_backend_matmul_scaled(ref, &out, x, w8, TSR_DTYPE_FP8_E4M3, &s, 1, 4, 1), TSR_OK);
        assert_true(out == (4.0f + 448.0f / 512.0f) * (0.5f * 2.0f));
        /* NVFP4: one block, scale 1.0 (0x38), codes 0..15; weight-only with x = 1 sums the
         * codes: 0 + .5 + 1 + 1.5 + 2 + 3 + 4 + 6 minus the same = 0; x = +1 on the first
         * half, 0 on the second: 18 */
        uint8_t blk[9] = {0x38};
        for (int c = 0; c < 16; c++)
                blk[1 + c / 2] |= (uint8_t)(c % 2 ? c << 4 : c);
        float xs[16];
        for (int k = 0; k < 16; k++)
                xs[k] = k < 8 ? 1.0f : 0.0f;
        s = (tsr_matmul_scales){.weight = 0.5f, .input = 0.0f};
        assert_int_equal(tsr_backend_matmul_scaled(ref, &out, xs, blk, TSR_DTYPE_NVFP4, &s, 1, 16, 1), TSR_OK);
        assert_true(out == 18.0f * 0.5f);
        /* W4A4 with input scale 1/6/448 * 6 ... x = 6 * input * 448 on element 7 (amax):
         * SFa = e4m3(448) = 448, os = 1 / (448 * input); x * os = 6 -> code 7; the rest 0. */
        memset(xs, 0, sizeof xs);
        xs[7] = 6.0f;                                   /* amax 6 -> gs*amax/6 = 1/input */
        s = (tsr_matmul_scales){.weight = 1.0f, .input = 1.0f};
        assert_int_equal(tsr_backend_matmul_scaled(ref, &out, xs, blk, TSR_DTYPE_NVFP4, &s, 1, 16, 1), TSR_OK);
        /* SFa = e4m3(1 * 6 / 6) = 1, qa_7 = e2m1(6) = 6, w_7 = code 7 = 6: 36 */
        assert_true(out == 36.0f);
        tsr_backend_free(&ref);
}

static void test_bad_args(void **state) {
        tsr_backend *ref;
        float x[32] = {0}, out[2];
        uint8_t w[64] = {0};
        (void)state;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        tsr_matmul_scales ok = {1.0f, 0.0f}, neg = {-1.0f, 0.0f}, nan_in = {1.0f, NAN}, zero = {0.0f, 1.0f};
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_FP8_E4M3, &neg, 1, 8, 1), TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_FP8_E4M3, &nan_in, 1, 8, 1),
                         TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_FP8_E4M3, &zero, 1, 8, 1), TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_FP8_E4M3, NULL, 1, 8, 1), TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_NVFP4, &ok, 1, 24, 1), TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul_scaled(ref, out, x, w, TSR_DTYPE_F32, &ok, 1, 8, 1), TSR_E_UNSUPPORTED);
        assert_int_equal(tsr_backend_matmul_scaled(NULL, out, x, w, TSR_DTYPE_FP8_E4M3, &ok, 1, 8, 1), TSR_E_INVAL);
        assert_true(tsr_backend_supports(ref, TSR_OP_MATMUL, TSR_DTYPE_FP8_E4M3));
        assert_true(tsr_backend_supports(ref, TSR_OP_MATMUL, TSR_DTYPE_NVFP4));
        assert_false(tsr_backend_supports(ref, TSR_OP_MATMUL, TSR_DTYPE_FP8_E5M2));
        /* the plain entry point: unit scales, weight-only */
        w[0] = 0x38;
        x[0] = 3.0f;
        assert_int_equal(tsr_backend_matmul(ref, out, x, w, TSR_DTYPE_FP8_E4M3, 1, 8, 1), TSR_OK);
        assert_true(out[0] == 3.0f);
        tsr_backend_free(&ref);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_e2m1_codes),
                cmocka_unit_test(test_e4m3_spec_checks),
                cmocka_unit_test(test_hand_cases),
                cmocka_unit_test(test_bad_args),
                cmocka_unit_test(test_fp8_matrix),
                cmocka_unit_test(test_nvfp4_matrix),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
