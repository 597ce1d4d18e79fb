/* test_mamba.c - NemotronH's two backend ops, tsr_backend_mamba_mixer and
 * tsr_backend_relu_sq (kernels.h), on every backend.
 *
 * The mixer against a float64 oracle written here from kernels.h's definition (the
 * recurrence token by token, as transformers' torch_forward computes it), within a stated
 * bound, on shapes that reach every path of cpu/mamba.c: the recurrence, the chunked (SSD)
 * form on whole aligned chunks, a chunk cut short by chunked_end, prefix-cache saves on a
 * chunk's edge and between tokens, odd head_dim / state widths (the vector tails), one
 * group with the norm left to the caller (leaves), a conv of one tap.  Then:
 *   - the fast backend at 1 and 2 threads and cpu-devlike give cpu-ref's bits (y, both
 *     states, every saved slot, leaves);
 *   - a prompt cut into steps at a chunk multiple gives the bits of the prompt in one step;
 *   - CUDA (device 0) within the bound of the oracle; "[skip:no-gpu]" without one;
 *   - arguments kernels.h refuses are TSR_E_INVAL with nothing written.
 * relu_sq and round_bf16 against their definitions, bitwise, on every backend. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

#define MAX_SEQS 4
#define UNTOUCHED 1234.5f       /* y's value before the op */

static uint64_t rng_state;

static float frand(void) {      /* uniform in [-1, 1), xorshift64* */
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return (float)((rng_state * 0x2545F4914F6CDD1Dull) >> 40) / (float)(1u << 23) - 1.0f;
}

static float *rand_vec(size_t n, float lo, float hi) {
        float *v = malloc((n ? n : 1) * sizeof *v);
        assert_non_null(v);
        for (size_t i = 0; i < n; i++)
                v[i] = lo + (hi - lo) * 0.5f * (frand() + 1.0f);
        return v;
}

/* One case: shapes, parameters, sequences and the state before the step. */
typedef struct mcase {
        const char *name;
        tsr_mamba_dims d;
        bool bias, leaves;
        size_t n_leaves, n_slots, n_seqs, rows;
        tsr_mamba_seq seqs[MAX_SEQS];
        tsr_state_save saves[MAX_SEQS][4];
        float *conv_w, *conv_b, *dt_bias, *A, *D, *norm;
        float *proj, *conv0, *ssm0;     /* the state arrays before the step */
} mcase;

static size_t di_of(const tsr_mamba_dims *d) { return d->heads * d->head_dim; }
static size_t cd_of(const tsr_mamba_dims *d) { return di_of(d) + 2 * d->groups * d->state; }
static size_t pr_of(const tsr_mamba_dims *d) { return di_of(d) + cd_of(d) + d->heads; }
static size_t ce_of(const tsr_mamba_dims *d) { return (d->conv_kernel - 1) * cd_of(d); }
static size_t se_of(const tsr_mamba_dims *d) { return d->heads * d->head_dim * d->state; }

/* A sequence: n rows from the case's next free row, at past_len, in slot `slot`; saves
 * (pos, slot) pairs, count of them. */
static void add_seq(mcase *c, size_t n, size_t past_len, uint32_t slot, size_t chunked_end, const uint32_t *saves,
                    size_t n_saves) {
        tsr_mamba_seq *q = &c->seqs[c->n_seqs];
        for (size_t k = 0; k < n_saves; k++)
                c->saves[c->n_seqs][k] = (tsr_state_save){saves[2 * k], saves[2 * k + 1]};
        *q = (tsr_mamba_seq){.row = c->rows, .n = n, .past_len = past_len, .chunked_end = chunked_end, .slot = slot,
                             .saves = n_saves ? c->saves[c->n_seqs] : NULL, .n_saves = n_saves};
        c->rows += n;
        c->n_seqs++;
}

/* The parameters and inputs from a seed.  A fresh sequence's slot (past_len 0) is zeroed,
 * as the caller of the op does. */
