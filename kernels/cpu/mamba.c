/* mamba.c - the Mamba-2 mixer of kernels.h (tsr_backend_mamba_mixer) on the CPU: the
 * specification the other backends are held to, run by the reference backend on the
 * calling thread and by the fast one on its pool, with the same bits at every thread
 * count (the work is split by (sequence, group), each task computing only its own
 * channels in a fixed order).  Shared by cpu/ref.c, cpu/fast.c and cpu/devlike.c. */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"
#include "kernels/cpu/ref.h"

static size_t d_inner(const tsr_mamba_dims *c) { return c->heads * c->head_dim; }
static size_t conv_dim(const tsr_mamba_dims *c) { return d_inner(c) + 2 * c->groups * c->state; }
static size_t conv_elems(const tsr_mamba_dims *c) { return (c->conv_kernel - 1) * conv_dim(c); }
static size_t ssm_elems(const tsr_mamba_dims *c) { return c->heads * c->head_dim * c->state; }

static float silu(float a) { return a / (1.0f + expf(-a)); }

/* torch.nn.functional.softplus (beta 1, threshold 20). */
static float softplus(float a) { return a > 20.0f ? a : log1pf(expf(a)); }

/* Eight floats as one value (GCC/clang vector extension: one AVX register in scan_row's
 * avx2 clone, SSE pairs in its baseline one), loaded and stored through memcpy, so no
 * alignment is assumed.  Never a parameter or a return value: that would change the ABI
 * with the ISA (-Wpsabi). */
typedef float mb_v8 __attribute__((vector_size(32)));

/* One row of the selective scan's step over the ns state entries of (head, p):
 * S[s] = S[s] * dA + (d * B[s]) * xv, then the read-out sum_s S[s] * C[s].  The sum in a
 * fixed order that the vectors allow: eight lanes (lane j takes s = j, j + 8, ...; a tail
 * of ns % 8 entries goes to lanes 0 ..), then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
 * l7)).  Each product and sum is one float32 rounding as in the scalar loop it replaced
 * (no FMA: the avx2 clone has none either, so both clones give the same bits); only the
 * order of the read-out's sum is its own.  The scalar loop's latency chain was 27% of a
 * NemotronH decode step at batch 32 (perf, 2026-11-27); docs/benchmarks.md has before and
 * after. */
#if defined(__SANITIZE_THREAD__)
/* ThreadSanitizer instruments the ifunc resolver that target_clones makes, and the
 * dynamic loader runs it before TSan is set up: build-tsan's worker crashed at start.
 * There, one clone. */
