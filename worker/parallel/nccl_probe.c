/* nccl_probe.c - `tessera doctor`'s NCCL measurements on this node's GPUs (nccl_probe.h).
 * Built only with NCCL.  UNTESTED ON MORE THAN ONE GPU: scripts/gpu-check.sh runs the
 * doctor on the one device the project is lent now and then.
 *
 * One thread per local GPU, each a rank of one NCCL communicator over every node's GPUs.
 * Buffers are device memory on the rank's device; ops run on the legacy default stream
 * and each is waited for with tsr_comm_sync (bounded), so the times include the launch. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "common/clock.h"
#include "worker/parallel/nccl_probe.h"

typedef struct probe_rank {
        const tsr_nccl_probe_cfg *cfg;
        tsr_nccl_probe_out *out;
        int local;                        /* device ordinal on this node */
        tsr_status st;
        char err[256];
        bool ar_ok[TSR_NCCL_PROBE_SIZES];
        bool link_bad[TSR_COMM_MAX_RANKS];     /* bytes differed on this rank's end of link 0 <-> q */
} probe_rank;

/* Rank r's all-reduce input: small integers times 1/4, so every order of the sum over up
 * to 64 ranks is exact and the reference tree's bits are the only right answer. */
static float pattern(size_t i, int rank) {
        return (float)((int)((i * 7 + (size_t)rank * 13) % 251) - 125) * 0.25f;
}

static void fill_bytes(unsigned char *p, size_t n, int seed) {
        for (size_t i = 0; i < n; i++)
                p[i] = (unsigned char)((i * 31 + (size_t)seed * 17) >> 3);
}

/* Calls that are timed: at least 3, about 64 MiB moved in all, at most 100. */
static int rounds_for(size_t bytes) {
        size_t r = (64u << 20) / (bytes + 1);
        return r < 3 ? 3 : r > 100 ? 100 : (int)r;
}

