/* weights_hf.c - Llama config from a Hugging Face config.json, and its safetensors
 * tensors converted to float32.
 *
 * The field names and defaults are transformers' LlamaConfig.  Both
 * config styles occur in the wild: transformers 4 writes a top-level rope_theta and a
 * rope_scaling object (null for plain RoPE); transformers 5 writes rope_parameters with
 * rope_theta inside.  Older files spell rope_type as "type". */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "worker/weights.h"

#define HF_MAX_CONFIG (16u << 20)

/* ---- config ------------------------------------------------------------------------ */

/* An integer field of `obj` in 0..UINT32_MAX.  Absent or null: *ret = def unless required. */
static tsr_status hf_u32(const char *path, json_t *obj, const char *key, bool required, uint32_t def,
                         uint32_t *ret, char *err, size_t errlen) {
        json_t *v = json_object_get(obj, key);

        if (!v || json_is_null(v)) {
                if (required) {
                        tsr_errf(err, errlen, "%s: field '%s' missing", path, key);
                        return TSR_E_INVAL;
                }
                *ret = def;
                return TSR_OK;
        }
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (json_int_t)UINT32_MAX) {
                tsr_errf(err, errlen, "%s: field '%s': expected an integer in 0..%" PRIu32, path, key, UINT32_MAX);
                return TSR_E_INVAL;
        }
        *ret = (uint32_t)json_integer_value(v);
        return TSR_OK;
}

/* A finite number field of `obj` (named `where` in messages). */
static tsr_status hf_f64(const char *path, json_t *obj, const char *where, const char *key, bool required,
                         double def, double *ret, char *err, size_t errlen) {
        json_t *v = json_object_get(obj, key);

        if (!v || json_is_null(v)) {
                if (required) {
                        tsr_errf(err, errlen, "%s: field '%s%s' missing", path, where, key);
                        return TSR_E_INVAL;
                }
                *ret = def;
                return TSR_OK;
        }
        if (!json_is_number(v) || !isfinite(json_number_value(v))) {
                tsr_errf(err, errlen, "%s: field '%s%s': expected a number", path, where, key);
                return TSR_E_INVAL;
        }
        *ret = json_number_value(v);
        return TSR_OK;
}

/* A boolean field that must be false when present (a feature this loader lacks). */
static tsr_status hf_must_be_false(const char *path, json_t *root, const char *key, const char *why, char *err,
                                   size_t errlen) {
        json_t *v = json_object_get(root, key);

        if (!v || json_is_null(v) || json_is_false(v))
                return TSR_OK;
        if (!json_is_true(v)) {
                tsr_errf(err, errlen, "%s: field '%s': expected true or false", path, key);
                return TSR_E_INVAL;
        }
        tsr_errf(err, errlen, "%s: field '%s' is true: %s are not supported", path, key, why);
        return TSR_E_UNSUPPORTED;
}

static tsr_status hf_architecture(const char *path, json_t *root, char *err, size_t errlen) {
        json_t *archs = json_object_get(root, "architectures"), *mt = json_object_get(root, "model_type");

        if (archs && !json_is_null(archs)) {
                json_t *a0 = json_array_get(archs, 0);
                if (!json_is_array(archs) || json_array_size(archs) != 1 || !json_is_string(a0)) {
                        tsr_errf(err, errlen, "%s: field 'architectures': expected a list of one string", path);
                        return TSR_E_INVAL;
                }
                if (strcmp(json_string_value(a0), "LlamaForCausalLM") != 0) {
                        tsr_errf(err, errlen, "%s: architecture '%.100s' is not supported (only LlamaForCausalLM)",
                                path, json_string_value(a0));
                        return TSR_E_UNSUPPORTED;
                }
                return TSR_OK;
        }
        if (!json_is_string(mt)) {
                tsr_errf(err, errlen, "%s: neither 'architectures' nor 'model_type' says what the model is", path);
                return TSR_E_INVAL;
        }
        if (strcmp(json_string_value(mt), "llama") != 0) {
                tsr_errf(err, errlen, "%s: model_type '%.100s' is not supported (only llama)", path,
                        json_string_value(mt));
                return TSR_E_UNSUPPORTED;
        }
        return TSR_OK;
}

