/* comm_nccl.c - the GPU backend over NCCL (built only when meson found the CUDA toolkit
 * and nccl.h; comm_nccl_none.c otherwise).  UNTESTED ON A GPU: the development machines
 * have none; the unit test only makes a unique id (reference/distributed.md, section 4).
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0), the basis of NCCL's fault
 * tolerance: every call returns at once, ncclInProgress included, and the rank thread
 * polls ncclCommGetAsyncError against the call's deadline, then ncclCommAbort on a timeout
 * (NVIDIA/nccl#289, #140: a blocking init or collective cannot be timed out).  Only the
 * rank thread touches the ncclComm_t: tsr_comm_abort from another thread sets a flag
 * that the rank thread's poll loops (and its next call) act on, because ncclCommAbort
 * frees the communicator under any thread still using it.
 *
 * Ops are enqueued on the caller's CUDA stream (NULL = the legacy default stream) and
 * complete asynchronously; tsr_comm_sync is the bounded wait for them.  Buffers are device
 * memory.  Send/recv match in issue order per peer (NCCL has no tags): the tag is checked
 * for range and otherwise not used; callers that need out-of-order tags use a CPU
 * backend.  The reduction order is NCCL's (ring/tree, by size and topology): bitwise
 * invariance across TP sizes is a CPU-backend promise only.  NCCL_* environment variables
 * are left alone, so NCCL_DEBUG, NCCL_SOCKET_IFNAME, ... work as users expect. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "common/clock.h"
#include "worker/parallel/comm_impl.h"

_Static_assert(sizeof(ncclUniqueId) == TSR_COMM_NCCL_ID_BYTES, "ncclUniqueId size changed");

/* Poll interval of the waits: short against a decode step, long enough that a rank
 * thread waiting on a 2-core host leaves the core to the others. */
#define NCCL_POLL_NS 20000

typedef struct nccl_comm {
        tsr_comm base;
        ncclComm_t comm;
        int device;
        _Atomic int abort_req;
        bool aborted;                    /* ncclCommAbort done (rank thread) */
} nccl_comm;

static void nap(void) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = NCCL_POLL_NS};
        nanosleep(&ts, NULL);
}

/* Rank thread: abort the communicator once, with `st` as the sticky status. */
static tsr_status abort_now(nccl_comm *n, tsr_status st) {
        st = tsr_comm_fail(&n->base, st);
        if (!n->aborted && n->comm) {
                ncclCommAbort(n->comm);
                n->aborted = true;
        }
        return st;
}

/* Wait, bounded, until a non-blocking call that returned `r` has been issued. */
static tsr_status settle(nccl_comm *n, ncclResult_t r, uint64_t deadline) {
        for (;;) {
                if (r == ncclSuccess)
                        return TSR_OK;
                if (r != ncclInProgress)
                        return abort_now(n, TSR_E_NCCL);
                if (atomic_load_explicit(&n->abort_req, memory_order_acquire))
                        return abort_now(n, TSR_E_CANCELLED);
                if (tsr_now_ns() >= deadline)
                        return abort_now(n, TSR_E_TIMEOUT);
                nap();
                if (ncclCommGetAsyncError(n->comm, &r) != ncclSuccess)
                        return abort_now(n, TSR_E_NCCL);
        }
}

static tsr_status enter(nccl_comm *n) {
        if (atomic_load_explicit(&n->abort_req, memory_order_acquire))
                return abort_now(n, TSR_E_CANCELLED);
        return tsr_comm_failed(&n->base);
}

static cudaStream_t stream_of(void *stream) { return (cudaStream_t)stream; }
static nccl_comm *nc(tsr_comm *c) { return (nccl_comm *)c; }

/* The ops go straight to NCCL: comm.c has refused a failed or aborted comm already
 * (tsr_comm_abort sets the sticky status before the flag), and an abort that lands
 * during the call is seen by settle. */
static tsr_status nccl_all_reduce(tsr_comm *c, float *buf, size_t count, void *stream, uint64_t deadline) {
        ncclResult_t r = ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, nc(c)->comm, stream_of(stream));
        return settle(nc(c), r, deadline);
}

static tsr_status nccl_all_gather(tsr_comm *c, const void *in, void *out, size_t bytes, void *stream,
                                  uint64_t deadline) {
        ncclResult_t r = ncclAllGather(in, out, bytes, ncclUint8, nc(c)->comm, stream_of(stream));
        return settle(nc(c), r, deadline);
}

static tsr_status nccl_broadcast(tsr_comm *c, void *buf, size_t bytes, int root, void *stream, uint64_t deadline) {
        ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, nc(c)->comm, stream_of(stream));
        return settle(nc(c), r, deadline);
}

static tsr_status nccl_send(tsr_comm *c, const void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                            uint64_t deadline) {
        ncclResult_t r = ncclSend(buf, bytes, ncclUint8, peer, nc(c)->comm, stream_of(stream));
        return settle(nc(c), r, deadline);
}

static tsr_status nccl_recv(tsr_comm *c, void *buf, size_t bytes, int peer, uint64_t tag, void *stream,
                            uint64_t deadline) {
        ncclResult_t r = ncclRecv(buf, bytes, ncclUint8, peer, nc(c)->comm, stream_of(stream));
        return settle(nc(c), r, deadline);
}

static tsr_status nccl_group_begin(tsr_comm *c) {
        nccl_comm *n = (nccl_comm *)c;
        tsr_status st = enter(n);
        if (st != TSR_OK)
                return st;
        return ncclGroupStart() == ncclSuccess ? TSR_OK : abort_now(n, TSR_E_NCCL);
}

