/* test_forward.c - reference kernels, GGUF weight loading and the Llama forward.
 *
 * Kernels are checked against naive double-precision versions written here, and for
 * batch invariance (a row alone vs among others: bitwise equal).  The forward is checked
 * against transformers' outputs for three GGUF models (tests/fixtures/forward/, written
 * by tests/fixtures/make_forward_goldens.py):
 *   stories260K (F32)          full logits max |Δ| <= 1e-4, greedy 32 tokens exact
 *   llama-2-tiny-random (F16)  last-position top-50 within 1e-4, argmax per position
 *   SmolLM2-135M Q4_1          top-20 per position within 1e-3 * max|logit|, same argmax,
 *                              greedy 64 tokens exact for 10 prompts via the decode path
 * Models come from TSR_FIXTURES/models (a test skips, "no-shared-fixtures", when that
 * folder is absent, as in a user's clone) and TSR_SOURCE_ROOT/.cache/models (absent: a
 * "not-fetched" skip, which fails the test command).  The goldens are committed: a
 * missing one fails.  Speeds are printed, not asserted (tessera-bench-engine measures).
 *
 * Sanitized builds (TSR_SANITIZED set, or gcc's __SANITIZE_ADDRESS__): ASan instruments
 * every load of the matmul's inner loop and runs it ~10x slower, so the SmolLM2 tests run
 * a short subset (2 logit prompts; 2 greedy prompts of 16 tokens), and the bf16 case is
 * not registered there (minutes at sanitized speed).  The stories260K and llama-2-tiny
 * tests, which cover the same code, run in full. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"
#include "tests/tsr_rand.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "kernels/kernels.h"
#include "worker/load/gguf.h"
#include "worker/model/llama.h"
#include "worker/model/llama_weights.h"

/* The reference backend most tests run on (made in main); tests of the fast backend
 * make their own. */
static tsr_backend *ref_be;

/* ---- helpers ------------------------------------------------------------------------ */

/* cmocka 1.1.5's assert_float_equal compares in float; this one in double. */
#define assert_close(got, want, tol)                                                                   \
        do {                                                                                           \
                double g_ = (got), w_ = (want), t_ = (tol);                                            \
                if (!(fabs(g_ - w_) <= t_))                                                            \
                        fail_msg("%s = %.9g, want %.9g (tol %.3g)", #got, g_, w_, t_);                  \
        } while (0)

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* $env/rel into buf, or NULL when the variable is unset or the file is absent. */
static const char *env_path(const char *env, const char *rel, char *buf, size_t len) {
        const char *dir = getenv(env);
        FILE *f;

        if (!dir)
                return NULL;
        snprintf(buf, len, "%s/%s", dir, rel);
        if (!(f = fopen(buf, "rb")))
                return NULL;
        fclose(f);
        return buf;
}

static json_t *load_golden(const char *name) {
        char path[1024];
        json_error_t je;
        json_t *j;

        if (!env_path("TSR_SOURCE_ROOT", name, path, sizeof path))
                fail_msg("golden %s absent (it is committed: run from the source tree)", name);
        j = json_load_file(path, 0, &je);
        if (!j)
                print_message("%s: %s (line %d)\n", path, je.text, je.line);
        assert_non_null(j);
        return j;
}

static float *load_f32(const char *name, size_t n) {
        char rel[512], path[1024];
        float *v = malloc(n * sizeof(float));
        FILE *f;

        snprintf(rel, sizeof rel, "tests/fixtures/forward/%s", name);
        assert_non_null(env_path("TSR_SOURCE_ROOT", rel, path, sizeof path));
        assert_non_null(v);
        f = fopen(path, "rb");
        assert_non_null(f);
        assert_int_equal(fread(v, sizeof(float), n, f), n);    /* little-endian host assumed (x86, arm) */
        fclose(f);
        return v;
}

static size_t json_ids(json_t *arr, uint32_t *out, size_t cap) {
        size_t n = json_array_size(arr);
        assert_true(n <= cap);
        for (size_t i = 0; i < n; i++)
                out[i] = (uint32_t)json_integer_value(json_array_get(arr, i));
        return n;
}

static tsr_llama *load_model(const char *env, const char *rel) {
        char path[1024], err[512];
        tsr_llama *m = NULL;
        tsr_load_stats st;

        if (!env_path(env, rel, path, sizeof path))
                return NULL;
        tsr_status s = tsr_llama_load(path, NULL, NULL, NULL, &m, &st, err, sizeof err);
        if (s != TSR_OK)
                print_message("%s\n", err);
        assert_int_equal(s, TSR_OK);
        print_message("loaded %s: %zu tensors, %.1f MB in file, %.1f MB float32, %.2f s\n", rel, st.n_tensors,
                      (double)st.file_bytes / 1e6, (double)st.f32_bytes / 1e6, st.seconds);
        return m;
}

/* ---- kernels -------------------------------------------------------------------------- */

static void test_matmul_shapes(void **state) {
        tsr_backend *o = ref_be;
        static const size_t ns[] = {1, 3, 8, 127, 576, 4097};
        static const size_t ds[] = {1, 3, 127, 130};

        for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
                for (size_t b = 0; b < sizeof ds / sizeof ds[0]; b++) {
                        size_t n = ns[a], d = ds[b], rows = 8;
                        float *w = rand_vec(d * n, 1.0f), *x = rand_vec(rows * n, 1.0f);
                        float *out = malloc(rows * d * sizeof(float)), *one = malloc(d * sizeof(float));
                        assert_int_equal(tsr_backend_matmul(o, out, x, w, TSR_DTYPE_F32, rows, n, d), TSR_OK);
                        for (size_t r = 0; r < rows; r++) {
                                for (size_t i = 0; i < d; i++) {
                                        double want = 0, mag = 0;
                                        for (size_t k = 0; k < n; k++) {
                                                want += (double)w[i * n + k] * x[r * n + k];
                                                mag += fabs((double)w[i * n + k] * x[r * n + k]);
                                        }
                                        double got = out[r * d + i];
                                        if (fabs(got - want) > 1e-6 * mag + 1e-30)
                                                fail_msg("matmul n=%zu d=%zu row %zu out %zu: %.9g vs %.9g", n, d,
                                                         r, i, got, want);
                                }
                                /* batch invariance: row r alone == row r among 7 others, bitwise */
                                assert_int_equal(tsr_backend_matmul(o, one, x + r * n, w, TSR_DTYPE_F32, 1, n, d),
                                                 TSR_OK);
                                assert_memory_equal(one, out + r * d, d * sizeof(float));
                        }
                        free(w);
                        free(x);
                        free(out);
                        free(one);
                }
        }
        float f = 0;
        assert_int_equal(tsr_backend_matmul(o, &f, &f, NULL, TSR_DTYPE_F32, 1, 1, 1), TSR_E_INVAL);
        assert_int_equal(tsr_backend_matmul(o, &f, &f, &f, TSR_DTYPE_F32, 1, 0, 1), TSR_E_INVAL);
}

/* Reference rotation in double for one head. */
static void rope_naive(double *y, const float *x, size_t hd, double pos, const float *inv_freq, int interleaved) {
        for (size_t i = 0; i < hd / 2; i++) {
                size_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + hd / 2;
                double th = (double)(float)(pos * inv_freq[i]), c = cos(th), s = sin(th);
                y[ia] = x[ia] * c - x[ib] * s;
                y[ib] = x[ib] * c + x[ia] * s;
        }
}

