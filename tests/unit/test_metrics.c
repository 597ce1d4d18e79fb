/* router/metrics: vLLM's series, names, labels and buckets byte for byte; counters that
 * never go down across worker restarts; gauges over the live workers only.
 *
 * test_write_exposition also leaves a rich exposition in a file
 * ($TSR_METRICS_EXPOSITION, default /tmp/tessera-metrics.prom) for
 * tests/fixtures/check_exposition.py, which parses it with prometheus_client. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <math.h>

#include "router/metrics.h"

static double fixed_clock(void *ud) { return *(double *)ud; }

static double created_at = 1700000000.5;

static tsr_metrics *new_metrics(bool disable, const char *hidden) {
        tsr_metrics_opts o = {.disable_log_stats = disable,
                              .show_hidden_metrics_for_version = hidden,
                              .clock = fixed_clock,
                              .clock_ud = &created_at};
        tsr_metrics *m = NULL;
        assert_int_equal(tsr_metrics_new(&o, &m), TSR_OK);
        assert_non_null(m);
        return m;
}

/* Render into a NUL-terminated heap string (caller frees). */
static char *render(const tsr_metrics *m) {
        tsr_buf b;
        size_t len;
        tsr_buf_init(&b, 16u << 20);
        assert_int_equal(tsr_metrics_render(m, &b), TSR_OK);
        if (!b.data)
                return strdup("");
        return (char *)tsr_buf_steal(&b, &len);
}

static void assert_has(const char *text, const char *needle) {
        if (!strstr(text, needle))
                fail_msg("missing from exposition: %s", needle);
}

static void assert_lacks(const char *text, const char *needle) {
        if (strstr(text, needle))
                fail_msg("unexpected in exposition: %s", needle);
}

/* The value of the sample line that starts with `prefix` (name and labels). */
static double sample_value(const char *text, const char *prefix) {
        size_t n = strlen(prefix);
        for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
                if (strncmp(p, prefix, n) == 0 && p[n] == ' ')
                        return strtod(p + n + 1, NULL);
        }
        fail_msg("no sample %s", prefix);
        return 0;
}

/* The text between "# HELP <family> " and the next family's HELP (that is, one family
 * and, for counters and histograms, not its _created part). */
static char *family_text(const char *text, const char *family) {
        char head[256];
        const char *p, *end;
        snprintf(head, sizeof(head), "# HELP %s ", family);
        p = strstr(text, head);
        if (!p) {
                fail_msg("no family %s", family);
                return strdup("");   /* not reached: fail_msg ends the test */
        }
        end = strstr(p + 1, "# HELP ");
        if (!end)
                end = p + strlen(p);
        return strndup(p, (size_t)(end - p));
}

#define L0 "{engine=\"0\",model_name=\"m\"}"

/* ---------------------------------------------------------------- formatting */

static void test_format_double(void **state) {
        /* Expected strings are prometheus_client.utils.floatToGoString's output. */
        static const struct {
                double v;
                const char *s;
        } cases[] = {
                {0.0, "0.0"},
                {1.0, "1.0"},
                {-1.0, "-1.0"},
                {0.5, "0.5"},
                {0.001, "0.001"},
                {0.0001, "0.0001"},
                {0.00001, "1e-05"},
                {1.5e-7, "1.5e-07"},
                {2560.0, "2560.0"},
                {16384.0, "16384.0"},
                {100000.0, "100000.0"},
                {999999.0, "999999.0"},
                {1000000.0, "1e+06"},
                {1234567.0, "1.234567e+06"},
                {12345678.9, "1.23456789e+07"},
                {1e15, "1e+15"},
                {1e16, "1e+16"},
                {1.5e16, "1.5e+16"},
                {1e100, "1e+100"},
                {0.1 + 0.2, "0.30000000000000004"},
                {1.0 / 3.0, "0.3333333333333333"},
                {1765432100.25, "1.76543210025e+09"},
                {-12345678.0, "-12345678.0"},
                {123456.789, "123456.789"},
                {5e-324, "5e-324"},
                {1.7976931348623157e308, "1.7976931348623157e+308"},
                {0.9, "0.9"},
        };
        char out[32];
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
                assert_string_equal(tsr_metrics_format_double(cases[i].v, out), cases[i].s);
        assert_string_equal(tsr_metrics_format_double(1.0 / 0.0, out), "+Inf");
        assert_string_equal(tsr_metrics_format_double(-1.0 / 0.0, out), "-Inf");
        assert_string_equal(tsr_metrics_format_double(0.0 / 0.0, out), "NaN");
}

/* ---------------------------------------------------------------- exact text */

