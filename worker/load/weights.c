/* weights.c - Llama config from GGUF metadata, and its tensors dequantized to float32.
 *
 * The block formats and their dequantization are kernels/quant/'s (quant.h); each is
 * checked against gguf-py's on random blocks (tests/fixtures/forward/dequant.json). */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/quant/quant.h"
#include "worker/load/weights.h"


/* ggml's type tag -> the dtype of the same encoding; the formats and their
 * dequantization live in kernels/quant/. */
tsr_status tsr_ggml_dequantize(uint32_t type, const void *src, size_t n, float *dst) {
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
                return TSR_E_UNSUPPORTED;
        }
        return tsr_dequant_row(t, src, n, dst);
}

/* ---- config ------------------------------------------------------------------------ */

tsr_shard_spec tsr_shard_spec_whole(uint32_t n_layers) {
        return (tsr_shard_spec){.tp_rank = 0, .tp_size = 1, .first_layer = 0,
                                .last_layer = n_layers ? n_layers - 1 : 0};
}

/* Read "llama.<suffix>" as a u32.  Absent: *ret = def when !required, else TSR_E_INVAL. */
static tsr_status cfg_u32(const tsr_gguf *g, const char *path, const char *suffix, bool required, uint32_t def,
                          uint32_t *ret, char *err, size_t errlen) {
        char key[128];
        uint64_t v;

        snprintf(key, sizeof key, "llama.%s", suffix);
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        if (!kv) {
                if (required) {
                        tsr_errf(err, errlen, "%s: metadata key '%s' missing", path, key);
                        return TSR_E_INVAL;
                }
                *ret = def;
                return TSR_OK;
        }
        if (tsr_gguf_get_u64(&kv->value, &v) != TSR_OK || v > UINT32_MAX) {
                tsr_errf(err, errlen, "%s: metadata key '%s': expected an unsigned 32-bit integer", path, key);
                return TSR_E_INVAL;
        }
        *ret = (uint32_t)v;
        return TSR_OK;
}

