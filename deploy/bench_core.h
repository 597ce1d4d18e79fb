/* bench_core.h - the pure parts of `tessera bench serve` (no network, no clock).
 *
 * `tessera bench serve` is a drop-in for `vllm bench serve` (vllm/benchmarks/serve.py,
 * datasets/datasets.py RandomDataset, lib/endpoint_request_func.py, read from the
 * vllm 0.33.0 wheel).  Everything here is defined the way those files define it, so
 * that the two clients report the same quantities for the same traffic:
 *
 *   - SSE splitting as StreamedResponseHandler does it (messages end at "\n\n"; a tail
 *     that starts with "data: " is a message once it is "[DONE]" or parses as JSON);
 *   - one request's bookkeeping (TTFT, ITL samples, latency, usage) per message;
 *   - calculate_metrics(): TPOT per request excluding the first token, pooled ITL,
 *     throughputs, goodput, peak output tok/s and peak concurrency over 1-s buckets,
 *     mean/median/std/percentiles as numpy computes them (np.percentile, "linear");
 *   - the printed result block and the --save-result JSON (same labels, widths,
 *     number formats and keys);
 *   - RandomDataset's length logic and prompt construction against any tokenizer.
 *
 * The random streams are numpy's: default_rng(seed) for the dataset and the legacy
 * np.random (MT19937) for arrival gaps, so a --seed gives vLLM's prompts and schedule.
 *
 * Threads: none of this is shared; `tessera bench serve` is one thread. */
#ifndef TSR_BENCH_CORE_H
#define TSR_BENCH_CORE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/buf.h"
#include "common/tsr_status.h"

/* ------------------------------------------------------------------ random numbers */

/* numpy.random.default_rng(seed): SeedSequence -> PCG64 (XSL-RR), with numpy's 32-bit
 * buffering; tsr_bench_rng_range draws exactly what Generator.integers draws (Lemire's
 * method as numpy implements it), so the random dataset is vLLM's prompt for prompt. */
typedef struct tsr_bench_rng {
        unsigned __int128 state, inc;
        bool has_uint32;
        uint32_t uinteger;
} tsr_bench_rng;

/* seed >= 0 (numpy's SeedSequence takes the integer's 32-bit words, low first). */
void tsr_bench_rng_seed(tsr_bench_rng *r, uint64_t seed);
uint64_t tsr_bench_rng_u64(tsr_bench_rng *r);
/* Uniform integer in [lo, hi] (inclusive): numpy's integers(lo, hi + 1), one value. */
int64_t tsr_bench_rng_range(tsr_bench_rng *r, int64_t lo, int64_t hi);

/* numpy's legacy global generator after np.random.seed(seed): MT19937 seeded with
 * init_genrand(seed) (seeds below 2^32, as np.random.seed takes them), and the legacy
 * gamma (Marsaglia-Tsang, polar normals with the cached second value; shape < 1 by
 * Johnk/Best's rejection; shape 1 the exponential) that np.random.gamma draws. */
typedef struct tsr_bench_mt {
        uint32_t mt[624];
        int pos;
        bool has_gauss;
        double gauss;
} tsr_bench_mt;

void tsr_bench_mt_seed(tsr_bench_mt *m, uint32_t seed);
uint32_t tsr_bench_mt_u32(tsr_bench_mt *m);
double tsr_bench_mt_double(tsr_bench_mt *m);
double tsr_bench_mt_gamma(tsr_bench_mt *m, double shape, double scale);

/* Arrival offsets (seconds from the start) of n requests, as serve.py's get_request:
 * rate = +inf -> all 0; burstiness = +inf -> 1/rate each; else np.random.gamma(burstiness,
 * 1/(rate*burstiness)) gaps; cumulative; then rescaled so the last is n/rate. */
void tsr_bench_arrival_delays(tsr_bench_mt *m, size_t n, double rate, double burstiness, double *out);

/* ------------------------------------------------------------------ SSE */

typedef void (*tsr_bench_sse_cb)(void *ud, const char *msg, size_t len);

/* Feed `n` received bytes; calls cb for every complete message (stripped of surrounding
 * whitespace, never empty), in order.  `buf` holds the unfinished tail between calls. */
