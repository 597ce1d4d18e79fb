/* llama_weights.h - a Llama's hyperparameters and float32 weights, loaded from a GGUF
 * file or a Hugging Face folder (config.json + safetensors; at the end).  The config
 * readers are llama_weights.c (GGUF) and llama_config_hf.c (config.json); the tensors of
 * either source go through the one loader, worker/load/loader.c, which takes their names
 * from the Llama family's table (worker/model/llama_family.c; the mapping below).
 *
 * Every tensor is dequantized at load into a float32 array the forward reads directly
 * (the fidelity path), except where tsr_load_opts asks to keep a GGUF block type as
 * stored: then the matmul weights (and token_embd) of that type keep the file's bytes
 * (tsr_llama_layer.stored, tsr_llama_weights.*_stored) and the forward's matmul runs on
 * the blocks (kernels/quant/qmm.h).  Supported ggml types: F32, F16, BF16, Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
 *
 * GGUF names (llama.cpp's) map to transformers' LlamaForCausalLM ones as
 *   token_embd        model.embed_tokens            (vocab, dim)
 *   blk.N.attn_norm   layers.N.input_layernorm       (dim,)
 *   blk.N.attn_q/k/v  layers.N.self_attn.q/k/v_proj  (n_heads*head_dim | n_kv_heads*head_dim, dim)
 *   blk.N.attn_output layers.N.self_attn.o_proj      (dim, n_heads*head_dim)
 *   blk.N.ffn_norm    layers.N.post_attention_layernorm (dim,)
 *   blk.N.ffn_gate/up layers.N.mlp.gate/up_proj      (hidden_dim, dim)
 *   blk.N.ffn_down    layers.N.mlp.down_proj         (dim, hidden_dim)
 *   output_norm       model.norm                     (dim,)
 *   output            lm_head (absent: tied to token_embd)  (vocab, dim)
 * ggml lists dims fastest-first, so a GGUF tensor of dims [n, d] is our row-major (d, n).
 * llama.cpp's converter permutes the Q and K rows of HF checkpoints so that interleaved
 * RoPE gives HF's rotate_half result; such files therefore use TSR_ROPE_INTERLEAVED.
 *
 * Loading is blocking file I/O plus dequantization: call it at startup.  Non-logging:
 * failures return a status and a message naming the file and the tensor or key. */
#ifndef TSR_WEIGHTS_H
#define TSR_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/load/gguf.h"
#include "worker/load/loader.h"
#include "worker/load/safetensors.h"

/* What the forward needs to know about the architecture.  Plain data. */
typedef struct tsr_llama_config {
        uint32_t vocab_size;
        uint32_t dim;                   /* hidden size */
        uint32_t hidden_dim;            /* MLP intermediate size */
        uint32_t n_layers;
        uint32_t n_heads;
        uint32_t n_kv_heads;            /* divides n_heads */
        uint32_t head_dim;              /* even */
        uint32_t max_seq_len;           /* context length the model was trained for; 0 if unknown */
        float rms_eps;
        double rope_theta;
        tsr_rope_layout rope_layout;
        /* llama3 frequency scaling (transformers' _compute_llama3_parameters) when rope_llama3 is set. */
        bool rope_llama3;
        double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
        uint32_t rope_original_max_pos;
        bool tied_embeddings;           /* no separate output matrix: logits use token_embd */
} tsr_llama_config;


/* What both loaders (GGUF, safetensors) require before reading a tensor: a layer range
 * of the model, a tensor-parallel rank that splits it (tsr_llama_tp_share_of) and a
 * consistent config.  `src` names the file or folder in the message.  TSR_OK,
 * TSR_E_UNSUPPORTED or TSR_E_INVAL. */
tsr_status tsr_llama_weights_check(const tsr_llama_config *cfg, const tsr_shard_spec *spec, const char *src,
                                   char *err, size_t errlen);

/* A tensor-parallel rank's share of a Llama, as vLLM lays it out: query heads
 * [rank x nh, + nh), KV heads [kv0, kv0 + nkv) (each replicated on tp / n_kv_heads ranks
 * when tp > n_kv_heads), MLP columns [rank x hid, + hid), the embedding's and lm_head's
 * vocabulary rows [v0, v0 + vl) (tsr_tp_vocab_of: the vocabulary padded to 64, the last
 * ranks fewer rows), and ns = TSR_COMM_TREE_LEAVES / tp canonical K slices of o_proj and
 * down_proj. */
typedef struct tsr_llama_tp_share {
        uint32_t nh, nkv, kv0, hid, v0, vl, ns;
} tsr_llama_tp_share;
/* The share of rank tp_rank of tp_size; TSR_E_UNSUPPORTED with the counts tp_size must
 * divide named in err when it does not split the model. */
