/* Built instead of kernels/cuda when CUDA is disabled or nvcc is absent. */
#include <stddef.h>
#include "kernels/kernels.h"

const tsr_kernels_ops *tsr_kernels_cuda(void) { return NULL; }
