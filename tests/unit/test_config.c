/* test_config.c - flags, --config YAML, validation, child argv and help (common/config.c). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"

#define MAX_ARGS 64

static char err[512];

/* Parse a NULL-terminated list of arguments; argv[0] is supplied here. */
static tsr_status parse_v(tsr_config *c, bool allow_model, va_list ap) {
        char *argv[MAX_ARGS];
        int argc = 0;
        const char *a;

        argv[argc++] = (char *)"tessera";
        while ((a = va_arg(ap, const char *)) != NULL) {
                assert_true(argc < MAX_ARGS - 1);
                argv[argc++] = (char *)a;
        }
        argv[argc] = NULL;
        err[0] = '\0';
        return tsr_config_parse(c, argc, argv, allow_model, err, sizeof(err));
}

static tsr_status parse(tsr_config *c, ...) {
        va_list ap;
        tsr_status st;

        va_start(ap, c);
        st = parse_v(c, true, ap);
        va_end(ap);
        return st;
}

static tsr_status parse_router(tsr_config *c, ...) {
        va_list ap;
        tsr_status st;

        va_start(ap, c);
        st = parse_v(c, false, ap);
        va_end(ap);
        return st;
}

/* Write `text` to a fresh /tmp file with the given suffix; the caller unlinks and frees. */
static char *write_tmp(const char *suffix, const char *text) {
        char *path;
        int fd;

        assert_true(asprintf(&path, "/tmp/tsr-cfg-XXXXXX%s", suffix) > 0);
        fd = mkstemps(path, (int)strlen(suffix));
        assert_true(fd >= 0);
        assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
        close(fd);
        return path;
}

static void drop_tmp(char *path) {
        unlink(path);
        free(path);
}

static bool argv_has(char **argv, const char *s) {
        for (; *argv; argv++)
                if (strcmp(*argv, s) == 0)
                        return true;
        return false;
}

/* Index of s in argv, or -1. */
static int argv_find(char **argv, const char *s) {
        for (int i = 0; argv[i]; i++)
                if (strcmp(argv[i], s) == 0)
                        return i;
        return -1;
}

/* ----------------------------------------------------------------------- */

static void test_defaults(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_null(c.model);
        assert_int_equal(c.served_model_name.n, 0);
        assert_null(c.tokenizer);
        assert_int_equal(c.max_model_len, 0);
        assert_string_equal(c.dtype, "auto");
        assert_string_equal(c.kv_cache_dtype, "auto");
        assert_null(c.quantization);
        assert_string_equal(c.load_format, "auto");
        assert_string_equal(c.generation_config, "auto");
        assert_string_equal(c.override_generation_config, "{}");
        assert_int_equal(c.max_logprobs, 20);
        assert_int_equal(c.seed, 0);
        assert_false(c.trust_remote_code);
        assert_false(c.enforce_eager);
        assert_int_equal(c.tensor_parallel_size, 1);
        assert_int_equal(c.pipeline_parallel_size, 1);
        assert_int_equal(c.data_parallel_size, 1);
        assert_null(c.distributed_executor_backend);
        assert_int_equal(c.block_size, 16);
        assert_int_equal(c.enable_prefix_caching, TSR_TRI_UNSET);
        assert_string_equal(c.prefix_caching_hash_algo, "sha256");
        assert_true(c.gpu_memory_utilization == 0.9);
        assert_int_equal(c.kv_cache_memory_bytes, 0);
        assert_int_equal(c.num_gpu_blocks_override, 0);
        assert_int_equal(c.max_num_seqs, 0);
        assert_int_equal(c.max_num_batched_tokens, 0);
        assert_int_equal(c.enable_chunked_prefill, TSR_TRI_UNSET);
        assert_int_equal(c.max_num_partial_prefills, 1);
        assert_int_equal(c.long_prefill_token_threshold, 0);
        assert_string_equal(c.scheduling_policy, "fcfs");
        assert_false(c.async_scheduling);
        assert_true(c.swap_space == 4.0);
        assert_int_equal(c.cpu_threads, 0);
        assert_string_equal(c.worker_listen, "tcp://127.0.0.1:8100");
        assert_null(c.status_listen);
        assert_int_equal(c.status_interval_ms, 100);
        assert_null(c.host);
        assert_int_equal(c.port, 8000);
        assert_int_equal(c.api_key.n, 0);
        assert_null(c.chat_template);
        assert_string_equal(c.response_role, "assistant");
        assert_null(c.root_path);
        assert_int_equal(c.stream_interval, 1);
        assert_int_equal(c.max_request_body, 32LL << 20);
        assert_int_equal(c.router_threads, 1);
        assert_int_equal(c.worker.n, 0);
        assert_string_equal(c.routing_policy, "kv");
        assert_null(c.log_level);
        assert_null(c.config_file);
        assert_false(c.help);
        assert_false(c.version);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
        tsr_config_done(&c);
        tsr_config_done(&c);    /* twice is harmless */
}

static void test_empty_argv(void **state) {
        tsr_config c;
        char *argv[] = {(char *)"tessera", NULL};

        tsr_config_init(&c);
        assert_int_equal(tsr_config_parse(&c, 1, argv, true, err, sizeof(err)), TSR_OK);
        assert_int_equal(tsr_config_parse(&c, 0, argv, true, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.port, 8000);
        tsr_config_done(&c);
}

static void test_value_types(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--dtype", "bfloat16", "--port", "9000", "--seed", "-5",
                               "--gpu-memory-utilization", "0.5", "--max-request-body", "1MiB",
                               "--kv-cache-memory-bytes", "2G", "--swap-space", "0", "--host", "127.0.0.1",
                               "--max-logprobs", "-1", "--long-prefill-token-threshold", "512", NULL), TSR_OK);
        assert_string_equal(c.dtype, "bfloat16");
        assert_int_equal(c.port, 9000);
        assert_int_equal(c.seed, -5);
        assert_true(c.gpu_memory_utilization == 0.5);
        assert_int_equal(c.max_request_body, 1 << 20);
        assert_int_equal(c.kv_cache_memory_bytes, 2LL << 30);
        assert_true(c.swap_space == 0.0);
        assert_string_equal(c.host, "127.0.0.1");
        assert_int_equal(c.max_logprobs, -1);
        assert_int_equal(c.long_prefill_token_threshold, 512);
        tsr_config_done(&c);
}

static void test_seed_long_long(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--seed", "9000000000", NULL), TSR_OK);
        assert_true(c.seed == 9000000000LL);
        assert_int_equal(parse(&c, "--seed", "99999999999999999999", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "argument --seed"));
        tsr_config_done(&c);
}

static void test_equals_form(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--port=1234", "--served-model-name=a", "--chat-template=-x-", NULL), TSR_OK);
        assert_int_equal(c.port, 1234);
        assert_int_equal(c.served_model_name.n, 1);
        assert_string_equal(c.served_model_name.items[0], "a");
        assert_string_equal(c.chat_template, "-x-");    /* '=' lets a value start with '-' */
        tsr_config_done(&c);
}

