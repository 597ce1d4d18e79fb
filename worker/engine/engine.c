/* engine.c - the engine thread: continuous batching as vLLM V1 schedules it.
 *
 *   for (;;) {
 *           take new Submits and Aborts from the inbox (block when idle);
 *           schedule(): token budget, running first, then waiting, preempt on OOM;
 *           run every scheduled chunk through the model in one forward call (each
 *                   row's logits are bitwise independent of the batch: the kernels
 *                   reduce per row in a fixed order, kernels/kernels.h);
 *           gather prompt logprobs from every row of a prompt_logprobs chunk;
 *           sample where a chunk reached the end of the known tokens, check stops;
 *           emit one Output per router, free finished requests, publish stats;
 *   }
 *
 * With --async-scheduling (loop_async) the forward and sampling of step N run on a
 * "step" thread while this loop's other work (Outputs of N-1, inbox, stats,
 * scheduling N+1 with one placeholder per token N will sample) runs beside it.
 */
#include "worker/engine/engine.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "worker/engine/state_cache.h"

typedef enum slot_state { SLOT_WAITING, SLOT_RUNNING, SLOT_FINISHED } slot_state;

typedef struct slot {
        char request_id[TSR_ENGINE_REQUEST_ID_MAX + 1];
        uint8_t router_id[TSR_ENGINE_ROUTER_ID_MAX];
        size_t router_id_len;
        slot_state state;
        uint32_t *tokens;             /* prompt then output */
        size_t n_prompt;
        size_t n_tokens;
        size_t cap_tokens;
        uint32_t max_tokens;
        bool ignore_eos;
        uint32_t *stop_ids;
        size_t n_stop_ids;
        tsr_logit_bias *bias;
        size_t n_bias;
        tsr_sampling sampling;        /* arrays point into this slot */
        int32_t prompt_logprobs;      /* -1: none; else top k of every prompt position */
        tsr_token_logprobs *prompt_lp;/* (n_prompt - 1,): position p at p - 1; moves to the first Output */
        uint64_t rng_key;
        int32_t priority;
        uint64_t arrival_ns;          /* engine clock when admitted */
        uint64_t seq;                 /* admission order: FCFS tie-break */
        uint64_t first_scheduled_ns;
        uint64_t first_token_ns;
        uint32_t num_preemptions;
        size_t num_cached_tokens;     /* prefix hit at first scheduling */
        uint64_t deferred_round;      /* schedule() round that left it waiting for a running
                                       * request to compute its shared prefix */
        bool cached_known;
        tsr_kv_req kv;
        bool has_state_slot;          /* holds engine.states' slot state_slot */
        uint32_t state_slot;
        /* Scheduled ahead of the KV cache (--async-scheduling schedules step N+1 while N
         * runs; synchronously both are 0 whenever schedule() reads them): tokens in a
         * step not yet applied, and the tokens those steps will sample (placeholders:
         * position known, id not yet).  `epoch` grows at every preemption, which makes
         * a step scheduled before it stale. */
        size_t n_ahead;
        size_t n_placeholders;
        uint64_t epoch;
        /* Steps in the model holding a chunk of it: at most one, except a prompt's
         * chunks with micro-batches (loop_queue), which follow each other in. */
        uint32_t n_in_flight;
        /* Let go while in flight (aborted, or finished with a chunk of it still in the
         * model): in no list, no Output; freed when its last step in flight returns. */
        bool aborted;
        /* this step's output */
        uint32_t step_new[1];
        tsr_token_logprobs step_lp;
        bool step_has_token;
        bool step_has_lp;
        tsr_engine_finish finish;
        bool has_stop_token_id;
        uint32_t stop_token_id;
        bool reported_prompt;         /* prompt/cached counts go in the first Output */
        /* The replica failed before this request's first token (replica_failure): a
         * retryable Error went to its router, which resubmits it; no Output follows. */
        bool handed_back;
        /* Structured output: the compile job while the request waits for it (vLLM's
         * WAITING_FOR_FSM: the scheduler skips it), then the matcher.  The matcher is
         * used by execute_plan only (the step thread with --async-scheduling). */
        tsr_grammar_job *gjob;
        tsr_grammar_matcher *gm;
        /* With a reasoning parser the constraint starts after the reasoning's end token
         * (reasoning_end; -1: at once): no mask while reasoning, and the end token is not
         * fed to the matcher (vLLM's should_fill_bitmask / should_advance).  grammar_from:
         * the output index the matcher starts at (SIZE_MAX: not yet); reasoning_scanned:
         * output tokens searched for the end so far.  execute_plan's, as the matcher. */
        int64_t reasoning_end;
        size_t grammar_from, reasoning_scanned;
} slot;

typedef struct slot_list {
        slot **items;
        size_t n, cap;
} slot_list;

/* One request's chunk in one step, and what the step made of it. */
typedef struct sched_entry {
        slot *s;
        size_t num_new;
        size_t past;                  /* tokens before the chunk (computed, or computed by the step before) */
        uint64_t epoch;               /* s->epoch when scheduled */
        bool will_sample;             /* the chunk ends the known tokens (placeholders counted) */
        /* Mamba prefix caching (tsr_engine_seq's fields of the same names): the chunk
         * starts from cached state restore_from; its saves are the plan's
         * saves[save_first .. save_first + n_saves), slots held until the step is
         * applied (state_saves_done). */
        bool restore_state;
        uint32_t restore_from;
        size_t save_first, n_saves;
        /* execute_plan's results (the step thread with --async-scheduling) */
        tsr_status st;
        bool sampled;
        uint32_t token;
        bool has_lp;
        tsr_token_logprobs lp;
        bool grammar_end;             /* its grammar is complete: finish (stop) */
        /* execute_plan's middle phase: the row it samples from (NULL: nothing to sample),
         * sampled by the engine (or step) thread or by the "sample" thread (sample_rows) */
        const float *sample_logits;
        tsr_sample_result sample;
        /* a row whose token the model may give instead of the row (tsr_engine_seq.token,
         * with `draw` for a sampled one); token_taken: it did, and `sample` holds it */
        uint32_t dev_token;
        tsr_draw draw;
        tsr_token_logprobs dev_lp;    /* its logprobs, where the model answers them too */
        bool token_taken;
        /* structured output: its mask is filled (the mask thread, while the forward
         * runs) into row mask_row of engine.gmask for n_output tokens; mask_st the fill's */
        bool constrained;
        uint32_t mask_row;
        size_t n_output;
        tsr_status mask_st;
} sched_entry;

/* One engine step: schedule() fills the entries, prepare_plan() the forward's inputs
 * (copies: with --async-scheduling the engine thread may grow a block table while the
 * step thread reads the step's), execute_plan() runs the model and samples,
 * apply_plan() stores the results in the slots, emit_outputs() tells the routers. */
typedef struct step_plan {
        sched_entry *entries;
        size_t n, cap;
        tsr_engine_seq *seqs;             /* (cap,) parallel to entries until apply_plan */
        uint32_t *inputs;             /* the seqs' tokens and block tables */
        size_t inputs_cap;
        tsr_state_save *saves;        /* the entries' state saves (Mamba prefix caching) */
        size_t n_saves, saves_cap;
        size_t n_want;                /* logits rows the forward writes */
        tsr_status st;                /* preparing or running the forward */
        uint64_t step;
        /* What the step computed and how long it took (execute_plan), for the step
         * timing model the routers' placement reads (step_timing_update). */
        uint64_t prefill_tokens;
        uint32_t n_decode;
        uint64_t compute_ns;
        /* execute_plan's sampling split: the "sample" thread samples the entries from
         * sample_from on, the calling thread those before */
        size_t sample_from;
        /* Pipeline micro-batches (tsr_engine_model.submit): the plan's own logits rows
         * (several steps are in flight; else the engine's `logits`), whether its step
         * is in the model (a wait owed), and when it went in. */
        float *logits;
        size_t logits_rows;
        bool submitted;
        uint64_t t0;
        size_t n_masks;
        /* The masks were filled before the forward, not beside it: the model answers
         * masks (tsr_engine_model.answers_masks), so its constrained rows go as tokens.
         * A queued step plans its masks after its wait unless the model answers masks
         * (then when it goes in, as every other step).  own_masks: a queued step's rows
         * are its own (gmask, gmask_rows: the next step's plan would overwrite the
         * engine's while this one is in flight); masks_of says whose. */
        bool masks_first, own_masks;
        uint32_t *gmask;
        size_t gmask_rows;
} step_plan;

/* A thread that runs one plan at a time for the engine: job_launch hands it a plan,
 * job_wait returns once run(engine, plan) has. mu guards job, done and quit; what the
 * plan's run touches belongs to the thread from job_launch until job_wait returns. */
typedef struct job_thread {
        bool up;
        pthread_t thread;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        struct step_plan *job;
        bool done;
        bool quit;
        struct tsr_engine *e;
        void (*run)(struct tsr_engine *e, struct step_plan *p);
        const char *name;             /* the thread's log name */
} job_thread;

struct tsr_engine {
        pthread_t thread;
        tsr_engine_params params;
        tsr_queue *inbox;
        tsr_queue *outbox;
        tsr_kv_cache *kv;
        slot_list running;            /* admission order */
        slot_list waiting;            /* FCFS order (front = next), preempted requests pushed to the front */
        tsr_engine_stats stats;
        tsr_engine_stats last_published;
        /* The step timing model (step_timing_update). Engine thread. */
        struct timing_samples {
                double v[8];          /* the last samples, a ring */
                unsigned n, next;
        } prefill_tps, decode_ms;
        uint64_t step;
        uint64_t next_seq;
        uint64_t kv_generation;       /* the model's, as last seen (tsr_engine_model.kv_generation) */
        /* logits, logits_rows and scratch belong to execute_plan: the step thread's
         * with --async-scheduling */
        float *logits;                /* (logits_rows, vocab): the rows of this step (tsr_engine_model.forward) */
        size_t logits_rows;
        size_t max_lp_rows;           /* prompt-logprobs rows one step may ask for (bounds `logits`) */
        float *scratch;               /* (TSR_SAMPLER_SCRATCH(vocab),) */
        float *scratch2;              /* (TSR_SAMPLER_SCRATCH(vocab),) the "sample" thread's */
        uint32_t *gmask;              /* (gmask_rows, tsr_grammar_mask_words(vocab)) execute_plan's */
        size_t gmask_rows;
        /* Structured outputs: the "mask" thread fills a step's masks (fill_masks)
         * while its forward runs, as vLLM fills the bitmask on the CPU while the GPU
         * computes; the plan's constrained entries' matchers are its meanwhile (the
         * forward does not touch them). */
        job_thread mask_thread;
        /* The "sample" thread: a step's rows are sampled half here, half on the calling
         * thread (sample_rows), after the forward, when its kernel threads are idle.
         * Each row's draw depends on that row, its request and its position only, so the
         * split changes no token (tsr_sample). */
        job_thread sample_thread;
        bool stopping;
        uint64_t sched_round;         /* schedule() calls */
        /* TSR_ENGINE_IN_SHUTDOWN: no new Submits; at the deadline (or once idle) the rest is
         * aborted and TSR_ENGINE_OUT_STOPPED sent (shutdown_done). */
        bool shutting_down;
        bool shutdown_done;
        uint64_t shutdown_deadline_ns;
        /* When the last step ended (execute_end; steps end in submit order): a step in a
         * pipeline costs from the later of its submit and that (step_timing_update). */
        uint64_t last_step_end_ns;
        step_plan plans[2];           /* synchronous: plans[0]; async: the one in flight and the next */
        /* Pipeline micro-batches (tsr_engine_model.submit, loop_queue): queue_cap plans,
         * the steps in the model and the one being scheduled. */
        step_plan *queue;
        uint32_t queue_cap;
        /* --async-scheduling: the "step" thread runs execute_plan while the engine
         * thread emits, takes the inbox and schedules the next step. */
        job_thread step_thread;
        /* Recurrent-state slots (params.state_slots > 0): held by running requests, and
         * with prefix caching the states kept every state block.  Engine thread only. */
        tsr_state_cache *states;
};

/* ------------------------------------------------------------------ small helpers */

