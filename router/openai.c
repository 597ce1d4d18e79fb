/* openai.c - parsing and validation of OpenAI request bodies (see openai.h).
 * The checks and messages follow vLLM 0.12: protocol.py (pydantic models and their
 * validators) and SamplingParams._verify_args. */
#include "openai.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "router/tools/tools.h"

#define GREEDY_EPS 1e-5   /* vLLM's _SAMPLING_EPS: below it, temperature means greedy */

void tsr_oai_limits_default(tsr_oai_limits *l) {
        l->max_prompts = 4096;
        l->max_prompt_ids = 1u << 20;
        l->max_messages = 10000;
        l->max_n = 128;
        l->max_stop = 64;
        l->max_stop_len = 4096;
        l->max_logit_bias = 4096;
        l->max_logprobs = 20;
        l->max_json_depth = 64;
}

void tsr_oai_py_float_repr(double v, char *out, size_t n) {
        if (isnan(v)) {
                snprintf(out, n, "nan");
                return;
        }
        if (isinf(v)) {
                snprintf(out, n, v < 0 ? "-inf" : "inf");
                return;
        }
        /* The shortest digits that read back to the same double, as Python's repr
         * (float_repr_style 'short'): positional when the decimal exponent is in
         * [-4, 16), else d.ddde+XX; integral positional values keep ".0" (1000.0,
         * 0.0001, 1e-05, 1e+16, 2.0). */
        char buf[64], digits[32], res[96];
        int prec, exp, nd = 0;
        for (prec = 1; prec <= 17; prec++) {
                snprintf(buf, sizeof(buf), "%.*e", prec - 1, v);
                if (strtod(buf, NULL) == v)
                        break;
        }
        for (const char *p = buf; *p && *p != 'e'; p++)
                if (*p >= '0' && *p <= '9')
                        digits[nd++] = *p;
        while (nd > 1 && digits[nd - 1] == '0')
                nd--;
        digits[nd] = '\0';
        exp = atoi(strchr(buf, 'e') + 1);
        size_t k = 0;
        if (signbit(v))
                res[k++] = '-';
        if (exp >= -4 && exp < 16) {
                if (exp < 0) {
                        k += (size_t)snprintf(res + k, sizeof(res) - k, "0.");
                        for (int i = 0; i < -exp - 1; i++)
                                res[k++] = '0';
                        k += (size_t)snprintf(res + k, sizeof(res) - k, "%s", digits);
                } else {
                        for (int i = 0; i <= exp; i++)
                                res[k++] = i < nd ? digits[i] : '0';
                        res[k++] = '.';
                        if (nd > exp + 1)
                                k += (size_t)snprintf(res + k, sizeof(res) - k, "%s", digits + exp + 1);
                        else
                                res[k++] = '0';
                }
                res[k] = '\0';
        } else {
                res[k++] = digits[0];
                if (nd > 1) {
                        res[k++] = '.';
                        k += (size_t)snprintf(res + k, sizeof(res) - k, "%s", digits + 1);
                }
                snprintf(res + k, sizeof(res) - k, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
        }
        snprintf(out, n, "%s", res);
}

static tsr_status fail(tsr_oai_error *err, int status, const char *type, const char *param, const char *fmt, ...)
        __attribute__((format(printf, 5, 6)));

static tsr_status fail(tsr_oai_error *err, int status, const char *type, const char *param, const char *fmt, ...) {
        va_list ap;
        err->status = status;
        err->type = type;
        err->param = param;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
        return TSR_E_INVAL;
}

/* Type errors are pydantic's job in vLLM (400 "Bad Request"); value errors come from
 * validators and SamplingParams (400 "BadRequestError"). */
#define TYPE_ERR(err, field, what) \
        fail((err), 400, "Bad Request", (field), "%s: Input should be %s", (field), (what))
#define VALUE_ERR(err, field, ...) fail((err), 400, "BadRequestError", (field), __VA_ARGS__)

static const char *fmt_float(double v, char *buf, size_t n) {
        tsr_oai_py_float_repr(v, buf, n);
        return buf;
}

/* ---- typed field access: absent or null = unset, other types = error ---- */

static json_t *field(json_t *root, const char *name) {
        json_t *v = json_object_get(root, name);
        return json_is_null(v) ? NULL : v;
}

static tsr_status get_bool(json_t *root, const char *name, bool *out, tsr_oai_error *err) {
        json_t *v = field(root, name);
        if (!v)
                return TSR_OK;
        if (json_is_boolean(v)) {
                *out = json_is_true(v);
                return TSR_OK;
        }
        /* pydantic's lax mode also takes 0 and 1. */
        if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
                *out = json_integer_value(v) == 1;
                return TSR_OK;
        }
        return TYPE_ERR(err, name, "a valid boolean");
}

/* An int, or a float with no fractional part (pydantic lax mode). */
static tsr_status int_value(json_t *v, const char *name, int64_t *out, tsr_oai_error *err) {
        if (json_is_integer(v)) {
                *out = json_integer_value(v);
                return TSR_OK;
        }
        if (json_is_real(v)) {
                double d = json_real_value(v);
                if (d == floor(d) && fabs(d) < 9.2e18) {
                        *out = (int64_t)d;
                        return TSR_OK;
                }
                return TYPE_ERR(err, name, "a valid integer, got a number with a fractional part");
        }
        return TYPE_ERR(err, name, "a valid integer");
}

static tsr_status get_int(json_t *root, const char *name, bool *has, int64_t *out, tsr_oai_error *err) {
        json_t *v = field(root, name);
        if (!v)
                return TSR_OK;
        tsr_status st = int_value(v, name, out, err);
        if (st == TSR_OK && has)
                *has = true;
        return st;
}

