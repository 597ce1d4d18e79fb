/* worker/kv_cache: block pool bookkeeping and prefix caching with vLLM V1 semantics.
 * Every test checks the cache's invariants (tsr_kv_cache_check) after each
 * operation; the last one is a seeded random stress over many requests that also
 * models the KV contents, so a prefix hit is proven to hand out the right tokens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "worker/engine/kv_cache.h"

#define CHECK(kv) assert_int_equal(tsr_kv_cache_check(kv), TSR_OK)
#define RCHECK(kv, r) assert_int_equal(tsr_kv_req_check((kv), (r)), TSR_OK)

static tsr_kv_cache *mk(uint32_t nb, uint32_t bs, bool caching) {
        tsr_kv_cache *kv = NULL;
        assert_int_equal(tsr_kv_cache_new(nb, bs, caching, TSR_BLOCK_HASH_XXHASH, &kv), TSR_OK);
        CHECK(kv);
        return kv;
}

static void fill(uint32_t *t, size_t n, uint32_t seed) {
        for (size_t i = 0; i < n; i++)
                t[i] = seed * 1000u + (uint32_t)i;
}

static tsr_kv_stats stats(const tsr_kv_cache *kv) {
        tsr_kv_stats s;
        tsr_kv_cache_stats(kv, &s);
        return s;
}

/* A whole prefill in one step: lookup, allocate the rest, commit everything.
 * Returns the cached token count. */
static size_t prefill(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *t, size_t n) {
        size_t cached = 99999;
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, r, t, n, false, &cached), TSR_OK);
        CHECK(kv);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, r, n - cached), TSR_OK);
        CHECK(kv);
        RCHECK(kv, r);
        assert_int_equal(r->n_computed, cached);
        assert_int_equal(tsr_kv_cache_commit(kv, r, t, n), TSR_OK);
        CHECK(kv);
        RCHECK(kv, r);
        return cached;
}

static tsr_kv_events *take(tsr_kv_cache *kv) {
        tsr_kv_events *e = (tsr_kv_events *)1;
        assert_int_equal(tsr_kv_cache_take_events(kv, &e), TSR_OK);
        CHECK(kv);
        return e;
}

static void drain(tsr_kv_cache *kv) {
        tsr_kv_events *e = take(kv);
        tsr_kv_events_free(&e);
}

static void test_new_invalid(void **state) {
        tsr_kv_cache *kv = (tsr_kv_cache *)&kv;
        assert_int_equal(tsr_kv_cache_new(0, 16, true, TSR_BLOCK_HASH_SHA256, &kv), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_new(8, 0, true, TSR_BLOCK_HASH_SHA256, &kv), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_new(8, 65537, true, TSR_BLOCK_HASH_SHA256, &kv), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_new(UINT32_C(1) << 31, 16, true, TSR_BLOCK_HASH_SHA256, &kv), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_new(8, 16, true, (tsr_block_hash_algo)5, &kv), TSR_E_INVAL);
        assert_ptr_equal(kv, (tsr_kv_cache *)&kv);
        kv = NULL;
        assert_int_equal(tsr_kv_cache_new(8, 16, true, TSR_BLOCK_HASH_SHA256, &kv), TSR_OK);
        CHECK(kv);
        assert_int_equal(tsr_kv_cache_block_size(kv), 16);
        tsr_kv_stats s = stats(kv);
        assert_int_equal(s.num_blocks, 8);
        assert_int_equal(s.num_free, 8);
        assert_int_equal(s.num_active, 0);
        assert_true(s.usage == 0.0);
        tsr_kv_cache_free(&kv);
        assert_null(kv);
        tsr_kv_cache_free(&kv);
        tsr_kv_cache_free(NULL);

        tsr_kv_req r;
        char big[TSR_KV_SALT_MAX + 1] = {0};
        assert_int_equal(tsr_kv_req_init(&r, big, sizeof(big)), TSR_E_LIMIT);
        tsr_kv_req_done(NULL, &r);
        assert_int_equal(tsr_kv_req_init(&r, big, TSR_KV_SALT_MAX), TSR_OK);
        tsr_kv_req_done(NULL, &r);
}

