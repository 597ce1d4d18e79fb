/* test_cuda_forward.c - the Llama forward on the CUDA backend (issue #16), suite 'gpu'.
 *
 * Without a CUDA device it prints "[skip:no-gpu] ..." and exits 77 (meson: skipped).
 * With one:
 *   1. tests/fixtures/tiny-llama3-hf/f32 against transformers (golden.json, written by
 *      tests/fixtures/make_tiny_llama_hf.py): every position's logits of every prompt
 *      within 2e-4 (float32 on both sides; the CPU backends meet 1e-4), and the greedy
 *      16-token continuation of every prompt through the KV-cache decode path equal.
 *   2. The same model with --dtype bfloat16 on CUDA against the CPU reference backend's
 *      bfloat16 path, which computes the same products (x rounded to bf16, bf16 weights,
 *      float32 sums) in another order: within 1e-3 * max |logit| + 1e-4.
 *   3. Paged batching: two sequences through shuffled block tables in one
 *      tsr_llama_forward_batch on CUDA, against each alone on the CPU.  3b: a bfloat16 KV
 *      cache on CUDA against one on the CPU reference (within 1e-3 * max |logit| + 1e-4).
 *      3c: rows answered by their token on the device (tsr_llama_seq.token) in a batch
 *      with whole rows: an argmax (the row's first maximum) and a draw (cpu-ref's
 *      tsr_backend_sample of the same row, bitwise), the whole rows bitwise.
 *   4. $TSR_GPU_MODEL (a folder or .gguf; unset: skipped with a line, not a failure),
 *      e.g. the SmolLM2-shaped random model the device script makes: float32 CUDA against
 *      the fast CPU backend, last-position logits of a 96-token prompt within
 *      1e-3 * max |logit|, and 24 greedy decode steps equal up to the first near tie
 *      (a CPU top-2 margin under 1e-4 * max |logit|); bfloat16 CUDA against the
 *      CPU bfloat16 path within 2e-2 * max |logit| (prints the greedy agreement).
 *   5. CUDA graphs of decode steps against the same steps run eagerly (graphs(), below).
 *   6. ModelOpt FP8 / NVFP4 weights (modelopt(), below); 7. Llama 4 on the device
 *      (llama4_on_device()); 8. NemotronH on the device (nemotron_h_on_device()); 9. a BF16
 *      Llama's tables kept as stored (stored_tables()).
 * TSR_TEST_DEVICE=cpu-devlike runs it all on the reference kernels behind a backend
 * whose memory counts as a device's (tsr_backend_cpu_devlike_new): the forward's device
 * path without a GPU, in the unit suite ('cuda_forward_devlike').
 * Prints what it measured; exits 1 if any check failed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kernels/kernels.h"
#include "worker/engine/kv_pool.h"
#include "worker/engine/sampler.h"
#include "worker/load/modelopt.h"
#include "worker/model/llama.h"
#include "worker/model/llama4.h"
#include "worker/model/nemotron_h.h"

static int failures;

#define CHECK(cond, ...)                                        \
        do {                                                    \
                if (!(cond)) {                                  \
                        printf("FAIL %s:%d: ", __FILE__, __LINE__); \
                        printf(__VA_ARGS__);                    \
                        printf("\n");                           \
                        failures++;                             \
                }                                               \
        } while (0)

static size_t argmax(const float *x, size_t n) {
        size_t b = 0;
        for (size_t i = 1; i < n; i++)
                if (x[i] > x[b])
                        b = i;
        return b;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
        double m = 0;
        for (size_t i = 0; i < n; i++) {
                double d = fabs((double)a[i] - (double)b[i]);
                if (!(d <= m))          /* NaN counts as infinitely far */
                        m = isnan(d) ? INFINITY : d;
        }
        return m;
}

static double max_abs(const float *a, size_t n) {
        double m = 0;
        for (size_t i = 0; i < n; i++)
                m = fmax(m, fabs((double)a[i]));
        return m;
}

/* A JSON array of ints a (at most cap) into ids; the count. */
static size_t json_ids(const json_t *a, uint32_t *ids, size_t cap) {
        size_t n = json_array_size(a);
        CHECK(n <= cap, "%zu ids, room for %zu", n, cap);
        n = n < cap ? n : cap;
        for (size_t i = 0; i < n; i++)
                ids[i] = (uint32_t)json_integer_value(json_array_get(a, i));
        return n;
}

/* A model on `be` (weights copied there when it is a device), bf16 when asked; lo (may
 * be NULL): the load's options (a ModelOpt checkpoint's weights kept as stored). */
static tsr_llama *load_opts_on(const char *path, const tsr_load_opts *lo, tsr_backend *be, bool bf16) {
        char err[512] = "";
        tsr_llama *m = NULL;
        if (tsr_llama_load_opts(path, NULL, NULL, lo, NULL, NULL, &m, NULL, err, sizeof err) != TSR_OK) {
                printf("FAIL load %s: %s\n", path, err);
                return NULL;
        }
        if ((bf16 && tsr_llama_use_bf16(m) != TSR_OK) || tsr_llama_to_backend(m, be, err, sizeof err) != TSR_OK ||
            tsr_llama_check_backend(m, be) != TSR_OK) {
                printf("FAIL %s on %s: %s\n", path, tsr_backend_name(be), err[0] ? err : "check_backend");
                tsr_llama_free(&m);
                failures++;
                return NULL;
        }
        /* the dtype the worker reports (ModelInfo) survives the move to the device */
        CHECK(tsr_llama_is_bf16(m) == bf16, "is_bf16 after to_backend: %d, want %d", tsr_llama_is_bf16(m), bf16);
        if (!tsr_backend_host_memory(be))
                CHECK(tsr_llama_use_bf16(m) == TSR_E_INVAL, "use_bf16 after to_backend must be refused");
        return m;
}

static tsr_llama *load_on(const char *path, tsr_backend *be, bool bf16) { return load_opts_on(path, NULL, be, bf16); }

/* All-position logits of ids[n] (n rows), prefilled in one forward. */
static tsr_status logits_all(tsr_llama *m, tsr_backend *be, const uint32_t *ids, size_t n, float *out) {
        tsr_llama_kv *kv = NULL;
        tsr_status st = tsr_llama_kv_new(m, n + 1, 16, &kv);
        if (st == TSR_OK)
                st = tsr_llama_forward(m, be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, out);
        tsr_llama_kv_free(&kv);
        return st;
}

/* The same through a KV pool of `dtype` in be's memory (the runner's pool for
 * --kv-cache-dtype). */
static tsr_status logits_all_kv(tsr_llama *m, tsr_backend *be, tsr_dtype dtype, const uint32_t *ids, size_t n,
                                float *out) {
        tsr_kv_group g = tsr_llama_kv_group(tsr_llama_config_of(m));
        tsr_kv_pool *pool = NULL;
        tsr_llama_kv *kv = NULL;
        g.dtype = dtype;
        tsr_status st = tsr_kv_pool_new_on(tsr_backend_host_memory(be) ? NULL : be, &g, 1, n / 16 + 1, 16, 0, &pool);
        if (st == TSR_OK)
                st = tsr_llama_kv_bind(m, pool, &kv);
        if (st == TSR_OK)
                st = tsr_llama_forward(m, be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, out);
        tsr_llama_kv_free(&kv);
        tsr_kv_pool_free(&pool);
        return st;
}

/* Greedy continuation of ids[n] for `steps` tokens through the decode path (prefill,
 * then one token per forward); the last step's logits into last (vocab). */
/* The gap between the largest and the second largest of x[0..n). */
static double top2_margin(const float *x, size_t n) {
        double a = -INFINITY, b = -INFINITY;
        for (size_t i = 0; i < n; i++) {
                if (x[i] > a) {
                        b = a;
                        a = x[i];
                } else if (x[i] > b) {
                        b = x[i];
                }
        }
        return a - b;
}

