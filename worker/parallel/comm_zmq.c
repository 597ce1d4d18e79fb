/* comm_zmq.c - the cross-process CPU backend over ZeroMQ (ranks in other processes or on
 * other nodes; pipeline stage-to-stage transfers).
 *
 * Sockets.  Each rank binds one ROUTER at its endpoint and connects one DEALER to every
 * peer's ROUTER.  Why this pattern and not one PAIR per edge:
 *   - one listening endpoint per rank is all the bootstrap has to hand out (PAIR would need
 *     a port per edge, and ZeroMQ documents PAIR over TCP as lacking reconnection);
 *   - every incoming message, from any peer, arrives on the one ROUTER, so a wait polls one
 *     socket for data and the sender is in the header (checked against the group);
 *   - a DEALER per outgoing edge keeps per-peer FIFO order, and a peer that stops reading
 *     fills only its own DEALER's queue (bounded by ZMQ_SNDHWM): the others keep moving;
 *   - a socket monitor on each DEALER reports ZMQ_EVENT_DISCONNECTED for exactly that peer,
 *     which is how a kill -9 becomes TSR_E_CLOSED within LOST_GRACE_NS rather than a
 *     timeout; ZMTP heartbeats (1 s, 5 s timeout) turn a silent peer (a dead host) into a
 *     disconnect too.
 * ZeroMQ copies on receive, and that is the price of reusing the dependency and its
 * reconnect/heartbeat machinery; the data plane of a large deployment may move to plain
 * TCP or NCCL later behind the same tsr_comm interface (reference/distributed.md, 5b).
 *
 * Frames.  One frame per message (no multipart, so ZeroMQ's high-water mark can never split
 * one): a 48-byte little-endian header {magic "TSRC", version, kind, op, src, size, epoch,
 * tag, total, bytes} and the payload.  kind: HELLO (once per edge at init: same size and
 * epoch, else refused), DATA, ABORT (a peer called tsr_comm_abort), BYE (a peer freed its
 * comm cleanly: a later wait for its data is TSR_E_CLOSED, its disconnect no error).  A
 * frame that does not
 * parse, claims a sender outside the group or carries another epoch is dropped (logged
 * once per comm), never trusted.  Tags with the top bit set are the collectives':
 * (1 << 63) | sequence << 4 | phase, the sequence counted per rank (every rank calls the
 * collectives in the same order).
 *
 * Progress.  There is no background thread: the rank thread drives the sockets inside
 * every call.  A send that finds its DEALER full polls for room while it drains the
 * ROUTER into the inbox (messages received ahead of their recv, capped at
 * zmq_max_buffered bytes: TSR_E_LIMIT), so two ranks sending to each other never
 * deadlock.  tsr_comm_abort from another thread writes an eventfd that every poll
 * watches.
 *
 * Collectives, with the same bits as the local backend:
 *   all_reduce_sum  phase 1: rank r sends slice q of its buffer to rank q and sums the n
 *                   copies of its slice r with tsr_comm_tree_sum (rank order); phase 2:
 *                   it sends its reduced slice to every rank.  Each rank sends and
 *                   receives 2 (n-1)/n of the buffer.
 *   all_gather      every rank sends its input to every other.
 *   broadcast       the root sends to every other rank.
 *   barrier         an empty message to and from every rank.
 * Every message of a collective carries its op and total size; a receiver that finds
 * another one drains the collective's messages and answers TSR_E_INVAL.  For
 * all_reduce/all_gather/barrier every rank receives from every other, so if the ranks
 * disagree every one of them sees it and the collective sequence stays aligned. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/parallel/comm_impl.h"

#define HDR_BYTES 48
#define HDR_MAGIC 0x43525354u            /* "TSRC" little-endian */
#define HDR_VERSION 1
#define ZMQ_HWM 256
#define ZMQ_HEARTBEAT_MS 1000
#define ZMQ_HEARTBEAT_TIMEOUT_MS 5000
#define DEFAULT_MAX_BUFFERED ((size_t)1 << 30)
/* A disconnect is a lost peer only if no BYE follows within this time: the BYE and the
 * disconnect travel on different connections, so a peer that left cleanly can be seen
 * disconnecting before its BYE (and its last data) has been read. */
#define LOST_GRACE_NS (200ull * 1000000ull)

enum frame_kind { FRAME_HELLO = 1, FRAME_DATA = 2, FRAME_ABORT = 3, FRAME_BYE = 4 };
enum frame_op { OP_P2P = 0, OP_ALL_REDUCE = 1, OP_ALL_GATHER = 2, OP_BROADCAST = 3, OP_BARRIER = 4 };

