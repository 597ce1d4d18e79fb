/* loader.c - the one weight loader (loader.h).  One totals pass (every tensor present
 * before any work), one load pass, one progress callback, whatever the source.
 *
 * Only the per-source part differs: finding a tensor by its name in that format, and
 * checking its shape and type before converting it to float32 with tsr_ggml_dequantize
 * -- the GGUF shape is in ggml order, the safetensors one row-major, and the messages say
 * so.  Blocking file I/O plus conversion: start-up only. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kernels/quant/quant.h"
#include "worker/load/loader.h"

/* What to read: one tensor, its name in the source, its shape and where it goes. */
struct want {
        char name[160];
        uint64_t rows, cols;    /* cols == 0: a vector of `rows` elements */
        uint64_t experts;       /* > 0: a 3-D (experts, rows, cols) stack */
        float **dst;
        tsr_tensor *stored;     /* where it goes when kept in its block format; NULL: always widened */
        bool optional;
        tsr_load_slice slice;   /* a tensor-parallel rank's rows or columns (tsr_load_slot) */
        uint64_t experts_first, experts_n;      /* an expert-parallel rank's experts (tsr_load_slot) */
};

/* The experts of a stack that `w` takes: its range, or all (1 for a matrix). */
static uint64_t want_experts(const struct want *w) {
        return w->experts_n ? w->experts_n : w->experts ? w->experts : 1;
}

/* The rows and columns of one (rows, cols) matrix that w's slice keeps. */
static void slice_shape(const struct want *w, uint64_t *rows, uint64_t *cols) {
        uint64_t n = 0;
        for (uint32_t i = 0; i < w->slice.n_ranges; i++)
                n += w->slice.range[i][1];
        *rows = w->slice.axis == TSR_LOAD_SLICE_ROWS ? n : w->rows;
        *cols = w->slice.axis == TSR_LOAD_SLICE_COLS ? n : w->cols ? w->cols : 1;
}

/* Float32 elements that `w` takes of a tensor of n_elements. */
static uint64_t want_elems(const struct want *w, uint64_t n_elements) {
        uint64_t rows, cols;
        if (w->slice.axis == TSR_LOAD_WHOLE && !w->experts_n)
                return n_elements;
        if (w->slice.axis == TSR_LOAD_WHOLE)
                return n_elements / w->experts * w->experts_n;
        slice_shape(w, &rows, &cols);
        return want_experts(w) * rows * cols;
}

/* Bytes of the file's tensor (n_bytes in all) that `w` reads: the rows its slice or
 * expert range takes (a column slice reads every row of the experts it takes). */
static uint64_t want_file_bytes(const struct want *w, uint64_t n_bytes) {
        uint64_t all_rows = (w->experts ? w->experts : 1) * w->rows, rows = 0;
        if (w->slice.axis == TSR_LOAD_WHOLE && !w->experts_n)
                return n_bytes;
        if (w->slice.axis == TSR_LOAD_SLICE_ROWS)
                for (uint32_t i = 0; i < w->slice.n_ranges; i++)
                        rows += w->slice.range[i][1];
        else
                rows = w->rows;
        return all_rows ? n_bytes / all_rows * rows * want_experts(w) : n_bytes;
}

/* Whether w's slice lies inside its (rows, cols) matrix; else a message naming the tensor. */
static bool slice_ok(const struct want *w, const char *src, char *err, size_t errlen) {
        const tsr_load_slice *sl = &w->slice;
        bool rows = sl->axis == TSR_LOAD_SLICE_ROWS;
        uint64_t extent = rows ? w->rows : w->cols;
        uint32_t bad = 0;

        if (w->experts_n && (!w->experts || w->experts_first > w->experts ||
                             w->experts_n > w->experts - w->experts_first)) {
                tsr_errf(err, errlen, "%s: tensor '%s': experts [%" PRIu64 ", %" PRIu64 ") of %" PRIu64
                         ": out of range", src, w->name, w->experts_first, w->experts_first + w->experts_n,
                         w->experts);
                return false;
        }
        if (sl->axis == TSR_LOAD_WHOLE)
                return true;
        if ((rows || w->cols) && sl->n_ranges >= 1 && sl->n_ranges <= TSR_LOAD_SLICE_MAX) {
                for (bad = 0; bad < sl->n_ranges; bad++)
                        if (sl->range[bad][1] == 0 || sl->range[bad][0] > extent ||
                            sl->range[bad][1] > extent - sl->range[bad][0])
                                break;
                if (bad == sl->n_ranges)
                        return true;
        }
        if (bad >= sl->n_ranges)
                bad = 0;
        tsr_errf(err, errlen, "%s: tensor '%s': %s [%" PRIu64 ", %" PRIu64 ") of a (%" PRIu64 ", %" PRIu64 ") %s: "
                 "out of range", src, w->name, rows ? "rows" : "columns", sl->range[bad][0],
                 sl->range[bad][0] + sl->range[bad][1], w->rows, w->cols, w->cols ? "matrix" : "vector");
        return false;
}

