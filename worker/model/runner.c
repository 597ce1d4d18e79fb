/* runner.c - a model of a registered family (worker/model/family.h) on the CPU kernels,
 * as an tsr_engine_model: the family's load and forward entry points, called through its table. */
#include "worker/model/runner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/kernels.h"
#include "worker/engine/kv_pool.h"
#include "worker/load/modelopt.h"
#include "worker/parallel/nodes.h"
#include "worker/parallel/pipeline.h"

/* One rank: a pipeline stage's layers (or its tensor-parallel shard of them), its
 * backend and its share of the KV cache (the same block ids on every rank, each storing
 * its own layers' and heads').  Without parallelism the runner has one rank holding the
 * whole model. */
typedef struct stage {
        void *model;               /* the family's model (Llama: tsr_llama) of the rank's layers and shard */
        tsr_backend *be;           /* stage 0: borrowed from the caller (tsr_runner_opts); others: owned */
        tsr_kv_pool *kv_memory;    /* the stage's layers' KV, per layer group, indexed by the engine's block ids */
        void *pool;                /* the family's view of kv_memory */
} stage;

/* What every stage reads of one step (tsr_pipeline_step.plan). */
typedef struct step_plan {
        const char *seqs;          /* the family's sequence records [n_seqs] */
        size_t n_seqs;
        uint64_t step;             /* the runner's step count, for the test hook below */
} step_plan;

struct tsr_runner {
        const tsr_model_family *fam;
        uint32_t pp, tp;           /* pipeline stages x tensor-parallel ranks per stage */
        uint32_t n_stages;         /* ranks: pp x tp; stages[stage x tp + tp_rank] (pipeline.h) */
        stage stages[TSR_RUNNER_MAX_STAGES];
        tsr_pipeline *pipe;        /* n_stages > 1 */
        /* A node of a multi-node replica: the stages held here are node_stage ..
         * node_stage + node_stages - 1 of pp, as a grid of node_stages x tp ranks; on
         * node 0, `nodes` runs the others (borrowed). */
        bool node_mode;
        uint32_t node_stage, node_stages;
        struct tsr_nodes *nodes;
        uint32_t hidden;           /* desc->hidden_size: a stage hands 2 x tokens x hidden floats on */
        uint64_t steps;            /* forwards run; engine's forward thread only */
        /* TESSERA_TEST_PP_ABORT_AT_STEP=N (tests only, docs/testing.md): the last stage
         * aborts the pipeline's comm at its N-th step, as a failing peer would. */
        uint64_t abort_at;
        /* TESSERA_TEST_HANG_AT_STEP=N (tests only, docs/testing.md): the N-th forward never
         * returns, as a wedged kernel or device would; the engine thread's systemd watchdog
         * pings stop, so WatchdogSec restarts the worker. */
        uint64_t hang_at;
        /* a model on a device answering rows there (answer.h): the rows of the steps so
         * far, logged when the runner goes (engine's forward thread only) */
        bool answers_on_device;
        uint64_t rows_as_token, rows_with_lp, rows_with_rules, rows_prompt_lp, rows_whole;
        tsr_engine_model em;
        /* Micro-batches (pp > 1 in this process: em.submit): the steps in the pipeline,
         * oldest first, each with its sequence records and plan, alive until its wait. */
        struct queued_step {
                step_plan pl;
                tsr_pipeline_step step;
                float *logits;
        } queued[TSR_RUNNER_MAX_STAGES];
        uint32_t queued_head, queued_n;
        tsr_modelopt_config mo;    /* what a Hugging Face folder announces (worker/load/modelopt.h) */
        uint64_t kv_blocks;        /* allocated on every stage */
};

/* Rank `rank`'s part of a step, on its thread (rank 0: the engine's): its stage's layers
 * on its shard, meeting its stage's other tp ranks in `comm` (its TP group). */
static tsr_status stage_run(void *ud, uint32_t rank, const tsr_pipeline_step *step, const float *in, float *out,
                            struct tsr_comm *comm) {
        tsr_runner *r = ud;
        const step_plan *pl = step->plan;
        const stage *sg = &r->stages[rank];
        /* the model's stage: a node of a multi-node replica holds node_stages of them */
        uint32_t s = (r->node_mode ? r->node_stage : 0) + rank / r->tp;
        bool last = s + 1 == r->pp;

        if (last && r->abort_at && pl->step == r->abort_at)
                tsr_pipeline_abort(r->pipe);
        if (r->tp > 1)
                r->fam->tp_set_comm(sg->model, comm);
        if (r->pp == 1)         /* TP only: the whole step on the rank's shard */
                return r->fam->forward_batch(sg->model, sg->be, sg->pool, pl->seqs, pl->n_seqs, out);
        return r->fam->forward_stage(sg->model, sg->be, sg->pool, pl->seqs, pl->n_seqs, s > 0 ? in : NULL,
                                     last ? NULL : out, last ? out : NULL);
}

/* The family's sequence records of the engine's, in a new buffer (free()); NULL: no memory. */
static char *fill_seqs(const tsr_runner *r, const tsr_engine_seq *seqs, size_t n_seqs) {
        char *ls = malloc(n_seqs ? n_seqs * r->fam->seq_size : 1);   /* one small allocation per step */
        if (!ls)
                return NULL;
        for (size_t i = 0; i < n_seqs; i++)
                r->fam->seq_fill(ls + i * r->fam->seq_size, seqs[i].block_table, seqs[i].n_table, seqs[i].tokens,
                                 seqs[i].n, seqs[i].past_len, seqs[i].want_logits, seqs[i].want_all_logits);
        if (r->fam->seq_set_state)
                for (size_t i = 0; i < n_seqs; i++)
                        r->fam->seq_set_state(ls + i * r->fam->seq_size, seqs[i].state_slot,
                                              seqs[i].restore_state ? &seqs[i].restore_from : NULL, seqs[i].saves,
                                              seqs[i].n_saves, seqs[i].prompt_len);
        return ls;
}

/* This node's stages of a multi-node step (node_mode): `in` from the previous node (NULL
 * on node 0), into `out` (the next node's input, or the logits rows on the last node);
 * with several stages or tp > 1 on this node's grid of rank threads.  Engine thread
 * (node 0) or the follower's main thread. */
