/* cpu/ref.c - scalar reference kernels: the executable specification.
 * Never optimise this file; fast paths live elsewhere and are tested against it.
 *
 * Every reduction here runs in one fixed order that depends only on the length being
 * reduced, never on how many rows are in the call: that is the batch-invariance promise
 * of kernels.h.  Shapes are given llama2.c-style in the comments. */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/exp.h"
#include "kernels/cpu/kv_view.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/ref.h"
#include "kernels/quant/fpmm.h"
#include "kernels/quant/qmm.h"

/* The dot product every matmul and attention score uses.
 * a (n,) . b (n,) -> float
 * Order (the specification): eight running float partial sums, lane j adding the
 * terms k = j, j+8, j+16, ... in increasing k; then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
 * Eight independent lanes instead of one chain are still one fixed order, and they let
 * the compiler keep the lanes in vector registers, which makes this plain loop fast
 * enough to run a 135M model in the tests. */
static float dot_f32(const float *a, const float *b, size_t n) {
        float lane[8] = {0};
        size_t k = 0;

        for (; k + 8 <= n; k += 8)
                for (size_t j = 0; j < 8; j++)
                        lane[j] += a[k + j] * b[k + j];
        for (size_t j = 0; k + j < n; j++)
                lane[j] += a[k + j] * b[k + j];
        return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

tsr_status tsr_ref_rmsnorm(float *out, const float *x, const float *w, size_t rows, size_t dim, float eps) {
        if (!out || !x || !w || dim == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * dim;
                float *outr = out + r * dim;
                /* Sum of squares in one fixed order (index 0..dim-1), in double, so the
                 * result never depends on batch size: the batch-invariance promise. */
                double ss = 0.0;
                for (size_t i = 0; i < dim; i++)
                        ss += (double)xr[i] * (double)xr[i];
                float scale = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
                for (size_t i = 0; i < dim; i++)
                        outr[i] = xr[i] * scale * w[i];
        }
        return TSR_OK;
}

/* table (vocab, dim) float32 or bf16, ids (rows,) -> out (rows, dim) float32 */
tsr_status tsr_ref_embedding(float *out, const void *table, tsr_dtype dtype, size_t vocab, size_t dim,
                             const uint32_t *ids, size_t rows) {
        if (!out || !table || (!ids && rows) || dim == 0)
                return TSR_E_INVAL;
        if (dtype != TSR_DTYPE_F32 && dtype != TSR_DTYPE_BF16)
                return TSR_E_UNSUPPORTED;
        for (size_t r = 0; r < rows; r++)       /* check all ids before writing anything */
                if (ids[r] >= vocab)
                        return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                if (dtype == TSR_DTYPE_F32) {
                        memcpy(out + r * dim, (const float *)table + (size_t)ids[r] * dim, dim * sizeof(float));
                        continue;
                }
                const uint16_t *row = (const uint16_t *)table + (size_t)ids[r] * dim;
                for (size_t i = 0; i < dim; i++)
                        out[r * dim + i] = tsr_bf16_to_f32(row[i]);
        }
        return TSR_OK;
}

/* W (d,n) @ x[r] (n,) -> out[r] (d,), for r in 0..rows-1
 * x (rows, n), w (d, n) -> out (rows, d) */
tsr_status tsr_ref_matmul_f32(float *out, const float *x, const float *w, size_t rows, size_t n, size_t d) {
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        /* Weight row outermost so it is read from memory once per call and reused from
         * cache for every row of x; each element is still one dot_f32. */
        for (size_t i = 0; i < d; i++) {
                const float *wi = w + i * n;
                for (size_t r = 0; r < rows; r++)
                        out[r * d + i] = dot_f32(wi, x + r * n, n);
        }
        return TSR_OK;
}

uint16_t tsr_f32_to_bf16(float x) {
        uint32_t u;
        memcpy(&u, &x, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)    /* NaN: keep the sign and the top payload, force quiet */
                return (uint16_t)((u >> 16) | 0x0040u);
        u += 0x7fffu + ((u >> 16) & 1u);        /* round to nearest, ties to even; overflow gives inf */
        return (uint16_t)(u >> 16);
}