/* rope_theta and the rope_type of rope_parameters (5.x) or rope_scaling (4.x). */
static tsr_status hf_rope(const char *path, json_t *root, tsr_llama_config *c, char *err, size_t errlen) {
        json_t *rp = json_object_get(root, "rope_parameters"), *type;
        const char *where = "rope_parameters.";
        tsr_status st;

        if (!rp || json_is_null(rp)) {
                rp = json_object_get(root, "rope_scaling");
                where = "rope_scaling.";
        }
        if (rp && !json_is_null(rp) && !json_is_object(rp)) {
                tsr_errf(err, errlen, "%s: field '%.*s': expected an object", path, (int)strlen(where) - 1, where);
                return TSR_E_INVAL;
        }
        if (!json_is_object(rp))
                rp = NULL;
        /* 5.x keeps rope_theta in rope_parameters; 4.x at the top level. */
        if (rp && json_object_get(rp, "rope_theta"))
                st = hf_f64(path, rp, where, "rope_theta", true, 0, &c->rope_theta, err, errlen);
        else
                st = hf_f64(path, root, "", "rope_theta", false, 10000.0, &c->rope_theta, err, errlen);
        if (st != TSR_OK)
                return st;
        if (!(c->rope_theta > 0)) {
                tsr_errf(err, errlen, "%s: rope_theta must be positive", path);
                return TSR_E_INVAL;
        }
        c->rope_layout = TSR_ROPE_NEOX;
        if (!rp)
                return TSR_OK;
        type = json_object_get(rp, "rope_type");
        if (!type)
                type = json_object_get(rp, "type");
        if (!json_is_string(type)) {
                tsr_errf(err, errlen, "%s: field '%srope_type' missing or not a string", path, where);
                return TSR_E_INVAL;
        }
        if (strcmp(json_string_value(type), "default") == 0)
                return TSR_OK;
        if (strcmp(json_string_value(type), "llama3") != 0) {
                tsr_errf(err, errlen, "%s: rope type '%.60s' is not supported (default and llama3 are)", path,
                        json_string_value(type));
                return TSR_E_UNSUPPORTED;
        }
        if ((st = hf_f64(path, rp, where, "factor", true, 0, &c->rope_factor, err, errlen)) != TSR_OK ||
            (st = hf_f64(path, rp, where, "low_freq_factor", true, 0, &c->rope_low_freq_factor, err, errlen)) !=
                    TSR_OK ||
            (st = hf_f64(path, rp, where, "high_freq_factor", true, 0, &c->rope_high_freq_factor, err, errlen)) !=
                    TSR_OK)
                return st;
        json_t *o = json_object_get(rp, "original_max_position_embeddings");
        if (!json_is_integer(o) || json_integer_value(o) <= 0 || json_integer_value(o) > (json_int_t)UINT32_MAX) {
                tsr_errf(err, errlen, "%s: field '%soriginal_max_position_embeddings': expected a positive integer",
                        path, where);
                return TSR_E_INVAL;
        }
        c->rope_original_max_pos = (uint32_t)json_integer_value(o);
        /* The ranges tsr_llama_rope_inv_freq accepts; hi == lo is Llama 4's empty band. */
        if (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) ||
            !(c->rope_high_freq_factor >= c->rope_low_freq_factor)) {
                tsr_errf(err, errlen, "%s: llama3 rope scaling needs factor > 0 and 0 < low_freq_factor <= "
                        "high_freq_factor", path);
                return TSR_E_INVAL;
        }
        c->rope_llama3 = true;
        return TSR_OK;
}

