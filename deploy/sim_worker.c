/* tessera-sim-worker MODEL --listen tcp://HOST:PORT [worker flags] [--sim-* flags]
 *
 * A simulated GPU worker, for measuring the router (placement, throughput) with more
 * workers than one machine could run (docs/benchmarks.md, "Router at scale").  It is
 * the real worker minus the model: the same io thread (worker/link.c: sockets, Hello
 * and ModelInfo, Heartbeat reaping, Drain, Status with KV capacity and prefix-cache
 * block events), the same engine thread (worker/engine/engine.c: continuous batching,
 * chunked prefill, the prefix cache of worker/engine/kv_cache.c, an LRU over block hashes,
 * preemption, Abort, shutdown), and the same ModelInfo (worker/link.c, from
 * MODEL's metadata and tokenizer: no weights are read).  Only the forward pass is
 * replaced: it sleeps for the time a GPU would take and writes logits that make one
 * token certain, chosen by a hash of (--seed, the previous token, the position), so
 * the output is deterministic and needs no model.  A prefix-cache hit therefore
 * shortens the simulated prefill exactly as it shortens the real one: the engine
 * never hands cached tokens to the forward.  The tokens are words the tokenizer reads
 * back as the same ids (sim_stable_ids), so a client that resends the answer in its
 * next prompt, as a chat client does, hits the answer's cached blocks as it would on
 * a real model.
 *
 * Cost model of one engine step (every chunk of the batch at once):
 *   t = prefill_tokens / --sim-prefill-tokens-per-s
 *       + [decode_seqs > 0] * (--sim-decode-ms + --sim-decode-ms-per-seq * decode_seqs)
 * where a chunk of one token past the prompt is a decode.  All zero (the default of
 * --sim-zero-compute) makes the worker answer as fast as the engine loop turns.
 *
 * Every worker flag is parsed by common/config (so a flag the real worker refuses is
 * refused here too); the --sim-* flags are taken out of argv first.  Threads: main
 * (io, link.c) and the engine thread, as tessera-worker. */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/endpoint.h"
#include "common/log.h"
#include "common/clock.h"
#include "common/tokenizer.h"
#include "worker/engine/engine.h"
#include "worker/exit_codes.h"
#include "worker/load/gen_config.h"
#include "worker/link.h"
#include "worker/serve.h"
#include "worker/load/model_meta.h"

#define SIM_DEFAULT_KV_BLOCKS 8192      /* 131k tokens at block size 16: a small GPU's pool */
#define SIM_DEFAULT_MAX_NUM_SEQS 256
#define SIM_DEFAULT_MAX_BATCHED_TOKENS 8192
/* Sampled ids come from [SIM_FIRST_ID, vocab): below are a GGUF/BPE vocabulary's
 * control and byte tokens, which would make the streamed text empty or odd. */
#define SIM_FIRST_ID 256u

typedef struct sim_params {
        double prefill_tps;              /* prompt tokens per second; 0 = free */
        double decode_ms;                /* a decode step's fixed cost */
        double decode_ms_per_seq;        /* ... plus this per sequence decoded in it */
} sim_params;

typedef struct sim_model {
        sim_params sp;
        uint64_t seed;
        size_t vocab;
        uint32_t *stable;                /* sim_stable_ids; NULL: any id in [lo, vocab) */
        size_t n_stable;
        const uint32_t *eos;
        size_t n_eos;
        tsr_engine_model em;
        uint64_t steps, prefill_tokens, sampled;  /* engine thread only (diagnostics) */
} sim_model;

static uint64_t mix64(uint64_t x) {   /* splitmix64's finaliser */
        x ^= x >> 30;
        x *= UINT64_C(0xbf58476d1ce4e5b9);
        x ^= x >> 27;
        x *= UINT64_C(0x94d049bb133111eb);
        return x ^ (x >> 31);
}

static uint64_t sim_first_id(size_t vocab) {
        return vocab > SIM_FIRST_ID * 2 ? SIM_FIRST_ID : 0;
}

