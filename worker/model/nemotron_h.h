/* nemotron_h.h - the NemotronH hybrid (transformers' NemotronHForCausalLM, model_type
 * nemotron_h; Nemotron-3-Nano) on the host, in float32 or with bf16 linears
 * (tsr_nemotron_h_use_bf16), and with a ModelOpt FP8 / NVFP4 checkpoint's quantized linears
 * kept as stored (W8A8 / W4A4 through tsr_backend_matmul_scaled; tsr_nemotron_h_load), written
 * against kernels/kernels.h.
 *
 * The math is models.md §3 as transformers 5's modeling_nemotron_h.py computes it:
 *   h = embed[ids]
 *   per layer l: h += mixer_l(rmsnorm(h, layers.l.norm))    one pre-norm, no post-norm
 *   logits = rmsnorm(h, norm_f) . W_lmᵀ
 * where the mixer is, by hybrid_override_pattern[l],
 *   'M' Mamba-2: in_proj -> [z | xBC | dt]; causal depthwise conv1d + SiLU on xBC;
 *       the selective scan with A = -exp(A_log), Δ = clamp(softplus(dt + dt_bias),
 *       time_step_limit), D skip; the gated group RMSNorm (y * silu(z) first); out_proj;
 *   '*' attention without positional encoding (GQA, scale head_dim^-0.5);
 *   'E' MoE: sigmoid router in float32, e_score_correction_bias for the choice only,
 *       grouped top-k (n_group / topk_group), weights renormalised (norm_topk_prob) and
 *       scaled (routed_scaling_factor); ReLU² experts (up, down), plus a shared expert;
 *   '-' dense ReLU² MLP.
 * The scan is the sequential recurrence, token by token, for prefill as for decode
 * (exactness first; transformers' chunked SSD is algebraically the same sum and agrees
 * to rounding).  Every op is per row or per sequence with a fixed order, so a
 * sequence's logits are bitwise the same however it is batched or cut into chunks.
 *
 * State kept between steps (tsr_nemotron_h_cache): for attention layers the keys and
 * values of every position in paged blocks, as the Llama's; for Mamba layers one state
 * *slot* per running sequence, not per token: the last conv_kernel-1 raw xBC rows (conv
 * state) and the (heads, head_dim, state) SSM state, both float32 also when the linears
 * are bf16 (why: tsr_nemotron_h_kv_groups in nemotron_h.c).  A forward with
 * past_len == 0 starts the slot from zero; past_len > 0 continues the slot's state,
 * which must then hold exactly the sequence's first past_len tokens (no prefix reuse:
 * a Mamba state cannot be rewound).
 *
 * Thread safety: a loaded model is read-only; a cache is written by one forward at a
 * time (the engine thread or its step thread). */
#ifndef TSR_WORKER_MODEL_NEMOTRON_H_H
#define TSR_WORKER_MODEL_NEMOTRON_H_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/loader.h"
#include "worker/model/llama.h"

#define TSR_NEMOTRON_H_MAX_LAYERS 256
/* The longest chunk_size the chunked scan takes: its (chunk, chunk) C.B table is per thread. */
#define TSR_NEMOTRON_H_MAX_SSD_CHUNK TSR_MAMBA_MAX_CHUNK  /* kernels.h */

struct tsr_comm;

/* What config.json says, checked.  One flat struct (the family's desc->config). */
typedef struct tsr_nemotron_h_config {
        uint32_t vocab_size, dim, n_layers;
        char pattern[TSR_NEMOTRON_H_MAX_LAYERS + 1];    /* 'M', '*', 'E', '-' per layer */
        uint32_t n_heads, n_kv_heads, head_dim;                 /* attention */
        uint32_t m_heads, m_head_dim, ssm_state, n_groups, conv_kernel;   /* Mamba-2 */
        uint32_t chunk_size;    /* the SSD scan's chunk (config.json; 128, NemotronHConfig's default): the
                                 * step of the prefix cache's states unless --mamba-block-size; a
                                 * prefill runs whole chunks of it in the chunked form (2 ..
                                 * TSR_NEMOTRON_H_MAX_SSD_CHUNK; another value: the recurrence only) */
        bool conv_bias;
        float dt_min, dt_max;                                   /* time_step_limit */
        uint32_t n_experts, top_k, moe_hidden, shared_hidden;   /* MoE */
        uint32_t n_group, topk_group;
        bool norm_topk_prob;
        float routed_scale;
        uint32_t mlp_hidden;                                    /* '-' layers */
        float eps;
        bool tied_embeddings;
        bool residual_in_fp32;          /* a bf16 model keeps the residual stream in float32 */
        bool gguf;                      /* read from a GGUF (tsr_nemotron_h_config_from_gguf): load from it too */
} tsr_nemotron_h_config;

