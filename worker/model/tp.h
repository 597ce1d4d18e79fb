/* tp.h - the pieces of tensor parallelism (issue #20) the families share: splitting a
 * loaded float32 matrix for a rank, the canonical row-parallel sum of R7
 * (reference/distributed.md), the vocabulary-parallel embedding and lm_head's vocabulary
 * all-gather.
 *
 * A row-parallel matrix W (d, K) of a rank of tp_size holds the rank's K / tp_size input
 * columns as ns = TSR_COMM_TREE_LEAVES / tp_size contiguous (d, K / S) blocks
 * (tsr_tp_keep_col_slices); its product gives one fp32 partial per block
 * (tsr_tp_row_partials), the balanced tree adds a rank's partials and the all-reduce
 * the ranks' sums (tsr_tp_row_reduce): the lower tree levels on the rank, the upper ones
 * in the all-reduce, the same bits for every tp_size.  A family may add several
 * matrices' partials slice by slice before the one reduce (Llama 4's MoE block).
 *
 * Pure functions of their arguments; the splits run at start-up on the main thread, the
 * forward's pieces on the rank's thread (its comm and backend). */
#ifndef TSR_WORKER_MODEL_TP_H
#define TSR_WORKER_MODEL_TP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/load/loader.h"

struct tsr_comm;

/* Keep rows [first, first + n) of each of the n_mats stacked (rows, cols) float32
 * matrices of *w: *w becomes a new (n_mats, n, cols) array and the old one is freed.
 * TSR_E_NOMEM (*w unchanged). */
tsr_status tsr_tp_keep_rows(float **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n);
/* Keep columns [first, first + n) of each of the n_mats stacked (rows, cols) float32
 * matrices of *w as ns contiguous (rows, n / ns) blocks, block j = columns
 * first + j * n / ns ...: *w becomes a new (n_mats, ns, rows, n / ns) array and the old
 * one is freed.  TSR_E_NOMEM (*w unchanged). */
tsr_status tsr_tp_keep_col_slices(float **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n,
                                  size_t ns);
/* The same two for stacked bfloat16 matrices (a BF16 checkpoint's expert stacks kept as
 * stored: Llama 4's). */
tsr_status tsr_tp_keep_rows_bf16(uint16_t **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n);
tsr_status tsr_tp_keep_col_slices_bf16(uint16_t **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n,
                                       size_t ns);
/* tsr_tp_keep_col_slices for a (rows, cols) host tensor kept as stored (a ModelOpt
 * fp8_e4m3 / nvfp4 weight, a GGUF block-format one: loader.h's tsr_load_slot.stored,
 * data from aligned_alloc):
 * the ns blocks (rows, n / ns) of the tensor's dtype one after the other, the scales
 * kept; the tensor then says (rows, n), its data in that slice order.  TSR_E_UNSUPPORTED
 * when first or n / ns is not a whole number of the dtype's blocks (nvfp4: 16 elements),
 * TSR_E_INVAL for a range out of it, TSR_E_NOMEM (*t unchanged on failure). */
tsr_status tsr_tp_keep_stored_col_slices(tsr_tensor *t, size_t first, size_t n, size_t ns);
/* The same three for a linear held either as float32 (*f) or kept as stored (q->data
 * set: loader.h's tsr_load_stored_slice cuts its rows, tsr_tp_keep_stored_col_slices its
 * K slices), so a family splits both with one call. */
tsr_status tsr_tp_keep_rows_of(float **f, tsr_tensor *q, size_t rows, size_t cols, size_t first, size_t n);
tsr_status tsr_tp_keep_row_ranges_of(float **f, tsr_tensor *q, size_t cols, const size_t (*ranges)[2], size_t n);
tsr_status tsr_tp_keep_col_slices_of(float **f, tsr_tensor *q, size_t rows, size_t cols, size_t first, size_t n,
                                     size_t ns);
/* TSR_E_UNSUPPORTED, with err naming `what` of layer `layer`, when q is kept as stored
 * (q->data set) and a canonical K slice of ks columns (ns a rank) would cut its blocks
 * (NVFP4's 16 elements); TSR_OK otherwise (a float32 one, or no tensor: q NULL).  The
 * families check every layer this way before cutting anything. */
