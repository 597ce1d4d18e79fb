/* cpu/amx.c - the bf16 matmul on AMX tiles (TDPBF16PS), for CPUs with AMX-TILE and AMX-BF16.
 *
 * The product is computed transposed, out^T = W x^T, so that the weights need no
 * repacking: W (d, n) bf16 row-major is exactly the layout of the A operand (a tile row
 * is 32 bf16 of k of one weight row, rows n * 2 bytes apart).  x, rounded to bf16 once
 * per call as on the other paths, is packed per call into B's pair layout: for each block
 * of 32 k and each block of 16 rows of x, 16 tile rows of k pairs, row p holding
 * (x[j][2p], x[j][2p+1]) for the 16 rows j, i.e. a 16 x 16 transpose of 32-bit pairs.  A C
 * tile is then 16 weight rows x 16 rows of x in float32; it is transposed in registers
 * and stored into out (rows, d).
 *
 * Batch invariance (kernels.h): output element (r, i) is C[i'][r'] of one tile, summed by
 * one TDPBF16PS per 32-wide block of k, the blocks in increasing k, each instruction
 * adding its 32 products in the hardware's fixed order; the bytes that enter it are W's
 * row i and x's row r (zeros past n), never anything of another row.  Which tile row and
 * column the element occupies, how many C tiles run side by side, the number of rows,
 * threads and tasks change none of that: rows of x are padded to 16 with zeros, k is
 * never split, and one row alone (decode) goes through the same instructions.
 * tests/kernels/test_cpu_fast.c checks a row alone against the same row among 63 others.
 *
 * Edges, never reading outside w or x: the last block of 16 weight rows when d % 16 != 0
 * is the one ending at row d (it overlaps the block before; only its own rows are
 * stored), and when d < 16 the rows are copied into a zeroed block; a k tail (n % 32 != 0)
 * of the weights is copied into a zeroed 16 x 32 tile per block, and x's pairs past n are
 * zero.  The results differ from VDPBF16PS's (fast.c) in summation order: the same
 * exact bf16 products, float32 sums (both read bf16 subnormals as zero).
 *
 * Threads: the caller (engine thread) drives two pool runs: packing x (one task per 16
 * rows), then the tile products, each task owning a range of weight rows, loading the
 * tile configuration, computing, and releasing the tiles (TILERELEASE), so a thread holds
 * no tile state between tasks. */
#include "kernels/cpu/amx.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/bf16_simd.h"
#include "kernels/kernels.h"

#if defined(__x86_64__) && defined(__linux__)
#define AMX_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef AMX_X86

#define AMX_TARGET "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl"
#define AMX_FN __attribute__((target(AMX_TARGET)))
#define AMX_INLINE static inline __attribute__((always_inline, target(AMX_TARGET)))

#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023     /* <asm/prctl.h>, Linux 5.16 */
#endif
#define XFEATURE_XTILEDATA 18

#define TILE_ROWS 16            /* weight rows per A / C tile, and rows of x per C tile (columns) */
#define TILE_K 32               /* bf16 of k per A tile row: one TDPBF16PS step */
#define TILE_WORDS 256          /* 32-bit words in one packed B tile (16 x 16 pairs) */
#define PREFETCH_KB 2           /* blocks of k ahead that the weight prefetches run */
#define TASKS_PER_THREAD 4      /* pool tasks per thread: balance against LDTILECFG per task */

/* ---- detection --------------------------------------------------------------------- */

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static bool amx_ok, amx_int8_ok;

static void amx_detect(void) {
        unsigned a, b, c, d;
        /* CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE, bit 25 AMX-INT8. */
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
                return;
        /* Linux keeps the 8 KiB tile state off until a process asks; it refuses when the
         * kernel is too old or a thread's signal stack is too small for it. */
        amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        amx_int8_ok = amx_ok && (d & (1u << 25));
}

bool tsr_amx_init(void) {
        pthread_once(&amx_once, amx_detect);
        return amx_ok;
}

bool tsr_amx_int8(void) {
        pthread_once(&amx_once, amx_detect);
        return amx_int8_ok;
}

/* ---- the kernel ---------------------------------------------------------------------- */

