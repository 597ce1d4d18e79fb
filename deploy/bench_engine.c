/* bench_engine.c - tessera-bench-engine: forward-pass throughput of a Llama model on the
 * CPU kernels, and this machine's memory bandwidth to put it against.  A benchmark, not a
 * test: it prints numbers and asserts nothing (docs/benchmarks.md has the table).
 *
 *   tessera-bench-engine [MODEL.gguf|HF-DIR] [--threads 1,2] [--batches 1,8,32,64]
 *                        [--steps N] [--prefill N] [--context N] [--repeat N]
 *                        [--kernels fast|amx_bf16|avx512_bf16|avx2|ref|cuda]
 *                        [--dtypes float32,bfloat16,stored] [--no-bandwidth]
 *                        [--kv-cache-dtype auto|bfloat16|fp8|fp8_e5m2] [--graphs]
 *
 * For each dtype, thread count and batch B: B sequences each prefilled with --context
 * tokens (16),
 * then --steps decode steps of all B at once through tsr_llama_forward_batch (what one
 * engine step runs), timed: decode tok/s = B * steps / seconds.  Prefill: one sequence of
 * --prefill tokens, last logits only.  Each number is the best of --repeat runs (the
 * cores are shared with other work).  Bandwidth: a STREAM-like triad a = b + s*c over
 * three arrays of 512 MiB (far beyond the last-level cache), bytes = 3 * 4 * n per pass,
 * best of 5, per thread count listed, before and after the model runs (the best is
 * used).  Roofline for batch-1 decode: the bytes of the matmul weights read per token
 * divided by the best bandwidth is the fastest a step could be if it only streamed
 * weights; fraction = that time / the best measured time.  A model whose weights fit in
 * the last-level cache can exceed 1.  --kernels caps the fast kernels at an ISA (fast = the
 * best this CPU has), e.g. avx512_bf16 to time VDPBF16PS against AMX's tiles for bf16.
 * --dtypes stored: a GGUF file's block-format weights kept as they are (the worker's
 * --dtype auto; the int8 matmul of kernels/quant/qmm.h), or a ModelOpt FP8 / NVFP4 folder's
 * quantized weights (kernels/quant/fpmm.h); weight bytes = resident bytes.
 * --kernels cuda: the CUDA backend on GPU 0 (issue #16), weights copied to the device
 * (tsr_llama_to_backend), one "thread"; the timed steps end with the logits' download,
 * which waits for the device.  The bandwidth triad is the host's: pass --no-bandwidth.
 * --graphs (with --kernels cuda): each decode batch through a CUDA graph recorded for its
 * size before its prefills (tsr_llama_set_graphs), as the worker's default; without it
 * every step runs eagerly (the worker's --enforce-eager).
 * --kv-cache-dtype fp8: the KV cache stores e4m3 bytes with scale 1.0 (the worker's
 * --kv-cache-dtype fp8 without checkpoint scales), on the CPU or the device; attention
 * dequantizes what it reads, which --context makes the larger part of a step.
 * --kv-cache-dtype bfloat16: bf16 K and V (no scale), which the CPU attention reads as
 * stored, widening as it loads.  auto (the default) is float32 here whatever --dtypes
 * says, so that every row of one run compares the weights over the same cache (the
 * worker's auto is the model's dtype, as vLLM's). */
#include <math.h>
#include <stdbool.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/modelopt.h"
#include "worker/model/llama.h"

#define MAX_LIST 16

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t parse_list(const char *s, int *out) {
        size_t n = 0;
        char *end;
        while (*s && n < MAX_LIST) {
                long v = strtol(s, &end, 10);
                if (end == s || v < 0 || v > 4096) {
                        fprintf(stderr, "bad number list near '%s'\n", s);
                        exit(2);
                }
                out[n++] = (int)v;
                s = *end == ',' ? end + 1 : end;
        }
        return n;
}

/* ---- bandwidth ------------------------------------------------------------------------- */

struct triad_job {
        float *a;
        const float *b, *c;
        size_t n;
};

static void *triad_part(void *arg) {
        struct triad_job *j = arg;
        for (size_t i = 0; i < j->n; i++)
                j->a[i] = j->b[i] + 3.0f * j->c[i];
        return NULL;
}

