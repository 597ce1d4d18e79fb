/* comm.c - the process-group interface: argument checks, the sticky error, group
 * batching for the CPU backends, and the reference reduction tree (comm.h). */
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "worker/parallel/comm_impl.h"

/* Elements per block of tsr_comm_tree_sum: the tree's intermediate levels live in a
 * stack buffer of TSR_COMM_MAX_RANKS / 2 blocks (8 KiB), small enough for any rank
 * thread's stack, large enough for the compiler to vectorise each level's adds. */
#define TREE_BLOCK 64

void tsr_comm_tree_sum(const float *const *parts, int n, float *out, size_t count) {
        float tmp[TSR_COMM_MAX_RANKS / 2][TREE_BLOCK];
        const float *lv[TSR_COMM_MAX_RANKS];

        for (size_t b = 0; b < count; b += TREE_BLOCK) {
                size_t len = count - b < TREE_BLOCK ? count - b : TREE_BLOCK;
                int m = n;
                for (int i = 0; i < n; i++)
                        lv[i] = parts[i] + b;
                /* One level: pair 2i with 2i+1 into tmp[i]; an odd last entry moves up as is.
                 * tmp[k] is written only after lv[2k] and lv[2k+1] were read, and entries
                 * below 2k are consumed already, so the levels can share tmp. */
                while (m > 1) {
                        int k = 0;
                        for (int i = 0; i + 1 < m; i += 2, k++) {
                                const float *l = lv[i], *r = lv[i + 1];
                                float *d = tmp[k];
                                for (size_t e = 0; e < len; e++)
                                        d[e] = l[e] + r[e];
                                lv[k] = d;
                        }
                        if (m & 1)
                                lv[k++] = lv[m - 1];
                        m = k;
                }
                /* Every part's block is read by now: `out` may alias one of them. */
                if (lv[0] != out + b)
                        memmove(out + b, lv[0], len * sizeof(float));
        }
}

tsr_status tsr_comm_fail(tsr_comm *c, tsr_status st) {
        int expected = TSR_OK;
        atomic_compare_exchange_strong_explicit(&c->failed, &expected, (int)st, memory_order_acq_rel,
                                                memory_order_acquire);
        return tsr_comm_failed(c);
}

tsr_status tsr_comm_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen) {
        tsr_comm *c = NULL;
        tsr_status st;

        if (!d || !ret) {
                tsr_errf(err, errlen, "comm: no description");
                return TSR_E_INVAL;
        }
        if (d->size < 1 || d->size > TSR_COMM_MAX_RANKS) {
                if (d->backend == TSR_COMM_BACKEND_ZMQ && d->zmq_listener)
                        tsr_comm_zmq_listener_free(d->zmq_listener);
                tsr_errf(err, errlen, "comm: group size %d out of range 1..%d", d->size, TSR_COMM_MAX_RANKS);
                return TSR_E_INVAL;
        }
        if (d->rank < 0 || d->rank >= d->size) {
                if (d->backend == TSR_COMM_BACKEND_ZMQ && d->zmq_listener)
                        tsr_comm_zmq_listener_free(d->zmq_listener);
                tsr_errf(err, errlen, "comm: rank %d out of range for group size %d", d->rank, d->size);
                return TSR_E_INVAL;
        }
        switch (d->backend) {
        case TSR_COMM_BACKEND_LOCAL: st = tsr_comm_local_new(d, &c, err, errlen); break;
        case TSR_COMM_BACKEND_ZMQ: st = tsr_comm_zmq_new(d, &c, err, errlen); break;
        case TSR_COMM_BACKEND_NCCL: st = tsr_comm_nccl_new(d, &c, err, errlen); break;
        default:
                tsr_errf(err, errlen, "comm: unknown backend %d", (int)d->backend);
                return TSR_E_INVAL;
        }
        if (st != TSR_OK)
                return st;
        c->rank = d->rank;
        c->size = d->size;
        c->timeout_ms = d->timeout_ms ? d->timeout_ms : TSR_COMM_TIMEOUT_MS_DEFAULT;
        *ret = c;
        return TSR_OK;
}

void tsr_comm_free(tsr_comm **cp) {
        tsr_comm *c = cp ? *cp : NULL;
        if (!c)
                return;
        *cp = NULL;
        free(c->group_ops);
        c->ops->destroy(c);
}

int tsr_comm_rank(const tsr_comm *c) { return c->rank; }
int tsr_comm_size(const tsr_comm *c) { return c->size; }
const char *tsr_comm_backend_name(const tsr_comm *c) { return c->ops->name; }

void tsr_comm_set_timeout(tsr_comm *c, uint32_t timeout_ms) {
        c->timeout_ms = timeout_ms ? timeout_ms : TSR_COMM_TIMEOUT_MS_DEFAULT;
}

static uint64_t deadline_of(const tsr_comm *c) { return tsr_deadline_ns(c->timeout_ms); }

/* Checks every call starts with: a usable comm and, for collectives, no open group. */
static tsr_status enter(tsr_comm *c, bool collective) {
        if (!c)
                return TSR_E_INVAL;
        tsr_status st = tsr_comm_failed(c);
        if (st != TSR_OK)
                return st;
        if (collective && c->group_depth > 0)
                return TSR_E_INVAL;
        return TSR_OK;
}

tsr_status tsr_comm_all_reduce_sum(tsr_comm *c, float *buf, size_t count, void *stream) {
        tsr_status st = enter(c, true);
        if (st != TSR_OK)
                return st;
        if ((!buf && count) || count > SIZE_MAX / sizeof(float) / 2)
                return TSR_E_INVAL;
        return c->ops->all_reduce_sum(c, buf, count, stream, deadline_of(c));
}

