#ifndef TSR_CUDA_ADD_RMSNORM_CUH
#define TSR_CUDA_ADD_RMSNORM_CUH
#include <stddef.h>
#include <cuda_runtime.h>
#include "common/tsr_status.h"
#ifdef __cplusplus
extern "C" {
#endif
/* kernels.h's add_rmsnorm: residual += x, out = rmsnorm(residual) * w.  Device pointers.
 * Launches on `stream`; returns TSR_E_CUDA on a launch error. */
tsr_status tsr_cuda_add_rmsnorm(cudaStream_t stream, float *out, float *residual, const float *x, const float *w,
                                size_t rows, size_t dim, float eps);
#ifdef __cplusplus
}
#endif
#endif
