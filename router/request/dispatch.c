/* dispatch.c - placement and submission of choices, worker events (see request.h). */
#include "router/request/request_int.h"

/* ------------------------------------------------------------------ placement and submission */

routing_policy tsr_request_policy_of(const tsr_config *cfg) {
        const char *p = cfg->routing_policy;
        if (p && strcmp(p, "least_load") == 0)
                return ROUTE_LEAST_LOAD;
        if (p && strcmp(p, "round_robin") == 0)
                return ROUTE_ROUND_ROBIN;
        return ROUTE_KV;
}

static const char *const policy_names[] = {"kv", "least_load", "round_robin"};

/* The pending-dispatch entry of worker w (created empty; NULL when out of memory),
 * pruned against its Status st (tsr_placement_sent_prune) once per Status: every
 * placement reads every candidate's entry, a Status comes far less often. */
static struct pending_dispatch *pending_of(tsr_request_layer *L, const tsr_worker *w, const Tessera__V1__Status *st) {
        uint64_t epoch = st ? st->boot_epoch : 0, seq = st ? st->seq : 0, ack = 0;
        struct pending_dispatch *p = NULL;

        for (size_t i = 0; i < L->n_pending && !p; i++)
                if (L->pending[i].w == w)
                        p = &L->pending[i];
        if (!p) {
                struct pending_dispatch *grown = realloc(L->pending, (L->n_pending + 1) * sizeof(*grown));
                if (!grown)
                        return NULL;
                L->pending = grown;
                p = &L->pending[L->n_pending++];
                memset(p, 0, sizeof(*p));
                p->w = w;
        }
        if (!p->sent.pruned || p->sent.boot_epoch != epoch || p->sent.pruned_seq != seq) {
                bool acked = tsr_worker_submit_ack(w, &ack);
                tsr_placement_sent_prune(&p->sent, epoch, seq, acked, ack);
        }
        return p;
}

/* Count the Submit wire_id just sent to w, placed as candidate c, as pending there. */
static void pending_record(tsr_request_layer *L, tsr_worker *w, uint64_t wire_id, const tsr_placement_cand *c) {
        const Tessera__V1__Status *st = tsr_worker_status(w);
        struct pending_dispatch *p = pending_of(L, w, st);
        if (p)
                tsr_placement_sent_add(&p->sent, wire_id, st ? st->seq : 0, c);
}

static const char *const place_path_names[] = {"cost", "all_filtered", "imbalance_guard"};

/* Loop thread.  Candidates are the live workers serving the model, listed from a
 * rotating start so that ties spread.  kv: tsr_placement_pick (placement.h: capacity
 * filters, cost with the prompt's prefix hits in each worker's mirror, imbalance
 * guard); least_load: the fewest requests running, waiting and sent since the last
 * Status; round_robin: the first candidate. */
