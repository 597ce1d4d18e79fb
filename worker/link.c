/* link.c - the worker io thread (see link.h). */
#include "worker/link.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>   /* readv: <unistd.h> would clash with `link` below */
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/wire.h"
#include "common/zmq_curve.h"
#include "worker/engine/engine.h"

/* Router liveness (docs/protocol.md, "Liveness and failure").  A router that sends
 * Heartbeats is reaped, every request of its routing id aborted, once it has been
 * silent for REAP_MISSED_HEARTBEATS of its own intervals (at least REAP_MIN_NS): a
 * kill -9'd router otherwise leaves its requests generating here until max_tokens,
 * holding KV blocks (ghosts).  Why not ZeroMQ's own signals: socket-monitor events
 * name a connection, not a routing id; ZMQ_ROUTER_NOTIFY is draft API; and ZMTP
 * heartbeats are answered by libzmq's io thread, so they prove a process, not a
 * router loop.  Bookkeeping is the io thread's alone; the engine only ever sees an
 * ordinary Abort{all_from_router}.  A busy router is not reaped: any frame from it
 * counts as life, its heartbeats come from a timer of its loop, and the
 * deadline is 12 intervals (3 s at 250 ms); a stall of this thread itself (SIGSTOP,
 * an overloaded host) pushes every deadline back instead of reaping. */
#define REAP_MISSED_HEARTBEATS 12u
#define REAP_MIN_NS (2000ull * 1000000ull)
#define IO_STALL_NS (1000ull * 1000000ull)
#define MAX_TRACKED_ROUTERS 256
/* A Submit makes the next Status come at most this long after the last one instead of
 * at the next tick, so that every router learns of every router's dispatches within
 * a few milliseconds (placement.h, "herding"); it also caps Status at 200 a second. */
#define STATUS_AFTER_SUBMIT_NS (5ull * 1000000ull)
/* Reaped routers remembered, so that one which was only stalled is told (Error
 * ROUTER_REAPED) when it speaks again, instead of waiting forever for Outputs of
 * requests that no longer exist.  A ring: a killed router simply ages out. */
#define MAX_REAPED_REMEMBERED 32

typedef struct router_peer {
        uint8_t id[TSR_ENGINE_ROUTER_ID_MAX];
        size_t id_len;
        uint64_t last_heard_ns;
        uint64_t deadline_ns;   /* silence that reaps it */
        uint64_t last_submit_id;  /* highest numeric Submit request_id read from it (Status submit_acks) */
} router_peer;

typedef struct link {
        const tsr_link_opts *o;
        void *zctx;
        void *router;          /* ROUTER: requests and replies */
        void *pub;             /* PUB: Status */
        tsr_curve_zap *zap;    /* CurveZMQ authentication (--zmq-curve-*), NULL when off */
        tsr_queue *inbox;
        tsr_queue *outbox;
        tsr_engine_stats stats;    /* latest snapshot from the engine */
        uint64_t status_seq;
        uint64_t last_status_ns;
        /* Submits handed to the engine, and their prompt tokens: what the engine's
         * stats have not taken yet is counted as waiting in Status (in_transit). */
        uint64_t submits_pushed, submit_tokens_pushed;
        bool submits_unpublished;  /* a Submit came since the last Status: send one soon */
        bool draining;
        bool shutting_down;    /* stop signal seen: waiting for the engine's TSR_ENGINE_OUT_STOPPED */
        bool stop;
        uint64_t n_bad_frames;
        uint64_t n_send_drops;
        tsr_engine_stats logged;   /* counters at the last stats line */
        uint64_t logged_ns;
        router_peer peers[MAX_TRACKED_ROUTERS];  /* routers that sent a Heartbeat */
        size_t n_peers;
        uint64_t last_iter_ns;  /* end of the previous io loop iteration */
        uint64_t n_reaped;
        router_peer reaped[MAX_REAPED_REMEMBERED];  /* ring; id_len 0 = empty */
        size_t reaped_next;
} link;

/* Log the first few of a repeated problem, then one in a thousand (hot-path rate limit). */
static bool should_log(uint64_t count) { return count <= 10 || count % 1000 == 0; }

static void printable_id(const uint8_t *id, size_t len, char *out, size_t outlen) {
        size_t j = 0;
        for (size_t i = 0; i < len && j + 3 < outlen; i++) {
                if (id[i] >= 0x21 && id[i] < 0x7f) {
                        out[j++] = (char)id[i];
                } else {
                        snprintf(out + j, outlen - j, "%02x", id[i]);
                        j += 2;
                }
        }
        out[j] = '\0';
}

static router_peer *find_peer(link *l, const uint8_t *rid, size_t rid_len) {
        for (size_t i = 0; i < l->n_peers; i++)
                if (l->peers[i].id_len == rid_len && memcmp(l->peers[i].id, rid, rid_len) == 0)
                        return &l->peers[i];
        return NULL;
}

static void send_error(link *l, const uint8_t *rid, size_t rid_len, const char *request_id,
                       Tessera__V1__ErrorCode code, bool retryable, const char *message);

/* Any frame from a tracked router, well-formed or not, is a sign of life.  A router
 * we reaped that speaks again learns it once (then it is a new peer like any other,
 * from its next Heartbeat). */
static void peer_heard(link *l, const uint8_t *rid, size_t rid_len, const char *who) {
        router_peer *pr = find_peer(l, rid, rid_len);
        if (pr) {
                pr->last_heard_ns = tsr_now_ns();
                return;
        }
        for (size_t i = 0; i < MAX_REAPED_REMEMBERED; i++) {
                router_peer *r = &l->reaped[i];
                char msg[160];
                if (!r->id_len || r->id_len != rid_len || memcmp(r->id, rid, rid_len) != 0)
                        continue;
                log_warn("router %s speaks again after being reaped: telling it its requests were aborted", who);
                snprintf(msg, sizeof(msg),
                         "this worker aborted every request of router %s: no heartbeat for %.1f s", who,
                         (double)r->deadline_ns / 1e9);
                send_error(l, rid, rid_len, NULL, TESSERA__V1__ERROR_CODE__ERROR_ROUTER_REAPED, false, msg);
                r->id_len = 0;
                return;
        }
}

static void remember_reaped(link *l, const router_peer *pr, uint64_t silent_ns) {
        router_peer *r = &l->reaped[l->reaped_next];
        l->reaped_next = (l->reaped_next + 1) % MAX_REAPED_REMEMBERED;
        *r = *pr;
        r->deadline_ns = silent_ns;   /* here: how long it had been silent */
}

