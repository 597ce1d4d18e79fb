/* worker/parallel/comm: the process-group interface (issue #20).
 *
 * One workload (all_reduce over odd sizes, all_gather, broadcast, tagged send/recv out of
 * order, a group whose recv comes before its send, a size mismatch, barrier) runs on 1..8
 * in-process rank threads and on 2..4 forked processes over loopback; every rank's bytes
 * must equal the serial reference tree and each other's, and the processes' bytes the
 * threads'.  Then the failure paths: abort wakes every waiter, a missing rank makes the
 * others time out within the deadline, kill -9 of a process is seen by its peers, bad
 * arguments and peers of another epoch are refused.  Waits in this file are bounded; the
 * only sleeps are short pauses that let ranks reach a blocking call before an abort. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>
#include <cmocka.h>

#include "common/clock.h"
#include "tests/tsr_test.h"
#include "worker/parallel/comm.h"
#include "worker/parallel/nodes.h"
#include "tests/unit/comm_values.h"

#define MAX_N 8
static const size_t AR_COUNTS[] = {0, 1, 3, 7, 64, 1000, 4097, 65539};
#define N_AR (sizeof(AR_COUNTS) / sizeof(AR_COUNTS[0]))
#define AR_TOTAL (0 + 1 + 3 + 7 + 64 + 1000 + 4097 + 65539)
#define AG_BYTES 37
#define BC_BYTES 1001
#define P2P_BYTES 129
#define MM_COUNT 10              /* mismatch: rank 0 passes MM_COUNT + 1 */
#define AFTER_COUNT 5

/* Messages each way, before any is received: more than ZeroMQ's two high-water marks and
 * the loopback socket buffers hold. */
#define FLOOD 1000
#define FLOOD_BYTES 16384
enum { ST_AR0 = 0, ST_AG = N_AR, ST_BC, ST_SEND, ST_RECV, ST_GROUP, ST_MISMATCH, ST_AG_MISMATCH, ST_FLOOD,
       ST_AFTER, ST_BARRIER, ST_COLL_IN_GROUP, ST_GROUP_END, ST_N };

typedef struct rank_result {
        int ran;
        int st[ST_N];
        float ar[AR_TOTAL];
        unsigned char ag[MAX_N * AG_BYTES];
        unsigned char bc[BC_BYTES];
        unsigned char p2p[3][P2P_BYTES];
        unsigned char grp[P2P_BYTES];
        float mm[MM_COUNT + 1 + 4];       /* + canary */
        unsigned char ag_mm[MAX_N * (AG_BYTES + 1)];
        int flood_bad;                    /* messages out of FIFO order or with wrong bytes */
        float after[AFTER_COUNT];
} rank_result;

/* ---- deterministic inputs ---------------------------------------------------------- */

static void fill(float *x, size_t n, int rank, uint32_t seed) {
        for (size_t i = 0; i < n; i++)
                x[i] = value((uint32_t)rank, seed, i);
}

static void pattern(unsigned char *p, size_t n, int a, int b) {
        for (size_t i = 0; i < n; i++)
                p[i] = (unsigned char)(mix((uint32_t)(a * 131 + b * 7 + 1) ^ (uint32_t)i) >> 24);
}

/* The tree written out independently of tsr_comm_tree_sum: one element at a time,
 * level by level, pairs (2i, 2i+1), odd last one carried up. */
static float ref_tree_one(const float *v, int n) {
        float lv[MAX_N * 8];
        for (int i = 0; i < n; i++)
                lv[i] = v[i];
        while (n > 1) {
                int k = 0;
                for (int i = 0; i + 1 < n; i += 2)
                        lv[k++] = lv[i] + lv[i + 1];
                if (n & 1)
                        lv[k++] = lv[n - 1];
                n = k;
        }
        return lv[0];
}

/* ---- the workload every backend runs ------------------------------------------------- */

static void workload(tsr_comm *c, rank_result *r) {
        int n = tsr_comm_size(c), me = tsr_comm_rank(c);
        int next = (me + 1) % n, prev = (me + n - 1) % n;
        size_t off = 0;

        r->ran = 1;
        for (size_t k = 0; k < N_AR; k++) {
                fill(r->ar + off, AR_COUNTS[k], me, (uint32_t)k);
                r->st[ST_AR0 + k] = tsr_comm_all_reduce_sum(c, r->ar + off, AR_COUNTS[k], NULL);
                off += AR_COUNTS[k];
        }
        unsigned char in[AG_BYTES];
        pattern(in, AG_BYTES, me, 1);
        r->st[ST_AG] = tsr_comm_all_gather(c, in, r->ag, AG_BYTES, NULL);
        pattern(r->bc, BC_BYTES, me, 2);
        r->st[ST_BC] = tsr_comm_broadcast(c, r->bc, BC_BYTES, n - 1, NULL);

        if (n > 1) {
                /* Three tags to the next rank, received from the previous one out of order. */
                int st = TSR_OK;
                for (int t = 0; t < 3 && st == TSR_OK; t++) {
                        unsigned char m[P2P_BYTES];
                        pattern(m, P2P_BYTES, me, 30 + t);
                        st = tsr_comm_send(c, m, P2P_BYTES, next, 30 + (uint64_t)t, NULL);
                }
                r->st[ST_SEND] = st;
                static const int order[3] = {2, 0, 1};
                st = TSR_OK;
                for (int i = 0; i < 3 && st == TSR_OK; i++)
                        st = tsr_comm_recv(c, r->p2p[order[i]], P2P_BYTES, prev, 30 + (uint64_t)order[i], NULL);
                r->st[ST_RECV] = st;

                /* A ring where every rank posts its recv first: only a group makes this work. */
                unsigned char out[P2P_BYTES];
                pattern(out, P2P_BYTES, me, 40);
                st = tsr_comm_group_begin(c);
                if (st == TSR_OK)
                        st = tsr_comm_recv(c, r->grp, P2P_BYTES, prev, 40, NULL);
                if (st == TSR_OK)
                        st = tsr_comm_send(c, out, P2P_BYTES, next, 40, NULL);
                int st2 = tsr_comm_group_end(c);
                r->st[ST_GROUP] = st != TSR_OK ? st : st2;

                /* Rank 0 passes one more element: every rank must see the mismatch. */
                for (int i = 0; i < MM_COUNT + 1 + 4; i++)
                        r->mm[i] = (float)(me + 1);
                r->st[ST_MISMATCH] = tsr_comm_all_reduce_sum(c, r->mm, MM_COUNT + (me == 0), NULL);
                unsigned char ag_in[AG_BYTES + 1];
                pattern(ag_in, sizeof(ag_in), me, 3);
                memset(r->ag_mm, 0xA5, sizeof(r->ag_mm));
                r->st[ST_AG_MISMATCH] = tsr_comm_all_gather(c, ag_in, r->ag_mm, AG_BYTES + (me == 0), NULL);

                /* Every rank sends FLOOD messages (one tag, so FIFO) before receiving any:
                 * a sender that finds its queue full must keep draining its own inbox. */
                static _Thread_local uint64_t msg[FLOOD_BYTES / 8];
                st = TSR_OK;
                for (uint64_t i = 0; i < FLOOD && st == TSR_OK; i++) {
                        msg[0] = msg[FLOOD_BYTES / 8 - 1] = (uint64_t)me << 32 | i;
                        st = tsr_comm_send(c, msg, sizeof(msg), next, 50, NULL);
                }
                for (uint64_t i = 0; i < FLOOD && st == TSR_OK; i++) {
                        uint64_t want = (uint64_t)prev << 32 | i;
                        st = tsr_comm_recv(c, msg, sizeof(msg), prev, 50, NULL);
                        r->flood_bad += msg[0] != want || msg[FLOOD_BYTES / 8 - 1] != want;
                }
                r->st[ST_FLOOD] = st;
        }
        fill(r->after, AFTER_COUNT, me, 99);
        r->st[ST_AFTER] = tsr_comm_all_reduce_sum(c, r->after, AFTER_COUNT, NULL);
        r->st[ST_BARRIER] = tsr_comm_barrier(c);
        r->st[ST_COLL_IN_GROUP] = tsr_comm_group_begin(c);
        if (r->st[ST_COLL_IN_GROUP] == TSR_OK)
                r->st[ST_COLL_IN_GROUP] = tsr_comm_barrier(c);
        r->st[ST_GROUP_END] = tsr_comm_group_end(c);
}