static void test_alloc_until_exhaustion(void **state) {
        tsr_kv_cache *kv = mk(8, 4, true);
        tsr_kv_req r1, r2;
        uint32_t t[64];

        fill(t, 64, 1);
        assert_int_equal(tsr_kv_req_init(&r1, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&r2, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r1, 20), TSR_OK);
        CHECK(kv);
        assert_int_equal(r1.n_blocks, 5);
        for (uint32_t i = 0; i < 5; i++) {
                assert_int_equal(r1.block_ids[i], i);     /* fresh cache: id order */
                assert_int_equal(tsr_kv_cache_block_ref(kv, i), 1);
        }
        assert_int_equal(tsr_kv_cache_commit(kv, &r1, t, 20), TSR_OK);
        CHECK(kv);
        drain(kv);

        /* 4 blocks wanted, 3 free: refused, nothing moves */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, 16), TSR_E_UNAVAILABLE);
        CHECK(kv);
        assert_int_equal(r2.n_blocks, 0);
        assert_int_equal(stats(kv).num_free, 3);
        assert_null(take(kv));
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, 12), TSR_OK);
        CHECK(kv);
        assert_int_equal(r2.n_blocks, 3);
        assert_int_equal(stats(kv).num_free, 0);
        assert_true(stats(kv).usage == 1.0);

        /* r1 is full at 20 tokens: one more needs a sixth block */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r1, 1), TSR_E_UNAVAILABLE);
        CHECK(kv);
        assert_int_equal(r1.n_blocks, 5);
        assert_int_equal(r1.n_computed, 20);
        /* tokens inside the last partial block need nothing */
        assert_int_equal(tsr_kv_cache_commit(kv, &r2, t, 9), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, 3), TSR_OK);
        assert_int_equal(r2.n_blocks, 3);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, 4), TSR_E_UNAVAILABLE);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, SIZE_MAX), TSR_E_INVAL);
        /* commit outside [n_computed, capacity] is refused */
        assert_int_equal(tsr_kv_cache_commit(kv, &r2, t, 13), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_commit(kv, &r2, t, 8), TSR_E_INVAL);
        assert_int_equal(r2.n_computed, 9);
        CHECK(kv);
        RCHECK(kv, &r1);
        RCHECK(kv, &r2);

        tsr_kv_req_done(kv, &r1);
        tsr_kv_req_done(kv, &r2);
        CHECK(kv);
        assert_int_equal(stats(kv).num_free, 8);
        assert_int_equal(stats(kv).num_active, 0);
        tsr_kv_cache_free(&kv);
}

static void test_free_reverse_to_tail(void **state) {
        tsr_kv_cache *kv = mk(8, 4, false);
        tsr_kv_req r1, r2, r3;

        assert_int_equal(tsr_kv_req_init(&r1, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&r2, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&r3, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r1, 12), TSR_OK); /* 0 1 2 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, 8), TSR_OK);  /* 3 4 */
        CHECK(kv);
        tsr_kv_cache_free_blocks(kv, &r1);
        CHECK(kv);
        RCHECK(kv, &r1);
        assert_int_equal(r1.n_blocks, 0);
        assert_int_equal(tsr_kv_cache_block_ref(kv, 0), 0);
        /* queue is now 5 6 7 | 2 1 0 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r3, 24), TSR_OK);
        CHECK(kv);
        static const uint32_t want[] = {5, 6, 7, 2, 1, 0};
        assert_int_equal(r3.n_blocks, 6);
        assert_memory_equal(r3.block_ids, want, sizeof(want));
        tsr_kv_cache_free_blocks(kv, &r2);
        tsr_kv_cache_free_blocks(kv, &r3);
        CHECK(kv);
        assert_int_equal(stats(kv).num_free, 8);
        tsr_kv_req_done(kv, &r1);
        tsr_kv_req_done(kv, &r2);
        tsr_kv_req_done(kv, &r3);
        tsr_kv_cache_free(&kv);
}

/* cached = floor((n - 1) / bs) * bs for every prefix length of a fully cached prompt */
static void test_prefix_hit_repeat(void **state) {
        enum { BS = 4, N = 24 };
        tsr_kv_cache *kv = mk(32, BS, true);
        tsr_kv_req r1, r2;
        uint32_t t[N];

        fill(t, N, 7);
        assert_int_equal(tsr_kv_req_init(&r1, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &r1, t, N), 0);
        assert_int_equal(stats(kv).num_cached, N / BS);
        tsr_kv_cache_free_blocks(kv, &r1);
        CHECK(kv);
        for (size_t n = 1; n <= N; n++) {
                size_t cached = 12345;
                assert_int_equal(tsr_kv_req_init(&r2, NULL, 0), TSR_OK);
                assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &r2, t, n, false, &cached), TSR_OK);
                assert_int_equal(cached, (n - 1) / BS * BS);
                assert_int_equal(r2.num_cached_tokens, cached);
                assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r2, n - cached), TSR_OK);
                CHECK(kv);
                RCHECK(kv, &r2);
                assert_int_equal(r2.n_computed, cached);
                /* the hits are r1's blocks, in order */
                for (size_t i = 0; i < cached / BS; i++)
                        assert_int_equal(r2.block_ids[i], r1.block_ids[i]);
                tsr_kv_req_done(kv, &r2);
                CHECK(kv);
        }
        tsr_kv_req_done(kv, &r1);
        tsr_kv_cache_free(&kv);
}

