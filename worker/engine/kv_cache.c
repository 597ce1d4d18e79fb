/* kv_cache.c - paged KV block pool with prefix caching (semantics in kv_cache.h).
 *
 * Layout: one array of per-block records.  The free queue threads through
 * prev/next (index num_blocks is the sentinel, so the list is circular and has no
 * special cases); the hash map is a chained table whose chains also thread through
 * the records (hnext), since a block is in the map at most once.  After
 * tsr_kv_cache_new nothing on the block paths allocates, so allocate_slots and
 * commit cannot fail half-way.
 *
 * Engine thread only. */
#include "worker/engine/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#define KV_NIL UINT32_MAX

typedef struct kv_block {
        uint64_t hash;           /* valid when has_hash */
        uint64_t parent;         /* hash of the previous block of its chain, when has_parent */
        uint32_t ref;
        uint32_t prev, next;     /* free-queue links; KV_NIL when not queued (ref > 0) */
        uint32_t hnext;          /* next block in the same hash bucket */
        bool has_hash;
        bool has_parent;
        uint8_t table;           /* the request table whose block it was hashed as (0: the
                                  * full-attention one, the only one events describe) */
} kv_block;

typedef struct kv_ev {
        tsr_kv_event_kind kind;
        bool has_parent;
        uint64_t parent;
        size_t first;            /* index into the hash array */
        size_t n;
} kv_ev;

struct tsr_kv_cache {
        uint32_t num_blocks;
        uint32_t block_size;
        uint32_t n_tables;          /* block tables per request (tsr_kv_cache_set_tables) */
        uint32_t chunk[TSR_KV_TABLES_MAX];  /* per table: 0 full attention, else its attention chunk */
        bool caching;
        tsr_block_hasher *hasher;   /* NULL when caching is off */

        kv_block *blocks;           /* num_blocks + 1; [num_blocks] is the queue sentinel */
        uint32_t num_free;
        uint32_t num_cached;
        uint64_t n_refs;            /* sum of ref counts, for tsr_kv_cache_check */

        uint32_t *buckets;          /* heads, mask + 1 of them */
        uint64_t mask;

        kv_ev *ev;                  /* event queue: ev_cap = h_cap + 1 events */
        uint64_t *ev_hashes;        /* h_cap */
        size_t n_ev, ev_cap, n_h, h_cap;

        uint64_t requests, queries, hits, evictions, overflows;

        /* tsr_kv_cache_set_hit_check: a hit of b > 0 blocks also needs hit_check(hit_ud,
         * hash of block b - 1) (NULL: every hit stands) */
        bool (*hit_check)(void *ud, uint64_t hash);
        void *hit_ud;
};

/* ---------------------------------------------------------------- free queue */

static void fq_remove(tsr_kv_cache *kv, uint32_t id) {
        kv_block *b = &kv->blocks[id];

        kv->blocks[b->prev].next = b->next;
        kv->blocks[b->next].prev = b->prev;
        b->prev = b->next = KV_NIL;
        kv->num_free--;
}

static void fq_push_tail(tsr_kv_cache *kv, uint32_t id) {
        uint32_t s = kv->num_blocks;
        kv_block *b = &kv->blocks[id];

        b->prev = kv->blocks[s].prev;
        b->next = s;
        kv->blocks[b->prev].next = id;
        kv->blocks[s].prev = id;
        kv->num_free++;
}

/* Caller checked num_free > 0. */
static uint32_t fq_pop_head(tsr_kv_cache *kv) {
        uint32_t id = kv->blocks[kv->num_blocks].next;
        fq_remove(kv, id);
        return id;
}

/* ---------------------------------------------------------------- hash map */

static uint64_t bucket_of(const tsr_kv_cache *kv, uint64_t h) {
        /* The hashes are already uniform, but fold the high bits in so a weak or
         * truncated hash still spreads over the buckets. */
        return ((h ^ (h >> 29)) * UINT64_C(0xbf58476d1ce4e5b9) >> 17) & kv->mask;
}

static uint32_t map_find(const tsr_kv_cache *kv, uint64_t h) {
        for (uint32_t id = kv->buckets[bucket_of(kv, h)]; id != KV_NIL; id = kv->blocks[id].hnext)
                if (kv->blocks[id].hash == h)
                        return id;
        return KV_NIL;
}

