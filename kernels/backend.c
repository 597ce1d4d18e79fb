/* backend.c - kernels.h's backend handle: the wrappers every caller goes through, and the
 * host-memory functions the CPU backends share.
 *
 * A wrapper checks the handle and the op's slot (TSR_E_INVAL for NULL, TSR_E_UNSUPPORTED
 * for an op or weight dtype the backend lacks) and calls the backend's op; it touches no
 * data.  Thread: the caller's (kernels.h: one thread drives a backend at a time). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"

tsr_status tsr_backend_make(const tsr_backend_ops *ops, void *ctx, tsr_cpu_isa isa, int n_threads,
                            tsr_backend **ret) {
        tsr_backend *be = calloc(1, sizeof *be);
        if (!be) {
                if (ops->ctx_free)
                        ops->ctx_free(ctx);
                return TSR_E_NOMEM;
        }
        *be = (tsr_backend){.ops = ops, .ctx = ctx, .isa = isa, .n_threads = n_threads};
        *ret = be;
        return TSR_OK;
}

void tsr_backend_free(tsr_backend **pbe) {
        tsr_backend *be;

        if (!pbe || !*pbe)
                return;
        be = *pbe;
        if (be->ops->ctx_free)
                be->ops->ctx_free(be->ctx);
        free(be);
        *pbe = NULL;
}

const char *tsr_cpu_isa_name(tsr_cpu_isa isa) {
        switch (isa) {
        case TSR_CPU_ISA_SCALAR:
                return "scalar";
        case TSR_CPU_ISA_AVX2:
                return "avx2";
        case TSR_CPU_ISA_AVX512_BF16:
                return "avx512_bf16";
        case TSR_CPU_ISA_AMX_BF16:
                return "amx_bf16";
        }
        return "?";
}

/* ---- queries -------------------------------------------------------------------------- */

const char *tsr_backend_name(const tsr_backend *be) { return be ? be->ops->name : "?"; }

tsr_cpu_isa tsr_backend_cpu_isa(const tsr_backend *be) { return be ? be->isa : TSR_CPU_ISA_SCALAR; }

int tsr_backend_threads(const tsr_backend *be) { return be ? be->n_threads : 1; }

bool tsr_backend_host_memory(const tsr_backend *be) { return be && be->ops->host_memory; }

/* matmul_dtypes keeps one bit per dtype in a uint32_t. */
_Static_assert(TSR_DTYPE_COUNT <= 32, "tsr_backend_ops.matmul_dtypes has one bit per dtype");

/* The scaled formats go to matmul_scaled, the others to matmul. */
static bool dtype_scaled(tsr_dtype t) { return t == TSR_DTYPE_FP8_E4M3 || t == TSR_DTYPE_NVFP4; }

static bool dtype_ok(const tsr_backend *be, tsr_dtype t) {
        return (unsigned)t < TSR_DTYPE_COUNT && (be->ops->matmul_dtypes & (1u << t)) &&
               (dtype_scaled(t) ? be->ops->matmul_scaled != NULL : be->ops->matmul != NULL);
}

bool tsr_backend_supports(const tsr_backend *be, tsr_op op, tsr_dtype w_dtype) {
        if (!be)
                return false;
        const tsr_backend_ops *o = be->ops;
        switch (op) {
        case TSR_OP_RMSNORM:
                return o->rmsnorm;
        case TSR_OP_EMBEDDING:          /* a float32 or a bf16 table */
                return o->embedding && (w_dtype == TSR_DTYPE_F32 || w_dtype == TSR_DTYPE_BF16);
        case TSR_OP_MATMUL:
                return dtype_ok(be, w_dtype);
        case TSR_OP_ROPE:
                return o->rope;
        case TSR_OP_KV_WRITE:
                return o->kv_write;
        case TSR_OP_ATTENTION:
                return o->attention;
        case TSR_OP_SILU_MUL:
                return o->silu_mul;
        case TSR_OP_ADD:
                return o->add;
        case TSR_OP_SOFTMAX:
                return o->softmax;
        case TSR_OP_LOG_SOFTMAX:
                return o->log_softmax;
        case TSR_OP_ADD_RMSNORM:
                return o->add_rmsnorm;
        case TSR_OP_ARGMAX:
                return o->argmax;
        case TSR_OP_SAMPLE:
                return o->sample;
        case TSR_OP_GATHER_ROWS:
                return o->gather_rows;
        case TSR_OP_SCATTER_ADD_ROWS:
                return o->scatter_add_rows;
        case TSR_OP_RELU_SQ:
                return o->relu_sq;
        case TSR_OP_ROUND_BF16:
                return o->round_bf16;
        case TSR_OP_MAMBA_MIXER:
                return o->mamba_mixer;
        case TSR_OP_LOGIT_RULES:
                return o->logit_rules;
        case TSR_OP_LOGPROBS:
                return o->logprobs;
        case TSR_OP_COUNT:
                break;
        }
        return false;
}

