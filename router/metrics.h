/* metrics.h - the router's Prometheus registry: vLLM's series under vLLM's names, plus
 * Tessera's own under `tessera:` (docs/metrics.md has the table).
 *
 * Operators keep the Grafana dashboards, alerts and autoscalers they built on vLLM, so
 * the vllm:* series copy vLLM 0.12 exactly: names, types, the label set
 * {engine, model_name} (engine is always "0": the router folds every worker of a model
 * into one engine), histogram bucket boundaries, and the text that prometheus_client
 * prints (sorted labels, `_total` on counters, `_created` families, Python float
 * formatting, so an `le` label reads "1.0" here as it does on vLLM and a series keeps
 * its identity when a deployment moves from vLLM to Tessera).
 *
 * Where values come from:
 *   - worker Status (tsr_metrics_worker_status): running/waiting/KV usage gauges, summed
 *     over the model's live workers; the cumulative engine counters, turned into
 *     router-side counters by per-worker deltas so they never go down when a worker
 *     restarts;
 *   - the request path (tsr_metrics_observe_*, tsr_metrics_request_finished): TTFT,
 *     ITL, per-step tokens and the per-request histograms.
 *
 * Every labelled vllm:* series of a model exists, at 0, from tsr_metrics_add_model on:
 * dashboards and `rate()` need the series before the first request.
 *
 * Thread: the router's loop thread only.  Nothing here locks; every call, the render
 * included, must come from the one thread that owns the object. */
#ifndef TSR_ROUTER_METRICS_H
#define TSR_ROUTER_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/tsr_status.h"

/* The Content-Type the /metrics route answers with. */
#define TSR_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
/* The one value of --show-hidden-metrics-for-version that shows vLLM 0.12's hidden
 * series (vLLM accepts exactly the previous minor version). */
#define TSR_METRICS_HIDDEN_VERSION "0.11"

typedef struct tsr_metrics tsr_metrics;

typedef struct tsr_metrics_opts {
        bool disable_log_stats;                      /* --disable-log-stats: no vllm:* at all */
        const char *show_hidden_metrics_for_version; /* NULL = none; copied */
        /* Unix seconds for the `_created` samples; NULL = the wall clock.  Tests pin it. */
        double (*clock)(void *ud);
        void *clock_ud;
} tsr_metrics_opts;

/* Loop thread.  `o` may be NULL (defaults).  Creates the unlabelled tessera:* series. */
tsr_status tsr_metrics_new(const tsr_metrics_opts *o, tsr_metrics **ret);
/* Accepts NULL and *m == NULL; clears *m. */
void tsr_metrics_free(tsr_metrics **m);

/* vLLM's CacheConfig, rendered as the labels of vllm:cache_config_info the way
 * Python's str() prints them (True/False, None, 0.9).  Strings NULL = "None";
 * numbers below 0 = "None". */
typedef struct tsr_metrics_cache_info {
        int64_t block_size;
        int64_t num_gpu_blocks;              /* ModelInfo.kv_blocks_total */
        int64_t num_cpu_blocks;              /* -1: Tessera has no CPU swap tier */
        int64_t num_gpu_blocks_override;     /* -1 = None */
        int64_t sliding_window;              /* -1 = None */
        int64_t kv_cache_memory_bytes;       /* -1 = None */
        double gpu_memory_utilization;
        double swap_space;                   /* GiB */
        bool enable_prefix_caching;
        bool is_attention_free;
        const char *cache_dtype;             /* "auto" */
        const char *prefix_caching_hash_algo;/* "sha256" */
} tsr_metrics_cache_info;

/* Fills `ci` with vLLM's defaults (block 16, 0.9, prefix caching on, sha256, ...). */
void tsr_metrics_cache_info_defaults(tsr_metrics_cache_info *ci);

/* A model appears (name = its first served model name).  Creates every vllm:* series of
 * the model at 0, with 1-2-5 token buckets up to `max_model_len`, and cache_config_info
 * from `ci` (NULL = defaults).  Calling it again for a known model only replaces the
 * cache_config_info labels (a worker with more KV blocks joined); buckets stay.
 * No-op with disable_log_stats.  Copies everything.  TSR_E_INVAL on an empty name or
 * max_model_len 0, TSR_E_NOMEM. */
