/* kv_cache.h - paged KV block pool with prefix caching: the bookkeeping half.
 *
 * The model runner owns the tensor memory (worker/model/runner.c: per layer,
 * [num_blocks][block_size][kv heads][head_dim] for K and for V); the engine passes it
 * the block ids kept here, which index that memory: token t of a
 * request lives in block r->block_ids[t / block_size], row t % block_size.  This
 * module decides which ids a request gets, which full blocks can be shared through
 * the prefix cache, and which cached block to evict, with vLLM V1's semantics
 * (vLLM's KVCacheManager and BlockPool):
 *
 *  - every block has a ref count; blocks with ref 0 sit in one free queue (an
 *    intrusive doubly linked list over block ids, all operations O(1));
 *  - new blocks come from the HEAD of the queue; a popped block that still carries a
 *    hash is evicted from the hash map then (REMOVED event);
 *  - a request's blocks are released last block first to the TAIL, keeping their
 *    hash, so eviction is LRU and, within a request, the tail goes before the shared
 *    prefix;
 *  - a full block gets hash_i = block_hash(hash_{i-1}, its token ids, salt if i==0)
 *    (common/block_hash.h, the same chain the router computes) when the engine
 *    commits it, and is then findable by that hash until evicted;
 *  - a lookup walks the request's chain from block 0 and stops at the first miss,
 *    capped so that at least one prompt token is recomputed (the sampler needs its
 *    logits).
 * Unlike vLLM there is no reserved null block: all num_blocks ids are usable, and a
 * table entry that vLLM would point at its null block holds TSR_KV_NULL_BLOCK.
 *
 * Block tables (issue #14).  A request holds one block table per table the cache was
 * given (tsr_kv_cache_set_tables; 1 by default), all drawn from the one free queue, as
 * vLLM's KV cache groups share one BlockPool.  Table t is full attention (chunk 0: every
 * block kept) or chunked-local attention with chunk C (vLLM's
 * ChunkedLocalAttentionManager): after each commit, the blocks wholly before the chunk
 * of the next position, floor(n_computed / C) * C, go back to the free queue and their
 * entries become TSR_KV_NULL_BLOCK.  Each logical block b of a request takes one id per
 * table, so allocate_slots needs n_tables free blocks per new block.  Prefix caching
 * with several tables follows vLLM's HybridKVCacheCoordinator for full + chunked-local
 * groups: every table's full blocks are hashed, table t's under the chain hash mixed
 * with t (vLLM keys them by hash and group id; a chunked block freed behind its chunk
 * keeps its hash until evicted); a hit is table 0's (full attention) run of cached
 * blocks, which each other table must also have from the chunk of the hit's end on
 * (ChunkedLocalAttentionManager.find_longest_cache_hit), else the hit is cut back and
 * tried again; the chunked entries before that chunk are null.  Events (and
 * tsr_kv_cache_cached_hashes) describe table 0's blocks only: the router's hashes.
 *
 * Call order per request (engine thread):
 *   tsr_kv_req_init -> [get_computed_blocks (waiting requests) -> allocate_slots ->
 *   forward -> commit]* -> free_blocks (finish, abort or preemption) -> ... ->
 *   tsr_kv_req_done.
 * After a preemption the request starts again with get_computed_blocks.
 *
 * Thread: everything here belongs to the engine thread; nothing is thread-safe. */
#ifndef TSR_WORKER_KV_CACHE_H
#define TSR_WORKER_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/block_hash.h"
#include "common/tsr_status.h"

/* Longest cache_salt accepted (bytes): the salt is client-controlled. */
#define TSR_KV_SALT_MAX 1024

/* A table entry whose block was freed behind a chunked table's chunk (vLLM's null block). */
#define TSR_KV_NULL_BLOCK UINT32_MAX
/* The most block tables a request holds (kv_pool.h's TSR_KV_GROUPS_MAX paged groups). */
#define TSR_KV_TABLES_MAX 4

typedef struct tsr_kv_cache tsr_kv_cache;

/* One request's KV bookkeeping, embedded in the engine's slot.  Fields without `_`
 * are read-only outside this module; `_` fields are private. */
