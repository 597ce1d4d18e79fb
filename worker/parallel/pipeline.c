/* pipeline.c - a grid of pipeline stages x tensor-parallel ranks of one worker process as
 * rank threads (pipeline.h).
 *
 * The mailbox (mu, cv, step_id, step) is how the caller wakes the rank threads: an idle
 * worker may wait hours for its next step, and comm waits are bounded (a timeout would
 * fail the group), so the wait for work is a plain condvar and only the waits inside a
 * step go through the comm.  Stage-to-stage messages are [status (int32), pad (int32),
 * payload floats]: the header keeps the payload 8-byte aligned and is two floats long.
 *
 * Groups: `world` holds every rank (stage-to-stage send/recv, and the collectives when
 * the grid is one stage or tp is 1); with several stages and tp > 1, tp_groups[s] holds
 * stage s's tp ranks (their collectives).  A local group fails as a whole, so an abort
 * aborts every group (a rank waiting in its TP group's all-reduce must wake too). */
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
#define MAX_RANKS 64
#define MAX_IN_FLIGHT TSR_PIPELINE_MAX_IN_FLIGHT

typedef struct rank {
        tsr_pipeline *p;
        uint32_t id;            /* global rank: stage x tp + tp_rank */
        pthread_t th;
        bool running;           /* th is to be joined */
        /* under p->mu while they live (abort reads them): */
        tsr_comm *comm;         /* on the grid's group */
        tsr_comm *tpc;          /* on the stage's TP group; NULL when the grid's group is it (or tp 1) */
        uint64_t first_seen;    /* step_id when the thread was started: it runs the steps after it */
        float *in, *out;        /* HDR_FLOATS + payload, grown as steps need */
        size_t in_cap, out_cap;
} rank;

struct tsr_pipeline {
        uint32_t n_stages, tp, n;       /* n = n_stages x tp */
        uint32_t timeout_ms;
        tsr_pipeline_stage_fn fn;
        void *ud;
        rank ranks[MAX_RANKS];                          /* [n]; ranks[0] is the caller's */
        /* the current epoch's; NULL before the first step / after a failure */
        tsr_comm_local_group *world;
        tsr_comm_local_group *tp_groups[MAX_RANKS];     /* [n_stages] when n_stages > 1 and tp > 1 */
        uint64_t epoch;
        /* the mailbox, under mu: steps[id % MAX_IN_FLIGHT] is step id's; a rank runs
         * every id after the one it last ran, in order */
        pthread_mutex_t mu;
        pthread_cond_t cv;
        uint64_t step_id;
        const tsr_pipeline_step *steps[MAX_IN_FLIGHT];
        bool stop;
        /* the caller's: the steps submitted and not yet waited for, oldest first, each
         * with the epoch it went in on (a step of a grid that has since failed fails) */
        uint64_t oldest, n_in_flight;
        uint64_t in_flight_epoch[MAX_IN_FLIGHT];
        tsr_status one_stage_st[MAX_IN_FLIGHT];         /* a one-stage grid's steps end in submit */
};