static void test_exact_small_registry(void **state) {
        tsr_metrics *m = new_metrics(true, NULL);
        tsr_metrics_worker_sample s = {0};
        char *t;

        assert_int_equal(tsr_metrics_worker_status(m, "m", "tcp://w1:8100", 1, &s), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_PLACEMENTS, "prefix", 2), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_RETRIES, NULL, 1), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_ABORTS, "a\\b\"c\nd", 0), TSR_OK);
        assert_int_equal(tsr_metrics_gauge_set(m, TSR_METRICS_CONNECTIONS, NULL, 3), TSR_OK);
        assert_int_equal(tsr_metrics_gauge_add(m, TSR_METRICS_CONNECTIONS, NULL, -1), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_CONNECTIONS_ACCEPTED, NULL, 12345678), TSR_OK);
        t = render(m);
        assert_string_equal(
                t,
                "# HELP tessera:worker_up 1 while the worker is live (Status within 3 intervals), else 0.\n"
                "# TYPE tessera:worker_up gauge\n"
                "tessera:worker_up{worker=\"tcp://w1:8100\"} 1.0\n"
                "# HELP tessera:placement_decisions_total Requests placed on a worker, by placement policy.\n"
                "# TYPE tessera:placement_decisions_total counter\n"
                "tessera:placement_decisions_total{policy=\"prefix\"} 2.0\n"
                "# HELP tessera:placement_decisions_created Requests placed on a worker, by placement policy.\n"
                "# TYPE tessera:placement_decisions_created gauge\n"
                "tessera:placement_decisions_created{policy=\"prefix\"} 1.7000000005e+09\n"
                "# HELP tessera:request_retries_total Requests resubmitted to another worker.\n"
                "# TYPE tessera:request_retries_total counter\n"
                "tessera:request_retries_total 1.0\n"
                "# HELP tessera:request_retries_created Requests resubmitted to another worker.\n"
                "# TYPE tessera:request_retries_created gauge\n"
                "tessera:request_retries_created 1.7000000005e+09\n"
                "# HELP tessera:request_aborts_total Requests aborted, by cause.\n"
                "# TYPE tessera:request_aborts_total counter\n"
                "tessera:request_aborts_total{cause=\"a\\\\b\\\"c\\nd\"} 0.0\n"
                "# HELP tessera:request_aborts_created Requests aborted, by cause.\n"
                "# TYPE tessera:request_aborts_created gauge\n"
                "tessera:request_aborts_created{cause=\"a\\\\b\\\"c\\nd\"} 1.7000000005e+09\n"
                "# HELP tessera:router_connections Open HTTP connections.\n"
                "# TYPE tessera:router_connections gauge\n"
                "tessera:router_connections 2.0\n"
                "# HELP tessera:router_connections_accepted_total HTTP connections accepted.\n"
                "# TYPE tessera:router_connections_accepted_total counter\n"
                "tessera:router_connections_accepted_total 1.2345678e+07\n"
                "# HELP tessera:router_connections_accepted_created HTTP connections accepted.\n"
                "# TYPE tessera:router_connections_accepted_created gauge\n"
                "tessera:router_connections_accepted_created 1.7000000005e+09\n"
                "# HELP tessera:router_connections_dropped_total HTTP connections the router closed on its own, by "
                "reason (cap, header_timeout, body_timeout, idle_timeout).\n"
                "# TYPE tessera:router_connections_dropped_total counter\n"
                "# HELP tessera:worker_kv_blocks KV-cache blocks of the worker (its last Status).\n"
                "# TYPE tessera:worker_kv_blocks gauge\n"
                "# HELP tessera:worker_kv_free_blocks KV-cache blocks free on the worker, evictable cached blocks "
                "included (its last Status).\n"
                "# TYPE tessera:worker_kv_free_blocks gauge\n"
                "# HELP tessera:worker_weight_bytes Bytes of model weights resident on the worker, every rank, as "
                "held (kept quantized or widened; its ModelInfo).\n"
                "# TYPE tessera:worker_weight_bytes gauge\n");
        free(t);
        s.weight_bytes = 228608;                /* a ModelInfo that reports them: the series appears */
        assert_int_equal(tsr_metrics_worker_status(m, "m", "tcp://w1:8100", 1, &s), TSR_OK);
        t = render(m);
        assert_non_null(strstr(t, "tessera:worker_weight_bytes{worker=\"tcp://w1:8100\"} 228608.0\n"));
        free(t);
        tsr_metrics_free(&m);
        assert_null(m);
        tsr_metrics_free(&m);
        tsr_metrics_free(NULL);
}

