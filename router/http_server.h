/* http_server.h - the router's HTTP/1.1 server: listener, connections, llhttp parsing,
 * limits, timeouts and the response write path.
 *
 * Threading: everything here runs on the router's `loop` thread, the thread that runs
 * uv_run on the loop given to tsr_http_server_new.  No function in this header may be called
 * from another thread (libuv handles are not thread-safe; hand work back to the loop with
 * uv_async_send).  Nothing here blocks the loop, except name resolution in
 * tsr_http_server_listen, which is meant to run at startup, before uv_run.
 *
 * Request flow: one request at a time per connection.  When a request is complete it is
 * handed to the handler, and parsing of that connection stops (llhttp is paused; further
 * pipelined bytes are buffered, capped) until the response has been completely written.
 * So pipelined requests are answered strictly in order, and a handler never sees two
 * requests of one connection at once.
 *
 * Ownership of a request: the handler owns `c` and `req` from the handler call until it
 * calls tsr_http_conn_respond, tsr_http_conn_stream_end or tsr_http_conn_abort (with any return
 * value), or until the on_close callback it registered runs.  After that it must not
 * touch `c` or `req` again.  While the handler owns a request the connection is kept
 * alive, even if the peer has gone; a handler that holds a request across loop
 * iterations should register tsr_http_conn_on_close to learn about disconnects (this is how
 * a client disconnect cancels generation); without it, the calls above return
 * TSR_E_CLOSED once the peer has gone.
 *
 * Responses carry lower-case "server: tessera", "content-type" (if given) and
 * "content-length" (or "transfer-encoding: chunked" when streamed), plus
 * "connection: close" when the connection will close after the response.  Errors the
 * server generates itself (400, 408, 413, 431) use vLLM's JSON error body and close the
 * connection. */
#ifndef TSR_HTTP_SERVER_H
#define TSR_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/arena.h"
#include "common/tsr_status.h"

typedef struct tsr_http_server tsr_http_server;
typedef struct tsr_http_conn tsr_http_conn;

typedef struct tsr_http_header {
        const char *name;     /* lower-cased */
        const char *value;
} tsr_http_header;

/* A parsed request.  Every pointer in it is owned by the server and stays valid until
 * the response has been completely written (or the connection is freed): copy what you
 * need beyond that.  Handlers may allocate in `arena`, which is freed at the same time. */
typedef struct tsr_http_request {
        const char *method;           /* "GET", "POST", ... */
        const char *path;             /* request target without the query, not decoded */
        const char *query;            /* after '?', "" if none */
        const tsr_http_header *headers;   /* [n_headers], in arrival order */
        size_t n_headers;
        const uint8_t *body;          /* de-chunked; NUL-terminated (not counted in body_len); never NULL */
        size_t body_len;
        int http_major, http_minor;
        bool keep_alive;              /* false: the connection closes after this response */
        tsr_arena *arena;             /* per-request arena: freed after the response is fully written */
} tsr_http_request;

/* Value of the first header named `lower_name` (compared case-insensitively), or NULL if
 * absent.  Borrowed from the request.  Any thread that may read `r`. */
const char *tsr_http_request_header(const tsr_http_request *r, const char *lower_name);

/* Limits.  A timeout of 0 disables that timeout; every size must be > 0. */
typedef struct tsr_http_server_opts {
        size_t max_body;              /* 32 MiB: larger bodies get 413 and the connection closes */
        size_t max_header_bytes;      /* 64 KiB: request line + header bytes; over -> 431 + close */
        size_t max_headers;           /* 100: more header fields -> 431 + close */
        uint64_t header_timeout_ms;   /* 10 s: the whole request head must arrive within this
                                       * (measured from its first byte, or from accept for the first
                                       * request) -> 408 + close; also the most a body upload may
                                       * stall between two reads */
        uint64_t idle_timeout_ms;     /* 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): keep-alive idle -> close */
        size_t max_connections;       /* 10000: past it new connections are accepted and closed at once */
        size_t max_write_queue;       /* 8 MiB per connection of bytes not yet taken by the kernel:
                                       * tsr_http_conn_stream_write returns TSR_E_LIMIT past it */
        bool reuse_port;              /* false: SO_REUSEPORT on the listener (--router-threads) */
} tsr_http_server_opts;

