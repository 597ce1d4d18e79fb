/* test_tokenizer.c - the tokenizer against Hugging Face goldens, streaming detok, errors.
 *
 * Goldens come from tests/fixtures/make_tokenizer_goldens.py (HF `tokenizers` and
 * `transformers`, never our code): strings.json holds the shared input strings and each
 * <family>.golden.json their ids, the add_special_tokens prefix/suffix and decodes of
 * random id sequences.  Trained families load their committed tokenizer.json; GGUF
 * families are built from the GGUF metadata and skip when the file is absent.
 *
 * TSR_TOK_BENCH=<text file> TSR_TOK_BENCH_GGUF=<gguf> runs an encode benchmark instead of the
 * tests (bench_main; tests/fixtures/tok_bench.py drives it). */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/tokenizer.h"
#include "worker/load/model_meta.h"

static char *read_file(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        char *buf;
        long n;

        if (!f)
                return NULL;
        fseek(f, 0, SEEK_END);
        n = ftell(f);
        fseek(f, 0, SEEK_SET);
        buf = malloc((size_t)n + 1);
        assert_non_null(buf);
        assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
        buf[n] = '\0';
        fclose(f);
        *len = (size_t)n;
        return buf;
}

static void fixture_path(char *out, size_t n, const char *name) {
        const char *r = getenv("TSR_SOURCE_ROOT");
        snprintf(out, n, "%s/tests/fixtures/tokenizers/%s", r ? r : ".", name);
}

static json_t *load_json(const char *name) {
        char path[4096];
        json_error_t je;
        json_t *j;

        fixture_path(path, sizeof(path), name);
        j = json_load_file(path, JSON_ALLOW_NUL, &je);
        if (!j)
                print_error("%s: %s\n", path, je.text);
        assert_non_null(j);
        return j;
}

static tsr_tokenizer *tok_from_json_file(const char *path) {
        size_t n;
        char *s = read_file(path, &n), err[512] = "";
        tsr_tokenizer *t = NULL;

        if (!s)
                return NULL;
        if (tsr_tokenizer_new_json((const uint8_t *)s, n, NULL, 0, &t, err, sizeof(err)) != TSR_OK)
                print_error("%s: %s\n", path, err);
        free(s);
        assert_non_null(t);
        return t;
}

/* Build from a GGUF file through the worker's metadata reader; NULL if absent. */
static tsr_tokenizer *tok_from_gguf(const char *path) {
        tsr_model_meta *m = NULL;
        tsr_gguf_tokenizer *g;
        tsr_tok_gguf d;
        tsr_tokenizer *t = NULL;
        char err[512] = "";

        if (access(path, R_OK) != 0)
                return NULL;
        if (tsr_model_meta_load(path, &m, err, sizeof(err)) != TSR_OK)
                print_error("%s: %s\n", path, err);
        assert_non_null(m);
        g = m->gguf_tokenizer;
        assert_non_null(g);
        d = (tsr_tok_gguf){
                .model = g->model, .pre = g->pre, .tokens = (const char *const *)g->tokens,
                .n_tokens = g->n_tokens, .scores = g->scores, .token_types = g->token_types,
                .merges = (const char *const *)g->merges, .n_merges = g->n_merges, .bos_id = g->bos_id,
                .eos_id = g->eos_id, .unk_id = g->unk_id, .pad_id = g->pad_id, .add_bos = g->add_bos,
                .add_eos = g->add_eos, .add_space_prefix = g->add_space_prefix,
        };
        if (tsr_tokenizer_new_gguf(&d, &t, err, sizeof(err)) != TSR_OK)
                print_error("%s: %s\n", path, err);
        tsr_model_meta_free(&m);
        assert_non_null(t);
        return t;
}

static void print_ids(const char *what, const uint32_t *ids, size_t n) {
        size_t i;

        print_message("  %s (%zu):", what, n);
        for (i = 0; i < n; i++)
                print_message(" %u", ids[i]);
        print_message("\n");
}

