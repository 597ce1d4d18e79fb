// fpmm_math.cuh - the arithmetic of fpmm.cu's exact kernels, one thread's share: the
// activation quantizers of kernels/quant/fpmm.h per element / per 16-block, and one of
// the eight lanes of a weight row . activation row.  Every multiply and add is rounded
// once (__fmul_rn / __fadd_rn, which nvcc does not fuse), so the results are fpmm.h's
// bit for bit.  Kept apart from the launches so that tests/kernels/test_fpmm_host.cc
// compiles it for the host and holds it to cpu/ref.c without a GPU.
#ifndef TSR_CUDA_FPMM_MATH_CUH
#define TSR_CUDA_FPMM_MATH_CUH

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/minifloat.cuh"

// Weights x activations: fp8 or nvfp4 weights, float32 x (weight-only) or quantized x.
enum { TSR_FPMM_FP8_W, TSR_FPMM_FP8_A, TSR_FPMM_NV_W, TSR_FPMM_NV_A };

// tsr_fpmm_fp8_quantize_row's element: the e4m3 code of x / input.
__device__ static inline uint8_t tsr_fpmm_cuda_quantize_fp8(float x, float input) {
        return tsr_cuda_f32_to_e4m3(__fdiv_rn(x, input));
}

// tsr_fpmm_nvfp4_quantize_row's block: xb (16,) -> a (16,) as 2*e2m1, *sfa the block scale
// (NaN for a block holding a non-finite x, its codes 0).
__device__ static inline void tsr_fpmm_cuda_quantize_nvfp4_block(const float *xb, float input, int8_t *a, float *sfa) {
        float gs = __fdiv_rn(1.0f, input), amax = 0.0f;
        bool finite = true;
        for (int k = 0; k < 16; k++) {
                finite = finite && isfinite(xb[k]);
                if (fabsf(xb[k]) > amax)
                        amax = fabsf(xb[k]);
        }
        if (!finite) {
                for (int k = 0; k < 16; k++)
                        a[k] = 0;
                *sfa = NAN;
                return;
        }
        float sf = tsr_cuda_e4m3_to_f32(tsr_cuda_f32_to_e4m3(__fdiv_rn(__fmul_rn(gs, amax), 6.0f)));
        float os = sf != 0.0f ? __fdiv_rn(1.0f, __fmul_rn(sf, __fdiv_rn(1.0f, gs))) : 0.0f;
        for (int k = 0; k < 16; k++)
                a[k] = (int8_t)tsr_cuda_e2m1_x2(tsr_cuda_f32_to_e2m1(__fmul_rn(xb[k], os)));
        *sfa = sf;
}

// Code k (0..15) of an NVFP4 block (its scale byte, then 8 bytes, element 2m in byte m's
// low nibble).
__device__ static inline unsigned tsr_fpmm_cuda_nv_code(const uint8_t *blk, unsigned k) {
        uint8_t byte = blk[1 + k / 2];
        return k % 2 ? byte >> 4 : byte & 0x0f;
}

// Lane j (0..7) of weight row wi . activation row r, in fpmm.h's order: k = j, j + 8, ...
// (NVFP4 W4A4: blocks b = j, j + 8, ..., each an exact integer dot then one exact term).
// x (rows, n) float32 for the weight-only kinds; xc its e4m3 codes (FP8_A); a / sfa its
// NVFP4 codes and block scales (NV_A).  e4m3: the 256 codes' values.
template <int K>
__device__ static inline float tsr_fpmm_cuda_lane(const float *x, const uint8_t *xc, const int8_t *a, const float *sfa,
                                                  const uint8_t *wi, size_t r, size_t n, unsigned j,
                                                  const float *e4m3) {
        float lane = 0.0f;
        if (K == TSR_FPMM_FP8_W) {
                for (size_t k = j; k < n; k += 8)
                        lane = __fadd_rn(lane, __fmul_rn(x[r * n + k], e4m3[wi[k]]));
        } else if (K == TSR_FPMM_FP8_A) {
                for (size_t k = j; k < n; k += 8)
                        lane = __fadd_rn(lane, __fmul_rn(e4m3[xc[r * n + k]], e4m3[wi[k]]));
        } else if (K == TSR_FPMM_NV_W) {
                for (size_t k = j; k < n; k += 8) {
                        const uint8_t *blk = wi + 9 * (k / 16);
                        float wk = __fmul_rn(tsr_cuda_e2m1_to_f32(tsr_fpmm_cuda_nv_code(blk, (unsigned)(k % 16))),
                                             e4m3[blk[0]]);
                        lane = __fadd_rn(lane, __fmul_rn(x[r * n + k], wk));
                }
        } else {
                for (size_t b = j; b < n / 16; b += 8) {
                        const uint8_t *blk = wi + 9 * b;
                        const int8_t *ab = a + r * n + 16 * b;
                        int32_t dot = 0;
                        for (unsigned k = 0; k < 16; k++)
                                dot += tsr_cuda_e2m1_x2(tsr_fpmm_cuda_nv_code(blk, k)) * ab[k];
                        float t = __fmul_rn(__fmul_rn((float)dot, __fmul_rn(sfa[r * (n / 16) + b], e4m3[blk[0]])), 0.25f);
                        lane = __fadd_rn(lane, t);
                }
        }
        return lane;
}

#endif
