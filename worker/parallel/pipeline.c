/* pipeline.c - stages (or tensor-parallel ranks) of one worker process as rank threads
 * (pipeline.h).
 *
 * The mailbox (mu, cv, step_id, step) is how the caller wakes the rank threads: an idle
 * worker may wait hours for its next step, and comm waits are bounded (a timeout would
 * fail the group), so the wait for work is a plain condvar and only the waits inside a
 * step go through the comm.  Messages are [status (int32), pad (int32), payload floats]:
 * the header keeps the payload 8-byte aligned and is two floats long. */
#include "worker/parallel/pipeline.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/parallel/comm.h"

#define HDR_FLOATS 2

typedef struct rank {
        tsr_pipeline *p;
        uint32_t stage;
        pthread_t th;
        bool running;           /* th is to be joined */
        tsr_comm *comm;         /* under p->mu: the rank's comm while it lives (abort reads it) */
        uint64_t first_seen;    /* step_id when the thread was started: it runs the steps after it */
        float *in, *out;        /* HDR_FLOATS + payload, grown as steps need */
        size_t in_cap, out_cap;
} rank;

struct tsr_pipeline {
        tsr_pipeline_kind kind;
        uint32_t n;
        uint32_t timeout_ms;
        tsr_pipeline_stage_fn fn;
        void *ud;
        rank ranks[64];                 /* [n]; ranks[0] is the caller's */
        tsr_comm_local_group *group;    /* the current epoch's; NULL before the first step / after a failure */
        uint64_t epoch;
        /* the mailbox, under mu */
        pthread_mutex_t mu;
        pthread_cond_t cv;
        uint64_t step_id;
        const tsr_pipeline_step *step;
        bool stop;
};

static tsr_status grow(float **buf, size_t *cap, size_t floats) {
        if (floats <= *cap)
                return TSR_OK;
        float *b = realloc(*buf, (floats + HDR_FLOATS) * sizeof(float));
        if (!b)
                return TSR_E_NOMEM;
        *buf = b;
        *cap = floats;
        return TSR_OK;
}

static void hdr_set(float *buf, tsr_status st) {
        int32_t h[2] = {(int32_t)st, 0};
        memcpy(buf, h, sizeof h);
}

static tsr_status hdr_status(const float *buf) {
        int32_t h[2];
        memcpy(h, buf, sizeof h);
        return (tsr_status)h[0];
}

/* Stage r's part of step `id` for r >= 1: receive, run, send on.  A stage failure travels
 * on in the header; a comm failure is returned (the group is dead). */
static tsr_status rank_step(rank *r, uint64_t id, const tsr_pipeline_step *step) {
        tsr_pipeline *p = r->p;
        bool last = r->stage + 1 == p->n;
        size_t out_n = last ? step->out_floats : step->io_floats;
        tsr_status st, cst;

        if (p->kind == TSR_PIPELINE_TENSOR) {   /* every rank at once; the statuses meet at the end */
                int32_t mine, all[64];
                if ((st = grow(&r->out, &r->out_cap, step->out_floats)) != TSR_OK)
                        return st;
                mine = (int32_t)p->fn(p->ud, r->stage, step, NULL, r->out + HDR_FLOATS, r->comm);
                return tsr_comm_all_gather(r->comm, &mine, all, sizeof mine, NULL);
        }
        st = grow(&r->in, &r->in_cap, step->io_floats);
        if (st == TSR_OK)
                st = grow(&r->out, &r->out_cap, out_n);
        if (st != TSR_OK)
                return st;      /* cannot even receive: the leader's deadline fails the step */
        cst = tsr_comm_recv(r->comm, r->in, (HDR_FLOATS + step->io_floats) * sizeof(float), (int)r->stage - 1, id,
                            NULL);
        if (cst != TSR_OK)
                return cst;
        st = hdr_status(r->in);
        if (st == TSR_OK)
                st = p->fn(p->ud, r->stage, step, r->in + HDR_FLOATS, r->out + HDR_FLOATS, r->comm);
        hdr_set(r->out, st);
        return tsr_comm_send(r->comm, r->out, (HDR_FLOATS + out_n) * sizeof(float), last ? 0 : (int)r->stage + 1, id,
                             NULL);
}

