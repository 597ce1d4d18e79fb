/* reasoning.c - vLLM's `deepseek_r1` and `nemotron_v3` reasoning parsers:
 *
 *   [<think>]reasoning</think>content
 *
 * Whole output: what follows the first <think> (or all of it: the templates often put
 * <think> in the prompt), split at the first </think>; no </think> means it is all
 * reasoning and content is null; an empty content is null.  nemotron_v3 (Nemotron 3
 * Nano) swaps the two when chat_template_kwargs.enable_thinking is false and no
 * </think> came: the answer is content.  `nano_v3`, the name issue #17 uses, is taken
 * as another name of it.
 *
 * Streaming, by text: reasoning until </think>, content after it; a half-written
 * marker at the end waits for the next delta.  vLLM 0.12 streams a thinking-off
 * Nemotron answer as reasoning (its swap is in the non-stream path only); here it is
 * content, the same split as the non-streamed response. */
#include <stdlib.h>
#include <string.h>

#include "router/tools/parsers.h"

#define START "<think>"
#define END "</think>"

struct tsr_reasoning_parser {
        const char *name;
        bool swap_when_off;
};

static const tsr_reasoning_parser reasoners[] = {
        {"deepseek_r1", false},
        {"nemotron_v3", true},
        {"nano_v3", true},
};

const tsr_reasoning_parser *tsr_reasoning_parser_find(const char *name) {
        for (size_t i = 0; name && i < sizeof(reasoners) / sizeof(reasoners[0]); i++)
                if (strcmp(reasoners[i].name, name) == 0)
                        return &reasoners[i];
        return NULL;
}

static size_t find(const char *s, size_t n, size_t from, const char *m) {
        const char *p = from <= n ? memmem(s + from, n - from, m, strlen(m)) : NULL;
        return p ? (size_t)(p - s) : (size_t)-1;
}

tsr_status tsr_reasoning_split(const tsr_reasoning_parser *p, const char *text, size_t len, bool thinking_off,
                               char **reasoning, size_t *reasoning_len, char **content, size_t *content_len) {
        size_t st = find(text, len, 0, START), base = st == (size_t)-1 ? 0 : st + strlen(START);
        size_t e = find(text, len, base, END);
        char *r = NULL, *c = NULL;
        size_t rl, cl = 0;

        rl = (e == (size_t)-1 ? len : e) - base;
        if (!(r = strndup(text + base, rl)))
                return TSR_E_NOMEM;
        if (e != (size_t)-1 && len > e + strlen(END)) {
                cl = len - e - strlen(END);
                if (!(c = strndup(text + e + strlen(END), cl))) {
                        free(r);
                        return TSR_E_NOMEM;
                }
        }
        if (p->swap_when_off && thinking_off && !c) {
                c = r;
                cl = rl;
                r = NULL;
                rl = 0;
        }
        *reasoning = r;
        *reasoning_len = rl;
        *content = c;
        *content_len = cl;
        return TSR_OK;
}

void tsr_reasoning_view_of(const tsr_reasoning_parser *p, const char *text, size_t len, bool final, bool thinking_off,
                           tsr_reasoning_view *v) {
        size_t st, base, e;
        if (p->swap_when_off && thinking_off) {
                *v = (tsr_reasoning_view){.r_from = 0, .r_to = 0, .c_from = 0, .settled = len, .content = true};
                return;
        }
        st = find(text, len, 0, START);
        base = st == (size_t)-1 ? 0 : st + strlen(START);
        e = find(text, len, base, END);
        if (e != (size_t)-1) {
                *v = (tsr_reasoning_view){.r_from = base, .r_to = e, .c_from = e + strlen(END), .settled = len,
                                          .content = true};
                return;
        }
        size_t hold = 0;
        if (!final) {
                size_t h1 = tsr_tools_holdback(text + base, len - base, END);
                size_t h2 = st == (size_t)-1 ? tsr_tools_holdback(text, len, START) : 0;
                hold = h1 > h2 ? h1 : h2;
        }
        *v = (tsr_reasoning_view){.r_from = base, .r_to = len - hold, .c_from = len - hold, .settled = len - hold,
                                  .content = final};
}