float tsr_bf16_to_f32(uint16_t h) {
        uint32_t u = (uint32_t)h << 16;
        float x;
        memcpy(&x, &u, sizeof x);
        return x;
}

/* W (d,n) bfloat16 @ x[r] (n,) -> out[r] (d,), for r in 0..rows-1
 * x (rows, n) float32, w (d, n) bfloat16 bits -> out (rows, d)
 * The same eight lanes and final pairs as dot_f32, over widen(w) and widen(round(x)). */
tsr_status tsr_ref_matmul_bf16(float *out, const float *x, const uint16_t *w, size_t rows, size_t n, size_t d) {
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        for (size_t i = 0; i < d; i++) {
                const uint16_t *wi = w + i * n;
                for (size_t r = 0; r < rows; r++) {
                        const float *xr = x + r * n;
                        float lane[8] = {0};
                        size_t k = 0;
                        for (; k + 8 <= n; k += 8)
                                for (size_t j = 0; j < 8; j++)
                                        lane[j] += tsr_bf16_to_f32(wi[k + j]) *
                                                   tsr_bf16_to_f32(tsr_f32_to_bf16(xr[k + j]));
                        for (size_t j = 0; k + j < n; j++)
                                lane[j] += tsr_bf16_to_f32(wi[k + j]) * tsr_bf16_to_f32(tsr_f32_to_bf16(xr[k + j]));
                        out[r * d + i] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                                         ((lane[4] + lane[5]) + (lane[6] + lane[7]));
                }
        }
        return TSR_OK;
}

/* x (rows, n_heads, head_dim), pos (rows,), inv_freq (head_dim/2,) -> x rotated in place.
 * For pair i of a head: θ = pos * inv_freq[i] (a float32 product, as HF computes it),
 *   a' = a cos θ - b sin θ
 *   b' = b cos θ + a sin θ
 * where (a, b) = (x[i], x[i + head_dim/2]) for NEOX and (x[2i], x[2i+1]) for INTERLEAVED. */
tsr_status tsr_ref_rope(float *x, size_t rows, size_t n_heads, size_t head_dim,
                           const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        size_t half = head_dim / 2;

        if (!x || !pos || !inv_freq || head_dim == 0 || head_dim % 2 != 0)
                return TSR_E_INVAL;
        if (layout != TSR_ROPE_NEOX && layout != TSR_ROPE_INTERLEAVED)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                for (size_t i = 0; i < half; i++) {
                        float theta = (float)pos[r] * inv_freq[i];
                        /* cos and sin of the float32 angle, rounded once to float32. */
                        float c = (float)cos((double)theta), s = (float)sin((double)theta);
                        for (size_t h = 0; h < n_heads; h++) {
                                float *xh = x + (r * n_heads + h) * head_dim;
                                size_t ia = layout == TSR_ROPE_NEOX ? i : 2 * i;
                                size_t ib = layout == TSR_ROPE_NEOX ? i + half : 2 * i + 1;
                                float a = xh[ia], b = xh[ib];
                                xh[ia] = a * c - b * s;
                                xh[ib] = b * c + a * s;
                        }
                }
        }
        return TSR_OK;
}

/* k, v (n, n_kv_heads, head_dim) -> cache rows past_len .. past_len+n-1 */
tsr_status tsr_ref_kv_write(const tsr_kv_view *kv, const float *k, const float *v, size_t n, size_t past_len) {
        if (!k || !v || !kv_view_ok(kv, past_len + n))
                return TSR_E_INVAL;
        size_t width = kv->n_kv_heads * kv->head_dim;
        for (size_t t = 0; t < n; t++) {
                size_t row = kv_row(kv, past_len + t);
                if (tsr_dtype_is_fp8(kv->dtype)) {
                        kv_fp8_store(kv->dtype, kv->k8 + row, k + t * width, width, kv->k_scale);
                        kv_fp8_store(kv->dtype, kv->v8 + row, v + t * width, width, kv->v_scale);
                } else if (kv->dtype == TSR_DTYPE_BF16) {
                        kv_bf16_store(kv->k16 + row, k + t * width, width);
                        kv_bf16_store(kv->v16 + row, v + t * width, width);
                } else {
                        memcpy(kv->k + row, k + t * width, width * sizeof(float));
                        memcpy(kv->v + row, v + t * width, width * sizeof(float));
                }
        }
        return TSR_OK;
}

