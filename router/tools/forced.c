/* forced.c - the outputs of tool_choice "required" and of a named tool, which
 * structured outputs force into shape (router/openai.c builds the schemas, as vLLM 0.12's
 * _get_json_schema_from_tool):
 *
 *   named     the whole output is the arguments object of the named tool: one call,
 *             `arguments` the text as generated (vLLM passes the content through);
 *   required  the output is [{"name": ..., "parameters": {...}}, ...]: a call per
 *             element, `arguments` json.dumps(parameters, ensure_ascii=False).
 *
 * Both are parsers of the tools.h kind, so the stream layer sends their deltas (name
 * first, arguments in pieces) exactly as for --tool-call-parser output.  vLLM's message
 * has content "" beside the calls.  An output the grammar did not let finish (length)
 * that does not parse is left as content. */
#include <stdlib.h>
#include <string.h>

#include "router/tools/parsers.h"

static const char *const param_keys[] = {"parameters", NULL};

static tsr_status called_empty_content(tsr_tools_result *out) {
        out->called = true;
        if (!(out->content = strdup("")))
                return TSR_E_NOMEM;
        out->content_len = 0;
        return TSR_OK;
}

static tsr_status parse_named(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                              tsr_tools_result *out) {
        tsr_status st;
        memset(out, 0, sizeof(*out));
        if (!ctx->forced_name)
                return final ? tsr_tools_result_all_content(out, text, len) : TSR_OK;
        if ((st = tsr_tools_result_add(out, ctx->forced_name, strlen(ctx->forced_name), text, len)) != TSR_OK)
                return st;
        return final ? called_empty_content(out) : TSR_OK;
}

/* The array's calls at text[0..len): 1 all complete (and the array closed), 0 cut
 * short (out has the calls so far, the last one's arguments a prefix), -1 malformed. */
static int required_calls(const char *text, size_t len, tsr_tools_result *out) {
        size_t i = tsr_canon_skip_ws(text, len, 0, false);
        tsr_buf args;
        int rc = 0;
        if (i == len)
                return 0;
        if (text[i++] != '[')
                return -1;
        tsr_buf_init(&args, (size_t)64 << 20);
        for (bool first = true;; first = false) {
                char *name = NULL;
                bool has_args = false;
                i = tsr_canon_skip_ws(text, len, i, false);
                if (i == len) {
                        rc = 0;
                        break;
                }
                if (text[i] == ']') {
                        rc = first ? -1 : 1;   /* minItems 1 */
                        break;
                }
                if (!first && (rc = tsr_tools_expect(text, len, &i, ',', false)) != 1)
                        break;
                tsr_buf_reset(&args);
                rc = tsr_tools_json_call(text, len, &i, param_keys, &name, &args, &has_args);
                if (rc < 0 || (rc == 1 && (!name || !has_args))) {
                        free(name);
                        rc = -1;
                        break;
                }
                if (name && tsr_tools_result_add(out, name, strlen(name), (char *)args.data, args.len) != TSR_OK) {
                        free(name);
                        rc = -2;
                        break;
                }
                free(name);
                if (rc == 0)
                        break;
        }
        tsr_buf_done(&args);
        return rc;
}

static tsr_status parse_required(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                 tsr_tools_result *out) {
        int rc;
        (void)ctx;
        memset(out, 0, sizeof(*out));
        rc = required_calls(text, len, out);
        if (rc == -2)
                return TSR_E_NOMEM;
        if (!final)
                return TSR_OK;
        if (rc != 1 || tsr_canon_skip_ws(text, len, 0, false) == len)
                return tsr_tools_result_all_content(out, text, len);
        return called_empty_content(out);
}

static const tsr_tools_parser named_parser = {"(tool_choice named)", true, NULL, parse_named};
static const tsr_tools_parser required_parser = {"(tool_choice required)", false, NULL, parse_required};

const tsr_tools_parser *tsr_tools_forced_parser(const char *tool_choice) {
        if (tool_choice && strcmp(tool_choice, "function") == 0)
                return &named_parser;
        if (tool_choice && strcmp(tool_choice, "required") == 0)
                return &required_parser;
        return NULL;
}