static void *rank_main(void *arg) {
        rank *r = arg;
        tsr_pipeline *p = r->p;
        tsr_comm *comm = NULL;
        uint64_t seen;
        char name[16], err[256];

        snprintf(name, sizeof name, "pp%u", r->stage);
        tsr_log_set_thread(name);
        pthread_mutex_lock(&p->mu);
        seen = r->first_seen;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = (int)r->stage, .size = (int)p->n,
                           .timeout_ms = p->timeout_ms, .epoch = p->epoch, .local = p->group};
        pthread_mutex_unlock(&p->mu);
        if (tsr_comm_new(&d, &comm, err, sizeof err) != TSR_OK) {
                log_error("pipeline stage %u: %s", r->stage, err);
                return NULL;    /* the leader's first wait on this rank fails by its deadline */
        }
        pthread_mutex_lock(&p->mu);
        r->comm = comm;
        for (;;) {
                while (!p->stop && p->step_id == seen)
                        pthread_cond_wait(&p->cv, &p->mu);
                if (p->stop)
                        break;
                seen = p->step_id;
                const tsr_pipeline_step *step = p->step;
                pthread_mutex_unlock(&p->mu);
                tsr_status st = rank_step(r, seen, step);
                pthread_mutex_lock(&p->mu);
                if (st != TSR_OK) {
                        log_error("pipeline stage %u: step %llu: %s; the stage stops (the next step starts a new "
                                  "group)", r->stage, (unsigned long long)seen, tsr_status_str(st));
                        if (r->comm)
                                tsr_comm_abort(r->comm);      /* the others must not wait for this rank */
                        break;
                }
        }
        r->comm = NULL;
        pthread_mutex_unlock(&p->mu);
        tsr_comm_free(&comm);
        return NULL;
}

/* Stop and join the rank threads; free the leader's comm and the group.  Caller's thread. */
static void stop_ranks(tsr_pipeline *p) {
        tsr_comm *c0;

        pthread_mutex_lock(&p->mu);
        p->stop = true;
        for (uint32_t i = 0; i < p->n; i++)
                if (p->ranks[i].comm)
                        tsr_comm_abort(p->ranks[i].comm);     /* wakes a rank still inside a comm wait */
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (uint32_t i = 1; i < p->n; i++)
                if (p->ranks[i].running) {
                        pthread_join(p->ranks[i].th, NULL);
                        p->ranks[i].running = false;
                }
        pthread_mutex_lock(&p->mu);
        c0 = p->ranks[0].comm;
        p->ranks[0].comm = NULL;
        p->stop = false;
        pthread_mutex_unlock(&p->mu);
        tsr_comm_free(&c0);
        tsr_comm_local_group_unref(&p->group);
}

/* A fresh group (epoch + 1), the leader's comm and the rank threads, all signals
 * blocked in them.  Caller's thread. */
static tsr_status start_ranks(tsr_pipeline *p) {
        tsr_comm *c0 = NULL;
        sigset_t all, old;
        char err[256];
        tsr_status st;

        if ((st = tsr_comm_local_group_new((int)p->n, &p->group)) != TSR_OK)
                return st;
        p->epoch++;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = 0, .size = (int)p->n,
                           .timeout_ms = p->timeout_ms, .epoch = p->epoch, .local = p->group};
        if ((st = tsr_comm_new(&d, &c0, err, sizeof err)) != TSR_OK) {
                log_error("pipeline stage 0: %s", err);
                tsr_comm_local_group_unref(&p->group);
                return st;
        }
        pthread_mutex_lock(&p->mu);
        p->ranks[0].comm = c0;
        pthread_mutex_unlock(&p->mu);
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (uint32_t i = 1; i < p->n && st == TSR_OK; i++) {
                p->ranks[i].first_seen = p->step_id;    /* only the caller's thread changes it */
                if (pthread_create(&p->ranks[i].th, NULL, rank_main, &p->ranks[i]) != 0)
                        st = TSR_E_INTERNAL;
                else
                        p->ranks[i].running = true;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (st != TSR_OK) {
                log_error("pipeline: cannot start the rank threads");
                stop_ranks(p);
        }
        return st;
}

tsr_status tsr_pipeline_new(uint32_t n_stages, uint32_t timeout_ms, tsr_pipeline_stage_fn fn, void *ud,
                            tsr_pipeline **ret) {
        return tsr_pipeline_new_kind(TSR_PIPELINE_STAGES, n_stages, timeout_ms, fn, ud, ret);
}