static bool valid_utf8(const char *s, size_t n) {
        const unsigned char *p = (const unsigned char *)s;
        size_t i = 0;

        while (i < n) {
                unsigned c = p[i], k, need;
                unsigned char lo = 0x80, hi = 0xBF;
                if (c < 0x80) {
                        i++;
                        continue;
                }
                if (c >= 0xC2 && c <= 0xDF)
                        need = 1;
                else if (c >= 0xE0 && c <= 0xEF) {
                        need = 2;
                        lo = c == 0xE0 ? 0xA0 : 0x80;
                        hi = c == 0xED ? 0x9F : 0xBF;
                } else if (c >= 0xF0 && c <= 0xF4) {
                        need = 3;
                        lo = c == 0xF0 ? 0x90 : 0x80;
                        hi = c == 0xF4 ? 0x8F : 0xBF;
                } else
                        return false;
                for (k = 1; k <= need; k++) {
                        if (i + k >= n)
                                return false;
                        if (p[i + k] < (k == 1 ? lo : 0x80) || p[i + k] > (k == 1 ? hi : 0xBF))
                                return false;
                }
                i += need + 1;
        }
        return true;
}

static uint32_t *json_ids(json_t *arr, size_t *n) {
        size_t i;
        uint32_t *v = malloc((json_array_size(arr) + 1) * sizeof(uint32_t));

        assert_non_null(v);
        for (i = 0; i < json_array_size(arr); i++)
                v[i] = (uint32_t)json_integer_value(json_array_get(arr, i));
        *n = json_array_size(arr);
        return v;
}

/* Streaming decode one id at a time, after priming with `prompt` (n_prompt ids, 0 for none);
 * returns false (after printing) on a mismatch. */
static bool check_detok_primed(const tsr_tokenizer *t, const uint32_t *prompt, size_t n_prompt, const uint32_t *ids,
                               size_t n, bool skip, const char *want, size_t want_len) {
        tsr_detok *d = NULL;
        char *acc = NULL, *delta;
        size_t acc_len = 0, dl, i;
        bool ok = true;

        assert_int_equal(tsr_detok_new(t, skip, &d), TSR_OK);
        assert_int_equal(tsr_detok_prime(d, prompt, n_prompt), TSR_OK);
        assert_int_equal(tsr_detok_prime(d, prompt, n_prompt), TSR_E_INVAL);      /* once only */
        for (i = 0; i <= n; i++) {
                if (i < n)
                        assert_int_equal(tsr_detok_push(d, ids[i], &delta, &dl), TSR_OK);
                else
                        assert_int_equal(tsr_detok_flush(d, &delta, &dl), TSR_OK);
                assert_int_equal(delta[dl], '\0');
                if (!valid_utf8(delta, dl)) {
                        print_message("detok emitted invalid UTF-8 at id #%zu\n", i);
                        ok = false;
                }
                acc = realloc(acc, acc_len + dl + 1);
                memcpy(acc + acc_len, delta, dl);
                acc_len += dl;
                free(delta);
        }
        if (acc_len != want_len || memcmp(acc, want, want_len) != 0) {
                print_message("detok (skip=%d) gave \"%.*s\", want \"%s\"\n", skip, (int)acc_len, acc, want);
                if (n_prompt)
                        print_ids("prompt", prompt, n_prompt);
                print_ids("ids", ids, n);
                ok = false;
        }
        free(acc);
        tsr_detok_free(&d);
        assert_null(d);
        return ok;
}

static bool check_detok(const tsr_tokenizer *t, const uint32_t *ids, size_t n, bool skip, const char *want,
                        size_t want_len) {
        return check_detok_primed(t, NULL, 0, ids, n, skip, want, want_len);
}

/* The golden's "primed" cases: the stream primed with a prompt, as vLLM primes its
 * DecodeStream, gives vLLM's text.  Returns the number of mismatches. */
static size_t check_primed(const tsr_tokenizer *t, json_t *g, const char *name) {
        json_t *cases = json_object_get(g, "primed"), *c;
        size_t k, n_ok = 0, n_fail = 0, n_reset = 0, n_primed_only = 0;

        if (!cases)
                return 0;
        json_array_foreach(cases, k, c) {
                size_t np, ng;
                uint32_t *p = json_ids(json_array_get(c, 0), &np), *gen = json_ids(json_array_get(c, 1), &ng);
                bool skip = json_is_true(json_array_get(c, 2));
                json_t *w = json_array_get(c, 3);
                char *plain = NULL;
                size_t plain_len = 0;

                if (json_array_size(c) > 4) {
                        n_reset++;      /* vLLM's stream restarted ("Invalid prefix"): not mimicked */
                } else if (check_detok_primed(t, p, np, gen, ng, skip, json_string_value(w), json_string_length(w))) {
                        n_ok++;
                        assert_int_equal(tsr_tokenizer_decode(t, gen, ng, skip, &plain, &plain_len), TSR_OK);
                        if (plain_len != json_string_length(w) || memcmp(plain, json_string_value(w), plain_len))
                                n_primed_only++;
                        free(plain);
                } else {
                        n_fail++;
                }
                free(p);
                free(gen);
        }
        print_message("%s: primed streaming %zu/%zu as vLLM (%zu differ from the unprimed decode; %zu DecodeStream "
                      "restarts not compared)\n", name, n_ok, json_array_size(cases), n_primed_only, n_reset);
        return n_fail;
}

