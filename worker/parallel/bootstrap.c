/* bootstrap.c - the rendezvous of a multi-node group (bootstrap.h). */
#include "worker/parallel/bootstrap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/wire.h"
#include "worker/parallel/comm.h"

#define MAX_HELLO_BYTES (64u << 10)
#define ID_BYTES 256

/* One node as node 0 heard it. */
typedef struct heard {
        bool present;
        unsigned char id[ID_BYTES];     /* the DEALER's routing id */
        size_t id_len;
        uint64_t nonce;
        char *hostname, *endpoint;
} heard;

static tsr_status failf(tsr_status st, char *err, size_t errlen, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static tsr_status failf(tsr_status st, char *err, size_t errlen, const char *fmt, ...) {
        if (err && errlen) {
                va_list ap;
                va_start(ap, fmt);
                vsnprintf(err, errlen, fmt, ap);
                va_end(ap);
        }
        return st;
}

/* "tcp://IP:PORT" for host:port, IPv6 in brackets (*ipv6 set: the socket needs ZMQ_IPV6). */
static tsr_status resolve(const char *host, uint16_t port, char *ep, size_t len, bool *ipv6, char *err,
                          size_t errlen) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
        char ip[INET6_ADDRSTRLEN];
        int rc = getaddrinfo(host, NULL, &hints, &res);
        if (rc != 0 || !res)
                return failf(TSR_E_IO, err, errlen, "--master-addr %s: %s", host, gai_strerror(rc));
        const void *a = res->ai_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)res->ai_addr)->sin6_addr
                                                   : (const void *)&((struct sockaddr_in *)res->ai_addr)->sin_addr;
        *ipv6 = res->ai_family == AF_INET6;
        inet_ntop(res->ai_family, a, ip, sizeof(ip));
        freeaddrinfo(res);
        if ((size_t)snprintf(ep, len, *ipv6 ? "tcp://[%s]:%u" : "tcp://%s:%u", ip, port) >= len)
                return failf(TSR_E_LIMIT, err, errlen, "--master-addr %s: endpoint too long", host);
        return TSR_OK;
}

tsr_status tsr_bootstrap_local_addr(const char *host, uint16_t port, char *buf, size_t len, char *err,
                                    size_t errlen) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM}, *res = NULL;
        struct sockaddr_storage me;
        socklen_t me_len = sizeof(me);
        char service[8], ip[INET6_ADDRSTRLEN];
        snprintf(service, sizeof(service), "%u", port);
        int rc = getaddrinfo(host, service, &hints, &res);
        if (rc != 0 || !res)
                return failf(TSR_E_IO, err, errlen, "--master-addr %s: %s", host, gai_strerror(rc));
        int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  getsockname(fd, (struct sockaddr *)&me, &me_len) == 0;
        int family = res->ai_family;
        freeaddrinfo(res);
        if (fd >= 0)
                close(fd);
        if (!ok)
                return failf(TSR_E_IO, err, errlen, "no route to --master-addr %s", host);
        const void *a = family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&me)->sin6_addr
                                           : (const void *)&((struct sockaddr_in *)&me)->sin_addr;
        inet_ntop(family, a, ip, sizeof(ip));
        if ((size_t)snprintf(buf, len, family == AF_INET6 ? "[%s]" : "%s", ip) >= len)
                return failf(TSR_E_LIMIT, err, errlen, "local address too long");
        return TSR_OK;
}

static void set_int(void *s, int opt, int v) { zmq_setsockopt(s, opt, &v, sizeof(v)); }

static char *host_name(void) {
        char h[256] = "";
        if (gethostname(h, sizeof(h) - 1) != 0)
                strcpy(h, "?");
        return strdup(h);
}

static tsr_status send_env(void *sock, const unsigned char *id, size_t id_len, tsr_envelope *env) {
        uint8_t *buf;
        size_t len;
        tsr_status st = tsr_wire_pack(env, &buf, &len);
        if (st != TSR_OK)
                return st;
        int rc = (id && zmq_send(sock, id, id_len, ZMQ_SNDMORE) < 0) ? -1 : zmq_send(sock, buf, len, 0);
        free(buf);
        return rc < 0 ? TSR_E_IO : TSR_OK;
}

