/* test_model_meta.c - model metadata from tests/fixtures/tiny-hf, from real GGUF files,
 * and the errors for broken folders and files.
 *
 * tiny-hf is built by tests/fixtures/make_tiny_hf.py; the GGUF facts were read with the
 * Python `gguf` package.  GGUF tests skip when a file is absent. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <math.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/buf.h"
#include "worker/load/gguf.h"
#include "worker/load/model_meta.h"

static bool starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

static const char *source_root(void) {
        const char *r = getenv("TSR_SOURCE_ROOT");
        return r ? r : ".";
}

static char *read_all(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        char *buf;
        long n;

        assert_non_null(f);
        assert_int_equal(fseek(f, 0, SEEK_END), 0);
        n = ftell(f);
        assert_true(n >= 0);
        rewind(f);
        buf = malloc((size_t)n + 1);
        assert_non_null(buf);
        assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
        buf[n] = '\0';
        fclose(f);
        *len = (size_t)n;
        return buf;
}

static void write_file(const char *dir, const char *name, const void *data, size_t len) {
        char path[4096];
        FILE *f;

        snprintf(path, sizeof(path), "%s/%s", dir, name);
        f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(data, 1, len, f), len);
        fclose(f);
}

static void write_str(const char *dir, const char *name, const char *s) { write_file(dir, name, s, strlen(s)); }

static void rm_dir(const char *dir) {
        static const char *const names[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                            "generation_config.json", "chat_template.jinja", "model.gguf",
                                            "model.bin"};
        char path[4096];

        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
                snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
                unlink(path);
        }
        rmdir(dir);
}

static void make_tmp_dir(char *dir, size_t len) {
        snprintf(dir, len, "/tmp/tsr_meta_XXXXXX");
        assert_non_null(mkdtemp(dir));
}

/* Load, expecting failure with `status` and every needle in the message. */
static void expect_fail(const char *path, tsr_status status, const char *needle1, const char *needle2) {
        tsr_model_meta *m = NULL;
        char err[1024] = "";
        tsr_status st = tsr_model_meta_load(path, &m, err, sizeof(err));

        if (st != status || !strstr(err, needle1) || (needle2 && !strstr(err, needle2)))
                fail_msg("status %d, message \"%s\"; wanted %d with \"%s\" / \"%s\"", st, err, status, needle1,
                         needle2 ? needle2 : "");
        assert_null(m);
}

static tsr_model_meta *load_ok(const char *path) {
        tsr_model_meta *m = NULL;
        char err[1024] = "";

        if (tsr_model_meta_load(path, &m, err, sizeof(err)) != TSR_OK)
                fail_msg("%s", err);
        assert_non_null(m);
        return m;
}

/* ---- tiny-hf ---------------------------------------------------------------------- */

