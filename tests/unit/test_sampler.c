/* worker/sampler: goldens from an independent torch restatement of vLLM's sampler
 * (tests/fixtures/make_sampler_goldens.py), Philox known answers, seeded determinism,
 * the draw's statistics and hand-computed processor/penalty cases. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <cmocka.h>
#include <jansson.h>

#include "worker/engine/sampler.h"

#define GOLDEN_TOL 1e-5

static const tsr_sample_history no_history = {0};

/* Random123's kat_vectors, philox4x32 with 10 rounds: counter, key, expected. */
static void test_philox_known_answers(void **state) {
        static const struct {
                uint32_t ctr[4], key[2], want[4];
        } kat[] = {
                {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
                {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
                 {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
                {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
                 {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
        };
        for (size_t i = 0; i < sizeof(kat) / sizeof(kat[0]); i++) {
                uint32_t out[4];
                tsr_philox4x32_10(kat[i].ctr, kat[i].key, out);
                for (int j = 0; j < 4; j++)
                        assert_int_equal(out[j], kat[i].want[j]);
        }
}

static void test_uniform_streams(void **state) {
        /* Same (key, position): same number.  Different positions or keys: different
         * numbers, all in [0, 1). */
        double seen[2000];
        for (uint64_t p = 0; p < 1000; p++) {
                double u = tsr_sampler_uniform(42, p);
                assert_true(u >= 0.0 && u < 1.0);
                assert_true(u == tsr_sampler_uniform(42, p));
                seen[p] = u;
                seen[1000 + p] = tsr_sampler_uniform(43, p);
        }
        for (int i = 0; i < 2000; i++)
                for (int j = i + 1; j < 2000; j++)
                        assert_true(seen[i] != seen[j]);
        /* The high counter word matters too. */
        assert_true(tsr_sampler_uniform(42, 1) != tsr_sampler_uniform(42, (1ull << 32) | 1));
}

/* ---- goldens ---- */

static char *read_all(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        char *buf = NULL;
        long n;

        if (!f)
                return NULL;
        if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
                buf = malloc((size_t)n + 1);
                if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
                        free(buf);
                        buf = NULL;
                }
                if (buf) {
                        buf[n] = 0;
                        *len = (size_t)n;
                }
        }
        fclose(f);
        return buf;
}

static float jf(json_t *o, const char *key, float dflt) {
        json_t *v = json_object_get(o, key);
        return v ? (float)json_number_value(v) : dflt;
}

static uint32_t *ju32_array(json_t *a, size_t *n) {
        uint32_t *ids;

        *n = a ? json_array_size(a) : 0;
        ids = calloc(*n ? *n : 1, sizeof(*ids));
        assert_non_null(ids);
        for (size_t i = 0; i < *n; i++)
                ids[i] = (uint32_t)json_integer_value(json_array_get(a, i));
        return ids;
}

static void test_goldens(void **state) {
        const char *root = getenv("TSR_SOURCE_ROOT");
        char path[4096];
        size_t len, vocab, rows, n_cases;
        char *text, *raw;
        json_t *doc, *cases;
        json_error_t jerr;
        float *scratch, *probs;
        double qscale, worst = 0.0;

        if (!root)
                root = ".";
        snprintf(path, sizeof(path), "%s/tests/fixtures/sampler/cases.json", root);
        text = read_all(path, &len);
        assert_non_null(text);
        doc = json_loads(text, 0, &jerr);
        free(text);
        assert_non_null(doc);
        vocab = (size_t)json_integer_value(json_object_get(doc, "vocab"));
        rows = (size_t)json_integer_value(json_object_get(doc, "rows"));
        qscale = json_number_value(json_object_get(doc, "qscale"));
        cases = json_object_get(doc, "cases");
        n_cases = json_array_size(cases);
        assert_true(vocab > 0 && rows > 0 && n_cases >= 100);

        snprintf(path, sizeof(path), "%s/tests/fixtures/sampler/logits.f32", root);
        raw = read_all(path, &len);
        assert_non_null(raw);
        assert_int_equal(len, rows * vocab * sizeof(float));
        scratch = malloc(TSR_SAMPLER_SCRATCH(vocab) * sizeof(float));
        probs = malloc(vocab * sizeof(float));
        assert_non_null(scratch);
        assert_non_null(probs);

        for (size_t ci = 0; ci < n_cases; ci++) {
                json_t *c = json_array_get(cases, ci), *p = json_object_get(c, "params");
                json_t *jb = json_object_get(p, "bias"), *jq = json_object_get(c, "q");
                json_t *jids = json_object_get(c, "ids"), *jlp = json_object_get(c, "logprobs");
                const float *logits = (const float *)raw + (size_t)json_integer_value(json_object_get(c, "row")) * vocab;
                tsr_sampling s;
                tsr_sample_history h;
                tsr_logit_bias bias[16];
                tsr_token_logprobs lp;
                tsr_sample_result res;
                size_t n_eos, n_stop, n_allowed, n_prompt, n_output, nz = 0;
                uint32_t *eos, *stop, *allowed, *prompt, *output, greedy;
                double maxdiff = 0.0;

                tsr_sampling_init(&s);
                s.temperature = jf(p, "temperature", 1.0f);
                s.top_p = jf(p, "top_p", 1.0f);
                s.min_p = jf(p, "min_p", 0.0f);
                s.repetition_penalty = jf(p, "rep", 1.0f);
                s.presence_penalty = jf(p, "pres", 0.0f);
                s.frequency_penalty = jf(p, "freq", 0.0f);
                s.top_k = (int32_t)json_integer_value(json_object_get(p, "top_k"));
                s.min_tokens = (uint32_t)json_integer_value(json_object_get(p, "min_tokens"));
                eos = ju32_array(json_object_get(p, "eos"), &n_eos);
                stop = ju32_array(json_object_get(p, "stop"), &n_stop);
                allowed = ju32_array(json_object_get(p, "allowed"), &n_allowed);
                prompt = ju32_array(json_object_get(c, "prompt"), &n_prompt);
                output = ju32_array(json_object_get(c, "output"), &n_output);
                s.eos_ids = eos;
                s.n_eos = n_eos;
                s.stop_ids = stop;
                s.n_stop = n_stop;
                s.allowed_ids = allowed;
                s.n_allowed = n_allowed;
                assert_true(json_array_size(jb) <= 16);
                for (size_t i = 0; i < json_array_size(jb); i++) {
                        bias[i].id = (uint32_t)json_integer_value(json_array_get(json_array_get(jb, i), 0));
                        bias[i].bias = (float)json_number_value(json_array_get(json_array_get(jb, i), 1));
                }
                s.bias = bias;
                s.n_bias = json_array_size(jb);
                h = (tsr_sample_history){prompt, n_prompt, output, n_output};

                assert_int_equal(tsr_sampler_probs(&s, &h, logits, vocab, scratch, probs, &greedy), TSR_OK);
                if (greedy != (uint32_t)json_integer_value(json_object_get(c, "greedy")))
                        fail_msg("case %zu: greedy %u, golden %lld", ci, greedy,
                                 (long long)json_integer_value(json_object_get(c, "greedy")));
                for (size_t i = 0; i < vocab; i++)
                        nz += probs[i] > 0.0f;
                if (nz != (size_t)json_integer_value(json_object_get(c, "n_nonzero")))
                        fail_msg("case %zu: %zu nonzero probs, golden %lld", ci, nz,
                                 (long long)json_integer_value(json_object_get(c, "n_nonzero")));
                if (jids) {
                        /* Sparse: the listed ids carry every nonzero prob. */
                        for (size_t i = 0; i < json_array_size(jids); i++) {
                                size_t id = (size_t)json_integer_value(json_array_get(jids, i));
                                double want = (double)json_integer_value(json_array_get(jq, i)) / qscale;
                                assert_true(id < vocab);
                                assert_true(probs[id] > 0.0f);
                                maxdiff = fmax(maxdiff, fabs((double)probs[id] - want));
                        }
                } else {
                        assert_int_equal(json_array_size(jq), vocab);
                        for (size_t i = 0; i < vocab; i++)
                                maxdiff = fmax(maxdiff, fabs((double)probs[i] -
                                                (double)json_integer_value(json_array_get(jq, i)) / qscale));
                }
                if (maxdiff > GOLDEN_TOL)
                        fail_msg("case %zu: max |dp| %.3g", ci, maxdiff);
                worst = fmax(worst, maxdiff);

                /* The sampled token is one the distribution allows. */
                s.logprobs = 5;
                assert_int_equal(tsr_sample(&s, &h, 1000 + ci, logits, vocab, scratch, &res), TSR_OK);
                assert_true(probs[res.token] > 0.0f);
                if (s.temperature < TSR_SAMPLER_GREEDY_EPS)
                        assert_int_equal(res.token, greedy);
                assert_true(res.has_logprobs);
                assert_int_equal(res.lp.token, res.token);
                assert_int_equal(res.lp.n_top, 5);

                /* Raw logprobs of the golden's token. */
                {
                        uint32_t tok = (uint32_t)json_integer_value(json_object_get(jlp, "token"));
                        json_t *top = json_object_get(jlp, "top");
                        assert_int_equal(tsr_logprobs_gather(logits, vocab, tok, 5, &lp), TSR_OK);
                        assert_true(fabs(lp.logprob - json_number_value(json_object_get(jlp, "logprob"))) <= GOLDEN_TOL);
                        assert_int_equal(lp.rank, json_integer_value(json_object_get(jlp, "rank")));
                        assert_int_equal(lp.n_top, json_array_size(top));
                        for (size_t i = 0; i < lp.n_top; i++) {
                                json_t *e = json_array_get(top, i);
                                assert_int_equal(lp.top_ids[i], json_integer_value(json_array_get(e, 0)));
                                assert_true(fabs(lp.top_logprobs[i] - json_number_value(json_array_get(e, 1))) <= GOLDEN_TOL);
                        }
                        /* Same values as the sampled token's, from the same row. */
                        for (size_t i = 0; i < lp.n_top; i++) {
                                assert_int_equal(lp.top_ids[i], res.lp.top_ids[i]);
                                assert_true(lp.top_logprobs[i] == res.lp.top_logprobs[i]);
                        }
                }
                free(eos);
                free(stop);
                free(allowed);
                free(prompt);
                free(output);
        }
        print_message("sampler goldens: %zu cases, worst max |dp| %.3g\n", n_cases, worst);
        free(scratch);
        free(probs);
        free(raw);
        json_decref(doc);
}

/* ---- hand-made cases ---- */

/* A row whose sampling needs only temperature, top_k, top_p and min_p gets from
 * tsr_sample_uniform_given, with the uniform of its key and position, tsr_sample's
 * token (a multi-node replica's last node samples so for node 0); parameters it does
 * not serve are refused. */
/* n logits in [-5, 5) from the LCG state *x. */
static void random_row(float *logits, size_t n, uint64_t *x) {
        for (size_t i = 0; i < n; i++) {
                *x = *x * 6364136223846793005ull + 1442695040888963407ull;
                logits[i] = (float)((*x >> 40) % 2000) / 200.0f - 5.0f;
        }
}

/* sp's lists: allowed ids and a bias (each NULL: none), one EOS id and two stop ids. */
static void set_lists(tsr_sampling *sp, const uint32_t *allowed, size_t n_allowed, const tsr_logit_bias *bias,
                      size_t n_bias, const uint32_t eos[1], const uint32_t stop[2]) {
        sp->allowed_ids = allowed;
        sp->n_allowed = allowed ? n_allowed : 0;
        sp->bias = bias;
        sp->n_bias = bias ? n_bias : 0;
        sp->eos_ids = eos;
        sp->n_eos = 1;
        sp->stop_ids = stop;
        sp->n_stop = 2;
}

/* The request's rules as a multi-node replica's last node gets them (nodes.c): allowed
 * ids, a logit bias and, at a position below min_tokens, the EOS and stop ids given as
 * EOS ids with min_tokens 1 (n_output 0 there), or with penalties the history too (then
 * min_tokens n_output + 1): tsr_sample_uniform_given's token is tsr_sample's at that
 * position with the request's own sampling and history, greedy and drawn, and the rules
 * do change tokens. */
static void test_uniform_given_with_rules(void **state) {
        (void)state;
        enum { V = 300 };
        float logits[V], *scratch = malloc(TSR_SAMPLER_SCRATCH(V) * sizeof(float));
        const uint32_t allowed[] = {3, 17, 42, 43, 44, 250, 299}, eos[] = {42}, stop[] = {250, 3};
        const tsr_logit_bias bias[] = {{.id = 17, .bias = 3.5f}, {.id = 250, .bias = -2.0f}, {.id = 5, .bias = 9.0f}};
        uint32_t out[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        uint64_t x = 777;
        size_t changed = 0, masked_pos = 0;
        const uint32_t prompt[5] = {17, 17, 42, 9, 250};
        for (int c = 0; c < 9; c++)
                for (size_t pos = 0; pos < 8; pos++) {
                        random_row(logits, V, &x);
                        tsr_sampling sp;
                        tsr_sampling_init(&sp);
                        sp.temperature = c % 2 ? 0.8f : 0.0f;
                        sp.top_k = c == 3 ? 4 : 0;
                        sp.top_p = c == 5 ? 0.9f : 1.0f;
                        set_lists(&sp, c < 2 || c == 4 ? allowed : NULL, sizeof allowed / sizeof allowed[0],
                                  c >= 2 ? bias : NULL, sizeof bias / sizeof bias[0], eos, stop);
                        sp.min_tokens = 4;
                        sp.presence_penalty = c == 6 ? 0.5f : 0.0f;
                        sp.frequency_penalty = c == 7 ? 0.3f : 0.0f;
                        sp.repetition_penalty = c == 8 ? 1.2f : 1.0f;
                        tsr_sample_history h = {.prompt = prompt, .n_prompt = 5, .output = out, .n_output = pos};
                        uint64_t key = 0xabcdef12345ull * (uint64_t)(c + 1);
                        tsr_sample_result want, plain;
                        assert_int_equal(tsr_sample(&sp, &h, key, logits, V, scratch, &want), TSR_OK);
                        /* the last node's sampling: the lists, the mask as EOS ids */
                        const uint32_t masked[] = {42, 250, 3};
                        tsr_sampling last = sp;
                        bool below = pos < sp.min_tokens;
                        last.eos_ids = below ? masked : NULL;
                        last.n_eos = below ? 3 : 0;
                        last.stop_ids = NULL;
                        last.n_stop = 0;
                        last.min_tokens = below ? 1 : 0;
                        masked_pos += below;
                        uint32_t got;
                        /* with penalties the history goes too, and min_tokens counts from it */
                        const tsr_sample_history *lh = tsr_sampling_history_free(&sp) ? NULL : &h;
                        if (lh)
                                last.min_tokens = below ? (uint32_t)pos + 1 : 0;
                        assert_int_equal(tsr_sample_uniform_given(&last, lh, tsr_sampler_uniform(key, pos), logits,
                                                                  V, scratch, &got), TSR_OK);
                        assert_int_equal(got, want.token);
                        if (c >= 6)
                                continue;
                        tsr_sampling none;
                        tsr_sampling_init(&none);
                        none.temperature = sp.temperature;
                        none.top_k = sp.top_k;
                        none.top_p = sp.top_p;
                        assert_int_equal(tsr_sample(&none, &h, key, logits, V, scratch, &plain), TSR_OK);
                        changed += plain.token != want.token;
                }
        assert_true(changed > 20);
        assert_int_equal(masked_pos, 9 * 4);
        free(scratch);
}

/* A device's answer to a request with rules (worker/model/answer.c): tsr_sampling_rules'
 * lists through the reference backend's tsr_backend_logit_rules, then its argmax, give
 * tsr_sample's greedy token at every position (allowed ids, min_tokens' mask, a bias
 * with a repeated id, each penalty alone and all three, over a history with repeats and
 * prompt-only tokens), and the rules change tokens; the backend's logprobs of the raw
 * row are tsr_logprobs_gather's (rank and top ids equal, values within 1e-5: the two
 * sum the exponentials differently). */
static void test_rules_on_a_device(void **state) {
        (void)state;
        enum { V = 300 };
        float logits[V], row[V], *scratch = malloc(TSR_SAMPLER_SCRATCH(V) * sizeof(float));
        const uint32_t allowed[] = {3, 17, 42, 43, 44, 250, 299, 17}, eos[] = {42}, stop[] = {250, 3};
        const tsr_logit_bias bias[] = {{17, 3.5f}, {250, -2.0f}, {5, 9.0f}, {17, 0.25f}};
        const uint32_t prompt[6] = {17, 17, 42, 9, 250, 6};
        uint32_t out[12] = {6, 2, 3, 2, 5, 6, 2, 8, 9, 2, 17, 1};
        uint64_t x = 4242;
        size_t changed = 0;
        tsr_backend *be = NULL;
        assert_int_equal(tsr_backend_cpu_ref_new(&be), TSR_OK);
        for (int c = 0; c < 8; c++)
                for (size_t pos = 0; pos <= 12; pos++) {
                        random_row(logits, V, &x);
                        tsr_sampling sp;
                        tsr_sampling_init(&sp);
                        sp.temperature = 0.0f;
                        set_lists(&sp, c == 0 || c == 7 ? allowed : NULL, sizeof allowed / sizeof allowed[0],
                                  c >= 1 ? bias : NULL, sizeof bias / sizeof bias[0], eos, stop);
                        sp.min_tokens = c == 2 || c == 7 ? 5 : 0;
                        sp.presence_penalty = c == 3 || c >= 6 ? 1.5f : 0.0f;
                        sp.frequency_penalty = c == 4 || c >= 6 ? 0.8f : 0.0f;
                        sp.repetition_penalty = c == 5 || c >= 6 ? 1.7f : 1.0f;
                        tsr_sample_history h = {.prompt = prompt, .n_prompt = 6, .output = out, .n_output = pos};
                        tsr_sample_result want, plain;
                        assert_int_equal(tsr_sample(&sp, &h, 1, logits, V, scratch, &want), TSR_OK);
                        uint32_t buf[96];
                        assert_true(tsr_sampling_rules_words(&sp, 18) <= 96);
                        tsr_logit_rules q;
                        assert_int_equal(tsr_sampling_rules(&sp, &h, pos < sp.min_tokens, V, buf, &q), TSR_OK);
                        memcpy(row, logits, sizeof row);
                        uint32_t got;
                        assert_int_equal(tsr_backend_logit_rules(be, row, 1, V, &q), TSR_OK);
                        assert_int_equal(tsr_backend_argmax(be, &got, row, 1, V), TSR_OK);
                        assert_int_equal(got, want.token);
                        /* the whole processed row: the sampler's distribution at temperature
                         * 1 is its softmax (the masked entries 0) */
                        tsr_sampling warm = sp;
                        warm.temperature = 1.0f;
                        float probs[V];
                        double mx = -INFINITY, z = 0.0;
                        assert_int_equal(tsr_sampler_probs(&warm, &h, logits, V, scratch, probs, NULL), TSR_OK);
                        for (size_t i = 0; i < V; i++)
                                mx = row[i] > mx ? row[i] : mx;
                        for (size_t i = 0; i < V; i++)
                                z += exp((double)row[i] - mx);
                        for (size_t i = 0; i < V; i++)
                                assert_true(fabs(exp((double)row[i] - mx) / z - probs[i]) <= 1e-6);
                        tsr_sampling none;
                        tsr_sampling_init(&none);
                        none.temperature = 0.0f;
                        assert_int_equal(tsr_sample(&none, &h, 1, logits, V, scratch, &plain), TSR_OK);
                        changed += plain.token != want.token;
                        /* the logprobs of the raw row, as the engine's */
                        uint32_t top = 5;
                        tsr_row_logprobs lp;
                        tsr_token_logprobs wl;
                        assert_int_equal(tsr_backend_logprobs(be, &lp, logits, 1, V, &got, &top), TSR_OK);
                        assert_int_equal(tsr_logprobs_gather(logits, V, got, top, &wl), TSR_OK);
                        assert_int_equal(lp.rank, wl.rank);
                        assert_true(fabsf(lp.logprob - wl.logprob) <= 1e-5f);
                        for (uint32_t k = 0; k < top; k++) {
                                assert_int_equal(lp.top_ids[k], wl.top_ids[k]);
                                assert_true(fabsf(lp.top_logprobs[k] - wl.top_logprobs[k]) <= 1e-5f);
                        }
                }
        assert_true(changed > 40);
        /* penalties without a history, an id past the vocabulary: refused */
        tsr_sampling sp;
        tsr_sampling_init(&sp);
        sp.presence_penalty = 1.0f;
        uint32_t buf[8];
        tsr_logit_rules q;
        assert_int_equal(tsr_sampling_rules(&sp, NULL, false, V, buf, &q), TSR_E_INVAL);
        const uint32_t far[1] = {V};
        tsr_sample_history h = {.prompt = far, .n_prompt = 1};
        assert_int_equal(tsr_sampling_rules(&sp, &h, false, V, buf, &q), TSR_E_INVAL);
        tsr_backend_free(&be);
        free(scratch);
}

static void test_uniform_given_matches_tsr_sample(void **state) {
        (void)state;
        enum { V = 300 };
        float logits[V], *scratch = malloc(TSR_SAMPLER_SCRATCH(V) * sizeof(float));
        const struct { float t; int32_t k; float p, min_p; } params[] = {
                {0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f}, {0.7f, 20, 1.0f, 0.0f}, {1.3f, 0, 0.9f, 0.0f},
                {0.8f, 0, 1.0f, 0.05f}, {0.5f, 5, 0.8f, 0.1f},
        };
        uint64_t x = 12345;
        size_t drawn_differently = 0;
        for (size_t c = 0; c < sizeof params / sizeof params[0]; c++)
                for (uint64_t pos = 0; pos < 40; pos++) {
                        random_row(logits, V, &x);
                        tsr_sampling sp;
                        tsr_sampling_init(&sp);
                        sp.temperature = params[c].t;
                        sp.top_k = params[c].k;
                        sp.top_p = params[c].p;
                        sp.min_p = params[c].min_p;
                        uint32_t out[4] = {0};
                        tsr_sample_history h = {.output = out, .n_output = pos < 4 ? pos : 4};
                        uint64_t key = 0x9e3779b97f4a7c15ull * (c + 1);
                        tsr_sample_result want;
                        uint32_t got, other;
                        assert_int_equal(tsr_sample(&sp, &h, key, logits, V, scratch, &want), TSR_OK);
                        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, tsr_sampler_uniform(key, h.n_output),
                                                                  logits, V, scratch, &got), TSR_OK);
                        assert_int_equal(got, want.token);
                        /* another position's uniform draws another token often enough */
                        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, tsr_sampler_uniform(key, h.n_output + 1),
                                                                  logits, V, scratch, &other), TSR_OK);
                        drawn_differently += other != got;
                }
        assert_true(drawn_differently > 20);
        tsr_sampling sp;
        tsr_sampling_init(&sp);
        uint32_t tok;
        sp.logprobs = 1;
        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, 0.5, logits, V, scratch, &tok), TSR_E_INVAL);
        tsr_sampling_init(&sp);
        sp.presence_penalty = 0.5f;
        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, 0.5, logits, V, scratch, &tok), TSR_E_INVAL);
        tsr_sampling_init(&sp);
        sp.repetition_penalty = 1.1f;   /* penalties need the history: refused */
        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, 0.5, logits, V, scratch, &tok), TSR_E_INVAL);
        tsr_sampling_init(&sp);
        logits[7] = NAN;
        assert_int_equal(tsr_sample_uniform_given(&sp, NULL, 0.5, logits, V, scratch, &tok), TSR_E_INVAL);
        free(scratch);
}

