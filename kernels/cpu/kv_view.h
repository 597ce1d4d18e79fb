/* kv_view.h - the paged-KV helpers ref.c and fast.c share (kernels.h, tsr_kv_view).
 * Internal to kernels/cpu. */
#ifndef TSR_KERNELS_CPU_KV_VIEW_H
#define TSR_KERNELS_CPU_KV_VIEW_H

#include <stdbool.h>
#include <stddef.h>

#include "kernels/kernels.h"

/* The view is usable for tokens 0 .. n_tokens - 1: non-NULL arrays, non-zero sizes, a
 * table long enough, and every block id it uses inside the arrays. */
static inline bool kv_view_ok(const tsr_kv_view *kv, size_t n_tokens) {
        if (!kv || !kv->k || !kv->v || !kv->block_table || kv->block_size == 0 || kv->n_kv_heads == 0 ||
            kv->head_dim == 0)
                return false;
        if (n_tokens > kv->n_table * kv->block_size)
                return false;
        for (size_t b = 0; b * kv->block_size < n_tokens; b++)
                if (kv->block_table[b] >= kv->n_blocks)
                        return false;
        return true;
}

/* Offset, in floats, of token t's row in kv->k and kv->v. */
static inline size_t kv_row(const tsr_kv_view *kv, size_t t) {
        size_t row = (size_t)kv->block_table[t / kv->block_size] * kv->block_size + t % kv->block_size;
        return row * kv->n_kv_heads * kv->head_dim;
}

#endif
