/* http_server.c - listener, per-connection parsing with llhttp, limits, timeouts and the
 * write path.  Everything runs on the loop thread (see http_server.h).
 *
 * Life of a connection:
 *
 *   accept ─► REQ_NONE ─(first byte)─► REQ_HEAD ─(headers)─► REQ_BODY ─(message end)─►
 *   REQ_HANDLER ─(respond / stream_end)─► REQ_DONE ─(last write_cb)─► REQ_NONE ...
 *
 * When a message is complete, on_message_complete pauses llhttp; bytes after it (pipelined
 * requests) are kept in `pending` (capped; reading stops when it is full) and are parsed
 * only once the response has been written completely.  That is what keeps pipelined
 * responses in order and lets the request arena die at a single, well-defined point.
 *
 * One uv_timer per connection serves every timeout: header deadline (REQ_NONE before the
 * first request, REQ_HEAD), body stall (REQ_BODY), keep-alive idle (REQ_NONE after a
 * response) and the lingering close.  No timer runs while a handler owns the request or
 * its response is being written.
 *
 * Closing: a graceful close (after a "connection: close" response or a server-generated
 * error) waits for the writes, sends FIN with uv_shutdown, then keeps reading and
 * discarding for up to LINGER_MS so that unread request bytes cannot turn into a RST that
 * destroys the response in flight (nginx's lingering_close).  A hard close is uv_close on
 * both handles.  The struct is freed only when both close callbacks have run, no write
 * is pending and no handler owns a request (conn_maybe_free). */
#include "router/http_server.h"

#include <assert.h>
#include <errno.h>
#include <stdatomic.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include <jansson.h>
#include <llhttp.h>

#include "common/buf.h"
#include "common/log.h"

#define READ_BUF_SIZE  (64 * 1024)
#define PENDING_CAP    (2 * READ_BUF_SIZE)   /* buffered pipelined bytes while a request is handled */
#define LINGER_MS      2000
#define LISTEN_BACKLOG 511

enum req_state {
        REQ_NONE,       /* between requests: no byte of the next one yet */
        REQ_HEAD,       /* request line and headers arriving */
        REQ_BODY,       /* headers parsed, body arriving */
        REQ_HANDLER,    /* dispatched; the handler owns it */
        REQ_DONE,       /* response complete; waiting for its writes to finish */
};

enum resp_state {
        RESP_NONE,
        RESP_STREAMING,
        RESP_DONE,
};

struct tsr_http_conn {
        tsr_http_server *s;
        tsr_http_conn *prev, *next;       /* s->conns */
        uv_tcp_t tcp;
        uv_timer_t timer;
        uv_shutdown_t shutdown_req;
        int handles_open;             /* tcp + timer until their close_cb */
        size_t pending_writes;        /* uv_write requests whose write_cb has not run */

        llhttp_t parser;
        enum req_state req_state;
        enum resp_state resp_state;
        bool parser_paused;           /* a message is complete; llhttp paused until it is answered */
        bool req_ready;               /* on_message_complete ran; dispatch after llhttp returns */
        bool handler_owns;
        bool reading;
        bool draining;                /* closing after the writes: input is discarded */
        bool lingering;               /* FIN sent; reading and discarding until EOF or timeout */
        bool peer_eof;
        bool closing;                 /* uv_close called */
        bool in_header_field;
        bool head_done;               /* later header callbacks are trailers: ignored */
        bool streaming_chunked;
        bool detached;                /* tsr_http_parse_one's connection: no socket, no timer */
        int err_status;               /* set by a parser callback that fails the request */
        void (*on_close)(void *ud);
        void *on_close_ud;

        tsr_buf pending;              /* unparsed bytes after a paused message */
        tsr_buf head;                 /* url '\0' name '\0' value '\0' ... */
        tsr_buf body;
        size_t head_bytes;            /* raw-ish head size, for max_header_bytes */
        size_t url_len;
        size_t n_headers;
        size_t *hoff;                 /* [2 * max_headers] name/value offsets into head, in the arena */
        tsr_http_request req;
};

struct tsr_http_server {
        uv_loop_t *loop;
        tsr_http_server_opts opts;
        tsr_http_handler_fn fn;
        void *ud;
        llhttp_settings_t settings;
        uv_tcp_t *listener;           /* own allocation: freed in its close_cb, which may outlive s */
        int port;
        tsr_http_conn *conns;
        size_t n_conns;
        /* Totals behind tsr_http_server_get_stats, atomic so that another loop's thread
         * may read them (--router-threads: /metrics sums every loop's server). */
        struct {
                atomic_uint_least64_t accepted, rejected_cap, header_timeouts, body_timeouts, idle_timeouts;
                atomic_size_t open;
        } counters;
        bool iterating;               /* walking `conns`: on_close callbacks must not free any */

        bool shutting_down;
        bool grace_timer_init;
        bool grace_timer_closing;
        bool grace_timer_closed;
        bool done_called;
        uv_timer_t grace_timer;
        void (*done)(void *ud);
        void *done_ud;

        char rbuf[READ_BUF_SIZE];     /* shared read buffer: every read is consumed in its read_cb */
};

static void conn_close(tsr_http_conn *c, bool notify);
static void conn_after_writes(tsr_http_conn *c);
static void conn_parse(tsr_http_conn *c, const char *data, size_t len, bool from_pending);
static void conn_update_reading(tsr_http_conn *c);
static void server_check_done(tsr_http_server *s);
static void conn_timer_cb(uv_timer_t *t);

/* ---- small helpers --------------------------------------------------------------- */

const char *tsr_http_reason_phrase(int status) {
        switch (status) {
        case 100: return "Continue";
        case 101: return "Switching Protocols";
        case 200: return "OK";
        case 201: return "Created";
        case 202: return "Accepted";
        case 204: return "No Content";
        case 206: return "Partial Content";
        case 301: return "Moved Permanently";
        case 302: return "Found";
        case 304: return "Not Modified";
        case 307: return "Temporary Redirect";
        case 308: return "Permanent Redirect";
        case 400: return "Bad Request";
        case 401: return "Unauthorized";
        case 403: return "Forbidden";
        case 404: return "Not Found";
        case 405: return "Method Not Allowed";
        case 406: return "Not Acceptable";
        case 408: return "Request Timeout";
        case 409: return "Conflict";
        case 411: return "Length Required";
        case 413: return "Request Entity Too Large";
        case 414: return "Request-URI Too Long";
        case 415: return "Unsupported Media Type";
        case 417: return "Expectation Failed";
        case 422: return "Unprocessable Entity";
        case 429: return "Too Many Requests";
        case 431: return "Request Header Fields Too Large";
        case 500: return "Internal Server Error";
        case 501: return "Not Implemented";
        case 502: return "Bad Gateway";
        case 503: return "Service Unavailable";
        case 504: return "Gateway Timeout";
        case 505: return "HTTP Version Not Supported";
        default: return "Unknown";
        }
}

