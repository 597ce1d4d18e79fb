#include "arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ARENA_ALIGN 16

struct arena_chunk {
        struct arena_chunk *next;
        size_t size;          /* usable bytes in data[] */
        size_t used;
        _Alignas(ARENA_ALIGN) unsigned char data[];
};

struct arena_cleanup {
        struct arena_cleanup *next;
        tsr_arena_cleanup_fn fn;
        void *data;
};

struct tsr_arena {
        struct arena_chunk *chunks;     /* newest first; the last one is the first chunk */
        struct arena_cleanup *cleanups; /* newest first, so running the list is LIFO */
        size_t chunk_size;
        size_t limit;
        size_t used;
        int over_limit;
};

static struct arena_chunk *chunk_new(size_t size) {
        struct arena_chunk *c = malloc(sizeof(*c) + size);
        if (!c)
                return NULL;
        c->next = NULL;
        c->size = size;
        c->used = 0;
        return c;
}

tsr_arena *tsr_arena_new(size_t chunk_size, size_t limit) {
        tsr_arena *a = calloc(1, sizeof(*a));
        if (!a)
                return NULL;
        a->chunk_size = chunk_size ? chunk_size : 4096;
        a->limit = limit;
        a->chunks = chunk_new(a->chunk_size);
        if (!a->chunks) {
                free(a);
                return NULL;
        }
        return a;
}

static void run_cleanups(tsr_arena *a) {
        while (a->cleanups) {
                struct arena_cleanup *c = a->cleanups;
                a->cleanups = c->next;
                c->fn(c->data);   /* the node itself lives in the arena */
        }
}

void tsr_arena_reset(tsr_arena *a) {
        if (!a)
                return;
        run_cleanups(a);
        while (a->chunks->next) {
                struct arena_chunk *c = a->chunks;
                a->chunks = c->next;
                free(c);
        }
        a->chunks->used = 0;
        a->used = 0;
        a->over_limit = 0;
}

void tsr_arena_free(tsr_arena **ap) {
        tsr_arena *a;
        if (!ap || !*ap)
                return;
        a = *ap;
        run_cleanups(a);
        while (a->chunks) {
                struct arena_chunk *c = a->chunks;
                a->chunks = c->next;
                free(c);
        }
        free(a);
        *ap = NULL;
}

void *tsr_arena_alloc(tsr_arena *a, size_t n) {
        struct arena_chunk *c = a->chunks;
        size_t need = (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
        void *p;

        if (n == 0)
                need = ARENA_ALIGN;
        if (need < n || (a->limit && (need > a->limit || a->used > a->limit - need))) {
                a->over_limit = 1;
                return NULL;
        }
        if (c->size - c->used < need) {
                /* Big requests get a chunk of their own so the normal chunk size is kept. */
                size_t size = need > a->chunk_size ? need : a->chunk_size;
                struct arena_chunk *fresh = chunk_new(size);
                if (!fresh)
                        return NULL;
                fresh->next = a->chunks;
                a->chunks = fresh;
                c = fresh;
        }
        p = c->data + c->used;
        c->used += need;
        a->used += need;
        return p;
}

void *tsr_arena_calloc(tsr_arena *a, size_t count, size_t size) {
        void *p;
        if (size && count > SIZE_MAX / size)
                return NULL;
        p = tsr_arena_alloc(a, count * size);
        if (p)
                memset(p, 0, count * size);
        return p;
}

void *tsr_arena_memdup(tsr_arena *a, const void *src, size_t n) {
        void *p = tsr_arena_alloc(a, n);
        if (p && n)
                memcpy(p, src, n);
        return p;
}

char *tsr_arena_strndup(tsr_arena *a, const char *s, size_t n) {
        char *p;
        if (n == SIZE_MAX)
                return NULL;
        p = tsr_arena_alloc(a, n + 1);
        if (!p)
                return NULL;
        if (n)
                memcpy(p, s, n);
        p[n] = '\0';
        return p;
}

char *tsr_arena_strdup(tsr_arena *a, const char *s) { return tsr_arena_strndup(a, s, strlen(s)); }

tsr_status tsr_arena_add_cleanup(tsr_arena *a, tsr_arena_cleanup_fn fn, void *data) {
        struct arena_cleanup *c = tsr_arena_alloc(a, sizeof(*c));
        if (!c)
                return a->over_limit ? TSR_E_LIMIT : TSR_E_NOMEM;
        c->fn = fn;
        c->data = data;
        c->next = a->cleanups;
        a->cleanups = c;
        return TSR_OK;
}

size_t tsr_arena_used(const tsr_arena *a) { return a->used; }
int tsr_arena_over_limit(const tsr_arena *a) { return a->over_limit; }
