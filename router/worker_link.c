/* worker_link.c - ZeroMQ to workers on the libuv loop (see worker_link.h). */
#include "worker_link.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/endpoint.h"
#include "common/log.h"
#include "common/zmq_curve.h"

#define HELLO_RETRY_NS (1000ull * 1000000ull)
#define DEFAULT_STATUS_INTERVAL_MS 100u
#define MISSED_STATUS_LIMIT 3u
#define MISSED_STATUS_MIN_NS (1000ull * 1000000ull)
#define TICK_MS 50
/* Heartbeat cadence to every worker (docs/protocol.md, "Liveness and failure").  Sent from
 * the loop's tick, so it says "this router's loop runs", not merely "its process has a
 * TCP connection": ZMTP heartbeats are answered by libzmq's own io thread.  Four a
 * second costs a few bytes per worker; the worker reaps after 12 silent intervals. */
#define HEARTBEAT_MS 250u
/* A tick this late means our own loop (or process) was not running: the workers'
 * Status is unread, not missing.  Give them DOWN_GRACE_NS (the queued Status is read
 * on the first drain) before declaring any down. */
#define LOOP_STALL_NS (1000ull * 1000000ull)
#define DOWN_GRACE_NS (1000ull * 1000000ull)
/* Most hashes mirrored per worker when its Status does not say how many blocks it
 * has: 8 MiB of set at most.  A worker cannot cache more hashes than KV blocks. */
#define MIRROR_CAP_DEFAULT (1u << 20)
#define MIRROR_CAP_MAX (1u << 24)
/* At most one Resync a second per worker: a snapshot is every cached hash. */
#define RESYNC_MIN_GAP_NS (1000ull * 1000000ull)

typedef struct zsock_watch {
        void *sock;
        uv_poll_t poll;
        tsr_worker *owner;
        bool is_sub;
} zsock_watch;

struct tsr_worker {
        tsr_worker_pool *pool;
        char *endpoint;
        char *status_endpoint;
        zsock_watch dealer;
        zsock_watch sub;
        tsr_envelope *info;          /* latest ModelInfo envelope, owned */
        tsr_envelope *tokenizer_env; /* the envelope whose ModelInfo carries the tokenizer, owned */
        tsr_envelope *status;        /* latest Status envelope, owned */
        uint64_t boot_epoch;         /* of `info` */
        uint64_t last_status_ns;
        uint64_t last_hello_ns;
        uint64_t last_resync_ns;     /* last Resync asked (maybe_ask_resync) */
        bool was_live;
        bool abort_on_return;        /* declared down: abort our ghosts when it speaks again */
        bool retired;                /* tsr_worker_pool_retire: no new requests, removed when idle */
        bool removed;                /* out of the pool; freed when `closing` handles have closed */
        int closing;                 /* its poll handles still closing after removal */
        uint64_t n_bad_frames;
        tsr_prefix_mirror mirror;    /* its cached block hashes (loop thread) */
};

struct tsr_worker_pool {
        uv_loop_t *loop;
        void *zctx;
        char router_id[64];
        tsr_worker **workers;
        size_t n_workers;
        uv_timer_t tick;
        uv_idle_t kick;              /* re-drain after sends: the ZMQ_FD edge rule */
        uint64_t last_heartbeat_ns;
        uint64_t heartbeat_seq;
        uint64_t last_tick_ns;
        uint64_t down_grace_until_ns; /* after a stall of ours: no worker declared down before */
        const tsr_curve *curve;      /* CurveZMQ keys (borrowed), NULL or disabled = plain TCP */
        int open_handles;
        worker_events ev;
        void (*closed_cb)(void *ud);
        void *closed_ud;
};

static bool should_log(uint64_t n) { return n <= 10 || n % 1000 == 0; }

static void kick(tsr_worker_pool *p);
static void send_control(tsr_worker *w, tsr_envelope *env);
static void abort_all_on(tsr_worker *w);

static uint64_t status_window_ns(const tsr_worker *w) {
        uint32_t ivl = DEFAULT_STATUS_INTERVAL_MS;
        if (w->info && w->info->model_info->status_interval_ms)
                ivl = w->info->model_info->status_interval_ms;
        uint64_t window = (uint64_t)MISSED_STATUS_LIMIT * ivl * 1000000ull;
        /* Never under a second: at the default 100 ms a worker whose io thread waits
         * 300 ms for a core (a loaded host) was being declared down, failing its
         * requests with 503s (seen in the keep-alive soak at load 13). */
        return window > MISSED_STATUS_MIN_NS ? window : MISSED_STATUS_MIN_NS;
}

