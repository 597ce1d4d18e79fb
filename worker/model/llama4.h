/* llama4.h - the Llama 4 text model (transformers' Llama4ForCausalLM, and the text half of
 * Llama4ForConditionalGeneration), written against kernels/kernels.h: models.md §2.
 *
 * What differs from the dense Llama (llama.h), per layer l:
 *  - RoPE layers (no_rope_layers[l] == 1) rotate q and k in the interleaved-pairs layout
 *    (HF's complex apply_rotary_emb on the checkpoint's unpermuted rows), then, with
 *    use_qk_norm, L2-normalise each head of q and k (no weight, eps = rms_norm_eps);
 *  - NoPE layers skip RoPE and, with attn_temperature_tuning, scale q by
 *    log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1;
 *  - chunked layers (layer_types[l] == "chunked_attention") attend only to the keys of
 *    their own chunk: query p sees keys [floor(p / C) * C, p], C = attention_chunk_size;
 *  - MoE layers (moe_layers) replace the MLP by a router (top-k of x . W_routerᵀ, sigmoid
 *    of the chosen logits), the chosen experts run on x * score (the score scales the
 *    expert's INPUT), plus a shared expert on x; the others keep a SwiGLU MLP of width
 *    intermediate_size_mlp.
 * The KV cache (issue #14) is a hybrid, as vLLM's for Llama 4: the full-attention layers
 * form one TSR_KV_FULL_ATTENTION group and the chunked layers TSR_KV_CHUNKED_LOCAL
 * groups of as many layers (tsr_llama4_kv_groups), each with its own block table, whose
 * blocks behind the current chunk the engine frees.  A pool of the one full-attention
 * group tsr_llama4_kv_group (every position of every layer) is served too.
 *
 * Thread safety and the backend argument as llama.h: a loaded model is read-only; each
 * forward runs on the caller's backend and its own KV view. */
#ifndef TSR_LLAMA4_H
#define TSR_LLAMA4_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/loader.h"
#include "worker/model/llama.h"
#include "worker/model/llama_weights.h"

/* Per-layer flags of tsr_llama4_config.layer[]. */
enum {
        TSR_LLAMA4_ROPE = 1u << 0,      /* RoPE (+ qk norm); else NoPE (+ temperature tuning) */
        TSR_LLAMA4_CHUNKED = 1u << 1,   /* chunked local attention; else full causal */
        TSR_LLAMA4_MOE = 1u << 2,       /* router + experts + shared expert; else dense MLP */
};

/* What the forward needs.  One flat allocation (the family's description frees it with
 * free()): layer[] follows the struct. */
typedef struct tsr_llama4_config {
        /* The fields a dense Llama has, read by the Llama reader from text_config:
         * dim, n_layers, heads, head_dim, vocab, rms_eps, rope (theta, llama3 scaling;
         * layout interleaved), tied embeddings; hidden_dim is the experts' width
         * (intermediate_size). */
        tsr_llama_config base;
        uint32_t mlp_dim;               /* intermediate_size_mlp: the dense layers' width */
        uint32_t n_experts;             /* num_local_experts */
        uint32_t top_k;                 /* num_experts_per_tok */
        uint32_t chunk;                 /* attention_chunk_size; 0: none */
        bool qk_norm;                   /* use_qk_norm */
        bool temp_tuning;               /* attn_temperature_tuning */
        float floor_scale, attn_scale;  /* temperature tuning's */
        bool nested;                    /* Llama4ForConditionalGeneration: text_config, language_model. tensors */
        bool gguf;                      /* read from a GGUF (tsr_llama4_config_from_gguf): load from it too */
        uint8_t layer[];                /* [base.n_layers] TSR_LLAMA4_* flags */
} tsr_llama4_config;

/* Read dir/config.json: Llama4ForCausalLM (model_type llama4_text) at the top level, or
 * Llama4ForConditionalGeneration (model_type llama4) whose text_config holds the fields;
 * the vision_config is not read.  Defaults and derived per-layer lists as transformers'
 * Llama4TextConfig.__post_init__: no_rope_layers (absent or empty: every
 * no_rope_layer_interval-th layer is NoPE), moe_layers (absent: every
 * interleave_moe_layer_step-th layer), layer_types (absent: chunked where RoPE and
 * attention_chunk_size is set).  *ret (malloc'd, free()) written only on success.
 * TSR_E_INVAL (bad or missing field, named), TSR_E_UNSUPPORTED (another architecture,
 * a rope type, biases), TSR_E_NOTFOUND, TSR_E_IO, TSR_E_NOMEM.  Blocking. */