static void test_seeded_determinism(void **state) {
        enum { V = 64, STEPS = 200 };
        float logits[V], scratch[3 * V], other[V];
        uint32_t out[STEPS] = {0};
        tsr_sampling s;
        tsr_sample_result r1, r2;
        int differ = 0;

        for (int i = 0; i < V; i++) {
                logits[i] = sinf((float)i * 0.37f) * 2.0f;
                other[i] = cosf((float)i * 1.3f);
        }
        tsr_sampling_init(&s);
        s.temperature = 1.0f;
        for (int step = 0; step < STEPS; step++) {
                tsr_sample_history h = {NULL, 0, out, (size_t)step};
                assert_int_equal(tsr_sample(&s, &h, 0x1234, logits, V, scratch, &r1), TSR_OK);
                /* Something else sampled in between ("another sequence in the batch")
                 * changes nothing: the sampler has no state. */
                assert_int_equal(tsr_sample(&s, &no_history, 0x9999, other, V, scratch, &r2), TSR_OK);
                assert_int_equal(tsr_sample(&s, &h, 0x1234, logits, V, scratch, &r2), TSR_OK);
                assert_int_equal(r1.token, r2.token);
                out[step] = r1.token;
        }
        /* Replay from scratch (a preempted and recomputed sequence) gives the same tokens;
         * a different key gives a different stream. */
        for (int step = 0; step < STEPS; step++) {
                tsr_sample_history h = {NULL, 0, out, (size_t)step};
                assert_int_equal(tsr_sample(&s, &h, 0x1234, logits, V, scratch, &r1), TSR_OK);
                assert_int_equal(r1.token, out[step]);
                assert_int_equal(tsr_sample(&s, &h, 0x1235, logits, V, scratch, &r2), TSR_OK);
                differ += r2.token != out[step];
        }
        assert_true(differ > STEPS / 2);
        /* Different positions: not a constant stream. */
        differ = 0;
        for (int step = 1; step < STEPS; step++)
                differ += out[step] != out[0];
        assert_true(differ > STEPS / 2);
}

