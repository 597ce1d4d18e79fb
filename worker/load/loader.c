/* loader.c - the one weight loader: a tensor source (a GGUF file or a set of safetensors
 * files, both mmap'd by their readers) x the family's tensor-name table
 * (worker/model/family.h) x a shard spec.  One totals pass (every tensor present before
 * any work), one load pass, one progress callback, whatever the source.
 *
 * Only the per-source part differs: finding a tensor by its name in that format, and
 * checking its shape and type before converting it to float32 with tsr_ggml_dequantize
 * (weights.c) -- the GGUF shape is in ggml order, the safetensors one row-major, and the
 * messages say so as they always have.  Blocking file I/O plus conversion: start-up only. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/model/family.h"
#include "worker/load/weights.h"

/* What to read: one tensor, its name in the source, its shape and where it goes. */
struct want {
        char name[96];
        uint64_t rows, cols;    /* cols == 0: a vector of `rows` elements */
        float **dst;
        bool optional;
};

/* A tensor source: exactly one of g / set.  `src` names it in messages. */
typedef struct tensor_source {
        const tsr_gguf *g;
        const tsr_safetensors_set *set;
        const char *src;
} tensor_source;

/* A tensor of the source, format-blind: enough for the totals and the progress. */
typedef struct src_tensor {
        const tsr_gguf_tensor *gt;
        const tsr_safetensors_tensor *st;
        const char *file;               /* safetensors: the file that holds it */
        uint64_t n_bytes, n_elements;
} src_tensor;

static bool src_find(const tensor_source *s, const char *name, src_tensor *ret) {
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

/* ---- GGUF ------------------------------------------------------------------------ */

/* Check `t` against `w` and dequantize it into a new array. */
static tsr_status gguf_load_one(const tsr_gguf_tensor *t, const struct want *w, const char *path, float **ret,
                           char *err, size_t errlen) {
        uint64_t d0 = w->cols ? w->cols : w->rows, d1 = w->cols ? w->rows : 1;
        uint32_t want_dims = w->cols ? 2 : 1;
        bool ok = t->dims[0] == d0 && t->dims[1] == d1 && t->dims[2] == 1 && t->dims[3] == 1 &&
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
        if (t->n_elements > SIZE_MAX / sizeof(float)) {
                tsr_errf(err, errlen, "%s: tensor '%s' too large", path, w->name);
                return TSR_E_LIMIT;
        }
        buf = malloc((size_t)t->n_elements * sizeof(float));
        if (!buf) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", path, w->name);
                return TSR_E_NOMEM;
        }
        st = tsr_ggml_dequantize(t->type, t->data, (size_t)t->n_elements, buf);
        if (st != TSR_OK) {
                const char *tn = tsr_ggml_type_name(t->type);
                tsr_errf(err, errlen, "%s: tensor '%s': type %s is not supported", path, w->name, tn ? tn : "?");
                free(buf);
                return st == TSR_E_INVAL ? TSR_E_INVAL : TSR_E_UNSUPPORTED;
        }
        *ret = buf;
        return TSR_OK;
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

/* Check `t` (from `file`) against `w` and convert it into a new float32 array. */
static tsr_status hf_load_one(const tsr_safetensors_tensor *t, const char *file, const struct want *w,
                              float **ret, char *err, size_t errlen) {
        uint32_t gtype;
        float *buf;

        if (!hf_ggml_type(t->dtype, &gtype)) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s is not supported (F32, F16 and BF16 are)", file,
                        w->name, tsr_safetensors_dtype_name(t->dtype));
                return TSR_E_UNSUPPORTED;
        }
        bool ok = w->cols ? t->n_dims == 2 && t->shape[0] == w->rows && t->shape[1] == w->cols
                          : t->n_dims == 1 && t->shape[0] == w->rows;
        if (!ok) {
                char got[160] = "[", want[64];
                size_t n = 1;
                for (uint32_t i = 0; i < t->n_dims && n < sizeof got; i++)
                        n += (size_t)snprintf(got + n, sizeof got - n, "%s%" PRIu64, i ? ", " : "", t->shape[i]);
                if (n < sizeof got - 1)
                        snprintf(got + n, sizeof got - n, "]");
                if (w->cols)
                        snprintf(want, sizeof want, "[%" PRIu64 ", %" PRIu64 "]", w->rows, w->cols);
                else
                        snprintf(want, sizeof want, "[%" PRIu64 "]", w->rows);
                tsr_errf(err, errlen, "%s: tensor '%s': shape %s, expected %s", file, w->name, got, want);
                return TSR_E_INVAL;
        }
        if (t->n_elements > SIZE_MAX / sizeof(float)) {
                tsr_errf(err, errlen, "%s: tensor '%s' too large", file, w->name);
                return TSR_E_LIMIT;
        }
        buf = malloc((size_t)t->n_elements * sizeof(float));
        if (!buf) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", file, w->name);
                return TSR_E_NOMEM;
        }
        /* Safetensors data is little-endian and only byte-aligned: the dequantizer reads
         * it byte-wise (F16/BF16) or with memcpy (F32). */
        if (tsr_ggml_dequantize(gtype, t->data, (size_t)t->n_elements, buf) != TSR_OK) {
                tsr_errf(err, errlen, "%s: tensor '%s': conversion failed", file, w->name);
                free(buf);
                return TSR_E_INTERNAL;
        }
        *ret = buf;
        return TSR_OK;
}

