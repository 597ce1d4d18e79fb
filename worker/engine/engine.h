/* engine.h - the worker's engine thread and the messages it trades with the io thread.
 *
 * Threads (docs/threading.md): the io thread (link.c) owns the sockets and protobuf and
 * translates both ways: the engine sees only the plain C structs below;
 * the engine thread owns the model, the KV cache and the scheduler (with
 * --async-scheduling a "runner" thread of the engine's runs each step's forward and
 * sampling while the engine thread schedules the next one).  They talk only
 * through two bounded queues: `inbox` (io -> engine, tsr_engine_in items) and `outbox`
 * (engine -> io, tsr_engine_out items).  Whoever pops an item owns it and frees it with
 * tsr_engine_in_free / tsr_engine_out_free.
 *
 * The engine follows vLLM's V1 scheduler (its Scheduler class):
 * one token budget per step (max_num_batched_tokens), running requests first, chunked
 * prefill, FCFS or priority waiting queue, preemption by recompute when KV blocks run
 * out, prefix caching on full blocks.  Each step emits at most one Output per router,
 * carrying every request of that router that moved.
 *
 * Beyond vLLM: a waiting request whose next uncached full prompt blocks are being
 * computed by a running request right now (the `n` samples of one prompt, which the
 * router submits as n requests; any requests sharing a long system prompt) waits for
 * them instead of computing them twice, then reads them from the prefix cache.
 *
 * With no model (tsr_engine_params.model == NULL) every Submit is refused with a retryable
 * UNAVAILABLE Error: the skeleton mode used when a model family has no runner. */
#ifndef TSR_WORKER_ENGINE_H
#define TSR_WORKER_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/block_hash.h"
#include "common/queue.h"
#include "grammar/pool.h"
#include "kernels/kernels.h"
#include "worker/engine/kv_cache.h"
#include "worker/engine/kv_pool.h"
#include "worker/engine/sampler.h"

#define TSR_ENGINE_ROUTER_ID_MAX 255
#define TSR_ENGINE_REQUEST_ID_MAX 256   /* bytes, without the NUL; link.c checks it against the wire's */

/* Why a request ended.  FINISH_NONE: it runs on. */
typedef enum tsr_engine_finish {
        TSR_ENGINE_FINISH_NONE = 0,
        TSR_ENGINE_FINISH_STOP,    /* EOS or a stop id */
        TSR_ENGINE_FINISH_LENGTH,  /* max_tokens or max_model_len */
        TSR_ENGINE_FINISH_ABORT,   /* ended by a shutdown after it produced tokens */
        TSR_ENGINE_FINISH_ERROR,   /* its forward or sampling failed */
} tsr_engine_finish;

/* Why the engine refused a request (TSR_ENGINE_OUT_ERROR). */
typedef enum tsr_engine_error {
        TSR_ENGINE_ERROR_INVALID,      /* out of range for this model: token ids, sampling parameters */
        TSR_ENGINE_ERROR_TOO_LONG,     /* the prompt does not fit max_model_len */
        TSR_ENGINE_ERROR_UNAVAILABLE,  /* no model, out of memory, shutting down: try elsewhere */
} tsr_engine_error;

