/* runner.h - the model runner the engine drives: a loaded model plus the KV pool its
 * paged attention reads, behind engine.h's tsr_engine_model interface.
 *
 * Built by the worker's main thread before the engine starts, then used only by the
 * engine thread (which then drives the backend it borrowed).  Any registered model family
 * (worker/model/family.h; today Llama), GGUF files and HF folders, on a CPU backend
 * (kernels.h). */
#ifndef TSR_WORKER_RUNNER_H
#define TSR_WORKER_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "worker/engine/engine.h"
#include "kernels/kernels.h"
#include "worker/model/family.h"
#include "worker/model/llama_weights.h"

typedef struct tsr_runner tsr_runner;

/* How the runner computes: the worker's --dtype and the backend its forwards run on. */
typedef struct tsr_runner_opts {
        const char *dtype;      /* auto | float32 | float | bfloat16 (half/float16: TSR_E_INVAL); NULL = auto */
        tsr_backend *backend;   /* borrowed: must outlive the runner (tsr_runner_backend_new); stage 0's */
        /* Pipeline parallelism (issue #20): pp stages (0 or 1: the whole model in one),
         * stage s holding pp_layers[s] layers (tsr_pp_partition), each on its own rank:
         * stage 0 on the engine's thread with `backend`, stages 1 .. pp-1 on rank threads
         * with backends of their own of `stage_threads` kernel threads each
         * (tsr_runner_backend_new).  Every comm wait of a step is bounded by pp_timeout_ms
         * (0: the comm's default). */
        uint32_t pp;
        const uint32_t *pp_layers;      /* [pp], borrowed for the call */
        /* A node of a multi-node replica (issue #20, worker/parallel/nodes.h): the runner
         * holds only stages node_stage .. node_stage + node_stages - 1 of the pp stages
         * (each on its tp ranks), the first on `backend`; the other stages run on the
         * other nodes (tsr_runner_set_nodes on node 0; tsr_runner_run_stage on a
         * follower). */
        bool node_stage_only;
        uint32_t node_stage, node_stages;
        /* Tensor parallelism (issue #20): tp ranks (0 or 1: none) per pipeline stage, each
         * holding its shard of the stage's layers; with pp, tp x pp ranks in all, global
         * rank = stage x tp + tp_rank (pipeline.h), rank 0 on the engine's thread, the
         * others on rank threads with `stage_threads` kernel threads each.
         * tp_canonical: compute o_proj and down_proj in the canonical split even at tp 1,
         * so that a tp 1 runner gives the bits of a tp > 1 one (needs float32 weights). */
        uint32_t tp;
        bool tp_canonical;
        /* --enable-expert-parallel: the family's ep_shard instead of tp_shard (the worker
         * has checked that the family has one, or has no MoE layers). */
        bool expert_parallel;
        /* Tests only: every tensor-parallel rank loads whole tensors and splits them after
         * (the path of a family without load_tp_share), so that path stays checked. */
        bool tp_load_whole;
        int stage_threads;
        uint32_t pp_timeout_ms;
        /* --quantization (NULL: from the checkpoint): must agree with what a Hugging Face
         * folder announces (worker/load/modelopt.h); refused for a GGUF file. */
        const char *quantization;
        /* A backend whose memory is not the host's (CUDA; issue #16): the weights go there
         * (the family's to_backend), with the forward's activations for a step of
         * max_step_tokens tokens and max_logit_rows rows of logits kept allocated.  With
         * num_blocks 0 the runner sizes the KV cache itself, as vLLM does: of the device's
         * total memory times gpu_memory_utilization, what is left after everything
         * already in use (the weights, the activations, the CUDA context, other
         * processes) goes to the KV blocks (tsr_runner_kv_blocks says how many). */
        size_t max_step_tokens, max_logit_rows;
        double gpu_memory_utilization;
        /* CUDA graphs of decode steps (n_sizes 0: none, --enforce-eager): recorded at
         * start-up on a device backend for a model in one rank whose family has them;
         * logged as vLLM logs its capture. */
        tsr_graph_opts graphs;
        /* --kv-cache-dtype (tsr_kv_cache_dtype_parse): float32 (0), or fp8_e4m3 /
         * fp8_e5m2 for the paged groups, with a checkpoint's k_scale / v_scale where it
         * has them, else 1.0 (logged as vLLM does).  tsr_runner_kv_dtype_check says where. */
        tsr_dtype kv_dtype;
} tsr_runner_opts;

/* Whether the KV cache can store `kv_dtype` for a model of `fam`: float32 always;
 * bfloat16 for any family (no scales; the CPU backends only, which worker/main.c checks);
 * fp8_e4m3 and fp8_e5m2 for a family that names its checkpoint scales (kv_scale_module:
 * llama, llama4, nemotron_h), with any tensor and pipeline parallelism (each rank stores
 * its layers' and heads' KV with its layers' scales), on any backend the family runs on
 * (the CPU backends and CUDA have the e4m3 kv_write and attention; e5m2 is the CPU
 * backends' only, which worker/main.c checks once it knows the device).  TSR_E_UNSUPPORTED
 * with one line in err naming the flag, the value (`flag`, as given) and what is
 * supported otherwise.  Any thread; main's start-up check and the runner's. */
