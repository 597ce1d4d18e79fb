/* fuzz_http.c - bytes -> llhttp (tsr_http_parse_one: the router's own callbacks and limits)
 * -> tsr_oai_parse (the OpenAI JSON validation) -> the request struct the router builds on.
 * No socket and no loop.
 *
 * The input is what a client would write on a connection: one or more pipelined HTTP
 * requests.  Each complete request is parsed as the server would parse it; its body goes
 * through tsr_oai_parse for the endpoint its path names (any other path: the kind the body
 * length's parity picks, so every body reaches the JSON validation).  Small limits
 * (4 KiB body, 2 KiB head, 16 headers) let short inputs reach the 413 and 431 paths.
 *
 * Properties checked (http_server.h, openai.h):
 *   - exactly one outcome: a request, a valid prefix, or a server error 400/413/431/500
 *     with a message; `consumed` within the input and > 0 for a request;
 *   - a request has method, path, query and a NUL-terminated body within max_body, at
 *     most max_headers lower-cased headers, each found again by tsr_http_request_header;
 *   - tsr_oai_parse either fills a request whose values are inside vLLM's bounds, or fails
 *     with a 4xx/500 status, a type and a message whose JSON body parses back;
 *   - no leak, no invalid access (ASan), no UB (UBSan).
 * Seeds: tests/fuzz/corpus/http (tests/fuzz/make_corpus.py). */
#include <string.h>

#include <jansson.h>

#include "common/arena.h"
#include "router/http_server.h"
#include "router/openai.h"
#include "fuzz.h"

#define MAX_PIPELINED 8

static void check_oai(tsr_oai_kind kind, const tsr_http_request *req) {
        tsr_oai_limits lim;
        tsr_oai_request r;
        tsr_oai_error err;
        tsr_arena *a = tsr_arena_new(4096, 0);
        tsr_status st;

        FUZZ_CHECK(a != NULL);
        tsr_oai_limits_default(&lim);
        memset(&err, 0, sizeof(err));
        st = tsr_oai_parse(kind, (const char *)req->body, req->body_len, &lim, a, &r, &err);
        if (st == TSR_OK) {
                FUZZ_CHECK(r.root && json_is_object(r.root));
                FUZZ_CHECK(r.n >= 1 && r.n <= lim.max_n);
                FUZZ_CHECK(!r.has_max_tokens || r.max_tokens >= 1 ||
                           (kind == TSR_OAI_COMPLETIONS && r.echo && r.max_tokens == 0));
                FUZZ_CHECK(r.logprobs <= lim.max_logprobs && r.prompt_logprobs <= lim.max_logprobs);
                FUZZ_CHECK(!r.has_temperature || r.temperature >= 0.0);
                FUZZ_CHECK(!r.has_top_p || (r.top_p > 0.0 && r.top_p <= 1.0));
                FUZZ_CHECK(!r.has_top_k || r.top_k >= -1);
                FUZZ_CHECK(r.n_stop <= lim.max_stop && r.n_logit_bias <= lim.max_logit_bias);
                for (size_t i = 0; i < r.n_stop; i++)
                        FUZZ_CHECK(r.stop[i] && r.stop[i][0] != '\0');
                for (size_t i = 0; i < r.n_logit_bias; i++)
                        FUZZ_CHECK(r.logit_bias[i].bias >= -100.0f && r.logit_bias[i].bias <= 100.0f);
                if (kind == TSR_OAI_COMPLETIONS) {
                        FUZZ_CHECK(r.n_prompts >= 1 && r.n_prompts <= lim.max_prompts);
                        for (size_t i = 0; i < r.n_prompts; i++) {
                                const tsr_oai_prompt *p = &r.prompts[i];
                                if (p->is_ids) {
                                        FUZZ_CHECK(p->n_ids >= 1 && p->n_ids <= lim.max_prompt_ids);
                                        fuzz_touch(p->ids, p->n_ids * sizeof(*p->ids));
                                } else {
                                        FUZZ_CHECK(p->text && p->text_len >= 1 && p->text[p->text_len] == '\0');
                                        fuzz_touch(p->text, p->text_len);
                                }
                        }
                } else {
                        FUZZ_CHECK(json_is_array(r.messages) && json_array_size(r.messages) >= 1);
                        FUZZ_CHECK(!(r.add_generation_prompt && r.continue_final_message));
                        FUZZ_CHECK(r.tool_choice != NULL);
                }
                tsr_oai_request_done(&r);
        } else {
                char *body;
                json_t *back;

                FUZZ_CHECK(st == TSR_E_INVAL);
                FUZZ_CHECK((err.status >= 400 && err.status < 500) || err.status == 500);
                FUZZ_CHECK(err.type && err.type[0] && err.message[0]);
                FUZZ_CHECK(memchr(err.message, '\0', sizeof(err.message)) != NULL);
                body = tsr_oai_error_json(&err);
                FUZZ_CHECK(body != NULL);
                back = json_loads(body, 0, NULL);
                FUZZ_CHECK(json_is_object(json_object_get(back, "error")));
                FUZZ_CHECK(json_integer_value(json_object_get(json_object_get(back, "error"), "code")) == err.status);
                json_decref(back);
                free(body);
        }
        tsr_arena_free(&a);
}

