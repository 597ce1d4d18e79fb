/* worker/parallel/partition + pipeline and the runner's pipeline stages and TP ranks (issue #20).
 *
 *  - the layer split: vLLM's get_pp_indices rule (remainder to the stages before the
 *    last), VLLM_PP_LAYER_PARTITION, and the refusals with vLLM's words;
 *  - the pipeline module on a toy stage function: every stage runs in order on its own
 *    thread, a stage's failure fails the step and the group stays up, an abort in the
 *    middle of a step fails it with TSR_E_CANCELLED and the next step runs on a new group;
 *  - the model: logits of a prefill (every row) and of a mixed decode + prefill step at
 *    PP = 2 and 3 (and an uneven split) memcmp-equal to PP = 1, for SmolLM2-135M (GGUF,
 *    30 layers, tied embeddings) and the tiny HF Llama 3 fixture (2 layers, separate
 *    lm_head): pipeline stages only move bytes;
 *  - tensor parallelism: the tiny HF Llama 3 at TP = 2 and 4, and TP x PP = 2 x 2 and
 *    4 x 2, memcmp-equal to TP = 1 in the canonical row-parallel split (R7), on the
 *    reference and the fast kernels; a 4-layer tied Llama written at run time at TP x PP
 *    = 2 x 3 (uneven split), 2 x 4 and 4 x 2;
 *  - the grid of stages x tp ranks on a toy: counterpart transfers, each stage's own TP
 *    group, a failure shared by a stage's ranks (the groups stay up) or a lone one (a
 *    new grid), an abort;
 *  - the hybrid families (issue #14): the tiny Llama 4 (chunked-local KV groups) and
 *    NemotronH (Mamba state slots, a stage that keeps nothing) at 2, 3 and more stages,
 *    float32 and bfloat16, three steps of a batch of three (prefill, decode, a sequence
 *    starting over in its slot) memcmp-equal to the whole model; forward_stage's
 *    argument checks; TP still refused for both. */
#include <setjmp.h>
#include <stdarg.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "tests/tsr_test.h"
#include "tests/unit/test_util.h"
#include "kernels/quant/quant.h"
#include "tests/unit/gguf_writer.h"
#include "worker/engine/kv_cache.h"
#include "worker/model/family.h"
#include "worker/model/runner.h"
#include "worker/model/tp.h"
#include "worker/parallel/comm.h"
#include "worker/parallel/partition.h"
#include "worker/parallel/pipeline.h"

/* ---- partition ------------------------------------------------------------------------ */

static void expect_split(uint32_t n_layers, uint32_t pp, const char *env, const uint32_t *want) {
        uint32_t got[8];
        char err[256] = "";
        assert_int_equal(tsr_pp_partition(n_layers, pp, env, got, err, sizeof err), TSR_OK);
        for (uint32_t i = 0; i < pp; i++)
                if (got[i] != want[i])
                        fail_msg("%u layers / %u stages (%s): stage %u holds %u, want %u", n_layers, pp,
                                 env ? env : "rule", i, got[i], want[i]);
}

static void expect_refused(uint32_t n_layers, uint32_t pp, const char *env, const char *words) {
        uint32_t got[8] = {0};
        char err[256] = "";
        assert_int_equal(tsr_pp_partition(n_layers, pp, env, got, err, sizeof err), TSR_E_INVAL);
        if (!strstr(err, words))
                fail_msg("%u layers / %u stages (%s): '%s' lacks '%s'", n_layers, pp, env ? env : "rule", err, words);
        assert_int_equal(got[0], 0);    /* nothing written on failure */
}

static void test_partition(void **state) {
        (void)state;
        /* vLLM 0.12 get_pp_indices: L // pp each, the remainder to partitions[-2], [-3], ... */
        expect_split(30, 1, NULL, (const uint32_t[]){30});
        expect_split(30, 2, NULL, (const uint32_t[]){15, 15});
        expect_split(30, 3, NULL, (const uint32_t[]){10, 10, 10});
        expect_split(30, 4, NULL, (const uint32_t[]){7, 8, 8, 7});
        expect_split(30, 7, NULL, (const uint32_t[]){4, 4, 4, 4, 5, 5, 4});
        expect_split(5, 3, NULL, (const uint32_t[]){2, 2, 1});
        expect_split(2, 2, NULL, (const uint32_t[]){1, 1});
        expect_split(30, 3, "", (const uint32_t[]){10, 10, 10});
        expect_split(30, 3, "8,12,10", (const uint32_t[]){8, 12, 10});
        expect_split(30, 2, "29,1", (const uint32_t[]){29, 1});
        expect_refused(30, 31, NULL, "--pipeline-parallel-size 31 is greater than the model's 30 hidden layers");
        expect_refused(30, 0, NULL, "--pipeline-parallel-size 0");
        expect_refused(30, 3, "8,12", "len(partition_list)=2 does not match pp_size=3.");
        expect_refused(30, 3, "8,12,11", "sum(partition_list)=31 does not match num_hidden_layers=30.");
        expect_refused(30, 2, "30,0", "stage 1 has no layer");
        expect_refused(30, 2, "15;15", "expected comma-separated layer counts");
        expect_refused(30, 2, "15,,15", "expected comma-separated layer counts");
        expect_refused(30, 2, "-1,31", "expected comma-separated layer counts");
}

/* ---- the pipeline on a toy stage function ---------------------------------------------- */

typedef struct toy {
        tsr_pipeline *p;
        int fail_stage;                 /* -1: none */
        int abort_stage;                /* -1: none */
        const void *abort_plan;         /* non-NULL: abort_stage aborts only this plan's step */
        tsr_status fail_with;
        int ran[8];
} toy;

/* Stage s: out[i] = in[i] * 2 + s (stage 0: in = i); the last writes out_floats. */
static tsr_status toy_stage(void *ud, uint32_t s, const tsr_pipeline_step *step, const float *in, float *out,
                            struct tsr_comm *comm) {
        toy *t = ud;
        const float *base = step->plan;
        size_t n = step->io_floats;
        t->ran[s]++;
        if ((int)s == t->abort_stage && (!t->abort_plan || t->abort_plan == step->plan))
                tsr_pipeline_abort(t->p);
        if ((int)s == t->fail_stage)
                return t->fail_with;
        for (size_t i = 0; i < n; i++)
                out[i] = (s == 0 ? base[i] : in[i]) * 2.0f + (float)s;
        return TSR_OK;
}

static void toy_expect(uint32_t stages, const float *base, const float *got, size_t n) {
        for (size_t i = 0; i < n; i++) {
                float want = base[i];
                for (uint32_t s = 0; s < stages; s++)
                        want = want * 2.0f + (float)s;
                if (got[i] != want)
                        fail_msg("%u stages: element %zu is %g, want %g", stages, i, got[i], want);
        }
}

/* Micro-batches: as many steps as stages submitted before the first wait, each with its
 * own plan and output, come back in order with their own results; every stage runs each
 * once.  A step whose grid fails while another is in flight: both fail (the first may
 * have been answered before the abort), the next runs on a new group. */
static void test_pipeline_micro_batches(void **state) {
        (void)state;
        enum { N = 37, MAXS = 4 };
        static float base[MAXS][N], out[MAXS][N];
        for (uint32_t k = 0; k < MAXS; k++)
                for (size_t i = 0; i < N; i++)
                        base[k][i] = (float)i * (float)(k + 1) - 3.5f;
        for (uint32_t stages = 2; stages <= MAXS; stages++) {
                toy t = {.fail_stage = -1, .abort_stage = -1};
                tsr_pipeline_step st[MAXS];
                assert_int_equal(tsr_pipeline_new(stages, 10000, toy_stage, &t, &t.p), TSR_OK);
                for (int round = 0; round < 3; round++) {
                        memset(out, 0, sizeof out);
                        for (uint32_t k = 0; k < stages; k++) {
                                st[k] = (tsr_pipeline_step){.plan = base[k], .io_floats = N, .out_floats = N};
                                assert_int_equal(tsr_pipeline_submit(t.p, &st[k], out[k]), TSR_OK);
                        }
                        for (uint32_t k = 0; k < stages; k++) {
                                assert_int_equal(tsr_pipeline_wait(t.p, &st[k], out[k]), TSR_OK);
                                toy_expect(stages, base[k], out[k], N);
                        }
                }
                assert_int_equal(tsr_pipeline_wait(t.p, &st[0], out[0]), TSR_E_INVAL);   /* nothing in flight */
                for (uint32_t s = 0; s < stages; s++)
                        assert_int_equal(t.ran[s], 3 * (int)stages);
                assert_int_equal(tsr_pipeline_epoch(t.p), 1);

                t.abort_stage = (int)stages - 1;
                t.abort_plan = base[1];
                for (uint32_t k = 0; k < 2; k++) {
                        st[k] = (tsr_pipeline_step){.plan = base[k], .io_floats = N, .out_floats = N};
                        assert_int_equal(tsr_pipeline_submit(t.p, &st[k], out[k]), TSR_OK);
                }
                tsr_status first = tsr_pipeline_wait(t.p, &st[0], out[0]);
                assert_true(first == TSR_OK || first == TSR_E_CANCELLED);
                if (first == TSR_OK)
                        toy_expect(stages, base[0], out[0], N);
                assert_int_equal(tsr_pipeline_wait(t.p, &st[1], out[1]), TSR_E_CANCELLED);
                t.abort_stage = -1;
                memset(out, 0, sizeof out);
                st[2] = (tsr_pipeline_step){.plan = base[2], .io_floats = N, .out_floats = N};
                assert_int_equal(tsr_pipeline_run(t.p, &st[2], out[2]), TSR_OK);
                toy_expect(stages, base[2], out[2], N);
                assert_int_equal(tsr_pipeline_epoch(t.p), 2);
                tsr_pipeline_free(&t.p);
        }
}

static void test_pipeline_toy(void **state) {
        (void)state;
        float base[37], out[37];
        for (size_t i = 0; i < 37; i++)
                base[i] = (float)i - 3.5f;
        for (uint32_t stages = 2; stages <= 4; stages++) {
                toy t = {.fail_stage = -1, .abort_stage = -1};
                assert_int_equal(tsr_pipeline_new(stages, 10000, toy_stage, &t, &t.p), TSR_OK);
                for (int step = 0; step < 5; step++) {
                        tsr_pipeline_step st = {.plan = base, .io_floats = 37, .out_floats = 37};
                        memset(out, 0, sizeof out);
                        assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                        toy_expect(stages, base, out, 37);
                }
                for (uint32_t s = 0; s < stages; s++)
                        assert_int_equal(t.ran[s], 5);
                assert_int_equal(tsr_pipeline_epoch(t.p), 1);

                /* A stage's own failure: the step fails with it, the later stages do not run
                 * it, and the group stays up for the next step. */
                t.fail_stage = (int)stages - 2;
                t.fail_with = TSR_E_NOMEM;
                tsr_pipeline_step st = {.plan = base, .io_floats = 37, .out_floats = 37};
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_E_NOMEM);
                assert_int_equal(t.ran[stages - 1], 5);
                t.fail_stage = -1;
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                toy_expect(stages, base, out, 37);
                assert_int_equal(tsr_pipeline_epoch(t.p), 1);

                /* An abort in the middle of a step (the comm fails as under a lost peer): the
                 * step fails with TSR_E_CANCELLED, every rank thread is joined, and the next
                 * step runs on a new group (epoch 2) with the right result. */
                t.abort_stage = (int)stages - 1;
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_E_CANCELLED);
                t.abort_stage = -1;
                memset(out, 0, sizeof out);
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                toy_expect(stages, base, out, 37);
                assert_int_equal(tsr_pipeline_epoch(t.p), 2);
                /* An abort between steps fails nothing already done; the next step fails
                 * (the group is gone) and the one after runs on epoch 3. */
                tsr_pipeline_abort(t.p);
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_E_CANCELLED);
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                toy_expect(stages, base, out, 37);
                assert_int_equal(tsr_pipeline_epoch(t.p), 3);
                /* A step with no output (a prefill chunk nobody samples from). */
                st.out_floats = 0;
                assert_int_equal(tsr_pipeline_run(t.p, &st, NULL), TSR_OK);
                tsr_pipeline_free(&t.p);
                assert_null(t.p);
        }
        assert_int_equal(tsr_pipeline_new(1, 0, toy_stage, NULL, &(tsr_pipeline *){NULL}), TSR_E_INVAL);
        assert_int_equal(tsr_pipeline_new(65, 0, toy_stage, NULL, &(tsr_pipeline *){NULL}), TSR_E_INVAL);
        tsr_pipeline_free(NULL);
}

/* The tensor kind: every rank runs the step at once and meets the others in an
 * all-reduce; rank 0's output is the result.  A rank's own failure and an abort fail the
 * step; the next one runs on a new group. */
typedef struct tp_toy {
        tsr_pipeline *p;
        int fail_rank, abort_rank;
} tp_toy;

static tsr_status tp_stage(void *ud, uint32_t r, const tsr_pipeline_step *step, const float *in, float *out,
                           struct tsr_comm *comm) {
        tp_toy *t = ud;
        (void)in;
        if ((int)r == t->abort_rank)
                tsr_pipeline_abort(t->p);
        if ((int)r == t->fail_rank)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < step->out_floats; i++)
                out[i] = (float)(r + 1) * 0.5f + (float)i;
        return tsr_comm_all_reduce_sum(comm, out, step->out_floats, NULL);
}

static void test_pipeline_tensor(void **state) {
        (void)state;
        float out[9];
        tsr_pipeline_step st = {.plan = NULL, .io_floats = 0, .out_floats = 9};
        for (uint32_t n = 2; n <= 4; n++) {
                tp_toy t = {.fail_rank = -1, .abort_rank = -1};
                assert_int_equal(tsr_pipeline_new_kind(TSR_PIPELINE_TENSOR, n, 10000, tp_stage, &t, &t.p), TSR_OK);
                for (int rep = 0; rep < 3; rep++) {
                        assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                        for (size_t i = 0; i < 9; i++)   /* sum over r of (r + 1) / 2 + i: exact in float */
                                assert_true(out[i] == (float)(n * (n + 1)) * 0.25f + (float)(n * i));
                }
                t.fail_rank = (int)n - 1;
                assert_int_not_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                t.fail_rank = -1;
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                t.abort_rank = (int)n - 1;
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_E_CANCELLED);
                t.abort_rank = -1;
                assert_int_equal(tsr_pipeline_run(t.p, &st, out), TSR_OK);
                assert_true(out[8] == (float)(n * (n + 1)) * 0.25f + (float)(n * 8));
                assert_int_equal(tsr_pipeline_epoch(t.p), 3);
                tsr_pipeline_free(&t.p);
        }
}

/* The grid: pp stages x tp ranks (rank = stage x tp + tp_rank).  Rank (s, t) computes
 * v = in * 2 + s (stage 0: in = the plan), contributes v * (t + 1) to its stage's TP
 * all-reduce and hands the sum, v * tp (tp + 1) / 2, on: every value stays an exact
 * float.  The toy checks that each rank got its counterpart's input and met only its own
 * stage's tp ranks in the collective. */
typedef struct grid_toy {
        tsr_pipeline *p;
        uint32_t tp;
        int fail_rank;                  /* -1: none; -2: every rank of stage 1 */
        int abort_rank;
        _Atomic int ran[16];
} grid_toy;