static bool same_ids(const uint32_t *a, size_t na, const uint32_t *b, size_t nb) {
        return na == nb && (na == 0 || memcmp(a, b, na * sizeof(uint32_t)) == 0);
}

/* What vLLM returns for the ids of golden `kind` #i (streamed or not) when it is not their
 * full decode: the golden's "stream" entry, or NULL (then it is the decode).  *reset is set
 * for the sequences whose DecodeStream restarts, which Tessera does not mimic. */
static json_t *stream_want(json_t *g, const char *kind, size_t i, bool skip, bool *reset) {
        json_t *arr = json_object_get(g, "stream"), *e;
        size_t k;

        *reset = false;
        json_array_foreach(arr, k, e) {
                const char *ek = json_string_value(json_array_get(e, 0));
                bool is_reset = !strcmp(ek, "reset");
                if ((size_t)json_integer_value(json_array_get(e, 1)) != i ||
                    json_is_true(json_array_get(e, 2)) != skip ||
                    strcmp(is_reset ? json_string_value(json_array_get(e, 4)) : ek, kind))
                        continue;
                *reset = is_reset;
                return json_array_get(e, 3);
        }
        return NULL;
}

/* Every golden of one family: encode both ways, decode both ways, streaming decode. */
static void check_family(const tsr_tokenizer *t, const char *name) {
        char gname[256];
        json_t *strings = load_json("strings.json"), *g;
        json_t *ids_all, *dec;
        uint32_t *pre, *suf;
        size_t npre, nsuf, i, n_ok = 0, n_fail = 0, n_dec_ok = 0, n_detok_ok = 0, n_reset = 0, n_tail = 0;
        json_t *sw;
        bool reset;

        snprintf(gname, sizeof(gname), "%s.golden.json", name);
        g = load_json(gname);
        ids_all = json_object_get(g, "ids");
        dec = json_object_get(g, "decode");
        assert_int_equal(json_array_size(ids_all), json_array_size(strings));
        assert_int_equal(tsr_tokenizer_vocab_size(t), (size_t)json_integer_value(json_object_get(g, "vocab_size")));
        pre = json_ids(json_object_get(g, "prefix"), &npre);
        suf = json_ids(json_object_get(g, "suffix"), &nsuf);
        for (i = 0; i < json_array_size(strings); i++) {
                json_t *js = json_array_get(strings, i);
                const char *s = json_string_value(js);
                size_t slen = json_string_length(js), nw, ng, ngs, tl;
                uint32_t *want = json_ids(json_array_get(ids_all, i), &nw), *got = NULL, *gots = NULL, *wants;
                char *text = NULL;
                bool ok;

                assert_int_equal(tsr_tokenizer_encode(t, s, slen, false, &got, &ng), TSR_OK);
                assert_int_equal(tsr_tokenizer_encode(t, s, slen, true, &gots, &ngs), TSR_OK);
                wants = malloc((npre + nw + nsuf + 1) * sizeof(uint32_t));
                memcpy(wants, pre, npre * sizeof(uint32_t));
                memcpy(wants + npre, want, nw * sizeof(uint32_t));
                memcpy(wants + npre + nw, suf, nsuf * sizeof(uint32_t));
                ok = same_ids(got, ng, want, nw) && same_ids(gots, ngs, wants, npre + nw + nsuf);
                if (ok) {
                        n_ok++;
                } else if (n_fail++ < 3) {
                        print_message("%s: string #%zu \"%s\" encodes differently\n", name, i, s);
                        print_ids("want", want, nw);
                        print_ids("got ", got, ng);
                        print_ids("want(special)", wants, npre + nw + nsuf);
                        print_ids("got (special)", gots, ngs);
                }
                /* every golden string's ids also stream back to their full decode, or to what
                 * vLLM returns when that decode ends in U+FFFD */
                assert_int_equal(tsr_tokenizer_decode(t, want, nw, false, &text, &tl), TSR_OK);
                sw = stream_want(g, "ids", i, false, &reset);
                n_tail += sw && !reset;
                if (reset)
                        n_reset++;
                else if (sw ? check_detok(t, want, nw, false, json_string_value(sw), json_string_length(sw))
                            : check_detok(t, want, nw, false, text, tl))
                        n_detok_ok++;
                else
                        n_fail++;
                free(text);
                free(got);
                free(gots);
                free(want);
                free(wants);
        }
        for (i = 0; i < json_array_size(dec); i++) {
                json_t *e = json_array_get(dec, i);
                size_t n, tl, k;
                uint32_t *ids = json_ids(json_array_get(e, 0), &n);
                for (k = 0; k < 2; k++) {
                        json_t *w = json_array_get(e, 1 + k);
                        char *text = NULL;
                        bool skip = k == 0;
                        assert_int_equal(tsr_tokenizer_decode(t, ids, n, skip, &text, &tl), TSR_OK);
                        if (tl == json_string_length(w) && memcmp(text, json_string_value(w), tl) == 0) {
                                n_dec_ok++;
                        } else if (n_fail++ < 6) {
                                print_message("%s: decode #%zu (skip=%d) gave \"%s\", want \"%s\"\n", name, i, skip,
                                              text, json_string_value(w));
                                print_ids("ids", ids, n);
                        }
                        sw = stream_want(g, "decode", i, skip, &reset);
                        n_tail += sw && !reset;
                        if (sw)
                                w = sw;
                        if (reset)
                                n_reset++;
                        else if (!check_detok(t, ids, n, skip, json_string_value(w), json_string_length(w)))
                                n_fail++;
                        else
                                n_detok_ok++;
                        free(text);
                }
                free(ids);
        }
        /* normalizer families: strings aimed at the Unicode normalization forms */
        {
                json_t *xs = json_object_get(g, "extra_strings"), *xi = json_object_get(g, "extra_ids");
                size_t n_x = 0;
                assert_int_equal(json_array_size(xs), json_array_size(xi));
                for (i = 0; i < json_array_size(xs); i++) {
                        json_t *js = json_array_get(xs, i);
                        size_t nw, ng;
                        uint32_t *want = json_ids(json_array_get(xi, i), &nw), *got = NULL;
                        assert_int_equal(tsr_tokenizer_encode(t, json_string_value(js), json_string_length(js), false,
                                                              &got, &ng), TSR_OK);
                        if (same_ids(got, ng, want, nw)) {
                                n_x++;
                        } else {
                                n_fail++;
                                print_message("%s: normalization string #%zu \"%s\" encodes differently\n", name, i,
                                              json_string_value(js));
                                print_ids("want", want, nw);
                                print_ids("got ", got, ng);
                        }
                        free(got);
                        free(want);
                }
                if (xs)
                        print_message("%s: %zu/%zu normalization strings exact\n", name, n_x, json_array_size(xs));
        }
        n_fail += check_primed(t, g, name);
        print_message("%s: encode %zu/%zu exact, decode %zu/%zu exact, streaming %zu ok (%zu lose a U+FFFD tail as "
                      "in vLLM; %zu DecodeStream restarts not compared)\n", name, n_ok, json_array_size(strings),
                      n_dec_ok, 2 * json_array_size(dec), n_detok_ok, n_tail, n_reset);
        free(pre);
        free(suf);
        json_decref(g);
        json_decref(strings);
        assert_int_equal(n_fail, 0);
}

