/* deploy/bench_core: the pure parts of `tessera bench serve`, against vLLM 0.33.0's
 * definitions (vllm/benchmarks/serve.py, datasets, lib/endpoint_request_func.py).
 * Expected numbers marked "numpy" were computed with numpy 2.x (np.percentile default
 * "linear", np.std ddof=0); expected strings marked "Python" with CPython 3.11's
 * str.format / str(float). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "deploy/bench_core.h"

/* ------------------------------------------------------------------ SSE */

typedef struct collected {
        char msgs[16][256];
        int n;
} collected;

static void collect(void *ud, const char *msg, size_t len) {
        collected *c = ud;
        assert_true(c->n < 16);
        assert_true(len < 256);
        memcpy(c->msgs[c->n], msg, len);
        c->msgs[c->n][len] = '\0';
        c->n++;
}

static void test_sse_split_anywhere(void **state) {
        const char *stream = ": ping\n\n"
                             "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                             "data: {\"choices\":[{\"text\":\"b\\n\\nc\"}]}\n\n"
                             "\n\n"
                             "data: [DONE]\n\n";
        size_t len = strlen(stream);
        /* Every split point gives the same messages. */
        for (size_t cut = 0; cut <= len; cut++) {
                tsr_buf b;
                collected c = {0};
                tsr_buf_init(&b, 4096);
                assert_int_equal(tsr_bench_sse_feed(&b, stream, cut, collect, &c), TSR_OK);
                assert_int_equal(tsr_bench_sse_feed(&b, stream + cut, len - cut, collect, &c), TSR_OK);
                assert_int_equal(c.n, 4);
                assert_string_equal(c.msgs[0], ": ping");
                assert_string_equal(c.msgs[1], "data: {\"choices\":[{\"text\":\"a\"}]}");
                assert_string_equal(c.msgs[2], "data: {\"choices\":[{\"text\":\"b\\n\\nc\"}]}");
                assert_string_equal(c.msgs[3], "data: [DONE]");
                /* what is left is whitespace at most (as vLLM's buffer keeps it) */
                for (size_t k = 0; k < b.len; k++)
                        assert_true(b.data[k] == '\n');
                tsr_buf_done(&b);
        }
}

static void test_sse_tail_without_blank_line(void **state) {
        tsr_buf b;
        collected c = {0};
        tsr_buf_init(&b, 4096);
        /* An unfinished JSON tail waits; once it parses it is a message (vLLM's handler). */
        assert_int_equal(tsr_bench_sse_feed(&b, "data: {\"usage\": {", 17, collect, &c), TSR_OK);
        assert_int_equal(c.n, 0);
        assert_int_equal(tsr_bench_sse_feed(&b, "\"completion_tokens\": 3}}", 24, collect, &c), TSR_OK);
        assert_int_equal(c.n, 1);
        assert_string_equal(c.msgs[0], "data: {\"usage\": {\"completion_tokens\": 3}}");
        assert_int_equal(tsr_bench_sse_feed(&b, "data: [DONE]", 12, collect, &c), TSR_OK);
        assert_int_equal(c.n, 2);
        assert_string_equal(c.msgs[1], "data: [DONE]");
        /* A tail that does not start with "data: " waits for its blank line. */
        assert_int_equal(tsr_bench_sse_feed(&b, "event: x", 8, collect, &c), TSR_OK);
        assert_int_equal(c.n, 2);
        tsr_buf_done(&b);
}

/* ------------------------------------------------------------------ one request */

static void feed(tsr_bench_output *o, const char *msg, double t) {
        assert_int_equal(tsr_bench_output_on_message(o, msg, strlen(msg), t), TSR_OK);
}

static void test_output_completions(void **state) {
        tsr_bench_output o;
        tsr_bench_output_init(&o, false, 10, 100.0);
        feed(&o, ": keepalive", 100.1);
        feed(&o, "data: {\"choices\":[{\"text\":\"Hel\"}],\"usage\":null}", 100.5);   /* first token */
        feed(&o, "data: {\"choices\":[{\"text\":\"\"}]}", 100.75);                    /* empty text counts */
        feed(&o, "data: {\"choices\":[{\"text\":\"lo\",\"finish_reason\":\"length\"}]}", 101.0);
        feed(&o, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3}}", 101.5);
        feed(&o, "data: [DONE]", 101.6);
        tsr_bench_output_finish(&o);
        assert_true(o.success);
        assert_null(o.error);
        assert_true(fabs(o.ttft - 0.5) < 1e-9);
        assert_int_equal(o.n_itl, 2);
        assert_true(fabs(o.itl[0] - 0.25) < 1e-9);
        assert_true(fabs(o.itl[1] - 0.25) < 1e-9);
        /* latency ends at the last token chunk, not at the usage chunk or [DONE] */
        assert_true(fabs(o.latency - 1.0) < 1e-9);
        assert_int_equal(o.output_tokens, 3);
        assert_int_equal(o.prompt_len, 12);            /* usage.prompt_tokens replaces the count */
        assert_int_equal(o.text.len, 5);
        assert_memory_equal(o.text.data, "Hello", 5);
        tsr_bench_output_done(&o);
}

