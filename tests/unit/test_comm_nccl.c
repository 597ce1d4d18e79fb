/* worker/parallel/comm_nccl.c on real GPUs (issue #20; suite 'gpu').
 *
 * The development machines have no GPU, so this is the first program that runs the NCCL
 * backend for real; scripts/gpu-check.sh runs it whenever a device is lent.  For every
 * group size s in {1, 2, 4, 8} that fits the visible devices, s rank threads (rank r on
 * device r, one communicator each, the id made once by ncclGetUniqueId) run:
 *   - all_reduce_sum over several sizes of integer-valued floats, whose sums are exact
 *     in any order, so every rank must hold the serial reference tree's bits; and over
 *     floats spread across 40 binades (NCCL's order is its own: bitwise for s <= 2,
 *     where a + b = b + a, else within a relative bound);
 *   - all_gather, broadcast from the last rank, a ring of send/recv in one group (s = 1:
 *     to itself), barrier;
 *   - the failure paths: an all-reduce that the other ranks never join times out at the
 *     deadline (its kernel is stopped by ncclCommAbort), and one cancelled by
 *     tsr_comm_abort from another thread returns promptly; after either, the comm is
 *     failed for good.
 * With a single device, a group of 2 whose second rank never comes must fail its init
 * within the deadline (no hang): the init is non-blocking and polled.
 * Without a device (or without NCCL in the build) it prints "[skip:no-gpu]" and exits 77.
 * Two ranks on one GPU are refused by NCCL ("Duplicate GPU"), so s = 2 needs two GPUs. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "common/clock.h"
#include "worker/parallel/comm.h"
#include "tests/unit/comm_values.h"

#define MAX_RANKS 8
#define TIMEOUT_MS 20000u
#define SHORT_TIMEOUT_MS 1000u
/* A failure path must end within this long past its deadline (ncclCommAbort included). */
#define LATE_MS 10000u
static const size_t AR_COUNTS[] = {1, 7, 1000, 65539, 1u << 20};
#define N_AR (sizeof(AR_COUNTS) / sizeof(AR_COUNTS[0]))
#define AG_BYTES 4099
#define BC_BYTES 1001
#define RING_BYTES 129000

static int failures;
static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...) do {                                                          \
                if (!(cond)) {                                                         \
                        pthread_mutex_lock(&report_lock);                              \
                        failures++;                                                    \
                        printf("FAIL %s:%d: ", __FILE__, __LINE__);                    \
                        printf(__VA_ARGS__);                                           \
                        printf("\n");                                                  \
                        pthread_mutex_unlock(&report_lock);                            \
                }                                                                      \
        } while (0)

/* Integers in [-1000, 1000]: any order of 8 additions is exact in float32. */
static float exact_value(uint32_t rank, uint32_t seed, size_t i) {
        return (float)((int)(value_hash(rank, seed, i) % 2001u) - 1000);
}

static unsigned char byte_of(int rank, uint32_t seed, size_t i) {
        return (unsigned char)(value_hash((uint32_t)rank, seed, i) >> 24);
}

/* The reference: the balanced pairwise tree over the ranks' values of element i. */
static float tree_of(float (*f)(uint32_t, uint32_t, size_t), int n, uint32_t seed, size_t i) {
        float parts[MAX_RANKS];
        const float *ptrs[MAX_RANKS];
        for (int q = 0; q < n; q++) {
                parts[q] = f((uint32_t)q, seed, i);
                ptrs[q] = &parts[q];
        }
        float out;
        tsr_comm_tree_sum(ptrs, n, &out, 1);
        return out;
}

typedef struct group_run {
        int size;
        tsr_comm_nccl_id id;
        /* the failure phase: 0 none, 1 rank 0 waits alone until the deadline, 2 rank 0's
         * wait is cancelled by another thread */
        int failure;
} group_run;

typedef struct rank_arg {
        group_run *g;
        int rank;
} rank_arg;

static void *dev_alloc(size_t bytes) {
        void *p = NULL;
        return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}