static tsr_status list_push(slot_list *l, slot *s) {
        if (l->n == l->cap) {
                size_t cap = l->cap ? l->cap * 2 : 16;
                slot **g = realloc(l->items, cap * sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                l->items = g;
                l->cap = cap;
        }
        l->items[l->n++] = s;
        return TSR_OK;
}

static tsr_status list_push_front(slot_list *l, slot *s) {
        tsr_status st = list_push(l, s);
        if (st != TSR_OK)
                return st;
        memmove(l->items + 1, l->items, (l->n - 1) * sizeof(*l->items));
        l->items[0] = s;
        return TSR_OK;
}

static void list_remove_at(slot_list *l, size_t i) {
        memmove(l->items + i, l->items + i + 1, (l->n - i - 1) * sizeof(*l->items));
        l->n--;
}

static bool list_remove(slot_list *l, slot *s) {
        for (size_t i = 0; i < l->n; i++)
                if (l->items[i] == s) {
                        list_remove_at(l, i);
                        return true;
                }
        return false;
}

void tsr_engine_in_free(tsr_engine_in *in) {
        if (!in)
                return;
        free(in->submit.prompt);
        free(in->submit.stop_ids);
        free(in->submit.bias);
        free(in->submit.so_text);
        free(in->abort.request_ids);
        free(in);
}

void tsr_engine_out_free(tsr_engine_out *out) {
        if (!out)
                return;
        for (size_t i = 0; i < out->n_outputs; i++) {
                free(out->outputs[i].new_tokens);
                free(out->outputs[i].logprobs);
                free(out->outputs[i].prompt_logprobs);
        }
        free(out->outputs);
        tsr_kv_events_free(&out->events);
        free(out);
}

/* A request's recurrent-state slot back to the pool (none held: nothing).  Its
 * contents need no clearing: the forward that starts a sequence zeroes the slot. */
static void state_slot_give(tsr_engine *e, slot *s) {
        if (!s->has_state_slot)
                return;
        tsr_state_give(e->states, s->state_slot);
        s->has_state_slot = false;
}

static void slot_free(tsr_engine *e, slot *s) {
        if (!s)
                return;
        state_slot_give(e, s);
        tsr_kv_req_done(e->kv, &s->kv);
        free(s->tokens);
        free(s->stop_ids);
        free(s->bias);
        free(s->prompt_lp);
        tsr_grammar_job_release(&s->gjob);
        tsr_grammar_matcher_free(&s->gm);
        free(s);
}

/* The engine never blocks on the network; a full outbox means the io thread is
 * behind, so wait for it briefly (bounded) rather than drop a reply. */
static void push_out(tsr_engine *e, tsr_engine_out *out) {
        for (int tries = 0; tries < 2000; tries++) {
                tsr_status st = tsr_queue_push(e->outbox, out);
                if (st == TSR_OK)
                        return;
                if (st == TSR_E_CLOSED)
                        break;
                nanosleep(&(struct timespec){.tv_nsec = 500000}, NULL);
        }
        log_warn("outbox full or closed for 1 s: dropped a message (kind %d)", (int)out->kind);
        tsr_engine_out_free(out);
}

static void send_error(tsr_engine *e, const uint8_t *rid, size_t rid_len, const char *request_id,
                       tsr_engine_error code, bool retryable, const char *fmt, ...)
        __attribute__((format(printf, 7, 8)));

static void send_error(tsr_engine *e, const uint8_t *rid, size_t rid_len, const char *request_id,
                       tsr_engine_error code, bool retryable, const char *fmt, ...) {
        tsr_engine_out *out = calloc(1, sizeof(*out));
        va_list ap;
        if (!out)
                return;
        out->kind = TSR_ENGINE_OUT_ERROR;
        memcpy(out->router_id, rid, rid_len);
        out->router_id_len = rid_len;
        snprintf(out->request_id, sizeof(out->request_id), "%s", request_id);
        out->error_code = code;
        out->retryable = retryable;
        va_start(ap, fmt);
        vsnprintf(out->message, sizeof(out->message), fmt, ap);
        va_end(ap);
        push_out(e, out);
}

/* The step timing model routers place by (Status prefill_tokens_per_s and
 * decode_step_ms, router/placement.h): a step takes about prefill_tokens / P, plus D
 * when it decodes, a step's time being what it adds to the engine's (execute_end:
 * with micro-batches the interval since the step before it ended).  A step that only
 * decodes samples D; one that prefills at least TIMING_MIN_PREFILL tokens samples P from
 * the time left after D (once D is known when it also decodes).  Each is the median of
 * its last 8 samples: it follows the batch size and context lengths as load changes,
 * and one step stretched by a page fault, a first-call allocation or a descheduled
 * thread (seen: a 50 ms simulated prefill timed at 1.1 s on a loaded machine) does not
 * move it.  Engine thread (both loops apply here). */
#define TIMING_MIN_PREFILL 32

static void timing_add(struct timing_samples *t, double v) {
        t->v[t->next] = v;
        t->next = (t->next + 1) % 8;
        if (t->n < 8)
                t->n++;
}

/* The median of the samples (the lower middle of an even count); 0 without any. */
static double timing_median(const struct timing_samples *t) {
        double v[8];
        if (!t->n)
                return 0;
        memcpy(v, t->v, t->n * sizeof(*v));
        for (unsigned i = 1; i < t->n; i++)      /* insertion sort: at most 8 */
                for (unsigned j = i; j > 0 && v[j - 1] > v[j]; j--) {
                        double x = v[j];
                        v[j] = v[j - 1];
                        v[j - 1] = x;
                }
        return v[(t->n - 1) / 2];
}

static void step_timing_update(tsr_engine *e, const step_plan *p) {
        double dt = (double)p->compute_ns / 1e9, decode_s = timing_median(&e->decode_ms) / 1e3, rest;
        if (!p->n || p->st != TSR_OK || dt <= 0)
                return;
        if (p->n_decode && !p->prefill_tokens) {
                timing_add(&e->decode_ms, dt * 1e3);
                return;
        }
        if (p->prefill_tokens < TIMING_MIN_PREFILL || (p->n_decode && decode_s <= 0))
                return;
        rest = dt - (p->n_decode ? decode_s : 0);
        if (rest > 0.1 * dt)   /* else the decode estimate is off for this step: no sample */
                timing_add(&e->prefill_tps, (double)p->prefill_tokens / rest);
}

static void refresh_stats(tsr_engine *e) {
        tsr_kv_stats ks;
        uint64_t waiting_tokens = 0;
        tsr_kv_cache_stats(e->kv, &ks);
        for (size_t i = 0; i < e->waiting.n; i++)
                waiting_tokens += e->waiting.items[i]->n_tokens;
        e->stats.kv_blocks_total = ks.num_blocks;
        e->stats.kv_blocks_free = ks.num_free;
        e->stats.kv_blocks_active = ks.num_active;
        e->stats.state_slots_total = e->params.state_slots;
        if (e->states) {
                tsr_state_stats ss;
                tsr_state_cache_stats(e->states, &ss);
                e->stats.state_slots_free = ss.total - ss.held;
        }
        e->stats.num_running = (uint32_t)e->running.n;
        e->stats.num_waiting = (uint32_t)e->waiting.n;
        e->stats.waiting_prompt_tokens = waiting_tokens;
        e->stats.prefix_cache_queries_total = ks.prefix_cache_queries;
        e->stats.prefix_cache_hits_total = ks.prefix_cache_hits;
        e->stats.prefill_tokens_per_s = (float)timing_median(&e->prefill_tps);
        e->stats.decode_step_ms = (float)timing_median(&e->decode_ms);
}

/* Publish when something a router can see changed, with the prefix-cache events. */
static void publish_stats(tsr_engine *e, bool force) {
        tsr_engine_out *out;
        tsr_kv_events *events = NULL;

        refresh_stats(e);
        if (e->kv)
                tsr_kv_cache_take_events(e->kv, &events);
        if (!force && !events && memcmp(&e->stats, &e->last_published, sizeof(e->stats)) == 0)
                return;
        out = calloc(1, sizeof(*out));
        if (!out) {
                tsr_kv_events_free(&events);
                return;
        }
        out->kind = TSR_ENGINE_OUT_STATS;
        out->stats = e->stats;
        out->events = events;
        e->last_published = e->stats;
        push_out(e, out);
}

/* ------------------------------------------------------------------ admission */

static void admit(tsr_engine *e, tsr_engine_in *in) {
        tsr_engine_submit *m = &in->submit;
        const tsr_engine_params *p = &e->params;
        size_t vocab = p->model->vocab;
        slot *s;

        if (m->n_prompt + 1 > p->max_model_len) {
                send_error(e, in->router_id, in->router_id_len, m->request_id, TSR_ENGINE_ERROR_TOO_LONG,
                           false, "The decoder prompt (length %zu) is longer than the maximum model length of %u.",
                           m->n_prompt, p->max_model_len);
                return;
        }
        for (size_t i = 0; i < m->n_prompt; i++)
                if (m->prompt[i] >= vocab) {
                        send_error(e, in->router_id, in->router_id_len, m->request_id,
                                   TSR_ENGINE_ERROR_INVALID, false, "Token id %u is out of vocabulary",
                                   m->prompt[i]);
                        return;
                }
        s = calloc(1, sizeof(*s));
        if (!s)
                goto oom;
        snprintf(s->request_id, sizeof(s->request_id), "%s", m->request_id);
        memcpy(s->router_id, in->router_id, in->router_id_len);
        s->router_id_len = in->router_id_len;
        s->n_prompt = m->n_prompt;
        s->n_tokens = s->n_prompt;
        /* Room for every token the request may ever hold. */
        s->max_tokens = m->max_tokens;
        if (s->n_prompt + s->max_tokens > p->max_model_len)
                s->max_tokens = (uint32_t)(p->max_model_len - s->n_prompt);
        s->cap_tokens = s->n_prompt + s->max_tokens + 1;
        s->tokens = malloc(s->cap_tokens * sizeof(uint32_t));
        if (!s->tokens)
                goto oom;
        memcpy(s->tokens, m->prompt, s->n_prompt * sizeof(uint32_t));
        s->ignore_eos = m->ignore_eos;
        /* The slot takes the message's arrays. */
        s->stop_ids = m->stop_ids;
        s->n_stop_ids = m->n_stop_ids;
        m->stop_ids = NULL;
        s->bias = m->bias;
        s->n_bias = m->n_bias;
        m->bias = NULL;
        s->sampling = m->sampling;
        s->sampling.min_tokens = m->min_tokens;
        /* min_tokens masks every EOS id, ignore_eos or not (vLLM's _all_stop_token_ids). */
        s->sampling.eos_ids = p->eos_ids;
        s->sampling.n_eos = p->n_eos_ids;
        s->sampling.stop_ids = s->stop_ids;
        s->sampling.n_stop = s->n_stop_ids;
        s->sampling.bias = s->bias;
        s->sampling.n_bias = s->n_bias;
        s->sampling.logprobs = m->logprobs > TSR_SAMPLER_MAX_LOGPROBS ? TSR_SAMPLER_MAX_LOGPROBS : m->logprobs;
        s->prompt_logprobs = m->prompt_logprobs > TSR_SAMPLER_MAX_LOGPROBS ? TSR_SAMPLER_MAX_LOGPROBS : m->prompt_logprobs;
        if ((size_t)s->prompt_logprobs > vocab && s->prompt_logprobs >= 0)
                s->prompt_logprobs = (int32_t)vocab;
        if (s->prompt_logprobs >= 0 && s->n_prompt > 1) {
                s->prompt_lp = calloc(s->n_prompt - 1, sizeof(*s->prompt_lp));
                if (!s->prompt_lp)
                        goto oom;
        }
        if (tsr_sampling_check(&s->sampling, vocab) != TSR_OK) {
                send_error(e, in->router_id, in->router_id_len, m->request_id, TSR_ENGINE_ERROR_INVALID,
                           false, "sampling parameters out of range for this model (logit_bias or stop ids outside "
                           "the vocabulary?)");
                slot_free(e, s);
                return;
        }
        /* Seeded: the same key whatever else runs, so the same tokens alone or in any
         * batch.  Unseeded: the engine seed mixed with the admission order. */
        s->rng_key = m->has_seed ? m->seed * 0x9e3779b97f4a7c15ull + 1
                                        : (p->seed ^ 0xa0761d6478bd642full) + e->next_seq * 0xe7037ed1a0b428dbull;
        if (m->so_kind != TSR_GRAMMAR_NONE) {
                tsr_grammar_spec spec = {.kind = m->so_kind, .text = m->so_text, .len = m->so_len,
                                         .any_whitespace = !m->so_compact};
                if (!p->grammar) {
                        send_error(e, in->router_id, in->router_id_len, m->request_id, TSR_ENGINE_ERROR_INVALID,
                                   false, "structured outputs are not available on this worker");
                        slot_free(e, s);
                        return;
                }
                /* Compiled on the grammar thread; grammar_poll picks the result up. */
                if (!(s->gjob = tsr_grammar_pool_submit(p->grammar, &spec)))
                        goto oom;
                s->reasoning_end = m->so_reasoning_end;
                s->grammar_from = m->so_reasoning_end < 0 ? 0 : SIZE_MAX;
        }
        s->priority = m->priority;
        s->arrival_ns = tsr_now_ns();
        s->seq = e->next_seq++;
        s->state = SLOT_WAITING;
        if (tsr_kv_req_init(&s->kv, NULL, 0) != TSR_OK || list_push(&e->waiting, s) != TSR_OK)
                goto oom;
        return;
oom:
        slot_free(e, s);
        send_error(e, in->router_id, in->router_id_len, m->request_id, TSR_ENGINE_ERROR_UNAVAILABLE, true,
                   "worker out of memory");
}

static void abort_requests(tsr_engine *e, tsr_engine_in *in) {
        const tsr_engine_abort *a = &in->abort;
        slot_list *lists[2] = {&e->running, &e->waiting};
        for (int li = 0; li < 2; li++) {
                slot_list *l = lists[li];
                for (size_t i = 0; i < l->n;) {
                        slot *s = l->items[i];
                        bool hit = a->all_from_router && s->router_id_len == in->router_id_len &&
                                   memcmp(s->router_id, in->router_id, in->router_id_len) == 0;
                        for (size_t k = 0; !hit && k < a->n_request_ids; k++)
                                hit = strcmp(s->request_id, a->request_ids[k]) == 0 &&
                                      s->router_id_len == in->router_id_len &&
                                      memcmp(s->router_id, in->router_id, in->router_id_len) == 0;
                        if (!hit) {
                                i++;
                                continue;
                        }
                        /* Aborted requests get no Output: the router already let go. */
                        list_remove_at(l, i);
                        log_req(TSR_LOG_DEBUG, s->request_id, "aborted (%s)", a->reason);
                        if (s->n_in_flight)
                                s->aborted = true;   /* the step thread still reads it: apply_plan frees it */
                        else
                                slot_free(e, s);
                }
        }
}

/* Blocking pop for an idle engine.  With a liveness callback the wait wakes every
 * alive_interval_ms to call it, with a model's idle hook every TSR_ENGINE_IDLE_POLL_MS
 * (the shorter); the queue answers NULL both on a timeout and when it is closed and
 * empty, told apart by the clock (a timed-out wait has reached its deadline). */
static tsr_engine_in *wait_inbox(tsr_engine *e) {
        const tsr_engine_model *m = e->params.model;
        bool alive = e->params.alive && e->params.alive_interval_ms, idle = m && m->idle;
        uint32_t every = alive ? e->params.alive_interval_ms : TSR_ENGINE_IDLE_POLL_MS;
        tsr_engine_in *in;
        uint64_t deadline;

        if (!alive && !idle)
                return tsr_queue_pop_wait(e->inbox, -1);
        if (idle && every > TSR_ENGINE_IDLE_POLL_MS)
                every = TSR_ENGINE_IDLE_POLL_MS;
        for (;;) {
                deadline = tsr_now_ns() + (uint64_t)every * 1000000ull;
                in = tsr_queue_pop_wait(e->inbox, (int)every);
                if (in || tsr_now_ns() < deadline)
                        return in;
                if (alive)
                        e->params.alive(e->params.alive_ud);
                if (idle)
                        m->idle(m->ud);
        }
}

/* Nothing can run until a grammar compile ends: every request left waits for one. */
static bool grammar_only_waiting(const tsr_engine *e) {
        if (e->running.n || !e->waiting.n)
                return false;
        for (size_t i = 0; i < e->waiting.n; i++)
                if (!e->waiting.items[i]->gjob)
                        return false;
        return true;
}

static void take_inbox(tsr_engine *e, bool block) {
        tsr_engine_in *in;
        bool first = true;
        /* Waiting on the grammar thread only: nap on the inbox for 1 ms instead of spinning. */
        bool nap = !block && grammar_only_waiting(e);
        if (e->params.alive)
                e->params.alive(e->params.alive_ud);
        for (;;) {
                in = first && block ? wait_inbox(e) : first && nap ? tsr_queue_pop_wait(e->inbox, 1) : tsr_queue_pop(e->inbox);
                first = false;
                if (!in) {
                        if (block)
                                e->stopping = true;   /* closed and empty */
                        return;
                }
                if (in->kind == TSR_ENGINE_IN_SUBMIT) {
                        e->stats.submits_taken_total++;
                        e->stats.submit_prompt_tokens_taken_total += in->submit.n_prompt;
                        if (!e->params.model)
                                send_error(e, in->router_id, in->router_id_len, in->submit.request_id,
                                           TSR_ENGINE_ERROR_UNAVAILABLE, true,
                                           "this worker has no model runner for its model family");
                        else if (e->shutting_down)
                                send_error(e, in->router_id, in->router_id_len, in->submit.request_id,
                                           TSR_ENGINE_ERROR_UNAVAILABLE, true,
                                           "worker is shutting down");
                        else
                                admit(e, in);
                } else if (in->kind == TSR_ENGINE_IN_ABORT) {
                        abort_requests(e, in);
                } else if (in->kind == TSR_ENGINE_IN_RESYNC) {
                        if (e->kv)      /* publish_stats after this drain sends it */
                                tsr_kv_cache_resync(e->kv);
                } else if (!e->shutting_down) {
                        e->shutting_down = true;
                        e->shutdown_deadline_ns = tsr_now_ns() + e->params.shutdown_timeout_ms * 1000000ull;
                        log_info("shutting down: no new requests; %zu running and %zu waiting may finish within "
                                 "%llu ms, then are aborted", e->running.n, e->waiting.n,
                                 (unsigned long long)e->params.shutdown_timeout_ms);
                }
                tsr_engine_in_free(in);
                block = false;
        }
}

/* ------------------------------------------------------------------ scheduling */

/* A request whose prompt logprobs are still to be computed: its prefill chunks need a
 * logits row for every token, not just the last. */
static bool wants_prompt_lp(const slot *s, size_t computed) {
        return s->prompt_lp && !s->reported_prompt && computed < s->n_prompt;
}

/* One entry of the plan being scheduled; the request's tokens now run ahead of its KV. */
static void plan_add(sched_entry *pe, slot *s, size_t past, size_t num_new, bool will_sample) {
        *pe = (sched_entry){.s = s, .num_new = num_new, .past = past, .epoch = s->epoch, .will_sample = will_sample};
        s->n_ahead += num_new;
        if (will_sample)
                s->n_placeholders++;
}

static void preempt(tsr_engine *e, slot *victim) {
        tsr_kv_cache_free_blocks(e->kv, &victim->kv);
        state_slot_give(e, victim);     /* as its blocks: a later owner's step runs after any in flight */
        list_remove(&e->running, victim);
        victim->state = SLOT_WAITING;
        /* A step of it still in flight (--async-scheduling) is now stale: apply_plan
         * drops its result and the recompute produces the same token again.  Its
         * blocks may go to others at once: their steps run after the one in flight. */
        victim->n_ahead = 0;
        victim->n_placeholders = 0;
        victim->epoch++;
        victim->num_preemptions++;
        e->stats.num_preemptions_total++;
        /* Recompute on resume: the generated tokens are kept and re-prefilled. */
        list_push_front(&e->waiting, victim);
        log_req(TSR_LOG_DEBUG, victim->request_id, "preempted (recompute later): KV blocks exhausted");
}

/* The running request to preempt: FCFS takes the last admitted; priority the one with
 * the highest (priority, arrival). */
static slot *pick_victim(tsr_engine *e) {
        slot *v = e->running.items[e->running.n - 1];
        if (e->params.priority_scheduling)
                for (size_t i = 0; i < e->running.n; i++) {
                        slot *s = e->running.items[i];
                        if (s->priority > v->priority || (s->priority == v->priority && s->seq > v->seq))
                                v = s;
                }
        return v;
}

/* Index in `waiting` of the next request to admit, skipping those deferred in this
 * round (prefix_in_flight); SIZE_MAX when none is left. */
static size_t next_waiting(const tsr_engine *e) {
        size_t best = SIZE_MAX;
        for (size_t i = 0; i < e->waiting.n; i++) {
                const slot *a = e->waiting.items[i], *b;
                /* n_in_flight: preempted while a step of it is in the model (micro-
                 * batches): its recompute waits for those steps to be applied */
                if (a->deferred_round == e->sched_round || a->gjob || a->n_in_flight)
                        continue;   /* deferred, or its grammar is still compiling */
                if (!e->params.priority_scheduling)
                        return i;
                b = best == SIZE_MAX ? NULL : e->waiting.items[best];
                if (!b || a->priority < b->priority || (a->priority == b->priority && a->seq < b->seq))
                        best = i;
        }
        return best;
}

/* Prefix caching of a Mamba hybrid's state (state_cache.h): on, and its state block
 * (tokens), at whose multiples the states are kept. */
static bool states_cached(const tsr_engine *e) { return e->states && e->params.enable_prefix_caching; }

static size_t state_block(const tsr_engine *e) {
        return e->params.state_block ? e->params.state_block : e->params.block_size;
}

/* True when a running request is computing, right now, full blocks of s's tokens that
 * s could read from the prefix cache once they are done: s then waits for them rather
 * than computing them a second time.  This is what makes the `n` samples of one prompt
 * (n requests, submitted together) share the prompt's KV: the first is prefilled, the
 * others hit every full block of it and compute only the partial last block.  Waiting
 * is bounded: the running request only moves forward (or is preempted, and then no
 * longer holds anyone back).  Requests that skip the cache (prompt_logprobs) never
 * wait.  Skipping such a request for this round is V1's own skip-and-requeue of a
 * waiting request that cannot start yet (remote KV, grammar, LoRA slot); requests
 * behind it may go first. */
static bool prefix_in_flight(tsr_engine *e, slot *s) {
        size_t bs = e->params.block_size, readable;
        if (!e->params.enable_prefix_caching || s->prompt_logprobs >= 0 || s->n_tokens <= bs)
                return false;
        readable = (s->n_tokens - 1) / bs;   /* a lookup leaves at least one token to compute */
        for (size_t i = 0; i < e->running.n; i++) {
                const slot *x = e->running.items[i];
                size_t common = tsr_kv_req_common_blocks(e->kv, &s->kv, s->tokens, s->n_tokens, &x->kv);
                if (common > readable)
                        common = readable;
                if (states_cached(e))   /* a hybrid's hit ends where a state is kept */
                        common = common * bs / state_block(e) * state_block(e) / bs;
                if (common && x->kv.n_computed < common * bs)
                        return true;
        }
        return false;
}

/* ---- prefix caching of a Mamba hybrid's state: the hit, the saves ---- */

/* kv_cache's hit check (tsr_kv_cache_set_hit_check): a hybrid's hit must end at a block
 * whose state was kept.  Engine thread. */
static bool state_kept(void *ud, uint64_t hash) {
        const tsr_engine *e = ud;
        return tsr_state_has(e->states, hash);
}

/* A hit of `cached` tokens: pin the state kept at its end for this round and return its
 * slot (the request's first chunk copies it into its own).  false: no hit, or (not
 * expected: the hit check found it) the state is gone, and the request must start from
 * nothing. */
static bool state_for_hit(tsr_engine *e, slot *s, size_t cached, uint32_t *from) {
        uint64_t h;
        return cached && tsr_kv_req_block_hash(&s->kv, cached / e->params.block_size - 1, &h) &&
               tsr_state_find(e->states, h, e->sched_round, from);
}

/* After scheduling: each position a multiple of the state block that a chunk reaches
 * saves the state there into a slot of its own (a free one, else the least recently used
 * kept state), kept under the hash of the block that ends there once the step is applied
 * (vLLM 0.11-0.12 keeps a hybrid's state at every mamba block the prefill computes, and
 * at the blocks decoding fills).  Positions whose state is kept already are skipped.
 * After the admissions, so saves never take a slot a request could have run in; when no
 * slot is left, the rest are not kept. */
static void plan_saves(tsr_engine *e, step_plan *p) {
        size_t sb = state_block(e), bs = e->params.block_size;
        p->n_saves = 0;
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                pe->save_first = p->n_saves;
                pe->n_saves = 0;
                for (size_t b = (pe->past / sb + 1) * sb; b <= pe->past + pe->num_new; b += sb) {
                        uint64_t h;
                        uint32_t to;
                        if (tsr_kv_req_block_hash(&pe->s->kv, b / bs - 1, &h) && tsr_state_has(e->states, h))
                                continue;
                        if (p->n_saves == p->saves_cap) {
                                size_t cap = p->saves_cap ? 2 * p->saves_cap : 64;
                                tsr_state_save *g = realloc(p->saves, cap * sizeof(*g));
                                if (!g)
                                        return;
                                p->saves = g;
                                p->saves_cap = cap;
                        }
                        if (!tsr_state_take(e->states, e->sched_round, &to))
                                return;
                        p->saves[p->n_saves++] = (tsr_state_save){.pos = (uint32_t)b, .slot = to};
                        pe->n_saves++;
                }
        }
}