/* margins (steps, may be NULL): each step's top-2 gap. */
static tsr_status greedy(tsr_llama *m, tsr_backend *be, const uint32_t *ids, size_t n, size_t steps, uint32_t *toks,
                         float *last, double *margins) {
        size_t vocab = tsr_llama_config_of(m)->vocab_size;
        tsr_llama_kv *kv = NULL;
        tsr_status st = tsr_llama_kv_new(m, n + steps + 1, 16, &kv);
        if (st == TSR_OK)
                st = tsr_llama_forward(m, be, kv, ids, n, 0, TSR_LLAMA_LOGITS_LAST, last);
        for (size_t s = 0; st == TSR_OK && s < steps; s++) {
                toks[s] = (uint32_t)argmax(last, vocab);
                if (margins)
                        margins[s] = top2_margin(last, vocab);
                if (s + 1 < steps)
                        st = tsr_llama_forward(m, be, kv, &toks[s], 1, n + s, TSR_LLAMA_LOGITS_LAST, last);
        }
        tsr_llama_kv_free(&kv);
        return st;
}

/* Prompt 1's all-position logits of mg on gpu against mc's on ref (both bf16; each
 * freed here): within the bf16 bound (1e-3 x max |logit| + 1e-4), or bitwise. */
static void bf16_vs_ref(tsr_llama *mg, tsr_backend *gpu, tsr_llama *mc, tsr_backend *ref, json_t *prompts,
                        size_t vocab, float *got, const char *what, bool bitwise) {
        CHECK(mg && mc, "tiny %s", what);
        if (mg && mc) {
                uint32_t ids[256];
                size_t n = json_ids(json_object_get(json_array_get(prompts, 1), "ids"), ids, 256);
                float *want = malloc(n * vocab * sizeof(float));
                CHECK(logits_all(mc, ref, ids, n, want) == TSR_OK && logits_all(mg, gpu, ids, n, got) == TSR_OK,
                      "%s forwards", what);
                double d = max_abs_diff(got, want, n * vocab), bound = 1e-3 * max_abs(want, n * vocab) + 1e-4;
                printf("tiny-llama3-hf %s (%zu tokens): max |dlogit| %s vs cpu-ref %.3g (bound %.3g%s)\n", what, n,
                       tsr_backend_name(gpu), d, bound, bitwise ? ", bitwise" : "");
                CHECK(bitwise ? memcmp(got, want, n * vocab * sizeof(float)) == 0 : d <= bound, "%s: %.3g (bound %.3g)",
                      what, d, bound);
                free(want);
        }
        tsr_llama_free(&mg);
        tsr_llama_free(&mc);
}

/* The golden.json of the fixture folder `rel` (under root), dir set to that folder; NULL,
 * the failure counted, when it cannot be read. */
static json_t *fixture_golden(const char *root, const char *rel, char *dir, size_t dir_len) {
        char path[4400];
        json_error_t je;
        snprintf(dir, dir_len, "%s/%s", root, rel);
        snprintf(path, sizeof path, "%s/golden.json", dir);
        json_t *g = json_load_file(path, 0, &je);
        CHECK(g, "%s: %s", path, je.text);
        return g;
}

