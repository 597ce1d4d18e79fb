#include "response.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static json_t *str_or_null(const char *s) { return s ? json_string(s) : json_null(); }

static json_t *stringn(const char *s, size_t len) {
        /* jansson refuses invalid UTF-8; the detokenizer never emits it, but be safe. */
        json_t *v = json_stringn(s ? s : "", s ? len : 0);
        return v ? v : json_string("\xef\xbf\xbd");
}

json_t *tsr_resp_usage_json(const tsr_resp_usage *u, bool with_null_details) {
        json_t *o = json_object();
        json_object_set_new(o, "prompt_tokens", json_integer(u->prompt_tokens));
        json_object_set_new(o, "total_tokens", json_integer((json_int_t)u->prompt_tokens + u->completion_tokens));
        json_object_set_new(o, "completion_tokens", json_integer(u->completion_tokens));
        if (u->has_cached_tokens)
                json_object_set_new(o, "prompt_tokens_details", json_pack("{s:i}", "cached_tokens", u->cached_tokens));
        else if (with_null_details)
                json_object_set_new(o, "prompt_tokens_details", json_null());
        return o;
}

json_t *tsr_resp_stop_reason(bool has_token, uint32_t token, const char *stop_string) {
        if (stop_string)
                return json_string(stop_string);
        if (has_token)
                return json_integer(token);
        return json_null();
}

static void set_head(json_t *o, const tsr_resp_head *h, const char *object) {
        json_object_set_new(o, "id", json_string(h->id));
        json_object_set_new(o, "object", json_string(object));
        json_object_set_new(o, "created", json_integer(h->created));
        json_object_set_new(o, "model", json_string(h->model));
}

json_t *tsr_resp_completion_choice(int index, const char *text, size_t len, json_t *logprobs, const char *finish_reason,
                               json_t *stop_reason) {
        json_t *c = json_object();
        json_object_set_new(c, "index", json_integer(index));
        json_object_set_new(c, "text", stringn(text, len));
        json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
        json_object_set_new(c, "finish_reason", str_or_null(finish_reason));
        json_object_set_new(c, "stop_reason", stop_reason ? stop_reason : json_null());
        json_object_set_new(c, "token_ids", json_null());
        json_object_set_new(c, "prompt_logprobs", json_null());
        json_object_set_new(c, "prompt_token_ids", json_null());
        return c;
}

json_t *tsr_resp_completion(const tsr_resp_head *h, json_t *choices, const tsr_resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, "text_completion");
        json_object_set_new(o, "choices", choices);
        json_object_set_new(o, "service_tier", json_null());
        json_object_set_new(o, "system_fingerprint", json_null());
        json_object_set_new(o, "usage", tsr_resp_usage_json(u, true));
        json_object_set_new(o, "kv_transfer_params", json_null());
        return o;
}

json_t *tsr_resp_chat_choice(int index, const char *role, const char *content, size_t len, json_t *logprobs,
                         const char *finish_reason, json_t *stop_reason) {
        json_t *c = json_object(), *m = json_object();
        json_object_set_new(m, "role", json_string(role));
        json_object_set_new(m, "content", content ? stringn(content, len) : json_null());
        json_object_set_new(m, "refusal", json_null());
        json_object_set_new(m, "annotations", json_null());
        json_object_set_new(m, "audio", json_null());
        json_object_set_new(m, "function_call", json_null());
        json_object_set_new(m, "tool_calls", json_array());
        json_object_set_new(m, "reasoning", json_null());
        json_object_set_new(m, "reasoning_content", json_null());
        json_object_set_new(c, "index", json_integer(index));
        json_object_set_new(c, "message", m);
        json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
        json_object_set_new(c, "finish_reason", str_or_null(finish_reason));
        json_object_set_new(c, "stop_reason", stop_reason ? stop_reason : json_null());
        json_object_set_new(c, "token_ids", json_null());
        return c;
}