/* One scheduled chunk of one sequence in a step. */
typedef struct tsr_engine_seq {
        /* (n_tables, n_table): the sequence's blocks, one table of n_table entries after
         * the other (tsr_engine_params.n_kv_tables; one table: (n_table,)).  A chunked
         * table's entries behind the current chunk are TSR_KV_NULL_BLOCK (kv_cache.h). */
        const uint32_t *block_table;
        size_t n_table;
        const uint32_t *tokens;        /* (n,) at positions past_len .. past_len+n-1 */
        size_t n;
        size_t past_len;
        bool want_logits;              /* the chunk ends the known tokens: sample after it */
        bool want_all_logits;          /* prompt_logprobs: a row for every token of the chunk */
        uint32_t state_slot;           /* its recurrent-state slot (params.state_slots > 0), else 0 */
        /* Prefix caching of a model with recurrent state (state_cache.h): before the chunk,
         * copy slot restore_from's state into state_slot (the chunk continues a cached
         * prefix: past_len is that prefix's length); and for each of saves[0..n_saves)
         * (positions in order, past_len < pos <= past_len + n) copy the state after the
         * first pos tokens into its slot.  A slot written by one sequence of a step (its
         * state_slot, a save) is no other's and is never a restore source of that step,
         * so the copies commute with the other sequences' work. */
        bool restore_state;
        uint32_t restore_from;
        const tsr_state_save *saves;
        size_t n_saves;
        /* The request's prompt length: a model whose scan has a chunked form
         * (tsr_engine_params.prefill_align) runs it only on whole chunks before this
         * position.  Generated tokens ran through the recurrence one step at a time, so a
         * recompute after preemption runs them so again and gives the same bits. */
        uint32_t prompt_len;
        /* NULL, or (want_logits without want_all_logits) the chunk's token may come from the
         * model instead of its row (a request with nothing that needs the row itself:
         * tsr_sampling_device_ok; to a model with answers_rules also one whose `rules`
         * go with it): with `draw` NULL the row's argmax as it stands (a greedy
         * request), else a draw with *draw (the request's temperature, top_k, top_p,
         * min_p and its Philox uniform for this position): on a device kernels.h's
         * tsr_backend_sample, on a multi-node replica's last node the engine's own
         * tsr_sample (sampler.h tsr_sample_uniform_given, so the tokens are the ones the
         * engine would draw).  The model may write it here (an index >= the vocabulary,
         * TSR_ARGMAX_NONE: the row has no maximum, a NaN or +inf in it) and leave the
         * row's slot in `logits` unwritten.  The engine sets it to TSR_ENGINE_TOKEN_UNSET
         * first and samples the row itself when it is still that.  In a queued step
         * (micro-batches) a request under a grammar is not offered it: its mask is
         * planned after the step's wait. */
        uint32_t *token;
        const tsr_draw *draw;
        /* NULL, or (with `token`, to a model with answers_logprobs: a request that asked
         * for logprobs and nothing else that needs the row, tsr_sampling_token_and_
         * logprobs_ok) where a model that answers the token also writes its logprobs:
         * tsr_logprobs_gather(the row as computed, the token, lp_top).  A model that
         * answers *token must then fill *lp. */
        tsr_token_logprobs *lp;
        uint32_t lp_top;
        /* NULL, or (with `token`, to a model with answers_rules) the request's sampling,
         * whose allowed ids, logit bias, penalties and, with rules_mask_eos (n_output <
         * min_tokens), min_tokens' EOS / stop mask shape the token too: a model that
         * answers *token applies them as tsr_sample does (tsr_sample_uniform_given), the
         * penalties with `history`, the request's tokens so far (n_history: the prompt's
         * prompt_len, then its outputs; NULL without penalties).  Borrowed for the call. */
        const tsr_sampling *rules;
        bool rules_mask_eos;
        const uint32_t *history;
        uint32_t n_history;
        /* NULL, or (with `token`, to a model with answers_masks) the request's grammar mask
         * at this position (tsr_grammar_mask_words(vocab) words; bit i % 32 of word i / 32
         * set: token i allowed): a model that answers *token first masks the row with it
         * as the engine does (tsr_grammar_apply_mask: the others -inf), then samples and
         * gathers the logprobs from the masked row.  Borrowed for the call. */
        const uint32_t *grammar_mask;
        uint32_t grammar_mask_words;
        /* NULL, or (want_all_logits, to a model with answers_logprobs: a chunk of a request
         * that asked for prompt logprobs) where the model writes the prompt logprobs of
         * each row t with past_len + t + 1 < prompt_len: tsr_logprobs_gather(row t, the
         * prompt's next token, prompt_lp_top) into prompt_lp[t], the next token being
         * tokens[t + 1], or next_token for the chunk's last row.  Those rows of `logits`
         * it may leave unwritten; the others (the prompt's last position, the one sampled
         * from) it writes as usual. */
        tsr_token_logprobs *prompt_lp;
        uint32_t prompt_lp_top, next_token;
        /* The request (its admission number): a replica over several nodes sends each
         * step's block tables as changes against the same request's last ones (nodes.h). */
        uint64_t seq_id;
} tsr_engine_seq;

#define TSR_ENGINE_TOKEN_UNSET (UINT32_MAX - 1)

/* A decode: one new token after some context, sampled, no prompt logprobs.  Anything
 * else computes prompt tokens (the step timing model and the simulated worker's cost
 * count it as prefill). */