static tsr_status grid_stage(void *ud, uint32_t rank, const tsr_pipeline_step *step, const float *in, float *out,
                             struct tsr_comm *comm) {
        grid_toy *g = ud;
        uint32_t s = rank / g->tp, t = rank % g->tp;
        const float *base = step->plan;
        size_t n = step->out_floats;    /* io_floats == out_floats in this toy */

        g->ran[rank]++;
        if ((int)rank == g->abort_rank)
                tsr_pipeline_abort(g->p);
        if ((int)rank == g->fail_rank || (g->fail_rank == -2 && s == 1))
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n; i++)
                out[i] = ((s == 0 ? base[i] : in[i]) * 2.0f + (float)s) * (float)(t + 1);
        if (g->tp == 1)         /* comm is the grid's group then: no collective of a stage */
                return TSR_OK;
        if (tsr_comm_size(comm) != (int)g->tp || tsr_comm_rank(comm) != (int)t)
                return TSR_E_INTERNAL;  /* not this stage's TP group */
        return tsr_comm_all_reduce_sum(comm, out, n, NULL);
}

static void grid_expect(uint32_t pp, uint32_t tp, const float *base, const float *got, size_t n) {
        for (size_t i = 0; i < n; i++) {
                float want = base[i];
                for (uint32_t s = 0; s < pp; s++)
                        want = (want * 2.0f + (float)s) * (float)(tp * (tp + 1) / 2);
                if (got[i] != want)
                        fail_msg("%u x %u: element %zu is %g, want %g", pp, tp, i, got[i], want);
        }
}

static void test_pipeline_grid(void **state) {
        (void)state;
        float base[13], out[13];
        struct { uint32_t pp, tp; } shapes[] = {{2, 2}, {3, 2}, {2, 4}, {1, 2}, {2, 1}};
        for (size_t i = 0; i < 13; i++)
                base[i] = (float)i * 0.5f - 2.0f;
        for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
                uint32_t pp = shapes[c].pp, tp = shapes[c].tp;
                grid_toy g = {.tp = tp, .fail_rank = -1, .abort_rank = -1};
                tsr_pipeline_step st = {.plan = base, .io_floats = pp > 1 ? 13 : 0, .out_floats = 13};
                assert_int_equal(tsr_pipeline_new_grid(pp, tp, 10000, grid_stage, &g, &g.p), TSR_OK);
                for (int rep = 0; rep < 3; rep++) {
                        memset(out, 0, sizeof out);
                        assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_OK);
                        grid_expect(pp, tp, base, out, 13);
                }
                for (uint32_t r = 0; r < pp * tp; r++)
                        assert_int_equal(g.ran[r], 3);
                assert_int_equal(tsr_pipeline_epoch(g.p), 1);
                if (pp > 1 && tp > 1) {
                        /* Every tp rank of stage 1 fails alike (as bad input would): the step
                         * fails with it, the groups stay up. */
                        g.fail_rank = -2;
                        assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_E_NOMEM);
                        g.fail_rank = -1;
                        assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_OK);
                        grid_expect(pp, tp, base, out, 13);
                        assert_int_equal(tsr_pipeline_epoch(g.p), 1);
                }
                /* One rank of the last stage fails on its own: its peers met it in a
                 * mismatched collective, so the grid starts over (epoch 2); with tp 1 it
                 * is a stage's failure, which travels on (pipeline_toy). */
                g.fail_rank = (int)(pp * tp) - 1;
                assert_int_not_equal(tsr_pipeline_run(g.p, &st, out), TSR_OK);
                g.fail_rank = -1;
                assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_OK);
                grid_expect(pp, tp, base, out, 13);
                /* An abort from a rank of the last stage in the middle of a step. */
                g.abort_rank = (int)(pp * tp) - 1;
                assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_E_CANCELLED);
                g.abort_rank = -1;
                memset(out, 0, sizeof out);
                assert_int_equal(tsr_pipeline_run(g.p, &st, out), TSR_OK);
                grid_expect(pp, tp, base, out, 13);
                assert_int_equal(tsr_pipeline_epoch(g.p), tp > 1 ? 3 : 2);
                print_message("grid %u x %u: steps, a shared and a lone failure and an abort as expected\n", pp, tp);
                tsr_pipeline_free(&g.p);
        }
        assert_int_equal(tsr_pipeline_new_grid(1, 1, 0, grid_stage, NULL, &(tsr_pipeline *){NULL}), TSR_E_INVAL);
        assert_int_equal(tsr_pipeline_new_grid(9, 8, 0, grid_stage, NULL, &(tsr_pipeline *){NULL}), TSR_E_INVAL);
}

/* A stage that takes longer than the comm deadline (a stalled rank): the leader's wait
 * ends with TSR_E_TIMEOUT at the deadline (the log line), the step returns it once the
 * slow stage's own work has ended (the pipeline joins every rank thread before returning,
 * since they read the caller's plan), never a hang, and the next step runs on a new group.
 * The stall is a bounded condvar wait on a flag nobody sets: the only pause in this file. */
static pthread_mutex_t stall_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t stall_cv = PTHREAD_COND_INITIALIZER;

static tsr_status stall_stage(void *ud, uint32_t s, const tsr_pipeline_step *step, const float *in, float *out,
                              struct tsr_comm *comm) {
        int *stall_ms = ud;
        if (s == 1 && *stall_ms > 0) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += (long)*stall_ms * 1000000L;
                ts.tv_sec += ts.tv_nsec / 1000000000L;
                ts.tv_nsec %= 1000000000L;
                pthread_mutex_lock(&stall_mu);
                pthread_cond_timedwait(&stall_cv, &stall_mu, &ts);
                pthread_mutex_unlock(&stall_mu);
        }
        for (size_t i = 0; i < step->io_floats; i++)
                out[i] = s == 0 ? 1.0f : in[i] + 1.0f;
        return TSR_OK;
}

static void test_pipeline_deadline(void **state) {
        (void)state;
        int stall_ms = 400;
        tsr_pipeline *p = NULL;
        float out[4];
        tsr_pipeline_step st = {.plan = NULL, .io_floats = 4, .out_floats = 4};
        struct timespec t0, t1;

        assert_int_equal(tsr_pipeline_new(2, 100, stall_stage, &stall_ms, &p), TSR_OK);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        assert_int_equal(tsr_pipeline_run(p, &st, out), TSR_E_TIMEOUT);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        print_message("a stage stalled 400 ms past a 100 ms deadline: the step failed after %.0f ms\n", ms);
        assert_true(ms < 5000);
        stall_ms = 0;
        assert_int_equal(tsr_pipeline_run(p, &st, out), TSR_OK);
        assert_true(out[0] == 2.0f && out[3] == 2.0f);
        assert_int_equal(tsr_pipeline_epoch(p), 2);
        tsr_pipeline_free(&p);
}

/* ---- the model: PP = 2, 3 against PP = 1 ------------------------------------------------ */

typedef struct model_case {
        const char *path;
        tsr_model_desc desc;
        tsr_backend *be;
} model_case;

/* The model at `rel` (from the source tree) of the family named `family`. */
/* `path` (kept: mc->path borrows it) as a model of `family`. */
static void model_open_path(model_case *mc, const char *path, const char *family) {
        char err[512] = "";
        bool gguf = strstr(path, ".gguf") != NULL;
        static const tsr_model_family *const all[] = {&tsr_family_llama, &tsr_family_llama4, &tsr_family_nemotron_h};
        const tsr_model_family *fam = NULL;

        mc->path = path;
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
                if (strcmp(all[i]->name, family) == 0)
                        fam = all[i];
        assert_non_null(fam);
        if (tsr_model_desc_read(fam, path, gguf, &mc->desc, err, sizeof err) != TSR_OK)
                fail_msg("%s: %s", path, err);
        assert_int_equal(tsr_runner_backend_new(1, &mc->be, err, sizeof err), TSR_OK);
}

static bool model_open_family(model_case *mc, const char *rel, const char *family) {
        static char path[4096];
        if (!tsr_test_src_path(rel, path, sizeof path))
                return false;
        model_open_path(mc, path, family);
        return true;
}

static bool model_open(model_case *mc, const char *rel) { return model_open_family(mc, rel, "llama"); }

static void model_close(model_case *mc) {
        tsr_model_desc_done(&mc->desc);
        tsr_backend_free(&mc->be);
}

#define BLOCK 16
#define N_BLOCKS 32

/* compare_pp's second pass: both steps in the pipeline at once (micro-batches: submit,
 * submit, wait, wait), the second's chunks reading the KV the first writes on each stage. */
static bool g_micro;
/* compare_tp's bound on the canonical split against the one-pass sum at tp 1 */
static double g_plain_tol = 1e-3;
/* run_steps_kv's --dtype ("float32"; "auto" keeps a GGUF's block-format weights) */
static const char *g_dtype = "float32";

/* The case being run asks for ranks that load the whole model and split it
 * (tsr_runner_opts.tp_load_whole: the families' split of whole tensors, which a served
 * worker never takes); compare_tp and the 4-layer test set it. */
static bool run_whole;

/* Two steps through `pp` stages of layers[] (pp 1: the whole model): a prefill of 11
 * tokens with every row's logits beside a prefill of 5 whose logits nobody wants, then a
 * step of one decode token for each plus the second's next 3 prompt tokens with the
 * last row.  The logits of both steps, packed, into out. */
static void run_steps_kv(model_case *mc, uint32_t pp, const uint32_t *layers, uint32_t tp, bool canonical,
                         tsr_dtype kv_dtype, float *out, size_t *n_out) {
        tsr_runner *r = NULL;
        tsr_load_stats ls;
        char err[512] = "";
        uint32_t t0[4] = {0, 1, 2, 3}, t1[4] = {4, 5, 6, 7};
        uint32_t p0[11] = {1, 504, 2911, 314, 47, 9, 1, 17, 42, 128, 3};
        uint32_t p1[8] = {12, 77, 5, 250, 2, 19, 8, 101};
        uint32_t next0 = 200;
        size_t V = mc->desc.vocab_size;

        for (size_t i = 0; i < 11; i++)
                p0[i] %= (uint32_t)V;
        tsr_runner_opts o = {.dtype = g_dtype, .backend = mc->be, .pp = pp, .pp_layers = layers,
                             .stage_threads = 1, .pp_timeout_ms = 60000, .tp = tp, .tp_canonical = canonical,
                             .kv_dtype = kv_dtype, .tp_load_whole = run_whole};
        if (g_micro)    /* the runner offers submit / wait (off by default on CPU stages) */
                setenv("TESSERA_PP_MAX_IN_FLIGHT", "8", 1);
        if (tsr_runner_new(mc->path, &mc->desc, &o, N_BLOCKS, BLOCK, 0, &r, &ls, err, sizeof err) != TSR_OK)
                fail_msg("%s pp %u tp %u: %s", mc->path, pp, tp, err);
        unsetenv("TESSERA_PP_MAX_IN_FLIGHT");
        assert_int_equal(tsr_runner_stages(r), (tp > 1 ? tp : 1) * (pp > 1 ? pp : 1));
        const tsr_engine_model *m = tsr_runner_model(r);
        assert_true(g_micro && pp > 1 ? m->max_in_flight == pp : !m->submit);
        tsr_engine_seq step1[2] = {
                {.block_table = t0, .n_table = 4, .tokens = p0, .n = 11, .past_len = 0, .want_logits = true,
                 .want_all_logits = true},
                {.block_table = t1, .n_table = 4, .tokens = p1, .n = 5, .past_len = 0},
        };
        tsr_engine_seq step2[2] = {
                {.block_table = t0, .n_table = 4, .tokens = &next0, .n = 1, .past_len = 11, .want_logits = true},
                {.block_table = t1, .n_table = 4, .tokens = p1 + 5, .n = 3, .past_len = 5, .want_logits = true},
        };
        if (g_micro && pp > 1) {
                assert_true(m->submit && m->max_in_flight >= 2);
                assert_int_equal(m->submit(m->ud, step1, 2, out), TSR_OK);
                assert_int_equal(m->submit(m->ud, step2, 2, out + 11 * V), TSR_OK);
                assert_int_equal(m->wait(m->ud), TSR_OK);
                assert_int_equal(m->wait(m->ud), TSR_OK);
        } else {
                assert_int_equal(m->forward(m->ud, step1, 2, out), TSR_OK);
                assert_int_equal(m->forward(m->ud, step2, 2, out + 11 * V), TSR_OK);
        }
        *n_out = 13 * V;
        tsr_runner_free(&r);
        assert_null(r);
}

static void run_steps_tp(model_case *mc, uint32_t pp, const uint32_t *layers, uint32_t tp, bool canonical,
                         float *out, size_t *n_out) {
        run_steps_kv(mc, pp, layers, tp, canonical, TSR_DTYPE_F32, out, n_out);
}

static void run_steps(model_case *mc, uint32_t pp, const uint32_t *layers, float *out, size_t *n_out) {
        run_steps_tp(mc, pp, layers, 1, false, out, n_out);
}

static void compare_pp(const char *rel, const uint32_t *const *splits, const uint32_t *pps, size_t n_cases) {
        model_case mc = {0};
        if (!model_open(&mc, rel))
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s is absent (scripts/fetch-model.sh fetches the demo model)", rel);
        size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0;
        float *want = malloc(13 * V * sizeof(float)), *got = malloc(13 * V * sizeof(float));
        assert_non_null(want);
        assert_non_null(got);
        run_steps(&mc, 1, NULL, want, &n_want);
        float max_abs = 0;
        for (size_t i = 0; i < n_want; i++) {
                if (!(want[i] > -1e30f && want[i] < 1e30f))
                        fail_msg("%s pp 1: logit %zu is %g", rel, i, want[i]);
                max_abs = fabsf(want[i]) > max_abs ? fabsf(want[i]) : max_abs;
        }
        assert_true(max_abs > 0.1f);    /* real logits, not a zeroed buffer */
        for (size_t c = 0; c < 2 * n_cases; c++) {
                g_micro = c >= n_cases;         /* every case again with both steps in flight */
                size_t k = c % n_cases;
                memset(got, 0xff, 13 * V * sizeof(float));
                run_steps(&mc, pps[k], splits[k], got, &n_got);
                g_micro = false;
                assert_int_equal(n_got, n_want);
                if (memcmp(got, want, n_want * sizeof(float)) != 0)
                        for (size_t i = 0; i < n_want; i++)
                                if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                        fail_msg("%s pp %u (split %u,%u,...%s): logit [%zu, %zu] %.9g, pp 1 %.9g", rel,
                                                 pps[k], splits[k][0], splits[k][1], c >= n_cases ? ", micro-batches" : "",
                                                 i / V, i % V, got[i], want[i]);
                print_message("%s: pp %u (%u,%u%s)%s: %zu logits bitwise equal to pp 1\n", rel, pps[k], splits[k][0],
                              splits[k][1], pps[k] > 2 ? ",..." : "", c >= n_cases ? ", both steps in flight" : "",
                              n_want);
        }
        free(want);
        free(got);
        model_close(&mc);
}

