/* state_cache.c - recurrent-state slots and their prefix cache (semantics in
 * state_cache.h). */
#include "worker/engine/state_cache.h"

#include <stdlib.h>

#define NIL UINT32_MAX

typedef enum { S_FREE, S_HELD, S_CACHED } slot_state;

typedef struct state_slot {
        uint8_t state;              /* slot_state */
        uint64_t hash;              /* CACHED: its key */
        uint64_t pin_round;         /* CACHED: not evicted while scheduling this round */
        uint32_t prev, next;        /* CACHED: the LRU list (head: least recently used) */
        uint32_t chain;             /* CACHED: next slot in its map bucket */
} state_slot;

struct tsr_state_cache {
        uint32_t n;
        state_slot *s;
        uint32_t *free_stack, n_free;
        uint32_t lru_head, lru_tail, n_cached;
        uint32_t *buckets;          /* mask + 1 heads */
        uint64_t mask;
        uint64_t evictions;
};

static uint64_t bucket_of(const tsr_state_cache *sc, uint64_t hash) {
        /* the chain hashes are uniform already; fold the high half in for small masks */
        return (hash ^ (hash >> 32)) & sc->mask;
}

tsr_status tsr_state_cache_new(uint32_t n_slots, tsr_state_cache **ret) {
        tsr_state_cache *sc;
        uint64_t nb = 1;

        if (n_slots == 0 || n_slots >= (1u << 31))
                return TSR_E_INVAL;
        while (nb < 2ull * n_slots)
                nb <<= 1;
        if (!(sc = calloc(1, sizeof(*sc))))
                return TSR_E_NOMEM;
        sc->n = n_slots;
        sc->s = calloc(n_slots, sizeof(*sc->s));
        sc->free_stack = malloc(n_slots * sizeof(*sc->free_stack));
        sc->buckets = malloc(nb * sizeof(*sc->buckets));
        if (!sc->s || !sc->free_stack || !sc->buckets) {
                tsr_state_cache_free(&sc);
                return TSR_E_NOMEM;
        }
        sc->mask = nb - 1;
        for (uint64_t i = 0; i < nb; i++)
                sc->buckets[i] = NIL;
        /* pushed high to low, so slot 0 is taken first */
        for (uint32_t i = 0; i < n_slots; i++)
                sc->free_stack[i] = n_slots - 1 - i;
        sc->n_free = n_slots;
        sc->lru_head = sc->lru_tail = NIL;
        *ret = sc;
        return TSR_OK;
}

void tsr_state_cache_free(tsr_state_cache **scp) {
        tsr_state_cache *sc = scp ? *scp : NULL;
        if (!sc)
                return;
        free(sc->s);
        free(sc->free_stack);
        free(sc->buckets);
        free(sc);
        *scp = NULL;
}

static void lru_unlink(tsr_state_cache *sc, uint32_t i) {
        state_slot *x = &sc->s[i];
        if (x->prev != NIL)
                sc->s[x->prev].next = x->next;
        else
                sc->lru_head = x->next;
        if (x->next != NIL)
                sc->s[x->next].prev = x->prev;
        else
                sc->lru_tail = x->prev;
        x->prev = x->next = NIL;
}

static void lru_push_tail(tsr_state_cache *sc, uint32_t i) {
        state_slot *x = &sc->s[i];
        x->prev = sc->lru_tail;
        x->next = NIL;
        if (sc->lru_tail != NIL)
                sc->s[sc->lru_tail].next = i;
        else
                sc->lru_head = i;
        sc->lru_tail = i;
}

static uint32_t map_find(const tsr_state_cache *sc, uint64_t hash) {
        for (uint32_t i = sc->buckets[bucket_of(sc, hash)]; i != NIL; i = sc->s[i].chain)
                if (sc->s[i].hash == hash)
                        return i;
        return NIL;
}

static void map_remove(tsr_state_cache *sc, uint32_t i) {
        uint32_t *p = &sc->buckets[bucket_of(sc, sc->s[i].hash)];
        while (*p != i)
                p = &sc->s[*p].chain;
        *p = sc->s[i].chain;
        sc->s[i].chain = NIL;
}