static tsr_status nccl_group_end(tsr_comm *c, uint64_t deadline) {
        nccl_comm *n = (nccl_comm *)c;
        return settle(n, ncclGroupEnd(), deadline);
}

/* Wait until the stream has run what was enqueued, polling NCCL's async error. */
static tsr_status nccl_sync(tsr_comm *c, void *stream, uint64_t deadline) {
        nccl_comm *n = (nccl_comm *)c;
        for (;;) {
                tsr_status st = enter(n);
                if (st != TSR_OK)
                        return st;
                cudaError_t e = cudaStreamQuery(stream_of(stream));
                if (e == cudaSuccess)
                        return TSR_OK;
                if (e != cudaErrorNotReady)
                        return abort_now(n, TSR_E_CUDA);
                ncclResult_t r;
                if (ncclCommGetAsyncError(n->comm, &r) != ncclSuccess || (r != ncclSuccess && r != ncclInProgress))
                        return abort_now(n, TSR_E_NCCL);
                if (tsr_now_ns() >= deadline)
                        return abort_now(n, TSR_E_TIMEOUT);
                nap();
        }
}

static tsr_status nccl_barrier(tsr_comm *c, uint64_t deadline) {
        /* NCCL has no barrier: a one-float all-reduce on a scratch buffer, waited for. */
        nccl_comm *n = (nccl_comm *)c;
        float *d = NULL;
        if (cudaMalloc((void **)&d, sizeof(float)) != cudaSuccess)
                return TSR_E_CUDA;
        tsr_status st = nccl_all_reduce(c, d, 1, NULL, deadline);
        if (st == TSR_OK)
                st = nccl_sync(c, NULL, deadline);
        cudaFree(d);
        (void)n;
        return st;
}

/* Any thread: reads only the sticky status and the flag (NCCL's own async error is
 * polled by the rank thread inside every wait). */
static tsr_status nccl_poll_error(tsr_comm *c) {
        nccl_comm *n = (nccl_comm *)c;
        return atomic_load_explicit(&n->abort_req, memory_order_acquire) ? TSR_E_CANCELLED : TSR_OK;
}

static void nccl_abort(tsr_comm *c) {
        atomic_store_explicit(&((nccl_comm *)c)->abort_req, 1, memory_order_release);
}

static void nccl_destroy(tsr_comm *c) {
        nccl_comm *n = (nccl_comm *)c;
        if (n->comm && !n->aborted) {
                bool clean = tsr_comm_failed(c) == TSR_OK;
                if (clean && settle(n, ncclCommFinalize(n->comm), tsr_deadline_ns(c->timeout_ms)) == TSR_OK)
                        ncclCommDestroy(n->comm);
                else
                        abort_now(n, TSR_E_CANCELLED);
        }
        free(n);
}

static const tsr_comm_ops nccl_ops = {
        .name = "nccl",
        .all_reduce_sum = nccl_all_reduce,
        .all_gather = nccl_all_gather,
        .broadcast = nccl_broadcast,
        .send = nccl_send,
        .recv = nccl_recv,
        .barrier = nccl_barrier,
        .group_begin = nccl_group_begin,
        .group_end = nccl_group_end,
        .sync = nccl_sync,
        .poll_error = nccl_poll_error,
        .abort = nccl_abort,
        .destroy = nccl_destroy,
};

int tsr_comm_nccl_available(void) { return 1; }

tsr_status tsr_comm_nccl_unique_id(tsr_comm_nccl_id *ret, char *err, size_t errlen) {
        ncclUniqueId id;
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) {
                tsr_errf(err, errlen, "ncclGetUniqueId: %s", ncclGetErrorString(r));
                return TSR_E_NCCL;
        }
        memcpy(ret->bytes, id.internal, sizeof(ret->bytes));
        return TSR_OK;
}

tsr_status tsr_comm_nccl_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen) {
        if (!d->nccl_id) {
                tsr_errf(err, errlen, "comm nccl: no unique id");
                return TSR_E_INVAL;
        }
        cudaError_t ce = cudaSetDevice(d->cuda_device);
        if (ce != cudaSuccess) {
                tsr_errf(err, errlen, "comm nccl rank %d: cudaSetDevice(%d): %s", d->rank, d->cuda_device,
                         cudaGetErrorString(ce));
                return TSR_E_CUDA;
        }
        nccl_comm *n = calloc(1, sizeof(*n));
        if (!n)
                return TSR_E_NOMEM;
        n->base.ops = &nccl_ops;
        n->base.rank = d->rank;
        n->base.size = d->size;
        n->base.timeout_ms = d->timeout_ms ? d->timeout_ms : TSR_COMM_TIMEOUT_MS_DEFAULT;
        n->device = d->cuda_device;
        atomic_init(&n->base.failed, TSR_OK);
        atomic_init(&n->abort_req, 0);

        ncclUniqueId id;
        memcpy(id.internal, d->nccl_id->bytes, sizeof(id.internal));
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        ncclResult_t r = ncclCommInitRankConfig(&n->comm, d->size, id, d->rank, &cfg);
        tsr_status st = n->comm ? settle(n, r, tsr_deadline_ns(n->base.timeout_ms))
                                : r == ncclSuccess || r == ncclInProgress ? TSR_E_INTERNAL : TSR_E_NCCL;
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "comm nccl rank %d/%d: init: %s (%s)", d->rank, d->size, tsr_status_str(st),
                         r == ncclInProgress || r == ncclSuccess ? "in progress" : ncclGetErrorString(r));
                nccl_destroy(&n->base);
                return st;
        }
        *ret = &n->base;
        return TSR_OK;
}