/* Every rank's results against the reference (and so against each other). */
static void check_results(const rank_result *res, int n) {
        float (*parts)[MAX_N] = NULL;
        size_t off = 0;
        for (int q = 0; q < n; q++) {
                const rank_result *r = &res[q];
                assert_true(r->ran);
                for (size_t k = 0; k < N_AR; k++)
                        assert_int_equal(r->st[ST_AR0 + k], TSR_OK);
                assert_int_equal(r->st[ST_AG], TSR_OK);
                assert_int_equal(r->st[ST_BC], TSR_OK);
                if (n > 1) {
                        assert_int_equal(r->st[ST_SEND], TSR_OK);
                        assert_int_equal(r->st[ST_RECV], TSR_OK);
                        assert_int_equal(r->st[ST_GROUP], TSR_OK);
                        assert_int_equal(r->st[ST_MISMATCH], TSR_E_INVAL);
                        assert_int_equal(r->st[ST_AG_MISMATCH], TSR_E_INVAL);
                        assert_int_equal(r->st[ST_FLOOD], TSR_OK);
                        assert_int_equal(r->flood_bad, 0);
                        for (size_t i = 0; i < sizeof(r->ag_mm); i++)   /* refused: nothing written */
                                assert_int_equal(r->ag_mm[i], 0xA5);
                }
                assert_int_equal(r->st[ST_AFTER], TSR_OK);
                assert_int_equal(r->st[ST_BARRIER], TSR_OK);
                assert_int_equal(r->st[ST_COLL_IN_GROUP], TSR_E_INVAL);
                assert_int_equal(r->st[ST_GROUP_END], TSR_OK);
        }
        /* all_reduce: memcmp against the reference tree, on every rank. */
        parts = malloc(sizeof(*parts) * 65539);
        assert_non_null(parts);
        for (size_t k = 0; k < N_AR; k++) {
                size_t cnt = AR_COUNTS[k];
                float *want = malloc((cnt ? cnt : 1) * sizeof(float));
                for (size_t i = 0; i < cnt; i++) {
                        for (int q = 0; q < n; q++)
                                parts[i][q] = value((uint32_t)q, (uint32_t)k, i);
                        want[i] = ref_tree_one(parts[i], n);
                }
                for (int q = 0; q < n; q++)
                        assert_memory_equal(res[q].ar + off, want, cnt * sizeof(float));
                free(want);
                off += cnt;
        }
        float want_after[AFTER_COUNT];
        for (size_t i = 0; i < AFTER_COUNT; i++) {
                float v[MAX_N];
                for (int q = 0; q < n; q++)
                        v[q] = value((uint32_t)q, 99, i);
                want_after[i] = ref_tree_one(v, n);
        }
        free(parts);
        unsigned char want[P2P_BYTES * 4 > BC_BYTES ? P2P_BYTES * 4 : BC_BYTES];
        for (int q = 0; q < n; q++) {
                const rank_result *r = &res[q];
                assert_memory_equal(r->after, want_after, sizeof(want_after));
                for (int s = 0; s < n; s++) {
                        pattern(want, AG_BYTES, s, 1);
                        assert_memory_equal(r->ag + s * AG_BYTES, want, AG_BYTES);
                }
                pattern(want, BC_BYTES, n - 1, 2);
                assert_memory_equal(r->bc, want, BC_BYTES);
                if (n > 1) {
                        int prev = (q + n - 1) % n;
                        for (int t = 0; t < 3; t++) {
                                pattern(want, P2P_BYTES, prev, 30 + t);
                                assert_memory_equal(r->p2p[t], want, P2P_BYTES);
                        }
                        pattern(want, P2P_BYTES, prev, 40);
                        assert_memory_equal(r->grp, want, P2P_BYTES);
                        for (int i = 0; i < MM_COUNT + 1 + 4; i++)   /* refused: nothing written */
                                assert_true(r->mm[i] == (float)(q + 1));
                }
        }
}

/* ---- in-process ranks ------------------------------------------------------------------ */

typedef void (*rank_fn)(tsr_comm *c, void *arg, rank_result *r);

typedef struct rank_ctx {
        tsr_comm_local_group *g;
        int rank, size;
        uint32_t timeout_ms;
        rank_fn fn;
        void *arg;
        rank_result *r;
        tsr_comm *c;                     /* published for the aborting thread */
        _Atomic int *started;
} rank_ctx;

static void *rank_main(void *p) {
        rank_ctx *x = p;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = x->rank, .size = x->size,
                           .timeout_ms = x->timeout_ms, .local = x->g};
        char err[256];
        if (tsr_comm_new(&d, &x->c, err, sizeof(err)) != TSR_OK) {
                x->r->ran = -1;
                return NULL;
        }
        if (x->started)
                atomic_fetch_add(x->started, 1);
        x->fn(x->c, x->arg, x->r);
        return NULL;
}

/* Run fn on n rank threads; `during` (may be NULL) runs on this thread meanwhile. */
static void run_local(int n, uint32_t timeout_ms, rank_fn fn, void *arg, rank_result *res,
                      void (*during)(rank_ctx *ctx, int n)) {
        tsr_comm_local_group *g = NULL;
        rank_ctx ctx[MAX_N];
        pthread_t th[MAX_N];
        _Atomic int started = 0;
        assert_int_equal(tsr_comm_local_group_new(n, &g), TSR_OK);
        for (int q = 0; q < n; q++) {
                ctx[q] = (rank_ctx){.g = g, .rank = q, .size = n, .timeout_ms = timeout_ms, .fn = fn, .arg = arg,
                                    .r = &res[q], .started = &started};
                assert_int_equal(pthread_create(&th[q], NULL, rank_main, &ctx[q]), 0);
        }
        if (during) {
                uint64_t until = tsr_deadline_ns(10000);
                while (atomic_load(&started) < n && tsr_now_ns() < until)
                        sched_yield();
                during(ctx, n);
        }
        for (int q = 0; q < n; q++)
                pthread_join(th[q], NULL);
        for (int q = 0; q < n; q++)
                tsr_comm_free(&ctx[q].c);
        tsr_comm_local_group_unref(&g);
        assert_null(g);
}

static void workload_fn(tsr_comm *c, void *arg, rank_result *r) { workload(c, r); }

static void test_local_conformance_1_to_8(void **state) {
        rank_result *res = calloc(MAX_N, sizeof(*res));
        assert_non_null(res);
        for (int n = 1; n <= MAX_N; n++) {
                memset(res, 0, MAX_N * sizeof(*res));
                run_local(n, 20000, workload_fn, NULL, res, NULL);
                check_results(res, n);
        }
        free(res);
}

/* ---- the reference tree and R7 --------------------------------------------------------- */

static void test_tree_sum_order(void **state) {
        enum { CNT = 131 };
        static float p[MAX_N][CNT], out[CNT];
        const float *parts[MAX_N];
        bool order_matters = false;
        for (int q = 0; q < MAX_N; q++) {
                fill(p[q], CNT, q, 7);
                parts[q] = p[q];
        }
        for (int n = 1; n <= MAX_N; n++) {
                tsr_comm_tree_sum(parts, n, out, CNT);
                for (size_t i = 0; i < CNT; i++) {
                        float v[MAX_N], seq = 0;
                        for (int q = 0; q < n; q++) {
                                v[q] = p[q][i];
                                seq += v[q];
                        }
                        float want = ref_tree_one(v, n);
                        assert_memory_equal(&out[i], &want, sizeof(float));
                        order_matters |= seq != want;
                }
        }
        /* The shapes written out: n = 4 is (p0 + p1) + (p2 + p3), n = 3 is (p0 + p1) + p2. */
        tsr_comm_tree_sum(parts, 4, out, CNT);
        for (size_t i = 0; i < CNT; i++) {
                float want = (p[0][i] + p[1][i]) + (p[2][i] + p[3][i]);
                assert_memory_equal(&out[i], &want, sizeof(float));
        }
        tsr_comm_tree_sum(parts, 3, out, CNT);
        for (size_t i = 0; i < CNT; i++) {
                float want = (p[0][i] + p[1][i]) + p[2][i];
                assert_memory_equal(&out[i], &want, sizeof(float));
        }
        /* out may alias a part. */
        static float alias[CNT];
        memcpy(alias, p[2], sizeof(alias));
        const float *ap[3] = {p[0], p[1], alias};
        tsr_comm_tree_sum(ap, 3, alias, CNT);
        assert_memory_equal(alias, out, sizeof(alias));
        /* The inputs are such that a left-to-right sum differs: the test can see the order. */
        assert_true(order_matters);
}

/* R7: S = 8 leaves; at t ranks each reduces its S/t contiguous leaves, then all-reduces. */
typedef struct r7_arg {
        const float (*leaves)[1025];
        int t;
} r7_arg;

static void r7_fn(tsr_comm *c, void *arg, rank_result *r) {
        const r7_arg *a = arg;
        int per = TSR_COMM_TREE_LEAVES / a->t, me = tsr_comm_rank(c);
        const float *parts[TSR_COMM_TREE_LEAVES];
        for (int i = 0; i < per; i++)
                parts[i] = a->leaves[me * per + i];
        tsr_comm_tree_sum(parts, per, r->ar, 1025);
        r->st[0] = tsr_comm_all_reduce_sum(c, r->ar, 1025, NULL);
        r->ran = 1;
}

static void test_r7_invariant_over_tp(void **state) {
        static float leaves[TSR_COMM_TREE_LEAVES][1025], want[1025];
        const float *parts[TSR_COMM_TREE_LEAVES];
        for (int l = 0; l < TSR_COMM_TREE_LEAVES; l++) {
                fill(leaves[l], 1025, l, 3);
                parts[l] = leaves[l];
        }
        tsr_comm_tree_sum(parts, TSR_COMM_TREE_LEAVES, want, 1025);
        rank_result *res = calloc(MAX_N, sizeof(*res));
        for (int t = 1; t <= TSR_COMM_TREE_LEAVES; t *= 2) {
                r7_arg a = {.leaves = (const float (*)[1025])leaves, .t = t};
                memset(res, 0, MAX_N * sizeof(*res));
                run_local(t, 20000, r7_fn, &a, res, NULL);
                for (int q = 0; q < t; q++) {
                        assert_int_equal(res[q].st[0], TSR_OK);
                        assert_memory_equal(res[q].ar, want, sizeof(want));
                }
        }
        free(res);
}

