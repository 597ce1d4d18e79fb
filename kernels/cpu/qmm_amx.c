/* cpu/qmm_amx.c - the int8 matmul on GGUF 32-blocks with AMX-INT8 tiles (TDPBSSD /
 * TDPBSUD), for a batch of activation rows on CPUs with AMX: bitwise quant/qmm.c's result,
 * as cpu/qmm.c's other paths.
 *
 * Why it is bitwise the reference: one tile product per 32-block leaves C[r][i] = the
 * block's integer sum of w * q for activation row r and weight row i, exactly (|sum| <=
 * 32 * 128 * 127 in int32, any order); the float32 terms are then the reference's own,
 * t_b = (dw * dx) * (float)sum + mw * sx, each an IEEE operation of the same operands in
 * the same order, sixteen weight rows per vector, and lane b % 8 of the reference is an
 * accumulator of its own here, summed over its blocks in increasing b and finally
 * combined by the reference's pair tree.  For the formats without a min (q8_0, q4_0,
 * q5_0; mw = 0) the term mw * sx is not added: adding +-0 changes no sum here (t + +-0 is
 * t unless t is -0, and a lane is never -0, so lane + -0 = lane + +0; a non-finite block
 * has dx = NaN, so t is NaN already).  No path, tile or thread count enters any of this,
 * so a row alone (the GEMV, cpu/qmm.c) and the same row in any batch agree (kernels.h).
 *
 * Layout.  A task owns 16 weight rows (one B tile's columns).  It unpacks them once per
 * call into B's layout: per block b, 8 tile rows of 64 bytes, row p holding bytes
 * 4p..4p+3 of the block's codes for each of the 16 weight rows (a 16 x 8 transpose of
 * 32-bit words), signed codes for q8_0 / q4_0 / q5_0 (TDPBSSD) and unsigned ones for q4_1 /
 * q5_1 (TDPBSUD); and their scales as dw[b][16], mw[b][16].  The A tile is 16 activation
 * rows' codes of block b read in place (32 bytes, act_bytes apart): the quantized rows
 * need no repacking.  C is 16 activation rows x 16 weight rows of int32, stored to a
 * buffer and turned into the terms with the weight rows across a vector.
 *
 * Order of work: per tile of 16 activation rows, lane j = 0..7 at a time, its blocks j,
 * j + 8, ... in increasing order into 16 register accumulators (one per activation row);
 * the eight lanes then go to the pair tree and out.  The whole task is one software
 * pipeline (qamx_rows_t).
 *
 * Cost, measured on a Xeon with AMX (docs/benchmarks.md, issue #21): a block's tile
 * product and store take about 36 core cycles, its float terms about 64 (96 zmm
 * operations for q4_1 on two ports), and the two did not overlap even in a standalone
 * loop, so the float terms bound it: 2.3 ms for 512 rows x 576 x 1536 on one thread
 * against 4.0-4.3 ms for the VNNI tiles (cpu/qmm.c).  Below 32 rows the weight unpacking
 * and the padded tile cost more than they save, and cpu/qmm.c keeps the VNNI tiles.
 *
 * Threads: tasks over pool threads in spans (tsr_pool_run_spans, as cpu/qmm.c); each task
 * loads the tile configuration and releases the tiles, so no thread holds tile state
 * between tasks (cpu/amx.c does the same). */
#include "kernels/cpu/qmm_amx.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "kernels/cpu/amx.h"
#include "kernels/quant/qmm.h"

#if defined(__x86_64__) && defined(__linux__)

#include <immintrin.h>

#include "kernels/cpu/qmm_blocks.h"

#define QAMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,f16c"
#define QAMX_FN __attribute__((target(QAMX_TARGET)))
#define QAMX_INLINE static inline __attribute__((always_inline, target(QAMX_TARGET)))

#define W_ROWS 16               /* weight rows per task: a B tile's 16 int32 columns */
#define B_BYTES 512             /* one block of 16 weight rows in B's layout: 8 rows x 64 */
#define C_WORDS 256             /* one C tile: 16 x 16 int32 */