static void fill(mcase *c, uint64_t seed) {
        const tsr_mamba_dims *d = &c->d;
        size_t cd = cd_of(d), H = d->heads;
        rng_state = seed * 0x9e3779b97f4a7c15ull + 1;
        c->conv_w = rand_vec(cd * d->conv_kernel, -0.6f, 0.6f);
        c->conv_b = c->bias ? rand_vec(cd, -0.2f, 0.2f) : NULL;
        c->dt_bias = rand_vec(H, -3.0f, 0.5f);
        c->A = rand_vec(H, -2.0f, 1.0f);
        for (size_t h = 0; h < H; h++)          /* A = -exp(A_log) */
                c->A[h] = -expf(c->A[h]);
        c->D = rand_vec(H, -1.0f, 1.0f);
        c->norm = rand_vec(di_of(d), 0.5f, 1.5f);
        c->proj = rand_vec(c->rows * pr_of(d), -2.0f, 2.0f);
        c->conv0 = rand_vec(c->n_slots * ce_of(d), -2.0f, 2.0f);
        c->ssm0 = rand_vec(c->n_slots * se_of(d), -0.5f, 0.5f);
        for (size_t i = 0; i < c->n_seqs; i++)
                if (c->seqs[i].past_len == 0) {
                        memset(c->conv0 + c->seqs[i].slot * ce_of(d), 0, ce_of(d) * sizeof(float));
                        memset(c->ssm0 + c->seqs[i].slot * se_of(d), 0, se_of(d) * sizeof(float));
                }
}

static void mcase_free(mcase *c) {
        float *p[] = {c->conv_w, c->conv_b, c->dt_bias, c->A, c->D, c->norm, c->proj, c->conv0, c->ssm0};
        for (size_t i = 0; i < sizeof p / sizeof *p; i++)
                free(p[i]);
}

/* What the op writes: y, leaves and the two state arrays (every slot: saves land in
 * others). */
typedef struct result {
        float *y, *leaves, *conv, *ssm;
} result;

static void result_new(const mcase *c, result *r) {
        size_t ny = c->rows * di_of(&c->d), nl = c->n_leaves * c->rows;
        r->y = malloc(ny * sizeof(float));
        r->leaves = malloc((nl + 1) * sizeof(float));
        r->conv = malloc((c->n_slots * ce_of(&c->d) + 1) * sizeof(float));
        r->ssm = malloc(c->n_slots * se_of(&c->d) * sizeof(float));
        assert_true(r->y && r->leaves && r->conv && r->ssm);
        for (size_t i = 0; i < ny; i++)        /* what a row no sequence covers keeps */
                r->y[i] = UNTOUCHED;
}

static void result_free(result *r) {
        free(r->y);
        free(r->leaves);
        free(r->conv);
        free(r->ssm);
}

/* ---- the oracle ------------------------------------------------------------------------ */

static double silu_d(double a) { return a / (1.0 + exp(-a)); }

/* The whole step in float64, into want (as result, doubles). */
typedef struct oracle {
        double *y, *leaves, *conv, *ssm;
} oracle;

