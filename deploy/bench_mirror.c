/* bench_mirror.c - tessera-bench-mirror: what the router's prefix-cache mirrors and kv
 * placement cost as the fleet grows (issue #19; docs/benchmarks.md, "Router at scale").
 * A benchmark, not a test: it prints numbers and asserts nothing.
 *
 *   tessera-bench-mirror [--workers 4,16,64] [--blocks 1000,10000,100000]
 *                        [--prompt-blocks 64] [--requests 20000] [--seed 1]
 *
 * For each fleet size W and cache size N it builds W mirrors the way the router's loop
 * thread does (tsr_prefix_mirror_apply on a Status carrying a snapshot: ALL_CLEARED then
 * STORED events of 1,024 hashes), each worker's cache made of chains of --prompt-blocks
 * random hashes, and reports
 *   - snapshot: ns per hash to apply it (a Resync after a router restart or a gap);
 *   - churn: ns per hash of a steady Status (64 REMOVED + 64 STORED per worker);
 *   - memory: bytes of the mirrors' tables (exact) and the process RSS growth;
 *   - placement: µs per request of pick_worker's kv work for one request (dispatch.c):
 *     for every worker the prompt's leading hits in its mirror and in the recent
 *     placements (one scan of the ring per request, as dispatch.c), a candidate, then
 *     tsr_placement_pick; the request's chain starts with a prefix of a chain some
 *     worker holds (a hit somewhere, as on a shared-prefix workload); again without the
 *     recent-placements ring, to show its share, and with the ring scanned once per
 *     worker (tsr_placement_recent_hits, what dispatch.c did before), to compare;
 *   - hit blocks: the chosen worker's hits over all prompt blocks (about half when the
 *     owner wins: the shared part is uniform in 1..prompt-blocks).
 * Also, once: ns per block to hash a prompt's chain (16-token blocks, sha256 and
 * xxhash), the per-request cost that does not grow with the fleet.
 * Single thread, as one router loop.  Each figure is the best of 3 passes. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/block_hash.h"
#include "router/placement.h"
#include "router/worker_link.h"

#define MAX_LIST 16
#define EVENT_HASHES 1024

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t splitmix64(uint64_t *s) {
        uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static long rss_kb(void) {
        long pages = 0, resident = 0;
        FILE *f = fopen("/proc/self/statm", "r");
        if (!f)
                return 0;
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
                resident = 0;
        fclose(f);
        return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static size_t parse_list(const char *s, size_t *out) {
        size_t n = 0;
        char *end;
        while (*s && n < MAX_LIST) {
                unsigned long long v = strtoull(s, &end, 10);
                if (end == s || v == 0) {
                        fprintf(stderr, "tessera-bench-mirror: bad list '%s'\n", s);
                        exit(2);
                }
                out[n++] = (size_t)v;
                s = *end == ',' ? end + 1 : end;
        }
        return n;
}

/* One Status with `n_events` events of kind `kind` over hashes[0..n). */
static void apply_events(tsr_prefix_mirror *m, uint64_t *seq, uint64_t kv_total, int kind, const uint64_t *hashes,
                         size_t n, bool clear_first) {
        Tessera__V1__Status st;
        Tessera__V1__BlockHashEvent ev[65], *evp[65];   /* ALL_CLEARED + 64 events a Status */
        size_t done = 0;
        while (done < n || clear_first) {
                size_t ne = 0;
                tessera__v1__status__init(&st);
                st.seq = ++*seq;
                st.boot_epoch = 1;
                st.kv_blocks_total = kv_total;
                if (clear_first) {
                        tessera__v1__block_hash_event__init(&ev[ne]);
                        ev[ne].kind = TESSERA__V1__BLOCK_HASH_EVENT__KIND__ALL_CLEARED;
                        evp[ne] = &ev[ne];
                        ne++;
                        clear_first = false;
                }
                while (done < n && ne < 64) {
                        size_t k = n - done < EVENT_HASHES ? n - done : EVENT_HASHES;
                        tessera__v1__block_hash_event__init(&ev[ne]);
                        ev[ne].kind = kind;
                        ev[ne].block_hashes = (uint64_t *)(hashes + done);
                        ev[ne].n_block_hashes = k;
                        evp[ne] = &ev[ne];
                        ne++;
                        done += k;
                }
                st.events = evp;
                st.n_events = ne;
                tsr_prefix_mirror_apply(m, &st);
        }
}

