/* backend_impl.h - what a backend implements: the operator table behind kernels.h's
 * tsr_backend handle.  Private to kernels/ (cpu/ref.c, cpu/fast.c, cuda/backend.cu and
 * backend.c, which holds the public wrappers); callers see only kernels.h.
 *
 * A backend kind has one static, immutable tsr_backend_ops; each backend object pairs it
 * with its own context (the CPU pool and ISA, the CUDA device), so two objects of one
 * kind share no mutable state.  Every op gets the backend first and reads its context
 * from be->ctx.  The wrappers in backend.c have already checked that `be` is not NULL,
 * that the op's slot is set and, for matmul, that the weight dtype is in matmul_dtypes;
 * an op checks its own arguments (kernels.h: TSR_E_INVAL, nothing written). */
#ifndef TSR_KERNELS_BACKEND_IMPL_H
#define TSR_KERNELS_BACKEND_IMPL_H

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tsr_backend_ops {
        const char *name;
        bool host_memory;               /* the backend's memory is the host's */
        uint32_t matmul_dtypes;         /* bit (1u << dtype) for each weight dtype matmul has a kernel for */

        /* Free be->ctx (not be itself); NULL when ctx needs nothing. */
        void (*ctx_free)(void *ctx);
        tsr_status (*mem_alloc)(tsr_backend *be, size_t bytes, void **ret);
        void (*mem_free)(tsr_backend *be, void *p);
        tsr_status (*upload)(tsr_backend *be, void *dst, const void *src, size_t bytes);
        tsr_status (*download)(tsr_backend *be, void *dst, const void *src, size_t bytes);
        tsr_status (*copy)(tsr_backend *be, void *dst, const void *src, size_t bytes);
        /* NULL: memset (host memory) */
        tsr_status (*zero)(tsr_backend *be, void *p, size_t bytes);
        /* NULL: TSR_E_UNSUPPORTED (host memory) */
        tsr_status (*mem_info)(tsr_backend *be, size_t *free_bytes, size_t *total_bytes);
        tsr_status (*synchronize)(tsr_backend *be);
        /* kernels.h's graphs; NULL: none (the wrappers answer TSR_E_UNSUPPORTED / false) */
        tsr_status (*graph_begin)(tsr_backend *be, uint64_t key, tsr_graph_mode mode, uint32_t table_width,
                                  uint32_t max_len);
        tsr_status (*graph_end)(tsr_backend *be, bool launch, bool *launched);
        bool (*graph_has)(tsr_backend *be, uint64_t key, uint32_t max_len);
        void (*graph_drop)(tsr_backend *be);

        /* The operators of kernels.h, same arguments after `be`; NULL: not implemented
         * (the wrapper answers TSR_E_UNSUPPORTED). */
        tsr_status (*rmsnorm)(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                              float eps);
        tsr_status (*embedding)(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                size_t dim, const uint32_t *ids, size_t rows);
        /* Dispatches on w_dtype inside: one kernel per weight format, one slot for all. */
        tsr_status (*matmul)(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                             size_t rows, size_t n, size_t d);
        /* The scaled formats (fp8_e4m3, nvfp4; their bits are in matmul_dtypes too):
         * tsr_backend_matmul_scaled.  NULL: the backend has no such kernel. */
        tsr_status (*matmul_scaled)(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                    const tsr_matmul_scales *s, size_t rows, size_t n, size_t d);
        tsr_status (*rope)(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                           const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout);
        tsr_status (*kv_write)(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                               size_t past_len);
        tsr_status (*attention)(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                size_t past_len, size_t n_heads, float scale);
        /* NULL: the wrappers run kv_write / attention per sequence */
        tsr_status (*kv_write_batch)(tsr_backend *be, const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs,
                                     const float *k, const float *v);
        tsr_status (*attention_batch)(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv,
                                      const tsr_kv_seq *seqs, size_t n_seqs, size_t n_heads, float scale);
        tsr_status (*silu_mul)(tsr_backend *be, float *out, const float *gate, const float *up, size_t n);
        tsr_status (*add)(tsr_backend *be, float *out, const float *a, const float *b, size_t n);
        /* the wrappers checked the arguments (idx in range) and n > 0 */
        tsr_status (*gather_rows)(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                  const uint32_t *idx, const float *scales, size_t n);
        tsr_status (*scatter_add_rows)(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                       const uint32_t *idx, const float *scales, size_t n);
        tsr_status (*relu_sq)(tsr_backend *be, float *x, size_t n);
        tsr_status (*round_bf16)(tsr_backend *be, float *x, size_t n);
        /* the wrapper checked the arguments (kernels.h) and n_seqs > 0 */
        tsr_status (*mamba_mixer)(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                                  const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                                  const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves,
                                  size_t n_leaves);
        tsr_status (*softmax)(tsr_backend *be, float *out, const float *x, size_t rows, size_t n);
        tsr_status (*log_softmax)(tsr_backend *be, float *out, const float *x, size_t rows, size_t n);
        /* out is host memory; the wrapper checked the arguments and rows > 0 */
        tsr_status (*argmax)(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n);
        /* the same: draws checked, rows > 0 */
        tsr_status (*sample)(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws);
        /* the same: rules checked (ids < n, counts, factors), rows > 0 */
        tsr_status (*logit_rules)(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules);
        /* the same: tokens and top checked (a token >= n: the row is skipped), rows > 0 */
        tsr_status (*logprobs)(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                               const uint32_t *tokens, const uint32_t *top);
        tsr_status (*add_rmsnorm)(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                  size_t rows, size_t dim, float eps);
        /* CPU backends only (kernels.h, tsr_backend_host_tasks) */
        tsr_status (*host_tasks)(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx);
} tsr_backend_ops;

/* Written once by the backend's constructor, read-only after: the queries of kernels.h
 * read these fields, the ops read ctx. */
struct tsr_backend {
        const tsr_backend_ops *ops;     /* static, shared by every backend of the kind */
        void *ctx;                      /* this backend's own state; ops->ctx_free frees it */
        tsr_cpu_isa isa;                /* TSR_CPU_ISA_SCALAR unless a fast CPU backend */
        int n_threads;                  /* 1 unless a fast CPU backend with a pool */
};

/* A backend of `ops` owning `ctx` (freed through ops->ctx_free by tsr_backend_free,
 * and here when the allocation fails).  TSR_E_NOMEM. */
tsr_status tsr_backend_make(const tsr_backend_ops *ops, void *ctx, tsr_cpu_isa isa, int n_threads,
                            tsr_backend **ret);

/* The reference backend's operator table (cpu/ref.c), for cpu/devlike.c, and the weight
 * dtypes its matmul takes. */
const tsr_backend_ops *tsr_backend_ref_ops(void);
#define TSR_CPU_REF_MATMUL_DTYPES (1u << TSR_DTYPE_F32 | 1u << TSR_DTYPE_BF16 | TSR_QMM_DTYPES | TSR_FPMM_DTYPES)

/* Host memory for the CPU backends: aligned_alloc(64), free, memcpy. */
tsr_status tsr_backend_host_alloc(tsr_backend *be, size_t bytes, void **ret);
void tsr_backend_host_free(tsr_backend *be, void *p);
tsr_status tsr_backend_host_copy(tsr_backend *be, void *dst, const void *src, size_t bytes);
tsr_status tsr_backend_host_sync(tsr_backend *be);

#ifdef __cplusplus
}
#endif

#endif
