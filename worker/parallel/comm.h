/* comm.h - one interface for a process group of ranks (issue #20, the comm layer).
 *
 * A tsr_comm is one rank's handle on a group of `size` ranks.  Three backends behind the
 * same calls (reference/distributed.md, R1/R2):
 *   local  ranks are threads of one process; shared memory, pthread mutex + condvars.
 *   zmq    ranks are processes (other nodes, pipeline stages); one ZeroMQ ROUTER per rank
 *          plus one DEALER per outgoing peer edge, endpoints given explicitly.
 *   nccl   GPUs; only in builds that found the CUDA toolkit and NCCL (else
 *          TSR_E_UNSUPPORTED).  NCCL_* environment variables pass through untouched.
 *
 * Semantics, all backends:
 *   - Collectives (all_reduce_sum, all_gather, broadcast, barrier) are called by every rank
 *     of the group in the same order with the same sizes.  A size or kind mismatch between
 *     ranks is detected where the backend can see it (local: always; zmq: every rank for
 *     all_reduce/all_gather/barrier, the receivers for broadcast) and answered with
 *     TSR_E_INVAL on those ranks; nothing is written past any buffer.
 *   - all_reduce_sum is in place, float32, and its reduction order is fixed: element by
 *     element, the balanced pairwise tree over the ranks' buffers in rank order
 *     (tsr_comm_tree_sum below).  Every rank gets the same bits, equal to the serial
 *     reference tree, on the local and zmq backends alike.  NCCL's order is NCCL's own.
 *   - send/recv match on (peer, tag), FIFO per (peer, tag); a message with another tag is
 *     buffered until its recv comes (out-of-order tags).  CPU backends copy on send, so
 *     send returns once `buf` may be reused and never waits for the matching recv.
 *   - group_begin/group_end batch sends and recvs (NCCL group semantics): nothing moves
 *     until group_end, which runs them so that no op of the group blocks another (a
 *     stage's send to the next stage and recv from the previous one never deadlock).
 *     Buffers must stay valid until group_end returns.  Collectives inside a group are
 *     refused (TSR_E_INVAL).
 *   - Every wait is bounded: a call returns TSR_E_TIMEOUT at most timeout_ms after it was
 *     made.  TSR_E_TIMEOUT, TSR_E_CANCELLED (abort, here or on a peer), TSR_E_CLOSED (a
 *     peer process went away), TSR_E_PROTO and TSR_E_LIMIT are sticky: the group is
 *     unusable and every later call returns the same status; the caller frees the comm
 *     and the bootstrap builds a new group (epoch + 1).  TSR_E_INVAL from argument checks
 *     and mismatches is not sticky.
 *
 * Threads: a tsr_comm belongs to the thread of its rank (the rank thread of the worker):
 * every call except tsr_comm_abort, tsr_comm_poll_error, tsr_comm_rank, tsr_comm_size and
 * tsr_comm_backend_name is made from that thread only.  abort and poll_error may be called
 * from any thread (a watchdog, the io thread), but not from a signal handler, and never
 * concurrently with tsr_comm_free.
 *
 * R7 (bitwise TP invariance): with S = TSR_COMM_TREE_LEAVES canonical fp32 partials over
 * contiguous K slices, a rank of a group of size t (t a power of two dividing S) reduces
 * its S/t contiguous partials with tsr_comm_tree_sum and all-reduces the result: the
 * lower tree levels run on the rank, the upper ones in the all-reduce, and the sum is the
 * same bits for every t in {1, 2, 4, 8} (tests/unit/test_comm.c checks exactly this). */
#ifndef TSR_PARALLEL_COMM_H
#define TSR_PARALLEL_COMM_H

#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

#define TSR_COMM_MAX_RANKS 64
/* S of R7: the canonical number of fp32 partials of a row-parallel reduction. */
#define TSR_COMM_TREE_LEAVES 8
/* Tags at or above this value are reserved for the collectives' own messages. */
#define TSR_COMM_TAG_MAX ((UINT64_C(1) << 63) - 1)
#define TSR_COMM_TIMEOUT_MS_DEFAULT 30000u
#define TSR_COMM_NCCL_ID_BYTES 128

typedef enum tsr_comm_backend {
        TSR_COMM_BACKEND_LOCAL = 1,
        TSR_COMM_BACKEND_ZMQ = 2,
        TSR_COMM_BACKEND_NCCL = 3,
} tsr_comm_backend;

