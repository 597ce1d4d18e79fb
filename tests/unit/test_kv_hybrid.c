/* worker/kv_cache + kv_pool with several block tables (issue #14): a hybrid of full and
 * chunked-local attention, as vLLM's hybrid KV cache manager runs Llama 4.  Per-table
 * allocation from the one free queue, the chunked tables' blocks freed behind the chunk
 * (boundaries inside a block and on a block edge), admission counting what a request
 * holds, preemption/abort giving every table's blocks back, prefix-cache hits per table
 * (vLLM's coordinator), and the pool's shared layer arrays and per-request block counts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "worker/engine/kv_cache.h"
#include "worker/engine/kv_pool.h"

#define CHECK(kv) assert_int_equal(tsr_kv_cache_check(kv), TSR_OK)
#define RCHECK(kv, r) assert_int_equal(tsr_kv_req_check((kv), (r)), TSR_OK)

/* A cache of nb blocks of bs tokens with tables {full, chunked(C)}. */
static tsr_kv_cache *mk(uint32_t nb, uint32_t bs, bool caching, uint32_t C) {
        tsr_kv_cache *kv = NULL;
        uint32_t chunk[2] = {0, C};
        assert_int_equal(tsr_kv_cache_new(nb, bs, caching, TSR_BLOCK_HASH_XXHASH, &kv), TSR_OK);
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunk, 2), TSR_OK);
        assert_int_equal(tsr_kv_cache_tables(kv), 2);
        CHECK(kv);
        return kv;
}

static uint32_t n_free(const tsr_kv_cache *kv) {
        tsr_kv_stats s;
        tsr_kv_cache_stats(kv, &s);
        return s.num_free;
}

/* Run tokens[0..n) through r in steps of `step` tokens, as the engine would. */
static void run(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *t, size_t n, size_t step) {
        while (r->n_computed < n) {
                size_t k = n - r->n_computed < step ? n - r->n_computed : step;
                assert_int_equal(tsr_kv_cache_allocate_slots(kv, r, k), TSR_OK);
                RCHECK(kv, r);
                assert_int_equal(tsr_kv_cache_commit(kv, r, t, r->n_computed + k), TSR_OK);
                CHECK(kv);
                RCHECK(kv, r);
        }
}

static void test_set_tables_invalid(void **state) {
        tsr_kv_cache *kv = NULL;
        tsr_kv_req r;
        uint32_t chunk[5] = {0, 8, 8, 8, 8}, chunked_first[2] = {8, 0};
        (void)state;
        assert_int_equal(tsr_kv_cache_new(8, 4, false, TSR_BLOCK_HASH_XXHASH, &kv), TSR_OK);
        assert_int_equal(tsr_kv_cache_tables(kv), 1);           /* the default: one full table */
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunk, 0), TSR_E_INVAL);
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunk, 5), TSR_E_INVAL);
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r, 3), TSR_OK);
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunk, 2), TSR_E_INVAL);   /* blocks in use */
        tsr_kv_req_done(kv, &r);
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunk, 4), TSR_OK);
        assert_int_equal(tsr_kv_cache_tables(kv), 4);
        CHECK(kv);
        /* only chunked tables (a shard of chunked layers alone): table 0 frees too */
        assert_int_equal(tsr_kv_cache_set_tables(kv, chunked_first, 1), TSR_OK);
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        for (size_t n = 4; n <= 20; n += 4) {
                uint32_t t[20] = {0};
                assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r, 4), TSR_OK);
                assert_int_equal(tsr_kv_cache_commit(kv, &r, t, n), TSR_OK);
                RCHECK(kv, &r);
        }
        assert_int_equal(tsr_kv_req_held(kv, &r), 1);   /* 20: chunk [16, 24), block 4 only */
        tsr_kv_req_done(kv, &r);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* Each logical block takes one block per table, all distinct, from the one queue; the
 * forward's layout is table after table. */
