/* stream.c - streaming: logprobs entries, SSE chunks (see request.h). */
#include "router/request/request_int.h"

/* ------------------------------------------------------------------ logprobs */

/* echo with max_tokens 0: the engine runs one token, the response carries only the
 * prompt (text and logprobs), as vLLM does. */
bool tsr_request_echo_only(const rq *r) {
        return r->kind == TSR_OAI_COMPLETIONS && r->req.echo && r->req.has_max_tokens && r->req.max_tokens == 0;
}

/* tsr_resp_tokens.decode: one token's text, special tokens kept (vLLM's decoded_token is
 * tokenizer.decode([id])).  Loop thread. */
static char *decode_one(void *ud, uint32_t id, size_t *len) {
        char *text = NULL;
        if (tsr_tokenizer_decode(ud, &id, 1, false, &text, len) != TSR_OK)
                return NULL;
        return text;
}

tsr_resp_tokens tsr_request_tokens_of(const rq *r) { return (tsr_resp_tokens){.decode = decode_one, .ud = r->model->tok}; }

static void lp_from_wire(const Tessera__V1__TokenLogprobs *w, uint32_t token, tsr_resp_token_lp *lp) {
        size_t n_top = w->n_top_token_ids < w->n_top_logprobs ? w->n_top_token_ids : w->n_top_logprobs;
        memset(lp, 0, sizeof(*lp));
        lp->token = token;
        lp->has = true;
        lp->logprob = w->logprob;
        lp->rank = w->rank;
        lp->n_top = (uint32_t)(n_top < TSR_RESP_MAX_TOP ? n_top : TSR_RESP_MAX_TOP);
        for (uint32_t i = 0; i < lp->n_top; i++) {
                lp->top_ids[i] = w->top_token_ids[i];
                lp->top_logprobs[i] = w->top_logprobs[i];
        }
}

/* The first Output's prompt logprobs (positions 1.. on the wire) as one entry per
 * prompt position; a position the worker sent nothing for has none (like position 0). */
tsr_status tsr_request_take_prompt_lp(choice *ch, const Tessera__V1__RequestOutput *out) {
        rq *r = ch->r;
        size_t n = r->prompt_lens[ch->prompt];
        const uint32_t *ids = r->prompt_ids[ch->prompt];
        tsr_resp_token_lp *plp = calloc(n ? n : 1, sizeof(*plp));
        if (!plp)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n; i++) {
                plp[i].token = ids[i];
                if (i >= 1 && i - 1 < out->n_prompt_logprobs && out->prompt_logprobs[i - 1])
                        lp_from_wire(out->prompt_logprobs[i - 1], ids[i], &plp[i]);
        }
        free(ch->plp);
        ch->plp = plp;
        return TSR_OK;
}

tsr_status tsr_request_push_lp(choice *ch, uint32_t token, const Tessera__V1__TokenLogprobs *w) {
        if (ch->n_lp == ch->cap_lp) {
                size_t cap = ch->cap_lp ? ch->cap_lp * 2 : 16;
                tsr_resp_token_lp *g = realloc(ch->lp, cap * sizeof(*g));
                if (!g)
                        return TSR_E_NOMEM;
                ch->lp = g;
                ch->cap_lp = cap;
        }
        if (w) {
                lp_from_wire(w, token, &ch->lp[ch->n_lp]);
        } else {
                memset(&ch->lp[ch->n_lp], 0, sizeof(*ch->lp));
                ch->lp[ch->n_lp].token = token;
        }
        ch->n_lp++;
        return TSR_OK;
}

/* The entries a completions logprobs object covers: with echo the prompt's first
 * (`with_prompt`), then generated ones from `from`.  malloc'd; *n set. */