/* Head g of cached token j as float32: the array itself for f32, else widened or
 * dequantized into buf (head_dim floats: kv_bf16_load, kv_fp8_load). */
static const float *ref_kv_head(const tsr_kv_view *kv, bool is_v, size_t j, size_t g, float *buf) {
        size_t off = kv_row(kv, j) + g * kv->head_dim;
        if (kv->dtype == TSR_DTYPE_F32)
                return (is_v ? kv->v : kv->k) + off;
        if (kv->dtype == TSR_DTYPE_BF16) {
                kv_bf16_load(buf, (is_v ? kv->v16 : kv->k16) + off, kv->head_dim);
                return buf;
        }
        kv_fp8_load(kv->dtype, buf, (is_v ? kv->v8 : kv->k8) + off, kv->head_dim, is_v ? kv->v_scale : kv->k_scale);
        return buf;
}

/* q (n, n_heads, head_dim), cache K, V (past_len+n, n_kv_heads, head_dim)
 *   -> out (n, n_heads, head_dim)
 * For query row t (position p = past_len + t) and head h, with g = h / (n_heads/n_kv_heads):
 *   s[j] = (q[t,h] . K[j,g]) * scale          for j = 0..p (causal)
 *   P[j] = exp(s[j] - max s) / sum_j' exp(s[j'] - max s)   (float32, sums in j order;
 *          exp is tsr_exp of cpu/exp.h, which the fast backend runs 8 or 16 lanes at a time)
 *   out[t,h] = sum_j P[j] * V[j,g]            (float32, in j order) */
tsr_status tsr_ref_attention(float *out, const float *q, const tsr_kv_view *kv, size_t n, size_t past_len,
                                size_t n_heads, float scale) {
        if (!out || !q || n_heads == 0 || !kv_view_ok(kv, past_len + n) || n_heads % kv->n_kv_heads != 0)
                return TSR_E_INVAL;
        size_t hd = kv->head_dim, group = n_heads / kv->n_kv_heads;
        float *s = malloc((past_len + n + hd) * sizeof(float)); /* scores of one (row, head), then */
        if (!s)                                                 /* one fp8 head dequantized */
                return TSR_E_NOMEM;
        float *head = s + past_len + n;

        for (size_t t = 0; t < n; t++) {
                size_t p = past_len + t;
                for (size_t h = 0; h < n_heads; h++) {
                        const float *qh = q + (t * n_heads + h) * hd;
                        size_t g = h / group;
                        float *oh = out + (t * n_heads + h) * hd;

                        float max = -INFINITY;
                        for (size_t j = 0; j <= p; j++) {
                                s[j] = dot_f32(qh, ref_kv_head(kv, false, j, g, head), hd) * scale;
                                if (s[j] > max)
                                        max = s[j];
                        }
                        float sum = 0.0f;
                        for (size_t j = 0; j <= p; j++) {
                                s[j] = tsr_exp(s[j] - max);
                                sum += s[j];
                        }
                        for (size_t i = 0; i < hd; i++)
                                oh[i] = 0.0f;
                        for (size_t j = 0; j <= p; j++) {
                                float pj = s[j] / sum;
                                const float *vj = ref_kv_head(kv, true, j, g, head);
                                for (size_t i = 0; i < hd; i++)
                                        oh[i] += pj * vj[i];
                        }
                }
        }
        free(s);
        return TSR_OK;
}

/* gate, up (n,) -> out (n,): out = gate * sigmoid(gate) * up, as torch's silu(x) = x * sigmoid(x);
 * exp is tsr_exp (cpu/exp.h), as in attention */
tsr_status tsr_ref_silu_mul(float *out, const float *gate, const float *up, size_t n) {
        if (!out || !gate || !up)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++) {
                float g = gate[i];
                out[i] = g * (1.0f / (1.0f + tsr_exp(-g))) * up[i];
        }
        return TSR_OK;
}

/* kernels.h tsr_backend_gather_rows, arguments checked: out row i = x row idx[i] (or i)
 * times scales[i] (or copied), element by element. */
