/* router/tsr_http_server: the server runs in-process on 127.0.0.1 with an ephemeral port.
 * uv_run runs on the test's main thread (the loop thread: handler and server code, and
 * every cmocka assertion); a client thread does blocking socket I/O with a receive
 * timeout, records what it saw, and wakes the loop with uv_async_send when it is done,
 * which shuts the server down.  A guard timer force-closes everything after
 * GUARD_MS so that a bug fails the test instead of hanging it, and alarm() is the last
 * resort. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "router/http_server.h"

#define GUARD_MS     10000
#define RECV_TIMEOUT 4      /* seconds: a client never blocks longer than this */
#define MAX_GOT      8
#define RD_CAP       (1u << 20)

struct fx {
        uv_loop_t loop;
        tsr_http_server *srv;
        tsr_http_server_stats stats;      /* the server's totals, read just before it is freed */
        tsr_http_server_opts opts;
        uint64_t grace_ms;
        uv_async_t async;
        uv_timer_t guard;
        pthread_t th;
        int port;
        void (*client)(struct fx *f);
        bool client_signals;

        /* loop thread */
        bool done_called;
        bool timed_out;
        bool shut;
        int n_requests;
        char last_method[16], last_path[64], last_query[64], last_ctype[64];
        size_t last_n_headers;
        tsr_status flood_status;

        /* written by one thread, polled by the other */
        atomic_int n_dispatched;
        atomic_int hang_closed;
        atomic_int flood_done;

        /* client results, checked on the main thread after the run */
        char *got[MAX_GOT];
        int ints[MAX_GOT];
};

/* ---- the test handler (loop thread) ----------------------------------------------- */

struct slow {
        uv_timer_t t;
        tsr_http_conn *c;   /* NULL once the connection died */
};

static void slow_closed(void *ud) { ((struct slow *)ud)->c = NULL; }

static void free_handle(uv_handle_t *h) { free(h); }

static void slow_fire(uv_timer_t *t) {
        struct slow *sl = (struct slow *)t;
        if (sl->c)
                tsr_http_conn_respond(sl->c, 200, "text/plain", "slow", 4, NULL);
        uv_close((uv_handle_t *)&sl->t, free_handle);
}

static void hang_closed_cb(void *ud) {
        struct fx *f = ud;
        atomic_store(&f->hang_closed, 1);
}

static void copy_str(char *dst, size_t cap, const char *src) { snprintf(dst, cap, "%s", src ? src : "(null)"); }

static void handler(void *ud, tsr_http_conn *c, tsr_http_request *req) {
        struct fx *f = ud;
        bool get = strcmp(req->method, "GET") == 0;

        f->n_requests++;
        copy_str(f->last_method, sizeof(f->last_method), req->method);
        copy_str(f->last_path, sizeof(f->last_path), req->path);
        copy_str(f->last_query, sizeof(f->last_query), req->query);
        copy_str(f->last_ctype, sizeof(f->last_ctype), tsr_http_request_header(req, "content-type"));
        f->last_n_headers = req->n_headers;
        assert_non_null(req->arena);
        assert_non_null(req->body);
        assert_int_equal(req->body[req->body_len], 0);
        atomic_fetch_add(&f->n_dispatched, 1);

        if (get && strcmp(req->path, "/hello") == 0) {
                assert_int_equal(tsr_http_conn_respond(c, 200, "text/plain", "hi", 2, NULL), TSR_OK);
        } else if (strcmp(req->method, "POST") == 0 && strcmp(req->path, "/echo") == 0) {
                assert_int_equal(tsr_http_conn_respond(c, 200, "application/octet-stream", req->body, req->body_len,
                                                   "x-echo: 1\r\n"),
                                 TSR_OK);
        } else if (get && strcmp(req->path, "/slow") == 0) {
                struct slow *sl = calloc(1, sizeof(*sl));
                assert_non_null(sl);
                sl->c = c;
                tsr_http_conn_on_close(c, slow_closed, sl);
                uv_timer_init(&f->loop, &sl->t);
                uv_timer_start(&sl->t, slow_fire, 50, 0);
        } else if (get && strcmp(req->path, "/stream") == 0) {
                assert_int_equal(tsr_http_conn_stream_start(c, 200, "text/plain", NULL), TSR_OK);
                assert_int_equal(tsr_http_conn_stream_write(c, "a", 1), TSR_OK);
                assert_int_equal(tsr_http_conn_stream_write(c, "bb", 2), TSR_OK);
                assert_int_equal(tsr_http_conn_stream_write(c, "", 0), TSR_OK);   /* no empty chunk on the wire */
                assert_int_equal(tsr_http_conn_stream_write(c, "ccc", 3), TSR_OK);
                assert_int_equal(tsr_http_conn_stream_end(c), TSR_OK);
        } else if (get && strcmp(req->path, "/hang") == 0) {
                tsr_http_conn_on_close(c, hang_closed_cb, f);
        } else if (get && strcmp(req->path, "/flood") == 0) {
                static char chunk[4096];
                tsr_status st = TSR_OK;
                memset(chunk, 'x', sizeof(chunk));
                assert_int_equal(tsr_http_conn_stream_start(c, 200, "text/plain", NULL), TSR_OK);
                for (int i = 0; i < 65536 && st == TSR_OK; i++)
                        st = tsr_http_conn_stream_write(c, chunk, sizeof(chunk));
                f->flood_status = st;
                tsr_http_conn_abort(c);
                atomic_store(&f->flood_done, 1);
        } else {
                assert_int_equal(tsr_http_conn_respond_error(c, 404, "NotFoundError", "no such route"), TSR_OK);
        }
}