/* The map key of block hash h as a block of table t: h itself for table 0 (the router's
 * hashes), else h mixed with t, as vLLM keys a group's blocks by (hash, group id). */
static uint64_t table_key(uint64_t h, uint32_t t) {
        return t ? h ^ (UINT64_C(0x9e3779b97f4a7c15) * t) : h;
}

static void map_insert(tsr_kv_cache *kv, uint32_t id, uint64_t h, bool has_parent, uint64_t parent, uint32_t t) {
        kv_block *b = &kv->blocks[id];
        uint64_t k = bucket_of(kv, h);

        b->table = (uint8_t)t;
        b->hash = h;
        b->has_hash = true;
        b->parent = parent;
        b->has_parent = has_parent;
        b->hnext = kv->buckets[k];
        kv->buckets[k] = id;
        kv->num_cached++;
}

static void map_remove(tsr_kv_cache *kv, uint32_t id) {
        kv_block *b = &kv->blocks[id];
        uint32_t *link = &kv->buckets[bucket_of(kv, b->hash)];

        while (*link != id)
                link = &kv->blocks[*link].hnext;
        *link = b->hnext;
        b->hnext = KV_NIL;
        b->has_hash = false;
        b->has_parent = false;
        kv->num_cached--;
}

/* ---------------------------------------------------------------- events */

static void event_push(tsr_kv_cache *kv, tsr_kv_event_kind kind, uint64_t h, bool has_parent, uint64_t parent);

/* Drop the queue and describe the current state from scratch.  Fits by
 * construction: num_cached <= num_blocks <= h_cap hashes and ev_cap = h_cap + 1. */
void tsr_kv_cache_resync(tsr_kv_cache *kv) {
        kv->n_ev = kv->n_h = 0;
        event_push(kv, TSR_KV_EVENT_ALL_CLEARED, 0, false, 0);
        for (uint32_t id = 0; id < kv->num_blocks; id++) {
                const kv_block *b = &kv->blocks[id];
                if (b->has_hash && b->table == 0)
                        event_push(kv, TSR_KV_EVENT_STORED, b->hash, b->has_parent, b->parent);
        }
}

/* Overflow: the same snapshot, counted. */
static void event_resync(tsr_kv_cache *kv) {
        kv->overflows++;
        tsr_kv_cache_resync(kv);
}

/* Queue one event about one hash, merging into the previous event where the router
 * would see the same thing.  Called after the map already reflects the change, so a
 * resync triggered here covers this change too and the event itself is dropped. */
static void event_push(tsr_kv_cache *kv, tsr_kv_event_kind kind, uint64_t h, bool has_parent, uint64_t parent) {
        kv_ev *last = kv->n_ev ? &kv->ev[kv->n_ev - 1] : NULL;

        if (kind == TSR_KV_EVENT_ALL_CLEARED) {
                /* supersedes everything before it */
                kv->n_ev = kv->n_h = 0;
                kv->ev[kv->n_ev++] = (kv_ev){.kind = kind};
                return;
        }
        if (kv->n_h >= kv->h_cap) {
                event_resync(kv);
                return;
        }
        if (last && last->kind == kind && last->n > 0 &&
            (kind == TSR_KV_EVENT_REMOVED ||
             (has_parent && kv->ev_hashes[last->first + last->n - 1] == parent))) {
                kv->ev_hashes[kv->n_h++] = h;
                last->n++;
                return;
        }
        if (kv->n_ev >= kv->ev_cap) {
                event_resync(kv);
                return;
        }
        kv->ev[kv->n_ev++] = (kv_ev){
                .kind = kind, .has_parent = has_parent, .parent = parent, .first = kv->n_h, .n = 1};
        kv->ev_hashes[kv->n_h++] = h;
}

tsr_status tsr_kv_cache_set_event_cap(tsr_kv_cache *kv, size_t cap) {
        kv_ev *ev;
        uint64_t *hs;

        if (cap < kv->num_blocks)
                cap = kv->num_blocks;
        if (cap < 1)
                cap = 1;
        if (cap > SIZE_MAX / sizeof(kv_ev) - 1)
                return TSR_E_NOMEM;
        ev = malloc((cap + 1) * sizeof(*ev));
        hs = malloc(cap * sizeof(*hs));
        if (!ev || !hs) {
                free(ev);
                free(hs);
                return TSR_E_NOMEM;
        }
        free(kv->ev);
        free(kv->ev_hashes);
        kv->ev = ev;
        kv->ev_hashes = hs;
        kv->ev_cap = cap + 1;
        kv->h_cap = cap;
        bool had = kv->n_ev > 0;
        kv->n_ev = kv->n_h = 0;
        if (had)
                event_resync(kv);
        return TSR_OK;
}

