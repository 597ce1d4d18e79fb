/* router placement: the hash set behind the prefix-cache mirror, the mirror's event
 * and gap rules, and the routers.md §6.4 filters, cost, imbalance guard and tie-breaks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "router/hashset.h"
#include "router/placement.h"
#include "router/worker_dns.h"
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
        /* the first Status seen may have any seq: nothing to compare with, but events
         * before it were missed, so the mirror is not exact (the router asks a Resync) */
        assert_false(m.exact);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 40, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        assert_false(m.exact);
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 4);
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 2), 2);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 41, TESSERA__V1__BLOCK_HASH_EVENT__KIND__REMOVED, rm, 1)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 2);   /* stops at the first miss */
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 42, -1, NULL, 0)));   /* heartbeat */
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 2);
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 43, TESSERA__V1__BLOCK_HASH_EVENT__KIND__ALL_CLEARED,
                                                    NULL, 0)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_true(m.exact);            /* a snapshot (what a Resync brings) starts here */
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 44, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 4);
        /* seq 45 lost: the mirror cannot be trusted, start over; this Status's own
         * events still apply */
        assert_true(tsr_prefix_mirror_apply(&m, mk(&f, 7, 46, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, other, 1)));
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_int_equal(tsr_prefix_mirror_hits(&m, other, 1), 1);
        assert_int_equal(m.resets, 1);
        assert_false(m.exact);           /* until the snapshot the router asked for */
        assert_false(tsr_prefix_mirror_apply(&m, mk(&f, 7, 47, TESSERA__V1__BLOCK_HASH_EVENT__KIND__STORED, chain, 4)));
        assert_false(m.exact);
        /* restarted worker: new epoch, seq from 1, its first Status: nothing was missed */
        assert_true(tsr_prefix_mirror_apply(&m, mk(&f, 8, 1, -1, NULL, 0)));
        assert_true(m.exact);
        assert_int_equal(tsr_prefix_mirror_hits(&m, query, 5), 0);
        assert_int_equal(tsr_prefix_mirror_hits(&m, other, 1), 0);
        assert_int_equal(m.resets, 2);
        tsr_prefix_mirror_done(&m);
}

/* A worker with 100 KV blocks of 16 tokens, `active` of them held by running requests. */
static tsr_placement_cand cand(size_t blocks, size_t hits, uint64_t wpt, uint32_t running, uint32_t waiting,
                               uint64_t active) {
        tsr_placement_cand c = {.blocks = blocks, .hits = hits, .waiting_prompt_tokens = wpt, .block_size = 16,
                                .num_running = running, .num_waiting = waiting, .kv_total = 100,
                                .kv_free = 100 - active, .kv_active = active, .reserve_blocks = 1};
        return c;
}

static void test_cost(void **state) {
        (void)state;
        /* (B - h) + queued prefill in blocks + active blocks */
        tsr_placement_cand c = cand(10, 4, 32, 1, 2, 3);
        assert_true(tsr_placement_cost(&c) == 6.0 + 2.0 + 3.0);
        /* what this router sent since the last Status counts as queued and active */
        c.pending_prefill_blocks = 5;
        c.pending_decode_blocks = 7;
        assert_true(tsr_placement_cost(&c) == 6.0 + 2.0 + 5.0 + 3.0 + 7.0);
        c = cand(10, 12, 0, 0, 0, 0);    /* hits past B clamp */
        assert_true(tsr_placement_cost(&c) == 0.0);
        c = cand(3, 0, 10, 0, 0, 0);
        c.block_size = 0;                /* unknown block size counts as 1 */
        assert_true(tsr_placement_cost(&c) == 13.0);
        c.pending_requests = 4;
        assert_true(tsr_placement_load(&c) == 4.0);
        /* reserve: ceil(max_tokens / block size), at most 16 blocks */
        assert_int_equal(tsr_placement_reserve(1, 16), 1);
        assert_int_equal(tsr_placement_reserve(32, 16), 2);
        assert_int_equal(tsr_placement_reserve(33, 16), 3);
        assert_int_equal(tsr_placement_reserve(100000, 16), 16);
        assert_int_equal(tsr_placement_reserve(5, 0), 5);
}

