/* test_cuda_layer.c - one Llama layer plus the head, op by op, at SmolLM2-135M's sizes
 * (dim 576, 9 heads of 64, 3 KV heads, hidden 1536, vocab 49152, paged KV blocks of 16),
 * on cpu-ref and on CUDA, for a prefill of 37 rows, a decode step, a 37-row chunk at
 * past_len 263 and a decode step at past_len 300: the sequence the worker's forward runs.
 *
 * Two passes over the same steps:
 *   stepwise  before each op the CUDA inputs are reset to cpu-ref's, so each op is judged
 *             alone, within its own bound (beside each check below);
 *   chained   CUDA runs the whole sequence on its own results, as the worker will; each op's
 *             drift from cpu-ref is printed, and the logits and log-probabilities must stay
 *             within 1e-2 of the row's largest |logit| (bf16 activations round differently
 *             once inputs differ by an ulp, so the drift is far above float32 rounding, and
 *             far below what a wrong index or a missing rescale gives).
 * Weights are random (a fixed seed), bf16 for the layer's projections and float32 for the
 * tied embedding / LM head, so both matmul kernels run at full size.  The KV cache starts
 * as random rows, so the jump to past_len 263 attends over filled rows.
 * Exit 77 (meson: skipped) without a CUDA device; a failure prints the op, the step, the
 * element and both values. */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

enum { DIM = 576, N_HEADS = 9, N_KV = 3, HD = 64, KV_W = N_KV * HD, HIDDEN = 1536, VOCAB = 49152 };
enum { BS = 16, N_BLOCKS = 24, MAX_ROWS = 37 };

static const struct { size_t rows, past; } steps[] = {{37, 0}, {1, 37}, {37, 263}, {1, 300}};

static const double u = FLT_EPSILON / 2;
static int failures;

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand(void) {      /* xorshift64*, uniform in [-1, 1) */
        rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
        return (float)((rng * 0x2545f4914f6cdd1dull) >> 40) / (float)(1u << 23) - 1.0f;
}

/* A float array on both backends: h on cpu-ref (host), d on CUDA. */
typedef struct pair {
        float *h, *d;
        size_t n;
} pair;

static tsr_backend *ref, *gpu;

static void die(const char *what, tsr_status st) {
        fprintf(stderr, "FAIL %s: %s\n", what, tsr_status_str(st));
        exit(1);
}

static void *dev_alloc(size_t bytes) {
        void *p = NULL;
        tsr_status st = tsr_backend_mem_alloc(gpu, bytes, &p);
        if (st != TSR_OK)
                die("device alloc", st);
        return p;
}

static void upload(void *d, const void *h, size_t bytes) {
        tsr_status st = tsr_backend_upload(gpu, d, h, bytes);
        if (st != TSR_OK)
                die("upload", st);
}

static pair pair_new(size_t n, float scale) {      /* scale 0: zeros */
        pair p = {calloc(n, sizeof(float)), dev_alloc(n * sizeof(float)), n};
        for (size_t i = 0; scale != 0 && i < n; i++)
                p.h[i] = scale * frand();
        upload(p.d, p.h, n * sizeof(float));
        return p;
}

static void pair_free(pair *p) {
        free(p->h);
        tsr_backend_mem_free(gpu, p->d);
}

/* The CUDA copy of p made equal to cpu-ref's (stepwise: the next op starts from ref's inputs). */
static void resync(const pair *p, size_t n) { upload(p->d, p->h, n * sizeof(float)); }

static void ok(const char *what, tsr_status st) {
        if (st != TSR_OK)
                die(what, st);
}

/* Compare the first n elements of p (CUDA, downloaded) with cpu-ref's: |got - want| <=
 * bound[i] (NaN/inf by class; bound NULL: bitwise).  `enforce` false: print the drift only.
 * Returns the largest |got - want|. */