tsr_status tsr_ref_gather_rows(float *out, const float *x, size_t dim, const uint32_t *idx, const float *scales,
                               size_t n) {
        for (size_t i = 0; i < n; i++) {
                const float *src = x + (idx ? (size_t)idx[i] : i) * dim;
                float *dst = out + i * dim;
                for (size_t d = 0; d < dim; d++)
                        dst[d] = scales ? src[d] * scales[i] : src[d];
        }
        return TSR_OK;
}

/* kernels.h tsr_backend_scatter_add_rows, arguments checked: dst row idx[i] += src row i
 * (times scales[i]: the product rounded first; the build never contracts to an FMA). */
tsr_status tsr_ref_scatter_add_rows(float *dst, size_t dim, const float *src, const uint32_t *idx,
                                    const float *scales, size_t n) {
        for (size_t i = 0; i < n; i++) {
                float *o = dst + (size_t)idx[i] * dim;
                const float *y = src + i * dim;
                for (size_t d = 0; d < dim; d++)
                        o[d] += scales ? y[d] * scales[i] : y[d];
        }
        return TSR_OK;
}

/* kernels.h tsr_backend_relu_sq: x * x where x > 0, else 0 (NaN stays NaN: NaN > 0 is
 * false, so it would become 0 - not what torch's relu(x)**2 gives; x * x keeps it). */
tsr_status tsr_ref_relu_sq(float *x, size_t n) {
        if (n && !x)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++)
                x[i] = x[i] > 0.0f || isnan(x[i]) ? x[i] * x[i] : 0.0f;
        return TSR_OK;
}

/* a, b (n,) -> out (n,) */
tsr_status tsr_ref_add(float *out, const float *a, const float *b, size_t n) {
        if (!out || !a || !b)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++)
                out[i] = a[i] + b[i];
        return TSR_OK;
}

/* x (rows, n) -> out (rows, n).  exp(x - max) in float32, their sum in double (index order). */
tsr_status tsr_ref_softmax(float *out, const float *x, size_t rows, size_t n) {
        if (!out || !x || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * n;
                float *outr = out + r * n;
                float max = xr[0];
                for (size_t i = 1; i < n; i++)
                        if (xr[i] > max)
                                max = xr[i];
                double sum = 0.0;
                for (size_t i = 0; i < n; i++) {
                        outr[i] = expf(xr[i] - max);
                        sum += outr[i];
                }
                for (size_t i = 0; i < n; i++)
                        outr[i] = (float)(outr[i] / sum);
        }
        return TSR_OK;
}

/* x (rows, n) -> out (rows,): the first maximum of each row, TSR_ARGMAX_NONE for a row
 * with NaN or +inf or only -inf (kernels.h; the sampler's greedy rule, sampler.c). */
tsr_status tsr_ref_argmax(uint32_t *out, const float *x, size_t rows, size_t n) {
        if (!out || !x || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * n;
                float max = -INFINITY;
                uint32_t best = TSR_ARGMAX_NONE;
                for (size_t i = 0; i < n; i++) {
                        if (isnan(xr[i]) || xr[i] == INFINITY) {
                                best = TSR_ARGMAX_NONE;
                                break;
                        }
                        if (xr[i] > max) {
                                max = xr[i];
                                best = (uint32_t)i;
                        }
                }
                out[r] = best;
        }
        return TSR_OK;
}

/* ---- sample: kernels.h's tsr_backend_sample, the specification cuda/sample.cu follows
 * step for step (the same float operations, each rounded once, and the same order of
 * every double sum), so both give the same token for the same row and u. */

/* Chunk c of n entries: [lo, hi). */
static void sample_chunk(size_t n, size_t c, size_t *lo, size_t *hi) {
        size_t len = (n + TSR_SAMPLE_CHUNKS - 1) / TSR_SAMPLE_CHUNKS;
        *lo = c * len < n ? c * len : n;
        *hi = *lo + len < n ? *lo + len : n;
}

/* The mass of the entries >= t: each chunk in index order, the chunk sums in order. */
static double sample_mass(const float *e, size_t n, float t) {
        double total = 0.0;
        for (size_t c = 0; c < TSR_SAMPLE_CHUNKS; c++) {
                size_t lo, hi;
                double s = 0.0;
                sample_chunk(n, c, &lo, &hi);
                for (size_t i = lo; i < hi; i++)
                        if (e[i] >= t)
                                s += (double)e[i];
                total += s;
        }
        return total;
}

