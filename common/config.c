/* config.c - the flag table, the command-line parser, the YAML loader, help and
 * child argv.  See config.h for the rules; docs/configuration.md for users.
 *
 * One table (opts[]) drives everything: parsing, defaults, range checks, --help and
 * the argv handed to children, so a flag cannot exist in one place and be missing in
 * another.  Defaults are written as text and go through the same converters as user
 * input, so what --help shows is what tsr_config_init sets. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

typedef enum opt_type {
        OPT_STR,        /* char * */
        OPT_LIST,       /* tsr_strlist, 1+ values per flag, repeats append */
        OPT_INT,        /* int */
        OPT_INT_HR,     /* int, also 1k / 1K suffixes (vLLM's human_readable_int) */
        OPT_LL,         /* long long */
        OPT_SIZE,       /* long long byte count via tsr_parse_size */
        OPT_DOUBLE,     /* double */
        OPT_BOOL,       /* bool, --x / --no-x */
        OPT_TRI,        /* int TSR_TRI_*, --x / --no-x, unset by default */
} opt_type;

typedef enum opt_group {
        GRP_MODEL,
        GRP_PARALLEL,
        GRP_CACHE,
        GRP_FRONTEND,
        GRP_TESSERA,
        GRP_COUNT,
} opt_group;

typedef struct tsr_opt {
        const char *name;               /* long name without "--", vLLM's dashes */
        const char *alias;              /* short alias with its dash ("-tp"), or NULL */
        const char *alt;                /* second long name ("kv-cache-memory"), or NULL */
        opt_type type;
        unsigned owner;                 /* TSR_OWNER_* bits */
        opt_group group;
        size_t off;                     /* offsetof(tsr_config, field) */
        const char *def;                /* default as text; NULL = NULL / 0 / false / unset */
        const char *def_help;           /* what --help shows instead of def */
        const char *const *choices;     /* NULL-terminated, or NULL */
        long long min, max;             /* inclusive, integer types */
        double dmin, dmax;              /* OPT_DOUBLE; dmin excluded when dmin_open */
        bool dmin_open;
        const char *metavar;
        const char *help;
} tsr_opt;

/* Where a value came from, kept in cfg->_set (bits, so YAML-then-CLI keeps both). */
enum { SRC_YAML = 1u << 0, SRC_CLI = 1u << 1 };

/* offsetof plus a compile-time check that the field has the C type the entry claims:
 * a wrong pairing is a negative array size, not a silent memory overwrite. */
#define FIELD(f, T) (offsetof(tsr_config, f) + \
        0 * sizeof(char[__builtin_types_compatible_p(__typeof__(((tsr_config *)0)->f), T) ? 1 : -1]))

#define O_STR(n, f)  .name = n, .type = OPT_STR, .off = FIELD(f, char *)
#define O_LIST(n, f) .name = n, .type = OPT_LIST, .off = FIELD(f, tsr_strlist)
#define O_INT(n, f, lo, hi) .name = n, .type = OPT_INT, .off = FIELD(f, int), .min = lo, .max = hi
#define O_INT_HR(n, f, lo, hi) .name = n, .type = OPT_INT_HR, .off = FIELD(f, int), .min = lo, .max = hi
#define O_LL(n, f)   .name = n, .type = OPT_LL, .off = FIELD(f, long long), .min = LLONG_MIN, .max = LLONG_MAX
#define O_SIZE(n, f, lo, hi) .name = n, .type = OPT_SIZE, .off = FIELD(f, long long), .min = lo, .max = hi
#define O_DBL(n, f)  .name = n, .type = OPT_DOUBLE, .off = FIELD(f, double)
#define O_BOOL(n, f) .name = n, .type = OPT_BOOL, .off = FIELD(f, bool)
#define O_TRI(n, f)  .name = n, .type = OPT_TRI, .off = FIELD(f, int)

#define R TSR_OWNER_ROUTER
#define W TSR_OWNER_WORKER

static const char *const dtype_choices[] = {"auto", "half", "float16", "bfloat16", "float", "float32", NULL};
static const char *const kv_dtype_choices[] = {"auto",     "bfloat16", "fp8",        "fp8_e4m3",
                                               "fp8_e5m2", "fp8_inc",  "fp8_ds_mla", NULL};
/* vLLM's MambaDType */
static const char *const mamba_dtype_choices[] = {"auto", "float32", "float16", NULL};
static const char *const load_format_choices[] = {"auto", "safetensors", "gguf", "dummy", NULL};
static const char *const backend_choices[] = {"mp", "uni", NULL};
static const char *const device_choices[] = {"auto", "cuda", "cpu", NULL};
static const char *const block_size_choices[] = {"1", "8", "16", "32", "64", "128", "256", NULL};
static const char *const hash_algo_choices[] = {"sha256", "sha256_cbor", "xxhash", NULL};
static const char *const policy_choices[] = {"fcfs", "priority", NULL};
static const char *const routing_policy_choices[] = {"kv", "least_load", "round_robin", NULL};
static const char *const log_level_choices[] = {"debug", "info", "warning", "error", NULL};

/* Order is --help order within a group.  `model` must stay first and `config` last
 * (opt_model / opt_config rely on it; the tests would catch a move). */
