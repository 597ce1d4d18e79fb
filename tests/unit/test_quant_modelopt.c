/* test_quant_modelopt.c - ModelOpt FP8 / NVFP4 checkpoints end to end below the engine:
 * config detection (worker/load/modelopt.h), --quantization agreement, the exclude
 * rules, the tiny fixture (tests/fixtures/tiny-modelopt) loaded with its weights kept as
 * stored and run against the committed torch emulation, and bad checkpoints refused
 * naming the file and the tensor.
 *
 * The logit bound against the emulation (make_tiny_modelopt.py): both compute the same
 * quantized products; the kernels sum them in their fixed eight-lane order, torch in
 * its own, so per linear output the difference is at most the two float32 summation
 * errors, 2 n u sum|terms| (u = 2^-24, n <= 128 here) -- about 1.5e-5 relative to
 * sum|terms|.  Such a difference can also move an activation across an fp8 / e2m1
 * rounding boundary in the next layer, which changes that element by one quantum.  The
 * fixture measures how far the sum order alone moves its logits (`order_sensitivity`:
 * the emulation with float64 accumulation; 2.4e-7 FP8, 0 NVFP4: no boundary crossing
 * there), so the bound is 1e-4 + 50 x that: a crossing would show as a jump of about
 * 1e-2, far above it.  Greedy 32-token continuations must be equal token for token. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"
#include "tests/unit/test_util.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/kernels.h"
#include "worker/load/modelopt.h"
#include "worker/model/llama.h"

#define FIXTURE "tests/fixtures/tiny-modelopt"

static tsr_backend *ref_be, *fast_be;
static json_t *golden;
static char tmpdir[256];

static void write_file(const char *dir, const char *name, const char *text) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(text, f);
        fclose(f);
}

static void rm_file(const char *dir, const char *name) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        unlink(path);
}

#define expect_err(st_expr, want_st, needle)                                                        \
        do {                                                                                        \
                tsr_status s_ = (st_expr);                                                          \
                if (s_ != (want_st) || !strstr(err, (needle)))                                      \
                        fail_msg("%s: status %d (want %d), message '%s' (want '%s')", #st_expr, s_,  \
                                 (int)(want_st), err, (needle));                                     \
        } while (0)

/* ---- config detection ------------------------------------------------------------------ */