/* The first line of two "key=value" lists that differs, for an error that names the
 * field ("max-model-len: 4096 here, 8192 on node 2"). */
static void first_difference(const char *ours, const char *theirs, char *out, size_t len) {
        const char *a = ours, *b = theirs;
        while (*a || *b) {
                size_t la = strcspn(a, "\n"), lb = strcspn(b, "\n");
                if (la != lb || memcmp(a, b, la) != 0) {
                        snprintf(out, len, "'%.*s' on node 0, '%.*s' there", (int)la, a, (int)lb, b);
                        return;
                }
                a += la + (a[la] == '\n');
                b += lb + (b[lb] == '\n');
        }
        snprintf(out, len, "(no difference)");
}

/* The next frame on `sock` as an Envelope carrying message `want`; NULL (logged) when it
 * is not one.  Both sides' sockets are capped at MAX_HELLO_BYTES. */
static tsr_envelope *take_frame(void *sock, int want, const char *what) {
        zmq_msg_t body;
        tsr_envelope *env = NULL;
        char why[256];
        zmq_msg_init(&body);
        if (zmq_msg_recv(&body, sock, 0) < 0) {
                zmq_msg_close(&body);
                return NULL;
        }
        tsr_status st = tsr_wire_unpack(zmq_msg_data(&body), zmq_msg_size(&body), MAX_HELLO_BYTES, &env, why,
                                        sizeof(why));
        zmq_msg_close(&body);
        if (st != TSR_OK || (int)env->msg_case != want) {
                log_warn("rendezvous: dropped a frame that is not %s (%s)", what,
                         st != TSR_OK ? why : tsr_wire_msg_name(env));
                tsr_wire_free(env);
                return NULL;
        }
        return env;
}

static tsr_status wait_readable(void *sock, uint64_t deadline_ms, const _Atomic bool *cancel) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        for (;;) {
                uint64_t now = tsr_now_ms();
                if (cancel && atomic_load(cancel))
                        return TSR_E_CANCELLED;
                if (now >= deadline_ms)
                        return TSR_E_TIMEOUT;
                long wait = (long)(deadline_ms - now);
                int rc = zmq_poll(&it, 1, wait > 500 ? 500 : wait);
                if (rc > 0)
                        return TSR_OK;
                if (rc < 0 && zmq_errno() != EINTR)
                        return TSR_E_IO;
        }
}

static tsr_status group_alloc(tsr_bootstrap_group *g, uint32_t n) {
        memset(g, 0, sizeof(*g));
        g->nnodes = n;
        g->endpoints = calloc(n, sizeof(char *));
        g->hostnames = calloc(n, sizeof(char *));
        return g->endpoints && g->hostnames ? TSR_OK : TSR_E_NOMEM;
}

void tsr_bootstrap_group_free(tsr_bootstrap_group *g) {
        if (!g)
                return;
        for (uint32_t i = 0; i < g->nnodes; i++) {
                if (g->endpoints)
                        free(g->endpoints[i]);
                if (g->hostnames)
                        free(g->hostnames[i]);
        }
        free(g->endpoints);
        free(g->hostnames);
        memset(g, 0, sizeof(*g));
}

