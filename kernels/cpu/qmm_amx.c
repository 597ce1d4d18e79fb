/* cpu/qmm_amx.c - the int8 matmul on GGUF blocks with AMX-INT8 tiles (TDPBSSD /
 * TDPBSUD), for a batch of activation rows on CPUs with AMX: bitwise quant/qmm.c's result,
 * as cpu/qmm.c's other paths.  Every format of qmm.h: the 32-blocks (q8_0, q4_0, q4_1,
 * q5_0, q5_1) and the K blocks (q4_K, q5_K, q6_K).
 *
 * Why it is bitwise the reference.  32-blocks: one tile product per block leaves C[r][i]
 * = the block's integer sum of w * q for activation row r and weight row i, exactly
 * (|sum| <= 32 * 128 * 127 in int32, any order); the float32 terms are then the
 * reference's own, t_b = (dw * dx) * (float)sum + mw * sx, each an IEEE operation of the
 * same operands in the same order, sixteen weight rows per vector.  For the formats
 * without a min (q8_0, q4_0, q5_0; mw = 0) the term mw * sx is not added: adding +-0
 * changes no sum here (t + +-0 is t unless t is -0, and a lane is never -0, so lane + -0
 * = lane + +0; a non-finite block has dx = NaN, so t is NaN already).  K blocks: one tile
 * product per group of codes that shares a scale (q4_K / q5_K's eight sub-blocks of 32,
 * q6_K's sixteen groups of 16) gives that group's sum exactly; I1 = sum of scale x sum
 * and I2 = sum of min x activation sum are the reference's integers (exact in int32 in
 * any order, |I1| < 2^28), and t_b = (d*dx) * (float)I1 - (dmin*dx) * (float)I2 its
 * float terms.  In both, lane b % 8 of the reference is an accumulator of its own here,
 * summed over its blocks in increasing b and finally combined by the reference's pair
 * tree.  No path, tile or thread count enters any of this, so a row alone (the GEMV,
 * cpu/qmm.c) and the same row in any batch agree (kernels.h).
 *
 * Layout.  A task owns 16 weight rows (one B tile's columns).  It unpacks them once per
 * call into B's layout: per group of KW codes, KW / 4 tile rows of 64 bytes, row p
 * holding bytes 4p..4p+3 of the group's codes for each of the 16 weight rows (a 16 x 8
 * transpose of 32-bit words per 32 codes), signed codes for q8_0 / q4_0 / q5_0 / q6_K
 * (TDPBSSD; q6_K's -32 applied) and unsigned ones for q4_1 / q5_1 / q4_K / q5_K
 * (TDPBSUD); and their scales with the 16 weight rows across a vector (struct qamx_w).
 * The A tile is 16 activation rows' codes of one group read in place (KW bytes,
 * act_bytes apart): the quantized rows need no repacking.  C is 16 activation rows x 16
 * weight rows of int32, stored to a buffer and turned into the terms with the weight rows
 * across a vector.
 *
 * Order of work: per tile of 16 activation rows, lane j = 0..7 at a time, its blocks j,
 * j + 8, ... in increasing order into 16 register accumulators (one per activation row);
 * the eight lanes then go to the pair tree and out.  The whole task is one software
 * pipeline (qamx_rows_t).
 *
 * Cost, measured on a Xeon with AMX (docs/benchmarks.md, issue #21).  32-blocks: a
 * block's tile product and store take about 36 core cycles in a standalone loop, its
 * float terms about 64 (96 zmm operations for q4_1 on two ports), and the two did not
 * overlap, so the float terms bound it: 2.3 ms for 512 rows x 576 x 1536 on one thread
 * against 4.0-4.3 ms for the VNNI tiles (cpu/qmm.c).  K blocks: the float terms are per
 * 256 codes, and the integer scaling (a vpmulld per group and row) is cheaper than the
 * 32-blocks' terms, so the tile products bound it (about 19 ns a product inside the
 * kernel, twice the standalone loop's, not explained yet): 512 x 2048 x 2048 q4_K in 9.8
 * ms on one thread against 19.0 ms for the VNNI tiles.  Below 32 rows the weight
 * unpacking and the padded tile cost more than they save, and cpu/qmm.c keeps the VNNI
 * tiles.
 *
 * Threads: tasks over pool threads in spans (tsr_pool_run_spans, as cpu/qmm.c); each task
 * loads the tile configuration and releases the tiles, so no thread holds tile state
 * between tasks (cpu/amx.c does the same). */
