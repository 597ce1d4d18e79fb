/* bench_core.c - see bench_core.h.  Definitions follow vllm 0.33.0's
 * vllm/benchmarks/serve.py, datasets/{datasets,utils}.py and
 * lib/endpoint_request_func.py; each function names the piece it mirrors. */
#include "bench_core.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ random numbers */

/* numpy/random/bit_generator.pyx SeedSequence: hash the entropy words into a pool of
 * four, then generate_state(4, uint64). */
static uint32_t seq_hashmix(uint32_t value, uint32_t *hash_const) {
        value ^= *hash_const;
        *hash_const *= 0x931e8875u;
        value *= *hash_const;
        return value ^ (value >> 16);
}

static uint32_t seq_mix(uint32_t x, uint32_t y) {
        uint32_t r = 0xca01f9ddu * x - 0x4973f715u * y;
        return r ^ (r >> 16);
}

static void seed_sequence(uint64_t seed, uint64_t out[4]) {
        uint32_t entropy[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, pool[4], hash_const = 0x43b0d7e5u;
        size_t n_entropy = seed >> 32 ? 2 : 1;
        for (size_t i = 0; i < 4; i++)
                pool[i] = seq_hashmix(i < n_entropy ? entropy[i] : 0, &hash_const);
        for (size_t src = 0; src < 4; src++)
                for (size_t dst = 0; dst < 4; dst++)
                        if (src != dst)
                                pool[dst] = seq_mix(pool[dst], seq_hashmix(pool[src], &hash_const));
        uint32_t hb = 0x8b51f9ddu, words[8];
        for (size_t i = 0; i < 8; i++) {
                uint32_t v = pool[i % 4] ^ hb;
                hb *= 0x58f38dedu;
                v *= hb;
                words[i] = v ^ (v >> 16);
        }
        for (size_t i = 0; i < 4; i++)
                out[i] = (uint64_t)words[2 * i] | ((uint64_t)words[2 * i + 1] << 32);
}

#define PCG_MULT (((unsigned __int128)0x2360ED051FC65DA4ull << 64) | 0x4385DF649FCCF645ull)

static inline void pcg_step(tsr_bench_rng *r) {
        r->state = r->state * PCG_MULT + r->inc;
}

void tsr_bench_rng_seed(tsr_bench_rng *r, uint64_t seed) {
        uint64_t v[4];
        seed_sequence(seed, v);
        /* pcg64_set_seed: state = v[0]:v[1], sequence = v[2]:v[3] (high word first) */
        unsigned __int128 initstate = ((unsigned __int128)v[0] << 64) | v[1];
        unsigned __int128 initseq = ((unsigned __int128)v[2] << 64) | v[3];
        r->state = 0;
        r->inc = (initseq << 1) | 1;
        pcg_step(r);
        r->state += initstate;
        pcg_step(r);
        r->has_uint32 = false;
        r->uinteger = 0;
}

uint64_t tsr_bench_rng_u64(tsr_bench_rng *r) {   /* XSL-RR output of the stepped state */
        pcg_step(r);
        uint64_t x = (uint64_t)(r->state >> 64) ^ (uint64_t)r->state;
        unsigned rot = (unsigned)(r->state >> 122);
        return (x >> rot) | (x << ((64 - rot) & 63));
}

static uint32_t rng_u32(tsr_bench_rng *r) {   /* pcg64_next32: halves of one 64-bit draw, low first */
        if (r->has_uint32) {
                r->has_uint32 = false;
                return r->uinteger;
        }
        uint64_t next = tsr_bench_rng_u64(r);
        r->has_uint32 = true;
        r->uinteger = (uint32_t)(next >> 32);
        return (uint32_t)next;
}

/* random_bounded_uint64_fill() with use_masked = false, for one value. */
int64_t tsr_bench_rng_range(tsr_bench_rng *r, int64_t lo, int64_t hi) {
        uint64_t rng = (uint64_t)hi - (uint64_t)lo;
        if (hi <= lo)
                return lo;
        if (rng <= 0xffffffffull) {
                if (rng == 0xffffffffull)
                        return lo + (int64_t)rng_u32(r);
                uint32_t excl = (uint32_t)rng + 1;
                uint64_t m = (uint64_t)rng_u32(r) * excl;
                uint32_t leftover = (uint32_t)m;
                if (leftover < excl) {
                        uint32_t threshold = (UINT32_MAX - (uint32_t)rng) % excl;
                        while (leftover < threshold) {
                                m = (uint64_t)rng_u32(r) * excl;
                                leftover = (uint32_t)m;
                        }
                }
                return lo + (int64_t)(m >> 32);
        }
        if (rng == UINT64_MAX)
                return (int64_t)((uint64_t)lo + tsr_bench_rng_u64(r));
        uint64_t excl = rng + 1;
        unsigned __int128 m = (unsigned __int128)tsr_bench_rng_u64(r) * excl;
        uint64_t leftover = (uint64_t)m;
        if (leftover < excl) {
                uint64_t threshold = (UINT64_MAX - rng) % excl;
                while (leftover < threshold) {
                        m = (unsigned __int128)tsr_bench_rng_u64(r) * excl;
                        leftover = (uint64_t)m;
                }
        }
        return (int64_t)((uint64_t)lo + (uint64_t)(m >> 64));
}

/* MT19937 (init_genrand seeding), numpy's legacy RandomState stream. */
void tsr_bench_mt_seed(tsr_bench_mt *m, uint32_t seed) {
        m->mt[0] = seed;
        for (int i = 1; i < 624; i++)
                m->mt[i] = 1812433253u * (m->mt[i - 1] ^ (m->mt[i - 1] >> 30)) + (uint32_t)i;
        m->pos = 624;
        m->has_gauss = false;
        m->gauss = 0.0;
}

uint32_t tsr_bench_mt_u32(tsr_bench_mt *m) {
        if (m->pos >= 624) {
                for (int k = 0; k < 624; k++) {
                        uint32_t y = (m->mt[k] & 0x80000000u) | (m->mt[(k + 1) % 624] & 0x7fffffffu);
                        m->mt[k] = m->mt[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1) ? 0x9908b0dfu : 0);
                }
                m->pos = 0;
        }
        uint32_t y = m->mt[m->pos++];
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        return y ^ (y >> 18);
}

double tsr_bench_mt_double(tsr_bench_mt *m) {   /* 53 bits: genrand_res53 */
        uint32_t a = tsr_bench_mt_u32(m) >> 5, b = tsr_bench_mt_u32(m) >> 6;
        return ((double)a * 67108864.0 + (double)b) / 9007199254740992.0;
}

static double mt_exponential(tsr_bench_mt *m) {
        return -log(1.0 - tsr_bench_mt_double(m));
}

static double mt_gauss(tsr_bench_mt *m) {
        if (m->has_gauss) {
                m->has_gauss = false;
                return m->gauss;
        }
        double x1, x2, r2;
        do {
                x1 = 2.0 * tsr_bench_mt_double(m) - 1.0;
                x2 = 2.0 * tsr_bench_mt_double(m) - 1.0;
                r2 = x1 * x1 + x2 * x2;
        } while (r2 >= 1.0 || r2 == 0.0);
        double f = sqrt(-2.0 * log(r2) / r2);
        m->gauss = f * x1;
        m->has_gauss = true;
        return f * x2;
}

