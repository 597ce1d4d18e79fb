/* llama_weights.c - a Llama's config from GGUF metadata, and its tensors through the one
 * loader (worker/load/loader.c): the Llama half of a load is `llama_bind`, which says
 * where each logical tensor of the family's table goes and what shape it must have. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/model/family.h"
#include "worker/model/llama_weights.h"
#include "worker/model/tp.h"
#include "worker/parallel/comm.h"


/* ---- config ------------------------------------------------------------------------ */

/* The shared GGUF key readers, scalars only here (gguf.h). */
static tsr_status cfg_u32(const tsr_gguf *g, const char *path, const char *arch, const char *suffix, bool required,
                          uint32_t def, uint32_t *ret, char *err, size_t errlen) {
        return tsr_gguf_arch_u32(g, path, arch, suffix, required, def, -1, ret, err, errlen);
}

tsr_status tsr_llama_config_from_gguf(const tsr_gguf *g, const char *path, tsr_llama_config *ret,
                                      char *err, size_t errlen) {
        return tsr_llama_config_from_gguf_arch(g, path, "llama", ret, err, errlen);
}

tsr_status tsr_llama_config_from_gguf_arch(const tsr_gguf *g, const char *path, const char *arch,
                                           tsr_llama_config *ret, char *err, size_t errlen) {
        tsr_llama_config c = {0};
        const tsr_gguf_kv *kv;
        const char *s;
        size_t len;
        uint32_t rot_dim;
        double eps;
        char key[96];
        tsr_status st;

        if (!g || !ret || !arch)
                return TSR_E_INVAL;
        if (!path)
                path = "<gguf>";
        kv = tsr_gguf_find_kv(g, "general.architecture");
        if (!kv || tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK) {
                tsr_errf(err, errlen, "%s: metadata key 'general.architecture' missing or not a string", path);
                return TSR_E_INVAL;
        }
        if (len != strlen(arch) || memcmp(s, arch, len) != 0) {
                tsr_errf(err, errlen, "%s: architecture '%.*s' is not supported (only '%s')", path,
                        (int)(len > 64 ? 64 : len), s, arch);
                return TSR_E_UNSUPPORTED;
        }
        if ((st = cfg_u32(g, path, arch, "embedding_length", true, 0, &c.dim, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, arch, "block_count", true, 0, &c.n_layers, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, arch, "attention.head_count", true, 0, &c.n_heads, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, arch, "attention.head_count_kv", false, c.n_heads, &c.n_kv_heads, err,
                          errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, arch, "feed_forward_length", true, 0, &c.hidden_dim, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, arch, "context_length", false, 0, &c.max_seq_len, err, errlen)) != TSR_OK)
                return st;
        if (c.dim == 0 || c.n_layers == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.hidden_dim == 0) {
                tsr_errf(err, errlen, "%s: a %s.* dimension is zero", path, arch);
                return TSR_E_INVAL;
        }
        if (c.n_heads % c.n_kv_heads != 0) {
                tsr_errf(err, errlen, "%s: head_count %" PRIu32 " is not a multiple of head_count_kv %" PRIu32,
                        path, c.n_heads, c.n_kv_heads);
                return TSR_E_INVAL;
        }
        if ((st = cfg_u32(g, path, arch, "attention.key_length", false, c.dim / c.n_heads, &c.head_dim, err, errlen)))
                return st;
        if (c.head_dim == 0 || c.head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: head dim %" PRIu32 " must be even and non-zero", path, c.head_dim);
                return TSR_E_INVAL;
        }
        if ((st = cfg_u32(g, path, arch, "rope.dimension_count", false, c.head_dim, &rot_dim, err, errlen)))
                return st;
        if (rot_dim != c.head_dim) {
                tsr_errf(err, errlen, "%s: %s.rope.dimension_count %" PRIu32 " != head dim %" PRIu32
                        " (partial rotary is not supported)", path, arch, rot_dim, c.head_dim);
                return TSR_E_UNSUPPORTED;
        }
        if ((st = tsr_gguf_arch_f64(g, path, arch, "attention.layer_norm_rms_epsilon", 1e-5, &eps, err, errlen)) ||
            (st = tsr_gguf_arch_f64(g, path, arch, "rope.freq_base", 10000.0, &c.rope_theta, err, errlen)))
                return st;
        if (eps <= 0 || c.rope_theta <= 0) {
                tsr_errf(err, errlen, "%s: rms epsilon and rope.freq_base must be positive", path);
                return TSR_E_INVAL;
        }
        c.rms_eps = (float)eps;
        snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
        kv = tsr_gguf_find_kv(g, key);
        if (kv && (tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK || len != 4 || memcmp(s, "none", 4) != 0)) {
                tsr_errf(err, errlen, "%s: %s other than 'none' is not supported", path, key);
                return TSR_E_UNSUPPORTED;
        }

        /* Vocabulary: the explicit key, else the tokenizer's size, else the embedding rows. */
        snprintf(key, sizeof key, "%s.vocab_size", arch);
        kv = tsr_gguf_find_kv(g, key);
        if (kv) {
                if ((st = cfg_u32(g, path, arch, "vocab_size", true, 0, &c.vocab_size, err, errlen)) != TSR_OK)
                        return st;
        } else if ((kv = tsr_gguf_find_kv(g, "tokenizer.ggml.tokens")) && kv->value.type == TSR_GGUF_TYPE_ARRAY &&
                   kv->value.count <= UINT32_MAX) {
                c.vocab_size = (uint32_t)kv->value.count;
        } else {
                const tsr_gguf_tensor *t = tsr_gguf_find_tensor(g, "token_embd.weight");
                if (t && t->n_dims == 2 && t->dims[1] <= UINT32_MAX)
                        c.vocab_size = (uint32_t)t->dims[1];
        }
        if (c.vocab_size == 0) {
                tsr_errf(err, errlen, "%s: cannot tell the vocabulary size", path);
                return TSR_E_INVAL;
        }
        /* llama.cpp's converter permutes HF's Q/K rows for interleaved RoPE (weights.h). */
        c.rope_layout = TSR_ROPE_INTERLEAVED;
        c.tied_embeddings = tsr_gguf_find_tensor(g, "output.weight") == NULL;
        *ret = c;
        return TSR_OK;
}

