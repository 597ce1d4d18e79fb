/* test_util.h - small helpers the model tests share (header-only: each test is its own
 * executable). */
#ifndef TSR_TEST_UTIL_H
#define TSR_TEST_UTIL_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

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

/* The first index of the largest of x[0..n) (n >= 1): greedy decoding's choice. */
static inline size_t tsr_test_argmax(const float *x, size_t n) {
        size_t best = 0;
        for (size_t i = 1; i < n; i++)
                if (x[i] > x[best])
                        best = i;
        return best;
}

#endif