static void test_underscores(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--tensor_parallel_size", "2", "--max_num-seqs=8", "--enable_prefix_caching",
                               "--no_enforce-eager", NULL), TSR_OK);
        assert_int_equal(c.tensor_parallel_size, 2);
        assert_int_equal(c.max_num_seqs, 8);
        assert_int_equal(c.enable_prefix_caching, TSR_TRI_TRUE);
        assert_false(c.enforce_eager);
        tsr_config_done(&c);
}

static void test_short_aliases(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "-tp", "2", "-pp", "3", "-dp", "4", "-q", "awq", NULL), TSR_OK);
        assert_int_equal(c.tensor_parallel_size, 2);
        assert_int_equal(c.pipeline_parallel_size, 3);
        assert_int_equal(c.data_parallel_size, 4);
        assert_string_equal(c.quantization, "awq");
        assert_int_equal(parse(&c, "-tp=8", NULL), TSR_OK);
        assert_int_equal(c.tensor_parallel_size, 8);
        assert_int_equal(parse(&c, "-xx", "1", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: -xx");
        tsr_config_done(&c);
}

static void test_bools(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--enforce-eager", "--trust-remote-code", "--async-scheduling",
                               "--disable-log-stats", NULL), TSR_OK);
        assert_true(c.enforce_eager);
        assert_true(c.trust_remote_code);
        assert_true(c.async_scheduling);
        assert_true(c.disable_log_stats);
        assert_int_equal(parse(&c, "--no-enforce-eager", NULL), TSR_OK);
        assert_false(c.enforce_eager);
        assert_int_equal(parse(&c, "--enforce-eager", "--no-enforce-eager", NULL), TSR_OK);
        assert_false(c.enforce_eager);    /* last one wins */
        assert_int_equal(parse(&c, "--enforce-eager=yes", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --enforce-eager: ignored explicit argument 'yes'");
        /* "no-" only exists for booleans */
        assert_int_equal(parse(&c, "--no-port", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: --no-port");
        tsr_config_done(&c);
}

static void test_tristate(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(c.enable_chunked_prefill, TSR_TRI_UNSET);
        assert_int_equal(parse(&c, "--enable-chunked-prefill", NULL), TSR_OK);
        assert_int_equal(c.enable_chunked_prefill, TSR_TRI_TRUE);
        assert_int_equal(parse(&c, "--no-enable-chunked-prefill", "--no-enable-prefix-caching", NULL), TSR_OK);
        assert_int_equal(c.enable_chunked_prefill, TSR_TRI_FALSE);
        assert_int_equal(c.enable_prefix_caching, TSR_TRI_FALSE);
        tsr_config_done(&c);
}

static void test_list_values(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--served-model-name", "a", "b", "--port", "1", "--served-model-name", "c",
                               "--worker", "tcp://h1:1", "tcp://h2:2", NULL), TSR_OK);
        assert_int_equal(c.served_model_name.n, 3);
        assert_string_equal(c.served_model_name.items[0], "a");
        assert_string_equal(c.served_model_name.items[1], "b");
        assert_string_equal(c.served_model_name.items[2], "c");
        assert_int_equal(c.worker.n, 2);
        assert_string_equal(c.worker.items[1], "tcp://h2:2");
        assert_int_equal(c.port, 1);
        assert_null(c.model);   /* list values are not positionals */
        tsr_config_done(&c);
}

static void test_list_then_positional_after_equals(void **state) {
        tsr_config c;

        /* "--api-key=k" takes exactly one value, so the next word is the model */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--api-key=k", "m", NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.model, "m");
        tsr_config_done(&c);
}

static void test_parse_size(void **state) {
        static const struct {
                const char *s;
                long long v;
        } ok[] = {
                {"0", 0}, {"1000", 1000}, {"1k", 1000}, {"1K", 1024}, {"32k", 32000}, {"32K", 32768},
                {"1m", 1000000}, {"1M", 1 << 20}, {"1g", 1000000000}, {"1G", 1 << 30}, {"2t", 2000000000000LL},
                {"1T", 1LL << 40}, {"1.5k", 1500}, {"0.5m", 500000}, {"4GiB", 4LL << 30}, {"32MiB", 32 << 20},
                {"1KiB", 1024}, {"1KB", 1024}, {"1kB", 1000}, {"2MB", 2 << 20}, {"1GB", 1 << 30},
                {"9223372036854775807", 9223372036854775807LL},
        };
        static const char *const bad[] = {
                "", "-1", "+1", " 1", "1 ", "abc", "1x", "1.5K", "1.5", "1.", ".5k", "1kiB", "1KiBB", "1b",
                "9223372036854775808", "99999999999999999999999", "9000000000G", "1e3",
        };
        long long v;

        for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                v = -7;
                assert_int_equal(tsr_parse_size(ok[i].s, &v), TSR_OK);
                assert_true(v == ok[i].v);
        }
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                v = -7;
                assert_int_equal(tsr_parse_size(bad[i], &v), TSR_E_INVAL);
                assert_true(v == -7);   /* untouched on failure */
        }
        assert_int_equal(tsr_parse_size(NULL, &v), TSR_E_INVAL);
}

static void test_max_model_len_suffix(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--max-model-len", "1k", NULL), TSR_OK);
        assert_int_equal(c.max_model_len, 1000);
        assert_int_equal(parse(&c, "--max-model-len", "1K", NULL), TSR_OK);
        assert_int_equal(c.max_model_len, 1024);
        assert_int_equal(parse(&c, "--max-model-len=32K", NULL), TSR_OK);
        assert_int_equal(c.max_model_len, 32768);
        assert_int_equal(parse(&c, "--max-model-len", "4096", NULL), TSR_OK);
        assert_int_equal(c.max_model_len, 4096);
        assert_int_equal(parse(&c, "--max-model-len", "1.5K", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --max-model-len: invalid size value: '1.5K'");
        assert_int_equal(parse(&c, "--max-model-len", "4G", NULL), TSR_E_INVAL);    /* > INT_MAX */
        assert_non_null(strstr(err, "argument --max-model-len: invalid value: '4G'"));
        tsr_config_done(&c);
}

static void test_kv_cache_memory_alias(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--kv-cache-memory", "4GiB", NULL), TSR_OK);
        assert_int_equal(c.kv_cache_memory_bytes, 4LL << 30);
        assert_int_equal(parse(&c, "--kv_cache_memory_bytes=1000000", NULL), TSR_OK);
        assert_int_equal(c.kv_cache_memory_bytes, 1000000);
        assert_int_equal(parse(&c, "--max-request-body", "0", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "argument --max-request-body: invalid value: '0'"));
        tsr_config_done(&c);
}

static void test_model_positional_and_flag(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/models/a", "--port", "1", NULL), TSR_OK);
        assert_string_equal(c.model, "/models/a");
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--model", "/models/b", NULL), TSR_OK);
        assert_string_equal(c.model, "/models/b");
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--port", "1", "--", "-odd-name", NULL), TSR_OK);
        assert_string_equal(c.model, "-odd-name");

        /* a model that looks like a flag still round-trips through child argv */
        {
                char **argv, *full[4] = {(char *)"w", NULL, NULL, NULL};
                tsr_config d;

                assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_WORKER, &argv, NULL), TSR_OK);
                assert_string_equal(argv[0], "--model=-odd-name");
                full[1] = argv[0];
                tsr_config_init(&d);
                assert_int_equal(tsr_config_parse(&d, 2, full, true, err, sizeof(err)), TSR_OK);
                assert_string_equal(d.model, "-odd-name");
                tsr_config_done(&d);
                tsr_config_free_argv(argv);
        }
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/models/a", "--model", "/models/b", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "--model"));
        tsr_config_done(&c);
}