static tsr_status src_load_one(const tensor_source *s, const src_tensor *t, const struct want *w, char *err,
                               size_t errlen) {
        return s->g ? gguf_load_one(t->gt, w, s->src, w->dst, err, errlen)
                    : hf_load_one(t->st, t->file, w, w->dst, err, errlen);
}

/* ---- the loader ------------------------------------------------------------------ */

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Where the Llama family's logical tensor `logical` of layer L goes, and its shape
 * (rows, cols; cols 0 for a vector).  False for a name this struct has no field for. */
static bool llama_slot(tsr_llama_weights *w, tsr_llama_layer *L, const char *logical, float ***dst, uint64_t *rows,
                       uint64_t *cols) {
        const tsr_llama_config *c = &w->cfg;
        uint64_t dim = c->dim, q_dim = (uint64_t)c->n_heads * c->head_dim;
        uint64_t kv_dim = (uint64_t)c->n_kv_heads * c->head_dim, hid = c->hidden_dim;
        static const char *const names[] = {"token_embd", "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "output_norm", "output",
                                            "rope_freqs"};
        struct { float **dst; uint64_t rows, cols; } s[] = {
                {&w->token_embd, c->vocab_size, dim},
                {L ? &L->attn_norm : NULL, dim, 0},
                {L ? &L->wq : NULL, q_dim, dim},
                {L ? &L->wk : NULL, kv_dim, dim},
                {L ? &L->wv : NULL, kv_dim, dim},
                {L ? &L->wo : NULL, dim, q_dim},
                {L ? &L->ffn_norm : NULL, dim, 0},
                {L ? &L->w_gate : NULL, hid, dim},
                {L ? &L->w_up : NULL, hid, dim},
                {L ? &L->w_down : NULL, dim, hid},
                {&w->output_norm, dim, 0},
                {&w->output, c->vocab_size, dim},
                {&w->rope_freqs, c->head_dim / 2, 0},
        };
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
                if (strcmp(names[i], logical) == 0 && s[i].dst) {
                        *dst = s[i].dst;
                        *rows = s[i].rows;
                        *cols = s[i].cols;
                        return true;
                }
        }
        return false;
}

/* Add the table's entry `n` (layer `layer`, or a model-wide one when L is NULL) to wants,
 * in the source's naming; an entry the source has no name for (rope_freqs in safetensors)
 * or the output matrix of a tied model is skipped. */
static void want_entry(const tensor_source *s, const tsr_tensor_name *n, tsr_llama_weights *w, tsr_llama_layer *L,
                       uint32_t layer, struct want *wants, size_t *n_wants) {
        const char *pattern = s->g ? n->gguf : n->hf;
        struct want *x;

        if (!pattern || (strcmp(n->logical, "output") == 0 && w->cfg.tied_embeddings))
                return;
        x = &wants[*n_wants];
        if (!llama_slot(w, L, n->logical, &x->dst, &x->rows, &x->cols))
                return;
        snprintf(x->name, sizeof x->name, pattern, layer);      /* a model-wide name has no %u */
        /* Only llama.cpp's precomputed rope divisors may be absent. */
        x->optional = strcmp(n->logical, "rope_freqs") == 0;
        (*n_wants)++;
}

