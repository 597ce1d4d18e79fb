/* runner.c - a Llama (GGUF or HF folder) on the CPU kernels, as an engine_model. */
#include "runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "llama.h"

struct tsr_runner {
        tsr_llama *model;
        tsr_backend *be;           /* borrowed from the caller (tsr_runner_opts); runs every forward */
        tsr_llama_kv *pool;        /* every sequence's KV, indexed by the engine's block ids */
        engine_model em;
};

/* The whole step in one batched forward: each weight matrix is read once for every
 * sequence in the step. */
static tsr_status runner_forward(void *ud, const engine_seq *seqs, size_t n_seqs, float *logits) {
        tsr_runner *r = ud;
        tsr_llama_seq *ls = malloc(n_seqs * sizeof(*ls));   /* one small allocation per step */
        tsr_status st;
        if (!ls)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n_seqs; i++)
                ls[i] = (tsr_llama_seq){
                        .block_table = seqs[i].block_table,
                        .n_table = seqs[i].n_table,
                        .tokens = seqs[i].tokens,
                        .n = seqs[i].n,
                        .past_len = seqs[i].past_len,
                        .which = seqs[i].want_all_logits ? TSR_LLAMA_LOGITS_ALL
                                 : seqs[i].want_logits   ? TSR_LLAMA_LOGITS_LAST
                                                         : TSR_LLAMA_LOGITS_NONE,
                };
        st = tsr_llama_forward_batch(r->model, r->be, r->pool, ls, n_seqs, logits);
        free(ls);
        return st;
}

/* Every 64th tensor and the last: tensors and file bytes read so far, and the rate
 * (file bytes over the seconds since the load began, dequantizing included). */
static void progress(void *ud, const tsr_load_stats *done, const tsr_load_stats *total) {
        (void)ud;
        if (done->n_tensors != total->n_tensors && done->n_tensors % 64 != 0)
                return;
        log_info("loading weights: %zu/%zu tensors, %.1f/%.1f MB (%.0f%%), %.1f MB/s", done->n_tensors,
                 total->n_tensors, (double)done->file_bytes / 1e6, (double)total->file_bytes / 1e6,
                 total->file_bytes ? 100.0 * (double)done->file_bytes / (double)total->file_bytes : 100.0,
                 done->seconds > 0 ? (double)done->file_bytes / 1e6 / done->seconds : 0.0);
}

