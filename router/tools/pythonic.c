/* pythonic.c - vLLM's `pythonic` and `llama4_pythonic` parsers (Llama 3.2/4, ToolACE):
 *
 *   [get_weather(city='Paris', days=3), get_time(tz="CET")]
 *
 * The output must match vLLM's pattern from its start and be a Python list of calls
 * f(kw=literal, ...) with literals str/int/float/True/False/None and lists and dicts
 * of them (a unary minus is not a literal there, so -1 fails, as in vLLM).  arguments
 * = json.dumps({kw: value}) (llama4_pythonic with ensure_ascii, pythonic without);
 * positional arguments are ignored.  On success content is null; otherwise the whole
 * output is content.  llama4_pythonic first drops a leading <|python_start|> and every
 * <|python_end|>.  A stream looks for calls only when the output starts with '[' (or
 * <|python_start|>), see tools.c. */
#include <stdlib.h>
#include <string.h>

#include "router/tools/parsers.h"

#define PY_START "<|python_start|>"
#define PY_END "<|python_end|>"

static tsr_tools_re call_list_re = TSR_TOOLS_RE(
        "\\[([a-zA-Z]+\\w*\\(([a-zA-Z]+\\w*=.*,\\s*)*([a-zA-Z]+\\w*=.*\\s)?\\),\\s*)*"
        "([a-zA-Z]+\\w*\\(([a-zA-Z]+\\w*=.*,\\s*)*([a-zA-Z]+\\w*=.*\\s*)?\\)\\s*)+\\]",
        PCRE2_DOTALL);

static bool id_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool id_char(char c) { return id_start(c) || (c >= '0' && c <= '9'); }

static size_t ws(const char *s, size_t n, size_t i) { return tsr_canon_skip_ws(s, n, i, true); }

/* The list at s[0..n): 1 complete (and nothing but whitespace after), 0 cut, -1 not a
 * list of calls.  Calls are added as far as they go (names once followed by '('). */
static int parse_list(const char *s, size_t n, bool ascii, tsr_tools_result *out) {
        const tsr_canon_opts o = {.py = true, .allow_neg = false, .ascii = ascii};
        size_t i = ws(s, n, 0);
        tsr_buf args, scratch;
        int rc = 1;
        bool first_call = true;

        if (i == n)
                return 0;
        if (s[i] != '[')
                return -1;
        i++;
        tsr_buf_init(&args, (size_t)64 << 20);
        tsr_buf_init(&scratch, (size_t)64 << 20);
        for (;;) {
                size_t ns;
                bool first_arg = true;
                i = ws(s, n, i);
                if (i == n) {
                        rc = 0;
                        break;
                }
                if (s[i] == ']') {
                        i = ws(s, n, i + 1);
                        rc = i == n ? (first_call ? -1 : 1) : -1;   /* [] is no call list */
                        break;
                }
                if (!first_call) {
                        if ((rc = tsr_tools_expect(s, n, &i, ',', true)) != 1)
                                break;
                        if (s[i] == ']')
                                continue;   /* a trailing comma */
                }
                first_call = false;
                if (!id_start(s[i])) {
                        rc = -1;
                        break;
                }
                ns = i;
                while (i < n && id_char(s[i]))
                        i++;
                size_t ne = i;
                i = ws(s, n, i);
                if (i == n) {
                        rc = 0;
                        break;
                }
                if (s[i] != '(') {
                        rc = -1;   /* a.b(...), a name alone: not a call of a plain name */
                        break;
                }
                i++;
                tsr_buf_reset(&args);
                tsr_buf_append(&args, "{", 1);
                if (tsr_tools_result_add(out, s + ns, ne - ns, (char *)args.data, args.len) != TSR_OK) {
                        rc = -2;
                        break;
                }
                tsr_tools_call *call = &out->calls[out->n_calls - 1];
                /* arguments */
                for (;;) {
                        size_t ks, ke, j;
                        bool kw = false;
                        i = ws(s, n, i);
                        if (i == n) {
                                rc = 0;
                                break;
                        }
                        if (s[i] == ')') {
                                i++;
                                tsr_buf_append(&args, "}", 1);
                                break;
                        }
                        if (!first_arg) {
                                if ((rc = tsr_tools_expect(s, n, &i, ',', true)) != 1)
                                        break;
                                if (s[i] == ')')
                                        continue;
                        }
                        /* kw=value, or a positional value (ignored) */
                        ks = i;
                        if (id_start(s[i])) {
                                j = i;
                                while (j < n && id_char(s[j]))
                                        j++;
                                ke = j;
                                j = ws(s, n, j);
                                if (j == n) {
                                        rc = 0;
                                        break;
                                }
                                if (s[j] == '=' && !(j + 1 < n && s[j + 1] == '=')) {
                                        if (j + 1 == n) {
                                                rc = 0;
                                                break;
                                        }
                                        kw = true;
                                        i = j + 1;
                                }
                        }
                        if (kw) {
                                if (!first_arg && args.len > 1)
                                        tsr_buf_append(&args, ", ", 2);
                                if (tsr_canon_string(&args, s + ks, ke - ks, ascii) != TSR_OK ||
                                    tsr_buf_append(&args, ": ", 2) != TSR_OK) {
                                        rc = -2;
                                        break;
                                }
                                /* on a cut, args keeps the value's sure prefix */
                                if ((rc = tsr_canon_value(s, n, &i, &o, &args)) != 1)
                                        break;
                        } else {
                                tsr_buf_reset(&scratch);
                                if ((rc = tsr_canon_value(s, n, &i, &o, &scratch)) != 1)
                                        break;
                        }
                        first_arg = false;
                }
                /* what the arguments are so far */
                free(call->args);
                call->args = strndup((char *)args.data, args.len);
                call->args_len = call->args ? args.len : 0;
                if (!call->args) {
                        rc = -2;
                        break;
                }
                if (rc != 1)
                        break;
        }
        tsr_buf_done(&args);
        tsr_buf_done(&scratch);
        return rc;
}

