/* worker/engine: the V1 scheduler end to end through the real queues, with a fake
 * model whose next token is a hash of the WHOLE context, read back through the paged
 * KV cache.  Any mistake in block tables, chunking, preemption or prefix-cache reuse
 * changes a sequence's context and therefore its tokens, which are checked against
 * the hash computed directly.
 *
 * Every test runs twice: synchronously, and with --async-scheduling (the forward on the
 * engine's step thread while the next step is scheduled against placeholders), where
 * the fake model's speed makes the two threads interleave at every step.
 * test_async_matches_sync runs one mixed workload (seeded sampling, stop ids under
 * min_tokens, max_tokens 1, logprobs, prompt logprobs, preemption, chunking, prefix
 * hits, an abort) both ways and compares everything a router sees.
 *
 * No test depends on timing: a test that needs a given load submits before the engine
 * starts (held + go), and one that needs a request to arrive while others run makes
 * the fake model hold a given step until the request is in the inbox (hold_at). */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>
#include <math.h>

#include "common/clock.h"
#include "worker/engine/engine.h"

#define VOCAB 97u
#define EOS 0u
#define BS 4u

typedef struct fake_model {
        uint32_t *kv;          /* token id stored per KV slot, UINT32_MAX = never written */
        size_t n_slots;
        size_t forwards;
        size_t tokens_run;
        /* mu guards the rest: the engine's forward runs on its own thread (the step thread
         * with --async-scheduling), the test reads these from the test thread. */
        pthread_mutex_t mu;
        pthread_cond_t cv;
        size_t steps;            /* forward calls: one per engine step */
        size_t max_step_seqs;    /* the most chunks one step ran */
        size_t max_step_tokens;  /* the most tokens one step ran */
        size_t max_pos_end;      /* the highest position computed, + 1 */
        size_t max_chunk;        /* the most tokens one sequence ran in one step */
        /* align > 0: chunks that stop short of their known tokens at a position that is
         * not a multiple of align (params.prefill_align's cut) */
        size_t align, misaligned;
        /* hold_at: the forward call of that number (1 = the first) waits, holding, until
         * released: the test then knows exactly which steps ran before what it submits. */
        size_t hold_at;
        bool holding;
        bool released;
        /* fail_at: the forward call of that number fails (TSR_E_INTERNAL) for its step */
        size_t fail_at;
        /* Recurrent state (params.state_slots > 0), as a Mamba model keeps it: per slot the
         * length and a hash of the tokens it has seen.  A chunk with past > 0 must find
         * exactly its sequence's first `past` tokens there, else the forward fails. */
        uint32_t state_slots;
        size_t *state_len;
        uint64_t *state_hash;
        /* Prefix caching of the state (tsr_engine_seq restore_state / save_state): a
         * restore copies the source slot in before the chunk (which must then hold the
         * chunk's first `past` tokens, as above), a save copies the slot out after it;
         * counted here. */
        size_t restores, saves;
        uint64_t state_hash_at[4097];   /* the last chunk's state after past + t tokens, t = 0..n */
        /* A hybrid's block tables (tsr_engine_params.n_kv_tables > 1): table 0 is full
         * attention (read above), each other one chunked with chunk[t]: its KV is written
         * too and, from the chunk of `past` on, must read back the context (a freed or
         * reused block would not) */
        uint32_t n_tables;
        uint32_t chunk[TSR_KV_TABLES_MAX];
        /* As a model on a device (tsr_engine_seq.token): a greedy row the engine offers is
         * answered with its argmax, and its slot in `logits` filled with NaN (a row the
         * sampler would refuse: so the engine must not read it).  argmax_none: answered
         * TSR_ARGMAX_NONE instead (a row without a maximum).  answered: how many.
         * draws: a sampled row offered (tsr_engine_seq.draw) is answered with
         * draw_token(u), its draws recorded in drawn[n_drawn]. */
        bool argmax;
        bool argmax_none;
        size_t argmax_answered;
        /* the engine may offer rows with logprobs (tsr_engine_model.answers_logprobs, set
         * from this): the answer then carries tsr_logprobs_gather of the row, as a
         * multi-node replica's last node sends; answered_lp counts them */
        bool answers_logprobs;
        size_t answered_lp;
        size_t answered_plp;    /* prompt rows answered as their logprobs (tsr_engine_seq.prompt_lp) */
        /* the engine may offer rows shaped by their request's logit bias or min_tokens'
         * mask (tsr_engine_model.answers_rules, set from this): answered as a multi-node
         * replica's last node answers them, tsr_sample_uniform_given with the rules (and
         * the draw's parameters and uniform); answered_rules counts them */
        bool answers_rules;
        size_t answered_rules;
        /* the engine may offer rows under a grammar with their mask (tsr_engine_model.
         * answers_masks, set from this): the row is masked as the last node masks it
         * (tsr_grammar_apply_mask) before it is answered; answered_masks counts them */
        bool answers_masks;
        size_t answered_masks;
        bool draws;
        tsr_draw drawn[64];
        size_t n_drawn;
        /* KV incarnations (tsr_engine_model.kv_generation, as a multi-node replica's):
         * renewal_pending makes the next kv_generation call install a new one;
         * in_forward counts forward calls running, and a kv_generation call meeting one
         * (or a step in the model, with micro-batches) is counted in
         * generation_during_forward (the engine must never make one). */
        uint64_t generation;
        bool renewal_pending;
        size_t installs;
        size_t in_forward;
        size_t generation_during_forward;
        /* As a pipeline with micro-batches (tsr_engine_model.submit, the fourth group): a
         * step is computed when it is submitted (every stage runs the steps in submit
         * order, so its KV writes land as they would) and its status handed out by
         * wait, oldest first; the most steps in flight at once is recorded. */
        tsr_status queued_st[8];
        size_t queued_head, queued_n, max_queued;
        /* Each queued step's sequences by their first block; chunk_behind counts the
         * sequences submitted while a step holding a chunk of them was still queued
         * (a prompt's chunks pipelined). */
        uint32_t queued_first[8][16];
        size_t queued_n_first[8];
        size_t chunk_behind;
        /* stage_ns > 0: the queued steps go through two pipeline stages of stage_ns each
         * (a stage takes one step at a time, in submit order), and wait returns when the
         * oldest has left the second (queued_ready) */
        uint64_t stage_ns;
        uint64_t stage_free[2];
        uint64_t queued_ready[8];
} fake_model;

static uint64_t fnv_more(uint64_t h, const uint32_t *t, size_t n) {
        for (size_t i = 0; i < n; i++)
                h = (h ^ t[i]) * 1099511628211ull;
        return h;
}

/* The state check and update of one chunk whose full context is ctx[0 .. past+n). */
static tsr_status fake_state(fake_model *m, uint32_t slot, const uint32_t *ctx, size_t past, size_t n) {
        if (!m->state_slots)
                return TSR_OK;
        if (slot >= m->state_slots)
                return TSR_E_INVAL;
        if (past == 0) {                /* a sequence starts: the slot is zeroed */
                m->state_len[slot] = 0;
                m->state_hash[slot] = 1469598103934665603ull;
        }
        if (m->state_len[slot] != past || m->state_hash[slot] != fnv_more(1469598103934665603ull, ctx, past))
                return TSR_E_INTERNAL;  /* the slot holds another history */
        m->state_hash_at[0] = m->state_hash[slot];
        for (size_t t = 0; t < n; t++)
                m->state_hash_at[t + 1] = fnv_more(m->state_hash_at[t], ctx + past + t, 1);
        m->state_len[slot] = past + n;
        m->state_hash[slot] = m->state_hash_at[n];
        return TSR_OK;
}

static uint32_t next_of(const uint32_t *ctx, size_t n) {
        uint64_t h = 1469598103934665603ull;
        for (size_t i = 0; i < n; i++)
                h = (h ^ ctx[i]) * 1099511628211ull;
        return (uint32_t)(h % (VOCAB - 1)) + 1;   /* never EOS */
}

/* The fake model's logits after the context ctx (n,): 10 at next_of(ctx), -10 elsewhere. */
static void fake_row(const uint32_t *ctx, size_t n, float *logits) {
        for (size_t v = 0; v < VOCAB; v++)
                logits[v] = -10.0f;
        logits[next_of(ctx, n)] = 10.0f;
}

/* The slots a step writes (every running request's, every save's) are distinct and in
 * range, no restore reads one of them, a restore continues something (past > 0), and
 * each chunk's saves lie in it, in order. */
static bool fake_slots_ok(const fake_model *m, const tsr_engine_seq *seqs, size_t n_seqs) {
        uint8_t written[64] = {0};
        if (m->state_slots > sizeof written)
                return false;
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *q = &seqs[i];
                if (q->state_slot >= m->state_slots || written[q->state_slot]++)
                        return false;
                for (size_t k = 0; k < q->n_saves; k++) {
                        const tsr_state_save *sv = &q->saves[k];
                        if (sv->slot >= m->state_slots || written[sv->slot]++ || sv->pos <= q->past_len ||
                            sv->pos > q->past_len + q->n || (k && sv->pos <= q->saves[k - 1].pos))
                                return false;
                }
        }
        for (size_t i = 0; i < n_seqs; i++)
                if (seqs[i].restore_state && (seqs[i].restore_from >= m->state_slots || seqs[i].past_len == 0 ||
                                              written[seqs[i].restore_from]))
                        return false;
        return true;
}

/* logits: NULL, one row (the last token's), or with `all` one row per token. */
static tsr_status fake_forward_one(fake_model *m, const uint32_t *bt, size_t n_table, const uint32_t *tokens,
                                   size_t n, size_t past, uint32_t state_slot, bool all, float *logits) {
        uint32_t ctx[4096];
        tsr_status st;
        if (past + n > n_table * BS || past + n > 4096)
                return TSR_E_INVAL;
        for (size_t p = 0; p < past; p++) {
                size_t slot = (size_t)bt[p / BS] * BS + p % BS;
                if (slot >= m->n_slots || m->kv[slot] == UINT32_MAX)
                        return TSR_E_INTERNAL;   /* reading KV that was never written */
                ctx[p] = m->kv[slot];
        }
        for (uint32_t tb = 1; tb < m->n_tables; tb++) {
                const uint32_t *ct = bt + tb * n_table;
                for (size_t p = past / m->chunk[tb] * m->chunk[tb]; p < past; p++) {
                        size_t slot = (size_t)ct[p / BS] * BS + p % BS;
                        if (ct[p / BS] == TSR_KV_NULL_BLOCK || slot >= m->n_slots || m->kv[slot] != ctx[p])
                                return TSR_E_INTERNAL;  /* the chunk's KV is gone */
                }
        }
        for (size_t t = 0; t < n; t++) {
                for (uint32_t tb = 0; tb < (m->n_tables ? m->n_tables : 1); tb++) {
                        const uint32_t *ct = bt + tb * n_table;
                        size_t slot = (size_t)ct[(past + t) / BS] * BS + (past + t) % BS;
                        if (ct[(past + t) / BS] == TSR_KV_NULL_BLOCK || slot >= m->n_slots)
                                return TSR_E_INTERNAL;
                        m->kv[slot] = tokens[t];
                }
                ctx[past + t] = tokens[t];
        }
        if ((st = fake_state(m, state_slot, ctx, past, n)) != TSR_OK)
                return st;
        m->forwards++;
        m->tokens_run += n;
        if (logits && all)
                for (size_t t = 0; t < n; t++)
                        fake_row(ctx, past + t + 1, logits + t * VOCAB);
        else if (logits)
                fake_row(ctx, past + n, logits);
        return TSR_OK;
}

/* The fake device's draw: a token from u alone (never EOS, 0). */
static uint32_t draw_token(double u) { return 1 + (uint32_t)(u * (VOCAB - 1)); }

static tsr_status fake_forward(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        fake_model *m = ud;
        size_t step_tokens = 0;
        pthread_mutex_lock(&m->mu);
        if (++m->steps == m->hold_at) {
                m->holding = true;
                pthread_cond_broadcast(&m->cv);
                while (!m->released)
                        pthread_cond_wait(&m->cv, &m->mu);
        }
        if (m->steps == m->fail_at) {
                pthread_mutex_unlock(&m->mu);
                return TSR_E_INTERNAL;
        }
        for (size_t i = 0; i < n_seqs; i++) {
                step_tokens += seqs[i].n;
                if (seqs[i].n > m->max_chunk)
                        m->max_chunk = seqs[i].n;
                if (seqs[i].past_len + seqs[i].n > m->max_pos_end)
                        m->max_pos_end = seqs[i].past_len + seqs[i].n;
                if (m->align && !seqs[i].want_logits && (seqs[i].past_len + seqs[i].n) % m->align)
                        m->misaligned++;
        }
        if (n_seqs > m->max_step_seqs)
                m->max_step_seqs = n_seqs;
        if (m->state_slots && !fake_slots_ok(m, seqs, n_seqs)) {
                pthread_mutex_unlock(&m->mu);
                return TSR_E_INTERNAL;
        }
        for (size_t i = 0; m->state_slots && i < n_seqs; i++)
                if (seqs[i].restore_state && seqs[i].state_slot < m->state_slots) {
                        m->state_len[seqs[i].state_slot] = m->state_len[seqs[i].restore_from];
                        m->state_hash[seqs[i].state_slot] = m->state_hash[seqs[i].restore_from];
                        m->restores++;
                }
        if (step_tokens > m->max_step_tokens)
                m->max_step_tokens = step_tokens;
        pthread_mutex_unlock(&m->mu);
        for (size_t i = 0; i < n_seqs; i++) {
                bool any = seqs[i].want_logits || seqs[i].want_all_logits;
                tsr_status st = fake_forward_one(m, seqs[i].block_table, seqs[i].n_table, seqs[i].tokens, seqs[i].n,
                                                 seqs[i].past_len, seqs[i].state_slot, seqs[i].want_all_logits,
                                                 any ? logits : NULL);
                if (st != TSR_OK)
                        return st;
                /* the saves: the state after the first pos tokens (a hash of them, as the
                 * slot's own would be); its context is the chunk's tokens after the slot's */
                for (size_t k = 0; k < seqs[i].n_saves; k++) {
                        const tsr_state_save *sv = &seqs[i].saves[k];
                        uint64_t h = m->state_hash_at[sv->pos - seqs[i].past_len];
                        pthread_mutex_lock(&m->mu);
                        m->state_len[sv->slot] = sv->pos;
                        m->state_hash[sv->slot] = h;
                        m->saves++;
                        pthread_mutex_unlock(&m->mu);
                }
                /* only ever offered for a last row, never answered before */
                if (seqs[i].token && (seqs[i].want_all_logits || !seqs[i].want_logits ||
                                      *seqs[i].token != TSR_ENGINE_TOKEN_UNSET))
                        return TSR_E_INTERNAL;
                /* logprobs and rules are offered only to a model that answers them */
                if (seqs[i].lp && (!seqs[i].token || !m->answers_logprobs))
                        return TSR_E_INTERNAL;
                if (seqs[i].rules && (!seqs[i].token || !m->answers_rules))
                        return TSR_E_INTERNAL;
                if (seqs[i].grammar_mask && (!seqs[i].token || !m->answers_masks ||
                                             seqs[i].grammar_mask_words != tsr_grammar_mask_words(VOCAB)))
                        return TSR_E_INTERNAL;
                if (seqs[i].token && seqs[i].grammar_mask) {
                        tsr_grammar_apply_mask(logits, VOCAB, seqs[i].grammar_mask);
                        pthread_mutex_lock(&m->mu);
                        m->answered_masks++;
                        pthread_mutex_unlock(&m->mu);
                }
                if (seqs[i].prompt_lp && (!seqs[i].want_all_logits || !m->answers_logprobs))
                        return TSR_E_INTERNAL;
                /* a prompt-logprobs chunk's prompt rows: their logprobs, the rows then NaN */
                for (size_t t = 0; seqs[i].prompt_lp && t < seqs[i].n &&
                                   seqs[i].past_len + t + 1 < seqs[i].prompt_len; t++) {
                        uint32_t next = t + 1 < seqs[i].n ? seqs[i].tokens[t + 1] : seqs[i].next_token;
                        if (tsr_logprobs_gather(logits + t * VOCAB, VOCAB, next, seqs[i].prompt_lp_top,
                                                &seqs[i].prompt_lp[t]) != TSR_OK)
                                return TSR_E_INTERNAL;
                        for (size_t v = 0; v < VOCAB; v++)
                                logits[t * VOCAB + v] = NAN;
                        pthread_mutex_lock(&m->mu);
                        m->answered_plp++;
                        pthread_mutex_unlock(&m->mu);
                }
                if (seqs[i].token && seqs[i].rules) {
                        const tsr_draw *d = seqs[i].draw;
                        tsr_sampling sp = *seqs[i].rules;
                        float scratch[TSR_SAMPLER_SCRATCH(VOCAB)];
                        sp.min_tokens = seqs[i].rules_mask_eos ? 1 : 0;   /* at n_output 0: masked or not */
                        sp.logprobs = -1;
                        sp.temperature = d ? d->temperature : 0.0f;
                        sp.top_k = d ? d->top_k : 0;
                        sp.top_p = d ? d->top_p : 1.0f;
                        sp.min_p = d ? d->min_p : 0.0f;
                        const tsr_engine_seq *q = &seqs[i];
                        tsr_sample_history hist = {.prompt = q->history, .n_prompt = q->prompt_len,
                                                   .output = q->history ? q->history + q->prompt_len : NULL,
                                                   .n_output = q->history ? q->n_history - q->prompt_len : 0};
                        if (q->history && sp.min_tokens)
                                sp.min_tokens = (uint32_t)hist.n_output + 1;
                        if (tsr_sample_uniform_given(&sp, q->history ? &hist : NULL, d ? d->u : 0.0, logits, VOCAB,
                                                     scratch, seqs[i].token) != TSR_OK ||
                            (seqs[i].lp && tsr_logprobs_gather(logits, VOCAB, *seqs[i].token, seqs[i].lp_top,
                                                               seqs[i].lp) != TSR_OK))
                                return TSR_E_INTERNAL;
                        for (size_t v = 0; v < VOCAB; v++)
                                logits[v] = NAN;
                        pthread_mutex_lock(&m->mu);
                        m->answered_rules++;
                        pthread_mutex_unlock(&m->mu);
                } else if (seqs[i].token && !seqs[i].draw && m->argmax) {
                        uint32_t best = 0;
                        for (uint32_t v = 1; v < VOCAB; v++)
                                if (logits[v] > logits[best])
                                        best = v;
                        *seqs[i].token = m->argmax_none ? UINT32_MAX : best;
                        if (seqs[i].lp && !m->argmax_none &&
                            tsr_logprobs_gather(logits, VOCAB, best, seqs[i].lp_top, seqs[i].lp) != TSR_OK)
                                return TSR_E_INTERNAL;
                        for (size_t v = 0; v < VOCAB; v++)
                                logits[v] = NAN;
                        pthread_mutex_lock(&m->mu);
                        m->argmax_answered++;
                        m->answered_lp += seqs[i].lp != NULL;
                        pthread_mutex_unlock(&m->mu);
                } else if (seqs[i].token && seqs[i].draw && m->draws) {
                        *seqs[i].token = draw_token(seqs[i].draw->u);
                        if (seqs[i].lp && tsr_logprobs_gather(logits, VOCAB, *seqs[i].token, seqs[i].lp_top,
                                                              seqs[i].lp) != TSR_OK)
                                return TSR_E_INTERNAL;
                        for (size_t v = 0; v < VOCAB; v++)
                                logits[v] = NAN;
                        pthread_mutex_lock(&m->mu);
                        m->answered_lp += seqs[i].lp != NULL;
                        if (m->n_drawn < sizeof m->drawn / sizeof m->drawn[0])
                                m->drawn[m->n_drawn++] = *seqs[i].draw;
                        pthread_mutex_unlock(&m->mu);
                }
                logits += (seqs[i].want_all_logits ? seqs[i].n : seqs[i].want_logits ? 1 : 0) * VOCAB;
        }
        return TSR_OK;
}

