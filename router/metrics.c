/* metrics.c - the router's Prometheus registry and its text exposition (see metrics.h).
 *
 * Layout: a fixed table of families (one per series name, in the order vLLM registers
 * them, then Tessera's); each family owns its children (one per label set).  A model
 * keeps borrowed pointers to its children so the hot calls (observe, Status) never
 * search labels.  Models and workers are short arrays searched linearly: a router
 * serves a handful of models and tens of workers, and Status comes at 10 Hz each.
 *
 * Loop thread only, like every caller of this module. */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

#define TRY(expr)                                \
        do {                                     \
                tsr_status st_ = (expr);         \
                if (st_ != TSR_OK)               \
                        return st_;              \
        } while (0)

/* A cap on children of one tessera:* series: label values come from config and
 * worker lists, but a bug feeding request data into a label must not eat memory. */
#define MAX_CHILDREN 4096
#define MAX_LABELS 16

typedef enum kind { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM } kind;

typedef enum buckets {
        BUCKETS_NONE,
        BUCKETS_TOKENS,         /* 1-2-5 up to the model's max_model_len */
        BUCKETS_N,
        BUCKETS_ITERATION,
        BUCKETS_TTFT,
        BUCKETS_ITL,
        BUCKETS_LATENCY,
} buckets;

/* Bucket boundaries: vLLM's, to the digit.  A dashboard's histogram_quantile works on
 * any boundaries, but recording rules and alerts name `le` values, and those must keep
 * matching after a switch from vLLM. */
static const double bounds_n[] = {1, 2, 5, 10, 20};
static const double bounds_iteration[] = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
static const double bounds_ttft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                     1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double bounds_itl[] = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
                                    0.75, 1.0,   2.5,  5.0,   7.5,  10.0, 20.0, 40.0, 80.0};
static const double bounds_latency[] = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,  15.0, 20.0,
                                        30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

/* Family ids.  The vllm:* ones come first and in vLLM's registration order, so a diff
 * against a vLLM scrape lines up; cache_config_info is last, as vLLM adds it once the
 * engine is up. */
enum {
        F_RUNNING,
        F_WAITING,
        F_KV_USAGE,
        F_PREFIX_QUERIES,
        F_PREFIX_HITS,
        F_PREEMPTIONS,
        F_PROMPT_TOKENS,
        F_GENERATION_TOKENS,
        F_REQUEST_SUCCESS,
        F_REQ_PROMPT_TOKENS,
        F_REQ_GENERATION_TOKENS,
        F_ITERATION_TOKENS,
        F_REQ_MAX_GENERATION_TOKENS,
        F_PARAMS_N,
        F_PARAMS_MAX_TOKENS,
        F_TTFT,
        F_ITL,
        F_TPOT,                 /* hidden: deprecated alias of ITL */
        F_REQ_TPOT,
        F_E2E,
        F_QUEUE,
        F_INFERENCE,
        F_PREFILL,
        F_DECODE,
        F_CACHE_CONFIG,
        F_VLLM_COUNT,
        F_TESSERA_FIRST = F_VLLM_COUNT,
        F_COUNT = F_TESSERA_FIRST + TSR_METRICS_ID_COUNT,
};

typedef struct family_def {
        const char *name;       /* as registered: a counter's name has no _total */
        const char *help;
        kind kind;
        buckets buckets;
        const char *label;      /* tessera:* only: its one label, NULL = none */
} family_def;

