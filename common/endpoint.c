#include "endpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

tsr_status tsr_endpoint_status_default(const char *ep, char *out, size_t outlen) {
        const char *colon = strrchr(ep, ':');
        char *end;
        long port;
        int n;

        if (!colon || strncmp(ep, "tcp://", 6) != 0 || colon < ep + 6)
                return TSR_E_INVAL;
        port = strtol(colon + 1, &end, 10);
        if (colon[1] == '\0' || *end || port <= 0 || port >= 65535)
                return TSR_E_INVAL;
        n = snprintf(out, outlen, "%.*s:%ld", (int)(colon - ep), ep, port + 1);
        return n < 0 || (size_t)n >= outlen ? TSR_E_LIMIT : TSR_OK;
}