static bool is_dir(const char *path) {
        struct stat sb;
        return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

tsr_status tsr_runner_backend_new(int cpu_threads, tsr_backend **ret, char *err, size_t errlen) {
        const char *kern = getenv("TESSERA_KERNELS");
        tsr_cpu_backend_config cfg = {.n_threads = cpu_threads, .max_isa = TSR_CPU_ISA_AMX_BF16};  /* the best */
        tsr_status st;

        if (kern && *kern && strcmp(kern, "fast") != 0 && strcmp(kern, "ref") != 0 && strcmp(kern, "avx2") != 0 &&
            strcmp(kern, "avx512_bf16") != 0 && strcmp(kern, "amx_bf16") != 0) {
                snprintf(err, errlen, "TESSERA_KERNELS=%s: expected fast, amx_bf16, avx512_bf16, avx2 or ref", kern);
                return TSR_E_INVAL;
        }
        if (kern && strcmp(kern, "ref") == 0) {
                if ((st = tsr_backend_cpu_ref_new(ret)) != TSR_OK)
                        snprintf(err, errlen, "cannot make the reference backend: %s", tsr_status_str(st));
                return st;
        }
        if (kern && strcmp(kern, "avx2") == 0)
                cfg.max_isa = TSR_CPU_ISA_AVX2;
        if (kern && strcmp(kern, "avx512_bf16") == 0)  /* bf16 matmul on VDPBF16PS, not AMX */
                cfg.max_isa = TSR_CPU_ISA_AVX512_BF16;
        st = tsr_backend_cpu_new(&cfg, ret);
        if (st == TSR_E_INVAL) {
                snprintf(err, errlen, "--cpu-threads %d is not valid", cpu_threads);
                return st;
        }
        if (st != TSR_OK) {
                log_warn("kernels: cannot start %d threads (%s); running single-threaded", cpu_threads,
                         tsr_status_str(st));
                cfg.n_threads = 1;      /* starts no thread */
                if ((st = tsr_backend_cpu_new(&cfg, ret)) != TSR_OK)
                        snprintf(err, errlen, "cannot make the CPU backend: %s", tsr_status_str(st));
        }
        return st;
}

/* The weight dtype for `opts` on the backend, and the start-up line naming both.  Main
 * thread, at startup. */
static tsr_status pick_dtype(const tsr_runner_opts *opts, bool *bf16, char *err, size_t errlen) {
        const char *dtype = opts->dtype ? opts->dtype : "auto";
        const tsr_backend *be = opts->backend;
        int threads = tsr_backend_threads(be);

        if (strcmp(dtype, "half") == 0 || strcmp(dtype, "float16") == 0) {
                snprintf(err, errlen, "--dtype %s is not supported by the CPU backend (use bfloat16 or float32)",
                         dtype);
                return TSR_E_INVAL;
        }
        if (strcmp(tsr_backend_name(be), "cpu-ref") == 0) {    /* only TESSERA_KERNELS=ref makes one here */
                *bf16 = strcmp(dtype, "bfloat16") == 0;
                log_info("kernels: cpu-ref (TESSERA_KERNELS=ref), 1 thread, dtype %s", *bf16 ? "bfloat16" : "float32");
                return TSR_OK;
        }
        /* auto: bfloat16 only where the CPU has dot-product instructions for it (vLLM's CPU
         * platform downcasts float32 checkpoints to bfloat16 unconditionally; here the
         * AVX2 fallback would halve the bytes too, but rounds x through bf16 for no
         * speed-up in compute, so auto keeps float32's fidelity there). */
        *bf16 = strcmp(dtype, "bfloat16") == 0 ||
                (strcmp(dtype, "auto") == 0 && tsr_backend_cpu_isa(be) >= TSR_CPU_ISA_AVX512_BF16);
        log_info("kernels: %s, isa %s, %d thread%s, dtype %s%s", tsr_backend_name(be),
                 tsr_cpu_isa_name(tsr_backend_cpu_isa(be)), threads, threads == 1 ? "" : "s",
                 *bf16 ? "bfloat16" : "float32", strcmp(dtype, "auto") == 0 ? " (--dtype auto)" : "");
        return TSR_OK;
}

tsr_status tsr_runner_new(const char *path, const tsr_runner_opts *opts, uint64_t num_blocks, uint32_t block_size,
                          tsr_runner **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        bool bf16 = false;
        tsr_runner *r;
        tsr_status st;
        size_t len = strlen(path);

        if (!opts || !opts->backend)
                return TSR_E_INVAL;
        /* A Hugging Face folder or a .gguf file; tsr_llama_load tells the two apart and
         * refuses architectures other than Llama with TSR_E_UNSUPPORTED. */
        if (!is_dir(path) && (len < 5 || strcmp(path + len - 5, ".gguf") != 0)) {
                snprintf(err, errlen, "a model is a Hugging Face folder or a .gguf file");
                return TSR_E_UNSUPPORTED;
        }
        r = calloc(1, sizeof(*r));
        if (!r)
                return TSR_E_NOMEM;
        r->be = opts->backend;
        if ((st = pick_dtype(opts, &bf16, err, errlen)) != TSR_OK)
                goto fail;
        st = tsr_llama_load(path, NULL, progress, NULL, &r->model, stats, err, errlen);
        if (st != TSR_OK)
                goto fail;
        if (bf16 && (st = tsr_llama_use_bf16(r->model)) != TSR_OK) {
                snprintf(err, errlen, "cannot convert the weights to bfloat16: %s", tsr_status_str(st));
                goto fail;
        }
        if (bf16)
                log_info("matmul weights held as bfloat16 (rounded from float32), the float32 copies freed");
        if ((st = tsr_llama_check_backend(r->model, r->be)) != TSR_OK) {
                snprintf(err, errlen, "kernel backend '%s' lacks ops the Llama forward needs", tsr_backend_name(r->be));
                goto fail;
        }
        st = tsr_llama_kv_new(r->model, (size_t)num_blocks * block_size, block_size, &r->pool);
        if (st != TSR_OK) {
                snprintf(err, errlen, "cannot allocate the KV cache (%llu blocks of %u tokens): %s",
                         (unsigned long long)num_blocks, block_size, tsr_status_str(st));
                goto fail;
        }
        r->em.vocab = tsr_llama_config_of(r->model)->vocab_size;
        r->em.ud = r;
        r->em.forward = runner_forward;
        *ret = r;
        return TSR_OK;
fail:
        tsr_runner_free(&r);
        return st;
}

void tsr_runner_free(tsr_runner **rp) {
        tsr_runner *r;
        if (!rp || !*rp)
                return;
        r = *rp;
        tsr_llama_kv_free(&r->pool);
        tsr_llama_free(&r->model);
        free(r);
        *rp = NULL;
}

const engine_model *tsr_runner_model(const tsr_runner *r) { return &r->em; }

const char *tsr_runner_dtype(const tsr_runner *r) {
        return r && tsr_llama_is_bf16(r->model) ? "bfloat16" : "float32";
}