typedef struct frame_hdr {
        uint32_t magic;
        uint8_t version, kind;
        uint16_t op;
        uint32_t src, size;
        uint64_t epoch, tag, total, bytes;
} frame_hdr;

typedef struct inbox_msg {
        struct inbox_msg *next;
        int src;
        uint16_t op;
        uint64_t tag, total;
        size_t bytes;
        zmq_msg_t msg;                   /* owns the payload */
} inbox_msg;

struct tsr_comm_zmq_listener {
        void *ctx;
        void *router;
        char endpoint[256];
};

typedef struct zmq_comm {
        tsr_comm base;
        void *ctx;
        void *router;
        void *dealer[TSR_COMM_MAX_RANKS];
        void *mon[TSR_COMM_MAX_RANKS];   /* PAIR reading dealer[q]'s monitor */
        int wake_fd;                      /* eventfd: tsr_comm_abort from any thread */
        _Atomic int abort_req;
        bool abort_sent;
        bool hello_from[TSR_COMM_MAX_RANKS];
        bool bye_from[TSR_COMM_MAX_RANKS];       /* the peer freed its comm cleanly */
        uint64_t lost_at[TSR_COMM_MAX_RANKS];    /* when its DEALER disconnected, 0: never */
        uint64_t epoch;
        uint64_t coll_seq;
        inbox_msg *inbox;                /* oldest first */
        inbox_msg **inbox_tail;          /* the last next pointer (&inbox when empty) */
        size_t inbox_bytes, max_buffered;
        bool warned_garbage;
        char refused[160];               /* why the last hello was refused (init errors) */
} zmq_comm;

static const tsr_comm_ops zmq_ops;

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void hdr_write(unsigned char *p, const frame_hdr *h) {
        put32(p, h->magic);
        p[4] = h->version;
        p[5] = h->kind;
        memcpy(p + 6, &h->op, 2);
        put32(p + 8, h->src);
        put32(p + 12, h->size);
        put64(p + 16, h->epoch);
        put64(p + 24, h->tag);
        put64(p + 32, h->total);
        put64(p + 40, h->bytes);
}

static bool hdr_read(const unsigned char *p, size_t n, frame_hdr *h) {
        if (n < HDR_BYTES)
                return false;
        h->magic = get32(p);
        h->version = p[4];
        h->kind = p[5];
        memcpy(&h->op, p + 6, 2);
        h->src = get32(p + 8);
        h->size = get32(p + 12);
        h->epoch = get64(p + 16);
        h->tag = get64(p + 24);
        h->total = get64(p + 32);
        h->bytes = get64(p + 40);
        return h->magic == HDR_MAGIC && h->version == HDR_VERSION && h->bytes == n - HDR_BYTES &&
               h->kind >= FRAME_HELLO && h->kind <= FRAME_BYE;
}

static void set_int(void *s, int opt, int v) { zmq_setsockopt(s, opt, &v, sizeof(v)); }

/* ---- listener ---------------------------------------------------------------------- */

