/* prepare.c - parse and prompt preparation on the thread pool, then the checks on the loop (see request.h). */
#include "router/request/request_int.h"

/* ------------------------------------------------------------------ preparation (thread pool) */

tsr_status tsr_request_render_chat(rq *r, char **prompt, size_t *len) {
        json_t *ctx = json_object(), *kv;
        const char *key;
        tsr_status st;

        /* vLLM's message shape: tool calls' arguments as objects, tool results with
         * their tool_call_id (router/tools) */
        json_t *msgs = tsr_tools_template_messages(r->req.messages, r->err.message, sizeof(r->err.message));
        if (!msgs) {
                json_decref(ctx);
                r->err.status = 400;
                r->err.type = "BadRequestError";
                return TSR_E_INVAL;
        }
        json_object_set_new(ctx, "messages", msgs);
        json_object_set_new(ctx, "add_generation_prompt", json_boolean(r->req.add_generation_prompt));
        json_object_set_new(ctx, "bos_token", json_string(r->model->bos_token));
        json_object_set_new(ctx, "eos_token", json_string(r->model->eos_token));
        if (r->req.tools)
                json_object_set(ctx, "tools", r->req.tools);
        if (r->req.chat_template_kwargs)
                json_object_foreach(r->req.chat_template_kwargs, key, kv)
                        json_object_set(ctx, key, kv);
        st = tsr_template_render(r->model->tpl, ctx, NULL, prompt, len, r->err.message, sizeof(r->err.message));
        json_decref(ctx);
        if (st != TSR_OK) {
                r->err.status = 400;
                r->err.type = "BadRequestError";
        }
        return st;
}

/* Thread pool, after tokenization: each prompt's block-hash chain, the same as the
 * worker's prefix cache computes (common/block_hash.h, no salt), so that placement on
 * the loop only has to look hashes up.  Best effort: on any failure the request is
 * placed without prefix affinity. */
static void hash_prompts(rq *r, size_t n) {
        if (!r->hash_wanted || !r->hash_block_size)
                return;
        r->prompt_hashes = calloc(n, sizeof(uint64_t *));
        r->prompt_n_hashes = calloc(n, sizeof(size_t));
        if (!r->prompt_hashes || !r->prompt_n_hashes)
                goto fail;
        for (size_t i = 0; i < n; i++) {
                size_t nb = r->prompt_lens[i] / r->hash_block_size;
                r->prompt_hashes[i] = malloc((nb ? nb : 1) * sizeof(uint64_t));
                if (!r->prompt_hashes[i] ||
                    tsr_block_hash_chain(r->hash_algo, r->prompt_ids[i], r->prompt_lens[i], r->hash_block_size,
                                         NULL, 0, r->prompt_hashes[i], &r->prompt_n_hashes[i]) != TSR_OK)
                        goto fail;
        }
        r->n_hashed = n;
        return;
fail:
        if (r->prompt_hashes)
                for (size_t i = 0; i < n; i++)
                        free(r->prompt_hashes[i]);
        free(r->prompt_hashes);
        free(r->prompt_n_hashes);
        r->prompt_hashes = NULL;
        r->prompt_n_hashes = NULL;
}

/* Loop thread, before prep_work is queued: how the workers serving the model hash
 * their blocks (the first such worker with prefix caching on; workers of one model
 * are expected to agree — one that does not simply never shows hits). */
static void choose_hash_spec(rq *r) {
        tsr_router_ctx *ctx = r->L->ctx;
        if (tsr_request_policy_of(ctx->cfg) != ROUTE_KV)
                return;
        for (size_t k = 0; k < tsr_worker_pool_count(ctx->workers); k++) {
                const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(tsr_worker_pool_get(ctx->workers, k));
                if (!mi || !mi->prefix_caching || !mi->block_size || !mi->block_hash ||
                    !tsr_models_served_by(r->model, mi))
                        continue;
                if (tsr_block_hash_algo_parse(mi->block_hash->algo, &r->hash_algo) != TSR_OK)
                        continue;
                r->hash_block_size = mi->block_size;
                r->hash_wanted = true;
                return;
        }
}

/* Thread pool.  A detokenizer for every choice, primed with its prompt as vLLM primes
 * its DecodeStream (a SentencePiece model's first token keeps its leading space). */
