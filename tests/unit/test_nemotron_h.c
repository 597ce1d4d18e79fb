/* test_nemotron_h.c - the NemotronH family (worker/model/nemotron_h.h) against
 * transformers on tests/fixtures/tiny-nemotron-h (tests/fixtures/make_tiny_nemotron_h.py):
 * a tiny random NemotronHForCausalLM with the pattern "ME*M-E" (every block type),
 * n_groups 2, grouped routing with a correction bias that changes the choices.
 *
 *  - every position's logits within 1e-4 of transformers' fp32 ones, full sequence;
 *  - the decode path (state carried across one-token steps) against transformers' cache
 *    decode, and prefill cut into chunks that cross the conv window and the KV blocks;
 *  - the Mamba scan's chunked form (whole chunk_size chunks of a prefill) against the
 *    recurrence, and bitwise across prefill pieces at chunk multiples;
 *  - the greedy 32-token continuations token for token (prefill, then decode steps);
 *  - batch invariance: a sequence alone and batched with others, bitwise; the same bits
 *    on fast backends of 1, 2 and 3 threads (the Mamba mixer runs as host tasks);
 *  - config and argument errors;
 *  - bfloat16 (issue #14): a BF16 copy of the fixture, written at setup into a temporary
 *    folder as a bf16 checkpoint ships (every tensor rounded to bf16 but the router's
 *    gate.weight and e_score_correction_bias, which transformers keeps in float32),
 *    loaded and run with bf16 linears: against transformers' fp32 logits every position
 *    with cosine >= 0.999 and top-1 agreeing at >= 99% of positions (full sequences,
 *    decode steps, chunked prefill), batch invariance bitwise, the fast backend against
 *    the reference, resident bytes; the same folder upcast (--dtype float32);
 *  - ModelOpt FP8 (issue #15): tests/fixtures/tiny-nemotron-h-fp8 against a torch
 *    emulation of vLLM's W8A8 math (the section's comment has the bound), greedy, chunked,
 *    decoded and batched bitwise, resident bytes, bad checkpoints named; and
 *    tests/fixtures/tiny-nemotron-h-nvfp4 (the same recipe in NVFP4) against the W4A4
 *    emulation: resident bytes, logits, greedy, batch invariance, the fast backend. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/quant/quant.h"
#include "tests/tsr_test.h"
#include "tests/unit/test_util.h"
#include "worker/model/family.h"
#include "worker/model/nemotron_h.h"
#include "worker/model/tp.h"

#define FIXTURE "tests/fixtures/tiny-nemotron-h"
#define GGUF_FIXTURE "tests/fixtures/tiny-nemotron-h-gguf"
#define TOL 1e-4f
#define BLOCK 4         /* small blocks: every prompt spans several */
#define SEQ_BLOCKS 32   /* 128 positions per sequence */
#define N_SLOTS 4

static json_t *golden;
static tsr_nemotron_h *model;
static tsr_nemotron_h *model16;         /* the BF16 copy, bf16 linears */
static tsr_load_stats stats32, stats16; /* the float32 fixture's load; the BF16 copy's */
static char bf16_dir[] = "/tmp/tsr_nh_bf16_XXXXXX";
static char rounded_dir[] = "/tmp/tsr_nh_rnd_XXXXXX";  /* COPY_ROUNDED */
static tsr_backend *be;
static uint32_t vocab;

/* Kept float32 in a bf16 checkpoint (transformers' _keep_in_fp32_modules_strict). */
static bool keeps_f32(const char *name) {
        size_t n = strlen(name);
        static const char *const tails[] = {"mixer.gate.weight", "e_score_correction_bias"};
        for (size_t i = 0; i < sizeof tails / sizeof tails[0]; i++)
                if (n >= strlen(tails[i]) && strcmp(name + n - strlen(tails[i]), tails[i]) == 0)
                        return true;
        return false;
}

/* The linears (tsr_nemotron_h_use_bf16's): every "*proj.weight" and lm_head. */
static bool is_linear(const char *name) {
        return strstr(name, "proj.weight") || strcmp(name, "lm_head.weight") == 0;
}

/* The copies of the float32 fixture the tests write (keeps_f32 tensors always F32):
 *  COPY_BF16     every other tensor rounded to BF16 (nearest even): a bf16 checkpoint;
 *  COPY_ROUNDED  stored F32, the linears as they are, the rest bf16-valued: a float32
 *                checkpoint that --dtype bfloat16 turns into exactly COPY_BF16's weights;
 *  COPY_F16      every other tensor as F16: a float16 checkpoint. */
enum copy_kind { COPY_BF16, COPY_ROUNDED, COPY_F16 };

/* float -> IEEE half, round to nearest even (by hand: clang has no _Float16 on every
 * x86-64 target, and the fuzz build compiles the unit tests with clang). */
static uint16_t f32_to_f16(float x) {
        uint32_t u, sign, mant, h, rem, half;
        int32_t exp;
        memcpy(&u, &x, 4);
        sign = (u >> 16) & 0x8000u;
        mant = u & 0x7fffffu;
        if (((u >> 23) & 0xffu) == 0xffu)
                return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0));
        exp = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
        if (exp >= 31)
                return (uint16_t)(sign | 0x7c00u);
        if (exp <= 0) {                 /* a half subnormal (or zero): units of 2^-24 */
                uint32_t shift = (uint32_t)(14 - exp);
                if (exp < -10)
                        return (uint16_t)sign;
                mant |= 0x800000u;
                h = mant >> shift;
                rem = mant & ((1u << shift) - 1);
                half = 1u << (shift - 1);
        } else {
                h = ((uint32_t)exp << 10) | (mant >> 13);
                rem = mant & 0x1fffu;
                half = 0x1000u;
        }
        if (rem > half || (rem == half && (h & 1)))
                h++;                    /* a carry into the exponent is still right */
        return (uint16_t)(sign | h);
}

/* One element of tensor `name` in the copy `kind` into out; returns its bytes. */
static size_t copy_elem(enum copy_kind kind, const char *name, float x, void *out) {
        if (keeps_f32(name) || (kind == COPY_ROUNDED && is_linear(name))) {
                memcpy(out, &x, 4);
                return 4;
        }
        if (kind == COPY_F16) {
                uint16_t h = f32_to_f16(x);     /* the fixture's values are in range */
                memcpy(out, &h, 2);
                return 2;
        }
        uint16_t b = tsr_f32_to_bf16(x);
        if (kind == COPY_BF16) {
                memcpy(out, &b, 2);
                return 2;
        }
        x = tsr_bf16_to_f32(b);
        memcpy(out, &x, 4);
        return 4;
}

/* dir/model.safetensors: the copy `kind` of src's, in the header order, and config.json
 * with the copy's torch_dtype.  0 on success. */
static int write_copy(const char *src, const char *dir, enum copy_kind kind) {
        static const char *const dtype_of[] = {"BF16", "F32", "F16"}, *const torch_of[] = {"bfloat16", "float32",
                                                                                               "float16"};
        char path[1200], err[256], one[4];
        tsr_safetensors *st = NULL;
        json_t *hdr = json_object(), *cfg = NULL;
        json_error_t je;
        uint64_t off = 0;
        char *text;
        FILE *f;
        int rc = -1;

        snprintf(path, sizeof path, "%s/config.json", src);
        if (!(cfg = json_load_file(path, 0, &je)))
                goto done;
        json_object_set_new(cfg, "torch_dtype", json_string(torch_of[kind]));
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (json_dump_file(cfg, path, JSON_INDENT(1)) != 0)
                goto done;
        snprintf(path, sizeof path, "%s/model.safetensors", src);
        if (tsr_safetensors_open(path, &st, err, sizeof err) != TSR_OK)
                goto done;
        json_object_set_new(hdr, "__metadata__", json_pack("{s:s}", "format", "pt"));
        for (size_t i = 0; i < tsr_safetensors_n_tensors(st); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_tensor_at(st, i);
                size_t w = copy_elem(kind, t->name, 0.0f, one);
                json_t *shape = json_array();
                if (t->dtype != TSR_ST_F32) {
                        json_decref(shape);
                        goto done;
                }
                for (uint32_t d = 0; d < t->n_dims; d++)
                        json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
                json_object_set_new(hdr, t->name,
                                    json_pack("{s:s, s:o, s:[I, I]}", "dtype", w == 4 ? "F32" : dtype_of[kind], "shape",
                                              shape, "data_offsets", (json_int_t)off,
                                              (json_int_t)(off + t->n_elements * w)));
                off += t->n_elements * w;
        }
        text = json_dumps(hdr, JSON_COMPACT);
        size_t hlen = (strlen(text) + 7) / 8 * 8;       /* padded with spaces, as the writers do */
        uint64_t le = hlen;
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (!(f = fopen(path, "wb"))) {
                free(text);
                goto done;
        }
        fwrite(&le, 8, 1, f);                           /* little-endian host */
        fprintf(f, "%-*s", (int)hlen, text);
        free(text);
        for (size_t i = 0; i < tsr_safetensors_n_tensors(st); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_tensor_at(st, i);
                const float *x = t->data;
                for (uint64_t e = 0; e < t->n_elements; e++)
                        fwrite(one, copy_elem(kind, t->name, x[e], one), 1, f);
        }
        rc = fclose(f) == 0 ? 0 : -1;
done:
        tsr_safetensors_close(&st);
        json_decref(hdr);
        json_decref(cfg);
        return rc;
}

static void remove_copy(const char *dir) {
        char path[1200];
        static const char *const files[] = {"config.json", "model.safetensors"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
                snprintf(path, sizeof path, "%s/%s", dir, files[i]);
                unlink(path);
        }
        rmdir(dir);
}

static int setup(void **state) {
        char path[1024], err[512] = "";
        json_error_t je;

        (void)state;
        if (!tsr_test_src_path(FIXTURE "/golden.json", path, sizeof path) || !(golden = json_load_file(path, 0, &je)))
                return -1;
        if (!tsr_test_src_path(FIXTURE "/model", path, sizeof path) ||
            tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, NULL, &model, &stats32, err, sizeof err) != TSR_OK) {
                fprintf(stderr, "load: %s\n", err);
                return -1;
        }
        if (!mkdtemp(bf16_dir) || write_copy(path, bf16_dir, COPY_BF16) != 0 || !mkdtemp(rounded_dir) ||
            write_copy(path, rounded_dir, COPY_ROUNDED) != 0 ||
            tsr_nemotron_h_load(bf16_dir, NULL, NULL, NULL, NULL, NULL, &model16, &stats16, err, sizeof err) !=
                    TSR_OK ||
            tsr_nemotron_h_use_bf16(model16) != TSR_OK) {
                fprintf(stderr, "bf16 copy in %s: %s\n", bf16_dir, err);
                return -1;
        }
        vocab = tsr_nemotron_h_config_of(model)->vocab_size;
        return tsr_backend_cpu_ref_new(&be) == TSR_OK ? 0 : -1;
}

static int teardown(void **state) {
        (void)state;
        tsr_backend_free(&be);
        tsr_nemotron_h_free(&model);
        tsr_nemotron_h_free(&model16);
        remove_copy(bf16_dir);
        remove_copy(rounded_dir);
        json_decref(golden);
        return 0;
}

/* Every row of a raw float32 logits file (`rel` from the source root). */
static float *load_logits_at(const char *rel, size_t *n_rows) {
        char path[1024];
        struct stat sb;
        float *v;
        FILE *f;

        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
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

/* Every row of transformers' logits file: the prompts' full rows, then the decode rows. */
static float *load_logits(size_t *n_rows) { return load_logits_at(FIXTURE "/logits.f32", n_rows); }

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

/* A cache sized for model m (the fixtures differ in their Mamba and attention widths). */
static tsr_nemotron_h_cache *new_cache_for(const tsr_nemotron_h *m) {
        tsr_nemotron_h_cache *c = NULL;
        assert_int_equal(tsr_nemotron_h_cache_new(m, N_SLOTS * SEQ_BLOCKS, BLOCK, N_SLOTS, &c), TSR_OK);
        return c;
}

static tsr_nemotron_h_cache *new_cache(void) { return new_cache_for(model); }

/* Run tokens[past .. past+n) of a sequence in slot/table k, on model m and backend b. */
static void run_on(const tsr_nemotron_h *m, tsr_backend *b, tsr_nemotron_h_cache *c, size_t k,
                   const uint32_t *tokens, size_t n, size_t past, tsr_llama_logits which, float *logits) {
        uint32_t table[SEQ_BLOCKS];
        table_of(k, table);
        tsr_nemotron_h_seq q = {.block_table = table, .n_table = SEQ_BLOCKS, .tokens = tokens + past, .n = n,
                                .past_len = past, .slot = (uint32_t)k, .which = which};
        tsr_status st = tsr_nemotron_h_forward_batch(m, b, c, &q, 1, logits);
        if (st != TSR_OK)
                fail_msg("forward: %s", tsr_status_str(st));
}

/* Rows of the golden prompts (the full sequences' rows of logits.f32). */
static size_t prompt_rows(void) {
        size_t rows = 0, n_prompts = json_array_size(json_object_get(golden, "prompts"));
        uint32_t ids[128];
        for (size_t p = 0; p < n_prompts; p++)
                rows += tsr_test_prompt_ids(golden, p, ids, 128);
        return rows;
}

/* Every position of every prompt, each prompt a fresh sequence in its own slot, into
 * got (prompt_rows() rows); chunks NULL: each prompt in one forward, else cut into
 * chunks of chunks[i % n_chunks] tokens. */
static void full_rows(const tsr_nemotron_h *m, tsr_backend *b, const size_t *chunks, size_t n_chunks, float *got) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts")), row = 0;
        tsr_nemotron_h_cache *c = new_cache_for(m);
        uint32_t ids[128];

        for (size_t p = 0; p < n_prompts; p++) {
                size_t n = tsr_test_prompt_ids(golden, p, ids, 128), past = 0;
                for (size_t i = 0; past < n; i++) {
                        size_t k = chunks ? chunks[i % n_chunks] : n;
                        k = k > n - past ? n - past : k;
                        run_on(m, b, c, p, ids, k, past, TSR_LLAMA_LOGITS_ALL, got + (row + past) * vocab);
                        past += k;
                }
                row += n;
        }
        tsr_nemotron_h_cache_free(&c);
}

