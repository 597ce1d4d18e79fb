/* sampler.c - see sampler.h for the order of operations and the RNG.
 *
 * Layout of the 2*vocab scratch floats: w = scratch[0, vocab) holds the working logits
 * and, at the end, the probabilities; a = scratch[vocab, 2*vocab) is auxiliary space
 * (output-token counts for the penalties, a copy for top-k selection, candidate ids for
 * top-p).  Sums of exponentials are accumulated in double in index order, so a row's
 * result never depends on anything but the row. */
#include "worker/engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Philox4x32 constants (Random123): round multipliers and Weyl key increments. */
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void tsr_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
        uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
        uint32_t k0 = key[0], k1 = key[1];

        for (int r = 0; r < 10; r++) {
                uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
                uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
                uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
                uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;

                c0 = n0;
                c1 = (uint32_t)p1;
                c2 = n2;
                c3 = (uint32_t)p0;
                k0 += PHILOX_W0;        /* the bump after the last round is unused */
                k1 += PHILOX_W1;
        }
        out[0] = c0;
        out[1] = c1;
        out[2] = c2;
        out[3] = c3;
}

double tsr_sampler_uniform(uint64_t key, uint64_t position) {
        uint32_t ctr[4] = {(uint32_t)position, (uint32_t)(position >> 32), 0, 0};
        uint32_t k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
        uint32_t r[4];

        tsr_philox4x32_10(ctr, k, r);
        /* 27 + 26 bits: every double in [0, 1) with a 2^-53 step, none equal to 1. */
        return ((double)(r[0] >> 5) * 67108864.0 + (double)(r[1] >> 6)) * (1.0 / 9007199254740992.0);
}

void tsr_sampling_init(tsr_sampling *s) {
        memset(s, 0, sizeof(*s));
        s->temperature = 1.0f;
        s->top_p = 1.0f;
        s->repetition_penalty = 1.0f;
        s->logprobs = -1;
}

static bool ids_ok(const uint32_t *ids, size_t n, size_t vocab) {
        if (n && !ids)
                return false;
        for (size_t i = 0; i < n; i++)
                if (ids[i] >= vocab)
                        return false;
        return true;
}

tsr_status tsr_sampling_check(const tsr_sampling *s, size_t vocab) {
        if (!s || vocab == 0 || vocab > UINT32_MAX)
                return TSR_E_INVAL;
        /* Written as negated ranges so that NaN fails every test. */
        if (!(s->temperature >= 0.0f) || !isfinite(s->temperature))
                return TSR_E_INVAL;
        if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
                return TSR_E_INVAL;
        if (!(s->min_p >= 0.0f && s->min_p <= 1.0f))
                return TSR_E_INVAL;
        if (!(s->repetition_penalty > 0.0f) || !isfinite(s->repetition_penalty))
                return TSR_E_INVAL;
        if (!isfinite(s->presence_penalty) || !isfinite(s->frequency_penalty))
                return TSR_E_INVAL;
        if (s->top_k < -1)
                return TSR_E_INVAL;
        if (s->logprobs < -1 || s->logprobs > TSR_SAMPLER_MAX_LOGPROBS || (s->logprobs > 0 && (size_t)s->logprobs > vocab))
                return TSR_E_INVAL;
        if (!ids_ok(s->eos_ids, s->n_eos, vocab) || !ids_ok(s->stop_ids, s->n_stop, vocab) ||
            !ids_ok(s->allowed_ids, s->n_allowed, vocab))
                return TSR_E_INVAL;
        if (s->n_bias && !s->bias)
                return TSR_E_INVAL;
        for (size_t i = 0; i < s->n_bias; i++)
                if (s->bias[i].id >= vocab || !isfinite(s->bias[i].bias))
                        return TSR_E_INVAL;
        return TSR_OK;
}

bool tsr_sampling_token_and_logprobs_ok(const tsr_sampling *s, size_t n_output) {
        bool min_tokens_mask = n_output < s->min_tokens && (s->n_eos || s->n_stop);
        return s->n_allowed == 0 && s->n_bias == 0 && !min_tokens_mask && tsr_sampling_history_free(s);
}

bool tsr_sampling_history_free(const tsr_sampling *s) {
        return s->repetition_penalty == 1.0f && s->presence_penalty == 0.0f && s->frequency_penalty == 0.0f;
}