typedef struct tsr_kv_req {
        /* The block tables, block-major: entry b * n_tables + t is block b of table t
         * (with one table, simply the block table); TSR_KV_NULL_BLOCK for a chunked
         * table's block freed behind its chunk.  tsr_kv_req_table writes them table by
         * table for a forward. */
        uint32_t *block_ids;
        uint32_t n_blocks;          /* logical blocks: entries per table */
        size_t n_computed;          /* leading tokens whose KV is stored (hits + commits) */
        size_t num_cached_tokens;   /* prefix-cache hit of the last get_computed_blocks, tokens */

        uint32_t _cap_blocks;       /* entries of block_ids */
        uint32_t _n_hit;            /* hits parked in block_ids[0.._n_hit) until allocate_slots */
        uint32_t _n_registered;     /* leading blocks already offered to the hash map */
        uint64_t *_hashes;          /* chain hashes of the full blocks seen so far */
        size_t _n_hashes, _cap_hashes;
        uint8_t *_salt;
        size_t _salt_len;
} tsr_kv_req;

/* Embedded-object init.  Copies `salt` (the request's cache_salt, mixed into block 0
 * only; NULL/0 for none).  TSR_OK, TSR_E_LIMIT past TSR_KV_SALT_MAX, TSR_E_NOMEM; on
 * failure *r is left zeroed and tsr_kv_req_done on it is a no-op. */
tsr_status tsr_kv_req_init(tsr_kv_req *r, const void *salt, size_t salt_len);
/* Release the request's blocks to `kv` (as tsr_kv_cache_free_blocks) if it holds any,
 * then its memory.  `kv` may be NULL only when the request holds no blocks. */
void tsr_kv_req_done(tsr_kv_cache *kv, tsr_kv_req *r);

/* num_blocks in [1, 2^31), block_size in [1, 2^16].  *ret written only on success:
 * TSR_OK, TSR_E_INVAL for a bad size or algo, TSR_E_NOMEM. */
tsr_status tsr_kv_cache_new(uint32_t num_blocks, uint32_t block_size, bool enable_prefix_caching,
                            tsr_block_hash_algo algo, tsr_kv_cache **ret);
/* Accepts NULL; clears the caller's pointer.  Requests that still hold blocks are
 * dead with it: free their memory with tsr_kv_req_done(NULL, r). */
void tsr_kv_cache_free(tsr_kv_cache **kv);

uint32_t tsr_kv_cache_block_size(const tsr_kv_cache *kv);

/* Give each request n_tables block tables: chunk[t] 0 for full attention, else the
 * attention chunk (tokens) of a chunked-local table (see the top).  Put a full-attention
 * table first where there is one: a prefix-cache hit starts from table 0's run of cached
 * blocks (a chunked table 0 then needs its blocks from 0 for a hit: fewer hits, never a
 * wrong one) and events describe its blocks.  Before any request holds blocks.
 * TSR_E_INVAL for 0 or more than TSR_KV_TABLES_MAX tables, or blocks in use. */
tsr_status tsr_kv_cache_set_tables(tsr_kv_cache *kv, const uint32_t *chunk, size_t n_tables);
uint32_t tsr_kv_cache_tables(const tsr_kv_cache *kv);
/* Write r's tables table by table to out[tables * r->n_blocks] (table t at
 * out + t * r->n_blocks: a forward's layout, engine.h tsr_engine_seq); returns the
 * entries written. */
size_t tsr_kv_req_table(const tsr_kv_cache *kv, const tsr_kv_req *r, uint32_t *out);
/* Blocks r holds (its entries that are not TSR_KV_NULL_BLOCK). */
uint32_t tsr_kv_req_held(const tsr_kv_cache *kv, const tsr_kv_req *r);

/* Prefix-cache lookup for a request that holds no blocks (new, or preempted and
 * released).  Hashes the full blocks of tokens[0..n_tokens) (the prompt, plus tokens
 * generated before a preemption) and finds the longest run of cached blocks from
 * block 0, capped at (n_tokens - 1) / block_size blocks so at least one token is
 * recomputed.  *ret_cached (and r->num_cached_tokens) = hit blocks * block_size.
 * The hit blocks are parked in `r` (not yet referenced) until allocate_slots, which
 * must be the next operation on this cache that can evict (see there).
 * With caching disabled, or `skip_read` (the request wants prompt logprobs), nothing
 * is looked up and the answer is 0; otherwise the query and hit counters grow by
 * n_tokens and *ret_cached (tokens, vLLM's metric).  TSR_E_INVAL when r holds blocks;
 * TSR_E_NOMEM, TSR_E_INTERNAL (hashing).  *ret_cached written only on success. */