static void test_second_positional(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "a", "b", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: b");
        tsr_config_done(&c);
}

static void test_router_rejects_positional(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse_router(&c, "--port", "8001", "somemodel", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: somemodel");
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse_router(&c, "--port", "8001", "--worker", "tcp://a:1", NULL), TSR_OK);
        assert_int_equal(c.port, 8001);
        tsr_config_done(&c);
}

static void test_unknown_flag(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--foo", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: --foo");
        assert_int_equal(parse(&c, "--foo", "--bar=1", NULL), TSR_E_INVAL);
        assert_string_equal(err, "unrecognized arguments: --foo --bar=1");
        tsr_config_done(&c);
}

static void test_missing_value(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--port", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --port: expected one argument");
        assert_int_equal(parse(&c, "--host", "--port", "1", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --host: expected one argument");
        assert_int_equal(parse(&c, "--served-model-name", "--port", "1", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --served-model-name: expected at least one argument");
        assert_int_equal(parse(&c, "--config", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --config: expected one argument");
        tsr_config_done(&c);
}

static void test_invalid_int(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--port", "abc", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --port: invalid int value: 'abc'");
        assert_int_equal(parse(&c, "--port", "80x", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --port: invalid int value: '80x'");
        assert_int_equal(parse(&c, "--gpu-memory-utilization", "lots", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --gpu-memory-utilization: invalid float value: 'lots'");
        assert_int_equal(parse(&c, "--gpu-memory-utilization", "nan", NULL), TSR_E_INVAL);
        tsr_config_done(&c);
}

static void test_invalid_choice(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--block-size", "17", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --block-size: invalid choice: '17' (choose from 1, 8, 16, 32, 64, 128, 256)");
        assert_int_equal(parse(&c, "--dtype", "fp4", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --dtype: invalid choice: 'fp4' "
                                 "(choose from auto, half, float16, bfloat16, float, float32)");
        assert_int_equal(parse(&c, "--kv-cache-dtype", "fp8_e5m2", "--scheduling-policy", "priority",
                               "--load-format", "dummy", "--distributed-executor-backend", "uni",
                               "--prefix-caching-hash-algo", "xxhash", "--log-level", "debug",
                               "--block-size", "32", NULL), TSR_OK);
        assert_string_equal(c.kv_cache_dtype, "fp8_e5m2");
        assert_string_equal(c.scheduling_policy, "priority");
        assert_int_equal(parse(&c, "--mamba-ssm-cache-dtype", "float32", "--mamba-cache-dtype", "auto", NULL), TSR_OK);
        assert_string_equal(c.mamba_ssm_cache_dtype, "float32");
        assert_string_equal(c.mamba_cache_dtype, "auto");
        assert_int_equal(parse(&c, "--mamba-ssm-cache-dtype", "bfloat16", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --mamba-ssm-cache-dtype: invalid choice: 'bfloat16' "
                                 "(choose from auto, float32, float16)");
        assert_string_equal(c.load_format, "dummy");
        assert_string_equal(c.distributed_executor_backend, "uni");
        assert_string_equal(c.prefix_caching_hash_algo, "xxhash");
        assert_string_equal(c.log_level, "debug");
        assert_int_equal(c.block_size, 32);
        assert_int_equal(parse(&c, "--log-level", "verbose", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--distributed-executor-backend", "ray", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--routing-policy", "round_robin", NULL), TSR_OK);
        assert_string_equal(c.routing_policy, "round_robin");
        assert_int_equal(parse(&c, "--routing-policy", "random", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --routing-policy: invalid choice: 'random' "
                                 "(choose from kv, least_load, round_robin)");
        /* generation-config takes any directory besides its two words */
        assert_int_equal(parse(&c, "--generation-config", "/models/x", NULL), TSR_OK);
        assert_string_equal(c.generation_config, "/models/x");
        tsr_config_done(&c);
}

static void test_out_of_range(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--port", "70000", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --port: invalid value: '70000' (must be between 0 and 65535)");
        assert_int_equal(parse(&c, "--port", "-1", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "-tp", "0", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "argument --tensor-parallel-size: invalid value: '0'"));
        assert_int_equal(parse(&c, "--gpu-memory-utilization", "0", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "must be in (0, 1]"));
        assert_int_equal(parse(&c, "--gpu-memory-utilization", "1.01", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--gpu-memory-utilization", "1", NULL), TSR_OK);
        assert_int_equal(parse(&c, "--max-logprobs", "-2", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--stream-interval", "0", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--swap-space", "-1", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--max-num-seqs", "3000000000", NULL), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--router-threads", "0", NULL), TSR_E_INVAL);
        tsr_config_done(&c);
}

static void test_help_and_version(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        /* help wins even over a broken config file and bad flags */
        assert_int_equal(parse(&c, "--config", "/nonexistent.yaml", "--port", "x", "-h", NULL), TSR_OK);
        assert_true(c.help);
        tsr_config_done(&c);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--version", NULL), TSR_OK);
        assert_true(c.version);
        assert_false(c.help);
        tsr_config_done(&c);
}

static void test_config_twice(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--config", "a.yaml", "--config=b.yaml", NULL), TSR_E_INVAL);
        assert_string_equal(err, "argument --config: given more than once");
        tsr_config_done(&c);
}

/* ------------------------------------------------------------------ YAML -- */

static void test_yaml_precedence(void **state) {
        char *path = write_tmp(".yaml", "# a comment\n"
                                        "port: 9000\n"
                                        "block-size: 32\n"
                                        "tensor_parallel_size: 2\n"
                                        "model: /models/yaml\n"
                                        "served-model-name: [a, b]\n"
                                        "enforce-eager: true\n"
                                        "max-model-len: 8k\n");
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--config", path, "--port", "9100", "--served-model-name", "c", NULL), TSR_OK);
        assert_int_equal(c.port, 9100);                 /* CLI over YAML */
        assert_int_equal(c.block_size, 32);             /* YAML over default */
        assert_int_equal(c.tensor_parallel_size, 2);
        assert_int_equal(c.max_model_len, 8000);
        assert_string_equal(c.dtype, "auto");           /* default */
        assert_string_equal(c.model, "/models/yaml");
        assert_true(c.enforce_eager);
        assert_int_equal(c.served_model_name.n, 1);     /* CLI list replaces YAML list */
        assert_string_equal(c.served_model_name.items[0], "c");
        assert_string_equal(c.config_file, path);
        tsr_config_done(&c);

        /* positional model wins over `model:` */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/models/cli", "--config=" , NULL), TSR_E_INVAL);   /* empty name: not .yaml */
        tsr_config_done(&c);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/models/cli", "--config", path, NULL), TSR_OK);
        assert_string_equal(c.model, "/models/cli");
        assert_int_equal(c.served_model_name.n, 2);
        tsr_config_done(&c);
        drop_tmp(path);
}

static void test_yaml_load_direct(void **state) {
        char *path = write_tmp(".yml", "api-key: k1\n"
                                       "worker:\n  - tcp://a:1\n  - tcp://b:2\n"
                                       "gpu-memory-utilization: 0.75\n"
                                       "kv-cache-memory: 1GiB\n"
                                       "host: \"0.0.0.0\"\n"
                                       "seed: -3\n");
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(tsr_config_load_yaml(&c, path, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.api_key.items[0], "k1");
        assert_int_equal(c.worker.n, 2);
        assert_string_equal(c.worker.items[1], "tcp://b:2");
        assert_true(c.gpu_memory_utilization == 0.75);
        assert_int_equal(c.kv_cache_memory_bytes, 1LL << 30);
        assert_string_equal(c.host, "0.0.0.0");
        assert_int_equal(c.seed, -3);
        /* a second load replaces lists rather than appending to them */
        assert_int_equal(tsr_config_load_yaml(&c, path, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.worker.n, 2);
        tsr_config_done(&c);
        drop_tmp(path);
}

/* Run fn with stderr captured into buf. */
static tsr_status with_stderr(char *buf, size_t len, tsr_config *c, const char *path) {
        FILE *tmp = tmpfile();
        int saved;
        size_t n;
        tsr_status st;

        assert_non_null(tmp);
        fflush(stderr);
        saved = dup(2);
        assert_true(saved >= 0);
        assert_true(dup2(fileno(tmp), 2) >= 0);
        st = tsr_config_load_yaml(c, path, err, sizeof(err));
        fflush(stderr);
        assert_true(dup2(saved, 2) >= 0);
        close(saved);
        rewind(tmp);
        n = fread(buf, 1, len - 1, tmp);
        buf[n] = '\0';
        fclose(tmp);
        return st;
}

static void test_yaml_false_dropped(void **state) {
        char *path = write_tmp(".yaml", "enforce-eager: false\n"
                                        "enable-prefix-caching: false\n"
                                        "trust-remote-code: yes\n"
                                        "async-scheduling: off\n");
        char out[2048];
        tsr_config c;
        char **argv;

        tsr_config_init(&c);
        c.enforce_eager = true;         /* `false` must not turn it off (vLLM drops it) */
        assert_int_equal(with_stderr(out, sizeof(out), &c, path), TSR_OK);
        assert_true(c.enforce_eager);
        assert_int_equal(c.enable_prefix_caching, TSR_TRI_UNSET);
        assert_true(c.trust_remote_code);       /* PyYAML reads `yes` as true */
        assert_false(c.async_scheduling);
        assert_non_null(strstr(out, "no-enforce-eager: true"));
        assert_non_null(strstr(out, "no-enable-prefix-caching: true"));
        assert_non_null(strstr(out, path));
        /* dropped keys are not "set": nothing to hand to children */
        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_WORKER, &argv, NULL), TSR_OK);
        assert_false(argv_has(argv, "--no-enforce-eager"));
        assert_false(argv_has(argv, "--no-enable-prefix-caching"));
        assert_true(argv_has(argv, "--trust-remote-code"));
        tsr_config_free_argv(argv);
        tsr_config_done(&c);
        drop_tmp(path);
}

static void test_yaml_no_name_true(void **state) {
        char *path = write_tmp(".yaml", "no-enable-prefix-caching: true\n"
                                        "no_enable_chunked_prefill: true\n"
                                        "no-disable-log-stats: true\n");
        tsr_config c;
        char **argv;

        tsr_config_init(&c);
        c.disable_log_stats = true;
        assert_int_equal(tsr_config_load_yaml(&c, path, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.enable_prefix_caching, TSR_TRI_FALSE);
        assert_int_equal(c.enable_chunked_prefill, TSR_TRI_FALSE);
        assert_false(c.disable_log_stats);
        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_WORKER, &argv, NULL), TSR_OK);
        assert_true(argv_has(argv, "--no-enable-prefix-caching"));
        assert_true(argv_has(argv, "--no-enable-chunked-prefill"));
        assert_true(argv_has(argv, "--no-disable-log-stats"));
        tsr_config_free_argv(argv);
        tsr_config_done(&c);
        drop_tmp(path);
}

/* Load `text` as YAML and expect failure; err gets the message. */
static tsr_status yaml_fails(const char *text, char **ret_path) {
        char *path = write_tmp(".yaml", text);
        tsr_config c;
        tsr_status st;

        tsr_config_init(&c);
        err[0] = '\0';
        st = tsr_config_load_yaml(&c, path, err, sizeof(err));
        assert_int_not_equal(st, TSR_OK);
        assert_non_null(strstr(err, path));     /* every file error names the file */
        tsr_config_done(&c);
        if (ret_path)
                *ret_path = path;
        else
                drop_tmp(path);
        return st;
}

static void test_yaml_unknown_key(void **state) {
        char *path, want[600];

        assert_int_equal(yaml_fails("port: 1\ntensor-parallel-sise: 4\n", &path), TSR_E_INVAL);
        snprintf(want, sizeof(want), "%s: key 'tensor-parallel-sise': unknown option", path);
        assert_string_equal(err, want);
        drop_tmp(path);
        /* short aliases are not keys, as in vLLM */
        assert_int_equal(yaml_fails("tp: 2\n", NULL), TSR_E_INVAL);
        assert_non_null(strstr(err, "key 'tp': unknown option"));
}

static void test_yaml_bad_value(void **state) {
        char *path, want[600];

        assert_int_equal(yaml_fails("port: abc\n", &path), TSR_E_INVAL);
        snprintf(want, sizeof(want), "%s: key 'port': invalid int value: 'abc'", path);
        assert_string_equal(err, want);
        drop_tmp(path);
        yaml_fails("block-size: 17\n", NULL);
        assert_non_null(strstr(err, "key 'block-size': invalid choice: '17'"));
        yaml_fails("enforce-eager: maybe\n", NULL);
        assert_non_null(strstr(err, "key 'enforce-eager': expected true or false"));
        yaml_fails("enforce-eager: \"true\"\n", NULL);  /* quoted is a string, as in PyYAML */
        yaml_fails("port: [1, 2]\n", NULL);
        assert_non_null(strstr(err, "not a list"));
        yaml_fails("port:\n", NULL);
        assert_non_null(strstr(err, "key 'port': missing value"));
        yaml_fails("worker: [tcp://a:1, [nested]]\n", NULL);
        yaml_fails("config: other.yaml\n", NULL);
}

static void test_yaml_syntax_error(void **state) {
        char *path;

        assert_int_equal(yaml_fails("port: 1\nblock-size: [1, 2\n", &path), TSR_E_INVAL);
        assert_non_null(strstr(err, "line "));
        assert_non_null(strstr(err, "column "));
        drop_tmp(path);
        yaml_fails("a: b: c\n", NULL);
        assert_non_null(strstr(err, "line 1"));
}

static void test_yaml_odd_shapes(void **state) {
        char *path;
        tsr_config c;

        yaml_fails("", NULL);
        assert_non_null(strstr(err, "empty"));
        yaml_fails("# only a comment\n", NULL);
        yaml_fails("- a\n- b\n", NULL);
        assert_non_null(strstr(err, "mapping"));
        yaml_fails("just text\n", NULL);
        yaml_fails("override-generation-config:\n  temperature: 0.5\n", NULL);
        assert_non_null(strstr(err, "nested"));
        yaml_fails("? [a, b]\n: 1\n", NULL);
        yaml_fails("\xff\xfe\x00garbage", NULL);

        /* anchors and aliases are fine, and are never expanded recursively */
        path = write_tmp(".yaml", "port: &p 9001\nstream-interval: *p\nserved-model-name: &l [x, y]\n"
                                  "api-key: *l\n");
        tsr_config_init(&c);
        assert_int_equal(tsr_config_load_yaml(&c, path, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.port, 9001);
        assert_int_equal(c.stream_interval, 9001);
        assert_int_equal(c.api_key.n, 2);
        tsr_config_done(&c);
        drop_tmp(path);
        yaml_fails("a: &a [*a]\n", NULL);       /* self-referential alias: an error, not a crash */
}

static void test_yaml_files(void **state) {
        char *path = write_tmp(".txt", "port: 1\n");
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(tsr_config_load_yaml(&c, path, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, ".yaml or .yml"));
        assert_int_equal(c.port, 8000);
        drop_tmp(path);
        assert_int_equal(tsr_config_load_yaml(&c, "/nonexistent/x.yaml", err, sizeof(err)), TSR_E_NOTFOUND);
        assert_non_null(strstr(err, "/nonexistent/x.yaml"));
        assert_int_equal(parse(&c, "--config", "/nonexistent/x.yaml", NULL), TSR_E_NOTFOUND);
        tsr_config_done(&c);
}

/* ----------------------------------------------------------- validation -- */

static void test_validate(void **state) {
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--max-num-seqs", "64", "--max-num-batched-tokens", "32", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "--max-num-batched-tokens"));
        assert_int_equal(parse(&c, "--max-num-batched-tokens", "2k", "--max-model-len", "4k",
                               "--enable-chunked-prefill", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);

        assert_int_equal(parse(&c, "--status-listen", "tcp://127.0.0.1:8100", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(parse(&c, "--status-listen", "tcp://127.0.0.1:8101", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);

        /* --mamba-block-size: only with --enable-prefix-caching, a multiple of 8 and of the block */
        assert_int_equal(parse(&c, "--mamba-block-size", "64", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_string_equal(err, "argument --mamba-block-size: can only be set with --enable-prefix-caching");
        assert_int_equal(parse(&c, "--enable-prefix-caching", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
        assert_int_equal(parse(&c, "--mamba-block-size", "24", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_string_equal(err, "argument --mamba-block-size: 24 is not a multiple of 8 and of --block-size 16");
        c.mamba_block_size = 0;

        /* fields filled by hand are checked too */
        c.port = 70000;
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "argument --port"));
        c.port = 8000;
        c.gpu_memory_utilization = 0;
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        c.gpu_memory_utilization = 0.9;
        c.block_size = 12;
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "invalid choice"));
        c.block_size = 16;
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
        tsr_config_done(&c);
}

/* Values vLLM has but Tessera cannot honour yet: every process refuses them at start-up
 * (TSR_E_UNSUPPORTED; the binaries exit 2) with one line naming the flag, the value and
 * what works.  Each row: the arguments (up to 4), then the exact message. */
static void test_validate_refuses_unsupported(void **state) {
        static const struct {
                const char *args[4];
                const char *message;
        } rows[] = {
                {{"--data-parallel-size", "2"}, "argument --data-parallel-size: 2 is not supported: a worker is "
                                                "one replica; for data parallelism start more workers behind the "
                                                "router (supported: 1)"},
                {{"-dp", "4", "-pp", "2"}, "argument --data-parallel-size: 4 is not supported: a worker is one "
                                           "replica; for data parallelism start more workers behind the router "
                                           "(supported: 1)"},
                {{"--kv-cache-dtype", "fp8_inc"}, "argument --kv-cache-dtype: 'fp8_inc' is not supported yet: "
                                                  "the KV cache is float32, bfloat16, fp8 e4m3 or fp8 e5m2 "
                                                  "(supported: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"},
                {{"--kv-cache-dtype", "fp8_ds_mla"}, "argument --kv-cache-dtype: 'fp8_ds_mla' is not supported yet: "
                                                     "the KV cache is float32, bfloat16, fp8 e4m3 or fp8 e5m2 "
                                                     "(supported: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"},
                {{"--mamba-ssm-cache-dtype", "float16"}, "argument --mamba-ssm-cache-dtype: 'float16' is not "
                                                         "supported yet: the Mamba state is kept in float32 "
                                                         "(supported: auto, float32)"},
                {{"--mamba-cache-dtype", "float16"}, "argument --mamba-cache-dtype: 'float16' is not supported "
                                                     "yet: the Mamba state is kept in float32 (supported: auto, "
                                                     "float32)"},
                {{"--quantization", "gptq"}, "argument --quantization: 'gptq' is not supported (supported: "
                                             "modelopt, modelopt_fp4, fp8, or leave it unset to use the "
                                             "checkpoint's)"},
                {{"-q", "awq"}, "argument --quantization: 'awq' is not supported (supported: modelopt, "
                                "modelopt_fp4, fp8, or leave it unset to use the checkpoint's)"},
                {{"--load-format", "dummy"}, "argument --load-format: 'dummy' is not supported yet: weights are "
                                             "always read from the model files (supported: auto, safetensors, "
                                             "gguf)"},
                {{"/models/m", "--tokenizer", "/models/t"},
                 "argument --tokenizer: '/models/t' is not supported yet: the tokenizer is always the model's own "
                 "(supported: /models/m, or leave it unset)"},
                {{"--tokenizer", "/models/t"}, "argument --tokenizer: '/models/t' is not supported yet: the "
                                               "tokenizer is always the model's own (supported: the model's own "
                                               "path, or leave it unset)"},
                {{"--no-enable-chunked-prefill"}, "argument --no-enable-chunked-prefill: not supported yet: a "
                                                  "prompt longer than the step's token budget is always split "
                                                  "across steps (supported: --enable-chunked-prefill, the "
                                                  "default)"},
                {{"--max-num-partial-prefills", "2"}, "argument --max-num-partial-prefills: 2 is not supported "
                                                      "yet: concurrent partial prefills are not implemented "
                                                      "(supported: 1)"},
                {{"--stream-interval", "4"}, "argument --stream-interval: 4 is not supported yet: every token is "
                                             "streamed as soon as it is generated (supported: 1)"},
                {{"--root-path", "/api"}, "argument --root-path: '/api' is not supported yet: the routes are "
                                          "served from / only (supported: leave it unset)"},
                {{"--enable-request-id-headers"}, "argument --enable-request-id-headers: not supported yet: "
                                                  "responses carry no X-Request-Id header (supported: leave it "
                                                  "off)"},
                {{"--enable-server-load-tracking"}, "argument --enable-server-load-tracking: not supported yet: "
                                                    "there is no /load endpoint (supported: leave it off)"},
                {{"--enable-tokenizer-info-endpoint"}, "argument --enable-tokenizer-info-endpoint: not supported "
                                                       "yet: there is no /tokenizer_info endpoint (supported: "
                                                       "leave it off)"},
                {{"--calculate-kv-scales"}, "argument --calculate-kv-scales: not supported yet: the fp8 KV cache's "
                                            "scales are the checkpoint's k_scale / v_scale, else 1.0 (supported: "
                                            "leave it off)"},
        };
        tsr_config c;

        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                const char *const *a = rows[i].args;
                tsr_config_init(&c);
                assert_int_equal(parse(&c, a[0], a[1], a[2], a[3], NULL), TSR_OK);
                assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_UNSUPPORTED);
                if (strcmp(err, rows[i].message) != 0)
                        fail_msg("row %zu (%s)\n got: %s\nwant: %s", i, a[0], err, rows[i].message);
                tsr_config_done(&c);
        }

        /* The supported values of the same flags pass; a hand-set field is checked too. */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/tmp", "--tokenizer", "/tmp/", "--kv-cache-dtype", "auto", "-tp", "1",
                               "--max-num-partial-prefills", "1", "--stream-interval", "1", "--load-format",
                               "safetensors", "--enable-chunked-prefill", "--long-prefill-token-threshold", "64",
                               "--distributed-executor-backend", "mp", "--enforce-eager", "--swap-space", "0",
                               "--trust-remote-code", "--gpu-memory-utilization", "0.5", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
        c.stream_interval = 2;
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_UNSUPPORTED);
        assert_non_null(strstr(err, "argument --stream-interval: 2 "));
        tsr_config_done(&c);

        /* fp8 and fp8_e4m3 pass: the worker checks them against the model and the device
         * (tsr_runner_kv_dtype_check, test_family.c) */
        static const char *const fp8_names[] = {"fp8", "fp8_e4m3"};
        for (size_t i = 0; i < 2; i++) {
                tsr_config_init(&c);
                assert_int_equal(parse(&c, "--kv-cache-dtype", fp8_names[i], NULL), TSR_OK);
                assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
                tsr_config_done(&c);
        }

        /* -tp and -pp pass validation: the worker checks them against the model's heads and
         * layers once it has read its config (worker/main.c, test_parallel.c). */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "-tp", "2", "-pp", "3", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.tensor_parallel_size, 2);
        assert_int_equal(c.pipeline_parallel_size, 3);
        tsr_config_done(&c);
        /* the implemented --quantization methods pass here; the worker checks them against
         * the checkpoint (worker/load/modelopt.h) */
        const char *methods[] = {"modelopt", "modelopt_fp4", "fp8"};
        for (size_t i = 0; i < 3; i++) {
                tsr_config_init(&c);
                assert_int_equal(parse(&c, "-q", methods[i], NULL, NULL, NULL), TSR_OK);
                assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_OK);
                tsr_config_done(&c);
        }
}

/* --tool-call-parser / --reasoning-parser: the router's parsers pass, anything else
 * gets vLLM's message; --enable-auto-tool-choice needs a parser (issue #17). */
static void test_output_parsers(void **state) {
        tsr_config c;
        const char *ok[][4] = {
                {"--enable-auto-tool-choice", "--tool-call-parser", "hermes", NULL},
                {"--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", NULL},
                {"--enable-auto-tool-choice", "--tool-call-parser", "llama4_pythonic", NULL},
                {"--enable-auto-tool-choice", "--tool-call-parser", "pythonic", NULL},
                {"--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", NULL},
                {"--tool-call-parser", "hermes", NULL, NULL},
                {"--reasoning-parser", "deepseek_r1", NULL, NULL},
                {"--reasoning-parser", "nemotron_v3", NULL, NULL},
                {"--reasoning-parser", "nano_v3", NULL, NULL},
        };
        (void)state;
        for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                tsr_config_init(&c);
                assert_int_equal(parse(&c, ok[i][0], ok[i][1], ok[i][2], ok[i][3], NULL), TSR_OK);
                if (tsr_config_validate(&c, err, sizeof(err)) != TSR_OK)
                        fail_msg("row %zu: %s", i, err);
                tsr_config_done(&c);
        }
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--enable-auto-tool-choice", "--tool-call-parser", "mistral", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_string_equal(err, "invalid tool call parser: mistral (chose from { hermes,llama3_json,llama4_pythonic,"
                                 "pythonic,qwen3_coder })");
        tsr_config_done(&c);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--reasoning-parser", "qwen3", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_string_equal(err, "invalid reasoning parser: qwen3 (chose from { deepseek_r1,nemotron_v3,nano_v3 })");
        tsr_config_done(&c);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--enable-auto-tool-choice", NULL), TSR_OK);
        assert_int_equal(tsr_config_validate(&c, err, sizeof(err)), TSR_E_INVAL);
        assert_string_equal(err, "Error: --enable-auto-tool-choice requires --tool-call-parser");
        tsr_config_done(&c);
}

/* Accepted on purpose though they change nothing: one line each for the owner's log,
 * only when set to something other than the default. */
static void test_noop_notes(void **state) {
        const char *lines[16];
        tsr_config c;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--enforce-eager", "--swap-space", "4", "--gpu-memory-utilization", "0.9", NULL),
                         TSR_OK);
        /* --enforce-eager and --gpu-memory-utilization depend on the device: the worker
         * notes them once it has picked one (worker/main.c), not here. */
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_WORKER, lines, 16), 0);
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_ROUTER, lines, 16), 0);
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_ALL, lines, 16), 0);   /* defaults: nothing */
        assert_int_equal(parse(&c, "--enforce-eager", "--gpu-memory-utilization", "0.5", "--swap-space", "0",
                               "--trust-remote-code", "--distributed-executor-backend", "uni",
                               "--enable-log-requests", "--disable-uvicorn-access-log", NULL), TSR_OK);
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_WORKER, lines, 16), 3);
        assert_non_null(strstr(lines[0], "--swap-space has no effect by design"));
        assert_non_null(strstr(lines[1], "--trust-remote-code has no effect by design"));
        assert_non_null(strstr(lines[2], "--distributed-executor-backend has no effect by design"));
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_ROUTER, lines, 16), 2);
        assert_non_null(strstr(lines[0], "--enable-log-requests has no effect by design"));
        assert_non_null(strstr(lines[1], "--disable-uvicorn-access-log has no effect by design"));
        assert_int_equal(tsr_config_noop_notes(&c, TSR_OWNER_ALL, lines, 3), 3);     /* cap respected */
        tsr_config_done(&c);
}

/* --------------------------------------------------------------- api key -- */

static void test_api_key_env(void **state) {
        char *path = write_tmp(".yaml", "api-key: from-yaml\n");
        tsr_config c;
        char **argv;

        setenv("VLLM_API_KEY", "from-env", 1);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.api_key.items[0], "from-env");
        /* the env key is not put on a child's command line: children inherit the env */
        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_ROUTER, &argv, NULL), TSR_OK);
        assert_false(argv_has(argv, "from-env"));
        tsr_config_free_argv(argv);
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--api-key", "from-cli", NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.api_key.items[0], "from-cli");
        tsr_config_done(&c);

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--config", path, NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.api_key.items[0], "from-yaml");
        tsr_config_done(&c);

        /* TESSERA_API_KEY wins over VLLM_API_KEY */
        setenv("TESSERA_API_KEY", "ours", 1);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 1);
        assert_string_equal(c.api_key.items[0], "ours");
        tsr_config_done(&c);
        unsetenv("TESSERA_API_KEY");

        setenv("VLLM_API_KEY", "", 1);
        tsr_config_init(&c);
        assert_int_equal(parse(&c, NULL), TSR_OK);
        assert_int_equal(c.api_key.n, 0);
        tsr_config_done(&c);
        unsetenv("VLLM_API_KEY");
        drop_tmp(path);
}

