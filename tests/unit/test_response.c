/* router/stop and router/response: vLLM's stop-string rules and response shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <math.h>

#include "router/response.h"
#include "router/stop.h"

/* Feed `pieces` one at a time, as detokenized deltas arrive, and return the cut
 * output (like the router's per-token loop). */
static char *stream_stop(const char *const *pieces, size_t n, const char *const *stops, size_t n_stops, bool include,
                         int *matched) {
        static char text[1024];
        size_t len = 0;
        *matched = -1;
        for (size_t i = 0; i < n; i++) {
                size_t plen = strlen(pieces[i]);
                memcpy(text + len, pieces[i], plen);
                len += plen;
                tsr_stop_match m = tsr_stop_check(text, len, tsr_stop_utf8_count(pieces[i], plen), stops, n_stops, include);
                if (m.index >= 0) {
                        *matched = m.index;
                        len = m.cut_bytes;
                        break;
                }
        }
        text[len] = '\0';
        return text;
}

static void test_stop_basic_and_across_tokens(void **state) {
        const char *stops[] = {"END"};
        const char *pieces[] = {"Hello", " wor", "ld E", "N", "D and more"};
        int m;
        assert_string_equal(stream_stop(pieces, 5, stops, 1, false, &m), "Hello world ");
        assert_int_equal(m, 0);
        assert_string_equal(stream_stop(pieces, 5, stops, 1, true, &m), "Hello world END");
}

static void test_stop_first_in_list_wins(void **state) {
        /* vLLM tries stop strings in list order: "b" is found although "a" comes first in the text. */
        const char *stops[] = {"b", "a"};
        const char *pieces[] = {"xaxbx"};
        int m;
        assert_string_equal(stream_stop(pieces, 1, stops, 2, false, &m), "xax");
        assert_int_equal(m, 0);
}

static void test_stop_window_only_new_text(void **state) {
        /* A stop string that was already in the text before the new piece is not
         * searched again (vLLM's window): here "ab" is entirely old text. */
        const char *stops[] = {"ab"};
        tsr_stop_match mt = tsr_stop_check("xxabyyyy", 8, 2, stops, 1, false);
        assert_int_equal(mt.index, -1);
        mt = tsr_stop_check("xxabyyyy", 8, 5, stops, 1, false);
        assert_int_equal(mt.index, 0);
        assert_int_equal(mt.cut_bytes, 2);
}

static void test_stop_utf8_and_holdback(void **state) {
        const char *stops[] = {"éé", "stop"};
        const char *pieces[] = {"caf", "é", "é!"};
        int m;
        assert_string_equal(stream_stop(pieces, 3, stops, 2, false, &m), "caf");
        /* Hold back (longest stop - 1) = 3 code points: "é!" is 3 bytes, "xé!" 4. */
        assert_int_equal(tsr_stop_holdback_bytes("abcxé!", 7, stops, 2, false), 4);
        assert_int_equal(tsr_stop_holdback_bytes("ab", 2, stops, 2, false), 2);
        assert_int_equal(tsr_stop_holdback_bytes("abcdef", 6, stops, 2, true), 0);
        const char *one[] = {"x"};
        assert_int_equal(tsr_stop_holdback_bytes("abc", 3, one, 1, false), 0);
        assert_int_equal(tsr_stop_utf8_count("añ😀", strlen("añ😀")), 3);
}

static char *dump(json_t *o) {
        char *s = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        return s;
}

static void test_completion_shapes(void **state) {
        tsr_resp_head h = {.id = "cmpl-abc", .created = 1733000000, .model = "m"};
        tsr_resp_usage u = {.prompt_tokens = 5, .completion_tokens = 16};
        json_t *choices = json_array();
        json_array_append_new(choices, tsr_resp_completion_choice(0, "hi", 2, NULL, "length", tsr_resp_stop_reason(false, 0, NULL)));
        char *s = dump(tsr_resp_completion(&h, choices, &u));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"text\":\"hi\",\"logprobs\":null,\"finish_reason\":\"length\","
                "\"stop_reason\":null,\"token_ids\":null,\"prompt_logprobs\":null,\"prompt_token_ids\":null}],"
                "\"service_tier\":null,\"system_fingerprint\":null,"
                "\"usage\":{\"prompt_tokens\":5,\"total_tokens\":21,\"completion_tokens\":16,\"prompt_tokens_details\":null},"
                "\"kv_transfer_params\":null}");
        free(s);
        s = dump(tsr_resp_completion_chunk(&h, 0, " Hel", 4, NULL, NULL, NULL, NULL));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"text\":\" Hel\",\"logprobs\":null,\"finish_reason\":null,"
                "\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":null}],\"usage\":null}");
        free(s);
        s = dump(tsr_resp_usage_chunk(&h, false, &u));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"total_tokens\":21,\"completion_tokens\":16}}");
        free(s);
}