static void check_all_reduce(tsr_comm *c, int n, int me, bool spread) {
        float (*f)(uint32_t, uint32_t, size_t) = spread ? value : exact_value;
        for (size_t k = 0; k < N_AR; k++) {
                size_t count = AR_COUNTS[k];
                uint32_t seed = (uint32_t)k + (spread ? 100u : 0u);
                float *h = malloc(count * sizeof(float));
                float *d = dev_alloc(count * sizeof(float));
                CHECK(h && d, "rank %d: no memory for %zu floats", me, count);
                if (!h || !d) {
                        free(h);
                        cudaFree(d);
                        return;
                }
                for (size_t i = 0; i < count; i++)
                        h[i] = f((uint32_t)me, seed, i);
                cudaMemcpy(d, h, count * sizeof(float), cudaMemcpyHostToDevice);
                tsr_status st = tsr_comm_all_reduce_sum(c, d, count, NULL);
                if (st == TSR_OK)
                        st = tsr_comm_sync(c, NULL);
                CHECK(st == TSR_OK, "rank %d/%d: all_reduce %zu: %s", me, n, count, tsr_status_str(st));
                cudaMemcpy(h, d, count * sizeof(float), cudaMemcpyDeviceToHost);
                size_t bad = 0;
                double worst = 0;
                for (size_t i = 0; i < count; i++) {
                        float want = tree_of(f, n, seed, i);
                        if (!spread || n <= 2) {
                                bad += memcmp(&h[i], &want, sizeof(float)) != 0;
                        } else {
                                /* n <= 8 values below 2^20 * 1.003: every partial sum is
                                 * below 2^24, where an ulp is at most 2, and two orders
                                 * differ by at most (n - 1) half-ulp roundings each. */
                                double tol = (double)(n - 1) * 2.0;
                                double e = fabs((double)h[i] - (double)want);
                                worst = e > worst ? e : worst;
                                bad += e > tol;
                        }
                }
                CHECK(bad == 0, "rank %d/%d: all_reduce %zu (%s): %zu elements differ from the tree (worst %g)",
                      me, n, count, spread ? "spread" : "exact", bad, worst);
                free(h);
                cudaFree(d);
        }
}

static void check_collectives(tsr_comm *c, int n, int me) {
        unsigned char *h = malloc((size_t)n * AG_BYTES);
        unsigned char *d_in = dev_alloc(AG_BYTES), *d_out = dev_alloc((size_t)n * AG_BYTES);
        unsigned char *d_bc = dev_alloc(BC_BYTES), *d_send = dev_alloc(RING_BYTES), *d_recv = dev_alloc(RING_BYTES);
        unsigned char *h_ring = malloc(RING_BYTES);
        CHECK(h && h_ring && d_in && d_out && d_bc && d_send && d_recv, "rank %d: no memory", me);
        if (!(h && h_ring && d_in && d_out && d_bc && d_send && d_recv))
                goto out;

        /* all_gather: rank-major */
        for (size_t i = 0; i < AG_BYTES; i++)
                h[i] = byte_of(me, 1, i);
        cudaMemcpy(d_in, h, AG_BYTES, cudaMemcpyHostToDevice);
        tsr_status st = tsr_comm_all_gather(c, d_in, d_out, AG_BYTES, NULL);
        if (st == TSR_OK)
                st = tsr_comm_sync(c, NULL);
        CHECK(st == TSR_OK, "rank %d/%d: all_gather: %s", me, n, tsr_status_str(st));
        cudaMemcpy(h, d_out, (size_t)n * AG_BYTES, cudaMemcpyDeviceToHost);
        size_t bad = 0;
        for (int q = 0; q < n; q++)
                for (size_t i = 0; i < AG_BYTES; i++)
                        bad += h[(size_t)q * AG_BYTES + i] != byte_of(q, 1, i);
        CHECK(bad == 0, "rank %d/%d: all_gather: %zu bytes wrong", me, n, bad);

        /* broadcast from the last rank */
        for (size_t i = 0; i < BC_BYTES; i++)
                h[i] = byte_of(me, 2, i);
        cudaMemcpy(d_bc, h, BC_BYTES, cudaMemcpyHostToDevice);
        st = tsr_comm_broadcast(c, d_bc, BC_BYTES, n - 1, NULL);
        if (st == TSR_OK)
                st = tsr_comm_sync(c, NULL);
        CHECK(st == TSR_OK, "rank %d/%d: broadcast: %s", me, n, tsr_status_str(st));
        cudaMemcpy(h, d_bc, BC_BYTES, cudaMemcpyDeviceToHost);
        bad = 0;
        for (size_t i = 0; i < BC_BYTES; i++)
                bad += h[i] != byte_of(n - 1, 2, i);
        CHECK(bad == 0, "rank %d/%d: broadcast: %zu bytes wrong", me, n, bad);

        /* a ring in one group: send to the next rank, receive from the previous one */
        int next = (me + 1) % n, prev = (me + n - 1) % n;
        for (size_t i = 0; i < RING_BYTES; i++)
                h_ring[i] = byte_of(me, 3, i);
        cudaMemcpy(d_send, h_ring, RING_BYTES, cudaMemcpyHostToDevice);
        cudaMemset(d_recv, 0, RING_BYTES);
        st = tsr_comm_group_begin(c);
        if (st == TSR_OK)
                st = tsr_comm_send(c, d_send, RING_BYTES, next, 7, NULL);
        if (st == TSR_OK)
                st = tsr_comm_recv(c, d_recv, RING_BYTES, prev, 7, NULL);
        tsr_status end = tsr_comm_group_end(c);
        if (st == TSR_OK)
                st = end;
        if (st == TSR_OK)
                st = tsr_comm_sync(c, NULL);
        CHECK(st == TSR_OK, "rank %d/%d: ring: %s", me, n, tsr_status_str(st));
        cudaMemcpy(h_ring, d_recv, RING_BYTES, cudaMemcpyDeviceToHost);
        bad = 0;
        for (size_t i = 0; i < RING_BYTES; i++)
                bad += h_ring[i] != byte_of(prev, 3, i);
        CHECK(bad == 0, "rank %d/%d: ring from rank %d: %zu bytes wrong", me, n, prev, bad);

        st = tsr_comm_barrier(c);
        CHECK(st == TSR_OK, "rank %d/%d: barrier: %s", me, n, tsr_status_str(st));
out:
        free(h);
        free(h_ring);
        cudaFree(d_in);
        cudaFree(d_out);
        cudaFree(d_bc);
        cudaFree(d_send);
        cudaFree(d_recv);
}

