/* tokenize.c - POST /tokenize and /detokenize on the thread pool (see request.h). */
#include "router/request/request_int.h"

/* ------------------------------------------------------------------ /tokenize, /detokenize */

typedef struct tok_job {
        uv_work_t work;
        tsr_request_layer *L;
        tsr_http_conn *c;                 /* NULL once the client is gone */
        bool detokenize;
        bool running;
        char *body;
        size_t body_len;
        tsr_models_entry *model;
        /* results */
        int status;
        char *response;               /* JSON body */
} tok_job;

static void tok_job_gone(void *ud) {
        tok_job *j = ud;
        j->c = NULL;
        if (!j->running) {
                tsr_models_unref(j->model);
                free(j->body);
                free(j->response);
                free(j);
        }
}

static char *error_body(int status, const char *type, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static char *error_body(int status, const char *type, const char *fmt, ...) {
        tsr_oai_error e = {.status = status, .type = type};
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.message, sizeof(e.message), fmt, ap);
        va_end(ap);
        return tsr_oai_error_json(&e);
}

/* {"prompt": s, "add_special_tokens": true, "return_token_strs": false} or the chat form
 * {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, ...}
 * -> {"count", "max_model_len", "tokens", "token_strs"} */
static void tokenize_work(tok_job *j, json_t *root) {
        tsr_models_entry *m = j->model;
        json_t *messages = json_object_get(root, "messages"), *prompt = json_object_get(root, "prompt");
        bool chat = messages != NULL;
        bool add_special = !chat, return_strs = false;
        char *text = NULL;
        size_t len = 0;
        uint32_t *ids = NULL;
        size_t n_ids = 0;
        json_t *tokens, *strs = json_null(), *v;

        v = json_object_get(root, "add_special_tokens");
        if (json_is_boolean(v))
                add_special = json_is_true(v);
        v = json_object_get(root, "return_token_strs");
        if (json_is_boolean(v))
                return_strs = json_is_true(v);
        if (chat) {
                /* Reuse the chat path's parser and renderer on a throw-away request. */
                rq tmp;
                tsr_oai_limits lim;
                tsr_arena *a = tsr_arena_new(0, 0);
                char *dumped = json_dumps(root, JSON_COMPACT);
                memset(&tmp, 0, sizeof(tmp));
                tsr_oai_limits_default(&lim);
                lim.max_logprobs = -1;
                tmp.model = m;
                tmp.kind = TSR_OAI_CHAT;
                if (!dumped || !a || tsr_oai_parse(TSR_OAI_CHAT, dumped, strlen(dumped), &lim, a, &tmp.req, &tmp.err) != TSR_OK) {
                        j->status = tmp.err.status ? tmp.err.status : 500;
                        j->response = tsr_oai_error_json(&tmp.err);
                        free(dumped);
                        tsr_arena_free(&a);
                        return;
                }
                free(dumped);
                if (!m->tpl) {
                        j->status = 400;
                        j->response = error_body(400, "BadRequestError", "the model has no chat template");
                } else if (tsr_request_render_chat(&tmp, &text, &len) != TSR_OK) {
                        j->status = 400;
                        j->response = tsr_oai_error_json(&tmp.err);
                }
                tsr_oai_request_done(&tmp.req);
                tsr_arena_free(&a);
                if (j->response)
                        return;
        } else if (json_is_string(prompt)) {
                text = strndup(json_string_value(prompt), json_string_length(prompt));
                len = json_string_length(prompt);
        } else {
                j->status = 400;
                j->response = error_body(400, "Bad Request", "prompt: Input should be a valid string");
                return;
        }
        if (!text || tsr_tokenizer_encode(m->tok, text, len, add_special, &ids, &n_ids) != TSR_OK) {
                free(text);
                j->status = 400;
                j->response = error_body(400, "BadRequestError", "the prompt could not be tokenized (invalid UTF-8?)");
                return;
        }
        free(text);
        tokens = json_array();
        if (return_strs)
                strs = json_array();
        for (size_t i = 0; i < n_ids; i++) {
                json_array_append_new(tokens, json_integer(ids[i]));
                if (return_strs) {
                        const char *s = tsr_tokenizer_token_str(m->tok, ids[i]);
                        json_array_append_new(strs, json_string(s ? s : ""));
                }
        }
        free(ids);
        json_t *out = json_pack("{s:I, s:I, s:o, s:o}", "count", (json_int_t)n_ids, "max_model_len",
                                (json_int_t)m->max_model_len, "tokens", tokens, "token_strs", strs);
        j->response = out ? json_dumps(out, JSON_COMPACT) : NULL;
        json_decref(out);
        j->status = 200;
}