tsr_status tsr_llama_config_from_hf_json(const char *json, size_t len, const char *path, tsr_llama_config *ret,
                                         char *err, size_t errlen) {
        tsr_llama_config c = {0};
        json_error_t je;
        json_t *root, *v;
        double eps, prf;
        tsr_status st;

        if (!json || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "config.json";
        root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
        if (!root) {
                tsr_errf(err, errlen, "%s: invalid JSON at line %d column %d: %s", path, je.line, je.column, je.text);
                return TSR_E_INVAL;
        }
        if (!json_is_object(root)) {
                tsr_errf(err, errlen, "%s: expected a JSON object", path);
                st = TSR_E_INVAL;
                goto done;
        }
        if ((st = hf_architecture(path, root, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "hidden_size", true, 0, &c.dim, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "num_hidden_layers", true, 0, &c.n_layers, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "num_attention_heads", true, 0, &c.n_heads, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "num_key_value_heads", false, c.n_heads, &c.n_kv_heads, err, errlen)) !=
                    TSR_OK ||
            (st = hf_u32(path, root, "intermediate_size", true, 0, &c.hidden_dim, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "vocab_size", true, 0, &c.vocab_size, err, errlen)) != TSR_OK ||
            (st = hf_u32(path, root, "max_position_embeddings", false, 0, &c.max_seq_len, err, errlen)) != TSR_OK)
                goto done;
        if (c.dim == 0 || c.n_layers == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.hidden_dim == 0 ||
            c.vocab_size == 0) {
                tsr_errf(err, errlen, "%s: hidden_size, num_hidden_layers, num_attention_heads, "
                        "num_key_value_heads, intermediate_size and vocab_size must be non-zero", path);
                st = TSR_E_INVAL;
                goto done;
        }
        if (c.n_heads % c.n_kv_heads != 0) {
                tsr_errf(err, errlen, "%s: num_attention_heads %" PRIu32 " is not a multiple of num_key_value_heads %"
                        PRIu32, path, c.n_heads, c.n_kv_heads);
                st = TSR_E_INVAL;
                goto done;
        }
        /* LlamaConfig: head_dim = hidden_size // num_attention_heads unless given. */
        if ((st = hf_u32(path, root, "head_dim", false, c.dim / c.n_heads, &c.head_dim, err, errlen)) != TSR_OK)
                goto done;
        if (c.head_dim == 0 || c.head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: head dim %" PRIu32 " must be even and non-zero", path, c.head_dim);
                st = TSR_E_INVAL;
                goto done;
        }
        if ((st = hf_f64(path, root, "", "rms_norm_eps", false, 1e-6, &eps, err, errlen)) != TSR_OK)
                goto done;
        if (!(eps > 0)) {
                tsr_errf(err, errlen, "%s: rms_norm_eps must be positive", path);
                st = TSR_E_INVAL;
                goto done;
        }
        c.rms_eps = (float)eps;
        v = json_object_get(root, "hidden_act");
        if (v && !json_is_null(v) && (!json_is_string(v) || strcmp(json_string_value(v), "silu") != 0)) {
                tsr_errf(err, errlen, "%s: hidden_act '%.60s' is not supported (only silu)", path,
                        json_is_string(v) ? json_string_value(v) : "?");
                st = TSR_E_UNSUPPORTED;
                goto done;
        }
        if ((st = hf_must_be_false(path, root, "attention_bias", "attention biases", err, errlen)) != TSR_OK ||
            (st = hf_must_be_false(path, root, "mlp_bias", "MLP biases", err, errlen)) != TSR_OK)
                goto done;
        if ((st = hf_f64(path, root, "", "partial_rotary_factor", false, 1.0, &prf, err, errlen)) != TSR_OK)
                goto done;
        if (prf != 1.0) {
                tsr_errf(err, errlen, "%s: partial_rotary_factor %g is not supported (only 1)", path, prf);
                st = TSR_E_UNSUPPORTED;
                goto done;
        }
        if ((st = hf_rope(path, root, &c, err, errlen)) != TSR_OK)
                goto done;
        v = json_object_get(root, "tie_word_embeddings");
        if (v && !json_is_null(v) && !json_is_boolean(v)) {
                tsr_errf(err, errlen, "%s: field 'tie_word_embeddings': expected true or false", path);
                st = TSR_E_INVAL;
                goto done;
        }
        c.tied_embeddings = json_is_true(v);    /* LlamaConfig's default is false */
        *ret = c;
        st = TSR_OK;
done:
        json_decref(root);
        return st;
}

tsr_status tsr_llama_config_from_hf(const char *dir, tsr_llama_config *ret, char *err, size_t errlen) {
        char path[4096];
        struct stat sb;
        char *buf = NULL;
        size_t got = 0;
        tsr_status st;
        int fd;

        if (!dir || !ret)
                return TSR_E_INVAL;
        if ((size_t)snprintf(path, sizeof path, "%s/config.json", dir) >= sizeof path) {
                tsr_errf(err, errlen, "%s: path too long", dir);
                return TSR_E_INVAL;
        }
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
                tsr_errf(err, errlen, "%s: %s", path, strerror(errno));
                return errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO;
        }
        if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
                tsr_errf(err, errlen, "%s: not a readable regular file", path);
                st = TSR_E_IO;
                goto done;
        }
        if ((uint64_t)sb.st_size > HF_MAX_CONFIG) {
                tsr_errf(err, errlen, "%s: %lld bytes, over the %u-byte limit", path, (long long)sb.st_size,
                        HF_MAX_CONFIG);
                st = TSR_E_LIMIT;
                goto done;
        }
        if (!(buf = malloc((size_t)sb.st_size + 1))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                st = TSR_E_NOMEM;
                goto done;
        }
        while (got < (size_t)sb.st_size) {
                ssize_t n = read(fd, buf + got, (size_t)sb.st_size - got);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        tsr_errf(err, errlen, "%s: read failed: %s", path, n < 0 ? strerror(errno) : "file shrank");
                        st = TSR_E_IO;
                        goto done;
                }
                got += (size_t)n;
        }
        st = tsr_llama_config_from_hf_json(buf, got, path, ret, err, errlen);