static void test_filters(void **state) {
        tsr_placement_params p = TSR_PLACEMENT_DEFAULTS;
        (void)state;
        tsr_placement_cand c = cand(10, 0, 0, 0, 0, 0);
        assert_true(tsr_placement_passes(&c, &p));
        /* free blocks must hold the prefill plus the reserve */
        c = cand(10, 0, 0, 0, 0, 80);    /* 80 active <= 0.8 * 100, 20 free >= 10 + 1 */
        assert_true(tsr_placement_passes(&c, &p));
        c.kv_free = 10;                  /* 10 < 10 + 1 */
        assert_false(tsr_placement_passes(&c, &p));
        c.hits = 5;                      /* 10 >= 5 + 1 */
        assert_true(tsr_placement_passes(&c, &p));
        /* saturation: more than 0.8 of the blocks active */
        c = cand(1, 0, 0, 0, 0, 81);
        assert_false(tsr_placement_passes(&c, &p));
        /* a backed-up queue */
        c = cand(1, 0, 0, 0, 128, 0);
        assert_false(tsr_placement_passes(&c, &p));
        c.num_waiting = 127;
        assert_true(tsr_placement_passes(&c, &p));
        /* no KV report: only the queue filter applies */
        c = cand(50, 0, 0, 0, 0, 0);
        c.kv_total = c.kv_free = 0;
        assert_true(tsr_placement_passes(&c, &p));
}

static void test_pick(void **state) {
        tsr_placement_cand c[3] = {0};
        tsr_placement_path path;
        (void)state;
        assert_int_equal(tsr_placement_pick(c, 0, NULL, &path), (size_t)-1);
        /* routers.md §6.4's worked example: cached 2/5/8 of 10 blocks, queued prefill
         * 8-2 / 5-5 / 2-8 ... expressed as (B - h) + Q + D = 18, 10, 11: W2 */
        c[0] = cand(10, 2, 0, 0, 0, 10);         /* 8 + 0 + 10 */
        c[1] = cand(10, 5, 0, 0, 0, 5);          /* 5 + 0 + 5 */
        c[2] = cand(10, 8, 0, 0, 0, 9);          /* 2 + 0 + 9 */
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 1);
        assert_int_equal(path, TSR_PLACE_COST);
        /* the worker holding the prefix loses once its active KV outweighs the saving */
        c[1] = cand(10, 5, 0, 0, 0, 30);
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 2);
        /* a filtered worker is skipped however cheap it looks */
        c[0] = cand(10, 10, 0, 0, 0, 0);
        c[0].kv_free = 0;
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 2);
        /* when every worker is filtered, all are candidates again */
        c[1].kv_free = c[2].kv_free = 0;
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 0);
        assert_int_equal(path, TSR_PLACE_ALL_FILTERED);
        /* equal cost: fewer waiting, then lower load, then the earlier index */
        c[0] = cand(5, 0, 0, 3, 1, 0);
        c[1] = cand(5, 0, 0, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
        c[0] = cand(5, 0, 0, 3, 0, 0);
        c[1] = cand(5, 0, 0, 1, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
        c[0] = cand(5, 0, 0, 1, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 0);
}

/* With every worker's step timing known, the pick compares estimated TTFTs: the
 * prompt's uncached and the queued prefill at the worker's rate, plus 1.5 decode
 * steps on a worker that is decoding.  A GPU-like worker (20k prefill tokens/s, 20 ms
 * decode step) holding 64 of a prompt's 68 blocks while it decodes one request
 * (68 active blocks) answers in 4 * 16 / 20k s + 30 ms = 33.2 ms; an idle one that
 * holds nothing in 68 * 16 / 20k s = 54.4 ms.  The block cost picked the idle one
 * (68 < 4 + 68); the TTFT estimate picks the holder.  One worker without timing puts
 * every candidate back on the block cost. */
static void test_ttft_cost(void **state) {
        tsr_placement_cand c[2];
        tsr_placement_path path;
        (void)state;
        c[0] = cand(68, 64, 0, 1, 0, 68);
        c[0].kv_total = c[1].kv_total = 1000;
        c[0].kv_free = 1000 - 68;
        c[1] = cand(68, 0, 0, 0, 0, 0);
        c[1].kv_total = 1000;
        c[1].kv_free = 1000;
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);      /* no timing: blocks */
        for (int i = 0; i < 2; i++) {
                c[i].prefill_tps = 20000;
                c[i].decode_ms = 20;
        }
        assert_true(tsr_placement_timed(&c[0]));
        assert_true(fabs(tsr_placement_ttft_ms(&c[0]) - (4.0 * 16 / 20000 * 1e3 + 30.0)) < 1e-9);
        assert_true(fabs(tsr_placement_ttft_ms(&c[1]) - 68.0 * 16 / 20000 * 1e3) < 1e-9);
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 0);
        assert_int_equal(path, TSR_PLACE_COST);
        /* queued prefill there (waiting prompt tokens, our own pending Submits) counts */
        c[0].waiting_prompt_tokens = 512;                   /* +25.6 ms: 58.8 > 54.4 */
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
        c[0].waiting_prompt_tokens = 0;
        c[0].pending_prefill_blocks = 32;                   /* the same, sent by us */
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
        c[0].pending_prefill_blocks = 0;
        /* a request dispatched to an idle worker makes it decoding */
        c[1].pending_requests = 1;
        assert_true(fabs(tsr_placement_ttft_ms(&c[1]) - (68.0 * 16 / 20000 * 1e3 + 30.0)) < 1e-9);
        c[1].pending_requests = 0;
        /* one worker that has not measured yet: both on the block cost again */
        c[1].decode_ms = 0;
        assert_false(tsr_placement_timed(&c[1]));
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
        /* the filters still apply first */
        c[1].decode_ms = 20;
        c[0].kv_free = 0;
        assert_int_equal(tsr_placement_pick(c, 2, NULL, &path), 1);
}

