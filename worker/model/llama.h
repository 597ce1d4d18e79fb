/* llama.h - the Llama forward pass for one sequence, written against kernels/kernels.h.
 *
 * The math is models.md §1.3 as transformers computes it, in float32:
 *   h = embed[ids]
 *   per layer: h += o_proj(attn(rope(q), rope(k), v)) of rmsnorm(h);  h += mlp(rmsnorm(h))
 *   logits = rmsnorm(h) . W_outᵀ
 * with the keys (after RoPE) and values of every position kept in a tsr_llama_kv, so a
 * sequence is run as one prefill chunk followed by one-token decode steps, or in any
 * chunks at all: by batch invariance (kernels.h) each position's logits are bitwise the
 * same however the sequence was cut into calls.
 *
 * Thread safety: a loaded tsr_llama is read-only, so any number of threads may run
 * forwards on it at once, each with its own tsr_llama_kv and its own backend (kernels.h:
 * a backend is driven by one thread at a time).  Scratch memory is allocated per call.
 *
 * The backend is an argument of every forward rather than part of the model: the model
 * is weights in host memory, the backend is what runs the ops (and owns the threads), so
 * one model serves several backends (the reference and the fast CPU one in tests, one
 * per thread) without being reloaded. */
#ifndef TSR_LLAMA_H
#define TSR_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/engine/engine.h"
#include "worker/engine/kv_pool.h"
#include "worker/model/llama_weights.h"

typedef struct tsr_llama tsr_llama;

/* Load the model at `path` and the shard `spec` of it (NULL: the whole model) as float32
 * weights in host memory (tsr_llama_load_opts below keeps GGUF blocks as stored).  `path` is either
 *  - a directory: a Hugging Face LlamaForCausalLM folder, config.json plus
 *    model.safetensors or model.safetensors.index.json shards (tsr_llama_config_from_hf,
 *    tsr_safetensors_set_open, tsr_llama_weights_load_hf); or
 *  - a GGUF file (tsr_gguf_open, tsr_llama_config_from_gguf, tsr_llama_weights_load).
 * The files are unmapped before returning.  Progress and stats as tsr_llama_weights_load.
 * On success *ret is new (tsr_llama_free).  Errors as the functions named, with the file
 * and tensor or key named in `err`. */
tsr_status tsr_llama_load(const char *path, const tsr_shard_spec *spec,
                          tsr_load_progress_fn progress, void *ud, tsr_llama **ret, tsr_load_stats *stats,
                          char *err, size_t errlen);
/* The same with the config already read (the family's model description,
 * worker/model/family.h): `cfg` (NULL: read it from the file, as tsr_llama_load) is used
 * as given, so the config is parsed once per worker. */
tsr_status tsr_llama_load_config(const char *path, const tsr_llama_config *cfg, const tsr_shard_spec *spec,
                                 tsr_load_progress_fn progress, void *ud, tsr_llama **ret, tsr_load_stats *stats,
                                 char *err, size_t errlen);
/* The same with load options (loader.h tsr_load_opts; NULL: widen every tensor, as
 * tsr_llama_load_config): a GGUF file's matmul weights (and token_embd) in a dtype of
 * opts->keep_dtypes stay in their block format, and the forward runs the backend's
 * matmul on them (tsr_llama_check_backend then asks the backend for that dtype). */
tsr_status tsr_llama_load_opts(const char *path, const tsr_llama_config *cfg, const tsr_shard_spec *spec,
                               const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, tsr_llama **ret,
                               tsr_load_stats *stats, char *err, size_t errlen);
/* Accepts NULL and *m == NULL; clears *m. */
void tsr_llama_free(tsr_llama **m);

/* --dtype bfloat16: convert the matmul weights (q, k, v, o, gate, up, down, output) to
 * bfloat16, rounding each float32 to nearest even, and free their float32 copies; the
 * forward then runs the backend's matmul with TSR_DTYPE_BF16 weights on them
 * (activations, norms, attention and the KV cache stay float32).  Call once, after load
 * and before any forward and tsr_llama_to_backend (TSR_E_INVAL after it).  TSR_OK (also
 * when already bf16), TSR_E_NOMEM (the model is then half converted: only
 * tsr_llama_free may be called on it). */
tsr_status tsr_llama_use_bf16(tsr_llama *m);
/* Whether `be` can run this model's forward: TSR_OK, TSR_E_UNSUPPORTED when it lacks an
 * op the forward uses (the matmul for the model's weight dtype included) or its memory is
 * neither the host's nor the one tsr_llama_to_backend copied the weights to, TSR_E_INVAL
 * for NULL.  Every forward checks it too; call it once at start-up to fail early. */