static void test_tiny_hf(void **state) {
        char dir[2048], path[4096];
        tsr_model_meta *m, *m2;
        char *tok, *tok_cfg;
        size_t tok_len, tok_cfg_len;
        XXH64_state_t *h;
        uint64_t want_hash;

        snprintf(dir, sizeof(dir), "%s/tests/fixtures/tiny-hf", source_root());
        m = load_ok(dir);
        assert_string_equal(m->path, dir);
        assert_string_equal(m->format, "hf");
        assert_string_equal(m->architecture, "LlamaForCausalLM");
        assert_string_equal(m->model_type, "llama");
        assert_int_equal(m->max_model_len, 512);
        assert_int_equal(m->vocab_size, 300);
        assert_int_equal(m->bos_token_id, 1);
        /* config.json says 2, generation_config.json [2, 0]: the union keeps first-seen order. */
        assert_int_equal(m->n_eos_token_ids, 2);
        assert_int_equal(m->eos_token_ids[0], 2);
        assert_int_equal(m->eos_token_ids[1], 0);

        assert_non_null(m->chat_template);
        assert_true(starts_with(m->chat_template, "{% for message in messages %}{{ '<|im_start|>' + message['role']"));
        assert_non_null(strstr(m->chat_template, "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"));

        assert_true(m->gen.has_temperature && fabs(m->gen.temperature - 0.7) < 1e-12);
        assert_true(m->gen.has_top_p && fabs(m->gen.top_p - 0.9) < 1e-12);
        assert_true(m->gen.has_top_k && m->gen.top_k == 20);
        assert_false(m->gen.has_min_p);
        assert_true(m->gen.has_repetition_penalty && fabs(m->gen.repetition_penalty - 1.05) < 1e-12);
        assert_true(m->gen.has_max_new_tokens && m->gen.max_new_tokens == 128);

        assert_int_equal(m->hidden_size, 64);
        assert_int_equal(m->num_hidden_layers, 2);
        assert_int_equal(m->num_attention_heads, 4);
        assert_int_equal(m->num_key_value_heads, 2);
        assert_int_equal(m->head_dim, 16);              /* not in config.json: 64 / 4 */
        assert_int_equal(m->intermediate_size, 176);
        assert_true(m->rope_theta == 10000.0);
        assert_true(fabs(m->rms_norm_eps - 1e-5) < 1e-15);
        assert_true(m->tie_word_embeddings);
        assert_null(m->gguf_tokenizer);

        /* The bytes are the files' bytes, and the hash is XXH64 over both in order. */
        snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
        tok = read_all(path, &tok_len);
        snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
        tok_cfg = read_all(path, &tok_cfg_len);
        assert_int_equal(m->tokenizer_json_len, tok_len);
        assert_memory_equal(m->tokenizer_json, tok, tok_len);
        assert_int_equal(m->tokenizer_json[tok_len], '\0');
        assert_int_equal(m->tokenizer_config_json_len, tok_cfg_len);
        assert_memory_equal(m->tokenizer_config_json, tok_cfg, tok_cfg_len);
        assert_non_null(strstr((const char *)m->tokenizer_json, "\"<|im_end|>\""));
        h = XXH64_createState();
        assert_non_null(h);
        XXH64_reset(h, 0);
        XXH64_update(h, tok, tok_len);
        XXH64_update(h, tok_cfg, tok_cfg_len);
        want_hash = XXH64_digest(h);
        XXH64_freeState(h);
        assert_true(m->tokenizer_hash != 0);
        assert_true(m->tokenizer_hash == want_hash);

        m2 = load_ok(dir);
        assert_true(m2->tokenizer_hash == m->tokenizer_hash);
        tsr_model_meta_free(&m2);
        tsr_model_meta_free(&m);
        assert_null(m);
        tsr_model_meta_free(&m);        /* NULL is fine */
        free(tok);
        free(tok_cfg);
}

/* A folder with a minimal tokenizer.json, for the variants below. */
static void make_hf_dir(char *dir, size_t len, const char *config) {
        make_tmp_dir(dir, len);
        write_str(dir, "config.json", config);
        write_str(dir, "tokenizer.json", "{\"version\":\"1.0\",\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]}}");
}

