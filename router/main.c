/* tessera-router --worker tcp://HOST:PORT [--worker ...] [--host H] [--port P] [vLLM flags]
 *
 * Parse the configuration, connect to the workers, serve HTTP on --router-threads libuv
 * loops (default 1) sharing the port with SO_REUSEPORT.  Each loop is a whole router of
 * its own (its HTTP server, worker sockets, models, requests; the router is stateless,
 * so nothing else is shared) except for the one metrics registry, which is locked.
 * Loop 0 runs on the main thread and takes the signals.
 * SIGTERM/SIGINT: every loop stops accepting, lets in-flight responses finish (bounded),
 * closes its worker sockets; exit 0. */
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#ifdef TSR_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "common/clock.h"
#include "common/config.h"
#include "common/log.h"
#include "common/zmq_curve.h"
#include "router.h"
#include "worker_dns.h"

#define SHUTDOWN_GRACE_MS 10000

typedef struct router_main router_main;

/* One event loop and everything it owns.  Its thread (the main thread for loop 0)
 * is the only one touching it after start. */
typedef struct router_loop {
        tsr_router_ctx r;
        router_main *owner;
        uv_loop_t own_loop;          /* loops 1..N-1; loop 0 is uv_default_loop() */
        tsr_worker_dns *dns;             /* --worker-dns lookups; NULL without the flag */
        uv_async_t stop;             /* loop 0's signal handler wakes the others with it */
        bool stop_init;
        uv_timer_t ready_publish;    /* with several loops: publishes tsr_api_can_serve */
        bool ready_publish_init;
        bool stopping;
        pthread_t thread;
        bool thread_started;
} router_loop;

struct router_main {
        const tsr_config *cfg;
        tsr_curve curve;             /* --zmq-curve-* keys; disabled = plain TCP */
        tsr_metrics *metrics;        /* shared by every loop (locked inside) */
        tsr_http_server **http;          /* every loop's server, for /metrics (read-only after start) */
        atomic_bool *loops_ready;    /* one per loop, written by that loop only */
        router_loop *loops;
        int n_loops;
        uv_signal_t sigterm;
        uv_signal_t sigint;
        bool signals_init;
        uv_timer_t watchdog;         /* systemd WatchdogSec: WATCHDOG=1 from loop 0 while it turns */
        bool watchdog_init;
};

/* Closing a uv_signal handle restores the default disposition; a second SIGTERM
 * (a supervisor repeating itself) must not kill a router that is already on its way out. */
static void on_signal_closed(uv_handle_t *h) {
        signal(h == (uv_handle_t *)&((router_main *)h->data)->sigterm ? SIGTERM : SIGINT, SIG_IGN);
}

static void on_pool_closed(void *ud) {
        router_loop *l = ud;
        if (l->stop_init)
                uv_close((uv_handle_t *)&l->stop, NULL);
        if (l->ready_publish_init)
                uv_close((uv_handle_t *)&l->ready_publish, NULL);
        if (l == &l->owner->loops[0] && l->owner->signals_init) {
                uv_close((uv_handle_t *)&l->owner->sigterm, on_signal_closed);
                uv_close((uv_handle_t *)&l->owner->sigint, on_signal_closed);
        }
        if (l == &l->owner->loops[0] && l->owner->watchdog_init)
                uv_close((uv_handle_t *)&l->owner->watchdog, NULL);
}

static void on_http_closed(void *ud) {
        router_loop *l = ud;
        log_info("http server closed; disconnecting from workers");
        tsr_worker_pool_close(l->r.workers, on_pool_closed, l);
}

/* This loop's part of a stop: no more lookups, deadlines or connections; in-flight
 * responses get the grace period; then the worker sockets close. */
static void loop_begin_stop(router_loop *l) {
        if (l->stopping)
                return;
        l->stopping = true;
        tsr_worker_dns_close(l->dns);    /* before the pool closes: no workers added after */
        tsr_request_layer_close(l->r.requests);
        tsr_http_server_shutdown(l->r.http, SHUTDOWN_GRACE_MS, on_http_closed, l);
}

static void on_stop_async(uv_async_t *h) { loop_begin_stop(h->data); }

/* Loop thread.  Without this, /health on loop 0 could say 200 while loop 1 has not
 * yet built its tokenizer, and the client's next connection, landing there, a 503. */
static void on_ready_publish(uv_timer_t *t) {
        router_loop *l = t->data;
        atomic_store_explicit(&l->r.loops_ready[l->r.loop_index], !l->stopping && tsr_api_can_serve(&l->r),
                              memory_order_relaxed);
}