/* Fill `o` with the defaults above.  Any thread. */
void tsr_http_server_opts_default(tsr_http_server_opts *o);

/* Called on the loop thread with a complete request.  The handler now owns `c` and `req`
 * (see above) and must later call exactly one of tsr_http_conn_respond, or
 * tsr_http_conn_stream_start .. tsr_http_conn_stream_end, or tsr_http_conn_abort, now or on a later
 * loop iteration.  `ud` is the pointer given to tsr_http_server_new. */
typedef void (*tsr_http_handler_fn)(void *ud, tsr_http_conn *c, tsr_http_request *req);

/* Create a server on `loop` (borrowed; must outlive the server).  `o` is copied; NULL
 * means defaults.  Returns TSR_OK and writes *ret, TSR_E_INVAL for a zero size limit, or
 * TSR_E_NOMEM.  Loop thread (or before uv_run). */
tsr_status tsr_http_server_new(uv_loop_t *loop, const tsr_http_server_opts *o, tsr_http_handler_fn fn, void *ud,
                           tsr_http_server **ret);

/* Bind and listen.  `host`: a numeric IPv4/IPv6 address or a name (resolved synchronously:
 * call before uv_run); NULL means all IPv4 interfaces.  `port` 0 picks an ephemeral port
 * (see tsr_http_server_port).  Returns TSR_OK, TSR_E_INVAL (bad host, already listening or
 * shutting down), or TSR_E_IO (bind/listen failed, e.g. port in use).  Loop thread. */
tsr_status tsr_http_server_listen(tsr_http_server *s, const char *host, int port);

/* The bound port, or -1 when not listening.  Loop thread. */
int tsr_http_server_port(const tsr_http_server *s);

/* Stop accepting, close connections that have no request in progress, let in-flight
 * responses finish (their connections close afterwards), and force-close whatever is
 * left after `grace_ms` (on_close callbacks fire then).  `done(ud)` runs once, on a later
 * loop iteration, when every connection and handle of the server is closed; the server
 * may be freed from inside `done`.  A second call does nothing.  Loop thread. */
void tsr_http_server_shutdown(tsr_http_server *s, uint64_t grace_ms, void (*done)(void *ud), void *ud);

/* Free the server and clear *s.  Accepts NULL.  Call only after `done` ran, or when the
 * server never listened successfully.  Loop thread. */
void tsr_http_server_free(tsr_http_server **s);

/* Connections accepted and not yet freed (closing ones included).  Any thread. */
size_t tsr_http_server_num_connections(const tsr_http_server *s);

/* Totals since the server was created, for the router's tessera:router_connections*
 * series (api.c copies them into the registry at each /metrics scrape). */
typedef struct tsr_http_server_stats {
        uint64_t accepted;            /* connections taken into service */
        uint64_t rejected_cap;        /* accepted and closed at once: max_connections reached */
        uint64_t header_timeouts;     /* 408: request head not complete within header_timeout_ms */
        uint64_t body_timeouts;       /* 408: body upload stalled for header_timeout_ms */
        uint64_t idle_timeouts;       /* closed after idle_timeout_ms without a request byte
                                       * (keep-alive idle, or a new connection that sent nothing
                                       * within header_timeout_ms) */
} tsr_http_server_stats;

/* Copy the totals into *out.  Any thread (the counters are atomic). */
void tsr_http_server_get_stats(const tsr_http_server *s, tsr_http_server_stats *out);

/* Send a complete response with a Content-Length.  `content_type` may be NULL (no
 * header); `body` is copied (the caller keeps it); `extra_headers` is "Name: v\r\n"...
 * or NULL.  Ends the handler's ownership whatever it returns.  Returns TSR_OK,
 * TSR_E_CLOSED (the peer went away; nothing sent), TSR_E_INVAL (no request owned, a
 * response already started, or extra_headers not ending in "\r\n"), TSR_E_NOMEM or
 * TSR_E_IO (the connection is closed).  Loop thread. */