static const tsr_opt opts[] = {
        /* ---- model ---- */
        {O_STR("model", model), .owner = W, .group = GRP_MODEL, .metavar = "MODEL",
         .help = "model directory or Hugging Face id (same as the positional MODEL)"},
        {O_LIST("served-model-name", served_model_name), .owner = R | W, .group = GRP_MODEL, .metavar = "NAME",
         .def_help = "the model path", .help = "names the API answers to; responses carry the first"},
        {O_STR("tokenizer", tokenizer), .owner = W, .group = GRP_MODEL, .metavar = "PATH",
         .def_help = "the model's", .help = "tokenizer directory; only the model's own for now"},
        {O_INT_HR("max-model-len", max_model_len, 0, INT_MAX), .owner = W, .group = GRP_MODEL, .metavar = "N",
         .def_help = "from the model's config", .help = "context length in tokens; 1k = 1000, 1K = 1024"},
        {O_STR("dtype", dtype), .owner = W, .group = GRP_MODEL, .metavar = "DTYPE", .def = "auto",
         .choices = dtype_choices, .help = "weight and activation precision"},
        {O_STR("device", device), .owner = W, .group = GRP_MODEL, .metavar = "DEVICE", .def = "auto",
         .choices = device_choices,
         .help = "where the forward runs: cuda (GPU 0), cpu, or auto (cuda when a device is there and the model's "
                 "family runs on it, else cpu)"},
        {O_STR("kv-cache-dtype", kv_cache_dtype), .owner = W, .group = GRP_MODEL, .metavar = "DTYPE",
         .def = "auto", .choices = kv_dtype_choices, .help = "element type of the KV cache: auto (the model's dtype: bfloat16 where the CPU holds the weights in bfloat16, else float32), bfloat16 (two bytes per element), or fp8 / fp8_e4m3 / "
                 "fp8_e5m2 (one byte per element, scaled); llama, llama4 and nemotron_h; bfloat16 and e5m2 on the CPU "
                 "backend only"},
        {O_STR("mamba-cache-dtype", mamba_cache_dtype), .owner = W, .group = GRP_MODEL, .metavar = "DTYPE",
         .def = "auto", .choices = mamba_dtype_choices,
         .help = "element type of a Mamba hybrid's recurrent state (conv and SSM): auto or float32, which is what "
                 "the CPU backend keeps (float16 is refused)"},
        {O_STR("mamba-ssm-cache-dtype", mamba_ssm_cache_dtype), .owner = W, .group = GRP_MODEL, .metavar = "DTYPE",
         .def = "auto", .choices = mamba_dtype_choices,
         .help = "element type of the SSM state alone (vLLM: auto follows --mamba-cache-dtype): auto or float32 "
                 "(float16 is refused)"},
        {O_BOOL("calculate-kv-scales", calculate_kv_scales), .owner = W, .group = GRP_MODEL,
         .help = "compute the fp8 KV cache scales from the first batch: refused (the scales are the checkpoint's, "
                 "else 1.0)"},
        {O_STR("quantization", quantization), .alias = "-q", .owner = W, .group = GRP_MODEL, .metavar = "METHOD",
         .def_help = "from the checkpoint",
         .help = "weight quantization method: modelopt (FP8), modelopt_fp4 (NVFP4) or fp8; must match the checkpoint"},
        {O_STR("load-format", load_format), .owner = W, .group = GRP_MODEL, .metavar = "FORMAT", .def = "auto",
         .choices = load_format_choices, .help = "weight file format; must match the model; dummy (random weights) is not supported yet"},
        {O_STR("generation-config", generation_config), .owner = W, .group = GRP_MODEL, .metavar = "SRC",
         .def = "auto", .help = "sampling defaults: auto (the model's), vllm (neutral) or a directory"},
        {O_STR("override-generation-config", override_generation_config), .owner = W, .group = GRP_MODEL,
         .metavar = "JSON", .def = "{}", .help = "JSON object laid over the sampling defaults"},
        {O_INT("max-logprobs", max_logprobs, -1, INT_MAX), .owner = W, .group = GRP_MODEL, .metavar = "N",
         .def = "20", .help = "largest logprobs a request may ask for; -1 = vocabulary size"},
        {O_LL("seed", seed), .owner = W, .group = GRP_MODEL, .metavar = "N", .def = "0",
         .help = "seed for sampling without a per-request seed"},
        {O_BOOL("trust-remote-code", trust_remote_code), .owner = W, .group = GRP_MODEL,
         .help = "no effect: Tessera never runs model code"},
        {O_BOOL("enforce-eager", enforce_eager), .owner = W, .group = GRP_MODEL,
         .help = "do not capture CUDA graphs; no effect: the CPU backend always runs eagerly"},
        {O_STR("compilation-config", compilation_config), .owner = W, .group = GRP_MODEL, .metavar = "JSON",
         .help = "CUDA graphs as vLLM's JSON: cudagraph_capture_sizes, max_cudagraph_capture_size, cudagraph_mode"},
        {O_INT("max-seq-len-to-capture", max_seq_len_to_capture, 1, INT_MAX), .owner = W, .group = GRP_MODEL,
         .metavar = "N", .def = "8192", .help = "decode steps with a longer sequence run without CUDA graphs"},

        /* ---- parallelism ---- */
        {O_INT("tensor-parallel-size", tensor_parallel_size, 1, 1024), .alias = "-tp", .owner = W,
         .group = GRP_PARALLEL, .metavar = "N", .def = "1", .help = "ranks each layer is split across: rank threads in the worker, per pipeline stage (llama, llama4 and nemotron_h families, --dtype float32)"},
        {O_INT("pipeline-parallel-size", pipeline_parallel_size, 1, 1024), .alias = "-pp", .owner = W,
         .group = GRP_PARALLEL, .metavar = "N", .def = "1", .help = "pipeline stages the layers are split into: one rank thread per stage in the worker "
                 "(VLLM_PP_LAYER_PARTITION=a,b,... overrides the split)"},
        {O_INT("data-parallel-size", data_parallel_size, 1, 1024), .alias = "-dp", .owner = W,
         .group = GRP_PARALLEL, .metavar = "N", .def = "1", .help = "independent engine replicas; only 1: run more workers behind the router instead"},
        {O_BOOL("enable-expert-parallel", enable_expert_parallel), .owner = W, .group = GRP_PARALLEL,
         .help = "MoE layers: each tensor-parallel rank holds whole experts (E / -tp, consecutive) instead of a "
                 "share of every expert; the same outputs (llama4, nemotron_h; no effect without MoE layers)"},
        {O_INT("nnodes", nnodes, 1, 64), .alias = "-n", .owner = W, .group = GRP_PARALLEL, .metavar = "N",
         .def = "1", .help = "nodes one replica spans: -pp / N pipeline stages per node (N divides -pp), node 0 "
                 "schedules and serves, the others run --headless"},
        {O_INT("node-rank", node_rank, 0, 63), .alias = "-r", .owner = W, .group = GRP_PARALLEL, .metavar = "N",
         .def = "0", .help = "this node's rank (0 .. --nnodes - 1); the pipeline stage it runs"},
        {O_STR("master-addr", master_addr), .owner = W, .group = GRP_PARALLEL, .metavar = "HOST",
         .def = "127.0.0.1", .help = "address of node 0, where the nodes meet (--nnodes > 1)"},
        {O_INT("master-port", master_port, 1, 65535), .owner = W, .group = GRP_PARALLEL, .metavar = "PORT",
         .def = "29501", .help = "port node 0 listens on for the other nodes (--nnodes > 1)"},
        {O_BOOL("headless", headless), .owner = W, .group = GRP_PARALLEL,
         .help = "a follower node (--node-rank > 0): run the worker only, no router and no API"},
        {O_STR("distributed-executor-backend", distributed_executor_backend), .owner = W, .group = GRP_PARALLEL,
         .metavar = "BACKEND", .def_help = "auto", .choices = backend_choices,
         .help = "how ranks are started: processes (mp) or in-process (uni); no effect with one rank"},

        /* ---- cache and scheduler ---- */
        {O_INT("block-size", block_size, 1, 256), .owner = W, .group = GRP_CACHE, .metavar = "N", .def = "16",
         .choices = block_size_choices, .help = "KV cache block size in tokens"},
        {O_TRI("enable-prefix-caching", enable_prefix_caching), .owner = W, .group = GRP_CACHE,
         .def_help = "on", .help = "reuse KV blocks of shared prompt prefixes"},
        {O_STR("prefix-caching-hash-algo", prefix_caching_hash_algo), .owner = R | W, .group = GRP_CACHE,
         .metavar = "ALGO", .def = "sha256", .choices = hash_algo_choices,
         .help = "hash chaining prefix blocks (the router hashes the same way)"},
        {O_DBL("gpu-memory-utilization", gpu_memory_utilization), .dmin = 0, .dmax = 1, .dmin_open = true,
         .owner = W, .group = GRP_CACHE, .metavar = "FRACTION", .def = "0.9",
         .help = "share of total GPU memory this worker may use; no effect on the CPU backend"},
        {O_SIZE("kv-cache-memory-bytes", kv_cache_memory_bytes, 0, LLONG_MAX), .alt = "kv-cache-memory",
         .owner = W, .group = GRP_CACHE, .metavar = "SIZE", .def_help = "derived; CPU: 4GiB capped by free RAM",
         .help = "KV cache size, overriding --gpu-memory-utilization"},
        {O_INT("num-gpu-blocks-override", num_gpu_blocks_override, 0, INT_MAX), .owner = W, .group = GRP_CACHE,
         .metavar = "N", .def_help = "none", .help = "fixed number of KV blocks (testing)"},
        {O_INT("mamba-block-size", mamba_block_size, 0, INT_MAX), .owner = W, .group = GRP_CACHE, .metavar = "N",
         .def_help = "the model's scan chunk (chunk_size) rounded up to --block-size",
         .help = "with --enable-prefix-caching on a Mamba hybrid: keep the recurrent state every N tokens (a "
                 "multiple of 8 and of --block-size); a hit ends at one of them"},
        {O_INT("max-num-seqs", max_num_seqs, 0, INT_MAX), .owner = W, .group = GRP_CACHE, .metavar = "N",
         .def_help = "platform default", .help = "sequences running at once"},
        {O_INT_HR("max-num-batched-tokens", max_num_batched_tokens, 0, INT_MAX), .owner = W, .group = GRP_CACHE,
         .metavar = "N", .def_help = "platform default", .help = "tokens processed per engine step"},
        {O_TRI("enable-chunked-prefill", enable_chunked_prefill), .owner = W, .group = GRP_CACHE,
         .def_help = "on", .help = "split long prompts across steps; off is not supported yet"},
        {O_INT("max-num-partial-prefills", max_num_partial_prefills, 1, INT_MAX), .owner = W, .group = GRP_CACHE,
         .metavar = "N", .def = "1", .help = "prompts that may be mid-prefill at once; only 1 for now"},
        {O_INT("long-prefill-token-threshold", long_prefill_token_threshold, 0, INT_MAX), .owner = W,
         .group = GRP_CACHE, .metavar = "N", .def = "0", .help = "cap on prompt tokens per request per step; 0 = none"},
        {O_STR("scheduling-policy", scheduling_policy), .owner = W, .group = GRP_CACHE, .metavar = "POLICY",
         .def = "fcfs", .choices = policy_choices, .help = "order of waiting requests"},
        {O_BOOL("async-scheduling", async_scheduling), .owner = W, .group = GRP_CACHE,
         .help = "schedule the next step while the current one runs"},
        {O_DBL("swap-space", swap_space), .dmin = 0, .dmax = HUGE_VAL, .owner = W, .group = GRP_CACHE,
         .metavar = "GIB", .def = "4", .help = "no effect: preempted requests are recomputed, never swapped"},
        {O_INT("shutdown-timeout", shutdown_timeout, 0, INT_MAX), .owner = W, .group = GRP_CACHE,
         .metavar = "SECONDS", .def = "0",
         .help = "after SIGTERM, time in-flight requests may finish before they are aborted"},

        /* ---- HTTP front end ---- */
        {O_STR("host", host), .owner = R, .group = GRP_FRONTEND, .metavar = "HOST",
         .def_help = "all interfaces", .help = "address the HTTP server binds"},
        {O_INT("port", port, 0, 65535), .owner = R, .group = GRP_FRONTEND, .metavar = "PORT", .def = "8000",
         .help = "HTTP port"},
        {O_LIST("api-key", api_key), .owner = R, .group = GRP_FRONTEND, .metavar = "KEY",
         .def_help = "env TESSERA_API_KEY or VLLM_API_KEY", .help = "bearer keys accepted on /v1"},
        {O_STR("chat-template", chat_template), .owner = R, .group = GRP_FRONTEND, .metavar = "TEMPLATE",
         .def_help = "the model's", .help = "chat template file or inline text"},
        {O_STR("response-role", response_role), .owner = R, .group = GRP_FRONTEND, .metavar = "ROLE",
         .def = "assistant", .help = "role of generated chat messages"},
        {O_STR("root-path", root_path), .owner = R, .group = GRP_FRONTEND, .metavar = "PATH",
         .help = "URL prefix when behind a path-based proxy; not supported yet"},
        {O_BOOL("enable-log-requests", enable_log_requests), .owner = R, .group = GRP_FRONTEND,
         .help = "log every request (no effect: the router logs each request already)"},
        {O_BOOL("disable-log-requests", disable_log_requests), .owner = R, .group = GRP_FRONTEND,
         .help = "deprecated in vLLM; turns off the router's line per finished request"},
        {O_BOOL("disable-log-stats", disable_log_stats), .owner = R | W, .group = GRP_FRONTEND,
         .help = "no periodic stats line and no vllm:* metrics"},
        {O_BOOL("enable-prompt-tokens-details", enable_prompt_tokens_details), .owner = R,
         .group = GRP_FRONTEND, .help = "report cached prompt tokens in usage"},
        {O_BOOL("enable-force-include-usage", enable_force_include_usage), .owner = R, .group = GRP_FRONTEND,
         .help = "send usage on every stream"},
        {O_BOOL("enable-request-id-headers", enable_request_id_headers), .owner = R, .group = GRP_FRONTEND,
         .help = "return X-Request-Id; not supported yet"},
        {O_BOOL("enable-server-load-tracking", enable_server_load_tracking), .owner = R, .group = GRP_FRONTEND,
         .help = "serve /load; not supported yet"},
        {O_BOOL("enable-tokenizer-info-endpoint", enable_tokenizer_info_endpoint), .owner = R,
         .group = GRP_FRONTEND, .help = "serve /tokenizer_info; not supported yet"},
        {O_BOOL("enable-auto-tool-choice", enable_auto_tool_choice), .owner = R, .group = GRP_FRONTEND,
         .help = "let the model decide when to call tools (tool_choice auto); needs --tool-call-parser"},
        {O_STR("tool-call-parser", tool_call_parser), .owner = R, .group = GRP_FRONTEND, .metavar = "NAME",
         .help = "parser turning model output into tool calls: hermes, llama3_json, llama4_pythonic, pythonic, qwen3_coder"},
        {O_STR("reasoning-parser", reasoning_parser), .owner = R, .group = GRP_FRONTEND, .metavar = "NAME",
         .help = "parser splitting reasoning from the answer: deepseek_r1, nemotron_v3 (also nano_v3)"},
        {O_STR("show-hidden-metrics-for-version", show_hidden_metrics_for_version), .owner = R,
         .group = GRP_FRONTEND, .metavar = "VERSION", .help = "bring back metrics deprecated since VERSION"},
        {O_INT("stream-interval", stream_interval, 1, INT_MAX), .owner = R, .group = GRP_FRONTEND,
         .metavar = "N", .def = "1", .help = "tokens gathered into one streamed chunk; only 1 for now"},
        {O_BOOL("disable-uvicorn-access-log", disable_uvicorn_access_log), .owner = R, .group = GRP_FRONTEND,
         .help = "turn off the HTTP access log (no effect: the router writes none)"},

        /* ---- Tessera ---- */
        {O_STR("listen", worker_listen), .owner = W, .group = GRP_TESSERA, .metavar = "ENDPOINT",
         .def = "tcp://127.0.0.1:8100", .help = "ZeroMQ endpoint the worker takes requests on"},
        {O_STR("status-listen", status_listen), .owner = W, .group = GRP_TESSERA, .metavar = "ENDPOINT",
         .def_help = "--listen port + 1", .help = "ZeroMQ endpoint the worker publishes status on"},
        {O_INT("status-interval-ms", status_interval_ms, 1, 60000), .owner = W, .group = GRP_TESSERA,
         .metavar = "MS", .def = "100", .help = "time between status messages"},
        {O_INT("cpu-threads", cpu_threads, 0, 4096), .owner = W, .group = GRP_TESSERA, .metavar = "N",
         .def = "0", .help = "CPU backend threads; 0 = all cores"},
        {O_SIZE("max-request-body", max_request_body, 1, 1LL << 40), .owner = R, .group = GRP_TESSERA,
         .metavar = "SIZE", .def = "32MiB", .help = "largest HTTP request body; larger gets 413"},
        {O_INT("request-timeout-secs", request_timeout_secs, 0, 1 << 30), .owner = R, .group = GRP_TESSERA,
         .metavar = "S", .def = "1800",
         .help = "deadline of a generation request from its arrival; past it the router aborts it (504); 0 = none"},
        {O_INT("router-threads", router_threads, 1, 256), .owner = R, .group = GRP_TESSERA, .metavar = "N",
         .def = "1", .help = "event loops sharing the HTTP port"},
        {O_LIST("worker", worker), .owner = R, .group = GRP_TESSERA, .metavar = "ENDPOINT",
         .help = "worker endpoint (tcp://HOST:PORT) to route to; repeatable"},
        {O_STR("zmq-curve-secret-file", zmq_curve_secret_file), .owner = R | W, .group = GRP_TESSERA,
         .metavar = "FILE", .help = "encrypt and authenticate router-worker ZeroMQ traffic (CurveZMQ): this "
                                    "process's secret key; with --zmq-curve-peers-file"},
        {O_STR("zmq-curve-peers-file", zmq_curve_peers_file), .owner = R | W, .group = GRP_TESSERA,
         .metavar = "FILE", .help = "CurveZMQ public keys: on a worker the routers allowed, on a router the "
                                    "workers trusted ([tcp://HOST:PORT ]KEY per line)"},
        {O_LIST("worker-dns", worker_dns), .owner = R, .group = GRP_TESSERA, .metavar = "NAME:PORT",
         .help = "route to every address of a DNS name (e.g. a headless Service), re-resolved every 5 s; repeatable"},
        {O_STR("routing-policy", routing_policy), .owner = R, .group = GRP_TESSERA, .metavar = "POLICY",
         .def = "kv", .choices = routing_policy_choices,
         .help = "placement: kv = prefix-cache overlap and load, least_load, round_robin"},
        {O_STR("log-level", log_level), .owner = TSR_OWNER_ALL, .group = GRP_TESSERA, .metavar = "LEVEL",
         .def_help = "info", .choices = log_level_choices, .help = "least severe level logged"},
        {O_STR("config", config_file), .owner = TSR_OWNER_ALL, .group = GRP_TESSERA, .metavar = "FILE.yaml",
         .help = "YAML file of options; the command line wins over it"},
};