/* ---- failure paths, in-process --------------------------------------------------------- */

/* Rank 0 waits in recv (from the last rank, which never sends), the others in all_reduce
 * (rank 0 never joins it); the test thread aborts one of them. */
static void blocked_fn(tsr_comm *c, void *arg, rank_result *r) {
        float x[16] = {0};
        unsigned char b[4];
        uint64_t t0 = tsr_now_ns();
        r->ran = 1;
        if (tsr_comm_rank(c) == 0)
                r->st[0] = tsr_comm_recv(c, b, sizeof(b), tsr_comm_size(c) - 1, 5, NULL);
        else
                r->st[0] = tsr_comm_all_reduce_sum(c, x, 16, NULL);
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);          /* ms */
        r->st[2] = tsr_comm_barrier(c);                             /* sticky */
        r->st[3] = tsr_comm_poll_error(c);
}

static void abort_rank1(rank_ctx *ctx, int n) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000};
        nanosleep(&ts, NULL);                   /* let the ranks reach their waits */
        tsr_comm_abort(ctx[1].c);
        tsr_comm_abort(ctx[1].c);               /* idempotent */
}

static void test_local_abort_wakes_every_waiter(void **state) {
        rank_result res[4];
        memset(res, 0, sizeof(res));
        run_local(4, 30000, blocked_fn, NULL, res, abort_rank1);
        for (int q = 0; q < 4; q++) {
                assert_true(res[q].ran);
                assert_int_equal(res[q].st[0], TSR_E_CANCELLED);
                assert_true(res[q].st[1] < 15000);                   /* woken, not timed out */
                assert_int_equal(res[q].st[2], TSR_E_CANCELLED);
                assert_int_equal(res[q].st[3], TSR_E_CANCELLED);
        }
}

/* Rank n-1 never arrives: the others' all_reduce times out within the deadline. */
static void absent_fn(tsr_comm *c, void *arg, rank_result *r) {
        float x[8] = {0};
        r->ran = 1;
        if (tsr_comm_rank(c) == tsr_comm_size(c) - 1)
                return;
        uint64_t t0 = tsr_now_ns();
        r->st[0] = tsr_comm_all_reduce_sum(c, x, 8, NULL);
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);
        r->st[2] = tsr_comm_send(c, x, 4, 0 == tsr_comm_rank(c) ? 1 : 0, 1, NULL);
}

static void test_local_missing_rank_times_out(void **state) {
        rank_result res[4];
        memset(res, 0, sizeof(res));
        run_local(4, 300, absent_fn, NULL, res, NULL);
        for (int q = 0; q < 3; q++) {
                assert_int_equal(res[q].st[0], TSR_E_TIMEOUT);
                assert_true(res[q].st[1] >= 250);              /* the deadline, not earlier */
                assert_true(res[q].st[1] < 300 + 5000);        /* and bounded (a shared 2-core host) */
                assert_int_equal(res[q].st[2], TSR_E_TIMEOUT);  /* sticky */
        }
}