#ifdef TSR_HAVE_SYSTEMD
/* Loop 0.  A loop stuck in a callback stops these and systemd restarts the router. */
static void on_watchdog(uv_timer_t *t) {
        (void)t;
        sd_notify(0, "WATCHDOG=1");
}
#endif

/* Loop 0, once started: ping at half of WatchdogSec when the unit sets one. */
static void watchdog_start(router_main *m) {
#ifdef TSR_HAVE_SYSTEMD
        uint64_t usec = 0;
        if (sd_watchdog_enabled(0, &usec) <= 0 || usec < 2000)
                return;
        uv_timer_init(m->loops[0].r.loop, &m->watchdog);
        m->watchdog_init = true;
        uv_timer_start(&m->watchdog, on_watchdog, 0, usec / 2000);
#else
        (void)m;
#endif
}

static void on_signal(uv_signal_t *h, int signum) {
        router_main *m = h->data;
        if (m->loops[0].stopping)
                return;
        log_info("%s: shutting down (grace %d ms)", signum == SIGTERM ? "SIGTERM" : "SIGINT", SHUTDOWN_GRACE_MS);
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "STOPPING=1");
#endif
        for (int i = 1; i < m->n_loops; i++)
                uv_async_send(&m->loops[i].stop);
        loop_begin_stop(&m->loops[0]);
}

/* Every client connection is a file descriptor: raise the soft limit toward 65535 as
 * vLLM's set_ulimit does (a default soft limit of 1024 would refuse the 1,000th
 * concurrent client long before --max-connections-like caps matter). */
static void raise_fd_limit(void) {
        struct rlimit rl;
        const rlim_t want = 65535;
        if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= want)
                return;
        rlim_t target = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        if (target > rl.rlim_cur) {
                rlim_t old = rl.rlim_cur;
                rl.rlim_cur = target;
                if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
                        log_debug("open-file limit raised from %llu to %llu", (unsigned long long)old,
                                  (unsigned long long)target);
        }
        if (target < 4096)
                log_warn("open-file limit is %llu: at most about that many concurrent connections",
                         (unsigned long long)target);
}

static void make_router_id(char *out, size_t n, int loop_index) {
        char host[64] = "host";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        /* pid + boot time: a restarted router gets a new id, so workers can tell its
         * orphaned requests from the new ones. */
        snprintf(out, n, "router-%.24s-%d-%llx", host, (int)getpid(), (unsigned long long)(tsr_wall_ns() & 0xffffffffull));
        /* --router-threads: every loop is a router of its own to the workers */
        if (loop_index > 0) {
                size_t len = strlen(out);
                snprintf(out + len, n - len, "-l%d", loop_index);
        }
}

/* Build loop i's router: worker sockets, models, requests, HTTP server listening on
 * `port` (with SO_REUSEPORT when there are several loops).  Main thread, before any
 * loop runs.  Returns the exit code on failure (2 config, 1 runtime), 0 on success. */