static void test_rope_layouts(void **state) {
        tsr_backend *o = ref_be;
        enum { HD = 16, NH = 3, ROWS = 4 };
        tsr_llama_config cfg = {.head_dim = HD, .rope_theta = 10000.0};
        float inv[HD / 2], x[ROWS * NH * HD], y[ROWS * NH * HD], p[ROWS * NH * HD];
        uint32_t pos[ROWS] = {0, 1, 17, 4000};
        double want[HD];

        assert_int_equal(tsr_llama_rope_inv_freq(&cfg, NULL, inv), TSR_OK);
        assert_close(inv[0], 1.0, 0);
        assert_close(inv[1], 1.0 / pow(10000.0, 2.0 / HD), 1e-7);
        for (size_t i = 0; i < ROWS * NH * HD; i++)
                x[i] = frand();
        for (int il = 0; il < 2; il++) {
                memcpy(y, x, sizeof x);
                assert_int_equal(tsr_backend_rope(o, y, ROWS, NH, HD, pos, inv,
                                                  il ? TSR_ROPE_INTERLEAVED : TSR_ROPE_NEOX),
                                 TSR_OK);
                for (size_t r = 0; r < ROWS; r++)
                        for (size_t h = 0; h < NH; h++) {
                                rope_naive(want, x + (r * NH + h) * HD, HD, pos[r], inv, il);
                                for (size_t i = 0; i < HD; i++)
                                        assert_close(y[(r * NH + h) * HD + i], want[i], 1e-6);
                        }
                assert_memory_equal(y, x, NH * HD * sizeof(float));     /* position 0 is the identity */
        }
        /* Interleaved on llama.cpp's permuted rows == NEOX on HF rows, then permuted:
         * the permutation sends HF dim i to 2i and i + d/2 to 2i + 1. */
        for (size_t r = 0; r < ROWS * NH; r++)
                for (size_t i = 0; i < HD / 2; i++) {
                        p[r * HD + 2 * i] = x[r * HD + i];
                        p[r * HD + 2 * i + 1] = x[r * HD + i + HD / 2];
                }
        memcpy(y, x, sizeof x);
        assert_int_equal(tsr_backend_rope(o, y, ROWS, NH, HD, pos, inv, TSR_ROPE_NEOX), TSR_OK);
        assert_int_equal(tsr_backend_rope(o, p, ROWS, NH, HD, pos, inv, TSR_ROPE_INTERLEAVED), TSR_OK);
        for (size_t r = 0; r < ROWS * NH; r++)
                for (size_t i = 0; i < HD / 2; i++) {
                        assert_true(p[r * HD + 2 * i] == y[r * HD + i]);
                        assert_true(p[r * HD + 2 * i + 1] == y[r * HD + i + HD / 2]);
                }
        assert_int_equal(tsr_backend_rope(o, y, 1, 1, 3, pos, inv, TSR_ROPE_NEOX), TSR_E_INVAL);    /* odd head dim */
}

/* models.md §6.3: d=16, O=64, θ=5e5, f=8, lo=1, hi=4: pair 0 unchanged, pair 1 blended,
 * pairs 2..7 divided by 8. */
static void test_rope_llama3(void **state) {
        tsr_llama_config c = {.head_dim = 16, .rope_theta = 500000.0, .rope_llama3 = true, .rope_factor = 8.0,
                              .rope_low_freq_factor = 1.0, .rope_high_freq_factor = 4.0,
                              .rope_original_max_pos = 64};
        tsr_llama_config plain = c;
        float a[8], b[8], div[8];

        plain.rope_llama3 = false;
        assert_int_equal(tsr_llama_rope_inv_freq(&c, NULL, a), TSR_OK);
        assert_int_equal(tsr_llama_rope_inv_freq(&plain, NULL, b), TSR_OK);
        assert_true(a[0] == b[0]);
        double wl = 2 * M_PI / (double)b[1], s = (64.0 / wl - 1.0) / 3.0;
        assert_true(s > 0 && s < 1);
        assert_close(a[1], (1 - s) * b[1] / 8 + s * b[1], 1e-7 * a[1]);
        for (int i = 2; i < 8; i++)
                assert_close(a[i], b[i] / 8.0, 1e-7 * a[i]);
        /* GGUF's rope_freqs divisors give the same thing when they hold the factors. */
        for (int i = 0; i < 8; i++)
                div[i] = b[i] / a[i];
        assert_int_equal(tsr_llama_rope_inv_freq(&plain, div, b), TSR_OK);
        for (int i = 0; i < 8; i++)
                assert_close(a[i], b[i], 1e-6 * a[i]);
        c.rope_high_freq_factor = 1.0;          /* Llama 4: lo == hi, empty band, no division by 0 */
        assert_int_equal(tsr_llama_rope_inv_freq(&c, NULL, a), TSR_OK);
        for (int i = 0; i < 8; i++)
                assert_true(isfinite(a[i]) && a[i] > 0);
}

static void test_attention_vs_double(void **state) {
        tsr_backend *o = ref_be;
        enum { NH = 4, NKV = 2, HD = 16, PAST = 7, N = 6, BS = 3, NB = 6 };
        /* A shuffled block table, as a paged cache hands out. */
        static const uint32_t table[NB] = {4, 0, 5, 2, 1, 3};
        size_t T = PAST + N, row = NKV * HD;
        float *kp = rand_vec(NB * BS * row, 1.0f), *vp = rand_vec(NB * BS * row, 1.0f);
        float *q = rand_vec(N * NH * HD, 2.0f), *knew = rand_vec(T * row, 2.0f), *vnew = rand_vec(T * row, 1.0f);
        float out[N * NH * HD], one[NH * HD];
        tsr_kv_view kv = {.k = kp, .v = vp, .block_table = table, .n_table = NB, .n_blocks = NB,
                          .block_size = BS, .n_kv_heads = NKV, .head_dim = HD};
        float scale = 1.0f / sqrtf((float)HD);

        assert_int_equal(tsr_backend_kv_write(o, &kv, knew, vnew, T, 0), TSR_OK);
        assert_int_equal(tsr_backend_attention(o, out, q, &kv, N, PAST, NH, scale), TSR_OK);
        for (size_t t = 0; t < N; t++) {
                for (size_t h = 0; h < NH; h++) {
                        size_t g = h / (NH / NKV), p = PAST + t;
                        double sc[PAST + N], max = -INFINITY, sum = 0;
                        for (size_t j = 0; j <= p; j++) {
                                double d = 0;
                                for (size_t i = 0; i < HD; i++)
                                        d += (double)q[(t * NH + h) * HD + i] * knew[j * row + g * HD + i];
                                sc[j] = d * scale;
                                max = fmax(max, sc[j]);
                        }
                        for (size_t j = 0; j <= p; j++)
                                sum += exp(sc[j] - max);
                        for (size_t i = 0; i < HD; i++) {
                                double want = 0;
                                for (size_t j = 0; j <= p; j++)
                                        want += exp(sc[j] - max) / sum * vnew[j * row + g * HD + i];
                                assert_close(out[(t * NH + h) * HD + i], want, 2e-6);
                        }
                }
                /* batch invariance: query row t alone (as a decode step) == within the chunk */
                assert_int_equal(tsr_backend_attention(o, one, q + t * NH * HD, &kv, 1, PAST + t, NH, scale), TSR_OK);
                assert_memory_equal(one, out + t * NH * HD, sizeof one);
        }
        /* a table too short for the chunk, and a block id outside the pool */
        kv.n_table = 2;
        assert_int_equal(tsr_backend_attention(o, out, q, &kv, N, PAST, NH, scale), TSR_E_INVAL);
        kv.n_table = NB;
        kv.n_blocks = 4;
        assert_int_equal(tsr_backend_kv_write(o, &kv, knew, vnew, 1, 0), TSR_E_INVAL);
        free(kp);
        free(vp);
        free(q);
        free(knew);
        free(vnew);
}