static tsr_worker *pick_worker(rq *r, int prompt, tsr_worker *avoid, tsr_placement_cand *chosen) {
        tsr_router_ctx *ctx = r->L->ctx;
        routing_policy pol = tsr_request_policy_of(ctx->cfg);
        size_t n = tsr_worker_pool_count(ctx->workers), n_cand = 0, best;
        const uint64_t *hashes = r->prompt_hashes ? r->prompt_hashes[prompt] : NULL;
        size_t n_hashes = hashes ? r->prompt_n_hashes[prompt] : 0;
        tsr_worker *stack_w[16], **ws = stack_w;
        tsr_placement_cand stack_c[16], *cs = stack_c;
        tsr_placement_path path = TSR_PLACE_COST;
        uint64_t now = tsr_now_ns();

        if (n > 16) {
                ws = malloc(n * sizeof(*ws));
                cs = malloc(n * sizeof(*cs));
                if (!ws || !cs) {   /* degrade to the first 16 rather than fail the request */
                        free(ws);
                        free(cs);
                        ws = stack_w;
                        cs = stack_c;
                        n = 16;
                }
        }
        tsr_placement_recent_match recent;     /* placed here, not yet in a Status */
        tsr_placement_recent_scan(&r->L->recent, pol == ROUTE_KV ? hashes : NULL, n_hashes, now, &recent);
        /* A draining worker (SIGTERM, --shutdown-timeout) refuses new requests: list
         * it only when no other worker can take the request (second pass). */
        for (int pass = 0; pass < 2 && n_cand == 0; pass++) {
                for (size_t k = 0; k < tsr_worker_pool_count(ctx->workers) && n_cand < n; k++) {
                        size_t idx = (k + r->L->rotate) % tsr_worker_pool_count(ctx->workers);
                        tsr_worker *w = tsr_worker_pool_get(ctx->workers, idx);
                        const Tessera__V1__Status *st = tsr_worker_status(w);
                        tsr_placement_cand *c = &cs[n_cand];
                        if (!tsr_worker_live(w) || !tsr_worker_accepting(w) ||
                            !tsr_models_served_by(r->model, tsr_worker_model_info(w)))
                                continue;
                        if (w == avoid && tsr_worker_pool_count(ctx->workers) > 1)
                                continue;
                        if (pass == 0 && st && st->state == TESSERA__V1__STATUS__STATE__DRAINING)
                                continue;
                        /* UNHEALTHY: a replica that cannot run a step now (a multi-node
                         * replica whose nodes are apart): it would only fail the request. */
                        if (st && st->state == TESSERA__V1__STATUS__STATE__UNHEALTHY)
                                continue;
                        const struct pending_dispatch *p = pending_of(r->L, w, st);
                        tsr_placement_pending sent;
                        tsr_placement_sent_sum(p ? &p->sent : NULL, &sent);
                        tsr_placement_cand_fill(c, w, st, &sent,
                                                r->hash_block_size ? r->hash_block_size : r->model->block_size,
                                                r->max_tokens > 0 ? (uint64_t)r->max_tokens : 1,
                                                pol == ROUTE_KV ? hashes : NULL, pol == ROUTE_KV ? n_hashes : 0);
                        if (recent.n) {
                                size_t h = tsr_placement_recent_lookup(&recent, w);
                                c->hits = h > c->hits ? h : c->hits;
                        }
                        ws[n_cand++] = w;
                }
        }
        r->L->rotate++;
        if (pol == ROUTE_ROUND_ROBIN)
                best = n_cand ? 0 : (size_t)-1;
        else if (pol == ROUTE_LEAST_LOAD)
                best = tsr_placement_pick_least_load(cs, n_cand);
        else
                best = tsr_placement_pick(cs, n_cand, NULL, &path);
        tsr_worker *w = best == (size_t)-1 ? NULL : ws[best];
        if (w) {
                *chosen = cs[best];
                if (pol == ROUTE_KV)
                        tsr_placement_recent_add(&r->L->recent, w, hashes, n_hashes, now);
                tsr_metrics_counter_add(ctx->metrics, TSR_METRICS_PLACEMENTS, policy_names[pol], 1);
                if (pol == ROUTE_KV)
                        log_debug("%s: placed on %s (%zu of %zu blocks cached there, %s)", r->id,
                                  tsr_worker_endpoint(w), cs[best].hits, cs[best].blocks, place_path_names[path]);
        }
        if (ws != stack_w) {
                free(ws);
                free(cs);
        }
        return w;
}

/* Does this prompt leave the output inside the reasoning?  As vLLM's thinking parsers
 * read the prompt: the last of <think> / </think> in it decides (none: the model opens
 * its reasoning itself); chat_template_kwargs.enable_thinking false: no reasoning. */
static bool reasoning_pending(const rq *r, const uint32_t *prompt, size_t n) {
        if (r->think_end_id < 0 || json_is_false(json_object_get(r->req.chat_template_kwargs, "enable_thinking")))
                return false;
        for (size_t i = n; i-- > 0;) {
                if (prompt[i] == (uint32_t)r->think_end_id)
                        return false;
                if (r->think_start_id >= 0 && prompt[i] == (uint32_t)r->think_start_id)
                        return true;
        }
        return true;
}

