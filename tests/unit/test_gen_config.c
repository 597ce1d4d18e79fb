/* test_gen_config.c - --generation-config (auto | vllm | DIR) and
 * --override-generation-config as vLLM's ModelConfig.get_diff_sampling_param
 * resolves them: the source's defaults, the override laid on top (with vllm too), a
 * null override removing a default, and the bad inputs refused with a message. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "worker/load/gen_config.h"
#include "worker/load/model_meta.h"

static const char *source_root(void) {
        const char *r = getenv("TSR_SOURCE_ROOT");
        return r ? r : ".";
}

static void write_str(const char *dir, const char *name, const char *s) {
        char path[4096];
        FILE *f;

        snprintf(path, sizeof(path), "%s/%s", dir, name);
        f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(s, 1, strlen(s), f), strlen(s));
        fclose(f);
}

static void rm_dir(const char *dir) {
        char path[4096];

        snprintf(path, sizeof(path), "%s/generation_config.json", dir);
        unlink(path);
        snprintf(path, sizeof(path), "%s/plain_file", dir);
        unlink(path);
        rmdir(dir);
}

static void make_tmp_dir(char *dir, size_t len) {
        snprintf(dir, len, "/tmp/tsr_gencfg_XXXXXX");
        assert_non_null(mkdtemp(dir));
}

/* A loaded model's generation defaults, as model_meta fills them for `auto`. */
static tsr_model_meta model_with_defaults(void) {
        tsr_model_meta m;

        memset(&m, 0, sizeof(m));
        m.bos_token_id = -1;
        m.gen.has_temperature = true;
        m.gen.temperature = 0.7;
        m.gen.has_top_p = true;
        m.gen.top_p = 0.9;
        m.gen.has_top_k = true;
        m.gen.top_k = 20;
        m.gen.has_repetition_penalty = true;
        m.gen.repetition_penalty = 1.05;
        m.gen.has_max_new_tokens = true;
        m.gen.max_new_tokens = 128;
        return m;
}

static tsr_gen_override parse_ok(const char *text) {
        tsr_gen_override ov;
        char err[256] = "";

        assert_int_equal(tsr_gen_override_parse(text, &ov, err, sizeof(err)), TSR_OK);
        assert_string_equal(err, "");
        return ov;
}

static tsr_gen_defaults resolve_ok(const char *source, const tsr_model_meta *m, const char *override, bool *no_file) {
        tsr_gen_override ov = parse_ok(override);
        tsr_gen_defaults d;
        char err[512] = "";

        assert_int_equal(tsr_gen_defaults_resolve(source, m, &ov, &d, no_file, err, sizeof(err)), TSR_OK);
        return d;
}

static void assert_empty(const tsr_gen_defaults *d) {
        assert_false(d->has_temperature);
        assert_false(d->has_top_p);
        assert_false(d->has_top_k);
        assert_false(d->has_min_p);
        assert_false(d->has_repetition_penalty);
        assert_false(d->has_max_new_tokens);
}

static void assert_model_defaults(const tsr_gen_defaults *d) {
        assert_true(d->has_temperature);
        assert_true(d->temperature == 0.7);
        assert_true(d->has_top_p);
        assert_true(d->top_p == 0.9);
        assert_true(d->has_top_k);
        assert_int_equal(d->top_k, 20);
        assert_false(d->has_min_p);
        assert_true(d->has_repetition_penalty);
        assert_true(d->repetition_penalty == 1.05);
        assert_true(d->has_max_new_tokens);
        assert_int_equal(d->max_new_tokens, 128);
}