/* Tiles 0, 1 C (16 x 64 bytes), 2, 4 A (16 x 32 bytes: one block of 16 activation rows),
 * 3, 5 B (8 x 64 bytes: one block of 16 weight rows). */
static const struct tsr_amx_tilecfg qamx_cfg __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 32, 64, 32, 64},
        .rows = {16, 16, 16, 8, 16, 8},
};

struct qamx_ctx {
        float *out;                     /* (rows, d) */
        const uint8_t *xq;              /* (rows rounded up to 16, act_bytes) */
        const uint8_t *w;               /* (d, row_bytes) */
        tsr_dtype t;
        size_t rows, d, nb, act_bytes, row_bytes;      /* nb: blocks per row, n / 32 */
        size_t dx_at, sx_at;            /* byte offsets of dx and sx in an activation row */
        size_t scratch_bytes;
        _Atomic bool *no_memory;
};

/* Weight rows i0 .. i0 + nw - 1 (nw <= 16) -> B's layout at wb and their scales at dw,
 * mw (nb x 16 each; mw only for q4_1 / q5_1).  Columns past nw repeat the last row:
 * computed, never stored. */
QAMX_INLINE void unpack_rows_t(const tsr_dtype T, const struct qamx_ctx *c, size_t i0, size_t nw, uint8_t *wb,
                               float *dw, float *mw) {
        const size_t bb = BLOCK32_BYTES(T);
        const bool has_m = T == TSR_DTYPE_Q4_1 || T == TSR_DTYPE_Q5_1;
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
                        _mm512_store_si512(wb + b * B_BYTES + 64 * p,
                                           _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1));
                /* The 16 blocks' first dwords: f16 d, then f16 m (or codes). */
                __m512i head = _mm512_i32gather_epi32(at, base, 1);
                _mm512_store_ps(dw + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
                if (has_m)      /* block_terms reads mw only then */
                        _mm512_store_ps(mw + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
        }
        /* TILELOADD's asm does not say it reads memory: the stores above come first. */
        __asm__ volatile("" ::: "memory");
}

/* Block b's float terms from its C tile (stored at cb) into acc[r], r = the tile's 16
 * activation rows (their quantized rows from a0, act_bytes apart). */
QAMX_INLINE void block_terms(const bool has_m, const struct qamx_ctx *c, const int32_t *cb, const float *dw,
                             const float *mw, const uint8_t *a0, size_t b, __m512 acc[16]) {
        __m512 dwv = _mm512_load_ps(dw + 16 * b), mwv = has_m ? _mm512_load_ps(mw + 16 * b) : _mm512_setzero_ps();
        const uint8_t *dxp = a0 + c->dx_at + 4 * b, *sxp = a0 + c->sx_at + 4 * b;
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
                __m512 dx = _mm512_set1_ps(*(const float *)(dxp + r * c->act_bytes));
                __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r));
                __m512 t = _mm512_mul_ps(_mm512_mul_ps(dwv, dx), s);
                if (has_m)
                        t = _mm512_add_ps(t, _mm512_mul_ps(mwv, _mm512_set1_ps(*(const float *)(sxp + r * c->act_bytes))));
                acc[r] = _mm512_add_ps(acc[r], t);
        }
}

/* Block b of the 16 activation rows at a into C tile C, from A tile A and B tile B (tile
 * numbers are literal tokens: the intrinsics paste them into the instruction), stored to
 * cb. */
#define QAMX_BLOCK(C, A, B, a, b, cb)                                                           \
        do {                                                                                    \
                _tile_loadd(A, (a) + 32 * (b), ab);                                             \
                _tile_loadd(B, wb + B_BYTES * (b), 64);                                         \
                _tile_zero(C);                                                                  \
                if (has_m)                                                                      \
                        _tile_dpbsud(C, A, B);                                                  \
                else                                                                            \
                        _tile_dpbssd(C, A, B);                                                  \
                _tile_stored(C, cb, 64);                                                        \
        } while (0)

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
 * whole list: item k + 1's tile product is stored (C tiles 0 and 1, cbuf's halves, in
 * turn) before item k's float terms are read, so the tile unit works while the vector
 * units do, also across lanes and tiles. */
