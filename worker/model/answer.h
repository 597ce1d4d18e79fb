/* answer.h - a step's logits rows answered where they were computed, on a device, so
 * that most of them never cross to the host (issue #16).  The engine offers a chunk's
 * row as its token when nothing else of the row is needed (engine.h tsr_engine_seq:
 * token, draw, and to a model that answers them lp, rules, prompt_lp); a family's
 * forward on a device backend hands its logits rows here with each chunk's engine
 * record, and gets back the rows that must come whole.
 *
 * For a token row: the request's rules (tsr_sampling_rules: allowed ids, min_tokens'
 * mask, bias, penalties over its history) applied on the device
 * (tsr_backend_logit_rules), then the argmax or the draw (tsr_backend_argmax /
 * tsr_backend_sample), and its logprobs of the raw row (tsr_backend_logprobs, from a
 * device copy taken before the rules or the draw changed the row): 4 bytes a row, or the
 * top k and the token's.  For a prompt-logprobs chunk, each prompt row's logprobs of the
 * prompt's next token.  The rest come back whole, each run of neighbours in one copy. */
#ifndef TSR_WORKER_MODEL_ANSWER_H
#define TSR_WORKER_MODEL_ANSWER_H

#include <stddef.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"
#include "worker/engine/engine.h"

/* The rows of one step: `lg` (n_rows, vocab) in backend memory (rows clobbered) and the
 * family's sequence records `seqs`, whose chunk i `chunk` describes: its engine record
 * (NULL: its rows come back whole) and how many logits rows it has (*rows: 0, 1 or its
 * n).  Writes every token row's *token (and *lp), every prompt_lp row's logprobs, and
 * the other rows into `logits` (n_rows, vocab), leaving the answered rows' places
 * unwritten.  A token row without an answer (no maximum, bad rules) gets
 * TSR_ARGMAX_NONE, as the engine's tsr_sample fails such a row; a prompt row without
 * logprobs fails the step (TSR_E_INVAL, as the engine's own gathering does).  The
 * caller's thread; synchronous (the answers are on the host when it returns). */
typedef const tsr_engine_seq *(*tsr_answer_chunk_fn)(const void *seqs, size_t i, size_t *rows);
tsr_status tsr_answer_rows(tsr_backend *be, tsr_answer_chunk_fn chunk, const void *seqs, size_t n_seqs,
                           float *logits, float *lg, size_t vocab);

#endif