/* Widen a tensor of ggml type `type` (the encoding; safetensors' F32 / F16 / BF16 map to
 * it) at `data` into *buf (want_elems floats): all of it in one call, or w's slice of
 * each expert's matrix range by range -- column ranges through one widened row at a
 * time -- so that only the share is ever held in float32.  TSR_E_UNSUPPORTED /
 * TSR_E_INVAL from the dequantizer, TSR_E_NOMEM. */
static tsr_status widen(uint32_t type, const void *data, uint64_t n_elements, const struct want *w, float *buf) {
        const uint8_t *p = data;
        const tsr_load_slice *sl = &w->slice;
        uint64_t cols = w->cols ? w->cols : 1, out_rows, out_cols;
        size_t row_bytes;
        float *row = NULL;
        tsr_dtype dt;
        tsr_status st;

        if (sl->axis == TSR_LOAD_WHOLE && !w->experts_n)
                return tsr_ggml_dequantize(type, data, (size_t)n_elements, buf);
        if (!tsr_ggml_dtype(type, &dt))
                return TSR_E_UNSUPPORTED;
        if ((st = tsr_dtype_row_bytes(dt, (size_t)cols, &row_bytes)) != TSR_OK)
                return st;
        if (sl->axis == TSR_LOAD_WHOLE)         /* an expert range, each expert whole */
                return tsr_ggml_dequantize(type, p + w->experts_first * w->rows * row_bytes,
                                           (size_t)(w->experts_n * w->rows * cols), buf);
        slice_shape(w, &out_rows, &out_cols);
        if (sl->axis == TSR_LOAD_SLICE_COLS && !(row = malloc((size_t)cols * sizeof(float))))
                return TSR_E_NOMEM;
        for (uint64_t e = 0; e < want_experts(w) && st == TSR_OK; e++) {
                const uint8_t *m = p + (w->experts_first + e) * w->rows * row_bytes;
                float *out = buf + e * out_rows * out_cols;
                if (sl->axis == TSR_LOAD_SLICE_ROWS) {
                        for (uint32_t i = 0; i < sl->n_ranges && st == TSR_OK; i++) {
                                st = tsr_ggml_dequantize(type, m + sl->range[i][0] * row_bytes,
                                                         (size_t)(sl->range[i][1] * cols), out);
                                out += sl->range[i][1] * cols;
                        }
                        continue;
                }
                for (uint64_t r = 0; r < w->rows && st == TSR_OK; r++) {
                        if ((st = tsr_ggml_dequantize(type, m + r * row_bytes, (size_t)cols, row)) != TSR_OK)
                                break;
                        for (uint32_t i = 0; i < sl->n_ranges; i++) {
                                memcpy(out, row + sl->range[i][0], (size_t)sl->range[i][1] * sizeof(float));
                                out += sl->range[i][1];
                        }
                }
        }
        free(row);
        return st;
}

/* A tensor of the source, format-blind: enough for the totals and the progress. */
typedef struct src_tensor {
        const tsr_gguf_tensor *gt;
        const tsr_safetensors_tensor *st;
        const char *file;               /* safetensors: the file that holds it */
        uint64_t n_bytes, n_elements;
} src_tensor;

static bool src_find(const tsr_tensor_source *s, const char *name, src_tensor *ret) {
        *ret = (src_tensor){0};
        if (s->g) {
                if (!(ret->gt = tsr_gguf_find_tensor(s->g, name)))
                        return false;
                ret->n_bytes = ret->gt->n_bytes;
                ret->n_elements = ret->gt->n_elements;
                return true;
        }
        if (!(ret->st = tsr_safetensors_set_find(s->set, name, &ret->file)))
                return false;
        ret->n_bytes = ret->st->n_bytes;
        ret->n_elements = ret->st->n_elements;
        return true;
}