static void test_imbalance_guard(void **state) {
        tsr_placement_cand c[3];
        tsr_placement_path path;
        (void)state;
        /* A hot prefix: worker 0 holds all of it but runs 100 requests; the others
         * run 10 and 20.  100 - 10 > 64 and 100 > 1.5 * 10: only loads <= 74 stay,
         * and of those the longer prefix hit wins (worker 2), not the cheaper cost. */
        c[0] = cand(20, 20, 0, 100, 0, 0);
        c[1] = cand(20, 0, 0, 10, 0, 0);
        c[2] = cand(20, 3, 0, 20, 0, 10);        /* cost 17 + 10 = 27 > worker 1's 20 */
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 2);
        assert_int_equal(path, TSR_PLACE_GUARD);
        /* a 64-request gap is not enough */
        c[0].num_running = 74;
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 0);
        assert_int_equal(path, TSR_PLACE_COST);
        /* nor a large gap that is under 1.5x */
        for (int i = 0; i < 3; i++)
                c[i].num_running += 200;        /* 274 vs 210: gap 64, 1.3x */
        c[0].num_running = 300;                 /* gap 90, 300 < 1.5 * 210 */
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 0);
        assert_int_equal(path, TSR_PLACE_COST);
        /* pending requests count as load */
        c[0] = cand(20, 20, 0, 0, 0, 0);
        c[0].pending_requests = 80;
        c[1] = cand(20, 0, 0, 0, 0, 0);
        c[2] = cand(20, 1, 0, 0, 0, 0);
        assert_int_equal(tsr_placement_pick(c, 3, NULL, &path), 2);
        assert_int_equal(path, TSR_PLACE_GUARD);
        /* least_load: fewest requests, ties to the earlier index */
        assert_int_equal(tsr_placement_pick_least_load(c, 3), 1);
        assert_int_equal(tsr_placement_pick_least_load(c, 0), (size_t)-1);
}

