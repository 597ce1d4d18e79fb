/* tessera-bench: `tessera bench serve [vllm bench serve flags]`.
 *
 * A C drop-in for `vllm bench serve` (vllm 0.33.0, vllm/benchmarks/serve.py): build the
 * random dataset, send streamed /v1/completions or /v1/chat/completions requests at the
 * configured rate and concurrency, time every chunk, and print vLLM's result block and
 * (--save-result) its JSON.  The definitions live in bench_core.c; this file is the
 * command line, the tokenizer (local common/tokenizer, or the server's /tokenize and
 * /detokenize) and the HTTP client.
 *
 * One thread.  The HTTP client is libcurl's multi interface: every request is an easy
 * handle; the write callback runs inside curl_multi_perform on this thread, and is where
 * chunks are timestamped (as vLLM's aiohttp loop timestamps each chunk as it reads it).
 * Arrivals are precomputed offsets; the loop sleeps in curl_multi_poll until the next
 * arrival or socket event.  A multi_turn turn that arrives before its session's previous
 * turn has finished is parked until it has (a user waits for the answer), and is then
 * sent with that turn's real answer in its history: one prompt for the completions
 * backends (resend_prompt), alternating user and assistant messages for openai-chat
 * (chat_messages).
 * --max-concurrency holds arrived requests in a FIFO until a slot frees, the
 * asyncio.Semaphore of vLLM; the wait is the client queue time. */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench_core.h"
#include "common/tokenizer.h"
#include "worker/load/model_meta.h"

#define EXIT_BAD_FLAGS 2
#define PROG "tessera bench serve"

/* ------------------------------------------------------------------ flags */

typedef struct bench_args {
        const char *host, *base_url, *endpoint, *backend, *model, *served_model_name, *tokenizer;
        const char *dataset_name, *range_ratio, *percentile_metrics, *metric_percentiles;
        const char *result_filename, *result_dir, *label, *request_id_prefix, *extra_body;
        long long port, input_len, output_len, prefix_len, num_prompts, max_concurrency, num_warmups, seed;
        long long ready_check_timeout_sec, logprobs;
        /* --dataset-name prefix_repetition (vLLM's names) and multi_turn (ours) */
        long long prep_prefix_len, prep_suffix_len, prep_num_prefixes, prep_output_len;
        long long mt_turns, mt_user_len, mt_session_prefix_len;
        bool mt_dataset_replies;        /* resend the dataset's stand-in replies, not the answers */
        double request_rate, burstiness;
        bool ignore_eos, save_result, save_detailed, append_result, disable_tqdm, help;
        /* sampling parameters: NULL = not given (not sent) */
        const char *temperature, *top_p, *top_k, *min_p, *frequency_penalty, *presence_penalty, *repetition_penalty;
        char **goodput, **metadata, **header;
        size_t n_goodput, n_metadata, n_header;
} bench_args;

enum flag_kind { F_STR, F_INT, F_FLOAT, F_BOOL, F_LIST, F_NUMSTR };

typedef struct flag_def {
        const char *name;
        enum flag_kind kind;
        size_t off;              /* into bench_args */
        size_t count_off;        /* F_LIST: the size_t count */
} flag_def;

#define A(f) offsetof(bench_args, f)
static const flag_def FLAGS[] = {
        {"--host", F_STR, A(host), 0},
        {"--port", F_INT, A(port), 0},
        {"--base-url", F_STR, A(base_url), 0},
        {"--endpoint", F_STR, A(endpoint), 0},
        {"--backend", F_STR, A(backend), 0},
        {"--model", F_STR, A(model), 0},
        {"--served-model-name", F_STR, A(served_model_name), 0},
        {"--tokenizer", F_STR, A(tokenizer), 0},
        {"--dataset-name", F_STR, A(dataset_name), 0},
        {"--random-input-len", F_INT, A(input_len), 0},
        {"--input-len", F_INT, A(input_len), 0},
        {"--random-output-len", F_INT, A(output_len), 0},
        {"--output-len", F_INT, A(output_len), 0},
        {"--random-range-ratio", F_STR, A(range_ratio), 0},
        {"--random-prefix-len", F_INT, A(prefix_len), 0},
        {"--prefix-repetition-prefix-len", F_INT, A(prep_prefix_len), 0},
        {"--prefix-repetition-suffix-len", F_INT, A(prep_suffix_len), 0},
        {"--prefix-repetition-num-prefixes", F_INT, A(prep_num_prefixes), 0},
        {"--prefix-repetition-output-len", F_INT, A(prep_output_len), 0},
        {"--multi-turn-turns", F_INT, A(mt_turns), 0},
        {"--multi-turn-user-len", F_INT, A(mt_user_len), 0},
        {"--multi-turn-session-prefix-len", F_INT, A(mt_session_prefix_len), 0},
        {"--multi-turn-dataset-replies", F_BOOL, A(mt_dataset_replies), 0},
        {"--num-prompts", F_INT, A(num_prompts), 0},
        {"--max-concurrency", F_INT, A(max_concurrency), 0},
        {"--request-rate", F_FLOAT, A(request_rate), 0},
        {"--burstiness", F_FLOAT, A(burstiness), 0},
        {"--num-warmups", F_INT, A(num_warmups), 0},
        {"--ignore-eos", F_BOOL, A(ignore_eos), 0},
        {"--seed", F_INT, A(seed), 0},
        {"--percentile-metrics", F_STR, A(percentile_metrics), 0},
        {"--metric-percentiles", F_STR, A(metric_percentiles), 0},
        {"--goodput", F_LIST, A(goodput), A(n_goodput)},
        {"--save-result", F_BOOL, A(save_result), 0},
        {"--save-detailed", F_BOOL, A(save_detailed), 0},
        {"--append-result", F_BOOL, A(append_result), 0},
        {"--metadata", F_LIST, A(metadata), A(n_metadata)},
        {"--result-dir", F_STR, A(result_dir), 0},
        {"--result-filename", F_STR, A(result_filename), 0},
        {"--label", F_STR, A(label), 0},
        {"--disable-tqdm", F_BOOL, A(disable_tqdm), 0},
        {"--request-id-prefix", F_STR, A(request_id_prefix), 0},
        {"--ready-check-timeout-sec", F_INT, A(ready_check_timeout_sec), 0},
        {"--logprobs", F_INT, A(logprobs), 0},
        {"--extra-body", F_STR, A(extra_body), 0},
        {"--header", F_LIST, A(header), A(n_header)},
        {"--temperature", F_NUMSTR, A(temperature), 0},
        {"--top-p", F_NUMSTR, A(top_p), 0},
        {"--top-k", F_NUMSTR, A(top_k), 0},
        {"--min-p", F_NUMSTR, A(min_p), 0},
        {"--frequency-penalty", F_NUMSTR, A(frequency_penalty), 0},
        {"--presence-penalty", F_NUMSTR, A(presence_penalty), 0},
        {"--repetition-penalty", F_NUMSTR, A(repetition_penalty), 0},
        {"--help", F_BOOL, A(help), 0},
};
#undef A

/* vLLM flags this client knows but does not implement: a clear refusal rather than
 * "unrecognized". */
static const char *const UNSUPPORTED[] = {
        "--dataset-path", "--tokenizer-mode", "--use-beam-search", "--probe-request-rate", "--profile",
        "--self-timed", "--no-self-timed", "--lora-modules", "--lora-assignment", "--ramp-up-strategy",
        "--ramp-up-start-rps", "--ramp-up-end-rps", "--chat-template-kwargs", "--skip-tokenizer-init",
        "--trust-remote-code", "--no-oversample", "--skip-chat-template", "--disable-shuffle",
        "--random-batch-size", "--plot-timeline", "--plot-dataset-stats", "--timeline-itl-thresholds",
        "--insecure", NULL,
};

static void usage(FILE *out) {
        fprintf(out,
                "usage: tessera bench serve [--backend openai|vllm|openai-chat] [--base-url URL | --host H --port P]\n"
                "                           [--endpoint PATH] [--model NAME] [--tokenizer PATH]\n"
                "                           [--dataset-name random|prefix_repetition|multi_turn]\n"
                "                           [--random-input-len N] [--random-output-len N]\n"
                "                           [--random-range-ratio R] [--random-prefix-len N] [--num-prompts N]\n"
                "                           [--prefix-repetition-prefix-len N] [--prefix-repetition-suffix-len N]\n"
                "                           [--prefix-repetition-num-prefixes N] [--prefix-repetition-output-len N]\n"
                "                           [--multi-turn-turns N] [--multi-turn-user-len N]\n"
                "                           [--multi-turn-session-prefix-len N] [--multi-turn-dataset-replies]\n"
                "                           [--request-rate RPS|inf] [--burstiness B] [--max-concurrency N]\n"
                "                           [--num-warmups N] [--ignore-eos] [--seed N]\n"
                "                           [--percentile-metrics ttft,tpot,itl,e2el] [--metric-percentiles 99]\n"
                "                           [--goodput KEY:MS ...] [--save-result] [--save-detailed] [--append-result]\n"
                "                           [--result-dir DIR] [--result-filename NAME] [--label L] [--metadata K=V ...]\n"
                "                           [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--extra-body JSON]\n"
                "                           [--header K=V ...] [--request-id-prefix P] [--ready-check-timeout-sec S]\n"
                "                           [--disable-tqdm]\n"
                "The flags are vllm bench serve's (vllm 0.33); see docs/benchmarks.md.\n");
}

