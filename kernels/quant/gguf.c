/* quant/gguf.c - ggml's block formats (GGUF tensors) and the 16-bit floats, widened to
 * float32: the scalar reference (quant.h).
 *
 * Block layouts follow the GGUF spec (ggml docs/gguf.md and the ggml type table); each
 * dequantizer is checked against gguf-py's on random blocks (tests/unit/test_forward.c,
 * tests/fixtures/forward/dequant.json) and against a second decoding written from the
 * layouts in tests/kernels/test_ops.c.  Moved here from worker/model/llama_weights.c unchanged in
 * arithmetic: the float32 operations and their order are what the forward goldens were
 * recorded with, so they must stay exactly these.  All reads go through bytes: nothing
 * promises more than byte alignment inside a block. */
#include <string.h>

#include "kernels/quant/quant.h"

/* ---- scalar formats -------------------------------------------------------------- */

/* IEEE 754 binary16 -> binary32, exactly (every half is a float). */
float tsr_f16_to_f32(uint16_t h) {
        uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
        float f;

        if (exp == 0x1f) {                      /* inf or NaN */
                bits = sign | 0x7f800000u | (mant << 13);
        } else if (exp != 0) {                  /* normal: rebias 15 -> 127 */
                bits = sign | ((exp + 112) << 23) | (mant << 13);
        } else if (mant == 0) {                 /* signed zero */
                bits = sign;
        } else {                                /* subnormal half: mant * 2^-24, exact in float */
                f = (float)mant * 0x1p-24f;
                memcpy(&bits, &f, 4);
                bits |= sign;
        }
        memcpy(&f, &bits, 4);
        return f;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static float rd_f16(const uint8_t *p) { return tsr_f16_to_f32(rd16(p)); }

/* ---- block formats (QK = elements per block) ----------------------------------- */

/* Q8_0: f16 d; int8 q[32].  x = d * q */
static void deq_q8_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        for (int j = 0; j < 32; j++)
                y[j] = d * (float)(int8_t)b[2 + j];
}

/* Q4_0: f16 d; u8 qs[16] (low nibbles are elements 0..15, high nibbles 16..31).
 * x = d * (q - 8) */
static void deq_q4_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((qs[j] & 0x0f) - 8);
                y[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
}

/* Q4_1: f16 d, f16 m; u8 qs[16].  x = d * q + m */
static void deq_q4_1(const uint8_t *b, float *y) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
                y[j] = d * (float)(qs[j] & 0x0f) + m;
                y[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
}

/* Q5_0: f16 d; u32 qh (bit j is the fifth bit of element j); u8 qs[16].  x = d * (q - 16) */
static void deq_q5_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
                int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
        }
}

/* Q5_1: f16 d, f16 m; u32 qh; u8 qs[16].  x = d * q + m */
static void deq_q5_1(const uint8_t *b, float *y) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
                int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                y[j] = d * (float)lo + m;
                y[j + 16] = d * (float)hi + m;
        }
}

/* Q4_K (256 elements): f16 d, f16 dmin; u8 scales[12]; u8 qs[128].
 * Eight sub-blocks of 32; each 64-element chunk uses the low nibbles of 32 bytes for its
 * first sub-block and the high nibbles for its second.  x = (d*sc) * q - (dmin*mn) */
static void deq_q4_k(const uint8_t *b, float *y) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *scales = b + 4, *qs = b + 16;
        for (int c = 0; c < 4; c++) {
                int sc0, mn0, sc1, mn1;
                tsr_gguf_k_scale_min(2 * c, scales, &sc0, &mn0);
                tsr_gguf_k_scale_min(2 * c + 1, scales, &sc1, &mn1);
                float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
                float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
                for (int l = 0; l < 32; l++) {
                        y[64 * c + l] = d0 * (float)(qs[32 * c + l] & 0x0f) - m0;
                        y[64 * c + 32 + l] = d1 * (float)(qs[32 * c + l] >> 4) - m1;
                }
        }
}

/* Q5_K (256): f16 d, f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128].  As Q4_K, with the
 * fifth bit of element l of sub-block s in bit s of qh[l]. */
static void deq_q5_k(const uint8_t *b, float *y) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
        for (int c = 0; c < 4; c++) {
                int sc0, mn0, sc1, mn1;
                tsr_gguf_k_scale_min(2 * c, scales, &sc0, &mn0);
                tsr_gguf_k_scale_min(2 * c + 1, scales, &sc1, &mn1);
                float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
                float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
                for (int l = 0; l < 32; l++) {
                        int lo = (qs[32 * c + l] & 0x0f) | (((qh[l] >> (2 * c)) & 1) << 4);
                        int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                        y[64 * c + l] = d0 * (float)lo - m0;
                        y[64 * c + 32 + l] = d1 * (float)hi - m1;
                }
        }
}