static tsr_status node_stage_run(tsr_runner *r, const tsr_engine_seq *seqs, const char *ls, size_t n_seqs,
                                 const float *in, float *out) {
        const stage *sg = &r->stages[0];
        bool last = r->node_stage + r->node_stages == r->pp;
        if (!r->pipe)
                return r->fam->forward_stage(sg->model, sg->be, sg->pool, ls, n_seqs, r->node_stage ? in : NULL,
                                             last ? NULL : out, last ? out : NULL);
        size_t n_tokens, rows;
        tsr_engine_step_size(seqs, n_seqs, &n_tokens, &rows);
        step_plan pl = {.seqs = ls, .n_seqs = n_seqs, .step = r->steps};
        size_t io = 2 * n_tokens * r->hidden;
        tsr_pipeline_step step = {.plan = &pl, .io_floats = io, .out_floats = last ? rows * r->em.vocab : io,
                                  .in = r->node_stage ? in : NULL};
        return tsr_pipeline_run(r->pipe, &step, out);
}

/* Node 0's stage of a multi-node step (tsr_nodes_step's stage0). */
typedef struct node0_step {
        tsr_runner *r;
        const tsr_engine_seq *seqs;
        const char *ls;
        size_t n_seqs;
} node0_step;

static tsr_status node0_stage(void *ud, float *act) {
        const node0_step *q = ud;
        return node_stage_run(q->r, q->seqs, q->ls, q->n_seqs, NULL, act);
}

static tsr_status runner_submit(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits);
static tsr_status runner_wait(void *ud);

/* Micro-batches (vLLM's batch queue, max_concurrent_batches = pp): up to k steps in
 * flight, k = TESSERA_PP_MAX_IN_FLIGHT (1 .. pp), else `dflt`: pp on node 0 of a
 * multi-node replica (each node computes on its own cores: two nodes with a core each
 * served 43-47% more with them), 1 for stages in this process (rank threads sharing the
 * same cores, where two steps at once only split the batch and the cores: -pp 2 lost
 * 4-24%).  docs/benchmarks.md, "Pipeline micro-batches". */
static void micro_batches_setup(tsr_runner *r, unsigned long dflt) {
        const char *cap = getenv("TESSERA_PP_MAX_IN_FLIGHT");
        unsigned long k = cap && *cap ? strtoul(cap, NULL, 10) : dflt;
        if (r->pp < 2 || k < 2)
                return;
        r->em.max_in_flight = (uint32_t)(k < r->pp ? k : r->pp);
        r->em.submit = runner_submit;
        r->em.wait = runner_wait;      /* the engine says whether it uses them */
}

static uint64_t runner_kv_generation(void *ud) { return tsr_nodes_generation(((tsr_runner *)ud)->nodes); }
static bool runner_kv_renewal_pending(void *ud) { return tsr_nodes_renewal_pending(((tsr_runner *)ud)->nodes); }
static bool runner_available(void *ud) { return tsr_nodes_up(((tsr_runner *)ud)->nodes); }
static void runner_idle(void *ud) { tsr_nodes_idle(((tsr_runner *)ud)->nodes); }

void tsr_runner_set_nodes(tsr_runner *r, struct tsr_nodes *nodes) {
        r->nodes = nodes;
        r->em.kv_generation = nodes ? runner_kv_generation : NULL;
        r->em.kv_renewal_pending = nodes ? runner_kv_renewal_pending : NULL;
        r->em.available = nodes ? runner_available : NULL;
        r->em.idle = nodes ? runner_idle : NULL;
        /* the last node answers logprobs with the token (nodes.c lp_back) */
        r->em.answers_logprobs = nodes && r->em.vocab >= TSR_NODES_LP_MIN_VOCAB;
        r->em.answers_rules = nodes;
        r->em.answers_masks = nodes;
        if (nodes)
                micro_batches_setup(r, r->pp);
}

tsr_status tsr_runner_run_stage(tsr_runner *r, const tsr_engine_seq *seqs, size_t n_seqs, const float *in,
                                float *out) {
        char *ls = fill_seqs(r, seqs, n_seqs);
        if (!ls)
                return TSR_E_NOMEM;
        r->steps++;
        tsr_status st = node_stage_run(r, seqs, ls, n_seqs, in, out);
        free(ls);
        return st;
}

/* What the device answered of a step's rows (answer.h), for the closing log line. */
static void count_answers(tsr_runner *r, const tsr_engine_seq *seqs, size_t n_seqs) {
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *q = &seqs[i];
                size_t rows = tsr_engine_seq_rows(q), plp = tsr_engine_seq_prompt_lp_rows(q);
                if (q->token && *q->token != TSR_ENGINE_TOKEN_UNSET) {
                        r->rows_as_token++;
                        r->rows_with_lp += q->lp != NULL;
                        r->rows_with_rules += q->rules != NULL;
                        continue;
                }
                r->rows_prompt_lp += plp;
                r->rows_whole += rows - plp;
        }
}

/* The whole step in one batched forward: each weight matrix is read once for every
 * sequence in the step.  With pipeline stages, the step goes through every stage in
 * turn (tsr_pipeline_run), the logits coming back from the last. */
static tsr_status runner_forward(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        tsr_runner *r = ud;
        char *ls = fill_seqs(r, seqs, n_seqs);
        size_t n_tokens, rows;
        tsr_status st;
        if (!ls)
                return TSR_E_NOMEM;
        r->steps++;
        if (r->hang_at && r->steps == r->hang_at) {
                log_warn("TESSERA_TEST_HANG_AT_STEP=%llu: this forward hangs (a test)", (unsigned long long)r->hang_at);
                for (;;)
                        sleep(3600);
        }
        tsr_engine_step_size(seqs, n_seqs, &n_tokens, &rows);
        if (r->nodes) {
                node0_step q = {.r = r, .seqs = seqs, .ls = ls, .n_seqs = n_seqs};
                st = tsr_nodes_step(r->nodes, seqs, n_seqs, 2 * n_tokens * r->hidden, rows * r->em.vocab, node0_stage,
                                    &q, logits);
        } else if (r->n_stages == 1) {
                /* one process, one rank: a device answers rows as their token (answer.h) */
                if (r->fam->seq_set_answer)
                        for (size_t i = 0; i < n_seqs; i++)
                                r->fam->seq_set_answer(ls + i * r->fam->seq_size, &seqs[i]);
                st = r->fam->forward_batch(r->stages[0].model, r->stages[0].be, r->stages[0].pool, ls, n_seqs,
                                           logits);
                if (st == TSR_OK && r->answers_on_device)
                        count_answers(r, seqs, n_seqs);
        } else {
                step_plan pl = {.seqs = ls, .n_seqs = n_seqs, .step = r->steps};
                tsr_pipeline_step step = {.plan = &pl, .io_floats = r->pp > 1 ? 2 * n_tokens * r->hidden : 0,
                                          .out_floats = rows * r->em.vocab};
                st = tsr_pipeline_run(r->pipe, &step, logits);
        }
        free(ls);
        return st;
}

