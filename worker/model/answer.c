/* answer.c - see answer.h.  One call per step, on the thread running the forward. */
#include "worker/model/answer.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "worker/engine/sampler.h"

_Static_assert(TSR_SAMPLER_MAX_LOGPROBS == TSR_LOGPROBS_TOP_MAX, "the engine's logprobs are the backend's");

/* Chunk q's one row comes back as its token (the engine offers only a last row). */
static bool token_row(const tsr_engine_seq *q, size_t rows) {
        return q && q->token && rows == 1 && !q->want_all_logits;
}

/* Chunk q's prompt rows answered as their logprobs (q NULL: none). */
static size_t plp_rows(const tsr_engine_seq *q) { return q ? tsr_engine_seq_prompt_lp_rows(q) : 0; }

static tsr_token_logprobs engine_lp(uint32_t token, uint32_t k, const tsr_row_logprobs *r) {
        tsr_token_logprobs lp;
        memset(&lp, 0, sizeof lp);
        lp.token = token;
        lp.logprob = r->logprob;
        lp.rank = r->rank;
        lp.n_top = k;
        memcpy(lp.top_ids, r->top_ids, k * sizeof(uint32_t));
        memcpy(lp.top_logprobs, r->top_logprobs, k * sizeof(float));
        return lp;
}

/* Everything one call keeps per logits row (n_rows of each), in one allocation (`block`,
 * the 8-byte aligned arrays first). */
struct rows {
        void *block;
        tsr_draw *draws;                /* temperature 0: not drawn */
        tsr_logit_rules *rules;         /* empty: none */
        size_t *copy;                   /* its raw copy's index, or SIZE_MAX */
        tsr_row_logprobs *lp;
        uint32_t *argmax, *drawn;
        uint32_t *lp_token, *lp_top;    /* logprobs of the row as it is in lg (TSR_ARGMAX_NONE: none) */
        bool *bad;                      /* a token row without an answer */
};

static tsr_status rows_alloc(struct rows *w, size_t n) {
        size_t per = sizeof *w->draws + sizeof *w->rules + sizeof *w->copy + sizeof *w->lp + 4 * sizeof(uint32_t) +
                     sizeof *w->bad;
        char *p = w->block = calloc(n, per);
        if (!p)
                return TSR_E_NOMEM;
        w->draws = (tsr_draw *)(void *)p;
        w->rules = (tsr_logit_rules *)(void *)(p += n * sizeof *w->draws);
        w->copy = (size_t *)(void *)(p += n * sizeof *w->rules);
        w->lp = (tsr_row_logprobs *)(void *)(p += n * sizeof *w->copy);
        w->argmax = (uint32_t *)(void *)(p += n * sizeof *w->lp);
        w->drawn = w->argmax + n;
        w->lp_token = w->drawn + n;
        w->lp_top = w->lp_token + n;
        w->bad = (bool *)(w->lp_top + n);
        for (size_t r = 0; r < n; r++) {
                w->lp_token[r] = TSR_ARGMAX_NONE;
                w->copy[r] = SIZE_MAX;
        }
        return TSR_OK;
}

/* The rows that come back whole, each run of neighbours in one copy. */
static tsr_status download_whole(tsr_backend *be, const tsr_engine_seq *const *ans, const size_t *rows, size_t n_seqs,
                                 float *logits, const float *lg, size_t vocab) {
        size_t row_bytes = vocab * sizeof(float), row = 0, run = 0;    /* rows [run, row) to copy */
        tsr_status st = TSR_OK;
        for (size_t i = 0; i < n_seqs && st == TSR_OK; i++) {
                size_t answered = token_row(ans[i], rows[i]) ? 1 : plp_rows(ans[i]);
                if (answered) {         /* the chunk's leading rows: the run stops before them */
                        st = tsr_backend_download(be, (char *)logits + run * row_bytes,
                                                  (const char *)lg + run * row_bytes, (row - run) * row_bytes);
                        run = row + answered;
                }
                row += rows[i];
        }
        if (st == TSR_OK)
                st = tsr_backend_download(be, (char *)logits + run * row_bytes, (const char *)lg + run * row_bytes,
                                          (row - run) * row_bytes);
        return st;
}

