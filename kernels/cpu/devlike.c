/* devlike.c - the "cpu-devlike" backend (kernels.h: tsr_backend_cpu_devlike_new): the
 * reference kernels behind memory that counts as a device's, so that tests run the
 * forward's device path on a machine without a GPU, and kernels.h's graphs as the CPU
 * reference of their contract.
 *
 * Graphs: between graph_begin and graph_end each op checks its arguments as the
 * reference does, then becomes a record (the op, its pointers, sizes and scalars; its
 * index arrays - ids, positions, a kv op's block table - copied into the run's arena),
 * and nothing runs.  A capture keeps the records as graph `key` (per length class, as the
 * CUDA backend: one per 128 keys of the longest sequence, up to 32); a replay compares
 * each record with the graph's, everything but the index arrays' values.  graph_end with
 * `launch` then runs this run's records in order, reading the index arrays from the
 * arena: what the CUDA backend's graph launch computes, from the same checks.  A kv op
 * whose sequence holds more blocks than the table width, or whose length is past the
 * class, fails the run, as on CUDA.  One thread drives a backend (kernels.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"
#include "kernels/quant/fpmm.h"  /* TSR_FPMM_DTYPES: the reference matmul's dtypes */
#include "kernels/quant/qmm.h"   /* TSR_QMM_DTYPES */

enum { DL_OFF, DL_CAPTURE, DL_REPLAY };
enum { DL_RMSNORM = 1, DL_ADD_RMSNORM, DL_EMBEDDING, DL_MATMUL, DL_MATMUL_SCALED, DL_ROPE, DL_KV_WRITE, DL_ATTENTION,
       DL_SILU_MUL, DL_ADD, DL_SOFTMAX, DL_LOG_SOFTMAX, DL_COPY };

/* One op of a graph run (rec_same compares two). */
typedef struct dl_rec {
        int op;
        float *out;
        float *inout;                   /* add_rmsnorm's residual, rope's x */
        const float *a, *b;
        const void *w;
        tsr_dtype dtype;
        tsr_matmul_scales scales;
        tsr_rope_layout layout;
        size_t n1, n2, n3;
        float f;
        tsr_kv_view kv;                 /* kv ops: block_table NULL here, the table in the arena */
        size_t idx_off, idx_n;          /* the op's index array: uint32 entries of the arena */
} dl_rec;

typedef struct dl_graph {
        uint64_t key;
        unsigned cls;
        dl_rec *recs;
        size_t n;
} dl_graph;

typedef struct dl_ctx {
        int state;
        bool failed;
        uint64_t key;
        unsigned cls;
        uint32_t width;
        dl_rec *run;                    /* this run's records */
        size_t n_run, cap_run;
        uint32_t *arena;                /* this run's index arrays */
        size_t n_arena, cap_arena;
        dl_graph *graphs;
        size_t n_graphs;
} dl_ctx;

static dl_ctx *ctx_of(tsr_backend *be) { return be->ctx; }

/* The CUDA backend's length class of a sequence of n tokens (its attention's key splits). */
static unsigned length_class(size_t n) {
        size_t c = (n + 127) / 128;
        return c == 0 ? 1 : c < 32 ? (unsigned)c : 32;
}

static dl_graph *graph_find(dl_ctx *c, uint64_t key, unsigned cls) {
        for (size_t i = 0; i < c->n_graphs; i++)
                if (c->graphs[i].key == key && c->graphs[i].cls == cls)
                        return &c->graphs[i];
        return NULL;
}

static void graphs_drop(dl_ctx *c) {
        for (size_t i = 0; i < c->n_graphs; i++)
                free(c->graphs[i].recs);
        c->n_graphs = 0;
}

static void dl_ctx_free(void *p) {
        dl_ctx *c = p;
        if (!c)
                return;
        graphs_drop(c);
        free(c->graphs);
        free(c->run);
        free(c->arena);
        free(c);
}

