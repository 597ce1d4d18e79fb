/* bench_grammar.c - tessera-bench-grammar: what structured outputs cost per token on the
 * worker (docs/benchmarks.md).  A benchmark, not a test: it prints numbers.
 *
 *   tessera-bench-grammar [MODEL.gguf|HF-DIR] [--steps N] [--seed N] [--schema FILE]
 *
 * The router's check of the schema (xgrammar's Grammar without a vocabulary).  Over the
 * model's real vocabulary (worker/engine/grammar_vocab.c): the time to build
 * xgrammar's vocabulary, to compile a large JSON schema (and to get it again from the
 * cache), then N steps of what the engine does per token of a constrained request: fill
 * the bitmask, apply it to a logits row, accept a token.  The token is drawn uniformly
 * (seeded) from the allowed ones, the stop token never while anything else is allowed,
 * and the walk restarts when the grammar completes, so the schema's every part is
 * visited.  Mean and p99 of the fill and of fill + apply + accept. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grammar/grammar.h"
#include "worker/engine/grammar_vocab.h"

/* A large schema: nested objects, arrays with bounds, enums, number ranges, string
 * patterns and formats, $defs/$ref, anyOf. */
static const char schema[] =
        "{\"$defs\":{\"addr\":{\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\",\"maxLength\":40},"
        "\"city\":{\"type\":\"string\",\"maxLength\":30},\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"},"
        "\"country\":{\"enum\":[\"FR\",\"DE\",\"US\",\"JP\",\"BR\"]}},\"required\":[\"street\",\"city\",\"zip\","
        "\"country\"],\"additionalProperties\":false}},"
        "\"type\":\"object\",\"properties\":{"
        "\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":60},"
        "\"email\":{\"type\":\"string\",\"format\":\"email\"},\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":130},"
        "\"score\":{\"type\":\"number\",\"minimum\":0,\"maximum\":1},\"active\":{\"type\":\"boolean\"},"
        "\"created\":{\"type\":\"string\",\"format\":\"date-time\"},\"home\":{\"$ref\":\"#/$defs/addr\"},"
        "\"work\":{\"anyOf\":[{\"$ref\":\"#/$defs/addr\"},{\"type\":\"null\"}]},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":16},\"minItems\":1,\"maxItems\":8},"
        "\"orders\":{\"type\":\"array\",\"maxItems\":5,\"items\":{\"type\":\"object\",\"properties\":{"
        "\"sku\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-[0-9]{4}$\"},\"qty\":{\"type\":\"integer\",\"minimum\":1,"
        "\"maximum\":99},\"price\":{\"type\":\"number\",\"minimum\":0},\"status\":{\"enum\":[\"new\",\"paid\","
        "\"shipped\",\"returned\"]},\"notes\":{\"anyOf\":[{\"type\":\"string\",\"maxLength\":80},{\"type\":\"null\"}]}},"
        "\"required\":[\"sku\",\"qty\",\"price\",\"status\"],\"additionalProperties\":false}},"
        "\"prefs\":{\"type\":\"object\",\"properties\":{\"lang\":{\"enum\":[\"en\",\"fr\",\"de\",\"ja\"]},"
        "\"newsletter\":{\"type\":\"boolean\"},\"theme\":{\"enum\":[\"light\",\"dark\"]}},\"required\":[\"lang\"],"
        "\"additionalProperties\":false}},"
        "\"required\":[\"id\",\"name\",\"email\",\"age\",\"score\",\"active\",\"created\",\"home\",\"tags\",\"orders\","
        "\"prefs\"],\"additionalProperties\":false}";

