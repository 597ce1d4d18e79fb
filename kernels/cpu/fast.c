/* cpu/fast.c - SIMD and threaded CPU kernels, bitwise equal to cpu/ref.c for float32.
 *
 * Where the speed comes from, and why the results cannot move:
 *  - Register blocking over OUTPUTS: a micro-kernel computes a tile of up to 4 weight rows
 *    x 3 rows of x at once, so each loaded vector of W or x feeds several dot products.
 *    Every output element still has its own accumulator running over k = 0, 8, 16, ...
 *    exactly as ref.c's dot_f32: one __m256 is ref's eight lanes, _mm256_mul_ps then
 *    _mm256_add_ps (never FMA: a fused multiply-add rounds once where ref rounds twice,
 *    and this file is compiled with -ffp-contract=off so the compiler cannot fuse
 *    them either), a masked tail that adds +0 to the unused lanes (a lane that starts at
 *    +0 is never -0, so +0 leaves it bitwise unchanged), and ref's final pairs, done with
 *    two hadds.  Tiles never split K, so the tile shape (which depends on rows and d)
 *    changes nothing.
 *  - Threads (pool.c) split OUTPUT elements only: chunks of weight rows for a matmul,
 *    (query row, head) pairs for attention.  Thread count and batch change nothing.
 *  - bfloat16 weights halve the bytes a memory-bound decode reads.  On AVX512_BF16 the
 *    dot products use VDPBF16PS, whose lane/pair order is this file's own but fixed per
 *    element (same kernel for any tile, no split K), so it is batch- and thread-invariant
 *    too; elsewhere the bf16 weights are widened and run in ref's order (bitwise).
 *    Where the CPU has AMX-BF16 and Linux grants the tile state, cpu/amx.c runs every
 *    bf16 matmul (decode rows included) on TDPBF16PS tiles instead, with its own fixed
 *    per-element order.
 *
 * exp (attention's softmax, silu) is exp.h's, whose 8- and 16-lane forms give the scalar
 * form's bits lane by lane; ref.c runs the scalar one.
 *
 * silu_mul (vectorised with that exp), add and rmsnorm are ref.c's functions run on
 * slices across the pool;
 * add_rmsnorm (the residual add fused with the next norm) has an AVX2 row kernel that
 * does ref's float adds, double squares and index-order double sum in one pass, and ref's
 * two float multiplies in a second.  The other ops (rope, softmax, ...) are cheap next to
 * the matmuls and are ref.c's as they are.
 *
 * Thread: ops run on the caller (the thread driving this backend: the engine thread, or
 * one rank's) plus the helpers of this backend's own pool.  All state is per backend
 * (struct cpu_fast), so backends with different pools run at once in one process. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_simd.h"
#include "kernels/cpu/exp.h"
#include "kernels/cpu/fpmm.h"
#include "kernels/quant/fpmm.h"
#include "kernels/cpu/kv_view.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/qmm.h"
#include "kernels/quant/qmm.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/ref.h"

#if defined(__x86_64__) || defined(__i386__)
#define FAST_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define AVX2_FN __attribute__((target("avx2")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))
#define BF16_TARGET "avx2,avx512f,avx512bw,avx512vl,avx512bf16"
#define BF16_FN __attribute__((target(BF16_TARGET)))
#define BF16_INLINE static inline __attribute__((always_inline, target(BF16_TARGET)))

/* Weight rows per pool task: a multiple of the 4-row tile, small enough that a decode
 * matmul of d = 576 rows still makes 36 tasks for the threads to share. */
#define ROWS_PER_TASK 16
/* Rows of x swept per pass over a task's weight rows: 48 x 1536 floats = 288 KiB, in L2. */
#define X_ROWS_PER_PASS 48

/* One fast CPU backend's state (be->ctx): its pool and the ISA its ops run.  Set by
 * tsr_backend_cpu_new, read-only after; the pool's own state is the pool's. */
/* rope's cos and sin for the positions of its last call: a forward passes every layer's
 * q and k the same positions, so a step computes them once instead of 2 x n_layers
 * times (ref's values: (float)cos((double)theta), in libm's double sincos, which was
 * 1.6% of a batch-32 decode step and more of a prefill).  Keyed by the positions and the
 * inv_freq values themselves (not their pointer, which a freed model's successor may
 * reuse).  Engine thread: one thread drives a backend (kernels.h). */
struct rope_cache {
        uint32_t *pos;          /* (rows,) */
        float *freq;            /* (half,) */
        float *cs;              /* (rows, half, 2): cos, sin */
        size_t rows, half, cap_rows, cap_half;
};

struct cpu_fast {
        tsr_pool *pool;         /* NULL: single-threaded */
        tsr_cpu_isa isa;        /* min(the config's max_isa, what the CPU supports) */
        struct rope_cache rope;
};

/* What the CPU supports: a fact about the machine, not backend state, found once under
 * pthread_once and only read after (AMX's grant is per process: amx.c asks once too). */
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static tsr_cpu_isa cpu_best = TSR_CPU_ISA_SCALAR;

#ifdef FAST_X86
/* CPUID.1:ECX bit 29.  Asked directly: clang's __builtin_cpu_supports has no "f16c". */
static bool cpu_has_f16c(void) {
        unsigned a, b, c, d;
        return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

static void detect(void) {
        tsr_cpu_isa best = TSR_CPU_ISA_SCALAR;
#ifdef FAST_X86
        __builtin_cpu_init();
        /* F16C and FMA with AVX2 (every AVX2 CPU has both): the GGUF block scales are f16,
         * and exp.h's vector exp is ref's fmaf steps. */
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c())
                best = TSR_CPU_ISA_AVX2;
        if (best == TSR_CPU_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
                best = TSR_CPU_ISA_AVX512_BF16;
        /* AMX tiles for the bf16 matmul; the rest stays on the AVX2 / AVX512 code. */
        if (best == TSR_CPU_ISA_AVX512_BF16 && tsr_amx_init())
                best = TSR_CPU_ISA_AMX_BF16;
#endif
        cpu_best = best;
}

tsr_cpu_isa tsr_cpu_isa_best(void) {
        pthread_once(&detect_once, detect);
        return cpu_best;
}

#ifdef FAST_X86

/* ---- the micro-kernels ------------------------------------------------------------------ */

/* _mm256_loadu_si256(tail_mask + 8 - r): the first r lanes set (0 < r < 8). */
static const int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* ref.c's ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) of one __m256 of lanes l0..l7. */
AVX2_INLINE float sum_lanes_ref_order(__m256 v) {
        __m256 t = _mm256_hadd_ps(v, v);        /* l0+l1, l2+l3, ., ., l4+l5, l6+l7, ., . */
        t = _mm256_hadd_ps(t, t);               /* (l0+l1)+(l2+l3) in lane 0, (l4+l5)+(l6+l7) in lane 4 */
        return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* sum_lanes_ref_order of four vectors at once: lane u of the result is v_u's sum, the
 * same adds in the same tree (hadd(v0, v1) holds v0's and v1's pairs, the second hadd
 * their quads, the last add the two halves), in three hadds and one add for the four. */
AVX2_INLINE __m128 sum_lanes_ref_order4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
        return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* out[b*ldo + a] = dot_f32(w + a*n, x + b*n, n) for a < NI, b < NR (NI <= 8, NR <= 4,
 * constants after inlining).  Each dot is ref.c's, bit for bit. */
AVX2_INLINE void tile_f32(const int NI, const int NR, const float *w, const float *x, size_t n, float *out,
                          size_t ldo) {
        __m256 acc[8][4];
        size_t k = 0;

#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        acc[a][b] = _mm256_setzero_ps();
        for (; k + 8 <= n; k += 8) {
                __m256 xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = _mm256_loadu_ps(x + b * n + k);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        __m256 wv = _mm256_loadu_ps(w + a * n + k);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(wv, xv[b]));
                }
        }
        if (k < n) {
                __m256i m = _mm256_loadu_si256((const __m256i *)(tail_mask + 8 - (n - k)));
                __m256 xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = _mm256_maskload_ps(x + b * n + k, m);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        __m256 wv = _mm256_maskload_ps(w + a * n + k, m);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(wv, xv[b]));
                }
        }
#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        out[(size_t)b * ldo + a] = sum_lanes_ref_order(acc[a][b]);
}

/* Eight bf16 weights widened to float32 (exact: the bf16 bits are the float's top half). */
AVX2_INLINE __m256 widen8_bf16(const uint16_t *p) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* As tile_f32 with bf16 weights widened and x already rounded through bf16 (xr, float32):
 * ref.c's tsr_ref_matmul_bf16 order, bit for bit. */