static void test_draw_statistics(void **state) {
        enum { V = 5, N = 20000 };
        static const double p[V] = {0.1, 0.2, 0.3, 0.15, 0.25};
        float logits[V], scratch[3 * V];
        uint32_t *hist = calloc(N, sizeof(uint32_t));
        unsigned count[V] = {0}, count_k[V] = {0};
        tsr_sampling s, sk;
        tsr_sample_result r;

        assert_non_null(hist);
        for (int i = 0; i < V; i++)
                logits[i] = (float)log(p[i]) + 3.0f;     /* a shift changes nothing */
        tsr_sampling_init(&s);
        sk = s;
        sk.top_k = 2;                                     /* keeps ids 2 and 4: 0.3 / 0.25 */
        for (size_t i = 0; i < N; i++) {
                tsr_sample_history h = {NULL, 0, hist, i};
                assert_int_equal(tsr_sample(&s, &h, 7, logits, V, scratch, &r), TSR_OK);
                count[r.token]++;
                assert_int_equal(tsr_sample(&sk, &h, 7, logits, V, scratch, &r), TSR_OK);
                count_k[r.token]++;
        }
        for (int i = 0; i < V; i++) {
                double sigma = sqrt(N * p[i] * (1 - p[i]));
                if (fabs(count[i] - N * p[i]) > 3 * sigma)
                        fail_msg("token %d: %u draws, expected %.0f +- %.0f", i, count[i], N * p[i], 3 * sigma);
        }
        assert_int_equal(count_k[0] + count_k[1] + count_k[3], 0);
        {
                double q = 0.3 / 0.55, sigma = sqrt(N * q * (1 - q));
                assert_true(fabs(count_k[2] - N * q) <= 3 * sigma);
        }
        free(hist);
}

