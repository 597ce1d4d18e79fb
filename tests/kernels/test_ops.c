/* test_ops.c - the cross-backend op matrix (after ggml's test-backend-ops): every op x
 * dtype x backend x edge shape against the scalar reference, and every storage format's
 * dequantization against a second decoding written here from the format's definition.
 *
 * Columns (one cmocka case each, so the closing line counts what this machine could not
 * test):
 *   cpu-ref            the reference itself, against float64 oracles written here, within
 *                      stated bounds (it is the specification, but a specification with a
 *                      slip is still wrong);
 *   cpu-fast/LEVEL     the fast CPU backend capped at each ISA level (scalar, avx2,
 *                      avx512_bf16, amx_bf16), 2 threads, against cpu-ref: float32 ops
 *                      BITWISE (kernels.h promises it), the bf16 matmul bitwise below
 *                      AVX512_BF16 and within the float32 summation bound at and above
 *                      (its own fixed order).  A level the CPU lacks skips with
 *                      "[skip:cpu-lacks:LEVEL]";
 *   cuda               device 0, against cpu-ref within a per-op bound (cuda_bounds: copies
 *                      and add bitwise, the rest from the oracles' bounds or the kernel's own
 *                      summation order);
 *                      ops the backend lacks (tsr_backend_supports) are counted, not run.
 *                      "[skip:no-gpu]" where tsr_backend_cuda_new says UNSUPPORTED/NOTFOUND.
 * Stored-format weights (f16, the GGUF blocks, fp8, NVFP4): in every column, a matmul
 * kernel the backend has for one is compared with cpu-ref's f32 matmul of the weights
 * tsr_dequant_row widened; one it lacks must answer TSR_E_UNSUPPORTED.
 * Shapes: odd sizes and SIMD tails (1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 127, 129,
 * 4097), rows 1/3/5; inputs from a fixed seed, spread over magnitudes; variants with an
 * infinity and a NaN in the last elements of a row (the tail a vector loop handles
 * separately), and bf16 subnormals for the bf16 matmul.  A NaN in the reference must be
 * a NaN in the candidate (payloads are not compared); anything else is compared bitwise
 * or by the bound above.  A failure prints op, shape, backend, index and both values for
 * the first mismatches. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/quant/quant.h"
#include "kernels/tensor.h"

static uint64_t rng_state;

static uint64_t rnd(void) {     /* xorshift64* */
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return rng_state * 0x2545f4914f6cdd1dull;
}

static float frand(void) {      /* uniform in [-1, 1) */
        return (float)(rnd() >> 40) / (float)(1u << 23) - 1.0f;
}

static void seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }

static float *vec(size_t n) {
        float *v = malloc((n ? n : 1) * sizeof(float));
        assert_non_null(v);
        return v;
}

/* Values over several magnitudes, so a changed summation order shows. */
static float *rand_vec(size_t n, float scale) {
        float *v = vec(n);
        for (size_t i = 0; i < n; i++) {
                float m = frand();
                v[i] = scale * frand() * (m > 0.6f ? 100.0f : m < -0.6f ? 1e-3f : 1.0f);
        }
        return v;
}

static uint32_t bits_of(float f) {
        uint32_t u;
        memcpy(&u, &f, 4);
        return u;
}

static float float_of(uint32_t u) {
        float f;
        memcpy(&f, &u, 4);
        return f;
}

/* ---- the op matrix ---------------------------------------------------------------------- */

typedef enum mop {
        MOP_RMSNORM,
        MOP_ADD_RMSNORM,
        MOP_ADD,
        MOP_SILU_MUL,
        MOP_SOFTMAX,
        MOP_LOG_SOFTMAX,
        MOP_EMBEDDING,
        MOP_EMBEDDING_BF16,
        MOP_MATMUL_F32,
        MOP_MATMUL_BF16,
        MOP_ROPE_NEOX,
        MOP_ROPE_INTERLEAVED,
        MOP_KV_WRITE,
        MOP_ATTENTION,
        MOP_GATHER_ROWS,
        MOP_SCATTER_ADD_ROWS,
        MOP_COUNT
} mop;

static const char *const mop_names[MOP_COUNT] = {
        "rmsnorm", "add_rmsnorm", "add", "silu_mul", "softmax", "log_softmax", "embedding",
        "embedding_bf16", "matmul_f32", "matmul_bf16", "rope_neox", "rope_interleaved", "kv_write", "attention", "gather_rows",
        "scatter_add_rows",
};

static tsr_op mop_op(mop m) {
        static const tsr_op ops[MOP_COUNT] = {
                TSR_OP_RMSNORM, TSR_OP_ADD_RMSNORM, TSR_OP_ADD, TSR_OP_SILU_MUL, TSR_OP_SOFTMAX,
                TSR_OP_LOG_SOFTMAX, TSR_OP_EMBEDDING, TSR_OP_EMBEDDING, TSR_OP_MATMUL, TSR_OP_MATMUL, TSR_OP_ROPE, TSR_OP_ROPE,
                TSR_OP_KV_WRITE, TSR_OP_ATTENTION, TSR_OP_GATHER_ROWS, TSR_OP_SCATTER_ADD_ROWS,
        };
        return ops[m];
}

enum variant { VAR_PLAIN, VAR_TAIL_SPECIAL, VAR_SUBNORMAL, VAR_COUNT };
static const char *const var_names[VAR_COUNT] = {"plain", "inf/nan-tail", "bf16-subnormal"};

/* One case of the matrix: the op's sizes (meaning per op, below) and its inputs.
 *   elementwise / norms / softmax: rows x n
 *   embedding: vocab n, dim d, rows ids
 *   matmul: x (rows, n), w (d, n)
 *   rope: rows x n_heads(d) x head_dim(n)
 *   kv_write / attention: n new tokens (rows) after past_len, n_heads (d), head_dim (n),
 *   n_kv_heads, block_size
 *   gather_rows: x (d, n) -> out (rows, n), rows idx (ids) and scales (b); past_len 1: in
 *   place, idx NULL (rows = d)
 *   scatter_add_rows: dst (d, n) += src (rows, n) at distinct rows idx (ids), rows <= d;
 *   past_len 1: each row times its scale (w) */
typedef struct mcase {
        mop op;
        enum variant var;
        size_t rows, n, d, past_len, n_kv_heads, block_size;
        /* inputs, host */
        float *a, *b, *w;       /* main input, second input, weight / norm gain / table */
        uint16_t *wb;           /* bf16 weight */
        uint32_t *ids;          /* embedding ids or rope positions */
        float *inv_freq;
        float *k, *v;           /* kv cache (n_blocks, block_size, width) */
        uint32_t *table;
        size_t n_blocks, n_table;
        size_t out_len, out2_len;
} mcase;

static void mcase_free(mcase *c) {
        free(c->a), free(c->b), free(c->w), free(c->wb), free(c->ids), free(c->inv_freq);
        free(c->k), free(c->v), free(c->table);
        memset(c, 0, sizeof *c);
}

/* Put an infinity and a NaN in the last elements of row 0 and row rows-1 of x (rows, n):
 * they sit in the tail a vector loop handles after its full vectors. */
static void poison_tail(float *x, size_t rows, size_t n) {
        x[n - 1] = INFINITY;
        if (n >= 2)
                x[(rows - 1) * n + n - 2] = NAN;
        else
                x[(rows - 1) * n] = NAN;
}

static void mcase_build(mcase *c) {
        size_t rows = c->rows, n = c->n, d = c->d;

        switch (c->op) {
        case MOP_RMSNORM:
        case MOP_ADD_RMSNORM:
        case MOP_ADD:
        case MOP_SILU_MUL:
        case MOP_SOFTMAX:
        case MOP_LOG_SOFTMAX:
                c->a = rand_vec(rows * n, c->op == MOP_SOFTMAX || c->op == MOP_LOG_SOFTMAX ? 0.05f : 1.0f);
                c->b = rand_vec(rows * n, 1.0f);
                c->w = rand_vec(n, 1.0f);
                if (c->var == VAR_TAIL_SPECIAL)
                        poison_tail(c->a, rows, n);
                c->out_len = rows * n;
                c->out2_len = c->op == MOP_ADD_RMSNORM ? rows * n : 0;
                break;
        case MOP_EMBEDDING:
        case MOP_EMBEDDING_BF16:
                c->w = rand_vec(n * d, 1.0f);
                c->ids = malloc(rows * sizeof *c->ids);
                for (size_t r = 0; r < rows; r++)
                        c->ids[r] = (uint32_t)(r == rows - 1 ? n - 1 : rnd() % n);    /* the last row too */
                if (c->op == MOP_EMBEDDING_BF16) {      /* a bf16 table: signed zeros, a subnormal, an inf */
                        c->wb = malloc(n * d * sizeof *c->wb);
                        for (size_t i = 0; i < n * d; i++)
                                c->wb[i] = tsr_f32_to_bf16(c->w[i]);
                        c->wb[0] = 0x8000, c->wb[n * d - 1] = 0x0001, c->wb[(n - 1) * d] = 0xff80;
                }
                c->out_len = rows * d;
                break;
        case MOP_MATMUL_F32:
        case MOP_MATMUL_BF16:
                c->a = rand_vec(rows * n, 1.0f);
                c->w = rand_vec(d * n, 1.0f);
                if (c->var == VAR_TAIL_SPECIAL) {
                        poison_tail(c->a, rows, n);
                        c->w[(d - 1) * n + n - 1] = -INFINITY;
                }
                if (c->var == VAR_SUBNORMAL)            /* bf16 subnormals: below 2^-126, 7 mantissa bits */
                        for (size_t i = 0; i < rows * n; i += 2)
                                c->a[i] = ldexpf(c->a[i], -130);
                if (c->op == MOP_MATMUL_BF16) {
                        c->wb = malloc(d * n * sizeof *c->wb);
                        for (size_t i = 0; i < d * n; i++)
                                c->wb[i] = tsr_f32_to_bf16(c->var == VAR_SUBNORMAL && i % 3 == 0 ?
                                                                   ldexpf(c->w[i], -128) : c->w[i]);
                }
                c->out_len = rows * d;
                break;
        case MOP_ROPE_NEOX:
        case MOP_ROPE_INTERLEAVED:
                c->a = rand_vec(rows * d * n, 1.0f);
                c->ids = malloc(rows * sizeof *c->ids);
                c->inv_freq = vec(n / 2);
                for (size_t r = 0; r < rows; r++)
                        c->ids[r] = (uint32_t)(rnd() % 4096);
                for (size_t i = 0; i < n / 2; i++)
                        c->inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)n);
                if (c->var == VAR_TAIL_SPECIAL)
                        poison_tail(c->a, rows * d, n);
                c->out_len = rows * d * n;
                break;
        case MOP_KV_WRITE:
        case MOP_ATTENTION: {
                size_t total = c->past_len + rows, bs = c->block_size, width = c->n_kv_heads * n;
                c->n_table = (total + bs - 1) / bs;
                c->n_blocks = c->n_table + 2;
                c->k = rand_vec(c->n_blocks * bs * width, 1.0f);
                c->v = rand_vec(c->n_blocks * bs * width, 1.0f);
                c->table = malloc(c->n_table * sizeof *c->table);
                for (size_t i = 0; i < c->n_table; i++)
                        c->table[i] = (uint32_t)((i * 5 + 1) % c->n_blocks);   /* scattered, distinct */
                c->a = rand_vec(rows * (c->op == MOP_ATTENTION ? d : c->n_kv_heads) * n, 0.05f);
                c->b = rand_vec(rows * width, 1.0f);                            /* kv_write's v */
                if (c->var == VAR_TAIL_SPECIAL && c->op == MOP_KV_WRITE)
                        poison_tail(c->a, rows, c->n_kv_heads * n);
                c->out_len = c->op == MOP_ATTENTION ? rows * d * n : c->n_blocks * bs * width;
                c->out2_len = c->op == MOP_KV_WRITE ? c->out_len : 0;
                break;
        }
        case MOP_GATHER_ROWS:
        case MOP_SCATTER_ADD_ROWS: {
                bool scatter = c->op == MOP_SCATTER_ADD_ROWS, in_place = !scatter && c->past_len;
                if (scatter && c->rows > d)
                        c->rows = rows = d;
                if (in_place)
                        c->rows = rows = d;
                c->a = rand_vec(d * n, 1.0f);
                c->b = rand_vec(rows * (scatter ? n : 1), scatter ? 1.0f : 4.0f);
                if (scatter && c->past_len)
                        c->w = rand_vec(rows, 4.0f);
                if (c->var == VAR_TAIL_SPECIAL)
                        poison_tail(c->a, d, n);
                if (!in_place) {        /* gather: any rows, repeats too; scatter: a distinct draw */
                        uint32_t *perm = malloc(d * sizeof *perm);
                        c->ids = malloc(rows * sizeof *c->ids);
                        for (size_t i = 0; i < d; i++)
                                perm[i] = (uint32_t)i;
                        for (size_t i = d; i > 1; i--) {
                                size_t j = rnd() % i;
                                uint32_t t = perm[i - 1];
                                perm[i - 1] = perm[j], perm[j] = t;
                        }
                        for (size_t r = 0; r < rows; r++)
                                c->ids[r] = scatter ? perm[r] : (uint32_t)(r == rows - 1 ? d - 1 : rnd() % d);
                        free(perm);
                }
                c->out_len = (scatter ? d : rows) * n;
                break;
        }
        case MOP_COUNT:
                break;
        }
}

/* Backend memory holding a copy of host[0..n). */
static void *dev_copy(tsr_backend *be, const void *host, size_t bytes) {
        void *p = NULL;
        assert_int_equal(tsr_backend_mem_alloc(be, bytes ? bytes : 4, &p), TSR_OK);
        if (host && bytes)
                assert_int_equal(tsr_backend_upload(be, p, host, bytes), TSR_OK);
        return p;
}