static int flag_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int flag_error(const char *fmt, ...) {
        va_list ap;
        usage(stderr);
        fprintf(stderr, PROG ": error: ");
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
        return EXIT_BAD_FLAGS;
}

static bool parse_ll(const char *s, long long *v) {
        char *end;
        errno = 0;
        *v = strtoll(s, &end, 10);
        return *s && !*end && errno == 0;
}

static bool parse_double(const char *s, double *v) {
        char *end;
        errno = 0;
        *v = strtod(s, &end);
        return *s && !*end && errno == 0 && !isnan(*v);
}

/* argparse-like: --flag VALUE or --flag=VALUE; '_' in a flag name reads as '-' (vLLM's
 * FlexibleArgumentParser); list flags take every following word up to the next flag. */
static int parse_args(int argc, char **argv, bench_args *a) {
        for (int i = 0; i < argc; i++) {
                char name[128];
                const char *arg = argv[i], *eq = strchr(arg, '='), *value = NULL;
                if (strncmp(arg, "--", 2) != 0)
                        return flag_error("unrecognized arguments: %s", arg);
                size_t nl = eq ? (size_t)(eq - arg) : strlen(arg);
                if (nl >= sizeof(name))
                        return flag_error("unrecognized arguments: %s", arg);
                memcpy(name, arg, nl);
                name[nl] = '\0';
                for (char *p = name + 2; *p; p++)
                        if (*p == '_')
                                *p = '-';
                const flag_def *f = NULL;
                for (size_t k = 0; k < sizeof(FLAGS) / sizeof(FLAGS[0]); k++)
                        if (strcmp(FLAGS[k].name, name) == 0)
                                f = &FLAGS[k];
                if (!f) {
                        for (const char *const *u = UNSUPPORTED; *u; u++)
                                if (strcmp(*u, name) == 0)
                                        return flag_error("%s (a vllm bench serve flag) is not supported by "
                                                          "tessera bench serve", name);
                        return flag_error("unrecognized arguments: %s", arg);
                }
                char *base = (char *)a + f->off;
                if (f->kind == F_BOOL) {
                        if (eq)
                                return flag_error("argument %s: ignored explicit argument '%s'", name, eq + 1);
                        *(bool *)base = true;
                        continue;
                }
                if (f->kind == F_LIST) {
                        char ***list = (char ***)base;
                        size_t *count = (size_t *)((char *)a + f->count_off);
                        int first = eq ? i : i + 1, last = first;
                        while (last + 1 < argc && strncmp(argv[last + 1], "--", 2) != 0)
                                last++;
                        if (!eq && first >= argc)
                                return flag_error("argument %s: expected at least one argument", name);
                        for (int k = first; k <= last && k < argc; k++) {
                                char **g = realloc(*list, (*count + 1) * sizeof(*g));
                                if (!g)
                                        return flag_error("out of memory");
                                *list = g;
                                g[(*count)++] = (k == i) ? (char *)eq + 1 : argv[k];
                        }
                        i = last < argc ? last : argc - 1;
                        continue;
                }
                if (eq) {
                        value = eq + 1;
                } else {
                        if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
                                return flag_error("argument %s: expected one argument", name);
                        value = argv[++i];
                }
                switch (f->kind) {
                case F_STR:
                        *(const char **)base = value;
                        break;
                case F_INT:
                        if (!parse_ll(value, (long long *)base))
                                return flag_error("argument %s: invalid int value: '%s'", name, value);
                        break;
                case F_FLOAT:
                        if (!parse_double(value, (double *)base))
                                return flag_error("argument %s: invalid float value: '%s'", name, value);
                        break;
                case F_NUMSTR: {
                        double d;
                        if (!parse_double(value, &d))
                                return flag_error("argument %s: invalid float value: '%s'", name, value);
                        *(const char **)base = value;
                        break;
                }
                default:
                        break;
                }
        }
        return 0;
}

/* ------------------------------------------------------------------ clock, misc */

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void msleep(long ms) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ blocking HTTP */

static size_t collect_cb(char *p, size_t size, size_t nm, void *ud) {
        return tsr_buf_append(ud, p, size * nm) == TSR_OK ? size * nm : 0;
}

/* One blocking request (GET when body is NULL).  *status = HTTP status, 0 when the
 * connection failed (err says why). */
static tsr_status http_simple(const char *url, const char *body, long *status, tsr_buf *resp, char *err,
                              size_t errlen) {
        CURL *c = curl_easy_init();
        struct curl_slist *h = NULL;
        char cerr[CURL_ERROR_SIZE] = "";
        if (!c)
                return TSR_E_NOMEM;
        h = curl_slist_append(h, "Content-Type: application/json");
        h = curl_slist_append(h, "Expect:");
        curl_easy_setopt(c, CURLOPT_URL, url);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect_cb);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, resp);
        curl_easy_setopt(c, CURLOPT_ERRORBUFFER, cerr);
        curl_easy_setopt(c, CURLOPT_TIMEOUT, 600L);
        curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
        if (body)
                curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        CURLcode rc = curl_easy_perform(c);
        *status = 0;
        if (rc == CURLE_OK)
                curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
        else
                tsr_errf(err, errlen, "%s: %s", url, cerr[0] ? cerr : curl_easy_strerror(rc));
        curl_slist_free_all(h);
        curl_easy_cleanup(c);
        return rc == CURLE_OK ? TSR_OK : TSR_E_IO;
}

/* ------------------------------------------------------------------ tokenizers */

static tsr_status local_encode(void *ud, const char *text, size_t len, uint32_t **ids, size_t *n) {
        return tsr_tokenizer_encode(ud, text, len, false, ids, n);
}

static tsr_status local_decode(void *ud, const uint32_t *ids, size_t n, char **text, size_t *len) {
        return tsr_tokenizer_decode(ud, ids, n, false, text, len);
}

static bool local_is_special(void *ud, uint32_t id) {
        return tsr_tokenizer_is_special(ud, id);
}

static uint8_t *slurp(const char *path, size_t *len) {
        FILE *f = fopen(path, "rb");
        uint8_t *buf = NULL;
        long size;
        if (!f)
                return NULL;
        if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
            (buf = malloc((size_t)size + 1)) && fread(buf, 1, (size_t)size, f) == (size_t)size) {
                buf[size] = '\0';
                *len = (size_t)size;
        } else {
                free(buf);
                buf = NULL;
        }
        fclose(f);
        return buf;
}

/* --tokenizer PATH: a tokenizer.json, a folder holding one (tokenizer_config.json beside
 * it is read too), or a .gguf file (its tokenizer.ggml.* metadata). */
static tsr_status load_local_tokenizer(const char *path, tsr_tokenizer **tok, char *err, size_t errlen) {
        struct stat sb;
        char json_path[4096], cfg_path[4096];
        size_t plen = strlen(path);
        if (stat(path, &sb) != 0) {
                tsr_errf(err, errlen, "--tokenizer %s: %s", path, strerror(errno));
                return TSR_E_NOTFOUND;
        }
        if (!S_ISDIR(sb.st_mode) && plen > 5 && strcmp(path + plen - 5, ".gguf") == 0) {
                tsr_model_meta *m = NULL;
                tsr_status st = tsr_model_meta_load(path, &m, err, errlen);
                if (st != TSR_OK)
                        return st;
                st = tsr_model_meta_tokenizer(m, tok, err, errlen);
                tsr_model_meta_free(&m);
                return st;
        }
        if (S_ISDIR(sb.st_mode)) {
                snprintf(json_path, sizeof(json_path), "%s/tokenizer.json", path);
                snprintf(cfg_path, sizeof(cfg_path), "%s/tokenizer_config.json", path);
        } else {
                const char *slash = strrchr(path, '/');
                snprintf(json_path, sizeof(json_path), "%s", path);
                snprintf(cfg_path, sizeof(cfg_path), "%.*stokenizer_config.json",
                         slash ? (int)(slash - path + 1) : 0, path);
        }
        size_t jl = 0, cl = 0;
        uint8_t *j = slurp(json_path, &jl), *c = slurp(cfg_path, &cl);
        if (!j) {
                free(c);
                tsr_errf(err, errlen, "--tokenizer %s: cannot read %s (give a tokenizer.json, a folder holding "
                                      "one, or a .gguf file)", path, json_path);
                return TSR_E_NOTFOUND;
        }
        tsr_status st = tsr_tokenizer_new_json(j, jl, c, cl, tok, err, errlen);
        if (st != TSR_OK && c && strstr(err, "tokenizer_config.json")) {
                /* e.g. transformers' model_max_length sentinel (1e30 written as an
                 * integer) is past what jansson reads: the tokenizer itself is fine. */
                fprintf(stderr, "WARNING: %s: %s; loading the tokenizer without it\n", cfg_path, err);
                st = tsr_tokenizer_new_json(j, jl, NULL, 0, tok, err, errlen);
        }
        free(j);
        free(c);
        return st;
}