/* llama-server's way: usage rides in the last chunk beside choices (issue #21). */
static void test_output_usage_beside_choices(void **state) {
        tsr_bench_output o;
        tsr_bench_output_init(&o, false, 10, 100.0);
        feed(&o, "data: {\"choices\":[{\"text\":\"a\"}]}", 100.5);
        feed(&o, "data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"length\"}],"
                 "\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}", 101.0);
        feed(&o, "data: [DONE]", 101.1);
        tsr_bench_output_finish(&o);
        assert_true(o.success);
        assert_int_equal(o.n_itl, 1);                  /* the chunk still counts as a token */
        assert_true(fabs(o.latency - 1.0) < 1e-9);
        assert_int_equal(o.output_tokens, 2);
        assert_int_equal(o.prompt_len, 9);
        tsr_bench_output_done(&o);
}

static void test_output_chat_role_chunk_is_not_a_token(void **state) {
        tsr_bench_output o;
        tsr_bench_output_init(&o, true, 7, 0.0);
        feed(&o, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}", 0.2);
        assert_false(o.first_chunk_received);
        feed(&o, "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}", 0.5);
        feed(&o, "data: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}", 0.7);   /* empty, no role: a token */
        feed(&o, "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}", 0.8);   /* not a token */
        tsr_bench_output_finish(&o);
        assert_true(o.success);
        assert_true(fabs(o.ttft - 0.5) < 1e-9);
        assert_int_equal(o.n_itl, 1);
        assert_true(fabs(o.latency - 0.7) < 1e-9);
        assert_int_equal(o.output_tokens, 0);          /* no usage: counted later */
        assert_int_equal(o.prompt_len, 7);
        tsr_bench_output_done(&o);
}

/* A chunk whose text is a NUL byte ("\u0000", valid JSON; a model can emit one) is a
 * token like any other, kept in the text with its length. */
static void test_output_nul_text(void **state) {
        tsr_bench_output o;
        (void)state;
        tsr_bench_output_init(&o, false, 10, 0.0);
        feed(&o, "data: {\"choices\":[{\"text\":\"a\"}]}", 0.1);
        feed(&o, "data: {\"choices\":[{\"text\":\"\\u0000b\"}]}", 0.2);
        feed(&o, "data: [DONE]", 0.3);
        tsr_bench_output_finish(&o);
        assert_true(o.success);
        assert_int_equal(o.n_itl, 1);
        assert_int_equal(o.text.len, 3);
        assert_memory_equal(o.text.data, "a\0b", 3);
        tsr_bench_output_done(&o);
}

/* A NUL in an object key (a top_logprobs entry's token "\u0000": jansson holds no NUL
 * in a key) does not fail the chunk: the bench reads the text (its NUL kept) and the
 * usage, never the logprobs. */
static void test_output_nul_key(void **state) {
        tsr_bench_output o;
        (void)state;
        tsr_bench_output_init(&o, false, 10, 0.0);
        feed(&o, "data: {\"choices\":[{\"text\":\"\\u0000x\",\"logprobs\":{\"top_logprobs\":[{\"\\u0000\": -0.5, "
                 "\"a\\\\u0000\":-1}]}}]}", 0.1);
        feed(&o, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}", 0.2);
        tsr_bench_output_finish(&o);
        assert_true(o.success);
        assert_int_equal(o.text.len, 2);
        assert_memory_equal(o.text.data, "\0x", 2);
        assert_int_equal(o.output_tokens, 1);
        tsr_bench_output_done(&o);
}

static void test_output_failures(void **state) {
        tsr_bench_output o;
        tsr_bench_output_init(&o, false, 1, 0.0);
        assert_int_equal(tsr_bench_output_on_message(&o, "data: {oops", 11, 0.1), TSR_E_INVAL);
        assert_non_null(o.error);
        tsr_bench_output_done(&o);

        tsr_bench_output_init(&o, false, 1, 0.0);
        feed(&o, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":0}}", 0.3);
        tsr_bench_output_finish(&o);                        /* no token chunk: failed */
        assert_false(o.success);
        assert_non_null(strstr(o.error, "Never received a valid chunk"));
        tsr_bench_output_done(&o);
}

/* ------------------------------------------------------------------ statistics */

