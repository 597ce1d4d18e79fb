/* qmm_amx.h - the int8 matmul on GGUF blocks with AMX-INT8 tiles (cpu/qmm_amx.c),
 * one of cpu/qmm.c's paths for a batch of activation rows.  Internal to kernels/cpu. */
#ifndef TSR_KERNELS_CPU_QMM_AMX_H
#define TSR_KERNELS_CPU_QMM_AMX_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

/* Activation rows are taken in tiles of this many; the caller pads xq to a multiple. */
#define TSR_QMM_AMX_ROWS 16

/* W (d, n) of type t (any of qmm.h's: tsr_qmm_supported; row_bytes per row) @ the
 * quantized activations xq (tsr_qmm_quantize_row's rows, act_bytes apart) -> out (rows,
 * d), bitwise tsr_qmm_ref's result.  xq holds rows rounded up to TSR_QMM_AMX_ROWS rows,
 * the rows past `rows` all zero bytes.  Weight rows split over `pool` in tasks of 16.
 * Only after tsr_amx_int8() returned true; arguments checked by the caller.
 * TSR_E_NOMEM when a thread's scratch or the K blocks' activation sums cannot be
 * allocated (out then partly written). */
tsr_status tsr_qmm_amx(tsr_pool *pool, float *out, const uint8_t *xq, size_t act_bytes, const void *w,
                       size_t row_bytes, tsr_dtype t, size_t rows, size_t n, size_t d);

#endif
