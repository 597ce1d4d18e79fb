/* common.c - helpers the parsers of router/tools/ share: compiled patterns, the
 * stream holdback of a half-written marker, and the JSON call object reader of the
 * hermes and llama3_json formats. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "router/tools/parsers.h"

static tsr_tools_re *compiling;   /* only touched inside pthread_once */

static void compile_one(void) {
        int code;
        PCRE2_SIZE off;
        compiling->code = pcre2_compile((PCRE2_SPTR)compiling->pattern, PCRE2_ZERO_TERMINATED,
                                        compiling->flags | PCRE2_UTF | PCRE2_NO_UTF_CHECK, &code, &off, NULL);
        if (!compiling->code)
                tsr_log(TSR_LOG_ERROR, NULL, "tool parser pattern does not compile at %zu: %s", (size_t)off,
                        compiling->pattern);
}

pcre2_code *tsr_tools_re_get(tsr_tools_re *re) {
        /* pthread_once takes no argument: the pattern is handed over through a
         * file-scope pointer, under a lock so two first uses do not race. */
        static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&mu);
        compiling = re;
        pthread_once(&re->once, compile_one);
        pthread_mutex_unlock(&mu);
        return re->code;
}

int tsr_tools_re_match(tsr_tools_re *re, const char *s, size_t n, size_t from, uint32_t opts, size_t *ov, size_t n_ov) {
        pcre2_code *code = tsr_tools_re_get(re);
        pcre2_match_data *md;
        pcre2_match_context *mc;
        int rc;
        if (!code)
                return -1;
        md = pcre2_match_data_create_from_pattern(code, NULL);
        mc = pcre2_match_context_create(NULL);
        if (!md || !mc) {
                pcre2_match_data_free(md);
                pcre2_match_context_free(mc);
                return -1;
        }
        /* vLLM bounds these patterns by a timeout (VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS);
         * here a backtracking budget: past it the output stays content, as there. */
        pcre2_set_match_limit(mc, 10000000);
        /* No PCRE2_NO_UTF_CHECK: the text is a model's output; invalid UTF-8 is an error
         * (then content), never a read past the subject. */
        rc = pcre2_match(code, (PCRE2_SPTR)s, n, from, opts, md, mc);
        if (rc > 0) {
                PCRE2_SIZE *v = pcre2_get_ovector_pointer(md);
                uint32_t pairs = pcre2_get_ovector_count(md);
                for (size_t i = 0; i < n_ov; i++)
                        ov[i] = i / 2 < pairs ? (size_t)v[i] : (size_t)PCRE2_UNSET;
        }
        pcre2_match_data_free(md);
        pcre2_match_context_free(mc);
        if (rc == PCRE2_ERROR_NOMATCH)
                return 0;
        return rc > 0 ? 1 : -1;
}

size_t tsr_tools_holdback(const char *s, size_t n, const char *marker) {
        size_t ml = strlen(marker);
        for (size_t k = ml - 1; k > 0; k--)
                if (k <= n && memcmp(s + n - k, marker, k) == 0)
                        return k;
        return 0;
}

int tsr_tools_expect(const char *s, size_t n, size_t *i, char ch, bool py) {
        *i = tsr_canon_skip_ws(s, n, *i, py);
        if (*i == n)
                return 0;
        if (s[*i] != ch)
                return -1;
        *i = tsr_canon_skip_ws(s, n, *i + 1, py);
        return *i < n ? 1 : 0;
}

tsr_status tsr_tools_result_all_content(tsr_tools_result *r, const char *text, size_t len) {
        tsr_tools_result_done(r);
        if (!(r->content = strndup(text, len)))
                return TSR_E_NOMEM;
        r->content_len = len;
        return TSR_OK;
}

tsr_status tsr_tools_result_called(tsr_tools_result *r, const char *text, size_t content_len) {
        r->called = true;
        if (content_len && !(r->content = strndup(text, content_len)))
                return TSR_E_NOMEM;
        r->content_len = content_len;
        return TSR_OK;
}