bool tsr_ggml_dtype(uint32_t type, tsr_dtype *ret) {
        tsr_dtype t;

        switch (type) {
        case TSR_GGML_TYPE_F32: t = TSR_DTYPE_F32; break;
        case TSR_GGML_TYPE_F16: t = TSR_DTYPE_F16; break;
        case TSR_GGML_TYPE_BF16: t = TSR_DTYPE_BF16; break;
        case TSR_GGML_TYPE_Q8_0: t = TSR_DTYPE_Q8_0; break;
        case TSR_GGML_TYPE_Q4_0: t = TSR_DTYPE_Q4_0; break;
        case TSR_GGML_TYPE_Q4_1: t = TSR_DTYPE_Q4_1; break;
        case TSR_GGML_TYPE_Q5_0: t = TSR_DTYPE_Q5_0; break;
        case TSR_GGML_TYPE_Q5_1: t = TSR_DTYPE_Q5_1; break;
        case TSR_GGML_TYPE_Q4_K: t = TSR_DTYPE_Q4_K; break;
        case TSR_GGML_TYPE_Q5_K: t = TSR_DTYPE_Q5_K; break;
        case TSR_GGML_TYPE_Q6_K: t = TSR_DTYPE_Q6_K; break;
        default:
                return false;
        }
        *ret = t;
        return true;
}

/* The formats and their dequantization live in kernels/quant/. */
tsr_status tsr_ggml_dequantize(uint32_t type, const void *src, size_t n, float *dst) {
        tsr_dtype t;

        if (!tsr_ggml_dtype(type, &t))
                return TSR_E_UNSUPPORTED;
        return tsr_dequant_row(t, src, n, dst);
}

tsr_shard_spec tsr_shard_spec_whole(uint32_t n_layers) {
        return (tsr_shard_spec){.tp_rank = 0, .tp_size = 1, .first_layer = 0,
                                .last_layer = n_layers ? n_layers - 1 : 0};
}

/* *w->stored = the matrix or expert stack tt (its data the file's mapped bytes,
 * borrowed), or w's tensor-parallel share of it, in new 64-byte aligned memory of ours
 * (the file is unmapped after the load).  TSR_E_UNSUPPORTED when the share would cut a
 * block, TSR_E_NOMEM; *w->stored unchanged on failure. */
static tsr_status keep_stored(tsr_tensor *tt, const struct want *w) {
        if (w->slice.axis != TSR_LOAD_WHOLE) {
                tsr_tensor cut;
                tsr_status st = tsr_load_stored_cut(tt, &w->slice, &cut);
                if (st == TSR_OK)
                        *w->stored = cut;
                return st;
        }
        size_t bytes = tsr_tensor_n_bytes(tt);
        void *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!buf)
                return TSR_E_NOMEM;
        memcpy(buf, tt->data, bytes);
        tt->data = buf;
        *w->stored = *tt;
        return TSR_OK;
}

/* ---- GGUF ------------------------------------------------------------------------ */

/* Keep GGUF tensor `t` (shape checked) in its block format when `keep_dtypes` has its
 * dtype and `w` a place for it: its bytes (w's share of them) copied into 64-byte aligned
 * memory of ours (the file is unmapped after the load).  False when it is to be widened
 * instead. */
static bool gguf_keep(const tsr_gguf_tensor *t, const struct want *w, uint32_t keep_dtypes, tsr_status *st) {
        tsr_dtype dt;
        size_t shape[2] = {w->rows, w->cols};
        tsr_tensor tt;

        if (!w->stored || !w->cols || w->experts || w->experts_n || !tsr_ggml_dtype(t->type, &dt) ||
            !(keep_dtypes & (1u << dt)) ||
            tsr_tensor_init(&tt, dt, 2, shape, NULL, (void *)t->data) != TSR_OK || tsr_tensor_n_bytes(&tt) != t->n_bytes)
                return false;
        /* a column range that would cut a block is widened instead, as without keep_dtypes */
        return (*st = keep_stored(&tt, w)) != TSR_E_UNSUPPORTED;
}