/* ---- tensors ------------------------------------------------------------------------ */

tsr_status tsr_llama_weights_check(const tsr_llama_config *cfg, const tsr_shard_spec *spec, const char *src,
                                   char *err, size_t errlen) {
        /* A pipeline stage's layer range, a tensor-parallel rank's share (issue #20). */
        if (spec->tp_size == 0 || spec->tp_rank >= spec->tp_size || spec->first_layer > spec->last_layer ||
            spec->last_layer >= cfg->n_layers) {
                tsr_errf(err, errlen, "%s: shard tp %" PRIu32 "/%" PRIu32 " layers %" PRIu32 "..%" PRIu32
                        ": a rank below the tensor parallel size and a layer range within 0..%" PRIu32
                        " are supported", src, spec->tp_rank, spec->tp_size, spec->first_layer, spec->last_layer,
                        cfg->n_layers ? cfg->n_layers - 1 : 0);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->vocab_size == 0 || cfg->dim == 0 || cfg->hidden_dim == 0 || cfg->n_heads == 0 ||
            cfg->n_kv_heads == 0 || cfg->n_heads % cfg->n_kv_heads != 0 || cfg->head_dim == 0 ||
            cfg->head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: inconsistent model config", src);
                return TSR_E_INVAL;
        }
        tsr_llama_tp_share share;
        char why[400];
        tsr_status st;
        if (spec->tp_size > 1 &&
            (st = tsr_llama_tp_share_of(cfg, spec->tp_rank, spec->tp_size, &share, why, sizeof why)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: %s", src, why);
                return st;
        }
        return TSR_OK;
}

tsr_status tsr_llama_tp_share_of(const tsr_llama_config *c, uint32_t tp_rank, uint32_t tp_size,
                                 tsr_llama_tp_share *ret, char *err, size_t errlen) {
        uint32_t S = TSR_COMM_TREE_LEAVES;
        tsr_llama_tp_share x;
        size_t hd = c->head_dim;

        if (tp_size == 0 || tp_rank >= tp_size || c->n_kv_heads == 0)
                return TSR_E_INVAL;
        x.nh = c->n_heads / tp_size;
        x.nkv = tp_size <= c->n_kv_heads ? c->n_kv_heads / tp_size : 1;
        x.kv0 = tp_size <= c->n_kv_heads ? tp_rank * x.nkv : tp_rank / (tp_size / c->n_kv_heads);
        x.hid = c->hidden_dim / tp_size;
        tsr_tp_vocab v = tsr_tp_vocab_of(c->vocab_size, tp_rank, tp_size);
        x.v0 = (uint32_t)v.first;
        x.vl = (uint32_t)v.n;
        x.ns = S / tp_size;
        if (S % tp_size || c->n_heads % tp_size ||
            (tp_size <= c->n_kv_heads ? c->n_kv_heads % tp_size : tp_size % c->n_kv_heads) ||
            c->hidden_dim % tp_size || tsr_tp_vocab_of(c->vocab_size, tp_size - 1, tp_size).n == 0 ||
            (x.nh * hd) % x.ns || x.hid % x.ns) {
                tsr_errf(err, errlen, "tensor parallel size %u does not split this model: it needs to divide %u "
                         "(the canonical partial sums), the %u attention heads and the %u MLP columns, be a "
                         "multiple or divisor of the %u KV heads and leave every rank some of the %u-token "
                         "vocabulary (padded to %d), with each rank's o_proj and down_proj inputs a multiple of "
                         "%u", tp_size, S, c->n_heads, c->hidden_dim, c->n_kv_heads, c->vocab_size,
                         TSR_TP_VOCAB_PAD, x.ns);
                return TSR_E_UNSUPPORTED;
        }
        *ret = x;
        return TSR_OK;
}

void tsr_llama_weights_free(tsr_llama_weights **wp) {
        tsr_llama_weights *w;

        if (!wp || !*wp)
                return;
        w = *wp;
        if (w->layers) {
                size_t n_layers = w->shard.last_layer - w->shard.first_layer + 1;
                for (size_t l = 0; l < n_layers; l++) {
                        tsr_llama_layer *L = &w->layers[l];
                        free(L->attn_norm);
                        free(L->wq);
                        free(L->wk);
                        free(L->wv);
                        free(L->wo);
                        free(L->ffn_norm);
                        free(L->w_gate);
                        free(L->w_up);
                        free(L->w_down);
                        for (int i = 0; i < TSR_LLAMA_MM_PER_LAYER; i++)
                                free(L->stored[i].data);
                }
                free(w->layers);
        }
        if (w->output != w->token_embd)
                free(w->output);
        free(w->token_embd);
        if (w->output_stored.data != w->token_embd_stored.data)
                free(w->output_stored.data);
        free(w->token_embd_stored.data);
        free(w->output_norm);
        free(w->rope_freqs);
        free(w);
        *wp = NULL;
}

/* Where the Llama family's logical tensor `n` of `layer` goes in `model` (a
 * tsr_llama_weights with cfg, shard and layers set), and its shape.  The output matrix of
 * a tied model has no slot; only llama.cpp's precomputed rope divisors may be absent. */
static bool llama_bind(void *model, const tsr_tensor_name *n, uint32_t layer, tsr_load_slot *ret) {
        tsr_llama_weights *w = model;
        const tsr_llama_config *c = &w->cfg;
        tsr_llama_layer *L = n->per_layer ? &w->layers[layer - w->shard.first_layer] : NULL;
        uint64_t dim = c->dim, q_dim = (uint64_t)c->n_heads * c->head_dim;
        uint64_t kv_dim = (uint64_t)c->n_kv_heads * c->head_dim, hid = c->hidden_dim;
        static const char *const names[] = {"token_embd", "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "output_norm", "output",
                                            "rope_freqs"};
        tsr_tensor *st = L ? L->stored : NULL;
        /* A pipeline stage holds the embedding only on the first stage, the final norm and
         * lm_head only on the last (a tied lm_head is the embedding, so the last stage
         * reads it too). */
        bool first = w->shard.first_layer == 0, last = w->shard.last_layer + 1 == c->n_layers;
        /* A tensor-parallel rank reads its share only (tp_sliced, tp_share: llama_load_source). */
        const tsr_llama_tp_share sh = w->tp_share;
        bool tp = w->tp_sliced;
        uint64_t r = w->shard.tp_rank, hd = c->head_dim;
        const tsr_load_slice rows_q = {TSR_LOAD_SLICE_ROWS, 1, {{r * sh.nh * hd, sh.nh * hd}}},
                             rows_kv = {TSR_LOAD_SLICE_ROWS, 1, {{sh.kv0 * hd, sh.nkv * hd}}},
                             rows_mlp = {TSR_LOAD_SLICE_ROWS, 1, {{r * sh.hid, sh.hid}}},
                             cols_o = {TSR_LOAD_SLICE_COLS, 1, {{r * sh.nh * hd, sh.nh * hd}}},
                             cols_down = {TSR_LOAD_SLICE_COLS, 1, {{r * sh.hid, sh.hid}}},
                             rows_vocab = {TSR_LOAD_SLICE_ROWS, 1, {{sh.v0, sh.vl}}}, whole = {0};
        struct { float **dst; tsr_tensor *stored; uint64_t rows, cols; tsr_load_slice slice; } s[] = {
                /* a tied last stage that does not embed reads the table as lm_head; a
                 * tensor-parallel rank its vocabulary rows (the embedding is
                 * vocabulary-parallel, tsr_tp_embed) */
                {first || (last && c->tied_embeddings) ? &w->token_embd : NULL,
                 w->tables_stored ? &w->token_embd_stored : NULL, c->vocab_size, dim, tp ? rows_vocab : whole},
                {L ? &L->attn_norm : NULL, NULL, dim, 0, whole},
                {L ? &L->wq : NULL, st ? &st[TSR_LLAMA_MM_Q] : NULL, q_dim, dim, tp ? rows_q : whole},
                {L ? &L->wk : NULL, st ? &st[TSR_LLAMA_MM_K] : NULL, kv_dim, dim, tp ? rows_kv : whole},
                {L ? &L->wv : NULL, st ? &st[TSR_LLAMA_MM_V] : NULL, kv_dim, dim, tp ? rows_kv : whole},
                {L ? &L->wo : NULL, st ? &st[TSR_LLAMA_MM_O] : NULL, dim, q_dim, tp ? cols_o : whole},
                {L ? &L->ffn_norm : NULL, NULL, dim, 0, whole},
                {L ? &L->w_gate : NULL, st ? &st[TSR_LLAMA_MM_GATE] : NULL, hid, dim, tp ? rows_mlp : whole},
                {L ? &L->w_up : NULL, st ? &st[TSR_LLAMA_MM_UP] : NULL, hid, dim, tp ? rows_mlp : whole},
                {L ? &L->w_down : NULL, st ? &st[TSR_LLAMA_MM_DOWN] : NULL, dim, hid, tp ? cols_down : whole},
                {last ? &w->output_norm : NULL, NULL, dim, 0, whole},
                {c->tied_embeddings || !last ? NULL : &w->output, w->tables_stored ? &w->output_stored : NULL,
                 c->vocab_size, dim, tp ? rows_vocab : whole},
                {&w->rope_freqs, NULL, c->head_dim / 2, 0, whole},
        };
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
                if (strcmp(names[i], n->logical) == 0 && s[i].dst) {
                        *ret = (tsr_load_slot){.dst = s[i].dst, .stored = s[i].stored,
                                               .rows = s[i].rows, .cols = s[i].cols,
                                               .optional = strcmp(n->logical, "rope_freqs") == 0,
                                               .slice = s[i].slice};
                        return true;
                }
        }
        return false;
}