int tsr_tools_json_call_whole(const char *s, size_t n, const char *const *arg_keys, tsr_tools_result *out) {
        /* a copy with a newline after it: a value at the very end has ended */
        char *seg = malloc(n + 2), *name = NULL;
        size_t pos = 0;
        bool has_args;
        tsr_buf args;
        int rc = 0;
        if (!seg)
                return -1;
        memcpy(seg, s, n);
        seg[n] = '\n';
        tsr_buf_init(&args, (size_t)64 << 20);
        if (tsr_tools_json_call(seg, n + 1, &pos, arg_keys, &name, &args, &has_args) == 1 &&
            tsr_canon_skip_ws(seg, n + 1, pos, false) == n + 1)
                rc = tsr_tools_result_add(out, name, strlen(name), (char *)args.data, args.len) == TSR_OK ? 1 : -1;
        free(seg);
        free(name);
        tsr_buf_done(&args);
        return rc;
}

/* A key read as canonical JSON equals `want` ("name" -> "\"name\""), escapes and all. */
static bool key_is(const tsr_buf *k, const char *want) {
        size_t wl = strlen(want);
        return k->len == wl + 2 && k->data[0] == '"' && memcmp(k->data + 1, want, wl) == 0 && k->data[wl + 1] == '"';
}

int tsr_tools_json_call(const char *s, size_t n, size_t *pos, const char *const *arg_keys, char **name, tsr_buf *args,
                        bool *has_args) {
        const tsr_canon_opts o = {0};
        size_t i = tsr_canon_skip_ws(s, n, *pos, false);
        tsr_buf key, scratch;
        int best = -1, rc = 1;
        bool first = true, name_bad = false;

        *name = NULL;
        *has_args = false;
        if (i == n)
                return 0;
        if (s[i] != '{')
                return -1;
        i++;
        tsr_buf_init(&key, (size_t)1 << 20);
        tsr_buf_init(&scratch, (size_t)64 << 20);
        for (;;) {
                int which = -1;
                i = tsr_canon_skip_ws(s, n, i, false);
                if (i == n) {
                        rc = 0;
                        break;
                }
                if (s[i] == '}') {
                        i++;
                        break;
                }
                if (!first && (rc = tsr_tools_expect(s, n, &i, ',', false)) != 1)
                        break;
                first = false;
                if (s[i] != '"') {
                        rc = -1;
                        break;
                }
                tsr_buf_reset(&key);
                if ((rc = tsr_canon_value(s, n, &i, &o, &key)) != 1)
                        break;
                if ((rc = tsr_tools_expect(s, n, &i, ':', false)) != 1)
                        break;
                for (int k = 0; arg_keys[k]; k++)
                        if (key_is(&key, arg_keys[k]))
                                which = k;
                if (which >= 0 && (best < 0 || which <= best)) {
                        /* the preferred key, or a repeat of it (the last one wins, as in a dict) */
                        tsr_buf_reset(args);
                        best = which;
                        *has_args = true;
                        if ((rc = tsr_canon_value(s, n, &i, &o, args)) != 1)
                                break;
                        continue;
                }
                tsr_buf_reset(&scratch);
                if ((rc = tsr_canon_value(s, n, &i, &o, &scratch)) != 1)
                        break;
                if (key_is(&key, "name")) {
                        json_t *v = scratch.data[0] == '"' ? json_loadb((char *)scratch.data, scratch.len, JSON_DECODE_ANY, NULL)
                                                           : NULL;
                        free(*name);
                        *name = NULL;
                        name_bad = !json_is_string(v);
                        if (v && json_is_string(v))
                                *name = strndup(json_string_value(v), json_string_length(v));
                        json_decref(v);
                }
        }
        tsr_buf_done(&key);
        tsr_buf_done(&scratch);
        if (rc == 1 && (name_bad || !*name || !*has_args))
                rc = -1;   /* KeyError or a name that is not a string, as vLLM's extraction fails */
        if (rc == 1)
                *pos = i;
        if (rc == -1) {
                free(*name);
                *name = NULL;
        }
        return rc;
}