static void test_override_parse(void **state) {
        tsr_gen_override ov;
        (void)state;

        ov = parse_ok(NULL);
        assert_int_equal(ov.temperature, TSR_GEN_KEEP);
        assert_int_equal(ov.max_new_tokens, TSR_GEN_KEEP);
        ov = parse_ok("{}");
        assert_int_equal(ov.top_p, TSR_GEN_KEEP);
        ov = parse_ok("{\"temperature\": 0, \"top_p\": 0.5, \"top_k\": -1, \"min_p\": 0.05, "
                      "\"repetition_penalty\": 1.2, \"max_new_tokens\": 7}");
        assert_int_equal(ov.temperature, TSR_GEN_SET);
        assert_true(ov.values.temperature == 0.0);
        assert_int_equal(ov.top_p, TSR_GEN_SET);
        assert_true(ov.values.top_p == 0.5);
        assert_int_equal(ov.top_k, TSR_GEN_SET);
        assert_int_equal(ov.values.top_k, -1);
        assert_int_equal(ov.min_p, TSR_GEN_SET);
        assert_true(ov.values.min_p == 0.05);
        assert_int_equal(ov.repetition_penalty, TSR_GEN_SET);
        assert_true(ov.values.repetition_penalty == 1.2);
        assert_int_equal(ov.max_new_tokens, TSR_GEN_SET);
        assert_int_equal(ov.values.max_new_tokens, 7);
        /* An integer where a float goes is a float (JSON has one number type). */
        ov = parse_ok("{\"temperature\": 1}");
        assert_int_equal(ov.temperature, TSR_GEN_SET);
        assert_true(ov.values.temperature == 1.0);
        /* null removes; keys vLLM does not take are ignored, whatever their type. */
        ov = parse_ok("{\"temperature\": null, \"do_sample\": true, \"eos_token_id\": [5], \"num_beams\": \"x\"}");
        assert_int_equal(ov.temperature, TSR_GEN_CLEAR);
        assert_int_equal(ov.top_p, TSR_GEN_KEEP);
}

static void test_override_bad(void **state) {
        static const struct {
                const char *text, *want;
        } cases[] = {
                {"", "not valid JSON"},
                {"{bad", "not valid JSON"},
                {"{\"temperature\": 0.5", "not valid JSON"},
                {"{} {}", "not valid JSON"},
                {"[1]", "expected a JSON object"},
                {"5", "expected a JSON object"},
                {"null", "expected a JSON object"},
                {"\"{}\"", "expected a JSON object"},
                {"{\"temperature\": \"hot\"}", "key 'temperature': expected a number or null"},
                {"{\"top_p\": true}", "key 'top_p': expected a number or null"},
                {"{\"min_p\": [0.1]}", "key 'min_p': expected a number or null"},
                {"{\"repetition_penalty\": {}}", "key 'repetition_penalty': expected a number or null"},
                {"{\"top_k\": 1.5}", "key 'top_k': expected an integer or null"},
                {"{\"top_k\": \"5\"}", "key 'top_k': expected an integer or null"},
                {"{\"max_new_tokens\": 2.0}", "key 'max_new_tokens': expected an integer or null"},
                {"{\"max_new_tokens\": -1}", "key 'max_new_tokens': -1 is negative"},
        };
        (void)state;

        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                tsr_gen_override ov;
                char err[256] = "";

                memset(&ov, 0x5a, sizeof(ov));
                assert_int_equal(tsr_gen_override_parse(cases[i].text, &ov, err, sizeof(err)), TSR_E_INVAL);
                if (strncmp(err, "--override-generation-config: ", 30) != 0 || !strstr(err, cases[i].want))
                        fail_msg("%s: got '%s', want '%s'", cases[i].text, err, cases[i].want);
                /* *ret is left alone on failure */
                assert_int_equal(((unsigned char *)&ov)[0], 0x5a);
        }
}