tsr_status tsr_comm_zmq_listener_new(const char *bind_endpoint, tsr_comm_zmq_listener **ret, char *err,
                                     size_t errlen) {
        if (!bind_endpoint || !ret) {
                tsr_errf(err, errlen, "comm zmq: no endpoint to bind");
                return TSR_E_INVAL;
        }
        tsr_comm_zmq_listener *l = calloc(1, sizeof(*l));
        if (!l)
                return TSR_E_NOMEM;
        size_t len = sizeof(l->endpoint);
        int64_t maxmsg = (int64_t)(DEFAULT_MAX_BUFFERED + HDR_BYTES);
        l->ctx = zmq_ctx_new();
        l->router = l->ctx ? zmq_socket(l->ctx, ZMQ_ROUTER) : NULL;
        if (!l->router)
                goto fail;
        set_int(l->router, ZMQ_LINGER, 0);
        set_int(l->router, ZMQ_RCVHWM, ZMQ_HWM);
        zmq_setsockopt(l->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        if (zmq_bind(l->router, bind_endpoint) != 0 ||
            zmq_getsockopt(l->router, ZMQ_LAST_ENDPOINT, l->endpoint, &len) != 0)
                goto fail;
        *ret = l;
        return TSR_OK;
fail:
        tsr_errf(err, errlen, "comm zmq: bind %s: %s", bind_endpoint, zmq_strerror(zmq_errno()));
        tsr_comm_zmq_listener_free(&l);
        return TSR_E_IO;
}

const char *tsr_comm_zmq_listener_endpoint(const tsr_comm_zmq_listener *l) { return l->endpoint; }

void tsr_comm_zmq_listener_free(tsr_comm_zmq_listener **lp) {
        tsr_comm_zmq_listener *l = lp ? *lp : NULL;
        if (!l)
                return;
        *lp = NULL;
        if (l->router)
                zmq_close(l->router);
        if (l->ctx)
                zmq_ctx_term(l->ctx);
        free(l);
}

/* ---- progress ---------------------------------------------------------------------- */

static tsr_status fail(zmq_comm *z, tsr_status st) { return tsr_comm_fail(&z->base, st); }

/* ABORT or BYE to every peer, best effort (never waits). */
static void send_to_peers(zmq_comm *z, uint8_t kind) {
        for (int q = 0; q < z->base.size; q++) {
                if (q == z->base.rank || !z->dealer[q])
                        continue;
                unsigned char h[HDR_BYTES];
                hdr_write(h, &(frame_hdr){.magic = HDR_MAGIC, .version = HDR_VERSION, .kind = kind,
                                          .src = (uint32_t)z->base.rank, .size = (uint32_t)z->base.size,
                                          .epoch = z->epoch});
                zmq_send(z->dealer[q], h, sizeof(h), ZMQ_DONTWAIT);
        }
}

static void send_aborts(zmq_comm *z) {
        if (z->abort_sent)
                return;
        z->abort_sent = true;
        send_to_peers(z, FRAME_ABORT);
}

static void garbage(zmq_comm *z, const char *why) {
        if (!z->warned_garbage)
                log_warn("comm zmq rank %d: dropped a frame (%s); later ones are dropped silently",
                         z->base.rank, why);
        z->warned_garbage = true;
}

/* Take one frame off the ROUTER (identity frame first).  false: nothing more to read. */
static bool read_one(zmq_comm *z) {
        zmq_msg_t id, m;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, z->router, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&id);
                return false;
        }
        bool more = zmq_msg_more(&id);
        zmq_msg_close(&id);
        if (!more) {
                garbage(z, "no data frame");
                return true;
        }
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->router, 0) < 0) {         /* parts of a message arrive together */
                zmq_msg_close(&m);
                return true;
        }
        if (zmq_msg_more(&m)) {                            /* not ours: drain and drop it all */
                garbage(z, "multipart");
                do {
                        zmq_msg_close(&m);
                        zmq_msg_init(&m);
                } while (zmq_msg_recv(&m, z->router, 0) >= 0 && zmq_msg_more(&m));
                zmq_msg_close(&m);
                return true;
        }
        frame_hdr h;
        if (!hdr_read(zmq_msg_data(&m), zmq_msg_size(&m), &h) || h.src >= (uint32_t)z->base.size ||
            h.src == (uint32_t)z->base.rank) {
                garbage(z, "bad header");
                zmq_msg_close(&m);
                return true;
        }
        if (h.epoch != z->epoch || h.size != (uint32_t)z->base.size) {
                snprintf(z->refused, sizeof(z->refused),
                         "rank %" PRIu32 " speaks for a group of %" PRIu32 " ranks, epoch %" PRIu64
                         " (ours: %d ranks, epoch %" PRIu64 ")",
                         h.src, h.size, h.epoch, z->base.size, z->epoch);
                garbage(z, z->refused);
                zmq_msg_close(&m);
                return true;
        }
        switch (h.kind) {
        case FRAME_HELLO:
                z->hello_from[h.src] = true;
                zmq_msg_close(&m);
                return true;
        case FRAME_ABORT:
                zmq_msg_close(&m);
                fail(z, TSR_E_CANCELLED);
                return true;
        case FRAME_BYE:
                z->bye_from[h.src] = true;
                zmq_msg_close(&m);
                return true;
        default:
                break;
        }
        inbox_msg *im = malloc(sizeof(*im));
        if (!im) {
                zmq_msg_close(&m);
                fail(z, TSR_E_NOMEM);
                return true;
        }
        *im = (inbox_msg){.src = (int)h.src, .op = h.op, .tag = h.tag, .total = h.total, .bytes = h.bytes};
        zmq_msg_init(&im->msg);
        zmq_msg_move(&im->msg, &m);
        zmq_msg_close(&m);
        *z->inbox_tail = im;
        z->inbox_tail = &im->next;
        z->inbox_bytes += im->bytes;
        if (z->inbox_bytes > z->max_buffered)
                fail(z, TSR_E_LIMIT);
        return true;
}

/* Read dealer q's monitor: a disconnect after the peer's hello starts the grace period
 * at whose end, without a BYE, the peer counts as lost (progress). */