/* 1 and 2: the tiny fixture against transformers (f32) and the CPU bf16 path. */
static void tiny_fixture(tsr_backend *gpu, tsr_backend *ref, const char *root) {
        char dir[4096], path[4200];
        json_t *g = fixture_golden(root, "tests/fixtures/tiny-llama3-hf", dir, sizeof dir);
        if (!g)
                return;
        json_t *prompts = json_object_get(g, "prompts"), *var = json_object_get(json_object_get(g, "variants"), "f32");
        size_t vocab = (size_t)json_integer_value(json_object_get(g, "vocab_size")), rows = 0;
        for (size_t p = 0; p < json_array_size(prompts); p++)
                rows += json_array_size(json_object_get(json_array_get(prompts, p), "ids"));
        float *golden = malloc(rows * vocab * sizeof(float)), *got = malloc(rows * vocab * sizeof(float));
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(var, "logits_file")));
        FILE *f = fopen(path, "rb");
        CHECK(f && fread(golden, sizeof(float), rows * vocab, f) == rows * vocab, "read %s", path);
        if (f)
                fclose(f);
        snprintf(path, sizeof path, "%s/f32", dir);
        tsr_llama *m = load_on(path, gpu, false);
        CHECK(m, "tiny f32 on cuda");
        size_t row = 0;
        for (size_t p = 0; m && p < json_array_size(prompts); p++) {
                uint32_t ids[256], toks[16];
                size_t n = json_ids(json_object_get(json_array_get(prompts, p), "ids"), ids, 256);
                float last[4096];
                tsr_status st = logits_all(m, gpu, ids, n, got);
                CHECK(st == TSR_OK, "forward: %s", tsr_status_str(st));
                double d = max_abs_diff(got, golden + row * vocab, n * vocab);
                printf("tiny-llama3-hf f32 prompt %zu (%zu tokens): max |dlogit| vs transformers %.3g\n", p, n, d);
                CHECK(d <= 2e-4, "prompt %zu: max |dlogit| %.3g > 2e-4", p, d);
                row += n;
                json_t *want = json_array_get(json_object_get(var, "greedy"), p);
                st = greedy(m, gpu, ids, n, json_array_size(want), toks, last, NULL);
                CHECK(st == TSR_OK, "greedy: %s", tsr_status_str(st));
                for (size_t s = 0; st == TSR_OK && s < json_array_size(want); s++)
                        CHECK(toks[s] == (uint32_t)json_integer_value(json_array_get(want, s)),
                              "prompt %zu greedy step %zu: %u, transformers %lld", p, s, toks[s],
                              (long long)json_integer_value(json_array_get(want, s)));
        }
        tsr_llama_free(&m);

        /* 2: bf16 on both backends over the first prompt, all positions */
        bf16_vs_ref(load_on(path, gpu, true), gpu, load_on(path, ref, true), ref, prompts, vocab, got, "bf16", false);
        /* 2b: the BF16 copy's matmuls kept as stored (keep_bf16, as the runner loads a BF16
         * checkpoint whose weights stay bfloat16) go to the device as their bytes: the
         * device forward within the bf16 bound of cpu-ref's on the same file widened and
         * converted, bitwise on cpu-devlike (the same reference kernels on the same bits) */
        snprintf(path, sizeof path, "%s/bf16", dir);
        const tsr_load_opts keep = {.keep_bf16 = true};
        bf16_vs_ref(load_opts_on(path, &keep, gpu, true), gpu, load_on(path, ref, true), ref, prompts, vocab, got,
                    "BF16 kept as stored", strcmp(tsr_backend_name(gpu), "cpu-devlike") == 0);

        /* 3: two sequences in one batch through shuffled block tables */
        snprintf(path, sizeof path, "%s/f32", dir);
        tsr_llama *mg = load_on(path, gpu, false), *mc = load_on(path, ref, false);
        CHECK(mg && mc, "tiny f32 for batching");
        if (mg && mc) {
                uint32_t i0[256], i1[256], t0[4] = {7, 5, 3, 1}, t1[4] = {6, 0, 2, 4};
                size_t n0 = json_ids(json_object_get(json_array_get(prompts, 1), "ids"), i0, 256);
                size_t n1 = json_ids(json_object_get(json_array_get(prompts, 2), "ids"), i1, 256);
                tsr_llama_kv *pool = NULL;
                float *bat = malloc((n0 + n1) * vocab * sizeof(float));
                float *w0 = malloc(n0 * vocab * sizeof(float)), *w1 = malloc(n1 * vocab * sizeof(float));
                CHECK(n0 <= 64 && n1 <= 64, "prompts fit 4 blocks of 16");
                CHECK(tsr_llama_kv_new(mg, 8 * 16, 16, &pool) == TSR_OK, "pool");
                tsr_llama_seq seqs[2] = {
                        {.block_table = t0, .n_table = 4, .tokens = i0, .n = n0, .past_len = 0,
                         .which = TSR_LLAMA_LOGITS_ALL},
                        {.block_table = t1, .n_table = 4, .tokens = i1, .n = n1, .past_len = 0,
                         .which = TSR_LLAMA_LOGITS_ALL},
                };
                tsr_status st = tsr_llama_forward_batch(mg, gpu, pool, seqs, 2, bat);
                CHECK(st == TSR_OK, "batch: %s", tsr_status_str(st));
                CHECK(logits_all(mc, ref, i0, n0, w0) == TSR_OK && logits_all(mc, ref, i1, n1, w1) == TSR_OK,
                      "cpu alone");
                double d0 = max_abs_diff(bat, w0, n0 * vocab), d1 = max_abs_diff(bat + n0 * vocab, w1, n1 * vocab);
                printf("batched paged forward on cuda vs each alone on cpu-ref: max |dlogit| %.3g, %.3g\n", d0, d1);
                CHECK(d0 <= 2e-4 && d1 <= 2e-4, "batched: %.3g %.3g", d0, d1);
                tsr_llama_kv_free(&pool);
                free(bat);
                free(w0);
                free(w1);
        }
        tsr_llama_free(&mg);
        tsr_llama_free(&mc);

        /* 3b: a bfloat16 KV cache (--kv-cache-dtype bfloat16, and auto under bf16 weights):
         * both backends round K and V alike (tsr_f32_to_bf16), but a K one float32 ulp away
         * after RoPE can round one bf16 ulp (2^-8 relative) away, so the bar is the bf16
         * weights' (1e-3 x max |logit| + 1e-4; the H200 measured 4.2e-4 for a bar of 3.6e-3),
         * not the float32 cache's 2e-4 */
        mg = load_on(path, gpu, false);
        mc = load_on(path, ref, false);
        CHECK(mg && mc, "tiny f32 for the bf16 cache");
        if (mg && mc) {
                uint32_t ids[256];
                size_t n = json_ids(json_object_get(json_array_get(prompts, 2), "ids"), ids, 256);
                float *want = malloc(n * vocab * sizeof(float)), *f32kv = malloc(n * vocab * sizeof(float));
                tsr_status st = logits_all_kv(mc, ref, TSR_DTYPE_BF16, ids, n, want);
                CHECK(st == TSR_OK, "cpu-ref, bf16 cache: %s", tsr_status_str(st));
                st = logits_all_kv(mg, gpu, TSR_DTYPE_BF16, ids, n, got);
                CHECK(st == TSR_OK, "device, bf16 cache: %s", tsr_status_str(st));
                CHECK(logits_all(mc, ref, ids, n, f32kv) == TSR_OK, "cpu-ref, f32 cache");
                double d = max_abs_diff(got, want, n * vocab), d32 = max_abs_diff(want, f32kv, n * vocab);
                double bound = 1e-3 * max_abs(want, n * vocab) + 1e-4;
                printf("tiny-llama3-hf f32 weights, bf16 KV cache (%zu tokens): max |dlogit| %s vs cpu-ref %.3g "
                       "(bound %.3g; the bf16 cache vs a float32 one on cpu-ref: %.3g)\n", n, tsr_backend_name(gpu),
                       d, bound, d32);
                CHECK(d <= bound, "bf16 cache: %.3g > %.3g", d, bound);
                CHECK(d32 > 0, "the bf16 cache changed nothing: is it in use?");
                free(want);
                free(f32kv);
        }
        tsr_llama_free(&mg);
        tsr_llama_free(&mc);

        /* 3c: rows answered on the device (answer.h, through tsr_llama_seq.answer) in a
         * batch that mixes them with whole rows: a greedy row's argmax is the first
         * maximum of the row the same batch downloads whole, with its logprobs; a
         * prompt-logprobs chunk's prompt rows answered as the next token's logprobs, its
         * last row whole; a drawn row under rules (allowed ids, a bias, the three
         * penalties over a history) is the reference's draw from that row after the
         * reference's rules, with the raw row's logprobs.  Logprobs are the engine's
         * tsr_logprobs_gather's within 1e-4 (the same ranks and top ids), the whole rows
         * bitwise, and an answered row's slot in the logits is left alone. */
        mg = load_on(path, gpu, false);
        CHECK(mg, "tiny f32 for token rows");
        if (mg) {
                uint32_t ids[4][256], t[4][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}};
                size_t n[4], pick[4] = {0, 1, 0, 2};      /* the argmax rows of two different prompts */
                for (size_t i = 0; i < 4; i++)
                        n[i] = json_ids(json_object_get(json_array_get(prompts, pick[i] % json_array_size(prompts)),
                                                        "ids"),
                                        ids[i], 256);
                tsr_llama_kv *pool = NULL;
                CHECK(tsr_llama_kv_new(mg, 16 * 16, 16, &pool) == TSR_OK, "pool");
                /* rows: seq 0 its last (argmax, logprobs), seq 1 all n[1] (prompt logprobs),
                 * seq 2 its last (whole), seq 3 its last (rules, a draw, logprobs) */
                size_t nrows = 1 + n[1] + 1 + 1, off3 = 1 + n[1] + 1;
                float *whole = malloc(nrows * vocab * sizeof(float)), *mixed = malloc(nrows * vocab * sizeof(float));
                uint32_t am[4] = {TSR_ARGMAX_NONE - 1, 0, 0, TSR_ARGMAX_NONE - 1};
                tsr_llama_seq seqs[4];
                for (size_t i = 0; i < 4; i++)
                        seqs[i] = (tsr_llama_seq){.block_table = t[i], .n_table = 4, .tokens = ids[i], .n = n[i],
                                                  .which = i == 1 ? TSR_LLAMA_LOGITS_ALL : TSR_LLAMA_LOGITS_LAST};
                tsr_status st = tsr_llama_forward_batch(mg, gpu, pool, seqs, 4, whole);
                CHECK(st == TSR_OK, "batch, whole rows: %s", tsr_status_str(st));
                tsr_draw dr = {.temperature = 0.9f, .top_k = 20, .top_p = 0.95f, .u = 0.37};
                const uint32_t allowed[] = {1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37};
                const tsr_logit_bias bias[] = {{7, 2.5f}, {13, -1.0f}};
                uint32_t history[6] = {ids[3][0], ids[3][1], 7, 7, 13, 5};
                tsr_sampling rules;
                tsr_sampling_init(&rules);
                rules.allowed_ids = allowed;
                rules.n_allowed = sizeof allowed / sizeof *allowed;
                rules.bias = bias;
                rules.n_bias = 2;
                rules.repetition_penalty = 1.4f;
                rules.frequency_penalty = 0.3f;
                rules.presence_penalty = 0.6f;
                tsr_token_logprobs lp0, lp3, *plp = calloc(n[1], sizeof *plp);
                tsr_engine_seq e[4] = {
                        {.want_logits = true, .token = &am[0], .lp = &lp0, .lp_top = 3},
                        {.want_logits = true, .want_all_logits = true, .n = n[1], .tokens = ids[1],
                         .prompt_len = (uint32_t)n[1], .prompt_lp = plp, .prompt_lp_top = 2, .next_token = 3},
                        {.want_logits = true},
                        {.want_logits = true, .token = &am[3], .draw = &dr, .lp = &lp3, .lp_top = 4, .rules = &rules,
                         .history = history, .n_history = 6, .prompt_len = 2},
                };
                for (size_t i = 0; i < 4; i++)
                        seqs[i].answer = &e[i];
                memset(mixed, 0x7f, nrows * vocab * sizeof(float));
                st = tsr_llama_forward_batch(mg, gpu, pool, seqs, 4, mixed);
                CHECK(st == TSR_OK, "batch, answered rows: %s", tsr_status_str(st));
                /* the draw: the reference's rules, then its tsr_backend_sample, of the whole row */
                uint32_t want3 = TSR_ARGMAX_NONE, words[64];
                float *row3 = malloc(vocab * sizeof(float));
                memcpy(row3, whole + off3 * vocab, vocab * sizeof(float));
                tsr_sample_history h = {.prompt = history, .n_prompt = 2, .output = history + 2, .n_output = 4};
                tsr_logit_rules lr;
                CHECK(tsr_sampling_rules(&rules, &h, false, vocab, words, &lr) == TSR_OK, "rules");
                CHECK(tsr_backend_logit_rules(ref, row3, 1, vocab, &lr) == TSR_OK, "reference rules");
                CHECK(tsr_backend_sample(ref, &want3, row3, 1, vocab, &dr) == TSR_OK, "reference draw");
                free(row3);
                CHECK(am[0] == argmax(whole, vocab) && am[3] == want3, "argmax %u, draw %u; of the rows %zu, %u",
                      am[0], am[3], argmax(whole, vocab), want3);
                bool allowed3 = false;
                for (size_t k = 0; k < sizeof allowed / sizeof *allowed; k++)
                        allowed3 |= am[3] == allowed[k];
                CHECK(allowed3, "the drawn token %u is not an allowed one", am[3]);
                /* the logprobs against the engine's own gathering from the whole rows */
                size_t lp_checked = 0;
                struct { const tsr_token_logprobs *got; const float *row; uint32_t token, k; } lps[258];
                size_t nl = 0;
                lps[nl++] = (__typeof__(lps[0])){&lp0, whole, am[0], 3};
                lps[nl++] = (__typeof__(lps[0])){&lp3, whole + off3 * vocab, am[3], 4};
                for (size_t r = 0; r + 1 < n[1] && nl < 258; r++)
                        lps[nl++] = (__typeof__(lps[0])){&plp[r], whole + (1 + r) * vocab, ids[1][r + 1], 2};
                for (size_t j = 0; j < nl; j++) {
                        tsr_token_logprobs want;
                        CHECK(tsr_logprobs_gather(lps[j].row, vocab, lps[j].token, lps[j].k, &want) == TSR_OK, "gather");
                        const tsr_token_logprobs *ans = lps[j].got;
                        bool same = ans->token == lps[j].token && ans->rank == want.rank && ans->n_top == lps[j].k &&
                                    fabsf(ans->logprob - want.logprob) <= 1e-4f;
                        for (uint32_t k = 0; k < lps[j].k; k++)
                                same &= ans->top_ids[k] == want.top_ids[k] &&
                                        fabsf(ans->top_logprobs[k] - want.top_logprobs[k]) <= 1e-4f;
                        CHECK(same, "logprobs %zu (token %u): rank %u / %u, logprob %g / %g", j, lps[j].token,
                              ans->rank, want.rank, ans->logprob, want.logprob);
                        lp_checked++;
                }
                /* seq 1's last row and seq 2's come back whole, bitwise */
                CHECK(memcmp(mixed + n[1] * vocab, whole + n[1] * vocab, 2 * vocab * sizeof(float)) == 0,
                      "the whole rows differ");
                bool untouched = true;
                for (size_t v = 0; v < vocab; v++) {
                        untouched &= memcmp(&mixed[v], &(uint32_t){0x7f7f7f7fu}, 4) == 0 &&
                                     memcmp(&mixed[off3 * vocab + v], &(uint32_t){0x7f7f7f7fu}, 4) == 0;
                        for (size_t r = 0; r + 1 < n[1]; r++)
                                untouched &= memcmp(&mixed[(1 + r) * vocab + v], &(uint32_t){0x7f7f7f7fu}, 4) == 0;
                }
                CHECK(untouched, "an answered row's slot was written");
                printf("rows answered on the device: argmax %u (the row's first maximum), draw %u under rules "
                       "(the reference's), %zu logprobs as the engine's, %zu prompt rows; 2 whole rows bitwise\n",
                       am[0], am[3], lp_checked, n[1] - 1);
                tsr_llama_kv_free(&pool);
                free(whole);
                free(mixed);
                free(plp);
        }
        tsr_llama_free(&mg);
        free(golden);
        free(got);
        json_decref(g);
}

