/* nemotron_h_family.c - NemotronH (transformers' NemotronHForCausalLM, model_type
 * nemotron_h: Nemotron-H, Nemotron Nano 2, Nemotron-3-Nano) as a model family: the
 * config reader of nemotron_h_config.c, the forward and state of nemotron_h.c.
 *
 * HF safetensors folders only (F32, F16 or BF16 tensors; linears held in float32 or
 * bf16; a ModelOpt FP8 / NVFP4 checkpoint's quantized linears as stored), on the
 * CPU, or one whole model on a device (tsr_nemotron_h_to_backend).  llama.cpp names this architecture "nemotron_h" in GGUF (and
 * "nemotron_h_moe" for the MoE variant); we list both so a GGUF of it is refused with a
 * clear error rather than served as metadata only. */
#include "worker/model/family.h"

#include <stdlib.h>

#include "worker/model/nemotron_h.h"

static const char *const hf_archs[] = {"NemotronHForCausalLM", NULL};
static const char *const hf_types[] = {"nemotron_h", NULL};
static const char *const gguf_archs[] = {"nemotron_h", "nemotron_h_moe", NULL};

static const tsr_nemotron_h_config *cfg_of(const tsr_model_desc *d) { return d->config; }

static tsr_status nh_read_config(const char *path, bool gguf, tsr_model_desc *ret, char *err, size_t errlen) {
        tsr_nemotron_h_config *c;
        tsr_status st;

        if (!(c = calloc(1, sizeof *c))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                return TSR_E_NOMEM;
        }
        ret->config = c;
        if (gguf) {
                tsr_gguf *g = NULL;
                if ((st = tsr_gguf_open(path, &g, err, errlen)) != TSR_OK)
                        return st;
                st = tsr_nemotron_h_config_from_gguf(g, path, c, err, errlen);
                tsr_gguf_close(&g);
        } else {
                st = tsr_nemotron_h_config_from_hf(path, c, err, errlen);
        }
        ret->vocab_size = c->vocab_size;
        ret->n_layers = c->n_layers;
        ret->hidden_size = c->dim;
        ret->state_chunk = c->chunk_size;
        if (tsr_nemotron_h_count(c, 'M'))
                ret->scan_chunk = tsr_nemotron_h_scan_chunk(c);
        return st;
}

/* The whole model or a pipeline stage's layers, of one tensor-parallel rank: its KV heads,
 * its heads' and groups' Mamba state. */
static size_t nh_kv_groups(const tsr_model_desc *d, const tsr_shard_spec *shard, tsr_kv_group *out, size_t max) {
        return tsr_nemotron_h_kv_groups(cfg_of(d), shard->first_layer, shard->last_layer, shard->tp_size, out, max);
}

/* Layer ranges as the Llama family splits them (a function of the layer count only):
 * every layer counts, whatever its kind (Mamba, attention, MoE, MLP), as vLLM's
 * get_pp_indices counts the hybrid pattern's layers. */
static tsr_status nh_shard_for(const tsr_model_desc *d, uint32_t tp_rank, uint32_t tp_size, uint32_t pp_rank,
                               uint32_t pp_size, tsr_shard_spec *ret) {
        return tsr_family_llama.shard_for(d, tp_rank, tp_size, pp_rank, pp_size, ret);
}

static tsr_status nh_load(const char *path, const tsr_model_desc *d, const tsr_shard_spec *shard,
                          const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, void **ret,
                          tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_nemotron_h *m = NULL;
        tsr_status st;

        /* opts->keep_dtypes is not read: a GGUF's tensors are widened to float32; a
         * ModelOpt FP8 / NVFP4 folder's quantized linears stay as stored, and with
         * keep_bf16 a BF16 folder's linears */
        if ((st = tsr_nemotron_h_load(path, cfg_of(d), shard, opts, progress, ud, &m, stats, err, errlen)) == TSR_OK)
                *ret = m;
        return st;
}

static void nh_free(void **model) {
        tsr_nemotron_h *m = *model;
        tsr_nemotron_h_free(&m);
        *model = NULL;
}

/* --dtype bfloat16 (and auto where the runner picks bfloat16): bf16 linears, the rest
 * float32 (tsr_nemotron_h_use_bf16). */
static tsr_status nh_use_bf16(void *model) { return tsr_nemotron_h_use_bf16(model); }
static bool nh_is_bf16(const void *model) { return tsr_nemotron_h_is_bf16(model); }
static uint64_t nh_resident_bytes(const void *model) { return tsr_nemotron_h_resident_bytes(model); }
static tsr_status nh_check_backend(const void *model, const tsr_backend *be) {
        return tsr_nemotron_h_check_backend(model, be);
}

static tsr_status nh_to_backend(void *model, tsr_backend *be, size_t tokens, size_t logit_rows, char *err,
                                size_t errlen) {
        tsr_status st = tsr_nemotron_h_to_backend(model, be, err, errlen);
        if (st == TSR_OK && (st = tsr_nemotron_h_reserve(model, tokens, logit_rows)) != TSR_OK)
                tsr_errf(err, errlen, "cannot allocate the forward's activations for %zu tokens on the %s backend: %s",
                         tokens, tsr_backend_name(be), tsr_status_str(st));
        return st;
}