static void read_monitor(zmq_comm *z, int q) {
        for (;;) {
                zmq_msg_t ev, addr;
                zmq_msg_init(&ev);
                if (zmq_msg_recv(&ev, z->mon[q], ZMQ_DONTWAIT) < 0) {
                        zmq_msg_close(&ev);
                        return;
                }
                uint16_t event = 0;
                if (zmq_msg_size(&ev) >= 2)
                        memcpy(&event, zmq_msg_data(&ev), 2);
                bool more = zmq_msg_more(&ev);
                zmq_msg_close(&ev);
                if (more) {
                        zmq_msg_init(&addr);
                        zmq_msg_recv(&addr, z->mon[q], 0);
                        zmq_msg_close(&addr);
                }
                if (event == ZMQ_EVENT_DISCONNECTED && z->hello_from[q] && !z->lost_at[q])
                        z->lost_at[q] = tsr_now_ns();
        }
}

/* One round: wait (until the deadline; UINT64_MAX with poll_only: not at all) for a
 * frame, a monitor event, an abort, or room on dealer[out_peer] (-1: none), and handle
 * what came.  Returns the sticky status. */
static tsr_status progress_round(zmq_comm *z, uint64_t deadline, int out_peer, bool poll_only) {
        zmq_pollitem_t items[2 + 2 * TSR_COMM_MAX_RANKS];
        int mon_of[2 + 2 * TSR_COMM_MAX_RANKS];
        int n = 0;
        items[n++] = (zmq_pollitem_t){.socket = z->router, .events = ZMQ_POLLIN};
        items[n++] = (zmq_pollitem_t){.fd = z->wake_fd, .events = ZMQ_POLLIN};
        for (int q = 0; q < z->base.size; q++)
                if (z->mon[q]) {
                        mon_of[n] = q;
                        items[n++] = (zmq_pollitem_t){.socket = z->mon[q], .events = ZMQ_POLLIN};
                }
        int out_item = -1;
        if (out_peer >= 0) {
                out_item = n;
                items[n++] = (zmq_pollitem_t){.socket = z->dealer[out_peer], .events = ZMQ_POLLOUT};
        }
        uint64_t now = tsr_now_ns(), wake = deadline;
        for (int q = 0; q < z->base.size; q++)
                if (z->lost_at[q] && !z->bye_from[q] && z->lost_at[q] + LOST_GRACE_NS < wake)
                        wake = z->lost_at[q] + LOST_GRACE_NS;
        long timeout_ms = poll_only || now >= wake ? 0 : (long)((wake - now + 999999) / 1000000);
        int rc = zmq_poll(items, n, timeout_ms);
        if (rc < 0 && zmq_errno() != EINTR)
                return fail(z, TSR_E_IO);
        if (atomic_load_explicit(&z->abort_req, memory_order_acquire)) {
                uint64_t v;
                if (read(z->wake_fd, &v, sizeof(v)) < 0) {
                        /* nothing pending: the flag is what counts */
                }
                fail(z, TSR_E_CANCELLED);
                send_aborts(z);
        }
        for (int i = 2; i < n; i++)
                if (i != out_item && (items[i].revents & ZMQ_POLLIN))
                        read_monitor(z, mon_of[i]);
        while (tsr_comm_failed(&z->base) == TSR_OK && read_one(z)) {
        }
        now = tsr_now_ns();
        for (int q = 0; q < z->base.size; q++)
                if (z->lost_at[q] && !z->bye_from[q] && now >= z->lost_at[q] + LOST_GRACE_NS)
                        fail(z, TSR_E_CLOSED);
        tsr_status st = tsr_comm_failed(&z->base);
        if (st == TSR_OK && !poll_only && tsr_now_ns() >= deadline)
                st = fail(z, TSR_E_TIMEOUT);
        return st;
}

static tsr_status progress(zmq_comm *z, uint64_t deadline, int out_peer) {
        return progress_round(z, deadline, out_peer, false);
}

static tsr_status zmq_progress_op(tsr_comm *c) { return progress_round((zmq_comm *)c, UINT64_MAX, -1, true); }