/* Run case c on be; out (out_len) and out2 (out2_len) come back in host memory.  Every
 * array the op reads goes to the backend's memory first (a copy on the CPU). */
static tsr_status run_case(tsr_backend *be, const mcase *c, float *out, float *out2) {
        size_t rows = c->rows, n = c->n, d = c->d, fb = sizeof(float);
        void *dout = dev_copy(be, NULL, c->out_len * fb), *dout2 = NULL;
        void *da = NULL, *db = NULL, *dw = NULL, *dk = NULL, *dv = NULL;
        tsr_status st = TSR_E_INTERNAL;
        tsr_kv_view kv = {0};

        if (c->op == MOP_KV_WRITE || c->op == MOP_ATTENTION) {
                size_t cache = c->n_blocks * c->block_size * c->n_kv_heads * n * fb;
                dk = dev_copy(be, c->k, cache);
                dv = dev_copy(be, c->v, cache);
                kv = (tsr_kv_view){.k = dk, .v = dv, .block_table = c->table, .n_table = c->n_table,
                                   .n_blocks = c->n_blocks, .block_size = c->block_size,
                                   .n_kv_heads = c->n_kv_heads, .head_dim = n};
        }
        switch (c->op) {
        case MOP_RMSNORM:
                da = dev_copy(be, c->a, rows * n * fb), dw = dev_copy(be, c->w, n * fb);
                st = tsr_backend_rmsnorm(be, dout, da, dw, rows, n, 1e-5f);
                break;
        case MOP_ADD_RMSNORM:   /* out2 = the updated residual */
                da = dev_copy(be, c->a, rows * n * fb), db = dev_copy(be, c->b, rows * n * fb);
                dw = dev_copy(be, c->w, n * fb);
                st = tsr_backend_add_rmsnorm(be, dout, db, da, dw, rows, n, 1e-5f);
                dout2 = db, db = NULL;
                break;
        case MOP_ADD:
                da = dev_copy(be, c->a, rows * n * fb), db = dev_copy(be, c->b, rows * n * fb);
                st = tsr_backend_add(be, dout, da, db, rows * n);
                break;
        case MOP_SILU_MUL:
                da = dev_copy(be, c->a, rows * n * fb), db = dev_copy(be, c->b, rows * n * fb);
                st = tsr_backend_silu_mul(be, dout, da, db, rows * n);
                break;
        case MOP_SOFTMAX:
        case MOP_LOG_SOFTMAX:
                da = dev_copy(be, c->a, rows * n * fb);
                st = (c->op == MOP_SOFTMAX ? tsr_backend_softmax : tsr_backend_log_softmax)(be, dout, da, rows, n);
                break;
        case MOP_EMBEDDING:
                dw = dev_copy(be, c->w, n * d * fb);
                st = tsr_backend_embedding(be, dout, dw, TSR_DTYPE_F32, n, d, c->ids, rows);
                break;
        case MOP_EMBEDDING_BF16:
                dw = dev_copy(be, c->wb, n * d * 2);
                st = tsr_backend_embedding(be, dout, dw, TSR_DTYPE_BF16, n, d, c->ids, rows);
                break;
        case MOP_MATMUL_F32:
                da = dev_copy(be, c->a, rows * n * fb), dw = dev_copy(be, c->w, d * n * fb);
                st = tsr_backend_matmul(be, dout, da, dw, TSR_DTYPE_F32, rows, n, d);
                break;
        case MOP_MATMUL_BF16:
                da = dev_copy(be, c->a, rows * n * fb), dw = dev_copy(be, c->wb, d * n * 2);
                st = tsr_backend_matmul(be, dout, da, dw, TSR_DTYPE_BF16, rows, n, d);
                break;
        case MOP_ROPE_NEOX:
        case MOP_ROPE_INTERLEAVED:     /* in place: dout starts as a copy of x */
                assert_int_equal(tsr_backend_upload(be, dout, c->a, rows * d * n * fb), TSR_OK);
                dw = dev_copy(be, c->inv_freq, n / 2 * fb);
                st = tsr_backend_rope(be, dout, rows, d, n, c->ids, dw,
                                      c->op == MOP_ROPE_NEOX ? TSR_ROPE_NEOX : TSR_ROPE_INTERLEAVED);
                break;
        case MOP_KV_WRITE:             /* out = k cache, out2 = v cache after the write */
                da = dev_copy(be, c->a, rows * c->n_kv_heads * n * fb);
                db = dev_copy(be, c->b, rows * c->n_kv_heads * n * fb);
                st = tsr_backend_kv_write(be, &kv, da, db, rows, c->past_len);
                tsr_backend_mem_free(be, dout);
                dout = dk, dout2 = dv, dk = dv = NULL;
                break;
        case MOP_ATTENTION:
                da = dev_copy(be, c->a, rows * d * n * fb);
                st = tsr_backend_attention(be, dout, da, &kv, rows, c->past_len, d, 1.0f / sqrtf((float)n));
                break;
        case MOP_GATHER_ROWS:          /* the scales stay host memory, as the index array */
                if (!c->ids) {         /* in place: dout starts as a copy of x */
                        assert_int_equal(tsr_backend_upload(be, dout, c->a, d * n * fb), TSR_OK);
                        st = tsr_backend_gather_rows(be, dout, dout, d, n, NULL, c->b, d);
                        break;
                }
                da = dev_copy(be, c->a, d * n * fb);
                st = tsr_backend_gather_rows(be, dout, da, d, n, c->ids, c->b, rows);
                break;
        case MOP_SCATTER_ADD_ROWS:     /* dout starts as a copy of dst */
                assert_int_equal(tsr_backend_upload(be, dout, c->a, d * n * fb), TSR_OK);
                db = dev_copy(be, c->b, rows * n * fb);
                st = tsr_backend_scatter_add_rows(be, dout, d, n, db, c->ids, c->w, rows);
                break;
        case MOP_COUNT:
                break;
        }
        if (st == TSR_OK)
                st = tsr_backend_synchronize(be);
        if (st == TSR_OK)
                assert_int_equal(tsr_backend_download(be, out, dout, c->out_len * fb), TSR_OK);
        if (st == TSR_OK && dout2)
                assert_int_equal(tsr_backend_download(be, out2, dout2, c->out2_len * fb), TSR_OK);
        tsr_backend_mem_free(be, dout), tsr_backend_mem_free(be, dout2);
        tsr_backend_mem_free(be, da), tsr_backend_mem_free(be, db), tsr_backend_mem_free(be, dw);
        tsr_backend_mem_free(be, dk), tsr_backend_mem_free(be, dv);
        return st;
}

/* ---- float64 oracles for the cpu-ref column ------------------------------------------------
 * Each writes the exact-as-double result want[] and a bound[] per element: the most a
 * float32 evaluation in the reference's order may differ from it (derivations beside
 * each).  A bound of 0 means bitwise.  Non-finite results are compared by class. */

static double dot_abs(const float *a, const float *b, size_t n, double *abs_sum) {
        double s = 0, t = 0;
        for (size_t k = 0; k < n; k++) {
                s += (double)a[k] * (double)b[k];
                t += fabs((double)a[k] * (double)b[k]);
        }
        *abs_sum = t;
        return s;
}

static void oracle_rmsnorm_row(const float *x, const float *w, size_t n, double *want, double *bound) {
        double ss = 0;
        for (size_t i = 0; i < n; i++)
                ss += (double)x[i] * x[i];
        double scale = 1.0 / sqrt(ss / (double)n + 1e-5);
        /* float scale (1 rounding), x*scale (1), *w (1): 3 u relative, u = 2^-24; 4 for margin. */
        for (size_t i = 0; i < n; i++) {
                want[i] = (double)x[i] * scale * (double)w[i];
                bound[i] = 4 * (FLT_EPSILON / 2) * fabs(want[i]) + 1e-37;
        }
}

static void oracle(const mcase *c, double *want, double *bound, double *want2, double *bound2) {
        size_t rows = c->rows, n = c->n, d = c->d;
        const double u = FLT_EPSILON / 2;

        switch (c->op) {
        case MOP_RMSNORM:
                for (size_t r = 0; r < rows; r++)
                        oracle_rmsnorm_row(c->a + r * n, c->w, n, want + r * n, bound + r * n);
                break;
        case MOP_ADD_RMSNORM: {
                float *res = vec(n);
                for (size_t r = 0; r < rows; r++) {
                        for (size_t i = 0; i < n; i++) {
                                res[i] = c->b[r * n + i] + c->a[r * n + i];     /* one float add: exact oracle */
                                want2[r * n + i] = (double)c->b[r * n + i] + (double)c->a[r * n + i];
                                bound2[r * n + i] = u * fabs(want2[r * n + i]);
                        }
                        oracle_rmsnorm_row(res, c->w, n, want + r * n, bound + r * n);
                }
                free(res);
                break;
        }
        case MOP_ADD:           /* one rounding of the exact sum */
                for (size_t i = 0; i < rows * n; i++) {
                        want[i] = (double)c->a[i] + (double)c->b[i];
                        bound[i] = u * fabs(want[i]);
                }
                break;
        case MOP_SILU_MUL:
                /* expf (<= 1 ulp here, glibc), +1, 1/, *g, *up: 8 u relative.  Below g = -88
                 * expf(-g) overflows float32 and the specification's formula gives a zero
                 * where the true value is under 1e-34: a zero is allowed there. */
                for (size_t i = 0; i < rows * n; i++) {
                        double g = c->a[i];
                        want[i] = g / (1 + exp(-g)) * (double)c->b[i];
                        bound[i] = 8 * u * fabs(want[i]) + 1e-37;
                        if (g < -88)
                                bound[i] += fabs(want[i]);
                }
                break;
        case MOP_SOFTMAX:
        case MOP_LOG_SOFTMAX:
                for (size_t r = 0; r < rows; r++) {
                        const float *x = c->a + r * n;
                        double max = x[0], sum = 0;
                        for (size_t i = 1; i < n; i++)
                                if (x[i] > max)
                                        max = x[i];
                        for (size_t i = 0; i < n; i++)
                                sum += exp((double)x[i] - max);
                        for (size_t i = 0; i < n; i++) {
                                double z = (double)x[i] - max;
                                /* softmax: x - max rounded (u |z|) feeds expf: relative (|z| + 2) u,
                                 * then the quotient's; log_softmax: two subtractions and a log. */
                                if (c->op == MOP_SOFTMAX) {
                                        want[r * n + i] = exp(z) / sum;
                                        bound[r * n + i] = (fabs(z) + 6) * u * fabs(want[r * n + i]) + 1e-37;
                                } else {
                                        want[r * n + i] = z - log(sum);
                                        bound[r * n + i] = 4 * u * (fabs(z) + fabs(log(sum)) + 1);
                                }
                        }
                }
                break;
        case MOP_EMBEDDING:
        case MOP_EMBEDDING_BF16:        /* a bf16 element widens exactly: its bits << 16 */
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < d; i++) {
                                size_t at = (size_t)c->ids[r] * d + i;
                                union { uint32_t u; float f; } wide = {.u = c->wb ? (uint32_t)c->wb[at] << 16 : 0};
                                want[r * d + i] = c->wb ? wide.f : c->w[at], bound[r * d + i] = 0;
                        }
                break;
        case MOP_MATMUL_F32:
        case MOP_MATMUL_BF16: {
                float *wf = vec(d * n), *xf = vec(rows * n);
                for (size_t i = 0; i < d * n; i++)
                        wf[i] = c->op == MOP_MATMUL_F32 ? c->w[i] : tsr_bf16_to_f32(c->wb[i]);
                for (size_t i = 0; i < rows * n; i++)
                        xf[i] = c->op == MOP_MATMUL_F32 ? c->a[i] : tsr_bf16_to_f32(tsr_f32_to_bf16(c->a[i]));
                /* Products rounded (u each) and summed in float: n u sum |p|, plus the
                 * absolute error of products that fall below float's normal range. */
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < d; i++) {
                                double abs_sum;
                                want[r * d + i] = dot_abs(wf + i * n, xf + r * n, n, &abs_sum);
                                bound[r * d + i] = (double)n * u * abs_sum + (double)n * 0x1p-149 + 1e-37;
                        }
                free(wf), free(xf);
                break;
        }
        case MOP_ROPE_NEOX:
        case MOP_ROPE_INTERLEAVED: {
                size_t half = n / 2;
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < half; i++) {
                                /* The angle and its cos/sin as the specification defines them
                                 * (float32 product, rounded once); the rotation exact here. */
                                float theta = (float)c->ids[r] * c->inv_freq[i];
                                double cs = (float)cos((double)theta), sn = (float)sin((double)theta);
                                for (size_t h = 0; h < d; h++) {
                                        size_t base = (r * d + h) * n;
                                        size_t ia = c->op == MOP_ROPE_NEOX ? i : 2 * i;
                                        size_t ib = c->op == MOP_ROPE_NEOX ? i + half : 2 * i + 1;
                                        double a = c->a[base + ia], b = c->a[base + ib];
                                        want[base + ia] = a * cs - b * sn;
                                        want[base + ib] = b * cs + a * sn;
                                        double e = 2 * u * (fabs(a * cs) + fabs(b * sn)) + 1e-37;
                                        bound[base + ia] = e;
                                        bound[base + ib] = 2 * u * (fabs(b * cs) + fabs(a * sn)) + 1e-37;
                                }
                        }
                break;
        }
        case MOP_KV_WRITE: {   /* a copy into the rows the table names */
                size_t width = c->n_kv_heads * n, bs = c->block_size;
                for (size_t i = 0; i < c->out_len; i++) {
                        want[i] = c->k[i], want2[i] = c->v[i];
                        bound[i] = bound2[i] = 0;
                }
                for (size_t t = 0; t < rows; t++) {
                        size_t pos = c->past_len + t, row = (size_t)c->table[pos / bs] * bs + pos % bs;
                        for (size_t i = 0; i < width; i++) {
                                want[row * width + i] = c->a[t * width + i];
                                want2[row * width + i] = c->b[t * width + i];
                        }
                }
                break;
        }
        case MOP_ATTENTION: {
                size_t hd = n, width = c->n_kv_heads * hd, group = d / c->n_kv_heads, bs = c->block_size;
                double scale = 1.0f / sqrtf((float)hd);
                double *p = malloc((c->past_len + rows) * sizeof *p), *e = malloc((c->past_len + rows) * sizeof *e);
                for (size_t t = 0; t < rows; t++)
                        for (size_t h = 0; h < d; h++) {
                                size_t last = c->past_len + t, g = h / group;
                                const float *q = c->a + (t * d + h) * hd;
                                double max = -INFINITY, sum = 0, emax = 0;
                                for (size_t j = 0; j <= last; j++) {
                                        size_t row = (size_t)c->table[j / bs] * bs + j % bs;
                                        double abs_sum;
                                        p[j] = dot_abs(q, c->k + row * width + g * hd, hd, &abs_sum) * scale;
                                        e[j] = (double)hd * u * abs_sum * scale;  /* the float dot's error */
                                        emax = fmax(emax, e[j]);
                                        max = fmax(max, p[j]);
                                }
                                for (size_t j = 0; j <= last; j++) {
                                        /* exp's argument is off by its score's and the max's
                                         * error plus a rounding: that much relative error. */
                                        e[j] = 2 * (e[j] + emax) + u * fabs(p[j] - max) + 2 * u;
                                        sum += (p[j] = exp(p[j] - max));
                                }
                                for (size_t i = 0; i < hd; i++) {
                                        double o = 0, mag = 0;
                                        for (size_t j = 0; j <= last; j++) {
                                                size_t row = (size_t)c->table[j / bs] * bs + j % bs;
                                                double vj = c->v[row * width + g * hd + i];
                                                o += p[j] / sum * vj;
                                                mag += p[j] / sum * fabs(vj) * (2 * e[j] + (double)(last + 8) * u);
                                        }
                                        /* Each weight P_j carries its exp's error and the
                                         * normalising sum's (last + 1 float adds), the output
                                         * the accumulation's: sum P_j |v_j| (2 e_j + (last+8) u),
                                         * doubled for margin. */
                                        want[(t * d + h) * hd + i] = o;
                                        bound[(t * d + h) * hd + i] = 2 * mag + 1e-30;
                                }
                        }
                free(p), free(e);
                break;
        }
        case MOP_GATHER_ROWS:           /* one rounding of the exact product, or a copy */
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < n; i++) {
                                double x = c->a[(c->ids ? (size_t)c->ids[r] : r) * n + i];
                                want[r * n + i] = x * (double)c->b[r];
                                bound[r * n + i] = u * fabs(want[r * n + i]);
                        }
                break;
        case MOP_SCATTER_ADD_ROWS:      /* the rows not named: copies; the others one add */
                for (size_t i = 0; i < d * n; i++)
                        want[i] = c->a[i], bound[i] = 0;
                for (size_t r = 0; r < rows; r++)
                        for (size_t i = 0; i < n; i++) {
                                size_t at = (size_t)c->ids[r] * n + i;
                                double y = (double)c->b[r * n + i] * (c->w ? (double)c->w[r] : 1.0);
                                want[at] = (double)c->a[at] + y;
                                /* the product's rounding (u |y|), then the sum's */
                                bound[at] = u * fabs(want[at]) + (c->w ? u * fabs(y) * (1 + u) : 0);
                        }
                break;
        case MOP_COUNT:
                break;
        }
}