bool tsr_worker_live(const tsr_worker *w) {
        return w->info && w->last_status_ns && tsr_now_ns() - w->last_status_ns <= status_window_ns(w);
}

const char *tsr_worker_endpoint(const tsr_worker *w) { return w->endpoint; }

const Tessera__V1__ModelInfo *tsr_worker_model_info(const tsr_worker *w) {
        return w->info ? w->info->model_info : NULL;
}

const Tessera__V1__Status *tsr_worker_status(const tsr_worker *w) { return w->status ? w->status->status : NULL; }

bool tsr_worker_submit_ack(const tsr_worker *w, uint64_t *last_id) {
        const Tessera__V1__Status *st = tsr_worker_status(w);
        size_t id_len = strlen(w->pool->router_id);
        for (size_t i = 0; st && i < st->n_submit_acks; i++) {
                const ProtobufCBinaryData *id = &st->submit_acks[i]->router_id;
                if (id->len == id_len && memcmp(id->data, w->pool->router_id, id_len) == 0) {
                        *last_id = st->submit_acks[i]->last_request_id;
                        return true;
                }
        }
        return false;
}

size_t tsr_worker_pool_count(const tsr_worker_pool *p) { return p->n_workers; }

void tsr_worker_pool_set_events(tsr_worker_pool *p, const worker_events *ev) { p->ev = *ev; }

tsr_status tsr_worker_send(tsr_worker *w, tsr_envelope *env) {
        uint8_t *buf;
        size_t n;
        tsr_status st = tsr_wire_pack(env, &buf, &n);
        if (st != TSR_OK)
                return st;
        st = zmq_send(w->dealer.sock, buf, n, ZMQ_DONTWAIT) < 0 ? TSR_E_UNAVAILABLE : TSR_OK;
        if (st != TSR_OK)
                log_warn("worker %s: %s not sent: %s", w->endpoint, tsr_wire_msg_name(env), zmq_strerror(zmq_errno()));
        free(buf);
        kick(w->pool);
        return st;
}
tsr_worker *tsr_worker_pool_get(tsr_worker_pool *p, size_t i) { return i < p->n_workers ? p->workers[i] : NULL; }

tsr_worker *tsr_worker_pool_find(tsr_worker_pool *p, const char *endpoint) {
        for (size_t i = 0; i < p->n_workers; i++)
                if (strcmp(p->workers[i]->endpoint, endpoint) == 0)
                        return p->workers[i];
        return NULL;
}

bool tsr_worker_accepting(const tsr_worker *w) { return !w->retired; }

void tsr_worker_pool_retire(tsr_worker_pool *p, tsr_worker *w) {
        (void)p;
        if (w->retired)
                return;
        w->retired = true;
        log_info("worker %s retired: no new requests; removed once none of ours is in flight there", w->endpoint);
}

void tsr_worker_pool_unretire(tsr_worker_pool *p, tsr_worker *w) {
        (void)p;
        if (!w->retired)
                return;
        w->retired = false;
        log_info("worker %s takes requests again", w->endpoint);
}

size_t tsr_worker_pool_num_live(const tsr_worker_pool *p) {
        size_t n = 0;
        for (size_t i = 0; i < p->n_workers; i++)
                n += tsr_worker_live(p->workers[i]);
        return n;
}

static const Tessera__V1__ModelInfo *tokenizer_source(const tsr_worker *w);

static void send_hello(tsr_worker *w) {
        tsr_envelope env;
        Tessera__V1__Hello h;
        uint8_t *buf;
        size_t n;

        tessera__v1__envelope__init(&env);
        tessera__v1__hello__init(&h);
        h.router_id = w->pool->router_id;
        h.tessera_version = TSR_VERSION;
        if (tokenizer_source(w))
                h.cached_tokenizer_hash = tokenizer_source(w)->tokenizer_hash;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_HELLO;
        env.hello = &h;
        w->last_hello_ns = tsr_now_ns();
        if (tsr_wire_pack(&env, &buf, &n) != TSR_OK)
                return;
        /* DONTWAIT: a DEALER whose pipe is full (worker gone for long) drops the Hello;
         * the tick retries every second until ModelInfo arrives. */
        if (zmq_send(w->dealer.sock, buf, n, ZMQ_DONTWAIT) < 0)
                log_debug("hello to %s not sent: %s", w->endpoint, zmq_strerror(zmq_errno()));
        free(buf);
        kick(w->pool);
}

