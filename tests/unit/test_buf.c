/* common/buf: the hard cap is never exceeded and a failed append changes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/buf.h"

static void test_append_and_terminate(void **state) {
        tsr_buf b;
        tsr_buf_init(&b, 1024);
        assert_int_equal(tsr_buf_append_str(&b, "abc"), TSR_OK);
        assert_int_equal(tsr_buf_append(&b, "\0def", 4), TSR_OK);
        assert_int_equal(b.len, 7);
        assert_memory_equal(b.data, "abc\0def", 7);
        assert_int_equal(b.data[7], 0);
        assert_int_equal(tsr_buf_appendf(&b, "-%d-%s", 42, "x"), TSR_OK);
        assert_int_equal(b.len, 12);
        assert_memory_equal(b.data + 7, "-42-x", 6);
        tsr_buf_done(&b);
        assert_null(b.data);
}

static void test_limit_exact_and_over(void **state) {
        tsr_buf b;
        tsr_buf_init(&b, 10);
        assert_int_equal(tsr_buf_append(&b, "0123456789", 10), TSR_OK);
        assert_int_equal(tsr_buf_append(&b, "x", 1), TSR_E_LIMIT);
        assert_int_equal(b.len, 10);
        assert_memory_equal(b.data, "0123456789", 10);
        assert_int_equal(tsr_buf_appendf(&b, "%s", "y"), TSR_E_LIMIT);
        assert_int_equal(b.len, 10);
        assert_int_equal(tsr_buf_reserve(&b, SIZE_MAX), TSR_E_LIMIT);
        tsr_buf_done(&b);
}

static void test_growth_many_small(void **state) {
        tsr_buf b;
        tsr_buf_init(&b, 1 << 20);
        for (int i = 0; i < 100000; i++)
                assert_int_equal(tsr_buf_append(&b, "ab", 2), TSR_OK);
        assert_int_equal(b.len, 200000);
        assert_true(b.alloc >= b.len + 1);
        assert_true(b.alloc <= (1 << 20) + 1);
        assert_int_equal(b.data[199999], 'b');
        tsr_buf_done(&b);
}

static void test_consume_reset_steal(void **state) {
        tsr_buf b;
        size_t n;
        tsr_buf_init(&b, 64);
        tsr_buf_append_str(&b, "hello world");
        tsr_buf_consume(&b, 6);
        assert_int_equal(b.len, 5);
        assert_string_equal((char *)b.data, "world");
        tsr_buf_consume(&b, 100);
        assert_int_equal(b.len, 0);
        tsr_buf_append_str(&b, "keep");
        uint8_t *p = tsr_buf_steal(&b, &n);
        assert_int_equal(n, 4);
        assert_memory_equal(p, "keep", 4);
        assert_null(b.data);
        assert_int_equal(b.len, 0);
        free(p);
        tsr_buf_reset(&b);   /* on an empty buffer */
        tsr_buf_done(&b);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_append_and_terminate),
                cmocka_unit_test(test_limit_exact_and_over),
                cmocka_unit_test(test_growth_many_small),
                cmocka_unit_test(test_consume_reset_steal),
        };
        return cmocka_run_group_tests_name("buf", tests, NULL, NULL);
}