AVX2_INLINE void tile_bf16_widened(const int NI, const int NR, const uint16_t *w, const float *xr, size_t n,
                                   float *out, size_t ldo) {
        __m256 acc[8][4];
        size_t k = 0;

#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        acc[a][b] = _mm256_setzero_ps();
        for (; k + 8 <= n; k += 8) {
                __m256 xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = _mm256_loadu_ps(xr + b * n + k);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        __m256 wv = widen8_bf16(w + a * n + k);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(wv, xv[b]));
                }
        }
        if (k < n) {
                __m256i m = _mm256_loadu_si256((const __m256i *)(tail_mask + 8 - (n - k)));
                __m256 xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = _mm256_maskload_ps(xr + b * n + k, m);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        uint16_t pad[8] = {0};          /* bf16 +0 in the unused lanes */
                        memcpy(pad, w + a * n + k, (n - k) * sizeof(uint16_t));
                        __m256 wv = widen8_bf16(pad);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(wv, xv[b]));
                }
        }
#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        out[(size_t)b * ldo + a] = sum_lanes_ref_order(acc[a][b]);
}

/* AVX512_BF16: out[b*ldo + a] = dot of bf16 rows w + a*n and xb + b*n.  Per element:
 * sixteen float32 lanes, lane j taking the pairs k = 32m+2j, 32m+2j+1 for m = 0, 1, ...
 * in one VDPBF16PS each (pairs past n read as bf16 zero), then _mm512_reduce_add_ps's
 * fixed tree.  The same for every tile shape: NI, NR only choose how many run at once. */
BF16_INLINE void tile_bf16_dp(const int NI, const int NR, const uint16_t *w, const uint16_t *xb, size_t n,
                              float *out, size_t ldo) {
        __m512 acc[8][4];
        size_t k = 0;

#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        acc[a][b] = _mm512_setzero_ps();
        for (; k + 32 <= n; k += 32) {
                __m512bh xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = (__m512bh)_mm512_loadu_si512(xb + b * n + k);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + a * n + k);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv, xv[b]);
                }
        }
        if (k < n) {
                __mmask32 m = (__mmask32)((1ull << (n - k)) - 1);
                __m512bh xv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        xv[b] = (__m512bh)_mm512_maskz_loadu_epi16(m, xb + b * n + k);
#pragma GCC unroll 8
                for (int a = 0; a < NI; a++) {
                        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + a * n + k);
#pragma GCC unroll 4
                        for (int b = 0; b < NR; b++)
                                acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv, xv[b]);
                }
        }
#pragma GCC unroll 8
        for (int a = 0; a < NI; a++)
#pragma GCC unroll 4
                for (int b = 0; b < NR; b++)
                        out[(size_t)b * ldo + a] = _mm512_reduce_add_ps(acc[a][b]);
}

/* ---- matmul drivers: one task = ROWS_PER_TASK rows of W against every row of x ---------- */

enum mm_kind { MM_F32, MM_BF16_WIDENED, MM_BF16_DP };

struct mm_ctx {
        enum mm_kind kind;
        float *out;             /* (rows, d) */
        const float *x;         /* (rows, n) float32: MM_F32 the input, MM_BF16_WIDENED rounded via bf16 */
        const uint16_t *xb;     /* (rows, n) bf16 of x (MM_BF16_DP) */
        const void *w;          /* (d, n) float or bf16 */
        size_t rows, n, d;
};

/* The tiles of weight rows [i0, i1) x rows of x [r0, r1): 4x3 over the rows of x in
 * threes, then the one or two rows left (all of them at decode batch 1) in 8x1 tiles,
 * whose eight independent accumulator chains hide the add latency that a single dot
 * (one chain of dependent adds, by ref's order) cannot.  Rows of x outermost: each row
 * of out gets its ROWS_PER_TASK results (one cache line) in one go; the other nesting
 * revisits every row of out once per tile, and rows d floats apart (d a multiple of
 * 1024: 4 KiB apart) all fall in the same cache set and evict each other.
 * T(NI, NR, i, r) runs one tile. */
#define SWEEP(T)                                                                          \
        do {                                                                              \
                size_t rf = r0 + (r1 - r0) / 3 * 3, i, r;                                 \
                for (r = r0; r < rf; r += 3) {                                            \
                        for (i = i0; i + 4 <= i1; i += 4)                                 \
                                T(4, 3, i, r);                                            \
                        for (; i < i1; i++)                                               \
                                T(1, 3, i, r);                                            \
                }                                                                         \
                for (r = rf; r < r1; r++) {                                               \
                        for (i = i0; i + 8 <= i1; i += 8)                                 \
                                T(8, 1, i, r);                                            \
                        for (; i + 4 <= i1; i += 4)                                       \
                                T(4, 1, i, r);                                            \
                        for (; i < i1; i++)                                               \
                                T(1, 1, i, r);                                            \
                }                                                                         \
        } while (0)

AVX2_FN static void mm_f32_range(const struct mm_ctx *c, size_t i0, size_t i1, size_t r0, size_t r1) {
        const float *w = c->w;
#define T_F32(NI, NR, i, r) tile_f32(NI, NR, w + (i) * c->n, c->x + (r) * c->n, c->n, c->out + (r) * c->d + (i), c->d)
        SWEEP(T_F32);
#undef T_F32
}

AVX2_FN static void mm_bf16_widened_range(const struct mm_ctx *c, size_t i0, size_t i1, size_t r0, size_t r1) {
        const uint16_t *w = c->w;
#define T_BW(NI, NR, i, r) \
        tile_bf16_widened(NI, NR, w + (i) * c->n, c->x + (r) * c->n, c->n, c->out + (r) * c->d + (i), c->d)
        SWEEP(T_BW);
#undef T_BW
}

BF16_FN static void mm_bf16_dp_range(const struct mm_ctx *c, size_t i0, size_t i1, size_t r0, size_t r1) {
        const uint16_t *w = c->w;
#define T_DP(NI, NR, i, r) \
        tile_bf16_dp(NI, NR, w + (i) * c->n, c->xb + (r) * c->n, c->n, c->out + (r) * c->d + (i), c->d)
        SWEEP(T_DP);
#undef T_DP
}

static void mm_task(void *ctx, size_t task, int worker) {
        const struct mm_ctx *c = ctx;
        size_t i0 = task * ROWS_PER_TASK, i1 = i0 + ROWS_PER_TASK < c->d ? i0 + ROWS_PER_TASK : c->d;

        (void)worker;
        for (size_t r0 = 0; r0 < c->rows; r0 += X_ROWS_PER_PASS) {
                size_t r1 = r0 + X_ROWS_PER_PASS < c->rows ? r0 + X_ROWS_PER_PASS : c->rows;
                switch (c->kind) {
                case MM_F32:
                        mm_f32_range(c, i0, i1, r0, r1);
                        break;
                case MM_BF16_WIDENED:
                        mm_bf16_widened_range(c, i0, i1, r0, r1);
                        break;
                case MM_BF16_DP:
                        mm_bf16_dp_range(c, i0, i1, r0, r1);
                        break;
                }
        }
}

static void mm_run(const struct cpu_fast *f, struct mm_ctx *c) {
        tsr_pool_run_spans(f->pool, (c->d + ROWS_PER_TASK - 1) / ROWS_PER_TASK, mm_task, c);
}