bool tsr_sampling_device_ok(const tsr_sampling *s, size_t n_output) {
        return s->logprobs < 0 && tsr_sampling_token_and_logprobs_ok(s, n_output);
}

bool tsr_sampling_plain_argmax(const tsr_sampling *s, size_t n_output) {
        return s->temperature < TSR_SAMPLER_GREEDY_EPS && tsr_sampling_device_ok(s, n_output);
}

/* Max of a row; TSR_E_INVAL for NaN or +inf anywhere or when all are -inf (no
 * distribution exists).  -inf entries are legal: they are masked tokens. */
static tsr_status row_max(const float *x, size_t n, float *ret) {
        float m = -INFINITY;

        for (size_t i = 0; i < n; i++) {
                if (isnan(x[i]) || x[i] == INFINITY)
                        return TSR_E_INVAL;
                if (x[i] > m)
                        m = x[i];
        }
        if (m == -INFINITY)
                return TSR_E_INVAL;
        *ret = m;
        return TSR_OK;
}

/* sum(exp(x - m)) in double, index order. */
static double row_expsum(const float *x, size_t n, float m) {
        double z = 0.0;

        for (size_t i = 0; i < n; i++)
                z += (double)expf(x[i] - m);
        return z;
}

/* One log-softmax value; the single formula behind every logprob we report. */
static inline float lsm(float x, float m, double lse) {
        return (float)((double)(x - m) - lse);
}

tsr_status tsr_log_softmax_row(const float *logits, size_t vocab, float *out) {
        float m;
        double lse;
        tsr_status st;

        if (!logits || !out || vocab == 0)
                return TSR_E_INVAL;
        st = row_max(logits, vocab, &m);
        if (st != TSR_OK)
                return st;
        lse = log(row_expsum(logits, vocab, m));
        for (size_t i = 0; i < vocab; i++)
                out[i] = lsm(logits[i], m, lse);
        return TSR_OK;
}

tsr_status tsr_logprobs_gather(const float *logits, size_t vocab, uint32_t token, uint32_t k,
                               tsr_token_logprobs *out) {
        tsr_token_logprobs r;
        float m, lt;
        double lse;
        uint32_t rank = 0, n = 0;
        tsr_status st;

        if (!logits || !out || vocab == 0 || token >= vocab || k > TSR_SAMPLER_MAX_LOGPROBS || k > vocab)
                return TSR_E_INVAL;
        st = row_max(logits, vocab, &m);
        if (st != TSR_OK)
                return st;
        lse = log(row_expsum(logits, vocab, m));
        lt = lsm(logits[token], m, lse);
        memset(&r, 0, sizeof(r));
        for (size_t i = 0; i < vocab; i++) {
                float v = lsm(logits[i], m, lse);
                uint32_t j;

                /* vLLM counts x >= x_token (itself included), so tied tokens share the
                 * worst rank of their group rather than the best. */
                if (v >= lt)
                        rank++;
                if (k == 0 || (n == k && !(v > r.top_logprobs[n - 1])))
                        continue;
                /* Insertion into the sorted top list; strict > keeps lower ids first
                 * among equal values since ids arrive in increasing order. */
                j = n < k ? n++ : k - 1;
                while (j > 0 && v > r.top_logprobs[j - 1]) {
                        r.top_logprobs[j] = r.top_logprobs[j - 1];
                        r.top_ids[j] = r.top_ids[j - 1];
                        j--;
                }
                r.top_logprobs[j] = v;
                r.top_ids[j] = (uint32_t)i;
        }
        r.token = token;
        r.logprob = lt;
        r.rank = rank;
        r.n_top = n;
        *out = r;
        return TSR_OK;
}

size_t tsr_sampling_rules_words(const tsr_sampling *s, size_t n_history) {
        /* the mask, the bias ids and values, and per history token a sort slot, an id
         * and a count */
        return s->n_eos + s->n_stop + 2 * s->n_bias + 3 * n_history;
}

/* n ids from src (which may be NULL when n is 0: memcpy's arguments may not). */
static void copy_ids(uint32_t *dst, const uint32_t *src, size_t n) {
        if (n)
                memcpy(dst, src, n * sizeof *dst);
}

static int cmp_u32(const void *a, const void *b) {
        uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
        return x < y ? -1 : x > y;
}