#undef R
#undef W

#define N_OPTS (sizeof(opts) / sizeof(opts[0]))
_Static_assert(N_OPTS <= TSR_CONFIG_MAX_OPTS, "raise TSR_CONFIG_MAX_OPTS in config.h");

#define AT(cfg, o, T) ((T *)(void *)((char *)(cfg) + (o)->off))
#define CAT(cfg, o, T) ((const T *)(const void *)((const char *)(cfg) + (o)->off))

static const tsr_opt *opt_config(void) { return &opts[N_OPTS - 1]; }
static const tsr_opt *opt_model(void) { return &opts[0]; }


/* ---------------------------------------------------------------- values -- */

/* Strings pointing at the table's default text are not heap memory; everything else is.
 * Comparing the pointer (not the text) is what makes this safe. */
static void str_free(const tsr_opt *o, char *s) {
        if (s != o->def)
                free(s);
}

static void list_clear(tsr_strlist *l) {
        for (size_t i = 0; i < l->n; i++)
                free(l->items[i]);
        free(l->items);
        l->items = NULL;
        l->n = 0;
}

static tsr_status list_append(tsr_strlist *l, const char *v) {
        char **items;
        char *copy;

        if (l->n >= SIZE_MAX / sizeof(char *) - 1)
                return TSR_E_NOMEM;
        copy = strdup(v);
        if (!copy)
                return TSR_E_NOMEM;
        items = realloc(l->items, (l->n + 1) * sizeof(char *));
        if (!items) {
                free(copy);
                return TSR_E_NOMEM;
        }
        items[l->n++] = copy;
        l->items = items;
        return TSR_OK;
}

tsr_status tsr_parse_size(const char *s, long long *ret) {
        unsigned long long ip = 0, frac = 0, frac_div = 1, mult = 1;
        const char *p = s;
        bool has_frac = false, binary = false;
        unsigned long long v;

        if (!s || !isdigit((unsigned char)*p))
                return TSR_E_INVAL;             /* no sign, no blanks, no empty string */
        for (; isdigit((unsigned char)*p); p++) {
                if (__builtin_mul_overflow(ip, 10ULL, &ip) || __builtin_add_overflow(ip, (unsigned)(*p - '0'), &ip))
                        return TSR_E_INVAL;
        }
        if (*p == '.') {
                p++;
                if (!isdigit((unsigned char)*p))
                        return TSR_E_INVAL;
                has_frac = true;
                /* Digits past 18 cannot change the truncated result for mult <= 10^12. */
                for (; isdigit((unsigned char)*p); p++) {
                        if (frac_div < 1000000000000000000ULL) {
                                frac = frac * 10 + (unsigned)(*p - '0');
                                frac_div *= 10;
                        }
                }
        }
        if (*p) {
                /* vLLM's rule: the case of the letter decides, lower = powers of 1000 and
                 * upper = powers of 1024; "B" and "iB" after it only make sizes read well. */
                switch (*p) {
                case 'k': mult = 1000ULL; break;
                case 'm': mult = 1000000ULL; break;
                case 'g': mult = 1000000000ULL; break;
                case 't': mult = 1000000000000ULL; break;
                case 'K': mult = 1ULL << 10; binary = true; break;
                case 'M': mult = 1ULL << 20; binary = true; break;
                case 'G': mult = 1ULL << 30; binary = true; break;
                case 'T': mult = 1ULL << 40; binary = true; break;
                default: return TSR_E_INVAL;
                }
                p++;
                if (strcmp(p, "B") != 0 && !(binary && strcmp(p, "iB") == 0) && *p)
                        return TSR_E_INVAL;
        }
        if (has_frac && (mult == 1 || binary))
                return TSR_E_INVAL;             /* "1.5" or "1.5K": vLLM refuses these too */
        if (__builtin_mul_overflow(ip, mult, &v))
                return TSR_E_INVAL;
        if (has_frac && __builtin_add_overflow(v, frac * mult / frac_div, &v))
                return TSR_E_INVAL;
        if (v > (unsigned long long)LLONG_MAX)
                return TSR_E_INVAL;
        *ret = (long long)v;
        return TSR_OK;
}

