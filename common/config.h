/* config.h - command-line flags and `--config FILE.yaml`, vLLM's names.
 *
 * Every Tessera binary (tessera, tessera-router, tessera-worker) accepts every flag
 * in the table (config.c), so one YAML file and one runbook serve all processes; each
 * process uses the flags it owns (TSR_OWNER_*), and `tessera serve` hands each child
 * only the flags that child owns (tsr_config_child_argv).
 *
 * Rules, as vLLM's argparse has them (docs/configuration.md):
 *   - `--name value` and `--name=value`; dashes and underscores are interchangeable;
 *   - booleans are `--flag` / `--no-flag`;
 *   - list flags (`--served-model-name a b`, `--api-key k1 k2`, `--worker ...`) take one
 *     or more values up to the next `-`-prefixed argument, and may repeat;
 *   - `--max-model-len` accepts 1k (=1000) and 1K (=1024) style suffixes;
 *   - `--config FILE.yaml` (must end .yaml/.yml): a flat map whose keys are flag names
 *     without the leading dashes (either spelling); `true` sets a boolean, `false` is
 *     dropped with a warning exactly as vLLM drops it (use `no-NAME: true`), lists give
 *     repeated values, the key `model` gives the model;
 *   - precedence: command line > YAML > defaults.
 * An unknown flag, an unknown YAML key, a missing value or a bad value is an error
 * whose message names the flag (and, for YAML, the file and the key).
 *
 * The struct is filled once at start-up, validated, then read-only (const) for the
 * life of the process.  Strings are heap copies owned by the struct. */
#ifndef TSR_CONFIG_H
#define TSR_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include "tsr_status.h"

enum tsr_owner {
        TSR_OWNER_ROUTER = 1u << 0,
        TSR_OWNER_WORKER = 1u << 1,
        TSR_OWNER_LAUNCHER = 1u << 2,   /* `tessera serve` itself */
        TSR_OWNER_ALL = 7u,
};

typedef struct tsr_strlist {
        char **items;
        size_t n;
} tsr_strlist;

/* Tri-state for vLLM's `None` booleans: unset means "the model/platform decides". */
enum { TSR_TRI_UNSET = -1, TSR_TRI_FALSE = 0, TSR_TRI_TRUE = 1 };

/* Room for the option table in config.c (a static assert there keeps it honest). */
#define TSR_CONFIG_MAX_OPTS 96