/* The inputs from a Status and the pending counts; what a dispatch adds to them. */
static void test_cand_fill_and_pending(void **state) {
        (void)state;
        Tessera__V1__Status st = TESSERA__V1__STATUS__INIT;
        tsr_placement_pending p = {.prefill_blocks = 3, .decode_blocks = 5, .requests = 2};
        tsr_placement_cand c;
        st.num_running = 4;
        st.num_waiting = 1;
        st.waiting_prompt_tokens = 32;
        st.kv_blocks_total = 100;
        st.kv_blocks_free = 60;
        st.kv_blocks_active = 40;
        tsr_placement_cand_fill(&c, NULL, &st, &p, 16, 40, NULL, 0);   /* no hashes: the worker is not read */
        assert_int_equal(c.num_running, 4);
        assert_int_equal(c.num_waiting, 1);
        assert_int_equal(c.waiting_prompt_tokens, 32);
        assert_int_equal(c.kv_total, 100);
        assert_int_equal(c.kv_free, 60);
        assert_int_equal(c.kv_active, 40);
        assert_int_equal(c.pending_prefill_blocks, 3);
        assert_int_equal(c.pending_decode_blocks, 5);
        assert_int_equal(c.pending_requests, 2);
        assert_int_equal(c.block_size, 16);
        assert_int_equal(c.reserve_blocks, 3);   /* ceil(40 / 16) */
        assert_int_equal(c.blocks, 0);
        assert_int_equal(c.hits, 0);
        tsr_placement_cand_fill(&c, NULL, NULL, NULL, 16, 1, NULL, 0);   /* no Status yet, nothing sent */
        assert_int_equal(c.num_running + c.num_waiting + c.kv_total + c.pending_requests, 0);
        c.blocks = 7;
        c.hits = 2;
        tsr_placement_pending_add(&p, &c);
        assert_int_equal(p.prefill_blocks, 3 + 5);
        assert_int_equal(p.decode_blocks, 5 + 7);
        assert_int_equal(p.requests, 3);
        c.hits = 9;   /* more hits than blocks adds no prefill */
        tsr_placement_pending_add(&p, &c);
        assert_int_equal(p.prefill_blocks, 8);
}

/* The Submits a router keeps pending per worker: acknowledged ids leave, the rest stay
 * across Status updates; without an acknowledgement a newer Status clears what was
 * sent before it; a new boot epoch clears everything; the oldest go past the cap. */
static void test_sent_list(void **state) {
        (void)state;
        tsr_placement_sent_list l = {0};
        tsr_placement_pending sum;
        tsr_placement_cand c = {.blocks = 4, .hits = 1};

        tsr_placement_sent_prune(&l, 7, 1, false, 0);           /* epoch 7, Status seq 1 */
        for (uint64_t id = 10; id < 15; id++)
                assert_true(tsr_placement_sent_add(&l, id, 1, &c));
        tsr_placement_sent_sum(&l, &sum);
        assert_int_equal(sum.requests, 5);
        assert_int_equal(sum.prefill_blocks, 5 * 3);
        assert_int_equal(sum.decode_blocks, 5 * 4);

        /* Status 2 acknowledges up to 12: 13 and 14 are still pending, whatever the seq. */
        tsr_placement_sent_prune(&l, 7, 2, true, 12);
        tsr_placement_sent_sum(&l, &sum);
        assert_int_equal(sum.requests, 2);
        assert_int_equal(l.items[0].id, 13);
        assert_int_equal(l.items[1].id, 14);
        assert_true(tsr_placement_sent_add(&l, 15, 2, &c));
        /* A Status without our acknowledgement (an older worker): only what was sent
         * while seq 3 was current would stay, so all three leave. */
        tsr_placement_sent_prune(&l, 7, 3, false, 0);
        assert_int_equal(l.n, 0);
        assert_true(tsr_placement_sent_add(&l, 16, 3, &c));
        tsr_placement_sent_prune(&l, 7, 3, false, 0);            /* same Status: kept */
        assert_int_equal(l.n, 1);
        tsr_placement_sent_prune(&l, 7, 4, true, 15);            /* acked below it: kept */
        assert_int_equal(l.n, 1);
        tsr_placement_sent_prune(&l, 8, 1, true, 99);            /* restarted: nothing carries over */
        assert_int_equal(l.n, 0);
        assert_int_equal(l.boot_epoch, 8);
        tsr_placement_sent_sum(NULL, &sum);                       /* no entry: zeros */
        assert_int_equal(sum.requests + sum.prefill_blocks + sum.decode_blocks, 0);

        for (uint64_t id = 1; id <= TSR_PLACEMENT_SENT_MAX + 3; id++)
                assert_true(tsr_placement_sent_add(&l, id, 1, &c));
        assert_int_equal(l.n, TSR_PLACEMENT_SENT_MAX);
        assert_int_equal(l.items[0].id, 4);                      /* 1..3 forgotten */
        assert_int_equal(l.items[l.n - 1].id, TSR_PLACEMENT_SENT_MAX + 3);
        tsr_placement_sent_free(&l);
        assert_null(l.items);
        tsr_placement_sent_free(&l);                              /* twice is harmless */
}

