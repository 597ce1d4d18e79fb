/* router/openai: request bodies parsed and validated as vLLM 0.12 does, with its
 * status codes, error types and messages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "router/openai.h"

typedef struct fixture {
        tsr_arena *arena;
        tsr_oai_limits lim;
        tsr_oai_request req;
        tsr_oai_error err;
} fixture;

static int setup(void **state) {
        fixture *f = calloc(1, sizeof(*f));
        f->arena = tsr_arena_new(0, 0);
        tsr_oai_limits_default(&f->lim);
        *state = f;
        return 0;
}

static int teardown(void **state) {
        fixture *f = *state;
        tsr_oai_request_done(&f->req);
        tsr_arena_free(&f->arena);
        free(f);
        return 0;
}

static tsr_status parse(fixture *f, tsr_oai_kind kind, const char *body) {
        tsr_oai_request_done(&f->req);
        memset(&f->req, 0, sizeof(f->req));
        memset(&f->err, 0, sizeof(f->err));
        return tsr_oai_parse(kind, body, strlen(body), &f->lim, f->arena, &f->req, &f->err);
}

/* Parse must fail with this status, type and exact message. */
static void expect_error(fixture *f, tsr_oai_kind kind, const char *body, int status, const char *type, const char *message) {
        tsr_status st = parse(f, kind, body);
        if (st != TSR_E_INVAL)
                fail_msg("accepted: %s", body);
        assert_int_equal(f->err.status, status);
        assert_string_equal(f->err.type, type);
        if (message && strcmp(f->err.message, message) != 0)
                fail_msg("body %s\n got: %s\nwant: %s", body, f->err.message, message);
}

static void test_py_float_repr(void **state) {
        char b[64];
        static const struct { double v; const char *want; } cases[] = {
                {-1.0, "-1.0"}, {0.1, "0.1"}, {1.5, "1.5"}, {2.0, "2.0"}, {1e-05, "1e-05"}, {1e16, "1e+16"},
                {123456.789, "123456.789"}, {-0.5, "-0.5"}, {0.30000000000000004, "0.30000000000000004"},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                tsr_oai_py_float_repr(cases[i].v, b, sizeof(b));
                assert_string_equal(b, cases[i].want);
        }
}

static void test_completions_defaults(void **state) {
        fixture *f = *state;
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"Hello\"}"), TSR_OK);
        assert_string_equal(f->req.model, "m");
        assert_int_equal(f->req.n_prompts, 1);
        assert_false(f->req.prompts[0].is_ids);
        assert_string_equal(f->req.prompts[0].text, "Hello");
        assert_true(f->req.has_max_tokens);
        assert_int_equal(f->req.max_tokens, 16);     /* completions default */
        assert_int_equal(f->req.n, 1);
        assert_false(f->req.has_temperature);        /* unset: generation_config may fill it */
        assert_false(f->req.stream);
        assert_true(f->req.add_special_tokens);
        assert_true(f->req.skip_special_tokens);
        assert_int_equal(f->req.logprobs, -1);
        assert_int_equal(f->req.prompt_logprobs, -1);
}

static void test_completions_prompt_forms(void **state) {
        fixture *f = *state;
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[1,2,3]}"), TSR_OK);
        assert_int_equal(f->req.n_prompts, 1);
        assert_true(f->req.prompts[0].is_ids);
        assert_int_equal(f->req.prompts[0].n_ids, 3);
        assert_int_equal(f->req.prompts[0].ids[2], 3);
        /* lm-eval's form: a batch of token-id lists, one choice each. */
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[[5,6],[7],[8,9,10]],\"echo\":true,\"logprobs\":1,"
                                                   "\"max_tokens\":1,\"temperature\":0,\"seed\":1234}"), TSR_OK);
        assert_int_equal(f->req.n_prompts, 3);
        assert_int_equal(f->req.prompts[2].n_ids, 3);
        assert_int_equal(f->req.prompts[1].ids[0], 7);
        assert_true(f->req.echo);
        assert_int_equal(f->req.logprobs, 1);
        assert_int_equal(f->req.prompt_logprobs, 1);  /* echo implies prompt logprobs */
        assert_true(tsr_oai_request_is_greedy(&f->req));
        assert_true(f->req.has_seed);
        assert_int_equal(f->req.seed, 1234);
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"]}"), TSR_OK);
        assert_int_equal(f->req.n_prompts, 2);
        assert_string_equal(f->req.prompts[1].text, "b");
        /* max_tokens: null means the rest of the context. */
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":null}"), TSR_OK);
        assert_false(f->req.has_max_tokens);
        /* echo with max_tokens 0 is allowed (returns the prompt only). */
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0,\"echo\":true}"), TSR_OK);
}