/* Argparse's test for "this looks like a negative number, so it is a value". */
static bool is_negative_number(const char *s) {
        const char *p = s + 1;
        bool digits = false;

        if (s[0] != '-')
                return false;
        while (isdigit((unsigned char)*p)) {
                p++;
                digits = true;
        }
        if (*p == '.') {
                p++;
                if (!isdigit((unsigned char)*p))
                        return false;
                while (isdigit((unsigned char)*p))
                        p++;
                digits = true;
        }
        return digits && *p == '\0';
}

static bool is_flag(const char *s) { return s[0] == '-' && s[1] != '\0' && !is_negative_number(s); }

static bool choice_ok(const tsr_opt *o, const char *v) {
        if (!o->choices)
                return true;
        for (const char *const *c = o->choices; *c; c++)
                if (strcmp(*c, v) == 0)
                        return true;
        return false;
}

static void choices_str(const tsr_opt *o, char *buf, size_t len) {
        size_t used = 0;

        buf[0] = '\0';
        for (const char *const *c = o->choices; *c && used < len; c++) {
                int n = snprintf(buf + used, len - used, "%s%s", c == o->choices ? "" : ", ", *c);
                if (n < 0)
                        break;
                used += (size_t)n;
        }
}

static void range_str(const tsr_opt *o, char *buf, size_t len) {
        bool lo = o->min != LLONG_MIN && !(o->min == INT_MIN && o->type != OPT_LL);
        bool hi = o->max != LLONG_MAX && !(o->max == INT_MAX && o->type != OPT_LL && o->type != OPT_SIZE);

        if (lo && hi)
                snprintf(buf, len, "must be between %lld and %lld", o->min, o->max);
        else if (lo)
                snprintf(buf, len, "must be >= %lld", o->min);
        else
                snprintf(buf, len, "must be <= %lld", o->max);
}