tsr_status tsr_llama_check_backend(const tsr_llama *m, const tsr_backend *be);
bool tsr_llama_is_bf16(const tsr_llama *m);
/* The bytes the host weights take in memory now (after tsr_llama_use_bf16 too); 0 after
 * tsr_llama_to_backend. */
uint64_t tsr_llama_resident_bytes(const tsr_llama *m);
/* A backend whose memory is not the host's (CUDA): copy the weights the forward reads
 * (norms, matmuls in their float32 or bf16 form, embedding, RoPE frequencies) into its
 * memory and free the host copies; the forward then runs there, its KV pool must be in
 * that backend's memory too (tsr_kv_pool_new_on), and `be` must outlive the model.
 * After load and any tsr_llama_use_bf16, before the first forward; a no-op on a host
 * backend.  TSR_E_UNSUPPORTED (`err` says why: tensor parallelism, GGUF block formats,
 * ModelOpt weights), TSR_E_NOMEM / TSR_E_CUDA (the model is then unchanged). */
tsr_status tsr_llama_to_backend(tsr_llama *m, tsr_backend *be, char *err, size_t errlen);
/* On a device backend: allocate now the forward's activations for `tokens` tokens in one
 * step and logits for `logit_rows` rows (kept and grown on demand, so a step never waits
 * on an allocation the memory plan did not count).  TSR_OK and nothing on the CPU. */
tsr_status tsr_llama_reserve(const tsr_llama *m, size_t tokens, size_t logit_rows);
/* The model's config; lives as long as the model. */
const tsr_llama_config *tsr_llama_config_of(const tsr_llama *m);

/* RoPE inverse frequencies, inv_freq (head_dim/2,), for `cfg`:
 *   inv_freq[i] = 1 / theta^(2i / head_dim)        ("default", the exponent in float32 as HF)
 * then, when cfg->rope_llama3, the llama3 rescaling of models.md §0, then, when
 * `divisors` (head_dim/2,) is not NULL (a GGUF rope_freqs tensor), inv_freq[i] /= divisors[i].
 * TSR_E_INVAL for a bad config (head_dim odd or zero, theta <= 0, llama3 factors out of
 * range); *out written only on success. */
tsr_status tsr_llama_rope_inv_freq(const tsr_llama_config *cfg, const float *divisors, float *out);

/* ---- KV cache -------------------------------------------------------------------------
 * Keys and values for all layers, stored paged (kernels.h tsr_kv_view: per-layer pools of
 * blocks of block_size token rows, one block table shared by every layer, as vLLM lays it
 * out).  Two uses:
 *  - one sequence's cache (tsr_llama_forward): it uses its blocks 0, 1, 2, ... in order
 *    and tracks how many positions are valid;
 *  - a pool shared by many sequences (tsr_llama_forward_blocks): the caller's block
 *    manager gives each sequence its own block table and does the bookkeeping.
 * The forward itself only ever sees per-layer views through a table. */
typedef struct tsr_llama_kv tsr_llama_kv;

/* A cache for up to `max_tokens` positions of model `m`, in blocks of `block_size`
 * (0: 16) token rows.  The model must outlive the cache.  TSR_E_INVAL (zero size),
 * TSR_E_LIMIT (size overflows), TSR_E_NOMEM; *ret written only on success. */
tsr_status tsr_llama_kv_new(const tsr_llama *m, size_t max_tokens, size_t block_size, tsr_llama_kv **ret);
/* The KV group a Llama of config `c` declares: every layer full attention, float32. */
tsr_kv_group tsr_llama_kv_group(const tsr_llama_config *c);
/* A cache over the caller's `pool` (tsr_kv_pool_new from tsr_llama_kv_group): the
 * forward writes the pool's arrays, which must outlive the cache.  TSR_E_INVAL when the
 * pool is not exactly that one group; TSR_E_LIMIT, TSR_E_NOMEM. */
tsr_status tsr_llama_kv_bind(const tsr_llama *m, tsr_kv_pool *pool, tsr_llama_kv **ret);
/* Accepts NULL and *kv == NULL; clears *kv. */
void tsr_llama_kv_free(tsr_llama_kv **kv);