static tsr_status get_number(json_t *root, const char *name, bool *has, double *out, tsr_oai_error *err) {
        json_t *v = field(root, name);
        if (!v)
                return TSR_OK;
        if (!json_is_number(v))
                return TYPE_ERR(err, name, "a valid number");
        *out = json_number_value(v);
        if (has)
                *has = true;
        return TSR_OK;
}

static tsr_status get_string(json_t *root, const char *name, const char **out, tsr_oai_error *err) {
        json_t *v = field(root, name);
        if (!v)
                return TSR_OK;
        if (!json_is_string(v))
                return TYPE_ERR(err, name, "a valid string");
        *out = json_string_value(v);
        return TSR_OK;
}

#define TRY(expr)                                  \
        do {                                       \
                tsr_status try_st_ = (expr);       \
                if (try_st_ != TSR_OK)             \
                        return try_st_;            \
        } while (0)

static size_t json_depth(json_t *v, size_t limit) {
        size_t best = 0, i;
        const char *k;
        json_t *child;
        if (limit == 0)
                return 1;
        if (json_is_array(v)) {
                json_array_foreach(v, i, child) {
                        size_t d = json_depth(child, limit - 1);
                        if (d > best)
                                best = d;
                        if (best >= limit)
                                break;
                }
                return best + 1;
        }
        if (json_is_object(v)) {
                json_object_foreach(v, k, child) {
                        size_t d = json_depth(child, limit - 1);
                        if (d > best)
                                best = d;
                        if (best >= limit)
                                break;
                }
                return best + 1;
        }
        return 0;
}

/* ---- completions prompt: str | [str] | [int] | [[int]] ---- */

static tsr_status ids_from(json_t *arr, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_prompt *p, tsr_oai_error *err) {
        size_t i, n = json_array_size(arr);
        json_t *v;
        if (n > lim->max_prompt_ids)
                return VALUE_ERR(err, "prompt", "prompt has %zu token ids, more than the %zu allowed", n,
                                 lim->max_prompt_ids);
        p->is_ids = true;
        p->n_ids = n;
        p->ids = tsr_arena_calloc(a, n ? n : 1, sizeof(uint32_t));
        if (!p->ids)
                return fail(err, 500, "InternalServerError", NULL, "out of memory");
        json_array_foreach(arr, i, v) {
                int64_t id;
                if (!json_is_integer(v))
                        return TYPE_ERR(err, "prompt", "a list of integers (token ids)");
                id = json_integer_value(v);
                if (id < 0 || id > 0x7fffffff)
                        return VALUE_ERR(err, "prompt", "token id %lld in the prompt is out of range", (long long)id);
                p->ids[i] = (uint32_t)id;
        }
        return TSR_OK;
}

static tsr_status parse_prompts(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        json_t *prompt = field(root, "prompt"), *first, *v;
        size_t i, n;

        if (!prompt || (json_is_array(prompt) && json_array_size(prompt) == 0))
                return VALUE_ERR(err, "prompt", "Either prompt or prompt_embeds must be provided and non-empty.");
        if (json_is_string(prompt)) {
                r->prompts = tsr_arena_calloc(a, 1, sizeof(tsr_oai_prompt));
                if (!r->prompts)
                        return fail(err, 500, "InternalServerError", NULL, "out of memory");
                r->prompts[0].text = json_string_value(prompt);
                r->prompts[0].text_len = json_string_length(prompt);
                r->n_prompts = 1;
                if (r->prompts[0].text_len == 0)
                        return VALUE_ERR(err, "prompt", "Prompt cannot be empty.");
                return TSR_OK;
        }
        if (!json_is_array(prompt))
                return TYPE_ERR(err, "prompt", "a string, a list of strings, a list of token ids or a list of lists of token ids");
        first = json_array_get(prompt, 0);
        if (json_is_integer(first)) {   /* one prompt of ids */
                r->prompts = tsr_arena_calloc(a, 1, sizeof(tsr_oai_prompt));
                if (!r->prompts)
                        return fail(err, 500, "InternalServerError", NULL, "out of memory");
                r->n_prompts = 1;
                return ids_from(prompt, lim, a, &r->prompts[0], err);
        }
        n = json_array_size(prompt);
        if (n > lim->max_prompts)
                return VALUE_ERR(err, "prompt", "%zu prompts in one request, more than the %zu allowed", n,
                                 lim->max_prompts);
        r->prompts = tsr_arena_calloc(a, n, sizeof(tsr_oai_prompt));
        if (!r->prompts)
                return fail(err, 500, "InternalServerError", NULL, "out of memory");
        r->n_prompts = n;
        json_array_foreach(prompt, i, v) {
                if (json_is_string(v)) {
                        if (json_is_array(first))
                                return TYPE_ERR(err, "prompt", "a list of one kind: strings or lists of token ids");
                        r->prompts[i].text = json_string_value(v);
                        r->prompts[i].text_len = json_string_length(v);
                        if (r->prompts[i].text_len == 0)
                                return VALUE_ERR(err, "prompt", "Prompt cannot be empty.");
                } else if (json_is_array(v)) {
                        if (json_is_string(first))
                                return TYPE_ERR(err, "prompt", "a list of one kind: strings or lists of token ids");
                        if (json_array_size(v) == 0)
                                return VALUE_ERR(err, "prompt", "Prompt cannot be empty.");
                        TRY(ids_from(v, lim, a, &r->prompts[i], err));
                } else {
                        return TYPE_ERR(err, "prompt", "a string, a list of strings, a list of token ids or a list of lists of token ids");
                }
        }
        return TSR_OK;
}

/* ---- chat messages ---- */