static void test_auto(void **state) {
        tsr_model_meta m = model_with_defaults();
        tsr_gen_defaults d;
        bool no_file = true;
        (void)state;

        d = resolve_ok("auto", &m, NULL, &no_file);
        assert_model_defaults(&d);
        assert_false(no_file);
        /* NULL source is the flag's default, auto */
        d = resolve_ok(NULL, &m, "{}", NULL);
        assert_model_defaults(&d);
        /* the override: a value replaces, a new key adds, null removes, the rest stays */
        d = resolve_ok("auto", &m, "{\"temperature\": 0.0, \"min_p\": 0.1, \"top_k\": null, \"max_new_tokens\": 5}",
                       NULL);
        assert_true(d.has_temperature);
        assert_true(d.temperature == 0.0);
        assert_true(d.has_min_p);
        assert_true(d.min_p == 0.1);
        assert_false(d.has_top_k);
        assert_true(d.has_max_new_tokens);
        assert_int_equal(d.max_new_tokens, 5);
        assert_true(d.has_top_p);
        assert_true(d.top_p == 0.9);
        assert_true(d.has_repetition_penalty);
        assert_true(d.repetition_penalty == 1.05);
        /* a model without a generation_config.json: only the override */
        memset(&m, 0, sizeof(m));
        d = resolve_ok("auto", &m, "{\"top_p\": 0.25}", NULL);
        assert_true(d.has_top_p);
        assert_true(d.top_p == 0.25);
        assert_false(d.has_temperature);
        assert_false(d.has_max_new_tokens);
}

static void test_vllm(void **state) {
        tsr_model_meta m = model_with_defaults();
        tsr_gen_defaults d;
        (void)state;

        /* the model's file is not used... */
        d = resolve_ok("vllm", &m, NULL, NULL);
        assert_empty(&d);
        d = resolve_ok("vllm", &m, "{\"top_k\": null}", NULL);
        assert_empty(&d);
        /* ...but the override is (vLLM: "only the override parameters are used") */
        d = resolve_ok("vllm", &m, "{\"temperature\": 0, \"max_new_tokens\": 3}", NULL);
        assert_true(d.has_temperature);
        assert_true(d.temperature == 0.0);
        assert_true(d.has_max_new_tokens);
        assert_int_equal(d.max_new_tokens, 3);
        assert_false(d.has_top_p);
        assert_false(d.has_top_k);
        assert_false(d.has_repetition_penalty);
}

static void test_dir(void **state) {
        tsr_model_meta m = model_with_defaults();
        tsr_gen_defaults d;
        bool no_file = true;
        char dir[64];
        (void)state;

        make_tmp_dir(dir, sizeof(dir));
        write_str(dir, "generation_config.json",
                  "{\"temperature\": 0.0, \"min_p\": 0.2, \"max_new_tokens\": 3, \"eos_token_id\": [7, 8],"
                  " \"do_sample\": false, \"transformers_version\": \"4.57.0\"}");
        /* DIR's file replaces the model's: the model's top_p/top_k/... are not used */
        d = resolve_ok(dir, &m, NULL, &no_file);
        assert_false(no_file);
        assert_true(d.has_temperature);
        assert_true(d.temperature == 0.0);
        assert_true(d.has_min_p);
        assert_true(d.min_p == 0.2);
        assert_true(d.has_max_new_tokens);
        assert_int_equal(d.max_new_tokens, 3);
        assert_false(d.has_top_p);
        assert_false(d.has_top_k);
        assert_false(d.has_repetition_penalty);
        /* override on DIR */
        d = resolve_ok(dir, &m, "{\"temperature\": 0.5, \"min_p\": null, \"top_k\": 4}", NULL);
        assert_true(d.has_temperature);
        assert_true(d.temperature == 0.5);
        assert_false(d.has_min_p);
        assert_true(d.has_top_k);
        assert_int_equal(d.top_k, 4);
        assert_true(d.has_max_new_tokens);
        /* DIR without generation_config.json: no defaults, as vLLM (no error) */
        rm_dir(dir);
        make_tmp_dir(dir, sizeof(dir));
        d = resolve_ok(dir, &m, NULL, &no_file);
        assert_true(no_file);
        assert_empty(&d);
        d = resolve_ok(dir, &m, "{\"repetition_penalty\": 1.3}", &no_file);
        assert_true(no_file);
        assert_true(d.has_repetition_penalty);
        assert_true(d.repetition_penalty == 1.3);
        assert_false(d.has_temperature);
        rm_dir(dir);
}

/* The committed tiny HF fixture through both paths: auto (tsr_model_meta_load) and
 * DIR (tsr_model_meta_load_generation_config) read the same file the same way. */