static tsr_status grow(float **buf, size_t *cap, size_t floats) {
        if (floats <= *cap && *buf)
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

static bool separate_tp_groups(const tsr_pipeline *p) { return p->n_stages > 1 && p->tp > 1; }

/* The comm of the rank's stage's TP group: what the stage function's collectives use. */
static tsr_comm *tp_comm(const rank *r) { return r->tpc ? r->tpc : r->comm; }

/* The tp ranks of a stage agree on its status: all-gather theirs (tp > 1).  A shared
 * status (OK, or a failure every shard met alike) goes into *st; ranks that disagree
 * return the first failure, as a comm failure would be (the grid starts over). */
static tsr_status tp_agree(rank *r, tsr_status *st) {
        int32_t mine = (int32_t)*st, all[MAX_RANKS];
        tsr_status cst = tsr_comm_all_gather(tp_comm(r), &mine, all, sizeof mine, NULL);

        if (cst != TSR_OK)
                return cst;
        for (uint32_t q = 1; q < r->p->tp; q++)
                if (all[q] != all[0])
                        return (tsr_status)(all[0] != TSR_OK ? all[0] : all[q]);
        *st = (tsr_status)all[0];
        return TSR_OK;
}

/* Rank r's part of step `id`: receive (stage > 0), run, agree with the stage's tp ranks,
 * send on (the last stage's tp rank 0: to rank 0).  `result` is where rank 0 of a
 * one-stage grid writes the output itself.  A rank failure travels on in the header
 * (*step_st for a one-stage grid); a comm failure is returned (the grid is dead). */
static tsr_status rank_step(rank *r, uint64_t id, const tsr_pipeline_step *step, float *result,
                            tsr_status *step_st) {
        tsr_pipeline *p = r->p;
        uint32_t stage = r->id / p->tp;
        bool last = stage + 1 == p->n_stages;
        size_t out_n = last ? step->out_floats : step->io_floats;
        tsr_status st = TSR_OK, cst;

        if (stage > 0 && (st = grow(&r->in, &r->in_cap, step->io_floats)) != TSR_OK)
                return st;      /* cannot even receive: the leader's deadline fails the step */
        if (!result && (st = grow(&r->out, &r->out_cap, out_n)) != TSR_OK)
                return st;
        if (stage > 0) {
                cst = tsr_comm_recv(r->comm, r->in, (HDR_FLOATS + step->io_floats) * sizeof(float),
                                    (int)(r->id - p->tp), id, NULL);
                if (cst != TSR_OK)
                        return cst;
                st = hdr_status(r->in);
        }
        float *out = result ? result : r->out + HDR_FLOATS;
        if (st == TSR_OK)
                st = p->fn(p->ud, r->id, step, stage > 0 ? r->in + HDR_FLOATS : step->in, out, tp_comm(r));
        if (p->tp > 1 && (cst = tp_agree(r, &st)) != TSR_OK)
                return cst;
        if (p->n_stages == 1) {
                if (step_st)    /* rank 0: the step's status; the others' are the same */
                        *step_st = st;
                return TSR_OK;
        }
        if (last && r->id % p->tp != 0)
                return TSR_OK;  /* the same logits as tp rank 0's: only that one goes back */
        hdr_set(r->out, st);
        return tsr_comm_send(r->comm, r->out, (HDR_FLOATS + out_n) * sizeof(float),
                             last ? 0 : (int)(r->id + p->tp), id, NULL);
}

/* Abort every comm of the grid (each local group fails as a whole).  mu held. */
static void abort_all_locked(tsr_pipeline *p) {
        for (uint32_t i = 0; i < p->n; i++) {
                if (p->ranks[i].comm)
                        tsr_comm_abort(p->ranks[i].comm);
                if (p->ranks[i].tpc)
                        tsr_comm_abort(p->ranks[i].tpc);
        }
}

/* This rank's comms on the current epoch's groups.  mu held (the groups and the epoch
 * are the caller's until the threads are joined). */
static tsr_status comms_new_locked(rank *r, tsr_comm **comm, tsr_comm **tpc, char *err, size_t errlen) {
        tsr_pipeline *p = r->p;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = (int)r->id, .size = (int)p->n,
                           .timeout_ms = p->timeout_ms, .epoch = p->epoch, .local = p->world};
        tsr_status st = tsr_comm_new(&d, comm, err, errlen);

        *tpc = NULL;
        if (st != TSR_OK || !separate_tp_groups(p))
                return st;
        d.rank = (int)(r->id % p->tp);
        d.size = (int)p->tp;
        d.local = p->tp_groups[r->id / p->tp];
        if ((st = tsr_comm_new(&d, tpc, err, errlen)) != TSR_OK)
                tsr_comm_free(comm);
        return st;
}

