/* comm_local.c - the in-process backend: the ranks are threads of one worker.
 *
 * One mutex and one condition variable per group (CLOCK_MONOTONIC, so every wait has a
 * real deadline); groups are small (<= 8 ranks in practice), so one broadcast waking every
 * rank costs less than per-rank wakeups would save.  No spinning: on a 2-core machine the
 * rank threads are oversubscribed and a spinning waiter would steal the core of the rank
 * it waits for.
 *
 * A collective publishes each rank's arguments in its slot, then runs in phases separated
 * by a generation barrier; data moves between phases outside the lock (the barrier's
 * mutex orders the writes of one phase before the reads of the next):
 *   all_reduce_sum  A | check | rank r sums slice r of every rank's buffer with
 *                   tsr_comm_tree_sum into its own buffer | B | r copies slice q from
 *                   rank q's buffer | C          (reduce-scatter in tree order + all-gather)
 *   all_gather      A | check | r copies every rank's input | B
 *   broadcast       A | check | non-roots copy from the root | B
 *   barrier         A | check | B
 * The check compares every slot (kind, size, root, overlapping buffers): all ranks see the
 * same slots, so all of them answer a mismatch with TSR_E_INVAL, and none touches memory.
 * Point to point: a mailbox per destination rank; send copies the message in (waiting,
 * bounded, while the destination already holds LOCAL_MAIL_CAP bytes), recv takes the
 * oldest message with its (peer, tag).
 *
 * A timeout or an abort fails the whole group (every member's sticky status) and wakes
 * every waiter: the ranks of one worker live and die together. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "worker/parallel/comm_impl.h"

/* Bytes queued for one destination before send waits for its recvs: two 128k x 4096
 * fp32 activation pairs, far more than a pipeline keeps in flight. */
#define LOCAL_MAIL_CAP ((size_t)1 << 30)

enum coll_kind { COLL_NONE, COLL_ALL_REDUCE, COLL_ALL_GATHER, COLL_BROADCAST, COLL_BARRIER };

typedef struct local_msg {
        struct local_msg *next;
        int src;
        uint64_t tag;
        size_t bytes;
        unsigned char data[];
} local_msg;

typedef struct coll_slot {
        enum coll_kind kind;
        const void *in;
        void *out;
        size_t count;                    /* elements (all_reduce) or bytes */
        int root;
} coll_slot;

struct tsr_comm_local_group {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        _Atomic int refs;
        int size;
        /* Under mu: */
        tsr_status failed;
        uint64_t gen;                    /* barrier generation */
        int arrived;
        coll_slot slots[TSR_COMM_MAX_RANKS];
        tsr_comm *members[TSR_COMM_MAX_RANKS];
        local_msg *mail[TSR_COMM_MAX_RANKS];       /* per destination, oldest first */
        size_t mail_bytes[TSR_COMM_MAX_RANKS];
};

typedef struct local_comm {
        tsr_comm base;
        tsr_comm_local_group *g;
} local_comm;

static const tsr_comm_ops local_ops;

tsr_status tsr_comm_local_group_new(int size, tsr_comm_local_group **ret) {
        if (!ret || size < 1 || size > TSR_COMM_MAX_RANKS)
                return TSR_E_INVAL;
        tsr_comm_local_group *g = calloc(1, sizeof(*g));
        if (!g)
                return TSR_E_NOMEM;
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&g->cv, &ca);
        pthread_condattr_destroy(&ca);
        pthread_mutex_init(&g->mu, NULL);
        atomic_init(&g->refs, 1);
        g->size = size;
        *ret = g;
        return TSR_OK;
}

void tsr_comm_local_group_unref(tsr_comm_local_group **gp) {
        tsr_comm_local_group *g = gp ? *gp : NULL;
        if (!g)
                return;
        *gp = NULL;
        if (atomic_fetch_sub_explicit(&g->refs, 1, memory_order_acq_rel) != 1)
                return;
        for (int i = 0; i < g->size; i++)
                for (local_msg *m = g->mail[i], *next; m; m = next) {
                        next = m->next;
                        free(m);
                }
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g);
}

/* Fail the group: every member's sticky status, every waiter woken.  mu held. */
static tsr_status group_fail_locked(tsr_comm_local_group *g, tsr_status st) {
        if (g->failed == TSR_OK)
                g->failed = st;
        for (int i = 0; i < g->size; i++)
                if (g->members[i])
                        tsr_comm_fail(g->members[i], g->failed);
        pthread_cond_broadcast(&g->cv);
        return g->failed;
}

/* Wait until the condvar is signalled or the deadline passes: false on the deadline. */
static bool wait_until(tsr_comm_local_group *g, uint64_t deadline) {
        struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000ull),
                              .tv_nsec = (long)(deadline % 1000000000ull)};
        int rc = pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        return rc != ETIMEDOUT || tsr_now_ns() < deadline;
}