/* The server's tokenizer, through vLLM's POST /tokenize and /detokenize. */
typedef struct server_tok {
        char tokenize_url[2112], detokenize_url[2112];
        const char *model;
        char err[512];
} server_tok;

static tsr_status server_call(const char *url, json_t *req, json_t **resp, char *err, size_t errlen) {
        char *body = json_dumps(req, JSON_COMPACT);
        tsr_buf out;
        long status;
        tsr_status st;
        tsr_buf_init(&out, (size_t)1 << 30);
        json_decref(req);
        if (!body)
                return TSR_E_NOMEM;
        st = http_simple(url, body, &status, &out, err, errlen);
        free(body);
        if (st == TSR_OK && status != 200) {
                tsr_errf(err, errlen, "%s: HTTP %ld: %.*s", url, status, (int)(out.len > 300 ? 300 : out.len),
                         out.data ? (const char *)out.data : "");
                st = status == 400 ? TSR_E_INVAL : TSR_E_IO;
        }
        if (st == TSR_OK) {
                *resp = json_loadb((const char *)out.data, out.len, JSON_ALLOW_NUL, NULL);
                if (!*resp) {
                        tsr_errf(err, errlen, "%s: the reply is not JSON", url);
                        st = TSR_E_PROTO;
                }
        }
        tsr_buf_done(&out);
        return st;
}

static tsr_status server_tokenize(server_tok *s, const char *text, size_t len, bool add_special, uint32_t **ids,
                                  size_t *n) {
        json_t *resp = NULL;
        tsr_status st = server_call(s->tokenize_url,
                                    json_pack("{s:s, s:s%, s:b}", "model", s->model, "prompt", text, len,
                                              "add_special_tokens", add_special),
                                    &resp, s->err, sizeof(s->err));
        if (st != TSR_OK)
                return st;
        json_t *tokens = json_object_get(resp, "tokens");
        *n = json_array_size(tokens);
        *ids = malloc((*n ? *n : 1) * sizeof(**ids));
        if (!*ids) {
                json_decref(resp);
                return TSR_E_NOMEM;
        }
        for (size_t i = 0; i < *n; i++)
                (*ids)[i] = (uint32_t)json_integer_value(json_array_get(tokens, i));
        json_decref(resp);
        return TSR_OK;
}

static tsr_status server_encode(void *ud, const char *text, size_t len, uint32_t **ids, size_t *n) {
        return server_tokenize(ud, text, len, false, ids, n);
}

static tsr_status server_decode(void *ud, const uint32_t *ids, size_t n, char **text, size_t *len) {
        server_tok *s = ud;
        json_t *arr = json_array(), *resp = NULL;
        for (size_t i = 0; i < n; i++)
                json_array_append_new(arr, json_integer(ids[i]));
        tsr_status st = server_call(s->detokenize_url, json_pack("{s:s, s:o}", "model", s->model, "tokens", arr),
                                    &resp, s->err, sizeof(s->err));
        if (st != TSR_OK)
                return st;
        json_t *p = json_object_get(resp, "prompt");
        *len = json_string_length(p);
        *text = strndup(json_is_string(p) ? json_string_value(p) : "", *len);
        json_decref(resp);
        return *text ? TSR_OK : TSR_E_NOMEM;
}

/* The vocabulary size the server's tokenizer has: the first id /detokenize rejects
 * (binary search; ~22 requests). */
static tsr_status server_vocab_size(server_tok *s, size_t *vocab) {
        size_t lo = 1, hi = (size_t)1 << 22;   /* lo decodes, hi does not */
        char *text;
        size_t len;
        uint32_t id = 0;
        tsr_status st = server_decode(s, &id, 1, &text, &len);
        if (st != TSR_OK)
                return st;
        free(text);
        while (hi - lo > 1) {
                size_t mid = lo + (hi - lo) / 2;
                id = (uint32_t)mid;
                st = server_decode(s, &id, 1, &text, &len);
                if (st == TSR_OK) {
                        free(text);
                        lo = mid + 1;
                        if (lo == hi)
                                break;
                } else if (st == TSR_E_INVAL) {
                        hi = mid;
                } else {
                        return st;
                }
        }
        /* lo is now the smallest id not known to decode; check it. */
        id = (uint32_t)lo;
        st = server_decode(s, &id, 1, &text, &len);
        if (st == TSR_OK) {
                free(text);
                lo++;
        } else if (st != TSR_E_INVAL) {
                return st;
        }
        *vocab = lo;
        return TSR_OK;
}

typedef struct count_ctx {
        const tsr_bench_tok *tok;
} count_ctx;

static int64_t count_tokens(void *ud, const char *text, size_t len) {
        const tsr_bench_tok *t = ((count_ctx *)ud)->tok;
        uint32_t *ids = NULL;
        size_t n = 0;
        if (t->encode(t->ud, text, len, &ids, &n) != TSR_OK)
                return -1;
        free(ids);
        return (int64_t)n;
}

/* ------------------------------------------------------------------ progress bar */

typedef struct pbar {
        bool on;
        size_t total, n;
        double start;
} pbar;