tsr_status tsr_bench_sse_feed(tsr_buf *buf, const char *data, size_t n, tsr_bench_sse_cb cb, void *ud);

/* ------------------------------------------------------------------ one request */

typedef struct tsr_bench_output {
        bool success;
        bool chat;                     /* openai-chat: delta.content, role chunk not a token */
        bool first_chunk_received;
        double start_time;             /* s, monotonic clock */
        double most_recent;            /* time of the last token chunk */
        double ttft, latency;          /* s */
        double client_queue_time;      /* s waiting for a --max-concurrency slot */
        double *itl;                   /* s, one per token chunk after the first */
        size_t n_itl, itl_cap;
        int64_t output_tokens;         /* usage.completion_tokens; 0 when absent */
        int64_t prompt_len;            /* the dataset's count, then usage.prompt_tokens */
        tsr_buf text;                  /* generated text */
        char *error;                   /* malloc'd; NULL while there is none */
} tsr_bench_output;

void tsr_bench_output_init(tsr_bench_output *o, bool chat, int64_t prompt_len, double start_time);
void tsr_bench_output_done(tsr_bench_output *o);
/* One SSE message received at time `now`: ":" comments and [DONE] are skipped; a chunk
 * with non-empty choices is a token (completions: any; chat: one that carries content,
 * reasoning or tool calls, or an empty content without a role); a chunk without choices
 * that has usage sets output_tokens and prompt_len.  TSR_E_INVAL for a payload that is not
 * JSON (the request then fails, as vLLM's json.loads raising fails it). */