static void test_tables_per_group(void **state) {
        tsr_kv_cache *kv = mk(10, 4, false, 8);
        tsr_kv_req r;
        uint32_t out[16];
        (void)state;
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(&*kv, &r, 7), TSR_OK);   /* 2 blocks x 2 tables */
        RCHECK(kv, &r);
        assert_int_equal(r.n_blocks, 2);
        assert_int_equal(n_free(kv), 6);
        assert_int_equal(tsr_kv_req_held(kv, &r), 4);
        assert_int_equal(tsr_kv_req_table(kv, &r, out), 4);
        /* block-major inside the request, table-major for the forward */
        assert_int_equal(out[0], r.block_ids[0]);
        assert_int_equal(out[1], r.block_ids[2]);
        assert_int_equal(out[2], r.block_ids[1]);
        assert_int_equal(out[3], r.block_ids[3]);
        for (int i = 0; i < 4; i++) {
                assert_int_not_equal(out[i], TSR_KV_NULL_BLOCK);
                assert_int_equal(tsr_kv_cache_block_ref(kv, out[i]), 1);
        }
        /* too few for 2 more blocks x 2 tables with 3 free after one more: nothing changes */
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r, 7 + 12), TSR_OK);  /* 5 blocks: 10 ids */
        assert_int_equal(n_free(kv), 0);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &r, 7 + 12 + 4), TSR_E_UNAVAILABLE);
        assert_int_equal(r.n_blocks, 5);
        RCHECK(kv, &r);
        tsr_kv_req_done(kv, &r);
        assert_int_equal(n_free(kv), 10);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* Chunk 6, blocks of 4: chunk starts 6, 12, 18 fall inside blocks.  After a commit to n
 * the chunked table frees the blocks wholly before floor(n / 6) * 6; the full table keeps
 * everything. */
static void test_free_behind_chunk_inside_block(void **state) {
        tsr_kv_cache *kv = mk(16, 4, false, 6);
        tsr_kv_req r;
        uint32_t t[32] = {0}, out[32];
        /* after committing n tokens: chunked blocks freed (all of 0 .. f-1) */
        static const struct { size_t n; uint32_t freed; } want[] = {
                {5, 0}, {6, 1}, {7, 1}, {11, 1}, {12, 3}, {17, 3}, {18, 4}, {24, 6},
        };
        (void)state;
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
                run(kv, &r, t, want[i].n, 64);
                tsr_kv_req_table(kv, &r, out);
                for (uint32_t b = 0; b < r.n_blocks; b++) {
                        assert_int_not_equal(out[b], TSR_KV_NULL_BLOCK);        /* full: kept */
                        if (b < want[i].freed)
                                assert_int_equal(out[r.n_blocks + b], TSR_KV_NULL_BLOCK);
                        else
                                assert_int_not_equal(out[r.n_blocks + b], TSR_KV_NULL_BLOCK);
                }
                assert_int_equal(tsr_kv_req_held(kv, &r), 2 * r.n_blocks - want[i].freed);
                assert_int_equal(n_free(kv), 16 - (2 * r.n_blocks - want[i].freed));
        }
        tsr_kv_cache_free_blocks(kv, &r);       /* preemption: every table's blocks back */
        assert_int_equal(n_free(kv), 16);
        CHECK(kv);
        tsr_kv_req_done(kv, &r);
        tsr_kv_cache_free(&kv);
}