tsr_status tsr_kv_cache_take_events(tsr_kv_cache *kv, tsr_kv_events **ret) {
        tsr_kv_events *e;
        uint64_t *hs;

        if (kv->n_ev == 0) {
                *ret = NULL;
                return TSR_OK;
        }
        /* one allocation: header, events, hashes (uint64_t alignment holds: both
         * structs are multiples of 8 bytes) */
        e = malloc(sizeof(*e) + kv->n_ev * sizeof(tsr_kv_event) + kv->n_h * sizeof(uint64_t));
        if (!e)
                return TSR_E_NOMEM;
        e->n = kv->n_ev;
        e->ev = (tsr_kv_event *)(e + 1);
        hs = (uint64_t *)(e->ev + kv->n_ev);
        memcpy(hs, kv->ev_hashes, kv->n_h * sizeof(uint64_t));
        for (size_t i = 0; i < kv->n_ev; i++) {
                const kv_ev *s = &kv->ev[i];
                e->ev[i] = (tsr_kv_event){
                        .kind = s->kind,
                        .has_parent = s->has_parent,
                        .parent_hash = s->parent,
                        .n_hashes = s->n,
                        .hashes = s->n ? hs + s->first : NULL,
                };
        }
        kv->n_ev = kv->n_h = 0;
        *ret = e;
        return TSR_OK;
}

void tsr_kv_events_free(tsr_kv_events **e) {
        if (!e)
                return;
        free(*e);
        *e = NULL;
}

/* ---------------------------------------------------------------- lifetime */

tsr_status tsr_kv_cache_new(uint32_t num_blocks, uint32_t block_size, bool enable_prefix_caching,
                            tsr_block_hash_algo algo, tsr_kv_cache **ret) {
        tsr_kv_cache *kv;
        tsr_status st = TSR_E_NOMEM;
        uint64_t n_buckets = 1;
        size_t cap;

        if (num_blocks == 0 || num_blocks >= (UINT32_C(1) << 31) || block_size == 0 || block_size > 65536)
                return TSR_E_INVAL;
        if (algo != TSR_BLOCK_HASH_SHA256 && algo != TSR_BLOCK_HASH_XXHASH)
                return TSR_E_INVAL;
        kv = calloc(1, sizeof(*kv));
        if (!kv)
                return TSR_E_NOMEM;
        kv->num_blocks = num_blocks;
        kv->block_size = block_size;
        kv->n_tables = 1;
        kv->caching = enable_prefix_caching;
        kv->blocks = calloc((size_t)num_blocks + 1, sizeof(kv_block));
        while (n_buckets < num_blocks)
                n_buckets <<= 1;
        kv->mask = n_buckets - 1;
        kv->buckets = malloc(n_buckets * sizeof(uint32_t));
        if (!kv->blocks || !kv->buckets)
                goto fail;
        memset(kv->buckets, 0xff, n_buckets * sizeof(uint32_t));    /* KV_NIL */
        if (enable_prefix_caching) {
                st = tsr_block_hasher_new(algo, &kv->hasher);
                if (st != TSR_OK)
                        goto fail;
        }
        /* every block free, in id order, so a fresh cache hands out 0, 1, 2, ... */
        kv->blocks[num_blocks].prev = kv->blocks[num_blocks].next = num_blocks;
        for (uint32_t id = 0; id < num_blocks; id++) {
                kv->blocks[id].hnext = KV_NIL;
                fq_push_tail(kv, id);
        }
        /* room for two full turnovers of the cache between Status messages; past
         * 4M hashes (128 MiB of queue) rely on the resync instead */
        cap = (size_t)num_blocks * 2;
        if (cap < 1024)
                cap = 1024;
        if (cap > ((size_t)1 << 22))
                cap = (size_t)1 << 22;      /* set_event_cap raises it to num_blocks */
        st = tsr_kv_cache_set_event_cap(kv, cap);
        if (st != TSR_OK)
                goto fail;
        *ret = kv;
        return TSR_OK;
fail:
        tsr_kv_cache_free(&kv);
        return st;
}

