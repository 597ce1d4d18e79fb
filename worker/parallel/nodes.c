/* nodes.c - a replica over several nodes: the leader's steps and rejoin thread, the
 * follower's loop, the step plan on the wire (nodes.h).
 *
 * Messages on the group (tags; FIFO per peer and tag, so a constant tag per kind is
 * enough while one step is in flight):
 *   READY  follower -> 0 once per group: {u64 kv_blocks, u32 state_slots, u32 pad}
 *   CTL    0 -> every follower per step: {u64 step, u64 plan_bytes, u64 io_floats,
 *          u64 out_floats}, then PLAN (plan_bytes)
 *   ACT    stage s -> s + 1: [status i32, pad i32, io_floats floats]
 *   OUT    the last stage -> 0: [status i32, pad i32, out_floats floats]: per sequence in
 *          order its logits rows, or for one whose row goes back as its token (the
 *          plan's flag 4) one float slot holding the token's bits, and with flag 16 its
 *          logprobs after it (lp_floats: logprob, rank, n_top, lp_top ids, lp_top
 *          logprobs; integers as their bits); with flag 64 each prompt row as the same
 *          answer (the prompt's next token, its prompt logprobs), the rest whole
 * The header of ACT/OUT keeps the floats 8-byte aligned, as pipeline.c's messages.
 *
 * Plan encoding, little-endian u32 words: n_seqs, then per sequence a header of
 * SEQ_WORDS: seq_id (u64: two words, low first), n_table, n, past_len (u64), flags (1
 * want_logits, 2 want_all_logits, 4 its row comes back as its token: token_back, 8 and
 * drawn, 16 and its logprobs, 32 and the request's rules shape it, 128 and its penalties
 * with its history, 256 and the grammar's mask shapes it; 64 want_all_logits' prompt rows
 * come back as their prompt logprobs),
 * state_slot, restore_from + 1 (0: none; engine.h), n_saves, base, n_changes, prompt_len;
 * with flag 8 the draw (tsr_draw: temperature, top_k, top_p, min_p, then u, a double in
 * two words); with flag 16 lp_top; with flag 32 the rules (tsr_engine_seq.rules):
 * n_allowed, n_bias, n_masked, the allowed ids, the bias pairs (id, float bits), the ids
 * min_tokens masks at this position (EOS and stop ids; none once it is reached); with
 * flag 128 the repetition, presence and frequency penalties (float bits), n_history and
 * the request's tokens so far (the prompt's prompt_len, then its outputs); with flag 64
 * prompt_lp_top and next_token; with flag 256 n_mask_words and the mask's words
 * (tsr_engine_seq.grammar_mask); then its block tables (n_tables of n_table entries, one
 * after the other as the engine hands them; n_tables is the model's, known to both
 * sides) as changes against the receiver's copy (tsr_plan_tables): base 0, every entry of
 * every table;
 * base b > 0, the copy held b entries per table and its first b of each stay but for
 * n_changes (index, block) pairs (index into the new tables, t x n_table + i with
 * i < b), then each table's entries from b on; then tokens[n], then n_saves (pos, slot)
 * pairs. */
#include "worker/parallel/nodes.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "grammar/grammar.h"
#include "kernels/cpu/ref.h"
#include "worker/engine/sampler.h"
#include "worker/parallel/bootstrap.h"
#include "worker/parallel/comm.h"

enum { TAG_READY = 1, TAG_CTL = 2, TAG_PLAN = 3, TAG_ACT = 4, TAG_OUT = 5 };
#define HDR_FLOATS 2
/* A plan, a step's activations or logits larger than this is malformed (1 GiB). */
#define MAX_MSG_BYTES ((size_t)1 << 30)

typedef struct ready_msg {
        uint64_t kv_blocks;
        uint32_t state_slots, pad;
} ready_msg;

typedef struct ctl_msg {
        uint64_t step, plan_bytes, io_floats, out_floats;
} ctl_msg;

/* ---- the plan ---------------------------------------------------------------------- */

/* seq_id lo, hi, n_table, n, past_len lo, hi, flags, state_slot, restore_from + 1 (0:
 * none), n_saves, base, n_changes, prompt_len */
#define SEQ_WORDS 13

/* Whether q's one row comes back from the last node as its token: the engine offers the
 * token (tsr_engine_seq.token: nothing but temperature, top_k, top_p and min_p shapes
 * it, or also the rules the plan carries: rules_back), so the last node computes what
 * node 0's sampler would: the row's first maximum for a greedy one (tsr_ref_argmax),
 * else tsr_sample's token with the request's uniform (tsr_sample_uniform_given); a row
 * without an answer (TSR_ARGMAX_NONE) is the engine's TSR_E_INVAL, as from tsr_sample.
 * A decode step then sends 4 bytes a sequence back instead of vocab x 4. */
static bool token_back(const tsr_engine_seq *q) {
        return q->token && q->want_logits && !q->want_all_logits;
}

#define DRAW_WORDS 6             /* a drawn row's tsr_draw after its header (flag 8) */
#define LP_WORDS 1               /* lp_top after the draw (flag 16) */
#define RULES_WORDS 3            /* the rules' counts after lp_top (flag 32), then the lists */
#define PLP_WORDS 2              /* prompt_lp_top, next_token after the rules (flag 64) */
#define HISTORY_WORDS 4          /* the penalties and n_history after the rules (flag 128), then the ids */
#define MASK_WORDS 1             /* n_mask_words after the prompt-logprobs words (flag 256), then the mask */
/* an unpacked plan's bias pairs are read where they lie, as tsr_logit_bias records */
_Static_assert(sizeof(tsr_logit_bias) == 2 * sizeof(uint32_t) && offsetof(tsr_logit_bias, bias) == sizeof(uint32_t),
               "tsr_logit_bias is two words: id, bias");

/* A token_back row's logprobs come back too (tsr_engine_seq.lp: the engine offers them
 * to a model with answers_logprobs, which the runner sets for a replica whose vocabulary
 * holds the largest answer: TSR_NODES_LP_MIN_VOCAB). */
static bool lp_back(const tsr_engine_seq *q) { return token_back(q) && q->lp; }

/* A token_back row shaped by its request's allowed ids, logit bias or min_tokens' mask
 * (tsr_engine_seq.rules: the engine offers such rows to a model with answers_rules,
 * which the runner sets for a replica over nodes): the lists go with the plan, so the
 * last node samples as node 0's tsr_sample would (tsr_sample_uniform_given). */
static bool rules_back(const tsr_engine_seq *q) { return token_back(q) && q->rules; }

/* The ids min_tokens masks at q's position: its EOS and stop ids while below. */
static size_t masked_ids(const tsr_engine_seq *q) {
        return q->rules_mask_eos ? q->rules->n_eos + q->rules->n_stop : 0;
}

/* A prompt-logprobs chunk whose prompt rows come back as their logprobs (tsr_engine_seq.
 * prompt_lp: the engine offers them to a model with answers_logprobs): the answer of row
 * t is the prompt's next token and tsr_logprobs_gather of the row, node 0's own, 4 + 8k
 * bytes instead of vocab x 4. */
static bool plp_back(const tsr_engine_seq *q) { return q->prompt_lp && q->want_all_logits; }

/* Its leading rows that are prompt rows; the rest come back whole. */
static size_t plp_rows(const tsr_engine_seq *q) { return tsr_engine_seq_prompt_lp_rows(q); }

/* A token_back row under a grammar (tsr_engine_seq.grammar_mask: the engine offers it to a
 * model with answers_masks, which the runner sets for a replica over nodes, once the
 * step's masks are filled): the mask goes with the plan (vocab / 32 words: 6 KB for
 * SmolLM2's 49,152 tokens, its row 192 KB) and the last node masks the row with it
 * before it samples and gathers the logprobs, as node 0's engine does. */
static bool mask_back(const tsr_engine_seq *q) { return token_back(q) && q->grammar_mask; }

/* A rules row whose penalties need the request's tokens so far (tsr_engine_seq.history:
 * the engine offers it while they are fewer than the vocabulary). */
static bool history_back(const tsr_engine_seq *q) { return rules_back(q) && q->history; }