void tsr_http_server_opts_default(tsr_http_server_opts *o) {
        o->max_body = 32u << 20;
        o->max_header_bytes = 64u << 10;
        o->max_headers = 100;
        o->header_timeout_ms = 10000;
        o->idle_timeout_ms = 5000;
        o->max_connections = 10000;
        o->max_write_queue = 8u << 20;
}

const char *tsr_http_request_header(const tsr_http_request *r, const char *lower_name) {
        for (size_t i = 0; i < r->n_headers; i++)
                if (strcasecmp(r->headers[i].name, lower_name) == 0)
                        return r->headers[i].value;
        return NULL;
}

static void conn_arm_timer(tsr_http_conn *c, uint64_t ms, uv_timer_cb cb) {
        if (c->closing || c->detached)
                return;
        if (ms == 0) {
                uv_timer_stop(&c->timer);
                return;
        }
        uv_timer_start(&c->timer, cb, ms, 0);
}

/* Release everything that belongs to the current request. */
static void conn_request_done(tsr_http_conn *c) {
        tsr_arena_free(&c->req.arena);   /* runs the cleanups: frees the body */
        memset(&c->req, 0, sizeof(c->req));
        c->hoff = NULL;
        tsr_buf_done(&c->head);
        tsr_buf_done(&c->body);
        c->n_headers = 0;
        c->head_bytes = 0;
        c->url_len = 0;
        c->in_header_field = false;
        c->head_done = false;
        c->req_ready = false;
        c->resp_state = RESP_NONE;
        c->streaming_chunked = false;
        c->on_close = NULL;
        c->on_close_ud = NULL;
}

/* ---- freeing --------------------------------------------------------------------- */

/* Free `c` once nothing can reach it any more: both handles closed (their close_cb has
 * run), no write request outstanding, no handler holding the request.  May free `c`:
 * callers return right after. */
static void conn_maybe_free(tsr_http_conn *c) {
        tsr_http_server *s = c->s;

        if (!c->closing || c->handles_open > 0 || c->pending_writes > 0 || c->handler_owns || s->iterating)
                return;
        conn_request_done(c);
        tsr_buf_done(&c->pending);
        if (c->prev)
                c->prev->next = c->next;
        else
                s->conns = c->next;
        if (c->next)
                c->next->prev = c->prev;
        s->n_conns--;
        atomic_fetch_sub_explicit(&s->counters.open, 1, memory_order_relaxed);
        free(c);
        server_check_done(s);
}

static void conn_handle_close_cb(uv_handle_t *h) {
        tsr_http_conn *c = h->data;
        c->handles_open--;
        conn_maybe_free(c);
}

/* Hard close.  `notify`: fire the handler's on_close if it still owns the request; false
 * when we are inside an http_conn_* call made by the handler (it learns from the return
 * value instead, and keeps ownership until it ends the response). */
static void conn_close(tsr_http_conn *c, bool notify) {
        if (c->closing)
                return;
        c->closing = true;
        c->reading = false;
        uv_close((uv_handle_t *)&c->tcp, conn_handle_close_cb);   /* cancels writes/shutdown first */
        uv_close((uv_handle_t *)&c->timer, conn_handle_close_cb);
        if (notify && c->handler_owns && c->on_close) {
                void (*cb)(void *) = c->on_close;
                void *ud = c->on_close_ud;
                c->on_close = NULL;
                c->handler_owns = false;
                cb(ud);
        }
}

/* ---- writing --------------------------------------------------------------------- */

struct wreq {
        uv_write_t req;
        tsr_http_conn *c;
        size_t len;
        char data[];
};

static void conn_write_cb(uv_write_t *req, int status) {
        struct wreq *w = (struct wreq *)req;
        tsr_http_conn *c = w->c;

        c->pending_writes--;
        free(w);
        if (status < 0 && !c->closing) {
                log_debug("http: write failed: %s", uv_strerror(status));
                conn_close(c, true);
        }
        if (c->closing) {
                conn_maybe_free(c);
                return;
        }
        if (c->pending_writes == 0)
                conn_after_writes(c);
}

/* Queue `a` followed by `b` (either may be empty) as one write; both are copied. */
static tsr_status conn_write2(tsr_http_conn *c, const void *a, size_t alen, const void *b, size_t blen) {
        struct wreq *w;
        uv_buf_t ub;
        int r;

        if (alen > UINT_MAX || blen > UINT_MAX - alen)
                return TSR_E_LIMIT;   /* uv_buf_t lengths are unsigned int */
        w = malloc(sizeof(*w) + alen + blen);
        if (!w)
                return TSR_E_NOMEM;
        w->c = c;
        w->len = alen + blen;
        if (alen)
                memcpy(w->data, a, alen);
        if (blen)
                memcpy(w->data + alen, b, blen);
        ub = uv_buf_init(w->data, (unsigned int)w->len);
        r = uv_write(&w->req, (uv_stream_t *)&c->tcp, &ub, 1, conn_write_cb);
        if (r < 0) {
                free(w);
                log_debug("http: uv_write: %s", uv_strerror(r));
                return TSR_E_IO;
        }
        c->pending_writes++;
        return TSR_OK;
}