static void test_exact_vllm_families(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_metrics_cache_info ci;
        char *t, *f;

        tsr_metrics_cache_info_defaults(&ci);
        ci.num_gpu_blocks = 2048;
        assert_int_equal(tsr_metrics_add_model(m, "m", 100, &ci), TSR_OK);
        tsr_metrics_request_group_finished(m, "m", 2, 7);
        t = render(m);

        f = family_text(t, "vllm:num_requests_running");
        assert_string_equal(f, "# HELP vllm:num_requests_running Requests in the engines' running batches.\n"
                               "# TYPE vllm:num_requests_running gauge\n"
                               "vllm:num_requests_running" L0 " 0.0\n");
        free(f);

        f = family_text(t, "vllm:prompt_tokens_total");
        assert_string_equal(f, "# HELP vllm:prompt_tokens_total Prompt tokens prefilled.\n"
                               "# TYPE vllm:prompt_tokens_total counter\n"
                               "vllm:prompt_tokens_total" L0 " 0.0\n");
        free(f);
        f = family_text(t, "vllm:prompt_tokens_created");
        assert_string_equal(f, "# HELP vllm:prompt_tokens_created Prompt tokens prefilled.\n"
                               "# TYPE vllm:prompt_tokens_created gauge\n"
                               "vllm:prompt_tokens_created" L0 " 1.7000000005e+09\n");
        free(f);

        f = family_text(t, "vllm:request_success_total");
        assert_string_equal(
                f, "# HELP vllm:request_success_total Finished requests, by finish reason.\n"
                   "# TYPE vllm:request_success_total counter\n"
                   "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 0.0\n"
                   "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 0.0\n"
                   "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"m\"} 0.0\n"
                   "vllm:request_success_total{engine=\"0\",finished_reason=\"error\",model_name=\"m\"} 0.0\n");
        free(f);

        f = family_text(t, "vllm:request_params_n");
        assert_string_equal(f, "# HELP vllm:request_params_n The n parameter of each request.\n"
                               "# TYPE vllm:request_params_n histogram\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"1.0\",model_name=\"m\"} 0.0\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"2.0\",model_name=\"m\"} 1.0\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"5.0\",model_name=\"m\"} 1.0\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"10.0\",model_name=\"m\"} 1.0\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"20.0\",model_name=\"m\"} 1.0\n"
                               "vllm:request_params_n_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 1.0\n"
                               "vllm:request_params_n_count" L0 " 1.0\n"
                               "vllm:request_params_n_sum" L0 " 2.0\n");
        free(f);
        f = family_text(t, "vllm:request_params_n_created");
        assert_string_equal(f, "# HELP vllm:request_params_n_created The n parameter of each request.\n"
                               "# TYPE vllm:request_params_n_created gauge\n"
                               "vllm:request_params_n_created" L0 " 1.7000000005e+09\n");
        free(f);

        f = family_text(t, "vllm:cache_config_info");
        assert_string_equal(f, "# HELP vllm:cache_config_info KV-cache configuration, as labels (value always 1).\n"
                               "# TYPE vllm:cache_config_info gauge\n"
                               "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\","
                               "enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\","
                               "is_attention_free=\"False\",kv_cache_memory_bytes=\"None\",model_name=\"m\","
                               "num_cpu_blocks=\"None\",num_gpu_blocks=\"2048\",num_gpu_blocks_override=\"None\","
                               "prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4.0\"} 1.0\n");
        free(f);
        free(t);

        /* Again for a known model: only the info labels change, one child remains. */
        ci.num_gpu_blocks = 4096;
        assert_int_equal(tsr_metrics_add_model(m, "m", 100, &ci), TSR_OK);
        t = render(m);
        assert_has(t, "num_gpu_blocks=\"4096\"");
        assert_lacks(t, "num_gpu_blocks=\"2048\"");
        assert_has(t, "vllm:request_params_n_count" L0 " 1.0\n");
        free(t);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- presence */

/* Every series issue #6 lists, as a sample line at 0 right after add_model. */
static void test_all_series_at_zero(void **state) {
        static const char *const gauges[] = {"vllm:num_requests_running", "vllm:num_requests_waiting",
                                             "vllm:kv_cache_usage_perc"};
        static const char *const counters[] = {"vllm:prompt_tokens", "vllm:generation_tokens",
                                               "vllm:num_preemptions", "vllm:prefix_cache_queries",
                                               "vllm:prefix_cache_hits"};
        static const char *const histograms[] = {
                "vllm:time_to_first_token_seconds",      "vllm:inter_token_latency_seconds",
                "vllm:e2e_request_latency_seconds",      "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",     "vllm:request_decode_time_seconds",
                "vllm:request_inference_time_seconds",   "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens",        "vllm:request_max_num_generation_tokens",
                "vllm:request_params_n",                 "vllm:request_params_max_tokens",
                "vllm:iteration_tokens_total",           "vllm:request_time_per_output_token_seconds",
        };
        static const char *const reasons[] = {"stop", "length", "abort", "error"};
        tsr_metrics *m = new_metrics(false, NULL);
        char line[512], *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        t = render(m);
        for (size_t i = 0; i < sizeof(gauges) / sizeof(gauges[0]); i++) {
                snprintf(line, sizeof(line), "# TYPE %s gauge\n%s" L0 " 0.0\n", gauges[i], gauges[i]);
                assert_has(t, line);
        }
        for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
                snprintf(line, sizeof(line), "# TYPE %s_total counter\n%s_total" L0 " 0.0\n", counters[i],
                         counters[i]);
                assert_has(t, line);
                snprintf(line, sizeof(line), "%s_created" L0 " 1.7000000005e+09\n", counters[i]);
                assert_has(t, line);
        }
        for (size_t i = 0; i < sizeof(histograms) / sizeof(histograms[0]); i++) {
                snprintf(line, sizeof(line), "# TYPE %s histogram\n", histograms[i]);
                assert_has(t, line);
                snprintf(line, sizeof(line), "%s_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 0.0\n",
                         histograms[i]);
                assert_has(t, line);
                snprintf(line, sizeof(line), "%s_count" L0 " 0.0\n%s_sum" L0 " 0.0\n", histograms[i],
                         histograms[i]);
                assert_has(t, line);
                snprintf(line, sizeof(line), "%s_created" L0 " 1.7000000005e+09\n", histograms[i]);
                assert_has(t, line);
        }
        for (size_t i = 0; i < 4; i++) {
                snprintf(line, sizeof(line),
                         "vllm:request_success_total{engine=\"0\",finished_reason=\"%s\",model_name=\"m\"} 0.0\n",
                         reasons[i]);
                assert_has(t, line);
        }
        assert_has(t, "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\"");
        assert_lacks(t, "vllm:time_per_output_token_seconds");
        free(t);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- buckets */

/* The `le` values of one histogram child, joined by spaces. */
static void le_list(const char *t, const char *hist, char *out, size_t cap) {
        char prefix[256];
        size_t n, used = 0;
        out[0] = '\0';
        n = (size_t)snprintf(prefix, sizeof(prefix), "%s_bucket{engine=\"0\",le=\"", hist);
        for (const char *p = strstr(t, prefix); p; p = strstr(p + 1, prefix)) {
                const char *v = p + n, *q = strchr(v, '"');
                used += (size_t)snprintf(out + used, cap - used, "%s%.*s", used ? " " : "", (int)(q - v), v);
        }
}

static void test_buckets(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        char got[2048], *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        t = render(m);
        le_list(t, "vllm:request_prompt_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 200.0 500.0 1000.0 2000.0 5000.0 +Inf");
        le_list(t, "vllm:request_generation_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 200.0 500.0 1000.0 2000.0 5000.0 +Inf");
        le_list(t, "vllm:request_max_num_generation_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 200.0 500.0 1000.0 2000.0 5000.0 +Inf");
        le_list(t, "vllm:request_params_max_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 200.0 500.0 1000.0 2000.0 5000.0 +Inf");
        le_list(t, "vllm:request_params_n", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 +Inf");
        le_list(t, "vllm:iteration_tokens_total", got, sizeof(got));
        assert_string_equal(got, "1.0 8.0 16.0 32.0 64.0 128.0 256.0 512.0 1024.0 2048.0 4096.0 8192.0 16384.0 +Inf");
        le_list(t, "vllm:time_to_first_token_seconds", got, sizeof(got));
        assert_string_equal(got, "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 "
                                 "20.0 40.0 80.0 160.0 640.0 2560.0 +Inf");
        le_list(t, "vllm:inter_token_latency_seconds", got, sizeof(got));
        assert_string_equal(got, "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 "
                                 "40.0 80.0 +Inf");
        le_list(t, "vllm:request_time_per_output_token_seconds", got, sizeof(got));
        assert_string_equal(got, "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 "
                                 "40.0 80.0 +Inf");
        static const char *const latency[] = {"vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                                              "vllm:request_inference_time_seconds",
                                              "vllm:request_prefill_time_seconds",
                                              "vllm:request_decode_time_seconds"};
        for (size_t i = 0; i < 5; i++) {
                le_list(t, latency[i], got, sizeof(got));
                assert_string_equal(got, "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 "
                                         "120.0 240.0 480.0 960.0 1920.0 7680.0 +Inf");
        }
        free(t);
        tsr_metrics_free(&m);

        m = new_metrics(false, NULL);
        assert_int_equal(tsr_metrics_add_model(m, "m", 100, NULL), TSR_OK);
        t = render(m);
        le_list(t, "vllm:request_prompt_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 +Inf");
        free(t);
        tsr_metrics_free(&m);

        /* Long contexts reach Go's exponent form, exactly as vLLM prints them. */
        m = new_metrics(false, NULL);
        assert_int_equal(tsr_metrics_add_model(m, "m", 2000000, NULL), TSR_OK);
        t = render(m);
        le_list(t, "vllm:request_prompt_tokens", got, sizeof(got));
        assert_string_equal(got, "1.0 2.0 5.0 10.0 20.0 50.0 100.0 200.0 500.0 1000.0 2000.0 5000.0 10000.0 "
                                 "20000.0 50000.0 100000.0 200000.0 500000.0 1e+06 2e+06 +Inf");
        free(t);
        assert_int_equal(tsr_metrics_add_model(m, "", 100, NULL), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_add_model(m, "x", 0, NULL), TSR_E_INVAL);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- workers */

static tsr_metrics_worker_sample sample(uint64_t prompt, uint64_t gen) {
        tsr_metrics_worker_sample s = {0};
        s.prompt_tokens_total = prompt;
        s.generation_tokens_total = gen;
        s.prefix_cache_queries_total = prompt;
        s.prefix_cache_hits_total = prompt / 2;
        s.num_preemptions_total = gen / 10;
        return s;
}

static void test_counters_monotonic_across_restart(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_metrics_worker_sample s;
        char *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        /* First sight: a baseline, whatever the worker did before this router. */
        s = sample(1000, 500);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 7, &s), TSR_OK);
        s = sample(1100, 530);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 7, &s), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:prompt_tokens_total" L0) == 100);
        assert_true(sample_value(t, "vllm:generation_tokens_total" L0) == 30);
        assert_true(sample_value(t, "vllm:prefix_cache_queries_total" L0) == 100);
        assert_true(sample_value(t, "vllm:prefix_cache_hits_total" L0) == 50);
        assert_true(sample_value(t, "vllm:num_preemptions_total" L0) == 3);
        free(t);

        /* Restart with a new boot_epoch: everything the new process counted is new. */
        s = sample(40, 20);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 8, &s), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:prompt_tokens_total" L0) == 140);
        assert_true(sample_value(t, "vllm:generation_tokens_total" L0) == 50);
        assert_true(sample_value(t, "vllm:num_preemptions_total" L0) == 5);
        free(t);

        /* Same epoch, counter lower (the epoch was missed): treated as a reset. */
        s = sample(10, 5);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 8, &s), TSR_OK);
        s = sample(15, 5);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 8, &s), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:prompt_tokens_total" L0) == 155);
        assert_true(sample_value(t, "vllm:generation_tokens_total" L0) == 55);
        free(t);

        /* Gone and back with the same epoch: the gap's work counts once. */
        tsr_metrics_worker_gone(m, "w1");
        s = sample(65, 5);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 8, &s), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:prompt_tokens_total" L0) == 205);
        free(t);

        /* An unknown model is refused; liveness still moves. */
        assert_int_equal(tsr_metrics_worker_status(m, "other", "w9", 1, &s), TSR_E_NOTFOUND);
        t = render(m);
        assert_true(sample_value(t, "tessera:worker_up{worker=\"w9\"}") == 1);
        free(t);
        tsr_metrics_free(&m);
}