/* Check `t` against `w` and dequantize it into a new array, or keep it (gguf_keep). */
static tsr_status gguf_load_one(const tsr_gguf_tensor *t, const struct want *w, const char *path,
                                uint32_t keep_dtypes, float **ret, char *err, size_t errlen) {
        uint64_t d0 = w->cols ? w->cols : w->rows, d1 = w->cols ? w->rows : 1, d2 = w->experts ? w->experts : 1;
        uint32_t want_dims = w->experts ? 3 : w->cols ? 2 : 1;
        bool ok = t->dims[0] == d0 && t->dims[1] == d1 && t->dims[2] == d2 && t->dims[3] == 1 &&
                  t->n_dims <= want_dims;
        float *buf;
        tsr_status st;

        if (!ok) {
                tsr_errf(err, errlen,
                        "%s: tensor '%s': shape [%" PRIu64 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64
                        "] (ggml order), expected [%" PRIu64 ", %" PRIu64 "]",
                        path, w->name, t->dims[0], t->dims[1], t->dims[2], t->dims[3], d0, d1);
                return TSR_E_INVAL;
        }
        if (!slice_ok(w, path, err, errlen))
                return TSR_E_INVAL;
        if (gguf_keep(t, w, keep_dtypes, &st)) {
                if (st != TSR_OK)
                        tsr_errf(err, errlen, "%s: tensor '%s': out of memory", path, w->name);
                return st;
        }
        if (t->n_elements > SIZE_MAX / sizeof(float)) {
                tsr_errf(err, errlen, "%s: tensor '%s' too large", path, w->name);
                return TSR_E_LIMIT;
        }
        buf = malloc((size_t)want_elems(w, t->n_elements) * sizeof(float));
        if (!buf) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", path, w->name);
                return TSR_E_NOMEM;
        }
        st = widen(t->type, t->data, t->n_elements, w, buf);
        if (st == TSR_E_NOMEM) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", path, w->name);
                free(buf);
                return st;
        }
        if (st != TSR_OK) {
                const char *tn = tsr_ggml_type_name(t->type);
                tsr_errf(err, errlen, "%s: tensor '%s': type %s is not supported", path, w->name, tn ? tn : "?");
                free(buf);
                return st == TSR_E_INVAL ? TSR_E_INVAL : TSR_E_UNSUPPORTED;
        }
        *ret = buf;
        return TSR_OK;
}

tsr_status tsr_load_stored_cut(const tsr_tensor *t, const tsr_load_slice *s, tsr_tensor *ret) {
        const tsr_dtype_info *di = tsr_dtype_get_info(t->dtype);
        bool rows = s->axis == TSR_LOAD_SLICE_ROWS, stack = t->n_dims == 3;
        /* a stack [E, rows, cols]: the same share of each of its E matrices */
        size_t E = stack ? t->shape[0] : 1, n_rows = t->shape[stack ? 1 : 0], n_cols = t->shape[stack ? 2 : 1];
        size_t total = 0;
        size_t row_bytes, piece_bytes, be;
        uint8_t *k, *at;

        if (!di || (t->n_dims != 2 && t->n_dims != 3) || !t->data || s->axis == TSR_LOAD_WHOLE || s->n_ranges < 1 ||
            s->n_ranges > TSR_LOAD_SLICE_MAX)
                return TSR_E_INVAL;
        be = di->block_elems;
        for (uint32_t i = 0; i < s->n_ranges; i++) {
                uint64_t first = s->range[i][0], n = s->range[i][1], extent = rows ? n_rows : n_cols;
                if (n == 0 || first > extent || n > extent - first)
                        return TSR_E_INVAL;
                if (!rows && (first % be || n % be))
                        return TSR_E_UNSUPPORTED;       /* a block would be cut */
                total += (size_t)n;
        }
        if (tsr_dtype_row_bytes(t->dtype, n_cols, &row_bytes) != TSR_OK ||
            tsr_dtype_row_bytes(t->dtype, rows ? n_cols : total, &piece_bytes) != TSR_OK)
                return TSR_E_INVAL;
        size_t bytes = E * (rows ? total : n_rows) * piece_bytes;
        if (!(k = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64)))
                return TSR_E_NOMEM;
        at = k;
        for (size_t e = 0; e < E; e++) {
                const uint8_t *m = (const uint8_t *)t->data + e * n_rows * row_bytes;
                if (rows) {
                        for (uint32_t i = 0; i < s->n_ranges; at += s->range[i][1] * row_bytes, i++)
                                memcpy(at, m + s->range[i][0] * row_bytes, s->range[i][1] * row_bytes);
                } else {
                        for (size_t r = 0; r < n_rows; r++)
                                for (uint32_t i = 0; i < s->n_ranges; i++) {
                                        size_t off = (size_t)s->range[i][0] / be * di->block_bytes,
                                               len = (size_t)s->range[i][1] / be * di->block_bytes;
                                        memcpy(at, m + r * row_bytes + off, len);
                                        at += len;
                                }
                }
        }
        size_t shape[3] = {E, rows ? total : n_rows, rows ? n_cols : total};
        if (tsr_tensor_init(ret, t->dtype, t->n_dims, stack ? shape : shape + 1, t->backend, k) != TSR_OK) {
                free(k);
                return TSR_E_INVAL;
        }
        ret->scales = t->scales;
        return TSR_OK;
}