void tsr_kv_cache_free(tsr_kv_cache **kvp) {
        tsr_kv_cache *kv = kvp ? *kvp : NULL;

        if (!kv)
                return;
        tsr_block_hasher_free(&kv->hasher);
        free(kv->blocks);
        free(kv->buckets);
        free(kv->ev);
        free(kv->ev_hashes);
        free(kv);
        *kvp = NULL;
}

uint32_t tsr_kv_cache_block_size(const tsr_kv_cache *kv) { return kv->block_size; }

tsr_status tsr_kv_cache_set_tables(tsr_kv_cache *kv, const uint32_t *chunk, size_t n_tables) {
        if (n_tables == 0 || n_tables > TSR_KV_TABLES_MAX || kv->num_free != kv->num_blocks)
                return TSR_E_INVAL;
        kv->n_tables = (uint32_t)n_tables;
        memcpy(kv->chunk, chunk, n_tables * sizeof *chunk);
        return TSR_OK;
}

uint32_t tsr_kv_cache_tables(const tsr_kv_cache *kv) { return kv->n_tables; }

size_t tsr_kv_req_table(const tsr_kv_cache *kv, const tsr_kv_req *r, uint32_t *out) {
        const uint32_t T = kv->n_tables;

        for (uint32_t t = 0; t < T; t++)
                for (uint32_t b = 0; b < r->n_blocks; b++)
                        out[(size_t)t * r->n_blocks + b] = r->block_ids[(size_t)b * T + t];
        return (size_t)T * r->n_blocks;
}

uint32_t tsr_kv_req_held(const tsr_kv_cache *kv, const tsr_kv_req *r) {
        uint32_t n = 0;

        for (size_t i = 0; i < (size_t)r->n_blocks * kv->n_tables; i++)
                n += r->block_ids[i] != TSR_KV_NULL_BLOCK;
        return n;
}

/* ---------------------------------------------------------------- requests */

tsr_status tsr_kv_req_init(tsr_kv_req *r, const void *salt, size_t salt_len) {
        memset(r, 0, sizeof(*r));
        if (salt_len > TSR_KV_SALT_MAX)
                return TSR_E_LIMIT;
        if (salt_len) {
                r->_salt = malloc(salt_len);
                if (!r->_salt)
                        return TSR_E_NOMEM;
                memcpy(r->_salt, salt, salt_len);
                r->_salt_len = salt_len;
        }
        return TSR_OK;
}

void tsr_kv_req_done(tsr_kv_cache *kv, tsr_kv_req *r) {
        if (kv && r->n_blocks)
                tsr_kv_cache_free_blocks(kv, r);
        free(r->block_ids);
        free(r->_hashes);
        free(r->_salt);
        memset(r, 0, sizeof(*r));
}

/* Room for n logical blocks of `tables` entries each. */
static tsr_status req_reserve_blocks(tsr_kv_req *r, size_t n, uint32_t tables) {
        uint32_t *p;
        size_t cap = r->_cap_blocks ? r->_cap_blocks : 8;

        if (n > UINT32_MAX / tables)
                return TSR_E_LIMIT;
        n *= tables;
        if (n <= r->_cap_blocks)
                return TSR_OK;
        while (cap < n)
                cap *= 2;
        if (cap > UINT32_MAX)
                cap = UINT32_MAX;
        p = realloc(r->block_ids, cap * sizeof(*p));
        if (!p)
                return TSR_E_NOMEM;
        r->block_ids = p;
        r->_cap_blocks = (uint32_t)cap;
        return TSR_OK;
}

/* Extend r's hash chain to cover the first n_full full blocks of `tokens`.  Hashes
 * already computed are kept: they depend only on tokens the request cannot change.
 * On failure the chain keeps a valid prefix. */
static tsr_status req_hash_up_to(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *tokens, size_t n_full) {
        const size_t bs = kv->block_size;

        if (n_full > r->_cap_hashes) {
                size_t cap = r->_cap_hashes ? r->_cap_hashes : 8;
                uint64_t *p;
                while (cap < n_full)
                        cap *= 2;
                p = realloc(r->_hashes, cap * sizeof(*p));
                if (!p)
                        return TSR_E_NOMEM;
                r->_hashes = p;
                r->_cap_hashes = cap;
        }
        for (size_t i = r->_n_hashes; i < n_full; i++) {
                uint64_t parent = i ? r->_hashes[i - 1] : TSR_BLOCK_HASH_NONE;
                tsr_status st = tsr_block_hasher_hash(kv->hasher, parent, tokens + i * bs, bs, i ? NULL : r->_salt,
                                                      i ? 0 : r->_salt_len, &r->_hashes[i]);
                if (st != TSR_OK)
                        return st;
                r->_n_hashes = i + 1;
        }
        return TSR_OK;
}

