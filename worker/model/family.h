/* family.h - a model family: everything the worker needs to know about one kind of
 * architecture, behind one table of functions and data (DESIGN.md, "Model families").
 *
 * A family declares
 *  - the architectures it serves (HF config.json `architectures` / `model_type`, GGUF
 *    `general.architecture`), matched by tsr_family_find;
 *  - a config reader: the one model description (tsr_model_desc) the whole worker uses
 *    after it, for KV sizing (main.c), the loader and the forward.  Read once, at start-up;
 *    a missing required field is an error naming the file and the field, never a guess;
 *  - its tensor-name table: one logical name per weight with its GGUF and HF names, and
 *    how the tensor shards under tensor parallelism;
 *  - its per-layer KV spec, as groups of layers with the same kind of state;
 *  - which layers a pipeline stage holds;
 *  - its load and forward entry points (the runner's tsr_engine_model adapter calls them).
 *
 * Families are static const data: any thread may read them.  tsr_model_desc_read does
 * blocking file I/O (main thread, at start-up); a read description is plain data. */
#ifndef TSR_WORKER_MODEL_FAMILY_H
#define TSR_WORKER_MODEL_FAMILY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/engine/engine.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/loader.h"

typedef struct tsr_model_family tsr_model_family;
struct tsr_comm;

/* The model description: what the family read from the model's config, once.  The
 * fields the whole worker needs are here; the rest is the family's own config, behind
 * `config` (a Llama's is a tsr_llama_config), so a new family adds no field here. */
typedef struct tsr_model_desc {
        const tsr_model_family *family;
        bool gguf;                      /* the source: a .gguf file, else a Hugging Face folder */
        uint32_t vocab_size;            /* rows of the logits: what the engine samples over */
        uint32_t n_layers;              /* layers of the whole model (pipeline stages split them) */
        uint32_t hidden_size;           /* width of the activations a pipeline stage hands on;
                                         * 0 for a family without forward_stage */
        void *config;                   /* the family's config: one flat allocation, freed by
                                         * tsr_model_desc_done */
        uint32_t state_chunk;           /* a family with recurrent state: its scan's chunk (tokens), the
                                         * default step of the prefix cache's states; else 0 */
        uint32_t scan_chunk;            /* the chunk a prefill's scan runs whole chunks of in its
                                         * chunked form (engine.h prefill_align); 0: none */
} tsr_model_desc;

/* ---- per-layer KV / state spec --------------------------------------------------------
 * tsr_kv_group, tsr_kv_kind, tsr_kv_block_bytes and the pool allocated per group are the
 * engine's: worker/engine/kv_pool.h. */

/* The tensor-name table (tsr_tensor_name) and its shard rules are the loader's input:
 * worker/load/loader.h. */

/* CUDA graphs of decode steps (issue #16): the batch sizes to record, the block-table
 * entries of the longest request, the longest sequence a graph runs (tokens). */
typedef struct tsr_graph_opts {
        const uint32_t *sizes;
        size_t n_sizes;
        uint32_t table_width;
        uint32_t max_seq_len;
} tsr_graph_opts;

/* ---- the family ----------------------------------------------------------------------- */

struct tsr_model_family {
        const char *name;                       /* "llama" */
        const char *const *hf_architectures;    /* NULL-terminated; matched against architectures[0] */
        const char *const *hf_model_types;      /* NULL-terminated; used when architectures is absent */
        const char *const *gguf_architectures;  /* NULL-terminated; general.architecture */

        /* Read the model's config at `path` (a .gguf file when `gguf`, else a folder's
         * config.json) into ret->vocab_size, ->n_layers and a new ->config.  TSR_E_INVAL (missing or bad field,
         * `err` names the file and the field), TSR_E_UNSUPPORTED (a variant this family does
         * not run: rope type, biases, ...), TSR_E_NOTFOUND, TSR_E_IO.  Blocking. */
        tsr_status (*read_config)(const char *path, bool gguf, tsr_model_desc *ret, char *err, size_t errlen);

        const tsr_tensor_name *tensors;         /* [n_tensors] */
        size_t n_tensors;

        /* The KV groups of the layers `shard` holds, into out[max]; returns how many. */
        size_t (*kv_groups)(const tsr_model_desc *d, const tsr_shard_spec *shard, tsr_kv_group *out, size_t max);

        /* The layers pipeline stage pp_rank of pp_size holds (contiguous, vLLM's split:
         * worker/parallel/partition.h), as a shard spec for tp_rank of tp_size.  TSR_E_INVAL when
         * pp_size exceeds the layer count or a rank is out of range. */
        tsr_status (*shard_for)(const tsr_model_desc *d, uint32_t tp_rank, uint32_t tp_size, uint32_t pp_rank,
                                uint32_t pp_size, tsr_shard_spec *ret);