/* The plan words of q's rules (flag 32) and history (flag 128). */
static size_t rules_words(const tsr_engine_seq *q) {
        return rules_back(q) ? RULES_WORDS + q->rules->n_allowed + 2 * q->rules->n_bias + masked_ids(q) +
                                       (history_back(q) ? HISTORY_WORDS + q->n_history : 0)
                             : 0;
}

/* The floats of a token_back row's answer: its token, then with logprobs the
 * tsr_token_logprobs fields (logprob, rank, n_top, lp_top ids, lp_top logprobs). */
static size_t answer_len(bool with_lp, uint32_t lp_top) { return 1 + (with_lp ? 3 + 2 * (size_t)lp_top : 0); }
static size_t answer_floats(const tsr_engine_seq *q) { return answer_len(lp_back(q), q->lp_top); }

/* The floats of a step's OUT message: rows, or an answer per token_back sequence. */
static size_t out_wire_floats(const tsr_engine_seq *seqs, size_t n_seqs, size_t vocab) {
        size_t f = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                size_t k = plp_rows(&seqs[i]);
                f += token_back(&seqs[i]) ? answer_floats(&seqs[i])
                                          : k * answer_len(true, seqs[i].prompt_lp_top) +
                                                    (tsr_engine_seq_rows(&seqs[i]) - k) * vocab;
        }
        return f;
}

/* A token_back row's answer on the wire, answer_floats of them: the token's bits, then
 * with its logprobs (lp non-NULL, top = lp_top) logprob, rank, n_top, top ids and top
 * logprobs, integers as their bits.  answer_get reads what answer_put wrote into *lp
 * (NULL: none); TSR_E_PROTO for an n_top above top. */
static void answer_put(float *a, uint32_t token, const tsr_token_logprobs *lp, uint32_t top) {
        memcpy(&a[0], &token, sizeof token);
        if (!lp)
                return;
        a[1] = lp->logprob;
        memcpy(&a[2], &lp->rank, sizeof(uint32_t));
        memcpy(&a[3], &lp->n_top, sizeof(uint32_t));
        memcpy(&a[4], lp->top_ids, top * sizeof(uint32_t));
        memcpy(&a[4 + top], lp->top_logprobs, top * sizeof(float));
}

static tsr_status answer_get(const float *a, uint32_t *token, tsr_token_logprobs *lp, uint32_t top) {
        memcpy(token, &a[0], sizeof *token);
        if (!lp)
                return TSR_OK;
        memset(lp, 0, sizeof(*lp));
        lp->token = *token;
        lp->logprob = a[1];
        memcpy(&lp->rank, &a[2], sizeof(uint32_t));
        memcpy(&lp->n_top, &a[3], sizeof(uint32_t));
        memcpy(lp->top_ids, &a[4], top * sizeof(uint32_t));
        memcpy(lp->top_logprobs, &a[4 + top], top * sizeof(float));
        return lp->n_top > top ? TSR_E_PROTO : TSR_OK;
}

/* The last node: the step's logits rows (in place) into the OUT message's layout, each
 * token_back row replaced by its answer (its token; with logprobs, tsr_logprobs_gather of
 * the row as computed, the engine's own).  An answer is never longer than its row
 * (vocab >= TSR_NODES_LP_MIN_VOCAB: follow_steps refuses logprobs otherwise), so the
 * rows still to read are ahead of the writes.  scratch: TSR_SAMPLER_SCRATCH(vocab). */
static void rows_to_wire(const tsr_engine_seq *seqs, size_t n_seqs, size_t vocab, float *rows, float *scratch) {
        size_t rd = 0, wr = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_draw *d = seqs[i].draw;
                size_t k = tsr_engine_seq_rows(&seqs[i]) * vocab;
                if (token_back(&seqs[i])) {
                        uint32_t t = TSR_ARGMAX_NONE;
                        /* the grammar's mask first (a mask too short for the vocabulary
                         * is a row without an answer: node 0 fails the request) */
                        bool mask_ok = !seqs[i].grammar_mask || (size_t)seqs[i].grammar_mask_words * 32 >= vocab;
                        if (seqs[i].grammar_mask && mask_ok)
                                tsr_grammar_apply_mask(rows + rd, vocab, seqs[i].grammar_mask);
                        if (!mask_ok) {
                                /* t stays TSR_ARGMAX_NONE */
                        } else if (d || seqs[i].rules) {
                                /* the rules as unpacked (allowed ids, bias, the masked ids
                                 * as EOS ids with min_tokens 1), the draw's parameters */
                                tsr_sampling sp;
                                if (seqs[i].rules)
                                        sp = *seqs[i].rules;
                                else
                                        tsr_sampling_init(&sp);
                                sp.temperature = d ? d->temperature : 0.0f;
                                sp.top_k = d ? d->top_k : 0;
                                sp.top_p = d ? d->top_p : 1.0f;
                                sp.min_p = d ? d->min_p : 0.0f;
                                /* penalties: the history as node 0's sampler holds it, and
                                 * min_tokens' mask counted from it */
                                const tsr_engine_seq *q = &seqs[i];
                                tsr_sample_history h = {0};
                                if (q->history) {
                                        h = tsr_engine_seq_history(q);
                                        sp.min_tokens = sp.min_tokens ? (uint32_t)h.n_output + 1 : 0;
                                }
                                if (tsr_sample_uniform_given(&sp, q->history ? &h : NULL, d ? d->u : 0.0, rows + rd,
                                                             vocab, scratch, &t) != TSR_OK)
                                        t = TSR_ARGMAX_NONE;
                        } else {
                                (void)tsr_ref_argmax(&t, rows + rd, 1, vocab);
                        }
                        tsr_token_logprobs lp = {0};
                        if (lp_back(&seqs[i]) && t < vocab &&
                            tsr_logprobs_gather(rows + rd, vocab, t, seqs[i].lp_top, &lp) != TSR_OK)
                                t = TSR_ARGMAX_NONE;
                        /* the row is read: its answer may overwrite it */
                        answer_put(rows + wr, t, lp_back(&seqs[i]) ? &lp : NULL, seqs[i].lp_top);
                        wr += answer_floats(&seqs[i]);
                } else if (plp_rows(&seqs[i])) {
                        /* its prompt rows' answers, then its other rows whole */
                        const tsr_engine_seq *q = &seqs[i];
                        size_t np = plp_rows(q);
                        for (size_t r = 0; r < np; r++) {
                                uint32_t next = r + 1 < q->n ? q->tokens[r + 1] : q->next_token;
                                tsr_token_logprobs lp = {0};
                                if (next >= vocab ||
                                    tsr_logprobs_gather(rows + rd + r * vocab, vocab, next, q->prompt_lp_top, &lp) !=
                                            TSR_OK)
                                        next = TSR_ARGMAX_NONE;     /* node 0 fails the request */
                                answer_put(rows + wr, next, &lp, q->prompt_lp_top);
                                wr += answer_len(true, q->prompt_lp_top);
                        }
                        memmove(rows + wr, rows + rd + np * vocab, (k - np * vocab) * sizeof(float));
                        wr += k - np * vocab;
                } else {
                        memmove(rows + wr, rows + rd, k * sizeof(float));
                        wr += k;
                }
                rd += k;
        }
}

void tsr_plan_tables_clear(tsr_plan_tables *t) {
        for (size_t i = 0; i < t->n; i++)
                free(t->e[i].blocks);
        free(t->e);
        t->e = NULL;
        t->n = t->cap = 0;
}

/* The index of seq_id in t, or where it would go (*found false). */
static size_t tables_find(const tsr_plan_tables *t, uint64_t seq_id, bool *found) {
        size_t lo = 0, hi = t->n;
        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (t->e[mid].seq_id < seq_id)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        *found = lo < t->n && t->e[lo].seq_id == seq_id;
        return lo;
}