/* The ModelInfo that carries the tokenizer bytes: the current one, or an earlier one
 * kept because the worker later sent its ModelInfo without them (same hash). */
static const Tessera__V1__ModelInfo *tokenizer_source(const tsr_worker *w) {
        if (w->tokenizer_env)
                return w->tokenizer_env->model_info;
        if (w->info && !w->info->model_info->tokenizer_omitted)
                return w->info->model_info;
        return NULL;
}

const Tessera__V1__ModelInfo *tsr_worker_tokenizer(const tsr_worker *w) { return tokenizer_source(w); }

/* Drop the ModelInfo (the worker restarted), keeping its tokenizer for the cache. */
static void forget_info(tsr_worker *w) {
        if (w->info && !w->info->model_info->tokenizer_omitted) {
                tsr_wire_free(w->tokenizer_env);
                w->tokenizer_env = w->info;
        } else {
                tsr_wire_free(w->info);
        }
        w->info = NULL;
}

static void on_model_info(tsr_worker *w, tsr_envelope *env) {
        Tessera__V1__ModelInfo *mi = env->model_info;

        if (mi->tokenizer_omitted) {
                const Tessera__V1__ModelInfo *src = tokenizer_source(w);
                if (!src || src->tokenizer_hash != mi->tokenizer_hash) {
                        /* Our cache is gone or stale: drop it and ask for the full form. */
                        tsr_wire_free(w->tokenizer_env);
                        w->tokenizer_env = NULL;
                        tsr_wire_free(w->info);
                        w->info = NULL;
                        tsr_wire_free(env);
                        send_hello(w);
                        return;
                }
                forget_info(w);   /* moves a tokenizer-carrying info into tokenizer_env */
        } else {
                tsr_wire_free(w->info);
                tsr_wire_free(w->tokenizer_env);
                w->tokenizer_env = NULL;
        }
        w->info = env;
        w->boot_epoch = mi->boot_epoch;
        log_info("worker %s: model info: %s (max_model_len %u, block_size %u, %llu KV blocks, engine %s%s)",
                 w->endpoint, mi->served_model_names[0], mi->max_model_len, mi->block_size,
                 (unsigned long long)mi->kv_blocks_total, mi->engine_ready ? "ready" : "not built",
                 mi->tokenizer_omitted ? ", tokenizer from cache" : "");
        if (w->pool->ev.on_model_info)
                w->pool->ev.on_model_info(w->pool->ev.ud, w, mi);
}

void tsr_prefix_mirror_init(tsr_prefix_mirror *m) {
        memset(m, 0, sizeof(*m));
        tsr_hashset_init(&m->set, MIRROR_CAP_DEFAULT);
}

void tsr_prefix_mirror_done(tsr_prefix_mirror *m) { tsr_hashset_done(&m->set); }

size_t tsr_prefix_mirror_hits(const tsr_prefix_mirror *m, const uint64_t *hashes, size_t n) {
        size_t k = 0;
        while (k < n && tsr_hashset_has(&m->set, hashes[k]))
                k++;
        return k;
}

size_t tsr_worker_prefix_hits(const tsr_worker *w, const uint64_t *hashes, size_t n) {
        return tsr_prefix_mirror_hits(&w->mirror, hashes, n);
}

size_t tsr_worker_mirror_size(const tsr_worker *w) { return tsr_hashset_size(&w->mirror.set); }

bool tsr_worker_mirror_exact(const tsr_worker *w) { return w->mirror.exact; }

/* Loop thread (see worker_link.h for why a gap or restart empties the mirror). */
bool tsr_prefix_mirror_apply(tsr_prefix_mirror *m, const Tessera__V1__Status *s) {
        size_t cap = s->kv_blocks_total ? (size_t)s->kv_blocks_total : MIRROR_CAP_DEFAULT;
        bool gap = m->seq && s->seq != m->seq + 1;
        bool restarted = m->seq && s->boot_epoch != m->epoch;

        if (gap || restarted) {
                m->resets++;
                tsr_hashset_clear(&m->set);
                m->exact = false;
        }
        /* Seq 1 is the worker's first Status: no event came before it. */
        if (s->seq == 1)
                m->exact = true;
        m->epoch = s->boot_epoch;
        m->seq = s->seq;
        m->set.cap = cap < MIRROR_CAP_MAX ? cap : MIRROR_CAP_MAX;
        for (size_t i = 0; i < s->n_events; i++) {
                const Tessera__V1__BlockHashEvent *e = s->events[i];
                switch (e->kind) {
                case TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED:
                        /* Past the cap (or out of memory) the hash is simply not
                         * mirrored: fewer hits predicted, never a wrong one. */
                        for (size_t k = 0; k < e->n_block_hashes; k++)
                                (void)tsr_hashset_add(&m->set, e->block_hashes[k]);
                        break;
                case TESSERA__V1__BLOCK_HASH_EVENT__KIND__REMOVED:
                        for (size_t k = 0; k < e->n_block_hashes; k++)
                                tsr_hashset_remove(&m->set, e->block_hashes[k]);
                        break;
                case TESSERA__V1__BLOCK_HASH_EVENT__KIND__ALL_CLEARED:
                        tsr_hashset_clear(&m->set);
                        m->exact = true;        /* a snapshot follows, in this Status */
                        break;
                default:
                        break;
                }
        }
        return gap || restarted;
}