/* pe's step was applied (ok: its KV committed, so every block up to each save is
 * hashed) or dropped: keep each state it saved under the hash of the block ending at its
 * position, or give the slot back.  Engine thread. */
static void state_saves_done(tsr_engine *e, const step_plan *p, sched_entry *pe, bool ok) {
        size_t bs = e->params.block_size;
        for (size_t k = 0; k < pe->n_saves; k++) {
                const tsr_state_save *sv = &p->saves[pe->save_first + k];
                uint64_t h;
                if (ok && tsr_kv_req_block_hash(&pe->s->kv, sv->pos / bs - 1, &h))
                        tsr_state_store(e->states, sv->slot, h);
                else
                        tsr_state_give(e->states, sv->slot);
        }
        pe->n_saves = 0;
}

/* --long-prefill-token-threshold, as vLLM V1 applies it to running and waiting requests
 * alike before the step's budget: more than the threshold to compute means a chunk of
 * exactly the threshold.  A decode step (one token) is never capped. */
static size_t long_prefill_cap(const tsr_engine_params *p, size_t num_new) {
        if (p->long_prefill_token_threshold > 0 && num_new > p->long_prefill_token_threshold)
                return p->long_prefill_token_threshold;
        return num_new;
}

/* tsr_engine_params.prefill_align: num_new tokens from `computed` cut to end at a chunk
 * multiple unless they reach `known`; 0 when the piece would end inside the chunk it
 * starts at (the request waits for a step with more room).  Not cut where a step could
 * never hold a chunk: a budget, threshold or (prompt logprobs, `lp`) logits-row cap
 * below it. */