static tsr_status all_reduce_size(tsr_comm *c, const tsr_nccl_probe_cfg *cfg, size_t bytes, double *us, bool *ok) {
        size_t count = bytes / sizeof(float);
        int me = tsr_comm_rank(c);
        float *h = malloc(bytes), *want = malloc(bytes), *d = NULL;
        if (!h || !want || cudaMalloc((void **)&d, bytes) != cudaSuccess) {
                free(h);
                free(want);
                return TSR_E_NOMEM;
        }
        for (size_t i = 0; i < count; i++) {
                float parts[TSR_COMM_MAX_RANKS];
                const float *ptrs[TSR_COMM_MAX_RANKS];
                for (int q = 0; q < cfg->size; q++) {
                        parts[q] = pattern(i, q);
                        ptrs[q] = &parts[q];
                }
                tsr_comm_tree_sum(ptrs, cfg->size, &want[i], 1);
                h[i] = pattern(i, me);
        }
        tsr_status st = cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? TSR_OK : TSR_E_CUDA;
        if (st == TSR_OK && (st = tsr_comm_all_reduce_sum(c, d, count, NULL)) == TSR_OK)
                st = tsr_comm_sync(c, NULL);
        if (st == TSR_OK && cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
                st = TSR_E_CUDA;
        if (st == TSR_OK)
                *ok = memcmp(h, want, bytes) == 0;
        int rounds = rounds_for(bytes);
        uint64_t t0 = tsr_now_ns();
        for (int r = 0; st == TSR_OK && r < rounds; r++)
                if ((st = tsr_comm_all_reduce_sum(c, d, count, NULL)) == TSR_OK)
                        st = tsr_comm_sync(c, NULL);
        *us = (double)(tsr_now_ns() - t0) / 1e3 / rounds;
        cudaFree(d);
        free(h);
        free(want);
        return st;
}

/* Rank 0 sends `bytes` to q and q sends them back, `rounds` times; the best round trip
 * (ns) on rank 0; *ok false where the bytes that came back differ. */
static tsr_status ping_pong(tsr_comm *c, int q, size_t bytes, double *best_ns, bool *ok) {
        int me = tsr_comm_rank(c);
        if (me != 0 && me != q)
                return TSR_OK;
        unsigned char *h = malloc(bytes), *back = malloc(bytes), *d = NULL;
        if (!h || !back || cudaMalloc((void **)&d, bytes) != cudaSuccess) {
                free(h);
                free(back);
                return TSR_E_NOMEM;
        }
        fill_bytes(h, bytes, q);
        /* rank q's buffer starts as zeros: only bytes received from rank 0 can match */
        tsr_status st = (me == 0 ? cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) : cudaMemset(d, 0, bytes)) ==
                                        cudaSuccess ? TSR_OK : TSR_E_CUDA;
        double best = 1e30;
        int rounds = rounds_for(bytes * 4);
        for (int r = 0; st == TSR_OK && r < rounds; r++) {
                uint64_t t0 = tsr_now_ns();
                if (me == 0) {
                        if ((st = tsr_comm_send(c, d, bytes, q, 0, NULL)) == TSR_OK &&
                            (st = tsr_comm_sync(c, NULL)) == TSR_OK &&
                            (st = tsr_comm_recv(c, d, bytes, q, 0, NULL)) == TSR_OK)
                                st = tsr_comm_sync(c, NULL);
                } else {
                        if ((st = tsr_comm_recv(c, d, bytes, 0, 0, NULL)) == TSR_OK &&
                            (st = tsr_comm_sync(c, NULL)) == TSR_OK &&
                            (st = tsr_comm_send(c, d, bytes, 0, 0, NULL)) == TSR_OK)
                                st = tsr_comm_sync(c, NULL);
                }
                double t = (double)(tsr_now_ns() - t0);
                best = t < best ? t : best;
        }
        if (st == TSR_OK && cudaMemcpy(back, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
                st = TSR_E_CUDA;
        if (st == TSR_OK)
                *ok = memcmp(back, h, bytes) == 0;
        *best_ns = best;
        cudaFree(d);
        free(h);
        free(back);
        return st;
}

static void *probe_main(void *arg) {
        probe_rank *pr = arg;
        const tsr_nccl_probe_cfg *cfg = pr->cfg;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_NCCL, .rank = cfg->first_rank + pr->local, .size = cfg->size,
                           .timeout_ms = cfg->timeout_ms, .nccl_id = cfg->id, .cuda_device = pr->local};
        tsr_comm *c = NULL;
        pr->st = tsr_comm_new(&d, &c, pr->err, sizeof(pr->err));
        for (int i = 0; pr->st == TSR_OK && i < cfg->n_sizes; i++) {
                double us = 0;
                pr->st = all_reduce_size(c, cfg, cfg->sizes[i], &us, &pr->ar_ok[i]);
                if (pr->local == 0)
                        pr->out->all_reduce_us[i] = us;
        }
        size_t small = cfg->sizes[0], large = cfg->sizes[cfg->n_sizes - 1];
        for (int q = 1; pr->st == TSR_OK && q < cfg->size; q++) {
                double lat_ns = 0, bw_ns = 0;
                bool ok_small = true, ok_large = true;
                pr->st = ping_pong(c, q, small, &lat_ns, &ok_small);
                if (pr->st == TSR_OK)
                        pr->st = ping_pong(c, q, large, &bw_ns, &ok_large);
                if (pr->st == TSR_OK && d.rank == 0) {
                        pr->out->link_latency_us[q] = lat_ns / 2e3;
                        pr->out->link_gbps[q] = (double)large / (bw_ns / 2);
                }
                /* both ends check; a failure shows on whichever end saw it */
                pr->link_bad[q] = !ok_small || !ok_large;
        }
        if (pr->st == TSR_OK)
                pr->st = tsr_comm_barrier(c);
        if (pr->st != TSR_OK && !pr->err[0])
                tsr_errf(pr->err, sizeof(pr->err), "NCCL rank %d (GPU %d): %s", d.rank, pr->local,
                         tsr_status_str(pr->st));
        tsr_comm_free(&c);
        return NULL;
}

int tsr_nccl_probe_devices(void) {
        int n = 0;
        return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

tsr_status tsr_nccl_probe_run(const tsr_nccl_probe_cfg *cfg, tsr_nccl_probe_out *out, char *err, size_t errlen) {
        if (cfg->n_local < 1 || cfg->n_local > TSR_COMM_MAX_RANKS || cfg->size > TSR_COMM_MAX_RANKS ||
            cfg->first_rank < 0 || cfg->first_rank + cfg->n_local > cfg->size || cfg->n_sizes < 1 ||
            cfg->n_sizes > TSR_NCCL_PROBE_SIZES) {
                tsr_errf(err, errlen, "nccl probe: bad configuration (%d local of %d ranks from %d, %d sizes)",
                         cfg->n_local, cfg->size, cfg->first_rank, cfg->n_sizes);
                return TSR_E_INVAL;
        }
        memset(out, 0, sizeof(*out));
        probe_rank *ranks = calloc((size_t)cfg->n_local, sizeof(*ranks));
        pthread_t *th = calloc((size_t)cfg->n_local, sizeof(*th));
        if (!ranks || !th) {
                free(ranks);
                free(th);
                return TSR_E_NOMEM;
        }
        int started = 0;
        tsr_status st = TSR_OK;
        for (int i = 0; i < cfg->n_local; i++) {
                ranks[i] = (probe_rank){.cfg = cfg, .out = out, .local = i};
                if (pthread_create(&th[i], NULL, probe_main, &ranks[i]) != 0) {
                        tsr_errf(err, errlen, "nccl probe: cannot start the thread of GPU %d", i);
                        st = TSR_E_NOMEM;
                        break;
                }
                started++;
        }
        for (int i = 0; i < started; i++)
                pthread_join(th[i], NULL);
        for (int s = 0; s < cfg->n_sizes; s++) {
                out->all_reduce_ok[s] = started == cfg->n_local;
                for (int i = 0; i < started; i++)
                        out->all_reduce_ok[s] = out->all_reduce_ok[s] && ranks[i].ar_ok[s];
        }
        for (int q = 0; q < TSR_COMM_MAX_RANKS; q++) {
                out->link_ok[q] = true;
                for (int i = 0; i < started; i++)
                        out->link_ok[q] = out->link_ok[q] && !ranks[i].link_bad[q];
        }
        for (int i = 0; st == TSR_OK && i < started; i++)
                if (ranks[i].st != TSR_OK) {
                        st = ranks[i].st;
                        tsr_errf(err, errlen, "%s", ranks[i].err);
                }
        free(ranks);
        free(th);
        return st;
}