static void test_fixture_dir_equals_auto(void **state) {
        char path[4096];
        tsr_model_meta *m = NULL;
        tsr_gen_defaults a, d;
        char err[512] = "";
        (void)state;

        snprintf(path, sizeof(path), "%s/tests/fixtures/tiny-hf", source_root());
        assert_int_equal(tsr_model_meta_load(path, &m, err, sizeof(err)), TSR_OK);
        a = resolve_ok("auto", m, NULL, NULL);
        d = resolve_ok(path, NULL, NULL, NULL);
        assert_model_defaults(&a);
        assert_model_defaults(&d);
        assert_memory_equal(&a, &d, sizeof(a));
        tsr_model_meta_free(&m);
}

static void test_dir_errors(void **state) {
        static const struct {
                const char *json, *want;
        } files[] = {
                {"{\"temperature\": ", "invalid JSON"},
                {"[0.5]", "expected a JSON object"},
                {"{\"temperature\": \"hot\"}", "field 'temperature'"},
                {"{\"top_k\": 2.5}", "field 'top_k'"},
                {"{\"max_new_tokens\": -4}", "field 'max_new_tokens': -4 is negative"},
        };
        tsr_gen_defaults d;
        char dir[64], missing[128], file_path[128], want_file[128];
        (void)state;

        make_tmp_dir(dir, sizeof(dir));
        snprintf(want_file, sizeof(want_file), "%s/generation_config.json: ", dir);
        for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
                char err[512] = "";

                write_str(dir, "generation_config.json", files[i].json);
                memset(&d, 0x5a, sizeof(d));
                assert_int_equal(tsr_gen_defaults_resolve(dir, NULL, NULL, &d, NULL, err, sizeof(err)), TSR_E_INVAL);
                if (strncmp(err, want_file, strlen(want_file)) != 0 || !strstr(err, files[i].want))
                        fail_msg("%s: got '%s', want '%s...%s'", files[i].json, err, want_file, files[i].want);
                assert_int_equal(((unsigned char *)&d)[0], 0x5a);
        }
        /* a folder that does not exist, and a plain file, are errors naming them */
        snprintf(missing, sizeof(missing), "%s/nope", dir);
        {
                char err[512] = "";
                assert_int_equal(tsr_gen_defaults_resolve(missing, NULL, NULL, &d, NULL, err, sizeof(err)),
                                 TSR_E_INVAL);
                assert_non_null(strstr(err, missing));
        }
        write_str(dir, "plain_file", "{}");
        snprintf(file_path, sizeof(file_path), "%s/plain_file", dir);
        {
                char err[512] = "";
                assert_int_equal(tsr_gen_defaults_resolve(file_path, NULL, NULL, &d, NULL, err, sizeof(err)),
                                 TSR_E_INVAL);
                assert_non_null(strstr(err, file_path));
                assert_non_null(strstr(err, "not a directory"));
        }
        rm_dir(dir);
}

static void test_format(void **state) {
        tsr_model_meta m = model_with_defaults();
        tsr_gen_defaults d;
        char buf[256];
        (void)state;

        d = resolve_ok("vllm", &m, NULL, NULL);
        tsr_gen_defaults_format(&d, buf, sizeof(buf));
        assert_string_equal(buf, "none");
        d = resolve_ok("auto", &m, "{\"min_p\": 0.5}", NULL);
        tsr_gen_defaults_format(&d, buf, sizeof(buf));
        assert_string_equal(buf, "temperature=0.7 top_p=0.9 top_k=20 min_p=0.5 repetition_penalty=1.05 "
                                 "max_new_tokens=128");
        tsr_gen_defaults_format(&d, buf, 12);   /* truncated, still a string */
        assert_true(strlen(buf) < 12);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_override_parse),
                cmocka_unit_test(test_override_bad),
                cmocka_unit_test(test_auto),
                cmocka_unit_test(test_vllm),
                cmocka_unit_test(test_dir),
                cmocka_unit_test(test_fixture_dir_equals_auto),
                cmocka_unit_test(test_dir_errors),
                cmocka_unit_test(test_format),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
