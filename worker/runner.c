/* runner.c - a Llama GGUF on the CPU reference kernels, as an engine_model. */
#include "runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "llama.h"

struct tsr_runner {
        tsr_llama *model;
        tsr_llama_kv *pool;        /* every sequence's KV, indexed by the engine's block ids */
        engine_model em;
};

static tsr_status runner_forward(void *ud, const uint32_t *block_table, size_t n_table, const uint32_t *tokens,
                                 size_t n, size_t past_len, float *logits) {
        tsr_runner *r = ud;
        return tsr_llama_forward_blocks(r->model, r->pool, block_table, n_table, tokens, n, past_len,
                                        logits ? TSR_LLAMA_LOGITS_LAST : TSR_LLAMA_LOGITS_NONE, logits);
}

static void progress(void *ud, const tsr_load_stats *done, const tsr_load_stats *total) {
        (void)ud;
        if (done->n_tensors == total->n_tensors || done->n_tensors % 64 == 0)
                log_info("loading weights: %zu/%zu tensors", done->n_tensors, total->n_tensors);
}

tsr_status tsr_runner_new(const char *path, uint64_t num_blocks, uint32_t block_size, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_runner *r;
        tsr_status st;
        size_t len = strlen(path);

        if (len < 5 || strcmp(path + len - 5, ".gguf") != 0) {
                snprintf(err, errlen, "only GGUF files have a model runner yet (Hugging Face safetensors: issue #4)");
                return TSR_E_UNSUPPORTED;
        }
        r = calloc(1, sizeof(*r));
        if (!r)
                return TSR_E_NOMEM;
        st = tsr_llama_load(path, tsr_kernels_cpu_ref(), NULL, progress, NULL, &r->model, stats, err, errlen);
        if (st != TSR_OK)
                goto fail;
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