static void oracle_run(const mcase *c, oracle *o) {
        const tsr_mamba_dims *d = &c->d;
        size_t di = di_of(d), cd = cd_of(d), pr = pr_of(d), K = d->conv_kernel, H = d->heads, P = d->head_dim;
        size_t NS = d->state, G = d->groups, hpg = H / G, gs = di / G, ce = ce_of(d), se = se_of(d);
        o->y = malloc(c->rows * di * sizeof(double));
        o->leaves = calloc(c->n_leaves * c->rows + 1, sizeof(double));
        o->conv = malloc((c->n_slots * ce + 1) * sizeof(double));
        o->ssm = malloc(c->n_slots * se * sizeof(double));
        double *xbc = malloc(cd * sizeof(double));
        assert_true(o->y && o->leaves && o->conv && o->ssm && xbc);
        for (size_t i = 0; i < c->rows * di; i++)
                o->y[i] = UNTOUCHED;
        for (size_t i = 0; i < c->n_slots * ce; i++)
                o->conv[i] = c->conv0[i];
        for (size_t i = 0; i < c->n_slots * se; i++)
                o->ssm[i] = c->ssm0[i];
        for (size_t i = 0; i < c->n_seqs; i++) {
                const tsr_mamba_seq *q = &c->seqs[i];
                double *S = o->ssm + q->slot * se, *cs = o->conv + q->slot * ce;
                /* the raw window: the K-1 state rows, then the sequence's xBC rows */
                size_t nw = K - 1 + q->n;
                double *win = malloc(nw * cd * sizeof(double));
                assert_non_null(win);
                for (size_t w = 0; w < nw; w++)
                        for (size_t ch = 0; ch < cd; ch++)
                                win[w * cd + ch] = w < K - 1 ? cs[w * cd + ch]
                                                             : c->proj[(q->row + w - (K - 1)) * pr + di + ch];
                size_t next_save = 0;
                for (size_t t = 0; t < q->n; t++) {
                        const float *row = c->proj + (q->row + t) * pr;
                        double *y = o->y + (q->row + t) * di;
                        for (size_t ch = 0; ch < cd; ch++) {
                                double a = c->conv_b ? c->conv_b[ch] : 0.0;
                                for (size_t k = 0; k < K; k++)
                                        a += (double)c->conv_w[ch * K + k] * win[(t + k) * cd + ch];
                                xbc[ch] = silu_d(a);
                        }
                        for (size_t h = 0; h < H; h++) {
                                size_t g = h / hpg;
                                double v = (double)row[di + cd + h] + c->dt_bias[h];
                                double dt = v > 20.0 ? v : log1p(exp(v));
                                dt = fmin(fmax(dt, d->dt_min), d->dt_max);
                                double dA = exp(dt * c->A[h]);
                                const double *B = xbc + di + g * NS, *C = xbc + di + G * NS + g * NS;
                                for (size_t p = 0; p < P; p++) {
                                        double xv = xbc[h * P + p], acc = 0.0;
                                        double *Sp = S + (h * P + p) * NS;
                                        for (size_t n = 0; n < NS; n++) {
                                                Sp[n] = Sp[n] * dA + dt * B[n] * xv;
                                                acc += Sp[n] * C[n];
                                        }
                                        y[h * P + p] = acc + c->D[h] * xv;
                                }
                        }
                        for (size_t e = 0; e < di; e++)
                                y[e] *= silu_d(row[e]);
                        if (c->leaves) {
                                size_t lw = di / c->n_leaves;
                                for (size_t l = 0; l < c->n_leaves; l++) {
                                        double ss = 0.0;
                                        for (size_t e = l * lw; e < (l + 1) * lw; e++)
                                                ss += y[e] * y[e];
                                        o->leaves[l * c->rows + q->row + t] = ss;
                                }
                        } else {
                                for (size_t g = 0; g < G; g++) {
                                        double ss = 0.0, *u = y + g * gs;
                                        for (size_t e = 0; e < gs; e++)
                                                ss += u[e] * u[e];
                                        double rs = 1.0 / sqrt(ss / (double)gs + d->eps);
                                        for (size_t e = 0; e < gs; e++)
                                                u[e] = c->norm[g * gs + e] * u[e] * rs;
                                }
                        }
                        if (next_save < q->n_saves && q->saves[next_save].pos == q->past_len + t + 1) {
                                uint32_t to = q->saves[next_save++].slot;
                                memcpy(o->ssm + to * se, S, se * sizeof(double));
                                for (size_t r = 0; r + 1 < K; r++)
                                        for (size_t ch = 0; ch < cd; ch++)
                                                o->conv[to * ce + r * cd + ch] = win[(t + 1 + r) * cd + ch];
                        }
                }
                for (size_t r = 0; r + 1 < K; r++)
                        for (size_t ch = 0; ch < cd; ch++)
                                cs[r * cd + ch] = win[(q->n + r) * cd + ch];
                free(win);
        }
        free(xbc);
}

static void oracle_free(oracle *o) {
        free(o->y);
        free(o->leaves);
        free(o->conv);
        free(o->ssm);
}

/* got within 2e-4 (1 + |want|) of want everywhere; prints the first misses. */
static size_t near(const char *what, const char *be, const float *got, const double *want, size_t n) {
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
                double tol = 2e-4 * (1.0 + fabs(want[i]));
                if (!(fabs((double)got[i] - want[i]) <= tol)) {
                        if (bad++ < 5)
                                print_message("%s %s[%zu]: got %.9g want %.9g\n", be, what, i, (double)got[i],
                                              want[i]);
                }
        }
        return bad;
}

/* ---- running the op -------------------------------------------------------------------- */

static tsr_status run_op(tsr_backend *be, const mcase *c, const tsr_mamba_seq *seqs, size_t n_seqs, result *r);