/* Chunk 8 on blocks of 4: a chunk start is a block edge; decode token by token. */
static void test_free_behind_chunk_block_edge(void **state) {
        tsr_kv_cache *kv = mk(16, 4, false, 8);
        tsr_kv_req r;
        uint32_t t[40] = {0}, out[40];
        (void)state;
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        for (size_t n = 1; n <= 24; n++) {
                run(kv, &r, t, n, 1);
                tsr_kv_req_table(kv, &r, out);
                for (uint32_t b = 0; b < r.n_blocks; b++)
                        assert_int_equal(out[r.n_blocks + b] == TSR_KV_NULL_BLOCK, (b + 1) * 4 <= n / 8 * 8);
        }
        /* at 24 the chunk is [24, 32): all six chunked blocks are gone; the full six stay */
        assert_int_equal(tsr_kv_req_held(kv, &r), 6);
        tsr_kv_req_done(kv, &r);                /* abort / finish */
        assert_int_equal(n_free(kv), 16);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* Admission counts what a request holds: with chunk 4 and blocks of 4, a 32-token request
 * decoded token by token needs 8 full blocks + at most 2 chunked ones, so a pool of 10
 * (less than the 16 of two whole tables) runs it to the end; a prefill of 32 at once
 * needs 16 and waits. */
static void test_admission_with_freeing(void **state) {
        tsr_kv_cache *kv = mk(10, 4, false, 4);
        tsr_kv_req r, big;
        uint32_t t[32] = {0};
        (void)state;
        assert_int_equal(tsr_kv_req_init(&big, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &big, 32), TSR_E_UNAVAILABLE);
        assert_int_equal(big.n_blocks, 0);
        assert_int_equal(n_free(kv), 10);
        assert_int_equal(tsr_kv_req_init(&r, NULL, 0), TSR_OK);
        run(kv, &r, t, 32, 1);
        assert_int_equal(r.n_computed, 32);
        /* at 32 the chunk [32, 36) has no block yet: the 8 chunked ones are all free */
        assert_int_equal(tsr_kv_req_held(kv, &r), 8);
        assert_int_equal(n_free(kv), 2);
        tsr_kv_req_done(kv, &r);
        tsr_kv_req_done(kv, &big);
        assert_int_equal(n_free(kv), 10);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* Prefix caching over the hybrid, vLLM's rule: every table's full blocks are hashed
 * (a chunked block freed behind its chunk keeps its hash until evicted); a hit needs the
 * full table's blocks and each chunked table's from the chunk of the hit's end, and is
 * cut back until every table has them. */
static void test_prefix_hit_per_table(void **state) {
        uint32_t t[64], other[64], out[64];
        size_t cached = 0;
        (void)state;
        for (size_t i = 0; i < 64; i++) {
                t[i] = 7 + (uint32_t)i;
                other[i] = 500 + (uint32_t)i;
        }
        for (int c = 0; c < 3; c++) {
                /* 21 tokens: 5 full blocks, the lookup capped at (21 - 1) / 4 = 5 blocks; every
                 * chunked block still cached, so the whole 20 for chunk 8, 12 and 4 alike,
                 * the chunked entries null before the chunk of 20 (16, 12, 20) */
                static const uint32_t C[3] = {8, 12, 4};
                tsr_kv_cache *kv = mk(32, 4, true, C[c]);
                tsr_kv_req a, b;
                uint32_t start = 20 / C[c] * C[c] / 4;
                assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
                assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &a, t, 21, false, &cached), TSR_OK);
                assert_int_equal(cached, 0);
                run(kv, &a, t, 21, 5);
                tsr_kv_req_done(kv, &a);
                assert_int_equal(n_free(kv), 32);
                assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
                assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 21, false, &cached), TSR_OK);
                assert_int_equal(cached, 20);
                assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 1), TSR_OK);
                RCHECK(kv, &b);
                assert_int_equal(b.n_computed, 20);
                tsr_kv_req_table(kv, &b, out);
                for (uint32_t k = 0; k < b.n_blocks; k++) {
                        assert_int_not_equal(out[k], TSR_KV_NULL_BLOCK);
                        assert_int_equal(out[b.n_blocks + k] == TSR_KV_NULL_BLOCK, k < start);
                }
                run(kv, &b, t, 21, 5);
                tsr_kv_req_done(kv, &b);
                assert_int_equal(n_free(kv), 32);
                CHECK(kv);
                tsr_kv_cache_free(&kv);
        }
        /* chunk 12: A (21 tokens in steps of 5) frees chunked blocks 0..2 at 15, the rest
         * at its finish, last block first: the free queue ends c0 c1 c2 | c5 f5 c4 f4 c3 ...
         * A 52-token request then takes the 20 unused blocks and the next 6 (c0 c1 c2 c5
         * f5 c4), evicting them.  The same 21 tokens: the full table hits blocks 0..4
         * (20 tokens), the chunk of 20 starts at 12 and needs chunked blocks 3 and 4, 4 is
         * gone: cut to 16, whose chunk (12) needs block 3 only: a hit of 16 */
        tsr_kv_cache *kv = mk(32, 4, true, 12);
        tsr_kv_req a, x, b;
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        run(kv, &a, t, 21, 5);
        tsr_kv_req_done(kv, &a);
        assert_int_equal(tsr_kv_req_init(&x, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &x, other, 52, false, &cached), TSR_OK);
        assert_int_equal(cached, 0);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &x, 52), TSR_OK);
        tsr_kv_req_done(kv, &x);
        CHECK(kv);
        assert_int_equal(tsr_kv_req_init(&b, NULL, 0), TSR_OK);
        assert_int_equal(tsr_kv_cache_get_computed_blocks(kv, &b, t, 21, false, &cached), TSR_OK);
        assert_int_equal(cached, 16);
        assert_int_equal(tsr_kv_cache_allocate_slots(kv, &b, 5), TSR_OK);
        RCHECK(kv, &b);
        tsr_kv_req_table(kv, &b, out);
        for (uint32_t k = 0; k < 4; k++)        /* hits: full 0..3, chunked 3 (0..2 null) */
                assert_int_equal(out[b.n_blocks + k] == TSR_KV_NULL_BLOCK, k < 3);
        run(kv, &b, t, 21, 5);
        tsr_kv_req_done(kv, &b);
        assert_int_equal(n_free(kv), 32);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* The router's mirror sees table 0's hashes only: the events and cached_hashes list
 * the full table's blocks, not the chunked tables' (their keys are the worker's). */
static void test_events_full_table_only(void **state) {
        tsr_kv_cache *kv = mk(32, 4, true, 8);
        tsr_kv_req a;
        tsr_kv_events *e = NULL;
        uint32_t t[24];
        uint64_t hashes[32];
        size_t n_stored = 0;
        (void)state;
        for (size_t i = 0; i < 24; i++)
                t[i] = 3 + (uint32_t)i;
        assert_int_equal(tsr_kv_req_init(&a, NULL, 0), TSR_OK);
        run(kv, &a, t, 24, 24);
        assert_int_equal(tsr_kv_cache_take_events(kv, &e), TSR_OK);
        assert_non_null(e);
        for (size_t i = 0; i < e->n; i++) {
                assert_int_equal(e->ev[i].kind, TSR_KV_EVENT_STORED);
                n_stored += e->ev[i].n_hashes;
        }
        assert_int_equal(n_stored, 6);                                  /* 6 full blocks, one table */
        assert_int_equal(tsr_kv_cache_cached_hashes(kv, hashes, 32), 6);
        tsr_kv_events_free(&e);
        tsr_kv_req_done(kv, &a);
        CHECK(kv);
        tsr_kv_cache_free(&kv);
}

/* The pool of a hybrid: paged groups share layer arrays (block bytes of the widest), a
 * chunked group needs a chunk, row shapes must match; per-request blocks. */
static void test_pool_hybrid(void **state) {
        tsr_kv_group g[3] = {
                {.kind = TSR_KV_FULL_ATTENTION, .n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .dtype = TSR_DTYPE_F32},
                {.kind = TSR_KV_CHUNKED_LOCAL, .n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .dtype = TSR_DTYPE_F32,
                 .chunk = 8},
                {.kind = TSR_KV_CHUNKED_LOCAL, .n_layers = 1, .n_kv_heads = 2, .head_dim = 8, .dtype = TSR_DTYPE_F32,
                 .chunk = 8},
        };
        uint32_t chunk[TSR_KV_GROUPS_MAX];
        tsr_kv_pool *p = NULL;
        (void)state;
        assert_true(tsr_kv_groups_hybrid(g, 3));
        assert_false(tsr_kv_groups_hybrid(g, 1));
        assert_int_equal(tsr_kv_tables(g, 3, chunk), 3);
        assert_int_equal(chunk[0], 0);
        assert_int_equal(chunk[1], 8);
        assert_int_equal(chunk[2], 8);
        assert_int_equal(tsr_kv_tables(g, 1, chunk), 1);
        /* 2 layers x K and V x 16 floats a row x 4 rows: the widest group's, not the sum */
        assert_int_equal(tsr_kv_block_bytes(g, 3, 4), 2 * 2 * 16 * 4 * 4);
        /* 100 tokens, blocks of 4, chunk 8, steps of 16: full 25, chunked (8+16)/4+1 = 7 each */
        assert_int_equal(tsr_kv_blocks_per_request(g, 3, 4, 100, 16), 25 + 7 + 7);
        assert_int_equal(tsr_kv_blocks_per_request(g, 3, 4, 10, 16), 3 + 3 + 3);   /* never more than full */
        assert_int_equal(tsr_kv_blocks_per_request(g, 1, 4, 100, 16), 25);
        assert_int_equal(tsr_kv_pool_new(g, 3, 5, 4, &p), TSR_OK);
        assert_int_equal(p->n_paged_layers, 2);
        assert_int_equal(p->bytes, 5 * tsr_kv_block_bytes(g, 3, 4));
        for (size_t i = 0; i < 3; i++)
                for (uint32_t j = 0; j < g[i].n_layers; j++) {
                        assert_ptr_equal(p->groups[i].k[j], p->paged_k[j]);
                        assert_ptr_equal(p->groups[i].v[j], p->paged_v[j]);
                }
        memset(p->paged_k[1], 0xab, 5 * 4 * 16 * 4);    /* every byte there (ASan) */
        tsr_kv_pool_free(&p);
        assert_null(p);
        g[2].chunk = 0;
        assert_int_equal(tsr_kv_pool_new(g, 3, 5, 4, &p), TSR_E_INVAL);
        g[2].chunk = 8;
        g[2].head_dim = 4;
        assert_int_equal(tsr_kv_pool_new(g, 3, 5, 4, &p), TSR_E_INVAL);
        assert_null(p);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_set_tables_invalid),
                cmocka_unit_test(test_tables_per_group),
                cmocka_unit_test(test_free_behind_chunk_inside_block),
                cmocka_unit_test(test_free_behind_chunk_block_edge),
                cmocka_unit_test(test_admission_with_freeing),
                cmocka_unit_test(test_prefix_hit_per_table),
                cmocka_unit_test(test_events_full_table_only),
                cmocka_unit_test(test_pool_hybrid),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
