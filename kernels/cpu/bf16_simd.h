/* bf16_simd.h - float32 -> bf16 rounding on 16 AVX-512 lanes, bit for bit the scalar
 * tsr_f32_to_bf16 (kernels.h) that ref.c uses.  Internal to kernels/cpu: amx.c packs x
 * with it, fast.c rounds x for its VDPBF16PS path.
 *
 * Not VCVTNEPS2BF16: that instruction reads float32 subnormals as zero, the scalar
 * rounding keeps them (a subnormal rounds to a bf16 subnormal or zero by the same rule
 * as any other value), and every path must round x the same way.
 *
 * The inline function carries its own target attribute; a caller compiled for a superset
 * (amx.c's AMX target, fast.c's AVX512_BF16 target) can inline it. */
#ifndef TSR_KERNELS_CPU_BF16_SIMD_H
#define TSR_KERNELS_CPU_BF16_SIMD_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define TSR_BF16_SIMD_TARGET "avx512f,avx512bw,avx512vl"

/* The bf16 bits of each lane in the low half of that lane: round to nearest even; a NaN
 * keeps its sign and top payload and is made quiet. */
static inline __attribute__((always_inline, target(TSR_BF16_SIMD_TARGET))) __m512i tsr_bf16_bits16(__m512 v) {
        __m512i u = _mm512_castps_si512(v);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
        __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* dst[i] = tsr_f32_to_bf16(src[i]) for i < count, 16 at a time, the tail masked. */
static inline __attribute__((always_inline, target(TSR_BF16_SIMD_TARGET))) void
tsr_bf16_round_row(uint16_t *dst, const float *src, size_t count) {
        for (size_t i = 0; i < count; i += 16) {
                size_t left = count - i;
                __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                __m512i bits = tsr_bf16_bits16(_mm512_maskz_loadu_ps(m, src + i));
                _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(bits));
        }
}
#endif

#endif