static tsr_status check_content(json_t *content, size_t idx, tsr_oai_error *err) {
        size_t i;
        json_t *part;
        if (!content || json_is_null(content) || json_is_string(content))
                return TSR_OK;
        if (!json_is_array(content))
                return TYPE_ERR(err, "messages", "a message content that is a string or a list of content parts");
        json_array_foreach(content, i, part) {
                const char *type = json_string_value(json_object_get(part, "type"));
                if (!json_is_object(part) || !type)
                        return TYPE_ERR(err, "messages", "content parts that are objects with a `type`");
                if (strcmp(type, "text") == 0) {
                        if (!json_is_string(json_object_get(part, "text")))
                                return TYPE_ERR(err, "messages", "a text content part with a string `text`");
                } else {
                        return VALUE_ERR(err, "messages",
                                         "message %zu: content part type '%.64s' is not supported by this text-only model",
                                         idx, type);
                }
        }
        return TSR_OK;
}

static tsr_status parse_messages(json_t *root, const tsr_oai_limits *lim, tsr_oai_request *r, tsr_oai_error *err) {
        json_t *msgs = json_object_get(root, "messages"), *m;
        size_t i;

        if (!msgs || json_is_null(msgs))
                return TYPE_ERR(err, "messages", "present: the field is required");
        if (!json_is_array(msgs))
                return TYPE_ERR(err, "messages", "a valid list");
        if (json_array_size(msgs) == 0)
                return VALUE_ERR(err, "messages", "messages must contain at least one message.");
        if (json_array_size(msgs) > lim->max_messages)
                return VALUE_ERR(err, "messages", "%zu messages, more than the %zu allowed", json_array_size(msgs),
                                 lim->max_messages);
        json_array_foreach(msgs, i, m) {
                json_t *role;
                if (!json_is_object(m))
                        return TYPE_ERR(err, "messages", "a list of message objects");
                role = json_object_get(m, "role");
                /* vLLM also accepts custom roles (CustomChatCompletionMessageParam). */
                if (!json_is_string(role) || json_string_length(role) == 0)
                        return TYPE_ERR(err, "messages", "messages that each have a string `role`");
                TRY(check_content(json_object_get(m, "content"), i, err));
        }
        r->messages = msgs;
        return TSR_OK;
}

static tsr_status parse_tools(json_t *root, tsr_oai_request *r, tsr_oai_error *err) {
        json_t *tools = field(root, "tools"), *tc = field(root, "tool_choice"), *t;
        size_t i;

        if (tools) {
                if (!json_is_array(tools))
                        return TYPE_ERR(err, "tools", "a valid list");
                json_array_foreach(tools, i, t) {
                        json_t *fn = json_object_get(t, "function");
                        json_t *params = json_object_get(fn, "parameters");
                        if (!json_is_object(t) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
                                return TYPE_ERR(err, "tools", "tools of the form {type: function, function: {name, ...}}");
                        if (params && !json_is_null(params) && !json_is_object(params))
                                return TYPE_ERR(err, "tools", "tools whose function.parameters is a valid dictionary");
                }
                r->tools = tools;
        }
        if (!tc) {
                /* vLLM: tool_choice defaults to "none", and to "auto" when tools are given. */
                r->tool_choice = tools && json_array_size(tools) ? "auto" : "none";
                return TSR_OK;
        }
        if (json_is_string(tc)) {
                const char *s = json_string_value(tc);
                if (strcmp(s, "none") && strcmp(s, "auto") && strcmp(s, "required"))
                        return TYPE_ERR(err, "tool_choice", "'none', 'auto', 'required' or a named tool");
                r->tool_choice = s;
                return TSR_OK;
        }
        const char *name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
        if (!json_is_object(tc) || !name)
                return TYPE_ERR(err, "tool_choice", "'none', 'auto', 'required' or {type: function, function: {name}}");
        r->tool_choice = "function";
        r->tool_choice_name = name;
        if (!tools)
                return VALUE_ERR(err, "tool_choice", "When using `tool_choice`, `tools` must be set.");
        json_array_foreach(tools, i, t) {
                const char *tn = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
                if (tn && strcmp(tn, name) == 0)
                        return TSR_OK;
        }
        return VALUE_ERR(err, "tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`");
}

/* ---- both endpoints ---- */

static tsr_status parse_stop(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        json_t *stop = field(root, "stop"), *ids = field(root, "stop_token_ids"), *v;
        size_t i;

        if (stop) {
                size_t n = json_is_string(stop) ? 1 : json_array_size(stop);
                if (!json_is_string(stop) && !json_is_array(stop))
                        return TYPE_ERR(err, "stop", "a string or a list of strings");
                if (n > lim->max_stop)
                        return VALUE_ERR(err, "stop", "%zu stop strings, more than the %zu allowed", n, lim->max_stop);
                r->stop = tsr_arena_calloc(a, n ? n : 1, sizeof(char *));
                if (!r->stop)
                        return fail(err, 500, "InternalServerError", NULL, "out of memory");
                for (i = 0; i < n; i++) {
                        v = json_is_string(stop) ? stop : json_array_get(stop, i);
                        if (!json_is_string(v))
                                return TYPE_ERR(err, "stop", "a string or a list of strings");
                        if (json_string_length(v) == 0)
                                return VALUE_ERR(err, "stop", "stop cannot contain an empty string.");
                        if (json_string_length(v) > lim->max_stop_len)
                                return VALUE_ERR(err, "stop", "a stop string of %zu bytes is longer than the %zu allowed",
                                                 json_string_length(v), lim->max_stop_len);
                        r->stop[i] = json_string_value(v);
                }
                r->n_stop = n;
        }
        if (ids) {
                if (!json_is_array(ids))
                        return TYPE_ERR(err, "stop_token_ids", "a valid list");
                if (json_array_size(ids) > lim->max_stop * 16)
                        return VALUE_ERR(err, "stop_token_ids", "too many stop_token_ids");
                r->stop_token_ids = tsr_arena_calloc(a, json_array_size(ids) + 1, sizeof(uint32_t));
                if (!r->stop_token_ids)
                        return fail(err, 500, "InternalServerError", NULL, "out of memory");
                json_array_foreach(ids, i, v) {
                        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 0x7fffffff)
                                return VALUE_ERR(err, "stop_token_ids", "stop_token_ids must contain only integers (token ids).");
                        r->stop_token_ids[r->n_stop_token_ids++] = (uint32_t)json_integer_value(v);
                }
        }
        return TSR_OK;
}