static void test_partial_prefix_and_salt(void **state) {
        enum { BS = 4 };
        tsr_kv_cache *kv = mk(32, BS, true);
        tsr_kv_req a, b;
        uint32_t t[16], u[16];
        size_t cached;

        fill(t, 16, 3);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 16);

        /* shares 9 tokens: two full blocks hit */
        memcpy(u, t, sizeof(u));
        u[9] = 999999;
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, u, 16), 8);
        tsr_kv_req_done(kv, &b);
        /* differs in a block in the middle: the chain stops there even though later
         * token ids agree */
        memcpy(u, t, sizeof(u));
        u[5] = 999999;
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, u, 16), 4);
        tsr_kv_req_done(kv, &b);
        /* differs at token 0: nothing */
        memcpy(u, t, sizeof(u));
        u[0] = 999999;
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, u, 16), 0);
        tsr_kv_req_done(kv, &b);
        /* same tokens, other salt: nothing; then the salted prompt hits itself */
        assert_int_equal(tsr_kv_req_init(&b, "tenant-a", 8), TSR_OK);
        assert_int_equal(prefill(kv, &b, t, 16), 0);
        tsr_kv_req_done(kv, &b);
        assert_int_equal(tsr_kv_req_init(&b, "tenant-a", 8), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 16, false, &cached), TSR_OK);
        assert_int_equal(cached, 12);
        tsr_kv_req_done(kv, &b);
        /* shorter than one block never hits */
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 3, false, &cached), TSR_OK);
        assert_int_equal(cached, 0);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 0, false, &cached), TSR_OK);
        assert_int_equal(cached, 0);
        tsr_kv_req_done(kv, &b);
        CHECK(kv);
        tsr_kv_req_done(kv, &a);
        tsr_kv_cache_free(&kv);
}

/* A released block keeps its hash; a hit takes it back out of the free queue. */
static void test_hit_on_freed_block(void **state) {
        enum { BS = 4, NB = 8 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b;
        uint32_t t[14];
        uint32_t ids[4];

        fill(t, 14, 5);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 14);              /* 4 blocks, 3 full */
        memcpy(ids, a.block_ids, sizeof(ids));
        tsr_kv_cache_free_blocks(kv, &a);
        CHECK(kv);
        assert_int_equal(stats(kv).num_free, NB);
        assert_int_equal(stats(kv).num_cached, 3);
        drain(kv);

        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, t, 14), 12);
        assert_int_equal(b.n_blocks, 4);
        for (int i = 0; i < 3; i++) {
                assert_int_equal(b.block_ids[i], ids[i]);
                assert_int_equal(tsr_kv_cache_block_ref(kv, ids[i]), 1);
        }
        /* 3 touched + 1 new; the new one came from the queue head (4), not a hit */
        assert_int_equal(b.block_ids[3], 4);
        assert_int_equal(stats(kv).num_free, NB - 4);
        assert_int_equal(stats(kv).num_active, 4);
        assert_int_equal(stats(kv).evictions, 0);
        tsr_kv_events *e = take(kv);
        assert_null(e);                      /* nothing evicted, nothing new became full */
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_cache_free(&kv);
}

static void test_eviction_lru(void **state) {
        enum { BS = 4, NB = 4 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b, c;
        uint32_t t[9], u[12];
        uint64_t h[2];
        size_t n, cached;

        fill(t, 9, 1);
        fill(u, 12, 2);
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, t, 9, BS, NULL, 0, h, &n), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 9);               /* blocks 0 1 2, 0 and 1 cached */
        tsr_kv_cache_free_blocks(kv, &a);    /* queue: 3 | 2 1 0 */
        CHECK(kv);
        drain(kv);

        /* 3 new blocks: 3, 2 (no hash), then 1, which carries h[1]: evicted */
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 12), TSR_OK);
        CHECK(kv);
        static const uint32_t want[] = {3, 2, 1};
        assert_memory_equal(b.block_ids, want, sizeof(want));
        assert_int_equal(stats(kv).evictions, 1);
        assert_int_equal(stats(kv).num_cached, 1);
        tsr_kv_events *e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->n, 1);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_REMOVED);
        assert_int_equal(e->ev[0].n_hashes, 1);
        assert_int_equal(e->ev[0].hashes[0], h[1]);
        tsr_kv_events_free(&e);
        assert_null(e);

        /* the prompt now only hits block 0 */
        assert_int_equal(tsr_kv_req_init(&c, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &c, t, 9, false, &cached), TSR_OK);
        assert_int_equal(cached, 4);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 5), TSR_E_UNAVAILABLE); /* needs 2, has 0 + hit */
        CHECK(kv);
        /* with b gone its blocks are freed (2 1 3 order: 1, 2, 3 reversed) */
        tsr_kv_cache_free_blocks(kv, &b);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 5), TSR_OK);
        CHECK(kv);
        RCHECK(kv, &c);
        assert_int_equal(c.block_ids[0], 0);
        assert_int_equal(c.block_ids[1], 1);   /* b's last block went to the tail first */
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_req_done(kv, &c);
        tsr_kv_cache_free(&kv);
}