static void detokenize_work(tok_job *j, json_t *root) {
        json_t *tokens = json_object_get(root, "tokens"), *v;
        size_t i, n = json_array_size(tokens);
        uint32_t *ids;
        char *text = NULL;
        size_t len = 0;

        if (!json_is_array(tokens)) {
                j->status = 400;
                j->response = error_body(400, "Bad Request", "tokens: Input should be a valid list");
                return;
        }
        ids = malloc((n ? n : 1) * sizeof(uint32_t));
        if (!ids) {
                j->status = 500;
                j->response = error_body(500, "InternalServerError", "out of memory");
                return;
        }
        json_array_foreach(tokens, i, v) {
                if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                    json_integer_value(v) >= (json_int_t)tsr_tokenizer_vocab_size(j->model->tok)) {
                        free(ids);
                        j->status = 400;
                        j->response = error_body(400, "BadRequestError", "token id at position %zu is out of vocabulary", i);
                        return;
                }
                ids[i] = (uint32_t)json_integer_value(v);
        }
        if (tsr_tokenizer_decode(j->model->tok, ids, n, false, &text, &len) != TSR_OK) {
                free(ids);
                j->status = 500;
                j->response = error_body(500, "InternalServerError", "decoding failed");
                return;
        }
        free(ids);
        json_t *out = json_pack("{s:s%}", "prompt", text, len);
        j->response = out ? json_dumps(out, JSON_COMPACT) : NULL;
        json_decref(out);
        free(text);
        j->status = 200;
}

static void tok_work(uv_work_t *w) {   /* thread pool */
        tok_job *j = w->data;
        json_error_t jerr;
        json_t *root = json_loadb(j->body, j->body_len, 0, &jerr);
        if (!json_is_object(root)) {
                j->status = 400;
                j->response = error_body(400, "Bad Request", "JSON decode error: %s", root ? "not an object" : jerr.text);
        } else if (j->detokenize) {
                detokenize_work(j, root);
        } else {
                tokenize_work(j, root);
        }
        json_decref(root);
}

static void tok_done(uv_work_t *w, int status) {   /* loop */
        tok_job *j = w->data;
        j->running = false;
        if (j->c) {
                if (j->response)
                        tsr_http_conn_respond(j->c, j->status, "application/json", j->response, strlen(j->response), NULL);
                else
                        tsr_http_conn_respond_error(j->c, 500, "InternalServerError", "out of memory");
        }
        tsr_models_unref(j->model);
        free(j->body);
        free(j->response);
        free(j);
}

static void tok_start(tsr_request_layer *L, tsr_http_conn *c, tsr_http_request *req, bool detokenize) {
        tok_job *j;
        json_t *root;
        const char *model_name = NULL;
        tsr_models_entry *m;

        if (!tsr_request_content_type_json(req)) {
                tsr_http_conn_respond_error(c, 400, "Bad Request", "Unsupported Media Type: Only 'application/json' is allowed");
                return;
        }
        /* Peek at "model" only; the body is parsed again on the thread pool. */
        root = json_loadb((const char *)req->body, req->body_len, JSON_DISABLE_EOF_CHECK, NULL);
        model_name = json_string_value(json_object_get(root, "model"));
        m = tsr_models_registry_find(L->ctx->models, model_name);
        if (!m || !m->ready) {
                char *body = m ? error_body(503, "ServiceUnavailableError", "model %s is still loading", m->name)
                               : model_name && *model_name
                                         ? error_body(404, "NotFoundError", "The model `%s` does not exist.", model_name)
                                         : error_body(503, "ServiceUnavailableError", "no model is being served yet");
                json_decref(root);
                if (body)
                        tsr_http_conn_respond(c, m || !(model_name && *model_name) ? 503 : 404, "application/json", body,
                                          strlen(body), NULL);
                free(body);
                return;
        }
        json_decref(root);
        j = calloc(1, sizeof(*j));
        if (!j || !(j->body = malloc(req->body_len + 1))) {
                free(j);
                tsr_http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
                return;
        }
        memcpy(j->body, req->body, req->body_len);
        j->body_len = req->body_len;
        j->L = L;
        j->c = c;
        j->detokenize = detokenize;
        j->model = tsr_models_ref(m);
        j->work.data = j;
        j->running = true;
        tsr_http_conn_on_close(c, tok_job_gone, j);
        if (uv_queue_work(L->ctx->loop, &j->work, tok_work, tok_done) != 0) {
                j->running = false;
                tsr_http_conn_respond_error(c, 500, "InternalServerError", "cannot queue the job");
                tsr_models_unref(j->model);
                free(j->body);
                free(j);
        }
}

void tsr_request_handle_tokenize(tsr_request_layer *L, tsr_http_conn *c, tsr_http_request *req) { tok_start(L, c, req, false); }
void tsr_request_handle_detokenize(tsr_request_layer *L, tsr_http_conn *c, tsr_http_request *req) {
        tok_start(L, c, req, true);
}