json_t *tsr_resp_chat(const tsr_resp_head *h, json_t *choices, const tsr_resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, "chat.completion");
        json_object_set_new(o, "choices", choices);
        json_object_set_new(o, "service_tier", json_null());
        json_object_set_new(o, "system_fingerprint", json_null());
        json_object_set_new(o, "usage", tsr_resp_usage_json(u, true));
        json_object_set_new(o, "prompt_logprobs", json_null());
        json_object_set_new(o, "prompt_token_ids", json_null());
        json_object_set_new(o, "kv_transfer_params", json_null());
        return o;
}

json_t *tsr_resp_completion_chunk(const tsr_resp_head *h, int index, const char *text, size_t len, json_t *logprobs,
                              const char *finish_reason, json_t *stop_reason, const tsr_resp_usage *usage) {
        json_t *o = json_object(), *c = json_object();
        set_head(o, h, "text_completion");
        json_object_set_new(c, "index", json_integer(index));
        json_object_set_new(c, "text", stringn(text, len));
        json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
        json_object_set_new(c, "finish_reason", str_or_null(finish_reason));
        json_object_set_new(c, "stop_reason", stop_reason ? stop_reason : json_null());
        json_object_set_new(c, "prompt_token_ids", json_null());
        json_object_set_new(c, "token_ids", json_null());
        json_object_set_new(o, "choices", json_pack("[o]", c));
        json_object_set_new(o, "usage", usage ? tsr_resp_usage_json(usage, false) : json_null());
        return o;
}

json_t *tsr_resp_chat_role_chunk(const tsr_resp_head *h, int index, const char *role, const tsr_resp_usage *usage) {
        json_t *o = json_object(), *c = json_object(), *d = json_object();
        set_head(o, h, "chat.completion.chunk");
        json_object_set_new(d, "role", json_string(role));
        json_object_set_new(d, "content", json_string(""));
        json_object_set_new(d, "reasoning_content", json_null());
        json_object_set_new(c, "index", json_integer(index));
        json_object_set_new(c, "delta", d);
        json_object_set_new(c, "logprobs", json_null());
        json_object_set_new(c, "finish_reason", json_null());
        json_object_set_new(o, "choices", json_pack("[o]", c));
        json_object_set_new(o, "prompt_token_ids", json_null());
        if (usage)
                json_object_set_new(o, "usage", tsr_resp_usage_json(usage, false));
        return o;
}

json_t *tsr_resp_chat_chunk(const tsr_resp_head *h, int index, const char *content, size_t len, json_t *logprobs,
                        const char *finish_reason, json_t *stop_reason, const tsr_resp_usage *usage) {
        json_t *d = json_object();
        json_object_set_new(d, "content", stringn(content, len));
        json_object_set_new(d, "reasoning_content", json_null());
        return tsr_resp_chat_delta_chunk(h, index, d, logprobs, finish_reason, stop_reason, usage);
}

json_t *tsr_resp_chat_delta_chunk(const tsr_resp_head *h, int index, json_t *d, json_t *logprobs, const char *finish_reason,
                              json_t *stop_reason, const tsr_resp_usage *usage) {
        json_t *o = json_object(), *c = json_object();
        set_head(o, h, "chat.completion.chunk");
        json_object_set_new(c, "index", json_integer(index));
        json_object_set_new(c, "delta", d);
        json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
        json_object_set_new(c, "finish_reason", str_or_null(finish_reason));
        if (finish_reason)
                json_object_set_new(c, "stop_reason", stop_reason ? stop_reason : json_null());
        else if (stop_reason)
                json_decref(stop_reason);
        json_object_set_new(c, "token_ids", json_null());
        json_object_set_new(o, "choices", json_pack("[o]", c));
        if (usage)
                json_object_set_new(o, "usage", tsr_resp_usage_json(usage, false));
        return o;
}

