/* router placement: the hash set behind the prefix-cache mirror, the mirror's event
 * and gap rules, and the routers.md §6.4 cost and its tie-breaks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "router/hashset.h"
#include "router/worker_link.h"

static void test_hashset_basic(void **state) {
        tsr_hashset s;
        tsr_hashset_init(&s, 0);
        assert_false(tsr_hashset_has(&s, 1));
        assert_false(tsr_hashset_remove(&s, 1));
        assert_int_equal(tsr_hashset_add(&s, 0), TSR_OK);   /* 0 is a member like any other */
        assert_int_equal(tsr_hashset_add(&s, 42), TSR_OK);
        assert_int_equal(tsr_hashset_add(&s, 42), TSR_OK);
        assert_int_equal(tsr_hashset_size(&s), 2);
        assert_true(tsr_hashset_has(&s, 0));
        assert_true(tsr_hashset_has(&s, 42));
        assert_true(tsr_hashset_remove(&s, 0));
        assert_false(tsr_hashset_has(&s, 0));
        assert_int_equal(tsr_hashset_size(&s), 1);
        tsr_hashset_clear(&s);
        assert_false(tsr_hashset_has(&s, 42));
        assert_int_equal(tsr_hashset_size(&s), 0);
        tsr_hashset_done(&s);
        tsr_hashset_done(&s);   /* twice is harmless */
}

/* Many inserts and deletes against a plain bitmap model: backward-shift deletion
 * must keep every remaining member findable. */
static void test_hashset_churn(void **state) {
        enum { N = 4096 };
        static bool model[N];
        tsr_hashset s;
        uint64_t x = 12345;
        tsr_hashset_init(&s, 0);
        memset(model, 0, sizeof(model));
        for (int step = 0; step < 200000; step++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                /* small keys collide in their home slots: exercises the probe runs */
                uint64_t k = (x >> 33) % N;
                if ((x >> 20) & 1) {
                        assert_int_equal(tsr_hashset_add(&s, k * 1024), TSR_OK);
                        model[k] = true;
                } else {
                        assert_int_equal(tsr_hashset_remove(&s, k * 1024), model[k]);
                        model[k] = false;
                }
        }
        size_t n = 0;
        for (uint64_t k = 0; k < N; k++) {
                assert_int_equal(tsr_hashset_has(&s, k * 1024), model[k]);
                n += model[k];
        }
        assert_int_equal(tsr_hashset_size(&s), n);
        tsr_hashset_done(&s);
}

static void test_hashset_cap(void **state) {
        tsr_hashset s;
        tsr_hashset_init(&s, 3);
        assert_int_equal(tsr_hashset_add(&s, 1), TSR_OK);
        assert_int_equal(tsr_hashset_add(&s, 2), TSR_OK);
        assert_int_equal(tsr_hashset_add(&s, 3), TSR_OK);
        assert_int_equal(tsr_hashset_add(&s, 4), TSR_E_LIMIT);
        assert_int_equal(tsr_hashset_add(&s, 3), TSR_OK);   /* present: not an insert */
        assert_true(tsr_hashset_remove(&s, 1));
        assert_int_equal(tsr_hashset_add(&s, 4), TSR_OK);
        assert_int_equal(tsr_hashset_size(&s), 3);
        tsr_hashset_done(&s);
}

/* A Status with one event. */
typedef struct fake_status {
        Tessera__V1__Status st;
        Tessera__V1__BlockHashEvent ev, *evp;
} fake_status;

static Tessera__V1__Status *mk(fake_status *f, uint64_t epoch, uint64_t seq, int kind, uint64_t *hashes,
                               size_t n) {
        tessera__v1__status__init(&f->st);
        tessera__v1__block_hash_event__init(&f->ev);
        f->st.boot_epoch = epoch;
        f->st.seq = seq;
        f->st.kv_blocks_total = 1000;
        if (kind >= 0) {
                f->ev.kind = kind;
                f->ev.block_hashes = hashes;
                f->ev.n_block_hashes = n;
                f->evp = &f->ev;
                f->st.events = &f->evp;
                f->st.n_events = 1;
        }
        return &f->st;
}