/* Send one frame to `peer`, waiting (bounded) for room while draining our ROUTER. */
static tsr_status zsend(zmq_comm *z, int peer, uint8_t kind, uint16_t op, uint64_t tag, uint64_t total,
                        const void *data, size_t bytes, uint64_t deadline) {
        zmq_msg_t m;
        if (zmq_msg_init_size(&m, HDR_BYTES + bytes) != 0)
                return TSR_E_NOMEM;
        unsigned char *p = zmq_msg_data(&m);
        hdr_write(p, &(frame_hdr){.magic = HDR_MAGIC, .version = HDR_VERSION, .kind = kind, .op = op,
                                  .src = (uint32_t)z->base.rank, .size = (uint32_t)z->base.size,
                                  .epoch = z->epoch, .tag = tag, .total = total, .bytes = bytes});
        if (bytes)
                memcpy(p + HDR_BYTES, data, bytes);
        tsr_status st = TSR_OK;
        for (;;) {
                if ((st = tsr_comm_failed(&z->base)) != TSR_OK)
                        break;
                if (zmq_msg_send(&m, z->dealer[peer], ZMQ_DONTWAIT) >= 0)
                        return TSR_OK;                     /* zmq owns the message now */
                if (zmq_errno() != EAGAIN && zmq_errno() != EINTR) {
                        st = fail(z, TSR_E_IO);
                        break;
                }
                if ((st = progress(z, deadline, peer)) != TSR_OK)
                        break;
        }
        zmq_msg_close(&m);
        return st;
}

/* Wait (bounded) for the oldest DATA message with (src, tag) and unlink it. */
static tsr_status wait_msg(zmq_comm *z, int src, uint64_t tag, uint64_t deadline, inbox_msg **ret) {
        for (;;) {
                tsr_status st = tsr_comm_failed(&z->base);
                if (st != TSR_OK)
                        return st;
                for (inbox_msg **p = &z->inbox; *p; p = &(*p)->next)
                        if ((*p)->src == src && (*p)->tag == tag) {
                                inbox_msg *m = *p;
                                *p = m->next;
                                if (z->inbox_tail == &m->next)
                                        z->inbox_tail = p;
                                z->inbox_bytes -= m->bytes;
                                *ret = m;
                                return TSR_OK;
                        }
                /* Everything a peer sent comes before its BYE on the same connection. */
                if (z->bye_from[src])
                        return fail(z, TSR_E_CLOSED);
                if ((st = progress(z, deadline, -1)) != TSR_OK)
                        return st;
        }
}

static void msg_free(inbox_msg *m) {
        if (!m)
                return;
        zmq_msg_close(&m->msg);
        free(m);
}

static const void *msg_payload(inbox_msg *m) { return (const unsigned char *)zmq_msg_data(&m->msg) + HDR_BYTES; }

/* ---- operations -------------------------------------------------------------------- */

static uint64_t coll_tag(zmq_comm *z, int phase) { return TSR_COMM_TAG_COLL | (z->coll_seq << 4) | (uint64_t)phase; }

static tsr_status zmq_send_op(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                              uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        if (bytes > z->max_buffered)
                return TSR_E_INVAL;
        return zsend(z, peer, FRAME_DATA, OP_P2P, tag, bytes, buf, bytes, deadline);
}

static tsr_status zmq_recv_op(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                              uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        inbox_msg *m = NULL;
        tsr_status st = wait_msg(z, peer, tag, deadline, &m);
        if (st != TSR_OK)
                return st;
        st = m->op == OP_P2P && m->bytes == bytes ? TSR_OK : TSR_E_INVAL;
        if (st == TSR_OK && bytes)
                memcpy(buf, msg_payload(m), bytes);
        msg_free(m);
        return st;
}

/* Send `data` (bytes_of(q) at offset off_of(q)) to every other rank, for one phase. */
static tsr_status send_to_all(zmq_comm *z, uint16_t op, uint64_t tag, uint64_t total, const void *data,
                              size_t bytes, uint64_t deadline) {
        for (int q = 0; q < z->base.size; q++) {
                if (q == z->base.rank)
                        continue;
                tsr_status st = zsend(z, q, FRAME_DATA, op, tag, total, data, bytes, deadline);
                if (st != TSR_OK)
                        return st;
        }
        return TSR_OK;
}

/* Receive one collective message from every other rank into msgs[q]; a message of another
 * op or total, or of another size than want_bytes[q], makes the result TSR_E_INVAL (after
 * all of them were taken, so the sequence stays aligned). */
static tsr_status recv_from_all(zmq_comm *z, uint16_t op, uint64_t tag, uint64_t total, const size_t *want_bytes,
                                inbox_msg **msgs, uint64_t deadline) {
        bool agree = true;
        for (int q = 0; q < z->base.size; q++)
                msgs[q] = NULL;                          /* the caller frees them all, also on error */
        for (int q = 0; q < z->base.size; q++) {
                if (q == z->base.rank)
                        continue;
                tsr_status st = wait_msg(z, q, tag, deadline, &msgs[q]);
                if (st != TSR_OK)
                        return st;
                if (msgs[q]->op != op || msgs[q]->total != total || msgs[q]->bytes != want_bytes[q])
                        agree = false;
        }
        return agree ? TSR_OK : TSR_E_INVAL;
}