static void test_trained(const char *name) {
        char path[4096], file[256];
        tsr_tokenizer *t;

        snprintf(file, sizeof(file), "%s.tokenizer.json", name);
        fixture_path(path, sizeof(path), file);
        t = tok_from_json_file(path);
        check_family(t, name);
        tsr_tokenizer_free(&t);
        assert_null(t);
}

static void test_llama3_style(void **state) {
        (void)state;
        test_trained("llama3_style");
}

static void test_o200k_style(void **state) {
        (void)state;
        test_trained("o200k_style");
}

static void test_metaspace_bf(void **state) {
        (void)state;
        test_trained("metaspace_bf");
}

/* Nemotron-3-Nano's shape (models.md 5.3): the specials sit at the ids the real vocabulary
 * gives them, add_special_tokens adds nothing (add_bos_token=false), and the reasoning and
 * tool tags are added tokens that skip_special_tokens keeps. */
static void test_nemotron_style(void **state) {
        static const char *const first[] = {"<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                                            "[TOOL_CALLS]", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                            "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"};
        char path[4096];
        tsr_tokenizer *t;
        uint32_t *ids = NULL, think[] = {12, 11, 13};
        size_t n, i, len;
        char *text = NULL;
        (void)state;

        fixture_path(path, sizeof(path), "nemotron_style.tokenizer.json");
        t = tok_from_json_file(path);
        for (i = 0; i < sizeof(first) / sizeof(first[0]); i++) {
                assert_int_equal(tsr_tokenizer_token_id(t, first[i], strlen(first[i])), (int64_t)i);
                assert_int_equal(tsr_tokenizer_is_special(t, (uint32_t)i), i < 12);
        }
        assert_false(tsr_tokenizer_add_bos(t));
        assert_false(tsr_tokenizer_add_eos(t));
        assert_int_equal(tsr_tokenizer_encode(t, "<|im_start|>user\n", 17, true, &ids, &n), TSR_OK);
        assert_true(n >= 2);
        assert_int_equal(ids[0], 10);
        free(ids);
        /* single digits: "2024" is four pieces of one digit each */
        assert_int_equal(tsr_tokenizer_encode(t, "2024", 4, false, &ids, &n), TSR_OK);
        assert_int_equal(n, 4);
        free(ids);
        assert_int_equal(tsr_tokenizer_decode(t, think, 3, true, &text, &len), TSR_OK);
        assert_string_equal(text, "<think></think>");
        free(text);
        check_family(t, "nemotron_style");
        tsr_tokenizer_free(&t);
}

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void write_ids(const char *prefix, const char *what, const uint32_t *ids, size_t n) {
        char path[4096];
        FILE *f;

        snprintf(path, sizeof(path), "%s.%s.u32", prefix, what);
        f = fopen(path, "wb");
        if (!f || fwrite(ids, sizeof(uint32_t), n, f) != n) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                exit(1);
        }
        fclose(f);
}

