/* bench_pp.c - tessera-bench-pp: the per-step cost of pipeline parallelism inside one
 * worker (issue #20).  A benchmark, not a test: it prints numbers and asserts nothing
 * (docs/benchmarks.md, "Pipeline parallelism").
 *
 *   tessera-bench-pp MODEL [--pp 2] [--tp 1] [--dtype auto] [--batches 1,8] [--steps 32] [--prefill 128]
 *                    [--repeat 3]
 *
 * Three runners on the same model, through the worker's own runner (tsr_runner_new, the
 * engine's forward callback): PP 1 with every core in its kernel pool (what a worker
 * runs without -pp), PP 1 with cores / pp threads (one rank's share), and PP pp with
 * cores / pp threads per rank (what `-pp` runs).  One step holds one stage at a time (no
 * micro-batches yet), so PP pp vs PP 1 at the same threads per rank is the pipeline's
 * own overhead: the hand-off of (x, xb) between stages, the logits back, the rank
 * threads' wake-ups.  For each batch B: B sequences prefilled with 16 tokens, then
 * --steps decode steps of all B (ms per step); prefill: one sequence of --prefill
 * tokens, last logits only (ms).  Each number is the best of --repeat rounds, the three
 * runners timed in turn in every round.
 *
 * --tp T (> 1; llama family, any --dtype: bf16 ranks convert their float32 split): the third runner is
 * TP T x PP pp, T x pp ranks of cores / (T x pp) threads each (what `-tp T -pp pp`
 * runs), the second PP 1 with that share, and all three compute o_proj and down_proj in
 * the canonical split (R7), so TP T x PP pp vs PP 1 at the same threads per rank is the
 * cost of the grid: the stage hand-offs, the TP all-reduces and logits all-gather, the
 * wake-ups; with more ranks than cores, the ranks' time-sharing of the cores too. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "deploy/bench_runner.h"
#include "worker/model/family.h"
#include "worker/model/runner.h"
#include "worker/parallel/partition.h"

int main(int argc, char **argv) {
        tsr_bench_runner_opts o = {.batches = {1, 8}, .n_batches = 2, .steps = 32, .prefill = 128, .repeat = 3};
        const char *path = NULL;
        uint32_t pp = 2, tp = 1;
        const char *dtype = "auto";
        char err[1024] = "";

        for (int i = 1; i < argc; i++) {
                const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
                if (strcmp(a, "--pp") == 0 && v) {
                        pp = (uint32_t)atoi(v);
                        i++;
                } else if (strcmp(a, "--tp") == 0 && v) {
                        tp = (uint32_t)atoi(v);
                        i++;
                } else if (strcmp(a, "--dtype") == 0 && v) {
                        dtype = v;
                        i++;
                } else if (strcmp(a, "--steps") == 0 && v) {
                        o.steps = atoi(v);
                        i++;
                } else if (strcmp(a, "--prefill") == 0 && v) {
                        o.prefill = atoi(v);
                        i++;
                } else if (strcmp(a, "--repeat") == 0 && v) {
                        o.repeat = atoi(v);
                        i++;
                } else if (strcmp(a, "--batches") == 0 && v) {
                        o.n_batches = 0;
                        for (char *s = argv[++i], *end; *s && o.n_batches < 8; s = *end ? end + 1 : end) {
                                o.batches[o.n_batches++] = (int)strtol(s, &end, 10);
                                if (end == s)
                                        break;
                        }
                } else if (a[0] != '-' && !path) {
                        path = a;
                } else {
                        fprintf(stderr, "usage: tessera-bench-pp MODEL [--pp N] [--tp N] [--dtype D] [--batches 1,8] "
                                        "[--steps N] [--prefill N] [--repeat N]\n");
                        return 2;
                }
        }
        if (!path || pp < 1 || tp < 1 || pp * tp < 2 || pp * tp > 64 || o.steps < 1 || o.prefill < 1 ||
            o.repeat < 1 || o.n_batches == 0) {
                fprintf(stderr, "usage: tessera-bench-pp MODEL [--pp N] [--tp N] [--batches 1,8] [--steps N] "
                                "[--prefill N] [--repeat N]\n");
                return 2;
        }
        const char *dot = strrchr(path, '.');
        bool gguf = dot && strcmp(dot, ".gguf") == 0;
        const tsr_model_family *fam = tsr_family_find(gguf ? "gguf" : "hf", "llama", "llama");
        tsr_model_desc desc = {0};
        uint32_t layers[64];
        if (!fam || tsr_model_desc_read(fam, path, gguf, &desc, err, sizeof err) != TSR_OK ||
            tsr_pp_partition(desc.n_layers, pp, getenv("VLLM_PP_LAYER_PARTITION"), layers, err, sizeof err) !=
                    TSR_OK) {
                fprintf(stderr, "tessera-bench-pp: %s\n", err);
                return 2;
        }
        int cores = (int)sysconf(_SC_NPROCESSORS_ONLN), ranks = (int)(pp * tp);
        int share = cores / ranks > 1 ? cores / ranks : 1;
        bool r7 = tp > 1;
        struct {
                const char *name;
                uint32_t pp, tp;
                int threads;
                bool canonical;
        } cfgs[4] = {{"pp 1, all cores", 1, 1, cores, r7}, {"pp 1, one rank's share", 1, 1, share, r7},
                     {tp > 1 ? "tp T x pp N" : "pp N", pp, tp, share, r7},
                     {"pp 1, all cores, R7 split", 1, 1, cores, true}};
        /* --dtype float32 adds a 4th runner: the canonical row-parallel split that makes
         * -tp 1 and -tp N bitwise equal (what the worker runs under --dtype float32);
         * with --tp every runner uses it, so there is no 4th. */
        int n_cfg = strcmp(dtype, "float32") == 0 && !r7 ? 4 : 3;
        double dec[4][8], pre[4];
        uint64_t blocks = tsr_bench_runner_blocks(&o);
        printf("model %s, %u layers, %d cores; tp %u x pp %u = %d ranks, layers", path, desc.n_layers, cores, tp,
               pp, ranks);
        for (uint32_t s = 0; s < pp; s++)
                printf("%s%u", s ? "," : " ", layers[s]);
        printf("; dtype %s%s; best of %d\n", dtype, r7 ? " (R7 split in every runner)" : "", o.repeat);
        /* The three runners loaded side by side and timed in turn, round after round, so
         * a burst of load from other processes hits all three alike; best of the rounds. */
        tsr_backend *bes[4] = {NULL};
        tsr_runner *rs[4] = {NULL};
        for (int c = 0; c < n_cfg; c++) {
                tsr_runner_opts ro = {.dtype = dtype, .pp = cfgs[c].pp, .pp_layers = layers, .stage_threads = share,
                                      .tp = cfgs[c].tp, .tp_canonical = cfgs[c].canonical};
                if (tsr_runner_backend_new(cfgs[c].threads, &bes[c], err, sizeof err) != TSR_OK)
                        break;
                ro.backend = bes[c];
                if (tsr_runner_new(path, &desc, &ro, blocks, TSR_BENCH_BLOCK, 0, &rs[c], NULL, err, sizeof err) != TSR_OK)
                        break;
        }
        if (!rs[n_cfg - 1]) {
                fprintf(stderr, "tessera-bench-pp: %s\n", err);
                return 1;
        }
        tsr_bench_runner_opts once = o;
        once.repeat = 1;
        for (int c = 0; c < n_cfg; c++) {
                for (size_t i = 0; i < o.n_batches; i++)
                        dec[c][i] = 1e30;
                pre[c] = 1e30;
        }
        for (int rep = 0; rep < o.repeat; rep++)
                for (int c = 0; c < n_cfg; c++) {
                        double d[8], p;
                        if (tsr_bench_runner_run(rs[c], &once, desc.vocab_size, d, &p) != 0) {
                                fprintf(stderr, "tessera-bench-pp: %s: forward failed\n", cfgs[c].name);
                                return 1;
                        }
                        for (size_t i = 0; i < o.n_batches; i++)
                                dec[c][i] = d[i] < dec[c][i] ? d[i] : dec[c][i];
                        pre[c] = p < pre[c] ? p : pre[c];
                }
        for (int c = 0; c < n_cfg; c++) {
                tsr_runner_free(&rs[c]);
                tsr_backend_free(&bes[c]);
        }
        printf("%-26s %8s", "runner (threads per rank)", "");
        for (size_t i = 0; i < o.n_batches; i++)
                printf("  decode b%-3d", o.batches[i]);
        printf("  prefill %d\n", o.prefill);
        for (int c = 0; c < n_cfg; c++) {
                printf("%-26s %8d", cfgs[c].name, cfgs[c].threads);
                for (size_t i = 0; i < o.n_batches; i++)
                        printf("  %8.2f ms", dec[c][i]);
                printf("  %8.1f ms\n", pre[c]);
        }
        printf("%-26s %8s", tp > 1 ? "grid - pp 1 (same threads)" : "pp N - pp 1 (same threads)", "");
        for (size_t i = 0; i < o.n_batches; i++)
                printf("  %+8.2f ms", dec[2][i] - dec[1][i]);
        printf("  %+8.1f ms\n", pre[2] - pre[1]);
        tsr_model_desc_done(&desc);
        return 0;
}
