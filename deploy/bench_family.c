/* bench_family.c - tessera-bench-family: decode and prefill throughput of any model
 * family (Llama, Llama 4, NemotronH) through the worker's own runner, on the CPU
 * backend.  A benchmark, not a test: it prints numbers and asserts nothing
 * (docs/benchmarks.md, "Model families").
 *
 *   tessera-bench-family MODEL [--threads 1,2] [--dtype auto|float32|bfloat16]
 *                        [--batches 1,8,32] [--steps 16] [--prefill 128] [--repeat 3]
 *
 * The family is the worker's choice for the folder (tsr_family_find on its metadata),
 * loaded by tsr_runner_new as `tessera-worker MODEL --dtype D --cpu-threads T` loads it,
 * with one recurrent-state slot per sequence where the family keeps state (NemotronH's
 * Mamba layers).  For each thread count and batch B: B sequences prefilled with 16
 * tokens, then --steps decode steps of all B (tok/s = B / ms per step), and one prefill
 * of --prefill tokens (tok/s), each the best of --repeat rounds (bench_runner.h).
 * tessera-bench-engine remains the Llama benchmark with the memory roofline, the CUDA
 * backend and the fp8 KV cache; this one is what every family shares. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deploy/bench_runner.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/model_meta.h"
#include "worker/model/family.h"
#include "worker/model/runner.h"

#define MAX_THREADS 8

static size_t parse_ints(const char *s, int *out, size_t max) {
        size_t n = 0;
        for (char *end; *s && n < max; s = *end ? end + 1 : end) {
                long v = strtol(s, &end, 10);
                if (end == s || v < 1 || v > 4096)
                        return 0;
                out[n++] = (int)v;
        }
        return n;
}

static int usage(void) {
        fprintf(stderr, "usage: tessera-bench-family MODEL [--threads 1,2] [--dtype auto|float32|bfloat16] "
                        "[--batches 1,8,32] [--steps N] [--prefill N] [--repeat N]\n");
        return 2;
}

int main(int argc, char **argv) {
        tsr_bench_runner_opts o = {.batches = {1, 8, 32}, .n_batches = 3, .steps = 16, .prefill = 128, .repeat = 3};
        int threads[MAX_THREADS] = {1, 2};
        size_t n_threads = 2;
        const char *path = NULL, *dtype = "auto";
        char err[1024] = "";

        for (int i = 1; i < argc; i++) {
                const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
                if (a[0] != '-' && !path) {
                        path = a;
                        continue;
                }
                if (!v)
                        return usage();
                i++;
                if (strcmp(a, "--threads") == 0)
                        n_threads = parse_ints(v, threads, MAX_THREADS);
                else if (strcmp(a, "--batches") == 0)
                        o.n_batches = parse_ints(v, o.batches, 8);
                else if (strcmp(a, "--dtype") == 0)
                        dtype = v;
                else if (strcmp(a, "--steps") == 0)
                        o.steps = atoi(v);
                else if (strcmp(a, "--prefill") == 0)
                        o.prefill = atoi(v);
                else if (strcmp(a, "--repeat") == 0)
                        o.repeat = atoi(v);
                else
                        return usage();
        }
        if (!path || n_threads == 0 || o.n_batches == 0 || o.steps < 1 || o.prefill < 1 || o.repeat < 1)
                return usage();

        tsr_model_meta *meta = NULL;
        tsr_model_desc desc = {0};
        if (tsr_model_meta_load(path, &meta, err, sizeof err) != TSR_OK) {
                fprintf(stderr, "tessera-bench-family: %s\n", err);
                return 1;
        }
        const tsr_model_family *fam = tsr_family_find(meta->format, meta->architecture, meta->model_type);
        if (!fam) {
                fprintf(stderr, "tessera-bench-family: %s: no model family serves %s\n", path,
                        meta->architecture ? meta->architecture : "this architecture");
                return 1;
        }
        if (tsr_model_desc_read(fam, path, strcmp(meta->format, "gguf") == 0, &desc, err, sizeof err) != TSR_OK) {
                fprintf(stderr, "tessera-bench-family: %s\n", err);
                return 1;
        }
        /* a hybrid model's sequences carry a block table per paged KV group */
        tsr_shard_spec shard;
        tsr_kv_group groups[TSR_KV_GROUPS_MAX];
        uint32_t chunk[TSR_KV_TABLES_MAX];
        if (fam->shard_for(&desc, 0, 1, 0, 1, &shard) != TSR_OK) {
                fprintf(stderr, "tessera-bench-family: %s: no shard of the whole model\n", path);
                return 1;
        }
        o.n_tables = tsr_kv_tables(groups, fam->kv_groups(&desc, &shard, groups, TSR_KV_GROUPS_MAX), chunk);
        int max_b = 1;
        for (size_t i = 0; i < o.n_batches; i++)
                max_b = o.batches[i] > max_b ? o.batches[i] : max_b;
        printf("model %s: family %s (%s), %u layers, vocab %u; dtype %s; best of %d\n", path, fam->name,
               meta->architecture ? meta->architecture : "?", desc.n_layers, desc.vocab_size, dtype, o.repeat);
        printf("| family | dtype | threads | what | tok/s |\n|---|---|---|---|---|\n");
        int rc = 0;
        for (size_t t = 0; t < n_threads && rc == 0; t++) {
                tsr_backend *be = NULL;
                tsr_runner *r = NULL;
                tsr_load_stats ls = {0};
                tsr_runner_opts ro = {.dtype = dtype};
                double dec[8], pre;
                if (tsr_runner_backend_new(threads[t], &be, err, sizeof err) != TSR_OK ||
                    (ro.backend = be,
                     tsr_runner_new(path, &desc, &ro, tsr_bench_runner_blocks(&o), TSR_BENCH_BLOCK, (uint32_t)max_b, &r,
                                    &ls, err, sizeof err)) != TSR_OK) {
                        fprintf(stderr, "tessera-bench-family: %s\n", err);
                        rc = 1;
                } else if (tsr_bench_runner_run(r, &o, desc.vocab_size, dec, &pre) != 0) {
                        fprintf(stderr, "tessera-bench-family: a forward failed (%d threads)\n", threads[t]);
                        rc = 1;
                } else {
                        if (t == 0)
                                printf("(weights resident: %.1f MB in %s)\n", (double)ls.resident_bytes / 1e6,
                                       tsr_runner_dtype(r));
                        for (size_t i = 0; i < o.n_batches; i++)
                                printf("| %s | %s | %d | decode batch %d | %.1f |\n", fam->name, tsr_runner_dtype(r),
                                       threads[t], o.batches[i], o.batches[i] * 1e3 / dec[i]);
                        printf("| %s | %s | %d | prefill %d tokens | %.1f |\n", fam->name, tsr_runner_dtype(r),
                               threads[t], o.prefill, o.prefill * 1e3 / pre);
                        fflush(stdout);
                }
                tsr_runner_free(&r);
                tsr_backend_free(&be);
        }
        tsr_model_desc_done(&desc);
        tsr_model_meta_free(&meta);
        return rc;
}
