/* modelopt.c - ModelOpt FP8 / NVFP4 checkpoints: config detection, the --quantization
 * check, and one quantized weight with its scales (modelopt.h). */
#include "worker/load/modelopt.h"

#include <fnmatch.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant/quant.h"
#include "worker/load/hf_config.h"

const char *tsr_modelopt_algo_name(tsr_modelopt_algo a) {
        return a == TSR_MODELOPT_FP8 ? "FP8" : a == TSR_MODELOPT_NVFP4 ? "NVFP4" : "none";
}

const char *tsr_modelopt_method(tsr_modelopt_algo a) {
        return a == TSR_MODELOPT_FP8 ? "modelopt" : a == TSR_MODELOPT_NVFP4 ? "modelopt_fp4" : "none";
}

void tsr_modelopt_config_done(tsr_modelopt_config *c) {
        if (!c)
                return;
        for (size_t i = 0; i < c->n_exclude; i++)
                free(c->exclude[i]);
        free(c->exclude);
        memset(c, 0, sizeof *c);
}

/* A string field, or NULL when absent or null; TSR_E_INVAL for another type. */
static tsr_status str_field(const char *path, json_t *obj, const char *where, const char *key, const char **ret,
                            char *err, size_t errlen) {
        json_t *v = json_object_get(obj, key);
        *ret = NULL;
        if (!v || json_is_null(v))
                return TSR_OK;
        if (!json_is_string(v)) {
                tsr_errf(err, errlen, "%s: field '%s%s': expected a string", path, where, key);
                return TSR_E_INVAL;
        }
        *ret = json_string_value(v);
        return TSR_OK;
}

/* The fields of one ModelOpt quantization object, either form (`where` prefixes keys in
 * messages: "quantization_config." or "quantization."). */
static tsr_status parse_quant(const char *path, json_t *q, const char *where, const char *exclude_key,
                              tsr_modelopt_config *c, char *err, size_t errlen) {
        const char *algo, *kv_algo;
        json_t *ex, *gs, *kvs;
        tsr_status st;

        if ((st = str_field(path, q, where, "quant_algo", &algo, err, errlen)) != TSR_OK ||
            (st = str_field(path, q, where, "kv_cache_quant_algo", &kv_algo, err, errlen)) != TSR_OK)
                return st;
        if (!algo) {
                tsr_errf(err, errlen, "%s: field '%squant_algo' missing", path, where);
                return TSR_E_INVAL;
        }
        if (strcmp(algo, "FP8") == 0) {
                c->algo = TSR_MODELOPT_FP8;
        } else if (strcmp(algo, "NVFP4") == 0) {
                c->algo = TSR_MODELOPT_NVFP4;
        } else {
                tsr_errf(err, errlen, "%s: field '%squant_algo': '%.64s' is not supported (supported: FP8, NVFP4)",
                         path, where, algo);
                return TSR_E_UNSUPPORTED;
        }
        /* group_size: top level, or the weights' group of config_groups (config.json form) */
        gs = json_object_get(q, "group_size");
        if (!gs || json_is_null(gs)) {
                json_t *groups = json_object_get(q, "config_groups"), *g;
                const char *name;
                if (json_is_object(groups))
                        json_object_foreach(groups, name, g) {
                                json_t *w = json_object_get(g, "weights");
                                if (json_is_object(w) && json_object_get(w, "group_size"))
                                        gs = json_object_get(w, "group_size");
                        }
        }
        if (c->algo == TSR_MODELOPT_NVFP4) {
                if (gs && !json_is_null(gs) && (!json_is_integer(gs) || json_integer_value(gs) != 16)) {
                        char v[32] = "?";
                        if (json_is_integer(gs))
                                snprintf(v, sizeof v, "%" JSON_INTEGER_FORMAT, json_integer_value(gs));
                        tsr_errf(err, errlen, "%s: field '%sgroup_size': %s is not supported (NVFP4 uses blocks "
                                 "of 16)", path, where, v);
                        return TSR_E_UNSUPPORTED;
                }
                c->group_size = 16;
        }
        c->kv_cache_fp8 = kv_algo && strcmp(kv_algo, "FP8") == 0;
        kvs = json_object_get(q, "kv_cache_scheme");
        if (json_is_object(kvs) && json_integer_value(json_object_get(kvs, "num_bits")) == 8)
                c->kv_cache_fp8 = true;
        ex = json_object_get(q, exclude_key);
        if (ex && !json_is_null(ex)) {
                if (!json_is_array(ex)) {
                        tsr_errf(err, errlen, "%s: field '%s%s': expected a list of strings", path, where, exclude_key);
                        return TSR_E_INVAL;
                }
                c->exclude = calloc(json_array_size(ex) + 1, sizeof *c->exclude);
                if (!c->exclude)
                        return TSR_E_NOMEM;
                for (size_t i = 0; i < json_array_size(ex); i++) {
                        json_t *e = json_array_get(ex, i);
                        if (!json_is_string(e)) {
                                tsr_errf(err, errlen, "%s: field '%s%s[%zu]': expected a string", path, where,
                                         exclude_key, i);
                                return TSR_E_INVAL;
                        }
                        if (!(c->exclude[c->n_exclude] = strdup(json_string_value(e))))
                                return TSR_E_NOMEM;
                        c->n_exclude++;
                }
        }
        return TSR_OK;
}