tsr_status tsr_request_submit_choice(choice *ch, tsr_worker *avoid) {
        rq *r = ch->r;
        tsr_envelope env;
        Tessera__V1__Submit s;
        Tessera__V1__SamplingParams sp;
        Tessera__V1__StructuredOutput so;
        Tessera__V1__SamplingParams__LogitBiasEntry *lb = NULL, **lbp = NULL;
        uint32_t *stop_ids = r->req.stop_token_ids;
        char idbuf[24];
        tsr_placement_cand placed;
        tsr_worker *w = pick_worker(r, ch->prompt, avoid, &placed);
        tsr_status st;

        if (!w)
                return TSR_E_UNAVAILABLE;
        if (tsr_request_table_put(r->L, ch) != TSR_OK)
                return TSR_E_UNAVAILABLE;
        snprintf(idbuf, sizeof(idbuf), "%" PRIu64, ch->wire_id);
        tessera__v1__envelope__init(&env);
        tessera__v1__submit__init(&s);
        tessera__v1__sampling_params__init(&sp);
        sp.temperature = r->temperature;
        sp.top_p = r->top_p;
        sp.top_k = r->top_k;
        sp.min_p = r->min_p;
        sp.repetition_penalty = r->repetition_penalty;
        sp.frequency_penalty = (float)r->req.frequency_penalty;
        sp.presence_penalty = (float)r->req.presence_penalty;
        sp.has_seed = r->req.has_seed;
        /* Each sample of n gets its own stream of the seeded generator. */
        sp.seed = (uint64_t)r->req.seed + (uint64_t)(ch->index % r->req.n);
        if (r->req.n_logit_bias) {
                lb = calloc(r->req.n_logit_bias, sizeof(*lb));
                lbp = calloc(r->req.n_logit_bias, sizeof(*lbp));
                if (!lb || !lbp) {
                        free(lb);
                        free(lbp);
                        tsr_request_table_del(r->L, ch);
                        return TSR_E_NOMEM;
                }
                for (size_t i = 0; i < r->req.n_logit_bias; i++) {
                        tessera__v1__sampling_params__logit_bias_entry__init(&lb[i]);
                        lb[i].key = r->req.logit_bias[i].token_id;
                        lb[i].value = r->req.logit_bias[i].bias;
                        lbp[i] = &lb[i];
                }
                sp.logit_bias = lbp;
                sp.n_logit_bias = r->req.n_logit_bias;
        }
        s.request_id = idbuf;
        s.prompt_token_ids = r->prompt_ids[ch->prompt];
        s.n_prompt_token_ids = r->prompt_lens[ch->prompt];
        s.sampling = &sp;
        /* echo with max_tokens 0: run one token, return only the prompt (vLLM). */
        s.max_tokens = (uint32_t)(r->max_tokens > 0 ? r->max_tokens : 1);
        s.min_tokens = (uint32_t)r->req.min_tokens;
        s.stop_token_ids = stop_ids;
        s.n_stop_token_ids = r->req.n_stop_token_ids;
        s.ignore_eos = r->req.ignore_eos;
        /* Completions `logprobs: k`, chat `logprobs: true` + `top_logprobs: k` (openai.c
         * folds both into req.logprobs); prompt_logprobs explicit or implied by echo. */
        s.logprobs = r->req.logprobs < 0 ? -1 : r->req.logprobs > TSR_RESP_MAX_TOP ? TSR_RESP_MAX_TOP : r->req.logprobs;
        s.prompt_logprobs = r->req.prompt_logprobs < 0 ? -1
                            : r->req.prompt_logprobs > TSR_RESP_MAX_TOP ? TSR_RESP_MAX_TOP
                                                                    : r->req.prompt_logprobs;
        s.priority = (int32_t)r->req.priority;
        if (r->req.so_kind != TSR_GRAMMAR_NONE) {   /* same numbers as the wire's Kind */
                tessera__v1__structured_output__init(&so);
                so.kind = (Tessera__V1__StructuredOutput__Kind)r->req.so_kind;
                so.text = (char *)(r->req.so_text ? r->req.so_text : "");
                so.compact_whitespace = r->req.so_compact;
                so.reasoning_end_token_id_plus_1 = reasoning_pending(r, s.prompt_token_ids, s.n_prompt_token_ids)
                                                           ? (uint32_t)r->think_end_id + 1 : 0;
                s.structured_output = &so;
        }
        s.arrival_time_unix_ns = tsr_wall_ns();
        if (r->deadline_ns) {   /* the same instant on the wall clock (the worker does not act on it yet) */
                uint64_t now = tsr_now_ns();
                s.deadline_unix_ns = s.arrival_time_unix_ns + (r->deadline_ns > now ? r->deadline_ns - now : 0);
        }
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_SUBMIT;
        env.submit = &s;
        st = tsr_worker_send(w, &env);
        free(lb);
        free(lbp);
        if (st != TSR_OK) {
                tsr_request_table_del(r->L, ch);
                return st;
        }
        pending_record(r->L, w, ch->wire_id, &placed);
        ch->worker = w;
        ch->attempts++;
        return TSR_OK;
}

