/* chat.c - a chat choice's output through the reasoning and tool-call parsers, for
 * the stream (one delta per Output) and for the whole response (see tools.h).
 * Loop thread (one choice at a time). */
#include <stdlib.h>
#include <string.h>

#include "router/tools/tools.h"

struct tsr_chat_out {
        const tsr_reasoning_parser *rp;
        bool thinking_off;
        const tsr_tools_parser *tp;
        tsr_tools_stream *ts;
        size_t r_sent;                /* end (absolute) of the reasoning sent */
        size_t c_sent;                /* content bytes sent (without a tool parser) */
};

tsr_chat_out *tsr_chat_out_new(const tsr_reasoning_parser *rp, bool thinking_off, const tsr_tools_parser *tp,
                               const tsr_tools_ctx *ctx) {
        tsr_chat_out *o = calloc(1, sizeof(*o));
        if (!o)
                return NULL;
        o->rp = rp;
        o->thinking_off = thinking_off;
        o->tp = tp;
        if (tp && !(o->ts = tsr_tools_stream_new(tp, ctx))) {
                free(o);
                return NULL;
        }
        return o;
}

void tsr_chat_out_free(tsr_chat_out *o) {
        if (!o)
                return;
        tsr_tools_stream_free(o->ts);
        free(o);
}

bool tsr_chat_out_called(const tsr_chat_out *o) { return o && tsr_tools_stream_called(o->ts); }

static json_t *strn(const char *s, size_t n) { return json_stringn_nocheck(s, n); }

tsr_status tsr_chat_out_step(tsr_chat_out *o, const char *text, size_t len, bool final, json_t **delta) {
        const char *ctext = text, *piece = "";
        size_t clen = len, plen = 0, r_from = 0, r_len = 0;
        bool content_region = true;
        json_t *calls = NULL, *d;
        tsr_status st;

        *delta = NULL;
        if (o->rp) {
                tsr_reasoning_view v;
                tsr_reasoning_view_of(o->rp, text, len, final, o->thinking_off, &v);
                size_t from = o->r_sent > v.r_from ? o->r_sent : v.r_from;
                if (v.r_to > from) {
                        r_from = from;
                        r_len = v.r_to - from;
                        o->r_sent = v.r_to;
                }
                content_region = v.content;
                ctext = text + v.c_from;
                clen = v.settled >= v.c_from ? v.settled - v.c_from : 0;
        }
        if (content_region) {
                if (o->ts) {
                        if ((st = tsr_tools_stream_step(o->ts, ctext, clen, final, &piece, &plen, &calls)) != TSR_OK)
                                return st;
                } else if (clen > o->c_sent) {
                        piece = ctext + o->c_sent;
                        plen = clen - o->c_sent;
                        o->c_sent = clen;
                }
        }
        if (!plen && !r_len && !calls)
                return TSR_OK;
        /* DeltaMessage's field order; reasoning_content mirrors reasoning (null when unset) */
        d = json_object();
        if (plen)
                json_object_set_new(d, "content", strn(piece, plen));
        if (r_len) {
                json_object_set_new(d, "reasoning", strn(text + r_from, r_len));
                json_object_set_new(d, "reasoning_content", strn(text + r_from, r_len));
        } else {
                json_object_set_new(d, "reasoning_content", json_null());
        }
        if (calls)
                json_object_set_new(d, "tool_calls", calls);
        *delta = d;
        return TSR_OK;
}

tsr_status tsr_chat_out_message(const tsr_reasoning_parser *rp, bool thinking_off, const tsr_tools_parser *tp,
                                const tsr_tools_ctx *ctx, const char *text, size_t len, json_t *message, bool *called) {
        char *r = NULL, *c = NULL;
        size_t rl = 0, cl = len;
        const char *content = text;
        tsr_tools_result res = {0};
        tsr_status st = TSR_OK;

        *called = false;
        if (rp) {
                if ((st = tsr_reasoning_split(rp, text, len, thinking_off, &r, &rl, &c, &cl)) != TSR_OK)
                        return st;
                content = c;
        }
        if (tp) {
                if ((st = tp->parse(ctx, content ? content : "", content ? cl : 0, true, &res)) != TSR_OK)
                        goto out;
                if (res.called) {
                        *called = true;
                        content = res.content;
                        cl = res.content_len;
                        json_object_set_new(message, "tool_calls", tsr_tools_calls_json(&res));
                } else if (res.content && res.content_len) {
                        /* the parser's content first (llama4_pythonic drops its tags) */
                        content = res.content;
                        cl = res.content_len;
                }
        }
        json_object_set_new(message, "content", content ? strn(content, cl) : json_null());
        json_object_set_new(message, "reasoning", r ? strn(r, rl) : json_null());
        json_object_set_new(message, "reasoning_content", r ? strn(r, rl) : json_null());
out:
        tsr_tools_result_done(&res);
        free(r);
        free(c);
        return st;
}
