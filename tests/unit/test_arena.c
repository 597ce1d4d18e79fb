/* common/arena: alignment, growth, caps, cleanups (LIFO), reset and free. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "common/arena.h"

static void test_alloc_aligned_and_distinct(void **state) {
        tsr_arena *a = tsr_arena_new(64, 0);
        assert_non_null(a);
        char *p = tsr_arena_alloc(a, 1), *q = tsr_arena_alloc(a, 3), *r = tsr_arena_alloc(a, 0);
        assert_non_null(p);
        assert_non_null(q);
        assert_non_null(r);
        assert_int_equal((uintptr_t)p % 16, 0);
        assert_int_equal((uintptr_t)q % 16, 0);
        assert_int_equal((uintptr_t)r % 16, 0);
        assert_true(q >= p + 16 || p >= q + 16);
        tsr_arena_free(&a);
        assert_null(a);
        tsr_arena_free(&a);   /* NULL is fine */
}

static void test_big_alloc_gets_own_chunk(void **state) {
        tsr_arena *a = tsr_arena_new(64, 0);
        unsigned char *big = tsr_arena_alloc(a, 100000);
        assert_non_null(big);
        memset(big, 0xab, 100000);      /* ASan catches a short chunk */
        char *s = tsr_arena_strdup(a, "after the big one");
        assert_string_equal(s, "after the big one");
        assert_int_equal(big[99999], 0xab);
        tsr_arena_free(&a);
}

static void test_limit(void **state) {
        tsr_arena *a = tsr_arena_new(256, 100);
        assert_non_null(tsr_arena_alloc(a, 64));
        assert_false(tsr_arena_over_limit(a));
        assert_null(tsr_arena_alloc(a, 64));   /* 64 + 64 > 100 */
        assert_true(tsr_arena_over_limit(a));
        assert_null(tsr_arena_alloc(a, SIZE_MAX));
        tsr_arena_reset(a);
        assert_false(tsr_arena_over_limit(a));
        assert_int_equal(tsr_arena_used(a), 0);
        assert_non_null(tsr_arena_alloc(a, 96));
        tsr_arena_free(&a);
}

static void test_strings_and_calloc(void **state) {
        tsr_arena *a = tsr_arena_new(0, 0);
        char *s = tsr_arena_strndup(a, "hello world", 5);
        assert_string_equal(s, "hello");
        int *z = tsr_arena_calloc(a, 100, sizeof(int));
        for (int i = 0; i < 100; i++)
                assert_int_equal(z[i], 0);
        assert_null(tsr_arena_calloc(a, SIZE_MAX / 2, 4));   /* overflow refused */
        const unsigned char bytes[3] = {1, 0, 2};
        unsigned char *d = tsr_arena_memdup(a, bytes, 3);
        assert_memory_equal(d, bytes, 3);
        tsr_arena_free(&a);
}

static int order[8];
static int n_order;
static void record(void *data) { order[n_order++] = (int)(intptr_t)data; }

static void test_cleanups_lifo_on_reset_and_free(void **state) {
        tsr_arena *a = tsr_arena_new(32, 0);
        n_order = 0;
        assert_int_equal(tsr_arena_add_cleanup(a, record, (void *)1), TSR_OK);
        assert_int_equal(tsr_arena_add_cleanup(a, record, (void *)2), TSR_OK);
        assert_int_equal(tsr_arena_add_cleanup(a, record, (void *)3), TSR_OK);
        tsr_arena_reset(a);
        assert_int_equal(n_order, 3);
        assert_int_equal(order[0], 3);
        assert_int_equal(order[1], 2);
        assert_int_equal(order[2], 1);
        assert_int_equal(tsr_arena_add_cleanup(a, record, (void *)9), TSR_OK);
        tsr_arena_free(&a);
        assert_int_equal(n_order, 4);
        assert_int_equal(order[3], 9);
}

static void test_cleanup_over_limit(void **state) {
        tsr_arena *a = tsr_arena_new(32, 16);
        assert_non_null(tsr_arena_alloc(a, 16));
        assert_int_equal(tsr_arena_add_cleanup(a, record, NULL), TSR_E_LIMIT);
        tsr_arena_free(&a);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_alloc_aligned_and_distinct),
                cmocka_unit_test(test_big_alloc_gets_own_chunk),
                cmocka_unit_test(test_limit),
                cmocka_unit_test(test_strings_and_calloc),
                cmocka_unit_test(test_cleanups_lifo_on_reset_and_free),
                cmocka_unit_test(test_cleanup_over_limit),
        };
        return cmocka_run_group_tests_name("arena", tests, NULL, NULL);
}
