/* runner.c - a model of a registered family (worker/model/family.h) on the CPU kernels,
 * as an tsr_engine_model: the family's load and forward entry points, called through its table. */
#include "worker/model/runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "worker/load/modelopt.h"

struct tsr_runner {
        const tsr_model_family *fam;
        void *model;               /* the family's model (Llama: tsr_llama) */
        tsr_backend *be;           /* borrowed from the caller (tsr_runner_opts); runs every forward */
        tsr_kv_pool *kv_memory;    /* every sequence's KV, per layer group, indexed by the engine's block ids */
        void *pool;                /* the family's view of kv_memory */
        tsr_engine_model em;
};

/* The whole step in one batched forward: each weight matrix is read once for every
 * sequence in the step. */
static tsr_status runner_forward(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        tsr_runner *r = ud;
        char *ls = malloc(n_seqs * r->fam->seq_size);   /* one small allocation per step */
        tsr_status st;
        if (!ls)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n_seqs; i++)
                r->fam->seq_fill(ls + i * r->fam->seq_size, seqs[i].block_table, seqs[i].n_table, seqs[i].tokens,
                                 seqs[i].n, seqs[i].past_len, seqs[i].want_logits, seqs[i].want_all_logits);
        if (r->fam->seq_set_state_slot)
                for (size_t i = 0; i < n_seqs; i++)
                        r->fam->seq_set_state_slot(ls + i * r->fam->seq_size, seqs[i].state_slot);
        st = r->fam->forward_batch(r->model, r->be, r->pool, ls, n_seqs, logits);
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

/* What the model at `path` announces about quantization, checked against --quantization
 * `flag`, with the start-up line naming it and a warning per exclude_modules entry that
 * matches no tensor (as vLLM warns).  Main thread, at startup. */
static tsr_status quant_config(const char *path, const tsr_model_desc *desc, const char *flag,
                               tsr_modelopt_config *mo, char *err, size_t errlen) {
        tsr_safetensors_set *set = NULL;
        const char *unmatched[8];
        tsr_status st;

        if (desc->gguf) {
                if (!flag)
                        return TSR_OK;
                snprintf(err, errlen, "argument --quantization: '%s' does not apply to a GGUF file (%s): its "
                         "tensors carry their own block types", flag, path);
                return TSR_E_INVAL;
        }
        if ((st = tsr_modelopt_config_read(path, mo, err, errlen)) != TSR_OK)
                return st;
        if ((st = tsr_modelopt_check_flag(mo, flag, path, err, errlen)) != TSR_OK) {
                tsr_modelopt_config_done(mo);
                return st;
        }
        if (mo->algo == TSR_MODELOPT_NONE)
                return TSR_OK;
        log_info("quantization: %s (ModelOpt %s, from %s%s); the quantized weights stay as stored",
                 tsr_modelopt_method(mo->algo), tsr_modelopt_algo_name(mo->algo), mo->source,
                 mo->kv_cache_fp8 ? "; its FP8 KV cache scales are not used: --kv-cache-dtype auto" : "");
        if (tsr_safetensors_set_open(path, &set, err, errlen) == TSR_OK) {
                size_t n = tsr_modelopt_unmatched_excludes(mo, set, unmatched, 8);
                for (size_t i = 0; i < n && i < 8; i++)
                        log_warn("quantization: exclude_modules entry '%s' (%s) matches no module of the checkpoint",
                                 unmatched[i], mo->source);
                tsr_safetensors_set_close(&set);
        }
        return TSR_OK;
}

