/* pool.c - fork-join pool: helpers claim task indices from one atomic word.
 *
 * The run in flight is published as one 64-bit word, state = gen:16 | n_tasks:24 | next:24.
 * A helper claims task `next` with a compare-and-swap that also checks the generation
 * and the count, so a helper that wakes late (after its run finished and another began)
 * can never claim a task of a run it did not read; only after a successful claim does it
 * read the run's function and context, which stay valid until every claimed task has
 * reported done.  The caller claims tasks too, so a helper that is not scheduled (the
 * cores are shared) delays nothing: the caller then simply runs everything itself.
 *
 * Helpers spin briefly between runs (a decode step issues hundreds of runs back to
 * back), then sleep on a condition variable. */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#define GEN_SHIFT 48
#define N_SHIFT 24
#define FIELD_MASK ((1ull << 24) - 1)
#define MAX_TASKS_PER_RUN FIELD_MASK    /* larger runs are issued in slices */
#define SPINS_BEFORE_SLEEP 4096

struct tsr_pool {
        int n_threads;
        pthread_t *helpers;             /* [n_threads - 1] */
        struct helper_arg { struct tsr_pool *p; int worker; } *args;  /* [n_threads - 1] */
        int n_started;

        _Atomic uint64_t state;         /* gen | n_tasks | next */
        _Atomic size_t n_done;          /* tasks of the current run finished */
        tsr_pool_task_fn fn;            /* of the current run; read only after a claim */
        void *ctx;
        size_t base;                    /* index of the slice's first task */

        pthread_mutex_t run_lock;       /* held by the thread driving a run */
        pthread_mutex_t mu;             /* sleep/wake of helpers */
        pthread_cond_t cv;
        atomic_bool stop;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
}

static inline uint64_t st_gen(uint64_t s) { return s >> GEN_SHIFT; }
static inline uint64_t st_n(uint64_t s) { return (s >> N_SHIFT) & FIELD_MASK; }
static inline uint64_t st_next(uint64_t s) { return s & FIELD_MASK; }

/* Claim and run tasks of generation `gen` until none is left.  Any thread. */
static void work(tsr_pool *p, uint64_t gen, int worker) {
        for (;;) {
                uint64_t s = atomic_load_explicit(&p->state, memory_order_acquire);
                if (st_gen(s) != gen || st_next(s) >= st_n(s))
                        return;
                if (!atomic_compare_exchange_weak_explicit(&p->state, &s, s + 1, memory_order_acq_rel,
                                                           memory_order_relaxed))
                        continue;
                /* The run cannot finish before this task reports done: fn, ctx, base valid. */
                p->fn(p->ctx, p->base + st_next(s), worker);
                atomic_fetch_add_explicit(&p->n_done, 1, memory_order_release);
        }
}

static void *helper_main(void *arg) {
        tsr_pool *p = ((struct helper_arg *)arg)->p;
        int worker = ((struct helper_arg *)arg)->worker;
        uint64_t seen = st_gen(atomic_load_explicit(&p->state, memory_order_acquire));

        for (;;) {
                uint64_t s = 0;
                int spins = 0;
                while (!atomic_load_explicit(&p->stop, memory_order_acquire)) {
                        s = atomic_load_explicit(&p->state, memory_order_acquire);
                        if (st_gen(s) != seen)
                                break;
                        if (++spins < SPINS_BEFORE_SLEEP) {
                                cpu_relax();
                                continue;
                        }
                        pthread_mutex_lock(&p->mu);
                        s = atomic_load_explicit(&p->state, memory_order_acquire);
                        if (st_gen(s) == seen && !atomic_load_explicit(&p->stop, memory_order_acquire))
                                pthread_cond_wait(&p->cv, &p->mu);
                        pthread_mutex_unlock(&p->mu);
                        spins = 0;
                }
                if (atomic_load_explicit(&p->stop, memory_order_acquire))
                        return NULL;
                seen = st_gen(s);
                work(p, seen, worker);
        }
}

tsr_pool *tsr_pool_new(int n_threads) {
        tsr_pool *p;

        if (n_threads < 1)
                return NULL;
        p = calloc(1, sizeof *p);
        if (!p)
                return NULL;
        p->n_threads = n_threads;
        atomic_init(&p->state, 0);
        atomic_init(&p->n_done, 0);
        atomic_init(&p->stop, false);
        pthread_mutex_init(&p->run_lock, NULL);
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        if (n_threads > 1) {
                p->helpers = calloc((size_t)n_threads - 1, sizeof *p->helpers);
                p->args = calloc((size_t)n_threads - 1, sizeof *p->args);
                if (!p->helpers || !p->args)
                        goto fail;
                /* Helpers take no signals: they inherit a full mask, so a process-directed
                 * SIGTERM still reaches the thread that waits for it (the worker's
                 * signalfd), even when the pool is made before the caller blocks it. */
                sigset_t all, old;
                bool ok = true;
                sigfillset(&all);
                pthread_sigmask(SIG_SETMASK, &all, &old);
                for (int i = 0; i < n_threads - 1 && ok; i++) {
                        p->args[i] = (struct helper_arg){.p = p, .worker = i + 1};
                        if (pthread_create(&p->helpers[i], NULL, helper_main, &p->args[i]) != 0)
                                ok = false;
                        else
                                p->n_started++;
                }
                pthread_sigmask(SIG_SETMASK, &old, NULL);
                if (!ok)
                        goto fail;
        }
        return p;
fail:
        tsr_pool_free(&p);
        return NULL;
}