/* transformers' cache decode path: prefill all but `steps` tokens of the decode prompt,
 * then one at a time, into got (steps rows).  Returns steps. */
static size_t decode_rows(const tsr_nemotron_h *m, tsr_backend *b, float *got) {
        json_t *d = json_object_get(golden, "decode");
        size_t pi = (size_t)json_integer_value(json_object_get(d, "prompt"));
        size_t steps = (size_t)json_integer_value(json_object_get(d, "steps"));
        tsr_nemotron_h_cache *c = new_cache_for(m);
        uint32_t ids[128];
        size_t n = tsr_test_prompt_ids(golden, pi, ids, 128);

        /* slot 3 first holds another sequence: a new sequence must start from zero state */
        run_on(m, b, c, 3, ids, 5, 0, TSR_LLAMA_LOGITS_NONE, NULL);
        run_on(m, b, c, 3, ids, n - steps, 0, TSR_LLAMA_LOGITS_LAST, got);
        for (size_t t = n - steps; t < n; t++)
                run_on(m, b, c, 3, ids, 1, t, TSR_LLAMA_LOGITS_LAST, got + (t - (n - steps)) * vocab);
        tsr_nemotron_h_cache_free(&c);
        return steps;
}

/* Prefill chunks of 1, 2, 5, 3, 7, ... tokens: shorter and longer than the conv window
 * of 3 past rows, across KV blocks of 4. */
static const size_t chunk_sizes[] = {1, 2, 5, 3, 7, 1, 1, 4, 9, 2, 6};
#define N_CHUNK_SIZES (sizeof chunk_sizes / sizeof chunk_sizes[0])

/* Prefill pieces at multiples of the fixtures' chunk_size (8), the last one the rest:
 * the same scans as the whole prompt in one piece (each whole chunk in the chunked form,
 * the tail after the last whole chunk by the recurrence), so the same bits.  chunk_sizes'
 * pieces cut chunks, which then run by the recurrence: the same values to rounding. */
static const size_t aligned_chunks[] = {8, 16, 8, 24};
#define N_ALIGNED_CHUNKS (sizeof aligned_chunks / sizeof aligned_chunks[0])

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
        assert_false(c->residual_in_fp32);
        /* one slot: 2 Mamba layers x (3 conv rows x 128 + 8 x 8 x 16 state) floats */
        assert_int_equal(tsr_nemotron_h_slot_bytes(c), 2 * (3 * 128 + 8 * 8 * 16) * 4);
}

/* Every position of every prompt, each prompt a fresh sequence in its own slot. */
static void test_full_logits(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));

        (void)state;
        full_rows(model, be, NULL, 0, got);
        float worst = compare_rows(got, want, rows);
        print_message("full sequences: max |dlogit| %.3g over %zu rows\n", (double)worst, rows);
        assert_true(worst <= TOL);
        free(got);
        free(want);
}

/* transformers' cache decode path: prefill all but `steps` tokens, then one at a time. */
static void test_decode_steps(void **state) {
        size_t n_rows, before = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(n_rows * vocab * sizeof(float));

        (void)state;
        size_t steps = decode_rows(model, be, got);
        assert_int_equal(n_rows, before + steps);
        float worst = compare_rows(got, want + before * vocab, steps);
        print_message("decode steps: max |dlogit| %.3g over %zu steps\n", (double)worst, steps);
        assert_true(worst <= TOL);
        free(got);
        free(want);
}

/* Prefill in chunks (chunk_sizes): every row as the full sequence's. */
static void test_chunked_prefill(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));

        (void)state;
        full_rows(model, be, chunk_sizes, N_CHUNK_SIZES, got);
        float worst = compare_rows(got, want, rows);
        print_message("chunked prefill: max |dlogit| %.3g\n", (double)worst);
        assert_true(worst <= TOL);
        free(got);
        free(want);
}

/* Prefix caching of the state (engine.h restore_state / saves): sequence A runs the
 * first 40 tokens of the longest prompt in one chunk in slot 1, saving the states after
 * 16 and 32 tokens to slots 2 and 0 on the way; sequence B (slot 3, its table's leading
 * blocks A's) restores one of them and runs the rest in one chunk, batched with a fresh
 * prompt in slot 1: B's rows are bitwise the full sequence's from there, from either
 * save (so each save is the state at its position, conv window included), twice from
 * the same save.  Copies that would touch a slot the step writes, or saves outside the
 * chunk or out of order, are refused. */
static void test_state_restore_and_save(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts"));
        uint32_t ids[128], other[128], ta[SEQ_BLOCKS], tb[SEQ_BLOCKS], t0[SEQ_BLOCKS];
        size_t n = tsr_test_prompt_ids(golden, n_prompts - 1, ids, 128);
        size_t n0 = tsr_test_prompt_ids(golden, 0, other, 128);
        float *want = malloc(n * vocab * sizeof(float)), *got = malloc(n * vocab * sizeof(float));
        tsr_nemotron_h_cache *c = new_cache();
        const tsr_state_save saves[2] = {{.pos = 16, .slot = 2}, {.pos = 32, .slot = 0}};

        (void)state;
        assert_true(n > 48);
        run_on(model, be, c, 0, ids, n, 0, TSR_LLAMA_LOGITS_ALL, want);
        table_of(1, ta);
        table_of(3, tb);
        table_of(0, t0);
        memcpy(tb, ta, 40 / BLOCK * sizeof(uint32_t));  /* A's KV blocks, as a prefix hit shares them */
        tsr_nemotron_h_seq a = {.block_table = ta, .n_table = SEQ_BLOCKS, .tokens = ids, .n = 40, .slot = 1,
                                .which = TSR_LLAMA_LOGITS_NONE, .saves = saves, .n_saves = 2};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &a, 1, NULL), TSR_OK);
        for (int round = 0; round < 3; round++) {
                size_t P = round == 1 ? 32 : 16;
                uint32_t from = round == 1 ? 0 : 2;
                tsr_nemotron_h_seq q[2] = {
                        {.block_table = tb, .n_table = SEQ_BLOCKS, .tokens = ids + P, .n = n - P, .past_len = P,
                         .slot = 3, .which = TSR_LLAMA_LOGITS_ALL, .restore = true, .restore_from = from},
                        {.block_table = t0, .n_table = SEQ_BLOCKS, .tokens = other, .n = n0, .slot = 1,
                         .which = TSR_LLAMA_LOGITS_LAST},
                };
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_OK);
                assert_memory_equal(got, want + P * vocab, (n - P) * vocab * sizeof(float));
                /* the bad ones, each refused before anything runs */
                q[0].restore_from = 3;                  /* B's own slot */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                q[0].restore_from = 1;                  /* the other sequence's slot */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                q[0].restore_from = from;
                tsr_state_save bad[2] = {{.pos = 1, .slot = from}, {.pos = 2, .slot = 2}};
                q[1].saves = bad;                       /* a save over B's source */
                q[1].n_saves = 1;
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                bad[0].slot = 3;                        /* over B's slot */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                bad[0].slot = N_SLOTS;                  /* no such slot */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                bad[0] = (tsr_state_save){.pos = (uint32_t)n0 + 1, .slot = 2 - from};   /* past the chunk */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                bad[0].pos = 3;                         /* out of order */
                q[1].n_saves = 2;
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
                q[1].n_saves = 0;
                q[0].past_len = 0;                      /* a restore with nothing before */
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, q, 2, got), TSR_E_INVAL);
        }
        tsr_nemotron_h_cache_free(&c);
        free(want);
        free(got);
}

/* The scan in chunks (chunk_size 8 here): the longest prompt in one forward (its whole
 * chunks in the chunked form) against the same prompt a token at a time (the recurrence
 * only) agree to rounding (1e-5) but not to the bit, so the chunked form ran.  A prefix
 * cache save inside a chunk (position 12 of [8, 16)) makes that chunk run by the
 * recurrence: a sequence restored from it gives bitwise the rows of the one that saved it. */
static void test_chunked_scan(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts"));
        uint32_t ids[128], ta[SEQ_BLOCKS], tb[SEQ_BLOCKS];
        size_t n = tsr_test_prompt_ids(golden, n_prompts - 1, ids, 128);
        float *whole = malloc(n * vocab * sizeof(float)), *steps = malloc(n * vocab * sizeof(float));
        tsr_nemotron_h_cache *c = new_cache();

        (void)state;
        assert_int_equal(tsr_nemotron_h_config_of(model)->chunk_size, 8);
        assert_true(n >= 40);
        run_on(model, be, c, 0, ids, n, 0, TSR_LLAMA_LOGITS_ALL, whole);
        for (size_t t = 0; t < n; t++)
                run_on(model, be, c, 1, ids, 1, t, TSR_LLAMA_LOGITS_LAST, steps + t * vocab);
        float worst = compare_rows(whole, steps, n);
        print_message("chunked scan vs the recurrence: max |dlogit| %.3g over %zu rows\n", (double)worst, n);
        assert_true(worst <= 1e-5f);
        assert_true(memcmp(whole, steps, n * vocab * sizeof(float)) != 0);

        const tsr_state_save save = {.pos = 12, .slot = 2};
        table_of(1, ta);
        table_of(3, tb);
        memcpy(tb, ta, 12 / BLOCK * sizeof(uint32_t));
        tsr_nemotron_h_seq a = {.block_table = ta, .n_table = SEQ_BLOCKS, .tokens = ids, .n = 40, .slot = 1,
                                .which = TSR_LLAMA_LOGITS_ALL, .saves = &save, .n_saves = 1};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &a, 1, whole), TSR_OK);
        tsr_nemotron_h_seq b = {.block_table = tb, .n_table = SEQ_BLOCKS, .tokens = ids + 12, .n = 28,
                                .past_len = 12, .slot = 3, .which = TSR_LLAMA_LOGITS_ALL, .restore = true,
                                .restore_from = 2};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c, &b, 1, steps), TSR_OK);
        assert_memory_equal(steps, whole + 12 * vocab, 28 * vocab * sizeof(float));
        tsr_nemotron_h_cache_free(&c);
        free(whole);
        free(steps);
}

/* The greedy continuations: prefill the prompt, then decode on the carried state. */
/* Prompt p's greedy continuation of n tokens on model m (prefill, then decode steps on
 * the carried state) into out[n]. */
static void greedy_on(const tsr_nemotron_h *m, size_t p, size_t n, uint32_t *out) {
        tsr_nemotron_h_cache *c = new_cache_for(m);
        float *logits = malloc(vocab * sizeof(float));
        uint32_t ids[SEQ_BLOCKS * BLOCK];
        size_t len = tsr_test_prompt_ids(golden, p, ids, 128);

        assert_true(len + n <= SEQ_BLOCKS * BLOCK);
        run_on(m, be, c, p, ids, len, 0, TSR_LLAMA_LOGITS_LAST, logits);
        for (size_t i = 0; i < n; i++) {
                out[i] = ids[len] = (uint32_t)tsr_test_argmax(logits, vocab);
                run_on(m, be, c, p, ids, 1, len++, TSR_LLAMA_LOGITS_LAST, logits);
        }
        tsr_nemotron_h_cache_free(&c);
        free(logits);
}

static void test_greedy(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts"));
        uint32_t got[64];

        (void)state;
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *g = json_array_get(json_object_get(golden, "greedy"), p);
                assert_true(json_array_size(g) <= 64);
                greedy_on(model, p, json_array_size(g), got);
                for (size_t i = 0; i < json_array_size(g); i++)
                        assert_int_equal(got[i], json_integer_value(json_array_get(g, i)));
        }
}

/* One step of three sequences batched (a prefill chunk, a decode step, a fresh prompt)
 * gives bitwise each one's rows alone, on the reference and the fast CPU backends. */