/* Micro-batches: the step goes in (stage 0 runs here: this process's stages, or node 0's
 * part of a multi-node replica) and stays in the pipeline until runner_wait; up to pp of
 * them at once.  Engine thread. */
static tsr_status runner_submit(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        tsr_runner *r = ud;
        size_t n_tokens, rows;
        tsr_status st;
        if (r->queued_n == r->pp)
                return TSR_E_INVAL;
        struct queued_step *q = &r->queued[(r->queued_head + r->queued_n) % r->pp];
        char *ls = fill_seqs(r, seqs, n_seqs);
        if (!ls)
                return TSR_E_NOMEM;
        r->steps++;
        tsr_engine_step_size(seqs, n_seqs, &n_tokens, &rows);
        q->pl = (step_plan){.seqs = ls, .n_seqs = n_seqs, .step = r->steps};
        q->step = (tsr_pipeline_step){.plan = &q->pl, .io_floats = 2 * n_tokens * r->hidden,
                                      .out_floats = rows * r->em.vocab};
        q->logits = logits;
        if (r->nodes) {         /* the followers hold the plan now: node 0 is done with ls */
                node0_step n0 = {.r = r, .seqs = seqs, .ls = ls, .n_seqs = n_seqs};
                st = tsr_nodes_submit(r->nodes, seqs, n_seqs, q->step.io_floats, q->step.out_floats, node0_stage,
                                      &n0);
                free(ls);
                q->pl.seqs = NULL;
        } else {
                st = tsr_pipeline_submit(r->pipe, &q->step, logits);
                if (st != TSR_OK)
                        free(ls);
        }
        if (st != TSR_OK)
                return st;
        r->queued_n++;
        return TSR_OK;
}

static tsr_status runner_wait(void *ud) {
        tsr_runner *r = ud;
        if (r->queued_n == 0)
                return TSR_E_INVAL;
        struct queued_step *q = &r->queued[r->queued_head];
        tsr_status st = r->nodes ? tsr_nodes_wait(r->nodes, q->step.out_floats, q->logits)
                                 : tsr_pipeline_wait(r->pipe, &q->step, q->logits);
        free((char *)q->pl.seqs);
        q->pl.seqs = NULL;
        r->queued_head = (r->queued_head + 1) % r->pp;
        r->queued_n--;
        return st;
}

/* Every 64th tensor and the last: tensors and file bytes read so far, and the rate
 * (file bytes over the seconds since the load began, dequantizing included). */
static void progress(void *ud, const tsr_load_stats *done, const tsr_load_stats *total) {
        (void)ud;
        if (done->n_tensors != total->n_tensors && done->n_tensors % 64 != 0)
                return;
        log_info("loading weights: %zu/%zu tensors, %.1f/%.1f MB (%.0f%%), %.1f MB/s", done->n_tensors,
                 total->n_tensors, (double)done->file_bytes / 1e6, (double)total->file_bytes / 1e6,
                 total->file_bytes ? 100.0 * (double)done->file_bytes / (double)total->file_bytes : 100.0,
                 done->seconds > 0 ? (double)done->file_bytes / 1e6 / done->seconds : 0.0);
}

tsr_status tsr_runner_backend_new(int cpu_threads, tsr_backend **ret, char *err, size_t errlen) {
        const char *kern = getenv("TESSERA_KERNELS");
        tsr_cpu_backend_config cfg = {.n_threads = cpu_threads, .max_isa = TSR_CPU_ISA_AMX_BF16};  /* the best */
        tsr_status st;

        if (kern && *kern && strcmp(kern, "fast") != 0 && strcmp(kern, "ref") != 0 && strcmp(kern, "avx2") != 0 &&
            strcmp(kern, "avx512_bf16") != 0 && strcmp(kern, "amx_bf16") != 0 && strcmp(kern, "devlike") != 0) {
                snprintf(err, errlen, "TESSERA_KERNELS=%s: expected fast, amx_bf16, avx512_bf16, avx2, ref or devlike",
                         kern);
                return TSR_E_INVAL;
        }
        if (kern && strcmp(kern, "ref") == 0) {
                if ((st = tsr_backend_cpu_ref_new(ret)) != TSR_OK)
                        snprintf(err, errlen, "cannot make the reference backend: %s", tsr_status_str(st));
                return st;
        }
        if (kern && strcmp(kern, "avx2") == 0)
                cfg.max_isa = TSR_CPU_ISA_AVX2;
        if (kern && strcmp(kern, "avx512_bf16") == 0)  /* bf16 matmul on VDPBF16PS, not AMX */
                cfg.max_isa = TSR_CPU_ISA_AVX512_BF16;
        st = tsr_backend_cpu_new(&cfg, ret);
        if (st == TSR_E_INVAL) {
                snprintf(err, errlen, "--cpu-threads %d is not valid", cpu_threads);
                return st;
        }
        if (st != TSR_OK) {
                log_warn("kernels: cannot start %d threads (%s); running single-threaded", cpu_threads,
                         tsr_status_str(st));
                cfg.n_threads = 1;      /* starts no thread */
                if ((st = tsr_backend_cpu_new(&cfg, ret)) != TSR_OK)
                        snprintf(err, errlen, "cannot make the CPU backend: %s", tsr_status_str(st));
        }
        return st;
}

tsr_status tsr_runner_backend_for(const char *device, const char *gpu_not_ok, int cpu_threads, tsr_backend **ret,
                                  char *err, size_t errlen) {
        bool want_cuda = device && strcmp(device, "cuda") == 0, want_cpu = device && strcmp(device, "cpu") == 0;
        tsr_status st;

        if (want_cuda && gpu_not_ok) {
                snprintf(err, errlen, "--device cuda: %s", gpu_not_ok);
                return TSR_E_UNSUPPORTED;
        }
        /* TESSERA_KERNELS=devlike: the device path (weights and KV uploaded, graphs
         * captured and replayed) on the reference kernels, where a GPU would be chosen:
         * how CI serves through that path without a GPU. */
        const char *kern = getenv("TESSERA_KERNELS");
        if (kern && strcmp(kern, "devlike") == 0 && !want_cpu && !want_cuda && !gpu_not_ok) {
                if ((st = tsr_backend_cpu_devlike_new(ret)) != TSR_OK) {
                        snprintf(err, errlen, "TESSERA_KERNELS=devlike: %s", tsr_status_str(st));
                        return st;
                }
                log_info("device: cpu-devlike (TESSERA_KERNELS=devlike: the reference kernels behind a device's "
                         "memory, for tests)");
                return TSR_OK;
        }
        if (!want_cpu && !gpu_not_ok) {
                st = tsr_backend_cuda_new(0, ret);
                if (st == TSR_OK) {
                        log_info("device: cuda (GPU 0)%s", want_cuda ? "" : " (--device auto)");
                        return TSR_OK;
                }
                if (want_cuda) {
                        snprintf(err, errlen, "--device cuda: %s",
                                 st == TSR_E_UNSUPPORTED ? "this build has no CUDA backend (nvcc was not found)"
                                 : st == TSR_E_NOTFOUND  ? "no CUDA device (the driver reports none)"
                                                         : tsr_status_str(st));
                        return st;
                }
                log_info("device: cpu (--device auto: %s)", st == TSR_E_UNSUPPORTED ? "this build has no CUDA backend"
                                                            : st == TSR_E_NOTFOUND    ? "no CUDA device"
                                                                                      : tsr_status_str(st));
        } else if (!want_cpu) {
                log_info("device: cpu (--device auto: %s)", gpu_not_ok);
        } else {
                log_info("device: cpu (--device cpu)");
        }
        return tsr_runner_backend_new(cpu_threads, ret, err, errlen);
}