static void test_local_bad_input(void **state) {
        tsr_comm_local_group *g = NULL, *g2 = NULL;
        tsr_comm *c = NULL, *c2 = NULL;
        char err[256] = "";
        assert_int_equal(tsr_comm_local_group_new(0, &g), TSR_E_INVAL);
        assert_int_equal(tsr_comm_local_group_new(TSR_COMM_MAX_RANKS + 1, &g), TSR_E_INVAL);
        assert_null(g);
        assert_int_equal(tsr_comm_local_group_new(2, &g), TSR_OK);
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = 0, .size = 0, .local = g};
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "size 0"));
        d.size = 2;
        d.rank = 2;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "rank 2"));
        d.rank = -1;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        d.rank = 0;
        d.size = 3;                                          /* the group has 2 */
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        d.size = 2;
        d.local = NULL;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        d.backend = 77;
        d.local = g;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        assert_null(c);
        d.backend = TSR_COMM_BACKEND_LOCAL;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_OK);
        assert_int_equal(tsr_comm_new(&d, &c2, err, sizeof(err)), TSR_E_INVAL);   /* rank 0 twice */
        assert_non_null(strstr(err, "already"));
        assert_string_equal(tsr_comm_backend_name(c), "local");

        float x[4] = {0};
        unsigned char b[4] = {0};
        assert_int_equal(tsr_comm_all_reduce_sum(c, NULL, 4, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_all_reduce_sum(c, x, SIZE_MAX / 2, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_all_gather(c, x, NULL, 4, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_all_gather(c, x, x, SIZE_MAX / 2, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_broadcast(c, x, 4, 2, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_broadcast(c, x, 4, -1, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_send(c, b, 4, 0, 1, NULL), TSR_E_INVAL);    /* to itself */
        assert_int_equal(tsr_comm_send(c, b, 4, 2, 1, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_send(c, b, 4, 1, TSR_COMM_TAG_MAX + 1, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_recv(c, NULL, 4, 1, 1, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_comm_group_end(c), TSR_E_INVAL);                 /* no group */
        assert_int_equal(tsr_comm_poll_error(c), TSR_OK);                     /* none of it sticks */
        assert_int_equal(tsr_comm_all_reduce_sum(NULL, x, 4, NULL), TSR_E_INVAL);
        tsr_comm_free(&c);
        assert_null(c);
        tsr_comm_free(&c);                                                    /* NULL is fine */

        /* recv of a message of another size: consumed, refused, not sticky. */
        assert_int_equal(tsr_comm_local_group_new(2, &g2), TSR_OK);
        tsr_comm_desc d0 = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = 0, .size = 2, .local = g2, .timeout_ms = 5000};
        tsr_comm_desc d1 = d0;
        d1.rank = 1;
        assert_int_equal(tsr_comm_new(&d0, &c, err, sizeof(err)), TSR_OK);
        assert_int_equal(tsr_comm_new(&d1, &c2, err, sizeof(err)), TSR_OK);
        unsigned char big[8] = {1, 2, 3, 4, 5, 6, 7, 8}, small[4] = {9, 9, 9, 9};
        assert_int_equal(tsr_comm_send(c, big, 8, 1, 3, NULL), TSR_OK);
        assert_int_equal(tsr_comm_send(c, big, 4, 1, 3, NULL), TSR_OK);
        assert_int_equal(tsr_comm_recv(c2, small, 4, 0, 3, NULL), TSR_E_INVAL);
        assert_memory_equal(small, ((unsigned char[4]){9, 9, 9, 9}), 4);
        assert_int_equal(tsr_comm_recv(c2, small, 4, 0, 3, NULL), TSR_OK);    /* the next one, FIFO */
        assert_memory_equal(small, big, 4);
        tsr_comm_free(&c);
        tsr_comm_free(&c2);
        tsr_comm_local_group_unref(&g2);
        tsr_comm_local_group_unref(&g);
}

/* Two ranks passing overlapping buffers: refused on both, nothing written. */
static float shared_buf[64];
static void overlap_fn(tsr_comm *c, void *arg, rank_result *r) {
        r->ran = 1;
        r->st[0] = tsr_comm_all_reduce_sum(c, shared_buf + 8 * tsr_comm_rank(c), 16, NULL);
        r->st[1] = tsr_comm_barrier(c);
}

static void test_local_overlapping_buffers_refused(void **state) {
        rank_result res[2];
        memset(res, 0, sizeof(res));
        for (int i = 0; i < 64; i++)
                shared_buf[i] = 1.0f;
        run_local(2, 5000, overlap_fn, NULL, res, NULL);
        for (int q = 0; q < 2; q++) {
                assert_int_equal(res[q].st[0], TSR_E_INVAL);
                assert_int_equal(res[q].st[1], TSR_OK);
        }
        for (int i = 0; i < 64; i++)
                assert_true(shared_buf[i] == 1.0f);
}

/* ---- cross-process ranks over ZeroMQ ---------------------------------------------------- */

#define EP_LEN 256

typedef struct procs {
        int n;
        pid_t pid[MAX_N];
        int up[MAX_N];                   /* child -> parent */
        int down[MAX_N];                 /* parent -> child */
} procs;

typedef void (*child_fn)(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps);

static bool read_full(int fd, void *p, size_t n) {
        for (size_t got = 0; got < n;) {
                ssize_t k = read(fd, (char *)p + got, n - got);
                if (k <= 0) {
                        if (k < 0 && errno == EINTR)
                                continue;
                        return false;
                }
                got += (size_t)k;
        }
        return true;
}

/* zmq_max_buffered of the next spawn's ranks (0: the default); read by the children. */
static size_t spawn_max_buffered;

/* In a forked child: cmocka's handlers would turn a crash into a second test run in the
 * child; die of the signal instead, so the parent sees it. */
static void child_signals(void) {
        static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
        for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
                signal(sigs[i], SIG_DFL);
}

/* Child: bind, report the endpoint, learn everyone's, join the group, run fn, _exit. */
static void child_main(int rank, int n, uint32_t timeout_ms, uint64_t epoch, child_fn fn, void *arg,
                       rank_result *r, int up, int down) {
        char err[256];
        child_signals();
        tsr_comm_zmq_listener *l = NULL;
        char eps[MAX_N][EP_LEN];
        const char *ep_ptrs[MAX_N];
        if (tsr_comm_zmq_listener_new("tcp://127.0.0.1:*", &l, err, sizeof(err)) != TSR_OK)
                _exit(10);
        char mine[EP_LEN] = {0};
        snprintf(mine, sizeof(mine), "%s", tsr_comm_zmq_listener_endpoint(l));
        if (write(up, mine, EP_LEN) != EP_LEN || !read_full(down, eps, sizeof(eps[0]) * (size_t)n))
                _exit(11);
        for (int q = 0; q < n; q++)
                ep_ptrs[q] = eps[q];
        tsr_comm *c = NULL;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_ZMQ, .rank = rank, .size = n, .timeout_ms = timeout_ms,
                           .epoch = epoch, .zmq_listener = &l, .endpoints = ep_ptrs,
                           .zmq_max_buffered = spawn_max_buffered};
        int st = tsr_comm_new(&d, &c, err, sizeof(err));
        if (l)
                _exit(12);                                   /* must have been taken */
        r->st[ST_N - 1] = st;                                /* the init status, for fn == NULL */
        if (st != TSR_OK) {
                r->ran = -1;
                fprintf(stderr, "rank %d: %s\n", rank, err);
                _exit(fn ? 13 : 0);
        }
        if (fn)
                fn(c, arg, r, up, ep_ptrs);
        tsr_comm_free(&c);
        exit(0);                /* not _exit: under ASan, LeakSanitizer checks the child too */
}

/* Fork n ranks; `epochs` (NULL: all 1) per rank.  Returns once endpoints are exchanged. */
static void spawn(procs *p, int n, uint32_t timeout_ms, const uint64_t *epochs, child_fn fn, void *arg,
                  rank_result *res) {
        char eps[MAX_N][EP_LEN];
        p->n = n;
        for (int q = 0; q < n; q++) {
                int up[2], down[2];
                assert_int_equal(pipe(up), 0);
                assert_int_equal(pipe(down), 0);
                pid_t pid = fork();
                assert_true(pid >= 0);
                if (pid == 0) {
                        close(up[0]);
                        close(down[1]);
                        child_main(q, n, timeout_ms, epochs ? epochs[q] : 1, fn, arg, &res[q], up[1], down[0]);
                }
                close(up[1]);
                close(down[0]);
                p->pid[q] = pid;
                p->up[q] = up[0];
                p->down[q] = down[1];
        }
        for (int q = 0; q < n; q++)
                assert_true(read_full(p->up[q], eps[q], EP_LEN));
        for (int q = 0; q < n; q++)
                assert_int_equal(write(p->down[q], eps, sizeof(eps[0]) * (size_t)n), (ssize_t)(sizeof(eps[0]) * n));
}

/* Reap every child within `ms`; any still running then is killed and the test fails.
 * Returns the exit codes (-signal for a signalled child). */
static void reap(procs *p, int ms, int *codes) {
        uint64_t until = tsr_deadline_ns((uint64_t)ms);
        int left = p->n;
        bool done[MAX_N] = {false};
        while (left > 0) {
                for (int q = 0; q < p->n; q++) {
                        int ws;
                        if (done[q] || waitpid(p->pid[q], &ws, WNOHANG) != p->pid[q])
                                continue;
                        done[q] = true;
                        left--;
                        codes[q] = WIFEXITED(ws) ? WEXITSTATUS(ws) : -WTERMSIG(ws);
                }
                if (left > 0 && tsr_now_ns() > until) {
                        for (int q = 0; q < p->n; q++)
                                if (!done[q])
                                        kill(p->pid[q], SIGKILL);
                        for (int q = 0; q < p->n; q++)
                                if (!done[q])
                                        waitpid(p->pid[q], NULL, 0);
                        fail_msg("ranks still running after %d ms", ms);
                }
                struct timespec ts = {.tv_sec = 0, .tv_nsec = 5 * 1000000};
                nanosleep(&ts, NULL);
        }
        for (int q = 0; q < p->n; q++) {
                close(p->up[q]);
                close(p->down[q]);
        }
}

/* Fork n ranks running fn, wait for them (bounded), and require each to exit 0. */
static void run_procs(int n, uint32_t timeout_ms, const uint64_t *epochs, child_fn fn, void *arg,
                      rank_result *res) {
        procs p;
        int codes[MAX_N];
        memset(res, 0, MAX_N * sizeof(*res));
        spawn(&p, n, timeout_ms, epochs, fn, arg, res);
        reap(&p, 30000, codes);
        for (int q = 0; q < n; q++)
                assert_int_equal(codes[q], 0);
}

static rank_result *shared_results(void) {
        void *m = mmap(NULL, MAX_N * sizeof(rank_result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        assert_true(m != MAP_FAILED);
        return m;
}

/* A garbage sender: frames that must be dropped without harm by rank 1's ROUTER. */
static void send_garbage(const char *ep) {
        void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
        int linger = 1000;
        zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_connect(s, ep);
        unsigned char h[48] = {0};
        zmq_send(s, "hello", 5, 0);                                          /* short */
        memcpy(h, "XXXX", 4);
        zmq_send(s, h, sizeof(h), 0);                                        /* bad magic */
        uint32_t magic = 0x43525354u, src = 77, size = 2;
        memcpy(h, &magic, 4);
        h[4] = 1;
        h[5] = 2;
        memcpy(h + 8, &src, 4);
        memcpy(h + 12, &size, 4);
        zmq_send(s, h, sizeof(h), 0);                                        /* sender 77 */
        src = 0;
        memcpy(h + 8, &src, 4);
        uint64_t bytes = 1000;
        memcpy(h + 40, &bytes, 8);
        zmq_send(s, h, sizeof(h), 0);                                        /* lies about its size */
        zmq_send(s, "a", 1, ZMQ_SNDMORE);
        zmq_send(s, "b", 1, 0);                                              /* multipart */
        zmq_close(s);
        zmq_ctx_term(ctx);
}

/* arg non-NULL: rank 0 first sends garbage frames to rank 1, which must drop them. */
static void zmq_workload_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        if (arg && tsr_comm_rank(c) == 0)
                send_garbage(eps[1]);
        workload(c, r);
}

static void test_zmq_conformance_2_to_4(void **state) {
        rank_result *res = shared_results();
        rank_result *local = calloc(MAX_N, sizeof(*local));
        for (int n = 2; n <= 4; n++) {
                run_procs(n, 10000, NULL, zmq_workload_fn, NULL, res);
                check_results(res, n);
                /* The same workload on threads: the processes' bytes equal the threads'. */
                memset(local, 0, MAX_N * sizeof(*local));
                run_local(n, 20000, workload_fn, NULL, local, NULL);
                for (int q = 0; q < n; q++) {
                        assert_memory_equal(res[q].ar, local[q].ar, sizeof(res[q].ar));
                        assert_memory_equal(res[q].after, local[q].after, sizeof(res[q].after));
                        assert_memory_equal(res[q].ag, local[q].ag, sizeof(res[q].ag));
                }
        }
        free(local);
        munmap(res, MAX_N * sizeof(rank_result));
}

static void test_zmq_garbage_frames_dropped(void **state) {
        rank_result *res = shared_results();
        run_procs(2, 10000, NULL, zmq_workload_fn, (void *)1, res);
        check_results(res, 2);
        munmap(res, MAX_N * sizeof(rank_result));
}

/* Four ranks; rank VICTIM waits to be killed, the others wait in an all_reduce that needs
 * it (ranks before and after it in the receive order, so an error in the middle of a
 * collective's receives is covered). */
#define VICTIM 1
static void victim_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        float x[64] = {0};
        r->ran = 1;
        /* Every rank tells the parent it is past the barrier (so the victim owes nothing
         * any more); the parent then kills the victim. */
        r->st[3] = tsr_comm_barrier(c);
        char one = 1;
        if (write(up_fd, &one, 1) != 1)
                _exit(20);
        if (tsr_comm_rank(c) == VICTIM) {
                for (;;)
                        pause();
        }
        uint64_t t0 = tsr_now_ns();
        r->st[0] = tsr_comm_all_reduce_sum(c, x, 64, NULL);
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);
        r->st[2] = tsr_comm_barrier(c);
}

/* Two ranks; rank 1 is killed while rank 0 is idle: rank 0 only polls
 * (tsr_comm_progress, as node 0's engine does while it waits for work) and must see the
 * loss, TSR_E_CLOSED, without a send or receive, well inside the group's deadline. */
static void idle_victim_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        (void)arg;
        (void)eps;
        r->ran = 1;
        r->st[3] = tsr_comm_barrier(c);
        char one = 1;
        if (write(up_fd, &one, 1) != 1)
                _exit(20);
        if (tsr_comm_rank(c) == 1) {
                for (;;)
                        pause();
        }
        uint64_t t0 = tsr_now_ns();
        tsr_status st = TSR_OK;
        while (st == TSR_OK && tsr_now_ns() - t0 < 20ull * 1000000000ull) {
                struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000};
                nanosleep(&ts, NULL);
                st = tsr_comm_progress(c);
        }
        r->st[0] = st;
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);
}

static void test_zmq_progress_sees_a_lost_idle_peer(void **state) {
        rank_result *res = shared_results();
        procs p;
        int codes[MAX_N];
        char one;
        (void)state;
        memset(res, 0, MAX_N * sizeof(*res));
        spawn(&p, 2, 60000, NULL, idle_victim_fn, NULL, res);
        for (int q = 0; q < 2; q++)
                assert_true(read_full(p.up[q], &one, 1));
        kill(p.pid[1], SIGKILL);
        reap(&p, 30000, codes);
        assert_int_equal(codes[1], -SIGKILL);
        assert_int_equal(codes[0], 0);
        print_message("rank 0 idle: %s after %d ms\n", tsr_status_str(res[0].st[0]), res[0].st[1]);
        assert_int_equal(res[0].st[0], TSR_E_CLOSED);
        assert_true(res[0].st[1] < 5000);
        munmap(res, MAX_N * sizeof(rank_result));
}

static void test_zmq_kill9_peer_is_an_error(void **state) {
        rank_result *res = shared_results();
        procs p;
        int codes[MAX_N];
        char one;
        memset(res, 0, MAX_N * sizeof(*res));
        spawn(&p, 4, 8000, NULL, victim_fn, NULL, res);
        for (int q = 0; q < 4; q++)
                assert_true(read_full(p.up[q], &one, 1));      /* every rank past the barrier */
        kill(p.pid[VICTIM], SIGKILL);
        reap(&p, 20000, codes);
        assert_int_equal(codes[VICTIM], -SIGKILL);
        for (int q = 0; q < 4; q++) {
                if (q == VICTIM)
                        continue;
                assert_int_equal(codes[q], 0);
                assert_int_equal(res[q].st[3], TSR_OK);
                print_message("rank %d: %s after %d ms\n", q, tsr_status_str(res[q].st[0]), res[q].st[1]);
                /* Seen through the DEALER's disconnect (TSR_E_CLOSED) or, at worst, the deadline. */
                assert_true(res[q].st[0] == TSR_E_CLOSED || res[q].st[0] == TSR_E_TIMEOUT);
                assert_true(res[q].st[1] <= 8000 + 2000);
                assert_int_equal(res[q].st[2], res[q].st[0]);  /* sticky */
        }
        munmap(res, MAX_N * sizeof(rank_result));
}

/* Rank 1 aborts from a second thread while its rank thread waits in recv; rank 0 waits in
 * a recv too and learns of the abort from rank 1's ABORT frame. */
static void *abort_later(void *p) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 100 * 1000000};
        nanosleep(&ts, NULL);
        tsr_comm_abort(p);
        return NULL;
}