static size_t sample_count(const float *e, size_t n, float t) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
                k += e[i] >= t;
        return k;
}

static float sample_f32(uint32_t u) {
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
}

/* The largest t among [0, 1] (by bits: e >= 0) with count(e >= t) >= k (mass_goal < 0)
 * or mass(e >= t) >= mass_goal: a bisection over the float bits, 30 halvings. */
static float sample_threshold(const float *e, size_t n, size_t k, double mass_goal) {
        uint32_t lo = 0, hi = 0x3f800001u;      /* bits(1.0f) + 1: nothing is above 1 */
        while (hi - lo > 1) {
                uint32_t mid = lo + (hi - lo) / 2;
                bool ok = mass_goal < 0 ? sample_count(e, n, sample_f32(mid)) >= k
                                        : sample_mass(e, n, sample_f32(mid)) >= mass_goal;
                if (ok)
                        lo = mid;
                else
                        hi = mid;
        }
        return sample_f32(lo);
}

/* One row: e in place of x; its token, or TSR_ARGMAX_NONE. */
static uint32_t sample_row(float *x, size_t n, const tsr_draw *d) {
        float xmax = -INFINITY;
        for (size_t i = 0; i < n; i++) {
                if (isnan(x[i]) || x[i] == INFINITY)
                        return TSR_ARGMAX_NONE;
                xmax = x[i] > xmax ? x[i] : xmax;
        }
        if (xmax == -INFINITY)
                return TSR_ARGMAX_NONE;
        float m = xmax / d->temperature;        /* the max of x / T: division is monotonic */
        for (size_t i = 0; i < n; i++) {
                float w = x[i] / d->temperature;
                x[i] = isinf(m) ? (w == m ? 1.0f : 0.0f) : tsr_exp(w - m);
        }
        if (d->min_p > 0.0f) {
                double z = sample_mass(x, n, 0.0f);
                float thr = (float)(1.0 / z) * d->min_p;
                for (size_t i = 0; i < n; i++)
                        if ((float)((double)x[i] / z) < thr)
                                x[i] = 0.0f;
        }
        if (d->top_k > 0 && (size_t)d->top_k < n) {
                float t = sample_threshold(x, n, (size_t)d->top_k, -1.0);
                for (size_t i = 0; i < n; i++)
                        if (x[i] < t)
                                x[i] = 0.0f;
        }
        if (d->top_p < 1.0f) {
                float t = sample_threshold(x, n, 0, (double)d->top_p * sample_mass(x, n, 0.0f));
                for (size_t i = 0; i < n; i++)
                        if (x[i] < t)
                                x[i] = 0.0f;
        }
        /* the draw: chunk by chunk, into the chunk whose sum takes the running sum past u x
         * total, there entry by entry; rounding that never passes it: the last entry > 0 */
        double target = d->u * sample_mass(x, n, 0.0f), cum = 0.0;
        for (size_t c = 0; c < TSR_SAMPLE_CHUNKS; c++) {
                size_t lo, hi;
                double s = 0.0;
                sample_chunk(n, c, &lo, &hi);
                for (size_t i = lo; i < hi; i++)
                        s += (double)x[i];
                if (!(cum + s > target)) {
                        cum += s;
                        continue;
                }
                for (size_t i = lo; i < hi; i++) {
                        if (x[i] <= 0.0f)
                                continue;
                        cum += (double)x[i];
                        if (cum > target)
                                return (uint32_t)i;
                }
        }
        for (size_t i = n; i-- > 0;)
                if (x[i] > 0.0f)
                        return (uint32_t)i;
        return TSR_ARGMAX_NONE;         /* unreachable: the maximum's e is 1 */
}

tsr_status tsr_ref_sample(uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        if (!out || !x || !draws || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++)
                if (draws[r].temperature != 0.0f)
                        out[r] = sample_row(x + r * n, n, &draws[r]);
        return TSR_OK;
}

/* log_softmax's two constants of one row: its maximum (the running one from x[0]) and
 * log(sum exp(x - max)) with the sum in double, index order, rounded to float once. */