#include "kernels/cpu/qmm_amx.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/amx.h"
#include "kernels/quant/qmm.h"
#include "kernels/quant/quant.h"

#if defined(__x86_64__) && defined(__linux__)

#include <immintrin.h>

#include "kernels/cpu/qmm_blocks.h"

#define QAMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,f16c"
#define QAMX_FN __attribute__((target(QAMX_TARGET)))
#define QAMX_INLINE static inline __attribute__((always_inline, target(QAMX_TARGET)))

#define W_ROWS 16               /* weight rows per task: a B tile's 16 int32 columns */
#define C_WORDS 256             /* one C tile: 16 x 16 int32 */

/* The block shapes of type T: a block of BE(T) elements is G(T) tile products of KW(T)
 * codes each (a 32-block one of 32; a q4_K / q5_K block its eight sub-blocks of 32; a
 * q6_K block its sixteen scale groups of 16), and BB(T) bytes of B for 16 weight rows. */
#define IS_K(T) ((T) == TSR_DTYPE_Q4_K || (T) == TSR_DTYPE_Q5_K || (T) == TSR_DTYPE_Q6_K)
#define BE(T) (IS_K(T) ? 256 : 32)
#define G(T) ((T) == TSR_DTYPE_Q6_K ? 16 : IS_K(T) ? 8 : 1)
#define KW(T) ((T) == TSR_DTYPE_Q6_K ? 16 : 32)
#define BB(T) (G(T) * KW(T) * W_ROWS)
/* Codes of both operands signed (TDPBSSD), or the weights' unsigned (TDPBSUD). */
#define SIGNED_W(T) ((T) == TSR_DTYPE_Q8_0 || (T) == TSR_DTYPE_Q4_0 || (T) == TSR_DTYPE_Q5_0 || (T) == TSR_DTYPE_Q6_K)
/* A float32 min term per block: q4_1, q5_1 (mw * sx) and q4_K, q5_K (dmin * dx * I2). */
#define HAS_MIN(T) ((T) == TSR_DTYPE_Q4_1 || (T) == TSR_DTYPE_Q5_1 || (T) == TSR_DTYPE_Q4_K || (T) == TSR_DTYPE_Q5_K)

/* Tiles 0, 1 C (16 x 64 bytes), 2, 4 A (16 activation rows x KW bytes), 3, 5 B (KW / 4
 * rows x 64 bytes: KW codes of 16 weight rows); one configuration per KW. */
static const struct tsr_amx_tilecfg qamx_cfg32 __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 32, 64, 32, 64},
        .rows = {16, 16, 16, 8, 16, 8},
};
static const struct tsr_amx_tilecfg qamx_cfg16 __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 16, 64, 16, 64},
        .rows = {16, 16, 16, 4, 16, 4},
};

struct qamx_ctx {
        float *out;                     /* (rows, d) */
        const uint8_t *xq;              /* (rows rounded up to 16, act_bytes) */
        const uint32_t *qs32;           /* q4_K / q5_K: per activation row and block, (s0, s1) ... (s6, s7) */
        const uint8_t *w;               /* (d, row_bytes) */
        tsr_dtype t;
        size_t rows, d, nb, act_bytes, row_bytes;      /* nb: blocks per row */
        size_t dx_at, sx_at;            /* byte offsets of dx and sx (32-blocks) in an activation row */
        size_t scratch_bytes;
        _Atomic bool *no_memory;
};

/* A task's 16 weight rows in tile layout, in its thread's scratch: b, B's bytes (nb x
 * BB); 32-blocks: d = dw, m = mw ([nb][16]; mw only with a min); K blocks: d, m = dmin
 * ([nb][16]; dmin only with a min), sc the scale of each tile product ([nb][G][16]
 * int32), mnp the mins of sub-blocks 2h and 2h + 1 as two int16 ([nb][4][16]; with a
 * min). */
struct qamx_w {
        uint8_t *b;
        float *d, *m;
        int32_t *sc, *mnp;
};

/* The scratch: lanes (8 C tiles of floats), cbuf (two halves of G C tiles), then the
 * qamx_w sections, the block order (nb uint32) and, for the K blocks, 16 x 256 bytes
 * where each weight row's codes wait for the transpose.  Every section 64-byte aligned. */