static size_t align_prefill(const tsr_engine *e, size_t computed, size_t num_new, size_t known, bool lp) {
        const tsr_engine_params *p = &e->params;
        size_t Q = p->prefill_align, cap = p->max_num_batched_tokens;
        if (p->long_prefill_token_threshold > 0 && p->long_prefill_token_threshold < cap)
                cap = p->long_prefill_token_threshold;
        if (lp && e->max_lp_rows < cap)
                cap = e->max_lp_rows;
        if (Q < 2 || cap < Q || computed + num_new >= known)
                return num_new;
        size_t end = (computed + num_new) / Q * Q;
        if (end > computed)
                return end - computed;
        return computed % Q ? num_new : 0;      /* mid-chunk already: that chunk is cut anyway */
}

/* Fill plan[0..] (at most plan_cap entries) for the next step.  A running request's
 * known tokens count its placeholders and its computed ones the tokens of the step in
 * flight (vLLM's AsyncScheduler); synchronously both additions are 0. */
static size_t schedule(tsr_engine *e, sched_entry *plan, size_t plan_cap) {
        const tsr_engine_params *p = &e->params;
        size_t budget = p->max_num_batched_tokens, n_plan = 0;
        /* Prompt-logprobs chunks take one logits row per token: their share of the step
         * is capped so the logits buffer stays bounded (the rest comes in later chunks). */
        size_t lp_rows = e->max_lp_rows;
        bool preempted = false;

        e->sched_round++;

        /* (1) running requests, in admission order (a snapshot: preemption edits the list) */
        size_t n_snap = e->running.n;
        slot **snap = malloc((n_snap ? n_snap : 1) * sizeof(*snap));
        if (!snap)
                return 0;
        if (n_snap)
                memcpy(snap, e->running.items, n_snap * sizeof(*snap));
        for (size_t i = 0; i < n_snap && budget > 0 && n_plan < plan_cap; i++) {
                slot *s = snap[i];
                size_t num_new, room, computed, known;
                if (s->state != SLOT_RUNNING)
                        continue;   /* preempted earlier in this step */
                /* With micro-batches, a request whose token a step in the model will
                 * sample waits for it (vLLM's batch queue: nothing is known to schedule
                 * after it).  A prompt's next chunk does not wait: it goes in behind the
                 * chunk in flight, which every stage computes first (vLLM advances
                 * num_computed_tokens when it schedules, so its chunks pipeline too). */
                if (e->queue && s->n_placeholders)   /* a token pending: its step is in flight */
                        continue;
                computed = s->kv.n_computed + s->n_ahead;
                known = s->n_tokens + s->n_placeholders;
                /* Its pending token is its last for sure (max_tokens, max_model_len):
                 * nothing to schedule after it (vLLM's max_total check). */
                if (s->n_placeholders &&
                    (known - s->n_prompt >= s->max_tokens || known >= p->max_model_len))
                        continue;
                num_new = known - computed;
                room = p->max_model_len > computed ? p->max_model_len - computed : 0;
                num_new = long_prefill_cap(p, num_new);
                if (num_new > budget)
                        num_new = budget;
                if (num_new > room)
                        num_new = room;
                if (wants_prompt_lp(s, computed) && num_new > lp_rows)
                        num_new = lp_rows;
                num_new = align_prefill(e, computed, num_new, known, wants_prompt_lp(s, computed));
                if (num_new == 0)
                        continue;
                while (tsr_kv_cache_allocate_slots(e->kv, &s->kv, s->n_ahead + num_new) != TSR_OK) {
                        slot *victim = pick_victim(e);
                        /* A victim already planned this step gives its budget back. */
                        for (size_t k = 0; k < n_plan; k++)
                                if (plan[k].s == victim) {
                                        budget += plan[k].num_new;
                                        plan[k] = plan[--n_plan];
                                        break;
                                }
                        preempt(e, victim);
                        preempted = true;
                        if (victim == s)
                                break;
                }
                if (s->state != SLOT_RUNNING)
                        break;      /* it preempted itself: as vLLM, no running request after it this step */
                if (!s->first_scheduled_ns)
                        s->first_scheduled_ns = tsr_now_ns();
                plan_add(&plan[n_plan++], s, computed, num_new, computed + num_new == known);
                budget -= num_new;
                if (wants_prompt_lp(s, computed))
                        lp_rows -= num_new;
        }
        free(snap);
        /* (2) waiting requests, only if nothing was preempted this step */
        while (!preempted && budget > 0 && e->waiting.n && e->running.n < p->max_num_seqs && n_plan < plan_cap) {
                size_t wi = next_waiting(e);
                slot *s;
                size_t cached = 0, num_new;
                uint32_t restore_from = 0;
                bool restore = false;

                if (wi == SIZE_MAX)
                        break;
                s = e->waiting.items[wi];
                if (s->kv.n_blocks == 0 && prefix_in_flight(e, s)) {
                        s->deferred_round = e->sched_round;
                        continue;
                }

                /* prompt_logprobs needs the logits of every prompt position, so such a
                 * request reads nothing from the prefix cache (vLLM does the same). */
                if (s->kv.n_blocks == 0 &&
                    tsr_kv_cache_get_computed_blocks(e->kv, &s->kv, s->tokens, s->n_tokens, s->prompt_logprobs >= 0,
                                                     &cached) != TSR_OK)
                        cached = 0;
                if (!s->cached_known) {
                        s->num_cached_tokens = cached;
                        s->cached_known = true;
                }
                num_new = long_prefill_cap(p, s->n_tokens - (s->kv.n_computed + cached));
                if (num_new > budget)
                        num_new = budget;
                if (wants_prompt_lp(s, s->kv.n_computed) && num_new > lp_rows) {
                        num_new = lp_rows;
                        if (num_new == 0)
                                break;   /* head-of-line: no logits rows left this step */
                }
                num_new = align_prefill(e, s->kv.n_computed + cached, num_new, s->n_tokens,
                                        wants_prompt_lp(s, s->kv.n_computed));
                if (num_new == 0)
                        break;   /* head-of-line: too little budget left for a whole chunk */
                if (cached && states_cached(e)) {
                        if (!state_for_hit(e, s, cached, &restore_from))
                                break;   /* its state went missing: the next round looks up again */
                        restore = true;
                }
                if (e->params.state_slots && !s->has_state_slot) {
                        if (!tsr_state_take(e->states, e->sched_round, &s->state_slot))
                                break;   /* head-of-line: wait for a state slot (vLLM: no Mamba block free) */
                        s->has_state_slot = true;
                }
                if (tsr_kv_cache_allocate_slots(e->kv, &s->kv, num_new) != TSR_OK) {
                        state_slot_give(e, s);
                        break;   /* head-of-line: wait for blocks */
                }
                if (wants_prompt_lp(s, s->kv.n_computed))
                        lp_rows -= num_new;
                list_remove_at(&e->waiting, wi);
                s->state = SLOT_RUNNING;
                list_push(&e->running, s);
                if (!s->first_scheduled_ns)
                        s->first_scheduled_ns = tsr_now_ns();
                /* allocate_slots took the prefix hits: kv.n_computed counts them now */
                plan_add(&plan[n_plan], s, s->kv.n_computed, num_new, s->kv.n_computed + num_new == s->n_tokens);
                plan[n_plan].restore_state = restore;
                plan[n_plan++].restore_from = restore_from;
                budget -= num_new;
        }
        return n_plan;
}

/* ------------------------------------------------------------------ execution */

/* eos_ids[0] is the tokenizer's EOS, the one vLLM stops on as EOS (no stop reason). */
static bool is_eos(const tsr_engine *e, uint32_t t) {
        return e->params.n_eos_ids > 0 && e->params.eos_ids[0] == t;
}

/* The model's other EOS ids (generation_config's list less the tokenizer's): vLLM's
 * update_from_generation_config adds them to the request's stop_token_ids unless
 * ignore_eos, so they finish a request as stop ids do, reported as its stop reason. */
static bool is_extra_eos(const tsr_engine *e, uint32_t t) {
        for (size_t i = 1; i < e->params.n_eos_ids; i++)
                if (e->params.eos_ids[i] == t)
                        return true;
        return false;
}

/* vLLM's check_stop order: min_tokens gate, EOS, stop_token_ids, length. */
static void check_stop(tsr_engine *e, slot *s, uint32_t t) {
        size_t n_out = s->n_tokens - s->n_prompt;
        if (n_out >= s->sampling.min_tokens) {
                if (!s->ignore_eos && is_eos(e, t)) {
                        s->finish = TSR_ENGINE_FINISH_STOP;
                        return;
                }
                bool stop_id = !s->ignore_eos && is_extra_eos(e, t);
                for (size_t i = 0; i < s->n_stop_ids && !stop_id; i++)
                        stop_id = s->stop_ids[i] == t;
                if (stop_id) {
                        s->finish = TSR_ENGINE_FINISH_STOP;
                        s->has_stop_token_id = true;
                        s->stop_token_id = t;
                        return;
                }
        }
        if (n_out >= s->max_tokens || s->n_tokens >= e->params.max_model_len)
                s->finish = TSR_ENGINE_FINISH_LENGTH;
}

/* Prompt logprobs of the chunk at positions past .. past+n-1: row t holds the logits
 * after position past + t, which score the prompt token at past + t + 1.  A re-run of
 * the same chunk after a preemption writes the same values again. */