/* Read `dir`/config.json.  TSR_E_INVAL (missing or bad field: `err` names the file and
 * the field), TSR_E_UNSUPPORTED (biases, a latent MoE projection, activations other
 * than silu / relu2, more than one shared expert, multi-token-prediction layers are
 * ignored), TSR_E_NOTFOUND, TSR_E_IO.  Blocking. */
tsr_status tsr_nemotron_h_config_from_hf(const char *dir, tsr_nemotron_h_config *ret, char *err, size_t errlen);

/* The same from a GGUF of llama.cpp's "nemotron_h" or "nemotron_h_moe" architecture (its
 * convert_hf_to_gguf.py), keys under that prefix: embedding_length, block_count,
 * attention.head_count / head_count_kv (per layer: the attention layers' is non-zero) /
 * key_length / layer_norm_epsilon, ssm.conv_kernel / state_size / group_count /
 * inner_size / time_step_rank (the Mamba heads), and for MoE expert_count /
 * expert_used_count / expert_feed_forward_length / expert_shared_feed_forward_length /
 * expert_shared_count (1) / expert_weights_norm / expert_weights_scale /
 * expert_group_count / expert_group_used_count.  Each layer's kind comes from its tensors
 * (ssm_in: 'M', attn_q: '*', ffn_up_exps: 'E', ffn_up: '-'; the converter's per-layer
 * feed_forward_length says 0 for a '-' layer of a MoE model), the dense MLP's width from
 * ffn_up; time_step_limit is (0, inf), the converter's only value; the conv bias is
 * there when its tensor is.  TSR_E_INVAL naming the file and the key, TSR_E_UNSUPPORTED
 * (another architecture, a latent MoE, more than one shared expert, a layer of no kind). */
tsr_status tsr_nemotron_h_config_from_gguf(const tsr_gguf *g, const char *path, tsr_nemotron_h_config *ret,
                                           char *err, size_t errlen);

/* The counts one tensor-parallel rank of tp_size holds (tsr_nemotron_h_shard_tp): the
 * Mamba heads and B/C groups, the attention heads and KV heads (one, replicated, where
 * tp_size exceeds them), the columns of every expert, of the shared expert and of the
 * dense MLP; the rest as `c`.  tp_size 1: `c` itself. */
tsr_nemotron_h_config tsr_nemotron_h_config_rank(const tsr_nemotron_h_config *c, uint32_t tp_size);

/* Derived sizes of the Mamba mixer. */
/* The chunk a prefill's whole chunks run the scan's chunked form in: chunk_size, or 0
 * (the recurrence only) outside 2 .. TSR_NEMOTRON_H_MAX_SSD_CHUNK. */
static inline uint32_t tsr_nemotron_h_scan_chunk(const tsr_nemotron_h_config *c) {
        return c->chunk_size >= 2 && c->chunk_size <= TSR_NEMOTRON_H_MAX_SSD_CHUNK ? c->chunk_size : 0;
}
static inline uint32_t tsr_nemotron_h_d_inner(const tsr_nemotron_h_config *c) { return c->m_heads * c->m_head_dim; }
static inline uint32_t tsr_nemotron_h_conv_dim(const tsr_nemotron_h_config *c) {
        return c->m_heads * c->m_head_dim + 2 * c->n_groups * c->ssm_state;
}
/* Whether the Mamba layers' gated norm spans all d_inner channels in one group (n_groups
 * 1): its sum of squares is then taken as canonical leaves and finished on the host. */
bool tsr_nemotron_h_norm_across(const tsr_nemotron_h_config *c);
/* Layers of one kind ('M', '*', 'E', '-') in the pattern. */
uint32_t tsr_nemotron_h_count(const tsr_nemotron_h_config *c, char kind);