/* A choice that produced nothing yet can go elsewhere; one that did cannot (the
 * client already has its first tokens). */
static void retry_or_fail(choice *ch, const char *why) {
        rq *r = ch->r;
        tsr_worker *failed = ch->worker;
        bool can_retry = ch->n_generated == 0 && ch->attempts < MAX_ATTEMPTS;

        tsr_request_close_choice(ch, false, why);
        r->n_open++;   /* still open: being resubmitted */
        if (can_retry && tsr_request_submit_choice(ch, failed) == TSR_OK) {
                log_req(TSR_LOG_INFO, r->id, "choice %d resubmitted (attempt %d): %s", ch->index, ch->attempts, why);
                tsr_metrics_counter_add(r->L->ctx->metrics, TSR_METRICS_RETRIES, NULL, 1);
                return;
        }
        r->n_open--;
        ch->finished = true;
        /* After tokens the upstream failed mid-answer: 502 (issue #5; a stream gets an
         * error event instead).  Before any token and no worker left: 503. */
        if (ch->n_generated)
                tsr_request_fail(r, 502, "BadGatewayError", "%s", why);
        else
                tsr_request_fail(r, 503, "ServiceUnavailableError", "%s", why);
}

/* ------------------------------------------------------------------ worker events */

/* vLLM's iteration_tokens_total: per engine step, the tokens it generated plus the
 * prompts whose prefill ended in it (a sequence's first Output carries its prompt
 * length).  Counted from this router's share of the step, before on_output may close
 * the choices: outputs of choices no longer here (aborted, retried elsewhere) were
 * still computed by the engine, so they count too. */
static void on_step(void *ud, tsr_worker *w, const Tessera__V1__Output *out) {
        tsr_request_layer *L = ud;
        const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
        uint64_t n = 0;

        if (!mi || !mi->n_served_model_names)
                return;
        for (size_t i = 0; i < out->n_outputs; i++)
                n += out->outputs[i]->n_new_token_ids + out->outputs[i]->num_prompt_tokens;
        if (n)
                tsr_metrics_observe_iteration(L->ctx->metrics, mi->served_model_names[0], n);
}