/* ---- loop plumbing ------------------------------------------------------------------ */

static void on_done(void *ud) { ((struct fx *)ud)->done_called = true; }

static void shut(struct fx *f, uint64_t grace_ms) {
        if (f->shut)
                return;
        f->shut = true;
        tsr_http_server_shutdown(f->srv, grace_ms, on_done, f);
}

static void async_cb(uv_async_t *a) {
        struct fx *f = a->data;
        shut(f, f->grace_ms);
        uv_close((uv_handle_t *)&f->async, NULL);
        uv_close((uv_handle_t *)&f->guard, NULL);
}

static void guard_cb(uv_timer_t *t) {
        struct fx *f = t->data;
        f->timed_out = true;
        shut(f, 0);   /* force-close: blocked clients see EOF and finish */
}

static void *client_main(void *arg) {
        struct fx *f = arg;
        f->client(f);
        if (!f->client_signals)
                uv_async_send(&f->async);   /* exactly once, last thing */
        return NULL;
}

/* Serve until the client thread signals, then shut down and check that everything was
 * released.  `client_signals`: the client calls uv_async_send itself (to shut the server
 * down while it still holds a connection). */
static void run_ex(struct fx *f, void (*client)(struct fx *f), bool client_signals) {
        f->client = client;
        f->client_signals = client_signals;
        assert_int_equal(uv_loop_init(&f->loop), 0);
        assert_int_equal(tsr_http_server_new(&f->loop, &f->opts, handler, f, &f->srv), TSR_OK);
        assert_int_equal(tsr_http_server_port(f->srv), -1);
        assert_int_equal(tsr_http_server_listen(f->srv, "127.0.0.1", 0), TSR_OK);
        f->port = tsr_http_server_port(f->srv);
        assert_true(f->port > 0);
        f->async.data = f;
        f->guard.data = f;
        assert_int_equal(uv_async_init(&f->loop, &f->async, async_cb), 0);
        uv_timer_init(&f->loop, &f->guard);
        uv_timer_start(&f->guard, guard_cb, GUARD_MS, 0);
        assert_int_equal(pthread_create(&f->th, NULL, client_main, f), 0);
        uv_run(&f->loop, UV_RUN_DEFAULT);
        pthread_join(f->th, NULL);
        assert_false(f->timed_out);
        assert_true(f->done_called);
        assert_int_equal(tsr_http_server_num_connections(f->srv), 0);
        tsr_http_server_get_stats(f->srv, &f->stats);
        tsr_http_server_free(&f->srv);
        assert_null(f->srv);
        assert_int_equal(uv_loop_close(&f->loop), 0);   /* no handle left behind */
}

static void run(struct fx *f, void (*client)(struct fx *f)) { run_ex(f, client, false); }

static int setup(void **state) {
        struct fx *f = calloc(1, sizeof(*f));
        if (!f)
                return -1;
        tsr_http_server_opts_default(&f->opts);
        f->grace_ms = 2000;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        struct fx *f = *state;
        for (int i = 0; i < MAX_GOT; i++)
                free(f->got[i]);
        free(f);
        return 0;
}

/* ---- blocking client helpers (client thread) ---------------------------------------- */

static int cli_connect(struct fx *f) {
        struct sockaddr_in sa = {0};
        struct timeval tv = {.tv_sec = RECV_TIMEOUT};
        int fd = socket(AF_INET, SOCK_STREAM, 0);

        if (fd < 0)
                return -1;
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        sa.sin_family = AF_INET;
        sa.sin_port = htons((uint16_t)f->port);
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                return -1;
        }
        return fd;
}

static void cli_sendn(int fd, const void *p, size_t n) {
        const char *s = p;
        while (n) {
                ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
                if (k <= 0)
                        return;
                s += k;
                n -= (size_t)k;
        }
}

static void cli_send(int fd, const char *s) { cli_sendn(fd, s, strlen(s)); }

static void sleep_ms(int ms) {
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
}

/* Poll an atomic flag for up to `ms`; true once it is at least `want`. */
static bool wait_for(atomic_int *v, int want, int ms) {
        for (int i = 0; i < ms; i++) {
                if (atomic_load(v) >= want)
                        return true;
                sleep_ms(1);
        }
        return atomic_load(v) >= want;
}