tsr_status tsr_load_stored_slice(tsr_tensor *t, const tsr_load_slice *s) {
        tsr_tensor cut;
        tsr_status st = tsr_load_stored_cut(t, s, &cut);
        if (st == TSR_OK) {
                free(t->data);
                *t = cut;
        }
        return st;
}

/* tsr_load_stored_adopt for a tensor of n_dims dimensions `shape`. */
static tsr_status stored_adopt(tsr_tensor *t, void *data, size_t n_dims, const size_t *shape) {
        tsr_tensor nt;
        if (tsr_tensor_init(&nt, t->dtype, n_dims, shape, t->backend, data) != TSR_OK) {
                free(data);
                return TSR_E_INVAL;
        }
        nt.scales = t->scales;
        free(t->data);
        *t = nt;
        return TSR_OK;
}

tsr_status tsr_load_stored_adopt(tsr_tensor *t, void *data, size_t rows, size_t cols) {
        size_t shape[2] = {rows, cols};
        return stored_adopt(t, data, 2, shape);
}

/* Keep experts [first, first + n) of a 3-D stack [E, rows, cols] kept as stored (its
 * data from aligned_alloc), the scales kept: an expert-parallel rank's, which
 * slice_ok checked are inside the stack.  TSR_E_NOMEM (*t unchanged). */
static tsr_status stored_keep_experts(tsr_tensor *t, uint64_t first, uint64_t n) {
        size_t per = tsr_tensor_n_bytes(t) / t->shape[0], bytes = (size_t)n * per;
        uint8_t *k = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        if (!k)
                return TSR_E_NOMEM;
        memcpy(k, (const uint8_t *)t->data + (size_t)first * per, bytes);
        size_t shape[3] = {(size_t)n, t->shape[1], t->shape[2]};
        return stored_adopt(t, k, 3, shape);
}

/* ---- safetensors ----------------------------------------------------------------- */

/* The ggml tag with the same element encoding, so tsr_ggml_dequantize converts it. */
static bool hf_ggml_type(tsr_safetensors_dtype d, uint32_t *ret) {
        switch (d) {
        case TSR_ST_F32: *ret = TSR_GGML_TYPE_F32; return true;
        case TSR_ST_F16: *ret = TSR_GGML_TYPE_F16; return true;
        case TSR_ST_BF16: *ret = TSR_GGML_TYPE_BF16; return true;
        default: return false;
        }
}

/* A quantized linear weight of a ModelOpt checkpoint (F8_E4M3 or U8), kept as stored
 * with its scales where the slot can hold it; a dtype the config does not announce, or a
 * quantized tensor where the family reads float32 only, is refused naming the tensor. */