/* ------------------------------------------------------------ child argv -- */

static void test_child_argv_owners(void **state) {
        tsr_config c;
        char **argv;
        int argc = -1;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "/models/m", "--port", "9000", "-tp", "2", "--block-size", "32",
                               "--served-model-name", "a", "b", "--log-level", "debug", "--enforce-eager",
                               "--max-request-body", "1M", NULL), TSR_OK);

        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_ROUTER, &argv, &argc), TSR_OK);
        assert_int_equal(argv[argc], NULL);
        assert_true(argv_has(argv, "--port"));
        assert_true(argv_has(argv, "9000"));
        assert_true(argv_has(argv, "--max-request-body"));
        assert_true(argv_has(argv, "1048576"));
        assert_true(argv_has(argv, "--served-model-name"));
        assert_true(argv_has(argv, "--log-level"));
        assert_false(argv_has(argv, "--tensor-parallel-size"));
        assert_false(argv_has(argv, "--block-size"));
        assert_false(argv_has(argv, "--enforce-eager"));
        assert_false(argv_has(argv, "/models/m"));
        assert_false(argv_has(argv, "--config"));
        assert_false(argv_has(argv, "--dtype"));        /* defaults are not passed */
        tsr_config_free_argv(argv);

        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_WORKER, &argv, &argc), TSR_OK);
        assert_string_equal(argv[0], "/models/m");
        assert_true(argc >= 1);
        assert_int_equal(argv[argc], NULL);
        assert_int_equal(argv_find(argv, "--block-size") + 1, argv_find(argv, "32"));
        assert_int_equal(argv_find(argv, "--tensor-parallel-size") + 1, argv_find(argv, "2"));
        assert_int_equal(argv_find(argv, "--served-model-name") + 2, argv_find(argv, "b"));
        assert_true(argv_has(argv, "--enforce-eager"));
        assert_true(argv_has(argv, "--log-level"));
        assert_false(argv_has(argv, "--port"));
        assert_false(argv_has(argv, "--max-request-body"));
        tsr_config_free_argv(argv);
        tsr_config_done(&c);

        /* nothing set: just the terminator */
        tsr_config_init(&c);
        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_ROUTER, &argv, &argc), TSR_OK);
        assert_int_equal(argc, 0);
        assert_null(argv[0]);
        tsr_config_free_argv(argv);
        tsr_config_free_argv(NULL);
        tsr_config_done(&c);
}