/* 6: the ModelOpt checkpoints of tests/fixtures/tiny-modelopt (fp8 and nvfp4 linears
 * kept as stored, tsr_llama_to_backend copying their bytes and scales), on the device
 * against the same model on the CPU reference and against the committed torch emulation
 * (make_tiny_modelopt.py).  Every logit prompt's all-position logits and the greedy
 * 32-token continuations through the decode path.
 * cpu-devlike (the reference kernels): bitwise the CPU's logits, and within the CPU's
 * own bound of the emulation (test_quant_modelopt.c: 1e-4 + 50 x order_sensitivity);
 * greedy equal token for token.
 * CUDA: cuBLASLt's fp8 GEMM and the device's attention sum in their own orders, which
 * may move an activation across an fp8 / e2m1 rounding boundary in the next layer (one
 * quantum of that element: logit jumps of about 1e-2 on this model), so the bound is
 * 5e-2 (max |logit| 3.6) and the greedy tokens must equal the emulation's up to its
 * first step with a top-2 margin under 5e-2 (greedy_margin), after which the
 * continuations may part legitimately; the measured distances are printed. */
static void modelopt(tsr_backend *gpu, tsr_backend *ref, const char *root, bool devlike) {
        static const char *const variants[] = {"fp8", "nvfp4"};
        char dir[4096], path[4400], err[512] = "";
        json_t *g = fixture_golden(root, "tests/fixtures/tiny-modelopt", dir, sizeof dir);
        for (size_t vi = 0; g && vi < sizeof variants / sizeof *variants; vi++) {
                json_t *var = json_object_get(json_object_get(g, "variants"), variants[vi]);
                json_t *lp = json_object_get(g, "logit_prompts"), *prompts = json_object_get(g, "prompts");
                tsr_modelopt_config mc;
                snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(var, "dir")));
                if (tsr_modelopt_config_read(path, &mc, err, sizeof err) != TSR_OK) {
                        CHECK(0, "%s: %s", path, err);
                        continue;
                }
                tsr_load_opts lo = {.modelopt = &mc};
                tsr_llama *md = load_opts_on(path, &lo, gpu, false), *mh = load_opts_on(path, &lo, ref, false);
                tsr_modelopt_config_done(&mc);
                CHECK(md && mh, "tiny-modelopt %s on %s and on the CPU", variants[vi], tsr_backend_name(gpu));
                if (!md || !mh) {
                        tsr_llama_free(&md);
                        tsr_llama_free(&mh);
                        continue;
                }
                size_t vocab = tsr_llama_config_of(md)->vocab_size, rows = 0;
                for (size_t i = 0; i < json_array_size(lp); i++)
                        rows += json_array_size(json_object_get(
                                json_array_get(prompts, (size_t)json_integer_value(json_array_get(lp, i))), "ids"));
                float *emu = malloc(rows * vocab * sizeof(float)), *got = malloc(256 * vocab * sizeof(float));
                float *host = malloc(256 * vocab * sizeof(float)), *last = malloc(vocab * sizeof(float));
                snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(var, "logits_file")));
                FILE *f = fopen(path, "rb");
                CHECK(f && fread(emu, sizeof(float), rows * vocab, f) == rows * vocab, "read %s", path);
                if (f)
                        fclose(f);
                double bound = devlike ? 1e-4 + 50 * json_number_value(json_object_get(var, "order_sensitivity")) : 5e-2;
                double worst_emu = 0, worst_host = 0;
                size_t row = 0, equal = 0, compared = 0;
                for (size_t i = 0; i < json_array_size(lp); i++) {
                        uint32_t ids[256];
                        size_t n = json_ids(json_object_get(json_array_get(prompts,
                                                                           (size_t)json_integer_value(json_array_get(lp, i))),
                                                            "ids"), ids, 256);
                        tsr_status st = logits_all(md, gpu, ids, n, got);
                        CHECK(st == TSR_OK, "%s forward on %s: %s", variants[vi], tsr_backend_name(gpu), tsr_status_str(st));
                        st = logits_all(mh, ref, ids, n, host);
                        CHECK(st == TSR_OK, "%s forward on the CPU: %s", variants[vi], tsr_status_str(st));
                        if (devlike)
                                CHECK(memcmp(got, host, n * vocab * sizeof(float)) == 0,
                                      "%s logit prompt %zu: the device path is not bitwise the CPU's", variants[vi], i);
                        worst_host = fmax(worst_host, max_abs_diff(got, host, n * vocab));
                        worst_emu = fmax(worst_emu, max_abs_diff(got, emu + row * vocab, n * vocab));
                        row += n;
                }
                CHECK(worst_emu <= bound, "%s: max |dlogit| vs the emulation %.3g > %.3g", variants[vi], worst_emu, bound);
                json_t *greedy_all = json_object_get(var, "greedy"), *margins = json_object_get(var, "greedy_margin");
                for (size_t p = 0; p < json_array_size(greedy_all); p++) {
                        json_t *want = json_array_get(greedy_all, p);
                        uint32_t ids[256], toks[64];
                        size_t n = json_ids(json_object_get(json_array_get(prompts, p), "ids"), ids, 256);
                        size_t steps = json_array_size(want) < 64 ? json_array_size(want) : 64;
                        tsr_status st = greedy(md, gpu, ids, n, steps, toks, last, NULL);
                        CHECK(st == TSR_OK, "%s greedy: %s", variants[vi], tsr_status_str(st));
                        for (size_t s = 0; st == TSR_OK && s < steps; s++) {
                                double margin = json_number_value(json_array_get(json_array_get(margins, p), s));
                                if (!devlike && margin < 5e-2)
                                        break;
                                compared++;
                                equal += toks[s] == (uint32_t)json_integer_value(json_array_get(want, s));
                                CHECK(toks[s] == (uint32_t)json_integer_value(json_array_get(want, s)),
                                      "%s prompt %zu greedy step %zu: %u, emulation %lld", variants[vi], p, s, toks[s],
                                      (long long)json_integer_value(json_array_get(want, s)));
                        }
                }
                CHECK(compared > 0, "%s: no greedy step compared", variants[vi]);
                printf("tiny-modelopt %s on %s: max |dlogit| vs the emulation %.3g (bound %.3g), vs the CPU %.3g; greedy "
                       "%zu/%zu tokens equal\n", variants[vi], tsr_backend_name(gpu), worst_emu, bound, worst_host, equal,
                       compared);
                free(emu), free(got), free(host), free(last);
                tsr_llama_free(&md);
                tsr_llama_free(&mh);
        }
        json_decref(g);
}