tsr_status tsr_llama4_config_from_hf(const char *dir, tsr_llama4_config **ret, char *err, size_t errlen);
/* The same from config.json's bytes; `path` names it in messages. */
tsr_status tsr_llama4_config_from_hf_json(const char *json, size_t len, const char *path, tsr_llama4_config **ret,
                                          char *err, size_t errlen);

/* The same from a GGUF of llama.cpp's "llama4" architecture (its convert_hf_to_gguf.py):
 * the Llama keys under "llama4." (tsr_llama_config_from_gguf_arch; feed_forward_length is
 * the dense layers' width), expert_count, expert_used_count, expert_feed_forward_length
 * (the experts' and the shared expert's width) and interleave_moe_layer_step, all
 * required.  What such a file does not say is fixed as llama.cpp's loader fixes it
 * (src/models/llama4.cpp): chunked attention of 8192 on three layers of every four, the
 * fourth NoPE with full attention and temperature tuning (floor_scale 8192, attn_scale
 * 0.1), qk norm on the RoPE layers unless the model has 128 experts; the llama3 RoPE
 * scaling comes as the rope_freqs.weight tensor (the load reads it).  A file with
 * "llama4.attention.sliding_window" 0 (every layer full attention: not a Llama 4 from
 * Meta) is TSR_E_UNSUPPORTED.  *ret (malloc'd, free()) only on success; `path` names the
 * file in messages. */
tsr_status tsr_llama4_config_from_gguf(const tsr_gguf *g, const char *path, tsr_llama4_config **ret, char *err,
                                       size_t errlen);

typedef struct tsr_llama4 tsr_llama4;

/* The weights of `spec` (the whole model, or a pipeline stage's layer range: its layers,
 * the embedding on the first stage, the final norm and lm_head on the last, the
 * embedding there too when tied) from the HF folder `dir`, float32 in host memory, as
 * `cfg` describes them (copied).  tp_size 1 (tsr_llama4_shard_tp splits the loaded
 * model for a tensor-parallel rank).  Tensor names are the family's
 * table (llama4_family.c) under the prefix the folder uses: "language_model." for the
 * nested layout when language_model.model.embed_tokens.weight is there, none otherwise
 * (Llama4ForCausalLM, and ModelOpt exports of the nested model).  Vision tower and
 * projector tensors are not read (one INFO line counts them).  The routed experts come
 * in transformers' BMM stacks (experts.gate_up_proj / down_proj) or, when the first
 * MoE layer of the range has experts.0.gate_proj.weight instead, one linear per expert
 * (experts.<e>.{gate,up,down}_proj: ModelOpt's NVFP4 export; vLLM reads both).
 *
 * `opts` (NULL: widen every tensor): opts->keep_bf16 keeps a BF16 folder's linears
 * (attention, dense MLP, shared expert) as stored, and its expert stacks as bf16 (one
 * transposition of the bytes, no float32 pass), the bits tsr_llama4_use_bf16 gives the
 * widened model; each rank reads only its share of them, and an untied embedding and
 * lm_head stay bf16 as stored too (a GGUF's and a tied table are widened); the router
 * is widened.  opts->modelopt: what the folder announces
 * (tsr_modelopt_config_read; NULL or algo NONE: none).
 * A ModelOpt FP8 / NVFP4 checkpoint's quantized linears stay as stored with their scales
 * (attention, dense MLP, shared expert; models.md §4.2), and so do its routed experts:
 * an FP8 BMM stack with its one scale pair (transposed per expert at load, still fp8),
 * or per-expert linears.  A MoE layer's experts are all quantized or none; as vLLM's
 * fused MoE, each expert GEMM quantizes its input with ONE scale, the max over the
 * layer's experts of their input_scale (gate and up together; down); each expert keeps
 * its own weight scales (vLLM requantizes gate/up to their max: a rounding difference
 * only when ModelOpt did not already give them one).  Progress and stats as
 * tsr_load_tensors.  Errors name the folder (or file) and the tensor. */
tsr_status tsr_llama4_load(const char *dir, const tsr_llama4_config *cfg, const tsr_shard_spec *spec,
                           const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, tsr_llama4 **ret,
                           tsr_load_stats *stats, char *err, size_t errlen);