typedef struct canceller {
        tsr_comm *c;
        unsigned delay_ms;
} canceller;

static void *cancel_later(void *arg) {
        canceller *k = arg;
        struct timespec ts = {.tv_sec = k->delay_ms / 1000, .tv_nsec = (long)(k->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        tsr_comm_abort(k->c);
        return NULL;
}

/* Rank 0 issues an all-reduce that no other rank joins. */
static void check_failure(tsr_comm *c, int n, int kind) {
        float *d = dev_alloc(1024 * sizeof(float));
        CHECK(d, "no memory");
        if (!d)
                return;
        cudaMemset(d, 0, 1024 * sizeof(float));
        pthread_t th;
        canceller k = {.c = c, .delay_ms = 200};
        tsr_comm_set_timeout(c, kind == 1 ? SHORT_TIMEOUT_MS : TIMEOUT_MS);
        if (kind == 2)
                pthread_create(&th, NULL, cancel_later, &k);
        uint64_t t0 = tsr_now_ns();
        tsr_status st = tsr_comm_all_reduce_sum(c, d, 1024, NULL);
        if (st == TSR_OK)
                st = tsr_comm_sync(c, NULL);
        double ms = (double)(tsr_now_ns() - t0) / 1e6;
        if (kind == 2)
                pthread_join(th, NULL);
        tsr_status want = kind == 1 ? TSR_E_TIMEOUT : TSR_E_CANCELLED;
        printf("group of %d: an all-reduce rank 0 waits on alone, %s: %s after %.0f ms\n", n,
               kind == 1 ? "deadline 1000 ms" : "cancelled at 200 ms", tsr_status_str(st), ms);
        CHECK(st == want, "group of %d: %s, wanted %s", n, tsr_status_str(st), tsr_status_str(want));
        double limit = kind == 1 ? SHORT_TIMEOUT_MS + LATE_MS : 200 + LATE_MS;
        CHECK(ms < limit, "group of %d: the failure took %.0f ms (limit %.0f)", n, ms, limit);
        st = tsr_comm_barrier(c);
        CHECK(st == want, "group of %d: the comm is not failed for good after %s: %s", n, tsr_status_str(want),
              tsr_status_str(st));
        cudaFree(d);
}

static void *rank_main(void *arg) {
        rank_arg *a = arg;
        group_run *g = a->g;
        char err[256] = "";
        tsr_comm_desc desc = {.backend = TSR_COMM_BACKEND_NCCL, .rank = a->rank, .size = g->size,
                              .timeout_ms = TIMEOUT_MS, .nccl_id = &g->id, .cuda_device = a->rank};
        tsr_comm *c = NULL;
        tsr_status st = tsr_comm_new(&desc, &c, err, sizeof(err));
        CHECK(st == TSR_OK, "rank %d/%d: init: %s (%s)", a->rank, g->size, tsr_status_str(st), err);
        if (st != TSR_OK)
                return NULL;
        CHECK(strcmp(tsr_comm_backend_name(c), "nccl") == 0, "backend %s", tsr_comm_backend_name(c));
        check_all_reduce(c, g->size, a->rank, false);
        check_all_reduce(c, g->size, a->rank, true);
        check_collectives(c, g->size, a->rank);
        if (g->failure && a->rank == 0)
                check_failure(c, g->size, g->failure);
        else if (g->failure)
                tsr_comm_set_timeout(c, SHORT_TIMEOUT_MS);   /* the others' finalize may not complete */
        uint64_t t0 = tsr_now_ns();
        tsr_comm_free(&c);
        double ms = (double)(tsr_now_ns() - t0) / 1e6;
        CHECK(ms < SHORT_TIMEOUT_MS + LATE_MS || !g->failure, "rank %d/%d: free took %.0f ms", a->rank, g->size, ms);
        return NULL;
}

static void run_group(int size, int failure) {
        group_run g = {.size = size, .failure = failure};
        char err[256] = "";
        tsr_status st = tsr_comm_nccl_unique_id(&g.id, err, sizeof(err));
        CHECK(st == TSR_OK, "ncclGetUniqueId: %s (%s)", tsr_status_str(st), err);
        if (st != TSR_OK)
                return;
        pthread_t th[MAX_RANKS];
        rank_arg args[MAX_RANKS];
        int before = failures;
        uint64_t t0 = tsr_now_ns();
        for (int r = 0; r < size; r++) {
                args[r] = (rank_arg){.g = &g, .rank = r};
                pthread_create(&th[r], NULL, rank_main, &args[r]);
        }
        for (int r = 0; r < size; r++)
                pthread_join(th[r], NULL);
        printf("group of %d (failure phase %d): %s, %.0f ms\n", size, failure,
               failures == before ? "ok" : "FAILED", (double)(tsr_now_ns() - t0) / 1e6);
}

/* One device: rank 0 of a group of 2 whose rank 1 never comes. */
static void check_missing_rank(void) {
        tsr_comm_nccl_id id;
        char err[256] = "";
        tsr_status st = tsr_comm_nccl_unique_id(&id, err, sizeof(err));
        CHECK(st == TSR_OK, "ncclGetUniqueId: %s (%s)", tsr_status_str(st), err);
        if (st != TSR_OK)
                return;
        tsr_comm_desc desc = {.backend = TSR_COMM_BACKEND_NCCL, .rank = 0, .size = 2,
                              .timeout_ms = SHORT_TIMEOUT_MS, .nccl_id = &id, .cuda_device = 0};
        tsr_comm *c = NULL;
        uint64_t t0 = tsr_now_ns();
        st = tsr_comm_new(&desc, &c, err, sizeof(err));
        double ms = (double)(tsr_now_ns() - t0) / 1e6;
        printf("a group of 2 whose rank 1 never comes: %s after %.0f ms (%s)\n", tsr_status_str(st), ms, err);
        CHECK(st == TSR_E_TIMEOUT, "init without the second rank: %s, wanted %s", tsr_status_str(st),
              tsr_status_str(TSR_E_TIMEOUT));
        CHECK(ms < SHORT_TIMEOUT_MS + LATE_MS, "init without the second rank took %.0f ms", ms);
        CHECK(c == NULL, "a comm was returned from a failed init");
        tsr_comm_free(&c);
}

int main(void) {
        setvbuf(stdout, NULL, _IOLBF, 0);
        int n_dev = 0;
        if (!tsr_comm_nccl_available()) {
                printf("[skip:no-gpu] this build has no NCCL backend\n");
                return 77;
        }
        if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
                printf("[skip:no-gpu] no CUDA device\n");
                return 77;
        }
        printf("%d CUDA device%s; NCCL_DEBUG=%s\n", n_dev, n_dev == 1 ? "" : "s",
               getenv("NCCL_DEBUG") ? getenv("NCCL_DEBUG") : "(unset)");
        for (int s = 1; s <= MAX_RANKS && s <= n_dev; s *= 2)
                run_group(s, 0);
        if (n_dev >= 2) {
                run_group(2, 1);
                run_group(2, 2);
        } else {
                check_missing_rank();
                printf("one device: the groups of 2+ ranks need two GPUs (NCCL refuses two ranks on one)\n");
        }
        printf("%s: %d failure%s\n", failures ? "FAILED" : "OK", failures, failures == 1 ? "" : "s");
        return failures ? 1 : 0;
}