static void free_all(inbox_msg **msgs, int n) {
        for (int q = 0; q < n; q++)
                msg_free(msgs[q]);
}

static tsr_status zmq_all_reduce(tsr_comm *c, float *buf, size_t count, void *stream, uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        int n = c->size, me = c->rank;
        inbox_msg *msgs[TSR_COMM_MAX_RANKS];
        size_t want[TSR_COMM_MAX_RANKS] = {0}, lo[TSR_COMM_MAX_RANKS] = {0}, hi[TSR_COMM_MAX_RANKS] = {0};
        uint64_t t1 = coll_tag(z, 1), t2 = coll_tag(z, 2);
        tsr_status st = TSR_OK;

        z->coll_seq++;
        for (int q = 0; q < n; q++)
                tsr_comm_slice(count, n, q, &lo[q], &hi[q]);
        /* Phase 1: slice q to rank q; the n copies of our slice, summed in rank order. */
        for (int q = 0; q < n && st == TSR_OK; q++)
                if (q != me)
                        st = zsend(z, q, FRAME_DATA, OP_ALL_REDUCE, t1, count, buf + lo[q],
                                   (hi[q] - lo[q]) * sizeof(float), deadline);
        if (st != TSR_OK)
                return st;
        for (int q = 0; q < n; q++)
                want[q] = (hi[me] - lo[me]) * sizeof(float);
        st = recv_from_all(z, OP_ALL_REDUCE, t1, count, want, msgs, deadline);
        float *aligned = NULL;
        if (st == TSR_OK) {
                /* ZeroMQ gives no alignment for a payload (it may sit at any offset of its
                 * receive buffer): a misaligned one is copied into a float array first. */
                const float *parts[TSR_COMM_MAX_RANKS];
                size_t len = hi[me] - lo[me];
                for (int q = 0; q < n && st == TSR_OK; q++) {
                        const void *p = q == me ? (const void *)(buf + lo[me]) : msg_payload(msgs[q]);
                        if ((uintptr_t)p % _Alignof(float) == 0) {
                                parts[q] = p;
                                continue;
                        }
                        if (!aligned && !(aligned = malloc((size_t)n * len * sizeof(float))))
                                st = fail(z, TSR_E_NOMEM);        /* the peers wait for phase 2 */
                        else {
                                memcpy(aligned + (size_t)q * len, p, len * sizeof(float));
                                parts[q] = aligned + (size_t)q * len;
                        }
                }
                if (st == TSR_OK)
                        tsr_comm_tree_sum(parts, n, buf + lo[me], len);
        }
        free(aligned);
        free_all(msgs, n);
        if (st != TSR_OK)
                return st;
        /* Phase 2: our reduced slice to everyone, theirs into place. */
        st = send_to_all(z, OP_ALL_REDUCE, t2, count, buf + lo[me], (hi[me] - lo[me]) * sizeof(float), deadline);
        if (st != TSR_OK)
                return st;
        for (int q = 0; q < n; q++)
                want[q] = (hi[q] - lo[q]) * sizeof(float);
        st = recv_from_all(z, OP_ALL_REDUCE, t2, count, want, msgs, deadline);
        for (int q = 0; q < n && st == TSR_OK; q++)
                if (q != me && want[q])
                        memcpy(buf + lo[q], msg_payload(msgs[q]), want[q]);
        free_all(msgs, n);
        return st;
}

static tsr_status zmq_all_gather(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream,
                                 uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        int n = c->size, me = c->rank;
        inbox_msg *msgs[TSR_COMM_MAX_RANKS];
        size_t want[TSR_COMM_MAX_RANKS] = {0};
        uint64_t t1 = coll_tag(z, 1);

        z->coll_seq++;
        tsr_status st = send_to_all(z, OP_ALL_GATHER, t1, bytes, in, bytes, deadline);
        if (st != TSR_OK)
                return st;
        for (int q = 0; q < n; q++)
                want[q] = bytes;
        st = recv_from_all(z, OP_ALL_GATHER, t1, bytes, want, msgs, deadline);
        for (int q = 0; q < n && st == TSR_OK && bytes; q++) {
                unsigned char *dst = (unsigned char *)out + (size_t)q * bytes;
                if (q != me)
                        memcpy(dst, msg_payload(msgs[q]), bytes);
                else if (dst != in)
                        memmove(dst, in, bytes);
        }
        free_all(msgs, n);
        return st;
}