static void log_softmax_consts(const float *xr, size_t n, float *max_out, float *lse_out) {
        float max = xr[0];
        for (size_t i = 1; i < n; i++)
                if (xr[i] > max)
                        max = xr[i];
        double sum = 0.0;
        for (size_t i = 0; i < n; i++)
                sum += exp((double)xr[i] - (double)max);
        *max_out = max;
        *lse_out = (float)log(sum);
}

/* x (rows, n) -> out (rows, n): x - max - log(sum exp(x - max)), the sum in double. */
tsr_status tsr_ref_log_softmax(float *out, const float *x, size_t rows, size_t n) {
        if (!out || !x || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * n;
                float *outr = out + r * n, max, lse;
                log_softmax_consts(xr, n, &max, &lse);
                for (size_t i = 0; i < n; i++)
                        outr[i] = (xr[i] - max) - lse;
        }
        return TSR_OK;
}

/* kernels.h tsr_backend_logit_rules, the specification: one row at a time, the lists in
 * order, each step one IEEE operation (the build has -ffp-contract=off). */
tsr_status tsr_ref_logit_rules(float *x, size_t rows, size_t n, const tsr_logit_rules *rules) {
        if (!x || !rules || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const tsr_logit_rules *q = &rules[r];
                float *xr = x + r * n;
                if (q->n_allowed) {     /* the allowed values kept aside, the row -inf, them back */
                        float *kept = malloc(q->n_allowed * sizeof *kept);
                        if (!kept)
                                return TSR_E_NOMEM;
                        for (uint32_t j = 0; j < q->n_allowed; j++)
                                kept[j] = xr[q->allowed[j]];
                        for (size_t i = 0; i < n; i++)
                                xr[i] = -INFINITY;
                        for (uint32_t j = 0; j < q->n_allowed; j++)
                                xr[q->allowed[j]] = kept[j];
                        free(kept);
                }
                for (uint32_t j = 0; j < q->n_masked; j++)
                        xr[q->masked[j]] = -INFINITY;
                for (uint32_t j = 0; j < q->n_bias; j++)
                        xr[q->bias_ids[j]] += q->bias[j];
                for (uint32_t j = 0; j < q->n_pen; j++) {
                        float *w = &xr[q->pen_ids[j]], c = q->pen_counts[j];
                        if (q->repetition != 1.0f)
                                *w = *w > 0.0f ? *w / q->repetition : *w * q->repetition;
                        if (c > 0.0f) {
                                *w -= q->frequency * c;
                                *w -= q->presence;
                        }
                }
        }
        return TSR_OK;
}

/* Whether candidate (v, i) goes before (bv, bi) in the top list: larger, or as large at
 * a lower index. */
static bool top_before(float v, uint32_t i, float bv, uint32_t bi) { return v > bv || (v == bv && i < bi); }

/* kernels.h tsr_backend_logprobs, the specification: tsr_ref_log_softmax's values of the
 * row, the rank and the top k by comparisons of them. */
tsr_status tsr_ref_logprobs(tsr_row_logprobs *out, const float *x, size_t rows, size_t n, const uint32_t *tokens,
                            const uint32_t *top) {
        if (!out || !x || !tokens || !top || n == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * n;
                uint32_t tok = tokens[r], k = top[r], n_top = 0;
                if (tok >= n)
                        continue;
                tsr_row_logprobs lp;
                memset(&lp, 0, sizeof lp);
                bool finite = false, bad = false;
                for (size_t i = 0; i < n; i++) {
                        bad |= isnan(xr[i]) || xr[i] == INFINITY;
                        finite |= xr[i] != -INFINITY;
                }
                if (bad || !finite) {
                        out[r] = lp;    /* rank 0: no distribution */
                        continue;
                }
                float max, lse;
                log_softmax_consts(xr, n, &max, &lse);
                lp.logprob = (xr[tok] - max) - lse;
                for (size_t i = 0; i < n; i++) {
                        float v = (xr[i] - max) - lse;
                        if (v >= lp.logprob)
                                lp.rank++;
                        if (k == 0 || (n_top == k && !top_before(v, (uint32_t)i, lp.top_logprobs[k - 1],
                                                                  lp.top_ids[k - 1])))
                                continue;
                        uint32_t j = n_top < k ? n_top++ : k - 1;       /* insertion into the sorted list */
                        while (j > 0 && top_before(v, (uint32_t)i, lp.top_logprobs[j - 1], lp.top_ids[j - 1])) {
                                lp.top_logprobs[j] = lp.top_logprobs[j - 1];
                                lp.top_ids[j] = lp.top_ids[j - 1];
                                j--;
                        }
                        lp.top_logprobs[j] = v;
                        lp.top_ids[j] = (uint32_t)i;
                }
                out[r] = lp;
        }
        return TSR_OK;
}

