/* endpoint.h - ZeroMQ endpoint helpers shared by router and worker.  No state. */
#ifndef TSR_ENDPOINT_H
#define TSR_ENDPOINT_H

#include <stddef.h>
#include "tsr_status.h"

/* A worker publishes Status next to its request socket by default:
 * "tcp://HOST:PORT" -> "tcp://HOST:(PORT+1)" written to out.  TSR_E_INVAL when `ep`
 * is not tcp:// with a numeric port below 65535, TSR_E_LIMIT when out is too small. */
tsr_status tsr_endpoint_status_default(const char *ep, char *out, size_t outlen);

#endif
