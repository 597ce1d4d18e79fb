/* llama4_family.c - Llama 4 text (transformers' Llama4ForCausalLM and the text half of
 * Llama4ForConditionalGeneration) as a model family: the config reader of
 * llama4_config.c, the weights and forward of llama4.c, and the tables below. */
#include "worker/model/family.h"

#include <stdlib.h>

#include "worker/model/llama4.h"

static const char *const hf_archs[] = {"Llama4ForConditionalGeneration", "Llama4ForCausalLM", NULL};
static const char *const hf_types[] = {"llama4", "llama4_text", NULL};
/* llama.cpp's convert_hf_to_gguf.py writes Llama 4's text model as "llama4". */
static const char *const gguf_archs[] = {"llama4", NULL};

/* One row per weight: llama.cpp's GGUF names, and HF names without the nesting prefix
 * (the loader adds "language_model." for the nested layout; llama4.h).  Shard rules
 * (tsr_llama4_shard_tp splits by them): attention as Llama; the router replicated; the
 * shared expert and the dense MLP as Llama's MLP; every expert split like an MLP, gate/up
 * column-parallel and down row-parallel.  HF stores the experts [E, in, out]
 * (transformers' BMM layout, gate and up in one stack), so "column" splits their last
 * dimension (gate and up halves each) and "row" the middle one of down_proj; the GGUF
 * stores them as the matmul reads them, [E, out, in], gate and up apart (the converter
 * splits and transposes), down too (llama4.c's l4_slice and llama4_bind know both). */
static const tsr_tensor_name llama4_tensors[] = {
        {"token_embd", "token_embd.weight", "model.embed_tokens.weight", false, TSR_SHARD_COLUMN},
        {"rope_freqs", "rope_freqs.weight", NULL, false, TSR_SHARD_REPLICATED},        /* GGUF: llama3 divisors */
        {"attn_norm", "blk.%u.attn_norm.weight", "model.layers.%u.input_layernorm.weight", true,
         TSR_SHARD_REPLICATED},
        {"attn_q", "blk.%u.attn_q.weight", "model.layers.%u.self_attn.q_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_k", "blk.%u.attn_k.weight", "model.layers.%u.self_attn.k_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_v", "blk.%u.attn_v.weight", "model.layers.%u.self_attn.v_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_output", "blk.%u.attn_output.weight", "model.layers.%u.self_attn.o_proj.weight", true, TSR_SHARD_ROW},
        {"ffn_norm", "blk.%u.ffn_norm.weight", "model.layers.%u.post_attention_layernorm.weight", true,
         TSR_SHARD_REPLICATED},
        {"ffn_gate", "blk.%u.ffn_gate.weight", "model.layers.%u.feed_forward.gate_proj.weight", true, TSR_SHARD_COLUMN},
        {"ffn_up", "blk.%u.ffn_up.weight", "model.layers.%u.feed_forward.up_proj.weight", true, TSR_SHARD_COLUMN},
        {"ffn_down", "blk.%u.ffn_down.weight", "model.layers.%u.feed_forward.down_proj.weight", true, TSR_SHARD_ROW},
        {"ffn_gate_inp", "blk.%u.ffn_gate_inp.weight", "model.layers.%u.feed_forward.router.weight", true,
         TSR_SHARD_REPLICATED},
        {"ffn_gate_up_exps", NULL, "model.layers.%u.feed_forward.experts.gate_up_proj", true, TSR_SHARD_COLUMN},
        {"ffn_gate_exps", "blk.%u.ffn_gate_exps.weight", NULL, true, TSR_SHARD_COLUMN},
        {"ffn_up_exps", "blk.%u.ffn_up_exps.weight", NULL, true, TSR_SHARD_COLUMN},
        {"ffn_down_exps", "blk.%u.ffn_down_exps.weight", "model.layers.%u.feed_forward.experts.down_proj", true,
         TSR_SHARD_ROW},
        {"ffn_gate_shexp", "blk.%u.ffn_gate_shexp.weight", "model.layers.%u.feed_forward.shared_expert.gate_proj.weight",
         true, TSR_SHARD_COLUMN},
        {"ffn_up_shexp", "blk.%u.ffn_up_shexp.weight", "model.layers.%u.feed_forward.shared_expert.up_proj.weight",
         true, TSR_SHARD_COLUMN},
        {"ffn_down_shexp", "blk.%u.ffn_down_shexp.weight",
         "model.layers.%u.feed_forward.shared_expert.down_proj.weight", true, TSR_SHARD_ROW},
        {"output_norm", "output_norm.weight", "model.norm.weight", false, TSR_SHARD_REPLICATED},
        {"output", "output.weight", "lm_head.weight", false, TSR_SHARD_COLUMN},
};

static tsr_status llama4_read_config(const char *path, bool gguf, tsr_model_desc *ret, char *err, size_t errlen) {
        tsr_llama4_config *c = NULL;
        tsr_status st;

        if (gguf) {
                tsr_gguf *g = NULL;
                if ((st = tsr_gguf_open(path, &g, err, errlen)) != TSR_OK)
                        return st;
                st = tsr_llama4_config_from_gguf(g, path, &c, err, errlen);
                tsr_gguf_close(&g);
        } else {
                st = tsr_llama4_config_from_hf(path, &c, err, errlen);
        }
        if (st != TSR_OK)
                return st;
        ret->config = c;
        ret->vocab_size = c->base.vocab_size;
        ret->n_layers = c->base.n_layers;
        ret->hidden_size = c->base.dim;
        return TSR_OK;
}