static void test_hf_variants(void **state) {
        char dir[64];
        tsr_model_meta *m;

        /* eos list in config.json, fields under text_config, list-form chat_template,
         * generation_config with nulls, no tokenizer_config hash contribution beyond its bytes. */
        make_hf_dir(dir, sizeof(dir),
                    "{\"architectures\": [\"Llama4ForConditionalGeneration\"], \"model_type\": \"llama4\","
                    " \"eos_token_id\": [200001, 200007, 200001], \"bos_token_id\": null,"
                    " \"text_config\": {\"hidden_size\": 5120, \"num_hidden_layers\": 48,"
                    "   \"num_attention_heads\": 40, \"num_key_value_heads\": 8, \"head_dim\": 128,"
                    "   \"max_position_embeddings\": 10485760, \"vocab_size\": 202048,"
                    "   \"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-05, \"intermediate_size\": 8192}}");
        write_str(dir, "generation_config.json",
                  "{\"bos_token_id\": 200000, \"eos_token_id\": [200007, 200008], \"temperature\": null,"
                  " \"top_k\": null, \"min_p\": 0.05}");
        write_str(dir, "tokenizer_config.json",
                  "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"TOOLS\"},"
                  " {\"name\": \"default\", \"template\": \"DEFAULT {{ messages }}\"}],"
                  /* what transformers writes when a model sets no maximum: past int64 */
                  " \"model_max_length\": 1000000000000000019884624838656}");
        m = load_ok(dir);
        assert_string_equal(m->architecture, "Llama4ForConditionalGeneration");
        assert_int_equal(m->hidden_size, 5120);
        assert_int_equal(m->num_hidden_layers, 48);
        assert_int_equal(m->num_key_value_heads, 8);
        assert_int_equal(m->head_dim, 128);
        assert_int_equal(m->max_model_len, 10485760);
        assert_int_equal(m->vocab_size, 202048);
        assert_true(m->rope_theta == 500000.0);
        assert_false(m->tie_word_embeddings);
        assert_int_equal(m->bos_token_id, 200000);     /* from generation_config: config has null */
        assert_int_equal(m->n_eos_token_ids, 3);
        assert_int_equal(m->eos_token_ids[0], 200001);
        assert_int_equal(m->eos_token_ids[1], 200007);
        assert_int_equal(m->eos_token_ids[2], 200008);
        assert_string_equal(m->chat_template, "DEFAULT {{ messages }}");
        assert_false(m->gen.has_temperature);
        assert_false(m->gen.has_top_k);
        assert_true(m->gen.has_min_p && m->gen.min_p == 0.05);
        tsr_model_meta_free(&m);
        rm_dir(dir);

        /* No generation_config or tokenizer_config: chat_template.jinja is the template, the
         * hash covers tokenizer.json alone, head_dim and kv heads are derived. */
        make_hf_dir(dir, sizeof(dir),
                    "{\"hidden_size\": 96, \"num_attention_heads\": 3, \"eos_token_id\": 7}");
        write_str(dir, "chat_template.jinja", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
        m = load_ok(dir);
        assert_null(m->architecture);
        assert_null(m->model_type);
        assert_int_equal(m->head_dim, 32);
        assert_int_equal(m->num_key_value_heads, 3);
        assert_int_equal(m->bos_token_id, -1);
        assert_int_equal(m->n_eos_token_ids, 1);
        assert_int_equal(m->eos_token_ids[0], 7);
        assert_string_equal(m->chat_template, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
        assert_null(m->tokenizer_config_json);
        assert_int_equal(m->tokenizer_config_json_len, 0);
        assert_true(m->tokenizer_hash == XXH64(m->tokenizer_json, m->tokenizer_json_len, 0));
        assert_false(m->gen.has_temperature || m->gen.has_top_p || m->gen.has_top_k || m->gen.has_max_new_tokens);
        tsr_model_meta_free(&m);
        rm_dir(dir);
}

/* The tokenizer's EOS goes first (engine.h: eos_ids[0] stops as EOS, the others as stop
 * ids, as vLLM): Llama 3.3 Instruct's layout, where config.json lists [128001, 128008,
 * 128009] and the tokenizer's eos_token is <|eot_id|> (128009); one whose eos_token the
 * configs do not list (added in front); one found in model.vocab, not added_tokens; and
 * one no table has (order unchanged). */
static void test_hf_tokenizer_eos_first(void **state) {
        static const char tok_json[] =
                "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":128000,\"content\":\"<|begin_of_text|>\"},"
                "{\"id\":128001,\"content\":\"<|end_of_text|>\"},{\"id\":128008,\"content\":\"<|eom_id|>\"},"
                "{\"id\":128009,\"content\":\"<|eot_id|>\"}],"
                "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"</s>\":7},\"merges\":[]}}";
        static const struct {
                const char *eos_token;          /* tokenizer_config.json's value, JSON */
                uint32_t want[4];
                size_t n;
        } cases[] = {
                {"\"<|eot_id|>\"", {128009, 128001, 128008}, 3},
                {"{\"content\": \"<|eot_id|>\", \"special\": true}", {128009, 128001, 128008}, 3},
                {"\"<|begin_of_text|>\"", {128000, 128001, 128008, 128009}, 4},
                {"\"</s>\"", {7, 128001, 128008, 128009}, 4},
                {"\"<|nowhere|>\"", {128001, 128008, 128009}, 3},
                {"null", {128001, 128008, 128009}, 3},
        };
        for (size_t k = 0; k < sizeof(cases) / sizeof(*cases); k++) {
                char dir[64], tok_cfg[256];
                tsr_model_meta *m;
                make_hf_dir(dir, sizeof(dir),
                            "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
                            " \"eos_token_id\": [128001, 128008, 128009], \"max_position_embeddings\": 64,"
                            " \"vocab_size\": 128256}");
                write_str(dir, "tokenizer.json", tok_json);
                snprintf(tok_cfg, sizeof(tok_cfg), "{\"eos_token\": %s}", cases[k].eos_token);
                write_str(dir, "tokenizer_config.json", tok_cfg);
                m = load_ok(dir);
                if (m->n_eos_token_ids != cases[k].n ||
                    memcmp(m->eos_token_ids, cases[k].want, cases[k].n * sizeof(uint32_t)) != 0)
                        fail_msg("eos_token %s: %zu ids, first %u", cases[k].eos_token, m->n_eos_token_ids,
                                 m->n_eos_token_ids ? m->eos_token_ids[0] : 0);
                tsr_model_meta_free(&m);
                rm_dir(dir);
        }
}

static void test_hf_errors(void **state) {
        char dir[64], path[128], err[512];
        tsr_model_meta *m = NULL;
        int fd;

        expect_fail("/nonexistent/model", TSR_E_NOTFOUND, "/nonexistent/model", NULL);

        make_tmp_dir(dir, sizeof(dir));
        snprintf(path, sizeof(path), "%s/config.json", dir);
        expect_fail(dir, TSR_E_NOTFOUND, path, "no such file");

        write_str(dir, "config.json", "{\"hidden_size\": 64,");
        expect_fail(dir, TSR_E_INVAL, path, "invalid JSON");
        write_str(dir, "config.json", "[1, 2]");
        expect_fail(dir, TSR_E_INVAL, path, "JSON object");
        write_str(dir, "config.json", "{\"hidden_size\": 64, \"hidden_size\": 65}");
        expect_fail(dir, TSR_E_INVAL, path, "duplicate");
        write_str(dir, "config.json", "{\"num_hidden_layers\": \"2\"}");
        snprintf(err, sizeof(err), "%s: field 'num_hidden_layers': expected an integer", path);
        expect_fail(dir, TSR_E_INVAL, err, NULL);
        write_str(dir, "config.json", "{\"hidden_size\": -64}");
        expect_fail(dir, TSR_E_INVAL, "field 'hidden_size'", "out of range");
        write_str(dir, "config.json", "{\"text_config\": {\"head_dim\": 1.5}}");
        expect_fail(dir, TSR_E_INVAL, "field 'text_config.head_dim'", "expected an integer");
        write_str(dir, "config.json", "{\"rms_norm_eps\": \"small\"}");
        expect_fail(dir, TSR_E_INVAL, "field 'rms_norm_eps'", "expected a number");
        write_str(dir, "config.json", "{\"tie_word_embeddings\": 1}");
        expect_fail(dir, TSR_E_INVAL, "field 'tie_word_embeddings'", "true or false");
        write_str(dir, "config.json", "{\"architectures\": \"LlamaForCausalLM\"}");
        expect_fail(dir, TSR_E_INVAL, "field 'architectures'", NULL);
        write_str(dir, "config.json", "{\"eos_token_id\": [2, \"x\"]}");
        expect_fail(dir, TSR_E_INVAL, "field 'eos_token_id[1]'", "expected an integer");
        write_str(dir, "config.json", "{\"eos_token_id\": -3}");
        expect_fail(dir, TSR_E_INVAL, "field 'eos_token_id'", "not a token id");

        /* A valid config.json but no tokenizer.json. */
        write_str(dir, "config.json", "{\"hidden_size\": 64}");
        snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
        expect_fail(dir, TSR_E_NOTFOUND, path, "no such file");

        /* Bad optional files are errors too: they name their own file. */
        write_str(dir, "tokenizer.json", "{}");
        write_str(dir, "generation_config.json", "{\"top_k\": \"many\"}");
        snprintf(path, sizeof(path), "%s/generation_config.json", dir);
        expect_fail(dir, TSR_E_INVAL, path, "field 'top_k': expected an integer");
        write_str(dir, "generation_config.json", "{\"eos_token_id\": {\"id\": 2}}");
        expect_fail(dir, TSR_E_INVAL, path, "expected an integer or a list of integers");
        unlink(path);
        write_str(dir, "tokenizer_config.json", "{\"chat_template\": 42}");
        snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
        expect_fail(dir, TSR_E_INVAL, path, "field 'chat_template'");
        write_str(dir, "tokenizer_config.json", "{\"chat_template\": [{\"name\": \"default\"}]}");
        expect_fail(dir, TSR_E_INVAL, path, "field 'chat_template[0]'");
        write_str(dir, "tokenizer_config.json", "{\"chat_template\": \"ok\"}");
        m = load_ok(dir);
        assert_string_equal(m->chat_template, "ok");
        tsr_model_meta_free(&m);

        /* A tokenizer.json over the 256 MiB cap (sparse, so the test writes nothing). */
        snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
        fd = open(path, O_WRONLY | O_TRUNC);
        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, (off_t)TSR_MODEL_META_MAX_TOKENIZER_JSON + 1), 0);
        close(fd);
        expect_fail(dir, TSR_E_LIMIT, path, "limit");

        /* Neither a folder nor a .gguf. */
        write_str(dir, "model.bin", "GGUF");
        snprintf(path, sizeof(path), "%s/model.bin", dir);
        expect_fail(path, TSR_E_INVAL, path, "not a model folder or a .gguf file");
        rm_dir(dir);
}