static double check(const char *op, size_t step, const pair *p, size_t n, const double *bound, bool enforce) {
        float *got = malloc(n * sizeof *got);
        size_t bad = 0;
        double worst = 0;
        ok("synchronize", tsr_backend_synchronize(gpu));
        ok("download", tsr_backend_download(gpu, got, p->d, n * sizeof *got));
        for (size_t i = 0; i < n; i++) {
                double g = got[i], w = p->h[i], e = fabs(g - w);
                bool good = isnan(w) ? isnan(g) : (isinf(w) || isinf(g)) ? g == w
                                                  : bound ? e <= bound[i] : memcmp(&got[i], &p->h[i], 4) == 0;
                if (!isnan(e) && e > worst)
                        worst = e;
                if (!good && enforce && bad++ < 5)
                        fprintf(stderr, "  %s step %zu [%zu]: cuda %.9g ref %.9g bound %.3g\n", op, step, i, g, w,
                                bound ? bound[i] : 0.0);
        }
        if (bad) {
                fprintf(stderr, "FAIL %s step %zu: %zu of %zu elements outside the bound\n", op, step, bad, n);
                failures++;
        }
        free(got);
        return worst;
}

/* ---- bounds (stepwise) ----------------------------------------------------------------- */

/* matmul: both sides sum the same products in float32, each within n u sum |w x| of the
 * exact value (2 n u between them; bf16: the products of the same rounded inputs).  The
 * sums |w| |x| come from cpu-ref's matmul of the absolute values (host arrays). */
static void matmul_bound(double *bound, const float *x, size_t rows, size_t n, size_t d, const void *w_abs,
                         tsr_dtype t) {
        float *xa = malloc(rows * n * sizeof *xa), *s = malloc(rows * d * sizeof *s);
        for (size_t i = 0; i < rows * n; i++)
                xa[i] = fabsf(x[i]);
        ok("ref abs matmul", tsr_backend_matmul(ref, s, xa, w_abs, t, rows, n, d));
        for (size_t i = 0; i < rows * d; i++)
                bound[i] = 2.0 * (double)n * u * s[i] * 1.01 + 1e-30;
        free(xa), free(s);
}

/* rmsnorm/add_rmsnorm: rmsnorm.cu's float sum (3 squares per thread, 8 tree levels) and
 * rsqrtf against ref's double sum: (ceil(dim/256) + 24) u relative (test_ops.c derives it). */
static void norm_bound(double *bound, const float *want, size_t n) {
        for (size_t i = 0; i < n; i++)
                bound[i] = (double)((DIM + 255) / 256 + 24) * u * fabs(want[i]) + 1e-37;
}

/* rope (NEOX): c and s are cos/sin in double rounded once on both sides (an ulp apart at
 * most), the rotation the same float ops: 4 u (|a| + |b|) of the pair's inputs. */
static void rope_bound(double *bound, const float *in, size_t rows_heads) {
        for (size_t r = 0; r < rows_heads; r++)
                for (size_t i = 0; i < HD / 2; i++) {
                        const float *x = in + r * HD;
                        double e = 4 * u * (fabs(x[i]) + fabs(x[i + HD / 2])) + 1e-37;
                        bound[r * HD + i] = bound[r * HD + i + HD / 2] = e;
                }
}

/* attention: out is a convex combination of V rows.  A score off by ds moves its weight by
 * about 2 ds relative; the dot products are within HD u sum |q k| scale; the sums and the
 * rescaling add (L + 8) u per weight, L the keys seen.  So |dout| <= max|v| (4 max ds +
 * 4 (L + 8) u), doubled for the two sides. */
static void attention_bound(double *bound, const float *q, const float *kc, const float *vc, const uint32_t *table,
                            size_t rows, size_t past, float scale) {
        for (size_t t = 0; t < rows; t++)
                for (size_t h = 0; h < N_HEADS; h++) {
                        size_t g = h / (N_HEADS / N_KV), L = past + t + 1;
                        double ds = 0, vmax = 0;
                        for (size_t j = 0; j < L; j++) {
                                size_t row = (size_t)table[j / BS] * BS + j % BS;
                                double a = 0;
                                for (size_t i = 0; i < HD; i++) {
                                        a += fabs((double)q[(t * N_HEADS + h) * HD + i] * kc[row * KV_W + g * HD + i]);
                                        vmax = fmax(vmax, fabs((double)vc[row * KV_W + g * HD + i]));
                                }
                                ds = fmax(ds, HD * u * a * scale);
                        }
                        double e = 2 * vmax * (4 * ds + 4 * (double)(L + 8) * u) + 1e-30;
                        for (size_t i = 0; i < HD; i++)
                                bound[(t * N_HEADS + h) * HD + i] = e;
                }
}