/* seq_id's tables are now blocks[nt x n_table], held in plan t->plans. */
static tsr_status tables_keep(tsr_plan_tables *t, uint64_t seq_id, const uint32_t *blocks, size_t n_table,
                              size_t nt) {
        bool found;
        size_t i = tables_find(t, seq_id, &found);
        if (!found) {
                if (t->n == t->cap) {
                        size_t cap = t->cap ? 2 * t->cap : 64;
                        tsr_plan_table *g = realloc(t->e, cap * sizeof(*g));
                        if (!g)
                                return TSR_E_NOMEM;
                        t->e = g;
                        t->cap = cap;
                }
                /* ids are admission numbers, new ones the largest: this rarely moves */
                memmove(t->e + i + 1, t->e + i, (t->n - i) * sizeof(*t->e));
                t->e[i] = (tsr_plan_table){.seq_id = seq_id};
                t->n++;
        }
        tsr_plan_table *e = &t->e[i];
        if (n_table != e->n_table || !e->blocks) {
                uint32_t *g = realloc(e->blocks, (nt * n_table + 1) * sizeof(uint32_t));   /* + 1: never 0 bytes */
                if (!g)
                        return TSR_E_NOMEM;
                e->blocks = g;
                e->n_table = n_table;
        }
        memcpy(e->blocks, blocks, nt * n_table * sizeof(uint32_t));
        e->last_plan = t->plans;
        return TSR_OK;
}

/* A plan is done: forget the sequences none of the last TSR_PLAN_TABLES_AGE plans held. */
static void tables_age(tsr_plan_tables *t) {
        size_t kept = 0;
        t->plans++;
        for (size_t i = 0; i < t->n; i++) {
                if (t->e[i].last_plan + TSR_PLAN_TABLES_AGE < t->plans)
                        free(t->e[i].blocks);
                else
                        t->e[kept++] = t->e[i];
        }
        t->n = kept;
}

/* The base of q's tables against known's copy (0: send them whole), and its changes. */
static size_t table_base(const tsr_plan_tables *known, const tsr_engine_seq *q, size_t nt, size_t *n_changes) {
        bool found;
        size_t i, b, changes = 0;
        *n_changes = 0;
        if (!known)
                return 0;
        i = tables_find(known, q->seq_id, &found);
        if (!found || (b = known->e[i].n_table) == 0 || b > q->n_table)
                return 0;
        for (size_t t = 0; t < nt; t++)
                for (size_t k = 0; k < b; k++)
                        changes += known->e[i].blocks[t * b + k] != q->block_table[t * q->n_table + k];
        if (2 * changes >= nt * b)     /* a pair per change: no cheaper than the entries */
                return 0;
        *n_changes = changes;
        return b;
}

tsr_status tsr_nodes_plan_pack(tsr_plan_tables *known, const tsr_engine_seq *seqs, size_t n_seqs,
                               uint32_t n_tables, uint8_t **buf, size_t *len) {
        size_t words = 1, nt = n_tables ? n_tables : 1;
        size_t *base = malloc((n_seqs ? n_seqs : 1) * 2 * sizeof(size_t)), *changes = base + n_seqs;
        tsr_status st = TSR_OK;
        if (!base)
                return TSR_E_NOMEM;
        /* Every table against the copies as they were before this plan (the receiver
         * reads them so too), which take the plan's tables after it: a seq_id met twice
         * needs nothing of its own. */
        for (size_t i = 0; i < n_seqs; i++) {
                base[i] = table_base(known, &seqs[i], nt, &changes[i]);
                words += SEQ_WORDS + (token_back(&seqs[i]) && seqs[i].draw ? DRAW_WORDS : 0) +
                         (lp_back(&seqs[i]) ? LP_WORDS : 0) + rules_words(&seqs[i]) +
                         (plp_back(&seqs[i]) ? PLP_WORDS : 0) +
                         (mask_back(&seqs[i]) ? MASK_WORDS + seqs[i].grammar_mask_words : 0) + 2 * changes[i] +
                         nt * (seqs[i].n_table - base[i]) + seqs[i].n + 2 * seqs[i].n_saves;
        }
        uint32_t *w = malloc(words * sizeof(uint32_t)), *p = w;
        if (!w) {
                free(base);
                return TSR_E_NOMEM;
        }
        *p++ = (uint32_t)n_seqs;
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *q = &seqs[i];
                size_t b = base[i];
                *p++ = (uint32_t)q->seq_id;
                *p++ = (uint32_t)(q->seq_id >> 32);
                *p++ = (uint32_t)q->n_table;
                *p++ = (uint32_t)q->n;
                *p++ = (uint32_t)q->past_len;
                *p++ = (uint32_t)((uint64_t)q->past_len >> 32);
                bool drawn = token_back(q) && q->draw;
                *p++ = (q->want_logits ? 1u : 0u) | (q->want_all_logits ? 2u : 0u) | (token_back(q) ? 4u : 0u) |
                       (drawn ? 8u : 0u) | (lp_back(q) ? 16u : 0u) | (rules_back(q) ? 32u : 0u) |
                       (plp_back(q) ? 64u : 0u) | (history_back(q) ? 128u : 0u) | (mask_back(q) ? 256u : 0u);
                *p++ = q->state_slot;
                *p++ = q->restore_state ? q->restore_from + 1 : 0;
                *p++ = (uint32_t)q->n_saves;
                *p++ = (uint32_t)b;
                *p++ = (uint32_t)changes[i];
                *p++ = q->prompt_len;
                if (drawn) {
                        memcpy(p++, &q->draw->temperature, sizeof(uint32_t));
                        *p++ = (uint32_t)q->draw->top_k;
                        memcpy(p++, &q->draw->top_p, sizeof(uint32_t));
                        memcpy(p++, &q->draw->min_p, sizeof(uint32_t));
                        memcpy(p, &q->draw->u, sizeof(double));
                        p += 2;
                }
                if (lp_back(q))
                        *p++ = q->lp_top;
                if (rules_back(q)) {
                        const tsr_sampling *r = q->rules;
                        *p++ = (uint32_t)r->n_allowed;
                        *p++ = (uint32_t)r->n_bias;
                        *p++ = (uint32_t)masked_ids(q);
                        if (r->n_allowed)       /* (an empty list may be NULL: no memcpy from it) */
                                memcpy(p, r->allowed_ids, r->n_allowed * sizeof(uint32_t));
                        p += r->n_allowed;
                        for (size_t k = 0; k < r->n_bias; k++) {
                                *p++ = r->bias[k].id;
                                memcpy(p++, &r->bias[k].bias, sizeof(uint32_t));
                        }
                        if (masked_ids(q) && r->n_eos)
                                memcpy(p, r->eos_ids, r->n_eos * sizeof(uint32_t));
                        if (masked_ids(q) && r->n_stop)
                                memcpy(p + r->n_eos, r->stop_ids, r->n_stop * sizeof(uint32_t));
                        p += masked_ids(q);
                        if (history_back(q)) {
                                memcpy(p++, &r->repetition_penalty, sizeof(uint32_t));
                                memcpy(p++, &r->presence_penalty, sizeof(uint32_t));
                                memcpy(p++, &r->frequency_penalty, sizeof(uint32_t));
                                *p++ = q->n_history;
                                memcpy(p, q->history, q->n_history * sizeof(uint32_t));
                                p += q->n_history;
                        }
                }
                if (plp_back(q)) {
                        *p++ = q->prompt_lp_top;
                        *p++ = q->next_token;
                }
                if (mask_back(q)) {
                        *p++ = q->grammar_mask_words;
                        memcpy(p, q->grammar_mask, q->grammar_mask_words * sizeof(uint32_t));
                        p += q->grammar_mask_words;
                }
                if (b) {
                        bool found;
                        const uint32_t *old = known->e[tables_find(known, q->seq_id, &found)].blocks;
                        for (size_t t = 0; t < nt; t++)
                                for (size_t k = 0; k < b; k++)
                                        if (old[t * b + k] != q->block_table[t * q->n_table + k]) {
                                                *p++ = (uint32_t)(t * q->n_table + k);
                                                *p++ = q->block_table[t * q->n_table + k];
                                        }
                }
                for (size_t t = 0; t < nt; t++) {
                        memcpy(p, q->block_table + t * q->n_table + b, (q->n_table - b) * sizeof(uint32_t));
                        p += q->n_table - b;
                }
                memcpy(p, q->tokens, q->n * sizeof(uint32_t));
                p += q->n;
                for (size_t k = 0; k < q->n_saves; k++) {
                        *p++ = q->saves[k].pos;
                        *p++ = q->saves[k].slot;
                }
                if (known) {
                        known->words_sent += 2 * changes[i] + nt * (q->n_table - b);
                        known->words_whole += nt * q->n_table;
                }
        }
        for (size_t i = 0; known && i < n_seqs && st == TSR_OK; i++)
                st = tables_keep(known, seqs[i].seq_id, seqs[i].block_table, seqs[i].n_table, nt);
        if (known)
                tables_age(known);
        free(base);
        if (st != TSR_OK) {     /* known no longer what the receiver will hold */
                free(w);
                return st;
        }
        *buf = (uint8_t *)w;
        *len = words * sizeof(uint32_t);
        return TSR_OK;
}