/* The case on `be` (its memory through upload / download), into r from the case's state. */
static tsr_status run_case(tsr_backend *be, const mcase *c, result *r) {
        memcpy(r->conv, c->conv0, c->n_slots * ce_of(&c->d) * sizeof(float));
        memcpy(r->ssm, c->ssm0, c->n_slots * se_of(&c->d) * sizeof(float));
        return run_op(be, c, c->seqs, c->n_seqs, r);
}

/* Backend memory holding n floats of host (NULL: none). */
static float *dev_of(tsr_backend *be, const float *host, size_t n) {
        void *p = NULL;
        if (!host)
                return NULL;
        assert_int_equal(tsr_backend_mem_alloc(be, (n ? n : 1) * sizeof(float), &p), TSR_OK);
        assert_int_equal(tsr_backend_upload(be, p, host, n * sizeof(float)), TSR_OK);
        return p;
}

/* The op over seqs, r's state arrays in and out, y and leaves out. */
static tsr_status run_op(tsr_backend *be, const mcase *c, const tsr_mamba_seq *seqs, size_t n_seqs, result *r) {
        const tsr_mamba_dims *d = &c->d;
        size_t ny = c->rows * di_of(d), nl = c->n_leaves * c->rows, nc = c->n_slots * ce_of(d);
        size_t ns = c->n_slots * se_of(d), cd = cd_of(d);
        float *conv_w = dev_of(be, c->conv_w, cd * d->conv_kernel), *conv_b = dev_of(be, c->conv_b, cd);
        float *dt_bias = dev_of(be, c->dt_bias, d->heads), *A = dev_of(be, c->A, d->heads);
        float *D = dev_of(be, c->D, d->heads), *norm = dev_of(be, c->norm, di_of(d));
        float *proj = dev_of(be, c->proj, c->rows * pr_of(d)), *conv = dev_of(be, r->conv, nc + 1);
        float *ssm = dev_of(be, r->ssm, ns), *y = dev_of(be, r->y, ny), *leaves = dev_of(be, r->leaves, nl + 1);
        tsr_mamba_weights w = {conv_w, conv_b, dt_bias, A, D, norm};
        tsr_status st = tsr_backend_mamba_mixer(be, d, &w, proj, c->rows, conv, ssm, c->n_slots, seqs, n_seqs, y,
                                                c->leaves ? leaves : NULL, c->n_leaves);
        if (st == TSR_OK)
                st = tsr_backend_synchronize(be);
        assert_int_equal(tsr_backend_download(be, r->y, y, ny * sizeof(float)), TSR_OK);
        assert_int_equal(tsr_backend_download(be, r->leaves, leaves, nl * sizeof(float)), TSR_OK);
        assert_int_equal(tsr_backend_download(be, r->conv, conv, nc * sizeof(float)), TSR_OK);
        assert_int_equal(tsr_backend_download(be, r->ssm, ssm, ns * sizeof(float)), TSR_OK);
        float *all[] = {conv_w, conv_b, dt_bias, A, D, norm, proj, conv, ssm, y, leaves};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                if (all[i])
                        tsr_backend_mem_free(be, all[i]);
        return st;
}

/* ---- the cases ----------------------------------------------------------------------- */

#define N_CASES 6

