/* matmul.cuh - kernels.h's matmul on cuBLAS (matmul.cu).  Device pointers; the handle is
 * the backend's, already bound to its stream (cublasSetStream), so the GEMM queues there.
 * rows, n, d are checked <= INT_MAX by the caller.  TSR_E_CUDA (with a stderr line) when
 * cuBLAS refuses. */
#ifndef TSR_CUDA_MATMUL_CUH
#define TSR_CUDA_MATMUL_CUH

#include <stddef.h>
#include <stdint.h>
#include <cublas_v2.h>
#include "common/tsr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x (rows, n) float32, w (d, n) float32 -> out (rows, d): cublasSgemm, no TF32. */
tsr_status tsr_cuda_matmul_f32(cublasHandle_t h, float *out, const float *x, const float *w, size_t rows, size_t n,
                               size_t d);
/* xb (rows, n) bf16 bits (x already rounded, elementwise.cu), w (d, n) bf16 bits -> out
 * (rows, d) float32: cublasGemmEx with float32 accumulation (CUBLAS_COMPUTE_32F). */
tsr_status tsr_cuda_matmul_bf16(cublasHandle_t h, float *out, const uint16_t *xb, const uint16_t *w, size_t rows,
                                size_t n, size_t d);

#ifdef __cplusplus
}
#endif

#endif
