/* hashset.c - open-addressing uint64 set (see hashset.h).  Loop thread of its owner. */
#include "hashset.h"

#include <stdlib.h>
#include <string.h>

#define MIN_SLOTS 64u

/* Block hashes are already uniform (XXH3 / SHA-256), but a cheap finaliser keeps
 * probing sane if a test or a future algo feeds structured values. */
static size_t slot_of(uint64_t h, size_t mask) {
        h ^= h >> 33;
        h *= UINT64_C(0xff51afd7ed558ccd);
        h ^= h >> 33;
        return (size_t)h & mask;
}

void tsr_hashset_init(tsr_hashset *s, size_t cap) {
        memset(s, 0, sizeof(*s));
        s->cap = cap;
}

void tsr_hashset_done(tsr_hashset *s) {
        size_t cap = s->cap;
        free(s->slots);
        tsr_hashset_init(s, cap);
}

void tsr_hashset_clear(tsr_hashset *s) {
        if (s->slots)
                memset(s->slots, 0, s->n_slots * sizeof(uint64_t));
        s->n = 0;
        s->has_zero = false;
}

static void put(uint64_t *slots, size_t n_slots, uint64_t h) {
        size_t mask = n_slots - 1, i = slot_of(h, mask);
        while (slots[i] && slots[i] != h)
                i = (i + 1) & mask;
        slots[i] = h;
}

/* Keep the load factor at or under 1/2: short probe runs for the per-request lookups. */
static bool grow(tsr_hashset *s) {
        size_t n = s->n_slots ? s->n_slots * 2 : MIN_SLOTS;
        uint64_t *slots = calloc(n, sizeof(uint64_t));
        if (!slots)
                return false;
        for (size_t i = 0; i < s->n_slots; i++)
                if (s->slots[i])
                        put(slots, n, s->slots[i]);
        free(s->slots);
        s->slots = slots;
        s->n_slots = n;
        return true;
}

bool tsr_hashset_has(const tsr_hashset *s, uint64_t h) {
        size_t mask, i;
        if (h == 0)
                return s->has_zero;
        if (!s->n_slots)
                return false;
        mask = s->n_slots - 1;
        for (i = slot_of(h, mask); s->slots[i]; i = (i + 1) & mask)
                if (s->slots[i] == h)
                        return true;
        return false;
}

tsr_status tsr_hashset_add(tsr_hashset *s, uint64_t h) {
        if (tsr_hashset_has(s, h))
                return TSR_OK;
        if (s->cap && s->n >= s->cap)
                return TSR_E_LIMIT;
        if (h == 0) {
                s->has_zero = true;
                s->n++;
                return TSR_OK;
        }
        if ((s->n + 1) * 2 > s->n_slots && !grow(s))
                return TSR_E_NOMEM;
        put(s->slots, s->n_slots, h);
        s->n++;
        return TSR_OK;
}

bool tsr_hashset_remove(tsr_hashset *s, uint64_t h) {
        size_t mask, i, j;
        if (h == 0) {
                if (!s->has_zero)
                        return false;
                s->has_zero = false;
                s->n--;
                return true;
        }
        if (!s->n_slots)
                return false;
        mask = s->n_slots - 1;
        for (i = slot_of(h, mask); s->slots[i] != h; i = (i + 1) & mask)
                if (!s->slots[i])
                        return false;
        /* Backward shift: pull later members of the run into the hole when their home
         * slot is not cyclically in (hole, j], so every lookup still finds them. */
        for (j = (i + 1) & mask; s->slots[j]; j = (j + 1) & mask) {
                size_t home = slot_of(s->slots[j], mask);
                bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
                if (!stays) {
                        s->slots[i] = s->slots[j];
                        i = j;
                }
        }
        s->slots[i] = 0;
        s->n--;
        return true;
}