/* Best GB/s of a triad over three n-float arrays split across `threads` threads. */
static double triad_gbs(float *a, const float *b, const float *c, size_t n, int threads) {
        double best = 0;
        pthread_t th[64];
        struct triad_job jobs[64];
        if (threads > 64)
                threads = 64;
        for (int rep = 0; rep < 5; rep++) {
                double t0 = now_s();
                for (int t = 0; t < threads; t++) {
                        size_t lo = n * (size_t)t / (size_t)threads, hi = n * (size_t)(t + 1) / (size_t)threads;
                        jobs[t] = (struct triad_job){.a = a + lo, .b = b + lo, .c = c + lo, .n = hi - lo};
                        if (t > 0)
                                pthread_create(&th[t], NULL, triad_part, &jobs[t]);
                }
                triad_part(&jobs[0]);
                for (int t = 1; t < threads; t++)
                        pthread_join(th[t], NULL);
                double gbs = 3.0 * 4.0 * (double)n / (now_s() - t0) / 1e9;
                if (gbs > best)
                        best = gbs;
        }
        return best;
}

/* Best triad GB/s over the thread counts listed, printed; 0 when memory is short. */
static double measure_bandwidth(const int *threads, size_t n_threads, const char *when) {
        size_t n = (size_t)512 << 20 >> 2;      /* 512 MiB per array */
        float *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
        double best = 0;
        if (!a || !b || !c) {
                fprintf(stderr, "cannot allocate 1.5 GiB for the bandwidth test\n");
                goto out;
        }
        for (size_t i = 0; i < n; i++) {
                a[i] = 0;
                b[i] = (float)(i & 1023);
                c[i] = 1.0f;
        }
        for (size_t t = 0; t < n_threads; t++) {
                int nt = threads[t] ? threads[t] : 2;
                double gbs = triad_gbs(a, b, c, n, nt);
                printf("bandwidth (%s): triad over 3 x 512 MiB, %d thread(s): %.1f GB/s\n", when, nt, gbs);
                best = fmax(best, gbs);
        }
out:
        free(a);
        free(b);
        free(c);
        return best;
}

/* ---- model runs -------------------------------------------------------------------------- */

/* Tokens each sequence holds before the timed decode steps (--context; 16 by default):
 * attention reads them all every step, so a long context times the attention kernel too. */
static int context_len = 16;
static bool use_graphs;         /* --graphs */
/* What the KV cache stores (--kv-cache-dtype). */
static tsr_dtype kv_dtype = TSR_DTYPE_F32;

/* A cache of `tokens` tokens in blocks of `block` for the whole model: tsr_llama_kv_new's
 * for float32, else over a pool of kv_dtype (*mem, freed by the caller after the cache). */
static tsr_status kv_new(tsr_llama *m, tsr_backend *be, size_t tokens, size_t block, tsr_kv_pool **mem,
                         tsr_llama_kv **ret) {
        *mem = NULL;
        if (kv_dtype == TSR_DTYPE_F32)
                return tsr_llama_kv_new(m, tokens, block, ret);
        tsr_kv_group g = tsr_llama_kv_group(tsr_llama_config_of(m));
        tsr_kv_groups_set_dtype(&g, 1, kv_dtype);
        /* in the memory the forward runs in, as tsr_llama_kv_new's */
        tsr_status st = tsr_kv_pool_new_on(be && !tsr_backend_host_memory(be) ? be : NULL, &g, 1,
                                           (tokens + block - 1) / block, (uint32_t)block, 0, mem);
        if (st == TSR_OK && (st = tsr_llama_kv_bind(m, *mem, ret)) != TSR_OK)
                tsr_kv_pool_free(mem);
        return st;
}

/* Token ids for the runs: 1 + (x % 4000), inside the model's vocabulary however small
 * (a test fixture's is a few hundred). */
static uint32_t bench_token(const tsr_llama *m, size_t x) {
        size_t span = tsr_llama_config_of(m)->vocab_size - 1;
        return (uint32_t)(1 + x % (span < 4000 ? span : 4000));
}