done:
        free(buf);
        close(fd);
        return st;
}

/* ---- tensors ----------------------------------------------------------------------- */

struct hf_want {
        char name[96];
        uint64_t rows, cols;    /* cols == 0: a vector of `rows` elements */
        float **dst;
};

static void hf_want_add(struct hf_want *w, size_t *n, const char *name, uint64_t rows, uint64_t cols, float **dst) {
        struct hf_want *x = &w[(*n)++];
        snprintf(x->name, sizeof x->name, "%s", name);
        x->rows = rows;
        x->cols = cols;
        x->dst = dst;
}

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
static tsr_status hf_load_one(const tsr_safetensors_tensor *t, const char *file, const struct hf_want *w,
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

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool ends_with(const char *s, const char *suffix) {
        size_t n = strlen(s), k = strlen(suffix);
        return n >= k && strcmp(s + n - k, suffix) == 0;
}

tsr_status tsr_llama_weights_load_hf(const tsr_safetensors_set *set, const tsr_llama_config *cfg,
                                     const tsr_shard_spec *spec, tsr_load_progress_fn progress, void *ud,
                                     tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_llama_weights *w = NULL;
        struct hf_want *wants = NULL;
        size_t n_wants = 0, n_layers;
        tsr_load_stats total = {0}, done = {0};
        const char *src, *file;
        double t0 = now_s();
        tsr_status st = TSR_E_NOMEM;

        if (!set || !cfg || !spec || !ret)
                return TSR_E_INVAL;
        src = tsr_safetensors_set_source(set);
        st = tsr_llama_weights_check(cfg, spec, src, err, errlen);
        if (st != TSR_OK)
                return st;
        st = TSR_E_NOMEM;       /* what a `goto fail` below reports unless it sets st */
        /* Biases (Qwen2-style checkpoints labelled Llama) would be dropped silently. */
        for (size_t i = 0; i < tsr_safetensors_set_n_tensors(set); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_set_tensor_at(set, i, &file);
                if (ends_with(t->name, ".bias")) {
                        tsr_errf(err, errlen, "%s: tensor '%.200s': biases are not supported", file, t->name);
                        return TSR_E_UNSUPPORTED;
                }
        }
        n_layers = spec->last_layer - spec->first_layer + 1;
        w = calloc(1, sizeof *w);
        if (w)
                w->shard = *spec;       /* before layers: tsr_llama_weights_free reads it */
        if (!w || !(w->layers = calloc(n_layers, sizeof *w->layers)) ||
            !(wants = calloc(3 + 9 * n_layers, sizeof *wants))) {
                tsr_errf(err, errlen, "%s: out of memory", src);
                goto fail;
        }
        w->cfg = *cfg;

        /* transformers' LlamaForCausalLM names, in the order of weights.h. */
        uint64_t dim = cfg->dim, q_dim = (uint64_t)cfg->n_heads * cfg->head_dim;
        uint64_t kv_dim = (uint64_t)cfg->n_kv_heads * cfg->head_dim, hid = cfg->hidden_dim;
        hf_want_add(wants, &n_wants, "model.embed_tokens.weight", cfg->vocab_size, dim, &w->token_embd);
        for (size_t l = 0; l < n_layers; l++) {
                tsr_llama_layer *L = &w->layers[l];
                uint32_t i = spec->first_layer + (uint32_t)l;
                char nm[96];
#define LAYER(suffix) (snprintf(nm, sizeof nm, "model.layers.%" PRIu32 ".%s.weight", i, suffix), nm)
                hf_want_add(wants, &n_wants, LAYER("input_layernorm"), dim, 0, &L->attn_norm);
                hf_want_add(wants, &n_wants, LAYER("self_attn.q_proj"), q_dim, dim, &L->wq);
                hf_want_add(wants, &n_wants, LAYER("self_attn.k_proj"), kv_dim, dim, &L->wk);
                hf_want_add(wants, &n_wants, LAYER("self_attn.v_proj"), kv_dim, dim, &L->wv);
                hf_want_add(wants, &n_wants, LAYER("self_attn.o_proj"), dim, q_dim, &L->wo);
                hf_want_add(wants, &n_wants, LAYER("post_attention_layernorm"), dim, 0, &L->ffn_norm);
                hf_want_add(wants, &n_wants, LAYER("mlp.gate_proj"), hid, dim, &L->w_gate);
                hf_want_add(wants, &n_wants, LAYER("mlp.up_proj"), hid, dim, &L->w_up);
                hf_want_add(wants, &n_wants, LAYER("mlp.down_proj"), dim, hid, &L->w_down);
#undef LAYER
        }
        hf_want_add(wants, &n_wants, "model.norm.weight", dim, 0, &w->output_norm);
        if (!cfg->tied_embeddings)
                hf_want_add(wants, &n_wants, "lm_head.weight", cfg->vocab_size, dim, &w->output);

        /* Totals first, so progress can say how far along it is; missing tensors fail
         * before any work. */
        for (size_t i = 0; i < n_wants; i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_set_find(set, wants[i].name, NULL);
                if (!t) {
                        tsr_errf(err, errlen, "%s: tensor '%s' missing", src, wants[i].name);
                        st = TSR_E_NOTFOUND;
                        goto fail;
                }
                total.n_tensors++;
                total.file_bytes += t->n_bytes;
                total.f32_bytes += t->n_elements * sizeof(float);
        }
        for (size_t i = 0; i < n_wants; i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_set_find(set, wants[i].name, &file);
                if ((st = hf_load_one(t, file, &wants[i], wants[i].dst, err, errlen)) != TSR_OK)
                        goto fail;
                done.n_tensors++;
                done.file_bytes += t->n_bytes;
                done.f32_bytes += t->n_elements * sizeof(float);
                done.seconds = now_s() - t0;
                if (progress)
                        progress(ud, &done, &total);
        }
        if (cfg->tied_embeddings)
                w->output = w->token_embd;
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