static size_t qamx_scratch_bytes(tsr_dtype t, size_t nb) {
        const bool k = IS_K(t);
        const size_t g = (size_t)G(t);
        size_t bytes = 8 * C_WORDS * 4 + 2 * g * C_WORDS * 4 + nb * ((size_t)BB(t) + 2 * 64);

        if (k)
                bytes += nb * (g + 4) * 64 + 16 * 256;
        return bytes + (nb * 4 + 63) / 64 * 64;
}

/* Weight rows i0 .. i0 + nw - 1 (nw <= 16) of the 32-block type T -> B's layout (per block
 * 8 tile rows of 64 bytes, row p = bytes 4p..4p+3 of each weight row's codes) and their
 * scales.  Columns past nw repeat the last row: computed, never stored. */
QAMX_INLINE void unpack_rows_t(const tsr_dtype T, const struct qamx_ctx *c, size_t i0, size_t nw,
                               const struct qamx_w *u) {
        const size_t bb = BLOCK32_BYTES(T);
        const uint8_t *row[W_ROWS];
        const uint8_t *base = c->w + i0 * c->row_bytes;
        __m512i at = _mm512_mullo_epi32(_mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                           13, 14, 15),
                                                         _mm512_set1_epi32((int)nw - 1)),
                                        _mm512_set1_epi32((int)c->row_bytes));

        for (size_t i = 0; i < W_ROWS; i++)
                row[i] = base + (i < nw ? i : nw - 1) * c->row_bytes;
        for (size_t b = 0; b < c->nb; b++, at = _mm512_add_epi32(at, _mm512_set1_epi32((int)bb))) {
                __m256i lo[8], hi[8];
                for (int i = 0; i < 8; i++) {
                        lo[i] = codes32(T, row[i] + b * bb);
                        hi[i] = codes32(T, row[8 + i] + b * bb);
                }
                transpose8_epi32(lo);
                transpose8_epi32(hi);
                for (int p = 0; p < 8; p++)
                        _mm512_store_si512(u->b + b * BB(T) + 64 * p,
                                           _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1));
                /* The 16 blocks' first dwords: f16 d, then f16 m (or codes). */
                __m512i head = _mm512_i32gather_epi32(at, base, 1);
                _mm512_store_ps(u->d + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
                if (HAS_MIN(T)) /* block_terms reads mw only then */
                        _mm512_store_ps(u->m + 16 * b,
                                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
        }
}

/* The same for the K type T: per block, sub-block j's B rows at 512 j (so q6_K's scale
 * group g, half of a sub-block, at 256 g); q6_K's codes signed (its -32 applied), q4_K /
 * q5_K's unsigned.  tmp: 16 x 256 bytes. */
QAMX_INLINE void unpack_k_rows_t(const tsr_dtype T, const struct qamx_ctx *c, size_t i0, size_t nw,
                                 const struct qamx_w *u, uint8_t *tmp) {
        const size_t bb = KBLOCK_BYTES(T);
        const uint8_t *row[W_ROWS];

        for (size_t i = 0; i < W_ROWS; i++)
                row[i] = c->w + (i0 + (i < nw ? i : nw - 1)) * c->row_bytes;
        for (size_t b = 0; b < c->nb; b++) {
                int32_t *sc = u->sc + b * G(T) * 16;
                for (int i = 0; i < W_ROWS; i++) {
                        const uint8_t *blk = row[i] + b * bb;
                        __m256i v[8];
                        k_codes(T, blk, v);
                        for (int j = 0; j < 8; j++)
                                _mm256_store_si256((__m256i *)(tmp + 256 * i + 32 * j),
                                                   T == TSR_DTYPE_Q6_K ? _mm256_sub_epi8(v[j], _mm256_set1_epi8(32))
                                                                       : v[j]);
                        if (T == TSR_DTYPE_Q6_K) {
                                u->d[16 * b + i] = f16_at(blk + 208);
                                for (int g = 0; g < 16; g++)
                                        sc[16 * g + i] = (int8_t)blk[192 + g];
                                continue;
                        }
                        int mn[8];
                        u->d[16 * b + i] = f16_at(blk);
                        u->m[16 * b + i] = f16_at(blk + 2);
                        for (int j = 0; j < 8; j++)
                                tsr_gguf_k_scale_min(j, blk + 4, &sc[16 * j + i], &mn[j]);
                        for (int h = 0; h < 4; h++)
                                u->mnp[64 * b + 16 * h + i] = (int32_t)((uint32_t)mn[2 * h] | (uint32_t)mn[2 * h + 1] << 16);
                }
                for (int j = 0; j < 8; j++) {
                        __m256i lo[8], hi[8];
                        for (int i = 0; i < 8; i++) {
                                lo[i] = _mm256_load_si256((const __m256i *)(tmp + 256 * i + 32 * j));
                                hi[i] = _mm256_load_si256((const __m256i *)(tmp + 256 * (8 + i) + 32 * j));
                        }
                        transpose8_epi32(lo);
                        transpose8_epi32(hi);
                        for (int p = 0; p < 8; p++)
                                _mm512_store_si512(u->b + b * BB(T) + 512 * j + 64 * p,
                                                   _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1));
                }
        }
}

