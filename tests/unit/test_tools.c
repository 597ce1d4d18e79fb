/* router/tools: the tool-call and reasoning parsers on recorded model outputs.
 *
 * The outputs are written from each format as its model and vLLM's parser document
 * it (Hermes <tool_call> JSON, Llama 3 JSON with parameters, Llama 3.2/4 pythonic
 * lists, Qwen3-Coder / Nemotron-3-Nano XML, <think> reasoning); the expected calls
 * are what vLLM 0.12 returns for them: Python's json.dumps of the arguments.  Every
 * output is also streamed split at every byte boundary (one byte per delta, and every
 * two-piece split): the pieces must add up to the non-stream message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/config.h"
#include "router/openai.h"
#include "router/tools/tools.h"

typedef struct want_call {
        const char *name, *args;
} want_call;

typedef struct cse {
        const char *parser;           /* tool parser or NULL */
        const char *reasoner;         /* reasoning parser or NULL */
        bool thinking_off;
        const char *text;
        const char *content;          /* NULL = null */
        const char *reasoning;        /* NULL = null */
        want_call calls[4];
        size_t n_calls;
        bool stream;                  /* also check the stream (false: vLLM's stream differs, see the case) */
} cse;

static json_t *tools_schema(void) {
        return json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
                          "\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},"
                          "\"temp\":{\"type\":\"number\"},\"flag\":{\"type\":\"boolean\"},\"opts\":{\"type\":\"object\"},"
                          "\"tags\":{\"type\":\"array\"}}}}}]",
                          0, NULL);
}

static void check_message(const cse *c, json_t *msg, bool called) {
        json_t *content = json_object_get(msg, "content"), *reasoning = json_object_get(msg, "reasoning");
        json_t *calls = json_object_get(msg, "tool_calls");
        if (c->content)
                assert_string_equal(json_string_value(content), c->content);
        else
                assert_true(json_is_null(content));
        if (c->reasoning)
                assert_string_equal(json_string_value(reasoning), c->reasoning);
        else
                assert_true(json_is_null(reasoning));
        assert_true(json_equal(reasoning, json_object_get(msg, "reasoning_content")));
        assert_int_equal(called, c->n_calls > 0);
        assert_int_equal(calls ? json_array_size(calls) : 0, c->n_calls);
        for (size_t i = 0; i < c->n_calls; i++) {
                json_t *tc = json_array_get(calls, i), *f = json_object_get(tc, "function");
                const char *id = json_string_value(json_object_get(tc, "id"));
                assert_non_null(id);
                assert_int_equal(strncmp(id, "chatcmpl-tool-", 14), 0);
                assert_int_equal(strlen(id), 14 + 32);
                assert_string_equal(json_string_value(json_object_get(tc, "type")), "function");
                assert_string_equal(json_string_value(json_object_get(f, "name")), c->calls[i].name);
                assert_string_equal(json_string_value(json_object_get(f, "arguments")), c->calls[i].args);
        }
}

typedef struct acc {
        char content[4096], reasoning[4096];
        char names[4][64], args[4][1024];
        size_t n_calls;
} acc;

static void cat(char *dst, size_t cap, const char *s) {
        assert_true(strlen(dst) + strlen(s) < cap);
        strcat(dst, s);
}

static void take_delta(acc *a, json_t *d) {
        json_t *v, *tc;
        size_t i;
        if ((v = json_object_get(d, "content")))
                cat(a->content, sizeof(a->content), json_string_value(v));
        if ((v = json_object_get(d, "reasoning")) && !json_is_null(v)) {
                cat(a->reasoning, sizeof(a->reasoning), json_string_value(v));
                assert_true(json_equal(v, json_object_get(d, "reasoning_content")));
        }
        json_array_foreach(json_object_get(d, "tool_calls"), i, tc) {
                size_t idx = (size_t)json_integer_value(json_object_get(tc, "index"));
                json_t *f = json_object_get(tc, "function"), *args = json_object_get(f, "arguments");
                assert_true(idx < 4);
                if (idx == a->n_calls) {
                        /* a new call: id, type and the name come first, in one delta */
                        assert_non_null(json_object_get(tc, "id"));
                        assert_string_equal(json_string_value(json_object_get(tc, "type")), "function");
                        assert_non_null(json_string_value(json_object_get(f, "name")));
                        snprintf(a->names[idx], sizeof(a->names[idx]), "%s", json_string_value(json_object_get(f, "name")));
                        a->n_calls++;
                } else {
                        assert_true(idx < a->n_calls);
                        assert_null(json_object_get(tc, "id"));
                        assert_null(json_object_get(f, "name"));
                        assert_non_null(args);
                }
                if (args)
                        cat(a->args[idx], sizeof(a->args[idx]), json_string_value(args));
        }
}

