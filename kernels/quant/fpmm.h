/* fpmm.h - matmul on stored fp8 e4m3 and NVFP4 weights with per-tensor scales (NVIDIA
 * ModelOpt's FP8 and NVFP4 checkpoints, models.md §4): the scalar reference and the
 * activation quantizers the fast version shares with it.  Internal to kernels/
 * (cpu/ref.c, cpu/fpmm.c); callers reach it through tsr_backend_matmul_scaled.
 *
 * The weights stay in their stored bytes; every kernel decodes them in registers (or one
 * row at a time into a thread's scratch), never into a float copy of the matrix.
 * W (d, n) @ x[r] (n,) -> out[r] (d,); s = the tsr_matmul_scales (weight, input).
 *
 * FP8 e4m3, s.input > 0 (W8A8 static, vLLM ModelOptFp8LinearMethod):
 *     xq_k  = e4m3(x_k / s.input)             round to nearest even, saturating at +-448
 *                                              (tsr_f32_to_fp8_e4m3; NaN stays NaN)
 *     acc   = sum_k xq_k * e4m3(w_k)          each product exact in float32 (two 4-bit
 *                                              significands); cpu/ref.c's eight lanes: lane j
 *                                              adds k = j, j+8, ..., then the pair tree
 *     out   = acc * (s.input * s.weight)
 * FP8 e4m3, s.input == 0 (weight-only): acc = the same lanes over x_k * e4m3(w_k);
 *     out = acc * s.weight.
 *
 * NVFP4 (dtype.h's 9-byte blocks: e4m3 scale, then 16 e2m1 codes), s.weight = the global
 * weight_scale_2.  s.input > 0 (W4A4, vLLM's cvt_warp_fp16_to_fp4 + the FP4 GEMM), per
 * row of x and block b of 16 elements, with gs = 1 / s.input:
 *     SFa_b = e4m3((gs * max_k |x_k|) / 6)     nearest even, saturating
 *     os    = SFa_b != 0 ? 1 / (SFa_b * (1 / gs)) : 0
 *     qa_k  = e2m1(x_k * os)                  nearest even, saturating at +-6
 *     I_b   = sum_k (2 qa_k) * (2 qw_k)       exactly, in integers (|2q| <= 12)
 *     t_b   = ((float)I_b * (SFa_b * SFw_b)) * 0.25     exact: |I_b| <= 2304 (12 bits)
 *                                              times an 8-bit significand
 *     acc   = sum_b t_b in eight lanes (lane b % 8), then the pair tree
 *     out   = acc * (s.input * s.weight)
 *   t_b is the exact value of sum_k (qa_k SFa_b)(qw_k SFw_b), so the float32 sum over the
 *   blocks is the only rounding before the final scale.  A block of x holding an
 *   infinity or a NaN gives t_b = NaN (a float dot product would be NaN or inf too);
 *   a NaN weight scale (e4m3 S.1111.111) gives NaN.
 * NVFP4, s.input == 0 (weight-only, as vLLM's Marlin W4A16 fallback on Hopper):
 *     acc = eight lanes over x_k * (e2m1(qw_k) * SFw_b)   (the inner product exact);
 *     out = acc * s.weight.
 *
 * Every step depends on one row of x and one row of W alone (kernels.h batch
 * invariance); a SIMD version computing the same terms in the same lanes is bitwise this.
 * No state: any thread.  Non-logging. */
#ifndef TSR_KERNELS_QUANT_FPMM_H
#define TSR_KERNELS_QUANT_FPMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"

/* Their bits in tsr_backend_ops.matmul_dtypes. */
#define TSR_FPMM_DTYPES (1u << TSR_DTYPE_FP8_E4M3 | 1u << TSR_DTYPE_NVFP4)

/* fp8_e4m3 or nvfp4. */
bool tsr_fpmm_supported(tsr_dtype t);
/* Scales a kernel can use: weight finite and > 0, input finite and >= 0. */
bool tsr_fpmm_scales_ok(const tsr_matmul_scales *s);

/* FP8, W8A8: x (n,) -> xq (n,), the e4m3 values of x / input as float32. */
void tsr_fpmm_fp8_quantize_row(const float *x, size_t n, float input, float *xq);
/* NVFP4, W4A4: x (n,), n a multiple of 16 -> a (n,) the codes as 2*e2m1 (int8 in -12..12),
 * sfa (n/16,) the block scales as float32 (NaN for a block with a non-finite x). */
void tsr_fpmm_nvfp4_quantize_row(const float *x, size_t n, float input, int8_t *a, float *sfa);
/* 2*e2m1 of a code (low 4 bits): 0, 1, 2, 3, 4, 6, 8, 12 with the code's sign. */
int tsr_fpmm_e2m1_x2(uint8_t code);

/* The reference matmul above.  TSR_E_INVAL (NULL, n or d zero, n not a multiple of the
 * block, t not fp8_e4m3/nvfp4, bad scales), TSR_E_LIMIT, TSR_E_NOMEM; nothing written then. */
tsr_status tsr_fpmm_ref(float *out, const float *x, const void *w, tsr_dtype t, const tsr_matmul_scales *s,
                        size_t rows, size_t n, size_t d);

#endif