QAMX_INLINE void qamx_rows_t(const tsr_dtype T, const struct qamx_ctx *c, size_t i0, size_t nw, uint8_t *scratch) {
        const bool has_m = T == TSR_DTYPE_Q4_1 || T == TSR_DTYPE_Q5_1;
        const size_t nb = c->nb, ab = c->act_bytes, items = (c->rows + 15) / 16 * nb;
        float *lanes = (float *)scratch;                                /* 8 x 16 x 16 */
        int32_t *cb0 = (int32_t *)(scratch + 8 * C_WORDS * 4), *cb1 = cb0 + C_WORDS;
        uint8_t *wb = scratch + 10 * C_WORDS * 4;                       /* nb x 512 */
        float *dw = (float *)(wb + nb * B_BYTES), *mw = dw + 16 * nb;
        uint32_t *order = (uint32_t *)(mw + 16 * nb);                   /* nb: block, bit 31 = lane's last */
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
        unpack_rows_t(T, c, i0, nw, wb, dw, mw);
        _tile_loadconfig(&qamx_cfg);

/* Issue the next item into C tile C (A, B its operand tiles), stored to cb. */
#define QAMX_ISSUE(C, A, B, cb)                                                                 \
        do {                                                                                    \
                QAMX_BLOCK(C, A, B, c->xq + is.rt * 16 * ab, order[is.p] & 0x7fffffffu, cb);    \
                qamx_advance(&is, nb);                                                          \
        } while (0)
/* The float terms of the oldest item in flight, read from cb; a lane or a tile that ends. */
#define QAMX_TERMS(cb)                                                                          \
        do {                                                                                    \
                size_t b_ = order[ep.p] & 0x7fffffffu;                                          \
                block_terms(has_m, c, cb, dw, mw, c->xq + ep.rt * 16 * ab, b_, acc);            \
                if (order[ep.p] >> 31)                                                          \
                        lane_done(acc, lanes + b_ % 8 * C_WORDS);                               \
                if (ep.p == nb - 1)                                                             \
                        tile_done(c, lanes, ep.rt * 16, i0, keep);                              \
                qamx_advance(&ep, nb);                                                          \
        } while (0)

        QAMX_ISSUE(0, 2, 3, cb0);
        for (size_t k = 0; k < items; k += 2) {
                if (k + 1 < items)
                        QAMX_ISSUE(1, 4, 5, cb1);
                QAMX_TERMS(cb0);
                if (k + 1 == items)
                        break;
                if (k + 2 < items)
                        QAMX_ISSUE(0, 2, 3, cb0);
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
        default: qamx_rows_t(TSR_DTYPE_Q5_1, c, i0, nw, scratch); break;
        }
}

tsr_status tsr_qmm_amx(tsr_pool *pool, float *out, const uint8_t *xq, size_t act_bytes, const void *w,
                       size_t row_bytes, tsr_dtype t, size_t rows, size_t n, size_t d) {
        tsr_qmm_act a = tsr_qmm_act_at(t, xq, n);
        _Atomic bool no_memory = false;
        struct qamx_ctx c = {
                .out = out, .xq = xq, .w = w, .t = t, .rows = rows, .d = d, .nb = n / 32,
                .act_bytes = act_bytes, .row_bytes = row_bytes,
                .dx_at = (size_t)((const uint8_t *)a.dx - xq), .sx_at = (size_t)((const uint8_t *)a.sx - xq),
                .scratch_bytes = 10 * C_WORDS * 4 + n / 32 * (B_BYTES + 2 * 16 * sizeof(float) + sizeof(uint32_t)),
                .no_memory = &no_memory,
        };

        tsr_pool_run_spans(pool, (d + W_ROWS - 1) / W_ROWS, qamx_task, &c);
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