/* silu_mul: expf within 2 ulp on the device, 1 in glibc, four more roundings: 16 u relative. */
static void silu_bound(double *bound, const float *want, size_t n) {
        for (size_t i = 0; i < n; i++)
                bound[i] = 16 * u * fabs(want[i]) + 1e-37;
}

/* softmax: the same x - max, expf's ulps (3 apart at most), the double sum: 10 u relative.
 * log_softmax: x - max - log(sum) with log in double on both sides: 8 u (|out| + 1). */
static void softmax_bound(double *bound, const float *want, size_t n, bool log_out) {
        for (size_t i = 0; i < n; i++)
                bound[i] = log_out ? 8 * u * (fabs(want[i]) + 1) : 10 * u * fabs(want[i]) + 1e-37;
}

/* ---- the model --------------------------------------------------------------------------- */

typedef struct model {
        pair table, attn_norm, mlp_norm, final_norm, inv_freq;
        uint16_t *wq, *wk, *wv, *wo, *wg, *wu, *wd;             /* bf16 bits, host */
        uint16_t *aq, *ak, *av, *ao, *ag, *au, *ad;             /* their absolute values */
        void *dq, *dk, *dv, *dwo, *dg, *du, *dd;                /* device copies */
        float *table_abs;
} model;

static uint16_t *bf16_weights(size_t d, size_t n, uint16_t **abs_out, void **dev) {
        uint16_t *w = malloc(d * n * 2), *a = malloc(d * n * 2);
        float scale = 1.0f / sqrtf((float)n);
        for (size_t i = 0; i < d * n; i++) {
                w[i] = tsr_f32_to_bf16(scale * 1.7f * frand());
                a[i] = w[i] & 0x7fff;
        }
        *dev = dev_alloc(d * n * 2);
        upload(*dev, w, d * n * 2);
        *abs_out = a;
        return w;
}

static void model_init(model *m) {
        m->table = pair_new((size_t)VOCAB * DIM, 1.0f);
        m->table_abs = malloc((size_t)VOCAB * DIM * sizeof(float));
        for (size_t i = 0; i < (size_t)VOCAB * DIM; i++)
                m->table_abs[i] = fabsf(m->table.h[i]);
        m->attn_norm = pair_new(DIM, 1.0f), m->mlp_norm = pair_new(DIM, 1.0f), m->final_norm = pair_new(DIM, 1.0f);
        for (size_t i = 0; i < DIM; i++) {      /* gains near 1 */
                m->attn_norm.h[i] += 1.5f, m->mlp_norm.h[i] += 1.5f, m->final_norm.h[i] += 1.5f;
        }
        resync(&m->attn_norm, DIM), resync(&m->mlp_norm, DIM), resync(&m->final_norm, DIM);
        m->inv_freq = pair_new(HD / 2, 0);
        for (size_t i = 0; i < HD / 2; i++)     /* SmolLM2's rope_theta 100000 */
                m->inv_freq.h[i] = powf(100000.0f, -2.0f * (float)i / (float)HD);
        resync(&m->inv_freq, HD / 2);
        m->wq = bf16_weights(DIM, DIM, &m->aq, &m->dq);
        m->wk = bf16_weights(KV_W, DIM, &m->ak, &m->dk);
        m->wv = bf16_weights(KV_W, DIM, &m->av, &m->dv);
        m->wo = bf16_weights(DIM, DIM, &m->ao, &m->dwo);
        m->wg = bf16_weights(HIDDEN, DIM, &m->ag, &m->dg);
        m->wu = bf16_weights(HIDDEN, DIM, &m->au, &m->du);
        m->wd = bf16_weights(DIM, HIDDEN, &m->ad, &m->dd);
}

static void model_free(model *m) {
        pair_free(&m->table), pair_free(&m->attn_norm), pair_free(&m->mlp_norm), pair_free(&m->final_norm);
        pair_free(&m->inv_freq);
        uint16_t *hs[] = {m->wq, m->wk, m->wv, m->wo, m->wg, m->wu, m->wd, m->aq, m->ak, m->av, m->ao, m->ag, m->au,
                          m->ad};
        void *ds[] = {m->dq, m->dk, m->dv, m->dwo, m->dg, m->du, m->dd};
        for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
                free(hs[i]);
        for (size_t i = 0; i < sizeof ds / sizeof *ds; i++)
                tsr_backend_mem_free(gpu, ds[i]);
        free(m->table_abs);
}