/* The generation barrier.  mu held.  TSR_OK once every rank arrived. */
static tsr_status barrier_locked(tsr_comm_local_group *g, uint64_t deadline) {
        if (g->failed != TSR_OK)
                return g->failed;
        uint64_t gen = g->gen;
        if (++g->arrived == g->size) {
                g->arrived = 0;
                g->gen++;
                pthread_cond_broadcast(&g->cv);
                return TSR_OK;
        }
        while (g->gen == gen && g->failed == TSR_OK)
                if (!wait_until(g, deadline) && g->gen == gen)
                        return group_fail_locked(g, TSR_E_TIMEOUT);
        return g->gen != gen ? TSR_OK : g->failed;
}

static tsr_status barrier(tsr_comm_local_group *g, uint64_t deadline) {
        pthread_mutex_lock(&g->mu);
        tsr_status st = barrier_locked(g, deadline);
        pthread_mutex_unlock(&g->mu);
        return st;
}

static bool overlap(const void *a, size_t na, const void *b, size_t nb) {
        uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
        return na && nb && x < y + nb && y < x + na;
}

/* Do all ranks call the same collective with the same sizes, into buffers of their own? */
static bool slots_agree(const tsr_comm_local_group *g) {
        const coll_slot *s0 = &g->slots[0];
        for (int i = 1; i < g->size; i++) {
                const coll_slot *s = &g->slots[i];
                if (s->kind != s0->kind || s->count != s0->count || s->root != s0->root)
                        return false;
        }
        size_t bytes = s0->kind == COLL_ALL_REDUCE ? s0->count * sizeof(float)
                     : s0->kind == COLL_ALL_GATHER ? s0->count * (size_t)g->size
                     : s0->count;
        if (s0->kind == COLL_BARRIER)
                return true;
        for (int i = 0; i < g->size; i++)
                for (int j = i + 1; j < g->size; j++)
                        if (overlap(g->slots[i].out, bytes, g->slots[j].out, bytes))
                                return false;
        return true;
}

/* Publish this rank's slot and pass barrier A; *agree tells whether all slots match.  On
 * a mismatch every rank passes barrier B and answers TSR_E_INVAL. */
static tsr_status coll_enter(local_comm *l, coll_slot slot, uint64_t deadline) {
        tsr_comm_local_group *g = l->g;
        pthread_mutex_lock(&g->mu);
        g->slots[l->base.rank] = slot;
        tsr_status st = barrier_locked(g, deadline);
        bool agree = st == TSR_OK && slots_agree(g);
        if (st == TSR_OK && !agree) {
                st = barrier_locked(g, deadline);
                if (st == TSR_OK)
                        st = TSR_E_INVAL;
        }
        pthread_mutex_unlock(&g->mu);
        return st;
}

static tsr_status local_all_reduce(tsr_comm *c, float *buf, size_t count, void *stream, uint64_t deadline) {
        local_comm *l = (local_comm *)c;
        tsr_comm_local_group *g = l->g;
        int n = c->size, me = c->rank;
        tsr_status st = coll_enter(l, (coll_slot){.kind = COLL_ALL_REDUCE, .out = buf, .count = count}, deadline);
        if (st != TSR_OK)
                return st;

        const float *parts[TSR_COMM_MAX_RANKS];
        size_t lo, hi;
        tsr_comm_slice(count, n, me, &lo, &hi);
        for (int q = 0; q < n; q++)
                parts[q] = (const float *)g->slots[q].out + lo;
        tsr_comm_tree_sum(parts, n, buf + lo, hi - lo);
        if ((st = barrier(g, deadline)) != TSR_OK)
                return st;
        for (int q = 0; q < n; q++) {
                if (q == me)
                        continue;
                tsr_comm_slice(count, n, q, &lo, &hi);
                memcpy(buf + lo, (const float *)g->slots[q].out + lo, (hi - lo) * sizeof(float));
        }
        return barrier(g, deadline);
}

static tsr_status local_all_gather(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream,
                                   uint64_t deadline) {
        local_comm *l = (local_comm *)c;
        tsr_comm_local_group *g = l->g;
        tsr_status st = coll_enter(l, (coll_slot){.kind = COLL_ALL_GATHER, .in = in, .out = out, .count = bytes},
                                   deadline);
        if (st != TSR_OK)
                return st;
        for (int q = 0; q < c->size; q++) {
                unsigned char *dst = (unsigned char *)out + (size_t)q * bytes;
                const void *src = q == c->rank ? in : g->slots[q].in;
                if (dst != src && bytes)
                        memmove(dst, src, bytes);
        }
        return barrier(g, deadline);
}

static tsr_status local_broadcast(tsr_comm *c, void *buf, size_t bytes, int root, void *stream,
                                  uint64_t deadline) {
        local_comm *l = (local_comm *)c;
        tsr_comm_local_group *g = l->g;
        tsr_status st = coll_enter(l, (coll_slot){.kind = COLL_BROADCAST, .out = buf, .count = bytes, .root = root},
                                   deadline);
        if (st != TSR_OK)
                return st;
        if (c->rank != root && bytes)
                memcpy(buf, g->slots[root].out, bytes);
        return barrier(g, deadline);
}