static void test_elementwise(void **state) {
        tsr_backend *o = ref_be;
        float x[2 * 5] = {1, 2, 3, 4, 5, -1000, 0, 1000, 3, 3}, sm[10], lsm[10], out[3];
        float g[3] = {-2, 0, 3}, u[3] = {1, 2, -1}, a[3] = {1, 2, 3};
        uint32_t ids[2] = {2, 0};
        float table[3 * 2] = {0, 1, 2, 3, 4, 5}, e[4];

        assert_int_equal(tsr_backend_softmax(o, sm, x, 2, 5), TSR_OK);
        assert_int_equal(tsr_backend_log_softmax(o, lsm, x, 2, 5), TSR_OK);
        for (int r = 0; r < 2; r++) {
                double max = -INFINITY, sum = 0, tot = 0;
                for (int i = 0; i < 5; i++)
                        max = fmax(max, x[r * 5 + i]);
                for (int i = 0; i < 5; i++)
                        sum += exp(x[r * 5 + i] - max);
                for (int i = 0; i < 5; i++) {
                        double p = exp(x[r * 5 + i] - max) / sum;
                        assert_close(sm[r * 5 + i], p, 1e-7);
                        assert_close(lsm[r * 5 + i], x[r * 5 + i] - max - log(sum), 1e-5);
                        tot += sm[r * 5 + i];
                }
                assert_close(tot, 1.0, 1e-6);
        }
        assert_int_equal(tsr_backend_silu_mul(o, out, g, u, 3), TSR_OK);
        for (int i = 0; i < 3; i++)
                assert_close(out[i], g[i] / (1 + exp(-g[i])) * u[i], 1e-6);
        assert_int_equal(tsr_backend_add(o, out, a, u, 3), TSR_OK);
        assert_close(out[2], 2.0, 0);
        assert_int_equal(tsr_backend_embedding(o, e, table, TSR_DTYPE_F32, 3, 2, ids, 2), TSR_OK);
        assert_true(e[0] == 4 && e[1] == 5 && e[2] == 0 && e[3] == 1);
        ids[1] = 3;
        assert_int_equal(tsr_backend_embedding(o, e, table, TSR_DTYPE_F32, 3, 2, ids, 2), TSR_E_INVAL);
}

/* Every dequantizer against gguf-py's, on random blocks. */
static void test_dequant(void **state) {
        json_t *j = load_golden("tests/fixtures/forward/dequant.json");
        json_t *cases = json_object_get(j, "cases");

        assert_true(json_array_size(cases) >= 10);
        for (size_t c = 0; c < json_array_size(cases); c++) {
                json_t *cs = json_array_get(cases, c);
                uint32_t type = (uint32_t)json_integer_value(json_object_get(cs, "type"));
                size_t n = (size_t)json_integer_value(json_object_get(cs, "n"));
                const char *hex = json_string_value(json_object_get(cs, "data_hex"));
                json_t *bits = json_object_get(cs, "expect_bits");
                size_t nb = strlen(hex) / 2;
                uint8_t *raw = malloc(nb);
                float *got = malloc(n * sizeof(float));

                for (size_t i = 0; i < nb; i++) {
                        unsigned v;
                        assert_int_equal(sscanf(hex + 2 * i, "%2x", &v), 1);
                        raw[i] = (uint8_t)v;
                }
                assert_int_equal(tsr_ggml_dequantize(type, raw, n, got), TSR_OK);
                assert_int_equal(json_array_size(bits), n);
                for (size_t i = 0; i < n; i++) {
                        uint32_t b = (uint32_t)json_integer_value(json_array_get(bits, i));
                        float want;
                        memcpy(&want, &b, 4);
                        if (!(fabsf(got[i] - want) <= 1e-6f * fabsf(want) + 1e-12f))
                                fail_msg("%s element %zu: %.9g vs gguf-py %.9g",
                                         json_string_value(json_object_get(cs, "name")), i, got[i], want);
                }
                free(raw);
                free(got);
        }
        float f;
        assert_int_equal(tsr_ggml_dequantize(TSR_GGML_TYPE_IQ2_XXS, "", 0, &f), TSR_E_UNSUPPORTED);
        assert_int_equal(tsr_ggml_dequantize(TSR_GGML_TYPE_Q8_0, "", 31, &f), TSR_E_INVAL);
        json_decref(j);
}

/* ---- loading errors ------------------------------------------------------------------ */

static uint8_t *read_file(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        uint8_t *p;
        long n;

        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        n = ftell(f);
        fseek(f, 0, SEEK_SET);
        p = malloc((size_t)n);
        assert_non_null(p);
        assert_int_equal(fread(p, 1, (size_t)n, f), (size_t)n);
        fclose(f);
        *len = (size_t)n;
        return p;
}

static uint8_t *find_bytes(uint8_t *hay, size_t n, const char *needle) {
        size_t k = strlen(needle);
        for (size_t i = 0; i + k <= n; i++)
                if (memcmp(hay + i, needle, k) == 0)
                        return hay + i;
        return NULL;
}

/* Load stories260K from (possibly patched) bytes; returns the status, message in err. */
static tsr_status load_bytes(const uint8_t *p, size_t n, const tsr_llama_config *override,
                             const tsr_shard_spec *spec, char *err, size_t errlen) {
        tsr_gguf *g = NULL;
        tsr_llama_config cfg;
        tsr_llama_weights *w = NULL;
        tsr_shard_spec whole;
        tsr_status st;

        assert_int_equal(tsr_gguf_open_memory(p, n, &g, err, errlen), TSR_OK);
        assert_int_equal(tsr_llama_config_from_gguf(g, "s.gguf", &cfg, err, errlen), TSR_OK);
        if (override)
                cfg = *override;
        whole = tsr_shard_spec_whole(cfg.n_layers);
        st = tsr_llama_weights_load(g, "s.gguf", &cfg, spec ? spec : &whole, NULL, NULL, &w, NULL, err, errlen);
        if (st == TSR_OK)
                assert_non_null(w);
        else
                assert_null(w);
        tsr_llama_weights_free(&w);
        tsr_gguf_close(&g);
        return st;
}

