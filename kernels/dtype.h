/* dtype.h - the element formats Tessera stores tensors in, and one table describing them.
 *
 * A dtype is either a scalar format (one element per "block": f32, bf16, f16, fp8) or a
 * block format, where a fixed number of elements share a few bytes of scales (the GGUF
 * block types, NVFP4).  A row of n elements of a block format is n / block_elems blocks
 * back to back, so a row's size in bytes is (n / block_elems) * block_bytes and n must be
 * a multiple of block_elems.  The byte layout of each block format and its scalar
 * dequantization are in kernels/quant/ (quant.h).
 *
 * The enum's values are Tessera's own, never written to a file (F32 = 0 and BF16 = 1
 * kept their values from before the table); a file format's type tags (ggml's,
 * safetensors') are mapped to these by its loader.  At most 32: a backend keeps one bit
 * per dtype in a uint32_t (backend.c asserts it).  Non-logging, no state: any thread. */
#ifndef TSR_KERNELS_DTYPE_H
#define TSR_KERNELS_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tsr_dtype {
        TSR_DTYPE_F32 = 0,              /* float32 */
        TSR_DTYPE_BF16 = 1,             /* bfloat16 bits (uint16_t) */
        TSR_DTYPE_F16 = 2,              /* IEEE binary16 bits (uint16_t) */
        /* GGUF block types (ggml's layouts, kernels/quant/gguf.c) */
        TSR_DTYPE_Q8_0 = 3,             /* 32 elements: f16 d, int8 q[32] */
        TSR_DTYPE_Q4_0 = 4,             /* 32: f16 d, 4-bit q[32] */
        TSR_DTYPE_Q4_1 = 5,             /* 32: f16 d, f16 m, 4-bit q[32] */
        TSR_DTYPE_Q5_0 = 6,             /* 32: f16 d, 5-bit q[32] */
        TSR_DTYPE_Q5_1 = 7,             /* 32: f16 d, f16 m, 5-bit q[32] */
        TSR_DTYPE_Q4_K = 8,             /* 256: f16 d, dmin, 6-bit sub-block scales/mins, 4-bit q */
        TSR_DTYPE_Q5_K = 9,             /* 256: as Q4_K with a fifth bit */
        TSR_DTYPE_Q6_K = 10,            /* 256: f16 d, int8 sub-block scales, 6-bit q */
        /* 8-bit floats (OCP FP8, kernels/quant/fp8.c) */
        TSR_DTYPE_FP8_E4M3 = 11,        /* e4m3fn: bias 7, no infinities, NaN = S.1111.111, max 448 */
        TSR_DTYPE_FP8_E5M2 = 12,        /* e5m2: bias 15, IEEE-like with inf and NaN, max 57344 */
        /* NVIDIA's 4-bit float (kernels/quant/nvfp4.c) */
        TSR_DTYPE_NVFP4 = 13,           /* 16 e2m1 values with one e4m3 scale; a float32 scale per tensor */
        TSR_DTYPE_COUNT
} tsr_dtype;

/* What a dtype's storage looks like.  Immutable. */
typedef struct tsr_dtype_info {
        const char *name;               /* "f32", "q4_K", "fp8_e4m3", "nvfp4", ... */
        uint32_t block_elems;           /* elements per block; 1 for a scalar format */
        uint32_t block_bytes;           /* bytes per block */
        bool quantized;                 /* a block format with scales (dequantize before use) */
} tsr_dtype_info;

/* A dtype a KV cache may store scaled, one byte per element (--kv-cache-dtype fp8 /
 * fp8_e4m3, fp8_e5m2; kernels.h's tsr_kv_view). */
static inline bool tsr_dtype_is_fp8(tsr_dtype t) { return t == TSR_DTYPE_FP8_E4M3 || t == TSR_DTYPE_FP8_E5M2; }
/* What a paged KV cache may hold (kernels.h, tsr_kv_view): f32, bf16, fp8 e4m3 / e5m2. */
static inline bool tsr_dtype_is_kv(tsr_dtype t) {
        return t == TSR_DTYPE_F32 || t == TSR_DTYPE_BF16 || tsr_dtype_is_fp8(t);
}

/* The entry for `t`; NULL for a value out of range.  Any thread. */
const tsr_dtype_info *tsr_dtype_get_info(tsr_dtype t);
/* Name of a dtype (the table's); "?" for a value out of range. */
const char *tsr_dtype_name(tsr_dtype t);
/* Bytes of n elements of `t` into *ret.  TSR_E_INVAL for a dtype out of range or n not a
 * multiple of the block size; TSR_E_LIMIT when the size overflows size_t. */
tsr_status tsr_dtype_row_bytes(tsr_dtype t, size_t n, size_t *ret);

#ifdef __cplusplus
}
#endif

#endif