tsr_status tsr_llama_tp_share_of(const tsr_llama_config *c, uint32_t tp_rank, uint32_t tp_size,
                                 tsr_llama_tp_share *ret, char *err, size_t errlen);


/* The matmul weights of a layer, in the order tsr_llama_layer.stored keeps them. */
enum {
        TSR_LLAMA_MM_Q, TSR_LLAMA_MM_K, TSR_LLAMA_MM_V, TSR_LLAMA_MM_O,
        TSR_LLAMA_MM_GATE, TSR_LLAMA_MM_UP, TSR_LLAMA_MM_DOWN, TSR_LLAMA_MM_PER_LAYER
};

typedef struct tsr_llama_layer {
        float *attn_norm;       /* (dim,) */
        float *wq;              /* (n_heads * head_dim, dim) */
        float *wk;              /* (n_kv_heads * head_dim, dim) */
        float *wv;              /* (n_kv_heads * head_dim, dim) */
        float *wo;              /* (dim, n_heads * head_dim) */
        float *ffn_norm;        /* (dim,) */
        float *w_gate;          /* (hidden_dim, dim) */
        float *w_up;            /* (hidden_dim, dim) */
        float *w_down;          /* (dim, hidden_dim) */
        /* The matmul weights (TSR_LLAMA_MM_* order) kept as the file stores them: a GGUF's
         * block format (tsr_load_opts.keep_dtypes), a ModelOpt fp8 / nvfp4 weight, a
         * safetensors BF16 one (keep_bf16): the file's bytes copied into memory this
         * struct owns (data), in the tensor's dtype and shape; the float32 field above is
         * then NULL.  data == NULL: widened to float32 as usual. */
        tsr_tensor stored[TSR_LLAMA_MM_PER_LAYER];
} tsr_llama_layer;

typedef struct tsr_llama_weights {
        tsr_llama_config cfg;
        tsr_shard_spec shard;
        float *token_embd;      /* (vocab, dim); a tensor-parallel rank's vocab rows only */
        tsr_llama_layer *layers;  /* [last_layer - first_layer + 1] */
        float *output_norm;     /* (dim,) */
        float *output;          /* (vocab, dim); == token_embd when tied (not a second copy) */
        float *rope_freqs;      /* (head_dim/2,) llama.cpp's per-pair frequency divisors, NULL if absent */
        /* token_embd and output kept in their block format, as the layers' stored[]: the
         * float32 field is then NULL (the forward widens the embedding rows it looks up);
         * tied: output_stored is token_embd_stored (the same data, freed once).  A GGUF's
         * (tables_stored), and a safetensors checkpoint's BF16 ones under keep_bf16 (a
         * F32 one is widened as usual; ModelOpt never quantizes them). */
        tsr_tensor token_embd_stored, output_stored;
        bool tables_stored;
        /* shard.tp_size > 1: every matmul weight and an untied lm_head were read as the
         * rank's share straight from the file (tsr_llama_tp_share_of; loader.h's slices):
         * wq/wk/wv/w_gate/w_up hold its rows, wo/w_down its columns (not yet in the
         * canonical slice order: tsr_llama_shard_tp), output and the embedding their
         * vocab rows (the lookup is vocabulary-parallel: tsr_tp_embed). */
        bool tp_sliced;
        tsr_llama_tp_share tp_share;    /* the share read when tp_sliced */
} tsr_llama_weights;


/* Read the Llama hyperparameters from `g`'s metadata (general.architecture must be
 * "llama"): llama.embedding_length, .block_count, .attention.head_count,
 * .attention.head_count_kv (default head_count), .attention.key_length (default
 * dim / heads), .feed_forward_length, .context_length, .attention.layer_norm_rms_epsilon
 * (default 1e-5), .rope.freq_base (default 10000), .rope.dimension_count (must equal
 * head_dim), .vocab_size (else the tokenizer size, else token_embd's rows); no
 * output.weight means tied embeddings.  A rope_freqs.weight tensor is llama3 scaling
 * precomputed by llama.cpp.  Writes *ret only on success; TSR_E_INVAL (bad or missing
 * key, message names it) or TSR_E_UNSUPPORTED (another architecture, rope scaling
 * type, partial rotary). */
tsr_status tsr_llama_config_from_gguf(const tsr_gguf *g, const char *path, tsr_llama_config *ret,
                                      char *err, size_t errlen);
/* The same for an architecture whose keys follow llama's under its own prefix ("llama4":
 * general.architecture must be `arch`, the keys "<arch>.*"). */
