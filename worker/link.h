/* link.h - the worker's io thread: ZeroMQ sockets and protobuf, nothing else.
 *
 *   ROUTER bind (--listen)          <- routers' DEALERs: Hello, Submit, Abort, Drain, Shutdown
 *                                   -> ModelInfo, Output, Error (addressed by routing id)
 *   PUB    bind (--status-listen)   -> Status every status_interval_ms
 *
 * The sockets are owned by the thread that calls worker_link_run and never touched by
 * any other (a ZeroMQ socket is not thread-safe).  Decoded Submit/Abort go to the engine inbox;
 * the engine's replies come back on the outbox, whose eventfd is polled beside the
 * sockets. */
#ifndef TSR_WORKER_LINK_H
#define TSR_WORKER_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "common/queue.h"
#include "common/tsr_status.h"

typedef struct worker_link_opts {
        const char *listen;              /* ROUTER endpoint to bind */
        const char *status_listen;       /* PUB endpoint to bind */
        int status_interval_ms;
        const char *worker_id;
        uint64_t boot_epoch;
        /* Packed Envelope(ModelInfo), with and without the tokenizer (sent when the
         * router's Hello says it has the tokenizer with this hash cached). */
        const uint8_t *model_info_full;
        size_t model_info_full_len;
        const uint8_t *model_info_lean;
        size_t model_info_lean_len;
        uint64_t tokenizer_hash;
        /* vLLM's periodic "Engine 000: Avg prompt throughput ..." line every this many
         * seconds (VLLM_LOG_STATS_INTERVAL, 10); 0 = off (--disable-log-stats). */
        double log_stats_interval_s;
        /* CurveZMQ keys (common/zmq_curve.h); NULL or disabled = plain TCP.  Borrowed. */
        const struct tsr_curve *curve;
        /* Called once both sockets are bound (e.g. sd_notify READY=1); may be NULL. */
        void (*on_listening)(void *ud);
        void *ud;
} worker_link_opts;

/* Bind the sockets and run the io loop on the calling thread until a Shutdown message
 * arrives, or stop_fd (a signalfd for SIGTERM/SIGINT) becomes readable and the engine
 * then reports ENGINE_OUT_STOPPED (new Submits are refused meanwhile; a second signal
 * stops at once).  Borrows the queues.  Returns TSR_OK on a clean stop, TSR_E_IO if a socket could not be bound
 * (logged with the endpoint). */
tsr_status worker_link_run(const worker_link_opts *o, tsr_queue *inbox, tsr_queue *outbox, int stop_fd);

#endif
