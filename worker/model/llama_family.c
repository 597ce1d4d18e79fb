/* llama_family.c - Llama 3.x dense (transformers' LlamaForCausalLM, llama.cpp's "llama")
 * as a model family: the config readers of weights.c / weights_hf.c, the forward of
 * llama.c, and the tables below. */
#include "worker/model/family.h"

#include <stdio.h>
#include <stdlib.h>

#include "worker/load/gguf.h"
#include "worker/model/llama.h"
#include "worker/parallel/partition.h"

static const char *const hf_archs[] = {"LlamaForCausalLM", "llama", NULL};
static const char *const hf_types[] = {"llama", NULL};
static const char *const gguf_archs[] = {"llama", NULL};

/* One row per weight, in the order the loaders read them.  The embedding is split over
 * the vocabulary (its rows), as vLLM's VocabParallelEmbedding does; rope_freqs is
 * optional (GGUF only: llama3 frequency divisors precomputed by llama.cpp). */
static const tsr_tensor_name llama_tensors[] = {
        {"token_embd", "token_embd.weight", "model.embed_tokens.weight", false, TSR_SHARD_COLUMN},
        {"attn_norm", "blk.%u.attn_norm.weight", "model.layers.%u.input_layernorm.weight", true, TSR_SHARD_REPLICATED},
        {"attn_q", "blk.%u.attn_q.weight", "model.layers.%u.self_attn.q_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_k", "blk.%u.attn_k.weight", "model.layers.%u.self_attn.k_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_v", "blk.%u.attn_v.weight", "model.layers.%u.self_attn.v_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_output", "blk.%u.attn_output.weight", "model.layers.%u.self_attn.o_proj.weight", true, TSR_SHARD_ROW},
        {"ffn_norm", "blk.%u.ffn_norm.weight", "model.layers.%u.post_attention_layernorm.weight", true,
         TSR_SHARD_REPLICATED},
        {"ffn_gate", "blk.%u.ffn_gate.weight", "model.layers.%u.mlp.gate_proj.weight", true, TSR_SHARD_COLUMN},
        {"ffn_up", "blk.%u.ffn_up.weight", "model.layers.%u.mlp.up_proj.weight", true, TSR_SHARD_COLUMN},
        {"ffn_down", "blk.%u.ffn_down.weight", "model.layers.%u.mlp.down_proj.weight", true, TSR_SHARD_ROW},
        {"output_norm", "output_norm.weight", "model.norm.weight", false, TSR_SHARD_REPLICATED},
        {"output", "output.weight", "lm_head.weight", false, TSR_SHARD_COLUMN},
        {"rope_freqs", "rope_freqs.weight", NULL, false, TSR_SHARD_REPLICATED},
};

static const tsr_llama_config *cfg_of(const tsr_model_desc *d) { return d->config; }

static tsr_status llama_read_config(const char *path, bool gguf, tsr_model_desc *ret, char *err, size_t errlen) {
        tsr_llama_config *c = calloc(1, sizeof *c);
        tsr_gguf *g = NULL;
        tsr_status st;

        if (!c) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                return TSR_E_NOMEM;
        }
        ret->config = c;
        if (!gguf) {
                st = tsr_llama_config_from_hf(path, c, err, errlen);
        } else {
                if ((st = tsr_gguf_open(path, &g, err, errlen)) != TSR_OK)
                        return st;
                st = tsr_llama_config_from_gguf(g, path, c, err, errlen);
                tsr_gguf_close(&g);
        }
        ret->vocab_size = c->vocab_size;
        ret->n_layers = c->n_layers;
        ret->hidden_size = c->dim;
        return st;
}

/* Every layer is full attention; the cache is float32 whatever the weights' dtype
 * (tsr_llama_kv_group). */
static size_t llama_kv_groups(const tsr_model_desc *d, const tsr_shard_spec *shard, tsr_kv_group *out, size_t max) {
        if (max < 1 || shard->last_layer < shard->first_layer)
                return 0;
        out[0] = tsr_llama_kv_group(cfg_of(d));
        out[0].n_layers = shard->last_layer - shard->first_layer + 1;
        /* tp above the KV heads: one (replicated) KV head per rank, as vLLM */
        if (shard->tp_size > 1)
                out[0].n_kv_heads = shard->tp_size <= out[0].n_kv_heads ? out[0].n_kv_heads / shard->tp_size : 1;
        return 1;
}

tsr_status tsr_llama_shard_for(const tsr_model_desc *d, uint32_t tp_rank, uint32_t tp_size, uint32_t pp_rank,
                                uint32_t pp_size, tsr_shard_spec *ret) {
        uint32_t *counts, first = 0;
        char err[160];

        if (tp_size == 0 || tp_rank >= tp_size || pp_size == 0 || pp_rank >= pp_size || pp_size > d->n_layers)
                return TSR_E_INVAL;
        if (!(counts = malloc(pp_size * sizeof(*counts))))
                return TSR_E_NOMEM;
        if (tsr_pp_partition(d->n_layers, pp_size, NULL, counts, err, sizeof(err)) != TSR_OK) {
                free(counts);
                return TSR_E_INVAL;
        }
        for (uint32_t s = 0; s < pp_rank; s++)          /* vLLM's split, as the runner's stages */
                first += counts[s];
        *ret = (tsr_shard_spec){.tp_rank = tp_rank, .tp_size = tp_size, .first_layer = first,
                                .last_layer = first + counts[pp_rank] - 1};
        free(counts);
        return TSR_OK;
}