static void test_mirror_events_and_gaps(void **state) {
        tsr_prefix_mirror m;
        fake_status f;
        uint64_t chain[] = {11, 12, 13, 14}, rm[] = {13}, other[] = {99};
        uint64_t query[] = {11, 12, 13, 14, 15};

        tsr_prefix_mirror_init(&m);
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        /* the first Status seen may have any seq: nothing to compare with */
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 40, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 4);
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 2), 2);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 41, TESSERA__V1__BLOCK_HASH_EVENT__KIND__REMOVED, rm, 1)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 2);   /* stops at the first miss */
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 42, -1, NULL, 0)));   /* heartbeat */
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 2);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 43, TESSERA__V1__BLOCK_HASH_EVENT__KIND__ALL_CLEARED,
                                                    NULL, 0)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 44, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 4);
        /* seq 45 lost: the mirror cannot be trusted, start over; this Status's own
         * events still apply */
        assert_true(tsr_prefix_mirror_apply(&m, mk(&f, 7, 46, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, other, 1)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_int_equal(tsr_prefix_mirror_hits(&m, other, 1), 1);
        assert_int_equal(m.resets, 1);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 47, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        /* restarted worker: new epoch, seq from 1 */
        assert_true(tsr_prefix_mirror_apply(&m, mk(&f, 8, 1, -1, NULL, 0)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_int_equal(tsr_prefix_mirror_hits(&m, other, 1), 0);
        assert_int_equal(m.resets, 2);
        tsr_prefix_mirror_done(&m);
}

static tsr_placement_cand cand(size_t blocks, size_t hits, uint64_t wpt, uint32_t running, uint32_t waiting,
                               int inflight) {
        tsr_placement_cand c = {.blocks = blocks, .hits = hits, .waiting_prompt_tokens = wpt, .block_size = 16,
                                .num_running = running, .num_waiting = waiting, .inflight = inflight};
        return c;
}

static void test_cost(void **state) {
        tsr_placement_cand c = cand(10, 4, 32, 1, 2, 3);
        assert_true(tsr_placement_cost(&c) == 6.0 + 2.0 + 6.0);
        c = cand(10, 12, 0, 0, 0, -5);   /* hits past B and a negative in-flight count clamp */
        assert_true(tsr_placement_cost(&c) == 0.0);
        c = cand(3, 0, 10, 0, 0, 0);
        c.block_size = 0;                /* unknown block size counts as 1 */
        assert_true(tsr_placement_cost(&c) == 13.0);
}

static void test_pick(void **state) {
        tsr_placement_cand c[3] = {0};
        assert_int_equal(tsr_placement_pick(c, 0), (size_t)-1);
        /* the worker holding the prefix wins while its extra load is below the saving */
        c[0] = cand(20, 0, 0, 0, 0, 0);
        c[1] = cand(20, 18, 0, 2, 1, 1);
        c[2] = cand(20, 5, 0, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 3), 1);
        /* ... and loses once it is busier than the prefill it saves */
        c[1] = cand(20, 18, 0, 10, 10, 0);
        assert_int_equal(tsr_placement_pick(c, 3), 2);
        /* queued prefill counts in blocks */
        c[2] = cand(20, 5, 16 * 100, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 3), 0);
        /* equal cost: lower load wins (cost 5 = 5 blocks, or 3 blocks + 2 requests) */
        c[0] = cand(5, 0, 0, 0, 0, 0);
        c[1] = cand(5, 2, 0, 1, 1, 0);
        c[2] = cand(5, 0, 0, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 2), 0);
        c[0] = cand(5, 2, 0, 1, 1, 0);
        c[1] = cand(5, 0, 0, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 2), 1);
        /* full tie: the first listed (the caller rotates the order) */
        assert_int_equal(tsr_placement_pick(&c[1], 2), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_hashset_basic),
                cmocka_unit_test(test_hashset_churn),
                cmocka_unit_test(test_hashset_cap),
                cmocka_unit_test(test_mirror_events_and_gaps),
                cmocka_unit_test(test_cost),
                cmocka_unit_test(test_pick),
        };
        return cmocka_run_group_tests_name("placement", tests, NULL, NULL);
}
