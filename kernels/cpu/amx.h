/* amx.h - the AMX-BF16 bf16 matmul of the fast CPU backend (cpu/amx.c, used by cpu/fast.c).
 *
 * Internal to kernels/cpu: fast.c detects AMX once (tsr_amx_init) and, when a backend's
 * ISA is TSR_CPU_ISA_AMX_BF16, sends every bf16 matmul (tsr_backend_matmul with
 * TSR_DTYPE_BF16) here, whatever the number of rows, so one element's reduction order
 * never depends on the batch (kernels.h). */
#ifndef TSR_KERNELS_CPU_AMX_H
#define TSR_KERNELS_CPU_AMX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/cpu/pool.h"

/* LDTILECFG's 64-byte operand, palette 1: per tile its bytes per row and its rows. */
struct tsr_amx_tilecfg {
        uint8_t palette;
        uint8_t start_row;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
};

/* True when this CPU has AMX-TILE and AMX-BF16 and Linux granted this process the tile
 * data state (arch_prctl ARCH_REQ_XCOMP_PERM; the grant covers every thread of the
 * process).  Asks the kernel once; later calls return the first answer.  Any thread. */
bool tsr_amx_init(void);

/* True when tsr_amx_init() is and the CPU also has AMX-INT8 (TDPBSSD / TDPBSUD): the
 * int8 matmul's tiles (cpu/qmm_amx.c) then serve a backend at TSR_CPU_ISA_AMX_BF16.
 * Any thread. */
bool tsr_amx_int8(void);

/* The bf16 matmul (kernels.h) on AMX tiles: out (rows, d) = b(x) (rows, n) @ W^T, W (d, n) bf16.
 * Arguments already checked by the caller (non-NULL, n, d, rows >= 1, rows * n fits).
 * Splits the weight rows over `pool`, the backend's (NULL: inline); every task loads the tile
 * configuration and releases the tiles itself.  Only after tsr_amx_init() returned true.
 * TSR_E_NOMEM when the packed copy of x cannot be allocated (nothing written then). */
tsr_status tsr_amx_matmul_bf16(tsr_pool *pool, float *out, const float *x, const uint16_t *w, size_t rows, size_t n,
                               size_t d);

#endif