/* Recent placements count as hits on their worker only, for their shared leading
 * run, until they age out or the worker is forgotten. */
static void test_recent_placements(void **state) {
        static tsr_placement_recent r;     /* 10 KB: not on the test's stack */
        static int wa, wb;                  /* two workers, by address */
        uint64_t a[6] = {11, 12, 13, 14, 15, 16}, b[6] = {11, 12, 13, 99, 98, 97}, c[3] = {21, 22, 23};
        const uint64_t t0 = 1000000000ull;

        memset(&r, 0, sizeof(r));
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 6, t0), 0);
        tsr_placement_recent_add(&r, &wa, a, 6, t0);
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 6, t0), 6);
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 4, t0), 4);    /* a shorter prompt */
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, b, 6, t0), 3);    /* shares 3 blocks */
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, a, 6, t0), 0);    /* other worker */
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, c, 3, t0), 0);
        tsr_placement_recent_add(&r, &wb, b, 5, t0 + 10);
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, b, 6, t0 + 10), 5);
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, a, 6, t0 + 10), 3);
        /* aged out */
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 6, t0 + TSR_PLACEMENT_RECENT_NS + 1), 0);
        tsr_placement_recent_forget(&r, &wb);
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, b, 6, t0 + 10), 0);
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 6, t0 + 10), 6);
        /* the ring wraps: the oldest placements go first */
        for (int i = 0; i < TSR_PLACEMENT_RECENT_MAX; i++)
                tsr_placement_recent_add(&r, &wb, c, 3, t0 + 20);
        assert_int_equal(tsr_placement_recent_hits(&r, &wa, a, 6, t0 + 20), 0);
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, c, 3, t0 + 20), 3);
        tsr_placement_recent_add(&r, &wa, NULL, 0, t0);                       /* nothing to remember */
        tsr_placement_recent_done(&r);
        assert_int_equal(tsr_placement_recent_hits(&r, &wb, c, 3, t0 + 20), 0);
}

/* One scan per request equals a per-worker brute force over the ring: random rings of
 * 8 workers whose chains share random prefixes, entries of random ages. */
static size_t brute_hits(const tsr_placement_recent *r, const void *w, const uint64_t *h, size_t n, uint64_t now) {
        size_t best = 0;
        for (size_t i = 0; i < TSR_PLACEMENT_RECENT_MAX; i++) {
                const tsr_placement_recent_entry *e = &r->e[i];
                if (e->w != w || now - e->at_ns > TSR_PLACEMENT_RECENT_NS)
                        continue;
                size_t k = 0;
                while (k < e->n && k < n && e->hashes[k] == h[k])
                        k++;
                best = k > best ? k : best;
        }
        return best;
}