/* Seconds of `steps` batched decode steps of `batch` sequences (after their prefill). */
static double run_decode(tsr_llama *m, tsr_backend *be, int batch, int steps, float *logits) {
        size_t block = 16, per_seq = ((size_t)context_len + (size_t)steps + block - 1) / block;
        tsr_llama_kv *pool = NULL;
        tsr_kv_pool *mem = NULL;
        uint32_t *tables = malloc((size_t)batch * per_seq * sizeof(uint32_t));
        uint32_t *toks = malloc((size_t)batch * sizeof(uint32_t));
        tsr_llama_seq *seqs = malloc((size_t)batch * sizeof *seqs);
        uint32_t *prompt = malloc((size_t)context_len * sizeof *prompt);
        double secs = -1;

        if (!tables || !toks || !seqs || !prompt ||
            kv_new(m, be, (size_t)batch * per_seq * block, block, &mem, &pool) != TSR_OK)
                goto out;
        if (use_graphs && be && !tsr_backend_host_memory(be)) {    /* recorded before the prefills: */
                uint32_t size = (uint32_t)batch;                    /* its warm-up writes block 0 */
                size_t captured = 0;
                if (tsr_llama_set_graphs(m, &size, 1, (uint32_t)per_seq, UINT32_MAX) != TSR_OK ||
                    tsr_llama_capture_graphs(m, be, pool, &captured) != TSR_OK || captured != 1) {
                        fprintf(stderr, "batch %d: the CUDA graph was not recorded\n", batch);
                        goto out;
                }
        }
        for (size_t i = 0; i < (size_t)batch * per_seq; i++)
                tables[i] = (uint32_t)i;
        for (int s = 0; s < batch; s++) {
                for (int t = 0; t < context_len; t++)
                        prompt[t] = bench_token(m, (size_t)s * 131 + (size_t)t * 17);
                if (tsr_llama_forward_blocks(m, be, pool, tables + (size_t)s * per_seq, per_seq, prompt, (size_t)context_len, 0,
                                             TSR_LLAMA_LOGITS_NONE, NULL) != TSR_OK)
                        goto out;
                toks[s] = bench_token(m, 99 + (size_t)s);
        }
        /* A device backend returns once the prefills are queued: the timed steps start
         * when they are done, not while the device still works on them. */
        if (be && tsr_backend_synchronize(be) != TSR_OK)
                goto out;
        double t0 = now_s();
        for (int step = 0; step < steps; step++) {
                for (int s = 0; s < batch; s++)
                        seqs[s] = (tsr_llama_seq){.block_table = tables + (size_t)s * per_seq, .n_table = per_seq,
                                                  .tokens = &toks[s], .n = 1, .past_len = (size_t)(context_len + step),
                                                  .which = TSR_LLAMA_LOGITS_LAST};
                if (tsr_llama_forward_batch(m, be, pool, seqs, (size_t)batch, logits) != TSR_OK)
                        goto out;
        }
        secs = now_s() - t0;
out:
        if (use_graphs && be && !tsr_backend_host_memory(be))
                (void)tsr_llama_set_graphs(m, NULL, 0, 0, 0);    /* before the pool they read goes */
        tsr_llama_kv_free(&pool);
        tsr_kv_pool_free(&mem);
        free(tables);
        free(toks);
        free(seqs);
        free(prompt);
        return secs;
}

static double run_prefill(tsr_llama *m, tsr_backend *be, int n, float *logits) {
        tsr_llama_kv *kv = NULL;
        tsr_kv_pool *mem = NULL;
        uint32_t *ids = malloc((size_t)n * sizeof *ids);
        double secs = -1;
        if (ids && kv_new(m, be, (size_t)n, 16, &mem, &kv) == TSR_OK) {
                for (int i = 0; i < n; i++)
                        ids[i] = bench_token(m, (size_t)i * 37);
                double t0 = (!be || tsr_backend_synchronize(be) == TSR_OK) ? now_s() : -1;
                if (t0 >= 0 && tsr_llama_forward(m, be, kv, ids, (size_t)n, 0, TSR_LLAMA_LOGITS_LAST, logits) == TSR_OK)
                        secs = now_s() - t0;
        }
        tsr_llama_kv_free(&kv);
        tsr_kv_pool_free(&mem);
        free(ids);
        return secs;
}

/* Bytes of matmul weights one decode token reads (q k v o gate up down per layer, output). */
static double weight_bytes(const tsr_llama_config *c, double bytes_per_weight) {
        double q = (double)c->n_heads * c->head_dim, kv = (double)c->n_kv_heads * c->head_dim;
        double per_layer = (double)c->dim * (q + 2 * kv) + q * c->dim + 3.0 * c->dim * c->hidden_dim;
        return bytes_per_weight * (per_layer * c->n_layers + (double)c->vocab_size * c->dim);
}