/* 5: CUDA graphs of decode steps (tsr_llama_set_graphs): the same decode steps on two
 * copies of the model, one eager, one through graphs recorded at start-up for batch sizes
 * {1, 2, 4, 8} (the shortest length class; the runner's reserve first, so that no
 * prefill moves the scratch).  Five sequences with prompts of 3 to 203 tokens in
 * interleaved blocks, then decode steps (the token fed is a fixed function of the
 * sequence and step, so both copies see the same inputs) across block boundaries:
 *   steps 0-19: batches of 4 then 1 sequences (recorded sizes), bitwise the eager step's
 *     logits (attention split over the keys);
 *   step 20: the scratch regrown (tsr_llama_reserve): the graph no longer matches, is
 *     recorded again on the spot, the same bits;
 *   step 21: a block-table width of 1 (the sequences hold 2+ blocks): the step runs
 *     eagerly, the same bits;
 *   steps 22-41: the width back (graphs dropped), batches of 5 then 3 sequences, padded
 *     to 8 and 4 (another matmul height, which cuBLAS may sum in another order; the KV
 *     history differs from here on too): recorded on the first step of each size,
 *     replayed after, within 1e-4 * max |logit| + 1e-5 with the same argmax.
 * cpu-devlike runs the same checks through its reference of the graph contract
 * (kernels/cpu/devlike.c: records replayed through the reference kernels, the same
 * length classes), so CI covers the forward's graph path without a GPU; there the padded
 * steps are bitwise too (the reference is batch-invariant). */
static void graphs(tsr_backend *gpu, const char *path, bool bf16) {
        tsr_llama *mg = load_on(path, gpu, bf16), *me = load_on(path, gpu, bf16);
        tsr_llama_kv *kg = NULL, *ke = NULL;
        enum { NS = 5, BLOCKS = 24, STEPS = 42, LONGEST = 203 };
        CHECK(mg && me, "graphs: models");
        if (!mg || !me || tsr_llama_kv_new(mg, NS * BLOCKS * 16, 16, &kg) != TSR_OK ||
            tsr_llama_kv_new(me, NS * BLOCKS * 16, 16, &ke) != TSR_OK) {
                CHECK(false, "graphs: kv");
                goto out;
        }
        size_t vocab = tsr_llama_config_of(mg)->vocab_size;
        uint32_t sizes[] = {8, 2, 1, 4}, tables[NS][BLOCKS], prompt[NS][LONGEST], next[NS];
        size_t len[NS];
        float *lg = malloc(NS * vocab * sizeof(float)), *le = malloc(NS * vocab * sizeof(float));
        size_t captured = 0;
        tsr_status st = tsr_llama_reserve(mg, 256, 8);
        CHECK(st == TSR_OK, "reserve: %s", tsr_status_str(st));
        st = tsr_llama_set_graphs(mg, sizes, 4, BLOCKS, 4096);
        CHECK(st == TSR_OK, "set_graphs: %s", tsr_status_str(st));
        st = tsr_llama_capture_graphs(mg, gpu, kg, &captured);
        CHECK(st == TSR_OK && captured == 4, "capture: %s, %zu of 4", tsr_status_str(st), captured);
        for (size_t i = 0; i < NS; i++) {
                len[i] = 3 + 50 * i;
                for (size_t b = 0; b < BLOCKS; b++)
                        tables[i][b] = (uint32_t)(b * NS + (NS - 1 - i));
                for (size_t t = 0; t < len[i]; t++)
                        prompt[i][t] = (uint32_t)(1 + (i * 131 + t * 17) % (vocab - 1));
                tsr_llama_seq q = {.block_table = tables[i], .n_table = BLOCKS, .tokens = prompt[i], .n = len[i],
                                   .which = TSR_LLAMA_LOGITS_LAST};
                CHECK(tsr_llama_forward_batch(mg, gpu, kg, &q, 1, lg) == TSR_OK &&
                              tsr_llama_forward_batch(me, gpu, ke, &q, 1, le) == TSR_OK,
                      "prefill %zu", i);
        }
        double worst_padded = 0;
        size_t exact_steps = 0, exact_equal = 0, padded_steps = 0, seen[64] = {1 * 64 + 1, 2 * 64 + 1, 4 * 64 + 1,
                                                                                8 * 64 + 1}, n_seen = 4;
        for (size_t s = 0; s < STEPS; s++) {
                size_t nb = s < 10 ? 4 : s < 20 ? 1 : s < 22 ? 4 : s < 32 ? 5 : 3;
                if (s == 20)
                        CHECK(tsr_llama_reserve(mg, 4096, 64) == TSR_OK, "reserve");
                if (s == 21)
                        CHECK(tsr_llama_set_graphs(mg, sizes, 4, 1, 4096) == TSR_OK, "set_graphs width 1");
                if (s == 22)
                        CHECK(tsr_llama_set_graphs(mg, sizes, 4, BLOCKS, 4096) == TSR_OK, "set_graphs again");
                tsr_llama_graph_stats before, after;
                tsr_llama_graph_stats_of(mg, &before);
                tsr_llama_seq q[NS];
                for (size_t i = 0; i < nb; i++) {
                        next[i] = (uint32_t)(1 + (i * 7 + s * 29) % (vocab - 1));
                        q[i] = (tsr_llama_seq){.block_table = tables[i], .n_table = BLOCKS, .tokens = &next[i], .n = 1,
                                               .past_len = len[i], .which = TSR_LLAMA_LOGITS_LAST};
                }
                st = tsr_llama_forward_batch(mg, gpu, kg, q, nb, lg);
                CHECK(st == TSR_OK, "step %zu graphed: %s", s, tsr_status_str(st));
                st = tsr_llama_forward_batch(me, gpu, ke, q, nb, le);
                CHECK(st == TSR_OK, "step %zu eager: %s", s, tsr_status_str(st));
                for (size_t i = 0; i < nb; i++)
                        len[i]++;
                tsr_llama_graph_stats_of(mg, &after);
                if (s < 22) {
                        exact_steps++;
                        exact_equal += memcmp(lg, le, nb * vocab * sizeof(float)) == 0;
                } else {
                        double d = max_abs_diff(lg, le, nb * vocab), bound = 1e-4 * max_abs(le, nb * vocab) + 1e-5;
                        worst_padded = d > worst_padded ? d : worst_padded;
                        padded_steps++;
                        CHECK(d <= bound, "step %zu (%zu sequences, padded): %.3g > %.3g", s, nb, d, bound);
                        for (size_t i = 0; i < nb; i++)
                                CHECK(argmax(lg + i * vocab, vocab) == argmax(le + i * vocab, vocab),
                                      "step %zu row %zu argmax", s, i);
                }
                /* a step records its graph when its (size, length class) is new since the last
                 * set_graphs (the CUDA backend's class: the key splits of the longest row, one
                 * per 128 keys up to 32; start-up recorded class 1), or the scratch moved */
                size_t size = nb <= 1 ? 1 : nb <= 2 ? 2 : nb <= 4 ? 4 : 8, longest = 0;
                for (size_t i = 0; i < nb; i++)
                        longest = len[i] > longest ? len[i] : longest;    /* len: after the step */
                size_t cls = (longest + 127) / 128 < 32 ? (longest + 127) / 128 : 32, id = size * 64 + cls;
                if (s == 22)
                        n_seen = 0;
                bool recorded = s == 20 || s == 22;
                if (!recorded) {
                        recorded = true;
                        for (size_t j = 0; j < n_seen; j++)
                                recorded &= seen[j] != id;
                }
                if (n_seen < 64 && recorded)
                        seen[n_seen++] = id;
                if (s == 21)    /* set_graphs reset the counts */
                        CHECK(after.eager == 1 && after.replays == 0 && after.captures == 0,
                              "width 1: eager %llu, replays %llu", (unsigned long long)after.eager,
                              (unsigned long long)after.replays);
                else if (s == 22)
                        CHECK(after.captures == 1 && after.replays == 0, "step 22 not recorded on the spot");
                else if (recorded)
                        CHECK(after.captures == before.captures + 1, "step %zu not recorded on the spot", s);
                else
                        CHECK(after.replays == before.replays + 1, "step %zu not replayed", s);
        }
        printf("%s graphs (%s): %zu of %zu decode steps of recorded sizes bitwise the eager ones (re-recorded after "
               "the scratch moved, eager past the table width); %zu padded steps within %.3g\n",
               tsr_backend_name(gpu), bf16 ? "bf16" : "f32", exact_equal, exact_steps, padded_steps, worst_padded);
        CHECK(exact_equal == exact_steps, "%zu of %zu exact-size steps differ", exact_steps - exact_equal,
              exact_steps);
        free(lg);
        free(le);
out:
        tsr_llama_kv_free(&kg);
        tsr_llama_kv_free(&ke);
        tsr_llama_free(&mg);
        tsr_llama_free(&me);
}

