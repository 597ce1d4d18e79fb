/* test_cpu_fast.c - the fast CPU backend (kernels/cpu/fast.c) against the reference.
 *
 * float32 ops must be BITWISE ref.c's: over a table of odd shapes, for every ISA level
 * the CPU has (scalar, avx2, avx512_bf16) and for 1, 2 and 3 threads.  bf16 matmul:
 * bitwise the reference's where the dot products are widened (AVX2), within the float32
 * summation error bound where VDPBF16PS or AMX TDPBF16PS runs (their own orders; the
 * AMX level is skipped on CPUs without it); in every case bitwise invariant to the
 * thread count and to the rows around a row.  add_rmsnorm (the residual add fused with
 * the next norm): ref's is bitwise ref's add then rmsnorm, fast's bitwise ref's, and a
 * NaN or an infinity stays in its row.  Also: exp.h's exp (its stated accuracy against
 * exp() in double, its special values, its vector forms bitwise its scalar one), the bf16 rounding, the thread pool
 * (every task exactly once, a second driving thread, spans), and the int8 matmul's
 * activation quantization at its rounding edges.
 *
 * The cases loop over the levels the CPU has; one case per level above scalar
 * (isa_avx2, isa_avx512_bf16, isa_amx_bf16) runs that level alone and is the one that
 * skips, "[skip:cpu-lacks:LEVEL]", where the CPU lacks it, so the closing line counts
 * every level this machine could not test. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <float.h>
#include <stdbool.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/exp.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

/* The backends under test: the reference, and the fast one that configure() remakes with
 * a thread count and an ISA cap (the whole backend: pool and ISA are its own). */
static tsr_backend *ref, *fast;

static tsr_status configure(int threads, tsr_cpu_isa isa) {
        tsr_backend_free(&fast);
        return tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads, .max_isa = isa}, &fast);
}

/* The matmul with float32 / bfloat16 weights. */
static tsr_status mm_f32(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t n, size_t d) {
        return tsr_backend_matmul(be, out, x, w, TSR_DTYPE_F32, rows, n, d);
}

static tsr_status mm_bf16(tsr_backend *be, float *out, const float *x, const uint16_t *w, size_t rows, size_t n,
                          size_t d) {
        return tsr_backend_matmul(be, out, x, w, TSR_DTYPE_BF16, rows, n, d);
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static float frand(void) {      /* uniform in [-1, 1), xorshift64* */
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return (float)((rng_state * 0x2545f4914f6cdd1dull) >> 40) / (float)(1u << 23) - 1.0f;
}

/* Values spread over several magnitudes, so a changed summation order shows. */
static float *rand_vec(size_t n) {
        float *v = malloc((n ? n : 1) * sizeof(float));
        assert_non_null(v);
        for (size_t i = 0; i < n; i++) {
                float m = frand();
                v[i] = frand() * (m > 0.6f ? 1000.0f : m < -0.6f ? 1e-3f : 1.0f);
        }
        return v;
}

/* Compare bitwise; on a mismatch print the first few and fail. */
static void expect_bitwise(const char *what, const float *got, const float *want, size_t rows, size_t cols) {
        int shown = 0;
        size_t bad = 0;
        for (size_t i = 0; i < rows * cols; i++) {
                if (memcmp(&got[i], &want[i], sizeof(float)) == 0)
                        continue;
                if (shown++ < 5)
                        print_message("%s: [%zu,%zu] got %.9g (0x%08x) want %.9g (0x%08x)\n", what, i / cols, i % cols,
                                      got[i], *(const uint32_t *)&got[i], want[i], *(const uint32_t *)&want[i]);
                bad++;
        }
        if (bad)
                fail_msg("%s: %zu of %zu elements differ", what, bad, rows * cols);
}

static const tsr_cpu_isa isas[] = {TSR_CPU_ISA_SCALAR, TSR_CPU_ISA_AVX2, TSR_CPU_ISA_AVX512_BF16};
/* The bf16 matmul has one more level: AMX tiles (kernels/cpu/amx.c). */
static const tsr_cpu_isa bf16_isas[] = {TSR_CPU_ISA_SCALAR, TSR_CPU_ISA_AVX2, TSR_CPU_ISA_AVX512_BF16,
                                        TSR_CPU_ISA_AMX_BF16};
static const int thread_counts[] = {1, 2, 3};

static const size_t ns[] = {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 576, 1536 + 3};
static const size_t ds[] = {1, 3, 4, 5, 17, 64, 67};
static const size_t rows_list[] = {1, 2, 3, 4, 5, 7, 48, 49, 67};

/* Configure `threads` at `isa`; false (and a note) when the CPU lacks that level, so the
 * caller skips it instead of testing a lower level twice. */
static bool configure_isa(int threads, tsr_cpu_isa isa) {
        assert_int_equal(configure(threads, isa), TSR_OK);
        if (tsr_backend_cpu_isa(fast) == isa)
                return true;
        print_message("isa %s not available here (best %s): skipped\n", tsr_cpu_isa_name(isa),
                      tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)));
        return false;
}

/* ---- matmul f32 ------------------------------------------------------------------------- */