/* A new zeroed record of op for this run, or NULL (the run failed: out of memory). */
static dl_rec *rec_new(dl_ctx *c, int op) {
        if (c->n_run == c->cap_run) {
                size_t cap = c->cap_run ? 2 * c->cap_run : 256;
                dl_rec *p = realloc(c->run, cap * sizeof *p);
                if (!p) {
                        c->failed = true;
                        return NULL;
                }
                c->run = p;
                c->cap_run = cap;
        }
        dl_rec *r = &c->run[c->n_run++];
        memset(r, 0, sizeof *r);
        r->op = op;
        return r;
}

/* Copy a (n,) into the arena for r. */
static void rec_index(dl_ctx *c, dl_rec *r, const uint32_t *a, size_t n) {
        if (c->n_arena + n > c->cap_arena) {
                size_t cap = c->cap_arena ? 2 * c->cap_arena : 4096;
                while (cap < c->n_arena + n)
                        cap *= 2;
                uint32_t *p = realloc(c->arena, cap * sizeof *p);
                if (!p) {
                        c->failed = true;
                        return;
                }
                c->arena = p;
                c->cap_arena = cap;
        }
        if (n)
                memcpy(c->arena + c->n_arena, a, n * sizeof *a);
        r->idx_off = c->n_arena;
        r->idx_n = n;
        c->n_arena += n;
}

/* Whether two records are the same op on the same memory with the same sizes and scalars
 * (their index arrays' values aside), field by field. */
static bool rec_same(const dl_rec *x, const dl_rec *y) {
        const tsr_kv_view *a = &x->kv, *b = &y->kv;
        return x->op == y->op && x->out == y->out && x->inout == y->inout && x->a == y->a && x->b == y->b &&
               x->w == y->w && x->dtype == y->dtype && x->scales.weight == y->scales.weight &&
               x->scales.input == y->scales.input && x->layout == y->layout && x->n1 == y->n1 && x->n2 == y->n2 &&
               x->n3 == y->n3 && memcmp(&x->f, &y->f, sizeof x->f) == 0 && x->idx_off == y->idx_off &&
               x->idx_n == y->idx_n && a->k == b->k && a->v == b->v && a->dtype == b->dtype &&
               a->k_scale == b->k_scale && a->v_scale == b->v_scale && a->n_table == b->n_table &&
               a->n_blocks == b->n_blocks && a->block_size == b->block_size && a->n_kv_heads == b->n_kv_heads &&
               a->head_dim == b->head_dim;
}

/* ---- graphs ------------------------------------------------------------------------------ */

static tsr_status dl_graph_begin(tsr_backend *be, uint64_t key, tsr_graph_mode mode, uint32_t table_width,
                                 uint32_t max_len) {
        dl_ctx *c = ctx_of(be);
        if (c->state != DL_OFF || table_width == 0 || max_len == 0)
                return TSR_E_INVAL;
        if (mode == TSR_GRAPH_REPLAY && !graph_find(c, key, length_class(max_len)))
                return TSR_E_NOTFOUND;
        c->state = mode == TSR_GRAPH_CAPTURE ? DL_CAPTURE : DL_REPLAY;
        c->failed = false;
        c->key = key;
        c->cls = length_class(max_len);
        c->width = table_width;
        c->n_run = 0;
        c->n_arena = 0;
        return TSR_OK;
}