/* Node 0: hear every other rank, check agreement, answer each. */
static tsr_status run_leader(void *sock, const tsr_bootstrap_cfg *cfg, tsr_bootstrap_group *out, char *err,
                             size_t errlen) {
        heard *h = calloc(cfg->nnodes, sizeof(*h));
        uint64_t deadline = tsr_now_ms() + cfg->timeout_ms;
        uint32_t missing = cfg->nnodes - 1;
        tsr_status st = h ? TSR_OK : TSR_E_NOMEM;
        char why[1024] = "";

        while (st == TSR_OK && missing > 0 && !why[0]) {
                if ((st = wait_readable(sock, deadline, cfg->cancel)) != TSR_OK)
                        break;
                unsigned char id[ID_BYTES];
                int id_len = zmq_recv(sock, id, sizeof(id), 0), more = 0;
                size_t more_len = sizeof(more);
                zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &more_len);
                if (id_len <= 0 || id_len > ID_BYTES || !more)
                        continue;
                tsr_envelope *env = take_frame(sock, TESSERA__V1__ENVELOPE__MSG_NODE_HELLO, "a NodeHello");
                if (!env)
                        continue;
                const Tessera__V1__NodeHello *m = env->node_hello;
                const char *host = m->hostname[0] ? m->hostname : "?";
                char diff[600];
                if (m->nnodes != cfg->nnodes)
                        snprintf(why, sizeof(why), "node rank %u (host %s) says --nnodes %u, node 0 says %u",
                                 m->node_rank, host, m->nnodes, cfg->nnodes);
                else if (m->node_rank == 0)
                        snprintf(why, sizeof(why), "a second node (host %s) says --node-rank 0", host);
                else if (strcmp(m->tessera_version, TSR_VERSION) != 0)
                        snprintf(why, sizeof(why), "node rank %u (host %s) runs tessera %s, node 0 runs %s",
                                 m->node_rank, host, m->tessera_version, TSR_VERSION);
                else if (strcmp(m->purpose, cfg->purpose) != 0)
                        snprintf(why, sizeof(why), "node rank %u (host %s) joined for '%s', node 0 is running '%s'",
                                 m->node_rank, host, m->purpose, cfg->purpose);
                else if (strcmp(m->fingerprint, cfg->fingerprint ? cfg->fingerprint : "") != 0) {
                        first_difference(cfg->fingerprint ? cfg->fingerprint : "", m->fingerprint, diff, sizeof(diff));
                        snprintf(why, sizeof(why), "node rank %u (host %s) has another configuration: %s",
                                 m->node_rank, host, diff);
                } else if (h[m->node_rank].present && h[m->node_rank].nonce != m->nonce &&
                           strcmp(h[m->node_rank].hostname, host) != 0)
                        snprintf(why, sizeof(why), "two nodes say --node-rank %u (hosts %s and %s)", m->node_rank,
                                 h[m->node_rank].hostname, host);
                if (!why[0]) {
                        heard *e = &h[m->node_rank];
                        if (e->present)     /* the same host again: a restarted process replaces the old one */
                                log_info("rendezvous: node rank %u (host %s) said hello again", m->node_rank, host);
                        else if (missing-- == cfg->nnodes - 1 && cfg->on_first_hello)
                                cfg->on_first_hello(cfg->ud);
                        free(e->hostname);
                        free(e->endpoint);
                        e->present = true;
                        memcpy(e->id, id, (size_t)id_len);
                        e->id_len = (size_t)id_len;
                        e->nonce = m->nonce;
                        e->hostname = strdup(host);
                        e->endpoint = strdup(m->data_endpoint);
                        if (!e->hostname || !e->endpoint)
                                st = TSR_E_NOMEM;
                        else
                                log_info("rendezvous: node rank %u of %u joined from host %s (data endpoint %s)",
                                         m->node_rank, cfg->nnodes, host, e->endpoint);
                } else {        /* the node that disagreed hears why, too */
                        Tessera__V1__NodeSetup ns = TESSERA__V1__NODE_SETUP__INIT;
                        tsr_envelope reply = TESSERA__V1__ENVELOPE__INIT;
                        ns.error = why;
                        reply.msg_case = TESSERA__V1__ENVELOPE__MSG_NODE_SETUP;
                        reply.node_setup = &ns;
                        send_env(sock, id, (size_t)id_len, &reply);
                }
                tsr_wire_free(env);
        }
        if (st == TSR_E_TIMEOUT) {
                char list[512] = "";
                size_t off = 0;
                for (uint32_t r = 1; r < cfg->nnodes && off < sizeof(list); r++)
                        if (!h[r].present)
                                off += (size_t)snprintf(list + off, sizeof(list) - off, "%s%u", off ? ", " : "", r);
                failf(st, err, errlen,
                      "node rank%s %s did not join within %u ms (each must run with --nnodes %u --master-addr %s "
                      "--master-port %u and reach this node: check the address, the port and any firewall)",
                      missing > 1 ? "s" : "", list, cfg->timeout_ms, cfg->nnodes, cfg->master_addr, cfg->master_port);
        }
        /* Answer everyone heard so far: the group, or why there is none. */
        Tessera__V1__NodeSetup ns = TESSERA__V1__NODE_SETUP__INIT;
        tsr_envelope reply = TESSERA__V1__ENVELOPE__INIT;
        reply.msg_case = TESSERA__V1__ENVELOPE__MSG_NODE_SETUP;
        reply.node_setup = &ns;
        if (st == TSR_OK && why[0]) {
                st = TSR_E_PROTO;
                failf(st, err, errlen, "%s", why);
        }
        if (st == TSR_OK)
                st = group_alloc(out, cfg->nnodes);
        if (st == TSR_OK) {
                uint64_t epoch = 0;
                while (epoch == 0 && getrandom(&epoch, sizeof(epoch), 0) != (ssize_t)sizeof(epoch))
                        epoch = tsr_wall_ns();
                out->epoch = epoch;
                out->endpoints[0] = strdup(cfg->data_endpoint);
                out->hostnames[0] = host_name();
                for (uint32_t r = 1; r < cfg->nnodes; r++) {
                        out->endpoints[r] = strdup(h[r].endpoint);
                        out->hostnames[r] = strdup(h[r].hostname);
                }
                for (uint32_t r = 0; r < cfg->nnodes; r++)
                        if (!out->endpoints[r] || !out->hostnames[r])
                                st = TSR_E_NOMEM;
                ns.epoch = out->epoch;
                ns.n_data_endpoints = ns.n_hostnames = cfg->nnodes;
                ns.data_endpoints = out->endpoints;
                ns.hostnames = out->hostnames;
        }
        if (st != TSR_OK) {
                ns.error = err && err[0] ? err : (char *)tsr_status_str(st);
                ns.n_data_endpoints = ns.n_hostnames = 0;
        }
        for (uint32_t r = 1; h && r < cfg->nnodes; r++)
                if (h[r].present)
                        send_env(sock, h[r].id, h[r].id_len, &reply);
        for (uint32_t r = 0; h && r < cfg->nnodes; r++) {
                free(h[r].hostname);
                free(h[r].endpoint);
        }
        free(h);
        if (st != TSR_OK)
                tsr_bootstrap_group_free(out);
        return st;
}