static tsr_status llama_load(const char *path, const tsr_model_desc *d, const tsr_shard_spec *shard,
                             const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, void **ret,
                             tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_llama *m = NULL;
        tsr_status st = tsr_llama_load_opts(path, cfg_of(d), shard, opts, progress, ud, &m, stats, err, errlen);
        if (st == TSR_OK)
                *ret = m;
        return st;
}

static void llama_free(void **model) {
        tsr_llama *m = *model;
        tsr_llama_free(&m);
        *model = NULL;
}

static tsr_status llama_use_bf16(void *model) { return tsr_llama_use_bf16(model); }
static bool llama_is_bf16(const void *model) { return tsr_llama_is_bf16(model); }
static uint64_t llama_resident_bytes(const void *model) { return tsr_llama_resident_bytes(model); }
static tsr_status llama_to_backend(void *model, tsr_backend *be, size_t tokens, size_t logit_rows, char *err,
                                   size_t errlen) {
        tsr_status st = tsr_llama_to_backend(model, be, err, errlen);
        if (st == TSR_OK && (st = tsr_llama_reserve(model, tokens, logit_rows)) != TSR_OK)
                snprintf(err, errlen, "cannot allocate the forward's activations for %zu tokens on the %s backend: %s",
                         tokens, tsr_backend_name(be), tsr_status_str(st));
        return st;
}

static tsr_status llama_capture_graphs(void *model, tsr_backend *be, void *pool, const tsr_graph_opts *o,
                                       size_t *captured) {
        tsr_status st = tsr_llama_set_graphs(model, o->sizes, o->n_sizes, o->table_width, o->max_seq_len);
        return st != TSR_OK ? st : tsr_llama_capture_graphs(model, be, pool, captured);
}

static tsr_status llama_check_backend(const void *model, const tsr_backend *be) {
        return tsr_llama_check_backend(model, be);
}

static tsr_status llama_kv_bind(const void *model, tsr_kv_pool *pool, void **ret) {
        tsr_llama_kv *kv = NULL;
        tsr_status st = tsr_llama_kv_bind(model, pool, &kv);
        if (st == TSR_OK)
                *ret = kv;
        return st;
}

static const char *llama_kv_scale_module(const tsr_model_desc *d, const tsr_shard_spec *shard, uint32_t group,
                                         uint32_t i, uint32_t *layer) {
        (void)d;
        (void)group;            /* one group */
        *layer = shard->first_layer + i;        /* the group holds the shard's layers in order */
        return "model.layers.%u.self_attn";
}

static void llama_kv_unbind(void **view) {
        tsr_llama_kv *kv = *view;
        tsr_llama_kv_free(&kv);
        *view = NULL;
}

static tsr_status llama_forward_batch(const void *model, tsr_backend *be, void *pool, const void *seqs,
                                      size_t n_seqs, float *logits) {
        return tsr_llama_forward_batch(model, be, pool, seqs, n_seqs, logits);
}

static tsr_status llama_forward_stage(const void *model, tsr_backend *be, void *pool, const void *seqs,
                                      size_t n_seqs, const float *in, float *out, float *logits) {
        return tsr_llama_forward_stage(model, be, pool, seqs, n_seqs, in, out, logits);
}

static tsr_status llama_tp_shard(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return tsr_llama_shard_tp(model, tp_rank, tp_size, err, errlen);
}

static void llama_tp_set_comm(void *model, struct tsr_comm *comm) { tsr_llama_set_comm(model, comm); }

void tsr_llama_seq_set_answer(void *seq, const tsr_engine_seq *q) { ((tsr_llama_seq *)seq)->answer = q; }

void tsr_llama_seq_fill(void *seq, const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                        size_t past_len, bool want_logits, bool want_all_logits) {
        *(tsr_llama_seq *)seq = (tsr_llama_seq){
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

const tsr_model_family tsr_family_llama = {
        .name = "llama",
        .hf_architectures = hf_archs,
        .hf_model_types = hf_types,
        .gguf_architectures = gguf_archs,
        .read_config = llama_read_config,
        .tensors = llama_tensors,
        .n_tensors = sizeof llama_tensors / sizeof llama_tensors[0],
        .kv_groups = llama_kv_groups,
        .shard_for = tsr_llama_shard_for,
        .load = llama_load,
        .free = llama_free,
        .use_bf16 = llama_use_bf16,
        .is_bf16 = llama_is_bf16,
        .resident_bytes = llama_resident_bytes,
        .check_backend = llama_check_backend,
        .to_backend = llama_to_backend,
        .capture_graphs = llama_capture_graphs,
        .kv_bind = llama_kv_bind,
        .kv_scale_module = llama_kv_scale_module,
        .kv_unbind = llama_kv_unbind,
        .forward_batch = llama_forward_batch,
        .forward_stage = llama_forward_stage,
        .tp_shard = llama_tp_shard,
        .load_tp_share = true,
        .tp_quantized = true,
        .tp_set_comm = llama_tp_set_comm,
        .seq_size = sizeof(tsr_llama_seq),
        .seq_fill = tsr_llama_seq_fill,
        .seq_set_answer = tsr_llama_seq_set_answer,
};