tsr_status tsr_modelopt_config_read(const char *dir, tsr_modelopt_config *ret, char *err, size_t errlen) {
        char path[512];
        char *buf = NULL;
        size_t len;
        json_t *root = NULL, *q;
        json_error_t je;
        tsr_status st;
        bool legacy = false;

        if (!dir || !ret)
                return TSR_E_INVAL;
        memset(ret, 0, sizeof *ret);
        /* config.json first, as vLLM (its quantization_config wins over the legacy file) */
        if ((st = tsr_hf_config_read(dir, path, sizeof path, &buf, &len, err, errlen)) != TSR_OK &&
            st != TSR_E_NOTFOUND)
                return st;
        if (st == TSR_OK) {
                if (!(root = json_loadb(buf, len, 0, &je)) || !json_is_object(root)) {
                        tsr_errf(err, errlen, "%s: not a JSON object (line %d: %s)", path, je.line, je.text);
                        st = TSR_E_INVAL;
                        goto done;
                }
                q = json_object_get(root, "quantization_config");
        } else {
                q = NULL;
        }
        if (!q || json_is_null(q)) {
                json_decref(root), root = NULL;
                free(buf), buf = NULL;
                st = tsr_hf_file_read(dir, "hf_quant_config.json", path, sizeof path, &buf, &len, err, errlen);
                if (st == TSR_E_NOTFOUND) {
                        if (err && errlen)
                                err[0] = '\0';
                        st = TSR_OK;            /* no quantization announced */
                        goto done;
                }
                if (st != TSR_OK)
                        goto done;
                if (!(root = json_loadb(buf, len, 0, &je)) || !json_is_object(root)) {
                        tsr_errf(err, errlen, "%s: not a JSON object (line %d: %s)", path, je.line, je.text);
                        st = TSR_E_INVAL;
                        goto done;
                }
                q = json_object_get(root, "quantization");
                legacy = true;
                if (!json_is_object(q)) {
                        tsr_errf(err, errlen, "%s: field 'quantization' missing or not an object", path);
                        st = TSR_E_INVAL;
                        goto done;
                }
        } else {
                const char *method;
                if (!json_is_object(q)) {
                        tsr_errf(err, errlen, "%s: field 'quantization_config': expected an object", path);
                        st = TSR_E_INVAL;
                        goto done;
                }
                if ((st = str_field(path, q, "quantization_config.", "quant_method", &method, err, errlen)) != TSR_OK)
                        goto done;
                if (!method || strcmp(method, "modelopt") != 0) {
                        tsr_errf(err, errlen, "%s: field 'quantization_config.quant_method': '%.64s' is not "
                                 "supported (supported: modelopt, with quant_algo FP8 or NVFP4)", path,
                                 method ? method : "(missing)");
                        st = TSR_E_UNSUPPORTED;
                        goto done;
                }
        }
        snprintf(ret->source, sizeof ret->source, "%s", path);
        st = parse_quant(path, q, legacy ? "quantization." : "quantization_config.",
                         legacy ? "exclude_modules" : "ignore", ret, err, errlen);
        if (st == TSR_E_NOMEM)
                tsr_errf(err, errlen, "%s: out of memory", path);
done:
        if (st != TSR_OK)
                tsr_modelopt_config_done(ret);
        json_decref(root);
        free(buf);
        return st;
}