/* The mirror is not exact (this router joined late, or a Status was lost): ask the
 * worker for a snapshot, at most once a second.  It comes in a later Status as
 * ALL_CLEARED + STORED events, in order with everything else (proto Resync). */
static void maybe_ask_resync(tsr_worker *w) {
        tsr_envelope env;
        Tessera__V1__Resync rs;
        uint64_t now = tsr_now_ns();

        if (w->mirror.exact || !w->info || now - w->last_resync_ns < RESYNC_MIN_GAP_NS)
                return;
        w->last_resync_ns = now;
        w->mirror.resyncs_asked++;
        tessera__v1__envelope__init(&env);
        tessera__v1__resync__init(&rs);
        rs.router_id = w->pool->router_id;
        rs.after_seq = w->mirror.seq;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_RESYNC;
        env.resync = &rs;
        send_control(w, &env);
        kick(w->pool);
}

static void on_status(tsr_worker *w, tsr_envelope *env) {
        Tessera__V1__Status *s = env->status;
        uint64_t prev_seq = w->mirror.seq;
        if (tsr_prefix_mirror_apply(&w->mirror, s) && should_log(w->mirror.resets))
                log_info("worker %s: prefix-cache mirror reset (%s, seq %llu after %llu)", w->endpoint,
                         s->boot_epoch != w->boot_epoch ? "worker restarted" : "status lost",
                         (unsigned long long)s->seq, (unsigned long long)prev_seq);
        maybe_ask_resync(w);
        if (w->info && s->boot_epoch != w->boot_epoch) {
                log_warn("worker %s restarted (boot epoch %llu -> %llu): asking for its model info again",
                         w->endpoint, (unsigned long long)w->boot_epoch, (unsigned long long)s->boot_epoch);
                forget_info(w);
                /* Whatever it had in flight died with the old process. */
                if (w->was_live) {
                        w->was_live = false;
                        if (w->pool->ev.on_worker_down)
                                w->pool->ev.on_worker_down(w->pool->ev.ud, w);
                }
        }
        /* Back from being declared down, same process (it was stalled, not dead): the
         * Abort sent when it went down may have been lost with a reconnect, so send
         * it again, before any placement can see this worker live (the Submits that
         * follow queue behind it on the same pipe). */
        if (w->abort_on_return) {
                w->abort_on_return = false;
                if (w->info && s->boot_epoch == w->boot_epoch) {
                        log_info("worker %s is back: aborting whatever it still runs for us", w->endpoint);
                        abort_all_on(w);
                }
        }
        tsr_wire_free(w->status);
        w->status = env;
        w->last_status_ns = tsr_now_ns();
        if (w->info && w->pool->ev.on_status)
                w->pool->ev.on_status(w->pool->ev.ud, w, s);
        if (!w->info && w->last_status_ns - w->last_hello_ns > 200ull * 1000000ull)
                send_hello(w);
}

/* The worker took this router for dead (no Heartbeat within its deadline: our loop
 * or process was stalled) and aborted everything we had there; those requests will
 * never get another Output.  First Abort whatever we submitted since (it races the
 * notice; the pipe is FIFO, so the Abort lands before the retries that follow), then
 * let the request layer retry or fail every choice there, as for a worker that went
 * down.  The worker itself is fine and stays live. */
static void on_reaped(tsr_worker *w, const Tessera__V1__Error *err) {
        log_warn("worker %s: %s", w->endpoint, err->message);
        abort_all_on(w);
        if (w->pool->ev.on_worker_down)
                w->pool->ev.on_worker_down(w->pool->ev.ud, w);
}