static void test_config_forms(void **state) {
        char err[512];
        tsr_modelopt_config c;
        (void)state;

        snprintf(tmpdir, sizeof tmpdir, "/tmp/tsr_modelopt_XXXXXX");
        assert_non_null(mkdtemp(tmpdir));
        /* nothing announced */
        write_file(tmpdir, "config.json", "{\"model_type\": \"llama\"}");
        assert_int_equal(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_OK);
        assert_int_equal(c.algo, TSR_MODELOPT_NONE);
        assert_int_equal(tsr_modelopt_check_flag(&c, NULL, tmpdir, err, sizeof err), TSR_OK);
        expect_err(tsr_modelopt_check_flag(&c, "modelopt", tmpdir, err, sizeof err), TSR_E_INVAL,
                   "argument --quantization: 'modelopt' does not match the checkpoint");
        tsr_modelopt_config_done(&c);

        /* the legacy file alone */
        write_file(tmpdir, "hf_quant_config.json",
                   "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": \"NVFP4\", "
                   "\"kv_cache_quant_algo\": \"FP8\", \"group_size\": 16, \"exclude_modules\": [\"lm_head\", "
                   "\"model.layers.3*\"]}}");
        assert_int_equal(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_OK);
        assert_int_equal(c.algo, TSR_MODELOPT_NVFP4);
        assert_int_equal(c.group_size, 16);
        assert_true(c.kv_cache_fp8);
        assert_int_equal(c.n_exclude, 2);
        assert_non_null(strstr(c.source, "hf_quant_config.json"));
        assert_int_equal(tsr_modelopt_check_flag(&c, "modelopt_fp4", tmpdir, err, sizeof err), TSR_OK);
        expect_err(tsr_modelopt_check_flag(&c, "modelopt", tmpdir, err, sizeof err), TSR_E_INVAL,
                   "says quant_algo NVFP4 (use --quantization modelopt_fp4");
        expect_err(tsr_modelopt_check_flag(&c, "fp8", tmpdir, err, sizeof err), TSR_E_INVAL, "quant_algo NVFP4");
        /* vLLM's exclusion rules: exact, substring, fnmatch, language_model. prefix */
        assert_true(tsr_modelopt_excluded(&c, "lm_head"));
        assert_true(tsr_modelopt_excluded(&c, "language_model.lm_head"));
        assert_true(tsr_modelopt_excluded(&c, "model.layers.3.mlp.up_proj"));
        assert_true(tsr_modelopt_excluded(&c, "model.layers.31.mlp.up_proj"));
        assert_false(tsr_modelopt_excluded(&c, "model.layers.2.mlp.up_proj"));
        tsr_modelopt_config_done(&c);

        /* config.json's quantization_config wins over the legacy file */
        write_file(tmpdir, "config.json",
                   "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"FP8\", "
                   "\"ignore\": [\"lm_head\"], \"kv_cache_scheme\": {\"type\": \"float\", \"num_bits\": 8}}}");
        assert_int_equal(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_OK);
        assert_int_equal(c.algo, TSR_MODELOPT_FP8);
        assert_true(c.kv_cache_fp8);
        assert_non_null(strstr(c.source, "config.json"));
        assert_int_equal(tsr_modelopt_check_flag(&c, "modelopt", tmpdir, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_modelopt_check_flag(&c, "fp8", tmpdir, err, sizeof err), TSR_OK);
        expect_err(tsr_modelopt_check_flag(&c, "modelopt_fp4", tmpdir, err, sizeof err), TSR_E_INVAL,
                   "says quant_algo FP8 (use --quantization modelopt");
        tsr_modelopt_config_done(&c);

        /* refused: another method, another algorithm, a group size other than 16 */
        write_file(tmpdir, "config.json", "{\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4}}");
        expect_err(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_E_UNSUPPORTED,
                   "field 'quantization_config.quant_method': 'gptq' is not supported (supported: modelopt");
        write_file(tmpdir, "config.json",
                   "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"W4A8_AWQ\"}}");
        expect_err(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_E_UNSUPPORTED,
                   "'W4A8_AWQ' is not supported (supported: FP8, NVFP4)");
        write_file(tmpdir, "config.json",
                   "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"NVFP4\", "
                   "\"group_size\": 32}}");
        expect_err(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_E_UNSUPPORTED,
                   "field 'quantization_config.group_size': 32 is not supported (NVFP4 uses blocks of 16)");
        write_file(tmpdir, "config.json",
                   "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"NVFP4\", "
                   "\"config_groups\": {\"group_0\": {\"weights\": {\"group_size\": 8}}}}}");
        expect_err(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_E_UNSUPPORTED, "8 is not supported");
        write_file(tmpdir, "config.json", "{\"quantization_config\": {\"quant_method\": \"modelopt\", "
                                          "\"quant_algo\": \"FP8\", \"ignore\": \"lm_head\"}}");
        expect_err(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_E_INVAL,
                   "field 'quantization_config.ignore': expected a list of strings");
        rm_file(tmpdir, "config.json");
        rm_file(tmpdir, "hf_quant_config.json");
        rmdir(tmpdir);
}

/* ---- the fixture against the emulation --------------------------------------------------- */

static int golden_setup(void **state) {
        char path[1024];
        json_error_t je;
        (void)state;
        if (tsr_test_src_path(FIXTURE "/golden.json", path, sizeof path))
                golden = json_load_file(path, 0, &je);
        return 0;
}

static int golden_teardown(void **state) {
        (void)state;
        json_decref(golden);
        golden = NULL;
        return 0;
}

/* Load `dir` as the worker does: its ModelOpt config, the weights kept as stored. */
static tsr_status load_dir(const char *dir, tsr_llama **m, tsr_load_stats *st, char *err, size_t errlen) {
        tsr_modelopt_config c;
        tsr_status s = tsr_modelopt_config_read(dir, &c, err, errlen);
        if (s != TSR_OK)
                return s;
        tsr_load_opts o = {.modelopt = c.algo ? &c : NULL};
        s = tsr_llama_load_opts(dir, NULL, NULL, &o, NULL, NULL, m, st, err, errlen);
        tsr_modelopt_config_done(&c);
        return s;
}

static void check_variant(const char *variant, tsr_dtype want_dtype) {
        char path[1024], err[512];
        tsr_llama *m = NULL;
        tsr_llama_kv *kv = NULL;
        tsr_load_stats st;
        json_t *var = json_object_get(json_object_get(golden, "variants"), variant);

        assert_non_null(golden);                                                /* committed */
        assert_non_null(var);
        assert_non_null(tsr_test_src_path(FIXTURE, path, sizeof path));
        snprintf(path + strlen(path), sizeof path - strlen(path), "/%s", json_string_value(json_object_get(var, "dir")));
        if (load_dir(path, &m, &st, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        const tsr_llama_config *c = tsr_llama_config_of(m);
        size_t V = c->vocab_size;
        assert_int_equal(V, 300);
        /* memory truth: the 14 linears stay in their format; the 7 bf16 tensors (2 norms x
         * 2 layers, embeddings, lm_head, final norm) widen to float32 */
        uint64_t lin = 2 * (64 * 64 + 32 * 64 * 2 + 64 * 64 + 128 * 64 * 3);   /* elements */
        uint64_t rest = 300 * 64 * 2 + 64 * 5;
        uint64_t lin_bytes = want_dtype == TSR_DTYPE_FP8_E4M3 ? lin : lin / 16 * 9;
        assert_int_equal(st.resident_bytes, lin_bytes + rest * 4);
        print_message("tiny-modelopt %s: resident %llu bytes (linears %llu: %.3f of bf16)\n", variant,
                      (unsigned long long)st.resident_bytes, (unsigned long long)lin_bytes,
                      (double)lin_bytes / (double)(2 * lin));

        double bound = 1e-4 + 50 * json_number_value(json_object_get(var, "order_sensitivity"));
        json_t *lp = json_object_get(golden, "logit_prompts");
        size_t rows = 0;
        uint32_t ids[160];
        for (size_t i = 0; i < json_array_size(lp); i++)
                rows += tsr_test_prompt_ids(golden, (size_t)json_integer_value(json_array_get(lp, i)), ids, 160);
        char rel[512], lpath[1024];
        snprintf(rel, sizeof rel, FIXTURE "/%s", json_string_value(json_object_get(var, "logits_file")));
        assert_non_null(tsr_test_src_path(rel, lpath, sizeof lpath));
        float *want = malloc(rows * V * sizeof(float)), *got = malloc(160 * V * sizeof(float));
        float *got2 = malloc(160 * V * sizeof(float)), *step = malloc(V * sizeof(float));
        FILE *f = fopen(lpath, "rb");
        assert_non_null(f);
        assert_int_equal(fread(want, sizeof(float), rows * V, f), rows * V);
        fclose(f);
        assert_int_equal(tsr_llama_kv_new(m, 160, 4, &kv), TSR_OK);

        double worst = 0;
        size_t row = 0;
        for (size_t i = 0; i < json_array_size(lp); i++) {
                size_t pi = (size_t)json_integer_value(json_array_get(lp, i)), n = tsr_test_prompt_ids(golden, pi, ids, 160);
                assert_int_equal(tsr_llama_kv_truncate(kv, 0), TSR_OK);
                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, got), TSR_OK);
                /* the fast backend is bitwise the reference */
                assert_int_equal(tsr_llama_kv_truncate(kv, 0), TSR_OK);
                assert_int_equal(tsr_llama_forward(m, fast_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, got2), TSR_OK);
                assert_memory_equal(got, got2, n * V * sizeof(float));
                for (size_t t = 0; t < n; t++)
                        for (size_t v = 0; v < V; v++) {
                                double d = fabs((double)got[t * V + v] - want[(row + t) * V + v]);
                                worst = fmax(worst, d);
                                if (!(d <= bound))
                                        fail_msg("%s prompt %zu pos %zu id %zu: %.7g, emulation %.7g (bound %.3g)",
                                                 variant, pi, t, v, got[t * V + v], want[(row + t) * V + v], bound);
                        }
                row += n;
        }

        /* greedy 32-token continuations through the decode path (KV cache), token-exact */
        json_t *greedy = json_object_get(var, "greedy");
        size_t total = 0;
        for (size_t pi = 0; pi < json_array_size(greedy); pi++) {
                json_t *gw = json_array_get(greedy, pi);
                size_t n = tsr_test_prompt_ids(golden, pi, ids, 160);
                assert_int_equal(tsr_llama_kv_truncate(kv, 0), TSR_OK);
                assert_int_equal(tsr_llama_forward(m, fast_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_LAST, step), TSR_OK);
                for (size_t s2 = 0; s2 < json_array_size(gw); s2++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(step, V);
                        long long w = json_integer_value(json_array_get(gw, s2));
                        if (tok != w)
                                fail_msg("%s prompt %zu greedy step %zu: %u, emulation %lld", variant, pi, s2, tok, w);
                        total++;
                        assert_int_equal(tsr_llama_forward(m, fast_be, kv, &tok, 1, n + s2, TSR_LLAMA_LOGITS_LAST, step),
                                         TSR_OK);
                }
        }
        assert_int_equal(total, 32 * json_array_size(greedy));
        print_message("tiny-modelopt %s: max |dlogit| vs emulation %.3g (bound %.3g, max |logit| %.3g); greedy %zu/%zu "
                      "tokens equal\n", variant, worst, bound, json_number_value(json_object_get(var, "max_abs_logit")),
                      total, total);
        tsr_llama_kv_free(&kv);
        tsr_llama_free(&m);
        free(want), free(got), free(got2), free(step);
}

static void test_fp8_model(void **state) {
        (void)state;
        check_variant("fp8", TSR_DTYPE_FP8_E4M3);
}

static void test_nvfp4_model(void **state) {
        (void)state;
        check_variant("nvfp4", TSR_DTYPE_NVFP4);
}

/* ---- bad checkpoints: a rewritten copy of the fixture ------------------------------------- */

typedef struct st_edit {
        const char *drop;               /* a tensor left out */
        const char *name;               /* a tensor replaced (or added) by: */
        const char *dtype;
        uint64_t shape[2];
        int n_dims;
        float value;                    /* an F32 replacement's elements; 0: 1.0 */
} st_edit;

/* Copy fixture `variant`'s folder into tmpdir with `e` applied to model.safetensors (the
 * replaced tensor's bytes are zeros, then 0x38 = 1.0 in e4m3 / 1.0f in F32 where it is a
 * scale) and `quant_json` as config.json's quantization_config (NULL: the fixture's;
 * "" : none, and no hf_quant_config.json). */
static void make_copy(const char *variant, const st_edit *e, const char *quant_json) {
        char src[1024], path[1100], err[256];
        tsr_safetensors *f = NULL;
        json_error_t je;

        assert_non_null(tsr_test_src_path(FIXTURE, src, sizeof src));
        snprintf(path, sizeof path, "%s/%s/config.json", src, variant);
        json_t *cfg = json_load_file(path, 0, &je);
        assert_non_null(cfg);
        if (quant_json && !*quant_json)
                json_object_del(cfg, "quantization_config");
        else if (quant_json)
                json_object_set_new(cfg, "quantization_config", json_loads(quant_json, 0, &je));
        snprintf(path, sizeof path, "%s/config.json", tmpdir);
        assert_int_equal(json_dump_file(cfg, path, 0), 0);
        json_decref(cfg);
        rm_file(tmpdir, "hf_quant_config.json");
        if (!quant_json) {
                snprintf(path, sizeof path, "%s/%s/hf_quant_config.json", src, variant);
                json_t *h = json_load_file(path, 0, &je);
                snprintf(path, sizeof path, "%s/hf_quant_config.json", tmpdir);
                assert_int_equal(json_dump_file(h, path, 0), 0);
                json_decref(h);
        }

        snprintf(path, sizeof path, "%s/%s/model.safetensors", src, variant);
        assert_int_equal(tsr_safetensors_open(path, &f, err, sizeof err), TSR_OK);
        json_t *hdr = json_object();
        uint8_t *data = NULL;
        size_t off = 0;
        for (size_t i = 0; i <= tsr_safetensors_n_tensors(f); i++) {
                const tsr_safetensors_tensor *t = i < tsr_safetensors_n_tensors(f) ? tsr_safetensors_tensor_at(f, i) : NULL;
                const char *name = t ? t->name : e->name, *dtype;
                size_t bytes;
                const void *src_bytes = NULL;
                if (!name || (e->drop && strcmp(name, e->drop) == 0) || (!t && json_object_get(hdr, name)))
                        continue;
                json_t *shape = json_array();
                if (e->name && strcmp(name, e->name) == 0) {
                        uint64_t n = 1;
                        for (int d = 0; d < e->n_dims; d++) {
                                json_array_append_new(shape, json_integer((json_int_t)e->shape[d]));
                                n *= e->shape[d];
                        }
                        dtype = e->dtype;
                        bytes = (size_t)n * (strcmp(dtype, "F32") == 0 ? 4 : 1);
                } else {
                        for (uint32_t d = 0; d < t->n_dims; d++)
                                json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
                        dtype = tsr_safetensors_dtype_name(t->dtype);
                        bytes = (size_t)t->n_bytes;
                        src_bytes = t->data;
                }
                data = realloc(data, off + bytes + 1);
                if (src_bytes)
                        memcpy(data + off, src_bytes, bytes);
                else if (strcmp(dtype, "F32") == 0)
                        for (size_t k = 0; k < bytes; k += 4)
                                memcpy(data + off + k, &(float){e->value != 0 ? e->value : 1.0f}, 4);
                else
                        memset(data + off, 0x38, bytes);
                json_object_set_new(hdr, name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", dtype, "shape", shape,
                                                         "data_offsets", (json_int_t)off, (json_int_t)(off + bytes)));
                off += bytes;
        }
        tsr_safetensors_close(&f);
        char *h = json_dumps(hdr, JSON_COMPACT);
        size_t hl = strlen(h);
        snprintf(path, sizeof path, "%s/model.safetensors", tmpdir);
        FILE *o = fopen(path, "wb");
        assert_non_null(o);
        uint64_t le = hl;
        fwrite(&le, 8, 1, o);
        fwrite(h, 1, hl, o);
        fwrite(data, 1, off, o);
        fclose(o);
        free(h), free(data);
        json_decref(hdr);
}