/* The records of this run in order through the reference kernels. */
static tsr_status run_records(tsr_backend *be, const tsr_backend_ops *ref) {
        dl_ctx *c = ctx_of(be);
        tsr_status st = TSR_OK;
        for (size_t i = 0; i < c->n_run && st == TSR_OK; i++) {
                dl_rec *r = &c->run[i];
                const uint32_t *idx = c->arena + r->idx_off;
                tsr_kv_view kv = r->kv;         /* kv ops: idx = past_len, then the table */
                kv.block_table = idx + 1;
                switch (r->op) {
                case DL_RMSNORM: st = ref->rmsnorm(be, r->out, r->a, r->b, r->n1, r->n2, r->f); break;
                case DL_ADD_RMSNORM: st = ref->add_rmsnorm(be, r->out, r->inout, r->a, r->b, r->n1, r->n2, r->f); break;
                case DL_EMBEDDING: st = ref->embedding(be, r->out, r->w, r->dtype, r->n1, r->n2, idx, r->idx_n); break;
                case DL_MATMUL: st = ref->matmul(be, r->out, r->a, r->w, r->dtype, r->n1, r->n2, r->n3); break;
                case DL_MATMUL_SCALED:
                        st = ref->matmul_scaled(be, r->out, r->a, r->w, r->dtype, &r->scales, r->n1, r->n2, r->n3);
                        break;
                case DL_ROPE: st = ref->rope(be, r->inout, r->n1, r->n2, r->n3, idx, r->a, r->layout); break;
                case DL_KV_WRITE: st = ref->kv_write(be, &kv, r->a, r->b, r->n1, idx[0]); break;
                case DL_ATTENTION: st = ref->attention(be, r->out, r->a, &kv, r->n1, idx[0], r->n3, r->f); break;
                case DL_SILU_MUL: st = ref->silu_mul(be, r->out, r->a, r->b, r->n1); break;
                case DL_ADD: st = ref->add(be, r->out, r->a, r->b, r->n1); break;
                case DL_SOFTMAX: st = ref->softmax(be, r->out, r->a, r->n1, r->n2); break;
                case DL_LOG_SOFTMAX: st = ref->log_softmax(be, r->out, r->a, r->n1, r->n2); break;
                case DL_COPY: st = ref->copy(be, r->out, r->a, r->n1); break;
                default: st = TSR_E_INTERNAL;
                }
        }
        return st;
}

static tsr_status dl_graph_end(tsr_backend *be, bool launch, bool *launched) {
        dl_ctx *c = ctx_of(be);
        if (c->state == DL_OFF)
                return TSR_E_INVAL;
        bool capture = c->state == DL_CAPTURE, ok = !c->failed;
        c->state = DL_OFF;
        dl_graph *g = graph_find(c, c->key, c->cls);
        if (capture) {
                if (g) {                /* the key's old recording goes either way */
                        free(g->recs);
                        *g = c->graphs[--c->n_graphs];
                }
                dl_graph *p = ok ? realloc(c->graphs, (c->n_graphs + 1) * sizeof *p) : NULL;
                dl_rec *recs = p ? malloc((c->n_run ? c->n_run : 1) * sizeof *recs) : NULL;
                if (p)
                        c->graphs = p;
                if (!recs)
                        return ok ? TSR_E_NOMEM : TSR_OK;
                memcpy(recs, c->run, c->n_run * sizeof *recs);
                c->graphs[c->n_graphs++] = (dl_graph){.key = c->key, .cls = c->cls, .recs = recs, .n = c->n_run};
        } else {
                ok = ok && g && g->n == c->n_run;
                for (size_t i = 0; ok && i < c->n_run; i++)
                        ok = rec_same(&g->recs[i], &c->run[i]);
        }
        if (!ok || !launch)
                return TSR_OK;
        tsr_status st = run_records(be, tsr_backend_ref_ops());
        *launched = st == TSR_OK;
        return st;
}

static bool dl_graph_has(tsr_backend *be, uint64_t key, uint32_t max_len) {
        return graph_find(ctx_of(be), key, length_class(max_len ? max_len : 1)) != NULL;
}

static void dl_graph_drop(tsr_backend *be) {
        if (ctx_of(be)->state == DL_OFF)
                graphs_drop(ctx_of(be));
}

/* ---- memory: refused inside a graph run (kernels.h), else the host's -------------------- */

#define IN_GRAPH(be) (ctx_of(be)->state != DL_OFF)

static tsr_status dl_mem_alloc(tsr_backend *be, size_t bytes, void **ret) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_host_alloc(be, bytes, ret);
}

static tsr_status dl_upload(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_host_copy(be, dst, src, bytes);
}

static tsr_status dl_sync(tsr_backend *be) { return IN_GRAPH(be) ? TSR_E_INVAL : TSR_OK; }

static tsr_status dl_zero(tsr_backend *be, void *p, size_t bytes) {
        if (IN_GRAPH(be))
                return TSR_E_UNSUPPORTED;
        memset(p, 0, bytes);
        return TSR_OK;
}