uint64_t tsr_runner_kv_blocks(const tsr_runner *r) { return r ? r->kv_blocks : 0; }

/* Whether --dtype `dtype` (NULL: auto) holds the matmul weights as bfloat16 on `be`: a
 * GPU unless float32 is asked for (as vLLM); cpu-ref only when asked; the fast CPU
 * backends when asked, and under auto where the CPU has dot-product instructions for it
 * (vLLM's CPU platform downcasts float32 checkpoints to bfloat16 unconditionally; here
 * the AVX2 fallback would halve the bytes too, but rounds x through bf16 for no speed-up
 * in compute, so auto keeps float32's fidelity there).  "half" is refused by pick_dtype. */
static bool weights_bf16(const tsr_backend *be, const char *dtype) {
        if (!dtype)
                dtype = "auto";
        if (!tsr_backend_host_memory(be))
                return strcmp(dtype, "float32") != 0 && strcmp(dtype, "float") != 0;
        if (strcmp(tsr_backend_name(be), "cpu-ref") == 0)      /* only TESSERA_KERNELS=ref makes one */
                return strcmp(dtype, "bfloat16") == 0;
        return strcmp(dtype, "bfloat16") == 0 ||
               (strcmp(dtype, "auto") == 0 && tsr_backend_cpu_isa(be) >= TSR_CPU_ISA_AVX512_BF16);
}

tsr_dtype tsr_runner_auto_kv_dtype(const tsr_backend *be, const char *dtype) {
        /* vLLM: "auto" stores the KV cache in the model's dtype. */
        return be && weights_bf16(be, dtype) ? TSR_DTYPE_BF16 : TSR_DTYPE_F32;
}

/* The weight dtype for `opts` on the backend, and the start-up line naming both.  Main
 * thread, at startup. */
static tsr_status pick_dtype(const tsr_runner_opts *opts, bool *bf16, char *err, size_t errlen) {
        const char *dtype = opts->dtype ? opts->dtype : "auto";
        const tsr_backend *be = opts->backend;
        int threads = tsr_backend_threads(be);

        if (strcmp(dtype, "half") == 0 || strcmp(dtype, "float16") == 0) {
                snprintf(err, errlen, "--dtype %s is not supported by the %s backend (use bfloat16 or float32)",
                         dtype, tsr_backend_host_memory(be) ? "CPU" : tsr_backend_name(be));
                return TSR_E_INVAL;
        }
        *bf16 = weights_bf16(be, dtype);
        if (!tsr_backend_host_memory(be)) {
                log_info("kernels: %s, dtype %s%s", tsr_backend_name(be), *bf16 ? "bfloat16" : "float32",
                         strcmp(dtype, "auto") == 0 ? " (--dtype auto)" : "");
                return TSR_OK;
        }
        if (strcmp(tsr_backend_name(be), "cpu-ref") == 0) {
                log_info("kernels: cpu-ref (TESSERA_KERNELS=ref), 1 thread, dtype %s", *bf16 ? "bfloat16" : "float32");
                return TSR_OK;
        }
        log_info("kernels: %s, isa %s, %d thread%s, dtype %s%s", tsr_backend_name(be),
                 tsr_cpu_isa_name(tsr_backend_cpu_isa(be)), threads, threads == 1 ? "" : "s",
                 *bf16 ? "bfloat16" : "float32", strcmp(dtype, "auto") == 0 ? " (--dtype auto)" : "");
        return TSR_OK;
}

/* What the model at `path` announces about quantization, checked against --quantization
 * `flag`, with the start-up line naming it and a warning per exclude_modules entry that
 * matches no tensor (as vLLM warns).  Main thread, at startup. */
static tsr_status quant_config(const char *path, const tsr_model_desc *desc, const char *flag, bool kv_fp8,
                               tsr_modelopt_config *mo, char *err, size_t errlen) {
        tsr_safetensors_set *set = NULL;
        const char *unmatched[8];
        tsr_status st;

        if (desc->gguf) {
                if (!flag)
                        return TSR_OK;
                snprintf(err, errlen, "argument --quantization: '%s' does not apply to a GGUF file (%s): its "
                         "tensors carry their own block types", flag, path);
                return TSR_E_INVAL;
        }
        if ((st = tsr_modelopt_config_read(path, mo, err, errlen)) != TSR_OK)
                return st;
        if ((st = tsr_modelopt_check_flag(mo, flag, path, err, errlen)) != TSR_OK) {
                tsr_modelopt_config_done(mo);
                return st;
        }
        if (mo->algo == TSR_MODELOPT_NONE)
                return TSR_OK;
        log_info("quantization: %s (ModelOpt %s, from %s%s); the quantized weights stay as stored",
                 tsr_modelopt_method(mo->algo), tsr_modelopt_algo_name(mo->algo), mo->source,
                 mo->kv_cache_fp8 && !kv_fp8 ? "; its FP8 KV cache scales are not used: --kv-cache-dtype auto" : "");
        if (tsr_safetensors_set_open(path, &set, err, errlen) == TSR_OK) {
                size_t n = tsr_modelopt_unmatched_excludes(mo, set, unmatched, 8);
                for (size_t i = 0; i < n && i < 8; i++)
                        log_warn("quantization: exclude_modules entry '%s' (%s) matches no module of the checkpoint",
                                 unmatched[i], mo->source);
                tsr_safetensors_set_close(&set);
        }
        return TSR_OK;
}

/* vLLM's KV sizing on a GPU (gpu_worker.determine_available_memory): of the device's
 * total memory times `util`, what is not in use now (after the weights and the kept
 * activations are allocated: everything else the device holds, other processes
 * included, counts as used) becomes KV blocks of `block_bytes`, with vLLM's log line.
 * Called on a device backend with no --kv-cache-memory-bytes or block override. */