/* 4: a larger model, CUDA against the fast CPU backend. */
static void big_model(tsr_backend *gpu, const char *path) {
        tsr_backend *cpu = NULL;
        tsr_cpu_backend_config cc = {.n_threads = 0, .max_isa = TSR_CPU_ISA_AMX_BF16};
        CHECK(tsr_backend_cpu_new(&cc, &cpu) == TSR_OK, "cpu backend");
        for (int bf16 = 0; cpu && bf16 <= 1; bf16++) {
                tsr_llama *mg = load_on(path, gpu, bf16), *mc = load_on(path, cpu, bf16);
                CHECK(mg && mc, "%s %s", path, bf16 ? "bf16" : "f32");
                if (!mg || !mc) {
                        tsr_llama_free(&mg);
                        tsr_llama_free(&mc);
                        continue;
                }
                size_t vocab = tsr_llama_config_of(mg)->vocab_size, n = 96, steps = 24, same = 0;
                uint32_t ids[96], tg[24], tc[24];
                for (size_t i = 0; i < n; i++)
                        ids[i] = (uint32_t)(1 + (i * 7919 + 13) % (vocab - 1));
                float *lg = malloc(vocab * sizeof(float)), *lc = malloc(vocab * sizeof(float));
                double margin[24];
                tsr_status sg = greedy(mg, gpu, ids, n, steps, tg, lg, NULL);
                tsr_status sc = greedy(mc, cpu, ids, n, steps, tc, lc, margin);
                CHECK(sg == TSR_OK && sc == TSR_OK, "greedy: %s / %s", tsr_status_str(sg), tsr_status_str(sc));
                for (size_t s = 0; s < steps; s++) {
                        if (tg[s] != tc[s])
                                break;
                        same++;
                }
                /* the first step's logits are the prompt's last position: compare them */
                float *pg = malloc(vocab * sizeof(float)), *pc = malloc(vocab * sizeof(float));
                tsr_llama_kv *kg = NULL, *kc = NULL;
                CHECK(tsr_llama_kv_new(mg, n, 16, &kg) == TSR_OK && tsr_llama_kv_new(mc, n, 16, &kc) == TSR_OK, "kv");
                CHECK(tsr_llama_forward(mg, gpu, kg, ids, n, 0, TSR_LLAMA_LOGITS_LAST, pg) == TSR_OK &&
                              tsr_llama_forward(mc, cpu, kc, ids, n, 0, TSR_LLAMA_LOGITS_LAST, pc) == TSR_OK,
                      "prefill");
                double d = max_abs_diff(pg, pc, vocab), scale = max_abs(pc, vocab);
                double bound = (bf16 ? 2e-2 : 1e-3) * scale;
                printf("%s %s: last-position max |dlogit| cuda vs %s %.3g (max |logit| %.3g, bound %.3g); greedy "
                       "steps equal before the first difference: %zu of %zu\n", path, bf16 ? "bfloat16" : "float32",
                       tsr_backend_name(cpu), d, scale, bound, same, steps);
                CHECK(d <= bound, "%s: %.3g > %.3g", bf16 ? "bf16" : "f32", d, bound);
                /* float32: equal tokens, unless the CPU's own choice was a near tie (random
                 * weights make small margins; 1e-4 * max |logit| is ~100x the float32 drift) */
                if (!bf16 && same < steps)
                        printf("  first difference at step %zu: cpu's top-2 margin %.3g\n", same, margin[same]);
                if (!bf16)
                        CHECK(same == steps || margin[same] < 1e-4 * scale, "f32 greedy: %zu of %zu steps equal",
                              same, steps);
                tsr_llama_kv_free(&kg);
                tsr_llama_kv_free(&kc);
                free(pg);
                free(pc);
                free(lg);
                free(lc);
                tsr_llama_free(&mg);
                tsr_llama_free(&mc);
        }
        tsr_backend_free(&cpu);
}

/* Every row's argmax equal to the reference's where the reference's top-2 margin exceeds
 * `bound` (elsewhere a tie within rounding may go either way). */