/* Status line and headers, into `out` (uncapped beyond extra_headers' own size). */
static tsr_status build_head(tsr_buf *out, const tsr_http_conn *c, int status, const char *content_type,
                             bool has_length, size_t len, bool chunked, const char *extra) {
        tsr_status st;

        st = tsr_buf_appendf(out, "HTTP/1.1 %d %s\r\nserver: tessera\r\n", status, tsr_http_reason_phrase(status));
        if (st == TSR_OK && content_type)
                st = tsr_buf_appendf(out, "content-type: %s\r\n", content_type);
        if (st == TSR_OK && has_length)
                st = tsr_buf_appendf(out, "content-length: %zu\r\n", len);
        if (st == TSR_OK && chunked)
                st = tsr_buf_append_str(out, "transfer-encoding: chunked\r\n");
        if (st == TSR_OK) {
                if (!c->req.keep_alive)
                        st = tsr_buf_append_str(out, "connection: close\r\n");
                else if (c->req.http_major == 1 && c->req.http_minor == 0)
                        st = tsr_buf_append_str(out, "connection: keep-alive\r\n");
        }
        if (st == TSR_OK && extra)
                st = tsr_buf_append_str(out, extra);
        if (st == TSR_OK)
                st = tsr_buf_append(out, "\r\n", 2);
        return st;
}

static bool extra_ok(const char *extra) {
        size_t n;
        if (!extra || !*extra)
                return true;
        n = strlen(extra);
        return n >= 2 && extra[n - 2] == '\r' && extra[n - 1] == '\n';
}

/* Write a complete response with a Content-Length.  Shared by tsr_http_conn_respond and the
 * server's own errors; the caller has checked state. */
static tsr_status conn_send(tsr_http_conn *c, int status, const char *content_type, const void *body, size_t len,
                            const char *extra) {
        tsr_buf head;
        tsr_status st;
        bool no_body = status == 204 || status == 304 || (status >= 100 && status < 200);
        bool is_head = c->req.method && strcmp(c->req.method, "HEAD") == 0;

        tsr_buf_init(&head, SIZE_MAX - 1);
        st = build_head(&head, c, status, content_type, !no_body, len, false, extra);
        if (st == TSR_OK)
                st = conn_write2(c, head.data, head.len, body, (no_body || is_head) ? 0 : len);
        tsr_buf_done(&head);
        return st;
}

/* JSON error body in vLLM's shape; the string is malloc'd (json_dumps) or NULL on OOM. */
static char *error_json(int status, const char *type, const char *message) {
        json_t *o = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", message ? message : "", "type",
                              type ? type : tsr_http_reason_phrase(status), "param", "code", status);
        char *s;

        if (!o)
                return NULL;
        s = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        return s;
}

/* A server-generated error (no handler owns the request): answer, then close gracefully. */
static void conn_fail(tsr_http_conn *c, int status, const char *message) {
        char *body;
        tsr_status st = TSR_E_NOMEM;

        if (c->closing || c->draining)
                return;
        log_debug("http: %d %s", status, message);
        c->draining = true;
        c->req.keep_alive = false;
        conn_arm_timer(c, LINGER_MS, conn_timer_cb);   /* write deadline for a client that never reads */
        body = error_json(status, NULL, message);
        if (body)
                st = conn_send(c, status, "application/json", body, strlen(body), NULL);
        free(body);
        if (st != TSR_OK) {
                conn_close(c, true);
                return;
        }
        conn_update_reading(c);
}

/* ---- timers ---------------------------------------------------------------------- */

static void conn_timer_cb(uv_timer_t *t) {
        tsr_http_conn *c = t->data;
        char msg[96];

        if (c->closing)
                return;
        if (c->lingering || c->draining) {
                conn_close(c, true);
                return;
        }
        switch (c->req_state) {
        case REQ_NONE:
                /* nothing of a request yet (idle keep-alive or a silent new connection) */
                atomic_fetch_add_explicit(&c->s->counters.idle_timeouts, 1, memory_order_relaxed);
                conn_close(c, true);
                break;
        case REQ_HEAD:
                atomic_fetch_add_explicit(&c->s->counters.header_timeouts, 1, memory_order_relaxed);
                snprintf(msg, sizeof(msg), "Request headers not received within %llu ms",
                         (unsigned long long)c->s->opts.header_timeout_ms);
                conn_fail(c, 408, msg);
                break;
        case REQ_BODY:
                atomic_fetch_add_explicit(&c->s->counters.body_timeouts, 1, memory_order_relaxed);
                snprintf(msg, sizeof(msg), "Request body stalled for %llu ms",
                         (unsigned long long)c->s->opts.header_timeout_ms);
                conn_fail(c, 408, msg);
                break;
        case REQ_HANDLER:
        case REQ_DONE:
                break;
        }
}

/* ---- reading --------------------------------------------------------------------- */

static void conn_alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
        tsr_http_conn *c = h->data;
        size_t n = READ_BUF_SIZE;

        (void)suggested;
        /* While parsing is paused, read no more than `pending` can still hold. */
        if (c->parser_paused && !c->draining && !c->lingering) {
                size_t room = c->pending.len < PENDING_CAP ? PENDING_CAP - c->pending.len : 0;
                if (room < n)
                        n = room;
        }
        *buf = uv_buf_init(c->s->rbuf, (unsigned int)n);   /* n == 0 -> UV_ENOBUFS in read_cb */
}

/* The peer closed its side or the read failed. */
static void conn_on_eof(tsr_http_conn *c, ssize_t nread) {
        c->peer_eof = true;
        if (nread == UV_EOF && c->pending_writes > 0 && !c->handler_owns && !c->lingering &&
            (c->req_state == REQ_DONE || c->draining)) {
                /* A half-close with a complete response (or our error) still being written:
                 * finish writing it, then close. */
                c->draining = true;
                conn_update_reading(c);
                return;
        }
        /* Idle, mid-request, lingering, reset, or a handler still working for a client
         * that has gone: close (on_close cancels the work). */
        conn_close(c, true);
}

static void conn_read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
        tsr_http_conn *c = st->data;

        if (c->closing)
                return;
        if (nread == UV_ENOBUFS) {
                conn_update_reading(c);
                return;
        }
        if (nread < 0) {
                conn_on_eof(c, nread);
                return;
        }
        if (nread == 0 || c->draining || c->lingering)
                return;   /* EAGAIN, or input we no longer care about */
        if (c->req_state == REQ_BODY)
                conn_arm_timer(c, c->s->opts.header_timeout_ms, conn_timer_cb);
        if (c->parser_paused) {
                /* Pipelined bytes while a request is being answered; alloc_cb kept this within the cap. */
                if (tsr_buf_append(&c->pending, buf->base, (size_t)nread) != TSR_OK) {
                        conn_close(c, true);
                        return;
                }
        } else {
                conn_parse(c, buf->base, (size_t)nread, false);
        }
        conn_update_reading(c);
}