/* A parked hit evicted before allocate_slots is refused, not silently used. */
static void test_stale_hit(void **state) {
        enum { BS = 4, NB = 3 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b, c;
        uint32_t t[8];
        size_t cached;

        fill(t, 8, 9);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 8);
        tsr_kv_cache_free_blocks(kv, &a);    /* queue: 2 | 1 0 */
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 8, false, &cached), TSR_OK);
        assert_int_equal(cached, 4);         /* block 0 parked */
        assert_int_equal(tsr_kv_req_init(&c, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 12), TSR_OK);  /* evicts 1 and 0 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 4), TSR_E_INVAL);
        CHECK(kv);
        assert_int_equal(b.n_blocks, 0);
        tsr_kv_cache_free_blocks(kv, &c);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 8, false, &cached), TSR_OK);
        assert_int_equal(cached, 0);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 8), TSR_OK);
        /* get_computed_blocks needs a request without blocks */
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 8, false, &cached), TSR_E_INVAL);
        CHECK(kv);
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_req_done(kv, &c);
        tsr_kv_cache_free(&kv);
}

/* Parked hits that sit in the free queue are not free capacity: touching them takes
 * them out of it. */
static void test_free_hits_not_capacity(void **state) {
        enum { BS = 4, NB = 4 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, x, c;
        uint32_t t[9];
        size_t cached;

        fill(t, 9, 11);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&x, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&c, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 8);               /* blocks 0 1, both cached */
        tsr_kv_cache_free_blocks(kv, &a);    /* queue: 2 3 | 1 0 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &x, 8), TSR_OK);   /* 2 3 */
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &c, t, 9, false, &cached), TSR_OK);
        assert_int_equal(cached, 8);
        assert_int_equal(stats(kv).num_free, 2);
        /* 13 tokens = 4 blocks: 2 hits + 2 new, but only the hits are free */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 5), TSR_E_UNAVAILABLE);
        CHECK(kv);
        assert_int_equal(c.n_blocks, 0);
        /* 9 tokens = 2 hits + 1 new: still short while x holds 2 and 3 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 1), TSR_E_UNAVAILABLE);
        tsr_kv_cache_free_blocks(kv, &x);    /* queue: 1 0 | 3 2 */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &c, 1), TSR_OK);
        static const uint32_t want[] = {0, 1, 3};
        assert_int_equal(c.n_blocks, 3);
        assert_memory_equal(c.block_ids, want, sizeof(want));
        assert_int_equal(c.n_computed, 8);
        assert_int_equal(stats(kv).num_free, 1);
        CHECK(kv);
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &x);
        tsr_kv_req_done(kv, &c);
        tsr_kv_cache_free(&kv);
}

static void test_shared_blocks(void **state) {
        enum { BS = 4, NB = 16 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b;
        uint32_t t[14], u[18];

        fill(t, 14, 4);
        memcpy(u, t, 12 * sizeof(uint32_t));
        fill(u + 12, 6, 8);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 14);
        assert_int_equal(prefill(kv, &b, u, 18), 12);
        for (int i = 0; i < 3; i++) {
                assert_int_equal(b.block_ids[i], a.block_ids[i]);
                assert_int_equal(tsr_kv_cache_block_ref(kv, a.block_ids[i]), 2);
        }
        assert_int_equal(tsr_kv_cache_block_ref(kv, a.block_ids[3]), 1);
        assert_int_equal(stats(kv).num_active, 4 + 2);
        tsr_kv_cache_free_blocks(kv, &a);
        CHECK(kv);
        RCHECK(kv, &b);
        assert_int_equal(stats(kv).num_active, 5);
        for (int i = 0; i < 3; i++)
                assert_int_equal(tsr_kv_cache_block_ref(kv, b.block_ids[i]), 1);
        tsr_kv_cache_free_blocks(kv, &b);
        CHECK(kv);
        assert_int_equal(stats(kv).num_free, NB);
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_cache_free(&kv);
}

/* Two requests compute the same prefix at once: the first commit owns the hash. */
static void test_duplicate_computation(void **state) {
        enum { BS = 4, NB = 16 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b, c;
        uint32_t t[10];
        size_t cached;

        fill(t, 10, 6);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &a, t, 10, false, &cached), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 10, false, &cached), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 10), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 10), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &a, t, 10), TSR_OK);
        drain(kv);
        assert_int_equal(tsr_kv_cache_commit(kv, &b, t, 10), TSR_OK);
        CHECK(kv);
        RCHECK(kv, &b);
        assert_null(take(kv));               /* no STORED for the duplicates */
        assert_int_equal(stats(kv).num_cached, 2);
        /* a's blocks serve the hit, even after a is gone and b is still live */
        tsr_kv_cache_free_blocks(kv, &a);
        assert_int_equal(tsr_kv_req_init(&c, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &c, t, 10), 8);
        assert_int_equal(c.block_ids[0], 0);  /* a had 0 1 2, b 3 4 5 */
        assert_int_equal(c.block_ids[1], 1);
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_req_done(kv, &c);
        tsr_kv_cache_free(&kv);
}

