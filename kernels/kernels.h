/* kernels.h - the operator interface the forward pass is written against.
 *
 * One vtable per backend, in the style of ggml's backend interface.  cpu/ref.c is the
 * specification: scalar, plain, with shape comments.  Fast CPU paths and CUDA kernels
 * are judged against it (tests/kernels).  Functions return a tsr_status and never
 * exit or abort on bad input.
 *
 * Only the ops the skeleton needs exist yet; the engine issue adds matmul, rope,
 * attention, silu_mul, softmax (docs/kernels.md: "adding an op"). */
#ifndef TSR_KERNELS_H
#define TSR_KERNELS_H

#include <stddef.h>
#include "common/tsr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tsr_kernels_ops {
        const char *name;
        /* out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w[:]
         * x (rows, dim), w (dim,) -> out (rows, dim); out may alias x.
         * Pointers are in the backend's memory (host for cpu, device for cuda). */
        tsr_status (*rmsnorm)(float *out, const float *x, const float *w, size_t rows, size_t dim, float eps);
        /* Wait for queued work (no-op on the CPU). */
        tsr_status (*sync)(void);
} tsr_kernels_ops;

/* The scalar reference backend.  Always available. */
const tsr_kernels_ops *tsr_kernels_cpu_ref(void);

/* The CUDA backend, or NULL when not built or no device is present. */
const tsr_kernels_ops *tsr_kernels_cuda(void);

#ifdef __cplusplus
}
#endif

#endif