static void test_matmul_f32_bitwise(void **state) {
        size_t checked = 0;

        for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++)
                for (size_t ti = 0; ti < sizeof thread_counts / sizeof *thread_counts; ti++) {
                        assert_int_equal(configure(thread_counts[ti], isas[ii]), TSR_OK);
                        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
                                for (size_t b = 0; b < sizeof ds / sizeof *ds; b++)
                                        for (size_t c = 0; c < sizeof rows_list / sizeof *rows_list; c++) {
                                                size_t n = ns[a], d = ds[b], rows = rows_list[c];
                                                if (n * d * rows > 4000000 && ti > 0)
                                                        continue;       /* the big ones once per ISA */
                                                float *x = rand_vec(rows * n), *w = rand_vec(d * n);
                                                float *o1 = malloc(rows * d * sizeof(float));
                                                float *o2 = malloc(rows * d * sizeof(float));
                                                char what[128];
                                                assert_int_equal(mm_f32(ref, o1, x, w, rows, n, d), TSR_OK);
                                                assert_int_equal(mm_f32(fast, o2, x, w, rows, n, d), TSR_OK);
                                                snprintf(what, sizeof what, "matmul %s t%d rows %zu n %zu d %zu",
                                                         tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)),
                                                         tsr_backend_threads(fast), rows, n, d);
                                                expect_bitwise(what, o2, o1, rows, d);
                                                checked++;
                                                free(x);
                                                free(w);
                                                free(o1);
                                                free(o2);
                                        }
                }
        print_message("matmul f32: %zu shape/isa/thread cases bitwise equal to cpu-ref (best isa %s)\n", checked,
                      tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)));
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* Special values: zeros of both signs, infinities and NaN lanes go through the same adds. */
static void test_matmul_f32_special(void **state) {
        size_t n = 19, d = 9, rows = 5;
        float *x = rand_vec(rows * n), *w = rand_vec(d * n);
        float o1[45], o2[45];

        x[0] = -0.0f;
        w[0] = 0.0f;            /* row 0: -0 * +0 = -0 on lane 0 */
        w[n + 3] = INFINITY;    /* row 1 with an infinity */
        w[2 * n + 17] = NAN;    /* row 2 with a NaN in the tail */
        for (size_t k = 0; k < n; k++)
                w[3 * n + k] = -0.0f;   /* row 3 all -0: a dot of -0 products */
        assert_int_equal(configure(2, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
        assert_int_equal(mm_f32(ref, o1, x, w, rows, n, d), TSR_OK);
        assert_int_equal(mm_f32(fast, o2, x, w, rows, n, d), TSR_OK);
        for (size_t i = 0; i < rows * d; i++)
                if (isnan(o1[i]))
                        assert_true(isnan(o2[i]));
                else
                        assert_memory_equal(&o1[i], &o2[i], sizeof(float));
        assert_int_equal(mm_f32(fast, o2, x, NULL, rows, n, d), TSR_E_INVAL);
        assert_int_equal(mm_f32(fast, o2, x, w, rows, 0, d), TSR_E_INVAL);
        assert_int_equal(mm_f32(fast, o2, x, w, 0, n, d), TSR_OK);
        free(x);
        free(w);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- attention ---------------------------------------------------------------------------- */

struct att_case {
        size_t n, past_len, n_heads, n_kv_heads, head_dim, block_size;
};

static void run_attention_case(const struct att_case *ac, const char *tag) {
        size_t total = ac->past_len + ac->n, bs = ac->block_size;
        size_t n_table = (total + bs - 1) / bs, n_blocks = n_table + 3;
        size_t width = ac->n_kv_heads * ac->head_dim, q_width = ac->n_heads * ac->head_dim;
        float *k = rand_vec(n_blocks * bs * width), *v = rand_vec(n_blocks * bs * width);
        float *q = rand_vec(ac->n * q_width);
        float *o1 = malloc(ac->n * q_width * sizeof(float)), *o2 = malloc(ac->n * q_width * sizeof(float));
        uint32_t *table = malloc(n_table * sizeof(uint32_t));
        char what[160];

        for (size_t i = 0; i < n_table; i++)
                table[i] = (uint32_t)((i * 7 + 2) % n_blocks);  /* scattered, distinct blocks */
        for (size_t i = 0; i < ac->n * q_width; i++)
                q[i] *= 0.05f;                                  /* keep exp() in range */
        tsr_kv_view kv = {.k = k, .v = v, .block_table = table, .n_table = n_table, .n_blocks = n_blocks,
                          .block_size = bs, .n_kv_heads = ac->n_kv_heads, .head_dim = ac->head_dim};
        float scale = 1.0f / sqrtf((float)ac->head_dim);
        assert_int_equal(tsr_backend_attention(ref, o1, q, &kv, ac->n, ac->past_len, ac->n_heads, scale), TSR_OK);
        assert_int_equal(tsr_backend_attention(fast, o2, q, &kv, ac->n, ac->past_len, ac->n_heads, scale), TSR_OK);
        snprintf(what, sizeof what, "attention %s n %zu past %zu heads %zu/%zu hd %zu bs %zu", tag, ac->n,
                 ac->past_len, ac->n_heads, ac->n_kv_heads, ac->head_dim, ac->block_size);
        expect_bitwise(what, o2, o1, ac->n, q_width);
        free(k);
        free(v);
        free(q);
        free(o1);
        free(o2);
        free(table);
}

static void test_attention_bitwise(void **state) {
        static const struct att_case cases[] = {
                {1, 0, 9, 3, 64, 16},   {1, 37, 9, 3, 64, 16}, {5, 0, 9, 3, 64, 16},  {17, 40, 9, 3, 64, 4},
                {3, 5, 4, 4, 40, 3},    {2, 9, 8, 1, 12, 5},   {1, 70, 2, 2, 4, 1},   {9, 0, 6, 2, 33, 7},
                {64, 0, 4, 2, 128, 16}, {1, 200, 3, 1, 96, 16},
        };
        for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++)
                for (size_t ti = 0; ti < sizeof thread_counts / sizeof *thread_counts; ti++) {
                        char tag[64];
                        assert_int_equal(configure(thread_counts[ti], isas[ii]), TSR_OK);
                        snprintf(tag, sizeof tag, "%s t%d", tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)),
                                 tsr_backend_threads(fast));
                        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
                                run_attention_case(&cases[c], tag);
                }
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- bf16 --------------------------------------------------------------------------------- */

static void test_bf16_rounding(void **state) {
        static const struct {
                uint32_t in;
                uint16_t out;
        } cases[] = {
                {0x3f800000u, 0x3f80}, /* 1.0 */
                {0x3f808000u, 0x3f80}, /* tie, even stays */
                {0x3f818000u, 0x3f82}, /* tie, odd rounds up */
                {0x3f808001u, 0x3f81}, /* above the tie */
                {0x3f807fffu, 0x3f80}, /* below the tie */
                {0xbf818000u, 0xbf82}, /* negative tie */
                {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to +inf */
                {0x7f800000u, 0x7f80}, /* +inf */
                {0xff800000u, 0xff80}, /* -inf */
                {0x80000000u, 0x8000}, /* -0 */
                {0x00000001u, 0x0000}, /* smallest denormal rounds to 0 */
                {0x00018000u, 0x0002}, /* denormal tie to even */
        };
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
                float f;
                memcpy(&f, &cases[i].in, sizeof f);
                if (tsr_f32_to_bf16(f) != cases[i].out)
                        fail_msg("bf16(0x%08x) = 0x%04x, want 0x%04x", cases[i].in, tsr_f32_to_bf16(f), cases[i].out);
                float back = tsr_bf16_to_f32(cases[i].out);
                uint32_t bits;
                memcpy(&bits, &back, sizeof bits);
                assert_int_equal(bits, (uint32_t)cases[i].out << 16);
        }
        uint16_t qnan = tsr_f32_to_bf16(NAN);
        assert_true(isnan(tsr_bf16_to_f32(qnan)));
        uint32_t snan_bits = 0x7f800001u;       /* a NaN whose payload lives in the dropped half */
        float snan;
        memcpy(&snan, &snan_bits, sizeof snan);
        assert_true(isnan(tsr_bf16_to_f32(tsr_f32_to_bf16(snan))));
}

static uint16_t *to_bf16_vec(const float *x, size_t n) {
        uint16_t *b = malloc((n ? n : 1) * sizeof *b);
        assert_non_null(b);
        for (size_t i = 0; i < n; i++)
                b[i] = tsr_f32_to_bf16(x[i]);
        return b;
}

/* The float32 error bound of any summation order of these products: both orders are
 * within (n-1) u sum |p| of the exact sum, so of each other within twice that. */
static double dot_bound(const uint16_t *w, const float *x, size_t n) {
        double s = 0;
        for (size_t k = 0; k < n; k++)
                s += fabs((double)tsr_bf16_to_f32(w[k]) * (double)tsr_bf16_to_f32(tsr_f32_to_bf16(x[k])));
        return 2.0 * (double)(n > 1 ? n - 1 : 1) * (FLT_EPSILON / 2) * s + 1e-30;
}

static void test_matmul_bf16(void **state) {

        for (size_t ii = 0; ii < sizeof bf16_isas / sizeof *bf16_isas; ii++) {
                size_t checked = 0, bitwise = 0;
                double worst = 0;
                if (!configure_isa(1, bf16_isas[ii]))
                        continue;
                bool exact = tsr_backend_cpu_isa(fast) < TSR_CPU_ISA_AVX512_BF16;
                for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
                        for (size_t b = 0; b < sizeof ds / sizeof *ds; b++)
                                for (size_t c = 0; c < sizeof rows_list / sizeof *rows_list; c += 2) {
                                        size_t n = ns[a], d = ds[b], rows = rows_list[c];
                                        float *x = rand_vec(rows * n), *wf = rand_vec(d * n);
                                        uint16_t *w = to_bf16_vec(wf, d * n);
                                        float *o1 = malloc(rows * d * sizeof(float));
                                        float *o2 = malloc(rows * d * sizeof(float));
                                        float *o3 = malloc(rows * d * sizeof(float));
                                        char what[128];
                                        snprintf(what, sizeof what, "matmul_bf16 %s rows %zu n %zu d %zu",
                                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), rows, n, d);
                                        assert_int_equal(mm_bf16(ref, o1, x, w, rows, n, d), TSR_OK);
                                        assert_int_equal(mm_bf16(fast, o2, x, w, rows, n, d), TSR_OK);
                                        if (exact) {
                                                expect_bitwise(what, o2, o1, rows, d);
                                                bitwise++;
                                        } else {
                                                for (size_t r = 0; r < rows; r++)
                                                        for (size_t i = 0; i < d; i++) {
                                                                double bound = dot_bound(w + i * n, x + r * n, n);
                                                                double diff = fabs((double)o2[r * d + i] -
                                                                                   (double)o1[r * d + i]);
                                                                worst = fmax(worst, diff / bound);
                                                                if (!(diff <= bound))
                                                                        fail_msg("%s [%zu,%zu]: %.9g vs ref %.9g, "
                                                                                 "bound %.3g", what, r, i,
                                                                                 o2[r * d + i], o1[r * d + i], bound);
                                                        }
                                        }
                                        /* Thread count: bitwise the same. */
                                        assert_int_equal(configure(3, bf16_isas[ii]), TSR_OK);
                                        assert_int_equal(mm_bf16(fast, o3, x, w, rows, n, d), TSR_OK);
                                        expect_bitwise(what, o3, o2, rows, d);
                                        assert_int_equal(configure(1, bf16_isas[ii]), TSR_OK);
                                        /* Batch: the last row alone is bitwise that row among the others. */
                                        assert_int_equal(mm_bf16(fast, o3, x + (rows - 1) * n, w, 1, n, d), TSR_OK);
                                        expect_bitwise(what, o3, o2 + (rows - 1) * d, 1, d);
                                        checked++;
                                        free(x);
                                        free(wf);
                                        free(w);
                                        free(o1);
                                        free(o2);
                                        free(o3);
                                }
                print_message("matmul_bf16 %s: %zu cases, %zu bitwise to cpu-ref, worst |fast-ref| / error bound "
                              "= %.3g\n", tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), checked, bitwise, worst);
        }
        assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
}