tsr_resp_token_lp *tsr_request_completion_entries(const rq *r, const choice *ch, bool with_prompt, size_t from, size_t *n) {
        size_t n_prompt = with_prompt ? r->prompt_lens[ch->prompt] : 0, n_gen = ch->n_lp - from;
        tsr_resp_token_lp *all = malloc((n_prompt + n_gen) ? (n_prompt + n_gen) * sizeof(*all) : 1);
        if (!all)
                return NULL;
        for (size_t i = 0; i < n_prompt; i++) {
                if (ch->plp) {
                        all[i] = ch->plp[i];
                } else {
                        memset(&all[i], 0, sizeof(all[i]));
                        all[i].token = r->prompt_ids[ch->prompt][i];
                }
        }
        if (n_gen)
                memcpy(all + n_prompt, ch->lp + from, n_gen * sizeof(*all));
        *n = n_prompt + n_gen;
        return all;
}

/* The logprobs of a stream chunk: every token not sent yet (a chunk suppressed for an
 * empty delta hands its tokens to the next one).  NULL when none were asked. */
static json_t *stream_logprobs(rq *r, choice *ch) {
        tsr_resp_tokens t = tsr_request_tokens_of(r);
        json_t *o = NULL;
        if (r->kind == TSR_OAI_CHAT) {
                if (!r->req.chat_logprobs)
                        return NULL;
                o = tsr_resp_chat_logprobs(ch->lp + ch->lp_sent, ch->n_lp - ch->lp_sent, r->req.top_logprobs, &t);
        } else {
                size_t n;
                bool first_echo = r->req.echo && !ch->echo_lp_sent;
                tsr_resp_token_lp *all;
                if (r->req.logprobs < 0)
                        return NULL;
                all = tsr_request_completion_entries(r, ch, first_echo, ch->lp_sent, &n);
                if (!all)
                        return NULL;
                /* vLLM's initial_text_offset: the generated text streamed before (the
                 * echoed prompt does not count). */
                o = tsr_resp_completion_logprobs(all, n, r->req.logprobs,
                                             first_echo || ch->sent_chars < ch->echo_chars ? 0
                                                                                           : ch->sent_chars - ch->echo_chars,
                                             &t);
                free(all);
                ch->echo_lp_sent = true;
        }
        ch->lp_sent = ch->n_lp;
        return o;
}

/* ------------------------------------------------------------------ streaming */

const tsr_resp_head *tsr_request_head_of(rq *r, tsr_resp_head *h) {
        h->id = r->id;
        h->created = r->created;
        h->model = r->model->name;
        return h;
}

bool tsr_request_want_usage_chunk(const rq *r) {
        return r->req.include_usage || r->L->ctx->cfg->enable_force_include_usage;
}

/* `only`: the per-chunk usage of one choice (stream_options.continuous_usage_stats),
 * which vLLM never gives prompt_tokens_details; NULL: the request's usage. */
void tsr_request_usage_of(const rq *r, const choice *only, tsr_resp_usage *u) {
        const choice *src;

        memset(u, 0, sizeof(*u));
        /* vLLM counts every prompt once per choice set: prompt tokens of each prompt,
         * generated tokens of every choice. */
        for (size_t i = 0; i < r->n_choices; i++) {
                const choice *ch = &r->choices[i];
                if (only && ch != only)
                        continue;
                if (only || ch->index % r->req.n == 0)
                        u->prompt_tokens += ch->prompt_tokens ? ch->prompt_tokens : (uint32_t)r->prompt_lens[ch->prompt];
                u->completion_tokens += ch->n_generated;
        }
        if (only)
                return;
        /* Cached tokens are one child's, never a sum (see first_out), and vLLM 0.12 sets
         * the details only when that count is non-zero: null in a body, absent from
         * the usage chunk otherwise. */
        src = r->streaming ? r->first_out : r->last_done;
        u->cached_tokens = src ? src->cached_tokens : 0;
        u->has_cached_tokens = r->L->ctx->cfg->enable_prompt_tokens_details && u->cached_tokens > 0;
}

