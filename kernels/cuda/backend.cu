// backend.cu - the CUDA tsr_kernels_ops table.  tsr_kernels_cuda() returns NULL when
// no device is present, so callers fall back to the CPU backend.
#include "kernels/kernels.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rmsnorm.cuh"

static tsr_status cuda_sync(void) {
        TSR_CUDA_TRY(cudaDeviceSynchronize());
        return TSR_OK;
}

static const tsr_kernels_ops cuda_ops = {
        "cuda",
        tsr_cuda_rmsnorm,
        cuda_sync,
};

extern "C" const tsr_kernels_ops *tsr_kernels_cuda(void) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
                return NULL;
        return &cuda_ops;
}