static tsr_status parse_logit_bias(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        json_t *lb = field(root, "logit_bias"), *v;
        const char *key;

        if (!lb)
                return TSR_OK;
        if (!json_is_object(lb))
                return TYPE_ERR(err, "logit_bias", "a valid dictionary");
        if (json_object_size(lb) > lim->max_logit_bias)
                return VALUE_ERR(err, "logit_bias", "%zu logit_bias entries, more than the %zu allowed",
                                 json_object_size(lb), lim->max_logit_bias);
        r->logit_bias = tsr_arena_calloc(a, json_object_size(lb) + 1, sizeof(tsr_oai_logit_bias));
        if (!r->logit_bias)
                return fail(err, 500, "InternalServerError", NULL, "out of memory");
        json_object_foreach(lb, key, v) {
                char *end;
                long long id;
                errno = 0;
                id = strtoll(key, &end, 10);
                if (!*key || *end || errno || id < 0 || id > 0x7fffffff)
                        return VALUE_ERR(err, "logit_bias",
                                         "logit_bias contains key(s) that cannot be converted to integer token IDs: ['%.64s']",
                                         key);
                if (!json_is_number(v))
                        return TYPE_ERR(err, "logit_bias", "a dictionary of token id -> number");
                double b = json_number_value(v);
                b = b < -100.0 ? -100.0 : b > 100.0 ? 100.0 : b;
                r->logit_bias[r->n_logit_bias].token_id = (uint32_t)id;
                r->logit_bias[r->n_logit_bias].bias = (float)b;
                r->n_logit_bias++;
        }
        return TSR_OK;
}

/* SamplingParams._verify_args, in vLLM's order and words. */
static tsr_status verify_sampling(const tsr_oai_request *r, const tsr_oai_limits *lim, tsr_oai_error *err) {
        char f[64];
        if (r->n < 1)
                return VALUE_ERR(err, "n", "n must be at least 1, got %d.", r->n);
        if (r->n > lim->max_n)
                return VALUE_ERR(err, "n", "n must be at most %d, got %d.", lim->max_n, r->n);
        if (!(r->presence_penalty >= -2.0 && r->presence_penalty <= 2.0))
                return VALUE_ERR(err, "presence_penalty", "presence_penalty must be in [-2, 2], got %s.",
                                 fmt_float(r->presence_penalty, f, sizeof(f)));
        if (!(r->frequency_penalty >= -2.0 && r->frequency_penalty <= 2.0))
                return VALUE_ERR(err, "frequency_penalty", "frequency_penalty must be in [-2, 2], got %s.",
                                 fmt_float(r->frequency_penalty, f, sizeof(f)));
        if (r->has_repetition_penalty && !isfinite(r->repetition_penalty))
                return VALUE_ERR(err, "repetition_penalty", "repetition_penalty must be a finite number, got %s.",
                                 fmt_float(r->repetition_penalty, f, sizeof(f)));
        if (r->has_repetition_penalty && r->repetition_penalty <= 0.0)
                return VALUE_ERR(err, "repetition_penalty", "repetition_penalty must be greater than zero, got %s.",
                                 fmt_float(r->repetition_penalty, f, sizeof(f)));
        if (r->has_temperature && !isfinite(r->temperature))
                return VALUE_ERR(err, "temperature", "temperature must be a finite number, got %s.",
                                 fmt_float(r->temperature, f, sizeof(f)));
        if (r->has_temperature && r->temperature < 0.0)
                return VALUE_ERR(err, "temperature", "temperature must be non-negative, got %s.",
                                 fmt_float(r->temperature, f, sizeof(f)));
        if (r->has_top_p && !(r->top_p > 0.0 && r->top_p <= 1.0))
                return VALUE_ERR(err, "top_p", "top_p must be in (0, 1], got %s.", fmt_float(r->top_p, f, sizeof(f)));
        if (r->has_top_k && r->top_k < -1)
                return VALUE_ERR(err, "top_k", "top_k must be 0 (disable), or at least 1, got %lld.", (long long)r->top_k);
        if (r->has_min_p && !(r->min_p >= 0.0 && r->min_p <= 1.0))
                return VALUE_ERR(err, "min_p", "min_p must be in [0, 1], got %s.", fmt_float(r->min_p, f, sizeof(f)));
        if (r->has_max_tokens && r->max_tokens < 1 && !(r->kind == TSR_OAI_COMPLETIONS && r->echo && r->max_tokens == 0))
                return VALUE_ERR(err, "max_tokens", "max_tokens must be at least 1, got %lld.", (long long)r->max_tokens);
        if (r->min_tokens < 0)
                return VALUE_ERR(err, "min_tokens", "min_tokens must be greater than or equal to 0, got %lld.",
                                 (long long)r->min_tokens);
        if (r->has_max_tokens && r->max_tokens > 0 && r->min_tokens > r->max_tokens)
                return VALUE_ERR(err, "min_tokens", "min_tokens must be less than or equal to max_tokens=%lld, got %lld.",
                                 (long long)r->max_tokens, (long long)r->min_tokens);
        if (r->prompt_logprobs < -1)
                return VALUE_ERR(err, "prompt_logprobs", "prompt_logprobs must be non-negative or -1, got %d.",
                                 r->prompt_logprobs);
        /* -1 (the whole vocabulary) is checked against the cap once the model's
         * vocabulary is known (request/prepare.c). */
        if (lim->max_logprobs >= 0 && r->prompt_logprobs > lim->max_logprobs)
                return VALUE_ERR(err, "prompt_logprobs", "Requested prompt logprobs of %d, which is greater than max allowed: %d",
                                 r->prompt_logprobs, lim->max_logprobs);
        if (tsr_oai_request_is_greedy(r) && r->n > 1)
                return VALUE_ERR(err, "n", "n must be 1 when using greedy sampling, got %d.", r->n);
        return TSR_OK;
}