static tsr_status fast_matmul_f32(const struct cpu_fast *f, float *out, const float *x, const float *w, size_t rows,
                                  size_t n, size_t d) {
        if (f->isa < TSR_CPU_ISA_AVX2)
                return tsr_ref_matmul_f32(out, x, w, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        struct mm_ctx c = {.kind = MM_F32, .out = out, .x = x, .w = w, .rows = rows, .n = n, .d = d};
        mm_run(f, &c);
        return TSR_OK;
}

/* x through bf16 for the VDPBF16PS path, as ref.c rounds it (bf16_simd.h). */
BF16_FN static void round_x_bf16(uint16_t *xb, const float *x, size_t count) {
        tsr_bf16_round_row(xb, x, count);
}

static tsr_status fast_matmul_bf16(const struct cpu_fast *f, float *out, const float *x, const uint16_t *w,
                                   size_t rows, size_t n, size_t d) {
        if (f->isa < TSR_CPU_ISA_AVX2)
                return tsr_ref_matmul_bf16(out, x, w, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        if (rows > SIZE_MAX / sizeof(float) / n)
                return TSR_E_LIMIT;
        /* AMX for every rows count, one alone too: a row's order must not depend on the batch. */
        if (f->isa >= TSR_CPU_ISA_AMX_BF16)
                return tsr_amx_matmul_bf16(f->pool, out, x, w, rows, n, d);
        struct mm_ctx c = {.out = out, .w = w, .rows = rows, .n = n, .d = d};
        void *buf;
        /* x through bf16 once per call, O(rows*n) next to the matmul's O(rows*n*d). */
        if (f->isa >= TSR_CPU_ISA_AVX512_BF16) {
                uint16_t *xb = malloc(rows * n * sizeof *xb);
                if (!xb)
                        return TSR_E_NOMEM;
                round_x_bf16(xb, x, rows * n);
                c.kind = MM_BF16_DP;
                c.xb = xb;
                buf = xb;
        } else {
                float *xr = malloc(rows * n * sizeof *xr);
                if (!xr)
                        return TSR_E_NOMEM;
                for (size_t i = 0; i < rows * n; i++)
                        xr[i] = tsr_bf16_to_f32(tsr_f32_to_bf16(x[i]));
                c.kind = MM_BF16_WIDENED;
                c.x = xr;
                buf = xr;
        }
        mm_run(f, &c);
        free(buf);
        return TSR_OK;
}

/* ---- attention: one task per (query row, KV group), or per pair of rows (a prefill on
 * AVX-512: att_pair_task below) ----------------------------------------------------------- */

struct att_ctx {
        float *out;
        const float *q;
        const tsr_kv_view *kv;
        size_t past_len, n, n_heads, group;
        float scale;
        bool avx512;            /* the softmax's exp on 16 lanes (else 8) */
        size_t scores_stride;   /* a task's scores: (ATT_HEADS_MAX, scores_stride) floats in
                                 * its thread's own scratch (tsr_thread_scratch) */
        _Atomic bool no_memory; /* set by a task whose scratch could not grow */
        /* fp8 view (but an e4m3 decode step's): every cached row's K and V as float32,
         * (past_len + n, n_kv_heads, head_dim) each, filled once per call (deq_task) before
         * the attention tasks */
        float *kd, *vd;
        float k_lut[256], v_lut[256];   /* fp8: float(code) * scale, kv_fp8_load's values */
        /* What the heads read: K, V (the cache's f32 arrays, or kd, vd), and each cached
         * token's row offset in them, found once per call (kv_row's division by the block
         * size was a tenth of the tasks' time when each pass over the keys redid it) */
        const float *kb, *vb;
        /* a bf16 or e4m3 view is read as it is stored, each element converted as it is
         * loaded (to the float32 the reference reads, so the same bits): kt says how */
        int kt;                         /* ATT_F32, ATT_BF16, ATT_E4M3 */
        const uint16_t *kb16, *vb16;
        const uint8_t *kb8, *vb8;
        size_t *rowoff;                 /* (past_len + n) */
};

#define DEQ_ROWS_PER_TASK 64
#define ATT_HEADS_MAX 8         /* heads of a KV group one pass takes (tile_f32's rows) */

/* Rows task * DEQ_ROWS_PER_TASK .. of an fp8 view into c->kd, c->vd through the tables:
 * the values ref.c's kv_fp8_load gives, so the attention below reads ref's floats. */
static void deq_task(void *ctx, size_t task, int worker) {
        struct att_ctx *c = ctx;
        const tsr_kv_view *kv = c->kv;
        size_t width = kv->n_kv_heads * kv->head_dim, rows = c->past_len + c->n;
        (void)worker;
        for (size_t j = task * DEQ_ROWS_PER_TASK; j < rows && j < (task + 1) * DEQ_ROWS_PER_TASK; j++) {
                const uint8_t *kj = kv->k8 + kv_row(kv, j), *vj = kv->v8 + kv_row(kv, j);
                float *kr = c->kd + j * width, *vr = c->vd + j * width;
                for (size_t i = 0; i < width; i++) {
                        kr[i] = c->k_lut[kj[i]];
                        vr[i] = c->v_lut[vj[i]];
                }
        }
}

/* Head g of cached token j: its offset in elements in the arrays (c->kb and c->vb: the
 * f32 cache or the call's dequantized copy (deq_task); c->kb16 and c->vb16: a bf16
 * cache). */
static inline size_t att_head(const struct att_ctx *c, size_t j, size_t g) {
        return c->rowoff[j] + g * c->kv->head_dim;
}

/* Eight bf16 values widened to float32: exact (the bits shifted up), as tsr_bf16_to_f32. */
AVX2_INLINE __m256 bf16x8_load(const uint16_t *p) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* s[j] = tsr_exp(s[j] - m) for j < n, 8 lanes at a time (the tail one by one: the same
 * bits, exp.h), then the same on 16 lanes with a masked tail. */
__attribute__((target("avx2,fma"))) static void exp_sub_avx2(float *s, size_t n, float m) {
        __m256 mv = _mm256_set1_ps(m);
        size_t j = 0;
        for (; j + 8 <= n; j += 8)
                _mm256_storeu_ps(s + j, tsr_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
        for (; j < n; j++)
                s[j] = tsr_exp(s[j] - m);
}

__attribute__((target("avx512f"))) static void exp_sub_avx512(float *s, size_t n, float m) {
        __m512 mv = _mm512_set1_ps(m);
        for (size_t j = 0; j < n; j += 16) {
                __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
                _mm512_mask_storeu_ps(s + j, k, tsr_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
        }
}

/* s[j] = s[j] / sum for j < n: IEEE division per element, so 8 lanes are ref's bits. */
AVX2_FN static void div_row(float *s, size_t n, float sum) {
        __m256 sv = _mm256_set1_ps(sum);
        size_t j = 0;
        for (; j + 8 <= n; j += 8)
                _mm256_storeu_ps(s + j, _mm256_div_ps(_mm256_loadu_ps(s + j), sv));
        for (; j < n; j++)
                s[j] = s[j] / sum;
}

/* Keys ahead that the attention loops prefetch, and the prefetch of one head's row (of
 * `bytes`). */
#define ATT_PREFETCH 8
AVX2_INLINE void att_prefetch(const void *row, size_t bytes) {
        for (size_t o = 0; o < bytes; o += 64)
                _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}

/* How the attention tasks read the cache (a compile-time argument of the helpers below,
 * so each form is its own code): float32 (the f32 cache, or an fp8 cache's dequantized
 * copy), bf16 widened as it loads, e4m3 converted as it loads (a decode step). */
enum { ATT_F32, ATT_BF16, ATT_E4M3 };

/* Eight e4m3 codes as float(code) * scale with the bits of ref's table (kv_fp8_load):
 * the code's seven magnitude bits moved into float32's exponent and mantissa fields and
 * the result times 2^120 (exact: the biases are 7 and 127; a subnormal code lands on a
 * float subnormal, and nothing here flushes those), the sign bit on top, the NaN codes
 * (S.1111.111) replaced by ref's NaN of that sign; then one float product with the
 * scale, as the table's entries are made. */
AVX2_INLINE __m256 e4m3x8_load(const uint8_t *p, __m256 scale) {
        __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
        __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(mag, 20), sign)),
                                 _mm256_set1_ps(0x1p120f));
        __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
        if (!_mm256_testz_ps(nan, nan)) {       /* only a NaN input stores these */
                __m256 qnan = _mm256_or_ps(_mm256_set1_ps(tsr_fp8_e4m3_to_f32(0x7f)), _mm256_castsi256_ps(sign));
                v = _mm256_blendv_ps(v, qnan, nan);
        }
        return _mm256_mul_ps(v, scale);
}

/* The head's row of token j (K or V) prefetched, as stored. */
AVX2_INLINE void att_prefetch_head(const int KT, const struct att_ctx *c, bool is_v, size_t j, size_t g) {
        size_t off = att_head(c, j, g), hd = c->kv->head_dim;
        if (KT == ATT_BF16)
                att_prefetch((is_v ? c->vb16 : c->kb16) + off, hd * sizeof(uint16_t));
        else if (KT == ATT_E4M3)
                att_prefetch((is_v ? c->vb8 : c->kb8) + off, hd);
        else
                att_prefetch((is_v ? c->vb : c->kb) + off, hd * sizeof(float));
}

/* Eight of K_j's or V_j's head as float32, read as stored (a bf16 widened, an e4m3
 * code converted and scaled: kv_bf16_load's and the fp8 table's values). */
AVX2_INLINE __m256 att_k8(const int KT, const struct att_ctx *c, size_t off) {
        return KT == ATT_BF16   ? bf16x8_load(c->kb16 + off)
               : KT == ATT_E4M3 ? e4m3x8_load(c->kb8 + off, _mm256_set1_ps(c->kv->k_scale))
                                : _mm256_loadu_ps(c->kb + off);
}

AVX2_INLINE __m256 att_v8(const int KT, const struct att_ctx *c, size_t off) {
        return KT == ATT_BF16   ? bf16x8_load(c->vb16 + off)
               : KT == ATT_E4M3 ? e4m3x8_load(c->vb8 + off, _mm256_set1_ps(c->kv->v_scale))
                                : _mm256_loadu_ps(c->vb + off);
}

AVX2_INLINE float att_v1(const int KT, const struct att_ctx *c, size_t off) {
        return KT == ATT_BF16 ? tsr_bf16_to_f32(c->vb16[off]) : KT == ATT_E4M3 ? c->v_lut[c->vb8[off]] : c->vb[off];
}

/* dot[a] = dot_f32(q + a*n, K_j, n) for a < NH, K_j read as stored: tile_f32's, or the
 * same chains over K_j's values converted as they load (att_k8), the tail's lanes past
 * n zero as tile_f32's mask makes them (a zero element converts to +0): the same bits. */
AVX2_INLINE void att_dots(const int NH, const int KT, const struct att_ctx *c, const float *q, size_t off,
                          size_t n, float *dot) {
        if (KT == ATT_F32) {
                tile_f32(NH, 1, q, c->kb + off, n, dot, 1);
                return;
        }
        __m256 acc[8];
        size_t k = 0;
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                acc[a] = _mm256_setzero_ps();
        for (; k + 8 <= n; k += 8) {
                __m256 xv = att_k8(KT, c, off + k);
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
                        acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_loadu_ps(q + a * n + k), xv));
        }
        if (k < n) {
                __m256i m = _mm256_loadu_si256((const __m256i *)(tail_mask + 8 - (n - k)));
                __m256 xv;
                if (KT == ATT_BF16) {
                        uint16_t tail[8] = {0};
                        memcpy(tail, c->kb16 + off + k, (n - k) * sizeof *tail);
                        xv = bf16x8_load(tail);
                } else {
                        uint8_t tail[8] = {0};
                        memcpy(tail, c->kb8 + off + k, n - k);
                        xv = e4m3x8_load(tail, _mm256_set1_ps(c->kv->k_scale));
                }
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
                        acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_maskload_ps(q + a * n + k, m), xv));
        }
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                dot[a] = sum_lanes_ref_order(acc[a]);
}