/* A hybrid's workers report their KV memory by bytes, state slots included: usage is
 * then used / total bytes over the workers (a running request's state counts, as in
 * vLLM's one page pool); one worker without bytes puts the model back on blocks. */
static void test_kv_usage_by_bytes(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        /* 100 blocks of 1000 bytes, 10 free; 8 slots of 5000 bytes, 6 held: (90k + 30k) / 140k */
        tsr_metrics_worker_sample a = {.kv_blocks_total = 100, .kv_blocks_free = 10, .kv_bytes_total = 140000,
                                       .kv_bytes_used = 120000};
        tsr_metrics_worker_sample b = {.kv_blocks_total = 100, .kv_blocks_free = 100, .kv_bytes_total = 60000,
                                       .kv_bytes_used = 0};
        tsr_metrics_worker_sample c = {.kv_blocks_total = 100, .kv_blocks_free = 50};
        char *t;
        (void)state;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        t = render(m);
        assert_true(fabs(sample_value(t, "vllm:kv_cache_usage_perc" L0) - 120000.0 / 140000.0) < 1e-9);
        free(t);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w2", 1, &b), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:kv_cache_usage_perc" L0) == 0.6);    /* 120k / 200k */
        free(t);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w3", 1, &c), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:kv_cache_usage_perc" L0) == 1.0 - 160.0 / 300.0);
        free(t);
        tsr_metrics_free(&m);
}