/* vLLM request fields that would change the output but are not implemented here: a
 * request using one gets 400, never an answer that silently ignores it (issue #12).
 * Fields that cannot change the output alone stay accepted, as vLLM accepts unknown
 * ones: user, parallel_tool_calls (vLLM 0.12 returns every call the parser finds either
 * way), guided_decoding_backend (xgrammar is the only backend), length_penalty (beam search only),
 * kv_transfer_params, mm_processor_kwargs (a text-only model) and vllm_xargs (read by
 * logits processors only). */
static tsr_status refuse_unimplemented(json_t *root, tsr_oai_error *err) {
        static const struct {
                const char *name;
                const char *why;
        } present[] = {   /* refused whenever present and not null */
                {"logits_processors", "custom logits processors are not implemented"},
                {"allowed_token_ids", "restricting sampling to given token ids is not implemented"},
                {"truncate_prompt_tokens", "prompts are never truncated"},
                {"prompt_embeds", "prompts are text or token ids only"},
                {"documents", "the chat template is given no documents"},
                {"cache_salt", "the prefix cache is shared by every request"},
                {"reasoning_effort", "it does not reach the chat template; a template that reads it can be "
                                     "given it in chat_template_kwargs"},
        };
        static const struct {
                const char *name;
                const char *why;
        } flags[] = {   /* refused when true */
                {"use_beam_search", "beam search is not implemented"},
                {"return_tokens_as_token_ids", "tokens are returned as text"},
                {"return_token_ids", "responses carry no token ids"},
        };
        json_t *v;
        int64_t best_of = 1;

        for (size_t i = 0; i < sizeof(present) / sizeof(present[0]); i++)
                if (field(root, present[i].name))
                        return VALUE_ERR(err, present[i].name, "%s is not supported yet: %s", present[i].name,
                                         present[i].why);
        for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++) {
                bool on = false;
                TRY(get_bool(root, flags[i].name, &on, err));
                if (on)
                        return VALUE_ERR(err, flags[i].name, "%s is not supported yet: %s", flags[i].name,
                                         flags[i].why);
        }
        v = field(root, "bad_words");
        if (v && !(json_is_array(v) && json_array_size(v) == 0))
                return VALUE_ERR(err, "bad_words", "bad_words is not supported yet: banning words is not implemented");
        TRY(get_int(root, "best_of", NULL, &best_of, err));
        if (best_of > 1)
                return VALUE_ERR(err, "best_of", "best_of is not supported yet: returning the best of several "
                                 "candidates is not implemented (n=%lld returns them all)", (long long)best_of);
        return TSR_OK;
}

/* ---- structured outputs (vLLM's structured_outputs, guided_*, response_format) ---- */

/* One constraint into r: its text as the worker compiles it, then xgrammar's own check
 * (no tokenizer needed), so a schema, regex or grammar it refuses is a 400 here and
 * never reaches a worker.  The check runs on the loop thread: building the Grammar of
 * a schema is a parse (well under a millisecond for ordinary schemas), not the compile
 * over the vocabulary, which the worker does off its engine thread. */
static tsr_status so_set(tsr_arena *a, tsr_oai_request *r, const char *param, tsr_grammar_kind kind, json_t *v,
                         tsr_oai_error *err) {
        static const char *const what[] = {
                [TSR_GRAMMAR_JSON_SCHEMA] = "Failed to transform json schema into a grammar",
                [TSR_GRAMMAR_JSON_OBJECT] = "Failed to build the JSON object grammar",
                [TSR_GRAMMAR_REGEX] = "Failed to transform regex into a grammar",
                [TSR_GRAMMAR_CHOICE] = "Failed to transform choices into a grammar",
                [TSR_GRAMMAR_EBNF] = "Invalid grammar specification",
        };
        char msg[512];
        const char *text = "";
        char *dumped = NULL;

        if (kind == TSR_GRAMMAR_JSON_OBJECT) {
                if (!json_is_boolean(v))
                        return TYPE_ERR(err, param, "a valid boolean");
                if (!json_is_true(v))
                        return TSR_OK;   /* json_object: false constrains nothing */
        }
        if (r->so_kind != TSR_GRAMMAR_NONE)
                return VALUE_ERR(err, param, "You can only use one kind of structured outputs constraint but multiple "
                                             "are specified");
        switch (kind) {
        case TSR_GRAMMAR_JSON_SCHEMA:
                if (json_is_string(v))
                        text = json_string_value(v);   /* a schema serialized by the client */
                else if (json_is_object(v) || json_is_boolean(v))
                        text = dumped = json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_ENCODE_ANY);
                else
                        return TYPE_ERR(err, param, "a valid dictionary or string");
                break;
        case TSR_GRAMMAR_REGEX:
        case TSR_GRAMMAR_EBNF:
                if (!json_is_string(v))
                        return TYPE_ERR(err, param, "a valid string");
                text = json_string_value(v);
                break;
        case TSR_GRAMMAR_CHOICE:
                if (!json_is_array(v))
                        return TYPE_ERR(err, param, "a valid list");
                for (size_t i = 0; i < json_array_size(v); i++)
                        if (!json_is_string(json_array_get(v, i)))
                                return TYPE_ERR(err, param, "a list of strings");
                text = dumped = json_dumps(v, JSON_COMPACT);
                break;
        default:
                break;
        }
        if (!text)
                return fail(err, 500, "InternalServerError", NULL, "out of memory");
        r->so_text = tsr_arena_strdup(a, text);
        free(dumped);
        if (!r->so_text)
                return fail(err, 500, "InternalServerError", NULL, "out of memory");
        r->so_kind = kind;
        tsr_grammar_spec spec = {.kind = kind, .text = r->so_text, .len = strlen(r->so_text),
                                 .any_whitespace = !r->so_compact};
        if (tsr_grammar_check(&spec, msg, sizeof(msg)) != TSR_OK)
                return VALUE_ERR(err, param, "%s: %s", what[kind], msg);
        return TSR_OK;
}