/* The family's tensor table (shard rules as data); nemotron_h.c. */
#define TSR_NEMOTRON_H_N_TENSORS 27
extern const tsr_tensor_name tsr_nemotron_h_tensors[TSR_NEMOTRON_H_N_TENSORS];

typedef struct tsr_nemotron_h tsr_nemotron_h;

/* Load the HF folder `dir` (config.json; model.safetensors or an index), its F32, F16
 * or BF16 tensors widened to float32 (exactly).
 * `opts` (NULL: widen every tensor): opts->keep_bf16 keeps a BF16 folder's linears (the
 * same ones as below, routed experts included), lm_head and an untied embedding table as
 * stored, 2 bytes each and never widened: the bits tsr_nemotron_h_use_bf16 gives the
 * widened model (the embedding rows widen exactly).  opts->modelopt:
 * what the folder announces (tsr_modelopt_config_read; NULL or algo NONE: no
 * quantization).  ModelOpt FP8 (models.md §4.2-4.3, nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8)
 * and NVFP4 (§4.4): every linear stored F8_E4M3 with its weight_scale / input_scale, or
 * U8 e2m1 codes with weight_scale (e4m3 per 16) / weight_scale_2 / input_scale, stays as
 * stored
 * (in_proj, out_proj, q/k/v/o, routed and shared experts, the dense MLP; the router,
 * conv1d, embeddings and lm_head are never quantized: widened, or BF16 kept as above), the rest is widened; the
 * decision is per module from its dtype and scales, the exclude list cross-checks it
 * (tsr_modelopt_load_weight).  A MoE layer's experts are all quantized or none, and
 * share one activation scale per GEMM, the max over the experts (vLLM).
 * `cfg` NULL: read config.json.  `spec` NULL or whole: the whole model; a pipeline
 * stage's layer range holds those layers (any kind: the split counts layers), the
 * embedding on the first stage, the final norm and lm_head on the last (the embedding
 * there too when tied); tp_size 1 only (TSR_E_UNSUPPORTED: a rank's split is
 * tsr_nemotron_h_shard_tp, after the load).  Errors name the file and the tensor.  *ret
 * new on success (tsr_nemotron_h_free). */
tsr_status tsr_nemotron_h_load(const char *dir, const tsr_nemotron_h_config *cfg, const tsr_shard_spec *spec,
                               const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud,
                               tsr_nemotron_h **ret, tsr_load_stats *stats, char *err, size_t errlen);
void tsr_nemotron_h_free(tsr_nemotron_h **m);
const tsr_nemotron_h_config *tsr_nemotron_h_config_of(const tsr_nemotron_h *m);
/* Tensor parallelism (issue #14; vLLM's nemotron_h.py and mamba_mixer2.py): split a
 * loaded float32 model for tp_rank of tp_size.  Mamba: in_proj column-parallel with its
 * parts split apart (the rank's heads' z, x and dt rows, its groups' B and C rows), the
 * conv weights and bias by the same channels, A, D and dt_bias by head, the gated norm's
 * weight with its heads (each rank holds whole groups), out_proj row-parallel.
 * Attention as the Llama's: q by head, k / v by KV head (replicated where tp_size exceeds
 * them), o_proj row-parallel.  MoE and the dense MLP: every expert's, the shared
 * expert's and the MLP's up column-parallel and down row-parallel, the router whole.
 * The embedding and lm_head by vocabulary rows (tsr_tp_embed; the logits all-gathered),
 * the norms whole.  Every row-parallel matrix holds the rank's canonical K slices (tp.h), so the
 * forward's sums are the same bits at every tp_size, tp_size 1 included (that split
 * alone).  TSR_E_UNSUPPORTED (err names the count, in vLLM's words where vLLM has them)
 * when tp_size does not split the model, or the weights are not float32; TSR_E_NOMEM
 * (the model half split: free it).  A rank's state (tsr_nemotron_h_kv_groups with its
 * tp_size) holds its heads' and groups' conv channels and SSM state only.  Main thread,
 * after the load. */