/* HELP texts are ours; names, types and buckets are vLLM's. */
static const family_def defs[F_COUNT] = {
        [F_RUNNING] = {"vllm:num_requests_running", "Requests in the engines' running batches.", KIND_GAUGE,
                       BUCKETS_NONE, NULL},
        [F_WAITING] = {"vllm:num_requests_waiting", "Requests queued in the engines, not yet running.", KIND_GAUGE,
                       BUCKETS_NONE, NULL},
        [F_KV_USAGE] = {"vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", KIND_GAUGE,
                        BUCKETS_NONE, NULL},
        [F_PREFIX_QUERIES] = {"vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              KIND_COUNTER, BUCKETS_NONE, NULL},
        [F_PREFIX_HITS] = {"vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", KIND_COUNTER,
                           BUCKETS_NONE, NULL},
        [F_PREEMPTIONS] = {"vllm:num_preemptions", "Requests preempted by the engines.", KIND_COUNTER,
                           BUCKETS_NONE, NULL},
        [F_PROMPT_TOKENS] = {"vllm:prompt_tokens", "Prompt tokens prefilled.", KIND_COUNTER, BUCKETS_NONE, NULL},
        [F_GENERATION_TOKENS] = {"vllm:generation_tokens", "Tokens generated.", KIND_COUNTER, BUCKETS_NONE, NULL},
        [F_REQUEST_SUCCESS] = {"vllm:request_success", "Finished requests, by finish reason.", KIND_COUNTER,
                               BUCKETS_NONE, NULL},
        [F_REQ_PROMPT_TOKENS] = {"vllm:request_prompt_tokens", "Prompt length of each finished request, in tokens.",
                                 KIND_HISTOGRAM, BUCKETS_TOKENS, NULL},
        [F_REQ_GENERATION_TOKENS] = {"vllm:request_generation_tokens",
                                     "Tokens generated by each finished request.", KIND_HISTOGRAM, BUCKETS_TOKENS,
                                     NULL},
        [F_ITERATION_TOKENS] = {"vllm:iteration_tokens_total", "Tokens (prompt and generated) per engine step.",
                                KIND_HISTOGRAM, BUCKETS_ITERATION, NULL},
        [F_REQ_MAX_GENERATION_TOKENS] = {"vllm:request_max_num_generation_tokens",
                                         "Most tokens generated by any of the n sequences of a request.",
                                         KIND_HISTOGRAM, BUCKETS_TOKENS, NULL},
        [F_PARAMS_N] = {"vllm:request_params_n", "The n parameter of each request.", KIND_HISTOGRAM, BUCKETS_N,
                        NULL},
        [F_PARAMS_MAX_TOKENS] = {"vllm:request_params_max_tokens", "The max_tokens parameter of each request.",
                                 KIND_HISTOGRAM, BUCKETS_TOKENS, NULL},
        [F_TTFT] = {"vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
                    KIND_HISTOGRAM, BUCKETS_TTFT, NULL},
        [F_ITL] = {"vllm:inter_token_latency_seconds", "Seconds between successive outputs of a request.",
                   KIND_HISTOGRAM, BUCKETS_ITL, NULL},
        [F_TPOT] = {"vllm:time_per_output_token_seconds",
                    "Seconds between successive outputs of a request. Deprecated: use "
                    "vllm:inter_token_latency_seconds.",
                    KIND_HISTOGRAM, BUCKETS_ITL, NULL},
        [F_REQ_TPOT] = {"vllm:request_time_per_output_token_seconds",
                        "Mean seconds per generated token after the first, per request.", KIND_HISTOGRAM,
                        BUCKETS_ITL, NULL},
        [F_E2E] = {"vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
                   KIND_HISTOGRAM, BUCKETS_LATENCY, NULL},
        [F_QUEUE] = {"vllm:request_queue_time_seconds", "Seconds a request waited before it was first scheduled.",
                     KIND_HISTOGRAM, BUCKETS_LATENCY, NULL},
        [F_INFERENCE] = {"vllm:request_inference_time_seconds",
                         "Seconds from a request's first scheduling to its last token.", KIND_HISTOGRAM,
                         BUCKETS_LATENCY, NULL},
        [F_PREFILL] = {"vllm:request_prefill_time_seconds",
                       "Seconds from a request's first scheduling to its first token.", KIND_HISTOGRAM,
                       BUCKETS_LATENCY, NULL},
        [F_DECODE] = {"vllm:request_decode_time_seconds", "Seconds from a request's first token to its last.",
                      KIND_HISTOGRAM, BUCKETS_LATENCY, NULL},
        [F_CACHE_CONFIG] = {"vllm:cache_config_info", "KV-cache configuration, as labels (value always 1).",
                            KIND_GAUGE, BUCKETS_NONE, NULL},
        [F_TESSERA_FIRST + TSR_METRICS_WORKER_UP] = {"tessera:worker_up",
                                                     "1 while the worker is live (Status within 3 intervals), "
                                                     "else 0.",
                                                     KIND_GAUGE, BUCKETS_NONE, "worker"},
        [F_TESSERA_FIRST + TSR_METRICS_PLACEMENTS] = {"tessera:placement_decisions",
                                                      "Requests placed on a worker, by placement policy.",
                                                      KIND_COUNTER, BUCKETS_NONE, "policy"},
        [F_TESSERA_FIRST + TSR_METRICS_RETRIES] = {"tessera:request_retries",
                                                   "Requests resubmitted to another worker.", KIND_COUNTER,
                                                   BUCKETS_NONE, NULL},
        [F_TESSERA_FIRST + TSR_METRICS_ABORTS] = {"tessera:request_aborts", "Requests aborted, by cause.",
                                                  KIND_COUNTER, BUCKETS_NONE, "cause"},
        [F_TESSERA_FIRST + TSR_METRICS_CONNECTIONS] = {"tessera:router_connections", "Open HTTP connections.",
                                                       KIND_GAUGE, BUCKETS_NONE, NULL},
        [F_TESSERA_FIRST + TSR_METRICS_CONNECTIONS_ACCEPTED] = {"tessera:router_connections_accepted",
                                                                "HTTP connections accepted.", KIND_COUNTER,
                                                                BUCKETS_NONE, NULL},
        [F_TESSERA_FIRST + TSR_METRICS_CONNECTIONS_DROPPED] = {"tessera:router_connections_dropped",
                                                               "HTTP connections the router closed on its own, by reason "
                                                               "(cap, header_timeout, body_timeout, idle_timeout).",
                                                               KIND_COUNTER, BUCKETS_NONE, "reason"},
        /* Per replica (a worker endpoint is a replica's leader): the KV capacity it
         * reported in its last Status, what placement reads.  vllm:kv_cache_usage_perc
         * is the same for the whole model, summed over workers. */
        [F_TESSERA_FIRST + TSR_METRICS_WORKER_KV_TOTAL] = {"tessera:worker_kv_blocks",
                                                           "KV-cache blocks of the worker (its last Status).",
                                                           KIND_GAUGE, BUCKETS_NONE, "worker"},
        [F_TESSERA_FIRST + TSR_METRICS_WORKER_KV_FREE] = {"tessera:worker_kv_free_blocks",
                                                          "KV-cache blocks free on the worker, evictable cached "
                                                          "blocks included (its last Status).",
                                                          KIND_GAUGE, BUCKETS_NONE, "worker"},
        [F_TESSERA_FIRST + TSR_METRICS_WORKER_WEIGHT_BYTES] = {"tessera:worker_weight_bytes",
                                                               "Bytes of model weights resident on the worker, every "
                                                               "rank, as held (kept quantized or widened; its "
                                                               "ModelInfo).",
                                                               KIND_GAUGE, BUCKETS_NONE, "worker"},
};

static const char *const finish_names[TSR_METRICS_FINISH_COUNT] = {"stop", "length", "abort", "error"};

typedef struct label {
        const char *name;       /* static */
        char *value;            /* owned */
} label;

typedef struct child {
        label labels[MAX_LABELS];   /* sorted by name, as prometheus_client prints them */
        size_t n_labels;
        double value;               /* counter, gauge */
        const double *bounds;       /* histogram: finite upper bounds, ascending (borrowed) */
        size_t n_bounds;
        uint64_t *counts;           /* n_bounds + 1 (last = +Inf), not cumulative */
        double sum;
        uint64_t count;
        double created;             /* unix seconds */
} child;

typedef struct family {
        const family_def *def;
        child **children;
        size_t n, cap;
} family;

typedef struct model {
        char *name;
        uint32_t max_model_len;
        double *token_bounds;       /* 1-2-5 up to max_model_len; children point here */
        size_t n_token_bounds;
        child *c[F_VLLM_COUNT];     /* NULL for request_success, cache_config, hidden */
        child *success[TSR_METRICS_FINISH_COUNT];
        child *cache_info;
} model;

typedef struct worker {
        char *key;
        size_t model;               /* index into models, SIZE_MAX = none yet */
        uint64_t boot_epoch;
        bool have_sample;           /* `last` holds a sample of `model` */
        bool live;
        tsr_metrics_worker_sample last;
        child *up;
        child *kv_total, *kv_free;  /* created with the first Status that reports a KV size */
        child *weight_bytes;        /* created once its ModelInfo reported them */
} worker;

struct tsr_metrics {
        /* Every public function holds it: with --router-threads each event loop
         * updates the one registry and any of them renders it. */
        pthread_mutex_t lock;
        bool disable_log_stats;
        bool show_hidden;
        double (*clock)(void *ud);
        void *clock_ud;
        family fam[F_COUNT];
        model **models;
        size_t n_models, cap_models;
        worker **workers;
        size_t n_workers, cap_workers;
};

/* ---------------------------------------------------------------- number format */

/* prometheus_client prints repr(float) (the shortest digits that read back the same,
 * fixed notation for 1e-4 <= |v| < 1e16, ".0" on integers), then rewrites positives of
 * seven or more integer digits in Go's exponent form.  Matching it keeps `le` label
 * values, and so series identities, equal to vLLM's. */
char *tsr_metrics_format_double(double v, char out[32]) {
        char tmp[40], digits[20];
        int prec, exp10 = 0, nd = 0, decpt, pos = 0;

        if (isnan(v)) {
                strcpy(out, "NaN");
                return out;
        }
        if (isinf(v)) {
                strcpy(out, v > 0 ? "+Inf" : "-Inf");
                return out;
        }
        if (v == 0) {
                strcpy(out, signbit(v) ? "-0.0" : "0.0");
                return out;
        }
        for (prec = 1; prec <= 17; prec++) {
                snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, v);
                if (strtod(tmp, NULL) == v)
                        break;
        }
        /* tmp = [-]d[.ddd]e[+-]XX */
        for (const char *p = tmp; *p && *p != 'e'; p++)
                if (*p >= '0' && *p <= '9')
                        digits[nd++] = *p;
        exp10 = atoi(strchr(tmp, 'e') + 1);
        while (nd > 1 && digits[nd - 1] == '0')
                nd--;
        decpt = exp10 + 1;      /* digits[0..decpt) are the integer part */

        if (v < 0)
                out[pos++] = '-';
        if (decpt > 16 || decpt < -3) {
                out[pos++] = digits[0];
                if (nd > 1) {
                        out[pos++] = '.';
                        memcpy(out + pos, digits + 1, (size_t)nd - 1);
                        pos += nd - 1;
                }
                snprintf(out + pos, 32 - (size_t)pos, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
                return out;
        }
        if (v > 0 && decpt > 6) {
                /* Go's form: the integer part must hold 7..16 digits here. */
                out[pos++] = digits[0];
                if (nd > 1) {
                        out[pos++] = '.';
                        memcpy(out + pos, digits + 1, (size_t)nd - 1);
                        pos += nd - 1;
                }
                snprintf(out + pos, 32 - (size_t)pos, "e+%02d", decpt - 1);
                return out;
        }
        if (decpt <= 0) {
                out[pos++] = '0';
                out[pos++] = '.';
                for (int i = 0; i < -decpt; i++)
                        out[pos++] = '0';
                memcpy(out + pos, digits, (size_t)nd);
                pos += nd;
        } else if (decpt >= nd) {
                memcpy(out + pos, digits, (size_t)nd);
                pos += nd;
                for (int i = nd; i < decpt; i++)
                        out[pos++] = '0';
                out[pos++] = '.';
                out[pos++] = '0';
        } else {
                memcpy(out + pos, digits, (size_t)decpt);
                pos += decpt;
                out[pos++] = '.';
                memcpy(out + pos, digits + decpt, (size_t)(nd - decpt));
                pos += nd - decpt;
        }
        out[pos] = '\0';
        return out;
}

/* Python's str() of an int, or "None" below 0 (how vLLM prints an unset field). */
static void format_int_or_none(int64_t v, char out[32]) {
        if (v < 0)
                strcpy(out, "None");
        else
                snprintf(out, 32, "%lld", (long long)v);
}

/* ---------------------------------------------------------------- children */

static double now_unix(const tsr_metrics *m) {
        if (m->clock)
                return m->clock(m->clock_ud);
        return (double)tsr_wall_ns() / 1e9;
}

static void child_free(child *c) {
        if (!c)
                return;
        for (size_t i = 0; i < c->n_labels; i++)
                free(c->labels[i].value);
        free(c->counts);
        free(c);
}

static int label_cmp(const void *a, const void *b) {
        return strcmp(((const label *)a)->name, ((const label *)b)->name);
}

/* New child of family `f` with `n` labels (names static, values copied), appended to
 * the family.  `bounds` only for histograms.  Returns NULL on OOM (nothing added). */
static child *child_add(tsr_metrics *m, family *f, const char *const *names, const char *const *values, size_t n,
                        const double *bounds, size_t n_bounds) {
        child *c;

        if (n > MAX_LABELS)
                return NULL;
        if (f->n == f->cap) {
                size_t cap = f->cap ? f->cap * 2 : 4;
                child **p = realloc(f->children, cap * sizeof(*p));
                if (!p)
                        return NULL;
                f->children = p;
                f->cap = cap;
        }
        c = calloc(1, sizeof(*c));
        if (!c)
                return NULL;
        for (size_t i = 0; i < n; i++) {
                c->labels[i].name = names[i];
                c->labels[i].value = strdup(values[i]);
                c->n_labels = i + 1;
                if (!c->labels[i].value) {
                        child_free(c);
                        return NULL;
                }
        }
        qsort(c->labels, c->n_labels, sizeof(label), label_cmp);
        if (f->def->kind == KIND_HISTOGRAM) {
                c->bounds = bounds;
                c->n_bounds = n_bounds;
                c->counts = calloc(n_bounds + 1, sizeof(*c->counts));
                if (!c->counts) {
                        child_free(c);
                        return NULL;
                }
        }
        c->created = now_unix(m);
        f->children[f->n++] = c;
        return c;
}

static void child_remove(family *f, child *c) {
        for (size_t i = 0; i < f->n; i++) {
                if (f->children[i] == c) {
                        memmove(f->children + i, f->children + i + 1, (f->n - i - 1) * sizeof(*f->children));
                        f->n--;
                        child_free(c);
                        return;
                }
        }
}

static void observe(child *c, double v) {
        size_t i;

        /* A NaN or negative time is a clock bug upstream; prometheus_client would put a
         * NaN in +Inf and poison _sum forever, so drop it. */
        if (!c || isnan(v) || v < 0)
                return;
        for (i = 0; i < c->n_bounds && v > c->bounds[i]; i++)
                ;
        c->counts[i]++;
        c->count++;
        c->sum += v;
}

/* ---------------------------------------------------------------- lifecycle */

tsr_status tsr_metrics_new(const tsr_metrics_opts *o, tsr_metrics **ret) {
        tsr_metrics *m = calloc(1, sizeof(*m));

        if (!m)
                return TSR_E_NOMEM;
        pthread_mutex_init(&m->lock, NULL);
        for (size_t i = 0; i < F_COUNT; i++)
                m->fam[i].def = &defs[i];
        if (o) {
                m->disable_log_stats = o->disable_log_stats;
                m->show_hidden = o->show_hidden_metrics_for_version &&
                                 strcmp(o->show_hidden_metrics_for_version, TSR_METRICS_HIDDEN_VERSION) == 0;
                m->clock = o->clock;
                m->clock_ud = o->clock_ud;
        }
        /* Unlabelled series exist from the start, as prometheus_client creates them. */
        for (size_t i = F_TESSERA_FIRST; i < F_COUNT; i++) {
                if (defs[i].label)
                        continue;
                if (!child_add(m, &m->fam[i], NULL, NULL, 0, NULL, 0)) {
                        tsr_metrics_free(&m);
                        return TSR_E_NOMEM;
                }
        }
        *ret = m;
        return TSR_OK;
}

static void model_free(model *md) {
        if (!md)
                return;
        free(md->name);
        free(md->token_bounds);
        free(md);
}

void tsr_metrics_free(tsr_metrics **mp) {
        tsr_metrics *m = mp ? *mp : NULL;

        if (!m)
                return;
        /* Children first: histogram children borrow their model's token bounds. */
        for (size_t i = 0; i < F_COUNT; i++) {
                for (size_t j = 0; j < m->fam[i].n; j++)
                        child_free(m->fam[i].children[j]);
                free(m->fam[i].children);
        }
        for (size_t i = 0; i < m->n_models; i++)
                model_free(m->models[i]);
        free(m->models);
        for (size_t i = 0; i < m->n_workers; i++) {
                free(m->workers[i]->key);
                free(m->workers[i]);
        }
        free(m->workers);
        pthread_mutex_destroy(&m->lock);
        free(m);
        *mp = NULL;
}

/* ---------------------------------------------------------------- models */

static model *find_model(const tsr_metrics *m, const char *name, size_t *idx) {
        if (!name)
                return NULL;
        for (size_t i = 0; i < m->n_models; i++) {
                if (strcmp(m->models[i]->name, name) == 0) {
                        if (idx)
                                *idx = i;
                        return m->models[i];
                }
        }
        return NULL;
}

void tsr_metrics_cache_info_defaults(tsr_metrics_cache_info *ci) {
        memset(ci, 0, sizeof(*ci));
        ci->block_size = 16;
        ci->num_gpu_blocks = -1;
        ci->num_cpu_blocks = -1;
        ci->num_gpu_blocks_override = -1;
        ci->sliding_window = -1;
        ci->kv_cache_memory_bytes = -1;
        ci->gpu_memory_utilization = 0.9;
        ci->swap_space = 4.0;
        ci->enable_prefix_caching = true;
        ci->is_attention_free = false;
        ci->cache_dtype = "auto";
        ci->prefix_caching_hash_algo = "sha256";
}

/* cache_config_info of `md` from `ci`: vLLM prints every CacheConfig field with str();
 * we print the fields Tessera has.  model_name is our addition: vLLM runs one model per
 * process, a router serves several, and two models with the same cache config would
 * otherwise be one duplicated series. */
static tsr_status model_set_cache_info(tsr_metrics *m, model *md, const tsr_metrics_cache_info *ci) {
        char block_size[32], num_gpu[32], num_cpu[32], override[32], window[32], kvbytes[32], util[32], swap[32];
        const char *names[] = {"model_name",
                               "engine",
                               "block_size",
                               "cache_dtype",
                               "enable_prefix_caching",
                               "gpu_memory_utilization",
                               "is_attention_free",
                               "kv_cache_memory_bytes",
                               "num_cpu_blocks",
                               "num_gpu_blocks",
                               "num_gpu_blocks_override",
                               "prefix_caching_hash_algo",
                               "sliding_window",
                               "swap_space"};
        const char *values[COUNT_OF(names)];
        family *f = &m->fam[F_CACHE_CONFIG];
        child *c;

        format_int_or_none(ci->block_size, block_size);
        format_int_or_none(ci->num_gpu_blocks, num_gpu);
        format_int_or_none(ci->num_cpu_blocks, num_cpu);
        format_int_or_none(ci->num_gpu_blocks_override, override);
        format_int_or_none(ci->sliding_window, window);
        format_int_or_none(ci->kv_cache_memory_bytes, kvbytes);
        tsr_metrics_format_double(ci->gpu_memory_utilization, util);
        tsr_metrics_format_double(ci->swap_space, swap);
        values[0] = md->name;
        values[1] = "0";
        values[2] = block_size;
        values[3] = ci->cache_dtype ? ci->cache_dtype : "None";
        values[4] = ci->enable_prefix_caching ? "True" : "False";
        values[5] = util;
        values[6] = ci->is_attention_free ? "True" : "False";
        values[7] = kvbytes;
        values[8] = num_cpu;
        values[9] = num_gpu;
        values[10] = override;
        values[11] = ci->prefix_caching_hash_algo ? ci->prefix_caching_hash_algo : "None";
        values[12] = window;
        values[13] = swap;
        c = child_add(m, f, names, values, COUNT_OF(names), NULL, 0);
        if (!c)
                return TSR_E_NOMEM;
        c->value = 1;
        if (md->cache_info)
                child_remove(f, md->cache_info);
        md->cache_info = c;
        return TSR_OK;
}

static tsr_status build_token_bounds(model *md) {
        static const uint64_t mant[] = {1, 2, 5};
        size_t n = 0;
        double *b = malloc(40 * sizeof(*b));   /* 3 per decade, 10 decades cover 2^32 */

        if (!b)
                return TSR_E_NOMEM;
        for (uint64_t scale = 1;; scale *= 10) {
                for (size_t i = 0; i < COUNT_OF(mant); i++) {
                        if (mant[i] * scale > md->max_model_len)
                                goto done;
                        b[n++] = (double)(mant[i] * scale);
                }
        }
done:
        md->token_bounds = b;
        md->n_token_bounds = n;
        return TSR_OK;
}

static tsr_status add_model_locked(tsr_metrics *m, const char *model_name, uint32_t max_model_len,
                                 const tsr_metrics_cache_info *ci) {
        tsr_metrics_cache_info defaults;
        const char *names[] = {"model_name", "engine", "finished_reason"};
        const char *values[] = {model_name, "0", NULL};
        model *md;

        if (!model_name || !*model_name || max_model_len == 0)
                return TSR_E_INVAL;
        if (m->disable_log_stats)
                return TSR_OK;
        if (!ci) {
                tsr_metrics_cache_info_defaults(&defaults);
                ci = &defaults;
        }
        md = find_model(m, model_name, NULL);
        if (md)
                return model_set_cache_info(m, md, ci);

        if (m->n_models == m->cap_models) {
                size_t cap = m->cap_models ? m->cap_models * 2 : 4;
                model **p = realloc(m->models, cap * sizeof(*p));
                if (!p)
                        return TSR_E_NOMEM;
                m->models = p;
                m->cap_models = cap;
        }
        md = calloc(1, sizeof(*md));
        if (!md)
                return TSR_E_NOMEM;
        md->max_model_len = max_model_len;
        md->name = strdup(model_name);
        if (!md->name || build_token_bounds(md) != TSR_OK) {
                model_free(md);
                return TSR_E_NOMEM;
        }
        m->models[m->n_models++] = md;

        for (int i = 0; i < F_VLLM_COUNT; i++) {
                const double *b = NULL;
                size_t nb = 0;

                if (i == F_REQUEST_SUCCESS || i == F_CACHE_CONFIG || (i == F_TPOT && !m->show_hidden))
                        continue;
                switch (defs[i].buckets) {
                case BUCKETS_NONE: break;
                case BUCKETS_TOKENS: b = md->token_bounds; nb = md->n_token_bounds; break;
                case BUCKETS_N: b = bounds_n; nb = COUNT_OF(bounds_n); break;
                case BUCKETS_ITERATION: b = bounds_iteration; nb = COUNT_OF(bounds_iteration); break;
                case BUCKETS_TTFT: b = bounds_ttft; nb = COUNT_OF(bounds_ttft); break;
                case BUCKETS_ITL: b = bounds_itl; nb = COUNT_OF(bounds_itl); break;
                case BUCKETS_LATENCY: b = bounds_latency; nb = COUNT_OF(bounds_latency); break;
                }
                md->c[i] = child_add(m, &m->fam[i], names, values, 2, b, nb);
                if (!md->c[i])
                        goto oom;
        }
        /* Every finish reason exists at 0: dashboards sum by finished_reason. */
        for (int r = 0; r < TSR_METRICS_FINISH_COUNT; r++) {
                values[2] = finish_names[r];
                md->success[r] = child_add(m, &m->fam[F_REQUEST_SUCCESS], names, values, 3, NULL, 0);
                if (!md->success[r])
                        goto oom;
        }
        if (model_set_cache_info(m, md, ci) != TSR_OK)
                goto oom;
        return TSR_OK;

oom:
        /* Take the half-made model out again: every other call may then assume a
         * registered model has all its children. */
        for (int i = 0; i < F_VLLM_COUNT; i++)
                if (md->c[i])
                        child_remove(&m->fam[i], md->c[i]);
        for (int r = 0; r < TSR_METRICS_FINISH_COUNT; r++)
                if (md->success[r])
                        child_remove(&m->fam[F_REQUEST_SUCCESS], md->success[r]);
        m->n_models--;
        model_free(md);
        return TSR_E_NOMEM;
}

tsr_status tsr_metrics_add_model(tsr_metrics *m, const char *model_name, uint32_t max_model_len,
                                 const tsr_metrics_cache_info *ci) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = add_model_locked(m, model_name, max_model_len, ci);
        pthread_mutex_unlock(&m->lock);
        return st;
}