static void test_smollm2_pp(void **state) {
        (void)state;
        static const uint32_t even2[] = {15, 15}, even3[] = {10, 10, 10}, uneven3[] = {8, 12, 10},
                              skew2[] = {29, 1};
        const uint32_t *splits[] = {even2, even3, uneven3, skew2};
        const uint32_t pps[] = {2, 3, 3, 2};
        compare_pp(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", splits, pps, 4);
}

static void test_tiny_llama3_pp(void **state) {
        (void)state;
        static const uint32_t two[] = {1, 1};
        const uint32_t *splits[] = {two};
        const uint32_t pps[] = {2};
        compare_pp("tests/fixtures/tiny-llama3-hf/f32", splits, pps, 1);
}

/* A run of a model's steps at pp stages of layers[] (pp 1: the whole model) of tp ranks
 * each, `canonical` as tsr_runner_opts.tp_canonical: the logits into out, their count
 * into *n_out (run_steps_tp, run_hybrid_f32). */
typedef void (*tp_run_fn)(model_case *mc, uint32_t pp, const uint32_t *layers, uint32_t tp, bool canonical,
                          float *out, size_t *n_out);
typedef struct tp_case {
        uint32_t tp, pp;
        const uint32_t *layers;
        bool ep;                /* --enable-expert-parallel (run_hybrid_tp reads it from run_ep) */
        bool whole;             /* each rank loads whole tensors, then splits them (run_whole) */
} tp_case;

/* The case compare_tp is running asks for expert parallelism (a run function's argument
 * list is shared by every family's tests; only run_hybrid_tp reads this). */
static bool run_ep;

/* R7 on `mc` (named `name`), on the reference kernels and on the fast ones: TP = 1 in the
 * canonical split within 1e-3 of the one-pass sum, and every case memcmp-equal to it;
 * `rows` bounds the rows of logits a run makes. */
static void compare_tp(model_case *mc, const char *name, tp_run_fn run, size_t rows, const tp_case *cases,
                       size_t n_cases) {
        const char *kern[] = {"ref", "fast"};
        size_t V = mc->desc.vocab_size, n_want = 0, n_got = 0;
        float *want = malloc(rows * V * sizeof(float)), *got = malloc(rows * V * sizeof(float)),
              *plain = malloc(rows * V * sizeof(float));
        assert_non_null(want);
        assert_non_null(got);
        assert_non_null(plain);
        for (int k = 0; k < 2; k++) {
                char err[256];
                tsr_backend_free(&mc->be);
                setenv("TESSERA_KERNELS", kern[k], 1);
                assert_int_equal(tsr_runner_backend_new(1, &mc->be, err, sizeof err), TSR_OK);
                run(mc, 1, NULL, 1, true, want, &n_want);
                run(mc, 1, NULL, 1, false, plain, &n_got);
                assert_int_equal(n_got, n_want);
                double worst = 0, top = 0;
                for (size_t i = 0; i < n_want; i++) {
                        worst = fabs((double)want[i] - plain[i]) > worst ? fabs((double)want[i] - plain[i]) : worst;
                        top = fabs((double)want[i]) > top ? fabs((double)want[i]) : top;
                }
                print_message("%s (%s kernels): canonical split vs plain at tp 1: max |dlogit| %.3g\n", name, kern[k],
                              worst);
                assert_true(worst < g_plain_tol);
                assert_true(top > 0.01);        /* real logits, not a zeroed buffer */
                for (size_t c = 0; c < n_cases; c++) {
                        memset(got, 0xff, rows * V * sizeof(float));
                        run_ep = cases[c].ep;
                        run_whole = cases[c].whole;
                        run(mc, cases[c].pp, cases[c].layers, cases[c].tp, true, got, &n_got);
                        run_ep = run_whole = false;
                        assert_int_equal(n_got, n_want);
                        for (size_t i = 0; i < n_want; i++)
                                if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                        fail_msg("%s, %s kernels, tp %u pp %u: logit [%zu, %zu] %.9g, tp 1 %.9g", name,
                                                 kern[k], cases[c].tp, cases[c].pp, i / V, i % V, got[i], want[i]);
                        print_message("%s (%s kernels): tp %u pp %u%s%s: %zu logits bitwise equal to tp 1\n",
                                      name, kern[k], cases[c].tp, cases[c].pp,
                                      cases[c].ep ? " expert-parallel" : "",
                                      cases[c].whole ? " (loaded whole, then split)" : "", n_want);
                }
        }
        unsetenv("TESSERA_KERNELS");
        free(want);
        free(got);
        free(plain);
}

/* Tensor parallelism (R7): TP = 2 and 4 (4 > the 2 KV heads: replicated) on the tiny HF
 * Llama 3 memcmp-equal to TP = 1 computed in the canonical split, on the reference
 * kernels and on the fast ones; the canonical split at PP = 2 too; and TP x PP: 2 x 2
 * and 4 x 2 (each stage's 4 ranks replicating the KV heads), stage s's tp ranks each
 * receiving from their counterpart in s - 1. */
static void test_tiny_llama3_tp(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {1, 1};
        static const tp_case cases[] = {{2, 1, NULL}, {4, 1, NULL}, {1, 2, two}, {2, 2, two}, {4, 2, two},
                                        {2, 1, NULL, false, true}, {4, 2, two, false, true}};
        if (!model_open(&mc, "tests/fixtures/tiny-llama3-hf/f32"))
                fail_msg("the tiny Llama 3 fixture is committed: run from the source tree");
        compare_tp(&mc, "tiny-llama3", run_steps_tp, 13, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* A GGUF Llama at -tp 2 (issue #20): ../shared/fixtures' llama-2-tiny-random (F16,
 * llama.cpp's converter: Q and K rows permuted for interleaved RoPE; 2 heads of 4, MLP
 * 32, vocabulary 32000, one layer), each rank reading its rows and columns of the F16
 * tensors from the file: logits bitwise -tp 1's on both kernel sets. */
static void test_gguf_f16_tp(void **state) {
        (void)state;
        model_case mc = {0};
        static char path[4096];
        static const tp_case cases[] = {{2, 1, NULL}};
        const char *dir = getenv("TSR_FIXTURES");
        FILE *f = NULL;
        snprintf(path, sizeof path, "%s/models/llama-2-tiny-random.gguf", dir ? dir : "");
        if (!dir || !(f = fopen(path, "rb")))
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s is absent (../shared/fixtures)", path);
        fclose(f);
        model_open_path(&mc, path, "llama");
        compare_tp(&mc, "llama-2-tiny-random.gguf", run_steps_tp, 13, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* A random 4-layer Llama in Hugging Face layout, written at run time (nothing committed):
 * hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 299 (odd: split as vLLM pads
 * it, 160 + 139 rows at tp 2, 80 x 3 + 59 at tp 4), tied embeddings (so the last stage's
 * lm_head is the embedding's rows), every float from a fixed LCG.  Four
 * layers allow three stages (vLLM's split 1, 2, 1) and four; the tiny fixture has two. */
#define L4_LAYERS 4
static bool write_llama_4layers(char *dir) {
        static const struct { const char *name; int rows, cols; bool norm; } per_layer[] = {
                {"input_layernorm.weight", 64, 1, true},          {"post_attention_layernorm.weight", 64, 1, true},
                {"self_attn.q_proj.weight", 64, 64, false},       {"self_attn.k_proj.weight", 32, 64, false},
                {"self_attn.v_proj.weight", 32, 64, false},       {"self_attn.o_proj.weight", 64, 64, false},
                {"mlp.gate_proj.weight", 128, 64, false},         {"mlp.up_proj.weight", 128, 64, false},
                {"mlp.down_proj.weight", 64, 128, false},
        };
        char path[512], hdr[8192], name[96];
        size_t h = 0, off = 0;
        uint32_t seed = 12345;
        FILE *f;

        if (!mkdtemp(dir))
                return false;
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (!(f = fopen(path, "w")))
                return false;
        fprintf(f, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": %d, \"num_attention_heads\": 4, "
                   "\"num_key_value_heads\": 2, \"head_dim\": 16, \"vocab_size\": 299, \"rms_norm_eps\": 1e-05, "
                   "\"rope_theta\": 10000.0, \"max_position_embeddings\": 256, \"tie_word_embeddings\": true, "
                   "\"hidden_act\": \"silu\", \"attention_bias\": false, \"mlp_bias\": false, "
                   "\"torch_dtype\": \"float32\", \"bos_token_id\": 1, \"eos_token_id\": 2}\n", L4_LAYERS);
        fclose(f);
        /* The header: the embedding, the final norm, then every layer's tensors in order. */
        struct { char name[96]; int rows, cols; bool norm; } t[2 + L4_LAYERS * 9];
        size_t n = 0;
        t[n++] = (__typeof__(t[0])){"model.embed_tokens.weight", 299, 64, false};
        t[n++] = (__typeof__(t[0])){"model.norm.weight", 64, 1, true};
        for (int l = 0; l < L4_LAYERS; l++)
                for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++, n++) {
                        snprintf(name, sizeof name, "model.layers.%d.%s", l, per_layer[i].name);
                        snprintf(t[n].name, sizeof t[n].name, "%s", name);
                        t[n].rows = per_layer[i].rows;
                        t[n].cols = per_layer[i].cols;
                        t[n].norm = per_layer[i].norm;
                }
        h += (size_t)snprintf(hdr + h, sizeof hdr - h, "{");
        for (size_t i = 0; i < n; i++) {
                size_t bytes = (size_t)t[i].rows * (size_t)t[i].cols * sizeof(float);
                if (t[i].cols == 1)
                        h += (size_t)snprintf(hdr + h, sizeof hdr - h, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],"
                                              "\"data_offsets\":[%zu,%zu]}", i ? "," : "", t[i].name, t[i].rows, off,
                                              off + bytes);
                else
                        h += (size_t)snprintf(hdr + h, sizeof hdr - h, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],"
                                              "\"data_offsets\":[%zu,%zu]}", i ? "," : "", t[i].name, t[i].rows,
                                              t[i].cols, off, off + bytes);
                off += bytes;
        }
        h += (size_t)snprintf(hdr + h, sizeof hdr - h, "}");
        while (h % 8)
                hdr[h++] = ' ';
        assert_true(h < sizeof hdr);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (!(f = fopen(path, "wb")))
                return false;
        uint64_t hl = h;
        fwrite(&hl, sizeof hl, 1, f);   /* little-endian: the only byte order this project builds for */
        fwrite(hdr, 1, h, f);
        for (size_t i = 0; i < n; i++)
                for (int e = 0; e < t[i].rows * t[i].cols; e++) {
                        seed = seed * 1664525u + 1013904223u;
                        float u = (float)(seed >> 8) / 16777216.0f - 0.5f;      /* [-0.5, 0.5) */
                        float v = t[i].norm ? 1.0f + 0.2f * u : 0.25f * u;
                        fwrite(&v, sizeof v, 1, f);
                }
        return fclose(f) == 0;
}

/* TP x PP with more stages: TP 2 x PP 3 (vLLM's uneven split 1, 2, 1), TP 2 x PP 4, TP 4
 * x PP 2 (KV heads replicated), and PP 3 alone, on the 4-layer tied Llama, memcmp-equal
 * to TP 1 x PP 1 in the canonical split. */
static void test_llama_4layers_tp_pp(void **state) {
        (void)state;
        char dir[] = "/tmp/tsr-test-parallel-XXXXXX", err[512] = "";
        model_case mc = {0};
        if (!write_llama_4layers(dir))
                fail_msg("cannot write the 4-layer model under /tmp");
        const tsr_model_family *fam = tsr_family_find("hf", "llama", "llama");
        mc.path = dir;
        if (tsr_model_desc_read(fam, dir, false, &mc.desc, err, sizeof err) != TSR_OK)
                fail_msg("%s: %s", dir, err);
        assert_int_equal(tsr_runner_backend_new(1, &mc.be, err, sizeof err), TSR_OK);
        size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0;
        float *want = malloc(13 * V * sizeof(float)), *got = malloc(13 * V * sizeof(float));
        assert_non_null(want);
        assert_non_null(got);
        run_steps_tp(&mc, 1, NULL, 1, true, want, &n_want);
        float max_abs = 0;
        for (size_t i = 0; i < n_want; i++)
                max_abs = fabsf(want[i]) > max_abs ? fabsf(want[i]) : max_abs;
        assert_true(max_abs > 0.01f && max_abs < 1e6f);         /* real logits, not a zeroed buffer */
        static const uint32_t three[] = {1, 2, 1}, four[] = {1, 1, 1, 1}, two[] = {2, 2};
        struct { uint32_t tp, pp; const uint32_t *layers; bool whole; } cases[] = {
                {2, 3, three, false}, {2, 4, four, false}, {4, 2, two, false}, {1, 3, three, false},
                {4, 1, NULL, true}, {4, 2, two, true}};       /* loaded whole, then split */
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                uint32_t check[8];
                assert_int_equal(tsr_pp_partition(L4_LAYERS, cases[c].pp, NULL, check, err, sizeof err), TSR_OK);
                if (cases[c].layers)    /* vLLM's split */
                        assert_memory_equal(check, cases[c].layers, cases[c].pp * sizeof(uint32_t));
                memset(got, 0xff, 13 * V * sizeof(float));
                run_whole = cases[c].whole;
                run_steps_tp(&mc, cases[c].pp, cases[c].layers, cases[c].tp, true, got, &n_got);
                run_whole = false;
                assert_int_equal(n_got, n_want);
                for (size_t i = 0; i < n_want; i++)
                        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                fail_msg("4 layers, tp %u pp %u: logit [%zu, %zu] %.9g, tp 1 pp 1 %.9g", cases[c].tp,
                                         cases[c].pp, i / V, i % V, got[i], want[i]);
                print_message("4-layer tied llama: tp %u x pp %u%s: %zu logits bitwise equal to tp 1 x pp 1\n",
                              cases[c].tp, cases[c].pp, cases[c].whole ? " (loaded whole, then split)" : "", n_want);
        }
        free(want);
        free(got);
        model_close(&mc);
        tsr_test_remove_model_dir(dir);
}

/* ---- the hybrid families: Llama 4 and NemotronH stages against the whole model ------- */

#define H_BLOCK 4
#define H_TABLE 8               /* blocks per table: 32 positions */
#define H_SEQS 3
#define H_BLOCKS (H_SEQS * TSR_KV_GROUPS_MAX * H_TABLE)
#define H_SLOTS 4

/* Three steps of three sequences through the runner at `pp` stages of layers[] (pp 1:
 * the whole model) of `tp` tensor-parallel ranks each (`canonical`: the canonical split
 * at tp 1, as --dtype float32 makes it), each sequence holding the whole model's block tables (a Llama 4's
 * hybrid: one per paged group, as main.c plans them) and, for NemotronH, its own state
 * slot (3, 0, 2: not its index).  Step 1: prefills of 11 tokens (every row's logits), 5
 * (none) and 9 (the last row).  Step 2: a decode token for the first and third, the
 * second's next 3 prompt tokens.  Step 3: a decode token each, except that the second
 * starts over with a new prompt of 6 tokens in its slot (its state zeroed by every stage
 * that keeps any).  Positions cross Llama 4's chunk of 8 in both chunked-attention paths,
 * and, as the engine does, a chunked table's blocks wholly behind the current chunk are
 * TSR_KV_NULL_BLOCK from step 2 on: a stage that read them through the wrong table
 * would fail.  The logits of every step, packed, into out; their count into *n_out. */
static void run_hybrid_tp(model_case *mc, const char *dtype, uint32_t pp, const uint32_t *layers, uint32_t tp,
                          bool canonical, float *out, size_t *n_out) {
        tsr_runner *r = NULL;
        char err[512] = "";
        tsr_kv_group g[TSR_KV_GROUPS_MAX];
        tsr_shard_spec whole;
        static uint32_t tables[H_SEQS][TSR_KV_GROUPS_MAX * H_TABLE];
        static const uint32_t slots[H_SEQS] = {3, 0, 2};
        uint32_t p0[12] = {1, 54, 291, 14, 47, 9, 1, 17, 42, 128, 3, 77}, p1[8] = {12, 77, 5, 250, 2, 19, 8, 101};
        uint32_t p2[9] = {7, 7, 99, 3, 180, 64, 5, 2, 31}, p3[6] = {2, 44, 130, 9, 9, 260};
        uint32_t d0[2] = {200, 13}, d2[2] = {150, 6};
        size_t V = mc->desc.vocab_size, rows = 0, n_tables;
        uint32_t chunk[TSR_KV_GROUPS_MAX];

        assert_int_equal(mc->desc.family->shard_for(&mc->desc, 0, 1, 0, 1, &whole), TSR_OK);
        n_tables = tsr_kv_tables(g, mc->desc.family->kv_groups(&mc->desc, &whole, g, TSR_KV_GROUPS_MAX), chunk);
        for (size_t i = 0; i < H_SEQS; i++)     /* every table's blocks its own */
                for (size_t t = 0; t < n_tables * H_TABLE; t++)
                        tables[i][t] = (uint32_t)((i * n_tables * H_TABLE + t) * 7 % H_BLOCKS);
        tsr_runner_opts o = {.dtype = dtype, .backend = mc->be, .pp = pp, .pp_layers = layers, .stage_threads = 1,
                             .pp_timeout_ms = 60000, .tp = tp, .tp_canonical = canonical, .expert_parallel = run_ep,
                             .tp_load_whole = run_whole};
        if (tsr_runner_new(mc->path, &mc->desc, &o, H_BLOCKS, H_BLOCK, H_SLOTS, &r, NULL, err, sizeof err) != TSR_OK)
                fail_msg("%s pp %u tp %u: %s", mc->path, pp, tp, err);
        assert_int_equal(tsr_runner_stages(r), (tp > 1 ? tp : 1) * (pp > 1 ? pp : 1));
        const tsr_engine_model *m = tsr_runner_model(r);
#define SEQ(i, toks, cnt, past, want, all)                                                                       \
        {.block_table = tables[i], .n_table = H_TABLE, .tokens = (toks), .n = (cnt), .past_len = (past),        \
         .want_logits = (want), .want_all_logits = (all), .state_slot = slots[i]}
        tsr_engine_seq step1[H_SEQS] = {SEQ(0, p0, 11, 0, true, true), SEQ(1, p1, 5, 0, false, false),
                                        SEQ(2, p2, 9, 0, true, false)};
        tsr_engine_seq step2[H_SEQS] = {SEQ(0, d0, 1, 11, true, false), SEQ(1, p1 + 5, 3, 5, true, false),
                                        SEQ(2, d2, 1, 9, true, false)};
        tsr_engine_seq step3[H_SEQS] = {SEQ(0, d0 + 1, 1, 12, true, false), SEQ(1, p3, 6, 0, true, true),
                                        SEQ(2, d2 + 1, 1, 10, true, false)};
#undef SEQ
        assert_int_equal(m->forward(m->ud, step1, H_SEQS, out), TSR_OK);
        rows += 11 + 1;
        for (size_t i = 0; i < H_SEQS; i += 2)  /* the first and third are past position 8 */
                for (size_t t = 0; t < n_tables; t++)
                        for (size_t b = 0; chunk[t] && b < 8 / chunk[t] * chunk[t] / H_BLOCK; b++)
                                tables[i][t * H_TABLE + b] = TSR_KV_NULL_BLOCK;
        assert_int_equal(m->forward(m->ud, step2, H_SEQS, out + rows * V), TSR_OK);
        rows += 3;
        assert_int_equal(m->forward(m->ud, step3, H_SEQS, out + rows * V), TSR_OK);
        rows += 1 + 6 + 1;
        *n_out = rows * V;
        tsr_runner_free(&r);
        assert_null(r);
}

static void run_hybrid(model_case *mc, const char *dtype, uint32_t pp, const uint32_t *layers, float *out,
                       size_t *n_out) {
        run_hybrid_tp(mc, dtype, pp, layers, 1, false, out, n_out);
}

/* run_hybrid_tp in float32, as compare_tp runs it */
static void run_hybrid_f32(model_case *mc, uint32_t pp, const uint32_t *layers, uint32_t tp, bool canonical,
                           float *out, size_t *n_out) {
        run_hybrid_tp(mc, "float32", pp, layers, tp, canonical, out, n_out);
}

#define H_ROWS 23

/* The two fixtures, and their families. */
static const struct { const char *rel, *family; } hybrid_fx[] = {
        {"tests/fixtures/tiny-llama4", "llama4"}, {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h"}};

/* The family at every split in splits[] (pps[] stages each), with `dtype`, memcmp-equal
 * to the whole model. */
static void compare_hybrid(const char *rel, const char *family, const char *dtype, const uint32_t *const *splits,
                           const uint32_t *pps, size_t n_cases) {
        model_case mc = {0};
        if (!model_open_family(&mc, rel, family))
                fail_msg("%s is a committed fixture: run from the source tree", rel);
        size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0;
        float *want = malloc(H_ROWS * V * sizeof(float)), *got = malloc(H_ROWS * V * sizeof(float));
        assert_non_null(want);
        assert_non_null(got);
        run_hybrid(&mc, dtype, 1, NULL, want, &n_want);
        assert_int_equal(n_want, H_ROWS * V);
        float max_abs = 0;
        for (size_t i = 0; i < n_want; i++) {
                if (!(want[i] > -1e30f && want[i] < 1e30f))
                        fail_msg("%s pp 1: logit %zu is %g", rel, i, want[i]);
                max_abs = fabsf(want[i]) > max_abs ? fabsf(want[i]) : max_abs;
        }
        assert_true(max_abs > 0.01f);   /* real logits, not a zeroed buffer */
        for (size_t c = 0; c < n_cases; c++) {
                char split[64];
                size_t o = 0;
                for (uint32_t s = 0; s < pps[c]; s++)
                        o += (size_t)snprintf(split + o, sizeof split - o, "%s%u", s ? "," : "", splits[c][s]);
                memset(got, 0xff, H_ROWS * V * sizeof(float));
                run_hybrid(&mc, dtype, pps[c], splits[c], got, &n_got);
                assert_int_equal(n_got, n_want);
                for (size_t i = 0; i < n_want; i++)
                        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                fail_msg("%s %s pp %u (%s): logit [%zu, %zu] %.9g, pp 1 %.9g", rel, dtype, pps[c],
                                         split, i / V, i % V, got[i], want[i]);
                print_message("%s %s: pp %u (%s): %zu logits of 3 steps bitwise equal to pp 1\n", family, dtype,
                              pps[c], split, n_want);
        }
        free(want);
        free(got);
        model_close(&mc);
}

/* Llama 4 (4 layers: chunked, chunked, chunked, full; MoE on 1 and 3): vLLM's splits at
 * 2, 3 and 4 stages, and 3,1 (a stage of chunked layers only, then one of the full layer
 * only), each stage's KV the whole model's groups it has layers of, indexed by the whole
 * model's block tables. */
static void test_llama4_pp(void **state) {
        (void)state;
        static const uint32_t two[] = {2, 2}, three[] = {1, 2, 1}, four[] = {1, 1, 1, 1}, skew[] = {3, 1};
        const uint32_t *splits[] = {two, three, four, skew};
        const uint32_t pps[] = {2, 3, 4, 2};
        compare_hybrid(hybrid_fx[0].rel, hybrid_fx[0].family, "float32", splits, pps, 4);
        compare_hybrid(hybrid_fx[0].rel, hybrid_fx[0].family, "bfloat16", splits, pps, 2);
}

/* Llama 4 tensor parallelism (R7): TP = 2 and 4 (4 heads of 16, 2 KV heads: replicated
 * at 4; every expert's 32 columns, the shared expert's and the dense MLP's 96 split) on
 * the tiny Llama 4 memcmp-equal to TP = 1 computed in the canonical split, over
 * run_hybrid's prefills, decodes and chunked layers past their chunk of 8, on the
 * reference kernels and on the fast ones; the canonical split at PP = 2 too, and TP x PP:
 * 2 x 2 (vLLM's split) and 4 x 2 at 3,1 (the second stage a full-attention MoE layer
 * and lm_head alone). */
static void test_llama4_tp(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {2, 2}, skew[] = {3, 1};
        static const tp_case cases[] = {{2, 1, NULL}, {4, 1, NULL}, {1, 2, two}, {2, 2, two}, {4, 2, skew},
                                        {4, 1, NULL, false, true}};
        if (!model_open_family(&mc, hybrid_fx[0].rel, hybrid_fx[0].family))
                fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[0].rel);
        compare_tp(&mc, "tiny-llama4", run_hybrid_f32, H_ROWS, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* --enable-expert-parallel on Llama 4: each rank holds whole experts (tp 2: experts 0-1 and
 * 2-3; tp 4: one each) and the MoE block's all-reduce of every choice's per-slice
 * partials, memcmp-equal to TP = 1 in the canonical split as tensor parallelism is:
 * tp 1 (every expert local), 2, 4, and 2 x 2 with pipeline stages.  (Adding a rank's
 * slice p where its global slice is tp_rank x P + p fails tp 2.  The fixture's top-2
 * cannot show the expert order of a row's choices: two addends commute exactly.) */
static void test_llama4_ep(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {2, 2};
        static const tp_case cases[] = {{1, 1, NULL, true}, {2, 1, NULL, true}, {4, 1, NULL, true},
                                        {2, 2, two, true}, {4, 1, NULL, true, true}};
        if (!model_open_family(&mc, hybrid_fx[0].rel, hybrid_fx[0].family))
                fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[0].rel);
        compare_tp(&mc, "tiny-llama4", run_hybrid_f32, H_ROWS, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* NemotronH (6 layers 'ME*M-E'): 3,3 (the second stage keeps Mamba state only), vLLM's
 * 2,2,2 (the last stage, '-E', keeps nothing: an empty pool), 1,4,1 and one layer a
 * stage; float32, and bfloat16 (its residual stream rounded to bf16 after every add,
 * the add at a stage boundary included). */
static void test_nemotron_h_pp(void **state) {
        (void)state;
        static const uint32_t two[] = {3, 3}, three[] = {2, 2, 2}, skew[] = {1, 4, 1}, six[] = {1, 1, 1, 1, 1, 1};
        const uint32_t *splits[] = {two, three, skew, six};
        const uint32_t pps[] = {2, 3, 3, 6};
        compare_hybrid(hybrid_fx[1].rel, hybrid_fx[1].family, "float32", splits, pps, 4);
        compare_hybrid(hybrid_fx[1].rel, hybrid_fx[1].family, "bfloat16", splits, pps, 2);
}

/* NemotronH tensor parallelism (R7): TP = 2 (4 of the 8 Mamba heads and 1 of the 2 B/C
 * groups a rank, its conv channels and SSM state only; 2 of the 4 attention heads and 1
 * of the 2 KV heads; every routed expert's 32 columns, the shared expert's 48 and the
 * dense MLP's 40 split; lm_head's 300 rows) on the tiny NemotronH memcmp-equal to TP = 1
 * computed in the canonical split, over run_hybrid's prefills, decodes and a sequence
 * restarting in its state slot, on the reference kernels and on the fast ones; the
 * canonical split at PP = 2 too, and TP x PP: 2 x 2 (3,3: the second stage keeps Mamba
 * state only) and 2 x 3 (2,2,2: the last stage keeps no state).  TP 4 does not divide
 * the 2 groups (test_hybrid_tp_refused). */
static void test_nemotron_h_tp(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {3, 3}, three[] = {2, 2, 2};
        static const tp_case cases[] = {{2, 1, NULL}, {1, 2, two}, {2, 2, two}, {2, 3, three},
                                        {2, 1, NULL, false, true}};
        if (!model_open_family(&mc, hybrid_fx[1].rel, hybrid_fx[1].family))
                fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[1].rel);
        compare_tp(&mc, "tiny-nemotron-h", run_hybrid_f32, H_ROWS, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* NemotronH with one Mamba group (n_groups 1, tests/fixtures/tiny-nemotron-h-g1, "M*M-"):
 * tp does not divide the groups, so every rank holds the group (its B and C channels and
 * their conv state replicated, vLLM's extra_groups_for_head_shards) and the gated
 * RMSNorm's sum of squares over all d_inner channels is R7's: 8 canonical channel slices,
 * each rank's tree-summed, then all-reduced.  TP = 2 and 4 (4 and 2 of the 8 Mamba heads
 * a rank) and 2 x 2 with pipeline stages, memcmp-equal to TP = 1 in the canonical split. */
static void test_nemotron_h_tp_one_group(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {2, 2};
        static const tp_case cases[] = {{2, 1, NULL}, {4, 1, NULL}, {2, 2, two}};
        if (!model_open_family(&mc, "tests/fixtures/tiny-nemotron-h-g1/model", "nemotron_h"))
                fail_msg("tests/fixtures/tiny-nemotron-h-g1 is a committed fixture: run from the source tree");
        compare_tp(&mc, "tiny-nemotron-h-g1", run_hybrid_f32, H_ROWS, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* The same one-group model as llama.cpp's converter writes it (tests/fixtures/tiny-nemotron-h-g1/
 * model-f16.gguf, "nemotron_h", F16 matrices): there each gated norm is one (1, d_inner)
 * row, of which every rank reads its heads' columns x0 .. x0 + dr (nemotron_h.c nh_slice,
 * TSR_LOAD_SLICE_COLS), with every other tensor its share of the F16 file.  TP = 2 and 4
 * and 2 x 2, memcmp-equal to TP = 1 in the canonical split. */
static void test_nemotron_h_tp_one_group_gguf(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {2, 2};
        static const tp_case cases[] = {{2, 1, NULL}, {4, 1, NULL}, {2, 2, two}};
        if (!model_open_family(&mc, "tests/fixtures/tiny-nemotron-h-g1/model-f16.gguf", "nemotron_h"))
                fail_msg("tests/fixtures/tiny-nemotron-h-g1 is a committed fixture: run from the source tree");
        assert_true(mc.desc.gguf);
        assert_int_equal(mc.desc.n_layers, 4);
        assert_int_equal(mc.desc.vocab_size, 300);
        compare_tp(&mc, "tiny-nemotron-h-g1 (F16 GGUF)", run_hybrid_f32, H_ROWS, cases,
                   sizeof cases / sizeof cases[0]);
        model_close(&mc);
}

/* --enable-expert-parallel on NemotronH (8 experts): tp 2 (experts 0-3 and 4-7), tp 1 and
 * 2 x 2, memcmp-equal to TP = 1 canonical; then a copy whose router picks 3 experts a
 * row (config.json rewritten, the weights linked), where a row's choices come in another
 * order than the experts' and the order of the weighted sum shows: TP 2 and EP 2 both
 * bitwise its TP 1.  (Adding the choices in top-k order fails the top-3 copy.) */
static void test_nemotron_h_ep(void **state) {
        (void)state;
        model_case mc = {0};
        static const uint32_t two[] = {3, 3};
        static const tp_case cases[] = {{1, 1, NULL, true}, {2, 1, NULL, true}, {2, 2, two, true}};
        static const tp_case top3[] = {{2, 1, NULL, false}, {2, 1, NULL, true}};
        char dir[] = "/tmp/tsr_nh_top3_XXXXXX", src[4096], path[4200];
        static const char *const linked[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
        json_error_t je;
        json_t *cfg;

        if (!model_open_family(&mc, hybrid_fx[1].rel, hybrid_fx[1].family))
                fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[1].rel);
        compare_tp(&mc, "tiny-nemotron-h", run_hybrid_f32, H_ROWS, cases, sizeof cases / sizeof cases[0]);
        model_close(&mc);

        assert_non_null(tsr_test_src_path(hybrid_fx[1].rel, src, sizeof src));
        assert_non_null(mkdtemp(dir));
        for (size_t i = 0; i < sizeof linked / sizeof linked[0]; i++) {
                char from[4200];
                snprintf(from, sizeof from, "%s/%s", src, linked[i]);
                snprintf(path, sizeof path, "%s/%s", dir, linked[i]);
                assert_int_equal(symlink(from, path), 0);
        }
        snprintf(path, sizeof path, "%s/config.json", src);
        assert_non_null(cfg = json_load_file(path, 0, &je));
        json_object_set_new(cfg, "num_experts_per_tok", json_integer(3));
        snprintf(path, sizeof path, "%s/config.json", dir);
        assert_int_equal(json_dump_file(cfg, path, 0), 0);
        json_decref(cfg);
        model_open_path(&mc, dir, "nemotron_h");
        compare_tp(&mc, "tiny-nemotron-h top-3", run_hybrid_f32, H_ROWS, top3, sizeof top3 / sizeof top3[0]);
        model_close(&mc);
        for (size_t i = 1; i < sizeof linked / sizeof linked[0]; i++) {
                snprintf(path, sizeof path, "%s/%s", dir, linked[i]);
                unlink(path);
        }
        tsr_test_remove_model_dir(dir);
}

/* vLLM's linear expert placement (determine_expert_map): E / tp consecutive experts a
 * rank, the remainder one each to the first ranks; every expert placed once; fewer
 * experts than ranks refused. */
static void test_expert_range(void **state) {
        static const struct { size_t E; uint32_t tp; size_t first[4], count[4]; } cases[] = {
                {4, 2, {0, 2}, {2, 2}},       {8, 2, {0, 4}, {4, 4}},       {16, 4, {0, 4, 8, 12}, {4, 4, 4, 4}},
                {5, 2, {0, 3}, {3, 2}},       {10, 4, {0, 3, 6, 8}, {3, 3, 2, 2}}, {3, 3, {0, 1, 2}, {1, 1, 1}},
                {128, 1, {0}, {128}},
        };
        char err[256];
        size_t e0, ne;
        (void)state;
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
                for (uint32_t r = 0; r < cases[c].tp; r++) {
                        assert_int_equal(tsr_tp_expert_range(cases[c].E, r, cases[c].tp, &e0, &ne, err, sizeof err),
                                         TSR_OK);
                        assert_int_equal(e0, cases[c].first[r]);
                        assert_int_equal(ne, cases[c].count[r]);
                }
        assert_int_equal(tsr_tp_expert_range(3, 0, 4, &e0, &ne, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "3 routed experts cannot be placed on 4 ranks"));
}

/* A stage's forward_stage refuses arguments that do not fit its place: no input on a
 * later stage, an output on the last, input on the first; and a stage model's pool is
 * its own layers' (a whole-model pool is refused). */
static void test_hybrid_stage_args(void **state) {
        (void)state;
        for (size_t f = 0; f < 2; f++) {
                model_case mc = {0};
                char err[512] = "";
                tsr_shard_spec sh[2], whole;
                void *model[2] = {NULL, NULL}, *view[2] = {NULL, NULL}, *bad = NULL;
                tsr_kv_pool *pool[2] = {NULL, NULL}, *wpool = NULL;
                tsr_kv_group g[TSR_KV_GROUPS_MAX];
                size_t ng;
                if (!model_open_family(&mc, hybrid_fx[f].rel, hybrid_fx[f].family))
                        fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[f].rel);
                const tsr_model_family *fam = mc.desc.family;
                assert_true(mc.desc.hidden_size > 0);
                assert_non_null(fam->forward_stage);
                for (uint32_t s = 0; s < 2; s++) {
                        assert_int_equal(fam->shard_for(&mc.desc, 0, 1, s, 2, &sh[s]), TSR_OK);
                        if (fam->load(mc.path, &mc.desc, &sh[s], NULL, NULL, NULL, &model[s], NULL, err, sizeof err) !=
                            TSR_OK)
                                fail_msg("%s stage %u: %s", hybrid_fx[f].rel, s, err);
                        ng = fam->kv_groups(&mc.desc, &sh[s], g, TSR_KV_GROUPS_MAX);
                        assert_int_equal(tsr_kv_pool_new_slots(g, ng, 16, H_BLOCK, H_SLOTS, &pool[s]), TSR_OK);
                        assert_int_equal(fam->kv_bind(model[s], pool[s], &view[s]), TSR_OK);
                }
                assert_int_equal(sh[0].first_layer, 0);
                assert_int_equal(sh[1].last_layer + 1, mc.desc.n_layers);
                assert_int_equal(sh[0].last_layer + 1, sh[1].first_layer);
                /* a stage does not bind the whole model's pool */
                assert_int_equal(fam->shard_for(&mc.desc, 0, 1, 0, 1, &whole), TSR_OK);
                ng = fam->kv_groups(&mc.desc, &whole, g, TSR_KV_GROUPS_MAX);
                assert_int_equal(tsr_kv_pool_new_slots(g, ng, 16, H_BLOCK, H_SLOTS, &wpool), TSR_OK);
                assert_int_not_equal(fam->kv_bind(model[1], wpool, &bad), TSR_OK);
                assert_null(bad);
                uint32_t table[TSR_KV_GROUPS_MAX * 4] = {0}, toks[3] = {5, 6, 7};
                tsr_engine_seq e = {.block_table = table, .n_table = 4, .tokens = toks, .n = 3, .want_logits = true};
                char seq[256];
                size_t D = mc.desc.hidden_size;
                float *io = malloc(2 * 3 * D * sizeof(float)), *logits = malloc(mc.desc.vocab_size * sizeof(float));
                assert_non_null(io);
                assert_non_null(logits);
                assert_true(fam->seq_size <= sizeof seq);
                fam->seq_fill(seq, e.block_table, e.n_table, e.tokens, e.n, 0, true, false);
                if (fam->seq_set_state)
                        fam->seq_set_state(seq, 1, NULL, NULL, 0, 0);
                /* the first stage: no input, an output, no logits */
                assert_int_equal(fam->forward_stage(model[0], mc.be, view[0], seq, 1, io, io, NULL), TSR_E_INVAL);
                assert_int_equal(fam->forward_stage(model[0], mc.be, view[0], seq, 1, NULL, NULL, logits),
                                 TSR_E_INVAL);
                /* a stage is not a whole model */
                assert_int_equal(fam->forward_batch(model[0], mc.be, view[0], seq, 1, logits), TSR_E_INVAL);
                assert_int_equal(fam->forward_stage(model[0], mc.be, view[0], seq, 1, NULL, io, NULL), TSR_OK);
                /* the last: an input, no output, logits when asked */
                assert_int_equal(fam->forward_stage(model[1], mc.be, view[1], seq, 1, NULL, NULL, logits), TSR_E_INVAL);
                assert_int_equal(fam->forward_stage(model[1], mc.be, view[1], seq, 1, io, io, logits), TSR_E_INVAL);
                assert_int_equal(fam->forward_stage(model[1], mc.be, view[1], seq, 1, io, NULL, NULL), TSR_E_INVAL);
                assert_int_equal(fam->forward_stage(model[1], mc.be, view[1], seq, 1, io, NULL, logits), TSR_OK);
                for (size_t i = 0; i < mc.desc.vocab_size; i++)
                        assert_true(logits[i] > -1e30f && logits[i] < 1e30f);
                free(io);
                free(logits);
                for (uint32_t s = 0; s < 2; s++) {
                        fam->kv_unbind(&view[s]);
                        tsr_kv_pool_free(&pool[s]);
                        fam->free(&model[s]);
                        assert_null(model[s]);
                }
                tsr_kv_pool_free(&wpool);
                model_close(&mc);
        }
}

/* Tensor parallelism refused where tp does not divide a family's counts (named, in
 * vLLM's words where vLLM has them: the attention heads for both, NemotronH's B/C groups
 * at 4 and its n_groups rule), with or without pipeline stages, and on bfloat16 weights;
 * pipeline and tensor parallelism's refusals name every family that has them; the fp8 KV
 * cache stays refused with pipeline stages (NemotronH's is one rank's; Llama 4 has
 * none). */
static void test_hybrid_tp_refused(void **state) {
        (void)state;
        char names[128];
        static const struct { size_t f; uint32_t tp, pp; const char *words; } bad[] = {
                /* tp 3: not a divisor of the 8 canonical partial sums; 8: of the 4 heads */
                {0, 3, 1, "tensor parallel size 3 must divide 8 (the canonical partial sums"},
                {0, 8, 1, "Total number of attention heads (4) must be divisible by tensor parallel size (8)."},
                {0, 8, 2, "Total number of attention heads (4) must be divisible by tensor parallel size (8)."},
                {1, 3, 1, "tensor parallel size 3 must divide 8 (the canonical partial sums"},
                {1, 8, 2, "Total number of attention heads (4) must be divisible by tensor parallel size (8)."},
                /* tp 4: the heads split (8 Mamba, 4 attention; the 2 KV heads replicated), the 2 groups not */
                {1, 4, 1, "If tensor parallel world size does not divide num_groups, then num_groups must equal 1. "
                          "(n_groups 2, tensor parallel size 4)"},
                {1, 4, 2, "If tensor parallel world size does not divide num_groups, then num_groups must equal 1."},
        };
        assert_string_equal(tsr_family_names(tsr_family_has_stages, names, sizeof names), "llama, llama4, nemotron_h");
        assert_string_equal(tsr_family_names(tsr_family_has_tp, names, sizeof names), "llama, llama4, nemotron_h");
        for (size_t f = 0; f < 2; f++) {
                model_case mc = {0};
                tsr_runner *r = NULL;
                char err[512] = "";
                const uint32_t *two = f == 0 ? (const uint32_t[]){2, 2} : (const uint32_t[]){3, 3};
                if (!model_open_family(&mc, hybrid_fx[f].rel, hybrid_fx[f].family))
                        fail_msg("%s is a committed fixture: run from the source tree", hybrid_fx[f].rel);
                for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                        if (bad[i].f != f)
                                continue;
                        tsr_runner_opts t = {.dtype = "float32", .backend = mc.be, .tp = bad[i].tp, .pp = bad[i].pp,
                                             .pp_layers = bad[i].pp > 1 ? two : NULL, .stage_threads = 1};
                        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &t, 16, H_BLOCK, H_SLOTS, &r, NULL, err,
                                                        sizeof err),
                                         TSR_E_UNSUPPORTED);
                        assert_null(r);
                        if (!strstr(err, bad[i].words))
                                fail_msg("%s tp %u pp %u: %s", hybrid_fx[f].family, bad[i].tp, bad[i].pp, err);
                }
                /* bfloat16 weights: split in float32, then converted rank by rank (test_tp_bf16) */
                tsr_runner_opts b = {.dtype = "bfloat16", .backend = mc.be, .tp = 2, .stage_threads = 1};
                assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &b, 16, H_BLOCK, H_SLOTS, &r, NULL, err,
                                                sizeof err),
                                 TSR_OK);
                assert_string_equal(tsr_runner_dtype(r), "bfloat16");
                tsr_runner_free(&r);
                tsr_runner_opts k = {.dtype = "float32", .backend = mc.be, .pp = 2, .pp_layers = two,
                                     .stage_threads = 1, .kv_dtype = TSR_DTYPE_FP8_E4M3};
                /* the fp8 KV cache with pipeline stages: both families */
                assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &k, 16, H_BLOCK, H_SLOTS, &r, NULL, err, sizeof err),
                                 TSR_OK);
                assert_non_null(r);
                tsr_runner_free(&r);
                model_close(&mc);
        }
}

/* The fp8 KV cache under parallelism: each rank stores its layers' (and its KV heads')
 * keys and values in fp8 with its layers' scales, so PP 2, TP 2 and TP 2 x PP 2 give the
 * logits of one rank bitwise (the tiny Llama 3, canonical float32 split), and PP 2 and 3
 * on SmolLM2's GGUF blocks those of PP 1; fp8 must also differ from float32 (the cache
 * really is fp8). */
static void test_fp8_kv_parallel(void **state) {
        (void)state;
        static const uint32_t one_one[] = {1, 1}, smol2[] = {15, 15}, smol3[] = {8, 12, 10};
        const struct {
                const char *rel;
                uint32_t pp, tp;
                const uint32_t *layers;
        } cases[] = {
                {"tests/fixtures/tiny-llama3-hf/f32", 2, 1, one_one},
                {"tests/fixtures/tiny-llama3-hf/f32", 1, 2, NULL},
                {"tests/fixtures/tiny-llama3-hf/f32", 2, 2, one_one},
                {".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", 2, 1, smol2},
                {".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", 3, 1, smol3},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                model_case mc = {0};
                if (!model_open(&mc, cases[c].rel))
                        TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s is absent (scripts/fetch-model.sh fetches it)", cases[c].rel);
                bool tiny = strstr(cases[c].rel, "tiny") != NULL;   /* tp needs the float32 canonical split */
                size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0, n_f32 = 0;
                float *want = malloc(13 * V * sizeof(float)), *got = malloc(13 * V * sizeof(float)),
                      *f32 = malloc(13 * V * sizeof(float));
                assert_true(want && got && f32);
                run_steps_kv(&mc, 1, NULL, 1, tiny, TSR_DTYPE_FP8_E4M3, want, &n_want);
                run_steps_kv(&mc, 1, NULL, 1, tiny, TSR_DTYPE_F32, f32, &n_f32);
                assert_int_equal(n_f32, n_want);
                assert_true(memcmp(want, f32, n_want * sizeof(float)) != 0);
                run_steps_kv(&mc, cases[c].pp, cases[c].layers, cases[c].tp, tiny, TSR_DTYPE_FP8_E4M3, got, &n_got);
                assert_int_equal(n_got, n_want);
                for (size_t i = 0; i < n_want; i++)
                        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                fail_msg("%s fp8 KV, pp %u tp %u: logit [%zu, %zu] %.9g, one rank %.9g", cases[c].rel,
                                         cases[c].pp, cases[c].tp, i / V, i % V, got[i], want[i]);
                print_message("%s: fp8 KV at pp %u x tp %u: %zu logits bitwise equal to one rank\n", cases[c].rel,
                              cases[c].pp, cases[c].tp, n_want);
                free(want);
                free(got);
                free(f32);
                model_close(&mc);
        }
}

/* --kv-cache-dtype fp8 against a torch emulation of the cache (issue #15):
 * tests/fixtures/tiny-modelopt/fp8-kv is the ModelOpt FP8 tiny Llama with k/v scales
 * 1.5 / 2.0 and 1.25 / 1.75 (make_tiny_modelopt_kv.py), whose emulation stores K (after
 * RoPE) and V as e4m3(x / scale) and attends over float(code) x scale.  Served by the
 * runner with an fp8 pool and the checkpoint's scales, prompts 0 and 1 give every
 * position's logits within 1e-4 + 50 x the emulation's sum-order sensitivity of it (as
 * test_quant_modelopt.c's bound; the fp8 cache itself moves them by 0.44), and the same
 * runner with a float32 pool does not (the scales and the cache are really used). */
static void test_fp8_kv_vs_emulation(void **state) {
        (void)state;
        model_case mc = {0};
        char path[1024], err[512] = "";
        json_error_t je;
        json_t *g = NULL, *meta = NULL;
        tsr_runner *r = NULL;
        uint32_t table[N_BLOCKS], ids[64];

        if (!model_open(&mc, "tests/fixtures/tiny-modelopt/fp8-kv"))
                fail_msg("the fp8-kv fixture is committed: run from the source tree");
        assert_non_null(tsr_test_src_path("tests/fixtures/tiny-modelopt/golden.json", path, sizeof path));
        assert_non_null(g = json_load_file(path, 0, &je));
        assert_non_null(tsr_test_src_path("tests/fixtures/tiny-modelopt/fp8-kv.json", path, sizeof path));
        assert_non_null(meta = json_load_file(path, 0, &je));
        size_t V = mc.desc.vocab_size, rows = 0, n0 = tsr_test_prompt_ids(g, 0, ids, 64);
        rows = n0 + tsr_test_prompt_ids(g, 1, ids, 64);
        float *want = malloc(rows * V * sizeof(float)), *got = malloc(rows * V * sizeof(float));
        assert_true(want && got);
        assert_non_null(tsr_test_src_path("tests/fixtures/tiny-modelopt/fp8-kv.logits.f32", path, sizeof path));
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        assert_int_equal(fread(want, sizeof(float), rows * V, f), rows * V);
        fclose(f);
        for (size_t i = 0; i < N_BLOCKS; i++)
                table[i] = (uint32_t)(N_BLOCKS - 1 - i);        /* reversed: the table matters */
        double bound = 1e-4 + 50 * json_number_value(json_object_get(meta, "order_sensitivity")), worst[2] = {0, 0};
        for (int fp8 = 1; fp8 >= 0; fp8--) {
                tsr_runner_opts o = {.dtype = "float32", .backend = mc.be, .stage_threads = 1,
                                     .kv_dtype = fp8 ? TSR_DTYPE_FP8_E4M3 : TSR_DTYPE_F32};
                if (tsr_runner_new(mc.path, &mc.desc, &o, N_BLOCKS, BLOCK, 0, &r, NULL, err, sizeof err) != TSR_OK)
                        fail_msg("%s: %s", mc.path, err);
                const tsr_engine_model *m = tsr_runner_model(r);
                for (size_t pi = 0, row = 0; pi < 2; pi++) {
                        size_t n = tsr_test_prompt_ids(g, pi, ids, 64);
                        tsr_engine_seq q = {.block_table = table, .n_table = N_BLOCKS, .tokens = ids, .n = n,
                                            .want_logits = true, .want_all_logits = true};
                        assert_int_equal(m->forward(m->ud, &q, 1, got + row * V), TSR_OK);
                        row += n;
                }
                tsr_runner_free(&r);
                for (size_t i = 0; i < rows * V; i++)
                        worst[fp8] = fmax(worst[fp8], fabs((double)got[i] - want[i]));
        }
        print_message("fp8 KV (scales 1.5/2.0, 1.25/1.75) vs the torch emulation: max |dlogit| %.3g (bound %.3g); "
                      "a float32 cache: %.3g\n", worst[1], bound, worst[0]);
        assert_true(worst[1] <= bound);
        assert_true(worst[0] > 100 * bound);
        json_decref(g);
        json_decref(meta);
        free(want);
        free(got);
        model_close(&mc);
}

/* Tensor parallelism with bf16 weights (no --dtype float32 needed, as vLLM serves a bf16
 * checkpoint at -tp N): the split runs on float32, then each rank converts its share, and
 * every row-parallel K slice's partial is the bf16 matmul's on that slice, so TP 2 (and
 * 4) give the bits of TP 1 in the canonical split with bf16 weights, for every family
 * (expert-parallel too); and they are not the float32 bits (the weights really are bf16).
 * A BF16 checkpoint's linears (and Llama 4's expert stacks) are not converted at all:
 * kept as stored, each rank its share of the bytes, the canonical slices cut from them
 * (`copy`: the fixture rounded to a BF16 checkpoint, tsr_test_bf16_copy). */
static void test_tp_bf16(void **state) {
        (void)state;
        static const struct { const char *rel, *family; uint32_t max_tp; bool ep, copy; } cases[] = {
                {"tests/fixtures/tiny-llama3-hf/f32", "llama", 4, false, false},
                /* a BF16 checkpoint: its matmuls kept as stored (keep_bf16), split as bytes */
                {"tests/fixtures/tiny-llama3-hf/bf16", "llama", 4, false, false},
                {"tests/fixtures/tiny-llama4", "llama4", 4, false, false},
                {"tests/fixtures/tiny-llama4", "llama4", 2, true, false},
                {"tests/fixtures/tiny-llama4", "llama4", 4, false, true},
                {"tests/fixtures/tiny-llama4", "llama4", 2, true, true},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", 2, false, false},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", 2, true, false},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", 2, false, true},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", 2, true, true},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                model_case mc = {0};
                char src[4096], copy[64] = "/tmp/tsr_tp_bf16_XXXXXX";
                if (!tsr_test_src_path(cases[c].rel, src, sizeof src))
                        fail_msg("%s is a committed fixture: run from the source tree", cases[c].rel);
                if (cases[c].copy) {
                        tsr_test_bf16_copy(src, copy);
                        model_open_path(&mc, copy, cases[c].family);
                } else {
                        model_open_family(&mc, cases[c].rel, cases[c].family);
                }
                size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0, n32 = 0;
                float *want = malloc(H_ROWS * V * sizeof(float)), *got = malloc(H_ROWS * V * sizeof(float));
                float *f32 = malloc(H_ROWS * V * sizeof(float));
                assert_true(want && got && f32);
                run_ep = cases[c].ep;
                run_hybrid_tp(&mc, "bfloat16", 1, NULL, 1, true, want, &n_want);
                run_hybrid_tp(&mc, "float32", 1, NULL, 2, true, f32, &n32);
                assert_int_equal(n32, n_want);
                assert_true(memcmp(f32, want, n_want * sizeof(float)) != 0);
                for (uint32_t tp = 2; tp <= cases[c].max_tp; tp *= 2) {
                        memset(got, 0xff, H_ROWS * V * sizeof(float));
                        run_hybrid_tp(&mc, "bfloat16", 1, NULL, tp, true, got, &n_got);
                        assert_int_equal(n_got, n_want);
                        for (size_t i = 0; i < n_want; i++)
                                if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                                        fail_msg("%s bf16 tp %u%s: logit [%zu, %zu] %.9g, tp 1 %.9g", cases[c].rel, tp,
                                                 cases[c].ep ? " ep" : "", i / V, i % V, got[i], want[i]);
                        print_message("%s%s bf16%s: tp %u: %zu logits bitwise equal to tp 1 (canonical)\n", cases[c].rel,
                                      cases[c].copy ? " (as a BF16 checkpoint)" : "",
                                      cases[c].ep ? " expert-parallel" : "", tp, n_want);
                }
                run_ep = false;
                free(want);
                free(got);
                free(f32);
                model_close(&mc);
                if (cases[c].copy)
                        tsr_test_remove_model_dir(copy);
        }
}