static tsr_status dl_copy(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_host_copy(be, dst, src, bytes);
        if ((r = rec_new(ctx_of(be), DL_COPY))) {
                r->out = dst;
                r->a = src;
                r->n1 = bytes;
        }
        return TSR_OK;
}

/* ---- ops: the reference's checks and kernels outside a run, records inside ------------- */

static tsr_status dl_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                             float eps) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->rmsnorm(be, out, x, w, rows, dim, eps);
        if (!out || !x || !w || dim == 0)
                return TSR_E_INVAL;
        if ((r = rec_new(ctx_of(be), DL_RMSNORM)))
                *r = (dl_rec){.op = DL_RMSNORM, .out = out, .a = x, .b = w, .n1 = rows, .n2 = dim, .f = eps};
        return TSR_OK;
}

static tsr_status dl_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                 size_t rows, size_t dim, float eps) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->add_rmsnorm(be, out, residual, x, w, rows, dim, eps);
        if (!out || !residual || !x || !w || dim == 0)
                return TSR_E_INVAL;
        if ((r = rec_new(ctx_of(be), DL_ADD_RMSNORM)))
                *r = (dl_rec){.op = DL_ADD_RMSNORM, .out = out, .inout = residual, .a = x, .b = w, .n1 = rows, .n2 = dim,
                              .f = eps};
        return TSR_OK;
}

static tsr_status dl_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                               size_t dim, const uint32_t *ids, size_t rows) {
        dl_ctx *c = ctx_of(be);
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->embedding(be, out, table, dtype, vocab, dim, ids, rows);
        if (!out || !table || (!ids && rows) || dim == 0)
                return TSR_E_INVAL;
        for (size_t i = 0; i < rows; i++)
                if (ids[i] >= vocab)
                        return TSR_E_INVAL;
        if ((r = rec_new(c, DL_EMBEDDING))) {
                *r = (dl_rec){.op = DL_EMBEDDING, .out = out, .w = table, .dtype = dtype, .n1 = vocab, .n2 = dim};
                rec_index(c, r, ids, rows);
        }
        return TSR_OK;
}

static tsr_status dl_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype, size_t rows,
                            size_t n, size_t d) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->matmul(be, out, x, w, w_dtype, rows, n, d);
        if (!out || !x || !w || n == 0 || d == 0)
                return TSR_E_INVAL;
        if ((r = rec_new(ctx_of(be), DL_MATMUL)))
                *r = (dl_rec){.op = DL_MATMUL, .out = out, .a = x, .w = w, .dtype = w_dtype, .n1 = rows, .n2 = n, .n3 = d};
        return TSR_OK;
}

static tsr_status dl_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                   const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->matmul_scaled(be, out, x, w, w_dtype, s, rows, n, d);
        if (!out || !x || !w || !s || n == 0 || d == 0)
                return TSR_E_INVAL;
        if ((r = rec_new(ctx_of(be), DL_MATMUL_SCALED)))
                *r = (dl_rec){.op = DL_MATMUL_SCALED, .out = out, .a = x, .w = w, .dtype = w_dtype, .scales = *s,
                              .n1 = rows, .n2 = n, .n3 = d};
        return TSR_OK;
}

static tsr_status dl_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim, const uint32_t *pos,
                          const float *inv_freq, tsr_rope_layout layout) {
        dl_ctx *c = ctx_of(be);
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->rope(be, x, rows, n_heads, head_dim, pos, inv_freq, layout);
        if (!x || !pos || !inv_freq || head_dim == 0 || head_dim % 2 != 0)
                return TSR_E_INVAL;
        if ((r = rec_new(c, DL_ROPE))) {
                *r = (dl_rec){.op = DL_ROPE, .inout = x, .a = inv_freq, .layout = layout, .n1 = rows, .n2 = n_heads,
                              .n3 = head_dim};
                rec_index(c, r, pos, rows);
        }
        return TSR_OK;
}

