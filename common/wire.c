#include "wire.h"

#include <math.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define E(name) TESSERA__V1__ENVELOPE__MSG_##name

static tsr_status fail(tsr_status st, char *err, size_t errlen, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

static tsr_status fail(tsr_status st, char *err, size_t errlen, const char *fmt, ...) {
        va_list ap;
        if (err && errlen) {
                va_start(ap, fmt);
                vsnprintf(err, errlen, fmt, ap);
                va_end(ap);
        }
        return st;
}

const char *tsr_wire_msg_name(const tsr_envelope *env) {
        switch (env->msg_case) {
        case E(HELLO): return "hello";
        case E(MODEL_INFO): return "model_info";
        case E(SUBMIT): return "submit";
        case E(ABORT): return "abort";
        case E(OUTPUT): return "output";
        case E(ERROR): return "error";
        case E(STATUS): return "status";
        case E(DRAIN): return "drain";
        case E(SHUTDOWN): return "shutdown";
        case E(HEARTBEAT): return "heartbeat";
        case E(RESYNC): return "resync";
        case E(JOIN): return "join";
        case E(PLAN): return "plan";
        case E(STAGE_DONE): return "stage_done";
        case E(NODE_HELLO): return "node_hello";
        case E(NODE_SETUP): return "node_setup";
        case TESSERA__V1__ENVELOPE__MSG__NOT_SET:
        default: return "none";
        }
}

tsr_status tsr_wire_pack(tsr_envelope *env, uint8_t **ret, size_t *ret_len) {
        size_t n;
        uint8_t *p;

        if (!env || env->msg_case == TESSERA__V1__ENVELOPE__MSG__NOT_SET)
                return TSR_E_INVAL;
        env->protocol_version = TSR_PROTO_VERSION;
        n = tessera__v1__envelope__get_packed_size(env);
        if (n > TSR_WIRE_MAX_FRAME)
                return TSR_E_LIMIT;
        p = malloc(n ? n : 1);
        if (!p)
                return TSR_E_NOMEM;
        if (tessera__v1__envelope__pack(env, p) != n) {
                free(p);
                return TSR_E_INTERNAL;
        }
        *ret = p;
        *ret_len = n;
        return TSR_OK;
}

/* A printable, bounded id: what goes into logs and hash tables must be tame. */
static int id_ok(const char *s, int allow_empty) {
        size_t n = 0;
        if (!s)
                return allow_empty;
        for (; s[n]; n++)
                if ((unsigned char)s[n] < 0x20 || s[n] == 0x7f)
                        return 0;
        return (n > 0 || allow_empty) && n <= TSR_WIRE_MAX_ID_LEN;
}

static int finite_in(float v, float lo, float hi) { return isfinite(v) && v >= lo && v <= hi; }

static tsr_status check_sampling(const Tessera__V1__SamplingParams *s, char *err, size_t errlen) {
        if (!s)
                return TSR_OK;   /* absent = engine defaults */
        if (!finite_in(s->temperature, 0.0f, 1e6f))
                return fail(TSR_E_INVAL, err, errlen, "submit: temperature out of range");
        if (!finite_in(s->top_p, 0.0f, 1.0f))
                return fail(TSR_E_INVAL, err, errlen, "submit: top_p out of range");
        if (s->top_k < -1)
                return fail(TSR_E_INVAL, err, errlen, "submit: top_k out of range");
        if (!finite_in(s->min_p, 0.0f, 1.0f))
                return fail(TSR_E_INVAL, err, errlen, "submit: min_p out of range");
        if (!finite_in(s->repetition_penalty, 0.0f, 1e6f))
                return fail(TSR_E_INVAL, err, errlen, "submit: repetition_penalty out of range");
        if (!finite_in(s->frequency_penalty, -2.0f, 2.0f) || !finite_in(s->presence_penalty, -2.0f, 2.0f))
                return fail(TSR_E_INVAL, err, errlen, "submit: penalty out of range");
        for (size_t i = 0; i < s->n_logit_bias; i++)
                if (!s->logit_bias[i] || !finite_in(s->logit_bias[i]->value, -100.0f, 100.0f))
                        return fail(TSR_E_INVAL, err, errlen, "submit: logit_bias out of range");
        return TSR_OK;
}

static tsr_status check_submit(const Tessera__V1__Submit *m, char *err, size_t errlen) {
        if (!id_ok(m->request_id, 0))
                return fail(TSR_E_INVAL, err, errlen, "submit: bad request_id");
        if (m->n_prompt_token_ids == 0)
                return fail(TSR_E_INVAL, err, errlen, "submit %s: empty prompt", m->request_id);
        if (m->n_prompt_token_ids > TSR_WIRE_MAX_PROMPT_TOKENS)
                return fail(TSR_E_LIMIT, err, errlen, "submit %s: %zu prompt tokens is over the limit",
                            m->request_id, m->n_prompt_token_ids);
        for (size_t i = 0; i < m->n_prompt_token_ids; i++)
                if (m->prompt_token_ids[i] > TSR_WIRE_MAX_TOKEN_ID)
                        return fail(TSR_E_INVAL, err, errlen, "submit %s: token id out of range", m->request_id);
        if (m->max_tokens == 0)
                return fail(TSR_E_INVAL, err, errlen, "submit %s: max_tokens must be >= 1", m->request_id);
        if (m->min_tokens > m->max_tokens)
                return fail(TSR_E_INVAL, err, errlen, "submit %s: min_tokens > max_tokens", m->request_id);
        if (m->logprobs < -1 || m->logprobs > TSR_WIRE_MAX_LOGPROBS || m->prompt_logprobs < -1 ||
            m->prompt_logprobs > TSR_WIRE_MAX_LOGPROBS)
                return fail(TSR_E_INVAL, err, errlen, "submit %s: logprobs out of range", m->request_id);
        if (m->structured_output && ((int)m->structured_output->kind < 0 ||
                                     (int)m->structured_output->kind > TESSERA__V1__STRUCTURED_OUTPUT__KIND__GRAMMAR))
                return fail(TSR_E_INVAL, err, errlen, "submit %s: unknown structured output kind", m->request_id);
        return check_sampling(m->sampling, err, errlen);
}

static tsr_status check_output(const Tessera__V1__Output *m, char *err, size_t errlen) {
        for (size_t i = 0; i < m->n_outputs; i++) {
                const Tessera__V1__RequestOutput *o = m->outputs[i];
                if (!o || !id_ok(o->request_id, 0))
                        return fail(TSR_E_INVAL, err, errlen, "output: bad request_id");
                if (o->finish_reason < TESSERA__V1__FINISH_REASON__FINISH_NONE ||
                    o->finish_reason > TESSERA__V1__FINISH_REASON__FINISH_ERROR)
                        return fail(TSR_E_INVAL, err, errlen, "output %s: unknown finish_reason", o->request_id);
                if (o->n_logprobs && o->n_logprobs != o->n_new_token_ids)
                        return fail(TSR_E_INVAL, err, errlen, "output %s: %zu logprobs for %zu tokens",
                                    o->request_id, o->n_logprobs, o->n_new_token_ids);
                for (size_t j = 0; j < o->n_logprobs; j++) {
                        const Tessera__V1__TokenLogprobs *lp = o->logprobs[j];
                        if (!lp || lp->n_top_token_ids != lp->n_top_logprobs ||
                            lp->n_top_token_ids > TSR_WIRE_MAX_LOGPROBS)
                                return fail(TSR_E_INVAL, err, errlen, "output %s: malformed logprobs", o->request_id);
                }
        }
        return TSR_OK;
}

static tsr_status check_model_info(const Tessera__V1__ModelInfo *m, char *err, size_t errlen) {
        if (!id_ok(m->worker_id, 0))
                return fail(TSR_E_INVAL, err, errlen, "model_info: bad worker_id");
        if (m->n_served_model_names == 0)
                return fail(TSR_E_INVAL, err, errlen, "model_info: no served model name");
        for (size_t i = 0; i < m->n_served_model_names; i++)
                if (!id_ok(m->served_model_names[i], 0))
                        return fail(TSR_E_INVAL, err, errlen, "model_info: bad served model name");
        if (m->block_size == 0 || m->block_size > 4096)
                return fail(TSR_E_INVAL, err, errlen, "model_info: block_size %u out of range", m->block_size);
        if (m->max_model_len == 0)
                return fail(TSR_E_INVAL, err, errlen, "model_info: max_model_len is 0");
        if (m->tokenizer_case == TESSERA__V1__MODEL_INFO__TOKENIZER_GGUF) {
                const Tessera__V1__GgufTokenizer *g = m->gguf;
                if (g->n_scores && g->n_scores != g->n_tokens)
                        return fail(TSR_E_INVAL, err, errlen, "model_info: gguf scores/tokens mismatch");
                if (g->n_token_types && g->n_token_types != g->n_tokens)
                        return fail(TSR_E_INVAL, err, errlen, "model_info: gguf token_types/tokens mismatch");
        }
        return TSR_OK;
}

static tsr_status check_status(const Tessera__V1__Status *m, char *err, size_t errlen) {
        if (!id_ok(m->worker_id, 0))
                return fail(TSR_E_INVAL, err, errlen, "status: bad worker_id");
        if (m->kv_blocks_free > m->kv_blocks_total || m->kv_blocks_active > m->kv_blocks_total)
                return fail(TSR_E_INVAL, err, errlen, "status %s: kv blocks free/active over total", m->worker_id);
        if (m->state < TESSERA__V1__STATUS__STATE__STARTING || m->state > TESSERA__V1__STATUS__STATE__UNHEALTHY)
                return fail(TSR_E_INVAL, err, errlen, "status %s: unknown state", m->worker_id);
        return TSR_OK;
}

/* The worker derives its reaping deadline from interval_ms: 0 would reap at once,
 * a huge value would never reap. */
static tsr_status check_heartbeat(const Tessera__V1__Heartbeat *m, char *err, size_t errlen) {
        if (!id_ok(m->router_id, 1))
                return fail(TSR_E_INVAL, err, errlen, "heartbeat: bad router_id");
        if (m->interval_ms == 0 || m->interval_ms > TSR_WIRE_MAX_HEARTBEAT_MS)
                return fail(TSR_E_INVAL, err, errlen, "heartbeat: interval_ms %u out of range 1 .. %u", m->interval_ms,
                            TSR_WIRE_MAX_HEARTBEAT_MS);
        return TSR_OK;
}

static tsr_status check_abort(const Tessera__V1__Abort *m, char *err, size_t errlen) {
        for (size_t i = 0; i < m->n_request_ids; i++)
                if (!id_ok(m->request_ids[i], 0))
                        return fail(TSR_E_INVAL, err, errlen, "abort: bad request_id");
        return TSR_OK;
}

/* A node's rendezvous: ranks within the group, text fields of a bounded size (they are
 * printed in error messages and log lines). */
static bool text_ok(const char *s) { return s && strlen(s) <= TSR_WIRE_MAX_ID_LEN; }

static tsr_status check_node_hello(const Tessera__V1__NodeHello *m, char *err, size_t errlen) {
        if (m->nnodes < 2 || m->nnodes > TSR_WIRE_MAX_NODES || m->node_rank >= m->nnodes)
                return fail(TSR_E_INVAL, err, errlen, "node_hello: node_rank %u of nnodes %u out of range",
                            m->node_rank, m->nnodes);
        if (!text_ok(m->tessera_version) || !text_ok(m->purpose) || !text_ok(m->data_endpoint) ||
            !text_ok(m->hostname) || !m->fingerprint || strlen(m->fingerprint) > 4096)
                return fail(TSR_E_INVAL, err, errlen, "node_hello: a text field is too long");
        return TSR_OK;
}

static tsr_status check_node_setup(const Tessera__V1__NodeSetup *m, char *err, size_t errlen) {
        if (m->n_data_endpoints > TSR_WIRE_MAX_NODES || m->n_hostnames != m->n_data_endpoints)
                return fail(TSR_E_INVAL, err, errlen, "node_setup: %zu endpoints, %zu hostnames",
                            m->n_data_endpoints, m->n_hostnames);
        for (size_t i = 0; i < m->n_data_endpoints; i++)
                if (!text_ok(m->data_endpoints[i]) || !text_ok(m->hostnames[i]))
                        return fail(TSR_E_INVAL, err, errlen, "node_setup: a text field is too long");
        if (!m->error || strlen(m->error) > 4096)
                return fail(TSR_E_INVAL, err, errlen, "node_setup: error text too long");
        return TSR_OK;
}

tsr_status tsr_wire_check(const tsr_envelope *env, char *err, size_t errlen) {
        switch (env->msg_case) {
        case E(HELLO):
                return id_ok(env->hello->router_id, 1) ? TSR_OK
                                                       : fail(TSR_E_INVAL, err, errlen, "hello: bad router_id");
        case E(MODEL_INFO): return check_model_info(env->model_info, err, errlen);
        case E(SUBMIT): return check_submit(env->submit, err, errlen);
        case E(ABORT): return check_abort(env->abort, err, errlen);
        case E(OUTPUT): return check_output(env->output, err, errlen);
        case E(ERROR):
                return id_ok(env->error->request_id, 1) ? TSR_OK
                                                        : fail(TSR_E_INVAL, err, errlen, "error: bad request_id");
        case E(STATUS): return check_status(env->status, err, errlen);
        case E(HEARTBEAT): return check_heartbeat(env->heartbeat, err, errlen);
        case E(RESYNC):
                return id_ok(env->resync->router_id, 1) ? TSR_OK
                                                        : fail(TSR_E_INVAL, err, errlen, "resync: bad router_id");
        case E(NODE_HELLO): return check_node_hello(env->node_hello, err, errlen);
        case E(NODE_SETUP): return check_node_setup(env->node_setup, err, errlen);
        case E(DRAIN):
        case E(SHUTDOWN):
        case E(JOIN):
        case E(PLAN):
        case E(STAGE_DONE):
                return TSR_OK;
        case TESSERA__V1__ENVELOPE__MSG__NOT_SET:
        default:
                return fail(TSR_E_PROTO, err, errlen, "envelope carries no known message");
        }
}

/* protobuf-c 1.4 refuses field number 0 in a one-byte tag but keeps it, as an unknown
 * field, when the tag is spelled in two bytes (0x85 0x00).  Such a frame is not valid
 * protobuf and would no longer round-trip, so refuse it: walk every (sub)message for an
 * unknown field tagged 0.  Depth is bounded by protobuf-c's own nesting limit. */
static bool has_field0(const ProtobufCMessage *m) {
        const ProtobufCMessageDescriptor *d;
        if (!m)
                return false;
        for (unsigned i = 0; i < m->n_unknown_fields; i++)
                if (m->unknown_fields[i].tag == 0)
                        return true;
        d = m->descriptor;
        for (unsigned f = 0; f < d->n_fields; f++) {
                const ProtobufCFieldDescriptor *fd = &d->fields[f];
                const char *base = (const char *)m;
                if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
                        continue;
                if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
                        size_t n = *(const size_t *)(base + fd->quantifier_offset);
                        ProtobufCMessage *const *arr = *(ProtobufCMessage *const *const *)(base + fd->offset);
                        for (size_t k = 0; k < n; k++)
                                if (has_field0(arr[k]))
                                        return true;
                } else {
                        /* A oneof member is only present when its case says so. */
                        if ((fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
                            *(const uint32_t *)(base + fd->quantifier_offset) != fd->id)
                                continue;
                        if (has_field0(*(ProtobufCMessage *const *)(base + fd->offset)))
                                return true;
                }
        }
        return false;
}

tsr_status tsr_wire_unpack(const uint8_t *p, size_t len, size_t max_len, tsr_envelope **ret, char *err,
                           size_t errlen) {
        tsr_envelope *env;
        tsr_status st;

        if (max_len == 0)
                max_len = TSR_WIRE_MAX_FRAME;
        if (len > max_len)
                return fail(TSR_E_LIMIT, err, errlen, "frame of %zu bytes is over the %zu byte limit", len, max_len);
        /* protobuf-c validates every length against the buffer and returns NULL on
         * malformed input, so hostile declared lengths cannot read past `p + len`. */
        env = tessera__v1__envelope__unpack(NULL, len, p);
        if (!env)
                return fail(TSR_E_PROTO, err, errlen, "frame of %zu bytes is not a valid Envelope", len);
        if (has_field0(&env->base)) {
                st = fail(TSR_E_PROTO, err, errlen, "frame of %zu bytes has a field numbered 0", len);
                goto fail_free;
        }
        if (env->protocol_version / 1000u != TSR_PROTO_MAJOR) {
                st = fail(TSR_E_PROTO, err, errlen, "protocol version %u.%u, this side speaks %u.%u",
                          env->protocol_version / 1000u, env->protocol_version % 1000u, TSR_PROTO_MAJOR,
                          TSR_PROTO_MINOR);
                goto fail_free;
        }
        st = tsr_wire_check(env, err, errlen);
        if (st != TSR_OK)
                goto fail_free;
        *ret = env;
        return TSR_OK;
fail_free:
        tessera__v1__envelope__free_unpacked(env, NULL);
        return st;
}

void tsr_wire_free(tsr_envelope *env) {
        if (env)
                tessera__v1__envelope__free_unpacked(env, NULL);
}