static inline bool tsr_engine_seq_is_decode(const tsr_engine_seq *q) {
        return q->n == 1 && q->past_len > 0 && q->want_logits && !q->want_all_logits;
}

/* The logits rows a chunk asks of the forward: one per token with want_all_logits, else
 * one with want_logits, else none. */
static inline size_t tsr_engine_seq_rows(const tsr_engine_seq *q) {
        return q->want_all_logits ? q->n : q->want_logits ? 1 : 0;
}

/* A prompt-logprobs chunk's leading rows that are prompt rows (past_len + t + 1 <
 * prompt_len), which a model that answers logprobs answers as the prompt's next token's
 * logprobs (prompt_lp); its other rows are sampled from or come back whole. */
static inline size_t tsr_engine_seq_prompt_lp_rows(const tsr_engine_seq *q) {
        if (!q->prompt_lp || !q->want_all_logits || (size_t)q->prompt_len <= q->past_len + 1)
                return 0;
        size_t k = q->prompt_len - q->past_len - 1;
        return k < q->n ? k : q->n;
}

/* The request's tokens so far (q->history: the prompt, then its outputs) as the sampler
 * reads them. */
static inline tsr_sample_history tsr_engine_seq_history(const tsr_engine_seq *q) {
        size_t np = q->prompt_len < q->n_history ? q->prompt_len : q->n_history;
        return (tsr_sample_history){.prompt = q->history, .n_prompt = np, .output = q->history + np,
                                    .n_output = q->n_history - np};
}

/* A step's tokens and logits rows over its chunks. */
static inline void tsr_engine_step_size(const tsr_engine_seq *seqs, size_t n_seqs, size_t *tokens, size_t *rows) {
        *tokens = *rows = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                *tokens += seqs[i].n;
                *rows += tsr_engine_seq_rows(&seqs[i]);
        }
}

/* What the engine needs from a model: its vocabulary and one forward over a paged KV
 * cache for a whole step.  The KV memory belongs to the model adapter, indexed by the
 * engine's block ids. */
typedef struct tsr_engine_model {
        size_t vocab;
        void *ud;
        /* Run every chunk of the step (store their KV) and write logits rows (vocab,)
         * to `logits`, chunk after chunk in order: n rows (one per token) for a chunk
         * with want_all_logits, else one row (its last token) for a chunk with
         * want_logits, else none.  With both flags the last of the n rows is the one
         * sampled from.  A chunk's logits must not depend on the others (batch
         * invariance).  Engine thread, or its runner thread with --async-scheduling
         * (one call at a time either way). */
        tsr_status (*forward)(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits);
        /* The model answers tsr_engine_seq.lp with the token (a multi-node replica's last
         * node does): rows of requests that asked for logprobs are offered as tokens too.
         * false: they never are. */
        bool answers_logprobs;
        /* The model answers tsr_engine_seq.rules with the token (a multi-node replica's
         * last node does): rows of requests with allowed ids, a logit bias, min_tokens'
         * mask or penalties (the last while the request's tokens are fewer than the
         * vocabulary: the history then costs less than the row) are offered as tokens
         * too.  false: they never are. */
        bool answers_rules;
        /* The model answers tsr_engine_seq.grammar_mask with the token (a multi-node
         * replica's last node does): a step's grammar masks are then filled before its
         * forward instead of beside it, and rows under a grammar are offered as tokens
         * (not in a queued step: its masks are planned after its wait).  false: never. */
        bool answers_masks;
        /* Optional: pipeline micro-batches (vLLM's batch queue, with pipeline stages).  Up
         * to max_in_flight (> 1) steps may be in the model at once: submit starts one
         * (as forward would run it: `seqs` and `logits` stay the engine's, untouched,
         * until its wait) and returns once the first stage is done with it; wait ends the
         * oldest step submitted and returns its status, as forward's.  A submit that
         * fails leaves nothing in flight (no wait for it).  The engine uses them instead
         * of forward when set and --async-scheduling is off.  Engine thread. */
        uint32_t max_in_flight;
        tsr_status (*submit)(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits);
        tsr_status (*wait)(void *ud);
        /* Optional (NULL: the KV memory lives as long as the model).  A model whose KV
         * memory can be lost while it runs (a pipeline stage on another node that
         * restarted: worker/parallel/nodes.h) counts its incarnations, and may install
         * a new one inside this call; the engine reads the count before it schedules a
         * step and, when it moved, forgets its prefix cache first.  Engine thread, and
         * never while a forward runs: with --async-scheduling the engine calls it only
         * with no step in flight, so every step runs on the incarnation it was
         * scheduled for. */
        uint64_t (*kv_generation)(void *ud);
        /* Optional, with kv_generation (NULL: always true): whether a new incarnation
         * waits for the next kv_generation call.  With --async-scheduling, when it says
         * so, the engine lets the step in flight end before it schedules the next one
         * (else it schedules ahead as usual and leaves kv_generation for a quiet
         * moment).  Any thread. */
        bool (*kv_renewal_pending)(void *ud);
        /* Optional (NULL: always): whether a step can run now.  The io thread reads it for
         * the Status it publishes (UNHEALTHY while not, so routers place elsewhere).  Any
         * thread. */
        bool (*available)(void *ud);
        /* Optional: called on the engine thread about every TSR_ENGINE_IDLE_POLL_MS while
         * it waits for work (a multi-node replica drives its group's sockets here, so a
         * node that died while nothing ran is noticed then, not at the next request). */
        void (*idle)(void *ud);
} tsr_engine_model;