/* Tiles 0..7 all 16 rows x 64 bytes: 0-3 C (float32), 4-5 A (weights), 6-7 B (packed x). */
static const struct tsr_amx_tilecfg tile_cfg __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

struct amx_ctx {
        float *out;             /* (rows, d) */
        const uint16_t *w;      /* (w_rows, n) bf16: the weights, or a zero-padded copy when d < 16 */
        size_t w_rows;          /* rows readable in w, >= 16 */
        const uint32_t *xp;     /* (n_mb, n_kb, 16 pairs, 16 rows) packed bf16 pairs of x */
        size_t rows, n, d;
        size_t n_kb;            /* blocks of 32 k, the last one zero-padded when n % 32 */
        size_t n_kb_full;       /* blocks of 32 k read straight from w */
        size_t n_mb;            /* blocks of 16 rows of x */
        size_t n_db;            /* blocks of 16 weight rows */
        size_t blocks_per_task; /* even: a task runs pairs of blocks */
};

/* Write the C tile in `c` (16 weight rows x 16 rows of x, row-major floats) transposed:
 * out[(j) * d + r] = c[r * 16 + j] for the rows j < n_m of x and the weight rows r with
 * bit r set in `keep`.  out points at element (first row of x, first weight row). */
AMX_INLINE void store_transposed(const float *c, float *out, size_t d, size_t n_m, __mmask16 keep) {
        __m512 r[16], s[16], u[16];

        if (n_m < 4) {          /* decode: a column or three, gathered */
                const __m512i col0 = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48,
                                                      32, 16, 0);
                for (size_t j = 0; j < n_m; j++)
                        _mm512_mask_storeu_ps(out + j * d, keep,
                                              _mm512_i32gather_ps(_mm512_add_epi32(col0, _mm512_set1_epi32((int)j)),
                                                                  c, 4));
                return;
        }
        for (int i = 0; i < 16; i++)
                r[i] = _mm512_load_ps(c + 16 * i);
        /* In each 128-bit lane L: s[2i] = rows 2i, 2i+1 at columns 4L, 4L+1, interleaved;
         * s[2i+1] the same at columns 4L+2, 4L+3. */
        for (int i = 0; i < 8; i++) {
                s[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                s[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        /* u[4g + q], lane L: rows 4g .. 4g+3 of column 4L + q. */
        for (int g = 0; g < 4; g++) {
                u[4 * g + 0] = _mm512_shuffle_ps(s[4 * g], s[4 * g + 2], 0x44);
                u[4 * g + 1] = _mm512_shuffle_ps(s[4 * g], s[4 * g + 2], 0xee);
                u[4 * g + 2] = _mm512_shuffle_ps(s[4 * g + 1], s[4 * g + 3], 0x44);
                u[4 * g + 3] = _mm512_shuffle_ps(s[4 * g + 1], s[4 * g + 3], 0xee);
        }
        /* Column 4L + q gathers lane L of u[q], u[4+q], u[8+q], u[12+q]. */
        for (int q = 0; q < 4; q++) {
                __m512 lo01 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x44);      /* lanes 0,1 of each */
                __m512 lo23 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x44);
                __m512 hi01 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xee);      /* lanes 2,3 of each */
                __m512 hi23 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xee);
                s[q] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);                  /* column q */
                s[4 + q] = _mm512_shuffle_f32x4(lo01, lo23, 0xdd);              /* column 4 + q */
                s[8 + q] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);              /* column 8 + q */
                s[12 + q] = _mm512_shuffle_f32x4(hi01, hi23, 0xdd);             /* column 12 + q */
        }
        for (size_t j = 0; j < n_m; j++)
                _mm512_mask_storeu_ps(out + j * d, keep, s[j]);
}

/* One 32-wide block of k into the C tiles 0..3: weight tiles 4 (a0) and 5 (a1, ND > 1),
 * x tiles 6 (b0) and 7 (b1, NM > 1). */