static void on_heartbeat(link *l, const uint8_t *rid, size_t rid_len, const Tessera__V1__Heartbeat *hb,
                         const char *who) {
        router_peer *pr = find_peer(l, rid, rid_len);
        uint64_t deadline = (uint64_t)REAP_MISSED_HEARTBEATS * hb->interval_ms * 1000000ull;

        if (!pr) {
                if (l->n_peers == MAX_TRACKED_ROUTERS) {
                        if (should_log(++l->n_bad_frames))
                                log_warn("heartbeat from router %s: already tracking %d routers, not reaping this one",
                                         who, MAX_TRACKED_ROUTERS);
                        return;
                }
                pr = &l->peers[l->n_peers++];
                memcpy(pr->id, rid, rid_len);
                pr->id_len = rid_len;
                log_info("router %s sends heartbeats every %u ms: its requests are aborted after %.1f s of silence",
                         who, hb->interval_ms, (double)(deadline > REAP_MIN_NS ? deadline : REAP_MIN_NS) / 1e9);
        }
        pr->deadline_ns = deadline > REAP_MIN_NS ? deadline : REAP_MIN_NS;
        pr->last_heard_ns = tsr_now_ns();
}

static tsr_engine_in *engine_in_new(tsr_engine_in_kind kind, const uint8_t *rid, size_t rid_len);
static tsr_status to_engine(link *l, tsr_engine_in *in);

/* Abort every request of one router, through the engine's ordinary Abort path.  False
 * when the engine inbox refused it (full): the caller tries again later. */
static bool abort_router(link *l, const uint8_t *rid, size_t rid_len, const char *reason) {
        tsr_engine_in *in = engine_in_new(TSR_ENGINE_IN_ABORT, rid, rid_len);
        if (!in)
                return false;
        in->abort.all_from_router = true;
        snprintf(in->abort.reason, sizeof(in->abort.reason), "%s", reason);
        return to_engine(l, in) == TSR_OK;
}

static bool router_input_pending(link *l) {
        int events = 0;
        size_t len = sizeof(events);
        return zmq_getsockopt(l->router, ZMQ_EVENTS, &events, &len) == 0 && (events & ZMQ_POLLIN);
}

/* Io thread, once per loop iteration, after the socket was drained. */
static void reap_silent_routers(link *l, uint64_t now) {
        if (l->last_iter_ns && now - l->last_iter_ns > IO_STALL_NS && l->n_peers) {
                /* We were not running (stopped, starved): the silence is ours, and the
                 * routers' heartbeats may still sit in libzmq's queues.  Start every
                 * deadline again. */
                log_warn("io thread stalled for %.1f s: restarting the heartbeat deadlines of %zu router(s)",
                         (double)(now - l->last_iter_ns) / 1e9, l->n_peers);
                for (size_t i = 0; i < l->n_peers; i++)
                        l->peers[i].last_heard_ns = now;
        }
        l->last_iter_ns = now;
        /* Unread input may hold a heartbeat: read it first (next iteration). */
        if (!l->n_peers || router_input_pending(l))
                return;
        for (size_t i = 0; i < l->n_peers;) {
                router_peer *pr = &l->peers[i];
                char who[64];
                if (now - pr->last_heard_ns <= pr->deadline_ns) {
                        i++;
                        continue;
                }
                printable_id(pr->id, pr->id_len, who, sizeof(who));
                if (!abort_router(l, pr->id, pr->id_len, "router vanished (no heartbeat)")) {
                        i++;   /* engine inbox full: keep it, try on the next iteration */
                        continue;
                }
                l->n_reaped++;
                log_warn("router %s silent for %.1f s (deadline %.1f s): aborting all its requests (reaped=%llu)", who,
                         (double)(now - pr->last_heard_ns) / 1e9, (double)pr->deadline_ns / 1e9,
                         (unsigned long long)l->n_reaped);
                remember_reaped(l, pr, now - pr->last_heard_ns);
                *pr = l->peers[--l->n_peers];   /* order does not matter */
        }
}

/* Send one envelope to one router.  Never blocks: a full pipe or a vanished router
 * is counted and logged, never waited on. */