/* A family on a device backend through the runner (to_backend, reserve, the pool in the
 * device's memory): the fixture `rel` (and, with `copy`, its BF16 copy, in bfloat16) on
 * cpu-devlike gives bitwise the host's logits in float32 and bfloat16 (issue #16). */
static void runner_on_devlike(const char *rel, const char *family, bool copy_bf16) {
        static const char *const dtypes[] = {"float32", "bfloat16"};
        char src[4096], copy[64] = "/tmp/tsr_dev_XXXXXX";
        if (rel[0] == '/')      /* a model the test wrote */
                snprintf(src, sizeof src, "%s", rel);
        else
                assert_non_null(tsr_test_src_path(rel, src, sizeof src));
        if (copy_bf16)
                tsr_test_bf16_copy(src, copy);
        const char *dirs[] = {src, copy};
        for (size_t di = 0; di < (copy_bf16 ? 2u : 1u); di++)
                for (size_t k = di; k < 2; k++) {       /* the BF16 copy in bfloat16 only */
                        model_case mc = {0};
                        model_open_path(&mc, dirs[di], family);
                        size_t V = mc.desc.vocab_size, n_want = 0, n_got = 0;
                        float *want = malloc(H_ROWS * V * sizeof(float)), *got = malloc(H_ROWS * V * sizeof(float));
                        tsr_backend *fast = mc.be;
                        assert_true(want && got);
                        assert_int_equal(tsr_backend_cpu_ref_new(&mc.be), TSR_OK);
                        run_hybrid_tp(&mc, dtypes[k], 1, NULL, 1, false, want, &n_want);
                        tsr_backend_free(&mc.be);
                        assert_int_equal(tsr_backend_cpu_devlike_new(&mc.be), TSR_OK);
                        run_hybrid_tp(&mc, dtypes[k], 1, NULL, 1, false, got, &n_got);
                        tsr_backend_free(&mc.be);
                        mc.be = fast;
                        assert_int_equal(n_got, n_want);
                        assert_memory_equal(got, want, n_want * sizeof(float));
                        print_message("%s%s %s through the runner on cpu-devlike: %zu logits bitwise the host's\n",
                                      rel, di ? " (BF16 checkpoint)" : "", dtypes[k], n_want);
                        free(want);
                        free(got);
                        model_close(&mc);
                }
        if (copy_bf16)
                tsr_test_remove_model_dir(copy);
}