tsr_status tsr_tp_check_stored_slice(const tsr_tensor *q, size_t ks, size_t ns, const char *what, size_t layer,
                                     char *err, size_t errlen);
/* Keep the n row ranges [ranges[i][0], ranges[i][0] + ranges[i][1]) of the (rows, cols)
 * float32 matrix *w, in that order: *w becomes a new (sum of the lengths, cols) array and
 * the old one is freed (a fused projection whose parts split apart, NemotronH's in_proj).
 * TSR_E_NOMEM (*w unchanged). */
tsr_status tsr_tp_keep_row_ranges(float **w, size_t cols, const size_t (*ranges)[2], size_t n);
/* The vocabulary rows [first, first + n) of the (vocab, dim) float32 embedding *embed and
 * lm_head *output (either may be NULL: a stage without it), each through
 * tsr_tp_keep_rows; tied (*output == *embed), the one table cut once and *output then
 * points at the cut.  TSR_E_NOMEM: half cut, the caller frees the model. */
tsr_status tsr_tp_keep_vocab_rows(float **output, float **embed, size_t vocab, size_t dim, size_t first, size_t n);
/* A family's embedding lookup: x (rows, dim) = the rows `ids` of the table `model` holds
 * (at tp_size > 1 the rank's vocabulary share). */
typedef tsr_status (*tsr_tp_gather_fn)(const void *model, tsr_backend *be, float *x, const uint32_t *ids,
                                       size_t rows);
/* The lookup a family's tsr_tp_gather_fn makes: x (rows, dim) = rows `ids` of a table of
 * n_rows rows held as float32 (`f32`) or kept as stored (q->data set): float32 and bf16
 * through the backend's gather (in its memory: bf16 widens exactly), a GGUF block format
 * row by row on the host by the dequantizer the load would have used (a host backend's
 * memory), so the values are bitwise the widened table's.  TSR_E_INVAL for an
 * id >= n_rows (nothing written); the backend's or the dequantizer's status. */
tsr_status tsr_tp_table_rows(tsr_backend *be, float *x, const float *f32, const tsr_tensor *q, size_t n_rows,
                             size_t dim, const uint32_t *ids, size_t rows);
/* x (rows, dim) = the embedding of `tokens` on every rank of a vocabulary-parallel
 * embedding (vLLM's VocabParallelEmbedding): rank tp_rank of tp_size holds only its
 * tsr_tp_vocab_of rows, and `gather` reads those; a row of a token another rank holds is
 * set to -0.0f, and x is all-reduced over `comm`.  -0.0f
 * is the identity of IEEE addition (a + -0.0f is a for every a, +0.0f included), so
 * each row is its owner's bits, the sign of a zero too, in any reduction order: the same
 * x at every tp_size.  At tp_size 1, `gather` on `tokens` itself.  TSR_E_INVAL for a
 * token >= vocab (checked first, nothing read), a bad rank or no comm at tp_size > 1; TSR_E_UNSUPPORTED at tp_size > 1 on a backend whose memory is
 * not the host's; TSR_E_NOMEM; gather's or the comm's status.  The rank's thread. */
tsr_status tsr_tp_embed(struct tsr_comm *comm, uint32_t tp_rank, uint32_t tp_size, size_t vocab, size_t dim,
                        const uint32_t *tokens, size_t rows, float *x, tsr_tp_gather_fn gather, const void *model,
                        tsr_backend *be);

/* The vocabulary's padding before it is split (vLLM's DEFAULT_VOCAB_PADDING_SIZE). */
#define TSR_TP_VOCAB_PAD 64
/* A rank's share of the vocabulary, the embedding's and lm_head's rows, as vLLM's
 * VocabParallelEmbedding / ParallelLMHead split it: the vocabulary padded to a multiple
 * of TSR_TP_VOCAB_PAD and cut into tp_size equal parts of `per` rows; rank r holds the
 * real rows of part r, [first, first + n) (the last ranks fewer than per, the padding
 * held by nobody).  n is 0 for a bad rank (per 0 then) and for a vocabulary too small
 * to split, which tsr_tp_check_split refuses. */
typedef struct tsr_tp_vocab {
        size_t first, n, per;
} tsr_tp_vocab;
tsr_tp_vocab tsr_tp_vocab_of(size_t vocab, uint32_t tp_rank, uint32_t tp_size);