tsr_status tsr_metrics_add_model(tsr_metrics *m, const char *model_name, uint32_t max_model_len,
                                 const tsr_metrics_cache_info *ci);

/* What one Status carries for /metrics.  The *_total fields are the worker's
 * cumulative counts since its start (boot_epoch). */
typedef struct tsr_metrics_worker_sample {
        uint32_t num_running;
        uint32_t num_waiting;
        uint64_t kv_blocks_total;            /* allocatable blocks (no reserved null block) */
        uint64_t kv_blocks_free;             /* evictable cached blocks included */
        /* The KV memory by bytes, recurrent-state slots included (0 / 0: not reported):
         * usage is then used / total, else 1 - free / total blocks */
        uint64_t kv_bytes_total, kv_bytes_used;
        uint64_t num_preemptions_total;
        uint64_t prefix_cache_queries_total;
        uint64_t prefix_cache_hits_total;
        uint64_t prompt_tokens_total;
        uint64_t generation_tokens_total;
        uint64_t weight_bytes;               /* from its ModelInfo (0: not reported) */
} tsr_metrics_worker_sample;

/* A worker's Status arrived.  `worker_key` names the worker for as long as the router
 * knows it (its endpoint); copied.  Sets the model's gauges from the latest sample of
 * every live worker of the model (running and waiting summed; KV usage
 * 1 - sum(free)/sum(total)) and the worker's liveness gauge to 1, and adds to the
 * model's counters what the worker's cumulative counters grew by since its previous
 * sample.  A worker seen for the first time is a baseline (its past was counted by
 * whatever router it served then); a new boot_epoch, or a counter lower than before,
 * means the worker restarted, and its whole current count is new.  The model must
 * have been added (TSR_E_NOTFOUND otherwise); with disable_log_stats only the
 * tessera:* liveness moves.  TSR_E_NOMEM. */
tsr_status tsr_metrics_worker_status(tsr_metrics *m, const char *model_name, const char *worker_key,
                                     uint64_t boot_epoch, const tsr_metrics_worker_sample *s);

/* The worker is dead or removed: its last sample stops counting in the gauges and its
 * liveness gauge goes to 0.  Its counter baseline is kept, so work it did while out of
 * sight is counted once when it comes back with the same boot_epoch.  Unknown keys
 * are ignored. */
void tsr_metrics_worker_gone(tsr_metrics *m, const char *worker_key);
/* The worker left the router's pool for good (a --worker-dns address that dropped out
 * of the answer): its tessera:worker_up series disappears and its sample stops counting
 * in the gauges.  Its counter baseline goes too, so if the address is added again its
 * first Status is a baseline, as for any new worker: what it did while outside the pool
 * was not this router's work.  Unknown keys are ignored. */
void tsr_metrics_worker_remove(tsr_metrics *m, const char *worker_key);

typedef enum tsr_metrics_finish {
        TSR_METRICS_FINISH_STOP = 0,
        TSR_METRICS_FINISH_LENGTH,
        TSR_METRICS_FINISH_ABORT,
        TSR_METRICS_FINISH_ERROR,
        TSR_METRICS_FINISH_COUNT,
} tsr_metrics_finish;

/* One finished sequence (one choice: vLLM runs each of a request's n samples as its
 * own engine request and counts each).  Times in seconds. */
typedef struct tsr_metrics_request {
        tsr_metrics_finish finished_reason;
        double e2e_s;                        /* router: arrival -> last output */
        double queue_s;                      /* worker: Output.queued_ns */
        double prefill_s;                    /* worker: Output.prefill_ns */
        double decode_s;                     /* worker: Output.decode_ns */
        double inference_s;                  /* prefill + decode */
        uint32_t num_prompt_tokens;
        uint32_t num_generation_tokens;
        uint32_t max_tokens;                 /* the max_tokens parameter; 0 = not given */
} tsr_metrics_request;

/* Loop thread.  An unknown model or disable_log_stats makes this a no-op (nothing for
 * the request path to handle, so no status).  Observes request_success{reason}, e2e,
 * queue, prefill, decode, inference, request_time_per_output_token
 * (decode / (generated - 1), 0 for one token), prompt/generation token counts and
 * max_tokens (when given).  Negative or NaN times are skipped, not clamped. */