/* Preemption frees the blocks; resuming with prompt + generated tokens hits them. */
static void test_preempt_resume(void **state) {
        enum { BS = 4, NB = 16 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a;
        uint32_t t[32];
        size_t n = 6, cached;

        fill(t, 32, 2);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, n);
        /* decode: one token a step (token n is the sampled one, its KV is computed
         * in the next step) */
        for (; n < 17; n++) {
                assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 1), TSR_OK);
                assert_int_equal(tsr_kv_cache_commit(kv, &a, t, n + 1), TSR_OK);
                CHECK(kv);
                RCHECK(kv, &a);
                assert_int_equal(a.n_blocks, (n + 1 + BS - 1) / BS);
        }
        assert_int_equal(stats(kv).num_cached, 4);
        tsr_kv_cache_free_blocks(kv, &a);
        CHECK(kv);
        assert_int_equal(a.n_computed, 0);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &a, t, 18, false, &cached), TSR_OK);
        assert_int_equal(cached, 16);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 2), TSR_OK);
        assert_int_equal(a.n_blocks, 5);
        assert_int_equal(tsr_kv_cache_commit(kv, &a, t, 18), TSR_OK);
        CHECK(kv);
        RCHECK(kv, &a);
        tsr_kv_req_done(kv, &a);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

static void test_caching_disabled(void **state) {
        enum { BS = 4, NB = 8 };
        tsr_kv_cache *kv = mk(NB, BS, false);
        tsr_kv_req a, b;
        uint32_t t[12];
        uint64_t h[8];

        fill(t, 12, 1);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &a, t, 12), 0);
        tsr_kv_cache_free_blocks(kv, &a);
        assert_int_equal(prefill(kv, &b, t, 12), 0);
        assert_int_equal(tsr_kv_cache_cached_hashes(kv, h, 8), 0);
        tsr_kv_stats s = stats(kv);
        assert_int_equal(s.num_cached, 0);
        assert_int_equal(s.prefix_cache_queries, 0);
        assert_int_equal(s.prefix_cache_hits, 0);
        assert_null(take(kv));
        tsr_kv_cache_reset_prefix_cache(kv);
        assert_null(take(kv));
        CHECK(kv);
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        tsr_kv_cache_free(&kv);
}

static void test_counters(void **state) {
        enum { BS = 4, NB = 16 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b;
        uint32_t t[10];
        size_t cached;

        fill(t, 10, 3);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        prefill(kv, &a, t, 10);              /* query 10, hit 0 */
        tsr_kv_cache_free_blocks(kv, &a);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        prefill(kv, &b, t, 10);              /* query 10, hit 8 */
        tsr_kv_stats s = stats(kv);
        assert_int_equal(s.prefix_cache_requests, 2);
        assert_int_equal(s.prefix_cache_queries, 20);
        assert_int_equal(s.prefix_cache_hits, 8);
        tsr_kv_req_done(kv, &b);
        /* prompt logprobs: no read, no count, but its blocks are still cached */
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 10, true, &cached), TSR_OK);
        assert_int_equal(cached, 0);
        s = stats(kv);
        assert_int_equal(s.prefix_cache_requests, 2);
        assert_int_equal(s.prefix_cache_queries, 20);
        assert_int_equal(s.prefix_cache_hits, 8);
        tsr_kv_req_done(kv, &b);
        tsr_kv_req_done(kv, &a);
        tsr_kv_cache_reset_prefix_cache(kv);
        drain(kv);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 10, true, &cached), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 10), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &b, t, 10), TSR_OK);
        assert_int_equal(stats(kv).num_cached, 2);
        tsr_kv_req_done(kv, &b);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