static void test_greedy_ties_lowest_id(void **state) {
        float logits[6] = {1.0f, 3.0f, -2.0f, 3.0f, 2.5f, 3.0f}, scratch[18], probs[6];
        tsr_sampling s;
        tsr_sample_result r;
        uint32_t g;

        tsr_sampling_init(&s);
        s.temperature = 0.0f;
        assert_int_equal(tsr_sample(&s, &no_history, 0, logits, 6, scratch, &r), TSR_OK);
        assert_int_equal(r.token, 1);
        /* Greedy's distribution is one-hot at that token. */
        assert_int_equal(tsr_sampler_probs(&s, &no_history, logits, 6, scratch, probs, &g), TSR_OK);
        assert_int_equal(g, 1);
        for (int i = 0; i < 6; i++)
                assert_true(probs[i] == (i == 1 ? 1.0f : 0.0f));
        /* Below the epsilon is greedy too, whatever the key. */
        s.temperature = 5e-6f;
        assert_int_equal(tsr_sample(&s, &no_history, 99, logits, 6, scratch, &r), TSR_OK);
        assert_int_equal(r.token, 1);
}

/* Plain greedy (tsr_sampling_plain_argmax: the one-pass path) gives what the full
 * pipeline gives when a no-op processor forces it (a logit bias of +0 on id 0): the same
 * status and token over random rows with ties, -inf entries, a NaN, a +inf and a row of
 * only -inf; and what tsr_sampling_plain_argmax says matches the processors that are set. */