tsr_status tsr_bench_output_on_message(tsr_bench_output *o, const char *msg, size_t len, double now);
/* End of a 200 response: success iff a token chunk came; latency = last token - start. */
void tsr_bench_output_finish(tsr_bench_output *o);
void tsr_bench_output_fail(tsr_bench_output *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ------------------------------------------------------------------ statistics */

/* numpy's np.percentile(v, p) with the default "linear" method; v need not be sorted.
 * An empty v counts as [0] (serve.py passes `values or 0`). */
double tsr_bench_percentile(const double *v, size_t n, double p);
double tsr_bench_mean(const double *v, size_t n);
double tsr_bench_median(const double *v, size_t n);
/* Population standard deviation (np.std, ddof=0). */
double tsr_bench_std(const double *v, size_t n);

enum {
        TSR_BENCH_M_TTFT,
        TSR_BENCH_M_TPOT,
        TSR_BENCH_M_ITL,
        TSR_BENCH_M_E2EL,
        TSR_BENCH_M_QUEUE,          /* client_queue_time (only with --max-concurrency) */
        TSR_BENCH_M_E2EL_QUEUE,     /* e2el_including_client_queue (and a finite rate) */
        TSR_BENCH_M_COUNT
};

typedef struct tsr_bench_goodput {
        bool enabled;
        bool has[3];            /* ttft, tpot, e2el */
        double slo_ms[3];
} tsr_bench_goodput;

typedef struct tsr_bench_metrics {
        int64_t completed, failed;
        int64_t total_input, total_output;
        double request_throughput, request_goodput, output_throughput, total_token_throughput;
        double max_output_tokens_per_s;
        int64_t max_concurrent_requests;
        /* The samples behind each metric, s (what serve.py hands to numpy). */
        double *samples[TSR_BENCH_M_COUNT];
        size_t n_samples[TSR_BENCH_M_COUNT];
        bool present[TSR_BENCH_M_COUNT];           /* QUEUE / E2EL_QUEUE exist only sometimes */
        int64_t *output_lens;                  /* per request; 0 for a failed one */
} tsr_bench_metrics;

/* Counts the tokens of generated text for a request whose stream carried no usage
 * (vLLM re-tokenizes with add_special_tokens=False).  Returns -1 on failure. */
typedef int64_t (*tsr_bench_count_tokens_fn)(void *ud, const char *text, size_t len);

/* calculate_metrics() over n outputs of a run that took `duration` s.  `with_queue`:
 * --max-concurrency was given; `finite_rate`: --request-rate was not inf. */
tsr_status tsr_bench_metrics_compute(const tsr_bench_output *outs, size_t n, double duration, const tsr_bench_goodput *gp,
                                 bool with_queue, bool finite_rate, tsr_bench_count_tokens_fn count, void *count_ud,
                                 tsr_bench_metrics *m);
void tsr_bench_metrics_done(tsr_bench_metrics *m);

/* ------------------------------------------------------------------ report */

typedef struct tsr_bench_report_cfg {
        int64_t max_concurrency;        /* -1: not given */
        double request_rate;            /* +inf when not given */
        const char *const *percentile_metrics;  /* names as in --percentile-metrics */
        size_t n_percentile_metrics;
        const double *percentiles;      /* --metric-percentiles */
        size_t n_percentiles;
        bool goodput;
} tsr_bench_report_cfg;

/* Print vLLM's result block (from the "= Serving Benchmark Result =" line to the
 * closing "=" line) to `out`, and add to `result` the keys serve.py's benchmark()
 * returns, in its order: duration ... rtfx, then mean_/median_/std_/p<P>_<metric>_ms
 * for the selected metrics.  Per-request arrays come from outs. */
tsr_status tsr_bench_report(FILE *out, const tsr_bench_report_cfg *cfg, const tsr_bench_metrics *m, const tsr_bench_output *outs,
                        size_t n, double duration, json_t *result);

/* Python's str(float): "inf", "10.0", "0.1", "1e-05". */
void tsr_bench_pyfloat(double v, char *out, size_t n);
/* vLLM's default result file name:
 * {label}-{rate}qps[-concurrency{C}]-{basename(model_id)}-{YYYYmmdd-HHMMSS}.json */
void tsr_bench_result_filename(const char *label, double rate, int64_t max_concurrency, const char *model_id,
                           const char *datetime, char *out, size_t n);
/* "KEY:VALUE KEY:VALUE" pairs of --goodput (ttft/tpot/e2el, ms, >= 0). */
tsr_status tsr_bench_goodput_parse(char *const *pairs, size_t n, tsr_bench_goodput *gp, char *err, size_t errlen);

/* ------------------------------------------------------------------ random dataset */

/* The tokenizer the dataset is built with: local (common/tokenizer) or the server's. */
typedef struct tsr_bench_tok {
        void *ud;
        /* encode(text, add_special_tokens=False) -> malloc'd ids */
        tsr_status (*encode)(void *ud, const char *text, size_t len, uint32_t **ids, size_t *n_ids);
        /* decode(ids) with special tokens kept (HF's default) -> malloc'd NUL-terminated text */
        tsr_status (*decode)(void *ud, const uint32_t *ids, size_t n, char **text, size_t *len);
        bool (*is_special)(void *ud, uint32_t id);   /* all_special_ids; NULL: none known */
        size_t vocab_size;
        int num_special_tokens_to_add;                /* BOS/EOS that add_special_tokens adds */
} tsr_bench_tok;

typedef struct tsr_bench_sample {
        char *prompt;                   /* malloc'd */
        int64_t prompt_len;             /* client-side token count; -1: counted after the run */
        int64_t expected_output_len;
        /* follows: not sent before sample prev (< this one's index) has finished: a chat
         * session's previous turn, whose answer a user waits for */
        bool follows;
        size_t prev;
        /* A multi_turn follower's parts (else NULL), malloc'd: prompt is, byte for byte,
         * tsr_bench_turn_prompt(samples[prev].prompt, prev_reply, user), where prev_reply
         * is the dataset's stand-in for turn prev's answer and user this turn's own text.
         * A client that resends the server's real answer puts it in prev_reply's place. */
        char *prev_reply, *user;
} tsr_bench_sample;

typedef struct tsr_bench_random_cfg {
        int64_t input_len, output_len, prefix_len;
        double input_range_ratio, output_range_ratio;
} tsr_bench_random_cfg;

/* get_sampling_params()'s intervals (inclusive) after its checks, and sample()'s
 * prefix + minimum input >= 1 check.  TSR_E_INVAL with vLLM's message otherwise. */
tsr_status tsr_bench_random_bounds(const tsr_bench_random_cfg *c, int num_special, int64_t *in_lo, int64_t *in_hi,
                               int64_t *out_lo, int64_t *out_hi, char *err, size_t errlen);

/* gen_prompt_decode_to_target_len(): decode, re-encode, pad with random ids or truncate,
 * up to 10 retries.  Takes ownership of *seq (malloc'd) and replaces it with the final
 * encoding; *prompt is the final decoded text; *mismatch = final length - target when
 * the retries ran out (else 0). */
tsr_status tsr_bench_decode_to_target_len(const tsr_bench_tok *t, tsr_bench_rng *r, uint32_t **seq, size_t *n_seq,
                                      size_t target, char **prompt, int64_t *mismatch);

/* RandomDataset.sample(): n prompts of random allowed tokens.  *ret is a malloc'd
 * array of n samples (free with tsr_bench_samples_free).  *mismatch_total as vLLM sums it. */
tsr_status tsr_bench_random_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_random_cfg *c, size_t n,
                                tsr_bench_sample **ret, int64_t *mismatch_total, char *err, size_t errlen);