static void test_completions_errors(void **state) {
        fixture *f = *state;
        expect_error(f, TSR_OAI_COMPLETIONS, "{}", 400, "BadRequestError",
                     "Either prompt or prompt_embeds must be provided and non-empty.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[]}", 400, "BadRequestError",
                     "Either prompt or prompt_embeds must be provided and non-empty.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"\"}", 400, "BadRequestError", "Prompt cannot be empty.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"suffix\":\"y\"}", 400, "BadRequestError",
                     "suffix is not currently supported");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":50}", 400, "BadRequestError",
                     "Requested sample logprobs of 50, which is greater than max allowed: 20");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[1,-2]}", 400, "BadRequestError", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[1,\"a\"]}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":[\"a\",[1]]}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":42}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "BadRequestError",
                     "max_tokens must be at least 1, got 0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":-5}", 400, "BadRequestError",
                     "max_tokens must be at least 1, got -5.");
}

static void test_sampling_messages(void **state) {
        fixture *f = *state;
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":-1}", 400, "BadRequestError",
                     "temperature must be non-negative, got -1.0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":-0.5}", 400, "BadRequestError",
                     "temperature must be non-negative, got -0.5.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "BadRequestError",
                     "top_p must be in (0, 1], got 1.5.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":0}", 400, "BadRequestError",
                     "top_p must be in (0, 1], got 0.0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":-2}", 400, "BadRequestError",
                     "top_k must be 0 (disable), or at least 1, got -2.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"min_p\":2}", 400, "BadRequestError",
                     "min_p must be in [0, 1], got 2.0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"presence_penalty\":3}", 400, "BadRequestError",
                     "presence_penalty must be in [-2, 2], got 3.0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"frequency_penalty\":-2.5}", 400, "BadRequestError",
                     "frequency_penalty must be in [-2, 2], got -2.5.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"repetition_penalty\":0}", 400, "BadRequestError",
                     "repetition_penalty must be greater than zero, got 0.0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":0}", 400, "BadRequestError",
                     "n must be at least 1, got 0.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":2,\"temperature\":0}", 400, "BadRequestError",
                     "n must be 1 when using greedy sampling, got 2.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":100000}", 400, "BadRequestError",
                     "n must be at most 128, got 100000.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"min_tokens\":20,\"max_tokens\":10}", 400,
                     "BadRequestError", "min_tokens must be less than or equal to max_tokens=10, got 20.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"min_tokens\":-1}", 400, "BadRequestError",
                     "min_tokens must be greater than or equal to 0, got -1.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", 400, "BadRequestError",
                     "stop cannot contain an empty string.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"a\":1}}", 400, "BadRequestError",
                     "logit_bias contains key(s) that cannot be converted to integer token IDs: ['a']");
        /* vLLM tests `data.get("stream_options")`: only a non-empty object is refused
         * without stream ({} is falsy there; tests/e2e/test_bad_input.py accepts it). */
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400,
                     "BadRequestError", "Stream options can only be defined when `stream=True`.");
        /* Valid JSON that is not an object: pydantic's message, not a decode error. */
        expect_error(f, TSR_OAI_COMPLETIONS, "\"hello\"", 400, "Bad Request", "Input should be a valid dictionary or object");
        expect_error(f, TSR_OAI_CHAT, "5", 400, "Bad Request", "Input should be a valid dictionary or object");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"prompt_logprobs\":21}", 400, "BadRequestError",
                     "Requested prompt logprobs of 21, which is greater than max allowed: 20");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":true,\"prompt_logprobs\":1}", 400,
                     "BadRequestError", "`prompt_logprobs` are not available when `stream=True`.");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "Bad Request",
                     "temperature: Input should be a valid number");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "Bad Request", NULL);
        assert_string_equal(f->err.param, "max_tokens");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "Bad Request", NULL);
}

