/* weights.c - Llama config from GGUF metadata, and its tensors dequantized to float32.
 *
 * Block layouts follow the GGUF spec (ggml docs/gguf.md and the ggml type table); each
 * dequantizer is checked against gguf-py's on random blocks (tests/fixtures/forward/
 * dequant.json).  All reads of the map go through memcpy: tensor data is aligned to the
 * file's alignment, but nothing promises more than byte alignment inside a block. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/weights.h"


/* ---- scalar formats -------------------------------------------------------------- */

/* IEEE 754 binary16 -> binary32, exactly (every half is a float). */
static float f16_to_f32(uint16_t h) {
        uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
        float f;

        if (exp == 0x1f) {                      /* inf or NaN */
                bits = sign | 0x7f800000u | (mant << 13);
        } else if (exp != 0) {                  /* normal: rebias 15 -> 127 */
                bits = sign | ((exp + 112) << 23) | (mant << 13);
        } else if (mant == 0) {                 /* signed zero */
                bits = sign;
        } else {                                /* subnormal half: mant * 2^-24, exact in float */
                f = (float)mant * 0x1p-24f;
                memcpy(&bits, &f, 4);
                bits |= sign;
        }
        memcpy(&f, &bits, 4);
        return f;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static float rd_f16(const uint8_t *p) { return f16_to_f32(rd16(p)); }

/* ---- block formats (QK = elements per block) ----------------------------------- */

/* Q8_0: f16 d; int8 q[32].  x = d * q */
static void deq_q8_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        for (int j = 0; j < 32; j++)
                y[j] = d * (float)(int8_t)b[2 + j];
}

/* Q4_0: f16 d; u8 qs[16] (low nibbles are elements 0..15, high nibbles 16..31).
 * x = d * (q - 8) */
static void deq_q4_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((qs[j] & 0x0f) - 8);
                y[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
}

/* Q4_1: f16 d, f16 m; u8 qs[16].  x = d * q + m */
static void deq_q4_1(const uint8_t *b, float *y) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
                y[j] = d * (float)(qs[j] & 0x0f) + m;
                y[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
}

/* Q5_0: f16 d; u32 qh (bit j is the fifth bit of element j); u8 qs[16].  x = d * (q - 16) */
static void deq_q5_0(const uint8_t *b, float *y) {
        float d = rd_f16(b);
        uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
                int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
        }
}

/* Q5_1: f16 d, f16 m; u32 qh; u8 qs[16].  x = d * q + m */
static void deq_q5_1(const uint8_t *b, float *y) {
        float d = rd_f16(b), m = rd_f16(b + 2);
        uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
                int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                y[j] = d * (float)lo + m;
                y[j + 16] = d * (float)hi + m;
        }
}

/* The 6-bit scale and min of sub-block j (0..7) packed in the 12 bytes of a Q4_K/Q5_K
 * super-block: sub-blocks 0..3 in the low 6 bits of bytes j and j+4; 4..7 in the
 * nibbles of bytes j+4 with their top two bits in the high bits of bytes j-4 and j. */
static void k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
        if (j < 4) {
                *sc = s[j] & 63;
                *mn = s[j + 4] & 63;
        } else {
                *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
                *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
}

/* Q4_K (256 elements): f16 d, f16 dmin; u8 scales[12]; u8 qs[128].
 * Eight sub-blocks of 32; each 64-element chunk uses the low nibbles of 32 bytes for its
 * first sub-block and the high nibbles for its second.  x = (d*sc) * q - (dmin*mn) */
static void deq_q4_k(const uint8_t *b, float *y) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *scales = b + 4, *qs = b + 16;
        for (int c = 0; c < 4; c++) {
                int sc0, mn0, sc1, mn1;
                k_scale_min(2 * c, scales, &sc0, &mn0);
                k_scale_min(2 * c + 1, scales, &sc1, &mn1);
                float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
                float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
                for (int l = 0; l < 32; l++) {
                        y[64 * c + l] = d0 * (float)(qs[32 * c + l] & 0x0f) - m0;
                        y[64 * c + 32 + l] = d1 * (float)(qs[32 * c + l] >> 4) - m1;
                }
        }
}