/* ---- GGUF ------------------------------------------------------------------------- */

static void w_le(tsr_buf *b, uint64_t x, int n) {
        for (int i = 0; i < n; i++) {
                uint8_t c = (uint8_t)(x >> (8 * i));
                assert_int_equal(tsr_buf_append(b, &c, 1), TSR_OK);
        }
}

static void w_str(tsr_buf *b, const char *s) {
        w_le(b, strlen(s), 8);
        assert_int_equal(tsr_buf_append(b, s, strlen(s)), TSR_OK);
}

static void w_kv_str(tsr_buf *b, const char *key, const char *val) {
        w_str(b, key);
        w_le(b, TSR_GGUF_TYPE_STRING, 4);
        w_str(b, val);
}

static void w_kv_u32(tsr_buf *b, const char *key, uint32_t val) {
        w_str(b, key);
        w_le(b, TSR_GGUF_TYPE_UINT32, 4);
        w_le(b, val, 4);
}

/* A tokenizer-only GGUF (no tensors): 4 tokens and the given eos id.  With `with_tokens`
 * false the tokenizer keys are left out. */
static void write_gguf(const char *path, bool with_tokens, uint32_t eos) {
        tsr_buf b;
        FILE *f;

        tsr_buf_init(&b, 1 << 16);
        assert_int_equal(tsr_buf_append(&b, "GGUF", 4), TSR_OK);
        w_le(&b, 3, 4);
        w_le(&b, 0, 8);
        w_le(&b, with_tokens ? 6 : 2, 8);
        w_kv_str(&b, "general.architecture", "qwen3");
        w_kv_u32(&b, "qwen3.context_length", 40960);
        if (with_tokens) {
                w_kv_str(&b, "tokenizer.ggml.model", "gpt2");
                w_str(&b, "tokenizer.ggml.tokens");
                w_le(&b, TSR_GGUF_TYPE_ARRAY, 4);
                w_le(&b, TSR_GGUF_TYPE_STRING, 4);
                w_le(&b, 4, 8);
                w_str(&b, "a");
                w_str(&b, "b");
                w_str(&b, "<eot>");
                w_str(&b, "<eos>");
                w_kv_u32(&b, "tokenizer.ggml.eos_token_id", eos);
                w_kv_u32(&b, "tokenizer.ggml.eot_token_id", 2);
        }
        f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(b.data, 1, b.len, f), b.len);
        fclose(f);
        tsr_buf_done(&b);
}

