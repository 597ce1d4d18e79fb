/* request.c - the generation request path (see request.h). */
#include "request.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>

#include "common/block_hash.h"
#include "common/buf.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/wire.h"
#include "models.h"
#include "placement.h"
#include "response.h"
#include "router.h"
#include "stop.h"

#define TABLE_BITS 16                 /* in-flight choices per router: 65536 */
#define TABLE_SIZE (1u << TABLE_BITS)
#define MAX_ATTEMPTS 3
#define MAX_OUTPUT_BYTES (64u << 20)  /* one choice's text */

typedef struct rq rq;

typedef struct choice {
        rq *r;
        int index;                    /* OpenAI choice index: prompt * n + sample */
        int prompt;
        uint64_t wire_id;             /* key in the in-flight table; 0 when not in flight */
        tsr_worker *worker;
        int attempts;
        tsr_detok *detok;
        tsr_buf text;                 /* output text so far (after any stop cut) */
        size_t sent;                  /* bytes of `text` already streamed */
        uint32_t n_generated;
        uint32_t prompt_tokens;
        uint32_t cached_tokens;
        const char *finish_reason;    /* NULL while running */
        json_t *stop_reason;
        bool finished;
        bool role_sent;
        uint64_t first_token_ns;      /* router clock: TTFT, ITL */
        uint64_t last_token_ns;
        uint64_t queued_ns, prefill_ns, decode_ns;   /* engine's, from the final Output */
        /* logprobs (the request asked for them) */
        resp_token_lp *lp;            /* one per generated token, in order */
        size_t n_lp, cap_lp;
        size_t lp_sent;               /* streaming: entries of `lp` already sent */
        resp_token_lp *plp;           /* prompt_logprobs: one per prompt position, [0] without */
        bool echo_lp_sent;            /* streaming echo: the prompt's entries went out */
        size_t sent_chars;            /* streaming: code points of `text` sent (text_offset) */
        size_t echo_chars;            /* ... of which the echoed prompt */
} choice;

struct rq {
        request_layer *L;
        http_conn *c;                 /* NULL once the client is gone */
        oai_kind kind;
        oai_request req;
        bool parsed;
        tsr_arena *arena;
        char *body;                   /* a copy: the connection's may die with the client */
        size_t body_len;
        model_entry *model;           /* referenced */
        char id[300];
        int64_t created;
        uint64_t arrival_ns;
        uint64_t deadline_ns;         /* monotonic; 0 = none (--request-timeout-secs 0) */
        int jobs;                     /* thread-pool jobs in flight */
        bool gone;                    /* the client disconnected */
        bool answered;                /* a response (or stream end) was sent */
        bool streaming;               /* SSE headers sent */
        bool id_from_header;          /* X-Request-Id named the id */
        /* prepared prompts */
        uint32_t **prompt_ids;
        size_t *prompt_lens;
        char **prompt_texts;          /* echo: the prompt as text */
        /* Block-hash chain per prompt, for kv placement: computed by prep_work on the
         * thread pool with the spec read (loop thread) before it was queued. */
        uint64_t **prompt_hashes;     /* NULL when not hashed (policy, no spec, OOM) */
        size_t *prompt_n_hashes;
        size_t n_hashed;              /* entries of prompt_hashes */
        /* One detokenizer per choice (prompt i / n), primed with its prompt by prep_work
         * on the thread pool: priming decodes the whole prompt.  prep_done moves each into
         * its choice; rq_free frees what was not taken. */
        tsr_detok **detoks;
        size_t n_detoks;
        bool hash_wanted;
        tsr_block_hash_algo hash_algo;
        uint32_t hash_block_size;
        tsr_status prep_st;
        oai_error err;
        /* resolved sampling */
        int64_t max_tokens;
        float temperature, top_p, min_p, repetition_penalty;
        int32_t top_k;
        choice *choices;
        size_t n_choices;
        size_t n_open;
        /* Whose prefix-cache hits usage.prompt_tokens_details reports: vLLM runs each of
         * n samples as a child request and copies num_cached_tokens from the child whose
         * output it is handling, so a stream reports the child whose first output came
         * first, and a full response the child of the last prompt that finished last
         * (usage_of).  Borrowed from `choices`; NULL until set. */
        const choice *first_out;
        const choice *last_done;
        uv_work_t work;
        rq *next_active, *prev_active;
};

struct request_layer {
        router_ctx *ctx;
        choice **table;
        uint64_t next_wire_id;
        rq *active;                   /* every live request, for shutdown */
        size_t n_active;
        unsigned rotate;              /* placement tie-break */
        /* What this router sent each worker since that worker's last Status: the
         * "pending" terms of placement.h, which the Status cannot count yet.  An entry
         * is stale, and reads as zero, once the worker's Status seq moves on. */
        struct pending_dispatch {
                const tsr_worker *w;
                uint64_t boot_epoch, seq;
                uint64_t prefill_blocks, decode_blocks;
                uint32_t requests;
        } *pending;
        size_t n_pending;
        /* Every 200 ms, fail the submitted requests past their deadline (one timer for
         * all requests: a per-request uv_timer would need an async close per request). */
        uv_timer_t deadline_sweep;
        bool sweep_started;
};

