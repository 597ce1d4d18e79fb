/* bench_comm.c - tessera-bench-comm: all-reduce latency of the CPU comm backends
 * (worker/parallel/comm.h).  A benchmark, not a test: it prints numbers and asserts
 * nothing (docs/benchmarks.md, "Comm layer (issue #20)").
 *
 *   tessera-bench-comm --bench [--backends local,zmq] [--ranks 2,4]
 *                      [--sizes 4096,16384,65536,262144,1048576,4194304] [--repeat 3]
 *
 * For each backend, rank count and size (bytes of float32): the ranks (threads for local,
 * processes forked here and joined over tcp://127.0.0.1 for zmq) run all_reduce_sum
 * back to back on their own buffers: 5 warm-up calls, then rounds of N calls with N
 * chosen so a round takes about 0.2 s.  Reported: rank 0's mean time per call, best
 * round of --repeat, in microseconds, and the algorithm bandwidth bytes / time. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "worker/parallel/comm.h"

#define MAX_LIST 16
#define EP_LEN 256

typedef struct bench_cfg {
        size_t bytes;
        int repeat;
} bench_cfg;

/* Runs on every rank; rank 0's best mean (ns per call) goes to *best_ns. */
static tsr_status run_rank(tsr_comm *c, const bench_cfg *cfg, double *best_ns) {
        size_t count = cfg->bytes / sizeof(float);
        float *buf = malloc(count * sizeof(float));
        if (!buf)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < count; i++)
                buf[i] = (float)(i % 97) * 0.25f;
        tsr_status st = TSR_OK;
        for (int i = 0; i < 5 && st == TSR_OK; i++)
                st = tsr_comm_all_reduce_sum(c, buf, count, NULL);
        /* Calls per round: from one timed call, broadcast by rank 0 so every rank agrees. */
        uint64_t t0 = tsr_now_ns();
        if (st == TSR_OK)
                st = tsr_comm_all_reduce_sum(c, buf, count, NULL);
        uint64_t iters = 200000000ull / (tsr_now_ns() - t0 + 1) + 1;
        if (iters > 20000)
                iters = 20000;
        if (st == TSR_OK)
                st = tsr_comm_broadcast(c, &iters, sizeof(iters), 0, NULL);
        double best = 1e30;
        for (int r = 0; r < cfg->repeat && st == TSR_OK; r++) {
                st = tsr_comm_barrier(c);
                t0 = tsr_now_ns();
                for (uint64_t i = 0; i < iters && st == TSR_OK; i++)
                        st = tsr_comm_all_reduce_sum(c, buf, count, NULL);
                double mean = (double)(tsr_now_ns() - t0) / (double)iters;
                if (mean < best)
                        best = mean;
        }
        free(buf);
        *best_ns = best;
        return st;
}

/* ---- local: threads ------------------------------------------------------------------- */

typedef struct thread_arg {
        tsr_comm_local_group *g;
        int rank, size;
        const bench_cfg *cfg;
        double ns;
        tsr_status st;
} thread_arg;

static void *thread_main(void *p) {
        thread_arg *a = p;
        tsr_comm *c = NULL;
        char err[256];
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = a->rank, .size = a->size, .local = a->g};
        a->st = tsr_comm_new(&d, &c, err, sizeof(err));
        if (a->st == TSR_OK)
                a->st = run_rank(c, a->cfg, &a->ns);
        tsr_comm_free(&c);
        return NULL;
}

static tsr_status bench_local(int n, const bench_cfg *cfg, double *ns) {
        tsr_comm_local_group *g = NULL;
        thread_arg a[TSR_COMM_MAX_RANKS];
        pthread_t th[TSR_COMM_MAX_RANKS];
        tsr_status st = tsr_comm_local_group_new(n, &g);
        if (st != TSR_OK)
                return st;
        for (int q = 0; q < n; q++) {
                a[q] = (thread_arg){.g = g, .rank = q, .size = n, .cfg = cfg};
                pthread_create(&th[q], NULL, thread_main, &a[q]);
        }
        for (int q = 0; q < n; q++) {
                pthread_join(th[q], NULL);
                if (a[q].st != TSR_OK && st == TSR_OK)
                        st = a[q].st;
        }
        tsr_comm_local_group_unref(&g);
        *ns = a[0].ns;
        return st;
}

/* ---- zmq: processes --------------------------------------------------------------------- */

static bool xfer(int fd, void *p, size_t n, bool writing) {
        for (size_t done = 0; done < n;) {
                ssize_t k = writing ? write(fd, (char *)p + done, n - done) : read(fd, (char *)p + done, n - done);
                if (k <= 0 && !(k < 0 && errno == EINTR))
                        return false;
                if (k > 0)
                        done += (size_t)k;
        }
        return true;
}

