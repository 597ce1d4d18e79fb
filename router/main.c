/* tessera-router --worker tcp://HOST:PORT [--worker ...] [--host H] [--port P] [vLLM flags]
 *
 * Parse the configuration, connect to the workers, serve HTTP on one libuv loop.
 * SIGTERM/SIGINT: stop accepting, let in-flight responses finish (bounded), close the
 * worker sockets, exit 0. */
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

typedef struct router_main {
        router_ctx r;
        tsr_curve curve;             /* --zmq-curve-* keys; disabled = plain TCP */
        worker_dns *dns;             /* --worker-dns lookups; NULL without the flag */
        uv_signal_t sigterm;
        uv_signal_t sigint;
        bool stopping;
} router_main;

/* Closing a uv_signal handle restores the default disposition; a second SIGTERM
 * (a supervisor repeating itself) must not kill a router that is already on its way out. */
static void on_signal_closed(uv_handle_t *h) {
        signal(h == (uv_handle_t *)&((router_main *)h->data)->sigterm ? SIGTERM : SIGINT, SIG_IGN);
}

static void on_pool_closed(void *ud) {
        router_main *m = ud;
        uv_close((uv_handle_t *)&m->sigterm, on_signal_closed);
        uv_close((uv_handle_t *)&m->sigint, on_signal_closed);
}

static void on_http_closed(void *ud) {
        router_main *m = ud;
        log_info("http server closed; disconnecting from workers");
        worker_pool_close(m->r.workers, on_pool_closed, m);
}

static void on_signal(uv_signal_t *h, int signum) {
        router_main *m = h->data;
        if (m->stopping)
                return;
        m->stopping = true;
        worker_dns_close(m->dns);    /* before the pool closes: no workers added after */
        request_layer_close(m->r.requests);
        log_info("%s: shutting down (grace %d ms)", signum == SIGTERM ? "SIGTERM" : "SIGINT", SHUTDOWN_GRACE_MS);
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "STOPPING=1");
#endif
        http_server_shutdown(m->r.http, SHUTDOWN_GRACE_MS, on_http_closed, m);
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

static void make_router_id(char *out, size_t n) {
        char host[64] = "host";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        /* pid + boot time: a restarted router gets a new id, so workers can tell its
         * orphaned requests from the new ones. */
        snprintf(out, n, "router-%.24s-%d-%llx", host, (int)getpid(), (unsigned long long)(tsr_wall_ns() & 0xffffffffull));
}

int main(int argc, char **argv) {
        router_main m;
        tsr_config cfg;
        http_server_opts hopts;
        uv_loop_t *loop = NULL;
        char err[1024] = "";
        int rc = 2;
        tsr_log_level level;

        memset(&m, 0, sizeof(m));
        tsr_log_init("tessera-router", TSR_LOG_INFO);
        tsr_log_set_thread("loop");
        tsr_config_init(&cfg);
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
        if (cfg.router_threads != 1) {
                fprintf(stderr, "tessera-router: error: --router-threads other than 1 is not supported yet\n");
                goto out;
        }
        if (tsr_curve_load(&m.curve, cfg.zmq_curve_secret_file, cfg.zmq_curve_peers_file, err, sizeof(err)) !=
            TSR_OK) {
                fprintf(stderr, "tessera-router: error: %s\n", err);
                goto out;
        }
        signal(SIGPIPE, SIG_IGN);
        raise_fd_limit();

        loop = uv_default_loop();
        m.r.loop = loop;
        m.r.cfg = &cfg;
        m.r.started_unix_s = (uint64_t)time(NULL);
        make_router_id(m.r.router_id, sizeof(m.r.router_id));
        if (worker_pool_new(loop, m.r.router_id, &m.r.workers) != TSR_OK ||
            model_registry_new(loop, &cfg, &m.r.models) != TSR_OK ||
            request_layer_new(&m.r, &m.r.requests) != TSR_OK) {
                log_error("out of memory");
                goto out_close;
        }
        tsr_metrics_opts mopts = {.disable_log_stats = cfg.disable_log_stats,
                                  .show_hidden_metrics_for_version = cfg.show_hidden_metrics_for_version};
        if (tsr_metrics_new(&mopts, &m.r.metrics) != TSR_OK) {
                log_error("out of memory");
                goto out_close;
        }
        worker_pool_set_curve(m.r.workers, &m.curve);
        if (m.curve.enabled)
                log_info("CurveZMQ on: public key %s, %zu worker key(s) trusted", m.curve.public_key,
                         m.curve.n_peers);
        for (size_t i = 0; i < cfg.worker.n; i++)
                if (worker_pool_add(m.r.workers, cfg.worker.items[i]) != TSR_OK)
                        goto out_close;
        if (cfg.worker_dns.n &&
            worker_dns_start(loop, m.r.workers, (const char *const *)cfg.worker_dns.items, cfg.worker_dns.n,
                             TSR_WORKER_DNS_INTERVAL_MS, &m.dns, err, sizeof(err)) != TSR_OK) {
                fprintf(stderr, "tessera-router: error: %s\n", err);
                goto out_close;
        }
        if (cfg.worker.n == 0 && cfg.worker_dns.n == 0)
                log_warn("no --worker or --worker-dns given: /health answers 503 until one is configured");

        http_server_opts_default(&hopts);
        hopts.max_body = (size_t)cfg.max_request_body;
        if (http_server_new(loop, &hopts, router_api_handle, &m.r, &m.r.http) != TSR_OK) {
                log_error("cannot create the http server");
                goto out_close;
        }
        if (http_server_listen(m.r.http, cfg.host, cfg.port) != TSR_OK) {
                log_error("cannot listen on %s:%d", cfg.host ? cfg.host : "0.0.0.0", cfg.port);
                rc = 1;
                goto out_close;
        }
        log_info("router %s listening on http://%s:%d", m.r.router_id, cfg.host ? cfg.host : "0.0.0.0",
                 http_server_port(m.r.http));
        uv_signal_init(loop, &m.sigterm);
        uv_signal_init(loop, &m.sigint);
        m.sigterm.data = &m;
        m.sigint.data = &m;
        uv_signal_start(&m.sigterm, on_signal, SIGTERM);
        uv_signal_start(&m.sigint, on_signal, SIGINT);
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "READY=1");
#endif
        uv_run(loop, UV_RUN_DEFAULT);
        rc = 0;
        goto out_free;

out_close:
        /* Failed start: close what was opened, run the loop until the handles are gone. */
        if (!loop)
                goto out;
        worker_dns_close(m.dns);
        request_layer_close(m.r.requests);
        if (m.r.workers)
                worker_pool_close(m.r.workers, NULL, NULL);
        if (m.r.http)
                http_server_shutdown(m.r.http, 0, NULL, NULL);
        uv_run(loop, UV_RUN_DEFAULT);
out_free:
        request_layer_free(&m.r.requests);
        http_server_free(&m.r.http);
        worker_dns_free(&m.dns);
        worker_pool_free(&m.r.workers);
        model_registry_free(&m.r.models);
        tsr_metrics_free(&m.r.metrics);
        uv_loop_close(loop);
        log_info("exit");
out:
        tsr_curve_done(&m.curve);
        tsr_config_done(&cfg);
        return rc;
}
