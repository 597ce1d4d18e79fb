/* pipeline.h - pipeline and tensor parallelism inside one worker process (issue #20): a
 * grid of n_stages x tp ranks, global rank = stage x tp + tp_rank (TP innermost, as
 * vLLM), rank 0 on the caller's thread (the engine thread, which schedules), every other
 * rank on a thread this module owns, connected by the comm layer's local backend.
 *
 * One step: the caller posts the step (a pointer to its plan: the ranks are threads of
 * the same process, so the plan is handed over, not copied; it stays valid because the
 * caller waits for the step to finish) to every rank thread.  The tp ranks of a stage
 * run the stage's layers together, each on its shard, meeting in the collectives their
 * function makes on their stage's own TP group; stage s's rank (s, t) receives the
 * previous stage's activations from its counterpart (s - 1, t) (comm send/recv on the
 * grid's group, tag = the step's id), runs, and sends to (s + 1, t); the last stage's
 * tp rank 0 sends the output (the logits rows) back to rank 0.
 *
 * Why every tp rank receives from its counterpart rather than tp rank 0 receiving and
 * broadcasting in its group: the row-parallel all-reduce that ends a stage leaves the
 * same bits on every tp rank of it, so the T transfers carry identical bytes and need
 * no collective afterwards; in one process each is one copy, made by the T threads at
 * once, where a broadcast would add a barrier of the whole TP group to every stage
 * boundary and serialize the copies behind tp rank 0.  (Across nodes, vLLM's answer
 * is different: each tp rank sends 1/tp of the tensor and the receivers all-gather, to
 * cut the bytes on the wire; that belongs to the zmq data plane, not here.)
 *
 * Micro-batches (vLLM's batch queue): tsr_pipeline_submit runs stage 0 of a step and
 * returns once its output is on the way to stage 1, so the caller can submit the next
 * step while the later stages work on this one; tsr_pipeline_wait takes the oldest
 * step's output.  Every rank runs the steps in submit order, so a step's KV writes on a
 * stage come after those of every step submitted before it (block ids a later step
 * reuses, a request's next chunk).  tsr_pipeline_run is submit + wait.
 *
 * Every stage-to-stage message starts with the sender's status: a stage whose own work
 * failed (bad input, out of memory) still sends, so the others learn it at once and the
 * step fails with that status while the groups stay up.  With tp > 1 the ranks of a
 * stage all-gather their statuses after their part (the stage's end): all OK, or all
 * the same failure (bad input fails every shard alike, before or at the same
 * collective), travels on; ranks that disagree (one failed on its own, so its peers may
 * have met it in a mismatched collective) fail the grid like a comm failure.  A comm
 * failure (a deadline passed, an abort) is sticky in the comm layer: the step fails with
 * it, every rank thread is stopped and joined before tsr_pipeline_run returns (nothing
 * still reads the plan), and the next step starts fresh groups with epoch + 1.  The
 * worker stays up.
 *
 * Threads: tsr_pipeline_submit / wait / run from one thread at a time (the engine's
 * forward);
 * tsr_pipeline_abort from any thread; new/free from the thread that owns the runner.
 * Rank threads block every signal (the io thread reads SIGTERM through a signalfd). */
#ifndef TSR_PARALLEL_PIPELINE_H
#define TSR_PARALLEL_PIPELINE_H

#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

typedef struct tsr_pipeline tsr_pipeline;
struct tsr_comm;

/* How the ranks share a step. */
typedef enum tsr_pipeline_kind {
        /* Pipeline stages only: n x 1 (tp 1). */
        TSR_PIPELINE_STAGES = 0,
        /* Tensor parallelism only: 1 x n, every rank runs the whole step at once on its
         * shard; rank 0's output is the result. */
        TSR_PIPELINE_TENSOR = 1,
} tsr_pipeline_kind;

/* One step as every stage sees it; borrowed for the duration of tsr_pipeline_run. */
typedef struct tsr_pipeline_step {
        const void *plan;       /* the caller's step plan, read-only for the stages */
        size_t io_floats;       /* floats stage s hands stage s + 1 (hidden state and residual) */
        /* io_floats the grid's first stage starts from, when the grid is not the model's
         * first stage (a node of a multi-node replica: the previous node's output), read
         * by every tp rank of it; else NULL. */
        const float *in;
        size_t out_floats;      /* floats the last stage returns (logits rows); may be 0 */
} tsr_pipeline_step;