/* att_dots' chains for n a multiple of 8, without their last step: acc[a] = head a's
 * eight lane sums of q_a . K_j (K_j read as stored, att_k8; for float32 the same chains
 * as tile_f32's). */
AVX2_INLINE void att_lanes(const int NH, const int KT, const struct att_ctx *c, const float *q, size_t off, size_t n,
                           __m256 *acc) {
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                acc[a] = _mm256_setzero_ps();
        for (size_t k = 0; k + 8 <= n; k += 8) {
                __m256 xv = att_k8(KT, c, off + k);
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
                        acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_loadu_ps(q + a * n + k), xv));
        }
}

/* ref's softmax of NH rows of scores (s, c->scores_stride apart) over keys 0 .. n_keys - 1,
 * max[a] their maximum: exp (exp.h's vector forms, the scalar's bits), the float sum in j
 * order (the NH heads' serial chains side by side), then P = s / sum. */
AVX2_INLINE void att_softmax(const int NH, const struct att_ctx *c, float *s, size_t n_keys, const float *max) {
        const size_t ss = c->scores_stride;
        float sum[8];

#pragma GCC unroll 8
        for (int a = 0; a < NH; a++) {
                if (c->avx512)
                        exp_sub_avx512(s + a * ss, n_keys, max[a]);
                else
                        exp_sub_avx2(s + a * ss, n_keys, max[a]);
                sum[a] = 0.0f;
        }
        for (size_t j = 0; j < n_keys; j++)
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
                        sum[a] += s[a * ss + j];
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                div_row(s + a * ss, n_keys, sum[a]);
}

/* ref_attention for NH (<= 8) heads of one KV group at one query row, each in ref's
 * order: scores by dot_f32 (tile_f32: head a's dot is its own chain, so running NH of
 * them over one read of K_j changes no bit), the maximum, exp (exp.h's vector forms, the
 * scalar's bits) and the float sum in j order (the NH heads' serial chains side by side),
 * P = s / sum, then out[i] = sum_j P[j] * V[j][i] over j in order for each i,
 * eight i at a time (elementwise, so vectors do not reorder anything), NH heads per read
 * of V_j.  The heads of a group share K and V (GQA): one pass over them for the group
 * instead of one per head, and NH independent chains where one head had one.  s:
 * NH rows of scores_stride floats. */
AVX2_INLINE void att_heads_t(const int NH, const int KT, const struct att_ctx *c, size_t p, size_t g,
                             const float *q, float *o, float *s) {
        const int U = NH >= 4 ? 1 : NH >= 2 ? 2 : 4;   /* eight-float columns per head in flight */
        const tsr_kv_view *kv = c->kv;
        const size_t hd = kv->head_dim, ss = c->scores_stride;
        float max[8];

#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                max[a] = -INFINITY;
        size_t jk = 0;
        /* Four keys at a time where the head has no tail: each key's chains as att_dots
         * runs them (att_lanes), the four reductions in one (sum_lanes_ref_order4), the
         * scale and the maximum in key order: the same bits as one key at a time. */
        if (hd % 8 == 0)
                for (; jk + 3 <= p; jk += 4) {
                        __m256 acc[4][8];
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++) {
                                if (jk + u + ATT_PREFETCH <= p)
                                        att_prefetch_head(KT, c, false, jk + u + ATT_PREFETCH, g);
                                att_lanes(NH, KT, c, q, att_head(c, jk + u, g), hd, acc[u]);
                        }
#pragma GCC unroll 8
                        for (int a = 0; a < NH; a++) {
                                __m128 d = sum_lanes_ref_order4(acc[0][a], acc[1][a], acc[2][a], acc[3][a]);
                                _mm_storeu_ps(s + a * ss + jk, _mm_mul_ps(d, _mm_set1_ps(c->scale)));
#pragma GCC unroll 4
                                for (int u = 0; u < 4; u++)
                                        if (s[a * ss + jk + u] > max[a])
                                                max[a] = s[a * ss + jk + u];
                        }
                }
        for (; jk <= p; jk++) {
                float dot[8];
                if (jk + ATT_PREFETCH <= p)     /* the cache's rows jump at each block: no stream */
                        att_prefetch_head(KT, c, false, jk + ATT_PREFETCH, g);
                att_dots(NH, KT, c, q, att_head(c, jk, g), hd, dot);
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++) {
                        s[a * ss + jk] = dot[a] * c->scale;
                        if (s[a * ss + jk] > max[a])
                                max[a] = s[a * ss + jk];
                }
        }
        att_softmax(NH, c, s, p + 1, max);
        size_t i = 0;
        for (; i + 8 * U <= hd; i += 8 * U) {
                __m256 acc[8][4];
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
#pragma GCC unroll 4
                        for (int u = 0; u < U; u++)
                                acc[a][u] = _mm256_setzero_ps();
                for (size_t j = 0; j <= p; j++) {
                        size_t vj = att_head(c, j, g) + i;
                        if (i == 0 && j + ATT_PREFETCH <= p)
                                att_prefetch_head(KT, c, true, j + ATT_PREFETCH, g);
                        __m256 v[4];
#pragma GCC unroll 4
                        for (int u = 0; u < U; u++)
                                v[u] = att_v8(KT, c, vj + 8 * u);
#pragma GCC unroll 8
                        for (int a = 0; a < NH; a++) {
                                __m256 pj = _mm256_set1_ps(s[a * ss + j]);
#pragma GCC unroll 4
                                for (int u = 0; u < U; u++)
                                        acc[a][u] = _mm256_add_ps(acc[a][u], _mm256_mul_ps(pj, v[u]));
                        }
                }
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
#pragma GCC unroll 4
                        for (int u = 0; u < U; u++)
                                _mm256_storeu_ps(o + a * hd + i + 8 * u, acc[a][u]);
        }
        for (; i + 8 <= hd; i += 8)
                for (int a = 0; a < NH; a++) {
                        __m256 a0 = _mm256_setzero_ps();
                        for (size_t j = 0; j <= p; j++) {
                                __m256 vj = att_v8(KT, c, att_head(c, j, g) + i);
                                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(s[a * ss + j]), vj));
                        }
                        _mm256_storeu_ps(o + a * hd + i, a0);
                }
        for (; i < hd; i++)
                for (int a = 0; a < NH; a++) {
                        float acc = 0.0f;
                        for (size_t j = 0; j <= p; j++)
                                acc += s[a * ss + j] * att_v1(KT, c, att_head(c, j, g) + i);
                        o[a * hd + i] = acc;
                }
}