/* A kv op's record: the view by value, and in the arena the sequence's past_len (a
 * scalar here, part of the rows array on CUDA: it changes every step) then its block
 * table, `width` entries whatever the sequence's length (the CUDA backend's layout); a
 * sequence with more blocks, or longer than the run's length class, fails the run. */
static dl_rec *kv_rec(dl_ctx *c, int op, const tsr_kv_view *kv, size_t past_len, size_t n) {
        size_t end = past_len + n, used = kv->block_size ? (end + kv->block_size - 1) / kv->block_size : 0;
        dl_rec *r = rec_new(c, op);
        if (!r)
                return NULL;
        if (used > c->width || used > kv->n_table || length_class(end) > c->cls || past_len > UINT32_MAX)
                c->failed = true;
        r->kv = *kv;
        r->kv.block_table = NULL;
        r->kv.n_table = c->width;
        uint32_t *t = calloc((size_t)c->width + 1, sizeof *t);
        if (!t) {
                c->failed = true;
                return r;
        }
        t[0] = (uint32_t)past_len;
        memcpy(t + 1, kv->block_table, (used < c->width ? used : c->width) * sizeof *t);
        rec_index(c, r, t, (size_t)c->width + 1);
        free(t);
        return r;
}

static tsr_status dl_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                              size_t past_len) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->kv_write(be, kv, k, v, n, past_len);
        if (!kv || !k || !v || !kv->block_table || kv->block_size == 0)
                return TSR_E_INVAL;
        if ((r = kv_rec(ctx_of(be), DL_KV_WRITE, kv, past_len, n))) {
                r->a = k;
                r->b = v;
                r->n1 = n;
        }
        return TSR_OK;
}

static tsr_status dl_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                               size_t past_len, size_t n_heads, float scale) {
        dl_rec *r;
        if (!IN_GRAPH(be))
                return tsr_backend_ref_ops()->attention(be, out, q, kv, n, past_len, n_heads, scale);
        if (!out || !q || !kv || !kv->block_table || kv->block_size == 0 || n_heads == 0)
                return TSR_E_INVAL;
        if ((r = kv_rec(ctx_of(be), DL_ATTENTION, kv, past_len, n))) {
                r->out = out;
                r->a = q;
                r->n1 = n;
                r->n3 = n_heads;
                r->f = scale;
        }
        return TSR_OK;
}

/* silu_mul, add, softmax and log_softmax: one shape of record each. */
static tsr_status dl_ew(tsr_backend *be, int op, float *out, const float *a, const float *b, size_t n1, size_t n2) {
        dl_rec *r;
        if (!out || !a || (!b && (op == DL_SILU_MUL || op == DL_ADD)))
                return TSR_E_INVAL;
        if ((r = rec_new(ctx_of(be), op)))
                *r = (dl_rec){.op = op, .out = out, .a = a, .b = b, .n1 = n1, .n2 = n2};
        return TSR_OK;
}

static tsr_status dl_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n) {
        return IN_GRAPH(be) ? dl_ew(be, DL_SILU_MUL, out, gate, up, n, 0)
                            : tsr_backend_ref_ops()->silu_mul(be, out, gate, up, n);
}

static tsr_status dl_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        return IN_GRAPH(be) ? dl_ew(be, DL_ADD, out, a, b, n, 0) : tsr_backend_ref_ops()->add(be, out, a, b, n);
}

/* gather_rows, scatter_add_rows, relu_sq, round_bf16 and mamba_mixer: eager only (no family records
 * them in a graph yet; the CUDA backend refuses them there too). */
static tsr_status dl_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                 const uint32_t *idx, const float *scales, size_t n) {
        return IN_GRAPH(be) ? TSR_E_UNSUPPORTED
                            : tsr_backend_ref_ops()->gather_rows(be, out, x, rows, dim, idx, scales, n);
}

static tsr_status dl_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                      const uint32_t *idx, const float *scales, size_t n) {
        return IN_GRAPH(be) ? TSR_E_UNSUPPORTED
                            : tsr_backend_ref_ops()->scatter_add_rows(be, dst, rows, dim, src, idx, scales, n);
}

