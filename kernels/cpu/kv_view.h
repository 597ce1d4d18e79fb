/* kv_view.h - the paged-KV helpers ref.c and fast.c share (kernels.h, tsr_kv_view).
 * Internal to kernels/cpu. */
#ifndef TSR_KERNELS_CPU_KV_VIEW_H
#define TSR_KERNELS_CPU_KV_VIEW_H

#include <float.h>
#include <stdbool.h>
#include <stddef.h>

#include "kernels/kernels.h"
#include "kernels/quant/quant.h"

/* The view is usable for tokens 0 .. n_tokens - 1: non-NULL arrays, non-zero sizes, a
 * table long enough, and every block id it uses inside the arrays. */
static inline bool kv_view_ok(const tsr_kv_view *kv, size_t n_tokens) {
        if (!kv || !kv->k || !kv->v || !kv->block_table || kv->block_size == 0 || kv->n_kv_heads == 0 ||
            kv->head_dim == 0)
                return false;
        if (tsr_dtype_is_fp8(kv->dtype)) {
                /* the negation catches NaN too */
                if (!(kv->k_scale > 0.0f && kv->k_scale <= FLT_MAX && kv->v_scale > 0.0f && kv->v_scale <= FLT_MAX))
                        return false;
        } else if (kv->dtype != TSR_DTYPE_F32 && kv->dtype != TSR_DTYPE_BF16) {
                return false;
        }
        if (n_tokens > kv->n_table * kv->block_size)
                return false;
        for (size_t b = 0; b * kv->block_size < n_tokens; b++)
                if (kv->block_table[b] >= kv->n_blocks)
                        return false;
        return true;
}

/* Offset, in elements (floats, bf16 values or fp8 bytes), of token t's row in the K and
 * V arrays. */
static inline size_t kv_row(const tsr_kv_view *kv, size_t t) {
        size_t row = (size_t)kv->block_table[t / kv->block_size] * kv->block_size + t % kv->block_size;
        return row * kv->n_kv_heads * kv->head_dim;
}

/* Elements [off, off + n) of an fp8 array of `dtype` (e4m3 or e5m2) as float32:
 * float(code) * scale, the one dequantization ref.c and fast.c both use, so their
 * attention reads the same values. */
static inline void kv_fp8_load(tsr_dtype dtype, float *dst, const uint8_t *src, size_t n, float scale) {
        for (size_t i = 0; i < n; i++)
                dst[i] = (dtype == TSR_DTYPE_FP8_E5M2 ? tsr_fp8_e5m2_to_f32(src[i]) : tsr_fp8_e4m3_to_f32(src[i])) *
                         scale;
}

/* Rows of an fp8 array: e4m3(x / scale) or e5m2(x / scale), round to nearest even,
 * saturating (vLLM's __NV_SATFINITE stores). */
static inline void kv_fp8_store(tsr_dtype dtype, uint8_t *dst, const float *src, size_t n, float scale) {
        for (size_t i = 0; i < n; i++)
                dst[i] = dtype == TSR_DTYPE_FP8_E5M2 ? tsr_f32_to_fp8_e5m2_sat(src[i] / scale)
                                                     : tsr_f32_to_fp8_e4m3(src[i] / scale);
}

/* Elements of a bf16 array widened to float32, and rows stored as bf16 (round to
 * nearest even: tsr_f32_to_bf16). */
static inline void kv_bf16_load(float *dst, const uint16_t *src, size_t n) {
        for (size_t i = 0; i < n; i++)
                dst[i] = tsr_bf16_to_f32(src[i]);
}

static inline void kv_bf16_store(uint16_t *dst, const float *src, size_t n) {
        for (size_t i = 0; i < n; i++)
                dst[i] = tsr_f32_to_bf16(src[i]);
}

#endif
