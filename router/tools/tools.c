/* tools.c - the parser table, results, tool call ids, the stream layer and the
 * messages handed to the chat template (see tools.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/clock.h"
#include "router/tools/parsers.h"
#include "router/tools/tools.h"

static const char *const llama3_starts[] = {"{", "<|python_tag|>", NULL};
static const char *const pythonic_starts[] = {"[", NULL};
static const char *const llama4_starts[] = {"[", "<|python_start|>", NULL};

/* The --tool-call-parser table: vLLM's names. */
static const tsr_tools_parser parsers[] = {
        {"hermes", false, NULL, tsr_tools_parse_hermes},
        {"llama3_json", false, llama3_starts, tsr_tools_parse_llama3_json},
        {"llama4_pythonic", true, llama4_starts, tsr_tools_parse_llama4_pythonic},
        {"pythonic", true, pythonic_starts, tsr_tools_parse_pythonic},
        {"qwen3_coder", true, NULL, tsr_tools_parse_qwen3_coder},
};

const tsr_tools_parser *tsr_tools_parser_find(const char *name) {
        for (size_t i = 0; name && i < sizeof(parsers) / sizeof(parsers[0]); i++)
                if (strcmp(parsers[i].name, name) == 0)
                        return &parsers[i];
        return NULL;
}

/* ------------------------------------------------------------------ results */

void tsr_tools_result_done(tsr_tools_result *r) {
        for (size_t i = 0; i < r->n_calls; i++) {
                free(r->calls[i].name);
                free(r->calls[i].args);
        }
        free(r->calls);
        free(r->content);
        memset(r, 0, sizeof(*r));
}

tsr_status tsr_tools_result_add(tsr_tools_result *r, const char *name, size_t name_len, const char *args, size_t args_len) {
        tsr_tools_call *g = realloc(r->calls, (r->n_calls + 1) * sizeof(*g)), *c;
        if (!g)
                return TSR_E_NOMEM;
        r->calls = g;
        c = &g[r->n_calls];
        memset(c, 0, sizeof(*c));
        if (name && !(c->name = strndup(name, name_len)))
                return TSR_E_NOMEM;
        if (!(c->args = malloc(args_len + 1))) {
                free(c->name);
                return TSR_E_NOMEM;
        }
        memcpy(c->args, args ? args : "", args_len);
        c->args[args_len] = '\0';
        c->args_len = args_len;
        r->n_calls++;
        return TSR_OK;
}

void tsr_tools_call_id(char out[48]) {
        static const char hex[] = "0123456789abcdef";
        unsigned char raw[16];
        if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw)) {
                uint64_t t = tsr_wall_ns() ^ (uint64_t)(uintptr_t)out;
                for (size_t i = 0; i < sizeof(raw); i++, t = t * 6364136223846793005ull + 1442695040888963407ull)
                        raw[i] = (unsigned char)(t >> 56);
        }
        memcpy(out, "chatcmpl-tool-", 14);
        for (size_t i = 0; i < 32; i++)
                out[14 + i] = hex[(raw[i / 2] >> ((i & 1) ? 0 : 4)) & 15];
        out[46] = '\0';
}

json_t *tsr_tools_calls_json(const tsr_tools_result *r) {
        json_t *a = json_array();
        for (size_t i = 0; a && r && i < r->n_calls; i++) {
                char id[48];
                json_t *c = json_object(), *f = json_object();
                tsr_tools_call_id(id);
                json_object_set_new(f, "name", json_string(r->calls[i].name ? r->calls[i].name : ""));
                json_object_set_new(f, "arguments", json_stringn(r->calls[i].args, r->calls[i].args_len));
                json_object_set_new(c, "id", json_string(id));
                json_object_set_new(c, "type", json_string("function"));
                json_object_set_new(c, "function", f);
                json_array_append_new(a, c);
        }
        return a;
}

/* ------------------------------------------------------------------ streaming */

typedef struct sent_call {
        char id[48];
        bool name_sent;
        size_t args_sent;
} sent_call;

struct tsr_tools_stream {
        const tsr_tools_parser *p;
        tsr_tools_ctx ctx;
        enum { UNDECIDED, CONTENT_ONLY, PARSING } mode;
        size_t content_sent;          /* bytes of content sent */
        sent_call *calls;
        size_t n_calls;
        tsr_buf tail;                 /* content sent at the end that is not a slice of the text */
};

