/* test_nemotron_h.c - the NemotronH family (worker/model/nemotron_h.h) against
 * transformers on tests/fixtures/tiny-nemotron-h (tests/fixtures/make_tiny_nemotron_h.py):
 * a tiny random NemotronHForCausalLM with the pattern "ME*M-E" (every block type),
 * n_groups 2, grouped routing with a correction bias that changes the choices.
 *
 *  - every position's logits within 1e-4 of transformers' fp32 ones, full sequence;
 *  - the decode path (state carried across one-token steps) against transformers' cache
 *    decode, and prefill cut into chunks that cross the conv window and the KV blocks;
 *  - the greedy 32-token continuations token for token (prefill, then decode steps);
 *  - batch invariance: a sequence alone and batched with others, bitwise;
 *  - config and argument errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/tsr_test.h"
#include "tests/unit/test_util.h"
#include "worker/model/family.h"
#include "worker/model/nemotron_h.h"

#define FIXTURE "tests/fixtures/tiny-nemotron-h"
#define TOL 1e-4f
#define BLOCK 4         /* small blocks: every prompt spans several */
#define SEQ_BLOCKS 32   /* 128 positions per sequence */
#define N_SLOTS 4

static json_t *golden;
static tsr_nemotron_h *model;
static tsr_backend *be;
static uint32_t vocab;

static int setup(void **state) {
        char path[1024], err[512] = "";
        json_error_t je;

        (void)state;
        if (!tsr_test_src_path(FIXTURE "/golden.json", path, sizeof path) || !(golden = json_load_file(path, 0, &je)))
                return -1;
        if (!tsr_test_src_path(FIXTURE "/model", path, sizeof path) ||
            tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, &model, NULL, err, sizeof err) != TSR_OK) {
                fprintf(stderr, "load: %s\n", err);
                return -1;
        }
        vocab = tsr_nemotron_h_config_of(model)->vocab_size;
        return tsr_backend_cpu_ref_new(&be) == TSR_OK ? 0 : -1;
}

static int teardown(void **state) {
        (void)state;
        tsr_backend_free(&be);
        tsr_nemotron_h_free(&model);
        json_decref(golden);
        return 0;
}

/* Every row of transformers' logits file: the prompts' full rows, then the decode rows. */
static float *load_logits(size_t *n_rows) {
        char path[1024];
        struct stat sb;
        float *v;
        FILE *f;

        assert_non_null(tsr_test_src_path(FIXTURE "/logits.f32", path, sizeof path));
        assert_int_equal(stat(path, &sb), 0);
        assert_int_equal(sb.st_size % (vocab * sizeof(float)), 0);
        *n_rows = (size_t)sb.st_size / (vocab * sizeof(float));
        v = malloc((size_t)sb.st_size);
        assert_non_null(v);
        f = fopen(path, "rb");
        assert_non_null(f);
        assert_int_equal(fread(v, sizeof(float), *n_rows * vocab, f), *n_rows * vocab);   /* little-endian host */
        fclose(f);
        return v;
}

/* max |a - b| over rows of the vocabulary, and the same argmax in each row. */
static float compare_rows(const float *got, const float *want, size_t rows) {
        float worst = 0.0f;
        for (size_t r = 0; r < rows; r++) {
                for (size_t j = 0; j < vocab; j++) {
                        float d = fabsf(got[r * vocab + j] - want[r * vocab + j]);
                        assert_false(isnan(d));
                        worst = d > worst ? d : worst;
                }
                assert_int_equal(tsr_test_argmax(got + r * vocab, vocab), tsr_test_argmax(want + r * vocab, vocab));
        }
        return worst;
}

/* Block table of sequence `k`: its own run of SEQ_BLOCKS blocks. */
static void table_of(size_t k, uint32_t *table) {
        for (size_t b = 0; b < SEQ_BLOCKS; b++)
                table[b] = (uint32_t)(k * SEQ_BLOCKS + b);
}

static tsr_nemotron_h_cache *new_cache(void) {
        tsr_nemotron_h_cache *c = NULL;
        assert_int_equal(tsr_nemotron_h_cache_new(model, N_SLOTS * SEQ_BLOCKS, BLOCK, N_SLOTS, &c), TSR_OK);
        return c;
}