static tsr_status load_copy(char *err, size_t errlen) {
        tsr_llama *m = NULL;
        err[0] = 0;
        tsr_status s = load_dir(tmpdir, &m, NULL, err, errlen);
        if (s == TSR_OK)
                assert_non_null(m);
        tsr_llama_free(&m);
        return s;
}

static void test_bad_checkpoints(void **state) {
        char err[512];
        (void)state;
        snprintf(tmpdir, sizeof tmpdir, "/tmp/tsr_modelopt_XXXXXX");
        assert_non_null(mkdtemp(tmpdir));

        /* the unchanged copies load */
        make_copy("fp8", &(st_edit){0}, NULL);
        assert_int_equal(load_copy(err, sizeof err), TSR_OK);
        make_copy("nvfp4", &(st_edit){0}, NULL);
        assert_int_equal(load_copy(err, sizeof err), TSR_OK);

        /* missing scales */
        make_copy("fp8", &(st_edit){.drop = "model.layers.1.self_attn.q_proj.weight_scale"}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "tensor 'model.layers.1.self_attn.q_proj.weight_scale' missing (a quantized weight needs its "
                   "weight_scale)");
        make_copy("fp8", &(st_edit){.drop = "model.layers.0.mlp.down_proj.input_scale"}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL, "'model.layers.0.mlp.down_proj.input_scale' missing");
        make_copy("nvfp4", &(st_edit){.drop = "model.layers.0.mlp.up_proj.weight_scale_2"}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL, "'model.layers.0.mlp.up_proj.weight_scale_2' missing");
        make_copy("nvfp4", &(st_edit){.drop = "model.layers.0.mlp.up_proj.weight_scale"}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "'model.layers.0.mlp.up_proj.weight_scale' missing (an NVFP4 weight needs its block scales)");

        /* scales of the wrong shape or dtype */
        make_copy("fp8", &(st_edit){.name = "model.layers.1.self_attn.q_proj.weight_scale", .dtype = "F32",
                                    .shape = {64}, .n_dims = 1}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight_scale': dtype F32, 1 dims, 64 "
                   "elements; expected a F32 scalar");
        make_copy("nvfp4", &(st_edit){.name = "model.layers.1.self_attn.q_proj.weight_scale", .dtype = "F8_E4M3",
                                      .shape = {64, 3}, .n_dims = 2}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL, "q_proj.weight_scale': shape [64, 3] gives a block size");
        /* NVFP4 group size 32: scales per 32 elements */
        make_copy("nvfp4", &(st_edit){.name = "model.layers.1.self_attn.q_proj.weight_scale", .dtype = "F8_E4M3",
                                      .shape = {64, 2}, .n_dims = 2}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "shape [64, 2] gives a block size of 32 for 64 columns; NVFP4 needs blocks of 16");
        assert_non_null(strstr(err, "/model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight_scale'"));
        /* a weight of the wrong shape */
        make_copy("nvfp4", &(st_edit){.name = "model.layers.1.self_attn.q_proj.weight", .dtype = "U8",
                                      .shape = {64, 64}, .n_dims = 2}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "tensor 'model.layers.1.self_attn.q_proj.weight': shape [64, 64], expected [64, 32] (two e2m1");

        /* dtypes the config does not announce */
        make_copy("fp8", &(st_edit){0}, "");
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "dtype F8_E4M3, which the checkpoint's config does not announce");
        make_copy("fp8", &(st_edit){0},
                  "{\"quant_method\": \"modelopt\", \"quant_algo\": \"NVFP4\", \"group_size\": 16}");
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL,
                   "dtype F8_E4M3, which does not match the announced quant_algo (NVFP4)");
        /* a quantized module the exclude list names */
        make_copy("fp8", &(st_edit){0}, "{\"quant_method\": \"modelopt\", \"quant_algo\": \"FP8\", "
                                        "\"ignore\": [\"lm_head\", \"model.layers.1.self_attn.q*\"]}");
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL, "excludes module 'model.layers.1.self_attn.q_proj'");
        /* a scale that is not a positive number */
        make_copy("fp8", &(st_edit){.name = "model.layers.1.self_attn.q_proj.input_scale", .dtype = "F8_E4M3",
                                    .n_dims = 0}, NULL);
        expect_err(load_copy(err, sizeof err), TSR_E_INVAL, "q_proj.input_scale': dtype F8_E4M3");
        /* an exclude entry that matches nothing: found (the worker warns) */
        tsr_modelopt_config c;
        tsr_safetensors_set *set = NULL;
        make_copy("fp8", &(st_edit){0}, "{\"quant_method\": \"modelopt\", \"quant_algo\": \"FP8\", "
                                        "\"ignore\": [\"lm_head\", \"vision_tower*\"]}");
        assert_int_equal(tsr_modelopt_config_read(tmpdir, &c, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_safetensors_set_open(tmpdir, &set, err, sizeof err), TSR_OK);
        const char *un[4];
        assert_int_equal(tsr_modelopt_unmatched_excludes(&c, set, un, 4), 1);
        assert_string_equal(un[0], "vision_tower*");
        tsr_safetensors_set_close(&set);
        tsr_modelopt_config_done(&c);

        rm_file(tmpdir, "config.json");
        rm_file(tmpdir, "hf_quant_config.json");
        rm_file(tmpdir, "model.safetensors");
        rmdir(tmpdir);
}

