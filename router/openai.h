/* openai.h - the OpenAI request bodies of /v1/completions and /v1/chat/completions,
 * parsed and validated the way vLLM 0.12 does it.
 *
 * tsr_oai_parse turns a JSON body into an tsr_oai_request, or into an tsr_oai_error carrying the
 * HTTP status, the OpenAI `type` and vLLM's message (e.g. 400 BadRequestError
 * "temperature must be non-negative, got -1.0.").  Unknown fields are accepted and
 * ignored, as vLLM's `extra="allow"` does (lm-eval forwards arbitrary gen_kwargs).
 * Values left out stay "unset" (has_* false) so the model's generation_config.json
 * defaults can fill them later, as vLLM's --generation-config auto does.
 *
 * Pure functions, no I/O; any thread.  Everything a request points to lives in its
 * arena or in `root` (the parsed JSON, owned: tsr_oai_request_done releases it). */
#ifndef TSR_ROUTER_OPENAI_H
#define TSR_ROUTER_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/arena.h"
#include "common/tsr_status.h"
#include "grammar/grammar.h"

typedef enum tsr_oai_kind { TSR_OAI_COMPLETIONS, TSR_OAI_CHAT } tsr_oai_kind;

/* Caps on client-controlled sizes (every size a client sets is bounded).  tsr_oai_limits_default fills them. */
typedef struct tsr_oai_limits {
        size_t max_prompts;          /* completions: prompts in one request (4096) */
        size_t max_prompt_ids;       /* token ids in one prompt given as ids (1 Mi) */
        size_t max_messages;         /* chat messages (10000) */
        int max_n;                   /* n (128) */
        size_t max_stop;             /* stop strings (64) and stop_token_ids (1024) */
        size_t max_stop_len;         /* bytes in one stop string (4096) */
        size_t max_logit_bias;       /* entries (4096) */
        int max_logprobs;            /* --max-logprobs (20); -1 = no cap */
        size_t max_json_depth;       /* nesting of the body (64) */
} tsr_oai_limits;

void tsr_oai_limits_default(tsr_oai_limits *l);

typedef struct tsr_oai_error {
        int status;                  /* HTTP status, also `code` */
        const char *type;            /* "BadRequestError", "Bad Request", "NotFoundError", ... */
        const char *param;           /* the field, or NULL */
        char message[512];
} tsr_oai_error;

/* One completions prompt: text, or token ids. */
typedef struct tsr_oai_prompt {
        bool is_ids;
        const char *text;            /* UTF-8, NUL-terminated (borrowed from root) */
        size_t text_len;
        uint32_t *ids;               /* arena */
        size_t n_ids;
} tsr_oai_prompt;

typedef struct tsr_oai_logit_bias {
        uint32_t token_id;
        float bias;                  /* clamped to [-100, 100] as vLLM does */
} tsr_oai_logit_bias;

typedef struct tsr_oai_request {
        tsr_oai_kind kind;
        json_t *root;                /* the parsed body (owned) */
        const char *model;           /* NULL or "" = the default model */
        const char *request_id;      /* body `request_id`, NULL if absent */

        /* completions */
        tsr_oai_prompt *prompts;
        size_t n_prompts;
        bool echo;
        int logprobs;                /* -1 = none; completions: k top alternatives */

        /* chat */
        json_t *messages;            /* borrowed from root: validated array of message objects */
        json_t *tools;               /* NULL if absent */
        json_t *chat_template_kwargs;/* NULL if absent */
        const char *chat_template;   /* per-request template, NULL if absent */
        bool add_generation_prompt;  /* true */
        bool continue_final_message; /* false */
        const char *tool_choice;     /* "none" | "auto" | "required" | "function" (named); NULL = absent */
        const char *tool_choice_name;/* the named function, when tool_choice is "function" */
        bool include_reasoning;      /* true; false drops the reasoning parser's reasoning */
        bool chat_logprobs;          /* `logprobs: true` */
        int top_logprobs;            /* 0 */

        /* both */
        bool has_max_tokens;
        int64_t max_tokens;          /* completions default 16; chat: max_completion_tokens or max_tokens */
        int n;                       /* 1 */
        bool has_temperature;   double temperature;
        bool has_top_p;         double top_p;
        bool has_top_k;         int64_t top_k;
        bool has_min_p;         double min_p;
        bool has_repetition_penalty; double repetition_penalty;
        double presence_penalty;     /* 0 */
        double frequency_penalty;    /* 0 */
        bool has_seed;          int64_t seed;
        const char **stop;           /* arena array of borrowed strings */
        size_t n_stop;
        uint32_t *stop_token_ids;
        size_t n_stop_token_ids;
        bool include_stop_str_in_output;
        bool ignore_eos;
        int64_t min_tokens;
        bool skip_special_tokens;    /* true */
        bool spaces_between_special_tokens; /* true */
        tsr_oai_logit_bias *logit_bias;
        size_t n_logit_bias;
        int prompt_logprobs;         /* -1 = none */
        bool prompt_logprobs_all;    /* explicit `prompt_logprobs: -1`: the whole vocabulary (vLLM) */
        bool stream;
        bool include_usage;          /* stream_options.include_usage (true when the object is present, as 0.12) */
        bool continuous_usage_stats;
        bool add_special_tokens;     /* completions true, chat false */
        int64_t priority;
        /* Structured output (response_format / structured_outputs / guided_*), checked
         * by xgrammar already: kind TSR_GRAMMAR_NONE when none.  so_text is the spec as
         * the worker compiles it (a schema or choice list re-serialized compactly; a
         * regex or grammar as given), in the request's arena. */
        tsr_grammar_kind so_kind;
        const char *so_text;
        bool so_compact;             /* disable_any_whitespace */
} tsr_oai_request;

/* Parse `body` (not necessarily NUL-terminated) for the endpoint `kind`.
 * TSR_OK: *req filled (call tsr_oai_request_done).  TSR_E_INVAL: *err filled, *req untouched. */
tsr_status tsr_oai_parse(tsr_oai_kind kind, const char *body, size_t len, const tsr_oai_limits *lim, tsr_arena *arena,
                     tsr_oai_request *req, tsr_oai_error *err);
void tsr_oai_request_done(tsr_oai_request *req);

/* The effective `temperature < 1e-5` rule of vLLM: greedy sampling. */
bool tsr_oai_request_is_greedy(const tsr_oai_request *req);

/* vLLM's error body {"error":{"message","type","param","code"}} as compact JSON
 * (malloc'd; NULL on OOM). */
char *tsr_oai_error_json(const tsr_oai_error *err);

/* Python's repr() of a float ("-1.0", "0.1", "1e-05", "inf"): vLLM's messages embed
 * numbers that way.  Writes at most n bytes incl. NUL. */
void tsr_oai_py_float_repr(double v, char *out, size_t n);

#endif