tsr_status tsr_kv_cache_get_computed_blocks(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *tokens,
                                            size_t n_tokens, bool skip_read, size_t *ret_cached);

/* A further condition on a hit (vLLM's Mamba prefix caching: a hybrid's hit must end
 * at a block whose recurrent state was kept, state_cache.h): get_computed_blocks cuts a
 * hit of b > 0 blocks back until check(ud, chain hash of block b - 1) holds (or b is 0).
 * NULL: none.  The counters count the hit after the cut. */
void tsr_kv_cache_set_hit_check(tsr_kv_cache *kv, bool (*check)(void *ud, uint64_t hash), void *ud);

/* The chain hash of r's block b (table 0's, salt included) when r has hashed it (its
 * full blocks up to its last lookup, plus every block it committed since, with caching
 * on); false otherwise. */
bool tsr_kv_req_block_hash(const tsr_kv_req *r, size_t b, uint64_t *ret);

/* How many leading full blocks of tokens[0..n_tokens) `r` has in common with the hash
 * chain of `other` (the blocks `other` has hashed: its full blocks up to its last
 * lookup, plus every block it committed since).  Hashes r's full blocks first, as
 * get_computed_blocks would (kept in r, so that lookup does not hash them again).
 * 0 with caching disabled or when hashing fails.  For the scheduler: a waiting request
 * sharing blocks that a running one has not computed yet can wait for them. */
size_t tsr_kv_req_common_blocks(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *tokens, size_t n_tokens,
                                const tsr_kv_req *other);

/* Make room for `num_new_tokens` more tokens after the request's computed ones
 * (parked hits included).  First references the parked hits (ref++, a ref-0 block
 * leaves the free queue), then takes new blocks from the head of the free queue
 * (evicting their old hash: REMOVED event), one per table for each new block.
 * Afterwards r->n_blocks * block_size >= r->n_computed + num_new_tokens.
 * TSR_E_UNAVAILABLE when too few blocks are free
 * (counting parked hits that are themselves free): nothing changes and the scheduler
 * preempts or waits.  TSR_E_INVAL when a parked hit was evicted since
 * get_computed_blocks (call it again), or on overflow; TSR_E_NOMEM growing the
 * table (nothing changed). */
tsr_status tsr_kv_cache_allocate_slots(tsr_kv_cache *kv, tsr_kv_req *r, size_t num_new_tokens);

/* After a forward step: the KV of all_tokens[0..n_computed) is now stored.  With
 * caching on, every block that became full is hashed (all_tokens supplies the ids)
 * and enters the hash map, one STORED event per run with the parent's hash; a block
 * whose hash is already mapped (the same prefix computed twice at once) stays out of
 * the map and the existing block keeps serving hits.  Then each chunked table's blocks
 * wholly before floor(n_computed / chunk) * chunk go to the tail of the free queue
 * (their entries TSR_KV_NULL_BLOCK).  TSR_E_INVAL unless
 * r->n_computed <= n_computed <= r->n_blocks * block_size; TSR_E_NOMEM,
 * TSR_E_INTERNAL from hashing (then nothing is committed; retrying is safe). */
tsr_status tsr_kv_cache_commit(tsr_kv_cache *kv, tsr_kv_req *r, const uint32_t *all_tokens, size_t n_computed);

/* Finish, abort or preemption: ref-- on every block of r (every table), and blocks
 * reaching 0 go to the tail of the free queue in reverse table order (last block first),
 * keeping their hash.  r keeps its hashes (for the next lookup) but holds no blocks afterwards. */
void tsr_kv_cache_free_blocks(tsr_kv_cache *kv, tsr_kv_req *r);

/* Forget every cached hash (free blocks and blocks in use alike: in-use blocks keep
 * their KV and owner but can no longer be shared) and queue one ALL_CLEARED event,
 * which supersedes every event still queued. */
void tsr_kv_cache_reset_prefix_cache(tsr_kv_cache *kv);