/* fake_forward with in_forward counted (the KV incarnation test's model).  A forward
 * that starts while a renewal is pending lingers until it is installed, up to 200 ms;
 * an install takes 50 ms (freeing a group, meeting again).  So an engine that would
 * install with a step in flight is seen doing it, whichever thread comes first. */
static tsr_status fake_forward_counted(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        fake_model *m = ud;
        struct timespec until;
        tsr_status st;
        int rc = 0;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 200000000L;
        if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&m->mu);
        m->in_forward++;
        while (m->renewal_pending && rc != ETIMEDOUT)
                rc = pthread_cond_timedwait(&m->cv, &m->mu, &until);
        pthread_mutex_unlock(&m->mu);
        st = fake_forward(ud, seqs, n_seqs, logits);
        pthread_mutex_lock(&m->mu);
        m->in_forward--;
        pthread_mutex_unlock(&m->mu);
        return st;
}

static uint64_t fake_kv_generation(void *ud) {
        fake_model *m = ud;
        pthread_mutex_lock(&m->mu);
        if (m->in_forward || m->queued_n)      /* a step running, or in the model (micro-batches) */
                m->generation_during_forward++;
        if (m->renewal_pending) {
                pthread_mutex_unlock(&m->mu);
                nanosleep(&(struct timespec){.tv_nsec = 50000000L}, NULL);
                pthread_mutex_lock(&m->mu);
                if (m->in_forward || m->queued_n)
                        m->generation_during_forward++;
                m->generation++;
                m->installs++;
                m->renewal_pending = false;
                pthread_cond_broadcast(&m->cv);
        }
        uint64_t g = m->generation;
        pthread_mutex_unlock(&m->mu);
        return g;
}

static bool fake_kv_renewal_pending(void *ud) {
        fake_model *m = ud;
        pthread_mutex_lock(&m->mu);
        bool pending = m->renewal_pending;
        pthread_mutex_unlock(&m->mu);
        return pending;
}

static tsr_status fake_submit(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        fake_model *m = ud;
        size_t q;
        pthread_mutex_lock(&m->mu);
        if (m->queued_n == 8 || n_seqs > 16) {
                pthread_mutex_unlock(&m->mu);
                return TSR_E_INVAL;
        }
        q = (m->queued_head + m->queued_n) % 8;
        m->queued_n_first[q] = 0;
        if (m->stage_ns) {
                uint64_t t = tsr_now_ns();
                for (int s = 0; s < 2; s++) {
                        t = (t > m->stage_free[s] ? t : m->stage_free[s]) + m->stage_ns;
                        m->stage_free[s] = t;
                }
                m->queued_ready[q] = t;
        }
        for (size_t i = 0; i < n_seqs; i++) {
                uint32_t first = seqs[i].n_table ? seqs[i].block_table[0] : UINT32_MAX;
                bool behind = false;
                for (size_t k = 0; k < m->queued_n; k++) {
                        size_t o = (m->queued_head + k) % 8;
                        for (size_t j = 0; j < m->queued_n_first[o]; j++)
                                behind |= m->queued_first[o][j] == first;
                }
                m->chunk_behind += behind;
                m->queued_first[q][m->queued_n_first[q]++] = first;
        }
        pthread_mutex_unlock(&m->mu);
        tsr_status st = fake_forward(ud, seqs, n_seqs, logits);
        pthread_mutex_lock(&m->mu);
        m->queued_st[q] = st;
        m->queued_n++;
        if (m->queued_n > m->max_queued)
                m->max_queued = m->queued_n;
        pthread_mutex_unlock(&m->mu);
        return TSR_OK;
}

static tsr_status fake_wait(void *ud) {
        fake_model *m = ud;
        pthread_mutex_lock(&m->mu);
        uint64_t ready = m->stage_ns && m->queued_n ? m->queued_ready[m->queued_head] : 0;
        pthread_mutex_unlock(&m->mu);
        for (uint64_t now = tsr_now_ns(); now < ready; now = tsr_now_ns()) {
                struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(ready - now)};
                nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&m->mu);
        tsr_status st = m->queued_n ? m->queued_st[m->queued_head] : TSR_E_INVAL;
        if (m->queued_n) {
                m->queued_head = (m->queued_head + 1) % 8;
                m->queued_n--;
        }
        pthread_mutex_unlock(&m->mu);
        return st;
}

static bool g_async;   /* start engines with async_scheduling (the second group) */
static bool g_queue;   /* the model takes 2 steps in flight (micro-batches, the fourth group) */
static bool g_argmax;  /* the model answers greedy rows with their argmax (the third group) */

typedef struct harness {
        fake_model fm;
        tsr_engine_model model;
        tsr_queue *in, *out;
        tsr_engine *e;
        tsr_engine_params params;
        uint32_t eos[2];   /* [0] the tokenizer's EOS; [1] an extra one where a test sets n_eos_ids 2 */
} harness;

/* A harness whose engine is not running yet: what is submitted before go() is in the
 * inbox when the engine takes its first step.  Tests that need a given load (preemption,
 * a request that must wait behind others) build it this way; submitting to a running
 * engine races with its steps, which may see the requests one at a time. */
static harness *held_full(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, bool prefix, size_t lp_rows,
                          uint64_t shutdown_ms) {
        harness *h = calloc(1, sizeof(*h));
        h->fm.n_slots = blocks * BS;
        h->fm.kv = malloc(h->fm.n_slots * sizeof(uint32_t));
        memset(h->fm.kv, 0xff, h->fm.n_slots * sizeof(uint32_t));
        h->model.vocab = VOCAB;
        h->model.ud = &h->fm;
        h->model.forward = fake_forward;
        if (g_queue) {
                h->model.max_in_flight = 2;
                h->model.submit = fake_submit;
                h->model.wait = fake_wait;
        }
        h->fm.argmax = g_argmax;
        /* a model that answers tokens answers logprobs too, as a last node does */
        h->fm.answers_logprobs = h->model.answers_logprobs = g_argmax;
        pthread_mutex_init(&h->fm.mu, NULL);
        pthread_cond_init(&h->fm.cv, NULL);
        h->eos[0] = EOS;
        assert_int_equal(tsr_queue_new(4096, &h->in), TSR_OK);
        assert_int_equal(tsr_queue_new(65536, &h->out), TSR_OK);
        tsr_engine_params p = {
                .model = &h->model, .kv_blocks_total = blocks, .block_size = BS, .max_model_len = 1024,
                .max_num_seqs = max_seqs, .max_num_batched_tokens = max_batched, .enable_prefix_caching = prefix,
                .hash_algo = TSR_BLOCK_HASH_XXHASH, .eos_ids = h->eos, .n_eos_ids = 1,
                .max_prompt_lp_rows = lp_rows, .shutdown_timeout_ms = shutdown_ms, .async_scheduling = g_async,
        };
        h->params = p;
        return h;
}

static void go(harness *h) {
        assert_int_equal(tsr_engine_start(&h->params, h->in, h->out, &h->e), TSR_OK);
}

static harness *held(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, bool prefix, size_t lp_rows) {
        return held_full(blocks, max_batched, max_seqs, prefix, lp_rows, 0);
}

static harness *start_full(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, bool prefix, size_t lp_rows,
                           uint64_t shutdown_ms) {
        harness *h = held_full(blocks, max_batched, max_seqs, prefix, lp_rows, shutdown_ms);
        go(h);
        return h;
}

static harness *start_lp(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, bool prefix, size_t lp_rows) {
        return start_full(blocks, max_batched, max_seqs, prefix, lp_rows, 0);
}

static harness *start(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, bool prefix) {
        return start_lp(blocks, max_batched, max_seqs, prefix, 0);
}

typedef struct step_records {
        size_t max_step_seqs, max_step_tokens, max_pos_end, max_chunk;
} step_records;

/* The fake model's per-step records, read under its lock. */
static step_records model_records(harness *h) {
        step_records r;
        pthread_mutex_lock(&h->fm.mu);
        r = (step_records){h->fm.max_step_seqs, h->fm.max_step_tokens, h->fm.max_pos_end, h->fm.max_chunk};
        pthread_mutex_unlock(&h->fm.mu);
        return r;
}

/* Wait until the engine is inside forward call number h->fm.hold_at (set before go). */
static void wait_holding(harness *h) {
        struct timespec deadline;
        int rc = 0;
        bool holding;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += 20;
        pthread_mutex_lock(&h->fm.mu);
        while (!h->fm.holding && rc != ETIMEDOUT)
                rc = pthread_cond_timedwait(&h->fm.cv, &h->fm.mu, &deadline);
        holding = h->fm.holding;
        pthread_mutex_unlock(&h->fm.mu);
        if (!holding)
                fail_msg("the engine did not reach forward call %zu in 20 s", h->fm.hold_at);
}

static void release(harness *h) {
        pthread_mutex_lock(&h->fm.mu);
        h->fm.released = true;
        pthread_cond_broadcast(&h->fm.cv);
        pthread_mutex_unlock(&h->fm.mu);
}

static void stop(harness *h) {
        tsr_engine_out *o;
        release(h);   /* a failed test may have left the model holding */
        tsr_engine_stop(&h->e);
        while ((o = tsr_queue_pop(h->out)))
                tsr_engine_out_free(o);
        tsr_queue_free(&h->in);
        tsr_queue_free(&h->out);
        free(h->fm.kv);
        free(h->fm.state_len);
        free(h->fm.state_hash);
        pthread_cond_destroy(&h->fm.cv);
        pthread_mutex_destroy(&h->fm.mu);
        free(h);
}

typedef struct submit_opts {
        float temperature;        /* 0: greedy */
        int32_t top_k;            /* 0: off */
        float top_p, min_p;       /* 0: off (vLLM's 1 and 0) */
        float presence_penalty;
        bool has_seed;
        uint64_t seed;
        uint32_t min_tokens;
        int32_t priority;         /* --scheduling-policy priority: lower first */
        bool ignore_eos;
        const tsr_logit_bias *bias;
        size_t n_bias;
} submit_opts;

static void submit_full(harness *h, const char *id, const uint32_t *prompt, size_t n, uint32_t max_tokens,
                        const uint32_t *stop_ids, size_t n_stop, int32_t logprobs, int32_t prompt_logprobs,
                        const submit_opts *so) {
        tsr_engine_in *in = calloc(1, sizeof(*in));
        tsr_engine_submit *s = &in->submit;
        assert_non_null(in);
        in->kind = TSR_ENGINE_IN_SUBMIT;
        memcpy(in->router_id, "r1", 2);
        in->router_id_len = 2;
        snprintf(s->request_id, sizeof(s->request_id), "%s", id);
        s->prompt = malloc(n * sizeof(uint32_t) + 1);
        assert_non_null(s->prompt);
        memcpy(s->prompt, prompt, n * sizeof(uint32_t));
        s->n_prompt = n;
        if (n_stop) {
                s->stop_ids = malloc(n_stop * sizeof(uint32_t));
                assert_non_null(s->stop_ids);
                memcpy(s->stop_ids, stop_ids, n_stop * sizeof(uint32_t));
                s->n_stop_ids = n_stop;
        }
        tsr_sampling_init(&s->sampling);
        s->sampling.temperature = so ? so->temperature : 0.0f;   /* greedy by default */
        if (so && so->top_k)
                s->sampling.top_k = so->top_k;
        if (so && so->top_p > 0.0f)
                s->sampling.top_p = so->top_p;
        if (so)
                s->sampling.min_p = so->min_p, s->sampling.presence_penalty = so->presence_penalty;
        s->has_seed = so && so->has_seed;
        s->seed = so ? so->seed : 0;
        s->min_tokens = so ? so->min_tokens : 0;
        s->priority = so ? so->priority : 0;
        s->ignore_eos = so && so->ignore_eos;
        if (so && so->n_bias) {
                s->bias = malloc(so->n_bias * sizeof(*s->bias));
                assert_non_null(s->bias);
                memcpy(s->bias, so->bias, so->n_bias * sizeof(*s->bias));
                s->n_bias = so->n_bias;
        }
        s->max_tokens = max_tokens;
        s->logprobs = logprobs;
        s->prompt_logprobs = prompt_logprobs;
        assert_int_equal(tsr_queue_push(h->in, in), TSR_OK);
}

static void submit_lp(harness *h, const char *id, const uint32_t *prompt, size_t n, uint32_t max_tokens,
                      const uint32_t *stop_ids, size_t n_stop, int32_t logprobs, int32_t prompt_logprobs) {
        submit_full(h, id, prompt, n, max_tokens, stop_ids, n_stop, logprobs, prompt_logprobs, NULL);
}

static void submit(harness *h, const char *id, const uint32_t *prompt, size_t n, uint32_t max_tokens,
                   const uint32_t *stop_ids, size_t n_stop) {
        submit_lp(h, id, prompt, n, max_tokens, stop_ids, n_stop, -1, -1);
}

static void abort_req(harness *h, const char *id) {
        tsr_engine_in *in = calloc(1, sizeof(*in));
        assert_non_null(in);
        in->kind = TSR_ENGINE_IN_ABORT;
        memcpy(in->router_id, "r1", 2);
        in->router_id_len = 2;
        in->abort.request_ids = calloc(1, sizeof(*in->abort.request_ids));
        assert_non_null(in->abort.request_ids);
        snprintf(in->abort.request_ids[0], sizeof(in->abort.request_ids[0]), "%s", id);
        in->abort.n_request_ids = 1;
        assert_int_equal(tsr_queue_push(h->in, in), TSR_OK);
}

typedef struct result {
        uint32_t tokens[512];
        size_t n;
        tsr_engine_finish finish;
        uint32_t cached;
        uint32_t stop_id;
        bool has_stop_id;
        uint32_t num_generated;          /* of the finishing Output */
        bool error;
        tsr_token_logprobs lp[512];      /* one per token when logprobs were asked */
        size_t n_lp;
        tsr_token_logprobs plp[64];      /* prompt positions 1.. */
        size_t n_plp;
        int n_plp_outputs;               /* Outputs that carried prompt logprobs */
        uint32_t num_preemptions;        /* of the finishing Output */
        int first_rank, finish_rank;     /* collect()'s count of request Outputs at its first token,
                                          * at its finish (from 1; 0: never) */
} result;