static void send_to(link *l, const uint8_t *rid, size_t rid_len, const uint8_t *p, size_t n) {
        if (zmq_send(l->router, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(l->router, p, n, ZMQ_DONTWAIT) < 0) {
                int e = zmq_errno();
                char who[64];
                printable_id(rid, rid_len, who, sizeof(who));
                l->n_send_drops++;
                if (should_log(l->n_send_drops))
                        log_warn("send to router %s dropped: %s (drops=%llu)", who, zmq_strerror(e),
                                 (unsigned long long)l->n_send_drops);
        }
}

static void send_env(link *l, const uint8_t *rid, size_t rid_len, tsr_envelope *env) {
        uint8_t *p;
        size_t n;
        if (tsr_wire_pack(env, &p, &n) != TSR_OK) {
                log_error("could not pack a %s message", tsr_wire_msg_name(env));
                return;
        }
        send_to(l, rid, rid_len, p, n);
        free(p);
}

static void send_error(link *l, const uint8_t *rid, size_t rid_len, const char *request_id,
                       Tessera__V1__ErrorCode code, bool retryable, const char *message) {
        tsr_envelope env;
        Tessera__V1__Error e;
        tessera__v1__envelope__init(&env);
        tessera__v1__error__init(&e);
        e.request_id = (char *)(request_id ? request_id : "");
        e.code = code;
        e.retryable = retryable;
        e.message = (char *)message;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_ERROR;
        env.error = &e;
        send_env(l, rid, rid_len, &env);
}

/* The KV memory by bytes from the engine's last stats: the attention blocks and the
 * recurrent-state slots, all of them and what running requests hold (free and evictable
 * cached blocks, free and kept states not held).  Status' kv_bytes_*; the usage. */
static void kv_bytes(const link *l, uint64_t *total, uint64_t *used) {
        const tsr_engine_stats *s = &l->stats;
        uint64_t blocks_used = s->kv_blocks_total > s->kv_blocks_free ? s->kv_blocks_total - s->kv_blocks_free : 0;
        uint64_t slots_used = s->state_slots_total > s->state_slots_free
                                      ? (uint64_t)(s->state_slots_total - s->state_slots_free) : 0;
        *total = s->kv_blocks_total * l->o->kv_block_bytes + (uint64_t)s->state_slots_total * l->o->state_slot_bytes;
        *used = blocks_used * l->o->kv_block_bytes + slots_used * l->o->state_slot_bytes;
}

/* Status, with the prefix-cache events of this engine snapshot when there are some
 * (`events` may be NULL: the periodic heartbeat). */
static void publish_status(link *l, const tsr_kv_events *events) {
        tsr_envelope env;
        Tessera__V1__Status s;
        Tessera__V1__BlockHashEvent *evs = NULL, **evp = NULL;
        Tessera__V1__SubmitAck acks[MAX_TRACKED_ROUTERS], *ackp[MAX_TRACKED_ROUTERS];
        uint64_t in_transit = l->submits_pushed - l->stats.submits_taken_total;
        uint64_t in_transit_tokens = l->submit_tokens_pushed - l->stats.submit_prompt_tokens_taken_total;
        uint8_t *p;
        size_t n;

        tessera__v1__envelope__init(&env);
        tessera__v1__status__init(&s);
        s.worker_id = (char *)l->o->worker_id;
        s.boot_epoch = l->o->boot_epoch;
        s.seq = ++l->status_seq;
        s.ts_unix_ns = tsr_wall_ns();
        const tsr_engine_model *m = l->o->model;
        s.state = l->draining                                 ? TESSERA__V1__STATUS__STATE__DRAINING
                  : m && m->available && !m->available(m->ud) ? TESSERA__V1__STATUS__STATE__UNHEALTHY
                                                              : TESSERA__V1__STATUS__STATE__READY;
        s.kv_blocks_total = l->stats.kv_blocks_total;
        s.kv_blocks_free = l->stats.kv_blocks_free;
        s.kv_blocks_active = l->stats.kv_blocks_active;
        s.num_running = l->stats.num_running;
        /* The engine's snapshot counts what it had taken when it was made; the rest of
         * what we pushed is still in its inbox, waiting all the same. */
        s.num_waiting = l->stats.num_waiting + (uint32_t)in_transit;
        s.max_num_seqs = l->stats.max_num_seqs;
        s.waiting_prompt_tokens = l->stats.waiting_prompt_tokens + in_transit_tokens;
        s.endpoint = (char *)l->o->listen;
        s.engine_ready = l->stats.ready;
        s.num_preemptions_total = l->stats.num_preemptions_total;
        s.prefix_cache_queries_total = l->stats.prefix_cache_queries_total;
        s.prefix_cache_hits_total = l->stats.prefix_cache_hits_total;
        s.prompt_tokens_total = l->stats.prompt_tokens_total;
        s.generation_tokens_total = l->stats.generation_tokens_total;
        s.state_slots_total = l->stats.state_slots_total;
        s.state_slots_free = l->stats.state_slots_free;
        kv_bytes(l, &s.kv_bytes_total, &s.kv_bytes_used);
        s.prefill_tokens_per_s = l->stats.prefill_tokens_per_s;
        s.decode_step_ms = l->stats.decode_step_ms;
        for (size_t i = 0; i < l->n_peers; i++) {
                if (!l->peers[i].last_submit_id)
                        continue;
                tessera__v1__submit_ack__init(&acks[s.n_submit_acks]);
                acks[s.n_submit_acks].router_id.data = l->peers[i].id;
                acks[s.n_submit_acks].router_id.len = l->peers[i].id_len;
                acks[s.n_submit_acks].last_request_id = l->peers[i].last_submit_id;
                ackp[s.n_submit_acks] = &acks[s.n_submit_acks];
                s.n_submit_acks++;
        }
        s.submit_acks = ackp;
        l->last_status_ns = tsr_now_ns();
        l->submits_unpublished = false;
        if (events && events->n) {
                evs = calloc(events->n, sizeof(*evs));
                evp = calloc(events->n, sizeof(*evp));
                if (evs && evp) {
                        for (size_t i = 0; i < events->n; i++) {
                                const tsr_kv_event *ke = &events->ev[i];
                                tessera__v1__block_hash_event__init(&evs[i]);
                                evs[i].kind = ke->kind == TSR_KV_EVENT_STORED    ? TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED
                                              : ke->kind == TSR_KV_EVENT_REMOVED ? TESSERA__V1__BLOCK_HASH_EVENT__KIND__REMOVED
                                                                                 : TESSERA__V1__BLOCK_HASH_EVENT__KIND__ALL_CLEARED;
                                evs[i].block_hashes = (uint64_t *)ke->hashes;
                                evs[i].n_block_hashes = ke->n_hashes;
                                evs[i].parent_block_hash = ke->has_parent ? ke->parent_hash : 0;
                                evp[i] = &evs[i];
                        }
                        s.events = evp;
                        s.n_events = events->n;
                }
        }
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_STATUS;
        env.status = &s;
                tsr_status packed = tsr_wire_pack(&env, &p, &n);
        free(evs);
        free(evp);
        if (packed != TSR_OK)
                return;
        /* PUB never blocks: past its HWM a message is dropped, which is what a
         * periodic snapshot wants. */
        if (zmq_send(l->pub, p, n, ZMQ_DONTWAIT) < 0 && should_log(++l->n_send_drops))
                log_warn("status publish failed: %s", zmq_strerror(zmq_errno()));
        free(p);
}

_Static_assert(TSR_ENGINE_REQUEST_ID_MAX == TSR_WIRE_MAX_ID_LEN, "engine and wire request ids differ");
_Static_assert(TSR_ENGINE_ROUTER_ID_MAX >= 255, "a ZeroMQ routing id is up to 255 bytes");

static tsr_engine_in *engine_in_new(tsr_engine_in_kind kind, const uint8_t *rid, size_t rid_len) {
        tsr_engine_in *in = calloc(1, sizeof(*in));
        if (!in)
                return NULL;
        in->kind = kind;
        memcpy(in->router_id, rid, rid_len);
        in->router_id_len = rid_len;
        return in;
}

static tsr_status copy_u32(const uint32_t *src, size_t n, uint32_t **dst) {
        *dst = NULL;
        if (!n)
                return TSR_OK;
        *dst = malloc(n * sizeof(uint32_t));
        if (!*dst)
                return TSR_E_NOMEM;
        memcpy(*dst, src, n * sizeof(uint32_t));
        return TSR_OK;
}

/* The engine's view of a Submit (validated by tsr_wire_unpack): the wire's "0 = unset"
 * for top_p and repetition_penalty resolved to vLLM's neutral values. */
static tsr_status submit_from_wire(const Tessera__V1__Submit *m, tsr_engine_submit *out) {
        const Tessera__V1__SamplingParams *sp = m->sampling;
        snprintf(out->request_id, sizeof(out->request_id), "%s", m->request_id);
        if (copy_u32(m->prompt_token_ids, m->n_prompt_token_ids, &out->prompt) != TSR_OK ||
            copy_u32(m->stop_token_ids, m->n_stop_token_ids, &out->stop_ids) != TSR_OK)
                return TSR_E_NOMEM;
        out->n_prompt = m->n_prompt_token_ids;
        out->n_stop_ids = m->n_stop_token_ids;
        out->max_tokens = m->max_tokens;
        out->min_tokens = m->min_tokens;
        out->ignore_eos = m->ignore_eos;
        out->logprobs = m->logprobs;
        out->prompt_logprobs = m->prompt_logprobs;
        out->priority = m->priority;
        if (m->structured_output && m->structured_output->kind != TESSERA__V1__STRUCTURED_OUTPUT__KIND__NONE) {
                const char *t = m->structured_output->text ? m->structured_output->text : "";
                out->so_kind = (tsr_grammar_kind)m->structured_output->kind;   /* same numbers; wire.c checked the range */
                out->so_len = strlen(t);
                out->so_compact = m->structured_output->compact_whitespace;
                out->so_reasoning_end = (int64_t)m->structured_output->reasoning_end_token_id_plus_1 - 1;
                if (!(out->so_text = strdup(t)))
                        return TSR_E_NOMEM;
        }
        tsr_sampling_init(&out->sampling);
        if (!sp)
                return TSR_OK;
        out->sampling.temperature = sp->temperature;
        out->sampling.top_p = sp->top_p > 0 ? sp->top_p : 1.0f;
        out->sampling.top_k = sp->top_k;
        out->sampling.min_p = sp->min_p;
        out->sampling.repetition_penalty = sp->repetition_penalty > 0 ? sp->repetition_penalty : 1.0f;
        out->sampling.presence_penalty = sp->presence_penalty;
        out->sampling.frequency_penalty = sp->frequency_penalty;
        out->has_seed = sp->has_seed;
        out->seed = sp->seed;
        if (sp->n_logit_bias) {
                out->bias = calloc(sp->n_logit_bias, sizeof(*out->bias));
                if (!out->bias)
                        return TSR_E_NOMEM;
                for (size_t i = 0; i < sp->n_logit_bias; i++) {
                        out->bias[i].id = sp->logit_bias[i]->key;
                        out->bias[i].bias = sp->logit_bias[i]->value;
                }
                out->n_bias = sp->n_logit_bias;
        }
        return TSR_OK;
}

static tsr_status abort_from_wire(const Tessera__V1__Abort *a, tsr_engine_abort *out) {
        out->all_from_router = a->all_from_router;
        snprintf(out->reason, sizeof(out->reason), "%s", a->reason ? a->reason : "");
        if (!a->n_request_ids)
                return TSR_OK;
        out->request_ids = calloc(a->n_request_ids, sizeof(*out->request_ids));
        if (!out->request_ids)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < a->n_request_ids; i++)
                snprintf(out->request_ids[i], sizeof(out->request_ids[i]), "%s", a->request_ids[i]);
        out->n_request_ids = a->n_request_ids;
        return TSR_OK;
}