/* Infinities and NaN in some weight rows stay in those rows' outputs: the k tail and the
 * ragged last block of weight rows (n = 45, d = 21) never mix another row's values in
 * (0 x inf would be NaN), and finite outputs stay within the error bound. */
static void test_matmul_bf16_special(void **state) {
        size_t n = 45, d = 21, rows = 3;
        float *x = rand_vec(rows * n), *wf = rand_vec(d * n);
        float o1[63], o2[63];

        wf[2 * n] = INFINITY;           /* weight row 2 starts with +inf: row 1's tail ends next to it */
        wf[5 * n + 3] = NAN;            /* row 5: the first row of the last (overlapping) block of 16 */
        wf[20 * n + 44] = -INFINITY;    /* row 20: the last element of w */
        uint16_t *w = to_bf16_vec(wf, d * n);
        for (size_t ii = 0; ii < sizeof bf16_isas / sizeof *bf16_isas; ii++) {
                if (!configure_isa(2, bf16_isas[ii]))
                        continue;
                assert_int_equal(mm_bf16(ref, o1, x, w, rows, n, d), TSR_OK);
                assert_int_equal(mm_bf16(fast, o2, x, w, rows, n, d), TSR_OK);
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < d; i++) {
                                float a = o2[r * d + i], b = o1[r * d + i];
                                if (isnan(b) || isinf(b)) {
                                        if (!(isnan(b) ? isnan(a) : a == b))
                                                fail_msg("matmul_bf16 %s [%zu,%zu]: %g, cpu-ref %g",
                                                         tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), r, i, a, b);
                                } else if (!(fabs((double)a - (double)b) <= dot_bound(w + i * n, x + r * n, n))) {
                                        fail_msg("matmul_bf16 %s [%zu,%zu]: %.9g, cpu-ref %.9g",
                                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), r, i, a, b);
                                }
                        }
        }
        free(x);
        free(wf);
        free(w);
        assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
}

/* Float32 subnormals and the smallest normals as x, n = 1 (see the comment below):
 * every output is ref's product or zero, and the normal ones are ref's exactly. */
static void test_matmul_bf16_subnormal_x(const uint16_t *w, size_t d) {
        static const uint32_t xbits[] = {
                0x00000001u, 0x00008000u, 0x00018000u, 0x00400000u, 0x007fffffu, 0x807f0000u, 0x80000001u,
                0x00800000u, 0x80800000u, 0x007fc000u, 0x00010000u, 0x00000000u, 0x80000000u, 0x00c00000u,
                0x003f8000u, 0x80200000u, 0x00700000u,
        };
        enum { ROWS = sizeof xbits / sizeof *xbits, D_MAX = 19 };
        float x[ROWS], o1[ROWS * D_MAX], o2[ROWS * D_MAX];

        assert_true(d <= D_MAX);
        for (size_t r = 0; r < ROWS; r++)
                memcpy(&x[r], &xbits[r], sizeof(float));
        assert_int_equal(mm_bf16(ref, o1, x, w, ROWS, 1, d), TSR_OK);
        assert_int_equal(mm_bf16(fast, o2, x, w, ROWS, 1, d), TSR_OK);
        size_t zeroed = 0;
        for (size_t i = 0; i < ROWS * d; i++) {
                bool normal_x = fabsf(x[i / d]) >= FLT_MIN;
                zeroed += o1[i] != 0.0f && o2[i] == 0.0f;
                bool same = memcmp(&o1[i], &o2[i], sizeof(float)) == 0;
                if (normal_x ? !same : !(same || o2[i] == 0.0f))
                        fail_msg("matmul_bf16 %s: x 0x%08x w[%zu]: %.9g, cpu-ref %.9g",
                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), xbits[i / d], i % d, o2[i], o1[i]);
        }
        print_message("matmul_bf16 %s: subnormal x, %zu of %zu products read as zero\n",
                      tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), zeroed, ROWS * d);
}

/* The rounding of x to bf16 inside matmul_bf16 (vectorised on AMX) is exactly b() of
 * kernels.h: with n = 1 each output is one exact product f(w) * f(b(x)), so every level
 * must match the reference bitwise, ties and overflow to inf included, and keep NaN.
 * Subnormal x (test_matmul_bf16_subnormal_x): b() keeps them as bf16 subnormals, which
 * ref.c multiplies as they are and VDPBF16PS and TDPBF16PS read as zero, so there an
 * output is the reference's product or a zero (of either sign). */
static void test_matmul_bf16_x_rounding(void **state) {
        static const uint32_t xbits[] = {
                0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf818000u, 0x7f7fffffu,
                0x7f800000u, 0xff800000u, 0x7fc00001u, 0xffa00000u, 0x7f800001u, 0x00800000u, 0x4b7fff80u, 0xc2fe8000u,
                0x3eaaaaabu, 0x41200000u, 0x3dcccccdu, 0xc0490fdbu,
        };
        enum { ROWS = sizeof xbits / sizeof *xbits, D = 19 };
        size_t rows = ROWS, d = D;
        float x[ROWS], o1[ROWS * D], o2[ROWS * D];
        uint16_t w[D];

        for (size_t r = 0; r < rows; r++)
                memcpy(&x[r], &xbits[r], sizeof(float));
        for (size_t i = 0; i < d; i++)
                w[i] = tsr_f32_to_bf16(i % 2 ? -2.0f : 1.0f + (float)i / 8.0f);
        for (size_t ii = 0; ii < sizeof bf16_isas / sizeof *bf16_isas; ii++) {
                if (!configure_isa(1, bf16_isas[ii]))
                        continue;
                assert_int_equal(mm_bf16(ref, o1, x, w, rows, 1, d), TSR_OK);
                assert_int_equal(mm_bf16(fast, o2, x, w, rows, 1, d), TSR_OK);
                for (size_t i = 0; i < rows * d; i++)
                        if (isnan(o1[i]) ? !isnan(o2[i]) : memcmp(&o1[i], &o2[i], sizeof(float)) != 0)
                                fail_msg("matmul_bf16 %s: x 0x%08x w[%zu]: %.9g, cpu-ref %.9g",
                                         tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), xbits[i / d], i % d, o2[i],
                                         o1[i]);
                test_matmul_bf16_subnormal_x(w, d);
        }
        assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
}

/* Batch invariance of the bf16 matmul at every level: each of 64 rows computed alone
 * (decode) is bitwise that row among the 63 others (prefill), for 1, 2 and 3 threads and
 * for the rows in the middle of a batch too (rows 20 .. 27 of it as a batch of 8).  On
 * AMX a row alone sits in column 0 of a tile padded with zeros, and among others in
 * column r % 16 of block r / 16.  d = 131 is 9 blocks of 16 weight rows, several per
 * pool task; the batch is also checked against the reference (error bound). */