tsr_tools_stream *tsr_tools_stream_new(const tsr_tools_parser *p, const tsr_tools_ctx *ctx) {
        tsr_tools_stream *s = calloc(1, sizeof(*s));
        if (!s)
                return NULL;
        s->p = p;
        s->ctx = *ctx;
        s->mode = p->stream_starts ? UNDECIDED : PARSING;
        tsr_buf_init(&s->tail, (size_t)64 << 20);
        return s;
}

void tsr_tools_stream_free(tsr_tools_stream *s) {
        if (!s)
                return;
        free(s->calls);
        tsr_buf_done(&s->tail);
        free(s);
}

bool tsr_tools_stream_called(const tsr_tools_stream *s) { return s && s->n_calls > 0; }

/* vLLM's llama3_json and pythonic streams look for calls only when the output starts
 * with their opener; anything else is streamed as plain content. */
static void decide(tsr_tools_stream *s, const char *text, size_t len, bool final) {
        bool maybe = false;
        for (const char *const *st = s->p->stream_starts; *st; st++) {
                size_t sl = strlen(*st);
                if (len >= sl && memcmp(text, *st, sl) == 0) {
                        s->mode = PARSING;
                        return;
                }
                if (len < sl && memcmp(text, *st, len) == 0)
                        maybe = true;
        }
        if (!maybe || final)
                s->mode = CONTENT_ONLY;
}

static json_t *call_delta(tsr_tools_stream *s, size_t i, const tsr_tools_call *c) {
        sent_call *sc = &s->calls[i];
        json_t *d = json_object(), *f = json_object();
        if (!sc->name_sent) {
                tsr_tools_call_id(sc->id);
                json_object_set_new(d, "id", json_string(sc->id));
                json_object_set_new(d, "type", json_string("function"));
        }
        json_object_set_new(d, "index", json_integer((json_int_t)i));
        if (!sc->name_sent) {
                json_object_set_new(f, "name", json_string(c->name));
                sc->name_sent = true;
                /* the arguments known by then ride along (vLLM's hermes sends them with
                 * the name when it has them; pythonic and qwen3_coder always) */
                if (s->p->name_with_args || c->args_len) {
                        json_object_set_new(f, "arguments", json_stringn(c->args, c->args_len));
                        sc->args_sent = c->args_len;
                }
        } else {
                json_object_set_new(f, "arguments", json_stringn(c->args + sc->args_sent, c->args_len - sc->args_sent));
                sc->args_sent = c->args_len;
        }
        json_object_set_new(d, "function", f);
        return d;
}

tsr_status tsr_tools_stream_step(tsr_tools_stream *s, const char *text, size_t len, bool final, const char **content,
                                 size_t *content_len, json_t **tool_calls) {
        tsr_tools_result res = {0};
        tsr_status st;
        json_t *deltas = NULL;

        *content = "";
        *content_len = 0;
        *tool_calls = NULL;
        if (s->mode == UNDECIDED)
                decide(s, text, len, final);
        if (s->mode == UNDECIDED)
                return TSR_OK;
        if (len < s->content_sent)
                return TSR_OK;   /* the text did not grow (a reasoning split moved): nothing new */
        if (s->mode == CONTENT_ONLY) {
                *content = text + s->content_sent;
                *content_len = len - s->content_sent;
                s->content_sent = len;
                return TSR_OK;
        }
        if ((st = s->p->parse(&s->ctx, text, len, final, &res)) != TSR_OK)
                return st;
        /* content: the settled prefix of the text, or at the end what the final parse
         * says the content is, past what went out already */
        if (!final) {
                if (res.safe_content > s->content_sent) {
                        *content = text + s->content_sent;
                        *content_len = res.safe_content - s->content_sent;
                        s->content_sent = res.safe_content;
                }
        } else if (res.content && res.content_len > s->content_sent) {
                tsr_buf_reset(&s->tail);
                if (tsr_buf_append(&s->tail, res.content + s->content_sent, res.content_len - s->content_sent) != TSR_OK) {
                        tsr_tools_result_done(&res);
                        return TSR_E_NOMEM;
                }
                *content = (const char *)s->tail.data;
                *content_len = s->tail.len;
                s->content_sent = res.content_len;
        }
        /* calls: names once complete, then the growth of each arguments string */
        for (size_t i = 0; i < res.n_calls; i++) {
                const tsr_tools_call *c = &res.calls[i];
                if (!c->name)
                        break;   /* later calls wait for this name */
                if (i >= s->n_calls) {
                        sent_call *g = realloc(s->calls, (i + 1) * sizeof(*g));
                        if (!g) {
                                tsr_tools_result_done(&res);
                                json_decref(deltas);
                                return TSR_E_NOMEM;
                        }
                        s->calls = g;
                        memset(&g[i], 0, sizeof(g[i]));
                        s->n_calls = i + 1;
                }
                sent_call *sc = &s->calls[i];
                bool grows = c->args_len > sc->args_sent;
                if (sc->name_sent && !grows)
                        continue;
                if (!deltas)
                        deltas = json_array();
                json_array_append_new(deltas, call_delta(s, i, c));
        }
        tsr_tools_result_done(&res);
        *tool_calls = deltas;
        return TSR_OK;
}