/* att_heads_t for nh (<= 8) heads of group g at one query row, the cache read as c->kt says. */
AVX2_FN static void att_heads(const struct att_ctx *c, size_t nh, size_t p, size_t g, const float *q, float *o,
                              float *s) {
#define ATT_HEADS(KT)                                                       \
        switch (nh) {                                                       \
        case 1: att_heads_t(1, KT, c, p, g, q, o, s); break;                \
        case 2: att_heads_t(2, KT, c, p, g, q, o, s); break;                \
        case 3: att_heads_t(3, KT, c, p, g, q, o, s); break;                \
        case 4: att_heads_t(4, KT, c, p, g, q, o, s); break;                \
        case 5: att_heads_t(5, KT, c, p, g, q, o, s); break;                \
        case 6: att_heads_t(6, KT, c, p, g, q, o, s); break;                \
        case 7: att_heads_t(7, KT, c, p, g, q, o, s); break;                \
        default: att_heads_t(8, KT, c, p, g, q, o, s); break;               \
        }
        if (c->kt == ATT_BF16)
                ATT_HEADS(ATT_BF16)
        else if (c->kt == ATT_E4M3)
                ATT_HEADS(ATT_E4M3)
        else
                ATT_HEADS(ATT_F32)
#undef ATT_HEADS
}

/* ---- two query rows of a prefill at once (AVX-512) ----------------------------------------
 * Query rows t and t + 1 of one call see the same keys 0 .. p (p = past_len + t) and the
 * same values, and row t + 1 one more, p + 1.  With 512-bit vectors, each of ref's
 * eight-lane chains of row t runs in the low half and the same chain of row t + 1 in the
 * high half of one vector, K_j's and V_j's eight floats broadcast to both halves: one
 * read of K and V and one instruction serve both rows.  Nothing crosses the halves, so
 * each row's dots (att_lanes' chains, sum_lanes_ref_order's tree), maximum, softmax and
 * outputs are att_heads_t's bits, which are ref's.  Key p + 1 is row t + 1's alone: its
 * dot by att_dots, its value added to the high half only (a masked add: a zero product
 * in the low half would leave row t unchanged for finite values, but not for an inf).
 * Prefill only (a decode step has one row per sequence); float32 and bf16 caches (an fp8
 * cache with several rows is read through its float32 copy). */

#define PAIR_TARGET "avx2,avx512f,avx512dq"
#define PAIR_INLINE static inline __attribute__((always_inline, target(PAIR_TARGET)))

/* Row t's eight values in the low half and row t + 1's in the high half. */
PAIR_INLINE __m512 pair_of(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

/* att_lanes for both rows: acc[a] = head a's eight lane sums of row t's q . K_j (low half)
 * and row t + 1's (high half); qp: the heads' q rows in pairs (hd / 8 vectors a head). */
PAIR_INLINE void pair_lanes(const int NH, const int KT, const struct att_ctx *c, const __m512 *qp, size_t off,
                            size_t hd, __m512 *acc) {
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
                acc[a] = _mm512_setzero_ps();
        for (size_t k = 0; k < hd; k += 8) {
                __m512 kv = _mm512_broadcast_f32x8(att_k8(KT, c, off + k));
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++)
                        acc[a] = _mm512_add_ps(acc[a], _mm512_mul_ps(qp[a * (hd / 8) + k / 8], kv));
        }
}

/* Outputs i .. i + 8U - 1 of NH heads for both rows: sum_j P[j] * V[j][i] in j order. */
PAIR_INLINE void pair_pv(const int NH, const int U, const int KT, const struct att_ctx *c, size_t p, size_t g,
                         size_t i, const float *s0, const float *s1, float *o0, float *o1) {
        const size_t ss = c->scores_stride, hd = c->kv->head_dim;
        __m512 acc[8][4], v[4];

#pragma GCC unroll 8
        for (int a = 0; a < NH; a++)
#pragma GCC unroll 4
                for (int u = 0; u < U; u++)
                        acc[a][u] = _mm512_setzero_ps();
        for (size_t j = 0; j <= p; j++) {
                size_t vj = att_head(c, j, g) + i;
                if (i == 0 && j + ATT_PREFETCH <= p + 1)
                        att_prefetch_head(KT, c, true, j + ATT_PREFETCH, g);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++)
                        v[u] = _mm512_broadcast_f32x8(att_v8(KT, c, vj + 8 * u));
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++) {
                        __m512 pj = pair_of(_mm256_set1_ps(s0[a * ss + j]), _mm256_set1_ps(s1[a * ss + j]));
#pragma GCC unroll 4
                        for (int u = 0; u < U; u++)
                                acc[a][u] = _mm512_add_ps(acc[a][u], _mm512_mul_ps(pj, v[u]));
                }
        }
        size_t vl = att_head(c, p + 1, g) + i;  /* row t + 1's own last key */
#pragma GCC unroll 4
        for (int u = 0; u < U; u++)
                v[u] = _mm512_broadcast_f32x8(att_v8(KT, c, vl + 8 * u));
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++) {
                __m512 pj = _mm512_set1_ps(s1[a * ss + p + 1]);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++) {
                        acc[a][u] = _mm512_mask_add_ps(acc[a][u], 0xff00, acc[a][u], _mm512_mul_ps(pj, v[u]));
                        _mm256_storeu_ps(o0 + a * hd + i + 8 * u, _mm512_castps512_ps256(acc[a][u]));
                        _mm256_storeu_ps(o1 + a * hd + i + 8 * u, _mm512_extractf32x8_ps(acc[a][u], 1));
                }
        }
}

/* att_heads_t for query rows t (q0, o0, scores s0) and t + 1 (q1, o1, s1) at once, p =
 * row t's last key; head_dim a multiple of 8.  qp: room for NH * head_dim / 8 vectors. */
PAIR_INLINE void att_pair_t(const int NH, const int KT, const struct att_ctx *c, size_t p, size_t g, const float *q0,
                            const float *q1, float *o0, float *o1, float *s0, float *s1, __m512 *qp) {
        const int U = NH >= 4 ? 1 : NH >= 2 ? 2 : 4;
        const size_t hd = c->kv->head_dim, ss = c->scores_stride;
        float max0[8], max1[8], dot[8];

#pragma GCC unroll 8
        for (int a = 0; a < NH; a++) {
                max0[a] = max1[a] = -INFINITY;
                for (size_t k = 0; k < hd; k += 8)
                        qp[a * (hd / 8) + k / 8] = pair_of(_mm256_loadu_ps(q0 + a * hd + k),
                                                           _mm256_loadu_ps(q1 + a * hd + k));
        }
        size_t jk = 0;
        for (; jk + 3 <= p; jk += 4) {  /* four keys at a time, as att_heads_t */
                __m512 acc[4][8];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                        if (jk + u + ATT_PREFETCH <= p + 1)
                                att_prefetch_head(KT, c, false, jk + u + ATT_PREFETCH, g);
                        pair_lanes(NH, KT, c, qp, att_head(c, jk + u, g), hd, acc[u]);
                }
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++) {
                        __m128 d0 = sum_lanes_ref_order4(_mm512_castps512_ps256(acc[0][a]), _mm512_castps512_ps256(acc[1][a]),
                                                         _mm512_castps512_ps256(acc[2][a]), _mm512_castps512_ps256(acc[3][a]));
                        __m128 d1 = sum_lanes_ref_order4(_mm512_extractf32x8_ps(acc[0][a], 1),
                                                         _mm512_extractf32x8_ps(acc[1][a], 1),
                                                         _mm512_extractf32x8_ps(acc[2][a], 1),
                                                         _mm512_extractf32x8_ps(acc[3][a], 1));
                        _mm_storeu_ps(s0 + a * ss + jk, _mm_mul_ps(d0, _mm_set1_ps(c->scale)));
                        _mm_storeu_ps(s1 + a * ss + jk, _mm_mul_ps(d1, _mm_set1_ps(c->scale)));
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++) {
                                if (s0[a * ss + jk + u] > max0[a])
                                        max0[a] = s0[a * ss + jk + u];
                                if (s1[a * ss + jk + u] > max1[a])
                                        max1[a] = s1[a * ss + jk + u];
                        }
                }
        }
        for (; jk <= p; jk++) {
                __m512 acc[8];
                pair_lanes(NH, KT, c, qp, att_head(c, jk, g), hd, acc);
#pragma GCC unroll 8
                for (int a = 0; a < NH; a++) {
                        s0[a * ss + jk] = sum_lanes_ref_order(_mm512_castps512_ps256(acc[a])) * c->scale;
                        s1[a * ss + jk] = sum_lanes_ref_order(_mm512_extractf32x8_ps(acc[a], 1)) * c->scale;
                        if (s0[a * ss + jk] > max0[a])
                                max0[a] = s0[a * ss + jk];
                        if (s1[a * ss + jk] > max1[a])
                                max1[a] = s1[a * ss + jk];
                }
        }
        att_dots(NH, KT, c, q1, att_head(c, p + 1, g), hd, dot);      /* row t + 1's own key */
