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
        tsr_worker_dns *owner;
        char name[256];
        int port;
        uv_getaddrinfo_t req;
        bool busy;                   /* a lookup is in flight: req is in use */
        bool failing;                /* the last lookup failed (log state changes only) */
        size_t n_last;               /* addresses in the last answer */
} dns_name;

/* A worker this module put in the pool, tracked until the pool has removed it.  An
 * endpoint the pool already had (a --worker, or another name's) is never ours, so a
 * --worker is never retired by a DNS answer. */
typedef struct dns_addr {
        char endpoint[INET_ADDRSTRLEN + 16];   /* "tcp://A.B.C.D:PORT" */
        size_t owner;                /* the name whose answers can retire it */
        unsigned absent;             /* the owner's answers in a row without it */
        bool seen;                   /* scratch for tsr_worker_dns_apply: in this answer */
} dns_addr;

struct tsr_worker_dns {
        uv_loop_t *loop;
        tsr_worker_pool *pool;
        dns_name *names;
        size_t n_names;
        dns_addr *addrs;
        size_t n_addrs, cap_addrs;
        uv_timer_t timer;
        unsigned interval_ms;
        bool timer_init;
        bool closing;
};

tsr_status tsr_worker_dns_parse(const char *spec, char *name, size_t name_len, int *port, char *err, size_t errlen) {
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

static dns_addr *find_addr(tsr_worker_dns *d, const char *endpoint) {
        for (size_t i = 0; i < d->n_addrs; i++)
                if (strcmp(d->addrs[i].endpoint, endpoint) == 0)
                        return &d->addrs[i];
        return NULL;
}

/* Add `endpoint` to the pool and track it as ours.  false: not added (logged). */
static bool add_worker(tsr_worker_dns *d, size_t name_idx, const char *endpoint) {
        const dns_name *n = &d->names[name_idx];
        dns_addr *a = find_addr(d, endpoint);

        if (!a && d->n_addrs == d->cap_addrs) {
                size_t cap = d->cap_addrs ? d->cap_addrs * 2 : 8;
                dns_addr *grown = realloc(d->addrs, cap * sizeof(*grown));
                if (!grown) {
                        log_warn("--worker-dns %s:%d: cannot add worker %s: out of memory", n->name, n->port, endpoint);
                        return false;
                }
                d->addrs = grown;
                d->cap_addrs = cap;
        }
        if (strlen(endpoint) >= sizeof(a->endpoint) || tsr_worker_pool_add(d->pool, endpoint) != TSR_OK) {
                log_warn("--worker-dns %s:%d: cannot add worker %s", n->name, n->port, endpoint);
                return false;
        }
        if (!a) {
                a = &d->addrs[d->n_addrs++];
                snprintf(a->endpoint, sizeof(a->endpoint), "%s", endpoint);
                a->owner = name_idx;
        }
        a->absent = 0;
        a->seen = true;
        log_info("--worker-dns %s:%d: new worker %s", n->name, n->port, endpoint);
        return true;
}

void tsr_worker_dns_apply(tsr_worker_dns *d, size_t name_idx, const char *const *endpoints, size_t n) {
        const dns_name *nm = &d->names[name_idx];

        for (size_t k = 0; k < d->n_addrs; k++)
                d->addrs[k].seen = false;
        for (size_t i = 0; i < n; i++) {
                dns_addr *a = find_addr(d, endpoints[i]);
                tsr_worker *w = tsr_worker_pool_find(d->pool, endpoints[i]);
                if (!a) {
                        if (!w)   /* else a --worker or another name's: not ours */
                                add_worker(d, name_idx, endpoints[i]);
                        continue;
                }
                /* Any name listing it keeps it, whichever name added it. */
                a->seen = true;
                if (a->absent >= TSR_WORKER_DNS_GONE_ANSWERS && w)
                        log_info("--worker-dns %s:%d: %s is back in the answer", nm->name, nm->port, a->endpoint);
                a->absent = 0;
                if (w)
                        tsr_worker_pool_unretire(d->pool, w);
                else
                        add_worker(d, name_idx, endpoints[i]);   /* removed since: a new worker */
        }
        for (size_t k = d->n_addrs; k-- > 0;) {
                dns_addr *a = &d->addrs[k];
                tsr_worker *w;
                if (a->owner != name_idx || a->seen)
                        continue;
                w = tsr_worker_pool_find(d->pool, a->endpoint);
                if (!w) {   /* the pool removed it (retired, then idle): forget it */
                        d->addrs[k] = d->addrs[--d->n_addrs];
                        continue;
                }
                if (++a->absent == TSR_WORKER_DNS_GONE_ANSWERS) {
                        log_info("--worker-dns %s:%d: %s missing from %u answers in a row: retiring it", nm->name,
                                 nm->port, a->endpoint, a->absent);
                        tsr_worker_pool_retire(d->pool, w);
                }
        }
}

/* Threadpool lookup done; loop thread. */
static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
        dns_name *n = req->data;
        tsr_worker_dns *d = n->owner;
        char (*eps)[INET_ADDRSTRLEN + 16] = NULL;
        const char **list = NULL;
        size_t count = 0, cap = 0;

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
                /* "No such name" and "no address" are answers: the name has no workers now
                 * (a headless Service scaled to zero).  Any other failure says nothing
                 * about the workers, so it retires none. */
                if (status == UV_EAI_NONAME || status == UV_EAI_NODATA) {
                        if (n->n_last)
                                log_info("--worker-dns %s:%d: 0 address(es)", n->name, n->port);
                        n->n_last = 0;
                        tsr_worker_dns_apply(d, (size_t)(n - d->names), NULL, 0);
                }
                return;
        }
        if (n->failing)
                log_info("--worker-dns %s:%d: lookup works again", n->name, n->port);
        n->failing = false;
        for (struct addrinfo *a = res; a; a = a->ai_next)
                cap += a->ai_family == AF_INET;
        eps = calloc(cap ? cap : 1, sizeof(*eps));
        list = calloc(cap ? cap : 1, sizeof(*list));
        if (!eps || !list) {   /* skip this round; the next one retries */
                free(eps);
                free(list);
                uv_freeaddrinfo(res);
                return;
        }
        for (struct addrinfo *a = res; a && count < cap; a = a->ai_next) {
                char ip[INET_ADDRSTRLEN];
                if (a->ai_family != AF_INET)
                        continue;
                if (!inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof(ip)))
                        continue;
                snprintf(eps[count], sizeof(eps[count]), "tcp://%s:%d", ip, n->port);
                list[count] = eps[count];
                count++;
        }
        uv_freeaddrinfo(res);
        if (count != n->n_last)
                log_info("--worker-dns %s:%d: %zu address(es)", n->name, n->port, count);
        n->n_last = count;
        tsr_worker_dns_apply(d, (size_t)(n - d->names), list, count);
        free(eps);
        free(list);
}