static void test_chat_shapes(void **state) {
        tsr_resp_head h = {.id = "chatcmpl-x", .created = 1733000000, .model = "m"};
        tsr_resp_usage u = {.prompt_tokens = 12, .completion_tokens = 3, .has_cached_tokens = true, .cached_tokens = 8};
        json_t *choices = json_array();
        json_array_append_new(choices, tsr_resp_chat_choice(0, "assistant", "Hi!", 3, NULL, "stop", tsr_resp_stop_reason(true, 2, NULL)));
        char *s = dump(tsr_resp_chat(&h, choices, &u));
        assert_string_equal(s,
                "{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"Hi!\",\"refusal\":null,"
                "\"annotations\":null,\"audio\":null,\"function_call\":null,\"tool_calls\":[],\"reasoning\":null,"
                "\"reasoning_content\":null},\"logprobs\":null,\"finish_reason\":\"stop\",\"stop_reason\":2,"
                "\"token_ids\":null}],\"service_tier\":null,\"system_fingerprint\":null,"
                "\"usage\":{\"prompt_tokens\":12,\"total_tokens\":15,\"completion_tokens\":3,"
                "\"prompt_tokens_details\":{\"cached_tokens\":8}},"
                "\"prompt_logprobs\":null,\"prompt_token_ids\":null,\"kv_transfer_params\":null}");
        free(s);
        s = dump(tsr_resp_chat_role_chunk(&h, 0, "assistant", NULL));
        assert_string_equal(s,
                "{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"reasoning_content\":null},"
                "\"logprobs\":null,\"finish_reason\":null}],\"prompt_token_ids\":null}");
        free(s);
        s = dump(tsr_resp_chat_chunk(&h, 0, "Hi", 2, NULL, NULL, NULL, NULL));
        assert_string_equal(s,
                "{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\",\"reasoning_content\":null},"
                "\"logprobs\":null,\"finish_reason\":null,\"token_ids\":null}]}");
        free(s);
        s = dump(tsr_resp_chat_chunk(&h, 0, "!", 1, NULL, "stop", tsr_resp_stop_reason(false, 0, "###"), NULL));
        assert_non_null(strstr(s, "\"finish_reason\":\"stop\",\"stop_reason\":\"###\",\"token_ids\":null"));
        free(s);
}

static void test_sse_framing(void **state) {
        size_t n = 0;
        char *ev = tsr_resp_sse_event(json_pack("{s:s}", "a", "é"), &n);
        assert_string_equal(ev, "data: {\"a\":\"é\"}\n\n");   /* UTF-8 kept, as pydantic writes it */
        assert_int_equal(n, strlen(ev));
        free(ev);
        assert_null(tsr_resp_sse_event(NULL, &n));
}

/* A five-token vocabulary: 3 and 4 both decode to U+FFFD (as broken byte tokens do). */
static char *fake_decode(void *ud, uint32_t id, size_t *len) {
        static const char *const texts[] = {"A", " b", "\xc3\xa9", "\xef\xbf\xbd", "\xef\xbf\xbd"};
        (void)ud;
        if (id >= 5)
                return NULL;
        *len = strlen(texts[id]);
        return strdup(texts[id]);
}

static void fill_lps(tsr_resp_token_lp *lps) {
        memset(lps, 0, 3 * sizeof(*lps));
        lps[0].token = 0;                       /* prompt position 0: no logprob */
        lps[1] = (tsr_resp_token_lp){.token = 1, .has = true, .logprob = -0.5f, .rank = 2, .n_top = 2,
                                 .top_ids = {2, 1}, .top_logprobs = {-0.25f, -0.5f}};
        lps[2] = (tsr_resp_token_lp){.token = 3, .has = true, .logprob = -INFINITY, .rank = 5, .n_top = 2,
                                 .top_ids = {4, 2}, .top_logprobs = {-0.75f, -1.0f}};
}