static void abort_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        unsigned char b[4];
        pthread_t th;
        r->ran = 1;
        if (tsr_comm_rank(c) == 1)
                pthread_create(&th, NULL, abort_later, c);
        uint64_t t0 = tsr_now_ns();
        r->st[0] = tsr_comm_recv(c, b, 4, 1 - tsr_comm_rank(c), 9, NULL);
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);
        if (tsr_comm_rank(c) == 1)
                pthread_join(th, NULL);
}

static void test_zmq_abort_reaches_peers(void **state) {
        rank_result *res = shared_results();
        run_procs(2, 20000, NULL, abort_fn, NULL, res);
        for (int q = 0; q < 2; q++) {
                assert_int_equal(res[q].st[0], TSR_E_CANCELLED);
                assert_true(res[q].st[1] < 10000);              /* woken, not the 20 s deadline */
        }
        munmap(res, MAX_N * sizeof(rank_result));
}

/* Rank 2 is alive and in the group but never joins the all_reduce (it waits, longer, in a
 * recv nobody answers): ranks 0 and 1 time out at their deadline. */
static void late_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        float x[32] = {0};
        unsigned char b[4];
        r->ran = 1;
        uint64_t t0 = tsr_now_ns();
        if (tsr_comm_rank(c) == 2) {
                tsr_comm_set_timeout(c, 3000);
                r->st[0] = tsr_comm_recv(c, b, sizeof(b), 0, 77, NULL);
        } else {
                tsr_comm_set_timeout(c, 500);           /* joining had 10 s; this wait has 0.5 */
                r->st[0] = tsr_comm_all_reduce_sum(c, x, 32, NULL);
        }
        r->st[1] = (int)((tsr_now_ns() - t0) / 1000000);
        r->st[2] = tsr_comm_poll_error(c);
}

static void test_zmq_missing_rank_times_out(void **state) {
        rank_result *res = shared_results();
        run_procs(3, 10000, NULL, late_fn, NULL, res);
        for (int q = 0; q < 2; q++) {
                assert_int_equal(res[q].st[0], TSR_E_TIMEOUT);
                assert_true(res[q].st[1] >= 450);
                assert_true(res[q].st[1] < 500 + 5000);
                assert_int_equal(res[q].st[2], TSR_E_TIMEOUT);
        }
        /* Rank 2: its own recv ends in an error too (the others' exit, or its deadline). */
        assert_int_not_equal(res[2].st[0], TSR_OK);
        munmap(res, MAX_N * sizeof(rank_result));
}

/* The cap on bytes received ahead of their recv: rank 0 sends 64 KiB that rank 1 never
 * asks for (its cap: 16 KiB): TSR_E_LIMIT, not growth.  A message over the cap is refused
 * at the sender. */
static void flood_fn(tsr_comm *c, void *arg, rank_result *r, int up_fd, const char *const *eps) {
        static unsigned char big[32768];
        unsigned char b[4];
        r->ran = 1;
        if (tsr_comm_rank(c) == 0) {
                r->st[1] = tsr_comm_send(c, big, sizeof(big), 1, 1, NULL);       /* over the cap */
                r->st[0] = TSR_OK;
                for (int i = 0; i < 16 && r->st[0] == TSR_OK; i++)
                        r->st[0] = tsr_comm_send(c, big, 4096, 1, 1, NULL);
                r->st[2] = tsr_comm_recv(c, b, sizeof(b), 1, 2, NULL);        /* waits for the end */
        } else {
                r->st[0] = tsr_comm_recv(c, b, sizeof(b), 0, 2, NULL);
        }
}

static void test_zmq_buffered_bytes_capped(void **state) {
        rank_result *res = shared_results();
        spawn_max_buffered = 16384;
        run_procs(2, 3000, NULL, flood_fn, NULL, res);
        spawn_max_buffered = 0;
        assert_int_equal(res[0].st[1], TSR_E_INVAL);
        assert_int_equal(res[0].st[0], TSR_OK);
        assert_int_equal(res[1].st[0], TSR_E_LIMIT);
        assert_int_not_equal(res[0].st[2], TSR_OK);     /* rank 1 failed: closed or timed out */
        munmap(res, MAX_N * sizeof(rank_result));
}

/* A peer of another epoch (a stale incarnation) is never taken for a member. */
static void test_zmq_other_epoch_refused(void **state) {
        rank_result *res = shared_results();
        const uint64_t epochs[2] = {5, 6};
        run_procs(2, 1500, epochs, NULL, NULL, res);
        for (int q = 0; q < 2; q++) {
                assert_int_equal(res[q].st[ST_N - 1], TSR_E_PROTO);
        }
        munmap(res, MAX_N * sizeof(rank_result));
}

static void test_zmq_bad_desc(void **state) {
        char err[256];
        tsr_comm *c = NULL;
        tsr_comm_zmq_listener *l = NULL;
        assert_int_equal(tsr_comm_zmq_listener_new("nonsense://x", &l, err, sizeof(err)), TSR_E_IO);
        assert_null(l);
        const char *eps[2] = {"tcp://127.0.0.1:1", NULL};
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_ZMQ, .rank = 0, .size = 2, .endpoints = eps};
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);     /* rank 1 has none */
        d.endpoints = NULL;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(tsr_comm_zmq_listener_new("tcp://127.0.0.1:*", &l, err, sizeof(err)), TSR_OK);
        d.zmq_listener = &l;
        d.size = 0;
        assert_int_equal(tsr_comm_new(&d, &c, err, sizeof(err)), TSR_E_INVAL);
        assert_null(l);                                                            /* taken anyway */
        assert_null(c);
}

/* ---- NCCL -------------------------------------------------------------------------------- */

/* In a child process: ncclGetUniqueId starts a bootstrap thread and socket that live as
 * long as the process, and NCCL's allocations are not ours to leak-check. */