static void check_batch_invariance(const tsr_nemotron_h *m) {
        tsr_backend *backends[2] = {be, NULL};
        uint32_t ids[3][128], tables[3][SEQ_BLOCKS];
        size_t n[3];

        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16},
                                             &backends[1]),
                         TSR_OK);
        for (size_t k = 0; k < 3; k++) {
                n[k] = tsr_test_prompt_ids(golden, k, ids[k], 128);
                table_of(k, tables[k]);
        }
        for (size_t bi = 0; bi < 2; bi++) {
                tsr_backend *b = backends[bi];
                tsr_nemotron_h_cache *alone = new_cache_for(m), *batched = new_cache_for(m);
                /* the history both caches share: seq 1 has 20 tokens, seq 2 has n-1 */
                tsr_nemotron_h_seq hist[2] = {
                        {tables[1], SEQ_BLOCKS, ids[1], 20, 0, 1, TSR_LLAMA_LOGITS_NONE},
                        {tables[2], SEQ_BLOCKS, ids[2], n[2] - 1, 0, 2, TSR_LLAMA_LOGITS_NONE},
                };
                for (size_t h = 0; h < 2; h++) {
                        assert_int_equal(tsr_nemotron_h_forward_batch(m, b, alone, &hist[h], 1, NULL), TSR_OK);
                        assert_int_equal(tsr_nemotron_h_forward_batch(m, b, batched, &hist[h], 1, NULL), TSR_OK);
                }
                tsr_nemotron_h_seq step[3] = {
                        {tables[0], SEQ_BLOCKS, ids[0], n[0], 0, 0, TSR_LLAMA_LOGITS_ALL},
                        {tables[1], SEQ_BLOCKS, ids[1] + 20, n[1] - 20, 20, 1, TSR_LLAMA_LOGITS_ALL},
                        {tables[2], SEQ_BLOCKS, ids[2] + n[2] - 1, 1, n[2] - 1, 2, TSR_LLAMA_LOGITS_LAST},
                };
                size_t rows = n[0] + (n[1] - 20) + 1;
                float *one = malloc(rows * vocab * sizeof(float)), *all = malloc(rows * vocab * sizeof(float));
                for (size_t k = 0, r = 0; k < 3; k++) {
                        assert_int_equal(tsr_nemotron_h_forward_batch(m, b, alone, &step[k], 1, one + r * vocab),
                                         TSR_OK);
                        r += step[k].which == TSR_LLAMA_LOGITS_ALL ? step[k].n : 1;
                }
                assert_int_equal(tsr_nemotron_h_forward_batch(m, b, batched, step, 3, all), TSR_OK);
                assert_memory_equal(one, all, rows * vocab * sizeof(float));
                free(one);
                free(all);
                tsr_nemotron_h_cache_free(&alone);
                tsr_nemotron_h_cache_free(&batched);
        }
        tsr_backend_free(&backends[1]);
}

static void test_batch_invariance(void **state) {
        (void)state;
        check_batch_invariance(model);
}

/* The Mamba mixer runs as (sequence, group) tasks on the backend's threads: a step of
 * three sequences (a new prompt, a prefill chunk after 20 tokens, a decode step) gives
 * the same bits on fast backends of 1, 2 and 3 threads, and leaves the same state (3
 * threads six times: a task writing outside its own channels shows as a difference only
 * when two tasks overlap in time). */
static void test_threads_bitwise(void **state) {
        uint32_t ids[3][128], tables[3][SEQ_BLOCKS];
        size_t n[3], rows;
        float *want = NULL;

        (void)state;
        for (size_t k = 0; k < 3; k++) {
                n[k] = tsr_test_prompt_ids(golden, k, ids[k], 128);
                table_of(k, tables[k]);
        }
        rows = n[0] + (n[1] - 20) + 1 + 1;
        for (int round = 0; round < 8; round++) {       /* 1, 2, then 3 threads six times */
                int threads = round < 2 ? round + 1 : 3;
                tsr_backend *b = NULL;
                tsr_nemotron_h_cache *kv = new_cache();
                float *got = malloc(rows * vocab * sizeof(float));

                assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads,
                                                                                .max_isa = TSR_CPU_ISA_AMX_BF16},
                                                     &b),
                                 TSR_OK);
                tsr_nemotron_h_seq hist[2] = {
                        {tables[1], SEQ_BLOCKS, ids[1], 20, 0, 1, TSR_LLAMA_LOGITS_NONE},
                        {tables[2], SEQ_BLOCKS, ids[2], n[2] - 1, 0, 2, TSR_LLAMA_LOGITS_NONE},
                };
                assert_int_equal(tsr_nemotron_h_forward_batch(model, b, kv, hist, 2, NULL), TSR_OK);
                tsr_nemotron_h_seq step[3] = {
                        {tables[0], SEQ_BLOCKS, ids[0], n[0], 0, 0, TSR_LLAMA_LOGITS_ALL},
                        {tables[1], SEQ_BLOCKS, ids[1] + 20, n[1] - 20, 20, 1, TSR_LLAMA_LOGITS_ALL},
                        {tables[2], SEQ_BLOCKS, ids[2] + n[2] - 1, 1, n[2] - 1, 2, TSR_LLAMA_LOGITS_LAST},
                };
                assert_int_equal(tsr_nemotron_h_forward_batch(model, b, kv, step, 3, got), TSR_OK);
                /* one more token of seq 1: reads the state the step left */
                tsr_nemotron_h_seq next = {tables[1], SEQ_BLOCKS, ids[0], 1, n[1], 1, TSR_LLAMA_LOGITS_LAST};
                assert_int_equal(tsr_nemotron_h_forward_batch(model, b, kv, &next, 1, got + (rows - 1) * vocab),
                                 TSR_OK);
                if (!want)
                        want = got;
                else {
                        assert_memory_equal(got, want, rows * vocab * sizeof(float));
                        free(got);
                }
                tsr_nemotron_h_cache_free(&kv);
                tsr_backend_free(&b);
        }
        free(want);
}

/* Over the runner's pool (the family's kv_groups: attention blocks + Mamba state slots)
 * the forward gives bitwise what it gives over its own cache; a pool of other groups is
 * refused. */
static void test_pool_bind(void **state) {
        tsr_kv_group g[TSR_KV_GROUPS_MAX];
        size_t ng = tsr_nemotron_h_kv_groups(tsr_nemotron_h_config_of(model), 0,
                                           tsr_nemotron_h_config_of(model)->n_layers - 1, 1, g, TSR_KV_GROUPS_MAX);
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
 * whole experts); the family's description (config.json and GGUF) and KV groups. */
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
                /* every row has a name in one format at least; "%u" exactly in the per-layer ones */
                assert_true(t->hf || t->gguf);
                if (t->hf)
                        assert_int_equal(strstr(t->hf, "%u") != NULL, t->per_layer);
                if (t->gguf)
                        assert_int_equal(strstr(t->gguf, "%u") != NULL, t->per_layer);
                for (size_t j = 0; j < i; j++)
                        assert_string_not_equal(f->tensors[j].logical, t->logical);
                if (!t->hf)
                        continue;
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
        /* pipeline stages (vLLM's split of the 6 layers 'ME*M-E', every kind counting):
         * stage 1 of 2 holds 'M-E', its one Mamba layer's state; stage 2 of 3 holds '-E',
         * which keeps nothing */
        assert_int_equal(f->shard_for(&d, 0, 1, 1, 2, &sh), TSR_OK);
        assert_int_equal(sh.first_layer, 3);
        assert_int_equal(sh.last_layer, 5);
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 1);
        assert_int_equal(g[0].kind, TSR_KV_MAMBA_STATE);
        assert_int_equal(g[0].n_layers, 1);
        assert_int_equal(f->shard_for(&d, 0, 1, 0, 2, &sh), TSR_OK);
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 2);
        assert_int_equal(g[0].kind, TSR_KV_FULL_ATTENTION);
        assert_int_equal(g[0].n_layers, 1);
        assert_int_equal(g[1].n_layers, 1);
        assert_int_equal(f->shard_for(&d, 0, 1, 2, 3, &sh), TSR_OK);
        assert_int_equal(sh.first_layer, 4);
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 0);
        sh.tp_size = 2;                 /* tensor parallelism is not built */
        assert_int_equal(f->kv_groups(&d, &sh, g, TSR_KV_GROUPS_MAX), 0);
        tsr_model_desc_done(&d);
        /* a GGUF: read (test_gguf); a missing one is an error naming the file */
        assert_int_not_equal(tsr_model_desc_read(f, "/x/model.gguf", true, &d, err, sizeof err), TSR_OK);
        assert_non_null(strstr(err, "/x/model.gguf"));
        tsr_model_desc_done(&d);
        assert_non_null(tsr_test_src_path(GGUF_FIXTURE "/model-f16.gguf", path, sizeof path));
        assert_int_equal(tsr_model_desc_read(f, path, true, &d, err, sizeof err), TSR_OK);
        assert_int_equal(d.n_layers, 6);
        assert_int_equal(d.vocab_size, 300);
        tsr_model_desc_done(&d);
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
                {"\"mamba_ssm_cache_dtype\": \"bfloat16\"", TSR_E_UNSUPPORTED, "mamba_ssm_cache_dtype"},
                {"\"residual_in_fp32\": \"yes\"", TSR_E_INVAL, "residual_in_fp32"},
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

/* ---- bfloat16 ---------------------------------------------------------------------- */

/* Issue #14's bar for bf16 rows against transformers' fp32 logits: every row's cosine
 * similarity, and the share of rows whose argmax agrees. */
#define BF16_MIN_COS 0.999
#define BF16_MIN_TOP1 0.99

typedef struct fidelity {
        double worst_cos;
        size_t agree, rows;
        float max_diff;
        float flip_margin;      /* the largest fp32 top-1/top-2 margin of a row whose argmax moved */
} fidelity;

/* The fp32 row's top-1 minus top-2 logit. */
static float margin(const float *w) {
        size_t a = tsr_test_argmax(w, vocab);
        float second = -INFINITY;
        for (size_t j = 0; j < vocab; j++)
                if (j != a && w[j] > second)
                        second = w[j];
        return w[a] - second;
}

static void fidelity_add(fidelity *f, const float *got, const float *want, size_t rows) {
        if (f->rows == 0)
                f->worst_cos = 1.0;
        for (size_t r = 0; r < rows; r++, f->rows++) {
                const float *g = got + r * vocab, *w = want + r * vocab;
                double dot = 0, na = 0, nb = 0;
                for (size_t j = 0; j < vocab; j++) {
                        float d = fabsf(g[j] - w[j]);
                        assert_false(isnan(d));
                        f->max_diff = d > f->max_diff ? d : f->max_diff;
                        dot += (double)g[j] * w[j];
                        na += (double)g[j] * g[j];
                        nb += (double)w[j] * w[j];
                }
                f->worst_cos = fmin(f->worst_cos, dot / sqrt(na * nb));
                if (tsr_test_argmax(g, vocab) == tsr_test_argmax(w, vocab))
                        f->agree++;
                else
                        f->flip_margin = fmaxf(f->flip_margin, margin(w));
        }
}

static void fidelity_check(const char *what, const fidelity *f) {
        print_message("%s: worst per-position cosine %.6f, top-1 %zu/%zu (moved where the fp32 margin <= %.3g), "
                      "max |dlogit| %.3g\n", what, f->worst_cos, f->agree, f->rows, (double)f->flip_margin,
                      (double)f->max_diff);
        assert_true(f->rows > 0);
        assert_true(f->worst_cos >= BF16_MIN_COS);
        assert_true((double)f->agree >= BF16_MIN_TOP1 * (double)f->rows);
}

/* Model m's full-sequence rows (the reference backend, into got) against want; with
 * `what` the figures are printed and held to the bar. */
static fidelity full_fidelity(const char *what, const tsr_nemotron_h *m, const float *want, float *got) {
        size_t rows = prompt_rows();
        fidelity f = {0};

        full_rows(m, be, NULL, 0, got);
        fidelity_add(&f, got, want, rows);
        if (what)
                fidelity_check(what, &f);
        return f;
}

/* The elements of the linears the bf16 model holds in bf16, from the config alone. */
static uint64_t linear_elems(const tsr_nemotron_h_config *c) {
        uint64_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), cd = tsr_nemotron_h_conv_dim(c);
        uint64_t qd = (uint64_t)c->n_heads * c->head_dim, kvd = (uint64_t)c->n_kv_heads * c->head_dim;
        uint64_t n = (uint64_t)c->vocab_size * dim;
        n += tsr_nemotron_h_count(c, 'M') * ((di + cd + c->m_heads) * dim + dim * di);
        n += tsr_nemotron_h_count(c, '*') * ((qd + 2 * kvd) * dim + dim * qd);
        n += tsr_nemotron_h_count(c, 'E') * (2 * (uint64_t)c->shared_hidden * dim +
                                            2 * (uint64_t)c->n_experts * c->moe_hidden * dim);
        n += tsr_nemotron_h_count(c, '-') * 2 * (uint64_t)c->mlp_hidden * dim;
        return n;
}

/* The BF16 copy: bf16 linears (resident bytes 2 per linear weight, the rest as loaded),
 * idempotent conversion, the float32 model untouched. */
static void test_bf16_load(void **state) {
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(model16);
        uint64_t lin = linear_elems(c);

        (void)state;
        assert_true(tsr_nemotron_h_is_bf16(model16));
        assert_false(tsr_nemotron_h_is_bf16(model));
        assert_int_equal(tsr_nemotron_h_check_backend(model16, be), TSR_OK);
        assert_int_equal(stats16.n_tensors, stats32.n_tensors);
        assert_true(stats16.file_bytes < stats32.file_bytes);
        assert_int_equal(stats16.resident_bytes, stats32.resident_bytes);      /* both widened at load */
        assert_int_equal(tsr_nemotron_h_resident_bytes(model), stats32.resident_bytes);
        assert_int_equal(tsr_nemotron_h_resident_bytes(model16), stats16.resident_bytes - 2 * lin);
        assert_int_equal(tsr_nemotron_h_use_bf16(model16), TSR_OK);            /* already: unchanged */
        assert_int_equal(tsr_nemotron_h_resident_bytes(model16), stats16.resident_bytes - 2 * lin);
        /* the state slots do not depend on the weights' dtype: float32 conv and SSM state */
        assert_int_equal(tsr_nemotron_h_slot_bytes(c), tsr_nemotron_h_slot_bytes(tsr_nemotron_h_config_of(model)));
        print_message("tiny-nemotron-h resident: %.1f KB float32, %.1f KB with bf16 linears (file %.1f KB -> %.1f KB)\n",
                      (double)tsr_nemotron_h_resident_bytes(model) / 1e3,
                      (double)tsr_nemotron_h_resident_bytes(model16) / 1e3, (double)stats32.file_bytes / 1e3,
                      (double)stats16.file_bytes / 1e3);
}

/* bf16 against transformers' fp32 logits: full sequences and the decode steps held to
 * the bar; prefill in pieces at chunk multiples bitwise the full sequences' rows (the
 * state carried in float32, every op per row). */