/* ---- comparing ------------------------------------------------------------------------- */

/* got against want: NaN for NaN, the same infinity for an infinity, else bitwise when
 * bound is 0 and |got - want| <= bound otherwise.  Prints the first mismatches; returns
 * how many elements failed. */
static size_t compare(const char *what, const float *got, const double *want, const double *bound, size_t n) {
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
                double g = got[i], w = want[i];
                bool ok;
                if (isnan(w))
                        ok = isnan(g);
                else if (isinf(w) || isinf(g))
                        ok = g == w;
                else if (bound[i] == 0)
                        ok = bits_of(got[i]) == bits_of((float)w);
                else
                        ok = fabs(g - w) <= bound[i];
                if (!ok && bad++ < 8)
                        print_message("%s: [%zu] got %.9g (0x%08x) want %.9g, bound %.3g\n", what, i, g,
                                      bits_of(got[i]), w, bound[i]);
        }
        return bad;
}

/* ---- the columns ------------------------------------------------------------------------- */

typedef enum col_kind { COL_REF, COL_FAST, COL_CUDA } col_kind;

typedef struct column {
        col_kind kind;
        tsr_cpu_isa isa;        /* COL_FAST: the level */
} column;

static tsr_backend *ref;        /* the reference every other column is compared with */

/* The shape tables: sizes either side of every vector width and unroll (8, 16, 32, 64,
 * 128) and one big odd one; tiny vocabularies; head dims odd and even. */
static const size_t sizes[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 127, 129, 4097};
static const size_t mm_d[] = {1, 3, 17};
static const size_t mm_rows[] = {1, 3, 5};
static const size_t emb_vocab[] = {1, 3, 17}, emb_dim[] = {1, 7, 33, 4097};
static const size_t rope_hd[] = {2, 6, 64, 128, 130};
static const struct {
        size_t n, past_len, n_heads, n_kv_heads, head_dim, block_size;
} att_shapes[] = {
        {1, 0, 1, 1, 64, 16}, {3, 5, 4, 2, 64, 4}, {7, 17, 6, 3, 128, 16}, {1, 40, 8, 8, 64, 16},
        {5, 2, 3, 1, 7, 3},   {17, 0, 2, 1, 33, 5}, {1, 63, 2, 2, 9, 64},
        /* past attention.cu's 128-key run: rows with one run and with two in one call, a
         * decode row in 8 runs, one in the 32 longest runs (157 keys each) */
        {4, 125, 2, 1, 32, 8}, {1, 1000, 4, 2, 64, 16}, {2, 5000, 2, 2, 128, 16},
        /* query heads per KV head (cpu/fast.c takes up to 8 in one pass): 8; 10 (8 + 2);
         * 5 with an odd number of 8-float columns; 3 with a column past its pairs */
        {3, 9, 16, 2, 64, 16}, {2, 11, 20, 2, 16, 8}, {2, 7, 5, 1, 24, 4}, {2, 6, 6, 2, 40, 4},
};

/* Call fn(c) for every case of op m.  The seed depends on the case only, so every column
 * sees the same inputs. */
static void for_each_case(mop m, void (*fn)(mcase *c, void *ud), void *ud) {
        uint64_t k = 0;
        for (int var = 0; var < VAR_COUNT; var++) {
                bool mm = m == MOP_MATMUL_F32 || m == MOP_MATMUL_BF16;
                if (var == VAR_SUBNORMAL && !mm)
                        continue;
                if (var == VAR_TAIL_SPECIAL && (m == MOP_EMBEDDING || m == MOP_EMBEDDING_BF16 || m == MOP_ATTENTION))
                        continue;       /* a copy has no tail; attention's specials are its own test's */
                switch (m) {
                case MOP_RMSNORM:
                case MOP_ADD_RMSNORM:
                case MOP_ADD:
                case MOP_SILU_MUL:
                case MOP_SOFTMAX:
                case MOP_LOG_SOFTMAX:
                        for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
                                for (size_t rows = 1; rows <= 3; rows += 2) {
                                        mcase c = {.op = m, .var = var, .rows = rows, .n = sizes[a]};
                                        seed(++k * 131 + m);
                                        mcase_build(&c), fn(&c, ud), mcase_free(&c);
                                }
                        break;
                case MOP_EMBEDDING:
                case MOP_EMBEDDING_BF16:
                        for (size_t a = 0; a < 3; a++)
                                for (size_t b = 0; b < 4; b++) {
                                        mcase c = {.op = m, .var = var, .rows = 5, .n = emb_vocab[a], .d = emb_dim[b]};
                                        seed(++k * 131 + m);
                                        mcase_build(&c), fn(&c, ud), mcase_free(&c);
                                }
                        break;
                case MOP_MATMUL_F32:
                case MOP_MATMUL_BF16:
                        for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
                                for (size_t b = 0; b < 3; b++)
                                        for (size_t r = 0; r < 3; r++) {
                                                mcase c = {.op = m, .var = var, .rows = mm_rows[r], .n = sizes[a],
                                                           .d = mm_d[b]};
                                                seed(++k * 131 + m);
                                                mcase_build(&c), fn(&c, ud), mcase_free(&c);
                                        }
                        break;
                case MOP_ROPE_NEOX:
                case MOP_ROPE_INTERLEAVED:
                        for (size_t a = 0; a < sizeof rope_hd / sizeof *rope_hd; a++)
                                for (size_t h = 1; h <= 3; h += 2)
                                        for (size_t rows = 1; rows <= 3; rows += 2) {
                                                mcase c = {.op = m, .var = var, .rows = rows, .n = rope_hd[a], .d = h};
                                                seed(++k * 131 + m);
                                                mcase_build(&c), fn(&c, ud), mcase_free(&c);
                                        }
                        break;
                case MOP_KV_WRITE:
                case MOP_ATTENTION:
                        for (size_t a = 0; a < sizeof att_shapes / sizeof *att_shapes; a++) {
                                mcase c = {.op = m, .var = var, .rows = att_shapes[a].n,
                                           .past_len = att_shapes[a].past_len, .d = att_shapes[a].n_heads,
                                           .n_kv_heads = att_shapes[a].n_kv_heads, .n = att_shapes[a].head_dim,
                                           .block_size = att_shapes[a].block_size};
                                seed(++k * 131 + m);
                                mcase_build(&c), fn(&c, ud), mcase_free(&c);
                        }
                        break;
                case MOP_GATHER_ROWS:
                case MOP_SCATTER_ADD_ROWS:
                        for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
                                for (size_t b = 0; b < 3; b++)
                                        for (size_t r = 0; r < 3; r++)
                                                for (size_t place = 0; place < 2; place++) {
                                                        mcase c = {.op = m, .var = var, .rows = mm_rows[r],
                                                                   .n = sizes[a], .d = mm_d[b], .past_len = place};
                                                        seed(++k * 131 + m);
                                                        mcase_build(&c), fn(&c, ud), mcase_free(&c);
                                                }
                        break;
                case MOP_COUNT:
                        break;
                }
        }
}

struct col_run {
        const column *col;
        tsr_backend *be;
        size_t n_bitwise, n_bounded, n_failed;
};

/* The bf16 matmul's bound where the fast backend runs its own order (VDPBF16PS, AMX):
 * two float32 summations of the same exact products differ by at most 2 (n-1) u sum |p|;
 * both instructions flush bf16 subnormal inputs, which moves a sum by at most those
 * products' magnitudes (tiny: counted in the absolute term). */
static double bf16_dot_bound(const uint16_t *w, const float *x, size_t n) {
        double s = 0, tiny = 0;
        for (size_t k = 0; k < n; k++) {
                double p = fabs((double)tsr_bf16_to_f32(w[k]) * (double)tsr_bf16_to_f32(tsr_f32_to_bf16(x[k])));
                s += p;
                if (p < 0x1p-100)
                        tiny += p;
        }
        return 2.0 * (double)(n > 1 ? n - 1 : 1) * (FLT_EPSILON / 2) * s + 2 * tiny + 1e-37;
}

/* The CUDA column's bound per element of case c against cpu-ref's result want[]; 0 means
 * bitwise (and bound2, add_rmsnorm's residual, stays 0: one float add, bitwise).  Where
 * both backends evaluate the same formula in float32 in different orders (or with the
 * device's expf, a few ulp from glibc's), each is within the oracle's bound of the exact
 * value (oracle() above), so they are within twice it of each other. */
