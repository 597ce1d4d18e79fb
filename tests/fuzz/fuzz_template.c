/* fuzz_template.c - chat-template parse and render, from bytes.
 *
 * The input, split at its first NUL byte, is a template source and a JSON context.  With no
 * NUL, or a context that is not a JSON object, the template renders with a fixed chat
 * context (system, user, assistant with a tool call, tool result, list-of-parts content,
 * tools, bos/eos, add_generation_prompt), so that most inputs exercise the template and not
 * the JSON reader.  Limits are tight (64 KiB of output, 8 MiB of memory, 20,000 steps, depth
 * 16) so a hostile template ends fast; a time-out or an out-of-memory is a finding, since
 * those bounds are what tsr_template_opts promises.
 *
 * Any status is allowed, but: parse and render return a status template.h documents, and a
 * failure carries a message (only raise_exception('') may fail with an empty one) and
 * writes no output; a successful render is NUL-terminated, is
 * valid UTF-8 when the source was (a JSON context always is), and rendering the same parsed
 * template a second time gives the same bytes (a parsed template is immutable, and the
 * router renders one template from many threads). */
#include <stdbool.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "common/template.h"
#include "fuzz.h"

static json_t *default_ctx;

static const char default_ctx_json[] =
        "{\"messages\":["
        "{\"role\":\"system\",\"content\":\"You are terse.\"},"
        "{\"role\":\"user\",\"content\":\"Hi \\u00e9\\u4e2d\\ud83d\\ude00 <|im_end|>\"},"
        "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
        "\"function\":{\"name\":\"get\",\"arguments\":{\"city\":\"Paris\",\"n\":2}}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"{\\\"t\\\": 21}\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"part one\"},{\"type\":\"image\"}]},"
        "{\"role\":\"assistant\",\"content\":\"<think>hmm</think>Sure.\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get\",\"description\":\"Weather\","
        "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
        "\"required\":[\"city\"]}}}],"
        "\"add_generation_prompt\":true,\"bos_token\":\"<s>\",\"eos_token\":\"</s>\","
        "\"enable_thinking\":false,\"n\":3,\"x\":1.5,\"none\":null}";

/* A fixed clock: the same input must render the same bytes on every run. */
static size_t fixed_strftime(char *out, size_t outlen, const char *format, void *user) {
        struct tm tm = {.tm_year = 124, .tm_mon = 6, .tm_mday = 26, .tm_hour = 12};

        (void)user;
        return strftime(out, outlen, format, &tm);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        json_error_t je;

        (void)argc;
        (void)argv;
        default_ctx = json_loads(default_ctx_json, 0, &je);
        if (!default_ctx) {
                fprintf(stderr, "fuzz_template: default context: %s\n", je.text);
                abort();
        }
        return 0;
}


static bool documented(tsr_status st) {
        return st == TSR_E_INVAL || st == TSR_E_UNSUPPORTED || st == TSR_E_LIMIT || st == TSR_E_NOMEM;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        const uint8_t *nul = memchr(data, 0, size);
        size_t src_len = nul ? (size_t)(nul - data) : size;
        tsr_template_opts o = {
                .max_output = 64 << 10,
                .max_memory = 8 << 20,
                .max_steps = 20000,
                .max_depth = 16,
                .strftime_now = fixed_strftime,
        };
        tsr_template *t = NULL;
        json_t *ctx = NULL;
        char err[512], *out = NULL, *out2 = NULL;
        size_t out_len = 0, out2_len = 0;
        tsr_status st;

        err[0] = '\0';
        st = tsr_template_parse((const char *)data, src_len, &t, err, sizeof(err));
        if (st != TSR_OK) {
                if (!documented(st) || err[0] == '\0')
                        fprintf(stderr, "parse: status %d, message \"%s\"\n", (int)st, err);
                FUZZ_CHECK(documented(st) && err[0] != '\0' && t == NULL);
                return 0;
        }
        FUZZ_CHECK(t != NULL);
        if (nul)
                ctx = json_loadb((const char *)nul + 1, size - src_len - 1, 0, NULL);
        if (ctx && !json_is_object(ctx)) {
                json_decref(ctx);
                ctx = NULL;
        }

        st = tsr_template_render(t, ctx ? ctx : default_ctx, &o, &out, &out_len, err, sizeof(err));
        if (st != TSR_OK) {
                if (!documented(st) || err[0] == '\0')
                        fprintf(stderr, "render: status %d, message \"%s\"\n", (int)st, err);
                /* raise_exception('') fails with its message, exactly: the empty string */
                FUZZ_CHECK(documented(st) && out == NULL);
                FUZZ_CHECK(err[0] != '\0' || (st == TSR_E_INVAL && memmem(data, src_len, "raise_exception", 15)));
        } else {
                FUZZ_CHECK(out != NULL && out[out_len] == '\0' && out_len <= o.max_output);
                if (fuzz_valid_utf8(data, src_len) && !fuzz_valid_utf8((const uint8_t *)out, out_len)) {
                        fprintf(stderr, "render gave invalid UTF-8: \"%s\"\n", out);
                        FUZZ_CHECK(!"a valid UTF-8 template renders valid UTF-8");
                }
                FUZZ_CHECK(tsr_template_render(t, ctx ? ctx : default_ctx, &o, &out2, &out2_len, err,
                                               sizeof(err)) == TSR_OK);
                FUZZ_CHECK(out2_len == out_len && memcmp(out, out2, out_len) == 0);
        }
        free(out);
        free(out2);
        json_decref(ctx);
        tsr_template_free(&t);
        FUZZ_CHECK(t == NULL);
        return 0;
}
