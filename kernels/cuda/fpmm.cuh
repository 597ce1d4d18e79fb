/* fpmm.cuh - kernels.h's tsr_backend_matmul_scaled on the device (fpmm.cu): ModelOpt's
 * fp8 e4m3 and NVFP4 weights with their per-tensor scales, kernels/quant/fpmm.h's
 * computation.  Called by backend.cu only, after it checked the arguments (dtype,
 * scales, an nvfp4 n a multiple of 16, sizes <= INT_MAX); device pointers; everything
 * queues on `stream`.
 *
 * Two ways to the same products:
 *   the exact kernels: fpmm.h step for step (the activation quantizers, each product
 *     exact or rounded once as there, eight lanes over k, the pair tree, one final scale),
 *     so every output is BITWISE cpu/ref.c's, alone or in any batch;
 *   cuBLASLt's FP8 GEMM (fp8 weights with an activation scale, n and d multiples of 16,
 *     16-byte aligned arrays, a GPU and cuBLASLt that have one: sm_89+): the same
 *     quantized activations and exact products, summed in float32 in cuBLASLt's order
 *     (within fpmm.h's summation bound of the exact result; which kernel it picks may
 *     depend on rows, so not batch invariant, as the bf16 matmul).
 * Weight-only scales (input 0) and NVFP4 always run the exact kernels: Hopper has no
 * FP4 tensor cores (vLLM runs NVFP4 there as Marlin's W4A16). */
#ifndef TSR_CUDA_FPMM_CUH
#define TSR_CUDA_FPMM_CUH

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cuBLASLt's handle and what it learned per GEMM shape (its algorithm, or that it has
 * none); the workspace is the backend's (shared with cuBLAS: one stream).  One thread at
 * a time, the backend's. */
typedef struct tsr_cuda_fpmm_lt tsr_cuda_fpmm_lt;
tsr_status tsr_cuda_fpmm_lt_new(void *workspace, size_t workspace_bytes, tsr_cuda_fpmm_lt **ret);
void tsr_cuda_fpmm_lt_free(tsr_cuda_fpmm_lt *lt);
/* Whether tsr_cuda_fpmm with this lt takes cuBLASLt's GEMM for these arguments (asks
 * cuBLASLt for an algorithm the first time a shape comes; the answer is kept). */
bool tsr_cuda_fpmm_lt_applies(tsr_cuda_fpmm_lt *lt, const float *out, const void *w, const void *act, tsr_dtype t,
                              bool quantized_x, size_t rows, size_t n, size_t d);
/* GEMMs run by cuBLASLt and by the exact kernels so far. */
void tsr_cuda_fpmm_lt_counts(const tsr_cuda_fpmm_lt *lt, uint64_t *lt_calls, uint64_t *exact_calls);

/* Whether the launches for these sizes fit CUDA's grid (at most INT_MAX blocks each). */
bool tsr_cuda_fpmm_fits(size_t rows, size_t n, size_t d);
/* Bytes of device scratch tsr_cuda_fpmm needs for the quantized activations (0 when x
 * is not quantized). */
size_t tsr_cuda_fpmm_scratch_bytes(tsr_dtype t, bool quantized_x, size_t rows, size_t n);

/* out (rows, d) = the scaled matmul of w (d rows of t) and x (rows, n); input 0: x is
 * not quantized.  use_lt: cuBLASLt's GEMM, as tsr_cuda_fpmm_lt_applies said for these
 * arguments (one it then refuses runs the exact kernels, the shape marked); else the
 * exact kernels.  lt (may be NULL without use_lt) counts the calls.  scratch:
 * tsr_cuda_fpmm_scratch_bytes of device memory, 16-byte aligned. */
tsr_status tsr_cuda_fpmm(cudaStream_t stream, tsr_cuda_fpmm_lt *lt, bool use_lt, float *out, const float *x,
                         const void *w, tsr_dtype t, float weight_scale, float input_scale, size_t rows, size_t n,
                         size_t d, void *scratch);

#ifdef __cplusplus
}
#endif

#endif