static void test_gguf_small_and_errors(void **state) {
        char dir[64], path[128], src[4096];
        tsr_model_meta *m;
        char *bytes;
        size_t len;

        make_tmp_dir(dir, sizeof(dir));
        snprintf(path, sizeof(path), "%s/model.gguf", dir);
        write_gguf(path, true, 3);
        m = load_ok(path);
        assert_string_equal(m->format, "gguf");
        assert_string_equal(m->architecture, "qwen3");
        assert_string_equal(m->model_type, "qwen3");
        assert_int_equal(m->max_model_len, 40960);
        assert_int_equal(m->vocab_size, 4);
        assert_int_equal(m->n_eos_token_ids, 2);       /* eos 3, then eot 2 */
        assert_int_equal(m->eos_token_ids[0], 3);
        assert_int_equal(m->eos_token_ids[1], 2);
        assert_int_equal(m->bos_token_id, -1);
        assert_null(m->chat_template);
        assert_null(m->tokenizer_json);
        assert_string_equal(m->gguf_tokenizer->tokens[2], "<eot>");
        assert_null(m->gguf_tokenizer->merges);
        assert_null(m->gguf_tokenizer->scores);
        assert_false(m->gguf_tokenizer->add_bos);      /* gpt2 default */
        assert_true(m->tie_word_embeddings);            /* no output.weight */
        assert_true(m->tokenizer_hash != 0);
        tsr_model_meta_free(&m);

        write_gguf(path, true, 4);                      /* eos id past the 4 tokens */
        expect_fail(path, TSR_E_INVAL, "tokenizer.ggml.eos_token_id", "out of range");
        write_gguf(path, false, 0);
        expect_fail(path, TSR_E_INVAL, path, "key 'tokenizer.ggml.model': missing");

        /* Truncated real file when present, else the small one cut in half. */
        snprintf(src, sizeof(src), "%s/models/stories260K.gguf", getenv("TSR_FIXTURES") ? getenv("TSR_FIXTURES") : "/nonexistent");
        if (access(src, R_OK) != 0) {
                write_gguf(path, true, 3);
                snprintf(src, sizeof(src), "%s", path);
        }
        bytes = read_all(src, &len);
        write_file(dir, "model.gguf", bytes, len - 1);
        expect_fail(path, TSR_E_INVAL, path, NULL);
        write_file(dir, "model.gguf", bytes, len / 2);
        expect_fail(path, TSR_E_INVAL, path, NULL);
        write_file(dir, "model.gguf", bytes, 3);
        expect_fail(path, TSR_E_INVAL, path, "magic");
        free(bytes);
        rm_dir(dir);
}

