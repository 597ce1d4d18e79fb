/* loader.h - the one weight loader: a tensor source (a GGUF file or a set of safetensors
 * files, both mmap'd by their readers) x a family's tensor-name table x a shard spec.
 *
 * The loader knows formats, names, shapes and progress; it knows nothing of any model.
 * Where each tensor goes, and the shape it must have, is the family's answer to `bind`
 * (worker/model/<family>.c), so a new family or a new source format is an addition on
 * one side only.  Blocking file I/O plus conversion: the main thread, at start-up.
 * Non-logging: failures return a status and a message naming the file and the tensor. */
#ifndef TSR_WORKER_LOAD_LOADER_H
#define TSR_WORKER_LOAD_LOADER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/tensor.h"
#include "worker/load/gguf.h"
#include "worker/load/modelopt.h"
#include "worker/load/safetensors.h"

/* Which part of the model a rank holds: a pipeline stage's layers, a tensor-parallel
 * rank's share of them (tp_size > 1: a family that reads its share from the file,
 * tsr_model_family.load_tp_share; the others load tp_size 1), with expert_parallel the
 * routed experts whole per rank instead (vLLM's --enable-expert-parallel; the rank's
 * range is tsr_tp_expert_range's), the rest of each layer tensor parallel. */
typedef struct tsr_shard_spec {
        uint32_t tp_rank, tp_size;
        uint32_t first_layer, last_layer;       /* inclusive */
        bool expert_parallel;
} tsr_shard_spec;

/* The spec for the whole model of n_layers layers. */
tsr_shard_spec tsr_shard_spec_whole(uint32_t n_layers);

/* How a weight splits over tp_size ranks (declared now; the distributed issue uses it).
 * Matrices are (out, in) row-major, as the forward reads them. */
typedef enum tsr_shard_rule {
        TSR_SHARD_REPLICATED = 0,       /* every rank holds all of it (norms, rope tables) */
        TSR_SHARD_COLUMN,               /* split along `out` (rows): q/k/v, gate/up, lm_head, vocab of the embedding */
        TSR_SHARD_ROW,                  /* split along `in` (columns), partial sums all-reduced: o_proj, down_proj */
        TSR_SHARD_EXPERT,               /* whole experts per rank (MoE families) */
} tsr_shard_rule;

/* One weight of a family's table.  Per-layer names carry one "%u", the layer index. */
typedef struct tsr_tensor_name {
        const char *logical;            /* the family's own name, e.g. "attn_q" */
        const char *gguf;               /* llama.cpp's, e.g. "blk.%u.attn_q.weight"; NULL: none */
        const char *hf;                 /* transformers', e.g. "model.layers.%u.self_attn.q_proj.weight"; NULL: none */
        bool per_layer;
        tsr_shard_rule shard;
} tsr_tensor_name;

/* What a load did, for the caller's progress and summary log lines. */
typedef struct tsr_load_stats {
        size_t n_tensors;       /* tensors read */
        uint64_t file_bytes;    /* their bytes in the file that were read (a row slice: its rows) */
        uint64_t f32_bytes;     /* bytes of float32 they would be widened (a slice: its share) */
        uint64_t resident_bytes;        /* bytes they take in memory after the load (kept + widened) */
        double seconds;
} tsr_load_stats;

/* Called after each tensor; may be NULL.  `done` counts tensors and bytes so far out
 * of `total`. */
typedef void (*tsr_load_progress_fn)(void *ud, const tsr_load_stats *done, const tsr_load_stats *total);

/* A tensor source: exactly one of g / set (borrowed).  `src` names it in messages. */
typedef struct tsr_tensor_source {
        const tsr_gguf *g;
        const tsr_safetensors_set *set;
        const char *src;
        /* bit (1u << dtype): a GGUF tensor stored in this dtype whose slot has `stored` is
         * kept as it is, not widened (tsr_load_opts; issue #15).  0: widen everything. */
        uint32_t keep_dtypes;
        /* A safetensors BF16 matrix or expert stack whose slot has `stored` is kept as it
         * is (BF16, the file's bytes or the slot's share of them), not widened
         * (tsr_load_opts).  Ignored for GGUF, whose BF16 tensors keep_dtypes governs. */
        bool keep_bf16;
        /* Prepended to every HF name of the table (NULL: none): a checkpoint that nests the
         * text model in a bigger one, e.g. "language_model." for Llama 4's
         * Llama4ForConditionalGeneration.  Ignored for GGUF. */
        const char *hf_prefix;
        /* The ModelOpt quantization the folder announces (NULL: none; tsr_load_opts): an
         * F8_E4M3 / U8 weight whose slot has `stored` is kept as stored with its scales
         * (tsr_modelopt_load_weight).  Ignored for GGUF. */
        const tsr_modelopt_config *modelopt;
} tsr_tensor_source;