static void test_recent_scan_matches_brute_force(void **state) {
        static tsr_placement_recent r;
        static tsr_placement_recent_match m;
        static int workers[8];
        uint64_t rng = 42, chain[16];
        const uint64_t t0 = 10ull * TSR_PLACEMENT_RECENT_NS;
        size_t partial = 0, whole = 0;        /* the cases the brute force must agree on */
        (void)state;

        memset(&r, 0, sizeof(r));
        for (int round = 0; round < 400; round++) {
                size_t n = 1 + (rng = rng * 6364136223846793005ull + 1442695040888963407ull) % 16;
                size_t shared = (rng >> 20) % (n + 1);
                for (size_t k = 0; k < n; k++)      /* chains share hashes 0..shared-1 (at most 3 roots) */
                        chain[k] = k < shared ? (k + 1) * 1000 + (rng >> 40) % 3 : (rng >> 8) + k * 77;
                uint64_t now = t0 + (uint64_t)round * (TSR_PLACEMENT_RECENT_NS / 100);
                tsr_placement_recent_scan(&r, chain, n, now, &m);
                for (size_t j = 1; j < m.n; j++)
                        assert_true((uintptr_t)m.h[j - 1].w < (uintptr_t)m.h[j].w);   /* sorted, one each */
                for (int w = 0; w < 8; w++) {
                        size_t want = brute_hits(&r, &workers[w], chain, n, now);
                        assert_int_equal(tsr_placement_recent_lookup(&m, &workers[w]), want);
                        partial += want > 0 && want < n;
                        whole += want == n;
                        assert_int_equal(tsr_placement_recent_hits(&r, &workers[w], chain, n, now), want);
                }
                tsr_placement_recent_add(&r, &workers[(rng >> 33) % 8], chain, n, now);
        }
        assert_true(partial > 50 && whole > 50);
        tsr_placement_recent_scan(&r, NULL, 0, t0, &m);
        assert_int_equal(m.n, 0);
        tsr_placement_recent_done(&r);
}

static void test_worker_dns_parse(void **state) {
        char name[64], err[256];
        int port = 0;
        (void)state;
        assert_int_equal(tsr_worker_dns_parse("tessera-workers.default.svc:5555", name, sizeof(name), &port, err,
                                          sizeof(err)), TSR_OK);
        assert_string_equal(name, "tessera-workers.default.svc");
        assert_int_equal(port, 5555);
        assert_int_equal(tsr_worker_dns_parse("localhost:1", name, sizeof(name), &port, err, sizeof(err)), TSR_OK);
        const char *bad[] = {"localhost", ":5555", "localhost:", "localhost:0", "localhost:65536", "localhost:55x",
                             "tcp://localhost:5555", "localhost:-1"};
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                err[0] = '\0';
                assert_int_equal(tsr_worker_dns_parse(bad[i], name, sizeof(name), &port, err, sizeof(err)), TSR_E_INVAL);
                assert_non_null(strstr(err, "--worker-dns"));
        }
        /* a name longer than the buffer is refused, not cut */
        assert_int_equal(tsr_worker_dns_parse("a-rather-long-name:80", name, 8, &port, err, sizeof(err)), TSR_E_INVAL);
}

typedef struct dns_probe {
        tsr_worker_pool *pool;
        tsr_worker_dns *dns;
        uv_timer_t poll;
        int ticks;
} dns_probe;

static void dns_probe_tick(uv_timer_t *t) {
        dns_probe *p = t->data;
        /* done once localhost was resolved and added, or after ~10 s */
        if (tsr_worker_pool_count(p->pool) > 0 || ++p->ticks > 1000) {
                uv_timer_stop(t);
                uv_close((uv_handle_t *)t, NULL);
                tsr_worker_dns_close(p->dns);
                tsr_worker_pool_close(p->pool, NULL, NULL);
        }
}

/* "localhost" resolves (via /etc/hosts, no network) to 127.0.0.1, which becomes a
 * worker of the pool with the given port; a second answer adds nothing twice. */