static void test_event_stream(void **state) {
        enum { BS = 4, NB = 4 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        tsr_kv_req a, b;
        uint32_t t[16], u[12];
        uint64_t h[4], hu[3];
        size_t n;
        tsr_kv_events *e;

        fill(t, 16, 1);
        fill(u, 12, 2);
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, t, 16, BS, NULL, 0, h, &n), TSR_OK);
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, u, 12, BS, NULL, 0, hu, &n), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        /* chunked prefill: 6 tokens, then 4 more (block 1 full), then 6 (blocks 2, 3):
         * one chain, merged into one STORED event */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 6), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &a, t, 6), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 4), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &a, t, 10), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &a, 6), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &a, t, 16), TSR_OK);
        CHECK(kv);
        e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->n, 1);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_STORED);
        assert_false(e->ev[0].has_parent);
        assert_int_equal(e->ev[0].n_hashes, 4);
        assert_memory_equal(e->ev[0].hashes, h, sizeof(h));
        tsr_kv_events_free(&e);
        assert_null(take(kv));

        /* evict three (a's tail first), store b's chain: REMOVED x3 merged, STORED */
        tsr_kv_cache_free_blocks(kv, &a);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, u, 12), 0);
        e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->n, 2);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_REMOVED);
        assert_int_equal(e->ev[0].n_hashes, 3);
        assert_int_equal(e->ev[0].hashes[0], h[3]);
        assert_int_equal(e->ev[0].hashes[1], h[2]);
        assert_int_equal(e->ev[0].hashes[2], h[1]);
        assert_int_equal(e->ev[1].kind, TSR_KV_EVENT_STORED);
        assert_int_equal(e->ev[1].n_hashes, 3);
        assert_memory_equal(e->ev[1].hashes, hu, sizeof(hu));
        tsr_kv_events_free(&e);

        /* a decode-style commit continuing a chain after a take carries its parent */
        tsr_kv_cache_free_blocks(kv, &b);
        tsr_kv_req_done(kv, &b);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(prefill(kv, &b, t, 7), 4);          /* hits h[0]; block 1 partial */
        drain(kv);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 1), TSR_OK);
        assert_int_equal(tsr_kv_cache_commit(kv, &b, t, 8), TSR_OK);
        e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->ev[e->n - 1].kind, TSR_KV_EVENT_STORED);
        assert_true(e->ev[e->n - 1].has_parent);
        assert_int_equal(e->ev[e->n - 1].parent_hash, h[0]);
        assert_int_equal(e->ev[e->n - 1].hashes[0], h[1]);
        tsr_kv_events_free(&e);

        /* reset: one ALL_CLEARED that supersedes anything queued */
        tsr_kv_req_done(kv, &a);
        tsr_kv_req_done(kv, &b);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        prefill(kv, &b, u, 12);
        tsr_kv_cache_reset_prefix_cache(kv);
        CHECK(kv);
        RCHECK(kv, &b);
        assert_int_equal(stats(kv).num_cached, 0);
        e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->n, 1);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_ALL_CLEARED);
        assert_int_equal(e->ev[0].n_hashes, 0);
        tsr_kv_events_free(&e);
        tsr_kv_req_done(kv, &b);
        tsr_kv_cache_free(&kv);
}

/* ---- a mirror that applies the event stream, as a router would ---- */

typedef struct mirror {
        uint64_t *h;
        size_t n, cap;
} mirror;

static void mirror_apply(mirror *m, const tsr_kv_events *e) {
        for (size_t i = 0; e && i < e->n; i++) {
                const tsr_kv_event *ev = &e->ev[i];
                if (ev->kind == TSR_KV_EVENT_ALL_CLEARED) {
                        m->n = 0;
                        continue;
                }
                for (size_t k = 0; k < ev->n_hashes; k++) {
                        size_t j = 0;
                        while (j < m->n && m->h[j] != ev->hashes[k])
                                j++;
                        if (ev->kind == TSR_KV_EVENT_STORED) {
                                assert_true(j == m->n);       /* never stored twice */
                                assert_true(m->n < m->cap);
                                m->h[m->n++] = ev->hashes[k];
                        } else if (j < m->n) {
                                m->h[j] = m->h[--m->n];
                        }
                }
        }
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

static void mirror_sync_and_compare(tsr_kv_cache *kv, mirror *m) {
        tsr_kv_events *e = take(kv);
        uint64_t *truth = malloc(m->cap * sizeof(uint64_t));
        size_t n;

        assert_non_null(truth);
        mirror_apply(m, e);
        tsr_kv_events_free(&e);
        n = tsr_kv_cache_cached_hashes(kv, truth, m->cap);
        assert_int_equal(n, m->n);
        qsort(truth, n, sizeof(uint64_t), cmp_u64);
        qsort(m->h, m->n, sizeof(uint64_t), cmp_u64);
        assert_memory_equal(truth, m->h, n * sizeof(uint64_t));
        free(truth);
}

/* Overflow: the queue is replaced by ALL_CLEARED + a snapshot; the mirror stays exact. */
static void test_event_overflow(void **state) {
        enum { BS = 2, NB = 16 };
        tsr_kv_cache *kv = mk(NB, BS, true);
        mirror m = {.h = calloc(4 * NB, sizeof(uint64_t)), .cap = 4 * NB};
        uint32_t t[16];

        assert_int_equal(tsr_kv_cache_set_event_cap(kv, 1), TSR_OK);   /* raised to NB */
        for (uint32_t round = 0; round < 40; round++) {
                tsr_kv_req r;
                fill(t, 16, round % 7);
                assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
                size_t cached = 0;
                assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &r, t, 16, false, &cached), TSR_OK);
                if (tsr_kv_cache_allocate_slots(kv, &r, 16 - cached) == TSR_OK)
                        assert_int_equal(tsr_kv_cache_commit(kv, &r, t, 16), TSR_OK);
                CHECK(kv);
                tsr_kv_req_done(kv, &r);
                CHECK(kv);
                if (round % 9 == 8)
                        mirror_sync_and_compare(kv, &m);
        }
        assert_true(stats(kv).event_overflows > 0);
        mirror_sync_and_compare(kv, &m);
        /* changing the cap with events queued resyncs too */
        tsr_kv_req r;
        fill(t, 16, 100);
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        prefill(kv, &r, t, 16);
        tsr_kv_req_done(kv, &r);
        assert_int_equal(tsr_kv_cache_set_event_cap(kv, 4096), TSR_OK);
        CHECK(kv);
        tsr_kv_events *e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_ALL_CLEARED);
        m.n = 5;                              /* garbage the mirror: the resync fixes it */
        mirror_apply(&m, e);
        tsr_kv_events_free(&e);
        mirror_sync_and_compare(kv, &m);
        /* a router's Resync: the same snapshot on demand, not counted as an overflow */
        uint64_t overflows = stats(kv).event_overflows;
        tsr_kv_cache_resync(kv);
        CHECK(kv);
        e = take(kv);
        assert_non_null(e);
        assert_int_equal(e->ev[0].kind, TSR_KV_EVENT_ALL_CLEARED);
        mirror m2 = {.h = calloc(4 * NB, sizeof(uint64_t)), .cap = 4 * NB};
        m2.n = 3;                             /* a late router's mirror: whatever it had */
        mirror_apply(&m2, e);
        tsr_kv_events_free(&e);
        mirror_sync_and_compare(kv, &m2);
        assert_true(m2.n > 0);
        assert_int_equal(stats(kv).event_overflows, overflows);
        free(m2.h);
        free(m.h);
        tsr_kv_cache_free(&kv);
}