tsr_status tsr_nemotron_h_shard_tp(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
/* The rank's TP group, before each forward (borrowed; NULL at tp_size 1).  The rank's thread. */
/* --enable-expert-parallel (issue #14): tsr_nemotron_h_shard_tp, except that each MoE
 * layer's routed experts go whole to the ranks (vLLM's linear placement: E / tp_size
 * consecutive experts each, the first E % tp_size ranks one more), their down_proj as
 * all TSR_COMM_TREE_LEAVES canonical K slices; every rank routes every token and runs
 * its experts on the tokens routed to them, and one all-reduce of each choice's
 * per-slice partials (zero where another rank's expert was chosen) lets each rank add
 * its slices' weighted partials in expert order, as the tensor-parallel sum does:
 * outputs bitwise those of tsr_nemotron_h_shard_tp (llama4.h says the cost).  Errors as
 * tsr_nemotron_h_shard_tp, and fewer experts than ranks. */
tsr_status tsr_nemotron_h_shard_ep(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
void tsr_nemotron_h_set_comm(tsr_nemotron_h *m, struct tsr_comm *comm);

/* --dtype bfloat16: the linears (in_proj, out_proj, q/k/v/o, routed and shared experts,
 * the dense MLP, lm_head) not held quantized rounded to bf16 (exact for a bf16 checkpoint, which the loader
 * widened), float32 copies freed; the router, A, D, dt_bias, conv weights, norms and the
 * embedding stay float32 (models.md §3), the recurrent state stays float32, and the
 * residual stream is held at bf16 precision unless config.json says residual_in_fp32.
 * TSR_OK (also when already), TSR_E_NOMEM (the model half converted: only
 * tsr_nemotron_h_free may be called on it), TSR_E_UNSUPPORTED after
 * tsr_nemotron_h_shard_tp (the split is float32 math).  Main thread, after load. */
tsr_status tsr_nemotron_h_use_bf16(tsr_nemotron_h *m);
bool tsr_nemotron_h_is_bf16(const tsr_nemotron_h *m);
/* Bytes the weights take in memory as now held (float32, bf16 linears, quantized linears). */
uint64_t tsr_nemotron_h_resident_bytes(const tsr_nemotron_h *m);
/* TSR_OK when `be` has every op the forward uses, and the weights are in its memory
 * (the host's, or the device's after tsr_nemotron_h_to_backend). */
tsr_status tsr_nemotron_h_check_backend(const tsr_nemotron_h *m, const tsr_backend *be);
/* A backend whose memory is not the host's (CUDA): as tsr_llama4_to_backend.  Every array
 * the forward reads goes to the device (the router's bias stays the host's, for the
 * top-k on the host); the state slots and K/V must be a pool in that memory
 * (tsr_kv_pool_new_on).  TSR_E_UNSUPPORTED (err says why) under tensor, expert or
 * pipeline parallelism, for a model whose Mamba layers have one group (its gated norm is
 * finished on the host) or weights whose matmul the backend lacks; TSR_E_NOMEM (err: the
 * sizes) when the device is too small; the model is then unchanged.  A no-op on a host
 * backend; TSR_E_INVAL after it (and tsr_nemotron_h_use_bf16 is TSR_E_INVAL after it). */
tsr_status tsr_nemotron_h_to_backend(tsr_nemotron_h *m, tsr_backend *be, char *err, size_t errlen);
/* As tsr_llama4_reserve. */
tsr_status tsr_nemotron_h_reserve(const tsr_nemotron_h *m, size_t tokens, size_t logit_rows);

/* ---- state ------------------------------------------------------------------------ */

typedef struct tsr_nemotron_h_cache tsr_nemotron_h_cache;

/* n_blocks blocks of block_size token rows for the model's attention layers' K/V, and
 * n_slots Mamba state slots (of the layers it holds), in host memory.  TSR_E_INVAL (a
 * zero size the model needs; a model moved to a device: bind a pool in its memory),
 * TSR_E_LIMIT, TSR_E_NOMEM. */
tsr_status tsr_nemotron_h_cache_new(const tsr_nemotron_h *m, size_t n_blocks, size_t block_size, size_t n_slots,
                                    tsr_nemotron_h_cache **ret);
void tsr_nemotron_h_cache_free(tsr_nemotron_h_cache **c);
/* Bytes of one Mamba state slot over all Mamba layers (conv + SSM state, float32). */
uint64_t tsr_nemotron_h_slot_bytes(const tsr_nemotron_h_config *c);
/* The KV groups of layers first .. last of a NemotronH (worker/engine/kv_pool.h) on one
 * tensor-parallel rank of tp_size (1: the whole model), into out[max]: their attention
 * layers' full-attention group of the rank's KV heads (when there are any) and their
 * Mamba layers' TSR_KV_MAMBA_STATE group of the rank's conv channels and SSM heads
 * (when there are any), float32.  Returns how many: 0 for a range of MoE and MLP layers
 * only (a pipeline stage that keeps nothing). */
size_t tsr_nemotron_h_kv_groups(const tsr_nemotron_h_config *c, uint32_t first, uint32_t last, uint32_t tp_size,
                                tsr_kv_group *out, size_t max);
/* A cache over the caller's pool (tsr_kv_pool_new_slots from those groups): the
 * forward writes the pool's arrays, which must outlive the cache.  TSR_E_INVAL when
 * the pool's groups are not exactly the model's; TSR_E_NOMEM. */
tsr_status tsr_nemotron_h_cache_bind(const tsr_nemotron_h *m, tsr_kv_pool *pool, tsr_nemotron_h_cache **ret);

/* ---- forward ------------------------------------------------------------------------ */

/* One sequence of a batched forward. */
typedef struct tsr_nemotron_h_seq {
        const uint32_t *block_table;    /* (n_table,) its attention blocks */
        size_t n_table;
        const uint32_t *tokens;         /* (n,) at positions past_len .. past_len+n-1 */
        size_t n;
        size_t past_len;
        uint32_t slot;                  /* its Mamba state slot */
        tsr_llama_logits which;         /* NONE, LAST (1 row) or ALL (n rows) */
        /* Prefix caching (engine.h tsr_engine_seq): each Mamba layer copies slot
         * restore_from's state into `slot` before the sequence's tokens (past_len > 0:
         * the state after the cached prefix), and the state after position saves[k].pos
         * into saves[k].slot as its tokens pass there (positions increasing, in
         * (past_len, past_len + n]). */
        bool restore;
        uint32_t restore_from;
        const tsr_state_save *saves;
        size_t n_saves;
        /* The scan's chunked form runs on whole chunk_size chunks of the sequence's tokens
         * that end by this position (the engine's prompt_len: generated tokens keep the
         * recurrence's bits); 0: no limit. */
        size_t chunked_end;
        /* NULL, or the chunk's engine record: a model on a device answers its rows there
         * (tsr_llama_seq.answer, answer.h) */
        const tsr_engine_seq *answer;
} tsr_nemotron_h_seq;

/* Run the sequences in one pass (rows stacked for every matmul), update their K/V and
 * state slots, and write the asked-for logits rows, sequence after sequence.
 * TSR_E_INVAL: n == 0, a token >= vocab, a slot >= n_slots or used twice, a short block
 * table or a block outside the cache, NULL logits when some are asked for.  On failure
 * the touched sequences' state is undefined (the caller recomputes from the prompt). */
tsr_status tsr_nemotron_h_forward_batch(const tsr_nemotron_h *m, tsr_backend *be, tsr_nemotron_h_cache *cache,
                                        const tsr_nemotron_h_seq *seqs, size_t n_seqs, float *logits);
/* A pipeline stage's part of the step (family.h forward_stage) for a model loaded with a
 * layer range: `in` NULL on the first stage, else the previous stage's (2, N, dim) pair;
 * `out` receives it on a stage before the last, which writes `logits`.  Each stage
 * updates its own layers' K/V and the sequences' state slots of its Mamba layers (the
 * same slot numbers on every stage).  Chained, the stages give
 * tsr_nemotron_h_forward_batch's logits bitwise.  Errors as that, and TSR_E_INVAL for
 * `in` / `out` / `logits` not as the stage's place asks. */
tsr_status tsr_nemotron_h_forward_stage(const tsr_nemotron_h *m, tsr_backend *be, tsr_nemotron_h_cache *cache,
                                        const tsr_nemotron_h_seq *seqs, size_t n_seqs, const float *in, float *out,
                                        float *logits);

#endif
