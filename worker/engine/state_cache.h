/* state_cache.h - a Mamba hybrid's recurrent-state slots: held by running requests, or
 * keeping the state after a block for prefix caching.
 *
 * The model runner owns the memory (kv_pool.h TSR_KV_MAMBA_STATE: per Mamba layer a conv
 * and an SSM state per slot); this module decides who uses which slot id.  A slot is
 *  - FREE;
 *  - HELD: a running request's live state, or the target of a save scheduled in a step
 *    that has not been applied yet;
 *  - CACHED: the state after the first (b + 1) * block_size tokens of some request,
 *    under the chain hash of its block b (kv_cache.h's table-0 hash, salt included), so
 *    a request whose prefix-cache hit ends with block b can start from a copy of it.
 *    This is vLLM 0.11-0.12's Mamba prefix caching: the engine saves the state at every
 *    multiple of the state block (--mamba-block-size) a step passes, prompt or decode.
 * A request (or a save) takes a FREE slot first, else evicts the least recently used
 * CACHED one that is not pinned for the scheduling round (a copy source of the step
 * being scheduled: its copy runs in that step's forward, before any later step writes).
 *
 * Thread: the engine thread only; nothing is thread-safe. */
#ifndef TSR_WORKER_STATE_CACHE_H
#define TSR_WORKER_STATE_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/tsr_status.h"

typedef struct tsr_state_cache tsr_state_cache;

/* n_slots in [1, 2^31).  TSR_OK, TSR_E_INVAL, TSR_E_NOMEM; *ret written on success. */
tsr_status tsr_state_cache_new(uint32_t n_slots, tsr_state_cache **ret);
/* Accepts NULL; clears the caller's pointer. */
void tsr_state_cache_free(tsr_state_cache **sc);

/* A slot to hold: a free one (lowest id first, as a stack pushed high to low), else the
 * least recently used cached one not pinned in `round` (its entry forgotten).  false
 * when every slot is held or pinned. */
bool tsr_state_take(tsr_state_cache *sc, uint64_t round, uint32_t *slot);
/* A held slot back to FREE (its contents need no clearing: a sequence that starts from
 * nothing zeroes its slot, one that starts from a cached state copies it in). */
void tsr_state_give(tsr_state_cache *sc, uint32_t slot);

/* The cached slot of `hash`, pinned for `round` and made the most recently used;
 * false when none. */
bool tsr_state_find(tsr_state_cache *sc, uint64_t hash, uint64_t round, uint32_t *slot);
/* Whether `hash` has a cached state (no pin, no LRU move). */
bool tsr_state_has(const tsr_state_cache *sc, uint64_t hash);

/* The held `slot` now holds the state under `hash` (a save's step was applied): it
 * becomes CACHED, the most recently used.  When `hash` is cached already (the same
 * prefix computed twice at once), the slot is given back instead. */
void tsr_state_store(tsr_state_cache *sc, uint32_t slot, uint64_t hash);

/* Forget every cached state (the prefix cache was reset): CACHED slots become FREE. */
void tsr_state_reset(tsr_state_cache *sc);

typedef struct tsr_state_stats {
        uint32_t total, held, cached;   /* free = total - held - cached */
        uint64_t evictions;             /* cached states evicted by tsr_state_take */
} tsr_state_stats;

void tsr_state_cache_stats(const tsr_state_cache *sc, tsr_state_stats *ret);
/* Debug: the invariants (counts, lists, map).  TSR_OK or TSR_E_INTERNAL. */
tsr_status tsr_state_cache_check(const tsr_state_cache *sc);

#endif