/* Whether tp_size splits the counts every family's split needs; else TSR_E_UNSUPPORTED
 * with the first that does not named in err, in vLLM's words where vLLM has them:
 * tp_size divides the TSR_COMM_TREE_LEAVES canonical partial sums and the n_heads
 * attention heads, is a divisor or a multiple of the n_kv_heads KV heads, and leaves
 * every rank some rows of the padded vocabulary (tsr_tp_vocab_of). */
tsr_status tsr_tp_check_split(uint32_t tp_size, uint32_t n_heads, uint32_t n_kv_heads, uint32_t vocab, char *err,
                              size_t errlen);

/* --enable-expert-parallel: the routed experts rank tp_rank of tp_size holds whole,
 * vLLM's linear placement (E / tp_size consecutive experts each, the first E % tp_size
 * ranks one more): [*e0, *e0 + *ne).  TSR_E_UNSUPPORTED (err says why) when there are
 * fewer experts than ranks. */
tsr_status tsr_tp_expert_range(size_t E, uint32_t tp_rank, uint32_t tp_size, size_t *e0, size_t *ne, char *err,
                               size_t errlen);
/* The ns canonical partials of W (d, k) @ x (rows, k) -> parts (ns, rows, d), W held as
 * tsr_tp_keep_col_slices' ns (d, k / ns) blocks of w_dtype (float32, or bf16 converted
 * after the split: each block's partial is then the bf16 matmul's, the same bits at
 * every tp_size), or tsr_tp_keep_stored_col_slices' blocks of a stored dtype (a GGUF
 * block format; fp8_e4m3 / nvfp4 with their `scales`, tsr_backend_matmul_scaled; NULL
 * for the others); `slice` (rows, k / ns) is scratch.  The backend matmul's status. */
tsr_status tsr_tp_row_partials(tsr_backend *be, float *parts, float *slice, const float *x, const void *w,
                               tsr_dtype w_dtype, const tsr_matmul_scales *scales, size_t rows, size_t k, size_t d,
                               size_t ns);
/* out (count,) = the balanced tree (tsr_comm_tree_sum) over the ns partials parts (ns,
 * count), then, when tp_size > 1, all-reduced over `comm` (TSR_E_INVAL without one).
 * `out` may be one of the partials. */
tsr_status tsr_tp_row_reduce(struct tsr_comm *comm, uint32_t tp_size, const float *parts, size_t ns, float *out,
                             size_t count);
/* A family's rule for a tensor-parallel rank's share of one logical tensor (the loader's
 * slice of it), by the family's logical name. */
typedef struct tsr_tp_slice_rule {
        const char *name;
        tsr_load_slice s;
} tsr_tp_slice_rule;
/* The share of logical tensor `name` among the n rules (TSR_LOAD_WHOLE when none names
 * it: what every rank holds whole). */
tsr_load_slice tsr_tp_slice_of(const tsr_tp_slice_rule *rules, size_t n, const char *name);
/* The start of a family's shard call for tp_rank of tp_size (`ep`: expert parallelism)
 * on a model loaded as `loaded`'s share (tp_size 1: whole tensors), `canonical` once
 * split.  TSR_OK with *done false: split it now (the load's own call, or a whole model);
 * TSR_OK with *done true: the load split it for this very rank, nothing left;
 * TSR_E_INVAL for anything else (another rank or kind of parallelism than the one read,
 * a whole model split twice), err naming the share read where there is one. */
tsr_status tsr_tp_shard_begin(const tsr_shard_spec *loaded, bool canonical, uint32_t tp_rank, uint32_t tp_size,
                              bool ep, bool *done, char *err, size_t errlen);
/* lm_head's vocabulary all-gather: each rank's logits rows mine (rows, n) of its
 * tsr_tp_vocab_of rows, all-gathered over `comm` (each part padded to `per` columns)
 * into logits (rows, vocab) in vocabulary order, the padding dropped (vLLM's
 * LogitsProcessor gathers, then cuts to the vocabulary, the same way).  TSR_E_NOMEM, the
 * comm's status. */
tsr_status tsr_tp_gather_vocab(struct tsr_comm *comm, uint32_t tp_rank, uint32_t tp_size, size_t vocab,
                               const float *mine, float *logits, size_t rows);

#endif
