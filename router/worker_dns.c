/* worker_dns.c - --worker-dns NAME:PORT: add the workers a DNS name points to
 * (see worker_dns.h).  Loop thread only. */
#include "worker_dns.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/log.h"

typedef struct dns_name {
        worker_dns *owner;
        char name[256];
        int port;
        uv_getaddrinfo_t req;
        bool busy;                   /* a lookup is in flight: req is in use */
        bool failing;                /* the last lookup failed (log state changes only) */
        size_t n_last;               /* addresses in the last answer */
} dns_name;

struct worker_dns {
        uv_loop_t *loop;
        worker_pool *pool;
        dns_name *names;
        size_t n_names;
        uv_timer_t timer;
        unsigned interval_ms;
        bool closing;
};

tsr_status worker_dns_parse(const char *spec, char *name, size_t name_len, int *port, char *err, size_t errlen) {
        const char *colon = spec ? strrchr(spec, ':') : NULL;
        char *end = NULL;
        long p;

        if (!spec || !colon || colon == spec || strstr(spec, "://") || (size_t)(colon - spec) >= name_len) {
                tsr_errf(err, errlen, "--worker-dns %s: expected NAME:PORT (a DNS name and the workers' port)",
                         spec ? spec : "(null)");
                return TSR_E_INVAL;
        }
        p = strtol(colon + 1, &end, 10);
        if (end == colon + 1 || *end != '\0' || p < 1 || p > 65535) {
                tsr_errf(err, errlen, "--worker-dns %s: the port must be a number in 1..65535", spec);
                return TSR_E_INVAL;
        }
        memcpy(name, spec, (size_t)(colon - spec));
        name[colon - spec] = '\0';
        *port = (int)p;
        return TSR_OK;
}

/* The pool already has a worker at this endpoint (from --worker or an earlier answer). */
static bool pool_has(worker_pool *pool, const char *endpoint) {
        for (size_t i = 0; i < worker_pool_count(pool); i++)
                if (strcmp(tsr_worker_endpoint(worker_pool_get(pool, i)), endpoint) == 0)
                        return true;
        return false;
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
        dns_name *n = req->data;
        worker_dns *d = n->owner;
        size_t count = 0;

        n->busy = false;
        if (d->closing || status == UV_ECANCELED) {
                uv_freeaddrinfo(res);
                return;
        }
        if (status != 0) {
                if (!n->failing)
                        log_warn("--worker-dns %s:%d: lookup failed: %s (retrying every %u ms)", n->name, n->port,
                                 uv_strerror(status), d->interval_ms);
                n->failing = true;
                uv_freeaddrinfo(res);
                return;
        }
        if (n->failing)
                log_info("--worker-dns %s:%d: lookup works again", n->name, n->port);
        n->failing = false;
        for (struct addrinfo *a = res; a; a = a->ai_next) {
                char ip[INET_ADDRSTRLEN], endpoint[INET_ADDRSTRLEN + 32];
                if (a->ai_family != AF_INET)
                        continue;
                if (!inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof(ip)))
                        continue;
                count++;
                snprintf(endpoint, sizeof(endpoint), "tcp://%s:%d", ip, n->port);
                if (pool_has(d->pool, endpoint))
                        continue;
                if (worker_pool_add(d->pool, endpoint) == TSR_OK)
                        log_info("--worker-dns %s:%d: new worker %s", n->name, n->port, endpoint);
                else
                        log_warn("--worker-dns %s:%d: cannot add worker %s", n->name, n->port, endpoint);
        }
        if (count != n->n_last)
                log_info("--worker-dns %s:%d: %zu address(es)", n->name, n->port, count);
        n->n_last = count;
        uv_freeaddrinfo(res);
}

static void resolve_all(uv_timer_t *t) {
        worker_dns *d = t->data;
        struct addrinfo hints;

        memset(&hints, 0, sizeof(hints));
        hints.ai_family = AF_INET;
        hints.ai_socktype = SOCK_STREAM;
        for (size_t i = 0; i < d->n_names; i++) {
                dns_name *n = &d->names[i];
                if (n->busy)            /* a slow resolver: do not stack lookups */
                        continue;
                n->req.data = n;
                if (uv_getaddrinfo(d->loop, &n->req, on_resolved, n->name, NULL, &hints) == 0)
                        n->busy = true;
        }
}

tsr_status worker_dns_start(uv_loop_t *loop, worker_pool *pool, const char *const *specs, size_t n_specs,
                            unsigned interval_ms, worker_dns **out, char *err, size_t errlen) {
        worker_dns *d = calloc(1, sizeof(*d));
        *out = NULL;
        if (!d || !(d->names = calloc(n_specs ? n_specs : 1, sizeof(*d->names)))) {
                free(d);
                tsr_errf(err, errlen, "out of memory");
                return TSR_E_NOMEM;
        }
        for (size_t i = 0; i < n_specs; i++) {
                dns_name *n = &d->names[i];
                if (worker_dns_parse(specs[i], n->name, sizeof(n->name), &n->port, err, errlen) != TSR_OK) {
                        free(d->names);
                        free(d);
                        return TSR_E_INVAL;
                }
                n->owner = d;
        }
        d->n_names = n_specs;
        d->loop = loop;
        d->pool = pool;
        d->interval_ms = interval_ms;
        uv_timer_init(loop, &d->timer);
        d->timer.data = d;
        uv_timer_start(&d->timer, resolve_all, 0, interval_ms);
        *out = d;
        return TSR_OK;
}

void worker_dns_close(worker_dns *d) {
        if (!d || d->closing)
                return;
        d->closing = true;
        uv_timer_stop(&d->timer);
        uv_close((uv_handle_t *)&d->timer, NULL);
        /* A lookup already running on the thread pool cannot be cancelled; its callback
         * still comes (the loop waits for it) and finds `closing` set. */
        for (size_t i = 0; i < d->n_names; i++)
                if (d->names[i].busy)
                        uv_cancel((uv_req_t *)&d->names[i].req);
}

void worker_dns_free(worker_dns **dp) {
        if (!dp || !*dp)
                return;
        free((*dp)->names);
        free(*dp);
        *dp = NULL;
}