/* structured_outputs: one constraint and its options.  Options we do not honour are
 * refused; disable_fallback means nothing with one backend, and
 * disable_additional_properties nothing with xgrammar's strict schemas (extra
 * properties are never generated either way). */
static tsr_status parse_structured_outputs(json_t *so, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        static const struct {
                const char *name;
                tsr_grammar_kind kind;
        } kinds[] = {
                {"json", TSR_GRAMMAR_JSON_SCHEMA}, {"regex", TSR_GRAMMAR_REGEX},     {"choice", TSR_GRAMMAR_CHOICE},
                {"grammar", TSR_GRAMMAR_EBNF},     {"json_object", TSR_GRAMMAR_JSON_OBJECT},
        };
        static const char *const flags[] = {"disable_any_whitespace", "disable_fallback",
                                            "disable_additional_properties"};
        const char *key;
        json_t *v;
        bool ok, compact = false;

        if (!json_is_object(so))
                return TYPE_ERR(err, "structured_outputs", "a valid dictionary");
        TRY(get_bool(so, "disable_any_whitespace", &compact, err));
        r->so_compact = compact;
        json_object_foreach(so, key, v) {
                ok = false;
                for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]) && !ok; i++)
                        ok = strcmp(key, flags[i]) == 0;
                for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]) && !ok; i++)
                        ok = strcmp(key, kinds[i].name) == 0;
                if (ok || json_is_null(v))
                        continue;
                if (strcmp(key, "whitespace_pattern") == 0 || strcmp(key, "structural_tag") == 0)
                        return VALUE_ERR(err, "structured_outputs",
                                         "structured_outputs.%s is not supported yet: the xgrammar backend %s", key,
                                         key[0] == 'w' ? "does not take a whitespace pattern"
                                                       : "is not given structural tags here");
                return VALUE_ERR(err, "structured_outputs", "structured_outputs: unexpected keyword argument '%.64s'",
                                 key);
        }
        for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++) {
                bool b = false;
                TRY(get_bool(so, flags[i], &b, err));
        }
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
                if ((v = field(so, kinds[i].name)))
                        TRY(so_set(a, r, "structured_outputs", kinds[i].kind, v, err));
        return TSR_OK;
}

/* Every way a request asks for structured output.  vLLM maps response_format onto
 * structured_outputs, so a constraint in both is "multiple constraints"; the guided_*
 * fields (deprecated, removed in vLLM 0.12) are taken as the structured_outputs fields
 * they were renamed to rather than ignored. */
static tsr_status parse_structured(json_t *root, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        static const struct {
                const char *name;
                tsr_grammar_kind kind;
        } guided[] = {
                {"guided_json", TSR_GRAMMAR_JSON_SCHEMA},
                {"guided_regex", TSR_GRAMMAR_REGEX},
                {"guided_choice", TSR_GRAMMAR_CHOICE},
                {"guided_grammar", TSR_GRAMMAR_EBNF},
        };
        json_t *so = field(root, "structured_outputs"), *rf = field(root, "response_format"), *v;

        if (so)
                TRY(parse_structured_outputs(so, a, r, err));
        if (field(root, "guided_whitespace_pattern"))
                return VALUE_ERR(err, "guided_whitespace_pattern", "guided_whitespace_pattern is not supported yet: "
                                 "the xgrammar backend does not take a whitespace pattern");
        for (size_t i = 0; i < sizeof(guided) / sizeof(guided[0]); i++)
                if ((v = field(root, guided[i].name)))
                        TRY(so_set(a, r, guided[i].name, guided[i].kind, v, err));
        if (rf) {
                const char *type = json_string_value(json_object_get(rf, "type"));
                json_t *js;
                if (!json_is_object(rf) || !type)
                        return TYPE_ERR(err, "response_format", "an object with a string `type`");
                if (strcmp(type, "json_object") == 0)
                        return so_set(a, r, "response_format", TSR_GRAMMAR_JSON_OBJECT, json_true(), err);
                if (strcmp(type, "json_schema") == 0) {
                        js = field(rf, "json_schema");
                        if (!json_is_object(js) || !field(js, "schema"))
                                return VALUE_ERR(err, "response_format", "response_format type 'json_schema' needs "
                                                 "json_schema: {name, schema}");
                        return so_set(a, r, "response_format", TSR_GRAMMAR_JSON_SCHEMA, field(js, "schema"), err);
                }
                if (strcmp(type, "text") != 0)
                        return VALUE_ERR(err, "response_format", "response_format type '%.64s' is not supported yet "
                                         "(supported: 'text', 'json_object', 'json_schema')", type);
        }
        return TSR_OK;
}

/* tool_choice "required" or a named function: structured outputs with the tools'
 * schema (vLLM 0.12's get_json_schema_from_tools); the router's tool parser for the
 * forced shape reads the calls back (router/tools/forced.c).  As vLLM's adjust_request,
 * the tool schema replaces whatever response_format / structured_outputs asked for
 * (the reply is the call, so there is nothing else to constrain), disable_any_whitespace
 * included; a named tool without `parameters` constrains nothing (the arguments are
 * the text as generated) and leaves the other constraint in force. */