static tsr_status prime_detoks(rq *r, size_t n_prompts) {
        size_t per = r->req.n > 0 ? (size_t)r->req.n : 1;
        r->detoks = calloc(n_prompts * per, sizeof(*r->detoks));
        if (!r->detoks)
                return TSR_E_NOMEM;
        r->n_detoks = n_prompts * per;
        for (size_t i = 0; i < r->n_detoks; i++) {
                size_t p = i / per;
                if (tsr_detok_new(r->model->tok, r->req.skip_special_tokens, &r->detoks[i]) != TSR_OK ||
                    tsr_detok_prime(r->detoks[i], r->prompt_ids[p], r->prompt_lens[p]) != TSR_OK)
                        return TSR_E_NOMEM;
        }
        return TSR_OK;
}

static void prep_work(uv_work_t *w) {   /* thread pool */
        rq *r = w->data;
        size_t n = r->req.n_prompts ? r->req.n_prompts : 1;
        const tsr_tokenizer *tok = r->model->tok;

        r->prompt_ids = calloc(n, sizeof(uint32_t *));
        r->prompt_lens = calloc(n, sizeof(size_t));
        r->prompt_texts = calloc(n, sizeof(char *));
        if (!r->prompt_ids || !r->prompt_lens || !r->prompt_texts)
                goto oom;
        if (r->kind == TSR_OAI_CHAT) {
                char *text = NULL;
                size_t len = 0;
                if (tsr_request_render_chat(r, &text, &len) != TSR_OK) {
                        r->prep_st = TSR_E_INVAL;
                        return;
                }
                r->prep_st = tsr_tokenizer_encode(tok, text, len, r->req.add_special_tokens, &r->prompt_ids[0],
                                                  &r->prompt_lens[0]);
                r->prompt_texts[0] = text;
                if (r->prep_st != TSR_OK)
                        goto tokenize_failed;
                hash_prompts(r, 1);
                if (prime_detoks(r, 1) != TSR_OK)
                        goto oom;
                return;
        }
        for (size_t i = 0; i < r->req.n_prompts; i++) {
                const tsr_oai_prompt *p = &r->req.prompts[i];
                if (p->is_ids) {
                        size_t vocab = tsr_tokenizer_vocab_size(tok);
                        r->prompt_ids[i] = malloc((p->n_ids ? p->n_ids : 1) * sizeof(uint32_t));
                        if (!r->prompt_ids[i])
                                goto oom;
                        for (size_t k = 0; k < p->n_ids; k++) {
                                if (p->ids[k] >= vocab) {
                                        r->err.status = 400;
                                        r->err.type = "BadRequestError";
                                        snprintf(r->err.message, sizeof(r->err.message),
                                                 "Token id %u is out of vocabulary", p->ids[k]);
                                        r->prep_st = TSR_E_INVAL;
                                        return;
                                }
                                r->prompt_ids[i][k] = p->ids[k];
                        }
                        r->prompt_lens[i] = p->n_ids;
                        if (r->req.echo && tsr_tokenizer_decode(tok, p->ids, p->n_ids, false, &r->prompt_texts[i], &(size_t){0}) != TSR_OK)
                                r->prompt_texts[i] = strdup("");
                } else {
                        r->prep_st = tsr_tokenizer_encode(tok, p->text, p->text_len, r->req.add_special_tokens,
                                                          &r->prompt_ids[i], &r->prompt_lens[i]);
                        if (r->prep_st != TSR_OK)
                                goto tokenize_failed;
                        r->prompt_texts[i] = strndup(p->text, p->text_len);
                }
        }
        hash_prompts(r, n);
        if (prime_detoks(r, n) != TSR_OK)
                goto oom;
        return;
tokenize_failed:
        r->err.status = 400;
        r->err.type = "BadRequestError";
        snprintf(r->err.message, sizeof(r->err.message), "the prompt could not be tokenized: %s",
                 r->prep_st == TSR_E_INVAL ? "it is not valid UTF-8" : tsr_status_str(r->prep_st));
        return;
oom:
        r->prep_st = TSR_E_NOMEM;
        r->err.status = 500;
        r->err.type = "InternalServerError";
        snprintf(r->err.message, sizeof(r->err.message), "out of memory");
}