static void test_load_errors(void **state) {
        char path[1024], err[512];
        tsr_llama *m = NULL;
        size_t n;
        uint8_t *p, *at;

        assert_int_equal(tsr_llama_load("/nonexistent/x.gguf", NULL, NULL, NULL, &m, NULL,
                                        err, sizeof err),
                         TSR_E_NOTFOUND);
        assert_null(m);
        if (!env_path("TSR_FIXTURES", "models/stories260K.gguf", path, sizeof path))
                TSR_SKIP(TSR_SKIP_NO_SHARED, "models/stories260K.gguf absent from TSR_FIXTURES");
        p = read_file(path, &n);

        err[0] = 0;
        assert_int_equal(load_bytes(p, n, NULL, NULL, err, sizeof err), TSR_OK);

        /* a tensor-parallel rank past the size, and a size that does not split the model
         * (stories260K's 172 MLP columns: 86 a rank, not a multiple of the 4 canonical
         * slices), are refused naming the file */
        tsr_shard_spec tp2 = {.tp_rank = 2, .tp_size = 2, .first_layer = 0, .last_layer = 4};
        assert_int_equal(load_bytes(p, n, NULL, &tp2, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "s.gguf"));
        tp2.tp_rank = 1;
        assert_int_equal(load_bytes(p, n, NULL, &tp2, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "s.gguf"));
        assert_non_null(strstr(err, "tensor parallel size 2 does not split this model"));

        /* a config whose shapes disagree with the tensors */
        tsr_gguf *g;
        tsr_llama_config cfg;
        assert_int_equal(tsr_gguf_open_memory(p, n, &g, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_llama_config_from_gguf(g, "s.gguf", &cfg, err, sizeof err), TSR_OK);
        tsr_gguf_close(&g);
        assert_int_equal(cfg.rope_layout, TSR_ROPE_INTERLEAVED);
        assert_false(cfg.tied_embeddings);
        cfg.hidden_dim += 1;
        assert_int_equal(load_bytes(p, n, &cfg, NULL, err, sizeof err), TSR_E_INVAL);
        assert_non_null(strstr(err, "'blk.0.ffn_gate.weight'"));
        assert_non_null(strstr(err, "s.gguf"));

        /* a missing tensor: rename one in the tensor table */
        at = find_bytes(p, n, "blk.3.ffn_up.weight");
        assert_non_null(at);
        at[18] = 'X';
        assert_int_equal(load_bytes(p, n, NULL, NULL, err, sizeof err), TSR_E_NOTFOUND);
        assert_non_null(strstr(err, "'blk.3.ffn_up.weight' missing"));
        at[18] = 't';

        /* an unsupported type: blk.2.attn_norm (64 floats) retyped as Q8_1, whose smaller
         * byte size still fits the file */
        at = find_bytes(p, n, "blk.2.attn_norm.weight");
        assert_non_null(at);
        uint8_t *type = at + strlen("blk.2.attn_norm.weight") + 4 + 8;     /* n_dims, one dim */
        assert_int_equal(type[0], TSR_GGML_TYPE_F32);
        type[0] = TSR_GGML_TYPE_Q8_1;
        assert_int_equal(load_bytes(p, n, NULL, NULL, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "'blk.2.attn_norm.weight'"));
        assert_non_null(strstr(err, "Q8_1"));
        free(p);
}

/* ---- stories260K ---------------------------------------------------------------------- */

static void test_stories260k(void **state) {
        json_t *j;
        tsr_llama *m = load_model("TSR_FIXTURES", "models/stories260K.gguf");
        tsr_llama_kv *kv = NULL;

        if (!m)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "its GGUF is absent from TSR_FIXTURES/models");
        j = load_golden("tests/fixtures/forward/stories260K.json");
        const tsr_llama_config *c = tsr_llama_config_of(m);
        size_t V = c->vocab_size;
        assert_int_equal(V, 512);
        assert_int_equal(tsr_llama_kv_new(m, 64, 4, &kv), TSR_OK);      /* small blocks: many of them */
        json_t *ps = json_object_get(j, "prompts");
        assert_true(json_array_size(ps) > 0);        /* a golden without prompts checks nothing */
        double worst = 0;
        for (size_t pi = 0; pi < json_array_size(ps); pi++) {
                json_t *P = json_array_get(ps, pi);
                uint32_t ids[64];
                size_t n = json_ids(json_object_get(P, "ids"), ids, 16);
                float *want = load_f32(json_string_value(json_object_get(P, "logits_file")), n * V);
                float *full = malloc(n * V * sizeof(float)), *step = malloc(n * V * sizeof(float));

                /* full sequence vs transformers */
                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, full), TSR_OK);
                assert_int_equal(tsr_llama_kv_len(kv), n);
                for (size_t i = 0; i < n * V; i++) {
                        double d = fabs((double)full[i] - want[i]);
                        if (d > worst)
                                worst = d;
                        if (d > 1e-4)
                                fail_msg("prompt %zu pos %zu id %zu: %.7g vs %.7g", pi, i / V, i % V, full[i], want[i]);
                }
                /* one token at a time through the cache == the full sequence, bitwise */
                for (size_t t = 0; t < n; t++)
                        assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids + t, 1, t, TSR_LLAMA_LOGITS_LAST,
                                                           step + t * V),
                                         TSR_OK);
                assert_memory_equal(step, full, n * V * sizeof(float));
                /* chunks of 3 after a rewind, LAST logits of each chunk */
                for (size_t t = 0; t < n; t += 3) {
                        size_t k = n - t < 3 ? n - t : 3;
                        float last[512];
                        assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids + t, k, t, TSR_LLAMA_LOGITS_LAST, last),
                                         TSR_OK);
                        assert_memory_equal(last, full + (t + k - 1) * V, V * sizeof(float));
                }

                /* greedy 32 tokens: prefill then decode steps */
                json_t *g = json_object_get(P, "greedy");
                float *lg = malloc(V * sizeof(float));
                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_LAST, lg), TSR_OK);
                for (size_t s = 0; s < json_array_size(g); s++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(lg, V);
                        assert_int_equal(tok, json_integer_value(json_array_get(g, s)));
                        assert_int_equal(tsr_llama_forward(m, ref_be, kv, &tok, 1, n + s, TSR_LLAMA_LOGITS_LAST, lg),
                                         TSR_OK);
                }
                free(lg);
                free(want);
                free(full);
                free(step);
        }
        print_message("stories260K: max |dlogit| %.3g over %zu prompts, greedy exact\n", worst, json_array_size(ps));

        /* errors leave the logits alone and never grow the cache */
        uint32_t bad[2] = {1, 512};
        float sentinel[512] = {0};
        float zero[512] = {0};
        size_t len = tsr_llama_kv_len(kv);
        assert_int_equal(tsr_llama_forward(m, ref_be, kv, bad, 2, 0, TSR_LLAMA_LOGITS_LAST, sentinel), TSR_E_INVAL);
        assert_memory_equal(sentinel, zero, sizeof zero);
        assert_int_equal(tsr_llama_kv_len(kv), len);
        assert_int_equal(tsr_llama_forward(m, ref_be, kv, bad, 1, len + 1, TSR_LLAMA_LOGITS_LAST, sentinel),
                         TSR_E_INVAL);
        uint32_t many[65] = {0};
        assert_int_equal(tsr_llama_forward(m, ref_be, kv, many, 65, 0, TSR_LLAMA_LOGITS_NONE, NULL), TSR_E_LIMIT);
        assert_int_equal(tsr_llama_forward(m, ref_be, kv, many, 1, 0, TSR_LLAMA_LOGITS_LAST, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_llama_kv_truncate(kv, len + 1), TSR_E_INVAL);
        tsr_llama_kv_free(&kv);
        assert_null(kv);
        tsr_llama_free(&m);
        assert_null(m);
        json_decref(j);
}

/* Two sequences interleaved over one shared pool through scrambled block tables (what
 * the engine's paged cache does) give the same logits, bitwise, as each run alone. */
static void test_stories260k_pool(void **state) {
        tsr_llama *m = load_model("TSR_FIXTURES", "models/stories260K.gguf");
        tsr_llama_kv *pool = NULL, *alone = NULL;
        enum { BS = 2, T = 12 };
        /* blocks of sequence a and b, interleaved and out of order; 6 blocks each */
        static const uint32_t tab_a[6] = {7, 2, 10, 0, 5, 9}, tab_b[6] = {3, 11, 1, 8, 4, 6};
        uint32_t ids_a[T], ids_b[T];

        if (!m)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "its GGUF is absent from TSR_FIXTURES/models");
        size_t V = tsr_llama_config_of(m)->vocab_size;
        float *want_a = malloc(T * V * sizeof(float)), *want_b = malloc(T * V * sizeof(float));
        float *got = malloc(V * sizeof(float));
        for (size_t i = 0; i < T; i++) {
                ids_a[i] = (uint32_t)(1 + 37 * i) % 512;
                ids_b[i] = (uint32_t)(5 + 101 * i) % 512;
        }
        assert_int_equal(tsr_llama_kv_new(m, T, 0, &alone), TSR_OK);
        assert_int_equal(tsr_llama_forward(m, ref_be, alone, ids_a, T, 0, TSR_LLAMA_LOGITS_ALL, want_a), TSR_OK);
        assert_int_equal(tsr_llama_forward(m, ref_be, alone, ids_b, T, 0, TSR_LLAMA_LOGITS_ALL, want_b), TSR_OK);

        assert_int_equal(tsr_llama_kv_new(m, 12 * BS, BS, &pool), TSR_OK);
        /* prefill 5 of a, 3 of b, then alternate single steps */
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_a, 6, ids_a, 5, 0, TSR_LLAMA_LOGITS_LAST, got),
                         TSR_OK);
        assert_memory_equal(got, want_a + 4 * V, V * sizeof(float));
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_b, 6, ids_b, 3, 0, TSR_LLAMA_LOGITS_LAST, got),
                         TSR_OK);
        assert_memory_equal(got, want_b + 2 * V, V * sizeof(float));
        for (size_t t = 5, u = 3; t < T || u < T; t++, u++) {
                if (t < T) {
                        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_a, 6, ids_a + t, 1, t,
                                                                  TSR_LLAMA_LOGITS_LAST, got), TSR_OK);
                        assert_memory_equal(got, want_a + t * V, V * sizeof(float));
                }
                if (u < T) {
                        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_b, 6, ids_b + u, 1, u,
                                                                  TSR_LLAMA_LOGITS_LAST, got), TSR_OK);
                        assert_memory_equal(got, want_b + u * V, V * sizeof(float));
                }
        }
        /* a table too short for the positions, and a block outside the pool */
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_a, 2, ids_a, 5, 0, TSR_LLAMA_LOGITS_LAST, got),
                         TSR_E_INVAL);
        static const uint32_t bad[1] = {12};
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, bad, 1, ids_a, 1, 0, TSR_LLAMA_LOGITS_LAST, got),
                         TSR_E_INVAL);
        tsr_llama_kv_free(&pool);
        tsr_llama_kv_free(&alone);
        tsr_llama_free(&m);
        free(want_a);
        free(want_b);
        free(got);
}