/* How to load.  Zero (or a NULL pointer) widens every tensor to float32. */
typedef struct tsr_load_opts {
        /* bit (1u << dtype): a matmul weight or embedding table stored in the file in
         * this dtype (a GGUF block type the backend's matmul computes on) is kept as it
         * is: resident bytes = file bytes for it. */
        uint32_t keep_dtypes;
        /* A Hugging Face folder's BF16 matmul weights stay BF16 as stored (the weights'
         * dtype is bfloat16 and the backend's matmul computes on it): resident bytes =
         * file bytes for them, and no float32 copy is ever made.  The family decides which
         * of its slots may hold one (tsr_load_slot.stored). */
        bool keep_bf16;
        /* A Hugging Face folder's ModelOpt quantization (tsr_modelopt_config_read; NULL:
         * none announced): its quantized linear weights stay fp8_e4m3 / nvfp4 with their
         * scales (resident bytes: the file's, plus NVFP4's block scales). */
        const tsr_modelopt_config *modelopt;
} tsr_load_opts;

/* A tensor-parallel rank's share of a matrix, read straight from the file (issue #20;
 * vLLM's weight_loader narrows the same way): row ranges [first, first + n) of a
 * column-parallel weight, or column ranges of every row (a row-parallel weight, or a
 * column-parallel one stored transposed, as Llama 4's expert stacks [E, in, out]).
 * Several ranges for a fused projection whose parts split apart (NemotronH's in_proj,
 * Llama 4's gate_up), concatenated in order.  Of an expert stack, the same share of
 * every expert's matrix.  TSR_LOAD_WHOLE (zero): all of it. */
typedef enum { TSR_LOAD_WHOLE, TSR_LOAD_SLICE_ROWS, TSR_LOAD_SLICE_COLS } tsr_load_slice_axis;
#define TSR_LOAD_SLICE_MAX 5
typedef struct tsr_load_slice {
        tsr_load_slice_axis axis;
        uint32_t n_ranges;                      /* 1..TSR_LOAD_SLICE_MAX */
        uint64_t range[TSR_LOAD_SLICE_MAX][2];  /* {first, n} each, n > 0 */
} tsr_load_slice;

/* Cut a 2-D host tensor kept as stored (its data from aligned_alloc, freed with free:
 * tsr_load_slot.stored) to the share `s`: the rows of its ranges, or the columns of its
 * ranges side by side, in order; the scales kept.  A 3-D stack [E, rows, cols]: that
 * share of each of its E matrices, [E, rows', cols'].  Column ranges of a block format must
 * start and end on whole blocks (dtype.h's block_elems): TSR_E_UNSUPPORTED otherwise;
 * TSR_E_INVAL for a range out of the tensor, TSR_E_NOMEM; *t unchanged on failure. */
tsr_status tsr_load_stored_slice(tsr_tensor *t, const tsr_load_slice *s);
/* The same share as a copy: *ret gets new aligned_alloc memory, t (its data borrowed,
 * e.g. a file's mapped bytes) is not changed. */
tsr_status tsr_load_stored_cut(const tsr_tensor *t, const tsr_load_slice *s, tsr_tensor *ret);
/* Its last step, for any new layout of such a tensor: t takes `data` (aligned_alloc'd,
 * `rows` x `cols` of t's dtype) in place of its own, which is freed; the scales kept.
 * TSR_E_INVAL (data freed, *t unchanged) for a shape the dtype cannot have. */
tsr_status tsr_load_stored_adopt(tsr_tensor *t, void *data, size_t rows, size_t cols);

