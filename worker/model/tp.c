/* tp.c - the tensor-parallel split and sums the families share (tp.h). */
#include "worker/model/tp.h"

#include <stdlib.h>
#include <string.h>

#include "common/tsr_status.h"
#include "kernels/quant/quant.h"

#include "worker/parallel/comm.h"

/* tsr_tp_keep_rows and tsr_tp_keep_col_slices on elements of `es` bytes (float32, bf16):
 * the kept ones in new 64-byte aligned memory, the old array freed. */
static tsr_status keep_rows_es(void **w, size_t es, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n) {
        size_t bytes = n_mats * n * cols * es;
        uint8_t *k = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        if (!k)
                return TSR_E_NOMEM;
        for (size_t e = 0; e < n_mats; e++)
                memcpy(k + e * n * cols * es, (const uint8_t *)*w + (e * rows + first) * cols * es, n * cols * es);
        free(*w);
        *w = k;
        return TSR_OK;
}

static tsr_status keep_col_slices_es(void **w, size_t es, size_t n_mats, size_t rows, size_t cols, size_t first,
                                     size_t n, size_t ns) {
        size_t ks = n / ns, bytes = n_mats * rows * n * es;
        uint8_t *k = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        if (!k)
                return TSR_E_NOMEM;
        for (size_t e = 0; e < n_mats; e++) {
                const uint8_t *a = (const uint8_t *)*w + e * rows * cols * es;
                uint8_t *b = k + e * rows * n * es;
                for (size_t j = 0; j < ns; j++)
                        for (size_t r = 0; r < rows; r++)
                                memcpy(b + (j * rows + r) * ks * es, a + (r * cols + first + j * ks) * es, ks * es);
        }
        free(*w);
        *w = k;
        return TSR_OK;
}

tsr_status tsr_tp_keep_rows(float **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n) {
        void *p = *w;
        tsr_status st = keep_rows_es(&p, sizeof(float), n_mats, rows, cols, first, n);
        *w = p;
        return st;
}

tsr_status tsr_tp_keep_col_slices(float **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n,
                                  size_t ns) {
        void *p = *w;
        tsr_status st = keep_col_slices_es(&p, sizeof(float), n_mats, rows, cols, first, n, ns);
        *w = p;
        return st;
}

tsr_status tsr_tp_keep_rows_bf16(uint16_t **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n) {
        void *p = *w;
        tsr_status st = keep_rows_es(&p, sizeof(uint16_t), n_mats, rows, cols, first, n);
        *w = p;
        return st;
}

tsr_status tsr_tp_keep_col_slices_bf16(uint16_t **w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n,
                                       size_t ns) {
        void *p = *w;
        tsr_status st = keep_col_slices_es(&p, sizeof(uint16_t), n_mats, rows, cols, first, n, ns);
        *w = p;
        return st;
}

tsr_status tsr_tp_keep_stored_col_slices(tsr_tensor *t, size_t first, size_t n, size_t ns) {
        const tsr_dtype_info *di = tsr_dtype_get_info(t->dtype);
        size_t rows, cols, ks, be, row_bytes, ks_bytes;
        uint8_t *k, *at;

        if (!di || t->n_dims != 2 || !t->data || ns == 0 || n % ns)
                return TSR_E_INVAL;
        rows = t->shape[0];
        cols = t->shape[1];
        ks = n / ns;
        be = di->block_elems;
        if (first > cols || n > cols - first)
                return TSR_E_INVAL;
        if (first % be || ks % be)
                return TSR_E_UNSUPPORTED;       /* a slice would cut a block */
        if (tsr_dtype_row_bytes(t->dtype, cols, &row_bytes) != TSR_OK ||
            tsr_dtype_row_bytes(t->dtype, ks, &ks_bytes) != TSR_OK)
                return TSR_E_INVAL;
        size_t bytes = ns * rows * ks_bytes;
        if (!(k = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64)))
                return TSR_E_NOMEM;
        at = k;
        for (size_t j = 0; j < ns; j++)
                for (size_t r = 0; r < rows; r++, at += ks_bytes)
                        memcpy(at, (const uint8_t *)t->data + r * row_bytes + (first + j * ks) / be * di->block_bytes,
                               ks_bytes);
        return tsr_load_stored_adopt(t, k, rows, n);
}