/* Whether id is in sorted[0, n). */
static bool sorted_has(const uint32_t *sorted, size_t n, uint32_t id) {
        size_t lo = 0, hi = n;
        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (sorted[mid] < id)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return lo < n && sorted[lo] == id;
}

tsr_status tsr_sampling_rules(const tsr_sampling *s, const tsr_sample_history *h, bool mask_eos, size_t vocab,
                              uint32_t *buf, tsr_logit_rules *out) {
        bool rep = s && s->repetition_penalty != 1.0f;
        bool pen = s && (rep || s->frequency_penalty != 0.0f || s->presence_penalty != 0.0f);
        if (!out || tsr_sampling_check(s, vocab) != TSR_OK || (pen && !h) ||
            (h && (!ids_ok(h->prompt, h->n_prompt, vocab) || !ids_ok(h->output, h->n_output, vocab))))
                return TSR_E_INVAL;
        size_t n_hist = h ? h->n_prompt + h->n_output : 0;
        if ((tsr_sampling_rules_words(s, n_hist) && !buf) || s->n_allowed > UINT32_MAX || n_hist > UINT32_MAX)
                return TSR_E_INVAL;
        memset(out, 0, sizeof *out);
        out->allowed = s->allowed_ids;
        out->n_allowed = (uint32_t)s->n_allowed;
        uint32_t *w = buf;
        if (mask_eos) {
                out->masked = w;
                copy_ids(w, s->eos_ids, s->n_eos);
                copy_ids(w + s->n_eos, s->stop_ids, s->n_stop);
                out->n_masked = (uint32_t)(s->n_eos + s->n_stop);
                w += out->n_masked;
        }
        if (s->n_bias) {
                float *vals = (float *)(void *)(w + s->n_bias);
                out->bias_ids = w;
                out->bias = vals;
                for (size_t j = 0; j < s->n_bias; j++) {
                        w[j] = s->bias[j].id;
                        vals[j] = s->bias[j].bias;
                }
                out->n_bias = (uint32_t)s->n_bias;
                w += 2 * s->n_bias;
        }
        if (!pen)
                return TSR_OK;
        out->repetition = s->repetition_penalty;
        out->frequency = s->frequency_penalty;
        out->presence = s->presence_penalty;
        /* the outputs sorted, counted by runs; then the prompt's other tokens (-1) */
        uint32_t *sorted = w, *ids = w + n_hist;
        float *counts = (float *)(void *)(ids + n_hist);
        uint32_t n = 0;
        copy_ids(sorted, h->output, h->n_output);
        qsort(sorted, h->n_output, sizeof *sorted, cmp_u32);
        for (size_t i = 0; i < h->n_output;) {
                size_t j = i;
                while (j < h->n_output && sorted[j] == sorted[i])
                        j++;
                ids[n] = sorted[i];
                counts[n++] = (float)(j - i);
                i = j;
        }
        if (rep) {
                uint32_t *prompt = sorted + h->n_output;
                copy_ids(prompt, h->prompt, h->n_prompt);
                qsort(prompt, h->n_prompt, sizeof *prompt, cmp_u32);
                for (size_t i = 0; i < h->n_prompt; i++)
                        if ((i == 0 || prompt[i] != prompt[i - 1]) && !sorted_has(sorted, h->n_output, prompt[i])) {
                                ids[n] = prompt[i];
                                counts[n++] = -1.0f;
                        }
        }
        out->pen_ids = ids;
        out->pen_counts = counts;
        out->n_pen = n;
        return TSR_OK;
}

/* Penalties over the history.  a[0, vocab) is zeroed, then a[t] = output count of t, or
 * -1 for a prompt-only token; each distinct token is penalised once and its slot reset
 * to 0 as the mark.  O(vocab + n_prompt + n_output) with no per-request state, which
 * is the price of a stateless sampler; the softmax passes are O(vocab) anyway. */
static void apply_penalty_one(const tsr_sampling *s, float *w, float *a, uint32_t t) {
        float c = a[t];

        if (c == 0.0f)
                return;
        if (s->repetition_penalty != 1.0f)
                w[t] = w[t] > 0.0f ? w[t] / s->repetition_penalty : w[t] * s->repetition_penalty;
        if (c > 0.0f) {
                /* Two separate subtractions, in vLLM's order. */
                w[t] -= s->frequency_penalty * c;
                w[t] -= s->presence_penalty;
        }
        a[t] = 0.0f;
}