static void test_gauges_over_workers(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_metrics_worker_sample a = {.num_running = 3, .num_waiting = 1, .kv_blocks_total = 100,
                                       .kv_blocks_free = 50};
        tsr_metrics_worker_sample b = {.num_running = 2, .num_waiting = 4, .kv_blocks_total = 300,
                                       .kv_blocks_free = 250};
        char *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_add_model(m, "n", 4096, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w2", 1, &b), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 5);
        assert_true(sample_value(t, "vllm:num_requests_waiting" L0) == 5);
        /* 1 - (50 + 250) / (100 + 300) */
        assert_true(sample_value(t, "vllm:kv_cache_usage_perc" L0) == 0.25);
        assert_true(sample_value(t, "vllm:num_requests_running{engine=\"0\",model_name=\"n\"}") == 0);
        assert_true(sample_value(t, "tessera:worker_up{worker=\"w1\"}") == 1);
        /* per replica: what each worker reported */
        assert_true(sample_value(t, "tessera:worker_kv_blocks{worker=\"w1\"}") == 100);
        assert_true(sample_value(t, "tessera:worker_kv_free_blocks{worker=\"w1\"}") == 50);
        assert_true(sample_value(t, "tessera:worker_kv_blocks{worker=\"w2\"}") == 300);
        assert_true(sample_value(t, "tessera:worker_kv_free_blocks{worker=\"w2\"}") == 250);
        free(t);

        /* A later sample replaces the worker's earlier one, it does not add to it. */
        a.num_running = 1;
        a.kv_blocks_free = 20;
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 3);
        assert_true(sample_value(t, "tessera:worker_kv_free_blocks{worker=\"w1\"}") == 20);
        free(t);
        a.kv_blocks_free = 50;
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);

        tsr_metrics_worker_gone(m, "w2");
        tsr_metrics_worker_gone(m, "nobody");
        t = render(m);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 1);
        assert_true(sample_value(t, "vllm:num_requests_waiting" L0) == 1);
        assert_true(sample_value(t, "vllm:kv_cache_usage_perc" L0) == 0.5);
        assert_true(sample_value(t, "tessera:worker_up{worker=\"w2\"}") == 0);
        free(t);

        tsr_metrics_worker_gone(m, "w1");
        t = render(m);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 0);
        assert_true(sample_value(t, "vllm:kv_cache_usage_perc" L0) == 0);
        free(t);

        /* A worker that moves to another model leaves the first one's gauges. */
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "n", "w1", 2, &a), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 0);
        assert_true(sample_value(t, "vllm:num_requests_running{engine=\"0\",model_name=\"n\"}") == 1);
        free(t);
        tsr_metrics_free(&m);
}

