/* parsers.h - what the files of router/tools/ share: each parser's entry (one file
 * each, listed in tools.c's table) and the helpers they have in common.  Private to
 * router/tools/. */
#ifndef TSR_ROUTER_TOOLS_PARSERS_H
#define TSR_ROUTER_TOOLS_PARSERS_H

#include <pthread.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "router/tools/tools.h"

tsr_status tsr_tools_parse_hermes(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final, tsr_tools_result *out);
tsr_status tsr_tools_parse_llama3_json(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                       tsr_tools_result *out);
tsr_status tsr_tools_parse_pythonic(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                    tsr_tools_result *out);
tsr_status tsr_tools_parse_llama4_pythonic(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                           tsr_tools_result *out);
tsr_status tsr_tools_parse_qwen3_coder(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                       tsr_tools_result *out);

/* A pattern compiled once (DOTALL when asked), shared read-only by every thread;
 * NULL if it does not compile (a bug: the patterns are constants). */
typedef struct tsr_tools_re {
        const char *pattern;
        uint32_t flags;
        pthread_once_t once;
        pcre2_code *code;
} tsr_tools_re;
#define TSR_TOOLS_RE(pat, fl) {.pattern = (pat), .flags = (fl), .once = PTHREAD_ONCE_INIT, .code = NULL}
pcre2_code *tsr_tools_re_get(tsr_tools_re *re);
/* One match of `re` in s[0..n) at or after `from`: 1 matched (ov: the ovector, 2 per
 * group, PCRE2_UNSET for groups that did not take part), 0 none, -1 error (match
 * limit: vLLM's regex timeout leaves the output as content too). */
int tsr_tools_re_match(tsr_tools_re *re, const char *s, size_t n, size_t from, uint32_t opts, size_t *ov, size_t n_ov);

/* Bytes at the end of s[0..n) that could be the start of `marker`: held back from a
 * stream until the next delta says. */
size_t tsr_tools_holdback(const char *s, size_t n, const char *marker);

/* A separator `ch` at s[*i] (whitespace first), and the whitespace after it: 1 found
 * with input after it, 0 the input ended, -1 another character there. */
int tsr_tools_expect(const char *s, size_t n, size_t *i, char ch, bool py);

/* Final results: no calls, the whole text is content; or calls found, content the
 * text before them (null when empty). */
tsr_status tsr_tools_result_all_content(tsr_tools_result *r, const char *text, size_t len);
tsr_status tsr_tools_result_called(tsr_tools_result *r, const char *text, size_t content_len);

/* s[0..n) is one call object and nothing else (whitespace around), as json.loads of
 * the whole segment: 1 and the call added to out, 0 not, -1 out of memory. */
int tsr_tools_json_call_whole(const char *s, size_t n, const char *const *arg_keys, tsr_tools_result *out);

/* A JSON call object {"name": "...", <args key>: value, ...} at s[*pos] (json.loads
 * grammar).  name: malloc'd once the string is complete (NULL before, and when it is
 * not a string: then BAD in the end); args: canonical JSON of the first of arg_keys
 * present (in key order of preference), the growing prefix while the input is cut;
 * *has_args whether any of arg_keys was seen.  Returns 1/0/-1 as tsr_canon_value. */
int tsr_tools_json_call(const char *s, size_t n, size_t *pos, const char *const *arg_keys, char **name, tsr_buf *args,
                        bool *has_args);

#endif
