/* dtype.c - dtype.h's table.  Block sizes and byte counts are the formats' definitions:
 * GGUF's from the ggml type table (gguf docs), NVFP4's from our block layout
 * (kernels/quant/quant.h: one e4m3 scale byte then eight bytes of packed e2m1). */
#include "kernels/dtype.h"

static const tsr_dtype_info dtype_table[TSR_DTYPE_COUNT] = {
        [TSR_DTYPE_F32] = {"f32", 1, 4, false},
        [TSR_DTYPE_BF16] = {"bf16", 1, 2, false},
        [TSR_DTYPE_F16] = {"f16", 1, 2, false},
        [TSR_DTYPE_Q8_0] = {"q8_0", 32, 34, true},
        [TSR_DTYPE_Q4_0] = {"q4_0", 32, 18, true},
        [TSR_DTYPE_Q4_1] = {"q4_1", 32, 20, true},
        [TSR_DTYPE_Q5_0] = {"q5_0", 32, 22, true},
        [TSR_DTYPE_Q5_1] = {"q5_1", 32, 24, true},
        [TSR_DTYPE_Q4_K] = {"q4_K", 256, 144, true},
        [TSR_DTYPE_Q5_K] = {"q5_K", 256, 176, true},
        [TSR_DTYPE_Q6_K] = {"q6_K", 256, 210, true},
        [TSR_DTYPE_FP8_E4M3] = {"fp8_e4m3", 1, 1, false},
        [TSR_DTYPE_FP8_E5M2] = {"fp8_e5m2", 1, 1, false},
        [TSR_DTYPE_NVFP4] = {"nvfp4", 16, 9, true},
};

const tsr_dtype_info *tsr_dtype_get_info(tsr_dtype t) {
        return (unsigned)t < TSR_DTYPE_COUNT ? &dtype_table[t] : NULL;
}

const char *tsr_dtype_name(tsr_dtype t) {
        const tsr_dtype_info *i = tsr_dtype_get_info(t);
        return i ? i->name : "?";
}

tsr_status tsr_dtype_row_bytes(tsr_dtype t, size_t n, size_t *ret) {
        const tsr_dtype_info *i = tsr_dtype_get_info(t);

        if (!i || !ret || n % i->block_elems != 0)
                return TSR_E_INVAL;
        size_t blocks = n / i->block_elems;
        if (blocks > SIZE_MAX / i->block_bytes)
                return TSR_E_LIMIT;
        *ret = blocks * i->block_bytes;
        return TSR_OK;
}