/* ---------------------------------------------------------------- workers */

static worker *find_worker(const tsr_metrics *m, const char *key) {
        if (!key)
                return NULL;
        for (size_t i = 0; i < m->n_workers; i++)
                if (strcmp(m->workers[i]->key, key) == 0)
                        return m->workers[i];
        return NULL;
}

static tsr_status add_worker(tsr_metrics *m, const char *key, worker **ret) {
        worker *w;

        if (m->n_workers == m->cap_workers) {
                size_t cap = m->cap_workers ? m->cap_workers * 2 : 8;
                worker **p = realloc(m->workers, cap * sizeof(*p));
                if (!p)
                        return TSR_E_NOMEM;
                m->workers = p;
                m->cap_workers = cap;
        }
        w = calloc(1, sizeof(*w));
        if (!w)
                return TSR_E_NOMEM;
        w->key = strdup(key);
        if (!w->key) {
                free(w);
                return TSR_E_NOMEM;
        }
        w->model = SIZE_MAX;
        m->workers[m->n_workers++] = w;
        *ret = w;
        return TSR_OK;
}

/* Recompute the gauges of model `idx` from the last sample of each of its live
 * workers.  vLLM's usage is 1 - free/usable per engine; summing blocks before dividing
 * weighs each worker by its cache size, which is what "fraction of the model's KV
 * cache in use" means when there are several. */