static tsr_status load_source(const tensor_source *s, const tsr_llama_config *cfg, const tsr_shard_spec *spec,
                              tsr_load_progress_fn progress, void *ud, tsr_llama_weights **ret,
                              tsr_load_stats *stats, char *err, size_t errlen) {
        const tsr_model_family *fam = &tsr_family_llama;
        tsr_llama_weights *w = NULL;
        struct want *wants = NULL;
        size_t n_wants = 0, n_layers;
        tsr_load_stats total = {0}, done = {0};
        double t0 = now_s();
        bool layers_done = false;
        src_tensor t;
        tsr_status st;

        if ((st = tsr_llama_weights_check(cfg, spec, s->src, err, errlen)) != TSR_OK)
                return st;
        st = TSR_E_NOMEM;       /* what a `goto fail` below reports unless it sets st */
        n_layers = spec->last_layer - spec->first_layer + 1;
        w = calloc(1, sizeof *w);
        if (w)
                w->shard = *spec;       /* before layers: tsr_llama_weights_free reads it */
        if (!w || !(w->layers = calloc(n_layers, sizeof *w->layers)) ||
            !(wants = calloc(fam->n_tensors * (n_layers + 1), sizeof *wants))) {
                tsr_errf(err, errlen, "%s: out of memory", s->src);
                goto fail;
        }
        w->cfg = *cfg;

        /* The family's table in its order, every per-layer entry once per layer of the
         * shard where the first of them stands (weights.h's order). */
        for (size_t i = 0; i < fam->n_tensors; i++) {
                if (!fam->tensors[i].per_layer) {
                        want_entry(s, &fam->tensors[i], w, NULL, 0, wants, &n_wants);
                        continue;
                }
                if (layers_done)
                        continue;
                layers_done = true;
                for (size_t l = 0; l < n_layers; l++)
                        for (size_t j = i; j < fam->n_tensors; j++)
                                if (fam->tensors[j].per_layer)
                                        want_entry(s, &fam->tensors[j], w, &w->layers[l],
                                                   spec->first_layer + (uint32_t)l, wants, &n_wants);
        }

        /* Totals first, so progress can say how far along it is; missing tensors fail
         * before any work. */
        for (size_t i = 0; i < n_wants; i++) {
                if (!src_find(s, wants[i].name, &t)) {
                        if (wants[i].optional)
                                continue;
                        tsr_errf(err, errlen, "%s: tensor '%s' missing", s->src, wants[i].name);
                        st = TSR_E_NOTFOUND;
                        goto fail;
                }
                total.n_tensors++;
                total.file_bytes += t.n_bytes;
                total.f32_bytes += t.n_elements * sizeof(float);
        }
        for (size_t i = 0; i < n_wants; i++) {
                if (!src_find(s, wants[i].name, &t))
                        continue;
                if ((st = src_load_one(s, &t, &wants[i], err, errlen)) != TSR_OK)
                        goto fail;
                done.n_tensors++;
                done.file_bytes += t.n_bytes;
                done.f32_bytes += t.n_elements * sizeof(float);
                done.seconds = now_s() - t0;
                if (progress)
                        progress(ud, &done, &total);
        }
        if (cfg->tied_embeddings)
                w->output = w->token_embd;
        if (w->rope_freqs) {
                for (uint32_t i = 0; i < cfg->head_dim / 2; i++) {
                        if (!(w->rope_freqs[i] > 0) || !isfinite(w->rope_freqs[i])) {
                                tsr_errf(err, errlen, "%s: tensor 'rope_freqs.weight': entry %" PRIu32
                                        " is not a positive number", s->src, i);
                                st = TSR_E_INVAL;
                                goto fail;
                        }
                }
        }
        free(wants);
        if (stats)
                *stats = done;
        *ret = w;
        return TSR_OK;
fail:
        free(wants);
        tsr_llama_weights_free(&w);
        return st;
}

tsr_status tsr_llama_weights_load(const tsr_gguf *g, const char *path, const tsr_llama_config *cfg,
                                  const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                  tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tensor_source s = {.g = g, .src = path ? path : "<gguf>"};

        if (!g || !cfg || !spec || !ret)
                return TSR_E_INVAL;
        return load_source(&s, cfg, spec, progress, ud, ret, stats, err, errlen);
}

static bool ends_with(const char *s, const char *suffix) {
        size_t n = strlen(s), k = strlen(suffix);
        return n >= k && strcmp(s + n - k, suffix) == 0;
}

tsr_status tsr_llama_weights_load_hf(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                     const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                     tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tensor_source s = {.set = set};
        const char *file;
        tsr_status st;

        if (!set || !cfg || !spec || !ret)
                return TSR_E_INVAL;
        s.src = tsr_safetensors_set_source(set);
        if ((st = tsr_llama_weights_check(cfg, spec, s.src, err, errlen)) != TSR_OK)
                return st;
        /* Biases (Qwen2-style checkpoints labelled Llama) would be dropped silently. */
        for (size_t i = 0; i < tsr_safetensors_set_n_tensors(set); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_set_tensor_at(set, i, &file);
                if (ends_with(t->name, ".bias")) {
                        tsr_errf(err, errlen, "%s: tensor '%.200s': biases are not supported", file, t->name);
                        return TSR_E_UNSUPPORTED;
                }
        }
        return load_source(&s, cfg, spec, progress, ud, ret, stats, err, errlen);
}