/* Run tokens[past .. past+n) of a sequence in slot/table k. */
static void run(tsr_nemotron_h_cache *c, size_t k, const uint32_t *tokens, size_t n, size_t past,
                tsr_llama_logits which, float *logits) {
        uint32_t table[SEQ_BLOCKS];
        table_of(k, table);
        tsr_nemotron_h_seq q = {.block_table = table, .n_table = SEQ_BLOCKS, .tokens = tokens + past, .n = n,
                                .past_len = past, .slot = (uint32_t)k, .which = which};
        tsr_status st = tsr_nemotron_h_forward_batch(model, be, c, &q, 1, logits);
        if (st != TSR_OK)
                fail_msg("forward: %s", tsr_status_str(st));
}

static void test_config(void **state) {
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(model);

        (void)state;
        assert_string_equal(c->pattern, "ME*M-E");
        assert_int_equal(c->n_layers, 6);
        assert_int_equal(tsr_nemotron_h_count(c, 'M'), 2);
        assert_int_equal(tsr_nemotron_h_d_inner(c), 64);
        assert_int_equal(tsr_nemotron_h_conv_dim(c), 64 + 2 * 2 * 16);
        assert_int_equal(c->n_group, 2);
        assert_int_equal(c->topk_group, 1);
        assert_true(isinf(c->dt_max) && c->dt_min == 0.0f);   /* transformers 5's {"__float__": "Infinity"} */
        /* one slot: 2 Mamba layers x (3 conv rows x 128 + 8 x 8 x 16 state) floats */
        assert_int_equal(tsr_nemotron_h_slot_bytes(c), 2 * (3 * 128 + 8 * 8 * 16) * 4);
}

/* Every position of every prompt, each prompt a fresh sequence in its own slot. */
static void test_full_logits(void **state) {
        size_t n_rows, row = 0, n_prompts = json_array_size(json_object_get(golden, "prompts"));
        float *want = load_logits(&n_rows), worst = 0.0f;
        tsr_nemotron_h_cache *c = new_cache();
        uint32_t ids[128];

        (void)state;
        for (size_t p = 0; p < n_prompts; p++) {
                size_t n = tsr_test_prompt_ids(golden, p, ids, 128);
                float *got = malloc(n * vocab * sizeof(float));
                run(c, p, ids, n, 0, TSR_LLAMA_LOGITS_ALL, got);
                float w = compare_rows(got, want + row * vocab, n);
                worst = w > worst ? w : worst;
                row += n;
                free(got);
        }
        print_message("full sequences: max |dlogit| %.3g over %zu rows\n", (double)worst, row);
        assert_true(worst <= TOL);
        tsr_nemotron_h_cache_free(&c);
        free(want);
}

/* transformers' cache decode path: prefill all but `steps` tokens, then one at a time. */
static void test_decode_steps(void **state) {
        json_t *d = json_object_get(golden, "decode");
        size_t pi = (size_t)json_integer_value(json_object_get(d, "prompt"));
        size_t steps = (size_t)json_integer_value(json_object_get(d, "steps"));
        size_t n_rows, n_prompts = json_array_size(json_object_get(golden, "prompts")), before = 0;
        float *want = load_logits(&n_rows), worst = 0.0f, *got = malloc(vocab * sizeof(float));
        tsr_nemotron_h_cache *c = new_cache();
        uint32_t ids[128];

        (void)state;
        for (size_t p = 0; p < n_prompts; p++)
                before += tsr_test_prompt_ids(golden, p, ids, 128);
        assert_int_equal(n_rows, before + steps);
        size_t n = tsr_test_prompt_ids(golden, pi, ids, 128);
        /* slot 3 first holds another sequence: a new sequence must start from zero state */
        run(c, 3, ids, 5, 0, TSR_LLAMA_LOGITS_NONE, NULL);
        run(c, 3, ids, n - steps, 0, TSR_LLAMA_LOGITS_LAST, got);
        for (size_t t = n - steps; t < n; t++) {
                run(c, 3, ids, 1, t, TSR_LLAMA_LOGITS_LAST, got);
                float w = compare_rows(got, want + (before + t - (n - steps)) * vocab, 1);
                worst = w > worst ? w : worst;
        }
        print_message("decode steps: max |dlogit| %.3g over %zu steps\n", (double)worst, steps);
        assert_true(worst <= TOL);
        tsr_nemotron_h_cache_free(&c);
        free(got);
        free(want);
}