/* ------------------------------------------------------------------ template messages */

json_t *tsr_tools_template_messages(json_t *messages, char *err, size_t errlen) {
        json_t *out = json_array(), *m;
        size_t i;
        json_array_foreach(messages, i, m) {
                json_t *o = json_object(), *content = json_object_get(m, "content"), *v;
                const char *role = json_string_value(json_object_get(m, "role"));
                json_object_set(o, "role", json_object_get(m, "role"));
                if (json_is_array(content)) {
                        /* text parts joined by "\n" (vLLM's "string" content format) */
                        json_t *part;
                        size_t k;
                        tsr_buf joined;
                        tsr_buf_init(&joined, (size_t)1 << 30);
                        json_array_foreach(content, k, part) {
                                if (k)
                                        tsr_buf_append_str(&joined, "\n");
                                tsr_buf_append_str(&joined, json_string_value(json_object_get(part, "text")));
                        }
                        json_object_set_new(o, "content", json_stringn(joined.data ? (char *)joined.data : "", joined.len));
                        tsr_buf_done(&joined);
                } else if (json_is_string(content)) {
                        json_object_set(o, "content", content);
                } else {
                        json_object_set_new(o, "content", json_string(""));
                }
                if (json_is_string(v = json_object_get(m, "name")))
                        json_object_set(o, "name", v);
                if (role && strcmp(role, "tool") == 0 && (v = json_object_get(m, "tool_call_id")))
                        json_object_set(o, "tool_call_id", v);
                /* an earlier turn's reasoning (Qwen3-style templates read it) */
                if (role && strcmp(role, "assistant") == 0) {
                        if (json_is_string(v = json_object_get(m, "reasoning")))
                                json_object_set(o, "reasoning", v);
                        if (json_is_string(v = json_object_get(m, "reasoning_content")))
                                json_object_set(o, "reasoning_content", v);
                }
                if (role && strcmp(role, "assistant") == 0 && json_is_array(v = json_object_get(m, "tool_calls"))) {
                        json_t *calls = json_deep_copy(v), *c;
                        size_t k;
                        json_array_foreach(calls, k, c) {
                                json_t *f = json_object_get(c, "function"), *a = json_object_get(f, "arguments");
                                if (!json_is_object(f))
                                        continue;
                                if (json_is_string(a) && json_string_length(a) > 0) {
                                        json_error_t je;
                                        json_t *parsed = json_loadb(json_string_value(a), json_string_length(a),
                                                                    JSON_DECODE_ANY, &je);
                                        if (!parsed) {
                                                tsr_errf(err, errlen, "%s: line %d column %d (char %d)", je.text, je.line,
                                                         je.column, je.position);
                                                json_decref(calls);
                                                json_decref(o);
                                                json_decref(out);
                                                return NULL;
                                        }
                                        json_object_set_new(f, "arguments", parsed);
                                } else if (!json_is_object(a) && !json_is_array(a)) {
                                        json_object_set_new(f, "arguments", json_object());
                                }
                        }
                        json_object_set_new(o, "tool_calls", calls);
                }
                json_array_append_new(out, o);
        }
        return out;
}