static void make_case(int i, mcase *c) {
        *c = (mcase){0};
        c->n_slots = 12;
        switch (i) {
        case 0: /* the recurrence only: a decode row, a fresh prefill, a continued one with saves */
                c->name = "recurrence";
                c->d = (tsr_mamba_dims){.heads = 4, .head_dim = 3, .state = 5, .groups = 2, .conv_kernel = 4,
                                        .eps = 1e-5f, .dt_min = 0.0f, .dt_max = INFINITY};
                c->bias = true;
                add_seq(c, 1, 7, 2, 0, NULL, 0);
                add_seq(c, 6, 0, 0, 0, NULL, 0);
                add_seq(c, 3, 2, 5, 0, (const uint32_t[]){3, 9, 5, 10}, 2);
                fill(c, 11);
                c->dt_bias[1] = 90.0f;  /* softplus's threshold: exp(90) is past float's range */
                return;
        case 1: /* chunks of 4: whole ones, one cut by chunked_end, saves on and between edges */
                c->name = "chunked";
                c->d = (tsr_mamba_dims){.heads = 6, .head_dim = 8, .state = 16, .groups = 3, .conv_kernel = 4,
                                        .chunk = 4, .eps = 1e-5f, .dt_min = 0.001f, .dt_max = 0.5f};
                c->bias = true;
                add_seq(c, 13, 0, 1, 0, (const uint32_t[]){4, 7, 8, 8, 11, 9}, 3);
                c->rows += 2;   /* two rows of no sequence: left as they are */
                add_seq(c, 10, 3, 3, 0, NULL, 0);
                add_seq(c, 1, 9, 4, 0, NULL, 0);
                add_seq(c, 9, 0, 6, 5, NULL, 0);
                break;
        case 2: /* odd widths: every vector tail of the chunked form */
                c->name = "chunked-odd";
                c->d = (tsr_mamba_dims){.heads = 2, .head_dim = 7, .state = 9, .groups = 2, .conv_kernel = 3,
                                        .chunk = 3, .eps = 1e-6f, .dt_min = 0.0f, .dt_max = INFINITY};
                add_seq(c, 11, 1, 0, 0, (const uint32_t[]){6, 3}, 1);
                add_seq(c, 7, 0, 1, 0, NULL, 0);
                break;
        case 3: /* a long chunk, wider than the state */
                c->name = "chunked-wide";
                c->d = (tsr_mamba_dims){.heads = 2, .head_dim = 33, .state = 8, .groups = 1, .conv_kernel = 4,
                                        .chunk = 16, .eps = 1e-5f, .dt_min = 0.0f, .dt_max = INFINITY};
                c->bias = true;
                add_seq(c, 37, 0, 0, 0, NULL, 0);
                break;
        case 4: /* one group spanning ranks: the norm left to the caller */
                c->name = "leaves";
                c->d = (tsr_mamba_dims){.heads = 2, .head_dim = 7, .state = 9, .groups = 1, .conv_kernel = 3,
                                        .chunk = 3, .eps = 1e-6f, .dt_min = 0.0f, .dt_max = INFINITY};
                c->leaves = true;
                c->n_leaves = 7;
                add_seq(c, 8, 0, 0, 0, NULL, 0);
                add_seq(c, 2, 4, 1, 0, NULL, 0);
                break;
        case 5: /* a conv of one tap: no conv state */
                c->name = "one-tap";
                c->d = (tsr_mamba_dims){.heads = 3, .head_dim = 2, .state = 4, .groups = 1, .conv_kernel = 1,
                                        .eps = 1e-5f, .dt_min = 0.0f, .dt_max = INFINITY};
                add_seq(c, 5, 0, 0, 0, NULL, 0);
                add_seq(c, 2, 3, 1, 0, (const uint32_t[]){4, 2}, 1);
                break;
        }
        fill(c, (uint64_t)i + 11);
}

static void expect_same(const char *what, const char *be, const float *a, const float *b, size_t n) {
        if (n && memcmp(a, b, n * sizeof(float))) {
                for (size_t i = 0; i < n; i++)
                        if (memcmp(&a[i], &b[i], sizeof(float))) {
                                print_message("%s %s[%zu]: %.9g, cpu-ref %.9g\n", be, what, i, (double)a[i],
                                              (double)b[i]);
                                break;
                        }
                fail_msg("%s: %s not bitwise cpu-ref's", be, what);
        }
}

static void expect_results_same(const mcase *c, const char *be, const result *a, const result *b) {
        expect_same("y", be, a->y, b->y, c->rows * di_of(&c->d));
        expect_same("leaves", be, a->leaves, b->leaves, c->leaves ? c->n_leaves * c->rows : 0);
        expect_same("conv", be, a->conv, b->conv, c->n_slots * ce_of(&c->d));
        expect_same("ssm", be, a->ssm, b->ssm, c->n_slots * se_of(&c->d));
}

static size_t against_oracle(const mcase *c, const char *be, const result *r) {
        oracle o;
        oracle_run(c, &o);
        size_t bad = near(c->leaves ? "y (gated)" : "y", be, r->y, o.y, c->rows * di_of(&c->d));
        if (c->leaves)
                bad += near("leaves", be, r->leaves, o.leaves, c->n_leaves * c->rows);
        bad += near("conv", be, r->conv, o.conv, c->n_slots * ce_of(&c->d));
        bad += near("ssm", be, r->ssm, o.ssm, c->n_slots * se_of(&c->d));
        oracle_free(&o);
        return bad;
}