static void model_refresh_gauges(tsr_metrics *m, size_t idx) {
        model *md = m->models[idx];
        uint64_t running = 0, waiting = 0, total = 0, free_blocks = 0, bytes_total = 0, bytes_used = 0;
        bool by_bytes = true;   /* every worker reports bytes (a hybrid's state slots counted) */

        for (size_t i = 0; i < m->n_workers; i++) {
                const worker *w = m->workers[i];
                if (w->model != idx || !w->live || !w->have_sample)
                        continue;
                running += w->last.num_running;
                waiting += w->last.num_waiting;
                total += w->last.kv_blocks_total;
                free_blocks += w->last.kv_blocks_free < w->last.kv_blocks_total ? w->last.kv_blocks_free
                                                                                 : w->last.kv_blocks_total;
                by_bytes = by_bytes && w->last.kv_bytes_total > 0;
                bytes_total += w->last.kv_bytes_total;
                bytes_used += w->last.kv_bytes_used < w->last.kv_bytes_total ? w->last.kv_bytes_used
                                                                             : w->last.kv_bytes_total;
        }
        md->c[F_RUNNING]->value = (double)running;
        md->c[F_WAITING]->value = (double)waiting;
        md->c[F_KV_USAGE]->value = by_bytes && bytes_total ? (double)bytes_used / (double)bytes_total
                                   : total                 ? 1.0 - (double)free_blocks / (double)total
                                                           : 0.0;
}

