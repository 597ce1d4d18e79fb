/* test_family.c - the model-family registry (worker/model/family.h): which metadata finds
 * the Llama and Llama 4 families, the KV bytes per block summed over groups, the PP layer ranges, the
 * config read once through the family, and the tensor-name table's shape. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/model/device_arrays.h"
#include "worker/model/family.h"
#include "worker/model/llama_weights.h"
#include "worker/model/runner.h"

static void test_find(void **state) {
        (void)state;
        assert_ptr_equal(tsr_family_find("gguf", "llama", "llama"), &tsr_family_llama);
        assert_ptr_equal(tsr_family_find("hf", "LlamaForCausalLM", "llama"), &tsr_family_llama);
        assert_ptr_equal(tsr_family_find("hf", NULL, "llama"), &tsr_family_llama);       /* no architectures list */
        /* Llama 4 text has its own family (tests/unit/test_llama4.c checks it in depth) */
        assert_ptr_equal(tsr_family_find("hf", "Llama4ForConditionalGeneration", "llama4"), &tsr_family_llama4);
        assert_ptr_equal(tsr_family_find("hf", "Llama4ForCausalLM", "llama4_text"), &tsr_family_llama4);
        assert_ptr_equal(tsr_family_find("gguf", "llama4", NULL), &tsr_family_llama4);  /* found, then refused */
        /* architectures wins over model_type */
        assert_ptr_equal(tsr_family_find("hf", "NemotronHForCausalLM", "llama"), &tsr_family_nemotron_h);
        assert_ptr_equal(tsr_family_find("hf", NULL, "nemotron_h"), &tsr_family_nemotron_h);
        /* llama.cpp's names: found, so that the family refuses the GGUF with its reason */
        assert_ptr_equal(tsr_family_find("gguf", "nemotron_h_moe", NULL), &tsr_family_nemotron_h);
        assert_ptr_equal(tsr_family_find("hf", "LlamaForCausalLM", "nemotron_h"), &tsr_family_llama);
        assert_null(tsr_family_find("gguf", "qwen2", "qwen2"));
        assert_null(tsr_family_find("hf", NULL, NULL));
}

static void test_kv_block_bytes(void **state) {
        (void)state;
        /* SmolLM2-135M: 30 layers, 3 kv heads of 64, float32, block 16: 737280 bytes
         * (the number test_worker_startup.py's error message carries). */
        tsr_kv_group g[2] = {
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 30, .n_kv_heads = 3, .head_dim = 64,
                 .dtype = TSR_DTYPE_F32},
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 2, .n_kv_heads = 1, .head_dim = 8,
                 .dtype = TSR_DTYPE_BF16},
        };
        assert_int_equal(tsr_kv_block_bytes(g, 1, 16), 737280);
        assert_int_equal(tsr_kv_block_bytes(g, 2, 16), 737280 + 2 * 2 * 1 * 8 * 16 * 2);
        assert_int_equal(tsr_kv_block_bytes(g, 0, 16), 0);
}

static void test_shard_for(void **state) {
        tsr_llama_config c = {.n_layers = 10, .n_kv_heads = 4, .head_dim = 16};
        tsr_model_desc d = {.family = &tsr_family_llama, .n_layers = 10, .config = &c};
        tsr_shard_spec s;
        tsr_kv_group g[TSR_KV_GROUPS_MAX];
        uint32_t next = 0;
        (void)state;

        for (uint32_t r = 0; r < 3; r++) {      /* 10 layers over 3 stages: 3, 4, 3 (vLLM's split) */
                assert_int_equal(tsr_family_llama.shard_for(&d, 0, 1, r, 3, &s), TSR_OK);
                assert_int_equal(s.first_layer, next);
                assert_int_equal(s.last_layer - s.first_layer + 1, r == 1 ? 4 : 3);
                next = s.last_layer + 1;
        }
        assert_int_equal(next, 10);
        assert_int_equal(tsr_family_llama.shard_for(&d, 0, 1, 0, 11, &s), TSR_E_INVAL);
        assert_int_equal(tsr_family_llama.shard_for(&d, 2, 2, 0, 1, &s), TSR_E_INVAL);
        assert_int_equal(tsr_family_llama.shard_for(&d, 0, 1, 0, 1, &s), TSR_OK);
        assert_int_equal(tsr_family_llama.kv_groups(&d, &s, g, TSR_KV_GROUPS_MAX), 1);
        assert_int_equal(g[0].kind, TSR_KV_FULL_ATTENTION);
        assert_int_equal(g[0].n_layers, 10);
        assert_int_equal(g[0].n_kv_heads, 4);
        assert_int_equal(g[0].head_dim, 16);
}