static void on_output(void *ud, tsr_worker *w, const Tessera__V1__RequestOutput *out) {
        tsr_request_layer *L = ud;
        choice *ch = tsr_request_table_get(L, out->request_id);
        rq *r;

        if (!ch || ch->worker != w)
                return;   /* late output of an aborted or finished choice */
        r = ch->r;
        if (!r->first_out)
                r->first_out = ch;
        if (out->num_prompt_tokens)
                ch->prompt_tokens = out->num_prompt_tokens;
        if (out->num_cached_tokens)
                ch->cached_tokens = out->num_cached_tokens;
        if (out->finish_reason != TESSERA__V1__FINISH_REASON__FINISH_NONE) {
                ch->queued_ns = out->queued_ns;
                ch->prefill_ns = out->prefill_ns;
                ch->decode_ns = out->decode_ns;
        }
        if (out->n_new_token_ids) {
                uint64_t now = tsr_now_ns();
                if (!ch->first_token_ns) {
                        ch->first_token_ns = now;
                        tsr_metrics_observe_ttft(L->ctx->metrics, r->model->name, (double)(now - r->arrival_ns) / 1e9);
                } else {
                        tsr_metrics_observe_itl(L->ctx->metrics, r->model->name, (double)(now - ch->last_token_ns) / 1e9);
                }
                ch->last_token_ns = now;
        }
        /* The first Output carries the prompt's logprobs when they were asked. */
        if (r->req.prompt_logprobs >= 0 && out->num_prompt_tokens && tsr_request_take_prompt_lp(ch, out) != TSR_OK) {
                tsr_request_fail(r, 500, "InternalServerError", "out of memory");
                return;
        }
        size_t before = ch->text.len;
        for (size_t i = 0; i < out->n_new_token_ids && !ch->finished; i++) {
                char *delta = NULL;
                size_t dlen = 0;
                ch->n_generated++;
                if (tsr_request_echo_only(r))
                        continue;   /* counted (vLLM's completion_tokens: 1), never shown */
                if (r->req.logprobs >= 0 &&
                    tsr_request_push_lp(ch, out->new_token_ids[i], i < out->n_logprobs ? out->logprobs[i] : NULL) != TSR_OK) {
                        tsr_request_fail(r, 500, "InternalServerError", "out of memory");
                        return;
                }
                if (tsr_detok_push(ch->detok, out->new_token_ids[i], &delta, &dlen) != TSR_OK) {
                        free(delta);
                        tsr_request_fail(r, 500, "InternalServerError", "the worker returned token id %u, outside the vocabulary",
                                     out->new_token_ids[i]);
                        return;
                }
                if (dlen && tsr_buf_append(&ch->text, delta, dlen) != TSR_OK) {
                        free(delta);
                        tsr_request_finish_choice(ch, "length", NULL, true);
                        return;
                }
                free(delta);
                if (r->req.n_stop && dlen) {
                        tsr_stop_match m = tsr_stop_check((char *)ch->text.data, ch->text.len,
                                                  tsr_stop_utf8_count((char *)ch->text.data + before, ch->text.len - before),
                                                  r->req.stop, r->req.n_stop, r->req.include_stop_str_in_output);
                        before = ch->text.len;
                        if (m.index >= 0) {
                                ch->text.len = m.cut_bytes;
                                ch->text.data[ch->text.len] = '\0';
                                tsr_request_finish_choice(ch, "stop", json_string(r->req.stop[m.index]), true);
                                return;
                        }
                }
        }
        if (out->finish_reason != TESSERA__V1__FINISH_REASON__FINISH_NONE) {
                char *tail = NULL;
                size_t tlen = 0;
                const char *reason = "stop";
                json_t *stop_reason = NULL;
                if (!tsr_request_echo_only(r) && tsr_detok_flush(ch->detok, &tail, &tlen) == TSR_OK && tlen)
                        tsr_buf_append(&ch->text, tail, tlen);
                free(tail);
                if (r->req.n_stop && tlen) {
                        tsr_stop_match m = tsr_stop_check((char *)ch->text.data, ch->text.len,
                                                  tsr_stop_utf8_count((char *)ch->text.data + before, ch->text.len - before),
                                                  r->req.stop, r->req.n_stop, r->req.include_stop_str_in_output);
                        if (m.index >= 0) {
                                ch->text.len = m.cut_bytes;
                                ch->text.data[ch->text.len] = '\0';
                                tsr_request_finish_choice(ch, "stop", json_string(r->req.stop[m.index]), false);
                                return;
                        }
                }
                switch (out->finish_reason) {
                case TESSERA__V1__FINISH_REASON__FINISH_STOP:
                        if (out->has_stop_token_id)
                                stop_reason = json_integer(out->stop_token_id);
                        break;
                case TESSERA__V1__FINISH_REASON__FINISH_LENGTH:
                        reason = "length";
                        break;
                case TESSERA__V1__FINISH_REASON__FINISH_ABORT:
                        reason = "abort";
                        break;
                default:
                        tsr_request_fail(r, 500, "InternalServerError", "the worker failed while generating");
                        return;
                }
                tsr_request_finish_choice(ch, reason, stop_reason, false);
                return;
        }
        if (r->streaming)
                tsr_request_stream_choice(r, ch);
}

static void on_error(void *ud, tsr_worker *w, const Tessera__V1__Error *err) {
        tsr_request_layer *L = ud;
        choice *ch = tsr_request_table_get(L, err->request_id);
        if (!ch || ch->worker != w)
                return;
        if (err->retryable) {
                retry_or_fail(ch, err->message);
                return;
        }
        if (err->code == TESSERA__V1__ERROR_CODE__ERROR_INVALID || err->code == TESSERA__V1__ERROR_CODE__ERROR_TOO_LONG)
                tsr_request_fail(ch->r, 400, "BadRequestError", "%s", err->message);
        else
                tsr_request_fail(ch->r, 500, "InternalServerError", "%s", err->message);
}

static void on_worker_down(void *ud, tsr_worker *w) {
        tsr_request_layer *L = ud;
        if (L->ctx->loop_index == 0)    /* see on_status */
                tsr_metrics_worker_gone(L->ctx->metrics, tsr_worker_endpoint(w));
        for (size_t i = 0; i < TABLE_SIZE; i++) {
                choice *ch = L->table[i];
                if (ch && ch->worker == w)
                        retry_or_fail(ch, "the worker serving this request stopped responding");
        }
}

