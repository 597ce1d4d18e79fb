/* pool.c - the grammar compile thread (pool.h).  Jobs are shared by the engine and
 * the compile thread: a reference count (the last release frees) and a state published
 * with release/acquire ordering, so the engine reads the result only once it is whole. */
#include "grammar/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tsr_grammar_job {
        atomic_int refs;
        atomic_int state;              /* tsr_grammar_job_state */
        tsr_grammar_spec spec;         /* spec.text owned */
        tsr_grammar_compiled *compiled;
        char err[512];
        tsr_grammar_job *next;         /* pool queue link, under the pool's mutex */
};

struct tsr_grammar_pool {
        tsr_grammar_vocab *vocab;
        pthread_t thread;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        tsr_grammar_job *head, *tail;  /* queued jobs, each holding one reference */
        bool quit;
};

static void job_unref(tsr_grammar_job *j) {
        if (j && atomic_fetch_sub_explicit(&j->refs, 1, memory_order_acq_rel) == 1) {
                tsr_grammar_compiled_free(&j->compiled);
                free((char *)j->spec.text);
                free(j);
        }
}

static void job_finish(tsr_grammar_job *j, tsr_grammar_job_state st) {
        atomic_store_explicit(&j->state, st, memory_order_release);
}

/* The "grammar" thread: compile queued jobs in order.  A job nobody holds any more (its
 * request was aborted while it waited) is skipped. */
static void *pool_main(void *arg) {
        tsr_grammar_pool *p = arg;
        pthread_mutex_lock(&p->mu);
        for (;;) {
                tsr_grammar_job *j;
                while (!p->head && !p->quit)
                        pthread_cond_wait(&p->cv, &p->mu);
                if (p->quit)
                        break;
                j = p->head;
                p->head = j->next;
                if (!p->head)
                        p->tail = NULL;
                pthread_mutex_unlock(&p->mu);
                if (atomic_load_explicit(&j->refs, memory_order_acquire) > 1) {
                        tsr_status st = tsr_grammar_compile(p->vocab, &j->spec, &j->compiled, j->err, sizeof(j->err));
                        job_finish(j, st == TSR_OK ? TSR_GRAMMAR_JOB_READY : TSR_GRAMMAR_JOB_FAILED);
                }
                job_unref(j);
                pthread_mutex_lock(&p->mu);
        }
        /* Stopping: the queued jobs fail (their requests end with an error). */
        while (p->head) {
                tsr_grammar_job *j = p->head;
                p->head = j->next;
                snprintf(j->err, sizeof(j->err), "the worker is shutting down");
                job_finish(j, TSR_GRAMMAR_JOB_FAILED);
                job_unref(j);
        }
        p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        return NULL;
}

tsr_status tsr_grammar_pool_new(tsr_grammar_vocab *v, tsr_grammar_pool **ret) {
        tsr_grammar_pool *p = calloc(1, sizeof(*p));
        if (!p)
                return TSR_E_NOMEM;
        p->vocab = v;
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        if (pthread_create(&p->thread, NULL, pool_main, p) != 0) {
                pthread_mutex_destroy(&p->mu);
                pthread_cond_destroy(&p->cv);
                free(p);
                return TSR_E_NOMEM;
        }
        pthread_setname_np(p->thread, "grammar");
        *ret = p;
        return TSR_OK;
}

void tsr_grammar_pool_free(tsr_grammar_pool **pp) {
        tsr_grammar_pool *p = pp ? *pp : NULL;
        if (!p)
                return;
        pthread_mutex_lock(&p->mu);
        p->quit = true;
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
        pthread_join(p->thread, NULL);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        *pp = NULL;
}

const tsr_grammar_vocab *tsr_grammar_pool_vocab(const tsr_grammar_pool *p) { return p->vocab; }

tsr_grammar_job *tsr_grammar_pool_submit(tsr_grammar_pool *p, const tsr_grammar_spec *spec) {
        tsr_grammar_job *j = calloc(1, sizeof(*j));
        char *text = malloc(spec->len + 1);
        if (!j || !text) {
                free(j);
                free(text);
                return NULL;
        }
        if (spec->len)
                memcpy(text, spec->text, spec->len);
        text[spec->len] = '\0';
        j->spec = *spec;
        j->spec.text = text;
        atomic_init(&j->refs, 2);   /* the caller's and the queue's */
        atomic_init(&j->state, TSR_GRAMMAR_JOB_PENDING);
        pthread_mutex_lock(&p->mu);
        if (p->tail)
                p->tail->next = j;
        else
                p->head = j;
        p->tail = j;
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
        return j;
}

tsr_grammar_job_state tsr_grammar_job_poll(const tsr_grammar_job *j) {
        return (tsr_grammar_job_state)atomic_load_explicit(&((tsr_grammar_job *)j)->state, memory_order_acquire);
}

const tsr_grammar_compiled *tsr_grammar_job_compiled(const tsr_grammar_job *j) { return j->compiled; }

const char *tsr_grammar_job_error(const tsr_grammar_job *j) { return j->err; }

void tsr_grammar_job_release(tsr_grammar_job **j) {
        if (j) {
                job_unref(*j);
                *j = NULL;
        }
}