static void bench_hash_chain(size_t prompt_blocks) {
        size_t n_ids = prompt_blocks * 16, n_out = 0;
        uint32_t *ids = malloc(n_ids * sizeof(*ids));
        uint64_t *out = malloc(prompt_blocks * sizeof(*out)), s = 7;
        tsr_block_hash_algo algos[2] = {TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_XXHASH};
        if (!ids || !out)
                exit(1);
        for (size_t i = 0; i < n_ids; i++)
                ids[i] = (uint32_t)(splitmix64(&s) % 49152);
        for (int a = 0; a < 2; a++) {
                double best = 1e30;
                for (int pass = 0; pass < 3; pass++) {
                        double t0 = now_s();
                        for (int r = 0; r < 200; r++)
                                if (tsr_block_hash_chain(algos[a], ids, n_ids, 16, NULL, 0, out, &n_out) != TSR_OK)
                                        exit(1);
                        double t = (now_s() - t0) / 200;
                        best = t < best ? t : best;
                }
                printf("prompt hash chain (%s): %zu blocks of 16 tokens in %.1f us (%.0f ns per block)\n",
                       tsr_block_hash_algo_name(algos[a]), prompt_blocks, best * 1e6, best * 1e9 / (double)prompt_blocks);
        }
        free(ids);
        free(out);
}

static void bench_fleet(size_t n_workers, size_t n_blocks, size_t prompt_blocks, size_t n_requests, uint64_t seed) {
        size_t n_chains = n_blocks / prompt_blocks ? n_blocks / prompt_blocks : 1;
        size_t per_worker = n_chains * prompt_blocks;
        uint64_t *hashes = malloc(n_workers * per_worker * sizeof(*hashes));
        tsr_prefix_mirror *m = calloc(n_workers, sizeof(*m));
        uint64_t *seq = calloc(n_workers, sizeof(*seq));
        tsr_placement_cand *cs = calloc(n_workers, sizeof(*cs));
        tsr_placement_recent recent;
        double best_snap = 1e30, best_churn = 1e30, best_place[3] = {1e30, 1e30, 1e30};
        size_t table_bytes = 0, hits_total = 0;
        long rss0;

        if (!hashes || !m || !seq || !cs) {
                fprintf(stderr, "tessera-bench-mirror: out of memory for %zu x %zu\n", n_workers, n_blocks);
                exit(1);
        }
        for (size_t i = 0; i < n_workers * per_worker; i++)
                hashes[i] = splitmix64(&seed);
        rss0 = rss_kb();
        for (int pass = 0; pass < 3; pass++) {
                double t0;
                for (size_t w = 0; w < n_workers; w++) {
                        tsr_prefix_mirror_done(&m[w]);
                        tsr_prefix_mirror_init(&m[w]);
                        seq[w] = 0;
                }
                t0 = now_s();
                for (size_t w = 0; w < n_workers; w++)
                        apply_events(&m[w], &seq[w], per_worker, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED,
                                     hashes + w * per_worker, per_worker, true);
                double t = (now_s() - t0) / (double)(n_workers * per_worker);
                best_snap = t < best_snap ? t : best_snap;
        }
        table_bytes = 0;
        for (size_t w = 0; w < n_workers; w++)
                table_bytes += m[w].set.n_slots * sizeof(uint64_t);
        long rss1 = rss_kb();

        /* Churn: each worker evicts 64 hashes and stores them back (same size after). */
        for (int pass = 0; pass < 3; pass++) {
                double t0 = now_s();
                size_t moved = 0;
                for (int round = 0; round < 16; round++)
                        for (size_t w = 0; w < n_workers; w++) {
                                const uint64_t *h = hashes + w * per_worker + ((size_t)round * 64) % per_worker;
                                size_t k = per_worker < 64 ? per_worker : 64;
                                apply_events(&m[w], &seq[w], per_worker, TESSERA__V1__BLOCK_HASH_EVENT__KIND__REMOVED,
                                             h, k, false);
                                apply_events(&m[w], &seq[w], per_worker, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED,
                                             h, k, false);
                                moved += 2 * k;
                        }
                double t = (now_s() - t0) / (double)moved;
                best_churn = t < best_churn ? t : best_churn;
        }

        /* Placement: pick_worker's kv work for one request. */
        memset(&recent, 0, sizeof(recent));
        uint64_t *req = malloc(prompt_blocks * sizeof(*req)), rs = seed ^ 0x5bd1e995;
        if (!req)
                exit(1);
        static tsr_placement_recent_match match;
        for (int pass = 0; pass < 9; pass++) {
                int mode = pass % 3;                    /* 0: scan once, 1: no ring, 2: per worker */
                bool with_recent = mode != 1;
                double t0 = now_s();
                hits_total = 0;
                for (size_t r = 0; r < n_requests; r++) {
                        size_t owner = splitmix64(&rs) % n_workers, chain = splitmix64(&rs) % n_chains;
                        size_t keep = 1 + splitmix64(&rs) % prompt_blocks;   /* shared part; the rest new */
                        const uint64_t *src = hashes + owner * per_worker + chain * prompt_blocks;
                        for (size_t b = 0; b < prompt_blocks; b++)
                                req[b] = b < keep ? src[b] : splitmix64(&rs);
                        uint64_t now = (uint64_t)r * 1000000ull;   /* 1 ms apart: the recent ring stays live */
                        if (mode == 0)
                                tsr_placement_recent_scan(&recent, req, prompt_blocks, now, &match);
                        for (size_t w = 0; w < n_workers; w++) {
                                tsr_placement_cand *c = &cs[w];
                                memset(c, 0, sizeof(*c));
                                c->block_size = 16;
                                c->blocks = prompt_blocks;
                                c->hits = tsr_prefix_mirror_hits(&m[w], req, prompt_blocks);
                                if (with_recent) {
                                        size_t h = mode == 0 ? tsr_placement_recent_lookup(&match, &m[w])
                                                             : tsr_placement_recent_hits(&recent, &m[w], req,
                                                                                         prompt_blocks, now);
                                        c->hits = h > c->hits ? h : c->hits;
                                }
                                c->kv_total = per_worker * 2;
                                c->kv_free = per_worker;
                                c->kv_active = w % 8;   /* light, uneven load: the hits decide */
                                c->num_running = (uint32_t)(w % 4);
                                c->reserve_blocks = 1;
                        }
                        size_t best = tsr_placement_pick(cs, n_workers, NULL, NULL);
                        hits_total += cs[best].hits;
                        if (with_recent)
                                tsr_placement_recent_add(&recent, &m[best], req, prompt_blocks, now);
                }
                double t = (now_s() - t0) / (double)n_requests;
                best_place[mode] = t < best_place[mode] ? t : best_place[mode];
        }
        printf("| %zu | %zu | %.1f | %.1f | %.1f MiB (%.1f B/hash) | %.1f MiB | %.2f | %.2f | %.2f | %.1f%% |\n", n_workers,
               per_worker, best_snap * 1e9, best_churn * 1e9, (double)table_bytes / (1 << 20),
               (double)table_bytes / (double)(n_workers * per_worker), (double)(rss1 - rss0) / 1024.0,
               best_place[0] * 1e6, best_place[1] * 1e6, best_place[2] * 1e6,
               100.0 * (double)hits_total / (double)(n_requests * prompt_blocks));
        fflush(stdout);
        tsr_placement_recent_done(&recent);
        for (size_t w = 0; w < n_workers; w++)
                tsr_prefix_mirror_done(&m[w]);
        free(req);
        free(m);
        free(seq);
        free(cs);
        free(hashes);
}