/* Q6_K (256): u8 ql[128] (low 4 bits); u8 qh[64] (high 2 bits); int8 scales[16]; f16 d.
 * Two halves of 128; in half h, element 32*k + l (k = 0..3, l = 0..31) takes its low bits
 * from nibble k/2 of ql[64h + l + 32*(k%2)], its high bits from bits 2k..2k+1 of
 * qh[32h + l], and scale scales[8h + 2k + l/16].  x = d * sc * (q - 32) */
static void deq_q6_k(const uint8_t *b, float *y) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = rd_f16(b + 208);
        for (int h = 0; h < 2; h++) {
                for (int k = 0; k < 4; k++) {
                        for (int l = 0; l < 32; l++) {
                                uint8_t lb = ql[64 * h + l + 32 * (k % 2)];
                                int lo = k < 2 ? (lb & 0x0f) : (lb >> 4);
                                int q = (lo | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
                                float sc = (float)scales[8 * h + 2 * k + l / 16];
                                y[128 * h + 32 * k + l] = d * sc * (float)q;
                        }
                }
        }
}

/* ---- rows ------------------------------------------------------------------------- */

/* n elements of blocks of qk elements in `bytes` bytes each, through block_fn. */
static tsr_status deq_blocks(void (*block_fn)(const uint8_t *, float *), uint32_t qk, uint32_t bytes,
                             const void *src, size_t n, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n) || n % qk != 0)
                return TSR_E_INVAL;
        for (size_t b = 0; b < n / qk; b++)
                block_fn(p + b * bytes, out + b * qk);
        return TSR_OK;
}

tsr_status tsr_dequant_f32(const void *src, size_t n, float *out) {
        if (!out || (!src && n))
                return TSR_E_INVAL;
        if (n)
                memcpy(out, src, n * sizeof(float));
        return TSR_OK;
}

tsr_status tsr_dequant_f16(const void *src, size_t n, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n))
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++)
                out[i] = rd_f16(p + 2 * i);
        return TSR_OK;
}

/* bfloat16 is the top half of a float32. */
tsr_status tsr_dequant_bf16(const void *src, size_t n, float *out) {
        const uint8_t *p = src;

        if (!out || (!src && n))
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++) {
                uint32_t bits = (uint32_t)rd16(p + 2 * i) << 16;
                memcpy(&out[i], &bits, 4);
        }
        return TSR_OK;
}

/* The block sizes here are dtype.c's table's (a test checks the two agree). */
tsr_status tsr_dequant_q8_0(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q8_0, 32, 34, src, n, out);
}

tsr_status tsr_dequant_q4_0(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q4_0, 32, 18, src, n, out);
}

tsr_status tsr_dequant_q4_1(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q4_1, 32, 20, src, n, out);
}

tsr_status tsr_dequant_q5_0(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q5_0, 32, 22, src, n, out);
}

tsr_status tsr_dequant_q5_1(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q5_1, 32, 24, src, n, out);
}

tsr_status tsr_dequant_q4_k(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q4_k, 256, 144, src, n, out);
}

tsr_status tsr_dequant_q5_k(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q5_k, 256, 176, src, n, out);
}

tsr_status tsr_dequant_q6_k(const void *src, size_t n, float *out) {
        return deq_blocks(deq_q6_k, 256, 210, src, n, out);
}


tsr_status tsr_dequant_row(tsr_dtype t, const void *src, size_t n, float *out) {
        switch (t) {
        case TSR_DTYPE_F32: return tsr_dequant_f32(src, n, out);
        case TSR_DTYPE_BF16: return tsr_dequant_bf16(src, n, out);
        case TSR_DTYPE_F16: return tsr_dequant_f16(src, n, out);
        case TSR_DTYPE_Q8_0: return tsr_dequant_q8_0(src, n, out);
        case TSR_DTYPE_Q4_0: return tsr_dequant_q4_0(src, n, out);
        case TSR_DTYPE_Q4_1: return tsr_dequant_q4_1(src, n, out);
        case TSR_DTYPE_Q5_0: return tsr_dequant_q5_0(src, n, out);
        case TSR_DTYPE_Q5_1: return tsr_dequant_q5_1(src, n, out);
        case TSR_DTYPE_Q4_K: return tsr_dequant_q4_k(src, n, out);
        case TSR_DTYPE_Q5_K: return tsr_dequant_q5_k(src, n, out);
        case TSR_DTYPE_Q6_K: return tsr_dequant_q6_k(src, n, out);
        case TSR_DTYPE_FP8_E4M3: return tsr_dequant_fp8_e4m3(src, n, out);
        case TSR_DTYPE_FP8_E5M2: return tsr_dequant_fp8_e5m2(src, n, out);
        case TSR_DTYPE_NVFP4: return tsr_dequant_nvfp4(src, n, 1.0f, out);
        case TSR_DTYPE_COUNT: break;
        }
        return TSR_E_INVAL;
}