/* The token after `prev` at `pos`: never an EOS id, so a request runs to max_tokens
 * (as with ignore_eos) and the workload, not the simulator, sets output lengths. */
static uint32_t sim_token(const sim_model *m, uint32_t prev, uint64_t pos) {
        uint64_t lo = sim_first_id(m->vocab), span = m->vocab - lo;
        uint64_t h = mix64(m->seed ^ mix64(((uint64_t)prev << 32) ^ pos));
        if (m->n_stable)        /* none of them is EOS */
                return m->stable[h % m->n_stable];
        for (;;) {
                uint32_t t = (uint32_t)(lo + h % span);
                bool eos = false;
                for (size_t i = 0; i < m->n_eos; i++)
                        eos |= m->eos[i] == t;
                if (!eos)
                        return t;
                h = mix64(h);
        }
}

/* Below this many stable ids (a toy vocabulary) the output is any id, as before. */
#define SIM_MIN_STABLE_IDS 64

/* The ids the simulated model says: those in [lo, vocab), not special, not EOS, whose
 * text on its own is a space and ASCII letters (" word") and encodes back to that id
 * alone.  The router streams the text of the ids sampled, a chat client resends that
 * text in its next prompt, and the router tokenizes it again: with arbitrary ids the
 * text reads back as other ids (" Homer" "bps" "Mich" ...), and the cached blocks of
 * the answer stop matching at the first such place (on SmolLM2, 200-token prompts
 * resent with their 64-token answers: every block the answer filled hit in 1 of 12
 * tries, none in 7), unlike on a real model, whose answers are mostly its tokenizer's
 * own spelling; with these ids all 12 hit every such block.  A byte-level BPE
 * pre-tokenizer (the GPT-2, Llama 3 and Qwen patterns) cuts before every " word", so a
 * run of such words tokenizes word by word whatever comes before it, and each word
 * encodes back to its id; a merge with what follows the answer can change only its
 * last token, whose KV is never computed, so never cached.  Other tokenizers
 * (SentencePiece's "_word", whose decode drops a first space) have no such ids and
 * keep the old stream.  Returns TSR_OK with *n 0 when fewer than SIM_MIN_STABLE_IDS
 * qualify or the model has no tokenizer. */
static tsr_status sim_stable_ids(const tsr_model_meta *meta, size_t vocab, uint64_t lo, uint32_t **ret, size_t *n) {
        tsr_tokenizer *t = NULL;
        uint32_t *ids = NULL, *enc = NULL;
        char err[256], *text = NULL;
        size_t k = 0, n_enc = 0, len = 0;
        tsr_status st;

        *ret = NULL;
        *n = 0;
        if (tsr_model_meta_tokenizer(meta, &t, err, sizeof(err)) != TSR_OK) {
                log_warn("no tokenizer for the simulated output (%s): any id, answers will not re-tokenize", err);
                return TSR_OK;
        }
        if (tsr_tokenizer_vocab_size(t) < vocab)
                vocab = tsr_tokenizer_vocab_size(t);
        if (!(ids = malloc((vocab > lo ? vocab - lo : 1) * sizeof(*ids)))) {
                st = TSR_E_NOMEM;
                goto done;
        }
        for (uint32_t id = (uint32_t)lo; id < vocab; id++) {
                bool ok = !tsr_tokenizer_is_special(t, id);
                for (size_t i = 0; ok && i < meta->n_eos_token_ids; i++)
                        ok = meta->eos_token_ids[i] != id;
                if (!ok || tsr_tokenizer_decode(t, &id, 1, false, &text, &len) != TSR_OK)
                        continue;
                ok = len >= 2 && text[0] == ' ';
                for (size_t i = 1; ok && i < len; i++)
                        ok = (text[i] >= 'a' && text[i] <= 'z') || (text[i] >= 'A' && text[i] <= 'Z');
                if (ok && tsr_tokenizer_encode(t, text, len, false, &enc, &n_enc) == TSR_OK) {
                        if (n_enc == 1 && enc[0] == id)
                                ids[k++] = id;
                        free(enc);
                        enc = NULL;
                }
                free(text);
                text = NULL;
        }
        st = TSR_OK;
        if (k >= SIM_MIN_STABLE_IDS) {
                *ret = ids;
                *n = k;
                ids = NULL;
        }
done:
        free(ids);
        tsr_tokenizer_free(&t);
        return st;
}