/* A --tool-call-parser name, or "required" / "function" for the parsers of a forced
 * tool_choice (the named function is get_weather). */
static const tsr_tools_parser *find_parser(const char *name) {
        return !name ? NULL : tsr_tools_forced_parser(name) ? tsr_tools_forced_parser(name) : tsr_tools_parser_find(name);
}

/* Stream `text` cut at the offsets in cuts[0..n_cuts) and compare with the case. */
static void stream_case(const cse *c, json_t *tools, const size_t *cuts, size_t n_cuts) {
        tsr_tools_ctx ctx = {.tools = tools, .forced_name = "get_weather"};
        const tsr_tools_parser *tp = find_parser(c->parser);
        const tsr_reasoning_parser *rp = c->reasoner ? tsr_reasoning_parser_find(c->reasoner) : NULL;
        tsr_chat_out *o = tsr_chat_out_new(rp, c->thinking_off, tp, &ctx);
        acc a;
        size_t len = strlen(c->text);
        memset(&a, 0, sizeof(a));
        for (size_t k = 0; k <= n_cuts; k++) {
                size_t upto = k < n_cuts ? cuts[k] : len;
                json_t *d = NULL;
                assert_int_equal(tsr_chat_out_step(o, c->text, upto, k == n_cuts, &d), TSR_OK);
                if (d)
                        take_delta(&a, d);
                json_decref(d);
        }
        assert_string_equal(a.content, c->content ? c->content : "");
        assert_string_equal(a.reasoning, c->reasoning ? c->reasoning : "");
        assert_int_equal(a.n_calls, c->n_calls);
        assert_int_equal(tsr_chat_out_called(o), c->n_calls > 0);
        for (size_t i = 0; i < c->n_calls; i++) {
                assert_string_equal(a.names[i], c->calls[i].name);
                assert_string_equal(a.args[i], c->calls[i].args);
        }
        tsr_chat_out_free(o);
}

static void run_cases(const cse *cases, size_t n) {
        json_t *tools = tools_schema();
        tsr_tools_ctx ctx = {.tools = tools, .forced_name = "get_weather"};
        for (size_t i = 0; i < n; i++) {
                const cse *c = &cases[i];
                const tsr_tools_parser *tp = find_parser(c->parser);
                const tsr_reasoning_parser *rp = c->reasoner ? tsr_reasoning_parser_find(c->reasoner) : NULL;
                json_t *msg = json_object();
                bool called;
                size_t len = strlen(c->text), *cuts = malloc((len + 1) * sizeof(size_t));
                print_message("case %zu: %s\n", i, c->text);
                assert_true(!c->parser || tp);
                assert_true(!c->reasoner || rp);
                assert_int_equal(tsr_chat_out_message(rp, c->thinking_off, tp, &ctx, c->text, len, msg, &called), TSR_OK);
                check_message(c, msg, called);
                json_decref(msg);
                if (c->stream) {
                        for (size_t k = 0; k < len; k++)   /* one byte per delta */
                                cuts[k] = k;
                        stream_case(c, tools, cuts, len);
                        for (size_t k = 1; k < len; k++) {   /* every split in two */
                                cuts[0] = k;
                                stream_case(c, tools, cuts, 1);
                        }
                        stream_case(c, tools, cuts, 0);      /* all at once */
                }
                free(cuts);
        }
        json_decref(tools);
}

#define N(a) (sizeof(a) / sizeof((a)[0]))