/* vLLM's HybridKVCacheCoordinator over table 0's hit of n_hit blocks (full attention):
 * each other table's hit for that length (a chunked one's: null blocks before the chunk
 * of the hit's end, then its cached blocks from there, ChunkedLocalAttentionManager.
 * find_longest_cache_hit; a full one's: its cached blocks from 0) may be shorter, which
 * cuts the hit and moves the chunk start back, until no table cuts it.  Writes the
 * tables' hit entries of r (table 0's are there already). */
static size_t tables_hit(const tsr_kv_cache *kv, tsr_kv_req *r, size_t n_hit) {
        const uint32_t T = kv->n_tables;

        for (bool moved = T > 1; moved;) {
                moved = false;
                for (uint32_t t = 1; t < T && !moved; t++) {
                        size_t C = kv->chunk[t], start = C ? n_hit * kv->block_size / C * C / kv->block_size : 0;
                        for (size_t b = 0; b < n_hit; b++) {
                                /* (TSR_KV_NULL_BLOCK and KV_NIL are both UINT32_MAX) */
                                uint32_t id = b < start ? TSR_KV_NULL_BLOCK
                                                        : map_find(kv, table_key(r->_hashes[b], t));
                                if (b >= start && id == KV_NIL) {
                                        n_hit = b;
                                        moved = true;   /* every table again, for the shorter hit */
                                        break;
                                }
                                r->block_ids[b * T + t] = id;
                        }
                }
        }
        return n_hit;
}

tsr_status tsr_kv_cache_get_computed_blocks(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *tokens,
                                            size_t n_tokens, bool skip_read, size_t *ret_cached) {
        size_t max_hit, n_hit = 0;
        tsr_status st;

        if (r->n_blocks != 0)
                return TSR_E_INVAL;
        r->_n_hit = 0;
        if (!kv->caching || skip_read || n_tokens == 0) {
                /* a skip_read request still writes to the cache: commit hashes its
                 * blocks as they fill */
                r->num_cached_tokens = 0;
                *ret_cached = 0;
                return TSR_OK;
        }
        st = req_hash_up_to(kv, r, tokens, n_tokens / kv->block_size);
        if (st != TSR_OK)
                return st;
        max_hit = (n_tokens - 1) / kv->block_size;
        if (max_hit > kv->num_cached)
                max_hit = kv->num_cached;   /* no longer hit is possible; bounds the table */
        st = req_reserve_blocks(r, max_hit, kv->n_tables);
        if (st != TSR_OK)
                return st;
        for (; n_hit < max_hit; n_hit++) {
                uint32_t id = map_find(kv, r->_hashes[n_hit]);
                if (id == KV_NIL)
                        break;
                r->block_ids[n_hit * kv->n_tables] = id;
        }
        n_hit = tables_hit(kv, r, n_hit);
        /* vLLM's MambaManager.find_longest_cache_hit: the hit must end where a state was
         * kept; a shorter hit is checked against every table again */
        while (kv->hit_check && n_hit > 0 && !kv->hit_check(kv->hit_ud, r->_hashes[n_hit - 1]))
                n_hit = tables_hit(kv, r, n_hit - 1);
        r->_n_hit = (uint32_t)n_hit;
        r->num_cached_tokens = n_hit * kv->block_size;
        kv->requests++;
        kv->queries += n_tokens;
        kv->hits += r->num_cached_tokens;
        *ret_cached = r->num_cached_tokens;
        return TSR_OK;
}

void tsr_kv_cache_set_hit_check(tsr_kv_cache *kv, bool (*check)(void *ud, uint64_t hash), void *ud) {
        kv->hit_check = check;
        kv->hit_ud = ud;
}

bool tsr_kv_req_block_hash(const tsr_kv_req *r, size_t b, uint64_t *ret) {
        if (b >= r->_n_hashes)
                return false;
        *ret = r->_hashes[b];
        return true;
}