static void test_sampling_values(void **state) {
        fixture *f = *state;
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS,
                               "{\"prompt\":\"x\",\"temperature\":0.7,\"top_p\":0.9,\"top_k\":-1,\"min_p\":0.05,"
                               "\"repetition_penalty\":1.1,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
                               "\"seed\":-1,\"stop\":\"END\",\"stop_token_ids\":[2,7],\"ignore_eos\":true,"
                               "\"min_tokens\":3,\"max_tokens\":10.0,\"logit_bias\":{\"42\":500,\"7\":-3.5},"
                               "\"stream\":true,\"stream_options\":{},\"skip_special_tokens\":false,"
                               "\"unknown_field\":{\"a\":[1]},\"n\":3,\"priority\":-2}"), TSR_OK);
        tsr_oai_request *r = &f->req;
        assert_float_equal(r->temperature, 0.7, 1e-12);
        assert_int_equal(r->top_k, -1);
        assert_false(r->has_seed);                   /* -1 = none */
        assert_int_equal(r->n_stop, 1);
        assert_string_equal(r->stop[0], "END");
        assert_int_equal(r->n_stop_token_ids, 2);
        assert_int_equal(r->stop_token_ids[1], 7);
        assert_true(r->ignore_eos);
        assert_int_equal(r->max_tokens, 10);         /* integral float accepted */
        assert_int_equal(r->n_logit_bias, 2);
        assert_int_equal(r->logit_bias[0].token_id, 42);
        assert_float_equal(r->logit_bias[0].bias, 100.0, 0);   /* clamped */
        assert_true(r->include_usage);               /* 0.12: true when stream_options is present */
        assert_false(r->continuous_usage_stats);
        assert_false(r->skip_special_tokens);
        assert_int_equal(r->n, 3);
        assert_int_equal(r->priority, -2);
        assert_false(tsr_oai_request_is_greedy(r));
}

static void test_chat_basic(void **state) {
        fixture *f = *state;
        assert_int_equal(parse(f, TSR_OAI_CHAT,
                               "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
                               "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}],"
                               "\"max_completion_tokens\":5,\"max_tokens\":99,\"logprobs\":true,\"top_logprobs\":3,"
                               "\"chat_template_kwargs\":{\"enable_thinking\":false}}"), TSR_OK);
        tsr_oai_request *r = &f->req;
        assert_int_equal(json_array_size(r->messages), 2);
        assert_true(r->has_max_tokens);
        assert_int_equal(r->max_tokens, 5);          /* max_completion_tokens wins */
        assert_true(r->chat_logprobs);
        assert_int_equal(r->top_logprobs, 3);
        assert_true(r->add_generation_prompt);
        assert_false(r->add_special_tokens);         /* chat default */
        assert_non_null(r->chat_template_kwargs);
        assert_string_equal(r->tool_choice, "none");
        /* No max tokens at all: the rest of the context. */
        assert_int_equal(parse(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}"), TSR_OK);
        assert_false(f->req.has_max_tokens);
        /* Custom roles are accepted, as vLLM's CustomChatCompletionMessageParam does. */
        assert_int_equal(parse(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"narrator\",\"content\":\"x\"}]}"), TSR_OK);
}

static void test_chat_tools(void **state) {
        fixture *f = *state;
        const char *tools = "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                            "\"parameters\":{\"type\":\"object\"}}}]";
        char body[512];
        snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}", tools);
        assert_int_equal(parse(f, TSR_OAI_CHAT, body), TSR_OK);
        assert_string_equal(f->req.tool_choice, "auto");   /* tools given, tool_choice absent */
        snprintf(body, sizeof(body),
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,\"tool_choice\":{\"type\":\"function\","
                 "\"function\":{\"name\":\"get_weather\"}}}", tools);
        assert_int_equal(parse(f, TSR_OAI_CHAT, body), TSR_OK);
        assert_string_equal(f->req.tool_choice, "function");
        assert_string_equal(f->req.tool_choice_name, "get_weather");
        snprintf(body, sizeof(body),
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,\"tool_choice\":{\"type\":\"function\","
                 "\"function\":{\"name\":\"nope\"}}}", tools);
        expect_error(f, TSR_OAI_CHAT, body, 400, "BadRequestError",
                     "The tool specified in `tool_choice` does not match any of the specified `tools`");
}

