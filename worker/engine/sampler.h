/* sampler.h - one sequence's logits to its next token, with vLLM V1 semantics.
 *
 * The engine calls tsr_sample once per sequence per step.  Everything a call depends on
 * is in its arguments (sampling parameters, the sequence's token history, a 64-bit RNG
 * key and the logits row), so a sequence samples the same token alone or in any batch,
 * and at any step of a re-run after preemption: batch invariance holds by construction.
 * The sampler has no state and no globals; every function here is re-entrant and may be
 * called from any number of threads at once on disjoint scratch buffers.
 *
 * Order of operations (vLLM v1/sample/sampler.py, logits_processor/builtin.py,
 * ops/penalties.py, ops/topk_topp_sampler.py):
 *   1. raw logprobs (when asked): log_softmax of the logits as given;
 *   2. allowed_token_ids (everything else -> -inf), then min_tokens (EOS and stop ids
 *      -> -inf while n_output < min_tokens), then logit_bias (added);
 *   3. penalties: repetition over prompt+output tokens (logit > 0 ? logit/p : logit*p),
 *      then frequency (-= f * count) and presence (-= p * [count > 0]) over the output;
 *   4. temperature < TSR_SAMPLER_GREEDY_EPS: the token is the argmax (lowest id on ties);
 *   5. otherwise: logits / temperature, min_p, top_k, top_p, softmax, then one draw.
 *
 * The draw is an inverse-CDF draw, not vLLM's exponential race (argmax p/q, q ~ Exp(1)
 * per token): it takes one uniform number per step instead of one per vocabulary entry,
 * which would cost more than the rest of the sampler on a 128k vocabulary.  Both draw
 * exactly from the same distribution; no two implementations share a random stream
 * anyway (vLLM's comes from torch's generator), so seeded outputs are reproducible within
 * Tessera, not equal to vLLM's.  The uniform number is Philox4x32-10 (Salmon et al.,
 * "Parallel random numbers: as easy as 1, 2, 3", SC'11) with key = the 64-bit RNG key
 * and counter = (n_output, 0): the position in the output is the counter, so step k of
 * a sequence gets the same number whatever ran before it or beside it.
 *
 * The engine chooses the RNG key once per sequence: the request's `seed` when it has one
 * (and, as vLLM does for n > 1, seed + i for the i-th child), otherwise 64 random bits
 * drawn at admission.  Two requests with the same seed and the same logits therefore
 * sample the same tokens, as users of `seed` expect. */
#ifndef TSR_SAMPLER_H
#define TSR_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/kernels.h"

/* vLLM's _SAMPLING_EPS: a temperature below this means greedy. */
#define TSR_SAMPLER_GREEDY_EPS 1e-5f
/* vLLM's default --max-logprobs; the top-logprobs arrays below hold this many. */
#define TSR_SAMPLER_MAX_LOGPROBS 20
/* Floats of working space tsr_sample and tsr_sampler_probs take for a row of `vocab`:
 * the working row, the candidates' ids and their exps (top_p). */
#define TSR_SAMPLER_SCRATCH(vocab) (3 * (size_t)(vocab))

typedef struct tsr_logit_bias {
        uint32_t id;     /* < vocab */
        float bias;      /* finite; added to the logit */
} tsr_logit_bias;

/* One request's sampling parameters.  Borrowed arrays must outlive the call only.
 * tsr_sampling_init gives vLLM's neutral defaults; tsr_sampling_check validates. */
