/* worker/engine/state_cache: a Mamba hybrid's state slots, held by running requests or
 * keeping the state after a block for prefix caching.  Free slots first (0 first), then
 * the least recently used kept state; pins for a scheduling round; a state kept twice
 * under one hash gives the second slot back; reset; the invariants after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "worker/engine/state_cache.h"

#define CHECK(sc) assert_int_equal(tsr_state_cache_check(sc), TSR_OK)

static tsr_state_stats stats(const tsr_state_cache *sc) {
        tsr_state_stats st;
        tsr_state_cache_stats(sc, &st);
        return st;
}

static void test_bad_sizes(void **state) {
        tsr_state_cache *sc = NULL;
        (void)state;
        assert_int_equal(tsr_state_cache_new(0, &sc), TSR_E_INVAL);
        assert_int_equal(tsr_state_cache_new(1u << 31, &sc), TSR_E_INVAL);
        assert_null(sc);
        tsr_state_cache_free(&sc);      /* NULL is fine */
}

/* Three slots: two requests hold 0 and 1; slot 2 keeps a state; a third request takes
 * it (evicting the kept state: it is gone); once every slot is held, nothing is left. */
static void test_take_free_first_then_evict(void **state) {
        tsr_state_cache *sc = NULL;
        uint32_t a, b, c, d, f;
        (void)state;
        assert_int_equal(tsr_state_cache_new(3, &sc), TSR_OK);
        assert_true(tsr_state_take(sc, 1, &a) && a == 0);
        assert_true(tsr_state_take(sc, 1, &b) && b == 1);
        assert_true(tsr_state_take(sc, 1, &c) && c == 2);
        tsr_state_store(sc, c, 0xabc);
        CHECK(sc);
        assert_true(tsr_state_has(sc, 0xabc));
        assert_int_equal(stats(sc).cached, 1);
        assert_int_equal(stats(sc).held, 2);
        assert_true(tsr_state_take(sc, 2, &d) && d == 2);       /* no free slot: the kept one */
        assert_false(tsr_state_has(sc, 0xabc));
        assert_false(tsr_state_find(sc, 0xabc, 2, &f));
        assert_int_equal(stats(sc).evictions, 1);
        assert_false(tsr_state_take(sc, 2, &f));
        CHECK(sc);
        tsr_state_give(sc, b);
        assert_true(tsr_state_take(sc, 2, &f) && f == 1);
        tsr_state_give(sc, a);
        tsr_state_give(sc, f);
        tsr_state_give(sc, d);
        tsr_state_give(sc, d);          /* not held any more: nothing */
        assert_int_equal(stats(sc).held, 0);
        CHECK(sc);
        tsr_state_cache_free(&sc);
        assert_null(sc);
}

/* Kept states go least recently used first; a find makes one the most recent, and pins
 * it for its round: a take in that round passes it over, one in the next round not. */
static void test_lru_and_pins(void **state) {
        tsr_state_cache *sc = NULL;
        uint32_t s[4], x, got;
        (void)state;
        assert_int_equal(tsr_state_cache_new(4, &sc), TSR_OK);
        for (uint32_t i = 0; i < 4; i++) {
                assert_true(tsr_state_take(sc, 1, &s[i]));
                tsr_state_store(sc, s[i], 100 + i);     /* kept in order 0, 1, 2, 3 */
        }
        CHECK(sc);
        assert_true(tsr_state_find(sc, 100, 7, &got) && got == s[0]);  /* 0 most recent, pinned in 7 */
        assert_true(tsr_state_take(sc, 7, &x) && x == s[1]);           /* the oldest is now 1 */
        assert_true(tsr_state_find(sc, 102, 7, &got) && got == s[2]);  /* pinned too: 3 then 0 then 2 */
        assert_true(tsr_state_take(sc, 7, &x) && x == s[3]);
        assert_false(tsr_state_take(sc, 7, &x));                       /* 0 and 2 pinned in 7 */
        assert_true(tsr_state_take(sc, 8, &x) && x == s[0]);           /* round 8: 0 is older */
        assert_true(tsr_state_has(sc, 102));
        CHECK(sc);
        tsr_state_cache_free(&sc);
}

/* The same hash kept twice (one prefix computed by two requests at once): the first
 * stays, the second slot is free again.  A reset frees every kept state. */
static void test_duplicate_and_reset(void **state) {
        tsr_state_cache *sc = NULL;
        uint32_t a, b, got;
        (void)state;
        assert_int_equal(tsr_state_cache_new(4, &sc), TSR_OK);
        assert_true(tsr_state_take(sc, 1, &a));
        assert_true(tsr_state_take(sc, 1, &b));
        tsr_state_store(sc, a, 7);
        tsr_state_store(sc, b, 7);
        assert_true(tsr_state_find(sc, 7, 1, &got) && got == a);
        assert_int_equal(stats(sc).cached, 1);
        assert_int_equal(stats(sc).held, 0);
        tsr_state_store(sc, b, 8);      /* b is free, not held: nothing */
        assert_false(tsr_state_has(sc, 8));
        CHECK(sc);
        /* many hashes in few buckets: the chains hold */
        for (uint32_t i = 0; i < 3; i++) {
                assert_true(tsr_state_take(sc, 2, &b));
                tsr_state_store(sc, b, (uint64_t)i << 40);
        }
        for (uint32_t i = 0; i < 3; i++)
                assert_true(tsr_state_has(sc, (uint64_t)i << 40));
        CHECK(sc);
        tsr_state_reset(sc);
        assert_int_equal(stats(sc).cached, 0);
        assert_int_equal(stats(sc).held, 0);
        assert_false(tsr_state_has(sc, 7));
        CHECK(sc);
        tsr_state_cache_free(&sc);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_bad_sizes),
                cmocka_unit_test(test_take_free_first_then_evict),
                cmocka_unit_test(test_lru_and_pins),
                cmocka_unit_test(test_duplicate_and_reset),
        };
        return cmocka_run_group_tests_name("state_cache", tests, NULL, NULL);
}