json_t *tsr_resp_usage_chunk(const tsr_resp_head *h, bool chat, const tsr_resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, chat ? "chat.completion.chunk" : "text_completion");
        json_object_set_new(o, "choices", json_array());
        json_object_set_new(o, "usage", tsr_resp_usage_json(u, false));
        return o;
}

/* ------------------------------------------------------------------ logprobs */

/* Python's len() of a token text: code points of valid UTF-8. */
static size_t code_points(const char *s, size_t len) {
        size_t n = 0;
        for (size_t i = 0; i < len; i++)
                n += ((unsigned char)s[i] & 0xc0) != 0x80;
        return n;
}

static char *token_text(const tsr_resp_tokens *t, uint32_t id, size_t *len) {
        char *s = t && t->decode ? t->decode(t->ud, id, len) : NULL;
        if (!s) {
                s = strdup("");
                *len = 0;
        }
        return s;
}

/* max(v, -9999.0) as vLLM writes it (-inf and NaN included: JSON has neither). */
static json_t *floored(float v) {
        double d = (double)v;
        return json_real(d >= TSR_RESP_LOGPROB_FLOOR ? d : TSR_RESP_LOGPROB_FLOOR);
}

/* One token's engine dict as vLLM builds it: the token itself with its own rank, then
 * the alternatives with ranks 1..; an id met again keeps its first place and takes the
 * later value (a Python dict).  Returns the number of entries (<= TSR_RESP_MAX_TOP + 1). */
static size_t lp_entries(const tsr_resp_token_lp *lp, uint32_t *ids, float *vals, uint32_t *ranks) {
        size_t n = 1, n_top = lp->n_top < TSR_RESP_MAX_TOP ? lp->n_top : TSR_RESP_MAX_TOP;
        ids[0] = lp->token;
        vals[0] = lp->logprob;
        ranks[0] = lp->rank;
        for (size_t i = 0; i < n_top; i++) {
                size_t j = 0;
                while (j < n && ids[j] != lp->top_ids[i])
                        j++;
                ids[j] = lp->top_ids[i];
                vals[j] = lp->top_logprobs[i];
                ranks[j] = (uint32_t)i + 1;
                if (j == n)
                        n++;
        }
        return n;
}

json_t *tsr_resp_completion_logprobs(const tsr_resp_token_lp *lps, size_t n, int k, size_t initial_offset,
                                 const tsr_resp_tokens *t) {
        json_t *o = json_object(), *offsets = json_array(), *values = json_array(), *tokens = json_array(),
               *tops = json_array();
        size_t offset = initial_offset;
        uint32_t ids[TSR_RESP_MAX_TOP + 1], ranks[TSR_RESP_MAX_TOP + 1];
        float vals[TSR_RESP_MAX_TOP + 1];

        for (size_t i = 0; i < n; i++) {
                size_t len, tlen;
                char *text = token_text(t, lps[i].token, &len);
                json_array_append_new(tokens, stringn(text, len));
                json_array_append_new(offsets, json_integer((json_int_t)offset));
                offset += code_points(text, len);
                free(text);
                if (!lps[i].has) {
                        json_array_append_new(values, json_null());
                        json_array_append_new(tops, json_null());
                        continue;
                }
                size_t ne = lp_entries(&lps[i], ids, vals, ranks);
                json_t *d = json_object();
                json_array_append_new(values, floored(vals[0]));
                /* The first k + 1 entries; texts that collide keep the first key's place
                 * and the last value, as the Python dict comprehension does. */
                for (size_t j = 0; j < ne && (int)j <= (k > 0 ? k : 0); j++) {
                        char *alt = token_text(t, ids[j], &tlen);
                        json_object_setn_new(d, alt, tlen, floored(vals[j]));   /* steals even on failure */
                        free(alt);
                }
                json_array_append_new(tops, d);
        }
        json_object_set_new(o, "text_offset", offsets);
        json_object_set_new(o, "token_logprobs", values);
        json_object_set_new(o, "tokens", tokens);
        json_object_set_new(o, "top_logprobs", tops);
        return o;
}