tsr_status tsr_modelopt_check_flag(const tsr_modelopt_config *c, const char *flag, const char *dir, char *err,
                                   size_t errlen) {
        if (!flag)
                return TSR_OK;
        if (c->algo == TSR_MODELOPT_NONE) {
                tsr_errf(err, errlen, "argument --quantization: '%s' does not match the checkpoint: %s announces no "
                         "quantization (no quantization_config in config.json, no hf_quant_config.json); quantizing "
                         "an unquantized checkpoint at load is not supported", flag, dir);
                return TSR_E_INVAL;
        }
        if (strcmp(flag, tsr_modelopt_method(c->algo)) == 0 ||
            (c->algo == TSR_MODELOPT_FP8 && strcmp(flag, "fp8") == 0))
                return TSR_OK;
        tsr_errf(err, errlen, "argument --quantization: '%s' does not match the checkpoint: %s says quant_algo %s "
                 "(use --quantization %s, or leave it unset)", flag, c->source, tsr_modelopt_algo_name(c->algo),
                 tsr_modelopt_method(c->algo));
        return TSR_E_INVAL;
}

static bool match_one(const char *pattern, const char *module) {
        return strcmp(pattern, module) == 0 || strstr(module, pattern) != NULL || fnmatch(pattern, module, 0) == 0;
}

bool tsr_modelopt_excluded(const tsr_modelopt_config *c, const char *module) {
        static const char lm[] = "language_model.";
        for (size_t i = 0; c && i < c->n_exclude; i++) {
                if (match_one(c->exclude[i], module))
                        return true;
                if (strncmp(module, lm, sizeof lm - 1) == 0 && match_one(c->exclude[i], module + sizeof lm - 1))
                        return true;
        }
        return false;
}

size_t tsr_modelopt_unmatched_excludes(const tsr_modelopt_config *c, const tsr_safetensors_set *set,
                                       const char **out, size_t cap) {
        size_t n_out = 0;
        for (size_t i = 0; c && i < c->n_exclude; i++) {
                bool hit = false;
                tsr_modelopt_config one = {.exclude = &c->exclude[i], .n_exclude = 1};
                for (size_t k = 0; !hit && k < tsr_safetensors_set_n_tensors(set); k++) {
                        const tsr_safetensors_tensor *t = tsr_safetensors_set_tensor_at(set, k, NULL);
                        char module[256];
                        size_t n = strlen(t->name);
                        if (n > 7 && strcmp(t->name + n - 7, ".weight") == 0)
                                n -= 7;
                        snprintf(module, sizeof module, "%.*s", (int)n, t->name);
                        hit = tsr_modelopt_excluded(&one, module);
                }
                if (!hit && n_out++ < cap)
                        out[n_out - 1] = c->exclude[i];
        }
        return n_out;
}

bool tsr_modelopt_weight_dtype(tsr_safetensors_dtype d) { return d == TSR_ST_F8_E4M3 || d == TSR_ST_U8; }