static tsr_status gather_prompt_lp(tsr_engine *e, slot *s, size_t past, size_t n, const float *rows) {
        size_t vocab = e->params.model->vocab;
        for (size_t t = 0; t < n && past + t + 1 < s->n_prompt; t++) {
                size_t pos = past + t + 1;
                tsr_status st = tsr_logprobs_gather(rows + t * vocab, vocab, s->tokens[pos], (uint32_t)s->prompt_logprobs,
                                                    &s->prompt_lp[pos - 1]);
                if (st != TSR_OK)
                        return st;
        }
        return TSR_OK;
}

/* Logits rows chunk `q` takes in the step's buffer (tsr_engine_model.forward). */
static tsr_status plan_reserve(step_plan *p, size_t cap) {
        if (cap <= p->cap)
                return TSR_OK;
        sched_entry *en = realloc(p->entries, cap * sizeof(*en));
        if (!en)
                return TSR_E_NOMEM;
        p->entries = en;
        tsr_engine_seq *sq = realloc(p->seqs, cap * sizeof(*sq));
        if (!sq)
                return TSR_E_NOMEM;
        p->seqs = sq;
        p->cap = cap;
        return TSR_OK;
}

static void plan_free(step_plan *p) {
        free(p->logits);
        free(p->gmask);
        free(p->entries);
        free(p->seqs);
        free(p->inputs);
        free(p->saves);
        memset(p, 0, sizeof(*p));
}

/* Waiting requests whose grammar compile has ended: a matcher for each compiled one, an
 * Error (and nothing else disturbed) for each refused one.  Engine thread. */
static void grammar_poll(tsr_engine *e) {
        for (size_t i = 0; i < e->waiting.n;) {
                slot *s = e->waiting.items[i];
                tsr_grammar_job_state js = s->gjob ? tsr_grammar_job_poll(s->gjob) : TSR_GRAMMAR_JOB_PENDING;
                if (js == TSR_GRAMMAR_JOB_READY && (s->gm = tsr_grammar_matcher_new(tsr_grammar_job_compiled(s->gjob)))) {
                        tsr_grammar_job_release(&s->gjob);
                        i++;
                        continue;
                }
                if (js == TSR_GRAMMAR_JOB_PENDING) {
                        i++;
                        continue;
                }
                log_req(TSR_LOG_INFO, s->request_id, "structured output refused: %s",
                        js == TSR_GRAMMAR_JOB_FAILED ? tsr_grammar_job_error(s->gjob) : "out of memory");
                if (js == TSR_GRAMMAR_JOB_FAILED)
                        send_error(e, s->router_id, s->router_id_len, s->request_id, TSR_ENGINE_ERROR_INVALID, false,
                                   "Invalid structured output: %s", tsr_grammar_job_error(s->gjob));
                else
                        send_error(e, s->router_id, s->router_id_len, s->request_id, TSR_ENGINE_ERROR_UNAVAILABLE,
                                   true, "worker out of memory");
                list_remove_at(&e->waiting, i);
                slot_free(e, s);
        }
}

/* Whether the model has a new KV incarnation to install (tsr_engine_model.kv_renewal_pending). */
static bool kv_renewal_pending(const tsr_engine *e) {
        const tsr_engine_model *m = e->params.model;
        return m && m->kv_generation && (!m->kv_renewal_pending || m->kv_renewal_pending(m->ud));
}

/* schedule() into `p`.  `quiet`: no step is in flight, so the model may install a new
 * KV incarnation (kv_generation) first.  Engine thread. */
static void schedule_plan(tsr_engine *e, step_plan *p, bool quiet) {
        const tsr_engine_model *m = e->params.model;
        size_t cap;
        grammar_poll(e);
        /* The model's KV memory was lost and made anew (a restarted pipeline node): no
         * cached block holds what its hash says any more. */
        if (quiet && m && m->kv_generation) {
                uint64_t g = m->kv_generation(m->ud);
                if (g != e->kv_generation) {
                        if (e->kv_generation && e->kv && e->params.enable_prefix_caching)
                                log_info("the model's KV memory was made anew (generation %llu): prefix cache reset",
                                         (unsigned long long)g);
                        if (e->kv && e->params.enable_prefix_caching)
                                tsr_kv_cache_reset_prefix_cache(e->kv);
                        if (states_cached(e))
                                tsr_state_reset(e->states);
                        e->kv_generation = g;
                }
        }
        cap = e->running.n + e->waiting.n;
        p->n = 0;
        p->st = TSR_OK;
        if (plan_reserve(p, cap ? cap : 1) != TSR_OK)
                return;   /* nothing scheduled: the requests wait for the next round */
        p->n = schedule(e, p->entries, cap);
        if (states_cached(e))
                plan_saves(e, p);
}

/* Just before the step runs (the step before it applied): drop the entries the step
 * before made moot (its request finished, or was preempted since), and copy every
 * chunk's tokens (placeholders are real tokens by now) and block table for the
 * forward; each request kept counts the step in its n_in_flight.  Engine thread. */
static void prepare_plan(tsr_engine *e, step_plan *p) {
        size_t kept = 0, need = 0, used = 0;
        p->st = TSR_OK;
        p->n_want = 0;
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                slot *s = pe->s;
                if (s->finish || s->epoch != pe->epoch) {
                        state_saves_done(e, p, pe, false);
                        continue;   /* its token of the step before was its last, or it was preempted */
                }
                /* its chunk follows the ones not yet applied (micro-batches), if any */
                size_t before = s->n_ahead - pe->num_new;
                if (pe->past != s->kv.n_computed + before || pe->past + pe->num_new > s->n_tokens) {
                        log_req(TSR_LOG_ERROR, s->request_id, "scheduled chunk no longer fits (%zu+%zu, computed %zu, "
                                "known %zu): rescheduled", pe->past, pe->num_new, s->kv.n_computed, s->n_tokens);
                        s->n_ahead -= pe->num_new;
                        if (pe->will_sample)
                                s->n_placeholders--;
                        state_saves_done(e, p, pe, false);
                        continue;
                }
                p->entries[kept++] = *pe;
                s->n_in_flight++;   /* the step runs next: apply_plan counts it back */
                need += pe->num_new + (size_t)s->kv.n_blocks * tsr_kv_cache_tables(e->kv);
        }
        p->n = kept;
        if (need > p->inputs_cap) {
                uint32_t *g = realloc(p->inputs, need * sizeof(uint32_t));
                if (!g) {
                        p->st = TSR_E_NOMEM;
                        return;
                }
                p->inputs = g;
                p->inputs_cap = need;
        }
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                slot *s = pe->s;
                uint32_t *toks = p->inputs + used, *table = toks + pe->num_new;
                memcpy(toks, s->tokens + pe->past, pe->num_new * sizeof(uint32_t));
                used += pe->num_new + tsr_kv_req_table(e->kv, &s->kv, table);
                p->seqs[i] = (tsr_engine_seq){
                        .block_table = table,
                        .n_table = s->kv.n_blocks,
                        .tokens = toks,
                        .n = pe->num_new,
                        .past_len = pe->past,
                        .want_logits = pe->past + pe->num_new == s->n_tokens,
                        .want_all_logits = wants_prompt_lp(s, pe->past),
                        .state_slot = s->state_slot,
                        .restore_state = pe->restore_state,
                        .restore_from = pe->restore_from,
                        .saves = p->saves + pe->save_first,
                        .n_saves = pe->n_saves,
                        .prompt_len = (uint32_t)s->n_prompt,
                        .seq_id = s->seq,
                };
                p->n_want += tsr_engine_seq_rows(&p->seqs[i]);
        }
}

/* Whether the structured output applies to the token after output[0..n_output): always
 * without a reasoning end token, else once that token has been generated.  A step
 * dropped under --async-scheduling takes back output tokens, the end token too. */
static bool grammar_active(slot *s, const uint32_t *output, size_t n_output) {
        if (s->reasoning_end < 0)
                return true;
        if (s->grammar_from != SIZE_MAX && s->grammar_from > n_output)
                s->grammar_from = SIZE_MAX;
        if (s->reasoning_scanned > n_output)
                s->reasoning_scanned = n_output;
        for (; s->grammar_from == SIZE_MAX && s->reasoning_scanned < n_output; s->reasoning_scanned++)
                if (output[s->reasoning_scanned] == (uint32_t)s->reasoning_end)
                        s->grammar_from = s->reasoning_scanned + 1;
        return s->grammar_from != SIZE_MAX;
}

/* Structured output, before sampling: bring the matcher to the request's n_output tokens
 * after grammar_from (a step it accepted a token in may have been dropped: a preemption
 * during --async-scheduling) and fill `mask` with the allowed tokens; execute_plan sets
 * the others' logits to -inf, so the sampler (seeds, penalties, logprobs) runs on as
 * usual.  *end: the grammar allows nothing but the end (a stop token) while the request
 * may not stop by one now (ignore_eos, min_tokens): it ends here, finish "stop".  The
 * mask thread (execute_plan's helper), or execute_plan's thread without one. */
static tsr_status grammar_fill(const tsr_engine *e, slot *s, uint32_t *mask, size_t n_output, bool *end) {
        size_t vocab = e->params.model->vocab, accepted = tsr_grammar_n_accepted(s->gm);
        size_t n_constrained = n_output - s->grammar_from;
        tsr_status st;
        *end = false;
        if (accepted > n_constrained && (st = tsr_grammar_rollback(s->gm, accepted - n_constrained)) != TSR_OK)
                return st;
        if (tsr_grammar_terminated(s->gm)) {
                *end = true;
                return TSR_OK;
        }
        if ((st = tsr_grammar_fill_mask(s->gm, mask, vocab)) != TSR_OK)
                return st;
        if ((s->ignore_eos || n_output < s->sampling.min_tokens) &&
            tsr_grammar_mask_only(mask, vocab, e->params.eos_ids, e->params.n_eos_ids))
                *end = true;
        return TSR_OK;
}

/* Where plan p's mask rows live: its own (a queued step whose masks were filled before
 * it went in, masks_first) or the engine's. */
static uint32_t *masks_of(const tsr_engine *e, const step_plan *p) { return p->own_masks ? p->gmask : e->gmask; }

/* Every constrained entry's mask of plan p (the mask thread's job, or before the forward
 * with masks_first). */
static void fill_masks(tsr_engine *e, step_plan *p) {
        size_t words = tsr_grammar_mask_words(e->params.model->vocab);
        uint32_t *masks = masks_of(e, p);
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                if (pe->constrained)
                        pe->mask_st = grammar_fill(e, pe->s, masks + (size_t)pe->mask_row * words, pe->n_output,
                                                   &pe->grammar_end);
        }
}

/* ------------------------------------------------------------------ job threads */

static void *job_thread_main(void *arg) {
        job_thread *t = arg;
        tsr_log_set_thread(t->name);
        pthread_mutex_lock(&t->mu);
        for (;;) {
                step_plan *job;
                while (!t->job && !t->quit)
                        pthread_cond_wait(&t->cv, &t->mu);
                if (!t->job)
                        break;   /* quit, nothing left to run */
                job = t->job;
                pthread_mutex_unlock(&t->mu);
                t->run(t->e, job);
                pthread_mutex_lock(&t->mu);
                t->job = NULL;
                t->done = true;
                pthread_cond_broadcast(&t->cv);
        }
        pthread_mutex_unlock(&t->mu);
        return NULL;
}

static bool job_thread_start(job_thread *t, tsr_engine *e, const char *name,
                             void (*run)(tsr_engine *e, step_plan *p)) {
        t->e = e;
        t->run = run;
        t->name = name;
        if (pthread_mutex_init(&t->mu, NULL) != 0)
                return false;
        if (pthread_cond_init(&t->cv, NULL) != 0) {
                pthread_mutex_destroy(&t->mu);
                return false;
        }
        if (pthread_create(&t->thread, NULL, job_thread_main, t) != 0) {
                pthread_cond_destroy(&t->cv);
                pthread_mutex_destroy(&t->mu);
                return false;
        }
        t->up = true;
        return true;
}

/* Run p on t; without the thread, here and now. */
static void job_launch(job_thread *t, step_plan *p) {
        if (!t->up) {
                t->run(t->e, p);
                return;
        }
        pthread_mutex_lock(&t->mu);
        t->job = p;
        t->done = false;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
}