size_t tsr_kv_req_common_blocks(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *tokens, size_t n_tokens,
                                const tsr_kv_req *other) {
        size_t n, i = 0;
        if (!kv->caching || req_hash_up_to(kv, r, tokens, n_tokens / kv->block_size) != TSR_OK)
                return 0;
        n = r->_n_hashes < other->_n_hashes ? r->_n_hashes : other->_n_hashes;
        /* Chained hashes: equal at block i means equal blocks 0..i (and salt), so the
         * first difference ends the common prefix. */
        while (i < n && r->_hashes[i] == other->_hashes[i])
                i++;
        return i;
}

tsr_status tsr_kv_cache_allocate_slots(tsr_kv_cache *kv, tsr_kv_req *r, size_t num_new_tokens) {
        const size_t bs = kv->block_size;
        size_t have, total, need, n_new, free_hits = 0;
        tsr_status st;

        have = r->_n_hit ? (size_t)r->_n_hit * bs : r->n_computed;
        if (num_new_tokens > SIZE_MAX - bs - have)
                return TSR_E_INVAL;
        total = have + num_new_tokens;
        need = (total + bs - 1) / bs;
        if (need <= (size_t)r->n_blocks + r->_n_hit) {
                n_new = 0;
        } else {
                n_new = need - r->n_blocks - r->_n_hit;
        }
        /* parked hits must still be what get_computed_blocks found (every table's) */
        for (size_t i = 0; i < (size_t)r->_n_hit * kv->n_tables; i++) {
                const kv_block *b;
                if (r->block_ids[i] == TSR_KV_NULL_BLOCK)
                        continue;       /* a chunked table's, before the hit's chunk */
                b = &kv->blocks[r->block_ids[i]];
                if (!b->has_hash || b->hash != table_key(r->_hashes[i / kv->n_tables], (uint32_t)(i % kv->n_tables)))
                        return TSR_E_INVAL;
                if (b->ref == 0)
                        free_hits++;
        }
        /* every table takes a block for each new logical block: no new block lies
         * behind a chunk (they start at or after n_computed) */
        if (n_new > (kv->num_free - free_hits) / kv->n_tables)
                return TSR_E_UNAVAILABLE;
        st = req_reserve_blocks(r, (size_t)r->n_blocks + r->_n_hit + n_new, kv->n_tables);
        if (st != TSR_OK)
                return st;

        /* nothing below can fail */
        for (size_t i = 0; i < (size_t)r->_n_hit * kv->n_tables; i++) {
                uint32_t id = r->block_ids[i];
                if (id == TSR_KV_NULL_BLOCK)
                        continue;
                if (kv->blocks[id].ref++ == 0)
                        fq_remove(kv, id);
                kv->n_refs++;
        }
        if (r->_n_hit) {
                r->n_blocks = r->_n_hit;
                r->n_computed = (size_t)r->_n_hit * bs;
                r->_n_registered = r->_n_hit;
                r->_n_hit = 0;
        }
        for (size_t i = 0; i < n_new * kv->n_tables; i++) {
                uint32_t id = fq_pop_head(kv);
                kv_block *b = &kv->blocks[id];
                if (b->has_hash) {
                        uint64_t h = b->hash;
                        bool seen = b->table == 0;      /* by the router's mirror */
                        map_remove(kv, id);
                        kv->evictions++;
                        if (seen)
                                event_push(kv, TSR_KV_EVENT_REMOVED, h, false, 0);
                }
                b->ref = 1;
                kv->n_refs++;
                r->block_ids[(size_t)r->n_blocks * kv->n_tables + i % kv->n_tables] = id;
                if (i % kv->n_tables == kv->n_tables - 1)
                        r->n_blocks++;
        }
        return TSR_OK;
}

static void block_release(tsr_kv_cache *kv, uint32_t id) {
        kv->n_refs--;
        if (--kv->blocks[id].ref == 0)
                fq_push_tail(kv, id);
}

/* vLLM's ChunkedLocalAttentionManager.remove_skipped_blocks: a chunked table's blocks
 * wholly before the chunk of position r->n_computed are never read again.  Walks back
 * from the last such block and stops at the first null entry (those before it were
 * freed by an earlier call). */