/* Every weight has a logical name and a GGUF name; only rope_freqs (llama.cpp's own
 * precomputed table) has no HF name; the logical names are unique. */
static void test_tensor_table(void **state) {
        const tsr_model_family *f = &tsr_family_llama;
        (void)state;
        assert_true(f->n_tensors > 0);
        for (size_t i = 0; i < f->n_tensors; i++) {
                const tsr_tensor_name *t = &f->tensors[i];
                assert_non_null(t->logical);
                assert_non_null(t->gguf);
                assert_true(t->hf != NULL || strcmp(t->logical, "rope_freqs") == 0);
                assert_int_equal(strstr(t->gguf, "%u") != NULL, t->per_layer);
                for (size_t j = 0; j < i; j++)
                        assert_string_not_equal(f->tensors[j].logical, t->logical);
        }
}

static void test_read_config_errors(void **state) {
        tsr_model_desc d;
        char err[512] = "";
        (void)state;
        memset(&d, 0x5a, sizeof d);
        assert_int_equal(tsr_model_desc_read(&tsr_family_llama, "/nonexistent-dir", false, &d, err, sizeof err),
                         TSR_E_NOTFOUND);
        assert_non_null(strstr(err, "/nonexistent-dir"));
        assert_int_equal(((unsigned char *)&d)[0], 0x5a);   /* untouched on failure */
        assert_int_equal(tsr_model_desc_read(NULL, "/x", false, &d, err, sizeof err), TSR_E_INVAL);
}

/* The runner's KV memory: per group, per layer, K and V of n_blocks x block_size rows in
 * the group's dtype, exactly the bytes tsr_kv_block_bytes budgets for. */
/* A Mamba hybrid's groups: attention blocks plus one state record per request slot,
 * which the per-block budget does not count and the per-slot one does. */
static void test_kv_pool_state_slots(void **state) {
        tsr_kv_group g[2] = {
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 1, .n_kv_heads = 2, .head_dim = 16, .dtype = TSR_DTYPE_F32},
                {.kind = TSR_KV_MAMBA_STATE, .n_layers = 2, .dtype = TSR_DTYPE_F32, .conv_elems = 384,
                 .ssm_elems = 1024},
        };
        tsr_kv_pool *p = NULL;
        (void)state;
        assert_int_equal(tsr_kv_block_bytes(g, 2, 16), tsr_kv_block_bytes(g, 1, 16));
        assert_int_equal(tsr_kv_block_bytes(g, 1, 16), 2 * 2 * 16 * 16 * 4);
        assert_int_equal(tsr_kv_slot_bytes(g, 2), 2 * (384 + 1024) * 4);
        assert_int_equal(tsr_kv_slot_bytes(g, 1), 0);
        assert_int_equal(tsr_kv_pool_new(g, 2, 5, 16, &p), TSR_E_INVAL);     /* a state group needs slots */
        assert_int_equal(tsr_kv_pool_new_slots(g, 2, 5, 16, 3, &p), TSR_OK);
        assert_int_equal(p->n_slots, 3);
        assert_int_equal(p->bytes, 5 * tsr_kv_block_bytes(g, 2, 16) + 3 * tsr_kv_slot_bytes(g, 2));
        for (uint32_t l = 0; l < 2; l++) {      /* conv (k) and SSM (v) state of every slot */
                memset(p->groups[1].k[l], 0xab, 3 * 384 * 4);
                memset(p->groups[1].v[l], 0xcd, 3 * 1024 * 4);
        }
        tsr_kv_pool_free(&p);
        assert_int_equal(tsr_kv_pool_new_slots(g, 1, 5, 16, 3, &p), TSR_OK);  /* no state group: no slots */
        assert_int_equal(p->n_slots, 0);
        tsr_kv_pool_free(&p);
}