static void test_nccl_unique_id(void **state) {
        if (!tsr_comm_nccl_available()) {
                char err[128];
                tsr_comm_nccl_id id;
                assert_int_equal(tsr_comm_nccl_unique_id(&id, err, sizeof(err)), TSR_E_UNSUPPORTED);
                TSR_SKIP("no-gpu", "this build has no NCCL backend (no CUDA toolkit / nccl.h), so no id to make");
        }
        struct shared {
                int st, init_st;
                tsr_comm_nccl_id id;
                char err[256];
        } *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        assert_true(sh != MAP_FAILED);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
                child_signals();
                sh->st = tsr_comm_nccl_unique_id(&sh->id, sh->err, sizeof(sh->err));
                if (sh->st == TSR_OK) {
                        /* No device here: init must fail cleanly (cudaSetDevice), never hang. */
                        tsr_comm *c = NULL;
                        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_NCCL, .rank = 0, .size = 1,
                                           .nccl_id = &sh->id, .timeout_ms = 5000};
                        sh->init_st = tsr_comm_new(&d, &c, sh->err, sizeof(sh->err));
                        tsr_comm_free(&c);
                }
                _exit(0);
        }
        procs p = {.n = 1, .pid = {pid}, .up = {-1}, .down = {-1}};
        int code;
        reap(&p, 60000, &code);
        assert_int_equal(code, 0);
        if (sh->st != TSR_OK) {
                print_message("ncclGetUniqueId: %s\n", sh->err);
                if (access("/dev/nvidia0", F_OK) == 0)
                        fail_msg("ncclGetUniqueId failed on a machine with a GPU: %s", sh->err);
                TSR_SKIP("no-gpu", "ncclGetUniqueId does not work without a device here: %s", sh->err);
        }
        bool nonzero = false;
        for (size_t i = 0; i < sizeof(sh->id.bytes); i++)
                nonzero |= sh->id.bytes[i] != 0;
        assert_true(nonzero);
        if (access("/dev/nvidia0", F_OK) != 0) {
                print_message("nccl init without a device: %s (%s)\n", tsr_status_str(sh->init_st), sh->err);
                assert_int_not_equal(sh->init_st, TSR_OK);
        }
        munmap(sh, sizeof(*sh));
}

/* ---- the multi-node step plan (nodes.h) ---- */

/* Every field of out[i] as in[i], each with nt block tables. */
static void assert_seqs_equal(const tsr_engine_seq *in, const tsr_engine_seq *out, size_t n, size_t nt) {
        for (size_t i = 0; i < n; i++) {
                assert_int_equal(out[i].seq_id, in[i].seq_id);
                assert_int_equal(out[i].n_table, in[i].n_table);
                assert_int_equal(out[i].n, in[i].n);
                assert_int_equal(out[i].past_len, in[i].past_len);
                assert_int_equal(out[i].want_logits, in[i].want_logits);
                assert_int_equal(out[i].want_all_logits, in[i].want_all_logits);
                assert_int_equal(out[i].state_slot, in[i].state_slot);
                assert_int_equal(out[i].restore_state, in[i].restore_state);
                assert_int_equal(out[i].restore_from, in[i].restore_from);
                assert_int_equal(out[i].n_saves, in[i].n_saves);
                assert_int_equal(out[i].prompt_len, in[i].prompt_len);
                if (in[i].n_saves)
                        assert_memory_equal(out[i].saves, in[i].saves, in[i].n_saves * sizeof(tsr_state_save));
                if (in[i].n_table)
                        assert_memory_equal(out[i].block_table, in[i].block_table, nt * in[i].n_table * sizeof(uint32_t));
                assert_memory_equal(out[i].tokens, in[i].tokens, in[i].n * sizeof(uint32_t));
        }
}

#define SEQ_WORDS_TEST 13       /* nodes.c SEQ_WORDS: a sequence's header words */