static void test_chat_errors(void **state) {
        fixture *f = *state;
        expect_error(f, TSR_OAI_CHAT, "{}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[]}", 400, "BadRequestError", NULL);
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":\"hi\"}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_CHAT,
                     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
                     400, "BadRequestError", NULL);
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400,
                     "BadRequestError", "when using `top_logprobs`, `logprobs` must be set to true.");
        expect_error(f, TSR_OAI_CHAT,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}",
                     400, "BadRequestError", "Requested sample logprobs of 21, which is greater than max allowed: 20");
        expect_error(f, TSR_OAI_CHAT,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":true}", 400,
                     "BadRequestError",
                     "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"maybe\"}",
                     400, "Bad Request", NULL);
}

/* Fields that would change the output but are not implemented: 400 BadRequestError
 * naming the field, on both endpoints; their neutral values and the fields that change
 * nothing alone are accepted. */
/* response_format / structured_outputs / guided_*: what reaches the worker, and the
 * 400s (xgrammar's check runs in the router). */
static void test_structured_outputs(void **state) {
        fixture *f = *state;
        static const struct {
                const char *field;
                tsr_grammar_kind kind;
                const char *text;     /* what the worker compiles */
                bool compact;
        } ok[] = {
                {"\"response_format\":{\"type\":\"json_object\"}", TSR_GRAMMAR_JSON_OBJECT, "", false},
                {"\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"strict\":true,"
                 "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}}}",
                 TSR_GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}", false},
                {"\"response_format\":{\"type\":\"text\"}", TSR_GRAMMAR_NONE, NULL, false},
                {"\"structured_outputs\":{\"json\":\"{\\\"type\\\": \\\"string\\\"}\",\"disable_any_whitespace\":true}",
                 TSR_GRAMMAR_JSON_SCHEMA, "{\"type\": \"string\"}", true},
                {"\"structured_outputs\":{\"regex\":\"[a-z]+\",\"disable_fallback\":true,"
                 "\"disable_additional_properties\":false}", TSR_GRAMMAR_REGEX, "[a-z]+", false},
                {"\"structured_outputs\":{\"choice\":[\"a\", \"b\\\"\"]}", TSR_GRAMMAR_CHOICE, "[\"a\",\"b\\\"\"]", false},
                {"\"structured_outputs\":{\"grammar\":\"root ::= \\\"a\\\"\"}", TSR_GRAMMAR_EBNF, "root ::= \"a\"", false},
                {"\"structured_outputs\":{\"json_object\":true}", TSR_GRAMMAR_JSON_OBJECT, "", false},
                {"\"structured_outputs\":{\"json_object\":false}", TSR_GRAMMAR_NONE, NULL, false},
                {"\"guided_json\":{\"type\":\"boolean\"}", TSR_GRAMMAR_JSON_SCHEMA, "{\"type\":\"boolean\"}", false},
                {"\"guided_regex\":\"[0-9]\"", TSR_GRAMMAR_REGEX, "[0-9]", false},
                {"\"guided_choice\":[\"yes\",\"no\"]", TSR_GRAMMAR_CHOICE, "[\"yes\",\"no\"]", false},
                {"\"guided_grammar\":\"root ::= \\\"a\\\"\",\"guided_decoding_backend\":\"xgrammar\"", TSR_GRAMMAR_EBNF,
                 "root ::= \"a\"", false},
        };
        static const struct {
                const char *field;
                const char *message;
        } bad[] = {
                {"\"structured_outputs\":{\"choice\":[]}",
                 "Failed to transform choices into a grammar: Choice list must not be empty"},
                {"\"structured_outputs\":{\"regex\":\"(a\"}", NULL},
                {"\"structured_outputs\":{\"json\":{\"type\":\"integer\",\"minimum\":5,\"maximum\":1}}", NULL},
                {"\"structured_outputs\":{\"json\":\"{not json\"}", NULL},
                {"\"structured_outputs\":{\"grammar\":\"root ::= \"}", NULL},
                {"\"structured_outputs\":{\"regex\":\"a\",\"choice\":[\"a\"]}",
                 "You can only use one kind of structured outputs constraint but multiple are specified"},
                {"\"response_format\":{\"type\":\"json_object\"},\"structured_outputs\":{\"regex\":\"a\"}",
                 "You can only use one kind of structured outputs constraint but multiple are specified"},
                {"\"guided_json\":{},\"guided_regex\":\"a\"",
                 "You can only use one kind of structured outputs constraint but multiple are specified"},
                {"\"response_format\":{\"type\":\"json_schema\"}",
                 "response_format type 'json_schema' needs json_schema: {name, schema}"},
                {"\"structured_outputs\":{\"regex\":\"a\",\"unknown\":1}",
                 "structured_outputs: unexpected keyword argument 'unknown'"},
        };
        char body[1024];
        for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}", ok[i].field);
                if (parse(f, TSR_OAI_CHAT, body) != TSR_OK)
                        fail_msg("refused: %s: %s", body, f->err.message);
                assert_int_equal(f->req.so_kind, ok[i].kind);
                if (ok[i].text)
                        assert_string_equal(f->req.so_text, ok[i].text);
                assert_int_equal(f->req.so_compact, ok[i].compact);
        }
        /* /v1/completions takes the same fields. */
        assert_int_equal(parse(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"structured_outputs\":{\"regex\":\"b+\"}}"),
                         TSR_OK);
        assert_int_equal(f->req.so_kind, TSR_GRAMMAR_REGEX);
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                snprintf(body, sizeof(body), "{\"prompt\":\"x\",%s}", bad[i].field);
                expect_error(f, TSR_OAI_COMPLETIONS, body, 400, "BadRequestError", bad[i].message);
                assert_true(f->err.message[0] != '\0');
        }
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"guided_regex\":5}", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"structured_outputs\":{\"choice\":[1]}}", 400,
                     "Bad Request", NULL);
}