static double mt_standard_gamma(tsr_bench_mt *m, double shape) {
        if (shape == 1.0)
                return mt_exponential(m);
        if (shape == 0.0)
                return 0.0;
        if (shape < 1.0) {
                for (;;) {
                        double u = tsr_bench_mt_double(m), v = mt_exponential(m);
                        if (u <= 1.0 - shape) {
                                double x = pow(u, 1.0 / shape);
                                if (x <= v)
                                        return x;
                        } else {
                                double y = -log((1 - u) / shape);
                                double x = pow(1.0 - shape + shape * y, 1.0 / shape);
                                if (x <= v + y)
                                        return x;
                        }
                }
        }
        double b = shape - 1.0 / 3.0, c = 1.0 / sqrt(9 * b);
        for (;;) {
                double x, v, u;
                do {
                        x = mt_gauss(m);
                        v = 1.0 + c * x;
                } while (v <= 0.0);
                v = v * v * v;
                u = tsr_bench_mt_double(m);
                if (u < 1.0 - 0.0331 * (x * x) * (x * x))
                        return b * v;
                if (log(u) < 0.5 * x * x + b * (1.0 - v + log(v)))
                        return b * v;
        }
}

double tsr_bench_mt_gamma(tsr_bench_mt *m, double shape, double scale) {
        return scale * mt_standard_gamma(m, shape);
}

/* serve.py get_request() without ramp-up. */
void tsr_bench_arrival_delays(tsr_bench_mt *m, size_t n, double rate, double burstiness, double *out) {
        for (size_t i = 0; i < n; i++) {
                if (isinf(rate))
                        out[i] = 0.0;
                else if (isinf(burstiness))
                        out[i] = 1.0 / rate;
                else
                        out[i] = tsr_bench_mt_gamma(m, burstiness, 1.0 / (rate * burstiness));
        }
        for (size_t i = 1; i < n; i++)
                out[i] += out[i - 1];
        if (n > 0 && out[n - 1] != 0.0) {
                double factor = ((double)n / rate) / out[n - 1];
                for (size_t i = 0; i < n; i++)
                        out[i] *= factor;
        }
}

/* ------------------------------------------------------------------ SSE */

