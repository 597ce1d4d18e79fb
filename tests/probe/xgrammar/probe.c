/* probe.c - does xgrammar's core work from C over SmolLM2's vocabulary?  Compiles a
 * JSON schema, then walks the grammar taking at each step the lowest allowed token id
 * (the stop token once allowed), timing every bitmask fill; prints the text it built,
 * whether it is JSON, and the timings.  Also feeds xgrammar a schema it must reject.
 * Usage: probe VOCAB.json SCHEMA.json STOP_ID  (probe.sh makes the vocabulary). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "xgr_shim.h"

static double now_us(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

/* GPT-2's byte-level alphabet back to bytes (the inverse of bytes_to_unicode). */
static int byte_of[512];
static void init_bytes(void) {
        int n = 0;
        for (int i = 0; i < 512; i++)
                byte_of[i] = -1;
        for (int b = 0; b < 256; b++) {
                if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
                        byte_of[b] = b;
                else
                        byte_of[256 + n++] = b;
        }
}

static void append_decoded(char *out, size_t *len, const char *tok) {
        const unsigned char *u = (const unsigned char *)tok;
        while (*u) {
                int cp = u[0] < 0x80 ? u[0] : ((u[0] & 0x1F) << 6) | (u[1] & 0x3F);
                u += u[0] < 0x80 ? 1 : 2;
                if (cp < 512 && byte_of[cp] >= 0)
                        out[(*len)++] = (char)byte_of[cp];
        }
        out[*len] = '\0';
}

int main(int argc, char **argv) {
        char err[512];
        json_t *vj, *schema_j;
        if (argc < 4)
                return 2;
        init_bytes();
        vj = json_load_file(argv[1], 0, NULL);
        schema_j = json_load_file(argv[2], 0, NULL);
        int stop = atoi(argv[3]);
        if (!vj || !schema_j)
                return 2;
        int n = (int)json_array_size(vj);
        const char **vocab = malloc(n * sizeof(*vocab));
        for (int i = 0; i < n; i++)
                vocab[i] = json_string_value(json_array_get(vj, i));
        char *schema = json_dumps(schema_j, JSON_COMPACT);

        double t0 = now_us();
        tsr_xgr_compiler *c = tsr_xgr_compiler_new(vocab, n, 2, &stop, 1, 2, err, sizeof(err));
        if (!c) {
                printf("compiler: %s\n", err);
                return 1;
        }
        double t1 = now_us();
        tsr_xgr_grammar *g = tsr_xgr_compile_json_schema(c, schema, err, sizeof(err));
        double t2 = now_us();
        if (!g) {
                printf("schema rejected: %s\n", err);
                return 1;
        }
        printf("vocab %d tokens; tokenizer info %.1f ms; schema compile %.1f ms\n", n, (t1 - t0) / 1e3,
               (t2 - t1) / 1e3);
        /* the same schema again: from the compiler's cache */
        double t3 = now_us();
        tsr_xgr_grammar *g2 = tsr_xgr_compile_json_schema(c, schema, err, sizeof(err));
        printf("schema compile again (cache) %.3f ms\n", (now_us() - t3) / 1e3);
        tsr_xgr_grammar_free(g2);

        tsr_xgr_matcher *m = tsr_xgr_matcher_new(g);
        int words = tsr_xgr_bitmask_words(n);
        int32_t *mask = malloc(words * sizeof(int32_t));
        double times[2048];
        int steps = 0, first_allowed = -1;
        char text[65536];
        size_t tl = 0;
        text[0] = '\0';
        while (steps < 2048 && !tsr_xgr_terminated(m)) {
                double a = now_us();
                tsr_xgr_fill_bitmask(m, mask, n);
                times[steps] = now_us() - a;
                /* a stand-in for a model: end what is open as soon as allowed (a closing
                 * quote or bracket, a comma), else the lowest allowed id that is not a
                 * special <|...|> token */
                static const char *const closers[] = {"\"", "\"}", "\"]", "}", "]", ",", NULL};
                int pick = -1, allowed = 0, closer = -1;
                for (int i = 0; i < n; i++) {
                        if (mask[i / 32] >> (i % 32) & 1) {
                                allowed++;
                                if (pick < 0 && strncmp(vocab[i], "<|", 2) != 0)
                                        pick = i;
                                for (int k = 0; closer < 0 && closers[k]; k++)
                                        if (strcmp(vocab[i], closers[k]) == 0)
                                                closer = i;
                        }
                }
                if (closer >= 0)
                        pick = closer;
                if (steps == 0)
                        first_allowed = allowed;
                if (mask[stop / 32] >> (stop % 32) & 1)
                        pick = stop;
                if (pick < 0 || !tsr_xgr_accept(m, pick)) {
                        printf("step %d: no token / refused\n", steps);
                        break;
                }
                if (pick != stop && tl + 64 < sizeof(text))
                        append_decoded(text, &tl, vocab[pick]);
                steps++;
        }
        qsort(times, steps, sizeof(double), cmp_d);
        double sum = 0;
        for (int i = 0; i < steps; i++)
                sum += times[i];
        printf("steps %d, terminated %d, allowed at step 0: %d of %d\n", steps, tsr_xgr_terminated(m), first_allowed, n);
        printf("bitmask fill: mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us\n", sum / steps, times[steps / 2],
               times[(int)(steps * 0.99)], times[steps - 1]);
        printf("output: %s\n", text);
        json_error_t je;
        json_t *parsed = json_loads(text, 0, &je);
        printf("output is JSON: %s\n", parsed ? "yes" : je.text);
        json_decref(parsed);

        /* a schema xgrammar must refuse */
        tsr_xgr_grammar *bad = tsr_xgr_compile_json_schema(c, "{\"type\": \"object\", \"properties\": 5}", err, sizeof(err));
        printf("bad schema: %s\n", bad ? "accepted (!)" : err);
        tsr_xgr_grammar_free(bad);
        tsr_xgr_matcher_free(m);
        tsr_xgr_grammar_free(g);
        tsr_xgr_compiler_free(c);
        free(mask);
        free(vocab);
        free(schema);
        json_decref(vj);
        json_decref(schema_j);
        return 0;
}