void tsr_metrics_request_finished(tsr_metrics *m, const char *model_name, const tsr_metrics_request *r);
/* All n sequences of one request finished: request_params_n and
 * request_max_num_generation_tokens (the longest of the n), once per request. */
void tsr_metrics_request_group_finished(tsr_metrics *m, const char *model_name, uint32_t n,
                                        uint32_t max_num_generation_tokens);
/* First token of a sequence reached the router: seconds since the request arrived. */
void tsr_metrics_observe_ttft(tsr_metrics *m, const char *model_name, double seconds);
/* A later Output of a sequence: seconds since its previous Output (one sample per
 * step, however many tokens the step brought, as vLLM does).  Also feeds
 * time_per_output_token_seconds when that hidden series is shown. */
void tsr_metrics_observe_itl(tsr_metrics *m, const char *model_name, double seconds);
/* One engine step (one Output message): prompt tokens of the sequences whose prefill
 * finished in it plus the tokens it generated, as vLLM counts iteration_tokens_total. */
void tsr_metrics_observe_iteration(tsr_metrics *m, const char *model_name, uint64_t num_tokens);

/* Tessera's own series.  Each has at most one label (named in the comment); pass its
 * value, or NULL for unlabelled series.  Children are created on first use, so call
 * with 0 to make a known label value exist before anything happens. */
typedef enum tsr_metrics_id {
        TSR_METRICS_WORKER_UP = 0,    /* gauge tessera:worker_up{worker}, set by worker_status/_gone */
        TSR_METRICS_PLACEMENTS,       /* counter tessera:placement_decisions{policy} */
        TSR_METRICS_RETRIES,          /* counter tessera:request_retries */
        TSR_METRICS_ABORTS,           /* counter tessera:request_aborts{cause} */
        TSR_METRICS_CONNECTIONS,      /* gauge tessera:router_connections (open now) */
        TSR_METRICS_CONNECTIONS_ACCEPTED, /* counter tessera:router_connections_accepted */
        TSR_METRICS_CONNECTIONS_DROPPED,  /* counter tessera:router_connections_dropped{reason}: closed by
                                           * the server itself: "cap", "header_timeout", "body_timeout",
                                           * "idle_timeout" */
        TSR_METRICS_WORKER_KV_TOTAL,  /* gauge tessera:worker_kv_blocks{worker}, set by worker_status */
        TSR_METRICS_WORKER_KV_FREE,   /* gauge tessera:worker_kv_free_blocks{worker}, set by worker_status */
        TSR_METRICS_WORKER_WEIGHT_BYTES, /* gauge tessera:worker_weight_bytes{worker}, set by worker_status */
        TSR_METRICS_ID_COUNT,
} tsr_metrics_id;

/* Loop thread.  TSR_E_INVAL: wrong kind for `id`, a label value where the series has
 * no label or none where it has one, a negative or NaN counter increment.
 * TSR_E_LIMIT past 4096 children of one series (label values come from config, but a
 * cap keeps a bug from eating memory).  TSR_E_NOMEM. */
tsr_status tsr_metrics_counter_add(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta);
tsr_status tsr_metrics_gauge_set(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double value);
tsr_status tsr_metrics_gauge_add(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta);
/* A counter kept elsewhere (the HTTP server's totals), copied in at scrape time: sets the
 * child to `total`.  TSR_E_INVAL as counter_add, and when `total` is below the current
 * value (a counter never goes down). */
tsr_status tsr_metrics_counter_set_total(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double total);

/* Append the whole exposition (text format 0.0.4) to `out`.  On error `out` may hold
 * part of it (the caller answers 500 and drops it).  TSR_E_LIMIT from the buffer cap,
 * TSR_E_NOMEM. */
tsr_status tsr_metrics_render(const tsr_metrics *m, tsr_buf *out);

/* Exposed for tests: a sample value as prometheus_client prints it (Python repr, and
 * Go's exponent form from 10^7 up: "0.0", "1.0", "0.001", "1e+07", "+Inf", "NaN").
 * `out` needs 32 bytes.  Returns out. */
char *tsr_metrics_format_double(double v, char out[32]);

#endif