static void job_wait(job_thread *t) {
        if (!t->up)
                return;
        pthread_mutex_lock(&t->mu);
        while (!t->done)
                pthread_cond_wait(&t->cv, &t->mu);
        pthread_mutex_unlock(&t->mu);
}

static void job_thread_stop(job_thread *t) {
        if (!t->up)
                return;
        pthread_mutex_lock(&t->mu);
        t->quit = true;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
        pthread_cond_destroy(&t->cv);
        pthread_mutex_destroy(&t->mu);
        t->up = false;
}

/* Mark p's entries that sample under a grammar (their output is past the reasoning)
 * and give each a mask row; false: no memory for the rows. */
static bool plan_masks(tsr_engine *e, step_plan *p, size_t *n_masks) {
        size_t words, n = 0, *have = p->own_masks ? &p->gmask_rows : &e->gmask_rows;
        uint32_t **rows = p->own_masks ? &p->gmask : &e->gmask;
        *n_masks = 0;
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                slot *s = pe->s;
                pe->constrained = false;
                if (!s->gm || !p->seqs[i].want_logits)
                        continue;
                pe->n_output = s->n_tokens - s->n_prompt;
                if (!grammar_active(s, s->tokens + s->n_prompt, pe->n_output))
                        continue;
                pe->constrained = true;
                pe->mask_row = (uint32_t)n++;
                pe->mask_st = TSR_OK;
        }
        if (n > *have) {
                words = tsr_grammar_mask_words(e->params.model->vocab);
                uint32_t *g = realloc(*rows, n * words * sizeof(uint32_t));
                if (!g)
                        return false;
                *rows = g;
                *have = n;
        }
        *n_masks = n;
        return true;
}

/* The chunks whose token needs nothing of the row but the token (tsr_sampling_device_ok,
 * and no grammar mask): the model may give the token instead of the row (a device then
 * reads back 4 bytes, not the vocabulary's floats): the argmax of a greedy one, else a
 * draw with the request's parameters and the uniform tsr_sample would use at this
 * position (the request's Philox stream: a seed gives the same tokens again).  To a model
 * that answers logprobs (answers_logprobs) also the rows of requests that asked for
 * logprobs and nothing else of the row; to one that answers rules (answers_rules) also
 * those with a logit bias, min_tokens' mask or penalties (tsr_engine_seq.rules; with
 * penalties the request's tokens, while fewer than the vocabulary), with their logprobs
 * where it answers those.  To one that answers masks (answers_masks) also the rows under
 * a grammar whose mask was filled before the forward (masks_first; not one the grammar
 * ends at, nor one whose fill failed), with the mask.  After plan_masks (and, with
 * masks_first, fill_masks): it needs the entries' constrained flags and masks. */
static void plan_device_tokens(const tsr_engine *e, step_plan *p, bool queued) {
        const tsr_engine_model *m = e->params.model;
        bool answers_logprobs = m->answers_logprobs;
        size_t words = tsr_grammar_mask_words(m->vocab);
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                tsr_engine_seq *q = &p->seqs[i];
                const slot *s = pe->s;
                size_t n_output = s->n_tokens - s->n_prompt;
                const tsr_sampling *sp = &s->sampling;
                /* a prompt-logprobs chunk: the model that answers logprobs answers its
                 * prompt rows' too (execute_plan then gathers none of them) */
                bool plp = q->want_all_logits && answers_logprobs && q->past_len + 1 < s->n_prompt;
                q->prompt_lp = plp ? s->prompt_lp + q->past_len : NULL;
                q->prompt_lp_top = plp ? (uint32_t)s->prompt_logprobs : 0;
                q->next_token = plp && q->past_len + q->n < s->n_prompt ? s->tokens[q->past_len + q->n] : 0;
                pe->dev_token = TSR_ENGINE_TOKEN_UNSET;
                q->token = NULL;
                q->draw = NULL;
                q->lp = NULL;
                q->rules = NULL;
                q->rules_mask_eos = false;
                q->history = NULL;
                q->n_history = 0;
                q->grammar_mask = NULL;
                q->grammar_mask_words = 0;
                bool with_lp = sp->logprobs >= 0;
                bool masked = pe->constrained && p->masks_first && pe->mask_st == TSR_OK && !pe->grammar_end;
                bool plain = tsr_sampling_token_and_logprobs_ok(sp, n_output);
                bool history = !tsr_sampling_history_free(sp);
                bool rules = !plain && m->answers_rules && (!history || s->n_tokens < m->vocab);
                /* s->gm: a queued step (micro-batches) plans its masks after its wait
                 * unless the model answers them, so pe->constrained is not known yet; a
                 * request under a grammar never offers its token then */
                if (!q->want_logits || q->want_all_logits || (pe->constrained && !masked) ||
                    (queued && s->gm && !m->answers_masks) ||
                    (!plain && !rules) || (with_lp && !answers_logprobs))
                        continue;
                q->token = &pe->dev_token;
                if (masked) {
                        q->grammar_mask = masks_of(e, p) + (size_t)pe->mask_row * words;
                        q->grammar_mask_words = (uint32_t)words;
                }
                if (rules) {
                        q->rules = sp;
                        q->rules_mask_eos = n_output < sp->min_tokens;
                        q->history = history ? s->tokens : NULL;
                        q->n_history = history ? (uint32_t)s->n_tokens : 0;
                }
                if (with_lp) {
                        q->lp = &pe->dev_lp;
                        q->lp_top = (uint32_t)sp->logprobs;
                }
                if (sp->temperature < TSR_SAMPLER_GREEDY_EPS)
                        continue;       /* the argmax */
                pe->draw = (tsr_draw){.temperature = sp->temperature, .top_k = sp->top_k, .top_p = sp->top_p,
                                      .min_p = sp->min_p, .u = tsr_sampler_uniform(s->rng_key, n_output)};
                q->draw = &pe->draw;
        }
}

/* tsr_sample for p's entries [from, to) that have a row to sample (sample_logits), with
 * `scratch`; results in the entries.  Reads each entry's slot (its sampling parameters,
 * tokens and key) and writes only the entry: the two halves run at once. */
static void sample_range(tsr_engine *e, step_plan *p, size_t from, size_t to, float *scratch) {
        size_t vocab = e->params.model->vocab;
        for (size_t i = from; i < to; i++) {
                sched_entry *pe = &p->entries[i];
                const slot *s = pe->s;
                if (!pe->sample_logits)
                        continue;
                tsr_sample_history h = {
                        .prompt = s->tokens,
                        .n_prompt = s->n_prompt,
                        .output = s->tokens + s->n_prompt,
                        .n_output = s->n_tokens - s->n_prompt,
                };
                pe->st = tsr_sample(&s->sampling, &h, s->rng_key, pe->sample_logits, vocab, scratch, &pe->sample);
        }
}

/* The "sample" thread's half (job_thread run). */
static void sample_rows(tsr_engine *e, step_plan *p) { sample_range(e, p, p->sample_from, p->n, e->scratch2); }

/* The step's forward, then for each chunk its prompt logprobs (seq->want_all_logits:
 * a row per token) and, where the chunk reached the end of the known tokens, a token
 * sampled from its last row.  Results go to the entries; the slots are only read (the
 * sampler's history), except prompt_lp rows no one else touches until the request's
 * first Output.  In two halves: execute_begin runs the forward (`queued`: submits it,
 * with micro-batches), execute_end samples (after the queued step's wait).  The step
 * thread with --async-scheduling, else the engine thread. */
/* The step's logits rows and their count: the plan's own with micro-batches (several
 * steps in flight), else the engine's. */
static float **logits_of(tsr_engine *e, step_plan *p, bool queued, size_t **rows) {
        *rows = queued ? &p->logits_rows : &e->logits_rows;
        return queued ? &p->logits : &e->logits;
}

static void execute_begin(tsr_engine *e, step_plan *p, bool queued) {
        const tsr_engine_model *m = e->params.model;
        size_t *logits_rows;
        float **logits = logits_of(e, p, queued, &logits_rows);
        p->t0 = tsr_now_ns();
        p->compute_ns = 0;
        p->submitted = false;
        p->n_masks = 0;
        p->masks_first = false;
        /* a request is never in two steps at once, so a queued step's matchers are
         * current when it goes in: it may plan (and fill) its masks then */
        p->own_masks = queued && m->answers_masks;
        if (p->n == 0)
                return;
        p->prefill_tokens = 0;
        p->n_decode = 0;
        for (size_t i = 0; i < p->n; i++) {
                if (tsr_engine_seq_is_decode(&p->seqs[i]))
                        p->n_decode++;
                else
                        p->prefill_tokens += p->seqs[i].n;
        }
        if (p->st == TSR_OK && p->n_want > *logits_rows) {
                float *g = realloc(*logits, p->n_want * m->vocab * sizeof(float));
                if (g) {
                        *logits = g;
                        *logits_rows = p->n_want;
                } else {
                        p->st = TSR_E_NOMEM;
                }
        }
        /* The masks are filled while the forward runs; a queued step's after its wait
         * (the mask thread serves one step at a time).  A model that answers masks (a
         * replica over nodes, whose last node samples) gets them with the step, so they
         * are planned and filled first, a queued step's too (in its own rows), as vLLM's
         * scheduler once built its bitmask before dispatching the step: the mask costs
         * the step its fill time, the row (vocab x 4 bytes) no longer crosses. */
        if ((!queued || m->answers_masks) && p->st == TSR_OK && !plan_masks(e, p, &p->n_masks))
                p->st = TSR_E_NOMEM;
        p->masks_first = p->n_masks && m->answers_masks;
        if (p->masks_first)
                fill_masks(e, p);
        else if (p->n_masks)
                job_launch(&e->mask_thread, p);
        if (p->st == TSR_OK) {
                plan_device_tokens(e, p, queued);
                if (queued)
                        p->submitted = (p->st = m->submit(m->ud, p->seqs, p->n, *logits)) == TSR_OK;
                else
                        p->st = m->forward(m->ud, p->seqs, p->n, *logits);
        }
}

