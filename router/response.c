#include "response.h"

#include <stdlib.h>
#include <string.h>

static json_t *str_or_null(const char *s) { return s ? json_string(s) : json_null(); }

static json_t *stringn(const char *s, size_t len) {
        /* jansson refuses invalid UTF-8; the detokenizer never emits it, but be safe. */
        json_t *v = json_stringn(s ? s : "", s ? len : 0);
        return v ? v : json_string("\xef\xbf\xbd");
}

json_t *resp_usage_json(const resp_usage *u, bool with_null_details) {
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

json_t *resp_stop_reason(bool has_token, uint32_t token, const char *stop_string) {
        if (stop_string)
                return json_string(stop_string);
        if (has_token)
                return json_integer(token);
        return json_null();
}

static void set_head(json_t *o, const resp_head *h, const char *object) {
        json_object_set_new(o, "id", json_string(h->id));
        json_object_set_new(o, "object", json_string(object));
        json_object_set_new(o, "created", json_integer(h->created));
        json_object_set_new(o, "model", json_string(h->model));
}

json_t *resp_completion_choice(int index, const char *text, size_t len, json_t *logprobs, const char *finish_reason,
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

json_t *resp_completion(const resp_head *h, json_t *choices, const resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, "text_completion");
        json_object_set_new(o, "choices", choices);
        json_object_set_new(o, "service_tier", json_null());
        json_object_set_new(o, "system_fingerprint", json_null());
        json_object_set_new(o, "usage", resp_usage_json(u, true));
        json_object_set_new(o, "kv_transfer_params", json_null());
        return o;
}

json_t *resp_chat_choice(int index, const char *role, const char *content, size_t len, json_t *logprobs,
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

json_t *resp_chat(const resp_head *h, json_t *choices, const resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, "chat.completion");
        json_object_set_new(o, "choices", choices);
        json_object_set_new(o, "service_tier", json_null());
        json_object_set_new(o, "system_fingerprint", json_null());
        json_object_set_new(o, "usage", resp_usage_json(u, true));
        json_object_set_new(o, "prompt_logprobs", json_null());
        json_object_set_new(o, "prompt_token_ids", json_null());
        json_object_set_new(o, "kv_transfer_params", json_null());
        return o;
}

json_t *resp_completion_chunk(const resp_head *h, int index, const char *text, size_t len, json_t *logprobs,
                              const char *finish_reason, json_t *stop_reason, const resp_usage *usage) {
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
        json_object_set_new(o, "usage", usage ? resp_usage_json(usage, false) : json_null());
        return o;
}

json_t *resp_chat_role_chunk(const resp_head *h, int index, const char *role, const resp_usage *usage) {
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
                json_object_set_new(o, "usage", resp_usage_json(usage, false));
        return o;
}

json_t *resp_chat_chunk(const resp_head *h, int index, const char *content, size_t len, json_t *logprobs,
                        const char *finish_reason, json_t *stop_reason, const resp_usage *usage) {
        json_t *o = json_object(), *c = json_object(), *d = json_object();
        set_head(o, h, "chat.completion.chunk");
        json_object_set_new(d, "content", stringn(content, len));
        json_object_set_new(d, "reasoning_content", json_null());
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
                json_object_set_new(o, "usage", resp_usage_json(usage, false));
        return o;
}

json_t *resp_usage_chunk(const resp_head *h, bool chat, const resp_usage *u) {
        json_t *o = json_object();
        set_head(o, h, chat ? "chat.completion.chunk" : "text_completion");
        json_object_set_new(o, "choices", json_array());
        json_object_set_new(o, "usage", resp_usage_json(u, false));
        return o;
}

char *resp_sse_event(json_t *obj, size_t *len) {
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