static void fmt_secs(double s, char *out, size_t n) {
        long t = (long)(s + 0.5);
        if (t >= 3600)
                snprintf(out, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
        else
                snprintf(out, n, "%02ld:%02ld", t / 60, t % 60);
}

/* tqdm's layout: " 40%|████      | 4/10 [00:02<00:03,  1.95it/s]" on stderr. */
static void pbar_draw(pbar *p) {
        if (!p->on)
                return;
        double el = now_s() - p->start, rate = el > 0 ? (double)p->n / el : 0.0;
        char e[32], r[32], bar[10 * 3 * 2 + 1] = "";
        int width = 10, fill = p->total ? (int)((double)p->n * width / (double)p->total) : 0;
        fmt_secs(el, e, sizeof(e));
        if (rate > 0)
                fmt_secs((double)(p->total - p->n) / rate, r, sizeof(r));
        else
                snprintf(r, sizeof(r), "?");
        for (int i = 0; i < width; i++)
                strcat(bar, i < fill ? "\xe2\x96\x88" : " ");
        fprintf(stderr, "\r%3d%%|%s| %zu/%zu [%s<%s, %5.2fit/s]", p->total ? (int)(100.0 * (double)p->n / (double)p->total) : 100,
                bar, p->n, p->total, e, r, rate);
        fflush(stderr);
}

static void pbar_close(pbar *p) {
        if (p->on) {
                pbar_draw(p);
                fputc('\n', stderr);
        }
}

/* ------------------------------------------------------------------ streamed requests */

typedef struct bench_cfg {
        bench_args *args;
        bool chat;
        char api_url[2048], base_url[2048];
        const char *model_id, *model_name;
        json_t *extra_body;        /* sampling params, then --extra-body, merged */
        struct curl_slist *headers;  /* Authorization, --header */
} bench_cfg;

typedef struct live_req {
        CURL *easy;
        struct curl_slist *hdrs;
        char *body;
        tsr_buf sse;
        tsr_bench_output *out;
        long status;
        char reason[128];
        char errbuf[CURL_ERROR_SIZE];
        bool broken;               /* a message could not be parsed: transfer aborted */
} live_req;

static void on_message(void *ud, const char *msg, size_t len) {
        live_req *r = ud;
        if (r->broken)
                return;
        if (tsr_bench_output_on_message(r->out, msg, len, now_s()) != TSR_OK)
                r->broken = true;
}

static size_t stream_cb(char *p, size_t size, size_t nm, void *ud) {
        live_req *r = ud;
        size_t n = size * nm;
        if (!r->status)
                curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
        if (r->status != 200 || n == 0)
                return n;
        if (tsr_bench_sse_feed(&r->sse, p, n, on_message, r) != TSR_OK)
                return 0;
        return r->broken ? 0 : n;
}

/* Keeps the reason phrase of the last status line (aiohttp's response.reason). */
static size_t header_cb(char *p, size_t size, size_t nm, void *ud) {
        live_req *r = ud;
        size_t n = size * nm;
        if (n > 9 && strncmp(p, "HTTP/", 5) == 0) {
                const char *sp = memchr(p, ' ', n), *sp2 = sp ? memchr(sp + 1, ' ', n - (size_t)(sp + 1 - p)) : NULL;
                size_t rl = 0;
                if (sp2) {
                        const char *end = p + n;
                        while (end > sp2 + 1 && (end[-1] == '\r' || end[-1] == '\n'))
                                end--;
                        rl = (size_t)(end - (sp2 + 1));
                        if (rl >= sizeof(r->reason))
                                rl = sizeof(r->reason) - 1;
                        memcpy(r->reason, sp2 + 1, rl);
                }
                r->reason[rl] = '\0';
        }
        return n;
}

/* One chat message: a user's text as async_request_openai_chat_completions sends the
 * prompt (one text content part), an assistant's as vLLM's multi-turn client keeps the
 * answer it got back (a string).  NULL only on OOM. */
static json_t *chat_message(const char *role, const char *text) {
        if (strcmp(role, "user") == 0)
                return json_pack("{s:s, s:[{s:s, s:s}]}", "role", role, "content", "type", "text", "text", text);
        return json_pack("{s:s, s:s}", "role", role, "content", text);
}

/* The payloads of async_request_openai_completions / _chat_completions.  messages
 * (borrowed; chat only): the conversation to send, else one user message of prompt. */
static char *request_body(const bench_cfg *c, const char *prompt, json_t *messages, int64_t output_len) {
        json_t *b = json_object();
        const char *model = c->model_name ? c->model_name : c->model_id;
        json_object_set_new(b, "model", json_string(model));
        if (c->chat) {
                if (messages)
                        json_object_set(b, "messages", messages);
                else
                        json_object_set_new(b, "messages", json_pack("[o]", chat_message("user", prompt)));
                json_object_set_new(b, "max_completion_tokens", json_integer(output_len));
        } else {
                json_object_set_new(b, "prompt", json_string(prompt));
                json_object_set_new(b, "repetition_penalty", json_real(1.0));
                json_object_set_new(b, "max_tokens", json_integer(output_len));
                json_object_set_new(b, "logprobs",
                                    c->args->logprobs >= 0 ? json_integer(c->args->logprobs) : json_null());
        }
        json_object_set_new(b, "stream", json_true());
        json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
        if (c->args->ignore_eos)
                json_object_set_new(b, "ignore_eos", json_true());
        if (c->extra_body)
                json_object_update(b, c->extra_body);
        char *s = json_dumps(b, JSON_COMPACT);
        json_decref(b);
        return s;
}

static tsr_status live_start(CURLM *multi, const bench_cfg *c, live_req *r, tsr_bench_output *out, const char *prompt,
                             json_t *messages, int64_t prompt_len, int64_t output_len, const char *request_id) {
        memset(r, 0, sizeof(*r));
        r->out = out;
        tsr_buf_init(&r->sse, (size_t)64 << 20);
        r->body = request_body(c, prompt, messages, output_len);
        r->easy = curl_easy_init();
        if (!r->body || !r->easy)
                return TSR_E_NOMEM;
        for (const struct curl_slist *h = c->headers; h; h = h->next)
                r->hdrs = curl_slist_append(r->hdrs, h->data);
        r->hdrs = curl_slist_append(r->hdrs, "Content-Type: application/json");
        r->hdrs = curl_slist_append(r->hdrs, "Expect:");
        if (request_id) {
                char h[512];
                snprintf(h, sizeof(h), "x-request-id: %s", request_id);
                r->hdrs = curl_slist_append(r->hdrs, h);
        }
        curl_easy_setopt(r->easy, CURLOPT_URL, c->api_url);
        curl_easy_setopt(r->easy, CURLOPT_HTTPHEADER, r->hdrs);
        curl_easy_setopt(r->easy, CURLOPT_POSTFIELDS, r->body);
        curl_easy_setopt(r->easy, CURLOPT_WRITEFUNCTION, stream_cb);
        curl_easy_setopt(r->easy, CURLOPT_WRITEDATA, r);
        curl_easy_setopt(r->easy, CURLOPT_HEADERFUNCTION, header_cb);
        curl_easy_setopt(r->easy, CURLOPT_HEADERDATA, r);
        curl_easy_setopt(r->easy, CURLOPT_ERRORBUFFER, r->errbuf);
        curl_easy_setopt(r->easy, CURLOPT_PRIVATE, r);
        curl_easy_setopt(r->easy, CURLOPT_TIMEOUT, 6L * 60 * 60);   /* aiohttp total timeout 6 h */
        curl_easy_setopt(r->easy, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(r->easy, CURLOPT_TCP_NODELAY, 1L);
        tsr_bench_output_init(out, c->chat, prompt_len, now_s());
        if (curl_multi_add_handle(multi, r->easy) != CURLM_OK)
                return TSR_E_INTERNAL;
        return TSR_OK;
}

static void live_finish(CURLM *multi, live_req *r, CURLcode rc) {
        tsr_bench_output *o = r->out;
        if (r->broken) {
                /* on_message already recorded why */
        } else if (rc != CURLE_OK) {
                tsr_bench_output_fail(o, "ClientError: %s", r->errbuf[0] ? r->errbuf : curl_easy_strerror(rc));
        } else if (r->status != 200) {
                curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
                if (r->status == 200)
                        tsr_bench_output_finish(o);
                else
                        tsr_bench_output_fail(o, "%s", r->reason);
        } else {
                tsr_bench_output_finish(o);
        }
        curl_multi_remove_handle(multi, r->easy);
        curl_easy_cleanup(r->easy);
        curl_slist_free_all(r->hdrs);
        free(r->body);
        tsr_buf_done(&r->sse);
        r->easy = NULL;
}

typedef struct job {
        const char *prompt;
        int64_t prompt_len, output_len;
        char request_id[256];
        bool has_id;
        bool follows;                   /* sent only once jobs[prev] has finished */
        size_t prev;
        /* A multi_turn follower's parts (else NULL): the dataset's stand-in for
         * jobs[prev]'s answer and this turn's user text; prompt is their join. */
        const char *prev_reply, *user;
        /* A follower that resends the server's answer is sent as resend_prompt() builds
         * it, into sent (malloc'd, the caller frees it); prompt is then only the
         * dataset's version.  openai-chat sends chat_messages() and keeps sent to count. */
        bool resend;
        char *sent;
} job;

static bool job_is_follower(const job *j) {
        return j->follows && j->user;
}

/* The answer a follower's history holds for jobs[i].prev: the text the server generated
 * for it, as vLLM's multi-turn benchmark resends (send_turn keeps the server's answer as
 * the next turn's context), which is what lets a prefix cache that keeps decoded blocks
 * hit on the answer.  A previous turn that failed or generated no text has no answer to
 * resend: the dataset's stand-in reply takes its place, so that history is the dataset's;
 * so does every turn without resend (--multi-turn-dataset-replies).  Texts are C strings
 * here: an answer holding a NUL is resent up to it. */
static const char *turn_answer(const job *jobs, const tsr_bench_output *outs, size_t i) {
        const tsr_bench_output *o = &outs[jobs[i].prev];
        return jobs[i].resend && o->success && o->text.len ? (const char *)o->text.data : jobs[i].prev_reply;
}

/* A multi_turn follower's prompt as one text: the prompt sent for the previous turn, its
 * answer (turn_answer), then this turn's user text.  Returns NULL on OOM. */
static char *resend_prompt(const job *jobs, const tsr_bench_output *outs, size_t i) {
        const job *p = &jobs[jobs[i].prev];
        return tsr_bench_turn_prompt(p->sent ? p->sent : p->prompt, turn_answer(jobs, outs, i), jobs[i].user);
}

/* A multi_turn follower's conversation as a chat client sends it: the session's first
 * prompt (its shared prefix, document and first user text, as vLLM's multi-turn
 * generator puts the prefixes in the first user turn) as a user message, then for each
 * later turn up to jobs[i] the answer to the turn before (turn_answer) as an assistant
 * message and the turn's user text as a user message.  The contents joined are
 * resend_prompt()'s text.  Returns a new array, NULL on OOM. */
static json_t *chat_messages(const job *jobs, const tsr_bench_output *outs, size_t i) {
        size_t turns = 0, j, m;
        json_t *msgs = json_array();

        for (j = i; job_is_follower(&jobs[j]); j = jobs[j].prev)
                turns++;
        for (m = 0; msgs && m < 2 * turns + 1; m++)     /* slots, filled back to front */
                if (json_array_append_new(msgs, json_null()) != 0)
                        goto fail;
        for (j = i, m = 2 * turns; job_is_follower(&jobs[j]); j = jobs[j].prev, m -= 2)
                if (json_array_set_new(msgs, m, chat_message("user", jobs[j].user)) != 0 ||
                    json_array_set_new(msgs, m - 1, chat_message("assistant", turn_answer(jobs, outs, j))) != 0)
                        goto fail;
        if (msgs && json_array_set_new(msgs, 0, chat_message("user", jobs[j].prompt)) == 0)
                return msgs;
fail:
        json_decref(msgs);
        return NULL;
}

/* Send jobs[i] at t0 + delays[i] (delays NULL: all at once), or, for a job that follows
 * another, when that one has finished if that is later; at most max_conc in flight
 * (<= 0: no limit); wait for all.  outs[i] gets each result.  A resent follower's
 * jobs[i].sent is set, and its outs[i].prompt_len is -1 unless the server's usage gave
 * it, as is one whose jobs[i].prompt_len is -1 (align_to_server): counting here would
 * stall the timed loop (the caller counts after the run). */
static tsr_status run_jobs(CURLM *multi, const bench_cfg *c, job *jobs, size_t n, const double *delays,
                           long long max_conc, tsr_bench_output *outs, pbar *pb) {
        live_req *live = calloc(n ? n : 1, sizeof(*live));
        size_t *fifo = malloc((n ? n : 1) * sizeof(*fifo));
        double *arrival = calloc(n ? n : 1, sizeof(double));
        /* waiter[j]: the job that arrived while jobs[j], which it follows, was not done */
        size_t *waiter = malloc((n ? n : 1) * sizeof(*waiter));
        bool *finished = calloc(n ? n : 1, sizeof(*finished));
        size_t next = 0, head = 0, tail = 0, done = 0, in_flight = 0;
        tsr_status st = TSR_OK;
        if (!live || !fifo || !arrival || !waiter || !finished) {
                st = TSR_E_NOMEM;
                goto out;
        }
        for (size_t i = 0; i < n; i++)
                waiter[i] = SIZE_MAX;
        curl_multi_setopt(multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, max_conc > 0 ? (long)max_conc : 0L);
        double t0 = now_s();
        while (done < n) {
                double t = now_s();
                while (next < n && (!delays || delays[next] <= t - t0)) {
                        size_t i = next++;
                        arrival[i] = t;
                        if (jobs[i].follows && !finished[jobs[i].prev])
                                waiter[jobs[i].prev] = i;
                        else
                                fifo[tail++] = i;
                }
                while (head < tail && (max_conc <= 0 || in_flight < (size_t)max_conc)) {
                        size_t i = fifo[head++];
                        const char *prompt = jobs[i].prompt;
                        int64_t prompt_len = jobs[i].prompt_len;
                        json_t *msgs = NULL;
                        if (job_is_follower(&jobs[i]) && jobs[i].resend) {    /* jobs[prev] has finished */
                                if (!(jobs[i].sent = resend_prompt(jobs, outs, i))) {
                                        st = TSR_E_NOMEM;
                                        goto out;
                                }
                                prompt = jobs[i].sent;
                                prompt_len = -1;
                        }
                        if (c->chat && job_is_follower(&jobs[i]) && !(msgs = chat_messages(jobs, outs, i))) {
                                st = TSR_E_NOMEM;
                                goto out;
                        }
                        st = live_start(multi, c, &live[i], &outs[i], prompt, msgs, prompt_len, jobs[i].output_len,
                                        jobs[i].has_id ? jobs[i].request_id : NULL);
                        json_decref(msgs);
                        if (st != TSR_OK)
                                goto out;
                        outs[i].client_queue_time = outs[i].start_time - arrival[i];
                        in_flight++;
                }
                int running;
                curl_multi_perform(multi, &running);
                CURLMsg *msg;
                int left;
                while ((msg = curl_multi_info_read(multi, &left))) {
                        if (msg->msg != CURLMSG_DONE)
                                continue;
                        live_req *r;
                        CURLcode rc = msg->data.result;
                        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&r);
                        live_finish(multi, r, rc);
                        in_flight--;
                        done++;
                        size_t j = (size_t)(r - live), w = waiter[j];
                        finished[j] = true;
                        if (w != SIZE_MAX) {    /* its follower arrived meanwhile: it arrives now */
                                arrival[w] = now_s();
                                fifo[tail++] = w;
                        }
                        if (pb) {
                                pb->n++;
                                pbar_draw(pb);
                        }
                }
                if (done >= n)
                        break;
                long wait_ms = 1000;
                if (next < n && delays && head == tail) {
                        double until = delays[next] - (now_s() - t0);
                        wait_ms = until <= 0 ? 0 : (long)ceil(until * 1000.0);
                        if (wait_ms > 1000)
                                wait_ms = 1000;
                }
                if (next < n && !delays)
                        wait_ms = 0;
                /* A queued job with a free seat starts now: at --max-concurrency 1 the
                 * next request used to wait out the whole 1 s poll with nothing in
                 * flight (issue #21). */
                if (head < tail && (max_conc <= 0 || in_flight < (size_t)max_conc))
                        wait_ms = 0;
                if (wait_ms > 0 || in_flight > 0)
                        curl_multi_poll(multi, NULL, 0, (int)wait_ms, NULL);
        }
out:
        if (live)
                for (size_t i = 0; i < n; i++)
                        if (live[i].easy)
                                live_finish(multi, &live[i], CURLE_ABORTED_BY_CALLBACK);
        free(live);
        free(fifo);
        free(arrival);
        free(waiter);
        free(finished);
        return st;
}

/* ------------------------------------------------------------------ main */

static bool fetch_first_model(const char *base_url, char **id, char **root, char *err, size_t errlen) {
        char url[2100];
        tsr_buf out;
        long status;
        bool ok = false;
        snprintf(url, sizeof(url), "%s/v1/models", base_url);
        tsr_buf_init(&out, (size_t)16 << 20);
        if (http_simple(url, NULL, &status, &out, err, errlen) == TSR_OK) {
                json_t *j = json_loadb((const char *)out.data, out.len, JSON_ALLOW_NUL, NULL);
                json_t *d0 = json_array_get(json_object_get(j, "data"), 0);
                if (status == 200 && json_is_string(json_object_get(d0, "id"))) {
                        *id = strdup(json_string_value(json_object_get(d0, "id")));
                        const json_t *r = json_object_get(d0, "root");
                        *root = strdup(json_is_string(r) ? json_string_value(r) : *id);
                        ok = true;
                } else {
                        tsr_errf(err, errlen, "%s: HTTP %ld, no model listed", url, status);
                }
                json_decref(j);
        }
        tsr_buf_done(&out);
        return ok;
}

/* serve.py _align_prompts_to_server_tokenizer(): if the server counts the first prompt
 * differently from the local tokenizer, cut every prompt to its count by the server's.
 * A multi_turn follower is not cut as one text: its prompt is its previous turn's, the
 * stand-in reply and its user text (tsr_bench_sample), and a cut of the whole would keep
 * the previous turn's prompt uncut where that turn was sent cut, and drop the user text,
 * so the turn would not extend what its session sent.  It is rebuilt from the previous
 * turn's prompt as aligned (samples[prev] comes first), and its prompt_len becomes -1:
 * the caller counts it with the server's tokenizer after the run, as the prompts a
 * follower resends are counted.  *aligned: whether the tokenizers differed.  TSR_OK, or
 * TSR_E_NOMEM. */
static tsr_status align_to_server(server_tok *srv, tsr_bench_sample *samples, size_t n, bool *aligned) {
        uint32_t *ids = NULL;
        size_t n_ids = 0;
        *aligned = false;
        if (n == 0)
                return TSR_OK;
        if (server_tokenize(srv, samples[0].prompt, strlen(samples[0].prompt), false, &ids, &n_ids) != TSR_OK) {
                printf("WARNING: /tokenize unavailable (%s), skipping alignment.\n", srv->err);
                return TSR_OK;
        }
        free(ids);
        if ((int64_t)n_ids == samples[0].prompt_len)
                return TSR_OK;
        printf("WARNING: tokenizer mismatch (server=%zu, expected=%lld), re-aligning prompts.\n", n_ids,
               (long long)samples[0].prompt_len);
        *aligned = true;
        for (size_t i = 0; i < n; i++) {
                tsr_bench_sample *s = &samples[i];
                char *text;
                size_t len;
                if (s->follows && s->user) {
                        if (!(text = tsr_bench_turn_prompt(samples[s->prev].prompt, s->prev_reply, s->user)))
                                return TSR_E_NOMEM;
                        free(s->prompt);
                        s->prompt = text;
                        s->prompt_len = -1;
                        continue;
                }
                if (server_tokenize(srv, s->prompt, strlen(s->prompt), false, &ids, &n_ids) != TSR_OK)
                        continue;
                if ((int64_t)n_ids > s->prompt_len &&
                    server_decode(srv, ids, (size_t)s->prompt_len, &text, &len) == TSR_OK) {
                        free(s->prompt);
                        s->prompt = text;
                }
                free(ids);
        }
        return TSR_OK;
}

static bool valid_metric(const char *m) {
        static const char *const names[] = {"ttft", "tpot", "itl", "e2el", "client_queue_time",
                                            "e2el_including_client_queue", NULL};
        for (const char *const *p = names; *p; p++)
                if (strcmp(*p, m) == 0)
                        return true;
        return false;
}

/* An error in the flags: usage and the message on stderr, exit 2, everything freed. */
#define FAIL_FLAGS(...)                                       \
        do {                                                  \
                rc_exit = flag_error(__VA_ARGS__);            \
                goto out;                                     \
        } while (0)

int bench_serve_main(int argc, char **argv);
int bench_serve_main(int argc, char **argv) {
        bench_args a = {
                .host = "127.0.0.1", .port = 8000, .endpoint = "/v1/completions", .backend = "openai",
                .dataset_name = "random", .input_len = 1024, .output_len = 128, .range_ratio = "0.0",
                .num_prompts = 1000, .max_concurrency = -1, .request_rate = INFINITY, .burstiness = 1.0, .seed = 0,
                .metric_percentiles = "99", .logprobs = -1,
                .prep_prefix_len = 256, .prep_suffix_len = 256, .prep_num_prefixes = 10, .prep_output_len = 128,
                .mt_turns = 5, .mt_user_len = 64,
        };
        bench_cfg c = {.args = &a};
        char err[1024] = "", *first_id = NULL, *first_root = NULL, **pm = NULL, *pm_copy = NULL;
        tsr_tokenizer *local = NULL;
        server_tok srv = {0};
        tsr_bench_tok tok = {0};
        tsr_bench_random_cfg rc = {0};
        tsr_bench_sample *samples = NULL;
        tsr_bench_output *outs = NULL;
        job *jobs = NULL;
        double *delays = NULL, *percentiles = NULL;
        size_t n_pm = 0, n_pct = 0;
        tsr_bench_metrics m = {0};
        json_t *result = NULL, *bench_result = NULL;
        CURLM *multi = NULL;
        tsr_bench_goodput gp = {0};
        int rc_exit = 1;
        int64_t mismatch = 0;
        char request_id_prefix[64];

        int r = parse_args(argc, argv, &a);
        if (r || a.help) {
                if (a.help && !r)
                        usage(stdout);
                free(a.goodput);
                free(a.metadata);
                free(a.header);
                return r;
        }
        /* --- checks that need nothing but the flags (exit 2, as argparse/ValueError) */
        if (strcmp(a.backend, "openai") == 0 || strcmp(a.backend, "vllm") == 0) {
                c.chat = false;
        } else if (strcmp(a.backend, "openai-chat") == 0) {
                c.chat = true;
        } else {
                FAIL_FLAGS("argument --backend: '%s' is not supported (choose from 'openai', 'vllm', "
                                  "'openai-chat')", a.backend);
        }
        if (strcmp(a.dataset_name, "random") != 0 && strcmp(a.dataset_name, "prefix_repetition") != 0 &&
            strcmp(a.dataset_name, "multi_turn") != 0)
                FAIL_FLAGS("argument --dataset-name: '%s' is not supported (choose from 'random', "
                           "'prefix_repetition', 'multi_turn')", a.dataset_name);
        if (a.max_concurrency != -1 && a.max_concurrency <= 0)
                FAIL_FLAGS("--max-concurrency must be greater than 0");
        if (a.num_prompts <= 0)
                FAIL_FLAGS("--num-prompts must be at least 1");
        if (!(a.request_rate > 0))
                FAIL_FLAGS("--request-rate must be positive (or inf)");
        if (!(a.burstiness > 0))
                FAIL_FLAGS("A positive burstiness factor is expected, but given %g.", a.burstiness);
        if (a.seed < 0 || a.seed > 0xffffffffll)
                FAIL_FLAGS("--seed must be in [0, 2**32 - 1] (numpy's np.random.seed range)");
        if (a.num_warmups < 0 || a.input_len < 0 || a.output_len < 0 || a.prefix_len < 0)
                FAIL_FLAGS("lengths and --num-warmups must be non-negative");
        {
                size_t el = strlen(a.endpoint);
                const char *want = c.chat ? "chat/completions" : "completions";
                if (el < strlen(want) || strcmp(a.endpoint + el - strlen(want), want) != 0)
                        FAIL_FLAGS("%s URL must end with one of: {'%s'}.",
                                          c.chat ? "OpenAI Chat Completions API" : "OpenAI Completions API", want);
        }
        if (a.range_ratio[0] == '{') {
                json_t *rr = json_loads(a.range_ratio, 0, NULL);
                json_t *ri = json_object_get(rr, "input"), *ro = json_object_get(rr, "output");
                bool ok = json_is_number(ri) && json_is_number(ro);
                if (ok) {
                        rc.input_range_ratio = json_number_value(ri);
                        rc.output_range_ratio = json_number_value(ro);
                }
                json_decref(rr);
                if (!ok)
                        FAIL_FLAGS("--random-range-ratio: a JSON dict must hold numbers 'input' and 'output'");
        } else if (!parse_double(a.range_ratio, &rc.input_range_ratio)) {
                FAIL_FLAGS("argument --random-range-ratio: invalid value: '%s'", a.range_ratio);
        } else {
                rc.output_range_ratio = rc.input_range_ratio;
        }
        if (!(rc.input_range_ratio >= 0 && rc.input_range_ratio < 1 && rc.output_range_ratio >= 0 &&
              rc.output_range_ratio < 1))
                FAIL_FLAGS("--random-range-ratio: values must be in [0, 1)");
        rc.input_len = a.input_len;
        rc.output_len = a.output_len;
        rc.prefix_len = a.prefix_len;
        if (tsr_bench_goodput_parse(a.goodput, a.n_goodput, &gp, err, sizeof(err)) != TSR_OK)
                FAIL_FLAGS("%s", err);
        pm_copy = strdup(a.percentile_metrics ? a.percentile_metrics : "ttft,tpot,itl");
        for (char *save = NULL, *t = strtok_r(pm_copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (!valid_metric(t))
                        FAIL_FLAGS("--percentile-metrics: unknown metric '%s' (ttft, tpot, itl, e2el, "
                                   "client_queue_time, e2el_including_client_queue)", t);
                pm = realloc(pm, (n_pm + 1) * sizeof(*pm));
                pm[n_pm++] = t;
        }
        {
                char *copy = strdup(a.metric_percentiles);
                for (char *save = NULL, *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                        double p;
                        if (!parse_double(t, &p) || p < 0 || p > 100) {
                                rc_exit = flag_error("--metric-percentiles: '%s' is not a number in [0, 100]", t);
                                free(copy);
                                goto out;
                        }
                        percentiles = realloc(percentiles, (n_pct + 1) * sizeof(double));
                        percentiles[n_pct++] = p;
                }
                free(copy);
        }
        /* sampling params, then --extra-body on top (serve.py: {**sampling_params, **extra_body}) */
        c.extra_body = json_object();
        {
                const char *names[] = {"top_p", "top_k", "min_p", "temperature", "frequency_penalty",
                                       "presence_penalty", "repetition_penalty"};
                const char *vals[] = {a.top_p, a.top_k, a.min_p, a.temperature, a.frequency_penalty,
                                      a.presence_penalty, a.repetition_penalty};
                for (int i = 0; i < 7; i++)
                        if (vals[i]) {
                                long long iv;
                                if (i == 1 && parse_ll(vals[i], &iv))
                                        json_object_set_new(c.extra_body, names[i], json_integer(iv));
                                else
                                        json_object_set_new(c.extra_body, names[i], json_real(strtod(vals[i], NULL)));
                        }
                if (a.extra_body) {
                        json_t *eb = json_loads(a.extra_body, 0, NULL);
                        if (!json_is_object(eb)) {
                                json_decref(eb);
                                FAIL_FLAGS("argument --extra-body: not a JSON object: '%s'", a.extra_body);
                        }
                        json_object_update(c.extra_body, eb);
                        json_decref(eb);
                }
        }
        for (size_t i = 0; i < a.n_header; i++) {
                const char *eq = strchr(a.header[i], '=');
                char h[1024];
                if (!eq) {
                        FAIL_FLAGS("Invalid header format. Please use KEY=VALUE format.");
                }
                snprintf(h, sizeof(h), "%.*s: %s", (int)(eq - a.header[i]), a.header[i], eq + 1);
                c.headers = curl_slist_append(c.headers, h);
        }
        for (size_t i = 0; i < a.n_metadata; i++)
                if (!strchr(a.metadata[i], '=')) {
                        FAIL_FLAGS("Invalid metadata format. Please use KEY=VALUE format.");
                }
        if (getenv("OPENAI_API_KEY") && *getenv("OPENAI_API_KEY")) {
                char h[1024];
                snprintf(h, sizeof(h), "Authorization: Bearer %s", getenv("OPENAI_API_KEY"));
                c.headers = curl_slist_append(c.headers, h);
        }
        if (a.request_id_prefix) {
                snprintf(request_id_prefix, sizeof(request_id_prefix), "%s", a.request_id_prefix);
        } else {
                /* bench-<8 hex>- as vLLM (uuid4().hex[:8]) */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
                tsr_bench_rng idr;
                tsr_bench_rng_seed(&idr, x);
                snprintf(request_id_prefix, sizeof(request_id_prefix), "bench-%08x-",
                         (unsigned)(tsr_bench_rng_u64(&idr) & 0xffffffffu));
        }

        /* --- the server and the tokenizer */
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0) {
                fprintf(stderr, PROG ": error: libcurl failed to initialise\n");
                goto out;
        }
        if (a.base_url) {
                snprintf(c.base_url, sizeof(c.base_url), "%s", a.base_url);
        } else {
                bool v6 = strchr(a.host, ':') != NULL;
                snprintf(c.base_url, sizeof(c.base_url), "http://%s%s%s:%lld", v6 ? "[" : "", a.host, v6 ? "]" : "",
                         a.port);
        }
        snprintf(c.api_url, sizeof(c.api_url), "%s%s", c.base_url, a.endpoint);
        if (a.model) {
                c.model_id = a.model;
                c.model_name = a.served_model_name;
        } else {
                printf("Model not specified, fetching first model from server...\n");
                if (!fetch_first_model(c.base_url, &first_id, &first_root, err, sizeof(err))) {
                        fprintf(stderr, PROG ": error: failed to fetch models from the server: %s\n", err);
                        goto out;
                }
                printf("First model name: %s, first model id: %s\n", first_id, first_root);
                c.model_name = first_id;
                c.model_id = first_root;
        }
        snprintf(srv.tokenize_url, sizeof(srv.tokenize_url), "%s/tokenize", c.base_url);
        snprintf(srv.detokenize_url, sizeof(srv.detokenize_url), "%s/detokenize", c.base_url);
        srv.model = c.model_name ? c.model_name : c.model_id;
        {
                /* vLLM loads the tokenizer from --tokenizer, else from the model id; a model id
                 * that is no local path falls back to the server's tokenizer. */
                const char *tok_path = a.tokenizer;
                struct stat sb;
                if (!tok_path && stat(c.model_id, &sb) == 0)
                        tok_path = c.model_id;
                if (tok_path) {
                        if (load_local_tokenizer(tok_path, &local, err, sizeof(err)) != TSR_OK) {
                                fprintf(stderr, PROG ": error: %s\n", err);
                                rc_exit = EXIT_BAD_FLAGS;
                                goto out;
                        }
                        tok = (tsr_bench_tok){
                                .ud = local, .encode = local_encode, .decode = local_decode,
                                .is_special = local_is_special, .vocab_size = tsr_tokenizer_vocab_size(local),
                                .num_special_tokens_to_add = tsr_tokenizer_add_bos(local) + tsr_tokenizer_add_eos(local),
                        };
                } else {
                        uint32_t *ids = NULL;
                        size_t n_ids = 0;
                        printf("No local tokenizer: using the server's /tokenize and /detokenize.\n");
                        tok = (tsr_bench_tok){.ud = &srv, .encode = server_encode, .decode = server_decode};
                        if (server_vocab_size(&srv, &tok.vocab_size) != TSR_OK ||
                            server_tokenize(&srv, "", 0, true, &ids, &n_ids) != TSR_OK) {
                                fprintf(stderr, PROG ": error: the server's tokenizer is unavailable: %s\n", srv.err);
                                goto out;
                        }
                        free(ids);
                        tok.num_special_tokens_to_add = (int)n_ids;
                }
        }

        /* --- dataset */
        tsr_bench_rng data_rng;
        tsr_bench_mt arrival_rng;
        /* As vLLM: the dataset from default_rng(seed), the arrival gaps from the global
         * np.random.seed(seed) stream. */
        tsr_bench_rng_seed(&data_rng, (uint64_t)a.seed);
        tsr_bench_mt_seed(&arrival_rng, (uint32_t)a.seed);
        size_t n = (size_t)a.num_prompts;
        /* the random dataset with an OpenAI backend always ignores EOS (serve.py); so do
         * the shared-prefix ones, whose outputs are sized by the workload */
        a.ignore_eos = true;
        tsr_status dst;
        if (strcmp(a.dataset_name, "prefix_repetition") == 0) {
                tsr_bench_prefix_rep_cfg pc = {a.prep_prefix_len, a.prep_suffix_len, a.prep_num_prefixes,
                                           a.prep_output_len};
                dst = tsr_bench_prefix_repetition_dataset(&tok, &data_rng, &pc, n, &samples, err, sizeof(err));
        } else if (strcmp(a.dataset_name, "multi_turn") == 0) {
                tsr_bench_multi_turn_cfg mc = {a.prefix_len, a.mt_turns, a.mt_user_len, a.output_len,
                                               a.mt_session_prefix_len};
                dst = tsr_bench_multi_turn_dataset(&tok, &data_rng, &mc, n, &samples, err, sizeof(err));
        } else {
                dst = tsr_bench_random_dataset(&tok, &data_rng, &rc, n, &samples, &mismatch, err, sizeof(err));
        }
        if (dst != TSR_OK) {
                fprintf(stderr, PROG ": error: %s\n", err[0] ? err : srv.err);
                rc_exit = EXIT_BAD_FLAGS;
                goto out;
        }
        if (mismatch)
                printf("WARNING: across all generated prompts there were %lld %s tokens than asked for after "
                       "decoding and re-encoding.\n", (long long)llabs(mismatch), mismatch > 0 ? "more" : "fewer");
        bool aligned = false;
        if (local && align_to_server(&srv, samples, n, &aligned) != TSR_OK) {
                fprintf(stderr, PROG ": error: out of memory\n");
                goto out;
        }

        /* --- run */
        multi = curl_multi_init();
        jobs = calloc(n, sizeof(*jobs));
        outs = calloc(n, sizeof(*outs));
        delays = calloc(n, sizeof(double));
        if (!multi || !jobs || !outs || !delays) {
                fprintf(stderr, PROG ": error: out of memory\n");
                goto out;
        }
        for (size_t i = 0; i < n; i++) {
                jobs[i] = (job){.prompt = samples[i].prompt, .prompt_len = samples[i].prompt_len,
                                .output_len = samples[i].expected_output_len, .has_id = true,
                                .follows = samples[i].follows, .prev = samples[i].prev,
                                .prev_reply = samples[i].prev_reply, .user = samples[i].user,
                                .resend = !a.mt_dataset_replies};
                snprintf(jobs[i].request_id, sizeof(jobs[i].request_id), "%s%zu", request_id_prefix, i);
        }
        if (!a.temperature)
                printf("WARNING: no --temperature given: the server's default applies (vLLM >= 0.11 sends none); "
                       "pass --temperature 0 for greedy decoding.\n");
        printf("Starting initial single prompt test run...\n");
        if (a.ready_check_timeout_sec > 0) {
                job test = jobs[0];
                tsr_bench_output o;
                double deadline = now_s() + (double)a.ready_check_timeout_sec;
                printf("Waiting for endpoint to become up in %lld seconds\n", a.ready_check_timeout_sec);
                test.has_id = false;
                for (;;) {
                        if (run_jobs(multi, &c, &test, 1, NULL, 0, &o, NULL) != TSR_OK)
                                goto out;
                        bool ok = o.success;
                        if (!ok)
                                fprintf(stderr, "WARNING: endpoint is not ready: %s\n", o.error ? o.error : "");
                        if (ok || now_s() >= deadline) {
                                if (!ok) {
                                        fprintf(stderr, PROG ": error: initial test run failed: %s\n",
                                                o.error ? o.error : "");
                                        tsr_bench_output_done(&o);
                                        goto out;
                                }
                                tsr_bench_output_done(&o);
                                break;
                        }
                        tsr_bench_output_done(&o);
                        double left = deadline - now_s();
                        msleep((long)(1000 * (left < 5 ? (left > 0 ? left : 0) : 5)));
                }
                printf("Initial test run completed.\n");
        } else {
                printf("Skipping endpoint ready check.\n");
        }
        if (a.num_warmups > 0) {
                size_t nw = (size_t)a.num_warmups;
                job *wj = calloc(nw, sizeof(*wj));
                tsr_bench_output *wo = calloc(nw, sizeof(*wo));
                pbar wpb = {.on = !a.disable_tqdm, .total = nw, .start = now_s()};
                if (!wj || !wo) {
                        free(wj);
                        free(wo);
                        goto out;
                }
                printf("Warming up with %zu requests...\n", nw);
                fflush(stdout);
                for (size_t i = 0; i < nw; i++) {
                        wj[i] = jobs[0];
                        wj[i].has_id = false;
                }
                tsr_status st = run_jobs(multi, &c, wj, nw, NULL, a.max_concurrency, wo, &wpb);
                pbar_close(&wpb);
                for (size_t i = 0; i < nw; i++)
                        tsr_bench_output_done(&wo[i]);
                free(wj);
                free(wo);
                if (st != TSR_OK)
                        goto out;
                printf("Warmup run completed.\n");
        }
        printf("Starting main benchmark run...\n");
        {
                char rate[64], burst[64];
                tsr_bench_pyfloat(a.request_rate, rate, sizeof(rate));
                tsr_bench_pyfloat(a.burstiness, burst, sizeof(burst));
                printf("Traffic request rate: %s\n", rate);
                printf("Burstiness factor: %s (%s)\n", burst,
                       a.burstiness == 1.0 ? "Poisson process" : "Gamma distribution");
                if (a.max_concurrency > 0)
                        printf("Maximum request concurrency: %lld\n", a.max_concurrency);
                else
                        printf("Maximum request concurrency: None\n");
        }
        fflush(stdout);
        tsr_bench_arrival_delays(&arrival_rng, n, a.request_rate, a.burstiness, delays);
        pbar pb = {.on = !a.disable_tqdm, .total = n, .start = now_s()};
        double t_start = now_s();
        if (run_jobs(multi, &c, jobs, n, delays, a.max_concurrency, outs, &pb) != TSR_OK) {
                fprintf(stderr, PROG ": error: the run failed (out of memory)\n");
                goto out;
        }
        pbar_close(&pb);
        double duration = now_s() - t_start;

        /* --- report */
        count_ctx cc = {&tok};
        /* The length of a follower's prompt, composed at send time or rebuilt by
         * align_to_server, where the server's usage did not report it: the tokenizer the
         * dataset was built with on the prompt as sent, or the server's where the two
         * were found to count differently (as the aligned first turns are cut to). */
        tsr_bench_tok srv_tok = {.ud = &srv, .encode = server_encode, .decode = server_decode};
        count_ctx pc = {aligned ? &srv_tok : &tok};
        for (size_t i = 0; i < n; i++)
                if (outs[i].prompt_len < 0) {
                        const char *p = jobs[i].sent ? jobs[i].sent : jobs[i].prompt;
                        outs[i].prompt_len = count_tokens(&pc, p, strlen(p));
                        if (outs[i].prompt_len < 0) {
                                fprintf(stderr, PROG ": error: the tokenizer failed on request %zu's prompt%s%s\n", i,
                                        srv.err[0] ? ": " : "", srv.err);
                                goto out;
                        }
                }
        if (tsr_bench_metrics_compute(outs, n, duration, &gp, a.max_concurrency > 0, !isinf(a.request_rate), count_tokens,
                                  &cc, &m) != TSR_OK) {
                fprintf(stderr, PROG ": error: out of memory\n");
                goto out;
        }
        if (m.completed == 0)
                fprintf(stderr, "WARNING: all requests failed; check the benchmark arguments.\n");
        if (m.failed > 0) {
                int shown = 0;
                printf("Failed requests during benchmark run detected (capping to 10):\n");
                for (size_t i = 0; i < n && shown < 10; i++)
                        if (!outs[i].success)
                                printf("Error %d: %s\n", shown++, outs[i].error ? outs[i].error : "");
        }
        bench_result = json_object();
        tsr_bench_report_cfg rcfg = {
                .max_concurrency = a.max_concurrency > 0 ? a.max_concurrency : -1,
                .request_rate = a.request_rate,
                .percentile_metrics = (const char *const *)pm, .n_percentile_metrics = n_pm,
                .percentiles = percentiles, .n_percentiles = n_pct,
                .goodput = gp.enabled,
        };
        if (tsr_bench_report(stdout, &rcfg, &m, outs, n, duration, bench_result) != TSR_OK) {
                fprintf(stderr, PROG ": error: out of memory\n");
                goto out;
        }
        fflush(stdout);

        /* --- result JSON (main_async's result_json) */
        if (a.save_result || a.append_result) {
                char dt[32], name[4096], path[8192];
                time_t now = time(NULL);
                struct tm tm;
                localtime_r(&now, &tm);
                strftime(dt, sizeof(dt), "%Y%m%d-%H%M%S", &tm);
                result = json_object();
                json_object_set_new(result, "date", json_string(dt));
                json_object_set_new(result, "endpoint_type", json_string(a.backend));
                json_object_set_new(result, "backend", json_string(a.backend));
                json_object_set_new(result, "label", a.label ? json_string(a.label) : json_null());
                json_object_set_new(result, "model_id", json_string(c.model_id));
                json_object_set_new(result, "tokenizer_id", json_string(a.tokenizer ? a.tokenizer : c.model_id));
                json_object_set_new(result, "num_prompts", json_integer(a.num_prompts));
                for (size_t i = 0; i < a.n_metadata; i++) {
                        const char *eq = strchr(a.metadata[i], '=');
                        char key[256];
                        snprintf(key, sizeof(key), "%.*s", (int)(eq - a.metadata[i]), a.metadata[i]);
                        json_object_set_new(result, key, json_string(eq + 1));
                }
                json_object_set_new(result, "request_rate",
                                    isinf(a.request_rate) ? json_string("inf") : json_real(a.request_rate));
                json_object_set_new(result, "burstiness",
                                    isinf(a.burstiness) ? json_string("inf") : json_real(a.burstiness));
                json_object_set_new(result, "max_concurrency",
                                    a.max_concurrency > 0 ? json_integer(a.max_concurrency) : json_null());
                json_object_update(result, bench_result);
                if (!a.save_detailed) {
                        static const char *const detailed[] = {"input_lens", "output_lens", "start_times", "ttfts",
                                                               "itls", "generated_texts", "errors", NULL};
                        for (const char *const *k = detailed; *k; k++)
                                json_object_del(result, *k);
                }
                tsr_bench_result_filename(a.label ? a.label : a.backend, a.request_rate,
                                      a.max_concurrency > 0 ? a.max_concurrency : -1, c.model_id, dt, name,
                                      sizeof(name));
                if (a.result_filename)
                        snprintf(name, sizeof(name), "%s", a.result_filename);
                if (a.result_dir) {
                        char cmd_dir[4096];
                        snprintf(cmd_dir, sizeof(cmd_dir), "%s", a.result_dir);
                        /* os.makedirs(exist_ok=True) */
                        for (char *p = cmd_dir + 1; *p; p++)
                                if (*p == '/') {
                                        *p = '\0';
                                        mkdir(cmd_dir, 0777);
                                        *p = '/';
                                }
                        mkdir(cmd_dir, 0777);
                        snprintf(path, sizeof(path), "%s/%s", a.result_dir, name);
                } else {
                        snprintf(path, sizeof(path), "%s", name);
                }
                FILE *f = fopen(path, a.append_result ? "a+" : "w");
                if (!f) {
                        fprintf(stderr, PROG ": error: cannot write %s: %s\n", path, strerror(errno));
                        goto out;
                }
                if (a.append_result && ftell(f) != 0)
                        fputc('\n', f);
                if (json_dumpf(result, f, JSON_REAL_PRECISION(17)) != 0 || fclose(f) != 0) {
                        fprintf(stderr, PROG ": error: cannot write %s\n", path);
                        goto out;
                }
                fprintf(stderr, "tessera bench serve: results written to %s\n", path);
        }
        rc_exit = 0;
out:
        if (outs)
                for (size_t i = 0; i < (size_t)a.num_prompts; i++)
                        tsr_bench_output_done(&outs[i]);
        if (jobs)
                for (size_t i = 0; i < (size_t)a.num_prompts; i++)
                        free(jobs[i].sent);
        free(outs);
        free(jobs);
        free(delays);
        tsr_bench_samples_free(samples, (size_t)a.num_prompts);
        tsr_bench_metrics_done(&m);
        json_decref(result);
        json_decref(bench_result);
        json_decref(c.extra_body);
        curl_slist_free_all(c.headers);
        if (multi)
                curl_multi_cleanup(multi);
        tsr_tokenizer_free(&local);
        free(first_id);
        free(first_root);
        free(pm);
        free(pm_copy);
        free(percentiles);
        free(a.goodput);
        free(a.metadata);
        free(a.header);
        curl_global_cleanup();
        return rc_exit;
}

/* argv: tessera-bench serve [flags]  (tessera bench serve ... execs this) */
int main(int argc, char **argv) {
        if (argc >= 2 && strcmp(argv[1], "serve") == 0)
                return bench_serve_main(argc - 2, argv + 2);
        if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
                usage(stdout);
                return 0;
        }
        fprintf(stderr, "usage: tessera bench serve [options]   (tessera bench serve --help lists them)\n");
        return EXIT_BAD_FLAGS;
}