static void test_percentile_matches_numpy(void **state) {
        const double v[] = {0.3, 0.1, 0.7, 0.2, 0.9, 0.45};
        const struct { double p, want; } cases[] = {   /* numpy */
                {0, 0.1}, {25, 0.225}, {50, 0.375}, {90, 0.8}, {99, 0.89}, {99.9, 0.8990000000000002}, {100, 0.9},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
                assert_true(fabs(tsr_bench_percentile(v, 6, cases[i].p) - cases[i].want) < 1e-15);
        assert_true(fabs(tsr_bench_mean(v, 6) - 0.4416666666666667) < 1e-15);
        assert_true(fabs(tsr_bench_std(v, 6) - 0.28050054466178054) < 1e-15);
        assert_true(fabs(tsr_bench_median(v, 6) - 0.375) < 1e-15);
        /* serve.py passes `values or 0`: an empty list is [0]. */
        assert_true(tsr_bench_percentile(v, 0, 99) == 0.0);
        assert_true(tsr_bench_mean(v, 0) == 0.0);
        assert_true(tsr_bench_std(v, 0) == 0.0);
        const double one = 4.2;
        assert_true(tsr_bench_percentile(&one, 1, 99) == 4.2);
}

static tsr_bench_output make_output(double start, double ttft, const double *itl, size_t n_itl, int64_t out_tokens,
                                int64_t prompt_len, bool success) {
        tsr_bench_output o;
        tsr_bench_output_init(&o, false, prompt_len, start);
        o.success = success;
        o.ttft = ttft;
        o.itl = NULL;   /* as the client leaves an output without gaps (one token, or failed) */
        if (n_itl) {    /* memcpy from NULL is undefined even for 0 bytes (UBSan) */
                o.itl = malloc(n_itl * sizeof(double));
                memcpy(o.itl, itl, n_itl * sizeof(double));
        }
        o.n_itl = o.itl_cap = n_itl;
        double lat = ttft;
        for (size_t i = 0; i < n_itl; i++)
                lat += itl[i];
        o.latency = lat;
        o.output_tokens = out_tokens;
        return o;
}

static int64_t count_chars(void *ud, const char *text, size_t len) {
        (void)ud;
        (void)text;
        return (int64_t)len;
}

static void test_metrics_as_calculate_metrics(void **state) {
        const double itl_a[] = {0.1, 0.1, 0.2}, itl_b[] = {0.5};
        tsr_bench_output outs[4];
        outs[0] = make_output(10.0, 0.5, itl_a, 3, 4, 100, true);   /* latency 0.9 */
        outs[1] = make_output(10.2, 1.5, itl_b, 1, 0, 50, true);    /* no usage: counted from text */
        tsr_buf_append(&outs[1].text, "abcdef", 6);                 /* -> 6 tokens by count_chars */
        outs[2] = make_output(10.4, 0.0, NULL, 0, 0, 70, false);    /* failed */
        outs[3] = make_output(12.5, 0.2, NULL, 0, 1, 30, true);     /* one token: no TPOT sample */
        tsr_bench_goodput gp = {.enabled = true, .has = {true, false, false}, .slo_ms = {600, 0, 0}};
        tsr_bench_metrics m;
        assert_int_equal(tsr_bench_metrics_compute(outs, 4, 4.0, &gp, true, false, count_chars, NULL, &m), TSR_OK);
        assert_int_equal(m.completed, 3);
        assert_int_equal(m.failed, 1);
        assert_int_equal(m.total_input, 180);
        assert_int_equal(m.total_output, 11);
        assert_int_equal(m.output_lens[0], 4);
        assert_int_equal(m.output_lens[1], 6);
        assert_int_equal(m.output_lens[2], 0);
        assert_int_equal(m.output_lens[3], 1);
        assert_true(fabs(m.request_throughput - 0.75) < 1e-12);
        assert_true(fabs(m.output_throughput - 11.0 / 4) < 1e-12);
        assert_true(fabs(m.total_token_throughput - 191.0 / 4) < 1e-12);
        /* goodput: ttft <= 600 ms holds for requests 0 and 3 */
        assert_true(fabs(m.request_goodput - 0.5) < 1e-12);
        /* TPOT = (latency - ttft) / (output_len - 1) for output_len > 1 */
        assert_int_equal(m.n_samples[TSR_BENCH_M_TPOT], 2);
        assert_true(fabs(m.samples[TSR_BENCH_M_TPOT][0] - 0.4 / 3) < 1e-12);
        assert_true(fabs(m.samples[TSR_BENCH_M_TPOT][1] - 0.5 / 5) < 1e-12);
        assert_int_equal(m.n_samples[TSR_BENCH_M_ITL], 4);      /* pooled */
        assert_int_equal(m.n_samples[TSR_BENCH_M_TTFT], 3);
        assert_true(m.present[TSR_BENCH_M_QUEUE]);
        assert_false(m.present[TSR_BENCH_M_E2EL_QUEUE]);        /* rate was inf */
        /* token times: req0 10.5 10.6 10.7 10.9; req1 11.7 12.2; req3 12.7.  Buckets from
         * 10.0: [0]=4, [1]=1, [2]=2.  Active seconds: req0 0..0, req1 0..1, req3 2..2. */
        assert_true(m.max_output_tokens_per_s == 4.0);
        assert_int_equal(m.max_concurrent_requests, 2);
        tsr_bench_metrics_done(&m);
        for (int i = 0; i < 4; i++)
                tsr_bench_output_done(&outs[i]);
}

/* ------------------------------------------------------------------ report */

static void test_report_block_format(void **state) {
        const double itl[] = {0.01, 0.02};
        tsr_bench_output outs[2];
        outs[0] = make_output(0.0, 0.1, itl, 2, 3, 5, true);
        outs[1] = make_output(0.0, 0.2, itl, 2, 3, 5, true);
        tsr_bench_metrics m;
        assert_int_equal(tsr_bench_metrics_compute(outs, 2, 2.0, NULL, true, true, NULL, NULL, &m), TSR_OK);
        const char *pm[] = {"ttft", "tpot", "itl", "e2el", "client_queue_time"};
        const double pct[] = {50, 99.9};
        tsr_bench_report_cfg cfg = {.max_concurrency = 7, .request_rate = 3.5, .percentile_metrics = pm,
                                .n_percentile_metrics = 5, .percentiles = pct, .n_percentiles = 2};
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        json_t *res = json_object();
        assert_int_equal(tsr_bench_report(f, &cfg, &m, outs, 2, 2.0, res), TSR_OK);
        fclose(f);
        /* Line by line as serve.py prints it (Python str.format). */
        const char *want =
                "============ Serving Benchmark Result ============\n"
                "Successful requests:                     2         \n"
                "Failed requests:                         0         \n"
                "Maximum request concurrency:             7         \n"
                "Request rate configured (RPS):           3.50      \n"
                "Benchmark duration (s):                  2.00      \n"
                "Total input tokens:                      10        \n"
                "Total generated tokens:                  6         \n"
                "Request throughput (req/s):              1.00      \n"
                "Output token throughput (tok/s):         3.00      \n"
                "Peak output token throughput (tok/s):    6.00      \n"
                "Peak concurrent requests:                2.00      \n"
                "Total token throughput (tok/s):          8.00      \n"
                "---------------Time to First Token----------------\n"
                "Mean TTFT (ms):                          150.00    \n"
                "Median TTFT (ms):                        150.00    \n"
                "P50 TTFT (ms):                           150.00    \n"
                "P99.9 TTFT (ms):                         199.90    \n"
                "-----Time per Output Token (excl. 1st token)------\n";
        assert_true(len > strlen(want));
        assert_memory_equal(text, want, strlen(want));
        assert_non_null(strstr(text, "---------------Client-side Queueing---------------\n"
                                     "Mean Client Queue Time (ms):             0.00      \n"));
        assert_null(strstr(text, "Queue-inclusive"));    /* not selected */
        assert_non_null(strstr(text, "----------------End-to-end Latency----------------\n"));
        assert_true(len >= 51 && strcmp(text + len - 51, "==================================================\n") == 0);
        /* JSON keys as vLLM names them */
        assert_true(json_is_real(json_object_get(res, "p99.9_ttft_ms")));
        assert_true(json_is_real(json_object_get(res, "p50_itl_ms")));
        assert_true(json_is_real(json_object_get(res, "std_e2el_ms")));
        assert_true(json_is_null(json_object_get(res, "request_goodput")));
        assert_int_equal(json_integer_value(json_object_get(res, "completed")), 2);
        assert_int_equal(json_array_size(json_object_get(res, "itls")), 2);
        assert_string_equal(json_string_value(json_array_get(json_object_get(res, "errors"), 0)), "");
        json_decref(res);
        free(text);
        tsr_bench_metrics_done(&m);
        tsr_bench_output_done(&outs[0]);
        tsr_bench_output_done(&outs[1]);
}

static void test_pyfloat_and_filename(void **state) {
        const struct { double v; const char *want; } cases[] = {   /* Python str(float) */
                {INFINITY, "inf"}, {10.0, "10.0"}, {0.5, "0.5"}, {1e-05, "1e-05"}, {0.0001, "0.0001"},
                {1e16, "1e+16"}, {123.456, "123.456"}, {2.5e-7, "2.5e-07"}, {1234567890123456.0, "1234567890123456.0"},
                {0.1 + 0.2, "0.30000000000000004"}, {0.0, "0.0"}, {-3.25, "-3.25"},
        };
        char buf[64];
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                tsr_bench_pyfloat(cases[i].v, buf, sizeof(buf));
                assert_string_equal(buf, cases[i].want);
        }
        char name[256];
        tsr_bench_result_filename("openai", INFINITY, -1, "HuggingFaceTB/SmolLM2-135M", "20260101-120000", name,
                              sizeof(name));
        assert_string_equal(name, "openai-infqps-SmolLM2-135M-20260101-120000.json");
        tsr_bench_result_filename("vllm", 4.0, 8, "m", "20260101-120000", name, sizeof(name));
        assert_string_equal(name, "vllm-4.0qps-concurrency8-m-20260101-120000.json");
}