static void test_matmul_bf16_batch_invariance(void **state) {
        size_t n = 576 + 7, d = 131, rows = 64;
        float *x = rand_vec(rows * n), *wf = rand_vec(d * n);
        uint16_t *w = to_bf16_vec(wf, d * n);
        float *all = malloc(rows * d * sizeof(float)), *part = malloc(8 * d * sizeof(float));
        float *one = malloc(d * sizeof(float)), *want = malloc(rows * d * sizeof(float));

        assert_int_equal(mm_bf16(ref, want, x, w, rows, n, d), TSR_OK);

        for (size_t ii = 0; ii < sizeof bf16_isas / sizeof *bf16_isas; ii++)
                for (int t = 1; t <= 3; t++) {
                        char what[96];
                        if (!configure_isa(t, bf16_isas[ii]))
                                break;
                        snprintf(what, sizeof what, "matmul_bf16 %s t%d: row alone vs among 64",
                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), t);
                        assert_int_equal(mm_bf16(fast, all, x, w, rows, n, d), TSR_OK);
                        for (size_t i = 0; i < rows * d; i++)
                                if (!(fabs((double)all[i] - (double)want[i]) <=
                                      dot_bound(w + i % d * n, x + i / d * n, n)))
                                        fail_msg("%s: [%zu,%zu] %.9g, cpu-ref %.9g", what, i / d, i % d, all[i],
                                                 want[i]);
                        for (size_t r = 0; r < rows; r++) {
                                assert_int_equal(mm_bf16(fast, one, x + r * n, w, 1, n, d), TSR_OK);
                                expect_bitwise(what, one, all + r * d, 1, d);
                        }
                        assert_int_equal(mm_bf16(fast, part, x + 20 * n, w, 8, n, d), TSR_OK);
                        expect_bitwise(what, part, all + 20 * d, 8, d);
                }
        free(x);
        free(wf);
        free(w);
        free(all);
        free(part);
        free(one);
        free(want);
        assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
}

/* Two threads calling matmul_bf16 at once: one drives the pool, the other runs its tasks
 * inline (pool.h); on AMX each task loads and releases the tile configuration itself, so
 * both get bitwise what they get alone. */
struct bf16_caller {
        const float *x;
        const uint16_t *w;
        const float *want;
        size_t rows, n, d;
        bool ok;
};

static void *call_bf16(void *arg) {
        struct bf16_caller *c = arg;
        float *o = malloc(c->rows * c->d * sizeof(float));
        c->ok = o != NULL;
        for (int i = 0; c->ok && i < 40; i++)
                c->ok = mm_bf16(fast, o, c->x, c->w, c->rows, c->n, c->d) == TSR_OK &&
                        memcmp(o, c->want, c->rows * c->d * sizeof(float)) == 0;
        free(o);
        return NULL;
}

static void test_matmul_bf16_two_callers(void **state) {
        size_t n = 200, d = 96;
        struct bf16_caller c[2] = {{.rows = 1, .n = n, .d = d}, {.rows = 21, .n = n, .d = d}};
        float *buf[6];

        for (int i = 0; i < 2; i++) {
                float *x = rand_vec(c[i].rows * n), *wf = rand_vec(d * n);
                float *want = malloc(c[i].rows * d * sizeof(float));
                uint16_t *w = to_bf16_vec(wf, d * n);
                assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
                assert_int_equal(mm_bf16(fast, want, x, w, c[i].rows, n, d), TSR_OK);
                c[i].x = x;
                c[i].w = w;
                c[i].want = want;
                buf[3 * i] = x;
                buf[3 * i + 1] = wf;
                buf[3 * i + 2] = want;
        }
        assert_int_equal(configure(2, TSR_CPU_ISA_AMX_BF16), TSR_OK);
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, call_bf16, &c[0]), 0);
        call_bf16(&c[1]);
        assert_int_equal(pthread_join(th, NULL), 0);
        assert_true(c[0].ok);
        assert_true(c[1].ok);
        for (int i = 0; i < 6; i++)
                free(buf[i]);
        free((void *)c[0].w);
        free((void *)c[1].w);
        assert_int_equal(configure(1, TSR_CPU_ISA_AMX_BF16), TSR_OK);
}

/* ---- batch invariance through the table ----------------------------------------------------- */

