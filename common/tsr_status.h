/* tsr_status.h - the one error enum of Tessera.
 *
 * Functions that can fail return a tsr_status and leave their outputs untouched on
 * failure.  Raw error codes (errno, zmq, libuv UV_E*, CUDA, NCCL) are converted at the
 * call site and never cross a module boundary.  docs/errors.md maps each value to an
 * HTTP status and an OpenAI error type. */
#ifndef TSR_STATUS_H
#define TSR_STATUS_H

typedef enum tsr_status {
        TSR_AGAIN = 1,             /* not finished; will call back */
        TSR_OK = 0,
        TSR_E_NOMEM = -1,
        TSR_E_INVAL = -2,          /* bad argument or bad input (client, file, flag) */
        TSR_E_PROTO = -3,          /* malformed or incompatible wire message */
        TSR_E_LIMIT = -4,          /* a cap was hit (size, count, queue) */
        TSR_E_CLOSED = -5,         /* peer or queue closed */
        TSR_E_TIMEOUT = -6,
        TSR_E_UNAVAILABLE = -7,    /* no capacity / no live worker / queue full */
        TSR_E_CANCELLED = -8,
        TSR_E_IO = -9,             /* file or socket I/O */
        TSR_E_NOTFOUND = -10,      /* file, tensor, model or key missing */
        TSR_E_UNSUPPORTED = -11,   /* valid but not implemented (dtype, feature) */
        TSR_E_CUDA = -12,
        TSR_E_NCCL = -13,
        TSR_E_INTERNAL = -14,
} tsr_status;

/* Stable lower-case name ("ok", "invalid argument", ...).  Never NULL. */
const char *tsr_status_str(tsr_status st);

#include <stddef.h>

/* Write a one-line error message into a caller's buffer (err may be NULL or errlen 0:
 * then nothing is written).  The convention of every non-logging module: return a
 * status, describe it here, let the caller log it once. */
void tsr_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