/* Check an integer against the entry's range and choices.  why: the reason, no prefix. */
static tsr_status check_ll(const tsr_opt *o, long long v, const char *text, char *why, size_t whylen) {
        char num[32], buf[160];

        snprintf(num, sizeof(num), "%lld", v);
        if (o->choices && !choice_ok(o, num)) {
                choices_str(o, buf, sizeof(buf));
                tsr_errf(why, whylen, "invalid choice: '%s' (choose from %s)", text ? text : num, buf);
                return TSR_E_INVAL;
        }
        if (v < o->min || v > o->max) {
                range_str(o, buf, sizeof(buf));
                tsr_errf(why, whylen, "invalid value: '%s' (%s)", text ? text : num, buf);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

static tsr_status check_double(const tsr_opt *o, double v, const char *text, char *why, size_t whylen) {
        if (!isfinite(v) || v < o->dmin || (o->dmin_open && v == o->dmin) || v > o->dmax) {
                if (o->dmax == HUGE_VAL)
                        tsr_errf(why, whylen, "invalid value: '%s' (must be >= %g)", text, o->dmin);
                else
                        tsr_errf(why, whylen, "invalid value: '%s' (must be in %s%g, %g])", text,
                                o->dmin_open ? "(" : "[", o->dmin, o->dmax);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* Convert text for a non-boolean entry without storing it.  Shared by the
 * parser and by tsr_config_init (defaults are text too). */
static tsr_status convert(const tsr_opt *o, const char *v, long long *ll, double *d, char *why, size_t whylen) {
        char *end;

        switch (o->type) {
        case OPT_INT:
        case OPT_LL:
                errno = 0;
                *ll = strtoll(v, &end, 10);
                if (end == v || *end || isspace((unsigned char)v[0])) {
                        tsr_errf(why, whylen, "invalid int value: '%s'", v);
                        return TSR_E_INVAL;
                }
                if (errno == ERANGE) {
                        char buf[128];
                        range_str(o, buf, sizeof(buf));
                        tsr_errf(why, whylen, "invalid value: '%s' (%s)", v, buf);
                        return TSR_E_INVAL;
                }
                return check_ll(o, *ll, v, why, whylen);
        case OPT_INT_HR:
        case OPT_SIZE:
                if (tsr_parse_size(v, ll) != TSR_OK) {
                        tsr_errf(why, whylen, "invalid size value: '%s'", v);
                        return TSR_E_INVAL;
                }
                return check_ll(o, *ll, v, why, whylen);
        case OPT_DOUBLE:
                errno = 0;
                *d = strtod(v, &end);
                if (end == v || *end || isspace((unsigned char)v[0]) || errno == ERANGE || !isfinite(*d)) {
                        tsr_errf(why, whylen, "invalid float value: '%s'", v);
                        return TSR_E_INVAL;
                }
                return check_double(o, *d, v, why, whylen);
        case OPT_STR:
        case OPT_LIST:
                if (!choice_ok(o, v)) {
                        char buf[160];
                        choices_str(o, buf, sizeof(buf));
                        tsr_errf(why, whylen, "invalid choice: '%s' (choose from %s)", v, buf);
                        return TSR_E_INVAL;
                }
                return TSR_OK;
        case OPT_BOOL:
        case OPT_TRI:
                break;
        }
        tsr_errf(why, whylen, "takes no value");
        return TSR_E_INVAL;
}

/* One application of options: a YAML file or a command line. */
typedef struct pass {
        tsr_config *cfg;
        unsigned char src;                              /* SRC_YAML or SRC_CLI */
        unsigned char touched[TSR_CONFIG_MAX_OPTS];     /* lists: first value of the pass replaces */
} pass;

static void pass_init(pass *p, tsr_config *cfg, unsigned char src) {
        memset(p, 0, sizeof(*p));
        p->cfg = cfg;
        p->src = src;
}

/* Store a value for a non-boolean entry.  why gets the reason on error. */
static tsr_status opt_set_value(pass *p, const tsr_opt *o, const char *v, char *why, size_t whylen) {
        size_t idx = (size_t)(o - opts);
        long long ll = 0;
        double d = 0;
        tsr_status st;

        st = convert(o, v, &ll, &d, why, whylen);
        if (st != TSR_OK)
                return st;
        switch (o->type) {
        case OPT_STR: {
                char *copy = strdup(v), **field = AT(p->cfg, o, char *);
                if (!copy)
                        return TSR_E_NOMEM;
                str_free(o, *field);
                *field = copy;
                break;
        }
        case OPT_LIST:
                /* Repeats within one source append; a later source (the command line
                 * after YAML, a second file) replaces, which is what precedence means. */
                if (!p->touched[idx]) {
                        list_clear(AT(p->cfg, o, tsr_strlist));
                        p->touched[idx] = 1;
                }
                st = list_append(AT(p->cfg, o, tsr_strlist), v);
                if (st != TSR_OK)
                        return st;
                break;
        case OPT_INT:
        case OPT_INT_HR:
                *AT(p->cfg, o, int) = (int)ll;          /* range-checked against the entry */
                break;
        case OPT_LL:
        case OPT_SIZE:
                *AT(p->cfg, o, long long) = ll;
                break;
        case OPT_DOUBLE:
                *AT(p->cfg, o, double) = d;
                break;
        case OPT_BOOL:
        case OPT_TRI:
                return TSR_E_INTERNAL;
        }
        p->cfg->_set[idx] |= p->src;
        return TSR_OK;
}

static void opt_set_bool(pass *p, const tsr_opt *o, bool on) {
        if (o->type == OPT_BOOL)
                *AT(p->cfg, o, bool) = on;
        else
                *AT(p->cfg, o, int) = on ? TSR_TRI_TRUE : TSR_TRI_FALSE;
        p->cfg->_set[o - opts] |= p->src;
}

/* --------------------------------------------------------- init / done -- */

void tsr_config_init(tsr_config *cfg) {
        memset(cfg, 0, sizeof(*cfg));
        for (size_t i = 0; i < N_OPTS; i++) {
                const tsr_opt *o = &opts[i];
                long long ll = 0;
                double d = 0;

                switch (o->type) {
                case OPT_STR:
                        *AT(cfg, o, char *) = (char *)o->def;   /* see str_free */
                        break;
                case OPT_TRI:
                        *AT(cfg, o, int) = TSR_TRI_UNSET;
                        break;
                case OPT_LIST:
                case OPT_BOOL:
                        break;                                  /* empty / false */
                default:
                        if (!o->def)
                                break;
                        /* Table constants; tests check every default converts. */
                        if (convert(o, o->def, &ll, &d, NULL, 0) != TSR_OK)
                                break;
                        if (o->type == OPT_DOUBLE)
                                *AT(cfg, o, double) = d;
                        else if (o->type == OPT_LL || o->type == OPT_SIZE)
                                *AT(cfg, o, long long) = ll;
                        else
                                *AT(cfg, o, int) = (int)ll;
                        break;
                }
        }
}

void tsr_config_done(tsr_config *cfg) {
        if (!cfg)
                return;
        for (size_t i = 0; i < N_OPTS; i++) {
                const tsr_opt *o = &opts[i];

                if (o->type == OPT_STR)
                        str_free(o, *AT(cfg, o, char *));
                else if (o->type == OPT_LIST)
                        list_clear(AT(cfg, o, tsr_strlist));
        }
        /* Zeroed, not re-defaulted: done twice is harmless, and init starts over. */
        memset(cfg, 0, sizeof(*cfg));
}

/* ---------------------------------------------------------------- lookup -- */

/* Dashes and underscores are the same character in option names. */
static bool name_eq(const char *a, size_t alen, const char *b) {
        size_t i;

        for (i = 0; i < alen && b[i]; i++) {
                char x = a[i] == '_' ? '-' : a[i], y = b[i] == '_' ? '-' : b[i];
                if (x != y)
                        return false;
        }
        return i == alen && b[i] == '\0';
}

/* Find a long name (no leading dashes).  *negated: it was "no-NAME" of a boolean. */
static const tsr_opt *find_long(const char *name, size_t len, bool *negated) {
        *negated = false;
        for (size_t i = 0; i < N_OPTS; i++)
                if (name_eq(name, len, opts[i].name) || (opts[i].alt && name_eq(name, len, opts[i].alt)))
                        return &opts[i];
        if (len > 3 && name[0] == 'n' && name[1] == 'o' && (name[2] == '-' || name[2] == '_')) {
                for (size_t i = 0; i < N_OPTS; i++) {
                        if (opts[i].type != OPT_BOOL && opts[i].type != OPT_TRI)
                                continue;
                        if (name_eq(name + 3, len - 3, opts[i].name)) {
                                *negated = true;
                                return &opts[i];
                        }
                }
        }
        return NULL;
}

static const tsr_opt *find_alias(const char *name, size_t len) {
        for (size_t i = 0; i < N_OPTS; i++)
                if (opts[i].alias && name_eq(name, len, opts[i].alias))
                        return &opts[i];
        return NULL;
}

/* ------------------------------------------------------------------ YAML -- */

static bool ends_with(const char *s, const char *suffix) {
        size_t n = strlen(s), m = strlen(suffix);
        return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* PyYAML (YAML 1.1) booleans, which is what vLLM's safe_load sees; quoted text is a string. */
static int yaml_bool(const yaml_node_t *n) {
        static const char *const yes[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", NULL};
        static const char *const no[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF", NULL};
        const char *v = (const char *)n->data.scalar.value;

        if (n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
                return -1;
        for (size_t i = 0; yes[i]; i++)
                if (strcmp(v, yes[i]) == 0)
                        return 1;
        for (size_t i = 0; no[i]; i++)
                if (strcmp(v, no[i]) == 0)
                        return 0;
        return -1;
}

static bool yaml_null(const yaml_node_t *n) {
        const char *v = (const char *)n->data.scalar.value;

        if (n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
                return false;
        return !*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL");
}

/* Apply one `key: value` pair.  Errors come back as a reason; the caller adds file and key. */
static tsr_status yaml_apply(pass *p, yaml_document_t *doc, const char *key, yaml_node_t *val, const char *path,
                             char *why, size_t whylen) {
        bool negated;
        const tsr_opt *o = find_long(key, strlen(key), &negated);
        tsr_status st;

        if (!o) {
                tsr_errf(why, whylen, "unknown option");
                return TSR_E_INVAL;
        }
        if (o == opt_config()) {
                tsr_errf(why, whylen, "a config file cannot name another config file");
                return TSR_E_INVAL;
        }
        if (!val) {
                tsr_errf(why, whylen, "missing value");
                return TSR_E_INVAL;
        }
        if (val->type == YAML_MAPPING_NODE) {
                tsr_errf(why, whylen, "nested mappings are not supported (write the value as a string)");
                return TSR_E_INVAL;
        }
        if (o->type == OPT_BOOL || o->type == OPT_TRI) {
                int b = val->type == YAML_SCALAR_NODE ? yaml_bool(val) : -1;

                if (b < 0) {
                        tsr_errf(why, whylen, "expected true or false");
                        return TSR_E_INVAL;
                }
                if (b == 0) {
                        /* vLLM turns `key: true` into `--key` and silently drops `key: false`;
                         * we drop it too (same meaning) but say so, because it surprises. */
                        fprintf(stderr, "warning: %s: key '%s': false is ignored (as in vLLM); write '%s%s: true' "
                                "to turn it %s\n", path, key, negated ? "" : "no-", o->name,
                                negated ? "on" : "off");
                        return TSR_OK;
                }
                opt_set_bool(p, o, !negated);
                return TSR_OK;
        }
        if (val->type == YAML_SEQUENCE_NODE) {
                yaml_node_item_t *it;

                if (o->type != OPT_LIST) {
                        tsr_errf(why, whylen, "expected a single value, not a list");
                        return TSR_E_INVAL;
                }
                for (it = val->data.sequence.items.start; it < val->data.sequence.items.top; it++) {
                        yaml_node_t *item = yaml_document_get_node(doc, *it);

                        if (!item || item->type != YAML_SCALAR_NODE || yaml_null(item)) {
                                tsr_errf(why, whylen, "list items must be plain values");
                                return TSR_E_INVAL;
                        }
                        st = opt_set_value(p, o, (const char *)item->data.scalar.value, why, whylen);
                        if (st != TSR_OK)
                                return st;
                }
                return TSR_OK;
        }
        if (yaml_null(val)) {
                tsr_errf(why, whylen, "missing value");
                return TSR_E_INVAL;
        }
        return opt_set_value(p, o, (const char *)val->data.scalar.value, why, whylen);
}

static tsr_status yaml_error(yaml_parser_t *parser, const char *path, char *err, size_t errlen) {
        switch (parser->error) {
        case YAML_MEMORY_ERROR:
                tsr_errf(err, errlen, "%s: out of memory", path);
                return TSR_E_NOMEM;
        case YAML_READER_ERROR:
                tsr_errf(err, errlen, "%s: byte %zu: %s", path, parser->problem_offset,
                        parser->problem ? parser->problem : "cannot read");
                return parser->problem && strcmp(parser->problem, "input error") == 0 ? TSR_E_IO : TSR_E_INVAL;
        default:
                tsr_errf(err, errlen, "%s: line %zu, column %zu: %s%s%s", path, parser->problem_mark.line + 1,
                        parser->problem_mark.column + 1, parser->problem ? parser->problem : "syntax error",
                        parser->context ? " " : "", parser->context ? parser->context : "");
                return TSR_E_INVAL;
        }
}

static tsr_status load_yaml(pass *p, const char *path, char *err, size_t errlen) {
        yaml_parser_t parser;
        yaml_document_t doc;
        yaml_node_t *root;
        yaml_node_pair_t *pair;
        bool parser_ok = false, doc_ok = false;
        struct stat sb;
        FILE *f = NULL;
        tsr_status st = TSR_OK;
        char why[256];

        if (!ends_with(path, ".yaml") && !ends_with(path, ".yml")) {
                tsr_errf(err, errlen, "%s: config file must end in .yaml or .yml", path);
                return TSR_E_INVAL;
        }
        f = fopen(path, "rb");
        if (!f) {
                tsr_errf(err, errlen, "%s: %s", path, strerror(errno));
                return errno == ENOENT || errno == ENOTDIR ? TSR_E_NOTFOUND : TSR_E_IO;
        }
        if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
                tsr_errf(err, errlen, "%s: not a regular file", path);
                st = TSR_E_IO;
                goto done;
        }
        if (!yaml_parser_initialize(&parser)) {
                st = TSR_E_NOMEM;
                goto done;
        }
        parser_ok = true;
        yaml_parser_set_input_file(&parser, f);
        if (!yaml_parser_load(&parser, &doc)) {
                st = yaml_error(&parser, path, err, errlen);
                goto done;
        }
        doc_ok = true;
        root = yaml_document_get_root_node(&doc);
        if (!root) {
                tsr_errf(err, errlen, "%s: empty file (expected a mapping of option names to values)", path);
                st = TSR_E_INVAL;
                goto done;
        }
        if (root->type != YAML_MAPPING_NODE) {
                tsr_errf(err, errlen, "%s: expected a mapping of option names to values at the top", path);
                st = TSR_E_INVAL;
                goto done;
        }
        for (pair = root->data.mapping.pairs.start; pair < root->data.mapping.pairs.top; pair++) {
                yaml_node_t *k = yaml_document_get_node(&doc, pair->key);
                yaml_node_t *v = yaml_document_get_node(&doc, pair->value);

                if (!k || k->type != YAML_SCALAR_NODE) {
                        tsr_errf(err, errlen, "%s: keys must be option names", path);
                        st = TSR_E_INVAL;
                        goto done;
                }
                st = yaml_apply(p, &doc, (const char *)k->data.scalar.value, v, path, why, sizeof(why));
                if (st == TSR_E_NOMEM) {
                        tsr_errf(err, errlen, "%s: out of memory", path);
                        goto done;
                }
                if (st != TSR_OK) {
                        tsr_errf(err, errlen, "%s: key '%s': %s", path, (const char *)k->data.scalar.value, why);
                        goto done;
                }
        }
done:
        if (doc_ok)
                yaml_document_delete(&doc);
        if (parser_ok)
                yaml_parser_delete(&parser);
        fclose(f);
        return st;
}

tsr_status tsr_config_load_yaml(tsr_config *cfg, const char *path, char *err, size_t errlen) {
        pass p;

        pass_init(&p, cfg, SRC_YAML);
        return load_yaml(&p, path, err, errlen);
}

/* ---------------------------------------------------------- command line -- */

/* The flag's name as messages show it. */
static const char *flag_name(const tsr_opt *o, char *buf, size_t len) {
        snprintf(buf, len, "--%s", o->name);
        return buf;
}

/* Look for -h/--help/--version and --config before anything else: help must work
 * even with a broken config file, and the file must load before the command line
 * is applied over it.  Values never start with '-' (argparse's rule), so a flag-
 * looking token is a flag. */
static tsr_status prescan(tsr_config *cfg, int argc, char **argv, const char **config, char *err, size_t errlen) {
        *config = NULL;
        for (int i = 1; i < argc; i++) {
                const char *a = argv[i];

                if (strcmp(a, "--") == 0)
                        break;
                if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
                        cfg->help = true;
                else if (strcmp(a, "--version") == 0)
                        cfg->version = true;
                else if (strcmp(a, "--config") == 0 || strncmp(a, "--config=", 9) == 0) {
                        if (*config) {
                                tsr_errf(err, errlen, "argument --config: given more than once");
                                return TSR_E_INVAL;
                        }
                        if (a[8] == '=') {
                                *config = a + 9;
                        } else if (i + 1 < argc && !is_flag(argv[i + 1])) {
                                *config = argv[++i];
                        } else {
                                tsr_errf(err, errlen, "argument --config: expected one argument");
                                return TSR_E_INVAL;
                        }
                }
        }
        return TSR_OK;
}

/* Append a token to the "unrecognized arguments" line, argparse-style. */
static void unrec_add(char *buf, size_t len, const char *tok) {
        size_t used = strlen(buf);

        if (used + 1 < len)
                snprintf(buf + used, len - used, "%s%s", used ? " " : "", tok);
}

static tsr_status parse_cli(pass *p, int argc, char **argv, bool allow_model, char *err, size_t errlen) {
        char unrec[512] = "", why[256], fname[80];
        bool ddash = false, positional_model = false, flag_model = false;
        tsr_status st;

        for (int i = 1; i < argc; i++) {
                const char *a = argv[i], *eq, *name, *val = NULL;
                const tsr_opt *o;
                bool negated = false;
                size_t nlen;

                if (ddash || !is_flag(a)) {
                        if (!allow_model || positional_model) {
                                unrec_add(unrec, sizeof(unrec), a);
                                continue;
                        }
                        positional_model = true;
                        st = opt_set_value(p, opt_model(), a, why, sizeof(why));
                        if (st != TSR_OK) {
                                tsr_errf(err, errlen, "argument MODEL: %s", why);
                                return st;
                        }
                        continue;
                }
                if (strcmp(a, "--") == 0) {
                        ddash = true;
                        continue;
                }
                if (!strcmp(a, "-h") || !strcmp(a, "--help") || !strcmp(a, "--version"))
                        continue;               /* prescan recorded them */
                name = a + (a[1] == '-' ? 2 : 0);
                eq = strchr(name, '=');
                nlen = eq ? (size_t)(eq - name) : strlen(name);
                o = a[1] == '-' ? find_long(name, nlen, &negated) : find_alias(name, nlen);
                if (!o) {
                        unrec_add(unrec, sizeof(unrec), a);
                        continue;
                }
                flag_name(o, fname, sizeof(fname));
                if (o->type == OPT_BOOL || o->type == OPT_TRI) {
                        if (eq) {
                                tsr_errf(err, errlen, "argument %s%s: ignored explicit argument '%s'",
                                        negated ? "--no-" : fname, negated ? o->name : "", eq + 1);
                                return TSR_E_INVAL;
                        }
                        opt_set_bool(p, o, !negated);
                        continue;
                }
                if (o == opt_config()) {
                        if (!eq)
                                i++;            /* prescan checked the value exists */
                        continue;
                }
                if (o == opt_model())
                        flag_model = true;
                if (eq) {
                        val = eq + 1;
                } else if (i + 1 < argc && !is_flag(argv[i + 1])) {
                        val = argv[++i];
                } else {
                        tsr_errf(err, errlen, "argument %s: expected %s argument", fname,
                                o->type == OPT_LIST ? "at least one" : "one");
                        return TSR_E_INVAL;
                }
                for (;;) {
                        st = opt_set_value(p, o, val, why, sizeof(why));
                        if (st == TSR_E_NOMEM) {
                                tsr_errf(err, errlen, "out of memory");
                                return st;
                        }
                        if (st != TSR_OK) {
                                tsr_errf(err, errlen, "argument %s: %s", fname, why);
                                return st;
                        }
                        /* A list takes every following value up to the next flag. */
                        if (o->type != OPT_LIST || eq || ddash || i + 1 >= argc || is_flag(argv[i + 1]))
                                break;
                        val = argv[++i];
                }
        }
        if (unrec[0]) {
                tsr_errf(err, errlen, "unrecognized arguments: %s", unrec);
                return TSR_E_INVAL;
        }
        if (positional_model && flag_model) {
                tsr_errf(err, errlen, "argument --model: give the model either as MODEL or with --model, not both");
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

tsr_status tsr_config_parse(tsr_config *cfg, int argc, char **argv, bool allow_model, char *err, size_t errlen) {
        const tsr_opt *api = NULL;
        const char *config = NULL, *env;
        tsr_status st;
        pass p;

        if (err && errlen)
                err[0] = '\0';
        st = prescan(cfg, argc, argv, &config, err, errlen);
        if (st != TSR_OK || cfg->help || cfg->version)
                return st;
        if (config) {
                char *copy = strdup(config);
                if (!copy)
                        return TSR_E_NOMEM;
                str_free(opt_config(), cfg->config_file);
                cfg->config_file = copy;
                pass_init(&p, cfg, SRC_YAML);
                st = load_yaml(&p, config, err, errlen);
                if (st != TSR_OK)
                        return st;
        }
        pass_init(&p, cfg, SRC_CLI);
        st = parse_cli(&p, argc, argv, allow_model, err, errlen);
        if (st != TSR_OK)
                return st;

        /* vLLM reads VLLM_API_KEY when no key was given; TESSERA_API_KEY is our own
         * spelling and wins over it.  Not marked as set: children inherit the
         * environment, and a key kept off argv stays out of `ps`. */
        for (size_t i = 0; i < N_OPTS; i++)
                if (opts[i].off == offsetof(tsr_config, api_key))
                        api = &opts[i];
        env = getenv("TESSERA_API_KEY");
        if (!env || !*env)
                env = getenv("VLLM_API_KEY");
        if (api && !cfg->_set[api - opts] && cfg->api_key.n == 0 && env && *env) {
                if (list_append(&cfg->api_key, env) != TSR_OK)
                        return TSR_E_NOMEM;
        }
        return TSR_OK;
}

/* -------------------------------------------------------------- validate -- */

/* The same file twice: equal names, or one file (device and inode) under two. */
static bool same_path(const char *a, const char *b) {
        struct stat sa, sb;

        if (!a || !b)
                return false;
        if (strcmp(a, b) == 0)
                return true;
        return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* The output parsers the router has (router/tools/: tools.c and reasoning.c hold the
 * same names; test_tools checks that they agree).  Checked here, in every process, so
 * that `tessera serve` refuses a wrong name before it starts a child, with vLLM's
 * messages (api_server.validate_api_server_args, cli_args.validate_parsed_serve_args). */
static const char *const tool_call_parsers[] = {"hermes", "llama3_json", "llama4_pythonic", "pythonic", "qwen3_coder", NULL};
static const char *const reasoning_parsers[] = {"deepseek_r1", "nemotron_v3", "nano_v3", NULL};

const char *const *tsr_config_tool_call_parsers(void) { return tool_call_parsers; }
const char *const *tsr_config_reasoning_parsers(void) { return reasoning_parsers; }

static bool listed(const char *const *names, const char *name) {
        for (; *names; names++)
                if (strcmp(*names, name) == 0)
                        return true;
        return false;
}

static void join_names(const char *const *names, char *out, size_t n) {
        size_t k = 0;
        out[0] = '\0';
        for (size_t i = 0; names[i] && k < n; i++)
                k += (size_t)snprintf(out + k, n - k, "%s%s", i ? "," : "", names[i]);
}

static tsr_status check_parsers(const tsr_config *cfg, char *err, size_t errlen) {
        char names[256];
        if (cfg->enable_auto_tool_choice && !cfg->tool_call_parser) {
                tsr_errf(err, errlen, "Error: --enable-auto-tool-choice requires --tool-call-parser");
                return TSR_E_INVAL;
        }
        if (cfg->tool_call_parser && !listed(tool_call_parsers, cfg->tool_call_parser)) {
                join_names(tool_call_parsers, names, sizeof(names));
                tsr_errf(err, errlen, "invalid tool call parser: %s (chose from { %s })", cfg->tool_call_parser, names);
                return TSR_E_INVAL;
        }
        if (cfg->reasoning_parser && !listed(reasoning_parsers, cfg->reasoning_parser)) {
                join_names(reasoning_parsers, names, sizeof(names));
                tsr_errf(err, errlen, "invalid reasoning parser: %s (chose from { %s })", cfg->reasoning_parser, names);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* A replica over several nodes (issue #20): vLLM's flags, in the shape this build runs:
 * pp / nnodes pipeline stages per node, tp inside each node (worker/parallel/nodes.h). */
static tsr_status check_nodes(const tsr_config *cfg, char *err, size_t errlen) {
        if (cfg->node_rank >= cfg->nnodes) {
                tsr_errf(err, errlen, "argument --node-rank: %d must be less than --nnodes %d", cfg->node_rank,
                         cfg->nnodes);
                return TSR_E_INVAL;
        }
        if (cfg->headless && cfg->node_rank == 0) {
                tsr_errf(err, errlen, "argument --headless: runs a follower node of a multi-node replica: give "
                         "--nnodes > 1 and --node-rank > 0 (node 0 serves the API)");
                return TSR_E_INVAL;
        }
        if (cfg->node_rank > 0 && !cfg->headless) {
                tsr_errf(err, errlen, "argument --node-rank: %d runs a follower node: pass --headless too (node 0 "
                         "serves the API, as with vllm serve)", cfg->node_rank);
                return TSR_E_INVAL;
        }
        if (cfg->nnodes == 1)
                return TSR_OK;
        if (cfg->pipeline_parallel_size % cfg->nnodes != 0) {
                tsr_errf(err, errlen, "argument --nnodes: %d must divide --pipeline-parallel-size (%d): each node runs "
                         "as many pipeline stages, each on its --tensor-parallel-size ranks inside the node (tensor "
                         "parallelism across nodes is not supported)", cfg->nnodes, cfg->pipeline_parallel_size);
                return TSR_E_UNSUPPORTED;
        }
        return TSR_OK;
}

/* Values that are vLLM's, so the table takes them, but that Tessera cannot honour yet.
 * Serving without them would give a user something other than what was asked (FP8 KV,
 * tool calls, a /load endpoint), so every process refuses them at start-up with one line
 * naming the flag, the value and what works; docs/configuration.md ("Flag status") says
 * which issue brings each.  Checked by every process, so `tessera serve` refuses before
 * it starts a child. */
static tsr_status check_supported(const tsr_config *cfg, char *err, size_t errlen) {
        const struct {
                bool on;
                const char *name;
                const char *why;
        } switches[] = {   /* boolean flags refused when on, checked in this order */
                {cfg->enable_request_id_headers, "enable-request-id-headers", "responses carry no X-Request-Id header"},
                {cfg->enable_server_load_tracking, "enable-server-load-tracking", "there is no /load endpoint"},
                {cfg->enable_tokenizer_info_endpoint, "enable-tokenizer-info-endpoint",
                 "there is no /tokenizer_info endpoint"},
                {cfg->calculate_kv_scales, "calculate-kv-scales",
                 "the fp8 KV cache's scales are the checkpoint's k_scale / v_scale, else 1.0"},
        };
        const char *model_file = "the model's own path";

        /* -tp and -pp depend on the model (head and layer counts): the worker checks them
         * once it has read the model's config (worker/main.c).  Data parallelism is more
         * replicas, which Tessera runs as more workers behind the routers. */
        if (cfg->data_parallel_size != 1) {
                tsr_errf(err, errlen, "argument --data-parallel-size: %d is not supported: a worker is one replica; "
                         "for data parallelism start more workers behind the router (supported: 1)",
                         cfg->data_parallel_size);
                return TSR_E_UNSUPPORTED;
        }
        if (check_nodes(cfg, err, errlen) != TSR_OK)
                return TSR_E_UNSUPPORTED;
        /* fp8 (= fp8_e4m3) and fp8_e5m2 are the worker's to check against the model and the
         * device (worker/model/runner.h, tsr_runner_kv_dtype_check). */
        if (cfg->kv_cache_dtype && strcmp(cfg->kv_cache_dtype, "auto") != 0 &&
            strcmp(cfg->kv_cache_dtype, "bfloat16") != 0 && strcmp(cfg->kv_cache_dtype, "fp8") != 0 &&
            strcmp(cfg->kv_cache_dtype, "fp8_e4m3") != 0 && strcmp(cfg->kv_cache_dtype, "fp8_e5m2") != 0) {
                tsr_errf(err, errlen, "argument --kv-cache-dtype: '%s' is not supported yet: the KV cache is "
                         "float32, bfloat16, fp8 e4m3 or fp8 e5m2 (supported: auto, bfloat16, fp8, fp8_e4m3, "
                         "fp8_e5m2)", cfg->kv_cache_dtype);
                return TSR_E_UNSUPPORTED;
        }
        /* vLLM: "--mamba-block-size can only be set with --enable-prefix-caching" */
        if (cfg->mamba_block_size > 0 && cfg->enable_prefix_caching != TSR_TRI_TRUE) {
                tsr_errf(err, errlen, "argument --mamba-block-size: can only be set with --enable-prefix-caching");
                return TSR_E_INVAL;
        }
        if (cfg->mamba_block_size > 0 && (cfg->mamba_block_size % 8 || cfg->mamba_block_size % cfg->block_size)) {
                tsr_errf(err, errlen, "argument --mamba-block-size: %d is not a multiple of 8 and of --block-size %d",
                         cfg->mamba_block_size, cfg->block_size);
                return TSR_E_INVAL;
        }
        /* The Mamba state is float32 in every weight dtype (worker/model/nemotron_h.c says
         * why): vLLM's float16 state is not built. */
        if ((cfg->mamba_cache_dtype && strcmp(cfg->mamba_cache_dtype, "float16") == 0) ||
            (cfg->mamba_ssm_cache_dtype && strcmp(cfg->mamba_ssm_cache_dtype, "float16") == 0)) {
                tsr_errf(err, errlen, "argument --%s: 'float16' is not supported yet: the Mamba state is kept in "
                         "float32 (supported: auto, float32)",
                         cfg->mamba_cache_dtype && strcmp(cfg->mamba_cache_dtype, "float16") == 0
                                 ? "mamba-cache-dtype" : "mamba-ssm-cache-dtype");
                return TSR_E_UNSUPPORTED;
        }
        /* ModelOpt FP8 / NVFP4 checkpoints (#15); the worker checks the value against what
         * the checkpoint announces (worker/load/modelopt.h). */
        if (cfg->quantization && strcmp(cfg->quantization, "modelopt") != 0 &&
            strcmp(cfg->quantization, "modelopt_fp4") != 0 && strcmp(cfg->quantization, "fp8") != 0) {
                tsr_errf(err, errlen, "argument --quantization: '%s' is not supported (supported: modelopt, "
                         "modelopt_fp4, fp8, or leave it unset to use the checkpoint's)", cfg->quantization);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->load_format && strcmp(cfg->load_format, "dummy") == 0) {
                tsr_errf(err, errlen, "argument --load-format: 'dummy' is not supported yet: weights are always "
                         "read from the model files (supported: auto, safetensors, gguf)");
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->tokenizer && !same_path(cfg->tokenizer, cfg->model)) {
                if (cfg->model)
                        model_file = cfg->model;
                tsr_errf(err, errlen, "argument --tokenizer: '%s' is not supported yet: the tokenizer is always "
                         "the model's own (supported: %s, or leave it unset)", cfg->tokenizer, model_file);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->enable_chunked_prefill == TSR_TRI_FALSE) {
                tsr_errf(err, errlen, "argument --no-enable-chunked-prefill: not supported yet: a prompt longer "
                         "than the step's token budget is always split across steps (supported: "
                         "--enable-chunked-prefill, the default)");
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->max_num_partial_prefills != 1) {
                tsr_errf(err, errlen, "argument --max-num-partial-prefills: %d is not supported yet: concurrent "
                         "partial prefills are not implemented (supported: 1)", cfg->max_num_partial_prefills);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->stream_interval != 1) {
                tsr_errf(err, errlen, "argument --stream-interval: %d is not supported yet: every token is "
                         "streamed as soon as it is generated (supported: 1)", cfg->stream_interval);
                return TSR_E_UNSUPPORTED;
        }
        if (cfg->root_path && cfg->root_path[0]) {
                tsr_errf(err, errlen, "argument --root-path: '%s' is not supported yet: the routes are served "
                         "from / only (supported: leave it unset)", cfg->root_path);
                return TSR_E_UNSUPPORTED;
        }
        for (size_t i = 0; i < sizeof(switches) / sizeof(switches[0]); i++) {
                if (switches[i].on) {
                        tsr_errf(err, errlen, "argument --%s: not supported yet: %s (supported: leave it off)",
                                 switches[i].name, switches[i].why);
                        return TSR_E_UNSUPPORTED;
                }
        }
        return TSR_OK;
}

size_t tsr_config_noop_notes(const tsr_config *cfg, unsigned owner, const char **lines, size_t cap) {
        const struct {
                unsigned owner;
                bool set;
                const char *line;
        } notes[] = {
                {TSR_OWNER_WORKER, cfg->swap_space != 4.0,
                 "--swap-space has no effect by design: preempted requests are recomputed, never swapped "
                 "(vLLM V1 ignores it too)"},
                {TSR_OWNER_WORKER, cfg->trust_remote_code,
                 "--trust-remote-code has no effect by design: Tessera never runs code from a model repository"},
                {TSR_OWNER_WORKER, cfg->distributed_executor_backend != NULL,
                 "--distributed-executor-backend has no effect by design: a worker runs its ranks (pipeline "
                 "stages x tensor-parallel ranks) as threads of its one process"},
                {TSR_OWNER_ROUTER, cfg->enable_log_requests,
                 "--enable-log-requests has no effect by design: the router logs a line for every finished "
                 "request already (ids, token counts, latency; never the prompt text) unless "
                 "--disable-log-requests"},
                {TSR_OWNER_ROUTER, cfg->disable_uvicorn_access_log,
                 "--disable-uvicorn-access-log has no effect by design: the router writes no HTTP access log"},
        };
        size_t n = 0;

        for (size_t i = 0; i < sizeof(notes) / sizeof(notes[0]); i++)
                if ((notes[i].owner & owner) && notes[i].set && n < cap)
                        lines[n++] = notes[i].line;
        return n;
}

tsr_status tsr_config_validate(const tsr_config *cfg, char *err, size_t errlen) {
        char why[256];
        long long ll;

        /* Re-check every entry: callers may have filled fields by hand. */
        for (size_t i = 0; i < N_OPTS; i++) {
                const tsr_opt *o = &opts[i];
                const char *s;
                char text[64];
                tsr_status st = TSR_OK;

                switch (o->type) {
                case OPT_INT:
                case OPT_INT_HR:
                        ll = *CAT(cfg, o, int);
                        snprintf(text, sizeof(text), "%lld", ll);
                        st = check_ll(o, ll, text, why, sizeof(why));
                        break;
                case OPT_LL:
                case OPT_SIZE:
                        ll = *CAT(cfg, o, long long);
                        snprintf(text, sizeof(text), "%lld", ll);
                        st = check_ll(o, ll, text, why, sizeof(why));
                        break;
                case OPT_DOUBLE:
                        snprintf(text, sizeof(text), "%g", *CAT(cfg, o, double));
                        st = check_double(o, *CAT(cfg, o, double), text, why, sizeof(why));
                        break;
                case OPT_STR:
                        s = *CAT(cfg, o, char *);
                        if (s)
                                st = convert(o, s, &ll, NULL, why, sizeof(why));
                        break;
                case OPT_TRI:
                        ll = *CAT(cfg, o, int);
                        if (ll < TSR_TRI_UNSET || ll > TSR_TRI_TRUE) {
                                tsr_errf(why, sizeof(why), "invalid tri-state value %lld", ll);
                                st = TSR_E_INVAL;
                        }
                        break;
                case OPT_LIST:
                case OPT_BOOL:
                        break;
                }
                if (st != TSR_OK) {
                        tsr_errf(err, errlen, "argument --%s: %s", o->name, why);
                        return st;
                }
        }
        if (check_supported(cfg, err, errlen) != TSR_OK)
                return TSR_E_UNSUPPORTED;
        if (check_parsers(cfg, err, errlen) != TSR_OK)
                return TSR_E_INVAL;
        if (cfg->max_num_seqs > 0 && cfg->max_num_batched_tokens > 0 &&
            cfg->max_num_batched_tokens < cfg->max_num_seqs) {
                tsr_errf(err, errlen, "argument --max-num-batched-tokens: %d is less than --max-num-seqs %d",
                        cfg->max_num_batched_tokens, cfg->max_num_seqs);
                return TSR_E_INVAL;
        }
        if (cfg->status_listen && cfg->worker_listen && strcmp(cfg->status_listen, cfg->worker_listen) == 0) {
                tsr_errf(err, errlen, "argument --status-listen: must differ from --listen");
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* ------------------------------------------------------------ child argv -- */

typedef struct argv_b {
        char **v;
        int n, cap;
} argv_b;

static tsr_status argv_push(argv_b *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static tsr_status argv_push(argv_b *b, const char *fmt, ...) {
        va_list ap;
        char *s;
        int r;

        if (b->n + 2 > b->cap) {
                int cap = b->cap ? b->cap * 2 : 32;
                char **v = realloc(b->v, (size_t)cap * sizeof(char *));
                if (!v)
                        return TSR_E_NOMEM;
                b->v = v;
                b->cap = cap;
        }
        va_start(ap, fmt);
        r = vasprintf(&s, fmt, ap);
        va_end(ap);
        if (r < 0)
                return TSR_E_NOMEM;
        b->v[b->n++] = s;
        b->v[b->n] = NULL;
        return TSR_OK;
}

/* "--name value", or "--name=value" when the value would read as a flag. */
static tsr_status argv_push_opt(argv_b *b, const tsr_opt *o, const char *v) {
        tsr_status st;

        if (is_flag(v) || strcmp(v, "--") == 0)
                return argv_push(b, "--%s=%s", o->name, v);
        st = argv_push(b, "--%s", o->name);
        return st != TSR_OK ? st : argv_push(b, "%s", v);
}

static tsr_status render_opt(argv_b *b, const tsr_config *cfg, const tsr_opt *o) {
        const tsr_strlist *l;
        char num[64];
        tsr_status st = TSR_OK;
        bool dashy = false;

        switch (o->type) {
        case OPT_STR:
                return *CAT(cfg, o, char *) ? argv_push_opt(b, o, *CAT(cfg, o, char *)) : TSR_OK;
        case OPT_LIST:
                l = CAT(cfg, o, tsr_strlist);
                for (size_t i = 0; i < l->n; i++)
                        dashy = dashy || is_flag(l->items[i]) || strcmp(l->items[i], "--") == 0;
                if (dashy) {            /* each value on its own; repeats append */
                        for (size_t i = 0; i < l->n && st == TSR_OK; i++)
                                st = argv_push(b, "--%s=%s", o->name, l->items[i]);
                        return st;
                }
                if (l->n)
                        st = argv_push(b, "--%s", o->name);
                for (size_t i = 0; i < l->n && st == TSR_OK; i++)
                        st = argv_push(b, "%s", l->items[i]);
                return st;
        case OPT_INT:
        case OPT_INT_HR:
                snprintf(num, sizeof(num), "%d", *CAT(cfg, o, int));
                return argv_push_opt(b, o, num);
        case OPT_LL:
        case OPT_SIZE:
                snprintf(num, sizeof(num), "%lld", *CAT(cfg, o, long long));
                return argv_push_opt(b, o, num);
        case OPT_DOUBLE:
                snprintf(num, sizeof(num), "%.17g", *CAT(cfg, o, double));
                return argv_push_opt(b, o, num);
        case OPT_BOOL:
                return argv_push(b, "--%s%s", *CAT(cfg, o, bool) ? "" : "no-", o->name);
        case OPT_TRI:
                if (*CAT(cfg, o, int) == TSR_TRI_UNSET)
                        return TSR_OK;
                return argv_push(b, "--%s%s", *CAT(cfg, o, int) == TSR_TRI_TRUE ? "" : "no-", o->name);
        }
        return TSR_E_INTERNAL;
}

tsr_status tsr_config_child_argv(const tsr_config *cfg, unsigned owner, char ***ret_argv, int *ret_argc) {
        argv_b b = {0};
        tsr_status st = TSR_OK;

        /* Start non-empty so the array is NULL-terminated even with nothing to pass. */
        b.v = calloc(1, sizeof(char *));
        if (!b.v)
                return TSR_E_NOMEM;
        b.cap = 1;
        /* The model goes first as the positional, unless it would read as a flag. */
        if ((owner & TSR_OWNER_WORKER) && cfg->model)
                st = is_flag(cfg->model) || !strcmp(cfg->model, "--") ? argv_push(&b, "--model=%s", cfg->model)
                                                                      : argv_push(&b, "%s", cfg->model);
        for (size_t i = 0; i < N_OPTS && st == TSR_OK; i++) {
                const tsr_opt *o = &opts[i];

                if (o == opt_config() || o == opt_model() || !cfg->_set[i] || !(o->owner & owner))
                        continue;
                st = render_opt(&b, cfg, o);
        }
        if (st != TSR_OK) {
                tsr_config_free_argv(b.v);
                return st;
        }
        *ret_argv = b.v;
        if (ret_argc)
                *ret_argc = b.n;
        return TSR_OK;
}

void tsr_config_free_argv(char **argv) {
        if (!argv)
                return;
        for (char **p = argv; *p; p++)
                free(*p);
        free(argv);
}

/* ------------------------------------------------------------------ help -- */

#define HELP_COL 36

static void help_line(FILE *out, const char *left, const char *text) {
        int n = fprintf(out, "  %s", left);

        if (n > HELP_COL - 2)           /* keep two spaces before the text */
                fprintf(out, "\n%*s", HELP_COL, "");
        else
                fprintf(out, "%*s", HELP_COL - n, "");
        fprintf(out, "%s\n", text);
}

void tsr_config_print_help(FILE *out, const char *usage_line, unsigned owner_mask) {
        static const char *const titles[GRP_COUNT] = {"model", "parallelism", "cache and scheduler",
                                                      "HTTP front end", "Tessera"};
        char left[160], text[512], buf[200];

        fprintf(out, "%s\n\noptions:\n", usage_line ? usage_line : "usage:");
        help_line(out, "-h, --help", "show this help and exit");
        help_line(out, "--version", "print the version and exit");
        for (int g = 0; g < GRP_COUNT; g++) {
                bool title = false;

                for (size_t i = 0; i < N_OPTS; i++) {
                        const tsr_opt *o = &opts[i];
                        const char *def = o->def_help ? o->def_help : o->def;
                        size_t used;

                        if (o->group != (opt_group)g || !(o->owner & owner_mask))
                                continue;
                        if (!title) {
                                fprintf(out, "\n%s:\n", titles[g]);
                                title = true;
                        }
                        if (o->type == OPT_BOOL || o->type == OPT_TRI)
                                snprintf(left, sizeof(left), "--%s, --no-%s", o->name, o->name);
                        else
                                snprintf(left, sizeof(left), "%s%s--%s%s%s %s%s", o->alias ? o->alias : "",
                                         o->alias ? ", " : "", o->name, o->alt ? ", --" : "", o->alt ? o->alt : "",
                                         o->metavar ? o->metavar : "VALUE",
                                         o->type == OPT_LIST ? " [...]" : "");
                        used = (size_t)snprintf(text, sizeof(text), "%s", o->help);
                        if (o->type == OPT_BOOL && !def)
                                def = "off";
                        if (def && used < sizeof(text))
                                used += (size_t)snprintf(text + used, sizeof(text) - used, " (default: %s", def);
                        if (o->choices && used < sizeof(text)) {
                                choices_str(o, buf, sizeof(buf));
                                used += (size_t)snprintf(text + used, sizeof(text) - used, "%schoices: %s",
                                                         def ? "; " : " (", buf);
                        }
                        if ((def || o->choices) && used < sizeof(text))
                                snprintf(text + used, sizeof(text) - used, ")");
                        help_line(out, left, text);
                }
        }
}