/* The scalar companion `module`.`suffix` (F32, shape [] or [1]) into *ret: finite, > 0. */
static tsr_status scalar_sep(const tsr_safetensors_set *set, const char *module, const char *sep, const char *suffix,
                             float *ret, char *err, size_t errlen) {
        char name[300];
        const char *file;
        snprintf(name, sizeof name, "%s%s%s", module, sep, suffix);
        const tsr_safetensors_tensor *t = tsr_safetensors_set_find(set, name, &file);
        if (!t) {
                tsr_errf(err, errlen, "%s: tensor '%s' missing (a quantized weight needs its %s)",
                         tsr_safetensors_set_source(set), name, suffix);
                return TSR_E_INVAL;
        }
        if (t->dtype != TSR_ST_F32 || t->n_elements != 1 || t->n_dims > 1) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s, %" PRIu32 " dims, %" PRIu64
                         " elements; expected a F32 scalar (shape [] or [1])", file, name,
                         tsr_safetensors_dtype_name(t->dtype), t->n_dims, t->n_elements);
                return TSR_E_INVAL;
        }
        float v;
        memcpy(&v, t->data, sizeof v);
        if (!isfinite(v) || !(v > 0)) {
                tsr_errf(err, errlen, "%s: tensor '%s': %g is not a finite positive scale", file, name, (double)v);
                return TSR_E_INVAL;
        }
        *ret = v;
        return TSR_OK;
}

/* The F32 scalar "<module>.<suffix>" (a linear's weight_scale, input_scale, ...). */
static tsr_status scalar(const tsr_safetensors_set *set, const char *module, const char *suffix, float *ret,
                         char *err, size_t errlen) {
        return scalar_sep(set, module, ".", suffix, ret, err, errlen);
}

tsr_status tsr_modelopt_input_scale(const tsr_safetensors_set *set, const char *module, float *ret, char *err,
                                    size_t errlen) {
        return scalar(set, module, "input_scale", ret, err, errlen);
}

static void shape_str(const tsr_safetensors_tensor *t, char *buf, size_t len) {
        size_t n = (size_t)snprintf(buf, len, "[");
        for (uint32_t i = 0; i < t->n_dims && n < len; i++)
                n += (size_t)snprintf(buf + n, len - n, "%s%" PRIu64, i ? ", " : "", t->shape[i]);
        if (n < len)
                snprintf(buf + n, len - n, "]");
}

