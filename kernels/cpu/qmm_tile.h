/* qmm_tile.h - one tile kernel of the batched int8 matmul (cpu/qmm.c, "many activation
 * rows"), included by cpu/qmm.c once per instruction set: the body is the same, the
 * target attribute and the byte multiply-add differ, and a function may only inline
 * intrinsics of its own target.  Not a header of its own: no include guard on purpose.
 *
 * Before each inclusion cpu/qmm.c defines
 *   ILV_NAME    infix of the functions defined here (ilv_tile_<ILV_NAME>4, ...2; it ends in _)
 *   ILV_TARGET  the target attribute string
 *   ILV_RW      weight rows per tile
 *   ILV_DOT     acc + the four-byte products of w and q per 32-bit lane (an inline
 *               function of ILV_TARGET or a subset of it)
 * and this file undefines them.
 *
 * A tile: ILV_RW weight rows x RA activation rows, acc[i][r] in registers; per group of
 * eight blocks, eight steps of ILV_DOT leave lane j = block j's integer sum, then
 * ilv_group_terms adds the group's float terms; at the end each pair's lanes are summed
 * as the reference sums them. */

#define ILV_CAT2(a, b) a##b
#define ILV_CAT(a, b) ILV_CAT2(a, b)
#define ILV_FN(suffix) ILV_CAT(ILV_CAT(ilv_tile_, ILV_NAME), suffix)

__attribute__((always_inline, target(ILV_TARGET))) static inline void ILV_FN(_t)(const int RA,
                                                                                const struct ilv_tile *tl,
                                                                                float out[][QMM_TILE_A]) {
        enum { RW = ILV_RW };
        __m256 facc[RW][QMM_TILE_A];

#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                for (int r = 0; r < RA; r++)
                        facc[i][r] = _mm256_setzero_ps();
        for (size_t g = 0; g < tl->ng; g++) {
                __m256i acc[RW][QMM_TILE_A];
#pragma GCC unroll 4
                for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                        for (int r = 0; r < RA; r++)
                                acc[i][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) {
                        __m256i w[RW];
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++)
                                w[i] = _mm256_load_si256((const __m256i *)(tl->w[i] + 256 * g + 32 * s));
#pragma GCC unroll 4
                        for (int r = 0; r < RA; r++) {
                                __m256i q = _mm256_load_si256((const __m256i *)(tl->q[r] + 256 * g + 32 * s));
#pragma GCC unroll 4
                                for (int i = 0; i < RW; i++)
                                        acc[i][r] = ILV_DOT(acc[i][r], w[i], q);
                        }
                }
                ilv_group_terms(RW, RA, tl, g, acc, facc);
        }
#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                for (int r = 0; r < RA; r++)
                        out[i][r] = lanes_sum(facc[i][r]);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(4)(const struct ilv_tile *tl, float out[][QMM_TILE_A]) {
        ILV_FN(_t)(4, tl, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(2)(const struct ilv_tile *tl, float out[][QMM_TILE_A]) {
        ILV_FN(_t)(2, tl, out);
}

#undef ILV_FN
#undef ILV_CAT
#undef ILV_CAT2
#undef ILV_NAME
#undef ILV_TARGET
#undef ILV_RW
#undef ILV_DOT