static void test_bf16_fidelity(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *full = malloc(rows * vocab * sizeof(float));
        float *chunked = malloc(rows * vocab * sizeof(float)), *dec = malloc(n_rows * vocab * sizeof(float));
        fidelity fd = {0};

        (void)state;
        full_fidelity("bf16 full sequences", model16, want, full);
        full_rows(model16, be, aligned_chunks, N_ALIGNED_CHUNKS, chunked);
        assert_memory_equal(chunked, full, rows * vocab * sizeof(float));
        size_t steps = decode_rows(model16, be, dec);
        fidelity_add(&fd, dec, want + rows * vocab, steps);
        fidelity_check("bf16 decode steps", &fd);
        free(want);
        free(full);
        free(chunked);
        free(dec);
}

/* bf16 greedy continuations against transformers' fp32 ones: the same tokens at least
 * until the first step whose fp32 top-1/top-2 margin is under BF16_FLIP_MARGIN (twice
 * the largest |dlogit| test_bf16_fidelity sees, 0.046: below it bf16's error may change
 * the choice, after it the contexts differ).  How far each agrees, and how far
 * transformers' own bf16 (golden.json "bf16") agrees with its fp32, is printed. */
#define BF16_FLIP_MARGIN 0.1
static void test_bf16_greedy(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden, "prompts")), same = 0, hf_same = 0, total = 0;
        json_t *hf = json_object_get(json_object_get(golden, "bf16"), "transformers_greedy");
        uint32_t got[64];

        (void)state;
        assert_int_equal(json_array_size(hf), n_prompts);
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *g = json_array_get(json_object_get(golden, "greedy"), p);
                json_t *mg = json_array_get(json_object_get(golden, "greedy_margin"), p);
                size_t n = json_array_size(g), k = 0, kh = 0, must = 0;
                assert_true(n <= 64);
                greedy_on(model16, p, n, got);
                while (must < n && json_real_value(json_array_get(mg, must)) >= BF16_FLIP_MARGIN)
                        must++;
                while (k < n && got[k] == (uint32_t)json_integer_value(json_array_get(g, k)))
                        k++;
                while (kh < n && json_integer_value(json_array_get(json_array_get(hf, p), kh)) ==
                                         json_integer_value(json_array_get(g, kh)))
                        kh++;
                print_message("prompt %zu: bf16 greedy equals fp32's for %zu of %zu tokens (required: %zu); "
                              "transformers bf16 for %zu\n", p, k, n, must, kh);
                /* the in-process tokens, for tests/e2e/test_nemotron_h.py to hold the served ones to */
                print_message("bf16 greedy of prompt %zu:", p);
                for (size_t i = 0; i < n; i++)
                        print_message("%s%u", i ? ", " : " [", got[i]);
                print_message("]\n");
                assert_true(k >= must);
                same += k;
                hf_same += kh;
                total += n;
        }
        print_message("bf16 greedy: %zu of %zu tokens before the first difference from fp32 (transformers bf16: %zu)\n",
                      same, total, hf_same);
}

/* --kv-cache-dtype fp8 over the runner's pool (issue #15, models.md §4.5): the
 * attention group stored as fp8_e4m3 with its per-layer scales, the Mamba state still
 * float32.  The first attention layer's cache holds exactly e4m3(k / k_scale) and
 * e4m3(v / v_scale) of what the float32 pool holds (every layer before it is the same
 * math in both), and the logits over a prefill and three decode steps stay within issue
 * #14's bar of the float32 cache's (cosine, top-1), without being equal to them. */
static void test_pool_fp8_kv(void **state) {
        const tsr_nemotron_h_config *cfg = tsr_nemotron_h_config_of(model);
        tsr_kv_group g[TSR_KV_GROUPS_MAX], g8[TSR_KV_GROUPS_MAX];
        size_t ng = tsr_nemotron_h_kv_groups(cfg, 0, cfg->n_layers - 1, 1, g, TSR_KV_GROUPS_MAX);
        size_t kvd = (size_t)cfg->n_kv_heads * cfg->head_dim;
        tsr_kv_pool *p32 = NULL, *p8 = NULL;
        tsr_nemotron_h_cache *c32 = NULL, *c8 = NULL;
        uint32_t ids[128], table[SEQ_BLOCKS];
        size_t n = tsr_test_prompt_ids(golden, 2, ids, 128), first = n - 3;
        float *a = malloc(n * vocab * sizeof(float)), *b = malloc(n * vocab * sizeof(float));
        fidelity f = {0};

        (void)state;
        memcpy(g8, g, sizeof g);
        tsr_kv_groups_set_dtype(g8, ng, TSR_DTYPE_FP8_E4M3);
        assert_int_equal(g8[0].dtype, TSR_DTYPE_FP8_E4M3);
        assert_int_equal(g8[1].dtype, TSR_DTYPE_F32);          /* the Mamba state is not the KV cache */
        assert_int_equal(tsr_kv_pool_new_slots(g, ng, SEQ_BLOCKS, BLOCK, 1, &p32), TSR_OK);
        assert_int_equal(tsr_kv_pool_new_slots(g8, ng, SEQ_BLOCKS, BLOCK, 1, &p8), TSR_OK);
        p8->groups[0].k_scale[0] = 2.0f;        /* not the 1.0 default: the scales are applied */
        p8->groups[0].v_scale[0] = 0.5f;
        assert_int_equal(tsr_nemotron_h_cache_bind(model, p32, &c32), TSR_OK);
        assert_int_equal(tsr_nemotron_h_cache_bind(model, p8, &c8), TSR_OK);
        table_of(0, table);
        tsr_nemotron_h_seq q = {table, SEQ_BLOCKS, ids, first, 0, 0, TSR_LLAMA_LOGITS_ALL};
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c8, &q, 1, a), TSR_OK);
        assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c32, &q, 1, b), TSR_OK);
        for (size_t t = 0; t < first; t++) {
                size_t row = ((size_t)table[t / BLOCK] * BLOCK + t % BLOCK) * kvd;
                const float *k32 = (const float *)p32->groups[0].k[0] + row;
                const float *v32 = (const float *)p32->groups[0].v[0] + row;
                const uint8_t *k8 = (const uint8_t *)p8->groups[0].k[0] + row;
                const uint8_t *v8 = (const uint8_t *)p8->groups[0].v[0] + row;
                for (size_t j = 0; j < kvd; j++) {
                        assert_int_equal(k8[j], tsr_f32_to_fp8_e4m3(k32[j] / 2.0f));
                        assert_int_equal(v8[j], tsr_f32_to_fp8_e4m3(v32[j] / 0.5f));
                }
        }
        for (size_t t = first; t < n; t++) {
                q = (tsr_nemotron_h_seq){table, SEQ_BLOCKS, ids + t, 1, t, 0, TSR_LLAMA_LOGITS_ALL};
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c8, &q, 1, a + t * vocab), TSR_OK);
                assert_int_equal(tsr_nemotron_h_forward_batch(model, be, c32, &q, 1, b + t * vocab), TSR_OK);
        }
        assert_memory_not_equal(a, b, n * vocab * sizeof(float));
        fidelity_add(&f, a, b, n);
        fidelity_check("fp8 KV cache against the float32 one", &f);
        tsr_nemotron_h_cache_free(&c32);
        tsr_nemotron_h_cache_free(&c8);
        tsr_kv_pool_free(&p32);
        tsr_kv_pool_free(&p8);
        free(a);
        free(b);
}

static void test_bf16_batch_invariance(void **state) {
        (void)state;
        check_batch_invariance(model16);
}

/* The fast CPU backend on the bf16 model: bitwise the reference where its bf16 matmul
 * widens the weights (AVX2: ref's order), else (VDPBF16PS, AMX tiles: their own fixed
 * order) held to the same bar against transformers. */
static void test_bf16_fast_backend(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *ref = malloc(rows * vocab * sizeof(float));
        float *got = malloc(rows * vocab * sizeof(float));
        tsr_backend *fast = NULL;
        fidelity f = {0};

        (void)state;
        assert_int_equal(
                tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AMX_BF16}, &fast),
                TSR_OK);
        full_rows(model16, be, NULL, 0, ref);
        full_rows(model16, fast, aligned_chunks, N_ALIGNED_CHUNKS, got);
        if (tsr_backend_cpu_isa(fast) < TSR_CPU_ISA_AVX512_BF16) {
                assert_memory_equal(got, ref, rows * vocab * sizeof(float));
                print_message("bf16 on cpu-fast (%s): bitwise the reference\n",
                              tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)));
        } else {
                fidelity_add(&f, got, want, rows);
                fidelity_check(tsr_cpu_isa_name(tsr_backend_cpu_isa(fast)), &f);
        }
        tsr_backend_free(&fast);
        free(want);
        free(ref);
        free(got);
}

/* The BF16 copy loaded with keep_bf16: every linear (routed experts too), lm_head and the
 * (untied) embedding table stay bf16 as stored, 2 bytes each and never widened.  After
 * tsr_nemotron_h_use_bf16 it holds 2 bytes a table element less than model16 (the same
 * file widened, then converted: its embedding stays float32), and its logits are bitwise
 * model16's, on the reference and the fast backends.  A tensor-parallel
 * and an expert-parallel rank keep their shares of the bytes (test_parallel's
 * test_tp_bf16 checks their logits). */
static void test_bf16_kept_as_stored(void **state) {
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(model16);
        uint64_t lin = linear_elems(c), table = c->tied_embeddings ? 0 : (uint64_t)c->vocab_size * c->dim;
        size_t rows = prompt_rows();
        float *ref = malloc(rows * vocab * sizeof(float)), *got = malloc(rows * vocab * sizeof(float));
        const tsr_load_opts keep = {.keep_bf16 = true};
        tsr_nemotron_h *m = NULL, *w = NULL;
        tsr_load_stats st = {0}, sw = {0};
        tsr_backend *fast = NULL;
        char err[512] = "";

        (void)state;
        if (tsr_nemotron_h_load(bf16_dir, NULL, NULL, &keep, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        assert_int_equal(st.resident_bytes, stats16.resident_bytes - 2 * (lin + table));
        assert_int_equal(tsr_nemotron_h_resident_bytes(m), st.resident_bytes);
        assert_false(tsr_nemotron_h_is_bf16(m));
        assert_int_equal(tsr_nemotron_h_check_backend(m, be), TSR_OK);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        assert_int_equal(tsr_nemotron_h_resident_bytes(m), tsr_nemotron_h_resident_bytes(model16) - 2 * table);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2}, &fast), TSR_OK);
        tsr_backend *bes[] = {be, fast};
        for (size_t k = 0; k < 2; k++) {
                full_rows(model16, bes[k], NULL, 0, ref);
                full_rows(m, bes[k], NULL, 0, got);
                assert_memory_equal(got, ref, rows * vocab * sizeof(float));
        }
        print_message("tiny-nemotron-h as BF16: %" PRIu64 " bytes of linears and tables kept as stored (%" PRIu64
                      " widened); %zu logit rows bitwise the converted model's\n", 2 * (lin + table),
                      4 * (lin + table), rows);
        tsr_nemotron_h_free(&m);
        for (int ep = 0; ep < 2; ep++) {
                tsr_shard_spec r1 = {1, 2, 0, c->n_layers - 1, ep};
                if (tsr_nemotron_h_load(bf16_dir, NULL, &r1, NULL, NULL, NULL, &w, &sw, err, sizeof err) != TSR_OK ||
                    tsr_nemotron_h_load(bf16_dir, NULL, &r1, &keep, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                assert_true(st.resident_bytes < sw.resident_bytes);
                assert_int_equal(tsr_nemotron_h_use_bf16(w), TSR_OK);
                assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
                /* each rank holds its vocabulary rows of the embedding (vocabulary-parallel,
                 * tsr_tp_vocab_of): at 2 bytes an element when kept */
                uint64_t share = table ? (uint64_t)tsr_tp_vocab_of(c->vocab_size, 1, 2).n * c->dim : 0;
                assert_int_equal(tsr_nemotron_h_resident_bytes(m), tsr_nemotron_h_resident_bytes(w) - 2 * share);
                tsr_nemotron_h_free(&w);
                /* the same rank loaded whole, then split: the kept lm_head cut to its rows too */
                if (tsr_nemotron_h_load(bf16_dir, NULL, NULL, &keep, NULL, NULL, &w, &sw, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                assert_int_equal(ep ? tsr_nemotron_h_shard_ep(w, 1, 2, err, sizeof err)
                                    : tsr_nemotron_h_shard_tp(w, 1, 2, err, sizeof err), TSR_OK);
                assert_int_equal(tsr_nemotron_h_use_bf16(w), TSR_OK);
                assert_int_equal(tsr_nemotron_h_resident_bytes(w), tsr_nemotron_h_resident_bytes(m));
                tsr_nemotron_h_free(&w);
                tsr_nemotron_h_free(&m);
        }
        tsr_backend_free(&fast);
        free(ref);
        free(got);
}

/* --dtype float32 on the BF16 folder: every weight widened, float32 math; within the bar. */
static void test_bf16_upcast(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));
        char err[512] = "";
        tsr_nemotron_h *m = NULL;

        (void)state;
        assert_int_equal(tsr_nemotron_h_load(bf16_dir, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err),
                         TSR_OK);
        assert_false(tsr_nemotron_h_is_bf16(m));
        full_fidelity("BF16 checkpoint upcast to float32", m, want, got);
        tsr_nemotron_h_free(&m);
        free(want);
        free(got);
}

/* --dtype bfloat16 on a float32 checkpoint rounds the linears as a BF16 checkpoint stores
 * them: the rounded_dir copy (float32 file, linears unrounded, the rest bf16-valued)
 * converted gives bitwise the BF16 copy's logits.  On the fixture itself (norms, conv,
 * A_log, D, dt_bias and the embedding unrounded) the argmax bar holds; the cosine bar
 * is not asserted there: one row (the fourth prompt's 7th position) is at cosine 0.897,
 * max |dlogit| 0.99, every other row above 0.9997, a jump of the kind a flipped expert
 * choice in the last MoE layer makes (this random model has many routing near-ties:
 * make_tiny_nemotron_h.py). */
static void test_bf16_downcast(void **state) {
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));
        float *ref = malloc(rows * vocab * sizeof(float));
        char path[1024], err[512] = "";
        tsr_nemotron_h *m = NULL;
        fidelity f;

        (void)state;
        assert_int_equal(tsr_nemotron_h_load(rounded_dir, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        assert_int_equal(tsr_nemotron_h_resident_bytes(m), tsr_nemotron_h_resident_bytes(model16));
        full_rows(m, be, NULL, 0, got);
        full_rows(model16, be, NULL, 0, ref);
        assert_memory_equal(got, ref, rows * vocab * sizeof(float));
        tsr_nemotron_h_free(&m);
        assert_non_null(tsr_test_src_path(FIXTURE "/model", path, sizeof path));
        assert_int_equal(tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        f = full_fidelity(NULL, m, want, got);
        print_message("float32 checkpoint as bfloat16: worst per-position cosine %.6f, top-1 %zu/%zu, max |dlogit| "
                      "%.3g\n", f.worst_cos, f.agree, f.rows, (double)f.max_diff);
        assert_true((double)f.agree >= BF16_MIN_TOP1 * (double)f.rows);
        tsr_nemotron_h_free(&m);
        free(want);
        free(got);
        free(ref);
}

/* An F16 checkpoint (COPY_F16) loads, widened exactly: in float32 within the bar (f16's
 * 11-bit significand rounds less than bf16's 8; seen 0.999998), and with bf16 linears. */
static void test_f16_checkpoint(void **state) {
        char dir[] = "/tmp/tsr_nh_f16_XXXXXX", src[1024], err[512] = "";
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));
        tsr_nemotron_h *m = NULL;
        tsr_load_stats st = {0};

        (void)state;
        assert_non_null(tsr_test_src_path(FIXTURE "/model", src, sizeof src));
        assert_non_null(mkdtemp(dir));
        assert_int_equal(write_copy(src, dir, COPY_F16), 0);
        assert_int_equal(tsr_nemotron_h_load(dir, NULL, NULL, NULL, NULL, NULL, &m, &st, err, sizeof err), TSR_OK);
        assert_int_equal(st.file_bytes, stats16.file_bytes);    /* 2 bytes an element, as BF16 */
        full_fidelity("F16 checkpoint in float32", m, want, got);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        full_fidelity("F16 checkpoint with bf16 linears", m, want, got);
        tsr_nemotron_h_free(&m);
        remove_copy(dir);
        free(want);
        free(got);
}