static void test_worker_dns_adds_localhost(void **state) {
        uv_loop_t loop;
        dns_probe p = {0};
        char err[256];
        const char *specs[] = {"localhost:45601"};
        (void)state;
        assert_int_equal(uv_loop_init(&loop), 0);
        assert_int_equal(tsr_worker_pool_new(&loop, "router-test", &p.pool), TSR_OK);
        assert_int_equal(tsr_worker_pool_add(p.pool, "tcp://127.0.0.1:45601"), TSR_OK);   /* also a --worker */
        assert_int_equal(tsr_worker_dns_start(&loop, p.pool, specs, 1, 10, &p.dns, err, sizeof(err)), TSR_OK);
        uv_timer_init(&loop, &p.poll);
        p.poll.data = &p;
        /* let several lookups (10 ms apart) complete before closing */
        p.ticks = 990;
        uv_timer_start(&p.poll, dns_probe_tick, 100, 10);
        uv_run(&loop, UV_RUN_DEFAULT);
        assert_int_equal(tsr_worker_pool_count(p.pool), 1);
        assert_string_equal(tsr_worker_endpoint(tsr_worker_pool_get(p.pool, 0)), "tcp://127.0.0.1:45601");
        tsr_worker_dns_free(&p.dns);
        tsr_worker_pool_free(&p.pool);
        assert_int_equal(uv_loop_close(&loop), 0);

        /* without the --worker entry, the lookup adds it */
        memset(&p, 0, sizeof(p));
        assert_int_equal(uv_loop_init(&loop), 0);
        assert_int_equal(tsr_worker_pool_new(&loop, "router-test", &p.pool), TSR_OK);
        assert_int_equal(tsr_worker_dns_start(&loop, p.pool, specs, 1, 10, &p.dns, err, sizeof(err)), TSR_OK);
        uv_timer_init(&loop, &p.poll);
        p.poll.data = &p;
        uv_timer_start(&p.poll, dns_probe_tick, 10, 10);
        uv_run(&loop, UV_RUN_DEFAULT);
        assert_int_equal(tsr_worker_pool_count(p.pool), 1);
        assert_string_equal(tsr_worker_endpoint(tsr_worker_pool_get(p.pool, 0)), "tcp://127.0.0.1:45601");
        tsr_worker_dns_free(&p.dns);
        tsr_worker_pool_free(&p.pool);
        assert_int_equal(uv_loop_close(&loop), 0);
}

static size_t fake_in_flight_n;
static size_t fake_in_flight(void *ud, const tsr_worker *w) {
        (void)ud;
        (void)w;
        return fake_in_flight_n;
}
static int removed_calls;
static void count_removed(void *ud, tsr_worker *w) {
        (void)ud;
        (void)w;
        removed_calls++;
}

static void set_flag(uv_timer_t *t) { *(bool *)t->data = true; }

/* Run the loop past one of the pool's 50 ms ticks (which reaps retired workers), and
 * the close callbacks after it.  A 60 ms timer, since UV_RUN_ONCE alone may return
 * early while the pool's idle kick is active. */
static void one_tick(uv_loop_t *loop) {
        uv_timer_t t;
        bool fired = false;
        uv_timer_init(loop, &t);
        t.data = &fired;
        uv_timer_start(&t, set_flag, 60, 0);
        while (!fired)
                uv_run(loop, UV_RUN_ONCE);
        uv_close((uv_handle_t *)&t, NULL);
        uv_run(loop, UV_RUN_NOWAIT);
}

/* The pool bookkeeping of --worker-dns, with answers fed by hand: an address gone from
 * TSR_WORKER_DNS_GONE_ANSWERS answers in a row is retired (no new requests), removed
 * only once nothing is in flight there, and added again when it comes back; a
 * --worker at an address the name also lists is never touched. */