static void test_unimplemented_fields_refused(void **state) {
        fixture *f = *state;
        static const struct {
                const char *field;     /* "key": value, spliced into a body */
                const char *param;
                const char *message;
        } rows[] = {
                {"\"response_format\":{\"type\":\"structural_tag\"}", "response_format",
                 "response_format type 'structural_tag' is not supported yet (supported: 'text', 'json_object', "
                 "'json_schema')"},
                {"\"response_format\":{\"type\":\"yaml\"}", "response_format",
                 "response_format type 'yaml' is not supported yet (supported: 'text', 'json_object', 'json_schema')"},
                {"\"structured_outputs\":{\"choice\":[\"a\"],\"whitespace_pattern\":\" \"}", "structured_outputs",
                 "structured_outputs.whitespace_pattern is not supported yet: the xgrammar backend does not take a "
                 "whitespace pattern"},
                {"\"structured_outputs\":{\"structural_tag\":\"{}\"}", "structured_outputs",
                 "structured_outputs.structural_tag is not supported yet: the xgrammar backend is not given "
                 "structural tags here"},
                {"\"guided_regex\":\"a\",\"guided_whitespace_pattern\":\" \"", "guided_whitespace_pattern",
                 "guided_whitespace_pattern is not supported yet: the xgrammar backend does not take a whitespace "
                 "pattern"},
                {"\"logits_processors\":[\"my.proc\"]", "logits_processors",
                 "logits_processors is not supported yet: custom logits processors are not implemented"},
                {"\"allowed_token_ids\":[1,2]", "allowed_token_ids",
                 "allowed_token_ids is not supported yet: restricting sampling to given token ids is not "
                 "implemented"},
                {"\"truncate_prompt_tokens\":5", "truncate_prompt_tokens",
                 "truncate_prompt_tokens is not supported yet: prompts are never truncated"},
                {"\"cache_salt\":\"tenant-a\"", "cache_salt",
                 "cache_salt is not supported yet: the prefix cache is shared by every request"},
                {"\"reasoning_effort\":\"low\"", "reasoning_effort",
                 "reasoning_effort is not supported yet: it does not reach the chat template; a template that "
                 "reads it can be given it in chat_template_kwargs"},
                {"\"use_beam_search\":true", "use_beam_search",
                 "use_beam_search is not supported yet: beam search is not implemented"},
                {"\"return_tokens_as_token_ids\":true", "return_tokens_as_token_ids",
                 "return_tokens_as_token_ids is not supported yet: tokens are returned as text"},
                {"\"return_token_ids\":true", "return_token_ids",
                 "return_token_ids is not supported yet: responses carry no token ids"},
                {"\"bad_words\":[\"darn\"]", "bad_words",
                 "bad_words is not supported yet: banning words is not implemented"},
                {"\"best_of\":3", "best_of",
                 "best_of is not supported yet: returning the best of several candidates is not implemented "
                 "(n=3 returns them all)"},
        };
        static const char *const fine[] = {
                "\"response_format\":{\"type\":\"text\"}", "\"response_format\":null", "\"guided_json\":null",
                "\"structured_outputs\":null", "\"use_beam_search\":false", "\"return_token_ids\":false",
                "\"return_tokens_as_token_ids\":false", "\"bad_words\":[]", "\"best_of\":1", "\"best_of\":null",
                "\"guided_decoding_backend\":\"xgrammar\"", "\"parallel_tool_calls\":false", "\"user\":\"u\"",
                "\"length_penalty\":1.5", "\"include_reasoning\":false", "\"logits_processors\":null",
        };
        char body[512];

        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                snprintf(body, sizeof(body), "{\"prompt\":\"x\",%s}", rows[i].field);
                expect_error(f, TSR_OAI_COMPLETIONS, body, 400, "BadRequestError", rows[i].message);
                assert_string_equal(f->err.param, rows[i].param);
                snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}",
                         rows[i].field);
                expect_error(f, TSR_OAI_CHAT, body, 400, "BadRequestError", rows[i].message);
        }
        for (size_t i = 0; i < sizeof(fine) / sizeof(fine[0]); i++) {
                snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}", fine[i]);
                if (parse(f, TSR_OAI_CHAT, body) != TSR_OK)
                        fail_msg("refused: %s: %s", body, f->err.message);
        }
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":[{\"t\":1}]}",
                     400, "BadRequestError", "documents is not supported yet: the chat template is given no documents");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"prompt_embeds\":\"AAAA\"}", 400, "BadRequestError",
                     "prompt_embeds is not supported yet: prompts are text or token ids only");
        /* type errors stay pydantic's */
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":\"json\"}",
                     400, "Bad Request", "response_format: Input should be an object with a string `type`");
        expect_error(f, TSR_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{}}",
                     400, "Bad Request", "response_format: Input should be an object with a string `type`");
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"use_beam_search\":\"yes\"}", 400, "Bad Request",
                     "use_beam_search: Input should be a valid boolean");
}