/* Rank `rank`'s part of a step, on that rank's thread: stage = rank / tp, tp_rank = rank
 * % tp.  `in` holds io_floats from the previous stage (on stage 0: step->in); `out` receives
 * io_floats for the next stage, or out_floats on the last stage (every tp rank of it:
 * only tp rank 0's are returned).  `comm` is the rank's handle on its stage's TP group
 * (size tp), for the collectives of the shard's layers; with tp 1 it is the grid's
 * group (every stage).  Returns the rank's status. */
typedef tsr_status (*tsr_pipeline_stage_fn)(void *ud, uint32_t rank, const tsr_pipeline_step *step,
                                            const float *in, float *out, struct tsr_comm *comm);

/* A grid of n_stages x tp ranks (2 .. 64 in all) running fn(ud, ...); every comm wait is
 * bounded by timeout_ms (0: the comm default).  The rank threads start with the first
 * step.  TSR_E_INVAL or TSR_E_NOMEM; *ret written only on success. */
tsr_status tsr_pipeline_new_grid(uint32_t n_stages, uint32_t tp, uint32_t timeout_ms, tsr_pipeline_stage_fn fn,
                                 void *ud, tsr_pipeline **ret);
/* n_stages x 1. */
tsr_status tsr_pipeline_new(uint32_t n_stages, uint32_t timeout_ms, tsr_pipeline_stage_fn fn, void *ud,
                            tsr_pipeline **ret);
/* `kind`: n_ranks x 1 (stages) or 1 x n_ranks (tensor). */
tsr_status tsr_pipeline_new_kind(tsr_pipeline_kind kind, uint32_t n_ranks, uint32_t timeout_ms,
                                 tsr_pipeline_stage_fn fn, void *ud, tsr_pipeline **ret);
/* Steps in flight at most (submitted, not yet waited for). */
#define TSR_PIPELINE_MAX_IN_FLIGHT 64

/* Start one step: post it to every rank thread and run rank 0's part (stage 0) here.
 * `step` and `out` stay the caller's, untouched, until the step's tsr_pipeline_wait; on
 * a one-stage grid the step is over on return (the output written, its status kept for
 * the wait).  TSR_OK: the step is in flight.  Otherwise it is not (no wait for it): a
 * comm failure (the grid starts over, and the steps still in flight fail in their
 * waits), TSR_E_INTERNAL when a rank thread cannot be started, TSR_E_INVAL with
 * TSR_PIPELINE_MAX_IN_FLIGHT steps in flight. */
tsr_status tsr_pipeline_submit(tsr_pipeline *p, const tsr_pipeline_step *step, float *out);
/* End the oldest step in flight (`step` and `out` are what it was submitted with): the
 * last stage's out_floats land in `out`.  Returns the first failing stage's status, or
 * the comm's (TSR_E_TIMEOUT, TSR_E_CANCELLED, ...: the grid starts over) or, with tp > 1,
 * the first of a stage's disagreeing statuses; TSR_E_CANCELLED when the grid failed after
 * the step went in; `out` is then undefined.  TSR_E_INVAL when nothing is in flight. */
tsr_status tsr_pipeline_wait(tsr_pipeline *p, const tsr_pipeline_step *step, float *out);
/* One step through every stage, nothing else in flight: submit + wait. */
tsr_status tsr_pipeline_run(tsr_pipeline *p, const tsr_pipeline_step *step, float *out);
/* Fail the step in flight (if any): every comm wait returns TSR_E_CANCELLED promptly.
 * Any thread; the next step runs on a fresh group. */
void tsr_pipeline_abort(tsr_pipeline *p);
/* Grids made so far (1 after the first step; + 1 after each failure). */
uint64_t tsr_pipeline_epoch(const tsr_pipeline *p);
/* Stop and join every rank thread, free everything; NULL is fine; clears *p. */
void tsr_pipeline_free(tsr_pipeline **p);

#endif