typedef struct tsr_kv_stats {
        uint32_t num_blocks;
        uint32_t num_free;               /* allocatable: never used, released, or cached and evictable */
        uint32_t num_active;             /* ref > 0 */
        uint32_t num_cached;             /* blocks carrying a hash (hittable), active or free */
        double usage;                    /* 1 - num_free / num_blocks */
        uint64_t prefix_cache_requests;  /* lookups counted below */
        uint64_t prefix_cache_queries;   /* tokens looked up */
        uint64_t prefix_cache_hits;      /* tokens found */
        uint64_t evictions;              /* cached blocks evicted by allocation */
        uint64_t event_overflows;        /* queue overflows resolved by ALL_CLEARED + resync */
} tsr_kv_stats;

void tsr_kv_cache_stats(const tsr_kv_cache *kv, tsr_kv_stats *ret);

/* ---- events for the router's mirror (Status.events, proto BlockHashEvent) ----
 *
 * Applied in order to a set of hashes, the events reproduce the set of hashes this
 * cache can hit (tsr_kv_cache_cached_hashes).  Adjacent REMOVED events merge, and a
 * STORED event merges into the previous one when it continues its chain.  The queue
 * holds at most `cap` hashes (default max(1024, 2 * num_blocks), at least num_blocks);
 * on overflow everything queued is dropped and replaced by ALL_CLEARED followed by a
 * STORED snapshot of every cached block (each with its own parent), so a router that
 * applies the stream stays exact; event_overflows counts it. */
typedef enum tsr_kv_event_kind {
        TSR_KV_EVENT_STORED = 0,
        TSR_KV_EVENT_REMOVED = 1,
        TSR_KV_EVENT_ALL_CLEARED = 2,
} tsr_kv_event_kind;

typedef struct tsr_kv_event {
        tsr_kv_event_kind kind;
        bool has_parent;             /* STORED: false when hashes[0] is block 0 of its chain */
        uint64_t parent_hash;        /* STORED: hash of the block before hashes[0] */
        size_t n_hashes;             /* 0 for ALL_CLEARED */
        const uint64_t *hashes;      /* STORED in chain order; REMOVED in eviction order */
} tsr_kv_event;

typedef struct tsr_kv_events {
        size_t n;
        tsr_kv_event *ev;            /* n events; their hashes live in the same allocation */
} tsr_kv_events;

/* Move every queued event to a new heap object the caller owns (hand it to the io
 * thread if needed; free with tsr_kv_events_free).  *ret = NULL when none is queued.
 * TSR_E_NOMEM leaves the events queued. */
tsr_status tsr_kv_cache_take_events(tsr_kv_cache *kv, tsr_kv_events **ret);
/* Accepts NULL; clears the caller's pointer.  Any thread. */
void tsr_kv_events_free(tsr_kv_events **e);

/* Change the event queue's cap (hashes; raised to num_blocks if lower).  Drops queued
 * events with a resync (as an overflow).  TSR_E_NOMEM keeps the old queue. */
tsr_status tsr_kv_cache_set_event_cap(tsr_kv_cache *kv, size_t cap);

/* Replace the queued events by ALL_CLEARED and a STORED event per cached block (a
 * router asked for a snapshot: proto Resync).  Engine thread, like every call here. */
void tsr_kv_cache_resync(tsr_kv_cache *kv);

/* Write up to `cap` cached hashes (in block-id order) to `out`; returns how many
 * blocks carry a hash (may exceed cap).  For a router resync and for tests. */
size_t tsr_kv_cache_cached_hashes(const tsr_kv_cache *kv, uint64_t *out, size_t cap);

/* Debug: the ref count of block `id` (0 for an id out of range). */
uint32_t tsr_kv_cache_block_ref(const tsr_kv_cache *kv, uint32_t id);

/* Debug: the cache's invariants (free queue vs ref counts, counters, hash map vs
 * block hashes, event queue bounds).  TSR_OK or TSR_E_INTERNAL.  O(num_blocks). */
tsr_status tsr_kv_cache_check(const tsr_kv_cache *kv);
/* Debug: one request against the cache (ids in range and distinct, each referenced,
 * n_computed within the table, registered blocks carrying the request's hashes). */
tsr_status tsr_kv_req_check(const tsr_kv_cache *kv, const tsr_kv_req *r);

#endif