static void test_plain_greedy_is_the_pipeline(void **state) {
        enum { V = 37, ROWS = 200 };
        float x[V], scratch[3 * V];
        uint32_t seed = 12345, hist[3] = {4, 5, 6};
        tsr_sample_history h = {.prompt = hist, .n_prompt = 2, .output = hist + 2, .n_output = 1};
        tsr_logit_bias nop = {.id = 0, .bias = 0.0f};
        tsr_sampling plain, forced;
        (void)state;
        tsr_sampling_init(&plain);
        plain.temperature = 0.0f;
        forced = plain;
        forced.bias = &nop;
        forced.n_bias = 1;
        assert_true(tsr_sampling_plain_argmax(&plain, 1));
        assert_false(tsr_sampling_plain_argmax(&forced, 1));
        for (int r = 0; r < ROWS; r++) {
                for (int i = 0; i < V; i++) {
                        seed = seed * 1103515245u + 12345u;
                        x[i] = (float)((seed >> 16) % 7) - 3.0f;   /* few values: many ties */
                        if ((seed >> 8) % 11 == 0)
                                x[i] = -INFINITY;
                }
                if (r == 10)
                        x[seed % V] = NAN;
                if (r == 11)
                        x[seed % V] = INFINITY;
                if (r == 12)
                        for (int i = 0; i < V; i++)
                                x[i] = -INFINITY;
                tsr_sample_result a = {0}, b = {0};
                tsr_status sa = tsr_sample(&plain, &h, 7, x, V, scratch, &a);
                tsr_status sb = tsr_sample(&forced, &h, 7, x, V, scratch, &b);
                assert_int_equal(sa, sb);
                assert_int_equal(sa, r >= 10 && r <= 12 ? TSR_E_INVAL : TSR_OK);
                if (sa == TSR_OK) {
                        assert_int_equal(a.token, b.token);
                        assert_false(a.has_logprobs);
                }
        }
        /* anything that can move the maximum or asks for more takes the full pipeline */
        tsr_sampling t = plain;
        t.logprobs = 0;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.repetition_penalty = 1.1f;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.presence_penalty = 0.5f;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.frequency_penalty = 0.5f;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.allowed_ids = hist, t.n_allowed = 1;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.temperature = 0.5f;
        assert_false(tsr_sampling_plain_argmax(&t, 1));
        t = plain, t.min_tokens = 3, t.eos_ids = hist, t.n_eos = 1;
        assert_false(tsr_sampling_plain_argmax(&t, 1));   /* the EOS mask is on until 3 tokens */
        assert_true(tsr_sampling_plain_argmax(&t, 3));
        t.n_eos = 0;                                        /* nothing to mask: plain again */
        assert_true(tsr_sampling_plain_argmax(&t, 1));
        /* NULL scratch is refused on both paths, as the header says */
        tsr_sample_result c;
        assert_int_equal(tsr_sample(&plain, &h, 7, x, V, NULL, &c), TSR_E_INVAL);
}