/* ---- randomized stress ---- */

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        return (uint32_t)(rng_state % n);
}

enum { S_NB = 48, S_BS = 4, S_MAXTOK = 64, S_SLOTS = 12, S_FAMILIES = 4 };

typedef struct sreq {
        bool live, running;
        tsr_kv_req r;
        uint32_t salt;                 /* 0 none, 1 "x" */
        uint32_t tok[S_MAXTOK];
        size_t n_tok, max_tok;
} sreq;

/* what the engine would have written: token ids (and salt) per block row */
static uint32_t content[S_NB][S_BS];
static uint32_t content_salt[S_NB];

static void s_write(tsr_kv_cache *kv, sreq *q, size_t from, size_t to) {
        for (size_t p = from; p < to; p++) {
                uint32_t id = q->r.block_ids[p / S_BS];
                /* never write into a block someone else can read */
                assert_int_equal(tsr_kv_cache_block_ref(kv, id), 1);
                content[id][p % S_BS] = q->tok[p];
                content_salt[id] = q->salt;
        }
}

static void s_verify_hits(sreq *q, size_t cached) {
        for (size_t b = 0; b < cached / S_BS; b++) {
                uint32_t id = q->r.block_ids[b];
                assert_memory_equal(content[id], q->tok + b * S_BS, sizeof(content[id]));
                /* block 0 carries the salt; later blocks inherit it through the chain */
                assert_int_equal(content_salt[id], q->salt);
        }
}

