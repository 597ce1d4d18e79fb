/* llama4_config.c - a Llama 4 text model's config.json (llama4.h).
 *
 * The fields a dense Llama shares (sizes, heads, eps, RoPE, biases, activation) go
 * through the Llama reader (tsr_llama_config_from_hf_object) on the text config; the
 * Llama 4 fields and the per-layer lists are read here, with the defaults and the
 * derivations of transformers 5's Llama4TextConfig.__post_init__.  Blocking file I/O,
 * start-up only; non-logging. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "worker/load/hf_config.h"
#include "worker/model/llama4.h"

/* A positive finite number; absent or null: *ret = def. */
static tsr_status get_pos(const char *path, json_t *o, const char *key, double def, float *ret, char *err,
                          size_t errlen) {
        json_t *v = json_object_get(o, key);
        if (!v || json_is_null(v)) {
                *ret = (float)def;
                return TSR_OK;
        }
        if (!json_is_number(v) || !(json_number_value(v) > 0) || !isfinite(json_number_value(v))) {
                tsr_errf(err, errlen, "%s: field '%s': expected a positive number", path, key);
                return TSR_E_INVAL;
        }
        *ret = (float)json_number_value(v);
        return TSR_OK;
}

/* A boolean, or an integer read as Python's truth (Scout's attn_temperature_tuning is 4). */
static tsr_status get_truth(const char *path, json_t *o, const char *key, bool def, bool *ret, char *err,
                            size_t errlen) {
        json_t *v = json_object_get(o, key);
        if (!v || json_is_null(v))
                *ret = def;
        else if (json_is_boolean(v))
                *ret = json_is_true(v);
        else if (json_is_integer(v))
                *ret = json_integer_value(v) != 0;
        else {
                tsr_errf(err, errlen, "%s: field '%s': expected true or false", path, key);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* Which object holds the text model's fields: the root (Llama4ForCausalLM, model_type
 * llama4_text) or its text_config (Llama4ForConditionalGeneration, model_type llama4). */
static tsr_status text_object(const char *path, json_t *root, json_t **text, bool *nested, char *err,
                              size_t errlen) {
        json_t *archs = json_object_get(root, "architectures"), *mt = json_object_get(root, "model_type");
        const char *name;

        if (archs && !json_is_null(archs)) {
                if (!json_is_array(archs) || json_array_size(archs) != 1 || !json_is_string(json_array_get(archs, 0))) {
                        tsr_errf(err, errlen, "%s: field 'architectures': expected a list of one string", path);
                        return TSR_E_INVAL;
                }
                name = json_string_value(json_array_get(archs, 0));
                *nested = strcmp(name, "Llama4ForConditionalGeneration") == 0;
                if (!*nested && strcmp(name, "Llama4ForCausalLM") != 0) {
                        tsr_errf(err, errlen, "%s: architecture '%.100s' is not supported (Llama4ForCausalLM and "
                                "Llama4ForConditionalGeneration are)", path, name);
                        return TSR_E_UNSUPPORTED;
                }
        } else if (json_is_string(mt) && (strcmp(json_string_value(mt), "llama4") == 0 ||
                                          strcmp(json_string_value(mt), "llama4_text") == 0)) {
                *nested = strcmp(json_string_value(mt), "llama4") == 0;
        } else {
                tsr_errf(err, errlen, "%s: neither 'architectures' nor 'model_type' names a Llama 4 model", path);
                return TSR_E_UNSUPPORTED;
        }
        *text = *nested ? json_object_get(root, "text_config") : root;
        if (!json_is_object(*text)) {
                tsr_errf(err, errlen, "%s: field 'text_config' missing or not an object", path);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* The per-layer lists of `t` into c->layer[] (n = c->base.n_layers). */
static tsr_status layer_lists(const char *path, json_t *t, tsr_llama4_config *c, char *err, size_t errlen) {
        uint32_t n = c->base.n_layers, interval, step;
        json_t *nr = json_object_get(t, "no_rope_layers"), *moe = json_object_get(t, "moe_layers");
        json_t *types = json_object_get(t, "layer_types"), *v;
        size_t i;
        tsr_status st;

        if ((st = tsr_hf_u32_in(path, t, "no_rope_layer_interval", 4, 1, UINT32_MAX, &interval, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32_in(path, t, "interleave_moe_layer_step", 1, 1, UINT32_MAX, &step, err, errlen)) != TSR_OK)
                return st;
        /* no_rope_layers: 1 = RoPE.  Absent, null or empty: every interval-th layer is NoPE. */
        if (nr && !json_is_null(nr) && !json_is_array(nr)) {
                tsr_errf(err, errlen, "%s: field 'no_rope_layers': expected a list", path);
                return TSR_E_INVAL;
        }
        if (json_array_size(nr) > 0 && json_array_size(nr) < n) {
                tsr_errf(err, errlen, "%s: field 'no_rope_layers': %zu entries for %" PRIu32 " layers", path,
                        json_array_size(nr), n);
                return TSR_E_INVAL;
        }
        for (uint32_t l = 0; l < n; l++) {
                bool rope = (l + 1) % interval != 0;
                if (json_array_size(nr) > 0) {
                        v = json_array_get(nr, l);
                        if (!json_is_integer(v) && !json_is_boolean(v)) {
                                tsr_errf(err, errlen, "%s: field 'no_rope_layers[%" PRIu32 "]': expected 0 or 1", path,
                                        l);
                                return TSR_E_INVAL;
                        }
                        rope = json_is_integer(v) ? json_integer_value(v) != 0 : json_is_true(v);
                }
                c->layer[l] = rope ? TSR_LLAMA4_ROPE : 0;
        }
        /* moe_layers: absent or null: step-1, 2*step-1, ...; a list (even empty) as given. */
        if (moe && !json_is_null(moe)) {
                if (!json_is_array(moe)) {
                        tsr_errf(err, errlen, "%s: field 'moe_layers': expected a list", path);
                        return TSR_E_INVAL;
                }
                json_array_foreach(moe, i, v) {
                        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= n) {
                                tsr_errf(err, errlen, "%s: field 'moe_layers[%zu]': expected a layer index below %"
                                        PRIu32, path, i, n);
                                return TSR_E_INVAL;
                        }
                        c->layer[json_integer_value(v)] |= TSR_LLAMA4_MOE;
                }
        } else {
                for (uint32_t l = step - 1; l < n; l += step)
                        c->layer[l] |= TSR_LLAMA4_MOE;
        }
        /* layer_types: absent or null: chunked where RoPE and a chunk size is set. */
        if (types && !json_is_null(types) && (!json_is_array(types) || json_array_size(types) != n)) {
                tsr_errf(err, errlen, "%s: field 'layer_types': expected a list of %" PRIu32 " strings", path, n);
                return TSR_E_INVAL;
        }
        for (uint32_t l = 0; l < n; l++) {
                bool chunked = (c->layer[l] & TSR_LLAMA4_ROPE) && c->chunk;
                if (types && !json_is_null(types)) {
                        const char *s = json_string_value(json_array_get(types, l));
                        if (!s || (strcmp(s, "chunked_attention") != 0 && strcmp(s, "full_attention") != 0)) {
                                tsr_errf(err, errlen, "%s: field 'layer_types[%" PRIu32 "]': '%.40s' is not supported "
                                        "(chunked_attention and full_attention are)", path, l, s ? s : "?");
                                return s ? TSR_E_UNSUPPORTED : TSR_E_INVAL;
                        }
                        chunked = strcmp(s, "chunked_attention") == 0;
                        if (chunked && !c->chunk) {
                                tsr_errf(err, errlen, "%s: layer %" PRIu32 " is chunked_attention but "
                                        "attention_chunk_size is null", path, l);
                                return TSR_E_INVAL;
                        }
                }
                if (chunked)
                        c->layer[l] |= TSR_LLAMA4_CHUNKED;
        }
        return TSR_OK;
}

/* The config from a parsed config.json. */
static tsr_status from_root(json_t *root, const char *path, tsr_llama4_config **ret, char *err, size_t errlen) {
        tsr_llama4_config *c = NULL;
        tsr_llama_config base;
        json_t *t = NULL, *v;
        bool nested = false;
        tsr_status st;

        if (!json_is_object(root)) {
                tsr_errf(err, errlen, "%s: expected a JSON object", path);
                return TSR_E_INVAL;
        }
        if ((st = text_object(path, root, &t, &nested, err, errlen)) != TSR_OK ||
            (st = tsr_llama_config_from_hf_object(t, path, &base, err, errlen)) != TSR_OK)
                return st;
        if (!(c = calloc(1, sizeof *c + base.n_layers))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                return TSR_E_NOMEM;
        }
        c->base = base;
        /* Llama 4 checkpoints store q/k rows for HF's complex (interleaved-pairs) RoPE. */
        c->base.rope_layout = TSR_ROPE_INTERLEAVED;
        v = json_object_get(t, "rms_norm_eps");
        if (!v || json_is_null(v))
                c->base.rms_eps = 1e-5f;        /* Llama4TextConfig's default (LlamaConfig's is 1e-6) */
        c->nested = nested;
        v = json_object_get(t, "attention_chunk_size");
        if ((st = tsr_hf_u32_in(path, t, "intermediate_size_mlp", 16384, 1, UINT32_MAX, &c->mlp_dim, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32_in(path, t, "num_local_experts", 16, 1, 1u << 16, &c->n_experts, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32_in(path, t, "num_experts_per_tok", 1, 1, c->n_experts, &c->top_k, err, errlen)) != TSR_OK ||
            /* absent: transformers' 8192; null: no chunked layers */
            (st = tsr_hf_u32_in(path, t, "attention_chunk_size", v ? 0 : 8192, 1, UINT32_MAX, &c->chunk, err, errlen)) !=
                    TSR_OK ||
            (st = get_truth(path, t, "use_qk_norm", true, &c->qk_norm, err, errlen)) != TSR_OK ||
            (st = get_truth(path, t, "attn_temperature_tuning", true, &c->temp_tuning, err, errlen)) != TSR_OK ||
            (st = get_pos(path, t, "floor_scale", 8192, &c->floor_scale, err, errlen)) != TSR_OK ||
            (st = get_pos(path, t, "attn_scale", 0.1, &c->attn_scale, err, errlen)) != TSR_OK ||
            (st = layer_lists(path, t, c, err, errlen)) != TSR_OK) {
                free(c);
                return st;
        }
        *ret = c;
        return TSR_OK;
}

/* "llama4.<key>", required, as a u32 in [lo, hi] (gguf.h's reader, then the range). */
static tsr_status gguf_u32(const tsr_gguf *g, const char *path, const char *key, uint32_t lo, uint32_t hi,
                           uint32_t *ret, char *err, size_t errlen) {
        tsr_status st = tsr_gguf_arch_u32(g, path, "llama4", key, true, 0, -1, ret, err, errlen);
        if (st == TSR_OK && (*ret < lo || *ret > hi)) {
                tsr_errf(err, errlen, "%s: metadata key 'llama4.%s' %" PRIu32 " out of range (expected [%" PRIu32
                        ", %" PRIu32 "])", path, key, *ret, lo, hi);
                return TSR_E_INVAL;
        }
        return st;
}

tsr_status tsr_llama4_config_from_gguf(const tsr_gguf *g, const char *path, tsr_llama4_config **ret, char *err,
                                       size_t errlen) {
        tsr_llama_config base;
        tsr_llama4_config *c;
        uint32_t step, ffn_exp;
        uint64_t swa;
        tsr_status st;

        if (!g || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "<gguf>";
        if ((st = tsr_llama_config_from_gguf_arch(g, path, "llama4", &base, err, errlen)) != TSR_OK)
                return st;
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, "llama4.attention.sliding_window");
        if (kv && tsr_gguf_get_u64(&kv->value, &swa) == TSR_OK && swa == 0) {
                tsr_errf(err, errlen, "%s: llama4.attention.sliding_window 0 (every layer full attention, as "
                        "llama.cpp converts MobileLLM-R1) is not supported: serve its Hugging Face folder", path);
                return TSR_E_UNSUPPORTED;
        }
        if (!(c = calloc(1, sizeof *c + base.n_layers))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                return TSR_E_NOMEM;
        }
        c->base = base;
        c->mlp_dim = base.hidden_dim;           /* feed_forward_length: the dense layers' */
        if ((st = gguf_u32(g, path, "expert_count", 1, 1u << 16, &c->n_experts, err, errlen)) != TSR_OK ||
            (st = gguf_u32(g, path, "expert_used_count", 1, c->n_experts, &c->top_k, err, errlen)) != TSR_OK ||
            (st = gguf_u32(g, path, "expert_feed_forward_length", 1, UINT32_MAX, &ffn_exp, err, errlen)) != TSR_OK ||
            (st = gguf_u32(g, path, "interleave_moe_layer_step", 1, UINT32_MAX, &step, err, errlen)) != TSR_OK) {
                free(c);
                return st;
        }
        c->base.hidden_dim = ffn_exp;
        c->base.rope_layout = TSR_ROPE_INTERLEAVED;    /* the converter does not permute Llama 4's q/k */
        c->chunk = 8192;
        c->qk_norm = c->n_experts != 128;
        c->temp_tuning = true;
        c->floor_scale = 8192;
        c->attn_scale = 0.1f;
        c->gguf = true;
        for (uint32_t l = 0; l < base.n_layers; l++) {
                bool rope = (l + 1) % 4 != 0;
                c->layer[l] = (rope ? TSR_LLAMA4_ROPE | TSR_LLAMA4_CHUNKED : 0) |
                              ((l + 1) % step == 0 ? TSR_LLAMA4_MOE : 0);
        }
        *ret = c;
        return TSR_OK;
}

tsr_status tsr_llama4_config_from_hf_json(const char *json, size_t len, const char *path, tsr_llama4_config **ret,
                                          char *err, size_t errlen) {
        json_error_t je;
        json_t *root;
        tsr_status st;

        if (!json || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "config.json";
        if (!(root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je))) {
                tsr_errf(err, errlen, "%s: invalid JSON at line %d column %d: %s", path, je.line, je.column, je.text);
                return TSR_E_INVAL;
        }
        st = from_root(root, path, ret, err, errlen);
        json_decref(root);
        return st;
}

tsr_status tsr_llama4_config_from_hf(const char *dir, tsr_llama4_config **ret, char *err, size_t errlen) {
        char path[4096], *buf = NULL;
        size_t len = 0;
        tsr_status st;

        if (!dir || !ret)
                return TSR_E_INVAL;
        if ((st = tsr_hf_config_read(dir, path, sizeof path, &buf, &len, err, errlen)) != TSR_OK)
                return st;
        st = tsr_llama4_config_from_hf_json(buf, len, path, ret, err, errlen);
        free(buf);
        return st;
}
