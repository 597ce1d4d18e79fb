/* cuda_check.h - turn CUDA and cuBLAS errors into tsr_status at the call site (never exit).
 * Each failure prints the failing expression, file:line and the library's own message on
 * stderr, so a run on a GPU machine says what broke without a debugger. */
#ifndef TSR_CUDA_CHECK_H
#define TSR_CUDA_CHECK_H

#include <stdio.h>
#include <cuda_runtime.h>
#include "common/tsr_status.h"

#define TSR_CUDA_TRY(expr)                                                                     \
        do {                                                                                   \
                cudaError_t tsr_cuda_err_ = (expr);                                            \
                if (tsr_cuda_err_ != cudaSuccess) {                                            \
                        fprintf(stderr, "cuda: %s failed at %s:%d: %s\n", #expr, __FILE__,     \
                                __LINE__, cudaGetErrorString(tsr_cuda_err_));                 \
                        return TSR_E_CUDA;                                                     \
                }                                                                              \
        } while (0)

#ifdef CUBLAS_V2_H_
/* Only where cublas_v2.h is included first (matmul.cu, backend.cu). */
#define TSR_CUBLAS_TRY(expr)                                                                   \
        do {                                                                                   \
                cublasStatus_t tsr_cublas_st_ = (expr);                                        \
                if (tsr_cublas_st_ != CUBLAS_STATUS_SUCCESS) {                                 \
                        fprintf(stderr, "cublas: %s failed at %s:%d: %s (%s)\n", #expr,        \
                                __FILE__, __LINE__, cublasGetStatusName(tsr_cublas_st_),       \
                                cublasGetStatusString(tsr_cublas_st_));                        \
                        return TSR_E_CUDA;                                                     \
                }                                                                              \
        } while (0)
#endif

#endif
