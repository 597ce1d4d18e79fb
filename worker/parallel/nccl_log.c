/* nccl_log.c - counting NCCL's channel connections by transport (nccl_log.h). */
#include <stdio.h>
#include <string.h>

#include "worker/parallel/nccl_log.h"

static const char *const KIND_NAMES[TSR_NCCL_KINDS] = {
        [TSR_NCCL_NET_IB_GDR] = "InfiniBand with GPUDirect RDMA",
        [TSR_NCCL_NET_IB] = "InfiniBand without GPUDirect RDMA",
        [TSR_NCCL_NET_SOCKET] = "TCP sockets",
        [TSR_NCCL_NET_OTHER] = "another network plugin",
        [TSR_NCCL_P2P] = "GPU peer to peer",
        [TSR_NCCL_SHM] = "host shared memory",
        [TSR_NCCL_COLLNET] = "CollNet",
        [TSR_NCCL_OTHER] = "other",
};

void tsr_nccl_log_init(tsr_nccl_log *log) { memset(log, 0, sizeof(*log)); }

const char *tsr_nccl_transport_kind_name(tsr_nccl_transport_kind k) {
        return k >= 0 && k < TSR_NCCL_KINDS ? KIND_NAMES[k] : "?";
}

static bool starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

tsr_nccl_transport_kind tsr_nccl_transport_classify(const char *t) {
        if (starts(t, "NET/IB"))
                return strstr(t, "/GDRDMA") ? TSR_NCCL_NET_IB_GDR : TSR_NCCL_NET_IB;
        if (starts(t, "NET/Socket"))
                return TSR_NCCL_NET_SOCKET;
        if (starts(t, "NET/"))
                return TSR_NCCL_NET_OTHER;
        if (starts(t, "P2P/"))
                return TSR_NCCL_P2P;
        if (starts(t, "SHM/"))
                return TSR_NCCL_SHM;
        if (starts(t, "COLLNET/"))
                return TSR_NCCL_COLLNET;
        return TSR_NCCL_OTHER;
}

/* Copy the first whitespace-delimited word of s into out. */
static void word(const char *s, char *out, size_t cap) {
        size_t n = strcspn(s, " \t\r\n");
        snprintf(out, cap, "%.*s", (int)n, s);
}

static void count_transport(tsr_nccl_log *log, const char *t) {
        for (int i = 0; i < log->n_transports; i++)
                if (strcmp(log->transports[i].text, t) == 0) {
                        log->transports[i].count++;
                        return;
                }
        int i = TSR_NCCL_LOG_TRANSPORTS - 1;         /* table full: its last row collects the rest */
        if (log->n_transports < TSR_NCCL_LOG_TRANSPORTS)
                i = log->n_transports++;
        else
                t = "(others)";
        snprintf(log->transports[i].text, sizeof(log->transports[i].text), "%s", t);
        log->transports[i].count++;
}

bool tsr_nccl_log_line(tsr_nccl_log *log, const char *line) {
        const char *msg = strstr(line, "NCCL INFO ");
        const char *warn = strstr(line, "NCCL WARN ");
        if (warn && (!msg || warn < msg)) {
                if (log->warnings++ == 0)
                        snprintf(log->first_warning, sizeof(log->first_warning), "%.*s",
                                 (int)strcspn(warn + 10, "\r\n"), warn + 10);
                return false;
        }
        msg = msg ? msg + strlen("NCCL INFO ") : line;
        if (starts(msg, "NCCL version ")) {
                word(msg + strlen("NCCL version "), log->version, sizeof(log->version));
                return false;
        }
        if (starts(msg, "Using network ")) {
                word(msg + strlen("Using network "), log->network, sizeof(log->network));
                return false;
        }
        if (!starts(msg, "Channel ") && !starts(msg, "CollNet "))
                return false;
        const char *via = strstr(msg, " via ");
        if (!via)
                return false;
        via += strlen(" via ");
        size_t n = strcspn(via, "\r\n");
        while (n && (via[n - 1] == ' ' || via[n - 1] == '\t'))
                n--;
        if (!n)
                return false;
        char t[48];
        snprintf(t, sizeof(t), "%.*s", (int)n, via);
        log->connections++;
        log->by_kind[tsr_nccl_transport_classify(t)]++;
        count_transport(log, t);
        return true;
}

void tsr_nccl_log_scan(tsr_nccl_log *log, const char *text, size_t len) {
        char line[1024];
        size_t i = 0;
        while (i < len) {
                const char *nl = memchr(text + i, '\n', len - i);
                size_t n = nl ? (size_t)(nl - (text + i)) : len - i;
                /* a line longer than the buffer is cut: NCCL's lines of interest are short */
                snprintf(line, sizeof(line), "%.*s", (int)(n < sizeof(line) ? n : sizeof(line) - 1), text + i);
                tsr_nccl_log_line(log, line);
                i += n + 1;
        }
}