static tsr_status llama_load_source(const tsr_tensor_source *s, const tsr_llama_config *cfg,
                                    const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                    tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        const tsr_model_family *fam = &tsr_family_llama;
        tsr_llama_weights *w;
        tsr_status st;

        if ((st = tsr_llama_weights_check(cfg, spec, s->src, err, errlen)) != TSR_OK)
                return st;
        w = calloc(1, sizeof *w);
        if (!w || !(w->layers = calloc(spec->last_layer - spec->first_layer + 1, sizeof *w->layers))) {
                free(w);
                tsr_errf(err, errlen, "%s: out of memory", s->src);
                return TSR_E_NOMEM;
        }
        w->cfg = *cfg;
        w->shard = *spec;
        /* a GGUF's tables in their block format; a safetensors checkpoint's BF16 ones as
         * stored when the weights become bfloat16 anyway (keep_bf16): half the bytes of
         * their float32 widening, the same values (the embedding rows widen exactly, the
         * lm_head's bf16 bits are what use_bf16 would round the widened table back to) */
        w->tables_stored = s->g != NULL || s->keep_bf16;
        if (spec->tp_size > 1) {        /* tsr_llama_weights_check passed it */
                if ((st = tsr_llama_tp_share_of(cfg, spec->tp_rank, spec->tp_size, &w->tp_share, err, errlen)) !=
                    TSR_OK)
                        goto fail;
                w->tp_sliced = true;
        }
        st = tsr_load_tensors(s, fam->tensors, fam->n_tensors, spec, llama_bind, w, progress, ud, stats, err,
                              errlen);
        if (st != TSR_OK)
                goto fail;
        if (cfg->tied_embeddings) {
                w->output = w->token_embd;
                w->output_stored = w->token_embd_stored;
        }
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
        *ret = w;
        return TSR_OK;
fail:
        tsr_llama_weights_free(&w);
        return st;
}