void tsr_request_stream_write_obj(rq *r, json_t *obj) {
        size_t n;
        char *ev = tsr_resp_sse_event(obj, &n);
        if (!ev || !r->c)
                goto out;
        if (tsr_http_conn_stream_write(r->c, ev, n) == TSR_E_LIMIT) {
                /* A client that does not read: stop generating for it (output we cannot send is not buffered without bound). */
                log_req(TSR_LOG_WARN, r->id, "client is not reading: write queue over its cap, aborting");
                tsr_request_abort_all(r, "slow_client");
                tsr_http_conn_abort(r->c);
                r->c = NULL;
                r->gone = true;
        }
out:
        free(ev);
}

/* ------------------------------------------------------------------ output parsers */

static const tsr_tools_parser *tool_parser_of(const rq *r) {
        const tsr_config *cfg = r->L->ctx->cfg;
        /* tool_choice "required" / named: the output was forced into the calls' shape */
        if (r->kind == TSR_OAI_CHAT && tsr_tools_forced_parser(r->req.tool_choice))
                return tsr_tools_forced_parser(r->req.tool_choice);
        /* vLLM parses for calls when tools were given, tool_choice is auto and the
         * server runs with --enable-auto-tool-choice and a parser. */
        if (r->kind != TSR_OAI_CHAT || !cfg->enable_auto_tool_choice || !cfg->tool_call_parser || !r->req.tools ||
            !json_array_size(r->req.tools) || !r->req.tool_choice || strcmp(r->req.tool_choice, "auto") != 0)
                return NULL;
        return tsr_tools_parser_find(cfg->tool_call_parser);
}

/* A named tool_choice keeps the output's finish_reason ("stop"), as vLLM. */
static bool named_tool(const rq *r) { return r->req.tool_choice && strcmp(r->req.tool_choice, "function") == 0; }

static const tsr_reasoning_parser *reasoning_parser_of(const rq *r) {
        return r->kind == TSR_OAI_CHAT ? tsr_reasoning_parser_find(r->L->ctx->cfg->reasoning_parser) : NULL;
}

/* chat_template_kwargs.enable_thinking is false (vLLM tests `is False`). */
static bool thinking_off(const rq *r) {
        return json_is_false(json_object_get(r->req.chat_template_kwargs, "enable_thinking"));
}

bool tsr_request_parses_output(const rq *r) { return tool_parser_of(r) || reasoning_parser_of(r); }

void tsr_request_parse_message(rq *r, choice *ch, json_t *chat_choice) {
        tsr_tools_ctx ctx = {.tools = r->req.tools, .forced_name = r->req.tool_choice_name};
        bool called = false;
        if (tsr_chat_out_message(reasoning_parser_of(r), thinking_off(r), tool_parser_of(r), &ctx, (char *)ch->text.data,
                                 ch->text.len, json_object_get(chat_choice, "message"), &called) != TSR_OK)
                log_req(TSR_LOG_WARN, r->id, "output parsers ran out of memory: the text is returned unparsed");
        if (called && !named_tool(r))
                json_object_set_new(chat_choice, "finish_reason", json_string("tool_calls"));
        if (!r->req.include_reasoning) {
                json_t *m = json_object_get(chat_choice, "message");
                json_object_set_new(m, "reasoning", json_null());
                json_object_set_new(m, "reasoning_content", json_null());
        }
}

/* The stream of a chat choice through the parsers: one chunk per Output with what
 * they settled (reasoning, content, tool-call pieces), none when nothing is new; the
 * last one carries finish_reason, "tool_calls" once a call went out. */