/* Node r > 0: say hello to node 0, wait for the group. */
static tsr_status run_follower(void *sock, const tsr_bootstrap_cfg *cfg, const char *master_ep,
                               tsr_bootstrap_group *out, char *err, size_t errlen) {
        Tessera__V1__NodeHello hello = TESSERA__V1__NODE_HELLO__INIT;
        tsr_envelope env = TESSERA__V1__ENVELOPE__INIT;
        char *host = host_name();
        uint64_t nonce = 0;
        if (getrandom(&nonce, sizeof(nonce), 0) != (ssize_t)sizeof(nonce))
                nonce = tsr_wall_ns() ^ (uint64_t)getpid();
        hello.nnodes = cfg->nnodes;
        hello.node_rank = cfg->node_rank;
        hello.tessera_version = (char *)TSR_VERSION;
        hello.purpose = (char *)cfg->purpose;
        hello.fingerprint = (char *)(cfg->fingerprint ? cfg->fingerprint : "");
        hello.data_endpoint = (char *)cfg->data_endpoint;
        hello.nonce = nonce;
        hello.hostname = host ? host : (char *)"?";
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_NODE_HELLO;
        env.node_hello = &hello;
        tsr_status st = send_env(sock, NULL, 0, &env);
        free(host);
        if (st != TSR_OK)
                return failf(st, err, errlen, "rendezvous: cannot send to %s", master_ep);
        /* A grace past the timeout: nodes started at about the same time as node 0 then
         * hear its reason when it gives up on a node that never came. */
        uint64_t deadline = tsr_now_ms() + cfg->timeout_ms + TSR_BOOTSTRAP_FOLLOWER_GRACE_MS;
        for (;;) {
                if ((st = wait_readable(sock, deadline, cfg->cancel)) == TSR_E_CANCELLED)
                        return failf(st, err, errlen, "rendezvous: cancelled");
                if (st != TSR_OK)
                        return failf(st, err, errlen,
                                     "no answer from node 0 at %s within %u ms (is node 0 running with --nnodes %u, "
                                     "is --master-addr/--master-port right, is the port open?)",
                                     master_ep, cfg->timeout_ms + TSR_BOOTSTRAP_FOLLOWER_GRACE_MS, cfg->nnodes);
                tsr_envelope *r = take_frame(sock, TESSERA__V1__ENVELOPE__MSG_NODE_SETUP, "a NodeSetup from node 0");
                if (!r)
                        continue;
                const Tessera__V1__NodeSetup *ns = r->node_setup;
                if (ns->error[0])
                        st = failf(TSR_E_PROTO, err, errlen, "node 0 refused the group: %s", ns->error);
                else if (ns->n_data_endpoints != cfg->nnodes)
                        st = failf(TSR_E_PROTO, err, errlen, "node 0 sent %zu endpoints for %u nodes",
                                   ns->n_data_endpoints, cfg->nnodes);
                else if ((st = group_alloc(out, cfg->nnodes)) == TSR_OK) {
                        out->epoch = ns->epoch;
                        for (uint32_t q = 0; q < cfg->nnodes; q++) {
                                out->endpoints[q] = strdup(ns->data_endpoints[q]);
                                out->hostnames[q] = strdup(ns->hostnames[q]);
                                if (!out->endpoints[q] || !out->hostnames[q])
                                        st = TSR_E_NOMEM;
                        }
                        if (st != TSR_OK)
                                tsr_bootstrap_group_free(out);
                }
                tsr_wire_free(r);
                return st;
        }
}