/* The activations of one step, on both backends. */
typedef struct acts {
        pair x, h, q, k, v, att, o, g, up, dn, f, logits, lp, sm, kc, vc;
} acts;

/* Run op `call` on both backends (its arguments through the macro H/D selectors). */
#define BOTH(name, call)                                                                           \
        do {                                                                                       \
                tsr_backend *be_ = ref;                                                            \
                bool on_dev_ = false;                                                              \
                ok(name " (cpu-ref)", call);                                                       \
                be_ = gpu, on_dev_ = true;                                                         \
                ok(name " (cuda)", call);                                                          \
        } while (0)
#define P(p) (on_dev_ ? (p).d : (p).h)

/* After an op: stepwise, check it within `bound` and reset CUDA's output to ref's;
 * chained, print the drift. */
static void after(bool stepwise, const char *op, size_t step, const pair *p, size_t n, const double *bound) {
        if (stepwise) {
                check(op, step, p, n, bound, true);
                resync(p, n);
        } else {
                double worst = check(op, step, p, n, NULL, false);
                printf("  chained step %zu %-12s max |cuda - ref| %.3g\n", step, op, worst);
        }
}

/* A linear layer on both backends (weights: host wh for cpu-ref, device wd for CUDA, host
 * absolute values wabs for the bound), then after(). */
static void linear(bool stepwise, size_t step, const char *op, pair *out, const pair *in, size_t rows, size_t n,
                   size_t d, const void *wh, const void *wd, const void *wabs, tsr_dtype t, double *bound) {
        ok(op, tsr_backend_matmul(ref, out->h, in->h, wh, t, rows, n, d));
        ok(op, tsr_backend_matmul(gpu, out->d, in->d, wd, t, rows, n, d));
        matmul_bound(bound, in->h, rows, n, d, wabs, t);
        after(stepwise, op, step, out, rows * d, bound);
}