static void resolve_all(uv_timer_t *t) {
        tsr_worker_dns *d = t->data;
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

tsr_status tsr_worker_dns_start(uv_loop_t *loop, tsr_worker_pool *pool, const char *const *specs, size_t n_specs,
                            unsigned interval_ms, tsr_worker_dns **out, char *err, size_t errlen) {
        tsr_worker_dns *d = calloc(1, sizeof(*d));
        *out = NULL;
        if (!d || !(d->names = calloc(n_specs ? n_specs : 1, sizeof(*d->names)))) {
                free(d);
                tsr_errf(err, errlen, "out of memory");
                return TSR_E_NOMEM;
        }
        for (size_t i = 0; i < n_specs; i++) {
                dns_name *n = &d->names[i];
                if (tsr_worker_dns_parse(specs[i], n->name, sizeof(n->name), &n->port, err, errlen) != TSR_OK) {
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
        if (interval_ms) {
                uv_timer_init(loop, &d->timer);
                d->timer.data = d;
                uv_timer_start(&d->timer, resolve_all, 0, interval_ms);
                d->timer_init = true;
        }
        *out = d;
        return TSR_OK;
}

void tsr_worker_dns_close(tsr_worker_dns *d) {
        if (!d || d->closing)
                return;
        d->closing = true;
        if (d->timer_init) {
                uv_timer_stop(&d->timer);
                uv_close((uv_handle_t *)&d->timer, NULL);
        }
        /* A lookup already running on the thread pool cannot be cancelled; its callback
         * still comes (the loop waits for it) and finds `closing` set. */
        for (size_t i = 0; i < d->n_names; i++)
                if (d->names[i].busy)
                        uv_cancel((uv_req_t *)&d->names[i].req);
}

void tsr_worker_dns_free(tsr_worker_dns **dp) {
        if (!dp || !*dp)
                return;
        free((*dp)->names);
        free((*dp)->addrs);
        free(*dp);
        *dp = NULL;
}