static void test_kv_pool(void **state) {
        tsr_kv_group g[2] = {
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 3, .n_kv_heads = 2, .head_dim = 8, .dtype = TSR_DTYPE_F32},
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 1, .n_kv_heads = 1, .head_dim = 4, .dtype = TSR_DTYPE_BF16},
        };
        tsr_kv_pool *p = NULL;
        (void)state;
        assert_int_equal(tsr_kv_pool_new(g, 2, 5, 16, &p), TSR_OK);
        assert_int_equal(p->n_groups, 2);
        assert_int_equal(p->n_blocks, 5);
        assert_int_equal(p->block_size, 16);
        assert_int_equal(p->bytes, 5 * tsr_kv_block_bytes(g, 2, 16));
        for (size_t i = 0; i < 2; i++) {
                size_t layer_bytes = 5 * 16 * g[i].n_kv_heads * g[i].head_dim * (i ? 2 : 4);
                assert_memory_equal(&p->groups[i].spec, &g[i], sizeof g[i]);
                for (uint32_t l = 0; l < g[i].n_layers; l++) {
                        /* every byte is there (ASan would catch one past the end) */
                        memset(p->groups[i].k[l], 0xab, layer_bytes);
                        memset(p->groups[i].v[l], 0xcd, layer_bytes);
                        assert_ptr_not_equal(p->groups[i].k[l], p->groups[i].v[l]);
                }
        }
        tsr_kv_pool_free(&p);
        assert_null(p);
        tsr_kv_pool_free(&p);

        /* no groups: an empty pool (a pipeline stage of MoE and MLP layers only) */
        assert_int_equal(tsr_kv_pool_new(g, 0, 5, 16, &p), TSR_OK);
        assert_int_equal(p->n_groups, 0);
        assert_int_equal(p->bytes, 0);
        tsr_kv_pool_free(&p);
        assert_null(p);
        assert_int_equal(tsr_kv_pool_new(NULL, 1, 5, 16, &p), TSR_E_INVAL);
        assert_int_equal(tsr_kv_pool_new(g, 1, 0, 16, &p), TSR_E_INVAL);
        assert_int_equal(tsr_kv_pool_new(g, 1, 5, 0, &p), TSR_E_INVAL);
        assert_int_equal(tsr_kv_pool_new(g, TSR_KV_GROUPS_MAX + 1, 5, 16, &p), TSR_E_INVAL);
        g[1].dtype = TSR_DTYPE_Q4_K;    /* not a dtype a cache holds */
        assert_int_equal(tsr_kv_pool_new(g, 2, 5, 16, &p), TSR_E_INVAL);
        g[1].dtype = TSR_DTYPE_BF16;
        g[1].n_layers = 0;
        assert_int_equal(tsr_kv_pool_new(g, 2, 5, 16, &p), TSR_E_INVAL);
        assert_int_equal(tsr_kv_pool_new(g, 1, UINT64_MAX / 2, 16, &p), TSR_E_LIMIT);
        assert_null(p);
}

/* --kv-cache-dtype fp8: the flag's names, one byte per element in the sizing and the
 * pool (4x the blocks of float32 in the same bytes), the pool's per-layer scales, and
 * where the worker accepts it (tsr_runner_kv_dtype_check's messages). */