tsr_status tsr_http_conn_respond(tsr_http_conn *c, int status, const char *content_type, const void *body, size_t len,
                             const char *extra_headers);

/* Start a streamed response: Transfer-Encoding: chunked for HTTP/1.1 clients, a
 * close-delimited body for HTTP/1.0 ones.  Does not end ownership: finish with
 * tsr_http_conn_stream_end even when this fails.  Returns TSR_OK, TSR_E_CLOSED, TSR_E_INVAL,
 * TSR_E_NOMEM or TSR_E_IO.  Loop thread. */
tsr_status tsr_http_conn_stream_start(tsr_http_conn *c, int status, const char *content_type, const char *extra_headers);

/* Queue one chunk (copied; len 0 does nothing).  Returns TSR_OK; TSR_E_LIMIT if the
 * bytes not yet written would pass max_write_queue (nothing queued: the client is not
 * reading; the caller should cancel and end or abort); TSR_E_CLOSED if the peer is gone;
 * TSR_E_INVAL without a started stream; TSR_E_NOMEM.  Loop thread. */
tsr_status tsr_http_conn_stream_write(tsr_http_conn *c, const void *data, size_t len);

/* Finish the stream (the terminating chunk) and end the handler's ownership, whatever it
 * returns.  If the stream never started, the connection is closed instead.  Returns
 * TSR_OK, TSR_E_CLOSED or TSR_E_IO.  Loop thread. */
tsr_status tsr_http_conn_stream_end(tsr_http_conn *c);

/* Drop the connection now (e.g. after TSR_E_LIMIT) and end the handler's ownership; the
 * on_close callback is not called.  Loop thread. */
void tsr_http_conn_abort(tsr_http_conn *c);

/* Register `cb(ud)`, called once, on the loop thread and never from inside an http_conn_*
 * call, if the connection dies while the handler still owns the request (peer closed or
 * reset, write error, forced shutdown).  After it runs the handler must not touch `c` or
 * its request.  A second call replaces the first; cb NULL unregisters.  Register it from
 * the handler call itself: if the connection has already died, cb is not called and the
 * calls above return TSR_E_CLOSED.  Loop thread. */
void tsr_http_conn_on_close(tsr_http_conn *c, void (*cb)(void *ud), void *ud);

/* tsr_http_conn_respond with vLLM's error body
 * {"error":{"message":..,"type":..,"param":null,"code":status}} as application/json.
 * `type` NULL means the HTTP reason phrase ("Bad Request").  Same returns and ownership
 * rule as tsr_http_conn_respond.  Loop thread. */
tsr_status tsr_http_conn_respond_error(tsr_http_conn *c, int status, const char *type, const char *message);

/* One request parsed from a buffer, exactly as a connection would parse it (the same
 * llhttp callbacks and limits), with no socket and no loop: for unit tests and the
 * fuzz target (tests/fuzz/fuzz_http.c).  Exactly one of:
 *   - a request: status 0, incomplete false, `req` filled (free with tsr_http_parsed_done),
 *     `consumed` = bytes of `data` it used (pipelined bytes may follow);
 *   - a valid prefix: incomplete true (the server would wait for more bytes);
 *   - an error the server answers itself: status 400, 413, 431 or 500 and `message`
 *     (a static string), as in its vLLM-shaped error body. */
typedef struct tsr_http_parsed {
        int status;
        const char *message;
        bool incomplete;
        size_t consumed;
        tsr_http_request req;
} tsr_http_parsed;

/* `o` NULL means the defaults.  TSR_OK (see tsr_http_parsed) or TSR_E_NOMEM.  Any thread. */
tsr_status tsr_http_parse_one(const tsr_http_server_opts *o, const void *data, size_t len, tsr_http_parsed *out);
void tsr_http_parsed_done(tsr_http_parsed *p);

/* Standard reason phrase for `status` ("Not Found"); "Unknown" if not known.  Static
 * string.  Any thread. */
const char *tsr_http_reason_phrase(int status);

#endif