typedef struct tsr_config {
        /* ---- model (worker) ---- */
        char *model;                       /* positional MODEL, --model, or YAML `model` */
        tsr_strlist served_model_name;     /* router+worker; empty = model path */
        char *tokenizer;                   /* NULL = the model's */
        int max_model_len;                 /* 0 = from the model's config */
        char *dtype;                       /* auto|half|float16|bfloat16|float|float32 */
        char *device;                      /* auto|cuda|cpu: where the worker's forward runs */
        char *kv_cache_dtype;              /* auto|bfloat16|fp8|fp8_e4m3|fp8_e5m2|fp8_inc|fp8_ds_mla */
        char *mamba_cache_dtype;           /* auto|float32|float16 (float16 refused) */
        char *mamba_ssm_cache_dtype;       /* auto|float32|float16 (float16 refused) */
        char *quantization;                /* NULL = from the checkpoint */
        char *load_format;                 /* auto|safetensors|gguf|dummy */
        char *generation_config;           /* auto|vllm|DIR */
        char *override_generation_config;  /* JSON object text, "{}" default */
        int max_logprobs;                  /* 20; -1 = vocab size */
        long long seed;                    /* 0 */
        bool trust_remote_code;
        bool calculate_kv_scales;          /* refused (issue #15): the scales are the checkpoint's */
        bool enforce_eager;
        char *compilation_config;       /* JSON object text (worker/model/cudagraph.h), NULL: {} */
        int max_seq_len_to_capture;     /* 8192 */

        /* ---- parallelism (worker) ---- */
        int tensor_parallel_size;          /* -tp, 1 */
        int pipeline_parallel_size;        /* -pp, 1 */
        int data_parallel_size;            /* -dp, 1 (only 1 supported for now: tsr_config_validate) */
        bool enable_expert_parallel;       /* MoE experts whole per tensor-parallel rank (issue #14) */
        char *distributed_executor_backend;/* NULL = auto; mp|uni */
        /* A replica over several nodes (issue #20): pp / nnodes pipeline stages per node, node 0
         * schedules and serves; the others run --headless (worker/parallel/nodes.h). */
        int nnodes;                        /* -n, 1 */
        int node_rank;                     /* -r, 0 */
        char *master_addr;                 /* node 0's address, "127.0.0.1" */
        int master_port;                   /* 29501 */
        bool headless;                     /* a follower node: no router, no Submit/Status endpoint */

        /* ---- cache and scheduler (worker) ---- */
        int block_size;                    /* 16; one of 1 8 16 32 64 128 256 */
        int enable_prefix_caching;         /* TSR_TRI_*; unset = on */
        char *prefix_caching_hash_algo;    /* sha256|sha256_cbor|xxhash (router mirrors it) */
        double gpu_memory_utilization;     /* 0.9, in (0, 1] */
        long long kv_cache_memory_bytes;   /* 0 = derived (CPU: 4 GiB capped by free RAM) */
        int num_gpu_blocks_override;       /* 0 = none */
        int max_num_seqs;                  /* 0 = platform default */
        int mamba_block_size;              /* 0 = the model's scan chunk rounded up to block_size */
        int max_num_batched_tokens;        /* 0 = platform default */
        int enable_chunked_prefill;        /* TSR_TRI_*; unset = on */
        int max_num_partial_prefills;      /* 1 */
        int long_prefill_token_threshold;  /* 0 */
        char *scheduling_policy;           /* fcfs|priority */
        bool async_scheduling;
        double swap_space;                 /* GiB, 4; no effect by design (recompute preemption) */
        int shutdown_timeout;              /* seconds in-flight requests may finish after SIGTERM; 0 = abort */
        int cpu_threads;                   /* Tessera: CPU backend threads, 0 = all cores */
        char *worker_listen;               /* Tessera: --listen, ZeroMQ ROUTER endpoint */
        char *status_listen;               /* Tessera: Status PUB endpoint; NULL = listen port + 1 */
        int status_interval_ms;            /* Tessera: 100 */

        /* ---- HTTP front end (router) ---- */
        char *host;                        /* NULL = all interfaces, as vLLM */
        int port;                          /* 8000 */
        tsr_strlist api_key;               /* also env VLLM_API_KEY; CLI wins */
        char *chat_template;               /* file or inline template; NULL = the model's */
        char *response_role;               /* "assistant" */
        char *root_path;
        bool enable_log_requests;
        bool disable_log_requests;         /* deprecated in vLLM; turns off the router's per-request line */
        bool disable_log_stats;
        bool enable_prompt_tokens_details;
        bool enable_force_include_usage;
        bool enable_request_id_headers;
        bool enable_server_load_tracking;
        bool enable_tokenizer_info_endpoint;
        bool enable_auto_tool_choice;
        char *tool_call_parser;
        char *reasoning_parser;
        char *show_hidden_metrics_for_version;
        int stream_interval;               /* 1 */
        bool disable_uvicorn_access_log;   /* no effect by design: the router writes no access log */
        long long max_request_body;        /* Tessera: 32 MiB; 413 past it */
        int router_threads;                /* Tessera: event loops on one port, 1 */
        int request_timeout_secs;          /* Tessera (SGLang router's name): 1800; 0 = none */
        tsr_strlist worker;                /* Tessera: --worker tcp://HOST:PORT (router), repeatable */
        char *zmq_curve_secret_file;       /* Tessera: this process's CURVE secret key (router+worker) */
        char *zmq_curve_peers_file;        /* Tessera: trusted/allowed CURVE public keys (router+worker) */
        tsr_strlist worker_dns;            /* Tessera: --worker-dns NAME:PORT (router), repeatable */
        char *routing_policy;              /* Tessera: kv|least_load|round_robin (router), "kv" */

        /* ---- every process ---- */
        char *log_level;                   /* Tessera: debug|info|warning|error; NULL = info */
        char *config_file;                 /* --config, as given */

        /* ---- what the command line asked for, not options ---- */
        bool help;                         /* --help / -h seen */
        bool version;                      /* --version seen */

        /* Private to config.c: which options the command line or YAML set (what
         * tsr_config_child_argv renders), one byte per table entry. */
        unsigned char _set[TSR_CONFIG_MAX_OPTS];
} tsr_config;