tsr_status tsr_comm_all_gather(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream) {
        tsr_status st = enter(c, true);
        if (st != TSR_OK)
                return st;
        if (((!in || !out) && bytes) || bytes > SIZE_MAX / 2 / (size_t)c->size)
                return TSR_E_INVAL;
        return c->ops->all_gather(c, in, out, bytes, stream, deadline_of(c));
}

tsr_status tsr_comm_broadcast(tsr_comm *c, void *buf, size_t bytes, int root, void *stream) {
        tsr_status st = enter(c, true);
        if (st != TSR_OK)
                return st;
        if ((!buf && bytes) || root < 0 || root >= c->size || bytes > SIZE_MAX / 2)
                return TSR_E_INVAL;
        return c->ops->broadcast(c, buf, bytes, root, stream, deadline_of(c));
}

tsr_status tsr_comm_barrier(tsr_comm *c) {
        tsr_status st = enter(c, true);
        if (st != TSR_OK)
                return st;
        return c->ops->barrier(c, deadline_of(c));
}

static tsr_status p2p_check(const tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag) {
        if ((!buf && bytes) || peer < 0 || peer >= c->size || peer == c->rank || tag > TSR_COMM_TAG_MAX ||
            bytes > SIZE_MAX / 2)
                return TSR_E_INVAL;
        return TSR_OK;
}

/* Inside a group the CPU backends only record the op; group_end runs it. */
static tsr_status group_add(tsr_comm *c, bool is_send, void *buf, size_t bytes, int peer, uint64_t tag,
                            void *stream) {
        if (!c->group_ops) {
                c->group_ops = calloc(TSR_COMM_GROUP_MAX_OPS, sizeof(*c->group_ops));
                if (!c->group_ops)
                        return TSR_E_NOMEM;
        }
        if (c->n_group_ops >= TSR_COMM_GROUP_MAX_OPS)
                return TSR_E_LIMIT;
        c->group_ops[c->n_group_ops++] = (tsr_comm_group_op){
                .is_send = is_send, .buf = buf, .bytes = bytes, .peer = peer, .tag = tag, .stream = stream};
        return TSR_OK;
}

/* send and recv: the same checks, then recorded (inside a CPU group) or run. */
static tsr_status p2p(tsr_comm *c, bool is_send, void *buf, size_t bytes, int peer, uint64_t tag, void *stream) {
        tsr_status st = enter(c, false);
        if (st != TSR_OK)
                return st;
        if ((st = p2p_check(c, buf, bytes, peer, tag)) != TSR_OK)
                return st;
        if (c->group_depth > 0 && !c->ops->group_begin)
                return group_add(c, is_send, buf, bytes, peer, tag, stream);
        return is_send ? c->ops->send(c, buf, bytes, peer, tag, stream, deadline_of(c))
                       : c->ops->recv(c, buf, bytes, peer, tag, stream, deadline_of(c));
}

tsr_status tsr_comm_send(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream) {
        return p2p(c, true, (void *)buf, bytes, peer, tag, stream);
}

tsr_status tsr_comm_recv(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream) {
        return p2p(c, false, buf, bytes, peer, tag, stream);
}

tsr_status tsr_comm_group_begin(tsr_comm *c) {
        tsr_status st = enter(c, false);
        if (st != TSR_OK)
                return st;
        if (c->ops->group_begin && (st = c->ops->group_begin(c)) != TSR_OK)
                return st;
        c->group_depth++;
        return TSR_OK;
}

/* CPU backends: every send first (they copy and never wait for the receiver), then every
 * recv, in the order they were added; one deadline for the whole group. */
static tsr_status group_run(tsr_comm *c, uint64_t deadline) {
        tsr_status st = TSR_OK;
        for (int pass = 0; pass < 2 && st == TSR_OK; pass++)
                for (int i = 0; i < c->n_group_ops && st == TSR_OK; i++) {
                        tsr_comm_group_op *op = &c->group_ops[i];
                        if (op->is_send != (pass == 0))
                                continue;
                        st = op->is_send ? c->ops->send(c, op->buf, op->bytes, op->peer, op->tag, op->stream, deadline)
                                         : c->ops->recv(c, op->buf, op->bytes, op->peer, op->tag, op->stream, deadline);
                }
        c->n_group_ops = 0;
        return st;
}

tsr_status tsr_comm_group_end(tsr_comm *c) {
        if (!c || c->group_depth == 0)
                return TSR_E_INVAL;
        if (--c->group_depth > 0)
                return TSR_OK;
        tsr_status st = tsr_comm_failed(c);
        if (st != TSR_OK) {
                c->n_group_ops = 0;
                return st;
        }
        if (c->ops->group_end)
                return c->ops->group_end(c, deadline_of(c));
        return group_run(c, deadline_of(c));
}

tsr_status tsr_comm_sync(tsr_comm *c, void *stream) {
        tsr_status st = enter(c, false);
        if (st != TSR_OK)
                return st;
        if (c->ops->sync)
                return c->ops->sync(c, stream, deadline_of(c));
        return tsr_comm_poll_error(c);
}

tsr_status tsr_comm_poll_error(tsr_comm *c) {
        if (!c)
                return TSR_E_INVAL;
        tsr_status st = tsr_comm_failed(c);
        if (st == TSR_OK && c->ops->poll_error)
                st = c->ops->poll_error(c);
        return st;
}

tsr_status tsr_comm_progress(tsr_comm *c) {
        if (!c)
                return TSR_E_INVAL;
        tsr_status st = tsr_comm_failed(c);
        if (st == TSR_OK && c->ops->progress)
                st = c->ops->progress(c);
        return st;
}

void tsr_comm_abort(tsr_comm *c) {
        if (!c)
                return;
        tsr_comm_fail(c, TSR_E_CANCELLED);
        c->ops->abort(c);
}
