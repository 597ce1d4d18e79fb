/* test_cudagraph.c - the decode batch sizes the worker records as CUDA graphs
 * (worker/model/cudagraph.h) from vLLM's --compilation-config, --enforce-eager and
 * --max-num-seqs: vLLM's default list (1, 2, 4, multiples of 8 below 256, multiples of 16
 * from 256) capped at Tessera's default 32 unless asked otherwise, cut after the first
 * size holding max_num_seqs; the keys read, the keys with no effect, and the refusals. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/cudagraph.h"

static tsr_cudagraph_sizes sz;
static char err[512];

static tsr_status sizes_for(const char *json, bool eager, uint32_t max_num_seqs) {
        err[0] = 0;
        return tsr_cudagraph_sizes_for(json, eager, max_num_seqs, &sz, err, sizeof err);
}

static void expect(const uint32_t *want, size_t n) {
        assert_int_equal(sz.n, n);
        for (size_t i = 0; i < n; i++)
                assert_int_equal(sz.sizes[i], want[i]);
}

static void test_default_is_vllms_list_capped_at_32(void **state) {
        (void)state;
        const uint32_t want[] = {1, 2, 4, 8, 16, 24, 32};
        assert_int_equal(sizes_for(NULL, false, 256), TSR_OK);
        expect(want, 7);
        assert_int_equal(sizes_for("{}", false, 1024), TSR_OK);
        expect(want, 7);
        assert_false(sz.compile_keys);
}

static void test_default_cut_after_the_size_holding_max_num_seqs(void **state) {
        (void)state;
        const uint32_t three[] = {1, 2, 4}, one[] = {1}, twenty[] = {1, 2, 4, 8, 16, 24};
        assert_int_equal(sizes_for(NULL, false, 3), TSR_OK);    /* vLLM's max 6: 1, 2, 4 */
        expect(three, 3);
        assert_int_equal(sizes_for(NULL, false, 1), TSR_OK);    /* vLLM's max 2; 1 holds one */
        expect(one, 1);
        assert_int_equal(sizes_for(NULL, false, 20), TSR_OK);   /* 24 holds 20 */
        expect(twenty, 6);
}

static void test_max_size_restores_vllms_list(void **state) {
        (void)state;
        /* 1, 2, 4, 8 .. 248 (31 sizes), 256: cut at 256 = max_num_seqs */
        assert_int_equal(sizes_for("{\"max_cudagraph_capture_size\": 512}", false, 256), TSR_OK);
        assert_int_equal(sz.n, 3 + 31 + 1);
        assert_int_equal(sz.sizes[3], 8);
        assert_int_equal(sz.sizes[33], 248);
        assert_int_equal(sz.sizes[34], 256);
        assert_int_equal(sizes_for("{\"max_cudagraph_capture_size\": 512}", false, 1024), TSR_OK);
        assert_int_equal(sz.n, 3 + 31 + 17);    /* then 256, 272, ..., 512 */
        assert_int_equal(sz.sizes[sz.n - 1], 512);
        assert_int_equal(sz.sizes[sz.n - 2], 496);
}

static void test_given_sizes_sorted_without_repeats(void **state) {
        (void)state;
        const uint32_t want[] = {1, 4, 8}, capped[] = {1, 4}, cut[] = {1, 4, 8};
        assert_int_equal(sizes_for("{\"cudagraph_capture_sizes\": [8, 1, 4, 4]}", false, 256), TSR_OK);
        expect(want, 3);
        assert_int_equal(sizes_for("{\"cudagraph_capture_sizes\": [8, 1, 4], \"max_cudagraph_capture_size\": 4}", false,
                                   256),
                         TSR_OK);
        expect(capped, 2);
        /* 8 holds max_num_seqs 5: 64 and 128 would never run */
        assert_int_equal(sizes_for("{\"cudagraph_capture_sizes\": [128, 8, 64, 4, 1]}", false, 5), TSR_OK);
        expect(cut, 3);
}

static void test_off(void **state) {
        (void)state;
        assert_int_equal(sizes_for(NULL, true, 256), TSR_OK);
        assert_int_equal(sz.n, 0);
        assert_int_equal(sizes_for("{\"cudagraph_capture_sizes\": [1, 2]}", true, 256), TSR_OK);
        assert_int_equal(sz.n, 0);
        assert_int_equal(sizes_for("{\"cudagraph_mode\": \"NONE\"}", false, 256), TSR_OK);
        assert_int_equal(sz.n, 0);
        for (const char *m = "FULL\0FULL_DECODE_ONLY\0FULL_AND_PIECEWISE\0"; *m; m += strlen(m) + 1) {
                char json[96];
                snprintf(json, sizeof json, "{\"cudagraph_mode\": \"%s\"}", m);
                assert_int_equal(sizes_for(json, false, 256), TSR_OK);
                assert_int_equal(sz.n, 7);
        }
}

static void test_compile_keys_have_no_effect(void **state) {
        (void)state;
        assert_int_equal(sizes_for("{\"level\": 3, \"mode\": 3}", false, 256), TSR_OK);
        assert_true(sz.compile_keys);
        assert_int_equal(sz.n, 7);
}

static void test_refused(void **state) {
        (void)state;
        static const struct {
                const char *json, *msg;
        } bad[] = {
                {"{\"cudagraph_mode\": \"PIECEWISE\"}", "--compilation-config: cudagraph_mode PIECEWISE is not implemented"},
                {"{\"cudagraph_mode\": \"HALF\"}", "--compilation-config: cudagraph_mode 'HALF': expected NONE, FULL"},
                {"{\"cudagraph_mode\": 2}", "--compilation-config: cudagraph_mode must be a string"},
                {"{\"custom_ops\": [\"none\"]}", "--compilation-config: key 'custom_ops' is not implemented"},
                {"{\"cudagraph_capture_sizes\": [1, 0]}",
                 "--compilation-config: cudagraph_capture_sizes[1] is not a positive integer"},
                {"{\"cudagraph_capture_sizes\": [\"8\"]}",
                 "--compilation-config: cudagraph_capture_sizes[0] is not a positive integer"},
                {"{\"cudagraph_capture_sizes\": 8}", "--compilation-config: cudagraph_capture_sizes must be a list"},
                {"{\"max_cudagraph_capture_size\": -1}",
                 "--compilation-config: max_cudagraph_capture_size must be a positive integer"},
                {"[1, 2]", "--compilation-config: expected a JSON object"},
                {"{\"cudagraph_mode\": ", "--compilation-config: expected a JSON object"},
                {"{\"level\": 1, \"level\": 2}", "--compilation-config: expected a JSON object"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                assert_int_equal(sizes_for(bad[i].json, false, 256), TSR_E_INVAL);
                if (strncmp(err, bad[i].msg, strlen(bad[i].msg)) != 0)
                        fail_msg("%s: got '%s', want '%s...'", bad[i].json, err, bad[i].msg);
                assert_int_equal(sz.n, 0);
        }
        assert_int_equal(tsr_cudagraph_sizes_for(NULL, false, 0, &sz, err, sizeof err), TSR_E_INVAL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_default_is_vllms_list_capped_at_32),
                cmocka_unit_test(test_default_cut_after_the_size_holding_max_num_seqs),
                cmocka_unit_test(test_max_size_restores_vllms_list),
                cmocka_unit_test(test_given_sizes_sorted_without_repeats),
                cmocka_unit_test(test_off),
                cmocka_unit_test(test_compile_keys_have_no_effect),
                cmocka_unit_test(test_refused),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