/* Every case on `be` against the oracle. */
static void all_against_oracle(tsr_backend *be) {
        for (int i = 0; i < N_CASES; i++) {
                mcase c;
                result r;
                make_case(i, &c);
                result_new(&c, &r);
                assert_int_equal(run_case(be, &c, &r), TSR_OK);
                size_t bad = against_oracle(&c, tsr_backend_name(be), &r);
                if (bad)
                        fail_msg("%s %s: %zu values off the oracle", tsr_backend_name(be), c.name, bad);
                print_message("%s %s: within the bound\n", tsr_backend_name(be), c.name);
                result_free(&r);
                mcase_free(&c);
        }
}

/* cpu-ref against the oracle. */
static void test_ref_oracle(void **state) {
        (void)state;
        tsr_backend *be;
        assert_int_equal(tsr_backend_cpu_ref_new(&be), TSR_OK);
        all_against_oracle(be);
        tsr_backend_free(&be);
}

/* The fast backend at 1 and 2 threads, and cpu-devlike: cpu-ref's bits. */
static void test_cpu_backends_bitwise(void **state) {
        (void)state;
        tsr_backend *ref, *bes[3];
        const char *names[3] = {"cpu-fast/1", "cpu-fast/2", "cpu-devlike"};
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 1, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &bes[0]), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &bes[1]), TSR_OK);
        assert_int_equal(tsr_backend_cpu_devlike_new(&bes[2]), TSR_OK);
        for (int i = 0; i < N_CASES; i++) {
                mcase c;
                result want, got;
                make_case(i, &c);
                result_new(&c, &want);
                result_new(&c, &got);
                assert_int_equal(run_case(ref, &c, &want), TSR_OK);
                for (int b = 0; b < 3; b++) {
                        assert_true(tsr_backend_supports(bes[b], TSR_OP_MAMBA_MIXER, TSR_DTYPE_F32));
                        assert_int_equal(run_case(bes[b], &c, &got), TSR_OK);
                        expect_results_same(&c, names[b], &got, &want);
                }
                result_free(&want);
                result_free(&got);
                mcase_free(&c);
        }
        for (int b = 0; b < 3; b++)
                tsr_backend_free(&bes[b]);
        tsr_backend_free(&ref);
}

/* A 12-token prompt at chunk 4 in one step, and as steps of 4 then 8 tokens (a chunk
 * multiple): the same y rows and state, bitwise. */
static void test_steps_at_chunk_multiples(void **state) {
        (void)state;
        tsr_backend *be;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &be), TSR_OK);
        mcase c = {.name = "steps", .n_slots = 2, .bias = true};
        c.d = (tsr_mamba_dims){.heads = 4, .head_dim = 5, .state = 12, .groups = 2, .conv_kernel = 4, .chunk = 4,
                               .eps = 1e-5f, .dt_min = 0.0f, .dt_max = INFINITY};
        add_seq(&c, 12, 0, 0, 0, NULL, 0);
        fill(&c, 99);
        result whole, cut;
        result_new(&c, &whole);
        result_new(&c, &cut);
        assert_int_equal(run_case(be, &c, &whole), TSR_OK);

        memcpy(cut.conv, c.conv0, c.n_slots * ce_of(&c.d) * sizeof(float));
        memcpy(cut.ssm, c.ssm0, c.n_slots * se_of(&c.d) * sizeof(float));
        size_t di = di_of(&c.d);
        float *y = malloc(12 * di * sizeof(float));
        assert_non_null(y);
        tsr_mamba_seq first = {.row = 0, .n = 4, .past_len = 0, .slot = 0};
        tsr_mamba_seq second = {.row = 4, .n = 8, .past_len = 4, .slot = 0};
        assert_int_equal(run_op(be, &c, &first, 1, &cut), TSR_OK);
        memcpy(y, cut.y, 4 * di * sizeof(float));
        assert_int_equal(run_op(be, &c, &second, 1, &cut), TSR_OK);
        memcpy(y + 4 * di, cut.y + 4 * di, 8 * di * sizeof(float));
        expect_same("y", "steps 4+8", y, whole.y, 12 * di);
        expect_same("ssm", "steps 4+8", cut.ssm, whole.ssm, se_of(&c.d));
        expect_same("conv", "steps 4+8", cut.conv, whole.conv, ce_of(&c.d));
        /* and the chunked form did run: a chunk's bits differ from the recurrence's */
        c.d.chunk = 0;
        result rec;
        result_new(&c, &rec);
        assert_int_equal(run_case(be, &c, &rec), TSR_OK);
        assert_true(memcmp(rec.y, whole.y, 12 * di * sizeof(float)) != 0);
        assert_int_equal(against_oracle(&c, "steps (recurrence)", &rec), 0);
        result_free(&rec);
        free(y);
        result_free(&whole);
        result_free(&cut);
        mcase_free(&c);
        tsr_backend_free(&be);
}

