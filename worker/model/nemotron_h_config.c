/* nemotron_h_config.c - a NemotronH's config.json (transformers' NemotronHConfig field
 * names and defaults; models.md §3.1).  Main thread, at start-up.
 *
 * Both spellings of the layer pattern occur: checkpoints ship hybrid_override_pattern
 * ("MEM*E..."), transformers 5 writes layers_block_type (a list of "mamba" /
 * "linear_attention", "attention" / "full_attention", "moe", "mlp"). */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "worker/load/hf_config.h"
#include "worker/model/nemotron_h.h"

/* A string field that, when present, must be `want` (a variant this family lacks). */
static tsr_status want_str(const char *path, json_t *root, const char *key, const char *want, char *err,
                           size_t errlen) {
        json_t *v = json_object_get(root, key);

        if (!v || json_is_null(v) || (json_is_string(v) && strcmp(json_string_value(v), want) == 0))
                return TSR_OK;
        tsr_errf(err, errlen, "%s: field '%s' is '%.60s': only '%s' is supported", path, key,
                json_is_string(v) ? json_string_value(v) : "?", want);
        return TSR_E_UNSUPPORTED;
}

static char block_char(const char *type) {
        static const struct { const char *name; char c; } map[] = {
                {"mamba", 'M'}, {"linear_attention", 'M'}, {"attention", '*'}, {"full_attention", '*'},
                {"moe", 'E'}, {"mlp", '-'},
        };
        for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
                if (strcmp(map[i].name, type) == 0)
                        return map[i].c;
        return 0;
}

static tsr_status read_pattern(const char *path, json_t *root, tsr_nemotron_h_config *c, char *err, size_t errlen) {
        json_t *pat = json_object_get(root, "hybrid_override_pattern");
        json_t *list = json_object_get(root, "layers_block_type");
        size_t n;

        if (pat && !json_is_null(pat)) {
                const char *s = json_is_string(pat) ? json_string_value(pat) : NULL;
                if (!s || !*s || (n = strlen(s)) > TSR_NEMOTRON_H_MAX_LAYERS || strspn(s, "M*E-") != n) {
                        tsr_errf(err, errlen, "%s: field 'hybrid_override_pattern': expected 1..%d of 'M', '*', "
                                "'E', '-'", path, TSR_NEMOTRON_H_MAX_LAYERS);
                        return TSR_E_INVAL;
                }
                memcpy(c->pattern, s, n + 1);
        } else if (list && !json_is_null(list)) {
                n = json_is_array(list) ? json_array_size(list) : 0;
                if (n == 0 || n > TSR_NEMOTRON_H_MAX_LAYERS) {
                        tsr_errf(err, errlen, "%s: field 'layers_block_type': expected a list of 1..%d names", path,
                                TSR_NEMOTRON_H_MAX_LAYERS);
                        return TSR_E_INVAL;
                }
                for (size_t i = 0; i < n; i++) {
                        json_t *e = json_array_get(list, i);
                        char ch = json_is_string(e) ? block_char(json_string_value(e)) : 0;
                        if (!ch) {
                                tsr_errf(err, errlen, "%s: field 'layers_block_type'[%zu]: not a known block type",
                                        path, i);
                                return TSR_E_INVAL;
                        }
                        c->pattern[i] = ch;
                }
                c->pattern[n] = 0;
        } else {
                tsr_errf(err, errlen, "%s: neither 'hybrid_override_pattern' nor 'layers_block_type' is given", path);
                return TSR_E_INVAL;
        }
        c->n_layers = (uint32_t)strlen(c->pattern);
        return TSR_OK;
}

/* An upper bound that may be infinite: JSON has no infinity, so it comes as null, as
 * a number, as the string "Infinity", as transformers 5's {"__float__": "Infinity"},
 * or as Python json's bare Infinity (which relax_infinity turned into null). */