/* Read unless the connection is closing, the peer has finished, or pipelined input is at its cap. */
static void conn_update_reading(tsr_http_conn *c) {
        bool want;

        if (c->closing)
                return;
        want = !c->peer_eof &&
               (c->draining || c->lingering || !c->parser_paused || c->pending.len < PENDING_CAP);
        if (want && !c->reading) {
                if (uv_read_start((uv_stream_t *)&c->tcp, conn_alloc_cb, conn_read_cb) == 0)
                        c->reading = true;
                else
                        conn_close(c, true);
        } else if (!want && c->reading) {
                uv_read_stop((uv_stream_t *)&c->tcp);
                c->reading = false;
        }
}

/* ---- llhttp callbacks (inside llhttp_execute, from conn_parse) ---------------------- */

static int fail_cb(tsr_http_conn *c, int status) {
        if (!c->err_status)
                c->err_status = status;
        return -1;
}

static tsr_status head_append(tsr_http_conn *c, const char *at, size_t len) {
        c->head_bytes += len;
        if (c->head_bytes > c->s->opts.max_header_bytes)
                return TSR_E_LIMIT;
        return tsr_buf_append(&c->head, at, len);
}

static int cb_status(tsr_http_conn *c, tsr_status st) {
        if (st == TSR_OK)
                return 0;
        return fail_cb(c, st == TSR_E_LIMIT ? 431 : 500);
}

static int on_message_begin(llhttp_t *p) {
        tsr_http_conn *c = p->data;

        c->req_state = REQ_HEAD;
        c->err_status = 0;
        c->req.arena = tsr_arena_new(8192, 0);
        if (!c->req.arena)
                return fail_cb(c, 500);
        c->hoff = tsr_arena_alloc(c->req.arena, 2 * c->s->opts.max_headers * sizeof(size_t));
        if (!c->hoff)
                return fail_cb(c, 500);
        tsr_buf_init(&c->head, c->s->opts.max_header_bytes + 1);
        tsr_buf_init(&c->body, c->s->opts.max_body);
        conn_arm_timer(c, c->s->opts.header_timeout_ms, conn_timer_cb);
        return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len) {
        return cb_status(p->data, head_append(p->data, at, len));
}

static int on_url_complete(llhttp_t *p) {
        tsr_http_conn *c = p->data;
        c->url_len = c->head.len;
        return cb_status(c, head_append(c, "", 1));
}

static int on_header_field(llhttp_t *p, const char *at, size_t len) {
        tsr_http_conn *c = p->data;
        size_t from = c->head.len;
        tsr_status st;

        if (c->head_done)
                return 0;   /* trailer: ignored (body stall timer and max_body bound it) */
        if (!c->in_header_field) {
                if (c->n_headers >= c->s->opts.max_headers)
                        return fail_cb(c, 431);
                c->in_header_field = true;
                c->hoff[2 * c->n_headers] = from;
                c->head_bytes += 4;   /* ": " and CRLF */
        }
        st = head_append(c, at, len);
        if (st == TSR_OK)
                for (size_t i = from; i < c->head.len; i++)
                        if (c->head.data[i] >= 'A' && c->head.data[i] <= 'Z')
                                c->head.data[i] += 'a' - 'A';
        return cb_status(c, st);
}

static int on_header_field_complete(llhttp_t *p) {
        tsr_http_conn *c = p->data;
        tsr_status st;

        if (c->head_done)
                return 0;
        c->in_header_field = false;
        st = head_append(c, "", 1);
        c->hoff[2 * c->n_headers + 1] = c->head.len;
        return cb_status(c, st);
}

static int on_header_value(llhttp_t *p, const char *at, size_t len) {
        tsr_http_conn *c = p->data;
        if (c->head_done)
                return 0;
        return cb_status(c, head_append(c, at, len));
}

static int on_header_value_complete(llhttp_t *p) {
        tsr_http_conn *c = p->data;
        tsr_status st;

        if (c->head_done)
                return 0;
        st = head_append(c, "", 1);
        if (st == TSR_OK)
                c->n_headers++;
        return cb_status(c, st);
}

static int on_headers_complete(llhttp_t *p) {
        tsr_http_conn *c = p->data;
        tsr_http_request *r = &c->req;
        tsr_http_header *hs = NULL;
        char *copy, *q;
        const char *expect;

        c->head_done = true;
        copy = tsr_arena_memdup(r->arena, c->head.data ? (const char *)c->head.data : "", c->head.len + 1);
        if (c->n_headers)
                hs = tsr_arena_calloc(r->arena, c->n_headers, sizeof(*hs));
        if (!copy || (c->n_headers && !hs))
                return fail_cb(c, 500);
        for (size_t i = 0; i < c->n_headers; i++) {
                hs[i].name = copy + c->hoff[2 * i];
                hs[i].value = copy + c->hoff[2 * i + 1];
        }
        tsr_buf_done(&c->head);
        r->method = llhttp_method_name((llhttp_method_t)p->method);
        r->path = copy;               /* url is first, NUL-terminated at url_len */
        q = memchr(copy, '?', c->url_len);
        if (q) {
                *q = '\0';
                r->query = q + 1;
        } else {
                r->query = "";
        }
        r->headers = hs;
        r->n_headers = c->n_headers;
        r->http_major = p->http_major;
        r->http_minor = p->http_minor;
        r->keep_alive = llhttp_should_keep_alive(p) && !c->s->shutting_down;

        if ((p->flags & F_CONTENT_LENGTH) && p->content_length > c->s->opts.max_body)
                return fail_cb(c, 413);
        expect = tsr_http_request_header(r, "expect");
        if (expect && strcasecmp(expect, "100-continue") == 0 && r->http_major == 1 && r->http_minor >= 1 &&
            ((p->flags & F_CHUNKED) || p->content_length > 0) && !c->detached) {
                static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
                if (conn_write2(c, cont, sizeof(cont) - 1, NULL, 0) != TSR_OK)
                        return fail_cb(c, 500);
        }
        c->req_state = REQ_BODY;
        conn_arm_timer(c, c->s->opts.header_timeout_ms, conn_timer_cb);
        return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len) {
        tsr_http_conn *c = p->data;
        tsr_status st = tsr_buf_append(&c->body, at, len);

        if (st == TSR_E_LIMIT)
                return fail_cb(c, 413);
        return cb_status(c, st);
}