static Tessera__V1__FinishReason finish_to_wire(tsr_engine_finish f) {
        switch (f) {
        case TSR_ENGINE_FINISH_NONE: return TESSERA__V1__FINISH_REASON__FINISH_NONE;
        case TSR_ENGINE_FINISH_STOP: return TESSERA__V1__FINISH_REASON__FINISH_STOP;
        case TSR_ENGINE_FINISH_LENGTH: return TESSERA__V1__FINISH_REASON__FINISH_LENGTH;
        case TSR_ENGINE_FINISH_ABORT: return TESSERA__V1__FINISH_REASON__FINISH_ABORT;
        case TSR_ENGINE_FINISH_ERROR: return TESSERA__V1__FINISH_REASON__FINISH_ERROR;
        }
        return TESSERA__V1__FINISH_REASON__FINISH_ERROR;
}

static Tessera__V1__ErrorCode error_to_wire(tsr_engine_error e) {
        switch (e) {
        case TSR_ENGINE_ERROR_INVALID: return TESSERA__V1__ERROR_CODE__ERROR_INVALID;
        case TSR_ENGINE_ERROR_TOO_LONG: return TESSERA__V1__ERROR_CODE__ERROR_TOO_LONG;
        case TSR_ENGINE_ERROR_UNAVAILABLE: return TESSERA__V1__ERROR_CODE__ERROR_UNAVAILABLE;
        }
        return TESSERA__V1__ERROR_CODE__ERROR_INTERNAL;
}

/* Hand a message to the engine thread; `in` is consumed either way.  A full inbox
 * refuses a Submit now, retryable, rather than queue without bound. */
static tsr_status to_engine(link *l, tsr_engine_in *in) {
        bool submit = in->kind == TSR_ENGINE_IN_SUBMIT;
        size_t n_prompt = submit ? in->submit.n_prompt : 0;
        tsr_status st = tsr_queue_push(l->inbox, in);   /* `in` is the engine's once pushed */
        if (st == TSR_OK && submit) {
                l->submits_pushed++;
                l->submit_tokens_pushed += n_prompt;
                l->submits_unpublished = true;
        }
        if (st != TSR_OK) {
                if (in->kind == TSR_ENGINE_IN_SUBMIT)
                        send_error(l, in->router_id, in->router_id_len, in->submit.request_id,
                                   TESSERA__V1__ERROR_CODE__ERROR_UNAVAILABLE, true, "worker engine queue is full");
                tsr_engine_in_free(in);
        }
        return st;
}

/* A Submit or Abort from router `rid`, translated for the engine and queued. */
static void frame_to_engine(link *l, tsr_engine_in_kind kind, const uint8_t *rid, size_t rid_len,
                            const tsr_envelope *env) {
        tsr_engine_in *in = engine_in_new(kind, rid, rid_len);
        tsr_status st = TSR_E_NOMEM;
        if (in && kind == TSR_ENGINE_IN_SUBMIT)
                st = submit_from_wire(env->submit, &in->submit);
        else if (in && kind == TSR_ENGINE_IN_ABORT)
                st = abort_from_wire(env->abort, &in->abort);
        else if (in)
                st = TSR_OK;
        if (st != TSR_OK) {
                if (kind == TSR_ENGINE_IN_SUBMIT)
                        send_error(l, rid, rid_len, env->submit->request_id, TESSERA__V1__ERROR_CODE__ERROR_UNAVAILABLE,
                                   true, "worker out of memory");
                tsr_engine_in_free(in);
                return;
        }
        to_engine(l, in);
}

/* Remember the highest numeric request_id a tracked router submitted (refused ones
 * too: the router hears of those by an Error and no longer counts them pending).
 * Routers number their Submits in increasing order per worker pipe; other ids (test
 * clients) are not acknowledged. */
static void note_submit_id(link *l, const uint8_t *rid, size_t rid_len, const char *request_id) {
        router_peer *pr = find_peer(l, rid, rid_len);
        char *end;
        unsigned long long id;
        if (!pr || !request_id || request_id[0] < '0' || request_id[0] > '9')
                return;
        errno = 0;
        id = strtoull(request_id, &end, 10);
        if (errno || *end || id <= pr->last_submit_id)
                return;
        pr->last_submit_id = id;
}

