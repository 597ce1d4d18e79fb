/* hermes.c - vLLM's `hermes` parser (Hermes 2 Pro, Qwen 2.5 and the many models that
 * took the format):
 *
 *   [content]<tool_call>{"name": "f", "arguments": {...}}</tool_call>...
 *
 * Every <tool_call>...</tool_call> (the last may be unclosed) holds one JSON object
 * with "name" and "arguments"; `arguments` is json.dumps(obj["arguments"],
 * ensure_ascii=False).  content is the text before the first <tool_call> (null when
 * empty); text between and after calls is dropped.  Any call that does not load, or
 * lacks a key, leaves the whole output as content with no calls. */
#include <stdlib.h>
#include <string.h>

#include "router/tools/parsers.h"

#define OPEN "<tool_call>"
#define CLOSE "</tool_call>"

static tsr_tools_re call_re = TSR_TOOLS_RE("<tool_call>(.*?)</tool_call>|<tool_call>(.*)", PCRE2_DOTALL);
static const char *const arg_keys[] = {"arguments", NULL};

static const char *find(const char *s, size_t n, size_t from, const char *m) {
        return from <= n ? memmem(s + from, n - from, m, strlen(m)) : NULL;
}

static tsr_status final_parse(const char *text, size_t len, tsr_tools_result *out) {
        size_t ov[6], from = 0;
        tsr_buf args;
        tsr_status st = TSR_OK;
        bool ok = true;
        const char *first = find(text, len, 0, OPEN);

        if (!first)
                goto as_content;
        tsr_buf_init(&args, (size_t)64 << 20);
        for (;;) {
                int m = tsr_tools_re_match(&call_re, text, len, from, 0, ov, 6);
                size_t a, b, pos = 0;
                char *name = NULL;
                bool has_args;
                if (m == 0)
                        break;
                if (m < 0) {
                        ok = false;
                        break;
                }
                a = ov[2] != (size_t)PCRE2_UNSET ? ov[2] : ov[4];
                b = ov[2] != (size_t)PCRE2_UNSET ? ov[3] : ov[5];
                tsr_buf_reset(&args);
                /* json.loads: one object, whitespace around it */
                char *seg = malloc(b - a + 2);
                if (!seg) {
                        st = TSR_E_NOMEM;
                        break;
                }
                memcpy(seg, text + a, b - a);
                seg[b - a] = '\n';
                if (tsr_tools_json_call(seg, b - a + 1, &pos, arg_keys, &name, &args, &has_args) != 1 ||
                    tsr_canon_skip_ws(seg, b - a + 1, pos, false) != b - a + 1) {
                        free(seg);
                        free(name);
                        ok = false;
                        break;
                }
                free(seg);
                st = tsr_tools_result_add(out, name, strlen(name), (char *)args.data, args.len);
                free(name);
                if (st != TSR_OK)
                        break;
                from = ov[1] > from ? ov[1] : from + 1;
        }
        tsr_buf_done(&args);
        if (st != TSR_OK)
                return st;
        if (ok && out->n_calls) {
                size_t cl = (size_t)(first - text);
                out->called = true;
                if (cl && !(out->content = strndup(text, cl)))
                        return TSR_E_NOMEM;
                out->content_len = cl;
                return TSR_OK;
        }
        tsr_tools_result_done(out);
as_content:
        if (!(out->content = strndup(text, len)))
                return TSR_E_NOMEM;
        out->content_len = len;
        return TSR_OK;
}

/* A stream in progress: content up to the first <tool_call> (minus a half-written
 * one at the end), then each call's name and arguments as far as they are written. */
static tsr_status partial_parse(const char *text, size_t len, tsr_tools_result *out) {
        const char *p = find(text, len, 0, OPEN);
        tsr_buf args;
        tsr_status st = TSR_OK;

        if (!p) {
                out->safe_content = len - tsr_tools_holdback(text, len, OPEN);
                return TSR_OK;
        }
        out->safe_content = (size_t)(p - text);
        tsr_buf_init(&args, (size_t)64 << 20);
        while (p) {
                size_t a = (size_t)(p - text) + strlen(OPEN), pos = 0;
                const char *e = find(text, len, a, CLOSE);
                size_t b = e ? (size_t)(e - text) : len;
                char *name = NULL;
                bool has_args;
                int rc;
                tsr_buf_reset(&args);
                rc = tsr_tools_json_call(text + a, b - a, &pos, arg_keys, &name, &args, &has_args);
                if (rc < 0 || !name) {
                        free(name);
                        break;
                }
                st = tsr_tools_result_add(out, name, strlen(name), (char *)args.data, args.len);
                free(name);
                if (st != TSR_OK || rc == 0 || !e)
                        break;
                p = find(text, len, b + strlen(CLOSE), OPEN);
        }
        tsr_buf_done(&args);
        return st;
}

tsr_status tsr_tools_parse_hermes(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final, tsr_tools_result *out) {
        (void)ctx;
        memset(out, 0, sizeof(*out));
        return final ? final_parse(text, len, out) : partial_parse(text, len, out);
}