static void free_cleanup(void *p) { free(p); }

static int on_message_complete(llhttp_t *p) {
        tsr_http_conn *c = p->data;
        tsr_http_request *r = &c->req;

        if (c->body.len) {
                size_t n;
                uint8_t *b;
                if (tsr_arena_add_cleanup(r->arena, free_cleanup, c->body.data) != TSR_OK)
                        return fail_cb(c, 500);
                b = tsr_buf_steal(&c->body, &n);   /* now owned by the arena cleanup */
                r->body = b;
                r->body_len = n;
        } else {
                tsr_buf_done(&c->body);
                r->body = (const uint8_t *)"";
                r->body_len = 0;
        }
        if (p->upgrade)
                r->keep_alive = false;   /* no protocol switch here: answer, then close */
        c->req_ready = true;
        return HPE_PAUSED;   /* stop here: the next message waits for this response */
}

/* ---- parsing and dispatch ---------------------------------------------------------- */

static void conn_dispatch(tsr_http_conn *c) {
        tsr_http_server *s = c->s;

        c->req_ready = false;
        c->req_state = REQ_HANDLER;
        c->resp_state = RESP_NONE;
        c->handler_owns = true;
        if (s->shutting_down)
                c->req.keep_alive = false;
        uv_timer_stop(&c->timer);
        s->fn(s->ud, c, &c->req);
        /* `c` is still allocated here: its handles are at least closing, not closed. */
}

static const char *fail_message(int status) {
        switch (status) {
        case 413: return "Request body too large";
        case 431: return "Request header fields too large";
        case 500: return "Out of memory while reading the request";
        default: return "Invalid HTTP request received.";
        }
}

/* Feed bytes to llhttp.  `from_pending`: `data` is c->pending itself. */
static void conn_parse(tsr_http_conn *c, const char *data, size_t len, bool from_pending) {
        llhttp_errno_t err = llhttp_execute(&c->parser, data, len);
        size_t off;

        if (err == HPE_OK) {
                if (from_pending)
                        tsr_buf_reset(&c->pending);
                return;
        }
        if (err == HPE_PAUSED || err == HPE_PAUSED_UPGRADE) {
                off = (size_t)(llhttp_get_error_pos(&c->parser) - data);
                if (off > len)
                        off = len;
                c->parser_paused = true;
                if (from_pending) {
                        tsr_buf_consume(&c->pending, off);
                } else if (off < len && tsr_buf_append(&c->pending, data + off, len - off) != TSR_OK) {
                        conn_close(c, true);
                        return;
                }
                if (err == HPE_PAUSED_UPGRADE)
                        c->req.keep_alive = false;
                if (c->req_ready)
                        conn_dispatch(c);
                return;
        }
        if (from_pending)
                tsr_buf_reset(&c->pending);
        log_debug("http: parse error %s: %s", llhttp_errno_name(err), llhttp_get_error_reason(&c->parser));
        c->parser_paused = true;   /* never parse this connection again */
        conn_fail(c, c->err_status ? c->err_status : 400, fail_message(c->err_status));
}

/* The response is written: free the request and go on with the next one. */
static void conn_finish_request(tsr_http_conn *c) {
        conn_request_done(c);
        c->req_state = REQ_NONE;
        c->parser_paused = false;
        llhttp_resume(&c->parser);
        conn_arm_timer(c, c->s->opts.idle_timeout_ms, conn_timer_cb);
        if (c->pending.len)
                conn_parse(c, (const char *)c->pending.data, c->pending.len, true);
        if (!c->pending.len)
                tsr_buf_done(&c->pending);   /* give idle connections' memory back */
        conn_update_reading(c);
}

static void conn_shutdown_cb(uv_shutdown_t *req, int status) {
        tsr_http_conn *c = req->data;
        if (status < 0 && !c->closing)
                conn_close(c, true);
}

/* Graceful close: FIN after the writes, then read and discard until EOF or LINGER_MS. */
static void conn_linger(tsr_http_conn *c) {
        if (c->lingering || c->closing)
                return;
        if (c->peer_eof) {
                conn_close(c, true);
                return;
        }
        c->lingering = true;
        c->shutdown_req.data = c;
        if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, conn_shutdown_cb) < 0) {
                conn_close(c, true);
                return;
        }
        conn_arm_timer(c, LINGER_MS, conn_timer_cb);
        conn_update_reading(c);
}

/* Every queued write has completed (write_cb context, never inside a handler call). */
static void conn_after_writes(tsr_http_conn *c) {
        if (c->draining) {   /* set only when no handler owns the request */
                conn_linger(c);
                return;
        }
        if (c->req_state != REQ_DONE)
                return;   /* e.g. the 100 Continue went out, or a stream chunk */
        if (!c->req.keep_alive) {
                conn_linger(c);
                return;
        }
        conn_finish_request(c);
}

/* ---- accepting --------------------------------------------------------------------- */

static void free_handle_cb(uv_handle_t *h) { free(h); }

static void reject_connection(uv_stream_t *listener) {
        uv_tcp_t *t = malloc(sizeof(*t));

        if (!t)
                return;   /* the connection stays in the backlog; libuv retries */
        if (uv_tcp_init(listener->loop, t) < 0) {
                free(t);
                return;
        }
        uv_accept(listener, (uv_stream_t *)t);
        uv_close((uv_handle_t *)t, free_handle_cb);
}

