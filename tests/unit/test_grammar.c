/* test_grammar.c - grammar/ (xgrammar behind C): the router's spec check, the mask
 * helpers, and over SmolLM2's real 49,152-token vocabulary (the demo model's GGUF
 * tokenizer, via worker/engine/grammar_vocab.c): compile, fill masks, accept, roll
 * back, terminate; the compile thread with a good and a bad spec. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "grammar/grammar.h"
#include "grammar/pool.h"
#include "tests/tsr_test.h"
#include "worker/engine/grammar_vocab.h"

static tsr_grammar_spec spec_of(tsr_grammar_kind kind, const char *text) {
        return (tsr_grammar_spec){.kind = kind, .text = text, .len = text ? strlen(text) : 0, .any_whitespace = false};
}

static tsr_status check(tsr_grammar_kind kind, const char *text, char *err, size_t errlen) {
        tsr_grammar_spec s = spec_of(kind, text);
        return tsr_grammar_check(&s, err, errlen);
}

static void test_check(void **state) {
        char err[256];
        (void)state;
        assert_int_equal(check(TSR_GRAMMAR_JSON_SCHEMA,
                               "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":1}},"
                               "\"required\":[\"a\"],\"additionalProperties\":false}", err, sizeof(err)),
                         TSR_OK);
        assert_int_equal(check(TSR_GRAMMAR_JSON_OBJECT, "", err, sizeof(err)), TSR_OK);
        assert_int_equal(check(TSR_GRAMMAR_REGEX, "[0-9]{3}-[a-z]+", err, sizeof(err)), TSR_OK);
        assert_int_equal(check(TSR_GRAMMAR_CHOICE, "[\"yes\",\"no \\\"quoted\\\"\\n\"]", err, sizeof(err)), TSR_OK);
        assert_int_equal(check(TSR_GRAMMAR_EBNF, "root ::= \"a\" root | \"b\"", err, sizeof(err)), TSR_OK);

        /* Refused, each with a message and no crash. */
        err[0] = '\0';
        assert_int_equal(check(TSR_GRAMMAR_JSON_SCHEMA, "{\"type\": ", err, sizeof(err)), TSR_E_INVAL);
        assert_true(err[0] != '\0');
        assert_null(strstr(err, ".cc:"));   /* our build path is not the client's business */
        err[0] = '\0';
        assert_int_equal(check(TSR_GRAMMAR_JSON_SCHEMA, "{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 1}",
                               err, sizeof(err)),
                         TSR_E_INVAL);
        assert_true(err[0] != '\0');
        assert_int_equal(check(TSR_GRAMMAR_REGEX, "(unclosed", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(check(TSR_GRAMMAR_CHOICE, "[]", err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "empty"));
        assert_int_equal(check(TSR_GRAMMAR_CHOICE, "[1, 2]", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(check(TSR_GRAMMAR_CHOICE, "not json", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(check(TSR_GRAMMAR_EBNF, "root ::= ", err, sizeof(err)), TSR_E_INVAL);
        assert_int_equal(check(TSR_GRAMMAR_EBNF, "start ::= \"a\"", err, sizeof(err)), TSR_E_INVAL);   /* no root */
}

static void test_mask_helpers(void **state) {
        float logits[40];
        uint32_t mask[2] = {0, 0};
        const uint32_t eos[1] = {35};
        (void)state;
        for (int i = 0; i < 40; i++)
                logits[i] = (float)i;
        assert_int_equal(tsr_grammar_mask_words(40), 2);
        assert_int_equal(tsr_grammar_mask_words(32), 1);
        mask[0] = 1u << 3;
        mask[1] = 1u << (35 - 32);
        tsr_grammar_apply_mask(logits, 40, mask);
        for (int i = 0; i < 40; i++) {
                if (i == 3 || i == 35)
                        assert_true(logits[i] == (float)i);
                else
                        assert_true(isinf(logits[i]) && logits[i] < 0);
        }
        assert_false(tsr_grammar_mask_only(mask, 40, eos, 1));   /* 3 is allowed too */
        mask[0] = 0;
        assert_true(tsr_grammar_mask_only(mask, 40, eos, 1));
        mask[1] = 0xffffffffu << 8;   /* bits past the vocabulary do not count */
        assert_false(tsr_grammar_mask_only(mask, 40, eos, 1));
        mask[1] = 0;
        assert_false(tsr_grammar_mask_only(mask, 40, eos, 1));   /* nothing allowed */
}

/* ---- over SmolLM2's vocabulary ---- */

typedef struct fixture {
        tsr_model_meta *meta;
        tsr_grammar_vocab *v;
        size_t vocab;
        int byte_of[512];          /* GPT-2's byte-level alphabet back to bytes */
} fixture;

static fixture F;

static int setup_vocab(void **state) {
        char path[4096], err[256];
        const char *root = getenv("TSR_SOURCE_ROOT");
        (void)state;
        snprintf(path, sizeof(path), "%s/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", root ? root : ".");
        if (access(path, R_OK) != 0)
                return 0;   /* each test skips */
        if (tsr_model_meta_load(path, &F.meta, err, sizeof(err)) != TSR_OK)
                return -1;
        F.vocab = F.meta->vocab_size;
        if (tsr_engine_grammar_vocab(F.meta, F.vocab, &F.v, err, sizeof(err)) != TSR_OK) {
                print_message("grammar vocab: %s\n", err);
                return -1;
        }
        for (int i = 0; i < 512; i++)
                F.byte_of[i] = -1;
        for (int b = 0, n = 0; b < 256; b++) {
                if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
                        F.byte_of[b] = b;
                else
                        F.byte_of[256 + n++] = b;
        }
        return 0;
}

static int teardown_vocab(void **state) {
        (void)state;
        tsr_grammar_vocab_free(&F.v);
        tsr_model_meta_free(&F.meta);
        return 0;
}

#define NEED_VOCAB()                                                                                     \
        do {                                                                                             \
                if (!F.v)                                                                                \
                        TSR_SKIP(TSR_SKIP_NOT_FETCHED, "SmolLM2 GGUF absent (scripts/fetch-model.sh fetches it)"); \
        } while (0)

static bool allowed(const uint32_t *mask, uint32_t id) { return mask[id / 32] >> (id % 32) & 1u; }

static size_t count_allowed(const uint32_t *mask, size_t vocab) {
        size_t n = 0;
        for (size_t i = 0; i < vocab; i++)
                n += allowed(mask, (uint32_t)i);
        return n;
}

/* A token's bytes (byte-level spelling decoded) appended to out. */
static void append_token(char *out, size_t *len, size_t cap, uint32_t id) {
        const unsigned char *u = (const unsigned char *)F.meta->gguf_tokenizer->tokens[id];
        while (*u && *len + 1 < cap) {
                int cp = u[0] < 0x80 ? u[0] : ((u[0] & 0x1F) << 6) | (u[1] & 0x3F);
                u += u[0] < 0x80 ? 1 : 2;
                if (cp < 512 && F.byte_of[cp] >= 0)
                        out[(*len)++] = (char)F.byte_of[cp];
        }
        out[*len] = '\0';
}

static int64_t token_id(const char *spelling) {
        for (size_t i = 0; i < F.meta->gguf_tokenizer->n_tokens; i++)
                if (strcmp(F.meta->gguf_tokenizer->tokens[i], spelling) == 0)
                        return (int64_t)i;
        return -1;
}

static void test_choice_walk(void **state) {
        tsr_grammar_spec s = spec_of(TSR_GRAMMAR_CHOICE, "[\"yes\",\"no\"]");
        tsr_grammar_compiled *g = NULL;
        tsr_grammar_matcher *m;
        char err[256];
        uint32_t *mask;
        uint32_t eos;
        int64_t yes, no, hello;
        (void)state;
        NEED_VOCAB();
        eos = F.meta->eos_token_ids[0];
        yes = token_id("yes");
        no = token_id("no");
        hello = token_id("hello");
        assert_true(yes >= 0 && no >= 0 && hello >= 0);
        assert_int_equal(tsr_grammar_compile(F.v, &s, &g, err, sizeof(err)), TSR_OK);
        m = tsr_grammar_matcher_new(g);
        tsr_grammar_compiled_free(&g);   /* the matcher keeps what it needs */
        assert_non_null(m);
        mask = calloc(tsr_grammar_mask_words(F.vocab), sizeof(uint32_t));
        assert_int_equal(tsr_grammar_fill_mask(m, mask, F.vocab), TSR_OK);
        assert_true(allowed(mask, (uint32_t)yes));
        assert_true(allowed(mask, (uint32_t)no));
        assert_false(allowed(mask, (uint32_t)hello));
        assert_false(allowed(mask, eos));   /* an empty answer is not a choice */
        assert_true(count_allowed(mask, F.vocab) < 16);

        assert_int_equal(tsr_grammar_accept(m, (uint32_t)hello), TSR_E_INVAL);   /* refused, state unchanged */
        assert_int_equal(tsr_grammar_n_accepted(m), 0);
        assert_int_equal(tsr_grammar_accept(m, (uint32_t)yes), TSR_OK);
        assert_int_equal(tsr_grammar_fill_mask(m, mask, F.vocab), TSR_OK);
        assert_true(allowed(mask, eos));
        assert_true(tsr_grammar_mask_only(mask, F.vocab, F.meta->eos_token_ids, F.meta->n_eos_token_ids));

        /* Roll "yes" back, take "no" instead, then end. */
        assert_int_equal(tsr_grammar_rollback(m, 1), TSR_OK);
        assert_int_equal(tsr_grammar_rollback(m, 1), TSR_E_INVAL);
        assert_int_equal(tsr_grammar_accept(m, (uint32_t)no), TSR_OK);
        assert_false(tsr_grammar_terminated(m));
        assert_int_equal(tsr_grammar_accept(m, eos), TSR_OK);
        assert_true(tsr_grammar_terminated(m));
        assert_int_equal(tsr_grammar_n_accepted(m), 2);
        assert_int_equal(tsr_grammar_fill_mask(m, mask, F.vocab), TSR_E_INVAL);
        free(mask);
        tsr_grammar_matcher_free(&m);
        assert_null(m);
}

/* Walk a schema taking the highest allowed id each step (the stop token once allowed):
 * whatever the path, the text is JSON that satisfies the schema. */
static void test_schema_walk(void **state) {
        static const char schema[] =
                "{\"type\":\"object\",\"properties\":{"
                "\"id\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99},"
                "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"enum\":[\"a\",\"b\"]},"
                "\"minItems\":1,\"maxItems\":2},"
                "\"ok\":{\"type\":\"boolean\"}},"
                "\"required\":[\"id\",\"tags\",\"ok\"],\"additionalProperties\":false}";
        tsr_grammar_spec s = spec_of(TSR_GRAMMAR_JSON_SCHEMA, schema);
        tsr_grammar_compiled *g = NULL;
        tsr_grammar_matcher *m;
        char err[256], text[4096];
        size_t len = 0;
        uint32_t *mask, eos;
        json_t *j, *tags;
        int steps = 0;
        (void)state;
        NEED_VOCAB();
        eos = F.meta->eos_token_ids[0];
        assert_int_equal(tsr_grammar_compile(F.v, &s, &g, err, sizeof(err)), TSR_OK);
        m = tsr_grammar_matcher_new(g);
        tsr_grammar_compiled_free(&g);
        mask = calloc(tsr_grammar_mask_words(F.vocab), sizeof(uint32_t));
        text[0] = '\0';
        while (!tsr_grammar_terminated(m) && steps++ < 400) {
                uint32_t pick = UINT32_MAX;
                assert_int_equal(tsr_grammar_fill_mask(m, mask, F.vocab), TSR_OK);
                if (allowed(mask, eos))
                        pick = eos;
                for (size_t i = F.vocab; pick == UINT32_MAX && i-- > 0;)
                        if (allowed(mask, (uint32_t)i))
                                pick = (uint32_t)i;
                assert_true(pick != UINT32_MAX);
                assert_int_equal(tsr_grammar_accept(m, pick), TSR_OK);
                if (pick != eos)
                        append_token(text, &len, sizeof(text), pick);
        }
        assert_true(tsr_grammar_terminated(m));
        j = json_loads(text, 0, NULL);
        if (!j)
                fail_msg("not JSON: %s", text);
        assert_true(json_is_integer(json_object_get(j, "id")));
        assert_true(json_integer_value(json_object_get(j, "id")) >= 0 &&
                    json_integer_value(json_object_get(j, "id")) <= 99);
        tags = json_object_get(j, "tags");
        assert_true(json_is_array(tags) && json_array_size(tags) >= 1 && json_array_size(tags) <= 2);
        assert_true(json_is_boolean(json_object_get(j, "ok")));
        assert_int_equal(json_object_size(j), 3);
        json_decref(j);
        free(mask);
        tsr_grammar_matcher_free(&m);
}

static tsr_grammar_job_state wait_job(tsr_grammar_job *j) {
        for (int i = 0; i < 30000; i++) {   /* 30 s at most: a loaded 2-core machine */
                tsr_grammar_job_state st = tsr_grammar_job_poll(j);
                if (st != TSR_GRAMMAR_JOB_PENDING)
                        return st;
                nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        }
        return TSR_GRAMMAR_JOB_PENDING;
}

static void test_pool(void **state) {
        tsr_grammar_pool *p = NULL;
        tsr_grammar_spec good = spec_of(TSR_GRAMMAR_REGEX, "[0-9]{2}"), bad = spec_of(TSR_GRAMMAR_REGEX, "[0-9");
        tsr_grammar_spec dropped = spec_of(TSR_GRAMMAR_JSON_OBJECT, "");
        tsr_grammar_job *a, *b, *c;
        tsr_grammar_matcher *m;
        (void)state;
        NEED_VOCAB();
        assert_int_equal(tsr_grammar_pool_new(F.v, &p), TSR_OK);
        a = tsr_grammar_pool_submit(p, &good);
        b = tsr_grammar_pool_submit(p, &bad);
        c = tsr_grammar_pool_submit(p, &dropped);
        tsr_grammar_job_release(&c);   /* its request went away: the pool skips it */
        assert_null(c);
        assert_int_equal(wait_job(a), TSR_GRAMMAR_JOB_READY);
        m = tsr_grammar_matcher_new(tsr_grammar_job_compiled(a));
        assert_non_null(m);
        tsr_grammar_matcher_free(&m);
        assert_int_equal(wait_job(b), TSR_GRAMMAR_JOB_FAILED);
        assert_true(tsr_grammar_job_error(b)[0] != '\0');
        tsr_grammar_job_release(&a);
        tsr_grammar_job_release(&b);
        /* Freed with a job still queued: it fails, and stays valid until released. */
        a = tsr_grammar_pool_submit(p, &good);
        tsr_grammar_pool_free(&p);
        assert_null(p);
        assert_int_not_equal(tsr_grammar_job_poll(a), TSR_GRAMMAR_JOB_PENDING);
        tsr_grammar_job_release(&a);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_check),
                cmocka_unit_test(test_mask_helpers),
                cmocka_unit_test(test_choice_walk),
                cmocka_unit_test(test_schema_walk),
                cmocka_unit_test(test_pool),
        };
        return cmocka_run_group_tests(tests, setup_vocab, teardown_vocab);
}