/* A --worker-dns address that left the pool: its series goes, the gauges drop its
 * sample, and when it is added again its first Status is a baseline. */
static void test_worker_removed(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_metrics_worker_sample a = sample(1000, 500), b = sample(0, 0);
        char *t;

        a.num_running = 2;
        a.kv_blocks_total = a.kv_blocks_free = 64;   /* its KV series go too */
        b.num_running = 3;
        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w2", 1, &b), TSR_OK);
        tsr_metrics_worker_remove(m, "w1");
        tsr_metrics_worker_remove(m, "nobody");
        t = render(m);
        assert_null(strstr(t, "worker=\"w1\""));
        assert_true(sample_value(t, "tessera:worker_up{worker=\"w2\"}") == 1);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 3);
        free(t);

        /* Back (the same process, counters grown): a baseline, no spike. */
        a = sample(5000, 900);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &a), TSR_OK);
        t = render(m);
        assert_true(sample_value(t, "tessera:worker_up{worker=\"w1\"}") == 1);
        assert_true(sample_value(t, "vllm:prompt_tokens_total" L0) == 0);
        assert_true(sample_value(t, "vllm:num_requests_running" L0) == 3);
        free(t);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- flags */

static void test_disable_log_stats(void **state) {
        tsr_metrics *m = new_metrics(true, "0.11");
        tsr_metrics_worker_sample s = sample(10, 10);
        tsr_metrics_request r = {.finished_reason = TSR_METRICS_FINISH_STOP, .e2e_s = 1};
        char *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "m", "w1", 1, &s), TSR_OK);
        tsr_metrics_request_finished(m, "m", &r);
        tsr_metrics_observe_ttft(m, "m", 0.1);
        tsr_metrics_observe_itl(m, "m", 0.1);
        t = render(m);
        assert_lacks(t, "vllm:");
        assert_has(t, "tessera:worker_up{worker=\"w1\"} 1.0\n");
        assert_has(t, "tessera:router_connections 0.0\n");
        free(t);
        tsr_metrics_free(&m);
}

static void test_hidden_metric(void **state) {
        static const char *const versions[] = {NULL, "0.10", "0.12", "0.11.0", ""};
        tsr_metrics *m;
        char got[1024], *t;

        for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]); i++) {
                m = new_metrics(false, versions[i]);
                assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
                tsr_metrics_observe_itl(m, "m", 0.02);
                t = render(m);
                assert_lacks(t, "vllm:time_per_output_token_seconds");
                assert_has(t, "vllm:request_time_per_output_token_seconds_count" L0 " 0.0\n");
                assert_has(t, "vllm:inter_token_latency_seconds_count" L0 " 1.0\n");
                free(t);
                tsr_metrics_free(&m);
        }

        m = new_metrics(false, TSR_METRICS_HIDDEN_VERSION);
        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        tsr_metrics_observe_itl(m, "m", 0.02);
        tsr_metrics_observe_itl(m, "m", 0.2);
        t = render(m);
        assert_has(t, "# TYPE vllm:time_per_output_token_seconds histogram\n");
        le_list(t, "vllm:time_per_output_token_seconds", got, sizeof(got));
        assert_string_equal(got, "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 "
                                 "40.0 80.0 +Inf");
        assert_true(sample_value(t, "vllm:time_per_output_token_seconds_count" L0) == 2);
        assert_true(sample_value(t, "vllm:time_per_output_token_seconds_bucket{engine=\"0\",le=\"0.025\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:inter_token_latency_seconds_count" L0) == 2);
        free(t);
        tsr_metrics_free(&m);
}