typedef struct tsr_comm tsr_comm;
/* The shared state of a local group: created once, handed to every rank thread. */
typedef struct tsr_comm_local_group tsr_comm_local_group;
/* A bound zmq data endpoint, made before the endpoints are exchanged. */
typedef struct tsr_comm_zmq_listener tsr_comm_zmq_listener;
/* ncclUniqueId's bytes, so callers need no NCCL header. */
typedef struct tsr_comm_nccl_id {
        unsigned char bytes[TSR_COMM_NCCL_ID_BYTES];
} tsr_comm_nccl_id;

typedef struct tsr_comm_desc {
        tsr_comm_backend backend;
        int rank;                          /* 0 <= rank < size */
        int size;                          /* 1 <= size <= TSR_COMM_MAX_RANKS */
        uint32_t timeout_ms;               /* bound of every wait; 0 = TSR_COMM_TIMEOUT_MS_DEFAULT */
        uint64_t epoch;                    /* group incarnation: zmq peers of another epoch are refused */
        /* local */
        tsr_comm_local_group *local;       /* borrowed; must outlive the comm */
        /* zmq: either a listener (taken: *zmq_listener is set to NULL, also on failure) or
         * endpoints[rank] is bound here.  endpoints[q] is where rank q listens, e.g.
         * "tcp://10.0.0.2:5601"; every endpoint but our own is connected to. */
        tsr_comm_zmq_listener **zmq_listener;
        const char *const *endpoints;      /* [size], borrowed for the call only */
        size_t zmq_max_buffered;           /* cap on bytes received ahead of their recv; 0 = 1 GiB */
        /* nccl */
        const tsr_comm_nccl_id *nccl_id;   /* the same id on every rank (tsr_comm_nccl_unique_id) */
        int cuda_device;                   /* local device ordinal of this rank */
} tsr_comm_desc;

/* Build this rank's comm.  local: returns at once; zmq: connects to every peer and
 * exchanges a hello (rank, size, epoch) with each, bounded by timeout_ms; nccl: a
 * non-blocking ncclCommInitRankConfig polled until done or timeout_ms (then
 * ncclCommAbort).  *ret is written only on success; `err` gets one line on failure.
 * Returns TSR_E_INVAL (bad desc), TSR_E_UNSUPPORTED (backend not built), TSR_E_TIMEOUT,
 * TSR_E_PROTO (a peer of another group/epoch), TSR_E_IO, TSR_E_NCCL, TSR_E_NOMEM.
 * zmq: a failure after every hello arrived (a peer already flooding this rank's inbox,
 * or gone) does not fail init: the group is up, and the first operation returns it.
 * The rank's thread. */
tsr_status tsr_comm_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen);
/* Free the comm (NULL is fine) and clear *c.  Other ranks are not told; their next wait
 * fails (zmq: TSR_E_CLOSED) or times out.  The rank's thread, after any thread that may
 * call tsr_comm_abort has stopped doing so. */
void tsr_comm_free(tsr_comm **c);

int tsr_comm_rank(const tsr_comm *c);
int tsr_comm_size(const tsr_comm *c);
const char *tsr_comm_backend_name(const tsr_comm *c);
/* Change the bound of the following waits (0 = default).  The rank's thread. */
void tsr_comm_set_timeout(tsr_comm *c, uint32_t timeout_ms);

/* In-place sum of `count` floats over the group, in the fixed tree order (above).  Each
 * rank passes its own buffer (local: distinct buffers).  `stream`: cudaStream_t for NCCL
 * (NULL = default stream; the op is enqueued, tsr_comm_sync waits), ignored on CPU. */
tsr_status tsr_comm_all_reduce_sum(tsr_comm *c, float *buf, size_t count, void *stream);
/* out[q * bytes .. (q+1) * bytes) = rank q's `in` (rank-major).  `in` may be
 * out + rank * bytes (in place). */
tsr_status tsr_comm_all_gather(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream);
/* Copy root's buf into every other rank's buf. */
tsr_status tsr_comm_broadcast(tsr_comm *c, void *buf, size_t bytes, int root, void *stream);
/* Point to point; tag <= TSR_COMM_TAG_MAX.  recv of a message whose size differs from
 * `bytes` consumes it and returns TSR_E_INVAL. */