static void cuda_bounds(const mcase *c, const double *want, double *bound) {
        size_t len = c->out_len, len2 = c->out2_len;
        double *ow = calloc(len ? len : 1, sizeof *ow), *ob = calloc(len ? len : 1, sizeof *ob);
        double *ow2 = calloc(len2 ? len2 : 1, sizeof *ow2), *ob2 = calloc(len2 ? len2 : 1, sizeof *ob2);
        const double u = FLT_EPSILON / 2;

        oracle(c, ow, ob, ow2, ob2);
        for (size_t i = 0; i < len; i++)
                bound[i] = 0;
        switch (c->op) {
        case MOP_RMSNORM:
        case MOP_ADD_RMSNORM: {
                /* rmsnorm.cu: each of 256 threads sums k = ceil(n/256) squares in float, then an
                 * 8-level tree: the sum within (k + 9) u relative (ref: a double sum, exact
                 * enough); /dim, +eps, rsqrtf (2 ulp = 4 u): the scale within (k + 15) u / 2 + 4 u;
                 * x * scale * w: two roundings on each side.  (k + 24) u |ref| covers it. */
                double k = (double)((c->n + 255) / 256);
                for (size_t i = 0; i < len; i++)
                        bound[i] = (k + 24) * u * fabs(want[i]) + 1e-37;
                break;
        }
        case MOP_ADD:           /* one float add: bitwise */
        case MOP_EMBEDDING:     /* copies: bitwise */
        case MOP_EMBEDDING_BF16:
        case MOP_KV_WRITE:
        case MOP_GATHER_ROWS:   /* a copy, or one multiply (__fmul_rn): bitwise */
        case MOP_SCATTER_ADD_ROWS:      /* one add (__fadd_rn): bitwise */
                break;
        case MOP_SILU_MUL:      /* device expf within 2 ulp: inside the oracle's 8 u */
        case MOP_SOFTMAX:       /* the same x - max, expf's ulps, a double sum in another order */
        case MOP_LOG_SOFTMAX:
        case MOP_ROPE_NEOX:     /* cos/sin in double on both sides; an ulp of c or s at most */
        case MOP_ROPE_INTERLEAVED:
        case MOP_MATMUL_F32:    /* cuBLAS's order and FMAs: n u sum |w x| each side */
                for (size_t i = 0; i < len; i++)
                        bound[i] = 2 * ob[i];
                break;
        case MOP_MATMUL_BF16:
                /* The same bf16 inputs on both sides (elementwise.cu rounds x as ref does), so
                 * only the float32 summation differs: twice the oracle's n u sum |p|, plus
                 * bf16_dot_bound's allowance for tensor cores that flush subnormal inputs. */
                for (size_t r = 0; r < c->rows; r++)
                        for (size_t i = 0; i < c->d; i++)
                                bound[r * c->d + i] = 2 * ob[r * c->d + i] +
                                                      bf16_dot_bound(c->wb + i * c->n, c->a + r * c->n, c->n);
                break;
        case MOP_ATTENTION:
                /* attention.cu's online softmax rescales each warp's running sums once per new
                 * maximum (an expf and two roundings per rescale), merges the warps and then a
                 * long row's runs the same way (two more), and splits the dot products over 32
                 * lanes: the same kinds of error the oracle bounds, a few times more of them.
                 * Four times the oracle. */
                for (size_t i = 0; i < len; i++)
                        bound[i] = 4 * ob[i];
                break;
        case MOP_COUNT:
                break;
        }
        free(ow), free(ob), free(ow2), free(ob2);
}

static void run_one(mcase *c, void *ud) {
        struct col_run *cr = ud;
        size_t len = c->out_len, len2 = c->out2_len;
        float *got = vec(len), *got2 = vec(len2), *rf = vec(len), *rf2 = vec(len2);
        double *want = calloc(len, sizeof *want), *bound = calloc(len, sizeof *bound);
        double *want2 = calloc(len2 ? len2 : 1, sizeof *want2), *bound2 = calloc(len2 ? len2 : 1, sizeof *bound2);
        char what[200];
        bool bounded = false;

        snprintf(what, sizeof what, "%s %s/%s rows %zu n %zu d %zu past %zu [%s]", mop_names[c->op],
                 tsr_backend_name(cr->be), tsr_cpu_isa_name(tsr_backend_cpu_isa(cr->be)), c->rows, c->n, c->d,
                 c->past_len, var_names[c->var]);
        assert_int_equal(run_case(cr->be, c, got, got2), TSR_OK);
        if (cr->col->kind == COL_REF) {
                oracle(c, want, bound, want2, bound2);
                for (size_t i = 0; i < len; i++)        /* a copy's oracle is exact: bitwise */
                        bounded = bounded || bound[i] != 0;
        } else {
                assert_int_equal(run_case(ref, c, rf, rf2), TSR_OK);
                for (size_t i = 0; i < len; i++)
                        want[i] = rf[i];
                for (size_t i = 0; i < len2; i++)
                        want2[i] = rf2[i];
                if (cr->col->kind == COL_FAST && c->op == MOP_MATMUL_BF16 && cr->col->isa >= TSR_CPU_ISA_AVX512_BF16) {
                        for (size_t r = 0; r < c->rows; r++)
                                for (size_t i = 0; i < c->d; i++)
                                        bound[r * c->d + i] = bf16_dot_bound(c->wb + i * c->n, c->a + r * c->n, c->n);
                        bounded = true;
                } else if (cr->col->kind == COL_CUDA) {
                        cuda_bounds(c, want, bound);
                        for (size_t i = 0; i < len; i++)
                                bounded = bounded || bound[i] != 0;
                }
        }
        size_t bad = compare(what, got, want, bound, len);
        if (len2)
                bad += compare(what, got2, want2, bound2, len2);
        if (bad) {
                print_message("FAIL %s: %zu elements\n", what, bad);
                cr->n_failed++;
        } else if (bounded) {
                cr->n_bounded++;
        } else {
                cr->n_bitwise++;
        }
        free(got), free(got2), free(rf), free(rf2), free(want), free(bound), free(want2), free(bound2);
}

/* ---- matmul with stored-format weights ----------------------------------------------------
 * For every dtype other than f32 and bf16: where a backend has a matmul kernel for it, the
 * kernel against the reference's f32 matmul of the dequantized weights (tsr_dequant_row),
 * within 2 n u sum |p| (another fixed summation order of the same float32 products; a
 * kernel that also quantizes x must state its own, larger bound here).  Where it has none,
 * the matmul must answer TSR_E_UNSUPPORTED, as tsr_backend_supports says. */

/* Random bytes with the scale fields made finite (a clear bit 14 of an f16 keeps its
 * exponent below 31; a clear bit 6 of an fp8 keeps e4m3 off its NaN and e5m2 off
 * inf/NaN), so the reference has numbers to compare. */
static void rand_weights(tsr_dtype t, uint8_t *w, size_t bytes) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        size_t bb = info->block_bytes;

        for (size_t i = 0; i < bytes; i++)
                w[i] = (uint8_t)rnd();
        for (size_t b = 0; b < bytes / bb; b++) {
                uint8_t *p = w + b * bb;
                switch (t) {
                case TSR_DTYPE_F16:
                        p[1] &= (uint8_t)~0x40;
                        break;
                case TSR_DTYPE_FP8_E4M3:
                case TSR_DTYPE_FP8_E5M2:
                case TSR_DTYPE_NVFP4:
                        p[0] &= (uint8_t)~0x40;
                        break;
                case TSR_DTYPE_Q6_K:
                        p[209] &= (uint8_t)~0x40;
                        break;
                case TSR_DTYPE_Q4_1:
                case TSR_DTYPE_Q5_1:
                case TSR_DTYPE_Q4_K:
                case TSR_DTYPE_Q5_K:
                        p[3] &= (uint8_t)~0x40;
                        p[1] &= (uint8_t)~0x40;
                        break;
                default:
                        p[1] &= (uint8_t)~0x40;
                        break;
                }
        }
}

/* ---- matmul on GGUF blocks with int8 activations (kernels/quant/qmm.h) -----------------
 * Every column with the kernel, every block dtype, odd block counts (1, 2, 3 below the
 * eight-block SIMD step; 8, 9, 17 on and past it), d across the 16-row task boundary and
 * not a multiple of the weight rows of a tile, rows 1 (the GEMV), 3 (one pair at a time),
 * 5, 6, 9 (tiles of four and two activation rows, a last row repeated), 32 and 33 (from
 * 32 rows the AMX-INT8 tiles where the column has them, cpu/qmm_amx.c: two whole tiles of
 * 16 rows, then a last tile of one row and fifteen of padding), and four variants:
 *   plain       random blocks (finite scales), x in [-1, 1);
 *   zero        every other weight block all zero bytes, the first block of each x row zero;
 *   max-scale   every f16 scale the largest finite half (65504), q8_0 codes -128 in half the
 *               blocks, x blocks spread over 1e-3 .. 1e3;
 *   nonfinite   an infinity at the end of x row 0: that row's outputs are NaN (qmm.h).
 * Checked:
 *   (a) against cpu-ref's int8 reference, BITWISE (cpu-ref itself: its own kernel);
 *   (b) against cpu-ref's float32 matmul of the widened weights (tsr_dequant_row) within
 *       sum_b (dx_b/2) sum_{k in b} |w_k|  +  4 n u sum_k |w_k| (|x_k| + dx_b)
 *       (the first term: each x_k moves by at most half its block's step dx_b = max|x|/127
 *       when quantized; the second: float32 rounding of the two evaluations, with room);
 *   (c) batch invariance: the last row of x alone gives bitwise the batched row. */
enum { QV_PLAIN, QV_ZERO, QV_MAX, QV_NONFINITE, QV_COUNT };
static const char *const qv_names[QV_COUNT] = {"plain", "zero", "max-scale", "nonfinite"};

/* Set every f16 scale field of block p of t to 65504. */
static void max_scales(tsr_dtype t, uint8_t *p) {
        static const uint8_t max_half[2] = {0xff, 0x7b};
        switch (t) {
        case TSR_DTYPE_Q6_K:
                memcpy(p + 208, max_half, 2);
                break;
        case TSR_DTYPE_Q4_1:
        case TSR_DTYPE_Q5_1:
        case TSR_DTYPE_Q4_K:
        case TSR_DTYPE_Q5_K:
                memcpy(p + 2, max_half, 2);
                /* fall through */
        default:
                memcpy(p, max_half, 2);
                break;
        }
}

static void qmm_case(struct col_run *cr, tsr_dtype t, int var, size_t nb, size_t d, size_t rows, uint64_t sd) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        size_t qk = info->block_elems, bb = info->block_bytes, n = nb * qk, wbytes;
        char what[200];

        assert_int_equal(tsr_dtype_row_bytes(t, d * n, &wbytes), TSR_OK);
        seed(sd);
        uint8_t *w = malloc(wbytes);
        float *x = rand_vec(rows * n, 1.0f), *wf = vec(d * n), *got = vec(rows * d), *exact = vec(rows * d);
        float *wide = vec(rows * d), *alone = vec(d);
        double *want = calloc(rows * d, sizeof *want), *bound = calloc(rows * d, sizeof *bound);
        rand_weights(t, w, wbytes);
        for (size_t b = 0; b < wbytes / bb; b++) {
                if (var == QV_ZERO && b % 2 == 0)
                        memset(w + b * bb, 0, bb);
                if (var == QV_MAX) {
                        max_scales(t, w + b * bb);
                        if (t == TSR_DTYPE_Q8_0 && b % 2)
                                memset(w + b * bb + 2, 0x80, 32);
                }
        }
        for (size_t r = 0; r < rows; r++)
                for (size_t k = 0; k < n; k++) {
                        if (var == QV_ZERO && k < qk)
                                x[r * n + k] = 0.0f;
                        if (var == QV_MAX)
                                x[r * n + k] *= powf(10.0f, (float)((k / qk) % 7) - 3.0f);
                }
        if (var == QV_NONFINITE)
                x[n - 1] = INFINITY;
        snprintf(what, sizeof what, "matmul_%s %s/%s rows %zu n %zu d %zu [%s]", info->name, tsr_backend_name(cr->be),
                 tsr_cpu_isa_name(tsr_backend_cpu_isa(cr->be)), rows, n, d, qv_names[var]);

        assert_int_equal(tsr_dequant_row(t, w, d * n, wf), TSR_OK);
        assert_int_equal(tsr_backend_matmul(ref, exact, x, w, t, rows, n, d), TSR_OK);
        assert_int_equal(tsr_backend_matmul(ref, wide, x, wf, TSR_DTYPE_F32, rows, n, d), TSR_OK);
        void *dx = dev_copy(cr->be, x, rows * n * sizeof(float)), *dw = dev_copy(cr->be, w, wbytes);
        void *dout = dev_copy(cr->be, NULL, rows * d * 4);
        assert_int_equal(tsr_backend_matmul(cr->be, dout, dx, dw, t, rows, n, d), TSR_OK);
        assert_int_equal(tsr_backend_download(cr->be, got, dout, rows * d * 4), TSR_OK);
        assert_int_equal(tsr_backend_matmul(cr->be, dout, (float *)dx + (rows - 1) * n, dw, t, 1, n, d), TSR_OK);
        assert_int_equal(tsr_backend_download(cr->be, alone, dout, d * 4), TSR_OK);

        size_t bad = 0;
        for (size_t i = 0; i < rows * d; i++)           /* (a) bitwise */
                want[i] = exact[i];
        bad += compare(what, got, want, bound, rows * d);
        for (size_t i = 0; i < d; i++)                  /* (c) bitwise */
                want[i] = exact[(rows - 1) * d + i];
        bad += compare(what, alone, want, bound, d);
        for (size_t r = 0; r < rows; r++) {             /* (b) within the bound */
                for (size_t i = 0; i < d; i++) {
                        double q = 0, f = 0;
                        for (size_t b = 0; b < nb; b++) {
                                double amax = 0, sw = 0, swx = 0;
                                for (size_t k = b * qk; k < b * qk + qk; k++)
                                        amax = fmax(amax, fabs((double)x[r * n + k]));
                                double step = amax / 127;
                                for (size_t k = b * qk; k < b * qk + qk; k++) {
                                        double wk = fabs((double)wf[i * n + k]);
                                        sw += wk;
                                        swx += wk * (fabs((double)x[r * n + k]) + step);
                                }
                                q += step / 2 * sw;
                                f += swx;
                        }
                        want[r * d + i] = r == 0 && var == QV_NONFINITE ? NAN : wide[r * d + i];
                        bound[r * d + i] = q * (1 + 1e-6) + 4.0 * (double)n * (FLT_EPSILON / 2) * f + 1e-30;
                }
        }
        bad += compare(what, got, want, bound, rows * d);
        if (bad) {
                print_message("FAIL %s\n", what);
                cr->n_failed++;
        } else {
                cr->n_bitwise++;
        }
        tsr_backend_mem_free(cr->be, dx), tsr_backend_mem_free(cr->be, dw), tsr_backend_mem_free(cr->be, dout);
        free(w), free(x), free(wf), free(got), free(exact), free(wide), free(alone), free(want), free(bound);
}