/* ---- memory --------------------------------------------------------------------------- */

tsr_status tsr_backend_mem_alloc(tsr_backend *be, size_t bytes, void **ret) {
        if (!be || !ret || bytes == 0)
                return TSR_E_INVAL;
        return be->ops->mem_alloc(be, bytes, ret);
}

void tsr_backend_mem_free(tsr_backend *be, void *p) {
        if (be && p)
                be->ops->mem_free(be, p);
}

tsr_status tsr_backend_upload(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        if (!be || ((!dst || !src) && bytes))
                return TSR_E_INVAL;
        return bytes ? be->ops->upload(be, dst, src, bytes) : TSR_OK;
}

tsr_status tsr_backend_download(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        if (!be || ((!dst || !src) && bytes))
                return TSR_E_INVAL;
        return bytes ? be->ops->download(be, dst, src, bytes) : TSR_OK;
}

tsr_status tsr_backend_copy(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        if (!be || ((!dst || !src) && bytes))
                return TSR_E_INVAL;
        return bytes ? be->ops->copy(be, dst, src, bytes) : TSR_OK;
}

tsr_status tsr_backend_zero(tsr_backend *be, void *p, size_t bytes) {
        if (!be || (!p && bytes) || (!be->ops->zero && !be->ops->host_memory))
                return TSR_E_INVAL;
        if (!bytes)
                return TSR_OK;
        if (be->ops->zero)
                return be->ops->zero(be, p, bytes);
        memset(p, 0, bytes);
        return TSR_OK;
}

tsr_status tsr_backend_mem_info(tsr_backend *be, size_t *free_bytes, size_t *total_bytes) {
        if (!be || !free_bytes || !total_bytes)
                return TSR_E_INVAL;
        return be->ops->mem_info ? be->ops->mem_info(be, free_bytes, total_bytes) : TSR_E_UNSUPPORTED;
}

tsr_status tsr_backend_synchronize(tsr_backend *be) {
        if (!be)
                return TSR_E_INVAL;
        return be->ops->synchronize(be);
}

tsr_status tsr_backend_graph_begin(tsr_backend *be, uint64_t key, tsr_graph_mode mode, uint32_t table_width,
                                   uint32_t max_len) {
        if (!be || (mode != TSR_GRAPH_CAPTURE && mode != TSR_GRAPH_REPLAY))
                return TSR_E_INVAL;
        return be->ops->graph_begin ? be->ops->graph_begin(be, key, mode, table_width, max_len) : TSR_E_UNSUPPORTED;
}

tsr_status tsr_backend_graph_end(tsr_backend *be, bool launch, bool *launched) {
        if (!be || !launched)
                return TSR_E_INVAL;
        *launched = false;
        return be->ops->graph_end ? be->ops->graph_end(be, launch, launched) : TSR_E_INVAL;
}

bool tsr_backend_graph_has(tsr_backend *be, uint64_t key, uint32_t max_len) {
        return be && be->ops->graph_has && be->ops->graph_has(be, key, max_len);
}

void tsr_backend_graph_drop(tsr_backend *be) {
        if (be && be->ops->graph_drop)
                be->ops->graph_drop(be);
}

tsr_status tsr_backend_host_alloc(tsr_backend *be, size_t bytes, void **ret) {
        (void)be;
        if (bytes > SIZE_MAX - 63)
                return TSR_E_NOMEM;
        void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);    /* C11: size a multiple of the alignment */
        if (!p)
                return TSR_E_NOMEM;
        *ret = p;
        return TSR_OK;
}

void tsr_backend_host_free(tsr_backend *be, void *p) {
        (void)be;
        free(p);
}

tsr_status tsr_backend_host_copy(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        (void)be;
        memmove(dst, src, bytes);
        return TSR_OK;
}

tsr_status tsr_backend_host_sync(tsr_backend *be) {
        (void)be;
        return TSR_OK;
}

/* ---- operators ------------------------------------------------------------------------ */

#define CALL(op, ...)                                   \
        do {                                            \
                if (!be)                                \
                        return TSR_E_INVAL;             \
                if (!be->ops->op)                       \
                        return TSR_E_UNSUPPORTED;       \
                return be->ops->op(be, __VA_ARGS__);    \
        } while (0)