static void on_connection(uv_stream_t *listener, int status) {
        tsr_http_server *s = listener->data;
        tsr_http_conn *c;

        if (status < 0) {
                log_warn("http: accept failed: %s", uv_strerror(status));
                return;
        }
        if (!s || s->shutting_down || s->n_conns >= s->opts.max_connections) {
                if (s && !s->shutting_down) {
                        atomic_fetch_add_explicit(&s->counters.rejected_cap, 1, memory_order_relaxed);
                        log_debug("http: %zu connections open: new connection refused", s->n_conns);
                }
                reject_connection(listener);
                return;
        }
        c = calloc(1, sizeof(*c));
        if (!c) {
                reject_connection(listener);
                return;
        }
        c->s = s;
        tsr_buf_init(&c->pending, PENDING_CAP);
        uv_tcp_init(s->loop, &c->tcp);   /* cannot fail on Unix for AF_UNSPEC */
        uv_timer_init(s->loop, &c->timer);
        c->tcp.data = c;
        c->timer.data = c;
        c->handles_open = 2;
        c->next = s->conns;
        if (s->conns)
                s->conns->prev = c;
        s->conns = c;
        s->n_conns++;
        atomic_fetch_add_explicit(&s->counters.open, 1, memory_order_relaxed);
        llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
        c->parser.data = c;
        if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
                conn_close(c, false);
                return;
        }
        atomic_fetch_add_explicit(&s->counters.accepted, 1, memory_order_relaxed);
        uv_tcp_nodelay(&c->tcp, 1);   /* stream chunks are small and latency-bound */
        conn_arm_timer(c, s->opts.header_timeout_ms, conn_timer_cb);
        conn_update_reading(c);
}

/* ---- server ------------------------------------------------------------------------ */

static void settings_init(llhttp_settings_t *st) {
        llhttp_settings_init(st);
        st->on_message_begin = on_message_begin;
        st->on_url = on_url;
        st->on_url_complete = on_url_complete;
        st->on_header_field = on_header_field;
        st->on_header_field_complete = on_header_field_complete;
        st->on_header_value = on_header_value;
        st->on_header_value_complete = on_header_value_complete;
        st->on_headers_complete = on_headers_complete;
        st->on_body = on_body;
        st->on_message_complete = on_message_complete;
}

/* ---- one request from a buffer (tests, fuzzing) ------------------------------------ */

/* The same llhttp settings and callbacks as a live connection, on a detached tsr_http_conn
 * (no socket, no timer, no 100 Continue), so what this accepts or refuses is exactly
 * what the server would. */
tsr_status tsr_http_parse_one(const tsr_http_server_opts *o, const void *data, size_t len, tsr_http_parsed *out) {
        tsr_http_server *s;
        tsr_http_conn *c;
        llhttp_errno_t err;
        const char *pos;

        memset(out, 0, sizeof(*out));
        s = calloc(1, sizeof(*s));
        c = calloc(1, sizeof(*c));
        if (!s || !c) {
                free(s);
                free(c);
                return TSR_E_NOMEM;
        }
        if (o)
                s->opts = *o;
        else
                tsr_http_server_opts_default(&s->opts);
        settings_init(&s->settings);
        c->s = s;
        c->detached = true;
        llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
        c->parser.data = c;
        err = llhttp_execute(&c->parser, data, len);
        if ((err == HPE_PAUSED || err == HPE_PAUSED_UPGRADE) && c->req_ready) {
                if (err == HPE_PAUSED_UPGRADE)
                        c->req.keep_alive = false;   /* as conn_parse: answer, then close */
                out->status = 0;
                out->consumed = (size_t)(llhttp_get_error_pos(&c->parser) - (const char *)data);
                out->req = c->req;             /* the arena (and the body in it) moves to `out` */
                memset(&c->req, 0, sizeof(c->req));
        } else if (err == HPE_OK) {
                out->incomplete = true;        /* a valid prefix: the server would wait for more */
                out->consumed = len;
        } else {
                out->status = c->err_status ? c->err_status : 400;
                out->message = fail_message(c->err_status);
                pos = llhttp_get_error_pos(&c->parser);
                out->consumed = pos && pos >= (const char *)data ? (size_t)(pos - (const char *)data) : len;
                if (out->consumed > len)
                        out->consumed = len;
        }
        conn_request_done(c);   /* whatever is left of a partial or failed request */
        free(c);
        free(s);
        return TSR_OK;
}

void tsr_http_parsed_done(tsr_http_parsed *p) {
        if (!p)
                return;
        tsr_arena_free(&p->req.arena);
        memset(p, 0, sizeof(*p));
}

tsr_status tsr_http_server_new(uv_loop_t *loop, const tsr_http_server_opts *o, tsr_http_handler_fn fn, void *ud,
                           tsr_http_server **ret) {
        tsr_http_server *s;

        if (!loop || !fn || !ret)
                return TSR_E_INVAL;
        if (o && (!o->max_body || !o->max_header_bytes || !o->max_headers || !o->max_connections ||
                  !o->max_write_queue))
                return TSR_E_INVAL;
        s = calloc(1, sizeof(*s));
        if (!s)
                return TSR_E_NOMEM;
        s->loop = loop;
        if (o)
                s->opts = *o;
        else
                tsr_http_server_opts_default(&s->opts);
        s->fn = fn;
        s->ud = ud;
        s->port = -1;
        settings_init(&s->settings);
        *ret = s;
        return TSR_OK;
}

static void listener_close_cb(uv_handle_t *h) {
        tsr_http_server *s = h->data;   /* NULL when the server was freed first */

        free(h);
        if (s) {
                s->listener = NULL;
                server_check_done(s);
        }
}

/* Resolve `host` into `ss`: numeric forms first, then a (blocking, startup-time) lookup. */
static tsr_status resolve_host(uv_loop_t *loop, const char *host, int port, struct sockaddr_storage *ss) {
        struct addrinfo hints = {0};
        uv_getaddrinfo_t gai;
        char service[16];
        int r;

        memset(ss, 0, sizeof(*ss));
        if (!host || !*host)
                host = "0.0.0.0";
        if (uv_ip4_addr(host, port, (struct sockaddr_in *)ss) == 0)
                return TSR_OK;
        if (uv_ip6_addr(host, port, (struct sockaddr_in6 *)ss) == 0)
                return TSR_OK;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_PASSIVE;
        snprintf(service, sizeof(service), "%d", port);
        r = uv_getaddrinfo(loop, &gai, NULL, host, service, &hints);   /* NULL cb: synchronous */
        if (r < 0 || !gai.addrinfo) {
                log_debug("http: resolve %s: %s", host, uv_strerror(r));
                return TSR_E_INVAL;
        }
        memcpy(ss, gai.addrinfo->ai_addr, gai.addrinfo->ai_addrlen);
        uv_freeaddrinfo(gai.addrinfo);
        return TSR_OK;
}