void tsr_bench_samples_free(tsr_bench_sample *s, size_t n);

/* ------------------------------------------------------------------ shared-prefix datasets
 *
 * Workloads for prefix-aware routing (docs/benchmarks.md, "Router at scale").  Both draw
 * random allowed (non-special) token ids from r, decode them to text and re-encode
 * (tsr_bench_decode_to_target_len), so prompts that share leading ids share leading text,
 * and so leading tokens at the server. */

/* vLLM's prefix_repetition dataset (--prefix-repetition-*): num_prefixes random
 * prefixes of prefix_len ids, each followed by a fresh random suffix of suffix_len ids
 * (n / num_prefixes prompts per prefix, the first n % num_prefixes prefixes get one
 * more), shuffled: a few long system prompts across many users (agentic / RAG).
 * Every output is output_len tokens.  TSR_E_INVAL (err) for a length < 1. */
typedef struct tsr_bench_prefix_rep_cfg {
        int64_t prefix_len, suffix_len, num_prefixes, output_len;
} tsr_bench_prefix_rep_cfg;
tsr_status tsr_bench_prefix_repetition_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_prefix_rep_cfg *c, size_t n,
                                           tsr_bench_sample **ret, char *err, size_t errlen);

/* multi_turn: ceil(n / turns) chat sessions growing a history.  A session's turn k
 * (0-based) is the text  system || document || user_0 || reply_0 || ... || user_k, where
 * system is system_len tokens shared by every session (--random-prefix-len), document
 * session_prefix_len tokens of the session's own (--multi-turn-session-prefix-len, 0 for
 * none: the per-conversation prefix of vLLM's multi-turn benchmark), user_i user_len fresh
 * tokens and reply_i output_len tokens standing in for the assistant's answer.  Each part
 * is random allowed ids decoded and re-encoded to its length on its own
 * (tsr_bench_decode_to_target_len); the parts are joined as text, so prompt_len, the
 * count of the whole prompt, can differ from the sum by a token where two parts meet.
 * The dataset is built before the run, so reply_i is not the real answer: a follower
 * carries its own user text and the stand-in separately (tsr_bench_sample), for a client
 * that resends what the server generated, as vLLM's multi-turn benchmark does, or that
 * sends the turns as chat messages.  Ordered
 * turn by turn (every session's turn 0, then turn 1, ...), each round in its own random
 * order; a turn follows its session's previous turn, so it is sent at its arrival time
 * or when that turn has finished, whichever is later (a closed loop per session, as in
 * vLLM's multi-turn benchmark).  The last turns are cut so that there are exactly n.
 * Every output is output_len tokens. */
typedef struct tsr_bench_multi_turn_cfg {
        int64_t system_len, turns, user_len, output_len, session_prefix_len;
} tsr_bench_multi_turn_cfg;
tsr_status tsr_bench_multi_turn_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_multi_turn_cfg *c, size_t n,
                                    tsr_bench_sample **ret, char *err, size_t errlen);

/* A multi_turn follower's prompt: the previous turn's prompt, then its answer, then the
 * new user text, joined as text.  Returns a malloc'd string, NULL only on OOM. */
char *tsr_bench_turn_prompt(const char *prev_prompt, const char *answer, const char *user);

#endif