/* The engine's step: several sequences in one tsr_llama_forward_batch (a prefill chunk
 * wanting every row, a decode step wanting its last row, a chunk wanting none) give,
 * bitwise, the logits each gives alone: batching never changes a sequence's result. */
static void test_stories260k_batch(void **state) {
        tsr_llama *m = load_model("TSR_FIXTURES", "models/stories260K.gguf");
        tsr_llama_kv *pool = NULL, *alone = NULL;
        enum { BS = 4, T = 10 };
        static const uint32_t tab_a[3] = {4, 0, 8}, tab_b[3] = {1, 6, 2}, tab_c[3] = {3, 7, 5};
        uint32_t ids[3][T];

        if (!m)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "its GGUF is absent from TSR_FIXTURES/models");
        size_t V = tsr_llama_config_of(m)->vocab_size;
        float *want[3], *got = malloc((T + 1) * V * sizeof(float));
        for (int q = 0; q < 3; q++) {
                want[q] = malloc(T * V * sizeof(float));
                for (size_t i = 0; i < T; i++)
                        ids[q][i] = (uint32_t)(3 + 53 * i + 17 * (size_t)q) % 512;
                assert_int_equal(tsr_llama_kv_new(m, T, 0, &alone), TSR_OK);
                assert_int_equal(tsr_llama_forward(m, ref_be, alone, ids[q], T, 0, TSR_LLAMA_LOGITS_ALL, want[q]),
                                 TSR_OK);
                tsr_llama_kv_free(&alone);
        }
        assert_int_equal(tsr_llama_kv_new(m, 9 * BS, BS, &pool), TSR_OK);
        /* b and c already hold 6 positions; a starts now. */
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_b, 3, ids[1], 6, 0, TSR_LLAMA_LOGITS_NONE,
                                                  NULL), TSR_OK);
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_c, 3, ids[2], 6, 0, TSR_LLAMA_LOGITS_NONE,
                                                  NULL), TSR_OK);
        tsr_llama_seq seqs[3] = {
                {.block_table = tab_a, .n_table = 3, .tokens = ids[0], .n = T, .past_len = 0, .which = TSR_LLAMA_LOGITS_ALL},
                {.block_table = tab_b, .n_table = 3, .tokens = ids[1] + 6, .n = 1, .past_len = 6, .which = TSR_LLAMA_LOGITS_LAST},
                {.block_table = tab_c, .n_table = 3, .tokens = ids[2] + 6, .n = 3, .past_len = 6, .which = TSR_LLAMA_LOGITS_NONE},
        };
        assert_int_equal(tsr_llama_forward_batch(m, ref_be, pool, seqs, 3, got), TSR_OK);
        assert_memory_equal(got, want[0], T * V * sizeof(float));              /* a: every row */
        assert_memory_equal(got + T * V, want[1] + 6 * V, V * sizeof(float));  /* b: its one row */
        /* c's KV was written by the batch: its next step alone matches too. */
        assert_int_equal(tsr_llama_forward_blocks(m, ref_be, pool, tab_c, 3, ids[2] + 9, 1, 9, TSR_LLAMA_LOGITS_LAST,
                                                  got),
                         TSR_OK);
        assert_memory_equal(got, want[2] + 9 * V, V * sizeof(float));
        /* a bad member refuses the whole batch */
        seqs[1].n_table = 1;
        assert_int_equal(tsr_llama_forward_batch(m, ref_be, pool, seqs, 3, got), TSR_E_INVAL);
        tsr_llama_kv_free(&pool);
        tsr_llama_free(&m);
        for (int q = 0; q < 3; q++)
                free(want[q]);
        free(got);
}

/* ---- llama-2-tiny-random (F16) ---------------------------------------------------- */

static void test_llama2_tiny(void **state) {
        tsr_llama *m = load_model("TSR_FIXTURES", "models/llama-2-tiny-random.gguf");
        tsr_llama_kv *kv = NULL;
        json_t *j;

        if (!m)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "its GGUF is absent from TSR_FIXTURES/models");
        j = load_golden("tests/fixtures/forward/llama2_tiny.json");
        size_t V = tsr_llama_config_of(m)->vocab_size;
        json_t *ps = json_object_get(j, "prompts");
        assert_true(json_array_size(ps) > 0);        /* a golden without prompts checks nothing */
        double worst = 0;
        assert_int_equal(tsr_llama_kv_new(m, 64, 0, &kv), TSR_OK);
        for (size_t pi = 0; pi < json_array_size(ps); pi++) {
                json_t *P = json_array_get(ps, pi), *top = json_object_get(P, "last_top50");
                json_t *am = json_object_get(P, "argmax");
                uint32_t ids[64];
                size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
                float *lg = malloc(n * V * sizeof(float));

                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, lg), TSR_OK);
                for (size_t k = 0; k < json_array_size(top); k++) {
                        json_t *e = json_array_get(top, k);
                        size_t id = (size_t)json_integer_value(json_array_get(e, 0));
                        double d = fabs(lg[(n - 1) * V + id] - json_real_value(json_array_get(e, 1)));
                        worst = fmax(worst, d);
                        assert_true(d <= 1e-4);
                }
                for (size_t t = 0; t < n; t++)
                        assert_int_equal(tsr_test_argmax(lg + t * V, V), json_integer_value(json_array_get(am, t)));
                free(lg);
        }
        print_message("llama-2-tiny-random: max |dlogit| (top-50) %.3g, argmax equal\n", worst);
        tsr_llama_kv_free(&kv);
        tsr_llama_free(&m);
        json_decref(j);
}

/* ---- SmolLM2-135M-Instruct Q4_1 ------------------------------------------------------ */

static tsr_llama *smol;
static json_t *smol_golden;

static bool sanitized(void) {
#ifdef __SANITIZE_ADDRESS__
        return true;
#else
        return getenv("TSR_SANITIZED") != NULL;
#endif
}

/* Whether prompt i of a golden list runs in this build. */
static bool smol_runs(size_t i, bool greedy) {
        if (!sanitized())
                return true;
        return greedy ? (i == 5 || i == 6) : (i == 1 || i == 4);       /* the shortest prompts */
}

static int smol_setup(void **state) {
        /* Loaded once for the two SmolLM2 tests; absence is a skip inside them. */
        smol = load_model("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if (smol)
                smol_golden = load_golden("tests/fixtures/forward/smollm2.json");
        return 0;
}

static int smol_teardown(void **state) {
        tsr_llama_free(&smol);
        json_decref(smol_golden);
        smol_golden = NULL;
        return 0;
}

static void test_smollm2_logits(void **state) {
        if (!smol)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "the demo model is absent (scripts/fetch-model.sh fetches it)");
        size_t V = tsr_llama_config_of(smol)->vocab_size;
        json_t *ps = json_object_get(smol_golden, "logit_prompts");
        assert_true(json_array_size(ps) > 0);        /* a golden without prompts checks nothing */
        tsr_llama_kv *kv = NULL;
        double worst = 0, tok = 0, secs = 0;

        assert_int_equal(V, 49152);
        assert_true(tsr_llama_config_of(smol)->tied_embeddings);
        assert_int_equal(tsr_llama_kv_new(smol, 64, 0, &kv), TSR_OK);
        for (size_t pi = 0; pi < json_array_size(ps); pi++) {
                if (!smol_runs(pi, false))
                        continue;
                json_t *P = json_array_get(ps, pi), *top = json_object_get(P, "top20");
                json_t *mx = json_object_get(P, "max_abs");
                uint32_t ids[64];
                size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
                float *lg = malloc(n * V * sizeof(float));
                float *last = load_f32(json_string_value(json_object_get(P, "last_logits_file")), V);

                double t0 = now_s();
                assert_int_equal(tsr_llama_forward(smol, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, lg), TSR_OK);
                secs += now_s() - t0;
                tok += (double)n;
                for (size_t t = 0; t < n; t++) {
                        json_t *row = json_array_get(top, t);
                        double tol = 1e-3 * json_real_value(json_array_get(mx, t));
                        for (size_t k = 0; k < json_array_size(row); k++) {
                                json_t *e = json_array_get(row, k);
                                size_t id = (size_t)json_integer_value(json_array_get(e, 0));
                                double d = fabs(lg[t * V + id] - json_real_value(json_array_get(e, 1)));
                                worst = fmax(worst, d / (tol * 1e3));
                                if (d > tol)
                                        fail_msg("prompt %zu pos %zu id %zu: %.6g vs %.6g", pi, t, id, lg[t * V + id],
                                                 json_real_value(json_array_get(e, 1)));
                        }
                        assert_int_equal(tsr_test_argmax(lg + t * V, V),
                                         json_integer_value(json_array_get(json_array_get(row, 0), 0)));
                }
                double tol = 1e-3 * json_real_value(json_array_get(mx, n - 1));
                for (size_t i = 0; i < V; i++)
                        assert_true(fabs(lg[(n - 1) * V + i] - last[i]) <= tol);
                free(lg);
                free(last);
        }
        print_message("SmolLM2: max |dlogit| / max|logit| over top-20 = %.3g; prefill with all logits "
                      "%.1f tok/s\n", worst, tok / secs);
        tsr_llama_kv_free(&kv);
}