static void test_goodput_parse(void **state) {
        tsr_bench_goodput gp;
        char err[512];
        char *ok[] = {"ttft:500", "e2el:2000.5"};
        assert_int_equal(tsr_bench_goodput_parse(ok, 2, &gp, err, sizeof(err)), TSR_OK);
        assert_true(gp.enabled && gp.has[0] && !gp.has[1] && gp.has[2]);
        assert_true(gp.slo_ms[2] == 2000.5);
        char *bad_name[] = {"itl:5"}, *bad_form[] = {"ttft=5"}, *neg[] = {"tpot:-1"};
        assert_int_equal(tsr_bench_goodput_parse(bad_name, 1, &gp, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "Invalid metric name"));
        assert_int_equal(tsr_bench_goodput_parse(bad_form, 1, &gp, err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(tsr_bench_goodput_parse(neg, 1, &gp, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "non-negative"));
}

/* ------------------------------------------------------------------ arrivals */

static void test_arrival_delays(void **state) {
        tsr_bench_mt m;
        double d[200];
        tsr_bench_mt_seed(&m, 0);
        tsr_bench_arrival_delays(&m, 200, 20.0, 1.0, d);
        for (int i = 1; i < 200; i++)
                assert_true(d[i] >= d[i - 1]);
        assert_true(fabs(d[199] - 10.0) < 1e-9);         /* rescaled: last arrival = n / rate */
        /* Poisson: gaps are exponential, coefficient of variation about 1 */
        double mean = 0, var = 0;
        for (int i = 1; i < 200; i++)
                mean += d[i] - d[i - 1];
        mean /= 199;
        for (int i = 1; i < 200; i++)
                var += (d[i] - d[i - 1] - mean) * (d[i] - d[i - 1] - mean);
        var /= 199;
        assert_true(sqrt(var) / mean > 0.7 && sqrt(var) / mean < 1.3);
        tsr_bench_arrival_delays(&m, 10, INFINITY, 1.0, d);
        for (int i = 0; i < 10; i++)
                assert_true(d[i] == 0.0);
        tsr_bench_arrival_delays(&m, 4, 2.0, INFINITY, d);     /* constant gaps */
        assert_true(fabs(d[0] - 0.5) < 1e-12 && fabs(d[3] - 2.0) < 1e-12);
        /* np.random.seed(0); gaps gamma(1, 1/(4*1)) = 0.19896862704077750,
         * 0.31398269074145946, 0.23080578645101720 (numpy), then rescaled to end at 3/4 */
        tsr_bench_mt_seed(&m, 0);
        tsr_bench_arrival_delays(&m, 3, 4.0, 1.0, d);
        double g0 = 0.1989686270407775, g1 = 0.31398269074145946, g2 = 0.2308057864510172;
        double k = 0.75 / (g0 + g1 + g2);
        assert_true(fabs(d[0] - g0 * k) < 1e-15 && fabs(d[1] - (g0 + g1) * k) < 1e-15);
        assert_true(fabs(d[2] - 0.75) < 1e-15);
}

/* numpy is the reference: default_rng(seed).integers(...) and np.random.seed(s);
 * np.random.gamma(...), values printed by numpy 2.x. */
static void test_rng_is_numpy(void **state) {
        tsr_bench_rng r;
        tsr_bench_rng_seed(&r, 0);
        const int64_t a[5] = {41809, 31307, 25123, 13260, 15130}, b[6] = {10, 10, 10, 11, 18, 16}, c[4] = {2, 1, 1, 2};
        for (int i = 0; i < 5; i++)             /* integers(0, 49152, size=5) */
                assert_int_equal(tsr_bench_rng_range(&r, 0, 49151), a[i]);
        for (int i = 0; i < 6; i++)             /* integers(10, 20, size=6) */
                assert_int_equal(tsr_bench_rng_range(&r, 10, 19), b[i]);
        for (int i = 0; i < 4; i++)             /* integers(0, 3, size=4) */
                assert_int_equal(tsr_bench_rng_range(&r, 0, 2), c[i]);
        tsr_bench_rng_seed(&r, (1ull << 40) + 5);   /* a two-word seed */
        assert_int_equal(tsr_bench_rng_range(&r, 0, 999), 14);
        assert_int_equal(tsr_bench_rng_range(&r, 0, 999), 4);
        assert_int_equal(tsr_bench_rng_range(&r, 0, 999), 449);
        assert_int_equal(tsr_bench_rng_range(&r, 5, 5), 5);   /* integers(5, 6): no draw */

        tsr_bench_mt m;
        const double g05[3] = {0.01164591005435917, 0.38440530842518983, 0.14411897207626556};
        const double g3[3] = {0.1975865787425526, 0.15746905899873226, 0.267004115549442};
        tsr_bench_mt_seed(&m, 7);
        for (int i = 0; i < 3; i++)             /* gamma(shape=0.5, scale=2.0) */
                assert_true(tsr_bench_mt_gamma(&m, 0.5, 2.0) == g05[i]);
        tsr_bench_mt_seed(&m, 7);
        for (int i = 0; i < 3; i++)             /* gamma(shape=3.0, scale=0.1) */
                assert_true(tsr_bench_mt_gamma(&m, 3.0, 0.1) == g3[i]);
}

/* ------------------------------------------------------------------ random dataset */

static void test_random_bounds(void **state) {
        int64_t a, b, c, d;
        char err[512];
        tsr_bench_random_cfg cfg = {.input_len = 1024, .output_len = 128, .input_range_ratio = 0.1, .output_range_ratio = 0.1};
        /* get_sampling_params: floor(real*(1-r)), ceil(real*(1+r)), real = len - special */
        assert_int_equal(tsr_bench_random_bounds(&cfg, 1, &a, &b, &c, &d, err, sizeof(err)), TSR_OK);
        assert_int_equal(a, 920);    /* floor(1023 * 0.9) = floor(920.7) */
        assert_int_equal(b, 1126);   /* ceil(1023 * 1.1) = ceil(1125.3) */
        assert_int_equal(c, 115);    /* floor(115.2) */
        assert_int_equal(d, 141);    /* ceil(140.8) */
        cfg = (tsr_bench_random_cfg){.input_len = 10, .output_len = 1, .input_range_ratio = 0.5, .output_range_ratio = 0.9};
        assert_int_equal(tsr_bench_random_bounds(&cfg, 0, &a, &b, &c, &d, err, sizeof(err)), TSR_OK);
        assert_int_equal(c, 1);      /* output low clamped to 1 */
        assert_int_equal(d, 2);
        cfg = (tsr_bench_random_cfg){.input_len = 1, .output_len = 4};
        assert_int_equal(tsr_bench_random_bounds(&cfg, 1, &a, &b, &c, &d, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "--random-input-len is too small"));
        cfg.prefix_len = 3;          /* a prefix makes up for it */
        assert_int_equal(tsr_bench_random_bounds(&cfg, 1, &a, &b, &c, &d, err, sizeof(err)), TSR_OK);
        assert_int_equal(a, 0);
        cfg = (tsr_bench_random_cfg){.input_len = 8, .output_len = 4, .input_range_ratio = 1.0};
        assert_int_equal(tsr_bench_random_bounds(&cfg, 0, &a, &b, &c, &d, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "[0, 1)"));
}

/* A toy tokenizer whose re-encoding is not 1:1: ids 0 and 1 are special ("<s>", "</s>"),
 * 2..27 are 'a'..'z', 28 is "ab".  Encoding merges every "ab" into 28. */
static const char *toy_str(uint32_t id) {
        static char letters[26][2];
        if (id == 0)
                return "<s>";
        if (id == 1)
                return "</s>";
        if (id == 28)
                return "ab";
        letters[id - 2][0] = (char)('a' + id - 2);
        letters[id - 2][1] = '\0';
        return letters[id - 2];
}

static tsr_status toy_decode(void *ud, const uint32_t *ids, size_t n, char **text, size_t *len) {
        size_t cap = 4 * n + 1, o = 0;
        char *s = malloc(cap);
        for (size_t i = 0; i < n; i++) {
                assert_true(ids[i] < 29);
                const char *p = toy_str(ids[i]);
                memcpy(s + o, p, strlen(p));
                o += strlen(p);
        }
        s[o] = '\0';
        *text = s;
        *len = o;
        return TSR_OK;
}

static tsr_status toy_encode(void *ud, const char *text, size_t len, uint32_t **ids, size_t *n) {
        uint32_t *out = malloc((len ? len : 1) * sizeof(*out));
        size_t k = 0;
        for (size_t i = 0; i < len;) {
                if (text[i] == '<') {
                        bool close = text[i + 1] == '/';
                        out[k++] = close ? 1 : 0;
                        i += close ? 4 : 3;
                } else if (text[i] == 'a' && i + 1 < len && text[i + 1] == 'b') {
                        out[k++] = 28;
                        i += 2;
                } else {
                        out[k++] = (uint32_t)(text[i] - 'a' + 2);
                        i++;
                }
        }
        *ids = out;
        *n = k;
        return TSR_OK;
}

static bool toy_special(void *ud, uint32_t id) {
        return id < 2;
}

static const tsr_bench_tok TOY = {.encode = toy_encode, .decode = toy_decode, .is_special = toy_special,
                              .vocab_size = 29};

/* A few long prefixes shared by many prompts: the prompts fall into exactly
 * num_prefixes groups by their leading text, of n / num_prefixes (+1) each. */
static void test_prefix_repetition_dataset(void **state) {
        tsr_bench_rng r;
        tsr_bench_sample *s;
        char err[512];
        tsr_bench_prefix_rep_cfg cfg = {.prefix_len = 40, .suffix_len = 10, .num_prefixes = 3, .output_len = 7};
        char heads[3][31] = {{0}};
        int sizes[3] = {0}, groups = 0;

        tsr_bench_rng_seed(&r, 5);
        assert_int_equal(tsr_bench_prefix_repetition_dataset(&TOY, &r, &cfg, 20, &s, err, sizeof(err)), TSR_OK);
        for (int i = 0; i < 20; i++) {
                int g;
                assert_int_equal(s[i].expected_output_len, 7);
                assert_true(strlen(s[i].prompt) >= 30);
                for (g = 0; g < groups && strncmp(heads[g], s[i].prompt, 30) != 0; g++)
                        ;
                if (g == groups) {
                        assert_true(groups < 3);
                        memcpy(heads[groups++], s[i].prompt, 30);
                }
                sizes[g]++;
        }
        assert_int_equal(groups, 3);
        assert_int_equal(sizes[0] + sizes[1] + sizes[2], 20);
        for (int g = 0; g < 3; g++)
                assert_true(sizes[g] == 6 || sizes[g] == 7);
        tsr_bench_samples_free(s, 20);
        cfg.num_prefixes = 0;
        assert_int_equal(tsr_bench_prefix_repetition_dataset(&TOY, &r, &cfg, 3, &s, err, sizeof(err)), TSR_E_INVAL);
        assert_null(s);
}

static int64_t toy_count(const char *text) {
        uint32_t *ids;
        size_t n;
        assert_int_equal(toy_encode(NULL, text, strlen(text), &ids, &n), TSR_OK);
        free(ids);
        return (int64_t)n;
}

/* Sessions growing a history: turn k+1 of a session is, byte for byte, turn k's prompt,
 * then the stand-in reply, then its own user text, the three handed out apart so a
 * client can put the server's real answer in the reply's place; every prompt starts
 * with the shared system prompt, and each round of turns comes in its own order (so
 * round-robin over workers is not session-sticky). */
static void test_multi_turn_dataset(void **state) {
        tsr_bench_rng r;
        tsr_bench_sample *s, *again;
        char err[512];
        tsr_bench_multi_turn_cfg cfg = {.system_len = 20, .turns = 4, .user_len = 8, .output_len = 5};
        const size_t n = 22, sessions = 6;   /* ceil(22 / 4); the last round is cut short */
        size_t moved = 0, followed[22] = {0};

        tsr_bench_rng_seed(&r, 6);
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &cfg, n, &s, err, sizeof(err)), TSR_OK);
        for (size_t i = 0; i < n; i++) {
                assert_int_equal(s[i].expected_output_len, 5);
                assert_memory_equal(s[i].prompt, s[0].prompt, 15);          /* the system prompt */
                /* prompt_len counts the prompt as joined, not its parts */
                assert_int_equal(s[i].prompt_len, toy_count(s[i].prompt));
                assert_int_equal(s[i].follows, i >= sessions);          /* turn 0 follows nothing */
                if (!s[i].follows) {
                        assert_null(s[i].user);
                        assert_null(s[i].prev_reply);
                        continue;
                }
                /* the previous turn of the same session, in the previous round */
                size_t p = s[i].prev;
                assert_true(p / sessions + 1 == i / sessions);
                followed[p]++;
                moved += i % sessions != p % sessions;
                /* each part sized on its own (re-encoding is exact for this seed) */
                assert_int_equal(toy_count(s[i].user), 8);
                assert_int_equal(toy_count(s[i].prev_reply), 5);
                /* the fallback a resending client uses is exactly the dataset's prompt */
                char *joined = tsr_bench_turn_prompt(s[p].prompt, s[i].prev_reply, s[i].user);
                assert_string_equal(joined, s[i].prompt);
                free(joined);
                /* the prompt ends with its own user text, after a reply of its own */
                assert_int_equal(strlen(s[i].prompt),
                                 strlen(s[p].prompt) + strlen(s[i].prev_reply) + strlen(s[i].user));
        }
        size_t cut = 0;
        for (size_t i = 0; i < n; i++) {
                /* every turn before the last full round has its follower; the last full
                 * round has as many as the cut round holds */
                assert_true(i < 2 * sessions ? followed[i] == 1 : followed[i] <= 1);
                cut += i >= 2 * sessions ? followed[i] : 0;
        }
        assert_int_equal(cut, n - 3 * sessions);
        assert_true(moved > 0);         /* the rounds are not all in one order */
        assert_true(strncmp(s[0].prompt + 20, s[1].prompt + 20, 20) != 0);   /* sessions differ past it */
        /* the same seed gives the same dataset, parts included */
        tsr_bench_rng_seed(&r, 6);
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &cfg, n, &again, err, sizeof(err)), TSR_OK);
        for (size_t i = 0; i < n; i++) {
                assert_string_equal(s[i].prompt, again[i].prompt);
                assert_int_equal(s[i].prompt_len, again[i].prompt_len);
                assert_int_equal(s[i].prev, again[i].prev);
                if (s[i].follows) {
                        assert_string_equal(s[i].user, again[i].user);
                        assert_string_equal(s[i].prev_reply, again[i].prev_reply);
                }
        }
        tsr_bench_samples_free(s, n);
        tsr_bench_samples_free(again, n);
}

