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
        const char *first = find(text, len, 0, OPEN);

        if (!first)
                return tsr_tools_result_all_content(out, text, len);
        for (;;) {
                int m = tsr_tools_re_match(&call_re, text, len, from, 0, ov, 6), rc;
                if (m == 0)
                        break;
                if (m < 0)
                        return tsr_tools_result_all_content(out, text, len);
                /* the closed form's group, or the unclosed one's: json.loads of it */
                bool closed = ov[2] != (size_t)PCRE2_UNSET;
                size_t a = closed ? ov[2] : ov[4], b = closed ? ov[3] : ov[5];
                if ((rc = tsr_tools_json_call_whole(text + a, b - a, arg_keys, out)) < 0)
                        return TSR_E_NOMEM;
                if (rc == 0)
                        return tsr_tools_result_all_content(out, text, len);
                from = ov[1] > from ? ov[1] : from + 1;
        }
        if (!out->n_calls)
                return tsr_tools_result_all_content(out, text, len);
        return tsr_tools_result_called(out, text, (size_t)(first - text));
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