static void stress(tsr_block_hash_algo algo) {
        tsr_kv_cache *kv = NULL;
        static sreq q[S_SLOTS];
        uint32_t family[S_FAMILIES][S_MAXTOK];
        mirror m = {.h = calloc(4 * S_NB, sizeof(uint64_t)), .cap = 4 * S_NB};
        uint64_t n_hits = 0, n_unavail = 0, n_preempt = 0, n_finish = 0;

        assert_int_equal(tsr_kv_cache_new(S_NB, S_BS, true, algo, &kv), TSR_OK);
        rng_state = 0x5eed5eed12345ULL;
        memset(q, 0, sizeof(q));
        for (int f = 0; f < S_FAMILIES; f++)
                for (int i = 0; i < S_MAXTOK; i++)
                        family[f][i] = (uint32_t)(f * 100000 + i);
        assert_int_equal(tsr_kv_cache_set_event_cap(kv, S_NB + rnd(S_NB)), TSR_OK);

        for (int step = 0; step < 20000; step++) {
                sreq *s = &q[rnd(S_SLOTS)];
                uint32_t op = rnd(100);

                if (!s->live) {
                        /* new request: a family prefix of random length, random suffix */
                        uint32_t f = rnd(S_FAMILIES), pre = rnd(40);
                        s->salt = rnd(8) == 0;
                        assert_int_equal(tsr_kv_req_init(&s->r, s->salt ? "x" : NULL, s->salt), TSR_OK);
                        s->n_tok = pre + 1 + rnd(12);
                        for (size_t i = 0; i < s->n_tok; i++)
                                s->tok[i] = i < pre ? family[f][i] : 500000 + rnd(50);
                        s->max_tok = s->n_tok + rnd((uint32_t)(S_MAXTOK - s->n_tok) + 1);
                        s->live = true;
                        s->running = false;
                } else if (!s->running) {
                        size_t cached = 0, chunk;
                        bool skip = rnd(10) == 0;
                        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &s->r, s->tok, s->n_tok, skip, &cached),
                                         TSR_OK);
                        assert_true(cached % S_BS == 0 && cached < s->n_tok);
                        CHECK(kv);
                        chunk = 1 + rnd((uint32_t)(s->n_tok - cached));
                        tsr_status st = tsr_kv_cache_allocate_slots(kv, &s->r, chunk);
                        CHECK(kv);
                        if (st == TSR_E_UNAVAILABLE) {
                                assert_int_equal(s->r.n_blocks, 0);
                                n_unavail++;
                                continue;
                        }
                        assert_int_equal(st, TSR_OK);
                        n_hits += cached > 0;
                        s_verify_hits(s, cached);
                        s_write(kv, s, cached, cached + chunk);
                        assert_int_equal(tsr_kv_cache_commit(kv, &s->r, s->tok, cached + chunk), TSR_OK);
                        s->running = true;
                } else if (op < 8) {
                        /* preemption or abort: release, maybe come back later */
                        tsr_kv_cache_free_blocks(kv, &s->r);
                        n_preempt++;
                        s->running = false;
                        if (rnd(2)) {
                                tsr_kv_req_done(kv, &s->r);
                                s->live = false;
                        }
                } else if (op < 9) {
                        tsr_kv_cache_reset_prefix_cache(kv);
                } else {
                        /* one step: the rest of the prefill in a chunk, or one decode token */
                        size_t done = s->r.n_computed, chunk;
                        if (done == s->n_tok) {
                                if (s->n_tok == s->max_tok) {
                                        tsr_kv_req_done(kv, &s->r);
                                        s->live = false;
                                        n_finish++;
                                        CHECK(kv);
                                        continue;
                                }
                                /* "sample": half the time a token a sibling might also pick */
                                s->tok[s->n_tok] = rnd(2) ? 600000 + rnd(3) : family[0][s->n_tok];
                                s->n_tok++;
                        }
                        chunk = 1 + rnd((uint32_t)(s->n_tok - done));
                        tsr_status st = tsr_kv_cache_allocate_slots(kv, &s->r, chunk);
                        CHECK(kv);
                        if (st == TSR_E_UNAVAILABLE) {
                                /* as the scheduler: preempt the request that could not grow */
                                n_unavail++;
                                tsr_kv_cache_free_blocks(kv, &s->r);
                                s->running = false;
                                n_preempt++;
                        } else {
                                assert_int_equal(st, TSR_OK);
                                s_write(kv, s, done, done + chunk);
                                assert_int_equal(tsr_kv_cache_commit(kv, &s->r, s->tok, done + chunk), TSR_OK);
                        }
                }
                CHECK(kv);
                uint32_t active_refs = 0;
                for (int i = 0; i < S_SLOTS; i++) {
                        if (!q[i].live)
                                continue;
                        RCHECK(kv, &q[i].r);
                        active_refs += q[i].r.n_blocks;
                }
                tsr_kv_stats ks = stats(kv);
                assert_true(ks.num_active <= active_refs);
                assert_true(ks.num_free + ks.num_active == S_NB);
                if (step % 97 == 0)
                        mirror_sync_and_compare(kv, &m);
        }
        for (int i = 0; i < S_SLOTS; i++)
                if (q[i].live)
                        tsr_kv_req_done(kv, &q[i].r);
        CHECK(kv);
        mirror_sync_and_compare(kv, &m);
        tsr_kv_stats st = stats(kv);
        assert_int_equal(st.num_free, S_NB);
        assert_int_equal(st.num_active, 0);
        /* the run exercised what it is meant to */
        assert_true(n_hits > 100);
        assert_true(n_unavail > 10);
        assert_true(n_preempt > 100);
        assert_true(n_finish > 10);
        assert_true(st.evictions > 100);
        assert_true(st.prefix_cache_hits > 0);
        print_message("stress: hits=%llu unavailable=%llu preempt=%llu finish=%llu evictions=%llu overflows=%llu\n",
                      (unsigned long long)n_hits, (unsigned long long)n_unavail, (unsigned long long)n_preempt,
                      (unsigned long long)n_finish, (unsigned long long)st.evictions,
                      (unsigned long long)st.event_overflows);
        free(m.h);
        tsr_kv_cache_free(&kv);
}

static void test_stress_xxhash(void **state) { stress(TSR_BLOCK_HASH_XXHASH); }
static void test_stress_sha256(void **state) { stress(TSR_BLOCK_HASH_SHA256); }

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_new_invalid),
                cmocka_unit_test(test_alloc_until_exhaustion),
                cmocka_unit_test(test_free_reverse_to_tail),
                cmocka_unit_test(test_prefix_hit_repeat),
                cmocka_unit_test(test_partial_prefix_and_salt),
                cmocka_unit_test(test_hit_on_freed_block),
                cmocka_unit_test(test_eviction_lru),
                cmocka_unit_test(test_stale_hit),
                cmocka_unit_test(test_free_hits_not_capacity),
                cmocka_unit_test(test_shared_blocks),
                cmocka_unit_test(test_duplicate_computation),
                cmocka_unit_test(test_preempt_resume),
                cmocka_unit_test(test_caching_disabled),
                cmocka_unit_test(test_counters),
                cmocka_unit_test(test_event_stream),
                cmocka_unit_test(test_event_overflow),
                cmocka_unit_test(test_stress_xxhash),
                cmocka_unit_test(test_stress_sha256),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
