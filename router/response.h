/* response.h - vLLM's response bodies for /v1/completions and /v1/chat/completions,
 * key for key (vLLM's OpenAI protocol models; docs/errors.md for the error bodies):
 *
 *   - non-stream bodies and completions chunks are serialised by vLLM with every key
 *     present, nulls included (model_dump);
 *   - chat chunks carry only the keys vLLM sets (exclude_unset): the first chunk of a
 *     choice has delta {role, content: ""}, then deltas {content}, the last one has
 *     finish_reason and stop_reason;
 *   - the usage chunk (stream_options.include_usage) has "choices": [] and usage
 *     without null fields.
 * Builders return new jansson references (NULL on OOM); arguments documented as
 * "stolen" are consumed even on failure.  Any thread. */
#ifndef TSR_ROUTER_RESPONSE_H
#define TSR_ROUTER_RESPONSE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tsr_resp_usage {
        uint32_t prompt_tokens;
        uint32_t completion_tokens;
        bool has_cached_tokens;       /* --enable-prompt-tokens-details and cached_tokens > 0 (vLLM) */
        uint32_t cached_tokens;
} tsr_resp_usage;

typedef struct tsr_resp_head {
        const char *id;               /* "cmpl-..." / "chatcmpl-..." */
        int64_t created;
        const char *model;
} tsr_resp_head;

/* {"prompt_tokens","total_tokens","completion_tokens","prompt_tokens_details"}; the
 * last is null unless cached tokens are reported.  `with_null_details`: false for
 * stream usage chunks (exclude_none). */
json_t *tsr_resp_usage_json(const tsr_resp_usage *u, bool with_null_details);

/* stop_reason: JSON null, an integer (stop_token_id) or a string (stop string). */
json_t *tsr_resp_stop_reason(bool has_token, uint32_t token, const char *stop_string);

/* ---- non-stream ---- */
json_t *tsr_resp_completion_choice(int index, const char *text, size_t len, json_t *logprobs /* stolen, NULL = null */,
                               const char *finish_reason, json_t *stop_reason /* stolen */);
json_t *tsr_resp_completion(const tsr_resp_head *h, json_t *choices /* stolen array */, const tsr_resp_usage *u);
json_t *tsr_resp_chat_choice(int index, const char *role, const char *content, size_t len,
                         json_t *logprobs /* stolen, NULL = null */, const char *finish_reason,
                         json_t *stop_reason /* stolen */);
json_t *tsr_resp_chat(const tsr_resp_head *h, json_t *choices /* stolen array */, const tsr_resp_usage *u);

/* ---- stream chunks ---- */
/* usage: NULL -> "usage": null (completions always has the key). */
json_t *tsr_resp_completion_chunk(const tsr_resp_head *h, int index, const char *text, size_t len,
                              json_t *logprobs /* stolen */, const char *finish_reason,
                              json_t *stop_reason /* stolen, only used when finish_reason */, const tsr_resp_usage *usage);
/* The first chunk of a chat choice: delta {role, content: ""}. */
json_t *tsr_resp_chat_role_chunk(const tsr_resp_head *h, int index, const char *role, const tsr_resp_usage *usage);
json_t *tsr_resp_chat_chunk(const tsr_resp_head *h, int index, const char *content, size_t len, json_t *logprobs /* stolen */,
                        const char *finish_reason, json_t *stop_reason /* stolen */, const tsr_resp_usage *usage);
/* A chat chunk with a delta built by the caller (stolen): the reasoning and tool-call
 * parsers' {content, reasoning, reasoning_content, tool_calls}. */
json_t *tsr_resp_chat_delta_chunk(const tsr_resp_head *h, int index, json_t *delta, json_t *logprobs /* stolen */,
                              const char *finish_reason, json_t *stop_reason /* stolen */, const tsr_resp_usage *usage);
/* {"id",...,"choices":[],"usage":{...}} for both APIs. */
json_t *tsr_resp_usage_chunk(const tsr_resp_head *h, bool chat, const tsr_resp_usage *u);

/* ---- logprobs ---- */
#define TSR_RESP_LOGPROB_FLOOR -9999.0    /* vLLM's JSON-safe stand-in for -inf */
#define TSR_RESP_MAX_TOP 20               /* alternatives kept per token (the wire's --max-logprobs) */

/* One returned token's logprobs as the engine reports them: the token itself (sampled,
 * or the prompt token) with its logprob and rank, then the top n_top by rank.  `has`
 * false: no logprob at all (prompt position 0). */
typedef struct tsr_resp_token_lp {
        uint32_t token;
        bool has;
        float logprob;
        uint32_t rank;
        uint32_t n_top;
        uint32_t top_ids[TSR_RESP_MAX_TOP];
        float top_logprobs[TSR_RESP_MAX_TOP];
} tsr_resp_token_lp;

/* The text of one token alone (the tokenizer's decode of [id], special tokens kept, as
 * vLLM's decoded_token): malloc'd valid UTF-8, *len set; NULL when it cannot (then ""
 * is used). */
typedef struct tsr_resp_tokens {
        char *(*decode)(void *ud, uint32_t id, size_t *len);
        void *ud;
} tsr_resp_tokens;

/* Completions' {"text_offset","token_logprobs","tokens","top_logprobs"} for tokens
 * (n,), in vLLM's _create_completion_logprobs way: tokens and top_logprobs keys are
 * single-token texts; top_logprobs[i] takes the token itself then its alternatives by
 * rank, id duplicates merged, the first k + 1 of those, then texts that collide merged
 * (the first position, the last value); a token without a logprob gets null in both
 * lists; logprobs below TSR_RESP_LOGPROB_FLOOR become it; text_offset starts at
 * `initial_offset` and adds each token text's length in code points. */
json_t *tsr_resp_completion_logprobs(const tsr_resp_token_lp *lps, size_t n, int k, size_t initial_offset,
                                 const tsr_resp_tokens *t);
/* Chat's {"content":[{"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}...]}]}:
 * top_logprobs lists the first `top` entries of (token itself, alternatives by rank), id
 * duplicates merged; bytes are the UTF-8 bytes of the token text. */
json_t *tsr_resp_chat_logprobs(const tsr_resp_token_lp *lps, size_t n, int top, const tsr_resp_tokens *t);
/* vLLM's prompt_logprobs list: null for a position without a logprob, else
 * {"<id>": {"logprob", "rank", "decoded_token"}} with the prompt token first (its own
 * rank), then the alternatives with ranks 1.. by position; -inf becomes -9999.0. */
json_t *tsr_resp_prompt_logprobs(const tsr_resp_token_lp *lps, size_t n, const tsr_resp_tokens *t);
/* Replace the "prompt_logprobs" value (null) of a completion choice or a chat body. */
void tsr_resp_set_prompt_logprobs(json_t *obj, json_t *prompt_logprobs /* stolen */);

/* "data: <compact json>\n\n" (malloc'd, *len set); NULL on OOM.  Takes the reference. */
char *tsr_resp_sse_event(json_t *obj, size_t *len);
#define TSR_RESP_SSE_DONE "data: [DONE]\n\n"

#endif