static bool upper_bound(json_t *v, float *ret) {
        json_t *f = json_object_get(v, "__float__");

        if (json_is_null(v) || (json_is_string(f) && strcmp(json_string_value(f), "Infinity") == 0) ||
            (json_is_string(v) && strcmp(json_string_value(v), "Infinity") == 0)) {
                *ret = INFINITY;
                return true;
        }
        if (json_is_number(v)) {
                *ret = (float)json_number_value(v);
                return true;
        }
        return false;
}

/* time_step_limit: [min, max]; absent -> (0, inf), NemotronHConfig's default. */
static tsr_status read_dt_limit(const char *path, json_t *root, tsr_nemotron_h_config *c, char *err,
                                size_t errlen) {
        json_t *v = json_object_get(root, "time_step_limit");
        json_t *lo, *hi;

        c->dt_min = 0.0f;
        c->dt_max = INFINITY;
        if (!v || json_is_null(v))
                return TSR_OK;
        lo = json_array_get(v, 0);
        hi = json_array_get(v, 1);
        if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_number(lo) || !upper_bound(hi, &c->dt_max) ||
            !(json_number_value(lo) >= 0)) {
                tsr_errf(err, errlen, "%s: field 'time_step_limit': expected [min >= 0, max]", path);
                return TSR_E_INVAL;
        }
        c->dt_min = (float)json_number_value(lo);
        if (!(c->dt_max >= c->dt_min)) {
                tsr_errf(err, errlen, "%s: field 'time_step_limit': max below min", path);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

static tsr_status check_sizes(const char *path, json_t *root, const tsr_nemotron_h_config *c, char *err,
                              size_t errlen) {
        json_t *v;

        if (c->vocab_size == 0 || c->dim == 0) {
                tsr_errf(err, errlen, "%s: vocab_size and hidden_size must be non-zero", path);
                return TSR_E_INVAL;
        }
        if (tsr_nemotron_h_count(c, '*') &&
            (c->n_heads == 0 || c->n_kv_heads == 0 || c->head_dim == 0 || c->n_heads % c->n_kv_heads)) {
                tsr_errf(err, errlen, "%s: attention layers need num_attention_heads a non-zero multiple of "
                        "num_key_value_heads and a non-zero head_dim", path);
                return TSR_E_INVAL;
        }
        if (tsr_nemotron_h_count(c, 'M') &&
            (c->m_heads == 0 || c->m_head_dim == 0 || c->ssm_state == 0 || c->n_groups == 0 ||
             c->m_heads % c->n_groups || c->conv_kernel < 1 || c->conv_kernel > 16)) {
                tsr_errf(err, errlen, "%s: Mamba layers need non-zero mamba_num_heads (a multiple of n_groups), "
                        "mamba_head_dim, ssm_state_size and conv_kernel 1..16", path);
                return TSR_E_INVAL;
        }
        if (tsr_nemotron_h_count(c, 'E') &&
            (c->n_experts == 0 || c->top_k == 0 || c->moe_hidden == 0 || c->n_group == 0 ||
             c->n_experts % c->n_group || c->n_experts / c->n_group < 2 || c->topk_group == 0 ||
             c->topk_group > c->n_group || c->top_k > c->topk_group * (c->n_experts / c->n_group))) {
                tsr_errf(err, errlen, "%s: MoE layers need n_routed_experts split into n_group groups of at "
                        "least 2, 1 <= topk_group <= n_group, and num_experts_per_tok within the chosen groups",
                        path);
                return TSR_E_INVAL;
        }
        if (tsr_nemotron_h_count(c, '-') && c->mlp_hidden == 0) {
                tsr_errf(err, errlen, "%s: field 'intermediate_size' must be non-zero for '-' layers", path);
                return TSR_E_INVAL;
        }
        v = json_object_get(root, "moe_latent_size");
        if (v && !json_is_null(v)) {
                tsr_errf(err, errlen, "%s: field 'moe_latent_size' is set: latent MoE projections are not "
                        "supported", path);
                return TSR_E_UNSUPPORTED;
        }
        return TSR_OK;
}

static tsr_status from_json(const char *path, json_t *root, tsr_nemotron_h_config *ret, char *err, size_t errlen) {
        tsr_nemotron_h_config c = {0};
        uint32_t n_shared, n_layers_field;
        bool bias;
        tsr_status st;

        if ((st = read_pattern(path, root, &c, err, errlen)) != TSR_OK ||
            (st = tsr_hf_u32(path, root, "vocab_size", true, 0, &c.vocab_size, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "hidden_size", true, 0, &c.dim, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "num_hidden_layers", false, c.n_layers, &n_layers_field, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "num_attention_heads", false, 0, &c.n_heads, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "num_key_value_heads", false, c.n_heads, &c.n_kv_heads, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "head_dim", false, c.n_heads ? c.dim / c.n_heads : 0, &c.head_dim, err,
                          errlen)) ||
            (st = tsr_hf_u32(path, root, "mamba_num_heads", false, 0, &c.m_heads, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "mamba_head_dim", false, 0, &c.m_head_dim, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "ssm_state_size", false, 0, &c.ssm_state, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "n_groups", false, 1, &c.n_groups, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "conv_kernel", false, 4, &c.conv_kernel, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "chunk_size", false, 128, &c.chunk_size, err, errlen)) ||
            (st = tsr_hf_bool(path, root, "use_conv_bias", true, &c.conv_bias, err, errlen)) ||
            (st = read_dt_limit(path, root, &c, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "n_routed_experts", false, 0, &c.n_experts, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "num_experts_per_tok", false, 0, &c.top_k, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "moe_intermediate_size", false, 0, &c.moe_hidden, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "moe_shared_expert_intermediate_size", false, 0, &c.shared_hidden, err,
                          errlen)) ||
            (st = tsr_hf_u32(path, root, "n_shared_experts", false, 1, &n_shared, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "n_group", false, 1, &c.n_group, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "topk_group", false, 1, &c.topk_group, err, errlen)) ||
            (st = tsr_hf_bool(path, root, "norm_topk_prob", true, &c.norm_topk_prob, err, errlen)) ||
            (st = tsr_hf_f32(path, root, "routed_scaling_factor", 1.0, &c.routed_scale, err, errlen)) ||
            (st = tsr_hf_u32(path, root, "intermediate_size", false, 0, &c.mlp_hidden, err, errlen)) ||
            (st = tsr_hf_f32(path, root, "layer_norm_epsilon", 1e-5, &c.eps, err, errlen)) ||
            (st = tsr_hf_bool(path, root, "tie_word_embeddings", false, &c.tied_embeddings, err, errlen)) ||
            (st = tsr_hf_bool(path, root, "residual_in_fp32", false, &c.residual_in_fp32, err, errlen)))
                return st;
        if (n_layers_field != c.n_layers) {
                tsr_errf(err, errlen, "%s: num_hidden_layers %" PRIu32 " but the layer pattern has %" PRIu32, path,
                        n_layers_field, c.n_layers);
                return TSR_E_INVAL;
        }
        if (!(c.eps > 0)) {
                tsr_errf(err, errlen, "%s: field 'layer_norm_epsilon' must be positive", path);
                return TSR_E_INVAL;
        }
        if (tsr_nemotron_h_count(&c, 'E') && n_shared != 1) {
                tsr_errf(err, errlen, "%s: n_shared_experts %" PRIu32 ": only 1 is supported", path, n_shared);
                return TSR_E_UNSUPPORTED;
        }
        if (tsr_nemotron_h_count(&c, 'E') && c.shared_hidden == 0)
                c.shared_hidden = c.moe_hidden;
        static const char *const no_bias[] = {"attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"};
        for (size_t i = 0; i < sizeof no_bias / sizeof no_bias[0]; i++) {
                if ((st = tsr_hf_bool(path, root, no_bias[i], false, &bias, err, errlen)) != TSR_OK)
                        return st;
                if (bias) {
                        tsr_errf(err, errlen, "%s: field '%s' is true: biases are not supported", path, no_bias[i]);
                        return TSR_E_UNSUPPORTED;
                }
        }
        if ((st = want_str(path, root, "mamba_hidden_act", "silu", err, errlen)) ||
            (st = want_str(path, root, "mlp_hidden_act", "relu2", err, errlen)) ||
            /* vLLM keeps the SSM state in this dtype; ours is float32 (the real checkpoints' value) */
            (st = want_str(path, root, "mamba_ssm_cache_dtype", "float32", err, errlen)) ||
            (st = check_sizes(path, root, &c, err, errlen)))
                return st;
        *ret = c;
        return TSR_OK;
}

/* ---- GGUF ----------------------------------------------------------------------------- */

/* gguf.h's key readers (a short name for the many keys below; gguf_f32: as a float). */
static tsr_status gguf_u32(const tsr_gguf *g, const char *path, const char *arch, const char *key, bool required,
                           uint32_t def, int64_t elem, uint32_t *ret, char *err, size_t errlen) {
        return tsr_gguf_arch_u32(g, path, arch, key, required, def, elem, ret, err, errlen);
}

static tsr_status gguf_f32(const tsr_gguf *g, const char *path, const char *arch, const char *key, double def,
                           float *ret, char *err, size_t errlen) {
        double v;
        tsr_status st = tsr_gguf_arch_f64(g, path, arch, key, def, &v, err, errlen);
        if (st == TSR_OK)
                *ret = (float)v;
        return st;
}

/* Whether tensor "blk.<l>.<what>" is in the file. */
static bool has_blk(const tsr_gguf *g, uint32_t l, const char *what) {
        char name[96];
        snprintf(name, sizeof name, "blk.%" PRIu32 ".%s", l, what);
        return tsr_gguf_find_tensor(g, name) != NULL;
}

tsr_status tsr_nemotron_h_config_from_gguf(const tsr_gguf *g, const char *path, tsr_nemotron_h_config *ret,
                                           char *err, size_t errlen) {
        tsr_nemotron_h_config c = {.chunk_size = 128};  /* llama.cpp keeps none: NemotronHConfig's default */
        const tsr_gguf_kv *kv;
        const char *s;
        size_t len;
        uint32_t n_shared = 1, inner = 0;
        tsr_status st;

        if (!g || !ret)
                return TSR_E_INVAL;
        if (!path)
                path = "<gguf>";
        kv = tsr_gguf_find_kv(g, "general.architecture");
        if (!kv || tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK ||
            !((len == 10 && memcmp(s, "nemotron_h", 10) == 0) || (len == 14 && memcmp(s, "nemotron_h_moe", 14) == 0))) {
                tsr_errf(err, errlen, "%s: general.architecture is not nemotron_h or nemotron_h_moe", path);
                return TSR_E_UNSUPPORTED;
        }
        char arch[16];
        memcpy(arch, s, len);
        arch[len] = 0;
        if ((st = gguf_u32(g, path, arch, "embedding_length", true, 0, -1, &c.dim, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "block_count", true, 0, -1, &c.n_layers, err, errlen)))
                return st;
        if (c.n_layers == 0 || c.n_layers > TSR_NEMOTRON_H_MAX_LAYERS) {
                tsr_errf(err, errlen, "%s: %s.block_count %" PRIu32 ": expected 1..%d", path, arch, c.n_layers,
                        TSR_NEMOTRON_H_MAX_LAYERS);
                return TSR_E_INVAL;
        }
        for (uint32_t l = 0; l < c.n_layers; l++) {
                char k = has_blk(g, l, "ssm_in.weight") ? 'M' : has_blk(g, l, "attn_q.weight") ? '*'
                         : has_blk(g, l, "ffn_up_exps.weight")                                  ? 'E'
                         : has_blk(g, l, "ffn_up.weight")                                       ? '-'
                                                                                                : 0;
                if (!k) {
                        tsr_errf(err, errlen, "%s: layer %" PRIu32 " has none of blk.%" PRIu32 ".ssm_in, attn_q, "
                                "ffn_up_exps, ffn_up: not a NemotronH block", path, l, l);
                        return TSR_E_UNSUPPORTED;
                }
                c.pattern[l] = k;
        }
        c.pattern[c.n_layers] = 0;
        /* the attention layers' KV heads (a per-layer array: 0 elsewhere) */
        for (uint32_t l = 0; l < c.n_layers; l++)
                if (c.pattern[l] == '*' &&
                    (st = gguf_u32(g, path, arch, "attention.head_count_kv", true, 0, l, &c.n_kv_heads, err, errlen)))
                        return st;
        if ((st = gguf_u32(g, path, arch, "attention.head_count", tsr_nemotron_h_count(&c, '*') > 0, 0, -1, &c.n_heads,
                           err, errlen)) ||
            (st = gguf_u32(g, path, arch, "attention.key_length", false, c.n_heads ? c.dim / c.n_heads : 0, -1,
                           &c.head_dim, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "ssm.conv_kernel", false, 4, -1, &c.conv_kernel, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "ssm.state_size", false, 0, -1, &c.ssm_state, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "ssm.group_count", false, 1, -1, &c.n_groups, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "ssm.inner_size", false, 0, -1, &inner, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "ssm.time_step_rank", false, 0, -1, &c.m_heads, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_count", false, 0, -1, &c.n_experts, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_used_count", false, 0, -1, &c.top_k, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_feed_forward_length", false, 0, -1, &c.moe_hidden, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_shared_feed_forward_length", false, c.moe_hidden, -1,
                           &c.shared_hidden, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_shared_count", false, 1, -1, &n_shared, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_group_count", false, 1, -1, &c.n_group, err, errlen)) ||
            (st = gguf_u32(g, path, arch, "expert_group_used_count", false, 1, -1, &c.topk_group, err, errlen)) ||
            (st = gguf_f32(g, path, arch, "expert_weights_scale", 1.0, &c.routed_scale, err, errlen)) ||
            (st = gguf_f32(g, path, arch, "attention.layer_norm_epsilon", 1e-5, &c.eps, err, errlen)))
                return st;
        c.norm_topk_prob = true;
        char key[96];
        snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
        if ((kv = tsr_gguf_find_kv(g, key)) && tsr_gguf_get_bool(&kv->value, &c.norm_topk_prob) != TSR_OK) {
                tsr_errf(err, errlen, "%s: metadata key '%s': expected a boolean", path, key);
                return TSR_E_INVAL;
        }
        snprintf(key, sizeof key, "%s.moe_latent_size", arch);
        if (tsr_gguf_find_kv(g, key)) {
                tsr_errf(err, errlen, "%s: metadata key '%s' is set: latent MoE projections are not supported", path,
                        key);
                return TSR_E_UNSUPPORTED;
        }
        if (tsr_nemotron_h_count(&c, 'E') && n_shared != 1) {
                tsr_errf(err, errlen, "%s: %s.expert_shared_count %" PRIu32 ": only 1 is supported", path, arch,
                        n_shared);
                return TSR_E_UNSUPPORTED;
        }
        c.m_head_dim = c.m_heads ? inner / c.m_heads : 0;
        c.dt_min = 0.0f;
        c.dt_max = INFINITY;
        for (uint32_t l = 0; l < c.n_layers; l++) {
                char name[96];
                if (c.pattern[l] == 'M') {
                        snprintf(name, sizeof name, "blk.%" PRIu32 ".ssm_conv1d.bias", l);
                        c.conv_bias = tsr_gguf_find_tensor(g, name) != NULL;
                }
                if (c.pattern[l] == '-' && !c.mlp_hidden) {
                        snprintf(name, sizeof name, "blk.%" PRIu32 ".ffn_up.weight", l);
                        const tsr_gguf_tensor *t = tsr_gguf_find_tensor(g, name);
                        c.mlp_hidden = t->n_dims == 2 && t->dims[1] <= UINT32_MAX ? (uint32_t)t->dims[1] : 0;
                }
        }
        /* Vocabulary: the explicit key, else the tokenizer's size, else the embedding rows. */
        const tsr_gguf_tensor *emb = tsr_gguf_find_tensor(g, "token_embd.weight");
        snprintf(key, sizeof key, "%s.vocab_size", arch);
        if ((kv = tsr_gguf_find_kv(g, key))) {
                if ((st = gguf_u32(g, path, arch, "vocab_size", true, 0, -1, &c.vocab_size, err, errlen)))
                        return st;
        } else if ((kv = tsr_gguf_find_kv(g, "tokenizer.ggml.tokens")) && kv->value.type == TSR_GGUF_TYPE_ARRAY &&
                   kv->value.count <= UINT32_MAX) {
                c.vocab_size = (uint32_t)kv->value.count;
        } else if (emb && emb->n_dims == 2 && emb->dims[1] <= UINT32_MAX) {
                c.vocab_size = (uint32_t)emb->dims[1];
        }
        c.tied_embeddings = tsr_gguf_find_tensor(g, "output.weight") == NULL;
        c.gguf = true;
        if (!(c.eps > 0)) {
                tsr_errf(err, errlen, "%s: %s.attention.layer_norm_epsilon must be positive", path, arch);
                return TSR_E_INVAL;
        }
        if ((st = check_sizes(path, NULL, &c, err, errlen)) != TSR_OK)
                return st;
        *ret = c;
        return TSR_OK;
}

/* Python's json module writes float('inf') as a bare Infinity, which is not JSON (Mamba
 * configs carry it in time_step_limit): outside strings, each becomes `null` padded to
 * the same length, which the fields that may be infinite read as infinity. */
static void relax_infinity(char *buf, size_t n) {
        static const char word[] = "Infinity";
        bool in_str = false;

        for (size_t i = 0; i < n; i++) {
                if (in_str) {
                        if (buf[i] == '\\')
                                i++;
                        else if (buf[i] == '"')
                                in_str = false;
                } else if (buf[i] == '"') {
                        in_str = true;
                } else if (n - i >= sizeof word - 1 && memcmp(buf + i, word, sizeof word - 1) == 0) {
                        memcpy(buf + i, "null    ", sizeof word - 1);
                        i += sizeof word - 2;
                }
        }
}

tsr_status tsr_nemotron_h_config_from_hf(const char *dir, tsr_nemotron_h_config *ret, char *err, size_t errlen) {
        char path[4096], *buf = NULL;
        json_error_t je;
        json_t *root;
        tsr_status st;
        size_t len = 0;

        if (!dir || !ret)
                return TSR_E_INVAL;
        if ((st = tsr_hf_config_read(dir, path, sizeof path, &buf, &len, err, errlen)) != TSR_OK)
                return st;
        relax_infinity(buf, len);
        root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &je);
        free(buf);
        if (!root) {
                tsr_errf(err, errlen, "%s:%d: %s", path, je.line, je.text);
                return TSR_E_INVAL;
        }
        if (!json_is_object(root)) {
                tsr_errf(err, errlen, "%s: not a JSON object", path);
                st = TSR_E_INVAL;
        } else {
                st = from_json(path, root, ret, err, errlen);
        }
        json_decref(root);
        return st;
}

uint32_t tsr_nemotron_h_count(const tsr_nemotron_h_config *c, char kind) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < c->n_layers; i++)
                n += c->pattern[i] == kind;
        return n;
}
