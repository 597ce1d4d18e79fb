/* tessera-worker MODEL --listen tcp://HOST:PORT [vLLM flags]
 *
 * Parse the configuration, read the model's metadata (config + tokenizer), size the
 * KV cache, then run two threads: the io thread (this one, link.c) and the engine
 * thread (engine.c).  Exits 2 before binding any socket when the flags or the model
 * files are bad, 0 on SIGTERM/SIGINT (after --shutdown-timeout lets in-flight requests
 * finish, link.c and engine.h). */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/clock.h"
#include "common/config.h"
#include "common/endpoint.h"
#include "common/log.h"
#include "common/zmq_curve.h"
#include "worker/engine/engine.h"
#include "worker/exit_codes.h"
#include "worker/load/gen_config.h"
#include "worker/link.h"
#include "worker/serve.h"
#include "worker/model/cudagraph.h"
#include "worker/model/family.h"
#include "worker/load/model_meta.h"
#include "worker/model/runner.h"
#include "worker/model/tp.h"
#include "worker/notify.h"
#include "worker/parallel/comm.h"
#include "worker/parallel/nodes.h"
#include "worker/parallel/partition.h"

#define DEFAULT_KV_CACHE_BYTES (4ll << 30)
#define CPU_DEFAULT_MAX_NUM_SEQS 256   /* issue #4; vLLM's server default below 70 GiB */
#define CPU_DEFAULT_MAX_BATCHED_TOKENS 2048


/* The KV groups of the model: its family's per-layer spec for the layers of `stage` (NULL:
 * the whole model as the family shards it).  A model with no family gets no pool and refuses Submit, but
 * still advertises a capacity in ModelInfo: one full-attention group from the dims its
 * config states (model_meta.c), float32 as the CPU runner would hold it; a dim the config
 * does not state is an error naming it, never a guess.  Main thread, at start-up. */
static tsr_status plan_kv_groups(const tsr_model_desc *desc, const tsr_model_meta *m, const tsr_shard_spec *stage,
                                 tsr_kv_group *groups, size_t *n_groups, char *err, size_t errlen) {
        tsr_shard_spec shard;
        const char *missing;

        if (desc) {
                if (stage)
                        shard = *stage;
                if ((!stage && desc->family->shard_for(desc, 0, 1, 0, 1, &shard) != TSR_OK) ||
                    (*n_groups = desc->family->kv_groups(desc, &shard, groups, TSR_KV_GROUPS_MAX)) == 0) {
                        snprintf(err, errlen, "%s: the model has no layers", m->path);
                        return TSR_E_INVAL;
                }
                return TSR_OK;
        }
        missing = !m->num_hidden_layers     ? "num_hidden_layers"
                  : !m->num_key_value_heads ? "num_key_value_heads"
                  : !m->head_dim            ? "head_dim"
                                            : NULL;
        if (missing) {
                snprintf(err, errlen, "%s: the model states no %s: cannot size the KV cache", m->path, missing);
                return TSR_E_INVAL;
        }
        groups[0] = (tsr_kv_group){.kind = TSR_KV_FULL_ATTENTION, .n_layers = m->num_hidden_layers,
                                   .n_kv_heads = m->num_key_value_heads, .head_dim = m->head_dim,
                                   .dtype = TSR_DTYPE_F32};
        *n_groups = 1;
        return TSR_OK;
}

/* The KV cache's memory of one rank: --kv-cache-memory-bytes, which is per rank as
 * vLLM's is per GPU worker; by default 4 GiB, never more than half of the free RAM, for
 * the whole process: its `ranks` (pipeline stages x tensor-parallel ranks) share the
 * machine's RAM, so each gets an even share. */
static long long kv_budget(const tsr_config *cfg, uint32_t ranks) {
        long long budget = cfg->kv_cache_memory_bytes ? cfg->kv_cache_memory_bytes : DEFAULT_KV_CACHE_BYTES;
        long long avail = (long long)sysconf(_SC_AVPHYS_PAGES) * (long long)sysconf(_SC_PAGESIZE);

        if (!cfg->kv_cache_memory_bytes && avail > 0 && budget > avail / 2)
                budget = avail / 2;
        return cfg->kv_cache_memory_bytes ? budget : budget / (ranks ? ranks : 1);
}

/* tsr_kv_tables writes a table per paged group into the plan's kv_chunk. */
_Static_assert(TSR_KV_TABLES_MAX >= TSR_KV_GROUPS_MAX, "a block table per KV group");

/* KV cache blocks: --num-gpu-blocks-override, else what `budget` bytes hold. */
static uint64_t plan_kv_blocks(const tsr_config *cfg, long long budget, uint64_t per_block) {
        if (cfg->num_gpu_blocks_override > 0)
                return (uint64_t)cfg->num_gpu_blocks_override;
        return per_block && budget > 0 ? (uint64_t)budget / per_block : 0;
}

/* Recurrent-state slots of a model with per-request state (a Mamba hybrid): one per
 * request that may run at once, max_num_seqs, and with prefix caching as many again for
 * the states kept every state block (state_cache.h; running requests evict them), but
 * at most half of the budget (the rest is for the attention layers' blocks).  0 when
 * the model keeps no such state, or the budget holds not one slot. */
static uint32_t plan_state_slots(long long budget, uint64_t slot_bytes, uint32_t max_num_seqs, bool prefix_caching) {
        uint64_t fit, want = (uint64_t)max_num_seqs * (prefix_caching ? 2 : 1);

        if (!slot_bytes || budget <= 0)
                return 0;
        fit = (uint64_t)budget / 2 / slot_bytes;
        return (uint32_t)(fit < want ? fit : want);
}

/* pp_layers[pp]: the layers of each pipeline stage (pp > 1), else NULL. */
/* gpu_total: the device's memory in bytes on a GPU backend (0 on the CPU), which picks
 * vLLM's server defaults for --max-num-seqs and --max-num-batched-tokens; kv_on_device:
 * the runner sizes the KV cache from the device's memory after the weights are in
 * (tsr_runner_opts), so the plan leaves kv_blocks_total 0 and main checks it then. */