static void test_llama4_device(void **state) {
        (void)state;
        runner_on_devlike("tests/fixtures/tiny-llama4", "llama4", true);
}

static void test_nemotron_h_device(void **state) {
        (void)state;
        runner_on_devlike("tests/fixtures/tiny-nemotron-h/model", "nemotron_h", true);
}

/* The Llama family's, from a BF16 checkpoint: in bfloat16 its tables are kept as stored
 * and go to the device as their bf16 bytes (the device's gather widens the embedding's
 * rows); untied (the fixture), and tied (the 4-layer model's BF16 copy: the one table
 * both the gather and lm_head read). */
static void test_llama_device(void **state) {
        (void)state;
        char dir[] = "/tmp/tsr-test-parallel-XXXXXX";
        runner_on_devlike("tests/fixtures/tiny-llama3-hf/bf16", "llama", false);
        if (!write_llama_4layers(dir))
                fail_msg("cannot write the 4-layer model under /tmp");
        runner_on_devlike(dir, "llama", true);
        tsr_test_remove_model_dir(dir);
}

/* Row d of the 2-D stored tensor t widened to float32 (its cols values). */
static void stored_row(const tsr_tensor *t, size_t d, float *out) {
        size_t rb;
        assert_int_equal(tsr_dtype_row_bytes(t->dtype, t->shape[1], &rb), TSR_OK);
        assert_int_equal(tsr_dequant_row(t->dtype, (const uint8_t *)t->data + d * rb, t->shape[1], out), TSR_OK);
}

