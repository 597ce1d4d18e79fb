/* worker_link.h - the router's view of its workers, over ZeroMQ, on the libuv loop.
 *
 * Per worker: a DEALER connected to the worker's ROUTER (Hello/Submit/Abort out;
 * ModelInfo/Output/Error in) and a SUB connected to its Status PUB.  Both sockets are
 * owned by the loop thread; their ZMQ_FDs are watched with uv_poll and drained while
 * ZMQ_EVENTS says POLLIN, and every send is followed by a re-check (the fd is
 * edge-triggered: docs/architecture.md says why this design and not a zmq thread).
 *
 * A worker is live when its ModelInfo has arrived and its last Status is younger than
 * 3 of its status intervals.  When a Status shows a new boot_epoch (the worker
 * restarted) the router forgets the old ModelInfo and says Hello again. */
#ifndef TSR_ROUTER_WORKER_LINK_H
#define TSR_ROUTER_WORKER_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/wire.h"
#include "hashset.h"

typedef struct tsr_worker_pool tsr_worker_pool;
typedef struct tsr_worker tsr_worker;

/* What the pool reports to the request layer (loop thread).  Each callback borrows
 * the message for the duration of the call. */
typedef struct worker_events {
        void (*on_output)(void *ud, tsr_worker *w, const Tessera__V1__RequestOutput *out);
        /* One engine step's Output (this router's share of it), before its
         * RequestOutputs go to on_output one by one. */
        void (*on_step)(void *ud, tsr_worker *w, const Tessera__V1__Output *out);
        void (*on_error)(void *ud, tsr_worker *w, const Tessera__V1__Error *err);
        /* The worker stopped being live (no Status within 3 intervals, or restarted):
         * requests in flight there will get no more Outputs. */
        void (*on_worker_down)(void *ud, tsr_worker *w);
        /* A ModelInfo arrived (new worker, or the same one after a restart). */
        void (*on_model_info)(void *ud, tsr_worker *w, const Tessera__V1__ModelInfo *mi);
        /* Every Status of a worker whose ModelInfo is known. */
        void (*on_status)(void *ud, tsr_worker *w, const Tessera__V1__Status *st);
        /* How many of this router's requests are in flight on w.  A retired worker
         * (tsr_worker_pool_retire) is removed only at 0.  NULL: always 0. */
        size_t (*in_flight)(void *ud, const tsr_worker *w);
        /* w is leaving the pool (retired, nothing in flight): drop every pointer to it.
         * It is freed after this call, once its sockets' poll handles have closed. */
        void (*on_worker_removed)(void *ud, tsr_worker *w);
        void *ud;
} worker_events;

/* Loop thread.  `router_id` becomes every DEALER's routing id (copied). */
tsr_status tsr_worker_pool_new(uv_loop_t *loop, const char *router_id, tsr_worker_pool **ret);
/* CurveZMQ for every worker added after this call (common/zmq_curve.h); borrowed,
 * must outlive the pool.  NULL or disabled: plain TCP. */
struct tsr_curve;
void tsr_worker_pool_set_curve(tsr_worker_pool *p, const struct tsr_curve *curve);
/* Add a worker by spec "tcp://HOST:PORT" (Status on PORT+1) or
 * "tcp://HOST:PORT,tcp://HOST:SPORT".  Connects at once; TSR_E_INVAL on a bad spec. */
tsr_status tsr_worker_pool_add(tsr_worker_pool *p, const char *spec);
/* Close every socket and handle; `done` runs on the loop once all handles are closed. */
void tsr_worker_pool_close(tsr_worker_pool *p, void (*done)(void *ud), void *ud);
/* Route Outputs, Errors and liveness changes to the request layer. */
void tsr_worker_pool_set_events(tsr_worker_pool *p, const worker_events *ev);
/* Send one envelope to the worker (non-blocking).  TSR_E_UNAVAILABLE when the socket
 * cannot take it now (pipe full, no connection). */
tsr_status tsr_worker_send(tsr_worker *w, tsr_envelope *env);
/* After done ran.  Accepts NULL; clears *p. */
void tsr_worker_pool_free(tsr_worker_pool **p);

size_t tsr_worker_pool_count(const tsr_worker_pool *p);
tsr_worker *tsr_worker_pool_get(tsr_worker_pool *p, size_t i);
size_t tsr_worker_pool_num_live(const tsr_worker_pool *p);
/* The worker whose request endpoint is `endpoint` ("tcp://HOST:PORT"), NULL if none.
 * Borrowed: valid until the worker is removed (never hold it across loop callbacks). */