static tsr_status make_plan(const tsr_config *cfg, const tsr_model_meta *m, const tsr_model_desc *desc,
                            uint32_t pp, const uint32_t *pp_layers, int node_stage, uint32_t node_stages, uint32_t tp,
                            uint64_t gpu_total,
                            bool kv_on_device, tsr_dtype kv_dtype, tsr_worker_plan *p, char *err, size_t errlen) {
        tsr_kv_group groups[TSR_KV_GROUPS_MAX], sg[TSR_KV_GROUPS_MAX];
        size_t n_groups = 0, n_sg;
        tsr_shard_spec whole = {.tp_size = 1}, *stage = NULL;
        uint64_t block_bytes, slot_bytes;

        /* TP: every rank holds every layer (with PP: its stage's) with its share of the KV
         * heads. */
        if (tp > 1 && desc) {
                whole = (tsr_shard_spec){.tp_size = tp, .last_layer = desc->n_layers - 1};
                stage = &whole;
        }

        memset(p, 0, sizeof(*p));
        if (cfg->headless) {
                /* a follower node binds no Submit/Status endpoint */
        } else if (cfg->status_listen) {
                snprintf(p->status_listen, sizeof(p->status_listen), "%s", cfg->status_listen);
        } else if (tsr_endpoint_status_default(cfg->worker_listen, p->status_listen, sizeof(p->status_listen)) != TSR_OK) {
                snprintf(err, errlen, "--listen %s: expected tcp://HOST:PORT (or give --status-listen)",
                         cfg->worker_listen);
                return TSR_E_INVAL;
        }
        p->max_model_len = m->max_model_len;
        if (cfg->max_model_len > 0) {
                if (m->max_model_len && (uint32_t)cfg->max_model_len > m->max_model_len) {
                        snprintf(err, errlen,
                                 "--max-model-len %d is greater than the model's maximum context length %u",
                                 cfg->max_model_len, m->max_model_len);
                        return TSR_E_INVAL;
                }
                p->max_model_len = (uint32_t)cfg->max_model_len;
        }
        if (p->max_model_len == 0) {
                snprintf(err, errlen, "%s: the model states no context length; pass --max-model-len", m->path);
                return TSR_E_INVAL;
        }
        /* The whole model's groups: a request's block tables follow them (with pipeline
         * stages too: each stage's layers index the whole model's tables, llama4.h). */
        if (plan_kv_groups(desc, m, stage, groups, &n_groups, err, errlen) != TSR_OK)
                return TSR_E_INVAL;
        tsr_kv_groups_set_dtype(groups, n_groups, kv_dtype);   /* as the runner allocates them */
        block_bytes = tsr_kv_block_bytes(groups, n_groups, (uint32_t)cfg->block_size);
        slot_bytes = tsr_kv_slot_bytes(groups, n_groups);
        /* Pipeline stages: every rank allocates as many blocks and state slots, each of its
         * own layers' groups (a stage of a hybrid may keep no state at all), so the rank
         * with the most bytes per block, and the one with the most per slot, size them:
         * the capacity is the minimum over the ranks. */
        /* A node of a multi-node replica (node_stage >= 0) holds its own stages only. */
        bool seen = false;
        for (uint32_t s = 0, first = 0; desc && pp_layers && s < pp; first += pp_layers[s++]) {
                if (node_stage >= 0 && (s < (uint32_t)node_stage || s >= (uint32_t)node_stage + node_stages))
                        continue;
                tsr_shard_spec one = {.tp_size = tp > 1 ? tp : 1, .first_layer = first,
                                      .last_layer = first + pp_layers[s] - 1};
                n_sg = desc->family->kv_groups(desc, &one, sg, TSR_KV_GROUPS_MAX);
                tsr_kv_groups_set_dtype(sg, n_sg, kv_dtype);
                uint64_t b = tsr_kv_block_bytes(sg, n_sg, (uint32_t)cfg->block_size), sl = tsr_kv_slot_bytes(sg, n_sg);
                block_bytes = !seen || b > block_bytes ? b : block_bytes;
                slot_bytes = !seen || sl > slot_bytes ? sl : slot_bytes;
                seen = true;
        }
        /* vLLM's OpenAI-server defaults: 1024 sequences and 8192 tokens a step on a GPU of
         * 70 GiB or more, else 256 and 2048 (the CPU's too). */
        bool big_gpu = gpu_total >= 70ull << 30;
        p->max_num_seqs = cfg->max_num_seqs > 0 ? (uint32_t)cfg->max_num_seqs
                          : big_gpu            ? 1024
                                               : CPU_DEFAULT_MAX_NUM_SEQS;
        /* Bytes of one KV block: the sum over the groups; the runner allocates exactly this
         * per block, and state slots (counted in the same budget) per running request. */
        long long budget = kv_budget(cfg, (node_stage >= 0 ? node_stages : !pp_layers ? 1 : pp) * (tp > 1 ? tp : 1));
        p->state_slot_bytes = slot_bytes;
        p->state_slots = plan_state_slots(budget, p->state_slot_bytes, p->max_num_seqs,
                                          cfg->enable_prefix_caching == TSR_TRI_TRUE);
        if (p->state_slot_bytes && p->state_slots == 0) {
                snprintf(err, errlen, "no available memory for the recurrent state: one request's state takes %llu "
                         "bytes; increase --kv-cache-memory", (unsigned long long)p->state_slot_bytes);
                return TSR_E_INVAL;
        }
        budget -= (long long)(p->state_slots * p->state_slot_bytes);
        p->kv_block_bytes = block_bytes;
        p->kv_blocks_total = kv_on_device ? 0 : plan_kv_blocks(cfg, budget, p->kv_block_bytes);
        p->max_num_batched_tokens = cfg->max_num_batched_tokens > 0 ? (uint32_t)cfg->max_num_batched_tokens
                                    : big_gpu                        ? 8192
                                                                     : CPU_DEFAULT_MAX_BATCHED_TOKENS;
        /* A hybrid (issue #14): a request holds a table per paged group, the chunked ones
         * one chunk's blocks at most (tsr_kv_blocks_per_request), so capacity is counted
         * in what a request of max_model_len holds rather than in tokens per block. */
        p->n_kv_tables = (uint32_t)tsr_kv_tables(groups, n_groups, p->kv_chunk);
        p->kv_blocks_per_request = tsr_kv_blocks_per_request(groups, n_groups, (uint32_t)cfg->block_size,
                                                             p->max_model_len, p->max_num_batched_tokens);
        /* No attention layer (a pure Mamba pattern): blocks hold no memory, only the
         * engine's positions; enough for every slot's request at max_model_len. */
        if (p->kv_block_bytes == 0 && p->state_slots && cfg->num_gpu_blocks_override <= 0)
                p->kv_blocks_total = (uint64_t)p->state_slots *
                                     ((p->max_model_len + (uint32_t)cfg->block_size - 1) / (uint32_t)cfg->block_size);
        if (p->kv_blocks_total == 0 && !kv_on_device) {   /* vLLM: "No available memory for the cache blocks" */
                snprintf(err, errlen,
                         "no available memory for the cache blocks: one block of %d tokens takes %llu bytes "
                         "(KV cache dtype %s); increase --kv-cache-memory",
                         cfg->block_size, (unsigned long long)p->kv_block_bytes, tsr_dtype_get_info(kv_dtype)->name);
                return TSR_E_INVAL;
        }
        if (!kv_on_device && p->n_kv_tables > 1 && p->kv_blocks_total < p->kv_blocks_per_request)
                log_warn("the KV cache holds %llu blocks, less than the %llu a request of max_model_len %u holds "
                         "over its %u block tables: long requests will wait or be refused",
                         (unsigned long long)p->kv_blocks_total, (unsigned long long)p->kv_blocks_per_request,
                         p->max_model_len, p->n_kv_tables);
        else if (!kv_on_device && p->n_kv_tables == 1 && p->kv_blocks_total * cfg->block_size < p->max_model_len)
                log_warn("the KV cache holds %llu tokens, less than max_model_len %u: long requests will wait or be "
                         "refused", (unsigned long long)(p->kv_blocks_total * cfg->block_size), p->max_model_len);
        p->boot_epoch = tsr_wall_ns();
        snprintf(p->worker_id, sizeof(p->worker_id), "%s", cfg->worker_listen ? cfg->worker_listen : "headless");
        return TSR_OK;
}