static void run_steps(model *m, bool stepwise) {
        acts a;
        pair *all[] = {&a.x, &a.h, &a.q, &a.k, &a.v, &a.att, &a.o, &a.g, &a.up, &a.dn, &a.f, &a.logits, &a.lp, &a.sm,
                       &a.kc, &a.vc};
        size_t sizes[] = {MAX_ROWS * DIM,    MAX_ROWS * DIM,  MAX_ROWS * DIM,    MAX_ROWS * KV_W,
                          MAX_ROWS * KV_W,   MAX_ROWS * DIM,  MAX_ROWS * DIM,    MAX_ROWS * HIDDEN,
                          MAX_ROWS * HIDDEN, MAX_ROWS * DIM,  MAX_ROWS * DIM,    (size_t)MAX_ROWS * VOCAB,
                          (size_t)MAX_ROWS * VOCAB, (size_t)MAX_ROWS * VOCAB, N_BLOCKS * BS * KV_W,
                          N_BLOCKS * BS * KV_W};
        uint32_t table[N_BLOCKS], ids[MAX_ROWS], pos[MAX_ROWS];
        size_t big = (size_t)MAX_ROWS * VOCAB;
        double *bound = malloc(big * sizeof *bound);
        float scale = 1.0f / sqrtf((float)HD);

        rng = 42;       /* the same cache rows and ids in both passes */
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
                *all[i] = pair_new(sizes[i], all[i] == &a.kc || all[i] == &a.vc ? 1.0f : 0);
        for (size_t b = 0; b < N_BLOCKS; b++)   /* scattered, distinct blocks */
                table[b] = (uint32_t)((b * 7 + 3) % N_BLOCKS);
        tsr_kv_view kvh = {.k = a.kc.h, .v = a.vc.h, .block_table = table, .n_table = N_BLOCKS,
                           .n_blocks = N_BLOCKS, .block_size = BS, .n_kv_heads = N_KV, .head_dim = HD};
        tsr_kv_view kvd = kvh;
        kvd.k = a.kc.d, kvd.v = a.vc.d;
#define KV (on_dev_ ? &kvd : &kvh)

        for (size_t s = 0; s < sizeof steps / sizeof *steps; s++) {
                size_t R = steps[s].rows, past = steps[s].past;
                for (size_t r = 0; r < R; r++) {
                        ids[r] = (uint32_t)(rng % VOCAB), rng = rng * 6364136223846793005ull + 1;
                        pos[r] = (uint32_t)(past + r);
                }
                if (!stepwise)
                        printf("chained step %zu: rows %zu past_len %zu\n", s, R, past);

                BOTH("embedding", tsr_backend_embedding(be_, P(a.x), P(m->table), TSR_DTYPE_F32, VOCAB, DIM, ids, R));
                after(stepwise, "embedding", s, &a.x, R * DIM, NULL);

                BOTH("rmsnorm", tsr_backend_rmsnorm(be_, P(a.h), P(a.x), P(m->attn_norm), R, DIM, 1e-5f));
                norm_bound(bound, a.h.h, R * DIM);
                after(stepwise, "rmsnorm", s, &a.h, R * DIM, bound);

                BOTH("matmul q", tsr_backend_matmul(be_, P(a.q), P(a.h), on_dev_ ? m->dq : m->wq, TSR_DTYPE_BF16, R,
                                                    DIM, DIM));
                matmul_bound(bound, a.h.h, R, DIM, DIM, m->aq, TSR_DTYPE_BF16);
                after(stepwise, "matmul_q", s, &a.q, R * DIM, bound);
                BOTH("matmul k", tsr_backend_matmul(be_, P(a.k), P(a.h), on_dev_ ? m->dk : m->wk, TSR_DTYPE_BF16, R,
                                                    DIM, KV_W));
                matmul_bound(bound, a.h.h, R, DIM, KV_W, m->ak, TSR_DTYPE_BF16);
                after(stepwise, "matmul_k", s, &a.k, R * KV_W, bound);
                BOTH("matmul v", tsr_backend_matmul(be_, P(a.v), P(a.h), on_dev_ ? m->dv : m->wv, TSR_DTYPE_BF16, R,
                                                    DIM, KV_W));
                matmul_bound(bound, a.h.h, R, DIM, KV_W, m->av, TSR_DTYPE_BF16);
                after(stepwise, "matmul_v", s, &a.v, R * KV_W, bound);

                rope_bound(bound, a.q.h, R * N_HEADS);  /* from the inputs, before the rotation */
                BOTH("rope q", tsr_backend_rope(be_, P(a.q), R, N_HEADS, HD, pos, P(m->inv_freq), TSR_ROPE_NEOX));
                after(stepwise, "rope_q", s, &a.q, R * DIM, bound);
                rope_bound(bound, a.k.h, R * N_KV);
                BOTH("rope k", tsr_backend_rope(be_, P(a.k), R, N_KV, HD, pos, P(m->inv_freq), TSR_ROPE_NEOX));
                after(stepwise, "rope_k", s, &a.k, R * KV_W, bound);

                BOTH("kv_write", tsr_backend_kv_write(be_, KV, P(a.k), P(a.v), R, past));
                after(stepwise, "kv_write_k", s, &a.kc, N_BLOCKS * BS * KV_W, NULL);
                after(stepwise, "kv_write_v", s, &a.vc, N_BLOCKS * BS * KV_W, NULL);

                BOTH("attention", tsr_backend_attention(be_, P(a.att), P(a.q), KV, R, past, N_HEADS, scale));
                attention_bound(bound, a.q.h, a.kc.h, a.vc.h, table, R, past, scale);
                after(stepwise, "attention", s, &a.att, R * DIM, bound);

                linear(stepwise, s, "matmul_o", &a.o, &a.att, R, DIM, DIM, m->wo, m->dwo, m->ao, TSR_DTYPE_BF16,
                       bound);

                /* x += o (bitwise), h = rmsnorm(x) */
                BOTH("add_rmsnorm", tsr_backend_add_rmsnorm(be_, P(a.h), P(a.x), P(a.o), P(m->mlp_norm), R, DIM,
                                                            1e-5f));
                after(stepwise, "residual_1", s, &a.x, R * DIM, NULL);
                norm_bound(bound, a.h.h, R * DIM);
                after(stepwise, "add_rmsnorm", s, &a.h, R * DIM, bound);

                linear(stepwise, s, "matmul_gate", &a.g, &a.h, R, DIM, HIDDEN, m->wg, m->dg, m->ag, TSR_DTYPE_BF16,
                       bound);
                linear(stepwise, s, "matmul_up", &a.up, &a.h, R, DIM, HIDDEN, m->wu, m->du, m->au, TSR_DTYPE_BF16,
                       bound);

                BOTH("silu_mul", tsr_backend_silu_mul(be_, P(a.g), P(a.g), P(a.up), R * HIDDEN));
                silu_bound(bound, a.g.h, R * HIDDEN);
                after(stepwise, "silu_mul", s, &a.g, R * HIDDEN, bound);

                linear(stepwise, s, "matmul_down", &a.dn, &a.g, R, HIDDEN, DIM, m->wd, m->dd, m->ad, TSR_DTYPE_BF16,
                       bound);

                BOTH("add", tsr_backend_add(be_, P(a.x), P(a.x), P(a.dn), R * DIM));
                after(stepwise, "residual_2", s, &a.x, R * DIM, NULL);

                BOTH("rmsnorm final", tsr_backend_rmsnorm(be_, P(a.f), P(a.x), P(m->final_norm), R, DIM, 1e-5f));
                norm_bound(bound, a.f.h, R * DIM);
                after(stepwise, "final_norm", s, &a.f, R * DIM, bound);

                linear(stepwise, s, "lm_head", &a.logits, &a.f, R, DIM, VOCAB, m->table.h, m->table.d, m->table_abs,
                       TSR_DTYPE_F32, bound);

                BOTH("log_softmax", tsr_backend_log_softmax(be_, P(a.lp), P(a.logits), R, VOCAB));
                softmax_bound(bound, a.lp.h, R * VOCAB, true);
                after(stepwise, "log_softmax", s, &a.lp, R * VOCAB, bound);
                BOTH("softmax", tsr_backend_softmax(be_, P(a.sm), P(a.logits), R, VOCAB));
                softmax_bound(bound, a.sm.h, R * VOCAB, false);
                after(stepwise, "softmax", s, &a.sm, R * VOCAB, bound);

                if (!stepwise) {        /* the end of the chain: logits and log-probs near ref's */
                        size_t argmax_differs = 0;
                        for (size_t r = 0; r < R; r++) {
                                double mx = 0;
                                size_t best = 0;
                                for (size_t i = 0; i < VOCAB; i++) {
                                        mx = fmax(mx, fabs(a.logits.h[r * VOCAB + i]));
                                        if (a.logits.h[r * VOCAB + i] > a.logits.h[r * VOCAB + best])
                                                best = i;
                                }
                                for (size_t i = 0; i < VOCAB; i++)
                                        bound[r * VOCAB + i] = 1e-2 * mx;
                                float *got = malloc(VOCAB * sizeof *got);
                                ok("download", tsr_backend_download(gpu, got, a.logits.d + r * VOCAB,
                                                                    VOCAB * sizeof *got));
                                size_t gbest = 0;
                                for (size_t i = 0; i < VOCAB; i++)
                                        if (got[i] > got[gbest])
                                                gbest = i;
                                argmax_differs += gbest != best;
                                free(got);
                        }
                        check("chained logits", s, &a.logits, R * VOCAB, bound, true);
                        check("chained log_softmax", s, &a.lp, R * VOCAB, bound, true);
                        printf("  chained step %zu: greedy token differs in %zu of %zu rows\n", s, argmax_differs,
                               R);
                }
        }
#undef KV
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
                pair_free(all[i]);
        free(bound);
}

