/* worker_dns.h - workers discovered from DNS names (--worker-dns NAME:PORT).
 *
 * A Kubernetes headless Service answers a DNS query for its name with the address of
 * every ready pod behind it; routers follow scale-ups and pod replacements by asking
 * again every few seconds.  Each address not yet in the pool is added as the worker
 * spec "tcp://ADDR:PORT" (its Status on PORT+1, as for --worker).  An address that
 * drops out of the answer stays in the pool: its worker stops sending Status, goes
 * not-live within 3 status intervals and gets no new requests (and comes back if the
 * address does).
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

typedef struct worker_dns worker_dns;

/* Split "NAME:PORT" (the port after the last colon, 1..65535; NAME non-empty, no
 * scheme).  TSR_E_INVAL with a message in err otherwise. */
tsr_status worker_dns_parse(const char *spec, char *name, size_t name_len, int *port, char *err, size_t errlen);

/* Start resolving every spec now and every interval_ms after.  The pool must outlive
 * worker_dns_close's completion. */
tsr_status worker_dns_start(uv_loop_t *loop, worker_pool *pool, const char *const *specs, size_t n_specs,
                            unsigned interval_ms, worker_dns **out, char *err, size_t errlen);
/* Stop: the timer closes and lookups in flight are cancelled or ignored.  The loop
 * keeps running until they are done; free afterwards.  Accepts NULL. */
void worker_dns_close(worker_dns *d);
/* After the loop has finished with it.  Accepts NULL; clears *d. */
void worker_dns_free(worker_dns **d);

#endif