static void test_kv_fp8(void **state) {
        tsr_dtype t = TSR_DTYPE_Q4_K;
        char err[320];
        (void)state;
        assert_true(tsr_kv_cache_dtype_parse(NULL, &t) && t == TSR_DTYPE_F32);
        assert_true(tsr_kv_cache_dtype_parse("auto", &t) && t == TSR_DTYPE_F32);
        assert_true(tsr_kv_cache_dtype_parse("fp8", &t) && t == TSR_DTYPE_FP8_E4M3);
        t = TSR_DTYPE_F32;
        assert_true(tsr_kv_cache_dtype_parse("fp8_e4m3", &t) && t == TSR_DTYPE_FP8_E4M3);
        assert_true(tsr_kv_cache_dtype_parse("fp8_e5m2", &t) && t == TSR_DTYPE_FP8_E5M2);
        assert_true(tsr_kv_cache_dtype_parse("bfloat16", &t) && t == TSR_DTYPE_BF16);
        assert_false(tsr_kv_cache_dtype_parse("fp8_inc", &t));

        /* SmolLM2-135M's group (737280 bytes a block in float32) and a state group */
        tsr_kv_group g[2] = {
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 30, .n_kv_heads = 3, .head_dim = 64,
                 .dtype = TSR_DTYPE_F32},
                {.kind = TSR_KV_MAMBA_STATE, .n_layers = 2, .dtype = TSR_DTYPE_F32, .conv_elems = 8, .ssm_elems = 16},
        };
        uint64_t slot = tsr_kv_slot_bytes(g, 2);
        tsr_kv_groups_set_dtype(g, 2, TSR_DTYPE_FP8_E4M3);
        assert_int_equal(g[0].dtype, TSR_DTYPE_FP8_E4M3);
        assert_int_equal(g[1].dtype, TSR_DTYPE_F32);            /* a state stays as it is */
        assert_int_equal(tsr_kv_block_bytes(g, 2, 16), 737280 / 4);
        assert_int_equal(tsr_kv_slot_bytes(g, 2), slot);

        tsr_kv_pool *p = NULL;
        g[0].n_layers = 3;
        assert_int_equal(tsr_kv_pool_new(g, 1, 5, 16, &p), TSR_OK);
        assert_int_equal(p->bytes, 2ull * 3 * 5 * 16 * 3 * 64);
        for (uint32_t l = 0; l < 3; l++) {
                assert_true(p->groups[0].k_scale[l] == 1.0f && p->groups[0].v_scale[l] == 1.0f);
                memset(p->groups[0].k[l], 0x38, 5 * 16 * 3 * 64);      /* every byte is there */
                memset(p->groups[0].v[l], 0x38, 5 * 16 * 3 * 64);
        }
        tsr_kv_pool_free(&p);

        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_llama, TSR_DTYPE_F32, "auto", err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_llama, TSR_DTYPE_FP8_E4M3, "fp8", err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_llama4, TSR_DTYPE_FP8_E4M3, "fp8", err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_nemotron_h, TSR_DTYPE_FP8_E4M3, "fp8_e4m3", err,
                                                   sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(NULL, TSR_DTYPE_FP8_E4M3, NULL, err, sizeof err),
                         TSR_E_UNSUPPORTED);
        assert_string_equal(err, "argument --kv-cache-dtype: 'fp8_e4m3' is not supported for this model yet: the "
                                 "bfloat16 and fp8 KV caches are implemented for the llama, llama4 and nemotron_h "
                                 "families (supported there: auto)");
        /* bfloat16: every family (no scales to read) */
        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_llama4, TSR_DTYPE_BF16, "bfloat16", err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(&tsr_family_nemotron_h, TSR_DTYPE_BF16, "bfloat16", err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_runner_kv_dtype_check(NULL, TSR_DTYPE_BF16, "bfloat16", err, sizeof err),
                         TSR_E_UNSUPPORTED);
        tsr_kv_groups_set_dtype(g, 2, TSR_DTYPE_BF16);          /* two bytes an element */
        g[0].n_layers = 30;
        assert_int_equal(tsr_kv_block_bytes(g, 2, 16), 737280 / 2);
}

/* --kv-cache-dtype auto is the weights' dtype, as vLLM's: on a device (cpu-devlike stands
 * for CUDA: memory not the host's) bfloat16 unless --dtype float32; on the reference CPU
 * backend float32 unless --dtype bfloat16. */
static void test_auto_kv_dtype(void **state) {
        (void)state;
        tsr_backend *dev = NULL, *ref = NULL;
        assert_int_equal(tsr_backend_cpu_devlike_new(&dev), TSR_OK);
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        assert_int_equal(tsr_runner_auto_kv_dtype(dev, NULL), TSR_DTYPE_BF16);
        assert_int_equal(tsr_runner_auto_kv_dtype(dev, "auto"), TSR_DTYPE_BF16);
        assert_int_equal(tsr_runner_auto_kv_dtype(dev, "bfloat16"), TSR_DTYPE_BF16);
        assert_int_equal(tsr_runner_auto_kv_dtype(dev, "float32"), TSR_DTYPE_F32);
        assert_int_equal(tsr_runner_auto_kv_dtype(ref, "auto"), TSR_DTYPE_F32);
        assert_int_equal(tsr_runner_auto_kv_dtype(ref, "bfloat16"), TSR_DTYPE_BF16);
        assert_int_equal(tsr_runner_auto_kv_dtype(NULL, "auto"), TSR_DTYPE_F32);
        tsr_backend_free(&dev);
        tsr_backend_free(&ref);
}

/* The description of a real checkpoint: the worker-wide fields from its config.json, the
 * family's own config behind `config`, freed by tsr_model_desc_done. */
