/* comm_impl.h - what the comm backends share (private to worker/parallel/).
 *
 * comm.c checks arguments, keeps the sticky error and the group queue, and calls the
 * backend through tsr_comm_ops; a backend embeds struct tsr_comm first. */
#ifndef TSR_PARALLEL_COMM_IMPL_H
#define TSR_PARALLEL_COMM_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include "worker/parallel/comm.h"

typedef struct tsr_comm_ops {
        const char *name;
        tsr_status (*all_reduce_sum)(tsr_comm *c, float *buf, size_t count, void *stream, uint64_t deadline);
        tsr_status (*all_gather)(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream,
                                 uint64_t deadline);
        tsr_status (*broadcast)(tsr_comm *c, void *buf, size_t bytes, int root, void *stream, uint64_t deadline);
        tsr_status (*send)(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                           uint64_t deadline);
        tsr_status (*recv)(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                           uint64_t deadline);
        tsr_status (*barrier)(tsr_comm *c, uint64_t deadline);
        /* NULL: comm.c queues the group's ops and runs the sends, then the recvs, at the end
         * (CPU backends: sends are buffered, so this never deadlocks). */
        tsr_status (*group_begin)(tsr_comm *c);
        tsr_status (*group_end)(tsr_comm *c, uint64_t deadline);
        tsr_status (*sync)(tsr_comm *c, void *stream, uint64_t deadline);     /* NULL: nothing to wait for */
        tsr_status (*poll_error)(tsr_comm *c);                                 /* NULL: the sticky status only */
        tsr_status (*progress)(tsr_comm *c);     /* NULL: nothing to drive (tsr_comm_progress) */
        void (*abort)(tsr_comm *c);              /* after comm.c set the sticky status; any thread */
        void (*destroy)(tsr_comm *c);
} tsr_comm_ops;

typedef struct tsr_comm_group_op {
        bool is_send;
        void *buf;
        size_t bytes;
        int peer;
        uint64_t tag;
        void *stream;
} tsr_comm_group_op;

struct tsr_comm {
        const tsr_comm_ops *ops;
        int rank, size;
        uint32_t timeout_ms;
        _Atomic int failed;              /* sticky tsr_status, TSR_OK while usable; any thread */
        int group_depth;                 /* rank thread only */
        int n_group_ops;
        tsr_comm_group_op *group_ops;    /* [TSR_COMM_GROUP_MAX_OPS], allocated on first use */
};

/* Record a sticky error (the first one wins) and return the sticky status. */
tsr_status tsr_comm_fail(tsr_comm *c, tsr_status st);
static inline tsr_status tsr_comm_failed(const tsr_comm *c) {
        return (tsr_status)atomic_load_explicit(&c->failed, memory_order_acquire);
}

/* Element range [*lo, *hi) of part `i` of `count` split in `n` contiguous parts (the
 * first count % n parts one longer).  Every rank computes the same split. */
static inline void tsr_comm_slice(size_t count, int n, int i, size_t *lo, size_t *hi) {
        size_t q = count / (size_t)n, r = count % (size_t)n, ui = (size_t)i;
        *lo = q * ui + (ui < r ? ui : r);
        *hi = *lo + q + (ui < r ? 1 : 0);
}

/* Collective tags (zmq): the top bit, then a per-rank collective sequence and a phase. */
#define TSR_COMM_TAG_COLL (UINT64_C(1) << 63)

/* Backends' constructors (comm.c dispatches on desc->backend; desc already checked). */
tsr_status tsr_comm_local_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen);
tsr_status tsr_comm_zmq_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen);
tsr_status tsr_comm_nccl_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen);

#endif