tsr_worker *tsr_worker_pool_find(tsr_worker_pool *p, const char *endpoint);
/* Loop thread.  Take w out of the pool gently (a --worker-dns address that left the
 * answer): from now on placement skips it (tsr_worker_accepting), and the pool's tick
 * removes it, with a log line and events.on_worker_removed, once events.in_flight says
 * none of our requests runs there: those finish, fail over when the worker dies, or
 * end at their deadline.  Idempotent. */
void tsr_worker_pool_retire(tsr_worker_pool *p, tsr_worker *w);
/* Loop thread.  Undo tsr_worker_pool_retire for a worker not removed yet (its address came
 * back).  No-op otherwise. */
void tsr_worker_pool_unretire(tsr_worker_pool *p, tsr_worker *w);
/* False once the worker is retired: place no new request there. */
bool tsr_worker_accepting(const tsr_worker *w);

const char *tsr_worker_endpoint(const tsr_worker *w);
bool tsr_worker_live(const tsr_worker *w);
/* The worker's ModelInfo, NULL until it arrived (borrowed; valid until the next loop
 * callback of the pool).  The tokenizer may come from an earlier ModelInfo with the
 * same hash when the worker omitted it. */
const Tessera__V1__ModelInfo *tsr_worker_model_info(const tsr_worker *w);
/* The ModelInfo whose tokenizer fields hold the bytes (the current one, or an earlier
 * one when the worker omitted them because we had them cached); NULL if none. */
const Tessera__V1__ModelInfo *tsr_worker_tokenizer(const tsr_worker *w);
/* The worker's last Status, NULL before the first. */
const Tessera__V1__Status *tsr_worker_status(const tsr_worker *w);
/* Loop thread.  The highest request id of this router's Submits that w's last Status
 * counts (its submit_acks entry for our routing id): true and *last_id set, or false
 * when that Status has none for us (no Status yet, an older worker, or we have not
 * been heard from since it started). */
bool tsr_worker_submit_ack(const tsr_worker *w, uint64_t *last_id);
/* Loop thread.  How many leading hashes of a request's block-hash chain the worker
 * has cached, by the router's mirror of its prefix cache (the Status events; cleared
 * after a lost Status or a restart, so it may under-report): counting stops at the
 * first miss, as the worker's prefix match does. */
size_t tsr_worker_prefix_hits(const tsr_worker *w, const uint64_t *hashes, size_t n);
/* Hashes in the mirror (diagnostics, tests). */
size_t tsr_worker_mirror_size(const tsr_worker *w);
/* Whether the mirror is the worker's whole cache (false until a snapshot after a late
 * join, a lost Status or a worker restart). */
bool tsr_worker_mirror_exact(const tsr_worker *w);

/* ---- the mirror itself: one per worker, owned by the loop thread ----
 *
 * The set of block hashes the worker's prefix cache can hit, rebuilt from the
 * BlockHashEvents of its Statuses applied in order (worker/engine/kv_cache.h: STORED adds,
 * REMOVED deletes, ALL_CLEARED empties).  The events are deltas, so when a Status
 * was lost (seq is not the last + 1: PUB/SUB drops past its high-water mark or while
 * reconnecting) or the worker restarted (boot_epoch changed) the mirror starts over
 * from empty.  Until it is exact again (below) the router asks the worker for a
 * snapshot (proto Resync: a replay of every cached block, docs/protocol.md), which arrives as ALL_CLEARED +
 * STORED events in a later Status; meanwhile it under-reports hits, which costs
 * affinity, never correctness.  At most min(kv_blocks_total, 2^24) hashes. */
typedef struct tsr_prefix_mirror {
        tsr_hashset set;
        uint64_t epoch;              /* boot_epoch of the Statuses applied */
        uint64_t seq;                /* seq of the last Status applied; 0 = none yet */
        uint64_t resets;             /* gaps and restarts seen */
        /* The set equals the worker's: it was rebuilt from a snapshot (an ALL_CLEARED
         * event, which a Resync asks for) or follows the worker's first Status, with
         * no gap since.  While false the router asks for a Resync. */
        bool exact;
        uint64_t resyncs_asked;
} tsr_prefix_mirror;

void tsr_prefix_mirror_init(tsr_prefix_mirror *m);
void tsr_prefix_mirror_done(tsr_prefix_mirror *m);
/* Apply one Status; true when it first reset the mirror (gap or restart). */
bool tsr_prefix_mirror_apply(tsr_prefix_mirror *m, const Tessera__V1__Status *s);
/* Leading hashes present, stopping at the first miss. */
size_t tsr_prefix_mirror_hits(const tsr_prefix_mirror *m, const uint64_t *hashes, size_t n);

#endif