/* Everything until EOF (or error/timeout).  *how: 0 EOF, -1 error or timeout. */
static char *cli_read_all(int fd, int *how) {
        size_t cap = 1 << 16, len = 0;
        char *buf = malloc(cap + 1);

        *how = -1;
        for (;;) {
                ssize_t n;
                if (len == cap) {
                        cap *= 2;
                        buf = realloc(buf, cap + 1);
                }
                n = recv(fd, buf + len, cap - len, 0);
                if (n == 0) {
                        *how = 0;
                        break;
                }
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        break;
                }
                len += (size_t)n;
        }
        buf[len] = '\0';
        return buf;
}

/* One HTTP response at a time from a socket, for keep-alive and pipelining. */
struct rd {
        int fd;
        char *buf;
        size_t len;
};

static bool rd_fill(struct rd *r) {
        ssize_t n;
        if (r->len >= RD_CAP)
                return false;
        n = recv(r->fd, r->buf + r->len, RD_CAP - r->len, 0);
        if (n <= 0)
                return false;
        r->len += (size_t)n;
        r->buf[r->len] = '\0';
        return true;
}

static bool rd_need(struct rd *r, size_t n) {
        while (r->len < n)
                if (!rd_fill(r))
                        return false;
        return true;
}

/* The next complete response as on the wire (malloc'd), or NULL; `body` (optional) gets
 * the de-chunked body. */
static char *rd_response(struct rd *r, char **body) {
        char *end, *raw, *cl;
        size_t head_len, total;
        char *dec = NULL;
        size_t dec_len = 0;

        while (!(end = strstr(r->buf, "\r\n\r\n")))
                if (!rd_fill(r))
                        return NULL;
        head_len = (size_t)(end - r->buf) + 4;
        cl = strstr(r->buf, "\r\ncontent-length: ");
        if (cl && cl > end)
                cl = NULL;
        if (strncmp(r->buf, "HTTP/1.1 1", 10) == 0) {
                total = head_len;
        } else if (strstr(r->buf, "\r\ntransfer-encoding: chunked\r\n") &&
                   strstr(r->buf, "\r\ntransfer-encoding: chunked\r\n") < end) {
                size_t p = head_len;
                dec = malloc(RD_CAP);
                for (;;) {
                        char *eol;
                        size_t sz;
                        while (!(eol = strstr(r->buf + p, "\r\n")))
                                if (!rd_fill(r))
                                        goto fail;
                        sz = strtoul(r->buf + p, NULL, 16);
                        p = (size_t)(eol - r->buf) + 2;
                        if (!rd_need(r, p + sz + 2))
                                goto fail;
                        if (strncmp(r->buf + p + sz, "\r\n", 2) != 0)
                                goto fail;
                        memcpy(dec + dec_len, r->buf + p, sz);
                        dec_len += sz;
                        p += sz + 2;
                        if (sz == 0)
                                break;
                }
                total = p;
        } else if (cl) {
                total = head_len + strtoul(cl + 18, NULL, 10);
                if (!rd_need(r, total))
                        return NULL;
        } else {
                while (rd_fill(r))
                        ;
                total = r->len;
        }
        raw = strndup(r->buf, total);
        if (body) {
                if (dec) {
                        dec[dec_len] = '\0';
                        *body = dec;
                        dec = NULL;
                } else {
                        *body = strdup(raw + head_len);
                }
        }
        free(dec);
        memmove(r->buf, r->buf + total, r->len - total);
        r->len -= total;
        r->buf[r->len] = '\0';
        return raw;
fail:
        free(dec);
        return NULL;
}

static void rd_init(struct rd *r, int fd) {
        r->fd = fd;
        r->buf = malloc(RD_CAP + 1);
        r->buf[0] = '\0';
        r->len = 0;
}

static void rd_done(struct rd *r) {
        free(r->buf);
        if (r->fd >= 0)
                close(r->fd);
}

/* Send `req` on a fresh connection and keep everything until EOF in got[slot]; ints[slot]
 * is 0 when the server closed the connection cleanly. */
static void exchange_close(struct fx *f, int slot, const char *req, size_t len) {
        int fd = cli_connect(f);
        if (fd < 0)
                return;
        cli_sendn(fd, req, len);
        f->got[slot] = cli_read_all(fd, &f->ints[slot]);
        close(fd);
}

/* ---- expected texts ------------------------------------------------------------------ */

#define HI_KEEP "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nhi"
#define HI_CLOSE                                                                                           \
        "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n"          \
        "connection: close\r\n\r\nhi"

static char *expected_error(int status, const char *reason, const char *message) {
        char body[512], *out;
        int n = snprintf(body, sizeof(body), "{\"error\":{\"message\":\"%s\",\"type\":\"%s\",\"param\":null,\"code\":%d}}",
                         message, reason, status);
        if (asprintf(&out,
                     "HTTP/1.1 %d %s\r\nserver: tessera\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     "connection: close\r\n\r\n%s",
                     status, reason, n, body) < 0)
                return NULL;
        return out;
}

static void assert_error_response(const char *got, int status, const char *reason, const char *message) {
        char *want = expected_error(status, reason, message);
        assert_non_null(got);
        assert_string_equal(got, want);
        free(want);
}

/* ---- cases ---------------------------------------------------------------------------- */

static void cl_simple_get(struct fx *f) {
        static const char req[] = "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        exchange_close(f, 0, req, sizeof(req) - 1);
}

