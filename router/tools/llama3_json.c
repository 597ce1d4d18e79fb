/* llama3_json.c - vLLM's `llama3_json` parser (Llama 3.x JSON tool calls, with or
 * without a leading <|python_tag|>):
 *
 *   {"name": "f", "parameters": {...}}; {"name": "g", "arguments": {...}}
 *
 * The whole output is searched with vLLM's pattern (objects nested at most two deep,
 * joined by ';'); the first match is split at every ';' and each piece loaded; a
 * call's arguments are obj["arguments"] if present, else obj["parameters"], dumped
 * with ensure_ascii=False.  On success content is null (text around the JSON is
 * dropped); anything malformed leaves the whole output as content.  A stream looks for
 * calls only when the output starts with '{' or <|python_tag|> (tools.c). */
#include <stdlib.h>
#include <string.h>

#include "router/tools/parsers.h"

#define BOT "<|python_tag|>"

static tsr_tools_re calls_re = TSR_TOOLS_RE(
        "{[^{}]*(?:{[^{}]*}[^{}]*)*}(?:\\s*;\\s*{[^{}]*(?:{[^{}]*}[^{}]*)*})*", PCRE2_DOTALL);
static const char *const arg_keys[] = {"arguments", "parameters", NULL};

static bool py_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static tsr_status final_parse(const char *text, size_t len, tsr_tools_result *out) {
        size_t ov[2];

        if (!memmem(text, len, BOT, strlen(BOT)) && !memchr(text, '{', len))
                return tsr_tools_result_all_content(out, text, len);
        if (tsr_tools_re_match(&calls_re, text, len, 0, 0, ov, 2) != 1)
                return tsr_tools_result_all_content(out, text, len);
        for (size_t a = ov[0]; a < ov[1];) {
                /* str.split(';') then strip: a ';' inside a string splits too, as there */
                const char *semi = memchr(text + a, ';', ov[1] - a);
                size_t b = semi ? (size_t)(semi - text) : ov[1], pa = a, pb = b;
                int rc;
                while (pa < pb && py_space(text[pa]))
                        pa++;
                while (pb > pa && py_space(text[pb - 1]))
                        pb--;
                a = b + 1;
                if (pa == pb)
                        continue;
                if ((rc = tsr_tools_json_call_whole(text + pa, pb - pa, arg_keys, out)) < 0)
                        return TSR_E_NOMEM;
                if (rc == 0)
                        return tsr_tools_result_all_content(out, text, len);
        }
        return tsr_tools_result_called(out, text, 0);   /* content: None */
}

/* A stream in progress (it starts with '{' or the tag): the objects one after the
 * other, "; " between them. */
static tsr_status partial_parse(const char *text, size_t len, tsr_tools_result *out) {
        size_t i = len >= strlen(BOT) && memcmp(text, BOT, strlen(BOT)) == 0 ? strlen(BOT) : 0;
        tsr_buf args;
        tsr_status st = TSR_OK;
        tsr_buf_init(&args, (size_t)64 << 20);
        while (i < len) {
                char *name = NULL;
                bool has_args;
                int rc;
                tsr_buf_reset(&args);
                rc = tsr_tools_json_call(text, len, &i, arg_keys, &name, &args, &has_args);
                if (rc < 0 || !name) {
                        free(name);
                        break;
                }
                st = tsr_tools_result_add(out, name, strlen(name), (char *)args.data, args.len);
                free(name);
                if (st != TSR_OK || rc == 0)
                        break;
                i = tsr_canon_skip_ws(text, len, i, false);
                if (i == len || text[i] != ';')
                        break;
                i = tsr_canon_skip_ws(text, len, i + 1, false);
        }
        tsr_buf_done(&args);
        return st;
}

tsr_status tsr_tools_parse_llama3_json(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                       tsr_tools_result *out) {
        (void)ctx;
        memset(out, 0, sizeof(*out));
        return final ? final_parse(text, len, out) : partial_parse(text, len, out);
}