tsr_status tsr_comm_send(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream);
tsr_status tsr_comm_recv(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream);
/* Batch sends/recvs (may nest; the outermost end runs them).  At most
 * TSR_COMM_GROUP_MAX_OPS ops per group (TSR_E_LIMIT). */
#define TSR_COMM_GROUP_MAX_OPS 1024
tsr_status tsr_comm_group_begin(tsr_comm *c);
tsr_status tsr_comm_group_end(tsr_comm *c);
/* Every rank has reached the barrier (or an error). */
tsr_status tsr_comm_barrier(tsr_comm *c);
/* NCCL: wait, bounded, until `stream` has run every enqueued op (polling the comm's async
 * error); CPU backends: ops are complete on return, so this is tsr_comm_poll_error. */
tsr_status tsr_comm_sync(tsr_comm *c, void *stream);
/* The sticky error, or TSR_OK.  Any thread.  Errors a backend finds only while it polls
 * (zmq: a lost peer; nccl: ncclCommGetAsyncError) become sticky inside the rank thread's
 * calls, so another thread sees them once the rank thread has made one. */
tsr_status tsr_comm_poll_error(tsr_comm *c);
/* Drive the backend without waiting and return the sticky status: zmq reads what has
 * arrived (buffered for its recv) and its peers' disconnects, so a peer killed while
 * this rank had nothing to send or receive becomes TSR_E_CLOSED at a later call (a
 * disconnect counts once its grace has passed without a BYE: 0.2 s); the other backends
 * only report the sticky status.  The rank's thread (an idle rank polls with it). */
tsr_status tsr_comm_progress(tsr_comm *c);
/* Fail the group: every wait of this rank (local: of every rank of the group) returns
 * TSR_E_CANCELLED promptly, and so does every later call; zmq tells the peers too (their
 * waits fail with TSR_E_CANCELLED); nccl: the rank thread calls ncclCommAbort in the wait
 * it is in, else in tsr_comm_free (ncclCommAbort frees the communicator, so no other
 * thread may call it).  Any thread; idempotent. */
void tsr_comm_abort(tsr_comm *c);

/* The reference reduction: out[e] = balanced pairwise tree over parts[0..n)[e] in index
 * order: level by level, parts 2i and 2i+1 are added (left + right) and an odd last one
 * moves up unchanged, so n = 4 gives (p0 + p1) + (p2 + p3) and n = 3 gives (p0 + p1) + p2.
 * `out` may be one of the parts (element e of every part is read before out[e] is
 * written).  1 <= n <= TSR_COMM_MAX_RANKS.  Pure; any thread. */
void tsr_comm_tree_sum(const float *const *parts, int n, float *out, size_t count);

/* The local group shared by `size` rank threads of this process.  Reference counted: the
 * creator holds one reference and each comm made on it another, so the creator may drop
 * its reference (tsr_comm_local_group_unref) while ranks still run.  Any thread. */
tsr_status tsr_comm_local_group_new(int size, tsr_comm_local_group **ret);
void tsr_comm_local_group_unref(tsr_comm_local_group **g);

/* Bind a zmq data endpoint ("tcp://127.0.0.1:*" picks a free port).  The endpoint to give
 * to the peers (with the port chosen) is tsr_comm_zmq_listener_endpoint.  The listener
 * then goes into tsr_comm_desc.zmq_listener.  The rank's thread. */
tsr_status tsr_comm_zmq_listener_new(const char *bind_endpoint, tsr_comm_zmq_listener **ret,
                                     char *err, size_t errlen);
const char *tsr_comm_zmq_listener_endpoint(const tsr_comm_zmq_listener *l);
void tsr_comm_zmq_listener_free(tsr_comm_zmq_listener **l);

/* ncclGetUniqueId: called once per group by its leader, whose process must stay alive
 * until every rank has joined (the id names a bootstrap socket it listens on).  Works
 * without a GPU.  TSR_E_UNSUPPORTED in builds without NCCL, TSR_E_NCCL otherwise. */
tsr_status tsr_comm_nccl_unique_id(tsr_comm_nccl_id *ret, char *err, size_t errlen);
/* Whether this build has the NCCL backend. */
int tsr_comm_nccl_available(void);

#endif