static void execute_end(tsr_engine *e, step_plan *p, bool queued) {
        const tsr_engine_model *m = e->params.model;
        float *logits_buf = queued ? p->logits : e->logits;
        if (p->n == 0)
                return;
        if (p->submitted) {
                p->st = m->wait(m->ud);
                p->submitted = false;
        }
        if (queued && p->st == TSR_OK && !m->answers_masks) {
                if (!plan_masks(e, p, &p->n_masks))
                        p->st = TSR_E_NOMEM;
                else if (p->n_masks)
                        job_launch(&e->mask_thread, p);
        }
        size_t n_masks = p->n_masks;
        if (n_masks && !p->masks_first)
                job_wait(&e->mask_thread);
        /* 1. Prompt logprobs, grammar masks, and which rows to sample (in order). */
        size_t n_sample = 0;
        for (size_t i = 0, row = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                const tsr_engine_seq *q = &p->seqs[i];
                slot *s = pe->s;
                float *rows = logits_buf + row * m->vocab, *logits;
                row += tsr_engine_seq_rows(q);
                bool constrained = n_masks && pe->constrained;
                pe->sampled = false;
                pe->has_lp = false;
                pe->sample_logits = NULL;
                pe->token_taken = false;
                if (!constrained)
                        pe->grammar_end = false;   /* the others': their fill's */
                if ((pe->st = p->st) != TSR_OK)
                        continue;
                if (q->want_all_logits && !q->prompt_lp &&
                    (pe->st = gather_prompt_lp(e, s, q->past_len, q->n, rows)) != TSR_OK)
                        continue;
                if (!q->want_logits)
                        continue;   /* a prefill chunk: nothing to sample */
                if (q->token && pe->dev_token != TSR_ENGINE_TOKEN_UNSET) {         /* the model's token */
                        if (pe->dev_token >= m->vocab)
                                pe->st = TSR_E_INVAL;   /* no maximum: tsr_sample's answer to such a row */
                        pe->sample = (tsr_sample_result){.token = pe->dev_token};
                        if (q->lp && pe->st == TSR_OK) {
                                pe->sample.has_logprobs = true;
                                pe->sample.lp = pe->dev_lp;
                        }
                        pe->token_taken = true;
                        continue;
                }
                logits = q->want_all_logits ? rows + (q->n - 1) * m->vocab : rows;
                if (constrained && (pe->st = pe->mask_st) != TSR_OK)
                        continue;
                if (pe->grammar_end)
                        continue;   /* complete: nothing more to sample */
                if (constrained)
                        tsr_grammar_apply_mask(logits, m->vocab,
                                               masks_of(e, p) + (size_t)pe->mask_row * tsr_grammar_mask_words(m->vocab));
                pe->sample_logits = logits;
                n_sample++;
        }
        /* 2. The draws: the later half of the rows on the "sample" thread (a step of
         * several), the rest here; each entry's result its own. */
        p->sample_from = p->n;
        if (n_sample >= 2 && e->sample_thread.up) {
                for (size_t i = 0, k = 0; i < p->n; i++)
                        if (p->entries[i].sample_logits && k++ == n_sample / 2) {
                                p->sample_from = i;
                                break;
                        }
                job_launch(&e->sample_thread, p);
        }
        sample_range(e, p, 0, p->sample_from, e->scratch);
        if (p->sample_from < p->n)
                job_wait(&e->sample_thread);
        /* 3. In order: the grammars advance, the results are taken. */
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                slot *s = pe->s;
                bool constrained = n_masks && pe->constrained;
                if ((!pe->sample_logits && !pe->token_taken) || pe->st != TSR_OK)
                        continue;
                if (constrained && (pe->st = tsr_grammar_accept(s->gm, pe->sample.token)) != TSR_OK)
                        continue;   /* cannot happen: the mask allowed it */
                pe->grammar_end = constrained && tsr_grammar_terminated(s->gm);
                pe->sampled = true;
                pe->token = pe->sample.token;
                pe->has_lp = pe->sample.has_logprobs;
                if (pe->sample.has_logprobs)
                        pe->lp = pe->sample.lp;
        }
        /* A prompt-logprobs step may have grown the buffer to max_lp_rows rows: give the
         * memory back once the steps that need it are over. */
        size_t *logits_rows;
        float **logits = logits_of(e, p, queued, &logits_rows);
        if (*logits_rows > e->params.max_num_seqs && p->n_want <= e->params.max_num_seqs) {
                size_t keep = e->params.max_num_seqs ? e->params.max_num_seqs : 1;
                float *g = realloc(*logits, keep * m->vocab * sizeof(float));
                if (g) {
                        *logits = g;
                        *logits_rows = keep;
                }
        }
        /* With steps in flight (micro-batches) a step submitted before the previous one
         * ended overlaps it: what it adds is the time since that end, the pipeline's
         * interval between steps, not its own latency through every stage.  One step at
         * a time: since its submit, as the previous one had ended. */
        uint64_t now = tsr_now_ns();
        p->compute_ns = now - (p->t0 > e->last_step_end_ns ? p->t0 : e->last_step_end_ns);
        e->last_step_end_ns = now;
}

static void execute_plan(tsr_engine *e, step_plan *p) {
        execute_begin(e, p, false);
        execute_end(e, p, false);
}

/* A step that failed for the replica's sake, not the request's: a pipeline stage or
 * node gone, aborted or past its deadline, or a replica not up (nodes.h). */
static bool replica_failure(tsr_status st) {
        return st == TSR_E_CLOSED || st == TSR_E_CANCELLED || st == TSR_E_TIMEOUT || st == TSR_E_UNAVAILABLE;
}

/* The step's results into the slots: store each chunk's KV in the prefix cache, append
 * the sampled tokens, check stops.  Entries of requests preempted or aborted while the
 * step ran are dropped (an aborted request is freed here: the step thread is done with it).
 * Engine thread. */
static void apply_plan(tsr_engine *e, step_plan *p) {
        size_t kept = 0;
        step_timing_update(e, p);
        for (size_t i = 0; i < p->n; i++) {
                sched_entry *pe = &p->entries[i];
                slot *s = pe->s;
                tsr_status st = pe->st;
                s->n_in_flight--;
                if (s->aborted || s->epoch != pe->epoch) {
                        state_saves_done(e, p, pe, false);
                        if (s->aborted && !s->n_in_flight)
                                slot_free(e, s);
                        continue;
                }
                s->step_has_token = false;
                s->step_has_lp = false;
                s->n_ahead -= pe->num_new;
                if (pe->will_sample)
                        s->n_placeholders--;
                if (st == TSR_OK)
                        st = tsr_kv_cache_commit(e->kv, &s->kv, s->tokens, pe->past + pe->num_new);
                state_saves_done(e, p, pe, st == TSR_OK);
                if (st == TSR_OK && pe->sampled) {
                        s->tokens[s->n_tokens++] = pe->token;
                        s->step_new[0] = pe->token;
                        s->step_has_token = true;
                        s->step_has_lp = pe->has_lp;
                        if (pe->has_lp)
                                s->step_lp = pe->lp;
                        if (!s->first_token_ns)
                                s->first_token_ns = tsr_now_ns();
                        e->stats.generation_tokens_total++;
                        if (s->n_tokens - s->n_prompt == 1)
                                e->stats.prompt_tokens_total += s->n_prompt;
                        check_stop(e, s, pe->token);
                }
                /* The grammar is complete (vLLM: the matcher terminated): the request stops. */
                if (st == TSR_OK && pe->grammar_end && !s->finish)
                        s->finish = TSR_ENGINE_FINISH_STOP;
                if (st != TSR_OK && replica_failure(st) && s->n_tokens == s->n_prompt) {
                        log_req(TSR_LOG_WARN, s->request_id, "the step failed (%s) before this request's first token: "
                                "handed back to its router", tsr_status_str(st));
                        send_error(e, s->router_id, s->router_id_len, s->request_id, TSR_ENGINE_ERROR_UNAVAILABLE,
                                   true, "the worker's replica failed (%s) before this request produced a token",
                                   tsr_status_str(st));
                        s->handed_back = true;
                        s->finish = TSR_ENGINE_FINISH_ERROR;
                } else if (st != TSR_OK) {
                        log_req(TSR_LOG_ERROR, s->request_id, "forward or sampling failed (%s): finishing it with an error",
                                tsr_status_str(st));
                        s->finish = TSR_ENGINE_FINISH_ERROR;
                }
                p->entries[kept++] = *pe;
        }
        p->n = kept;
}

/* One Output per router with every request of it that produced a token or finished.
 * Engine thread (with --async-scheduling while the step thread computes the next step). */
static void emit_outputs(tsr_engine *e, const sched_entry *plan, size_t n_plan, uint64_t step) {
        bool *done = calloc(n_plan ? n_plan : 1, sizeof(bool));
        if (!done)
                return;
        for (size_t i = 0; i < n_plan; i++) {
                slot *lead = plan[i].s;
                size_t count = 0;
                tsr_engine_out *out;
                if (done[i])
                        continue;
                for (size_t k = i; k < n_plan; k++) {
                        slot *s = plan[k].s;
                        if (!done[k] && s->router_id_len == lead->router_id_len &&
                            memcmp(s->router_id, lead->router_id, lead->router_id_len) == 0 &&
                            (s->step_has_token || s->finish) && !s->handed_back)
                                count++;
                }
                if (count == 0) {
                        done[i] = true;
                        continue;
                }
                out = calloc(1, sizeof(*out));
                if (out)
                        out->outputs = calloc(count, sizeof(*out->outputs));
                if (!out || !out->outputs) {
                        tsr_engine_out_free(out);
                        break;
                }
                out->kind = TSR_ENGINE_OUT_OUTPUT;
                out->step = step;
                memcpy(out->router_id, lead->router_id, lead->router_id_len);
                out->router_id_len = lead->router_id_len;
                for (size_t k = i; k < n_plan; k++) {
                        slot *s = plan[k].s;
                        tsr_engine_req_output *o;
                        if (done[k] || s->router_id_len != lead->router_id_len ||
                            memcmp(s->router_id, lead->router_id, lead->router_id_len) != 0)
                                continue;
                        done[k] = true;
                        if ((!s->step_has_token && !s->finish) || s->handed_back)
                                continue;
                        o = &out->outputs[out->n_outputs++];
                        snprintf(o->request_id, sizeof(o->request_id), "%s", s->request_id);
                        if (s->step_has_token) {
                                o->new_tokens = malloc(sizeof(uint32_t));
                                if (o->new_tokens) {
                                        o->new_tokens[0] = s->step_new[0];
                                        o->n_new = 1;
                                }
                                if (s->step_has_lp && (o->logprobs = malloc(sizeof(*o->logprobs))))
                                        o->logprobs[0] = s->step_lp;
                        }
                        o->finish = s->finish;
                        o->has_stop_token_id = s->has_stop_token_id;
                        o->stop_token_id = s->stop_token_id;
                        o->num_generated = (uint32_t)(s->n_tokens - s->n_prompt);
                        if (!s->reported_prompt) {
                                o->num_prompt_tokens = (uint32_t)s->n_prompt;
                                o->num_cached_tokens = (uint32_t)s->num_cached_tokens;
                                s->reported_prompt = true;
                                /* The Output owns them now; the slot never needs them again. */
                                if (s->prompt_lp) {
                                        o->prompt_logprobs = s->prompt_lp;
                                        o->n_prompt_logprobs = (uint32_t)(s->n_prompt - 1);
                                        s->prompt_lp = NULL;
                                }
                        }
                        if (s->finish) {
                                uint64_t now = tsr_now_ns();
                                o->queued_ns = s->first_scheduled_ns - s->arrival_ns;
                                o->prefill_ns = s->first_token_ns ? s->first_token_ns - s->first_scheduled_ns : 0;
                                o->decode_ns = s->first_token_ns ? now - s->first_token_ns : 0;
                                o->num_preemptions = s->num_preemptions;
                        }
                }
                push_out(e, out);
        }
        free(done);
}

/* After a step's Outputs: free the requests that finished in it. */
static void retire_finished(tsr_engine *e, const step_plan *p) {
        for (size_t i = 0; i < p->n; i++) {
                slot *s = p->entries[i].s;
                if (!s->finish)
                        continue;
                list_remove(&e->running, s);
                /* a prompt's later chunk still in the model (a failed step finishes a
                 * request mid-prompt): that step frees it when it returns */
                if (s->n_in_flight)
                        s->aborted = true;
                else
                        slot_free(e, s);
        }
}

/* One synchronous step (no --async-scheduling): schedule, run, sample, emit. */
static void step(tsr_engine *e) {
        step_plan *p = &e->plans[0];
        schedule_plan(e, p, true);
        p->step = ++e->step;
        prepare_plan(e, p);
        execute_plan(e, p);
        apply_plan(e, p);
        emit_outputs(e, p->entries, p->n, p->step);
        retire_finished(e, p);
}

/* ------------------------------------------------------------------ shutdown */

/* The shutdown deadline has come (or nothing is left to run): end every request
 * still here.  One that already streamed tokens cannot move to another worker, so it
 * ends with finish ABORT; one that did not is handed back with a retryable Error, and
 * its router resubmits it elsewhere.  Then tell the io thread it may close. */
static void finish_shutdown(tsr_engine *e) {
        size_t n = e->running.n + e->waiting.n, n_plan = 0, n_retry = 0;
        sched_entry *plan = calloc(n ? n : 1, sizeof(*plan));
        slot_list *lists[2] = {&e->running, &e->waiting};
        tsr_engine_out *out;

        for (int li = 0; li < 2; li++)
                for (size_t i = 0; i < lists[li]->n; i++) {
                        slot *s = lists[li]->items[i];
                        s->step_has_token = false;
                        if (s->n_tokens > s->n_prompt && plan) {
                                s->finish = TSR_ENGINE_FINISH_ABORT;
                                plan[n_plan++].s = s;
                        } else {
                                send_error(e, s->router_id, s->router_id_len, s->request_id,
                                           TSR_ENGINE_ERROR_UNAVAILABLE, true,
                                           "worker shut down before this request produced a token");
                                n_retry++;
                        }
                }
        if (n_plan)
                emit_outputs(e, plan, n_plan, e->step);
        free(plan);
        for (int li = 0; li < 2; li++) {
                for (size_t i = 0; i < lists[li]->n; i++)
                        slot_free(e, lists[li]->items[i]);
                lists[li]->n = 0;
        }
        if (n)
                log_info("shutdown timeout: %zu request(s) aborted after their first tokens, %zu handed back "
                         "for a retry elsewhere", n_plan, n_retry);
        else
                log_info("shutdown: every request finished");
        e->shutdown_done = true;
        publish_stats(e, true);
        out = calloc(1, sizeof(*out));
        if (out) {
                out->kind = TSR_ENGINE_OUT_STOPPED;
                push_out(e, out);
        }
}