/* vLLM's context-length rules and messages (serving_engine._validate_input). */
static bool check_lengths(rq *r) {
        uint32_t L = r->model->max_model_len;
        const char *suffix = r->kind == TSR_OAI_CHAT ? " None" : "";   /* vLLM's chat wraps the error with its cause */
        for (size_t i = 0; i < r->req.n_prompts || (i == 0 && r->kind == TSR_OAI_CHAT); i++) {
                size_t N = r->prompt_lens[i];
                int64_t M;
                if (N == 0) {
                        tsr_request_fail(r, 400, "BadRequestError", "Prompt cannot be empty.");
                        return false;
                }
                if (r->kind == TSR_OAI_CHAT) {
                        if (N >= L) {
                                tsr_request_fail(r, 400, "BadRequestError",
                                             "This model's maximum context length is %u tokens. However, your request has "
                                             "%zu input tokens. Please reduce the length of the input messages.%s", L, N, suffix);
                                return false;
                        }
                        M = r->req.has_max_tokens ? r->req.max_tokens : (int64_t)(L - N);
                        if (r->req.has_max_tokens && (int64_t)N + M > (int64_t)L) {
                                tsr_request_fail(r, 400, "BadRequestError",
                                             "'max_tokens' or 'max_completion_tokens' is too large: %lld. This model's maximum "
                                             "context length is %u tokens and your request has %zu input tokens (%lld > %u - %zu).%s",
                                             (long long)M, L, N, (long long)M, L, N, suffix);
                                return false;
                        }
                } else {
                        M = r->req.has_max_tokens ? r->req.max_tokens : (int64_t)L - (int64_t)N;
                        if (M < 0 || (int64_t)N > (int64_t)L - (r->req.has_max_tokens ? M : 0) ||
                            (!r->req.has_max_tokens && N >= L)) {
                                tsr_request_fail(r, 400, "BadRequestError",
                                             "This model's maximum context length is %lld tokens. However, your request has "
                                             "%zu input tokens. Please reduce the length of the input messages.",
                                             (long long)L - (r->req.has_max_tokens ? M : 0), N);
                                return false;
                        }
                }
                /* The request's own value, else the rest of the context capped by the
                 * model's max_new_tokens; the smallest over all prompts. */
                if (!r->req.has_max_tokens && r->model->gen.has_max_new_tokens && r->model->gen.max_new_tokens < M)
                        M = r->model->gen.max_new_tokens;
                if (i == 0 || M < r->max_tokens)
                        r->max_tokens = M;
        }
        return true;
}

/* Unset sampling fields come from the model's generation_config.json, else vLLM's
 * neutral defaults. */
static bool resolve_sampling(rq *r) {
        const Tessera__V1__GenerationDefaults *g = &r->model->gen;
        r->temperature = (float)(r->req.has_temperature ? r->req.temperature : g->has_temperature ? g->temperature : 1.0);
        r->top_p = (float)(r->req.has_top_p ? r->req.top_p : g->has_top_p ? g->top_p : 1.0);
        r->top_k = (int32_t)(r->req.has_top_k ? r->req.top_k : g->has_top_k ? g->top_k : 0);
        if (r->top_k < 0)
                r->top_k = 0;
        r->min_p = (float)(r->req.has_min_p ? r->req.min_p : g->has_min_p ? g->min_p : 0.0);
        r->repetition_penalty = (float)(r->req.has_repetition_penalty ? r->req.repetition_penalty
                                        : g->has_repetition_penalty ? g->repetition_penalty : 1.0);
        if (r->temperature < 1e-5f) {
                if (r->req.n > 1) {
                        tsr_request_fail(r, 400, "BadRequestError", "n must be 1 when using greedy sampling, got %d.", r->req.n);
                        return false;
                }
                r->top_p = 1.0f;
                r->top_k = 0;
                r->min_p = 0.0f;
        }
        for (size_t i = 0; i < r->req.n_logit_bias; i++)
                if (r->req.logit_bias[i].token_id >= r->model->vocab_size) {
                        tsr_request_fail(r, 400, "BadRequestError",
                                     "token_id(s) [%u] in logit_bias contain out-of-vocab token ids. Vocabulary size: %u",
                                     r->req.logit_bias[i].token_id, r->model->vocab_size);
                        return false;
                }
        return true;
}