static tsr_status parse(const char *text, size_t len, bool final, bool llama4, tsr_tools_result *out) {
        char *t = NULL;
        size_t tl = len;
        size_t ov[2];
        int rc;
        tsr_status st = TSR_OK;

        memset(out, 0, sizeof(*out));
        if (llama4 && len >= strlen(PY_START) && memcmp(text, PY_START, strlen(PY_START)) == 0) {
                /* drop the tag, and every <|python_end|> */
                const char *p = text + strlen(PY_START), *end = text + len;
                if (!(t = malloc(len + 1)))
                        return TSR_E_NOMEM;
                tl = 0;
                while (p < end) {
                        const char *q = memmem(p, (size_t)(end - p), PY_END, strlen(PY_END));
                        size_t k = q ? (size_t)(q - p) : (size_t)(end - p);
                        memcpy(t + tl, p, k);
                        tl += k;
                        p += k + (q ? strlen(PY_END) : 0);
                }
                t[tl] = '\0';
                text = t;
        }
        if (!final) {
                /* a stream: calls as far as written; nothing is content until the end */
                rc = parse_list(text, tl, llama4, out);
                if (rc == -2)
                        st = TSR_E_NOMEM;
                goto done;
        }
        if (tsr_tools_re_match(&call_list_re, text, tl, 0, PCRE2_ANCHORED, ov, 2) == 1) {
                rc = parse_list(text, tl, llama4, out);
                if (rc == -2) {
                        st = TSR_E_NOMEM;
                        goto done;
                }
                if (rc == 1) {
                        out->called = true;
                        goto done;
                }
        }
        st = tsr_tools_result_all_content(out, text, tl);
done:
        free(t);
        return st;
}

tsr_status tsr_tools_parse_pythonic(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                    tsr_tools_result *out) {
        (void)ctx;
        return parse(text, len, final, false, out);
}

tsr_status tsr_tools_parse_llama4_pythonic(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                           tsr_tools_result *out) {
        (void)ctx;
        return parse(text, len, final, true, out);
}
