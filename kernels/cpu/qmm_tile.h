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
 *   ILV_K       (optional) also define the K tiles, ilv_tile_<ILV_NAME>k4, k2, k6_4 and
 *               k6_2 (ILV_DOT then takes unsigned w and signed q)
 * and this file undefines them.
 *
 * A tile: ILV_RW weight rows x RA activation rows, acc[i][r] in registers; per group of
 * eight blocks, eight steps of ILV_DOT leave lane j = block j's integer sum, then
 * ilv_group_terms adds the group's float terms; at the end each pair's lanes are summed
 * as the reference sums them.  A K tile (cpu/qmm.c, "many activation rows of the K
 * formats"): per block, the same eight steps leave lane j = sub-block j's sum, which is
 * scaled and set aside; per group of eight blocks, ilvk_group_terms. */

#define ILV_CAT2(a, b) a##b
#define ILV_CAT(a, b) ILV_CAT2(a, b)
#define ILV_FN(suffix) ILV_CAT(ILV_CAT(ilv_tile_, ILV_NAME), suffix)

/* Steps s0..s1-1 into acc: weight step s at tl->w[i] + wo + 32s, activation step s at
 * tl->q[r] + qo + 32s. */
__attribute__((always_inline, target(ILV_TARGET))) static inline void ILV_FN(steps)(const int RA,
                                                                                   const struct ilv_tile *tl,
                                                                                   size_t wo, size_t qo,
                                                                                   const int s0, const int s1,
                                                                                   __m256i acc[][QMM_TILE_A]) {
#pragma GCC unroll 8
        for (int s = s0; s < s1; s++) {
                __m256i w[ILV_RW];
#pragma GCC unroll 4
                for (int i = 0; i < ILV_RW; i++)
                        w[i] = _mm256_load_si256((const __m256i *)(tl->w[i] + wo + 32 * s));
#pragma GCC unroll 4
                for (int r = 0; r < RA; r++) {
                        __m256i q = _mm256_load_si256((const __m256i *)(tl->q[r] + qo + 32 * s));
#pragma GCC unroll 4
                        for (int i = 0; i < ILV_RW; i++)
                                acc[i][r] = ILV_DOT(acc[i][r], w[i], q);
                }
        }
}

__attribute__((always_inline, target(ILV_TARGET))) static inline void ILV_FN(_t)(const int RA,
                                                                                const struct ilv_tile *tl,
                                                                                float out[][QMM_TILE_W_MAX]) {
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
                ILV_FN(steps)(RA, tl, 256 * g, 256 * g, 0, 8, acc);
                ilv_group_terms(RW, RA, tl, g, acc, facc);
        }
        ilv_tile_sums(RW, RA, facc, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(4)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(_t)(4, tl, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(2)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(_t)(2, tl, out);
}

#ifdef ILV_K
__attribute__((always_inline, target(ILV_TARGET))) static inline void ILV_FN(k_t)(const int RA, const bool Q6,
                                                                                 const struct ilv_tile *tl,
                                                                                 float out[][QMM_TILE_W_MAX]) {
        enum { RW = ILV_RW };
        const size_t nb = tl->nb;
        __m256 facc[RW][QMM_TILE_A];
        __m256i p1[RW][QMM_TILE_A][8], p2[RW][QMM_TILE_A][8];

#pragma GCC unroll 4
        for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                for (int r = 0; r < RA; r++)
                        facc[i][r] = _mm256_setzero_ps();
        for (size_t g = 0; g < (nb + 7) / 8; g++) {
                for (size_t j = 0; j < 8; j++) {
                        const size_t b = 8 * g + j;
                        __m256i acc[RW][QMM_TILE_A];
                        if (b >= nb) {
                                ilvk_absent_block(RW, RA, p1, p2, j);
                                continue;
                        }
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++)
#pragma GCC unroll 4
                                for (int r = 0; r < RA; r++)
                                        acc[i][r] = _mm256_setzero_si256();
                        if (Q6) {       /* groups 2j: times their scales, then groups 2j + 1 */
                                ILV_FN(steps)(RA, tl, ILVK_BLOCK * b, 256 * b, 0, 4, acc);
#pragma GCC unroll 4
                                for (int i = 0; i < RW; i++) {
                                        __m256i sc = _mm256_load_si256((const __m256i *)(tl->w[i] + ILVK_BLOCK * b + 256));
#pragma GCC unroll 4
                                        for (int r = 0; r < RA; r++) {
                                                p1[i][r][j] = _mm256_mullo_epi32(acc[i][r], sc);
                                                acc[i][r] = _mm256_setzero_si256();
                                        }
                                }
                        }
                        ILV_FN(steps)(RA, tl, ILVK_BLOCK * b, 256 * b, Q6 ? 4 : 0, 8, acc);
#pragma GCC unroll 4
                        for (int i = 0; i < RW; i++) {
                                const uint8_t *wb = tl->w[i] + ILVK_BLOCK * b;
                                __m256i sc = _mm256_load_si256((const __m256i *)(wb + 256 + (Q6 ? 32 : 0)));
#pragma GCC unroll 4
                                for (int r = 0; r < RA; r++) {
                                        __m256i v = _mm256_mullo_epi32(acc[i][r], sc);
                                        p1[i][r][j] = Q6 ? _mm256_add_epi32(p1[i][r][j], v) : v;
                                }
                                ilvk_p2(RA, tl, wb, b, p2[i], j);
                        }
                }
                ilvk_group_terms(RW, RA, Q6, tl, g, p1, p2, facc);
        }
        ilv_tile_sums(RW, RA, facc, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(k4)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(k_t)(4, false, tl, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(k2)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(k_t)(2, false, tl, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(k6_4)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(k_t)(4, true, tl, out);
}

__attribute__((target(ILV_TARGET))) static void ILV_FN(k6_2)(const struct ilv_tile *tl, float out[][QMM_TILE_W_MAX]) {
        ILV_FN(k_t)(2, true, tl, out);
}
#endif

#undef ILV_FN
#undef ILV_CAT
#undef ILV_CAT2
#undef ILV_NAME
#undef ILV_TARGET
#undef ILV_RW
#undef ILV_DOT
#undef ILV_K
