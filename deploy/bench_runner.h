/* bench_runner.h - one timed round of decode steps and a prefill through the worker's
 * runner (tsr_runner_model's forward, what an engine step calls), for the in-process
 * benchmarks tessera-bench-pp and tessera-bench-family.  Benchmarks, not tests: they
 * print numbers and assert nothing. */
#ifndef TSR_DEPLOY_BENCH_RUNNER_H
#define TSR_DEPLOY_BENCH_RUNNER_H

#include <stddef.h>

#include "worker/model/runner.h"

/* Tokens per KV block of the benchmarks' runners. */
#define TSR_BENCH_BLOCK 16

typedef struct tsr_bench_runner_opts {
        int batches[8];
        size_t n_batches;
        int steps, prefill, repeat;
        /* Block tables per sequence (engine.h tsr_engine_seq: one per paged KV group of a
         * hybrid model, kv_pool.h tsr_kv_tables); 0 or 1: one.  Every table of a sequence
         * names the same block ids (each group has its own arrays). */
        size_t n_tables;
} tsr_bench_runner_opts;

/* KV blocks a runner needs for o: the largest batch's sequences at their longest. */
size_t tsr_bench_runner_blocks(const tsr_bench_runner_opts *o);

/* For each batch B of o: B sequences (sequence b in state slot b, for a family that keeps
 * per-request state: the runner needs max(batches) slots) prefilled with 16 tokens, then
 * o->steps decode steps of all B: decode_ms[i] = the best over o->repeat rounds of the
 * mean ms per step.  Then prefill_ms = the best of o->repeat prefills of o->prefill
 * tokens of one sequence, last logits only.  0, or -1 when a forward fails (or memory). */
int tsr_bench_runner_run(tsr_runner *r, const tsr_bench_runner_opts *o, size_t vocab, double *decode_ms,
                         double *prefill_ms);

#endif