static bool is_py_space(char c) {
        return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static void strip(const char **p, size_t *n) {
        while (*n && is_py_space(**p)) {
                (*p)++;
                (*n)--;
        }
        while (*n && is_py_space((*p)[*n - 1]))
                (*n)--;
}

/* StreamedResponseHandler.add_chunk(). */
tsr_status tsr_bench_sse_feed(tsr_buf *buf, const char *data, size_t n, tsr_bench_sse_cb cb, void *ud) {
        tsr_status st = tsr_buf_append(buf, data, n);
        if (st != TSR_OK)
                return st;
        size_t pos = 0;
        for (;;) {
                const char *start = (const char *)buf->data + pos;
                const char *sep = memmem(start, buf->len - pos, "\n\n", 2);
                if (!sep)
                        break;
                const char *m = start;
                size_t mlen = (size_t)(sep - start);
                strip(&m, &mlen);
                if (mlen)
                        cb(ud, m, mlen);
                pos = (size_t)(sep - (const char *)buf->data) + 2;
        }
        tsr_buf_consume(buf, pos);
        /* A tail that is already a whole "data: " message (no blank line yet). */
        if (buf->len >= 6 && memcmp(buf->data, "data: ", 6) == 0) {
                const char *content = (const char *)buf->data + 6, *whole = (const char *)buf->data;
                size_t clen = buf->len - 6, wlen = buf->len;
                strip(&content, &clen);
                bool complete = false;
                if (clen == 6 && memcmp(content, "[DONE]", 6) == 0) {
                        complete = true;
                } else if (clen) {
                        json_t *j = json_loadb(content, clen, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
                        complete = j != NULL;
                        json_decref(j);
                }
                if (complete) {
                        strip(&whole, &wlen);
                        cb(ud, whole, wlen);
                        tsr_buf_reset(buf);
                }
        }
        return TSR_OK;
}

/* ------------------------------------------------------------------ one request */

void tsr_bench_output_init(tsr_bench_output *o, bool chat, int64_t prompt_len, double start_time) {
        memset(o, 0, sizeof(*o));
        o->chat = chat;
        o->prompt_len = prompt_len;
        o->start_time = start_time;
        o->most_recent = start_time;
        tsr_buf_init(&o->text, (size_t)1 << 30);
}

void tsr_bench_output_done(tsr_bench_output *o) {
        free(o->itl);
        free(o->error);
        tsr_buf_done(&o->text);
        memset(o, 0, sizeof(*o));
}

void tsr_bench_output_fail(tsr_bench_output *o, const char *fmt, ...) {
        va_list ap;
        char tmp[1024];
        va_start(ap, fmt);
        vsnprintf(tmp, sizeof(tmp), fmt, ap);
        va_end(ap);
        free(o->error);
        o->error = strdup(tmp);
        o->success = false;
}

/* Python truthiness of a JSON value. */
static bool truthy(const json_t *v) {
        if (!v || json_is_null(v) || json_is_false(v))
                return false;
        if (json_is_string(v))
                return json_string_length(v) > 0;
        if (json_is_array(v))
                return json_array_size(v) > 0;
        if (json_is_object(v))
                return json_object_size(v) > 0;
        if (json_is_integer(v))
                return json_integer_value(v) != 0;
        if (json_is_real(v))
                return json_real_value(v) != 0.0;
        return true;
}

/* _choice_has_streamed_output() */
static bool chat_choice_is_token(const json_t *choice) {
        const json_t *delta = json_object_get(choice, "delta");
        if (!json_is_object(delta))
                return false;
        if (truthy(json_object_get(delta, "content")) || truthy(json_object_get(delta, "reasoning")) ||
            truthy(json_object_get(delta, "tool_calls")) || truthy(json_object_get(delta, "function_call")))
                return true;
        const json_t *content = json_object_get(delta, "content");
        return json_is_string(content) && json_string_length(content) == 0 && !json_object_get(delta, "role");
}

static tsr_status push_itl(tsr_bench_output *o, double v) {
        if (o->n_itl == o->itl_cap) {
                size_t cap = o->itl_cap ? o->itl_cap * 2 : 64;
                double *g = realloc(o->itl, cap * sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                o->itl = g;
                o->itl_cap = cap;
        }
        o->itl[o->n_itl++] = v;
        return TSR_OK;
}

/* A copy of JSON text msg[0, len) whose object keys have each "\u0000" escape written
 * "\ufffd" (the same length); strings elsewhere are left as they are.  NULL: no memory. */
static char *nul_keys_replaced(const char *msg, size_t len) {
        char *c = malloc(len ? len : 1);
        if (!c)
                return NULL;
        memcpy(c, msg, len);
        for (size_t i = 0; i < len; i++) {
                if (c[i] != '"')
                        continue;
                size_t start = ++i;             /* the string's contents: [start, i) */
                while (i < len && c[i] != '"')
                        i += c[i] == '\\' ? 2 : 1;
                if (i >= len)
                        break;
                size_t after = i + 1;
                while (after < len && (c[after] == ' ' || c[after] == '\t' || c[after] == '\n' || c[after] == '\r'))
                        after++;
                if (after >= len || c[after] != ':')
                        continue;               /* a value, not a key */
                for (size_t j = start; j + 6 <= i; j++) {
                        if (c[j] != '\\')
                                continue;
                        if (memcmp(c + j, "\\u0000", 6) == 0)
                                memcpy(c + j, "\\ufffd", 6);
                        j++;                    /* past the escaped character */
                }
        }
        return c;
}

/* The message loop of async_request_openai_completions / _chat_completions. */
tsr_status tsr_bench_output_on_message(tsr_bench_output *o, const char *msg, size_t len, double now) {
        if (len && msg[0] == ':')
                return TSR_OK;
        if (len >= 6 && memcmp(msg, "data: ", 6) == 0) {
                msg += 6;
                len -= 6;
        }
        if (len == 6 && memcmp(msg, "[DONE]", 6) == 0)
                return TSR_OK;
        json_error_t jerr;
        /* "\u0000" is valid JSON (a model may emit a NUL byte; Python's json, vLLM's bench,
         * takes it): jansson refuses it unless asked */
        json_t *data = json_loadb(msg, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
        if (!data && strstr(jerr.text, "NUL byte in object key")) {
                /* a NUL in a key (a logprobs entry's token: jansson cannot hold one): the
                 * keys' NULs as U+FFFD, which the bench never reads */
                char *copy = nul_keys_replaced(msg, len);
                data = copy ? json_loadb(copy, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr) : NULL;
                free(copy);
        }
        if (!json_is_object(data)) {
                tsr_bench_output_fail(o, "invalid JSON in the stream: %s", data ? "not an object" : jerr.text);
                json_decref(data);
                return TSR_E_INVAL;
        }
        tsr_status st = TSR_OK;
        const json_t *choices = json_object_get(data, "choices");
        const json_t *usage = json_object_get(data, "usage");
        const json_t *c0 = json_array_get(choices, 0);
        bool token = truthy(choices) && (!o->chat || chat_choice_is_token(c0));
        if (token) {
                const json_t *text = o->chat ? json_object_get(json_object_get(c0, "delta"), "content")
                                             : json_object_get(c0, "text");
                if (!o->first_chunk_received) {
                        o->first_chunk_received = true;
                        o->ttft = now - o->start_time;
                } else {
                        st = push_itl(o, now - o->most_recent);
                }
                o->most_recent = now;
                if (st == TSR_OK && json_is_string(text))
                        st = tsr_buf_append(&o->text, json_string_value(text), json_string_length(text));
        }
        /* vLLM sends usage in a chunk of its own (choices []); llama-server sends it in the
         * last chunk beside choices: read it wherever it is (issue #21). */
        if (truthy(usage)) {
                const json_t *ct = json_object_get(usage, "completion_tokens");
                const json_t *pt = json_object_get(usage, "prompt_tokens");
                o->output_tokens = json_is_integer(ct) ? json_integer_value(ct) : 0;
                if (json_is_integer(pt))
                        o->prompt_len = json_integer_value(pt);
        }
        json_decref(data);
        return st;
}

void tsr_bench_output_finish(tsr_bench_output *o) {
        if (o->first_chunk_received) {
                o->success = true;
        } else {
                tsr_bench_output_fail(o, "Never received a valid chunk to calculate TTFT."
                                     "This response will be marked as failed!");
        }
        o->latency = o->most_recent - o->start_time;
}

/* ------------------------------------------------------------------ statistics */

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return (x > y) - (x < y);
}

double tsr_bench_percentile(const double *v, size_t n, double p) {
        if (n == 0)
                return 0.0;
        double *s = malloc(n * sizeof(*s));
        if (!s)
                return NAN;
        memcpy(s, v, n * sizeof(*s));
        qsort(s, n, sizeof(*s), cmp_double);
        double virt = (p / 100.0) * (double)(n - 1);
        double below = floor(virt);
        size_t lo = (size_t)below, hi = lo + 1 < n ? lo + 1 : n - 1;
        double g = virt - below, a = s[lo], b = s[hi], r;
        /* numpy's _lerp: exact at both ends (t = 0 gives a, t = 1 gives b). */
        r = g >= 0.5 ? b - (b - a) * (1.0 - g) : a + (b - a) * g;
        free(s);
        return r;
}

double tsr_bench_mean(const double *v, size_t n) {
        if (n == 0)
                return 0.0;
        double sum = 0.0;
        for (size_t i = 0; i < n; i++)
                sum += v[i];
        return sum / (double)n;
}

double tsr_bench_median(const double *v, size_t n) {
        return tsr_bench_percentile(v, n, 50.0);
}

double tsr_bench_std(const double *v, size_t n) {
        if (n == 0)
                return 0.0;
        double mean = tsr_bench_mean(v, n), acc = 0.0;
        for (size_t i = 0; i < n; i++)
                acc += (v[i] - mean) * (v[i] - mean);
        return sqrt(acc / (double)n);
}

void tsr_bench_metrics_done(tsr_bench_metrics *m) {
        for (int i = 0; i < TSR_BENCH_M_COUNT; i++)
                free(m->samples[i]);
        free(m->output_lens);
        memset(m, 0, sizeof(*m));
}

/* serve.py calculate_metrics(). */
tsr_status tsr_bench_metrics_compute(const tsr_bench_output *outs, size_t n, double duration, const tsr_bench_goodput *gp,
                                 bool with_queue, bool finite_rate, tsr_bench_count_tokens_fn count, void *count_ud,
                                 tsr_bench_metrics *m) {
        size_t n_itl = 0, ok = 0;
        memset(m, 0, sizeof(*m));
        for (size_t i = 0; i < n; i++)
                if (outs[i].success) {
                        n_itl += outs[i].n_itl;
                        ok++;
                }
        size_t cap[TSR_BENCH_M_COUNT] = {ok, ok, n_itl, ok, ok, ok};
        for (int k = 0; k < TSR_BENCH_M_COUNT; k++) {
                m->samples[k] = malloc((cap[k] ? cap[k] : 1) * sizeof(double));
                if (!m->samples[k])
                        goto nomem;
        }
        m->present[TSR_BENCH_M_TTFT] = m->present[TSR_BENCH_M_TPOT] = m->present[TSR_BENCH_M_ITL] = true;
        m->present[TSR_BENCH_M_E2EL] = true;
        m->present[TSR_BENCH_M_QUEUE] = with_queue;
        m->present[TSR_BENCH_M_E2EL_QUEUE] = with_queue && finite_rate;
        m->output_lens = calloc(n ? n : 1, sizeof(*m->output_lens));
        double *all_tpots = calloc(ok ? ok : 1, sizeof(double));
        if (!m->output_lens || !all_tpots) {
                free(all_tpots);
                goto nomem;
        }
        int64_t good = 0, total_output = 0;
        for (size_t i = 0; i < n; i++) {
                const tsr_bench_output *o = &outs[i];
                if (!o->success) {
                        m->failed++;
                        continue;
                }
                int64_t out_len = o->output_tokens;
                if (!out_len)
                        out_len = count ? count(count_ud, (const char *)o->text.data ? (const char *)o->text.data : "",
                                                o->text.len)
                                        : 1;
                if (out_len < 0)
                        out_len = 0;
                m->output_lens[i] = out_len;
                total_output += out_len;
                m->total_input += o->prompt_len;
                double tpot = 0.0;
                if (out_len > 1) {
                        tpot = (o->latency - o->ttft) / (double)(out_len - 1);
                        m->samples[TSR_BENCH_M_TPOT][m->n_samples[TSR_BENCH_M_TPOT]++] = tpot;
                }
                all_tpots[m->completed] = tpot;
                if (o->n_itl) { /* itl is NULL without gaps: memcpy from NULL is undefined even for 0 bytes */
                        memcpy(m->samples[TSR_BENCH_M_ITL] + m->n_samples[TSR_BENCH_M_ITL], o->itl,
                               o->n_itl * sizeof(double));
                        m->n_samples[TSR_BENCH_M_ITL] += o->n_itl;
                }
                m->samples[TSR_BENCH_M_TTFT][m->n_samples[TSR_BENCH_M_TTFT]++] = o->ttft;
                m->samples[TSR_BENCH_M_E2EL][m->n_samples[TSR_BENCH_M_E2EL]++] = o->latency;
                if (m->present[TSR_BENCH_M_QUEUE])
                        m->samples[TSR_BENCH_M_QUEUE][m->n_samples[TSR_BENCH_M_QUEUE]++] = o->client_queue_time;
                if (m->present[TSR_BENCH_M_E2EL_QUEUE])
                        m->samples[TSR_BENCH_M_E2EL_QUEUE][m->n_samples[TSR_BENCH_M_E2EL_QUEUE]++] =
                                o->latency + o->client_queue_time;
                if (gp && gp->enabled) {
                        double vals[3] = {o->ttft, tpot, o->latency};
                        bool is_good = true;
                        for (int k = 0; k < 3; k++)
                                if (gp->has[k] && !(gp->slo_ms[k] / 1000.0 >= vals[k]))
                                        is_good = false;
                        good += is_good;
                }
                m->completed++;
        }
        free(all_tpots);
        m->total_output = total_output;

        /* Peak output tok/s and concurrency over 1-s buckets from the first start. */
        if (m->completed > 0) {
                double min_start = INFINITY, max_end = -INFINITY;
                for (size_t i = 0; i < n; i++)
                        if (outs[i].success) {
                                if (outs[i].start_time < min_start)
                                        min_start = outs[i].start_time;
                                if (outs[i].start_time + outs[i].latency > max_end)
                                        max_end = outs[i].start_time + outs[i].latency;
                        }
                size_t buckets = (size_t)ceil(max_end - min_start) + 1;
                double *tok = calloc(buckets, sizeof(double)), *conc = calloc(buckets, sizeof(double));
                if (!tok || !conc) {
                        free(tok);
                        free(conc);
                        goto nomem;
                }
                for (size_t i = 0; i < n; i++) {
                        const tsr_bench_output *o = &outs[i];
                        if (!o->success)
                                continue;
                        double t = o->start_time + o->ttft;
                        for (size_t k = 0; k <= o->n_itl; k++) {
                                if (k > 0)
                                        t += o->itl[k - 1];
                                double rel = t - min_start;
                                long b = (long)rel;   /* Python int(): toward zero */
                                if (rel > -1.0 && b >= 0 && (size_t)b < buckets)
                                        tok[b] += 1;
                        }
                        long s0 = (long)(o->start_time - min_start);
                        long s1 = (long)(o->start_time + o->latency - min_start);
                        for (long s = s0; s <= s1; s++)
                                if (s >= 0 && (size_t)s < buckets)
                                        conc[s] += 1;
                }
                for (size_t b = 0; b < buckets; b++) {
                        if (tok[b] > m->max_output_tokens_per_s)
                                m->max_output_tokens_per_s = tok[b];
                        if ((int64_t)conc[b] > m->max_concurrent_requests)
                                m->max_concurrent_requests = (int64_t)conc[b];
                }
                free(tok);
                free(conc);
        }
        m->request_throughput = (double)m->completed / duration;
        m->request_goodput = (double)good / duration;
        m->output_throughput = (double)total_output / duration;
        m->total_token_throughput = (double)(m->total_input + total_output) / duration;
        return TSR_OK;
nomem:
        tsr_bench_metrics_done(m);
        return TSR_E_NOMEM;
}

/* ------------------------------------------------------------------ report */

void tsr_bench_pyfloat(double v, char *out, size_t n) {
        if (isnan(v)) {
                snprintf(out, n, "nan");
                return;
        }
        if (isinf(v)) {
                snprintf(out, n, v > 0 ? "inf" : "-inf");
                return;
        }
        /* Shortest digits that round-trip (Python's repr), then its layout: positional
         * for 1e-4 <= |v| < 1e16, else d.ddde+XX. */
        char sci[64];
        for (int prec = 0; prec <= 17; prec++) {
                snprintf(sci, sizeof(sci), "%.*e", prec, v);
                if (strtod(sci, NULL) == v)
                        break;
        }
        char digits[32] = "", *e = strchr(sci, 'e');
        int exp10 = atoi(e + 1), nd = 0;
        bool neg = sci[0] == '-';
        for (const char *p = sci + neg; p < e; p++)
                if (*p >= '0' && *p <= '9')
                        digits[nd++] = *p;
        while (nd > 1 && digits[nd - 1] == '0')
                nd--;
        digits[nd] = '\0';
        size_t o = 0;
        if (neg)
                o += (size_t)snprintf(out + o, n > o ? n - o : 0, "-");
        if (exp10 >= -4 && exp10 < 16) {
                if (exp10 < 0) {
                        o += (size_t)snprintf(out + o, n > o ? n - o : 0, "0.");
                        for (int i = 0; i < -exp10 - 1; i++)
                                o += (size_t)snprintf(out + o, n > o ? n - o : 0, "0");
                        snprintf(out + o, n > o ? n - o : 0, "%s", digits);
                } else {
                        for (int i = 0; i <= exp10; i++)
                                o += (size_t)snprintf(out + o, n > o ? n - o : 0, "%c", i < nd ? digits[i] : '0');
                        if (nd > exp10 + 1)
                                snprintf(out + o, n > o ? n - o : 0, ".%s", digits + exp10 + 1);
                        else
                                snprintf(out + o, n > o ? n - o : 0, ".0");
                }
                return;
        }
        o += (size_t)snprintf(out + o, n > o ? n - o : 0, "%c", digits[0]);
        if (nd > 1)
                o += (size_t)snprintf(out + o, n > o ? n - o : 0, ".%s", digits + 1);
        snprintf(out + o, n > o ? n - o : 0, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
}

/* compute_result_filename() without ramp-up. */
void tsr_bench_result_filename(const char *label, double rate, int64_t max_concurrency, const char *model_id,
                           const char *datetime, char *out, size_t n) {
        char r[64], c[48] = "";
        const char *base = strrchr(model_id, '/');
        tsr_bench_pyfloat(rate, r, sizeof(r));
        if (max_concurrency >= 0)
                snprintf(c, sizeof(c), "-concurrency%lld", (long long)max_concurrency);
        snprintf(out, n, "%s-%sqps%s-%s-%s.json", label, r, c, base ? base + 1 : model_id, datetime);
}

/* check_goodput_args() / parse_goodput() */
tsr_status tsr_bench_goodput_parse(char *const *pairs, size_t n, tsr_bench_goodput *gp, char *err, size_t errlen) {
        static const char *const names[3] = {"ttft", "tpot", "e2el"};
        memset(gp, 0, sizeof(*gp));
        for (size_t i = 0; i < n; i++) {
                const char *colon = strchr(pairs[i], ':');
                char *end;
                double v = colon ? strtod(colon + 1, &end) : 0.0;
                if (!colon || strchr(colon + 1, ':') || end == colon + 1 || *end) {
                        tsr_errf(err, errlen, "Invalid format found for service level objectives. "
                                              "Specify service level objectives for goodput as \"KEY:VALUE\" "
                                              "pairs, where the key is a metric name, and the value is a "
                                              "number in milliseconds.");
                        return TSR_E_INVAL;
                }
                int k = -1;
                for (int j = 0; j < 3; j++)
                        if (strlen(names[j]) == (size_t)(colon - pairs[i]) &&
                            strncmp(pairs[i], names[j], (size_t)(colon - pairs[i])) == 0)
                                k = j;
                if (k < 0) {
                        tsr_errf(err, errlen, "Invalid metric name found, %.*s: %s. The service level objective "
                                              "name should be one of ['ttft', 'tpot', 'e2el']. ",
                                 (int)(colon - pairs[i]), pairs[i], colon + 1);
                        return TSR_E_INVAL;
                }
                if (v < 0) {
                        tsr_errf(err, errlen, "Invalid value found, %s: %s. The service level objective value "
                                              "should be non-negative.", names[k], colon + 1);
                        return TSR_E_INVAL;
                }
                gp->has[k] = true;
                gp->slo_ms[k] = v;
                gp->enabled = true;
        }
        return TSR_OK;
}

/* "{s:{c}^{n}}" with n = 50: Python puts the odd padding character on the right. */
static void print_header(FILE *out, const char *s, char c) {
        int len = (int)strlen(s), pad = 50 - len, left = pad > 0 ? pad / 2 : 0, right = pad > 0 ? pad - left : 0;
        for (int i = 0; i < left; i++)
                fputc(c, out);
        fputs(s, out);
        for (int i = 0; i < right; i++)
                fputc(c, out);
        fputc('\n', out);
}

static void line_int(FILE *out, const char *label, long long v) {
        fprintf(out, "%-40s %-10lld\n", label, v);
}

static void line_f2(FILE *out, const char *label, double v) {
        fprintf(out, "%-40s %-10.2f\n", label, v);
}

static bool selected(const tsr_bench_report_cfg *cfg, const char *name) {
        for (size_t i = 0; i < cfg->n_percentile_metrics; i++)
                if (strcmp(cfg->percentile_metrics[i], name) == 0)
                        return true;
        return false;
}

static json_t *real_or_null(double v) {
        return isfinite(v) ? json_real(v) : json_null();
}

/* process_one_metric() */
static void one_metric(FILE *out, const tsr_bench_report_cfg *cfg, const tsr_bench_metrics *m, int k, const char *attr,
                       const char *name, const char *header, json_t *result) {
        if (!m->present[k] || !selected(cfg, attr))
                return;
        const double *v = m->samples[k];
        size_t n = m->n_samples[k];
        double mean = tsr_bench_mean(v, n) * 1000, median = tsr_bench_median(v, n) * 1000, std = tsr_bench_std(v, n) * 1000;
        char label[128], key[128], pw[48];
        print_header(out, header, '-');
        snprintf(label, sizeof(label), "Mean %s (ms):", name);
        line_f2(out, label, mean);
        snprintf(label, sizeof(label), "Median %s (ms):", name);
        line_f2(out, label, median);
        snprintf(key, sizeof(key), "mean_%s_ms", attr);
        json_object_set_new(result, key, real_or_null(mean));
        snprintf(key, sizeof(key), "median_%s_ms", attr);
        json_object_set_new(result, key, real_or_null(median));
        snprintf(key, sizeof(key), "std_%s_ms", attr);
        json_object_set_new(result, key, real_or_null(std));
        for (size_t i = 0; i < cfg->n_percentiles; i++) {
                double p = cfg->percentiles[i], value = tsr_bench_percentile(v, n, p) * 1000;
                if (p == floor(p) && fabs(p) < 1e15)
                        snprintf(pw, sizeof(pw), "%lld", (long long)p);
                else
                        tsr_bench_pyfloat(p, pw, sizeof(pw));
                snprintf(label, sizeof(label), "P%s %s (ms):", pw, name);
                line_f2(out, label, value);
                snprintf(key, sizeof(key), "p%s_%s_ms", pw, attr);
                json_object_set_new(result, key, real_or_null(value));
        }
}

/* The result-printing half of serve.py benchmark(). */
tsr_status tsr_bench_report(FILE *out, const tsr_bench_report_cfg *cfg, const tsr_bench_metrics *m, const tsr_bench_output *outs,
                        size_t n, double duration, json_t *result) {
        print_header(out, " Serving Benchmark Result ", '=');
        line_int(out, "Successful requests:", m->completed);
        line_int(out, "Failed requests:", m->failed);
        if (cfg->max_concurrency >= 0)
                line_int(out, "Maximum request concurrency:", cfg->max_concurrency);
        if (!isinf(cfg->request_rate))
                line_f2(out, "Request rate configured (RPS):", cfg->request_rate);
        line_f2(out, "Benchmark duration (s):", duration);
        line_int(out, "Total input tokens:", m->total_input);
        line_int(out, "Total generated tokens:", m->total_output);
        line_f2(out, "Request throughput (req/s):", m->request_throughput);
        if (cfg->goodput)
                line_f2(out, "Request goodput (req/s):", m->request_goodput);
        line_f2(out, "Output token throughput (tok/s):", m->output_throughput);
        line_f2(out, "Peak output token throughput (tok/s):", m->max_output_tokens_per_s);
        line_f2(out, "Peak concurrent requests:", (double)m->max_concurrent_requests);
        line_f2(out, "Total token throughput (tok/s):", m->total_token_throughput);

        json_t *a_in = json_array(), *a_out = json_array(), *a_ttft = json_array(), *a_itl = json_array();
        json_t *a_lat = json_array(), *a_start = json_array(), *a_queue = json_array(), *a_text = json_array();
        json_t *a_err = json_array();
        if (!a_in || !a_out || !a_ttft || !a_itl || !a_lat || !a_start || !a_queue || !a_text || !a_err)
                goto nomem;
        for (size_t i = 0; i < n; i++) {
                const tsr_bench_output *o = &outs[i];
                json_t *itl = json_array();
                if (!itl)
                        goto nomem;
                for (size_t k = 0; k < o->n_itl; k++)
                        json_array_append_new(itl, json_real(o->itl[k]));
                json_array_append_new(a_in, json_integer(o->prompt_len));
                json_array_append_new(a_out, json_integer(m->output_lens[i]));
                json_array_append_new(a_ttft, json_real(o->ttft));
                json_array_append_new(a_itl, itl);
                json_array_append_new(a_lat, json_real(o->latency));
                json_array_append_new(a_start, json_real(o->start_time));
                json_array_append_new(a_queue, json_real(o->client_queue_time));
                json_array_append_new(a_text, json_stringn(o->text.data ? (const char *)o->text.data : "",
                                                           o->text.len));
                json_array_append_new(a_err, json_string(o->error ? o->error : ""));
        }
        json_object_set_new(result, "duration", json_real(duration));
        json_object_set_new(result, "completed", json_integer(m->completed));
        json_object_set_new(result, "failed", json_integer(m->failed));
        json_object_set_new(result, "total_input_tokens", json_integer(m->total_input));
        json_object_set_new(result, "total_output_tokens", json_integer(m->total_output));
        json_object_set_new(result, "request_throughput", json_real(m->request_throughput));
        json_object_set_new(result, "request_goodput", cfg->goodput ? json_real(m->request_goodput) : json_null());
        json_object_set_new(result, "output_throughput", json_real(m->output_throughput));
        json_object_set_new(result, "total_token_throughput", json_real(m->total_token_throughput));
        json_object_set_new(result, "input_lens", a_in);
        json_object_set_new(result, "output_lens", a_out);
        json_object_set_new(result, "ttfts", a_ttft);
        json_object_set_new(result, "itls", a_itl);
        json_object_set_new(result, "latencies", a_lat);
        json_object_set_new(result, "start_times", a_start);
        json_object_set_new(result, "queue_times", a_queue);
        json_object_set_new(result, "generated_texts", a_text);
        json_object_set_new(result, "errors", a_err);
        json_object_set_new(result, "max_output_tokens_per_s", json_real(m->max_output_tokens_per_s));
        json_object_set_new(result, "max_concurrent_requests", json_integer(m->max_concurrent_requests));
        json_object_set_new(result, "rtfx", json_real(0.0));

        one_metric(out, cfg, m, TSR_BENCH_M_TTFT, "ttft", "TTFT", "Time to First Token", result);
        one_metric(out, cfg, m, TSR_BENCH_M_TPOT, "tpot", "TPOT", "Time per Output Token (excl. 1st token)", result);
        one_metric(out, cfg, m, TSR_BENCH_M_ITL, "itl", "ITL", "Inter-token Latency", result);
        one_metric(out, cfg, m, TSR_BENCH_M_E2EL, "e2el", "E2EL", "End-to-end Latency", result);
        one_metric(out, cfg, m, TSR_BENCH_M_QUEUE, "client_queue_time", "Client Queue Time", "Client-side Queueing",
                   result);
        one_metric(out, cfg, m, TSR_BENCH_M_E2EL_QUEUE, "e2el_including_client_queue", "E2EL incl. Client Queue",
                   "Queue-inclusive End-to-end Latency", result);
        for (int i = 0; i < 50; i++)
                fputc('=', out);
        fputc('\n', out);
        return TSR_OK;
nomem:
        json_decref(a_in);
        json_decref(a_out);
        json_decref(a_ttft);
        json_decref(a_itl);
        json_decref(a_lat);
        json_decref(a_start);
        json_decref(a_queue);
        json_decref(a_text);
        json_decref(a_err);
        return TSR_E_NOMEM;
}

/* ------------------------------------------------------------------ random dataset */

/* datasets/utils.py get_sampling_params() and RandomDataset.sample()'s first check. */
tsr_status tsr_bench_random_bounds(const tsr_bench_random_cfg *c, int num_special, int64_t *in_lo, int64_t *in_hi,
                               int64_t *out_lo, int64_t *out_hi, char *err, size_t errlen) {
        double rin = c->input_range_ratio, rout = c->output_range_ratio;
        if (!(rin >= 0.0 && rin < 1.0)) {
                tsr_errf(err, errlen, "input_range_ratio must be in [0, 1).");
                return TSR_E_INVAL;
        }
        if (!(rout >= 0.0 && rout < 1.0)) {
                tsr_errf(err, errlen, "output_range_ratio must be in [0, 1).");
                return TSR_E_INVAL;
        }
        int64_t real = c->input_len - num_special;
        if (real < 0)
                real = 0;
        int64_t min_sampled = (int64_t)floor((double)real * (1.0 - rin));
        if (c->prefix_len + min_sampled < 1) {
                tsr_errf(err, errlen, "--random-input-len is too small: with tokenizer special tokens %d and input "
                                      "range ratio %g, the minimum possible total input tokens (prefix + sampled) "
                                      "is %lld. Increase --random-input-len and/or --random-prefix-len, or "
                                      "decrease the input range ratio so that prefix_len + floor(max(0, "
                                      "random_input_len - num_special)) * (1 - input_range_ratio) >= 1.",
                         num_special, rin, (long long)(c->prefix_len + min_sampled));
                return TSR_E_INVAL;
        }
        *in_lo = (int64_t)floor((double)real * (1.0 - rin));
        *in_hi = (int64_t)ceil((double)real * (1.0 + rin));
        *out_lo = (int64_t)floor((double)c->output_len * (1.0 - rout));
        *out_hi = (int64_t)ceil((double)c->output_len * (1.0 + rout));
        if (*out_lo < 1)
                *out_lo = 1;
        if (*out_hi < 1)
                *out_hi = 1;
        if (*in_lo > *in_hi) {
                tsr_errf(err, errlen, "Invalid input sampling interval: low=%lld > high=%lld", (long long)*in_lo,
                         (long long)*in_hi);
                return TSR_E_INVAL;
        }
        if (*out_lo > *out_hi) {
                tsr_errf(err, errlen, "Invalid output sampling interval: low=%lld > high=%lld", (long long)*out_lo,
                         (long long)*out_hi);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

/* datasets.py gen_prompt_decode_to_target_len(), max_retry = 10. */
tsr_status tsr_bench_decode_to_target_len(const tsr_bench_tok *t, tsr_bench_rng *r, uint32_t **seq, size_t *n_seq,
                                      size_t target, char **prompt, int64_t *mismatch) {
        int remain = 10;
        char *text = NULL;
        size_t text_len;
        tsr_status st;
        *mismatch = 0;
        *prompt = NULL;
        for (;;) {
                uint32_t *ids = NULL;
                size_t n_ids = 0;
                free(text);
                text = NULL;
                st = t->decode(t->ud, *seq, *n_seq, &text, &text_len);
                if (st != TSR_OK)
                        break;
                st = t->encode(t->ud, text, text_len, &ids, &n_ids);
                if (st != TSR_OK)
                        break;
                free(*seq);
                *seq = ids;
                *n_seq = n_ids;
                if (remain <= 0) {
                        if (n_ids != target)
                                *mismatch = (int64_t)n_ids - (int64_t)target;
                        break;
                }
                if (n_ids == target)
                        break;
                if (n_ids < target) {
                        uint32_t *g = realloc(*seq, target * sizeof(*g));
                        if (!g) {
                                st = TSR_E_NOMEM;
                                break;
                        }
                        for (size_t i = n_ids; i < target; i++)
                                g[i] = (uint32_t)tsr_bench_rng_range(r, 0, (int64_t)t->vocab_size - 1);
                        *seq = g;
                        *n_seq = target;
                } else {
                        *n_seq = target;
                }
                remain--;
        }
        if (st != TSR_OK) {
                free(text);
                return st;
        }
        *prompt = text;
        return TSR_OK;
}

void tsr_bench_samples_free(tsr_bench_sample *s, size_t n) {
        if (!s)
                return;
        for (size_t i = 0; i < n; i++) {
                free(s[i].prompt);
                free(s[i].prev_reply);
                free(s[i].user);
        }
        free(s);
}

/* RandomDataset.sample() / get_prefix() / generate_token_sequence(). */
/* RandomDataset's allowed ids: the vocabulary minus all_special_ids, in order.
 * `allowed` has room for t->vocab_size; returns how many. */
static size_t allowed_ids(const tsr_bench_tok *t, uint32_t *allowed) {
        size_t n = 0;
        for (uint32_t id = 0; id < t->vocab_size; id++)
                if (!t->is_special || !t->is_special(t->ud, id))
                        allowed[n++] = id;
        return n;
}

tsr_status tsr_bench_random_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_random_cfg *c, size_t n,
                                tsr_bench_sample **ret, int64_t *mismatch_total, char *err, size_t errlen) {
        int64_t in_lo, in_hi, out_lo, out_hi, mismatch;
        *ret = NULL;
        *mismatch_total = 0;
        tsr_status st = tsr_bench_random_bounds(c, t->num_special_tokens_to_add, &in_lo, &in_hi, &out_lo, &out_hi, err,
                                            errlen);
        if (st != TSR_OK)
                return st;
        if (t->vocab_size == 0) {
                tsr_errf(err, errlen, "the tokenizer has an empty vocabulary");
                return TSR_E_INVAL;
        }
        int64_t *in_lens = malloc((n ? n : 1) * sizeof(int64_t)), *out_lens = malloc((n ? n : 1) * sizeof(int64_t));
        int64_t *offsets = malloc((n ? n : 1) * sizeof(int64_t));
        uint32_t *allowed = malloc(t->vocab_size * sizeof(uint32_t)), *prefix = NULL, *seq = NULL;
        size_t n_allowed = 0, n_prefix = 0;
        tsr_bench_sample *out = calloc(n ? n : 1, sizeof(*out));
        char *text = NULL;
        *mismatch_total = 0;
        if (!in_lens || !out_lens || !offsets || !allowed || !out) {
                st = TSR_E_NOMEM;
                goto done;
        }
        /* numpy draws the three arrays one after the other; so do we. */
        for (size_t i = 0; i < n; i++)
                in_lens[i] = tsr_bench_rng_range(r, in_lo, in_hi);
        for (size_t i = 0; i < n; i++)
                out_lens[i] = tsr_bench_rng_range(r, out_lo, out_hi);
        for (size_t i = 0; i < n; i++)
                offsets[i] = tsr_bench_rng_range(r, 0, (int64_t)t->vocab_size - 1);
        n_allowed = allowed_ids(t, allowed);
        if (n_allowed == 0) {
                tsr_errf(err, errlen, "every token of the tokenizer is special");
                st = TSR_E_INVAL;
                goto done;
        }
        if (c->prefix_len > 0) {
                prefix = malloc((size_t)c->prefix_len * sizeof(*prefix));
                if (!prefix) {
                        st = TSR_E_NOMEM;
                        goto done;
                }
                for (int64_t i = 0; i < c->prefix_len; i++)
                        prefix[i] = allowed[tsr_bench_rng_range(r, 0, (int64_t)n_allowed - 1)];
                n_prefix = (size_t)c->prefix_len;
                st = tsr_bench_decode_to_target_len(t, r, &prefix, &n_prefix, (size_t)c->prefix_len, &text, &mismatch);
                free(text);
                text = NULL;
                if (st != TSR_OK)
                        goto done;
                if (mismatch)
                        fprintf(stderr, "WARNING: Prefix tokenization produced %lld %s tokens than expected after "
                                        "decoding and re-encoding. This is expected due to the imperfect nature of "
                                        "the sampling procedure\n",
                                (long long)llabs(mismatch), mismatch > 0 ? "more" : "fewer");
        }
        for (size_t i = 0; i < n; i++) {
                size_t len = n_prefix + (size_t)in_lens[i];
                seq = malloc((len ? len : 1) * sizeof(*seq));
                if (!seq) {
                        st = TSR_E_NOMEM;
                        goto done;
                }
                if (n_prefix)
                        memcpy(seq, prefix, n_prefix * sizeof(*seq));
                for (int64_t k = 0; k < in_lens[i]; k++)
                        seq[n_prefix + (size_t)k] =
                                allowed[(uint64_t)(offsets[i] + (int64_t)i + k) % (uint64_t)n_allowed];
                st = tsr_bench_decode_to_target_len(t, r, &seq, &len, (size_t)(c->prefix_len + in_lens[i]),
                                                &out[i].prompt, &mismatch);
                free(seq);
                seq = NULL;
                if (st != TSR_OK) {
                        tsr_errf(err, errlen, "the tokenizer failed on prompt %zu: %s", i, tsr_status_str(st));
                        goto done;
                }
                *mismatch_total += mismatch;
                out[i].prompt_len = (int64_t)len;
                out[i].expected_output_len = out_lens[i];
        }
done:
        free(in_lens);
        free(out_lens);
        free(offsets);
        free(allowed);
        free(prefix);
        free(seq);
        if (st != TSR_OK) {
                tsr_bench_samples_free(out, n);
                out = NULL;
        }
        *ret = out;
        return st;
}

/* ------------------------------------------------------------------ shared-prefix datasets */

/* A growable token sequence. */
typedef struct id_seq {
        uint32_t *v;
        size_t n, cap;
} id_seq;

static tsr_status seq_reserve(id_seq *s, size_t more) {
        if (s->n + more > s->cap) {
                size_t cap = (s->n + more) * 2;
                uint32_t *v = realloc(s->v, (cap ? cap : 1) * sizeof(*v));
                if (!v)
                        return TSR_E_NOMEM;
                s->v = v;
                s->cap = cap;
        }
        return TSR_OK;
}

static tsr_status seq_append(id_seq *s, const uint32_t *ids, size_t n) {
        if (seq_reserve(s, n) != TSR_OK)
                return TSR_E_NOMEM;
        if (n)
                memcpy(s->v + s->n, ids, n * sizeof(*ids));
        s->n += n;
        return TSR_OK;
}

static tsr_status seq_push_random(id_seq *s, tsr_bench_rng *r, const uint32_t *allowed, size_t n_allowed, int64_t n) {
        if (seq_reserve(s, (size_t)n) != TSR_OK)
                return TSR_E_NOMEM;
        for (int64_t i = 0; i < n; i++)
                s->v[s->n++] = allowed[tsr_bench_rng_range(r, 0, (int64_t)n_allowed - 1)];
        return TSR_OK;
}

/* One sample from ids (copied): decoded and re-encoded to its own length. */
static tsr_status sample_from_ids(const tsr_bench_tok *t, tsr_bench_rng *r, const uint32_t *ids, size_t n,
                                  int64_t output_len, tsr_bench_sample *out) {
        uint32_t *seq = malloc((n ? n : 1) * sizeof(*seq));
        size_t len = n;
        int64_t mismatch;
        tsr_status st;
        if (!seq)
                return TSR_E_NOMEM;
        memcpy(seq, ids, n * sizeof(*seq));
        st = tsr_bench_decode_to_target_len(t, r, &seq, &len, n, &out->prompt, &mismatch);
        free(seq);
        if (st != TSR_OK)
                return st;
        out->prompt_len = (int64_t)len;
        out->expected_output_len = output_len;
        return TSR_OK;
}

static tsr_status dataset_begin(const tsr_bench_tok *t, size_t n, uint32_t **allowed, size_t *n_allowed,
                                tsr_bench_sample **out, char *err, size_t errlen) {
        *allowed = t->vocab_size ? malloc(t->vocab_size * sizeof(**allowed)) : NULL;
        *out = calloc(n ? n : 1, sizeof(**out));
        if (!*allowed || !*out) {
                if (t->vocab_size == 0)
                        tsr_errf(err, errlen, "the tokenizer has an empty vocabulary");
                return t->vocab_size ? TSR_E_NOMEM : TSR_E_INVAL;
        }
        *n_allowed = allowed_ids(t, *allowed);
        if (*n_allowed == 0) {
                tsr_errf(err, errlen, "every token of the tokenizer is special");
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

tsr_status tsr_bench_prefix_repetition_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_prefix_rep_cfg *c, size_t n,
                                           tsr_bench_sample **ret, char *err, size_t errlen) {
        uint32_t *allowed = NULL;
        size_t n_allowed = 0, k = 0;
        tsr_bench_sample *out = NULL;
        id_seq prefix = {0}, seq = {0};
        tsr_status st;

        *ret = NULL;
        if (c->prefix_len < 1 || c->suffix_len < 1 || c->num_prefixes < 1 || c->output_len < 1) {
                tsr_errf(err, errlen, "--prefix-repetition-prefix-len, -suffix-len, -num-prefixes and -output-len "
                                      "must be >= 1");
                return TSR_E_INVAL;
        }
        st = dataset_begin(t, n, &allowed, &n_allowed, &out, err, errlen);
        for (int64_t p = 0; st == TSR_OK && p < c->num_prefixes; p++) {
                size_t per = n / (size_t)c->num_prefixes + ((size_t)p < n % (size_t)c->num_prefixes);
                prefix.n = 0;
                st = seq_push_random(&prefix, r, allowed, n_allowed, c->prefix_len);
                for (size_t u = 0; st == TSR_OK && u < per; u++) {
                        seq.n = 0;
                        if ((st = seq_append(&seq, prefix.v, prefix.n)) != TSR_OK)
                                break;
                        st = seq_push_random(&seq, r, allowed, n_allowed, c->suffix_len);
                        if (st == TSR_OK)
                                st = sample_from_ids(t, r, seq.v, seq.n, c->output_len, &out[k++]);
                }
        }
        /* vLLM shuffles the prompts (random.shuffle); Fisher-Yates on our stream. */
        for (size_t i = n; st == TSR_OK && i > 1; i--) {
                size_t j = (size_t)tsr_bench_rng_range(r, 0, (int64_t)i - 1);
                tsr_bench_sample tmp = out[i - 1];
                out[i - 1] = out[j];
                out[j] = tmp;
        }
        free(allowed);
        free(prefix.v);
        free(seq.v);
        if (st != TSR_OK) {
                if (st != TSR_E_INVAL)
                        tsr_errf(err, errlen, "building the prefix_repetition dataset: %s", tsr_status_str(st));
                tsr_bench_samples_free(out, n);
                return st;
        }
        *ret = out;
        return TSR_OK;
}

char *tsr_bench_turn_prompt(const char *prev_prompt, const char *answer, const char *user) {
        size_t a = strlen(prev_prompt), b = strlen(answer), c = strlen(user);
        char *s = malloc(a + b + c + 1);
        if (!s)
                return NULL;
        memcpy(s, prev_prompt, a);
        memcpy(s + a, answer, b);
        memcpy(s + a + b, user, c + 1);
        return s;
}

/* One part of a multi_turn history as text: len random allowed ids, decoded and
 * re-encoded to len.  The parts are joined as text and never as ids, so that a turn's
 * prompt is exactly its predecessor's, then the reply's text, then the user's: the
 * identity a client resending the real answer builds on.  Joined ids would break it in
 * one case: the allowed ids include byte-level BPE's lone bytes 0x80-0xff, so a
 * multi-byte UTF-8 character can be cut between two parts, and decoded together it is
 * that character where decoded apart it is a U+FFFD on each side.  Decoded apart, every
 * part is valid UTF-8 (as the JSON body needs) and the cut shows as U+FFFD, as a cut
 * inside one part always did.  len 0 draws nothing from r. */
static tsr_status part_text(const tsr_bench_tok *t, tsr_bench_rng *r, const uint32_t *allowed, size_t n_allowed,
                            int64_t len, char **text) {
        id_seq ids = {0};
        int64_t mismatch;
        tsr_status st;

        *text = NULL;
        if (len == 0)
                return (*text = strdup("")) ? TSR_OK : TSR_E_NOMEM;
        st = seq_push_random(&ids, r, allowed, n_allowed, len);
        if (st == TSR_OK)
                st = tsr_bench_decode_to_target_len(t, r, &ids.v, &ids.n, (size_t)len, text, &mismatch);
        free(ids.v);
        return st;
}

static tsr_status count_ids(const tsr_bench_tok *t, const char *text, int64_t *n) {
        uint32_t *ids = NULL;
        size_t n_ids = 0;
        tsr_status st = t->encode(t->ud, text, strlen(text), &ids, &n_ids);
        free(ids);
        *n = (int64_t)n_ids;
        return st;
}

tsr_status tsr_bench_multi_turn_dataset(const tsr_bench_tok *t, tsr_bench_rng *r, const tsr_bench_multi_turn_cfg *c, size_t n,
                                    tsr_bench_sample **ret, char *err, size_t errlen) {
        uint32_t *allowed = NULL;
        size_t n_allowed = 0, sessions, k = 0, *order = NULL, *last = NULL;   /* last[s]: session s's latest turn */
        tsr_bench_sample *out = NULL;
        /* hist[s]: session s's next prompt less its user text; reply[s]: the stand-in
         * answer to its latest turn */
        char *system = NULL, **hist = NULL, **reply = NULL;
        tsr_status st;

        *ret = NULL;
        if (c->system_len < 0 || c->session_prefix_len < 0 || c->turns < 1 || c->user_len < 1 || c->output_len < 1) {
                tsr_errf(err, errlen, "--multi-turn-turns, --multi-turn-user-len and --random-output-len must be >= 1, "
                                      "--multi-turn-session-prefix-len >= 0");
                return TSR_E_INVAL;
        }
        sessions = (n + (size_t)c->turns - 1) / (size_t)c->turns;
        st = dataset_begin(t, n, &allowed, &n_allowed, &out, err, errlen);
        if (st == TSR_OK && (!(hist = calloc(sessions ? sessions : 1, sizeof(*hist))) ||
                             !(reply = calloc(sessions ? sessions : 1, sizeof(*reply))) ||
                             !(order = malloc((sessions ? sessions : 1) * sizeof(*order))) ||
                             !(last = malloc((sessions ? sessions : 1) * sizeof(*last)))))
                st = TSR_E_NOMEM;
        if (st == TSR_OK)
                st = part_text(t, r, allowed, n_allowed, c->system_len, &system);
        for (size_t s = 0; st == TSR_OK && s < sessions; s++) {
                char *doc = NULL;
                st = part_text(t, r, allowed, n_allowed, c->session_prefix_len, &doc);
                if (st == TSR_OK && !(hist[s] = tsr_bench_turn_prompt(system, doc, "")))
                        st = TSR_E_NOMEM;
                free(doc);
        }
        for (size_t s = 0; st == TSR_OK && s < sessions; s++)
                order[s] = s;
        for (int64_t turn = 0; st == TSR_OK && turn < c->turns && k < n; turn++) {
                /* Every round of turns in its own random order: in sessions' fixed order,
                 * turn t of session s was prompt t x sessions + s, so round-robin over W
                 * workers sent every turn of a session to worker s mod W whenever W divided
                 * the session count, i.e. it was session-sticky by accident. */
                for (size_t i = sessions; i > 1; i--) {
                        size_t j = (size_t)tsr_bench_rng_range(r, 0, (int64_t)i - 1), tmp = order[i - 1];
                        order[i - 1] = order[j];
                        order[j] = tmp;
                }
                for (size_t i = 0; st == TSR_OK && i < sessions && k < n; i++) {
                        size_t s = order[i];
                        char *user = NULL;
                        tsr_bench_sample *o = &out[k];
                        st = part_text(t, r, allowed, n_allowed, c->user_len, &user);
                        if (st == TSR_OK && !(o->prompt = tsr_bench_turn_prompt(hist[s], "", user)))
                                st = TSR_E_NOMEM;
                        if (st == TSR_OK)
                                st = count_ids(t, o->prompt, &o->prompt_len);
                        o->expected_output_len = c->output_len;
                        o->follows = turn > 0;
                        o->prev = turn > 0 ? last[s] : 0;
                        if (turn > 0) {          /* hist[s] ends with the previous turn's reply */
                                o->user = user;
                                o->prev_reply = reply[s];
                                reply[s] = NULL;
                        } else {
                                free(user);
                        }
                        last[s] = k++;
                        if (st == TSR_OK && turn + 1 < c->turns)   /* the answer the next turn resends */
                                st = part_text(t, r, allowed, n_allowed, c->output_len, &reply[s]);
                        if (st == TSR_OK && turn + 1 < c->turns) {
                                free(hist[s]);
                                if (!(hist[s] = tsr_bench_turn_prompt(o->prompt, reply[s], "")))
                                        st = TSR_E_NOMEM;
                        }
                }
        }
        for (size_t s = 0; s < sessions; s++) {
                free(hist ? hist[s] : NULL);
                free(reply ? reply[s] : NULL);
        }
        free(hist);
        free(reply);
        free(order);
        free(last);
        free(system);
        free(allowed);
        if (st != TSR_OK) {
                if (st != TSR_E_INVAL)
                        tsr_errf(err, errlen, "building the multi_turn dataset: %s", tsr_status_str(st));
                tsr_bench_samples_free(out, n);
                return st;
        }
        *ret = out;
        return TSR_OK;
}
