/* cpu/fpmm.h - the fast CPU backend's matmul on fp8 e4m3 and NVFP4 weights (cpu/fpmm.c):
 * quant/fpmm.h's computation with AVX2, threads over weight rows.  Internal to kernels/
 * (cpu/fast.c dispatches to it on the weight dtype). */
#ifndef TSR_KERNELS_CPU_FPMM_H
#define TSR_KERNELS_CPU_FPMM_H

#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

/* W (d, n) of `t` with scales `s` @ x (rows, n) -> out (rows, d), bitwise tsr_fpmm_ref's
 * result for every ISA, thread count and batch.  Below AVX2 it is tsr_fpmm_ref itself.
 * Errors as tsr_fpmm_ref.  Thread: the backend's driving thread, with `pool`'s helpers. */
tsr_status tsr_cpu_fpmm(tsr_pool *pool, tsr_cpu_isa isa, float *out, const float *x, const void *w, tsr_dtype t,
                        const tsr_matmul_scales *s, size_t rows, size_t n, size_t d);

#endif
