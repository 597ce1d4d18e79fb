/* core.c - the request object: lifetime, the in-flight table, errors, completion, entry points (see request.h). */
#include "router/request/request_int.h"

#include <sys/random.h>

/* ------------------------------------------------------------------ lifetime */

static void rq_free(rq *r) {
        tsr_request_layer *L = r->L;
        if (r->prev_active)
                r->prev_active->next_active = r->next_active;
        else if (L->active == r)
                L->active = r->next_active;
        if (r->next_active)
                r->next_active->prev_active = r->prev_active;
        L->n_active--;
        for (size_t i = 0; i < r->n_choices; i++) {
                choice *ch = &r->choices[i];
                tsr_detok_free(&ch->detok);
                tsr_buf_done(&ch->text);
                json_decref(ch->stop_reason);
                free(ch->lp);
                tsr_chat_out_free(ch->parse);
                free(ch->plp);
        }
        free(r->choices);
        if (r->prompt_ids)   /* chat: n_prompts is 0, and prep_work fills slot 0 (valgrind.sh found the leak) */
                for (size_t i = 0; i < (r->req.n_prompts ? r->req.n_prompts : 1); i++) {
                        free(r->prompt_ids[i]);
                        free(r->prompt_texts[i]);
                }
        if (r->prompt_hashes)
                for (size_t i = 0; i < r->n_hashed; i++)
                        free(r->prompt_hashes[i]);
        free(r->prompt_hashes);
        free(r->prompt_n_hashes);
        for (size_t i = 0; i < r->n_detoks; i++)
                tsr_detok_free(&r->detoks[i]);
        free(r->detoks);
        free(r->prompt_ids);
        free(r->prompt_lens);
        free(r->prompt_texts);
        if (r->parsed)
                tsr_oai_request_done(&r->req);
        if (r->model)
                tsr_models_unref(r->model);
        free(r->body);
        tsr_arena_free(&r->arena);
        free(r);
}

/* Free when nothing refers to the request any more: no job, no choice in flight,
 * and either answered or the client gone. */
void tsr_request_maybe_free(rq *r) {
        if (r->jobs == 0 && r->n_open == 0 && (r->answered || r->gone))
                rq_free(r);
}

/* ------------------------------------------------------------------ in-flight table */

tsr_status tsr_request_table_put(tsr_request_layer *L, choice *ch) {
        for (unsigned tries = 0; tries < TABLE_SIZE; tries++) {
                uint64_t id = ++L->next_wire_id;
                if (!L->table[id & (TABLE_SIZE - 1)]) {
                        L->table[id & (TABLE_SIZE - 1)] = ch;
                        ch->wire_id = id;
                        return TSR_OK;
                }
        }
        return TSR_E_UNAVAILABLE;
}

void tsr_request_table_del(tsr_request_layer *L, choice *ch) {
        if (ch->wire_id && L->table[ch->wire_id & (TABLE_SIZE - 1)] == ch)
                L->table[ch->wire_id & (TABLE_SIZE - 1)] = NULL;
        ch->wire_id = 0;
}

choice *tsr_request_table_get(tsr_request_layer *L, const char *wire) {
        char *end;
        uint64_t id = strtoull(wire, &end, 10);
        choice *ch;
        if (*end || id == 0)
                return NULL;
        ch = L->table[id & (TABLE_SIZE - 1)];
        return ch && ch->wire_id == id ? ch : NULL;
}

/* ------------------------------------------------------------------ errors and helpers */

static void respond_oai_error(tsr_http_conn *c, const tsr_oai_error *e) {
        char *body = tsr_oai_error_json(e);
        if (body) {
                tsr_http_conn_respond(c, e->status, "application/json", body, strlen(body), NULL);
                free(body);
        } else {
                tsr_http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
        }
}

