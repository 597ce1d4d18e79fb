/* cpu/qmm.h - the fast CPU backend's matmul on GGUF blocks (cpu/qmm.c): quant/qmm.h's
 * computation with AVX2 integer dot products, threads over weight rows.  Internal to
 * kernels/ (cpu/fast.c dispatches to it on the weight dtype). */
#ifndef TSR_KERNELS_CPU_QMM_H
#define TSR_KERNELS_CPU_QMM_H

#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

/* W (d, n) of `t` @ x (rows, n) -> out (rows, d), bitwise tsr_qmm_ref's result for every
 * ISA, thread count and batch.  Below AVX2 it is tsr_qmm_ref itself.  Errors as
 * tsr_qmm_ref.  Thread: the backend's driving thread, with `pool`'s helpers. */
tsr_status tsr_cpu_qmm(tsr_pool *pool, tsr_cpu_isa isa, float *out, const float *x, const void *w, tsr_dtype t,
                       size_t rows, size_t n, size_t d);

#endif