static void handle_frame(link *l, const uint8_t *rid, size_t rid_len, const uint8_t *p, size_t n) {
        tsr_envelope *env = NULL;
        char err[256], who[64];
        tsr_status st = tsr_wire_unpack(p, n, 0, &env, err, sizeof(err));

        printable_id(rid, rid_len, who, sizeof(who));
        peer_heard(l, rid, rid_len, who);
        if (st != TSR_OK) {
                l->n_bad_frames++;
                if (should_log(l->n_bad_frames))
                        log_warn("dropped a frame from router %s: %s (bad_frames=%llu)", who, err,
                                 (unsigned long long)l->n_bad_frames);
                /* Tell the sender why, when it speaks enough protocol to read the answer. */
                if (st == TSR_E_INVAL || strstr(err, "protocol version"))
                        send_error(l, rid, rid_len, NULL,
                                   st == TSR_E_INVAL ? TESSERA__V1__ERROR_CODE__ERROR_INVALID
                                                     : TESSERA__V1__ERROR_CODE__ERROR_VERSION,
                                   false, err);
                return;
        }
        switch (env->msg_case) {
        case TESSERA__V1__ENVELOPE__MSG_HELLO: {
                bool lean = env->hello->cached_tokenizer_hash != 0 &&
                            env->hello->cached_tokenizer_hash == l->o->tokenizer_hash;
                log_info("hello from router %s (version %s): sending model info%s", who,
                         env->hello->tessera_version, lean ? " without tokenizer (cached)" : "");
                if (lean)
                        send_to(l, rid, rid_len, l->o->model_info_lean, l->o->model_info_lean_len);
                else
                        send_to(l, rid, rid_len, l->o->model_info_full, l->o->model_info_full_len);
                break;
        }
        case TESSERA__V1__ENVELOPE__MSG_SUBMIT:
                note_submit_id(l, rid, rid_len, env->submit->request_id);
                if (l->draining) {
                        send_error(l, rid, rid_len, env->submit->request_id,
                                   TESSERA__V1__ERROR_CODE__ERROR_UNAVAILABLE, true,
                                   l->shutting_down ? "worker is shutting down" : "worker is draining");
                        break;
                }
                frame_to_engine(l, TSR_ENGINE_IN_SUBMIT, rid, rid_len, env);
                break;
        case TESSERA__V1__ENVELOPE__MSG_ABORT:
                frame_to_engine(l, TSR_ENGINE_IN_ABORT, rid, rid_len, env);
                break;
        case TESSERA__V1__ENVELOPE__MSG_HEARTBEAT:
                on_heartbeat(l, rid, rid_len, env->heartbeat, who);
                break;
        case TESSERA__V1__ENVELOPE__MSG_RESYNC:
                log_info("router %s asks for a prefix-cache snapshot (it applied status seq %llu)", who,
                         (unsigned long long)env->resync->after_seq);
                frame_to_engine(l, TSR_ENGINE_IN_RESYNC, rid, rid_len, env);
                break;
        case TESSERA__V1__ENVELOPE__MSG_DRAIN:
                if (!env->drain->resume) {
                        log_info("drain requested by router %s: %s", who, env->drain->reason);
                        l->draining = true;
                } else if (l->shutting_down) {
                        log_warn("router %s asks to resume (%s), but this worker is stopping: it stays draining", who,
                                 env->drain->reason);
                } else {
                        log_info("resume requested by router %s: %s", who, env->drain->reason);
                        l->draining = false;
                }
                publish_status(l, NULL);   /* routers see the state now, not at the next tick */
                break;
        case TESSERA__V1__ENVELOPE__MSG_SHUTDOWN:
                log_info("shutdown requested by router %s", who);
                l->stop = true;
                break;
        default:
                l->n_bad_frames++;
                if (should_log(l->n_bad_frames))
                        log_warn("dropped an unexpected %s message from router %s", tsr_wire_msg_name(env), who);
                break;
        }
        tsr_wire_free(env);
}

/* Drain the ROUTER socket.  zmq_poll reports level state here, but read in a bounded
 * batch so the outbox and status timer are never starved. */
static void drain_router(link *l) {
        for (int i = 0; i < 256; i++) {
                zmq_msg_t id, body;
                int more;
                size_t more_len = sizeof(more);

                zmq_msg_init(&id);
                if (zmq_msg_recv(&id, l->router, ZMQ_DONTWAIT) < 0) {
                        zmq_msg_close(&id);
                        return;
                }
                zmq_getsockopt(l->router, ZMQ_RCVMORE, &more, &more_len);
                if (!more) {
                        zmq_msg_close(&id);   /* identity with no body: nothing to do */
                        continue;
                }
                zmq_msg_init(&body);
                zmq_msg_recv(&body, l->router, ZMQ_DONTWAIT);
                zmq_getsockopt(l->router, ZMQ_RCVMORE, &more, &more_len);
                if (more) {
                        /* One frame per message is the protocol: discard the rest. */
                        zmq_msg_t junk;
                        do {
                                zmq_msg_init(&junk);
                                zmq_msg_recv(&junk, l->router, ZMQ_DONTWAIT);
                                zmq_getsockopt(l->router, ZMQ_RCVMORE, &more, &more_len);
                                zmq_msg_close(&junk);
                        } while (more);
                        if (should_log(++l->n_bad_frames))
                                log_warn("dropped a multi-frame message (protocol is one frame)");
                } else if (zmq_msg_size(&id) <= TSR_ENGINE_ROUTER_ID_MAX) {
                        handle_frame(l, zmq_msg_data(&id), zmq_msg_size(&id), zmq_msg_data(&body),
                                     zmq_msg_size(&body));
                }
                zmq_msg_close(&body);
                zmq_msg_close(&id);
        }
}

/* One tsr_token_logprobs as the wire's TokenLogprobs; `dst` borrows src's arrays. */
static void pack_logprobs(const tsr_token_logprobs *src, Tessera__V1__TokenLogprobs *dst) {
        tessera__v1__token_logprobs__init(dst);
        dst->logprob = src->logprob;
        dst->rank = src->rank;
        dst->top_token_ids = (uint32_t *)src->top_ids;
        dst->n_top_token_ids = src->n_top;
        dst->top_logprobs = (float *)src->top_logprobs;
        dst->n_top_logprobs = src->n_top;
}

/* One engine step's outputs for one router -> one Output envelope.  Io thread.  Every
 * TokenLogprobs of the message (sampled and prompt ones) lives in one array for the
 * duration of the send. */