#pragma GCC unroll 8
        for (int a = 0; a < NH; a++) {
                s1[a * ss + p + 1] = dot[a] * c->scale;
                if (s1[a * ss + p + 1] > max1[a])
                        max1[a] = s1[a * ss + p + 1];
        }
        att_softmax(NH, c, s0, p + 1, max0);
        att_softmax(NH, c, s1, p + 2, max1);
        size_t i = 0;
        for (; i + 8 * U <= hd; i += 8 * U)
                pair_pv(NH, U, KT, c, p, g, i, s0, s1, o0, o1);
        for (; i < hd; i += 8)
                pair_pv(NH, 1, KT, c, p, g, i, s0, s1, o0, o1);
}

/* One pair task: query rows 2 tp and 2 tp + 1, KV group g (the last row of an odd n goes
 * alone, through att_heads_t). */
__attribute__((target(PAIR_TARGET))) static void att_pair_task(void *ctx, size_t task, int worker) {
        const struct att_ctx *c = ctx;
        size_t n_kv = c->kv->n_kv_heads, hd = c->kv->head_dim, t = task / n_kv * 2, g = task % n_kv;
        size_t p = c->past_len + t, ss = c->scores_stride;
        /* the heads' paired q rows (64-byte aligned at the scratch's start), then the two
         * rows' scores */
        __m512 *qp = tsr_thread_scratch(ATT_HEADS_MAX * hd / 8 * sizeof(__m512) + 2 * ATT_HEADS_MAX * ss * sizeof(float));

        (void)worker;
        if (!qp) {
                atomic_store_explicit(&((struct att_ctx *)ctx)->no_memory, true, memory_order_relaxed);
                return;
        }
        float *s0 = (float *)(qp + ATT_HEADS_MAX * hd / 8), *s1 = s0 + ATT_HEADS_MAX * ss;
        for (size_t h = g * c->group; h < (g + 1) * c->group; h += ATT_HEADS_MAX) {
                size_t nh = (g + 1) * c->group - h < ATT_HEADS_MAX ? (g + 1) * c->group - h : ATT_HEADS_MAX;
                const float *q0 = c->q + (t * c->n_heads + h) * hd, *q1 = q0 + c->n_heads * hd;
                float *o0 = c->out + (t * c->n_heads + h) * hd, *o1 = o0 + c->n_heads * hd;
                if (t + 1 == c->n) {    /* an odd n's last row */
                        att_heads(c, nh, p, g, q0, o0, s0);
                        continue;
                }
#define ATT_TWO(KT)                                                                             \
        switch (nh) {                                                                           \
        case 1: att_pair_t(1, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 2: att_pair_t(2, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 3: att_pair_t(3, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 4: att_pair_t(4, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 5: att_pair_t(5, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 6: att_pair_t(6, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        case 7: att_pair_t(7, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                  \
        default: att_pair_t(8, KT, c, p, g, q0, q1, o0, o1, s0, s1, qp); break;                 \
        }
                if (c->kt == ATT_BF16)
                        ATT_TWO(ATT_BF16)
                else
                        ATT_TWO(ATT_F32)
#undef ATT_TWO
        }
}

/* One task: query row t, KV group g, its heads in chunks of at most eight. */
AVX2_FN static void att_task(void *ctx, size_t task, int worker) {
        const struct att_ctx *c = ctx;
        size_t n_kv = c->kv->n_kv_heads, hd = c->kv->head_dim, t = task / n_kv, g = task % n_kv;
        size_t p = c->past_len + t;
        float *s = tsr_thread_scratch(ATT_HEADS_MAX * c->scores_stride * sizeof(float));

        (void)worker;
        if (!s) {
                atomic_store_explicit(&((struct att_ctx *)ctx)->no_memory, true, memory_order_relaxed);
                return;
        }

        for (size_t h = g * c->group; h < (g + 1) * c->group; h += ATT_HEADS_MAX) {
                size_t nh = (g + 1) * c->group - h < ATT_HEADS_MAX ? (g + 1) * c->group - h : ATT_HEADS_MAX;
                const float *q = c->q + (t * c->n_heads + h) * hd;
                float *o = c->out + (t * c->n_heads + h) * hd;
                att_heads(c, nh, p, g, q, o, s);
        }
}

static tsr_status fast_attention_run(const struct cpu_fast *f, float *out, const float *q, const tsr_kv_view *kv,
                                     size_t n, size_t past_len, size_t n_heads, float scale) {
        if (f->isa < TSR_CPU_ISA_AVX2)
                return tsr_ref_attention(out, q, kv, n, past_len, n_heads, scale);
        if (!out || !q || n_heads == 0 || !kv_view_ok(kv, past_len + n) || n_heads % kv->n_kv_heads != 0)
                return TSR_E_INVAL;
        if (n == 0)
                return TSR_OK;
        /* An fp8 cache is read through a float32 copy of its rows (deq_task: one conversion
         * per element), except an e4m3 cache at one query row, a decode step, whose tasks
         * convert each element as they load it (one conversion per element there too, and
         * no copy to write and read back: 2x at batch 32; for a prefill of n rows the
         * tasks would convert every element n times).  Both read the same floats. */
        bool fp8 = tsr_dtype_is_fp8(kv->dtype), copy = fp8 && (kv->dtype == TSR_DTYPE_FP8_E5M2 || n > 1);
        struct att_ctx *c = malloc(sizeof *c);  /* heap: the two tables are 2 KiB */
        if (!c)
                return TSR_E_NOMEM;
        *c = (struct att_ctx){
                .out = out, .q = q, .kv = kv, .past_len = past_len, .n = n, .n_heads = n_heads,
                .group = n_heads / kv->n_kv_heads, .scale = scale, .avx512 = f->isa >= TSR_CPU_ISA_AVX512_BF16,
                .scores_stride = past_len + n,
                .kt = kv->dtype == TSR_DTYPE_BF16 ? ATT_BF16 : fp8 && !copy ? ATT_E4M3 : ATT_F32,
        };
        tsr_status st = TSR_E_NOMEM;
        size_t rows = past_len + n, width = kv->n_kv_heads * kv->head_dim;
        if (fp8)
                for (unsigned b = 0; b < 256; b++) {
                        kv_fp8_load(kv->dtype, &c->k_lut[b], (const uint8_t[]){(uint8_t)b}, 1, kv->k_scale);
                        kv_fp8_load(kv->dtype, &c->v_lut[b], (const uint8_t[]){(uint8_t)b}, 1, kv->v_scale);
                }
        if (copy) {
                if (rows > SIZE_MAX / sizeof(float) / width / 2 ||
                    !(c->kd = malloc(2 * rows * width * sizeof(float))))
                        goto done;
                c->vd = c->kd + rows * width;
                tsr_pool_run(f->pool, (rows + DEQ_ROWS_PER_TASK - 1) / DEQ_ROWS_PER_TASK, deq_task, c);
        }
        c->kb = copy ? c->kd : kv->k;
        c->vb = copy ? c->vd : kv->v;
        c->kb16 = kv->k16;
        c->vb16 = kv->v16;
        c->kb8 = kv->k8;
        c->vb8 = kv->v8;
        if (!(c->rowoff = malloc(rows * sizeof *c->rowoff)))
                goto done;
        for (size_t j = 0; j < rows; j++)       /* the copy is dense; the cache is paged */
                c->rowoff[j] = copy ? j * width : kv_row(kv, j);
        /* a prefill on AVX-512: two query rows a task (att_pair_task) */
        if (c->avx512 && n >= 2 && kv->head_dim % 8 == 0 && c->kt != ATT_E4M3)
                tsr_pool_run(f->pool, (n + 1) / 2 * kv->n_kv_heads, att_pair_task, c);
        else
                tsr_pool_run(f->pool, n * kv->n_kv_heads, att_task, c);
        st = atomic_load(&c->no_memory) ? TSR_E_NOMEM : TSR_OK;
done:
        free(c->rowoff);
        free(c->kd);
        free(c);
        return st;
}

#else  /* not x86: only the reference's scalar code (cpu_best stays TSR_CPU_ISA_SCALAR) */

static tsr_status fast_matmul_f32(const struct cpu_fast *f, float *out, const float *x, const float *w, size_t rows,
                                  size_t n, size_t d) {
        (void)f;
        return tsr_ref_matmul_f32(out, x, w, rows, n, d);
}

static tsr_status fast_matmul_bf16(const struct cpu_fast *f, float *out, const float *x, const uint16_t *w,
                                   size_t rows, size_t n, size_t d) {
        (void)f;
        return tsr_ref_matmul_bf16(out, x, w, rows, n, d);
}

static tsr_status fast_attention_run(const struct cpu_fast *f, float *out, const float *q, const tsr_kv_view *kv,
                                     size_t n, size_t past_len, size_t n_heads, float scale) {
        (void)f;
        return tsr_ref_attention(out, q, kv, n, past_len, n_heads, scale);
}

#endif

/* ---- elementwise and per-row ops: ref.c's own functions on slices, across the pool ----
 * Each output element (silu_mul, add) or row (rmsnorm) depends on its own inputs only,
 * so running ref's function on slices is bitwise ref's whole-array result; silu_mul and
 * add_rmsnorm run vector forms of ref's, bitwise too. */

#define ELEMS_PER_TASK 16384    /* below this an op runs on the caller alone */

struct slice_ctx {
        int op;                 /* 0 silu_mul, 1 add, 2 rmsnorm, 3 add_rmsnorm */
        tsr_cpu_isa isa;        /* the backend's (silu_mul's and add_rmsnorm's kernels) */
        float *out;
        float *residual;        /* add_rmsnorm only */
        const float *a, *b;     /* silu_mul: gate, up; add: a, b; rmsnorm, add_rmsnorm: x, w */
        size_t n, dim, per_task;
        float eps;
};

#ifdef FAST_X86
/* One row of add_rmsnorm, bitwise ref_add_rmsnorm's (ref_add then ref_rmsnorm):
 *  pass 1: res[i] = res[i] + x[i] (the same float add, 8 lanes at a time), and the
 *          square of each stored sum widened to double (exact: a float's 24-bit
 *          significand squared fits in double's 53) added to ss one by one in index
 *          order, ref's serial double sum;
 *  pass 2: out[i] = (res[i] * scale) * w[i], ref's two float multiplies in its order.
 * The serial double sum bounds pass 1's speed, as in ref; what the fusion saves is the
 * separate add's read and write of the row.  out may alias x: x is done with before
 * pass 2 writes out. */
AVX2_FN static void add_rmsnorm_row_avx2(float *out, float *res, const float *x, const float *w, size_t dim,
                                         float eps) {
        double ss = 0.0, sq[8];
        size_t i = 0;

        for (; i + 8 <= dim; i += 8) {
                __m256 s = _mm256_add_ps(_mm256_loadu_ps(res + i), _mm256_loadu_ps(x + i));
                _mm256_storeu_ps(res + i, s);
                __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(s));
                __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1));
                _mm256_storeu_pd(sq, _mm256_mul_pd(lo, lo));
                _mm256_storeu_pd(sq + 4, _mm256_mul_pd(hi, hi));
                for (int j = 0; j < 8; j++)
                        ss += sq[j];
        }
        for (; i < dim; i++) {
                res[i] = res[i] + x[i];
                ss += (double)res[i] * (double)res[i];
        }
        float scale = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
        __m256 sv = _mm256_set1_ps(scale);
        for (i = 0; i + 8 <= dim; i += 8)
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(res + i), sv),
                                                        _mm256_loadu_ps(w + i)));
        for (; i < dim; i++)
                out[i] = res[i] * scale * w[i];
}
#endif

#ifdef FAST_X86
/* ref_silu_mul, g * (1 / (1 + exp(-g))) * up, each step one IEEE operation per lane in
 * ref's order with exp.h's exp (-g flips the sign bit, as ref's negation does): bitwise
 * ref's.  out may alias gate or up: each vector is read before it is written. */
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(float *out, const float *gate, const float *up,
                                                              size_t n) {
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
                __m256 g = _mm256_loadu_ps(gate + i);
                __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, tsr_exp8(_mm256_xor_ps(g, sign))));
                _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sg), _mm256_loadu_ps(up + i)));
        }
        tsr_ref_silu_mul(out + i, gate + i, up + i, n - i);
}