#define MB_CLONES
#else
#define MB_CLONES __attribute__((target_clones("avx2", "default")))
#endif
MB_CLONES
static float scan_row(float *S, const float *B, const float *C, size_t ns, float dA, float d, float xv) {
        mb_v8 acc = {0}, va = {dA, dA, dA, dA, dA, dA, dA, dA}, vd = {d, d, d, d, d, d, d, d};
        mb_v8 vx = {xv, xv, xv, xv, xv, xv, xv, xv};
        size_t s = 0;
        for (; s + 8 <= ns; s += 8) {
                mb_v8 st, b, c;
                memcpy(&st, S + s, sizeof st);
                memcpy(&b, B + s, sizeof b);
                memcpy(&c, C + s, sizeof c);
                st = st * va + (vd * b) * vx;
                memcpy(S + s, &st, sizeof st);
                acc += st * c;
        }
        float lane[8];
        memcpy(lane, &acc, sizeof lane);
        for (size_t j = 0; s < ns; s++, j++) {
                S[s] = S[s] * dA + (d * B[s]) * xv;
                lane[j] += S[s] * C[s];
        }
        return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

/* The chunked scan's inner loops.  Inlined into ssd_chunk, so compiled for each of its
 * clones (a call through the clones' resolver per row would cost more than the row). */
#define MB_INLINE static inline __attribute__((always_inline))

/* Two sums over the same rows with their own coefficients:
 * out0[i] = init0[i] + sum_k c0[k] * rows[k * stride + i], out1 likewise with c1 (init0 /
 * init1 NULL: from 0), k = 0 .. K-1 in order, so each element's sum is the scalar loop's
 * and the bits do not depend on the vector width.  Thirty-two columns of both at a time:
 * eight independent vector sums in registers, each row loaded once for the two.  (An
 * avx512f clone with sixteen lanes measured no faster: the sums are latency-bound.) */
MB_INLINE void sum_rows2(float *out0, float *out1, const float *init0, const float *init1, const float *c0,
                         const float *c1, const float *rows, ptrdiff_t stride, size_t K, size_t n) {
        size_t i = 0;
        for (; i + 32 <= n; i += 32) {
                mb_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                if (init0) {
                        memcpy(&a0, init0 + i, sizeof a0);
                        memcpy(&a1, init0 + i + 8, sizeof a1);
                        memcpy(&a2, init0 + i + 16, sizeof a2);
                        memcpy(&a3, init0 + i + 24, sizeof a3);
                }
                if (init1) {
                        memcpy(&b0, init1 + i, sizeof b0);
                        memcpy(&b1, init1 + i + 8, sizeof b1);
                        memcpy(&b2, init1 + i + 16, sizeof b2);
                        memcpy(&b3, init1 + i + 24, sizeof b3);
                }
                for (size_t k = 0; k < K; k++) {
                        const float *r = rows + (ptrdiff_t)k * stride + (ptrdiff_t)i;
                        mb_v8 v0 = {0}, v1 = {0}, x0, x1, x2, x3;
                        v0 += c0[k];
                        v1 += c1[k];
                        memcpy(&x0, r, sizeof x0);
                        memcpy(&x1, r + 8, sizeof x1);
                        memcpy(&x2, r + 16, sizeof x2);
                        memcpy(&x3, r + 24, sizeof x3);
                        a0 += v0 * x0;
                        a1 += v0 * x1;
                        a2 += v0 * x2;
                        a3 += v0 * x3;
                        b0 += v1 * x0;
                        b1 += v1 * x1;
                        b2 += v1 * x2;
                        b3 += v1 * x3;
                }
                memcpy(out0 + i, &a0, sizeof a0);
                memcpy(out0 + i + 8, &a1, sizeof a1);
                memcpy(out0 + i + 16, &a2, sizeof a2);
                memcpy(out0 + i + 24, &a3, sizeof a3);
                memcpy(out1 + i, &b0, sizeof b0);
                memcpy(out1 + i + 8, &b1, sizeof b1);
                memcpy(out1 + i + 16, &b2, sizeof b2);
                memcpy(out1 + i + 24, &b3, sizeof b3);
        }
        for (; i + 8 <= n; i += 8) {
                mb_v8 a0 = {0}, b0 = {0};
                if (init0)
                        memcpy(&a0, init0 + i, sizeof a0);
                if (init1)
                        memcpy(&b0, init1 + i, sizeof b0);
                for (size_t k = 0; k < K; k++) {
                        mb_v8 x0;
                        memcpy(&x0, rows + (ptrdiff_t)k * stride + (ptrdiff_t)i, sizeof x0);
                        a0 += c0[k] * x0;
                        b0 += c1[k] * x0;
                }
                memcpy(out0 + i, &a0, sizeof a0);
                memcpy(out1 + i, &b0, sizeof b0);
        }
        for (; i < n; i++) {
                float a = init0 ? init0[i] : 0.0f, b = init1 ? init1[i] : 0.0f;
                for (size_t k = 0; k < K; k++) {
                        float r = rows[(ptrdiff_t)k * stride + (ptrdiff_t)i];
                        a += c0[k] * r;
                        b += c1[k] * r;
                }
                out0[i] = a;
                out1[i] = b;
        }
}

/* A Mamba group's tokens of one chunk as the mixer holds them: row u (0 .. L-1) is
 * [x (the group's hpg * P channels) | B (NS) | C (NS)] after the conv and SiLU, and dt
 * (L, hpg) the heads' softplus-clamped steps. */
struct seg {
        float *rows, *dt;
        size_t w;               /* a row: hpg * P + 2 * NS floats */
};

/* Scratch of the chunked scan (one per thread), for chunks of up to Q tokens. */
struct ssd_ws {
        float *cb;              /* (Q, Q): C_t . B_s for s <= t, the group's */
        float *bt;              /* (NS, Q): the chunk's B transposed */
        float *e, *dt;          /* (Q,): the head's exp(dt A) and dt per token */
        float *dec;             /* (Q,): at row t, the decay from token s to t (s <= t) */
        float *coef;            /* (2, max(Q, NS)): two rows' coefficients */
        float *s0t;             /* (NS, P): the head's state before the chunk, transposed */
        float *acc, *off;       /* (2, P): two rows' */
};

/* Row t of the coefficients of y's sum: (C_t.B_s) times the decay from s to t times dt_s,
 * for s <= t, after moving ws->dec on to row t; returns e_t. */
MB_INLINE float ssd_coef_row(const struct ssd_ws *ws, size_t t, size_t n_tok, float *coef) {
        float et = ws->e[t];
        for (size_t s = 0; s < t; s++)
                ws->dec[s] *= et;
        ws->dec[t] = 1.0f;
        for (size_t s = 0; s <= t; s++)
                coef[s] = ws->cb[t * n_tok + s] * (ws->dec[s] * ws->dt[s]);
        return et;
}

/* The chunked (SSD) form of the selective scan over a chunk of L tokens of group g, as
 * Mamba-2's ssd_minimal and vLLM's mamba_chunk_scan_combined compute it, in float32 on
 * plain loops.  For head h with e_t = exp(dt_t A_h) and S0 its state before the chunk:
 *   y_t = sum_{s<=t} (C_t.B_s) (prod_{s<i<=t} e_i) dt_s x_s + (prod_{i<=t} e_i) (S0 C_t) + D x_t
 *   S   = (prod_i e_i) S0 + sum_s (prod_{s<i<L} e_i) dt_s x_s B_s^T
 * the recurrence's result in another order: C_t.B_s once for the group's heads, the state
 * read and written once per chunk instead of once per token, every sum over rows that
 * sum_rows2 keeps in registers two outputs at a time, the decays a row at a time (row t =
 * row t-1 times e_t).  Every sum and product has a fixed order (s, n and i ascending), so
 * the bits depend only on the chunk's tokens and the state before it. */
MB_CLONES
static void ssd_chunk(const tsr_mamba_dims *c, const tsr_mamba_weights *L, const struct seg *sg, size_t n_tok, size_t g,
                      float *ssm, float *y, size_t y_stride, const struct ssd_ws *ws) {
        size_t P = c->head_dim, NS = c->state, hpg = c->heads / c->groups, gx = hpg * P, w = sg->w;
        size_t cw = n_tok > NS ? n_tok : NS;
        float *coef1 = ws->coef + cw, *acc1 = ws->acc + P, *off1 = ws->off + P;
        const float *C0 = sg->rows + gx + NS;

        /* C.B: row t is sum_n C_t[n] * B^T[n][0 .. t]; rows t and t+1 together (the
         * columns past t, C_t.B_s for s > t, are never read) */
        for (size_t s = 0; s < n_tok; s++)
                for (size_t n = 0; n < NS; n++)
                        ws->bt[n * n_tok + s] = sg->rows[s * w + gx + n];
        size_t t = 0;
        for (; t + 1 < n_tok; t += 2) {
                size_t cols = (t + 2 + 7) / 8 * 8;      /* whole vectors: the extra columns are never read */
                sum_rows2(ws->cb + t * n_tok, ws->cb + (t + 1) * n_tok, NULL, NULL, C0 + t * w, C0 + (t + 1) * w,
                          ws->bt, (ptrdiff_t)n_tok, NS, cols < n_tok ? cols : n_tok);
        }
        if (t < n_tok)          /* an odd last row: the second sum a throwaway */
                sum_rows2(ws->cb + t * n_tok, coef1, NULL, NULL, C0 + t * w, C0 + t * w, ws->bt, (ptrdiff_t)n_tok,
                          NS, t + 1);
        for (size_t hl = 0; hl < hpg; hl++) {
                size_t h = g * hpg + hl;
                float *S = ssm + h * P * NS, from_start = 1.0f, Dh = L->D[h];
                const float *x0 = sg->rows + hl * P;
                for (t = 0; t < n_tok; t++) {
                        ws->dt[t] = sg->dt[t * hpg + hl];
                        ws->e[t] = expf(ws->dt[t] * L->A[h]);
                }
                for (size_t p = 0; p < P; p++)
                        for (size_t n = 0; n < NS; n++)
                                ws->s0t[n * P + p] = S[p * NS + n];
                for (t = 0; t < n_tok; t += 2) {
                        bool two = t + 1 < n_tok;
                        float start0 = from_start *= ssd_coef_row(ws, t, n_tok, ws->coef), start1 = 0.0f;
                        if (two) {
                                start1 = from_start *= ssd_coef_row(ws, t + 1, n_tok, coef1);
                                /* rows s <= t for both, then row t+1's own last term */
                                sum_rows2(ws->acc, acc1, NULL, NULL, ws->coef, coef1, x0, (ptrdiff_t)w, t + 1, P);
                                for (size_t p = 0; p < P; p++)
                                        acc1[p] += coef1[t + 1] * x0[(t + 1) * w + p];
                                sum_rows2(ws->off, off1, NULL, NULL, C0 + t * w, C0 + (t + 1) * w, ws->s0t,
                                          (ptrdiff_t)P, NS, P);
                        } else {        /* an odd last row: acc1 and off1 throwaways */
                                sum_rows2(ws->acc, acc1, NULL, NULL, ws->coef, ws->coef, x0, (ptrdiff_t)w, t + 1, P);
                                sum_rows2(ws->off, off1, NULL, NULL, C0 + t * w, C0 + t * w, ws->s0t, (ptrdiff_t)P,
                                          NS, P);
                        }
                        for (size_t u = 0; u < (two ? 2u : 1u); u++) {
                                float *yt = y + (t + u) * y_stride + h * P, st = u ? start1 : start0;
                                const float *xt = x0 + (t + u) * w, *acc = ws->acc + u * P, *off = ws->off + u * P;
                                for (size_t p = 0; p < P; p++)
                                        yt[p] = (acc[p] + st * off[p]) + xt[p] * Dh;
                        }
                }
                /* dec is now the decay from each token to the chunk's end */
                for (size_t s = 0; s < n_tok; s++)
                        ws->dec[s] *= ws->dt[s];
                for (size_t p = 0; p < P; p++) {
                        float *Sp = S + p * NS;
                        for (size_t n = 0; n < NS; n++)
                                Sp[n] *= from_start;
                }
                size_t p = 0;
                for (; p + 1 < P; p += 2) {
                        for (size_t s = 0; s < n_tok; s++) {
                                ws->coef[s] = ws->dec[s] * x0[s * w + p];
                                coef1[s] = ws->dec[s] * x0[s * w + p + 1];
                        }
                        float *Sp = S + p * NS;
                        sum_rows2(Sp, Sp + NS, Sp, Sp + NS, ws->coef, coef1, sg->rows + gx, (ptrdiff_t)w, n_tok, NS);
                }
                if (p < P) {            /* an odd last row: coef1 (>= NS floats) a throwaway */
                        for (size_t s = 0; s < n_tok; s++)
                                ws->coef[s] = ws->dec[s] * x0[s * w + p];
                        sum_rows2(S + p * NS, coef1, S + p * NS, NULL, ws->coef, ws->coef, sg->rows + gx, (ptrdiff_t)w,
                                  n_tok, NS);
                }
        }
}

/* The Mamba mixer of a step, as (sequence, group) tasks on the backend's threads.  A
 * group g owns its heads g*hpg .. (g+1)*hpg - 1 (hpg = heads / n_groups), i.e. the
 * channels of x and of y [g*gs, (g+1)*gs) with gs = d_inner / n_groups, its own B and C
 * channels, those heads' SSM state and its group of the gated norm; and a sequence owns
 * its state slot.  So each (sequence, group) runs the sequence's tokens in order on its
 * own channels, in any order against the others, with the float operations of one loop
 * over everything: the same bits at every thread count. */
struct mixer_job {
        const tsr_mamba_dims *c;
        const tsr_mamba_weights *L;
        const tsr_mamba_seq *seqs;
        const float *proj;              /* (N, in_proj rows) */
        float *conv, *ssm;              /* the layer's state arrays, a slot per sequence */
        float *y;                       /* (N, d_inner) the mixer's output, gated and normed */
        float *seg;                     /* (threads, seg_floats): a chunk's rows (struct seg) and
                                         * the chunked scan's scratch (struct ssd_ws) */
        size_t seg_floats, chunk;       /* chunk: the longest a thread's seg holds (1: no SSD) */
        /* NULL, or (the model's one group spans the ranks: norm_across) y is left gated but
         * not normed, and leaves (n_leaves, N) gets each row's sums of squares over its
         * n_leaves canonical channel slices */
        float *leaves;
        size_t n_leaves, n_rows;
};

/* The channels of xBC that group g owns: x, then B, then C (three [first, end) ranges). */
static void group_channels(const tsr_mamba_dims *c, size_t g, size_t ranges[3][2]) {
        size_t di = d_inner(c), NS = c->state, G = c->groups, gs = di / G;
        ranges[0][0] = g * gs;
        ranges[0][1] = (g + 1) * gs;
        ranges[1][0] = di + g * NS;
        ranges[1][1] = di + (g + 1) * NS;
        ranges[2][0] = di + G * NS + g * NS;
        ranges[2][1] = di + G * NS + (g + 1) * NS;
}

/* Floats of a thread's seg for chunks of up to `chunk` tokens (1: the recurrence only). */
static size_t seg_floats(const tsr_mamba_dims *c, size_t chunk) {
        size_t P = c->head_dim, NS = c->state, hpg = c->heads / c->groups;
        size_t n = chunk * (hpg * P + 2 * NS) + chunk * hpg;
        if (chunk > 1)      /* struct ssd_ws */
                n += chunk * chunk + NS * chunk + 3 * chunk + 2 * (chunk > NS ? chunk : NS) + NS * P + 4 * P;
        return n;
}

/* Row r (0 .. K-2) of the conv state after the first t tokens of the chunk: the raw
 * xBC row of position past + t - (K-1) + r, from the state before the chunk or from the
 * chunk's own in_proj rows. */
static const float *conv_row_after(const float *conv_state, const float *proj, size_t t, size_t r, size_t K,
                                   size_t cd, size_t pr, size_t di) {
        size_t w = t + r;
        return w < K - 1 ? conv_state + w * cd : proj + (w - (K - 1)) * pr + di;
}

/* How many of the sequence's tokens from its t-th on the next scan covers: a whole
 * chunk of the model's chunk_size (aligned to absolute positions, inside this step's
 * tokens and before chunked_end, no prefix-cache save strictly inside it) in the chunked
 * form, else one token of the recurrence.  Only the positions decide, so a prompt cut
 * into steps at chunk multiples runs the same scans as the whole prompt in one step. */
static size_t scan_span(const struct mixer_job *j, const tsr_mamba_seq *q, size_t t, size_t next_save) {
        size_t Q = j->chunk, pos = q->past_len + t;
        if (Q < 2 || pos % Q || t + Q > q->n || (q->chunked_end && pos + Q > q->chunked_end))
                return 1;
        for (size_t k = next_save; k < q->n_saves && q->saves[k].pos < pos + Q; k++)
                if (q->saves[k].pos > pos)
                        return 1;
        return Q;
}

/* Task i = (sequence i / n_groups, group i % n_groups): the causal conv with SiLU, the
 * selective scan and the gated norm over the sequence's n tokens, then the group's
 * channels of the conv state moved on to the last K-1 raw rows.  The conv's window row r
 * (0 .. K-2 + n) is the conv state's row r before the sequence's rows (r < K-1), then
 * proj's row r - (K-1); a fresh sequence's state was zeroed by the caller. */
static void mixer_task(void *ctx, size_t i, int worker) {
        const struct mixer_job *j = ctx;
        const tsr_mamba_dims *c = j->c;
        const tsr_mamba_weights *L = j->L;
        size_t di = d_inner(c), cd = conv_dim(c), K = c->conv_kernel;
        size_t H = c->heads, P = c->head_dim, NS = c->state, G = c->groups, hpg = H / G;
        size_t pr = di + cd + H, gs = di / G, g = i % G, seq = i / G, Q = j->chunk;
        const tsr_mamba_seq *q = &j->seqs[seq];
        size_t n = q->n, row0 = q->row, ranges[3][2], next_save = 0;
        const float *proj = j->proj + row0 * pr;
        float *conv_state = j->conv + q->slot * conv_elems(c);
        float *ssm = j->ssm + q->slot * ssm_elems(c);
        float *ws0 = j->seg + (size_t)worker * j->seg_floats;
        struct seg sg = {.rows = ws0, .w = gs + 2 * NS};
        sg.dt = sg.rows + Q * sg.w;
        struct ssd_ws ws = {.cb = sg.dt + Q * hpg};
        ws.bt = ws.cb + Q * Q;
        ws.e = ws.bt + NS * Q;
        ws.dt = ws.e + Q;
        ws.dec = ws.dt + Q;
        ws.coef = ws.dec + Q;
        ws.s0t = ws.coef + 2 * (Q > NS ? Q : NS);
        ws.acc = ws.s0t + NS * P;
        ws.off = ws.acc + 2 * P;
        const float *conv_w = L->conv_w, *conv_b = L->conv_b;

        group_channels(c, g, ranges);
        for (size_t t = 0; t < n;) {
                size_t span = scan_span(j, q, t, next_save);
                /* causal depthwise conv: out[c] = b[c] + sum_k w[c,k] * win[t+k][c], then
                 * SiLU; each channel's sum in k order.  Into row u of the span: the
                 * group's x, B and C channels side by side; and each head's step dt. */
                for (size_t u = 0; u < span; u++) {
                        size_t tu = t + u;
                        const float *win[TSR_MAMBA_MAX_CONV];
                        float *out = sg.rows + u * sg.w;
                        for (size_t k = 0; k < K; k++)
                                win[k] = tu + k < K - 1 ? conv_state + (tu + k) * cd
                                                        : proj + (tu + k - (K - 1)) * pr + di;
                        for (size_t r = 0; r < 3; r++)
                                for (size_t ch = ranges[r][0]; ch < ranges[r][1]; ch++) {
                                        const float *w = conv_w + ch * K;
                                        float acc = conv_b ? conv_b[ch] : 0.0f;
                                        for (size_t k = 0; k < K; k++)
                                                acc += w[k] * win[k][ch];
                                        *out++ = silu(acc);
                                }
                        const float *dt_raw = proj + tu * pr + di + cd;
                        for (size_t hl = 0; hl < hpg; hl++) {
                                size_t h = g * hpg + hl;
                                float d = softplus(dt_raw[h] + L->dt_bias[h]);
                                sg.dt[u * hpg + hl] = fminf(fmaxf(d, c->dt_min), c->dt_max);
                        }
                }
                if (span > 1) {
                        ssd_chunk(c, L, &sg, span, g, ssm, j->y + (row0 + t) * di, di, &ws);
                } else {
                        /* the selective scan, one step: S = S*exp(Δ A) + (Δ B) x;  y = S·C + D x */
                        const float *xs = sg.rows, *B = sg.rows + gs, *C = B + NS;
                        float *yt = j->y + (row0 + t) * di;
                        for (size_t hl = 0; hl < hpg; hl++) {
                                size_t h = g * hpg + hl;
                                float d = sg.dt[hl], dA = expf(d * L->A[h]);
                                for (size_t p = 0; p < P; p++) {
                                        float xv = xs[hl * P + p];
                                        float acc = scan_row(ssm + (h * P + p) * NS, B, C, NS, dA, d, xv);
                                        yt[h * P + p] = acc + xv * L->D[h];
                                }
                        }
                }
                /* gated group RMSNorm: gate first, then the group's gs channels */
                for (size_t u = 0; u < span; u++) {
                        size_t tu = t + u;
                        const float *z = proj + tu * pr;
                        float *u_ = j->y + (row0 + tu) * di + g * gs, ss = 0.0f;
                        for (size_t e = 0; e < gs; e++)
                                u_[e] *= silu(z[g * gs + e]);
                        if (j->leaves) {        /* the group spans the ranks: mamba() norms the row */
                                size_t lw = gs / j->n_leaves;
                                for (size_t l = 0; l < j->n_leaves; l++) {
                                        float part = 0.0f;
                                        for (size_t e = l * lw; e < (l + 1) * lw; e++)
                                                part += u_[e] * u_[e];
                                        j->leaves[l * j->n_rows + row0 + tu] = part;
                                }
                        } else {
                                for (size_t e = 0; e < gs; e++)
                                        ss += u_[e] * u_[e];
                                float rs = 1.0f / sqrtf(ss / (float)gs + c->eps);
                                for (size_t e = 0; e < gs; e++)
                                        u_[e] = L->norm[g * gs + e] * (u_[e] * rs);
                        }
                }
                t += span;
                /* prefix caching: the group's share of the state after this span */
                if (next_save < q->n_saves && q->saves[next_save].pos == q->past_len + t) {
                        uint32_t to = q->saves[next_save++].slot;
                        float *conv_to = j->conv + to * conv_elems(c), *ssm_to = j->ssm + to * ssm_elems(c);
                        size_t first = g * hpg * P * NS, count = hpg * P * NS;
                        memcpy(ssm_to + first, ssm + first, count * sizeof(float));
                        for (size_t r = 0; r + 1 < K; r++) {
                                const float *src = conv_row_after(conv_state, proj, t, r, K, cd, pr, di);
                                for (size_t k2 = 0; k2 < 3; k2++)
                                        for (size_t ch = ranges[k2][0]; ch < ranges[k2][1]; ch++)
                                                conv_to[r * cd + ch] = src[ch];
                        }
                }
        }
        /* the conv state: window rows n .. n + K-2; in place, as row w = n + r > r is
         * read before it is overwritten (rows go up) */
        for (size_t r = 0; r + 1 < K; r++) {
                const float *src = conv_row_after(conv_state, proj, n, r, K, cd, pr, di);
                for (size_t k2 = 0; k2 < 3; k2++)
                        for (size_t ch = ranges[k2][0]; ch < ranges[k2][1]; ch++)
                                conv_state[r * cd + ch] = src[ch];
        }
}


tsr_status tsr_cpu_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                               const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                               const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves, size_t n_leaves) {
        (void)n_slots;
        /* the chunked form's scratch only where a sequence has a whole chunk of tokens */
        size_t chunk = 1;
        for (size_t i = 0; i < n_seqs; i++)
                if (d->chunk >= 2 && seqs[i].n >= d->chunk)
                        chunk = d->chunk;
        size_t per_thread = seg_floats(d, chunk);
        float *seg = malloc((size_t)tsr_backend_threads(be) * per_thread * sizeof(float));
        if (!seg)
                return TSR_E_NOMEM;
        struct mixer_job job = {.c = d, .L = w, .seqs = seqs, .proj = proj, .conv = conv, .ssm = ssm, .y = y,
                                .seg = seg, .seg_floats = per_thread, .chunk = chunk, .leaves = leaves,
                                .n_leaves = n_leaves, .n_rows = rows};
        tsr_status st = tsr_backend_host_tasks(be, n_seqs * d->groups, mixer_task, &job);
        free(seg);
        return st;
}