static void one_hot(float *row, size_t vocab, uint32_t tok) {
        /* -1e4 and not -inf: any temperature, penalty or bias leaves the chosen token
         * with all the probability mass and no NaN. */
        for (size_t i = 0; i < vocab; i++)
                row[i] = -1e4f;
        row[tok] = 1e4f;
}

static void sleep_s(double s) {
        struct timespec ts;
        if (!(s > 0))
                return;
        ts.tv_sec = (time_t)s;
        ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
}

/* tsr_engine_model.forward, engine thread: the step's simulated time, then the logits. */
static tsr_status sim_forward(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, float *logits) {
        sim_model *m = ud;
        uint64_t prefill = 0, decode = 0;
        float *row = logits;
        double t = 0;

        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *s = &seqs[i];
                if (tsr_engine_seq_is_decode(s))
                        decode++;
                else
                        prefill += s->n;
        }
        if (m->sp.prefill_tps > 0)
                t += (double)prefill / m->sp.prefill_tps;
        if (decode)
                t += (m->sp.decode_ms + m->sp.decode_ms_per_seq * (double)decode) / 1e3;
        sleep_s(t);
        m->steps++;
        m->prefill_tokens += prefill;

        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_engine_seq *s = &seqs[i];
                if (s->want_all_logits) {
                        for (size_t k = 0; k < s->n; k++, row += m->vocab)
                                one_hot(row, m->vocab, sim_token(m, s->tokens[k], s->past_len + k + 1));
                } else if (s->want_logits) {
                        one_hot(row, m->vocab, sim_token(m, s->tokens[s->n - 1], s->past_len + s->n));
                        row += m->vocab;
                        m->sampled++;
                }
        }
        return TSR_OK;
}

/* Take the --sim-* flags out of argv (compacting it) into sp.  Returns false with a
 * message for a bad one. */
static bool take_sim_flags(int *argc, char **argv, sim_params *sp, char *err, size_t errlen) {
        static const struct {
                const char *name;
                size_t off;
        } flags[] = {
                {"--sim-prefill-tokens-per-s", offsetof(sim_params, prefill_tps)},
                {"--sim-decode-ms", offsetof(sim_params, decode_ms)},
                {"--sim-decode-ms-per-seq", offsetof(sim_params, decode_ms_per_seq)},
        };
        int out = 1;

        for (int i = 1; i < *argc; i++) {
                const char *a = argv[i], *val = NULL;
                size_t k, nf = sizeof(flags) / sizeof(flags[0]);
                bool matched = false;

                if (strcmp(a, "--sim-zero-compute") == 0) {
                        *sp = (sim_params){0, 0, 0};
                        continue;
                }
                if (strncmp(a, "--sim-", 6) != 0) {
                        argv[out++] = argv[i];
                        continue;
                }
                for (k = 0; k < nf; k++) {
                        size_t n = strlen(flags[k].name);
                        if (strncmp(a, flags[k].name, n) == 0 && (a[n] == '\0' || a[n] == '=')) {
                                matched = true;
                                val = a[n] == '=' ? a + n + 1 : (i + 1 < *argc ? argv[++i] : NULL);
                                break;
                        }
                }
                if (!matched) {
                        snprintf(err, errlen, "unrecognized arguments: %s", a);
                        return false;
                }
                char *end;
                double v = val ? strtod(val, &end) : NAN;
                if (!val || *end || !isfinite(v) || v < 0) {
                        snprintf(err, errlen, "argument %s: expected a number >= 0, got '%s'", flags[k].name,
                                 val ? val : "");
                        return false;
                }
                *(double *)((char *)sp + flags[k].off) = v;
        }
        *argc = out;
        argv[out] = NULL;
        return true;
}