static tsr_status device_kv_blocks(tsr_backend *be, double util, uint64_t block_bytes, uint64_t *ret, char *err,
                                   size_t errlen) {
        size_t free_b = 0, total_b = 0;
        tsr_status st = tsr_backend_mem_info(be, &free_b, &total_b);
        double requested, used, avail;

        if (st != TSR_OK || block_bytes == 0) {
                snprintf(err, errlen, "cannot size the KV cache on the %s backend: %s (pass --kv-cache-memory-bytes)",
                         tsr_backend_name(be), st != TSR_OK ? tsr_status_str(st) : "the model has no KV layers");
                return st != TSR_OK ? st : TSR_E_INVAL;
        }
        requested = util * (double)total_b;
        used = (double)(total_b - free_b);
        avail = requested - used;
        log_info("Available KV cache memory: %.2f GiB (gpu_memory_utilization %.2f of %.2f GiB, %.2f GiB in use "
                 "after the weights and activations)", avail > 0 ? avail / (1 << 30) : 0.0, util,
                 (double)total_b / (1 << 30), used / (1 << 30));
        if (avail < (double)block_bytes) {
                snprintf(err, errlen, "No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine. (%.2f GiB in use, %.2f GiB allowed)",
                         used / (1 << 30), requested / (1 << 30));
                return TSR_E_NOMEM;
        }
        *ret = (uint64_t)(avail / (double)block_bytes);
        return TSR_OK;
}

tsr_status tsr_runner_kv_dtype_check(const tsr_model_family *fam, tsr_dtype kv_dtype, const char *flag, char *err,
                                     size_t errlen) {
        const char *where = NULL;

        if (kv_dtype == TSR_DTYPE_F32 || (kv_dtype == TSR_DTYPE_BF16 && fam))  /* every family's paged KV */
                return TSR_OK;
        if (!tsr_dtype_is_fp8(kv_dtype) || !fam)
                where = "for this model";
        else if (!fam->kv_scale_module)
                where = fam->name;
        if (!where)
                return TSR_OK;
        snprintf(err, errlen, "argument --kv-cache-dtype: '%s' is not supported %s%s yet: " TSR_RUNNER_KV_DTYPE_SCOPE
                 " (supported there: auto)", flag ? flag : tsr_dtype_get_info(kv_dtype)->name,
                 fam && where == fam->name ? "for model family " : "", where);
        return TSR_E_UNSUPPORTED;
}

/* The fp8 KV cache's scales of the stage's layers, group by paged group: a ModelOpt
 * checkpoint's k_scale / v_scale where it has them, else the pool's 1.0 with vLLM's
 * warning.  Main thread. */
static tsr_status kv_fp8_scales(const tsr_runner *r, const char *path, const tsr_model_desc *desc,
                                const tsr_shard_spec *shard, tsr_kv_pool *pool, tsr_dtype dtype, char *err,
                                size_t errlen) {
        tsr_safetensors_set *set = NULL;
        uint32_t found = 0, total = 0;
        float lo = INFINITY, hi = 0;
        bool nested;
        char fmt_nested[256];
        tsr_status st = TSR_OK;

        if (!desc->gguf && r->mo.algo != TSR_MODELOPT_NONE &&
            (st = tsr_safetensors_set_open(path, &set, err, errlen)) != TSR_OK)
                return st;
        /* a checkpoint that nests its text model (Llama 4's Llama4ForConditionalGeneration
         * layout) keeps the scales under "language_model.", as the weights (llama4.h) */
        nested = set && tsr_safetensors_set_find(set, "language_model.model.embed_tokens.weight", NULL);
        for (size_t gi = 0; st == TSR_OK && gi < pool->n_groups; gi++) {
                tsr_kv_pool_group *g = &pool->groups[gi];
                if (!tsr_kv_group_paged(&g->spec))
                        continue;
                total += g->spec.n_layers;
                /* layer by layer: the family says where each of the group's layers lives
                 * (NemotronH's attention layers are scattered among its Mamba and MoE ones) */
                for (uint32_t i = 0; set && st == TSR_OK && i < g->spec.n_layers; i++) {
                        uint32_t layer, one = 0;
                        const char *fmt = r->fam->kv_scale_module(desc, shard, (uint32_t)gi, i, &layer);
                        if (nested) {
                                snprintf(fmt_nested, sizeof fmt_nested, "language_model.%s", fmt);
                                fmt = fmt_nested;
                        }
                        st = tsr_modelopt_kv_scales(set, fmt, layer, 1, &g->k_scale[i], &g->v_scale[i], &one, err,
                                                    errlen);
                        found += one;
                }
                for (uint32_t l = 0; l < g->spec.n_layers; l++) {
                        lo = fminf(lo, fminf(g->k_scale[l], g->v_scale[l]));
                        hi = fmaxf(hi, fmaxf(g->k_scale[l], g->v_scale[l]));
                }
        }
        tsr_safetensors_set_close(&set);
        if (st != TSR_OK || total == 0)
                return st;
        const char *fmt_name = tsr_dtype_name(dtype);  /* fp8_e4m3 or fp8_e5m2 */
        if (found == 0) {       /* vLLM's BaseKVCacheMethod warning */
                log_warn("Using KV cache scaling factor 1.0 for %s. If this is unintended, verify that k/v_scale "
                         "scaling factors are properly set in the checkpoint.", fmt_name);
                return TSR_OK;
        }
        log_info("KV cache %s: k_scale / v_scale of %u of %u layers from %s (range %g .. %g)%s", fmt_name, found,
                 total, r->mo.source, (double)lo, (double)hi, found < total ? "; the other layers use 1.0" : "");
        return TSR_OK;
}