static void test_completion_logprobs_shape(void **state) {
        tsr_resp_token_lp lps[3];
        tsr_resp_tokens t = {.decode = fake_decode};
        fill_lps(lps);
        /* k = 1: the token itself plus one more entry; token 1 is also in its own top
         * list (merged by id); 3 and 4 share a text (merged by text: first place, last
         * value); -inf is floored; offsets count code points (" b" is 2, "é" 1). */
        char *s = dump(tsr_resp_completion_logprobs(lps, 3, 1, 0, &t));
        assert_string_equal(s, "{\"text_offset\":[0,1,3],\"token_logprobs\":[null,-0.5,-9999.0],"
                               "\"tokens\":[\"A\",\" b\",\"\xef\xbf\xbd\"],"
                               "\"top_logprobs\":[null,{\" b\":-0.5,\"\xc3\xa9\":-0.25},{\"\xef\xbf\xbd\":-0.75}]}");
        free(s);
        /* A stream chunk continues the offsets; k = 0 keeps only the token itself. */
        s = dump(tsr_resp_completion_logprobs(lps + 1, 2, 0, 7, &t));
        assert_string_equal(s, "{\"text_offset\":[7,9],\"token_logprobs\":[-0.5,-9999.0],"
                               "\"tokens\":[\" b\",\"\xef\xbf\xbd\"],"
                               "\"top_logprobs\":[{\" b\":-0.5},{\"\xef\xbf\xbd\":-9999.0}]}");
        free(s);
        /* In a completion choice, with the prompt_logprobs list beside it. */
        json_t *c = tsr_resp_completion_choice(0, "A b", 3, tsr_resp_completion_logprobs(lps, 2, 1, 0, &t), "length", NULL);
        tsr_resp_set_prompt_logprobs(c, tsr_resp_prompt_logprobs(lps, 2, &t));
        s = dump(c);
        assert_string_equal(s, "{\"index\":0,\"text\":\"A b\",\"logprobs\":{\"text_offset\":[0,1],"
                               "\"token_logprobs\":[null,-0.5],\"tokens\":[\"A\",\" b\"],"
                               "\"top_logprobs\":[null,{\" b\":-0.5,\"\xc3\xa9\":-0.25}]},"
                               "\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":null,"
                               "\"prompt_logprobs\":[null,{\"1\":{\"logprob\":-0.5,\"rank\":2,\"decoded_token\":\" b\"},"
                               "\"2\":{\"logprob\":-0.25,\"rank\":1,\"decoded_token\":\"\xc3\xa9\"}}],"
                               "\"prompt_token_ids\":null}");
        free(s);
}

static void test_chat_logprobs_shape(void **state) {
        tsr_resp_token_lp lps[3];
        tsr_resp_tokens t = {.decode = fake_decode};
        fill_lps(lps);
        char *s = dump(tsr_resp_chat_logprobs(lps + 1, 2, 2, &t));
        assert_string_equal(s,
                "{\"content\":[{\"token\":\" b\",\"logprob\":-0.5,\"bytes\":[32,98],\"top_logprobs\":["
                "{\"token\":\" b\",\"logprob\":-0.5,\"bytes\":[32,98]},"
                "{\"token\":\"\xc3\xa9\",\"logprob\":-0.25,\"bytes\":[195,169]}]},"
                "{\"token\":\"\xef\xbf\xbd\",\"logprob\":-9999.0,\"bytes\":[239,191,189],\"top_logprobs\":["
                "{\"token\":\"\xef\xbf\xbd\",\"logprob\":-9999.0,\"bytes\":[239,191,189]},"
                "{\"token\":\"\xef\xbf\xbd\",\"logprob\":-0.75,\"bytes\":[239,191,189]}]}]}");
        free(s);
        /* top_logprobs 0: an empty list per token. */
        s = dump(tsr_resp_chat_logprobs(lps + 1, 1, 0, &t));
        assert_string_equal(s, "{\"content\":[{\"token\":\" b\",\"logprob\":-0.5,\"bytes\":[32,98],\"top_logprobs\":[]}]}");
        free(s);
        /* A chat body's top-level prompt_logprobs. */
        tsr_resp_head h = {.id = "chatcmpl-x", .created = 1, .model = "m"};
        tsr_resp_usage u = {0};
        json_t *body = tsr_resp_chat(&h, json_array(), &u);
        tsr_resp_set_prompt_logprobs(body, tsr_resp_prompt_logprobs(lps, 1, &t));
        s = dump(body);
        assert_non_null(strstr(s, "\"prompt_logprobs\":[null],\"prompt_token_ids\":null"));
        free(s);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_stop_basic_and_across_tokens),
                cmocka_unit_test(test_stop_first_in_list_wins),
                cmocka_unit_test(test_stop_window_only_new_text),
                cmocka_unit_test(test_stop_utf8_and_holdback),
                cmocka_unit_test(test_completion_shapes),
                cmocka_unit_test(test_chat_shapes),
                cmocka_unit_test(test_sse_framing),
                cmocka_unit_test(test_completion_logprobs_shape),
                cmocka_unit_test(test_chat_logprobs_shape),
        };
        return cmocka_run_group_tests_name("response", tests, NULL, NULL);
}