static void handle_frame(tsr_worker *w, bool from_sub, const void *p, size_t n) {
        tsr_envelope *env = NULL;
        char err[256];

        if (tsr_wire_unpack(p, n, 0, &env, err, sizeof(err)) != TSR_OK) {
                if (should_log(++w->n_bad_frames))
                        log_warn("worker %s: dropped a frame: %s", w->endpoint, err);
                return;
        }
        switch (env->msg_case) {
        case TESSERA__V1__ENVELOPE__MSG_STATUS:
                if (from_sub) {
                        on_status(w, env);
                        return;
                }
                break;
        case TESSERA__V1__ENVELOPE__MSG_MODEL_INFO:
                if (!from_sub) {
                        on_model_info(w, env);
                        return;
                }
                break;
        case TESSERA__V1__ENVELOPE__MSG_ERROR:
                if (!from_sub && env->error->code == TESSERA__V1__ERROR_CODE__ERROR_ROUTER_REAPED) {
                        on_reaped(w, env->error);
                } else if (!from_sub && w->pool->ev.on_error && env->error->request_id[0]) {
                        w->pool->ev.on_error(w->pool->ev.ud, w, env->error);
                } else {
                        log_warn("worker %s: error%s%s: %s", w->endpoint, env->error->request_id[0] ? " for " : "",
                                 env->error->request_id, env->error->message);
                }
                break;
        case TESSERA__V1__ENVELOPE__MSG_OUTPUT:
                if (!from_sub && w->pool->ev.on_step)
                        w->pool->ev.on_step(w->pool->ev.ud, w, env->output);
                if (!from_sub && w->pool->ev.on_output)
                        for (size_t i = 0; i < env->output->n_outputs; i++)
                                w->pool->ev.on_output(w->pool->ev.ud, w, env->output->outputs[i]);
                break;
        default:
                if (should_log(++w->n_bad_frames))
                        log_warn("worker %s: unexpected %s message", w->endpoint, tsr_wire_msg_name(env));
                break;
        }
        tsr_wire_free(env);
}

/* Read everything the socket has.  ZMQ_FD only signals edges, so stop only when
 * ZMQ_EVENTS says there is nothing left; bounded per call so one busy worker cannot
 * starve the loop (the idle kick comes back for the rest). */
static bool drain(zsock_watch *z) {
        for (int i = 0; i < 1024; i++) {
                int events = 0;
                size_t len = sizeof(events);
                zmq_msg_t m;

                if (zmq_getsockopt(z->sock, ZMQ_EVENTS, &events, &len) != 0 || !(events & ZMQ_POLLIN))
                        return false;
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, z->sock, ZMQ_DONTWAIT) < 0) {
                        zmq_msg_close(&m);
                        return false;
                }
                if (zmq_msg_more(&m)) {
                        /* One frame per message is the protocol: skip the rest. */
                        zmq_msg_t junk;
                        do {
                                zmq_msg_init(&junk);
                                if (zmq_msg_recv(&junk, z->sock, ZMQ_DONTWAIT) < 0) {
                                        zmq_msg_close(&junk);
                                        break;
                                }
                                int more = zmq_msg_more(&junk);
                                zmq_msg_close(&junk);
                                if (!more)
                                        break;
                        } while (1);
                } else {
                        handle_frame(z->owner, z->is_sub, zmq_msg_data(&m), zmq_msg_size(&m));
                }
                zmq_msg_close(&m);
        }
        return true;   /* more may be waiting */
}

static bool drain_all(tsr_worker_pool *p) {
        bool more = false;
        for (size_t i = 0; i < p->n_workers; i++) {
                more |= drain(&p->workers[i]->dealer);
                more |= drain(&p->workers[i]->sub);
        }
        return more;
}

static void on_poll(uv_poll_t *h, int status, int events) {
        zsock_watch *z = h->data;
        if (drain(z))
                kick(z->owner->pool);
}

static void on_kick(uv_idle_t *h) {
        tsr_worker_pool *p = h->data;
        if (!drain_all(p))
                uv_idle_stop(&p->kick);
}

static void kick(tsr_worker_pool *p) {
        if (!uv_is_closing((uv_handle_t *)&p->kick))
                uv_idle_start(&p->kick, on_kick);
}

/* Pack and send one small control envelope on w's DEALER; never blocks.  While the
 * worker is away the message waits in the DEALER's pipe; past the HWM (a worker gone
 * for hours) it is dropped, which for these messages is fine. */