static void test_min_tokens(void **state) {
        float logits[8] = {0, 1, 9, 2, 8, 3, 0, 0}, scratch[24];
        uint32_t eos = 2, stop = 4, out[4] = {1, 1, 1, 1};
        tsr_sampling s;
        tsr_sample_result r;

        tsr_sampling_init(&s);
        s.temperature = 0.0f;
        s.min_tokens = 3;
        s.eos_ids = &eos;
        s.n_eos = 1;
        s.stop_ids = &stop;
        s.n_stop = 1;
        for (size_t n = 0; n <= 4; n++) {
                tsr_sample_history h = {NULL, 0, out, n};
                assert_int_equal(tsr_sample(&s, &h, 0, logits, 8, scratch, &r), TSR_OK);
                /* Masked while n_output < min_tokens: EOS (9) and the stop id (8) lose to 5. */
                assert_int_equal(r.token, n < 3 ? 5 : 2);
        }
        /* Sampling with temperature never yields a masked id either. */
        s.temperature = 1.0f;
        for (size_t k = 0; k < 500; k++) {
                tsr_sample_history h = {NULL, 0, out, 2};
                assert_int_equal(tsr_sample(&s, &h, k, logits, 8, scratch, &r), TSR_OK);
                assert_true(r.token != 2 && r.token != 4);
        }
}