static tsr_status hf_load_quantized(const tsr_tensor_source *s, const tsr_safetensors_tensor *t, const char *file,
                                    const struct want *w, char *err, size_t errlen) {
        char module[sizeof w->name];
        size_t n = strlen(w->name);

        if ((w->experts_n && !(w->stored && w->experts)) || (w->slice.axis != TSR_LOAD_WHOLE && !w->stored)) {
                /* runner.c refuses ModelOpt at tp > 1 first for the families without it */
                tsr_errf(err, errlen, "%s: tensor '%s': a tensor-parallel share of a quantized (%s) weight is not "
                         "supported", file, w->name, tsr_safetensors_dtype_name(t->dtype));
                return TSR_E_UNSUPPORTED;
        }
        if (!s->modelopt) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s, which the checkpoint's config does not announce "
                         "(no quantization_config in config.json, no hf_quant_config.json)", file, w->name,
                         tsr_safetensors_dtype_name(t->dtype));
                return TSR_E_INVAL;
        }
        /* an expert stack in the BMM layout (Llama 4's FP8): read whole, then only the
         * rank's experts (expert parallel) or the share of each expert (tensor parallel)
         * kept, one stack at a time */
        if (w->stored && w->experts) {
                if (!slice_ok(w, file, err, errlen))
                        return TSR_E_INVAL;
                tsr_status st = tsr_modelopt_load_stack(s->modelopt, s->set, w->name, t, file, w->experts, w->rows,
                                                        w->cols, w->stored, err, errlen);
                if (st == TSR_OK && w->experts_n && (st = stored_keep_experts(w->stored, w->experts_first,
                                                                              w->experts_n)) != TSR_OK) {
                        tsr_errf(err, errlen, "%s: tensor '%s': %s", file, w->name,
                                 st == TSR_E_NOMEM ? "out of memory" : "its expert range is not a tensor");
                        free(w->stored->data);
                        *w->stored = (tsr_tensor){0};
                }
                if (st == TSR_OK && w->slice.axis != TSR_LOAD_WHOLE &&
                    (st = tsr_load_stored_slice(w->stored, &w->slice)) != TSR_OK) {
                        tsr_errf(err, errlen, "%s: tensor '%s': %s", file, w->name,
                                 st == TSR_E_NOMEM ? "out of memory" : "its tensor-parallel share is out of the stack");
                        free(w->stored->data);
                        *w->stored = (tsr_tensor){0};
                }
                return st;
        }
        if (!w->stored || !w->cols || w->experts || n < 7 || strcmp(w->name + n - 7, ".weight") != 0) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s: this model reads the tensor as float32 only "
                         "(quantized weights are supported for the linear layers of the Llama, Llama 4 and "
                         "NemotronH families)", file, w->name, tsr_safetensors_dtype_name(t->dtype));
                return TSR_E_UNSUPPORTED;
        }
        if (!slice_ok(w, file, err, errlen))
                return TSR_E_INVAL;
        snprintf(module, sizeof module, "%.*s", (int)(n - 7), w->name);
        tsr_status st = tsr_modelopt_load_weight(s->modelopt, s->set, module, t, file, w->rows, w->cols, w->stored,
                                                 err, errlen);
        /* A tensor-parallel share: the whole tensor as stored (one tensor, never the
         * model), then only the share kept */
        if (st == TSR_OK && w->slice.axis != TSR_LOAD_WHOLE && (st = tsr_load_stored_slice(w->stored, &w->slice)) !=
                                                                        TSR_OK) {
                const tsr_dtype_info *di = tsr_dtype_get_info(w->stored->dtype);
                if (st == TSR_E_NOMEM)
                        tsr_errf(err, errlen, "%s: tensor '%s': out of memory", file, w->name);
                else
                        tsr_errf(err, errlen, "%s: tensor '%s': its tensor-parallel share (%s %" PRIu64 "..%" PRIu64
                                 ") does not fall on whole %s blocks of %u elements", file, w->name,
                                 w->slice.axis == TSR_LOAD_SLICE_ROWS ? "rows" : "columns", w->slice.range[0][0],
                                 w->slice.range[0][0] + w->slice.range[0][1] - 1, di ? di->name : "?",
                                 di ? di->block_elems : 0);
                free(w->stored->data);
                *w->stored = (tsr_tensor){0};
        }
        return st;
}

/* Check `t` (from `file`) against `w` and convert it into a new float32 array, or, with
 * keep_bf16, keep a BF16 matrix or expert stack whose slot has `stored` as it is
 * (tsr_tensor_source). */