/* A stored (3, 64) nvfp4 and (3, 24) fp8_e4m3 tensor of pseudo-random codes (every
 * block scale a finite e4m3): tsr_load_stored_slice keeps rows and whole-block column
 * ranges and refuses a range that cuts a block, leaving the tensor as it was;
 * tsr_tp_keep_stored_col_slices lays the K slices out one after the other, each slice's
 * rows widening to the whole row's columns, the scales kept.  A 3-D fp8 stack: each
 * expert's rows or columns. */
static void test_stored_slices(void **state) {
        (void)state;
        static const struct { tsr_dtype dt; size_t cols, first, n, ns_ok, ns_bad; } cases[] = {
                {TSR_DTYPE_NVFP4, 64, 16, 32, 2, 4},
                {TSR_DTYPE_FP8_E4M3, 24, 3, 18, 6, 0},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                size_t rows = 3, cols = cases[c].cols, rb, shape[2] = {rows, cols};
                bool nv = cases[c].dt == TSR_DTYPE_NVFP4;
                float whole[3][64], got[64];
                uint32_t seed = 7;
                assert_int_equal(tsr_dtype_row_bytes(cases[c].dt, cols, &rb), TSR_OK);
                uint8_t *bytes = aligned_alloc(64, 64 * ((rows * rb + 63) / 64));
                assert_non_null(bytes);
                for (size_t i = 0; i < rows * rb; i++) {
                        seed = seed * 1103515245u + 12345u;
                        bytes[i] = (uint8_t)(seed >> 16) & 0x77;       /* no e4m3 NaN (0x7f / 0xff) */
                }
                tsr_tensor t, keep;
                assert_int_equal(tsr_tensor_init(&t, cases[c].dt, 2, shape, NULL, bytes), TSR_OK);
                t.scales = (tsr_matmul_scales){.weight = 0.5f, .input = 2.0f};
                for (size_t d = 0; d < rows; d++)
                        stored_row(&t, d, whole[d]);
                /* rows 1 and 2 */
                tsr_load_slice rs = {TSR_LOAD_SLICE_ROWS, 1, {{1, 2}}};
                keep = t;
                keep.data = aligned_alloc(64, 64 * ((rows * rb + 63) / 64));
                assert_non_null(keep.data);
                memcpy(keep.data, bytes, rows * rb);
                assert_int_equal(tsr_load_stored_slice(&keep, &rs), TSR_OK);
                assert_true(keep.shape[0] == 2 && keep.shape[1] == cols && keep.scales.weight == 0.5f);
                for (size_t d = 0; d < 2; d++) {
                        stored_row(&keep, d, got);
                        assert_memory_equal(got, whole[d + 1], cols * sizeof(float));
                }
                free(keep.data);
                /* a column range on whole blocks, and one that cuts a block (nvfp4) */
                tsr_load_slice cs = {TSR_LOAD_SLICE_COLS, 1, {{cases[c].first, cases[c].n}}};
                keep = t;
                keep.data = aligned_alloc(64, 64 * ((rows * rb + 63) / 64));
                assert_non_null(keep.data);
                memcpy(keep.data, bytes, rows * rb);
                if (nv) {
                        tsr_load_slice bad = {TSR_LOAD_SLICE_COLS, 1, {{8, 16}}};
                        void *before = keep.data;
                        assert_int_equal(tsr_load_stored_slice(&keep, &bad), TSR_E_UNSUPPORTED);
                        assert_true(keep.data == before && keep.shape[1] == cols);
                }
                assert_int_equal(tsr_load_stored_slice(&keep, &cs), TSR_OK);
                assert_true(keep.shape[0] == rows && keep.shape[1] == cases[c].n && keep.scales.input == 2.0f);
                for (size_t d = 0; d < rows; d++) {
                        stored_row(&keep, d, got);
                        assert_memory_equal(got, whole[d] + cases[c].first, cases[c].n * sizeof(float));
                }
                free(keep.data);
                /* the canonical K slices */
                if (cases[c].ns_bad) {
                        void *before = t.data;
                        assert_int_equal(tsr_tp_keep_stored_col_slices(&t, cases[c].first, cases[c].n, cases[c].ns_bad),
                                         TSR_E_UNSUPPORTED);
                        assert_true(t.data == before);
                }
                size_t ns = cases[c].ns_ok, ks = cases[c].n / ns, ksb;
                assert_int_equal(tsr_tp_keep_stored_col_slices(&t, cases[c].first, cases[c].n, ns), TSR_OK);
                assert_true(t.shape[1] == cases[c].n && t.scales.weight == 0.5f);
                assert_int_equal(tsr_dtype_row_bytes(t.dtype, ks, &ksb), TSR_OK);
                for (size_t j = 0; j < ns; j++)
                        for (size_t d = 0; d < rows; d++) {
                                assert_int_equal(tsr_dequant_row(t.dtype, (const uint8_t *)t.data + (j * rows + d) * ksb,
                                                                 ks, got), TSR_OK);
                                assert_memory_equal(got, whole[d] + cases[c].first + j * ks, ks * sizeof(float));
                        }
                free(t.data);
        }
        /* an fp8 stack [2 experts, 3, 4] (byte e*12 + r*4 + c): the same share of each
         * expert, as Llama 4's FP8 BMM stacks are cut for a rank */
        for (int by_rows = 0; by_rows < 2; by_rows++) {
                size_t shape3[3] = {2, 3, 4};
                uint8_t *b = aligned_alloc(64, 64);
                assert_non_null(b);
                for (uint8_t i = 0; i < 24; i++)
                        b[i] = i;
                tsr_tensor st3;
                assert_int_equal(tsr_tensor_init(&st3, TSR_DTYPE_FP8_E4M3, 3, shape3, NULL, b), TSR_OK);
                st3.scales.weight = 0.25f;
                tsr_load_slice sh = by_rows ? (tsr_load_slice){TSR_LOAD_SLICE_ROWS, 1, {{1, 2}}}
                                            : (tsr_load_slice){TSR_LOAD_SLICE_COLS, 2, {{0, 1}, {3, 1}}};
                assert_int_equal(tsr_load_stored_slice(&st3, &sh), TSR_OK);
                const uint8_t want_rows[16] = {4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23};
                const uint8_t want_cols[12] = {0, 3, 4, 7, 8, 11, 12, 15, 16, 19, 20, 23};
                assert_true(st3.n_dims == 3 && st3.shape[0] == 2 && st3.scales.weight == 0.25f);
                assert_true(by_rows ? st3.shape[1] == 2 && st3.shape[2] == 4 : st3.shape[1] == 3 && st3.shape[2] == 2);
                assert_memory_equal(st3.data, by_rows ? want_rows : want_cols, by_rows ? 16 : 12);
                tsr_load_slice past = {TSR_LOAD_SLICE_ROWS, 1, {{2, 1}}};      /* beyond the 2 rows left */
                assert_int_equal(tsr_load_stored_slice(&st3, &past), by_rows ? TSR_E_INVAL : TSR_OK);
                free(st3.data);
        }
}