/* What a cumulative worker counter grew by.  Lower than before means the counter
 * started again from 0, so all of `cur` is new (Prometheus' own reset rule). */
static uint64_t counter_delta(uint64_t last, uint64_t cur, bool restarted) {
        if (restarted || cur < last)
                return cur;
        return cur - last;
}

/* The worker's child of tessera series `id` (label worker = its key), made on first use. */
static tsr_status worker_child(tsr_metrics *m, worker *w, tsr_metrics_id id, child **slot) {
        const char *names[] = {"worker"};
        const char *values[] = {w->key};
        family *f = &m->fam[F_TESSERA_FIRST + id];

        if (*slot)
                return TSR_OK;
        if (f->n >= MAX_CHILDREN)
                return TSR_E_LIMIT;
        *slot = child_add(m, f, names, values, 1, NULL, 0);
        return *slot ? TSR_OK : TSR_E_NOMEM;
}

static tsr_status worker_status_locked(tsr_metrics *m, const char *model_name, const char *worker_key,
                                     uint64_t boot_epoch, const tsr_metrics_worker_sample *s) {
        worker *w;
        model *md;
        size_t idx, old;
        bool restarted;

        if (!worker_key || !s)
                return TSR_E_INVAL;
        w = find_worker(m, worker_key);
        if (!w)
                TRY(add_worker(m, worker_key, &w));
        TRY(worker_child(m, w, TSR_METRICS_WORKER_UP, &w->up));
        w->up->value = 1;
        w->live = true;
        if (s->kv_blocks_total) {   /* a worker without an engine reports none: no series */
                TRY(worker_child(m, w, TSR_METRICS_WORKER_KV_TOTAL, &w->kv_total));
                TRY(worker_child(m, w, TSR_METRICS_WORKER_KV_FREE, &w->kv_free));
                w->kv_total->value = (double)s->kv_blocks_total;
                w->kv_free->value = (double)s->kv_blocks_free;
        }
        if (s->weight_bytes) {
                TRY(worker_child(m, w, TSR_METRICS_WORKER_WEIGHT_BYTES, &w->weight_bytes));
                w->weight_bytes->value = (double)s->weight_bytes;
        }
        if (m->disable_log_stats)
                return TSR_OK;
        md = find_model(m, model_name, &idx);
        if (!md)
                return TSR_E_NOTFOUND;

        restarted = w->have_sample && boot_epoch != w->boot_epoch;
        if (w->have_sample) {
                const tsr_metrics_worker_sample *l = &w->last;
                md->c[F_PREEMPTIONS]->value +=
                        (double)counter_delta(l->num_preemptions_total, s->num_preemptions_total, restarted);
                md->c[F_PREFIX_QUERIES]->value +=
                        (double)counter_delta(l->prefix_cache_queries_total, s->prefix_cache_queries_total, restarted);
                md->c[F_PREFIX_HITS]->value +=
                        (double)counter_delta(l->prefix_cache_hits_total, s->prefix_cache_hits_total, restarted);
                md->c[F_PROMPT_TOKENS]->value +=
                        (double)counter_delta(l->prompt_tokens_total, s->prompt_tokens_total, restarted);
                md->c[F_GENERATION_TOKENS]->value +=
                        (double)counter_delta(l->generation_tokens_total, s->generation_tokens_total, restarted);
        }
        /* else: first sight is a baseline.  The router may have just restarted next to
         * long-running workers; their past belongs to the previous router's counters,
         * and adding it here would show as one huge spike in rate(). */
        old = w->model;
        w->model = idx;
        w->boot_epoch = boot_epoch;
        w->last = *s;
        w->have_sample = true;
        if (old != SIZE_MAX && old != idx)
                model_refresh_gauges(m, old);
        model_refresh_gauges(m, idx);
        return TSR_OK;
}