/* Collect outputs until every id in `ids` finished; return the last stats seen. */
static tsr_engine_stats collect(harness *h, const char *const *ids, result *res, size_t n_ids) {
        size_t finished = 0;
        int rank = 0;
        tsr_engine_stats last = {0};
        while (finished < n_ids) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                if (!o)
                        fail_msg("engine produced nothing for 20 s (%zu of %zu finished)", finished, n_ids);
                if (o->kind == TSR_ENGINE_OUT_STATS)
                        last = o->stats;
                for (size_t i = 0; i < o->n_outputs; i++) {
                        tsr_engine_req_output *ro = &o->outputs[i];
                        for (size_t k = 0; k < n_ids; k++) {
                                if (strcmp(ids[k], ro->request_id) != 0)
                                        continue;
                                rank++;
                                if (ro->n_new && res[k].n == 0)
                                        res[k].first_rank = rank;
                                for (uint32_t t = 0; t < ro->n_new; t++)
                                        res[k].tokens[res[k].n++] = ro->new_tokens[t];
                                for (uint32_t t = 0; ro->logprobs && t < ro->n_new && res[k].n_lp < 512; t++)
                                        res[k].lp[res[k].n_lp++] = ro->logprobs[t];
                                if (ro->prompt_logprobs) {
                                        res[k].n_plp_outputs++;
                                        for (uint32_t t = 0; t < ro->n_prompt_logprobs && res[k].n_plp < 64; t++)
                                                res[k].plp[res[k].n_plp++] = ro->prompt_logprobs[t];
                                }
                                if (ro->num_prompt_tokens)
                                        res[k].cached = ro->num_cached_tokens;
                                if (ro->finish) {
                                        res[k].finish = ro->finish;
                                        res[k].num_generated = ro->num_generated;
                                        res[k].has_stop_id = ro->has_stop_token_id;
                                        res[k].stop_id = ro->stop_token_id;
                                        res[k].num_preemptions = ro->num_preemptions;
                                        res[k].finish_rank = rank;
                                        finished++;
                                }
                        }
                }
                if (o->kind == TSR_ENGINE_OUT_ERROR)
                        fail_msg("engine error for %s: %s", o->request_id, o->message);
                tsr_engine_out_free(o);
        }
        return last;
}

/* Stats once the engine is idle again. */
static tsr_engine_stats idle_stats(harness *h) {
        tsr_engine_stats last = {0};
        for (int quiet = 0; quiet < 100;) {   /* up to 5 s of silence */
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 50);
                quiet = o ? 0 : quiet + 1;
                if (!o) {
                        if (last.num_running == 0 && last.num_waiting == 0 && last.kv_blocks_total)
                                return last;
                        continue;
                }
                if (o->kind == TSR_ENGINE_OUT_STATS)
                        last = o->stats;
                tsr_engine_out_free(o);
        }
        return last;
}

static void expected(const uint32_t *prompt, size_t n, size_t max_tokens, uint32_t *out) {
        uint32_t ctx[2048];
        memcpy(ctx, prompt, n * sizeof(uint32_t));
        for (size_t i = 0; i < max_tokens; i++) {
                ctx[n + i] = next_of(ctx, n + i);
                out[i] = ctx[n + i];
        }
}

static void make_prompt(uint32_t *p, size_t n, uint32_t seed) {
        for (size_t i = 0; i < n; i++)
                p[i] = 1 + (seed * 31u + (uint32_t)i * 7u) % (VOCAB - 1);
}

static void test_single_request_greedy(void **state) {
        harness *h = start(256, 64, 8, true);
        uint32_t prompt[10], want[20];
        result res[1] = {0};
        const char *ids[] = {"a"};
        make_prompt(prompt, 10, 1);
        submit(h, "a", prompt, 10, 20, NULL, 0);
        collect(h, ids, res, 1);
        expected(prompt, 10, 20, want);
        assert_int_equal(res[0].n, 20);
        assert_memory_equal(res[0].tokens, want, sizeof(want));
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_LENGTH);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.argmax_answered, g_argmax ? 20 : 0);   /* every token, the prefill's too */
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

/* A sampled request whose row needs nothing but its token (no logprobs, bias, penalties)
 * is offered to the model as a draw: the request's temperature, top_k, top_p, min_p and
 * the uniform tsr_sample would use at that position (its seed's Philox stream), and the
 * model's token is the output; with logprobs or a penalty the row is sampled by the
 * engine as before (nothing offered). */
static void test_device_draws(void **state) {
        enum { MAX = 5 };
        harness *h = held(64, 64, 8, false, 0);
        uint32_t prompt[6];
        result res[1];
        const char *ids[] = {"d"};
        memset(res, 0, sizeof(res));
        h->fm.draws = true;
        make_prompt(prompt, 6, 5);
        submit_full(h, "d", prompt, 6, MAX, NULL, 0, -1, -1,
                    &(submit_opts){.temperature = 0.8f, .top_k = 5, .top_p = 0.9f, .min_p = 0.1f, .has_seed = true,
                                   .seed = 7});
        go(h);
        collect(h, ids, res, 1);
        assert_int_equal(res[0].n, MAX);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.n_drawn, MAX);
        for (size_t i = 0; i < MAX; i++) {
                const tsr_draw *d = &h->fm.drawn[i];
                assert_true(d->temperature == 0.8f && d->top_k == 5 && d->top_p == 0.9f && d->min_p == 0.1f);
                /* the engine's key of seed 7 (engine.c), position i of the output */
                assert_true(d->u == tsr_sampler_uniform(7 * 0x9e3779b97f4a7c15ull + 1, i));
                assert_int_equal(res[0].tokens[i], draw_token(d->u));
        }
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);

        /* logprobs, or a penalty: sampled by the engine, nothing offered (to a model that
         * does not answer logprobs: test_model_answers_logprobs has the other kind) */
        h = held(64, 64, 8, false, 0);
        h->fm.draws = true;
        h->fm.answers_logprobs = h->model.answers_logprobs = false;
        const char *ids2[] = {"lp", "pen"};
        result res2[2];
        memset(res2, 0, sizeof(res2));
        submit_full(h, "lp", prompt, 6, MAX, NULL, 0, 1, -1, &(submit_opts){.temperature = 0.8f});
        submit_full(h, "pen", prompt, 6, MAX, NULL, 0, -1, -1,
                    &(submit_opts){.temperature = 0.8f, .presence_penalty = 0.5f});
        go(h);
        collect(h, ids2, res2, 2);
        assert_int_equal(res2[0].n, MAX);
        assert_int_equal(res2[1].n, MAX);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.n_drawn, 0);
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

/* A model's argmax answer that says the row had no maximum (NaN or +inf in it) ends the
 * request with an error, as tsr_sample's TSR_E_INVAL for that row would; a request the
 * argmax does not serve (logprobs asked) runs on, sampled from its row. */
static void test_argmax_none_is_an_error(void **state) {
        harness *h = held(64, 64, 8, false, 0);
        uint32_t prompt[6], want[4];
        result res[2] = {0};
        const char *ids[] = {"none", "lp"};
        h->fm.argmax = true;
        h->fm.argmax_none = true;
        h->fm.answers_logprobs = h->model.answers_logprobs = false;
        make_prompt(prompt, 6, 3);
        submit(h, "none", prompt, 6, 4, NULL, 0);
        submit_lp(h, "lp", prompt, 6, 4, NULL, 0, 0, -1);
        go(h);
        collect(h, ids, res, 2);
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_ERROR);
        assert_int_equal(res[0].n, 0);
        expected(prompt, 6, 4, want);
        assert_int_equal(res[1].finish, TSR_ENGINE_FINISH_LENGTH);
        assert_int_equal(res[1].n, 4);
        assert_memory_equal(res[1].tokens, want, sizeof(want));
        pthread_mutex_lock(&h->fm.mu);
        assert_true(h->fm.argmax_answered >= 1);        /* "none"'s first row (and no "lp" row) */
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

/* A model that answers logprobs with the token (tsr_engine_model.answers_logprobs: a
 * multi-node replica's last node) is offered the rows of requests that asked for
 * logprobs, greedy and drawn, but not one with a penalty or prompt logprobs; the
 * model's token and logprobs are the output (its rows poisoned: never read), and for
 * the greedy request they are the ones the engine computes from the row itself. */
static void test_model_answers_logprobs(void **state) {
        enum { MAX = 5 };
        uint32_t prompt[6];
        result res[2][4];
        const char *ids[] = {"greedy", "drawn", "pen", "plp"};
        size_t answered_lp[2], answered_plp[2];
        make_prompt(prompt, 6, 9);
        memset(res, 0, sizeof(res));
        for (int run = 0; run < 2; run++) {
                harness *h = held(64, 64, 8, false, 0);
                h->fm.argmax = h->fm.draws = run == 1;
                h->fm.answers_logprobs = h->model.answers_logprobs = run == 1;
                submit_full(h, "greedy", prompt, 6, MAX, NULL, 0, 3, -1, &(submit_opts){0});
                submit_full(h, "drawn", prompt, 6, MAX, NULL, 0, 2, -1,
                            &(submit_opts){.temperature = 0.8f, .has_seed = true, .seed = 7});
                submit_full(h, "pen", prompt, 6, MAX, NULL, 0, 1, -1, &(submit_opts){.presence_penalty = 0.5f});
                submit_full(h, "plp", prompt, 6, MAX, NULL, 0, 1, 2, &(submit_opts){0});
                go(h);
                collect(h, ids, res[run], 4);
                pthread_mutex_lock(&h->fm.mu);
                answered_lp[run] = h->fm.answered_lp;
                answered_plp[run] = h->fm.answered_plp;
                if (run == 1) {
                        /* drawn: the model's draws, each with its logprobs */
                        assert_int_equal(h->fm.n_drawn, MAX);
                        for (size_t i = 0; i < MAX; i++) {
                                assert_int_equal(res[1][1].tokens[i], draw_token(h->fm.drawn[i].u));
                                assert_int_equal(res[1][1].lp[i].token, res[1][1].tokens[i]);
                                assert_int_equal(res[1][1].lp[i].n_top, 2);
                        }
                }
                pthread_mutex_unlock(&h->fm.mu);
                stop(h);
                for (int r = 0; r < 4; r++)
                        assert_int_equal(res[run][r].n, MAX);
        }
        assert_int_equal(answered_lp[0], 0);
        /* plp's prompt rows (positions 1..5 of its 6-token prompt) answered as their
         * logprobs by the model too, not gathered by the engine */
        assert_int_equal(answered_plp[0], 0);
        assert_int_equal(answered_plp[1], 5);
        /* greedy's 5 rows and drawn's 5; "pen" (a penalty) and "plp" (prompt logprobs: its
         * first token's row is a prompt row) are sampled by the engine, except plp's
         * decode rows, which need nothing else: 4 more */
        assert_int_equal(answered_lp[1], MAX + MAX + (MAX - 1));
        /* the model's answers are the engine's own: tokens and logprobs, bit for bit */
        for (int r = 0; r < 4; r++) {
                if (r == 1)
                        continue;   /* drawn by the fake model's rule, not from the row */
                assert_int_equal(res[1][r].n_lp, MAX);
                assert_memory_equal(res[1][r].tokens, res[0][r].tokens, MAX * sizeof(uint32_t));
                assert_memory_equal(res[1][r].lp, res[0][r].lp, MAX * sizeof(tsr_token_logprobs));
        }
        assert_memory_equal(res[1][3].plp, res[0][3].plp, res[0][3].n_plp * sizeof(tsr_token_logprobs));
}

/* A model that answers rows shaped by a logit bias, min_tokens' mask or penalties with
 * their token (tsr_engine_model.answers_rules: a multi-node replica's last node,
 * nodes.c): offered those rows (greedy and drawn, with and without logprobs; min_tokens'
 * mask only below min_tokens; penalties with the request's tokens so far); its answers
 * are the engine's own tokens and logprobs bit for bit, including EOS masked below
 * min_tokens and taken after it. */
static void test_model_answers_rules(void **state) {
        (void)state;
        enum { MAX = 6, N = 4 };
        uint32_t prompt[6];
        result res[2][N];
        const char *ids[N] = {"bias", "drawn", "min", "pen"};
        size_t answered[2];
        /* the bias pushes tokens the fake model's rows (10 at one token, -10 elsewhere)
         * would not choose, or nearly; +100 on EOS ends "min" as soon as min_tokens lets it */
        const tsr_logit_bias up[] = {{.id = 3, .bias = 25.0f}, {.id = 11, .bias = 19.5f}, {.id = 12, .bias = -30.0f}};
        const tsr_logit_bias eos[] = {{.id = EOS, .bias = 100.0f}};
        /* near ties the presence penalty breaks once a token has been output: 3, then 11 */
        const tsr_logit_bias near[] = {{.id = 3, .bias = 21.0f}, {.id = 11, .bias = 20.5f}};
        make_prompt(prompt, 6, 5);
        memset(res, 0, sizeof(res));
        for (int run = 0; run < 2; run++) {
                harness *h = held(64, 64, 8, false, 0);
                h->fm.argmax = h->fm.draws = false;
                h->fm.answers_logprobs = h->model.answers_logprobs = run == 1;
                h->fm.answers_rules = h->model.answers_rules = run == 1;
                submit_full(h, "bias", prompt, 6, MAX, NULL, 0, 2, -1, &(submit_opts){.bias = up, .n_bias = 3});
                submit_full(h, "drawn", prompt, 6, MAX, NULL, 0, -1, -1,
                            &(submit_opts){.temperature = 0.9f, .has_seed = true, .seed = 3, .bias = up, .n_bias = 3});
                submit_full(h, "min", prompt, 6, MAX, NULL, 0, 1, -1,
                            &(submit_opts){.min_tokens = 3, .bias = eos, .n_bias = 1});
                submit_full(h, "pen", prompt, 6, MAX, NULL, 0, -1, -1,
                            &(submit_opts){.presence_penalty = 2.0f, .bias = near, .n_bias = 2});
                go(h);
                collect(h, ids, res[run], N);
                pthread_mutex_lock(&h->fm.mu);
                answered[run] = h->fm.answered_rules;
                pthread_mutex_unlock(&h->fm.mu);
                stop(h);
        }
        assert_int_equal(answered[0], 0);
        /* bias's and drawn's rows, min's three below min_tokens and its EOS row after
         * (the bias is a rule too), pen's with its history */
        assert_int_equal(res[0][2].n, 4);
        assert_int_equal(res[0][2].tokens[3], EOS);
        assert_int_equal(answered[1], MAX + MAX + 4 + MAX);
        assert_int_equal(res[0][3].tokens[0], 3);
        assert_int_equal(res[0][3].tokens[1], 11);
        for (int r = 0; r < N; r++) {
                assert_int_equal(res[1][r].n, res[0][r].n);
                assert_memory_equal(res[1][r].tokens, res[0][r].tokens, res[0][r].n * sizeof(uint32_t));
                assert_int_equal(res[1][r].n_lp, res[0][r].n_lp);
                assert_memory_equal(res[1][r].lp, res[0][r].lp, res[0][r].n_lp * sizeof(tsr_token_logprobs));
        }
        /* the bias did shape the tokens: without it the greedy request would differ */
        harness *h = held(64, 64, 8, false, 0);
        result plain[1];
        const char *pid[1] = {"plain"};
        memset(plain, 0, sizeof(plain));
        submit_full(h, "plain", prompt, 6, MAX, NULL, 0, 2, -1, &(submit_opts){0});
        go(h);
        collect(h, pid, plain, 1);
        stop(h);
        assert_memory_not_equal(plain[0].tokens, res[0][0].tokens, MAX * sizeof(uint32_t));
}

/* The step time the routers place by (Status decode_step_ms) with micro-batches: a
 * model of two pipeline stages of 30 ms each, two steps in flight (a budget of 8
 * tokens puts the four 8-token prompts in steps of their own, so the requests decode
 * in two groups whose steps alternate: a request whose token is in flight waits).
 * Decode steps then end every 30 ms though each takes 60 ms through both stages; a step
 * is counted from the end of the one before it (the pipeline's interval), not from its
 * submit (which made it 60 ms: every step's latency, twice what a step adds).  The
 * engine runs without --async-scheduling in every group here (which would run the
 * model's forward, one step at a time). */
static void test_step_time_with_steps_in_flight(void **state) {
        enum { N = 4, MAX = 24 };
        harness *h = held(256, 8, 8, false, 0);
        h->params.async_scheduling = false;
        uint32_t prompt[N][8];
        result res[N];
        const char *ids[N] = {"a", "b", "c", "d"};
        memset(res, 0, sizeof(res));
        h->model.max_in_flight = 2;
        h->model.submit = fake_submit;
        h->model.wait = fake_wait;
        h->fm.stage_ns = 30 * 1000000ull;
        for (int i = 0; i < N; i++) {
                make_prompt(prompt[i], 8, 20 + (uint32_t)i);
                submit(h, ids[i], prompt[i], 8, MAX, NULL, 0);
        }
        go(h);
        tsr_engine_stats st = collect(h, ids, res, N);
        for (int i = 0; i < N; i++)
                assert_int_equal(res[i].n, MAX);
        print_message("decode_step_ms %.1f (two stages of 30 ms, two steps in flight)\n", st.decode_step_ms);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.max_queued, 2);
        pthread_mutex_unlock(&h->fm.mu);
        /* counted from its submit a step takes at least the two stages, 60 ms; the bounds
         * leave a loaded machine's scheduling jitter room on both sides of 30 (the median
         * of the last 8 decode steps) */
        assert_true(st.decode_step_ms >= 15 && st.decode_step_ms < 50);
        stop(h);
}