/* Prefill in chunks of 1, 2, 5, 3, 7, ... tokens (shorter and longer than the conv
 * window of 3 past rows, across KV blocks of 4): every row as the full sequence's. */
static void test_chunked_prefill(void **state) {
        static const size_t chunks[] = {1, 2, 5, 3, 7, 1, 1, 4, 9, 2, 6};
        size_t n_rows, n_prompts = json_array_size(json_object_get(golden, "prompts")), row = 0;
        float *want = load_logits(&n_rows), worst = 0.0f;
        tsr_nemotron_h_cache *c = new_cache();
        uint32_t ids[128];

        (void)state;
        for (size_t p = 0; p < n_prompts; p++) {
                size_t n = tsr_test_prompt_ids(golden, p, ids, 128), past = 0;
                float *got = malloc(n * vocab * sizeof(float));
                for (size_t i = 0; past < n; i++) {
                        size_t k = chunks[i % (sizeof chunks / sizeof chunks[0])];
                        k = k > n - past ? n - past : k;
                        run(c, p, ids, k, past, TSR_LLAMA_LOGITS_ALL, got + past * vocab);
                        past += k;
                }
                float w = compare_rows(got, want + row * vocab, n);
                worst = w > worst ? w : worst;
                row += n;
                free(got);
        }
        print_message("chunked prefill: max |dlogit| %.3g\n", (double)worst);
        assert_true(worst <= TOL);
        tsr_nemotron_h_cache_free(&c);
        free(want);
}

/* The greedy continuations: prefill the prompt, then decode on the carried state. */
static void test_greedy(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts"));
        tsr_nemotron_h_cache *c = new_cache();
        float *logits = malloc(vocab * sizeof(float));
        uint32_t ids[128];

        (void)state;
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *g = json_array_get(json_object_get(golden, "greedy"), p);
                size_t n = tsr_test_prompt_ids(golden, p, ids, 128), len = n;
                assert_true(n + json_array_size(g) <= SEQ_BLOCKS * BLOCK);
                run(c, p, ids, n, 0, TSR_LLAMA_LOGITS_LAST, logits);
                for (size_t i = 0; i < json_array_size(g); i++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(logits, vocab);
                        assert_int_equal(tok, json_integer_value(json_array_get(g, i)));
                        ids[len] = tok;
                        run(c, p, ids, 1, len++, TSR_LLAMA_LOGITS_LAST, logits);
                }
        }
        tsr_nemotron_h_cache_free(&c);
        free(logits);
}

/* One step of three sequences batched (a prefill chunk, a decode step, a fresh prompt)
 * gives bitwise each one's rows alone, on the reference and the fast CPU backends. */
static void test_batch_invariance(void **state) {
        tsr_backend *backends[2] = {be, NULL};
        uint32_t ids[3][128], tables[3][SEQ_BLOCKS];
        size_t n[3];

        (void)state;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2}, &backends[1]), TSR_OK);
        for (size_t k = 0; k < 3; k++) {
                n[k] = tsr_test_prompt_ids(golden, k, ids[k], 128);
                table_of(k, tables[k]);
        }
        for (size_t bi = 0; bi < 2; bi++) {
                tsr_backend *b = backends[bi];
                tsr_nemotron_h_cache *alone = new_cache(), *batched = new_cache();
                /* the history both caches share: seq 1 has 20 tokens, seq 2 has n-1 */
                tsr_nemotron_h_seq hist[2] = {
                        {tables[1], SEQ_BLOCKS, ids[1], 20, 0, 1, TSR_LLAMA_LOGITS_NONE},
                        {tables[2], SEQ_BLOCKS, ids[2], n[2] - 1, 0, 2, TSR_LLAMA_LOGITS_NONE},
                };
                for (size_t h = 0; h < 2; h++) {
                        assert_int_equal(tsr_nemotron_h_forward_batch(model, b, alone, &hist[h], 1, NULL), TSR_OK);
                        assert_int_equal(tsr_nemotron_h_forward_batch(model, b, batched, &hist[h], 1, NULL), TSR_OK);
                }
                tsr_nemotron_h_seq step[3] = {
                        {tables[0], SEQ_BLOCKS, ids[0], n[0], 0, 0, TSR_LLAMA_LOGITS_ALL},
                        {tables[1], SEQ_BLOCKS, ids[1] + 20, n[1] - 20, 20, 1, TSR_LLAMA_LOGITS_ALL},
                        {tables[2], SEQ_BLOCKS, ids[2] + n[2] - 1, 1, n[2] - 1, 2, TSR_LLAMA_LOGITS_LAST},
                };
                size_t rows = n[0] + (n[1] - 20) + 1;
                float *one = malloc(rows * vocab * sizeof(float)), *all = malloc(rows * vocab * sizeof(float));
                for (size_t k = 0, r = 0; k < 3; k++) {
                        assert_int_equal(tsr_nemotron_h_forward_batch(model, b, alone, &step[k], 1, one + r * vocab),
                                         TSR_OK);
                        r += step[k].which == TSR_LLAMA_LOGITS_ALL ? step[k].n : 1;
                }
                assert_int_equal(tsr_nemotron_h_forward_batch(model, b, batched, step, 3, all), TSR_OK);
                assert_memory_equal(one, all, rows * vocab * sizeof(float));
                free(one);
                free(all);
                tsr_nemotron_h_cache_free(&alone);
                tsr_nemotron_h_cache_free(&batched);
        }
        tsr_backend_free(&backends[1]);
}