static void argmax_where_clear(const char *what, size_t pi, const float *want, const float *got, size_t rows,
                               size_t vocab, double bound) {
        for (size_t r = 0; r < rows; r++) {
                const float *w = want + r * vocab;
                size_t b1 = argmax(w, vocab);
                float second = -INFINITY;
                for (size_t i = 0; i < vocab; i++)
                        if (i != b1 && w[i] > second)
                                second = w[i];
                if (w[b1] - second > bound)
                        CHECK(argmax(got + r * vocab, vocab) == b1, "%s prompt %zu row %zu: argmax differs", what, pi,
                              r);
        }
}

/* Prompt pi's rows x vocab logits from the device (got) against cpu-ref's (want):
 * cpu-devlike bitwise, else within rel x max |logit| + 1e-4 and, with `argmax`, the same
 * argmax where the reference's margin exceeds that bound; the largest distance into
 * *worst. */
static void device_rows_check(const char *what, size_t pi, const float *want, const float *got, size_t rows,
                              size_t vocab, double rel, bool argmax, bool devlike, double *worst) {
        size_t cnt = rows * vocab;
        double m = max_abs_diff(got, want, cnt), bound = rel * max_abs(want, cnt) + 1e-4;
        *worst = m > *worst ? m : *worst;
        if (devlike) {
                CHECK(memcmp(got, want, cnt * sizeof(float)) == 0, "%s prompt %zu on cpu-devlike: not bitwise (%.3g)",
                      what, pi, m);
                return;
        }
        CHECK(m <= bound, "%s prompt %zu: max |dlogit| %.3g (bound %.3g)", what, pi, m, bound);
        if (argmax)
                argmax_where_clear(what, pi, want, got, rows, vocab, bound);
}

/* A BF16 checkpoint loaded with keep_bf16 (its matmuls and both tables kept as stored),
 * as a float32 model (no use_bf16: lm_head still multiplies as bf16, as stored) and
 * converted: on the device (both tables as their bf16 bytes, the gather widening rows) against
 * the same load on cpu-ref, every position of every golden prompt.  cpu-devlike: bitwise;
 * CUDA: within 1e-3 x max |logit| + 1e-4. */
static void stored_tables(tsr_backend *gpu, tsr_backend *ref, const char *root, bool devlike) {
        char dir[4200];
        json_t *g = fixture_golden(root, "tests/fixtures/tiny-llama3-hf", dir, sizeof dir);
        snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "/bf16");
        const tsr_load_opts keep = {.keep_bf16 = true};
        for (int bf16 = 0; g && bf16 < 2; bf16++) {
                tsr_llama *d = load_opts_on(dir, &keep, gpu, bf16), *h = load_opts_on(dir, &keep, ref, bf16);
                size_t vocab = h ? tsr_llama_config_of(h)->vocab_size : 0;
                float *want = malloc(128 * (vocab + 1) * sizeof(float)), *got = malloc(128 * (vocab + 1) * sizeof(float));
                double worst = 0;
                uint32_t ids[128];
                bool ok = d && h && want && got;
                CHECK(ok, "tiny-llama3-hf/bf16 kept as stored (%s): load", bf16 ? "bf16" : "f32");
                for (size_t pi = 0; ok && pi < json_array_size(json_object_get(g, "prompts")); pi++) {
                        size_t n = json_ids(json_object_get(json_array_get(json_object_get(g, "prompts"), pi), "ids"),
                                            ids, 128);
                        ok = logits_all(h, ref, ids, n, want) == TSR_OK && logits_all(d, gpu, ids, n, got) == TSR_OK;
                        CHECK(ok, "tiny-llama3-hf/bf16 prompt %zu: a forward failed", pi);
                        if (ok)
                                device_rows_check("tiny-llama3-hf/bf16", pi, want, got, n, vocab, 1e-3, false,
                                                  devlike, &worst);
                }
                printf("tiny-llama3-hf/bf16, tables kept as stored, %s on %s: max |dlogit| vs cpu-ref %.3g%s\n",
                       bf16 ? "bf16" : "f32 (lm_head bf16 as stored)", tsr_backend_name(gpu), worst,
                       devlike ? " (bitwise required)" : "");
                tsr_llama_free(&d);
                tsr_llama_free(&h);
                free(want);
                free(got);
        }
        json_decref(g);
}

/* Llama 4 on the device (tsr_llama4_to_backend): tiny-llama4 in float32 and bf16, each
 * golden prompt prefilled whole on the device and on the CPU reference.  cpu-devlike:
 * bitwise.  CUDA: within 1e-3 x max |logit| + 1e-4 (float32; cuBLAS sums in its own
 * order) or 2e-2 x max |logit| (bf16 weights: the bf16-rounded activations may round
 * apart), the same argmax wherever the reference's top-2 margin exceeds the bound; the
 * distances are printed.  The bounds are first estimates: not yet run on a GPU. */
static void llama4_on_device(tsr_backend *gpu, tsr_backend *ref, const char *root, bool devlike) {
        char dir[4200], err[512] = "";
        tsr_llama4_config *c = NULL;
        json_t *g = fixture_golden(root, "tests/fixtures/tiny-llama4", dir, sizeof dir);
        if (!g || tsr_llama4_config_from_hf(dir, &c, err, sizeof err) != TSR_OK) {
                CHECK(0, "%s: %s", dir, err);
                json_decref(g);
                return;
        }
        size_t vocab = c->base.vocab_size, bs = 16, per = 128 / bs;
        tsr_shard_spec whole = {0, 1, 0, c->base.n_layers - 1};
        tsr_kv_group kg = tsr_llama4_kv_group(c);
        uint32_t table[128 / 16], ids[128];
        for (size_t i = 0; i < per; i++)
                table[i] = (uint32_t)i;
        for (int bf16 = 0; bf16 < 2; bf16++) {
                tsr_llama4 *h = NULL, *d = NULL;
                tsr_kv_pool *hp = NULL, *dp = NULL;
                tsr_llama4_kv *hk = NULL, *dk = NULL;
                float *want = malloc(128 * vocab * sizeof(float)), *got = malloc(128 * vocab * sizeof(float));
                double worst = 0;
                bool ok = want && got &&
                          tsr_llama4_load(dir, c, &whole, NULL, NULL, NULL, &h, NULL, err, sizeof err) == TSR_OK &&
                          tsr_llama4_load(dir, c, &whole, NULL, NULL, NULL, &d, NULL, err, sizeof err) == TSR_OK &&
                          (!bf16 || (tsr_llama4_use_bf16(h) == TSR_OK && tsr_llama4_use_bf16(d) == TSR_OK)) &&
                          tsr_llama4_to_backend(d, gpu, err, sizeof err) == TSR_OK;
                CHECK(ok, "tiny-llama4 %s to %s: %s", bf16 ? "bf16" : "f32", tsr_backend_name(gpu), err);
                for (size_t pi = 0; ok && pi < json_array_size(json_object_get(g, "prompts")); pi++) {
                        json_t *a = json_object_get(json_array_get(json_object_get(g, "prompts"), pi), "ids");
                        size_t n = json_array_size(a);
                        for (size_t t = 0; t < n && t < 128; t++)
                                ids[t] = (uint32_t)json_integer_value(json_array_get(a, t));
                        tsr_llama_seq q = {.block_table = table, .n_table = per, .tokens = ids, .n = n,
                                           .which = TSR_LLAMA_LOGITS_ALL};
                        ok = n <= 128 && tsr_kv_pool_new(&kg, 1, per, (uint32_t)bs, &hp) == TSR_OK &&
                             tsr_kv_pool_new_on(gpu, &kg, 1, per, (uint32_t)bs, 0, &dp) == TSR_OK &&
                             tsr_llama4_kv_bind(h, hp, &hk) == TSR_OK && tsr_llama4_kv_bind(d, dp, &dk) == TSR_OK &&
                             tsr_llama4_forward_batch(h, ref, hk, &q, 1, want) == TSR_OK &&
                             tsr_llama4_forward_batch(d, gpu, dk, &q, 1, got) == TSR_OK;
                        CHECK(ok, "tiny-llama4 prompt %zu: a forward failed", pi);
                        if (ok)
                                device_rows_check("tiny-llama4", pi, want, got, n, vocab, bf16 ? 2e-2 : 1e-3, true,
                                                  devlike, &worst);
                        tsr_llama4_kv_free(&hk);
                        tsr_llama4_kv_free(&dk);
                        tsr_kv_pool_free(&hp);
                        tsr_kv_pool_free(&dp);
                }
                printf("tiny-llama4 %s on %s: max |dlogit| vs cpu-ref %.3g%s\n", bf16 ? "bf16" : "f32",
                       tsr_backend_name(gpu), worst, devlike ? " (bitwise required)" : "");
                tsr_llama4_free(&h);
                tsr_llama4_free(&d);
                free(want);
                free(got);
        }
        free(c);
        json_decref(g);
}