static void test_label_escaping(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        char *t;

        assert_int_equal(tsr_metrics_add_model(m, "org/a\"b\\c\nd", 100, NULL), TSR_OK);
        t = render(m);
        assert_has(t, "vllm:num_requests_running{engine=\"0\",model_name=\"org/a\\\"b\\\\c\\nd\"} 0.0\n");
        assert_has(t, "vllm:request_params_n_bucket{engine=\"0\",le=\"1.0\",model_name=\"org/a\\\"b\\\\c\\nd\"} 0.0\n");
        free(t);

        /* The label contract of the tessera:* entry points. */
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_RETRIES, "x", 1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_ABORTS, NULL, 1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_ABORTS, "client", -1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_CONNECTIONS, NULL, 1), TSR_E_INVAL);
        /* counter_set_total: a total copied in from the HTTP server, never going down. */
        assert_int_equal(tsr_metrics_counter_set_total(m, TSR_METRICS_CONNECTIONS_DROPPED, "cap", 5), TSR_OK);
        assert_int_equal(tsr_metrics_counter_set_total(m, TSR_METRICS_CONNECTIONS_DROPPED, "cap", 5), TSR_OK);
        assert_int_equal(tsr_metrics_counter_set_total(m, TSR_METRICS_CONNECTIONS_DROPPED, "cap", 4), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_counter_set_total(m, TSR_METRICS_CONNECTIONS_DROPPED, NULL, 1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_counter_set_total(m, TSR_METRICS_CONNECTIONS, NULL, 1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_gauge_set(m, TSR_METRICS_RETRIES, NULL, 1), TSR_E_INVAL);
        assert_int_equal(tsr_metrics_gauge_set(m, TSR_METRICS_ID_COUNT, NULL, 1), TSR_E_INVAL);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- observations */

static void test_histogram_observations(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_metrics_request r = {
                .finished_reason = TSR_METRICS_FINISH_LENGTH,
                .e2e_s = 1.25,
                .queue_s = 0.25,
                .prefill_s = 0.5,
                .decode_s = 0.5,
                .inference_s = 1.0,
                .num_prompt_tokens = 20,
                .num_generation_tokens = 5,
                .max_tokens = 5,
        };
        char *t;

        assert_int_equal(tsr_metrics_add_model(m, "m", 100, NULL), TSR_OK);
        tsr_metrics_request_finished(m, "m", &r);
        r.finished_reason = TSR_METRICS_FINISH_STOP;
        r.e2e_s = 10000;         /* past the last bound: +Inf only */
        r.num_generation_tokens = 1;
        r.max_tokens = 0;        /* not given: not observed */
        r.queue_s = -1;          /* a clock bug: skipped */
        tsr_metrics_request_finished(m, "m", &r);
        tsr_metrics_request_finished(m, "nope", &r);
        tsr_metrics_observe_ttft(m, "m", 0.001); /* on a bound: le is inclusive */
        tsr_metrics_observe_ttft(m, "m", 0.0011);
        tsr_metrics_observe_iteration(m, "m", 9);
        tsr_metrics_request_group_finished(m, "m", 1, 5);
        t = render(m);

        assert_true(sample_value(t, "vllm:request_success_total{engine=\"0\",finished_reason=\"length\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\","
                                    "model_name=\"m\"}") == 0);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_count" L0) == 2);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_sum" L0) == 10001.25);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"1.0\","
                                    "model_name=\"m\"}") == 0);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"1.5\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"7680.0\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"+Inf\","
                                    "model_name=\"m\"}") == 2);
        assert_true(sample_value(t, "vllm:request_queue_time_seconds_count" L0) == 1);
        assert_true(sample_value(t, "vllm:request_queue_time_seconds_sum" L0) == 0.25);
        assert_true(sample_value(t, "vllm:request_prefill_time_seconds_sum" L0) == 1.0);
        assert_true(sample_value(t, "vllm:request_decode_time_seconds_sum" L0) == 1.0);
        assert_true(sample_value(t, "vllm:request_inference_time_seconds_sum" L0) == 2.0);
        assert_true(sample_value(t, "vllm:request_prompt_tokens_sum" L0) == 40);
        assert_true(sample_value(t, "vllm:request_prompt_tokens_bucket{engine=\"0\",le=\"20.0\","
                                    "model_name=\"m\"}") == 2);
        assert_true(sample_value(t, "vllm:request_generation_tokens_sum" L0) == 6);
        assert_true(sample_value(t, "vllm:request_generation_tokens_bucket{engine=\"0\",le=\"1.0\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:request_params_max_tokens_count" L0) == 1);
        /* 0.5 s over 4 intervals, then 0 for the one-token request. */
        assert_true(sample_value(t, "vllm:request_time_per_output_token_seconds_count" L0) == 2);
        assert_true(sample_value(t, "vllm:request_time_per_output_token_seconds_sum" L0) == 0.125);
        assert_true(sample_value(t, "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.005\","
                                    "model_name=\"m\"}") == 2);
        assert_true(sample_value(t, "vllm:iteration_tokens_total_bucket{engine=\"0\",le=\"8.0\","
                                    "model_name=\"m\"}") == 0);
        assert_true(sample_value(t, "vllm:iteration_tokens_total_bucket{engine=\"0\",le=\"16.0\","
                                    "model_name=\"m\"}") == 1);
        assert_true(sample_value(t, "vllm:iteration_tokens_total_sum" L0) == 9);
        assert_true(sample_value(t, "vllm:request_params_n_sum" L0) == 1);
        assert_true(sample_value(t, "vllm:request_max_num_generation_tokens_sum" L0) == 5);
        free(t);
        tsr_metrics_free(&m);
}