/* Over the runner's pool (the family's kv_groups: attention blocks + Mamba state slots)
 * the forward gives bitwise what it gives over its own cache; a pool of other groups is
 * refused. */
static void test_pool_bind(void **state) {
        tsr_kv_group g[TSR_KV_GROUPS_MAX];
        size_t ng = tsr_nemotron_h_kv_groups(tsr_nemotron_h_config_of(model), g, TSR_KV_GROUPS_MAX);
        tsr_kv_pool *pool = NULL;
        tsr_nemotron_h_cache *bound = NULL, *own = new_cache();
        uint32_t ids[128], table[SEQ_BLOCKS];
        size_t n = tsr_test_prompt_ids(golden, 2, ids, 128);
        float *a = malloc(n * vocab * sizeof(float)), *b = malloc(n * vocab * sizeof(float));

        (void)state;
        assert_int_equal(ng, 2);
        assert_int_equal(g[0].kind, TSR_KV_FULL_ATTENTION);
        assert_int_equal(g[1].kind, TSR_KV_MAMBA_STATE);
        assert_int_equal(tsr_kv_slot_bytes(g, ng), tsr_nemotron_h_slot_bytes(tsr_nemotron_h_config_of(model)));
        assert_int_equal(tsr_kv_pool_new_slots(g, 1, SEQ_BLOCKS, BLOCK, 2, &pool), TSR_OK);
        assert_int_equal(tsr_nemotron_h_cache_bind(model, pool, &bound), TSR_E_INVAL);  /* no state group */
        tsr_kv_pool_free(&pool);
        assert_int_equal(tsr_kv_pool_new_slots(g, ng, SEQ_BLOCKS, BLOCK, 2, &pool), TSR_OK);
        assert_int_equal(tsr_nemotron_h_cache_bind(model, pool, &bound), TSR_OK);
        table_of(0, table);
        tsr_nemotron_h_seq q = {table, SEQ_BLOCKS, ids, n - 3, 0, 1, TSR_LLAMA_LOGITS_ALL};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, bound, &q, 1, a), TSR_OK);
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, own, &q, 1, b), TSR_OK);
        q = (tsr_nemotron_h_seq){table, SEQ_BLOCKS, ids + n - 3, 3, n - 3, 1, TSR_LLAMA_LOGITS_ALL};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, bound, &q, 1, a + (n - 3) * vocab), TSR_OK);
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, own, &q, 1, b + (n - 3) * vocab), TSR_OK);
        assert_memory_equal(a, b, n * vocab * sizeof(float));
        q.slot = 2;             /* the pool has two slots */
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, bound, &q, 1, a), TSR_E_INVAL);
        tsr_nemotron_h_cache_free(&bound);
        tsr_nemotron_h_cache_free(&own);
        tsr_kv_pool_free(&pool);
        free(a);
        free(b);
}