static tsr_status zmq_broadcast(tsr_comm *c, void *buf, size_t bytes, int root, void *stream, uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        uint64_t t1 = coll_tag(z, 1);
        z->coll_seq++;
        if (c->rank == root)
                return send_to_all(z, OP_BROADCAST, t1, bytes, buf, bytes, deadline);
        inbox_msg *m = NULL;
        tsr_status st = wait_msg(z, root, t1, deadline, &m);
        if (st != TSR_OK)
                return st;
        st = m->op == OP_BROADCAST && m->total == bytes && m->bytes == bytes ? TSR_OK : TSR_E_INVAL;
        if (st == TSR_OK && bytes)
                memcpy(buf, msg_payload(m), bytes);
        msg_free(m);
        return st;
}

static tsr_status zmq_barrier(tsr_comm *c, uint64_t deadline) {
        zmq_comm *z = (zmq_comm *)c;
        inbox_msg *msgs[TSR_COMM_MAX_RANKS];
        size_t want[TSR_COMM_MAX_RANKS] = {0};
        uint64_t t1 = coll_tag(z, 1);
        z->coll_seq++;
        tsr_status st = send_to_all(z, OP_BARRIER, t1, 0, NULL, 0, deadline);
        if (st != TSR_OK)
                return st;
        st = recv_from_all(z, OP_BARRIER, t1, 0, want, msgs, deadline);
        free_all(msgs, c->size);
        return st;
}

static void zmq_abort(tsr_comm *c) {
        zmq_comm *z = (zmq_comm *)c;
        atomic_store_explicit(&z->abort_req, 1, memory_order_release);
        uint64_t one = 1;
        if (write(z->wake_fd, &one, sizeof(one)) < 0) {
                /* the counter is saturated: a wakeup is pending already */
        }
}

static void zmq_destroy(tsr_comm *c) {
        zmq_comm *z = (zmq_comm *)c;
        bool clean = tsr_comm_failed(c) == TSR_OK;
        if (atomic_load(&z->abort_req) && z->router)
                send_aborts(z);
        else if (clean && z->router)
                send_to_peers(z, FRAME_BYE);
        for (int q = 0; q < c->size; q++) {
                if (z->mon[q]) {
                        zmq_socket_monitor(z->dealer[q], NULL, 0);
                        zmq_close(z->mon[q]);
                }
                if (z->dealer[q]) {
                        /* A clean shutdown lets queued frames reach a live peer (bounded);
                         * after a failure nothing is worth waiting for.  Aborts get 100 ms. */
                        set_int(z->dealer[q], ZMQ_LINGER, clean ? 2000 : z->abort_sent ? 100 : 0);
                        zmq_close(z->dealer[q]);
                }
        }
        if (z->router)
                zmq_close(z->router);
        if (z->ctx)
                zmq_ctx_term(z->ctx);
        for (inbox_msg *m = z->inbox, *next; m; m = next) {
                next = m->next;
                msg_free(m);
        }
        if (z->wake_fd >= 0)
                close(z->wake_fd);
        free(z);
}

static const tsr_comm_ops zmq_ops = {
        .name = "zmq",
        .all_reduce_sum = zmq_all_reduce,
        .all_gather = zmq_all_gather,
        .broadcast = zmq_broadcast,
        .send = zmq_send_op,
        .recv = zmq_recv_op,
        .barrier = zmq_barrier,
        .progress = zmq_progress_op,
        .abort = zmq_abort,
        .destroy = zmq_destroy,
};

/* Connect dealer[q] to endpoint `ep`, with a monitor for its disconnects. */
static tsr_status connect_peer(zmq_comm *z, int q, const char *ep, char *err, size_t errlen) {
        char mon_ep[96];
        snprintf(mon_ep, sizeof(mon_ep), "inproc://tsr-comm-%p-%d", (void *)z, q);
        z->dealer[q] = zmq_socket(z->ctx, ZMQ_DEALER);
        if (!z->dealer[q])
                goto fail;
        set_int(z->dealer[q], ZMQ_LINGER, 0);
        set_int(z->dealer[q], ZMQ_SNDHWM, ZMQ_HWM);
        set_int(z->dealer[q], ZMQ_RECONNECT_IVL, 100);
        set_int(z->dealer[q], ZMQ_HEARTBEAT_IVL, ZMQ_HEARTBEAT_MS);
        set_int(z->dealer[q], ZMQ_HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS);
        if (zmq_socket_monitor(z->dealer[q], mon_ep, ZMQ_EVENT_DISCONNECTED) != 0)
                goto fail;
        z->mon[q] = zmq_socket(z->ctx, ZMQ_PAIR);
        if (!z->mon[q] || zmq_connect(z->mon[q], mon_ep) != 0)
                goto fail;
        if (zmq_connect(z->dealer[q], ep) != 0)
                goto fail;
        return TSR_OK;
fail:
        tsr_errf(err, errlen, "comm zmq rank %d: connect to rank %d at %s: %s", z->base.rank, q, ep,
                 zmq_strerror(zmq_errno()));
        return zmq_errno() == EINVAL || zmq_errno() == EPROTONOSUPPORT ? TSR_E_INVAL : TSR_E_IO;
}