static char *fixture(const char *env, const char *rel, char *path, size_t len) {
        const char *dir = getenv(env);

        if (!dir)
                return NULL;
        snprintf(path, len, "%s/%s", dir, rel);
        return access(path, R_OK) == 0 ? path : NULL;
}

static void test_gguf_stories260k(void **state) {
        char path[4096];
        tsr_model_meta *m, *m2;
        const tsr_gguf_tokenizer *t;

        if (!fixture("TSR_FIXTURES", "models/stories260K.gguf", path, sizeof(path)))
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", path);
        m = load_ok(path);
        assert_string_equal(m->format, "gguf");
        assert_string_equal(m->architecture, "llama");
        assert_int_equal(m->max_model_len, 2048);
        assert_int_equal(m->vocab_size, 512);
        assert_int_equal(m->bos_token_id, 1);
        assert_int_equal(m->n_eos_token_ids, 1);
        assert_int_equal(m->eos_token_ids[0], 2);
        assert_null(m->chat_template);
        assert_int_equal(m->hidden_size, 64);
        assert_int_equal(m->num_hidden_layers, 5);
        assert_int_equal(m->num_attention_heads, 8);
        assert_int_equal(m->num_key_value_heads, 4);
        assert_int_equal(m->head_dim, 8);
        assert_int_equal(m->intermediate_size, 172);
        assert_true(m->rope_theta == 0.0);              /* no llama.rope.freq_base in this file */
        assert_true(fabs(m->rms_norm_eps - 1e-5) < 1e-9);
        assert_false(m->tie_word_embeddings);           /* it has output.weight */
        t = m->gguf_tokenizer;
        assert_non_null(t);
        assert_string_equal(t->model, "llama");
        assert_null(t->pre);
        assert_int_equal(t->n_tokens, 512);
        assert_string_equal(t->tokens[0], "<unk>");
        assert_string_equal(t->tokens[1], "<s>");
        assert_string_equal(t->tokens[100], "<0x61>");
        assert_string_equal(t->tokens[511], "\xe2\x80\x8a");   /* U+200A */
        assert_non_null(t->scores);
        assert_true(t->scores[300] == -41.0f);
        assert_non_null(t->token_types);
        assert_int_equal(t->token_types[0], 2);
        assert_int_equal(t->token_types[3], 6);
        assert_int_equal(t->n_merges, 0);
        assert_int_equal(t->bos_id, 1);
        assert_int_equal(t->eos_id, 2);
        assert_int_equal(t->unk_id, 0);
        assert_int_equal(t->pad_id, -1);                /* stored as 0xFFFFFFFF */
        assert_true(t->add_bos);                        /* SentencePiece default */
        assert_false(t->add_eos);
        assert_true(t->add_space_prefix);
        assert_true(m->tokenizer_hash != 0);
        m2 = load_ok(path);
        assert_true(m2->tokenizer_hash == m->tokenizer_hash);
        tsr_model_meta_free(&m2);
        tsr_model_meta_free(&m);
}

