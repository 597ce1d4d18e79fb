/* pipeline.h - pipeline parallelism inside one worker process (issue #20): one rank per
 * stage, stage 0 on the caller's thread (the engine thread, which schedules), stages
 * 1 .. n-1 on rank threads this module owns, connected by the comm layer's local backend.
 *
 * One step: the caller posts the step (a pointer to its plan: the ranks are threads of
 * the same process, so the plan is handed over, not copied; it stays valid because the
 * caller waits for the step to finish) to every rank thread, runs stage 0, and sends its
 * activations to stage 1 (comm send, tag = the step's id); stage s receives from s - 1,
 * runs, sends to s + 1; the last stage sends its output (the logits rows) back to stage 0.
 * No micro-batches: one step is in the pipeline at a time, so on one step the stages run
 * one after another (a later slice can keep pp steps in flight, vLLM's batch queue).
 *
 * Every message starts with the sender's status: a stage whose own work failed (bad
 * input, out of memory) still sends, so the others learn it at once and the step fails
 * with that status while the group stays up.  A comm failure (a deadline passed, an
 * abort) is sticky in the comm layer: the step fails with it, every rank thread is
 * stopped and joined before tsr_pipeline_run returns (nothing still reads the plan), and
 * the next step starts a fresh group with epoch + 1.  The worker stays up.
 *
 * Threads: tsr_pipeline_run from one thread at a time (the engine's forward);
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
        /* Pipeline stages: stage s runs after s - 1, from its output (above). */
        TSR_PIPELINE_STAGES = 0,
        /* Tensor parallelism: every rank runs the whole step at once on its shard, meeting
         * the others in the collectives its function makes on `comm`; then the ranks'
         * statuses are all-gathered (the step's end) and rank 0's output is the result.
         * A rank's failure aborts the group (the others may wait in a collective). */
        TSR_PIPELINE_TENSOR = 1,
} tsr_pipeline_kind;

/* One step as every stage sees it; borrowed for the duration of tsr_pipeline_run. */
typedef struct tsr_pipeline_step {
        const void *plan;       /* the caller's step plan, read-only for the stages */
        size_t io_floats;       /* floats stage s hands stage s + 1 (hidden state and residual) */
        size_t out_floats;      /* floats the last stage returns (logits rows); may be 0 */
} tsr_pipeline_step;

/* Stage `stage`'s part of a step, on that stage's thread: `in` holds io_floats from the
 * previous stage (NULL on stage 0); `out` receives io_floats for the next stage, or
 * out_floats on the last stage (TSR_PIPELINE_TENSOR: `in` is NULL and every rank's `out`
 * receives out_floats).  `comm` is the rank's handle on the group, for the tensor kind's
 * collectives.  Returns the stage's status. */
typedef tsr_status (*tsr_pipeline_stage_fn)(void *ud, uint32_t stage, const tsr_pipeline_step *step,
                                            const float *in, float *out, struct tsr_comm *comm);

/* A pipeline of n_stages (2 .. 64) stages running fn(ud, ...); every comm wait is bounded
 * by timeout_ms (0: the comm default).  The rank threads start with the first step.
 * TSR_E_INVAL or TSR_E_NOMEM; *ret written only on success. */
tsr_status tsr_pipeline_new(uint32_t n_stages, uint32_t timeout_ms, tsr_pipeline_stage_fn fn, void *ud,
                            tsr_pipeline **ret);
/* The same for `kind` (tsr_pipeline_new: TSR_PIPELINE_STAGES). */
tsr_status tsr_pipeline_new_kind(tsr_pipeline_kind kind, uint32_t n_ranks, uint32_t timeout_ms,
                                 tsr_pipeline_stage_fn fn, void *ud, tsr_pipeline **ret);
/* Run one step through every stage; the last stage's out_floats land in `out`.  Returns
 * the first failing stage's status, or the comm's (TSR_E_TIMEOUT, TSR_E_CANCELLED, ...);
 * `out` is then undefined.  TSR_E_INTERNAL when a rank thread cannot be started. */
tsr_status tsr_pipeline_run(tsr_pipeline *p, const tsr_pipeline_step *step, float *out);
/* Fail the step in flight (if any): every comm wait returns TSR_E_CANCELLED promptly.
 * Any thread; the next step runs on a fresh group. */
void tsr_pipeline_abort(tsr_pipeline *p);
/* Groups made so far (1 after the first step; + 1 after each failure). */
uint64_t tsr_pipeline_epoch(const tsr_pipeline *p);
/* Stop and join every rank thread, free everything; NULL is fine; clears *p. */
void tsr_pipeline_free(tsr_pipeline **p);

#endif
