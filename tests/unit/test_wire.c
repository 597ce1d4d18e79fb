/* common/wire: Envelope round trips, and every malformed frame rejected cleanly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/wire.h"

static uint8_t *pack(tsr_envelope *env, size_t *n) {
        uint8_t *p = NULL;
        assert_int_equal(tsr_wire_pack(env, &p, n), TSR_OK);
        return p;
}

static void make_submit(tsr_envelope *env, Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp,
                        uint32_t *ids, size_t n_ids) {
        tessera__v1__envelope__init(env);
        tessera__v1__submit__init(s);
        tessera__v1__sampling_params__init(sp);
        sp->temperature = 0.7f;
        sp->top_p = 0.9f;
        sp->top_k = 40;
        sp->repetition_penalty = 1.1f;
        s->request_id = "cmpl-abc-0";
        s->prompt_token_ids = ids;
        s->n_prompt_token_ids = n_ids;
        s->sampling = sp;
        s->max_tokens = 16;
        s->logprobs = -1;
        s->prompt_logprobs = -1;
        env->msg_case = TESSERA__V1__ENVELOPE__MSG_SUBMIT;
        env->submit = s;
}

static void test_submit_round_trip(void **state) {
        tsr_envelope env, *out = NULL;
        Tessera__V1__Submit s;
        Tessera__V1__SamplingParams sp;
        uint32_t ids[] = {1, 2, 3, 49151, 0};
        size_t n;
        char err[256] = "";

        make_submit(&env, &s, &sp, ids, 5);
        uint8_t *p = pack(&env, &n);
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_OK);
        assert_int_equal(out->protocol_version, TSR_PROTO_VERSION);
        assert_int_equal(out->msg_case, TESSERA__V1__ENVELOPE__MSG_SUBMIT);
        assert_string_equal(tsr_wire_msg_name(out), "submit");
        assert_string_equal(out->submit->request_id, "cmpl-abc-0");
        assert_int_equal(out->submit->n_prompt_token_ids, 5);
        assert_memory_equal(out->submit->prompt_token_ids, ids, sizeof(ids));
        assert_int_equal(out->submit->max_tokens, 16);
        assert_int_equal(out->submit->logprobs, -1);
        assert_float_equal(out->submit->sampling->temperature, 0.7f, 0);
        assert_int_equal(out->submit->sampling->top_k, 40);
        tsr_wire_free(out);
        free(p);
}

static void test_model_info_and_status_round_trip(void **state) {
        tsr_envelope env, *out = NULL;
        Tessera__V1__ModelInfo mi;
        Tessera__V1__HfTokenizer hf;
        char *names[] = {"smol", "smol-alias"};
        uint32_t eos[] = {2, 0};
        static uint8_t big[1 << 20];
        size_t n;
        char err[256];

        memset(big, 'x', sizeof(big));
        tessera__v1__envelope__init(&env);
        tessera__v1__model_info__init(&mi);
        tessera__v1__hf_tokenizer__init(&hf);
        hf.tokenizer_json.data = big;
        hf.tokenizer_json.len = sizeof(big);
        mi.worker_id = "w-1";
        mi.boot_epoch = 77;
        mi.served_model_names = names;
        mi.n_served_model_names = 2;
        mi.max_model_len = 8192;
        mi.block_size = 16;
        mi.eos_token_ids = eos;
        mi.n_eos_token_ids = 2;
        mi.tokenizer_case = TESSERA__V1__MODEL_INFO__TOKENIZER_HF;
        mi.hf = &hf;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_MODEL_INFO;
        env.model_info = &mi;
        uint8_t *p = pack(&env, &n);
        assert_true(n > sizeof(big));
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_OK);
        assert_int_equal(out->model_info->n_served_model_names, 2);
        assert_string_equal(out->model_info->served_model_names[1], "smol-alias");
        assert_int_equal(out->model_info->hf->tokenizer_json.len, sizeof(big));
        assert_int_equal(out->model_info->boot_epoch, 77);
        tsr_wire_free(out);
        /* The same frame under a smaller cap is refused before decoding. */
        assert_int_equal(tsr_wire_unpack(p, n, 1024, &out, err, sizeof(err)), TSR_E_LIMIT);
        assert_non_null(strstr(err, "limit"));
        free(p);

        Tessera__V1__Status st;
        tessera__v1__status__init(&st);
        st.worker_id = "w-1";
        st.kv_blocks_total = 100;
        st.kv_blocks_free = 60;
        st.state = TESSERA__V1__STATUS__STATE__READY;
        tessera__v1__envelope__init(&env);
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_STATUS;
        env.status = &st;
        p = pack(&env, &n);
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_OK);
        assert_int_equal(out->status->kv_blocks_free, 60);
        assert_int_equal(out->status->state, TESSERA__V1__STATUS__STATE__READY);
        tsr_wire_free(out);
        free(p);
}