/* A CACHED slot's entry forgotten: it is HELD by the caller now. */
static void uncache(tsr_state_cache *sc, uint32_t i) {
        lru_unlink(sc, i);
        map_remove(sc, i);
        sc->n_cached--;
        sc->s[i].state = S_HELD;
}

bool tsr_state_take(tsr_state_cache *sc, uint64_t round, uint32_t *slot) {
        if (sc->n_free) {
                uint32_t i = sc->free_stack[--sc->n_free];
                sc->s[i].state = S_HELD;
                *slot = i;
                return true;
        }
        for (uint32_t i = sc->lru_head; i != NIL; i = sc->s[i].next)
                if (sc->s[i].pin_round != round || round == 0) {
                        uncache(sc, i);
                        sc->evictions++;
                        *slot = i;
                        return true;
                }
        return false;
}

void tsr_state_give(tsr_state_cache *sc, uint32_t slot) {
        if (slot >= sc->n || sc->s[slot].state != S_HELD)
                return;
        sc->s[slot].state = S_FREE;
        sc->free_stack[sc->n_free++] = slot;
}

bool tsr_state_find(tsr_state_cache *sc, uint64_t hash, uint64_t round, uint32_t *slot) {
        uint32_t i = map_find(sc, hash);
        if (i == NIL)
                return false;
        sc->s[i].pin_round = round;
        lru_unlink(sc, i);
        lru_push_tail(sc, i);
        *slot = i;
        return true;
}

bool tsr_state_has(const tsr_state_cache *sc, uint64_t hash) { return map_find(sc, hash) != NIL; }

void tsr_state_store(tsr_state_cache *sc, uint32_t slot, uint64_t hash) {
        state_slot *x;
        if (slot >= sc->n || sc->s[slot].state != S_HELD)
                return;
        if (map_find(sc, hash) != NIL) {
                tsr_state_give(sc, slot);
                return;
        }
        x = &sc->s[slot];
        x->state = S_CACHED;
        x->hash = hash;
        x->pin_round = 0;
        uint64_t b = bucket_of(sc, hash);
        x->chain = sc->buckets[b];
        sc->buckets[b] = slot;
        lru_push_tail(sc, slot);
        sc->n_cached++;
}

void tsr_state_reset(tsr_state_cache *sc) {
        while (sc->lru_head != NIL) {
                uint32_t i = sc->lru_head;
                uncache(sc, i);
                tsr_state_give(sc, i);
        }
}

void tsr_state_cache_stats(const tsr_state_cache *sc, tsr_state_stats *ret) {
        ret->total = sc->n;
        ret->cached = sc->n_cached;
        ret->held = sc->n - sc->n_cached - sc->n_free;
        ret->evictions = sc->evictions;
}

tsr_status tsr_state_cache_check(const tsr_state_cache *sc) {
        uint32_t free_n = 0, cached_n = 0, walked = 0;
        for (uint32_t i = 0; i < sc->n; i++) {
                free_n += sc->s[i].state == S_FREE;
                cached_n += sc->s[i].state == S_CACHED;
        }
        if (free_n != sc->n_free || cached_n != sc->n_cached)
                return TSR_E_INTERNAL;
        for (uint32_t k = 0; k < sc->n_free; k++)
                if (sc->free_stack[k] >= sc->n || sc->s[sc->free_stack[k]].state != S_FREE)
                        return TSR_E_INTERNAL;
        for (uint32_t i = sc->lru_head, prev = NIL; i != NIL; prev = i, i = sc->s[i].next) {
                if (i >= sc->n || sc->s[i].state != S_CACHED || sc->s[i].prev != prev || ++walked > sc->n)
                        return TSR_E_INTERNAL;
                if (map_find(sc, sc->s[i].hash) != i)
                        return TSR_E_INTERNAL;
        }
        return walked == sc->n_cached ? TSR_OK : TSR_E_INTERNAL;
}