static void test_logit_bias_and_allowed(void **state) {
        float logits[5] = {1, 2, 3, 4, 5}, scratch[15], probs[5];
        tsr_logit_bias b[2] = {{0, 10.0f}, {4, -100.0f}};
        uint32_t allowed[2] = {1, 3}, g;
        tsr_sampling s;
        tsr_sample_result r;

        tsr_sampling_init(&s);
        s.temperature = 0.0f;
        s.bias = b;
        s.n_bias = 2;
        assert_int_equal(tsr_sample(&s, &no_history, 0, logits, 5, scratch, &r), TSR_OK);
        assert_int_equal(r.token, 0);                   /* 1 + 10 beats 5 - 100 */
        /* allowed_token_ids first, then the bias on what is left. */
        s.allowed_ids = allowed;
        s.n_allowed = 2;
        s.temperature = 1.0f;
        assert_int_equal(tsr_sampler_probs(&s, &no_history, logits, 5, scratch, probs, &g), TSR_OK);
        assert_int_equal(g, 3);
        assert_true(probs[0] == 0.0f && probs[2] == 0.0f && probs[4] == 0.0f);
        assert_true(fabs(probs[3] - 1.0 / (1.0 + exp(-2.0))) < 1e-6);
}

static void test_penalties_by_hand(void **state) {
        /* prompt {0, 1}, output {3, 3, 2}; repetition 2, frequency 0.5, presence 0.25:
         *   t0 prompt, 2 > 0:        2 / 2                     =  1
         *   t1 prompt, -1 <= 0:     -1 * 2                     = -2
         *   t2 out x1:  0.5 / 2 - 0.5 * 1 - 0.25                = -0.5
         *   t3 out x2:  3 / 2 - 0.5 * 2 - 0.25                  =  0.25
         *   t4 unseen:                                          =  1
         * Greedy is 0 (tied with 4 at 1.0, lower id wins). */
        float logits[5] = {2.0f, -1.0f, 0.5f, 3.0f, 1.0f}, scratch[15], probs[5];
        static const double want[5] = {1.0, -2.0, -0.5, 0.25, 1.0};
        uint32_t prompt[2] = {0, 1}, output[3] = {3, 3, 2}, g;
        tsr_sample_history h = {prompt, 2, output, 3};
        tsr_sampling s;
        double z = 0.0;

        tsr_sampling_init(&s);
        s.repetition_penalty = 2.0f;
        s.frequency_penalty = 0.5f;
        s.presence_penalty = 0.25f;
        assert_int_equal(tsr_sampler_probs(&s, &h, logits, 5, scratch, probs, &g), TSR_OK);
        assert_int_equal(g, 0);
        for (int i = 0; i < 5; i++)
                z += exp(want[i]);
        for (int i = 0; i < 5; i++)
                assert_true(fabs(probs[i] - exp(want[i]) / z) < 1e-6);
        /* The penalties leave the caller's logits alone. */
        assert_true(logits[0] == 2.0f && logits[3] == 3.0f);
}

static void test_top_p_keeps_one(void **state) {
        float logits[4] = {0.0f, 0.1f, 0.2f, 0.05f}, scratch[12], probs[4];
        tsr_sampling s;
        uint32_t g;

        tsr_sampling_init(&s);
        s.top_p = 1e-6f;
        assert_int_equal(tsr_sampler_probs(&s, &no_history, logits, 4, scratch, probs, &g), TSR_OK);
        assert_true(probs[2] == 1.0f);
        assert_true(probs[0] == 0.0f && probs[1] == 0.0f && probs[3] == 0.0f);
        /* top_p = 0.5 on {0.1, 0.2, 0.3, 0.4}: ascending cumsums 0.1 0.3 0.6 1.0; those
         * <= 0.5 go, so 0.3 and 0.4 stay. */
        for (int i = 0; i < 4; i++)
                logits[i] = logf(0.1f * (float)(i + 1));
        s.top_p = 0.5f;
        assert_int_equal(tsr_sampler_probs(&s, &no_history, logits, 4, scratch, probs, &g), TSR_OK);
        assert_true(probs[0] == 0.0f && probs[1] == 0.0f);
        assert_true(fabs(probs[2] - 3.0 / 7.0) < 1e-6 && fabs(probs[3] - 4.0 / 7.0) < 1e-6);
}