static void test_many_concurrent_with_preemption_and_chunking(void **state) {
        /* 24 blocks of 4 tokens for 16 requests of up to 60 tokens each: preemption is
         * certain; a budget of 8 tokens per step forces chunked prefill. */
        harness *h = held(24, 8, 16, true, 0);
        uint32_t prompts[16][40], want[16][24];
        size_t lens[16];
        result res[16];
        const char *ids[16];
        char names[16][8];
        memset(res, 0, sizeof(res));
        for (int i = 0; i < 16; i++) {
                lens[i] = 3 + (size_t)(i * 7) % 37;
                make_prompt(prompts[i], lens[i], (uint32_t)i + 5);
                snprintf(names[i], sizeof(names[i]), "r%d", i);
                ids[i] = names[i];
                submit(h, ids[i], prompts[i], lens[i], 24, NULL, 0);
                expected(prompts[i], lens[i], 24, want[i]);
        }
        go(h);
        collect(h, ids, res, 16);
        for (int i = 0; i < 16; i++) {
                if (res[i].n != 24 || memcmp(res[i].tokens, want[i], sizeof(want[i])) != 0)
                        fail_msg("request %d: %zu tokens, or wrong tokens", i, res[i].n);
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_LENGTH);
        }
        tsr_engine_stats st = idle_stats(h);
        assert_true(st.num_preemptions_total > 0);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);   /* every block back */
        stop(h);
}

/* A hybrid of a full table and a chunked one (chunk 6 on blocks of 4: chunk starts
 * inside blocks; issue #14): 8 requests of up to 70 tokens in a pool of 40 blocks, less
 * than two whole tables of three of them, with preemption and prefix caching: every
 * output right (the fake model checks each chunked read against the context), every
 * block back at the end; and one request alone holds its full blocks plus at most two
 * chunked ones (read off Status as it decodes). */
static void test_hybrid_tables(void **state) {
        harness *h = held(40, 8, 8, true, 0);
        uint32_t prompts[8][40], want[8][30];
        size_t lens[8];
        result res[8];
        const char *ids[8];
        char names[8][8];
        (void)state;
        memset(res, 0, sizeof(res));
        h->params.n_kv_tables = 2;
        h->params.kv_chunk[1] = 6;
        h->fm.n_tables = 2;
        h->fm.chunk[1] = 6;
        for (int i = 0; i < 8; i++) {
                lens[i] = 5 + (size_t)(i * 11) % 36;
                make_prompt(prompts[i], lens[i], (uint32_t)i % 3 + 40);       /* shared prefixes */
                snprintf(names[i], sizeof(names[i]), "h%d", i);
                ids[i] = names[i];
                submit(h, ids[i], prompts[i], lens[i], 30, NULL, 0);
                expected(prompts[i], lens[i], 30, want[i]);
        }
        go(h);
        collect(h, ids, res, 8);
        for (int i = 0; i < 8; i++) {
                if (res[i].n != 30 || memcmp(res[i].tokens, want[i], sizeof(want[i])) != 0)
                        fail_msg("request %d: %zu tokens, or wrong tokens", i, res[i].n);
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_LENGTH);
        }
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);   /* every table's blocks back */
        /* alone: 40 + 30 = 70 positions: 18 full blocks + at most 2 chunked, never 36 */
        uint32_t prompt[40], one[30];
        result r1[1] = {0};
        make_prompt(prompt, 40, 77);
        expected(prompt, 40, 30, one);
        submit(h, "alone", prompt, 40, 30, NULL, 0);
        size_t most = 0;
        for (bool done = false; !done;) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                assert_non_null(o);
                if (o->kind == TSR_ENGINE_OUT_STATS && o->stats.kv_blocks_total - o->stats.kv_blocks_free > most)
                        most = o->stats.kv_blocks_total - o->stats.kv_blocks_free;
                for (size_t i = 0; i < o->n_outputs; i++) {
                        memcpy(r1[0].tokens + r1[0].n, o->outputs[i].new_tokens,
                               o->outputs[i].n_new * sizeof(uint32_t));
                        r1[0].n += o->outputs[i].n_new;
                        done |= o->outputs[i].finish != TSR_ENGINE_FINISH_NONE;
                }
                tsr_engine_out_free(o);
        }
        assert_int_equal(r1[0].n, 30);
        assert_memory_equal(r1[0].tokens, one, sizeof(one));
        assert_true(most >= 18 && most <= 18 + 2);
        stop(h);
}

static void test_prefix_cache_hit_same_output(void **state) {
        harness *h = start(64, 256, 4, true);
        uint32_t prompt[18], want[6];
        result r1[1] = {0}, r2[1] = {0};
        const char *a[] = {"first"}, *b[] = {"second"};
        make_prompt(prompt, 18, 9);
        expected(prompt, 18, 6, want);
        submit(h, "first", prompt, 18, 6, NULL, 0);
        collect(h, a, r1, 1);
        size_t tokens_before = h->fm.tokens_run;
        submit(h, "second", prompt, 18, 6, NULL, 0);
        collect(h, b, r2, 1);
        assert_memory_equal(r1[0].tokens, want, sizeof(want));
        assert_memory_equal(r2[0].tokens, want, sizeof(want));
        assert_int_equal(r1[0].cached, 0);
        assert_int_equal(r2[0].cached, 16);     /* 4 full blocks of the 18-token prompt */
        /* The second request computed 2 prompt tokens + 5 decode steps, not 18 + 5. */
        assert_int_equal(h->fm.tokens_run - tokens_before, 2 + 5);
        tsr_engine_stats st = idle_stats(h);
        assert_true(st.prefix_cache_hits_total >= 16);
        stop(h);
}

/* A model whose KV memory can be lost (a multi-node replica whose follower came back,
 * worker/parallel/nodes.h) installs the new incarnation in kv_generation.  The engine
 * calls it only while no forward runs (with --async-scheduling it lets the step in
 * flight end first, else the old group would be freed under it), and forgets its prefix
 * cache at the new generation: the same prompt hits before, not after. */
static void test_kv_renewal_waits_for_the_step_in_flight(void **state) {
        harness *h = held(64, 256, 4, true, 0);
        uint32_t prompt[18], want[6];
        result r[3];
        const char *ids[3] = {"before", "during", "after"};
        memset(r, 0, sizeof(r));
        h->model.forward = fake_forward_counted;
        h->model.kv_generation = fake_kv_generation;
        h->model.kv_renewal_pending = fake_kv_renewal_pending;
        h->fm.generation = 1;
        go(h);
        make_prompt(prompt, 18, 5);
        expected(prompt, 18, 6, want);
        submit(h, ids[0], prompt, 18, 6, NULL, 0);
        collect(h, &ids[0], &r[0], 1);
        /* "during" hits the cache (2 prompt tokens left) and decodes 5 more steps; hold
         * its 5th step (tokens 1-5), make a renewal pending while it runs, let it go */
        pthread_mutex_lock(&h->fm.mu);
        h->fm.hold_at = h->fm.steps + 5;
        pthread_mutex_unlock(&h->fm.mu);
        submit(h, ids[1], prompt, 18, 6, NULL, 0);
        wait_holding(h);
        pthread_mutex_lock(&h->fm.mu);
        h->fm.renewal_pending = true;
        pthread_mutex_unlock(&h->fm.mu);
        release(h);
        collect(h, &ids[1], &r[1], 1);
        submit(h, ids[2], prompt, 18, 6, NULL, 0);
        collect(h, &ids[2], &r[2], 1);
        for (int i = 0; i < 3; i++) {
                assert_int_equal(r[i].n, 6);
                assert_memory_equal(r[i].tokens, want, sizeof(want));
                assert_int_equal(r[i].finish, TSR_ENGINE_FINISH_LENGTH);
        }
        assert_int_equal(r[0].cached, 0);
        assert_int_equal(r[1].cached, 16);      /* the first generation's cache */
        assert_int_equal(r[2].cached, 0);       /* forgotten with it */
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.installs, 1);
        assert_int_equal(h->fm.generation_during_forward, 0);
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

static void test_stop_token_and_eos(void **state) {
        harness *h = start(64, 64, 4, false);
        uint32_t prompt[5], want[30];
        result res[1] = {0};
        const char *ids[] = {"s"};
        make_prompt(prompt, 5, 3);
        expected(prompt, 5, 30, want);
        uint32_t stop_id = want[7];
        size_t first = 0;
        while (want[first] != stop_id)
                first++;
        submit(h, "s", prompt, 5, 30, &stop_id, 1);
        collect(h, ids, res, 1);
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_STOP);
        assert_true(res[0].has_stop_id);
        assert_int_equal(res[0].stop_id, stop_id);
        assert_int_equal(res[0].n, first + 1);   /* the stop token is the last one returned */
        stop(h);
}

static void test_abort_frees_blocks(void **state) {
        harness *h = start(64, 64, 4, false);
        uint32_t prompt[12];
        make_prompt(prompt, 12, 4);
        submit(h, "long", prompt, 12, 1000, NULL, 0);
        /* Wait for it to start, then abort it. */
        for (;;) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                assert_non_null(o);
                bool started = o->kind == TSR_ENGINE_OUT_OUTPUT;
                tsr_engine_out_free(o);
                if (started)
                        break;
        }
        abort_req(h, "long");
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.num_running, 0);
        /* Aborted well before its 1000 tokens: the abort, not the length limit, ended it. */
        assert_true(st.generation_tokens_total < 1000);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* Request `id` of the prompt runs to its max_tokens greedy tokens, the fake model's. */
static void assert_serves(harness *h, const char *id, const uint32_t *prompt, size_t n, uint32_t max_tokens) {
        uint32_t want[64];
        result res[1] = {0};
        const char *ids[] = {id};
        assert_true(max_tokens <= 64);
        submit(h, id, prompt, n, max_tokens, NULL, 0);
        collect(h, ids, res, 1);
        expected(prompt, n, max_tokens, want);
        assert_int_equal(res[0].n, max_tokens);
        assert_memory_equal(res[0].tokens, want, max_tokens * sizeof(uint32_t));
}

/* A prompt of four chunks: with micro-batches each next chunk goes in behind the one
 * still in the model (vLLM's batch queue pipelines a prompt's chunks), and the fake
 * model, which reads every position's KV back, computes the same tokens. */
static void test_prompt_chunks_pipelined(void **state) {
        enum { N = 64, MAX = 4 };
        harness *h = start(64, 16, 4, false);
        uint32_t prompt[N];
        make_prompt(prompt, N, 9);
        assert_serves(h, "long", prompt, N, MAX);
        pthread_mutex_lock(&h->fm.mu);
        /* chunks 2, 3 and 4 each behind the one before; a decode never behind its token */
        assert_int_equal(h->fm.chunk_behind, g_queue ? 3 : 0);
        assert_int_equal(h->fm.max_queued, g_queue ? 2 : 0);
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

/* A prompt's chunk fails while its next chunk is in the model (micro-batches): the
 * request ends once, with an error, and is freed only when that next step returns
 * (ASan sees a use after free otherwise); the engine serves the next request. */
static void test_failed_chunk_with_the_next_in_flight(void **state) {
        enum { N = 64, MAX = 4 };
        harness *h = held(64, 16, 4, false, 0);
        uint32_t prompt[N];
        result res[1] = {0};
        const char *ids[] = {"bad"};
        h->fm.fail_at = 1;
        make_prompt(prompt, N, 11);
        submit(h, "bad", prompt, N, MAX, NULL, 0);
        go(h);
        collect(h, ids, res, 1);
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_ERROR);
        assert_int_equal(res[0].n, 0);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        assert_serves(h, "next", prompt, N, MAX);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.chunk_behind, g_queue ? 1 + 3 : 0);   /* "bad"'s second chunk went in */
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

/* Aborted with chunks in the model: with micro-batches three steps at once (as -pp 3),
 * the abort taken while its second and third chunks are in flight.  No Output for it,
 * its blocks come back once every step of it has returned (freeing it at the first is
 * a use after free ASan sees), and the next request runs. */
static void test_abort_with_chunks_in_flight(void **state) {
        enum { N = 64, MAX = 4 };
        harness *h = held(64, 16, 4, false, 0);
        uint32_t prompt[N];
        tsr_engine_out *o;
        h->fm.hold_at = g_queue ? 3 : 2;
        if (g_queue)
                h->model.max_in_flight = 3;
        make_prompt(prompt, N, 13);
        submit(h, "gone", prompt, N, MAX, NULL, 0);
        go(h);
        wait_holding(h);
        abort_req(h, "gone");
        release(h);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.num_running, 0);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        assert_int_equal(st.generation_tokens_total, 0);
        assert_serves(h, "next", prompt, N, MAX);
        while ((o = tsr_queue_pop_wait(h->out, 50))) {
                for (size_t i = 0; i < o->n_outputs; i++)
                        assert_string_not_equal(o->outputs[i].request_id, "gone");
                tsr_engine_out_free(o);
        }
        pthread_mutex_lock(&h->fm.mu);
        assert_true(h->fm.chunk_behind >= (g_queue ? 2u : 0u));   /* "gone"'s second and third chunks */
        assert_int_equal(h->fm.max_queued, g_queue ? 3 : 0);
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
}

static void test_too_long_prompt_refused(void **state) {
        harness *h = start(64, 64, 4, false);
        uint32_t *prompt = calloc(2000, sizeof(uint32_t));
        make_prompt(prompt, 2000, 2);
        submit(h, "big", prompt, 2000, 4, NULL, 0);
        tsr_engine_out *o;
        while ((o = tsr_queue_pop_wait(h->out, 5000)) && o->kind != TSR_ENGINE_OUT_ERROR)
                tsr_engine_out_free(o);
        assert_non_null(o);
        assert_string_equal(o->request_id, "big");
        assert_int_equal(o->error_code, TSR_ENGINE_ERROR_TOO_LONG);
        tsr_engine_out_free(o);
        free(prompt);
        stop(h);
}

/* prompt_logprobs: every prompt position from 1 is scored under the fake model's
 * logits of the position before it (10 at next_of(context), -10 elsewhere), so a
 * prompt token the model predicts has logprob -log(1 + 96 e^-20) ~ -2e-7 and rank 1,
 * any other -20 and rank 97 (all 96 others tie with it).  The prompt is long enough to
 * be prefilled in chunks (3 logits rows per step), and the same prompt was cached just
 * before: the request must not read the prefix cache (its logits would be missing). */