static tsr_status bench_zmq(int n, const bench_cfg *cfg, double *ns) {
        struct { int st; double ns; } *out = mmap(NULL, sizeof(*out), PROT_READ | PROT_WRITE,
                                                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        char (*eps)[EP_LEN] = calloc((size_t)n, EP_LEN);
        pid_t pid[TSR_COMM_MAX_RANKS];
        int up[TSR_COMM_MAX_RANKS], down[TSR_COMM_MAX_RANKS];
        if (out == MAP_FAILED || !eps)
                return TSR_E_NOMEM;
        out->st = TSR_E_INTERNAL;
        for (int q = 0; q < n; q++) {
                int u[2], d[2];
                if (pipe(u) || pipe(d))
                        return TSR_E_IO;
                if ((pid[q] = fork()) == 0) {
                        /* Rank q: bind, report the endpoint, learn everyone's, join, run. */
                        char err[256];
                        const char *ptrs[TSR_COMM_MAX_RANKS];
                        tsr_comm_zmq_listener *l = NULL;
                        tsr_comm *c = NULL;
                        double mine = 0;
                        if (tsr_comm_zmq_listener_new("tcp://127.0.0.1:*", &l, err, sizeof(err)) != TSR_OK)
                                _exit(1);
                        char ep[EP_LEN] = {0};
                        snprintf(ep, sizeof(ep), "%s", tsr_comm_zmq_listener_endpoint(l));
                        if (!xfer(u[1], ep, EP_LEN, true) || !xfer(d[0], eps, (size_t)n * EP_LEN, false))
                                _exit(1);
                        for (int i = 0; i < n; i++)
                                ptrs[i] = eps[i];
                        tsr_comm_desc desc = {.backend = TSR_COMM_BACKEND_ZMQ, .rank = q, .size = n,
                                              .zmq_listener = &l, .endpoints = ptrs};
                        tsr_status st = tsr_comm_new(&desc, &c, err, sizeof(err));
                        if (st == TSR_OK)
                                st = run_rank(c, cfg, &mine);
                        if (q == 0) {
                                out->st = st;
                                out->ns = mine;
                        }
                        tsr_comm_free(&c);
                        _exit(st == TSR_OK ? 0 : 1);
                }
                close(u[1]);
                close(d[0]);
                up[q] = u[0];
                down[q] = d[1];
        }
        bool ok = true;
        for (int q = 0; q < n; q++)
                ok = ok && xfer(up[q], eps[q], EP_LEN, false);
        for (int q = 0; q < n; q++)
                ok = ok && xfer(down[q], eps, (size_t)n * EP_LEN, true);
        for (int q = 0; q < n; q++) {
                if (!ok)
                        kill(pid[q], SIGKILL);
                waitpid(pid[q], NULL, 0);
                close(up[q]);
                close(down[q]);
        }
        tsr_status st = ok ? (tsr_status)out->st : TSR_E_IO;
        *ns = out->ns;
        munmap(out, sizeof(*out));
        free(eps);
        return st;
}

/* ---- main ------------------------------------------------------------------------------- */

static int parse_list(const char *s, long *v, int max) {
        int n = 0;
        for (char *end; *s && n < max; s = *end ? end + 1 : end) {
                v[n++] = strtol(s, &end, 10);
                if (end == s)
                        return -1;
        }
        return n;
}

int main(int argc, char **argv) {
        long ranks[MAX_LIST] = {2, 4}, sizes[MAX_LIST] = {4096, 16384, 65536, 262144, 1048576, 4194304};
        int n_ranks = 2, n_sizes = 6, repeat = 3;
        bool want_local = true, want_zmq = true, bench = false;
        for (int i = 1; i < argc; i++) {
                const char *v = i + 1 < argc ? argv[i + 1] : NULL;
                if (!strcmp(argv[i], "--bench"))
                        bench = true;
                else if (!strcmp(argv[i], "--ranks") && v && (n_ranks = parse_list(v, ranks, MAX_LIST)) > 0)
                        i++;
                else if (!strcmp(argv[i], "--sizes") && v && (n_sizes = parse_list(v, sizes, MAX_LIST)) > 0)
                        i++;
                else if (!strcmp(argv[i], "--repeat") && v && (repeat = atoi(v)) > 0)
                        i++;
                else if (!strcmp(argv[i], "--backends") && v) {
                        want_local = strstr(v, "local") != NULL;
                        want_zmq = strstr(v, "zmq") != NULL;
                        i++;
                } else {
                        fprintf(stderr, "tessera-bench-comm: bad argument %s\n", argv[i]);
                        bench = false;
                        break;
                }
        }
        for (int i = 0; i < n_ranks; i++)
                if (ranks[i] < 1 || ranks[i] > TSR_COMM_MAX_RANKS)
                        bench = false;
        for (int i = 0; i < n_sizes; i++)
                if (sizes[i] < 4 || sizes[i] % 4)
                        bench = false;
        if (!bench) {
                fprintf(stderr, "usage: tessera-bench-comm --bench [--backends local,zmq] [--ranks 2,4] "
                                "[--sizes BYTES,...] [--repeat N]\n");
                return 2;
        }
        printf("%-8s %5s %10s %12s %10s\n", "backend", "ranks", "bytes", "us/allreduce", "GB/s");
        fflush(stdout);                 /* before any fork */
        for (int b = 0; b < 2; b++) {
                if ((b == 0 && !want_local) || (b == 1 && !want_zmq))
                        continue;
                for (int r = 0; r < n_ranks; r++)
                        for (int s = 0; s < n_sizes; s++) {
                                bench_cfg cfg = {.bytes = (size_t)sizes[s], .repeat = repeat};
                                double ns = 0;
                                tsr_status st = b == 0 ? bench_local((int)ranks[r], &cfg, &ns)
                                                       : bench_zmq((int)ranks[r], &cfg, &ns);
                                if (st != TSR_OK) {
                                        printf("%-8s %5ld %10ld failed: %s\n", b ? "zmq" : "local", ranks[r],
                                               sizes[s], tsr_status_str(st));
                                        continue;
                                }
                                printf("%-8s %5ld %10ld %12.1f %10.3f\n", b ? "zmq" : "local", ranks[r], sizes[s],
                                       ns / 1e3, (double)sizes[s] / ns);
                                fflush(stdout);
                        }
        }
        return 0;
}