static void gg_key_u32(tsr_buf *b, const char *key, uint32_t v) {
        gw_key(b, key, TSR_GGUF_TYPE_UINT32);
        gw_u32(b, v);
}

/* A random Llama GGUF written at run time (nothing committed): `dim` wide, 4 heads of
 * dim / 4, 2 KV heads, MLP 2 x dim, 2 layers, vocabulary 300,
 * tied; the matmuls and the embedding in Q8_0 blocks (each block's scale a power of
 * two, so its f16 is exact), the norms F32.  ggml lists dims fastest first. */
static bool write_llama_q8_0(char *path, uint32_t dim) {
        uint32_t hid = 2 * dim, V = 300, L = 2, seed = 99;
        struct { char name[64]; uint64_t rows, cols; bool q; } t[2 + 2 * 9];
        size_t n = 0;
        tsr_buf b;
        t[n++] = (__typeof__(t[0])){"token_embd.weight", V, dim, true};
        t[n++] = (__typeof__(t[0])){"output_norm.weight", dim, 1, false};
        for (uint32_t l = 0; l < L; l++) {
                static const struct { const char *name; int rows, cols; bool q; } per[] = {
                        {"attn_norm", 1, 0, false}, {"ffn_norm", 1, 0, false}, {"attn_q", 1, 1, true},
                        {"attn_k", -2, 1, true},   {"attn_v", -2, 1, true},    {"attn_output", 1, 1, true},
                        {"ffn_gate", 2, 1, true},  {"ffn_up", 2, 1, true},     {"ffn_down", 1, 2, true},
                };
                for (size_t i = 0; i < 9; i++, n++) {
                        snprintf(t[n].name, sizeof t[n].name, "blk.%u.%s.weight", l, per[i].name);
                        t[n].rows = per[i].rows < 0 ? dim / 2 : per[i].rows * dim;      /* k, v: 2 KV heads */
                        t[n].cols = per[i].cols ? per[i].cols * dim : 1;
                        t[n].q = per[i].q;
                }
        }
        tsr_buf_init(&b, 64 << 20);
        gw_bytes(&b, "GGUF", 4);
        gw_u32(&b, 3);
        gw_u64(&b, n);
        gw_u64(&b, 6);
        gw_key(&b, "general.architecture", TSR_GGUF_TYPE_STRING);
        gw_str(&b, "llama");
        gg_key_u32(&b, "llama.embedding_length", dim);
        gg_key_u32(&b, "llama.block_count", L);
        gg_key_u32(&b, "llama.attention.head_count", 4);
        gg_key_u32(&b, "llama.attention.head_count_kv", 2);
        gg_key_u32(&b, "llama.feed_forward_length", hid);
        uint64_t off = 0;
        for (size_t i = 0; i < n; i++) {
                gw_str(&b, t[i].name);
                gw_u32(&b, t[i].cols == 1 ? 1 : 2);
                gw_u64(&b, t[i].cols == 1 ? t[i].rows : t[i].cols);
                if (t[i].cols != 1)
                        gw_u64(&b, t[i].rows);
                gw_u32(&b, t[i].q ? TSR_GGML_TYPE_Q8_0 : TSR_GGML_TYPE_F32);
                gw_u64(&b, off);
                off += t[i].q ? t[i].rows * t[i].cols / 32 * 34 : t[i].rows * t[i].cols * 4;
                off = (off + 31) / 32 * 32;
        }
        while (b.len % 32)
                gw_u8(&b, 0);
        for (size_t i = 0; i < n; i++) {
                size_t blocks = t[i].q ? t[i].rows * t[i].cols / 32 : t[i].rows * t[i].cols;
                for (size_t k = 0; k < blocks; k++) {
                        seed = seed * 1103515245u + 12345u;
                        if (t[i].q) {   /* scale 2^-7, 2^-8 or 2^-6 (f16 0x2000, 0x1c00, 0x2400), 32 int8 */
                                static const uint16_t d[3] = {0x2000, 0x1c00, 0x2400};
                                gw_le(&b, d[(seed >> 16) % 3], 2);
                                for (int e = 0; e < 32; e++) {
                                        seed = seed * 1103515245u + 12345u;
                                        gw_u8(&b, (uint8_t)((int)((seed >> 16) % 255) - 127));
                                }
                        } else {        /* norms in [0.9, 1.1) */
                                float v = ((float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f) * 0.1f + 1.0f;
                                gw_bytes(&b, &v, 4);
                        }
                }
                while (b.len % 32)
                        gw_u8(&b, 0);
        }
        int fd = mkstemps(path, 5);     /* the template's 5-byte ".gguf" suffix is kept */
        bool ok = fd >= 0 && write(fd, b.data, b.len) == (ssize_t)b.len;
        if (fd >= 0)
                ok = close(fd) == 0 && ok;
        tsr_buf_done(&b);
        return ok;
}

/* A GGUF's Q8_0 weights under TP, kept as stored (--dtype auto): each rank keeps its rows
 * and its canonical K slices of the blocks, and the logits are bitwise TP = 1's in the
 * canonical split on both kernel sets, at TP 2, 4 and 2 x PP 2 (the last stage, which
 * does not embed, reads only its vocabulary rows of the tied table).  In the 256-wide
 * model every slice is whole blocks (o_proj: 32 columns at tp 1, 32 at tp 2 and 4; down_proj 64, 64, 64);
 * in the 128-wide one o_proj's slices are 16 columns, half a block: o_proj is widened to
 * float32 (the bits of a widened load), down_proj stays Q8_0.  The tied embedding stays
 * Q8_0 too (rows widened at lookup), each rank's lm_head a Q8_0 copy of its vocabulary
 * rows.  Resident bytes: the ranks' together under one float32 copy. */
static void test_gguf_q8_0_tp(void **state) {
        (void)state;
        static const uint32_t halves[] = {1, 1};
        static const tp_case cases[] = {{2, 1, NULL}, {4, 1, NULL}, {2, 2, halves}, {2, 1, NULL, false, true}};
        for (uint32_t dim = 256; dim >= 128; dim /= 2) {
                static char path[64];
                model_case mc = {0};
                /* mkstemps' template: the six X become a unique name (write_llama_q8_0) */
                snprintf(path, sizeof path, "/tmp/tsr-q8-llama-XXXXXX.gguf");
                if (!write_llama_q8_0(path, dim))
                        fail_msg("cannot write a GGUF under /tmp");
                model_open_path(&mc, path, "llama");
                g_dtype = "auto";
                /* 128 wide: the canonical split widens o_proj, the one-pass run keeps its
                 * Q8_0 blocks (and quantizes its activations): not the same arithmetic */
                g_plain_tol = dim == 128 ? 10.0 : 1e-3;
                char name[64];
                snprintf(name, sizeof name, "q8_0 llama %u wide", dim);
                compare_tp(&mc, name, run_steps_tp, 13, cases, sizeof cases / sizeof cases[0]);
                /* what the ranks hold: the Q8_0 shares, not float32 */
                tsr_load_stats one = {0}, two = {0};
                tsr_runner *r = NULL;
                char err[512] = "";
                for (uint32_t tp = 1; tp <= 2; tp++) {
                        tsr_runner_opts o = {.dtype = "auto", .backend = mc.be, .stage_threads = 1,
                                             .pp_timeout_ms = 60000, .tp = tp, .tp_canonical = true};
                        if (tsr_runner_new(mc.path, &mc.desc, &o, N_BLOCKS, BLOCK, 0, &r, tp == 1 ? &one : &two, err,
                                           sizeof err) != TSR_OK)
                                fail_msg("%s tp %u: %s", mc.path, tp, err);
                        tsr_runner_free(&r);
                }
                g_dtype = "float32";
                g_plain_tol = 1e-3;
                print_message("%s: resident %llu bytes at tp 1, %llu over the 2 ranks at tp 2, float32 %llu\n", name,
                              (unsigned long long)one.resident_bytes, (unsigned long long)two.resident_bytes,
                              (unsigned long long)one.f32_bytes);
                assert_true(one.resident_bytes < one.f32_bytes / 2);
                assert_true(two.resident_bytes < one.f32_bytes);
                model_close(&mc);
                unlink(path);
        }
}

/* The ModelOpt fixture at `rel` (of `family`) loaded at tp 2 (`ep`: expert-parallel)
 * is refused, err containing `want`. */
static void expect_tp2_refused(const char *rel, const char *family, bool ep, const char *want) {
        model_case mc = {0};
        tsr_runner *r = NULL;
        char err[512] = "";
        if (!model_open_family(&mc, rel, family))
                fail_msg("%s is a committed fixture: run from the source tree", rel);
        tsr_runner_opts o = {.dtype = "float32", .backend = mc.be, .stage_threads = 1, .pp_timeout_ms = 60000,
                             .tp = 2, .tp_canonical = true, .expert_parallel = ep};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &o, N_BLOCKS, BLOCK, 4, &r, NULL, err, sizeof err),
                         TSR_E_UNSUPPORTED);
        print_message("%s at tp 2%s: %s\n", rel, ep ? " (expert parallel)" : "", err);
        if (!strstr(err, want))
                fail_msg("%s: %s", rel, err);
        model_close(&mc);
}

/* Tensor parallelism on ModelOpt checkpoints, every linear kept as stored: each rank
 * reads its rows and K columns of the fp8 bytes (a Llama 4 FP8 expert stack whole, then
 * the rank's columns of each expert), and the logits are bitwise TP = 1's in the
 * canonical split, on both kernel sets: the tiny Llama (TP 2, 4 > its 2 KV heads, 2 x PP
 * 2), NemotronH ("ME*M-E": Mamba mixer, attention, experts, shared expert, MLP; TP 2,
 * 2 x PP 2) and Llama 4 (TP 2, 4, 2 x PP 2), and both MoE families in NVFP4 on the wide
 * fixtures (tests/fixtures/wide-nemotron-h-nvfp4, wide-llama4-nvfp4: every row-parallel
 * quantized linear's K a multiple of 128).
 * The narrow NVFP4 twins are too narrow for blocks of 16: refused at tp 2, naming the
 * tensor (the Llama's and Llama 4's o_proj: 8 columns a canonical slice; NemotronH's
 * shared expert: 24 columns a rank, at the load), and the tiny Llama's runs unsplit at
 * tp 1.  --enable-expert-parallel: each rank holds its experts' fp8 / nvfp4 bytes whole
 * (NemotronH 2 x PP 1 and 2, FP8 and NVFP4; Llama 4 2 and 4, FP8 and NVFP4), the same
 * bits (an NVFP4 rank takes the max input scale over every expert, as vLLM's
 * global-scale backends). */
static void test_modelopt_tp(void **state) {
        (void)state;
        static const uint32_t llama_pp[] = {1, 1}, nh_pp[] = {3, 3}, l4_pp[] = {2, 2};
        static const tp_case llama_cases[] = {{2, 1, NULL}, {4, 1, NULL}, {2, 2, llama_pp}};
        /* expert parallel too: at ep 2 each half of NemotronH's experts holds its layer's
         * largest input scales (the fixture gives an expert no calibration token reached
         * the largest), and Llama 4's FP8 stacks have one scale pair: the max over a rank's
         * experts is the max over all, the bits TP = 1's (test_nemotron_h.py checks
         * a rank's own max against the emulation where they differ) */
        static const tp_case nh_cases[] = {{2, 1, NULL}, {2, 2, nh_pp}, {2, 1, NULL, true}, {2, 2, nh_pp, true}};
        static const tp_case l4_cases[] = {{2, 1, NULL}, {4, 1, NULL}, {2, 2, l4_pp}, {2, 1, NULL, true},
                                           {4, 1, NULL, true}};
        static const struct {
                const char *rel, *family;
                tp_run_fn run;
                size_t rows;
                const tp_case *cases;
                size_t n;
        } fp8[] = {
                {"tests/fixtures/tiny-modelopt/fp8", "llama", run_steps_tp, 13, llama_cases,
                 sizeof llama_cases / sizeof llama_cases[0]},
                {"tests/fixtures/tiny-nemotron-h-fp8/model", "nemotron_h", run_hybrid_f32, H_ROWS, nh_cases,
                 sizeof nh_cases / sizeof nh_cases[0]},
                {"tests/fixtures/tiny-llama4-modelopt/fp8", "llama4", run_hybrid_f32, H_ROWS, l4_cases,
                 sizeof l4_cases / sizeof l4_cases[0]},
                {"tests/fixtures/wide-nemotron-h-nvfp4/model", "nemotron_h", run_hybrid_f32, H_ROWS, nh_cases,
                 sizeof nh_cases / sizeof nh_cases[0]},
                {"tests/fixtures/wide-llama4-nvfp4/nvfp4", "llama4", run_hybrid_f32, H_ROWS, l4_cases,
                 sizeof l4_cases / sizeof l4_cases[0]},
        };
        for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; i++) {
                model_case mc = {0};
                if (!model_open_family(&mc, fp8[i].rel, fp8[i].family))
                        fail_msg("%s is a committed fixture: run from the source tree", fp8[i].rel);
                compare_tp(&mc, fp8[i].rel, fp8[i].run, fp8[i].rows, fp8[i].cases, fp8[i].n);
                model_close(&mc);
        }
        expect_tp2_refused("tests/fixtures/tiny-modelopt/nvfp4", "llama",
                           false, "tensor parallelism: o_proj of layer 0 is nvfp4, whose blocks of 16 elements the "
                                  "canonical split's 8 columns per slice would cut (4 slices a rank)");
        expect_tp2_refused("tests/fixtures/tiny-nemotron-h-nvfp4/model", "nemotron_h", false,
                           "tensor 'backbone.layers.1.mixer.shared_experts.down_proj.weight': its tensor-parallel "
                           "share (columns 0..23) does not fall on whole nvfp4 blocks of 16 elements");
        expect_tp2_refused("tests/fixtures/tiny-llama4-modelopt/nvfp4", "llama4", false,
                           "tensor parallelism: o_proj of layer 0 is nvfp4, whose blocks of 16 elements the "
                           "canonical split's 8 columns per slice would cut");
        /* NVFP4 under expert parallelism: both MoE families read every expert's input
         * scale (the wide fixtures above: bitwise tp 1), so the narrow ones fail as without
         * the flag, on what the flag leaves cut */
        expect_tp2_refused("tests/fixtures/tiny-nemotron-h-nvfp4/model", "nemotron_h", true,
                           "tensor 'backbone.layers.1.mixer.shared_experts.down_proj.weight': its tensor-parallel "
                           "share (columns 0..23) does not fall on whole nvfp4 blocks of 16 elements");
        expect_tp2_refused("tests/fixtures/tiny-llama4-modelopt/nvfp4", "llama4", true,
                           "tensor parallelism: o_proj of layer 0 is nvfp4, whose blocks of 16 elements the "
                           "canonical split's 8 columns per slice would cut");

        /* the narrow NVFP4 Llama at tp 1: the canonical split does not apply, it runs unsplit */
        model_case mc = {0};
        tsr_runner *r = NULL;
        char err[512] = "";
        if (!model_open(&mc, "tests/fixtures/tiny-modelopt/nvfp4"))
                fail_msg("the tiny ModelOpt fixture is committed: run from the source tree");
        tsr_runner_opts o = {.dtype = "float32", .backend = mc.be, .stage_threads = 1, .pp_timeout_ms = 60000,
                             .tp = 1, .tp_canonical = true};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &o, N_BLOCKS, BLOCK, 0, &r, NULL, err, sizeof err), TSR_OK);
        tsr_runner_free(&r);
        model_close(&mc);
}

