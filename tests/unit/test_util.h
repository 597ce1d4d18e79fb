/* test_util.h - small helpers the model tests share (header-only: each test is its own
 * executable).  Include after <cmocka.h>. */
#ifndef TSR_TEST_UTIL_H
#define TSR_TEST_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

/* $TSR_SOURCE_ROOT/rel (meson sets it for every test) into buf, or NULL when unset or
 * when the file is not there. */
static inline const char *tsr_test_src_path(const char *rel, char *buf, size_t len) {
        const char *root = getenv("TSR_SOURCE_ROOT");
        struct stat sb;

        if (!root)
                return NULL;
        snprintf(buf, len, "%s/%s", root, rel);
        return stat(buf, &sb) == 0 ? buf : NULL;
}

/* Remove a model folder a test wrote (its config.json and model.safetensors, then the
 * folder itself); what is already gone is fine. */
static inline void tsr_test_remove_model_dir(const char *dir) {
        char path[1024];
        assert_true(snprintf(path, sizeof path, "%s/config.json", dir) < (int)sizeof path);
        unlink(path);
        assert_true(snprintf(path, sizeof path, "%s/model.safetensors", dir) < (int)sizeof path);
        unlink(path);
        rmdir(dir);
}

/* A safetensors file read whole: *header its parsed header, *data its data section
 * (inside the returned buffer, which the caller frees). */
static inline uint8_t *tsr_test_st_read(const char *path, json_t **header, const uint8_t **data) {
        json_error_t je;
        FILE *f;
        long n;
        uint64_t hl = 0;

        assert_non_null(f = fopen(path, "rb"));
        fseek(f, 0, SEEK_END);
        n = ftell(f);
        rewind(f);
        uint8_t *buf = malloc((size_t)n);
        assert_non_null(buf);
        assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
        fclose(f);
        for (int i = 0; i < 8; i++)
                hl |= (uint64_t)buf[i] << (8 * i);
        assert_non_null(*header = json_loadb((const char *)buf + 8, hl, 0, &je));
        *data = buf + 8 + hl;
        return buf;
}

/* A safetensors file of `header` (data_offsets into data) and the n bytes of `data`; the
 * data section starts 8-byte aligned. */
static inline void tsr_test_st_write(const char *path, const json_t *header, const void *data, size_t n) {
        char *hs = json_dumps(header, JSON_COMPACT);
        uint64_t nl = (strlen(hs) + 7) / 8 * 8;        /* padded with spaces, as the writers do */
        FILE *f;

        assert_non_null(f = fopen(path, "wb"));
        for (int i = 0; i < 8; i++)
                fputc((int)(nl >> (8 * i)) & 0xff, f);
        fprintf(f, "%-*s", (int)nl, hs);
        fwrite(data, 1, n, f);
        assert_int_equal(fclose(f), 0);
        free(hs);
}

/* A model folder's config.json copied into the new folder made from the template `dir`
 * (mkdtemp's "...XXXXXX", rewritten). */
static inline void tsr_test_model_dir_new(const char *src, char *dir) {
        char path[1024];
        json_error_t je;

        assert_non_null(mkdtemp(dir));
        assert_true(snprintf(path, sizeof path, "%s/config.json", src) < (int)sizeof path);
        json_t *cfg = json_load_file(path, 0, &je);
        assert_non_null(cfg);
        assert_true(snprintf(path, sizeof path, "%s/config.json", dir) < (int)sizeof path);
        assert_int_equal(json_dump_file(cfg, path, 0), 0);
        json_decref(cfg);
}

/* A BF16 checkpoint made from a float32 one: the folder `src` (config.json and one
 * model.safetensors) copied into a new folder from the template `dir`
 * (tsr_test_model_dir_new), every F32 tensor rounded to BF16 (nearest even; the values
 * are finite) and the others as they are.  Remove it with tsr_test_remove_model_dir. */
static inline void tsr_test_bf16_copy(const char *src, char *dir) {
        char path[1024];
        json_t *h, *v;
        const uint8_t *data;
        const char *key;
        uint64_t at = 0;

        tsr_test_model_dir_new(src, dir);
        assert_true(snprintf(path, sizeof path, "%s/model.safetensors", src) < (int)sizeof path);
        uint8_t *buf = tsr_test_st_read(path, &h, &data), *out = malloc(1);
        json_object_foreach(h, key, v) {
                json_t *off = json_object_get(v, "data_offsets");
                if (!off)       /* __metadata__ */
                        continue;
                uint64_t b0 = (uint64_t)json_integer_value(json_array_get(off, 0));
                uint64_t b1 = (uint64_t)json_integer_value(json_array_get(off, 1));
                bool f32 = strcmp(json_string_value(json_object_get(v, "dtype")), "F32") == 0;
                uint64_t n = f32 ? (b1 - b0) / 2 : b1 - b0;
                assert_non_null(out = realloc(out, at + n));
                for (uint64_t i = b0, o = at; f32 && i < b1; i += 4) {
                        uint32_t u;
                        memcpy(&u, data + i, 4);
                        u += 0x7fffu + ((u >> 16) & 1u);
                        out[o++] = (uint8_t)(u >> 16);
                        out[o++] = (uint8_t)(u >> 24);
                }
                if (!f32)
                        memcpy(out + at, data + b0, n);
                json_object_set_new(v, "data_offsets", json_pack("[I, I]", (json_int_t)at, (json_int_t)(at + n)));
                if (f32)
                        json_object_set_new(v, "dtype", json_string("BF16"));
                at += n;
        }
        assert_true(snprintf(path, sizeof path, "%s/model.safetensors", dir) < (int)sizeof path);
        tsr_test_st_write(path, h, out, at);
        free(buf);
        free(out);
        json_decref(h);
}

/* The first index of the largest of x[0..n) (n >= 1): greedy decoding's choice. */
static inline size_t tsr_test_argmax(const float *x, size_t n) {
        size_t best = 0;
        for (size_t i = 1; i < n; i++)
                if (x[i] > x[best])
                        best = i;
        return best;
}

/* A golden file's prompt pi as token ids: golden.prompts[pi].ids into ids[cap]; the
 * count (the case fails when it is 0 or over cap). */
static inline size_t tsr_test_prompt_ids(const json_t *golden, size_t pi, uint32_t *ids, size_t cap) {
        json_t *a = json_object_get(json_array_get(json_object_get(golden, "prompts"), pi), "ids");
        size_t n = json_array_size(a);

        assert_true(n > 0 && n <= cap);
        for (size_t i = 0; i < n; i++)
                ids[i] = (uint32_t)json_integer_value(json_array_get(a, i));
        return n;
}

#endif