/* residual_in_fp32 true: the bf16 model's residual stream stays float32 (transformers
 * adds in float32 then): other logits than the default's bf16 stream, within the bar. */
static void test_bf16_residual_in_fp32(void **state) {
        char dir[] = "/tmp/tsr_nh_res_XXXXXX", path[1200], src[1200], err[512] = "";
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits(&n_rows), *got = malloc(rows * vocab * sizeof(float));
        float *ref = malloc(rows * vocab * sizeof(float));
        tsr_nemotron_h *m = NULL;
        json_error_t je;
        json_t *cfg;

        (void)state;
        assert_non_null(mkdtemp(dir));
        snprintf(src, sizeof src, "%s/model.safetensors", bf16_dir);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        assert_int_equal(symlink(src, path), 0);
        snprintf(src, sizeof src, "%s/config.json", bf16_dir);
        assert_non_null(cfg = json_load_file(src, 0, &je));
        json_object_set_new(cfg, "residual_in_fp32", json_true());
        snprintf(path, sizeof path, "%s/config.json", dir);
        assert_int_equal(json_dump_file(cfg, path, 0), 0);
        json_decref(cfg);
        assert_int_equal(tsr_nemotron_h_load(dir, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err), TSR_OK);
        assert_true(tsr_nemotron_h_config_of(m)->residual_in_fp32);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        full_fidelity("bf16, residual_in_fp32", m, want, got);
        full_rows(model16, be, NULL, 0, ref);
        assert_memory_not_equal(got, ref, rows * vocab * sizeof(float));
        tsr_nemotron_h_free(&m);
        remove_copy(dir);
        free(want);
        free(got);
        free(ref);
}

/* ---- ModelOpt FP8 (issue #15) ------------------------------------------------------ */

/* tests/fixtures/tiny-nemotron-h-fp8 (make_tiny_nemotron_h_fp8.py): this fixture in
 * ModelOpt's FP8 layout with the Nano FP8 recipe (routed and shared experts, the dense
 * MLP and the Mamba layer 3's in/out_proj quantized; attention, Mamba layer 0, conv,
 * router, embeddings and lm_head bf16), against a torch emulation of vLLM's W8A8 math.
 *
 * The bound against the emulation, as test_quant_modelopt.c derives it for the Llama:
 * both compute the same quantized products and differ only in the order of the float32
 * sums (2 n u sum|terms| per output, n <= 64 here), which can also move an activation
 * across an fp8 rounding boundary in the next quantized linear (a jump of ~1e-2 if it
 * happened).  The fixture measures how far the sum order alone moves its logits
 * (`order_sensitivity`, float64 accumulation: 7.2e-7), so the bound is 1e-4 + 50 x that. */
#define FP8_FIXTURE "tests/fixtures/tiny-nemotron-h-fp8"
/* The same model exported as NVFP4 (make_tiny_nemotron_h_nvfp4.py: the same recipe, the
 * dense MLP kept bf16 as its 40 columns are not whole blocks of 16), against the W4A4
 * emulation; load, logits, greedy, batch invariance and the fast backend run on it too
 * (setup_nvfp4), within the same bound (its order sensitivity: 0). */
#define NVFP4_FIXTURE "tests/fixtures/tiny-nemotron-h-nvfp4"
/* The recipe on a wider model whose quantized linears split into whole NVFP4 blocks
 * under tensor parallelism (make_wide_nemotron_h_nvfp4.py; test_parallel.c splits it):
 * logits, greedy and the fast backend against its own emulation here. */
#define WIDE_NVFP4_FIXTURE "tests/fixtures/wide-nemotron-h-nvfp4"

static const char *quant_fixture = FP8_FIXTURE;  /* the one the setup loaded */
static json_t *golden8;
static tsr_nemotron_h *model8;
static tsr_load_stats stats8;
static tsr_modelopt_config mo8;

static int setup_quant(const char *fixture) {
        char path[1024], rel[256], err[512] = "";
        json_error_t je;

        quant_fixture = fixture;
        snprintf(rel, sizeof rel, "%s/golden.json", fixture);
        if (!tsr_test_src_path(rel, path, sizeof path) || !(golden8 = json_load_file(path, 0, &je)) ||
            (snprintf(rel, sizeof rel, "%s/model", fixture), !tsr_test_src_path(rel, path, sizeof path)) ||
            tsr_modelopt_config_read(path, &mo8, err, sizeof err) != TSR_OK ||
            tsr_nemotron_h_load(path, NULL, NULL, &(tsr_load_opts){.modelopt = &mo8}, NULL, NULL, &model8, &stats8,
                                err, sizeof err) != TSR_OK) {
                fprintf(stderr, "%s: %s\n", fixture, err);
                return -1;
        }
        return 0;
}

static int setup_fp8(void **state) {
        (void)state;
        return setup_quant(FP8_FIXTURE);
}

static int setup_nvfp4(void **state) {
        (void)state;
        return setup_quant(NVFP4_FIXTURE);
}

static int setup_wide_nvfp4(void **state) {
        (void)state;
        return setup_quant(WIDE_NVFP4_FIXTURE);
}

static int teardown_fp8(void **state) {
        (void)state;
        tsr_nemotron_h_free(&model8);
        tsr_modelopt_config_done(&mo8);
        json_decref(golden8);
        return 0;
}

/* What the load keeps of the fixture's file, by its own arithmetic: an F8_E4M3 weight
 * one byte an element, an NVFP4 one (U8, two codes a byte) 9 bytes per 16 elements,
 * every other tensor the model reads widened to float32, the scale tensors held inside
 * their weights (not counted); *bf16_linears: the elements of the linears stored BF16
 * (what --dtype bfloat16 converts). */
static uint64_t fp8_expected_resident(uint64_t *bf16_linears) {
        char path[1024], err[256];
        tsr_safetensors *st = NULL;
        uint64_t bytes = 0;
        static const char *const scales[] = {".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale",
                                             ".v_scale"};

        *bf16_linears = 0;
        char rel[256];
        snprintf(rel, sizeof rel, "%s/model/model.safetensors", quant_fixture);
        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
        assert_int_equal(tsr_safetensors_open(path, &st, err, sizeof err), TSR_OK);
        for (size_t i = 0; i < tsr_safetensors_n_tensors(st); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_tensor_at(st, i);
                bool scale = false;
                for (size_t k = 0; k < sizeof scales / sizeof scales[0]; k++)
                        scale = scale || (strlen(t->name) > strlen(scales[k]) &&
                                          strcmp(t->name + strlen(t->name) - strlen(scales[k]), scales[k]) == 0);
                if (scale)
                        continue;
                bytes += t->dtype == TSR_ST_F8_E4M3 ? t->n_elements
                         : t->dtype == TSR_ST_U8    ? t->n_elements * 2 / 16 * 9
                                                    : t->n_elements * 4;
                if (t->dtype == TSR_ST_BF16 && is_linear(t->name))
                        *bf16_linears += t->n_elements;
        }
        tsr_safetensors_close(&st);
        return bytes;
}

static void test_fp8_load(void **state) {
        uint64_t bf16_lin, want = fp8_expected_resident(&bf16_lin);

        (void)state;
        assert_int_equal(mo8.algo, strstr(quant_fixture, "nvfp4") ? TSR_MODELOPT_NVFP4 : TSR_MODELOPT_FP8);
        assert_int_equal(stats8.resident_bytes, want);
        assert_int_equal(tsr_nemotron_h_resident_bytes(model8), want);
        assert_true(want < stats32.resident_bytes);
        assert_int_equal(tsr_nemotron_h_check_backend(model8, be), TSR_OK);
        print_message("%s resident: %.1f KB (float32 fixture %.1f KB), %zu tensors\n", quant_fixture,
                      (double)want / 1e3, (double)stats32.resident_bytes / 1e3, stats8.n_tensors);
}

/* Prompts 0 and 1 (the rows the fixture keeps) against the emulation; the same rows
 * from prefill in pieces at chunk multiples bitwise the full sequences', from decode
 * steps within the emulation's bound of them. */
static void test_fp8_logits(void **state) {
        size_t n_rows, rows = prompt_rows();
        char rel[256];
        snprintf(rel, sizeof rel, "%s/logits.f32", quant_fixture);
        float *want = load_logits_at(rel, &n_rows);
        float *full = malloc(rows * vocab * sizeof(float)), *chunked = malloc(rows * vocab * sizeof(float));
        float *dec = malloc(rows * vocab * sizeof(float));
        double bound = 1e-4 + 50 * json_real_value(json_object_get(golden8, "order_sensitivity"));

        (void)state;
        assert_true(n_rows <= rows);
        full_rows(model8, be, NULL, 0, full);
        float worst = compare_rows(full, want, n_rows);
        print_message("%s vs its emulation: max |dlogit| %.3g over %zu rows (bound %.3g)\n", quant_fixture,
                      (double)worst, n_rows, bound);
        assert_true(worst <= bound);
        full_rows(model8, be, aligned_chunks, N_ALIGNED_CHUNKS, chunked);
        assert_memory_equal(chunked, full, rows * vocab * sizeof(float));
        /* the last prompt's last rows: their prefill stops inside a chunk the whole prompt
         * scans in the chunked form, so the same to rounding, not to the bit */
        size_t steps = decode_rows(model8, be, dec);
        float dec_worst = compare_rows(dec, full + (rows - steps) * vocab, steps);
        print_message("%s decode steps vs the full rows: max |dlogit| %.3g\n", quant_fixture, (double)dec_worst);
        assert_true(dec_worst <= bound);
        free(want);
        free(full);
        free(chunked);
        free(dec);
}

static void test_fp8_greedy(void **state) {
        size_t n_prompts = json_array_size(json_object_get(golden8, "prompts"));
        uint32_t got[64];

        (void)state;
        assert_int_equal(n_prompts, 4);
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *g = json_array_get(json_object_get(golden8, "greedy"), p);
                assert_int_equal(json_array_size(g), 32);
                greedy_on(model8, p, json_array_size(g), got);
                for (size_t i = 0; i < json_array_size(g); i++)
                        assert_int_equal(got[i], json_integer_value(json_array_get(g, i)));
        }
}

static void test_fp8_batch_invariance(void **state) {
        (void)state;
        check_batch_invariance(model8);
}

/* The fast CPU backend (its fp8 kernel, kernels/cpu/fpmm.c) bitwise the reference, chunked. */
static void test_fp8_fast_backend(void **state) {
        size_t rows = prompt_rows();
        float *ref = malloc(rows * vocab * sizeof(float)), *got = malloc(rows * vocab * sizeof(float));
        tsr_backend *fast = NULL;

        (void)state;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2, .max_isa = TSR_CPU_ISA_AVX2},
                                             &fast),
                         TSR_OK);
        full_rows(model8, be, NULL, 0, ref);
        full_rows(model8, fast, aligned_chunks, N_ALIGNED_CHUNKS, got);
        assert_memory_equal(got, ref, rows * vocab * sizeof(float));
        tsr_backend_free(&fast);
        free(ref);
        free(got);
}

