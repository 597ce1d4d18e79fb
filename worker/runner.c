/* runner.c - a Llama GGUF on the CPU reference kernels, as an engine_model. */
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
        st = tsr_llama_forward_batch(r->model, r->pool, ls, n_seqs, logits);
        free(ls);
        return st;
}

static void progress(void *ud, const tsr_load_stats *done, const tsr_load_stats *total) {
        (void)ud;
        if (done->n_tensors == total->n_tensors || done->n_tensors % 64 == 0)
                log_info("loading weights: %zu/%zu tensors", done->n_tensors, total->n_tensors);
}

static bool is_dir(const char *path) {
        struct stat sb;
        return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

tsr_status tsr_runner_new(const char *path, uint64_t num_blocks, uint32_t block_size, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_runner *r;
        tsr_status st;
        size_t len = strlen(path);

        /* A Hugging Face folder or a .gguf file; tsr_llama_load tells the two apart and
         * refuses architectures other than Llama with TSR_E_UNSUPPORTED. */
        if (!is_dir(path) && (len < 5 || strcmp(path + len - 5, ".gguf") != 0)) {
                snprintf(err, errlen, "a model is a Hugging Face folder or a .gguf file");
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