struct greedy_job {
        tsr_backend *be;                /* this thread's own */
        json_t *prompts;
        size_t first, step, n_new;
        size_t done_tokens, prefill_tokens;
        double decode_s, prefill_s;
        char msg[256];                  /* empty on success */
};

/* Prefill then one-token decode steps, as the engine will run them; compare each token. */
static void *greedy_thread(void *arg) {
        struct greedy_job *job = arg;
        size_t V = tsr_llama_config_of(smol)->vocab_size;
        float *lg = malloc(V * sizeof(float));
        tsr_llama_kv *kv = NULL;

        if (!lg || tsr_llama_kv_new(smol, 128, 0, &kv) != TSR_OK) {
                snprintf(job->msg, sizeof job->msg, "out of memory");
                goto out;
        }
        for (size_t pi = job->first; pi < json_array_size(job->prompts); pi += job->step) {
                json_t *P = json_array_get(job->prompts, pi), *g = json_object_get(P, "greedy");
                json_t *ja = json_object_get(P, "ids");
                uint32_t ids[64];
                size_t n = json_array_size(ja);
                for (size_t i = 0; i < n && i < 64; i++)
                        ids[i] = (uint32_t)json_integer_value(json_array_get(ja, i));
                double t0 = now_s();
                if (n > 64 || tsr_llama_forward(smol, job->be, kv, ids, n, 0, TSR_LLAMA_LOGITS_LAST, lg) != TSR_OK) {
                        snprintf(job->msg, sizeof job->msg, "prompt %zu: prefill failed", pi);
                        goto out;
                }
                double t1 = now_s();
                job->prefill_s += t1 - t0;
                job->prefill_tokens += n;
                for (size_t s = 0; s < job->n_new && s < json_array_size(g); s++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(lg, V);
                        long long want = json_integer_value(json_array_get(g, s));
                        if (tok != want) {
                                snprintf(job->msg, sizeof job->msg, "prompt %zu step %zu: got %u, transformers %lld "
                                         "(its top-2 margin %.4g)", pi, s, tok, want,
                                         json_real_value(json_array_get(json_object_get(P, "greedy_margin"), s)));
                                goto out;
                        }
                        if (s + 1 == job->n_new)
                                break;
                        if (tsr_llama_forward(smol, job->be, kv, &tok, 1, n + s, TSR_LLAMA_LOGITS_LAST, lg) != TSR_OK) {
                                snprintf(job->msg, sizeof job->msg, "prompt %zu step %zu: decode failed", pi, s);
                                goto out;
                        }
                        job->done_tokens++;
                }
                job->decode_s += now_s() - t1;
        }
out:
        tsr_llama_kv_free(&kv);
        free(lg);
        return NULL;
}

static void test_smollm2_greedy(void **state) {
        if (!smol)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "the demo model is absent (scripts/fetch-model.sh fetches it)");
        json_t *ps = json_object_get(smol_golden, "greedy_prompts");
        assert_true(json_array_size(ps) > 0);        /* a golden without prompts checks nothing */
        /* Two threads (this machine's cores), each its own cache, sharing the read-only model. */
        struct greedy_job jobs[2];
        pthread_t th[2];
        size_t n_new = sanitized() ? 16 : 64;
        json_t *subset = json_array();

        assert_int_equal(json_array_size(ps), 10);
        for (size_t i = 0; i < json_array_size(ps); i++)
                if (smol_runs(i, true))
                        json_array_append(subset, json_array_get(ps, i));
        size_t n_prompts = json_array_size(subset);
        /* The fast backend: bitwise the reference's (test_smollm2_fast_bitwise) and several
         * times quicker.  One backend per thread (kernels.h: a backend is driven by one
         * thread at a time), one core each. */
        for (int t = 0; t < 2; t++) {
                jobs[t] = (struct greedy_job){.prompts = subset, .first = (size_t)t, .step = 2, .n_new = n_new};
                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 1,
                                                                               .max_isa = TSR_CPU_ISA_AVX512_BF16},
                                                     &jobs[t].be),
                                 TSR_OK);
        }
        for (int t = 0; t < 2; t++)
                assert_int_equal(pthread_create(&th[t], NULL, greedy_thread, &jobs[t]), 0);
        for (int t = 0; t < 2; t++)
                assert_int_equal(pthread_join(th[t], NULL), 0);
        for (int t = 0; t < 2; t++)
                tsr_backend_free(&jobs[t].be);
        for (int t = 0; t < 2; t++)
                if (jobs[t].msg[0])
                        fail_msg("%s", jobs[t].msg);
        double dec_tok = (double)(jobs[0].done_tokens + jobs[1].done_tokens);
        double pre_tok = (double)(jobs[0].prefill_tokens + jobs[1].prefill_tokens);
        print_message("SmolLM2 greedy (cpu-fast): %zu prompts x %d tokens exact; per thread (2 running): decode %.1f tok/s, "
                      "prefill %.1f tok/s\n", n_prompts, (int)n_new,
                      dec_tok / (jobs[0].decode_s + jobs[1].decode_s),
                      pre_tok / (jobs[0].prefill_s + jobs[1].prefill_s));
        json_decref(subset);
}

/* The fast CPU table (kernels/cpu/fast.c) through the whole model: every logit of a
 * prefill and of decode steps bitwise equal to the reference's, with 1 and 2 threads,
 * and a batch of sequences giving each one's logits bitwise as when run alone. */