/* Load stage `s` (layers `shard`) onto sg->be and allocate its KV.  Main thread. */
static tsr_status stage_load(tsr_runner *r, const char *path, const tsr_model_desc *desc, const tsr_runner_opts *opts,
                             bool *bf16, const tsr_shard_spec *shard, stage *sg, uint64_t num_blocks,
                             uint32_t block_size, uint32_t n_state_slots, tsr_load_stats *stats, char *err,
                             size_t errlen) {
        tsr_shard_spec load = *shard;
        tsr_kv_group groups[TSR_KV_GROUPS_MAX];
        size_t n_groups;
        tsr_status st;

        /* --dtype auto keeps a GGUF file's block-format matmul weights as they are (issue
         * #15: resident bytes = file bytes) wherever the backend's matmul computes on that
         * format; an explicit --dtype float32 or bfloat16 widens them as before (the
         * transformers goldens are float32 math). */
        tsr_load_opts lo = {0};
        if (!opts->dtype || strcmp(opts->dtype, "auto") == 0)
                for (int t = 0; t < TSR_DTYPE_COUNT; t++)
                        if (tsr_dtype_get_info((tsr_dtype)t)->quantized &&
                            tsr_backend_supports(sg->be, TSR_OP_MATMUL, (tsr_dtype)t))
                                lo.keep_dtypes |= 1u << t;
        /* Weights that become bfloat16 anyway (--dtype bfloat16, or auto where the matmul
         * has a bf16 path): a checkpoint's BF16 matmul weights stay as stored, the bits
         * use_bf16 would round their float32 copies back to, with no float32 pass (a
         * family that reads keep_bf16: llama, llama4, nemotron_h). */
        lo.keep_bf16 = *bf16 && tsr_backend_supports(sg->be, TSR_OP_MATMUL, TSR_DTYPE_BF16);
        /* Tensor parallelism (and the canonical split at tp 1): the layers load whole (or
         * as the rank's share), then the family splits them for the rank, before any
         * bfloat16 conversion (the split runs on float32, and, in a tp_quantized family,
         * on the weights kept as stored). */
        bool split = shard->tp_size > 1 || (opts->tp_canonical && opts->tp <= 1);
        /* A ModelOpt FP8 / NVFP4 folder: its quantized weights stay as stored (issue #15);
         * a family whose split cuts them (tp_quantized) splits such a model too, the others
         * refuse it at tp > 1 and leave it whole at tp 1. */
        lo.modelopt = r->mo.algo != TSR_MODELOPT_NONE ? &r->mo : NULL;
        if (split && lo.modelopt && shard->tp_size > 1 && !r->fam->tp_quantized) {
                char names[128];
                snprintf(err, errlen, "tensor parallelism with a quantized (ModelOpt %s) checkpoint is not supported "
                         "for model family %s (supported: -tp 1; families that split one: %s)",
                         tsr_modelopt_algo_name(r->mo.algo), r->fam->name,
                         tsr_family_names(tsr_family_has_tp_quantized, names, sizeof names));
                return TSR_E_UNSUPPORTED;
        }
        if (lo.modelopt && !r->fam->tp_quantized)
                split = false;
        /* A family that reads a rank's share from the file gets the rank's spec; the
         * others load whole tensors and split them after (tp_shard either way); under
         * expert parallelism the share is the rank's routed experts whole. */
        bool share = split && shard->tp_size > 1 && r->fam->load_tp_share && !opts->tp_load_whole;
        load.tp_rank = share ? shard->tp_rank : 0;
        load.tp_size = share ? shard->tp_size : 1;
        load.expert_parallel = share && opts->expert_parallel && r->fam->ep_shard;
        if (split && !r->fam->tp_quantized) {   /* that family's split reads float32 only */
                lo.keep_dtypes = 0;
                lo.keep_bf16 = false;
        }
        st = r->fam->load(path, desc, &load, &lo, progress, NULL, &sg->model, stats, err, errlen);
        if (st != TSR_OK)
                return st;
        if (split && !r->fam->tp_shard) {
                char names[128];
                snprintf(err, errlen, "tensor parallelism is not supported for model family %s (supported: %s)",
                         r->fam->name, tsr_family_names(tsr_family_has_tp, names, sizeof names));
                return TSR_E_UNSUPPORTED;
        }
        tsr_status (*shard_fn)(void *, uint32_t, uint32_t, char *, size_t) =
                opts->expert_parallel && r->fam->ep_shard ? r->fam->ep_shard : r->fam->tp_shard;
        if (split && (st = shard_fn(sg->model, shard->tp_rank, shard->tp_size, err, errlen)) != TSR_OK) {
                if (shard->tp_size > 1 || st != TSR_E_UNSUPPORTED)
                        return st;
                /* tp 1: a model whose sizes the split does not fit runs as it always did */
                log_info("the canonical row-parallel split does not apply (%s): o_proj and down_proj sum in one "
                         "pass", err);
                st = TSR_OK;
        }
        if (*bf16 && (st = r->fam->use_bf16(sg->model)) == TSR_E_UNSUPPORTED &&
            (!opts->dtype || strcmp(opts->dtype, "auto") == 0)) {
                /* --dtype auto asked for bfloat16 on this CPU, but the family has no
                 * bfloat16 path: keep float32 (an explicit --dtype bfloat16 is refused). */
                log_info("model family %s has no bfloat16 weights: float32 under --dtype auto", r->fam->name);
                *bf16 = false;
                st = TSR_OK;
        }
        if (*bf16 && st != TSR_OK) {
                snprintf(err, errlen, "cannot convert the weights to bfloat16: %s", tsr_status_str(st));
                return st;
        }
        /* what the rank holds now: the float32 copies are gone after bf16, the other ranks'
         * shares after a tensor- or expert-parallel split (the load counted whole tensors) */
        if ((*bf16 || split) && r->fam->resident_bytes && stats)
                stats->resident_bytes = r->fam->resident_bytes(sg->model);
        if (!tsr_backend_host_memory(sg->be)) {
                if (!r->fam->to_backend) {
                        char names[128];
                        snprintf(err, errlen, "model family %s does not run on the %s backend yet (supported: %s); "
                                 "use --device cpu", r->fam->name, tsr_backend_name(sg->be),
                                 tsr_family_names(tsr_family_has_device, names, sizeof names));
                        return TSR_E_UNSUPPORTED;
                }
                if ((st = r->fam->to_backend(sg->model, sg->be, opts->max_step_tokens, opts->max_logit_rows, err,
                                             errlen)) != TSR_OK)
                        return st;
        }
        if ((st = r->fam->check_backend(sg->model, sg->be)) != TSR_OK) {
                snprintf(err, errlen, "kernel backend '%s' lacks ops the %s forward needs", tsr_backend_name(sg->be),
                         r->fam->name);
                return st;
        }
        /* The KV memory, group by group as the family declares it for this shard; the
         * family's forward gets a view of it. */
        n_groups = r->fam->kv_groups(desc, shard, groups, TSR_KV_GROUPS_MAX);
        if ((st = tsr_runner_kv_dtype_check(r->fam, opts->kv_dtype, NULL, err, errlen)) != TSR_OK)
                return st;
        tsr_kv_groups_set_dtype(groups, n_groups, opts->kv_dtype);
        if (num_blocks == 0 && (st = device_kv_blocks(sg->be, opts->gpu_memory_utilization,
                                                      tsr_kv_block_bytes(groups, n_groups, block_size), &num_blocks,
                                                      err, errlen)) != TSR_OK)
                return st;
        if (!r->kv_blocks || num_blocks < r->kv_blocks)     /* the capacity: the minimum over ranks */
                r->kv_blocks = num_blocks;
        st = tsr_kv_pool_new_on(tsr_backend_host_memory(sg->be) ? NULL : sg->be, groups, n_groups, num_blocks,
                                block_size, n_state_slots, &sg->kv_memory);
        if (st == TSR_OK && tsr_dtype_is_fp8(opts->kv_dtype) &&
            (st = kv_fp8_scales(r, path, desc, shard, sg->kv_memory, opts->kv_dtype, err, errlen)) != TSR_OK)
                return st;      /* the message names the file and the tensor */
        if (st != TSR_OK || (st = r->fam->kv_bind(sg->model, sg->kv_memory, &sg->pool)) != TSR_OK) {
                snprintf(err, errlen, "cannot allocate the KV cache (%llu blocks of %u tokens, %zu group%s): %s",
                         (unsigned long long)num_blocks, block_size, n_groups, n_groups == 1 ? "" : "s",
                         tsr_status_str(st));
                return st;
        }
        return TSR_OK;
}

