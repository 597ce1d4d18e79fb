/* nccl_log.h - what NCCL's INFO lines say about how the ranks of a communicator are
 * connected (issue #18: `tessera doctor` flags cross-node traffic over sockets).
 *
 * NCCL_DEBUG=INFO prints one line per channel connection (reference/distributed.md,
 * "Which line tells the transport"), each after NCCL's "host:pid:tid [dev] NCCL INFO "
 * prefix:
 *   Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA     between nodes, InfiniBand
 *   Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0        between nodes, TCP
 *   Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read             GPUs of one node
 *   Channel 00 : 0[0] -> 1[1] via SHM/direct/direct            through host memory
 * plus "NCCL version 2.x.y+cudaZ" and "Using network IB|Socket".  A scan counts the
 * connections by transport; the verdict is the seeds' (003): `NET/Socket` between nodes
 * is not efficient for tensor parallelism, `NET/IB/.../GDRDMA` is.
 *
 * Pure functions over text; any thread. */
#ifndef TSR_PARALLEL_NCCL_LOG_H
#define TSR_PARALLEL_NCCL_LOG_H

#include <stdbool.h>
#include <stddef.h>

#define TSR_NCCL_LOG_TRANSPORTS 16

typedef enum tsr_nccl_transport_kind {
        TSR_NCCL_NET_IB_GDR = 0,    /* NET/IB/<dev>/GDRDMA: GPUDirect RDMA, the fast path between nodes */
        TSR_NCCL_NET_IB,            /* NET/IB/<dev> without GDRDMA: RDMA through host memory */
        TSR_NCCL_NET_SOCKET,        /* NET/Socket/<dev>: TCP between nodes */
        TSR_NCCL_NET_OTHER,         /* another network plugin */
        TSR_NCCL_P2P,               /* P2P/...: NVLink or PCIe between GPUs of a node */
        TSR_NCCL_SHM,               /* SHM/...: through host shared memory */
        TSR_NCCL_COLLNET,           /* COLLNET/... (SHARP) */
        TSR_NCCL_OTHER,
        TSR_NCCL_KINDS
} tsr_nccl_transport_kind;

typedef struct tsr_nccl_log {
        char version[48];                   /* "2.28.9+cuda13.0", "" if not seen */
        char network[32];                   /* "IB", "Socket", "" if not seen */
        int connections;                    /* channel lines seen */
        int by_kind[TSR_NCCL_KINDS];
        /* distinct transport texts (after "via "), with their counts */
        int n_transports;
        struct {
                char text[48];
                int count;
        } transports[TSR_NCCL_LOG_TRANSPORTS];
        int warnings;                       /* WARN lines */
        char first_warning[160];
} tsr_nccl_log;

void tsr_nccl_log_init(tsr_nccl_log *log);
/* Take one line of NCCL's output (with or without its prefix and newline); lines that are
 * not NCCL's are ignored.  Returns true when the line was a channel connection. */
bool tsr_nccl_log_line(tsr_nccl_log *log, const char *line);
/* Every line of `text` (len bytes, need not be NUL-terminated). */
void tsr_nccl_log_scan(tsr_nccl_log *log, const char *text, size_t len);
/* Classify a transport text such as "NET/IB/0/GDRDMA" or "P2P/CUMEM/read". */
tsr_nccl_transport_kind tsr_nccl_transport_classify(const char *transport);
const char *tsr_nccl_transport_kind_name(tsr_nccl_transport_kind k);

#endif