/* ---- the FP8 KV cache scales (--kv-cache-dtype fp8; models.md §4.5) --------------------- */

/* tsr_modelopt_kv_scales on the copy in tmpdir: k[2], v[2] preset to 7 (kept where a
 * layer has neither scale). */
static tsr_status kv_scales_of_copy(float *k, float *v, uint32_t *found, char *err, size_t errlen) {
        tsr_safetensors_set *set = NULL;
        k[0] = k[1] = v[0] = v[1] = 7.0f;
        err[0] = 0;
        assert_int_equal(tsr_safetensors_set_open(tmpdir, &set, err, errlen), TSR_OK);
        tsr_status st = tsr_modelopt_kv_scales(set, "model.layers.%u.self_attn", 0, 2, k, v, found, err, errlen);
        tsr_safetensors_set_close(&set);
        return st;
}

static void test_kv_scales(void **state) {
        char err[512];
        float k[2], v[2];
        uint32_t found = 99;
        (void)state;
        snprintf(tmpdir, sizeof tmpdir, "/tmp/tsr_modelopt_XXXXXX");
        assert_non_null(mkdtemp(tmpdir));

        /* the fixture's: 1.0 in both layers */
        make_copy("fp8", &(st_edit){0}, NULL);
        assert_int_equal(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_OK);
        assert_int_equal(found, 2);
        assert_true(k[0] == 1.0f && k[1] == 1.0f && v[0] == 1.0f && v[1] == 1.0f);
        /* a scale != 1 is read as stored */
        make_copy("fp8", &(st_edit){.name = "model.layers.1.self_attn.k_proj.k_scale", .dtype = "F32", .value = 0.375f},
                  NULL);
        assert_int_equal(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_OK);
        assert_true(k[1] == 0.375f && v[1] == 1.0f && k[0] == 1.0f);
        /* one scale of a layer: used for both (vLLM) */
        make_copy("fp8", &(st_edit){.drop = "model.layers.0.self_attn.v_proj.v_scale"}, NULL);
        assert_int_equal(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_OK);
        assert_int_equal(found, 2);
        assert_true(v[0] == k[0] && k[0] == 1.0f);
        /* layer 1 without its k_scale takes its v_scale for both; layer 0 keeps its own two */
        make_copy("fp8", &(st_edit){.drop = "model.layers.1.self_attn.k_proj.k_scale",
                                    .name = "model.layers.0.self_attn.k_proj.k_scale", .dtype = "F32", .value = 2.5f},
                  NULL);
        assert_int_equal(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_OK);
        assert_true(k[0] == 2.5f && v[0] == 1.0f && k[1] == 1.0f && v[1] == 1.0f);
        /* neither (layers the file does not have): the caller's values stay, none counted */
        tsr_safetensors_set *set = NULL;
        assert_int_equal(tsr_safetensors_set_open(tmpdir, &set, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_modelopt_kv_scales(set, "model.layers.%u.self_attn", 5, 2, k, v, &found, err, sizeof err),
                         TSR_OK);
        tsr_safetensors_set_close(&set);
        assert_int_equal(found, 0);
        assert_true(k[0] == 2.5f && k[1] == 1.0f);
        /* the other forms vLLM reads, on a layer 5 the file otherwise lacks: the module's
         * own k_scale (v duplicated), one kv_scale, one kv_cache_scaling_factor */
        static const char *const other[] = {"model.layers.5.self_attn.k_scale", "model.layers.5.self_attn.kv_scale",
                                            "model.layers.5.self_attn.kv_cache_scaling_factor"};
        for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
                make_copy("fp8", &(st_edit){.name = other[i], .dtype = "F32", .value = 0.625f}, NULL);
                assert_int_equal(tsr_safetensors_set_open(tmpdir, &set, err, sizeof err), TSR_OK);
                k[0] = v[0] = 7.0f;
                assert_int_equal(tsr_modelopt_kv_scales(set, "model.layers.%u.self_attn", 5, 1, k, v, &found, err,
                                                        sizeof err),
                                 TSR_OK);
                tsr_safetensors_set_close(&set);
                assert_int_equal(found, 1);
                assert_true(k[0] == 0.625f && v[0] == 0.625f);
        }
        /* bad scales name the file and the tensor */
        make_copy("fp8", &(st_edit){.name = "model.layers.0.self_attn.v_proj.v_scale", .dtype = "F32", .value = -2.0f},
                  NULL);
        expect_err(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_E_INVAL,
                   "tensor 'model.layers.0.self_attn.v_proj.v_scale': -2 is not a finite positive scale");
        make_copy("fp8", &(st_edit){.name = "model.layers.1.self_attn.k_proj.k_scale", .dtype = "F32", .shape = {4},
                                    .n_dims = 1},
                  NULL);
        expect_err(kv_scales_of_copy(k, v, &found, err, sizeof err), TSR_E_INVAL,
                   "tensor 'model.layers.1.self_attn.k_proj.k_scale': dtype F32, 1 dims, 4 elements; expected a F32 "
                   "scalar");

        rm_file(tmpdir, "config.json");
        rm_file(tmpdir, "hf_quant_config.json");
        rm_file(tmpdir, "model.safetensors");
        rmdir(tmpdir);
}