/* --dtype bfloat16 on the FP8 checkpoint: the fp8 linears stay as stored, the bf16 ones
 * (attention, Mamba layer 0, lm_head) go to bf16 (resident bytes exact), and the
 * residual stream is held in bf16 as vLLM's.  Against the float32 emulation this is
 * further off than issue #14's bf16 bar (cosine 0.999, top-1 99%) allows: every bf16
 * rounding before a quantized linear can move an activation across an fp8 boundary (a
 * jump of up to 1/16 of it) and a routing near-tie with it; measured: worst cosine
 * 0.9966, top-1 29/31, max |dlogit| 0.18.  Held to cosine 0.99 and top-1 90%. */
static void test_fp8_bf16(void **state) {
        uint64_t bf16_lin, want = fp8_expected_resident(&bf16_lin);
        size_t n_rows, rows = prompt_rows();
        float *emu = load_logits_at(FP8_FIXTURE "/logits.f32", &n_rows), *got = malloc(rows * vocab * sizeof(float));
        char path[1024], err[512] = "";
        tsr_nemotron_h *m = NULL;
        fidelity f = {0};

        (void)state;
        assert_non_null(tsr_test_src_path(FP8_FIXTURE "/model", path, sizeof path));
        assert_int_equal(tsr_nemotron_h_load(path, NULL, NULL, &(tsr_load_opts){.modelopt = &mo8}, NULL, NULL, &m, NULL,
                                             err, sizeof err),
                         TSR_OK);
        assert_int_equal(tsr_nemotron_h_use_bf16(m), TSR_OK);
        assert_int_equal(tsr_nemotron_h_resident_bytes(m), want - 2 * bf16_lin);
        full_rows(m, be, NULL, 0, got);
        fidelity_add(&f, got, emu, n_rows);
        print_message("fp8 with bf16 linears vs the float32 emulation: worst cosine %.6f, top-1 %zu/%zu, max |dlogit| "
                      "%.3g\n", f.worst_cos, f.agree, f.rows, (double)f.max_diff);
        assert_true(f.rows == n_rows && f.worst_cos >= 0.99 && (double)f.agree >= 0.9 * (double)f.rows);
        tsr_nemotron_h_free(&m);
        free(emu);
        free(got);
}

/* One edit of the FP8 fixture's safetensors header (the data section is copied as is):
 * rename tensor `name` to `rename`, or give it `dtype` and `shape` (same byte count), or
 * (append) add a zero-filled BF16 tensor `name` of `shape` after the data, renaming the
 * old one away. */
typedef struct st_edit {
        const char *name, *rename, *dtype, *shape;
        bool append;
} st_edit;

/* dir/: the FP8 fixture's model with `edit` applied (NULL: none) and config.json's
 * quantization_config merged with `qc_patch` (JSON text; NULL: none).  0 on success. */
static int write_fp8_variant(const char *dir, const st_edit *edit, const char *qc_patch) {
        char src[1024], path[1200];
        json_error_t je;
        json_t *cfg = NULL, *hdr = NULL;
        uint8_t *buf = NULL;
        uint64_t hlen = 0, size, extra = 0;
        FILE *f = NULL;
        int rc = -1;

        if (!tsr_test_src_path(FP8_FIXTURE "/model/config.json", src, sizeof src) ||
            !(cfg = json_load_file(src, 0, &je)))
                goto done;
        if (qc_patch) {
                json_t *p = json_loads(qc_patch, 0, &je);
                if (!p || json_object_update(json_object_get(cfg, "quantization_config"), p) != 0) {
                        json_decref(p);
                        goto done;
                }
                json_decref(p);
        }
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (json_dump_file(cfg, path, 0) != 0 ||
            !tsr_test_src_path(FP8_FIXTURE "/model/model.safetensors", src, sizeof src) || !(f = fopen(src, "rb")) ||
            fseek(f, 0, SEEK_END) != 0 || (size = (uint64_t)ftell(f)) < 8 || fseek(f, 0, SEEK_SET) != 0 ||
            !(buf = malloc(size)) || fread(buf, 1, size, f) != size)
                goto done;
        fclose(f);
        f = NULL;
        memcpy(&hlen, buf, 8);                          /* little-endian host */
        if (!(hdr = json_loadb((const char *)buf + 8, hlen, 0, &je)))
                goto done;
        if (edit) {
                json_t *e = json_object_get(hdr, edit->name);
                if (!e)
                        goto done;
                if (edit->append) {
                        json_t *shape = json_loads(edit->shape, 0, &je);
                        uint64_t n = 1, at = size - 8 - hlen;
                        for (size_t i = 0; i < json_array_size(shape); i++)
                                n *= (uint64_t)json_integer_value(json_array_get(shape, i));
                        extra = 2 * n;
                        json_object_set(hdr, "unused.moved_away", e);
                        json_object_set_new(hdr, edit->name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", "BF16",
                                                                       "shape", shape, "data_offsets", (json_int_t)at,
                                                                       (json_int_t)(at + extra)));
                } else if (edit->rename) {
                        json_object_set(hdr, edit->rename, e);
                        json_object_del(hdr, edit->name);
                } else {
                        json_object_set_new(e, "dtype", json_string(edit->dtype));
                        json_object_set_new(e, "shape", json_loads(edit->shape, 0, &je));
                }
        }
        char *text = json_dumps(hdr, JSON_COMPACT);
        uint64_t nlen = (strlen(text) + 7) / 8 * 8;
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if ((f = fopen(path, "wb"))) {
                fwrite(&nlen, 8, 1, f);
                fprintf(f, "%-*s", (int)nlen, text);
                fwrite(buf + 8 + hlen, 1, size - 8 - hlen, f);
                for (uint64_t i = 0; i < extra; i++)
                        fputc(0, f);
                rc = fclose(f) == 0 ? 0 : -1;
                f = NULL;
        }
        free(text);
done:
        if (f)
                fclose(f);
        free(buf);
        json_decref(hdr);
        json_decref(cfg);
        return rc;
}

/* Bad FP8 checkpoints, each refused naming the file and the tensor. */
static void test_fp8_bad_checkpoints(void **state) {
        static const struct {
                st_edit edit;
                const char *qc_patch;
                tsr_status st;
                const char *needle;
        } bad[] = {
                {{"backbone.layers.1.mixer.experts.3.up_proj.input_scale", "x.input_scale", NULL, NULL, false}, NULL,
                 TSR_E_INVAL, "tensor 'backbone.layers.1.mixer.experts.3.up_proj.input_scale' missing"},
                {{"backbone.layers.3.mixer.in_proj.weight_scale", NULL, "U8", "[4]", false}, NULL, TSR_E_INVAL,
                 "tensor 'backbone.layers.3.mixer.in_proj.weight_scale': dtype U8, 1 dims, 4 elements; expected a F32 "
                 "scalar"},
                {{"backbone.layers.1.mixer.gate.weight", NULL, "F8_E4M3", "[8, 256]", false}, NULL, TSR_E_UNSUPPORTED,
                 "tensor 'backbone.layers.1.mixer.gate.weight': dtype F8_E4M3: this model reads the tensor as float32 "
                 "only"},
                {{"backbone.layers.5.mixer.experts.6.down_proj.weight", NULL, NULL, "[64, 32]", true}, NULL,
                 TSR_E_INVAL, "tensor 'backbone.layers.5.mixer.experts.6.down_proj.weight' is not quantized but "
                 "expert 0's is F8_E4M3"},
                {{NULL, NULL, NULL, NULL, false}, "{\"ignore\": [\"lm_head\", \"backbone.layers.3.mixer.in_proj\"]}",
                 TSR_E_INVAL, "tensor 'backbone.layers.3.mixer.in_proj.weight' is F8_E4M3 but"},
                {{NULL, NULL, NULL, NULL, false}, "{\"quant_algo\": \"NVFP4\"}", TSR_E_INVAL,
                 "tensor 'backbone.layers.1.mixer.shared_experts.up_proj.weight': dtype F8_E4M3, which does not "
                 "match the announced quant_algo (NVFP4)"},
        };
        char dir[] = "/tmp/tsr_nh_fp8_XXXXXX", path[1024], err[512];
        tsr_modelopt_config mo;
        tsr_nemotron_h *m = NULL;

        (void)state;
        assert_non_null(mkdtemp(dir));
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                assert_int_equal(write_fp8_variant(dir, bad[i].edit.name ? &bad[i].edit : NULL, bad[i].qc_patch), 0);
                err[0] = 0;
                assert_int_equal(tsr_modelopt_config_read(dir, &mo, err, sizeof err), TSR_OK);
                tsr_status st = tsr_nemotron_h_load(dir, NULL, NULL, &(tsr_load_opts){.modelopt = &mo}, NULL, NULL, &m,
                                                    NULL, err, sizeof err);
                tsr_modelopt_config_done(&mo);
                if (st != bad[i].st || !strstr(err, bad[i].needle) || !strstr(err, dir))
                        fail_msg("case %zu: status %d (want %d), message '%s' (want '%s' and the folder)", i, (int)st,
                                 (int)bad[i].st, err, bad[i].needle);
                assert_null(m);
        }
        remove_copy(dir);
        /* the fixture read without its config's quantization: an F8_E4M3 tensor nobody announced */
        assert_non_null(tsr_test_src_path(FP8_FIXTURE "/model", path, sizeof path));
        assert_int_equal(tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err),
                         TSR_E_INVAL);
        assert_non_null(strstr(err, "dtype F8_E4M3, which the checkpoint's config does not announce"));
        assert_non_null(strstr(err, "model.safetensors"));
}

/* llama.cpp's converter's F16 GGUF of the fixture (nemotron_h_moe;
 * tests/fixtures/make_tiny_nemotron_h_gguf.py): the config from its metadata and tensors
 * equals the one config.json gives (the '-' layer's kind from its tensors), its 43 tensors
 * load (A as stored, the expert stacks split), every position within TOL of transformers'
 * logits of the same F16-rounded weights, and the greedy continuations equal up to the
 * first step whose margin is under 1e-4 (one step of prompt 0 has 6e-6).  Tensor and
 * expert parallelism of the file: tests/e2e/test_nemotron_h.py test_gguf_served. */