/* Accepts NULL and *m == NULL; clears *m. */
void tsr_llama4_free(tsr_llama4 **m);
const tsr_llama4_config *tsr_llama4_config_of(const tsr_llama4 *m);

/* --dtype bfloat16: every matmul weight (attention, router, experts, shared expert,
 * dense MLP, output) rounded to bf16, float32 copies freed; activations, norms,
 * routing math and the cache stay float32.  TSR_OK (also when already), TSR_E_NOMEM
 * (the model half converted: only tsr_llama4_free may be called on it). */
tsr_status tsr_llama4_use_bf16(tsr_llama4 *m);
bool tsr_llama4_is_bf16(const tsr_llama4 *m);
/* The bytes the weights take in memory now (after tsr_llama4_use_bf16 too). */
uint64_t tsr_llama4_resident_bytes(const tsr_llama4 *m);
/* As tsr_llama_check_backend. */
tsr_status tsr_llama4_check_backend(const tsr_llama4 *m, const tsr_backend *be);
/* A backend whose memory is not the host's (CUDA): copy every weight array the forward
 * reads into its memory and free the host copies; the forward then keeps its activations
 * there too (tsr_llama4_reserve), its KV pool must be in that memory
 * (tsr_kv_pool_new_on), the router logits come back to the host for the top-k, the
 * logits are downloaded once a step, and `be` must outlive the model.  After load and
 * any tsr_llama4_use_bf16 (TSR_E_INVAL after this), a whole model only: TSR_E_UNSUPPORTED
 * (err says why) under tensor, expert or pipeline parallelism or for weights whose
 * matmul the backend lacks; TSR_E_NOMEM when the device is too small (err: the sizes,
 * before any allocation) or an allocation fails, a backend error on a copy; the model is
 * then unchanged.  A no-op on a host backend. */
tsr_status tsr_llama4_to_backend(tsr_llama4 *m, tsr_backend *be, char *err, size_t errlen);
/* On a device backend: allocate now the forward's activations for a step of `tokens`
 * tokens and `logit_rows` rows of logits (kept, and grown if a step ever needs more), so
 * the KV cache sized after this never leaves a step short.  TSR_OK and nothing on the
 * host; TSR_E_NOMEM, TSR_E_LIMIT. */
tsr_status tsr_llama4_reserve(const tsr_llama4 *m, size_t tokens, size_t logit_rows);

/* Tensor parallelism (issue #20): split a loaded float32 model (whole or a pipeline
 * stage) for rank tp_rank of tp_size as vLLM shards Llama 4 without expert parallelism:
 * q/k/v by heads (KV heads replicated when tp_size exceeds them), o_proj by input
 * columns; every expert's gate/up by output columns and its down_proj by input columns
 * (each rank holds 1/tp_size of every expert's intermediate columns), the shared expert
 * and the dense MLP likewise; the router and the norms whole; the embedding and lm_head
 * by vocabulary rows (tsr_tp_embed; the logits all-gathered).  The row-parallel matrices are held as
 * TSR_COMM_TREE_LEAVES / tp_size canonical K slices (tp.h), and an MoE block adds its
 * shared and routed experts' partials slice by slice before one reduce (R7), so TP 1
 * (tp_size 1: the canonical split alone) and TP > 1 give the same bits.  The KV the
 * model then binds has its local KV heads (tsr_llama4_kv_groups with tp_size).
 * TSR_E_UNSUPPORTED (a count tp_size does not divide, named in err; bf16 weights; the
 * model is then unchanged) or TSR_E_NOMEM (the model is then only fit to be freed).
 * Main thread, at start-up. */