tsr_status tsr_backend_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                               float eps) {
        CALL(rmsnorm, out, x, w, rows, dim, eps);
}

tsr_status tsr_backend_embedding(tsr_backend *be, float *out, const void *table, tsr_dtype dtype, size_t vocab,
                                 size_t dim, const uint32_t *ids, size_t rows) {
        if (dtype != TSR_DTYPE_F32 && dtype != TSR_DTYPE_BF16)
                return TSR_E_UNSUPPORTED;
        CALL(embedding, out, table, dtype, vocab, dim, ids, rows);
}

tsr_status tsr_backend_matmul(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                              size_t rows, size_t n, size_t d) {
        if (be && !dtype_ok(be, w_dtype))
                return TSR_E_UNSUPPORTED;
        if (be && dtype_scaled(w_dtype)) {
                tsr_matmul_scales unit = {.weight = 1.0f, .input = 0.0f};
                return be->ops->matmul_scaled(be, out, x, w, w_dtype, &unit, rows, n, d);
        }
        CALL(matmul, out, x, w, w_dtype, rows, n, d);
}

tsr_status tsr_backend_matmul_scaled(tsr_backend *be, float *out, const float *x, const void *w, tsr_dtype w_dtype,
                                     const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        if (be && (!dtype_scaled(w_dtype) || !dtype_ok(be, w_dtype)))
                return TSR_E_UNSUPPORTED;
        CALL(matmul_scaled, out, x, w, w_dtype, s, rows, n, d);
}

tsr_status tsr_backend_rope(tsr_backend *be, float *x, size_t rows, size_t n_heads, size_t head_dim,
                            const uint32_t *pos, const float *inv_freq, tsr_rope_layout layout) {
        CALL(rope, x, rows, n_heads, head_dim, pos, inv_freq, layout);
}

tsr_status tsr_backend_kv_write(tsr_backend *be, const tsr_kv_view *kv, const float *k, const float *v, size_t n,
                                size_t past_len) {
        CALL(kv_write, kv, k, v, n, past_len);
}

tsr_status tsr_backend_attention(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv, size_t n,
                                 size_t past_len, size_t n_heads, float scale) {
        CALL(attention, out, q, kv, n, past_len, n_heads, scale);
}

/* Sequence i's view: the shared arrays and geometry with its own table. */
static tsr_kv_view seq_view(const tsr_kv_view *kv, const tsr_kv_seq *s) {
        tsr_kv_view v = *kv;
        v.block_table = s->block_table;
        v.n_table = s->n_table;
        return v;
}

tsr_status tsr_backend_kv_write_batch(tsr_backend *be, const tsr_kv_view *kv, const tsr_kv_seq *seqs, size_t n_seqs,
                                      const float *k, const float *v) {
        size_t width, row = 0;
        tsr_status st = TSR_OK;

        if (!be || !kv || !k || !v || (!seqs && n_seqs))
                return TSR_E_INVAL;
        if (be->ops->kv_write_batch)
                return be->ops->kv_write_batch(be, kv, seqs, n_seqs, k, v);
        if (!be->ops->kv_write)
                return TSR_E_UNSUPPORTED;
        width = kv->n_kv_heads * kv->head_dim;
        for (size_t i = 0; i < n_seqs && st == TSR_OK; row += seqs[i].n, i++) {
                tsr_kv_view sv = seq_view(kv, &seqs[i]);
                st = be->ops->kv_write(be, &sv, k + row * width, v + row * width, seqs[i].n, seqs[i].past_len);
        }
        return st;
}

tsr_status tsr_backend_attention_batch(tsr_backend *be, float *out, const float *q, const tsr_kv_view *kv,
                                       const tsr_kv_seq *seqs, size_t n_seqs, size_t n_heads, float scale) {
        size_t width, row = 0;
        tsr_status st = TSR_OK;

        if (!be || !kv || !out || !q || (!seqs && n_seqs))
                return TSR_E_INVAL;
        if (be->ops->attention_batch)
                return be->ops->attention_batch(be, out, q, kv, seqs, n_seqs, n_heads, scale);
        if (!be->ops->attention)
                return TSR_E_UNSUPPORTED;
        width = n_heads * kv->head_dim;
        for (size_t i = 0; i < n_seqs && st == TSR_OK; row += seqs[i].n, i++) {
                tsr_kv_view sv = seq_view(kv, &seqs[i]);
                st = be->ops->attention(be, out + row * width, q + row * width, &sv, seqs[i].n, seqs[i].past_len,
                                        n_heads, scale);
        }
        return st;
}