tsr_status tsr_metrics_worker_status(tsr_metrics *m, const char *model_name, const char *worker_key,
                                     uint64_t boot_epoch, const tsr_metrics_worker_sample *s) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = worker_status_locked(m, model_name, worker_key, boot_epoch, s);
        pthread_mutex_unlock(&m->lock);
        return st;
}

static void worker_gone_locked(tsr_metrics *m, const char *worker_key) {
        worker *w = find_worker(m, worker_key);

        if (!w)
                return;
        w->live = false;
        if (w->up)
                w->up->value = 0;
        if (w->model != SIZE_MAX)
                model_refresh_gauges(m, w->model);
}

void tsr_metrics_worker_gone(tsr_metrics *m, const char *worker_key) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        worker_gone_locked(m, worker_key);
        pthread_mutex_unlock(&m->lock);
}

static void worker_remove_locked(tsr_metrics *m, const char *worker_key) {
        worker *w = find_worker(m, worker_key);
        size_t model_idx;

        if (!w)
                return;
        model_idx = w->model;
        if (w->up)
                child_remove(&m->fam[F_TESSERA_FIRST + TSR_METRICS_WORKER_UP], w->up);
        if (w->kv_total)
                child_remove(&m->fam[F_TESSERA_FIRST + TSR_METRICS_WORKER_KV_TOTAL], w->kv_total);
        if (w->kv_free)
                child_remove(&m->fam[F_TESSERA_FIRST + TSR_METRICS_WORKER_KV_FREE], w->kv_free);
        if (w->weight_bytes)
                child_remove(&m->fam[F_TESSERA_FIRST + TSR_METRICS_WORKER_WEIGHT_BYTES], w->weight_bytes);
        for (size_t i = 0; i < m->n_workers; i++) {
                if (m->workers[i] == w) {
                        memmove(m->workers + i, m->workers + i + 1, (m->n_workers - i - 1) * sizeof(*m->workers));
                        m->n_workers--;
                        break;
                }
        }
        free(w->key);
        free(w);
        if (model_idx != SIZE_MAX)
                model_refresh_gauges(m, model_idx);
}