/* tsr_modelopt_load_stack's checks that need no file: an NVFP4 config refuses a stack
 * (only the per-expert export is read), a dtype the config does not announce, a shape
 * that is not [E, rows, cols], a module the exclude list names.  (A real stack with its
 * scales: test_llama4.c test_modelopt_fp8; a missing scale: test_llama4_modelopt.py.) */
static void test_expert_stack_checks(void **state) {
        static uint8_t bytes[2 * 4 * 6];
        char err[512];
        tsr_tensor t = {0};
        tsr_safetensors_tensor w = {.name = "x", .dtype = TSR_ST_U8, .n_dims = 3, .shape = {2, 4, 6},
                                    .n_elements = 48, .n_bytes = 48, .data = bytes};
        char *ex[] = {"*experts*"};
        tsr_modelopt_config nv = {.algo = TSR_MODELOPT_NVFP4, .source = "hf_quant_config.json"};
        tsr_modelopt_config fp8 = {.algo = TSR_MODELOPT_FP8, .source = "hf_quant_config.json"};
        tsr_modelopt_config fp8_ex = fp8;
        const char *name = "model.layers.1.feed_forward.experts.gate_up_proj";
        (void)state;

        expect_err(tsr_modelopt_load_stack(&nv, NULL, name, &w, "m.safetensors", 2, 4, 6, &t, err, sizeof err),
                   TSR_E_UNSUPPORTED, "m.safetensors: tensor 'model.layers.1.feed_forward.experts.gate_up_proj': "
                   "dtype U8, which is not read as an NVFP4 expert stack (the per-expert layout");
        expect_err(tsr_modelopt_load_stack(&fp8, NULL, name, &w, "m.safetensors", 2, 4, 6, &t, err, sizeof err),
                   TSR_E_INVAL, "dtype U8, which does not match the announced quant_algo (FP8)");
        expect_err(tsr_modelopt_load_stack(NULL, NULL, name, &w, "m.safetensors", 2, 4, 6, &t, err, sizeof err),
                   TSR_E_INVAL, "which the checkpoint's config does not announce");
        w.dtype = TSR_ST_F8_E4M3;
        expect_err(tsr_modelopt_load_stack(&fp8, NULL, name, &w, "m.safetensors", 2, 6, 4, &t, err, sizeof err),
                   TSR_E_INVAL, "shape [2, 4, 6], expected [2, 6, 4]");
        fp8_ex.exclude = ex;
        fp8_ex.n_exclude = 1;
        expect_err(tsr_modelopt_load_stack(&fp8_ex, NULL, name, &w, "m.safetensors", 2, 4, 6, &t, err, sizeof err),
                   TSR_E_INVAL, "is F8_E4M3 but hf_quant_config.json excludes module");
        assert_null(t.data);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_config_forms),
                cmocka_unit_test(test_fp8_model),
                cmocka_unit_test(test_nvfp4_model),
                cmocka_unit_test(test_bad_checkpoints),
                cmocka_unit_test(test_kv_scales),
                cmocka_unit_test(test_expert_stack_checks),
        };
        tsr_cpu_backend_config cfg = {.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16};
        if (tsr_backend_cpu_ref_new(&ref_be) != TSR_OK || tsr_backend_cpu_new(&cfg, &fast_be) != TSR_OK)
                return 1;
        int failed = cmocka_run_group_tests(tests, golden_setup, golden_teardown);
        tsr_backend_free(&ref_be);
        tsr_backend_free(&fast_be);
        return failed;
}