tsr_status tsr_bootstrap_rendezvous(const tsr_bootstrap_cfg *cfg, tsr_bootstrap_group *out, char *err,
                                    size_t errlen) {
        char master_ep[300];
        bool ipv6 = false;
        tsr_status st;

        if (!cfg || !out || cfg->nnodes < 2 || cfg->nnodes > TSR_COMM_MAX_RANKS || cfg->node_rank >= cfg->nnodes ||
            !cfg->master_addr || !cfg->master_port || !cfg->purpose || !cfg->data_endpoint || !cfg->timeout_ms)
                return failf(TSR_E_INVAL, err, errlen, "rendezvous: bad configuration");
        memset(out, 0, sizeof(*out));
        if ((st = resolve(cfg->master_addr, cfg->master_port, master_ep, sizeof(master_ep), &ipv6, err, errlen)) !=
            TSR_OK)
                return st;
        void *ctx = zmq_ctx_new();
        void *sock = ctx ? zmq_socket(ctx, cfg->node_rank == 0 ? ZMQ_ROUTER : ZMQ_DEALER) : NULL;
        if (!sock) {
                if (ctx)
                        zmq_ctx_term(ctx);
                return failf(TSR_E_IO, err, errlen, "rendezvous: zmq: %s", zmq_strerror(zmq_errno()));
        }
        int64_t maxmsg = MAX_HELLO_BYTES;
        zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
        set_int(sock, ZMQ_IPV6, ipv6);
        /* The answers must leave before the socket closes; a peer that is gone must not
         * keep this process waiting. */
        set_int(sock, ZMQ_LINGER, 2000);
        if (cfg->node_rank == 0) {
                if (zmq_bind(sock, master_ep) != 0)
                        st = failf(TSR_E_IO, err, errlen,
                                   "node 0 cannot listen on %s (--master-addr must be an address of this node; "
                                   "--master-port free): %s",
                                   master_ep, zmq_strerror(zmq_errno()));
                else
                        st = run_leader(sock, cfg, out, err, errlen);
        } else {
                set_int(sock, ZMQ_RECONNECT_IVL, 100);
                set_int(sock, ZMQ_RECONNECT_IVL_MAX, 2000);
                if (zmq_connect(sock, master_ep) != 0)
                        st = failf(TSR_E_IO, err, errlen, "rendezvous: connect %s: %s", master_ep,
                                   zmq_strerror(zmq_errno()));
                else
                        st = run_follower(sock, cfg, master_ep, out, err, errlen);
        }
        if (st != TSR_OK && cfg->node_rank != 0)   /* node 0's refusals must still leave */
                set_int(sock, ZMQ_LINGER, 0);
        zmq_close(sock);
        zmq_ctx_term(ctx);
        return st;
}