/* -tp and -pp against the model (config.c leaves them to the worker, which knows the
 * heads and layers), with vLLM's words where vLLM has a check.  On success layers[pp]
 * holds the layer count of each pipeline stage (pp > 1).  Main thread, at start-up. */
static tsr_status check_parallel(const tsr_config *cfg, const tsr_model_meta *m, const tsr_model_desc *desc,
                                 uint32_t *layers, char *err, size_t errlen) {
        uint32_t tp = (uint32_t)cfg->tensor_parallel_size, pp = (uint32_t)cfg->pipeline_parallel_size;
        uint32_t heads = m->num_attention_heads, kv_heads = m->num_key_value_heads;
        const char *partition = getenv("VLLM_PP_LAYER_PARTITION");

        /* --enable-expert-parallel: whole experts per rank where the family has MoE layers
         * and implements it; vLLM's flag changes nothing for a model without them */
        if (cfg->enable_expert_parallel && desc && desc->family->moe && !desc->family->ep_shard) {
                char names[128];
                snprintf(err, errlen, "argument --enable-expert-parallel: not supported yet for model family %s "
                         "(supported for %s; without the flag its experts are split across the tensor-parallel "
                         "ranks)", desc->family->name, tsr_family_names(tsr_family_has_ep, names, sizeof names));
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->enable_expert_parallel && desc && !desc->family->moe)
                log_info("--enable-expert-parallel: model family %s has no MoE layers, so it changes nothing (as in "
                         "vLLM)", desc->family->name);

        if (tp > 1) {
                if (heads && heads % tp != 0) {
                        snprintf(err, errlen, "Total number of attention heads (%u) must be divisible by tensor "
                                 "parallel size (%u).", heads, tp);
                        return TSR_E_INVAL;
                }
                /* vLLM's QKVParallelLinear: KV heads are split when tp divides them, else
                 * replicated, which needs tp to be a multiple of them. */
                if (kv_heads && (tp >= kv_heads ? tp % kv_heads : kv_heads % tp) != 0) {
                        snprintf(err, errlen, "Total number of key/value heads (%u) and tensor parallel size (%u) "
                                 "must divide one another.", kv_heads, tp);
                        return TSR_E_INVAL;
                }
                /* This slice: TP ranks are threads of this worker (with -pp, tp of them per
                 * stage), the canonical split of R7 in float32 or bfloat16. */
                if (!desc || !desc->family->tp_shard) {
                        char names[128];
                        snprintf(err, errlen, "argument --tensor-parallel-size: %u is not supported for %s "
                                 "(supported for the model families %s; 1 for the others)", tp,
                                 m->architecture ? m->architecture : m->model_type ? m->model_type : "this model",
                                 tsr_family_names(tsr_family_has_tp, names, sizeof names));
                        return TSR_E_UNSUPPORTED;
                }
                if (pp > 1 && (uint64_t)tp * pp > TSR_RUNNER_MAX_STAGES) {
                        snprintf(err, errlen, "argument --tensor-parallel-size: %u x --pipeline-parallel-size %u = "
                                 "%llu ranks: at most %d in one worker", tp, pp, (unsigned long long)tp * pp,
                                 TSR_RUNNER_MAX_STAGES);
                        return TSR_E_INVAL;
                }
                /* any --dtype: the split runs on the float32 weights, which --dtype bfloat16
                 * (or auto where it picks bf16) then converts rank by rank */
                if (TSR_COMM_TREE_LEAVES % tp != 0) {
                        snprintf(err, errlen, "argument --tensor-parallel-size: %u must divide %d (the canonical "
                                 "partial sums of a row-parallel layer)", tp, TSR_COMM_TREE_LEAVES);
                        return TSR_E_UNSUPPORTED;
                }
                /* the vocabulary is padded to 64 and split evenly, as vLLM's; a tiny one
                 * can leave the last rank nothing */
                if (tsr_tp_vocab_of(desc->vocab_size, tp - 1, tp).n == 0) {
                        snprintf(err, errlen, "argument --tensor-parallel-size: %u splits the vocabulary (%u tokens, "
                                 "padded to a multiple of %d) so that the last rank holds none of it", tp,
                                 desc->vocab_size, TSR_TP_VOCAB_PAD);
                        return TSR_E_UNSUPPORTED;
                }
        }
        if (pp <= 1 && !(partition && *partition))
                return TSR_OK;
        if (pp > TSR_RUNNER_MAX_STAGES) {
                snprintf(err, errlen, "argument --pipeline-parallel-size: %u: at most %d stages", pp,
                         TSR_RUNNER_MAX_STAGES);
                return TSR_E_INVAL;
        }
        if (pp > 1 && (!desc || !desc->family->forward_stage)) {
                char names[128];
                snprintf(err, errlen, "argument --pipeline-parallel-size: %u is not supported for %s (supported for "
                         "the model families %s; 1 for the others)", pp,
                         m->architecture ? m->architecture : m->model_type ? m->model_type : "this model",
                         tsr_family_names(tsr_family_has_stages, names, sizeof names));
                return TSR_E_UNSUPPORTED;
        }
        return tsr_pp_partition(desc ? desc->n_layers : m->num_hidden_layers, pp, partition, layers, err, errlen);
}

/* n with a comma every three digits, as Python's f"{n:,}" writes it. */
static const char *thousands(uint64_t n, char *buf, size_t len) {
        char digits[24];
        size_t nd = (size_t)snprintf(digits, sizeof(digits), "%llu", (unsigned long long)n), o = 0;
        for (size_t i = 0; i < nd && o + 1 < len; i++) {
                if (i > 0 && (nd - i) % 3 == 0 && o + 2 < len)
                        buf[o++] = ',';
                buf[o++] = digits[i];
        }
        buf[o] = '\0';
        return buf;
}

/* A duration in seconds from the environment variable `name` (a positive number), else
 * `dflt`; in milliseconds. */
static uint32_t env_seconds_ms(const char *name, double dflt) {
        const char *env = getenv(name);
        char *end;
        double v = env ? strtod(env, &end) : dflt;
        if (env && (*end || !(v > 0) || v > 4e6))
                v = dflt;
        return (uint32_t)(v * 1000.0);
}

/* The bound of a pipeline step's comm waits: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, vLLM's
 * bound on one execute_model (default 300 s). */