static void drop_behind_chunks(tsr_kv_cache *kv, tsr_kv_req *r) {
        const uint32_t T = kv->n_tables;

        for (uint32_t t = 0; t < T; t++) {
                size_t skip, b;
                if (!kv->chunk[t])
                        continue;
                skip = r->n_computed / kv->chunk[t] * kv->chunk[t];
                for (b = skip / kv->block_size; b-- > 0;) {
                        uint32_t *e = &r->block_ids[b * T + t];
                        if (*e == TSR_KV_NULL_BLOCK)
                                break;
                        block_release(kv, *e);
                        *e = TSR_KV_NULL_BLOCK;
                }
        }
}

tsr_status tsr_kv_cache_commit(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *all_tokens, size_t n_computed) {
        size_t n_full;
        tsr_status st;

        if (n_computed < r->n_computed || n_computed > (size_t)r->n_blocks * kv->block_size)
                return TSR_E_INVAL;
        if (!kv->caching) {
                r->n_computed = n_computed;
                drop_behind_chunks(kv, r);
                return TSR_OK;
        }
        n_full = n_computed / kv->block_size;
        st = req_hash_up_to(kv, r, all_tokens, n_full);
        if (st != TSR_OK)
                return st;
        /* every table's new full blocks, each under its table's key; STORED events
         * for table 0's only (the router's hashes) */
        for (size_t i = r->_n_registered; i < n_full; i++) {
                for (uint32_t t = 0; t < kv->n_tables; t++) {
                        uint32_t id = r->block_ids[i * kv->n_tables + t];
                        uint64_t h = table_key(r->_hashes[i], t);
                        bool has_parent = i > 0 && t == 0;
                        uint64_t parent = has_parent ? r->_hashes[i - 1] : 0;

                        /* A block can only carry a hash here if reset_prefix_cache had not
                         * touched it, which cannot happen for an unregistered block; and a
                         * duplicate keeps the older mapping (it may be shared already). */
                        if (id == TSR_KV_NULL_BLOCK || kv->blocks[id].has_hash || map_find(kv, h) != KV_NIL)
                                continue;
                        map_insert(kv, id, h, has_parent, parent, t);
                        if (t == 0)
                                event_push(kv, TSR_KV_EVENT_STORED, h, has_parent, parent);
                }
        }
        if (n_full > r->_n_registered)
                r->_n_registered = (uint32_t)n_full;
        r->n_computed = n_computed;
        drop_behind_chunks(kv, r);
        return TSR_OK;
}

void tsr_kv_cache_free_blocks(tsr_kv_cache *kv, tsr_kv_req *r) {
        /* last block first: it reaches the tail first and is evicted first, so the
         * request's prefix (the part others may share) stays cached longest */
        for (size_t i = (size_t)r->n_blocks * kv->n_tables; i-- > 0;)
                if (r->block_ids[i] != TSR_KV_NULL_BLOCK)
                        block_release(kv, r->block_ids[i]);
        r->n_blocks = 0;
        r->n_computed = 0;
        r->_n_hit = 0;
        r->_n_registered = 0;
}

void tsr_kv_cache_reset_prefix_cache(tsr_kv_cache *kv) {
        if (!kv->caching)
                return;
        for (uint32_t id = 0; id < kv->num_blocks; id++)
                if (kv->blocks[id].has_hash)
                        map_remove(kv, id);
        event_push(kv, TSR_KV_EVENT_ALL_CLEARED, 0, false, 0);
}

/* ---------------------------------------------------------------- observation */

void tsr_kv_cache_stats(const tsr_kv_cache *kv, tsr_kv_stats *ret) {
        *ret = (tsr_kv_stats){
                .num_blocks = kv->num_blocks,
                .num_free = kv->num_free,
                .num_active = kv->num_blocks - kv->num_free,
                .num_cached = kv->num_cached,
                .usage = 1.0 - (double)kv->num_free / (double)kv->num_blocks,
                .prefix_cache_requests = kv->requests,
                .prefix_cache_queries = kv->queries,
                .prefix_cache_hits = kv->hits,
                .evictions = kv->evictions,
                .event_overflows = kv->overflows,
        };
}

size_t tsr_kv_cache_cached_hashes(const tsr_kv_cache *kv, uint64_t *out, size_t cap) {
        size_t n = 0;

        for (uint32_t id = 0; id < kv->num_blocks; id++) {
                if (!kv->blocks[id].has_hash || kv->blocks[id].table != 0)
                        continue;
                if (n < cap)
                        out[n] = kv->blocks[id].hash;
                n++;
        }
        return n;
}