static const char usage[] =
        "usage: tessera-sim-worker MODEL --listen tcp://HOST:PORT [worker options] [simulation options]\n"
        "\n"
        "A worker without a model: the real io and engine threads, a forward pass that sleeps.\n"
        "MODEL gives the tokenizer, chat template and EOS ids (no weights are read).\n"
        "\n"
        "simulation options:\n"
        "  --sim-prefill-tokens-per-s R   prompt tokens computed per second (default 20000; 0 = free)\n"
        "  --sim-decode-ms MS             fixed cost of a decode step (default 20)\n"
        "  --sim-decode-ms-per-seq MS     extra cost per sequence in a decode step (default 0.1)\n"
        "  --sim-zero-compute             all three 0: the router is the only cost\n"
        "  (--seed picks the token stream; --num-gpu-blocks-override the KV blocks, default 8192)\n\n";

int main(int argc, char **argv) {
        tsr_config cfg;
        tsr_model_meta *meta = NULL;
        tsr_block_hash_algo hash_algo = TSR_BLOCK_HASH_SHA256;
        tsr_worker_plan plan;
        tsr_gen_override gen_override;
        tsr_gen_defaults gen_defaults;
        bool gen_no_file = false;
        uint8_t *mi_full = NULL, *mi_lean = NULL;
        size_t mi_full_len = 0, mi_lean_len = 0;
        sim_model sm = {.sp = {20000.0, 20.0, 0.1}};
        char err[1024] = "";
        int rc = TSR_EXIT_CONFIG;
        tsr_log_level level;

        tsr_log_init("tessera-sim-worker", TSR_LOG_INFO);
        tsr_log_set_thread("io");
        tsr_config_init(&cfg);
        if (!take_sim_flags(&argc, argv, &sm.sp, err, sizeof(err)) ||
            tsr_config_parse(&cfg, argc, argv, true, err, sizeof(err)) != TSR_OK ||
            (!cfg.help && !cfg.version && tsr_config_validate(&cfg, err, sizeof(err)) != TSR_OK)) {
                fprintf(stderr, "tessera-sim-worker: error: %s\n", err);
                goto out;
        }
        if (cfg.help) {
                fputs(usage, stdout);
                tsr_config_print_help(stdout, "worker options:", TSR_OWNER_WORKER);
                rc = TSR_EXIT_OK;
                goto out;
        }
        if (cfg.version) {
                printf("tessera-sim-worker %s\n", TSR_VERSION);
                rc = TSR_EXIT_OK;
                goto out;
        }
        if (cfg.log_level && tsr_log_parse_level(cfg.log_level, &level))
                tsr_log_set_level(level);
        if (!cfg.model) {
                fprintf(stderr, "tessera-sim-worker: error: the following arguments are required: MODEL\n");
                goto out;
        }
        if (tsr_gen_override_parse(cfg.override_generation_config, &gen_override, err, sizeof(err)) != TSR_OK ||
            tsr_block_hash_algo_parse(cfg.prefix_caching_hash_algo, &hash_algo) != TSR_OK) {
                fprintf(stderr, "tessera-sim-worker: error: %s\n",
                        err[0] ? err : "--prefix-caching-hash-algo is not supported");
                goto out;
        }
        if (tsr_model_meta_load(cfg.model, &meta, err, sizeof(err)) != TSR_OK) {
                log_error("cannot load model %s: %s", cfg.model, err);
                goto out;
        }
        if (tsr_gen_defaults_resolve(cfg.generation_config, meta, &gen_override, &gen_defaults, &gen_no_file, err,
                                     sizeof(err)) != TSR_OK) {
                log_error("--generation-config %s: %s", cfg.generation_config, err);
                goto out;
        }

        /* The plan: what tessera-worker sizes from the model's dims and memory, given here. */
        memset(&plan, 0, sizeof(plan));
        if (cfg.status_listen) {
                snprintf(plan.status_listen, sizeof(plan.status_listen), "%s", cfg.status_listen);
        } else if (tsr_endpoint_status_default(cfg.worker_listen, plan.status_listen, sizeof(plan.status_listen)) !=
                   TSR_OK) {
                fprintf(stderr, "tessera-sim-worker: error: --listen %s: expected tcp://HOST:PORT (or give "
                        "--status-listen)\n", cfg.worker_listen);
                goto out;
        }
        plan.max_model_len = cfg.max_model_len > 0 ? (uint32_t)cfg.max_model_len : meta->max_model_len;
        if (plan.max_model_len == 0 || meta->vocab_size == 0) {
                log_error("%s: the model states no context length or vocabulary; pass --max-model-len", meta->path);
                goto out;
        }
        plan.kv_blocks_total = cfg.num_gpu_blocks_override > 0 ? (uint64_t)cfg.num_gpu_blocks_override
                                                               : SIM_DEFAULT_KV_BLOCKS;
        plan.max_num_seqs = cfg.max_num_seqs > 0 ? (uint32_t)cfg.max_num_seqs : SIM_DEFAULT_MAX_NUM_SEQS;
        plan.max_num_batched_tokens = cfg.max_num_batched_tokens > 0 ? (uint32_t)cfg.max_num_batched_tokens
                                                                     : SIM_DEFAULT_MAX_BATCHED_TOKENS;
        plan.boot_epoch = tsr_wall_ns();
        snprintf(plan.worker_id, sizeof(plan.worker_id), "%s", cfg.worker_listen);
        if (tsr_link_pack_model_info(&cfg, meta, &gen_defaults, &plan, true, "simulated", &mi_full, &mi_full_len,
                                       &mi_lean, &mi_lean_len) != TSR_OK) {
                log_error("model info for %s does not fit in one protocol frame", meta->path);
                goto out;
        }
        sm.seed = (uint64_t)cfg.seed;
        sm.vocab = meta->vocab_size;
        sm.eos = meta->eos_token_ids;
        sm.n_eos = meta->n_eos_token_ids;
        if (sim_stable_ids(meta, sm.vocab, sim_first_id(sm.vocab), &sm.stable, &sm.n_stable) != TSR_OK) {
                log_error("out of memory");
                goto out;
        }
        sm.em = (tsr_engine_model){.vocab = sm.vocab, .ud = &sm, .forward = sim_forward};
        log_info("simulated worker for %s: vocab %zu, max_model_len %u, %llu KV blocks of %d tokens, max_num_seqs "
                 "%u; prefill %.0f tokens/s, decode step %.2f ms + %.3f ms/seq (0 = free); output from %zu word ids "
                 "(0: any id)",
                 meta->path, sm.vocab, plan.max_model_len, (unsigned long long)plan.kv_blocks_total, cfg.block_size,
                 plan.max_num_seqs, sm.sp.prefill_tps, sm.sp.decode_ms, sm.sp.decode_ms_per_seq, sm.n_stable);

        rc = TSR_EXIT_RUNTIME;
        tsr_worker_serve_opts so = {
                .cfg = &cfg,
                .meta = meta,
                .plan = &plan,
                .model = &sm.em,
                .hash_algo = hash_algo,
                .model_info_full = mi_full,
                .model_info_full_len = mi_full_len,
                .model_info_lean = mi_lean,
                .model_info_lean_len = mi_lean_len,
                .log_stats_interval_s = cfg.disable_log_stats ? 0 : 10.0,
        };
        if (tsr_worker_serve(&so) == TSR_OK)
                rc = TSR_EXIT_OK;
out:
        if (sm.steps)
                log_info("simulated %llu engine steps, %llu prompt tokens computed, %llu tokens sampled",
                         (unsigned long long)sm.steps, (unsigned long long)sm.prefill_tokens,
                         (unsigned long long)sm.sampled);
        free(mi_full);
        free(mi_lean);
        free(sm.stable);
        tsr_model_meta_free(&meta);
        tsr_config_done(&cfg);
        return rc;
}