/* Block b's float terms from its C tile (stored at cb) into acc[r], r = the tile's 16
 * activation rows (their quantized rows from a0, act_bytes apart). */
QAMX_INLINE void block_terms(const tsr_dtype T, const struct qamx_ctx *c, const int32_t *cb,
                             const struct qamx_w *u, const uint8_t *a0, size_t b, __m512 acc[16]) {
        __m512 dwv = _mm512_load_ps(u->d + 16 * b), mwv = HAS_MIN(T) ? _mm512_load_ps(u->m + 16 * b) : _mm512_setzero_ps();
        const uint8_t *dxp = a0 + c->dx_at + 4 * b, *sxp = a0 + c->sx_at + 4 * b;
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
                __m512 dx = _mm512_set1_ps(*(const float *)(dxp + r * c->act_bytes));
                __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r));
                __m512 t = _mm512_mul_ps(_mm512_mul_ps(dwv, dx), s);
                if (HAS_MIN(T))
                        t = _mm512_add_ps(t, _mm512_mul_ps(mwv, _mm512_set1_ps(*(const float *)(sxp + r * c->act_bytes))));
                acc[r] = _mm512_add_ps(acc[r], t);
        }
}

/* K block b's float terms from its G C tiles (at cb, C_WORDS apart) into acc[r]:
 * I1 = sum_g sc_g * C_g exactly in int32, I2 = the four (mins of two sub-blocks) x
 * (activation sums of those two) products, one vpmaddwd each, and then the reference's
 * t = (d*dx) * (float)I1 - (dmin*dx) * (float)I2.  q6_K has no min: its dmin is 0, so
 * (0*dx) * 0 is +0 (dx >= 0 or NaN, and then t is NaN already), and t - +0 is t for
 * every t (-0 included): the subtraction is left out. */
QAMX_INLINE void kblock_terms(const tsr_dtype T, const struct qamx_ctx *c, const int32_t *cb,
                              const struct qamx_w *u, size_t rt, size_t b, __m512 acc[16]) {
        const int32_t *sc = u->sc + b * G(T) * 16;
        const int32_t *mnp = u->mnp + 64 * b;
        const uint8_t *dxp = c->xq + rt * 16 * c->act_bytes + c->dx_at + 4 * b;
        const uint32_t *qs = HAS_MIN(T) ? c->qs32 + (rt * 16 * c->nb + b) * 4 : NULL;
        __m512 dv = _mm512_load_ps(u->d + 16 * b), mv = HAS_MIN(T) ? _mm512_load_ps(u->m + 16 * b) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
                __m512i s0 = _mm512_mullo_epi32(_mm512_load_si512(cb + 16 * r), _mm512_load_si512(sc));
                __m512i s1 = _mm512_mullo_epi32(_mm512_load_si512(cb + C_WORDS + 16 * r), _mm512_load_si512(sc + 16));
                for (int g = 2; g < G(T); g += 2) {
                        s0 = _mm512_add_epi32(s0, _mm512_mullo_epi32(_mm512_load_si512(cb + g * C_WORDS + 16 * r),
                                                                     _mm512_load_si512(sc + 16 * g)));
                        s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_load_si512(cb + (g + 1) * C_WORDS + 16 * r),
                                                                     _mm512_load_si512(sc + 16 * (g + 1))));
                }
                __m512 dx = _mm512_set1_ps(*(const float *)(dxp + r * c->act_bytes));
                __m512 t = _mm512_mul_ps(_mm512_mul_ps(dv, dx), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)));
                if (HAS_MIN(T)) {
                        const uint32_t *q = qs + r * c->nb * 4;
                        __m512i m0 = _mm512_add_epi32(
                                _mm512_madd_epi16(_mm512_load_si512(mnp), _mm512_set1_epi32((int)q[0])),
                                _mm512_madd_epi16(_mm512_load_si512(mnp + 16), _mm512_set1_epi32((int)q[1])));
                        __m512i m1 = _mm512_add_epi32(
                                _mm512_madd_epi16(_mm512_load_si512(mnp + 32), _mm512_set1_epi32((int)q[2])),
                                _mm512_madd_epi16(_mm512_load_si512(mnp + 48), _mm512_set1_epi32((int)q[3])));
                        t = _mm512_sub_ps(t, _mm512_mul_ps(_mm512_mul_ps(mv, dx),
                                                           _mm512_cvtepi32_ps(_mm512_add_epi32(m0, m1))));
                }
                acc[r] = _mm512_add_ps(acc[r], t);
        }
}