/* CUDA graphs of decode steps (issue #16; kernels.h's graphs), on a device backend after
 * tsr_llama_to_backend.  tsr_llama_set_graphs: the batch sizes to record (any order;
 * none: every step eager, the default), each graph's block tables `table_width` entries
 * per sequence (the blocks of the longest request: max_model_len / block_size rounded
 * up) and the longest sequence (tokens, the new one included) a graph runs
 * (--max-seq-len-to-capture).  A plain decode step (every sequence one new token and its
 * last logits; one process, no tensor parallelism) of n sequences then runs through the
 * graph of the smallest size >= n, the batch padded with copies of its last sequence;
 * any other step, or one past the largest size or the longest length, runs eagerly.  A
 * graph whose replay no longer matches (a scratch grew) is recorded again on the spot; a
 * size that fails to record GRAPH_MAX_FAILS times runs eagerly.  Drops the graphs
 * recorded before.  TSR_E_INVAL (not on a device), TSR_E_NOMEM.
 * tsr_llama_capture_graphs: record every size now (start-up) for the shortest length
 * class, after one eager warm-up step of the most tokens a step may have (the reserve's,
 * or the largest size) on `kv`, every row in block 0, which no request holds yet: every
 * scratch grows to its size there, so no later step moves one; *captured = how many were
 * recorded.  TSR_E_UNSUPPORTED: a backend without graphs; the backend's errors; a size
 * that fails to record is not an error (it is counted against the size).
 * tsr_llama_graph_stats_of: decode steps replayed, recorded on the spot and run eagerly
 * after a failed recording, since tsr_llama_set_graphs.  Engine thread, as the forward. */
typedef struct tsr_llama_graph_stats {
        uint64_t replays, captures, eager;
} tsr_llama_graph_stats;
tsr_status tsr_llama_set_graphs(tsr_llama *m, const uint32_t *sizes, size_t n_sizes, uint32_t table_width,
                                uint32_t max_seq_len);
tsr_status tsr_llama_capture_graphs(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, size_t *captured);
void tsr_llama_graph_stats_of(const tsr_llama *m, tsr_llama_graph_stats *ret);
/* Positions 0 .. len-1 hold valid keys and values. */
size_t tsr_llama_kv_len(const tsr_llama_kv *kv);
size_t tsr_llama_kv_capacity(const tsr_llama_kv *kv);
/* Forget positions >= len (len <= the current length), e.g. to re-run from there. */
tsr_status tsr_llama_kv_truncate(tsr_llama_kv *kv, size_t len);

/* ---- forward -------------------------------------------------------------------------- */

typedef enum tsr_llama_logits {
        TSR_LLAMA_LOGITS_NONE = 0,      /* a prefill chunk whose logits nobody needs */
        TSR_LLAMA_LOGITS_LAST = 1,      /* logits (vocab,) of the last token only */
        TSR_LLAMA_LOGITS_ALL = 2,       /* logits (n, vocab) of every token */
} tsr_llama_logits;

/* Run tokens (n,) at positions past_len .. past_len+n-1 of the sequence whose first
 * past_len positions are in `kv` (past_len <= tsr_llama_kv_len(kv)), append their keys
 * and values to `kv` and, per `which`, write logits.  On success the cache holds
 * past_len + n positions.  Returns TSR_E_INVAL (n == 0, a token >= vocab, past_len
 * beyond the cache's length, NULL logits when some are asked for), TSR_E_LIMIT
 * (past_len + n > capacity), TSR_E_NOMEM or a kernel's status.  On failure `logits` is
 * untouched and positions 0 .. min(length, past_len)-1 of the cache are intact (a failure
 * after the cache was touched leaves its length at past_len).  Runs every op on `be`
 * (tsr_llama_check_backend's statuses; the calling thread drives it). */
tsr_status tsr_llama_forward(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, const uint32_t *tokens, size_t n,
                             size_t past_len, tsr_llama_logits which, float *logits);

/* The same forward over a shared pool: the sequence's position t lives in block
 * block_table[t / block_size] of `pool` (n_table entries covering past_len + n positions,
 * each < the pool's block count).  The caller guarantees positions 0 .. past_len-1 of
 * this sequence were written earlier through the same table (no length is tracked here:
 * tsr_llama_kv_len is meaningless for a pool).  Errors as tsr_llama_forward; TSR_E_INVAL
 * for a short table or a block id outside the pool.  Several threads may run it at once
 * on one pool only if their tables share no block. */
tsr_status tsr_llama_forward_blocks(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool,
                                    const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                                    size_t past_len, tsr_llama_logits which, float *logits);