/* A document per session: every turn of a session starts with the shared system
 * prompt and then the session's own document; two sessions share only the system
 * prompt.  Length 0 leaves the dataset as it was (no draw from the stream). */
static void test_multi_turn_session_prefix(void **state) {
        tsr_bench_rng r;
        tsr_bench_sample *s, *plain, *zero, *bad = NULL;
        char err[512];
        tsr_bench_multi_turn_cfg cfg = {.system_len = 20, .turns = 3, .user_len = 8, .output_len = 5,
                                        .session_prefix_len = 40};
        const size_t n = 12, sessions = 4;

        tsr_bench_rng_seed(&r, 9);
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &cfg, n, &s, err, sizeof(err)), TSR_OK);
        for (size_t i = 0; i < n; i++) {
                assert_true(s[i].prompt_len >= 20 + 40 + 8 - 2);      /* ids, give or take re-encoding */
                size_t same = 0, other = 0;
                for (size_t j = 0; j < n; j++) {
                        if (j == i)
                                continue;
                        /* system + document is 60 ids, at least 60 characters */
                        if (strncmp(s[i].prompt, s[j].prompt, 55) == 0)
                                same++;
                        else if (strncmp(s[i].prompt, s[j].prompt, 15) == 0)
                                other++;
                }
                assert_int_equal(same, n / sessions - 1);      /* the session's other turns */
                assert_int_equal(other, n - n / sessions);     /* everyone else: the system prompt only */
        }
        cfg.session_prefix_len = -1;
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &cfg, n, &bad, err, sizeof(err)), TSR_E_INVAL);
        assert_null(bad);
        assert_non_null(strstr(err, "--multi-turn-session-prefix-len"));
        /* 0 draws nothing: the same dataset as a config without the field */
        cfg.session_prefix_len = 0;
        tsr_bench_multi_turn_cfg old = {.system_len = 20, .turns = 3, .user_len = 8, .output_len = 5};
        tsr_bench_rng_seed(&r, 9);
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &cfg, n, &zero, err, sizeof(err)), TSR_OK);
        tsr_bench_rng_seed(&r, 9);
        assert_int_equal(tsr_bench_multi_turn_dataset(&TOY, &r, &old, n, &plain, err, sizeof(err)), TSR_OK);
        for (size_t i = 0; i < n; i++)
                assert_string_equal(zero[i].prompt, plain[i].prompt);
        tsr_bench_samples_free(s, n);
        tsr_bench_samples_free(zero, n);
        tsr_bench_samples_free(plain, n);
}