        /* Forward entry points over an opaque model and KV pool (the family's own types).
         * load: the weights of `shard` from `path`, as the description says, with `opts`
         * (NULL: widen every tensor).  Errors name the file and the tensor.  The others as
         * llama.h's functions of the same names. */
        tsr_status (*load)(const char *path, const tsr_model_desc *d, const tsr_shard_spec *shard,
                           const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, void **ret,
                           tsr_load_stats *stats, char *err, size_t errlen);
        void (*free)(void **model);
        tsr_status (*use_bf16)(void *model);
        bool (*is_bf16)(const void *model);
        /* The bytes the model's weights take now (after use_bf16 too), for the runner's
         * "resident" figure.  NULL: the load's count stands. */
        uint64_t (*resident_bytes)(const void *model);
        tsr_status (*check_backend)(const void *model, const tsr_backend *be);
        /* Move the weights into the memory of a backend that is not the host's, and size
         * the forward's kept activations for a step of `tokens` tokens and `logit_rows`
         * rows of logits (llama.h: tsr_llama_to_backend, tsr_llama_reserve).  NULL: the
         * family runs on host-memory backends only. */
        tsr_status (*to_backend)(void *model, tsr_backend *be, size_t tokens, size_t logit_rows, char *err,
                                 size_t errlen);
        /* Why this model (its config) cannot run on a device though the family can, or
         * NULL: read before the backend is chosen, so --device auto takes the CPU for it
         * and --device cuda is refused with the reason.  NULL hook: every model can. */
        const char *(*device_refusal)(const tsr_model_desc *d);
        /* CUDA graphs of decode steps on a device backend (issue #16), after kv_bind with
         * the model's pool view: record o's sizes now (start-up); *captured = how many.
         * NULL: the family's steps run eagerly. */
        tsr_status (*capture_graphs)(void *model, tsr_backend *be, void *pool, const tsr_graph_opts *o,
                                     size_t *captured);
        /* The family's view of `pool` (allocated by the runner from this family's
         * kv_groups for the model's shard), which the forward reads and writes; the pool
         * stays the caller's.  TSR_E_INVAL when the pool's groups are not the model's. */
        tsr_status (*kv_bind)(const void *model, tsr_kv_pool *pool, void **ret);
        /* The fp8 KV cache (--kv-cache-dtype fp8, issue #15): where a ModelOpt checkpoint
         * keeps the k_scale / v_scale of layer `i` of the shard's paged (attention) group
         * `group` (its index among the shard's kv_groups; Llama 4 has a full-attention and
         * chunked-local ones) (`<module>.k_proj.k_scale`, `<module>.v_proj.v_scale`): a
         * module-name format with one %u, and its value in *layer.  NULL: the family has
         * no fp8 KV cache, and --kv-cache-dtype fp8 is refused for it. */
        const char *(*kv_scale_module)(const tsr_model_desc *d, const tsr_shard_spec *shard, uint32_t group,
                                       uint32_t i, uint32_t *layer);
        void (*kv_unbind)(void **view);
        /* One engine step: seqs are the family's own sequence records built by
         * `seq_fill` (the runner converts the engine's records through it). */
        tsr_status (*forward_batch)(const void *model, tsr_backend *be, void *pool, const void *seqs,
                                    size_t n_seqs, float *logits);
        /* A pipeline stage's part of the step (issue #20), for a model loaded with a layer
         * range: `in` NULL on the first stage, else (2, N, hidden_size) floats from the
         * previous stage; `out` the same for the next stage, NULL on the last (which writes
         * `logits`).  Chained, the stages give the whole model's logits bitwise.  NULL:
         * the family runs whole models only (pipeline parallelism is refused for it). */
        tsr_status (*forward_stage)(const void *model, tsr_backend *be, void *pool, const void *seqs, size_t n_seqs,
                                    const float *in, float *out, float *logits);
        /* Tensor parallelism (issue #20): split a loaded model for tp_rank of tp_size
         * (tp_size 1: the canonical row-parallel split alone, so TP 1 and TP > 1 give the
         * same bits), and hand it the rank's group before each forward.  NULL: the family
         * has no TP. */
        tsr_status (*tp_shard)(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
        /* load, given a shard spec with tp_size > 1, reads only the rank's share of each
         * split tensor from the file (loader.h's slices) and returns the rank's model,
         * split (tp_shard for the same rank is then a no-op): no rank ever holds a whole
         * split tensor in float32.  False: load takes tp_size 1 (whole tensors) and
         * tp_shard splits them afterwards. */
        bool load_tp_share;
        /* tp_shard (and load_tp_share) split weights kept as stored: a ModelOpt FP8 / NVFP4
         * checkpoint's linears (the canonical split needs each rank's K slices to be whole
         * blocks) and a GGUF's block-format ones (widened where a slice would cut a
         * block).  False: a ModelOpt checkpoint runs at -tp 1 only, and a GGUF's blocks
         * are widened to float32 whenever the model is split. */
        bool tp_quantized;
        void (*tp_set_comm)(void *model, struct tsr_comm *comm);
        /* --enable-expert-parallel (issue #14): as tp_shard, but each MoE layer's routed
         * experts go whole to the ranks instead of a share of every expert to every rank,
         * with outputs bitwise tp_shard's.  `moe`: the family's models have MoE layers; a
         * family without them runs tp_shard for the flag (it changes nothing there, as in
         * vLLM), one with them and no ep_shard refuses the flag.  A ModelOpt NVFP4
         * checkpoint's rank quantizes its experts' inputs with the max input_scale over
         * EVERY expert of the layer, read from the file at load (vLLM's global-scale NVFP4
         * MoE); an FP8 one with its own experts' max (vLLM's FusedMoE). */
        tsr_status (*ep_shard)(void *model, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
        bool moe;
        size_t seq_size;                        /* bytes of one family sequence record */
        void (*seq_fill)(void *seq, const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                         size_t past_len, bool want_logits, bool want_all_logits);
        /* A family with per-request state (a TSR_KV_MAMBA_STATE group): the engine's state
         * slot of the sequence `seq_fill` just filled, and (prefix caching) the slot whose
         * state it starts from (NULL: none) and the states it saves on the way (engine.h
         * tsr_engine_seq restore_from / saves; borrowed for the step), and its request's
         * prompt length (tsr_engine_seq.prompt_len).  NULL for families without. */
        void (*seq_set_state)(void *seq, uint32_t slot, const uint32_t *restore_from, const tsr_state_save *saves,
                              size_t n_saves, uint32_t prompt_len);
        /* A family whose model on a device answers rows there instead of handing them
         * back (answer.h: tsr_engine_seq.token, .lp, .rules, .prompt_lp): give the
         * sequence `seq_fill` just filled its engine record (borrowed for the step).
         * NULL: the rows always come back whole. */
        void (*seq_set_answer)(void *seq, const tsr_engine_seq *q);
};

/* ---- pipeline stages: the forward_stage contract, shared by the families -------------- */

/* Whether a stage holding layers shard->first_layer .. last_layer of a model of n_layers
 * gets the arguments forward_stage wants: `in` exactly when it is not the first stage,
 * `out` exactly when it is not the last, and `logits` on the last when some sequence
 * wants them (`want`). */
static inline bool tsr_stage_args_ok(const tsr_shard_spec *shard, uint32_t n_layers, const float *in,
                                     const float *out, bool want, const float *logits) {
        bool last = shard->last_layer + 1 == n_layers;
        return (shard->first_layer > 0) == (in != NULL) && !last == (out != NULL) && !(want && last && !logits);
}

/* The hand-over between two stages: the (2, N, dim) pair, x (the residual stream) then
 * xb (what the family's next step reads besides it), copied in from the previous stage
 * (recv) or out to the next (send) through `be`'s memory (memcpy on the CPU).  Only
 * bytes move: the stage that receives runs the same arithmetic on them that one
 * process would. */
static inline tsr_status tsr_stage_recv(tsr_backend *be, float *x, float *xb, const float *in, size_t N,
                                        size_t dim) {
        tsr_status st = tsr_backend_upload(be, x, in, N * dim * sizeof(float));
        return st != TSR_OK ? st : tsr_backend_upload(be, xb, in + N * dim, N * dim * sizeof(float));
}

static inline tsr_status tsr_stage_send(tsr_backend *be, float *out, const float *x, const float *xb, size_t N,
                                        size_t dim) {
        tsr_status st = tsr_backend_download(be, out, x, N * dim * sizeof(float));
        return st != TSR_OK ? st : tsr_backend_download(be, out + N * dim, xb, N * dim * sizeof(float));
}

/* The names of the registered families for which `has` is true, comma-separated, into
 * buf (for the "supported: ..." of an error message); returns buf.  Any thread. */
const char *tsr_family_names(bool (*has)(const tsr_model_family *f), char *buf, size_t len);
/* tsr_family_names' tests: the family runs pipeline stages / tensor-parallel shards / on
 * a backend whose memory is not the host's (CUDA). */
bool tsr_family_has_stages(const tsr_model_family *f);
bool tsr_family_has_tp(const tsr_model_family *f);
/* The families whose tensor parallelism splits a ModelOpt checkpoint (tp_quantized). */
bool tsr_family_has_tp_quantized(const tsr_model_family *f);
bool tsr_family_has_ep(const tsr_model_family *f);
bool tsr_family_has_device(const tsr_model_family *f);

/* The family that serves a model whose metadata says `format` ("gguf" or "hf"),
 * `architecture` (HF architectures[0] or GGUF general.architecture; may be NULL) and
 * `model_type` (may be NULL).  NULL when no family does (the worker then serves the
 * model's metadata only).  Any thread. */
const tsr_model_family *tsr_family_find(const char *format, const char *architecture, const char *model_type);

/* Read the description of the model at `path` with family `f`.  Writes *ret only on
 * success; errors as read_config.  Main thread, at start-up. */
tsr_status tsr_model_desc_read(const tsr_model_family *f, const char *path, bool gguf, tsr_model_desc *ret,
                               char *err, size_t errlen);
/* Free the family's config; accepts NULL and a zeroed description. */
void tsr_model_desc_done(tsr_model_desc *d);

/* The families (llama_family.c, ...); registry.c lists them. */
extern const tsr_model_family tsr_family_llama;
extern const tsr_model_family tsr_family_llama4;
extern const tsr_model_family tsr_family_nemotron_h;

#endif