static void *rank_main(void *arg) {
        rank *r = arg;
        tsr_pipeline *p = r->p;
        tsr_comm *comm = NULL, *tpc = NULL;
        uint64_t seen;
        char name[32], err[256];
        tsr_status st;

        if (p->tp == 1)
                snprintf(name, sizeof name, "pp%u", r->id);
        else if (p->n_stages == 1)
                snprintf(name, sizeof name, "tp%u", r->id);
        else
                snprintf(name, sizeof name, "pp%utp%u", r->id / p->tp, r->id % p->tp);
        tsr_log_set_thread(name);
        pthread_mutex_lock(&p->mu);
        seen = r->first_seen;
        st = comms_new_locked(r, &comm, &tpc, err, sizeof err);
        if (st != TSR_OK) {
                pthread_mutex_unlock(&p->mu);
                log_error("pipeline rank %u: %s", r->id, err);
                return NULL;    /* the leader's first wait on this rank fails by its deadline */
        }
        r->comm = comm;
        r->tpc = tpc;
        for (;;) {
                while (!p->stop && p->step_id == seen)
                        pthread_cond_wait(&p->cv, &p->mu);
                if (p->stop)
                        break;
                seen++;         /* every step in turn: several may be in flight */
                const tsr_pipeline_step *step = p->steps[seen % MAX_IN_FLIGHT];
                pthread_mutex_unlock(&p->mu);
                st = rank_step(r, seen, step, NULL, NULL);
                pthread_mutex_lock(&p->mu);
                if (st != TSR_OK) {
                        log_error("pipeline rank %u (stage %u, tp rank %u): step %llu: %s; the rank stops (the next "
                                  "step starts a new group)", r->id, r->id / p->tp, r->id % p->tp,
                                  (unsigned long long)seen, tsr_status_str(st));
                        abort_all_locked(p);    /* the others must not wait for this rank */
                        break;
                }
        }
        r->comm = NULL;
        r->tpc = NULL;
        pthread_mutex_unlock(&p->mu);
        tsr_comm_free(&tpc);
        tsr_comm_free(&comm);
        return NULL;
}

/* Stop and join the rank threads; free the leader's comms and the groups.  Caller's
 * thread. */
static void stop_ranks(tsr_pipeline *p) {
        tsr_comm *c0, *t0;

        pthread_mutex_lock(&p->mu);
        p->stop = true;
        abort_all_locked(p);    /* wakes a rank still inside a comm wait */
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (uint32_t i = 1; i < p->n; i++)
                if (p->ranks[i].running) {
                        pthread_join(p->ranks[i].th, NULL);
                        p->ranks[i].running = false;
                }
        pthread_mutex_lock(&p->mu);
        c0 = p->ranks[0].comm;
        t0 = p->ranks[0].tpc;
        p->ranks[0].comm = NULL;
        p->ranks[0].tpc = NULL;
        p->stop = false;
        pthread_mutex_unlock(&p->mu);
        tsr_comm_free(&t0);
        tsr_comm_free(&c0);
        tsr_comm_local_group_unref(&p->world);
        for (uint32_t s = 0; s < p->n_stages; s++)
                tsr_comm_local_group_unref(&p->tp_groups[s]);
}

/* Fresh groups (epoch + 1), the leader's comms and the rank threads, all signals blocked
 * in them.  Caller's thread. */