static tsr_status dl_relu_sq(tsr_backend *be, float *x, size_t n) {
        return IN_GRAPH(be) ? TSR_E_UNSUPPORTED : tsr_backend_ref_ops()->relu_sq(be, x, n);
}

static tsr_status dl_round_bf16(tsr_backend *be, float *x, size_t n) {
        return IN_GRAPH(be) ? TSR_E_UNSUPPORTED : tsr_backend_ref_ops()->round_bf16(be, x, n);
}

static tsr_status dl_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                                 const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                                 const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves, size_t n_leaves) {
        return IN_GRAPH(be) ? TSR_E_UNSUPPORTED
                            : tsr_backend_ref_ops()->mamba_mixer(be, d, w, proj, rows, conv, ssm, n_slots, seqs,
                                                                 n_seqs, y, leaves, n_leaves);
}

static tsr_status dl_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return IN_GRAPH(be) ? dl_ew(be, DL_SOFTMAX, out, x, NULL, rows, n)
                            : tsr_backend_ref_ops()->softmax(be, out, x, rows, n);
}

static tsr_status dl_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        return IN_GRAPH(be) ? dl_ew(be, DL_LOG_SOFTMAX, out, x, NULL, rows, n)
                            : tsr_backend_ref_ops()->log_softmax(be, out, x, rows, n);
}

/* argmax and sample return host results: not inside a graph run (kernels.h). */
static tsr_status dl_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_ref_ops()->argmax(be, out, x, rows, n);
}

/* The rules and the logprobs read host lists and write host results: not in a graph either. */
static tsr_status dl_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_ref_ops()->logit_rules(be, x, rows, n, rules);
}

static tsr_status dl_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                              const uint32_t *tokens, const uint32_t *top) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_ref_ops()->logprobs(be, out, x, rows, n, tokens, top);
}

static tsr_status dl_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_ref_ops()->sample(be, out, x, rows, n, draws);
}

static tsr_status dl_host_tasks(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx) {
        return IN_GRAPH(be) ? TSR_E_INVAL : tsr_backend_ref_ops()->host_tasks(be, n_tasks, task, ctx);
}

static const tsr_backend_ops cpu_devlike_ops = {
        .name = "cpu-devlike",
        .host_memory = false,
        .matmul_dtypes = TSR_CPU_REF_MATMUL_DTYPES,
        .ctx_free = dl_ctx_free,
        .mem_alloc = dl_mem_alloc,
        .mem_free = tsr_backend_host_free,
        .upload = dl_upload,
        .download = dl_upload,
        .copy = dl_copy,
        .zero = dl_zero,
        .synchronize = dl_sync,
        .graph_begin = dl_graph_begin,
        .graph_end = dl_graph_end,
        .graph_has = dl_graph_has,
        .graph_drop = dl_graph_drop,
        .rmsnorm = dl_rmsnorm,
        .embedding = dl_embedding,
        .matmul = dl_matmul,
        .matmul_scaled = dl_matmul_scaled,
        .rope = dl_rope,
        .kv_write = dl_kv_write,
        .attention = dl_attention,
        .silu_mul = dl_silu_mul,
        .add = dl_add,
        .gather_rows = dl_gather_rows,
        .scatter_add_rows = dl_scatter_add_rows,
        .relu_sq = dl_relu_sq,
        .round_bf16 = dl_round_bf16,
        .mamba_mixer = dl_mamba_mixer,
        .softmax = dl_softmax,
        .log_softmax = dl_log_softmax,
        .argmax = dl_argmax,
        .sample = dl_sample,
        .logit_rules = dl_logit_rules,
        .logprobs = dl_logprobs,
        .add_rmsnorm = dl_add_rmsnorm,
        .host_tasks = dl_host_tasks,
};

tsr_status tsr_backend_cpu_devlike_new(tsr_backend **ret) {
        dl_ctx *c;
        if (!ret)
                return TSR_E_INVAL;
        if (!(c = calloc(1, sizeof *c)))
                return TSR_E_NOMEM;
        return tsr_backend_make(&cpu_devlike_ops, c, TSR_CPU_ISA_SCALAR, 1, ret);
}
