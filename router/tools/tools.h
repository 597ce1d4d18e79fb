/* tools.h - tool-call and reasoning output parsers of the router (issue #17), the way
 * vLLM 0.12's --tool-call-parser and --reasoning-parser read a model's output.
 *
 * The router owns text (DESIGN.md), so the parsers run where the detokenized output
 * is: on the loop thread, once per choice at the end (non-stream) or once per Output
 * (stream).  Each parser is a file of router/tools/ and a row of the table in
 * tools.c; a parser is a pure function of the text so far:
 *
 *   parse(text, final) -> content, tool calls
 *
 * With final = true it is vLLM's extract_tool_calls on the whole output: same calls
 * (name, `arguments` as Python's json.dumps writes them), same `content` (null where
 * vLLM gives None), and a malformed output left whole as content.  With final = false
 * (a stream in progress) it reports only what can no longer change: the bytes that are
 * surely content, each call's name once complete, and the prefix of each call's
 * arguments string that the final string is sure to start with.  The stream layer
 * (tsr_tools_stream) sends the growth of those as vLLM's deltas: content, then per call
 * {index, id, type, function: {name}} first and {index, function: {arguments}} pieces,
 * so that every split of the output into deltas ends with the same calls as the
 * non-streamed response.
 *
 * Reasoning (deepseek_r1, nemotron_v3): <think>...</think> split into reasoning and
 * content, in both modes, tsr_reasoning_*.
 *
 * Thread: whichever calls; no global state besides the const tables and the compiled
 * PCRE2 patterns (compiled once under pthread_once, read-only after). */
#ifndef TSR_ROUTER_TOOLS_H
#define TSR_ROUTER_TOOLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"
#include "common/tsr_status.h"

/* One call as a parser sees it.  Strings are malloc'd and NUL-terminated. */
typedef struct tsr_tools_call {
        char *name;                   /* NULL until complete */
        char *args;                   /* arguments JSON text so far (final: all of it) */
        size_t args_len;
} tsr_tools_call;

typedef struct tsr_tools_result {
        bool called;                  /* final: vLLM's tools_called */
        char *content;                /* final: content, NULL = null */
        size_t content_len;
        size_t safe_content;          /* partial: leading bytes of the text that are surely content */
        tsr_tools_call *calls;
        size_t n_calls;
} tsr_tools_result;

/* What a parser may read of the request: the `tools` list (qwen3_coder converts
 * parameter values by their schema types). */
typedef struct tsr_tools_ctx {
        json_t *tools;                /* borrowed; NULL = none */
        const char *forced_name;      /* tool_choice naming a function: its name (borrowed) */
} tsr_tools_ctx;

typedef struct tsr_tools_parser {
        const char *name;             /* the --tool-call-parser value */
        /* The first delta of a call always carries `arguments` (what is known then, ""
         * too: vLLM's pythonic and qwen3_coder); otherwise only when some are known. */
        bool name_with_args;
        /* The text must start with one of these for a stream to look for calls at all
         * (vLLM's llama3_json and pythonic streaming); NULL = anywhere. */
        const char *const *stream_starts;
        tsr_status (*parse)(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final, tsr_tools_result *out);
} tsr_tools_parser;

/* NULL when unknown.  tsr_tools_parser_names: the table's names, comma-separated. */
const tsr_tools_parser *tsr_tools_parser_find(const char *name);

/* ---- tool_choice "required" / a named function (forced.c) ----
 * The parser of an output forced by tool_choice ("required" or "function"; NULL for
 * the others): ctx.forced_name names the function for "function". */
const tsr_tools_parser *tsr_tools_forced_parser(const char *tool_choice);
/* The JSON schema that forces such an output, as vLLM 0.12 builds it: the named tool's
 * parameters as given (JSON null when the tool has none: vLLM then constrains nothing),
 * or for "required" an array (minItems 1) of {name, parameters} objects, one anyOf
 * branch per tool, the tools' $defs merged at the top.  New reference; NULL for other
 * tool_choice values, or with a message in err (two tools defining one $defs name
 * differently). */
json_t *tsr_tools_choice_schema(json_t *tools, const char *tool_choice, const char *name, char *err, size_t errlen);

void tsr_tools_result_done(tsr_tools_result *r);
/* Append a call (name/args copied; name may be NULL). */
tsr_status tsr_tools_result_add(tsr_tools_result *r, const char *name, size_t name_len, const char *args, size_t args_len);

/* "chatcmpl-tool-" + 32 hex digits (vLLM's make_tool_call_id), into out[48]. */
void tsr_tools_call_id(char out[48]);

/* Non-stream: the message's "tool_calls" list [{id, type: function, function: {name,
 * arguments}}] of a final result (new reference; [] when none). */
json_t *tsr_tools_calls_json(const tsr_tools_result *r);

/* ---- streaming ---- */
typedef struct tsr_tools_stream tsr_tools_stream;

tsr_tools_stream *tsr_tools_stream_new(const tsr_tools_parser *p, const tsr_tools_ctx *ctx);
void tsr_tools_stream_free(tsr_tools_stream *s);
/* Feed the whole text so far (it only grows).  Sets *content (bytes to send as content,
 * may be empty) and *tool_calls (a delta list for the chunk, or NULL).  `final`: the
 * output is complete; what was held back goes out.  *content points into `text` or
 * into the stream (valid until the next call). */