#define TSR_RUNNER_KV_DTYPE_SCOPE \
        "the bfloat16 and fp8 KV caches are implemented for the llama, llama4 and nemotron_h families"
tsr_status tsr_runner_kv_dtype_check(const tsr_model_family *fam, tsr_dtype kv_dtype, const char *flag, char *err,
                                     size_t errlen);

/* What --kv-cache-dtype auto stores on `be` under --dtype `dtype` (NULL: auto): the
 * model's dtype, as vLLM: bfloat16 where the weights are held as bfloat16 (CUDA unless
 * --dtype float32; a CPU with AVX512-BF16 or --dtype bfloat16), else float32.  Main
 * thread, at start-up, before the KV plan. */
tsr_dtype tsr_runner_auto_kv_dtype(const tsr_backend *be, const char *dtype);

/* The backend for --device `device` (auto | cuda | cpu; NULL: auto): cuda is GPU 0;
 * auto takes it when there is one and the model can run there (`gpu_not_ok` NULL; else
 * it says why not: --device cuda is then refused with it), else the CPU backend of
 * tsr_runner_backend_new.  TESSERA_KERNELS=devlike makes auto take the CPU-devlike
 * backend where it would take a GPU (tests: the device path without one).  Logs the
 * choice.  Main thread, at start-up. */
tsr_status tsr_runner_backend_for(const char *device, const char *gpu_not_ok, int cpu_threads, tsr_backend **ret,
                                  char *err, size_t errlen);
/* KV blocks the runner allocated (what num_blocks asked for, or what it sized). */
uint64_t tsr_runner_kv_blocks(const tsr_runner *r);

/* The most ranks (pipeline stages x tensor-parallel ranks) a runner holds (the comm
 * layer's group size). */
#define TSR_RUNNER_MAX_STAGES 64

/* The worker's CPU backend: the fast one with `cpu_threads` threads (0 = the online
 * cores); the environment variable TESSERA_KERNELS=ref selects the scalar reference
 * instead (tests, debugging), =avx2 / =avx512_bf16 / =amx_bf16 cap the fast backend at
 * that ISA (=devlike is tsr_runner_backend_for's: here it is the fast backend).  When
 * the threads cannot be started, logs a warning and runs single-threaded.
 * TSR_E_INVAL (a bad TESSERA_KERNELS or thread count) or TSR_E_NOMEM, with the reason in
 * err; *ret written only on success (tsr_backend_free).  Main thread, at startup. */
tsr_status tsr_runner_backend_new(int cpu_threads, tsr_backend **ret, char *err, size_t errlen);

/* Load `path`, whose description `desc` (tsr_model_desc_read) names its family and
 * config, and allocate a KV pool of `num_blocks` blocks of `block_size` tokens (and
 * `n_state_slots` request state slots when the family declares a TSR_KV_MAMBA_STATE
 * group; ignored otherwise); the
 * forwards run on opts->backend (the start-up log names it, its ISA and threads).  dtype
 * auto means bfloat16 weights where the backend has AVX512_BF16 and is not the
 * reference, float32 otherwise; and, with auto only, a GGUF file's block-format matmul
 * weights (q8_0 .. q6_K) kept as stored wherever the backend's matmul computes on them
 * (explicit float32 / bfloat16 widen them, as the transformers goldens need).  *stats
 * (may be NULL): summed over the ranks, each counting the tensors and file bytes it
 * read (its share's rows), the float32 it widened and the bytes it holds.  TSR_E_INVAL
 * for a dtype the CPU backend cannot run, no backend or no family; other statuses with
 * the file and tensor named in err. */
tsr_status tsr_runner_new(const char *path, const tsr_model_desc *desc, const tsr_runner_opts *opts,
                          uint64_t num_blocks, uint32_t block_size, uint32_t n_state_slots, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen);
struct tsr_nodes;
/* Node 0 of a multi-node replica (opts->node_stage_only, stage 0): every forward runs
 * stage 0 here and the others on the followers through `nodes` (borrowed: it must
 * outlive the runner's last forward).  The engine model then also reports the group's
 * generation and whether it is up (engine.h).  Main thread, before the engine starts. */
void tsr_runner_set_nodes(tsr_runner *r, struct tsr_nodes *nodes);
/* A follower of a multi-node replica: run this node's stages of one step (`in`: the
 * previous node's (2, tokens, hidden) floats; `out`: the same for the next node, or the
 * logits rows on the last).  The follower's main thread. */
tsr_status tsr_runner_run_stage(tsr_runner *r, const tsr_engine_seq *seqs, size_t n_seqs, const float *in,
                                float *out);
/* Ranks of the runner: pipeline stages x tensor-parallel ranks (1 without either). */
uint32_t tsr_runner_stages(const tsr_runner *r);
/* Fail the step in flight (a pipeline's comm abort: its requests end with an error, the
 * next step runs on a fresh group).  Any thread; no effect with one stage. */
void tsr_runner_abort(tsr_runner *r);
/* The dtype the weights are held in: "float32" or "bfloat16". */
const char *tsr_runner_dtype(const tsr_runner *r);
void tsr_runner_free(tsr_runner **r);
/* The engine's view of the runner; valid while the runner lives. */
const tsr_engine_model *tsr_runner_model(const tsr_runner *r);

#endif