static void test_pack_refuses_empty(void **state) {
        tsr_envelope env;
        uint8_t *p = NULL;
        size_t n = 0;
        tessera__v1__envelope__init(&env);
        assert_int_equal(tsr_wire_pack(&env, &p, &n), TSR_E_INVAL);
        assert_null(p);
}

static void test_truncated_and_garbage(void **state) {
        tsr_envelope env, *out;
        Tessera__V1__Submit s;
        Tessera__V1__SamplingParams sp;
        uint32_t ids[64];
        size_t n;
        char err[256];

        for (int i = 0; i < 64; i++)
                ids[i] = (uint32_t)i * 1000u;
        make_submit(&env, &s, &sp, ids, 64);
        uint8_t *p = pack(&env, &n);
        /* Every prefix either fails to decode or decodes into a message that passed
         * validation; none may crash or leak (ASan run). */
        int rejected = 0;
        for (size_t len = 0; len < n; len++) {
                out = NULL;
                tsr_status st = tsr_wire_unpack(p, len, 0, &out, err, sizeof(err));
                if (st == TSR_OK) {
                        assert_int_equal(tsr_wire_check(out, NULL, 0), TSR_OK);
                        tsr_wire_free(out);
                } else {
                        assert_null(out);
                        assert_true(st == TSR_E_PROTO || st == TSR_E_INVAL);
                        rejected++;
                }
        }
        assert_true(rejected > (int)n / 2);
        free(p);

        /* Pseudo-random garbage. */
        uint8_t junk[512];
        uint32_t x = 12345;
        for (int round = 0; round < 2000; round++) {
                size_t len = (size_t)(x % sizeof(junk));
                for (size_t i = 0; i < len; i++) {
                        x = x * 1103515245u + 12345u;
                        junk[i] = (uint8_t)(x >> 16);
                }
                out = NULL;
                if (tsr_wire_unpack(junk, len, 0, &out, err, sizeof(err)) == TSR_OK) {
                        assert_int_equal(tsr_wire_check(out, NULL, 0), TSR_OK);
                        tsr_wire_free(out);
                }
        }
}

static void test_huge_declared_length(void **state) {
        /* field 20 (submit), wire type 2, varint length 0x7fffffff, then nothing. */
        const uint8_t frame[] = {0xa2, 0x01, 0xff, 0xff, 0xff, 0xff, 0x07, 0x0a};
        tsr_envelope *out = NULL;
        char err[256];
        assert_int_equal(tsr_wire_unpack(frame, sizeof(frame), 0, &out, err, sizeof(err)), TSR_E_PROTO);
        assert_null(out);
        assert_non_null(strstr(err, "not a valid Envelope"));
}

static void test_other_major_version(void **state) {
        tsr_envelope env, *out = NULL;
        Tessera__V1__Hello h;
        size_t n;
        char err[256];
        tessera__v1__envelope__init(&env);
        tessera__v1__hello__init(&h);
        h.router_id = "r1";
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_HELLO;
        env.hello = &h;
        uint8_t *p = pack(&env, &n);
        /* Re-pack by hand with version 2.0: pack always stamps the current version. */
        free(p);
        env.protocol_version = 2000;
        n = tessera__v1__envelope__get_packed_size(&env);
        p = malloc(n);
        tessera__v1__envelope__pack(&env, p);
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_E_PROTO);
        assert_non_null(strstr(err, "protocol version 2.0"));
        free(p);
        /* A newer minor of the same major is accepted. */
        env.protocol_version = TSR_PROTO_MAJOR * 1000 + 7;
        n = tessera__v1__envelope__get_packed_size(&env);
        p = malloc(n);
        tessera__v1__envelope__pack(&env, p);
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_OK);
        tsr_wire_free(out);
        free(p);
}