/* The common start of a thread-pool job's completion on the loop: false when the
 * request is gone (freed here if nothing else holds it) or the job failed (answered
 * here: 500 when libuv cancelled it, else the job's own error). */
static bool job_done_ok(rq *r, int status, const char *cancelled) {
        r->jobs--;
        if (r->gone) {
                tsr_request_maybe_free(r);
                return false;
        }
        if (status != 0 || r->prep_st != TSR_OK) {
                if (status != 0)
                        tsr_request_fail(r, 500, "InternalServerError", "%s", cancelled);
                else
                        tsr_request_fail_with(r, &r->err);
                return false;
        }
        return true;
}

static void prep_done(uv_work_t *w, int status) {   /* loop */
        rq *r = w->data;
        size_t n_prompts = r->kind == TSR_OAI_CHAT ? 1 : r->req.n_prompts;

        if (!job_done_ok(r, status, "request preparation was cancelled"))
                return;
        if (!check_lengths(r) || !resolve_sampling(r))
                return;
        r->n_choices = n_prompts * (size_t)r->req.n;
        r->choices = calloc(r->n_choices, sizeof(choice));
        if (!r->choices) {
                tsr_request_fail(r, 500, "InternalServerError", "out of memory");
                return;
        }
        for (size_t i = 0; i < r->n_choices; i++) {
                choice *ch = &r->choices[i];
                ch->r = r;
                ch->index = (int)i;
                ch->prompt = (int)(i / (size_t)r->req.n);
                tsr_buf_init(&ch->text, MAX_OUTPUT_BYTES);
                ch->stop_reason = json_null();
                /* primed by prep_work (prime_detoks): choice i is detoks[i] */
                ch->detok = r->detoks[i];
                r->detoks[i] = NULL;
        }
        if (r->req.stream) {
                if (tsr_http_conn_stream_start(r->c, 200, "text/event-stream; charset=utf-8", NULL) != TSR_OK) {
                        r->gone = true;
                        tsr_request_maybe_free(r);
                        return;
                }
                r->streaming = true;
        }
        for (size_t i = 0; i < r->n_choices; i++) {
                choice *ch = &r->choices[i];
                r->n_open++;
                if (tsr_request_submit_choice(ch, NULL) != TSR_OK) {
                        r->n_open--;
                        tsr_request_fail(r, 503, "ServiceUnavailableError",
                                     "no live worker can serve model %s right now", r->model->name);
                        return;
                }
                /* echo in a stream: the prompt text goes first (vLLM). */
                if (r->streaming && r->req.echo && r->kind == TSR_OAI_COMPLETIONS) {
                        tsr_buf_append_str(&ch->text, r->prompt_texts[ch->prompt]);
                        ch->echo_chars = tsr_stop_utf8_count((char *)ch->text.data, ch->text.len);
                }
        }
        log_req(TSR_LOG_DEBUG, r->id, "submitted %zu choice(s), max_tokens=%lld", r->n_choices, (long long)r->max_tokens);
}

/* ------------------------------------------------------------------ parse (thread pool) */

void tsr_request_parse_work(uv_work_t *w) {   /* thread pool */
        rq *r = w->data;
        tsr_oai_limits lim;
        tsr_oai_limits_default(&lim);
        lim.max_logprobs = r->L->ctx->cfg->max_logprobs;
        r->prep_st = tsr_oai_parse(r->kind, r->body, r->body_len, &lim, r->arena, &r->req, &r->err);
        r->parsed = r->prep_st == TSR_OK;
}