static void test_child_argv_no_config(void **state) {
        char *path = write_tmp(".yaml", "block-size: 64\nno-enable-prefix-caching: true\n");
        tsr_config c;
        char **argv;
        int argc;

        tsr_config_init(&c);
        assert_int_equal(parse(&c, "m", "--config", path, NULL), TSR_OK);
        assert_int_equal(tsr_config_child_argv(&c, TSR_OWNER_ALL, &argv, &argc), TSR_OK);
        assert_false(argv_has(argv, "--config"));
        assert_false(argv_has(argv, path));
        assert_true(argv_has(argv, "--block-size"));    /* merged YAML values do go */
        assert_true(argv_has(argv, "64"));
        assert_true(argv_has(argv, "--no-enable-prefix-caching"));
        tsr_config_free_argv(argv);
        tsr_config_done(&c);
        drop_tmp(path);
}

static void assert_same_config(const tsr_config *a, const tsr_config *b) {
        assert_string_equal(a->model, b->model);
        assert_int_equal(a->served_model_name.n, b->served_model_name.n);
        for (size_t i = 0; i < a->served_model_name.n; i++)
                assert_string_equal(a->served_model_name.items[i], b->served_model_name.items[i]);
        assert_int_equal(a->api_key.n, b->api_key.n);
        for (size_t i = 0; i < a->api_key.n; i++)
                assert_string_equal(a->api_key.items[i], b->api_key.items[i]);
        assert_int_equal(a->worker.n, b->worker.n);
        assert_int_equal(a->max_model_len, b->max_model_len);
        assert_string_equal(a->dtype, b->dtype);
        assert_string_equal(a->quantization, b->quantization);
        assert_int_equal(a->max_logprobs, b->max_logprobs);
        assert_true(a->seed == b->seed);
        assert_int_equal(a->enforce_eager, b->enforce_eager);
        assert_int_equal(a->tensor_parallel_size, b->tensor_parallel_size);
        assert_int_equal(a->block_size, b->block_size);
        assert_int_equal(a->enable_prefix_caching, b->enable_prefix_caching);
        assert_int_equal(a->enable_chunked_prefill, b->enable_chunked_prefill);
        assert_true(a->gpu_memory_utilization == b->gpu_memory_utilization);
        assert_true(a->swap_space == b->swap_space);
        assert_true(a->kv_cache_memory_bytes == b->kv_cache_memory_bytes);
        assert_true(a->max_request_body == b->max_request_body);
        assert_int_equal(a->port, b->port);
        assert_string_equal(a->host, b->host);
        assert_string_equal(a->chat_template, b->chat_template);
        assert_string_equal(a->log_level, b->log_level);
        assert_string_equal(a->override_generation_config, b->override_generation_config);
}

