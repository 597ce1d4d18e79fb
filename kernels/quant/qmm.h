/* qmm.h - matmul on stored GGUF blocks with int8 activations: the scalar reference and
 * the pieces the SIMD version shares with it.  Internal to kernels/ (cpu/ref.c and
 * cpu/qmm.c); callers reach it through tsr_backend_matmul with a q* weight dtype.
 *
 * The computation (the specification; kernels.h names the dtypes that take it):
 *
 *  1. Each row of x is quantized on its own to int8 blocks (qmm_quantize_row): for the
 *     32-element formats (q8_0, q4_0, q4_1, q5_0, q5_1) one block per 32 elements, for the
 *     K formats (q4_K, q5_K, q6_K) one per 256.  Per block, with a = max |x_k|:
 *         dx = a / 127,  q_k = clamp(rint(x_k * (127 / a)), -127, 127)   (a = 0: dx = 0, q = 0)
 *     A block so small that 127 / a overflows (a < 127 / FLT_MAX, about 3.7e-37) is a zero
 *     block too (dx = 0, q = 0): x_k * inf would make a zero x_k NaN, and no int8 code says
 *     that (its contribution, under a * sum |w|, is below float32's normal range anyway).
 *     rint is round-to-nearest-even.  A block holding an infinity or a NaN gets dx = NaN
 *     (its q are 0), so the outputs it feeds are NaN, as a float32 dot product's would be.
 *     32-blocks also keep sx = dx * (float)sum_k q_k (the offset term of q4_1/q5_1); K
 *     blocks keep the integer sums of each 16 q's (the min term of q4_K/q5_K).
 *  2. Each weight row is decoded to integers without rounding (qmm_unpack_row):
 *     32-blocks: int8 w_k (q8_0 q; q4_0 q-8; q5_0 q-16; q4_1, q5_1 q) and floats dw, mw
 *     (mw = the f16 m of q4_1/q5_1, else 0), so the element is dw * w_k + mw.
 *     K blocks: int8 w_k (q4_K, q5_K q; q6_K q-32), an integer scale per 16 elements (the
 *     6-bit sub-block scale, or q6_K's int8 one), an integer min per 16 (q4_K, q5_K) and
 *     floats d, dmin, so the element is d*sc*w_k - dmin*mn.
 *  3. Per block b, exactly in integers, then one float32 term:
 *     32-blocks:  I = sum_k w_k q_k                      t_b = (dw*dx) * (float)I + mw * sx
 *     K blocks:   I1 = sum_k sc(k) w_k q_k,  I2 = sum_g mn_g * qsum_g
 *                                                        t_b = (d*dx) * (float)I1 - (dmin*dx) * (float)I2
 *     (no overflow: |I1| < 2^28 for every format).  Each product and sum rounds once, in
 *     this order (no FMA: kernels/ is built with -ffp-contract=off).
 *  4. The terms are summed as cpu/ref.c sums a float32 dot product: eight lanes, lane j
 *     adding t_b for b = j, j+8, ... in increasing b; then
 *     ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
 * Every step depends on the row of x and the row of W alone, never on the batch, the
 * tiling or the threads (kernels.h batch invariance); integer sums are exact in any
 * order, so a SIMD version that computes the same terms and lanes is bitwise this one.
 *
 * Fidelity against widening W to float32 (tsr_dequant_row) and running the float32
 * matmul: quantizing x moves each x_k by at most dx/2, so out moves by at most
 * sum_b (dx_b / 2) sum_{k in b} |w_k|, plus float32 rounding of order n u sum |w_k x_k|
 * on each side (tests/kernels/test_ops.c checks that bound on every format).
 *
 * Layouts of the scratch rows (bytes, each section 32-byte aligned from the row start,
 * which qmm_*_bytes keeps a multiple of 32).  The 32-block rows are padded with zeros to
 * a multiple of eight blocks (q, w to 256 bytes, the float arrays to 8 floats), so a SIMD
 * loop over eight blocks at a time needs no tail: a padding block's term is
 * (0*0)*0 + 0*0 = +0, which leaves its lane unchanged (a lane starting at +0 is never -0).
 *   activations, 32-blocks:  int8 q[n] | float dx[n/32] | float sx[n/32]
 *   activations, K blocks:   int8 q[n] | int16 qsum[n/16] | float dx[n/256]
 *   weights, 32-blocks:      int8 w[n] | float dw[n/32] | float mw[n/32]
 *   weights, K blocks:       int8 w[n] | int16 sc[n/2] (per PAIR of elements, so a SIMD
 *                            multiply-add reads it in place) | int16 mn[n/16] |
 *                            float d[n/256] | float dmin[n/256]
 * No state: any thread.  Non-logging. */
#ifndef TSR_KERNELS_QUANT_QMM_H
#define TSR_KERNELS_QUANT_QMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/dtype.h"