tsr_status tsr_nodes_plan_unpack(tsr_plan_tables *known, const uint8_t *buf, size_t len, uint32_t n_tables,
                                 tsr_engine_seq **seqs, size_t *n_seqs) {
        size_t words = len / sizeof(uint32_t), at, n, tables = n_tables ? n_tables : 1, table_words = 0;
        const uint32_t *w = (const uint32_t *)buf;   /* the comm's buffers are malloc'd: aligned */
        tsr_status st = TSR_OK;

        if (len % sizeof(uint32_t) || words < 1)
                return TSR_E_PROTO;
        n = w[0];
        if (n > words / SEQ_WORDS)      /* each sequence takes SEQ_WORDS words at least */
                return TSR_E_PROTO;
        /* The layout first, bounded by the buffer (a base by what this end holds, below):
         * how many table entries the records need. */
        at = 1;
        for (size_t i = 0; i < n; i++) {
                if (words - at < SEQ_WORDS)
                        return TSR_E_PROTO;
                const uint32_t *h = w + at;
                size_t n_table = h[2], nn = h[3], n_saves = h[9], b = h[10], n_changes = h[11];
                at += SEQ_WORDS;
                /* flags: want_logits, want_all_logits, or both; a token back wants the
                 * one row (5), drawn (13), either with its logprobs (21, 29), any of
                 * those with rules (+ 32), and a history (+ 128), a grammar mask (+ 256);
                 * all rows (2, 3) with their prompt rows' logprobs (+ 64) */
                uint32_t f = h[6], g = f & ~(32u | 128u | 256u);
                if ((f & 128) && !(f & 32))
                        return TSR_E_PROTO;
                bool flags_ok = f <= 3 || g == 5 || g == 13 || g == 21 || g == 29 || f == 66 || f == 67;
                if (flags_ok && (f & 8)) {
                        if (words - at < DRAW_WORDS)
                                return TSR_E_PROTO;
                        at += DRAW_WORDS;
                }
                if (flags_ok && (f & 16)) {
                        if (words - at < LP_WORDS || w[at] > TSR_SAMPLER_MAX_LOGPROBS)
                                return TSR_E_PROTO;
                        at += LP_WORDS;
                }
                if (flags_ok && (f & 32)) {
                        if (words - at < RULES_WORDS)
                                return TSR_E_PROTO;
                        uint64_t lists = (uint64_t)w[at] + 2 * (uint64_t)w[at + 1] + w[at + 2];
                        at += RULES_WORDS;
                        if (lists > words - at)
                                return TSR_E_PROTO;
                        at += lists;
                }
                if (flags_ok && (f & 128)) {    /* the whole prompt and the outputs so far */
                        if (words - at < HISTORY_WORDS || w[at + 3] < h[12] || w[at + 3] > words - at - HISTORY_WORDS)
                                return TSR_E_PROTO;
                        at += HISTORY_WORDS + w[at + 3];
                }
                if (flags_ok && (f & 64)) {
                        if (words - at < PLP_WORDS || w[at] > TSR_SAMPLER_MAX_LOGPROBS)
                                return TSR_E_PROTO;
                        at += PLP_WORDS;
                }
                if (flags_ok && (f & 256)) {
                        if (words - at < MASK_WORDS || w[at] == 0 || w[at] > words - at - MASK_WORDS)
                                return TSR_E_PROTO;
                        at += MASK_WORDS + w[at];
                }
                if (!flags_ok || nn == 0 || b > n_table || (b && !known) ||
                    (b == 0 && n_changes) ||
                    n_changes > (words - at) / 2)
                        return TSR_E_PROTO;
                at += 2 * n_changes;
                if (n_table - b > (words - at) / tables)
                        return TSR_E_PROTO;
                at += tables * (n_table - b);
                if (nn > words - at)
                        return TSR_E_PROTO;
                at += nn;
                if (n_saves > (words - at) / 2)
                        return TSR_E_PROTO;
                at += 2 * n_saves;
                table_words += tables * n_table;
        }
        if (at != words)
                return TSR_E_PROTO;
        /* One allocation: the records, their rules, draws, logprobs and tokens, the
         * tables rebuilt, a copy of the words. */
        tsr_engine_seq *s = malloc(n * (sizeof(*s) + sizeof(tsr_sampling) + sizeof(tsr_draw) +
                                        sizeof(tsr_token_logprobs)) +
                                   (n + table_words) * sizeof(uint32_t) + len);
        if (!s)
                return TSR_E_NOMEM;
        tsr_sampling *rules = (tsr_sampling *)(s + n);
        tsr_draw *draws = (tsr_draw *)(rules + n);
        tsr_token_logprobs *lps = (tsr_token_logprobs *)(draws + n);
        uint32_t *tokens = (uint32_t *)(lps + n), *out = tokens + n, *copy = out + table_words;
        memcpy(copy, buf, len);
        at = 1;
        for (size_t i = 0; i < n && st == TSR_OK; i++) {
                const uint32_t *h = copy + at;
                uint64_t seq_id = h[0] | (uint64_t)h[1] << 32, past = h[4] | (uint64_t)h[5] << 32;
                size_t n_table = h[2], nn = h[3], n_saves = h[9], b = h[10], n_changes = h[11];
                size_t dw = h[6] & 8 ? DRAW_WORDS : 0, lw = h[6] & 16 ? LP_WORDS : 0, rw = 0;
                const uint32_t *hist = NULL;
                uint32_t hn = 0;
                if (h[6] & 32) {        /* the lists as they lie: ids, (id, bias) pairs, ids */
                        const uint32_t *r = h + SEQ_WORDS + dw + lw;
                        tsr_sampling_init(&rules[i]);
                        rules[i].n_allowed = r[0];
                        rules[i].allowed_ids = r + RULES_WORDS;
                        rules[i].n_bias = r[1];
                        rules[i].bias = (const tsr_logit_bias *)(r + RULES_WORDS + r[0]);
                        rules[i].n_eos = r[2];
                        rules[i].eos_ids = r + RULES_WORDS + r[0] + 2 * (size_t)r[1];
                        rules[i].min_tokens = r[2] ? 1 : 0;     /* masked at this position */
                        rw = RULES_WORDS + r[0] + 2 * (size_t)r[1] + r[2];
                        if (h[6] & 128) {
                                const uint32_t *y = r + rw;
                                memcpy(&rules[i].repetition_penalty, y, sizeof(uint32_t));
                                memcpy(&rules[i].presence_penalty, y + 1, sizeof(uint32_t));
                                memcpy(&rules[i].frequency_penalty, y + 2, sizeof(uint32_t));
                                hn = y[3];
                                hist = y + HISTORY_WORDS;
                                rw += HISTORY_WORDS + hn;
                        }
                }
                size_t pw = h[6] & 64 ? PLP_WORDS : 0;
                const uint32_t *plp = h + SEQ_WORDS + dw + lw + rw, *mask = plp + pw;
                size_t mw = h[6] & 256 ? MASK_WORDS + mask[0] : 0;
                const uint32_t *pairs = h + SEQ_WORDS + dw + lw + rw + pw + mw, *tail = pairs + 2 * n_changes;
                at += SEQ_WORDS + dw + lw + rw + pw + mw + 2 * n_changes + tables * (n_table - b);
                if (dw) {
                        const uint32_t *dr = h + SEQ_WORDS;
                        memcpy(&draws[i].temperature, dr, sizeof(uint32_t));
                        draws[i].top_k = (int32_t)dr[1];
                        memcpy(&draws[i].top_p, dr + 2, sizeof(uint32_t));
                        memcpy(&draws[i].min_p, dr + 3, sizeof(uint32_t));
                        memcpy(&draws[i].u, dr + 4, sizeof(double));
                }
                if (b) {
                        bool found;
                        size_t k = tables_find(known, seq_id, &found);
                        if (!found || known->e[k].n_table != b) {
                                st = TSR_E_PROTO;     /* changes to tables this end does not hold */
                                break;
                        }
                        for (size_t t = 0; t < tables; t++)
                                memcpy(out + t * n_table, known->e[k].blocks + t * b, b * sizeof(uint32_t));
                        for (size_t c = 0; c < n_changes && st == TSR_OK; c++) {
                                size_t idx = pairs[2 * c];
                                if (idx >= tables * n_table || idx % n_table >= b)
                                        st = TSR_E_PROTO;
                                else
                                        out[idx] = pairs[2 * c + 1];
                        }
                }
                for (size_t t = 0; t < tables; t++)
                        memcpy(out + t * n_table + b, tail + t * (n_table - b), (n_table - b) * sizeof(uint32_t));
                /* the (pos, slot) word pairs are tsr_state_save records as they lie */
                s[i] = (tsr_engine_seq){.block_table = out, .n_table = n_table, .tokens = copy + at, .n = nn,
                                        .past_len = (size_t)past, .want_logits = h[6] & 1,
                                        .want_all_logits = (h[6] & 2) != 0, .state_slot = h[7],
                                        .restore_state = h[8] != 0, .restore_from = h[8] ? h[8] - 1 : 0,
                                        .saves = (const tsr_state_save *)(copy + at + nn), .n_saves = n_saves,
                                        .prompt_len = h[12],
                                        .seq_id = seq_id, .token = h[6] & 4 ? &tokens[i] : NULL,
                                        .draw = dw ? &draws[i] : NULL, .lp = lw ? &lps[i] : NULL,
                                        .lp_top = lw ? h[SEQ_WORDS + dw] : 0,
                                        .rules = rw ? &rules[i] : NULL, .history = hist, .n_history = hn,
                                        /* (marks the prompt rows: their answers go on the wire) */
                                        .prompt_lp = pw ? &lps[i] : NULL, .prompt_lp_top = pw ? plp[0] : 0,
                                        .next_token = pw ? plp[1] : 0,
                                        .grammar_mask = mw ? mask + MASK_WORDS : NULL,
                                        .grammar_mask_words = mw ? mask[0] : 0};
                tokens[i] = TSR_ENGINE_TOKEN_UNSET;
                at += nn + 2 * n_saves;
                out += tables * n_table;
        }
        /* the copies take the plan's tables after it, as the leader's (plan_pack) */
        for (size_t i = 0; known && i < n && st == TSR_OK; i++)
                st = tables_keep(known, s[i].seq_id, s[i].block_table, s[i].n_table, tables);
        if (known)
                tables_age(known);
        if (st != TSR_OK) {
                free(s);
                return st;
        }
        *seqs = s;
        *n_seqs = n;
        return TSR_OK;
}