static void test_decode_to_target_len(void **state) {
        tsr_bench_rng r;
        tsr_bench_rng_seed(&r, 3);
        /* "a b a b c": re-encodes to 3 ids, padded back to 5 with random ids */
        uint32_t *seq = malloc(5 * sizeof(*seq));
        const uint32_t init[5] = {2, 3, 2, 3, 4};
        memcpy(seq, init, sizeof(init));
        size_t n = 5;
        char *prompt;
        int64_t mismatch;
        assert_int_equal(tsr_bench_decode_to_target_len(&TOY, &r, &seq, &n, 5, &prompt, &mismatch), TSR_OK);
        uint32_t *again;
        size_t n_again;
        /* the prompt re-encodes to exactly the returned sequence */
        assert_int_equal(toy_encode(NULL, prompt, strlen(prompt), &again, &n_again), TSR_OK);
        assert_int_equal(n_again, n);
        assert_memory_equal(again, seq, n * sizeof(*seq));
        if (mismatch == 0)
                assert_int_equal(n, 5);
        else
                assert_int_equal((int64_t)n - 5, mismatch);
        free(again);
        free(prompt);
        free(seq);

        /* too long: truncated to the target */
        seq = malloc(4 * sizeof(*seq));
        const uint32_t longer[4] = {4, 5, 6, 7};
        memcpy(seq, longer, sizeof(longer));
        n = 4;
        assert_int_equal(tsr_bench_decode_to_target_len(&TOY, &r, &seq, &n, 2, &prompt, &mismatch), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(mismatch, 0);
        assert_string_equal(prompt, "cd");
        free(prompt);
        free(seq);
}

static void test_random_dataset(void **state) {
        tsr_bench_rng r;
        tsr_bench_sample *s, *s2;
        int64_t mismatch;
        char err[512];
        tsr_bench_random_cfg cfg = {.input_len = 12, .output_len = 6, .prefix_len = 3, .input_range_ratio = 0.5,
                                .output_range_ratio = 0.5};
        tsr_bench_rng_seed(&r, 42);
        assert_int_equal(tsr_bench_random_dataset(&TOY, &r, &cfg, 20, &s, &mismatch, err, sizeof(err)), TSR_OK);
        for (int i = 0; i < 20; i++) {
                uint32_t *ids;
                size_t n;
                assert_true(s[i].expected_output_len >= 3 && s[i].expected_output_len <= 9);
                /* prompt_len is the client-side count of the prompt */
                assert_int_equal(toy_encode(NULL, s[i].prompt, strlen(s[i].prompt), &ids, &n), TSR_OK);
                assert_int_equal((int64_t)n, s[i].prompt_len);
                free(ids);
        }
        /* the same seed gives the same prompts */
        tsr_bench_rng_seed(&r, 42);
        assert_int_equal(tsr_bench_random_dataset(&TOY, &r, &cfg, 20, &s2, &mismatch, err, sizeof(err)), TSR_OK);
        for (int i = 0; i < 20; i++) {
                assert_string_equal(s[i].prompt, s2[i].prompt);
                assert_int_equal(s[i].prompt_len, s2[i].prompt_len);
        }
        tsr_bench_samples_free(s, 20);
        tsr_bench_samples_free(s2, 20);

        /* no range: every request asks for exactly output_len tokens */
        cfg = (tsr_bench_random_cfg){.input_len = 5, .output_len = 2};
        tsr_bench_rng_seed(&r, 1);
        assert_int_equal(tsr_bench_random_dataset(&TOY, &r, &cfg, 30, &s, &mismatch, err, sizeof(err)), TSR_OK);
        for (int i = 0; i < 30; i++) {
                assert_int_equal(s[i].expected_output_len, 2);
                assert_true(s[i].prompt_len >= 1);
        }
        tsr_bench_samples_free(s, 30);

        cfg = (tsr_bench_random_cfg){.input_len = 0, .output_len = 2};
        assert_int_equal(tsr_bench_random_dataset(&TOY, &r, &cfg, 3, &s, &mismatch, err, sizeof(err)), TSR_E_INVAL);
        assert_null(s);
}

/* FNV-1a over every prompt (with its NUL) and its prompt_len. */
static uint64_t samples_hash(const tsr_bench_sample *s, size_t n) {
        uint64_t h = UINT64_C(0xcbf29ce484222325);
        for (size_t i = 0; i < n; i++) {
                const unsigned char *p = (const unsigned char *)s[i].prompt;
                do {
                        h = (h ^ *p) * UINT64_C(0x100000001b3);
                } while (*p++);
                h = (h ^ (uint64_t)s[i].prompt_len) * UINT64_C(0x100000001b3);
        }
        return h;
}

/* The random and prefix_repetition datasets stay byte for byte what they were for a
 * seed when multi_turn, which shares their helpers, changes: the hashes were taken
 * before multi_turn's history moved from ids to text (branch resend-reply). */
static void test_other_datasets_unchanged(void **state) {
        tsr_bench_rng r;
        tsr_bench_sample *s;
        int64_t mismatch;
        char err[512];
        tsr_bench_random_cfg rc = {.input_len = 12, .output_len = 6, .prefix_len = 3, .input_range_ratio = 0.5,
                                   .output_range_ratio = 0.5};
        tsr_bench_prefix_rep_cfg pc = {.prefix_len = 40, .suffix_len = 10, .num_prefixes = 3, .output_len = 7};

        tsr_bench_rng_seed(&r, 42);
        assert_int_equal(tsr_bench_random_dataset(&TOY, &r, &rc, 20, &s, &mismatch, err, sizeof(err)), TSR_OK);
        assert_true(samples_hash(s, 20) == UINT64_C(0xbb169773a1e282dc));
        tsr_bench_samples_free(s, 20);
        tsr_bench_rng_seed(&r, 5);
        assert_int_equal(tsr_bench_prefix_repetition_dataset(&TOY, &r, &pc, 20, &s, err, sizeof(err)), TSR_OK);
        assert_true(samples_hash(s, 20) == UINT64_C(0x0f05ae5e2397c819));
        tsr_bench_samples_free(s, 20);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_sse_split_anywhere),
                cmocka_unit_test(test_sse_tail_without_blank_line),
                cmocka_unit_test(test_output_completions),
                cmocka_unit_test(test_output_usage_beside_choices),
                cmocka_unit_test(test_output_chat_role_chunk_is_not_a_token),
                cmocka_unit_test(test_output_nul_text),
                cmocka_unit_test(test_output_nul_key),
                cmocka_unit_test(test_output_failures),
                cmocka_unit_test(test_percentile_matches_numpy),
                cmocka_unit_test(test_metrics_as_calculate_metrics),
                cmocka_unit_test(test_report_block_format),
                cmocka_unit_test(test_pyfloat_and_filename),
                cmocka_unit_test(test_goodput_parse),
                cmocka_unit_test(test_arrival_delays),
                cmocka_unit_test(test_rng_is_numpy),
                cmocka_unit_test(test_random_bounds),
                cmocka_unit_test(test_decode_to_target_len),
                cmocka_unit_test(test_random_dataset),
                cmocka_unit_test(test_prefix_repetition_dataset),
                cmocka_unit_test(test_multi_turn_dataset),
                cmocka_unit_test(test_multi_turn_session_prefix),
                cmocka_unit_test(test_other_datasets_unchanged),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