static void run_qmm(struct col_run *cr, tsr_dtype t) {
        static const size_t n_blocks[] = {1, 2, 3, 8, 9, 17}, d_list[] = {1, 3, 17, 37}, rows_list[] = {1, 3, 5, 6, 9, 32, 33};
        uint64_t k = 0;

        for (int var = 0; var < QV_COUNT; var++)
                for (size_t a = 0; a < sizeof n_blocks / sizeof *n_blocks; a++)
                        for (size_t b = 0; b < sizeof d_list / sizeof *d_list; b++)
                                for (size_t r = 0; r < sizeof rows_list / sizeof *rows_list; r++)
                                        qmm_case(cr, t, var, n_blocks[a], d_list[b], rows_list[r],
                                                 7919 * t + ++k);
}

static void run_quant_matmul(struct col_run *cr, tsr_dtype t, size_t *not_run) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t);
        size_t qk = info->block_elems;
        const size_t n_blocks[] = {1, 2, 3, 17};

        if (tsr_backend_supports(cr->be, TSR_OP_MATMUL, t) && tsr_dtype_get_info(t)->block_elems >= 32 &&
            t != TSR_DTYPE_NVFP4) {
                run_qmm(cr, t);
                return;
        }
        if (!tsr_backend_supports(cr->be, TSR_OP_MATMUL, t)) {
                float x = 0, out = 0;
                uint8_t w[512] = {0};
                assert_int_equal(tsr_backend_matmul(cr->be, &out, &x, w, t, 1, qk, 1), TSR_E_UNSUPPORTED);
                (*not_run)++;
                return;
        }
        for (size_t a = 0; a < sizeof n_blocks / sizeof *n_blocks; a++)
                for (size_t b = 0; b < sizeof mm_d / sizeof *mm_d; b++)
                        for (size_t r = 0; r < sizeof mm_rows / sizeof *mm_rows; r++) {
                                size_t n = n_blocks[a] * qk, d = mm_d[b], rows = mm_rows[r], wbytes;
                                assert_int_equal(tsr_dtype_row_bytes(t, d * n, &wbytes), TSR_OK);
                                seed(1000 * t + 100 * a + 10 * b + r);
                                uint8_t *w = malloc(wbytes);
                                float *x = rand_vec(rows * n, 1.0f), *wf = vec(d * n);
                                float *got = vec(rows * d), *want = vec(rows * d);
                                double *wantd = calloc(rows * d, sizeof *wantd);
                                double *bound = calloc(rows * d, sizeof *bound);
                                char what[160];
                                rand_weights(t, w, wbytes);
                                assert_int_equal(tsr_dequant_row(t, w, d * n, wf), TSR_OK);
                                assert_int_equal(tsr_backend_matmul(ref, want, x, wf, TSR_DTYPE_F32, rows, n, d),
                                                 TSR_OK);
                                void *dx = dev_copy(cr->be, x, rows * n * sizeof(float));
                                void *dw = dev_copy(cr->be, w, wbytes), *dout = dev_copy(cr->be, NULL, rows * d * 4);
                                assert_int_equal(tsr_backend_matmul(cr->be, dout, dx, dw, t, rows, n, d), TSR_OK);
                                assert_int_equal(tsr_backend_synchronize(cr->be), TSR_OK);
                                assert_int_equal(tsr_backend_download(cr->be, got, dout, rows * d * 4), TSR_OK);
                                for (size_t i = 0; i < rows * d; i++) {
                                        double abs_sum;
                                        wantd[i] = want[i];
                                        dot_abs(wf + i % d * n, x + i / d * n, n, &abs_sum);
                                        bound[i] = 2.0 * (double)n * (FLT_EPSILON / 2) * abs_sum + 1e-30;
                                }
                                snprintf(what, sizeof what, "matmul_%s %s rows %zu n %zu d %zu", info->name,
                                         tsr_backend_name(cr->be), rows, n, d);
                                if (compare(what, got, wantd, bound, rows * d)) {
                                        print_message("FAIL %s\n", what);
                                        cr->n_failed++;
                                } else {
                                        cr->n_bounded++;
                                }
                                tsr_backend_mem_free(cr->be, dx), tsr_backend_mem_free(cr->be, dw);
                                tsr_backend_mem_free(cr->be, dout);
                                free(w), free(x), free(wf), free(got), free(want), free(wantd), free(bound);
                        }
}

/* ---- argmax: exact, against its definition ------------------------------------------------
 * kernels.h: the index of the first maximum of a row, TSR_ARGMAX_NONE for a row with a
 * NaN or +inf or nothing above -inf.  Every column must give these very indices. */
enum { AV_RANDOM, AV_TIES, AV_NAN, AV_POS_INF, AV_ALL_NEG_INF, AV_ONE_FINITE, AV_LAST, AV_ZEROS, AV_COUNT };
static const char *const av_names[AV_COUNT] = {"random", "ties", "nan", "+inf", "all -inf", "one finite",
                                               "max last", "+0/-0"};

static uint32_t argmax_def(const float *x, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (isnan(x[i]) || x[i] == INFINITY)
                        return TSR_ARGMAX_NONE;
        uint32_t best = TSR_ARGMAX_NONE;
        for (size_t i = 0; i < n; i++)
                if (x[i] != -INFINITY && (best == TSR_ARGMAX_NONE || x[i] > x[best]))
                        best = (uint32_t)i;
        return best;
}

/* Row r of variant v: the edge sits at a position that moves with the row, so rows of
 * one call put it on different threads of a device kernel. */
static void argmax_row(float *x, size_t n, int v, size_t r) {
        size_t at = (r * 257 + 5) % n;
        for (size_t i = 0; i < n; i++)
                x[i] = v == AV_ALL_NEG_INF || v == AV_ONE_FINITE ? -INFINITY : v == AV_ZEROS ? 0.0f : frand();
        switch (v) {
        case AV_TIES:   /* the maximum three times: at `at`, 256 later (another thread's share), last */
                x[at] = 2.0f;
                x[(at + 256) % n] = 2.0f;
                x[n - 1] = 2.0f;
                break;
        case AV_NAN:
                x[at] = NAN;
                break;
        case AV_POS_INF:
                x[at] = INFINITY;
                break;
        case AV_ONE_FINITE:
                x[at] = -3.0e38f;
                break;
        case AV_LAST:
                x[n - 1] = 1.5f;
                break;
        case AV_ZEROS:  /* -0 == +0: the first of them wins whatever its sign */
                x[at] = -0.0f;
                break;
        }
}

static void run_argmax(struct col_run *cr) {
        static const size_t an[] = {1, 2, 255, 256, 257, 4097, 49152 + 7};
        static const size_t arows[] = {1, 3, 9};
        for (int v = 0; v < AV_COUNT; v++)
                for (size_t i = 0; i < sizeof an / sizeof *an; i++)
                        for (size_t j = 0; j < sizeof arows / sizeof *arows; j++) {
                                size_t n = an[i], rows = arows[j];
                                seed(1000 + (uint64_t)v * 100 + i * 10 + j);
                                float *x = vec(rows * n);
                                uint32_t *got = malloc(rows * sizeof *got);
                                assert_non_null(got);
                                for (size_t r = 0; r < rows; r++)
                                        argmax_row(x + r * n, n, v, r);
                                void *dx = dev_copy(cr->be, x, rows * n * sizeof(float));
                                assert_int_equal(tsr_backend_argmax(cr->be, got, dx, rows, n), TSR_OK);
                                bool ok = true;
                                for (size_t r = 0; r < rows; r++) {
                                        uint32_t want = argmax_def(x + r * n, n);
                                        if (got[r] != want) {
                                                print_message("FAIL argmax %s n=%zu rows=%zu row %zu: got %u, want %u\n",
                                                              av_names[v], n, rows, r, got[r], want);
                                                ok = false;
                                        }
                                }
                                ok ? cr->n_bitwise++ : cr->n_failed++;
                                tsr_backend_mem_free(cr->be, dx);
                                free(got);
                                free(x);
                        }
}

/* ---- sample: every column draws cpu-ref's tokens, bitwise, and leaves its bits in x ---------
 * kernels.h tsr_backend_sample is one definition (cpu/ref.c), so a column's tokens and the
 * drawn rows' e values must equal the reference's exactly; test_sample_spec checks the
 * reference against the distributions it must draw from. */
static const tsr_draw sample_draws[] = {
        {1.0f, 0, 1.0f, 0.0f, 0.0},     {1.0f, 0, 1.0f, 0.0f, 0.5},   {0.7f, 5, 1.0f, 0.0f, 0.31},
        {1.0f, 0, 0.9f, 0.0f, 0.77},    {1.3f, 0, 1.0f, 0.05f, 0.13}, {0.6f, 40, 0.8f, 0.02f, 0.999999},
        {1e-5f, 0, 1.0f, 0.0f, 0.42},   {1.0f, 1, 1.0f, 0.0f, 0.9},   {0.0f, 0, 1.0f, 0.0f, 0.5},
};

static void run_sample(struct col_run *cr) {
        static const size_t an[] = {1, 2, 255, 256, 257, 4097, 49152 + 7};
        size_t nd = sizeof sample_draws / sizeof *sample_draws;
        for (int v = 0; v < AV_COUNT; v++)
                for (size_t i = 0; i < sizeof an / sizeof *an; i++) {
                        size_t n = an[i], rows = nd;
                        seed(5000 + (uint64_t)v * 100 + i);
                        float *x = vec(rows * n), *xr = vec(rows * n), *back = vec(rows * n);
                        uint32_t got[16], want[16];
                        for (size_t r = 0; r < rows; r++)
                                argmax_row(x + r * n, n, v, r);
                        for (size_t k = 0; k < rows * n; k++)
                                x[k] *= 4.0f;           /* logits of a few units: draws away from the top */
                        memcpy(xr, x, rows * n * sizeof(float));
                        assert_int_equal(tsr_backend_sample(ref, want, xr, rows, n, sample_draws), TSR_OK);
                        void *dx = dev_copy(cr->be, x, rows * n * sizeof(float));
                        assert_int_equal(tsr_backend_sample(cr->be, got, dx, rows, n, sample_draws), TSR_OK);
                        assert_int_equal(tsr_backend_download(cr->be, back, dx, rows * n * sizeof(float)), TSR_OK);
                        bool ok = true;
                        for (size_t r = 0; r < rows; r++) {
                                if (sample_draws[r].temperature == 0.0f) {      /* not drawn: x untouched */
                                        ok &= memcmp(back + r * n, x + r * n, n * sizeof(float)) == 0;
                                        continue;
                                }
                                if (got[r] != want[r] || memcmp(back + r * n, xr + r * n, n * sizeof(float)) != 0) {
                                        print_message("FAIL sample %s n=%zu draw %zu: token %u, cpu-ref %u%s\n",
                                                      av_names[v], n, r, got[r], want[r],
                                                      memcmp(back + r * n, xr + r * n, n * sizeof(float))
                                                              ? " (the e values differ)" : "");
                                        ok = false;
                                }
                        }
                        ok ? cr->n_bitwise++ : cr->n_failed++;
                        tsr_backend_mem_free(cr->be, dx);
                        free(x), free(xr), free(back);
                }
}

/* The reference draws from the distribution its definition names: over a grid of u, each
 * token's share is its probability within a grid step (plus exp.h's ulp): plain softmax,
 * temperature, top_k (ties kept), top_p (the threshold keeps ties), min_p; a NaN row and
 * an all -inf row draw nothing. */
static void test_sample_spec(void **state) {
        (void)state;
        enum { N = 6, G = 20000 };
        const float x[N] = {0.0f, 1.0f, 2.0f, 3.0f, 3.0f, -1.0f};
        struct { tsr_draw d; double p[N]; } cases[] = {
                {{1.0f, 0, 1.0f, 0.0f, 0}, {0}},        /* filled below: softmax */
                {{2.0f, 0, 1.0f, 0.0f, 0}, {0}},        /* softmax(x / 2) */
                {{1.0f, 3, 1.0f, 0.0f, 0}, {0}},        /* the 3 largest: 2, 3, 3 */
                {{1.0f, 0, 0.5f, 0.0f, 0}, {0, 0, 0, 0.5, 0.5, 0}},     /* the two 3s hold >= half */
                {{1.0f, 0, 1.0f, 0.3f, 0}, {0}},        /* e >= 0.3: 3, 3, 2 */
        };
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
                tsr_draw d = cases[c].d;
                double *p = cases[c].p, z = 0;
                if (c != 3) {
                        for (int i = 0; i < N; i++) {
                                bool keep = c == 2 ? x[i] >= 2.0f : c == 4 ? exp(x[i] - 3.0) >= 0.3 : true;
                                p[i] = keep ? exp((x[i] - 3.0) / d.temperature) : 0;
                                z += p[i];
                        }
                        for (int i = 0; i < N; i++)
                                p[i] /= z;
                }
                size_t count[N] = {0};
                for (int j = 0; j < G; j++) {
                        float row[N];
                        uint32_t tok;
                        memcpy(row, x, sizeof row);
                        d.u = (j + 0.5) / G;
                        assert_int_equal(tsr_backend_sample(ref, &tok, row, 1, N, &d), TSR_OK);
                        assert_true(tok < N);
                        count[tok]++;
                }
                for (int i = 0; i < N; i++)
                        if (fabs((double)count[i] / G - p[i]) > 2.0 / G + 1e-6)
                                fail_msg("sample case %zu token %d: share %.5f, probability %.5f", c, i,
                                         (double)count[i] / G, p[i]);
        }
        float bad[N] = {0, 1, NAN, 2, 3, 4}, neg[N];
        uint32_t tok = 0;
        for (int i = 0; i < N; i++)
                neg[i] = -INFINITY;
        tsr_draw d = {1.0f, 0, 1.0f, 0.0f, 0.5};
        assert_int_equal(tsr_backend_sample(ref, &tok, bad, 1, N, &d), TSR_OK);
        assert_int_equal(tok, TSR_ARGMAX_NONE);
        assert_int_equal(tsr_backend_sample(ref, &tok, neg, 1, N, &d), TSR_OK);
        assert_int_equal(tok, TSR_ARGMAX_NONE);
        d.u = 1.0;              /* u outside [0, 1), T < 0, top_p 0: refused */
        assert_int_equal(tsr_backend_sample(ref, &tok, bad, 1, N, &d), TSR_E_INVAL);
        d.u = 0.5, d.temperature = -1.0f;
        assert_int_equal(tsr_backend_sample(ref, &tok, bad, 1, N, &d), TSR_E_INVAL);
        d.temperature = 1.0f, d.top_p = 0.0f;
        assert_int_equal(tsr_backend_sample(ref, &tok, bad, 1, N, &d), TSR_E_INVAL);
}