static void test_smollm2_fast_bitwise(void **state) {
        if (!smol)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "the demo model is absent (scripts/fetch-model.sh fetches it)");
        size_t V = tsr_llama_config_of(smol)->vocab_size;
        json_t *P = json_array_get(json_object_get(smol_golden, "logit_prompts"), 1);
        uint32_t ids[64];
        size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
        float *want = malloc((n + 2) * V * sizeof(float)), *got = malloc((n + 2) * V * sizeof(float));
        tsr_llama_kv *kv = NULL;
        uint32_t next[2] = {17, 4242};

        assert_non_null(want);
        assert_non_null(got);
        assert_int_equal(tsr_llama_kv_new(smol, 128, 0, &kv), TSR_OK);
        /* Reference: prefill with all logits, then two decode steps. */
        assert_int_equal(tsr_llama_forward(smol, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, want), TSR_OK);
        for (size_t s = 0; s < 2; s++)
                assert_int_equal(tsr_llama_forward(smol, ref_be, kv, &next[s], 1, n + s, TSR_LLAMA_LOGITS_LAST,
                                                   want + (n + s) * V), TSR_OK);
        tsr_backend *fast = NULL;
        for (int threads = 1; threads <= 2; threads++) {
                tsr_backend_free(&fast);
                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads,
                                                                               .max_isa = TSR_CPU_ISA_AVX512_BF16},
                                                     &fast),
                                 TSR_OK);
                memset(got, 0, (n + 2) * V * sizeof(float));
                assert_int_equal(tsr_llama_forward(smol, fast, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, got), TSR_OK);
                for (size_t s = 0; s < 2; s++)
                        assert_int_equal(tsr_llama_forward(smol, fast, kv, &next[s], 1, n + s, TSR_LLAMA_LOGITS_LAST,
                                                           got + (n + s) * V), TSR_OK);
                if (memcmp(got, want, (n + 2) * V * sizeof(float)) != 0) {
                        for (size_t i = 0; i < (n + 2) * V; i++)
                                if (got[i] != want[i])
                                        fail_msg("%s, %d threads: logit [%zu, %zu] %.9g, cpu-ref %.9g",
                                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), threads, i / V, i % V,
                                                 got[i], want[i]);
                        fail_msg("logits differ in bits only (signed zeros or NaN payloads)");
                }
        }
        /* Batch invariance through the fast table: this prompt's decode step alone (want)
         * vs together with two other sequences' prefill and decode in one forward. */
        tsr_llama_kv *pool = NULL;
        assert_int_equal(tsr_llama_kv_new(smol, 16 * 24, 16, &pool), TSR_OK);
        uint32_t t0[8] = {0, 1, 2, 3, 4, 5, 6, 7}, t1[8] = {8, 9, 10, 11, 12, 13, 14, 15};
        uint32_t t2[8] = {16, 17, 18, 19, 20, 21, 22, 23};
        uint32_t other[5] = {1, 2, 3, 4, 5};
        assert_int_equal(tsr_llama_forward_blocks(smol, fast, pool, t0, 8, ids, n, 0, TSR_LLAMA_LOGITS_NONE, NULL),
                         TSR_OK);
        assert_int_equal(tsr_llama_forward_blocks(smol, fast, pool, t2, 8, other, 3, 0, TSR_LLAMA_LOGITS_NONE, NULL),
                         TSR_OK);
        tsr_llama_seq seqs[3] = {
                {.block_table = t1, .n_table = 8, .tokens = other, .n = 5, .past_len = 0, .which = TSR_LLAMA_LOGITS_ALL},
                {.block_table = t0, .n_table = 8, .tokens = &next[0], .n = 1, .past_len = n,
                 .which = TSR_LLAMA_LOGITS_LAST},
                {.block_table = t2, .n_table = 8, .tokens = &other[3], .n = 2, .past_len = 3,
                 .which = TSR_LLAMA_LOGITS_LAST},
        };
        float *batch = malloc(7 * V * sizeof(float));
        assert_non_null(batch);
        assert_int_equal(tsr_llama_forward_batch(smol, fast, pool, seqs, 3, batch), TSR_OK);
        assert_memory_equal(batch + 5 * V, want + n * V, V * sizeof(float));
        free(batch);
        tsr_llama_kv_free(&pool);
        tsr_backend_free(&fast);
        tsr_llama_kv_free(&kv);
        free(want);
        free(got);
}

/* --dtype bfloat16 against transformers' float32 logits: bf16 weights (rounded from the
 * dequantized float32) and bf16-rounded matmul inputs move every logit a little, so the
 * check is statistical: the full last-position logits of each prompt with cosine
 * similarity >= 0.999 to the goldens, and the argmax (top-1) agreeing at >= 99% of all
 * positions of all prompts.  Run on the bf16 matmul the fast table has now. */
static void check_fidelity(const char *what, double min_cos, double min_top1, tsr_llama *m, tsr_backend *be,
                           tsr_llama_kv *kv) {
        size_t V = tsr_llama_config_of(m)->vocab_size, positions = 0, agree = 0;
        json_t *ps = json_object_get(smol_golden, "logit_prompts");
        assert_true(json_array_size(ps) > 0);        /* a golden without prompts checks nothing */
        double worst_cos = 1.0;

        for (size_t pi = 0; pi < json_array_size(ps); pi++) {
                json_t *P = json_array_get(ps, pi), *top = json_object_get(P, "top20");
                uint32_t ids[64];
                size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
                float *lg = malloc(n * V * sizeof(float));
                float *last = load_f32(json_string_value(json_object_get(P, "last_logits_file")), V);
                assert_int_equal(tsr_llama_forward(m, be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, lg), TSR_OK);
                for (size_t t = 0; t < n; t++, positions++)
                        agree += tsr_test_argmax(lg + t * V, V) ==
                                 (size_t)json_integer_value(json_array_get(json_array_get(json_array_get(top, t), 0), 0));
                double dot = 0, na = 0, nb = 0;
                for (size_t i = 0; i < V; i++) {
                        dot += (double)lg[(n - 1) * V + i] * last[i];
                        na += (double)lg[(n - 1) * V + i] * lg[(n - 1) * V + i];
                        nb += (double)last[i] * last[i];
                }
                double cos = dot / sqrt(na * nb);
                worst_cos = fmin(worst_cos, cos);
                if (!(cos >= min_cos))
                        fail_msg("%s, prompt %zu: cosine(%s logits, transformers) = %.6f < %g",
                                 tsr_cpu_isa_name(tsr_backend_cpu_isa(be)), pi, what, cos, min_cos);
                free(lg);
                free(last);
        }
        print_message("SmolLM2 %s (%s): worst last-position cosine %.6f, top-1 agreement %zu/%zu positions\n", what,
                      tsr_cpu_isa_name(tsr_backend_cpu_isa(be)), worst_cos, agree, positions);
        assert_true((double)agree >= min_top1 * (double)positions);
}

/* Batch invariance through the whole bf16 model: a decode step of one sequence run alone
 * gives bitwise the logits of the same step run in one forward with another sequence's
 * 5-token prefill and a third's 2-token chunk (the bf16 matmuls then see 8 rows, not 1). */
static void check_batch_invariance(const char *what, tsr_llama *m, tsr_backend *be) {
        size_t V = tsr_llama_config_of(m)->vocab_size;
        json_t *P = json_array_get(json_object_get(smol_golden, "logit_prompts"), 1);
        uint32_t ids[64], next = 4242, other[5] = {1, 2, 3, 4, 5};
        size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
        uint32_t t0[8] = {0, 1, 2, 3, 4, 5, 6, 7}, t1[8] = {8, 9, 10, 11, 12, 13, 14, 15};
        uint32_t t2[8] = {16, 17, 18, 19, 20, 21, 22, 23};
        float *alone = malloc(V * sizeof(float)), *batch = malloc(7 * V * sizeof(float));
        tsr_llama_kv *pool = NULL;

        assert_non_null(alone);
        assert_non_null(batch);
        assert_int_equal(tsr_llama_kv_new(m, 16 * 24, 16, &pool), TSR_OK);
        assert_int_equal(tsr_llama_forward_blocks(m, be, pool, t0, 8, ids, n, 0, TSR_LLAMA_LOGITS_NONE, NULL), TSR_OK);
        assert_int_equal(tsr_llama_forward_blocks(m, be, pool, t0, 8, &next, 1, n, TSR_LLAMA_LOGITS_LAST, alone),
                         TSR_OK);
        /* The same decode step again (it rewrites the same KV row), now among others. */
        assert_int_equal(tsr_llama_forward_blocks(m, be, pool, t2, 8, other, 3, 0, TSR_LLAMA_LOGITS_NONE, NULL),
                         TSR_OK);
        tsr_llama_seq seqs[3] = {
                {.block_table = t1, .n_table = 8, .tokens = other, .n = 5, .past_len = 0,
                 .which = TSR_LLAMA_LOGITS_ALL},
                {.block_table = t0, .n_table = 8, .tokens = &next, .n = 1, .past_len = n,
                 .which = TSR_LLAMA_LOGITS_LAST},
                {.block_table = t2, .n_table = 8, .tokens = &other[3], .n = 2, .past_len = 3,
                 .which = TSR_LLAMA_LOGITS_LAST},
        };
        assert_int_equal(tsr_llama_forward_batch(m, be, pool, seqs, 3, batch), TSR_OK);
        if (memcmp(batch + 5 * V, alone, V * sizeof(float)) != 0)
                fail_msg("%s: %s decode logits in a batch differ from the same step alone",
                         tsr_cpu_isa_name(tsr_backend_cpu_isa(be)), what);
        tsr_llama_kv_free(&pool);
        free(alone);
        free(batch);
}

