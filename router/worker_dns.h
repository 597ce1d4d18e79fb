/* worker_dns.h - workers discovered from DNS names (--worker-dns NAME:PORT).
 *
 * A Kubernetes headless Service answers a DNS query for its name with the address of
 * every ready pod behind it; routers follow scale-ups and pod replacements by asking
 * again every few seconds.  Each address not yet in the pool is added as the worker
 * spec "tcp://ADDR:PORT" (its Status on PORT+1, as for --worker).
 *
 * An address that the name's answer has lacked TSR_WORKER_DNS_GONE_ANSWERS times in a
 * row is retired (tsr_worker_pool_retire): no new requests go there, and the pool removes
 * it, with its prefix-cache mirror and its /metrics series, once none of this router's
 * requests runs there.  If it comes back before that it is simply taken again; after,
 * it is added as a new worker.  "No such name" and "no address" count as an empty
 * answer; other lookup failures (a resolver that times out) count as no answer and
 * retire nothing.  Only addresses this module added are ever retired: one the pool had
 * already (a --worker) is never touched.
 *
 * Loop thread only.  The lookups run on the libuv thread pool (uv_getaddrinfo), never
 * on the loop.  IPv4 only: the ZeroMQ sockets are not opened with ZMQ_IPV6. */
#ifndef TSR_ROUTER_WORKER_DNS_H
#define TSR_ROUTER_WORKER_DNS_H

#include <stddef.h>
#include <uv.h>

#include "common/tsr_status.h"
#include "worker_link.h"

#define TSR_WORKER_DNS_INTERVAL_MS 5000
/* Answers in a row without an address before its worker is retired: 10 to 15 s at the
 * 5 s interval.  One answer is not enough: a pod that fails one readiness probe leaves
 * a headless Service's answer for a few seconds and returns, and dropping it would cost
 * its prefix-cache affinity (the mirror starts over from a snapshot).  Keeping a gone
 * address longer costs little (its sockets reconnect quietly and it gets no requests
 * once not live), so err long, but not minutes: Kubernetes reuses pod IPs. */
#define TSR_WORKER_DNS_GONE_ANSWERS 3u

typedef struct tsr_worker_dns tsr_worker_dns;

/* Split "NAME:PORT" (the port after the last colon, 1..65535; NAME non-empty, no
 * scheme).  TSR_E_INVAL with a message in err otherwise. */
tsr_status tsr_worker_dns_parse(const char *spec, char *name, size_t name_len, int *port, char *err, size_t errlen);

/* Start resolving every spec now and every interval_ms after (0: never; tests feed
 * answers through tsr_worker_dns_apply instead).  The pool must outlive
 * tsr_worker_dns_close's completion. */
tsr_status tsr_worker_dns_start(uv_loop_t *loop, tsr_worker_pool *pool, const char *const *specs, size_t n_specs,
                            unsigned interval_ms, tsr_worker_dns **out, char *err, size_t errlen);
/* Loop thread.  One answer for spec `name_idx` (its order in `specs`): the endpoints
 * "tcp://A.B.C.D:PORT" it lists, n may be 0.  Adds the new ones, takes back retired
 * ones it lists again, counts the absence of the rest and retires those absent
 * TSR_WORKER_DNS_GONE_ANSWERS times in a row.  The lookup callback calls it; exposed
 * for tests. */
void tsr_worker_dns_apply(tsr_worker_dns *d, size_t name_idx, const char *const *endpoints, size_t n);
/* Stop: the timer closes and lookups in flight are cancelled or ignored.  The loop
 * keeps running until they are done; free afterwards.  Accepts NULL. */
void tsr_worker_dns_close(tsr_worker_dns *d);
/* After the loop has finished with it.  Accepts NULL; clears *d. */
void tsr_worker_dns_free(tsr_worker_dns **d);

#endif