/* Where one tensor goes and the shape it must have, as the family answers `bind`. */
typedef struct tsr_load_slot {
        float **dst;            /* receives a new float32 array (malloc; the family frees it) */
        /* Where the tensor goes instead when the source keeps its dtype (keep_dtypes): the
         * file's bytes copied into 64-byte aligned memory (free(stored->data); the family
         * frees it), *dst left NULL.  NULL: always widened. */
        tsr_tensor *stored;
        uint64_t rows, cols;    /* (out, in) row-major; cols == 0: a vector of `rows` elements */
        /* > 0: a 3-D stack (experts, rows, cols) of matrices as the file stores it (MoE
         * experts, transformers' BMM layout); never kept in a block format, kept as
         * stored (`stored`) only as a ModelOpt FP8 stack (tsr_modelopt_load_stack) or a
         * BF16 one (keep_bf16). */
        uint64_t experts;
        bool optional;          /* may be absent from the source (then *dst stays NULL) */
        /* Not TSR_LOAD_WHOLE: only this share of the (rows, cols) matrix (rows and cols
         * stay the file's shape, which is checked) goes into *dst, as (sum of the n, cols)
         * or (rows, sum of the n) floats (an expert stack: experts of those); it is
         * converted row by row from the file's bytes, so no whole tensor is ever held in
         * float32.  A tensor kept as stored keeps only the share's bytes: a GGUF block
         * format's and a safetensors BF16 matrix's cut from the mapped file (a GGUF
         * column range that would cut a block is widened instead); a ModelOpt weight
         * read whole as stored and cut to the share (tsr_load_stored_slice: the one
         * tensor, never the whole model, held at once); an FP8 expert stack (experts > 0)
         * the same, the share of each expert; a BF16 one's share of each expert cut from
         * the mapped file.  A vector (cols 0) only by rows. */
        tsr_load_slice slice;
        /* An expert stack (experts > 0): only experts [experts_first, experts_first +
         * experts_n) go into *dst (experts_n 0: every one); an expert-parallel rank's
         * (tsr_shard_spec.expert_parallel).  A ModelOpt FP8 stack is read whole as
         * stored, then cut to those experts; a BF16 one kept as stored reads only them. */
        uint64_t experts_first, experts_n;
} tsr_load_slot;

/* The family's half of a load: the slot of table entry `n` in its `model` for layer
 * `layer` (the model's layer index; 0 for a model-wide entry).  False: this model has
 * no such tensor (a tied output matrix, a name the family keeps only in one format). */
typedef bool (*tsr_load_bind_fn)(void *model, const tsr_tensor_name *n, uint32_t layer, tsr_load_slot *ret);

/* Read every tensor of `table` the shard holds (model-wide entries once, per-layer
 * entries for each layer of spec, in the table's order layer after layer) from `s` into
 * the slots `bind` gives for `model`.  An entry the source format has no name for is
 * skipped.  Every tensor is found and counted before any is read (progress then says
 * how far along it is); a missing non-optional one is TSR_E_NOTFOUND.  Each is
 * converted to float32 (tsr_ggml_dequantize for GGUF types; F32/F16/BF16 safetensors).
 * TSR_E_INVAL (shape), TSR_E_UNSUPPORTED (type), TSR_E_NOMEM, TSR_E_LIMIT; arrays
 * already stored in slots stay there for the family to free.  *stats (may be NULL)
 * gets the totals on success. */
tsr_status tsr_load_tensors(const tsr_tensor_source *s, const tsr_tensor_name *table, size_t n_table,
                            const tsr_shard_spec *spec, tsr_load_bind_fn bind, void *model,
                            tsr_load_progress_fn progress, void *ud, tsr_load_stats *stats, char *err,
                            size_t errlen);

/* Dequantize n elements of ggml type `type` stored at src (n / block elements blocks)
 * into dst (n,): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (the
 * formats are kernels/quant/'s).  TSR_E_UNSUPPORTED for another type, TSR_E_INVAL if n
 * is not a multiple of the type's block size. */
tsr_status tsr_ggml_dequantize(uint32_t type, const void *src, size_t n, float *dst);
/* ggml's type tag -> the tsr_dtype of the same encoding; false for a tag we do not read. */
bool tsr_ggml_dtype(uint32_t type, tsr_dtype *ret);

#endif
