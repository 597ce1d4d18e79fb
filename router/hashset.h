/* hashset.h - a set of uint64 block hashes with a cap, for the router's mirror of a
 * worker's prefix cache (router/worker_link.c).
 *
 * Open addressing, linear probing, backward-shift deletion (no tombstones, so a set
 * that sees millions of STORED/REMOVED events never degrades).  The value 0 marks an
 * empty slot; the hash 0 is kept in a side flag, so every uint64 can be a member.
 * The table doubles up to `cap` members; past the cap an insert is refused (the
 * mirror then under-reports hits, which only costs placement quality, never
 * correctness: the worker's cache is the truth).  Not thread-safe: one owner (the
 * router's loop thread). */
#ifndef TSR_ROUTER_HASHSET_H
#define TSR_ROUTER_HASHSET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

typedef struct tsr_hashset {
        uint64_t *slots;             /* 0 = empty */
        size_t n_slots;              /* power of two, or 0 before the first insert */
        size_t n;                    /* members, the zero flag included */
        size_t cap;                  /* most members kept */
        bool has_zero;
} tsr_hashset;

/* An empty set holding at most `cap` members (0 = no cap).  Allocates nothing. */
void tsr_hashset_init(tsr_hashset *s, size_t cap);
/* Free the table; the set is empty and usable again afterwards.  Idempotent. */
void tsr_hashset_done(tsr_hashset *s);
/* Remove every member, keeping the table. */
void tsr_hashset_clear(tsr_hashset *s);
/* TSR_OK (also when already present), TSR_E_LIMIT at the cap, TSR_E_NOMEM. */
tsr_status tsr_hashset_add(tsr_hashset *s, uint64_t h);
/* true if it was there. */
bool tsr_hashset_remove(tsr_hashset *s, uint64_t h);
bool tsr_hashset_has(const tsr_hashset *s, uint64_t h);
static inline size_t tsr_hashset_size(const tsr_hashset *s) { return s->n; }

#endif