static void send_control(tsr_worker *w, tsr_envelope *env) {
        uint8_t *buf;
        size_t n;
        if (tsr_wire_pack(env, &buf, &n) != TSR_OK)
                return;
        if (zmq_send(w->dealer.sock, buf, n, ZMQ_DONTWAIT) < 0)
                log_debug("%s to %s not sent: %s", tsr_wire_msg_name(env), w->endpoint, zmq_strerror(zmq_errno()));
        free(buf);
}

static void send_heartbeats(tsr_worker_pool *p) {
        tsr_envelope env;
        Tessera__V1__Heartbeat hb;

        tessera__v1__envelope__init(&env);
        tessera__v1__heartbeat__init(&hb);
        hb.router_id = p->router_id;
        hb.interval_ms = HEARTBEAT_MS;
        hb.seq = ++p->heartbeat_seq;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_HEARTBEAT;
        env.heartbeat = &hb;
        for (size_t i = 0; i < p->n_workers; i++)
                send_control(p->workers[i], &env);
        kick(p);
}

/* A worker we just declared down (no Status for 3 intervals) may only be stalled
 * (SIGSTOP, swapping, a long GC-like pause).  Every choice we had there has been
 * retried or failed by on_worker_down, so whatever it still runs for us is a ghost.
 * Abort all of it now: the message waits in the pipe and the worker reads it, in
 * order, before any Submit we send after it comes back.  A worker that really died
 * never reads it; a restarted one has nothing of ours (Abort is idempotent). */
static void abort_all_on(tsr_worker *w) {
        tsr_envelope env;
        Tessera__V1__Abort a;

        tessera__v1__envelope__init(&env);
        tessera__v1__abort__init(&a);
        a.all_from_router = true;
        a.reason = "the router declared this worker down";
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_ABORT;
        env.abort = &a;
        send_control(w, &env);
        kick(w->pool);
}

static void remove_worker(tsr_worker_pool *p, size_t idx);

/* Remove the retired workers none of our requests runs on any more.  Last in the tick,
 * after the liveness pass: a retired worker that died has had its requests failed over
 * by on_worker_down just before, so it goes in the same tick. */
static void reap_retired(tsr_worker_pool *p) {
        for (size_t i = p->n_workers; i-- > 0;) {
                tsr_worker *w = p->workers[i];
                if (w->retired && (!p->ev.in_flight || p->ev.in_flight(p->ev.ud, w) == 0))
                        remove_worker(p, i);
        }
}

static void on_tick(uv_timer_t *t) {
        tsr_worker_pool *p = t->data;
        uint64_t now = tsr_now_ns();
        bool more;
        if (p->last_tick_ns && now - p->last_tick_ns > LOOP_STALL_NS) {
                log_warn("router loop stalled for %.1f s: reading the workers' Status before judging them",
                         (double)(now - p->last_tick_ns) / 1e9);
                p->down_grace_until_ns = now + DOWN_GRACE_NS;
        }
        p->last_tick_ns = now;
        if (now - p->last_heartbeat_ns >= HEARTBEAT_MS * 1000000ull) {
                p->last_heartbeat_ns = now;
                send_heartbeats(p);
        }
        /* Read what is queued before judging liveness: a Status waiting unread is not
         * a missing one (belt and braces for the edge-triggered fd, too). */
        more = drain_all(p);
        now = tsr_now_ns();
        for (size_t i = 0; i < p->n_workers; i++) {
                tsr_worker *w = p->workers[i];
                bool live = tsr_worker_live(w);
                if (!live && w->was_live && now < p->down_grace_until_ns) {
                        /* just back from our own stall: drain first (below) */
                } else if (live != w->was_live) {
                        if (live)
                                log_info("worker %s is live", w->endpoint);
                        else
                                log_warn("worker %s is down: %s", w->endpoint,
                                         w->info ? "no Status within 3 intervals" : "no model info");
                        w->was_live = live;
                        if (!live && p->ev.on_worker_down)
                                p->ev.on_worker_down(p->ev.ud, w);
                        if (!live && w->info) {
                                abort_all_on(w);
                                w->abort_on_return = true;
                        }
                }
                if (!w->info && now - w->last_hello_ns >= HELLO_RETRY_NS)
                        send_hello(w);
        }
        reap_retired(p);
        if (more)
                kick(p);
}

static int set_int(void *s, int opt, int v) { return zmq_setsockopt(s, opt, &v, sizeof(v)); }