/* NemotronH on the device (tsr_nemotron_h_to_backend; the Mamba mixer and ReLU² as
 * backend ops): tests/fixtures/tiny-nemotron-h in float32 and bf16, each golden prompt
 * prefilled whole (its chunks of 8 in the chunked scan on the CPU, by the recurrence on
 * CUDA) then its last 3 tokens decoded one at a time, on the device and on the CPU
 * reference.  cpu-devlike: bitwise.  CUDA: llama4_on_device's bounds and argmax rule.
 * The bounds are first estimates: not yet run on a GPU. */
static void nemotron_h_on_device(tsr_backend *gpu, tsr_backend *ref, const char *root, bool devlike) {
        char dir[4200], err[512] = "";
        json_t *g = fixture_golden(root, "tests/fixtures/tiny-nemotron-h", dir, sizeof dir);
        if (!g)
                return;
        snprintf(dir, sizeof dir, "%s/tests/fixtures/tiny-nemotron-h/model", root);
        uint32_t table[32], ids[128];
        for (size_t i = 0; i < 32; i++)
                table[i] = (uint32_t)i;
        for (int bf16 = 0; bf16 < 2; bf16++) {
                tsr_nemotron_h *h = NULL, *d = NULL;
                double worst = 0;
                bool ok = tsr_nemotron_h_load(dir, NULL, NULL, NULL, NULL, NULL, &h, NULL, err, sizeof err) == TSR_OK &&
                          tsr_nemotron_h_load(dir, NULL, NULL, NULL, NULL, NULL, &d, NULL, err, sizeof err) == TSR_OK &&
                          (!bf16 || (tsr_nemotron_h_use_bf16(h) == TSR_OK && tsr_nemotron_h_use_bf16(d) == TSR_OK)) &&
                          tsr_nemotron_h_to_backend(d, gpu, err, sizeof err) == TSR_OK;
                CHECK(ok, "tiny-nemotron-h %s to %s: %s", bf16 ? "bf16" : "f32", tsr_backend_name(gpu), err);
                const tsr_nemotron_h_config *c = ok ? tsr_nemotron_h_config_of(h) : NULL;
                size_t vocab = c ? c->vocab_size : 0;
                tsr_kv_group kg[TSR_KV_GROUPS_MAX];
                size_t ng = c ? tsr_nemotron_h_kv_groups(c, 0, c->n_layers - 1, 1, kg, TSR_KV_GROUPS_MAX) : 0;
                float *want = malloc(128 * (vocab + 1) * sizeof(float)), *got = malloc(128 * (vocab + 1) * sizeof(float));
                ok = ok && want && got;
                for (size_t pi = 0; ok && pi < json_array_size(json_object_get(g, "prompts")); pi++) {
                        json_t *a = json_object_get(json_array_get(json_object_get(g, "prompts"), pi), "ids");
                        size_t n = json_array_size(a);
                        for (size_t t = 0; t < n && t < 128; t++)
                                ids[t] = (uint32_t)json_integer_value(json_array_get(a, t));
                        tsr_kv_pool *hp = NULL, *dp = NULL;
                        tsr_nemotron_h_cache *hc = NULL, *dc = NULL;
                        ok = n > 3 && n <= 128 && tsr_kv_pool_new_slots(kg, ng, 32, 4, 1, &hp) == TSR_OK &&
                             tsr_kv_pool_new_on(gpu, kg, ng, 32, 4, 1, &dp) == TSR_OK &&
                             tsr_nemotron_h_cache_bind(h, hp, &hc) == TSR_OK &&
                             tsr_nemotron_h_cache_bind(d, dp, &dc) == TSR_OK;
                        /* the prompt but its last 3 tokens, all rows; then those one at a time */
                        size_t rows = 0;
                        for (size_t step = 0; ok && step < 4; step++) {
                                size_t past = step ? n - 4 + step : 0, cnt = step ? 1 : n - 3;
                                tsr_nemotron_h_seq q = {.block_table = table, .n_table = 32, .tokens = ids + past,
                                                        .n = cnt, .past_len = past, .slot = 0,
                                                        .which = step ? TSR_LLAMA_LOGITS_LAST : TSR_LLAMA_LOGITS_ALL,
                                                        .chunked_end = n};
                                ok = tsr_nemotron_h_forward_batch(h, ref, hc, &q, 1, want + rows * vocab) == TSR_OK &&
                                     tsr_nemotron_h_forward_batch(d, gpu, dc, &q, 1, got + rows * vocab) == TSR_OK;
                                rows += step ? 1 : cnt;
                        }
                        CHECK(ok, "tiny-nemotron-h prompt %zu: a forward failed", pi);
                        if (ok)
                                device_rows_check("tiny-nemotron-h", pi, want, got, rows, vocab, bf16 ? 2e-2 : 1e-3,
                                                  true, devlike, &worst);
                        tsr_nemotron_h_cache_free(&hc);
                        tsr_nemotron_h_cache_free(&dc);
                        tsr_kv_pool_free(&hp);
                        tsr_kv_pool_free(&dp);
                }
                printf("tiny-nemotron-h %s on %s: max |dlogit| vs cpu-ref %.3g%s\n", bf16 ? "bf16" : "f32",
                       tsr_backend_name(gpu), worst, devlike ? " (bitwise required)" : "");
                tsr_nemotron_h_free(&h);
                tsr_nemotron_h_free(&d);
                free(want);
                free(got);
        }
        json_decref(g);
}

int main(void) {
        tsr_backend *gpu = NULL, *ref = NULL;
        const char *root = getenv("TSR_SOURCE_ROOT"), *big = getenv("TSR_GPU_MODEL");
        const char *dev = getenv("TSR_TEST_DEVICE");
        bool devlike = dev && strcmp(dev, "cpu-devlike") == 0;
        tsr_status st = devlike ? tsr_backend_cpu_devlike_new(&gpu) : tsr_backend_cuda_new(0, &gpu);

        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND) {
                printf("[skip:no-gpu] %s\n", st == TSR_E_UNSUPPORTED ? "CUDA not built" : "no CUDA device");
                return 77;
        }
        if (st != TSR_OK || tsr_backend_cpu_ref_new(&ref) != TSR_OK || !root) {
                printf("FAIL: backends (%s) or TSR_SOURCE_ROOT unset\n", tsr_status_str(st));
                return 1;
        }
        tiny_fixture(gpu, ref, root);
        char tiny[4200];
        snprintf(tiny, sizeof tiny, "%s/tests/fixtures/tiny-llama3-hf/f32", root);
        graphs(gpu, tiny, false);
        graphs(gpu, tiny, true);
        modelopt(gpu, ref, root, devlike);
        llama4_on_device(gpu, ref, root, devlike);
        nemotron_h_on_device(gpu, ref, root, devlike);
        stored_tables(gpu, ref, root, devlike);
        if (big && *big)
                big_model(gpu, big);
        else
                printf("TSR_GPU_MODEL unset: the larger-model comparison did not run\n");
        tsr_backend_free(&ref);
        tsr_backend_free(&gpu);
        printf("%s (%d failed check%s)\n", failures ? "FAIL" : "OK", failures, failures == 1 ? "" : "s");
        return failures ? 1 : 0;
}
