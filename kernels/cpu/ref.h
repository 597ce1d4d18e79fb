/* ref.h - cpu/ref.c's kernels as plain functions: the specification, callable without a
 * backend.  Internal to kernels/: the reference backend's table wraps them, and the fast
 * backend (cpu/fast.c) runs them on slices and where its ISA has no faster version.
 * Each is the kernels.h operator of the same name (matmul per weight dtype) and checks
 * its arguments as kernels.h says.  Any thread: they keep no state. */
#ifndef TSR_KERNELS_CPU_REF_H
#define TSR_KERNELS_CPU_REF_H

#include "kernels/kernels.h"

tsr_status tsr_ref_rmsnorm(float *out, const float *x, const float *w, size_t rows, size_t dim, float eps);
tsr_status tsr_ref_embedding(float *out, const void *table, tsr_dtype dtype, size_t vocab, size_t dim, const uint32_t *ids,
                             size_t rows);
tsr_status tsr_ref_matmul_f32(float *out, const float *x, const float *w, size_t rows, size_t n, size_t d);
tsr_status tsr_ref_matmul_bf16(float *out, const float *x, const uint16_t *w, size_t rows, size_t n, size_t d);
tsr_status tsr_ref_rope(float *x, size_t rows, size_t n_heads, size_t head_dim, const uint32_t *pos,
                        const float *inv_freq, tsr_rope_layout layout);
tsr_status tsr_ref_kv_write(const tsr_kv_view *kv, const float *k, const float *v, size_t n, size_t past_len);
tsr_status tsr_ref_attention(float *out, const float *q, const tsr_kv_view *kv, size_t n, size_t past_len,
                             size_t n_heads, float scale);
tsr_status tsr_ref_silu_mul(float *out, const float *gate, const float *up, size_t n);
tsr_status tsr_ref_add(float *out, const float *a, const float *b, size_t n);
tsr_status tsr_ref_gather_rows(float *out, const float *x, size_t dim, const uint32_t *idx, const float *scales,
                               size_t n);
tsr_status tsr_ref_scatter_add_rows(float *dst, size_t dim, const float *src, const uint32_t *idx,
                                    const float *scales, size_t n);
/* The two as backend ops (the reference's and the fast backend's table entries). */
tsr_status tsr_ref_be_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                  const uint32_t *idx, const float *scales, size_t n);
tsr_status tsr_ref_be_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                       const uint32_t *idx, const float *scales, size_t n);
tsr_status tsr_ref_relu_sq(float *x, size_t n);
tsr_status tsr_ref_be_relu_sq(tsr_backend *be, float *x, size_t n);
tsr_status tsr_ref_be_round_bf16(tsr_backend *be, float *x, size_t n);
/* cpu/mamba.c: kernels.h tsr_backend_mamba_mixer, arguments checked, as the tasks of
 * tsr_backend_host_tasks on `be` (the reference's, the fast backend's, devlike's). */
tsr_status tsr_cpu_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                               const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                               const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves, size_t n_leaves);
tsr_status tsr_ref_softmax(float *out, const float *x, size_t rows, size_t n);
tsr_status tsr_ref_log_softmax(float *out, const float *x, size_t rows, size_t n);
tsr_status tsr_ref_argmax(uint32_t *out, const float *x, size_t rows, size_t n);
tsr_status tsr_ref_sample(uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws);
tsr_status tsr_ref_logit_rules(float *x, size_t rows, size_t n, const tsr_logit_rules *rules);
tsr_status tsr_ref_logprobs(tsr_row_logprobs *out, const float *x, size_t rows, size_t n, const uint32_t *tokens,
                            const uint32_t *top);
/* The two behind a backend table (ref.c's, and fast.c's: the same on every CPU backend). */
tsr_status tsr_ref_be_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules);
tsr_status tsr_ref_be_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                               const uint32_t *tokens, const uint32_t *top);
tsr_status tsr_ref_add_rmsnorm(float *out, float *residual, const float *x, const float *w, size_t rows,
                               size_t dim, float eps);

#endif