static void test_child_argv_round_trip(void **state) {
        tsr_config a, b;
        char **argv, **argv2, *full[MAX_ARGS + 2];
        int argc, argc2;

        tsr_config_init(&a);
        assert_int_equal(parse(&a, "/models/m", "--max-model-len", "4K", "--dtype", "half", "-q", "awq",
                               "--max-logprobs", "-1", "--seed", "-42", "--enforce-eager", "-tp", "2",
                               "--block-size", "8", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                               "--gpu-memory-utilization", "0.3", "--swap-space", "1.25",
                               "--kv-cache-memory", "3G", "--max-request-body", "5MiB", "--port", "0",
                               "--host", "::1", "--chat-template={{ x }}", "--log-level", "warning",
                               "--api-key", "k1", "--api-key=-dashy", "--worker", "tcp://a:1",
                               "--override-generation-config", "{\"temperature\": 0.5}",
                               "--served-model-name", "x", "y", "--no-trust-remote-code", NULL), TSR_OK);
        assert_int_equal(tsr_config_child_argv(&a, TSR_OWNER_ALL, &argv, &argc), TSR_OK);
        assert_true(argc <= MAX_ARGS);
        full[0] = (char *)"tessera-worker";
        for (int i = 0; i <= argc; i++)
                full[i + 1] = argv[i];

        tsr_config_init(&b);
        assert_int_equal(tsr_config_parse(&b, argc + 1, full, true, err, sizeof(err)), TSR_OK);
        assert_same_config(&a, &b);
        assert_string_equal(b.api_key.items[1], "-dashy");
        assert_false(b.trust_remote_code);
        /* and rendering again gives the very same argv */
        assert_int_equal(tsr_config_child_argv(&b, TSR_OWNER_ALL, &argv2, &argc2), TSR_OK);
        assert_int_equal(argc, argc2);
        for (int i = 0; i < argc; i++)
                assert_string_equal(argv[i], argv2[i]);
        tsr_config_free_argv(argv);
        tsr_config_free_argv(argv2);
        tsr_config_done(&a);
        tsr_config_done(&b);
}

