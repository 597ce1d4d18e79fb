/* quant/qmm.c - the int8 matmul on GGUF blocks, scalar: the specification of qmm.h.
 * Plain loops, like cpu/ref.c: never optimised; cpu/qmm.c is tested against it bitwise.
 * The block layouts are gguf.c's (each element decoded here as its deq_* decodes it,
 * stopping before the float32 multiply). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant/qmm.h"
#include "kernels/quant/quant.h"

bool tsr_qmm_supported(tsr_dtype t) {
        switch (t) {
        case TSR_DTYPE_Q8_0:
        case TSR_DTYPE_Q4_0:
        case TSR_DTYPE_Q4_1:
        case TSR_DTYPE_Q5_0:
        case TSR_DTYPE_Q5_1:
        case TSR_DTYPE_Q4_K:
        case TSR_DTYPE_Q5_K:
        case TSR_DTYPE_Q6_K:
                return true;
        default:
                return false;
        }
}

bool tsr_qmm_is_k(tsr_dtype t) { return t == TSR_DTYPE_Q4_K || t == TSR_DTYPE_Q5_K || t == TSR_DTYPE_Q6_K; }

size_t tsr_qmm_act_bytes(tsr_dtype t, size_t n) {
        if (tsr_qmm_is_k(t))
                return tsr_qmm_int8_bytes(n) + tsr_qmm_align32(n / 16 * 2) + tsr_qmm_align32(n / 256 * 4);
        return tsr_qmm_int8_bytes(n) + 2 * tsr_qmm_align32(n / 32 * 4);
}

size_t tsr_qmm_unpacked_bytes(tsr_dtype t, size_t n) {
        if (tsr_qmm_is_k(t))
                return tsr_qmm_int8_bytes(n) + tsr_qmm_align32(n / 2 * 2) + tsr_qmm_align32(n / 16 * 2) +
                       2 * tsr_qmm_align32(n / 256 * 4);
        return tsr_qmm_int8_bytes(n) + 2 * tsr_qmm_align32(n / 32 * 4);
}

/* ---- step 1: activations ------------------------------------------------------------ */

/* One block of `qk` floats -> q (qk,), returns dx (NaN for a non-finite block). */
static float quantize_block(const float *x, int qk, int8_t *q) {
        float amax = 0.0f;
        bool finite = true;

        for (int k = 0; k < qk; k++) {
                float a = fabsf(x[k]);
                finite = finite && isfinite(a);
                if (a > amax)
                        amax = a;
        }
        float id = 127.0f / amax;
        if (!finite || amax == 0.0f || isinf(id)) {     /* isinf: a block under 127 / FLT_MAX (qmm.h) */
                memset(q, 0, (size_t)qk);
                return finite ? 0.0f : NAN;
        }
        for (int k = 0; k < qk; k++) {
                float v = rintf(x[k] * id);
                q[k] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
        }
        return amax / 127.0f;
}

void tsr_qmm_quantize_row(tsr_dtype t, const float *x, size_t n, void *dst) {
        tsr_qmm_act a = tsr_qmm_act_at(t, dst, n);

        memset(dst, 0, tsr_qmm_act_bytes(t, n));        /* the padding (qmm.h) */
        if (tsr_qmm_is_k(t)) {
                for (size_t b = 0; b < n / 256; b++)
                        a.dx[b] = quantize_block(x + 256 * b, 256, a.q + 256 * b);
                for (size_t g = 0; g < n / 16; g++) {
                        int s = 0;
                        for (int k = 0; k < 16; k++)
                                s += a.q[16 * g + k];
                        a.qsum[g] = (int16_t)s;
                }
                return;
        }
        for (size_t b = 0; b < n / 32; b++) {
                int s = 0;
                a.dx[b] = quantize_block(x + 32 * b, 32, a.q + 32 * b);
                for (int k = 0; k < 32; k++)
                        s += a.q[32 * b + k];
                a.sx[b] = a.dx[b] * (float)s;
        }
}

/* ---- step 2: weights ------------------------------------------------------------------ */