static void test_worker_dns_retires_gone_addresses(void **state) {
        uv_loop_t loop;
        tsr_worker_pool *pool;
        tsr_worker_dns *dns;
        char err[256];
        const char *specs[] = {"svc:45611"};
        const char *both[] = {"tcp://127.0.0.1:45611", "tcp://127.0.0.2:45611"};
        const char *one[] = {"tcp://127.0.0.1:45611"};
        const char *other[] = {"tcp://127.0.0.2:45611"};
        worker_events ev = {.in_flight = fake_in_flight, .on_worker_removed = count_removed};
        (void)state;

        fake_in_flight_n = 0;
        removed_calls = 0;
        assert_int_equal(uv_loop_init(&loop), 0);
        assert_int_equal(tsr_worker_pool_new(&loop, "router-test", &pool), TSR_OK);
        tsr_worker_pool_set_events(pool, &ev);
        assert_int_equal(tsr_worker_pool_add(pool, "tcp://127.0.0.1:45611"), TSR_OK);   /* a --worker */
        assert_int_equal(tsr_worker_dns_start(&loop, pool, specs, 1, 0, &dns, err, sizeof(err)), TSR_OK);

        tsr_worker_dns_apply(dns, 0, both, 2);
        assert_int_equal(tsr_worker_pool_count(pool), 2);
        assert_non_null(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611"));

        /* The --worker leaves the answer: never retired. */
        for (unsigned i = 0; i < 2 * TSR_WORKER_DNS_GONE_ANSWERS; i++)
                tsr_worker_dns_apply(dns, 0, other, 1);
        assert_true(tsr_worker_accepting(tsr_worker_pool_find(pool, "tcp://127.0.0.1:45611")));

        /* Ours leaves: kept for GONE_ANSWERS - 1 answers, then retired. */
        for (unsigned i = 0; i + 1 < TSR_WORKER_DNS_GONE_ANSWERS; i++)
                tsr_worker_dns_apply(dns, 0, one, 1);
        assert_true(tsr_worker_accepting(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611")));
        tsr_worker_dns_apply(dns, 0, one, 1);
        assert_false(tsr_worker_accepting(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611")));

        /* Back before removal: taken again, and the count starts over. */
        tsr_worker_dns_apply(dns, 0, both, 2);
        assert_true(tsr_worker_accepting(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611")));
        tsr_worker_dns_apply(dns, 0, one, 1);
        one_tick(&loop);
        assert_int_equal(tsr_worker_pool_count(pool), 2);

        /* Gone again, with a request in flight there: retired, not removed. */
        for (unsigned i = 0; i < TSR_WORKER_DNS_GONE_ANSWERS; i++)
                tsr_worker_dns_apply(dns, 0, one, 1);
        fake_in_flight_n = 1;
        one_tick(&loop);
        assert_int_equal(tsr_worker_pool_count(pool), 2);
        assert_int_equal(removed_calls, 0);
        /* ... until it ends. */
        fake_in_flight_n = 0;
        one_tick(&loop);
        assert_int_equal(tsr_worker_pool_count(pool), 1);
        assert_int_equal(removed_calls, 1);
        assert_null(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611"));
        assert_non_null(tsr_worker_pool_find(pool, "tcp://127.0.0.1:45611"));

        /* An empty answer (the name is gone) still spares the --worker; the address
         * coming back is a new worker. */
        tsr_worker_dns_apply(dns, 0, NULL, 0);
        tsr_worker_dns_apply(dns, 0, both, 2);
        assert_int_equal(tsr_worker_pool_count(pool), 2);
        assert_true(tsr_worker_accepting(tsr_worker_pool_find(pool, "tcp://127.0.0.2:45611")));

        tsr_worker_dns_close(dns);
        tsr_worker_pool_close(pool, NULL, NULL);
        uv_run(&loop, UV_RUN_DEFAULT);
        tsr_worker_dns_free(&dns);
        tsr_worker_pool_free(&pool);
        assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_hashset_basic),
                cmocka_unit_test(test_hashset_churn),
                cmocka_unit_test(test_hashset_cap),
                cmocka_unit_test(test_mirror_events_and_gaps),
                cmocka_unit_test(test_cost),
                cmocka_unit_test(test_filters),
                cmocka_unit_test(test_pick),
                cmocka_unit_test(test_ttft_cost),
                cmocka_unit_test(test_imbalance_guard),
                cmocka_unit_test(test_cand_fill_and_pending),
                cmocka_unit_test(test_sent_list),
                cmocka_unit_test(test_recent_placements),
                cmocka_unit_test(test_recent_scan_matches_brute_force),
                cmocka_unit_test(test_worker_dns_parse),
                cmocka_unit_test(test_worker_dns_adds_localhost),
                cmocka_unit_test(test_worker_dns_retires_gone_addresses),
        };
        return cmocka_run_group_tests_name("placement", tests, NULL, NULL);
}