typedef struct tsr_sampling {
        float temperature;          /* >= 0; < TSR_SAMPLER_GREEDY_EPS is greedy */
        float top_p;                /* (0, 1]; 1 is off */
        float min_p;                /* [0, 1]; 0 is off */
        float repetition_penalty;   /* > 0; 1 is off */
        float presence_penalty;     /* finite (the router enforces [-2, 2]); 0 is off */
        float frequency_penalty;    /* finite (the router enforces [-2, 2]); 0 is off */
        int32_t top_k;              /* >= -1; 0 and -1 are off, and so is >= vocab */
        uint32_t min_tokens;        /* EOS and stop ids are masked while n_output < this */
        const uint32_t *eos_ids;    /* (n_eos,) empty when ignore_eos */
        size_t n_eos;
        const uint32_t *stop_ids;   /* (n_stop,) the request's stop_token_ids */
        size_t n_stop;
        const tsr_logit_bias *bias; /* (n_bias,) */
        size_t n_bias;
        const uint32_t *allowed_ids; /* (n_allowed,) allowed_token_ids; NULL/0 allows all */
        size_t n_allowed;
        int32_t logprobs;           /* -1: none; 0: the sampled token's only; k: plus top k */
} tsr_sampling;

/* The sequence's tokens so far.  n_output is also the RNG counter (see top). */
typedef struct tsr_sample_history {
        const uint32_t *prompt;     /* (n_prompt,) */
        size_t n_prompt;
        const uint32_t *output;     /* (n_output,) tokens sampled so far */
        size_t n_output;
} tsr_sample_history;

/* Raw logprobs of one position: the chosen (or prompt) token and the top n_top. */
typedef struct tsr_token_logprobs {
        uint32_t token;
        float logprob;              /* log_softmax(raw logits)[token] */
        uint32_t rank;              /* count of logprobs >= logprob (1 = best), as vLLM */
        uint32_t n_top;
        uint32_t top_ids[TSR_SAMPLER_MAX_LOGPROBS];      /* by logprob desc, lower id first on ties */
        float top_logprobs[TSR_SAMPLER_MAX_LOGPROBS];
} tsr_token_logprobs;

typedef struct tsr_sample_result {
        uint32_t token;
        bool has_logprobs;          /* sampling.logprobs >= 0 */
        tsr_token_logprobs lp;      /* valid when has_logprobs */
} tsr_sample_result;

/* vLLM's defaults: temperature 1, top_p 1, top_k 0, min_p 0, penalties off, no bias,
 * no min_tokens, logprobs -1. */
void tsr_sampling_init(tsr_sampling *s);

/* TSR_OK if every parameter is in range for this vocabulary (ids < vocab, floats finite,
 * logprobs <= min(TSR_SAMPLER_MAX_LOGPROBS, vocab), arrays non-NULL when counted), else
 * TSR_E_INVAL.  tsr_sample checks the same; the engine may call it at admission to
 * refuse a request before it runs. */
tsr_status tsr_sampling_check(const tsr_sampling *s, size_t vocab);

/* Whether the token after n_output tokens needs nothing of the row but the token: no
 * logprobs, and no processor or penalty (allowed ids, logit bias, an active min_tokens
 * mask, repetition/presence/frequency penalties), so only temperature, top_k, top_p and
 * min_p shape it; a device may then pick it in place of the row's download (engine.h
 * tsr_engine_seq.token). */
bool tsr_sampling_device_ok(const tsr_sampling *s, size_t n_output);
/* tsr_sampling_device_ok but for logprobs: the token and its raw logprobs
 * (tsr_logprobs_gather of the row as given) are all the engine needs of the row. */
bool tsr_sampling_token_and_logprobs_ok(const tsr_sampling *s, size_t n_output);
/* Whether the token and its logprobs need nothing of the request's history: no
 * repetition, presence or frequency penalty.  Its allowed ids, logit bias and min_tokens'
 * mask are the request's own lists, which go where the row is (a multi-node replica's
 * last node: tsr_engine_seq.rules). */
bool tsr_sampling_history_free(const tsr_sampling *s);
/* tsr_sampling_device_ok and greedy: tsr_sample's token is the first maximum of the row
 * as given (TSR_E_INVAL for a row holding NaN or +inf or only -inf). */
bool tsr_sampling_plain_argmax(const tsr_sampling *s, size_t n_output);

/* Sample the next token of one sequence.
 * `logits` (vocab,) is read only.  `scratch` (TSR_SAMPLER_SCRATCH(vocab) floats) is working space, any
 * contents, clobbered.  `rng_key`: see top; unused for greedy.  Writes *out only on
 * success.  Returns TSR_OK; TSR_E_INVAL for vocab 0, bad parameters, a token id >= vocab
 * in the history, a NaN or +inf logit, or when every token ends up masked (-inf). */