static void apply_penalties(const tsr_sampling *s, const tsr_sample_history *h, float *w, float *a,
                            size_t vocab) {
        bool rep = s->repetition_penalty != 1.0f;

        if (!rep && s->frequency_penalty == 0.0f && s->presence_penalty == 0.0f)
                return;
        memset(a, 0, vocab * sizeof(*a));
        for (size_t i = 0; i < h->n_output; i++)
                a[h->output[i]] += 1.0f;
        /* The prompt only matters to the repetition penalty. */
        if (rep)
                for (size_t i = 0; i < h->n_prompt; i++)
                        if (a[h->prompt[i]] == 0.0f)
                                a[h->prompt[i]] = -1.0f;
        for (size_t i = 0; i < h->n_output; i++)
                apply_penalty_one(s, w, a, h->output[i]);
        if (rep)
                for (size_t i = 0; i < h->n_prompt; i++)
                        apply_penalty_one(s, w, a, h->prompt[i]);
}

/* The value that sits at ascending position `kth` of x[0, n) (x is reordered):
 * quickselect, median of three, expected O(n). */
static float select_kth(float *x, size_t n, size_t kth) {
        size_t lo = 0, hi = n - 1;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2, i = lo, j = hi;
                float a = x[lo], b = x[mid], c = x[hi];
                float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));

                /* Hoare partition: afterwards x[lo..j] <= pivot <= x[i..hi]. */
                while (i <= j) {
                        while (x[i] < pivot)
                                i++;
                        while (x[j] > pivot)
                                j--;
                        if (i <= j) {
                                float t = x[i];
                                x[i] = x[j];
                                x[j] = t;
                                i++;
                                if (j == 0)
                                        break;
                                j--;
                        }
                }
                if (kth <= j)
                        hi = j;
                else if (kth >= i)
                        lo = i;
                else
                        return x[kth];
        }
        return x[kth];
}

/* Ascending order of candidate ids by working logit; among equal logits the higher id
 * comes first, so top-p drops it first and the lower id survives (torch's sort leaves
 * that order unspecified). */
static inline bool cand_before(const float *w, uint32_t a, uint32_t b) {
        return w[a] < w[b] || (w[a] == w[b] && a > b);
}

static void sift_down(const float *w, uint32_t *ids, size_t root, size_t n) {
        for (;;) {
                size_t child = 2 * root + 1;
                uint32_t t;

                if (child >= n)
                        return;
                if (child + 1 < n && cand_before(w, ids[child], ids[child + 1]))
                        child++;
                if (!cand_before(w, ids[root], ids[child]))
                        return;
                t = ids[root];
                ids[root] = ids[child];
                ids[child] = t;
                root = child;
        }
}

/* Heapsort: no allocation, O(n log n) worst case. */
static void sort_candidates(const float *w, uint32_t *ids, size_t n) {
        for (size_t i = n / 2; i-- > 0;)
                sift_down(w, ids, i, n);
        for (size_t end = n; end-- > 1;) {
                uint32_t t = ids[0];
                ids[0] = ids[end];
                ids[end] = t;
                sift_down(w, ids, 0, end);
        }
}

/* top_p as vLLM's sort-based code: sort ascending, mask every token whose inclusive
 * cumulative probability is <= 1 - top_p, never the last (largest) one.  The masked
 * tokens are a prefix of that order, so only the boundary has to be found:
 *  - a token with probability below (1 - p) / (2 * vocab) sits in the ascending order
 *    behind tokens no larger than itself, so its cumulative sum is at most vocab times
 *    its probability, under half of 1 - p: it is masked whatever the order, and only
 *    its mass is carried into the cumulative sum;
 *  - the other candidates are narrowed by quickselect-style partitions (if everything
 *    up to the pivot has cumulative mass <= 1 - p, that whole part is masked, else the
 *    boundary lies below the pivot), and only the last small range is sorted.
 * Expected O(vocab); a full sort of a flat 128k distribution cost ~30 ms. */
#define TOP_P_SORT_BELOW 64

static inline double cand_prob(const float *w, uint32_t id, float m, double z) {
        return (double)expf(w[id] - m) / z;
}

static inline void swap_cand(uint32_t *ids, float *e, size_t a, size_t b) {
        uint32_t t = ids[a];
        float u = e[a];
        ids[a] = ids[b];
        ids[b] = t;
        e[a] = e[b];
        e[b] = u;
}