tsr_status tsr_llama_config_from_gguf_arch(const tsr_gguf *g, const char *path, const char *arch,
                                           tsr_llama_config *ret, char *err, size_t errlen);

/* Load the tensors of `spec`'s shard.  `path` only names the file in messages.  On
 * success *ret is new (free with tsr_llama_weights_free) and *stats (if not NULL) holds
 * the totals.  Errors: TSR_E_NOTFOUND (a tensor missing), TSR_E_INVAL (wrong shape or
 * config), TSR_E_UNSUPPORTED (tensor type, or a shard other than the whole model),
 * TSR_E_NOMEM; `err` names the file and the tensor. */
tsr_status tsr_llama_weights_load(const tsr_gguf *g, const char *path, const tsr_llama_config *cfg,
                                  const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                  tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen);

/* The same with options (NULL: widen everything, as tsr_llama_weights_load). */
tsr_status tsr_llama_weights_load_opts(const tsr_gguf *g, const char *path, const tsr_llama_config *cfg,
                                       const tsr_shard_spec *spec, const tsr_load_opts *opts,
                                       tsr_load_progress_fn progress, void *ud, tsr_llama_weights **ret,
                                       tsr_load_stats *stats, char *err, size_t errlen);

/* Accepts NULL and *w == NULL; clears *w. */
void tsr_llama_weights_free(tsr_llama_weights **w);


/* ---- Hugging Face folders (weights_hf.c) ----------------------------------------------
 * A LlamaForCausalLM checkpoint: config.json and safetensors in HF naming
 * (transformers' LlamaForCausalLM), F32, F16 or BF16 tensors converted to float32.  HF's q_proj/k_proj rows are in
 * rotate_half order, so the config gets TSR_ROPE_NEOX. */

/* Parse config.json's bytes (`path` only names the file in messages).  Reads
 * architectures (must be ["LlamaForCausalLM"]; absent: model_type must be "llama"),
 * hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default
 * num_attention_heads), head_dim (default hidden_size / num_attention_heads),
 * intermediate_size, vocab_size, max_position_embeddings (default unknown),
 * rms_norm_eps (default 1e-6, as LlamaConfig), tie_word_embeddings (default false), and
 * the RoPE parameters in either transformers style: rope_theta (default 10000) with
 * rope_scaling (4.x), or rope_parameters holding rope_theta too (5.x); rope_type
 * "default" or "llama3" (factor, low_freq_factor, high_freq_factor,
 * original_max_position_embeddings).  Writes *ret only on success; TSR_E_INVAL (bad or
 * missing field, message names it) or TSR_E_UNSUPPORTED (another architecture, rope
 * type, activation, partial rotary, attention or MLP biases). */
tsr_status tsr_llama_config_from_hf_json(const char *json, size_t len, const char *path, tsr_llama_config *ret,
                                         char *err, size_t errlen);
/* The same fields from an already parsed JSON object (a jansson json_t), without the
 * architecture check: the Llama 4 family reads the Llama fields of its text_config
 * through it (worker/model/llama4_config.c).  Errors as above. */
struct json_t;
tsr_status tsr_llama_config_from_hf_object(struct json_t *obj, const char *path, tsr_llama_config *ret, char *err,
                                           size_t errlen);
/* The same for dir/config.json (TSR_E_NOTFOUND when it is absent; at most 16 MiB). */
tsr_status tsr_llama_config_from_hf(const char *dir, tsr_llama_config *ret, char *err, size_t errlen);

/* Load `spec`'s shard from the safetensors of `set` (tsr_safetensors_set_open), as
 * tsr_llama_weights_load does from a GGUF: the same results, statuses and stats.  Each
 * tensor must have exactly transformers' shape ([out, in] for a linear weight);
 * lm_head.weight is not read when cfg->tied_embeddings.  A ".bias" tensor anywhere is
 * TSR_E_UNSUPPORTED (this loader would silently drop it).  `err` names the file and the
 * tensor. */
tsr_status tsr_llama_weights_load_hf(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                     const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                     tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen);
/* The same with options: opts->modelopt (a ModelOpt FP8 / NVFP4 checkpoint) keeps the
 * quantized linear weights in their stored format with their scales (stored[]); opts
 * NULL or without it: every weight must be F32, F16 or BF16. */
tsr_status tsr_llama_weights_load_hf_opts(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                          const tsr_shard_spec *spec, const tsr_load_opts *opts,
                                          tsr_load_progress_fn progress, void *ud, tsr_llama_weights **ret,
                                          tsr_load_stats *stats, char *err, size_t errlen);

#endif