struct tsr_comm;
tsr_status tsr_llama4_shard_tp(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
/* The rank's TP group, which the forwards of a tp_size > 1 model all-reduce and
 * all-gather over; set by the rank's thread before its forward (borrowed). */
/* --enable-expert-parallel (issue #14): tsr_llama4_shard_tp, except that each MoE
 * layer's routed experts go whole to the ranks, vLLM's linear placement (E / tp_size
 * consecutive experts each, the first E % tp_size ranks one more), their down_proj held
 * as all TSR_COMM_TREE_LEAVES canonical K slices; attention, the dense MLPs, the shared
 * expert and lm_head are split as by tsr_llama4_shard_tp.  In the forward every rank
 * routes every token (the router is whole), runs its experts on the tokens routed to
 * them (vLLM's naive dispatch: every rank has every token), and one all-reduce of each
 * choice's per-slice partials (written by the rank holding its expert, zero elsewhere)
 * lets each rank add its slices' partials in expert order, as the tensor-parallel sum
 * does: outputs bitwise those of tsr_llama4_shard_tp at any tp_size (and of TP 1).
 * That all-reduce moves N x top_k x TSR_COMM_TREE_LEAVES x dim floats per MoE layer.
 * Errors as tsr_llama4_shard_tp. */
tsr_status tsr_llama4_shard_ep(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
void tsr_llama4_set_comm(tsr_llama4 *m, struct tsr_comm *comm);

/* One KV group of every layer as full attention (chunked layers too), float32. */
tsr_kv_group tsr_llama4_kv_group(const tsr_llama4_config *cfg);
/* The hybrid groups of layers first .. last into out[max] (returns how many, 0 when max
 * is too small).  The whole model's grouping: without chunked layers the one group
 * above; else the full-attention layers as group 0 (when there are any), then the
 * chunked layers in order, split into TSR_KV_CHUNKED_LOCAL groups of P layers (the last
 * may have fewer), P = the full group's size, or more where more than max - 1 groups
 * would be needed: vLLM's equal groups, so that the groups' shared layer arrays
 * (kv_pool.h) go unused as little as possible.  A pipeline stage's range gets those of
 * the whole model's groups it has layers of, in order, each with its layers of the
 * range: the engine's block tables are the whole model's (one per paged group), which
 * every stage's layers index alike (tsr_llama4_kv_bind).  A tensor-parallel rank's
 * n_kv_heads: divided by tp_size, or one (replicated) when tp_size exceeds them. */
size_t tsr_llama4_kv_groups(const tsr_llama4_config *cfg, uint32_t first, uint32_t last, uint32_t tp_size,
                            tsr_kv_group *out, size_t max);
/* The model layer that is layer `i` of group `group` of tsr_llama4_kv_groups(cfg, first,
 * last, tp_size): the range's layers of that whole-model group, in order.  UINT32_MAX when
 * there is no such layer. */
uint32_t tsr_llama4_kv_layer(const tsr_llama4_config *cfg, uint32_t first, uint32_t last, uint32_t tp_size,
                             uint32_t group, uint32_t i);
typedef struct tsr_llama4_kv tsr_llama4_kv;
/* A view of `pool`: tsr_llama4_kv_group's one group of the model's layers, or
 * tsr_llama4_kv_groups' hybrid of its layer range (then a sequence's block_table holds
 * one table per paged group of the whole model, n_table entries each, in the whole
 * model's group order, whatever layers the model holds; kv_pool.h tsr_kv_tables), with the
 * model's KV heads (a tensor-parallel rank's).  TSR_E_INVAL for another pool. */
tsr_status tsr_llama4_kv_bind(const tsr_llama4 *m, tsr_kv_pool *pool, tsr_llama4_kv **ret);
void tsr_llama4_kv_free(tsr_llama4_kv **kv);

/* Several sequences (llama.h's tsr_llama_seq records) in one pass, as
 * tsr_llama_forward_batch: rows stacked for every matmul (experts included: a token's
 * expert output is computed in a row of its own), attention per sequence through its
 * block table.  Each sequence's logits are bitwise those of running it alone, and of
 * running it in any chunks.  Errors as tsr_llama_forward_batch. */
tsr_status tsr_llama4_forward_batch(const tsr_llama4 *m, tsr_backend *be, tsr_llama4_kv *kv, const tsr_llama_seq *seqs,
                                    size_t n_seqs, float *logits);
/* A pipeline stage's part of the step (family.h forward_stage, as
 * tsr_llama_forward_stage): `in` NULL on the first stage, else the previous stage's
 * (2, N, dim) pair; `out` receives it on a stage before the last, which writes `logits`.
 * Chained, the stages give tsr_llama4_forward_batch's logits bitwise.  TSR_E_INVAL as
 * that, and for `in` / `out` / `logits` not as the stage's place asks. */
tsr_status tsr_llama4_forward_stage(const tsr_llama4 *m, tsr_backend *be, tsr_llama4_kv *kv, const tsr_llama_seq *seqs,
                                    size_t n_seqs, const float *in, float *out, float *logits);

#endif