/* kv_write_batch and attention_batch: three sequences of one step (a decode row at
 * past_len 300, a 37-row prefill, a 5-row chunk at past_len 40) with their own scattered
 * tables over one cache.  CUDA's one launch against cpu-ref (the per-sequence ops in
 * turn): the caches bitwise, attention within attention_bound per sequence; and against
 * CUDA's own per-sequence ops bitwise (kernels.h: each sequence's rows are what the
 * one-sequence op gives). */
static void batch_check(void) {
        enum { NB = 32, NSEQ = 3 };
        static const size_t seq_n[NSEQ] = {1, 37, 5}, seq_past[NSEQ] = {300, 0, 40};
        uint32_t tables[NB];
        tsr_kv_seq seqs[NSEQ];
        size_t rows = 0, used = 0;
        float scale = 1.0f / sqrtf((float)HD);

        rng = 7;
        for (size_t b = 0; b < NB; b++)
                tables[b] = (uint32_t)((b * 13 + 5) % NB);      /* a permutation: disjoint tables */
        for (size_t i = 0; i < NSEQ; i++) {
                size_t need = (seq_past[i] + seq_n[i] + BS - 1) / BS;
                seqs[i] = (tsr_kv_seq){tables + used, need, seq_n[i], seq_past[i]};
                used += need, rows += seq_n[i];
        }
        pair kc = pair_new((size_t)NB * BS * KV_W, 1.0f), vc = pair_new((size_t)NB * BS * KV_W, 1.0f);
        pair k = pair_new(rows * KV_W, 1.0f), v = pair_new(rows * KV_W, 1.0f);
        pair q = pair_new(rows * DIM, 0.3f), out = pair_new(rows * DIM, 0), alone = pair_new(rows * DIM, 0);
        tsr_kv_view kvh = {.k = kc.h, .v = vc.h, .block_table = NULL, .n_table = 0, .n_blocks = NB,
                           .block_size = BS, .n_kv_heads = N_KV, .head_dim = HD};
        tsr_kv_view kvd = kvh;
        kvd.k = kc.d, kvd.v = vc.d;
        double *bound = malloc(rows * DIM * sizeof *bound);

        ok("kv_write_batch (cpu-ref)", tsr_backend_kv_write_batch(ref, &kvh, seqs, NSEQ, k.h, v.h));
        ok("kv_write_batch (cuda)", tsr_backend_kv_write_batch(gpu, &kvd, seqs, NSEQ, k.d, v.d));
        check("kv_write_batch k", 0, &kc, kc.n, NULL, true);
        check("kv_write_batch v", 0, &vc, vc.n, NULL, true);
        ok("attention_batch (cpu-ref)", tsr_backend_attention_batch(ref, out.h, q.h, &kvh, seqs, NSEQ, N_HEADS, scale));
        ok("attention_batch (cuda)", tsr_backend_attention_batch(gpu, out.d, q.d, &kvd, seqs, NSEQ, N_HEADS, scale));
        for (size_t i = 0, r = 0; i < NSEQ; r += seq_n[i], i++)
                attention_bound(bound + r * DIM, q.h + r * DIM, kc.h, vc.h, seqs[i].block_table, seq_n[i],
                                seq_past[i], scale);
        check("attention_batch", 0, &out, rows * DIM, bound, true);
        for (size_t i = 0, r = 0; i < NSEQ; r += seq_n[i], i++) {       /* CUDA per sequence, into alone */
                tsr_kv_view sv = kvd;
                sv.block_table = seqs[i].block_table, sv.n_table = seqs[i].n_table;
                ok("attention (cuda)", tsr_backend_attention(gpu, alone.d + r * DIM, q.d + r * DIM, &sv, seq_n[i],
                                                             seq_past[i], N_HEADS, scale));
        }
        ok("synchronize", tsr_backend_synchronize(gpu));
        ok("download", tsr_backend_download(gpu, alone.h, alone.d, rows * DIM * sizeof(float)));
        pair batched_vs_alone = {alone.h, out.d, rows * DIM};     /* CUDA's batch against CUDA alone */
        check("attention_batch vs per-sequence cuda", 0, &batched_vs_alone, rows * DIM, NULL, true);
        printf("batch: kv_write_batch and attention_batch over %d sequences (%zu rows) checked\n", NSEQ, rows);
        pair_free(&kc), pair_free(&vc), pair_free(&k), pair_free(&v), pair_free(&q), pair_free(&out);
        pair_free(&alone);
        free(bound);
}

int main(void) {
        model m;
        tsr_status st = tsr_backend_cuda_new(0, &gpu);

        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND) {
                printf("[skip:no-gpu] no CUDA device (%s)\n",
                       st == TSR_E_UNSUPPORTED ? "CUDA not built" : "none found");
                return 77;
        }
        if (st != TSR_OK)
                die("tsr_backend_cuda_new", st);
        ok("tsr_backend_cpu_ref_new", tsr_backend_cpu_ref_new(&ref));
        model_init(&m);
        printf("stepwise: each op from cpu-ref's inputs, within its bound\n");
        run_steps(&m, true);
        int stepwise_failures = failures;
        printf("stepwise: %d failed checks\n", stepwise_failures);
        run_steps(&m, false);
        printf("chained: %d failed checks\n", failures - stepwise_failures);
        batch_check();
        model_free(&m);
        tsr_backend_free(&gpu);
        tsr_backend_free(&ref);
        printf("%s\n", failures ? "FAIL" : "OK");
        return failures ? 1 : 0;
}