static json_t *utf8_bytes(const char *s, size_t len) {
        json_t *a = json_array();
        for (size_t i = 0; i < len; i++)
                json_array_append_new(a, json_integer((unsigned char)s[i]));
        return a;
}

/* {"token","logprob","bytes"} of one alternative; takes `text`. */
static json_t *chat_alt(char *text, size_t len, json_t *logprob) {
        json_t *o = json_object();
        json_object_set_new(o, "token", stringn(text, len));
        json_object_set_new(o, "logprob", logprob);
        json_object_set_new(o, "bytes", utf8_bytes(text, len));
        free(text);
        return o;
}

json_t *tsr_resp_chat_logprobs(const tsr_resp_token_lp *lps, size_t n, int top, const tsr_resp_tokens *t) {
        json_t *content = json_array();
        uint32_t ids[TSR_RESP_MAX_TOP + 1], ranks[TSR_RESP_MAX_TOP + 1];
        float vals[TSR_RESP_MAX_TOP + 1];

        for (size_t i = 0; i < n; i++) {
                size_t len, ne = lps[i].has ? lp_entries(&lps[i], ids, vals, ranks) : 0;
                char *text = token_text(t, lps[i].token, &len);
                json_t *e = chat_alt(text, len, ne ? floored(vals[0]) : json_real(TSR_RESP_LOGPROB_FLOOR));
                json_t *alts = json_array();
                for (size_t j = 0; j < ne && (top < 0 || (int)j < top); j++) {
                        size_t alen;
                        char *alt = token_text(t, ids[j], &alen);
                        json_array_append_new(alts, chat_alt(alt, alen, floored(vals[j])));
                }
                json_object_set_new(e, "top_logprobs", alts);
                json_array_append_new(content, e);
        }
        return json_pack("{s:o}", "content", content);
}

json_t *tsr_resp_prompt_logprobs(const tsr_resp_token_lp *lps, size_t n, const tsr_resp_tokens *t) {
        json_t *a = json_array();
        uint32_t ids[TSR_RESP_MAX_TOP + 1], ranks[TSR_RESP_MAX_TOP + 1];
        float vals[TSR_RESP_MAX_TOP + 1];

        for (size_t i = 0; i < n; i++) {
                if (!lps[i].has) {
                        json_array_append_new(a, json_null());
                        continue;
                }
                size_t ne = lp_entries(&lps[i], ids, vals, ranks);
                json_t *d = json_object();
                for (size_t j = 0; j < ne; j++) {
                        char key[16], *text;
                        size_t len;
                        json_t *v = json_object();
                        snprintf(key, sizeof(key), "%u", ids[j]);
                        text = token_text(t, ids[j], &len);
                        json_object_set_new(v, "logprob", floored(vals[j]));
                        json_object_set_new(v, "rank", json_integer(ranks[j]));
                        json_object_set_new(v, "decoded_token", stringn(text, len));
                        free(text);
                        json_object_set_new(d, key, v);
                }
                json_array_append_new(a, d);
        }
        return a;
}

void tsr_resp_set_prompt_logprobs(json_t *obj, json_t *prompt_logprobs) {
        if (prompt_logprobs)
                json_object_set_new(obj, "prompt_logprobs", prompt_logprobs);   /* replaces the null in place */
}

char *tsr_resp_sse_event(json_t *obj, size_t *len) {
        char *body, *out;
        size_t n;
        if (!obj)
                return NULL;
        body = json_dumps(obj, JSON_COMPACT);
        json_decref(obj);
        if (!body)
                return NULL;
        n = strlen(body);
        out = malloc(n + 9);
        if (out) {
                memcpy(out, "data: ", 6);
                memcpy(out + 6, body, n);
                memcpy(out + 6 + n, "\n\n", 3);
                *len = n + 8;
        }
        free(body);
        return out;
}
