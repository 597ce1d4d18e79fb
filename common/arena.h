/* arena.h - bump allocator for per-request and per-step memory.
 *
 * Objects are never freed one by one: the whole arena is reset or freed once, on
 * every path, when the request (or engine step) ends.  Other resources tied to the
 * same lifetime register a cleanup, run in reverse order on reset/free (like nginx's
 * ngx_pool_cleanup_add).  An arena has an optional byte cap so a client-controlled
 * request cannot grow it without bound.  Not thread-safe: one owner thread. */
#ifndef TSR_ARENA_H
#define TSR_ARENA_H

#include <stddef.h>
#include "tsr_status.h"

typedef struct tsr_arena tsr_arena;
typedef void (*tsr_arena_cleanup_fn)(void *data);

/* `chunk_size`: bytes per chunk (0 = 4 KiB); `limit`: most bytes handed out in all
 * (0 = no cap).  Returns NULL only on OOM. */
tsr_arena *tsr_arena_new(size_t chunk_size, size_t limit);
/* Run the cleanups and free everything.  Accepts NULL; clears *a. */
void tsr_arena_free(tsr_arena **a);
/* Run the cleanups and forget every allocation; the first chunk is kept for reuse. */
void tsr_arena_reset(tsr_arena *a);

/* 16-byte aligned memory, uninitialised.  NULL on OOM or when over the cap
 * (tsr_arena_over_limit tells which). */
void *tsr_arena_alloc(tsr_arena *a, size_t n);
void *tsr_arena_calloc(tsr_arena *a, size_t count, size_t size);
void *tsr_arena_memdup(tsr_arena *a, const void *p, size_t n);
/* Copies `n` bytes and appends a NUL. */
char *tsr_arena_strndup(tsr_arena *a, const char *s, size_t n);
char *tsr_arena_strdup(tsr_arena *a, const char *s);

tsr_status tsr_arena_add_cleanup(tsr_arena *a, tsr_arena_cleanup_fn fn, void *data);

/* Bytes handed out since the last reset. */
size_t tsr_arena_used(const tsr_arena *a);
int tsr_arena_over_limit(const tsr_arena *a);

#endif