static void test_malformed_bodies(void **state) {
        fixture *f = *state;
        expect_error(f, TSR_OAI_COMPLETIONS, "{\"prompt\":", 400, "Bad Request", NULL);
        expect_error(f, TSR_OAI_COMPLETIONS, "[1,2]", 400, "Bad Request", "Input should be a valid dictionary or object");
        expect_error(f, TSR_OAI_COMPLETIONS, "", 400, "Bad Request", NULL);
        /* Deep nesting is refused before any walk can blow the stack. */
        char deep[2 * 300 + 64];
        size_t k = 0;
        k += (size_t)sprintf(deep, "{\"prompt\":\"x\",\"a\":");
        for (int i = 0; i < 300; i++)
                deep[k++] = '[';
        for (int i = 0; i < 300; i++)
                deep[k++] = ']';
        deep[k++] = '}';
        deep[k] = '\0';
        expect_error(f, TSR_OAI_COMPLETIONS, deep, 400, "Bad Request", NULL);
        /* Truncations of a valid body never crash and never succeed halfway. */
        const char *good = "{\"prompt\":[[1,2],[3]],\"max_tokens\":4,\"stop\":[\"a\"],\"logit_bias\":{\"1\":2}}";
        for (size_t len = 0; len + 1 < strlen(good); len++) {
                tsr_oai_request_done(&f->req);
                memset(&f->req, 0, sizeof(f->req));
                assert_int_equal(tsr_oai_parse(TSR_OAI_COMPLETIONS, good, len, &f->lim, f->arena, &f->req, &f->err),
                                 TSR_E_INVAL);
        }
}

