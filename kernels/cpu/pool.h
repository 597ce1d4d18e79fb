/* pool.h - a small fork-join thread pool for the fast CPU kernels.
 *
 * A pool of n threads is the calling thread plus n-1 helpers created once.  tsr_pool_run
 * splits one op into `n_tasks` independent tasks (ranges of OUTPUT elements: rows of a
 * weight matrix, (query row, head) pairs) and returns when all have run.  Which thread
 * runs which task is not fixed, so a task must compute its outputs in an order that
 * depends on nothing but the task's own indices: then results never depend on the number
 * of threads or on the batch (kernels.h, batch invariance).
 *
 * Threads: meant to be driven by one thread at a time (the worker's engine thread).  A
 * second thread that calls tsr_pool_run while a run is in flight does not wait for the
 * pool: it runs its tasks itself, inline, with the same results. */
#ifndef TSR_KERNELS_CPU_POOL_H
#define TSR_KERNELS_CPU_POOL_H

#include <stddef.h>

typedef struct tsr_pool tsr_pool;

/* task(ctx, i, worker) for one task index i in [0, n_tasks); `worker` (< the pool's
 * thread count) is the index of the thread running it: two tasks with the same `worker`
 * never run at the same time within one run.  For a working buffer prefer
 * tsr_thread_scratch (below) to slicing one per-call block by `worker`. */
typedef void (*tsr_pool_task_fn)(void *ctx, size_t i, int worker);

/* A pool of n_threads (>= 1; 1 = no helper threads, every run is inline).  NULL on
 * failure to allocate or to create a thread (errno from pthread_create is lost; the
 * caller falls back to running inline). */
tsr_pool *tsr_pool_new(int n_threads);

/* Stop and join the helpers, free the pool; accepts NULL and *p == NULL, clears *p.
 * Never while a run is in flight. */
void tsr_pool_free(tsr_pool **p);

/* Threads in the pool, the caller included (1 for NULL). */
int tsr_pool_threads(const tsr_pool *p);

/* Run task(ctx, 0 .. n_tasks-1) across the pool and the calling thread; returns when all
 * have finished.  p may be NULL (inline). */
void tsr_pool_run(tsr_pool *p, size_t n_tasks, tsr_pool_task_fn task, void *ctx);

/* As tsr_pool_run, but the indices are cut into one contiguous span per thread (at most
 * TSR_POOL_MAX_SPANS), each thread runs its own span's indices in increasing order, and a
 * thread whose span is done takes the next unrun indices of the others' (in span order,
 * from their fronts).  For tasks that stream memory in index order (a matrix-vector
 * product's weight rows): each thread then reads one long run of addresses, which the
 * hardware prefetchers follow, instead of every other short piece.  Same contract as
 * tsr_pool_run: which thread runs which index is still not fixed. */
#define TSR_POOL_MAX_SPANS 64
void tsr_pool_run_spans(tsr_pool *p, size_t n_tasks, tsr_pool_task_fn task, void *ctx);

/* The calling thread's own scratch of at least `bytes`, 64-byte aligned, kept between
 * calls and freed when the thread exits; NULL when it cannot grow.  For a task's working
 * buffer that only its thread writes: its lines then stay in that core's cache, where a
 * buffer malloc'd per call by the driving thread arrives each call from whichever core
 * wrote that memory last (measured in cpu/qmm.c: the helper thread ran its share of a
 * matmul 2-3x slower that way).  One buffer per thread, its contents lost when it grows:
 * a caller must not hold it across another caller's use in the same thread. */
void *tsr_thread_scratch(size_t bytes);

#endif