int main(int argc, char **argv) {
        const char *model = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", *kernels = "fast";
        const char *dtypes = "float32,bfloat16";
        int threads[MAX_LIST] = {1, 2}, batches[MAX_LIST] = {1, 8, 32, 64};
        size_t n_threads = 2, n_batches = 4;
        int steps = 16, prefill = 128, repeat = 3;
        bool bandwidth = true;

        for (int i = 1; i < argc; i++) {
                const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
                if (strcmp(a, "--no-bandwidth") == 0) {
                        bandwidth = false;
                        continue;
                }
                if (strcmp(a, "--graphs") == 0) {
                        use_graphs = true;
                        continue;
                }
                if (a[0] != '-') {
                        model = a;
                        continue;
                }
                if (!v) {
                        fprintf(stderr, "%s needs a value\n", a);
                        return 2;
                }
                i++;
                if (strcmp(a, "--threads") == 0)
                        n_threads = parse_list(v, threads);
                else if (strcmp(a, "--batches") == 0)
                        n_batches = parse_list(v, batches);
                else if (strcmp(a, "--steps") == 0)
                        steps = atoi(v);
                else if (strcmp(a, "--prefill") == 0)
                        prefill = atoi(v);
                else if (strcmp(a, "--context") == 0)
                        context_len = atoi(v);
                else if (strcmp(a, "--repeat") == 0)
                        repeat = atoi(v);
                else if (strcmp(a, "--kernels") == 0)
                        kernels = v;
                else if (strcmp(a, "--dtypes") == 0)
                        dtypes = v;
                else if (strcmp(a, "--kv-cache-dtype") == 0) {
                        if (!tsr_kv_cache_dtype_parse(v, &kv_dtype)) {
                                fprintf(stderr, "--kv-cache-dtype %s: expected auto (here always float32), bfloat16, fp8, fp8_e4m3 or fp8_e5m2\n", v);
                                return 2;
                        }
                }
                else {
                        fprintf(stderr, "unknown option %s (see the comment at the top of bench_engine.c)\n", a);
                        return 2;
                }
        }
        if (steps < 1 || prefill < 1 || repeat < 1 || context_len < 1) {
                fprintf(stderr, "--steps, --prefill, --context and --repeat must be >= 1\n");
                return 2;
        }
        bool ref = strcmp(kernels, "ref") == 0, cuda = strcmp(kernels, "cuda") == 0;
        tsr_backend *gpu = NULL;
        if (cuda) {
                tsr_status gst = tsr_backend_cuda_new(0, &gpu);
                if (gst != TSR_OK) {
                        fprintf(stderr, "--kernels cuda: %s\n", tsr_status_str(gst));
                        return 1;
                }
                ref = true;     /* one pass of the thread loop */
        }
        tsr_cpu_isa max_isa = TSR_CPU_ISA_AMX_BF16;
        if (strcmp(kernels, "avx512_bf16") == 0)
                max_isa = TSR_CPU_ISA_AVX512_BF16;
        else if (strcmp(kernels, "avx2") == 0)
                max_isa = TSR_CPU_ISA_AVX2;
        else if (!ref && strcmp(kernels, "fast") != 0 && strcmp(kernels, "amx_bf16") != 0) {
                fprintf(stderr, "--kernels %s: expected fast, amx_bf16, avx512_bf16, avx2, ref or cuda\n", kernels);
                return 2;
        }

        double best_bw = bandwidth ? measure_bandwidth(threads, n_threads, "before") : 0;
        double best_b1[3] = {0, 0, 0};  /* best batch-1 decode tok/s: float32, bfloat16, stored */
        double wbytes_of[3] = {0, 0, 0};
        tsr_cpu_isa isa = ref ? TSR_CPU_ISA_SCALAR : max_isa < tsr_cpu_isa_best() ? max_isa : tsr_cpu_isa_best();
        printf("kernels %s, isa %s, model %s, KV cache %s, context %d%s\n", cuda ? "cuda" : ref ? "cpu-ref" : "cpu-fast",
               tsr_cpu_isa_name(isa), model, tsr_dtype_get_info(kv_dtype)->name, context_len,
               cuda ? use_graphs ? ", decode through CUDA graphs" : ", decode eager" : "");
        printf("| dtype | threads | what | tok/s | |\n|---|---|---|---|---|\n");
        char dt[64];
        snprintf(dt, sizeof dt, "%s", dtypes);
        for (char *save = NULL, *dtype = strtok_r(dt, ",", &save); dtype; dtype = strtok_r(NULL, ",", &save)) {
                bool bf16 = strcmp(dtype, "bfloat16") == 0, stored = strcmp(dtype, "stored") == 0;
                int kind = stored ? 2 : bf16;           /* index of best_b1, wbytes_of */
                char err[512];
                tsr_llama *m = NULL;
                tsr_load_opts lo = {0};
                tsr_load_stats ls = {0};
                for (int t = 0; stored && t < TSR_DTYPE_COUNT; t++)
                        if (tsr_dtype_get_info((tsr_dtype)t)->quantized)
                                lo.keep_dtypes |= 1u << t;
                /* a ModelOpt FP8 / NVFP4 folder: its quantized weights as stored (the worker's load) */
                tsr_modelopt_config mo = {0};
                if (stored && tsr_modelopt_config_read(model, &mo, err, sizeof err) == TSR_OK && mo.algo)
                        lo.modelopt = &mo;
                tsr_status lst = tsr_llama_load_opts(model, NULL, NULL, &lo, NULL, NULL, &m, &ls, err, sizeof err);
                tsr_modelopt_config_done(&mo);
                if (lst != TSR_OK) {
                        fprintf(stderr, "%s\n", err);
                        return 1;
                }
                if (bf16 && tsr_llama_use_bf16(m) != TSR_OK) {
                        fprintf(stderr, "cannot convert to bfloat16\n");
                        return 1;
                }
                const tsr_llama_config *c = tsr_llama_config_of(m);
                int max_batch = 1;
                for (size_t b = 0; b < n_batches; b++)
                        if (batches[b] > max_batch)
                                max_batch = batches[b];
                if (gpu && (tsr_llama_to_backend(m, gpu, err, sizeof err) != TSR_OK ||
                            tsr_llama_reserve(m, (size_t)(max_batch > prefill ? max_batch : prefill),
                                              (size_t)max_batch) != TSR_OK)) {
                        fprintf(stderr, "cuda: %s\n", err[0] ? err : "cannot reserve the activations");
                        return 1;
                }
                float *logits = malloc((size_t)max_batch * c->vocab_size * sizeof(float));
                double wbytes = stored ? (double)ls.resident_bytes : weight_bytes(c, bf16 ? 2.0 : 4.0);
                for (size_t t = 0; t < (ref ? 1 : n_threads); t++) {
                        /* One backend per thread count: its pool has exactly that many threads. */
                        tsr_backend *be = NULL;
                        tsr_status bst = gpu ? TSR_OK
                                       : ref ? tsr_backend_cpu_ref_new(&be)
                                             : tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads[t],
                                                                                             .max_isa = max_isa},
                                                                   &be);
                        if (bst != TSR_OK) {
                                fprintf(stderr, "cannot make the backend (%d threads): %s\n", threads[t],
                                        tsr_status_str(bst));
                                return 1;
                        }
                        if (gpu)
                                be = gpu;
                        int nt = tsr_backend_threads(be);
                        for (size_t b = 0; b < n_batches; b++) {
                                double best = 1e30;
                                for (int r = 0; r < repeat; r++) {
                                        double s = run_decode(m, be, batches[b], steps, logits);
                                        if (s > 0 && s < best)
                                                best = s;
                                }
                                if (best == 1e30) {     /* every run failed: say so, never a 0.0 */
                                        fprintf(stderr, "decode batch %d failed\n", batches[b]);
                                        return 1;
                                }
                                double tps = (double)batches[b] * steps / best;
                                if (batches[b] == 1) {
                                        printf("| %s | %d | decode batch 1 | %.1f | weights streamed at %.1f GB/s "
                                               "(%.0f MB/token) |\n", dtype, nt, tps, wbytes * tps / 1e9, wbytes / 1e6);
                                        best_b1[kind] = fmax(best_b1[kind], tps);
                                        wbytes_of[kind] = wbytes;
                                } else
                                        printf("| %s | %d | decode batch %d | %.1f | |\n", dtype, nt, batches[b], tps);
                                fflush(stdout);
                        }
                        double best = 1e30;
                        for (int r = 0; r < repeat; r++) {
                                double s = run_prefill(m, be, prefill, logits);
                                if (s > 0 && s < best)
                                        best = s;
                        }
                        if (best == 1e30) {
                                fprintf(stderr, "prefill %d failed\n", prefill);
                                return 1;
                        }
                        printf("| %s | %d | prefill %d tokens | %.1f | |\n", dtype, nt, prefill, prefill / best);
                        fflush(stdout);
                        if (!gpu)
                                tsr_backend_free(&be);
                }
                free(logits);
                tsr_llama_free(&m);
        }
        tsr_backend_free(&gpu);
        if (bandwidth) {
                best_bw = fmax(best_bw, measure_bandwidth(threads, n_threads, "after"));
                for (int i = 0; i < 3; i++)
                        if (best_b1[i] > 0)
                                printf("roofline, %s decode batch 1: %.0f MB of weights per token / %.1f GB/s = "
                                       "%.1f ms floor; best measured %.1f ms per token: fraction %.2f\n",
                                       i == 2 ? "stored" : i ? "bfloat16" : "float32", wbytes_of[i] / 1e6, best_bw,
                                       wbytes_of[i] / (best_bw * 1e9) * 1e3, 1e3 / best_b1[i],
                                       (wbytes_of[i] / (best_bw * 1e9)) * best_b1[i]);
        }
        return 0;
}