AMX_INLINE void amx_kblock(const int ND, const int NM, const uint16_t *a0, const uint16_t *a1, long a_stride,
                           const uint32_t *b0, const uint32_t *b1) {
        _tile_loadd(6, b0, 64);
        _tile_loadd(4, a0, a_stride);
        if (NM > 1)
                _tile_loadd(7, b1, 64);
        if (ND > 1)
                _tile_loadd(5, a1, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (NM > 1)
                _tile_dpbf16ps(1, 4, 7);
        if (ND > 1)
                _tile_dpbf16ps(2, 5, 6);
        if (ND > 1 && NM > 1)
                _tile_dpbf16ps(3, 5, 7);
}

/* The C tiles of ND (1 or 2) blocks of 16 weight rows x NM (1 or 2) blocks of 16 rows of
 * x, over all of k: a0/a1 the weight blocks' first rows (stride n), tail0/tail1 their
 * zero-padded last 32 k (16 x 32, stride 64 bytes) when n % 32, b the packed x of the
 * first row block.  The C tiles land in c (4 x 256 floats: tile a*2+b at (a*2+b)*256). */
AMX_INLINE void amx_tiles(const int ND, const int NM, const struct amx_ctx *ctx, const uint16_t *a0,
                          const uint16_t *a1, const uint16_t *tail0, const uint16_t *tail1, const uint32_t *b,
                          float *c, bool prefetch) {
        const long stride = (long)(ctx->n * sizeof(uint16_t));
        const uint32_t *b1 = b + ctx->n_kb * TILE_WORDS;
        size_t kb;

        _tile_zero(0);
        if (NM > 1)
                _tile_zero(1);
        if (ND > 1)
                _tile_zero(2);
        if (ND > 1 && NM > 1)
                _tile_zero(3);
        for (kb = 0; kb < ctx->n_kb_full; kb++) {
                /* A tile load touches 16 lines n * 2 bytes apart, a pattern the hardware
                 * prefetchers follow poorly: ask for the weights PREFETCH_KB blocks ahead on
                 * the first pass over them (later passes find them in L1/L2). */
                if (prefetch && kb + PREFETCH_KB < ctx->n_kb_full)
                        for (int r = 0; r < TILE_ROWS; r++) {
                                _mm_prefetch((const char *)(a0 + r * ctx->n + (kb + PREFETCH_KB) * TILE_K),
                                             _MM_HINT_T0);
                                if (ND > 1)
                                        _mm_prefetch((const char *)(a1 + r * ctx->n + (kb + PREFETCH_KB) * TILE_K),
                                                     _MM_HINT_T0);
                        }
                amx_kblock(ND, NM, a0 + kb * TILE_K, a1 + kb * TILE_K, stride, b + kb * TILE_WORDS,
                           b1 + kb * TILE_WORDS);
        }
        if (kb < ctx->n_kb)     /* the k tail, from the zero-padded copies */
                amx_kblock(ND, NM, tail0, tail1, 64, b + kb * TILE_WORDS, b1 + kb * TILE_WORDS);
        _tile_stored(0, c, 64);
        if (NM > 1)
                _tile_stored(1, c + TILE_WORDS, 64);
        if (ND > 1)
                _tile_stored(2, c + 2 * TILE_WORDS, 64);
        if (ND > 1 && NM > 1)
                _tile_stored(3, c + 3 * TILE_WORDS, 64);
}

/* Weight-row blocks db0 .. db0 + nd - 1 (nd = 1 or 2) against every row of x, two blocks
 * of 16 rows of x at a time.  The tile configuration is loaded. */
AMX_INLINE void amx_pair(const struct amx_ctx *ctx, size_t db0, size_t nd) {
        uint16_t tail[2][TILE_ROWS * TILE_K] __attribute__((aligned(64)));
        float c[4 * TILE_WORDS] __attribute__((aligned(64)));
        const uint16_t *a[2];
        size_t base[2];
        __mmask16 keep[2];

        for (size_t t = 0; t < nd; t++) {
                size_t first = (db0 + t) * TILE_ROWS;           /* the block's own rows: first .. */
                size_t end = first + TILE_ROWS < ctx->d ? first + TILE_ROWS : ctx->d;  /* .. end - 1 */
                /* The tile reads 16 rows from base; the last block ends at w's last row. */
                base[t] = first + TILE_ROWS <= ctx->w_rows ? first : ctx->w_rows - TILE_ROWS;
                keep[t] = (__mmask16)(((1u << (end - base[t])) - 1) & ~((1u << (first - base[t])) - 1));
                a[t] = ctx->w + base[t] * ctx->n;
                if (ctx->n_kb > ctx->n_kb_full) {
                        size_t k0 = ctx->n_kb_full * TILE_K, nk = ctx->n - k0;
                        memset(tail[t], 0, sizeof tail[t]);
                        for (size_t r = 0; r < TILE_ROWS; r++)
                                memcpy(tail[t] + r * TILE_K, a[t] + r * ctx->n + k0, nk * sizeof(uint16_t));
                }
        }
        /* TILELOADD's asm does not tell the compiler it reads memory: make the tail
         * copies happen before it. */
        __asm__ volatile("" ::: "memory");
        for (size_t mb = 0; mb < ctx->n_mb; mb += 2) {
                const uint32_t *b = ctx->xp + mb * ctx->n_kb * TILE_WORDS;
                size_t m0 = mb * TILE_ROWS;
                size_t n_m0 = ctx->rows - m0 < TILE_ROWS ? ctx->rows - m0 : TILE_ROWS;
                bool two_m = mb + 1 < ctx->n_mb;
                size_t n_m1 = two_m ? (ctx->rows - m0 - TILE_ROWS < TILE_ROWS ? ctx->rows - m0 - TILE_ROWS
                                                                                : TILE_ROWS)
                                    : 0;
                if (nd == 2 && two_m)
                        amx_tiles(2, 2, ctx, a[0], a[1], tail[0], tail[1], b, c, mb == 0);
                else if (nd == 2)
                        amx_tiles(2, 1, ctx, a[0], a[1], tail[0], tail[1], b, c, mb == 0);
                else if (two_m)
                        amx_tiles(1, 2, ctx, a[0], a[0], tail[0], tail[0], b, c, mb == 0);
                else
                        amx_tiles(1, 1, ctx, a[0], a[0], tail[0], tail[0], b, c, mb == 0);
                for (size_t t = 0; t < nd; t++) {
                        float *o = ctx->out + m0 * ctx->d + base[t];
                        store_transposed(c + (2 * t) * TILE_WORDS, o, ctx->d, n_m0, keep[t]);
                        if (two_m)
                                store_transposed(c + (2 * t + 1) * TILE_WORDS, o + TILE_ROWS * ctx->d, ctx->d, n_m1,
                                                 keep[t]);
                }
        }
}

/* One pool task: weight-row blocks [task * blocks_per_task, + blocks_per_task), pair by
 * pair.  Loads the tile configuration first and releases the tiles last, so the thread
 * that ran it (any of the pool's) holds no tile state afterwards. */
AMX_FN static void amx_task(void *arg, size_t task, int worker) {
        const struct amx_ctx *ctx = arg;
        size_t db0 = task * ctx->blocks_per_task;
        size_t db1 = db0 + ctx->blocks_per_task < ctx->n_db ? db0 + ctx->blocks_per_task : ctx->n_db;

        (void)worker;
        _tile_loadconfig(&tile_cfg);
        for (size_t db = db0; db < db1; db += 2)
                amx_pair(ctx, db, db1 - db < 2 ? db1 - db : 2);
        _tile_release();
}

struct pack_ctx {
        uint32_t *xp;           /* (n_mb, n_kb, 16, 16) */
        const float *x;         /* (rows, n) */
        size_t rows, n, n_kb;
};

/* Row block `task` of x (rows 16 task .. 16 task + 15) float32 -> bf16 pairs in B's
 * layout, zeros past n and past rows.  32 floats of a row at a time: one block of k, 16
 * pair words that go down column r % 16 of that block's tile (64 bytes apart).  Pool
 * task: the blocks are disjoint. */
AMX_FN static void pack_task(void *arg, size_t task, int worker) {
        const struct pack_ctx *c = arg;
        const __m512i down = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16,
                                              0);
        size_t r0 = task * TILE_ROWS, r1 = r0 + TILE_ROWS < c->rows ? r0 + TILE_ROWS : c->rows;
        uint32_t *xp = c->xp + task * c->n_kb * TILE_WORDS;

        (void)worker;
        if (r1 - r0 < TILE_ROWS)        /* the columns past the last row stay zero */
                memset(xp, 0, c->n_kb * TILE_WORDS * sizeof(uint32_t));
        for (size_t r = r0; r < r1; r++) {
                const float *xr = c->x + r * c->n;
                uint32_t *col = xp + r % TILE_ROWS;
                for (size_t kb = 0; kb < c->n_kb; kb++) {
                        size_t k = kb * TILE_K, left = c->n - k;
                        __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                        __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                        __m256i lo = _mm512_cvtepi32_epi16(tsr_bf16_bits16(_mm512_maskz_loadu_ps(m0, xr + k)));
                        __m256i hi = _mm512_cvtepi32_epi16(tsr_bf16_bits16(_mm512_maskz_loadu_ps(m1, xr + k + 16)));
                        /* 32 bf16 in k order = 16 little-endian words (x[2q] | x[2q+1] << 16);
                         * masked-off lanes are +0, so pairs past n are zero words */
                        __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                        _mm512_i32scatter_epi32(col + kb * TILE_WORDS, down, pairs, 4);
                }
        }
}