static void test_hermes(void **state) {
        static const cse cases[] = {
                {"hermes", NULL, false,
                 "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
                 NULL, NULL, {{"get_weather", "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}, 1, true},
                /* content before the calls; compact JSON re-written with json.dumps spacing;
                 * escapes decoded, non-ASCII kept (ensure_ascii=False); 1.50 -> 1.5 */
                {"hermes", NULL, false,
                 "Let me check.<tool_call>{\"name\":\"a\",\"arguments\":{\"x\":1.50,\"y\":[true,null],"
                 "\"z\":\"caf\\u00e9 \\\"q\\\"\\n\"}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>",
                 "Let me check.", NULL,
                 {{"a", "{\"x\": 1.5, \"y\": [true, null], \"z\": \"caf\xc3\xa9 \\\"q\\\"\\n\"}"}, {"b", "{}"}}, 2, true},
                /* the last call unclosed (the model stopped at EOS) */
                {"hermes", NULL, false, "<tool_call>{\"name\": \"f\", \"arguments\": {\"n\": 10, \"m\": -2}}", NULL, NULL,
                 {{"f", "{\"n\": 10, \"m\": -2}"}}, 1, true},
                /* Python's number rules: 1e3 -> 1000.0, -0 -> 0, overflow -> Infinity, big ints kept */
                {"hermes", NULL, false,
                 "<tool_call>{\"name\": \"n\", \"arguments\": {\"a\": 1e3, \"b\": -0, \"c\": 1E400, "
                 "\"d\": 12345678901234567890, \"e\": 0.1, \"f\": 1e-7, \"g\": NaN}}</tool_call>",
                 NULL, NULL,
                 {{"n", "{\"a\": 1000.0, \"b\": 0, \"c\": Infinity, \"d\": 12345678901234567890, \"e\": 0.1, \"f\": 1e-07, "
                        "\"g\": NaN}"}},
                 1, true},
                /* malformed JSON: the whole output is content, no calls */
                {"hermes", NULL, false, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", NULL, {{0}},
                 0, true},
                /* no "arguments": KeyError in vLLM, content (the stream already named it: non-stream only) */
                {"hermes", NULL, false, "<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>",
                 NULL, {{0}}, 0, false},
                /* plain text, with something that starts like the tag */
                {"hermes", NULL, false, "Use <tool_ later <b>bold</b>", "Use <tool_ later <b>bold</b>", NULL, {{0}}, 0, true},
                {"hermes", NULL, false, "", "", NULL, {{0}}, 0, true},
        };
        (void)state;
        run_cases(cases, N(cases));
}

static void test_llama3_json(void **state) {
        static const cse cases[] = {
                {"llama3_json", NULL, false, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", NULL, NULL,
                 {{"get_weather", "{\"city\": \"Paris\"}"}}, 1, true},
                {"llama3_json", NULL, false,
                 "<|python_tag|>{\"name\": \"a\", \"arguments\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {\"y\": \"\xc3\xa9\"}}",
                 NULL, NULL, {{"a", "{\"x\": 1}"}, {"b", "{\"y\": \"\xc3\xa9\"}"}}, 2, true},
                /* "arguments" wins over "parameters" */
                {"llama3_json", NULL, false, "{\"name\": \"a\", \"arguments\": {\"x\": 1}, \"parameters\": {\"y\": 2}}", NULL,
                 NULL, {{"a", "{\"x\": 1}"}}, 1, false},
                /* text before the JSON: found anywhere, content dropped (vLLM's stream sees it as content) */
                {"llama3_json", NULL, false, "Sure! {\"name\": \"f\", \"parameters\": {\"q\": 1}}", NULL, NULL,
                 {{"f", "{\"q\": 1}"}}, 1, false},
                /* nested three deep: the pattern only matches the inner object, which has no name */
                {"llama3_json", NULL, false, "{\"name\": \"f\", \"parameters\": {\"a\": {\"b\": {\"c\": 1}}}}",
                 "{\"name\": \"f\", \"parameters\": {\"a\": {\"b\": {\"c\": 1}}}}", NULL, {{0}}, 0, false},
                {"llama3_json", NULL, false, "The weather is fine.", "The weather is fine.", NULL, {{0}}, 0, true},
                {"llama3_json", NULL, false, "{broken", "{broken", NULL, {{0}}, 0, true},
        };
        (void)state;
        run_cases(cases, N(cases));
}

static void test_pythonic(void **state) {
        static const cse cases[] = {
                {"pythonic", NULL, false, "[get_weather(city='San Francisco', metric='celsius')]", NULL, NULL,
                 {{"get_weather", "{\"city\": \"San Francisco\", \"metric\": \"celsius\"}"}}, 1, true},
                {"pythonic", NULL, false,
                 "[a(x=1, y=2.50, z=True, w=None, v=[1, 'two'], u={'k': \"v\", 3: 'i'}), b()]", NULL, NULL,
                 {{"a", "{\"x\": 1, \"y\": 2.5, \"z\": true, \"w\": null, \"v\": [1, \"two\"], \"u\": {\"k\": \"v\", \"3\": \"i\"}}"},
                  {"b", "{}"}},
                 2, true},
                {"pythonic", NULL, false, "[f(s='it\\'s \"x\"\\n', city=\"Z\xc3\xbcrich\")]", NULL, NULL,
                 {{"f", "{\"s\": \"it's \\\"x\\\"\\n\", \"city\": \"Z\xc3\xbcrich\"}"}}, 1, true},
                /* a unary minus is no literal for vLLM's pythonic parser: content (non-stream only) */
                {"pythonic", NULL, false, "[f(x=-1)]", "[f(x=-1)]", NULL, {{0}}, 0, false},
                {"pythonic", NULL, false, "I would call f(x=1).", "I would call f(x=1).", NULL, {{0}}, 0, true},
                {"pythonic", NULL, false, "[1, 2, 3]", "[1, 2, 3]", NULL, {{0}}, 0, true},
                /* llama4_pythonic: the tags dropped, json.dumps with ensure_ascii */
                {"llama4_pythonic", NULL, false, "<|python_start|>[f(city=\"Z\xc3\xbcrich\")]<|python_end|>", NULL, NULL,
                 {{"f", "{\"city\": \"Z\\u00fcrich\"}"}}, 1, true},
                {"llama4_pythonic", NULL, false, "[f(e='\xf0\x9f\x98\x80')]", NULL, NULL, {{"f", "{\"e\": \"\\ud83d\\ude00\"}"}},
                 1, true},
        };
        (void)state;
        run_cases(cases, N(cases));
}

static void test_qwen3_coder(void **state) {
        static const cse cases[] = {
                {"qwen3_coder", NULL, false,
                 "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                 "</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=opts>\n"
                 "{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>",
                 "Checking.\n", NULL,
                 {{"get_weather", "{\"city\": \"Paris\", \"days\": 3, \"temp\": 21.5, \"flag\": true, \"opts\": {\"a\": [1, 2]}}"}},
                 1, true},
                /* conversions that fall back: not an int -> the string; 5.0 -> 5; a parameter
                 * the schema lacks -> the string; null for any type; a Python literal list */
                {"qwen3_coder", NULL, false,
                 "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=temp>\n5.0\n"
                 "</parameter>\n<parameter=extra>\n42\n</parameter>\n<parameter=city>\nnull\n</parameter>\n<parameter=tags>\n"
                 "['a', -1]\n</parameter>\n</function>\n</tool_call>",
                 NULL, NULL,
                 {{"get_weather", "{\"days\": \"three\", \"temp\": 5, \"extra\": \"42\", \"city\": null, \"tags\": [\"a\", -1]}"}},
                 1, true},
                /* two calls in two blocks, parameters closed by the next one */
                {"qwen3_coder", NULL, false,
                 "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call>\n<tool_call>\n"
                 "<function=g>\n</function>\n</tool_call>",
                 NULL, NULL, {{"f", "{\"a\": \"x\", \"b\": \"y\"}"}, {"g", "{}"}}, 2, true},
                /* no <tool_call>: the functions of the whole text */
                {"qwen3_coder", NULL, false, "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>", NULL, NULL,
                 {{"f", "{\"a\": \"1\"}"}}, 1, true},
                {"qwen3_coder", NULL, false, "<tool_call>nothing</tool_call>", "<tool_call>nothing</tool_call>", NULL, {{0}}, 0,
                 true},
                {"qwen3_coder", NULL, false, "Plain <function answer", "Plain <function answer", NULL, {{0}}, 0, true},
        };
        (void)state;
        run_cases(cases, N(cases));
}

/* tool_choice "required" / named: outputs the tools' schema forced (forced.c). */
static void test_forced(void **state) {
        static const cse cases[] = {
                {"required", NULL, false, "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}]",
                 "", NULL, {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"}}, 1, true},
                {"required", NULL, false,
                 "[\n  {\"name\":\"get_weather\",\"parameters\":{\"city\":\"\\u00dcber\",\"temp\":1.50}} ,\n"
                 "  {\"parameters\": {}, \"name\": \"get_weather\"}\n]",
                 "", NULL, {{"get_weather", "{\"city\": \"\xc3\x9c" "ber\", \"temp\": 1.5}"}, {"get_weather", "{}"}}, 2,
                 false},   /* parameters before name: the stream cannot name the call first */
                {"required", NULL, false, "[{\"name\": \"get_weather\"}]", "[{\"name\": \"get_weather\"}]", NULL, {{0}}, 0,
                 false},   /* no parameters: left as content */
                {"required", NULL, false, "[]", "[]", NULL, {{0}}, 0, true},
                {"required", NULL, false, "[{\"name\": \"get_weather\", \"param", "[{\"name\": \"get_weather\", \"param",
                 NULL, {{0}}, 0, false},   /* cut by max_tokens */
                {"function", NULL, false, "{\n  \"city\": \"Paris\"\n}", "", NULL,
                 {{"get_weather", "{\n  \"city\": \"Paris\"\n}"}}, 1, true},   /* arguments as generated, as vLLM */
        };
        char err[256] = "";
        json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\","
                                   "\"properties\":{\"x\":{\"$ref\":\"#/$defs/X\"}},\"$defs\":{\"X\":{\"type\":\"integer\"}}}}},"
                                   "{\"type\":\"function\",\"function\":{\"name\":\"b\"}}]", 0, NULL);
        json_t *want = json_loads(
                "{\"type\":\"array\",\"minItems\":1,\"items\":{\"type\":\"object\",\"anyOf\":["
                "{\"properties\":{\"name\":{\"type\":\"string\",\"enum\":[\"a\"]},\"parameters\":{\"type\":\"object\","
                "\"properties\":{\"x\":{\"$ref\":\"#/$defs/X\"}}}},\"required\":[\"name\",\"parameters\"]},"
                "{\"properties\":{\"name\":{\"type\":\"string\",\"enum\":[\"b\"]},\"parameters\":{\"type\":\"object\","
                "\"properties\":{}}},\"required\":[\"name\",\"parameters\"]}]},\"$defs\":{\"X\":{\"type\":\"integer\"}}}",
                0, NULL);
        json_t *got;
        (void)state;
        run_cases(cases, N(cases));
        assert_null(tsr_tools_forced_parser("auto"));
        assert_null(tsr_tools_forced_parser(NULL));
        got = tsr_tools_choice_schema(tools, "required", NULL, err, sizeof(err));
        assert_true(json_equal(got, want));
        json_decref(got);
        got = tsr_tools_choice_schema(tools, "function", "b", err, sizeof(err));   /* no parameters: no constraint */
        assert_true(json_is_null(got));
        json_decref(got);
        got = tsr_tools_choice_schema(tools, "function", "a", err, sizeof(err));   /* the tool's own schema */
        assert_true(json_equal(got, json_object_get(json_object_get(json_array_get(tools, 0), "function"),
                                                    "parameters")));
        json_decref(got);
        assert_null(tsr_tools_choice_schema(tools, "auto", NULL, err, sizeof(err)));
        json_decref(tools);
        /* two tools defining one $defs name differently */
        tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"$defs\":{\"X\":"
                           "{\"type\":\"integer\"}}}}},{\"type\":\"function\",\"function\":{\"name\":\"b\","
                           "\"parameters\":{\"$defs\":{\"X\":{\"type\":\"string\"}}}}}]", 0, NULL);
        err[0] = '\0';
        assert_null(tsr_tools_choice_schema(tools, "required", NULL, err, sizeof(err)));
        assert_string_equal(err, "Tool definition 'X' has multiple schemas, which is not supported.");
        json_decref(tools);
        json_decref(want);
}

static void test_reasoning(void **state) {
        static const cse cases[] = {
                {NULL, "deepseek_r1", false, "<think>I think.</think>The answer.", "The answer.", "I think.", {{0}}, 0, true},
                /* the template put <think> in the prompt */
                {NULL, "deepseek_r1", false, "Hmm, 2+2.\n</think>\n\n4", "\n\n4", "Hmm, 2+2.\n", {{0}}, 0, true},
                {NULL, "deepseek_r1", false, "Still thinking", NULL, "Still thinking", {{0}}, 0, true},
                {NULL, "deepseek_r1", false, "<think>abc</think>", NULL, "abc", {{0}}, 0, true},
                {NULL, "deepseek_r1", false, "</think>x", "x", "", {{0}}, 0, true},
                {NULL, "nemotron_v3", false, "<think>a<b</think>c</thin", "c</thin", "a<b", {{0}}, 0, true},
                /* enable_thinking false: no </think>, so the text is the answer */
                {NULL, "nemotron_v3", true, "Just the answer", "Just the answer", NULL, {{0}}, 0, true},
                {NULL, "nano_v3", true, "Just the answer", "Just the answer", NULL, {{0}}, 0, true},
                {NULL, "deepseek_r1", true, "Just the answer", NULL, "Just the answer", {{0}}, 0, true},
                /* reasoning, then a call in the answer */
                {"hermes", "deepseek_r1", false,
                 "<think>plan</think>Sure<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>", "Sure", "plan",
                 {{"f", "{\"a\": 1}"}}, 1, true},
                {"qwen3_coder", "nemotron_v3", false,
                 "<think>\ncall it\n</think>\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                 "\n", "\ncall it\n", {{"f", "{\"a\": \"1\"}"}}, 1, true},
        };
        (void)state;
        run_cases(cases, N(cases));
}

/* The names common/config.c accepts are the names the router implements. */
static void test_names_agree(void **state) {
        (void)state;
        for (const char *const *n = tsr_config_tool_call_parsers(); *n; n++)
                assert_non_null(tsr_tools_parser_find(*n));
        for (const char *const *n = tsr_config_reasoning_parsers(); *n; n++)
                assert_non_null(tsr_reasoning_parser_find(*n));
        assert_null(tsr_tools_parser_find("mistral"));
        assert_null(tsr_reasoning_parser_find("qwen3"));
}

/* Messages for the template: arguments strings become objects, tool results keep
 * their id, other keys go; a bad arguments string is an error. */
static void test_template_messages(void **state) {
        char err[256];
        json_t *in = json_loads(
                "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
                "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
                "{\"name\":\"f\",\"arguments\":\"{\\\"x\\\": 1}\"}},{\"id\":\"c2\",\"type\":\"function\",\"function\":"
                "{\"name\":\"g\",\"arguments\":\"\"}}]},"
                "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"42\",\"extra\":1}]",
                0, NULL);
        json_t *out, *want;
        (void)state;
        assert_non_null(in);
        out = tsr_tools_template_messages(in, err, sizeof(err));
        assert_non_null(out);
        want = json_loads("[{\"role\":\"user\",\"content\":\"a\\nb\"},"
                          "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
                          "\"function\":{\"name\":\"f\",\"arguments\":{\"x\":1}}},{\"id\":\"c2\",\"type\":\"function\","
                          "\"function\":{\"name\":\"g\",\"arguments\":{}}}]},"
                          "{\"role\":\"tool\",\"content\":\"42\",\"tool_call_id\":\"c1\"}]",
                          0, NULL);
        assert_true(json_equal(out, want));
        json_decref(out);
        json_decref(want);
        json_decref(in);
        in = json_loads("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{bad\"}}]}]", 0,
                        NULL);
        assert_null(tsr_tools_template_messages(in, err, sizeof(err)));
        assert_true(strlen(err) > 0);
        json_decref(in);
}

/* The canonical writer alone: partial input writes only what is sure. */
static void test_canon_partial(void **state) {
        const tsr_canon_opts o = {0};
        tsr_buf b;
        size_t pos = 0;
        (void)state;
        tsr_buf_init(&b, 1 << 20);
        assert_int_equal(tsr_canon_value("{\"a\": 12", 8, &pos, &o, &b), 0);
        assert_string_equal((char *)b.data, "{\"a\": ");   /* 12 may go on */
        tsr_buf_reset(&b);
        pos = 0;
        assert_int_equal(tsr_canon_value("{\"a\": \"x\\u00", 12, &pos, &o, &b), 0);
        assert_string_equal((char *)b.data, "{\"a\": \"x");
        tsr_buf_reset(&b);
        pos = 0;
        assert_int_equal(tsr_canon_value("[1,]", 4, &pos, &o, &b), -1);   /* JSON: no trailing comma */
        tsr_buf_reset(&b);
        pos = 0;
        assert_int_equal(tsr_canon_value("\"a\tb\"", 5, &pos, &o, &b), -1);   /* raw control character */
        tsr_buf_done(&b);
}

/* Outputs stitched at random from the formats' pieces, and cut anywhere: every parser
 * answers (content or calls) in both modes, streamed too, without a crash or a leak
 * (a model's output is untrusted input). */
static void test_random_outputs(void **state) {
        static const char *const pieces[] = {
                "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>",
                "</think>", "{", "}", "[", "]", "(", ")", "\"", "'", ":", ",", ";", "=", "\\", "\\u12", "\\ud83d",
                "name", "arguments", "parameters", "f", "x", "1", "-", "1e", ".5", "True", "None", "null", "NaN",
                "<|python_tag|>", "<|python_start|>", "<|python_end|>", " ", "\n", "\xc3\xa9", "\xf0\x9f\x98\x80", "\xff",
        };
        static const char *const tool_parsers[] = {"hermes", "llama3_json", "pythonic", "llama4_pythonic", "qwen3_coder"};
        json_t *tools = tools_schema();
        tsr_tools_ctx ctx = {.tools = tools};
        uint64_t rng = 0x9E3779B97F4A7C15ull;
        char text[512];
        (void)state;
        for (int it = 0; it < 3000; it++) {
                size_t len = 0, n = 1 + (rng >> 59);
                for (size_t k = 0; k < n * 2; k++) {
                        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                        const char *p = pieces[(rng >> 33) % N(pieces)];
                        if (len + strlen(p) >= sizeof(text))
                                break;
                        memcpy(text + len, p, strlen(p));
                        len += strlen(p);
                }
                text[len] = '\0';
                const tsr_tools_parser *tp = tsr_tools_parser_find(tool_parsers[it % N(tool_parsers)]);
                const tsr_reasoning_parser *rp = it % 3 == 0 ? tsr_reasoning_parser_find("deepseek_r1") : NULL;
                json_t *msg = json_object(), *d = NULL;
                bool called;
                assert_int_equal(tsr_chat_out_message(rp, false, tp, &ctx, text, len, msg, &called), TSR_OK);
                assert_non_null(json_object_get(msg, "content"));
                json_decref(msg);
                tsr_chat_out *o = tsr_chat_out_new(rp, false, tp, &ctx);
                for (size_t k = 0; k <= len; k += 1 + (size_t)(it % 4)) {
                        assert_int_equal(tsr_chat_out_step(o, text, k, false, &d), TSR_OK);
                        json_decref(d);
                }
                assert_int_equal(tsr_chat_out_step(o, text, len, true, &d), TSR_OK);
                json_decref(d);
                tsr_chat_out_free(o);
        }
        json_decref(tools);
}

/* Python's repr of floats: what json.dumps writes for them. */
static void test_py_repr(void **state) {
        static const struct {
                double v;
                const char *want;
        } rows[] = {{1000.0, "1000.0"}, {1e16, "1e+16"}, {1.5e16, "1.5e+16"}, {123456789012345.6, "123456789012345.6"},
                    {0.0001, "0.0001"}, {0.00001, "1e-05"}, {-0.0, "-0.0"}, {2.0, "2.0"}, {0.1, "0.1"},
                    {-1.0, "-1.0"}, {1e22, "1e+22"}, {5e-324, "5e-324"}, {1.7976931348623157e308, "1.7976931348623157e+308"}};
        char buf[64];
        (void)state;
        for (size_t i = 0; i < N(rows); i++) {
                tsr_oai_py_float_repr(rows[i].v, buf, sizeof(buf));
                assert_string_equal(buf, rows[i].want);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_hermes),          cmocka_unit_test(test_llama3_json),
                cmocka_unit_test(test_pythonic),        cmocka_unit_test(test_qwen3_coder),
                cmocka_unit_test(test_reasoning),       cmocka_unit_test(test_names_agree),
                cmocka_unit_test(test_forced),
                cmocka_unit_test(test_template_messages), cmocka_unit_test(test_canon_partial),
                cmocka_unit_test(test_py_repr),
                cmocka_unit_test(test_random_outputs),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
