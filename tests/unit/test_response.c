/* router/stop and router/response: vLLM's stop-string rules and response shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

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
                stop_match m = stop_check(text, len, utf8_count(pieces[i], plen), stops, n_stops, include);
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
        stop_match mt = stop_check("xxabyyyy", 8, 2, stops, 1, false);
        assert_int_equal(mt.index, -1);
        mt = stop_check("xxabyyyy", 8, 5, stops, 1, false);
        assert_int_equal(mt.index, 0);
        assert_int_equal(mt.cut_bytes, 2);
}

static void test_stop_utf8_and_holdback(void **state) {
        const char *stops[] = {"éé", "stop"};
        const char *pieces[] = {"caf", "é", "é!"};
        int m;
        assert_string_equal(stream_stop(pieces, 3, stops, 2, false, &m), "caf");
        /* Hold back (longest stop - 1) = 3 code points: "é!" is 3 bytes, "xé!" 4. */
        assert_int_equal(stop_holdback_bytes("abcxé!", 7, stops, 2, false), 4);
        assert_int_equal(stop_holdback_bytes("ab", 2, stops, 2, false), 2);
        assert_int_equal(stop_holdback_bytes("abcdef", 6, stops, 2, true), 0);
        const char *one[] = {"x"};
        assert_int_equal(stop_holdback_bytes("abc", 3, one, 1, false), 0);
        assert_int_equal(utf8_count("añ😀", strlen("añ😀")), 3);
}

static char *dump(json_t *o) {
        char *s = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        return s;
}

static void test_completion_shapes(void **state) {
        resp_head h = {.id = "cmpl-abc", .created = 1733000000, .model = "m"};
        resp_usage u = {.prompt_tokens = 5, .completion_tokens = 16};
        json_t *choices = json_array();
        json_array_append_new(choices, resp_completion_choice(0, "hi", 2, NULL, "length", resp_stop_reason(false, 0, NULL)));
        char *s = dump(resp_completion(&h, choices, &u));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"text\":\"hi\",\"logprobs\":null,\"finish_reason\":\"length\","
                "\"stop_reason\":null,\"token_ids\":null,\"prompt_logprobs\":null,\"prompt_token_ids\":null}],"
                "\"service_tier\":null,\"system_fingerprint\":null,"
                "\"usage\":{\"prompt_tokens\":5,\"total_tokens\":21,\"completion_tokens\":16,\"prompt_tokens_details\":null},"
                "\"kv_transfer_params\":null}");
        free(s);
        s = dump(resp_completion_chunk(&h, 0, " Hel", 4, NULL, NULL, NULL, NULL));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"text\":\" Hel\",\"logprobs\":null,\"finish_reason\":null,"
                "\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":null}],\"usage\":null}");
        free(s);
        s = dump(resp_usage_chunk(&h, false, &u));
        assert_string_equal(s,
                "{\"id\":\"cmpl-abc\",\"object\":\"text_completion\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"total_tokens\":21,\"completion_tokens\":16}}");
        free(s);
}

static void test_chat_shapes(void **state) {
        resp_head h = {.id = "chatcmpl-x", .created = 1733000000, .model = "m"};
        resp_usage u = {.prompt_tokens = 12, .completion_tokens = 3, .has_cached_tokens = true, .cached_tokens = 8};
        json_t *choices = json_array();
        json_array_append_new(choices, resp_chat_choice(0, "assistant", "Hi!", 3, NULL, "stop", resp_stop_reason(true, 2, NULL)));
        char *s = dump(resp_chat(&h, choices, &u));
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
        s = dump(resp_chat_role_chunk(&h, 0, "assistant", NULL));
        assert_string_equal(s,
                "{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"reasoning_content\":null},"
                "\"logprobs\":null,\"finish_reason\":null}],\"prompt_token_ids\":null}");
        free(s);
        s = dump(resp_chat_chunk(&h, 0, "Hi", 2, NULL, NULL, NULL, NULL));
        assert_string_equal(s,
                "{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"m\","
                "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\",\"reasoning_content\":null},"
                "\"logprobs\":null,\"finish_reason\":null,\"token_ids\":null}]}");
        free(s);
        s = dump(resp_chat_chunk(&h, 0, "!", 1, NULL, "stop", resp_stop_reason(false, 0, "###"), NULL));
        assert_non_null(strstr(s, "\"finish_reason\":\"stop\",\"stop_reason\":\"###\",\"token_ids\":null"));
        free(s);
}

static void test_sse_framing(void **state) {
        size_t n = 0;
        char *ev = resp_sse_event(json_pack("{s:s}", "a", "é"), &n);
        assert_string_equal(ev, "data: {\"a\":\"é\"}\n\n");   /* UTF-8 kept, as pydantic writes it */
        assert_int_equal(n, strlen(ev));
        free(ev);
        assert_null(resp_sse_event(NULL, &n));
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
        };
        return cmocka_run_group_tests_name("response", tests, NULL, NULL);
}