static tsr_status answer_rows(tsr_backend *be, const tsr_engine_seq *const *ans, const size_t *rows, size_t n_seqs,
                              float *logits, float *lg, size_t vocab) {
        size_t n_rows = 0, n_answered = 0, n_argmax = 0, n_draw = 0, n_rules = 0, n_copy = 0, rule_words = 0;
        size_t row_bytes = vocab * sizeof(float);
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *q = ans[i];
                n_rows += rows[i];
                if (token_row(q, rows[i])) {
                        n_answered++;
                        q->draw ? n_draw++ : n_argmax++;
                        if (q->rules)
                                rule_words += tsr_sampling_rules_words(q->rules, q->history ? q->n_history : 0);
                } else {
                        n_answered += plp_rows(q);
                }
        }
        if (n_answered == 0)
                return tsr_backend_download(be, logits, lg, n_rows * row_bytes);
        if (vocab > UINT32_MAX)
                return TSR_E_INVAL;

        struct rows w = {0};
        uint32_t *words = rule_words ? malloc(rule_words * sizeof *words) : NULL;
        float *raw = NULL;
        tsr_status st = rows_alloc(&w, n_rows);
        if (st == TSR_OK && rule_words && !words)
                st = TSR_E_NOMEM;
        /* 1. Each token row's draw and rules; a copy of the raw row where its logprobs are
         * wanted and the rules or the draw change the row first. */
        uint32_t *wp = words;
        for (size_t i = 0, row = 0; i < n_seqs && st == TSR_OK; row += rows[i], i++) {
                const tsr_engine_seq *q = ans[i];
                if (!token_row(q, rows[i]))
                        continue;
                if (q->draw)
                        w.draws[row] = *q->draw;
                if (q->rules) {
                        tsr_sample_history h = q->history ? tsr_engine_seq_history(q) : (tsr_sample_history){0};
                        if (tsr_sampling_rules(q->rules, q->history ? &h : NULL, q->rules_mask_eos, vocab, wp,
                                               &w.rules[row]) != TSR_OK) {
                                memset(&w.rules[row], 0, sizeof w.rules[row]);
                                w.bad[row] = true;      /* no answer: the engine fails the request */
                        } else {
                                n_rules++;
                        }
                        wp += tsr_sampling_rules_words(q->rules, q->history ? q->n_history : 0);
                }
                if (q->lp && (q->rules || q->draw))
                        w.copy[row] = n_copy++;
        }
        if (st == TSR_OK && n_copy)
                st = tsr_backend_mem_alloc(be, n_copy * row_bytes, (void **)&raw);
        for (size_t r = 0; r < n_rows && st == TSR_OK; r++)
                if (w.copy[r] != SIZE_MAX)
                        st = tsr_backend_copy(be, (char *)raw + w.copy[r] * row_bytes, (const char *)lg + r * row_bytes,
                                              row_bytes);
        /* 2. The rules, then the argmax (before the draws: those overwrite their rows) */
        if (st == TSR_OK && n_rules)
                st = tsr_backend_logit_rules(be, lg, n_rows, vocab, w.rules);
        if (st == TSR_OK && n_argmax)
                st = tsr_backend_argmax(be, w.argmax, lg, n_rows, vocab);
        if (st == TSR_OK && n_draw)
                st = tsr_backend_sample(be, w.drawn, lg, n_rows, vocab, w.draws);
        /* 3. The logprobs: of the rows as computed (token rows left unchanged, prompt
         * rows) in place, of the others from their copies */
        uint32_t *copy_token = NULL, *copy_top = NULL;
        tsr_row_logprobs *copy_lp = NULL;
        if (st == TSR_OK && n_copy) {
                copy_token = malloc(n_copy * sizeof *copy_token);
                copy_top = malloc(n_copy * sizeof *copy_top);
                copy_lp = malloc(n_copy * sizeof *copy_lp);
                if (!copy_token || !copy_top || !copy_lp)
                        st = TSR_E_NOMEM;
        }
        size_t n_lp_in_place = 0;
        for (size_t i = 0, row = 0; i < n_seqs && st == TSR_OK; row += rows[i], i++) {
                const tsr_engine_seq *q = ans[i];
                if (token_row(q, rows[i])) {
                        uint32_t t = w.bad[row] ? TSR_ARGMAX_NONE : q->draw ? w.drawn[row] : w.argmax[row];
                        *q->token = t;
                        if (!q->lp)
                                continue;
                        if (w.copy[row] != SIZE_MAX) {
                                copy_token[w.copy[row]] = t;       /* >= vocab: skipped */
                                copy_top[w.copy[row]] = q->lp_top;
                        } else {
                                w.lp_token[row] = t;
                                w.lp_top[row] = q->lp_top;
                                n_lp_in_place++;
                        }
                        continue;
                }
                for (size_t t = 0, np = plp_rows(q); t < np; t++) {
                        w.lp_token[row + t] = t + 1 < q->n ? q->tokens[t + 1] : q->next_token;
                        w.lp_top[row + t] = q->prompt_lp_top;
                        if (w.lp_token[row + t] >= vocab)
                                st = TSR_E_INVAL;       /* a prompt id past the vocabulary */
                        n_lp_in_place++;
                }
        }
        if (st == TSR_OK && n_lp_in_place)
                st = tsr_backend_logprobs(be, w.lp, lg, n_rows, vocab, w.lp_token, w.lp_top);
        if (st == TSR_OK && n_copy)
                st = tsr_backend_logprobs(be, copy_lp, raw, n_copy, vocab, copy_token, copy_top);
        /* 4. The answers to the engine's places */
        for (size_t i = 0, row = 0; i < n_seqs && st == TSR_OK; row += rows[i], i++) {
                const tsr_engine_seq *q = ans[i];
                if (token_row(q, rows[i])) {
                        uint32_t t = *q->token;
                        if (!q->lp || t >= vocab)
                                continue;
                        const tsr_row_logprobs *r = w.copy[row] != SIZE_MAX ? &copy_lp[w.copy[row]] : &w.lp[row];
                        if (r->rank == 0)
                                *q->token = TSR_ARGMAX_NONE;    /* no distribution: as tsr_sample's */
                        else
                                *q->lp = engine_lp(t, q->lp_top, r);
                        continue;
                }
                for (size_t t = 0, np = plp_rows(q); t < np && st == TSR_OK; t++) {
                        if (w.lp[row + t].rank == 0)
                                st = TSR_E_INVAL;       /* as the engine's own gathering */
                        else
                                q->prompt_lp[t] = engine_lp(w.lp_token[row + t], q->prompt_lp_top, &w.lp[row + t]);
                }
        }
        if (st == TSR_OK)
                st = download_whole(be, ans, rows, n_seqs, logits, lg, vocab);
        tsr_backend_mem_free(be, raw);
        free(copy_token);
        free(copy_top);
        free(copy_lp);
        free(words);
        free(w.block);
        return st;
}

tsr_status tsr_answer_rows(tsr_backend *be, tsr_answer_chunk_fn chunk, const void *seqs, size_t n_seqs,
                           float *logits, float *lg, size_t vocab) {
        const tsr_engine_seq **ans = malloc((n_seqs ? n_seqs : 1) * sizeof *ans);
        size_t *rows = malloc((n_seqs ? n_seqs : 1) * sizeof *rows);
        tsr_status st = ans && rows ? TSR_OK : TSR_E_NOMEM;
        for (size_t i = 0; i < n_seqs && st == TSR_OK; i++)
                ans[i] = chunk(seqs, i, &rows[i]);
        if (st == TSR_OK)
                st = answer_rows(be, ans, rows, n_seqs, logits, lg, vocab);
        free(ans);
        free(rows);
        return st;
}