static tsr_status hf_load_one(const tsr_safetensors_tensor *t, const char *file, const struct want *w,
                              bool keep_bf16, float **ret, char *err, size_t errlen) {
        uint32_t gtype;
        float *buf;

        if (!hf_ggml_type(t->dtype, &gtype)) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s is not supported (F32, F16 and BF16 are)", file,
                        w->name, tsr_safetensors_dtype_name(t->dtype));
                return TSR_E_UNSUPPORTED;
        }
        /* A 3-D [experts, rows, cols] tensor is a Llama 4 expert stack; [rows, 1, cols] is
         * (rows, cols) too: a depthwise conv1d weight (Mamba's conv1d). */
        bool ok = w->experts ? t->n_dims == 3 && t->shape[0] == w->experts && t->shape[1] == w->rows &&
                                       t->shape[2] == w->cols
                  : w->cols  ? (t->n_dims == 2 && t->shape[0] == w->rows && t->shape[1] == w->cols) ||
                                      (t->n_dims == 3 && t->shape[0] == w->rows && t->shape[1] == 1 &&
                                       t->shape[2] == w->cols)
                             : t->n_dims == 1 && t->shape[0] == w->rows;
        if (!ok) {
                char got[160] = "[", want[64];
                size_t n = 1;
                for (uint32_t i = 0; i < t->n_dims && n < sizeof got; i++)
                        n += (size_t)snprintf(got + n, sizeof got - n, "%s%" PRIu64, i ? ", " : "", t->shape[i]);
                if (n < sizeof got - 1)
                        snprintf(got + n, sizeof got - n, "]");
                if (w->experts)
                        snprintf(want, sizeof want, "[%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]", w->experts, w->rows,
                                 w->cols);
                else if (w->cols)
                        snprintf(want, sizeof want, "[%" PRIu64 ", %" PRIu64 "]", w->rows, w->cols);
                else
                        snprintf(want, sizeof want, "[%" PRIu64 "]", w->rows);
                tsr_errf(err, errlen, "%s: tensor '%s': shape %s, expected %s", file, w->name, got, want);
                return TSR_E_INVAL;
        }
        if (!slice_ok(w, file, err, errlen))
                return TSR_E_INVAL;
        if (keep_bf16 && t->dtype == TSR_ST_BF16 && w->stored && w->cols && t->n_dims == (w->experts ? 3 : 2)) {
                /* an expert stack [E, rows, cols]: only the experts taken (an expert-parallel
                 * rank's), viewed in the file, then the share of each cut from them */
                uint64_t E = want_experts(w), per = w->rows * w->cols * 2;
                size_t shape[3] = {E, w->rows, w->cols};
                const uint8_t *at = (const uint8_t *)t->data + (w->experts_n ? w->experts_first * per : 0);
                tsr_tensor tt;
                tsr_status st = w->experts ? tsr_tensor_init(&tt, TSR_DTYPE_BF16, 3, shape, NULL, (void *)at)
                                           : tsr_tensor_init(&tt, TSR_DTYPE_BF16, 2, shape + 1, NULL, (void *)at);
                if (st == TSR_OK)
                        st = keep_stored(&tt, w);
                if (st != TSR_OK)
                        tsr_errf(err, errlen, "%s: tensor '%s': %s", file, w->name,
                                 st == TSR_E_NOMEM ? "out of memory" : "cannot keep it as stored");
                return st;
        }
        if (t->n_elements > SIZE_MAX / sizeof(float)) {
                tsr_errf(err, errlen, "%s: tensor '%s' too large", file, w->name);
                return TSR_E_LIMIT;
        }
        buf = malloc((size_t)want_elems(w, t->n_elements) * sizeof(float));
        if (!buf) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", file, w->name);
                return TSR_E_NOMEM;
        }
        /* Safetensors data is little-endian and only byte-aligned: the dequantizer reads
         * it byte-wise (F16/BF16) or with memcpy (F32). */
        tsr_status st = widen(gtype, t->data, t->n_elements, w, buf);
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "%s: tensor '%s': %s", file, w->name,
                         st == TSR_E_NOMEM ? "out of memory" : "conversion failed");
                free(buf);
                return st == TSR_E_NOMEM ? st : TSR_E_INTERNAL;
        }
        *ret = buf;
        return TSR_OK;
}

/* Bytes of the file that loading t for w reads: a ModelOpt weight is read whole, then
 * cut to its share (hf_load_quantized), the others as want_file_bytes says. */
static uint64_t src_read_bytes(const tsr_tensor_source *s, const src_tensor *t, const struct want *w) {
        if (!s->g && tsr_modelopt_weight_dtype(t->st->dtype))
                return t->n_bytes;
        return want_file_bytes(w, t->n_bytes);
}

static tsr_status src_load_one(const tsr_tensor_source *s, const src_tensor *t, const struct want *w, char *err,
                               size_t errlen) {
        if (!s->g && tsr_modelopt_weight_dtype(t->st->dtype))
                return hf_load_quantized(s, t->st, t->file, w, err, errlen);
        return s->g ? gguf_load_one(t->gt, w, s->src, s->keep_dtypes, w->dst, err, errlen)
                    : hf_load_one(t->st, t->file, w, s->keep_bf16, w->dst, err, errlen);
}

/* ---- the loader ------------------------------------------------------------------ */

/* Drop the file pages of tensor t, just read from s, from the process's resident set:
 * madvise MADV_DONTNEED on the whole pages inside its bytes.  A safetensors set is
 * always a read-only private map of its files, a GGUF may be one (tsr_gguf_file_mapped);
 * neither is ever written, so a later read of those bytes faults them back in from the
 * file (the page cache keeps them for the next rank's load): nothing changes but
 * memory.  Without it every page read stays resident until the file is closed after the
 * load, and the load peaks at the file plus the float32 model (a bf16 70B checkpoint:
 * 140 + 280 GB).  Bytes a GGUF borrows from memory are left alone (DONTNEED would zero
 * them).  Best effort: an madvise that fails leaves the pages where they were. */