tsr_status tsr_tp_keep_row_ranges(float **w, size_t cols, const size_t (*ranges)[2], size_t n) {
        size_t rows = 0;
        float *k, *at;

        for (size_t i = 0; i < n; i++)
                rows += ranges[i][1];
        if (!(k = malloc(rows * cols * sizeof(float) + 1)))
                return TSR_E_NOMEM;
        at = k;
        for (size_t i = 0; i < n; at += ranges[i][1] * cols, i++)
                memcpy(at, *w + ranges[i][0] * cols, ranges[i][1] * cols * sizeof(float));
        free(*w);
        *w = k;
        return TSR_OK;
}

tsr_status tsr_tp_keep_row_ranges_of(float **f, tsr_tensor *q, size_t cols, const size_t (*ranges)[2], size_t n) {
        if (!q || !q->data)
                return tsr_tp_keep_row_ranges(f, cols, ranges, n);
        tsr_load_slice sl = {TSR_LOAD_SLICE_ROWS, (uint32_t)n, {{0}}};
        if (n > TSR_LOAD_SLICE_MAX)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++) {
                sl.range[i][0] = ranges[i][0];
                sl.range[i][1] = ranges[i][1];
        }
        return tsr_load_stored_slice(q, &sl);
}

tsr_status tsr_tp_keep_rows_of(float **f, tsr_tensor *q, size_t rows, size_t cols, size_t first, size_t n) {
        const size_t one[1][2] = {{first, n}};
        return q && q->data ? tsr_tp_keep_row_ranges_of(f, q, cols, one, 1)
                            : tsr_tp_keep_rows(f, 1, rows, cols, first, n);
}

tsr_status tsr_tp_keep_col_slices_of(float **f, tsr_tensor *q, size_t rows, size_t cols, size_t first, size_t n,
                                     size_t ns) {
        return q && q->data ? tsr_tp_keep_stored_col_slices(q, first, n, ns)
                            : tsr_tp_keep_col_slices(f, 1, rows, cols, first, n, ns);
}

tsr_status tsr_tp_check_stored_slice(const tsr_tensor *q, size_t ks, size_t ns, const char *what, size_t layer,
                                     char *err, size_t errlen) {
        if (!q || !q->data)
                return TSR_OK;
        const tsr_dtype_info *di = tsr_dtype_get_info(q->dtype);
        if (!di || ks % di->block_elems == 0)
                return TSR_OK;
        tsr_errf(err, errlen, "tensor parallelism: %s of layer %zu is %s, whose blocks of %u elements the canonical "
                 "split's %zu columns per slice would cut (%zu slices a rank)", what, layer, di->name,
                 di->block_elems, ks, ns);
        return TSR_E_UNSUPPORTED;
}

tsr_status tsr_tp_keep_vocab_rows(float **output, float **embed, size_t vocab, size_t dim, size_t first, size_t n) {
        bool tied = *output && *output == *embed;
        tsr_status st = TSR_OK;

        if (*embed && (st = tsr_tp_keep_rows(embed, 1, vocab, dim, first, n)) != TSR_OK)
                return st;
        if (tied)
                *output = *embed;
        else if (*output)
                st = tsr_tp_keep_rows(output, 1, vocab, dim, first, n);
        return st;
}

tsr_status tsr_tp_table_rows(tsr_backend *be, float *x, const float *f32, const tsr_tensor *q, size_t n_rows,
                             size_t dim, const uint32_t *ids, size_t rows) {
        size_t row_bytes;
        tsr_status st;

        if (!q || !q->data)
                return tsr_backend_embedding(be, x, f32, TSR_DTYPE_F32, n_rows, dim, ids, rows);
        if (q->dtype == TSR_DTYPE_BF16)         /* the backend widens it, in its memory */
                return tsr_backend_embedding(be, x, q->data, q->dtype, n_rows, dim, ids, rows);
        if ((st = tsr_dtype_row_bytes(q->dtype, dim, &row_bytes)) != TSR_OK)
                return st;
        for (size_t r = 0; r < rows; r++)
                if (ids[r] >= n_rows)
                        return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++)
                if ((st = tsr_dequant_row(q->dtype, (const uint8_t *)q->data + ids[r] * row_bytes, dim,
                                          x + r * dim)) != TSR_OK)
                        return st;
        return TSR_OK;
}