tsr_status tsr_tools_stream_step(tsr_tools_stream *s, const char *text, size_t len, bool final, const char **content,
                                 size_t *content_len, json_t **tool_calls);
/* Whether any call was sent: finish_reason "tool_calls". */
bool tsr_tools_stream_called(const tsr_tools_stream *s);

/* ---- canonical JSON (canon.c) ----
 * Read one JSON value (py = false: Python's json.loads grammar, NaN and Infinity
 * included) or one Python literal (py = true: what ast.literal_eval-like tool parsers
 * accept: str, int, float, True/False/None, lists and dicts with constant keys) at
 * s[*pos..n) and append it to out as Python's json.dumps writes it (separators ", "
 * and ": ", ensure_ascii as asked).  Returns 1 when the value is complete (*pos past
 * it), 0 when the input ended inside it (out then holds only bytes the complete value
 * is sure to start with), -1 when it is malformed. */
typedef struct tsr_canon_opts {
        bool py;                      /* Python literal syntax */
        bool allow_neg;               /* py: unary minus on numbers (ast.literal_eval; vLLM's pythonic parser rejects it) */
        bool ascii;                   /* json.dumps(ensure_ascii=True) */
} tsr_canon_opts;

int tsr_canon_value(const char *s, size_t n, size_t *pos, const tsr_canon_opts *o, tsr_buf *out);
/* The whole of s[0..n) is one value (whitespace around it allowed), as json.loads
 * demands: appended to out and true; false (out unchanged) otherwise. */
bool tsr_canon_whole(const char *s, size_t n, const tsr_canon_opts *o, tsr_buf *out);
/* A string as json.dumps writes it (quotes included); s is UTF-8. */
tsr_status tsr_canon_string(tsr_buf *out, const char *s, size_t n, bool ascii);
/* Skip JSON (and, py, Python) whitespace. */
size_t tsr_canon_skip_ws(const char *s, size_t n, size_t i, bool py);

/* ---- template messages ---- */
/* The messages as vLLM hands them to the chat template: content parts joined into one
 * string (null content -> ""), assistant tool_calls' `arguments` strings parsed into
 * objects ("" or absent -> {}), and only role, content, name, tool_calls, reasoning and
 * reasoning_content (assistant) and tool_call_id (tool) kept.  New reference; NULL and *err set when an arguments
 * string is not JSON (vLLM's json.loads fails the request: 400). */
json_t *tsr_tools_template_messages(json_t *messages, char *err, size_t errlen);

/* ---- reasoning (reasoning.c) ---- */
typedef struct tsr_reasoning_parser tsr_reasoning_parser;

const tsr_reasoning_parser *tsr_reasoning_parser_find(const char *name);

/* Non-stream split of a whole output: reasoning and content (each NULL = null;
 * malloc'd).  `thinking_off`: chat_template_kwargs.enable_thinking is false. */
tsr_status tsr_reasoning_split(const tsr_reasoning_parser *p, const char *text, size_t len, bool thinking_off,
                               char **reasoning, size_t *reasoning_len, char **content, size_t *content_len);
/* Stream: of the text so far, how many leading bytes are settled and, of those, which
 * range is reasoning and where content starts.  reasoning = text[r_from, r_to),
 * content = text[c_from, settled).  Before the end marker c_from = settled. */
typedef struct tsr_reasoning_view {
        size_t r_from, r_to, c_from, settled;
        bool content;                 /* the answer has begun (or thinking is off) */
} tsr_reasoning_view;
void tsr_reasoning_view_of(const tsr_reasoning_parser *p, const char *text, size_t len, bool final, bool thinking_off,
                           tsr_reasoning_view *v);


/* ---- a chat choice's output through both parsers (chat.c) ----
 * Reasoning first, then tool calls in what follows the reasoning, as vLLM's chat
 * serving does.  Either parser may be NULL. */
typedef struct tsr_chat_out tsr_chat_out;

tsr_chat_out *tsr_chat_out_new(const tsr_reasoning_parser *rp, bool thinking_off, const tsr_tools_parser *tp,
                               const tsr_tools_ctx *ctx);
void tsr_chat_out_free(tsr_chat_out *o);
/* Stream: the text so far -> the chunk's delta object (content, reasoning,
 * reasoning_content, tool_calls, in vLLM's key order) or NULL when nothing is new. */
tsr_status tsr_chat_out_step(tsr_chat_out *o, const char *text, size_t len, bool final, json_t **delta);
bool tsr_chat_out_called(const tsr_chat_out *o);
/* Non-stream: set "content", "tool_calls", "reasoning" and "reasoning_content" of a
 * chat message object from the whole text; *called: finish_reason "tool_calls". */
tsr_status tsr_chat_out_message(const tsr_reasoning_parser *rp, bool thinking_off, const tsr_tools_parser *tp,
                                const tsr_tools_ctx *ctx, const char *text, size_t len, json_t *message, bool *called);
#endif