tsr_status tsr_modelopt_load_weight(const tsr_modelopt_config *c, const tsr_safetensors_set *set, const char *module,
                                    const tsr_safetensors_tensor *weight, const char *file, uint64_t rows,
                                    uint64_t cols, tsr_tensor *ret, char *err, size_t errlen) {
        bool nv = c && c->algo == TSR_MODELOPT_NVFP4;
        tsr_dtype dt = nv ? TSR_DTYPE_NVFP4 : TSR_DTYPE_FP8_E4M3;
        tsr_safetensors_dtype want = nv ? TSR_ST_U8 : TSR_ST_F8_E4M3;
        const tsr_safetensors_tensor *sc = NULL;
        tsr_matmul_scales s = {0};
        char got[96], name[300];
        const char *sfile = file;
        tsr_tensor tt;
        tsr_status st;

        if (!c || c->algo == TSR_MODELOPT_NONE || weight->dtype != want) {
                tsr_errf(err, errlen, "%s: tensor '%s.weight': dtype %s, which %s (%s)", file, module,
                         tsr_safetensors_dtype_name(weight->dtype),
                         !c || c->algo == TSR_MODELOPT_NONE ? "the checkpoint's config does not announce"
                                                            : "does not match the announced quant_algo",
                         !c || c->algo == TSR_MODELOPT_NONE ? "no quantization_config or hf_quant_config.json"
                                                            : tsr_modelopt_algo_name(c->algo));
                return TSR_E_INVAL;
        }
        if (tsr_modelopt_excluded(c, module)) {
                tsr_errf(err, errlen, "%s: tensor '%s.weight' is %s but %s excludes module '%s' from quantization",
                         file, module, tsr_safetensors_dtype_name(weight->dtype), c->source, module);
                return TSR_E_INVAL;
        }
        shape_str(weight, got, sizeof got);
        if (weight->n_dims != 2 || weight->shape[0] != rows || weight->shape[1] != (nv ? cols / 2 : cols) ||
            (nv && cols % 16 != 0)) {
                tsr_errf(err, errlen, "%s: tensor '%s.weight': shape %s, expected [%" PRIu64 ", %" PRIu64 "]%s", file,
                         module, got, rows, nv ? cols / 2 : cols, nv ? " (two e2m1 codes per byte)" : "");
                return TSR_E_INVAL;
        }
        if ((st = scalar(set, module, nv ? "weight_scale_2" : "weight_scale", &s.weight, err, errlen)) != TSR_OK ||
            (st = scalar(set, module, "input_scale", &s.input, err, errlen)) != TSR_OK)
                return st;
        if (nv) {
                snprintf(name, sizeof name, "%s.weight_scale", module);
                if (!(sc = tsr_safetensors_set_find(set, name, &sfile))) {
                        tsr_errf(err, errlen, "%s: tensor '%s' missing (an NVFP4 weight needs its block scales)",
                                 tsr_safetensors_set_source(set), name);
                        return TSR_E_INVAL;
                }
                shape_str(sc, got, sizeof got);
                if (sc->dtype != TSR_ST_F8_E4M3 || sc->n_dims != 2 || sc->shape[0] != rows || sc->shape[1] == 0) {
                        tsr_errf(err, errlen, "%s: tensor '%s': dtype %s shape %s, expected F8_E4M3 [%" PRIu64
                                 ", %" PRIu64 "]", sfile, name, tsr_safetensors_dtype_name(sc->dtype), got, rows,
                                 cols / 16);
                        return TSR_E_INVAL;
                }
                if (sc->shape[1] != cols / 16) {
                        tsr_errf(err, errlen, "%s: tensor '%s': shape %s gives a block size of %.4g for %" PRIu64
                                 " columns; NVFP4 needs blocks of 16 (shape [%" PRIu64 ", %" PRIu64 "])", sfile,
                                 name, got, (double)cols / (double)sc->shape[1], cols, rows, cols / 16);
                        return TSR_E_INVAL;
                }
        }
        size_t shape[2] = {(size_t)rows, (size_t)cols};
        if ((st = tsr_tensor_init(&tt, dt, 2, shape, NULL, NULL)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: tensor '%s.weight': bad shape for %s", file, module, tsr_dtype_name(dt));
                return st;
        }
        size_t bytes = tsr_tensor_n_bytes(&tt);
        uint8_t *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!buf) {
                tsr_errf(err, errlen, "%s: tensor '%s.weight': out of memory", file, module);
                return TSR_E_NOMEM;
        }
        if (!nv) {
                memcpy(buf, weight->data, bytes);
        } else {        /* regroup: per row, each block's scale byte then its 8 code bytes */
                const uint8_t *codes = weight->data, *scales = sc->data;
                size_t nb = cols / 16;
                for (size_t r = 0; r < rows; r++)
                        for (size_t b = 0; b < nb; b++) {
                                uint8_t *o = buf + (r * nb + b) * 9;
                                o[0] = scales[r * nb + b];
                                memcpy(o + 1, codes + r * (cols / 2) + 8 * b, 8);
                        }
        }
        tt.data = buf;
        tt.scales = s;
        *ret = tt;
        return TSR_OK;
}

