/* bootstrap.h - the rendezvous of a multi-node group (issue #20's bootstrap, step 1-2 of
 * docs/architecture.md "Across nodes"; used by `tessera doctor` today).
 *
 * Node 0 binds a ZeroMQ ROUTER on --master-addr:--master-port; every other node, started
 * independently (systemd, Kubernetes, a shell on each host), connects a DEALER to it and
 * sends a NodeHello: nnodes, node rank, version, purpose, a fingerprint of the
 * configuration that must agree, and the endpoint its comm listener is bound on.  ZeroMQ
 * retries the connection (100 ms, backing off to 2 s), so the order in which nodes start
 * does not matter.  Node 0 waits until every rank has said hello, checks that they
 * agree, and answers each with a NodeSetup: a new epoch and the data endpoints by node
 * rank, or an error that names the node and the field (every node, itself included,
 * then fails with that message).  The group is then built with the comm layer's zmq
 * backend (tsr_comm_new with these endpoints and the epoch).
 *
 * Every wait is bounded: node 0 waits cfg.timeout_ms and names the ranks that never came;
 * the others wait TSR_BOOTSTRAP_FOLLOWER_GRACE_MS longer (so they hear that reason when
 * they started with node 0) and otherwise say they had no answer from node 0 and what
 * to check.
 *
 * Threads: one call at a time per process (it owns its ZeroMQ context for the call);
 * the caller's thread; nothing is left running when it returns. */
#ifndef TSR_PARALLEL_BOOTSTRAP_H
#define TSR_PARALLEL_BOOTSTRAP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

#define TSR_BOOTSTRAP_FOLLOWER_GRACE_MS 2000u

typedef struct tsr_bootstrap_cfg {
        uint32_t nnodes;            /* 2 .. TSR_COMM_MAX_RANKS */
        uint32_t node_rank;         /* 0 = the node that binds the rendezvous */
        const char *master_addr;    /* host name or IP address of node 0 */
        uint16_t master_port;
        const char *purpose;        /* what the group is for ("doctor"); must agree */
        const char *fingerprint;    /* configuration that must agree, as text (may be "") */
        const char *data_endpoint;  /* this node's bound comm endpoint, e.g. tcp://10.0.0.2:41234 */
        uint32_t timeout_ms;        /* bound of the whole rendezvous */
        /* Optional: another thread sets it to give up (a stop signal); the rendezvous
         * then returns TSR_E_CANCELLED within half a second. */
        const _Atomic bool *cancel;
        /* Optional, node 0: called (on the caller's thread) when the first other node has
         * said hello, before the others have: a node that restarted says hello while
         * the group it left may still be up (nodes.h aborts that group here). */
        void (*on_first_hello)(void *ud);
        void *ud;
} tsr_bootstrap_cfg;

typedef struct tsr_bootstrap_group {
        uint32_t nnodes;
        uint64_t epoch;             /* made by node 0, new on every rendezvous */
        char **endpoints;           /* [nnodes]: where node q's comm listener is bound */
        char **hostnames;           /* [nnodes] */
} tsr_bootstrap_group;

/* Run the rendezvous.  On success *out holds the group (tsr_bootstrap_group_free).
 * TSR_E_INVAL (bad cfg), TSR_E_TIMEOUT (a node never came / node 0 never answered),
 * TSR_E_PROTO (nodes disagree: err names the node and the field), TSR_E_IO (bind or
 * connect failed), TSR_E_CANCELLED (cfg->cancel was set), TSR_E_NOMEM.  `err` gets one line on failure. */
tsr_status tsr_bootstrap_rendezvous(const tsr_bootstrap_cfg *cfg, tsr_bootstrap_group *out, char *err,
                                    size_t errlen);
void tsr_bootstrap_group_free(tsr_bootstrap_group *g);

/* The local IPv4/IPv6 address that traffic to host:port leaves from (a UDP socket
 * connected there and getsockname: no packet is sent), as text for a tcp:// endpoint
 * (IPv6 in brackets).  How a node picks the address its comm listener binds to. */
tsr_status tsr_bootstrap_local_addr(const char *host, uint16_t port, char *buf, size_t len, char *err,
                                    size_t errlen);

#endif