static void test_batch_invariance(void **state) {
        size_t n = 576, d = 131, rows = 37;
        float *x = rand_vec(rows * n), *w = rand_vec(d * n);
        float *all = malloc(rows * d * sizeof(float)), *one = malloc(d * sizeof(float));

        for (int t = 1; t <= 3; t++) {
                assert_int_equal(configure(t, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
                assert_int_equal(mm_f32(fast, all, x, w, rows, n, d), TSR_OK);
                for (size_t r = 0; r < rows; r++) {
                        assert_int_equal(mm_f32(fast, one, x + r * n, w, 1, n, d), TSR_OK);
                        expect_bitwise("row alone vs in batch", one, all + r * d, 1, d);
                }
        }
        free(x);
        free(w);
        free(all);
        free(one);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* Activation rows of quantization edge cases, block (of qk) b of row r by (b + r) % 6:
 * amax 127 with x.5 ties in every 32 (x * id == x), small values, -0 and denormals beside
 * larger ones, all zero, a block under 127 / FLT_MAX (127 / amax overflows: quant/qmm.h
 * makes it a zero block) with zeros in it, large random.  Row 0 (the 1-row case) has only
 * zero and tiny blocks, so a tiny block quantized otherwise shows in its outputs instead
 * of vanishing beside larger terms. */
static void edge_rows(float *x, size_t rows, size_t n, size_t qk) {
        for (size_t r = 0; r < rows; r++)
                for (size_t b = 0; b < n / qk; b++)
                        for (size_t k = 0; k < qk; k++) {
                                float *v = &x[r * n + qk * b + k], half = (float)(k % 32) - 15.5f;
                                switch (r == 0 ? 3 + b % 2 : (b + r) % 6) {
                                case 0: *v = k == 0 ? 127.0f : half * (r % 2 ? -1.0f : 1.0f); break;
                                case 1: *v = k == 3 ? -0.75f : k == 9 ? 0.75f : frand() * 0.75f; break;
                                case 2: *v = k % 3 == 0 ? -0.0f : k % 3 == 1 ? 1e-40f : 2.5f * frand(); break;
                                case 3: *v = 0.0f; break;
                                case 4: *v = k % 3 == 0 ? 1e-37f : k % 3 == 1 ? -5e-38f : 0.0f; break;
                                default: *v = frand() * 1000.0f; break;
                                }
                        }
}

/* The K formats' activation quantization (cpu/qmm.c quantizek_row: the same per-32 steps
 * over a 256-block, and the sums of 16): blocks of 256 built as the edges test below
 * builds its blocks of 32 (amax 127 with x.5 ties in every 32, -0 and denormals, zero,
 * random, large), against random q4_K / q6_K weights; bitwise the reference for 1 row and
 * 9, at every ISA level (AVX-512: the zmm K tiles), 1 and 2 threads. */
static void test_qmm_quantize_k_edges(void **state) {
        static const tsr_dtype types[] = {TSR_DTYPE_Q4_K, TSR_DTYPE_Q6_K};
        const size_t nb = 3, n = 256 * nb, d = 5, rows = 9;
        float *x = malloc(rows * n * sizeof(float)), *o1 = malloc(rows * d * sizeof(float));
        float *o2 = malloc(rows * d * sizeof(float));
        (void)state;

        edge_rows(x, rows, n, 256);
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
                tsr_dtype t = types[ti];
                size_t bb = tsr_dtype_get_info(t)->block_bytes;
                uint8_t *w = malloc(d * nb * bb);
                for (size_t i = 0; i < d * nb * bb; i++)
                        w[i] = (uint8_t)(frand() * 128.0f + 128.0f);
                for (size_t blk = 0; blk < d * nb; blk++) {     /* finite f16 scales: d (and dmin) = 1/64 */
                        uint8_t *p = w + blk * bb + (t == TSR_DTYPE_Q6_K ? 208 : 0);
                        p[0] = 0x00, p[1] = 0x24;
                        if (t == TSR_DTYPE_Q4_K)
                                p[2] = 0x00, p[3] = 0x24;
                }
                for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++)
                        for (int threads = 1; threads <= 2; threads++) {
                                assert_int_equal(configure(threads, isas[ii]), TSR_OK);
                                for (size_t rr = 1; rr <= rows; rr += rows - 1) {
                                        char what[96];
                                        snprintf(what, sizeof what, "matmul_%s quantize edges rows %zu t%d %s",
                                                 tsr_dtype_get_info(t)->name, rr, threads,
                                                 tsr_cpu_isa_name(isas[ii]));
                                        assert_int_equal(tsr_backend_matmul(ref, o1, x, w, t, rr, n, d), TSR_OK);
                                        assert_int_equal(tsr_backend_matmul(fast, o2, x, w, t, rr, n, d), TSR_OK);
                                        expect_bitwise(what, o2, o1, rr, d);
                                }
                        }
                free(w);
        }
        free(x);
        free(o1);
        free(o2);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- the int8 matmul's activation quantization (cpu/qmm.c quantize32_row) ----------------
 * Blocks built to hit the rounding's edges: amax 127 (x * id == x, so every x.5 is a tie
 * that rintf sends to even), +-amax itself (+-127), -0 and denormals beside larger
 * values, an all-zero block, and random blocks; weights with every code 1 (the output is
 * then dx times the sum of the q's: any changed q shows), alternating signs, and random.
 * The fast backend bitwise the reference for 1 row (the decode path) and 9 (the pool). */
static void test_qmm_quantize_edges(void **state) {
        static const tsr_dtype types[] = {TSR_DTYPE_Q8_0, TSR_DTYPE_Q4_1};
        const size_t nb = 9, n = 32 * nb, d = 3, rows = 9;
        float *x = malloc(rows * n * sizeof(float)), *o1 = malloc(rows * d * sizeof(float));
        float *o2 = malloc(rows * d * sizeof(float));
        uint8_t w[3 * 9 * 34];

        edge_rows(x, rows, n, 32);
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
                tsr_dtype t = types[ti];
                size_t bb = tsr_dtype_get_info(t)->block_bytes, off = t == TSR_DTYPE_Q8_0 ? 2 : 4;
                for (size_t i = 0; i < d; i++)
                        for (size_t b = 0; b < nb; b++) {
                                uint8_t *blk = w + (i * nb + b) * bb;
                                blk[0] = 0x00, blk[1] = 0x3c;           /* d = 1.0 (f16) */
                                if (t == TSR_DTYPE_Q4_1)
                                        blk[2] = 0x00, blk[3] = 0xbc;   /* m = -1.0 */
                                for (size_t k = off; k < bb; k++)
                                        blk[k] = i == 0   ? (t == TSR_DTYPE_Q8_0 ? 0x01 : 0x11)
                                                 : i == 1 ? (t == TSR_DTYPE_Q8_0 ? (k % 2 ? 0x01 : 0xff) : 0xf1)
                                                          : (uint8_t)(frand() * 128.0f + 128.0f);
                        }
                for (int threads = 1; threads <= 2; threads++) {
                        assert_int_equal(configure(threads, TSR_CPU_ISA_AVX2), TSR_OK);
                        for (size_t rr = 1; rr <= rows; rr += rows - 1) {
                                char what[96];
                                snprintf(what, sizeof what, "matmul_%s quantize edges rows %zu t%d",
                                         tsr_dtype_get_info(t)->name, rr, threads);
                                assert_int_equal(tsr_backend_matmul(ref, o1, x, w, t, rr, n, d), TSR_OK);
                                assert_int_equal(tsr_backend_matmul(fast, o2, x, w, t, rr, n, d), TSR_OK);
                                expect_bitwise(what, o2, o1, rr, d);
                        }
                }
        }
        free(x);
        free(o1);
        free(o2);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- elementwise and per-row ops (sliced across the pool) -------------------------------- */

static void test_elementwise_bitwise(void **state) {
        static const size_t sizes[] = {1, 100, 32768, 40000, 100003};
        static const size_t norm_shapes[][2] = {{1, 576}, {67, 576}, {200, 1539}, {3, 70000}};

        for (int t = 1; t <= 3; t++) {
                assert_int_equal(configure(t, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
                for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
                        size_t n = sizes[i];
                        float *a = rand_vec(n), *b = rand_vec(n), *o1 = malloc(n * sizeof(float));
                        float *o2 = malloc(n * sizeof(float)), *alias = malloc(n * sizeof(float));
                        assert_int_equal(tsr_backend_silu_mul(ref, o1, a, b, n), TSR_OK);
                        assert_int_equal(tsr_backend_silu_mul(fast, o2, a, b, n), TSR_OK);
                        expect_bitwise("silu_mul", o2, o1, 1, n);
                        memcpy(alias, a, n * sizeof(float));
                        /* out aliases gate */
                        assert_int_equal(tsr_backend_silu_mul(fast, alias, alias, b, n), TSR_OK);
                        expect_bitwise("silu_mul in place", alias, o1, 1, n);
                        assert_int_equal(tsr_backend_add(ref, o1, a, b, n), TSR_OK);
                        assert_int_equal(tsr_backend_add(fast, o2, a, b, n), TSR_OK);
                        expect_bitwise("add", o2, o1, 1, n);
                        memcpy(alias, a, n * sizeof(float));
                        assert_int_equal(tsr_backend_add(fast, alias, alias, b, n), TSR_OK);
                        expect_bitwise("add in place", alias, o1, 1, n);
                        free(a);
                        free(b);
                        free(o1);
                        free(o2);
                        free(alias);
                }
                for (size_t i = 0; i < sizeof norm_shapes / sizeof *norm_shapes; i++) {
                        size_t rows = norm_shapes[i][0], dim = norm_shapes[i][1];
                        float *x = rand_vec(rows * dim), *w = rand_vec(dim), *o1 = malloc(rows * dim * sizeof(float));
                        float *o2 = malloc(rows * dim * sizeof(float));
                        assert_int_equal(tsr_backend_rmsnorm(ref, o1, x, w, rows, dim, 1e-5f), TSR_OK);
                        assert_int_equal(tsr_backend_rmsnorm(fast, o2, x, w, rows, dim, 1e-5f), TSR_OK);
                        expect_bitwise("rmsnorm", o2, o1, rows, dim);
                        /* in place */
                        assert_int_equal(tsr_backend_rmsnorm(fast, x, x, w, rows, dim, 1e-5f), TSR_OK);
                        expect_bitwise("rmsnorm in place", x, o1, rows, dim);
                        free(x);
                        free(w);
                        free(o1);
                        free(o2);
                }
        }
        assert_int_equal(tsr_backend_add(fast, NULL, NULL, NULL, 100000), TSR_E_INVAL);
        assert_int_equal(tsr_backend_rmsnorm(fast, NULL, NULL, NULL, 100, 1000, 1e-5f), TSR_E_INVAL);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- add_rmsnorm (the residual add fused with the next norm) -------------------------- */

/* Bitwise, NaN included: the fused op promises the unfused pair's exact floats. */
static void expect_same_bits(const char *what, const float *got, const float *want, size_t rows, size_t cols) {
        for (size_t i = 0; i < rows * cols; i++)
                if (isnan(got[i]) && isnan(want[i]))
                        continue;       /* a NaN is a NaN: its payload is not part of the promise */
                else if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
                        expect_bitwise(what, got, want, rows, cols);
                        return;
                }
}

/* ref's add_rmsnorm is, bit for bit, ref's add over the rows then ref's rmsnorm of the
 * sums: the specification of the fused op is the unfused pair.  out == x is checked too,
 * the forward's use. */
/* rope through the fast backend's cos/sin cache, bitwise ref's on every call: the same
 * positions again (a hit: another layer's q and k), other positions of the same count,
 * other inv_freq values behind the same pointer (a new model where a freed one was), a
 * longer batch (the cache grows), both layouts. */
static void test_rope_cache_bitwise(void **state) {
        (void)state;
        enum { ROWS = 40, HEADS = 3, HD = 64 };
        uint32_t pos[ROWS];
        float freq[HD / 2];
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
        for (size_t i = 0; i < HD / 2; i++)
                freq[i] = powf(10000.0f, -2.0f * (float)i / HD);
        for (int round = 0; round < 8; round++) {
                size_t rows = round < 6 ? ROWS / 2 : ROWS;
                for (size_t r = 0; r < rows; r++)
                        pos[r] = round < 2 ? (uint32_t)(r + 7) : (uint32_t)(r * 13 + (round == 4 ? 3 : round) * 1000);
                if (round == 4)         /* round 3's positions, new values behind the same pointer */
                        for (size_t i = 0; i < HD / 2; i++)
                                freq[i] *= 0.5f;
                tsr_rope_layout layout = round % 2 ? TSR_ROPE_INTERLEAVED : TSR_ROPE_NEOX;
                float *x = rand_vec(rows * HEADS * HD), *want = malloc(rows * HEADS * HD * sizeof(float));
                memcpy(want, x, rows * HEADS * HD * sizeof(float));
                assert_int_equal(tsr_backend_rope(ref, want, rows, HEADS, HD, pos, freq, layout), TSR_OK);
                assert_int_equal(tsr_backend_rope(fast, x, rows, HEADS, HD, pos, freq, layout), TSR_OK);
                expect_bitwise("rope", x, want, rows, HEADS * HD);
                free(x);
                free(want);
        }
        assert_int_equal(tsr_backend_rope(fast, NULL, 1, HEADS, HD, pos, freq, TSR_ROPE_NEOX), TSR_E_INVAL);
        assert_int_equal(tsr_backend_rope(fast, (float[2]){0}, 1, 1, 3, pos, freq, TSR_ROPE_NEOX), TSR_E_INVAL);
}

static void test_add_rmsnorm_ref_is_add_then_rmsnorm(void **state) {
        static const size_t shapes[][2] = {{1, 1}, {1, 7}, {3, 9}, {5, 64}, {4, 576}, {2, 1539}};

        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
                size_t rows = shapes[i][0], dim = shapes[i][1], n = rows * dim;
                float *res = rand_vec(n), *x = rand_vec(n), *w = rand_vec(dim);
                float *res1 = malloc(n * sizeof(float)), *res2 = malloc(n * sizeof(float));
                float *o1 = malloc(n * sizeof(float)), *o2 = malloc(n * sizeof(float));
                char what[96];

                memcpy(res1, res, n * sizeof(float));
                memcpy(res2, res, n * sizeof(float));
                assert_int_equal(tsr_backend_add(ref, res1, res1, x, n), TSR_OK);
                assert_int_equal(tsr_backend_rmsnorm(ref, o1, res1, w, rows, dim, 1e-5f), TSR_OK);
                assert_int_equal(tsr_backend_add_rmsnorm(ref, o2, res2, x, w, rows, dim, 1e-5f), TSR_OK);
                snprintf(what, sizeof what, "ref add_rmsnorm rows %zu dim %zu: residual", rows, dim);
                expect_bitwise(what, res2, res1, rows, dim);
                snprintf(what, sizeof what, "ref add_rmsnorm rows %zu dim %zu: out", rows, dim);
                expect_bitwise(what, o2, o1, rows, dim);
                memcpy(res2, res, n * sizeof(float));
                memcpy(o2, x, n * sizeof(float));
                /* out == x */
                assert_int_equal(tsr_backend_add_rmsnorm(ref, o2, res2, o2, w, rows, dim, 1e-5f), TSR_OK);
                expect_bitwise("ref add_rmsnorm out == x: residual", res2, res1, rows, dim);
                expect_bitwise("ref add_rmsnorm out == x: out", o2, o1, rows, dim);
                free(res);
                free(x);
                free(w);
                free(res1);
                free(res2);
                free(o1);
                free(o2);
        }
}

/* One fast-vs-ref case: fresh copies of residual for each side; out separate, then out == x. */
static void add_rmsnorm_case(const float *res, const float *x, const float *w, size_t rows, size_t dim,
                             const char *tag) {
        size_t n = rows * dim;
        float *res1 = malloc(n * sizeof(float)), *res2 = malloc(n * sizeof(float));
        float *o1 = malloc(n * sizeof(float)), *o2 = malloc(n * sizeof(float));
        char what[160];

        memcpy(res1, res, n * sizeof(float));
        memcpy(res2, res, n * sizeof(float));
        assert_int_equal(tsr_backend_add_rmsnorm(ref, o1, res1, x, w, rows, dim, 1e-5f), TSR_OK);
        assert_int_equal(tsr_backend_add_rmsnorm(fast, o2, res2, x, w, rows, dim, 1e-5f), TSR_OK);
        snprintf(what, sizeof what, "add_rmsnorm %s %s t%d rows %zu dim %zu: residual", tag,
                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), tsr_backend_threads(fast), rows, dim);
        expect_same_bits(what, res2, res1, rows, dim);
        snprintf(what, sizeof what, "add_rmsnorm %s %s t%d rows %zu dim %zu: out", tag,
                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), tsr_backend_threads(fast), rows, dim);
        expect_same_bits(what, o2, o1, rows, dim);
        memcpy(res2, res, n * sizeof(float));
        memcpy(o2, x, n * sizeof(float));
        assert_int_equal(tsr_backend_add_rmsnorm(fast, o2, res2, o2, w, rows, dim, 1e-5f), TSR_OK);     /* out == x */
        snprintf(what, sizeof what, "add_rmsnorm %s out == x t%d rows %zu dim %zu", tag, tsr_backend_threads(fast),
                 rows, dim);
        expect_same_bits(what, res2, res1, rows, dim);
        expect_same_bits(what, o2, o1, rows, dim);
        free(res1);
        free(res2);
        free(o1);
        free(o2);
}