static void test_nodes_plan_round_trip(void **state) {
        (void)state;
        const uint32_t t0[] = {7, 3, 9}, k0[] = {11, 12, 13, 14, 15}, t1[] = {4, TSR_KV_NULL_BLOCK}, k1[] = {99};
        const tsr_state_save sv[2] = {{.pos = 2, .slot = 0}, {.pos = 4, .slot = 5}};
        tsr_engine_seq in[3] = {
                {.block_table = t0, .n_table = 3, .tokens = k0, .n = 5, .past_len = 0, .want_logits = true,
                 .want_all_logits = true, .state_slot = 2, .saves = sv, .n_saves = 2, .prompt_len = 5},
                {.block_table = t1, .n_table = 2, .tokens = k1, .n = 1, .past_len = (size_t)1 << 33,
                 .want_logits = true, .state_slot = 1, .restore_state = true, .restore_from = 7,
                 .prompt_len = 300000},
                {.block_table = t1, .n_table = 0, .tokens = k0, .n = 2, .past_len = 5},
        };
        uint8_t *buf;
        size_t len, n;
        tsr_engine_seq *out;
        in[1].seq_id = (uint64_t)1 << 40 | 3;
        /* a row the engine offers as its token comes back so (flag 4), one of all the
         * chunk's rows does not */
        uint32_t slot = 0;
        const tsr_draw draw = {.temperature = 0.5f, .top_p = 1.0f, .u = 0.25};
        in[1].token = &slot;
        in[0].token = &slot;
        assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
        assert_int_equal(n, 3);
        assert_seqs_equal(in, out, 3, 1);
        assert_null(out[0].token);
        assert_non_null(out[1].token);
        assert_int_equal(*out[1].token, TSR_ENGINE_TOKEN_UNSET);
        assert_null(out[2].token);
        free(out);
        free(buf);
        in[1].draw = &draw;     /* drawn: its parameters and uniform travel (flag 8) */
        assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
        assert_seqs_equal(in, out, 3, 1);
        assert_non_null(out[1].token);
        assert_non_null(out[1].draw);
        assert_memory_equal(out[1].draw, &draw, sizeof draw);
        assert_null(out[0].draw);
        assert_null(out[1].lp);
        free(out);
        free(buf);
        /* with its logprobs (flag 16): lp_top travels, after the draw; on a row that does
         * not come back as its token (in[0]) logprobs are not asked of the last node */
        tsr_token_logprobs lp_slot;
        in[1].lp = &lp_slot;
        in[1].lp_top = 3;
        in[0].lp = &lp_slot;
        in[0].lp_top = 5;
        for (int drawn = 1; drawn >= 0; drawn--) {
                in[1].draw = drawn ? &draw : NULL;
                assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
                assert_seqs_equal(in, out, 3, 1);
                assert_non_null(out[1].lp);
                assert_int_equal(out[1].lp_top, 3);
                assert_true(drawn ? out[1].draw && memcmp(out[1].draw, &draw, sizeof draw) == 0 : !out[1].draw);
                assert_null(out[0].lp);
                assert_null(out[2].lp);
                free(out);
                /* the flags word of sequence 1 says 21 or 29; its lp_top above 20 is refused */
                uint32_t *w = (uint32_t *)buf;
                size_t at = 1 + SEQ_WORDS_TEST + 3 + 5 + 2 * 2;   /* seq 0: header, 3 table entries, 5 tokens, 2 saves */
                assert_int_equal(w[at + 6], drawn ? 29u : 21u);
                size_t lp_word = at + SEQ_WORDS_TEST + (drawn ? 6 : 0);
                assert_int_equal(w[lp_word], 3);
                w[lp_word] = TSR_SAMPLER_MAX_LOGPROBS + 1;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[lp_word] = TSR_SAMPLER_MAX_LOGPROBS;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
                assert_int_equal(out[1].lp_top, TSR_SAMPLER_MAX_LOGPROBS);
                free(out);
                free(buf);
        }
        in[0].lp = in[1].lp = NULL;

        /* with its rules (flag 32): allowed ids, bias pairs and, below min_tokens, the EOS
         * and stop ids, after lp_top; unpacked as a sampling whose min_tokens masks those
         * ids at n_output 0; a list count past the plan is refused */
        const uint32_t allowed[] = {4, 9, 77}, eos[] = {2}, stop[] = {5, 6};
        const tsr_logit_bias bias[] = {{.id = 9, .bias = -1.5f}, {.id = 77, .bias = 2.25f}};
        tsr_sampling rules;
        tsr_sampling_init(&rules);
        rules.allowed_ids = allowed;
        rules.n_allowed = 3;
        rules.bias = bias;
        rules.n_bias = 2;
        rules.eos_ids = eos;
        rules.n_eos = 1;
        rules.stop_ids = stop;
        rules.n_stop = 2;
        rules.min_tokens = 4;
        rules.presence_penalty = 0.0f;
        in[1].rules = &rules;
        in[0].rules = &rules;   /* not a token back: nothing travels */
        in[1].lp = &lp_slot;
        in[1].lp_top = 2;
        for (int masked = 1; masked >= 0; masked--) {
                in[1].rules_mask_eos = masked;
                in[1].draw = masked ? &draw : NULL;
                assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
                assert_seqs_equal(in, out, 3, 1);
                assert_null(out[0].rules);
                assert_null(out[2].rules);
                const tsr_sampling *r = out[1].rules;
                assert_non_null(r);
                assert_int_equal(r->n_allowed, 3);
                assert_memory_equal(r->allowed_ids, allowed, sizeof allowed);
                assert_int_equal(r->n_bias, 2);
                assert_memory_equal(r->bias, bias, sizeof bias);
                assert_int_equal(r->n_eos, masked ? 3 : 0);
                if (masked) {
                        const uint32_t want[] = {2, 5, 6};
                        assert_memory_equal(r->eos_ids, want, sizeof want);
                }
                assert_int_equal(r->min_tokens, masked ? 1 : 0);
                assert_int_equal(r->n_stop, 0);
                assert_true(r->temperature == 1.0f && r->repetition_penalty == 1.0f && r->logprobs == -1);
                assert_int_equal(out[1].lp_top, 2);
                assert_true(masked ? out[1].draw && memcmp(out[1].draw, &draw, sizeof draw) == 0 : !out[1].draw);
                free(out);
                uint32_t *w = (uint32_t *)buf;
                size_t at = 1 + SEQ_WORDS_TEST + 3 + 5 + 2 * 2;
                assert_int_equal(w[at + 6], masked ? 61u : 53u);
                size_t counts = at + SEQ_WORDS_TEST + (masked ? 6 : 0) + 1;
                assert_int_equal(w[counts], 3);
                assert_int_equal(w[counts + 1], 2);
                w[counts + 1] = 1u << 30;       /* bias pairs past the plan */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[counts + 1] = 2;
                w[at + 6] = 32;                 /* rules on a row that does not come back */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                free(buf);
        }
        /* with penalties (flag 128): the three penalties and the request's tokens so far
         * after the rules' lists; a history shorter than the prompt, or past the plan, or
         * without the rules flag, is refused */
        const uint32_t hist[] = {5, 6, 7, 8, 9, 10, 11};
        rules.presence_penalty = 0.25f;
        rules.frequency_penalty = -0.5f;
        rules.repetition_penalty = 1.3f;
        in[1].history = hist;
        in[1].n_history = 7;
        in[1].prompt_len = 5;
        in[1].rules_mask_eos = false;
        in[1].draw = &draw;
        assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
        assert_seqs_equal(in, out, 3, 1);
        assert_int_equal(out[1].n_history, 7);
        assert_memory_equal(out[1].history, hist, sizeof hist);
        assert_true(out[1].rules->presence_penalty == 0.25f && out[1].rules->frequency_penalty == -0.5f &&
                    out[1].rules->repetition_penalty == 1.3f);
        assert_int_equal(out[1].rules->n_bias, 2);
        assert_null(out[0].history);
        free(out);
        {
                uint32_t *w = (uint32_t *)buf;
                size_t at = 1 + SEQ_WORDS_TEST + 3 + 5 + 2 * 2;
                assert_int_equal(w[at + 6], 128u | 32u | 16u | 8u | 4u | 1u);
                size_t nh = at + SEQ_WORDS_TEST + 6 + 1 + 3 + 3 + 2 * 2 + 3;   /* draw, lp_top, counts, lists */
                assert_int_equal(w[nh], 7);
                w[nh] = 4;                      /* fewer than the prompt's 5 */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[nh] = 1u << 30;               /* past the plan */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[nh] = 7;
                w[at + 6] &= ~32u;              /* a history without rules */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
        }
        free(buf);
        in[1].history = NULL;
        in[1].n_history = 0;
        in[1].prompt_len = 300000;
        in[1].draw = NULL;
        in[0].rules = in[1].rules = NULL;
        in[1].lp = NULL;

        /* under a grammar (flag 256): n_mask_words and the mask's words travel after the
         * other lists, with or without rules; not on a row that does not come back (in[0]);
         * a zero count or one past the plan is refused */
        const uint32_t gmask[3] = {0x12345678u, 0xffffffffu, 0x1u};
        for (int with_rules = 0; with_rules < 2; with_rules++) {
                in[1].rules = with_rules ? &rules : NULL;
                in[1].grammar_mask = gmask;
                in[1].grammar_mask_words = 3;
                in[0].grammar_mask = gmask;
                in[0].grammar_mask_words = 3;
                assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
                assert_seqs_equal(in, out, 3, 1);
                assert_null(out[0].grammar_mask);
                assert_int_equal(out[1].grammar_mask_words, 3);
                assert_memory_equal(out[1].grammar_mask, gmask, sizeof gmask);
                assert_true(with_rules ? out[1].rules != NULL : out[1].rules == NULL);
                free(out);
                uint32_t *w = (uint32_t *)buf;
                size_t at = 1 + SEQ_WORDS_TEST + 3 + 5 + 2 * 2;
                assert_int_equal(w[at + 6], 256u | (with_rules ? 32u : 0u) | 4u | 1u);
                size_t mw = at + SEQ_WORDS_TEST + (with_rules ? 3 + 3 + 2 * 2 : 0);
                assert_int_equal(w[mw], 3);
                w[mw] = 0;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[mw] = 1u << 30;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                free(buf);
        }
        in[0].grammar_mask = in[1].grammar_mask = NULL;
        in[0].grammar_mask_words = in[1].grammar_mask_words = 0;
        in[1].rules = NULL;

        /* a prompt-logprobs chunk (flag 64, all rows): prompt_lp_top and next_token travel;
         * not on a chunk that does not return all its rows (in[1]) */
        tsr_token_logprobs plp[5];
        in[0].prompt_lp = plp;
        in[0].prompt_lp_top = 4;
        in[0].next_token = 123;
        in[1].prompt_lp = plp;
        in[1].token = NULL;
        assert_int_equal(tsr_nodes_plan_pack(NULL, in, 3, 1, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
        assert_seqs_equal(in, out, 3, 1);
        assert_non_null(out[0].prompt_lp);
        assert_int_equal(out[0].prompt_lp_top, 4);
        assert_int_equal(out[0].next_token, 123);
        assert_null(out[1].prompt_lp);
        assert_null(out[2].prompt_lp);
        free(out);
        {
                uint32_t *w = (uint32_t *)buf;
                assert_int_equal(w[1 + 6], 67u);        /* want_logits | want_all_logits | 64 */
                w[1 + SEQ_WORDS_TEST] = TSR_SAMPLER_MAX_LOGPROBS + 1;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[1 + SEQ_WORDS_TEST] = 4;
                w[1 + 6] = 64 | 4 | 1;                  /* prompt rows on a token back: refused */
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
        }
        free(buf);
        in[0].prompt_lp = in[1].prompt_lp = NULL;
        in[1].token = &slot;

        /* a hybrid's two tables per sequence (full attention, then chunked-local), one
         * after the other: every entry crosses; read as one table, the plan is refused */
        const uint32_t two[] = {1, 2, 3, TSR_KV_NULL_BLOCK, 5, 6}, tok[] = {42, 43};
        tsr_engine_seq h[1] = {{.block_table = two, .n_table = 3, .tokens = tok, .n = 2, .past_len = 40,
                                .want_logits = true}};
        assert_int_equal(tsr_nodes_plan_pack(NULL, h, 1, 2, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 2, &out, &n), TSR_OK);
        assert_int_equal(n, 1);
        assert_int_equal(out[0].n_table, 3);
        assert_memory_equal(out[0].block_table, two, sizeof two);
        assert_memory_equal(out[0].tokens, tok, sizeof tok);
        free(out);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
        free(buf);
}

/* Every truncation and a few corruptions of a good plan are refused, never read past
 * the buffer (the ASan build checks that too). */
static void test_nodes_plan_malformed(void **state) {
        (void)state;
        const uint32_t t0[] = {1, 2}, k0[] = {5, 6, 7};
        tsr_engine_seq in[2] = {{.block_table = t0, .n_table = 2, .tokens = k0, .n = 3, .want_logits = true},
                                {.block_table = t0, .n_table = 1, .tokens = k0, .n = 1, .past_len = 3}};
        uint8_t *buf;
        size_t len, n;
        tsr_engine_seq *out = NULL;
        assert_int_equal(tsr_nodes_plan_pack(NULL, in, 2, 1, &buf, &len), TSR_OK);
        for (size_t cut = 0; cut < len; cut++) {
                uint8_t *c = malloc(cut ? cut : 1);
                memcpy(c, buf, cut);
                assert_int_equal(tsr_nodes_plan_unpack(NULL, c, cut, 1, &out, &n), TSR_E_PROTO);
                free(c);
        }
        /* the first sequence's header: words 1-2 seq_id, 3 n_table, 4 n, 7 flags, 11 base,
         * 12 n_changes (13 prompt_len: any value) */
        uint32_t *w = (uint32_t *)buf;
        const struct { size_t word; uint32_t value; } bad[] = {
                {0, 3}, {0, 0xffffffffu}, {3, 1000}, {4, 0}, {4, 0x40000000u}, {7, 4}, {3, 3},
                {11, 1}, {11, 3}, {12, 1}, {12, 0x80000000u}, {7, 6}, {7, 7}, {7, 8}, {7, 9}, {7, 12}, {7, 13}, {7, 16},
                {7, 17}, {7, 20}, {7, 21}, {7, 24}, {7, 29}, {7, 31},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                uint32_t keep = w[bad[i].word];
                w[bad[i].word] = bad[i].value;
                assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_E_PROTO);
                w[bad[i].word] = keep;
        }
        uint8_t *longer = calloc(1, len + 4);
        memcpy(longer, buf, len);
        assert_int_equal(tsr_nodes_plan_unpack(NULL, longer, len + 4, 1, &out, &n), TSR_E_PROTO);   /* trailing words */
        assert_int_equal(tsr_nodes_plan_unpack(NULL, buf, len, 1, &out, &n), TSR_OK);
        free(out);
        free(longer);
        free(buf);
}

/* One plan from the leader's copy of the tables to a follower's: the follower decodes
 * exactly the leader's sequences, and both copies then hold the same ids.  The plan's
 * bytes. */
static size_t plan_trip(tsr_plan_tables *lead, tsr_plan_tables *follow, const tsr_engine_seq *seqs, size_t n_seqs,
                        uint32_t nt) {
        uint8_t *buf;
        size_t len, n;
        tsr_engine_seq *out;
        assert_int_equal(tsr_nodes_plan_pack(lead, seqs, n_seqs, nt, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(follow, buf, len, nt, &out, &n), TSR_OK);
        assert_int_equal(n, n_seqs);
        assert_seqs_equal(seqs, out, n_seqs, nt);
        assert_int_equal(lead->n, follow->n);
        assert_int_equal(lead->plans, follow->plans);
        for (size_t i = 0; i < lead->n; i++) {
                assert_int_equal(lead->e[i].seq_id, follow->e[i].seq_id);
                assert_int_equal(lead->e[i].n_table, follow->e[i].n_table);
                assert_memory_equal(lead->e[i].blocks, follow->e[i].blocks, nt * lead->e[i].n_table * sizeof(uint32_t));
        }
        free(out);
        free(buf);
        return len;
}

/* Block tables as changes (vLLM's scheduler output: new block ids only): appended
 * blocks, a chunked table's entry freed behind its chunk, a new sequence between two
 * known ones, a table that shrank (a preempted request), one with most entries changed,
 * one id twice in a plan, ids forgotten after TSR_PLAN_TABLES_AGE plans on both ends;
 * and a follower without the leader's copy refuses the changes. */
static void test_nodes_plan_deltas(void **state) {
        (void)state;
        tsr_plan_tables lead = {0}, follow = {0}, empty = {0};
        const uint32_t tok[] = {5};
        uint32_t a1[] = {1, 2, 3, 4, 5, 6}, a2[] = {1, 2, 3, 7, TSR_KV_NULL_BLOCK, 5, 6, 8}, b1[] = {9, 10},
                 c1[] = {11, 12, 13, 14}, a3[] = {20, 21}, a4[] = {30, 31, 32, 33, 34, 35, 36, 37}, z1[] = {1, 2},
                 z2[] = {3, 4, 5, 6, 7, 8}, z3[] = {3, 4, 5, 9, 6, 7, 8, 10};
        /* two tables per sequence (a hybrid: full attention, then chunked-local) */
        tsr_engine_seq p1[2] = {{.seq_id = 5, .block_table = a1, .n_table = 3, .tokens = tok, .n = 1, .past_len = 9,
                                 .want_logits = true},
                                {.seq_id = 9, .block_table = b1, .n_table = 1, .tokens = tok, .n = 1, .past_len = 2,
                                 .want_logits = true}};
        size_t whole = plan_trip(&lead, &follow, p1, 2, 2);
        assert_int_equal(lead.words_sent, lead.words_whole);   /* nothing known yet: whole tables */

        /* a: one block appended to each table, the chunked one's first entry freed; b the
         * same; c new, between them by id */
        tsr_engine_seq p2[3] = {p1[0], p1[1], {.seq_id = 7, .block_table = c1, .n_table = 2, .tokens = tok, .n = 1,
                                               .past_len = 1, .want_logits = true}};
        p2[0].block_table = a2;
        p2[0].n_table = 4;
        uint64_t sent = lead.words_sent;
        size_t len = plan_trip(&lead, &follow, p2, 3, 2);
        /* a: one change pair + one new entry per table; b: nothing; c: whole (2 x 2) */
        assert_int_equal(lead.words_sent - sent, 2 + 2 + 0 + 4);
        /* n_seqs, three headers of 13 words, those 8 table words, three tokens */
        assert_int_equal(len, (1 + 3 * 13 + 8 + 3) * sizeof(uint32_t));
        assert_int_equal(whole, (1 + 2 * 13 + 6 + 2 + 2) * sizeof(uint32_t));

        /* a preempted and readmitted: fewer blocks, whole again; then most changed: whole */
        tsr_engine_seq p3[1] = {p1[0]};
        p3[0].block_table = a3;
        p3[0].n_table = 1;
        sent = lead.words_sent;
        plan_trip(&lead, &follow, p3, 1, 2);
        assert_int_equal(lead.words_sent - sent, 2);
        p3[0].block_table = a4;
        p3[0].n_table = 4;
        sent = lead.words_sent;
        plan_trip(&lead, &follow, p3, 1, 2);
        assert_int_equal(lead.words_sent - sent, 8);   /* 2 of 2 known entries changed: whole */

        /* an id twice in one plan (0: sequences nobody numbered): each against the copy
         * from before the plan (none: whole), and the next plan's against the last */
        tsr_engine_seq p4[2] = {{.block_table = z1, .n_table = 1, .tokens = tok, .n = 1, .want_logits = true},
                                {.block_table = z2, .n_table = 3, .tokens = tok, .n = 1, .want_logits = true}};
        plan_trip(&lead, &follow, p4, 2, 2);
        tsr_engine_seq p5[1] = {{.block_table = z3, .n_table = 4, .tokens = tok, .n = 1, .want_logits = true}};
        sent = lead.words_sent;
        plan_trip(&lead, &follow, p5, 1, 2);
        assert_int_equal(lead.words_sent - sent, 2);   /* one appended per table */

        /* a change whose index is past the tables, or in an entry past the base, or a
         * base other than the table this end holds: refused; the plan as sent: decoded */
        uint8_t *buf;
        size_t n;
        tsr_engine_seq *out;
        uint32_t z4[] = {3, 99, 5, 9, 6, 7, 8, 10};
        p5[0].block_table = z4;
        assert_int_equal(tsr_nodes_plan_pack(&lead, p5, 1, 2, &buf, &len), TSR_OK);
        uint32_t *w = (uint32_t *)buf;
        assert_int_equal(w[11], 4);     /* base */
        assert_int_equal(w[12], 1);     /* one change: (1, 99) */
        assert_int_equal(w[14], 1);     /* after the header's 13 words (prompt_len the last) */
        assert_int_equal(w[15], 99);
        const struct { size_t word; uint32_t value; } bad[] = {{14, 8}, {14, 0xffffffffu}, {11, 3}, {11, 2}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                uint32_t keep = w[bad[i].word];
                w[bad[i].word] = bad[i].value;
                assert_int_equal(tsr_nodes_plan_unpack(&follow, buf, len, 2, &out, &n), TSR_E_PROTO);
                w[bad[i].word] = keep;
        }
        assert_int_equal(tsr_nodes_plan_unpack(&follow, buf, len, 2, &out, &n), TSR_OK);
        assert_memory_equal(out[0].block_table, z4, sizeof z4);
        free(out);
        free(buf);

        /* a plan with changes to a follower that never held the tables: refused */
        p5[0].block_table = z3;
        assert_int_equal(tsr_nodes_plan_pack(&lead, p5, 1, 2, &buf, &len), TSR_OK);
        assert_int_equal(tsr_nodes_plan_unpack(&empty, buf, len, 2, &out, &n), TSR_E_PROTO);
        free(buf);
        tsr_plan_tables_clear(&lead);
        tsr_plan_tables_clear(&follow);
        tsr_plan_tables_clear(&empty);
        memset(&lead, 0, sizeof lead);  /* a new group on both ends */
        memset(&follow, 0, sizeof follow);

        /* aging: an id none of the last TSR_PLAN_TABLES_AGE plans held is forgotten by
         * both ends and sent whole when it comes back */
        plan_trip(&lead, &follow, p1, 1, 2);
        for (int i = 0; i < TSR_PLAN_TABLES_AGE - 1; i++)
                plan_trip(&lead, &follow, p1 + 1, 1, 2);
        assert_int_equal(lead.n, 2);    /* seq 5 in the last TSR_PLAN_TABLES_AGE plans: kept */
        plan_trip(&lead, &follow, p1 + 1, 1, 2);
        assert_int_equal(lead.n, 1);
        sent = lead.words_sent;
        plan_trip(&lead, &follow, p1, 1, 2);
        assert_int_equal(lead.words_sent - sent, 6);
        tsr_plan_tables_clear(&lead);
        tsr_plan_tables_clear(&follow);
}

int main(void) {
        /* A peer killed mid-send must not kill us through SIGPIPE. */
        signal(SIGPIPE, SIG_IGN);
        /* TSR_COMM_TEST=name runs the cases matching it (cmocka's filter), for repeat runs. */
        if (getenv("TSR_COMM_TEST"))
                cmocka_set_test_filter(getenv("TSR_COMM_TEST"));
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_tree_sum_order),
                cmocka_unit_test(test_local_conformance_1_to_8),
                cmocka_unit_test(test_r7_invariant_over_tp),
                cmocka_unit_test(test_local_abort_wakes_every_waiter),
                cmocka_unit_test(test_local_missing_rank_times_out),
                cmocka_unit_test(test_local_bad_input),
                cmocka_unit_test(test_local_overlapping_buffers_refused),
                cmocka_unit_test(test_zmq_conformance_2_to_4),
                cmocka_unit_test(test_zmq_garbage_frames_dropped),
                cmocka_unit_test(test_zmq_kill9_peer_is_an_error),
                cmocka_unit_test(test_zmq_abort_reaches_peers),
                cmocka_unit_test(test_zmq_missing_rank_times_out),
                cmocka_unit_test(test_zmq_buffered_bytes_capped),
                cmocka_unit_test(test_zmq_other_epoch_refused),
                cmocka_unit_test(test_zmq_bad_desc),
                cmocka_unit_test(test_nccl_unique_id),
                cmocka_unit_test(test_zmq_progress_sees_a_lost_idle_peer),
                cmocka_unit_test(test_nodes_plan_round_trip),
                cmocka_unit_test(test_nodes_plan_malformed),
                cmocka_unit_test(test_nodes_plan_deltas),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