/* Benchmark mode, not a test: TSR_TOK_BENCH=<text file> TSR_TOK_BENCH_GGUF=<gguf> runs one
 * timed encode of the whole file as one string and one of it line by line (one call per
 * line, "\n" kept, as a server sees prompts), add_special_tokens off, this thread only, and
 * prints the times; TSR_TOK_BENCH_IDS=<prefix> also writes the ids (<prefix>.one.u32,
 * <prefix>.lines.u32) for comparison with HF.  tests/fixtures/tok_bench.py drives it
 * (alternating with HF tokenizers, best of 3). */
static int bench_main(const char *path) {
        const char *gguf = getenv("TSR_TOK_BENCH_GGUF"), *idp = getenv("TSR_TOK_BENCH_IDS");
        tsr_tokenizer *t;
        size_t n, nids = 0, i = 0, total = 0, calls = 0, cap = 0;
        char *text;
        uint32_t *ids = NULL, *all = NULL;
        double t0, t1;

        if (!gguf || access(gguf, R_OK) != 0 || !(text = read_file(path, &n))) {
                fprintf(stderr, "bench: need TSR_TOK_BENCH=<readable text file> and TSR_TOK_BENCH_GGUF=<gguf>\n");
                return 2;
        }
        t = tok_from_gguf(gguf);
        t0 = now_s();
        if (tsr_tokenizer_encode(t, text, n, false, &ids, &nids) != TSR_OK) {
                fprintf(stderr, "bench: encode failed\n");
                return 1;
        }
        t1 = now_s();
        printf("tessera one_string bytes=%zu ids=%zu s=%.6f MB/s=%.3f\n", n, nids, t1 - t0, (double)n / (t1 - t0) / 1e6);
        if (idp)
                write_ids(idp, "one", ids, nids);
        free(ids);
        t0 = now_s();
        while (i < n) {
                const char *e = memchr(text + i, '\n', n - i);
                size_t l = e ? (size_t)(e - text - i) + 1 : n - i;
                if (tsr_tokenizer_encode(t, text + i, l, false, &ids, &nids) != TSR_OK) {
                        fprintf(stderr, "bench: encode failed at byte %zu\n", i);
                        return 1;
                }
                if (idp) {      /* the check run only; timed runs leave TSR_TOK_BENCH_IDS unset */
                        if (total + nids > cap) {
                                cap = 2 * (total + nids) + 1024;
                                all = realloc(all, cap * sizeof(uint32_t));
                                if (!all)
                                        return 1;
                        }
                        if (nids)
                                memcpy(all + total, ids, nids * sizeof(uint32_t));
                }
                total += nids;
                calls++;
                free(ids);
                i += l;
        }
        t1 = now_s();
        printf("tessera lines bytes=%zu calls=%zu ids=%zu s=%.6f MB/s=%.3f\n", n, calls, total, t1 - t0,
               (double)n / (t1 - t0) / 1e6);
        if (idp)
                write_ids(idp, "lines", all, total);
        free(all);
        free(text);
        tsr_tokenizer_free(&t);
        return 0;
}