tsr_status tsr_tp_embed(struct tsr_comm *comm, uint32_t tp_rank, uint32_t tp_size, size_t vocab, size_t dim,
                        const uint32_t *tokens, size_t rows, float *x, tsr_tp_gather_fn gather, const void *model,
                        tsr_backend *be) {
        uint32_t *ids;
        tsr_status st;

        if (tp_size == 0 || tp_rank >= tp_size || (tp_size > 1 && !comm))
                return TSR_E_INVAL;
        tsr_tp_vocab v = tsr_tp_vocab_of(vocab, tp_rank, tp_size);
        size_t first = v.first, n = v.n;
        for (size_t r = 0; r < rows; r++)       /* every token checked before anything is read */
                if (tokens[r] >= vocab)
                        return TSR_E_INVAL;
        if (tp_size == 1)
                return gather(model, be, x, tokens, rows);
        if (!tsr_backend_host_memory(be))
                return TSR_E_UNSUPPORTED;       /* the rows are masked on the host below */
        if (!(ids = malloc(rows * sizeof *ids + 1)))
                return TSR_E_NOMEM;
        for (size_t r = 0; r < rows; r++)       /* another rank's token: row 0, overwritten below */
                ids[r] = tokens[r] - first < n ? (uint32_t)(tokens[r] - first) : 0;
        st = gather(model, be, x, ids, rows);
        free(ids);
        if (st != TSR_OK)
                return st;
        for (size_t r = 0; r < rows; r++)
                if (tokens[r] - first >= n)
                        for (size_t i = 0; i < dim; i++)
                                x[r * dim + i] = -0.0f;
        return tsr_comm_all_reduce_sum(comm, x, rows * dim, NULL);
}

tsr_status tsr_tp_check_split(uint32_t t, uint32_t n_heads, uint32_t n_kv_heads, uint32_t vocab, char *err,
                              size_t errlen) {
        if (TSR_COMM_TREE_LEAVES % t)
                tsr_errf(err, errlen, "tensor parallel size %u must divide %d (the canonical partial sums of a "
                         "row-parallel layer)", t, TSR_COMM_TREE_LEAVES);
        else if (n_heads % t)
                tsr_errf(err, errlen, "Total number of attention heads (%u) must be divisible by tensor parallel "
                         "size (%u).", n_heads, t);
        else if (n_kv_heads && (t <= n_kv_heads ? n_kv_heads % t : t % n_kv_heads))
                tsr_errf(err, errlen, "Total number of key/value heads (%u) and tensor parallel size (%u) must "
                         "divide one another.", n_kv_heads, t);
        else if (tsr_tp_vocab_of(vocab, t - 1, t).n == 0)
                tsr_errf(err, errlen, "the vocabulary (%u tokens, padded to a multiple of %d) is too small to "
                         "split over tensor parallel size %u: the last rank would hold none of it", vocab,
                         TSR_TP_VOCAB_PAD, t);
        else
                return TSR_OK;
        return TSR_E_UNSUPPORTED;
}

tsr_status tsr_tp_row_partials(tsr_backend *be, float *parts, float *slice, const float *x, const void *w,
                               tsr_dtype w_dtype, const tsr_matmul_scales *scales, size_t rows, size_t k, size_t d,
                               size_t ns) {
        size_t ks = k / ns, ks_bytes;
        bool scaled = w_dtype == TSR_DTYPE_FP8_E4M3 || w_dtype == TSR_DTYPE_NVFP4;
        tsr_status st = TSR_OK;

        if (scaled && !scales)
                return TSR_E_UNSUPPORTED;
        if (tsr_dtype_row_bytes(w_dtype, ks, &ks_bytes) != TSR_OK)
                return TSR_E_INVAL;     /* a slice that cuts a block: tsr_tp_keep_stored_col_slices refused it */
        for (size_t j = 0; j < ns && st == TSR_OK; j++) {
                const void *wj = (const char *)w + j * d * ks_bytes;
                for (size_t r = 0; r < rows; r++)
                        memcpy(slice + r * ks, x + r * k + j * ks, ks * sizeof(float));
                st = scaled ? tsr_backend_matmul_scaled(be, parts + j * rows * d, slice, wj, w_dtype, scales, rows, ks,
                                                        d)
                            : tsr_backend_matmul(be, parts + j * rows * d, slice, wj, w_dtype, rows, ks, d);
        }
        return st;
}

tsr_status tsr_tp_row_reduce(tsr_comm *comm, uint32_t tp_size, const float *parts, size_t ns, float *out,
                             size_t count) {
        const float *p[TSR_COMM_TREE_LEAVES];

        if (ns == 0 || ns > TSR_COMM_TREE_LEAVES)
                return TSR_E_INVAL;
        for (size_t j = 0; j < ns; j++)
                p[j] = parts + j * count;
        tsr_comm_tree_sum(p, (int)ns, out, count);
        if (tp_size > 1)
                return comm ? tsr_comm_all_reduce_sum(comm, out, count, NULL) : TSR_E_INVAL;
        return TSR_OK;
}