static void test_prompt_logprobs(void **state) {
        harness *h = start_lp(64, 6, 4, true, 3);
        enum { N = 14 };
        uint32_t prompt[N], want[3];
        result warm[1] = {0}, res[1] = {0};
        const char *a[] = {"warm"}, *b[] = {"plp"};
        const double hit = -log1p(96.0 * exp(-20.0)), miss = -20.0 + hit;

        prompt[0] = 5;
        for (size_t i = 1; i < N; i++) {
                uint32_t nx = next_of(prompt, i);
                prompt[i] = i % 3 == 1 ? nx : 1 + (nx + 10) % (VOCAB - 1);   /* predicted, or surely not */
        }
        expected(prompt, N, 3, want);
        submit(h, "warm", prompt, N, 3, NULL, 0);
        collect(h, a, warm, 1);
        assert_int_equal(warm[0].n_plp_outputs, 0);
        assert_int_equal(warm[0].n_lp, 0);
        size_t tokens_before = h->fm.tokens_run;

        submit_lp(h, "plp", prompt, N, 3, NULL, 0, 1, 2);
        collect(h, b, res, 1);
        assert_memory_equal(res[0].tokens, want, sizeof(want));
        assert_int_equal(res[0].cached, 0);                       /* no prefix-cache read */
        assert_int_equal(h->fm.tokens_run - tokens_before, N + 2); /* the whole prompt, then 2 decodes */
        assert_int_equal(res[0].n_plp_outputs, 1);                /* in the first Output only */
        assert_int_equal(res[0].n_plp, N - 1);
        for (size_t pos = 1; pos < N; pos++) {
                const tsr_token_logprobs *lp = &res[0].plp[pos - 1];
                uint32_t nx = next_of(prompt, pos);
                bool predicted = prompt[pos] == nx;
                assert_int_equal(predicted, pos % 3 == 1);
                assert_int_equal(lp->token, prompt[pos]);
                assert_true(fabs(lp->logprob - (predicted ? hit : miss)) < 1e-4);
                assert_int_equal(lp->rank, predicted ? 1 : VOCAB);
                assert_int_equal(lp->n_top, 2);
                assert_int_equal(lp->top_ids[0], nx);
                assert_true(fabs(lp->top_logprobs[0] - hit) < 1e-4);
                assert_int_equal(lp->top_ids[1], 0);                     /* ties: the lowest id first */
                assert_true(fabs(lp->top_logprobs[1] - miss) < 1e-4);
        }
        /* The generated tokens' own logprobs (logprobs: 1): the greedy token, rank 1. */
        assert_int_equal(res[0].n_lp, 3);
        for (size_t i = 0; i < 3; i++) {
                assert_int_equal(res[0].lp[i].token, want[i]);
                assert_int_equal(res[0].lp[i].rank, 1);
                assert_int_equal(res[0].lp[i].n_top, 1);
                assert_int_equal(res[0].lp[i].top_ids[0], want[i]);
                assert_true(fabs(res[0].lp[i].logprob - hit) < 1e-4);
        }
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* A one-token prompt has no position to score: an empty list, still in the first
 * Output; and prompt_logprobs requests survive preemption (re-prefill) intact. */
static void test_prompt_logprobs_edge_cases(void **state) {
        harness *h = start_lp(12, 8, 8, false, 5);
        uint32_t one[1] = {9}, prompts[6][20];
        result r1[1] = {0}, rs[6];
        const char *a[] = {"one"}, *ids[6];
        char names[6][8];
        submit_lp(h, "one", one, 1, 2, NULL, 0, -1, 0);
        collect(h, a, r1, 1);
        assert_int_equal(r1[0].n, 2);
        assert_int_equal(r1[0].n_plp, 0);
        stop(h);
        /* six 20-token prompts on 48 KV slots, all in the inbox at the first step */
        h = held(12, 8, 8, false, 5);
        memset(rs, 0, sizeof(rs));
        for (int i = 0; i < 6; i++) {
                make_prompt(prompts[i], 20, (uint32_t)i + 40);
                snprintf(names[i], sizeof(names[i]), "p%d", i);
                ids[i] = names[i];
                submit_lp(h, ids[i], prompts[i], 20, 8, NULL, 0, -1, 0);
        }
        go(h);
        collect(h, ids, rs, 6);
        for (int i = 0; i < 6; i++) {
                uint32_t want[8];
                expected(prompts[i], 20, 8, want);
                assert_memory_equal(rs[i].tokens, want, sizeof(want));
                assert_int_equal(rs[i].n_plp, 19);
                assert_int_equal(rs[i].n_plp_outputs, 1);
                for (size_t pos = 1; pos < 20; pos++) {
                        bool predicted = prompts[i][pos] == next_of(prompts[i], pos);
                        assert_int_equal(rs[i].plp[pos - 1].token, prompts[i][pos]);
                        assert_int_equal(rs[i].plp[pos - 1].rank, predicted ? 1 : VOCAB);
                        assert_int_equal(rs[i].plp[pos - 1].n_top, 0);
                }
        }
        tsr_engine_stats st = idle_stats(h);
        assert_true(st.num_preemptions_total > 0);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* `n` = 4 arrives as four requests with one prompt (the router fans it out).  The
 * first is prefilled; the other three wait for it and then read every full block of
 * the prompt from the prefix cache, computing only the partial last block.  Run with
 * a budget that prefills in one step and with one that needs two chunks (without the
 * wait, a sibling would start beside the second chunk and hit only 8 tokens). */
static void n_siblings(uint32_t budget) {
        harness *h = held(64, budget, 8, true, 0);
        enum { N = 18, K = 4, OUT = 6 };
        uint32_t prompt[N], want[OUT];
        result res[K];
        const char *ids[K] = {"c0", "c1", "c2", "c3"};
        memset(res, 0, sizeof(res));
        make_prompt(prompt, N, 11);
        expected(prompt, N, OUT, want);
        for (int i = 0; i < K; i++)
                submit(h, ids[i], prompt, N, OUT, NULL, 0);
        go(h);
        collect(h, ids, res, K);
        for (int i = 0; i < K; i++) {
                assert_int_equal(res[i].n, OUT);
                assert_memory_equal(res[i].tokens, want, sizeof(want));
                /* FCFS: c0 is the one prefilled; each sibling hit the 4 full blocks. */
                assert_int_equal(res[i].cached, i == 0 ? 0 : 16);
        }
        /* Prompt work: 18 tokens once, then 2 per sibling; plus every decode step. */
        assert_int_equal(h->fm.tokens_run, N + (K - 1) * (N - 16) + K * (OUT - 1));
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.prefix_cache_hits_total, (K - 1) * 16);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

static void test_n_siblings_share_prompt_kv(void **state) { n_siblings(256); }
static void test_n_siblings_share_prompt_kv_chunked(void **state) { n_siblings(10); }

/* Two different 14-token prompts sharing their first three blocks, submitted
 * together with a budget of 10 tokens per step: the second waits only until the
 * shared blocks are computed (step 2 would otherwise start it beside the first's last
 * chunk, with two blocks cached), hits them, and computes its own tail. */
static void test_shared_prefix_waits_only_for_shared_blocks(void **state) {
        harness *h = held(64, 10, 8, true, 0);
        uint32_t a[14], b[14], wa[5], wb[5];
        result res[2];
        const char *ids[2] = {"a", "b"};
        memset(res, 0, sizeof(res));
        make_prompt(a, 14, 21);
        memcpy(b, a, sizeof(b));
        for (size_t i = 12; i < 14; i++)
                b[i] = 1 + (a[i] + 5) % (VOCAB - 1);
        expected(a, 14, 5, wa);
        expected(b, 14, 5, wb);
        submit(h, "a", a, 14, 5, NULL, 0);
        submit(h, "b", b, 14, 5, NULL, 0);
        go(h);
        collect(h, ids, res, 2);
        assert_memory_equal(res[0].tokens, wa, sizeof(wa));
        assert_memory_equal(res[1].tokens, wb, sizeof(wb));
        assert_int_equal(res[0].cached, 0);
        assert_int_equal(res[1].cached, 12);
        assert_int_equal(h->fm.tokens_run, 14 + 2 + 2 * 4);
        stop(h);
}

static void push_shutdown(harness *h) {
        tsr_engine_in *in = calloc(1, sizeof(*in));
        in->kind = TSR_ENGINE_IN_SHUTDOWN;
        assert_int_equal(tsr_queue_push(h->in, in), TSR_OK);
}

/* Wait for the first Output of anything (the engine is generating). */
static void wait_started(harness *h) {
        for (;;) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                assert_non_null(o);
                bool started = o->kind == TSR_ENGINE_OUT_OUTPUT;
                tsr_engine_out_free(o);
                if (started)
                        return;
        }
}

/* SIGTERM with time to spare: the running request runs to its end (all its tokens),
 * a Submit after the signal is refused with a retryable UNAVAILABLE, then STOPPED. */
static void test_shutdown_lets_inflight_finish(void **state) {
        harness *h = start_full(64, 64, 4, false, 0, 60000);
        uint32_t prompt[12], want[40];
        size_t n = 0;
        bool refused = false, stopped = false, finished = false;
        make_prompt(prompt, 12, 6);
        expected(prompt, 12, 40, want);
        submit(h, "run", prompt, 12, 40, NULL, 0);
        wait_started(h);
        n = 1;   /* wait_started consumed the first token's Output */
        push_shutdown(h);
        submit(h, "late", prompt, 12, 4, NULL, 0);
        /* "late" may be refused after STOPPED: when the engine took the shutdown alone and
         * "run" ended before the next inbox drain. */
        while (!stopped || !refused) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                assert_non_null(o);
                if (o->kind == TSR_ENGINE_OUT_ERROR) {
                        assert_string_equal(o->request_id, "late");
                        assert_int_equal(o->error_code, TSR_ENGINE_ERROR_UNAVAILABLE);
                        assert_true(o->retryable);
                        refused = true;
                }
                for (size_t i = 0; i < o->n_outputs; i++) {
                        assert_string_equal(o->outputs[i].request_id, "run");
                        for (uint32_t t = 0; t < o->outputs[i].n_new; t++, n++)
                                assert_int_equal(o->outputs[i].new_tokens[t], want[n]);
                        if (o->outputs[i].finish) {
                                assert_int_equal(o->outputs[i].finish, TSR_ENGINE_FINISH_LENGTH);
                                finished = true;
                        }
                }
                if (o->kind == TSR_ENGINE_OUT_STOPPED) {
                        assert_true(finished);   /* STOPPED comes after the last Output */
                        stopped = true;
                }
                tsr_engine_out_free(o);
        }
        assert_true(refused);
        assert_int_equal(n, 40);
        stop(h);
}

/* SIGTERM with --shutdown-timeout 0: the running request (tokens already out) ends
 * with finish ABORT; the waiting one (nothing out yet) is handed back with a
 * retryable Error; every block is free again and STOPPED closes the sequence. */
static void test_shutdown_timeout_aborts_the_rest(void **state) {
        harness *h = start_full(64, 64, 1, false, 0, 0);
        uint32_t prompt[12];
        bool aborted = false, handed_back = false, stopped = false;
        tsr_engine_stats last = {0};
        make_prompt(prompt, 12, 7);
        submit(h, "running", prompt, 12, 1000, NULL, 0);
        submit(h, "waiting", prompt, 12, 1000, NULL, 0);   /* max_num_seqs 1: it waits */
        wait_started(h);
        push_shutdown(h);
        while (!stopped) {
                tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                assert_non_null(o);
                if (o->kind == TSR_ENGINE_OUT_STATS)
                        last = o->stats;
                if (o->kind == TSR_ENGINE_OUT_ERROR) {
                        assert_string_equal(o->request_id, "waiting");
                        assert_int_equal(o->error_code, TSR_ENGINE_ERROR_UNAVAILABLE);
                        assert_true(o->retryable);
                        handed_back = true;
                }
                for (size_t i = 0; i < o->n_outputs; i++) {
                        assert_string_equal(o->outputs[i].request_id, "running");
                        if (o->outputs[i].finish) {
                                assert_int_equal(o->outputs[i].finish, TSR_ENGINE_FINISH_ABORT);
                                assert_true(o->outputs[i].num_generated < 1000);
                                aborted = true;
                        }
                }
                stopped = o->kind == TSR_ENGINE_OUT_STOPPED;
                tsr_engine_out_free(o);
        }
        assert_true(aborted);
        assert_true(handed_back);
        assert_int_equal(last.num_running + last.num_waiting, 0);
        assert_int_equal(last.kv_blocks_free, last.kv_blocks_total);
        stop(h);
}

/* One mixed workload, run by a synchronous engine and by an async one; every request's
 * tokens, finish, stop id, num_generated, logprobs and prompt logprobs must agree, and
 * both must end with every block free.  KV for ~6 requests of 40 tokens and a budget of
 * 12 tokens a step: preemption and chunked prefill; every 4th request shares a prompt
 * (prefix hits); "abort" is aborted after its first Output. */
enum { MIX = 40 };

typedef struct mix_run {
        result res[MIX];
        tsr_engine_stats st;
} mix_run;

static void run_mix(bool async, mix_run *out) {
        bool saved = g_async;
        uint32_t prompts[MIX][48], shared[48];
        size_t lens[MIX];
        const char *ids[MIX];
        char names[MIX][8];
        harness *h;

        g_async = async;
        h = held(60, 12, 16, true, 8);
        g_async = saved;
        memset(out, 0, sizeof(*out));
        make_prompt(shared, 30, 77);
        for (int i = 0; i < MIX; i++) {
                uint32_t want[64], stop_id;
                submit_opts so = {0};
                int32_t lp = -1, plp = -1;
                uint32_t max_tokens = 4 + (uint32_t)(i * 5) % 21;
                lens[i] = 2 + (size_t)(i * 11) % 40;
                if (i % 4 == 0) {
                        lens[i] = 30;
                        memcpy(prompts[i], shared, sizeof(shared));
                } else {
                        make_prompt(prompts[i], lens[i], (uint32_t)i + 100);
                }
                snprintf(names[i], sizeof(names[i]), "m%d", i);
                ids[i] = names[i];
                if (i % 3 == 1) {   /* seeded sampling, flat logits: anything may come */
                        so.temperature = 25.0f;
                        so.has_seed = true;
                        so.seed = 1000u + (uint64_t)i;
                }
                if (i % 5 == 2)
                        max_tokens = 1;   /* finishes in its first step, with its prefill */
                if (i % 6 == 3)
                        lp = 2;
                if (i % 7 == 5)
                        plp = 1;
                expected(prompts[i], lens[i], 64, want);
                stop_id = want[6];
                if (i % 4 == 2) {   /* greedy stop id, gated by min_tokens (the sampler masks it before) */
                        so.min_tokens = 5;
                        max_tokens = 30;
                        submit_full(h, ids[i], prompts[i], lens[i], max_tokens, &stop_id, 1, lp, plp, &so);
                } else {
                        submit_full(h, ids[i], prompts[i], lens[i], max_tokens, NULL, 0, lp, plp, &so);
                }
        }
        submit(h, "abort", prompts[1], lens[1], 400, NULL, 0);
        go(h);
        {
                const char *aid[] = {"abort"};
                bool seen = false;
                (void)aid;
                /* Collect the mix; abort "abort" as soon as it produced something.  It was
                 * submitted last, and FCFS with preempted requests going back to the head
                 * may finish the whole mix before its first token: wait for both. */
                size_t finished = 0;
                while (finished < MIX || !seen) {
                        tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                        if (!o)
                                fail_msg("engine produced nothing for 20 s (%zu of %d finished)", finished, MIX);
                        if (o->kind == TSR_ENGINE_OUT_ERROR)
                                fail_msg("engine error for %s: %s", o->request_id, o->message);
                        for (size_t i = 0; i < o->n_outputs; i++) {
                                tsr_engine_req_output *ro = &o->outputs[i];
                                if (strcmp(ro->request_id, "abort") == 0) {
                                        if (!seen)
                                                abort_req(h, "abort");
                                        seen = true;
                                        assert_int_not_equal(ro->finish, TSR_ENGINE_FINISH_LENGTH);
                                        continue;
                                }
                                for (int k = 0; k < MIX; k++) {
                                        result *r = &out->res[k];
                                        if (strcmp(ids[k], ro->request_id) != 0)
                                                continue;
                                        for (uint32_t t = 0; t < ro->n_new; t++)
                                                r->tokens[r->n++] = ro->new_tokens[t];
                                        for (uint32_t t = 0; ro->logprobs && t < ro->n_new; t++)
                                                r->lp[r->n_lp++] = ro->logprobs[t];
                                        if (ro->prompt_logprobs) {
                                                r->n_plp_outputs++;
                                                for (uint32_t t = 0; t < ro->n_prompt_logprobs && r->n_plp < 64; t++)
                                                        r->plp[r->n_plp++] = ro->prompt_logprobs[t];
                                        }
                                        if (ro->num_prompt_tokens)
                                                r->cached = ro->num_cached_tokens;
                                        if (ro->finish) {
                                                r->finish = ro->finish;
                                                r->num_generated = ro->num_generated;
                                                r->has_stop_id = ro->has_stop_token_id;
                                                r->stop_id = ro->stop_token_id;
                                                finished++;
                                        }
                                }
                        }
                        tsr_engine_out_free(o);
                }
                assert_true(seen);
        }
        out->st = idle_stats(h);
        /* the 40 greedy-or-seeded requests checked against their own definitions */
        for (int i = 0; i < MIX; i++) {
                result *r = &out->res[i];
                assert_int_equal(r->n, r->num_generated);
                uint32_t want[64];
                size_t first = 0;
                expected(prompts[i], lens[i], 64, want);
                while (want[first] != want[6])
                        first++;
                if (i % 4 == 2 && first < 5)
                        continue;   /* min_tokens masked the stop id: another continuation */
                if (i % 3 != 1 && memcmp(r->tokens, want, r->n * sizeof(uint32_t)) != 0)
                        fail_msg("m%d (async %d): greedy tokens differ from the fake model's", i, async);
                if (i % 4 == 2 && i % 3 != 1) {
                        /* stop id want[6], first produced at `first` >= min_tokens: ends there */
                        assert_int_equal(r->finish, TSR_ENGINE_FINISH_STOP);
                        assert_int_equal(r->n, first + 1);
                        assert_int_equal(r->tokens[r->n - 1], r->stop_id);
                }
        }
        stop(h);
}

static void same_lp(const tsr_token_logprobs *a, const tsr_token_logprobs *b) {
        assert_int_equal(a->token, b->token);
        assert_true(a->logprob == b->logprob);   /* bitwise: the same rows, the same code */
        assert_int_equal(a->rank, b->rank);
        assert_int_equal(a->n_top, b->n_top);
        for (uint32_t k = 0; k < a->n_top; k++) {
                assert_int_equal(a->top_ids[k], b->top_ids[k]);
                assert_true(a->top_logprobs[k] == b->top_logprobs[k]);
        }
}

static void test_async_matches_sync(void **state) {
        static mix_run a, b;   /* large: off the stack */
        run_mix(false, &a);
        run_mix(true, &b);
        for (int i = 0; i < MIX; i++) {
                result *x = &a.res[i], *y = &b.res[i];
                if (x->n != y->n || memcmp(x->tokens, y->tokens, x->n * sizeof(uint32_t)) != 0)
                        fail_msg("request m%d: %zu tokens synchronously, %zu with async scheduling, or different ones",
                                 i, x->n, y->n);
                assert_int_equal(x->finish, y->finish);
                assert_int_equal(x->num_generated, y->num_generated);
                assert_int_equal(x->has_stop_id, y->has_stop_id);
                assert_int_equal(x->stop_id, y->stop_id);
                assert_int_equal(x->n_lp, y->n_lp);
                for (size_t t = 0; t < x->n_lp; t++)
                        same_lp(&x->lp[t], &y->lp[t]);
                assert_int_equal(x->n_plp, y->n_plp);
                assert_int_equal(x->n_plp_outputs, y->n_plp_outputs);
                for (size_t t = 0; t < x->n_plp; t++)
                        same_lp(&x->plp[t], &y->plp[t]);
                if (i % 5 == 2 && i % 4 != 2)
                        assert_int_equal(x->n, 1);   /* max_tokens 1: exactly one, both ways */
        }
        assert_true(a.st.num_preemptions_total > 0);
        assert_true(b.st.num_preemptions_total > 0);
        assert_true(a.st.prefix_cache_hits_total > 0);
        assert_true(b.st.prefix_cache_hits_total > 0);
        assert_int_equal(a.st.kv_blocks_free, a.st.kv_blocks_total);
        assert_int_equal(b.st.kv_blocks_free, b.st.kv_blocks_total);
        assert_int_equal(b.st.num_running + b.st.num_waiting, 0);
}