static void send_abort(choice *ch, const char *why) {
        tsr_envelope env;
        Tessera__V1__Abort ab;
        char idbuf[24];
        char *ids[1] = {idbuf};

        if (!ch->worker || !ch->wire_id)
                return;
        tsr_metrics_counter_add(ch->r->L->ctx->metrics, TSR_METRICS_ABORTS, why, 1);
        snprintf(idbuf, sizeof(idbuf), "%" PRIu64, ch->wire_id);
        tessera__v1__envelope__init(&env);
        tessera__v1__abort__init(&ab);
        ab.request_ids = ids;
        ab.n_request_ids = 1;
        ab.reason = (char *)why;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_ABORT;
        env.abort = &ab;
        tsr_worker_send(ch->worker, &env);
}

/* The choice leaves the in-flight table (its worker is told to stop if asked). */
void tsr_request_close_choice(choice *ch, bool abort_worker, const char *why) {
        rq *r = ch->r;
        if (!ch->wire_id)
                return;
        if (abort_worker)
                send_abort(ch, why);
        tsr_request_table_del(r->L, ch);
        ch->worker = NULL;
        r->n_open--;
}

void tsr_request_abort_all(rq *r, const char *why) {
        for (size_t i = 0; i < r->n_choices; i++)
                tsr_request_close_choice(&r->choices[i], true, why);
}


void tsr_request_fail(rq *r, int status, const char *type, const char *fmt, ...) {
        tsr_oai_error e = {.status = status, .type = type};
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.message, sizeof(e.message), fmt, ap);
        va_end(ap);
        tsr_request_fail_with(r, &e);
}

/* Answer with `err` (a body before the headers, an error event after them). */
void tsr_request_fail_with(rq *r, const tsr_oai_error *err) {
        tsr_oai_error e = *err;
        tsr_request_abort_all(r, "request_failed");
        if (r->c && !r->answered) {
                if (r->streaming) {
                        /* After the headers: an error event, then [DONE] (vLLM). */
                        char *body = tsr_oai_error_json(&e);
                        if (body) {
                                size_t n = strlen(body);
                                char *ev = malloc(n + 9);
                                if (ev) {
                                        memcpy(ev, "data: ", 6);
                                        memcpy(ev + 6, body, n);
                                        memcpy(ev + 6 + n, "\n\n", 2);
                                        tsr_http_conn_stream_write(r->c, ev, n + 8);
                                        free(ev);
                                }
                                free(body);
                        }
                        tsr_http_conn_stream_write(r->c, TSR_RESP_SSE_DONE, strlen(TSR_RESP_SSE_DONE));
                        tsr_http_conn_stream_end(r->c);
                } else {
                        respond_oai_error(r->c, &e);
                }
        }
        log_req(TSR_LOG_WARN, r->id, "failed: %d %s", e.status, e.message);
        r->answered = true;
        tsr_request_maybe_free(r);
}

static void make_random_hex(char *out, size_t n_hex) {
        unsigned char raw[32];
        static const char hex[] = "0123456789abcdef";
        if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw)) {
                uint64_t t = tsr_wall_ns() ^ (uint64_t)(uintptr_t)out;
                for (size_t i = 0; i < sizeof(raw); i++, t = t * 6364136223846793005ull + 1442695040888963407ull)
                        raw[i] = (unsigned char)(t >> 56);
        }
        for (size_t i = 0; i < n_hex && i / 2 < sizeof(raw); i++)
                out[i] = hex[(raw[i / 2] >> ((i & 1) ? 0 : 4)) & 15];
        out[n_hex] = '\0';
}

bool tsr_request_content_type_json(const tsr_http_request *req) {
        const char *ct = tsr_http_request_header(req, "content-type");
        size_t n;
        if (!ct)
                return false;
        n = strcspn(ct, "; \t");
        return n == 16 && strncasecmp(ct, "application/json", 16) == 0;
}

/* ------------------------------------------------------------------ completion of a request */