void tsr_metrics_worker_remove(tsr_metrics *m, const char *worker_key) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        worker_remove_locked(m, worker_key);
        pthread_mutex_unlock(&m->lock);
}

/* ---------------------------------------------------------------- request path */

static model *live_model(tsr_metrics *m, const char *name) {
        if (m->disable_log_stats)
                return NULL;
        return find_model(m, name, NULL);
}

static void request_finished_locked(tsr_metrics *m, const char *model_name, const tsr_metrics_request *r) {
        model *md = live_model(m, model_name);
        double tpot = 0;

        if (!md || !r || (unsigned)r->finished_reason >= TSR_METRICS_FINISH_COUNT)
                return;
        md->success[r->finished_reason]->value += 1;
        observe(md->c[F_E2E], r->e2e_s);
        observe(md->c[F_QUEUE], r->queue_s);
        observe(md->c[F_PREFILL], r->prefill_s);
        observe(md->c[F_INFERENCE], r->inference_s);
        observe(md->c[F_DECODE], r->decode_s);
        observe(md->c[F_REQ_PROMPT_TOKENS], (double)r->num_prompt_tokens);
        observe(md->c[F_REQ_GENERATION_TOKENS], (double)r->num_generation_tokens);
        /* vLLM observes 0 for a request of one token: no interval to divide by. */
        if (r->num_generation_tokens > 1)
                tpot = r->decode_s / (double)(r->num_generation_tokens - 1);
        observe(md->c[F_REQ_TPOT], tpot);
        if (r->max_tokens)
                observe(md->c[F_PARAMS_MAX_TOKENS], (double)r->max_tokens);
}

void tsr_metrics_request_finished(tsr_metrics *m, const char *model_name, const tsr_metrics_request *r) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        request_finished_locked(m, model_name, r);
        pthread_mutex_unlock(&m->lock);
}

static void request_group_finished_locked(tsr_metrics *m, const char *model_name, uint32_t n,
                                        uint32_t max_num_generation_tokens) {
        model *md = live_model(m, model_name);

        if (!md)
                return;
        observe(md->c[F_PARAMS_N], (double)n);
        observe(md->c[F_REQ_MAX_GENERATION_TOKENS], (double)max_num_generation_tokens);
}

void tsr_metrics_request_group_finished(tsr_metrics *m, const char *model_name, uint32_t n,
                                        uint32_t max_num_generation_tokens) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        request_group_finished_locked(m, model_name, n, max_num_generation_tokens);
        pthread_mutex_unlock(&m->lock);
}

static void observe_ttft_locked(tsr_metrics *m, const char *model_name, double seconds) {
        model *md = live_model(m, model_name);

        if (md)
                observe(md->c[F_TTFT], seconds);
}

void tsr_metrics_observe_ttft(tsr_metrics *m, const char *model_name, double seconds) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        observe_ttft_locked(m, model_name, seconds);
        pthread_mutex_unlock(&m->lock);
}

static void observe_itl_locked(tsr_metrics *m, const char *model_name, double seconds) {
        model *md = live_model(m, model_name);

        if (!md)
                return;
        observe(md->c[F_ITL], seconds);
        observe(md->c[F_TPOT], seconds);        /* NULL unless shown */
}

void tsr_metrics_observe_itl(tsr_metrics *m, const char *model_name, double seconds) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        observe_itl_locked(m, model_name, seconds);
        pthread_mutex_unlock(&m->lock);
}

static void observe_iteration_locked(tsr_metrics *m, const char *model_name, uint64_t num_tokens) {
        model *md = live_model(m, model_name);

        if (md)
                observe(md->c[F_ITERATION_TOKENS], (double)num_tokens);
}

void tsr_metrics_observe_iteration(tsr_metrics *m, const char *model_name, uint64_t num_tokens) {
        if (!m)
                return;
        pthread_mutex_lock(&m->lock);
        observe_iteration_locked(m, model_name, num_tokens);
        pthread_mutex_unlock(&m->lock);
}

/* ---------------------------------------------------------------- tessera:* */

static tsr_status tessera_child(tsr_metrics *m, tsr_metrics_id id, kind want, const char *label_value,
                                child **ret) {
        family *f;
        const char *values[1];

        if ((unsigned)id >= TSR_METRICS_ID_COUNT)
                return TSR_E_INVAL;
        f = &m->fam[F_TESSERA_FIRST + id];
        if (f->def->kind != want || !f->def->label != !label_value)
                return TSR_E_INVAL;
        if (!label_value) {
                *ret = f->children[0];
                return TSR_OK;
        }
        for (size_t i = 0; i < f->n; i++) {
                if (strcmp(f->children[i]->labels[0].value, label_value) == 0) {
                        *ret = f->children[i];
                        return TSR_OK;
                }
        }
        if (f->n >= MAX_CHILDREN)
                return TSR_E_LIMIT;
        values[0] = label_value;
        *ret = child_add(m, f, &f->def->label, values, 1, NULL, 0);
        return *ret ? TSR_OK : TSR_E_NOMEM;
}

static tsr_status counter_add_locked(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta) {
        child *c;

        if (isnan(delta) || delta < 0)
                return TSR_E_INVAL;
        TRY(tessera_child(m, id, KIND_COUNTER, label_value, &c));
        c->value += delta;
        return TSR_OK;
}

tsr_status tsr_metrics_counter_add(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = counter_add_locked(m, id, label_value, delta);
        pthread_mutex_unlock(&m->lock);
        return st;
}

static tsr_status counter_set_total_locked(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double total) {
        child *c;

        if (isnan(total) || total < 0)
                return TSR_E_INVAL;
        TRY(tessera_child(m, id, KIND_COUNTER, label_value, &c));
        if (total < c->value)
                return TSR_E_INVAL;
        c->value = total;
        return TSR_OK;
}