tsr_status tsr_http_server_listen(tsr_http_server *s, const char *host, int port) {
        struct sockaddr_storage ss, bound;
        int r, namelen = sizeof(bound);
        tsr_status st;

        if (s->listener || s->shutting_down || port < 0 || port > 65535)
                return TSR_E_INVAL;
        st = resolve_host(s->loop, host, port, &ss);
        if (st != TSR_OK)
                return st;
        s->listener = malloc(sizeof(*s->listener));
        if (!s->listener)
                return TSR_E_NOMEM;
        /* --router-threads: several loops listen on one port and the kernel spreads
         * connections over them (SO_REUSEPORT); the socket must exist before bind. */
        r = s->opts.reuse_port ? uv_tcp_init_ex(s->loop, s->listener, ss.ss_family) : uv_tcp_init(s->loop, s->listener);
        if (r < 0) {
                free(s->listener);
                s->listener = NULL;
                return TSR_E_IO;
        }
        s->listener->data = s;
        r = 0;
        if (s->opts.reuse_port) {
                uv_os_fd_t fd;
                int one = 1;
                if (uv_fileno((uv_handle_t *)s->listener, &fd) != 0 ||
                    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0)
                        r = UV_EINVAL;
        }
        if (r == 0)
                r = uv_tcp_bind(s->listener, (const struct sockaddr *)&ss, 0);
        if (r == 0)
                r = uv_listen((uv_stream_t *)s->listener, LISTEN_BACKLOG, on_connection);
        if (r == 0)
                r = uv_tcp_getsockname(s->listener, (struct sockaddr *)&bound, &namelen);
        if (r < 0) {
                log_debug("http: listen %s:%d: %s", host ? host : "0.0.0.0", port, uv_strerror(r));
                s->listener->data = NULL;   /* the handle outlives nothing of ours */
                uv_close((uv_handle_t *)s->listener, listener_close_cb);
                s->listener = NULL;
                return TSR_E_IO;
        }
        if (bound.ss_family == AF_INET6)
                s->port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
        else
                s->port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
        return TSR_OK;
}

int tsr_http_server_port(const tsr_http_server *s) { return s->listener ? s->port : -1; }

size_t tsr_http_server_num_connections(const tsr_http_server *s) {
        return atomic_load_explicit(&((tsr_http_server *)s)->counters.open, memory_order_relaxed);
}

void tsr_http_server_get_stats(const tsr_http_server *s, tsr_http_server_stats *out) {
        /* the casts drop const: C11's atomic_load takes a non-const pointer */
        tsr_http_server *w = (tsr_http_server *)s;
        out->accepted = atomic_load_explicit(&w->counters.accepted, memory_order_relaxed);
        out->rejected_cap = atomic_load_explicit(&w->counters.rejected_cap, memory_order_relaxed);
        out->header_timeouts = atomic_load_explicit(&w->counters.header_timeouts, memory_order_relaxed);
        out->body_timeouts = atomic_load_explicit(&w->counters.body_timeouts, memory_order_relaxed);
        out->idle_timeouts = atomic_load_explicit(&w->counters.idle_timeouts, memory_order_relaxed);
}

static void grace_close_cb(uv_handle_t *h) {
        tsr_http_server *s = h->data;
        s->grace_timer_closed = true;
        server_check_done(s);
}

/* Calls `done` once the listener, the grace timer and every connection are gone.  May
 * free `s` (through `done`): callers return right after. */
static void server_check_done(tsr_http_server *s) {
        if (!s->shutting_down || s->done_called || s->n_conns > 0)
                return;
        if (!s->grace_timer_closed) {
                if (!s->grace_timer_closing) {
                        s->grace_timer_closing = true;
                        uv_close((uv_handle_t *)&s->grace_timer, grace_close_cb);
                }
                return;
        }
        if (s->listener)
                return;
        s->done_called = true;
        if (s->done)
                s->done(s->done_ud);
}

/* Close every connection (or only those with no request to finish).  An on_close
 * callback may end the ownership of another, already closed connection, which would free
 * it under the walk: frees are held back while iterating and done in a second pass.
 * Never calls `done` synchronously (the grace timer is still open). */
static void server_close_conns(tsr_http_server *s, bool only_idle) {
        tsr_http_conn *c, *next;

        s->iterating = true;
        for (c = s->conns; c; c = c->next) {
                /* Idle, mid-request (not yet handed over) or lingering: nothing to finish. */
                if (!only_idle || c->req_state == REQ_NONE || c->req_state == REQ_HEAD ||
                    c->req_state == REQ_BODY || c->lingering)
                        conn_close(c, true);
                else
                        c->req.keep_alive = false;   /* close once the response is written */
        }
        s->iterating = false;
        for (c = s->conns; c; c = next) {
                next = c->next;
                conn_maybe_free(c);
        }
}

static void grace_timer_cb(uv_timer_t *t) { server_close_conns(t->data, false); }

void tsr_http_server_shutdown(tsr_http_server *s, uint64_t grace_ms, void (*done)(void *ud), void *ud) {
        if (s->shutting_down)
                return;
        s->shutting_down = true;
        s->done = done;
        s->done_ud = ud;
        uv_timer_init(s->loop, &s->grace_timer);
        s->grace_timer.data = s;
        s->grace_timer_init = true;
        if (s->listener && !uv_is_closing((uv_handle_t *)s->listener))
                uv_close((uv_handle_t *)s->listener, listener_close_cb);
        server_close_conns(s, true);
        if (s->n_conns > 0)
                uv_timer_start(&s->grace_timer, grace_timer_cb, grace_ms, 0);
        else
                server_check_done(s);   /* closes the timer; done runs from its close_cb */
}

void tsr_http_server_free(tsr_http_server **sp) {
        tsr_http_server *s;

        if (!sp || !*sp)
                return;
        s = *sp;
        /* Programmer errors: freeing with live connections or an unclosed timer handle. */
        assert(s->n_conns == 0);
        assert(!s->grace_timer_init || s->grace_timer_closed);
        if (s->listener) {
                s->listener->data = NULL;
                if (!uv_is_closing((uv_handle_t *)s->listener))
                        uv_close((uv_handle_t *)s->listener, listener_close_cb);
        }
        free(s);
        *sp = NULL;
}

/* ---- responses ---------------------------------------------------------------------- */