static void test_empty_envelope_rejected(void **state) {
        tsr_envelope env, *out = NULL;
        char err[256];
        tessera__v1__envelope__init(&env);
        env.protocol_version = TSR_PROTO_VERSION;
        size_t n = tessera__v1__envelope__get_packed_size(&env);
        uint8_t buf[16];
        tessera__v1__envelope__pack(&env, buf);
        assert_int_equal(tsr_wire_unpack(buf, n, 0, &out, err, sizeof(err)), TSR_E_PROTO);
        assert_non_null(strstr(err, "no known message"));
}

/* Found by the wire fuzzer: protobuf-c keeps a field numbered 0 as an unknown field
 * when its tag is spelled in two bytes; such frames must be refused, at the top level
 * and inside a nested message. */
static void test_field_zero_refused(void **state) {
        const uint8_t top[] = {0x08, 0xe8, 0x07, 0x52, 0x00, 0x85, 0x00, 0x00, 0x00, 0x00, 0x00};
        const uint8_t nested[] = {0x08, 0xe8, 0x07, 0x52, 0x03, 0x80, 0x00, 0x01};
        tsr_envelope *out = NULL;
        char err[256];
        assert_int_equal(tsr_wire_unpack(top, sizeof(top), 0, &out, err, sizeof(err)), TSR_E_PROTO);
        assert_non_null(strstr(err, "numbered 0"));
        assert_int_equal(tsr_wire_unpack(nested, sizeof(nested), 0, &out, err, sizeof(err)), TSR_E_PROTO);
        assert_null(out);
}

static tsr_status unpack_submit_variant(void (*mutate)(Tessera__V1__Submit *, Tessera__V1__SamplingParams *),
                                        char *err, size_t errlen) {
        tsr_envelope env, *out = NULL;
        Tessera__V1__Submit s;
        Tessera__V1__SamplingParams sp;
        uint32_t ids[] = {5, 6, 7};
        size_t n;
        make_submit(&env, &s, &sp, ids, 3);
        mutate(&s, &sp);
        uint8_t *p = pack(&env, &n);
        tsr_status st = tsr_wire_unpack(p, n, 0, &out, err, errlen);
        if (st == TSR_OK)
                tsr_wire_free(out);
        free(p);
        return st;
}