static void check_request(const tsr_http_server_opts *o, const tsr_http_request *req) {
        tsr_oai_kind kind;

        FUZZ_CHECK(req->method && req->path && req->query && req->body && req->arena);
        FUZZ_CHECK(req->body_len <= o->max_body && req->body[req->body_len] == '\0');
        FUZZ_CHECK(req->n_headers <= o->max_headers);
        fuzz_touch(req->path, strlen(req->path));
        fuzz_touch(req->query, strlen(req->query));
        fuzz_touch(req->body, req->body_len + 1);
        for (size_t i = 0; i < req->n_headers; i++) {
                const tsr_http_header *h = &req->headers[i];
                FUZZ_CHECK(h->name && h->value);
                for (const char *p = h->name; *p; p++)
                        FUZZ_CHECK(!(*p >= 'A' && *p <= 'Z'));
                fuzz_touch(h->value, strlen(h->value));
                FUZZ_CHECK(tsr_http_request_header(req, h->name) != NULL);
        }
        if (strcmp(req->path, "/v1/chat/completions") == 0)
                kind = TSR_OAI_CHAT;
        else if (strcmp(req->path, "/v1/completions") == 0)
                kind = TSR_OAI_COMPLETIONS;
        else
                kind = (req->body_len & 1) ? TSR_OAI_CHAT : TSR_OAI_COMPLETIONS;
        check_oai(kind, req);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        tsr_http_server_opts o;
        size_t off = 0;

        tsr_http_server_opts_default(&o);
        o.max_body = 4096;
        o.max_header_bytes = 2048;
        o.max_headers = 16;
        for (int k = 0; k < MAX_PIPELINED && off < size; k++) {
                tsr_http_parsed p;
                tsr_status st = tsr_http_parse_one(&o, data + off, size - off, &p);

                FUZZ_CHECK(st == TSR_OK);
                FUZZ_CHECK(p.consumed <= size - off);
                if (p.incomplete) {
                        FUZZ_CHECK(p.status == 0 && p.req.arena == NULL);
                        break;
                }
                if (p.status != 0) {
                        FUZZ_CHECK(p.status == 400 || p.status == 413 || p.status == 431 || p.status == 500);
                        FUZZ_CHECK(p.message && p.message[0] && p.req.arena == NULL);
                        break;
                }
                FUZZ_CHECK(p.consumed > 0);
                check_request(&o, &p.req);
                off += p.consumed;
                tsr_http_parsed_done(&p);
                FUZZ_CHECK(p.req.arena == NULL);
        }
        return 0;
}
