/* quant/nvfp4.c - NVFP4: 16 e2m1 values per block with an fp8 e4m3 block scale and a
 * float32 scale per tensor, widened to float32 (quant.h has the layouts and the order of
 * the two multiplications). */
#include "kernels/quant/quant.h"

/* 16 codes (8 bytes, low nibble first) with one scale -> y (16,). */
static void deq_nvfp4_block(const uint8_t *codes, uint8_t scale, float global_scale, float *y) {
        float s = tsr_fp8_e4m3_to_f32(scale);
        for (int i = 0; i < 8; i++) {
                y[2 * i] = (tsr_e2m1_to_f32(codes[i] & 0x0f) * s) * global_scale;
                y[2 * i + 1] = (tsr_e2m1_to_f32(codes[i] >> 4) * s) * global_scale;
        }
}

tsr_status tsr_dequant_nvfp4(const void *src, size_t n, float global_scale, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n) || n % 16 != 0)
                return TSR_E_INVAL;
        for (size_t b = 0; b < n / 16; b++)
                deq_nvfp4_block(p + 9 * b + 1, p[9 * b], global_scale, out + 16 * b);
        return TSR_OK;
}

tsr_status tsr_dequant_nvfp4_planar(const uint8_t *codes, const uint8_t *scales, size_t n, float global_scale,
                                    float *out) {
        if (!out || ((!codes || !scales) && n) || n % 16 != 0)
                return TSR_E_INVAL;
        for (size_t b = 0; b < n / 16; b++)
                deq_nvfp4_block(codes + 8 * b, scales[b], global_scale, out + 16 * b);
        return TSR_OK;
}