void tsr_pool_free(tsr_pool **pp) {
        tsr_pool *p;

        if (!pp || !*pp)
                return;
        p = *pp;
        pthread_mutex_lock(&p->mu);
        atomic_store_explicit(&p->stop, true, memory_order_release);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n_started; i++)
                pthread_join(p->helpers[i], NULL);
        free(p->helpers);
        free(p->args);
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        pthread_mutex_destroy(&p->run_lock);
        free(p);
        *pp = NULL;
}

int tsr_pool_threads(const tsr_pool *p) { return p ? p->n_threads : 1; }

void tsr_pool_run(tsr_pool *p, size_t n_tasks, tsr_pool_task_fn task, void *ctx) {
        if (n_tasks == 0)
                return;
        /* No helpers, a single task, or another thread driving the pool: run inline. */
        if (!p || p->n_threads == 1 || n_tasks == 1 || pthread_mutex_trylock(&p->run_lock) != 0) {
                for (size_t i = 0; i < n_tasks; i++)
                        task(ctx, i, 0);
                return;
        }
        for (size_t base = 0; base < n_tasks; base += MAX_TASKS_PER_RUN) {
                size_t n = n_tasks - base < MAX_TASKS_PER_RUN ? n_tasks - base : MAX_TASKS_PER_RUN;
                uint64_t gen = (st_gen(atomic_load_explicit(&p->state, memory_order_relaxed)) + 1) & 0xffff;

                p->fn = task;
                p->ctx = ctx;
                p->base = base;
                atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
                /* Publish: the release makes fn, ctx, base and n_done visible to a claimer. */
                atomic_store_explicit(&p->state, gen << GEN_SHIFT | (uint64_t)n << N_SHIFT, memory_order_release);
                pthread_mutex_lock(&p->mu);
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);

                work(p, gen, 0);
                /* Every task is claimed; wait for those running on helpers. */
                for (unsigned spins = 0; atomic_load_explicit(&p->n_done, memory_order_acquire) < n; spins++) {
                        if (spins < 1u << 14)
                                cpu_relax();
                        else
                                sched_yield();
                }
        }
        pthread_mutex_unlock(&p->run_lock);
}

/* tsr_pool_run_spans: one pool task per span; it drains its own span, then helps the
 * others from their fronts.  Each index is claimed once by an atomic increment of its
 * span's counter (relaxed: the run's own release/acquire publishes the results). */
struct span_run {
        tsr_pool_task_fn task;
        void *ctx;
        size_t n_spans;
        struct span {
                _Alignas(64) _Atomic size_t next;       /* a cache line each: owners do not share */
                size_t end;
        } span[TSR_POOL_MAX_SPANS];
};

static void span_task(void *ctx, size_t s0, int worker) {
        struct span_run *r = ctx;

        for (size_t k = 0; k < r->n_spans; k++) {
                struct span *sp = &r->span[(s0 + k) % r->n_spans];
                for (;;) {
                        size_t i = atomic_fetch_add_explicit(&sp->next, 1, memory_order_relaxed);
                        if (i >= sp->end)
                                break;
                        r->task(r->ctx, i, worker);
                }
        }
}

void tsr_pool_run_spans(tsr_pool *p, size_t n_tasks, tsr_pool_task_fn task, void *ctx) {
        size_t n_spans = (size_t)tsr_pool_threads(p);
        struct span_run r = {.task = task, .ctx = ctx};

        if (n_spans > TSR_POOL_MAX_SPANS)
                n_spans = TSR_POOL_MAX_SPANS;
        if (n_spans > n_tasks)
                n_spans = n_tasks;
        if (n_spans <= 1) {
                tsr_pool_run(p, n_tasks, task, ctx);
                return;
        }
        r.n_spans = n_spans;
        for (size_t s = 0; s < n_spans; s++) {
                atomic_init(&r.span[s].next, s * n_tasks / n_spans);
                r.span[s].end = (s + 1) * n_tasks / n_spans;
        }
        tsr_pool_run(p, n_spans, span_task, &r);
}

/* tsr_thread_scratch: the pointer in a thread-local, and also under a key whose
 * destructor frees it when the thread exits (a pool helper's at tsr_pool_free). */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static bool scratch_key_ok;
static _Thread_local struct { void *p; size_t cap; } scratch;

/* At thread exit: free the buffer and forget it, so nothing later in the thread's exit
 * (another key's destructor) can be handed the freed block. */
static void scratch_free(void *p) {
        if (scratch.p == p) {
                scratch.p = NULL;
                scratch.cap = 0;
        }
        free(p);
}

static void scratch_key_make(void) { scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

void *tsr_thread_scratch(size_t bytes) {
        if (bytes <= scratch.cap)
                return scratch.p;
        pthread_once(&scratch_once, scratch_key_make);
        size_t cap = bytes > SIZE_MAX - 63 ? 0 : (bytes + 63) / 64 * 64;
        void *p = cap ? aligned_alloc(64, cap) : NULL;
        if (!p)
                return NULL;
        /* Without the key (PTHREAD_KEYS_MAX used up) the buffer still serves; a thread
         * that exits then leaks it rather than every op failing. */
        if (scratch_key_ok)
                (void)pthread_setspecific(scratch_key, p);
        free(scratch.p);
        scratch.p = p;
        scratch.cap = cap;
        return p;
}