/* `e` (vocab,): scratch for each candidate's exp, which the partitions read instead of
 * computing it again (cand_prob's value, the same bits). */
static void apply_top_p(float *w, uint32_t *ids, float *e, size_t vocab, float top_p) {
        float m = -INFINITY;
        double z = 0.0, cum = 0.0, cut, low;
        size_t n = 0, lo, hi;

        for (size_t i = 0; i < vocab; i++)
                if (w[i] > m)
                        m = w[i];
        /* row_expsum's sum with each exp kept, so each is computed once: the same floats
         * in the same order, the same bits as computing them again (expf(-inf) is +0) */
        for (size_t i = 0; i < vocab; i++) {
                e[i] = w[i] == -INFINITY ? 0.0f : expf(w[i] - m);
                z += (double)e[i];
        }
        cut = (double)(1.0f - top_p);           /* vLLM computes 1 - p in float32 */
        low = cut / (2.0 * (double)vocab);
        for (size_t i = 0; i < vocab; i++) {
                double p = (double)e[i] / z;

                if (p < low) {
                        cum += p;
                        w[i] = -INFINITY;
                } else {
                        e[n] = e[i];    /* n <= i: compacted alongside the ids */
                        ids[n++] = (uint32_t)i;
                }
        }
        /* The argmax has p >= 1/vocab > low, so n >= 1.  Invariant: ids[0, lo) are
         * masked with their mass in cum; ids[hi, n) are kept. */
        lo = 0;
        hi = n;
        while (hi - lo > TOP_P_SORT_BELOW) {
                size_t mid = lo + (hi - lo) / 2, store = lo;
                uint32_t a = ids[lo], b = ids[mid], c = ids[hi - 1], pivot;
                double part = 0.0;

                if (cand_before(w, a, b))
                        pivot = cand_before(w, b, c) ? b : (cand_before(w, a, c) ? c : a);
                else
                        pivot = cand_before(w, a, c) ? a : (cand_before(w, b, c) ? c : b);
                /* Lomuto partition around the pivot, which ends at ids[store]. */
                for (size_t i = lo; i < hi; i++) {
                        if (ids[i] == pivot) {
                                swap_cand(ids, e, i, hi - 1);
                                break;
                        }
                }
                for (size_t i = lo; i + 1 < hi; i++) {
                        if (cand_before(w, ids[i], pivot)) {
                                swap_cand(ids, e, i, store);
                                part += (double)e[store] / z;
                                store++;
                        }
                }
                swap_cand(ids, e, hi - 1, store);
                part += (double)e[store] / z;
                if (cum + part <= cut && store + 1 < n) {
                        /* Every cumulative sum up to the pivot is <= cut: all masked. */
                        for (size_t i = lo; i <= store; i++)
                                w[ids[i]] = -INFINITY;
                        cum += part;
                        lo = store + 1;
                } else {
                        hi = store;     /* the pivot survives, and so does all above it */
                        if (cum + part <= cut)
                                break;  /* pivot is the last token: kept regardless */
                }
        }
        sort_candidates(w, ids + lo, hi - lo);
        for (size_t i = lo; i < hi && i + 1 < n; i++) {
                uint32_t id = ids[i];

                cum += cand_prob(w, id, m, z);
                if (cum > cut)
                        break;          /* cumulative sums only grow: the rest stay */
                w[id] = -INFINITY;
        }
}

/* The index of the first maximum of x[0, n) into *ret; TSR_E_INVAL for a NaN or +inf
 * anywhere or nothing above -inf (no distribution). */
static tsr_status first_max(const float *x, size_t n, uint32_t *ret) {
        float m = -INFINITY;
        uint32_t best = 0;
        for (size_t i = 0; i < n; i++) {
                if (isnan(x[i]) || x[i] == INFINITY)
                        return TSR_E_INVAL;
                if (x[i] > m) {
                        m = x[i];
                        best = (uint32_t)i;
                }
        }
        if (m == -INFINITY)
                return TSR_E_INVAL;
        *ret = best;
        return TSR_OK;
}

/* Steps 2-5 of sampler.h.  On TSR_OK, scratch[0, vocab) holds the probabilities and
 * *greedy the argmax after processors and penalties. */