__attribute__((target("avx512f"))) static void silu_mul_avx512(float *out, const float *gate, const float *up,
                                                               size_t n) {
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);
        for (size_t i = 0; i < n; i += 16) {
                __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
                __m512 g = _mm512_maskz_loadu_ps(k, gate + i);
                __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
                __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, tsr_exp16(neg)));
                __m512 u = _mm512_maskz_loadu_ps(k, up + i);
                _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(_mm512_mul_ps(g, sg), u));
        }
}
#endif

/* silu_mul over n elements at the backend's ISA. */
static void silu_mul_span(tsr_cpu_isa isa, float *out, const float *gate, const float *up, size_t n) {
#ifdef FAST_X86
        if (isa >= TSR_CPU_ISA_AVX512_BF16) {
                silu_mul_avx512(out, gate, up, n);
                return;
        }
        if (isa >= TSR_CPU_ISA_AVX2) {
                silu_mul_avx2(out, gate, up, n);
                return;
        }
#endif
        (void)isa;
        tsr_ref_silu_mul(out, gate, up, n);
}

/* Rows lo .. hi-1 of add_rmsnorm: the AVX2 row kernel where the ISA allows, else ref's. */
static void add_rmsnorm_rows(const struct slice_ctx *c, size_t lo, size_t hi) {
        size_t dim = c->dim;

#ifdef FAST_X86
        if (c->isa >= TSR_CPU_ISA_AVX2) {
                for (size_t r = lo; r < hi; r++)
                        add_rmsnorm_row_avx2(c->out + r * dim, c->residual + r * dim, c->a + r * dim, c->b, dim,
                                             c->eps);
                return;
        }
#endif
        tsr_ref_add_rmsnorm(c->out + lo * dim, c->residual + lo * dim, c->a + lo * dim, c->b, hi - lo, dim, c->eps);
}

static void slice_task(void *ctx, size_t task, int worker) {
        const struct slice_ctx *c = ctx;
        size_t lo = task * c->per_task, hi = lo + c->per_task < c->n ? lo + c->per_task : c->n;

        (void)worker;
        if (c->op == 0)
                silu_mul_span(c->isa, c->out + lo, c->a + lo, c->b + lo, hi - lo);
        else if (c->op == 1)
                tsr_ref_add(c->out + lo, c->a + lo, c->b + lo, hi - lo);
        else if (c->op == 2)    /* lo, hi count rows */
                tsr_ref_rmsnorm(c->out + lo * c->dim, c->a + lo * c->dim, c->b, hi - lo, c->dim, c->eps);
        else                    /* rows too */
                add_rmsnorm_rows(c, lo, hi);
}

static void slice_run(const struct cpu_fast *f, struct slice_ctx *c, size_t elems_per_unit) {
        size_t units_per_task = ELEMS_PER_TASK / elems_per_unit + 1;
        c->per_task = units_per_task;
        tsr_pool_run(f->pool, (c->n + units_per_task - 1) / units_per_task, slice_task, c);
}

static tsr_status fast_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n) {
        const struct cpu_fast *f = be->ctx;
        if (!out || !gate || !up)
                return tsr_ref_silu_mul(out, gate, up, n);
        if (!f->pool || n < 2 * ELEMS_PER_TASK) {
                silu_mul_span(f->isa, out, gate, up, n);
                return TSR_OK;
        }
        struct slice_ctx c = {.op = 0, .isa = f->isa, .out = out, .a = gate, .b = up, .n = n};
        slice_run(f, &c, 1);
        return TSR_OK;
}

static tsr_status fast_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        const struct cpu_fast *f = be->ctx;
        if (!f->pool || n < 2 * ELEMS_PER_TASK || !out || !a || !b)
                return tsr_ref_add(out, a, b, n);
        struct slice_ctx c = {.op = 1, .out = out, .a = a, .b = b, .n = n};
        slice_run(f, &c, 1);
        return TSR_OK;
}

static tsr_status fast_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                               float eps) {
        const struct cpu_fast *f = be->ctx;
        if (!f->pool || dim == 0 || rows * dim < 2 * ELEMS_PER_TASK || !out || !x || !w)
                return tsr_ref_rmsnorm(out, x, w, rows, dim, eps);
        struct slice_ctx c = {.op = 2, .out = out, .a = x, .b = w, .n = rows, .dim = dim, .eps = eps};
        slice_run(f, &c, dim);
        return TSR_OK;
}

/* Rows split across the pool like rmsnorm's; below two tasks' worth (a decode step of a
 * small batch) the caller runs them alone, still on the row kernel. */