static void test_simple_get(void **state) {
        struct fx *f = *state;
        run(f, cl_simple_get);
        assert_string_equal(f->got[0], HI_CLOSE);
        assert_int_equal(f->ints[0], 0);
        assert_int_equal(f->n_requests, 1);
        assert_string_equal(f->last_method, "GET");
        assert_string_equal(f->last_path, "/hello");
        assert_string_equal(f->last_query, "");
        assert_int_equal(f->last_n_headers, 2);
}

static void cl_keep_alive(struct fx *f) {
        struct rd r;
        char *body = NULL;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[0] = rd_response(&r, NULL);
        cli_send(r.fd, "POST /echo?x=1&y=2 HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                       "Content-Length: 11\r\n\r\nhello world");
        f->got[1] = rd_response(&r, &body);
        f->got[2] = body;
        rd_done(&r);
}

static void test_keep_alive(void **state) {
        struct fx *f = *state;
        run(f, cl_keep_alive);
        assert_string_equal(f->got[0], HI_KEEP);
        assert_string_equal(f->got[1], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                       "content-length: 11\r\nx-echo: 1\r\n\r\nhello world");
        assert_string_equal(f->got[2], "hello world");
        assert_int_equal(f->n_requests, 2);
        assert_string_equal(f->last_path, "/echo");
        assert_string_equal(f->last_query, "x=1&y=2");
        assert_string_equal(f->last_ctype, "text/plain");
}

static void cl_pipelined(struct fx *f) {
        struct rd r;

        rd_init(&r, cli_connect(f));
        /* One send: the first is answered asynchronously, the others must wait for it. */
        cli_send(r.fd, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                       "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
                       "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc");
        f->got[0] = rd_response(&r, NULL);
        f->got[1] = rd_response(&r, NULL);
        f->got[2] = rd_response(&r, NULL);
        rd_done(&r);
}

static void test_pipelined(void **state) {
        struct fx *f = *state;
        run(f, cl_pipelined);
        assert_string_equal(f->got[0],
                            "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\ncontent-length: 4\r\n\r\nslow");
        assert_string_equal(f->got[1], HI_KEEP);
        assert_string_equal(f->got[2], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                       "content-length: 3\r\nx-echo: 1\r\n\r\nabc");
        assert_int_equal(f->n_requests, 3);
}

#define BIG_BODY 200000

static void cl_post_content_length(struct fx *f) {
        struct rd r;
        char head[128], *body = NULL, *big = malloc(BIG_BODY);

        for (int i = 0; i < BIG_BODY; i++)
                big[i] = (char)('a' + i % 26);
        rd_init(&r, cli_connect(f));
        snprintf(head, sizeof(head), "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", BIG_BODY);
        cli_send(r.fd, head);
        cli_sendn(r.fd, big, BIG_BODY);
        f->got[0] = rd_response(&r, &body);
        f->got[1] = body;
        f->ints[0] = body && strlen(body) == BIG_BODY && memcmp(body, big, BIG_BODY) == 0;
        rd_done(&r);
        free(big);
}

static void test_post_content_length(void **state) {
        struct fx *f = *state;
        run(f, cl_post_content_length);
        assert_non_null(f->got[0]);
        assert_int_equal(strlen(f->got[0]), 111 + BIG_BODY);
        static const char want[] = "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                   "content-length: 200000\r\nx-echo: 1\r\n\r\nabcdef";
        assert_true(strncmp(f->got[0], want, sizeof(want) - 1) == 0);
        assert_int_equal(f->ints[0], 1);
}

static void cl_post_chunked(struct fx *f) {
        struct rd r;
        char *body = NULL;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel");
        sleep_ms(20);   /* the body arrives in two reads */
        cli_send(r.fd, "lo\r\n6\r\n world\r\n0\r\n\r\n");
        f->got[0] = rd_response(&r, &body);
        f->got[1] = body;
        rd_done(&r);
}

static void test_post_chunked(void **state) {
        struct fx *f = *state;
        run(f, cl_post_chunked);
        assert_string_equal(f->got[0], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                       "content-length: 11\r\nx-echo: 1\r\n\r\nhello world");
        assert_string_equal(f->got[1], "hello world");
}

static void cl_expect_continue(struct fx *f) {
        struct rd r;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
        f->got[0] = rd_response(&r, NULL);   /* the 100, before any body byte was sent */
        cli_send(r.fd, "ping");
        f->got[1] = rd_response(&r, NULL);
        rd_done(&r);
}

static void test_expect_continue(void **state) {
        struct fx *f = *state;
        run(f, cl_expect_continue);
        assert_string_equal(f->got[0], "HTTP/1.1 100 Continue\r\n\r\n");
        assert_string_equal(f->got[1], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                       "content-length: 4\r\nx-echo: 1\r\n\r\nping");
}

static void cl_body_too_large(struct fx *f) {
        static const char by_length[] = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n0123456789abcdefg";
        static const char expect[] = "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 17\r\n\r\n";
        static const char chunked[] = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      "a\r\n0123456789\r\na\r\n0123456789\r\n0\r\n\r\n";
        static const char exact[] = "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 16\r\n\r\n"
                                    "0123456789abcdef";
        exchange_close(f, 0, by_length, sizeof(by_length) - 1);
        exchange_close(f, 1, expect, sizeof(expect) - 1);
        exchange_close(f, 2, chunked, sizeof(chunked) - 1);
        exchange_close(f, 3, exact, sizeof(exact) - 1);
}

static void test_body_too_large(void **state) {
        struct fx *f = *state;
        f->opts.max_body = 16;
        run(f, cl_body_too_large);
        for (int i = 0; i < 3; i++) {
                assert_error_response(f->got[i], 413, "Request Entity Too Large", "Request body too large");
                assert_int_equal(f->ints[i], 0);
        }
        assert_string_equal(f->got[3], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: application/octet-stream\r\n"
                                       "content-length: 16\r\nconnection: close\r\nx-echo: 1\r\n\r\n0123456789abcdef");
        assert_int_equal(f->n_requests, 1);
}

static void cl_too_many_headers(struct fx *f) {
        char req[8192];
        size_t n = (size_t)snprintf(req, sizeof(req), "GET /hello HTTP/1.1\r\n");
        char *big;

        for (int i = 0; i < 101; i++)
                n += (size_t)snprintf(req + n, sizeof(req) - n, "X-H%d: v\r\n", i);
        n += (size_t)snprintf(req + n, sizeof(req) - n, "\r\n");
        exchange_close(f, 0, req, n);

        /* exactly 100 headers is fine */
        n = (size_t)snprintf(req, sizeof(req), "GET /hello HTTP/1.1\r\nConnection: close\r\n");
        for (int i = 0; i < 99; i++)
                n += (size_t)snprintf(req + n, sizeof(req) - n, "X-H%d: v\r\n", i);
        n += (size_t)snprintf(req + n, sizeof(req) - n, "\r\n");
        exchange_close(f, 1, req, n);

        /* one header larger than max_header_bytes, sent in one go */
        big = malloc(80000);
        n = (size_t)snprintf(big, 80000, "GET /hello HTTP/1.1\r\nX-Big: ");
        memset(big + n, 'a', 70000);
        n += 70000;
        memcpy(big + n, "\r\n\r\n", 4);
        n += 4;
        exchange_close(f, 2, big, n);
        free(big);
}

static void test_too_many_headers(void **state) {
        struct fx *f = *state;
        run(f, cl_too_many_headers);
        assert_error_response(f->got[0], 431, "Request Header Fields Too Large", "Request header fields too large");
        assert_string_equal(f->got[1], HI_CLOSE);
        assert_error_response(f->got[2], 431, "Request Header Fields Too Large", "Request header fields too large");
        assert_int_equal(f->ints[2], 0);
        assert_int_equal(f->n_requests, 1);
        assert_int_equal(f->last_n_headers, 100);
}

static void cl_garbage(struct fx *f) {
        static const char junk[] = "\x01\x02\xff garbage\r\n\r\n";
        static const char smuggle[] = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                      "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        static const char after_ok[] = "GET /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /x HTTP/9\r\n\r\n";
        exchange_close(f, 0, junk, sizeof(junk) - 1);
        exchange_close(f, 1, smuggle, sizeof(smuggle) - 1);
        exchange_close(f, 2, after_ok, sizeof(after_ok) - 1);
}

static void test_garbage(void **state) {
        struct fx *f = *state;
        char *want;
        run(f, cl_garbage);
        assert_error_response(f->got[0], 400, "Bad Request", "Invalid HTTP request received.");
        assert_int_equal(f->ints[0], 0);
        assert_error_response(f->got[1], 400, "Bad Request", "Invalid HTTP request received.");
        /* the good request is answered, then the bad one gets its 400 */
        want = expected_error(400, "Bad Request", "Invalid HTTP request received.");
        assert_non_null(f->got[2]);
        assert_true(strncmp(f->got[2], HI_KEEP, strlen(HI_KEEP)) == 0);
        assert_string_equal(f->got[2] + strlen(HI_KEEP), want);
        free(want);
        assert_int_equal(f->n_requests, 1);
}

static void cl_header_timeout(struct fx *f) {
        static const char partial[] = "GET /hello HTTP/1.1\r\nHost: x\r\n";
        int fd;

        exchange_close(f, 0, partial, sizeof(partial) - 1);
        /* a connection that never sends anything is closed silently */
        fd = cli_connect(f);
        if (fd >= 0) {
                f->got[1] = cli_read_all(fd, &f->ints[1]);
                close(fd);
        }
}

static void test_header_timeout(void **state) {
        struct fx *f = *state;
        f->opts.header_timeout_ms = 100;
        run(f, cl_header_timeout);
        assert_error_response(f->got[0], 408, "Request Timeout", "Request headers not received within 100 ms");
        assert_int_equal(f->ints[0], 0);
        assert_string_equal(f->got[1], "");
        assert_int_equal(f->ints[1], 0);
        assert_int_equal(f->n_requests, 0);
        assert_int_equal(f->stats.accepted, 2);
        assert_int_equal(f->stats.header_timeouts, 1);   /* the partial head: 408 */
        assert_int_equal(f->stats.idle_timeouts, 1);     /* the silent connection */
        assert_int_equal(f->stats.rejected_cap, 0);
}

static void cl_idle_timeout(struct fx *f) {
        struct rd r;
        struct timespec t0, t1;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[0] = rd_response(&r, NULL);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        f->got[1] = cli_read_all(r.fd, &f->ints[1]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        f->ints[2] = (int)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        rd_done(&r);
}

static void test_idle_timeout(void **state) {
        struct fx *f = *state;
        f->opts.idle_timeout_ms = 100;
        run(f, cl_idle_timeout);
        assert_string_equal(f->got[0], HI_KEEP);
        assert_string_equal(f->got[1], "");
        assert_int_equal(f->ints[1], 0);     /* EOF, not our receive timeout */
        assert_in_range(f->ints[2], 50, 3000);
}

static void cl_stream(struct fx *f) {
        struct rd r;
        char *body = NULL;
        static const char req10[] = "GET /stream HTTP/1.0\r\n\r\n";

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[0] = rd_response(&r, &body);
        f->got[1] = body;
        /* still usable afterwards */
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[2] = rd_response(&r, NULL);
        rd_done(&r);
        exchange_close(f, 3, req10, sizeof(req10) - 1);
}

static void test_stream(void **state) {
        struct fx *f = *state;
        run(f, cl_stream);
        assert_string_equal(f->got[0], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\n"
                                       "transfer-encoding: chunked\r\n\r\n1\r\na\r\n2\r\nbb\r\n3\r\nccc\r\n0\r\n\r\n");
        assert_string_equal(f->got[1], "abbccc");
        assert_string_equal(f->got[2], HI_KEEP);
        /* HTTP/1.0 has no chunked encoding: the body ends at close */
        assert_string_equal(f->got[3], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\n"
                                       "connection: close\r\n\r\nabbccc");
        assert_int_equal(f->ints[3], 0);
}

static void cl_hang_disconnect(struct fx *f) {
        int fd = cli_connect(f);
        if (fd < 0)
                return;
        cli_send(fd, "GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
        f->ints[0] = wait_for(&f->n_dispatched, 1, 3000);
        close(fd);
        f->ints[1] = wait_for(&f->hang_closed, 1, 3000);   /* before the shutdown below */
}

static void test_hang_disconnect(void **state) {
        struct fx *f = *state;
        run(f, cl_hang_disconnect);
        assert_int_equal(f->ints[0], 1);
        assert_int_equal(f->ints[1], 1);
        assert_int_equal(atomic_load(&f->hang_closed), 1);
}

static void cl_http10(struct fx *f) {
        static const char req[] = "GET /hello HTTP/1.0\r\n\r\n";
        struct rd r;

        exchange_close(f, 0, req, sizeof(req) - 1);
        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
        f->got[1] = rd_response(&r, NULL);
        cli_send(r.fd, "GET /hello HTTP/1.0\r\n\r\n");
        f->got[2] = cli_read_all(r.fd, &f->ints[2]);
        rd_done(&r);
}

static void test_http10(void **state) {
        struct fx *f = *state;
        run(f, cl_http10);
        assert_string_equal(f->got[0], HI_CLOSE);
        assert_int_equal(f->ints[0], 0);
        assert_string_equal(f->got[1], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\n"
                                       "content-length: 2\r\nconnection: keep-alive\r\n\r\nhi");
        assert_string_equal(f->got[2], HI_CLOSE);
        assert_int_equal(f->ints[2], 0);
        assert_int_equal(f->n_requests, 3);
}

static void cl_shutdown_idle(struct fx *f) {
        struct rd r;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[0] = rd_response(&r, NULL);
        uv_async_send(&f->async);   /* shut down while this connection sits idle */
        f->got[1] = cli_read_all(r.fd, &f->ints[1]);
        rd_done(&r);
}

static void test_shutdown_idle(void **state) {
        struct fx *f = *state;
        run_ex(f, cl_shutdown_idle, true);
        assert_string_equal(f->got[0], HI_KEEP);
        assert_string_equal(f->got[1], "");
        assert_int_equal(f->ints[1], 0);
}

static void cl_shutdown_inflight(struct fx *f) {
        struct rd r;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n");
        f->ints[0] = wait_for(&f->n_dispatched, 1, 3000);
        uv_async_send(&f->async);   /* shut down while /slow is being answered */
        f->got[0] = rd_response(&r, NULL);
        f->got[1] = cli_read_all(r.fd, &f->ints[1]);
        rd_done(&r);
}

static void test_shutdown_inflight(void **state) {
        struct fx *f = *state;
        run_ex(f, cl_shutdown_inflight, true);
        assert_int_equal(f->ints[0], 1);
        assert_string_equal(f->got[0], "HTTP/1.1 200 OK\r\nserver: tessera\r\ncontent-type: text/plain\r\n"
                                       "content-length: 4\r\nconnection: close\r\n\r\nslow");
        assert_string_equal(f->got[1], "");
        assert_int_equal(f->ints[1], 0);
}

static void cl_shutdown_force(struct fx *f) {
        int fd = cli_connect(f);
        if (fd < 0)
                return;
        cli_send(fd, "GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
        f->ints[0] = wait_for(&f->n_dispatched, 1, 3000);
        uv_async_send(&f->async);
        f->got[0] = cli_read_all(fd, &f->ints[1]);   /* force-closed after the grace period */
        close(fd);
}

static void test_shutdown_force(void **state) {
        struct fx *f = *state;
        f->grace_ms = 50;
        run_ex(f, cl_shutdown_force, true);
        assert_int_equal(f->ints[0], 1);
        assert_string_equal(f->got[0], "");
        assert_int_equal(atomic_load(&f->hang_closed), 1);
}

static void cl_max_connections(struct fx *f) {
        struct rd r;
        int fd2;

        rd_init(&r, cli_connect(f));
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[0] = rd_response(&r, NULL);
        fd2 = cli_connect(f);   /* the kernel accepts it; the server closes it at once */
        if (fd2 >= 0) {
                cli_send(fd2, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
                f->got[1] = cli_read_all(fd2, &f->ints[1]);
                f->ints[1] = 0;   /* EOF or reset: either way nothing was answered */
                close(fd2);
        }
        cli_send(r.fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
        f->got[2] = rd_response(&r, NULL);
        rd_done(&r);
}

static void test_max_connections(void **state) {
        struct fx *f = *state;
        f->opts.max_connections = 1;
        run(f, cl_max_connections);
        assert_string_equal(f->got[0], HI_KEEP);
        assert_string_equal(f->got[1], "");
        assert_string_equal(f->got[2], HI_KEEP);
        assert_int_equal(f->n_requests, 2);
        assert_int_equal(f->stats.rejected_cap, 1);   /* tessera:router_connections_dropped{reason="cap"} */
        assert_int_equal(f->stats.accepted, 1);       /* both requests on the first connection */
}

static void cl_flood(struct fx *f) {
        int small = 4096, fd;
        struct sockaddr_in sa = {0};
        struct timeval tv = {.tv_sec = RECV_TIMEOUT};

        fd = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        sa.sin_family = AF_INET;
        sa.sin_port = htons((uint16_t)f->port);
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                return;
        }
        cli_send(fd, "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n");
        f->ints[0] = wait_for(&f->flood_done, 1, 5000);   /* not reading meanwhile */
        free(cli_read_all(fd, &f->ints[1]));
        close(fd);
}

static void test_write_queue_limit(void **state) {
        struct fx *f = *state;
        f->opts.max_write_queue = 64 * 1024;
        run(f, cl_flood);
        assert_int_equal(f->ints[0], 1);
        assert_int_equal(f->flood_status, TSR_E_LIMIT);
}

static void cl_not_found(struct fx *f) {
        static const char req[] = "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        exchange_close(f, 0, req, sizeof(req) - 1);
}

static void test_respond_error(void **state) {
        struct fx *f = *state;
        static const char body[] = "{\"error\":{\"message\":\"no such route\",\"type\":\"NotFoundError\",\"param\":null,\"code\":404}}";
        char want[512];
        run(f, cl_not_found);
        snprintf(want, sizeof(want),
                 "HTTP/1.1 404 Not Found\r\nserver: tessera\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n"
                 "connection: close\r\n\r\n%s",
                 strlen(body), body);
        assert_string_equal(f->got[0], want);
}

static void on_done_flag(void *ud) { *(bool *)ud = true; }

static void test_api_misuse(void **state) {
        uv_loop_t loop;
        tsr_http_server *s = NULL, *s2 = NULL;
        tsr_http_server_opts o;
        bool done = false;
        tsr_http_request req = {0};
        tsr_http_header hs[2] = {{"content-type", "a/b"}, {"x-y", ""}};

        (void)state;
        tsr_http_server_opts_default(&o);
        assert_int_equal(o.max_body, 32u << 20);
        assert_int_equal(o.max_headers, 100);
        assert_int_equal(o.idle_timeout_ms, 5000);
        o.max_body = 0;
        assert_int_equal(uv_loop_init(&loop), 0);
        assert_int_equal(tsr_http_server_new(&loop, &o, handler, NULL, &s), TSR_E_INVAL);
        assert_null(s);
        assert_int_equal(tsr_http_server_new(&loop, NULL, handler, NULL, &s), TSR_OK);
        assert_int_equal(tsr_http_server_listen(s, "127.0.0.1", 70000), TSR_E_INVAL);
        assert_int_equal(tsr_http_server_listen(s, "127.0.0.1", 0), TSR_OK);
        assert_int_equal(tsr_http_server_listen(s, "127.0.0.1", 0), TSR_E_INVAL);   /* already listening */
        /* a second server on the same port fails cleanly and can be freed at once */
        assert_int_equal(tsr_http_server_new(&loop, NULL, handler, NULL, &s2), TSR_OK);
        assert_int_equal(tsr_http_server_listen(s2, "127.0.0.1", tsr_http_server_port(s)), TSR_E_IO);
        assert_int_equal(tsr_http_server_port(s2), -1);
        tsr_http_server_free(&s2);
        assert_null(s2);
        tsr_http_server_free(&s2);   /* NULL is fine */
        tsr_http_server_shutdown(s, 1000, on_done_flag, &done);
        assert_false(done);      /* never from inside tsr_http_server_shutdown */
        uv_run(&loop, UV_RUN_DEFAULT);
        assert_true(done);
        tsr_http_server_free(&s);
        assert_int_equal(uv_loop_close(&loop), 0);

        req.headers = hs;
        req.n_headers = 2;
        assert_string_equal(tsr_http_request_header(&req, "content-type"), "a/b");
        assert_string_equal(tsr_http_request_header(&req, "X-Y"), "");
        assert_null(tsr_http_request_header(&req, "host"));
        assert_string_equal(tsr_http_reason_phrase(431), "Request Header Fields Too Large");
        assert_string_equal(tsr_http_reason_phrase(999), "Unknown");
}

/* tsr_http_parse_one: the server's parser on a buffer, no socket (the fuzz target's entry). */
static void test_parse_one(void **state) {
        static const char two[] = "POST /v1/completions?a=b HTTP/1.1\r\nHost: h\r\nX-Up: V\r\n"
                                  "Content-Length: 4\r\n\r\nbodyGET /health HTTP/1.1\r\n\r\n";
        tsr_http_server_opts o;
        tsr_http_parsed p;

        (void)state;
        assert_int_equal(tsr_http_parse_one(NULL, two, sizeof(two) - 1, &p), TSR_OK);
        assert_int_equal(p.status, 0);
        assert_false(p.incomplete);
        assert_string_equal(p.req.method, "POST");
        assert_string_equal(p.req.path, "/v1/completions");
        assert_string_equal(p.req.query, "a=b");
        assert_string_equal(tsr_http_request_header(&p.req, "x-up"), "V");
        assert_int_equal(p.req.body_len, 4);
        assert_memory_equal(p.req.body, "body", 5);
        assert_true(p.req.keep_alive);
        assert_string_equal(two + p.consumed, "GET /health HTTP/1.1\r\n\r\n");
        tsr_http_parsed_done(&p);
        assert_null(p.req.arena);

        assert_int_equal(tsr_http_parse_one(NULL, "GET /x HTTP/1.1\r\nHo", 19, &p), TSR_OK);
        assert_true(p.incomplete);
        assert_int_equal(p.status, 0);

        assert_int_equal(tsr_http_parse_one(NULL, "\x01\x02 x\r\n\r\n", 8, &p), TSR_OK);
        assert_int_equal(p.status, 400);
        assert_string_equal(p.message, "Invalid HTTP request received.");

        tsr_http_server_opts_default(&o);
        o.max_body = 10;
        assert_int_equal(tsr_http_parse_one(&o, "POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n", 39, &p), TSR_OK);
        assert_int_equal(p.status, 413);
        o.max_headers = 1;
        assert_int_equal(tsr_http_parse_one(&o, "GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\n\r\n", 30, &p), TSR_OK);
        assert_int_equal(p.status, 431);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_api_misuse),
                cmocka_unit_test_setup_teardown(test_simple_get, setup, teardown),
                cmocka_unit_test_setup_teardown(test_keep_alive, setup, teardown),
                cmocka_unit_test_setup_teardown(test_pipelined, setup, teardown),
                cmocka_unit_test_setup_teardown(test_post_content_length, setup, teardown),
                cmocka_unit_test_setup_teardown(test_post_chunked, setup, teardown),
                cmocka_unit_test_setup_teardown(test_expect_continue, setup, teardown),
                cmocka_unit_test_setup_teardown(test_body_too_large, setup, teardown),
                cmocka_unit_test_setup_teardown(test_too_many_headers, setup, teardown),
                cmocka_unit_test_setup_teardown(test_garbage, setup, teardown),
                cmocka_unit_test_setup_teardown(test_header_timeout, setup, teardown),
                cmocka_unit_test_setup_teardown(test_idle_timeout, setup, teardown),
                cmocka_unit_test_setup_teardown(test_stream, setup, teardown),
                cmocka_unit_test_setup_teardown(test_hang_disconnect, setup, teardown),
                cmocka_unit_test_setup_teardown(test_http10, setup, teardown),
                cmocka_unit_test_setup_teardown(test_shutdown_idle, setup, teardown),
                cmocka_unit_test_setup_teardown(test_shutdown_inflight, setup, teardown),
                cmocka_unit_test_setup_teardown(test_shutdown_force, setup, teardown),
                cmocka_unit_test_setup_teardown(test_max_connections, setup, teardown),
                cmocka_unit_test_setup_teardown(test_write_queue_limit, setup, teardown),
                cmocka_unit_test_setup_teardown(test_respond_error, setup, teardown),
                cmocka_unit_test(test_parse_one),
        };
        alarm(120);   /* last resort: a hung test kills the binary instead of the CI job */
        return cmocka_run_group_tests(tests, NULL, NULL);
}