static tsr_status parse_forced_tools(tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        char msg[256] = "";
        json_t *schema;
        tsr_status st;

        if (r->kind != TSR_OAI_CHAT || !r->tool_choice ||
            (strcmp(r->tool_choice, "required") != 0 && strcmp(r->tool_choice, "function") != 0))
                return TSR_OK;
        if (!r->tools || !json_array_size(r->tools))
                return VALUE_ERR(err, "tool_choice", "When using `tool_choice`, `tools` must be set.");
        schema = tsr_tools_choice_schema(r->tools, r->tool_choice, r->tool_choice_name, msg, sizeof(msg));
        if (!schema)
                return msg[0] ? VALUE_ERR(err, "tool_choice", "%s", msg)
                              : fail(err, 500, "InternalServerError", NULL, "out of memory");
        if (json_is_null(schema))
                return TSR_OK;
        r->so_kind = TSR_GRAMMAR_NONE;
        r->so_text = NULL;
        r->so_compact = false;
        st = so_set(a, r, "tool_choice", TSR_GRAMMAR_JSON_SCHEMA, schema, err);
        json_decref(schema);
        return st;
}

bool tsr_oai_request_is_greedy(const tsr_oai_request *r) { return r->has_temperature && r->temperature < GREEDY_EPS; }