static tsr_status sampler_run(const tsr_sampling *s, const tsr_sample_history *h, const float *logits,
                              size_t vocab, float *scratch, uint32_t *greedy) {
        float *w = scratch, *a = scratch + vocab;
        float m;
        double z;
        uint32_t best = 0;
        tsr_status st;

        st = tsr_sampling_check(s, vocab);
        if (st != TSR_OK)
                return st;
        if (!h || !logits || !scratch || (h->n_prompt && !h->prompt) || (h->n_output && !h->output) ||
            !ids_ok(h->prompt, h->n_prompt, vocab) || !ids_ok(h->output, h->n_output, vocab))
                return TSR_E_INVAL;
        /* Rejects NaN/+inf before anything uses the values. */
        st = row_max(logits, vocab, &m);
        if (st != TSR_OK)
                return st;

        /* 2. Processors that can change the argmax: allowed ids, min_tokens, bias. */
        if (s->n_allowed) {
                for (size_t i = 0; i < vocab; i++)
                        w[i] = -INFINITY;
                for (size_t i = 0; i < s->n_allowed; i++)
                        w[s->allowed_ids[i]] = logits[s->allowed_ids[i]];
        } else {
                memcpy(w, logits, vocab * sizeof(*w));
        }
        if (h->n_output < s->min_tokens) {
                for (size_t i = 0; i < s->n_eos; i++)
                        w[s->eos_ids[i]] = -INFINITY;
                for (size_t i = 0; i < s->n_stop; i++)
                        w[s->stop_ids[i]] = -INFINITY;
        }
        for (size_t i = 0; i < s->n_bias; i++)
                w[s->bias[i].id] += s->bias[i].bias;

        /* 3. Penalties. */
        apply_penalties(s, h, w, a, vocab);

        /* 4. Greedy token; also the check that something is left and nothing overflowed
         * (a huge bias can push a logit to +inf). */
        if ((st = first_max(w, vocab, &best)) != TSR_OK)
                return st;
        *greedy = best;
        if (s->temperature < TSR_SAMPLER_GREEDY_EPS) {
                memset(w, 0, vocab * sizeof(*w));
                w[best] = 1.0f;
                return TSR_OK;
        }

        /* 5. Temperature, then min_p (vLLM's argmax-invariant processor), top_k, top_p. */
        if (s->temperature != 1.0f)
                for (size_t i = 0; i < vocab; i++)
                        w[i] /= s->temperature;
        if (s->min_p > 0.0f) {
                float mx = -INFINITY, thr;

                for (size_t i = 0; i < vocab; i++)
                        if (w[i] > mx)
                                mx = w[i];
                z = row_expsum(w, vocab, mx);
                /* vLLM: probs < max(probs) * min_p, in float32. */
                thr = (float)(1.0 / z) * s->min_p;
                for (size_t i = 0; i < vocab; i++)
                        if ((float)((double)expf(w[i] - mx) / z) < thr)
                                w[i] = -INFINITY;
        }
        if (s->top_k > 0 && (size_t)s->top_k < vocab) {
                float kth;

                memcpy(a, w, vocab * sizeof(*a));
                kth = select_kth(a, vocab, vocab - (size_t)s->top_k);
                /* Ties with the k-th value stay, as in vLLM (mask is logit < kth). */
                for (size_t i = 0; i < vocab; i++)
                        if (w[i] < kth)
                                w[i] = -INFINITY;
        }
        if (s->top_p < 1.0f) {
                _Static_assert(sizeof(float) == sizeof(uint32_t), "scratch holds ids as floats");
                apply_top_p(w, (uint32_t *)(void *)a, scratch + 2 * vocab, vocab, s->top_p);
        }

        /* Softmax of what is left: row_expsum's sum, with each exp kept in w for the
         * division (the same floats in the same order: the bits of computing them twice,
         * at half the expf calls -- a 49k-entry row at c=32 is ~0.2 ms each). */
        m = -INFINITY;
        for (size_t i = 0; i < vocab; i++)
                if (w[i] > m)
                        m = w[i];
        z = 0.0;
        for (size_t i = 0; i < vocab; i++) {
                w[i] = w[i] == -INFINITY ? 0.0f : expf(w[i] - m);  /* expf(-inf) is +0: a masked token's call saved */
                z += (double)w[i];
        }
        for (size_t i = 0; i < vocab; i++)
                if (w[i] != 0.0f)       /* a masked token's 0 / z is +0 as it stands */
                        w[i] = (float)((double)w[i] / z);
        return TSR_OK;
}