/* The fidelity and batch checks on each bf16 matmul this CPU has: AMX tiles
 * (kernels/cpu/amx.c) where present, then VDPBF16PS (or the widened AVX2 path on older
 * CPUs). */
static void test_smollm2_bf16(void **state) {
        if (!smol)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "the demo model is absent (scripts/fetch-model.sh fetches it)");
        char path[1024], err[512];
        tsr_llama *m = NULL;
        tsr_llama_kv *kv = NULL;
        assert_true(env_path("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", path, sizeof path));
        tsr_backend *fast = NULL;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 0, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &fast),
                         TSR_OK);
        assert_int_equal(tsr_llama_load(path, NULL, NULL, NULL, &m, NULL, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_llama_use_bf16(m), TSR_OK);
        assert_true(tsr_llama_is_bf16(m));
        assert_int_equal(tsr_llama_check_backend(m, ref_be), TSR_OK);   /* ref has the bf16 matmul too */
        assert_int_equal(tsr_llama_check_backend(m, fast), TSR_OK);
        assert_int_equal(tsr_llama_kv_new(m, 64, 0, &kv), TSR_OK);
        check_fidelity("bf16", 0.999, 0.99, m, fast, kv);
        check_batch_invariance("bf16", m, fast);
        if (tsr_backend_cpu_isa(fast) == TSR_CPU_ISA_AMX_BF16) {
                tsr_backend_free(&fast);
                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 0,
                                                                               .max_isa = TSR_CPU_ISA_AVX512_BF16},
                                                     &fast),
                                 TSR_OK);
                check_fidelity("bf16", 0.999, 0.99, m, fast, kv);
                check_batch_invariance("bf16", m, fast);
        }
        tsr_llama_kv_free(&kv);
        tsr_llama_free(&m);
        tsr_backend_free(&fast);
}

/* --dtype auto on a GGUF file: the Q4_1 / Q8_0 blocks kept as stored (issue #15) and the
 * matmuls run on them with int8 activations (kernels/quant/qmm.h).  Checked: resident
 * bytes = the file's tensor bytes; the fast backend's logits bitwise the reference's
 * (cpu/qmm.c vs quant/qmm.c through the whole model); batch invariance; logits against
 * transformers' as for bf16 (cosine >= 0.999, top-1 >= 99%); and the greedy goldens,
 * counted, not required: quantizing the activations moves logits by more than some
 * goldens' top-2 margins (llama.cpp does the same), so a prompt may leave the golden
 * continuation; each one that does is printed with its step and transformers' margin. */
static void test_smollm2_stored(void **state) {
        if (!smol)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "the demo model is absent (scripts/fetch-model.sh fetches it)");
        char path[1024], err[512];
        tsr_llama *m = NULL;
        tsr_llama_kv *kv = NULL;
        tsr_backend *fast = NULL;
        tsr_load_stats st = {0};
        tsr_load_opts opts = {0};
        size_t V;

        assert_true(env_path("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", path, sizeof path));
        for (int t = 0; t < TSR_DTYPE_COUNT; t++)
                if (tsr_backend_supports(ref_be, TSR_OP_MATMUL, (tsr_dtype)t) && tsr_dtype_get_info((tsr_dtype)t)->quantized)
                        opts.keep_dtypes |= 1u << t;
        assert_true(opts.keep_dtypes & (1u << TSR_DTYPE_Q4_1));
        assert_int_equal(tsr_llama_load_opts(path, NULL, NULL, &opts, NULL, NULL, &m, &st, err, sizeof err), TSR_OK);
        print_message("SmolLM2 stored: %.1f MB of tensors in the file, %.1f MB resident (%.1f MB widened)\n",
                      (double)st.file_bytes / 1e6, (double)st.resident_bytes / 1e6, (double)st.f32_bytes / 1e6);
        assert_true(st.resident_bytes == st.file_bytes);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 0, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &fast),
                         TSR_OK);
        assert_int_equal(tsr_llama_check_backend(m, ref_be), TSR_OK);
        assert_int_equal(tsr_llama_check_backend(m, fast), TSR_OK);
        assert_int_equal(tsr_llama_kv_new(m, 128, 0, &kv), TSR_OK);
        V = tsr_llama_config_of(m)->vocab_size;

        /* fast == ref bitwise over a whole prompt (every matmul shape of the model). */
        json_t *P = json_array_get(json_object_get(smol_golden, "logit_prompts"), 1);
        uint32_t ids[64];
        size_t n = json_ids(json_object_get(P, "ids"), ids, 64);
        float *a = malloc(n * V * sizeof(float)), *b = malloc(n * V * sizeof(float)), *lg = malloc(V * sizeof(float));
        assert_true(a && b && lg);
        assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, a), TSR_OK);
        assert_int_equal(tsr_llama_forward(m, fast, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, b), TSR_OK);
        assert_memory_equal(a, b, n * V * sizeof(float));
        check_batch_invariance("stored q4_1", m, fast);
        check_fidelity("stored q4_1", 0.998, 0.97, m, fast, kv);

        json_t *ps = json_object_get(smol_golden, "greedy_prompts");
        size_t exact = 0, total = json_array_size(ps);
        assert_true(total > 0);
        for (size_t pi = 0; pi < total; pi++) {
                json_t *G = json_array_get(ps, pi), *g = json_object_get(G, "greedy");
                size_t np = json_ids(json_object_get(G, "ids"), ids, 64), s = 0;
                assert_int_equal(tsr_llama_forward(m, fast, kv, ids, np, 0, TSR_LLAMA_LOGITS_LAST, lg), TSR_OK);
                for (; s < json_array_size(g); s++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(lg, V);
                        if (tok != (uint32_t)json_integer_value(json_array_get(g, s)))
                                break;
                        if (s + 1 < json_array_size(g))
                                assert_int_equal(tsr_llama_forward(m, fast, kv, &tok, 1, np + s, TSR_LLAMA_LOGITS_LAST,
                                                                   lg), TSR_OK);
                }
                if (s == json_array_size(g))
                        exact++;
                else
                        print_message("SmolLM2 stored: greedy prompt %zu leaves the golden at step %zu of %zu "
                                      "(transformers' top-2 margin there %.4g)\n", pi, s, json_array_size(g),
                                      json_real_value(json_array_get(json_object_get(G, "greedy_margin"), s)));
        }
        print_message("SmolLM2 stored (%s): %zu of %zu greedy prompts token-exact\n",
                      tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), exact, total);
        free(a), free(b), free(lg);
        tsr_llama_kv_free(&kv);
        tsr_llama_free(&m);
        tsr_backend_free(&fast);
}

int main(void) {
        const struct CMUnitTest kernels[] = {
                cmocka_unit_test(test_matmul_shapes),
                cmocka_unit_test(test_rope_layouts),
                cmocka_unit_test(test_rope_llama3),
                cmocka_unit_test(test_attention_vs_double),
                cmocka_unit_test(test_elementwise),
                cmocka_unit_test(test_dequant),
                cmocka_unit_test(test_load_errors),
                cmocka_unit_test(test_stories260k),
                cmocka_unit_test(test_stories260k_pool),
                cmocka_unit_test(test_stories260k_batch),
                cmocka_unit_test(test_llama2_tiny),
        };
        const struct CMUnitTest smollm2[] = {
                cmocka_unit_test(test_smollm2_logits),
                cmocka_unit_test(test_smollm2_greedy),
                cmocka_unit_test(test_smollm2_fast_bitwise),
                cmocka_unit_test(test_smollm2_stored),
                cmocka_unit_test(test_smollm2_bf16),      /* last: not registered when sanitized */
        };
        if (tsr_backend_cpu_ref_new(&ref_be) != TSR_OK)
                return 1;
        int failed = cmocka_run_group_tests_name("forward", kernels, NULL, NULL);
        size_t n_smol = sizeof smollm2 / sizeof *smollm2 - (sanitized() ? 1 : 0);
        failed += _cmocka_run_group_tests("forward_smollm2", smollm2, n_smol, smol_setup, smol_teardown);
        tsr_backend_free(&ref_be);
        return failed ? 1 : 0;
}
