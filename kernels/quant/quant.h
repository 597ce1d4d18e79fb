/* quant.h - the storage formats of dtype.h, decoded to float32 by scalar reference code.
 *
 * Each format has one function that widens a row of it, written from the format's
 * definition, plainly, like cpu/ref.c: the specification a SIMD or CUDA dequantizer (or
 * a matmul reading the blocks in place) is tested against.  Where a format has a single
 * value per byte pattern (fp8, e2m1, f16) the conversions are exact; the block formats
 * compute each element as the comment over its function says, in float32, in that order,
 * so the result is reproducible bit for bit.
 *
 * Layouts (bytes little-endian, only byte alignment assumed: reads go through bytes):
 *   f16, bf16     2 bytes per element.
 *   q8_0 .. q6_K  ggml's blocks, as GGUF files store them (gguf.c has each layout).
 *   fp8_e4m3      OCP FP8 E4M3 ("e4m3fn"): S.EEEE.MMM, bias 7, subnormals at E = 0, no
 *                 infinities, S.1111.111 is NaN, largest finite 448.
 *   fp8_e5m2      OCP FP8 E5M2: S.EEEEE.MM, bias 15, E = 31 holds inf (M = 0) and NaN;
 *                 largest finite 57344.  Bit for bit the top byte of an IEEE binary16.
 *   nvfp4         blocks of 16 elements in 9 bytes: byte 0 is the block's e4m3 scale,
 *                 bytes 1..8 hold the 16 e2m1 codes, element 2i in the low nibble of byte
 *                 1+i and 2i+1 in its high nibble (the nibble order of NVIDIA's packed
 *                 uint8 tensors).  e2m1 is S.EE.M, bias 1: the 8 magnitudes 0, 0.5, 1,
 *                 1.5, 2, 3, 4, 6.  A tensor carries one float32 global scale besides:
 *                 x = e2m1 * scale * global.  The row function takes the global scale;
 *                 tsr_dequant_row, which has no place for it, uses 1.
 *                 tsr_dequant_nvfp4_planar reads the layout checkpoints ship (ModelOpt:
 *                 the packed codes and the scales as two arrays).
 *
 * Functions return TSR_E_INVAL for a NULL pointer (src may be NULL when n == 0) or an n
 * that is not a multiple of the format's block, having written nothing.  No state: any
 * thread.  Non-logging. */
#ifndef TSR_KERNELS_QUANT_H
#define TSR_KERNELS_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- scalar conversions (exact widening; rounding narrowing as stated) ---------------- */

/* IEEE binary16 bits -> float32, exact (inf and NaN kept, subnormals widened). */
float tsr_f16_to_f32(uint16_t h);
/* fp8 e4m3fn bits -> float32, exact; S.1111.111 gives NaN (of the code's sign). */
float tsr_fp8_e4m3_to_f32(uint8_t v);
/* float32 -> fp8 e4m3fn: round to nearest, ties to even, saturating: a magnitude past
 * 448 after rounding (infinity included) gives +-448; NaN gives S.1111.111; values below
 * half the smallest subnormal (2^-10) give a zero of x's sign. */
uint8_t tsr_f32_to_fp8_e4m3(float x);
/* fp8 e5m2 bits -> float32, exact; inf and NaN as IEEE. */
float tsr_fp8_e5m2_to_f32(uint8_t v);
/* float32 -> fp8 e5m2, IEEE style: round to nearest, ties to even; a magnitude at or past
 * 61440 (halfway from 57344 to the next power of two) gives inf; NaN gives a quiet NaN
 * (S.11111.10) of x's sign. */
uint8_t tsr_f32_to_fp8_e5m2(float x);
/* The same, saturating as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2) that
 * vLLM's KV cache stores with: a magnitude past 57344 after rounding (infinity included)
 * gives +-57344; NaN as above. */
uint8_t tsr_f32_to_fp8_e5m2_sat(float x);
/* e2m1 code (low 4 bits of `code`; the rest ignored) -> float32: +-{0, 0.5, 1, 1.5, 2, 3,
 * 4, 6}, exact. */
float tsr_e2m1_to_f32(uint8_t code);
/* float32 -> e2m1 code: round |x| to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1,
 * 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4: ModelOpt's _cast_fp4), saturating at 6
 * (infinity included); sign bit 3 from x (-0 -> 0x8).  NaN gives 0x7 (no NaN in e2m1). */
uint8_t tsr_f32_to_e2m1(float x);

/* The 6-bit scale and min of sub-block j (0..7) packed in the 12 scale bytes `s` of a
 * Q4_K/Q5_K super-block: sub-blocks 0..3 in the low 6 bits of bytes j and j+4; 4..7 in
 * the nibbles of bytes j+4 with their top two bits in the high bits of bytes j-4 and j.
 * Inline: the int8 matmul's weight unpacking (cpu/qmm*.c) calls it per sub-block. */
static inline void tsr_gguf_k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
        if (j < 4) {
                *sc = s[j] & 63;
                *mn = s[j + 4] & 63;
        } else {
                *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
                *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
}

/* ---- rows: n elements of a format -> out (n,) float32 --------------------------------- */

/* Any dtype of dtype.h (NVFP4 with a global scale of 1).  TSR_E_INVAL also for a dtype
 * out of range. */
tsr_status tsr_dequant_row(tsr_dtype t, const void *src, size_t n, float *out);

tsr_status tsr_dequant_f32(const void *src, size_t n, float *out);     /* a copy */
tsr_status tsr_dequant_f16(const void *src, size_t n, float *out);
tsr_status tsr_dequant_bf16(const void *src, size_t n, float *out);
/* GGUF blocks (gguf.c); n a multiple of 32 (q*_0, q*_1) or 256 (q*_K). */
tsr_status tsr_dequant_q8_0(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q4_0(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q4_1(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q5_0(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q5_1(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q4_k(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q5_k(const void *src, size_t n, float *out);
tsr_status tsr_dequant_q6_k(const void *src, size_t n, float *out);
/* fp8 (fp8.c): one byte per element. */
tsr_status tsr_dequant_fp8_e4m3(const void *src, size_t n, float *out);
tsr_status tsr_dequant_fp8_e5m2(const void *src, size_t n, float *out);
/* NVFP4 (nvfp4.c), n a multiple of 16.  Element i of block b is
 *     out = (e2m1(code_i) * e4m3(scale_b)) * global_scale
 * in float32: the first product is exact (a 2-bit by a 4-bit significand), so the only
 * rounding is the multiplication by global_scale.  A NaN scale gives NaN elements. */
tsr_status tsr_dequant_nvfp4(const void *src, size_t n, float global_scale, float *out);
/* The same values from the planar layout: codes (n/2 bytes, element 2i low nibble of
 * byte i) and scales (n/16 e4m3 bytes, one per 16 consecutive elements). */
tsr_status tsr_dequant_nvfp4_planar(const uint8_t *codes, const uint8_t *scales, size_t n, float global_scale,
                                    float *out);

#ifdef __cplusplus
}
#endif

#endif