/* Q5_K (256): f16 d, f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128].  As Q4_K, with the
 * fifth bit of element l of sub-block s in bit s of qh[l]. */
static void deq_q5_k(const uint8_t *b, float *y) {
        float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
        for (int c = 0; c < 4; c++) {
                int sc0, mn0, sc1, mn1;
                k_scale_min(2 * c, scales, &sc0, &mn0);
                k_scale_min(2 * c + 1, scales, &sc1, &mn1);
                float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
                float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
                for (int l = 0; l < 32; l++) {
                        int lo = (qs[32 * c + l] & 0x0f) | (((qh[l] >> (2 * c)) & 1) << 4);
                        int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                        y[64 * c + l] = d0 * (float)lo - m0;
                        y[64 * c + 32 + l] = d1 * (float)hi - m1;
                }
        }
}

/* Q6_K (256): u8 ql[128] (low 4 bits); u8 qh[64] (high 2 bits); int8 scales[16]; f16 d.
 * Two halves of 128; in half h, element 32*k + l (k = 0..3, l = 0..31) takes its low bits
 * from nibble k/2 of ql[64h + l + 32*(k%2)], its high bits from bits 2k..2k+1 of
 * qh[32h + l], and scale scales[8h + 2k + l/16].  x = d * sc * (q - 32) */
static void deq_q6_k(const uint8_t *b, float *y) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = rd_f16(b + 208);
        for (int h = 0; h < 2; h++) {
                for (int k = 0; k < 4; k++) {
                        for (int l = 0; l < 32; l++) {
                                uint8_t lb = ql[64 * h + l + 32 * (k % 2)];
                                int lo = k < 2 ? (lb & 0x0f) : (lb >> 4);
                                int q = (lo | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
                                float sc = (float)scales[8 * h + 2 * k + l / 16];
                                y[128 * h + 32 * k + l] = d * sc * (float)q;
                        }
                }
        }
}

tsr_status tsr_ggml_dequantize(uint32_t type, const void *src, size_t n, float *dst) {
        const uint8_t *p = src;
        void (*block_fn)(const uint8_t *, float *) = NULL;
        uint32_t qk, bytes;

        if (!dst || (!src && n))
                return TSR_E_INVAL;
        switch (type) {
        case TSR_GGML_TYPE_F32:
                memcpy(dst, src, n * sizeof(float));
                return TSR_OK;
        case TSR_GGML_TYPE_F16:
                for (size_t i = 0; i < n; i++)
                        dst[i] = rd_f16(p + 2 * i);
                return TSR_OK;
        case TSR_GGML_TYPE_BF16:                /* the top half of a float32 */
                for (size_t i = 0; i < n; i++) {
                        uint32_t bits = (uint32_t)rd16(p + 2 * i) << 16;
                        memcpy(&dst[i], &bits, 4);
                }
                return TSR_OK;
        case TSR_GGML_TYPE_Q8_0: block_fn = deq_q8_0; break;
        case TSR_GGML_TYPE_Q4_0: block_fn = deq_q4_0; break;
        case TSR_GGML_TYPE_Q4_1: block_fn = deq_q4_1; break;
        case TSR_GGML_TYPE_Q5_0: block_fn = deq_q5_0; break;
        case TSR_GGML_TYPE_Q5_1: block_fn = deq_q5_1; break;
        case TSR_GGML_TYPE_Q4_K: block_fn = deq_q4_k; break;
        case TSR_GGML_TYPE_Q5_K: block_fn = deq_q5_k; break;
        case TSR_GGML_TYPE_Q6_K: block_fn = deq_q6_k; break;
        default:
                return TSR_E_UNSUPPORTED;
        }
        if (tsr_ggml_type_size(type, &qk, &bytes) != TSR_OK)
                return TSR_E_UNSUPPORTED;
        if (n % qk != 0)
                return TSR_E_INVAL;
        for (size_t b = 0; b < n / qk; b++)
                block_fn(p + b * bytes, dst + b * qk);
        return TSR_OK;
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

/* ---- tensors (loaded by worker/model/loader.c) ---------------------------------- */

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