/* residual, x (rows, dim), w (dim,) -> residual += x, out = rmsnorm(residual) * w.
 * The specification of the fused op is the unfused pair, row by row: ref_add over the
 * row, then ref_rmsnorm of the stored sum.  Row by row so that out may alias x: row r of
 * x is read in full before row r of out is written. */
tsr_status tsr_ref_add_rmsnorm(float *out, float *residual, const float *x, const float *w, size_t rows,
                                  size_t dim, float eps) {
        if (!out || !residual || !x || !w || dim == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                float *res = residual + r * dim;
                tsr_ref_add(res, res, x + r * dim, dim);
                tsr_ref_rmsnorm(out + r * dim, res, w, 1, dim, eps);
        }
        return TSR_OK;
}

/* ---- the reference backend: the functions above behind the backend table ---------------- */

static tsr_status ref_be_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows,
                                 size_t dim, float eps) {
        (void)be;
        return tsr_ref_rmsnorm(out, x, w, rows, dim, eps);
}

static tsr_status ref_be_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                   size_t dim, const uint32_t *ids, size_t rows) {
        (void)be;
        return tsr_ref_embedding(out, table, dtype, vocab, dim, ids, rows);
}

/* The weight dtype picks the kernel (the wrapper has checked it is one of ours). */
static tsr_status ref_be_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                size_t rows, size_t n, size_t d) {
        (void)be;
        switch (w_dtype) {
        case TSR_DTYPE_F32:
                return tsr_ref_matmul_f32(out, x, w, rows, n, d);
        case TSR_DTYPE_BF16:
                return tsr_ref_matmul_bf16(out, x, w, rows, n, d);
        default:                /* the GGUF blocks: int8 activations (quant/qmm.h) */
                break;
        }
        return tsr_qmm_supported(w_dtype) ? tsr_qmm_ref(out, x, w, w_dtype, rows, n, d) : TSR_E_UNSUPPORTED;
}

static tsr_status ref_be_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                       const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        (void)be;
        return tsr_fpmm_ref(out, x, w, w_dtype, s, rows, n, d);
}

static tsr_status ref_be_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                              const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        (void)be;
        return tsr_ref_rope(x, rows, n_heads, head_dim, pos, inv_freq, layout);
}

static tsr_status ref_be_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                                  size_t past_len) {
        (void)be;
        return tsr_ref_kv_write(kv, k, v, n, past_len);
}

static tsr_status ref_be_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                   size_t past_len, size_t n_heads, float scale) {
        (void)be;
        return tsr_ref_attention(out, q, kv, n, past_len, n_heads, scale);
}

static tsr_status ref_be_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n) {
        (void)be;
        return tsr_ref_silu_mul(out, gate, up, n);
}

static tsr_status ref_be_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        (void)be;
        return tsr_ref_add(out, a, b, n);
}

/* Also the fast CPU backend's (fast.c): a copy and one operation per element, memory-bound
 * and small beside the matmuls around them. */
tsr_status tsr_ref_be_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                  const uint32_t *idx, const float *scales, size_t n) {
        (void)be;
        (void)rows;
        return tsr_ref_gather_rows(out, x, dim, idx, scales, n);
}

tsr_status tsr_ref_be_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                       const uint32_t *idx, const float *scales, size_t n) {
        (void)be;
        (void)rows;
        return tsr_ref_scatter_add_rows(dst, dim, src, idx, scales, n);
}

tsr_status tsr_ref_be_relu_sq(tsr_backend *be, float *x, size_t n) {
        (void)be;
        return tsr_ref_relu_sq(x, n);
}