static void release_file_pages(const tsr_tensor_source *s, const src_tensor *t) {
        const void *data = t->gt ? t->gt->data : t->st ? t->st->data : NULL;
        long page = sysconf(_SC_PAGESIZE);
        if (!data || page <= 0 || (s->g && !tsr_gguf_file_mapped(s->g)))
                return;
        uintptr_t a = (uintptr_t)data, lo = (a + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page,
                  hi = (a + t->n_bytes) / (uintptr_t)page * (uintptr_t)page;
        if (hi > lo)
                (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Add the table's entry `n` of `layer` to wants, in the source's naming, with the slot
 * the family binds it to; an entry the source has no name for (rope_freqs in
 * safetensors) or the family has no slot for (a tied output matrix) is skipped. */
static void want_entry(const tsr_tensor_source *s, const tsr_tensor_name *n, tsr_load_bind_fn bind, void *model,
                       uint32_t layer, struct want *wants, size_t *n_wants) {
        const char *pattern = s->g ? n->gguf : n->hf;
        tsr_load_slot slot = {0};
        struct want *x;

        if (!pattern || !bind(model, n, layer, &slot) || !slot.dst)
                return;
        x = &wants[*n_wants];
        int pre = snprintf(x->name, sizeof x->name, "%s", !s->g && s->hf_prefix ? s->hf_prefix : "");
        if (pre < 0 || (size_t)pre >= sizeof x->name)
                pre = 0;
        /* a model-wide name has no %u */
        snprintf(x->name + pre, sizeof x->name - (size_t)pre, pattern, layer);
        x->dst = slot.dst;
        x->stored = slot.stored;
        x->rows = slot.rows;
        x->cols = slot.cols;
        x->experts = slot.experts;
        x->optional = slot.optional;
        x->slice = slot.slice;
        x->experts_first = slot.experts_first;
        x->experts_n = slot.experts_n;
        (*n_wants)++;
}

tsr_status tsr_load_tensors(const tsr_tensor_source *s, const tsr_tensor_name *table, size_t n_table,
                            const tsr_shard_spec *spec, tsr_load_bind_fn bind, void *model,
                            tsr_load_progress_fn progress, void *ud, tsr_load_stats *stats, char *err,
                            size_t errlen) {
        struct want *wants = NULL;
        size_t n_wants = 0, n_layers;
        tsr_load_stats total = {0}, done = {0};
        double t0 = now_s();
        bool layers_done = false;
        src_tensor t;
        tsr_status st = TSR_OK;

        if (!s || (!s->g == !s->set) || !table || !spec || !bind || spec->last_layer < spec->first_layer)
                return TSR_E_INVAL;
        n_layers = spec->last_layer - spec->first_layer + 1;
        if (!(wants = calloc(n_table * (n_layers + 1), sizeof *wants))) {
                tsr_errf(err, errlen, "%s: out of memory", s->src);
                return TSR_E_NOMEM;
        }
        /* The table in its order, every per-layer entry once per layer of the shard
         * where the first of them stands. */
        for (size_t i = 0; i < n_table; i++) {
                if (!table[i].per_layer) {
                        want_entry(s, &table[i], bind, model, 0, wants, &n_wants);
                        continue;
                }
                if (layers_done)
                        continue;
                layers_done = true;
                for (size_t l = 0; l < n_layers; l++)
                        for (size_t j = i; j < n_table; j++)
                                if (table[j].per_layer)
                                        want_entry(s, &table[j], bind, model, spec->first_layer + (uint32_t)l,
                                                   wants, &n_wants);
        }

        /* Totals first, so progress can say how far along it is; missing tensors fail
         * before any work. */
        for (size_t i = 0; i < n_wants; i++) {
                if (!src_find(s, wants[i].name, &t)) {
                        if (wants[i].optional)
                                continue;
                        tsr_errf(err, errlen, "%s: tensor '%s' missing", s->src, wants[i].name);
                        st = TSR_E_NOTFOUND;
                        goto out;
                }
                total.n_tensors++;
                total.file_bytes += src_read_bytes(s, &t, &wants[i]);
                total.f32_bytes += want_elems(&wants[i], t.n_elements) * sizeof(float);
        }
        for (size_t i = 0; i < n_wants; i++) {
                if (!src_find(s, wants[i].name, &t))
                        continue;
                st = src_load_one(s, &t, &wants[i], err, errlen);
                release_file_pages(s, &t);
                if (st != TSR_OK)
                        goto out;
                done.n_tensors++;
                done.file_bytes += src_read_bytes(s, &t, &wants[i]);
                done.f32_bytes += want_elems(&wants[i], t.n_elements) * sizeof(float);
                /* kept: its bytes in memory (the file's; NVFP4 with its block scales regrouped in) */
                done.resident_bytes += wants[i].stored && wants[i].stored->data
                                               ? tsr_tensor_n_bytes(wants[i].stored)
                                               : want_elems(&wants[i], t.n_elements) * sizeof(float);
                done.seconds = now_s() - t0;
                if (progress)
                        progress(ud, &done, &total);
        }
        if (stats)
                *stats = done;
out:
        free(wants);
        return st;
}
