/* test_template.c - the chat template engine against Python jinja2.
 *
 * Goldens: tests/fixtures/templates/goldens.json, written by
 * tests/fixtures/make_template_goldens.py with jinja2 in transformers' environment.  Every
 * template case and every focused language case must render byte-exact, or fail with the
 * same raise_exception message.  Templates are read where they live (../shared fixtures,
 * the SmolLM2 GGUF, tests/fixtures/tiny-hf); one that is absent or whose sha256 differs
 * from the golden is skipped with a note.  C-only cases cover syntax errors (line and
 * column in the message), the bounds (TSR_E_LIMIT) and argument checks. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <cmocka.h>
#include "tests/tsr_test.h"
#include <jansson.h>

#include "common/template.h"
#include "worker/load/model_meta.h"

/* ---------------------------------------------------------------- sha256 (FIPS 180-4) */

typedef struct sha256 {
        uint32_t h[8];
        uint8_t buf[64];
        uint64_t len;
        size_t nbuf;
} sha256;

static const uint32_t K256[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256 *s, const uint8_t *p) {
        uint32_t w[64], a, b, c, d, e, f, g, h;
        int i;
        for (i = 0; i < 16; i++)
                w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
        for (i = 16; i < 64; i++)
                w[i] = w[i - 16] + (ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3)) + w[i - 7] +
                       (ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10));
        a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
        for (i = 0; i < 64; i++) {
                uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
                uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
                h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha256_hex(const void *data, size_t n, char out[65]) {
        static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
        sha256 s = {0};
        const uint8_t *p = data;
        uint8_t pad[72] = {0x80};
        size_t padn, i;
        uint64_t bits = (uint64_t)n * 8;

        memcpy(s.h, iv, sizeof(iv));
        for (i = 0; i + 64 <= n; i += 64)
                sha256_block(&s, p + i);
        memcpy(s.buf, p + i, n - i);
        s.nbuf = n - i;
        padn = (s.nbuf < 56 ? 56 : 120) - s.nbuf;
        for (i = 0; i < 8; i++)
                pad[padn + i] = (uint8_t)(bits >> (56 - 8 * i));
        memcpy(s.buf + s.nbuf, pad, 64 - s.nbuf);
        sha256_block(&s, s.buf);
        if (padn + 8 + s.nbuf > 64)
                sha256_block(&s, pad + (64 - s.nbuf));
        for (i = 0; i < 8; i++)
                snprintf(out + 8 * i, 9, "%08x", s.h[i]);
}

/* ---------------------------------------------------------------- helpers */

static json_t *goldens;
static struct tm fixed_tm;

static size_t fixed_strftime(char *out, size_t outlen, const char *format, void *user) {
        (void)user;
        return strftime(out, outlen, format, &fixed_tm);
}

static char *read_file(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        char *buf = NULL;
        long n;
        if (!f)
                return NULL;
        if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
            (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
                buf[n] = '\0';
                *len = (size_t)n;
        } else {
                free(buf);
                buf = NULL;
        }
        fclose(f);
        return buf;
}

static const char *source_root(void) {
        const char *r = getenv("TSR_SOURCE_ROOT");
        return r ? r : ".";
}

static int group_setup(void **state) {
        char path[4096];
        json_error_t jerr;
        const char *date;
        (void)state;
        snprintf(path, sizeof(path), "%s/tests/fixtures/templates/goldens.json", source_root());
        goldens = json_load_file(path, 0, &jerr);
        if (!goldens) {
                fprintf(stderr, "cannot load %s: %s\n", path, jerr.text);
                return -1;
        }
        date = json_string_value(json_object_get(goldens, "fixed_date"));
        memset(&fixed_tm, 0, sizeof(fixed_tm));
        if (!date || sscanf(date, "%d-%d-%d %d:%d:%d", &fixed_tm.tm_year, &fixed_tm.tm_mon, &fixed_tm.tm_mday,
                            &fixed_tm.tm_hour, &fixed_tm.tm_min, &fixed_tm.tm_sec) != 6)
                return -1;
        fixed_tm.tm_year -= 1900;
        fixed_tm.tm_mon -= 1;
        fixed_tm.tm_isdst = -1;
        mktime(&fixed_tm);      /* fills tm_wday/tm_yday for %a, %j */
        return 0;
}

static int group_teardown(void **state) {
        (void)state;
        json_decref(goldens);
        return 0;
}

static tsr_template_opts test_opts(void) {
        tsr_template_opts o = {0};
        o.strftime_now = fixed_strftime;
        return o;
}

static void show_diff(const char *what, const char *got, size_t got_len, const char *want, size_t want_len) {
        size_t i = 0, lo;
        while (i < got_len && i < want_len && got[i] == want[i])
                i++;
        lo = i > 40 ? i - 40 : 0;
        fprintf(stderr, "MISMATCH %s at byte %zu (got %zu bytes, want %zu)\n  got:  \"", what, i, got_len, want_len);
        for (size_t k = lo; k < got_len && k < i + 60; k++)
                fprintf(stderr, (unsigned char)got[k] < 0x20 ? "\\x%02x" : "%c", (unsigned char)got[k]);
        fprintf(stderr, "\"\n  want: \"");
        for (size_t k = lo; k < want_len && k < i + 60; k++)
                fprintf(stderr, (unsigned char)want[k] < 0x20 ? "\\x%02x" : "%c", (unsigned char)want[k]);
        fprintf(stderr, "\"\n");
}

/* Render `t` with `ctx` and check it against `expect` (an object with expected or
 * expected_error/error_kind).  Returns 1 when it matches. */
static int check_case(const char *what, const tsr_template *t, const json_t *ctx, const json_t *expect) {
        tsr_template_opts o = test_opts();
        char *out = NULL, err[1024];
        size_t out_len = 0;
        tsr_status st = tsr_template_render(t, ctx, &o, &out, &out_len, err, sizeof(err));
        const json_t *want = json_object_get(expect, "expected");
        const char *want_sha = json_string_value(json_object_get(expect, "expected_sha256"));
        int ok = 0;

        if (want_sha) {
                /* large real templates: the golden keeps the text's sha256 and length */
                char hex[65];
                if (st != TSR_OK) {
                        fprintf(stderr, "FAIL %s: render failed (%s): %s\n", what, tsr_status_str(st), err);
                } else {
                        sha256_hex(out, out_len, hex);
                        if (strcmp(hex, want_sha) != 0 ||
                            out_len != (size_t)json_integer_value(json_object_get(expect, "expected_len")))
                                fprintf(stderr, "FAIL %s: output (%zu bytes) differs from jinja2's (%lld bytes):\n%s\n",
                                        what, out_len, (long long)json_integer_value(json_object_get(expect, "expected_len")),
                                        out);
                        else
                                ok = 1;
                }
        } else if (want) {
                if (st != TSR_OK) {
                        fprintf(stderr, "FAIL %s: render failed (%s): %s\n", what, tsr_status_str(st), err);
                } else if (out_len != json_string_length(want) || memcmp(out, json_string_value(want), out_len) != 0) {
                        show_diff(what, out, out_len, json_string_value(want), json_string_length(want));
                } else {
                        ok = 1;
                }
        } else {
                const char *msg = json_string_value(json_object_get(expect, "expected_error"));
                const char *kind = json_string_value(json_object_get(expect, "error_kind"));
                if (st == TSR_OK) {
                        fprintf(stderr, "FAIL %s: rendered but jinja2 raised: %s\n", what, msg);
                } else if (st != TSR_E_INVAL) {
                        fprintf(stderr, "FAIL %s: status %s, want invalid (%s)\n", what, tsr_status_str(st), err);
                } else if (kind && !strcmp(kind, "raise") && strcmp(err, msg) != 0) {
                        fprintf(stderr, "FAIL %s: raise_exception message\n  got:  %s\n  want: %s\n", what, err, msg);
                } else {
                        ok = 1;
                }
        }
        free(out);
        return ok;
}

static char *template_source(const json_t *tpl, size_t *len, char *why, size_t whylen) {
        const char *source = json_string_value(json_object_get(tpl, "source"));
        const char *file = json_string_value(json_object_get(tpl, "file"));
        char path[4096];
        char *src = NULL;

        if (!source || !file)
                return NULL;
        if (!strcmp(source, "shared")) {
                const char *fx = getenv("TSR_FIXTURES");
                snprintf(path, sizeof(path), "%s/chat_templates/%s", fx ? fx : "../shared/fixtures", file);
                if (!(src = read_file(path, len)))
                        snprintf(why, whylen, "%s absent", path);
        } else if (!strcmp(source, "llama.cpp")) {
                /* fetched by scripts/fetch-vocab.sh */
                snprintf(path, sizeof(path), "%s/.cache/vocab/templates/%s", source_root(), file);
                if (!(src = read_file(path, len)))
                        snprintf(why, whylen, "%s absent (scripts/fetch-vocab.sh fetches it)", path);
        } else if (!strcmp(source, "gguf")) {
                tsr_model_meta *m = NULL;
                char err[512];
                snprintf(path, sizeof(path), "%s/.cache/models/%s", source_root(), file);
                if (tsr_model_meta_load(path, &m, err, sizeof(err)) != TSR_OK) {
                        snprintf(why, whylen, "%.3000s not loadable: %.500s", path, err);
                } else if (!m->chat_template) {
                        snprintf(why, whylen, "%s has no chat template", path);
                } else {
                        *len = strlen(m->chat_template);
                        src = strdup(m->chat_template);
                }
                tsr_model_meta_free(&m);
        } else {
                json_error_t jerr;
                json_t *tc;
                snprintf(path, sizeof(path), "%s/tests/fixtures/%s", source_root(), file);
                if (!(tc = json_load_file(path, 0, &jerr))) {
                        snprintf(why, whylen, "%s: %s", path, jerr.text);
                } else {
                        const json_t *s = json_object_get(tc, "chat_template");
                        if (json_is_string(s)) {
                                *len = json_string_length(s);
                                src = malloc(*len + 1);
                                if (src)
                                        memcpy(src, json_string_value(s), *len + 1);
                        }
                        json_decref(tc);
                }
        }
        return src;
}

static json_t *case_context(const json_t *tpl, const json_t *cs) {
        json_t *ctx = json_object();
        const json_t *conv = json_object_get(json_object_get(goldens, "conversations"),
                                             json_string_value(json_object_get(cs, "conv")));
        const json_t *tools = json_object_get(cs, "tools");
        const json_t *agp = json_object_get(cs, "add_generation_prompt");

        json_object_set(ctx, "messages", (json_t *)conv);
        if (json_is_string(tools))
                json_object_set(ctx, "tools",
                                json_object_get(json_object_get(goldens, "tools"), json_string_value(tools)));
        if (agp && !json_is_null(agp))
                json_object_set(ctx, "add_generation_prompt", (json_t *)agp);
        json_object_update(ctx, json_object_get(tpl, "special"));
        json_object_update(ctx, json_object_get(cs, "kwargs"));
        return ctx;
}

/* ---------------------------------------------------------------- golden templates */

/* Every golden template from `shared` (../shared/fixtures) or from every other source
 * (the repo, the demo model, llama.cpp's collection fetched by scripts/fetch-vocab.sh).
 * A template that is absent or whose file differs from the golden's sha256 fails: the
 * test command fetches pinned files, so only a whole ../shared missing is a skip. */
static void run_golden_templates(bool shared) {
        size_t i, k, n_run = 0, n_fail = 0, n_templates = 0;
        const json_t *tpls = json_object_get(goldens, "templates");

        for (i = 0; i < json_array_size(tpls); i++) {
                const json_t *tpl = json_array_get(tpls, i), *cases = json_object_get(tpl, "cases");
                const char *name = json_string_value(json_object_get(tpl, "name"));
                const char *source = json_string_value(json_object_get(tpl, "source"));
                char why[4600] = "", hex[65], err[512], what[512];
                size_t len = 0, pass = 0;
                char *src;
                tsr_template *t = NULL;
                tsr_status st;

                if ((source && !strcmp(source, "shared")) != shared)
                        continue;
                n_templates++;
                if (!(src = template_source(tpl, &len, why, sizeof(why)))) {
                        fprintf(stderr, "FAIL %s: %s\n", name, why);
                        n_fail += json_array_size(cases);
                        continue;
                }
                sha256_hex(src, len, hex);
                if (strcmp(hex, json_string_value(json_object_get(tpl, "sha256"))) != 0) {
                        fprintf(stderr, "FAIL %s: sha256 %s differs from the golden's\n", name, hex);
                        free(src);
                        n_fail += json_array_size(cases);
                        continue;
                }
                st = tsr_template_parse(src, len, &t, err, sizeof(err));
                free(src);
                if (st != TSR_OK) {
                        /* jinja2 rejects it too when every case recorded an error (a filter
                         * jinja2 lacks, such as llama.cpp's from_json) */
                        size_t n_err = 0;
                        for (k = 0; k < json_array_size(cases); k++)
                                n_err += json_object_get(json_array_get(cases, k), "expected_error") != NULL;
                        n_run += json_array_size(cases);
                        if (st == TSR_E_INVAL && n_err == json_array_size(cases)) {
                                printf("%s: parse error, as in jinja2: %s\n", name, err);
                                continue;
                        }
                        fprintf(stderr, "FAIL %s: parse: %s\n", name, err);
                        n_fail += json_array_size(cases);
                        continue;
                }
                for (k = 0; k < json_array_size(cases); k++) {
                        const json_t *cs = json_array_get(cases, k);
                        json_t *ctx = case_context(tpl, cs);
                        snprintf(what, sizeof(what), "%s case %zu (%s)", name, k,
                                 json_string_value(json_object_get(cs, "conv")));
                        if (check_case(what, t, ctx, cs))
                                pass++;
                        else
                                n_fail++;
                        n_run++;
                        json_decref(ctx);
                }
                printf("%-45s %zu/%zu cases pass\n", name, pass, json_array_size(cases));
                tsr_template_free(&t);
        }
        printf("golden templates (%s): %zu templates, %zu cases run, %zu failed\n", shared ? "shared" : "repo and fetched",
               n_templates, n_run, n_fail);
        assert_true(n_templates > 0);
        assert_int_equal(n_fail, 0);
}

static void test_golden_templates(void **state) {
        (void)state;
        run_golden_templates(false);
}

static void test_golden_templates_shared(void **state) {
        const char *fx = getenv("TSR_FIXTURES");
        char dir[4096];
        struct stat sb;
        (void)state;

        snprintf(dir, sizeof(dir), "%s/chat_templates", fx ? fx : "../shared/fixtures");
        if (stat(dir, &sb) != 0)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", dir);
        run_golden_templates(true);
}

static void test_golden_unit(void **state) {
        const json_t *unit = json_object_get(goldens, "unit");
        size_t i, n_fail = 0;
        (void)state;

        for (i = 0; i < json_array_size(unit); i++) {
                const json_t *u = json_array_get(unit, i);
                const char *name = json_string_value(json_object_get(u, "name"));
                const json_t *src = json_object_get(u, "template");
                tsr_template *t = NULL;
                char err[512];
                tsr_status st = tsr_template_parse(json_string_value(src), json_string_length(src), &t, err, sizeof(err));
                if (st != TSR_OK) {
                        /* jinja2 rejected it at parse time too */
                        if (!json_object_get(u, "expected_error")) {
                                fprintf(stderr, "FAIL unit %s: parse: %s\n", name, err);
                                n_fail++;
                        }
                        continue;
                }
                if (!check_case(name, t, json_object_get(u, "context"), u))
                        n_fail++;
                tsr_template_free(&t);
        }
        printf("unit cases: %zu run, %zu failed\n", json_array_size(unit), n_fail);
        assert_int_equal(n_fail, 0);
}

/* ---------------------------------------------------------------- C-only cases */

static tsr_status render_str(const char *src, const char *ctx_json, const tsr_template_opts *o, char **out,
                             char *err, size_t errlen) {
        tsr_template *t = NULL;
        json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : json_object();
        size_t len;
        tsr_status st = tsr_template_parse(src, strlen(src), &t, err, errlen);
        if (st == TSR_OK)
                st = tsr_template_render(t, ctx, o, out, &len, err, errlen);
        tsr_template_free(&t);
        json_decref(ctx);
        return st;
}

static void expect_syntax(const char *src, const char *where) {
        tsr_template *t = NULL;
        char err[512] = "";
        tsr_status st = tsr_template_parse(src, strlen(src), &t, err, sizeof(err));
        if (st != TSR_E_INVAL || !strstr(err, where))
                fprintf(stderr, "syntax case %s: status %d, message \"%s\", want \"%s\"\n", src, st, err, where);
        assert_int_equal(st, TSR_E_INVAL);
        assert_non_null(strstr(err, where));
        assert_null(t);
}

static void test_syntax_errors(void **state) {
        (void)state;
        expect_syntax("{% if x %}never closed", "line 1, column 23");
        expect_syntax("a\n{{ x ", "line 2, column 3");
        expect_syntax("line1\n  {{ 1 + }}", "line 2, column 10");
        expect_syntax("{% for x in %}{% endfor %}", "line 1, column 13");
        expect_syntax("{% endif %}", "line 1, column 4");
        expect_syntax("{{ x | nosuchfilter }}", "no filter named 'nosuchfilter'");
        expect_syntax("{{ x is nosuchtest }}", "no test named 'nosuchtest'");
        expect_syntax("{# unclosed comment", "missing end of comment");
        expect_syntax("{{ 'unterminated }}", "unterminated string");
        expect_syntax("{{ (1 }}", "line 1");
        expect_syntax("{{ 1 ] }}", "unexpected ']'");
        expect_syntax("{% break %}", "outside of a loop");
        expect_syntax("{% include 'x' %}", "unsupported tag 'include'");
        expect_syntax("{% macro m(a=1, b) %}{% endmacro %}", "non-default argument");
        expect_syntax("{% for x in y %}{% else %}{% else %}{% endfor %}", "line 1");
}

static void test_limits(void **state) {
        tsr_template_opts o = test_opts();
        char *out = NULL, err[512];
        tsr_status st;
        (void)state;

        /* nested huge loops: stopped by the step bound */
        o.max_steps = 2000000;
        st = render_str("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL, &o,
                        &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        assert_null(out);
        /* one range past jinja2's sandbox MAX_RANGE */
        st = render_str("{% for i in range(100000000) %}{% endfor %}", NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        /* unbounded recursion through a macro: stopped by the depth bound */
        st = render_str("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        assert_non_null(strstr(err, "nested deeper"));
        /* exponential output: stopped by the output bound */
        o = test_opts();
        o.max_output = 1 << 20;
        st = render_str("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% else %}xxxxxxxx{% endif %}"
                        "{% endmacro %}{{ f(40) }}",
                        NULL, &o, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        /* doubling a string in a loop: output or memory bound */
        st = render_str("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                        "{{ ns.s | length }}",
                        NULL, &o, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        st = render_str("{{ 'x' * 1000000000 }}", NULL, &o, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        /* memory bound on structure growth */
        o = test_opts();
        o.max_memory = 4 << 20;
        st = render_str("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}"
                        "{% endfor %}{{ ns.l | length }}",
                        NULL, &o, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        assert_null(out);
}

static void test_deep_nesting(void **state) {
        char *src = malloc(200000), *out = NULL, err[512];
        tsr_template *t = NULL;
        size_t i, n = 0;
        tsr_status st;
        (void)state;

        /* a parser stack bomb: 50000 opening parentheses */
        n += (size_t)sprintf(src, "{{ ");
        for (i = 0; i < 50000; i++)
                src[n++] = '(';
        src[n] = '\0';
        st = tsr_template_parse(src, n, &t, err, sizeof(err));
        assert_int_not_equal(st, TSR_OK);
        /* nested ifs */
        n = 0;
        for (i = 0; i < 5000; i++)
                n += (size_t)sprintf(src + n, "{%% if 1 %%}");
        st = tsr_template_parse(src, n, &t, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        /* not x 10000 times */
        n = (size_t)sprintf(src, "{{ ");
        for (i = 0; i < 10000; i++)
                n += (size_t)sprintf(src + n, "not ");
        n += (size_t)sprintf(src + n, "1 }}");
        st = tsr_template_parse(src, n, &t, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        /* deeply nested data built at render time, then printed and serialised */
        st = render_str("{% set ns = namespace(x=[]) %}{% for i in range(20000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                        "{{ ns.x | tojson }}",
                        NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_LIMIT);
        free(src);
}

static void test_raise_and_errors(void **state) {
        char *out = NULL, err[512];
        tsr_status st;
        (void)state;

        st = render_str("{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
                        NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_INVAL);
        assert_string_equal(err, "Conversation roles must alternate user/assistant/user/assistant/...");
        assert_null(out);
        st = render_str("{{ x.y }}", "{\"x\": null}", NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_OK);
        assert_string_equal(out, "");
        free(out);
        out = NULL;
        st = render_str("{{ x.y.z }}", "{}", NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_INVAL);
        assert_non_null(strstr(err, "'x' is undefined"));
        st = render_str("{{ 1 // 0 }}", NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_INVAL);
        st = render_str("{{ 9223372036854775807 + 1 }}", NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_INVAL);
        st = render_str("{{ [1] < 'a' }}", NULL, NULL, &out, err, sizeof(err));
        assert_int_equal(st, TSR_E_INVAL);
}

/* Inputs the fuzzer (tests/fuzz/fuzz_template.c) found; the same files are replayed from
 * tests/fuzz/regressions/template/.  Expected text from Python jinja2. */
static void test_fuzz_regressions(void **state) {
        char *out = NULL, err[512];
        (void)state;

        /* sort(reverse=true) of an empty list copied from its NULL storage (UBSan) */
        assert_int_equal(render_str("{{ xs | sort(reverse=true) }}|{{ [] | sort(reverse=true) }}|"
                                    "{{ [2, 1, 2] | sort(reverse=true) }}", NULL, NULL, &out, err, sizeof(err)),
                         TSR_OK);
        assert_string_equal(out, "[]|[]|[2, 2, 1]");
        free(out);
        out = NULL;
        /* valid Jinja outside the subset is TSR_E_UNSUPPORTED with a position (template.h) */
        assert_int_equal(render_str("{% set ns = namespace(n=0) %}{% set ns.n %}1{% endset %}", NULL, NULL, &out, err,
                                    sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "line 1, column"));
        assert_null(out);
        /* a slice inside a subscript tuple reached the evaluator as a value (TSR_E_INTERNAL);
         * jinja2's from_string fails on it (Python cannot compile it), so it is a syntax error */
        expect_syntax("{{ m['', :] }}", "line 1, column 10: a slice cannot be part of a subscript tuple");
        expect_syntax("{{ m[:, 1] }}", "a slice cannot be part of a subscript tuple");
        /* raise_exception() with no message failed with an empty one; Python raises a TypeError */
        assert_int_equal(render_str("{% if true %}{{ raise_exception() }}{% endif %}after", NULL, NULL, &out, err,
                                    sizeof(err)), TSR_E_INVAL);
        assert_string_equal(err, "raise_exception() missing 1 required positional argument: 'message'");
        assert_null(out);
        /* '' times 555,555,555,553 ran that many empty appends (a 15 s libFuzzer timeout);
         * Python gives '' at once */
        assert_int_equal(render_str("{{ ('' * 555555555553) | length }}|{{ 'ab' * -3 }}|{{ 'ab' * 3 }}|"
                                    "{{ 'a'[0] * 2 * -2 * 2 * 555555555555 }}.", NULL, NULL, &out, err, sizeof(err)),
                         TSR_OK);
        assert_string_equal(out, "0||ababab|.");
        free(out);
}

static void test_api_edges(void **state) {
        tsr_template *t = NULL;
        char *out = NULL, err[256];
        size_t len = 99;
        json_t *arr = json_array();
        (void)state;

        /* empty template renders the empty string; NULL context is an empty one */
        assert_int_equal(tsr_template_parse("", 0, &t, err, sizeof(err)), TSR_OK);
        assert_int_equal(tsr_template_render(t, NULL, NULL, &out, &len, err, sizeof(err)), TSR_OK);
        assert_int_equal(len, 0);
        assert_string_equal(out, "");
        free(out);
        out = NULL;
        /* a context that is not an object */
        assert_int_equal(tsr_template_render(t, arr, NULL, &out, &len, err, sizeof(err)), TSR_E_INVAL);
        assert_null(out);
        tsr_template_free(&t);
        assert_null(t);
        tsr_template_free(&t);
        tsr_template_free(NULL);
        /* embedded NUL bytes in the source are data */
        assert_int_equal(tsr_template_parse("a\0b{{ 1 }}", 10, &t, err, sizeof(err)), TSR_OK);
        assert_int_equal(tsr_template_render(t, NULL, NULL, &out, &len, err, sizeof(err)), TSR_OK);
        assert_int_equal(len, 4);
        assert_memory_equal(out, "a\0b1", 4);
        free(out);
        tsr_template_free(&t);
        json_decref(arr);
}

/* strftime_now with the default hook renders today's date */
static void test_strftime_default(void **state) {
        char *out = NULL, err[256], want[64];
        time_t now = time(NULL);
        struct tm tm;
        (void)state;

        localtime_r(&now, &tm);
        strftime(want, sizeof(want), "%Y", &tm);
        assert_int_equal(render_str("{{ strftime_now('%Y') }}", NULL, NULL, &out, err, sizeof(err)), TSR_OK);
        assert_string_equal(out, want);
        free(out);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_golden_templates),
                cmocka_unit_test(test_golden_templates_shared),
                cmocka_unit_test(test_golden_unit),
                cmocka_unit_test(test_syntax_errors),
                cmocka_unit_test(test_limits),
                cmocka_unit_test(test_deep_nesting),
                cmocka_unit_test(test_raise_and_errors),
                cmocka_unit_test(test_api_edges),
                cmocka_unit_test(test_fuzz_regressions),
                cmocka_unit_test(test_strftime_default),
        };
        return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