tsr_status tsr_metrics_counter_set_total(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double total) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = counter_set_total_locked(m, id, label_value, total);
        pthread_mutex_unlock(&m->lock);
        return st;
}

static tsr_status gauge_set_locked(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double value) {
        child *c;

        TRY(tessera_child(m, id, KIND_GAUGE, label_value, &c));
        c->value = value;
        return TSR_OK;
}

tsr_status tsr_metrics_gauge_set(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double value) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = gauge_set_locked(m, id, label_value, value);
        pthread_mutex_unlock(&m->lock);
        return st;
}

static tsr_status gauge_add_locked(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta) {
        child *c;

        TRY(tessera_child(m, id, KIND_GAUGE, label_value, &c));
        c->value += delta;
        return TSR_OK;
}

tsr_status tsr_metrics_gauge_add(tsr_metrics *m, tsr_metrics_id id, const char *label_value, double delta) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock(&m->lock);
        st = gauge_add_locked(m, id, label_value, delta);
        pthread_mutex_unlock(&m->lock);
        return st;
}

/* ---------------------------------------------------------------- exposition */

/* Label values: backslash, double quote and newline escaped (text format 0.0.4). */
static tsr_status append_label_value(tsr_buf *out, const char *v) {
        const char *run = v;

        for (; *v; v++) {
                const char *esc = *v == '\\' ? "\\\\" : *v == '"' ? "\\\"" : *v == '\n' ? "\\n" : NULL;
                if (!esc)
                        continue;
                TRY(tsr_buf_append(out, run, (size_t)(v - run)));
                TRY(tsr_buf_append_str(out, esc));
                run = v + 1;
        }
        return tsr_buf_append(out, run, (size_t)(v - run));
}

/* HELP text: backslash and newline escaped (quotes are legal there). */
static tsr_status append_help(tsr_buf *out, const char *name, const char *suffix, const char *help) {
        TRY(tsr_buf_appendf(out, "# HELP %s%s ", name, suffix));
        for (; *help; help++) {
                if (*help == '\\')
                        TRY(tsr_buf_append_str(out, "\\\\"));
                else if (*help == '\n')
                        TRY(tsr_buf_append_str(out, "\\n"));
                else
                        TRY(tsr_buf_append(out, help, 1));
        }
        return tsr_buf_append_str(out, "\n");
}

/* One sample line.  `le` (NULL = none) is merged into the sorted labels, where
 * prometheus_client puts it. */
static tsr_status append_sample(tsr_buf *out, const char *name, const char *suffix, const child *c,
                                const char *le, double value) {
        char num[32];
        bool le_done = !le;
        size_t n_out = 0;

        TRY(tsr_buf_append_str(out, name));
        TRY(tsr_buf_append_str(out, suffix));
        if (c->n_labels || le) {
                TRY(tsr_buf_append_str(out, "{"));
                for (size_t i = 0; i <= c->n_labels; i++) {
                        if (!le_done && (i == c->n_labels || strcmp("le", c->labels[i].name) < 0)) {
                                TRY(tsr_buf_appendf(out, "%sle=\"%s\"", n_out++ ? "," : "", le));
                                le_done = true;
                        }
                        if (i == c->n_labels)
                                break;
                        TRY(tsr_buf_appendf(out, "%s%s=\"", n_out++ ? "," : "", c->labels[i].name));
                        TRY(append_label_value(out, c->labels[i].value));
                        TRY(tsr_buf_append_str(out, "\""));
                }
                TRY(tsr_buf_append_str(out, "}"));
        }
        return tsr_buf_appendf(out, " %s\n", tsr_metrics_format_double(value, num));
}

static tsr_status render_family(const family *f, tsr_buf *out) {
        const family_def *d = f->def;
        const char *type = d->kind == KIND_COUNTER ? "counter" : d->kind == KIND_GAUGE ? "gauge" : "histogram";
        const char *total = d->kind == KIND_COUNTER ? "_total" : "";
        char le[32];

        TRY(append_help(out, d->name, total, d->help));
        TRY(tsr_buf_appendf(out, "# TYPE %s%s %s\n", d->name, total, type));
        for (size_t i = 0; i < f->n; i++) {
                const child *c = f->children[i];
                uint64_t acc = 0;

                if (d->kind != KIND_HISTOGRAM) {
                        TRY(append_sample(out, d->name, total, c, NULL, c->value));
                        continue;
                }
                for (size_t b = 0; b <= c->n_bounds; b++) {
                        acc += c->counts[b];
                        tsr_metrics_format_double(b < c->n_bounds ? c->bounds[b] : INFINITY, le);
                        TRY(append_sample(out, d->name, "_bucket", c, le, (double)acc));
                }
                TRY(append_sample(out, d->name, "_count", c, NULL, (double)c->count));
                TRY(append_sample(out, d->name, "_sum", c, NULL, c->sum));
        }
        /* prometheus_client gives counters and histograms a creation time and, in this
         * format, prints it as a gauge family of its own after the metric. */
        if (d->kind == KIND_GAUGE || f->n == 0)
                return TSR_OK;
        TRY(append_help(out, d->name, "_created", d->help));
        TRY(tsr_buf_appendf(out, "# TYPE %s_created gauge\n", d->name));
        for (size_t i = 0; i < f->n; i++)
                TRY(append_sample(out, d->name, "_created", f->children[i], NULL, f->children[i]->created));
        return TSR_OK;
}

static tsr_status render_locked(const tsr_metrics *m, tsr_buf *out) {
        for (size_t i = 0; i < F_COUNT; i++) {
                if (i < F_VLLM_COUNT && m->disable_log_stats)
                        continue;
                if (i == F_TPOT && !m->show_hidden)
                        continue;
                TRY(render_family(&m->fam[i], out));
        }
        return TSR_OK;
}

tsr_status tsr_metrics_render(const tsr_metrics *m, tsr_buf *out) {
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        pthread_mutex_lock((pthread_mutex_t *)&m->lock);
        st = render_locked(m, out);
        pthread_mutex_unlock((pthread_mutex_t *)&m->lock);
        return st;
}