static void finish_request(rq *r);
static void fail_request(rq *r, int status, const char *type, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

/* ------------------------------------------------------------------ lifetime */

static void rq_free(rq *r) {
        request_layer *L = r->L;
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
                oai_request_done(&r->req);
        if (r->model)
                model_unref(r->model);
        free(r->body);
        tsr_arena_free(&r->arena);
        free(r);
}

/* Free when nothing refers to the request any more: no job, no choice in flight,
 * and either answered or the client gone. */
static void rq_maybe_free(rq *r) {
        if (r->jobs == 0 && r->n_open == 0 && (r->answered || r->gone))
                rq_free(r);
}

/* ------------------------------------------------------------------ in-flight table */

static tsr_status table_put(request_layer *L, choice *ch) {
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

static void table_del(request_layer *L, choice *ch) {
        if (ch->wire_id && L->table[ch->wire_id & (TABLE_SIZE - 1)] == ch)
                L->table[ch->wire_id & (TABLE_SIZE - 1)] = NULL;
        ch->wire_id = 0;
}

static choice *table_get(request_layer *L, const char *wire) {
        char *end;
        uint64_t id = strtoull(wire, &end, 10);
        choice *ch;
        if (*end || id == 0)
                return NULL;
        ch = L->table[id & (TABLE_SIZE - 1)];
        return ch && ch->wire_id == id ? ch : NULL;
}

/* ------------------------------------------------------------------ errors and helpers */

static void respond_oai_error(http_conn *c, const oai_error *e) {
        char *body = oai_error_json(e);
        if (body) {
                http_conn_respond(c, e->status, "application/json", body, strlen(body), NULL);
                free(body);
        } else {
                http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
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
static void close_choice(choice *ch, bool abort_worker, const char *why) {
        rq *r = ch->r;
        if (!ch->wire_id)
                return;
        if (abort_worker)
                send_abort(ch, why);
        table_del(r->L, ch);
        ch->worker = NULL;
        r->n_open--;
}

static void abort_all(rq *r, const char *why) {
        for (size_t i = 0; i < r->n_choices; i++)
                close_choice(&r->choices[i], true, why);
}

static void fail_with(rq *r, const oai_error *err);

static void fail_request(rq *r, int status, const char *type, const char *fmt, ...) {
        oai_error e = {.status = status, .type = type};
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.message, sizeof(e.message), fmt, ap);
        va_end(ap);
        fail_with(r, &e);
}

/* Answer with `err` (a body before the headers, an error event after them). */
static void fail_with(rq *r, const oai_error *err) {
        oai_error e = *err;
        abort_all(r, "request_failed");
        if (r->c && !r->answered) {
                if (r->streaming) {
                        /* After the headers: an error event, then [DONE] (vLLM). */
                        char *body = oai_error_json(&e);
                        if (body) {
                                size_t n = strlen(body);
                                char *ev = malloc(n + 9);
                                if (ev) {
                                        memcpy(ev, "data: ", 6);
                                        memcpy(ev + 6, body, n);
                                        memcpy(ev + 6 + n, "\n\n", 2);
                                        http_conn_stream_write(r->c, ev, n + 8);
                                        free(ev);
                                }
                                free(body);
                        }
                        http_conn_stream_write(r->c, RESP_SSE_DONE, strlen(RESP_SSE_DONE));
                        http_conn_stream_end(r->c);
                } else {
                        respond_oai_error(r->c, &e);
                }
        }
        log_req(TSR_LOG_WARN, r->id, "failed: %d %s", e.status, e.message);
        r->answered = true;
        rq_maybe_free(r);
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

static bool content_type_json(const http_request *req) {
        const char *ct = http_request_header(req, "content-type");
        size_t n;
        if (!ct)
                return false;
        n = strcspn(ct, "; \t");
        return n == 16 && strncasecmp(ct, "application/json", 16) == 0;
}

/* ------------------------------------------------------------------ logprobs */

/* echo with max_tokens 0: the engine runs one token, the response carries only the
 * prompt (text and logprobs), as vLLM does. */
static bool echo_only(const rq *r) {
        return r->kind == OAI_COMPLETIONS && r->req.echo && r->req.has_max_tokens && r->req.max_tokens == 0;
}

/* resp_tokens.decode: one token's text, special tokens kept (vLLM's decoded_token is
 * tokenizer.decode([id])).  Loop thread. */
static char *decode_one(void *ud, uint32_t id, size_t *len) {
        char *text = NULL;
        if (tsr_tokenizer_decode(ud, &id, 1, false, &text, len) != TSR_OK)
                return NULL;
        return text;
}

static resp_tokens tokens_of(const rq *r) { return (resp_tokens){.decode = decode_one, .ud = r->model->tok}; }

static void lp_from_wire(const Tessera__V1__TokenLogprobs *w, uint32_t token, resp_token_lp *lp) {
        size_t n_top = w->n_top_token_ids < w->n_top_logprobs ? w->n_top_token_ids : w->n_top_logprobs;
        memset(lp, 0, sizeof(*lp));
        lp->token = token;
        lp->has = true;
        lp->logprob = w->logprob;
        lp->rank = w->rank;
        lp->n_top = (uint32_t)(n_top < RESP_MAX_TOP ? n_top : RESP_MAX_TOP);
        for (uint32_t i = 0; i < lp->n_top; i++) {
                lp->top_ids[i] = w->top_token_ids[i];
                lp->top_logprobs[i] = w->top_logprobs[i];
        }
}

/* The first Output's prompt logprobs (positions 1.. on the wire) as one entry per
 * prompt position; a position the worker sent nothing for has none (like position 0). */
static tsr_status take_prompt_lp(choice *ch, const Tessera__V1__RequestOutput *out) {
        rq *r = ch->r;
        size_t n = r->prompt_lens[ch->prompt];
        const uint32_t *ids = r->prompt_ids[ch->prompt];
        resp_token_lp *plp = calloc(n ? n : 1, sizeof(*plp));
        if (!plp)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n; i++) {
                plp[i].token = ids[i];
                if (i >= 1 && i - 1 < out->n_prompt_logprobs && out->prompt_logprobs[i - 1])
                        lp_from_wire(out->prompt_logprobs[i - 1], ids[i], &plp[i]);
        }
        free(ch->plp);
        ch->plp = plp;
        return TSR_OK;
}

static tsr_status push_lp(choice *ch, uint32_t token, const Tessera__V1__TokenLogprobs *w) {
        if (ch->n_lp == ch->cap_lp) {
                size_t cap = ch->cap_lp ? ch->cap_lp * 2 : 16;
                resp_token_lp *g = realloc(ch->lp, cap * sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                ch->lp = g;
                ch->cap_lp = cap;
        }
        if (w) {
                lp_from_wire(w, token, &ch->lp[ch->n_lp]);
        } else {
                memset(&ch->lp[ch->n_lp], 0, sizeof(*ch->lp));
                ch->lp[ch->n_lp].token = token;
        }
        ch->n_lp++;
        return TSR_OK;
}

/* The entries a completions logprobs object covers: with echo the prompt's first
 * (`with_prompt`), then generated ones from `from`.  malloc'd; *n set. */
static resp_token_lp *completion_entries(const rq *r, const choice *ch, bool with_prompt, size_t from, size_t *n) {
        size_t n_prompt = with_prompt ? r->prompt_lens[ch->prompt] : 0, n_gen = ch->n_lp - from;
        resp_token_lp *all = malloc((n_prompt + n_gen) ? (n_prompt + n_gen) * sizeof(*all) : 1);
        if (!all)
                return NULL;
        for (size_t i = 0; i < n_prompt; i++) {
                if (ch->plp) {
                        all[i] = ch->plp[i];
                } else {
                        memset(&all[i], 0, sizeof(all[i]));
                        all[i].token = r->prompt_ids[ch->prompt][i];
                }
        }
        if (n_gen)
                memcpy(all + n_prompt, ch->lp + from, n_gen * sizeof(*all));
        *n = n_prompt + n_gen;
        return all;
}

/* The logprobs of a stream chunk: every token not sent yet (a chunk suppressed for an
 * empty delta hands its tokens to the next one).  NULL when none were asked. */
static json_t *stream_logprobs(rq *r, choice *ch) {
        resp_tokens t = tokens_of(r);
        json_t *o = NULL;
        if (r->kind == OAI_CHAT) {
                if (!r->req.chat_logprobs)
                        return NULL;
                o = resp_chat_logprobs(ch->lp + ch->lp_sent, ch->n_lp - ch->lp_sent, r->req.top_logprobs, &t);
        } else {
                size_t n;
                bool first_echo = r->req.echo && !ch->echo_lp_sent;
                resp_token_lp *all;
                if (r->req.logprobs < 0)
                        return NULL;
                all = completion_entries(r, ch, first_echo, ch->lp_sent, &n);
                if (!all)
                        return NULL;
                /* vLLM's initial_text_offset: the generated text streamed before (the
                 * echoed prompt does not count). */
                o = resp_completion_logprobs(all, n, r->req.logprobs,
                                             first_echo || ch->sent_chars < ch->echo_chars ? 0
                                                                                           : ch->sent_chars - ch->echo_chars,
                                             &t);
                free(all);
                ch->echo_lp_sent = true;
        }
        ch->lp_sent = ch->n_lp;
        return o;
}

/* ------------------------------------------------------------------ streaming */

static const resp_head *head_of(rq *r, resp_head *h) {
        h->id = r->id;
        h->created = r->created;
        h->model = r->model->name;
        return h;
}

static bool want_usage_chunk(const rq *r) {
        return r->req.include_usage || r->L->ctx->cfg->enable_force_include_usage;
}

/* `only`: the per-chunk usage of one choice (stream_options.continuous_usage_stats),
 * which vLLM never gives prompt_tokens_details; NULL: the request's usage. */
static void usage_of(const rq *r, const choice *only, resp_usage *u) {
        const choice *src;

        memset(u, 0, sizeof(*u));
        /* vLLM counts every prompt once per choice set: prompt tokens of each prompt,
         * generated tokens of every choice. */
        for (size_t i = 0; i < r->n_choices; i++) {
                const choice *ch = &r->choices[i];
                if (only && ch != only)
                        continue;
                if (only || ch->index % r->req.n == 0)
                        u->prompt_tokens += ch->prompt_tokens ? ch->prompt_tokens : (uint32_t)r->prompt_lens[ch->prompt];
                u->completion_tokens += ch->n_generated;
        }
        if (only)
                return;
        /* Cached tokens are one child's, never a sum (see first_out), and vLLM 0.12 sets
         * the details only when that count is non-zero: null in a body, absent from
         * the usage chunk otherwise. */
        src = r->streaming ? r->first_out : r->last_done;
        u->cached_tokens = src ? src->cached_tokens : 0;
        u->has_cached_tokens = r->L->ctx->cfg->enable_prompt_tokens_details && u->cached_tokens > 0;
}

static void stream_write_obj(rq *r, json_t *obj) {
        size_t n;
        char *ev = resp_sse_event(obj, &n);
        if (!ev || !r->c)
                goto out;
        if (http_conn_stream_write(r->c, ev, n) == TSR_E_LIMIT) {
                /* A client that does not read: stop generating for it (output we cannot send is not buffered without bound). */
                log_req(TSR_LOG_WARN, r->id, "client is not reading: write queue over its cap, aborting");
                abort_all(r, "slow_client");
                http_conn_abort(r->c);
                r->c = NULL;
                r->gone = true;
        }
out:
        free(ev);
}

/* Send what is new in the choice's text (minus the stop-string holdback), with the
 * finish reason when the choice is done. */
static void stream_choice(rq *r, choice *ch) {
        resp_head h;
        resp_usage u, *up = NULL;
        size_t hold = ch->finished ? 0 : stop_holdback_bytes((char *)ch->text.data, ch->text.len, r->req.stop,
                                                             r->req.n_stop, r->req.include_stop_str_in_output);
        size_t upto = ch->text.len - hold;
        const char *delta = (const char *)ch->text.data + ch->sent;
        size_t delta_len = upto > ch->sent ? upto - ch->sent : 0;

        if (!r->c || !r->streaming)
                return;
        if (delta_len == 0 && !ch->finished)
                return;   /* vLLM suppresses empty deltas */
        if (r->req.continuous_usage_stats && want_usage_chunk(r)) {
                usage_of(r, ch, &u);
                up = &u;
        }
        head_of(r, &h);
        if (r->kind == OAI_CHAT) {
                if (!ch->role_sent) {
                        stream_write_obj(r, resp_chat_role_chunk(&h, ch->index, r->L->ctx->cfg->response_role, up));
                        ch->role_sent = true;
                }
                stream_write_obj(r, resp_chat_chunk(&h, ch->index, delta, delta_len, stream_logprobs(r, ch),
                                                    ch->finish_reason, ch->finished ? json_incref(ch->stop_reason) : NULL,
                                                    up));
        } else {
                stream_write_obj(r, resp_completion_chunk(&h, ch->index, delta, delta_len, stream_logprobs(r, ch),
                                                          ch->finish_reason,
                                                          ch->finished ? json_incref(ch->stop_reason) : NULL, up));
        }
        ch->sent_chars += utf8_count(delta, delta_len);
        ch->sent = upto;
}

/* ------------------------------------------------------------------ completion of a request */

static void finish_request(rq *r) {
        resp_head h;
        resp_usage u;

        if (r->answered || !r->c) {
                r->answered = true;
                rq_maybe_free(r);
                return;
        }
        head_of(r, &h);
        usage_of(r, NULL, &u);
        if (r->streaming) {
                if (want_usage_chunk(r))
                        stream_write_obj(r, resp_usage_chunk(&h, r->kind == OAI_CHAT, &u));
                if (r->c) {
                        http_conn_stream_write(r->c, RESP_SSE_DONE, strlen(RESP_SSE_DONE));
                        http_conn_stream_end(r->c);
                }
        } else {
                json_t *choices = json_array(), *body;
                resp_tokens t = tokens_of(r);
                char *text;
                for (size_t i = 0; i < r->n_choices; i++) {
                        choice *ch = &r->choices[i];
                        json_t *lp = NULL, *c;
                        if (r->kind == OAI_CHAT) {
                                if (r->req.chat_logprobs)
                                        lp = resp_chat_logprobs(ch->lp, ch->n_lp, r->req.top_logprobs, &t);
                                json_array_append_new(choices, resp_chat_choice(ch->index, r->L->ctx->cfg->response_role,
                                                                                (char *)ch->text.data, ch->text.len, lp,
                                                                                ch->finish_reason,
                                                                                json_incref(ch->stop_reason)));
                        } else {
                                tsr_buf full;
                                size_t n;
                                resp_token_lp *all;
                                tsr_buf_init(&full, (size_t)-1 / 2);
                                if (r->req.echo)
                                        tsr_buf_append_str(&full, r->prompt_texts[ch->prompt]);
                                tsr_buf_append(&full, ch->text.data, ch->text.len);
                                /* echo: the prompt's tokens first (position 0 without a
                                 * logprob), then the generated ones (none for echo_only). */
                                if (r->req.logprobs >= 0 && (all = completion_entries(r, ch, r->req.echo, 0, &n))) {
                                        lp = resp_completion_logprobs(all, n, r->req.logprobs, 0, &t);
                                        free(all);
                                }
                                c = resp_completion_choice(ch->index, (char *)full.data, full.len, lp, ch->finish_reason,
                                                           json_incref(ch->stop_reason));
                                if (r->req.prompt_logprobs >= 0 && ch->plp)
                                        resp_set_prompt_logprobs(
                                                c, resp_prompt_logprobs(ch->plp, r->prompt_lens[ch->prompt], &t));
                                json_array_append_new(choices, c);
                                tsr_buf_done(&full);
                        }
                }
                body = r->kind == OAI_CHAT ? resp_chat(&h, choices, &u) : resp_completion(&h, choices, &u);
                /* Chat: one prompt, so one prompt_logprobs list at the top (vLLM). */
                if (r->kind == OAI_CHAT && r->req.prompt_logprobs >= 0 && r->n_choices && r->choices[0].plp)
                        resp_set_prompt_logprobs(body, resp_prompt_logprobs(r->choices[0].plp, r->prompt_lens[0], &t));
                text = body ? json_dumps(body, JSON_COMPACT) : NULL;
                json_decref(body);
                if (text)
                        http_conn_respond(r->c, 200, "application/json", text, strlen(text), NULL);
                else
                        http_conn_respond_error(r->c, 500, "InternalServerError", "out of memory");
                free(text);
        }
        if (!r->L->ctx->cfg->disable_log_requests)
                log_req(TSR_LOG_INFO, r->id,
                        "done: choices=%zu prompt_tokens=%u cached_tokens=%u completion_tokens=%u e2e_ms=%.1f",
                        r->n_choices, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                        (double)(tsr_now_ns() - r->arrival_ns) / 1e6);
        r->answered = true;
        rq_maybe_free(r);
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

static void finish_choice(choice *ch, const char *reason, json_t *stop_reason, bool abort_worker) {
        rq *r = ch->r;
        if (ch->finished)
                return;
        ch->finished = true;
        ch->finish_reason = reason;
        if (ch->prompt == (int)(r->req.n_prompts ? r->req.n_prompts - 1 : 0))
                r->last_done = ch;
        json_decref(ch->stop_reason);
        ch->stop_reason = stop_reason ? stop_reason : json_null();
        close_choice(ch, abort_worker, "stop_string");
        observe_finished(ch);
        if (r->streaming)
                stream_choice(r, ch);
        if (r->n_open == 0)
                finish_request(r);
}

/* ------------------------------------------------------------------ placement and submission */

typedef enum routing_policy { ROUTE_KV, ROUTE_LEAST_LOAD, ROUTE_ROUND_ROBIN } routing_policy;

static routing_policy policy_of(const tsr_config *cfg) {
        const char *p = cfg->routing_policy;
        if (p && strcmp(p, "least_load") == 0)
                return ROUTE_LEAST_LOAD;
        if (p && strcmp(p, "round_robin") == 0)
                return ROUTE_ROUND_ROBIN;
        return ROUTE_KV;
}

static const char *const policy_names[] = {"kv", "least_load", "round_robin"};

/* The pending-dispatch entry of worker w as of its Status st (NULL: none yet),
 * reset when st is newer than the entry; NULL when out of memory. */
static struct pending_dispatch *pending_of(request_layer *L, const tsr_worker *w, const Tessera__V1__Status *st) {
        uint64_t epoch = st ? st->boot_epoch : 0, seq = st ? st->seq : 0;
        struct pending_dispatch *p = NULL;
        for (size_t i = 0; i < L->n_pending && !p; i++)
                if (L->pending[i].w == w)
                        p = &L->pending[i];
        if (!p) {
                struct pending_dispatch *grown = realloc(L->pending, (L->n_pending + 1) * sizeof(*grown));
                if (!grown)
                        return NULL;
                L->pending = grown;
                p = &L->pending[L->n_pending++];
                memset(p, 0, sizeof(*p));
                p->w = w;
        }
        if (p->boot_epoch != epoch || p->seq != seq) {
                memset(p, 0, sizeof(*p));
                p->w = w;
                p->boot_epoch = epoch;
                p->seq = seq;
        }
        return p;
}

static const char *const place_path_names[] = {"cost", "all_filtered", "imbalance_guard"};

/* Loop thread.  Candidates are the live workers serving the model, listed from a
 * rotating start so that ties spread.  kv: tsr_placement_pick (placement.h: capacity
 * filters, cost with the prompt's prefix hits in each worker's mirror, imbalance
 * guard); least_load: the fewest requests running, waiting and sent since the last
 * Status; round_robin: the first candidate. */
static tsr_worker *pick_worker(rq *r, int prompt, tsr_worker *avoid) {
        router_ctx *ctx = r->L->ctx;
        routing_policy pol = policy_of(ctx->cfg);
        size_t n = worker_pool_count(ctx->workers), n_cand = 0, best;
        const uint64_t *hashes = r->prompt_hashes ? r->prompt_hashes[prompt] : NULL;
        size_t n_hashes = hashes ? r->prompt_n_hashes[prompt] : 0;
        tsr_worker *stack_w[16], **ws = stack_w;
        tsr_placement_cand stack_c[16], *cs = stack_c;
        tsr_placement_path path = TSR_PLACE_COST;

        if (n > 16) {
                ws = malloc(n * sizeof(*ws));
                cs = malloc(n * sizeof(*cs));
                if (!ws || !cs) {   /* degrade to the first 16 rather than fail the request */
                        free(ws);
                        free(cs);
                        ws = stack_w;
                        cs = stack_c;
                        n = 16;
                }
        }
        /* A draining worker (SIGTERM, --shutdown-timeout) refuses new requests: list
         * it only when no other worker can take the request (second pass). */
        for (int pass = 0; pass < 2 && n_cand == 0; pass++) {
                for (size_t k = 0; k < worker_pool_count(ctx->workers) && n_cand < n; k++) {
                        size_t idx = (k + r->L->rotate) % worker_pool_count(ctx->workers);
                        tsr_worker *w = worker_pool_get(ctx->workers, idx);
                        const Tessera__V1__Status *st = tsr_worker_status(w);
                        tsr_placement_cand *c = &cs[n_cand];
                        if (!tsr_worker_live(w) || !tsr_worker_accepting(w) ||
                            !model_served_by(r->model, tsr_worker_model_info(w)))
                                continue;
                        if (w == avoid && worker_pool_count(ctx->workers) > 1)
                                continue;
                        if (pass == 0 && st && st->state == TESSERA__V1__STATUS__STATE__DRAINING)
                                continue;
                        const struct pending_dispatch *p = pending_of(r->L, w, st);
                        memset(c, 0, sizeof(*c));
                        c->block_size = r->hash_block_size ? r->hash_block_size : r->model->block_size;
                        if (st) {
                                c->num_running = st->num_running;
                                c->num_waiting = st->num_waiting;
                                c->waiting_prompt_tokens = st->waiting_prompt_tokens;
                                c->kv_total = st->kv_blocks_total;
                                c->kv_free = st->kv_blocks_free;
                                c->kv_active = st->kv_blocks_active;
                        }
                        if (p) {
                                c->pending_prefill_blocks = p->prefill_blocks;
                                c->pending_decode_blocks = p->decode_blocks;
                                c->pending_requests = p->requests;
                        }
                        c->reserve_blocks = tsr_placement_reserve(r->max_tokens > 0 ? (uint64_t)r->max_tokens : 1,
                                                                  c->block_size);
                        if (pol == ROUTE_KV) {
                                c->blocks = n_hashes;
                                c->hits = n_hashes ? tsr_worker_prefix_hits(w, hashes, n_hashes) : 0;
                        }
                        ws[n_cand++] = w;
                }
        }
        r->L->rotate++;
        if (pol == ROUTE_ROUND_ROBIN)
                best = n_cand ? 0 : (size_t)-1;
        else if (pol == ROUTE_LEAST_LOAD)
                best = tsr_placement_pick_least_load(cs, n_cand);
        else
                best = tsr_placement_pick(cs, n_cand, NULL, &path);
        tsr_worker *w = best == (size_t)-1 ? NULL : ws[best];
        if (w) {
                struct pending_dispatch *p = pending_of(r->L, w, tsr_worker_status(w));
                if (p) {
                        p->prefill_blocks += cs[best].blocks - (cs[best].hits < cs[best].blocks ? cs[best].hits
                                                                                                : cs[best].blocks);
                        p->decode_blocks += cs[best].blocks;
                        p->requests++;
                }
                tsr_metrics_counter_add(ctx->metrics, TSR_METRICS_PLACEMENTS, policy_names[pol], 1);
                if (pol == ROUTE_KV)
                        log_debug("%s: placed on %s (%zu of %zu blocks cached there, %s)", r->id,
                                  tsr_worker_endpoint(w), cs[best].hits, cs[best].blocks, place_path_names[path]);
        }
        if (ws != stack_w) {
                free(ws);
                free(cs);
        }
        return w;
}

static tsr_status submit_choice(choice *ch, tsr_worker *avoid) {
        rq *r = ch->r;
        tsr_envelope env;
        Tessera__V1__Submit s;
        Tessera__V1__SamplingParams sp;
        Tessera__V1__SamplingParams__LogitBiasEntry *lb = NULL, **lbp = NULL;
        uint32_t *stop_ids = r->req.stop_token_ids;
        char idbuf[24];
        tsr_worker *w = pick_worker(r, ch->prompt, avoid);
        tsr_status st;

        if (!w)
                return TSR_E_UNAVAILABLE;
        if (table_put(r->L, ch) != TSR_OK)
                return TSR_E_UNAVAILABLE;
        snprintf(idbuf, sizeof(idbuf), "%" PRIu64, ch->wire_id);
        tessera__v1__envelope__init(&env);
        tessera__v1__submit__init(&s);
        tessera__v1__sampling_params__init(&sp);
        sp.temperature = r->temperature;
        sp.top_p = r->top_p;
        sp.top_k = r->top_k;
        sp.min_p = r->min_p;
        sp.repetition_penalty = r->repetition_penalty;
        sp.frequency_penalty = (float)r->req.frequency_penalty;
        sp.presence_penalty = (float)r->req.presence_penalty;
        sp.has_seed = r->req.has_seed;
        /* Each sample of n gets its own stream of the seeded generator. */
        sp.seed = (uint64_t)r->req.seed + (uint64_t)(ch->index % r->req.n);
        if (r->req.n_logit_bias) {
                lb = calloc(r->req.n_logit_bias, sizeof(*lb));
                lbp = calloc(r->req.n_logit_bias, sizeof(*lbp));
                if (!lb || !lbp) {
                        free(lb);
                        free(lbp);
                        table_del(r->L, ch);
                        return TSR_E_NOMEM;
                }
                for (size_t i = 0; i < r->req.n_logit_bias; i++) {
                        tessera__v1__sampling_params__logit_bias_entry__init(&lb[i]);
                        lb[i].key = r->req.logit_bias[i].token_id;
                        lb[i].value = r->req.logit_bias[i].bias;
                        lbp[i] = &lb[i];
                }
                sp.logit_bias = lbp;
                sp.n_logit_bias = r->req.n_logit_bias;
        }
        s.request_id = idbuf;
        s.prompt_token_ids = r->prompt_ids[ch->prompt];
        s.n_prompt_token_ids = r->prompt_lens[ch->prompt];
        s.sampling = &sp;
        /* echo with max_tokens 0: run one token, return only the prompt (vLLM). */
        s.max_tokens = (uint32_t)(r->max_tokens > 0 ? r->max_tokens : 1);
        s.min_tokens = (uint32_t)r->req.min_tokens;
        s.stop_token_ids = stop_ids;
        s.n_stop_token_ids = r->req.n_stop_token_ids;
        s.ignore_eos = r->req.ignore_eos;
        /* Completions `logprobs: k`, chat `logprobs: true` + `top_logprobs: k` (openai.c
         * folds both into req.logprobs); prompt_logprobs explicit or implied by echo. */
        s.logprobs = r->req.logprobs < 0 ? -1 : r->req.logprobs > RESP_MAX_TOP ? RESP_MAX_TOP : r->req.logprobs;
        s.prompt_logprobs = r->req.prompt_logprobs < 0 ? -1
                            : r->req.prompt_logprobs > RESP_MAX_TOP ? RESP_MAX_TOP
                                                                    : r->req.prompt_logprobs;
        s.priority = (int32_t)r->req.priority;
        s.arrival_time_unix_ns = tsr_wall_ns();
        if (r->deadline_ns) {   /* the same instant on the wall clock (the worker does not act on it yet) */
                uint64_t now = tsr_now_ns();
                s.deadline_unix_ns = s.arrival_time_unix_ns + (r->deadline_ns > now ? r->deadline_ns - now : 0);
        }
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_SUBMIT;
        env.submit = &s;
        st = tsr_worker_send(w, &env);
        free(lb);
        free(lbp);
        if (st != TSR_OK) {
                table_del(r->L, ch);
                return st;
        }
        ch->worker = w;
        ch->attempts++;
        return TSR_OK;
}

/* A choice that produced nothing yet can go elsewhere; one that did cannot (the
 * client already has its first tokens). */
static void retry_or_fail(choice *ch, const char *why) {
        rq *r = ch->r;
        tsr_worker *failed = ch->worker;
        bool can_retry = ch->n_generated == 0 && ch->attempts < MAX_ATTEMPTS;

        close_choice(ch, false, why);
        r->n_open++;   /* still open: being resubmitted */
        if (can_retry && submit_choice(ch, failed) == TSR_OK) {
                log_req(TSR_LOG_INFO, r->id, "choice %d resubmitted (attempt %d): %s", ch->index, ch->attempts, why);
                tsr_metrics_counter_add(r->L->ctx->metrics, TSR_METRICS_RETRIES, NULL, 1);
                return;
        }
        r->n_open--;
        ch->finished = true;
        /* After tokens the upstream failed mid-answer: 502 (issue #5; a stream gets an
         * error event instead).  Before any token and no worker left: 503. */
        if (ch->n_generated)
                fail_request(r, 502, "BadGatewayError", "%s", why);
        else
                fail_request(r, 503, "ServiceUnavailableError", "%s", why);
}

/* ------------------------------------------------------------------ worker events */

static void on_output(void *ud, tsr_worker *w, const Tessera__V1__RequestOutput *out) {
        request_layer *L = ud;
        choice *ch = table_get(L, out->request_id);
        rq *r;

        if (!ch || ch->worker != w)
                return;   /* late output of an aborted or finished choice */
        r = ch->r;
        if (!r->first_out)
                r->first_out = ch;
        if (out->num_prompt_tokens)
                ch->prompt_tokens = out->num_prompt_tokens;
        if (out->num_cached_tokens)
                ch->cached_tokens = out->num_cached_tokens;
        if (out->finish_reason != TESSERA__V1__FINISH_REASON__FINISH_NONE) {
                ch->queued_ns = out->queued_ns;
                ch->prefill_ns = out->prefill_ns;
                ch->decode_ns = out->decode_ns;
        }
        if (out->n_new_token_ids) {
                uint64_t now = tsr_now_ns();
                if (!ch->first_token_ns) {
                        ch->first_token_ns = now;
                        tsr_metrics_observe_ttft(L->ctx->metrics, r->model->name, (double)(now - r->arrival_ns) / 1e9);
                } else {
                        tsr_metrics_observe_itl(L->ctx->metrics, r->model->name, (double)(now - ch->last_token_ns) / 1e9);
                }
                ch->last_token_ns = now;
        }
        /* The first Output carries the prompt's logprobs when they were asked. */
        if (r->req.prompt_logprobs >= 0 && out->num_prompt_tokens && take_prompt_lp(ch, out) != TSR_OK) {
                fail_request(r, 500, "InternalServerError", "out of memory");
                return;
        }
        size_t before = ch->text.len;
        for (size_t i = 0; i < out->n_new_token_ids && !ch->finished; i++) {
                char *delta = NULL;
                size_t dlen = 0;
                ch->n_generated++;
                if (echo_only(r))
                        continue;   /* counted (vLLM's completion_tokens: 1), never shown */
                if (r->req.logprobs >= 0 &&
                    push_lp(ch, out->new_token_ids[i], i < out->n_logprobs ? out->logprobs[i] : NULL) != TSR_OK) {
                        fail_request(r, 500, "InternalServerError", "out of memory");
                        return;
                }
                if (tsr_detok_push(ch->detok, out->new_token_ids[i], &delta, &dlen) != TSR_OK) {
                        free(delta);
                        fail_request(r, 500, "InternalServerError", "the worker returned token id %u, outside the vocabulary",
                                     out->new_token_ids[i]);
                        return;
                }
                if (dlen && tsr_buf_append(&ch->text, delta, dlen) != TSR_OK) {
                        free(delta);
                        finish_choice(ch, "length", NULL, true);
                        return;
                }
                free(delta);
                if (r->req.n_stop && dlen) {
                        stop_match m = stop_check((char *)ch->text.data, ch->text.len,
                                                  utf8_count((char *)ch->text.data + before, ch->text.len - before),
                                                  r->req.stop, r->req.n_stop, r->req.include_stop_str_in_output);
                        before = ch->text.len;
                        if (m.index >= 0) {
                                ch->text.len = m.cut_bytes;
                                ch->text.data[ch->text.len] = '\0';
                                finish_choice(ch, "stop", json_string(r->req.stop[m.index]), true);
                                return;
                        }
                }
        }
        if (out->finish_reason != TESSERA__V1__FINISH_REASON__FINISH_NONE) {
                char *tail = NULL;
                size_t tlen = 0;
                const char *reason = "stop";
                json_t *stop_reason = NULL;
                if (!echo_only(r) && tsr_detok_flush(ch->detok, &tail, &tlen) == TSR_OK && tlen)
                        tsr_buf_append(&ch->text, tail, tlen);
                free(tail);
                if (r->req.n_stop && tlen) {
                        stop_match m = stop_check((char *)ch->text.data, ch->text.len,
                                                  utf8_count((char *)ch->text.data + before, ch->text.len - before),
                                                  r->req.stop, r->req.n_stop, r->req.include_stop_str_in_output);
                        if (m.index >= 0) {
                                ch->text.len = m.cut_bytes;
                                ch->text.data[ch->text.len] = '\0';
                                finish_choice(ch, "stop", json_string(r->req.stop[m.index]), false);
                                return;
                        }
                }
                switch (out->finish_reason) {
                case TESSERA__V1__FINISH_REASON__FINISH_STOP:
                        if (out->has_stop_token_id)
                                stop_reason = json_integer(out->stop_token_id);
                        break;
                case TESSERA__V1__FINISH_REASON__FINISH_LENGTH:
                        reason = "length";
                        break;
                case TESSERA__V1__FINISH_REASON__FINISH_ABORT:
                        reason = "abort";
                        break;
                default:
                        fail_request(r, 500, "InternalServerError", "the worker failed while generating");
                        return;
                }
                finish_choice(ch, reason, stop_reason, false);
                return;
        }
        if (r->streaming)
                stream_choice(r, ch);
}

static void on_error(void *ud, tsr_worker *w, const Tessera__V1__Error *err) {
        request_layer *L = ud;
        choice *ch = table_get(L, err->request_id);
        if (!ch || ch->worker != w)
                return;
        if (err->retryable) {
                retry_or_fail(ch, err->message);
                return;
        }
        if (err->code == TESSERA__V1__ERROR_CODE__ERROR_INVALID || err->code == TESSERA__V1__ERROR_CODE__ERROR_TOO_LONG)
                fail_request(ch->r, 400, "BadRequestError", "%s", err->message);
        else
                fail_request(ch->r, 500, "InternalServerError", "%s", err->message);
}

static void on_worker_down(void *ud, tsr_worker *w) {
        request_layer *L = ud;
        if (L->ctx->loop_index == 0)    /* see on_status */
                tsr_metrics_worker_gone(L->ctx->metrics, tsr_worker_endpoint(w));
        for (size_t i = 0; i < TABLE_SIZE; i++) {
                choice *ch = L->table[i];
                if (ch && ch->worker == w)
                        retry_or_fail(ch, "the worker serving this request stopped responding");
        }
}

/* Loop thread, from the pool's tick while w is retired: our choices running there. */
static size_t in_flight(void *ud, const tsr_worker *w) {
        request_layer *L = ud;
        size_t n = 0;
        for (const rq *r = L->active; r; r = r->next_active)
                for (size_t i = 0; i < r->n_choices; i++)
                        n += r->choices[i].wire_id && r->choices[i].worker == w;
        return n;
}

/* Loop thread.  The pool drops w (retired, in_flight 0, so no choice points at it):
 * forget its pending-dispatch entry, whose address a later worker may reuse, and,
 * on loop 0 which feeds /metrics (see on_status), its series. */
static void on_worker_removed(void *ud, tsr_worker *w) {
        request_layer *L = ud;
        if (L->ctx->loop_index == 0)
                tsr_metrics_worker_remove(L->ctx->metrics, tsr_worker_endpoint(w));
        for (size_t i = 0; i < L->n_pending; i++) {
                if (L->pending[i].w == w) {
                        L->pending[i] = L->pending[--L->n_pending];
                        break;
                }
        }
}

static void on_model_info(void *ud, tsr_worker *w, const Tessera__V1__ModelInfo *mi) {
        request_layer *L = ud;
        const tsr_config *cfg = L->ctx->cfg;
        tsr_metrics_cache_info ci;

        model_registry_on_info(L->ctx->models, mi, tsr_worker_tokenizer(w));
        tsr_metrics_cache_info_defaults(&ci);
        ci.block_size = mi->block_size;
        ci.num_gpu_blocks = (int64_t)mi->kv_blocks_total;
        ci.enable_prefix_caching = mi->prefix_caching;
        ci.gpu_memory_utilization = cfg->gpu_memory_utilization;
        ci.swap_space = cfg->swap_space;
        ci.cache_dtype = cfg->kv_cache_dtype;
        ci.prefix_caching_hash_algo = cfg->prefix_caching_hash_algo;
        ci.kv_cache_memory_bytes = cfg->kv_cache_memory_bytes;
        ci.num_gpu_blocks_override = cfg->num_gpu_blocks_override;
        tsr_metrics_add_model(L->ctx->metrics, mi->served_model_names[0], mi->max_model_len, &ci);
}

static void on_status(void *ud, tsr_worker *w, const Tessera__V1__Status *st) {
        request_layer *L = ud;
        const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
        tsr_metrics_worker_sample s = {
                .num_running = st->num_running,
                .num_waiting = st->num_waiting,
                .kv_blocks_total = st->kv_blocks_total,
                .kv_blocks_free = st->kv_blocks_free,
                .num_preemptions_total = st->num_preemptions_total,
                .prefix_cache_queries_total = st->prefix_cache_queries_total,
                .prefix_cache_hits_total = st->prefix_cache_hits_total,
                .prompt_tokens_total = st->prompt_tokens_total,
                .generation_tokens_total = st->generation_tokens_total,
        };
        /* With --router-threads every loop hears every worker's Status; the engine
         * series (gauges, and counters fed as deltas of the worker's totals) come from
         * loop 0 alone, or a lagging loop's older sample would read as a restart. */
        if (mi && L->ctx->loop_index == 0)
                tsr_metrics_worker_status(L->ctx->metrics, mi->served_model_names[0], tsr_worker_endpoint(w),
                                          st->boot_epoch, &s);
}

/* ------------------------------------------------------------------ preparation (thread pool) */

/* OpenAI content parts -> one string, text parts joined by "\n" (vLLM's "string"
 * content format, which the templates of the models we serve expect). */
static json_t *normalized_messages(json_t *messages) {
        json_t *out = json_deep_copy(messages), *m;
        size_t i;
        json_array_foreach(out, i, m) {
                json_t *content = json_object_get(m, "content"), *part;
                size_t k;
                tsr_buf joined;
                if (!json_is_array(content))
                        continue;
                tsr_buf_init(&joined, (size_t)1 << 30);
                json_array_foreach(content, k, part) {
                        if (k)
                                tsr_buf_append_str(&joined, "\n");
                        tsr_buf_append_str(&joined, json_string_value(json_object_get(part, "text")));
                }
                json_object_set_new(m, "content", json_stringn(joined.data ? (char *)joined.data : "", joined.len));
                tsr_buf_done(&joined);
        }
        return out;
}

static tsr_status render_chat(rq *r, char **prompt, size_t *len) {
        json_t *ctx = json_object(), *kv;
        const char *key;
        tsr_status st;

        json_object_set_new(ctx, "messages", normalized_messages(r->req.messages));
        json_object_set_new(ctx, "add_generation_prompt", json_boolean(r->req.add_generation_prompt));
        json_object_set_new(ctx, "bos_token", json_string(r->model->bos_token));
        json_object_set_new(ctx, "eos_token", json_string(r->model->eos_token));
        if (r->req.tools)
                json_object_set(ctx, "tools", r->req.tools);
        if (r->req.chat_template_kwargs)
                json_object_foreach(r->req.chat_template_kwargs, key, kv)
                        json_object_set(ctx, key, kv);
        st = tsr_template_render(r->model->tpl, ctx, NULL, prompt, len, r->err.message, sizeof(r->err.message));
        json_decref(ctx);
        if (st != TSR_OK) {
                r->err.status = 400;
                r->err.type = "BadRequestError";
        }
        return st;
}

/* Thread pool, after tokenization: each prompt's block-hash chain, the same as the
 * worker's prefix cache computes (common/block_hash.h, no salt), so that placement on
 * the loop only has to look hashes up.  Best effort: on any failure the request is
 * placed without prefix affinity. */
static void hash_prompts(rq *r, size_t n) {
        if (!r->hash_wanted || !r->hash_block_size)
                return;
        r->prompt_hashes = calloc(n, sizeof(uint64_t *));
        r->prompt_n_hashes = calloc(n, sizeof(size_t));
        if (!r->prompt_hashes || !r->prompt_n_hashes)
                goto fail;
        for (size_t i = 0; i < n; i++) {
                size_t nb = r->prompt_lens[i] / r->hash_block_size;
                r->prompt_hashes[i] = malloc((nb ? nb : 1) * sizeof(uint64_t));
                if (!r->prompt_hashes[i] ||
                    tsr_block_hash_chain(r->hash_algo, r->prompt_ids[i], r->prompt_lens[i], r->hash_block_size,
                                         NULL, 0, r->prompt_hashes[i], &r->prompt_n_hashes[i]) != TSR_OK)
                        goto fail;
        }
        r->n_hashed = n;
        return;
fail:
        if (r->prompt_hashes)
                for (size_t i = 0; i < n; i++)
                        free(r->prompt_hashes[i]);
        free(r->prompt_hashes);
        free(r->prompt_n_hashes);
        r->prompt_hashes = NULL;
        r->prompt_n_hashes = NULL;
}

/* Loop thread, before prep_work is queued: how the workers serving the model hash
 * their blocks (the first such worker with prefix caching on; workers of one model
 * are expected to agree — one that does not simply never shows hits). */
static void choose_hash_spec(rq *r) {
        router_ctx *ctx = r->L->ctx;
        if (policy_of(ctx->cfg) != ROUTE_KV)
                return;
        for (size_t k = 0; k < worker_pool_count(ctx->workers); k++) {
                const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(worker_pool_get(ctx->workers, k));
                if (!mi || !mi->prefix_caching || !mi->block_size || !mi->block_hash ||
                    !model_served_by(r->model, mi))
                        continue;
                if (tsr_block_hash_algo_parse(mi->block_hash->algo, &r->hash_algo) != TSR_OK)
                        continue;
                r->hash_block_size = mi->block_size;
                r->hash_wanted = true;
                return;
        }
}

/* Thread pool.  A detokenizer for every choice, primed with its prompt as vLLM primes
 * its DecodeStream (a SentencePiece model's first token keeps its leading space). */
static tsr_status prime_detoks(rq *r, size_t n_prompts) {
        size_t per = r->req.n > 0 ? (size_t)r->req.n : 1;
        r->detoks = calloc(n_prompts * per, sizeof(*r->detoks));
        if (!r->detoks)
                return TSR_E_NOMEM;
        r->n_detoks = n_prompts * per;
        for (size_t i = 0; i < r->n_detoks; i++) {
                size_t p = i / per;
                if (tsr_detok_new(r->model->tok, r->req.skip_special_tokens, &r->detoks[i]) != TSR_OK ||
                    tsr_detok_prime(r->detoks[i], r->prompt_ids[p], r->prompt_lens[p]) != TSR_OK)
                        return TSR_E_NOMEM;
        }
        return TSR_OK;
}

static void prep_work(uv_work_t *w) {   /* thread pool */
        rq *r = w->data;
        size_t n = r->req.n_prompts ? r->req.n_prompts : 1;
        const tsr_tokenizer *tok = r->model->tok;

        r->prompt_ids = calloc(n, sizeof(uint32_t *));
        r->prompt_lens = calloc(n, sizeof(size_t));
        r->prompt_texts = calloc(n, sizeof(char *));
        if (!r->prompt_ids || !r->prompt_lens || !r->prompt_texts)
                goto oom;
        if (r->kind == OAI_CHAT) {
                char *text = NULL;
                size_t len = 0;
                if (render_chat(r, &text, &len) != TSR_OK) {
                        r->prep_st = TSR_E_INVAL;
                        return;
                }
                r->prep_st = tsr_tokenizer_encode(tok, text, len, r->req.add_special_tokens, &r->prompt_ids[0],
                                                  &r->prompt_lens[0]);
                r->prompt_texts[0] = text;
                if (r->prep_st != TSR_OK)
                        goto tokenize_failed;
                hash_prompts(r, 1);
                if (prime_detoks(r, 1) != TSR_OK)
                        goto oom;
                return;
        }
        for (size_t i = 0; i < r->req.n_prompts; i++) {
                const oai_prompt *p = &r->req.prompts[i];
                if (p->is_ids) {
                        size_t vocab = tsr_tokenizer_vocab_size(tok);
                        r->prompt_ids[i] = malloc((p->n_ids ? p->n_ids : 1) * sizeof(uint32_t));
                        if (!r->prompt_ids[i])
                                goto oom;
                        for (size_t k = 0; k < p->n_ids; k++) {
                                if (p->ids[k] >= vocab) {
                                        r->err.status = 400;
                                        r->err.type = "BadRequestError";
                                        snprintf(r->err.message, sizeof(r->err.message),
                                                 "Token id %u is out of vocabulary", p->ids[k]);
                                        r->prep_st = TSR_E_INVAL;
                                        return;
                                }
                                r->prompt_ids[i][k] = p->ids[k];
                        }
                        r->prompt_lens[i] = p->n_ids;
                        if (r->req.echo && tsr_tokenizer_decode(tok, p->ids, p->n_ids, false, &r->prompt_texts[i], &(size_t){0}) != TSR_OK)
                                r->prompt_texts[i] = strdup("");
                } else {
                        r->prep_st = tsr_tokenizer_encode(tok, p->text, p->text_len, r->req.add_special_tokens,
                                                          &r->prompt_ids[i], &r->prompt_lens[i]);
                        if (r->prep_st != TSR_OK)
                                goto tokenize_failed;
                        r->prompt_texts[i] = strndup(p->text, p->text_len);
                }
        }
        hash_prompts(r, n);
        if (prime_detoks(r, n) != TSR_OK)
                goto oom;
        return;
tokenize_failed:
        r->err.status = 400;
        r->err.type = "BadRequestError";
        snprintf(r->err.message, sizeof(r->err.message), "the prompt could not be tokenized: %s",
                 r->prep_st == TSR_E_INVAL ? "it is not valid UTF-8" : tsr_status_str(r->prep_st));
        return;
oom:
        r->prep_st = TSR_E_NOMEM;
        r->err.status = 500;
        r->err.type = "InternalServerError";
        snprintf(r->err.message, sizeof(r->err.message), "out of memory");
}

/* vLLM's context-length rules and messages (serving_engine._validate_input). */
static bool check_lengths(rq *r) {
        uint32_t L = r->model->max_model_len;
        const char *suffix = r->kind == OAI_CHAT ? " None" : "";   /* vLLM's chat wraps the error with its cause */
        for (size_t i = 0; i < r->req.n_prompts || (i == 0 && r->kind == OAI_CHAT); i++) {
                size_t N = r->prompt_lens[i];
                int64_t M;
                if (N == 0) {
                        fail_request(r, 400, "BadRequestError", "Prompt cannot be empty.");
                        return false;
                }
                if (r->kind == OAI_CHAT) {
                        if (N >= L) {
                                fail_request(r, 400, "BadRequestError",
                                             "This model's maximum context length is %u tokens. However, your request has "
                                             "%zu input tokens. Please reduce the length of the input messages.%s", L, N, suffix);
                                return false;
                        }
                        M = r->req.has_max_tokens ? r->req.max_tokens : (int64_t)(L - N);
                        if (r->req.has_max_tokens && (int64_t)N + M > (int64_t)L) {
                                fail_request(r, 400, "BadRequestError",
                                             "'max_tokens' or 'max_completion_tokens' is too large: %lld. This model's maximum "
                                             "context length is %u tokens and your request has %zu input tokens (%lld > %u - %zu).%s",
                                             (long long)M, L, N, (long long)M, L, N, suffix);
                                return false;
                        }
                } else {
                        M = r->req.has_max_tokens ? r->req.max_tokens : (int64_t)L - (int64_t)N;
                        if (M < 0 || (int64_t)N > (int64_t)L - (r->req.has_max_tokens ? M : 0) ||
                            (!r->req.has_max_tokens && N >= L)) {
                                fail_request(r, 400, "BadRequestError",
                                             "This model's maximum context length is %lld tokens. However, your request has "
                                             "%zu input tokens. Please reduce the length of the input messages.",
                                             (long long)L - (r->req.has_max_tokens ? M : 0), N);
                                return false;
                        }
                }
                /* The request's own value, else the rest of the context capped by the
                 * model's max_new_tokens; the smallest over all prompts. */
                if (!r->req.has_max_tokens && r->model->gen.has_max_new_tokens && r->model->gen.max_new_tokens < M)
                        M = r->model->gen.max_new_tokens;
                if (i == 0 || M < r->max_tokens)
                        r->max_tokens = M;
        }
        return true;
}

/* Unset sampling fields come from the model's generation_config.json, else vLLM's
 * neutral defaults. */
static bool resolve_sampling(rq *r) {
        const Tessera__V1__GenerationDefaults *g = &r->model->gen;
        r->temperature = (float)(r->req.has_temperature ? r->req.temperature : g->has_temperature ? g->temperature : 1.0);
        r->top_p = (float)(r->req.has_top_p ? r->req.top_p : g->has_top_p ? g->top_p : 1.0);
        r->top_k = (int32_t)(r->req.has_top_k ? r->req.top_k : g->has_top_k ? g->top_k : 0);
        if (r->top_k < 0)
                r->top_k = 0;
        r->min_p = (float)(r->req.has_min_p ? r->req.min_p : g->has_min_p ? g->min_p : 0.0);
        r->repetition_penalty = (float)(r->req.has_repetition_penalty ? r->req.repetition_penalty
                                        : g->has_repetition_penalty ? g->repetition_penalty : 1.0);
        if (r->temperature < 1e-5f) {
                if (r->req.n > 1) {
                        fail_request(r, 400, "BadRequestError", "n must be 1 when using greedy sampling, got %d.", r->req.n);
                        return false;
                }
                r->top_p = 1.0f;
                r->top_k = 0;
                r->min_p = 0.0f;
        }
        for (size_t i = 0; i < r->req.n_logit_bias; i++)
                if (r->req.logit_bias[i].token_id >= r->model->vocab_size) {
                        fail_request(r, 400, "BadRequestError",
                                     "token_id(s) [%u] in logit_bias contain out-of-vocab token ids. Vocabulary size: %u",
                                     r->req.logit_bias[i].token_id, r->model->vocab_size);
                        return false;
                }
        return true;
}

static void prep_done(uv_work_t *w, int status) {   /* loop */
        rq *r = w->data;
        size_t n_prompts = r->kind == OAI_CHAT ? 1 : r->req.n_prompts;

        r->jobs--;
        if (r->gone) {
                rq_maybe_free(r);
                return;
        }
        if (status != 0 || r->prep_st != TSR_OK) {
                if (status != 0)
                        fail_request(r, 500, "InternalServerError", "request preparation was cancelled");
                else
                        fail_with(r, &r->err);
                return;
        }
        if (!check_lengths(r) || !resolve_sampling(r))
                return;
        r->n_choices = n_prompts * (size_t)r->req.n;
        r->choices = calloc(r->n_choices, sizeof(choice));
        if (!r->choices) {
                fail_request(r, 500, "InternalServerError", "out of memory");
                return;
        }
        for (size_t i = 0; i < r->n_choices; i++) {
                choice *ch = &r->choices[i];
                ch->r = r;
                ch->index = (int)i;
                ch->prompt = (int)(i / (size_t)r->req.n);
                tsr_buf_init(&ch->text, MAX_OUTPUT_BYTES);
                ch->stop_reason = json_null();
                /* primed by prep_work (prime_detoks): choice i is detoks[i] */
                ch->detok = r->detoks[i];
                r->detoks[i] = NULL;
        }
        if (r->req.stream) {
                if (http_conn_stream_start(r->c, 200, "text/event-stream; charset=utf-8", NULL) != TSR_OK) {
                        r->gone = true;
                        rq_maybe_free(r);
                        return;
                }
                r->streaming = true;
        }
        for (size_t i = 0; i < r->n_choices; i++) {
                choice *ch = &r->choices[i];
                r->n_open++;
                if (submit_choice(ch, NULL) != TSR_OK) {
                        r->n_open--;
                        fail_request(r, 503, "ServiceUnavailableError",
                                     "no live worker can serve model %s right now", r->model->name);
                        return;
                }
                /* echo in a stream: the prompt text goes first (vLLM). */
                if (r->streaming && r->req.echo && r->kind == OAI_COMPLETIONS) {
                        tsr_buf_append_str(&ch->text, r->prompt_texts[ch->prompt]);
                        ch->echo_chars = utf8_count((char *)ch->text.data, ch->text.len);
                }
        }
        log_req(TSR_LOG_DEBUG, r->id, "submitted %zu choice(s), max_tokens=%lld", r->n_choices, (long long)r->max_tokens);
}

/* ------------------------------------------------------------------ parse (thread pool) */

static void parse_work(uv_work_t *w) {   /* thread pool */
        rq *r = w->data;
        oai_limits lim;
        oai_limits_default(&lim);
        lim.max_logprobs = r->L->ctx->cfg->max_logprobs;
        r->prep_st = oai_parse(r->kind, r->body, r->body_len, &lim, r->arena, &r->req, &r->err);
        r->parsed = r->prep_st == TSR_OK;
}

static void parse_done(uv_work_t *w, int status) {   /* loop */
        rq *r = w->data;
        request_layer *L = r->L;
        const tsr_config *cfg = L->ctx->cfg;
        model_entry *m;

        r->jobs--;
        if (r->gone) {
                rq_maybe_free(r);
                return;
        }
        if (status != 0 || r->prep_st != TSR_OK) {
                if (status != 0)
                        fail_request(r, 500, "InternalServerError", "request parsing was cancelled");
                else
                        fail_with(r, &r->err);
                return;
        }
        m = model_registry_find(L->ctx->models, r->req.model);
        if (!m) {
                if (r->req.model && *r->req.model)
                        fail_request(r, 404, "NotFoundError", "The model `%s` does not exist.", r->req.model);
                else
                        fail_request(r, 503, "ServiceUnavailableError", "no model is being served yet");
                return;
        }
        if (!m->ready) {
                if (m->load_error)
                        fail_request(r, 500, "InternalServerError", "model %s cannot be served: %s", m->name, m->load_error);
                else
                        fail_request(r, 503, "ServiceUnavailableError", "model %s is still loading", m->name);
                return;
        }
        r->model = model_ref(m);
        /* vLLM's id: X-Request-Id, else the body's request_id, else random hex. */
        if (!r->id_from_header && r->req.request_id && *r->req.request_id)
                snprintf(r->id, sizeof(r->id), "%s%.200s", r->kind == OAI_CHAT ? "chatcmpl-" : "cmpl-",
                         r->req.request_id);
        if (r->req.prompt_logprobs_all && cfg->max_logprobs >= 0 && (int64_t)m->vocab_size > cfg->max_logprobs) {
                fail_request(r, 400, "BadRequestError",
                             "Requested prompt logprobs of %u, which is greater than max allowed: %d", m->vocab_size,
                             cfg->max_logprobs);
                return;
        }
        if (r->kind == OAI_CHAT) {
                if (!m->tpl) {
                        fail_request(r, 400, "BadRequestError",
                                     "As of transformers v4.44, default chat template is no longer allowed, so you must "
                                     "provide a chat template if the tokenizer does not define one.");
                        return;
                }
                if (r->req.chat_template) {
                        fail_request(r, 400, "BadRequestError",
                                     "Chat template is passed with request, but --trust-request-chat-template is not set. "
                                     "Refused request with untrusted chat template.");
                        return;
                }
                if (strcmp(r->req.tool_choice, "auto") == 0 && r->req.tools &&
                    !(cfg->enable_auto_tool_choice && cfg->tool_call_parser)) {
                        fail_request(r, 400, "BadRequestError",
                                     "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
                        return;
                }
                if (strcmp(r->req.tool_choice, "required") == 0 || strcmp(r->req.tool_choice, "function") == 0) {
                        fail_request(r, 400, "BadRequestError",
                                     "tool_choice \"%s\" needs structured outputs, which this Tessera build does not support yet",
                                     r->req.tool_choice);
                        return;
                }
        }
        if (r->req.priority != 0 && cfg->scheduling_policy && strcmp(cfg->scheduling_policy, "priority") != 0) {
                fail_request(r, 400, "BadRequestError", "Priority scheduling is not enabled.");
                return;
        }
        choose_hash_spec(r);
        r->work.data = r;
        r->jobs++;
        if (uv_queue_work(L->ctx->loop, &r->work, prep_work, prep_done) != 0) {
                r->jobs--;
                fail_request(r, 500, "InternalServerError", "cannot queue request preparation");
        }
}

/* ------------------------------------------------------------------ entry points */

static void on_client_gone(void *ud) {
        rq *r = ud;
        r->c = NULL;
        r->gone = true;
        if (r->n_open)
                log_req(TSR_LOG_INFO, r->id, "client disconnected: aborting %zu choice(s)", r->n_open);
        abort_all(r, "client_disconnected");
        rq_maybe_free(r);
}

static rq *rq_new(request_layer *L, http_conn *c, http_request *req, const char *prefix) {
        rq *r = calloc(1, sizeof(*r));
        const char *xid = http_request_header(req, "x-request-id");
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
        http_conn_on_close(c, on_client_gone, r);
        return r;
}

void request_handle_generate(request_layer *L, http_conn *c, http_request *req, oai_kind kind) {
        rq *r;
        if (!content_type_json(req)) {
                http_conn_respond_error(c, 400, "Bad Request", "Unsupported Media Type: Only 'application/json' is allowed");
                return;
        }
        r = rq_new(L, c, req, kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
        if (!r) {
                http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
                return;
        }
        r->kind = kind;
        r->work.data = r;
        r->jobs++;
        if (uv_queue_work(L->ctx->loop, &r->work, parse_work, parse_done) != 0) {
                r->jobs--;
                fail_request(r, 500, "InternalServerError", "cannot queue request parsing");
        }
}

size_t request_layer_active(const request_layer *L) { return L->n_active; }

/* Loop thread.  A request past its deadline that is at a worker (prompt prepared and
 * submitted) is aborted there and answered 504, or its stream ends with that error
 * event; one still being parsed or prepared waits for that bounded step to end. */
static void on_deadline_sweep(uv_timer_t *t) {
        request_layer *L = t->data;
        uint64_t now = tsr_now_ns();
        rq *next;
        for (rq *r = L->active; r; r = next) {
                next = r->next_active;  /* r may be freed below */
                if (!r->deadline_ns || now < r->deadline_ns || r->answered || r->gone || r->jobs || !r->n_open)
                        continue;
                abort_all(r, "deadline");
                fail_request(r, 504, "GatewayTimeoutError",
                             "The request did not finish within %d s (--request-timeout-secs).",
                             L->ctx->cfg->request_timeout_secs);
        }
}

void request_layer_close(request_layer *L) {
        if (L && L->sweep_started && !uv_is_closing((uv_handle_t *)&L->deadline_sweep))
                uv_close((uv_handle_t *)&L->deadline_sweep, NULL);
}

tsr_status request_layer_new(router_ctx *ctx, request_layer **ret) {
        request_layer *L = calloc(1, sizeof(*L));
        worker_events ev = {
                .on_output = on_output,
                .on_error = on_error,
                .on_worker_down = on_worker_down,
                .on_model_info = on_model_info,
                .on_status = on_status,
                .in_flight = in_flight,
                .on_worker_removed = on_worker_removed,
        };
        if (!L)
                return TSR_E_NOMEM;
        L->table = calloc(TABLE_SIZE, sizeof(choice *));
        if (!L->table) {
                free(L);
                return TSR_E_NOMEM;
        }
        L->ctx = ctx;
        ev.ud = L;
        worker_pool_set_events(ctx->workers, &ev);
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

void request_layer_free(request_layer **Lp) {
        request_layer *L;
        if (!Lp || !*Lp)
                return;
        L = *Lp;
        /* Requests still here had their connections closed by the HTTP server's
         * shutdown (on_close ran) or have jobs that finished; free the rest. */
        while (L->active) {
                rq *r = L->active;
                abort_all(r, "router_shutdown");
                r->jobs = 0;
                r->gone = true;
                rq_free(r);
        }
        free(L->table);
        free(L->pending);
        free(L);
        *Lp = NULL;
}

/* ------------------------------------------------------------------ /tokenize, /detokenize */

typedef struct tok_job {
        uv_work_t work;
        request_layer *L;
        http_conn *c;                 /* NULL once the client is gone */
        bool detokenize;
        bool running;
        char *body;
        size_t body_len;
        model_entry *model;
        /* results */
        int status;
        char *response;               /* JSON body */
} tok_job;

static void tok_job_gone(void *ud) {
        tok_job *j = ud;
        j->c = NULL;
        if (!j->running) {
                model_unref(j->model);
                free(j->body);
                free(j->response);
                free(j);
        }
}

static char *error_body(int status, const char *type, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static char *error_body(int status, const char *type, const char *fmt, ...) {
        oai_error e = {.status = status, .type = type};
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.message, sizeof(e.message), fmt, ap);
        va_end(ap);
        return oai_error_json(&e);
}

/* {"prompt": s, "add_special_tokens": true, "return_token_strs": false} or the chat form
 * {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, ...}
 * -> {"count", "max_model_len", "tokens", "token_strs"} */
static void tokenize_work(tok_job *j, json_t *root) {
        model_entry *m = j->model;
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
                oai_limits lim;
                tsr_arena *a = tsr_arena_new(0, 0);
                char *dumped = json_dumps(root, JSON_COMPACT);
                memset(&tmp, 0, sizeof(tmp));
                oai_limits_default(&lim);
                lim.max_logprobs = -1;
                tmp.model = m;
                tmp.kind = OAI_CHAT;
                if (!dumped || !a || oai_parse(OAI_CHAT, dumped, strlen(dumped), &lim, a, &tmp.req, &tmp.err) != TSR_OK) {
                        j->status = tmp.err.status ? tmp.err.status : 500;
                        j->response = oai_error_json(&tmp.err);
                        free(dumped);
                        tsr_arena_free(&a);
                        return;
                }
                free(dumped);
                if (!m->tpl) {
                        j->status = 400;
                        j->response = error_body(400, "BadRequestError", "the model has no chat template");
                } else if (render_chat(&tmp, &text, &len) != TSR_OK) {
                        j->status = 400;
                        j->response = oai_error_json(&tmp.err);
                }
                oai_request_done(&tmp.req);
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
                        http_conn_respond(j->c, j->status, "application/json", j->response, strlen(j->response), NULL);
                else
                        http_conn_respond_error(j->c, 500, "InternalServerError", "out of memory");
        }
        model_unref(j->model);
        free(j->body);
        free(j->response);
        free(j);
}

static void tok_start(request_layer *L, http_conn *c, http_request *req, bool detokenize) {
        tok_job *j;
        json_t *root;
        const char *model_name = NULL;
        model_entry *m;

        if (!content_type_json(req)) {
                http_conn_respond_error(c, 400, "Bad Request", "Unsupported Media Type: Only 'application/json' is allowed");
                return;
        }
        /* Peek at "model" only; the body is parsed again on the thread pool. */
        root = json_loadb((const char *)req->body, req->body_len, JSON_DISABLE_EOF_CHECK, NULL);
        model_name = json_string_value(json_object_get(root, "model"));
        m = model_registry_find(L->ctx->models, model_name);
        if (!m || !m->ready) {
                char *body = m ? error_body(503, "ServiceUnavailableError", "model %s is still loading", m->name)
                               : model_name && *model_name
                                         ? error_body(404, "NotFoundError", "The model `%s` does not exist.", model_name)
                                         : error_body(503, "ServiceUnavailableError", "no model is being served yet");
                json_decref(root);
                if (body)
                        http_conn_respond(c, m || !(model_name && *model_name) ? 503 : 404, "application/json", body,
                                          strlen(body), NULL);
                free(body);
                return;
        }
        json_decref(root);
        j = calloc(1, sizeof(*j));
        if (!j || !(j->body = malloc(req->body_len + 1))) {
                free(j);
                http_conn_respond_error(c, 500, "InternalServerError", "out of memory");
                return;
        }
        memcpy(j->body, req->body, req->body_len);
        j->body_len = req->body_len;
        j->L = L;
        j->c = c;
        j->detokenize = detokenize;
        j->model = model_ref(m);
        j->work.data = j;
        j->running = true;
        http_conn_on_close(c, tok_job_gone, j);
        if (uv_queue_work(L->ctx->loop, &j->work, tok_work, tok_done) != 0) {
                j->running = false;
                http_conn_respond_error(c, 500, "InternalServerError", "cannot queue the job");
                model_unref(j->model);
                free(j->body);
                free(j);
        }
}

void request_handle_tokenize(request_layer *L, http_conn *c, http_request *req) { tok_start(L, c, req, false); }
void request_handle_detokenize(request_layer *L, http_conn *c, http_request *req) { tok_start(L, c, req, true); }