tsr_status tsr_backend_host_tasks(tsr_backend *be, size_t n_tasks, tsr_backend_task_fn task, void *ctx) {
        if (!task && n_tasks)
                return TSR_E_INVAL;
        CALL(host_tasks, n_tasks, task, ctx);
}

tsr_status tsr_backend_silu_mul(tsr_backend *be, float *out, const float *gate, const float *up, size_t n) {
        CALL(silu_mul, out, gate, up, n);
}

tsr_status tsr_backend_add(tsr_backend *be, float *out, const float *a, const float *b, size_t n) {
        CALL(add, out, a, b, n);
}

/* Whether every idx[i] (i < n) is below rows. */
static bool rows_in_range(const uint32_t *idx, size_t n, size_t rows) {
        for (size_t i = 0; i < n; i++)
                if (idx[i] >= rows)
                        return false;
        return true;
}

tsr_status tsr_backend_gather_rows(tsr_backend *be, float *out, const float *x, size_t rows, size_t dim,
                                   const uint32_t *idx, const float *scales, size_t n) {
        if (n && (!out || !x || dim == 0 || (idx ? out == x || !rows_in_range(idx, n, rows) : n > rows)))
                return TSR_E_INVAL;
        if (n == 0)
                return be ? TSR_OK : TSR_E_INVAL;
        CALL(gather_rows, out, x, rows, dim, idx, scales, n);
}

tsr_status tsr_backend_scatter_add_rows(tsr_backend *be, float *dst, size_t rows, size_t dim, const float *src,
                                        const uint32_t *idx, const float *scales, size_t n) {
        if (n && (!dst || !src || !idx || dim == 0 || !rows_in_range(idx, n, rows)))
                return TSR_E_INVAL;
        if (n == 0)
                return be ? TSR_OK : TSR_E_INVAL;
        CALL(scatter_add_rows, dst, rows, dim, src, idx, scales, n);
}

tsr_status tsr_backend_relu_sq(tsr_backend *be, float *x, size_t n) {
        if (n && !x)
                return TSR_E_INVAL;
        if (n == 0)
                return be ? TSR_OK : TSR_E_INVAL;
        CALL(relu_sq, x, n);
}

tsr_status tsr_backend_round_bf16(tsr_backend *be, float *x, size_t n) {
        if (n && !x)
                return TSR_E_INVAL;
        if (n == 0)
                return be ? TSR_OK : TSR_E_INVAL;
        CALL(round_bf16, x, n);
}

/* Marks slot in the step's bitmap; false when it was marked already. */
static bool slot_first_use(uint8_t *used, uint32_t slot) {
        uint8_t bit = (uint8_t)(1u << (slot & 7));
        if (used[slot >> 3] & bit)
                return false;
        used[slot >> 3] |= bit;
        return true;
}

/* kernels.h's conditions on one sequence of the mixer; marks its slots in used. */
static bool mamba_seq_ok(const tsr_mamba_seq *q, size_t rows, size_t n_slots, uint8_t *used) {
        if (q->n == 0 || q->row > rows || q->n > rows - q->row || q->slot >= n_slots ||
            !slot_first_use(used, q->slot) || (q->n_saves && !q->saves))
                return false;
        for (size_t k = 0; k < q->n_saves; k++) {
                const tsr_state_save *sv = &q->saves[k];
                if (sv->slot >= n_slots || sv->pos <= q->past_len || sv->pos > q->past_len + q->n ||
                    (k && sv->pos <= q->saves[k - 1].pos) || !slot_first_use(used, sv->slot))
                        return false;
        }
        return true;
}

static bool mamba_dims_ok(const tsr_mamba_dims *d, size_t n_leaves, bool leaves) {
        size_t di = d->heads * d->head_dim;
        return d->heads && d->head_dim && d->state && d->groups && d->heads % d->groups == 0 && d->conv_kernel >= 1 &&
               d->conv_kernel <= TSR_MAMBA_MAX_CONV && (d->chunk == 0 || (d->chunk >= 2 && d->chunk <= TSR_MAMBA_MAX_CHUNK)) &&
               (!leaves || (d->groups == 1 && n_leaves && di % n_leaves == 0));
}

