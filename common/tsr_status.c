#include <stdarg.h>
#include <stdio.h>

#include "tsr_status.h"

const char *tsr_status_str(tsr_status st) {
        switch (st) {
        case TSR_AGAIN: return "again";
        case TSR_OK: return "ok";
        case TSR_E_NOMEM: return "out of memory";
        case TSR_E_INVAL: return "invalid argument";
        case TSR_E_PROTO: return "protocol error";
        case TSR_E_LIMIT: return "limit exceeded";
        case TSR_E_CLOSED: return "closed";
        case TSR_E_TIMEOUT: return "timed out";
        case TSR_E_UNAVAILABLE: return "unavailable";
        case TSR_E_CANCELLED: return "cancelled";
        case TSR_E_IO: return "i/o error";
        case TSR_E_NOTFOUND: return "not found";
        case TSR_E_UNSUPPORTED: return "unsupported";
        case TSR_E_CUDA: return "cuda error";
        case TSR_E_NCCL: return "nccl error";
        case TSR_E_INTERNAL: return "internal error";
        }
        return "unknown status";
}

void tsr_errf(char *err, size_t errlen, const char *fmt, ...) {
        va_list ap;
        if (!err || errlen == 0)
                return;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
}