/* The handler gives the request back; if the connection is already dead, free it. */
static tsr_status conn_release_closed(tsr_http_conn *c) {
        c->handler_owns = false;
        c->resp_state = RESP_DONE;
        conn_maybe_free(c);   /* may free c */
        return TSR_E_CLOSED;
}

/* The response is complete (all of it queued). */
static void conn_response_queued(tsr_http_conn *c) {
        c->handler_owns = false;
        c->resp_state = RESP_DONE;
        c->req_state = REQ_DONE;
        if (!c->req.keep_alive)
                c->draining = true;   /* discard further input; FIN after the writes */
        if (c->pending_writes == 0)
                conn_linger(c);       /* only without keep-alive: nothing left to write */
}

tsr_status tsr_http_conn_respond(tsr_http_conn *c, int status, const char *content_type, const void *body, size_t len,
                             const char *extra_headers) {
        tsr_status st;

        if (!c || !c->handler_owns || c->resp_state != RESP_NONE)
                return TSR_E_INVAL;
        if (c->closing)
                return conn_release_closed(c);
        if (!extra_ok(extra_headers)) {
                st = TSR_E_INVAL;
                goto fail;
        }
        st = conn_send(c, status, content_type, body, len, extra_headers);
        if (st != TSR_OK)
                goto fail;
        conn_response_queued(c);
        return TSR_OK;
fail:
        /* Nothing was sent: the connection cannot be answered in order any more. */
        c->handler_owns = false;
        conn_close(c, false);
        return st;
}

tsr_status tsr_http_conn_respond_error(tsr_http_conn *c, int status, const char *type, const char *message) {
        char *body;
        tsr_status st;

        if (!c || !c->handler_owns || c->resp_state != RESP_NONE)
                return TSR_E_INVAL;
        body = error_json(status, type, message);
        if (!body) {
                if (c->closing)
                        return conn_release_closed(c);
                c->handler_owns = false;
                conn_close(c, false);
                return TSR_E_NOMEM;
        }
        st = tsr_http_conn_respond(c, status, "application/json", body, strlen(body), NULL);
        free(body);
        return st;
}

tsr_status tsr_http_conn_stream_start(tsr_http_conn *c, int status, const char *content_type, const char *extra_headers) {
        tsr_buf head;
        tsr_status st;

        if (!c || !c->handler_owns || c->resp_state != RESP_NONE || !extra_ok(extra_headers))
                return TSR_E_INVAL;
        if (c->closing)
                return TSR_E_CLOSED;
        c->streaming_chunked = !(c->req.http_major == 1 && c->req.http_minor == 0);
        if (!c->streaming_chunked || strcmp(c->req.method, "HEAD") == 0)
                c->req.keep_alive = false;   /* the body ends at close */
        tsr_buf_init(&head, SIZE_MAX - 1);
        st = build_head(&head, c, status, content_type, false, 0, c->streaming_chunked, extra_headers);
        if (st == TSR_OK)
                st = conn_write2(c, head.data, head.len, NULL, 0);
        tsr_buf_done(&head);
        if (st == TSR_E_IO) {
                conn_close(c, false);
                return TSR_E_CLOSED;
        }
        if (st == TSR_OK)
                c->resp_state = RESP_STREAMING;
        return st;
}

tsr_status tsr_http_conn_stream_write(tsr_http_conn *c, const void *data, size_t len) {
        char size_line[24];
        size_t n = 0;
        tsr_status st;

        if (!c || !c->handler_owns || c->resp_state != RESP_STREAMING)
                return TSR_E_INVAL;
        if (c->closing)
                return TSR_E_CLOSED;
        if (len == 0 || strcmp(c->req.method, "HEAD") == 0)
                return TSR_OK;
        if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) + len > c->s->opts.max_write_queue)
                return TSR_E_LIMIT;
        if (c->streaming_chunked) {
                /* "<hex>\r\n" + data + "\r\n" as one write */
                struct wreq *w;
                uv_buf_t ub;
                int r;

                n = (size_t)snprintf(size_line, sizeof(size_line), "%zx\r\n", len);
                if (len > UINT_MAX - n - 2)
                        return TSR_E_LIMIT;
                w = malloc(sizeof(*w) + n + len + 2);
                if (!w)
                        return TSR_E_NOMEM;
                w->c = c;
                w->len = n + len + 2;
                memcpy(w->data, size_line, n);
                memcpy(w->data + n, data, len);
                memcpy(w->data + n + len, "\r\n", 2);
                ub = uv_buf_init(w->data, (unsigned int)w->len);
                r = uv_write(&w->req, (uv_stream_t *)&c->tcp, &ub, 1, conn_write_cb);
                if (r < 0) {
                        free(w);
                        conn_close(c, false);
                        return TSR_E_CLOSED;
                }
                c->pending_writes++;
                return TSR_OK;
        }
        st = conn_write2(c, data, len, NULL, 0);
        if (st == TSR_E_IO) {
                conn_close(c, false);
                return TSR_E_CLOSED;
        }
        return st;
}

tsr_status tsr_http_conn_stream_end(tsr_http_conn *c) {
        static const char last[] = "0\r\n\r\n";
        tsr_status st = TSR_OK;

        if (!c || !c->handler_owns)
                return TSR_E_INVAL;
        if (c->closing)
                return conn_release_closed(c);
        if (c->resp_state != RESP_STREAMING) {
                /* Never started (or a respond in between failed): nothing valid was sent. */
                c->handler_owns = false;
                conn_close(c, false);
                return TSR_E_IO;
        }
        if (c->streaming_chunked && strcmp(c->req.method, "HEAD") != 0)
                st = conn_write2(c, last, sizeof(last) - 1, NULL, 0);
        if (st != TSR_OK) {
                c->handler_owns = false;
                conn_close(c, false);
                return st == TSR_E_IO ? TSR_E_CLOSED : st;
        }
        conn_response_queued(c);
        return TSR_OK;
}

void tsr_http_conn_abort(tsr_http_conn *c) {
        if (!c || !c->handler_owns)
                return;
        c->handler_owns = false;
        c->resp_state = RESP_DONE;
        if (c->closing)
                conn_maybe_free(c);
        else
                conn_close(c, false);
}

void tsr_http_conn_on_close(tsr_http_conn *c, void (*cb)(void *ud), void *ud) {
        if (!c || !c->handler_owns)
                return;
        c->on_close = cb;
        c->on_close_ud = ud;
}