/* CUDA against the oracle. */
static void test_cuda(void **state) {
        (void)state;
        tsr_backend *be;
        tsr_status st = tsr_backend_cuda_new(0, &be);
        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND)
                TSR_SKIP("no-gpu", "mamba on cuda: %s", st == TSR_E_UNSUPPORTED ? "CUDA not built" : "no CUDA device");
        assert_int_equal(st, TSR_OK);
        assert_true(tsr_backend_supports(be, TSR_OP_MAMBA_MIXER, TSR_DTYPE_F32));
        all_against_oracle(be);
        tsr_backend_free(&be);
}

/* What kernels.h refuses: TSR_E_INVAL, y and the states untouched. */
static void test_refused(void **state) {
        (void)state;
        tsr_backend *be;
        assert_int_equal(tsr_backend_cpu_ref_new(&be), TSR_OK);
        mcase c;
        make_case(0, &c);
        result r;
        result_new(&c, &r);
        size_t ny = c.rows * di_of(&c.d);
        float *y0 = malloc(ny * sizeof(float));
        assert_non_null(y0);
        for (size_t i = 0; i < ny; i++)
                r.y[i] = y0[i] = 1234.5f;
        tsr_mamba_weights w = {c.conv_w, c.conv_b, c.dt_bias, c.A, c.D, c.norm};
        float *conv = malloc(c.n_slots * ce_of(&c.d) * sizeof(float)), *ssm = malloc(c.n_slots * se_of(&c.d) * sizeof(float));
        assert_true(conv && ssm);
        for (int k = 0; k < 10; k++) {
                tsr_mamba_dims d = c.d;
                tsr_mamba_seq s[MAX_SEQS];
                tsr_state_save bad_saves[2] = {{5, 9}, {3, 10}};        /* out of order */
                tsr_state_save dup_save[1] = {{3, 2}};                  /* slot 2 is a sequence's */
                size_t n_slots = c.n_slots, rows = c.rows, n_leaves = 0;
                float *leaves = NULL;
                memcpy(s, c.seqs, sizeof s);
                switch (k) {
                case 0: d.groups = 3; break;                    /* heads % groups */
                case 1: d.conv_kernel = TSR_MAMBA_MAX_CONV + 1; break;
                case 2: d.chunk = 1; break;
                case 3: s[1].slot = s[0].slot; break;           /* a slot twice */
                case 4: s[2].saves = bad_saves; break;
                case 5: s[2].saves = dup_save; s[2].n_saves = 1; break;
                case 6: s[2].n = 5; break;                       /* past the rows */
                case 7: s[0].slot = (uint32_t)n_slots; break;
                case 8: leaves = r.leaves; n_leaves = 1; break;  /* leaves with 2 groups */
                case 9: s[1].n = 0; break;
                }
                assert_int_equal(tsr_backend_mamba_mixer(be, &d, &w, c.proj, rows, conv, ssm, n_slots, s, c.n_seqs, r.y,
                                                         leaves, n_leaves),
                                 TSR_E_INVAL);
                assert_memory_equal(r.y, y0, ny * sizeof(float));
        }
        free(conv);
        free(ssm);
        free(y0);
        result_free(&r);
        mcase_free(&c);
        tsr_backend_free(&be);
}

/* bf16 from its definition: the nearest of the two bf16 values around x (by their
 * distance in double), ties to the even one; overflow past the largest to infinity. */
static float bf16_nearest(float x) {
        uint32_t u;
        memcpy(&u, &x, sizeof u);
        if (isnan(x) || isinf(x))
                return x;
        uint32_t lo_bits = u & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
        float lo, hi;
        memcpy(&lo, &lo_bits, sizeof lo);
        memcpy(&hi, &hi_bits, sizeof hi);       /* the next bf16 away from zero (inf past the top) */
        /* past the largest bf16 the next one up is 2^128 (IEEE's overflow rule) */
        double dl = fabs((double)x - lo), dh = isinf(hi) ? 0x1p128 - fabs((double)x) : fabs((double)hi - x);
        if (dl < dh)
                return lo;
        if (dh < dl)
                return hi;
        return (lo_bits >> 16) & 1 ? hi : lo;
}