/* fast vs ref bitwise: every ISA level the CPU has x 1, 2, 3 threads x the odd-shape
 * table (dims around the 8-lane width and its tail) and shapes big enough for the pool. */
static void test_add_rmsnorm_bitwise(void **state) {
        static const size_t big[][2] = {{67, 576}, {200, 1539}, {3, 70000}, {57, 577}};
        size_t checked = 0;

        for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++)
                for (size_t ti = 0; ti < sizeof thread_counts / sizeof *thread_counts; ti++) {
                        if (!configure_isa(thread_counts[ti], isas[ii]))
                                continue;
                        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
                                for (size_t c = 0; c < sizeof rows_list / sizeof *rows_list; c++) {
                                        size_t dim = ns[a], rows = rows_list[c];
                                        float *res = rand_vec(rows * dim), *x = rand_vec(rows * dim);
                                        float *w = rand_vec(dim);
                                        add_rmsnorm_case(res, x, w, rows, dim, "table");
                                        checked++;
                                        free(res);
                                        free(x);
                                        free(w);
                                }
                        for (size_t b = 0; b < sizeof big / sizeof *big; b++) {
                                size_t rows = big[b][0], dim = big[b][1];
                                float *res = rand_vec(rows * dim), *x = rand_vec(rows * dim), *w = rand_vec(dim);
                                add_rmsnorm_case(res, x, w, rows, dim, "pool");
                                checked++;
                                free(res);
                                free(x);
                                free(w);
                        }
                }
        print_message("add_rmsnorm: %zu shape/isa/thread cases bitwise equal to cpu-ref\n", checked);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* A NaN or an infinity in one row poisons that row's norm and no other: rows are
 * independent whatever the slicing.  Also the argument checks, and that a failed call
 * writes nothing. */
