/* quant/fpmm.c - the fp8 e4m3 and NVFP4 matmul, scalar: the specification of fpmm.h.
 * Plain loops, like cpu/ref.c: never optimised; cpu/fpmm.c is tested against it bitwise. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant/fpmm.h"
#include "kernels/quant/quant.h"

bool tsr_fpmm_supported(tsr_dtype t) { return t == TSR_DTYPE_FP8_E4M3 || t == TSR_DTYPE_NVFP4; }

bool tsr_fpmm_scales_ok(const tsr_matmul_scales *s) {
        return s && isfinite(s->weight) && s->weight > 0 && isfinite(s->input) && s->input >= 0;
}

int tsr_fpmm_e2m1_x2(uint8_t code) {
        static const int8_t mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
        return code & 8 ? -mag[code & 7] : mag[code & 7];
}

void tsr_fpmm_fp8_quantize_row(const float *x, size_t n, float input, float *xq) {
        for (size_t k = 0; k < n; k++)
                xq[k] = tsr_fp8_e4m3_to_f32(tsr_f32_to_fp8_e4m3(x[k] / input));
}

void tsr_fpmm_nvfp4_quantize_row(const float *x, size_t n, float input, int8_t *a, float *sfa) {
        float gs = 1.0f / input;

        for (size_t b = 0; b < n / 16; b++) {
                const float *xb = x + 16 * b;
                float amax = 0.0f;
                bool finite = true;
                for (int k = 0; k < 16; k++) {
                        finite = finite && isfinite(xb[k]);
                        if (fabsf(xb[k]) > amax)
                                amax = fabsf(xb[k]);
                }
                if (!finite) {
                        memset(a + 16 * b, 0, 16);
                        sfa[b] = NAN;
                        continue;
                }
                float sf = tsr_fp8_e4m3_to_f32(tsr_f32_to_fp8_e4m3((gs * amax) / 6.0f));
                float os = sf != 0.0f ? 1.0f / (sf * (1.0f / gs)) : 0.0f;
                for (int k = 0; k < 16; k++)
                        a[16 * b + k] = (int8_t)tsr_fpmm_e2m1_x2(tsr_f32_to_e2m1(xb[k] * os));
                sfa[b] = sf;
        }
}

static float lanes_sum(const float lane[8]) {
        return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* One fp8 weight row . one activation row (quantized or not): the eight lanes. */
static float dot_fp8(const uint8_t *w, const float *x, size_t n) {
        float lane[8] = {0};
        for (size_t k = 0; k < n; k++)
                lane[k % 8] += x[k] * tsr_fp8_e4m3_to_f32(w[k]);
        return lanes_sum(lane);
}

/* One NVFP4 weight row (n/16 blocks of 9 bytes) . one W4A4 activation row. */
static float dot_nvfp4_w4a4(const uint8_t *w, const int8_t *a, const float *sfa, size_t n) {
        float lane[8] = {0};
        for (size_t b = 0; b < n / 16; b++) {
                const uint8_t *blk = w + 9 * b;
                int32_t i = 0;
                for (int k = 0; k < 16; k++) {
                        uint8_t byte = blk[1 + k / 2];
                        i += tsr_fpmm_e2m1_x2(k % 2 ? byte >> 4 : byte & 0x0f) * a[16 * b + k];
                }
                float t = ((float)i * (sfa[b] * tsr_fp8_e4m3_to_f32(blk[0]))) * 0.25f;
                lane[b % 8] += t;
        }
        return lanes_sum(lane);
}

/* One NVFP4 weight row . one float32 activation row (weight-only). */
static float dot_nvfp4_w4a16(const uint8_t *w, const float *x, size_t n) {
        float lane[8] = {0};
        for (size_t k = 0; k < n; k++) {
                const uint8_t *blk = w + 9 * (k / 16);
                uint8_t byte = blk[1 + k % 16 / 2];
                float wk = tsr_e2m1_to_f32(k % 2 ? byte >> 4 : byte & 0x0f) * tsr_fp8_e4m3_to_f32(blk[0]);
                lane[k % 8] += x[k] * wk;
        }
        return lanes_sum(lane);
}

tsr_status tsr_fpmm_ref(float *out, const float *x, const void *w, tsr_dtype t, const tsr_matmul_scales *s,
                        size_t rows, size_t n, size_t d) {
        size_t row_bytes;
        bool nv = t == TSR_DTYPE_NVFP4, act = s && s->input > 0;
        float *xq = NULL, *sfa = NULL;
        int8_t *a = NULL;

        if (!out || !x || !w || n == 0 || d == 0 || !tsr_fpmm_supported(t) || !tsr_fpmm_scales_ok(s) ||
            (nv && n % 16 != 0))
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        if (tsr_dtype_row_bytes(t, n, &row_bytes) != TSR_OK || rows > SIZE_MAX / n / sizeof(float))
                return TSR_E_LIMIT;
        if (act && nv) {
                a = malloc(rows * n);
                sfa = malloc(rows * (n / 16) * sizeof(float));
        } else if (act) {
                xq = malloc(rows * n * sizeof(float));
        }
        if (act && !xq && (!a || !sfa)) {
                free(a), free(sfa), free(xq);
                return TSR_E_NOMEM;
        }
        for (size_t r = 0; act && r < rows; r++) {
                if (nv)
                        tsr_fpmm_nvfp4_quantize_row(x + r * n, n, s->input, a + r * n, sfa + r * (n / 16));
                else
                        tsr_fpmm_fp8_quantize_row(x + r * n, n, s->input, xq + r * n);
        }
        float scale = act ? s->input * s->weight : s->weight;
        for (size_t i = 0; i < d; i++) {
                const uint8_t *wi = (const uint8_t *)w + i * row_bytes;
                for (size_t r = 0; r < rows; r++) {
                        float acc;
                        if (nv && act)
                                acc = dot_nvfp4_w4a4(wi, a + r * n, sfa + r * (n / 16), n);
                        else if (nv)
                                acc = dot_nvfp4_w4a16(wi, x + r * n, n);
                        else
                                acc = dot_fp8(wi, act ? xq + r * n : x + r * n, n);
                        out[r * d + i] = acc * scale;
                }
        }
        free(a), free(sfa), free(xq);
        return TSR_OK;
}