/* relu_sq (max(x, 0)^2, NaN kept) and round_bf16 (the nearest bf16, ties to even, NaN
 * kept), bitwise their definitions on every backend there is. */
static void test_elementwise(void **state) {
        (void)state;
        float in[] = {-2.0f, -0.0f, 0.0f, 1e-30f, 0.5f, 3.0f, -INFINITY, INFINITY, NAN, 1e20f, -1e-45f, 1e-45f,
                            1.00390625f /* 1 + 2^-8: a tie, to even (1) */, 1.01171875f /* 1 + 3 x 2^-8: to 1 + 2^-6 */,
                            1.0039063f /* just past the tie: up */, -3.14159265f, 0.0f, 0.0f};
        enum { N = sizeof in / sizeof *in };
        uint32_t top_tie = 0x7f7f8000u, below_tie = 0xff7f7fffu;       /* past bf16's largest: a tie (to inf), and not */
        memcpy(&in[N - 2], &top_tie, sizeof top_tie);
        memcpy(&in[N - 1], &below_tie, sizeof below_tie);
        float want[N], want_bf16[N], got[N];
        for (size_t i = 0; i < N; i++) {
                float x = in[i];
                want[i] = isnan(x) ? x : x > 0.0f ? x * x : 0.0f;
                want_bf16[i] = bf16_nearest(x);
        }
        tsr_backend *bes[4] = {0};
        assert_int_equal(tsr_backend_cpu_ref_new(&bes[0]), TSR_OK);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &bes[1]), TSR_OK);
        assert_int_equal(tsr_backend_cpu_devlike_new(&bes[2]), TSR_OK);
        if (tsr_backend_cuda_new(0, &bes[3]) != TSR_OK)
                bes[3] = NULL;          /* the CUDA column: test_cuda says why it skips */
        for (int b = 0; b < 4 && bes[b]; b++) {
                float *x = dev_of(bes[b], in, N);
                assert_int_equal(tsr_backend_relu_sq(bes[b], x, N), TSR_OK);
                assert_int_equal(tsr_backend_relu_sq(bes[b], x, 0), TSR_OK);
                assert_int_equal(tsr_backend_download(bes[b], got, x, sizeof got), TSR_OK);
                for (size_t i = 0; i < N; i++)
                        if (isnan(want[i]) ? !isnan(got[i]) : memcmp(&got[i], &want[i], sizeof(float)))
                                fail_msg("%s relu_sq(%g) = %g, want %g", tsr_backend_name(bes[b]), (double)in[i],
                                         (double)got[i], (double)want[i]);
                assert_int_equal(tsr_backend_upload(bes[b], x, in, sizeof in), TSR_OK);
                assert_int_equal(tsr_backend_round_bf16(bes[b], x, N), TSR_OK);
                assert_int_equal(tsr_backend_download(bes[b], got, x, sizeof got), TSR_OK);
                for (size_t i = 0; i < N; i++)
                        if (isnan(want_bf16[i]) ? !isnan(got[i]) : memcmp(&got[i], &want_bf16[i], sizeof(float)))
                                fail_msg("%s round_bf16(%.9g) = %.9g, want %.9g", tsr_backend_name(bes[b]),
                                         (double)in[i], (double)got[i], (double)want_bf16[i]);
                tsr_backend_mem_free(bes[b], x);
        }
        assert_int_equal(tsr_backend_relu_sq(bes[0], NULL, 3), TSR_E_INVAL);
        assert_int_equal(tsr_backend_round_bf16(bes[0], NULL, 3), TSR_E_INVAL);
        for (int b = 0; b < 4; b++)
                tsr_backend_free(&bes[b]);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_ref_oracle),
                cmocka_unit_test(test_cpu_backends_bitwise),
                cmocka_unit_test(test_steps_at_chunk_multiples),
                cmocka_unit_test(test_refused),
                cmocka_unit_test(test_elementwise),
                cmocka_unit_test(test_cuda),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