tsr_status tsr_backend_mamba_mixer(tsr_backend *be, const tsr_mamba_dims *d, const tsr_mamba_weights *w,
                                   const float *proj, size_t rows, float *conv, float *ssm, size_t n_slots,
                                   const tsr_mamba_seq *seqs, size_t n_seqs, float *y, float *leaves,
                                   size_t n_leaves) {
        if (!d || !w || !w->conv_w || !w->dt_bias || !w->A || !w->D || (!leaves && !w->norm) || !proj || !ssm || !y ||
            (!conv && d->conv_kernel > 1) || !n_slots || (n_seqs && !seqs) || !mamba_dims_ok(d, n_leaves, leaves))
                return TSR_E_INVAL;
        uint8_t *used = calloc((n_slots + 7) / 8, 1);
        if (!used)
                return TSR_E_NOMEM;
        bool ok = true;
        for (size_t i = 0; ok && i < n_seqs; i++)
                ok = mamba_seq_ok(&seqs[i], rows, n_slots, used);
        free(used);
        if (!ok)
                return TSR_E_INVAL;
        if (n_seqs == 0)
                return be ? TSR_OK : TSR_E_INVAL;
        CALL(mamba_mixer, d, w, proj, rows, conv, ssm, n_slots, seqs, n_seqs, y, leaves, n_leaves);
}

tsr_status tsr_backend_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        CALL(softmax, out, x, rows, n);
}

tsr_status tsr_backend_log_softmax(tsr_backend *be, float *out, const float *x, size_t rows, size_t n) {
        CALL(log_softmax, out, x, rows, n);
}

tsr_status tsr_backend_sample(tsr_backend *be, uint32_t *out, float *x, size_t rows, size_t n, const tsr_draw *draws) {
        if (!out || !x || !draws || n == 0 || n > INT32_MAX)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const tsr_draw *d = &draws[r];
                if (d->temperature == 0.0f)
                        continue;
                if (!(d->temperature > 0.0f) || !isfinite(d->temperature) || !(d->top_p > 0.0f && d->top_p <= 1.0f) ||
                    !(d->min_p >= 0.0f && d->min_p <= 1.0f) || !(d->u >= 0.0 && d->u < 1.0))
                        return TSR_E_INVAL;
        }
        if (rows == 0)
                return TSR_OK;
        CALL(sample, out, x, rows, n, draws);
}

static bool ids_below(const uint32_t *ids, uint32_t k, size_t n) {
        if (k && !ids)
                return false;
        for (uint32_t i = 0; i < k; i++)
                if (ids[i] >= n)
                        return false;
        return true;
}

static bool rules_ok(const tsr_logit_rules *r, size_t n) {
        if (!ids_below(r->allowed, r->n_allowed, n) || !ids_below(r->masked, r->n_masked, n) ||
            !ids_below(r->bias_ids, r->n_bias, n) || !ids_below(r->pen_ids, r->n_pen, n) ||
            (r->n_bias && !r->bias) || (r->n_pen && !r->pen_counts))
                return false;
        for (uint32_t j = 0; j < r->n_bias; j++)
                if (!isfinite(r->bias[j]))
                        return false;
        for (uint32_t j = 0; j < r->n_pen; j++)
                if (!(r->pen_counts[j] == -1.0f || (r->pen_counts[j] >= 1.0f && isfinite(r->pen_counts[j]))))
                        return false;
        return !r->n_pen || (r->repetition > 0.0f && isfinite(r->repetition) && isfinite(r->frequency) &&
                             isfinite(r->presence));
}

tsr_status tsr_backend_logit_rules(tsr_backend *be, float *x, size_t rows, size_t n, const tsr_logit_rules *rules) {
        if (!x || !rules || n == 0 || n > INT32_MAX)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++)
                if (!rules_ok(&rules[r], n))
                        return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        CALL(logit_rules, x, rows, n, rules);
}

tsr_status tsr_backend_logprobs(tsr_backend *be, tsr_row_logprobs *out, const float *x, size_t rows, size_t n,
                                const uint32_t *tokens, const uint32_t *top) {
        if (!out || !x || !tokens || !top || n == 0 || n > INT32_MAX)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++)
                if (top[r] > TSR_LOGPROBS_TOP_MAX || top[r] > n)
                        return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        CALL(logprobs, out, x, rows, n, tokens, top);
}

tsr_status tsr_backend_argmax(tsr_backend *be, uint32_t *out, const float *x, size_t rows, size_t n) {
        if (!out || !x || n == 0 || n > INT32_MAX)
                return TSR_E_INVAL;
        if (rows == 0)
                return TSR_OK;
        CALL(argmax, out, x, rows, n);
}

tsr_status tsr_backend_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps) {
        CALL(add_rmsnorm, out, residual, x, w, rows, dim, eps);
}