static tsr_status local_barrier(tsr_comm *c, uint64_t deadline) {
        local_comm *l = (local_comm *)c;
        tsr_status st = coll_enter(l, (coll_slot){.kind = COLL_BARRIER}, deadline);
        if (st != TSR_OK)
                return st;
        return barrier(l->g, deadline);
}

static tsr_status local_send(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                             uint64_t deadline) {
        tsr_comm_local_group *g = ((local_comm *)c)->g;
        local_msg *m = malloc(sizeof(*m) + bytes);
        if (!m)
                return TSR_E_NOMEM;
        *m = (local_msg){.src = c->rank, .tag = tag, .bytes = bytes};
        if (bytes)
                memcpy(m->data, buf, bytes);

        tsr_status st = TSR_OK;
        pthread_mutex_lock(&g->mu);
        /* One message larger than the cap still goes through once the mailbox is empty. */
        while (g->failed == TSR_OK && g->mail_bytes[peer] && g->mail_bytes[peer] + bytes > LOCAL_MAIL_CAP)
                if (!wait_until(g, deadline))
                        group_fail_locked(g, TSR_E_TIMEOUT);
        if ((st = g->failed) == TSR_OK) {
                local_msg **tail = &g->mail[peer];
                while (*tail)
                        tail = &(*tail)->next;
                *tail = m;
                m = NULL;
                g->mail_bytes[peer] += bytes;
                pthread_cond_broadcast(&g->cv);
        }
        pthread_mutex_unlock(&g->mu);
        free(m);
        return st;
}

static tsr_status local_recv(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                             uint64_t deadline) {
        tsr_comm_local_group *g = ((local_comm *)c)->g;
        local_msg *m = NULL;
        tsr_status st;

        pthread_mutex_lock(&g->mu);
        for (;;) {
                if ((st = g->failed) != TSR_OK)
                        break;
                local_msg **p = &g->mail[c->rank];
                while (*p && ((*p)->src != peer || (*p)->tag != tag))
                        p = &(*p)->next;
                if (*p) {
                        m = *p;
                        *p = m->next;
                        g->mail_bytes[c->rank] -= m->bytes;
                        pthread_cond_broadcast(&g->cv);          /* room for a waiting sender */
                        break;
                }
                if (!wait_until(g, deadline)) {
                        st = group_fail_locked(g, TSR_E_TIMEOUT);
                        break;
                }
        }
        pthread_mutex_unlock(&g->mu);
        if (!m)
                return st;
        st = m->bytes == bytes ? TSR_OK : TSR_E_INVAL;
        if (st == TSR_OK && bytes)
                memcpy(buf, m->data, bytes);
        free(m);
        return st;
}

static void local_abort(tsr_comm *c) {
        tsr_comm_local_group *g = ((local_comm *)c)->g;
        pthread_mutex_lock(&g->mu);
        group_fail_locked(g, TSR_E_CANCELLED);
        pthread_mutex_unlock(&g->mu);
}

static void local_destroy(tsr_comm *c) {
        local_comm *l = (local_comm *)c;
        pthread_mutex_lock(&l->g->mu);
        l->g->members[c->rank] = NULL;
        pthread_mutex_unlock(&l->g->mu);
        tsr_comm_local_group_unref(&l->g);
        free(l);
}

static const tsr_comm_ops local_ops = {
        .name = "local",
        .all_reduce_sum = local_all_reduce,
        .all_gather = local_all_gather,
        .broadcast = local_broadcast,
        .send = local_send,
        .recv = local_recv,
        .barrier = local_barrier,
        .abort = local_abort,
        .destroy = local_destroy,
};

tsr_status tsr_comm_local_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen) {
        tsr_comm_local_group *g = d->local;
        if (!g) {
                tsr_errf(err, errlen, "comm local: no group");
                return TSR_E_INVAL;
        }
        if (d->size != g->size) {
                tsr_errf(err, errlen, "comm local: size %d but the group has %d ranks", d->size, g->size);
                return TSR_E_INVAL;
        }
        local_comm *l = calloc(1, sizeof(*l));
        if (!l)
                return TSR_E_NOMEM;
        l->base.ops = &local_ops;
        l->base.rank = d->rank;
        atomic_init(&l->base.failed, TSR_OK);
        pthread_mutex_lock(&g->mu);
        tsr_status st = TSR_OK;
        if (g->members[d->rank]) {
                tsr_errf(err, errlen, "comm local: rank %d already joined", d->rank);
                st = TSR_E_INVAL;
        } else {
                g->members[d->rank] = &l->base;
                if (g->failed != TSR_OK)
                        tsr_comm_fail(&l->base, g->failed);
                atomic_fetch_add_explicit(&g->refs, 1, memory_order_relaxed);
                l->g = g;
        }
        pthread_mutex_unlock(&g->mu);
        if (st != TSR_OK) {
                free(l);
                return st;
        }
        *ret = &l->base;
        return TSR_OK;
}