void tsr_request_parse_done(uv_work_t *w, int status) {   /* loop */
        rq *r = w->data;
        tsr_request_layer *L = r->L;
        const tsr_config *cfg = L->ctx->cfg;
        tsr_models_entry *m;

        if (!job_done_ok(r, status, "request parsing was cancelled"))
                return;
        m = tsr_models_registry_find(L->ctx->models, r->req.model);
        if (!m) {
                if (r->req.model && *r->req.model)
                        tsr_request_fail(r, 404, "NotFoundError", "The model `%s` does not exist.", r->req.model);
                else
                        tsr_request_fail(r, 503, "ServiceUnavailableError", "no model is being served yet");
                return;
        }
        if (!m->ready) {
                if (m->load_error)
                        tsr_request_fail(r, 500, "InternalServerError", "model %s cannot be served: %s", m->name, m->load_error);
                else
                        tsr_request_fail(r, 503, "ServiceUnavailableError", "model %s is still loading", m->name);
                return;
        }
        r->model = tsr_models_ref(m);
        /* vLLM's id: X-Request-Id, else the body's request_id, else random hex. */
        if (!r->id_from_header && r->req.request_id && *r->req.request_id)
                snprintf(r->id, sizeof(r->id), "%s%.200s", r->kind == TSR_OAI_CHAT ? "chatcmpl-" : "cmpl-",
                         r->req.request_id);
        if (r->req.prompt_logprobs_all && cfg->max_logprobs >= 0 && (int64_t)m->vocab_size > cfg->max_logprobs) {
                tsr_request_fail(r, 400, "BadRequestError",
                             "Requested prompt logprobs of %u, which is greater than max allowed: %d", m->vocab_size,
                             cfg->max_logprobs);
                return;
        }
        r->think_end_id = r->think_start_id = -1;
        if (r->kind == TSR_OAI_CHAT) {
                if (!m->tpl) {
                        tsr_request_fail(r, 400, "BadRequestError",
                                     "As of transformers v4.44, default chat template is no longer allowed, so you must "
                                     "provide a chat template if the tokenizer does not define one.");
                        return;
                }
                if (r->req.chat_template) {
                        tsr_request_fail(r, 400, "BadRequestError",
                                     "Chat template is passed with request, but --trust-request-chat-template is not set. "
                                     "Refused request with untrusted chat template.");
                        return;
                }
                if (strcmp(r->req.tool_choice, "auto") == 0 && r->req.tools &&
                    !(cfg->enable_auto_tool_choice && cfg->tool_call_parser)) {
                        tsr_request_fail(r, 400, "BadRequestError",
                                     "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
                        return;
                }
                /* With a reasoning parser vLLM applies a structured output once the
                 * reasoning has ended: from the token after the parser's end token, which
                 * must be one token of the vocabulary (vLLM's parsers refuse to start
                 * otherwise).  Ours parse text, so a model without it (SmolLM2) is served;
                 * a structured output there can start only when thinking is off. */
                if (r->req.so_kind != TSR_GRAMMAR_NONE && cfg->reasoning_parser) {
                        r->think_end_id = tsr_tokenizer_token_id(m->tok, "</think>", 8);
                        r->think_start_id = tsr_tokenizer_token_id(m->tok, "<think>", 7);
                        if (r->think_end_id < 0 &&
                            !json_is_false(json_object_get(r->req.chat_template_kwargs, "enable_thinking"))) {
                                tsr_request_fail(r, 400, "BadRequestError",
                                             "structured outputs with --reasoning-parser start after the reasoning's "
                                             "end token </think>, which is not one token of this model's vocabulary; "
                                             "pass chat_template_kwargs {\"enable_thinking\": false} to constrain "
                                             "the whole output");
                                return;
                        }
                }
                /* vLLM's hermes parser (adjust_request) keeps special tokens in the text
                 * when it may parse calls: <tool_call> is a special token in several
                 * vocabularies (Nemotron-3-Nano's too, hence qwen3_coder here as well). */
                if (strcmp(r->req.tool_choice, "auto") == 0 && r->req.tools && json_array_size(r->req.tools) &&
                    cfg->enable_auto_tool_choice && cfg->tool_call_parser &&
                    (strcmp(cfg->tool_call_parser, "hermes") == 0 || strcmp(cfg->tool_call_parser, "qwen3_coder") == 0))
                        r->req.skip_special_tokens = false;
        }
        if (r->req.priority != 0 && cfg->scheduling_policy && strcmp(cfg->scheduling_policy, "priority") != 0) {
                tsr_request_fail(r, 400, "BadRequestError", "Priority scheduling is not enabled.");
                return;
        }
        choose_hash_spec(r);
        r->work.data = r;
        r->jobs++;
        if (uv_queue_work(L->ctx->loop, &r->work, prep_work, prep_done) != 0) {
                r->jobs--;
                tsr_request_fail(r, 500, "InternalServerError", "cannot queue request preparation");
        }
}