/* One sequence of a batched forward. */
typedef struct tsr_llama_seq {
        const uint32_t *block_table;    /* (n_table,) this sequence's blocks in the pool */
        size_t n_table;
        const uint32_t *tokens;         /* (n,) at positions past_len .. past_len+n-1 */
        size_t n;
        size_t past_len;
        tsr_llama_logits which;         /* NONE, LAST (1 row) or ALL (n rows) */
        /* NULL, or the chunk's engine record, whose token, logprobs and prompt logprobs
         * a model on a device answers there instead of downloading the rows (answer.h:
         * tsr_answer_rows; engine.h tsr_engine_seq.token and what goes with it); the
         * answered rows' slots in `logits` are then left unwritten.  A model on the host
         * leaves it as it is. */
        const tsr_engine_seq *answer;
} tsr_llama_seq;

/* Several sequences over one shared pool in a single pass: their rows are stacked so
 * every weight matrix is read once for all of them.  Each sequence's results are bitwise
 * those of running it alone (tsr_llama_forward_blocks).  `logits` receives, in sequence
 * order, the rows each one asked for (vocab floats per row).  Errors as
 * tsr_llama_forward_blocks, for any sequence; the pools may then hold partial writes
 * beyond each sequence's past_len (as after any failed forward). */
tsr_status tsr_llama_forward_batch(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool, const tsr_llama_seq *seqs,
                                   size_t n_seqs, float *logits);

/* The same for a pipeline stage: a model loaded with a layer range (its shard spec) runs
 * only those layers.  in: NULL on the first stage, else the previous stage's output;
 * out: (2, N, dim) floats, N the step's tokens, for the next stage (NULL on the last
 * stage, which writes `logits` as tsr_llama_forward_batch does).  Chaining the stages
 * gives logits bitwise equal to the whole model's: the stages run the same ops on the
 * same bytes.  TSR_E_INVAL when in/out do not match the stage's place. */
tsr_status tsr_llama_forward_stage(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool, const tsr_llama_seq *seqs,
                                   size_t n_seqs, const float *in, float *out, float *logits);

/* Tensor parallelism (issue #20): split a loaded float32 model (whole or a pipeline
 * stage) for rank tp_rank of tp_size, as vLLM shards a Llama: q/k/v and gate/up by output
 * rows (heads, KV heads replicated when tp_size exceeds them, MLP columns), lm_head by
 * vocabulary rows (the logits are all-gathered), o_proj and down_proj by input columns,
 * held as TSR_COMM_TREE_LEAVES / tp_size canonical K slices whose partial sums add in the
 * comm layer's fixed tree (R7); the embedding by vocabulary rows too (tsr_tp_embed), the
 * norms whole.  tp_size 1 makes
 * the canonical split alone, which the TP = 1 run needs to be bitwise equal to TP > 1.
 * The KV the model then binds has its local KV heads.  TSR_E_UNSUPPORTED (sizes that do
 * not split, weights not float32) or TSR_E_NOMEM, with the reason in err (the model is
 * then only fit to be freed).  Main thread, at start-up. */
struct tsr_comm;
tsr_status tsr_llama_shard_tp(tsr_llama *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen);
/* The rank's TP group, which the forwards of a tp_size > 1 model all-reduce and
 * all-gather over; set by the rank's thread before its forward (borrowed). */
void tsr_llama_set_comm(tsr_llama *m, struct tsr_comm *comm);

/* The family hooks (family.h) the Llama family shares with families of the same shape
 * (Llama 4): layers split contiguously over pipeline stages, the first n % pp_size
 * stages one more; and the engine's sequence record filled as a tsr_llama_seq. */
struct tsr_model_desc;
tsr_status tsr_llama_shard_for(const struct tsr_model_desc *d, uint32_t tp_rank, uint32_t tp_size, uint32_t pp_rank,
                               uint32_t pp_size, tsr_shard_spec *ret);
void tsr_llama_seq_fill(void *seq, const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                        size_t past_len, bool want_logits, bool want_all_logits);
void tsr_llama_seq_set_answer(void *seq, const tsr_engine_seq *q);
/* A step's logits rows lg (backend memory, one per row the sequences ask for) to the
 * host's `logits`, those the engine records in seq.answer offer answered on the device
 * instead (answer.h tsr_answer_rows).  Shared by the families with tsr_llama_seq. */
tsr_status tsr_llama_logits_to_host(tsr_backend *be, const tsr_llama_seq *seqs, size_t n_seqs, float *logits,
                                    float *lg, size_t vocab);

#endif