static tsr_status fast_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps) {
        const struct cpu_fast *f = be->ctx;
        if (!out || !residual || !x || !w || dim == 0)
                return TSR_E_INVAL;
        struct slice_ctx c = {.op = 3, .isa = f->isa, .out = out, .residual = residual, .a = x, .b = w, .n = rows,
                              .dim = dim, .eps = eps};
        if (!f->pool || rows * dim < 2 * ELEMS_PER_TASK) {
                add_rmsnorm_rows(&c, 0, rows);
                return TSR_OK;
        }
        slice_run(f, &c, dim);
        return TSR_OK;
}

/* ---- the backend: table, constructor ------------------------------------------------------ */

/* The weight dtype picks the kernel (the wrapper has checked it is one of ours). */
static tsr_status fast_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                              size_t rows, size_t n, size_t d) {
        const struct cpu_fast *f = be->ctx;
        switch (w_dtype) {
        case TSR_DTYPE_F32:
                return fast_matmul_f32(f, out, x, w, rows, n, d);
        case TSR_DTYPE_BF16:
                return fast_matmul_bf16(f, out, x, w, rows, n, d);
        default:                /* the GGUF blocks: int8 activations (cpu/qmm.c) */
                break;
        }
        return tsr_qmm_supported(w_dtype) ? tsr_cpu_qmm(f->pool, f->isa, out, x, w, w_dtype, rows, n, d)
                                          : TSR_E_UNSUPPORTED;
}

static tsr_status fast_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                     const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        const struct cpu_fast *f = be->ctx;
        return tsr_cpu_fpmm(f->pool, f->isa, out, x, w, w_dtype, s, rows, n, d);
}

static tsr_status fast_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                 size_t past_len, size_t n_heads, float scale) {
        return fast_attention_run(be->ctx, out, q, kv, n, past_len, n_heads, scale);
}

/* The ops without a fast version: the reference's, as they are. */
static tsr_status fast_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                 size_t dim, const uint32_t *ids, size_t rows) {
        (void)be;
        return tsr_ref_embedding(out, table, dtype, vocab, dim, ids, rows);
}

/* Make rc hold cos and sin for pos (rows) and inv_freq (half), unless it does already.
 * False when out of memory (rc then holds nothing). */
static bool rope_cache_fill(struct rope_cache *rc, const uint32_t *pos, size_t rows, const float *inv_freq,
                            size_t half) {
        if (rc->rows == rows && rc->half == half && memcmp(rc->pos, pos, rows * sizeof *pos) == 0 &&
            memcmp(rc->freq, inv_freq, half * sizeof *inv_freq) == 0)
                return true;
        rc->rows = rc->half = 0;
        if (rows > rc->cap_rows || half > rc->cap_half) {
                size_t cr = rows > rc->cap_rows ? rows : rc->cap_rows, ch = half > rc->cap_half ? half : rc->cap_half;
                free(rc->pos);
                free(rc->freq);
                free(rc->cs);
                rc->pos = malloc(cr * sizeof *rc->pos);
                rc->freq = malloc(ch * sizeof *rc->freq);
                rc->cs = cr <= SIZE_MAX / 2 / sizeof(float) / ch ? malloc(cr * ch * 2 * sizeof *rc->cs) : NULL;
                rc->cap_rows = rc->cap_half = 0;
                if (!rc->pos || !rc->freq || !rc->cs)
                        return false;
                rc->cap_rows = cr;
                rc->cap_half = ch;
        }
        for (size_t r = 0; r < rows; r++)
                for (size_t i = 0; i < half; i++) {
                        float theta = (float)pos[r] * inv_freq[i];      /* ref.c's rope, the same values */
                        rc->cs[(r * half + i) * 2] = (float)cos((double)theta);
                        rc->cs[(r * half + i) * 2 + 1] = (float)sin((double)theta);
                }
        memcpy(rc->pos, pos, rows * sizeof *pos);
        memcpy(rc->freq, inv_freq, half * sizeof *inv_freq);
        rc->rows = rows;
        rc->half = half;
        return true;
}

/* ref.c's rope, bitwise: the same cos and sin (from the cache) and the same four
 * multiplies and two adds per pair. */
static tsr_status fast_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                            const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        struct cpu_fast *f = be->ctx;
        size_t half = head_dim / 2;

        if (!x || !pos || !inv_freq || head_dim == 0 || head_dim % 2 != 0 ||
            (layout != TSR_ROPE_NEOX && layout != TSR_ROPE_INTERLEAVED))
                return TSR_E_INVAL;
        if (rows == 0 || !rope_cache_fill(&f->rope, pos, rows, inv_freq, half))
                return tsr_ref_rope(x, rows, n_heads, head_dim, pos, inv_freq, layout);
        const float *cs = f->rope.cs;
        for (size_t r = 0; r < rows; r++)
                for (size_t i = 0; i < half; i++) {
                        float c = cs[(r * half + i) * 2], s = cs[(r * half + i) * 2 + 1];
                        size_t ia = layout == TSR_ROPE_NEOX ? i : 2 * i;
                        size_t ib = layout == TSR_ROPE_NEOX ? i + half : 2 * i + 1;
                        for (size_t h = 0; h < n_heads; h++) {
                                float *xh = x + (r * n_heads + h) * head_dim;
                                float a = xh[ia], b = xh[ib];
                                xh[ia] = a * c - b * s;
                                xh[ib] = b * c + a * s;
                        }
                }
        return TSR_OK;
}

static tsr_status fast_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                                size_t past_len) {
        (void)be;
        return tsr_ref_kv_write(kv, k, v, n, past_len);
}

static tsr_status fast_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_softmax(out, x, rows, n);
}

static tsr_status fast_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_log_softmax(out, x, rows, n);
}

static tsr_status fast_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_argmax(out, x, rows, n);
}

static tsr_status fast_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        (void)be;
        return tsr_ref_sample(out, x, rows, n, draws);
}

static void fast_ctx_free(void *ctx) {
        struct cpu_fast *f = ctx;
        if (!f)
                return;
        tsr_pool_free(&f->pool);
        free(f->rope.pos);
        free(f->rope.freq);
        free(f->rope.cs);
        free(f);
}

static tsr_status fast_host_tasks(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx) {
        tsr_pool_run(((struct cpu_fast *)be->ctx)->pool, n_tasks, task, ctx);
        return TSR_OK;
}

static const tsr_backend_ops cpu_fast_ops = {
        .name = "cpu-fast",
        .host_memory = true,
        .matmul_dtypes = 1u << TSR_DTYPE_F32 | 1u << TSR_DTYPE_BF16 | TSR_QMM_DTYPES | TSR_FPMM_DTYPES,
        .ctx_free = fast_ctx_free,
        .mem_alloc = tsr_backend_host_alloc,
        .mem_free = tsr_backend_host_free,
        .upload = tsr_backend_host_copy,
        .download = tsr_backend_host_copy,
        .copy = tsr_backend_host_copy,
        .synchronize = tsr_backend_host_sync,
        .rmsnorm = fast_rmsnorm,
        .embedding = fast_embedding,
        .matmul = fast_matmul,
        .matmul_scaled = fast_matmul_scaled,
        .rope = fast_rope,
        .kv_write = fast_kv_write,
        .attention = fast_attention,
        .silu_mul = fast_silu_mul,
        .add = fast_add,
        .gather_rows = tsr_ref_be_gather_rows,
        .scatter_add_rows = tsr_ref_be_scatter_add_rows,
        .relu_sq = tsr_ref_be_relu_sq,
        .round_bf16 = tsr_ref_be_round_bf16,
        .mamba_mixer = tsr_cpu_mamba_mixer,
        .softmax = fast_softmax,
        .log_softmax = fast_log_softmax,
        .argmax = fast_argmax,
        .sample = fast_sample,
        .logit_rules = tsr_ref_be_logit_rules,  /* the reference's: a host backend's rows are */
        .logprobs = tsr_ref_be_logprobs,        /* the engine's already (answer.h: devices) */
        .add_rmsnorm = fast_add_rmsnorm,
        .host_tasks = fast_host_tasks,
};

tsr_status tsr_backend_cpu_new(const tsr_cpu_backend_config *cfg, tsr_backend **ret) {
        struct cpu_fast *f;
        int n_threads;

        if (!cfg || !ret || cfg->n_threads < 0)
                return TSR_E_INVAL;
        f = calloc(1, sizeof *f);
        if (!f)
                return TSR_E_NOMEM;
        f->isa = cfg->max_isa < tsr_cpu_isa_best() ? cfg->max_isa : tsr_cpu_isa_best();
        n_threads = cfg->n_threads ? cfg->n_threads : tsr_cpu_default_threads();
        if (n_threads > 1 && !(f->pool = tsr_pool_new(n_threads))) {
                free(f);
                return TSR_E_NOMEM;
        }
        return tsr_backend_make(&cpu_fast_ops, f, f->isa, n_threads > 1 ? n_threads : 1, ret);
}