static void test_read_config(void **state) {
        const char *root = getenv("TSR_SOURCE_ROOT");
        char path[4096], err[512] = "";
        tsr_model_desc d = {0};
        const tsr_llama_config *c;
        (void)state;
        assert_non_null(root);
        snprintf(path, sizeof path, "%s/tests/fixtures/tiny-llama3-hf/f32", root);
        assert_int_equal(tsr_model_desc_read(&tsr_family_llama, path, false, &d, err, sizeof err), TSR_OK);
        assert_ptr_equal(d.family, &tsr_family_llama);
        assert_false(d.gguf);
        assert_int_equal(d.vocab_size, 300);
        assert_int_equal(d.n_layers, 2);
        c = d.config;
        assert_non_null(c);
        assert_int_equal(c->vocab_size, d.vocab_size);
        assert_int_equal(c->n_layers, d.n_layers);
        assert_int_equal(c->n_kv_heads, 2);
        assert_int_equal(c->head_dim, 16);
        tsr_model_desc_done(&d);
        assert_null(d.config);
        tsr_model_desc_done(&d);        /* twice is harmless */
}

/* A weight upload's log lines (device_arrays.h): one at each tenth of a large upload but
 * the last (the closing line's), none for a small one, and the closing line with the
 * bytes and arrays; the tenths themselves at their edges. */
static void test_upload_progress(void **state) {
        (void)state;
        const size_t big = TSR_DEV_PROGRESS_MIN;
        assert_int_equal(tsr_dev_progress_tenths(big - 1, big - 1), 0);      /* small: never a tenth */
        assert_int_equal(tsr_dev_progress_tenths(0, big), 0);
        assert_int_equal(tsr_dev_progress_tenths(big / 10 - 1, big), 0);
        assert_int_equal(tsr_dev_progress_tenths(big / 10 + 1, big), 1);
        assert_int_equal(tsr_dev_progress_tenths(big - 1, big), 9);
        assert_int_equal(tsr_dev_progress_tenths(big, big), 10);
        assert_int_equal(tsr_dev_progress_tenths(2 * big, big), 10);

        tsr_backend *be = NULL;
        assert_int_equal(tsr_backend_cpu_devlike_new(&be), TSR_OK);
        char path[] = "/tmp/tsr-test-progress-XXXXXX";
        int fd = mkstemp(path), saved = dup(2);
        assert_true(fd >= 0 && saved >= 0);
        fflush(stderr);
        dup2(fd, 2);
        tsr_dev_progress p, q;
        tsr_dev_progress_start(&p, be, 4 * big);
        for (int i = 0; i < 16; i++)            /* sixteenths: tenths 1..9 crossed, then the end */
                tsr_dev_progress_add(&p, big / 4);
        tsr_dev_progress_done(&p, 16);
        tsr_dev_progress_start(&q, be, 1000);
        tsr_dev_progress_add(&q, 600);
        tsr_dev_progress_add(&q, 400);
        tsr_dev_progress_done(&q, 2);
        fflush(stderr);
        dup2(saved, 2);
        close(saved);
        char log[8192] = {0};
        assert_true(pread(fd, log, sizeof log - 1, 0) > 0);
        close(fd);
        unlink(path);
        size_t lines = 0;
        for (const char *at = log; (at = strstr(at, "copying weights to the cpu-devlike device: ")); at++)
                lines++;
        assert_int_equal(lines, 9);
        assert_non_null(strstr(log, "/4295.0 MB (10%)"));
        assert_non_null(strstr(log, "/4295.0 MB (90%)"));
        assert_null(strstr(log, "(100%)"));
        assert_non_null(strstr(log, "weights on the cpu-devlike device: 4295.0 MB in 16 arrays, "));
        assert_non_null(strstr(log, "weights on the cpu-devlike device: 0.0 MB in 2 arrays, "));
        tsr_backend_free(&be);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_find),
                cmocka_unit_test(test_kv_block_bytes),
                cmocka_unit_test(test_auto_kv_dtype),
                cmocka_unit_test(test_shard_for),
                cmocka_unit_test(test_tensor_table),
                cmocka_unit_test(test_read_config_errors),
                cmocka_unit_test(test_read_config),
                cmocka_unit_test(test_kv_pool),
                cmocka_unit_test(test_kv_pool_state_slots),
                cmocka_unit_test(test_kv_fp8),
                cmocka_unit_test(test_upload_progress),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