/* ---- logit_rules: every column changes the rows to cpu-ref's bits -------------------------
 * Row r of a call gets one of the rule shapes below over a row of argmax_row's variant:
 * allowed ids (with a repeat), a mask, a bias list with a repeated id, penalties with a
 * prompt-only id, every list at once, and an empty row (left as it is). */
enum { RS_NONE, RS_ALLOWED, RS_MASKED, RS_BIAS, RS_PEN, RS_ALL, RS_COUNT };

static void rules_of(int shape, size_t n, size_t r, tsr_logit_rules *q, uint32_t *ids, float *vals) {
        memset(q, 0, sizeof *q);
        for (size_t j = 0; j < 8; j++)
                ids[j] = (uint32_t)((r * 131 + j * 37 + 1) % n);
        uint32_t nd = 0;       /* the distinct ones among them, for the penalties */
        uint32_t *pen = ids + 8;
        for (size_t j = 0; j < 8; j++) {
                bool seen = false;
                for (uint32_t t = 0; t < nd; t++)
                        seen |= pen[t] == ids[j];
                if (!seen)
                        pen[nd++] = ids[j];
        }
        for (uint32_t j = 0; j < nd; j++)
                vals[8 + j] = j % 3 == 2 ? -1.0f : (float)(1 + j % 4);  /* every third: the prompt's only */
        for (size_t j = 0; j < 8; j++)
                vals[j] = j % 2 ? -3.5f : 0.75f + (float)j;
        bool all = shape == RS_ALL;
        if (shape == RS_ALLOWED || all) {
                q->allowed = ids;
                q->n_allowed = n > 1 ? 5 : 1;
        }
        if (shape == RS_MASKED || all) {
                q->masked = ids + 2;
                q->n_masked = n > 3 ? 3 : 0;
        }
        if (shape == RS_BIAS || all) {
                q->bias_ids = ids;      /* ids[0] twice when n is small */
                q->bias = vals;
                q->n_bias = 6;
        }
        if (shape == RS_PEN || all) {
                q->pen_ids = pen;
                q->pen_counts = vals + 8;
                q->n_pen = nd;
                q->repetition = 1.3f;
                q->frequency = 0.4f;
                q->presence = 0.7f;
        }
}

static void run_logit_rules(struct col_run *cr) {
        static const size_t an[] = {1, 2, 255, 256, 257, 4097};
        for (int v = 0; v < AV_COUNT; v++)
                for (size_t i = 0; i < sizeof an / sizeof *an; i++) {
                        size_t n = an[i], rows = RS_COUNT;
                        seed(7000 + (uint64_t)v * 100 + i);
                        float *x = vec(rows * n), *want = vec(rows * n), *got = vec(rows * n);
                        tsr_logit_rules q[RS_COUNT];
                        uint32_t ids[RS_COUNT][16];
                        float vals[RS_COUNT][16];
                        for (size_t r = 0; r < rows; r++) {
                                argmax_row(x + r * n, n, v, r);
                                rules_of((int)r, n, r, &q[r], ids[r], vals[r]);
                        }
                        memcpy(want, x, rows * n * sizeof(float));
                        assert_int_equal(tsr_backend_logit_rules(ref, want, rows, n, q), TSR_OK);
                        void *dx = dev_copy(cr->be, x, rows * n * sizeof(float));
                        assert_int_equal(tsr_backend_logit_rules(cr->be, dx, rows, n, q), TSR_OK);
                        assert_int_equal(tsr_backend_download(cr->be, got, dx, rows * n * sizeof(float)), TSR_OK);
                        bool ok = memcmp(got, want, rows * n * sizeof(float)) == 0;
                        if (!ok)
                                print_message("FAIL logit_rules %s n=%zu: rows differ from cpu-ref's\n", av_names[v], n);
                        ok ? cr->n_bitwise++ : cr->n_failed++;
                        tsr_backend_mem_free(cr->be, dx);
                        free(x), free(want), free(got);
                }
}

/* ---- logprobs: every column's answer is its own log_softmax's values, ranked -------------
 * The definition (kernels.h) over the values the column's tsr_backend_log_softmax writes
 * for the row: the token's value, how many are >= it, the k largest (lower id first). */
static tsr_row_logprobs logprobs_def(const float *x, const float *ls, size_t n, uint32_t tok, uint32_t k) {
        tsr_row_logprobs lp;
        memset(&lp, 0, sizeof lp);
        bool finite = false;
        for (size_t i = 0; i < n; i++) {
                if (isnan(x[i]) || x[i] == INFINITY)
                        return lp;
                finite |= x[i] != -INFINITY;
        }
        if (!finite)
                return lp;
        lp.logprob = ls[tok];
        for (size_t i = 0; i < n; i++)
                lp.rank += ls[i] >= ls[tok];
        bool *taken = calloc(n, 1);
        assert_non_null(taken);
        for (uint32_t j = 0; j < k; j++) {
                size_t best = n;
                for (size_t i = 0; i < n; i++)
                        if (!taken[i] && (best == n || ls[i] > ls[best]))
                                best = i;
                taken[best] = true;
                lp.top_ids[j] = (uint32_t)best;
                lp.top_logprobs[j] = ls[best];
        }
        free(taken);
        return lp;
}

static void run_logprobs(struct col_run *cr) {
        static const size_t an[] = {1, 2, 255, 256, 257, 4097, 49152 + 7};
        static const uint32_t tops[] = {0, 1, 5, 20};
        for (int v = 0; v < AV_COUNT; v++)
                for (size_t i = 0; i < sizeof an / sizeof *an; i++) {
                        size_t n = an[i], rows = 5;
                        seed(9000 + (uint64_t)v * 100 + i);
                        float *x = vec(rows * n), *ls = vec(rows * n);
                        uint32_t tok[5], top[5];
                        tsr_row_logprobs got[5], sentinel;
                        memset(&sentinel, 0xa5, sizeof sentinel);
                        for (size_t r = 0; r < rows; r++) {
                                argmax_row(x + r * n, n, v, r);
                                for (size_t k = 0; k < n; k++)
                                        x[r * n + k] *= 4.0f;
                                tok[r] = r == 3 ? TSR_ARGMAX_NONE : (uint32_t)((r * 977 + 3) % n);
                                top[r] = tops[r % 4] < n ? tops[r % 4] : (uint32_t)n;
                                got[r] = sentinel;
                        }
                        void *dx = dev_copy(cr->be, x, rows * n * sizeof(float));
                        void *dls = dev_copy(cr->be, NULL, rows * n * sizeof(float));
                        assert_int_equal(tsr_backend_logprobs(cr->be, got, dx, rows, n, tok, top), TSR_OK);
                        assert_int_equal(tsr_backend_log_softmax(cr->be, dls, dx, rows, n), TSR_OK);
                        assert_int_equal(tsr_backend_download(cr->be, ls, dls, rows * n * sizeof(float)), TSR_OK);
                        bool ok = true;
                        for (size_t r = 0; r < rows; r++) {
                                if (tok[r] >= n) {      /* skipped: left as it was */
                                        ok &= memcmp(&got[r], &sentinel, sizeof sentinel) == 0;
                                        continue;
                                }
                                tsr_row_logprobs w = logprobs_def(x + r * n, ls + r * n, n, tok[r], top[r]);
                                bool same = got[r].rank == w.rank &&
                                            (w.rank == 0 ||
                                             (bits_of(got[r].logprob) == bits_of(w.logprob) &&
                                              memcmp(got[r].top_ids, w.top_ids, top[r] * sizeof(uint32_t)) == 0 &&
                                              memcmp(got[r].top_logprobs, w.top_logprobs, top[r] * sizeof(float)) == 0));
                                if (!same) {
                                        print_message("FAIL logprobs %s n=%zu row %zu (token %u, top %u): rank %u, "
                                                      "want %u; logprob %a, want %a\n", av_names[v], n, r, tok[r],
                                                      top[r], got[r].rank, w.rank, got[r].logprob, w.logprob);
                                        ok = false;
                                }
                        }
                        ok ? cr->n_bitwise++ : cr->n_failed++;
                        tsr_backend_mem_free(cr->be, dx);
                        tsr_backend_mem_free(cr->be, dls);
                        free(x), free(ls);
                }
}

/* The rules' arguments the wrapper refuses: an id past the row, a count that is neither
 * -1 nor a positive count, a repetition penalty of 0, and a top list past 20. */
static void test_logits_args(void **state) {
        (void)state;
        float x[4] = {1, 2, 3, 4};
        uint32_t bad_id = 4, id = 1, tok = 0, top = 21;
        float zero = 0.0f, one = 1.0f;
        tsr_logit_rules q = {.masked = &bad_id, .n_masked = 1};
        assert_int_equal(tsr_backend_logit_rules(ref, x, 1, 4, &q), TSR_E_INVAL);
        q = (tsr_logit_rules){.pen_ids = &id, .pen_counts = &zero, .n_pen = 1, .repetition = 1.0f};
        assert_int_equal(tsr_backend_logit_rules(ref, x, 1, 4, &q), TSR_E_INVAL);
        q = (tsr_logit_rules){.pen_ids = &id, .pen_counts = &one, .n_pen = 1, .repetition = 0.0f};
        assert_int_equal(tsr_backend_logit_rules(ref, x, 1, 4, &q), TSR_E_INVAL);
        tsr_row_logprobs lp;
        assert_int_equal(tsr_backend_logprobs(ref, &lp, x, 1, 4, &tok, &top), TSR_E_INVAL);
        top = 5;        /* more than the row */
        assert_int_equal(tsr_backend_logprobs(ref, &lp, x, 1, 4, &tok, &top), TSR_E_INVAL);
        /* the reference's rules on a small row, by hand: allowed {1, 3}, mask 3, bias +1 on
         * 1 twice, repetition 2 and frequency 0.5 x 2 and presence 0.25 on 1 */
        uint32_t allowed[2] = {1, 3}, masked = 3, bias_ids[2] = {1, 1}, pen = 1;
        float bias[2] = {1.0f, 1.0f}, cnt = 2.0f;
        q = (tsr_logit_rules){.allowed = allowed, .n_allowed = 2, .masked = &masked, .n_masked = 1,
                              .bias_ids = bias_ids, .bias = bias, .n_bias = 2, .pen_ids = &pen, .pen_counts = &cnt,
                              .n_pen = 1, .repetition = 2.0f, .frequency = 0.5f, .presence = 0.25f};
        assert_int_equal(tsr_backend_logit_rules(ref, x, 1, 4, &q), TSR_OK);
        assert_true(x[0] == -INFINITY && x[2] == -INFINITY && x[3] == -INFINITY);
        assert_true(x[1] == (2.0f + 2.0f) / 2.0f - 1.0f - 0.25f);
}

static void test_column(void **state) {
        const column *col = *state;
        struct col_run cr = {.col = col};
        tsr_status st;
        size_t not_run = 0;

        switch (col->kind) {
        case COL_REF:
                assert_int_equal(tsr_backend_cpu_ref_new(&cr.be), TSR_OK);
                break;
        case COL_FAST:
                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = col->isa},
                                                     &cr.be), TSR_OK);
                if (tsr_backend_cpu_isa(cr.be) != col->isa) {
                        tsr_cpu_isa best = tsr_backend_cpu_isa(cr.be);
                        tsr_backend_free(&cr.be);
                        print_message("[skip:cpu-lacks:%s] this CPU runs %s at most\n", tsr_cpu_isa_name(col->isa),
                                      tsr_cpu_isa_name(best));
                        skip();
                }
                break;
        case COL_CUDA:
                st = tsr_backend_cuda_new(0, &cr.be);
                if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND)
                        TSR_SKIP("no-gpu", "cuda column: %s", st == TSR_E_UNSUPPORTED ? "CUDA not built"
                                                                                      : "no CUDA device");
                assert_int_equal(st, TSR_OK);
                break;
        }
        for (int m = 0; m < MOP_COUNT; m++) {
                tsr_dtype wt = m == MOP_MATMUL_BF16 || m == MOP_EMBEDDING_BF16 ? TSR_DTYPE_BF16 : TSR_DTYPE_F32;
                if (!tsr_backend_supports(cr.be, mop_op((mop)m), wt)) {
                        print_message("%s: %s not implemented on this backend: not run\n", tsr_backend_name(cr.be),
                                      mop_names[m]);
                        not_run++;
                        continue;
                }
                for_each_case((mop)m, run_one, &cr);
        }
        if (tsr_backend_supports(cr.be, TSR_OP_ARGMAX, TSR_DTYPE_F32))
                run_argmax(&cr);
        else
                not_run++;
        if (tsr_backend_supports(cr.be, TSR_OP_SAMPLE, TSR_DTYPE_F32))
                run_sample(&cr);
        else
                not_run++;
        if (tsr_backend_supports(cr.be, TSR_OP_LOGIT_RULES, TSR_DTYPE_F32))
                run_logit_rules(&cr);
        else
                not_run++;
        if (tsr_backend_supports(cr.be, TSR_OP_LOGPROBS, TSR_DTYPE_F32))
                run_logprobs(&cr);
        else
                not_run++;
        for (int t = 0; t < TSR_DTYPE_COUNT; t++)
                if (t != TSR_DTYPE_F32 && t != TSR_DTYPE_BF16)
                        run_quant_matmul(&cr, (tsr_dtype)t, &not_run);
        print_message("%s/%s: %zu cases bitwise, %zu within their bound, %zu failed; %zu ops or matmul dtypes "
                      "not implemented\n",
                      tsr_backend_name(cr.be), tsr_cpu_isa_name(tsr_backend_cpu_isa(cr.be)), cr.n_bitwise,
                      cr.n_bounded, cr.n_failed, not_run);
        tsr_backend_free(&cr.be);
        assert_int_equal(cr.n_failed, 0);
        assert_true(cr.n_bitwise + cr.n_bounded > 0);
}