static tsr_status watch_socket(tsr_worker_pool *p, tsr_worker *w, zsock_watch *z, void *sock, bool is_sub) {
        int fd;
        size_t len = sizeof(fd);
        z->sock = sock;
        z->owner = w;
        z->is_sub = is_sub;
        if (zmq_getsockopt(sock, ZMQ_FD, &fd, &len) != 0)
                return TSR_E_INTERNAL;
        if (uv_poll_init(p->loop, &z->poll, fd) != 0)
                return TSR_E_INTERNAL;
        p->open_handles++;
        z->poll.data = z;
        uv_poll_start(&z->poll, UV_READABLE, on_poll);
        return TSR_OK;
}

static char *default_status_endpoint(const char *ep) {
        char out[512];
        return tsr_endpoint_status_default(ep, out, sizeof(out)) == TSR_OK ? strdup(out) : NULL;
}

tsr_status tsr_worker_pool_add(tsr_worker_pool *p, const char *spec) {
        tsr_worker *w, **grown;
        const char *comma = strchr(spec, ',');
        int64_t maxmsg = TSR_WIRE_MAX_FRAME;
        void *dealer = NULL, *sub = NULL;

        w = calloc(1, sizeof(*w));
        if (!w)
                return TSR_E_NOMEM;
        w->pool = p;
        tsr_prefix_mirror_init(&w->mirror);
        w->endpoint = comma ? strndup(spec, (size_t)(comma - spec)) : strdup(spec);
        w->status_endpoint = comma ? strdup(comma + 1) : default_status_endpoint(spec);
        if (!w->endpoint || !w->status_endpoint) {
                log_error("--worker %s: expected tcp://HOST:PORT[,tcp://HOST:STATUS_PORT]", spec);
                goto fail;
        }
        dealer = zmq_socket(p->zctx, ZMQ_DEALER);
        sub = zmq_socket(p->zctx, ZMQ_SUB);
        if (!dealer || !sub)
                goto fail;
        zmq_setsockopt(dealer, ZMQ_ROUTING_ID, p->router_id, strlen(p->router_id));
        set_int(dealer, ZMQ_LINGER, 0);
        set_int(dealer, ZMQ_SNDHWM, 100000);
        set_int(dealer, ZMQ_RCVHWM, 100000);
        set_int(dealer, ZMQ_RECONNECT_IVL, 100);
        set_int(dealer, ZMQ_RECONNECT_IVL_MAX, 1000);
        set_int(dealer, ZMQ_HEARTBEAT_IVL, 1000);
        set_int(dealer, ZMQ_HEARTBEAT_TIMEOUT, 3000);
        set_int(dealer, ZMQ_HEARTBEAT_TTL, 5000);
        zmq_setsockopt(dealer, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        set_int(sub, ZMQ_LINGER, 0);
        set_int(sub, ZMQ_RCVHWM, 100000);
        set_int(sub, ZMQ_RECONNECT_IVL, 100);
        set_int(sub, ZMQ_RECONNECT_IVL_MAX, 1000);
        zmq_setsockopt(sub, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
        /* Both sockets reach the same worker process: the key of its request endpoint
         * authenticates its Status publisher too. */
        if (p->curve && p->curve->enabled) {
                tsr_status cst = tsr_curve_client(p->curve, dealer, w->endpoint);
                if (cst == TSR_OK)
                        cst = tsr_curve_client(p->curve, sub, w->endpoint);
                if (cst != TSR_OK) {
                        log_error("--worker %s: %s", spec,
                                  cst == TSR_E_NOTFOUND ? "no public key for it in --zmq-curve-peers-file"
                                                        : "cannot set its CurveZMQ keys");
                        goto fail;
                }
        }
        if (zmq_connect(dealer, w->endpoint) != 0 || zmq_connect(sub, w->status_endpoint) != 0) {
                log_error("--worker %s: cannot connect: %s", spec, zmq_strerror(zmq_errno()));
                goto fail;
        }
        grown = realloc(p->workers, (p->n_workers + 1) * sizeof(*grown));
        if (!grown)
                goto fail;
        p->workers = grown;
        if (watch_socket(p, w, &w->dealer, dealer, false) != TSR_OK)
                goto fail;
        if (watch_socket(p, w, &w->sub, sub, true) != TSR_OK) {
                /* the dealer's poll handle is open: close it through the pool later */
                p->workers[p->n_workers++] = w;
                zmq_close(sub);
                w->sub.sock = NULL;
                return TSR_E_INTERNAL;
        }
        p->workers[p->n_workers++] = w;
        log_info("worker %s (status %s) added", w->endpoint, w->status_endpoint);
        send_hello(w);
        return TSR_OK;
fail:
        if (dealer)
                zmq_close(dealer);
        if (sub)
                zmq_close(sub);
        free(w->endpoint);
        free(w->status_endpoint);
        free(w);
        return TSR_E_INVAL;
}

tsr_status tsr_worker_pool_new(uv_loop_t *loop, const char *router_id, tsr_worker_pool **ret) {
        tsr_worker_pool *p = calloc(1, sizeof(*p));
        if (!p)
                return TSR_E_NOMEM;
        p->loop = loop;
        snprintf(p->router_id, sizeof(p->router_id), "%s", router_id);
        p->zctx = zmq_ctx_new();
        if (!p->zctx) {
                free(p);
                return TSR_E_INTERNAL;
        }
        uv_timer_init(loop, &p->tick);
        uv_idle_init(loop, &p->kick);
        p->tick.data = p;
        p->kick.data = p;
        p->open_handles = 2;
        uv_timer_start(&p->tick, on_tick, TICK_MS, TICK_MS);
        *ret = p;
        return TSR_OK;
}

void tsr_worker_pool_set_curve(tsr_worker_pool *p, const tsr_curve *curve) { p->curve = curve; }

/* Sockets, messages and memory of a worker whose poll handles are closed (or never
 * opened). */
static void worker_free(tsr_worker *w) {
        if (w->dealer.sock)
                zmq_close(w->dealer.sock);
        if (w->sub.sock)
                zmq_close(w->sub.sock);
        tsr_wire_free(w->info);
        tsr_wire_free(w->tokenizer_env);
        tsr_wire_free(w->status);
        tsr_prefix_mirror_done(&w->mirror);
        free(w->endpoint);
        free(w->status_endpoint);
        free(w);
}

static void on_handle_closed(uv_handle_t *h) {
        tsr_worker_pool *p = h->data;
        if (h->type == UV_POLL) {
                tsr_worker *w = ((zsock_watch *)h->data)->owner;
                p = w->pool;
                /* A removed worker's sockets close only now: libuv must not poll an fd
                 * that is gone, and the handle's memory (inside w) lives until here. */
                if (w->removed && --w->closing == 0)
                        worker_free(w);
        }
        if (--p->open_handles == 0 && p->closed_cb)
                p->closed_cb(p->closed_ud);
}

/* Loop thread, from the tick.  Out of the array first, so that nothing iterating the
 * pool (drain_all, placement, /metrics) sees it again; then the request layer drops
 * its pointers; then the handles close and on_handle_closed frees the rest. */
static void remove_worker(tsr_worker_pool *p, size_t idx) {
        tsr_worker *w = p->workers[idx];

        memmove(p->workers + idx, p->workers + idx + 1, (p->n_workers - idx - 1) * sizeof(*p->workers));
        p->n_workers--;
        log_info("worker %s removed from the pool (retired, no requests in flight)", w->endpoint);
        if (p->ev.on_worker_removed)
                p->ev.on_worker_removed(p->ev.ud, w);
        w->removed = true;
        if (w->dealer.sock) {
                w->closing++;
                uv_close((uv_handle_t *)&w->dealer.poll, on_handle_closed);
        }
        if (w->sub.sock) {
                w->closing++;
                uv_close((uv_handle_t *)&w->sub.poll, on_handle_closed);
        }
        if (w->closing == 0)
                worker_free(w);
}

void tsr_worker_pool_close(tsr_worker_pool *p, void (*done)(void *ud), void *ud) {
        p->closed_cb = done;
        p->closed_ud = ud;
        uv_close((uv_handle_t *)&p->tick, on_handle_closed);
        uv_close((uv_handle_t *)&p->kick, on_handle_closed);
        for (size_t i = 0; i < p->n_workers; i++) {
                tsr_worker *w = p->workers[i];
                /* Stop watching before the socket (and its fd) goes away. */
                if (w->dealer.sock)
                        uv_close((uv_handle_t *)&w->dealer.poll, on_handle_closed);
                if (w->sub.sock)
                        uv_close((uv_handle_t *)&w->sub.poll, on_handle_closed);
        }
}

void tsr_worker_pool_free(tsr_worker_pool **pp) {
        tsr_worker_pool *p;
        if (!pp || !*pp)
                return;
        p = *pp;
        for (size_t i = 0; i < p->n_workers; i++)
                worker_free(p->workers[i]);
        free(p->workers);
        zmq_ctx_term(p->zctx);
        free(p);
        *pp = NULL;
}