/* --scheduling-policy priority admits the waiting request with the lowest (priority,
 * arrival) first, as vLLM's priority queue does (negative values are allowed); FCFS
 * admits in submit order whatever the priorities.  max_num_seqs 1 runs one request at
 * a time, so the order of first tokens is the admission order. */
static void admission_order(bool priority) {
        enum { N = 5 };
        static const char *const ids[N] = {"p5", "p0", "p2", "p0b", "m1"};
        static const int32_t prio[N] = {5, 0, 2, 0, -1};
        static const int by_priority[N] = {4, 1, 3, 2, 0};   /* m1, p0, p0b (its tie: later), p2, p5 */
        static const int by_arrival[N] = {0, 1, 2, 3, 4};
        const int *order = priority ? by_priority : by_arrival;
        harness *h = held(64, 64, 1, false, 0);
        uint32_t prompts[N][6];
        result res[N];
        memset(res, 0, sizeof(res));
        h->params.priority_scheduling = priority;
        for (int i = 0; i < N; i++) {
                submit_opts so = {.priority = prio[i]};
                make_prompt(prompts[i], 6, (uint32_t)i + 50);
                submit_full(h, ids[i], prompts[i], 6, 4, NULL, 0, -1, -1, &so);
        }
        go(h);
        collect(h, ids, res, N);
        for (int i = 0; i < N; i++) {
                uint32_t want[4];
                expected(prompts[i], 6, 4, want);
                assert_int_equal(res[i].n, 4);
                assert_memory_equal(res[i].tokens, want, sizeof(want));
                assert_int_equal(res[i].num_preemptions, 0);
        }
        for (int k = 0; k + 1 < N; k++)
                if (res[order[k]].finish_rank >= res[order[k + 1]].first_rank)
                        fail_msg("%s policy: %s started before %s finished", priority ? "priority" : "fcfs",
                                 ids[order[k + 1]], ids[order[k]]);
        stop(h);
}

static void test_priority_admission_order(void **state) { admission_order(true); }
static void test_fcfs_admission_ignores_priority(void **state) { admission_order(false); }

/* When a running request cannot get a KV block, the victim is the running request with
 * the largest (priority, arrival) under the priority policy, the last admitted under
 * FCFS (vLLM V1's Scheduler.schedule).  "a" (priority 0) and "b" (9) start together;
 * the model holds its second step until "c" (1) is submitted, so "c" is admitted after
 * "b" and is the last in the running list.  Three 8-token prompts growing to 32 tokens
 * need 24 blocks together, 16 for any two: of 18 blocks, one request is preempted and
 * the other two then run to their end.  Priority preempts "b", FCFS "c". */
static void preemption_victim(bool priority) {
        enum { N = 3 };
        static const char *const ids[N] = {"a", "b", "c"};
        static const int32_t prio[N] = {0, 9, 1};
        const int victim = priority ? 1 : 2;
        harness *h = held(18, 64, 4, false, 0);
        uint32_t prompts[N][8];
        result res[N];
        memset(res, 0, sizeof(res));
        h->params.priority_scheduling = priority;
        h->fm.hold_at = 2;
        for (int i = 0; i < N; i++)
                make_prompt(prompts[i], 8, (uint32_t)i + 60);
        for (int i = 0; i < 2; i++)
                submit_full(h, ids[i], prompts[i], 8, 24, NULL, 0, -1, -1, &(submit_opts){.priority = prio[i]});
        go(h);
        wait_holding(h);
        submit_full(h, ids[2], prompts[2], 8, 24, NULL, 0, -1, -1, &(submit_opts){.priority = prio[2]});
        release(h);
        collect(h, ids, res, N);
        for (int i = 0; i < N; i++) {
                uint32_t want[24];
                expected(prompts[i], 8, 24, want);
                assert_int_equal(res[i].n, 24);
                assert_memory_equal(res[i].tokens, want, sizeof(want));
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_LENGTH);
                if (i == victim)
                        assert_true(res[i].num_preemptions > 0);
                else if (res[i].num_preemptions != 0)
                        fail_msg("%s policy: %s preempted %u times, only %s should be", priority ? "priority" : "fcfs",
                                 ids[i], res[i].num_preemptions, ids[victim]);
        }
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.num_preemptions_total, res[victim].num_preemptions);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

static void test_priority_preempts_largest_priority_value(void **state) { preemption_victim(true); }
static void test_fcfs_preempts_last_admitted(void **state) { preemption_victim(false); }

/* A more urgent request arriving while a less urgent one runs waits for room: V1
 * preempts only when a RUNNING request needs a block, never to admit a waiting one.
 * Once with max_num_seqs 1, once with too few free blocks for its prompt. */
static void urgent_waits(uint32_t max_seqs, uint64_t blocks, size_t urgent_len) {
        static const char *const ids[2] = {"slow", "urgent"};
        harness *h = held(blocks, 64, max_seqs, false, 0);
        uint32_t slow[8], urgent[32], want_slow[24], want_urgent[4];
        result res[2];
        memset(res, 0, sizeof(res));
        h->params.priority_scheduling = true;
        h->fm.hold_at = 2;
        make_prompt(slow, 8, 70);
        make_prompt(urgent, urgent_len, 71);
        expected(slow, 8, 24, want_slow);
        expected(urgent, urgent_len, 4, want_urgent);
        submit_full(h, "slow", slow, 8, 24, NULL, 0, -1, -1, &(submit_opts){.priority = 9});
        go(h);
        wait_holding(h);
        submit_full(h, "urgent", urgent, urgent_len, 4, NULL, 0, -1, -1, &(submit_opts){.priority = -5});
        release(h);
        collect(h, ids, res, 2);
        assert_memory_equal(res[0].tokens, want_slow, sizeof(want_slow));
        assert_memory_equal(res[1].tokens, want_urgent, sizeof(want_urgent));
        assert_int_equal(res[0].num_preemptions, 0);
        assert_int_equal(res[1].num_preemptions, 0);
        assert_true(res[0].finish_rank < res[1].first_rank);   /* it waited for "slow" to end */
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.num_preemptions_total, 0);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* "slow" grows to 8 blocks of 9; "urgent"'s 28-token prompt needs 7 while "slow" runs. */
static void test_priority_waiting_never_preempts(void **state) {
        urgent_waits(1, 64, 8);
        urgent_waits(4, 9, 28);
}

/* The model's EOS (tsr_engine_params.eos_ids) ends a request with finish STOP and no stop
 * id (vLLM's check_stop tests EOS before stop_token_ids), the EOS token being the last
 * of its tokens: vLLM returns it in token_ids and leaves only its text out (the router's
 * job).  ignore_eos runs on to max_tokens; min_tokens masks EOS before it (the sampler
 * gives -inf to EOS, and the fake model's other logits tie: greedy takes the lowest id,
 * 0), which the reference below reproduces. */
static size_t expected_eos(const uint32_t *prompt, size_t n, size_t max_tokens, uint32_t eos, size_t min_tokens,
                           uint32_t *out) {
        uint32_t ctx[256];
        memcpy(ctx, prompt, n * sizeof(uint32_t));
        for (size_t i = 0; i < max_tokens; i++) {
                uint32_t t = next_of(ctx, n + i);
                if (i < min_tokens && t == eos)
                        t = 0;
                ctx[n + i] = out[i] = t;
                if (t == eos)
                        return i + 1;
        }
        return max_tokens;
}