static void test_gguf_llama2_tiny_random(void **state) {
        char path[4096], other[4096];
        tsr_model_meta *m, *s;

        if (!fixture("TSR_FIXTURES", "models/llama-2-tiny-random.gguf", path, sizeof(path)))
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", path);
        m = load_ok(path);
        assert_string_equal(m->architecture, "llama");
        assert_int_equal(m->max_model_len, 4096);
        assert_int_equal(m->vocab_size, 32000);
        assert_int_equal(m->bos_token_id, 1);
        assert_int_equal(m->n_eos_token_ids, 1);
        assert_int_equal(m->eos_token_ids[0], 2);
        assert_null(m->chat_template);
        assert_int_equal(m->hidden_size, 8);
        assert_int_equal(m->num_hidden_layers, 1);
        assert_int_equal(m->num_attention_heads, 2);
        assert_int_equal(m->num_key_value_heads, 2);
        assert_int_equal(m->head_dim, 4);
        assert_int_equal(m->intermediate_size, 32);
        assert_false(m->tie_word_embeddings);
        assert_string_equal(m->gguf_tokenizer->model, "llama");
        assert_int_equal(m->gguf_tokenizer->n_tokens, 32000);
        assert_string_equal(m->gguf_tokenizer->tokens[31999], "\xe7\xbb\x99");
        assert_non_null(m->gguf_tokenizer->scores);
        assert_true(m->gguf_tokenizer->scores[300] == -41.0f);
        assert_int_equal(m->gguf_tokenizer->token_types[100], 6);
        assert_int_equal(m->gguf_tokenizer->pad_id, -1);
        /* A different tokenizer hashes differently. */
        if (fixture("TSR_FIXTURES", "models/stories260K.gguf", other, sizeof(other))) {
                s = load_ok(other);
                assert_true(s->tokenizer_hash != m->tokenizer_hash);
                tsr_model_meta_free(&s);
        }
        tsr_model_meta_free(&m);
}