#define TSR_ENGINE_IDLE_POLL_MS 1000u

typedef struct tsr_engine_params {
        const tsr_engine_model *model;     /* NULL: skeleton mode (refuse Submit) */
        uint64_t kv_blocks_total;
        uint32_t block_size;
        uint32_t max_model_len;
        uint32_t max_num_seqs;
        uint32_t max_num_batched_tokens;
        bool enable_prefix_caching;
        /* Recurrent-state slots (a Mamba model's conv + SSM state, kv_pool.h
         * TSR_KV_MAMBA_STATE): each running request holds one, taken when it is admitted
         * and given back when it finishes, is aborted or is preempted (it then recomputes
         * from its tokens); a request is not admitted without a free one.  0: the model
         * keeps no per-request state.  With enable_prefix_caching the slots no running
         * request holds also keep the states at every state_block-th position a step
         * computes (vLLM 0.11-0.12's Mamba prefix caching, states at each mamba block:
         * state_cache.h), and a hit ends where a state was kept; the model must then
         * honour tsr_engine_seq's restore_state and saves. */
        uint32_t state_slots;
        uint32_t state_block;          /* a multiple of block_size (0: block_size) */
        /* A model whose scan runs whole chunks of this many tokens in its chunked form
         * (NemotronH's Mamba chunk_size; 0: none): a prefill piece that does not finish
         * the request's known tokens ends at a multiple of it, so a prompt cut into steps
         * runs the scans of the whole prompt in one step, with the same bits.  A piece
         * that would end inside the chunk it starts is put off to a later step (vLLM's
         * block-aligned split for Mamba); where max_num_batched_tokens,
         * long_prefill_token_threshold or (prompt logprobs) max_prompt_lp_rows is
         * smaller than the chunk, pieces are not cut. */
        uint32_t prefill_align;
        /* Block tables per request (kv_cache.h tsr_kv_cache_set_tables): kv_chunk[t] 0 for
         * a full-attention table, else a chunked-local one's attention chunk (a hybrid
         * model's groups, kv_pool.h tsr_kv_tables).  0 tables: one full-attention table.
         * Prefix caching then follows kv_cache.h's rule for several tables. */
        uint32_t n_kv_tables;
        uint32_t kv_chunk[TSR_KV_TABLES_MAX];
        tsr_block_hash_algo hash_algo;
        bool priority_scheduling;      /* --scheduling-policy priority */
        /* The model's EOS ids (borrowed; outlive the engine).  [0] is the tokenizer's EOS,
         * which finishes a request as EOS; the others finish it as stop ids would (the
         * id reported), as vLLM treats generation_config's extra EOS ids.  min_tokens
         * masks all of them. */
        const uint32_t *eos_ids;
        size_t n_eos_ids;
        uint64_t seed;                 /* --seed: key for requests without their own seed */
        size_t max_prompt_lp_rows;     /* prompt-logprobs positions per step; 0: 256 MiB of logits */
        uint64_t shutdown_timeout_ms;  /* --shutdown-timeout: how long in-flight requests may run on after
                                        * TSR_ENGINE_IN_SHUTDOWN; 0 = abort them at once (vLLM's default) */
        uint32_t long_prefill_token_threshold; /* --long-prefill-token-threshold: a request's chunk in one step
                                        * is at most this many tokens when it has more to compute
                                        * (vLLM V1's cap); 0 = no cap */
        /* Structured outputs: the compile thread over the model's vocabulary (grammar/pool.h;
         * borrowed, outlives the engine).  NULL: a Submit with a structured output is
         * refused (INVALID). */
        tsr_grammar_pool *grammar;
        bool async_scheduling;         /* --async-scheduling: forward and sampling on a "runner" thread
                                        * while the engine thread schedules the next step (engine.c) */
        /* Liveness (systemd's WatchdogSec, worker/notify.c): called on the engine thread once
         * per loop turn, and at least every alive_interval_ms while idle, so a step that
         * hangs stops the calls.  NULL: never called and the idle wait has no timeout. */
        void (*alive)(void *ud);
        void *alive_ud;
        uint32_t alive_interval_ms;
} tsr_engine_params;

