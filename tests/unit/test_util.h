/* test_util.h - small helpers the model tests share (header-only: each test is its own
 * executable).  Include after <cmocka.h>. */
#ifndef TSR_TEST_UTIL_H
#define TSR_TEST_UTIL_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
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
        snprintf(path, sizeof path, "%s/config.json", dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        unlink(path);
        rmdir(dir);
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