tsr_status tsr_amx_matmul_bf16(tsr_pool *pool, float *out, const float *x, const uint16_t *w, size_t rows, size_t n,
                               size_t d) {
        struct amx_ctx ctx = {
                .out = out, .w = w, .w_rows = d, .rows = rows, .n = n, .d = d,
                .n_kb = (n + TILE_K - 1) / TILE_K, .n_kb_full = n / TILE_K,
                .n_mb = (rows + TILE_ROWS - 1) / TILE_ROWS, .n_db = (d + TILE_ROWS - 1) / TILE_ROWS,
        };
        uint16_t *wpad = NULL;
        uint32_t *xp;
        size_t xp_bytes;

        if (ctx.n_kb > SIZE_MAX / TILE_WORDS / sizeof(uint32_t) / ctx.n_mb)
                return TSR_E_LIMIT;
        xp_bytes = ctx.n_mb * ctx.n_kb * TILE_WORDS * sizeof(uint32_t);
        xp = aligned_alloc(64, xp_bytes);       /* a multiple of 1 KiB */
        if (!xp)
                return TSR_E_NOMEM;
        if (d < TILE_ROWS) {    /* a block of 16 rows would read past w: pad a copy */
                wpad = calloc(TILE_ROWS * n, sizeof *wpad);
                if (!wpad) {
                        free(xp);
                        return TSR_E_NOMEM;
                }
                memcpy(wpad, w, d * n * sizeof *wpad);
                ctx.w = wpad;
                ctx.w_rows = TILE_ROWS;
        }
        struct pack_ctx pc = {.xp = xp, .x = x, .rows = rows, .n = n, .n_kb = ctx.n_kb};
        tsr_pool_run(pool, ctx.n_mb, pack_task, &pc);
        ctx.xp = xp;
        /* About TASKS_PER_THREAD tasks per thread (claimed dynamically, so a thread that
         * loses its core does not hold the rest back), each a whole number of pairs. */
        size_t want = (size_t)tsr_pool_threads(pool) * TASKS_PER_THREAD;
        ctx.blocks_per_task = (ctx.n_db + want - 1) / want;
        ctx.blocks_per_task += ctx.blocks_per_task & 1;
        tsr_pool_run(pool, (ctx.n_db + ctx.blocks_per_task - 1) / ctx.blocks_per_task, amx_task, &ctx);
        free(wpad);
        free(xp);
        return TSR_OK;
}

#else   /* not x86-64 Linux: no AMX */

bool tsr_amx_init(void) { return false; }

bool tsr_amx_int8(void) { return false; }

tsr_status tsr_amx_matmul_bf16(tsr_pool *pool, float *out, const float *x, const uint16_t *w, size_t rows, size_t n,
                               size_t d) {
        (void)pool, (void)out, (void)x, (void)w, (void)rows, (void)n, (void)d;
        return TSR_E_UNSUPPORTED;
}

#endif