static float rd_f16(const uint8_t *p) { return tsr_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

static uint32_t rd32(const uint8_t *p) {
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Element j (0..31) of the 4-bit codes qs[16] of a 32-block (low nibbles first). */
static int nib(const uint8_t *qs, int j) { return j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4; }

/* One 32-block -> w (32,), *dw, *mw. */
static void unpack32(tsr_dtype t, const uint8_t *b, int8_t *w, float *dw, float *mw) {
        *dw = rd_f16(b);
        *mw = 0.0f;
        for (int j = 0; j < 32; j++) {
                switch (t) {
                case TSR_DTYPE_Q8_0:
                        w[j] = (int8_t)b[2 + j];
                        break;
                case TSR_DTYPE_Q4_0:
                        w[j] = (int8_t)(nib(b + 2, j) - 8);
                        break;
                case TSR_DTYPE_Q4_1:
                        *mw = rd_f16(b + 2);
                        w[j] = (int8_t)nib(b + 4, j);
                        break;
                case TSR_DTYPE_Q5_0:
                        w[j] = (int8_t)((nib(b + 6, j) | (int)((rd32(b + 2) >> j) & 1) << 4) - 16);
                        break;
                default:        /* Q5_1 */
                        *mw = rd_f16(b + 2);
                        w[j] = (int8_t)(nib(b + 8, j) | (int)((rd32(b + 4) >> j) & 1) << 4);
                        break;
                }
        }
}

/* One 256-block -> w (256,), sc (128,) per pair, mn (16,), *d, *dmin. */
static void unpack256(tsr_dtype t, const uint8_t *b, int8_t *w, int16_t *sc, int16_t *mn, float *d,
                      float *dmin) {
        if (t == TSR_DTYPE_Q6_K) {
                const uint8_t *ql = b, *qh = b + 128;
                *d = rd_f16(b + 208);
                *dmin = 0.0f;
                for (int e = 0; e < 256; e++) {         /* e = 128h + 32k + l, as deq_q6_k */
                        int h = e / 128, k = e % 128 / 32, l = e % 32;
                        uint8_t lb = ql[64 * h + l + 32 * (k % 2)];
                        int lo = k < 2 ? (lb & 0x0f) : (lb >> 4);
                        w[e] = (int8_t)((lo | ((qh[32 * h + l] >> (2 * k)) & 3) << 4) - 32);
                }
                for (int g = 0; g < 16; g++) {
                        for (int p = 0; p < 8; p++)
                                sc[8 * g + p] = (int8_t)b[192 + g];
                        mn[g] = 0;
                }
                return;
        }
        const uint8_t *qh = b + 16, *qs = t == TSR_DTYPE_Q5_K ? b + 48 : b + 16;
        *d = rd_f16(b);
        *dmin = rd_f16(b + 2);
        for (int j = 0; j < 8; j++) {           /* sub-block j: elements 32j .. 32j+31 */
                int s, m;
                tsr_gguf_k_scale_min(j, b + 4, &s, &m);
                for (int p = 0; p < 16; p++)
                        sc[16 * j + p] = (int16_t)s;
                mn[2 * j] = mn[2 * j + 1] = (int16_t)m;
                for (int l = 0; l < 32; l++) {
                        uint8_t byte = qs[32 * (j / 2) + l];
                        int q = j % 2 ? byte >> 4 : byte & 0x0f;
                        if (t == TSR_DTYPE_Q5_K)
                                q |= ((qh[l] >> j) & 1) << 4;
                        w[32 * j + l] = (int8_t)q;
                }
        }
}

void tsr_qmm_unpack_row(tsr_dtype t, const void *w, size_t n, void *dst) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        const uint8_t *p = w;
        tsr_qmm_w u = tsr_qmm_w_at(t, dst, n);

        memset(dst, 0, tsr_qmm_unpacked_bytes(t, n));   /* the padding (qmm.h) */
        for (size_t b = 0; b < n / info->block_elems; b++) {
                const uint8_t *blk = p + b * info->block_bytes;
                if (tsr_qmm_is_k(t))
                        unpack256(t, blk, u.w + 256 * b, u.sc + 128 * b, u.mn + 16 * b, &u.d[b], &u.dmin[b]);
                else
                        unpack32(t, blk, u.w + 32 * b, &u.dw[b], &u.mw[b]);
        }
}

/* ---- steps 3 and 4 ------------------------------------------------------------------- */

float tsr_qmm_dot_ref(tsr_dtype t, const void *wu, const void *xq, size_t n) {
        tsr_qmm_w u = tsr_qmm_w_at(t, wu, n);
        tsr_qmm_act a = tsr_qmm_act_at(t, xq, n);
        float lane[8] = {0};

        if (tsr_qmm_is_k(t)) {
                for (size_t b = 0; b < n / 256; b++) {
                        int32_t i1 = 0, i2 = 0;
                        for (size_t k = 256 * b; k < 256 * b + 256; k++)
                                i1 += u.sc[k / 2] * u.w[k] * a.q[k];
                        for (size_t g = 16 * b; g < 16 * b + 16; g++)
                                i2 += u.mn[g] * a.qsum[g];
                        float t_b = (u.d[b] * a.dx[b]) * (float)i1 - (u.dmin[b] * a.dx[b]) * (float)i2;
                        lane[b % 8] += t_b;
                }
        } else {
                for (size_t b = 0; b < n / 32; b++) {
                        int32_t i = 0;
                        for (size_t k = 32 * b; k < 32 * b + 32; k++)
                                i += u.w[k] * a.q[k];
                        float t_b = (u.dw[b] * a.dx[b]) * (float)i + u.mw[b] * a.sx[b];
                        lane[b % 8] += t_b;
                }
        }
        return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* W (d, n) of t @ x[r] (n,) -> out[r] (d,): every row of x quantized once, every row of W
 * unpacked once, then one dot per output element. */
tsr_status tsr_qmm_ref(float *out, const float *x, const void *w, tsr_dtype t, size_t rows, size_t n, size_t d) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        size_t ab, wb, row_bytes;
        uint8_t *xq, *wu;

        if (!out || !x || !w || n == 0 || d == 0 || !tsr_qmm_supported(t) || n % info->block_elems != 0)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        ab = tsr_qmm_act_bytes(t, n);
        wb = tsr_qmm_unpacked_bytes(t, n);
        if (rows > SIZE_MAX / ab || tsr_dtype_row_bytes(t, n, &row_bytes) != TSR_OK)
                return TSR_E_LIMIT;
        xq = aligned_alloc(32, rows * ab);
        wu = aligned_alloc(32, wb);
        if (!xq || !wu) {
                free(xq), free(wu);
                return TSR_E_NOMEM;
        }
        for (size_t r = 0; r < rows; r++)
                tsr_qmm_quantize_row(t, x + r * n, n, xq + r * ab);
        for (size_t i = 0; i < d; i++) {
                tsr_qmm_unpack_row(t, (const uint8_t *)w + i * row_bytes, n, wu);
                for (size_t r = 0; r < rows; r++)
                        out[r * d + i] = tsr_qmm_dot_ref(t, wu, xq + r * ab, n);
        }
        free(xq), free(wu);
        return TSR_OK;
}