static tsr_status grow(float **buf, size_t *cap, size_t floats) {
        if (floats <= *cap)
                return TSR_OK;
        float *p = realloc(*buf, floats * sizeof(float));
        if (!p)
                return TSR_E_NOMEM;
        *buf = p;
        *cap = floats;
        return TSR_OK;
}

/* ---- joining -------------------------------------------------------------------------- */

/* Meet the other nodes and build the group on this thread.  TSR_E_* with err. */
static tsr_status join(const tsr_nodes_cfg *cfg, const _Atomic bool *cancel, void (*on_first_hello)(void *ud),
                       void *ud, tsr_comm **ret, uint64_t *epoch, char *err, size_t errlen) {
        char addr[128], bind_ep[160];
        tsr_comm_zmq_listener *l = NULL;
        tsr_bootstrap_group g = {0};
        tsr_status st;

        /* The address this node is reached at: the one its traffic to node 0 leaves from. */
        if ((st = tsr_bootstrap_local_addr(cfg->master_addr, cfg->master_port, addr, sizeof addr, err, errlen)) !=
            TSR_OK)
                return st;
        snprintf(bind_ep, sizeof bind_ep, "tcp://%s:*", addr);
        if ((st = tsr_comm_zmq_listener_new(bind_ep, &l, err, errlen)) != TSR_OK)
                return st;
        tsr_bootstrap_cfg bc = {.nnodes = cfg->nnodes, .node_rank = cfg->node_rank, .master_addr = cfg->master_addr,
                                .master_port = cfg->master_port, .purpose = "serve", .fingerprint = cfg->fingerprint,
                                .data_endpoint = tsr_comm_zmq_listener_endpoint(l),
                                .timeout_ms = cfg->join_timeout_ms, .cancel = cancel,
                                .on_first_hello = on_first_hello, .ud = ud};
        if ((st = tsr_bootstrap_rendezvous(&bc, &g, err, errlen)) != TSR_OK) {
                tsr_comm_zmq_listener_free(&l);
                return st;
        }
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_ZMQ, .rank = (int)cfg->node_rank, .size = (int)cfg->nnodes,
                           .timeout_ms = cfg->step_timeout_ms, .epoch = g.epoch, .zmq_listener = &l,
                           .endpoints = (const char *const *)g.endpoints};
        st = tsr_comm_new(&d, ret, err, errlen);
        *epoch = g.epoch;
        tsr_bootstrap_group_free(&g);
        return st;
}

/* ---- the leader ----------------------------------------------------------------------- */

/* A step in flight: its sequences' logits rows (0 for a token_back one) and token slot
 * (the engine's, for a token_back one; else NULL), and its OUT message's floats.  The
 * engine's plan, which the token slots point into, lives until the step's wait. */
/* Where one sequence's part of an OUT message goes (the engine's memory). */
struct out_seq {
        size_t rows;                    /* tsr_engine_seq_rows */
        uint32_t *token;                /* a token_back row's token, or NULL: rows come whole */
        tsr_token_logprobs *lp;         /* and its logprobs, or NULL */
        uint32_t lp_top;                /* its lp_top, or a prompt-logprobs chunk's prompt_lp_top */
        /* a prompt-logprobs chunk's: where its leading plp_n rows' answers go, or NULL */
        tsr_token_logprobs *plp;
        size_t plp_n;
};

struct out_layout {
        size_t n, cap, vocab, wire_floats;
        struct out_seq *seq;
};

static void layout_free(struct out_layout *l) { free(l->seq); }

struct tsr_nodes {
        tsr_nodes_cfg cfg;
        char *fingerprint, *master_addr;        /* cfg's strings, owned */
        uint64_t kv_blocks;                     /* what the engine uses: a new group must hold it */
        uint32_t state_slots;
        /* the engine's forward thread (tsr_nodes_step) and the engine thread
         * (tsr_nodes_generation, tsr_nodes_idle): never at once, the engine waits for its
         * step before it calls either */
        tsr_comm *comm;                         /* the installed group; NULL while down */
        uint64_t generation;
        uint64_t steps;
        uint32_t in_flight;                     /* steps submitted and not yet waited for */
        tsr_plan_tables known;                  /* the block tables the followers hold */
        /* the steps in flight, oldest first: where each one's OUT message goes */
        struct out_layout *lay;
        size_t lay_head, lay_n, lay_cap;
        /* for the log at the end: every plan's bytes, the rows that came back as their
         * token and those that came back whole */
        uint64_t plan_bytes, rows_as_token, rows_with_lp, rows_whole, rows_prompt_lp;
        float *act, *out;                       /* [HDR_FLOATS + floats] of the step's messages */
        size_t act_cap, out_cap;
        /* under mu */
        pthread_mutex_t mu;
        tsr_comm *ready;                        /* a group that met again, not installed yet */
        uint64_t ready_epoch;
        bool down;                              /* the installed group failed (group_down) */
        pthread_t rejoin;
        bool rejoin_running;
        _Atomic bool cancel;                    /* tsr_nodes_free: the rejoin thread stops */
        _Atomic bool up;
        /* the comm abort may reach, under mu (abort from any thread) */
        tsr_comm *abortable;
};