int main(int argc, char **argv) {
        size_t workers[MAX_LIST] = {4, 16, 64}, blocks[MAX_LIST] = {1000, 10000, 100000};
        size_t n_workers = 3, n_blocks = 3, prompt_blocks = 64, n_requests = 20000;
        uint64_t seed = 1;

        for (int i = 1; i < argc; i += 2) {     /* --option value pairs */
                const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
                if (!v || strncmp(a, "--", 2) != 0) {
                        fprintf(stderr, "usage: tessera-bench-mirror [--workers 4,16,64] [--blocks 1000,10000,100000] "
                                        "[--prompt-blocks 64] [--requests 20000] [--seed 1]\n");
                        return 2;
                }
                if (strcmp(a, "--workers") == 0)
                        n_workers = parse_list(v, workers);
                else if (strcmp(a, "--blocks") == 0)
                        n_blocks = parse_list(v, blocks);
                else if (strcmp(a, "--prompt-blocks") == 0)
                        prompt_blocks = strtoull(v, NULL, 10);
                else if (strcmp(a, "--requests") == 0)
                        n_requests = strtoull(v, NULL, 10);
                else if (strcmp(a, "--seed") == 0)
                        seed = strtoull(v, NULL, 10);
                else {
                        fprintf(stderr, "tessera-bench-mirror: unknown option %s\n", a);
                        return 2;
                }
        }
        if (prompt_blocks == 0 || n_requests == 0) {
                fprintf(stderr, "tessera-bench-mirror: --prompt-blocks and --requests must be positive\n");
                return 2;
        }
        bench_hash_chain(prompt_blocks);
        printf("\n| workers | hashes per worker | snapshot ns/hash | churn ns/hash | mirror tables | RSS growth | "
               "placement us/request | without the recent ring | ring scanned per worker | hit blocks |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n");
        for (size_t i = 0; i < n_workers; i++)
                for (size_t j = 0; j < n_blocks; j++)
                        bench_fleet(workers[i], blocks[j], prompt_blocks, n_requests, seed);
        return 0;
}
