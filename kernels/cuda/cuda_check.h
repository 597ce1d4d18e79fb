/* cuda_check.h - turn CUDA errors into tsr_status at the call site (never exit). */
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

#endif