static void send_outputs(link *l, const tsr_engine_out *out) {
        tsr_envelope env;
        Tessera__V1__Output o;
        Tessera__V1__RequestOutput *ro = calloc(out->n_outputs, sizeof(*ro));
        Tessera__V1__RequestOutput **rop = calloc(out->n_outputs, sizeof(*rop));
        Tessera__V1__TokenLogprobs *lps = NULL, **lpp = NULL;
        size_t n_lp = 0, k = 0;

        for (size_t i = 0; i < out->n_outputs; i++)
                n_lp += (out->outputs[i].logprobs ? out->outputs[i].n_new : 0) +
                        (out->outputs[i].prompt_logprobs ? out->outputs[i].n_prompt_logprobs : 0);
        if (n_lp) {
                lps = calloc(n_lp, sizeof(*lps));
                lpp = calloc(n_lp, sizeof(*lpp));
        }
        if (!ro || !rop || (n_lp && (!lps || !lpp))) {
                log_error("out of memory sending outputs");
                goto out;
        }
        tessera__v1__envelope__init(&env);
        tessera__v1__output__init(&o);
        o.step = out->step;
        for (size_t i = 0; i < out->n_outputs; i++) {
                const tsr_engine_req_output *eo = &out->outputs[i];
                Tessera__V1__RequestOutput *r = &ro[i];
                tessera__v1__request_output__init(r);
                r->request_id = (char *)eo->request_id;
                r->new_token_ids = eo->new_tokens;
                r->n_new_token_ids = eo->n_new;
                if (eo->logprobs) {
                        r->logprobs = &lpp[k];
                        r->n_logprobs = eo->n_new;
                        for (uint32_t t = 0; t < eo->n_new; t++, k++) {
                                pack_logprobs(&eo->logprobs[t], &lps[k]);
                                lpp[k] = &lps[k];
                        }
                }
                /* Positions 1 .. n-1 of the prompt, in order (position 0 has none). */
                if (eo->prompt_logprobs) {
                        r->prompt_logprobs = &lpp[k];
                        r->n_prompt_logprobs = eo->n_prompt_logprobs;
                        for (uint32_t t = 0; t < eo->n_prompt_logprobs; t++, k++) {
                                pack_logprobs(&eo->prompt_logprobs[t], &lps[k]);
                                lpp[k] = &lps[k];
                        }
                }
                r->finish_reason = finish_to_wire(eo->finish);
                r->has_stop_token_id = eo->has_stop_token_id;
                r->stop_token_id = eo->stop_token_id;
                r->num_prompt_tokens = eo->num_prompt_tokens;
                r->num_cached_tokens = eo->num_cached_tokens;
                r->num_generated_tokens = eo->num_generated;
                r->queued_ns = eo->queued_ns;
                r->prefill_ns = eo->prefill_ns;
                r->decode_ns = eo->decode_ns;
                r->num_preemptions = eo->num_preemptions;
                rop[i] = r;
        }
        o.outputs = rop;
        o.n_outputs = out->n_outputs;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_OUTPUT;
        env.output = &o;
        send_env(l, out->router_id, out->router_id_len, &env);
out:
        free(ro);
        free(rop);
        free(lps);
        free(lpp);
}

/* vLLM's LoggingStatLogger line, CPU-worded: throughput over the interval, queue
 * lengths, KV usage and the prefix-cache hit rate of the interval.  INFO while the
 * engine has work or had some in the interval, DEBUG when idle (as vLLM). */
static void log_stats(link *l, uint64_t now) {
        const tsr_engine_stats *s = &l->stats, *o = &l->logged;
        double dt = (double)(now - l->logged_ns) / 1e9;
        double prompt_tps = dt > 0 ? (double)(s->prompt_tokens_total - o->prompt_tokens_total) / dt : 0;
        double gen_tps = dt > 0 ? (double)(s->generation_tokens_total - o->generation_tokens_total) / dt : 0;
        uint64_t queries = s->prefix_cache_queries_total - o->prefix_cache_queries_total;
        uint64_t hits = s->prefix_cache_hits_total - o->prefix_cache_hits_total;
        uint64_t preempted = s->num_preemptions_total - o->num_preemptions_total;
        uint64_t bytes_total, bytes_used;
        kv_bytes(l, &bytes_total, &bytes_used);
        double usage = bytes_total ? 100.0 * (double)bytes_used / (double)bytes_total
                       : s->kv_blocks_total ? 100.0 * (1.0 - (double)s->kv_blocks_free / (double)s->kv_blocks_total)
                                            : 0;
        char extra[48] = "";
        bool busy = s->num_running || s->num_waiting || prompt_tps > 0 || gen_tps > 0;

        if (preempted)
                snprintf(extra, sizeof(extra), ", Preemptions: %llu", (unsigned long long)preempted);
        tsr_log(busy ? TSR_LOG_INFO : TSR_LOG_DEBUG, NULL,
                "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %u reqs, Waiting: %u reqs%s, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                prompt_tps, gen_tps, s->num_running, s->num_waiting, extra, usage,
                queries ? 100.0 * (double)hits / (double)queries : 0.0);
        l->logged = *s;
        l->logged_ns = now;
}

static void drain_outbox(link *l) {
        tsr_engine_out *out;
        tsr_queue_ack_fd(l->outbox);
        while ((out = tsr_queue_pop(l->outbox)) != NULL) {
                switch (out->kind) {
                case TSR_ENGINE_OUT_STATS:
                        l->stats = out->stats;
                        publish_status(l, out->events);    /* "on change", besides the timer */
                        break;
                case TSR_ENGINE_OUT_OUTPUT:
                        send_outputs(l, out);
                        break;
                case TSR_ENGINE_OUT_ERROR:
                        send_error(l, out->router_id, out->router_id_len, out->request_id, error_to_wire(out->error_code),
                                   out->retryable, out->message);
                        break;
                case TSR_ENGINE_OUT_STOPPED:
                        l->stop = true;   /* every request answered (engine.h, TSR_ENGINE_IN_SHUTDOWN) */
                        break;
                }
                tsr_engine_out_free(out);
        }
}

static int set_int(void *s, int opt, int v) { return zmq_setsockopt(s, opt, &v, sizeof(v)); }

