/* llama_config_hf.c - Llama config from a Hugging Face config.json, and its safetensors
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

#include "worker/load/hf_config.h"
#include "worker/model/llama_weights.h"

/* ---- config ------------------------------------------------------------------------ */

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
                st = tsr_hf_f64(path, rp, where, "rope_theta", true, 0, &c->rope_theta, err, errlen);
        else
                st = tsr_hf_f64(path, root, "", "rope_theta", false, 10000.0, &c->rope_theta, err, errlen);
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
        if ((st = tsr_hf_f64(path, rp, where, "factor", true, 0, &c->rope_factor, err, errlen)) != TSR_OK ||
            (st = tsr_hf_f64(path, rp, where, "low_freq_factor", true, 0, &c->rope_low_freq_factor, err, errlen)) !=
                    TSR_OK ||
            (st = tsr_hf_f64(path, rp, where, "high_freq_factor", true, 0, &c->rope_high_freq_factor, err, errlen)) !=
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
        json_error_t je;
        json_t *root;
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
        } else if ((st = hf_architecture(path, root, err, errlen)) == TSR_OK) {
                st = tsr_llama_config_from_hf_object(root, path, ret, err, errlen);
        }
        json_decref(root);
        return st;
}

tsr_status tsr_llama_config_from_hf_object(struct json_t *root, const char *path, tsr_llama_config *ret, char *err,
                                           size_t errlen) {
        tsr_llama_config c = {0};
        json_t *v;
        double eps, prf;
        tsr_status st;

        if (!json_is_object(root) || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "config.json";
        if ((st = tsr_hf_u32(path, root, "hidden_size", true, 0, &c.dim, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "num_hidden_layers", true, 0, &c.n_layers, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "num_attention_heads", true, 0, &c.n_heads, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "num_key_value_heads", false, c.n_heads, &c.n_kv_heads, err, errlen)) !=
                    TSR_OK ||
            (st = tsr_hf_u32(path, root, "intermediate_size", true, 0, &c.hidden_dim, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "vocab_size", true, 0, &c.vocab_size, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "max_position_embeddings", false, 0, &c.max_seq_len, err, errlen)) != TSR_OK)
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
        if ((st = tsr_hf_u32(path, root, "head_dim", false, c.dim / c.n_heads, &c.head_dim, err, errlen)) != TSR_OK)
                goto done;
        if (c.head_dim == 0 || c.head_dim % 2 != 0) {
                tsr_errf(err, errlen, "%s: head dim %" PRIu32 " must be even and non-zero", path, c.head_dim);
                st = TSR_E_INVAL;
                goto done;
        }
        if ((st = tsr_hf_f64(path, root, "", "rms_norm_eps", false, 1e-6, &eps, err, errlen)) != TSR_OK)
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
        if ((st = tsr_hf_f64(path, root, "", "partial_rotary_factor", false, 1.0, &prf, err, errlen)) != TSR_OK)
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
        return st;
}

tsr_status tsr_llama_config_from_hf(const char *dir, tsr_llama_config *ret, char *err, size_t errlen) {
        char path[4096], *buf = NULL;
        size_t len = 0;
        tsr_status st;

        if (!dir || !ret)
                return TSR_E_INVAL;
        if ((st = tsr_hf_config_read(dir, path, sizeof path, &buf, &len, err, errlen)) != TSR_OK)
                return st;
        st = tsr_llama_config_from_hf_json(buf, len, path, ret, err, errlen);
        free(buf);
        return st;
}