/* tsr_nemotron_h_to_backend's refusal known from the config: one Mamba group. */
static const char *nh_device_refusal(const tsr_model_desc *d) {
        const tsr_nemotron_h_config *c = cfg_of(d);
        return tsr_nemotron_h_count(c, 'M') && tsr_nemotron_h_norm_across(c)
                       ? "a NemotronH whose Mamba layers have one group (n_groups 1) does not run on CUDA yet"
                       : NULL;
}

static tsr_status nh_kv_bind(const void *model, tsr_kv_pool *pool, void **ret) {
        tsr_nemotron_h_cache *c = NULL;
        tsr_status st = tsr_nemotron_h_cache_bind(model, pool, &c);
        if (st == TSR_OK)
                *ret = c;
        return st;
}

/* ModelOpt's kv scales sit on the attention mixers (models.md §4.5):
 * backbone.layers.{l}.mixer.{k,v}_proj.{k,v}_scale, l the i-th attention layer's index
 * in the hybrid pattern. */
static const char *nh_kv_scale_module(const tsr_model_desc *d, const tsr_shard_spec *shard, uint32_t group,
                                      uint32_t i, uint32_t *layer) {
        (void)group;            /* one attention group (the state group is not paged) */
        const tsr_nemotron_h_config *c = cfg_of(d);
        uint32_t seen = 0;
        *layer = shard->first_layer;
        for (uint32_t l = shard->first_layer; l <= shard->last_layer && l < c->n_layers; l++)
                if (c->pattern[l] == '*' && seen++ == i) {
                        *layer = l;
                        break;
                }
        return "backbone.layers.%u.mixer";
}

static void nh_kv_unbind(void **view) {
        tsr_nemotron_h_cache *c = *view;
        tsr_nemotron_h_cache_free(&c);
        *view = NULL;
}

static tsr_status nh_forward_batch(const void *model, tsr_backend *be, void *pool, const void *seqs, size_t n_seqs,
                                   float *logits) {
        return tsr_nemotron_h_forward_batch(model, be, pool, seqs, n_seqs, logits);
}

static tsr_status nh_forward_stage(const void *model, tsr_backend *be, void *pool, const void *seqs, size_t n_seqs,
                                   const float *in, float *out, float *logits) {
        return tsr_nemotron_h_forward_stage(model, be, pool, seqs, n_seqs, in, out, logits);
}

/* Tensor parallelism: the rank's split of the loaded model (tsr_nemotron_h_shard_tp). */
static tsr_status nh_tp_shard(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return tsr_nemotron_h_shard_tp(model, tp_rank, tp_size, err, errlen);
}

static tsr_status nh_ep_shard(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return tsr_nemotron_h_shard_ep(model, tp_rank, tp_size, err, errlen);
}

static void nh_tp_set_comm(void *model, struct tsr_comm *comm) { tsr_nemotron_h_set_comm(model, comm); }

static void nh_seq_fill(void *seq, const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                        size_t past_len, bool want_logits, bool want_all_logits) {
        *(tsr_nemotron_h_seq *)seq = (tsr_nemotron_h_seq){
                .block_table = block_table,
                .n_table = n_table,
                .tokens = tokens,
                .n = n,
                .past_len = past_len,
                .which = want_all_logits ? TSR_LLAMA_LOGITS_ALL
                         : want_logits   ? TSR_LLAMA_LOGITS_LAST
                                         : TSR_LLAMA_LOGITS_NONE,
        };
}

static void nh_seq_set_answer(void *seq, const tsr_engine_seq *q) { ((tsr_nemotron_h_seq *)seq)->answer = q; }

static void nh_seq_set_state(void *seq, uint32_t slot, const uint32_t *restore_from, const tsr_state_save *saves,
                             size_t n_saves, uint32_t prompt_len) {
        tsr_nemotron_h_seq *q = seq;
        q->chunked_end = prompt_len;
        q->slot = slot;
        q->restore = restore_from != NULL;
        q->restore_from = restore_from ? *restore_from : 0;
        q->saves = saves;
        q->n_saves = n_saves;
}

const tsr_model_family tsr_family_nemotron_h = {
        .name = "nemotron_h",
        .hf_architectures = hf_archs,
        .hf_model_types = hf_types,
        .gguf_architectures = gguf_archs,
        .read_config = nh_read_config,
        .tensors = tsr_nemotron_h_tensors,
        .n_tensors = TSR_NEMOTRON_H_N_TENSORS,
        .kv_groups = nh_kv_groups,
        .shard_for = nh_shard_for,
        .load = nh_load,
        .free = nh_free,
        .use_bf16 = nh_use_bf16,
        .is_bf16 = nh_is_bf16,
        .resident_bytes = nh_resident_bytes,
        .check_backend = nh_check_backend,
        .to_backend = nh_to_backend,
        .device_refusal = nh_device_refusal,
        .kv_bind = nh_kv_bind,
        .kv_scale_module = nh_kv_scale_module,
        .kv_unbind = nh_kv_unbind,
        .forward_batch = nh_forward_batch,
        .forward_stage = nh_forward_stage,
        .tp_shard = nh_tp_shard,
        .load_tp_share = true,
        .tp_quantized = true,
        .ep_shard = nh_ep_shard,
        .moe = true,
        .tp_set_comm = nh_tp_set_comm,
        .seq_size = sizeof(tsr_nemotron_h_seq),
        .seq_fill = nh_seq_fill,
        .seq_set_answer = nh_seq_set_answer,
        .seq_set_state = nh_seq_set_state,
};