/* Their bits in tsr_backend_ops.matmul_dtypes. */
#define TSR_QMM_DTYPES                                                                                   \
        (1u << TSR_DTYPE_Q8_0 | 1u << TSR_DTYPE_Q4_0 | 1u << TSR_DTYPE_Q4_1 | 1u << TSR_DTYPE_Q5_0 |     \
         1u << TSR_DTYPE_Q5_1 | 1u << TSR_DTYPE_Q4_K | 1u << TSR_DTYPE_Q5_K | 1u << TSR_DTYPE_Q6_K)

/* The weight dtypes with an int8 matmul: q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K. */
bool tsr_qmm_supported(tsr_dtype t);
/* True for the K formats (256-element blocks, q8_K-style activations). */
bool tsr_qmm_is_k(tsr_dtype t);

/* Bytes of one quantized activation row / one unpacked weight row of n elements for
 * weights of `t` (a multiple of 32; n a multiple of t's block). */
size_t tsr_qmm_act_bytes(tsr_dtype t, size_t n);
size_t tsr_qmm_unpacked_bytes(tsr_dtype t, size_t n);

/* Step 1: x (n,) -> dst (tsr_qmm_act_bytes), the activation blocks for weights of `t`. */
void tsr_qmm_quantize_row(tsr_dtype t, const float *x, size_t n, void *dst);
/* Step 2: one weight row w (n elements of `t`, only byte-aligned) -> dst
 * (tsr_qmm_unpacked_bytes, 32-byte aligned). */
void tsr_qmm_unpack_row(tsr_dtype t, const void *w, size_t n, void *dst);
/* Steps 3-4 for one unpacked weight row and one activation row. */
float tsr_qmm_dot_ref(tsr_dtype t, const void *wu, const void *xq, size_t n);

/* The reference matmul: W (d, n) of `t` @ x[r] (n,) -> out[r] (d,) for r < rows, by the
 * steps above.  TSR_E_INVAL (NULL, n or d zero, n not a multiple of the block, t not one
 * of the dtypes above), TSR_E_LIMIT (sizes overflow), TSR_E_NOMEM; nothing written then. */
tsr_status tsr_qmm_ref(float *out, const float *x, const void *w, tsr_dtype t, size_t rows, size_t n, size_t d);

/* ---- the sections of the scratch rows (the layouts above) ---- */
static inline size_t tsr_qmm_align32(size_t b) { return (b + 31) & ~(size_t)31; }
/* Bytes of the int8 section: n, padded to eight 32-blocks. */
static inline size_t tsr_qmm_int8_bytes(size_t n) { return (n + 255) & ~(size_t)255; }

/* An activation row: q (n,); 32-blocks: dx, sx (n/32,); K blocks: qsum (n/16,), dx (n/256,). */
typedef struct tsr_qmm_act {
        int8_t *q;
        float *dx, *sx;
        int16_t *qsum;
} tsr_qmm_act;

/* An unpacked weight row: w (n,); 32-blocks: dw, mw (n/32,); K blocks: sc (n/2,), mn (n/16,),
 * d, dmin (n/256,). */
typedef struct tsr_qmm_w {
        int8_t *w;
        float *dw, *mw;
        int16_t *sc, *mn;
        float *d, *dmin;
} tsr_qmm_w;

static inline tsr_qmm_act tsr_qmm_act_at(tsr_dtype t, const void *row, size_t n) {
        uint8_t *p = (uint8_t *)row;
        size_t o = tsr_qmm_int8_bytes(n);
        tsr_qmm_act a = {.q = (int8_t *)p};

        if (tsr_qmm_is_k(t)) {
                a.qsum = (int16_t *)(p + o);
                a.dx = (float *)(p + o + tsr_qmm_align32(n / 16 * 2));
        } else {
                a.dx = (float *)(p + o);
                a.sx = (float *)(p + o + tsr_qmm_align32(n / 32 * 4));
        }
        return a;
}

static inline tsr_qmm_w tsr_qmm_w_at(tsr_dtype t, const void *row, size_t n) {
        uint8_t *p = (uint8_t *)row;
        size_t o = tsr_qmm_int8_bytes(n);
        tsr_qmm_w u = {.w = (int8_t *)p};

        if (tsr_qmm_is_k(t)) {
                u.sc = (int16_t *)(p + o);
                o += tsr_qmm_align32(n / 2 * 2);
                u.mn = (int16_t *)(p + o);
                o += tsr_qmm_align32(n / 16 * 2);
                u.d = (float *)(p + o);
                u.dmin = (float *)(p + o + tsr_qmm_align32(n / 256 * 4));
        } else {
                u.dw = (float *)(p + o);
                u.mw = (float *)(p + o + tsr_qmm_align32(n / 32 * 4));
        }
        return u;
}

#endif