/* ------------------------------------------------------------------ thread */

/* True once SIGTERM's deadline has come or nothing is left to run. */
static bool shutdown_due(const tsr_engine *e) {
        return e->shutting_down && !e->shutdown_done &&
               ((e->running.n == 0 && e->waiting.n == 0) || tsr_now_ns() >= e->shutdown_deadline_ns);
}

static void loop_sync(tsr_engine *e) {
        while (!e->stopping) {
                bool idle = e->running.n == 0 && e->waiting.n == 0;
                take_inbox(e, idle && (!e->shutting_down || e->shutdown_done));
                if (e->stopping)
                        break;
                /* Between steps: the deadline is checked once per step (a step is short). */
                if (shutdown_due(e))
                        finish_shutdown(e);
                if (e->running.n || e->waiting.n)
                        step(e);
                publish_stats(e, false);
        }
}

/* --async-scheduling: wait for the step thread's step *inflight, apply it and return
 * it; *inflight becomes NULL. */
static step_plan *land_step(tsr_engine *e, step_plan **inflight) {
        step_plan *p = *inflight;
        job_wait(&e->step_thread);
        apply_plan(e, p);
        *inflight = NULL;
        return p;
}

/* --async-scheduling: step N's forward and sampling run on the step thread while
 * this thread emits step N-1's Outputs, frees what finished in it, publishes stats,
 * takes the inbox and schedules step N+1 against placeholders for N's tokens.  When N
 * returns its results are applied (tokens appended, stops checked), the entries of
 * N+1 that N made moot are dropped, and N+1 starts at once.  Same tokens as the
 * synchronous loop: a chunk reads only tokens known when it starts, and a request
 * that finished in N never runs in N+1. */
static void loop_async(tsr_engine *e) {
        step_plan *inflight = NULL, *ready = NULL;
        while (!e->stopping) {
                step_plan *next;
                if (ready) {
                        emit_outputs(e, ready->entries, ready->n, ready->step);
                        retire_finished(e, ready);
                        ready = NULL;
                }
                publish_stats(e, false);
                bool idle = !inflight && e->running.n == 0 && e->waiting.n == 0;
                take_inbox(e, idle && (!e->shutting_down || e->shutdown_done));
                if (e->stopping)
                        break;
                if (shutdown_due(e)) {
                        if (inflight) {   /* let the running step end first: finish_shutdown frees every slot */
                                step_plan *done = land_step(e, &inflight);
                                emit_outputs(e, done->entries, done->n, done->step);
                                retire_finished(e, done);
                        }
                        finish_shutdown(e);
                }
                /* The model has a new KV incarnation to install (a pipeline node came
                 * back): it goes in only with no step in flight, so end that one first
                 * and schedule the next on the new one. */
                if (inflight && kv_renewal_pending(e))
                        ready = land_step(e, &inflight);
                step_plan *busy = inflight ? inflight : ready;   /* not to be overwritten */
                next = busy == &e->plans[0] ? &e->plans[1] : &e->plans[0];
                next->n = 0;
                if (e->running.n || e->waiting.n)
                        schedule_plan(e, next, !inflight);
                if (inflight)
                        ready = land_step(e, &inflight);
                prepare_plan(e, next);
                if (next->n) {
                        next->step = ++e->step;
                        job_launch(&e->step_thread, next);
                        inflight = next;
                }
        }
        if (inflight)     /* stopping: the step thread must be done with the slots before they are freed */
                land_step(e, &inflight);
}

/* Pipeline micro-batches (tsr_engine_model.submit; vLLM's batch queue): up to queue_cap
 * steps in the model at once.  While there is room, schedule a step of the requests not
 * waiting for a token in one and submit it (the model returns once its first stage is
 * done with it); when the queue is full or nothing more can go in, end the oldest (wait,
 * sample, apply, emit).  A request is in one step in flight at a time, except a prompt's chunks,
 * which follow each other in (schedule()): every stage runs the steps in submit order,
 * so a chunk's attention reads the KV its chunks before it wrote.  An aborted request
 * is freed when its last step in flight is applied, a preempted one's results dropped
 * (their epoch), and a step's blocks reused only by steps submitted after it, which
 * every stage runs after it. */
static void loop_queue(tsr_engine *e) {
        size_t head = 0, n_q = 0;
        bool overlapped = false;
        while (!e->stopping) {
                bool idle = n_q == 0 && e->running.n == 0 && e->waiting.n == 0;
                publish_stats(e, false);
                take_inbox(e, idle && (!e->shutting_down || e->shutdown_done));
                if (e->stopping)
                        break;
                /* shutdown (finish_shutdown frees every slot) and a new KV incarnation
                 * (installed with nothing in flight) wait for every step in the model */
                bool drain = shutdown_due(e) || (n_q && kv_renewal_pending(e));
                bool submitted = false;
                if (!drain && n_q < e->queue_cap && (e->running.n || e->waiting.n)) {
                        step_plan *p = &e->queue[(head + n_q) % e->queue_cap];
                        p->n = 0;
                        schedule_plan(e, p, n_q == 0);
                        prepare_plan(e, p);
                        if (p->n) {
                                p->step = ++e->step;
                                execute_begin(e, p, true);
                                n_q++;
                                submitted = true;
                                if (n_q == 2 && !overlapped) {
                                        overlapped = true;
                                        log_info("pipeline micro-batches: 2 steps in flight at once (step %llu; "
                                                 "logged the first time)", (unsigned long long)p->step);
                                }
                        }
                }
                if (n_q && (drain || !submitted || n_q == e->queue_cap)) {
                        step_plan *p = &e->queue[head];
                        execute_end(e, p, true);
                        apply_plan(e, p);
                        emit_outputs(e, p->entries, p->n, p->step);
                        retire_finished(e, p);
                        head = (head + 1) % e->queue_cap;
                        n_q--;
                        continue;
                }
                if (shutdown_due(e))
                        finish_shutdown(e);
        }
        for (; n_q; n_q--, head = (head + 1) % e->queue_cap) {   /* stopping: the model must be done */
                execute_end(e, &e->queue[head], true);
                apply_plan(e, &e->queue[head]);
        }
}

static void *engine_main(void *arg) {
        tsr_engine *e = arg;
        bool async = false;

        tsr_log_set_thread("engine");
        if (e->params.model && !job_thread_start(&e->sample_thread, e, "sample", sample_rows))
                log_warn("cannot start the sample thread: a step's rows are sampled on one thread");
        if (e->params.model && e->params.grammar &&
            !job_thread_start(&e->mask_thread, e, "mask", fill_masks))
                log_warn("cannot start the mask thread: structured outputs' masks are filled before the forward");
        if (e->params.model && e->params.async_scheduling) {
                async = job_thread_start(&e->step_thread, e, "step", execute_plan);
                if (!async)
                        log_warn("cannot start the step thread: scheduling synchronously");
        }
        if (e->queue)
                log_info("pipeline micro-batches: up to %u steps in flight", e->queue_cap);
        else if (e->params.model && e->params.model->submit && async)
                log_info("pipeline micro-batches off: --async-scheduling runs one step at a time");
        if (e->params.model)
                log_info("engine up: %llu KV blocks of %u tokens, max_model_len %u, max_num_seqs %u, "
                         "max_num_batched_tokens %u, prefix caching %s, async scheduling %s",
                         (unsigned long long)e->params.kv_blocks_total, e->params.block_size, e->params.max_model_len,
                         e->params.max_num_seqs, e->params.max_num_batched_tokens,
                         e->params.enable_prefix_caching ? "on" : "off", async ? "on" : "off");
        else
                log_info("engine up without a model runner: Submits are refused");
        publish_stats(e, true);
        if (async)
                loop_async(e);
        else if (e->queue)
                loop_queue(e);
        else
                loop_sync(e);
        job_thread_stop(&e->step_thread);
        job_thread_stop(&e->mask_thread);
        job_thread_stop(&e->sample_thread);
        log_info("engine stopped (%zu running, %zu waiting dropped)", e->running.n, e->waiting.n);
        return NULL;
}

tsr_status tsr_engine_start(const tsr_engine_params *p, tsr_queue *inbox, tsr_queue *outbox, tsr_engine **ret) {
        tsr_engine *e = calloc(1, sizeof(*e));
        tsr_status st;
        if (!e)
                return TSR_E_NOMEM;
        e->params = *p;
        e->inbox = inbox;
        e->outbox = outbox;
        e->stats.max_num_seqs = p->max_num_seqs;
        e->stats.ready = p->model != NULL;
        if (p->state_slots && (st = tsr_state_cache_new(p->state_slots, &e->states)) != TSR_OK) {
                free(e);
                return st;
        }
        e->stats.state_slots_total = p->state_slots;
        e->stats.state_slots_free = p->state_slots;
        st = tsr_kv_cache_new((uint32_t)(p->kv_blocks_total ? p->kv_blocks_total : 1), p->block_size,
                              p->enable_prefix_caching, p->hash_algo, &e->kv);
        if (st == TSR_OK && p->n_kv_tables)
                st = tsr_kv_cache_set_tables(e->kv, p->kv_chunk, p->n_kv_tables);
        if (st != TSR_OK) {
                tsr_kv_cache_free(&e->kv);
                tsr_state_cache_free(&e->states);
                free(e);
                return st;
        }
        if (e->states && p->enable_prefix_caching)
                tsr_kv_cache_set_hit_check(e->kv, state_kept, e);
        if (p->model) {
                e->logits = malloc(p->model->vocab * sizeof(float));
                e->logits_rows = 1;
                /* 256 MiB of prompt-logprobs rows per step at most (a 128k vocabulary
                 * gives 512 positions a step), and at least one. */
                e->max_lp_rows = p->max_prompt_lp_rows ? p->max_prompt_lp_rows
                                                       : ((size_t)256 << 20) / sizeof(float) / p->model->vocab;
                if (e->max_lp_rows == 0)
                        e->max_lp_rows = 1;
                e->scratch = malloc(TSR_SAMPLER_SCRATCH(p->model->vocab) * sizeof(float));
                e->scratch2 = malloc(TSR_SAMPLER_SCRATCH(p->model->vocab) * sizeof(float));
                if (!e->logits || !e->scratch || !e->scratch2) {
                        st = TSR_E_NOMEM;
                        goto fail;
                }
                /* micro-batches: a plan per step in the model (--async-scheduling, which
                 * overlaps scheduling with one step instead, takes precedence) */
                const tsr_engine_model *m = p->model;
                if (m->submit && m->wait && m->max_in_flight > 1 && !p->async_scheduling) {
                        e->queue_cap = m->max_in_flight;
                        if (!(e->queue = calloc(e->queue_cap, sizeof(*e->queue)))) {
                                st = TSR_E_NOMEM;
                                goto fail;
                        }
                }
        }
        if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
                st = TSR_E_INTERNAL;
                goto fail;
        }
        *ret = e;
        return TSR_OK;
fail:
        free(e->queue);
        free(e->logits);
        free(e->scratch);
        free(e->scratch2);
        free(e->gmask);
        tsr_state_cache_free(&e->states);
        tsr_kv_cache_free(&e->kv);
        free(e);
        return st;
}

void tsr_engine_stop(tsr_engine **ep) {
        tsr_engine *e;
        if (!ep || !*ep)
                return;
        e = *ep;
        tsr_queue_close(e->inbox);
        pthread_join(e->thread, NULL);
        for (size_t i = 0; i < e->running.n; i++)
                slot_free(e, e->running.items[i]);
        for (size_t i = 0; i < e->waiting.n; i++)
                slot_free(e, e->waiting.items[i]);
        free(e->running.items);
        free(e->waiting.items);
        plan_free(&e->plans[0]);
        plan_free(&e->plans[1]);
        for (uint32_t i = 0; i < e->queue_cap; i++)
                plan_free(&e->queue[i]);
        free(e->queue);
        free(e->logits);
        free(e->scratch);
        free(e->scratch2);
        free(e->gmask);
        tsr_kv_cache_free(&e->kv);
        tsr_state_cache_free(&e->states);
        free(e);
        *ep = NULL;
}