/* One tile product of KW codes: C tile C = A tile A (16 activation rows' codes at a) x
 * B tile B (16 weight rows' codes at wbp), stored to cb.  Tile numbers are literal
 * tokens: the intrinsics paste them into the instruction. */
#define QAMX_PROD(T, C, A, B, a, wbp, cb)                                                       \
        do {                                                                                    \
                _tile_loadd(A, (a), ab);                                                        \
                _tile_loadd(B, (wbp), 64);                                                      \
                _tile_zero(C);                                                                  \
                if (SIGNED_W(T))                                                                \
                        _tile_dpbssd(C, A, B);                                                  \
                else                                                                            \
                        _tile_dpbsud(C, A, B);                                                  \
                _tile_stored(C, (cb), 64);                                                      \
        } while (0)

/* Block b of the 16 activation rows at a: its G tile products into cb (C_WORDS apart),
 * alternating C tiles 0 and 1 (a 32-block: tile 0 for half 0 of cbuf, 1 for half 1, so
 * that consecutive items alternate too). */
QAMX_INLINE void issue_block(const tsr_dtype T, const int half, const uint8_t *a, const uint8_t *wb, size_t ab,
                             size_t b, int32_t *cb) {
        a += (size_t)BE(T) * b;
        wb += (size_t)BB(T) * b;
        for (int g = 0; g < G(T); g++) {
                if ((g + half) % 2 == 0)
                        QAMX_PROD(T, 0, 2, 3, a + KW(T) * g, wb + KW(T) * W_ROWS * g, cb + C_WORDS * g);
                else
                        QAMX_PROD(T, 1, 4, 5, a + KW(T) * g, wb + KW(T) * W_ROWS * g, cb + C_WORDS * g);
        }
}

/* A lane's accumulators set aside (16 activation rows x 16 weight rows), then zeroed. */
QAMX_INLINE void lane_done(__m512 acc[16], float *lane) {
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
                _mm512_store_ps(lane + 16 * r, acc[r]);
                acc[r] = _mm512_setzero_ps();
        }
}

/* A tile's eight lanes -> out rows r0 .. r0 + 15 (those below c->rows), weight rows i0 ..
 * through `keep`: the reference's ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
QAMX_INLINE void tile_done(const struct qamx_ctx *c, const float *lanes, size_t r0, size_t i0, __mmask16 keep) {
        for (size_t r = 0; r < 16 && r0 + r < c->rows; r++) {
#define LANE(j) _mm512_load_ps(lanes + (j) * C_WORDS + 16 * r)
                __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(LANE(0), LANE(1)), _mm512_add_ps(LANE(2), LANE(3))),
                                         _mm512_add_ps(_mm512_add_ps(LANE(4), LANE(5)), _mm512_add_ps(LANE(6), LANE(7))));
#undef LANE
                _mm512_mask_storeu_ps(c->out + (r0 + r) * c->d + i0, keep, v);
        }
}

/* Where an item's work is: tile `rt` of 16 activation rows, position p in the block order. */
struct qamx_pos {
        size_t rt, p;
};

static inline void qamx_advance(struct qamx_pos *q, size_t nb) {
        if (++q->p == nb) {
                q->p = 0;
                q->rt++;
        }
}