tsr_tp_vocab tsr_tp_vocab_of(size_t vocab, uint32_t tp_rank, uint32_t tp_size) {
        size_t padded = (vocab + TSR_TP_VOCAB_PAD - 1) / TSR_TP_VOCAB_PAD * TSR_TP_VOCAB_PAD;
        tsr_tp_vocab v = {0};

        if (tp_size == 0 || tp_rank >= tp_size)
                return v;
        v.per = (padded + tp_size - 1) / tp_size;       /* exact for tp_size dividing 64 */
        v.first = (size_t)tp_rank * v.per;
        v.n = v.first < vocab ? (vocab - v.first < v.per ? vocab - v.first : v.per) : 0;
        if (v.n == 0)
                v.first = vocab;
        return v;
}

tsr_status tsr_tp_gather_vocab(struct tsr_comm *comm, uint32_t tp_rank, uint32_t tp_size, size_t vocab,
                               const float *mine, float *logits, size_t rows) {
        size_t t = tp_size;
        tsr_tp_vocab v = tsr_tp_vocab_of(vocab, tp_rank, tp_size);
        float *all, *part;
        tsr_status st;

        if (!comm || tp_size == 0 || tp_rank >= tp_size)
                return TSR_E_INVAL;
        if (!(all = malloc((t + 1) * rows * v.per * sizeof(float) + 1)))
                return TSR_E_NOMEM;
        part = all + t * rows * v.per;          /* this rank's rows, padded to per columns */
        for (size_t r = 0; r < rows; r++) {
                memcpy(part + r * v.per, mine + r * v.n, v.n * sizeof(float));
                memset(part + r * v.per + v.n, 0, (v.per - v.n) * sizeof(float));
        }
        st = tsr_comm_all_gather(comm, part, all, rows * v.per * sizeof(float), NULL);
        for (size_t q = 0; st == TSR_OK && q < t; q++) {        /* (t, rows, per) -> (rows, vocab) */
                tsr_tp_vocab vq = tsr_tp_vocab_of(vocab, (uint32_t)q, tp_size);
                for (size_t r = 0; r < rows; r++)
                        memcpy(logits + r * vocab + vq.first, all + (q * rows + r) * v.per, vq.n * sizeof(float));
        }
        free(all);
        return st;
}

tsr_status tsr_tp_expert_range(size_t E, uint32_t tp_rank, uint32_t tp_size, size_t *e0, size_t *ne, char *err,
                               size_t errlen) {
        if (E < tp_size) {
                tsr_errf(err, errlen, "--enable-expert-parallel: %zu routed experts cannot be placed on %u ranks "
                         "(at least one each)", E, tp_size);
                return TSR_E_UNSUPPORTED;
        }
        *ne = E / tp_size + (tp_rank < E % tp_size);
        *e0 = tp_rank * (E / tp_size) + (tp_rank < E % tp_size ? tp_rank : E % tp_size);
        return TSR_OK;
}

tsr_status tsr_tp_shard_begin(const tsr_shard_spec *loaded, bool canonical, uint32_t tp_rank, uint32_t tp_size,
                              bool ep, bool *done, char *err, size_t errlen) {
        bool same = loaded->expert_parallel == ep && loaded->tp_rank == tp_rank && loaded->tp_size == tp_size;
        *done = false;
        if (tp_size == 0 || tp_rank >= tp_size)
                return TSR_E_INVAL;
        if (loaded->tp_size <= 1)       /* whole tensors: split once */
                return canonical ? TSR_E_INVAL : TSR_OK;
        if (same) {
                *done = canonical;
                return TSR_OK;
        }
        tsr_errf(err, errlen, "the weights were read as %s rank %u of %u's share, not %s rank %u of %u's",
                 loaded->expert_parallel ? "expert parallel" : "tensor parallel", loaded->tp_rank, loaded->tp_size,
                 ep ? "expert parallel" : "tensor parallel", tp_rank, tp_size);
        return TSR_E_INVAL;
}

tsr_load_slice tsr_tp_slice_of(const tsr_tp_slice_rule *rules, size_t n, const char *name) {
        for (size_t i = 0; i < n; i++)
                if (strcmp(rules[i].name, name) == 0)
                        return rules[i].s;
        return (tsr_load_slice){0};
}