static void test_gguf(void **state) {
        char path[1024], rel[512], err[512] = "";
        json_error_t je;
        json_t *g = NULL;
        tsr_gguf *gf = NULL;
        tsr_nemotron_h_config c;
        tsr_nemotron_h *m = NULL;
        tsr_load_stats st = {0};
        (void)state;

        assert_non_null(tsr_test_src_path(GGUF_FIXTURE "/golden.json", path, sizeof path));
        assert_non_null(g = json_load_file(path, 0, &je));
        snprintf(rel, sizeof rel, GGUF_FIXTURE "/%s", json_string_value(json_object_get(g, "gguf")));
        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
        if (tsr_gguf_open(path, &gf, err, sizeof err) != TSR_OK ||
            tsr_nemotron_h_config_from_gguf(gf, path, &c, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        tsr_gguf_close(&gf);
        const tsr_nemotron_h_config *h = tsr_nemotron_h_config_of(model);
        assert_true(c.gguf && !h->gguf);
        assert_string_equal(c.pattern, h->pattern);
#define SAME(f) assert_true(c.f == h->f)
        SAME(vocab_size), SAME(dim), SAME(n_layers), SAME(n_heads), SAME(n_kv_heads), SAME(head_dim);
        SAME(m_heads), SAME(m_head_dim), SAME(ssm_state), SAME(n_groups), SAME(conv_kernel), SAME(conv_bias);
        SAME(dt_min), SAME(dt_max), SAME(n_experts), SAME(top_k), SAME(moe_hidden), SAME(shared_hidden);
        SAME(n_group), SAME(topk_group), SAME(norm_topk_prob), SAME(routed_scale), SAME(mlp_hidden), SAME(eps);
        SAME(tied_embeddings), SAME(residual_in_fp32);
#undef SAME
        if (tsr_nemotron_h_load(path, &c, NULL, NULL, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        /* 2 model-wide + output_norm + 2 Mamba x 9 + attention x 5 + 2 MoE x 7 + MLP x 3 */
        assert_int_equal(st.n_tensors, 43);

        size_t n_rows, rows = prompt_rows();
        snprintf(rel, sizeof rel, GGUF_FIXTURE "/%s", json_string_value(json_object_get(g, "logits_file")));
        float *want = load_logits_at(rel, &n_rows), *got = malloc(rows * vocab * sizeof(float));
        assert_int_equal(n_rows, rows);
        full_rows(m, be, NULL, 0, got);
        float worst = compare_rows(got, want, rows);
        size_t n_prompts = json_array_size(json_object_get(g, "prompts")), checked = 0, total = 0;
        uint32_t toks[64];
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *gw = json_array_get(json_object_get(g, "greedy"), p);
                json_t *mg = json_array_get(json_object_get(g, "greedy_margin"), p);
                assert_true(json_array_size(gw) <= 64);
                greedy_on(m, p, json_array_size(gw), toks);
                for (size_t i = 0; i < json_array_size(gw); i++, checked++) {
                        if (json_number_value(json_array_get(mg, i)) < 1e-4)
                                break;  /* a near-tie: past it the continuation may fork */
                        assert_int_equal(toks[i], json_integer_value(json_array_get(gw, i)));
                }
                total += json_array_size(gw);
        }
        print_message("tiny-nemotron-h-gguf (F16): max |dlogit| vs transformers %.3g over %zu rows (TOL %.0e); "
                      "greedy %zu/%zu tokens equal before a near-tie\n", (double)worst, rows, (double)TOL, checked,
                      total);
        assert_true(worst <= TOL);
        assert_true(checked >= total - 9);
        tsr_nemotron_h_free(&m);
        free(want);
        free(got);
        json_decref(g);
}

/* The config of a tiny dense NemotronH GGUF by llama.cpp's converter (general.architecture
 * "nemotron_h"), with the sizes its fixture scripts share asserted: hidden 64, 4 heads /
 * 2 KV heads of 16, Mamba 8 heads of 8 with a 16 state and a kernel of 4 (bias), MLP 40,
 * no experts, eps 1e-5, no dt limit, untied. */
static void read_dense_gguf(const char *path, tsr_nemotron_h_config *c) {
        char err[512] = "";
        tsr_gguf *gf = NULL;
        const char *as;
        size_t alen;
        if (tsr_gguf_open(path, &gf, err, sizeof err) != TSR_OK ||
            tsr_nemotron_h_config_from_gguf(gf, path, c, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        const tsr_gguf_kv *arch = tsr_gguf_find_kv(gf, "general.architecture");
        assert_non_null(arch);
        assert_int_equal(tsr_gguf_get_str(&arch->value, &as, &alen), TSR_OK);
        assert_true(alen == 10 && memcmp(as, "nemotron_h", 10) == 0);
        tsr_gguf_close(&gf);
        assert_true(c->gguf);
        assert_int_equal(c->dim, 64);
        assert_int_equal(c->n_heads, 4);
        assert_int_equal(c->n_kv_heads, 2);
        assert_int_equal(c->head_dim, 16);
        assert_int_equal(c->m_heads, 8);
        assert_int_equal(c->m_head_dim, 8);
        assert_int_equal(c->ssm_state, 16);
        assert_int_equal(c->conv_kernel, 4);
        assert_true(c->conv_bias);
        assert_int_equal(c->mlp_hidden, 40);
        assert_int_equal(c->n_experts, 0);
        assert_true(c->eps == 1e-5f);
        assert_true(c->dt_min == 0.0f && isinf(c->dt_max));
        assert_false(c->tied_embeddings);
}

/* A GGUF fixture's model m against its goldens: the prompts of `g` (golden.json), every
 * position within TOL of logits file `logits_rel`, and the greedy continuations of `gold`
 * ("greedy", "greedy_margin") equal up to each prompt's first margin under `tie`.  The
 * file-global golden / model are this fixture's meanwhile (full_rows and greedy_on read
 * them).  Prints and checks; *checked / *total: greedy tokens compared / recorded. */
static void check_gguf_goldens(tsr_nemotron_h *m, json_t *g, json_t *gold, const char *logits_rel, const char *what,
                               double tie, size_t *checked, size_t *total) {
        json_t *keep_golden = golden;
        tsr_nemotron_h *keep_model = model;
        golden = g;
        model = m;
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits_at(logits_rel, &n_rows), *got = malloc(rows * vocab * sizeof(float));
        assert_int_equal(n_rows, rows);
        full_rows(m, be, NULL, 0, got);
        float worst = compare_rows(got, want, rows);
        size_t n_prompts = json_array_size(json_object_get(g, "prompts"));
        uint32_t toks[64];
        *checked = *total = 0;
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *gw = json_array_get(json_object_get(gold, "greedy"), p);
                json_t *mg = json_array_get(json_object_get(gold, "greedy_margin"), p);
                assert_true(json_array_size(gw) <= 64);
                assert_int_equal(json_array_size(mg), json_array_size(gw));
                greedy_on(m, p, json_array_size(gw), toks);
                for (size_t k = 0; k < json_array_size(gw) && json_number_value(json_array_get(mg, k)) >= tie;
                     k++, (*checked)++)
                        if (toks[k] != json_integer_value(json_array_get(gw, k)))
                                fail_msg("%s prompt %zu greedy step %zu: %u, transformers %lld", what, p, k, toks[k],
                                         (long long)json_integer_value(json_array_get(gw, k)));
                *total += json_array_size(gw);
        }
        golden = keep_golden;
        model = keep_model;
        print_message("%s: max |dlogit| vs transformers %.3g over %zu rows (TOL %.0e); greedy %zu/%zu tokens equal "
                      "before a near-tie (margin < %.0e)\n", what, (double)worst, rows, (double)TOL, *checked, *total,
                      tie);
        assert_true(worst <= TOL);
        assert_true(*checked >= *total * 3 / 4);        /* a fixture whose near-ties come early tests little */
        free(want);
        free(got);
}

/* llama.cpp's converter's F16 GGUF of a tiny random dense NemotronH (general.architecture
 * "nemotron_h": no MoE layer, so no expert key or tensor; the Mamba tensors through
 * Mamba2's rules; tests/fixtures/make_tiny_nemotron_h_dense_gguf.py, pattern "M*M-M-",
 * n_groups 2): the config from its metadata and tensors (each layer's kind from its
 * tensors, the MLP width from ffn_up, no experts), its 41 tensors load, the family's
 * description and KV groups (one attention layer, three Mamba states), every position
 * of its four prompts within TOL of transformers' logits of the same F16-rounded weights,
 * and the greedy continuations (the decode path) equal up to each prompt's first step
 * whose recorded margin is under 1e-3: measured 2026-11-27 max |dlogit| 4.6e-6, the
 * smallest margin 0.0065, so all 128 tokens. */
#define DENSE_FIXTURE "tests/fixtures/tiny-nemotron-h-dense-gguf"
#define DENSE_TIE 1e-3
static void test_gguf_dense(void **state) {
        char path[1024], rel[512], err[512] = "";
        json_error_t je;
        json_t *g = NULL;
        tsr_nemotron_h_config c;
        tsr_nemotron_h *m = NULL;
        tsr_load_stats st = {0};
        tsr_model_desc d;
        tsr_shard_spec sh;
        tsr_kv_group kg[TSR_KV_GROUPS_MAX];
        (void)state;

        assert_non_null(tsr_test_src_path(DENSE_FIXTURE "/golden.json", path, sizeof path));
        assert_non_null(g = json_load_file(path, 0, &je));
        snprintf(rel, sizeof rel, DENSE_FIXTURE "/%s", json_string_value(json_object_get(g, "gguf")));
        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
        read_dense_gguf(path, &c);
        /* the sizes make_tiny_nemotron_h_dense_gguf.py builds (read_dense_gguf: the shared ones) */
        assert_string_equal(c.pattern, "M*M-M-");
        assert_string_equal(c.pattern, json_string_value(json_object_get(g, "pattern")));
        assert_int_equal(c.n_layers, 6);
        assert_int_equal(c.vocab_size, 300);
        assert_int_equal(c.n_groups, 2);
        assert_int_equal(c.top_k, 0);
        assert_int_equal(c.moe_hidden, 0);
        assert_false(c.residual_in_fp32);
        if (tsr_nemotron_h_load(path, &c, NULL, NULL, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        /* 2 model-wide + output_norm + 3 Mamba x 9 + attention x 5 + 2 MLP x 3 */
        assert_int_equal(st.n_tensors, 41);

        /* the family's description, as the runner reads it: one KV group of the attention
         * layer, one of the three Mamba layers' states */
        const tsr_model_family *f = &tsr_family_nemotron_h;
        assert_int_equal(tsr_model_desc_read(f, path, true, &d, err, sizeof err), TSR_OK);
        assert_int_equal(d.n_layers, 6);
        assert_int_equal(d.vocab_size, 300);
        assert_int_equal(d.hidden_size, 64);
        assert_int_equal(f->shard_for(&d, 0, 1, 0, 1, &sh), TSR_OK);
        assert_int_equal(f->kv_groups(&d, &sh, kg, TSR_KV_GROUPS_MAX), 2);
        assert_int_equal(kg[0].kind, TSR_KV_FULL_ATTENTION);
        assert_int_equal(kg[0].n_layers, 1);
        assert_int_equal(kg[1].kind, TSR_KV_MAMBA_STATE);
        assert_int_equal(kg[1].n_layers, 3);
        tsr_model_desc_done(&d);

        assert_int_equal(json_integer_value(json_object_get(g, "vocab_size")), vocab);
        size_t checked, total;
        snprintf(rel, sizeof rel, DENSE_FIXTURE "/%s", json_string_value(json_object_get(g, "logits_file")));
        check_gguf_goldens(m, g, g, rel, "tiny-nemotron-h-dense-gguf (F16, nemotron_h)", DENSE_TIE, &checked, &total);
        assert_int_equal(total, 4 * 32);
        tsr_nemotron_h_free(&m);
        json_decref(g);
}

/* One Mamba group (n_groups 1: tests/fixtures/tiny-nemotron-h-g1, make_tiny_nemotron_h_g1.py,
 * pattern "M*M-"), whose gated RMSNorm spans every channel: the norm's sum of squares
 * is taken as R7's canonical partials (8 fixed channel slices summed in one tree, so
 * -tp 2 and 4 give the same bits: tests/unit/test_parallel.c test_nemotron_h_tp_one_group);
 * here every position of its prompts and the decode path within TOL of transformers,
 * prefill in chunks bitwise the whole, and the greedy continuations equal. */
#define G1_FIXTURE "tests/fixtures/tiny-nemotron-h-g1"
static void test_one_group(void **state) {
        char path[1024], err[512] = "";
        json_error_t je;
        json_t *g = NULL, *keep_golden = golden;
        tsr_nemotron_h *m = NULL, *keep_model = model;
        (void)state;

        assert_non_null(tsr_test_src_path(G1_FIXTURE "/golden.json", path, sizeof path));
        assert_non_null(g = json_load_file(path, 0, &je));
        assert_non_null(tsr_test_src_path(G1_FIXTURE "/model", path, sizeof path));
        if (tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, NULL, &m, NULL, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(m);
        assert_int_equal(c->n_groups, 1);
        assert_int_equal(c->vocab_size, vocab);
        golden = g;
        model = m;
        size_t n_rows, rows = prompt_rows();
        float *want = load_logits_at(G1_FIXTURE "/logits.f32", &n_rows), *got = malloc(n_rows * vocab * sizeof(float));
        float *chunked = malloc(rows * vocab * sizeof(float));
        full_rows(m, be, NULL, 0, got);
        float worst = compare_rows(got, want, rows);
        full_rows(m, be, aligned_chunks, N_ALIGNED_CHUNKS, chunked);
        assert_memory_equal(chunked, got, rows * vocab * sizeof(float));
        size_t steps = decode_rows(m, be, got);
        assert_int_equal(n_rows, rows + steps);
        float worst_dec = compare_rows(got, want + rows * vocab, steps);
        size_t n_prompts = json_array_size(json_object_get(g, "prompts")), n_greedy = 0;
        uint32_t toks[64];
        for (size_t p = 0; p < n_prompts; p++) {
                json_t *gw = json_array_get(json_object_get(g, "greedy"), p);
                assert_true(json_array_size(gw) <= 64);
                greedy_on(m, p, json_array_size(gw), toks);
                for (size_t i = 0; i < json_array_size(gw); i++, n_greedy++)
                        assert_int_equal(toks[i], json_integer_value(json_array_get(gw, i)));
        }
        golden = keep_golden;
        model = keep_model;
        print_message("tiny-nemotron-h-g1 (n_groups 1): max |dlogit| %.3g over %zu rows, decode %.3g over %zu steps; "
                      "%zu greedy tokens equal\n", (double)worst, rows, (double)worst_dec, steps, n_greedy);
        assert_true(worst <= TOL);
        assert_true(worst_dec <= TOL);
        tsr_nemotron_h_free(&m);
        free(want);
        free(got);
        free(chunked);
        json_decref(g);
}

/* tests/fixtures/tiny-nemotron-h-g1/model-f16.gguf: the one-group model above through
 * llama.cpp's converter (--outtype f16, general.architecture "nemotron_h"), whose gated
 * norms are (groups, d_inner / groups) = (1, 64) rows (test_parallel.c
 * test_nemotron_h_tp_one_group_gguf reads them by columns at -tp N): the config from its
 * metadata and tensors (n_groups 1, "M*M-", the MLP width from ffn_up, no experts), its 29
 * tensors load, every position of its prompts within TOL of transformers' logits of the
 * same F16-rounded weights (golden.json "gguf"), and the greedy continuations equal up to
 * each prompt's first recorded margin under 1e-3 (the smallest recorded is 0.0047: all 96). */
#define G1_TIE 1e-3
static void test_one_group_gguf(void **state) {
        char path[1024], rel[512], err[512] = "";
        json_error_t je;
        json_t *g = NULL, *gg;
        tsr_nemotron_h_config c;
        tsr_nemotron_h *m = NULL;
        tsr_load_stats st = {0};
        (void)state;

        assert_non_null(tsr_test_src_path(G1_FIXTURE "/golden.json", path, sizeof path));
        assert_non_null(g = json_load_file(path, 0, &je));
        assert_non_null(gg = json_object_get(g, "gguf"));
        snprintf(rel, sizeof rel, G1_FIXTURE "/%s", json_string_value(json_object_get(gg, "file")));
        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
        read_dense_gguf(path, &c);
        /* make_tiny_nemotron_h_g1.py's sizes (read_dense_gguf: the shared ones) */
        assert_int_equal(c.n_groups, 1);
        assert_string_equal(c.pattern, "M*M-");
        assert_string_equal(c.pattern, json_string_value(json_object_get(g, "pattern")));
        assert_int_equal(c.n_layers, 4);
        assert_int_equal(c.vocab_size, vocab);
        if (tsr_nemotron_h_load(path, &c, NULL, NULL, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        /* 2 model-wide + output_norm + 2 Mamba x 9 + attention x 5 + MLP x 3 */
        assert_int_equal(st.n_tensors, 29);
        assert_int_equal(tsr_nemotron_h_config_of(m)->n_groups, 1);

        size_t checked, total, n_prompts = json_array_size(json_object_get(g, "prompts"));
        snprintf(rel, sizeof rel, G1_FIXTURE "/%s", json_string_value(json_object_get(gg, "logits_file")));
        check_gguf_goldens(m, g, gg, rel, "tiny-nemotron-h-g1 (F16 GGUF, n_groups 1)", G1_TIE, &checked, &total);
        assert_int_equal(total, n_prompts * 32);
        tsr_nemotron_h_free(&m);
        json_decref(g);
}

/* ---- on a device backend (issue #16) ------------------------------------------------------- */

#define DEV_SLOTS 6

/* One scripted run on h (the host, cpu-ref, its own cache) and on d (moved to cpu-devlike,
 * a pool in its memory) with the logits compared bitwise at every step: three prompts
 * prefilled in pieces (a whole aligned chunk of 8 in the chunked form, shorter ones by
 * the recurrence), a prefix save at position 8 into slot 3 and a fourth sequence
 * restoring it, then decode steps of all four batched.  Returns the rows compared. */
static size_t device_vs_host(tsr_nemotron_h *h, tsr_nemotron_h *d, tsr_backend *dl, const json_t *g) {
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(h);
        tsr_kv_group groups[TSR_KV_GROUPS_MAX];
        size_t ng = tsr_nemotron_h_kv_groups(c, 0, c->n_layers - 1, 1, groups, TSR_KV_GROUPS_MAX), rows = 0;
        size_t np = json_array_size(json_object_get(g, "prompts")), len[4], done[4] = {0, 0, 0, 8};
        uint32_t ids[4][128], table[4][SEQ_BLOCKS];
        size_t V = c->vocab_size;
        float *a = malloc(4 * 128 * V * sizeof(float)), *b = malloc(4 * 128 * V * sizeof(float));
        tsr_kv_pool *hp = NULL, *dp = NULL;
        tsr_nemotron_h_cache *hc = NULL, *dc = NULL;
        char err[512] = "";

        assert_true(a && b && np >= 3);
        if (tsr_nemotron_h_to_backend(d, dl, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        assert_int_equal(tsr_nemotron_h_check_backend(d, dl), TSR_OK);
        assert_int_equal(tsr_nemotron_h_check_backend(d, be), TSR_E_UNSUPPORTED);     /* its weights moved */
        assert_int_equal(tsr_nemotron_h_check_backend(h, dl), TSR_E_UNSUPPORTED);     /* its did not */
        assert_int_equal(tsr_nemotron_h_use_bf16(d), TSR_E_INVAL);
        assert_int_equal(tsr_nemotron_h_to_backend(d, dl, err, sizeof err), TSR_E_INVAL);
        tsr_nemotron_h_cache *host_cache = NULL;        /* host arrays for a device model: refused */
        assert_int_equal(tsr_nemotron_h_cache_new(d, 4, BLOCK, 1, &host_cache), TSR_E_INVAL);
        /* activations kept for 4 tokens: the longer steps below grow them */
        assert_int_equal(tsr_nemotron_h_reserve(d, 4, 1), TSR_OK);
        assert_int_equal(tsr_nemotron_h_reserve(h, 4, 1), TSR_OK);     /* nothing on the host */
        assert_int_equal(tsr_kv_pool_new_slots(groups, ng, 4 * SEQ_BLOCKS, BLOCK, DEV_SLOTS, &hp), TSR_OK);
        assert_int_equal(tsr_kv_pool_new_on(dl, groups, ng, 4 * SEQ_BLOCKS, BLOCK, DEV_SLOTS, &dp), TSR_OK);
        assert_int_equal(tsr_nemotron_h_cache_bind(h, hp, &hc), TSR_OK);
        assert_int_equal(tsr_nemotron_h_cache_bind(d, dp, &dc), TSR_OK);
        for (size_t k = 0; k < 4; k++) {
                len[k] = tsr_test_prompt_ids(g, k < 3 ? k : 2, ids[k], 128);
                table_of(k, table[k]);
        }
        memcpy(table[3], table[2], 8 / BLOCK * sizeof(uint32_t));      /* the prefix's KV blocks, shared */
        const tsr_state_save save = {.pos = 8, .slot = 3};
        /* tokens per step of each sequence (0: not in the step); step 3 on: decode */
        static const size_t plan[6][4] = {{8, 5, 16, 0}, {9, 1, 3, 4}, {3, 7, 1, 5}, {1, 1, 1, 1}, {1, 1, 1, 1},
                                          {1, 1, 1, 1}};
        for (size_t k = 0; k < 6; k++) {
                tsr_nemotron_h_seq q[4];
                size_t nq = 0, n_rows = 0;
                for (size_t i = 0; i < 4; i++) {
                        size_t n = plan[k][i], left = len[i] - done[i];
                        n = n < left ? n : left;
                        if (!n)
                                continue;
                        bool last = k >= 3;
                        q[nq++] = (tsr_nemotron_h_seq){
                                .block_table = table[i], .n_table = SEQ_BLOCKS, .tokens = ids[i] + done[i], .n = n,
                                .past_len = done[i], .slot = (uint32_t)(i < 3 ? i : 4),
                                .which = last ? TSR_LLAMA_LOGITS_LAST : TSR_LLAMA_LOGITS_ALL,
                                .saves = k == 0 && i == 2 ? &save : NULL, .n_saves = k == 0 && i == 2,
                                .restore = k == 1 && i == 3, .restore_from = 3, .chunked_end = len[i]};
                        n_rows += last ? 1 : n;
                        done[i] += n;
                }
                assert_int_equal(tsr_nemotron_h_forward_batch(h, be, hc, q, nq, a), TSR_OK);
                assert_int_equal(tsr_nemotron_h_forward_batch(d, dl, dc, q, nq, b), TSR_OK);
                assert_memory_equal(a, b, n_rows * V * sizeof(float));
                rows += n_rows;
        }
        tsr_nemotron_h_cache_free(&hc);
        tsr_nemotron_h_cache_free(&dc);
        tsr_kv_pool_free(&hp);
        tsr_kv_pool_free(&dp);
        free(a);
        free(b);
        return rows;
}

/* NemotronH on a device backend: the same family code, its weights, state slots, K/V and
 * activations in the device's memory, bitwise the host's logits on cpu-devlike for the
 * float32 fixture, bf16 weights (converted, and a BF16 checkpoint's kept as stored) and
 * both ModelOpt formats; a parallel layout and a one-group model are refused with a
 * message, the model unchanged. */
static void test_device(void **state) {
        char path[1024], rel[256], err[512] = "";
        tsr_backend *dl = NULL;
        (void)state;

        assert_int_equal(tsr_backend_cpu_devlike_new(&dl), TSR_OK);
        assert_non_null(tsr_test_src_path(FIXTURE "/model", path, sizeof path));
        const struct { const char *what, *dir; bool bf16, keep; } cases[] = {
                {"float32", path, false, false},
                {"bfloat16", path, true, false},
                {"a BF16 checkpoint kept as stored", bf16_dir, true, true},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                tsr_nemotron_h *h = NULL, *d = NULL;
                tsr_load_opts o = {.keep_bf16 = cases[i].keep};
                if (tsr_nemotron_h_load(cases[i].dir, NULL, NULL, &o, NULL, NULL, &h, NULL, err, sizeof err) != TSR_OK ||
                    tsr_nemotron_h_load(cases[i].dir, NULL, NULL, &o, NULL, NULL, &d, NULL, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                if (cases[i].bf16) {
                        assert_int_equal(tsr_nemotron_h_use_bf16(h), TSR_OK);
                        assert_int_equal(tsr_nemotron_h_use_bf16(d), TSR_OK);
                }
                print_message("tiny-nemotron-h %s on cpu-devlike: %zu logit rows bitwise the host's\n", cases[i].what,
                              device_vs_host(h, d, dl, golden));
                tsr_nemotron_h_free(&h);
                tsr_nemotron_h_free(&d);
        }
        /* ModelOpt FP8 and NVFP4: the stored bytes go as they are */
        static const char *const quant[] = {FP8_FIXTURE, NVFP4_FIXTURE};
        for (size_t i = 0; i < 2; i++) {
                tsr_modelopt_config mo;
                tsr_nemotron_h *h = NULL, *d = NULL;
                json_error_t je;
                json_t *g;
                snprintf(rel, sizeof rel, "%s/golden.json", quant[i]);
                assert_non_null(tsr_test_src_path(rel, path, sizeof path));
                assert_non_null(g = json_load_file(path, 0, &je));
                snprintf(rel, sizeof rel, "%s/model", quant[i]);
                assert_non_null(tsr_test_src_path(rel, path, sizeof path));
                if (tsr_modelopt_config_read(path, &mo, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                tsr_load_opts o = {.modelopt = &mo};
                if (tsr_nemotron_h_load(path, NULL, NULL, &o, NULL, NULL, &h, NULL, err, sizeof err) != TSR_OK ||
                    tsr_nemotron_h_load(path, NULL, NULL, &o, NULL, NULL, &d, NULL, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                print_message("%s on cpu-devlike: %zu logit rows bitwise the host's\n", quant[i],
                              device_vs_host(h, d, dl, g));
                tsr_nemotron_h_free(&h);
                tsr_nemotron_h_free(&d);
                tsr_modelopt_config_done(&mo);
                json_decref(g);
        }
        /* refused, the model left on the host: a tensor-parallel rank, one Mamba group */
        tsr_nemotron_h *r1 = NULL, *g1 = NULL;
        const tsr_nemotron_h_config *c = tsr_nemotron_h_config_of(model);
        assert_non_null(tsr_test_src_path(FIXTURE "/model", path, sizeof path));
        if (tsr_nemotron_h_load(path, NULL, &(tsr_shard_spec){1, 2, 0, c->n_layers - 1}, NULL, NULL, NULL, &r1, NULL,
                                err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        assert_int_equal(tsr_nemotron_h_to_backend(r1, dl, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "not supported yet"));
        assert_int_equal(tsr_nemotron_h_check_backend(r1, be), TSR_OK);
        assert_non_null(tsr_test_src_path(G1_FIXTURE "/model", path, sizeof path));
        if (tsr_nemotron_h_load(path, NULL, NULL, NULL, NULL, NULL, &g1, NULL, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        assert_int_equal(tsr_nemotron_h_to_backend(g1, dl, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "n_groups 1"));
        assert_int_equal(tsr_nemotron_h_check_backend(g1, be), TSR_OK);
        /* the family says so from the config alone (--device auto then takes the CPU) */
        for (int k = 0; k < 2; k++) {
                tsr_model_desc desc = {0};
                assert_non_null(tsr_test_src_path(k ? G1_FIXTURE "/model" : FIXTURE "/model", path, sizeof path));
                if (tsr_model_desc_read(&tsr_family_nemotron_h, path, false, &desc, err, sizeof err) != TSR_OK)
                        fail_msg("%s", err);
                const char *why = tsr_family_nemotron_h.device_refusal(&desc);
                if (k)
                        assert_non_null(why && strstr(why, "n_groups 1"));
                else
                        assert_null(why);
                tsr_model_desc_done(&desc);
        }
        /* and a host backend: nothing to move */
        assert_int_equal(tsr_nemotron_h_to_backend(g1, be, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_nemotron_h_check_backend(g1, be), TSR_OK);
        tsr_nemotron_h_free(&r1);
        tsr_nemotron_h_free(&g1);
        tsr_backend_free(&dl);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_config),
                cmocka_unit_test(test_full_logits),
                cmocka_unit_test(test_decode_steps),
                cmocka_unit_test(test_chunked_prefill),
                cmocka_unit_test(test_state_restore_and_save),
                cmocka_unit_test(test_chunked_scan),
                cmocka_unit_test(test_greedy),
                cmocka_unit_test(test_batch_invariance),
                cmocka_unit_test(test_threads_bitwise),
                cmocka_unit_test(test_pool_bind),
                cmocka_unit_test(test_pool_fp8_kv),
                cmocka_unit_test(test_bad_args),
                cmocka_unit_test(test_config_errors),
                cmocka_unit_test(test_config_bare_infinity),
                cmocka_unit_test(test_family),
                cmocka_unit_test(test_bf16_load),
                cmocka_unit_test(test_bf16_fidelity),
                cmocka_unit_test(test_bf16_greedy),
                cmocka_unit_test(test_bf16_batch_invariance),
                cmocka_unit_test(test_bf16_fast_backend),
                cmocka_unit_test(test_bf16_kept_as_stored),
                cmocka_unit_test(test_bf16_upcast),
                cmocka_unit_test(test_device),
                cmocka_unit_test(test_bf16_downcast),
                cmocka_unit_test(test_bf16_residual_in_fp32),
                cmocka_unit_test(test_f16_checkpoint),
                cmocka_unit_test(test_gguf),
                cmocka_unit_test(test_gguf_dense),
                cmocka_unit_test(test_one_group),
                cmocka_unit_test(test_one_group_gguf),
                cmocka_unit_test_setup_teardown(test_fp8_load, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_logits, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_greedy, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_batch_invariance, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_fast_backend, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_bf16, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_bad_checkpoints, setup_fp8, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_load, setup_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_logits, setup_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_greedy, setup_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_batch_invariance, setup_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_fast_backend, setup_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_logits, setup_wide_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_greedy, setup_wide_nvfp4, teardown_fp8),
                cmocka_unit_test_setup_teardown(test_fp8_fast_backend, setup_wide_nvfp4, teardown_fp8),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