tsr_status tsr_runner_new(const char *path, const tsr_model_desc *desc, const tsr_runner_opts *opts,
                          uint64_t num_blocks, uint32_t block_size, uint32_t n_state_slots, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen) {
        bool bf16 = false;
        tsr_runner *r;
        tsr_status st;
        tsr_shard_spec whole;
        tsr_kv_group groups[TSR_KV_GROUPS_MAX];
        size_t n_groups;

        if (!opts || !opts->backend || !desc || !desc->family)
                return TSR_E_INVAL;
        r = calloc(1, sizeof(*r));
        if (!r)
                return TSR_E_NOMEM;
        r->fam = desc->family;
        r->be = opts->backend;
        if ((st = pick_dtype(opts, &bf16, err, errlen)) != TSR_OK)
                goto fail;
        /* tp = pp = 1 today: stage 0 of 1 holds every layer (DESIGN.md: weights always load
         * through a shard spec). */
        if ((st = r->fam->shard_for(desc, 0, 1, 0, 1, &whole)) != TSR_OK) {
                snprintf(err, errlen, "%s: the model has no layers", path);
                goto fail;
        }
        /* --dtype auto keeps a GGUF file's block-format matmul weights as they are (issue
         * #15: resident bytes = file bytes) wherever the backend's matmul computes on that
         * format; an explicit --dtype float32 or bfloat16 widens them as before (the
         * transformers goldens are float32 math). */
        tsr_load_opts lo = {0};
        if (!opts->dtype || strcmp(opts->dtype, "auto") == 0)
                for (int t = 0; t < TSR_DTYPE_COUNT; t++)
                        if (tsr_dtype_get_info((tsr_dtype)t)->quantized &&
                            tsr_backend_supports(r->be, TSR_OP_MATMUL, (tsr_dtype)t))
                                lo.keep_dtypes |= 1u << t;
        /* A ModelOpt FP8 / NVFP4 folder: its quantized weights stay as stored (issue #15). */
        tsr_modelopt_config mo = {0};
        if ((st = quant_config(path, desc, opts->quantization, &mo, err, errlen)) != TSR_OK)
                goto fail;
        lo.modelopt = mo.algo != TSR_MODELOPT_NONE ? &mo : NULL;
        st = r->fam->load(path, desc, &whole, &lo, progress, NULL, &r->model, stats, err, errlen);
        tsr_modelopt_config_done(&mo);
        if (st != TSR_OK)
                goto fail;
        if (bf16 && (st = r->fam->use_bf16(r->model)) == TSR_E_UNSUPPORTED &&
            (!opts->dtype || strcmp(opts->dtype, "auto") == 0)) {
                /* --dtype auto asked for bfloat16 on this CPU, but the family has no
                 * bfloat16 path: keep float32 (an explicit --dtype bfloat16 is refused). */
                log_info("model family %s has no bfloat16 weights: float32 under --dtype auto", r->fam->name);
                bf16 = false;
                st = TSR_OK;
        }
        if (bf16 && st != TSR_OK) {
                snprintf(err, errlen, "cannot convert the weights to bfloat16: %s", tsr_status_str(st));
                goto fail;
        }
        if (bf16)
                log_info("matmul weights held as bfloat16 (rounded from float32), the float32 copies freed");
        if ((st = r->fam->check_backend(r->model, r->be)) != TSR_OK) {
                snprintf(err, errlen, "kernel backend '%s' lacks ops the %s forward needs", tsr_backend_name(r->be),
                         r->fam->name);
                goto fail;
        }
        /* The KV memory, group by group as the family declares it for this shard; the
         * family's forward gets a view of it. */
        n_groups = r->fam->kv_groups(desc, &whole, groups, TSR_KV_GROUPS_MAX);
        if ((st = tsr_kv_pool_new_slots(groups, n_groups, num_blocks, block_size, n_state_slots, &r->kv_memory)) !=
                    TSR_OK ||
            (st = r->fam->kv_bind(r->model, r->kv_memory, &r->pool)) != TSR_OK) {
                snprintf(err, errlen, "cannot allocate the KV cache (%llu blocks of %u tokens, %zu group%s): %s",
                         (unsigned long long)num_blocks, block_size, n_groups, n_groups == 1 ? "" : "s",
                         tsr_status_str(st));
                goto fail;
        }
        r->em.vocab = desc->vocab_size;
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
        if (r->pool)
                r->fam->kv_unbind(&r->pool);
        tsr_kv_pool_free(&r->kv_memory);
        if (r->model)
                r->fam->free(&r->model);
        free(r);
        *rp = NULL;
}

const tsr_engine_model *tsr_runner_model(const tsr_runner *r) { return &r->em; }

const char *tsr_runner_dtype(const tsr_runner *r) {
        return r && r->fam->is_bf16(r->model) ? "bfloat16" : "float32";
}