uint32_t tsr_kv_cache_block_ref(const tsr_kv_cache *kv, uint32_t id) {
        return id < kv->num_blocks ? kv->blocks[id].ref : 0;
}

tsr_status tsr_kv_cache_check(const tsr_kv_cache *kv) {
        const uint32_t s = kv->num_blocks;
        uint32_t n_queued = 0, n_zero = 0, n_hashed = 0, n_mapped = 0;
        uint64_t refs = 0;
        size_t n_h = 0;

        /* free queue: a well-linked cycle through the sentinel, ref-0 blocks only */
        uint32_t last = s;
        for (uint32_t id = kv->blocks[s].next; id != s; last = id, id = kv->blocks[id].next) {
                if (id >= s || kv->blocks[id].prev != last || kv->blocks[id].ref != 0 || ++n_queued > s)
                        return TSR_E_INTERNAL;
        }
        if (kv->blocks[s].prev != last)
                return TSR_E_INTERNAL;
        for (uint32_t id = 0; id < s; id++) {
                const kv_block *b = &kv->blocks[id];
                if (b->ref == 0) {
                        n_zero++;
                } else if (b->prev != KV_NIL || b->next != KV_NIL) {
                        return TSR_E_INTERNAL;
                }
                refs += b->ref;
                if (b->has_hash) {
                        n_hashed++;
                        if (!kv->caching || map_find(kv, b->hash) != id)
                                return TSR_E_INTERNAL;
                } else if (b->has_parent) {
                        return TSR_E_INTERNAL;
                }
        }
        if (n_queued != kv->num_free || n_zero != kv->num_free || refs != kv->n_refs)
                return TSR_E_INTERNAL;
        /* every chained entry is a hashed block in its right bucket, no cycles */
        for (uint64_t k = 0; k <= kv->mask; k++) {
                for (uint32_t id = kv->buckets[k]; id != KV_NIL; id = kv->blocks[id].hnext) {
                        if (id >= s || !kv->blocks[id].has_hash || bucket_of(kv, kv->blocks[id].hash) != k ||
                            ++n_mapped > s)
                                return TSR_E_INTERNAL;
                }
        }
        if (n_mapped != n_hashed || n_hashed != kv->num_cached)
                return TSR_E_INTERNAL;
        /* event queue bounds and contiguity */
        if (kv->n_ev > kv->ev_cap || kv->n_h > kv->h_cap)
                return TSR_E_INTERNAL;
        for (size_t i = 0; i < kv->n_ev; i++) {
                const kv_ev *e = &kv->ev[i];
                if (e->first != n_h || (e->kind == TSR_KV_EVENT_ALL_CLEARED) != (e->n == 0) ||
                    (e->kind == TSR_KV_EVENT_ALL_CLEARED && i != 0))
                        return TSR_E_INTERNAL;
                n_h += e->n;
        }
        return n_h == kv->n_h ? TSR_OK : TSR_E_INTERNAL;
}

tsr_status tsr_kv_req_check(const tsr_kv_cache *kv, const tsr_kv_req *r) {
        const uint32_t T = kv->n_tables;

        if ((size_t)r->n_blocks * T > r->_cap_blocks || r->n_computed > (size_t)r->n_blocks * kv->block_size ||
            r->_n_registered > r->n_blocks || (r->n_blocks && r->_n_hit))
                return TSR_E_INTERNAL;
        if (kv->caching && r->_n_registered > r->_n_hashes)
                return TSR_E_INTERNAL;
        for (size_t i = 0; i < (size_t)r->n_blocks * T; i++) {
                uint32_t id = r->block_ids[i], t = (uint32_t)(i % T);
                size_t b = i / T;
                if (id == TSR_KV_NULL_BLOCK) {
                        /* only a chunked table's blocks behind the chunk of n_computed */
                        if (!kv->chunk[t] || (b + 1) * kv->block_size > r->n_computed / kv->chunk[t] * kv->chunk[t])
                                return TSR_E_INTERNAL;
                        continue;
                }
                if (id >= kv->num_blocks || kv->blocks[id].ref == 0)
                        return TSR_E_INTERNAL;
                for (size_t j = 0; j < i; j++)
                        if (r->block_ids[j] == id)
                                return TSR_E_INTERNAL;
                if (b < r->_n_registered && kv->blocks[id].has_hash && kv->blocks[id].hash != table_key(r->_hashes[b], t))
                        return TSR_E_INTERNAL;
        }
        return TSR_OK;
}