static tsr_status parse_common(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        int64_t v = 0;
        bool has = false;
        json_t *so;

        TRY(get_string(root, "model", &r->model, err));
        TRY(get_string(root, "request_id", &r->request_id, err));
        TRY(get_int(root, "n", &has, &v, err));
        if (has) {
                if (v < -1000000 || v > 1000000)
                        return VALUE_ERR(err, "n", "n must be at most %d, got %lld.", lim->max_n, (long long)v);
                r->n = (int)v;
        }
        TRY(get_number(root, "temperature", &r->has_temperature, &r->temperature, err));
        TRY(get_number(root, "top_p", &r->has_top_p, &r->top_p, err));
        TRY(get_int(root, "top_k", &r->has_top_k, &r->top_k, err));
        TRY(get_number(root, "min_p", &r->has_min_p, &r->min_p, err));
        TRY(get_number(root, "repetition_penalty", &r->has_repetition_penalty, &r->repetition_penalty, err));
        TRY(get_number(root, "presence_penalty", NULL, &r->presence_penalty, err));
        TRY(get_number(root, "frequency_penalty", NULL, &r->frequency_penalty, err));
        TRY(get_int(root, "seed", &r->has_seed, &r->seed, err));
        if (r->has_seed && r->seed == -1)
                r->has_seed = false;   /* vLLM: seed -1 means none */
        TRY(parse_stop(root, lim, a, r, err));
        TRY(get_bool(root, "include_stop_str_in_output", &r->include_stop_str_in_output, err));
        TRY(get_bool(root, "ignore_eos", &r->ignore_eos, err));
        TRY(get_int(root, "min_tokens", NULL, &r->min_tokens, err));
        TRY(get_bool(root, "skip_special_tokens", &r->skip_special_tokens, err));
        TRY(get_bool(root, "spaces_between_special_tokens", &r->spaces_between_special_tokens, err));
        TRY(parse_logit_bias(root, lim, a, r, err));
        TRY(get_bool(root, "stream", &r->stream, err));
        has = false;
        TRY(get_int(root, "prompt_logprobs", &has, &v, err));
        if (has) {
                /* Only an explicit prompt_logprobs is refused with stream (not one
                 * implied by echo + logprobs), as vLLM's model validator does. */
                if (r->stream && v > 0)
                        return VALUE_ERR(err, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.");
                r->prompt_logprobs = v < -1000 ? -1000 : v > 1000000 ? 1000000 : (int)v;
                r->prompt_logprobs_all = v == -1;
        }
        so = field(root, "stream_options");
        if (so) {
                if (!json_is_object(so))
                        return TYPE_ERR(err, "stream_options", "a valid dictionary");
                /* vLLM tests `data.get("stream_options") and not stream`: an empty
                 * object is falsy there and accepted (and means nothing) without stream. */
                if (!r->stream && json_object_size(so) > 0)
                        return VALUE_ERR(err, "stream_options", "Stream options can only be defined when `stream=True`.");
                r->include_usage = r->stream;   /* 0.12: true when the object is present */
                TRY(get_bool(so, "include_usage", &r->include_usage, err));
                TRY(get_bool(so, "continuous_usage_stats", &r->continuous_usage_stats, err));
        }
        TRY(get_bool(root, "add_special_tokens", &r->add_special_tokens, err));
        TRY(get_int(root, "priority", NULL, &r->priority, err));
        TRY(parse_structured(root, a, r, err));
        TRY(parse_forced_tools(a, r, err));
        return TSR_OK;
}

static tsr_status parse_completions(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        int64_t v = 0;
        bool has = false;
        json_t *suffix = field(root, "suffix");

        TRY(parse_prompts(root, lim, a, r, err));
        if (suffix)
                return VALUE_ERR(err, "suffix", "suffix is not currently supported");
        TRY(get_bool(root, "echo", &r->echo, err));
        r->has_max_tokens = true;
        r->max_tokens = 16;   /* completions default */
        if (json_object_get(root, "max_tokens") && json_is_null(json_object_get(root, "max_tokens")))
                r->has_max_tokens = false;   /* explicit null: the rest of the context */
        TRY(get_int(root, "max_tokens", NULL, &r->max_tokens, err));
        TRY(get_int(root, "logprobs", &has, &v, err));
        if (has) {
                if (v < 0)
                        return VALUE_ERR(err, "logprobs", "logprobs must be non-negative or -1, got %lld.", (long long)v);
                if (lim->max_logprobs >= 0 && v > lim->max_logprobs)
                        return VALUE_ERR(err, "logprobs", "Requested sample logprobs of %lld, which is greater than max allowed: %d",
                                         (long long)v, lim->max_logprobs);
                r->logprobs = (int)v;
                /* vLLM: echo makes prompt_logprobs default to logprobs. */
                if (r->echo && r->prompt_logprobs < 0)
                        r->prompt_logprobs = (int)v;
        }
        return TSR_OK;
}

static tsr_status parse_chat(json_t *root, const tsr_oai_limits *lim, tsr_arena *a, tsr_oai_request *r, tsr_oai_error *err) {
        int64_t v = 0;
        bool has = false;
        json_t *kw;

        TRY(parse_messages(root, lim, r, err));
        TRY(parse_tools(root, r, err));
        TRY(get_int(root, "max_tokens", &r->has_max_tokens, &r->max_tokens, err));
        has = false;
        TRY(get_int(root, "max_completion_tokens", &has, &v, err));
        if (has) {   /* max_completion_tokens wins over the deprecated max_tokens */
                r->has_max_tokens = true;
                r->max_tokens = v;
        }
        TRY(get_bool(root, "echo", &r->echo, err));
        TRY(get_bool(root, "add_generation_prompt", &r->add_generation_prompt, err));
        TRY(get_bool(root, "include_reasoning", &r->include_reasoning, err));
        TRY(get_bool(root, "continue_final_message", &r->continue_final_message, err));
        if (r->add_generation_prompt && r->continue_final_message)
                return VALUE_ERR(err, "continue_final_message",
                                 "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
        kw = field(root, "chat_template_kwargs");
        if (kw && !json_is_object(kw))
                return TYPE_ERR(err, "chat_template_kwargs", "a valid dictionary");
        r->chat_template_kwargs = kw;
        TRY(get_string(root, "chat_template", &r->chat_template, err));
        TRY(get_bool(root, "logprobs", &r->chat_logprobs, err));
        has = false;
        TRY(get_int(root, "top_logprobs", &has, &v, err));
        if (has) {
                if (v < -1)
                        return VALUE_ERR(err, "top_logprobs", "`top_logprobs` must be a non-negative value or -1.");
                if (v != 0 && !r->chat_logprobs)
                        return VALUE_ERR(err, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.");
                if (lim->max_logprobs >= 0 && (v > lim->max_logprobs || v == -1))
                        return VALUE_ERR(err, "top_logprobs", "Requested sample logprobs of %lld, which is greater than max allowed: %d",
                                         (long long)v, lim->max_logprobs);
                r->top_logprobs = (int)v;
        }
        if (r->chat_logprobs)
                r->logprobs = r->top_logprobs;
        return TSR_OK;
}

tsr_status tsr_oai_parse(tsr_oai_kind kind, const char *body, size_t len, const tsr_oai_limits *lim, tsr_arena *arena,
                     tsr_oai_request *req, tsr_oai_error *err) {
        tsr_oai_request r;
        json_error_t jerr;
        json_t *root;
        tsr_status st;

        memset(&r, 0, sizeof(r));
        r.kind = kind;
        r.n = 1;
        r.logprobs = -1;
        r.prompt_logprobs = -1;
        r.skip_special_tokens = true;
        r.spaces_between_special_tokens = true;
        r.add_generation_prompt = true;
        r.include_reasoning = true;
        r.add_special_tokens = kind == TSR_OAI_COMPLETIONS;

        /* JSON_DECODE_ANY: a body that is valid JSON but not an object ("hello", 5) gets
         * pydantic's "valid dictionary" message below, not a decode error. */
        root = json_loadb(body, len, JSON_DECODE_ANY, &jerr);
        if (!root)
                return fail(err, 400, "Bad Request", NULL, "JSON decode error: %s (line %d, column %d)", jerr.text,
                            jerr.line, jerr.column);
        if (!json_is_object(root)) {
                json_decref(root);
                return fail(err, 400, "Bad Request", NULL, "Input should be a valid dictionary or object");
        }
        if (json_depth(root, lim->max_json_depth + 1) > lim->max_json_depth) {
                json_decref(root);
                return fail(err, 400, "Bad Request", NULL, "the request body is nested deeper than %zu levels",
                            lim->max_json_depth);
        }
        r.root = root;
        st = kind == TSR_OAI_COMPLETIONS ? parse_completions(root, lim, arena, &r, err)
                                     : parse_chat(root, lim, arena, &r, err);
        if (st == TSR_OK)
                st = parse_common(root, lim, arena, &r, err);
        if (st == TSR_OK)
                st = verify_sampling(&r, lim, err);
        if (st == TSR_OK)
                st = refuse_unimplemented(root, err);
        if (st != TSR_OK) {
                json_decref(root);
                return st;
        }
        *req = r;
        return TSR_OK;
}

void tsr_oai_request_done(tsr_oai_request *req) {
        if (req->root)
                json_decref(req->root);
        req->root = NULL;
}

/* A JSON string of `s` with every byte that is not valid UTF-8 replaced by U+FFFD (as
 * Python's errors="replace"): an error message may quote the request's own bytes (a
 * parse error near invalid input), and JSON text must be UTF-8. */
static json_t *json_string_lossy(const char *s) {
        size_t n = strlen(s), o = 0;
        char *buf = malloc(3 * n + 1);          /* one byte can become three */
        json_t *j;
        if (!buf)
                return NULL;
        for (size_t i = 0; i < n;) {
                utf8proc_int32_t cp;
                utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
                if (k > 0) {
                        memcpy(buf + o, s + i, (size_t)k);
                        o += (size_t)k;
                        i += (size_t)k;
                } else {
                        memcpy(buf + o, "\xEF\xBF\xBD", 3);
                        o += 3;
                        i++;
                }
        }
        j = json_stringn(buf, o);
        free(buf);
        return j;
}

char *tsr_oai_error_json(const tsr_oai_error *err) {
        json_t *body = json_pack("{s:{s:o, s:s, s:o, s:i}}", "error", "message", json_string_lossy(err->message),
                                 "type", err->type, "param", err->param ? json_string_lossy(err->param) : json_null(),
                                 "code", err->status);
        char *s = body ? json_dumps(body, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
        json_decref(body);
        return s;
}