/* ------------------------------------------------------------------ help -- */

static const char *const router_flags[] = {
        "--host", "--port", "--api-key", "--chat-template", "--response-role", "--served-model-name",
        "--worker", "--max-request-body", "--router-threads", "--log-level", "--config", "--stream-interval",
        "--enable-log-requests", "--disable-log-requests", "--disable-log-stats", "--root-path",
        "--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-request-id-headers",
        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint", "--enable-auto-tool-choice",
        "--tool-call-parser", "--reasoning-parser", "--show-hidden-metrics-for-version",
        "--disable-uvicorn-access-log", "--prefix-caching-hash-algo", NULL,
};

static const char *const worker_flags[] = {
        "--model", "--served-model-name", "--tokenizer", "--max-model-len", "--dtype", "--kv-cache-dtype",
        "--quantization", "-q", "--load-format", "--generation-config", "--override-generation-config",
        "--max-logprobs", "--seed", "--trust-remote-code", "--enforce-eager", "--tensor-parallel-size", "-tp",
        "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--distributed-executor-backend",
        "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching", "--prefix-caching-hash-algo",
        "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-cache-memory", "--num-gpu-blocks-override",
        "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--max-num-partial-prefills",
        "--long-prefill-token-threshold", "--scheduling-policy", "--async-scheduling", "--swap-space",
        "--cpu-threads", "--listen", "--status-listen", "--status-interval-ms", "--log-level", "--config",
        "--disable-log-stats", NULL,
};