static double now_seconds(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CUDA graphs of decode steps (opts->graphs), recorded now as vLLM captures at start-up,
 * with its two log lines.  A model in one rank on a device backend whose family has
 * them; otherwise a line says the steps run eagerly.  Main thread, at start-up. */
static tsr_status capture_graphs(tsr_runner *r, const tsr_runner_opts *opts, char *err, size_t errlen) {
        const tsr_graph_opts *o = &opts->graphs;
        stage *sg = &r->stages[0];
        size_t free0 = 0, free1 = 0, total = 0, captured = 0;

        if (!o->n_sizes || tsr_backend_host_memory(sg->be))
                return TSR_OK;
        if (r->n_stages > 1 || !r->fam->capture_graphs) {
                log_info("CUDA graphs are not captured for %s: every step runs eagerly (as --enforce-eager)",
                         r->n_stages > 1 ? "tensor or pipeline parallelism yet" : "this model family yet");
                return TSR_OK;
        }
        log_info("Capturing CUDA graphs (decode, FULL): %zu batch sizes, %u .. %u, for the shortest sequences (each "
                 "longer length class is recorded on first use, up to %u tokens)", o->n_sizes, o->sizes[0],
                 o->sizes[o->n_sizes - 1], o->max_seq_len);
        (void)tsr_backend_mem_info(sg->be, &free0, &total);
        double t0 = now_seconds();
        tsr_status st = r->fam->capture_graphs(sg->model, sg->be, sg->pool, o, &captured);
        if (st == TSR_E_UNSUPPORTED) {
                log_info("the %s backend records no graphs: every step runs eagerly", tsr_backend_name(sg->be));
                return TSR_OK;
        }
        if (st != TSR_OK) {
                snprintf(err, errlen, "capturing CUDA graphs failed: %s (--enforce-eager runs without them)",
                         tsr_status_str(st));
                return st;
        }
        (void)tsr_backend_mem_info(sg->be, &free1, &total);
        log_info("Graph capturing finished in %.2f secs, took %.2f GiB", now_seconds() - t0,
                 free0 > free1 ? (double)(free0 - free1) / (1 << 30) : 0.0);
        if (captured < o->n_sizes)
                log_warn("CUDA graphs: %zu of %zu batch sizes could not be recorded; their steps run eagerly",
                         o->n_sizes - captured, o->n_sizes);
        return TSR_OK;
}

tsr_status tsr_runner_new(const char *path, const tsr_model_desc *desc, const tsr_runner_opts *opts,
                          uint64_t num_blocks, uint32_t block_size, uint32_t n_state_slots, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen) {
        bool bf16 = false;
        tsr_runner *r;
        tsr_status st;
        uint32_t pp = opts && opts->pp > 1 ? opts->pp : 1, first = 0;
        uint32_t tp = opts && opts->tp > 1 ? opts->tp : 1;
        tsr_load_stats total = {0};

        if (!opts || !opts->backend || !desc || !desc->family || pp > TSR_RUNNER_MAX_STAGES ||
            (pp > 1 && !opts->pp_layers))
                return TSR_E_INVAL;
        if (pp > 1 && (!desc->family->forward_stage || !desc->hidden_size)) {
                char names[128];
                snprintf(err, errlen, "pipeline parallelism is not supported for model family %s (supported: %s)",
                         desc->family->name, tsr_family_names(tsr_family_has_stages, names, sizeof names));
                return TSR_E_UNSUPPORTED;
        }
        if (tp > TSR_RUNNER_MAX_STAGES || pp * tp > TSR_RUNNER_MAX_STAGES) {
                snprintf(err, errlen, "tensor parallel size %u x pipeline parallel size %u: at most %d ranks in one "
                         "worker", tp, pp, TSR_RUNNER_MAX_STAGES);
                return TSR_E_INVAL;
        }
        r = calloc(1, sizeof(*r));
        if (!r)
                return TSR_E_NOMEM;
        r->fam = desc->family;
        r->pp = pp;
        r->tp = tp;
        r->n_stages = pp * tp;
        if (opts->node_stage_only) {    /* one stage of pp here, the others on other nodes */
                uint32_t k = opts->node_stages ? opts->node_stages : 1;
                if (pp < 2 || opts->node_stage >= pp || k > pp - opts->node_stage || k * tp > TSR_RUNNER_MAX_STAGES) {
                        free(r);
                        return TSR_E_INVAL;
                }
                r->node_mode = true;
                r->node_stage = opts->node_stage;
                r->node_stages = k;
                r->n_stages = k * tp;   /* the node's stages, each on its tp ranks */
                for (uint32_t s = 0; s < opts->node_stage; s++)
                        first += opts->pp_layers[s];
        }
        r->hidden = desc->hidden_size;
        r->stages[0].be = opts->backend;
        if ((st = pick_dtype(opts, &bf16, err, errlen)) != TSR_OK ||
            (st = quant_config(path, desc, opts->quantization, tsr_dtype_is_fp8(opts->kv_dtype), &r->mo, err,
                                errlen)) != TSR_OK)
                goto fail;
        for (uint32_t i = 0; i < r->n_stages; i++) {
                uint32_t s = (r->node_mode ? r->node_stage : 0) + i / tp, t = i % tp;
                tsr_shard_spec shard;
                tsr_load_stats one = {0};
                stage *sg = &r->stages[i];

                /* DESIGN.md: weights always load through a shard spec: without pipeline
                 * stages the family's spec (every layer, the rank's TP share), stage s of a
                 * pipeline its range of the split, with the rank's TP share of it. */
                if (pp == 1) {
                        if ((st = r->fam->shard_for(desc, t, tp, 0, 1, &shard)) != TSR_OK) {
                                snprintf(err, errlen, "%s: the model has no layers", path);
                                goto fail;
                        }
                } else {
                        shard = (tsr_shard_spec){.tp_rank = t, .tp_size = tp, .first_layer = first,
                                                 .last_layer = first + opts->pp_layers[s] - 1};
                        if (t + 1 == tp)
                                first += opts->pp_layers[s];
                }
                if (i > 0 && (st = tsr_runner_backend_new(opts->stage_threads, &sg->be, err, errlen)) != TSR_OK)
                        goto fail;
                st = stage_load(r, path, desc, opts, &bf16, &shard, sg, num_blocks, block_size, n_state_slots,
                                &one, err, errlen);
                if (st != TSR_OK)
                        goto fail;
                int threads = tsr_backend_threads(sg->be);
                bool share = r->fam->load_tp_share;
                /* a ModelOpt checkpoint's fp8 / nvfp4 linears: each read whole, then cut */
                const char *how = !share ? "whole tensors, then split"
                                  : r->mo.algo != TSR_MODELOPT_NONE
                                          ? "its share of the float32 tensors read straight from the file; each "
                                            "quantized linear read whole, one at a time, and cut to its share"
                                          : "its share read straight from the file";
                if (pp == 1 && tp > 1)
                        log_info("tensor parallel rank %u of %u: every layer's 1/%u shard, %d kernel thread%s, "
                                 "%.1f MB resident (%.1f MB read as float32: %s)", t, tp, tp, threads,
                                 threads == 1 ? "" : "s", (double)one.resident_bytes / 1e6, (double)one.f32_bytes / 1e6,
                                 how);
                else if (pp > 1 && tp == 1)
                        log_info("pipeline stage %u of %u: layers %u..%u%s%s, %d kernel thread%s, %.1f MB resident", s,
                                 pp, shard.first_layer, shard.last_layer, s == 0 ? " + embedding" : "",
                                 s + 1 == pp ? " + final norm and lm_head" : "", threads, threads == 1 ? "" : "s",
                                 (double)one.resident_bytes / 1e6);
                else if (pp > 1)
                        log_info("rank %u: pipeline stage %u of %u, tensor parallel rank %u of %u: layers %u..%u%s%s, "
                                 "their 1/%u shard, %d kernel thread%s, %.1f MB resident (%.1f MB read as float32: "
                                 "%s)", i, s, pp, t, tp, shard.first_layer, shard.last_layer,
                                 s == 0 ? " + embedding" : "", s + 1 == pp ? " + final norm and lm_head" : "", tp,
                                 threads, threads == 1 ? "" : "s", (double)one.resident_bytes / 1e6,
                                 (double)one.f32_bytes / 1e6,
                                 share && r->mo.algo == TSR_MODELOPT_NONE
                                         ? "the share of its layers, read straight from the file" : how);
                total.n_tensors += one.n_tensors;       /* what the ranks read, summed */
                total.file_bytes += one.file_bytes;
                total.f32_bytes += one.f32_bytes;
                total.resident_bytes += one.resident_bytes;
                total.seconds += one.seconds;
        }
        if (bf16)
                log_info("matmul weights held as bfloat16 (a BF16 checkpoint's linears as stored, the rest "
                         "rounded from float32), the float32 copies freed");
        if ((st = capture_graphs(r, opts, err, errlen)) != TSR_OK)
                goto fail;
        const char *hang_at = getenv("TESSERA_TEST_HANG_AT_STEP");
        r->hang_at = hang_at ? strtoull(hang_at, NULL, 10) : 0;
        if (r->n_stages > 1) {
                const char *abort_at = getenv("TESSERA_TEST_PP_ABORT_AT_STEP");
                r->abort_at = abort_at ? strtoull(abort_at, NULL, 10) : 0;
                if ((st = tsr_pipeline_new_grid(r->node_mode ? r->node_stages : pp, tp, opts->pp_timeout_ms, stage_run,
                                                r, &r->pipe)) != TSR_OK) {
                        snprintf(err, errlen, "cannot make the pipeline: %s", tsr_status_str(st));
                        goto fail;
                }
        }
        if (stats)
                *stats = total;
        r->em.vocab = desc->vocab_size;
        r->em.ud = r;
        r->em.forward = runner_forward;
        /* one rank on a device: the rows the engine offers are answered there (answer.h);
         * a grammar's mask is not yet (its rows come back whole) */
        r->answers_on_device = r->n_stages == 1 && !r->node_mode && r->fam->seq_set_answer &&
                               !tsr_backend_host_memory(r->stages[0].be);
        r->em.answers_logprobs = r->answers_on_device;
        r->em.answers_rules = r->answers_on_device;
        if (!r->node_mode)     /* off by default for stages in this process (above) */
                micro_batches_setup(r, 1);
        *ret = r;
        return TSR_OK;
fail:
        tsr_runner_free(&r);
        return st;
}

void tsr_runner_free(tsr_runner **rp) {
        tsr_runner *r;
        if (!rp || !*rp)
                return;
        r = *rp;
        if (r->rows_as_token + r->rows_whole + r->rows_prompt_lp)
                log_info("logits rows answered on the device: %llu as their token (%llu with its logprobs, %llu under "
                         "the request's rules), %llu as their prompt logprobs, %llu whole",
                         (unsigned long long)r->rows_as_token, (unsigned long long)r->rows_with_lp,
                         (unsigned long long)r->rows_with_rules, (unsigned long long)r->rows_prompt_lp,
                         (unsigned long long)r->rows_whole);
        tsr_pipeline_free(&r->pipe);    /* joins the rank threads before their stages go */
        tsr_modelopt_config_done(&r->mo);
        for (uint32_t s = 0; s < r->n_stages; s++) {
                stage *sg = &r->stages[s];
                if (sg->pool)
                        r->fam->kv_unbind(&sg->pool);
                tsr_kv_pool_free(&sg->kv_memory);
                if (sg->model)
                        r->fam->free(&sg->model);
                if (s > 0)
                        tsr_backend_free(&sg->be);
        }
        free(r);
        *rp = NULL;
}

const tsr_engine_model *tsr_runner_model(const tsr_runner *r) { return &r->em; }

uint32_t tsr_runner_stages(const tsr_runner *r) { return r ? r->n_stages : 0; }

void tsr_runner_abort(tsr_runner *r) {
        if (r) {
                tsr_pipeline_abort(r->pipe);
                tsr_nodes_abort(r->nodes);
        }
}

const char *tsr_runner_dtype(const tsr_runner *r) {
        return r && r->fam->is_bf16(r->stages[0].model) ? "bfloat16" : "float32";
}