/* Loop thread, from the pool's tick while w is retired: our choices running there. */
static size_t in_flight(void *ud, const tsr_worker *w) {
        tsr_request_layer *L = ud;
        size_t n = 0;
        for (const rq *r = L->active; r; r = r->next_active)
                for (size_t i = 0; i < r->n_choices; i++)
                        n += r->choices[i].wire_id && r->choices[i].worker == w;
        return n;
}

/* Loop thread.  The pool drops w (retired, in_flight 0, so no choice points at it):
 * forget its pending-dispatch entry, whose address a later worker may reuse, and,
 * on loop 0 which feeds /metrics (see on_status), its series. */
static void on_worker_removed(void *ud, tsr_worker *w) {
        tsr_request_layer *L = ud;
        if (L->ctx->loop_index == 0)
                tsr_metrics_worker_remove(L->ctx->metrics, tsr_worker_endpoint(w));
        tsr_placement_recent_forget(&L->recent, w);
        for (size_t i = 0; i < L->n_pending; i++) {
                if (L->pending[i].w == w) {
                        tsr_placement_sent_free(&L->pending[i].sent);
                        L->pending[i] = L->pending[--L->n_pending];
                        break;
                }
        }
}

static void on_model_info(void *ud, tsr_worker *w, const Tessera__V1__ModelInfo *mi) {
        tsr_request_layer *L = ud;
        const tsr_config *cfg = L->ctx->cfg;
        tsr_metrics_cache_info ci;

        tsr_models_registry_on_info(L->ctx->models, mi, tsr_worker_tokenizer(w));
        tsr_metrics_cache_info_defaults(&ci);
        ci.block_size = mi->block_size;
        ci.num_gpu_blocks = (int64_t)mi->kv_blocks_total;
        ci.enable_prefix_caching = mi->prefix_caching;
        ci.gpu_memory_utilization = cfg->gpu_memory_utilization;
        ci.swap_space = cfg->swap_space;
        /* the worker's own flag (a `tessera serve` router never sees worker flags) */
        ci.cache_dtype = mi->kv_cache_dtype && *mi->kv_cache_dtype ? mi->kv_cache_dtype : cfg->kv_cache_dtype;
        ci.prefix_caching_hash_algo = cfg->prefix_caching_hash_algo;
        ci.kv_cache_memory_bytes = cfg->kv_cache_memory_bytes;
        ci.num_gpu_blocks_override = cfg->num_gpu_blocks_override;
        tsr_metrics_add_model(L->ctx->metrics, mi->served_model_names[0], mi->max_model_len, &ci);
}

static void on_status(void *ud, tsr_worker *w, const Tessera__V1__Status *st) {
        tsr_request_layer *L = ud;
        const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
        tsr_metrics_worker_sample s = {
                .num_running = st->num_running,
                .num_waiting = st->num_waiting,
                .kv_blocks_total = st->kv_blocks_total,
                .kv_blocks_free = st->kv_blocks_free,
                .kv_bytes_total = st->kv_bytes_total,
                .kv_bytes_used = st->kv_bytes_used,
                .num_preemptions_total = st->num_preemptions_total,
                .prefix_cache_queries_total = st->prefix_cache_queries_total,
                .prefix_cache_hits_total = st->prefix_cache_hits_total,
                .prompt_tokens_total = st->prompt_tokens_total,
                .generation_tokens_total = st->generation_tokens_total,
                .weight_bytes = mi ? mi->weight_bytes : 0,
        };
        /* With --router-threads every loop hears every worker's Status; the engine
         * series (gauges, and counters fed as deltas of the worker's totals) come from
         * loop 0 alone, or a lagging loop's older sample would read as a restart. */
        if (mi && L->ctx->loop_index == 0)
                tsr_metrics_worker_status(L->ctx->metrics, mi->served_model_names[0], tsr_worker_endpoint(w),
                                          st->boot_epoch, &s);
}


/* The callbacks tsr_request_layer_new registers with the worker pool (the caller sets ud
 * to the layer).  Loop thread, as are the callbacks. */
worker_events tsr_request_worker_events(void) {
        worker_events ev = {
                .on_output = on_output,
                .on_step = on_step,
                .on_error = on_error,
                .on_worker_down = on_worker_down,
                .on_model_info = on_model_info,
                .on_status = on_status,
                .in_flight = in_flight,
                .on_worker_removed = on_worker_removed,
        };
        return ev;
}