static void test_add_rmsnorm_special(void **state) {
        size_t rows = 40, dim = 1539, n = rows * dim;   /* 61560 elements: the pool slices it */
        float *res = rand_vec(n), *x = rand_vec(n), *w = rand_vec(dim);
        float *res2 = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));

        x[1 * dim + 13] = NAN;          /* row 1: NaN in the vector part */
        x[5 * dim + dim - 1] = NAN;     /* row 5: NaN in the tail */
        res[9 * dim + 100] = INFINITY;  /* row 9: inf + finite = inf, inf^2 = inf, scale 0 */
        res[17 * dim] = INFINITY;       /* row 17: inf + -inf = NaN */
        x[17 * dim] = -INFINITY;
        x[23 * dim + 8] = -0.0f;        /* row 23: signed zeros through the add */
        res[23 * dim + 8] = -0.0f;
        for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++)
                for (int t = 1; t <= 3; t++) {
                        if (!configure_isa(t, isas[ii]))
                                continue;
                        add_rmsnorm_case(res, x, w, rows, dim, "special");
                        memcpy(res2, res, n * sizeof(float));
                        assert_int_equal(tsr_backend_add_rmsnorm(fast, out, res2, x, w, rows, dim, 1e-5f), TSR_OK);
                        for (size_t r = 0; r < rows; r++) {
                                bool poisoned = r == 1 || r == 5 || r == 9 || r == 17;
                                size_t nan_count = 0;
                                for (size_t i = 0; i < dim; i++)
                                        nan_count += isnan(out[r * dim + i]) != 0;
                                if (poisoned)
                                        assert_true(nan_count > 0);
                                else
                                        assert_int_equal(nan_count, 0);
                        }
                }
        assert_true(signbit(res2[23 * dim + 8]));       /* -0 + -0 = -0 */

        /* bad arguments: TSR_E_INVAL and nothing written */
        memcpy(res2, res, n * sizeof(float));
        memset(out, 0x5a, n * sizeof(float));
        float *outc = malloc(n * sizeof(float));
        memcpy(outc, out, n * sizeof(float));
        tsr_backend *tables[] = {ref, fast};
        for (size_t k = 0; k < 2; k++) {
                tsr_backend *o = tables[k];
                assert_int_equal(tsr_backend_add_rmsnorm(o, NULL, res2, x, w, rows, dim, 1e-5f), TSR_E_INVAL);
                assert_int_equal(tsr_backend_add_rmsnorm(o, out, NULL, x, w, rows, dim, 1e-5f), TSR_E_INVAL);
                assert_int_equal(tsr_backend_add_rmsnorm(o, out, res2, NULL, w, rows, dim, 1e-5f), TSR_E_INVAL);
                assert_int_equal(tsr_backend_add_rmsnorm(o, out, res2, x, NULL, rows, dim, 1e-5f), TSR_E_INVAL);
                assert_int_equal(tsr_backend_add_rmsnorm(o, out, res2, x, w, rows, 0, 1e-5f), TSR_E_INVAL);
                assert_int_equal(tsr_backend_add_rmsnorm(o, out, res2, x, w, 0, dim, 1e-5f), TSR_OK);
                assert_memory_equal(res2, res, n * sizeof(float));
                assert_memory_equal(out, outc, n * sizeof(float));
        }
        free(outc);
        free(res);
        free(x);
        free(w);
        free(res2);
        free(out);
        assert_int_equal(configure(1, TSR_CPU_ISA_AVX512_BF16), TSR_OK);
}

/* ---- the pool ------------------------------------------------------------------------------- */

struct count_ctx {
        _Atomic int *hits;
        int threads;
        atomic_bool bad_worker;
};

static void count_task(void *ctx, size_t i, int worker) {
        struct count_ctx *c = ctx;
        if (worker < 0 || worker >= c->threads)
                atomic_store(&c->bad_worker, true);
        atomic_fetch_add(&c->hits[i], 1);
}

struct driver {
        tsr_pool *pool;
        int threads;
        bool ok;
};

static void *drive(void *arg) {
        struct driver *dr = arg;
        size_t n = 1000;
        _Atomic int *hits = calloc(n, sizeof *hits);
        dr->ok = hits != NULL;
        for (int round = 0; dr->ok && round < 200; round++) {
                struct count_ctx c = {.hits = hits, .threads = dr->threads};
                atomic_init(&c.bad_worker, false);
                for (size_t i = 0; i < n; i++)
                        atomic_store(&hits[i], 0);
                /* Every other round in spans (pool.h): still each index once, any worker. */
                if (round % 2)
                        tsr_pool_run_spans(dr->pool, n - (size_t)round, count_task, &c);
                else
                        tsr_pool_run(dr->pool, n - (size_t)round, count_task, &c);
                for (size_t i = 0; i < n; i++)
                        if (atomic_load(&hits[i]) != (i < n - (size_t)round ? 1 : 0))
                                dr->ok = false;
                if (atomic_load(&c.bad_worker))
                        dr->ok = false;
        }
        free(hits);
        return NULL;
}

static void test_pool(void **state) {
        for (int t = 1; t <= 4; t++) {
                tsr_pool *p = tsr_pool_new(t);
                assert_non_null(p);
                assert_int_equal(tsr_pool_threads(p), t);
                /* Two threads driving one pool at once: one gets it, the other runs inline. */
                struct driver a = {.pool = p, .threads = t}, b = {.pool = p, .threads = t};
                pthread_t th;
                assert_int_equal(pthread_create(&th, NULL, drive, &a), 0);
                drive(&b);
                assert_int_equal(pthread_join(th, NULL), 0);
                assert_true(a.ok);
                assert_true(b.ok);
                /* Spans with fewer tasks than threads, none, one. */
                for (size_t m = 0; m < 10; m++) {
                        _Atomic int hits[10];
                        struct count_ctx c = {.hits = hits, .threads = t};
                        atomic_init(&c.bad_worker, false);
                        for (size_t i = 0; i < 10; i++)
                                atomic_init(&hits[i], 0);
                        tsr_pool_run_spans(p, m, count_task, &c);
                        for (size_t i = 0; i < 10; i++)
                                assert_int_equal(atomic_load(&hits[i]), i < m ? 1 : 0);
                        assert_false(atomic_load(&c.bad_worker));
                }
                tsr_pool_free(&p);
                assert_null(p);
        }
        tsr_pool_free(NULL);
        assert_null(tsr_pool_new(0));
        tsr_backend *bad = NULL;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = -1, .max_isa = TSR_CPU_ISA_AVX2},
                                             &bad),
                         TSR_E_INVAL);
        assert_null(bad);
}

static int teardown(void **state) {
        tsr_backend_free(&fast);
        tsr_backend_free(&ref);
        return 0;
}

/* ---- exp (cpu/exp.h): the softmax's and silu's -------------------------------------------- */