static void test_gguf(const char *dir_env, const char *sub, const char *file, const char *name) {
        char path[4096];
        const char *dir = dir_env ? getenv(dir_env) : getenv("TSR_SOURCE_ROOT");
        tsr_tokenizer *t;

        snprintf(path, sizeof(path), "%s/%s/%s", dir ? dir : ".", sub, file);
        t = tok_from_gguf(path);
        if (!t) {
                if (dir_env)
                        TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", path);
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-model.sh fetches it)", path);
        }
        check_family(t, name);
        if (!strcmp(name, "smollm2_gguf")) {
                /* transformers' converted tokenizer.json, when the generator left it in /tmp */
                tsr_tokenizer *tj = NULL;
                char jp[512];
                snprintf(jp, sizeof(jp), "/tmp/%s.tokenizer.json", file);
                if (access(jp, R_OK) == 0) {
                        tj = tok_from_json_file(jp);
                        check_family(tj, name);
                        tsr_tokenizer_free(&tj);
                }
        }
        tsr_tokenizer_free(&t);
}

static void test_smollm2_gguf(void **state) {
        (void)state;
        test_gguf(NULL, ".cache/models", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2_gguf");
}

static void test_stories260k_gguf(void **state) {
        (void)state;
        test_gguf("TSR_FIXTURES", "models", "stories260K.gguf", "stories260k_gguf");
}

static void test_llama2_tiny_gguf(void **state) {
        (void)state;
        test_gguf("TSR_FIXTURES", "models", "llama-2-tiny-random.gguf", "llama2_tiny_gguf");
}

static void test_nfc(void **state) {
        (void)state;
        test_trained("nfc_bytelevel");
}

static void test_nfkc(void **state) {
        (void)state;
        test_trained("nfkc_bytelevel");
}

static void test_nfd(void **state) {
        (void)state;
        test_trained("nfd_bytelevel");
}

static void test_nfkd(void **state) {
        (void)state;
        test_trained("nfkd_bytelevel");
}

/* ---- real vocabularies fetched by scripts/fetch-vocab.sh into .cache/vocab (skip when absent) */

static void vocab_path(char *out, size_t n, const char *file) {
        const char *r = getenv("TSR_SOURCE_ROOT");
        snprintf(out, n, "%s/.cache/vocab/%s", r ? r : ".", file);
}

/* llama.cpp's test strings (.inp, separated by "\n__ggml_vocab_test__\n") and the ids HF's
 * tokenizer of the original model gave for them (.out, one line of ids per string). */
static void check_inp_out(const tsr_tokenizer *t, const char *gguf_path) {
        static const char sep[] = "\n__ggml_vocab_test__\n";
        char path[4200];
        size_t ni, no, n_ok = 0, n_all = 0;
        char *inp, *out, *s, *o;

        snprintf(path, sizeof(path), "%s.inp", gguf_path);
        inp = read_file(path, &ni);
        snprintf(path, sizeof(path), "%s.out", gguf_path);
        out = read_file(path, &no);
        assert_non_null(inp);
        assert_non_null(out);
        for (s = inp, o = out; *s || *o;) {
                char *e = strstr(s, sep), *oe = strchr(o, '\n');
                size_t sl = e ? (size_t)(e - s) : strlen(s), nw = 0, ng, k;
                uint32_t want[512], *got = NULL;
                char *p = o, *end;

                if (oe)
                        *oe = '\0';
                while (nw < 512 && (k = strtoul(p, &end, 10), end != p)) {
                        want[nw++] = (uint32_t)k;
                        p = end;
                }
                if (sl || nw) {
                        n_all++;
                        assert_int_equal(tsr_tokenizer_encode(t, s, sl, false, &got, &ng), TSR_OK);
                        if (same_ids(got, ng, want, nw))
                                n_ok++;
                        else {
                                print_message(".inp string #%zu \"%.*s\" encodes differently\n", n_all, (int)sl, s);
                                print_ids("want", want, nw);
                                print_ids("got ", got, ng);
                        }
                        free(got);
                }
                s = e ? e + sizeof(sep) - 1 : s + sl;
                o = oe ? oe + 1 : o + strlen(o);
        }
        print_message("%s: %zu/%zu of llama.cpp's HF-generated encodings exact\n", gguf_path, n_ok, n_all);
        assert_true(n_all >= 40);
        assert_int_equal(n_ok, n_all);
        free(inp);
        free(out);
}

static void test_llama_bpe_gguf(void **state) {
        char path[4096];
        tsr_tokenizer *t;
        (void)state;

        vocab_path(path, sizeof(path), "llama-bpe.gguf");
        t = tok_from_gguf(path);
        if (!t)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-vocab.sh fetches it)", path);
        assert_int_equal(tsr_tokenizer_vocab_size(t), 128256);
        check_inp_out(t, path);
        check_family(t, "llama_bpe_gguf");
        tsr_tokenizer_free(&t);
}