/* What the engine publishes about itself; the io thread turns it into Status. */
typedef struct tsr_engine_stats {
        bool ready;                     /* a model runner exists and accepts Submit */
        uint64_t kv_blocks_total;
        uint64_t kv_blocks_free;
        uint64_t kv_blocks_active;
        uint32_t state_slots_total;     /* params.state_slots */
        uint32_t state_slots_free;      /* not held by a running request: free, or keeping a cached state */
        uint32_t num_running;
        uint32_t num_waiting;
        uint32_t max_num_seqs;
        uint64_t waiting_prompt_tokens;
        uint64_t num_preemptions_total;
        uint64_t prefix_cache_queries_total;
        uint64_t prefix_cache_hits_total;
        uint64_t prompt_tokens_total;
        uint64_t generation_tokens_total;
        /* Submits taken off the inbox (admitted or refused) and their prompt tokens:
         * the io thread subtracts these from what it pushed to count the ones still in
         * the inbox as waiting. */
        uint64_t submits_taken_total;
        uint64_t submit_prompt_tokens_taken_total;
        /* The step timing model (engine.c step_timing_update): prefill tokens per
         * second and a decode step's milliseconds at the current load; 0 = not
         * measured yet. */
        float prefill_tokens_per_s;
        float decode_step_ms;
} tsr_engine_stats;

/* A request to run, as the io thread decoded and validated it from the wire (the
 * wire's "0 = unset" conventions already resolved).  Arrays are owned by the message. */
typedef struct tsr_engine_submit {
        char request_id[TSR_ENGINE_REQUEST_ID_MAX + 1];
        uint32_t *prompt;              /* (n_prompt,) token ids */
        size_t n_prompt;
        uint32_t max_tokens;
        uint32_t min_tokens;
        bool ignore_eos;
        uint32_t *stop_ids;            /* (n_stop_ids,) */
        size_t n_stop_ids;
        /* The scalar knobs (temperature .. frequency_penalty); the engine fills the
         * array pointers and min_tokens/logprobs. */
        tsr_sampling sampling;
        tsr_logit_bias *bias;          /* (n_bias,) */
        size_t n_bias;
        bool has_seed;
        uint64_t seed;
        int32_t logprobs;              /* -1 none, 0 sampled only, k: sampled + top k */
        int32_t prompt_logprobs;       /* -1 none, else as logprobs for prompt positions */
        int32_t priority;              /* lower first under --scheduling-policy priority */
        /* Structured output (kind TSR_GRAMMAR_NONE: none): the spec text (so_len bytes,
         * NUL-terminated, owned) is compiled off the engine thread before the request runs;
         * every sampled token then obeys it (docs/architecture.md). */
        tsr_grammar_kind so_kind;
        char *so_text;
        size_t so_len;
        bool so_compact;               /* JSON kinds: no free whitespace */
        int64_t so_reasoning_end;      /* the constraint starts after this token (-1: at once) */
} tsr_engine_submit;