/* |got - exact| in units of the float ulp at exact (2^-149 in the subnormal range). */
static double ulp_error(float got, double exact) {
        int e;
        frexp(exact, &e);
        return fabs((double)got - exact) / ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void exp_avx2_row(float *out, const float *x, size_t n) {
        for (size_t i = 0; i + 8 <= n; i += 8)
                _mm256_storeu_ps(out + i, tsr_exp8(_mm256_loadu_ps(x + i)));
}

__attribute__((target("avx512f"))) static void exp_avx512_row(float *out, const float *x, size_t n) {
        for (size_t i = 0; i + 16 <= n; i += 16)
                _mm512_storeu_ps(out + i, tsr_exp16(_mm512_loadu_ps(x + i)));
}
#endif

/* Accuracy as exp.h states it, over a sample of every float in [-104, 89] (one bit pattern
 * in 127: about 17.6 million, most of them near 0 as floats are); the special values; the
 * 8- and 16-lane forms bitwise the scalar one over the same inputs, where the CPU has them. */
static void test_exp(void **state) {
        enum { CHUNK = 4096 };
        static float x[CHUNK], want[CHUNK], got[CHUNK];
        double worst = 0.0;
        float worst_x = 0.0f;
        size_t n = 0, checked = 0, mismatched = 0;
        bool avx2 = false, avx512 = false;
        (void)state;

#if defined(__x86_64__)
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        avx512 = __builtin_cpu_supports("avx512f");
#endif
        static const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, -0.5f, 1e-30f, -1e-30f, 88.72f, 88.73f,
                                         89.0f, 100.0f, -87.3f, -87.4f, -100.0f, -103.0f, -103.9f, -104.0f,
                                         -105.0f, -1e30f, 1e30f, FLT_MAX, -FLT_MAX, INFINITY, -INFINITY, NAN};
        for (uint64_t u = 0; u < 0x100000000ull; u += 127) {
                uint32_t b = (uint32_t)u;
                float v;
                memcpy(&v, &b, sizeof v);
                if (!(v >= -104.0f && v <= 89.0f))
                        continue;
                x[n++] = v;
                if (n < CHUNK - sizeof specials / sizeof *specials && u + 127 < 0x100000000ull)
                        continue;
                if (u + 127 >= 0x100000000ull) {
                        memcpy(x + n, specials, sizeof specials);
                        n += sizeof specials / sizeof *specials;
                }
                n -= n % 16;            /* whole vectors: the leftovers go in the next chunk */
                for (size_t i = 0; i < n; i++) {
                        want[i] = tsr_exp(x[i]);
                        double ex = exp((double)x[i]);
                        if ((float)ex > FLT_MAX) {      /* rounds to +inf: so must exp */
                                if (!isinf(want[i]) && mismatched++ < 5)
                                        print_message("exp(%a) = %a, not +inf\n", x[i], want[i]);
                        } else if (isfinite(x[i])) {
                                double e = ulp_error(want[i], ex);
                                if (e > worst)
                                        worst = e, worst_x = x[i];
                                checked++;
                        }
                }
#if defined(__x86_64__)
                for (int form = 0; form < 2; form++) {
                        if (!(form ? avx512 : avx2))
                                continue;
                        (form ? exp_avx512_row : exp_avx2_row)(got, x, n);
                        for (size_t i = 0; i < n; i++)
                                if (memcmp(&got[i], &want[i], sizeof(float)) != 0 && !(isnan(got[i]) && isnan(want[i])))
                                        if (mismatched++ < 5)
                                                print_message("exp %d lanes: x %a got %a want %a\n", form ? 16 : 8,
                                                              x[i], got[i], want[i]);
                }
#endif
                n = 0;
        }
        print_message("exp: %zu finite results, max error %.3f ulp at %a; vector forms checked: avx2 %d avx512 %d\n",
                      checked, worst, worst_x, avx2, avx512);
        assert_true(checked > 17000000);
        assert_true(worst < 1.05);
        assert_int_equal(mismatched, 0);
        /* the softmax's ends: its largest term exactly 1, masked-out (-inf) terms exactly 0 */
        assert_true(tsr_exp(0.0f) == 1.0f && tsr_exp(-0.0f) == 1.0f);
        assert_true(tsr_exp(-INFINITY) == 0.0f && !signbit(tsr_exp(-INFINITY)));
        assert_true(tsr_exp(-104.0f) == 0.0f && tsr_exp(-1e30f) == 0.0f);
        assert_true(tsr_exp(-103.0f) > 0.0f && tsr_exp(-103.0f) < FLT_MIN);     /* subnormal, not flushed */
        assert_true(isinf(tsr_exp(INFINITY)) && isinf(tsr_exp(88.73f)) && isfinite(tsr_exp(88.72f)));
        assert_true(isnan(tsr_exp(NAN)));
}

/* ---- one case per ISA level --------------------------------------------------------- */

/* The level alone, at 2 threads: it is what runs, float32 matmul bitwise ref's, bf16
 * matmul within the summation bound (bitwise below AVX512_BF16).  Skips where the CPU
 * (or, for AMX, Linux) does not grant the level. */
static void test_isa_level(void **state) {
        const tsr_cpu_isa isa = *(const tsr_cpu_isa *)*state;
        const size_t rows = 5, n = 67, d = 33;

        assert_int_equal(configure(2, isa), TSR_OK);
        if (tsr_backend_cpu_isa(fast) != isa) {
                print_message("[skip:cpu-lacks:%s] this CPU runs %s at most\n", tsr_cpu_isa_name(isa),
                              tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)));
                skip();
        }
        float *x = rand_vec(rows * n), *wf = rand_vec(d * n);
        uint16_t *w = to_bf16_vec(wf, d * n);
        float *o1 = malloc(rows * d * sizeof(float)), *o2 = malloc(rows * d * sizeof(float));
        assert_int_equal(mm_f32(ref, o1, x, wf, rows, n, d), TSR_OK);
        assert_int_equal(mm_f32(fast, o2, x, wf, rows, n, d), TSR_OK);
        expect_bitwise("matmul f32", o2, o1, rows, d);
        assert_int_equal(mm_bf16(ref, o1, x, w, rows, n, d), TSR_OK);
        assert_int_equal(mm_bf16(fast, o2, x, w, rows, n, d), TSR_OK);
        for (size_t r = 0; r < rows; r++)
                for (size_t i = 0; i < d; i++) {
                        double bound = isa < TSR_CPU_ISA_AVX512_BF16 ? 0 : dot_bound(w + i * n, x + r * n, n);
                        double diff = fabs((double)o2[r * d + i] - (double)o1[r * d + i]);
                        if (!(diff <= bound))
                                fail_msg("matmul_bf16 %s [%zu,%zu]: %.9g vs ref %.9g, bound %.3g",
                                         tsr_cpu_isa_name(isa), r, i, o2[r * d + i], o1[r * d + i], bound);
                }
        free(x), free(wf), free(w), free(o1), free(o2);
}

static const tsr_cpu_isa level_avx2 = TSR_CPU_ISA_AVX2, level_avx512_bf16 = TSR_CPU_ISA_AVX512_BF16,
                         level_amx_bf16 = TSR_CPU_ISA_AMX_BF16;

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_pool),
                cmocka_unit_test(test_exp),
                {"isa_avx2", test_isa_level, NULL, NULL, (void *)&level_avx2},
                {"isa_avx512_bf16", test_isa_level, NULL, NULL, (void *)&level_avx512_bf16},
                {"isa_amx_bf16", test_isa_level, NULL, NULL, (void *)&level_amx_bf16},
                cmocka_unit_test(test_matmul_f32_bitwise),
                cmocka_unit_test(test_matmul_f32_special),
                cmocka_unit_test(test_attention_bitwise),
                cmocka_unit_test(test_bf16_rounding),
                cmocka_unit_test(test_matmul_bf16),
                cmocka_unit_test(test_matmul_bf16_special),
                cmocka_unit_test(test_matmul_bf16_x_rounding),
                cmocka_unit_test(test_matmul_bf16_batch_invariance),
                cmocka_unit_test(test_matmul_bf16_two_callers),
                cmocka_unit_test(test_batch_invariance),
                cmocka_unit_test(test_qmm_quantize_edges),
                cmocka_unit_test(test_qmm_quantize_k_edges),
                cmocka_unit_test(test_elementwise_bitwise),
                cmocka_unit_test(test_rope_cache_bitwise),
                cmocka_unit_test(test_add_rmsnorm_ref_is_add_then_rmsnorm),
                cmocka_unit_test(test_add_rmsnorm_bitwise),
                cmocka_unit_test(test_add_rmsnorm_special),
        };
        /* As the fast table was by default before it had a handle: all cores, the best ISA. */
        if (tsr_backend_cpu_ref_new(&ref) != TSR_OK || configure(0, TSR_CPU_ISA_AMX_BF16) != TSR_OK)
                return 1;
        print_message("fast CPU backend: best isa %s\n", tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)));
        return cmocka_run_group_tests(tests, NULL, teardown);
}