tsr_status tsr_sample(const tsr_sampling *s, const tsr_sample_history *h, uint64_t rng_key,
                      const float *logits, size_t vocab, float *scratch, tsr_sample_result *out);

/* tsr_sample's token with the draw's uniform given: u = tsr_sampler_uniform(rng_key,
 * n_output) is the token tsr_sample gives at that position with history h, bit for
 * bit.  h NULL: the sequence's sampling needs nothing of its history
 * (tsr_sampling_history_free: temperature, top_k, top_p, min_p, allowed ids, logit bias,
 * and min_tokens' mask as at n_output 0: min_tokens > 0 masks the EOS and stop ids); else
 * the penalties read it.  Where the row is and the request is not (a multi-node
 * replica's last node, nodes.c).  No logprobs (the caller gathers them from the row).
 * TSR_E_INVAL as tsr_sample, and for logprobs asked or penalties without a history. */
tsr_status tsr_sample_uniform_given(const tsr_sampling *s, const tsr_sample_history *h, double u,
                                    const float *logits, size_t vocab, float *scratch, uint32_t *token);

/* The distribution tsr_sample draws from (steps 2-5 above), written to `probs` (vocab,)
 * on success only: zeros for masked tokens, and one-hot at the argmax when greedy.
 * `*greedy` (may be NULL) gets the argmax after steps 2-3.  Same arguments, checks and
 * scratch as tsr_sample; it is the code tsr_sample runs. */
tsr_status tsr_sampler_probs(const tsr_sampling *s, const tsr_sample_history *h,
                             const float *logits, size_t vocab, float *scratch,
                             float *probs, uint32_t *greedy);

/* Raw logprobs of `token` plus the top `k` (k <= TSR_SAMPLER_MAX_LOGPROBS and <= vocab)
 * from one row of raw logits: tsr_sample uses it for the sampled token and the engine
 * for prompt_logprobs.  O(vocab * (1 + k)) worst case, no scratch.  Writes *out only on
 * success; TSR_E_INVAL for a bad k or token, NaN/+inf logits or all -inf. */
tsr_status tsr_logprobs_gather(const float *logits, size_t vocab, uint32_t token, uint32_t k,
                               tsr_token_logprobs *out);

/* log_softmax of one row into out (vocab,), on success only; the values are bitwise
 * those tsr_logprobs_gather reports.  TSR_E_INVAL as for tsr_logprobs_gather. */
tsr_status tsr_log_softmax_row(const float *logits, size_t vocab, float *out);

/* The words tsr_sampling_rules needs in `buf` for s with a history of n_history tokens. */
size_t tsr_sampling_rules_words(const tsr_sampling *s, size_t n_history);
/* s's processors and penalties (tsr_sample's steps 2-3) as kernels.h's tsr_logit_rules,
 * which a device applies to the row before it picks the token (tsr_backend_logit_rules
 * then tsr_backend_argmax / tsr_backend_sample): allowed ids, min_tokens' EOS and stop
 * ids when mask_eos, the bias list, and each distinct token of h (NULL: no penalties)
 * with its count in the output or -1 for the prompt's only (those only with a
 * repetition penalty).  out's lists point into buf (tsr_sampling_rules_words words) and
 * into s.  TSR_E_INVAL for bad parameters (tsr_sampling_check), a history id >= vocab,
 * or penalties without a history. */
tsr_status tsr_sampling_rules(const tsr_sampling *s, const tsr_sample_history *h, bool mask_eos, size_t vocab,
                              uint32_t *buf, tsr_logit_rules *out);

/* Philox4x32-10: the block function of Random123, 10 rounds. */
void tsr_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The uniform number in [0, 1) (53 bits) that the draw at output position `position`
 * of a sequence keyed `key` uses. */
double tsr_sampler_uniform(uint64_t key, uint64_t position);

#endif