tsr_status tsr_pipeline_new_kind(tsr_pipeline_kind kind, uint32_t n_stages, uint32_t timeout_ms,
                                 tsr_pipeline_stage_fn fn, void *ud, tsr_pipeline **ret) {
        tsr_pipeline *p;

        if (n_stages < 2 || n_stages > 64 || !fn || !ret)
                return TSR_E_INVAL;
        p = calloc(1, sizeof *p);
        if (!p)
                return TSR_E_NOMEM;
        p->kind = kind;
        p->n = n_stages;
        p->timeout_ms = timeout_ms;
        p->fn = fn;
        p->ud = ud;
        for (uint32_t i = 0; i < n_stages; i++)
                p->ranks[i] = (rank){.p = p, .stage = i};
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        *ret = p;
        return TSR_OK;
}

tsr_status tsr_pipeline_run(tsr_pipeline *p, const tsr_pipeline_step *step, float *out) {
        rank *r0 = &p->ranks[0];
        uint64_t id;
        tsr_status st, cst;

        if (!step || (step->out_floats && !out))
                return TSR_E_INVAL;
        if (!p->group && (st = start_ranks(p)) != TSR_OK)
                return st;
        if ((st = grow(&r0->out, &r0->out_cap, step->io_floats)) != TSR_OK ||
            (st = grow(&r0->in, &r0->in_cap, step->out_floats)) != TSR_OK)
                return st;
        pthread_mutex_lock(&p->mu);
        id = ++p->step_id;
        p->step = step;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);

        if (p->kind == TSR_PIPELINE_TENSOR) {
                int32_t mine, all[64];
                mine = (int32_t)p->fn(p->ud, 0, step, NULL, out, r0->comm);
                cst = tsr_comm_all_gather(r0->comm, &mine, all, sizeof mine, NULL);
                for (uint32_t q = 0; cst == TSR_OK && q < p->n; q++)
                        if (all[q] != TSR_OK) {
                                /* a rank failed on its own: the others may have met it in a
                                 * mismatched collective, so the group starts over */
                                cst = (tsr_status)all[q];
                                break;
                        }
        } else {
                st = p->fn(p->ud, 0, step, NULL, r0->out + HDR_FLOATS, r0->comm);
                hdr_set(r0->out, st);
                cst = tsr_comm_send(r0->comm, r0->out, (HDR_FLOATS + step->io_floats) * sizeof(float), 1, id,
                                    NULL);
                if (cst == TSR_OK)
                        cst = tsr_comm_recv(r0->comm, r0->in, (HDR_FLOATS + step->out_floats) * sizeof(float),
                                            (int)p->n - 1, id, NULL);
        }
        if (cst != TSR_OK) {
                /* The group is dead: stop every rank before returning, so none still reads
                 * the plan; the next step builds a new group. */
                log_error("pipeline: step %llu failed in the comm (%s): the in-flight requests fail; a new group "
                          "(epoch %llu) serves the next step", (unsigned long long)id, tsr_status_str(cst),
                          (unsigned long long)p->epoch + 1);
                stop_ranks(p);
                return cst;
        }
        if (p->kind == TSR_PIPELINE_TENSOR)
                return TSR_OK;
        if (st == TSR_OK)
                st = hdr_status(r0->in);
        if (st == TSR_OK && step->out_floats)
                memcpy(out, r0->in + HDR_FLOATS, step->out_floats * sizeof(float));
        return st;
}

void tsr_pipeline_abort(tsr_pipeline *p) {
        if (!p)
                return;
        pthread_mutex_lock(&p->mu);
        for (uint32_t i = 0; i < p->n; i++)
                if (p->ranks[i].comm) {
                        tsr_comm_abort(p->ranks[i].comm);     /* local: fails the whole group */
                        break;
                }
        pthread_mutex_unlock(&p->mu);
}

uint64_t tsr_pipeline_epoch(const tsr_pipeline *p) { return p ? p->epoch : 0; }

void tsr_pipeline_free(tsr_pipeline **pp) {
        tsr_pipeline *p = pp ? *pp : NULL;
        if (!p)
                return;
        *pp = NULL;
        stop_ranks(p);
        for (uint32_t i = 0; i < p->n; i++) {
                free(p->ranks[i].in);
                free(p->ranks[i].out);
        }
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        free(p);
}