/* Defaults (vLLM's where vLLM has the flag). */
void tsr_config_init(tsr_config *cfg);
/* Free every string the struct owns; the struct can be init'ed again. */
void tsr_config_done(tsr_config *cfg);

/* Parse argv[1..argc-1] (argv[0] is the program), loading `--config` first so that the
 * command line wins over it.  `allow_model`: whether a positional MODEL is accepted
 * (router: false).  On error returns TSR_E_INVAL (or TSR_E_IO / TSR_E_NOTFOUND for an
 * unreadable config file) and writes a one-line message to err, e.g.
 *   "argument --block-size: invalid choice: '17' (choose from 1, 8, 16, 32, 64, 128, 256)"
 *   "/etc/tessera.yaml: key 'tensor-parallel-sise': unknown option"
 * A parse that sees --help or --version sets cfg->help / cfg->version and returns TSR_OK. */
tsr_status tsr_config_parse(tsr_config *cfg, int argc, char **argv, bool allow_model,
                            char *err, size_t errlen);

/* Load one YAML file into cfg (keys override what is there).  Same error rules. */
tsr_status tsr_config_load_yaml(tsr_config *cfg, const char *path, char *err, size_t errlen);

/* Checks after parsing: every range and choice again, rules across flags, and the
 * values Tessera accepts as vLLM's but cannot honour yet (a --kv-cache-dtype other than
 * auto, bfloat16 or fp8*, a --quantization other than ModelOpt's, the tool-call and
 * reasoning parsers, ...: the list is in docs/configuration.md, "Flag status").  Returns TSR_OK, TSR_E_INVAL for a bad value
 * or TSR_E_UNSUPPORTED for one not implemented yet, with one line in err naming the
 * flag, the value and what is supported, e.g.
 *   "argument --kv-cache-dtype: 'fp8_inc' is not supported yet: the KV cache is float32, bfloat16,
 *    fp8 e4m3 or fp8 e5m2 (supported: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"
 * Every process calls it, whichever process owns the flag, so `tessera serve` refuses
 * before it starts a child. */
tsr_status tsr_config_validate(const tsr_config *cfg, char *err, size_t errlen);

/* The flags of `owner` (TSR_OWNER_* bits) that are set to a non-default value which is
 * accepted and, by design, changes nothing (--enforce-eager on the CPU backend,
 * --swap-space, --trust-remote-code, ...): one line each saying why, for the process to
 * log at start-up.  Writes up to `cap` pointers to static strings into lines[] and
 * returns how many. */
size_t tsr_config_noop_notes(const tsr_config *cfg, unsigned owner, const char **lines, size_t cap);

/* Print usage: every flag owned by any bit of `owner_mask`, with its default. */
void tsr_config_print_help(FILE *out, const char *usage_line, unsigned owner_mask);

/* Arguments for a child process: every option set on the command line or in YAML whose
 * owner includes `owner`, rendered back as command-line flags ("--name", "value"...),
 * plus the positional model first when `owner` is the worker.  The array is
 * NULL-terminated; free it with tsr_config_free_argv.  Never includes --config (the
 * launcher already merged it). */
tsr_status tsr_config_child_argv(const tsr_config *cfg, unsigned owner, char ***ret_argv, int *ret_argc);
void tsr_config_free_argv(char **argv);

/* Parse a size like "32M", "4GiB", "1000", "1k" (=1000) / "1K" (=1024).  Helpers for
 * size-valued flags; also used by the worker for --kv-cache-memory. */
tsr_status tsr_parse_size(const char *s, long long *ret);

/* The --tool-call-parser and --reasoning-parser names accepted (NULL-terminated);
 * the router's tables (router/tools/) implement each. */
const char *const *tsr_config_tool_call_parsers(void);
const char *const *tsr_config_reasoning_parsers(void);

#endif