tsr_status tsr_sampler_probs(const tsr_sampling *s, const tsr_sample_history *h,
                             const float *logits, size_t vocab, float *scratch,
                             float *probs, uint32_t *greedy) {
        uint32_t g;
        tsr_status st;

        if (!probs)
                return TSR_E_INVAL;
        st = sampler_run(s, h, logits, vocab, scratch, &g);
        if (st != TSR_OK)
                return st;
        memcpy(probs, scratch, vocab * sizeof(*probs));
        if (greedy)
                *greedy = g;
        return TSR_OK;
}

/* Inverse-CDF draw over p[0, vocab) in index order.  Only tokens with p > 0 can be
 * drawn; if rounding leaves u * total at or past the last partial sum, the last such
 * token is the answer. */
static uint32_t draw(const float *p, size_t vocab, double u) {
        double total = 0.0, target, cum = 0.0;
        uint32_t last = 0;

        for (size_t i = 0; i < vocab; i++)
                if (p[i] != 0.0f)       /* adding +0 leaves the sum as it is */
                        total += (double)p[i];
        target = u * total;
        for (size_t i = 0; i < vocab; i++) {
                if (p[i] <= 0.0f)
                        continue;
                cum += (double)p[i];
                last = (uint32_t)i;
                if (cum > target)
                        return last;
        }
        return last;
}

/* tsr_sample's answer where tsr_sampling_plain_argmax holds: the same checks, then one
 * pass over the row instead of sampler_run's copy, scans and probability row (a decode
 * step samples every running request: at 32 rows of 49,152 that was five passes each). */
static tsr_status plain_argmax(const tsr_sampling *s, const tsr_sample_history *h, const float *logits, size_t vocab,
                               const float *scratch, uint32_t *ret) {
        tsr_status st = tsr_sampling_check(s, vocab);
        if (st != TSR_OK)
                return st;
        if (!h || !logits || !scratch || (h->n_prompt && !h->prompt) || (h->n_output && !h->output) ||
            !ids_ok(h->prompt, h->n_prompt, vocab) || !ids_ok(h->output, h->n_output, vocab))
                return TSR_E_INVAL;
        return first_max(logits, vocab, ret);
}

tsr_status tsr_sample_uniform_given(const tsr_sampling *s, const tsr_sample_history *h, double u,
                                    const float *logits, size_t vocab, float *scratch, uint32_t *token) {
        const tsr_sample_history none = {0};
        uint32_t g;
        tsr_status st;
        if (!s || !token || s->logprobs >= 0 || (!h && !tsr_sampling_history_free(s)))
                return TSR_E_INVAL;
        if ((st = sampler_run(s, h ? h : &none, logits, vocab, scratch, &g)) != TSR_OK)
                return st;
        *token = s->temperature < TSR_SAMPLER_GREEDY_EPS ? g : draw(scratch, vocab, u);
        return TSR_OK;
}

tsr_status tsr_sample(const tsr_sampling *s, const tsr_sample_history *h, uint64_t rng_key,
                      const float *logits, size_t vocab, float *scratch, tsr_sample_result *out) {
        tsr_sample_result r;
        uint32_t g;
        tsr_status st;

        if (!out)
                return TSR_E_INVAL;
        if (s && h && tsr_sampling_plain_argmax(s, h->n_output)) {
                if ((st = plain_argmax(s, h, logits, vocab, scratch, &g)) == TSR_OK)
                        *out = (tsr_sample_result){.token = g};
                return st;
        }
        st = sampler_run(s, h, logits, vocab, scratch, &g);
        if (st != TSR_OK)
                return st;
        memset(&r, 0, sizeof(r));
        if (s->temperature < TSR_SAMPLER_GREEDY_EPS)
                r.token = g;
        else
                r.token = draw(scratch, vocab, tsr_sampler_uniform(rng_key, h->n_output));
        if (s->logprobs >= 0) {
                /* 1. Raw logprobs: from the logits as given, never the processed ones. */
                st = tsr_logprobs_gather(logits, vocab, r.token, (uint32_t)s->logprobs, &r.lp);
                if (st != TSR_OK)
                        return st;
                r.has_logprobs = true;
        }
        *out = r;
        return TSR_OK;
}