/* Hear every follower's capacity; a new group must hold what the engine uses. */
static tsr_status hear_ready(tsr_comm *c, uint32_t nnodes, uint64_t *kv_blocks, uint32_t *state_slots, char *err,
                             size_t errlen) {
        for (uint32_t q = 1; q < nnodes; q++) {
                ready_msg m;
                tsr_status st = tsr_comm_recv(c, &m, sizeof m, (int)q, TAG_READY, NULL);
                if (st != TSR_OK) {
                        snprintf(err, errlen, "node rank %u did not report its KV capacity: %s", q,
                                 tsr_status_str(st));
                        return st;
                }
                log_info("node rank %u: %llu KV blocks, %u state slots", q, (unsigned long long)m.kv_blocks,
                         m.state_slots);
                *kv_blocks = m.kv_blocks < *kv_blocks ? m.kv_blocks : *kv_blocks;
                *state_slots = m.state_slots < *state_slots ? m.state_slots : *state_slots;
        }
        return TSR_OK;
}

/* A node said hello while a group may be up: it left that group (it restarted, or its
 * group broke), so the group is done; abort it, which also sends the nodes still in it
 * back to the rendezvous.  The rejoin thread, inside the rendezvous. */
static void stale_group(void *ud) {
        tsr_nodes *n = ud;
        pthread_mutex_lock(&n->mu);
        if (n->abortable) {
                log_warn("a node is meeting the others again: replica group %llu is over",
                         (unsigned long long)n->generation);
                tsr_comm_abort(n->abortable);
        }
        atomic_store(&n->up, false);
        pthread_mutex_unlock(&n->mu);
}

/* Node 0 listens for the nodes all the time: after a failure (the engine took the group
 * down) and while a group is up (a follower that restarted says hello: stale_group).
 * Each new group goes to `ready`; the engine thread installs it (tsr_nodes_generation). */
static void *rejoin_main(void *arg) {
        tsr_nodes *n = arg;
        char err[1024];
        tsr_nodes_cfg cfg = n->cfg;

        tsr_log_set_thread("nodes");
        while (!atomic_load(&n->cancel)) {
                tsr_comm *c = NULL;
                uint64_t epoch = 0, blocks = UINT64_MAX;
                uint32_t slots = UINT32_MAX;
                tsr_status st = join(&cfg, &n->cancel, stale_group, n, &c, &epoch, err, sizeof err);
                if (st == TSR_OK)
                        st = hear_ready(c, cfg.nnodes, &blocks, &slots, err, sizeof err);
                if (st == TSR_OK && (blocks < n->kv_blocks || slots < n->state_slots)) {
                        snprintf(err, sizeof err, "a node now holds %llu KV blocks and %u state slots, fewer than the "
                                 "%llu and %u this replica serves with", (unsigned long long)blocks, slots,
                                 (unsigned long long)n->kv_blocks, n->state_slots);
                        st = TSR_E_UNAVAILABLE;
                }
                pthread_mutex_lock(&n->mu);
                if (st == TSR_OK && !atomic_load(&n->cancel)) {
                        tsr_comm *old = n->ready;
                        n->ready = c;
                        n->ready_epoch = epoch;
                        atomic_store(&n->up, true);
                        pthread_mutex_unlock(&n->mu);
                        tsr_comm_free(&old);    /* a group met before it and never installed: over too */
                        log_info("the %u nodes met again (epoch %016llx): serving on it from the next step",
                                 cfg.nnodes, (unsigned long long)epoch);
                        continue;
                }
                bool down = n->down;
                pthread_mutex_unlock(&n->mu);
                tsr_comm_free(&c);
                if (st == TSR_E_CANCELLED)
                        break;
                if (down)       /* while a group is up, a rendezvous nobody came to is no news */
                        log_warn("the nodes did not meet again: %s (listening again)", err);
        }
        return NULL;
}