/* Also the fast backend's: one conversion each way per element, memory-bound. */
tsr_status tsr_ref_be_round_bf16(tsr_backend *be, float *x, size_t n) {
        (void)be;
        for (size_t i = 0; i < n; i++)
                x[i] = tsr_bf16_to_f32(tsr_f32_to_bf16(x[i]));
        return TSR_OK;
}

static tsr_status ref_be_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_softmax(out, x, rows, n);
}

static tsr_status ref_be_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_log_softmax(out, x, rows, n);
}

static tsr_status ref_be_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        (void)be;
        return tsr_ref_argmax(out, x, rows, n);
}

static tsr_status ref_be_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n,
                                const tsr_draw *draws) {
        (void)be;
        return tsr_ref_sample(out, x, rows, n, draws);
}

tsr_status tsr_ref_be_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules) {
        (void)be;
        return tsr_ref_logit_rules(x, rows, n, rules);
}

tsr_status tsr_ref_be_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                               const uint32_t *tokens, const uint32_t *top) {
        (void)be;
        return tsr_ref_logprobs(out, x, rows, n, tokens, top);
}

static tsr_status ref_be_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                     size_t rows, size_t dim, float eps) {
        (void)be;
        return tsr_ref_add_rmsnorm(out, residual, x, w, rows, dim, eps);
}

static tsr_status ref_be_host_tasks(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx) {
        (void)be;
        for (size_t i = 0; i < n_tasks; i++)
                task(ctx, i, 0);
        return TSR_OK;
}

#define CPU_REF_OPS(NAME, HOST)                                                                   \
        {                                                                                                 \
        .name = NAME,                                                                                     \
        .host_memory = HOST,                                                                              \
        .matmul_dtypes = TSR_CPU_REF_MATMUL_DTYPES,                                                       \
        .mem_alloc = tsr_backend_host_alloc,                                                              \
        .mem_free = tsr_backend_host_free,                                                                \
        .upload = tsr_backend_host_copy,                                                                  \
        .download = tsr_backend_host_copy,                                                                \
        .copy = tsr_backend_host_copy,                                                                    \
        .synchronize = tsr_backend_host_sync,                                                             \
        .rmsnorm = ref_be_rmsnorm,                                                                        \
        .embedding = ref_be_embedding,                                                                    \
        .matmul = ref_be_matmul,                                                                          \
        .matmul_scaled = ref_be_matmul_scaled,                                                            \
        .rope = ref_be_rope,                                                                              \
        .kv_write = ref_be_kv_write,                                                                      \
        .attention = ref_be_attention,                                                                    \
        .silu_mul = ref_be_silu_mul,                                                                      \
        .add = ref_be_add,                                                                                \
        .gather_rows = tsr_ref_be_gather_rows,                                                            \
        .scatter_add_rows = tsr_ref_be_scatter_add_rows,                                                  \
        .relu_sq = tsr_ref_be_relu_sq,                                                                    \
        .round_bf16 = tsr_ref_be_round_bf16,                                                              \
        .mamba_mixer = tsr_cpu_mamba_mixer,                                                               \
        .softmax = ref_be_softmax,                                                                        \
        .log_softmax = ref_be_log_softmax,                                                                \
        .argmax = ref_be_argmax,                                                                          \
        .sample = ref_be_sample,                                                                          \
        .logit_rules = tsr_ref_be_logit_rules,                                                            \
        .logprobs = tsr_ref_be_logprobs,                                                                  \
        .add_rmsnorm = ref_be_add_rmsnorm,                                                                \
        .host_tasks = ref_be_host_tasks,                                                                  \
        }

static const tsr_backend_ops cpu_ref_ops = CPU_REF_OPS("cpu-ref", true);

/* The table, for devlike.c: the same kernels behind a backend whose memory counts as a
 * device's (the forward's device path on a machine without a GPU; kernels.h's graphs). */
const tsr_backend_ops *tsr_backend_ref_ops(void) { return &cpu_ref_ops; }

/* No context: the reference keeps no state, so every reference backend is the same
 * table behind its own handle. */
tsr_status tsr_backend_cpu_ref_new(tsr_backend **ret) {
        if (!ret)
                return TSR_E_INVAL;
        return tsr_backend_make(&cpu_ref_ops, NULL, TSR_CPU_ISA_SCALAR, 1, ret);
}