/* What the ranks hold after a tensor- or expert-parallel split, for every family: the
 * load reads whole tensors, then each rank keeps its share, and the runner's total
 * resident bytes (the worker's "loaded" line and tessera:worker_weight_bytes) count the
 * shares, not the reads: at tp 2 more than one copy (norms and routers are whole on
 * every rank) but well under two.  The embedding is vocabulary-parallel: the two ranks
 * together hold less than half a table more than tp 1 (a whole table on each rank would
 * be one more). */
static void test_tp_resident_bytes(void **state) {
        (void)state;
        static const struct { const char *rel, *family; bool ep; } cases[] = {
                {"tests/fixtures/tiny-llama3-hf/f32", "llama", false},
                {"tests/fixtures/tiny-llama4", "llama4", false},
                {"tests/fixtures/tiny-llama4", "llama4", true},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", false},
                {"tests/fixtures/tiny-nemotron-h/model", "nemotron_h", true},
                /* fp8 experts as stored, each expert-parallel rank its own */
                {"tests/fixtures/tiny-nemotron-h-fp8/model", "nemotron_h", true},
                {"tests/fixtures/tiny-llama4-modelopt/fp8", "llama4", true},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                model_case mc = {0};
                tsr_load_stats one = {0}, two = {0};
                tsr_runner *r = NULL;
                char err[512] = "";
                if (!model_open_family(&mc, cases[c].rel, cases[c].family))
                        fail_msg("%s is a committed fixture: run from the source tree", cases[c].rel);
                for (uint32_t tp = 1; tp <= 2; tp++) {
                        tsr_runner_opts o = {.dtype = "float32", .backend = mc.be, .stage_threads = 1,
                                             .pp_timeout_ms = 60000, .tp = tp, .expert_parallel = cases[c].ep};
                        if (tsr_runner_new(mc.path, &mc.desc, &o, N_BLOCKS, BLOCK, 4, &r, tp == 1 ? &one : &two, err,
                                           sizeof err) != TSR_OK)
                                fail_msg("%s tp %u: %s", mc.path, tp, err);
                        tsr_runner_free(&r);
                }
                print_message("%s%s: resident %llu bytes at tp 1, %llu over the 2 ranks at tp 2 (%.2fx); read as "
                              "float32 %llu, %llu\n", cases[c].rel, cases[c].ep ? " (expert parallel)" : "",
                              (unsigned long long)one.resident_bytes, (unsigned long long)two.resident_bytes,
                              (double)two.resident_bytes / (double)one.resident_bytes,
                              (unsigned long long)one.f32_bytes, (unsigned long long)two.f32_bytes);
                assert_true(two.resident_bytes > one.resident_bytes);
                assert_true(two.resident_bytes < one.resident_bytes * 3 / 2);
                uint64_t table = (uint64_t)mc.desc.vocab_size * mc.desc.hidden_size * sizeof(float);
                assert_true(two.resident_bytes - one.resident_bytes < table / 2);
                /* each rank read its share from the file (under expert parallelism its
                 * routed experts whole, no other's) and kept all it read: under 1.5 whole
                 * reads (the norms and routers are whole) */
                assert_true(two.f32_bytes < 2 * one.f32_bytes * 3 / 4);
                /* (a quantized model keeps its fp8 bytes: less resident than float32) */
                assert_true(two.f32_bytes <= two.resident_bytes || strstr(cases[c].rel, "fp8"));
                model_close(&mc);
        }
}

/* The vocabulary-parallel embedding (tsr_tp_embed) on its own, rank threads on a local
 * comm: a table whose rows hold -0.0f, +0.0f, a denormal and ordinary values, looked up
 * at tp 2 and 4 with each rank holding only its rows (150 padded to 192: 96 + 54 at tp
 * 2, 48 x 3 + 6 at tp 4), gives every rank the bits of the whole-table lookup, the sign
 * of every zero included (a rank's +0.0f fill would turn the owner's -0.0f into +0.0f);
 * a token >= vocab is refused on every rank before any collective (no rank hangs).  And
 * the split itself, vLLM's (pad_vocab_size, then equal parts): a few vocabularies'
 * shares, and the one too small to split. */
enum { EMB_V = 150, EMB_DIM = 5, EMB_ROWS = 9 };

typedef struct emb_share {
        const float *rows;      /* the rank's (n, EMB_DIM) rows */
        size_t n;
} emb_share;

static tsr_status emb_gather(const void *model, tsr_backend *be, float *x, const uint32_t *ids, size_t rows) {
        const emb_share *sh = model;
        (void)be;
        for (size_t r = 0; r < rows; r++) {
                if (ids[r] >= sh->n)
                        return TSR_E_INVAL;
                memcpy(x + r * EMB_DIM, sh->rows + (size_t)ids[r] * EMB_DIM, EMB_DIM * sizeof(float));
        }
        return TSR_OK;
}

typedef struct emb_rank {
        tsr_comm_local_group *g;
        int rank, size;
        const float *table;
        const uint32_t *tokens;
        size_t rows;
        float x[EMB_ROWS * EMB_DIM];
        tsr_status st;
} emb_rank;

static void *emb_rank_main(void *p) {
        emb_rank *e = p;
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_LOCAL, .rank = e->rank, .size = e->size, .timeout_ms = 10000,
                           .local = e->g};
        tsr_comm *c = NULL;
        tsr_backend *be = NULL;
        char err[256];
        tsr_tp_vocab v = tsr_tp_vocab_of(EMB_V, (uint32_t)e->rank, (uint32_t)e->size);
        emb_share sh = {e->table + v.first * EMB_DIM, v.n};
        if ((e->st = tsr_comm_new(&d, &c, err, sizeof err)) != TSR_OK ||
            (e->st = tsr_backend_cpu_ref_new(&be)) != TSR_OK) {
                tsr_comm_free(&c);
                return NULL;
        }
        e->st = tsr_tp_embed(c, (uint32_t)e->rank, (uint32_t)e->size, EMB_V, EMB_DIM, e->tokens, e->rows, e->x,
                             emb_gather, &sh, be);
        tsr_backend_free(&be);
        tsr_comm_free(&c);
        return NULL;
}

static void emb_run(int n, const float *table, const uint32_t *tokens, size_t rows, emb_rank *ranks) {
        tsr_comm_local_group *g = NULL;
        pthread_t th[4];
        assert_int_equal(tsr_comm_local_group_new(n, &g), TSR_OK);
        for (int q = 0; q < n; q++) {
                ranks[q] = (emb_rank){.g = g, .rank = q, .size = n, .table = table, .tokens = tokens, .rows = rows};
                memset(ranks[q].x, 0x7f, sizeof ranks[q].x);
                assert_int_equal(pthread_create(&th[q], NULL, emb_rank_main, &ranks[q]), 0);
        }
        for (int q = 0; q < n; q++)
                pthread_join(th[q], NULL);
        tsr_comm_local_group_unref(&g);
}

static void test_tp_embed(void **state) {
        (void)state;
        float table[EMB_V * EMB_DIM];
        static const uint32_t tokens[EMB_ROWS] = {0, 149, 3, 96, 95, 144, 47, 48, 120};
        static const uint32_t bad[2] = {2, EMB_V};
        float want[EMB_ROWS * EMB_DIM];
        emb_rank ranks[4];
        for (size_t i = 0; i < EMB_V * EMB_DIM; i++)
                table[i] = (float)((int)(i * 7 % 11) - 5) * 0.375f;
        for (uint32_t v = 0; v < EMB_V; v += 3) {       /* signed zeros and a denormal in every third row */
                table[v * EMB_DIM] = -0.0f;
                table[v * EMB_DIM + 1] = 0.0f;
                table[v * EMB_DIM + 2] = -1e-40f;
        }
        for (size_t r = 0; r < EMB_ROWS; r++)
                memcpy(want + r * EMB_DIM, table + (size_t)tokens[r] * EMB_DIM, sizeof(float) * EMB_DIM);
        for (int n = 1; n <= 4; n *= 2) {
                emb_run(n, table, tokens, EMB_ROWS, ranks);
                for (int q = 0; q < n; q++) {
                        assert_int_equal(ranks[q].st, TSR_OK);
                        if (memcmp(ranks[q].x, want, sizeof want) != 0)
                                fail_msg("tp %d rank %d: the embedding rows differ from the whole table's", n, q);
                }
                emb_run(n, table, bad, 2, ranks);
                for (int q = 0; q < n; q++)
                        assert_int_equal(ranks[q].st, TSR_E_INVAL);
        }
        print_message("tsr_tp_embed: %d rows (signed zeros, a denormal) bitwise the whole table's at tp 1, 2, 4\n",
                      EMB_ROWS);
        /* vLLM's split: 32001 pads to 32064, 4008 rows a rank at tp 8, the last 3945 */
        static const struct { size_t vocab; uint32_t rank, tp; size_t first, n, per; } split[] = {
                {32001, 0, 8, 0, 4008, 4008},   {32001, 7, 8, 28056, 3945, 4008},
                {128256, 3, 8, 48096, 16032, 16032}, {300, 1, 2, 160, 140, 160},
                {300, 3, 4, 240, 60, 80},       {49152, 1, 1, 49152, 0, 49152},  /* a bad rank: nothing */
                {100, 7, 8, 100, 0, 16},                                          /* too small: none left */
        };
        for (size_t i = 0; i < sizeof split / sizeof split[0]; i++) {
                tsr_tp_vocab v = tsr_tp_vocab_of(split[i].vocab, split[i].rank, split[i].tp);
                if (split[i].rank >= split[i].tp) {
                        assert_int_equal(v.n, 0);
                        assert_int_equal(v.per, 0);
                        continue;
                }
                if (v.first != split[i].first || v.n != split[i].n || v.per != split[i].per)
                        fail_msg("vocab %zu rank %u of %u: [%zu, +%zu) of %zu, want [%zu, +%zu) of %zu",
                                 split[i].vocab, split[i].rank, split[i].tp, v.first, v.n, v.per, split[i].first,
                                 split[i].n, split[i].per);
        }
        char err[256] = "";
        assert_int_equal(tsr_tp_check_split(8, 8, 8, 100, err, sizeof err), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "too small to split"));
        assert_int_equal(tsr_tp_check_split(8, 8, 8, 32001, err, sizeof err), TSR_OK);
}

/* Bad stage arguments: no layer split, or more stages than the model has layers (the
 * loader refuses the empty range; main.c refuses pp > layers before it gets here). */
static void test_runner_refuses(void **state) {
        (void)state;
        model_case mc = {0};
        tsr_runner *r = NULL;
        char err[512] = "";
        static const uint32_t three[] = {1, 1, 1};
        if (!model_open(&mc, "tests/fixtures/tiny-llama3-hf/f32"))
                fail_msg("the tiny Llama 3 fixture is committed: run from the source tree");
        tsr_runner_opts o = {.dtype = "float32", .backend = mc.be, .pp = 2, .pp_layers = NULL};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &o, 4, BLOCK, 0, &r, NULL, err, sizeof err), TSR_E_INVAL);
        /* more stages than layers: the loader refuses the range (main.c refuses it first) */
        o.pp = 3;
        o.pp_layers = three;
        o.stage_threads = 1;
        assert_int_not_equal(tsr_runner_new(mc.path, &mc.desc, &o, 4, BLOCK, 0, &r, NULL, err, sizeof err), TSR_OK);
        assert_null(r);
        /* TP: 3 does not split 8 partial sums or 4 heads, with or without pipeline stages */
        tsr_runner_opts t = {.dtype = "float32", .backend = mc.be, .tp = 3, .stage_threads = 1};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &t, 4, BLOCK, 0, &r, NULL, err, sizeof err),
                         TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "tensor parallel size 3 does not split this model"));
        static const uint32_t two[] = {1, 1};
        t = (tsr_runner_opts){.dtype = "float32", .backend = mc.be, .tp = 3, .pp = 2, .pp_layers = two,
                              .stage_threads = 1};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &t, 4, BLOCK, 0, &r, NULL, err, sizeof err),
                         TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "tensor parallel size 3 does not split this model"));
        assert_null(r);
        /* more ranks than a worker holds */
        t = (tsr_runner_opts){.dtype = "float32", .backend = mc.be, .tp = 64, .pp = 2, .pp_layers = two,
                              .stage_threads = 1};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &t, 4, BLOCK, 0, &r, NULL, err, sizeof err), TSR_E_INVAL);
        assert_non_null(strstr(err, "at most 64 ranks in one worker"));
        /* TP on bfloat16 weights runs (test_tp_bf16) */
        t = (tsr_runner_opts){.dtype = "bfloat16", .backend = mc.be, .tp = 2, .stage_threads = 1};
        assert_int_equal(tsr_runner_new(mc.path, &mc.desc, &t, 4, BLOCK, 0, &r, NULL, err, sizeof err), TSR_OK);
        assert_string_equal(tsr_runner_dtype(r), "bfloat16");
        tsr_runner_free(&r);
        model_close(&mc);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_partition),
                cmocka_unit_test(test_pipeline_toy),
                cmocka_unit_test(test_pipeline_micro_batches),
                cmocka_unit_test(test_pipeline_deadline),
                cmocka_unit_test(test_pipeline_tensor),
                cmocka_unit_test(test_pipeline_grid),
                cmocka_unit_test(test_tiny_llama3_pp),
                cmocka_unit_test(test_smollm2_pp),
                cmocka_unit_test(test_tiny_llama3_tp),
                cmocka_unit_test(test_llama_4layers_tp_pp),
                cmocka_unit_test(test_gguf_f16_tp),
                cmocka_unit_test(test_runner_refuses),
                cmocka_unit_test(test_llama4_pp),
                cmocka_unit_test(test_llama4_tp),
                cmocka_unit_test(test_llama4_ep),
                cmocka_unit_test(test_nemotron_h_ep),
                cmocka_unit_test(test_expert_range),
                cmocka_unit_test(test_tp_embed),
                cmocka_unit_test(test_fp8_kv_vs_emulation),
                cmocka_unit_test(test_tp_resident_bytes),
                cmocka_unit_test(test_tp_bf16),
                cmocka_unit_test(test_llama4_device),
                cmocka_unit_test(test_nemotron_h_device),
                cmocka_unit_test(test_llama_device),
                cmocka_unit_test(test_stored_slices),
                cmocka_unit_test(test_modelopt_tp),
                cmocka_unit_test(test_gguf_q8_0_tp),
                cmocka_unit_test(test_nemotron_h_pp),
                cmocka_unit_test(test_nemotron_h_tp),
                cmocka_unit_test(test_nemotron_h_tp_one_group),
                cmocka_unit_test(test_nemotron_h_tp_one_group_gguf),
                cmocka_unit_test(test_hybrid_stage_args),
                cmocka_unit_test(test_hybrid_tp_refused),
                cmocka_unit_test(test_fp8_kv_parallel),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