/* ---- dequantization: a second decoding of every format, from its definition ---------------
 * Written per element (where is element i's code, which scale is its) rather than per
 * block loop as kernels/quant/ is, so a slip in either's index arithmetic shows.  The
 * arithmetic of each element is the format's formula in the order quant.h states, so the
 * two agree bitwise (NaN by class). */

/* binary16 from its definition: (-1)^s 2^(e-15) (1 + m/1024), subnormal 2^-14 m/1024. */
static float half_def(uint16_t h) {
        int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
        double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? m * pow(2, -24) : (1024 + m) * pow(2, e - 25);
        return (float)(s ? -v : v);
}

static float e4m3_def(uint8_t c) {
        int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
        double v = (e == 15 && m == 7) ? NAN : e == 0 ? m * pow(2, -9) : (8 + m) * pow(2, e - 10);
        return (float)(s ? -v : v);
}

static float e5m2_def(uint8_t c) {
        int s = c >> 7, e = (c >> 2) & 31, m = c & 3;
        double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? m * pow(2, -16) : (4 + m) * pow(2, e - 17);
        return (float)(s ? -v : v);
}

static const float e2m1_table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static bool same_value(float a, float b) {     /* bitwise, any NaN equal to any NaN */
        return (isnan(a) && isnan(b)) || bits_of(a) == bits_of(b);
}

static void test_e2m1_codes(void **state) {
        (void)state;
        for (uint8_t c = 0; c < 16; c++)
                if (bits_of(tsr_e2m1_to_f32(c)) != bits_of(e2m1_table[c]))
                        fail_msg("e2m1 code %u: %g, want %g", c, tsr_e2m1_to_f32(c), e2m1_table[c]);
        assert_true(tsr_e2m1_to_f32(0xf7) == 6.0f);     /* only the low nibble counts */
}

static void test_f16_bf16_all_codes(void **state) {
        (void)state;
        for (uint32_t c = 0; c < 65536; c++) {
                uint8_t le[2] = {(uint8_t)c, (uint8_t)(c >> 8)};
                float got, want = half_def((uint16_t)c);
                assert_int_equal(tsr_dequant_f16(le, 1, &got), TSR_OK);
                if (!same_value(got, want))
                        fail_msg("f16 0x%04x: %g, want %g", c, got, want);
                assert_int_equal(tsr_dequant_bf16(le, 1, &got), TSR_OK);
                if (!same_value(got, float_of(c << 16)))
                        fail_msg("bf16 0x%04x: %g", c, got);
        }
}

/* The code of a minifloat nearest to x (round to nearest, ties to the even code), found by
 * trying every finite code of x's sign: the definition of RNE, with no arithmetic shared
 * with kernels/quant/fp8.c. */
static uint8_t nearest_code(float x, float (*dec)(uint8_t)) {
        uint8_t sign = signbit(x) ? 0x80 : 0, best = sign;
        double bd = INFINITY;
        for (int c = 0; c < 128; c++) {
                float v = dec((uint8_t)(sign | c));
                if (!isfinite(v))
                        continue;
                double dist = fabs((double)v - (double)x);
                if (dist < bd || (dist == bd && (c & 1) == 0)) {
                        bd = dist;
                        best = (uint8_t)(sign | c);
                }
        }
        return best;
}

static void test_fp8_e4m3_all_codes(void **state) {
        (void)state;
        for (int c = 0; c < 256; c++) {
                float got = tsr_fp8_e4m3_to_f32((uint8_t)c), want = e4m3_def((uint8_t)c);
                if (!same_value(got, want))
                        fail_msg("e4m3 0x%02x: %g, want %g", c, got, want);
                if (!isnan(want) && tsr_f32_to_fp8_e4m3(want) != c)     /* every finite code round-trips */
                        fail_msg("e4m3 0x%02x: %g encodes as 0x%02x", c, want, tsr_f32_to_fp8_e4m3(want));
        }
        assert_true(isnan(tsr_fp8_e4m3_to_f32(0x7f)) && isnan(tsr_fp8_e4m3_to_f32(0xff)));
        assert_true(tsr_fp8_e4m3_to_f32(0x7e) == 448.0f && tsr_fp8_e4m3_to_f32(0xfe) == -448.0f);
        assert_true(tsr_fp8_e4m3_to_f32(0x78) == 256.0f);                       /* E = 15 is normal */
        assert_true(tsr_fp8_e4m3_to_f32(0x01) == 0x1p-9f && tsr_fp8_e4m3_to_f32(0x08) == 0x1p-6f);
        /* In: saturating RNE, NaN to S.1111.111. */
        assert_int_equal(tsr_f32_to_fp8_e4m3(1e9f), 0x7e);
        assert_int_equal(tsr_f32_to_fp8_e4m3(INFINITY), 0x7e);
        assert_int_equal(tsr_f32_to_fp8_e4m3(-INFINITY), 0xfe);
        assert_int_equal(tsr_f32_to_fp8_e4m3(464.0f), 0x7e);                   /* past 448: saturates */
        assert_int_equal(tsr_f32_to_fp8_e4m3(NAN) & 0x7f, 0x7f);
        assert_int_equal(tsr_f32_to_fp8_e4m3(-0.0f), 0x80);
        assert_int_equal(tsr_f32_to_fp8_e4m3(0x1p-10f), 0x00);                 /* half the smallest: tie to 0 */
        assert_int_equal(tsr_f32_to_fp8_e4m3(0x1.8p-9f), 0x02);                /* 1.5 subnormal quanta: to even 2 */
        /* Every midpoint between neighbours goes to the even code; random values to the nearest. */
        for (int c = 0; c < 0x7e; c++) {
                double mid = ((double)e4m3_def((uint8_t)c) + (double)e4m3_def((uint8_t)(c + 1))) / 2;
                uint8_t want = (uint8_t)((c & 1) ? c + 1 : c);
                assert_int_equal(tsr_f32_to_fp8_e4m3((float)mid), want);
                assert_int_equal(tsr_f32_to_fp8_e4m3(-(float)mid), want | 0x80);
        }
        seed(7);
        for (int i = 0; i < 20000; i++) {
                float x = ldexpf(frand(), (int)(rnd() % 24) - 14);
                uint8_t want = fabsf(x) > 448.0f ? (uint8_t)((signbit(x) ? 0x80 : 0) | 0x7e)
                                                 : nearest_code(x, e4m3_def);
                if (tsr_f32_to_fp8_e4m3(x) != want)
                        fail_msg("e4m3 of %a: 0x%02x, want 0x%02x", x, tsr_f32_to_fp8_e4m3(x), want);
        }
}

static void test_fp8_e5m2_all_codes(void **state) {
        (void)state;
        for (int c = 0; c < 256; c++) {
                float got = tsr_fp8_e5m2_to_f32((uint8_t)c), want = e5m2_def((uint8_t)c);
                if (!same_value(got, want))
                        fail_msg("e5m2 0x%02x: %g, want %g", c, got, want);
                if (!same_value(got, half_def((uint16_t)(c << 8))))    /* the top byte of a binary16 */
                        fail_msg("e5m2 0x%02x is not binary16 0x%02x00", c, c);
                if (!isnan(want) && tsr_f32_to_fp8_e5m2(want) != c)
                        fail_msg("e5m2 0x%02x: %g encodes as 0x%02x", c, want, tsr_f32_to_fp8_e5m2(want));
        }
        assert_true(tsr_fp8_e5m2_to_f32(0x7b) == 57344.0f);
        assert_true(isinf(tsr_fp8_e5m2_to_f32(0x7c)) && isinf(tsr_fp8_e5m2_to_f32(0xfc)));
        assert_int_equal(tsr_f32_to_fp8_e5m2(61439.0f), 0x7b);                 /* below the midpoint */
        assert_int_equal(tsr_f32_to_fp8_e5m2(61440.0f), 0x7c);                 /* the midpoint: to even = inf */
        assert_int_equal(tsr_f32_to_fp8_e5m2(-1e9f), 0xfc);
        assert_true(isnan(tsr_fp8_e5m2_to_f32(tsr_f32_to_fp8_e5m2(NAN))));
        for (int c = 0; c < 0x7b; c++) {
                double mid = ((double)e5m2_def((uint8_t)c) + (double)e5m2_def((uint8_t)(c + 1))) / 2;
                assert_int_equal(tsr_f32_to_fp8_e5m2((float)mid), (c & 1) ? c + 1 : c);
        }
        seed(8);
        for (int i = 0; i < 20000; i++) {
                float x = ldexpf(frand(), (int)(rnd() % 36) - 18);
                uint8_t want = fabsf(x) >= 61440.0f ? (uint8_t)((signbit(x) ? 0x80 : 0) | 0x7c)
                                                    : nearest_code(x, e5m2_def);
                if (tsr_f32_to_fp8_e5m2(x) != want)
                        fail_msg("e5m2 of %a: 0x%02x, want 0x%02x", x, tsr_f32_to_fp8_e5m2(x), want);
        }
}

/* ---- GGUF blocks, one element at a time ---- */

static float rdh(const uint8_t *p) { return half_def((uint16_t)(p[0] | p[1] << 8)); }