/* The task's 16 weight rows against every tile of 16 activation rows.  The work is a flat
 * list of items (tile rt, block order[p]): per tile, lane 0's blocks 0, 8, 16, ..., then
 * lane 1's, ...; 16 register accumulators (one per activation row) hold the current lane,
 * which is set aside in `lanes` when its last block is in, and after a tile's last item
 * the lanes go through the reference's pair tree to out.  Software pipelined over the
 * whole list: item k + 1's tile products are stored (cbuf's halves in turn) before item
 * k's float terms are read, so the tile unit works while the vector units do, also
 * across lanes and tiles. */
QAMX_INLINE void qamx_rows_t(const tsr_dtype T, const struct qamx_ctx *c, size_t i0, size_t nw, uint8_t *scratch) {
        const size_t nb = c->nb, ab = c->act_bytes, items = (c->rows + 15) / 16 * nb;
        float *lanes = (float *)scratch;                                /* 8 x 16 x 16 */
        int32_t *cb0 = (int32_t *)(scratch + 8 * C_WORDS * 4), *cb1 = cb0 + G(T) * C_WORDS;
        uint8_t *p = (uint8_t *)(cb1 + G(T) * C_WORDS);
        struct qamx_w u = {.b = p};
        p += nb * BB(T);
        u.d = (float *)p, u.m = u.d + 16 * nb;
        p += nb * 2 * 64;
        uint8_t *tmp = NULL;
        if (IS_K(T)) {
                u.sc = (int32_t *)p, u.mnp = u.sc + nb * G(T) * 16;
                p += nb * (G(T) + 4) * 64;
                tmp = p;
                p += 16 * 256;
        }
        uint32_t *order = (uint32_t *)p;                               /* nb: block, bit 31 = lane's last */
        const __mmask16 keep = (__mmask16)((1u << nw) - 1);
        struct qamx_pos is = {0, 0}, ep = {0, 0};
        __m512 acc[16];

        for (size_t j = 0, k = 0; j < 8; j++) {
                for (size_t b = j; b < nb; b += 8)
                        order[k++] = (uint32_t)b | (b + 8 >= nb ? 1u << 31 : 0);
                if (j >= nb)            /* a lane without blocks is +0 */
                        memset(lanes + j * C_WORDS, 0, C_WORDS * sizeof(float));
        }
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++)
                acc[r] = _mm512_setzero_ps();
        if (IS_K(T))
                unpack_k_rows_t(T, c, i0, nw, &u, tmp);
        else
                unpack_rows_t(T, c, i0, nw, &u);
        /* TILELOADD's asm does not say it reads memory: the stores above come first. */
        __asm__ volatile("" ::: "memory");
        _tile_loadconfig(KW(T) == 16 ? &qamx_cfg16 : &qamx_cfg32);

/* Issue the next item into cbuf's half H (cb). */
#define QAMX_ISSUE(H, cb)                                                                       \
        do {                                                                                    \
                issue_block(T, H, c->xq + is.rt * 16 * ab, u.b, ab, order[is.p] & 0x7fffffffu, cb); \
                qamx_advance(&is, nb);                                                          \
        } while (0)
/* The float terms of the oldest item in flight, read from cb; a lane or a tile that ends. */
#define QAMX_TERMS(cb)                                                                          \
        do {                                                                                    \
                size_t b_ = order[ep.p] & 0x7fffffffu;                                          \
                if (IS_K(T))                                                                    \
                        kblock_terms(T, c, cb, &u, ep.rt, b_, acc);                             \
                else                                                                            \
                        block_terms(T, c, cb, &u, c->xq + ep.rt * 16 * ab, b_, acc);            \
                if (order[ep.p] >> 31)                                                          \
                        lane_done(acc, lanes + b_ % 8 * C_WORDS);                               \
                if (ep.p == nb - 1)                                                             \
                        tile_done(c, lanes, ep.rt * 16, i0, keep);                              \
                qamx_advance(&ep, nb);                                                          \
        } while (0)

        QAMX_ISSUE(0, cb0);
        for (size_t k = 0; k < items; k += 2) {
                if (k + 1 < items)
                        QAMX_ISSUE(1, cb1);
                QAMX_TERMS(cb0);
                if (k + 1 == items)
                        break;
                if (k + 2 < items)
                        QAMX_ISSUE(0, cb0);
                QAMX_TERMS(cb1);
        }
#undef QAMX_ISSUE
#undef QAMX_TERMS
        _tile_release();
}