static char *help_text(unsigned mask) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);

        assert_non_null(f);
        tsr_config_print_help(f, "usage: tessera-x [options]", mask);
        fclose(f);
        return buf;
}

static void test_help_router(void **state) {
        char *h = help_text(TSR_OWNER_ROUTER);

        assert_true(strncmp(h, "usage: tessera-x [options]\n", 27) == 0);
        for (size_t i = 0; router_flags[i]; i++) {
                if (!strstr(h, router_flags[i]))
                        fail_msg("router help lacks %s", router_flags[i]);
        }
        assert_non_null(strstr(h, "(default: 8000)"));
        assert_non_null(strstr(h, "--help"));
        assert_null(strstr(h, "--tensor-parallel-size"));
        assert_null(strstr(h, "--block-size"));
        free(h);
}

static void test_help_worker(void **state) {
        char *h = help_text(TSR_OWNER_WORKER);

        for (size_t i = 0; worker_flags[i]; i++) {
                if (!strstr(h, worker_flags[i]))
                        fail_msg("worker help lacks %s", worker_flags[i]);
        }
        assert_non_null(strstr(h, "KV cache block size in tokens (default: 16; choices: 1, 8, 16, 32, 64, 128, 256)"));
        assert_non_null(strstr(h, "(default: 0.9)"));
        assert_non_null(strstr(h, "(default: tcp://127.0.0.1:8100)"));
        assert_null(strstr(h, "--port"));
        assert_null(strstr(h, "--api-key"));
        free(h);
}

static void test_help_all(void **state) {
        char *h = help_text(TSR_OWNER_ALL);

        for (size_t i = 0; router_flags[i]; i++)
                assert_non_null(strstr(h, router_flags[i]));
        for (size_t i = 0; worker_flags[i]; i++)
                assert_non_null(strstr(h, worker_flags[i]));
        assert_non_null(strstr(h, "(default: 32MiB)"));
        free(h);
}

/* ---------------------------------------------------------------- memory -- */

static void test_done_after_failure(void **state) {
        char *path = write_tmp(".yaml", "served-model-name: [a, b]\nchat-template: t\nport: nope\n");
        tsr_config c;

        /* fail midway through YAML, with heap values already stored */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--config", path, NULL), TSR_E_INVAL);
        assert_int_equal(c.served_model_name.n, 2);
        tsr_config_done(&c);

        /* fail midway through the command line */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "m", "--worker", "a", "b", "--dtype", "bfloat16", "--port", "x", NULL),
                         TSR_E_INVAL);
        assert_string_equal(c.dtype, "bfloat16");
        tsr_config_done(&c);

        /* init again after done, reparse */
        tsr_config_init(&c);
        assert_int_equal(parse(&c, "--dtype", "half", "--dtype", "float", NULL), TSR_OK);
        assert_string_equal(c.dtype, "float");
        tsr_config_done(&c);
        drop_tmp(path);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_defaults),
                cmocka_unit_test(test_empty_argv),
                cmocka_unit_test(test_value_types),
                cmocka_unit_test(test_seed_long_long),
                cmocka_unit_test(test_equals_form),
                cmocka_unit_test(test_underscores),
                cmocka_unit_test(test_short_aliases),
                cmocka_unit_test(test_bools),
                cmocka_unit_test(test_tristate),
                cmocka_unit_test(test_list_values),
                cmocka_unit_test(test_list_then_positional_after_equals),
                cmocka_unit_test(test_parse_size),
                cmocka_unit_test(test_max_model_len_suffix),
                cmocka_unit_test(test_kv_cache_memory_alias),
                cmocka_unit_test(test_model_positional_and_flag),
                cmocka_unit_test(test_second_positional),
                cmocka_unit_test(test_router_rejects_positional),
                cmocka_unit_test(test_unknown_flag),
                cmocka_unit_test(test_missing_value),
                cmocka_unit_test(test_invalid_int),
                cmocka_unit_test(test_invalid_choice),
                cmocka_unit_test(test_out_of_range),
                cmocka_unit_test(test_help_and_version),
                cmocka_unit_test(test_config_twice),
                cmocka_unit_test(test_yaml_precedence),
                cmocka_unit_test(test_yaml_load_direct),
                cmocka_unit_test(test_yaml_false_dropped),
                cmocka_unit_test(test_yaml_no_name_true),
                cmocka_unit_test(test_yaml_unknown_key),
                cmocka_unit_test(test_yaml_bad_value),
                cmocka_unit_test(test_yaml_syntax_error),
                cmocka_unit_test(test_yaml_odd_shapes),
                cmocka_unit_test(test_yaml_files),
                cmocka_unit_test(test_validate),
                cmocka_unit_test(test_validate_refuses_unsupported),
                cmocka_unit_test(test_output_parsers),
                cmocka_unit_test(test_noop_notes),
                cmocka_unit_test(test_api_key_env),
                cmocka_unit_test(test_child_argv_owners),
                cmocka_unit_test(test_child_argv_no_config),
                cmocka_unit_test(test_child_argv_round_trip),
                cmocka_unit_test(test_help_router),
                cmocka_unit_test(test_help_worker),
                cmocka_unit_test(test_help_all),
                cmocka_unit_test(test_done_after_failure),
        };

        /* the env must not leak a key into tests that expect none */
        unsetenv("VLLM_API_KEY");
        return cmocka_run_group_tests(tests, NULL, NULL);
}