static int loop_setup(router_main *m, int i, int port, char *err, size_t errlen) {
        router_loop *l = &m->loops[i];
        const tsr_config *cfg = m->cfg;
        tsr_http_server_opts hopts;

        l->owner = m;
        if (i == 0) {
                l->r.loop = uv_default_loop();
        } else {
                if (uv_loop_init(&l->own_loop) != 0) {
                        log_error("cannot create event loop %d", i);
                        return 1;
                }
                l->r.loop = &l->own_loop;
        }
        l->r.cfg = cfg;
        l->r.metrics = m->metrics;
        l->r.loop_index = i;
        l->r.all_http = m->http;
        l->r.n_http = (size_t)m->n_loops;
        l->r.loops_ready = m->loops_ready;
        l->r.started_unix_s = (uint64_t)time(NULL);
        make_router_id(l->r.router_id, sizeof(l->r.router_id), i);
        if (uv_async_init(l->r.loop, &l->stop, on_stop_async) != 0)
                return 1;
        l->stop.data = l;
        l->stop_init = true;
        if (m->loops_ready) {
                uv_timer_init(l->r.loop, &l->ready_publish);
                l->ready_publish.data = l;
                uv_timer_start(&l->ready_publish, on_ready_publish, 0, TSR_READY_PUBLISH_MS);
                uv_unref((uv_handle_t *)&l->ready_publish);   /* does not keep the loop alive */
                l->ready_publish_init = true;
        }
        if (tsr_worker_pool_new(l->r.loop, l->r.router_id, &l->r.workers) != TSR_OK ||
            tsr_models_registry_new(l->r.loop, cfg, &l->r.models) != TSR_OK ||
            tsr_request_layer_new(&l->r, &l->r.requests) != TSR_OK) {
                log_error("out of memory");
                return 1;
        }
        tsr_worker_pool_set_curve(l->r.workers, &m->curve);
        for (size_t w = 0; w < cfg->worker.n; w++)
                if (tsr_worker_pool_add(l->r.workers, cfg->worker.items[w]) != TSR_OK)
                        return 2;
        if (cfg->worker_dns.n &&
            tsr_worker_dns_start(l->r.loop, l->r.workers, (const char *const *)cfg->worker_dns.items,
                             cfg->worker_dns.n, TSR_WORKER_DNS_INTERVAL_MS, &l->dns, err, errlen) != TSR_OK) {
                fprintf(stderr, "tessera-router: error: %s\n", err);
                return 2;
        }
        tsr_http_server_opts_default(&hopts);
        hopts.max_body = (size_t)cfg->max_request_body;
        hopts.reuse_port = m->n_loops > 1;
        if (tsr_http_server_new(l->r.loop, &hopts, tsr_api_handle, &l->r, &l->r.http) != TSR_OK) {
                log_error("cannot create the http server");
                return 1;
        }
        m->http[i] = l->r.http;
        if (tsr_http_server_listen(l->r.http, cfg->host, port) != TSR_OK) {
                log_error("cannot listen on %s:%d", cfg->host ? cfg->host : "0.0.0.0", port);
                return 1;
        }
        log_info("router %s listening on http://%s:%d%s", l->r.router_id, cfg->host ? cfg->host : "0.0.0.0",
                 tsr_http_server_port(l->r.http), m->n_loops > 1 ? " (SO_REUSEPORT)" : "");
        return 0;
}

static void *loop_thread(void *arg) {
        router_loop *l = arg;
        char name[16];
        snprintf(name, sizeof(name), "loop%d", l->r.loop_index);
        tsr_log_set_thread(name);
        pthread_setname_np(pthread_self(), name);   /* visible in top -H, /proc/PID/task/N/comm */
        uv_run(l->r.loop, UV_RUN_DEFAULT);
        return NULL;
}

/* After a failed start or a finished run: close what is still open, let each loop
 * finish its handles (its own thread is gone by now), free everything. */
static void loops_teardown(router_main *m, bool failed) {
        for (int i = 0; i < m->n_loops; i++) {
                router_loop *l = &m->loops[i];
                if (!l->r.loop)
                        continue;
                if (failed) {
                        tsr_worker_dns_close(l->dns);
                        tsr_request_layer_close(l->r.requests);
                        if (l->r.workers)
                                tsr_worker_pool_close(l->r.workers, NULL, NULL);
                        if (l->r.http)
                                tsr_http_server_shutdown(l->r.http, 0, NULL, NULL);
                        if (l->stop_init && !uv_is_closing((uv_handle_t *)&l->stop))
                                uv_close((uv_handle_t *)&l->stop, NULL);
                        if (l->ready_publish_init && !uv_is_closing((uv_handle_t *)&l->ready_publish))
                                uv_close((uv_handle_t *)&l->ready_publish, NULL);
                        uv_run(l->r.loop, UV_RUN_DEFAULT);
                }
                tsr_request_layer_free(&l->r.requests);
                tsr_http_server_free(&l->r.http);
                tsr_worker_dns_free(&l->dns);
                tsr_worker_pool_free(&l->r.workers);
                tsr_models_registry_free(&l->r.models);
                uv_loop_close(l->r.loop);
        }
}