static tsr_status cfg_f64(const tsr_gguf *g, const char *path, const char *suffix, double def, double *ret,
                          char *err, size_t errlen) {
        char key[128];

        snprintf(key, sizeof key, "llama.%s", suffix);
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        if (!kv) {
                *ret = def;
                return TSR_OK;
        }
        if (tsr_gguf_get_f64(&kv->value, ret) != TSR_OK || !isfinite(*ret)) {
                tsr_errf(err, errlen, "%s: metadata key '%s': expected a finite number", path, key);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

tsr_status tsr_llama_config_from_gguf(const tsr_gguf *g, const char *path, tsr_llama_config *ret,
                                      char *err, size_t errlen) {
        tsr_llama_config c = {0};
        const tsr_gguf_kv *kv;
        const char *s;
        size_t len;
        uint32_t rot_dim;
        double eps;
        tsr_status st;

        if (!g || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "<gguf>";
        kv = tsr_gguf_find_kv(g, "general.architecture");
        if (!kv || tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK) {
                tsr_errf(err, errlen, "%s: metadata key 'general.architecture' missing or not a string", path);
                return TSR_E_INVAL;
        }
        if (len != 5 || memcmp(s, "llama", 5) != 0) {
                tsr_errf(err, errlen, "%s: architecture '%.*s' is not supported (only 'llama')", path,
                        (int)(len > 64 ? 64 : len), s);
                return TSR_E_UNSUPPORTED;
        }
        if ((st = cfg_u32(g, path, "embedding_length", true, 0, &c.dim, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, "block_count", true, 0, &c.n_layers, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, "attention.head_count", true, 0, &c.n_heads, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, "attention.head_count_kv", false, c.n_heads, &c.n_kv_heads, err,
                          errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, "feed_forward_length", true, 0, &c.hidden_dim, err, errlen)) != TSR_OK ||
            (st = cfg_u32(g, path, "context_length", false, 0, &c.max_seq_len, err, errlen)) != TSR_OK)
                return st;
        if (c.dim == 0 || c.n_layers == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.hidden_dim == 0) {
                tsr_errf(err, errlen, "%s: a llama.* dimension is zero", path);
                return TSR_E_INVAL;
        }
        if (c.n_heads % c.n_kv_heads != 0) {
                tsr_errf(err, errlen, "%s: head_count %" PRIu32 " is not a multiple of head_count_kv %" PRIu32,
                        path, c.n_heads, c.n_kv_heads);
                return TSR_E_INVAL;
        }
        if ((st = cfg_u32(g, path, "attention.key_length", false, c.dim / c.n_heads, &c.head_dim, err, errlen)))
                return st;
        if (c.head_dim == 0 || c.head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: head dim %" PRIu32 " must be even and non-zero", path, c.head_dim);
                return TSR_E_INVAL;
        }
        if ((st = cfg_u32(g, path, "rope.dimension_count", false, c.head_dim, &rot_dim, err, errlen)))
                return st;
        if (rot_dim != c.head_dim) {
                tsr_errf(err, errlen, "%s: llama.rope.dimension_count %" PRIu32 " != head dim %" PRIu32
                        " (partial rotary is not supported)", path, rot_dim, c.head_dim);
                return TSR_E_UNSUPPORTED;
        }
        if ((st = cfg_f64(g, path, "attention.layer_norm_rms_epsilon", 1e-5, &eps, err, errlen)) ||
            (st = cfg_f64(g, path, "rope.freq_base", 10000.0, &c.rope_theta, err, errlen)))
                return st;
        if (eps <= 0 || c.rope_theta <= 0) {
                tsr_errf(err, errlen, "%s: rms epsilon and rope.freq_base must be positive", path);
                return TSR_E_INVAL;
        }
        c.rms_eps = (float)eps;
        kv = tsr_gguf_find_kv(g, "llama.rope.scaling.type");
        if (kv && (tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK || len != 4 || memcmp(s, "none", 4) != 0)) {
                tsr_errf(err, errlen, "%s: llama.rope.scaling.type other than 'none' is not supported", path);
                return TSR_E_UNSUPPORTED;
        }

        /* Vocabulary: the explicit key, else the tokenizer's size, else the embedding rows. */
        kv = tsr_gguf_find_kv(g, "llama.vocab_size");
        if (kv) {
                if ((st = cfg_u32(g, path, "vocab_size", true, 0, &c.vocab_size, err, errlen)) != TSR_OK)
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

/* ---- tensors (loaded by worker/load/loader.c) ---------------------------------- */

tsr_status tsr_llama_weights_check(const tsr_llama_config *cfg, const tsr_shard_spec *spec, const char *src,
                                   char *err, size_t errlen) {
        if (spec->tp_size != 1 || spec->tp_rank != 0 || spec->first_layer != 0 ||
            spec->last_layer + 1 != cfg->n_layers) {
                tsr_errf(err, errlen, "%s: shard tp %" PRIu32 "/%" PRIu32 " layers %" PRIu32 "..%" PRIu32
                        ": only the whole model (tp 0/1, layers 0..%" PRIu32 ") is supported", src,
                        spec->tp_rank, spec->tp_size, spec->first_layer, spec->last_layer,
                        cfg->n_layers ? cfg->n_layers - 1 : 0);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->vocab_size == 0 || cfg->dim == 0 || cfg->hidden_dim == 0 || cfg->n_heads == 0 ||
            cfg->n_kv_heads == 0 || cfg->n_heads % cfg->n_kv_heads != 0 || cfg->head_dim == 0 ||
            cfg->head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: inconsistent model config", src);
                return TSR_E_INVAL;
        }
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
                }
                free(w->layers);
        }
        if (w->output != w->token_embd)
                free(w->output);
        free(w->token_embd);
        free(w->output_norm);
        free(w->rope_freqs);
        free(w);
        *wp = NULL;
}