void tsr_request_finish(rq *r) {
        tsr_resp_head h;
        tsr_resp_usage u;

        if (r->answered || !r->c) {
                r->answered = true;
                tsr_request_maybe_free(r);
                return;
        }
        tsr_request_head_of(r, &h);
        tsr_request_usage_of(r, NULL, &u);
        if (r->streaming) {
                if (tsr_request_want_usage_chunk(r))
                        tsr_request_stream_write_obj(r, tsr_resp_usage_chunk(&h, r->kind == TSR_OAI_CHAT, &u));
                if (r->c) {
                        tsr_http_conn_stream_write(r->c, TSR_RESP_SSE_DONE, strlen(TSR_RESP_SSE_DONE));
                        tsr_http_conn_stream_end(r->c);
                }
        } else {
                json_t *choices = json_array(), *body;
                tsr_resp_tokens t = tsr_request_tokens_of(r);
                char *text;
                for (size_t i = 0; i < r->n_choices; i++) {
                        choice *ch = &r->choices[i];
                        json_t *lp = NULL, *c;
                        if (r->kind == TSR_OAI_CHAT) {
                                if (r->req.chat_logprobs)
                                        lp = tsr_resp_chat_logprobs(ch->lp, ch->n_lp, r->req.top_logprobs, &t);
                                c = tsr_resp_chat_choice(ch->index, r->L->ctx->cfg->response_role, (char *)ch->text.data,
                                                         ch->text.len, lp, ch->finish_reason, json_incref(ch->stop_reason));
                                if (tsr_request_parses_output(r))
                                        tsr_request_parse_message(r, ch, c);
                                json_array_append_new(choices, c);
                        } else {
                                tsr_buf full;
                                size_t n;
                                tsr_resp_token_lp *all;
                                tsr_buf_init(&full, (size_t)-1 / 2);
                                if (r->req.echo)
                                        tsr_buf_append_str(&full, r->prompt_texts[ch->prompt]);
                                tsr_buf_append(&full, ch->text.data, ch->text.len);
                                /* echo: the prompt's tokens first (position 0 without a
                                 * logprob), then the generated ones (none for tsr_request_echo_only). */
                                if (r->req.logprobs >= 0 && (all = tsr_request_completion_entries(r, ch, r->req.echo, 0, &n))) {
                                        lp = tsr_resp_completion_logprobs(all, n, r->req.logprobs, 0, &t);
                                        free(all);
                                }
                                c = tsr_resp_completion_choice(ch->index, (char *)full.data, full.len, lp, ch->finish_reason,
                                                           json_incref(ch->stop_reason));
                                if (r->req.prompt_logprobs >= 0 && ch->plp)
                                        tsr_resp_set_prompt_logprobs(
                                                c, tsr_resp_prompt_logprobs(ch->plp, r->prompt_lens[ch->prompt], &t));
                                json_array_append_new(choices, c);
                                tsr_buf_done(&full);
                        }
                }
                body = r->kind == TSR_OAI_CHAT ? tsr_resp_chat(&h, choices, &u) : tsr_resp_completion(&h, choices, &u);
                /* Chat: one prompt, so one prompt_logprobs list at the top (vLLM). */
                if (r->kind == TSR_OAI_CHAT && r->req.prompt_logprobs >= 0 && r->n_choices && r->choices[0].plp)
                        tsr_resp_set_prompt_logprobs(body, tsr_resp_prompt_logprobs(r->choices[0].plp, r->prompt_lens[0], &t));
                text = body ? json_dumps(body, JSON_COMPACT) : NULL;
                json_decref(body);
                if (text)
                        tsr_http_conn_respond(r->c, 200, "application/json", text, strlen(text), NULL);
                else
                        tsr_http_conn_respond_error(r->c, 500, "InternalServerError", "out of memory");
                free(text);
        }
        if (!r->L->ctx->cfg->disable_log_requests)
                log_req(TSR_LOG_INFO, r->id,
                        "done: choices=%zu prompt_tokens=%u cached_tokens=%u completion_tokens=%u e2e_ms=%.1f",
                        r->n_choices, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                        (double)(tsr_now_ns() - r->arrival_ns) / 1e6);
        r->answered = true;
        tsr_request_maybe_free(r);
}