static void test_error_json(void **state) {
        tsr_oai_error e = {.status = 400, .type = "BadRequestError", .param = "temperature"};
        snprintf(e.message, sizeof(e.message), "temperature must be non-negative, got -1.0.");
        char *s = tsr_oai_error_json(&e);
        assert_string_equal(s, "{\"error\":{\"message\":\"temperature must be non-negative, got -1.0.\","
                               "\"type\":\"BadRequestError\",\"param\":\"temperature\",\"code\":400}}");
        free(s);
        e.param = NULL;
        s = tsr_oai_error_json(&e);
        assert_non_null(strstr(s, "\"param\":null"));
        free(s);
        /* a message quoting invalid UTF-8 (a parse error near the request's own bytes; a
         * fuzz finding: the body was NULL): each bad byte becomes U+FFFD, valid text stays */
        snprintf(e.message, sizeof(e.message), "invalid escape near '\"\\\xdax' in \xc3\xa9t\xe9");
        e.param = "st\xffop";
        s = tsr_oai_error_json(&e);
        assert_non_null(s);
        assert_string_equal(s, "{\"error\":{\"message\":\"invalid escape near '\\\"\\\\\xef\xbf\xbdx' in "
                               "\xc3\xa9t\xef\xbf\xbd\",\"type\":\"BadRequestError\",\"param\":\"st\xef\xbf\xbdop\","
                               "\"code\":400}}");
        free(s);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_py_float_repr),
                cmocka_unit_test_setup_teardown(test_completions_defaults, setup, teardown),
                cmocka_unit_test_setup_teardown(test_completions_prompt_forms, setup, teardown),
                cmocka_unit_test_setup_teardown(test_completions_errors, setup, teardown),
                cmocka_unit_test_setup_teardown(test_sampling_messages, setup, teardown),
                cmocka_unit_test_setup_teardown(test_sampling_values, setup, teardown),
                cmocka_unit_test_setup_teardown(test_chat_basic, setup, teardown),
                cmocka_unit_test_setup_teardown(test_chat_tools, setup, teardown),
                cmocka_unit_test_setup_teardown(test_chat_errors, setup, teardown),
                cmocka_unit_test_setup_teardown(test_unimplemented_fields_refused, setup, teardown),
                cmocka_unit_test_setup_teardown(test_structured_outputs, setup, teardown),
                cmocka_unit_test_setup_teardown(test_malformed_bodies, setup, teardown),
                cmocka_unit_test(test_error_json),
        };
        return cmocka_run_group_tests_name("openai", tests, NULL, NULL);
}