static void test_gguf_smollm2(void **state) {
        char path[4096];
        tsr_model_meta *m;
        const tsr_gguf_tokenizer *t;

        if (!fixture("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", path, sizeof(path)))
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-model.sh fetches it)", path);
        m = load_ok(path);
        assert_string_equal(m->architecture, "llama");
        assert_int_equal(m->max_model_len, 8192);
        assert_int_equal(m->vocab_size, 49152);
        assert_int_equal(m->bos_token_id, 1);
        assert_int_equal(m->n_eos_token_ids, 1);
        assert_int_equal(m->eos_token_ids[0], 2);
        assert_non_null(m->chat_template);
        assert_int_equal(strlen(m->chat_template), 368);
        assert_true(starts_with(m->chat_template,
                                "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"));
        assert_non_null(strstr(m->chat_template, "You are a helpful AI assistant named SmolLM"));
        assert_int_equal(m->hidden_size, 576);
        assert_int_equal(m->num_hidden_layers, 30);
        assert_int_equal(m->num_attention_heads, 9);
        assert_int_equal(m->num_key_value_heads, 3);
        assert_int_equal(m->head_dim, 64);
        assert_int_equal(m->intermediate_size, 1536);
        assert_true(m->rope_theta == 100000.0);
        assert_true(fabs(m->rms_norm_eps - 1e-5) < 1e-9);
        assert_true(m->tie_word_embeddings);            /* no output.weight */
        t = m->gguf_tokenizer;
        assert_string_equal(t->model, "gpt2");
        assert_string_equal(t->pre, "smollm");
        assert_int_equal(t->n_tokens, 49152);
        assert_string_equal(t->tokens[1], "<|im_start|>");
        assert_string_equal(t->tokens[100], "t");
        assert_null(t->scores);
        assert_non_null(t->token_types);
        assert_int_equal(t->token_types[0], 3);
        assert_int_equal(t->token_types[100], 1);
        assert_int_equal(t->n_merges, 48900);
        assert_true(t->n_merges > 0);
        assert_string_equal(t->merges[0], "\xc4\xa0 t");
        assert_string_equal(t->merges[48899], "ect able");
        assert_int_equal(t->bos_id, 1);
        assert_int_equal(t->eos_id, 2);
        assert_int_equal(t->unk_id, 0);
        assert_int_equal(t->pad_id, 2);
        assert_false(t->add_bos);
        assert_false(t->add_space_prefix);
        assert_true(m->tokenizer_hash != 0);
        tsr_model_meta_free(&m);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_tiny_hf),
                cmocka_unit_test(test_hf_variants),
                cmocka_unit_test(test_hf_errors),
                cmocka_unit_test(test_hf_tokenizer_eos_first),
                cmocka_unit_test(test_gguf_small_and_errors),
                cmocka_unit_test(test_gguf_stories260k),
                cmocka_unit_test(test_gguf_llama2_tiny_random),
                cmocka_unit_test(test_gguf_smollm2),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