static uint32_t pp_timeout_ms(void) { return env_seconds_ms("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0); }

/* ---- a replica over several nodes (worker/parallel/nodes.h) ------------------------- */

/* The model's identity for the nodes' agreement: a GGUF file's size and a hash of its
 * first MiB (the metadata and the first tensors); an HF folder's config.json hash and
 * the total size of its *.safetensors.  Cheap, and different files of one model almost
 * always differ in it. */
static void model_identity(const char *path, char *out, size_t len) {
        struct stat sb;
        unsigned long long bytes = 0, h = 0;
        char buf[1 << 16], p[4096];
        FILE *f;

        if (stat(path, &sb) != 0) {
                snprintf(out, len, "missing");
                return;
        }
        if (S_ISDIR(sb.st_mode)) {
                DIR *d = opendir(path);
                struct dirent *e;
                while (d && (e = readdir(d)) != NULL) {
                        size_t n = strlen(e->d_name);
                        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
                        if (n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0 && stat(p, &sb) == 0)
                                bytes += (unsigned long long)sb.st_size;
                }
                if (d)
                        closedir(d);
                snprintf(p, sizeof p, "%s/config.json", path);
        } else {
                bytes = (unsigned long long)sb.st_size;
                snprintf(p, sizeof p, "%s", path);
        }
        if ((f = fopen(p, "rb")) != NULL) {
                XXH64_state_t *x = XXH64_createState();
                size_t n, total = 0;
                XXH64_reset(x, 0);
                while (total < (1u << 20) && (n = fread(buf, 1, sizeof buf, f)) > 0) {
                        XXH64_update(x, buf, n);
                        total += n;
                }
                h = XXH64_digest(x);
                XXH64_freeState(x);
                fclose(f);
        }
        snprintf(out, len, "%llu bytes, head %016llx", bytes, h);
}

/* What every node of a replica must agree on, a key=value line each (bootstrap.h names
 * the first line that differs). */
static void node_fingerprint(const tsr_config *cfg, uint32_t pp, const uint32_t *layers, const char *weights_dtype,
                             tsr_dtype kv_dtype, char *out, size_t len) {
        char ident[128], split[256];
        size_t o = 0;
        const char *slash = strrchr(cfg->model, '/');

        model_identity(cfg->model, ident, sizeof ident);
        for (uint32_t s = 0; s < pp && o < sizeof split; s++)
                o += (size_t)snprintf(split + o, sizeof split - o, "%s%u", s ? "," : "", layers[s]);
        snprintf(out, len,
                 "model=%s\nmodel_files=%s\npipeline_parallel_size=%u\nlayers_per_stage=%s\ndtype=%s (%s)\n"
                 "kv_cache_dtype=%s (%s)\nblock_size=%d\nquantization=%s\nmax_model_len=%d\n"
                 "enable_expert_parallel=%d\n",
                 slash && slash[1] ? slash + 1 : cfg->model, ident, pp, split, cfg->dtype ? cfg->dtype : "auto",
                 weights_dtype, cfg->kv_cache_dtype ? cfg->kv_cache_dtype : "auto", tsr_dtype_get_info(kv_dtype)->name,
                 cfg->block_size,
                 cfg->quantization ? cfg->quantization : "auto", cfg->max_model_len, cfg->enable_expert_parallel);
}

/* How long the nodes wait for one another: TESSERA_NODE_JOIN_TIMEOUT seconds (600). */
static uint32_t node_join_timeout_ms(void) { return env_seconds_ms("TESSERA_NODE_JOIN_TIMEOUT", 600.0); }

static tsr_status follower_stage(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, const float *in, float *out) {
        return tsr_runner_run_stage(ud, seqs, n_seqs, in, out);
}

/* The follower's signal thread: the first SIGTERM/SIGINT/SIGHUP stops it. */
static void *follower_signals(void *arg) {
        sigset_t *set = arg;
        int sig = 0;
        tsr_log_set_thread("signals");
        if (sigwait(set, &sig) == 0 && sig != SIGUSR1) {
                log_info("%s: leaving the replica", strsignal(sig));
                tsr_nodes_stop();
        }
        return NULL;
}

/* A follower node (--headless): its stage of every step until a stop signal.  Exit 0
 * then; 2 when node 0 refused this node (another model or configuration: a restart
 * cannot help); 1 when node 0 went away and did not come back within the deadline. */
static int follow(const tsr_nodes_cfg *nc, tsr_runner *runner, const tsr_model_desc *desc) {
        sigset_t set;
        pthread_t th;
        char err[1024] = "";
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGHUP);
        sigaddset(&set, SIGUSR1);       /* how this thread wakes the signal thread at the end */
        pthread_sigmask(SIG_BLOCK, &set, NULL);
        if (pthread_create(&th, NULL, follower_signals, &set) != 0) {
                log_error("cannot start the signal thread");
                return TSR_EXIT_RUNTIME;
        }
        tsr_notify_ready(NULL);
        tsr_status st = tsr_nodes_follow(nc, follower_stage, runner, desc->hidden_size, desc->vocab_size, err,
                                         sizeof err);
        pthread_kill(th, SIGUSR1);
        pthread_join(th, NULL);
        if (st == TSR_OK) {
                log_info("stopped");
                return TSR_EXIT_OK;
        }
        log_error("node %u: %s", nc->node_rank, err[0] ? err : tsr_status_str(st));
        return st == TSR_E_PROTO ? TSR_EXIT_CONFIG : TSR_EXIT_RUNTIME;
}

/* VLLM_LOG_STATS_INTERVAL, seconds (vLLM's default 10). */
static double stats_interval_s(void) {
        const char *env = getenv("VLLM_LOG_STATS_INTERVAL");
        char *end;
        double v = env ? strtod(env, &end) : 10.0;
        return env && (*end || !(v > 0)) ? 10.0 : v;
}

int main(int argc, char **argv) {
        tsr_config cfg;
        tsr_model_meta *meta = NULL;
        const tsr_model_family *family = NULL;
        tsr_model_desc desc = {0};    /* the family's model description, read once; valid when family */
        tsr_runner *runner = NULL;
        tsr_nodes *nodes = NULL;        /* node 0 of a multi-node replica: the group of nodes */
        tsr_backend *backend = NULL;    /* the CPU backend every forward runs on; freed after the runner */
        tsr_block_hash_algo hash_algo = TSR_BLOCK_HASH_SHA256;
        tsr_worker_plan plan;
        uint32_t pp_layers[TSR_RUNNER_MAX_STAGES] = {0};
        uint32_t pp = 1;
        uint8_t *mi_full = NULL, *mi_lean = NULL;
        size_t mi_full_len = 0, mi_lean_len = 0;
        char err[1024] = "";
        tsr_curve curve = {0};
        tsr_gen_override gen_override;
        tsr_gen_defaults gen_defaults;
        tsr_cudagraph_sizes graph_sizes;        /* CUDA graphs' batch sizes */
        bool gen_no_file = false;
        char gen_text[256];
        int rc = TSR_EXIT_CONFIG;
        tsr_log_level level;
        tsr_status st;

        tsr_log_init("tessera-worker", TSR_LOG_INFO);
        tsr_log_set_thread("io");
        tsr_config_init(&cfg);
        if (tsr_config_parse(&cfg, argc, argv, true, err, sizeof(err)) != TSR_OK ||
            (!cfg.help && !cfg.version && tsr_config_validate(&cfg, err, sizeof(err)) != TSR_OK)) {
                fprintf(stderr, "tessera-worker: error: %s\n", err);
                goto out;
        }
        if (cfg.help) {
                tsr_config_print_help(stdout, "usage: tessera-worker MODEL --listen tcp://HOST:PORT [options]",
                                      TSR_OWNER_WORKER);
                rc = TSR_EXIT_OK;
                goto out;
        }
        if (cfg.version) {
                printf("tessera-worker %s\n", TSR_VERSION);
                rc = TSR_EXIT_OK;
                goto out;
        }
        if (cfg.log_level && tsr_log_parse_level(cfg.log_level, &level))
                tsr_log_set_level(level);
        if (!cfg.model) {
                fprintf(stderr, "tessera-worker: error: the following arguments are required: MODEL\n");
                goto out;
        }
        {       /* flags accepted that change nothing here, by design (docs/configuration.md) */
                const char *notes[16];
                size_t n = tsr_config_noop_notes(&cfg, TSR_OWNER_WORKER, notes, 16);
                for (size_t i = 0; i < n; i++)
                        log_info("%s", notes[i]);
        }
        /* Like the key files below, checked before the (slow) model load: exit 2 at once. */
        if (tsr_gen_override_parse(cfg.override_generation_config, &gen_override, err, sizeof(err)) != TSR_OK) {
                fprintf(stderr, "tessera-worker: error: %s\n", err);
                goto out;
        }
        /* Key files are checked before the (slow) model load: a bad one is exit 2 at once. */
        if (tsr_curve_load(&curve, cfg.zmq_curve_secret_file, cfg.zmq_curve_peers_file, err, sizeof(err)) !=
            TSR_OK) {
                fprintf(stderr, "tessera-worker: error: %s\n", err);
                goto out;
        }

        tsr_notify_loading_begin(cfg.model);   /* systemd: EXTEND_TIMEOUT_USEC while the load progresses */
        st = tsr_model_meta_load(cfg.model, &meta, err, sizeof(err));
        if (st != TSR_OK) {
                log_error("cannot load model %s: %s", cfg.model, err);
                goto out;
        }
        /* --load-format names the format the model must have: the loader goes by the files
         * (a directory of safetensors, or one GGUF file), so a mismatch is refused. */
        if (strcmp(cfg.load_format, "auto") != 0 &&
            strcmp(strcmp(meta->format, "gguf") == 0 ? "gguf" : "safetensors", cfg.load_format) != 0) {
                fprintf(stderr, "tessera-worker: error: argument --load-format: '%s' does not match %s, which is %s "
                        "(supported here: auto, %s)\n", cfg.load_format, cfg.model,
                        strcmp(meta->format, "gguf") == 0 ? "a GGUF file" : "a safetensors checkpoint directory",
                        strcmp(meta->format, "gguf") == 0 ? "gguf" : "safetensors");
                goto out;
        }
        /* The model's family reads its config once, into the description the KV sizing,
         * the loader and the forward all use.  A model whose family cannot read its config
         * (a missing field, a rope type, a bias) exits here, before any socket is bound; a
         * model of no family (e.g. Qwen2 today) is served as metadata only. */
        family = tsr_family_find(meta->format, meta->architecture, meta->model_type);
        if (family && tsr_model_desc_read(family, cfg.model, strcmp(meta->format, "gguf") == 0, &desc, err,
                                          sizeof(err)) != TSR_OK) {
                log_error("cannot load model %s: %s", cfg.model, err);
                goto out;
        }
        st = tsr_gen_defaults_resolve(cfg.generation_config, meta, &gen_override, &gen_defaults, &gen_no_file, err,
                                      sizeof(err));
        if (st != TSR_OK) {
                log_error("--generation-config %s: %s", cfg.generation_config, err);
                goto out;
        }
        tsr_gen_defaults_format(&gen_defaults, gen_text, sizeof(gen_text));
        if (gen_no_file)
                log_info("--generation-config %s: no generation_config.json there; no defaults from a file",
                         cfg.generation_config);
        log_info("default sampling parameters (--generation-config %s, --override-generation-config %s): %s",
                 cfg.generation_config, cfg.override_generation_config ? cfg.override_generation_config : "{}",
                 gen_text);
        if ((st = check_parallel(&cfg, meta, family ? &desc : NULL, pp_layers, err, sizeof(err))) != TSR_OK) {
                fprintf(stderr, "tessera-worker: error: %s\n", err);
                goto out;
        }
        uint32_t tp = (uint32_t)cfg.tensor_parallel_size;
        if (cfg.pipeline_parallel_size > 1) {
                char line[512];
                size_t o = 0;
                pp = (uint32_t)cfg.pipeline_parallel_size;
                for (uint32_t s = 0, first = 0; s < pp && o < sizeof line; first += pp_layers[s++])
                        o += (size_t)snprintf(line + o, sizeof line - o, "%s%u..%u", s ? ", " : "", first,
                                              first + pp_layers[s] - 1);
                if (cfg.nnodes > 1) {
                        uint32_t k = pp / (uint32_t)cfg.nnodes, s0 = (uint32_t)cfg.node_rank * k;
                        char which[48];
                        if (k == 1)
                                snprintf(which, sizeof which, "stage %u", s0);
                        else
                                snprintf(which, sizeof which, "stages %u..%u", s0, s0 + k - 1);
                        log_info("pipeline parallel: %u stages on %d nodes, this one (node rank %d%s) runs %s%s: "
                                 "layers [%s]%s", pp, cfg.nnodes, cfg.node_rank,
                                 cfg.headless ? ", headless" : ", the leader", which,
                                 tp > 1 ? " on its tensor-parallel rank threads" : "", line,
                                 getenv("VLLM_PP_LAYER_PARTITION") ? " (VLLM_PP_LAYER_PARTITION)" : "");
                } else if (tp > 1) {
                        log_info("pipeline parallel: %u stages x tensor parallel: %u ranks each = %u rank threads in "
                                 "this process (rank = stage x %u + tp rank), layers [%s]%s", pp, tp, pp * tp, tp,
                                 line, getenv("VLLM_PP_LAYER_PARTITION") ? " (VLLM_PP_LAYER_PARTITION)" : "");
                } else {
                        log_info("pipeline parallel: %u stages (ranks) in this process, layers [%s]%s", pp, line,
                                 getenv("VLLM_PP_LAYER_PARTITION") ? " (VLLM_PP_LAYER_PARTITION)" : "");
                }
        } else if (tp > 1) {
                log_info("tensor parallel: %u ranks (threads) in this process, every layer split across them", tp);
        }
        /* Each rank's kernel pool gets an even share of the cores (--cpu-threads, else the
         * physical cores it may run on) among the ranks that compute at once, at least one thread:
         * max(1, cores / tp).  The stages of a step run one after another (no micro-batches
         * yet), so each stage may use every core while it runs; a stage's tp ranks run at
         * once and share them.  (cores / (tp x pp) left -pp 2 at half speed: benchmarks.md,
         * "A replica over two nodes".)  A multi-node replica's node holds one stage. */
        int rank_threads = cfg.cpu_threads;
        long ranks = (long)pp * (long)(tp > 1 ? tp : 1);
        /* A node of a multi-node replica runs pp / nnodes consecutive stages. */
        uint32_t node_stages = cfg.nnodes > 1 ? pp / (uint32_t)cfg.nnodes : 0;
        int node_stage = cfg.nnodes > 1 ? cfg.node_rank * (int)node_stages : -1;
        long concurrent = tp > 1 ? tp : 1;
        if (ranks > 1) {
                long cores = cfg.cpu_threads > 0 ? cfg.cpu_threads : tsr_cpu_default_threads();
                rank_threads = cores / concurrent > 1 ? (int)(cores / concurrent) : 1;
        }
        /* --kv-cache-dtype: bfloat16 and fp8 for the llama, llama4 and nemotron_h families (any
         * -tp / -pp), on the CPU or (llama: bfloat16, fp8 e4m3) on CUDA; refused before anything
         * loads. */
        tsr_dtype kv_dtype = TSR_DTYPE_F32;
        (void)tsr_kv_cache_dtype_parse(cfg.kv_cache_dtype, &kv_dtype);  /* config.c refused the rest */
        if ((st = tsr_runner_kv_dtype_check(family, kv_dtype, cfg.kv_cache_dtype, err, sizeof(err))) != TSR_OK) {
                fprintf(stderr, "tessera-worker: error: %s\n", err);
                goto out;
        }
        /* The device (--device): a GPU only for a family that runs there, in one rank
         * (--device auto then picks the CPU; --device cuda is refused). */
        char gpu_families[128], no_gpu_family[192];
        snprintf(no_gpu_family, sizeof no_gpu_family, "the model's family does not run on CUDA yet (supported: %s)",
                 tsr_family_names(tsr_family_has_device, gpu_families, sizeof gpu_families));
        const char *gpu_not_ok = !family                    ? "the model has no runner on any device"
                                 : !family->to_backend      ? no_gpu_family
                                 : family->device_refusal && family->device_refusal(&desc)
                                         ? family->device_refusal(&desc)
                                 : ranks > 1                ? "tensor or pipeline parallelism on CUDA is not supported yet"
                                 : cfg.nnodes > 1           ? "a multi-node replica on CUDA is not supported yet"
                                                            : NULL;
        st = tsr_runner_backend_for(cfg.device, gpu_not_ok, rank_threads, &backend, err, sizeof(err));
        if (st != TSR_OK) {
                log_error("cannot load model %s: %s", cfg.model, err);
                goto out;
        }
        bool on_gpu = !tsr_backend_host_memory(backend);
        if (on_gpu && kv_dtype == TSR_DTYPE_FP8_E5M2) {
                log_error("argument --kv-cache-dtype: '%s' is not supported on CUDA yet (supported there: auto, "
                          "bfloat16, fp8, fp8_e4m3; %s runs on the CPU backend: --device cpu)", cfg.kv_cache_dtype,
                          cfg.kv_cache_dtype);
                goto out;
        }
        /* --kv-cache-dtype auto: the model's dtype, as vLLM (bfloat16 where the weights are
         * bfloat16: on CUDA by default, on a CPU with AVX512-BF16); every family stores
         * bfloat16 KV. */
        if (!cfg.kv_cache_dtype || strcmp(cfg.kv_cache_dtype, "auto") == 0)
                kv_dtype = family ? tsr_runner_auto_kv_dtype(backend, cfg.dtype) : TSR_DTYPE_F32;
        size_t gpu_free = 0, gpu_total = 0;
        if (on_gpu)
                (void)tsr_backend_mem_info(backend, &gpu_free, &gpu_total);
        /* The KV cache of a GPU is sized by the runner once the weights are in. */
        bool kv_on_device = on_gpu && !cfg.kv_cache_memory_bytes && cfg.num_gpu_blocks_override <= 0;
        if (!on_gpu && cfg.gpu_memory_utilization != 0.9)
                log_info("--gpu-memory-utilization has no effect by design on the CPU backend: the KV cache is sized "
                         "by --kv-cache-memory-bytes (vLLM's CPU backend also sizes it from its own setting)");
        if (make_plan(&cfg, meta, family ? &desc : NULL, pp, pp > 1 ? pp_layers : NULL, node_stage, node_stages,
                      (uint32_t)cfg.tensor_parallel_size, gpu_total, kv_on_device, kv_dtype, &plan, err,
                      sizeof(err)) != TSR_OK) {
                log_error("%s", err);
                goto out;
        }
        if (!plan.state_slots && (cfg.mamba_block_size > 0 ||
                                  (cfg.mamba_cache_dtype && strcmp(cfg.mamba_cache_dtype, "auto") != 0) ||
                                  (cfg.mamba_ssm_cache_dtype && strcmp(cfg.mamba_ssm_cache_dtype, "auto") != 0)))
                log_info("--mamba-block-size / --mamba-cache-dtype / --mamba-ssm-cache-dtype have no effect: %s keeps "
                         "no recurrent (Mamba) state", meta->architecture ? meta->architecture : "this model");
        if (plan.state_slots) {
                /* vLLM (0.11+) leaves prefix caching off by default for hybrid Mamba models
                 * and, asked for it, runs its experimental Mamba prefix caching: the state
                 * kept at every state block a step passes, so a hit ends at one of those
                 * (worker/engine/state_cache.h). */
                uint32_t running = plan.state_slots, bs = (uint32_t)cfg.block_size;
                if (cfg.enable_prefix_caching == TSR_TRI_TRUE) {
                        /* vLLM 0.11-0.12 keeps the state at every mamba block, a multiple of the
                         * scan's chunk_size (its attention blocks grow to match; ours stay) */
                        plan.state_block = cfg.mamba_block_size > 0 ? (uint32_t)cfg.mamba_block_size
                                           : desc.state_chunk  ? (desc.state_chunk + bs - 1) / bs * bs
                                                               : bs;
                        log_info("prefix caching on for a hybrid model with recurrent (Mamba) state (experimental, as "
                                 "in vLLM): the state is kept every %u tokens (--mamba-block-size), and a hit ends at "
                                 "one of those", plan.state_block);
                        if (running > plan.max_num_seqs)
                                running = plan.max_num_seqs;
                } else {
                        cfg.enable_prefix_caching = TSR_TRI_FALSE;
                        log_info("prefix caching disabled: the model keeps recurrent (Mamba) state per request "
                                 "(vLLM's default for hybrid models; --enable-prefix-caching turns it on)");
                }
                log_info("# state slots: %u (%.2f MB each): at most %u requests run at once", plan.state_slots,
                         (double)plan.state_slot_bytes / 1e6, running);
                plan.prefill_align = desc.scan_chunk;
                if (plan.prefill_align && plan.prefill_align <= plan.max_num_batched_tokens)
                        log_info("the Mamba scan runs whole chunks of %u tokens in its chunked form: prefill pieces "
                                 "end at multiples of %u", plan.prefill_align, plan.prefill_align);
                else if (plan.prefill_align)
                        log_info("the Mamba scan runs whole chunks of %u tokens in its chunked form; "
                                 "--max-num-batched-tokens %u is smaller, so prefill pieces are not aligned to them",
                                 plan.prefill_align, plan.max_num_batched_tokens);
        }
        if (plan.n_kv_tables > 1)
                log_info("hybrid KV cache: %u block tables per request (full attention + chunked-local attention, "
                         "chunk %u); the chunked tables free their blocks behind the current chunk",
                         plan.n_kv_tables, plan.kv_chunk[plan.n_kv_tables - 1]);
        log_info("model %s: %s, %s format, vocab %u, max_model_len %u, %zu eos ids, chat template %s",
                 meta->path, meta->architecture ? meta->architecture : "?", meta->format, meta->vocab_size,
                 plan.max_model_len, meta->n_eos_token_ids, meta->chat_template ? "yes" : "no");
        /* The model runner: weights and KV pool.  A model of no family still serves its
         * metadata (and refuses Submit), so routers can list it; a model of a family that
         * the runner cannot load exits here, before any socket is bound. */
        tsr_load_stats lstats = {0};
        /* --dtype float32 computes o_proj and down_proj in the canonical split (R7) at
         * every -tp, so -tp 1 and -tp N give the same bits. */
        bool f32 = cfg.dtype && (strcmp(cfg.dtype, "float32") == 0 || strcmp(cfg.dtype, "float") == 0);
        /* CUDA graphs of decode steps: vLLM's sizes (worker/model/cudagraph.h), recorded
         * by the runner at start-up on a GPU. */
        if (tsr_cudagraph_sizes_for(cfg.compilation_config, cfg.enforce_eager, plan.max_num_seqs, &graph_sizes, err,
                                    sizeof(err)) != TSR_OK) {
                log_error("%s", err);
                goto out;
        }
        if (graph_sizes.compile_keys)
                log_info("--compilation-config: level and mode have no effect by design: Tessera compiles nothing at "
                         "run time (its kernels are built ahead of time)");
        if (!on_gpu && (cfg.enforce_eager || cfg.compilation_config))
                log_info("--enforce-eager and --compilation-config have no effect by design: the CPU backend never "
                         "captures graphs, it always runs eagerly");
        else if (on_gpu && graph_sizes.n == 0)
                log_info("CUDA graphs off (%s): every step runs eagerly",
                         cfg.enforce_eager ? "--enforce-eager" : "cudagraph_mode NONE");
        tsr_graph_opts graph_opts = {
                .sizes = graph_sizes.sizes,
                .n_sizes = on_gpu ? graph_sizes.n : 0,
                .table_width = (plan.max_model_len + (uint32_t)cfg.block_size - 1) / (uint32_t)cfg.block_size,
                .max_seq_len = (uint32_t)cfg.max_seq_len_to_capture < plan.max_model_len
                                       ? (uint32_t)cfg.max_seq_len_to_capture
                                       : plan.max_model_len,
        };
        tsr_runner_opts ropts = {.dtype = cfg.dtype, .backend = backend, .pp = pp, .pp_layers = pp_layers,
                                 .stage_threads = rank_threads, .pp_timeout_ms = pp_timeout_ms(),
                                 .tp = tp, .node_stage_only = node_stage >= 0,
                                 .node_stage = node_stage >= 0 ? (uint32_t)node_stage : 0,
                                 .node_stages = node_stages,
                                 .tp_canonical = f32 && family && family->tp_shard && !on_gpu,
                                 .expert_parallel = cfg.enable_expert_parallel,
                                 .quantization = cfg.quantization,
                                 .max_step_tokens = plan.max_num_batched_tokens, .max_logit_rows = plan.max_num_seqs,
                                 .gpu_memory_utilization = cfg.gpu_memory_utilization, .kv_dtype = kv_dtype,
                                 .graphs = graph_opts};
        if (!family) {
                log_warn("model %s: no model runner (no model family serves architecture %s); serving its metadata "
                         "only, Submit is refused", cfg.model,
                         meta->architecture ? meta->architecture : meta->model_type ? meta->model_type : "?");
        } else if ((st = tsr_runner_new(cfg.model, &desc, &ropts, plan.kv_blocks_total, (uint32_t)cfg.block_size,
                                        plan.state_slots, &runner, &lstats, err, sizeof(err))) != TSR_OK) {
                log_error("cannot load model %s: %s", cfg.model, err);
                goto out;
        } else {
                if (kv_on_device)       /* the runner sized it from the device's memory */
                        plan.kv_blocks_total = tsr_runner_kv_blocks(runner);
                /* several ranks: what each read of the file, summed (shared tensors and
                 * whole ones read by each, column shares reading every row) */
                char read_by[48] = "in the file";
                if (tsr_runner_stages(runner) > 1)
                        snprintf(read_by, sizeof read_by, "read from the file by the %u ranks",
                                 tsr_runner_stages(runner));
                log_info("loaded %zu tensors (%.1f MB %s, %.1f MB as float32, %.1f MB resident) in %.2f s, "
                         "%.1f MB/s; KV pool %.1f MB%s",
                         lstats.n_tensors, (double)lstats.file_bytes / 1e6, read_by, (double)lstats.f32_bytes / 1e6,
                         (double)lstats.resident_bytes / 1e6,
                         lstats.seconds, lstats.seconds > 0 ? (double)lstats.file_bytes / 1e6 / lstats.seconds : 0.0,
                         (double)(plan.kv_blocks_total * plan.kv_block_bytes + plan.state_slots * plan.state_slot_bytes) /
                                 1e6, node_stage >= 0 ? " (this node's stages; the one with the most KV per block)"
                                      : pp > 1 ? " on the rank with the most KV per block (each holds its layers' KV)"
                                      : ranks > 1 ? " on each rank (each holds its share of the KV heads)" : "");
        }
        /* A multi-node replica: a follower serves its stage from here on; node 0 meets the
         * followers and serves with the smallest KV capacity among the nodes. */
        if (node_stage >= 0) {
                char fp[1024];
                /* the dtypes as resolved: nodes whose CPUs resolve auto differently disagree */
                node_fingerprint(&cfg, pp, pp_layers, runner ? tsr_runner_dtype(runner) : "none", kv_dtype, fp,
                                 sizeof fp);
                tsr_nodes_cfg nc = {.nnodes = (uint32_t)cfg.nnodes, .node_rank = (uint32_t)cfg.node_rank,
                                    .master_addr = cfg.master_addr, .master_port = (uint16_t)cfg.master_port,
                                    .fingerprint = fp, .join_timeout_ms = node_join_timeout_ms(),
                                    .step_timeout_ms = pp_timeout_ms(), .kv_blocks = plan.kv_blocks_total,
                                    .state_slots = plan.state_slots, .n_kv_tables = plan.n_kv_tables};
                if (!runner) {
                        log_error("model %s: a multi-node replica needs a model runner", cfg.model);
                        goto out;
                }
                if (cfg.headless) {
                        rc = follow(&nc, runner, &desc);
                        goto out;
                }
                st = tsr_nodes_lead(&nc, &plan.kv_blocks_total, &plan.state_slots, &nodes, err, sizeof err);
                if (st != TSR_OK) {
                        log_error("the nodes did not meet: %s", err);
                        rc = st == TSR_E_PROTO ? TSR_EXIT_CONFIG : TSR_EXIT_RUNTIME;
                        goto out;
                }
                tsr_runner_set_nodes(runner, nodes);
        }
        if (kv_on_device && runner) {
                if (plan.kv_blocks_total * cfg.block_size < plan.max_model_len) {
                        /* vLLM's start-up error, word for word */
                        log_error("The model's max seq len (%u) is larger than the maximum number of tokens that can "
                                  "be stored in KV cache (%llu). Try increasing `gpu_memory_utilization` or "
                                  "decreasing `max_model_len` when initializing the engine.", plan.max_model_len,
                                  (unsigned long long)(plan.kv_blocks_total * cfg.block_size));
                        goto out;
                }
        }
        /* Concurrency: requests of max_model_len the blocks hold (a hybrid's per-request
         * blocks, vLLM's get_max_concurrency_for_kv_cache_config); tokens: vLLM's
         * num_blocks // n_groups * block_size for a hybrid. */
        double concurrency = plan.n_kv_tables > 1 && plan.kv_blocks_per_request
                                     ? (double)plan.kv_blocks_total / (double)plan.kv_blocks_per_request
                                     : (double)plan.kv_blocks_total * cfg.block_size / plan.max_model_len;
        uint64_t kv_cache_tokens = plan.kv_blocks_total / (plan.n_kv_tables ? plan.n_kv_tables : 1) *
                                   (uint64_t)cfg.block_size;
        if (plan.n_kv_tables > 1)
                log_info("# KV blocks: %llu (block size %d, %u block tables per request, at most %llu blocks for a "
                         "request of max_model_len %u: %.2fx concurrency)", (unsigned long long)plan.kv_blocks_total,
                         cfg.block_size, plan.n_kv_tables, (unsigned long long)plan.kv_blocks_per_request,
                         plan.max_model_len, concurrency);
        else
                log_info("# KV blocks: %llu (block size %d, %.2fx concurrency at max_model_len %u)",
                         (unsigned long long)plan.kv_blocks_total, cfg.block_size, concurrency, plan.max_model_len);
        log_info("KV cache dtype %s (--kv-cache-dtype %s): %llu bytes per block, %s", tsr_dtype_get_info(kv_dtype)->name,
                 cfg.kv_cache_dtype ? cfg.kv_cache_dtype : "auto", (unsigned long long)plan.kv_block_bytes,
                 tsr_dtype_is_fp8(kv_dtype)       ? "1 byte per element: 4x the tokens of float32 in the same memory"
                 : kv_dtype == TSR_DTYPE_BF16 ? "2 bytes per element: 2x the tokens of float32 in the same memory"
                                              : "4 bytes per element");
        {       /* vLLM V1's capacity line, word for word (kv_cache_utils), for runbooks that grep it */
                char kv_tokens[32], model_len[32];
                log_info("%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
                         on_gpu ? "GPU" : "CPU",
                         thousands(kv_cache_tokens, kv_tokens, sizeof(kv_tokens)),
                         thousands(plan.max_model_len, model_len, sizeof(model_len)), concurrency);
        }
        if (tsr_block_hash_algo_parse(cfg.prefix_caching_hash_algo, &hash_algo) != TSR_OK) {
                log_error("--prefix-caching-hash-algo %s is not supported", cfg.prefix_caching_hash_algo);
                goto out;
        }
        plan.weight_bytes = lstats.resident_bytes;
        plan.tensor_parallel_size = (uint32_t)(cfg.tensor_parallel_size > 0 ? cfg.tensor_parallel_size : 1);
        plan.pipeline_parallel_size = (uint32_t)(cfg.pipeline_parallel_size > 0 ? cfg.pipeline_parallel_size : 1);
        if (tsr_link_pack_model_info(&cfg, meta, &gen_defaults, &plan, runner != NULL, runner ? tsr_runner_dtype(runner) : "float32", &mi_full, &mi_full_len, &mi_lean, &mi_lean_len) != TSR_OK) {
                log_error("model info for %s does not fit in one protocol frame", meta->path);
                goto out;
        }

        /* The engine and io threads until a stop (serve.h). */
        rc = TSR_EXIT_RUNTIME;
        tsr_worker_serve_opts so = {
                .cfg = &cfg,
                .meta = meta,
                .plan = &plan,
                .model = runner ? tsr_runner_model(runner) : NULL,
                .hash_algo = hash_algo,
                .model_info_full = mi_full,
                .model_info_full_len = mi_full_len,
                .model_info_lean = mi_lean,
                .model_info_lean_len = mi_lean_len,
                .curve = &curve,
                .on_listening = tsr_notify_ready,     /* systemd: READY=1 once the sockets are bound */
                .on_stopping = tsr_notify_stopping,   /* systemd: STOPPING=1 at the first SIGTERM */
                .alive = tsr_notify_alive,            /* systemd WatchdogSec: WATCHDOG=1 from the engine thread */
                .alive_interval_ms = tsr_notify_watchdog_interval_ms(),
                .log_stats_interval_s = cfg.disable_log_stats ? 0 : stats_interval_s(),
        };
        if (tsr_worker_serve(&so) == TSR_OK)
                rc = TSR_EXIT_OK;
out:
        tsr_notify_loading_end();
        free(mi_full);
        free(mi_lean);
        tsr_runner_free(&runner);   /* after the engine thread has stopped */
        tsr_nodes_free(&nodes);     /* after the runner's last forward */
        tsr_backend_free(&backend); /* after the runner, which borrowed it; stops its threads */
        tsr_model_desc_done(&desc);
        tsr_model_meta_free(&meta);
        tsr_curve_done(&curve);
        tsr_config_done(&cfg);
        return rc;
}