static void stream_parsed(rq *r, choice *ch, const tsr_resp_head *h, size_t upto, const tsr_resp_usage *up) {
        json_t *delta = NULL;
        const char *finish = ch->finish_reason;
        if (!ch->parse) {
                tsr_tools_ctx ctx = {.tools = r->req.tools, .forced_name = r->req.tool_choice_name};
                ch->parse = tsr_chat_out_new(reasoning_parser_of(r), thinking_off(r), tool_parser_of(r), &ctx);
                if (!ch->parse) {
                        tsr_request_fail(r, 500, "InternalServerError", "out of memory");
                        return;
                }
        }
        if (tsr_chat_out_step(ch->parse, (char *)ch->text.data, upto, ch->finished, &delta) != TSR_OK) {
                tsr_request_fail(r, 500, "InternalServerError", "out of memory");
                return;
        }
        if (delta && !r->req.include_reasoning && json_object_get(delta, "reasoning")) {
                /* include_reasoning false: the reasoning is parsed off and dropped */
                json_object_del(delta, "reasoning");
                json_object_set_new(delta, "reasoning_content", json_null());
                if (!json_object_get(delta, "content") && !json_object_get(delta, "tool_calls")) {
                        json_decref(delta);
                        delta = NULL;
                }
        }
        /* The role chunk goes with the first output, settled or not (vLLM sends it
         * before the parsers run, and TTFT is measured on it). */
        if (!ch->role_sent) {
                tsr_request_stream_write_obj(r, tsr_resp_chat_role_chunk(h, ch->index, r->L->ctx->cfg->response_role, up));
                ch->role_sent = true;
        }
        if (!delta && !ch->finished)
                return;   /* nothing settled yet: no chunk, as vLLM skips a None delta */
        if (!delta) {
                delta = json_object();
                json_object_set_new(delta, "content", json_string(""));
                json_object_set_new(delta, "reasoning_content", json_null());
        }
        if (ch->finished && tsr_chat_out_called(ch->parse) && !named_tool(r))
                finish = "tool_calls";
        tsr_request_stream_write_obj(r, tsr_resp_chat_delta_chunk(h, ch->index, delta, stream_logprobs(r, ch), finish,
                                                              ch->finished ? json_incref(ch->stop_reason) : NULL, up));
        ch->sent = upto;
}

/* Send what is new in the choice's text (minus the stop-string holdback), with the
 * finish reason when the choice is done. */
void tsr_request_stream_choice(rq *r, choice *ch) {
        tsr_resp_head h;
        tsr_resp_usage u, *up = NULL;
        size_t hold = ch->finished ? 0 : tsr_stop_holdback_bytes((char *)ch->text.data, ch->text.len, r->req.stop,
                                                             r->req.n_stop, r->req.include_stop_str_in_output);
        size_t upto = ch->text.len - hold;
        const char *delta = (const char *)ch->text.data + ch->sent;
        size_t delta_len = upto > ch->sent ? upto - ch->sent : 0;

        if (!r->c || !r->streaming)
                return;
        if (delta_len == 0 && !ch->finished)
                return;   /* vLLM suppresses empty deltas */
        if (r->req.continuous_usage_stats && tsr_request_want_usage_chunk(r)) {
                tsr_request_usage_of(r, ch, &u);
                up = &u;
        }
        tsr_request_head_of(r, &h);
        if (r->kind == TSR_OAI_CHAT && tsr_request_parses_output(r)) {
                stream_parsed(r, ch, &h, upto, up);
                return;
        }
        if (r->kind == TSR_OAI_CHAT) {
                if (!ch->role_sent) {
                        tsr_request_stream_write_obj(r, tsr_resp_chat_role_chunk(&h, ch->index, r->L->ctx->cfg->response_role, up));
                        ch->role_sent = true;
                }
                tsr_request_stream_write_obj(r, tsr_resp_chat_chunk(&h, ch->index, delta, delta_len, stream_logprobs(r, ch),
                                                    ch->finish_reason, ch->finished ? json_incref(ch->stop_reason) : NULL,
                                                    up));
        } else {
                tsr_request_stream_write_obj(r, tsr_resp_completion_chunk(&h, ch->index, delta, delta_len, stream_logprobs(r, ch),
                                                          ch->finish_reason,
                                                          ch->finished ? json_incref(ch->stop_reason) : NULL, up));
        }
        ch->sent_chars += tsr_stop_utf8_count(delta, delta_len);
        ch->sent = upto;
}