/* Nibble i of a 32-element block's 16 bytes: elements 0..15 low nibbles, 16..31 high. */
static int nib32(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

/* Sub-block j's 6-bit scale and min in a K-quant's 12 bytes: j < 4 low six bits of bytes
 * j (scale) and j+4 (min); j >= 4 a nibble of byte j+4 (scale low, min high) with the
 * top two bits taken from the top of bytes j-4 (scale) and j (min). */
static void k6(const uint8_t *s, int j, int *sc, int *mn) {
        if (j < 4) {
                *sc = s[j] & 63, *mn = s[j + 4] & 63;
        } else {
                *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
                *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        }
}

/* Element i of one block of `t`. */
static float gguf_elem(tsr_dtype t, const uint8_t *b, int i) {
        switch (t) {
        case TSR_DTYPE_Q8_0:
                return rdh(b) * (float)(int8_t)b[2 + i];
        case TSR_DTYPE_Q4_0:
                return rdh(b) * (float)(nib32(b + 2, i) - 8);
        case TSR_DTYPE_Q4_1:
                return rdh(b) * (float)nib32(b + 4, i) + rdh(b + 2);
        case TSR_DTYPE_Q5_0: {
                uint32_t qh = b[2] | b[3] << 8 | b[4] << 16 | (uint32_t)b[5] << 24;
                return rdh(b) * (float)((nib32(b + 6, i) | (int)((qh >> i) & 1) << 4) - 16);
        }
        case TSR_DTYPE_Q5_1: {
                uint32_t qh = b[4] | b[5] << 8 | b[6] << 16 | (uint32_t)b[7] << 24;
                return rdh(b) * (float)(nib32(b + 8, i) | (int)((qh >> i) & 1) << 4) + rdh(b + 2);
        }
        case TSR_DTYPE_Q4_K:
        case TSR_DTYPE_Q5_K: {
                /* 8 sub-blocks of 32; sub-blocks 2c and 2c+1 share 32 bytes of qs (low, high
                 * nibbles); Q5_K's fifth bit of element l of sub-block j is bit j of qh[l]. */
                int j = i / 32, l = i % 32, sc, mn, q;
                const uint8_t *qs = b + (t == TSR_DTYPE_Q4_K ? 16 : 48);
                k6(b + 4, j, &sc, &mn);
                q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
                if (t == TSR_DTYPE_Q5_K)
                        q |= ((b[16 + l] >> j) & 1) << 4;
                float dsc = rdh(b) * (float)sc, dmn = rdh(b + 2) * (float)mn;
                return dsc * (float)q - dmn;
        }
        case TSR_DTYPE_Q6_K: {
                /* 16 sub-blocks of 16 with int8 scales; halves of 128: element 32k + l of half
                 * h has its low nibble in ql[64h + 32(k%2) + l] (low for k < 2), its top two
                 * bits at 2k of qh[32h + l]. */
                int h = i / 128, k = i % 128 / 32, l = i % 32;
                uint8_t lb = b[64 * h + 32 * (k % 2) + l];
                int q = (k < 2 ? lb & 15 : lb >> 4) | ((b[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
                return rdh(b + 208) * (float)(int8_t)b[192 + i / 16] * (float)(q - 32);
        }
        default:
                break;
        }
        return NAN;
}

/* Fill a block of `t`: random bytes, then the variant's scales. */
enum blk { BLK_RANDOM, BLK_ZERO, BLK_MAX, BLK_NEG, BLK_COUNT };

static void gguf_block(tsr_dtype t, enum blk kind, uint8_t *b, size_t bytes) {
        for (size_t i = 0; i < bytes; i++)
                b[i] = kind == BLK_ZERO ? 0 : kind == BLK_MAX ? 0xff : (uint8_t)rnd();
        if (kind == BLK_RANDOM || kind == BLK_ZERO)
                return;
        /* f16 scales: the largest finite (65504) or a negative one (-1.5); q6_K's int8 scales
         * at their extreme (-128) in the negative variant. */
        uint8_t lo = kind == BLK_MAX ? 0xff : 0x00, hi = kind == BLK_MAX ? 0x7b : 0xbe;
        size_t d_off = t == TSR_DTYPE_Q6_K ? 208 : 0;
        b[d_off] = lo, b[d_off + 1] = hi;
        if (t == TSR_DTYPE_Q4_1 || t == TSR_DTYPE_Q5_1 || t == TSR_DTYPE_Q4_K || t == TSR_DTYPE_Q5_K)
                b[2] = lo, b[3] = hi;          /* the min / dmin too */
        if (t == TSR_DTYPE_Q6_K && kind == BLK_NEG)
                memset(b + 192, 0x80, 16);
}

static void test_gguf_blocks(void **state) {
        static const tsr_dtype types[] = {TSR_DTYPE_Q8_0, TSR_DTYPE_Q4_0, TSR_DTYPE_Q4_1, TSR_DTYPE_Q5_0,
                                          TSR_DTYPE_Q5_1, TSR_DTYPE_Q4_K, TSR_DTYPE_Q5_K, TSR_DTYPE_Q6_K};
        (void)state;
        seed(11);
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
                tsr_dtype t = types[ti];
                const tsr_dtype_info *info = tsr_dtype_get_info(t);
                size_t nblk = 64, qk = info->block_elems, bb = info->block_bytes;
                uint8_t *raw = malloc(nblk * bb);
                float *got = vec(nblk * qk);
                for (size_t b = 0; b < nblk; b++)
                        gguf_block(t, b < 4 ? (enum blk)b : BLK_RANDOM, raw + b * bb, bb);
                assert_int_equal(tsr_dequant_row(t, raw, nblk * qk, got), TSR_OK);
                for (size_t b = 0; b < nblk; b++)
                        for (size_t i = 0; i < qk; i++) {
                                float want = gguf_elem(t, raw + b * bb, (int)i);
                                if (!same_value(got[b * qk + i], want))
                                        fail_msg("%s block %zu element %zu: %.9g, want %.9g", info->name, b, i,
                                                 got[b * qk + i], want);
                        }
                for (size_t i = 0; i < qk; i++)                 /* block 1, all zero bytes, is zeros */
                        assert_true(got[BLK_ZERO * qk + i] == 0.0f);
                assert_int_equal(tsr_dequant_row(t, raw, qk + 1, got), TSR_E_INVAL);
                assert_int_equal(tsr_dequant_row(t, NULL, qk, got), TSR_E_INVAL);
                free(raw), free(got);
        }
}

/* ---- NVFP4 ---- */

static void test_nvfp4(void **state) {
        const float globals[] = {1.0f, 0.37f, -2.5f};
        uint8_t blk[9], codes[8 * 256], scales[256], *inter = malloc(9 * 256);
        float got[16], *a = vec(16 * 256), *b = vec(16 * 256);
        (void)state;

        /* Every scale code with all 16 values, at three global scales. */
        for (size_t g = 0; g < sizeof globals / sizeof *globals; g++)
                for (int s = 0; s < 256; s++) {
                        blk[0] = (uint8_t)s;
                        for (int i = 0; i < 8; i++)
                                blk[1 + i] = (uint8_t)((2 * i) | (2 * i + 1) << 4);
                        assert_int_equal(tsr_dequant_nvfp4(blk, 16, globals[g], got), TSR_OK);
                        for (int e = 0; e < 16; e++) {
                                float want = (e2m1_table[e] * e4m3_def((uint8_t)s)) * globals[g];
                                if (!same_value(got[e], want))
                                        fail_msg("nvfp4 scale 0x%02x code %d global %g: %g, want %g", s, e, globals[g],
                                                 got[e], want);
                        }
                        if (s == 0x7f || s == 0xff)                     /* a NaN scale poisons the block */
                                for (int e = 0; e < 16; e++)
                                        assert_true(isnan(got[e]));
                }
        /* Max scale (448) and negative scale (-448) with the extreme codes; a zero block. */
        memset(blk, 0, sizeof blk);
        assert_int_equal(tsr_dequant_nvfp4(blk, 16, 1.0f, got), TSR_OK);
        for (int e = 0; e < 16; e++)
                assert_true(got[e] == 0.0f);
        blk[0] = 0x7e, blk[1] = 0xf7;                   /* +6 then -6 */
        assert_int_equal(tsr_dequant_nvfp4(blk, 16, 1.0f, got), TSR_OK);
        assert_true(got[0] == 2688.0f && got[1] == -2688.0f);
        blk[0] = 0xfe;
        assert_int_equal(tsr_dequant_nvfp4(blk, 16, 1.0f, got), TSR_OK);
        assert_true(got[0] == -2688.0f && got[1] == 2688.0f);
        /* The planar layout gives the same values; row dequant is global scale 1. */
        seed(12);
        for (int i = 0; i < 256; i++) {
                scales[i] = (uint8_t)rnd();
                inter[9 * i] = scales[i];
                for (int k = 0; k < 8; k++)
                        inter[9 * i + 1 + k] = codes[8 * i + k] = (uint8_t)rnd();
        }
        assert_int_equal(tsr_dequant_nvfp4(inter, 16 * 256, 0.5f, a), TSR_OK);
        assert_int_equal(tsr_dequant_nvfp4_planar(codes, scales, 16 * 256, 0.5f, b), TSR_OK);
        for (int i = 0; i < 16 * 256; i++)
                assert_true(same_value(a[i], b[i]));
        assert_int_equal(tsr_dequant_row(TSR_DTYPE_NVFP4, inter, 16 * 256, b), TSR_OK);
        for (int i = 0; i < 16 * 256; i++)
                assert_true(same_value(a[i], b[i] * 0.5f));
        assert_int_equal(tsr_dequant_nvfp4(inter, 17, 1.0f, a), TSR_E_INVAL);
        assert_int_equal(tsr_dequant_nvfp4_planar(codes, NULL, 16, 1.0f, a), TSR_E_INVAL);
        free(inter), free(a), free(b);
}

/* ---- the dtype table and tsr_tensor ---- */

static void test_dtype_table(void **state) {
        static const struct {
                const char *name;
                uint32_t elems, bytes;
        } want[TSR_DTYPE_COUNT] = {
                [TSR_DTYPE_F32] = {"f32", 1, 4},         [TSR_DTYPE_BF16] = {"bf16", 1, 2},
                [TSR_DTYPE_F16] = {"f16", 1, 2},         [TSR_DTYPE_Q8_0] = {"q8_0", 32, 2 + 32},
                [TSR_DTYPE_Q4_0] = {"q4_0", 32, 2 + 16}, [TSR_DTYPE_Q4_1] = {"q4_1", 32, 4 + 16},
                [TSR_DTYPE_Q5_0] = {"q5_0", 32, 2 + 4 + 16}, [TSR_DTYPE_Q5_1] = {"q5_1", 32, 4 + 4 + 16},
                [TSR_DTYPE_Q4_K] = {"q4_K", 256, 4 + 12 + 128}, [TSR_DTYPE_Q5_K] = {"q5_K", 256, 4 + 12 + 32 + 128},
                [TSR_DTYPE_Q6_K] = {"q6_K", 256, 128 + 64 + 16 + 2}, [TSR_DTYPE_FP8_E4M3] = {"fp8_e4m3", 1, 1},
                [TSR_DTYPE_FP8_E5M2] = {"fp8_e5m2", 1, 1}, [TSR_DTYPE_NVFP4] = {"nvfp4", 16, 1 + 8},
        };
        uint8_t raw[2 * 256] = {0};
        float out[512];
        size_t bytes;
        (void)state;

        for (int t = 0; t < TSR_DTYPE_COUNT; t++) {
                const tsr_dtype_info *i = tsr_dtype_get_info((tsr_dtype)t);
                assert_non_null(i);
                assert_string_equal(i->name, want[t].name);
                assert_string_equal(tsr_dtype_name((tsr_dtype)t), want[t].name);
                assert_int_equal(i->block_elems, want[t].elems);
                assert_int_equal(i->block_bytes, want[t].bytes);
                assert_int_equal(tsr_dtype_row_bytes((tsr_dtype)t, 2 * i->block_elems, &bytes), TSR_OK);
                assert_int_equal(bytes, 2 * i->block_bytes);
                assert_int_equal(tsr_dequant_row((tsr_dtype)t, raw, i->block_elems, out), TSR_OK);
                if (i->block_elems > 1) {
                        assert_int_equal(tsr_dtype_row_bytes((tsr_dtype)t, i->block_elems - 1, &bytes), TSR_E_INVAL);
                        assert_int_equal(tsr_dequant_row((tsr_dtype)t, raw, i->block_elems - 1, out), TSR_E_INVAL);
                }
                assert_int_equal(tsr_dequant_row((tsr_dtype)t, NULL, 0, out), TSR_OK);
        }
        assert_null(tsr_dtype_get_info(TSR_DTYPE_COUNT));
        assert_string_equal(tsr_dtype_name((tsr_dtype)-1), "?");
        assert_int_equal(tsr_dequant_row(TSR_DTYPE_COUNT, raw, 1, out), TSR_E_INVAL);
}

static void test_tensor(void **state) {
        tsr_tensor t;
        tsr_backend *be = NULL;
        (void)state;

        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_Q4_K, 2, (size_t[]){3, 512}, NULL, NULL), TSR_OK);
        assert_int_equal(t.stride[1], 144);
        assert_int_equal(t.stride[0], 2 * 144);
        assert_int_equal(t.shape[2], 1);
        assert_int_equal(tsr_tensor_n_elems(&t), 3 * 512);
        assert_int_equal(tsr_tensor_row_bytes(&t), 288);
        assert_int_equal(tsr_tensor_n_bytes(&t), 3 * 288);
        assert_true(tsr_tensor_is_contiguous(&t));
        t.stride[0] += 16;                      /* padded rows: a view, not contiguous */
        assert_false(tsr_tensor_is_contiguous(&t));
        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_Q4_K, 2, (size_t[]){3, 100}, NULL, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_F32, 0, (size_t[]){3}, NULL, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_F32, 5, (size_t[]){1, 1, 1, 1, 1}, NULL, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_F32, 2, (size_t[]){0, 4}, NULL, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_tensor_init(&t, TSR_DTYPE_COUNT, 1, (size_t[]){4}, NULL, NULL), TSR_E_INVAL);

        assert_int_equal(tsr_backend_cpu_ref_new(&be), TSR_OK);
        assert_int_equal(tsr_tensor_alloc(&t, be, TSR_DTYPE_NVFP4, 3, (size_t[]){2, 3, 32}), TSR_OK);
        assert_non_null(t.data);
        assert_ptr_equal(t.backend, be);
        assert_int_equal(tsr_tensor_n_bytes(&t), 2 * 3 * 2 * 9);
        assert_int_equal(t.stride[1], 18);
        assert_int_equal(t.stride[0], 54);
        memset(t.data, 0, tsr_tensor_n_bytes(&t));
        tsr_tensor_done(&t);
        assert_null(t.data);
        tsr_tensor_done(&t);                    /* a cleared tensor is fine */
        tsr_tensor_done(NULL);
        tsr_backend_free(&be);
}

/* ---- main ------------------------------------------------------------------------------- */

static const column col_ref = {COL_REF, TSR_CPU_ISA_SCALAR};
static const column col_scalar = {COL_FAST, TSR_CPU_ISA_SCALAR}, col_avx2 = {COL_FAST, TSR_CPU_ISA_AVX2};
static const column col_avx512_bf16 = {COL_FAST, TSR_CPU_ISA_AVX512_BF16};
static const column col_amx_bf16 = {COL_FAST, TSR_CPU_ISA_AMX_BF16};
static const column col_cuda = {COL_CUDA, TSR_CPU_ISA_SCALAR};

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_dtype_table),
                cmocka_unit_test(test_tensor),
                cmocka_unit_test(test_e2m1_codes),
                cmocka_unit_test(test_f16_bf16_all_codes),
                cmocka_unit_test(test_fp8_e4m3_all_codes),
                cmocka_unit_test(test_fp8_e5m2_all_codes),
                cmocka_unit_test(test_gguf_blocks),
                cmocka_unit_test(test_nvfp4),
                cmocka_unit_test(test_sample_spec),
                cmocka_unit_test(test_logits_args),
                {"ops_cpu_ref", test_column, NULL, NULL, (void *)&col_ref},
                {"ops_cpu_fast_scalar", test_column, NULL, NULL, (void *)&col_scalar},
                {"ops_cpu_fast_avx2", test_column, NULL, NULL, (void *)&col_avx2},
                {"ops_cpu_fast_avx512_bf16", test_column, NULL, NULL, (void *)&col_avx512_bf16},
                {"ops_cpu_fast_amx_bf16", test_column, NULL, NULL, (void *)&col_amx_bf16},
                {"ops_cuda", test_column, NULL, NULL, (void *)&col_cuda},      /* last: see below */
        };
        size_t n_tests = sizeof tests / sizeof *tests;
        tsr_backend *cuda = NULL;

        if (tsr_backend_cpu_ref_new(&ref) != TSR_OK)
                return 1;
        /* A build without CUDA (the sanitizer build, a machine without nvcc) has no CUDA
         * column, as it has no gpu suite: not registered rather than skipped.  With CUDA
         * built and no device, the column runs and skips "no-gpu". */
        if (tsr_backend_cuda_new(0, &cuda) == TSR_E_UNSUPPORTED)
                n_tests--;
        tsr_backend_free(&cuda);
        int rc = _cmocka_run_group_tests("ops", tests, n_tests, NULL, NULL);
        tsr_backend_free(&ref);
        return rc;
}