static bool all_hellos(const zmq_comm *z) {
        for (int q = 0; q < z->base.size; q++)
                if (q != z->base.rank && !z->hello_from[q])
                        return false;
        return true;
}

tsr_status tsr_comm_zmq_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen) {
        tsr_comm_zmq_listener *l = d->zmq_listener ? *d->zmq_listener : NULL;
        tsr_status st;
        if (d->zmq_listener)
                *d->zmq_listener = NULL;                   /* taken, also on failure */
        if (d->size > 1 && !d->endpoints) {
                tsr_comm_zmq_listener_free(&l);
                tsr_errf(err, errlen, "comm zmq: no endpoints for a group of %d ranks", d->size);
                return TSR_E_INVAL;
        }
        for (int q = 0; q < d->size && d->endpoints; q++)
                if (!d->endpoints[q] && (q != d->rank || !l)) {
                        tsr_comm_zmq_listener_free(&l);
                        tsr_errf(err, errlen, "comm zmq: no endpoint for rank %d", q);
                        return TSR_E_INVAL;
                }
        if (!l && (st = tsr_comm_zmq_listener_new(d->endpoints ? d->endpoints[d->rank] : "tcp://127.0.0.1:*", &l,
                                                  err, errlen)) != TSR_OK)
                return st;

        zmq_comm *z = calloc(1, sizeof(*z));
        if (!z) {
                tsr_comm_zmq_listener_free(&l);
                return TSR_E_NOMEM;
        }
        z->base.ops = &zmq_ops;
        z->base.rank = d->rank;
        z->base.size = d->size;
        atomic_init(&z->base.failed, TSR_OK);
        atomic_init(&z->abort_req, 0);
        z->inbox_tail = &z->inbox;
        z->ctx = l->ctx;
        z->router = l->router;
        free(l);                                           /* its ctx and socket are ours now */
        z->epoch = d->epoch;
        z->max_buffered = d->zmq_max_buffered ? d->zmq_max_buffered : DEFAULT_MAX_BUFFERED;
        int64_t maxmsg = (int64_t)(z->max_buffered + HDR_BYTES);
        zmq_setsockopt(z->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        z->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (z->wake_fd < 0) {
                tsr_errf(err, errlen, "comm zmq: eventfd: %s", strerror(errno));
                st = TSR_E_IO;
                goto fail;
        }
        for (int q = 0; q < d->size; q++)
                if (q != d->rank && (st = connect_peer(z, q, d->endpoints[q], err, errlen)) != TSR_OK)
                        goto fail;

        /* Hello on every edge, then wait for every peer's: the group is up when every rank
         * has heard from every other one. */
        uint64_t deadline = tsr_deadline_ns(d->timeout_ms ? d->timeout_ms : TSR_COMM_TIMEOUT_MS_DEFAULT);
        for (int q = 0; q < d->size; q++)
                if (q != d->rank && (st = zsend(z, q, FRAME_HELLO, 0, 0, 0, NULL, 0, deadline)) != TSR_OK)
                        goto fail_wait;
        for (int q = 0; q < d->size; q++)
                while (q != d->rank && !z->hello_from[q])
                        if ((st = progress(z, deadline, -1)) != TSR_OK)
                                goto fail_wait;
up:
        *ret = &z->base;
        return TSR_OK;
fail_wait:
        /* A peer that left init first may already be sending: the read that brought the
         * last hello can also overflow the inbox (or see the peer go).  The group did come
         * up; that failure is sticky and the first operation returns it. */
        if (all_hellos(z))
                goto up;
        if (st == TSR_E_TIMEOUT && z->refused[0])
                st = TSR_E_PROTO;              /* a peer answered, but for another group */
        for (int q = 0; q < d->size; q++)
                if (q != d->rank && !z->hello_from[q]) {
                        tsr_errf(err, errlen, "comm zmq rank %d: no hello from rank %d at %s (%s)%s%s", d->rank, q,
                                 d->endpoints[q], tsr_status_str(st), z->refused[0] ? "; refused: " : "",
                                 z->refused);
                        break;
                }
fail:
        tsr_comm_fail(&z->base, st);
        zmq_destroy(&z->base);
        return st;
}