/* The hybrid of llama4.h: full-attention layers in one group, chunked ones in
 * chunked-local groups whose blocks behind the chunk the engine frees (issue #14); a
 * pipeline stage's, the whole model's groups it has layers of. */
static size_t llama4_kv_groups(const tsr_model_desc *d, const tsr_shard_spec *shard, tsr_kv_group *out, size_t max) {
        return tsr_llama4_kv_groups(d->config, shard->first_layer, shard->last_layer, shard->tp_size, out, max);
}

/* The fp8 KV cache: a (ModelOpt) checkpoint's scales of layer i of the range's paged
 * group `group` sit on that layer's attention module, as Llama's. */
static const char *llama4_kv_scale_module(const tsr_model_desc *d, const tsr_shard_spec *shard, uint32_t group,
                                          uint32_t i, uint32_t *layer) {
        *layer = tsr_llama4_kv_layer(d->config, shard->first_layer, shard->last_layer, shard->tp_size, group, i);
        return "model.layers.%u.self_attn";
}

static tsr_status llama4_load(const char *path, const tsr_model_desc *d, const tsr_shard_spec *shard,
                              const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, void **ret,
                              tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_llama4 *m = NULL;
        tsr_status st;
        /* opts->keep_dtypes is not read: a GGUF's tensors (F32, F16, the block formats) are
         * widened to float32; a ModelOpt FP8 / NVFP4 folder's quantized linears and experts
         * stay as stored, and with keep_bf16 a BF16 folder's linears and expert stacks */
        if ((st = tsr_llama4_load(path, d->config, shard, opts, progress, ud, &m, stats, err, errlen)) == TSR_OK)
                *ret = m;
        return st;
}

static void llama4_free(void **model) {
        tsr_llama4 *m = *model;
        tsr_llama4_free(&m);
        *model = NULL;
}

static tsr_status llama4_use_bf16(void *model) { return tsr_llama4_use_bf16(model); }

static tsr_status llama4_to_backend(void *model, tsr_backend *be, size_t tokens, size_t logit_rows, char *err,
                                    size_t errlen) {
        tsr_status st = tsr_llama4_to_backend(model, be, err, errlen);
        if (st == TSR_OK && (st = tsr_llama4_reserve(model, tokens, logit_rows)) != TSR_OK)
                tsr_errf(err, errlen, "cannot allocate the forward's activations for %zu tokens on the %s backend: %s",
                         tokens, tsr_backend_name(be), tsr_status_str(st));
        return st;
}
static bool llama4_is_bf16(const void *model) { return tsr_llama4_is_bf16(model); }
static uint64_t llama4_resident_bytes(const void *model) { return tsr_llama4_resident_bytes(model); }
static tsr_status llama4_check_backend(const void *model, const tsr_backend *be) {
        return tsr_llama4_check_backend(model, be);
}

static tsr_status llama4_kv_bind(const void *model, tsr_kv_pool *pool, void **ret) {
        tsr_llama4_kv *kv = NULL;
        tsr_status st = tsr_llama4_kv_bind(model, pool, &kv);
        if (st == TSR_OK)
                *ret = kv;
        return st;
}

static void llama4_kv_unbind(void **view) {
        tsr_llama4_kv *kv = *view;
        tsr_llama4_kv_free(&kv);
        *view = NULL;
}

static tsr_status llama4_forward_batch(const void *model, tsr_backend *be, void *pool, const void *seqs, size_t n_seqs,
                                       float *logits) {
        return tsr_llama4_forward_batch(model, be, pool, seqs, n_seqs, logits);
}

static tsr_status llama4_forward_stage(const void *model, tsr_backend *be, void *pool, const void *seqs,
                                       size_t n_seqs, const float *in, float *out, float *logits) {
        return tsr_llama4_forward_stage(model, be, pool, seqs, n_seqs, in, out, logits);
}

static tsr_status llama4_tp_shard(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return tsr_llama4_shard_tp(model, tp_rank, tp_size, err, errlen);
}

static tsr_status llama4_ep_shard(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return tsr_llama4_shard_ep(model, tp_rank, tp_size, err, errlen);
}

static void llama4_tp_set_comm(void *model, struct tsr_comm *comm) { tsr_llama4_set_comm(model, comm); }

/* The sequence record and the pipeline split are the Llama family's (llama.h). */
const tsr_model_family tsr_family_llama4 = {
        .name = "llama4",
        .hf_architectures = hf_archs,
        .hf_model_types = hf_types,
        .gguf_architectures = gguf_archs,
        .read_config = llama4_read_config,
        .tensors = llama4_tensors,
        .n_tensors = sizeof llama4_tensors / sizeof llama4_tensors[0],
        .kv_groups = llama4_kv_groups,
        .shard_for = tsr_llama_shard_for,
        .load = llama4_load,
        .free = llama4_free,
        .use_bf16 = llama4_use_bf16,
        .is_bf16 = llama4_is_bf16,
        .resident_bytes = llama4_resident_bytes,
        .check_backend = llama4_check_backend,
        .to_backend = llama4_to_backend,
        .kv_bind = llama4_kv_bind,
        .kv_scale_module = llama4_kv_scale_module,
        .kv_unbind = llama4_kv_unbind,
        .forward_batch = llama4_forward_batch,
        .forward_stage = llama4_forward_stage,
        .tp_shard = llama4_tp_shard,
        .load_tp_share = true,
        .tp_quantized = true,
        .ep_shard = llama4_ep_shard,
        .moe = true,
        .tp_set_comm = llama4_tp_set_comm,
        .seq_size = sizeof(tsr_llama_seq),
        .seq_fill = tsr_llama_seq_fill,
        .seq_set_answer = tsr_llama_seq_set_answer,
};