static void test_logprobs_rank_and_order(void **state) {
        float logits[6] = {1.0f, 4.0f, 2.0f, 4.0f, -INFINITY, 3.0f}, row[6];
        tsr_token_logprobs lp;

        assert_int_equal(tsr_log_softmax_row(logits, 6, row), TSR_OK);
        assert_true(row[4] == -INFINITY);
        assert_int_equal(tsr_logprobs_gather(logits, 6, 5, 4, &lp), TSR_OK);
        assert_int_equal(lp.rank, 3);
        assert_true(lp.logprob == row[5]);
        assert_int_equal(lp.n_top, 4);
        /* Ties by lower id: 1 before 3. */
        assert_int_equal(lp.top_ids[0], 1);
        assert_int_equal(lp.top_ids[1], 3);
        assert_int_equal(lp.top_ids[2], 5);
        assert_int_equal(lp.top_ids[3], 2);
        /* vLLM's rank counts logprobs >= the token's: a tie counts both. */
        assert_int_equal(tsr_logprobs_gather(logits, 6, 1, 0, &lp), TSR_OK);
        assert_int_equal(lp.rank, 2);
        assert_int_equal(lp.n_top, 0);
        assert_int_equal(tsr_logprobs_gather(logits, 6, 4, 1, &lp), TSR_OK);
        assert_int_equal(lp.rank, 6);
}

static void test_bad_input_rejected(void **state) {
        float logits[4] = {0.0f, 1.0f, 2.0f, 3.0f}, scratch[12], probs[4];
        uint32_t bad_out = 4, allowed = 1;
        tsr_sampling s, t;
        tsr_sample_result r, before;
        tsr_token_logprobs lp;

        memset(&r, 0xab, sizeof(r));
        before = r;
        tsr_sampling_init(&s);
        logits[2] = NAN;
        assert_int_equal(tsr_sample(&s, &no_history, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        assert_memory_equal(&r, &before, sizeof(r));
        assert_int_equal(tsr_log_softmax_row(logits, 4, probs), TSR_E_INVAL);
        assert_int_equal(tsr_logprobs_gather(logits, 4, 0, 1, &lp), TSR_E_INVAL);
        logits[2] = INFINITY;
        assert_int_equal(tsr_sample(&s, &no_history, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        logits[2] = 2.0f;
        assert_int_equal(tsr_sample(&s, &no_history, 0, logits, 0, scratch, &r), TSR_E_INVAL);

        t = s; t.temperature = NAN;
        assert_int_equal(tsr_sample(&t, &no_history, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        t = s; t.temperature = -1.0f;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.top_p = 0.0f;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.min_p = 1.5f;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.repetition_penalty = 0.0f;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.top_k = -2;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.logprobs = 5;                          /* more than the vocabulary */
        assert_int_equal(tsr_sample(&t, &no_history, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        t = s; t.logprobs = 21;
        assert_int_equal(tsr_sampling_check(&t, 1000), TSR_E_INVAL);
        assert_int_equal(tsr_logprobs_gather(logits, 4, 0, 5, &lp), TSR_E_INVAL);
        assert_int_equal(tsr_logprobs_gather(logits, 4, 4, 1, &lp), TSR_E_INVAL);
        t = s; t.eos_ids = &bad_out; t.n_eos = 1;
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        t = s; t.n_bias = 1;                            /* counted but NULL */
        assert_int_equal(tsr_sampling_check(&t, 4), TSR_E_INVAL);
        {
                tsr_sample_history h = {NULL, 0, &bad_out, 1};
                assert_int_equal(tsr_sample(&s, &h, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        }
        /* Everything masked: no distribution to draw from. */
        logits[1] = -INFINITY;
        t = s; t.allowed_ids = &allowed; t.n_allowed = 1;
        assert_int_equal(tsr_sample(&t, &no_history, 0, logits, 4, scratch, &r), TSR_E_INVAL);
        assert_int_equal(tsr_sampler_probs(&t, &no_history, logits, 4, scratch, probs, NULL), TSR_E_INVAL);
        assert_memory_equal(&r, &before, sizeof(r));
        /* top_k larger than the vocabulary is "off", as vLLM clamps it. */
        logits[1] = 1.0f;
        t = s; t.top_k = 100;
        assert_int_equal(tsr_sample(&t, &no_history, 0, logits, 4, scratch, &r), TSR_OK);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_philox_known_answers),
                cmocka_unit_test(test_uniform_streams),
                cmocka_unit_test(test_goldens),
                cmocka_unit_test(test_uniform_given_matches_tsr_sample),
                cmocka_unit_test(test_uniform_given_with_rules),
                cmocka_unit_test(test_rules_on_a_device),
                cmocka_unit_test(test_seeded_determinism),
                cmocka_unit_test(test_draw_statistics),
                cmocka_unit_test(test_greedy_ties_lowest_id),
                cmocka_unit_test(test_plain_greedy_is_the_pipeline),
                cmocka_unit_test(test_min_tokens),
                cmocka_unit_test(test_logit_bias_and_allowed),
                cmocka_unit_test(test_penalties_by_hand),
                cmocka_unit_test(test_top_p_keeps_one),
                cmocka_unit_test(test_logprobs_rank_and_order),
                cmocka_unit_test(test_bad_input_rejected),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