static void observe_finished(choice *ch) {
        rq *r = ch->r;
        uint64_t now = tsr_now_ns();
        tsr_metrics_request m = {
                .finished_reason = strcmp(ch->finish_reason, "length") == 0  ? TSR_METRICS_FINISH_LENGTH
                                   : strcmp(ch->finish_reason, "abort") == 0 ? TSR_METRICS_FINISH_ABORT
                                                                             : TSR_METRICS_FINISH_STOP,
                .e2e_s = (double)(now - r->arrival_ns) / 1e9,
                .queue_s = (double)ch->queued_ns / 1e9,
                .prefill_s = (double)ch->prefill_ns / 1e9,
                .decode_s = (double)ch->decode_ns / 1e9,
                .inference_s = (double)(ch->prefill_ns + ch->decode_ns) / 1e9,
                .num_prompt_tokens = ch->prompt_tokens ? ch->prompt_tokens : (uint32_t)r->prompt_lens[ch->prompt],
                .num_generation_tokens = ch->n_generated,
                .max_tokens = r->req.has_max_tokens && r->req.max_tokens > 0 ? (uint32_t)r->req.max_tokens : 0,
        };
        tsr_metrics_request_finished(r->L->ctx->metrics, r->model->name, &m);
        if (r->n_open == 0) {
                uint32_t most = 0;
                for (size_t i = 0; i < r->n_choices; i++)
                        if (r->choices[i].n_generated > most)
                                most = r->choices[i].n_generated;
                tsr_metrics_request_group_finished(r->L->ctx->metrics, r->model->name, (uint32_t)r->req.n, most);
        }
}

void tsr_request_finish_choice(choice *ch, const char *reason, json_t *stop_reason, bool abort_worker) {
        rq *r = ch->r;
        if (ch->finished)
                return;
        ch->finished = true;
        ch->finish_reason = reason;
        if (ch->prompt == (int)(r->req.n_prompts ? r->req.n_prompts - 1 : 0))
                r->last_done = ch;
        json_decref(ch->stop_reason);
        ch->stop_reason = stop_reason ? stop_reason : json_null();
        tsr_request_close_choice(ch, abort_worker, "stop_string");
        observe_finished(ch);
        if (r->streaming)
                tsr_request_stream_choice(r, ch);
        if (r->n_open == 0)
                tsr_request_finish(r);
}

/* ------------------------------------------------------------------ entry points */

static void on_client_gone(void *ud) {
        rq *r = ud;
        r->c = NULL;
        r->gone = true;
        if (r->n_open)
                log_req(TSR_LOG_INFO, r->id, "client disconnected: aborting %zu choice(s)", r->n_open);
        tsr_request_abort_all(r, "client_disconnected");
        tsr_request_maybe_free(r);
}

static rq *rq_new(tsr_request_layer *L, tsr_http_conn *c, tsr_http_request *req, const char *prefix) {
        rq *r = calloc(1, sizeof(*r));
        const char *xid = tsr_http_request_header(req, "x-request-id");
        char rnd[33];
        if (!r)
                return NULL;
        r->L = L;
        r->c = c;
        r->arena = tsr_arena_new(0, 0);
        r->body = malloc(req->body_len + 1);
        if (!r->arena || !r->body) {
                tsr_arena_free(&r->arena);
                free(r->body);
                free(r);
                return NULL;
        }
        memcpy(r->body, req->body, req->body_len);
        r->body[req->body_len] = '\0';
        r->body_len = req->body_len;
        r->id_from_header = xid && *xid;
        if (!r->id_from_header) {
                make_random_hex(rnd, 32);
                xid = rnd;
        }
        snprintf(r->id, sizeof(r->id), "%s%.200s", prefix, xid);
        r->created = (int64_t)time(NULL);
        r->arrival_ns = tsr_now_ns();
        if (L->ctx->cfg->request_timeout_secs > 0)
                r->deadline_ns = r->arrival_ns + (uint64_t)L->ctx->cfg->request_timeout_secs * 1000000000ull;
        r->next_active = L->active;
        if (L->active)
                L->active->prev_active = r;
        L->active = r;
        L->n_active++;
        tsr_http_conn_on_close(c, on_client_gone, r);
        return r;
}