/* Requests of one router to drop (unknown ids are ignored). */
typedef struct tsr_engine_abort {
        bool all_from_router;          /* every request of the sending router */
        char (*request_ids)[TSR_ENGINE_REQUEST_ID_MAX + 1];   /* (n_request_ids,) */
        size_t n_request_ids;
        char reason[64];               /* for the log */
} tsr_engine_abort;

typedef enum tsr_engine_in_kind {
        TSR_ENGINE_IN_SUBMIT,      /* .submit */
        TSR_ENGINE_IN_ABORT,       /* .abort */
        /* SIGTERM.  Refuse new Submits (retryable), let the admitted requests
         * run for params.shutdown_timeout_ms, then end the rest: an Output with
         * finish ABORT for those that already produced tokens, a retryable
         * UNAVAILABLE Error for those that did not (the router resubmits them
         * elsewhere); then answer TSR_ENGINE_OUT_STOPPED.  Later ones are ignored. */
        TSR_ENGINE_IN_SHUTDOWN,
        /* A router resyncs: the next Status carries a full snapshot of the prefix cache. */
        TSR_ENGINE_IN_RESYNC,
} tsr_engine_in_kind;

typedef struct tsr_engine_in {
        tsr_engine_in_kind kind;
        uint8_t router_id[TSR_ENGINE_ROUTER_ID_MAX];
        size_t router_id_len;
        tsr_engine_submit submit;  /* TSR_ENGINE_IN_SUBMIT */
        tsr_engine_abort abort;    /* TSR_ENGINE_IN_ABORT */
} tsr_engine_in;

/* One request's progress in one step. */
typedef struct tsr_engine_req_output {
        char request_id[TSR_ENGINE_REQUEST_ID_MAX + 1];
        uint32_t *new_tokens;           /* n_new */
        uint32_t n_new;
        tsr_token_logprobs *logprobs;   /* n_new entries, or NULL */
        /* Submit.prompt_logprobs >= 0, first Output only: entry i is prompt position
         * i + 1 (its token in .token) under the logits of position i.  Position 0 has
         * no logprob and no entry, so there are num_prompt_tokens - 1 of them. */
        tsr_token_logprobs *prompt_logprobs;
        uint32_t n_prompt_logprobs;
        tsr_engine_finish finish;
        bool has_stop_token_id;
        uint32_t stop_token_id;
        uint32_t num_prompt_tokens;
        uint32_t num_cached_tokens;
        uint32_t num_generated;
        uint64_t queued_ns, prefill_ns, decode_ns;
        uint32_t num_preemptions;
} tsr_engine_req_output;

typedef enum tsr_engine_out_kind {
        TSR_ENGINE_OUT_ERROR,      /* an Error for one request of router_id */
        TSR_ENGINE_OUT_STATS,      /* a new tsr_engine_stats snapshot (+ prefix-cache events) */
        TSR_ENGINE_OUT_OUTPUT,     /* one step's outputs for router_id */
        TSR_ENGINE_OUT_STOPPED,    /* after TSR_ENGINE_IN_SHUTDOWN: every request answered, nothing runs */
} tsr_engine_out_kind;

typedef struct tsr_engine_out {
        tsr_engine_out_kind kind;
        uint8_t router_id[TSR_ENGINE_ROUTER_ID_MAX];
        size_t router_id_len;
        /* ERROR */
        char request_id[TSR_ENGINE_REQUEST_ID_MAX + 1];
        tsr_engine_error error_code;
        bool retryable;
        char message[256];
        /* STATS */
        tsr_engine_stats stats;
        tsr_kv_events *events;          /* owned, may be NULL */
        /* OUTPUT */
        uint64_t step;
        tsr_engine_req_output *outputs;     /* owned */
        size_t n_outputs;
} tsr_engine_out;

void tsr_engine_in_free(tsr_engine_in *in);
void tsr_engine_out_free(tsr_engine_out *out);

typedef struct tsr_engine tsr_engine;

/* Start the engine thread.  Borrows both queues and the model (they must outlive the
 * engine).  *ret written only on success. */
tsr_status tsr_engine_start(const tsr_engine_params *p, tsr_queue *inbox, tsr_queue *outbox, tsr_engine **ret);
/* Close the inbox, let the thread finish its current step, join it.  Accepts NULL;
 * clears *e. */
void tsr_engine_stop(tsr_engine **e);

#endif