tsr_status tsr_llama_weights_load(const tsr_gguf *g, const char *path, const tsr_llama_config *cfg,
                                  const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                  tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        return tsr_llama_weights_load_opts(g, path, cfg, spec, NULL, progress, ud, ret, stats, err, errlen);
}

tsr_status tsr_llama_weights_load_opts(const tsr_gguf *g, const char *path, const tsr_llama_config *cfg,
                                       const tsr_shard_spec *spec, const tsr_load_opts *opts,
                                       tsr_load_progress_fn progress, void *ud, tsr_llama_weights **ret,
                                       tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_tensor_source s = {.g = g, .src = path ? path : "<gguf>", .keep_dtypes = opts ? opts->keep_dtypes : 0};

        if (!g || !cfg || !spec || !ret)
                return TSR_E_INVAL;
        return llama_load_source(&s, cfg, spec, progress, ud, ret, stats, err, errlen);
}

static bool ends_with(const char *s, const char *suffix) {
        size_t n = strlen(s), k = strlen(suffix);
        return n >= k && strcmp(s + n - k, suffix) == 0;
}

tsr_status tsr_llama_weights_load_hf(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                     const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                     tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        return tsr_llama_weights_load_hf_opts(set, cfg, spec, NULL, progress, ud, ret, stats, err, errlen);
}

tsr_status tsr_llama_weights_load_hf_opts(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                          const tsr_shard_spec *spec, const tsr_load_opts *opts,
                                          tsr_load_progress_fn progress, void *ud, tsr_llama_weights **ret,
                                          tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_tensor_source s = {.set = set, .modelopt = opts ? opts->modelopt : NULL,
                               .keep_bf16 = opts && opts->keep_bf16};
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
        return llama_load_source(&s, cfg, spec, progress, ud, ret, stats, err, errlen);
}