void tsr_request_handle_generate(tsr_request_layer *L, tsr_http_conn *c, tsr_http_request *req, tsr_oai_kind kind) {
        rq *r;
        if (!tsr_request_content_type_json(req)) {
                tsr_http_conn_respond_error(c, 400, "Bad Request", "Unsupported Media Type: Only 'application/json' is allowed");
                return;
        }
        r = rq_new(L, c, req, kind == TSR_OAI_CHAT ? "chatcmpl-" : "cmpl-");
        if (!r) {
                tsr_http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
                return;
        }
        r->kind = kind;
        r->work.data = r;
        r->jobs++;
        if (uv_queue_work(L->ctx->loop, &r->work, tsr_request_parse_work, tsr_request_parse_done) != 0) {
                r->jobs--;
                tsr_request_fail(r, 500, "InternalServerError", "cannot queue request parsing");
        }
}

size_t tsr_request_layer_active(const tsr_request_layer *L) { return L->n_active; }

/* Loop thread.  A request past its deadline that is at a worker (prompt prepared and
 * submitted) is aborted there and answered 504, or its stream ends with that error
 * event; one still being parsed or prepared waits for that bounded step to end. */
static void on_deadline_sweep(uv_timer_t *t) {
        tsr_request_layer *L = t->data;
        uint64_t now = tsr_now_ns();
        rq *next;
        for (rq *r = L->active; r; r = next) {
                next = r->next_active;  /* r may be freed below */
                if (!r->deadline_ns || now < r->deadline_ns || r->answered || r->gone || r->jobs || !r->n_open)
                        continue;
                tsr_request_abort_all(r, "deadline");
                tsr_request_fail(r, 504, "GatewayTimeoutError",
                             "The request did not finish within %d s (--request-timeout-secs).",
                             L->ctx->cfg->request_timeout_secs);
        }
}

void tsr_request_layer_close(tsr_request_layer *L) {
        if (L && L->sweep_started && !uv_is_closing((uv_handle_t *)&L->deadline_sweep))
                uv_close((uv_handle_t *)&L->deadline_sweep, NULL);
}

tsr_status tsr_request_layer_new(tsr_router_ctx *ctx, tsr_request_layer **ret) {
        tsr_request_layer *L = calloc(1, sizeof(*L));
        worker_events ev = tsr_request_worker_events();   /* ud set below */
        if (!L)
                return TSR_E_NOMEM;
        L->table = calloc(TABLE_SIZE, sizeof(choice *));
        if (!L->table) {
                free(L);
                return TSR_E_NOMEM;
        }
        L->ctx = ctx;
        ev.ud = L;
        tsr_worker_pool_set_events(ctx->workers, &ev);
        if (ctx->cfg->request_timeout_secs > 0) {
                uv_timer_init(ctx->loop, &L->deadline_sweep);
                L->deadline_sweep.data = L;
                uv_timer_start(&L->deadline_sweep, on_deadline_sweep, 200, 200);
                uv_unref((uv_handle_t *)&L->deadline_sweep);   /* does not keep the loop alive */
                L->sweep_started = true;
        }
        *ret = L;
        return TSR_OK;
}

void tsr_request_layer_free(tsr_request_layer **Lp) {
        tsr_request_layer *L;
        if (!Lp || !*Lp)
                return;
        L = *Lp;
        /* Requests still here had their connections closed by the HTTP server's
         * shutdown (on_close ran) or have jobs that finished; free the rest. */
        while (L->active) {
                rq *r = L->active;
                tsr_request_abort_all(r, "router_shutdown");
                r->jobs = 0;
                r->gone = true;
                rq_free(r);
        }
        free(L->table);
        for (size_t i = 0; i < L->n_pending; i++)
                tsr_placement_sent_free(&L->pending[i].sent);
        free(L->pending);
        tsr_placement_recent_done(&L->recent);
        free(L);
        *Lp = NULL;
}