static double now_us(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static uint64_t rng(uint64_t *s) {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        return *s;
}

static void report(const char *what, double *t, size_t n) {
        double sum = 0;
        for (size_t i = 0; i < n; i++)
                sum += t[i];
        qsort(t, n, sizeof(*t), cmp_d);
        printf("%-28s mean %8.1f us   p50 %8.1f us   p99 %8.1f us   max %8.1f us\n", what, sum / (double)n,
               t[n / 2], t[(size_t)((double)n * 0.99)], t[n - 1]);
}

int main(int argc, char **argv) {
        const char *path = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
        size_t steps = 2000, vocab, words, n = 0, restarts = 0;
        uint64_t seed = 1;
        tsr_model_meta *meta = NULL;
        tsr_grammar_vocab *v = NULL;
        tsr_grammar_compiled *g = NULL;
        tsr_grammar_matcher *m = NULL;
        char err[512];
        double t0, t1;

        const char *text = schema;
        char *file_text = NULL;
        for (int i = 1; i < argc; i++) {
                if (strcmp(argv[i], "--schema") == 0 && i + 1 < argc) {
                        FILE *f = fopen(argv[++i], "rb");
                        long len;
                        if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0 ||
                            !(file_text = calloc((size_t)len + 1, 1)) || fread(file_text, 1, (size_t)len, f) != (size_t)len) {
                                fprintf(stderr, "%s: cannot read\n", argv[i]);
                                return 1;
                        }
                        fclose(f);
                        text = file_text;
                } else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
                        steps = strtoull(argv[++i], NULL, 10);
                else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
                        seed = strtoull(argv[++i], NULL, 10) | 1;
                else
                        path = argv[i];
        }
        if (tsr_model_meta_load(path, &meta, err, sizeof(err)) != TSR_OK) {
                fprintf(stderr, "%s: %s\n", path, err);
                return 1;
        }
        vocab = meta->vocab_size;
        t0 = now_us();
        if (tsr_engine_grammar_vocab(meta, vocab, &v, err, sizeof(err)) != TSR_OK) {
                fprintf(stderr, "vocabulary: %s\n", err);
                return 1;
        }
        t1 = now_us();
        printf("model %s: %zu tokens; xgrammar vocabulary built in %.1f ms\n", path, vocab, (t1 - t0) / 1e3);
        tsr_grammar_spec spec = {.kind = TSR_GRAMMAR_JSON_SCHEMA, .text = text, .len = strlen(text),
                                 .any_whitespace = false};
        t0 = now_us();
        for (int k = 0; k < 20; k++)
                tsr_grammar_check(&spec, err, sizeof(err));
        printf("router's check of the schema (no vocabulary, on its loop thread): %.3f ms\n",
               (now_us() - t0) / 20 / 1e3);
        for (int k = 0; k < 2; k++) {
                t0 = now_us();
                tsr_grammar_compiled_free(&g);
                if (tsr_grammar_compile(v, &spec, &g, err, sizeof(err)) != TSR_OK) {
                        fprintf(stderr, "compile: %s\n", err);
                        return 1;
                }
                printf("schema (%zu bytes) compiled in %.3f ms%s\n", strlen(text), (now_us() - t0) / 1e3,
                       k ? " (xgrammar's cache)" : "");
        }
        words = tsr_grammar_mask_words(vocab);
        uint32_t *mask = malloc(words * sizeof(uint32_t)), *allowed = malloc(vocab * sizeof(uint32_t));
        float *logits = malloc(vocab * sizeof(float));
        double *fill = malloc(steps * sizeof(double)), *whole = malloc(steps * sizeof(double));
        uint32_t eos = meta->eos_token_ids[0];
        m = tsr_grammar_matcher_new(g);
        while (n < steps) {
                size_t n_allowed = 0;
                uint32_t pick;
                for (size_t i = 0; i < vocab; i++)
                        logits[i] = (float)(i % 97) * 0.01f;
                t0 = now_us();
                tsr_grammar_fill_mask(m, mask, vocab);
                t1 = now_us();
                tsr_grammar_apply_mask(logits, vocab, mask);
                for (size_t i = 0; i < vocab; i++)
                        if ((mask[i / 32] >> (i % 32) & 1u) && (i != eos))
                                allowed[n_allowed++] = (uint32_t)i;
                pick = n_allowed ? allowed[rng(&seed) % n_allowed] : eos;
                tsr_grammar_accept(m, pick);
                fill[n] = t1 - t0;
                whole[n] = now_us() - t0;   /* includes the test's own scan for allowed ids */
                n++;
                if (tsr_grammar_terminated(m)) {
                        tsr_grammar_matcher_free(&m);
                        m = tsr_grammar_matcher_new(g);
                        restarts++;
                }
        }
        printf("%zu steps (%zu complete outputs):\n", n, restarts);
        report("fill bitmask", fill, n);
        report("fill + apply + pick + accept", whole, n);
        tsr_grammar_matcher_free(&m);
        tsr_grammar_compiled_free(&g);
        tsr_grammar_vocab_free(&v);
        tsr_model_meta_free(&meta);
        free(mask);
        free(allowed);
        free(logits);
        free(fill);
        free(whole);
        free(file_text);
        return 0;
}