static void test_real_json(const char *file, const char *name, size_t vocab) {
        char path[4096];
        tsr_tokenizer *t;

        vocab_path(path, sizeof(path), file);
        t = tok_from_json_file(path);
        if (!t)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-vocab.sh fetches it)", path);
        assert_int_equal(tsr_tokenizer_vocab_size(t), vocab);
        check_family(t, name);
        tsr_tokenizer_free(&t);
}

static void test_o200k_real(void **state) {
        (void)state;
        test_real_json("o200k.tokenizer.json", "o200k_real", 200019);
}

static void test_tekken_real(void **state) {
        (void)state;
        test_real_json("tekken.tokenizer.json", "tekken_real", 131072);
}

/* ---- errors */

static tsr_status try_json(const char *json, char *err, size_t errlen) {
        tsr_tokenizer *t = NULL;
        tsr_status st = tsr_tokenizer_new_json((const uint8_t *)json, strlen(json), NULL, 0, &t, err, errlen);

        if (st == TSR_OK)
                assert_non_null(t);
        else
                assert_null(t);
        tsr_tokenizer_free(&t);
        return st;
}

#define MINI_MODEL "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}"

static void test_bad_json(void **state) {
        char err[512];
        (void)state;

        assert_int_equal(try_json("{", err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "tokenizer.json"));
        assert_int_equal(try_json("[]", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(try_json("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "WordPiece"));
        assert_int_equal(try_json("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-1}}}", err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "vocab"));
        assert_int_equal(try_json("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a c\"]}}", err, sizeof(err)),
                         TSR_E_INVAL);
        assert_non_null(strstr(err, "merges[0]"));
        assert_int_equal(try_json("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a a\"]}}", err, sizeof(err)),
                         TSR_E_INVAL);
        assert_non_null(strstr(err, "merged token"));
        assert_int_equal(try_json("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[7]}}", err, sizeof(err)),
                         TSR_E_INVAL);
        assert_int_equal(try_json("{\"model\":{\"type\":\"BPE\",\"vocab\":{},\"continuing_subword_prefix\":\"##\"}}", err,
                                  sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "continuing_subword_prefix"));
        assert_int_equal(try_json("{" MINI_MODEL ",\"normalizer\":{\"type\":\"Precompiled\"}}", err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "Precompiled"));
        assert_int_equal(try_json("{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},"
                                  "\"behavior\":\"Isolated\"}}", err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "regex"));
        assert_int_equal(try_json("{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"String\":\"x\"},"
                                  "\"behavior\":\"Sideways\"}}", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(try_json("{" MINI_MODEL ",\"decoder\":{\"type\":\"WordPiece\"}}", err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_int_equal(try_json("{" MINI_MODEL ",\"decoder\":{\"type\":\"Strip\",\"content\":\"ab\",\"start\":1,\"stop\":0}}",
                                  err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(try_json("{" MINI_MODEL ",\"added_tokens\":[{\"id\":3}]}", err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "added_tokens[0]"));
        assert_int_equal(try_json("{" MINI_MODEL ",\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":"
                                  "[{\"SpecialToken\":{\"id\":\"<s>\"}}],\"special_tokens\":{}}}", err, sizeof(err)),
                         TSR_E_INVAL);
        assert_int_equal(try_json("{" MINI_MODEL "}", err, sizeof(err)), TSR_OK);
}

static void test_bad_input(void **state) {
        tsr_tokenizer *t = NULL;
        uint32_t *ids = NULL, bad[] = {0, 3}, good[] = {2, 0};
        size_t n = 99, len;
        char *text = NULL, *delta = NULL;
        tsr_detok *d = NULL;
        static const char *const invalid[] = {"\xff", "a\xc3", "\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"};
        size_t i;
        (void)state;

        /* a tokenizer_config.json as transformers writes it for a model without a maximum:
         * an integer past int64, which jansson refuses as an integer */
        static const char cfg[] = "{\"model_max_length\": 1000000000000000019884624838656, \"eos_token\": \"ab\"}";
        assert_int_equal(tsr_tokenizer_new_json((const uint8_t *)"{" MINI_MODEL "}", strlen("{" MINI_MODEL "}"),
                                                (const uint8_t *)cfg, strlen(cfg), &t, NULL, 0), TSR_OK);
        for (i = 0; i < sizeof(invalid) / sizeof(invalid[0]); i++) {
                assert_int_equal(tsr_tokenizer_encode(t, invalid[i], strlen(invalid[i]), false, &ids, &n), TSR_E_INVAL);
                assert_null(ids);
                assert_int_equal(n, 99);
        }
        assert_int_equal(tsr_tokenizer_encode(t, "abab", 4, true, &ids, &n), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(ids[0], 2);
        free(ids);
        assert_int_equal(tsr_tokenizer_decode(t, bad, 2, false, &text, &len), TSR_E_INVAL);
        assert_null(text);
        /* nothing to decode: an empty string, not a NULL-plus-zero in the UTF-8 check (fuzz
         * regression tests/fuzz/regressions/tokenizer/empty-text-decode-null-plus-zero) */
        assert_int_equal(tsr_tokenizer_decode(t, NULL, 0, false, &text, &len), TSR_OK);
        assert_int_equal(len, 0);
        assert_string_equal(text, "");
        free(text);
        assert_int_equal(tsr_detok_new(t, true, &d), TSR_OK);
        assert_int_equal(tsr_detok_flush(d, &delta, &len), TSR_OK);
        assert_int_equal(len, 0);
        assert_string_equal(delta, "");
        free(delta);
        delta = NULL;
        tsr_detok_free(&d);
        assert_int_equal(tsr_tokenizer_decode(t, good, 2, false, &text, &len), TSR_OK);
        assert_string_equal(text, "ab a");  /* no decoder: HF joins the tokens with spaces */
        free(text);
        assert_int_equal(tsr_detok_new(t, false, &d), TSR_OK);
        assert_int_equal(tsr_detok_push(d, 3, &delta, &len), TSR_E_INVAL);
        assert_null(delta);
        tsr_detok_free(&d);
        assert_null(d);
        assert_int_equal(tsr_tokenizer_token_id(t, "ab", 2), 2);
        assert_int_equal(tsr_tokenizer_token_id(t, "zz", 2), -1);
        assert_string_equal(tsr_tokenizer_token_str(t, 1), "b");
        assert_null(tsr_tokenizer_token_str(t, 3));
        tsr_tokenizer_free(&t);
        tsr_tokenizer_free(&t);
        tsr_detok_free(NULL);
}

/* Huge inputs stay linear: a 4 MB single "word" and 4 MB of spaces. */
static void test_big_inputs(void **state) {
        char path[4096];
        tsr_tokenizer *t;
        size_t n = 4u << 20, nids, k;
        char *s = malloc(n);
        uint32_t *ids;
        (void)state;

        fixture_path(path, sizeof(path), "llama3_style.tokenizer.json");
        t = tok_from_json_file(path);
        for (k = 0; k < 2; k++) {
                memset(s, k ? ' ' : 'a', n);
                assert_int_equal(tsr_tokenizer_encode(t, s, n, false, &ids, &nids), TSR_OK);
                assert_true(nids > 0);
                free(ids);
        }
        free(s);
        tsr_tokenizer_free(&t);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_bad_json),
                cmocka_unit_test(test_bad_input),
                cmocka_unit_test(test_llama3_style),
                cmocka_unit_test(test_o200k_style),
                cmocka_unit_test(test_metaspace_bf),
                cmocka_unit_test(test_nemotron_style),
                cmocka_unit_test(test_smollm2_gguf),
                cmocka_unit_test(test_stories260k_gguf),
                cmocka_unit_test(test_llama2_tiny_gguf),
                cmocka_unit_test(test_nfc),
                cmocka_unit_test(test_nfkc),
                cmocka_unit_test(test_nfd),
                cmocka_unit_test(test_nfkd),
                cmocka_unit_test(test_llama_bpe_gguf),
                cmocka_unit_test(test_o200k_real),
                cmocka_unit_test(test_tekken_real),
                cmocka_unit_test(test_big_inputs),
        };
        if (getenv("TSR_TOK_BENCH"))
                return bench_main(getenv("TSR_TOK_BENCH"));
        return cmocka_run_group_tests(tests, NULL, NULL);
}