static tsr_status open_sockets(link *l) {
        int64_t maxmsg = TSR_WIRE_MAX_FRAME;

        l->zctx = zmq_ctx_new();
        if (!l->zctx)
                return log_err(TSR_E_INTERNAL, "zmq_ctx_new failed");
        l->router = zmq_socket(l->zctx, ZMQ_ROUTER);
        l->pub = zmq_socket(l->zctx, ZMQ_PUB);
        if (!l->router || !l->pub)
                return log_err(TSR_E_INTERNAL, "zmq_socket failed: %s", zmq_strerror(zmq_errno()));
        /* Mandatory: a reply to a vanished router fails (counted) instead of vanishing
         * silently; handover: a restarted router reusing its id takes over. */
        set_int(l->router, ZMQ_ROUTER_MANDATORY, 1);
        set_int(l->router, ZMQ_ROUTER_HANDOVER, 1);
        set_int(l->router, ZMQ_LINGER, 0);
        set_int(l->router, ZMQ_SNDHWM, 100000);
        set_int(l->router, ZMQ_RCVHWM, 100000);
        set_int(l->router, ZMQ_HEARTBEAT_IVL, 1000);
        set_int(l->router, ZMQ_HEARTBEAT_TIMEOUT, 3000);
        zmq_setsockopt(l->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        set_int(l->pub, ZMQ_LINGER, 0);
        set_int(l->pub, ZMQ_SNDHWM, 100000);
        if (l->o->curve && l->o->curve->enabled) {
                /* Encrypted, and only routers whose keys are listed get through: the
                 * ZAP thread answers libzmq before any frame reaches this loop. */
                if (tsr_curve_zap_start(l->zctx, l->o->curve, &l->zap) != TSR_OK ||
                    tsr_curve_server(l->o->curve, l->router) != TSR_OK ||
                    tsr_curve_server(l->o->curve, l->pub) != TSR_OK)
                        return log_err(TSR_E_INTERNAL, "cannot set up CurveZMQ: %s", zmq_strerror(zmq_errno()));
                log_info("CurveZMQ on: public key %s, %zu router key(s) allowed", l->o->curve->public_key,
                         l->o->curve->n_peers);
        }
        if (zmq_bind(l->router, l->o->listen) != 0)
                return log_err(TSR_E_IO, "cannot listen on %s: %s", l->o->listen, zmq_strerror(zmq_errno()));
        if (zmq_bind(l->pub, l->o->status_listen) != 0)
                return log_err(TSR_E_IO, "cannot publish status on %s: %s", l->o->status_listen,
                               zmq_strerror(zmq_errno()));
        return TSR_OK;
}

static void close_sockets(link *l) {
        /* After a graceful stop the last Outputs and Errors may still be queued: give
         * them a moment to leave (bounded; a vanished router does not hold us). */
        if (l->router && l->shutting_down)
                set_int(l->router, ZMQ_LINGER, 1000);
        if (l->router)
                zmq_close(l->router);
        if (l->pub)
                zmq_close(l->pub);
        tsr_curve_zap_stop(&l->zap);    /* its socket too must close before the context ends */
        if (l->zctx)
                zmq_ctx_term(l->zctx);
}

/* A stop signal (SIGTERM/SIGINT).  The first: refuse new Submits (retryable Error,
 * Status DRAINING) and ask the engine to finish or abort what it holds within
 * --shutdown-timeout; the loop ends at its TSR_ENGINE_OUT_STOPPED.  A second signal, or
 * an engine that cannot be told, ends the loop at once. */
static void begin_stop(link *l, int stop_fd) {
        char siginfo[128];   /* one struct signalfd_siginfo: read it so the fd quiets */
        struct iovec iov = {.iov_base = siginfo, .iov_len = sizeof(siginfo)};
        tsr_engine_in *in;

        if (readv(stop_fd, &iov, 1) < 0 && errno != EAGAIN)
                log_debug("reading the stop fd: %s", strerror(errno));
        if (l->shutting_down) {
                log_info("second stop signal: stopping now");
                l->stop = true;
                return;
        }
        l->shutting_down = true;
        l->draining = true;
        if (l->o->on_stopping)
                l->o->on_stopping(l->o->ud);
        in = calloc(1, sizeof(*in));
        if (in)
                in->kind = TSR_ENGINE_IN_SHUTDOWN;
        if (!in || tsr_queue_push(l->inbox, in) != TSR_OK) {
                log_warn("stop requested: cannot reach the engine, stopping now");
                free(in);
                l->stop = true;
                return;
        }
        log_info("stop requested: refusing new requests, letting the engine finish");
        publish_status(l, NULL);   /* routers see DRAINING now, not at the next tick */
}

tsr_status tsr_link_run(const tsr_link_opts *o, tsr_queue *inbox, tsr_queue *outbox, int stop_fd) {
        link l = {.o = o, .inbox = inbox, .outbox = outbox};
        uint64_t interval_ns = (uint64_t)(o->status_interval_ms > 0 ? o->status_interval_ms : 100) * 1000000ull;
        uint64_t next_status;
        tsr_status st;

        st = open_sockets(&l);
        if (st != TSR_OK) {
                close_sockets(&l);
                return st;
        }
        log_info("listening on %s, status on %s every %d ms", o->listen, o->status_listen, o->status_interval_ms);
        if (o->on_listening)
                o->on_listening(o->ud);
        next_status = tsr_now_ns();
        l.logged_ns = next_status;
        while (!l.stop) {
                zmq_pollitem_t items[3] = {
                        {.socket = l.router, .events = ZMQ_POLLIN},
                        {.fd = tsr_queue_fd(outbox), .events = ZMQ_POLLIN},
                        {.fd = stop_fd, .events = ZMQ_POLLIN},
                };
                uint64_t now = tsr_now_ns(), due = next_status;
                if (l.submits_unpublished && l.last_status_ns + STATUS_AFTER_SUBMIT_NS < due)
                        due = l.last_status_ns + STATUS_AFTER_SUBMIT_NS;
                long timeout_ms = due > now ? (long)((due - now + 999999) / 1000000) : 0;
                int n = zmq_poll(items, stop_fd >= 0 ? 3 : 2, timeout_ms);

                if (n < 0 && zmq_errno() != EINTR) {
                        st = log_err(TSR_E_IO, "zmq_poll failed: %s", zmq_strerror(zmq_errno()));
                        break;
                }
                if (n > 0 && (items[0].revents & ZMQ_POLLIN))
                        drain_router(&l);
                if (n > 0 && (items[1].revents & ZMQ_POLLIN))
                        drain_outbox(&l);
                if (n > 0 && stop_fd >= 0 && (items[2].revents & ZMQ_POLLIN))
                        begin_stop(&l, stop_fd);
                now = tsr_now_ns();
                reap_silent_routers(&l, now);
                if (o->log_stats_interval_s > 0 && now - l.logged_ns >= (uint64_t)(o->log_stats_interval_s * 1e9))
                        log_stats(&l, now);
                if (now >= next_status) {
                        publish_status(&l, NULL);
                        /* Skip missed ticks instead of bursting after a stall. */
                        while (next_status <= now)
                                next_status += interval_ns;
                } else if (l.submits_unpublished && now >= l.last_status_ns + STATUS_AFTER_SUBMIT_NS) {
                        publish_status(&l, NULL);
                }
        }
        close_sockets(&l);
        return st;
}

/* Build and pack ModelInfo: once with the tokenizer, once without it (for routers
 * that already have it cached).  Everything points into cfg/meta (borrowed). */
tsr_status tsr_link_pack_model_info(const tsr_config *cfg, const tsr_model_meta *m, const tsr_gen_defaults *gd,
                                  const tsr_worker_plan *p, bool ready, const char *dtype, uint8_t **full, size_t *full_len, uint8_t **lean, size_t *lean_len) {
        tsr_envelope env;
        Tessera__V1__ModelInfo mi;
        Tessera__V1__HfTokenizer hf;
        Tessera__V1__GgufTokenizer gg;
        Tessera__V1__GenerationDefaults gen;
        Tessera__V1__BlockHashSpec bh;
        char *default_name[1] = {m->path};
        tsr_status st;

        tessera__v1__envelope__init(&env);
        tessera__v1__model_info__init(&mi);
        tessera__v1__hf_tokenizer__init(&hf);
        tessera__v1__gguf_tokenizer__init(&gg);
        tessera__v1__generation_defaults__init(&gen);
        tessera__v1__block_hash_spec__init(&bh);

        mi.worker_id = (char *)p->worker_id;
        mi.boot_epoch = p->boot_epoch;
        if (cfg->served_model_name.n) {
                mi.served_model_names = cfg->served_model_name.items;
                mi.n_served_model_names = cfg->served_model_name.n;
        } else {
                mi.served_model_names = default_name;
                mi.n_served_model_names = 1;
        }
        mi.model_root = m->path;
        mi.max_model_len = p->max_model_len;
        mi.block_size = (uint32_t)cfg->block_size;
        mi.eos_token_ids = m->eos_token_ids;
        mi.n_eos_token_ids = m->n_eos_token_ids;
        mi.bos_token_id = m->bos_token_id;
        mi.vocab_size = m->vocab_size;
        mi.tokenizer_hash = m->tokenizer_hash;
        if (m->gguf_tokenizer) {
                const tsr_gguf_tokenizer *t = m->gguf_tokenizer;
                gg.model = t->model ? t->model : "";
                gg.pre = t->pre ? t->pre : "";
                gg.tokens = t->tokens;
                gg.n_tokens = t->n_tokens;
                gg.scores = t->scores;
                gg.n_scores = t->scores ? t->n_tokens : 0;
                gg.token_types = t->token_types;
                gg.n_token_types = t->token_types ? t->n_tokens : 0;
                gg.merges = t->merges;
                gg.n_merges = t->n_merges;
                gg.bos_token_id = t->bos_id;
                gg.eos_token_id = t->eos_id;
                gg.unk_token_id = t->unk_id;
                gg.pad_token_id = t->pad_id;
                gg.add_bos_token = t->add_bos;
                gg.add_eos_token = t->add_eos;
                gg.add_space_prefix = t->add_space_prefix;
                mi.tokenizer_case = TESSERA__V1__MODEL_INFO__TOKENIZER_GGUF;
                mi.gguf = &gg;
        } else {
                hf.tokenizer_json.data = m->tokenizer_json;
                hf.tokenizer_json.len = m->tokenizer_json_len;
                hf.tokenizer_config_json.data = m->tokenizer_config_json;
                hf.tokenizer_config_json.len = m->tokenizer_config_json_len;
                mi.tokenizer_case = TESSERA__V1__MODEL_INFO__TOKENIZER_HF;
                mi.hf = &hf;
        }
        mi.chat_template = m->chat_template ? m->chat_template : "";
        /* --generation-config / --override-generation-config, resolved at startup. */
        gen.has_temperature = gd->has_temperature;
        gen.temperature = (float)gd->temperature;
        gen.has_top_p = gd->has_top_p;
        gen.top_p = (float)gd->top_p;
        gen.has_top_k = gd->has_top_k;
        gen.top_k = gd->top_k < INT32_MIN ? INT32_MIN : gd->top_k > INT32_MAX ? INT32_MAX : (int32_t)gd->top_k;
        gen.has_min_p = gd->has_min_p;
        gen.min_p = (float)gd->min_p;
        gen.has_repetition_penalty = gd->has_repetition_penalty;
        gen.repetition_penalty = (float)gd->repetition_penalty;
        gen.has_max_new_tokens = gd->has_max_new_tokens && gd->max_new_tokens > 0;
        gen.max_new_tokens = gd->max_new_tokens > (int64_t)UINT32_MAX ? UINT32_MAX
                             : gd->max_new_tokens > 0 ? (uint32_t)gd->max_new_tokens : 0;
        mi.generation_defaults = &gen;
        bh.algo = cfg->prefix_caching_hash_algo;
        bh.seed = TSR_BLOCK_HASH_NONE;
        mi.block_hash = &bh;
        mi.kv_blocks_total = p->kv_blocks_total;
        mi.max_num_seqs = p->max_num_seqs;
        mi.max_num_batched_tokens = p->max_num_batched_tokens;
        mi.tensor_parallel_size = p->tensor_parallel_size ? p->tensor_parallel_size : 1;
        mi.pipeline_parallel_size = p->pipeline_parallel_size ? p->pipeline_parallel_size : 1;
        mi.weight_bytes = p->weight_bytes;
        mi.kv_cache_dtype = cfg->kv_cache_dtype ? cfg->kv_cache_dtype : (char *)"auto";
        mi.dtype = (char *)dtype;
        mi.backend = "cpu";
        mi.architecture = m->architecture ? m->architecture : "";
        mi.status_endpoint = (char *)p->status_listen;
        mi.engine_ready = ready;
        mi.tessera_version = TSR_VERSION;
        mi.max_logprobs = cfg->max_logprobs < 0 ? m->vocab_size : (uint32_t)cfg->max_logprobs;
        mi.prefix_caching = cfg->enable_prefix_caching != TSR_TRI_FALSE;
        mi.status_interval_ms = (uint32_t)cfg->status_interval_ms;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_MODEL_INFO;
        env.model_info = &mi;

        st = tsr_wire_pack(&env, full, full_len);
        if (st != TSR_OK)
                return st;
        mi.tokenizer_case = TESSERA__V1__MODEL_INFO__TOKENIZER__NOT_SET;
        mi.tokenizer_omitted = true;
        st = tsr_wire_pack(&env, lean, lean_len);
        if (st != TSR_OK) {
                free(*full);
                *full = NULL;
        }
        return st;
}