tsr_status tsr_nodes_lead(const tsr_nodes_cfg *cfg, uint64_t *kv_blocks, uint32_t *state_slots, tsr_nodes **ret,
                          char *err, size_t errlen) {
        tsr_nodes *n = calloc(1, sizeof(*n));
        tsr_status st;
        uint64_t epoch = 0;

        if (!n || !(n->fingerprint = strdup(cfg->fingerprint ? cfg->fingerprint : "")) ||
            !(n->master_addr = strdup(cfg->master_addr))) {
                if (n)
                        free(n->fingerprint);
                free(n);
                snprintf(err, errlen, "out of memory");
                return TSR_E_NOMEM;
        }
        n->cfg = *cfg;
        n->cfg.fingerprint = n->fingerprint;
        n->cfg.master_addr = n->master_addr;
        pthread_mutex_init(&n->mu, NULL);
        log_info("node 0 of %u: waiting up to %u s for the other nodes at %s:%u", cfg->nnodes,
                 cfg->join_timeout_ms / 1000, cfg->master_addr, cfg->master_port);
        *kv_blocks = cfg->kv_blocks;
        *state_slots = cfg->state_slots;
        st = join(&n->cfg, NULL, NULL, NULL, &n->ready, &epoch, err, errlen);
        if (st == TSR_OK)
                st = hear_ready(n->ready, cfg->nnodes, kv_blocks, state_slots, err, errlen);
        /* what the rejoin thread reads, set before it starts */
        n->ready_epoch = epoch;
        n->kv_blocks = *kv_blocks;
        n->state_slots = *state_slots;
        atomic_store(&n->up, true);
        if (st == TSR_OK) {
                /* The rejoin thread takes no signal: the io thread reads them (signalfd). */
                sigset_t all, old;
                sigfillset(&all);
                pthread_sigmask(SIG_SETMASK, &all, &old);
                if (pthread_create(&n->rejoin, NULL, rejoin_main, n) != 0) {
                        snprintf(err, errlen, "cannot start the rejoin thread");
                        st = TSR_E_INTERNAL;
                }
                pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
        if (st != TSR_OK) {
                tsr_comm_free(&n->ready);
                tsr_nodes_free(&n);
                return st;
        }
        n->rejoin_running = true;
        log_info("the %u nodes met (epoch %016llx): %llu KV blocks, %u state slots on every node", cfg->nnodes,
                 (unsigned long long)epoch, (unsigned long long)*kv_blocks, *state_slots);
        *ret = n;
        return TSR_OK;
}

uint64_t tsr_nodes_generation(tsr_nodes *n) {
        tsr_comm *old = NULL;
        pthread_mutex_lock(&n->mu);
        if (n->ready) {         /* the nodes met again: whatever group was up is over */
                old = n->comm;
                tsr_plan_tables_clear(&n->known);   /* the new group's followers hold none */
                n->comm = n->abortable = n->ready;
                n->ready = NULL;
                n->down = false;
                n->generation++;
                log_info("replica group %llu (epoch %016llx) installed", (unsigned long long)n->generation,
                         (unsigned long long)n->ready_epoch);
        }
        pthread_mutex_unlock(&n->mu);
        tsr_comm_free(&old);
        return n->generation;
}

bool tsr_nodes_renewal_pending(tsr_nodes *n) {
        pthread_mutex_lock(&n->mu);
        bool pending = n->ready != NULL;
        pthread_mutex_unlock(&n->mu);
        return pending;
}

bool tsr_nodes_up(const tsr_nodes *n) { return atomic_load(&n->up); }

void tsr_nodes_abort(tsr_nodes *n) {
        if (!n)
                return;
        pthread_mutex_lock(&n->mu);
        if (n->abortable)
                tsr_comm_abort(n->abortable);
        pthread_mutex_unlock(&n->mu);
}

/* The group broke: free it and wake the rejoin thread.  The engine's forward thread, or
 * the engine thread while idle. */
static void group_down(tsr_nodes *n, tsr_status why) {
        log_error("replica group %llu failed (%s): the requests in its step end (those without a token go back to "
                  "their router); the worker reports itself unhealthy until the nodes meet again",
                  (unsigned long long)n->generation, tsr_status_str(why));
        pthread_mutex_lock(&n->mu);
        n->abortable = NULL;
        if (!n->ready)          /* a group that met meanwhile stays up */
                atomic_store(&n->up, false);
        n->down = true;
        pthread_mutex_unlock(&n->mu);
        tsr_comm_free(&n->comm);
        tsr_plan_tables_clear(&n->known);
}

void tsr_nodes_idle(tsr_nodes *n) {
        tsr_status st;
        if (n->comm && (st = tsr_comm_progress(n->comm)) != TSR_OK)
                group_down(n, st);
}

/* Keep the layout of a step just sent (its OUT message's floats: wire_floats). */
static tsr_status layout_push(tsr_nodes *n, const tsr_engine_seq *seqs, size_t n_seqs, size_t vocab,
                              size_t wire_floats) {
        if (n->lay_n == n->lay_cap) {   /* grow the ring, its steps in order from 0 */
                size_t cap = n->lay_cap ? 2 * n->lay_cap : 4;
                struct out_layout *g = calloc(cap, sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                for (size_t i = 0; i < n->lay_cap; i++)
                        g[i] = n->lay[(n->lay_head + i) % n->lay_cap];
                free(n->lay);
                n->lay = g;
                n->lay_head = 0;
                n->lay_cap = cap;
        }
        struct out_layout *l = &n->lay[(n->lay_head + n->lay_n) % n->lay_cap];
        if (n_seqs > l->cap) {
                struct out_seq *g = realloc(l->seq, n_seqs * sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                l->seq = g;
                l->cap = n_seqs;
        }
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *q = &seqs[i];
                size_t np = plp_rows(q);
                l->seq[i] = (struct out_seq){.rows = tsr_engine_seq_rows(q),
                                             .token = token_back(q) ? q->token : NULL,
                                             .lp = lp_back(q) ? q->lp : NULL,
                                             .lp_top = plp_back(q) ? q->prompt_lp_top : q->lp_top,
                                             .plp = np ? q->prompt_lp : NULL, .plp_n = np};
        }
        l->n = n_seqs;
        l->vocab = vocab;
        l->wire_floats = wire_floats;
        n->lay_n++;
        return TSR_OK;
}

tsr_status tsr_nodes_submit(tsr_nodes *n, const tsr_engine_seq *seqs, size_t n_seqs, size_t io_floats,
                            size_t out_floats, tsr_status (*stage0)(void *ud, float *act), void *stage0_ud) {
        uint8_t *plan = NULL;
        size_t plan_len = 0;
        tsr_status st, local;

        size_t n_tokens, rows, vocab;
        tsr_engine_step_size(seqs, n_seqs, &n_tokens, &rows);
        vocab = rows ? out_floats / rows : 0;

        if (!n->comm)
                return TSR_E_UNAVAILABLE;
        if ((st = grow(&n->act, &n->act_cap, HDR_FLOATS + io_floats)) != TSR_OK)
                return st;
        if ((st = tsr_nodes_plan_pack(&n->known, seqs, n_seqs, n->cfg.n_kv_tables, &plan, &plan_len)) != TSR_OK) {
                group_down(n, st);      /* its tables may now differ from the followers' */
                return st;
        }
        n->plan_bytes += plan_len;
        ctl_msg ctl = {.step = ++n->steps, .plan_bytes = plan_len, .io_floats = io_floats,
                       .out_floats = out_wire_floats(seqs, n_seqs, vocab)};
        for (uint32_t q = 1; st == TSR_OK && q < n->cfg.nnodes; q++) {
                st = tsr_comm_send(n->comm, &ctl, sizeof ctl, (int)q, TAG_CTL, NULL);
                if (st == TSR_OK)
                        st = tsr_comm_send(n->comm, plan, plan_len, (int)q, TAG_PLAN, NULL);
        }
        free(plan);
        /* Stage 0 between the plan and its output: the followers decode the plan meanwhile.
         * A stage 0 that failed still sends, so the step ends at once on every node. */
        local = st == TSR_OK ? stage0(stage0_ud, n->act + HDR_FLOATS) : st;
        ((int32_t *)n->act)[0] = local;
        ((int32_t *)n->act)[1] = 0;
        if (st == TSR_OK)
                st = tsr_comm_send(n->comm, n->act, (HDR_FLOATS + io_floats) * sizeof(float), 1, TAG_ACT, NULL);
        if (st == TSR_OK)
                st = layout_push(n, seqs, n_seqs, vocab, ctl.out_floats);
        if (st != TSR_OK) {
                group_down(n, st);
                return st;
        }
        n->in_flight++;
        return TSR_OK;
}

tsr_status tsr_nodes_wait(tsr_nodes *n, size_t out_floats, float *logits) {
        tsr_status st;
        struct out_layout *l;

        if (n->in_flight == 0 || n->lay_n == 0)
                return TSR_E_INVAL;
        n->in_flight--;
        l = &n->lay[n->lay_head];       /* the oldest step's; reused once this returns */
        n->lay_head = (n->lay_head + 1) % n->lay_cap;
        n->lay_n--;
        if (!n->comm)           /* the group failed under an earlier step */
                return TSR_E_UNAVAILABLE;
        if ((st = grow(&n->out, &n->out_cap, HDR_FLOATS + l->wire_floats)) == TSR_OK)
                st = tsr_comm_recv(n->comm, n->out, (HDR_FLOATS + l->wire_floats) * sizeof(float),
                                   (int)n->cfg.nnodes - 1, TAG_OUT, NULL);
        if (st != TSR_OK) {
                group_down(n, st);
                return st;
        }
        if ((st = (tsr_status)((int32_t *)n->out)[0]) != TSR_OK)
                return st;
        /* the rows to their places in `logits`, the tokens to the engine's slots (their
         * rows' places stay unwritten: the engine reads the token, as from a device) */
        const float *rd = n->out + HDR_FLOATS;
        size_t wr = 0, vocab = l->vocab;
        for (size_t i = 0; i < l->n; i++) {
                const struct out_seq *o = &l->seq[i];
                if (o->token) {
                        if ((st = answer_get(rd, o->token, o->lp, o->lp_top)) != TSR_OK)
                                return st;
                        rd += answer_len(o->lp != NULL, o->lp_top);
                        wr += vocab;
                        n->rows_as_token++;
                        n->rows_with_lp += o->lp != NULL;
                } else {
                        /* a prompt-logprobs chunk's prompt rows: their answers (the rows'
                         * places stay unwritten; the engine reads prompt_lp) */
                        for (size_t r = 0; r < o->plp_n; r++) {
                                uint32_t next;
                                if ((st = answer_get(rd, &next, &o->plp[r], o->lp_top)) != TSR_OK)
                                        return st;
                                if (next == TSR_ARGMAX_NONE)
                                        return TSR_E_INVAL;     /* no logprobs: as gather_prompt_lp's */
                                rd += answer_len(true, o->lp_top);
                                wr += vocab;
                        }
                        n->rows_prompt_lp += o->plp_n;
                        size_t whole = o->rows - o->plp_n;
                        memcpy(logits + wr, rd, whole * vocab * sizeof(float));
                        rd += whole * vocab;
                        wr += whole * vocab;
                        n->rows_whole += whole;
                }
        }
        return wr == out_floats ? TSR_OK : TSR_E_INTERNAL;
}

tsr_status tsr_nodes_step(tsr_nodes *n, const tsr_engine_seq *seqs, size_t n_seqs, size_t io_floats,
                          size_t out_floats, tsr_status (*stage0)(void *ud, float *act), void *stage0_ud,
                          float *logits) {
        tsr_status st = tsr_nodes_submit(n, seqs, n_seqs, io_floats, out_floats, stage0, stage0_ud);
        return st != TSR_OK ? st : tsr_nodes_wait(n, out_floats, logits);
}

void tsr_nodes_free(tsr_nodes **np) {
        tsr_nodes *n = *np;
        if (!n)
                return;
        if (n->rejoin_running) {
                atomic_store(&n->cancel, true);        /* the rendezvous gives up within 0.5 s */
                pthread_join(n->rejoin, NULL);
        }
        for (size_t i = 0; i < n->lay_cap; i++)
                layout_free(&n->lay[i]);
        free(n->lay);
        if (n->rows_as_token + n->rows_whole + n->rows_prompt_lp)
                log_info("logits rows from the last node: %llu as their token (%llu with its logprobs), %llu whole, "
                         "%llu as their prompt logprobs", (unsigned long long)n->rows_as_token,
                         (unsigned long long)n->rows_with_lp, (unsigned long long)n->rows_whole,
                         (unsigned long long)n->rows_prompt_lp);
        if (n->known.plans)
                log_info("%llu step plans sent: %.1f MB; their block tables %.1f%% of whole ones (%llu of %llu "
                         "entries: the rest are changes the followers apply to their copies)",
                         (unsigned long long)n->known.plans, (double)n->plan_bytes / 1e6,
                         n->known.words_whole ? 100.0 * (double)n->known.words_sent / (double)n->known.words_whole : 0.0,
                         (unsigned long long)n->known.words_sent, (unsigned long long)n->known.words_whole);
        tsr_plan_tables_clear(&n->known);
        tsr_comm_free(&n->comm);
        tsr_comm_free(&n->ready);
        free(n->act);
        free(n->out);
        pthread_mutex_destroy(&n->mu);
        free(n->fingerprint);
        free(n->master_addr);
        free(n);
        *np = NULL;
}

/* ---- a follower ----------------------------------------------------------------------- */

static pthread_mutex_t follow_mu = PTHREAD_MUTEX_INITIALIZER;
static tsr_comm *follow_comm;           /* under follow_mu: what tsr_nodes_stop aborts */
static _Atomic bool follow_stop;

void tsr_nodes_stop(void) {
        atomic_store(&follow_stop, true);
        pthread_mutex_lock(&follow_mu);
        if (follow_comm)
                tsr_comm_abort(follow_comm);
        pthread_mutex_unlock(&follow_mu);
}

/* Run steps on group c until it breaks (its status) or a plan is malformed (TSR_E_PROTO). */
static tsr_status follow_steps(const tsr_nodes_cfg *cfg, tsr_comm *c, tsr_nodes_stage_fn fn, void *ud,
                               size_t hidden_floats, size_t vocab, char *err, size_t errlen) {
        bool last = cfg->node_rank + 1 == cfg->nnodes;
        float *in = NULL, *out = NULL;
        size_t in_cap = 0, out_cap = 0;
        uint8_t *plan = NULL;
        tsr_plan_tables known = {0};    /* the tables of the leader's recent plans, as it has them */
        float *scratch = last ? malloc(TSR_SAMPLER_SCRATCH(vocab) * sizeof(float)) : NULL;   /* rows_to_wire's */
        tsr_status st = TSR_OK;

        if (last && !scratch) {
                snprintf(err, errlen, "out of memory for the sampler's scratch");
                return TSR_E_NOMEM;
        }
        for (;;) {
                ctl_msg ctl;
                tsr_engine_seq *seqs = NULL;
                size_t n_seqs = 0, tokens, rows;
                /* An idle leader may send nothing for hours: this wait has no deadline (a
                 * dead leader is a disconnect, a silent host ZeroMQ's heartbeat). */
                tsr_comm_set_timeout(c, UINT32_MAX);
                st = tsr_comm_recv(c, &ctl, sizeof ctl, 0, TAG_CTL, NULL);
                tsr_comm_set_timeout(c, cfg->step_timeout_ms);
                if (st != TSR_OK)
                        break;
                if (ctl.plan_bytes > MAX_MSG_BYTES || ctl.io_floats > MAX_MSG_BYTES / sizeof(float) ||
                    ctl.out_floats > MAX_MSG_BYTES / sizeof(float) || !(plan = malloc(ctl.plan_bytes ? ctl.plan_bytes : 1))) {
                        snprintf(err, errlen, "step %llu: a plan of %llu bytes", (unsigned long long)ctl.step,
                                 (unsigned long long)ctl.plan_bytes);
                        st = TSR_E_PROTO;
                        break;
                }
                if ((st = tsr_comm_recv(c, plan, ctl.plan_bytes, 0, TAG_PLAN, NULL)) != TSR_OK)
                        break;
                st = tsr_nodes_plan_unpack(&known, plan, ctl.plan_bytes, cfg->n_kv_tables, &seqs, &n_seqs);
                free(plan);
                plan = NULL;
                if (st == TSR_OK) {
                        tsr_engine_step_size(seqs, n_seqs, &tokens, &rows);
                        if (ctl.io_floats != 2 * tokens * hidden_floats ||
                            (last && ctl.out_floats != out_wire_floats(seqs, n_seqs, vocab)))
                                st = TSR_E_PROTO;
                        for (size_t i = 0; i < n_seqs && vocab < TSR_NODES_LP_MIN_VOCAB; i++)
                                if (seqs[i].lp)
                                        st = TSR_E_PROTO;   /* an answer longer than its row */
                }
                if (st != TSR_OK) {
                        free(seqs);
                        snprintf(err, errlen, "step %llu: node 0 sent a plan that does not decode or does not match "
                                 "its sizes", (unsigned long long)ctl.step);
                        st = TSR_E_PROTO;
                        break;
                }
                /* the last stage computes every row; its message holds tokens for some */
                size_t out_n = last ? rows * vocab : ctl.io_floats;
                if ((st = grow(&in, &in_cap, HDR_FLOATS + ctl.io_floats)) != TSR_OK ||
                    (st = grow(&out, &out_cap, HDR_FLOATS + out_n)) != TSR_OK) {
                        free(seqs);
                        snprintf(err, errlen, "out of memory for step %llu", (unsigned long long)ctl.step);
                        break;
                }
                st = tsr_comm_recv(c, in, (HDR_FLOATS + ctl.io_floats) * sizeof(float), (int)cfg->node_rank - 1,
                                   TAG_ACT, NULL);
                if (st != TSR_OK) {
                        free(seqs);
                        break;
                }
                /* The previous stage's failure travels on; this stage does not run. */
                tsr_status prev = (tsr_status)((int32_t *)in)[0];
                tsr_status mine = prev != TSR_OK ? prev : fn(ud, seqs, n_seqs, in + HDR_FLOATS, out + HDR_FLOATS);
                if (last && mine == TSR_OK)
                        rows_to_wire(seqs, n_seqs, vocab, out + HDR_FLOATS, scratch);
                free(seqs);
                if (mine != TSR_OK && prev == TSR_OK)
                        log_error("step %llu: this stage failed: %s", (unsigned long long)ctl.step,
                                  tsr_status_str(mine));
                ((int32_t *)out)[0] = mine;
                ((int32_t *)out)[1] = 0;
                st = tsr_comm_send(c, out, (HDR_FLOATS + (last ? ctl.out_floats : out_n)) * sizeof(float),
                                   last ? 0 : (int)cfg->node_rank + 1, last ? TAG_OUT : TAG_ACT, NULL);
                if (st != TSR_OK)
                        break;
        }
        free(plan);
        free(in);
        free(out);
        tsr_plan_tables_clear(&known);
        free(scratch);
        return st;
}

tsr_status tsr_nodes_follow(const tsr_nodes_cfg *cfg, tsr_nodes_stage_fn fn, void *ud, size_t hidden_floats,
                            size_t vocab, char *err, size_t errlen) {
        tsr_status st = TSR_OK;

        while (!atomic_load(&follow_stop)) {
                tsr_comm *c = NULL;
                uint64_t epoch = 0;
                log_info("node %u of %u: meeting node 0 at %s:%u (up to %u s)", cfg->node_rank, cfg->nnodes,
                         cfg->master_addr, cfg->master_port, cfg->join_timeout_ms / 1000);
                if ((st = join(cfg, &follow_stop, NULL, NULL, &c, &epoch, err, errlen)) != TSR_OK)
                        break;
                ready_msg m = {.kv_blocks = cfg->kv_blocks, .state_slots = cfg->state_slots};
                pthread_mutex_lock(&follow_mu);
                follow_comm = c;
                pthread_mutex_unlock(&follow_mu);
                if (atomic_load(&follow_stop))  /* a stop between the join and the line above */
                        tsr_comm_abort(c);
                log_info("node %u of %u: in the group (epoch %016llx), serving pipeline stage %u", cfg->node_rank,
                         cfg->nnodes, (unsigned long long)epoch, cfg->node_rank);
                st = tsr_comm_send(c, &m, sizeof m, 0, TAG_READY, NULL);
                if (st == TSR_OK)
                        st = follow_steps(cfg, c, fn, ud, hidden_floats, vocab, err, errlen);
                pthread_mutex_lock(&follow_mu);
                follow_comm = NULL;
                pthread_mutex_unlock(&follow_mu);
                tsr_comm_free(&c);
                if (atomic_load(&follow_stop))
                        break;
                if (st == TSR_E_PROTO)
                        break;
                log_warn("node %u: the group broke (%s): meeting node 0 again", cfg->node_rank, tsr_status_str(st));
        }
        if (atomic_load(&follow_stop))
                return TSR_OK;
        if (st == TSR_E_CANCELLED)
                return TSR_OK;
        return st;
}