static void m_empty_id(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->request_id = ""; }
static void m_ctrl_id(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->request_id = "a\nb"; }
static void m_no_prompt(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->n_prompt_token_ids = 0; }
static void m_zero_max(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->max_tokens = 0; }
static void m_min_gt_max(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->min_tokens = 17; }
static void m_nan_temp(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { sp->temperature = NAN; }
static void m_top_p(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { sp->top_p = 1.5f; }
static void m_top_k(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { sp->top_k = -2; }
static void m_logprobs(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->logprobs = 5000; }
static void m_big_token(Tessera__V1__Submit *s, Tessera__V1__SamplingParams *sp) { s->prompt_token_ids[1] = 0x80000000u; }

static void test_submit_field_validation(void **state) {
        char err[256];
        static const struct {
                void (*mutate)(Tessera__V1__Submit *, Tessera__V1__SamplingParams *);
                const char *needle;
        } cases[] = {
                {m_empty_id, "request_id"}, {m_ctrl_id, "request_id"}, {m_no_prompt, "empty prompt"},
                {m_zero_max, "max_tokens"}, {m_min_gt_max, "min_tokens"}, {m_nan_temp, "temperature"},
                {m_top_p, "top_p"}, {m_top_k, "top_k"}, {m_logprobs, "logprobs"}, {m_big_token, "token id"},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                err[0] = 0;
                assert_int_equal(unpack_submit_variant(cases[i].mutate, err, sizeof(err)), TSR_E_INVAL);
                if (!strstr(err, cases[i].needle))
                        fail_msg("case %zu: '%s' does not mention '%s'", i, err, cases[i].needle);
        }
}

static void test_status_invariants(void **state) {
        tsr_envelope env, *out = NULL;
        Tessera__V1__Status st;
        size_t n;
        char err[256];
        tessera__v1__envelope__init(&env);
        tessera__v1__status__init(&st);
        st.worker_id = "w";
        st.kv_blocks_total = 10;
        st.kv_blocks_free = 11;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_STATUS;
        env.status = &st;
        uint8_t *p = pack(&env, &n);
        assert_int_equal(tsr_wire_unpack(p, n, 0, &out, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "over total"));
        free(p);
}

/* Heartbeat: round trip, and the interval the worker's reaping deadline rests on is
 * bounded (0 would reap at once, a huge one never). */
static void test_heartbeat(void **state) {
        static const struct {
                const char *router_id;
                uint32_t interval_ms;
                tsr_status want;
                const char *needle;
        } cases[] = {
                {"router-h-1-abc", 250, TSR_OK, NULL},
                {"router-h-1-abc", 1, TSR_OK, NULL},
                {"router-h-1-abc", TSR_WIRE_MAX_HEARTBEAT_MS, TSR_OK, NULL},
                {"", 250, TSR_OK, NULL},
                {"router-h-1-abc", 0, TSR_E_INVAL, "interval_ms 0 out of range"},
                {"router-h-1-abc", TSR_WIRE_MAX_HEARTBEAT_MS + 1, TSR_E_INVAL, "interval_ms 60001"},
                {"bad\nid", 250, TSR_E_INVAL, "heartbeat: bad router_id"},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                tsr_envelope env, *out = NULL;
                Tessera__V1__Heartbeat hb;
                size_t n;
                char err[256] = "";
                tessera__v1__envelope__init(&env);
                tessera__v1__heartbeat__init(&hb);
                hb.router_id = (char *)cases[i].router_id;
                hb.interval_ms = cases[i].interval_ms;
                hb.seq = 7 + i;
                env.msg_case = TESSERA__V1__ENVELOPE__MSG_HEARTBEAT;
                env.heartbeat = &hb;
                uint8_t *p = pack(&env, &n);
                tsr_status st = tsr_wire_unpack(p, n, 0, &out, err, sizeof(err));
                free(p);
                if (st != cases[i].want)
                        fail_msg("case %zu: status %d, want %d (%s)", i, st, cases[i].want, err);
                if (cases[i].want != TSR_OK) {
                        if (!strstr(err, cases[i].needle))
                                fail_msg("case %zu: '%s' does not mention '%s'", i, err, cases[i].needle);
                        continue;
                }
                assert_string_equal(tsr_wire_msg_name(out), "heartbeat");
                assert_string_equal(out->heartbeat->router_id, cases[i].router_id);
                assert_int_equal(out->heartbeat->interval_ms, cases[i].interval_ms);
                assert_int_equal(out->heartbeat->seq, 7 + i);
                tsr_wire_free(out);
        }
}

/* The rendezvous of a multi-node group: ranks inside the group, bounded text, a setup
 * whose lists agree. */
static void test_node_hello_setup(void **state) {
        static const struct {
                uint32_t nnodes, rank;
                size_t endpoint_len;
                tsr_status want;
        } hellos[] = {
                {2, 1, 20, TSR_OK},
                {TSR_WIRE_MAX_NODES, TSR_WIRE_MAX_NODES - 1, TSR_WIRE_MAX_ID_LEN, TSR_OK},
                {2, 2, 20, TSR_E_INVAL},                        /* rank outside the group */
                {1, 0, 20, TSR_E_INVAL},                        /* a group of one has no rendezvous */
                {TSR_WIRE_MAX_NODES + 1, 1, 20, TSR_E_INVAL},
                {2, 1, TSR_WIRE_MAX_ID_LEN + 1, TSR_E_INVAL},   /* text too long */
        };
        char long_text[TSR_WIRE_MAX_ID_LEN + 2];
        (void)state;
        for (size_t i = 0; i < sizeof(hellos) / sizeof(hellos[0]); i++) {
                tsr_envelope env, *out = NULL;
                Tessera__V1__NodeHello h;
                size_t n;
                char err[256] = "";
                memset(long_text, 'e', sizeof(long_text));
                long_text[hellos[i].endpoint_len] = 0;
                tessera__v1__envelope__init(&env);
                tessera__v1__node_hello__init(&h);
                h.nnodes = hellos[i].nnodes;
                h.node_rank = hellos[i].rank;
                h.data_endpoint = long_text;
                h.fingerprint = "sizes=4096\n";
                env.msg_case = TESSERA__V1__ENVELOPE__MSG_NODE_HELLO;
                env.node_hello = &h;
                uint8_t *p = pack(&env, &n);
                tsr_status st = tsr_wire_unpack(p, n, 0, &out, err, sizeof(err));
                free(p);
                if (st != hellos[i].want)
                        fail_msg("hello %zu: status %d, want %d (%s)", i, st, hellos[i].want, err);
                if (st == TSR_OK) {
                        assert_string_equal(tsr_wire_msg_name(out), "node_hello");
                        assert_int_equal(out->node_hello->node_rank, hellos[i].rank);
                        tsr_wire_free(out);
                }
        }
        for (int good = 0; good < 2; good++) {
                tsr_envelope env, *out = NULL;
                Tessera__V1__NodeSetup ns;
                char *eps[2] = {"tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000"}, *hosts[2] = {"a", "b"};
                size_t n;
                char err[256] = "";
                tessera__v1__envelope__init(&env);
                tessera__v1__node_setup__init(&ns);
                ns.epoch = 99;
                ns.n_data_endpoints = 2;
                ns.data_endpoints = eps;
                ns.n_hostnames = good ? 2 : 1;          /* the lists must agree */
                ns.hostnames = hosts;
                env.msg_case = TESSERA__V1__ENVELOPE__MSG_NODE_SETUP;
                env.node_setup = &ns;
                uint8_t *p = pack(&env, &n);
                tsr_status st = tsr_wire_unpack(p, n, 0, &out, err, sizeof(err));
                free(p);
                assert_int_equal(st, good ? TSR_OK : TSR_E_INVAL);
                if (good) {
                        assert_int_equal(out->node_setup->epoch, 99);
                        assert_string_equal(out->node_setup->data_endpoints[1], eps[1]);
                        tsr_wire_free(out);
                }
        }
}

static void test_resync(void **state) {
        (void)state;
        for (int good = 0; good < 2; good++) {
                tsr_envelope env, *out = NULL;
                Tessera__V1__Resync rs;
                size_t n;
                char err[256] = "";
                tessera__v1__envelope__init(&env);
                tessera__v1__resync__init(&rs);
                rs.router_id = good ? "router-h-1-abc" : "bad\x01id";
                rs.after_seq = 41;
                env.msg_case = TESSERA__V1__ENVELOPE__MSG_RESYNC;
                env.resync = &rs;
                uint8_t *p = pack(&env, &n);
                tsr_status st = tsr_wire_unpack(p, n, 0, &out, err, sizeof(err));
                free(p);
                if (!good) {
                        assert_int_equal(st, TSR_E_INVAL);
                        assert_non_null(strstr(err, "resync: bad router_id"));
                        continue;
                }
                assert_int_equal(st, TSR_OK);
                assert_string_equal(tsr_wire_msg_name(out), "resync");
                assert_string_equal(out->resync->router_id, "router-h-1-abc");
                assert_int_equal(out->resync->after_seq, 41);
                tsr_wire_free(out);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_resync),
                cmocka_unit_test(test_submit_round_trip),
                cmocka_unit_test(test_model_info_and_status_round_trip),
                cmocka_unit_test(test_pack_refuses_empty),
                cmocka_unit_test(test_truncated_and_garbage),
                cmocka_unit_test(test_huge_declared_length),
                cmocka_unit_test(test_other_major_version),
                cmocka_unit_test(test_empty_envelope_rejected),
                cmocka_unit_test(test_field_zero_refused),
                cmocka_unit_test(test_submit_field_validation),
                cmocka_unit_test(test_status_invariants),
                cmocka_unit_test(test_heartbeat),
                cmocka_unit_test(test_node_hello_setup),
        };
        return cmocka_run_group_tests_name("wire", tests, NULL, NULL);
}
