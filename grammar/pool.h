/* pool.h - the worker's grammar compile thread (vLLM's WAITING_FOR_FSM).
 *
 * Compiling a spec over the vocabulary takes up to seconds for a large schema, so the
 * engine thread never does it: it submits the spec here and gets a job back at once;
 * the request waits (the scheduler skips it) while the other requests keep stepping,
 * and the engine polls the job each round.  Results are cached by xgrammar's compiler
 * (grammar.h), so the same schema compiles once.
 *
 * Threads: tsr_grammar_pool_submit / _job_* / _job_release from the engine thread (any
 * one thread); the pool's own "grammar" thread compiles, one job at a time, in order. */
#ifndef TSR_GRAMMAR_POOL_H
#define TSR_GRAMMAR_POOL_H

#include "grammar/grammar.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tsr_grammar_pool tsr_grammar_pool;
typedef struct tsr_grammar_job tsr_grammar_job;

typedef enum tsr_grammar_job_state {
        TSR_GRAMMAR_JOB_PENDING = 0,
        TSR_GRAMMAR_JOB_READY,     /* tsr_grammar_job_compiled is valid */
        TSR_GRAMMAR_JOB_FAILED,    /* tsr_grammar_job_error says why */
} tsr_grammar_job_state;

/* Start the compile thread over `v` (borrowed: outlives the pool).  *ret on success. */
tsr_status tsr_grammar_pool_new(tsr_grammar_vocab *v, tsr_grammar_pool **ret);
/* Stop the thread (the job being compiled finishes first; queued ones fail) and free.
 * Jobs still held stay valid until released.  Accepts NULL; clears *p. */
void tsr_grammar_pool_free(tsr_grammar_pool **p);
const tsr_grammar_vocab *tsr_grammar_pool_vocab(const tsr_grammar_pool *p);

/* Queue a compile of `spec` (copied).  NULL on OOM. */
tsr_grammar_job *tsr_grammar_pool_submit(tsr_grammar_pool *p, const tsr_grammar_spec *spec);
tsr_grammar_job_state tsr_grammar_job_poll(const tsr_grammar_job *j);
/* READY only: the compiled grammar, owned by the job. */
const tsr_grammar_compiled *tsr_grammar_job_compiled(const tsr_grammar_job *j);
/* FAILED only: the message (owned by the job). */
const char *tsr_grammar_job_error(const tsr_grammar_job *j);
/* Let go of a job (pending or not).  Accepts NULL; clears *j. */
void tsr_grammar_job_release(tsr_grammar_job **j);

#ifdef __cplusplus
}
#endif
#endif
