/* request_int.h - what the files of router/request/ share: the request (rq), its
 * choices and the request layer.  Private to router/request/; api.c and the rest of
 * the router use router/request.h.  Loop thread only, except where a field says it
 * is written by a thread-pool job (prepare.c), which runs while the loop leaves the
 * request alone (r->jobs > 0). */
#ifndef TSR_ROUTER_REQUEST_INT_H
#define TSR_ROUTER_REQUEST_INT_H

#include "router/request.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/block_hash.h"
#include "common/buf.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/wire.h"
#include "router/models.h"
#include "router/placement.h"
#include "router/response.h"
#include "router/router.h"
#include "router/stop.h"
#include "router/tools/tools.h"

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
        struct tsr_chat_out *parse;   /* chat with --reasoning-parser / a tool parser: the stream's parser state */
        uint64_t first_token_ns;      /* router clock: TTFT, ITL */
        uint64_t last_token_ns;
        uint64_t queued_ns, prefill_ns, decode_ns;   /* engine's, from the final Output */
        /* logprobs (the request asked for them) */
        tsr_resp_token_lp *lp;            /* one per generated token, in order */
        size_t n_lp, cap_lp;
        size_t lp_sent;               /* streaming: entries of `lp` already sent */
        tsr_resp_token_lp *plp;           /* prompt_logprobs: one per prompt position, [0] without */
        bool echo_lp_sent;            /* streaming echo: the prompt's entries went out */
        size_t sent_chars;            /* streaming: code points of `text` sent (text_offset) */
        size_t echo_chars;            /* ... of which the echoed prompt */
} choice;

struct rq {
        tsr_request_layer *L;
        tsr_http_conn *c;                 /* NULL once the client is gone */
        tsr_oai_kind kind;
        tsr_oai_request req;
        bool parsed;
        tsr_arena *arena;
        char *body;                   /* a copy: the connection's may die with the client */
        size_t body_len;
        tsr_models_entry *model;           /* referenced */
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
        /* A structured output behind a reasoning parser: the vocabulary's </think> and
         * <think> ids (-1: none / not in the vocabulary); dispatch.c decides per prompt
         * whether the output starts inside the reasoning. */
        int64_t think_end_id, think_start_id;
        tsr_status prep_st;
        tsr_oai_error err;
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
         * (tsr_request_usage_of).  Borrowed from `choices`; NULL until set. */
        const choice *first_out;
        const choice *last_done;
        uv_work_t work;
        rq *next_active, *prev_active;
};

struct tsr_request_layer {
        tsr_router_ctx *ctx;
        choice **table;
        uint64_t next_wire_id;
        rq *active;                   /* every live request, for shutdown */
        size_t n_active;
        unsigned rotate;              /* placement tie-break */
        /* What this router sent each worker that the worker's last Status does not
         * count yet: the "pending" terms of placement.h (tsr_placement_sent_list). */
        struct pending_dispatch {
                const tsr_worker *w;
                tsr_placement_sent_list sent;
        } *pending;
        size_t n_pending;
        tsr_placement_recent recent;   /* kv policy: prompts placed in the last 2 s (placement.h) */
        /* Every 200 ms, fail the submitted requests past their deadline (one timer for
         * all requests: a per-request uv_timer would need an async close per request). */
        uv_timer_t deadline_sweep;
        bool sweep_started;
};
typedef enum routing_policy { ROUTE_KV, ROUTE_LEAST_LOAD, ROUTE_ROUND_ROBIN } routing_policy;

/* Shared between the files of router/request/ (named tsr_request_*: they leave their
 * file); all loop thread unless marked. */

/* core.c: lifetime, in-flight table, errors, completion */
void tsr_request_maybe_free(rq *r);
tsr_status tsr_request_table_put(tsr_request_layer *L, choice *ch);
void tsr_request_table_del(tsr_request_layer *L, choice *ch);
choice *tsr_request_table_get(tsr_request_layer *L, const char *wire);
void tsr_request_close_choice(choice *ch, bool abort_worker, const char *why);
void tsr_request_abort_all(rq *r, const char *why);
void tsr_request_fail_with(rq *r, const tsr_oai_error *err);
void tsr_request_fail(rq *r, int status, const char *type, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
bool tsr_request_content_type_json(const tsr_http_request *req);
void tsr_request_finish(rq *r);
void tsr_request_finish_choice(choice *ch, const char *reason, json_t *stop_reason, bool abort_worker);

/* stream.c: logprobs and SSE */
bool tsr_request_echo_only(const rq *r);
tsr_resp_tokens tsr_request_tokens_of(const rq *r);
tsr_status tsr_request_take_prompt_lp(choice *ch, const Tessera__V1__RequestOutput *out);
tsr_status tsr_request_push_lp(choice *ch, uint32_t token, const Tessera__V1__TokenLogprobs *w);
tsr_resp_token_lp *tsr_request_completion_entries(const rq *r, const choice *ch, bool with_prompt, size_t from, size_t *n);
const tsr_resp_head *tsr_request_head_of(rq *r, tsr_resp_head *h);
bool tsr_request_want_usage_chunk(const rq *r);
void tsr_request_usage_of(const rq *r, const choice *only, tsr_resp_usage *u);
void tsr_request_stream_write_obj(rq *r, json_t *obj);
void tsr_request_stream_choice(rq *r, choice *ch);
/* Chat output parsers (router/tools): whether this request's output goes through any,
 * and the non-stream message of a choice rewritten by them. */
bool tsr_request_parses_output(const rq *r);
void tsr_request_parse_message(rq *r, choice *ch, json_t *chat_choice);

/* dispatch.c: placement, submission, worker events */
routing_policy tsr_request_policy_of(const tsr_config *cfg);
tsr_status tsr_request_submit_choice(choice *ch, tsr_worker *avoid);
worker_events tsr_request_worker_events(void);

/* prepare.c: tsr_request_parse_work runs on the thread pool, tsr_request_parse_done
 * on the loop; tsr_request_render_chat runs on the thread pool (prep_work, and
 * tokenize.c's job) */
tsr_status tsr_request_render_chat(rq *r, char **prompt, size_t *len);
void tsr_request_parse_work(uv_work_t *w);
void tsr_request_parse_done(uv_work_t *w, int status);

#endif
