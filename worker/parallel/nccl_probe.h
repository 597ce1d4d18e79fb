/* nccl_probe.h - `tessera doctor`'s NCCL measurements (issue #18): every GPU of every
 * node of a replica as one NCCL communicator, an all-reduce at each size (checked against
 * the reference tree, then timed) and round trips between rank 0 and every other rank.
 * Built with NCCL where meson finds it (nccl_probe.c), else nccl_probe_none.c, which has
 * no devices.  NCCL's transport lines are read by nccl_log.h, not here.
 *
 * Threads: tsr_nccl_probe_run starts one thread per local GPU and joins them before it
 * returns; call it from one thread at a time. */
#ifndef TSR_PARALLEL_NCCL_PROBE_H
#define TSR_PARALLEL_NCCL_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "worker/parallel/comm.h"

#define TSR_NCCL_PROBE_SIZES 16

typedef struct tsr_nccl_probe_cfg {
        const tsr_comm_nccl_id *id;       /* the same on every node (made by node 0) */
        int first_rank;                   /* global rank of this node's GPU 0 */
        int n_local;                      /* this node's GPUs: ranks first_rank .. first_rank + n_local - 1 */
        int size;                         /* ranks over every node */
        const size_t *sizes;              /* bytes, multiples of 4 */
        int n_sizes;                      /* <= TSR_NCCL_PROBE_SIZES */
        uint32_t timeout_ms;              /* bound of every NCCL wait */
} tsr_nccl_probe_cfg;

typedef struct tsr_nccl_probe_out {
        /* per size: the mean time of one all-reduce on this node's first rank, and whether
         * every local rank's result was bitwise the reference tree */
        double all_reduce_us[TSR_NCCL_PROBE_SIZES];
        bool all_reduce_ok[TSR_NCCL_PROBE_SIZES];
        /* rank 0 <-> rank q, on the node that holds rank 0: one way at the smallest size
         * (us) and at the largest (GB/s); bytes_ok on both ends */
        double link_latency_us[TSR_COMM_MAX_RANKS];
        double link_gbps[TSR_COMM_MAX_RANKS];
        bool link_ok[TSR_COMM_MAX_RANKS];
} tsr_nccl_probe_out;

/* CUDA devices this process sees (0 without a driver, a device, or NCCL in the build). */
int tsr_nccl_probe_devices(void);
/* Run the measurements on this node's GPUs; every node of the group calls it with the
 * same id, size and sizes.  TSR_E_UNSUPPORTED without NCCL; a comm failure's status
 * (TSR_E_TIMEOUT when a node never joins) with one line in err. */
tsr_status tsr_nccl_probe_run(const tsr_nccl_probe_cfg *cfg, tsr_nccl_probe_out *out, char *err, size_t errlen);

#endif