static void test_bad_args(void **state) {
        tsr_nemotron_h_cache *c = new_cache();
        uint32_t table[SEQ_BLOCKS], tok[2] = {5, 7}, bad_tok = 300;
        float logits[2 * 300];

        (void)state;
        table_of(0, table);
        tsr_nemotron_h_seq q = {table, SEQ_BLOCKS, tok, 2, 0, 0, TSR_LLAMA_LOGITS_LAST};
        tsr_nemotron_h_seq two[2] = {q, q};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, two, 2, logits), TSR_E_INVAL); /* one slot twice */
        tsr_nemotron_h_seq x = q;
        x.slot = N_SLOTS;
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, logits), TSR_E_INVAL);
        x = q;
        x.tokens = &bad_tok;
        x.n = 1;
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, logits), TSR_E_INVAL);
        x = q;
        x.n_table = 0;
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, logits), TSR_E_INVAL);
        x = q;
        table[0] = N_SLOTS * SEQ_BLOCKS;        /* outside the cache */
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, logits), TSR_E_INVAL);
        table[0] = 0;
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &x, 1, logits), TSR_OK);
        tsr_nemotron_h_cache_free(&c);
}

/* Python's json writes float('inf') as a bare Infinity (not JSON): read as infinity
 * where a field may be infinite, left alone inside strings. */
static void test_config_bare_infinity(void **state) {
        char src[1024], dir[] = "/tmp/tsr_nh_XXXXXX", path[1100], err[512] = "", *text, *at;
        tsr_nemotron_h_config c;
        json_error_t je;
        json_t *cfg;
        FILE *f;

        (void)state;
        assert_non_null(tsr_test_src_path(FIXTURE "/model/config.json", src, sizeof src));
        assert_non_null(mkdtemp(dir));
        snprintf(path, sizeof path, "%s/config.json", dir);
        cfg = json_load_file(src, 0, &je);
        assert_non_null(cfg);
        json_object_set_new(cfg, "time_step_limit", json_pack("[f, f]", 0.0, 12345.5));
        json_object_set_new(cfg, "note", json_string("Infinity in a string"));
        text = json_dumps(cfg, JSON_COMPACT);
        assert_non_null(at = strstr(text, "12345.5"));
        f = fopen(path, "w");
        fprintf(f, "%.*sInfinity%s", (int)(at - text), text, at + 7);
        fclose(f);
        assert_int_equal(tsr_nemotron_h_config_from_hf(dir, &c, err, sizeof err), TSR_OK);
        assert_true(isinf(c.dt_max));
        f = fopen(path, "w");           /* a negative one is still an error, named */
        fprintf(f, "%.*s-Infinity%s", (int)(at - text), text, at + 7);
        fclose(f);
        assert_int_equal(tsr_nemotron_h_config_from_hf(dir, &c, err, sizeof err), TSR_E_INVAL);
        assert_non_null(strstr(err, "config.json"));
        free(text);
        json_decref(cfg);
        unlink(path);
        rmdir(dir);
}

/* The family table: HF names only (no GGUF), "%u" exactly in the per-layer ones,
 * unique logical names, shard rules as vLLM splits the layers (row-parallel outputs,
 * whole experts); the family's description, KV groups and GGUF refusal. */
static void test_family(void **state) {
        const tsr_model_family *f = &tsr_family_nemotron_h;
        char path[1024], err[512] = "";
        tsr_model_desc d;
        tsr_shard_spec sh;
        tsr_kv_group g[TSR_KV_GROUPS_MAX];

        (void)state;
        assert_int_equal(f->n_tensors, TSR_NEMOTRON_H_N_TENSORS);
        for (size_t i = 0; i < f->n_tensors; i++) {
                const tsr_tensor_name *t = &f->tensors[i];
                assert_null(t->gguf);
                assert_non_null(t->hf);
                assert_int_equal(strstr(t->hf, "%u") != NULL, t->per_layer);
                for (size_t j = 0; j < i; j++)
                        assert_string_not_equal(f->tensors[j].logical, t->logical);
                if (strstr(t->hf, "out_proj") || strstr(t->hf, "o_proj") || strstr(t->hf, "down_proj.weight"))
                        assert_int_equal(t->shard, strstr(t->hf, "experts.<e>") ? TSR_SHARD_EXPERT : TSR_SHARD_ROW);
                if (strstr(t->hf, "experts.<e>"))
                        assert_int_equal(t->shard, TSR_SHARD_EXPERT);
        }
        assert_non_null(tsr_test_src_path(FIXTURE "/model", path, sizeof path));
        assert_int_equal(tsr_model_desc_read(f, path, false, &d, err, sizeof err), TSR_OK);
        assert_int_equal(d.n_layers, 6);
        assert_int_equal(d.vocab_size, 300);
        assert_int_equal(f->shard_for(&d, 0, 1, 0, 1, &sh), TSR_OK);
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 2);
        assert_int_equal(g[1].kind, TSR_KV_MAMBA_STATE);
        assert_int_equal(f->shard_for(&d, 0, 1, 1, 2, &sh), TSR_OK);        /* a pipeline stage: not built */
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 0);
        tsr_model_desc_done(&d);
        assert_int_equal(tsr_model_desc_read(f, "/x/model.gguf", true, &d, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "NemotronH from GGUF is not supported"));
}