static void test_eos_finishes_unless_ignore_eos(void **state) {
        enum { N = 7, LEN = 6, MAX = 16 };
        static const char *const ids[N] = {"eos", "ignore", "min", "stop_too", "last", "at_first", "at_first_min"};
        harness *h = held(64, 64, 8, false, 0);
        uint32_t prompt[LEN], other[LEN], want[MAX], eos, min_want[MAX], other_want[MAX];
        size_t first = 0, min_n, other_n;
        uint32_t k = 0;
        result res[N];
        memset(res, 0, sizeof(res));
        make_prompt(prompt, LEN, 13);
        expected(prompt, LEN, MAX, want);
        eos = want[3];
        while (want[first] != eos)
                first++;
        h->eos[0] = eos;
        /* A prompt whose very first token is EOS: it ends in its prefill step. */
        memcpy(other, prompt, sizeof(other));
        do {
                assert_true(++k < (VOCAB - 1) * (VOCAB - 1));
                other[LEN - 1] = 1 + k % (VOCAB - 1);
                other[LEN - 2] = 1 + k / (VOCAB - 1);
                expected(other, LEN, 1, other_want);
        } while (other_want[0] != eos);
        min_n = expected_eos(prompt, LEN, MAX, eos, first + 2, min_want);
        other_n = expected_eos(other, LEN, MAX, eos, 1, other_want);
        submit(h, "eos", prompt, LEN, MAX, NULL, 0);
        submit_full(h, "ignore", prompt, LEN, MAX, NULL, 0, -1, -1, &(submit_opts){.ignore_eos = true});
        submit_full(h, "min", prompt, LEN, MAX, NULL, 0, -1, -1, &(submit_opts){.min_tokens = (uint32_t)first + 2});
        submit(h, "stop_too", prompt, LEN, MAX, &eos, 1);
        submit(h, "last", prompt, LEN, (uint32_t)first + 1, NULL, 0);   /* EOS is also its max_tokens-th */
        submit(h, "at_first", other, LEN, MAX, NULL, 0);
        submit_full(h, "at_first_min", other, LEN, MAX, NULL, 0, -1, -1, &(submit_opts){.min_tokens = 1});
        go(h);
        collect(h, ids, res, N);

        /* "eos"; "stop_too": EOS is checked before the stop ids (no stop id reported);
         * "last": before the length too (STOP, not LENGTH). */
        for (int i = 0; i < 5; i += i == 0 ? 3 : 1) {
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_STOP);
                assert_false(res[i].has_stop_id);
                assert_int_equal(res[i].n, first + 1);
                assert_int_equal(res[i].num_generated, first + 1);
                assert_memory_equal(res[i].tokens, want, (first + 1) * sizeof(uint32_t));
                assert_int_equal(res[i].tokens[first], eos);
        }
        assert_int_equal(res[1].finish, TSR_ENGINE_FINISH_LENGTH);
        assert_int_equal(res[1].n, MAX);
        assert_memory_equal(res[1].tokens, want, sizeof(want));
        assert_int_equal(res[2].n, min_n);
        assert_memory_equal(res[2].tokens, min_want, min_n * sizeof(uint32_t));
        assert_int_equal(res[2].tokens[first], 0);   /* masked: not EOS */
        assert_int_equal(res[2].finish, min_n < MAX || min_want[MAX - 1] == eos ? TSR_ENGINE_FINISH_STOP
                                                                                : TSR_ENGINE_FINISH_LENGTH);
        assert_false(res[2].has_stop_id);
        assert_int_equal(res[5].finish, TSR_ENGINE_FINISH_STOP);
        assert_int_equal(res[5].n, 1);
        assert_int_equal(res[5].tokens[0], eos);
        assert_int_equal(res[6].n, other_n);
        assert_memory_equal(res[6].tokens, other_want, other_n * sizeof(uint32_t));
        assert_int_equal(res[6].tokens[0], 0);
        assert_int_equal(res[6].finish, other_n < MAX || other_want[MAX - 1] == eos
                                                ? TSR_ENGINE_FINISH_STOP
                                                : TSR_ENGINE_FINISH_LENGTH);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* Several EOS ids (Llama 3's generation_config lists three): eos_ids[0] is the
 * tokenizer's, the EOS proper; vLLM makes the others stop_token_ids
 * (SamplingParams.update_from_generation_config), so finishing on one reports it as the
 * stop id, and ignore_eos lets a request run past it.  min_tokens masks them all,
 * ignore_eos or not (vLLM's _all_stop_token_ids). */
static void test_extra_eos_ids_are_stop_ids(void **state) {
        enum { N = 4, LEN = 6, MAX = 16 };
        static const char *const ids[N] = {"plain", "ignore", "ignore_min", "min"};
        harness *h = held(64, 64, 8, false, 0);
        uint32_t prompt[LEN], want[MAX], extra;
        size_t first = 0;
        result res[N];
        memset(res, 0, sizeof(res));
        make_prompt(prompt, LEN, 29);
        expected(prompt, LEN, MAX, want);
        extra = want[3];
        while (want[first] != extra)
                first++;
        h->eos[0] = EOS;              /* the fake model never produces it */
        h->eos[1] = extra;
        h->params.n_eos_ids = 2;
        submit(h, "plain", prompt, LEN, MAX, NULL, 0);
        submit_full(h, "ignore", prompt, LEN, MAX, NULL, 0, -1, -1, &(submit_opts){.ignore_eos = true});
        submit_full(h, "ignore_min", prompt, LEN, MAX, NULL, 0, -1, -1,
                    &(submit_opts){.ignore_eos = true, .min_tokens = (uint32_t)first + 1});
        submit_full(h, "min", prompt, LEN, MAX, NULL, 0, -1, -1, &(submit_opts){.min_tokens = (uint32_t)first + 1});
        go(h);
        collect(h, ids, res, N);

        /* "plain": STOP at the extra EOS, reported as the stop id, the token kept. */
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_STOP);
        assert_true(res[0].has_stop_id);
        assert_int_equal(res[0].stop_id, extra);
        assert_int_equal(res[0].n, first + 1);
        assert_memory_equal(res[0].tokens, want, (first + 1) * sizeof(uint32_t));
        /* "ignore": not a stop id under ignore_eos: the greedy run to max_tokens. */
        assert_int_equal(res[1].finish, TSR_ENGINE_FINISH_LENGTH);
        assert_false(res[1].has_stop_id);
        assert_int_equal(res[1].n, MAX);
        assert_memory_equal(res[1].tokens, want, sizeof(want));
        /* "ignore_min", "min": masked while n_output < min_tokens, so position `first`
         * takes another token; the prefix before it is the greedy one. */
        for (int i = 2; i < N; i++) {
                assert_true(res[i].n > first);
                assert_memory_equal(res[i].tokens, want, first * sizeof(uint32_t));
                assert_int_not_equal(res[i].tokens[first], extra);
                assert_int_not_equal(res[i].tokens[first], EOS);
        }
        assert_int_equal(res[2].finish, TSR_ENGINE_FINISH_LENGTH);
        assert_int_equal(res[2].n, MAX);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* max_model_len caps prompt + output (vLLM: num_tokens >= max_model_len is LENGTH):
 * a 28-token prompt under max_model_len 32 gets 4 tokens whatever max_tokens says, a
 * 31-token one gets 1, and a min_tokens beyond the room does not keep a request going
 * (vLLM's API refuses such a request; the engine still ends it).  The model never
 * computes position max_model_len - 1 or later (nothing samples from it), with
 * --async-scheduling included. */
static void test_length_at_max_model_len(void **state) {
        enum { N = 4 };
        static const char *const ids[N] = {"p28", "p31", "short", "p28min"};
        static const size_t lens[N] = {28, 31, 4, 28}, outs[N] = {4, 1, 6, 4}, max_tokens[N] = {100, 100, 6, 100};
        harness *h = held(64, 64, 4, false, 0);
        uint32_t prompts[N][31];
        result res[N];
        memset(res, 0, sizeof(res));
        h->params.max_model_len = 32;
        for (int i = 0; i < N; i++) {
                make_prompt(prompts[i], lens[i], (uint32_t)i + 80);
                submit_full(h, ids[i], prompts[i], lens[i], (uint32_t)max_tokens[i], NULL, 0, -1, -1,
                            &(submit_opts){.min_tokens = i == 3 ? 10 : 0});
        }
        go(h);
        collect(h, ids, res, N);
        for (int i = 0; i < N; i++) {
                uint32_t want[8];
                expected(prompts[i], lens[i], outs[i], want);
                assert_int_equal(res[i].n, outs[i]);
                assert_int_equal(res[i].num_generated, outs[i]);
                assert_memory_equal(res[i].tokens, want, outs[i] * sizeof(uint32_t));
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_LENGTH);
        }
        assert_int_equal(model_records(h).max_pos_end, 32 - 1);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* No step runs more than max_num_batched_tokens tokens or max_num_seqs sequences, and
 * both limits are reached (the check is not vacuous): a heavy mix of long and short
 * prompts, priorities, shared prefixes, prompt logprobs and seeded sampling on a KV
 * cache that forces preemption, under either policy. */
static void step_limits(bool priority) {
        enum { N = 30, BUDGET = 16, SEQS = 6 };
        harness *h = held(40, BUDGET, SEQS, true, 0);
        uint32_t prompts[N][40], shared[40];
        size_t lens[N];
        uint32_t max_tokens[N];
        const char *ids[N];
        char names[N][8];
        static result res[N];
        memset(res, 0, sizeof(res));
        h->params.priority_scheduling = priority;
        make_prompt(shared, 40, 90);
        for (int i = 0; i < N; i++) {
                submit_opts so = {.priority = (int32_t)(i * 7 % 5) - 2};
                lens[i] = 2 + (size_t)(i * 13) % 39;
                max_tokens[i] = 3 + (uint32_t)(i * 11) % 28;
                if (i % 5 == 0)
                        memcpy(prompts[i], shared, sizeof(shared));
                else
                        make_prompt(prompts[i], lens[i], (uint32_t)i + 200);
                if (i % 4 == 3) {
                        so.temperature = 5.0f;
                        so.has_seed = true;
                        so.seed = (uint64_t)i;
                }
                snprintf(names[i], sizeof(names[i]), "s%d", i);
                ids[i] = names[i];
                submit_full(h, ids[i], prompts[i], lens[i], max_tokens[i], NULL, 0, -1, i % 7 == 6 ? 1 : -1, &so);
        }
        go(h);
        collect(h, ids, res, N);
        for (int i = 0; i < N; i++) {
                uint32_t want[32];
                assert_int_equal(res[i].n, max_tokens[i]);
                assert_int_equal(res[i].finish, TSR_ENGINE_FINISH_LENGTH);
                expected(prompts[i], lens[i], max_tokens[i], want);
                if (i % 4 != 3 && memcmp(res[i].tokens, want, max_tokens[i] * sizeof(uint32_t)) != 0)
                        fail_msg("s%d: greedy tokens differ from the fake model's", i);
        }
        step_records r = model_records(h);
        tsr_engine_stats st = idle_stats(h);
        /* With micro-batches the running requests (max_num_seqs in all) are split over
         * the steps in flight, so a step's sequences stay under the limit; two steps
         * were in the model at once. */
        if (r.max_step_tokens != BUDGET || (g_queue ? r.max_step_seqs > SEQS : r.max_step_seqs != SEQS))
                fail_msg("%s policy: at most %zu tokens and %zu sequences in a step (limits %d and %d)",
                         priority ? "priority" : "fcfs", r.max_step_tokens, r.max_step_seqs, BUDGET, SEQS);
        pthread_mutex_lock(&h->fm.mu);
        assert_int_equal(h->fm.max_queued, g_queue ? 2 : 0);
        pthread_mutex_unlock(&h->fm.mu);
        assert_true(st.num_preemptions_total > 0);
        assert_true(st.prefix_cache_hits_total > 0);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

static void test_step_limits_fcfs(void **state) { step_limits(false); }
static void test_step_limits_priority(void **state) { step_limits(true); }

/* --long-prefill-token-threshold: with a threshold, no sequence runs more than that many
 * tokens in a step, though the budget would take whole prompts, and the cap is reached
 * (prompts of 23 and 30 tokens go in chunks of 5); the outputs are the same as without
 * it.  Without a threshold the same prompts go whole. */
static void long_prefill(uint32_t threshold, size_t want_max_chunk) {
        harness *h = held(64, 256, 8, false, 0);
        uint32_t p1[23], p2[30], w1[6], w2[6];
        const char *ids[2] = {"a", "b"};
        static result res[2];
        memset(res, 0, sizeof(res));
        h->params.long_prefill_token_threshold = threshold;
        make_prompt(p1, 23, 7);
        make_prompt(p2, 30, 8);
        submit(h, "a", p1, 23, 6, NULL, 0);
        submit(h, "b", p2, 30, 6, NULL, 0);
        go(h);
        collect(h, ids, res, 2);
        expected(p1, 23, 6, w1);
        expected(p2, 30, 6, w2);
        assert_int_equal(res[0].n, 6);
        assert_int_equal(res[1].n, 6);
        assert_memory_equal(res[0].tokens, w1, sizeof(w1));
        assert_memory_equal(res[1].tokens, w2, sizeof(w2));
        assert_int_equal(model_records(h).max_chunk, want_max_chunk);
        stop(h);
}

static void test_long_prefill_threshold_caps_chunks(void **state) { long_prefill(5, 5); }
static void test_long_prefill_threshold_zero_is_no_cap(void **state) { long_prefill(0, 30); }

/* params.prefill_align (a Mamba scan's chunk of 8): with a budget of 20, prompts of 23
 * and 30 tokens and a third of 13 go in pieces that end at multiples of 8 or at their
 * prompt's end (a piece that would end inside the chunk it starts waits for a step with
 * more budget); the outputs are those of a run without it, which cuts at other places.
 * A budget smaller than the chunk (5) cuts pieces where it must: nothing starves. */
static size_t prefill_aligned(uint32_t align, uint32_t max_batched) {
        harness *h = held(64, max_batched, 8, false, 0);
        uint32_t p[3][30], want[3][6];
        const size_t lens[3] = {23, 30, 13};
        const char *ids[3] = {"a", "b", "c"};
        static result res[3];
        memset(res, 0, sizeof(res));
        h->params.prefill_align = align;
        h->fm.align = 8;
        for (int i = 0; i < 3; i++) {
                make_prompt(p[i], lens[i], (uint32_t)i + 7);
                expected(p[i], lens[i], 6, want[i]);
                submit(h, ids[i], p[i], lens[i], 6, NULL, 0);
        }
        go(h);
        collect(h, ids, res, 3);
        for (int i = 0; i < 3; i++)
                assert_memory_equal(res[i].tokens, want[i], sizeof(want[i]));
        pthread_mutex_lock(&h->fm.mu);
        size_t misaligned = h->fm.misaligned;
        pthread_mutex_unlock(&h->fm.mu);
        stop(h);
        return misaligned;
}

static void test_prefill_align(void **state) {
        (void)state;
        assert_int_equal(prefill_aligned(8, 20), 0);
        assert_true(prefill_aligned(0, 20) > 0);        /* the same run cuts elsewhere without it */
        assert_true(prefill_aligned(8, 5) > 0);         /* budget < chunk: cut anyway, and done */

        /* prompt_logprobs with 5 logits rows a step, fewer than the chunk: cut at 5 */
        harness *h = held(64, 20, 8, false, 5);
        uint32_t p[23], want[4];
        const char *ids[1] = {"lp"};
        static result res[1];
        memset(res, 0, sizeof(res));
        h->params.prefill_align = 8;
        make_prompt(p, 23, 3);
        expected(p, 23, 4, want);
        submit_lp(h, "lp", p, 23, 4, NULL, 0, -1, 0);
        go(h);
        collect(h, ids, res, 1);
        assert_memory_equal(res[0].tokens, want, sizeof(want));
        assert_int_equal(res[0].n_plp, 22);
        assert_int_equal(model_records(h).max_chunk, 5);
        stop(h);
}

/* ---- recurrent-state slots (a Mamba hybrid's per-request conv + SSM state) ---------- */

/* A harness whose model keeps state in `slots` slots (prefix caching off, as the worker
 * runs such a model). */
static harness *held_state(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, uint32_t slots) {
        harness *h = held(blocks, max_batched, max_seqs, false, 0);
        h->params.state_slots = slots;
        h->fm.state_slots = slots;
        h->fm.state_len = calloc(slots, sizeof(size_t));
        h->fm.state_hash = calloc(slots, sizeof(uint64_t));
        return h;
}

/* Five requests, two slots, room for eight by max_num_seqs and blocks: at most two run
 * in any step, every output is right (the fake model checks each chunk finds its own
 * history in its slot), and both slots are free again at the end. */
static void test_state_slots_bound_admission(void **state) {
        harness *h = held_state(256, 256, 8, 2);
        uint32_t prompts[5][12], want[5][10];
        result res[5];
        const char *ids[5] = {"s0", "s1", "s2", "s3", "s4"};

        (void)state;
        memset(res, 0, sizeof(res));
        for (int i = 0; i < 5; i++) {
                make_prompt(prompts[i], 12, (uint32_t)i + 40);
                expected(prompts[i], 12, 10, want[i]);
                submit(h, ids[i], prompts[i], 12, 10, NULL, 0);
        }
        go(h);
        collect(h, ids, res, 5);
        for (int i = 0; i < 5; i++)
                assert_memory_equal(res[i].tokens, want[i], sizeof(want[i]));
        assert_int_equal(model_records(h).max_step_seqs, 2);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.state_slots_total, 2);
        assert_int_equal(st.state_slots_free, 2);
        stop(h);
}

/* Too few KV blocks for the requests that hold slots: preemption gives the victim's
 * slot back and its recompute starts a fresh state (past 0) in whatever slot it gets
 * next; the outputs are those of an unpreempted run. */
static void test_state_slots_freed_on_preemption(void **state) {
        harness *h = held_state(20, 8, 8, 4);
        uint32_t prompts[8][30], want[8][16];
        size_t lens[8];
        result res[8];
        const char *ids[8] = {"p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"};

        (void)state;
        memset(res, 0, sizeof(res));
        for (int i = 0; i < 8; i++) {
                lens[i] = 5 + (size_t)(i * 11) % 25;
                make_prompt(prompts[i], lens[i], (uint32_t)i + 70);
                expected(prompts[i], lens[i], 16, want[i]);
                submit(h, ids[i], prompts[i], lens[i], 16, NULL, 0);
        }
        go(h);
        collect(h, ids, res, 8);
        for (int i = 0; i < 8; i++)
                if (res[i].n != 16 || memcmp(res[i].tokens, want[i], sizeof(want[i])) != 0)
                        fail_msg("request %d: %zu tokens, or wrong tokens", i, res[i].n);
        tsr_engine_stats st = idle_stats(h);
        assert_true(st.num_preemptions_total > 0);
        assert_int_equal(st.state_slots_free, 4);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* One slot: a second request waits for it while the first runs, and gets it when the
 * first is aborted (and again when that one finishes). */
static void test_state_slot_freed_on_abort_and_finish(void **state) {
        harness *h = held_state(256, 64, 8, 1);
        uint32_t prompt[12], p2[6], want[5];
        result res[1] = {0};
        const char *ids[] = {"second"};

        (void)state;
        make_prompt(prompt, 12, 90);
        make_prompt(p2, 6, 91);
        expected(p2, 6, 5, want);
        submit(h, "long", prompt, 12, 1000, NULL, 0);
        h->fm.hold_at = 2;      /* "long" runs, holding the one slot; held, so it cannot */
        go(h);                  /* finish its 1000 tokens before the abort on a busy machine */
        wait_holding(h);
        submit(h, "second", p2, 6, 5, NULL, 0);
        abort_req(h, "long");
        release(h);
        collect(h, ids, res, 1);
        assert_memory_equal(res[0].tokens, want, sizeof(want));
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.state_slots_free, 1);
        assert_int_equal(st.num_running, 0);
        assert_true(st.generation_tokens_total < 1000);
        stop(h);
}

/* ---- prefix caching of the recurrent state (vLLM's Mamba prefix caching) ---- */

static harness *held_state_cached(uint64_t blocks, uint32_t max_batched, uint32_t max_seqs, uint32_t slots) {
        harness *h = held_state(blocks, max_batched, max_seqs, slots);
        h->params.enable_prefix_caching = true;
        return h;
}

static size_t fake_count(harness *h, const size_t *field) {
        pthread_mutex_lock(&h->fm.mu);
        size_t n = *field;
        pthread_mutex_unlock(&h->fm.mu);
        return n;
}

/* One request alone, then one sharing its first blocks: the first's prompt (14 tokens,
 * one chunk) keeps the states after 4, 8 and 12 tokens on the way; the second (15
 * tokens, its first 12 the same) hits those 3 blocks (at most (15 - 1) / 4 = 3), starts
 * from a copy of the state at 12 (the fake model fails a chunk whose slot does not hold
 * exactly its prefix) and gives the unshared run's tokens. */
static void test_state_prefix_cache_hit(void **state) {
        harness *h = held_state_cached(64, 64, 4, 4);
        uint32_t a[14], b[15], wa[6], wb[6];
        result ra[1] = {0}, rb[1] = {0};
        const char *ia[] = {"a"}, *ib[] = {"b"};

        (void)state;
        make_prompt(a, 14, 5);
        memcpy(b, a, 12 * sizeof(uint32_t));
        b[12] = 3, b[13] = 9, b[14] = 27;
        expected(a, 14, 6, wa);
        expected(b, 15, 6, wb);
        go(h);
        submit(h, "a", a, 14, 6, NULL, 0);
        collect(h, ia, ra, 1);
        assert_int_equal(model_records(h).max_chunk, 14);       /* no chunk is cut for a save */
        submit(h, "b", b, 15, 6, NULL, 0);
        collect(h, ib, rb, 1);
        assert_memory_equal(ra[0].tokens, wa, sizeof(wa));
        assert_memory_equal(rb[0].tokens, wb, sizeof(wb));
        assert_int_equal(ra[0].cached, 0);
        assert_int_equal(rb[0].cached, 12);
        assert_true(fake_count(h, &h->fm.restores) == 1);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.prefix_cache_hits_total, 12);
        assert_int_equal(st.state_slots_free, 4);       /* kept states are not held */
        stop(h);
}

/* The attention blocks are cached further than a state was kept: the hit is cut back to
 * the last block with a state.  A state block of 8 tokens (2 blocks): "a" (22 tokens,
 * in chunks of 9, 9 and 4) keeps the states at 8 and 16, inside its chunks (and 24
 * decoding).  "b" shares
 * a's first 12 tokens: its attention hit would be 3 blocks, but no state was kept at
 * 12, so it starts from the one at 8. */
static void test_state_prefix_cache_hit_cut_to_a_state(void **state) {
        harness *h = held_state_cached(64, 9, 4, 6);
        h->params.state_block = 8;
        uint32_t a[22], b[17], wa[4], wb[4];
        result ra[1] = {0}, rb[1] = {0};
        const char *ia[] = {"a"}, *ib[] = {"b"};

        (void)state;
        make_prompt(a, 22, 6);
        memcpy(b, a, 12 * sizeof(uint32_t));
        make_prompt(b + 12, 5, 77);
        expected(a, 22, 4, wa);
        expected(b, 17, 4, wb);
        go(h);
        submit(h, "a", a, 22, 4, NULL, 0);
        collect(h, ia, ra, 1);
        assert_int_equal(model_records(h).max_chunk, 9);
        assert_int_equal(fake_count(h, &h->fm.saves), 3);      /* 8, 16; 24 decoding */
        submit(h, "b", b, 17, 4, NULL, 0);
        collect(h, ib, rb, 1);
        assert_memory_equal(ra[0].tokens, wa, sizeof(wa));
        assert_memory_equal(rb[0].tokens, wb, sizeof(wb));
        assert_int_equal(rb[0].cached, 8);
        tsr_engine_stats st = idle_stats(h);
        assert_int_equal(st.prefix_cache_hits_total, 8);
        stop(h);
}

/* States kept at block boundaries reached while decoding serve a next turn: "t1" (a
 * prompt of 6) generates 14 tokens, its decode steps passing positions 8, 12 and 16;
 * "t2" sends t1's whole text plus 3 tokens (23): at most (23 - 1) / 4 = 5 blocks, but
 * t1 never ran its last token (sampled, not computed), so block 4 is not full and the
 * hit is 4 blocks, from the state its decode step kept at 16. */
static void test_state_prefix_cache_next_turn(void **state) {
        harness *h = held_state_cached(64, 64, 4, 6);
        uint32_t p1[6], w1[14], p2[23], w2[5];
        result r1[1] = {0}, r2[1] = {0};
        const char *i1[] = {"t1"}, *i2[] = {"t2"};

        (void)state;
        make_prompt(p1, 6, 8);
        expected(p1, 6, 14, w1);
        memcpy(p2, p1, sizeof(p1));
        memcpy(p2 + 6, w1, sizeof(w1));
        p2[20] = 4, p2[21] = 40, p2[22] = 44;
        expected(p2, 23, 5, w2);
        go(h);
        submit(h, "t1", p1, 6, 14, NULL, 0);
        collect(h, i1, r1, 1);
        submit(h, "t2", p2, 23, 5, NULL, 0);
        collect(h, i2, r2, 1);
        assert_memory_equal(r1[0].tokens, w1, sizeof(w1));
        assert_memory_equal(r2[0].tokens, w2, sizeof(w2));
        assert_int_equal(r2[0].cached, 16);
        stop(h);
}

/* Many requests over few slots, shared prefixes, chunking and preemption (few blocks):
 * every output is the unshared run's, the kept states are evicted to make room for
 * running ones (never the other way round: all run to the end), and at the end no slot
 * is held and no block is in use. */
static void test_state_prefix_cache_under_pressure(void **state) {
        harness *h = held_state_cached(24, 8, 8, 6);
        uint32_t prompts[12][26], want[12][12];
        size_t lens[12];
        result res[12];
        const char *ids[12] = {"q0", "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "q10", "q11"};

        (void)state;
        memset(res, 0, sizeof(res));
        for (int i = 0; i < 12; i++) {
                lens[i] = 9 + (size_t)(i * 7) % 17;
                make_prompt(prompts[i], lens[i], 100);          /* one shared stem */
                prompts[i][lens[i] - 1] = 1 + (uint32_t)i;      /* each its own last token */
                if (i % 3 == 0)
                        make_prompt(prompts[i] + 4, lens[i] - 5, 200 + (uint32_t)i);
                expected(prompts[i], lens[i], 12, want[i]);
                submit(h, ids[i], prompts[i], lens[i], 12, NULL, 0);
        }
        go(h);
        collect(h, ids, res, 12);
        for (int i = 0; i < 12; i++)
                if (res[i].n != 12 || memcmp(res[i].tokens, want[i], sizeof(want[i])) != 0)
                        fail_msg("request %d: %zu tokens, or wrong tokens", i, res[i].n);
        tsr_engine_stats st = idle_stats(h);
        assert_true(st.prefix_cache_hits_total > 0);
        assert_true(fake_count(h, &h->fm.saves) > 0);
        assert_int_equal(st.state_slots_free, 6);
        assert_int_equal(st.kv_blocks_free, st.kv_blocks_total);
        stop(h);
}

/* ---- structured outputs: the matcher masks the fake model's logits ---- */

/* A raw vocabulary over the fake model's 97 ids: id 0 the EOS (a stop token), ids 1..94
 * the characters '!'..'~', 95 "ab", 96 "12" (a two-character token). */
static tsr_grammar_vocab *raw_vocab(void) {
        static char chars[VOCAB][3];
        const char *toks[VOCAB];
        const uint32_t eos = EOS;
        tsr_grammar_vocab *v = NULL;
        char err[256];
        toks[0] = "";
        for (uint32_t i = 1; i <= 94; i++) {
                chars[i][0] = (char)('!' + i - 1);
                toks[i] = chars[i];
        }
        toks[95] = "ab";
        toks[96] = "12";
        assert_int_equal(tsr_grammar_vocab_new(toks, VOCAB, VOCAB, TSR_GRAMMAR_VOCAB_RAW, false, &eos, 1, 1, &v, err,
                                               sizeof(err)), TSR_OK);
        return v;
}

/* reasoning_end: the constraint starts after this output token (-1: at once). */
/* A request of 20 tokens at most under the grammar, with so's sampling. */
static void submit_grammar_so(harness *h, const char *id, tsr_grammar_kind kind, const char *text,
                              const submit_opts *so, int64_t reasoning_end) {
        uint32_t prompt[6];
        tsr_engine_in *in;
        make_prompt(prompt, 6, (uint32_t)strlen(id));
        tsr_engine_in *queued[16];
        size_t n = 0;
        submit_full(h, id, prompt, 6, 20, NULL, 0, -1, -1, so);
        /* the submit just queued (the last; the engine has not started) gets its spec */
        while (n < 16 && (in = tsr_queue_pop(h->in)))
                queued[n++] = in;
        assert_true(n > 0);
        in = queued[n - 1];
        in->submit.so_kind = kind;
        in->submit.so_text = strdup(text);
        in->submit.so_len = strlen(text);
        in->submit.so_reasoning_end = reasoning_end;
        for (size_t i = 0; i < n; i++)
                assert_int_equal(tsr_queue_push(h->in, queued[i]), TSR_OK);
}

static void submit_grammar_after(harness *h, const char *id, tsr_grammar_kind kind, const char *text, bool ignore_eos,
                                 int64_t reasoning_end) {
        submit_grammar_so(h, id, kind, text, &(submit_opts){.ignore_eos = ignore_eos}, reasoning_end);
}

static void submit_grammar(harness *h, const char *id, tsr_grammar_kind kind, const char *text, bool ignore_eos) {
        submit_grammar_after(h, id, kind, text, ignore_eos, -1);
}

static void text_of(const result *r, char *out) {
        size_t n = 0;
        for (size_t i = 0; i < r->n; i++) {
                uint32_t t = r->tokens[i];
                if (t == EOS)
                        continue;
                if (t <= 94)
                        out[n++] = (char)('!' + t - 1);
                else {
                        memcpy(out + n, t == 95 ? "ab" : "12", 2);
                        n += 2;
                }
        }
        out[n] = '\0';
}

static void test_structured_output(void **state) {
        tsr_grammar_vocab *v = raw_vocab();
        tsr_grammar_pool *pool = NULL;
        harness *h;
        const char *ids[3] = {"regex", "plain", "choice"};
        result res[3];
        char text[64];
        uint32_t prompt[6], want[20];
        (void)state;
        assert_int_equal(tsr_grammar_pool_new(v, &pool), TSR_OK);
        memset(res, 0, sizeof(res));
        h = held(64, 64, 8, false, 0);
        h->params.grammar = pool;
        submit_grammar(h, "regex", TSR_GRAMMAR_REGEX, "[0-9]{3}x", false);
        make_prompt(prompt, 6, 5);
        submit(h, "plain", prompt, 6, 20, NULL, 0);
        submit_grammar(h, "choice", TSR_GRAMMAR_CHOICE, "[\"ab12\",\"zz\"]", true);
        go(h);
        collect(h, ids, res, 3);
        /* greedy under the mask: the fake model's favourite is never allowed, ties go to the
         * lowest id; the grammar ends the request (EOS accepted: "stop") */
        text_of(&res[0], text);
        assert_string_equal(text, "000x");
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_STOP);
        assert_int_equal(res[0].tokens[res[0].n - 1], EOS);
        /* the unconstrained request beside them runs as alone */
        expected(prompt, 6, 20, want);
        assert_int_equal(res[1].n, 20);
        assert_memory_equal(res[1].tokens, want, sizeof(want));
        /* ignore_eos: once only the stop token is allowed the request ends, without it */
        text_of(&res[2], text);
        assert_true(strcmp(text, "ab12") == 0 || strcmp(text, "zz") == 0);
        assert_int_equal(res[2].finish, TSR_ENGINE_FINISH_STOP);
        assert_int_not_equal(res[2].tokens[res[2].n - 1], EOS);
        stop(h);
        tsr_grammar_pool_free(&pool);
        tsr_grammar_vocab_free(&v);
}

/* A model that answers masks (a multi-node replica's last node): the step's masks are
 * filled before its forward and its rows under a grammar come back as tokens, the mask
 * applied by the model; the same outputs as the engine sampling them, one step at a time
 * and with two steps in flight (micro-batches, a budget of 2 tokens: two requests' steps
 * alternate with the other two's, so one step's masks are planned while another's are in flight, and the
 * drawn request's rows, which the model does not answer, are sampled by the engine with
 * its own step's masks). */
static void test_model_answers_masks(void **state) {
        tsr_grammar_vocab *v = raw_vocab();
        tsr_grammar_pool *pool = NULL;
        const char *ids[4] = {"regex", "plain", "choice", "drawn"};
        result res[3][4];
        size_t answered[3];
        uint32_t prompt[6];
        (void)state;
        assert_int_equal(tsr_grammar_pool_new(v, &pool), TSR_OK);
        memset(res, 0, sizeof(res));
        make_prompt(prompt, 6, 5);
        for (int run = 0; run < 3; run++) {     /* engine samples; model answers; answers, queued */
                harness *h = held(64, 2, 8, false, 0);
                h->params.grammar = pool;
                h->fm.argmax = run > 0;
                h->fm.answers_masks = h->model.answers_masks = run > 0;
                if (run == 2) {
                        h->params.async_scheduling = false;
                        h->model.max_in_flight = 2;
                        h->model.submit = fake_submit;
                        h->model.wait = fake_wait;
                }
                submit_grammar(h, "regex", TSR_GRAMMAR_REGEX, "[0-9]{3}x", false);
                submit(h, "plain", prompt, 6, 20, NULL, 0);
                submit_grammar(h, "choice", TSR_GRAMMAR_CHOICE, "[\"ab12\",\"zz\"]", true);
                submit_grammar_so(h, "drawn", TSR_GRAMMAR_REGEX, "[0-9a-z]{12}x",
                                  &(submit_opts){.temperature = 0.9f, .has_seed = true, .seed = 5}, -1);
                go(h);
                collect(h, ids, res[run], 4);
                pthread_mutex_lock(&h->fm.mu);
                answered[run] = h->fm.answered_masks;
                pthread_mutex_unlock(&h->fm.mu);
                stop(h);
        }
        assert_int_equal(answered[0], 0);
        /* regex's 4 rows ("000x"; the row where only EOS is left is the grammar's end, not
         * offered) and choice's, as tokens, in both answering runs */
        print_message("rows answered under a grammar: %zu, queued %zu\n", answered[1], answered[2]);
        assert_true(answered[1] >= 4 + 2 && answered[2] >= 4 + 2);
        for (int run = 1; run < 3; run++)
                for (int r = 0; r < 4; r++) {
                        assert_int_equal(res[run][r].n, res[0][r].n);
                        assert_memory_equal(res[run][r].tokens, res[0][r].tokens, res[0][r].n * sizeof(uint32_t));
                        assert_int_equal(res[run][r].finish, res[0][r].finish);
                }
        tsr_grammar_pool_free(&pool);
        tsr_grammar_vocab_free(&v);
}

/* With a reasoning end token the output is free until that token and constrained after
 * it (vLLM with a reasoning parser): "think" reasons as it would unconstrained, emits the
 * end token (the fake model's own choice at step j), then follows the regex; "endless"
 * never meets its end token and runs unconstrained to max_tokens. */
static void test_structured_output_after_reasoning(void **state) {
        tsr_grammar_vocab *v = raw_vocab();
        tsr_grammar_pool *pool = NULL;
        const char *ids[2] = {"think", "endless"};
        result res[2];
        uint32_t prompt[6], free_run[2][20];
        size_t j = 0;
        int64_t never = -1;
        char text[64];
        (void)state;
        for (int k = 0; k < 2; k++) {       /* the prompts submit_grammar_after makes */
                make_prompt(prompt, 6, (uint32_t)strlen(ids[k]));
                expected(prompt, 6, 20, free_run[k]);
        }
        /* the end token: the first output token that did not occur before it, at j >= 2,
         * with a token before it the regex would refuse (so no mask ran while reasoning) */
        for (j = 2; j < 10; j++) {
                bool seen = false;
                for (size_t i = 0; i < j; i++)
                        seen |= free_run[0][i] == free_run[0][j];
                if (!seen)
                        break;
        }
        assert_true(j < 10 && free_run[0][j] != EOS);
        bool refused_before = false;
        for (size_t i = 0; i < j; i++)
                refused_before |= !(free_run[0][i] >= 16 && free_run[0][i] <= 25);     /* not '0'..'9' */
        assert_true(refused_before);
        for (uint32_t t = 1; t < VOCAB && never < 0; t++) {
                bool used = false;
                for (size_t i = 0; i < 20; i++)
                        used |= free_run[1][i] == t;
                if (!used)
                        never = t;
        }
        assert_true(never > 0);

        assert_int_equal(tsr_grammar_pool_new(v, &pool), TSR_OK);
        memset(res, 0, sizeof(res));
        harness *h = held(64, 64, 8, false, 0);
        h->params.grammar = pool;
        submit_grammar_after(h, "think", TSR_GRAMMAR_REGEX, "[0-9]{3}x", false, free_run[0][j]);
        submit_grammar_after(h, "endless", TSR_GRAMMAR_REGEX, "[0-9]{3}x", false, never);
        go(h);
        collect(h, ids, res, 2);
        assert_true(res[0].n > j + 1);
        assert_memory_equal(res[0].tokens, free_run[0], (j + 1) * sizeof(uint32_t));
        result after = {0};
        after.n = res[0].n - (j + 1);
        memcpy(after.tokens, res[0].tokens + j + 1, after.n * sizeof(uint32_t));
        text_of(&after, text);
        assert_int_equal(strlen(text), 4);
        for (int i = 0; i < 3; i++)
                assert_true(text[i] >= '0' && text[i] <= '9');
        assert_int_equal(text[3], 'x');
        assert_int_equal(res[0].finish, TSR_ENGINE_FINISH_STOP);
        assert_int_equal(res[1].n, 20);
        assert_memory_equal(res[1].tokens, free_run[1], sizeof(free_run[1]));
        assert_int_equal(res[1].finish, TSR_ENGINE_FINISH_LENGTH);
        stop(h);
        tsr_grammar_pool_free(&pool);
        tsr_grammar_vocab_free(&v);
}

/* A spec that does not compile ends its request with an INVALID Error and nothing else;
 * a worker without a grammar pool refuses structured outputs the same way. */
static void test_structured_output_refused(void **state) {
        tsr_grammar_vocab *v = raw_vocab();
        tsr_grammar_pool *pool = NULL;
        uint32_t prompt[6], want[20];
        bool errored = false, finished = false;
        (void)state;
        assert_int_equal(tsr_grammar_pool_new(v, &pool), TSR_OK);
        for (int with_pool = 1; with_pool >= 0; with_pool--) {
                harness *h = held(64, 64, 8, false, 0);
                result ok;
                memset(&ok, 0, sizeof(ok));
                h->params.grammar = with_pool ? pool : NULL;
                submit_grammar(h, "bad", TSR_GRAMMAR_REGEX, "([0-9]", false);
                make_prompt(prompt, 6, 9);
                submit(h, "good", prompt, 6, 20, NULL, 0);
                go(h);
                errored = finished = false;
                while (!errored || !finished) {
                        tsr_engine_out *o = tsr_queue_pop_wait(h->out, 20000);
                        assert_non_null(o);
                        if (o->kind == TSR_ENGINE_OUT_ERROR) {
                                assert_string_equal(o->request_id, "bad");
                                assert_int_equal(o->error_code, TSR_ENGINE_ERROR_INVALID);
                                assert_false(o->retryable);
                                errored = true;
                        }
                        for (size_t i = 0; i < o->n_outputs; i++) {
                                tsr_engine_req_output *ro = &o->outputs[i];
                                assert_string_equal(ro->request_id, "good");
                                for (uint32_t t = 0; t < ro->n_new; t++)
                                        ok.tokens[ok.n++] = ro->new_tokens[t];
                                finished |= ro->finish != TSR_ENGINE_FINISH_NONE;
                        }
                        tsr_engine_out_free(o);
                }
                expected(prompt, 6, 20, want);
                assert_int_equal(ok.n, 20);
                assert_memory_equal(ok.tokens, want, sizeof(want));
                stop(h);
        }
        tsr_grammar_pool_free(&pool);
        tsr_grammar_vocab_free(&v);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_structured_output),
        cmocka_unit_test(test_model_answers_masks),
                cmocka_unit_test(test_structured_output_refused),
                cmocka_unit_test(test_structured_output_after_reasoning),
                cmocka_unit_test(test_single_request_greedy),
                cmocka_unit_test(test_argmax_none_is_an_error),
                cmocka_unit_test(test_model_answers_logprobs),
                cmocka_unit_test(test_model_answers_rules),
                cmocka_unit_test(test_step_time_with_steps_in_flight),
                cmocka_unit_test(test_device_draws),
                cmocka_unit_test(test_many_concurrent_with_preemption_and_chunking),
                cmocka_unit_test(test_prefix_cache_hit_same_output),
                cmocka_unit_test(test_kv_renewal_waits_for_the_step_in_flight),
                cmocka_unit_test(test_hybrid_tables),
                cmocka_unit_test(test_stop_token_and_eos),
                cmocka_unit_test(test_abort_frees_blocks),
                cmocka_unit_test(test_prompt_chunks_pipelined),
                cmocka_unit_test(test_failed_chunk_with_the_next_in_flight),
                cmocka_unit_test(test_abort_with_chunks_in_flight),
                cmocka_unit_test(test_too_long_prompt_refused),
                cmocka_unit_test(test_prompt_logprobs),
                cmocka_unit_test(test_prompt_logprobs_edge_cases),
                cmocka_unit_test(test_n_siblings_share_prompt_kv),
                cmocka_unit_test(test_n_siblings_share_prompt_kv_chunked),
                cmocka_unit_test(test_shared_prefix_waits_only_for_shared_blocks),
                cmocka_unit_test(test_shutdown_lets_inflight_finish),
                cmocka_unit_test(test_shutdown_timeout_aborts_the_rest),
                cmocka_unit_test(test_async_matches_sync),
                cmocka_unit_test(test_priority_admission_order),
                cmocka_unit_test(test_fcfs_admission_ignores_priority),
                cmocka_unit_test(test_priority_preempts_largest_priority_value),
                cmocka_unit_test(test_fcfs_preempts_last_admitted),
                cmocka_unit_test(test_priority_waiting_never_preempts),
                cmocka_unit_test(test_eos_finishes_unless_ignore_eos),
                cmocka_unit_test(test_extra_eos_ids_are_stop_ids),
                cmocka_unit_test(test_length_at_max_model_len),
                cmocka_unit_test(test_step_limits_fcfs),
                cmocka_unit_test(test_step_limits_priority),
                cmocka_unit_test(test_long_prefill_threshold_caps_chunks),
                cmocka_unit_test(test_long_prefill_threshold_zero_is_no_cap),
                cmocka_unit_test(test_prefill_align),
                cmocka_unit_test(test_state_slots_bound_admission),
                cmocka_unit_test(test_state_slots_freed_on_preemption),
                cmocka_unit_test(test_state_slot_freed_on_abort_and_finish),
                cmocka_unit_test(test_state_prefix_cache_hit),
                cmocka_unit_test(test_state_prefix_cache_hit_cut_to_a_state),
                cmocka_unit_test(test_state_prefix_cache_next_turn),
                cmocka_unit_test(test_state_prefix_cache_under_pressure),
        };
        int failed = cmocka_run_group_tests_name("engine", tests, NULL, NULL);
        g_async = true;
        failed += cmocka_run_group_tests_name("engine --async-scheduling", tests, NULL, NULL);
        /* As on a device: every greedy row the engine offers comes back as its argmax
         * (fake_model.argmax), the row itself poisoned; every test must hold as before. */
        g_async = false;
        g_argmax = true;
        failed += cmocka_run_group_tests_name("engine, argmax from the model", tests, NULL, NULL);
        /* As a pipeline of stages: two steps in the model at once (loop_queue). */
        g_argmax = false;
        g_queue = true;
        failed += cmocka_run_group_tests_name("engine, pipeline micro-batches", tests, NULL, NULL);
        /* Both: a pipeline whose last stage answers greedy rows with their token (a
         * multi-node replica's last node does, nodes.c token_back). */
        g_argmax = true;
        failed += cmocka_run_group_tests_name("engine, pipeline micro-batches, argmax from the model", tests, NULL,
                                              NULL);
        return failed;
}