static void test_buffer_limit(void **state) {
        tsr_metrics *m = new_metrics(false, NULL);
        tsr_buf b;

        assert_int_equal(tsr_metrics_add_model(m, "m", 8192, NULL), TSR_OK);
        tsr_buf_init(&b, 1000);
        assert_int_equal(tsr_metrics_render(m, &b), TSR_E_LIMIT);
        tsr_buf_done(&b);
        tsr_metrics_free(&m);
}

/* ---------------------------------------------------------------- file for the parser check */

/* A registry with every kind of series, observations, two models, the hidden series and
 * awkward label values, written for tests/fixtures/check_exposition.py. */
static void test_write_exposition(void **state) {
        const char *path = getenv("TSR_METRICS_EXPOSITION");
        tsr_metrics_opts o = {.show_hidden_metrics_for_version = "0.11"};
        tsr_metrics_worker_sample a = {.num_running = 2, .num_waiting = 1, .kv_blocks_total = 1000,
                                       .kv_blocks_free = 900, .prompt_tokens_total = 0};
        tsr_metrics_request r = {.finished_reason = TSR_METRICS_FINISH_STOP, .e2e_s = 0.7, .queue_s = 0.01,
                                 .prefill_s = 0.09, .decode_s = 0.6, .inference_s = 0.69,
                                 .num_prompt_tokens = 128, .num_generation_tokens = 16, .max_tokens = 16};
        tsr_metrics *m = NULL;
        tsr_metrics_cache_info ci;
        FILE *f;
        char *t;

        if (!path || !*path)
                path = "/tmp/tessera-metrics.prom";
        assert_int_equal(tsr_metrics_new(&o, &m), TSR_OK);
        tsr_metrics_cache_info_defaults(&ci);
        ci.num_gpu_blocks = 1000;
        assert_int_equal(tsr_metrics_add_model(m, "HuggingFaceTB/SmolLM2-135M-Instruct", 8192, &ci), TSR_OK);
        assert_int_equal(tsr_metrics_add_model(m, "we\"ird\\name\nx", 1000000, NULL), TSR_OK);
        assert_int_equal(tsr_metrics_worker_status(m, "HuggingFaceTB/SmolLM2-135M-Instruct", "tcp://127.0.0.1:8100",
                                                   1, &a),
                         TSR_OK);
        a.prompt_tokens_total = 128;
        a.generation_tokens_total = 16;
        assert_int_equal(tsr_metrics_worker_status(m, "HuggingFaceTB/SmolLM2-135M-Instruct", "tcp://127.0.0.1:8100",
                                                   1, &a),
                         TSR_OK);
        for (int i = 0; i < 15; i++)
                tsr_metrics_observe_itl(m, "HuggingFaceTB/SmolLM2-135M-Instruct", 0.04);
        tsr_metrics_observe_ttft(m, "HuggingFaceTB/SmolLM2-135M-Instruct", 0.1);
        tsr_metrics_observe_iteration(m, "HuggingFaceTB/SmolLM2-135M-Instruct", 128);
        tsr_metrics_request_finished(m, "HuggingFaceTB/SmolLM2-135M-Instruct", &r);
        tsr_metrics_request_group_finished(m, "HuggingFaceTB/SmolLM2-135M-Instruct", 1, 16);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_PLACEMENTS, "prefix_affinity", 3), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_ABORTS, "client_disconnect", 1), TSR_OK);
        assert_int_equal(tsr_metrics_counter_add(m, TSR_METRICS_ABORTS, "q\"uo\\te\nnl", 0), TSR_OK);
        assert_int_equal(tsr_metrics_gauge_set(m, TSR_METRICS_CONNECTIONS, NULL, 4), TSR_OK);
        t = render(m);
        f = fopen(path, "w");
        assert_non_null(f);
        assert_int_equal(fwrite(t, 1, strlen(t), f), strlen(t));
        assert_int_equal(fclose(f), 0);
        free(t);
        tsr_metrics_free(&m);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_format_double),
                cmocka_unit_test(test_exact_small_registry),
                cmocka_unit_test(test_exact_vllm_families),
                cmocka_unit_test(test_all_series_at_zero),
                cmocka_unit_test(test_buckets),
                cmocka_unit_test(test_counters_monotonic_across_restart),
                cmocka_unit_test(test_gauges_over_workers),
                cmocka_unit_test(test_kv_usage_by_bytes),
                cmocka_unit_test(test_worker_removed),
                cmocka_unit_test(test_disable_log_stats),
                cmocka_unit_test(test_hidden_metric),
                cmocka_unit_test(test_label_escaping),
                cmocka_unit_test(test_histogram_observations),
                cmocka_unit_test(test_buffer_limit),
                cmocka_unit_test(test_write_exposition),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