/* config.json variants in a temporary folder: each refused with the field named. */
static void test_config_errors(void **state) {
        static const struct { const char *set; tsr_status st; const char *needle; } bad[] = {
                {"\"hybrid_override_pattern\": \"MEX\"", TSR_E_INVAL, "hybrid_override_pattern"},
                {"\"hybrid_override_pattern\": null", TSR_E_INVAL, "layers_block_type"},
                {"\"num_hidden_layers\": 7", TSR_E_INVAL, "num_hidden_layers 7"},
                {"\"attention_bias\": true", TSR_E_UNSUPPORTED, "attention_bias"},
                {"\"mamba_hidden_act\": \"gelu\"", TSR_E_UNSUPPORTED, "mamba_hidden_act"},
                {"\"mlp_hidden_act\": \"silu\"", TSR_E_UNSUPPORTED, "mlp_hidden_act"},
                {"\"moe_latent_size\": 16", TSR_E_UNSUPPORTED, "moe_latent_size"},
                {"\"n_group\": 3", TSR_E_INVAL, "n_group"},
                {"\"n_groups\": 3", TSR_E_INVAL, "n_groups"},
                {"\"time_step_limit\": [0.5, 0.1]", TSR_E_INVAL, "time_step_limit"},
                {"\"hidden_size\": \"64\"", TSR_E_INVAL, "hidden_size"},
                {"\"hybrid_override_pattern\": null, \"layers_block_type\": [\"mamba\", \"moe\", \"attention\", "
                 "\"linear_attention\", \"mlp\", \"moe\"]", TSR_OK, NULL},
        };
        char src[1024], dir[] = "/tmp/tsr_nh_XXXXXX", path[1100], err[512];
        json_error_t je;

        (void)state;
        assert_non_null(tsr_test_src_path(FIXTURE "/model/config.json", src, sizeof src));
        assert_non_null(mkdtemp(dir));
        snprintf(path, sizeof path, "%s/config.json", dir);
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                json_t *cfg = json_load_file(src, 0, &je), *patch;
                char text[512];
                tsr_nemotron_h_config c;
                snprintf(text, sizeof text, "{%s}", bad[i].set);
                patch = json_loads(text, 0, &je);
                assert_non_null(patch);
                assert_int_equal(json_object_update(cfg, patch), 0);
                assert_int_equal(json_dump_file(cfg, path, 0), 0);
                err[0] = 0;
                tsr_status st = tsr_nemotron_h_config_from_hf(dir, &c, err, sizeof err);
                if (st != bad[i].st)
                        fail_msg("case %zu: status %d, err '%s'", i, (int)st, err);
                if (bad[i].needle && !strstr(err, bad[i].needle))
                        fail_msg("case %zu: '%s' lacks '%s'", i, err, bad[i].needle);
                if (st == TSR_OK)
                        assert_string_equal(c.pattern, "ME*M-E");
                json_decref(cfg);
                json_decref(patch);
        }
        unlink(path);
        rmdir(dir);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_config),
                cmocka_unit_test(test_full_logits),
                cmocka_unit_test(test_decode_steps),
                cmocka_unit_test(test_chunked_prefill),
                cmocka_unit_test(test_greedy),
                cmocka_unit_test(test_batch_invariance),
                cmocka_unit_test(test_pool_bind),
                cmocka_unit_test(test_bad_args),
                cmocka_unit_test(test_config_errors),
                cmocka_unit_test(test_config_bare_infinity),
                cmocka_unit_test(test_family),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