int main(int argc, char **argv) {
        router_main m;
        tsr_config cfg;
        char err[1024] = "";
        int rc = 2, port;
        tsr_log_level level;
        bool started = false;

        memset(&m, 0, sizeof(m));
        tsr_log_init("tessera-router", TSR_LOG_INFO);
        tsr_log_set_thread("loop");
        tsr_config_init(&cfg);
        m.cfg = &cfg;
        if (tsr_config_parse(&cfg, argc, argv, false, err, sizeof(err)) != TSR_OK ||
            (!cfg.help && !cfg.version && tsr_config_validate(&cfg, err, sizeof(err)) != TSR_OK)) {
                fprintf(stderr, "tessera-router: error: %s\n", err);
                goto out;
        }
        if (cfg.help) {
                tsr_config_print_help(stdout, "usage: tessera-router --worker tcp://HOST:PORT [options]",
                                      TSR_OWNER_ROUTER);
                rc = 0;
                goto out;
        }
        if (cfg.version) {
                printf("tessera-router %s\n", TSR_VERSION);
                rc = 0;
                goto out;
        }
        if (cfg.log_level && tsr_log_parse_level(cfg.log_level, &level))
                tsr_log_set_level(level);
        {       /* flags accepted that change nothing here, by design (docs/configuration.md) */
                const char *notes[16];
                size_t n = tsr_config_noop_notes(&cfg, TSR_OWNER_ROUTER, notes, 16);
                for (size_t i = 0; i < n; i++)
                        log_info("%s", notes[i]);
        }
        if (tsr_curve_load(&m.curve, cfg.zmq_curve_secret_file, cfg.zmq_curve_peers_file, err, sizeof(err)) !=
            TSR_OK) {
                fprintf(stderr, "tessera-router: error: %s\n", err);
                goto out;
        }
        signal(SIGPIPE, SIG_IGN);
        raise_fd_limit();
        if (m.curve.enabled)
                log_info("CurveZMQ on: public key %s, %zu worker key(s) trusted", m.curve.public_key,
                         m.curve.n_peers);
        if (cfg.worker.n == 0 && cfg.worker_dns.n == 0)
                log_warn("no --worker or --worker-dns given: /health answers 503 until one is configured");

        tsr_metrics_opts mopts = {.disable_log_stats = cfg.disable_log_stats,
                                  .show_hidden_metrics_for_version = cfg.show_hidden_metrics_for_version};
        m.n_loops = cfg.router_threads;
        m.loops = calloc((size_t)m.n_loops, sizeof(*m.loops));
        m.http = calloc((size_t)m.n_loops, sizeof(*m.http));
        if (m.n_loops > 1)
                m.loops_ready = calloc((size_t)m.n_loops, sizeof(*m.loops_ready));
        if (!m.loops || !m.http || (m.n_loops > 1 && !m.loops_ready) || tsr_metrics_new(&mopts, &m.metrics) != TSR_OK) {
                log_error("out of memory");
                rc = 1;
                goto out;
        }
        /* Loop 0 first: with --port 0 the others join the port it was given. */
        port = cfg.port;
        for (int i = 0; i < m.n_loops; i++) {
                int st = loop_setup(&m, i, port, err, sizeof(err));
                if (st != 0) {
                        rc = st;
                        goto out_teardown;
                }
                port = tsr_http_server_port(m.loops[i].r.http);
        }
        uv_signal_init(m.loops[0].r.loop, &m.sigterm);
        uv_signal_init(m.loops[0].r.loop, &m.sigint);
        m.sigterm.data = &m;
        m.sigint.data = &m;
        m.signals_init = true;
        uv_signal_start(&m.sigterm, on_signal, SIGTERM);
        uv_signal_start(&m.sigint, on_signal, SIGINT);
        /* The other loops' threads must not take SIGTERM/SIGINT: loop 0's handler does. */
        sigset_t block, old;
        sigemptyset(&block);
        sigaddset(&block, SIGTERM);
        sigaddset(&block, SIGINT);
        pthread_sigmask(SIG_BLOCK, &block, &old);
        for (int i = 1; i < m.n_loops; i++) {
                if (pthread_create(&m.loops[i].thread, NULL, loop_thread, &m.loops[i]) != 0) {
                        log_error("cannot start the thread of loop %d", i);
                        break;
                }
                m.loops[i].thread_started = true;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        started = true;
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "READY=1");
#endif
        watchdog_start(&m);
        uv_run(m.loops[0].r.loop, UV_RUN_DEFAULT);
        for (int i = 1; i < m.n_loops; i++) {
                if (!m.loops[i].thread_started) {
                        loop_begin_stop(&m.loops[i]);   /* never ran: close it here */
                        uv_run(m.loops[i].r.loop, UV_RUN_DEFAULT);
                        continue;
                }
                pthread_join(m.loops[i].thread, NULL);
        }
        rc = 0;
out_teardown:
        loops_teardown(&m, !started);
        if (m.signals_init && !started) {
                uv_close((uv_handle_t *)&m.sigterm, NULL);
                uv_close((uv_handle_t *)&m.sigint, NULL);
                uv_run(uv_default_loop(), UV_RUN_DEFAULT);
        }
        log_info("exit");
out:
        tsr_metrics_free(&m.metrics);
        free(m.loops);
        free(m.http);
        free(m.loops_ready);
        tsr_curve_done(&m.curve);
        tsr_config_done(&cfg);
        return rc;
}