static tsr_status start_ranks(tsr_pipeline *p) {
        tsr_comm *c0 = NULL, *t0 = NULL;
        sigset_t all, old;
        char err[256];
        tsr_status st;

        st = tsr_comm_local_group_new((int)p->n, &p->world);
        for (uint32_t s = 0; st == TSR_OK && separate_tp_groups(p) && s < p->n_stages; s++)
                st = tsr_comm_local_group_new((int)p->tp, &p->tp_groups[s]);
        if (st != TSR_OK) {
                stop_ranks(p);
                return st;
        }
        p->epoch++;
        pthread_mutex_lock(&p->mu);
        if ((st = comms_new_locked(&p->ranks[0], &c0, &t0, err, sizeof err)) == TSR_OK) {
                p->ranks[0].comm = c0;
                p->ranks[0].tpc = t0;
        }
        pthread_mutex_unlock(&p->mu);
        if (st != TSR_OK) {
                log_error("pipeline rank 0: %s", err);
                stop_ranks(p);
                return st;
        }
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

tsr_status tsr_pipeline_new_grid(uint32_t n_stages, uint32_t tp, uint32_t timeout_ms, tsr_pipeline_stage_fn fn,
                                 void *ud, tsr_pipeline **ret) {
        tsr_pipeline *p;

        if (n_stages < 1 || tp < 1 || n_stages > MAX_RANKS || tp > MAX_RANKS || n_stages * tp < 2 ||
            n_stages * tp > MAX_RANKS || !fn || !ret)
                return TSR_E_INVAL;
        p = calloc(1, sizeof *p);
        if (!p)
                return TSR_E_NOMEM;
        p->n_stages = n_stages;
        p->tp = tp;
        p->n = n_stages * tp;
        p->timeout_ms = timeout_ms;
        p->fn = fn;
        p->ud = ud;
        for (uint32_t i = 0; i < p->n; i++)
                p->ranks[i] = (rank){.p = p, .id = i};
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        *ret = p;
        return TSR_OK;
}

tsr_status tsr_pipeline_new(uint32_t n_stages, uint32_t timeout_ms, tsr_pipeline_stage_fn fn, void *ud,
                            tsr_pipeline **ret) {
        return tsr_pipeline_new_grid(n_stages < 2 ? 0 : n_stages, 1, timeout_ms, fn, ud, ret);
}

tsr_status tsr_pipeline_new_kind(tsr_pipeline_kind kind, uint32_t n_ranks, uint32_t timeout_ms,
                                 tsr_pipeline_stage_fn fn, void *ud, tsr_pipeline **ret) {
        if (n_ranks < 2)
                return TSR_E_INVAL;
        return kind == TSR_PIPELINE_TENSOR ? tsr_pipeline_new_grid(1, n_ranks, timeout_ms, fn, ud, ret)
                                           : tsr_pipeline_new_grid(n_ranks, 1, timeout_ms, fn, ud, ret);
}

/* The grid is dead (a comm failure): stop every rank before returning, so none still
 * reads a plan; every step still in flight fails; the next step builds new groups. */
static tsr_status grid_failed(tsr_pipeline *p, uint64_t id, tsr_status cst) {
        log_error("pipeline: step %llu failed in the comm (%s): the in-flight requests fail; a new group "
                  "(epoch %llu) serves the next step", (unsigned long long)id, tsr_status_str(cst),
                  (unsigned long long)p->epoch + 1);
        stop_ranks(p);
        return cst;
}

tsr_status tsr_pipeline_submit(tsr_pipeline *p, const tsr_pipeline_step *step, float *out) {
        rank *r0 = &p->ranks[0];
        uint64_t id;
        tsr_status st = TSR_OK, cst;
        bool one_stage = p->n_stages == 1;

        if (!step || (step->out_floats && !out) || p->n_in_flight >= MAX_IN_FLIGHT)
                return TSR_E_INVAL;
        if (!p->world && (st = start_ranks(p)) != TSR_OK)
                return st;
        pthread_mutex_lock(&p->mu);
        id = ++p->step_id;
        p->steps[id % MAX_IN_FLIGHT] = step;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        if (p->n_in_flight == 0)
                p->oldest = id;
        p->in_flight_epoch[id % MAX_IN_FLIGHT] = p->epoch;
        p->n_in_flight++;

        /* Stage 0 here; its output goes to stage 1, or, one stage, rank 0 writes the
         * output itself and the step is over. */
        cst = rank_step(r0, id, step, one_stage ? out : NULL, &st);
        if (cst != TSR_OK) {
                p->n_in_flight--;       /* not in flight: no wait for it (older ones fail theirs) */
                return grid_failed(p, id, cst);
        }
        if (one_stage)
                p->one_stage_st[id % MAX_IN_FLIGHT] = st;
        return TSR_OK;
}

tsr_status tsr_pipeline_wait(tsr_pipeline *p, const tsr_pipeline_step *step, float *out) {
        rank *r0 = &p->ranks[0];
        tsr_status st, cst;

        if (p->n_in_flight == 0)
                return TSR_E_INVAL;
        uint64_t id = p->oldest++;
        p->n_in_flight--;
        if (!p->world || p->in_flight_epoch[id % MAX_IN_FLIGHT] != p->epoch)
                return TSR_E_CANCELLED;     /* its grid failed after it went in */
        if (p->n_stages == 1)
                return p->one_stage_st[id % MAX_IN_FLIGHT];
        /* the output from the last stage's tp rank 0 */
        if ((st = grow(&r0->in, &r0->in_cap, step->out_floats)) != TSR_OK)
                cst = st;
        else
                cst = tsr_comm_recv(r0->comm, r0->in, (HDR_FLOATS + step->out_floats) * sizeof(float),
                                    (int)((p->n_stages - 1) * p->tp), id, NULL);
        if (cst != TSR_OK)
                return grid_failed(p, id, cst);
        st = hdr_status(r0->in);
        if (st == TSR_OK && step->out_floats)
                memcpy(out, r0->in + HDR_FLOATS, step->out_floats * sizeof(float));
        return st;
}

tsr_status tsr_pipeline_run(tsr_pipeline *p, const tsr_pipeline_step *step, float *out) {
        tsr_status st = tsr_pipeline_submit(p, step, out);
        return st != TSR_OK ? st : tsr_pipeline_wait(p, step, out);
}

void tsr_pipeline_abort(tsr_pipeline *p) {
        if (!p)
                return;
        pthread_mutex_lock(&p->mu);
        abort_all_locked(p);
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