QAMX_FN static void qamx_task(void *arg, size_t task, int worker) {
        const struct qamx_ctx *c = arg;
        size_t i0 = task * W_ROWS, nw = c->d - i0 < W_ROWS ? c->d - i0 : W_ROWS;
        uint8_t *scratch = tsr_thread_scratch(c->scratch_bytes);

        (void)worker;
        if (!scratch) {
                atomic_store_explicit(c->no_memory, true, memory_order_relaxed);
                return;
        }
        switch (c->t) {
        case TSR_DTYPE_Q8_0: qamx_rows_t(TSR_DTYPE_Q8_0, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q4_0: qamx_rows_t(TSR_DTYPE_Q4_0, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q4_1: qamx_rows_t(TSR_DTYPE_Q4_1, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q5_0: qamx_rows_t(TSR_DTYPE_Q5_0, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q5_1: qamx_rows_t(TSR_DTYPE_Q5_1, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q4_K: qamx_rows_t(TSR_DTYPE_Q4_K, c, i0, nw, scratch); break;
        case TSR_DTYPE_Q5_K: qamx_rows_t(TSR_DTYPE_Q5_K, c, i0, nw, scratch); break;
        default: qamx_rows_t(TSR_DTYPE_Q6_K, c, i0, nw, scratch); break;
        }
}

/* q4_K / q5_K: the activation sums of each sub-block of 32 (two of the reference's sums
 * of 16; |sum| <= 32 * 127 fits int16), two sub-blocks to an int32 as vpmaddwd reads
 * them against the mins: (s0, s1), (s2, s3), (s4, s5), (s6, s7) per block. */
static void qamx_sub_sums(tsr_dtype t, const uint8_t *xq, size_t act_bytes, size_t rows, size_t n, uint32_t *qs32) {
        for (size_t r = 0; r < rows; r++) {
                const int16_t *qsum = tsr_qmm_act_at(t, xq + r * act_bytes, n).qsum;
                for (size_t h = 0; h < n / 64; h++, qsum += 4)
                        *qs32++ = (uint16_t)(qsum[0] + qsum[1]) | (uint32_t)(uint16_t)(qsum[2] + qsum[3]) << 16;
        }
}

tsr_status tsr_qmm_amx(tsr_pool *pool, float *out, const uint8_t *xq, size_t act_bytes, const void *w,
                       size_t row_bytes, tsr_dtype t, size_t rows, size_t n, size_t d) {
        tsr_qmm_act a = tsr_qmm_act_at(t, xq, n);
        const bool k = tsr_qmm_is_k(t);
        const size_t padded = (rows + TSR_QMM_AMX_ROWS - 1) / TSR_QMM_AMX_ROWS * TSR_QMM_AMX_ROWS;
        _Atomic bool no_memory = false;
        struct qamx_ctx c = {
                .out = out, .xq = xq, .w = w, .t = t, .rows = rows, .d = d, .nb = n / (k ? 256 : 32),
                .act_bytes = act_bytes, .row_bytes = row_bytes,
                .dx_at = (size_t)((const uint8_t *)a.dx - xq),
                .sx_at = k ? 0 : (size_t)((const uint8_t *)a.sx - xq),
                .no_memory = &no_memory,
        };
        uint32_t *qs32 = NULL;

        c.scratch_bytes = qamx_scratch_bytes(t, c.nb);
        if (t == TSR_DTYPE_Q4_K || t == TSR_DTYPE_Q5_K) {
                qs32 = aligned_alloc(64, (padded * n / 64 * 4 + 63) / 64 * 64);
                if (!qs32)
                        return TSR_E_NOMEM;
                qamx_sub_sums(t, xq, act_bytes, padded, n, qs32);
                c.qs32 = qs32;
        }
        tsr_pool_run_spans(pool, (d + W_ROWS - 1) / W_ROWS, qamx_task, &c);
        free(qs32);
        return atomic_load(&no_memory) ? TSR_E_NOMEM : TSR_OK;
}

#else   /* not x86-64 Linux: no AMX (tsr_amx_int8() is false, so never called) */

tsr_status tsr_qmm_amx(tsr_pool *pool, float *out, const uint8_t *xq, size_t act_bytes, const void *w,
                       size_t row_bytes, tsr_dtype t, size_t rows, size_t n, size_t d) {
        (void)pool, (void)out, (void)xq, (void)act_bytes, (void)w, (void)row_bytes, (void)t, (void)rows, (void)n,
                (void)d;
        return TSR_E_UNSUPPORTED;
}

#endif