tsr_status tsr_modelopt_load_stack(const tsr_modelopt_config *c, const tsr_safetensors_set *set, const char *name,
                                   const tsr_safetensors_tensor *weight, const char *file, uint64_t experts,
                                   uint64_t rows, uint64_t cols, tsr_tensor *ret, char *err, size_t errlen) {
        tsr_matmul_scales s = {0};
        char got[96];
        tsr_status st;

        if (!c || c->algo == TSR_MODELOPT_NONE || weight->dtype != TSR_ST_F8_E4M3) {
                tsr_errf(err, errlen, "%s: tensor '%s': dtype %s, which %s (%s)", file, name,
                         tsr_safetensors_dtype_name(weight->dtype),
                         !c || c->algo == TSR_MODELOPT_NONE ? "the checkpoint's config does not announce"
                         : c->algo == TSR_MODELOPT_NVFP4
                                 ? "is not read as an NVFP4 expert stack (the per-expert layout, "
                                   "experts.<e>.{gate,up,down}_proj, is)"
                                 : "does not match the announced quant_algo",
                         !c || c->algo == TSR_MODELOPT_NONE ? "no quantization_config or hf_quant_config.json"
                                                            : tsr_modelopt_algo_name(c->algo));
                return c && c->algo == TSR_MODELOPT_NVFP4 ? TSR_E_UNSUPPORTED : TSR_E_INVAL;
        }
        if (tsr_modelopt_excluded(c, name)) {
                tsr_errf(err, errlen, "%s: tensor '%s' is %s but %s excludes module '%s' from quantization", file,
                         name, tsr_safetensors_dtype_name(weight->dtype), c->source, name);
                return TSR_E_INVAL;
        }
        shape_str(weight, got, sizeof got);
        if (weight->n_dims != 3 || weight->shape[0] != experts || weight->shape[1] != rows ||
            weight->shape[2] != cols) {
                tsr_errf(err, errlen, "%s: tensor '%s': shape %s, expected [%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]",
                         file, name, got, experts, rows, cols);
                return TSR_E_INVAL;
        }
        if ((st = scalar_sep(set, name, "_", "weight_scale", &s.weight, err, errlen)) != TSR_OK ||
            (st = scalar_sep(set, name, "_", "input_scale", &s.input, err, errlen)) != TSR_OK)
                return st;
        size_t shape[3] = {(size_t)experts, (size_t)rows, (size_t)cols};
        tsr_tensor tt;
        if ((st = tsr_tensor_init(&tt, TSR_DTYPE_FP8_E4M3, 3, shape, NULL, NULL)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: tensor '%s': bad shape", file, name);
                return st;
        }
        size_t bytes = tsr_tensor_n_bytes(&tt);
        if (!(tt.data = aligned_alloc(64, (bytes + 63) / 64 * 64))) {
                tsr_errf(err, errlen, "%s: tensor '%s': out of memory", file, name);
                return TSR_E_NOMEM;
        }
        memcpy(tt.data, weight->data, bytes);
        tt.scales = s;
        *ret = tt;
        return TSR_OK;
}

tsr_status tsr_modelopt_kv_scales(const tsr_safetensors_set *set, const char *layer_fmt, uint32_t first, uint32_t n,
                                  float *k_scale, float *v_scale, uint32_t *n_found, char *err, size_t errlen) {
        /* The forms vLLM's loaders accept, most specific first: ModelOpt's per projection,
         * the attention module's own pair, then one scale for both (the deprecated
         * kv_scale, TensorRT-LLM's kv_cache_scaling_factor). */
        static const struct { const char *k, *v; } forms[] = {
                {"k_proj.k_scale", "v_proj.v_scale"}, {"k_scale", "v_scale"},
                {"kv_scale", NULL},                   {"kv_cache_scaling_factor", NULL},
        };
        char layer[256], name[320];
        tsr_status st;

        if (!set || !layer_fmt || !k_scale || !v_scale || !n_found)
                return TSR_E_INVAL;
        *n_found = 0;
        for (uint32_t i = 0; i < n; i++) {
                snprintf(layer, sizeof layer, layer_fmt, first + i);
                for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
                        snprintf(name, sizeof name, "%s.%s", layer, forms[f].k);
                        bool has_k = tsr_safetensors_set_find(set, name, NULL) != NULL;
                        snprintf(name, sizeof name, "%s.%s", layer, forms[f].v ? forms[f].v : forms[f].k);
                        bool has_v = forms[f].v && tsr_safetensors_set_find(set, name, NULL) != NULL;
                        if (!has_k && !has_v)
                                continue;
                        if ((has_k && (st = scalar(set, layer, forms[f].k, &k_scale[i], err, errlen)) != TSR_OK) ||
                            (has_v && (st = scalar(set, layer, forms[f].v, &v_scale[i], err, errlen)) != TSR_OK))
                                return st;
                        if (!has_v)     /* vLLM duplicates the one scale a layer has */
                                v_scale[i] = k_scale[i];
                        else if (!has_k)
                                k_scale[i] = v_scale[i];
                        (*n_found)++;
                        break;
                }
        }
        return TSR_OK;
}
