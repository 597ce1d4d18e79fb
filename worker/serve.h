/* serve.h - a worker process's last start-up step, shared by tessera-worker
 * (worker/main.c) and the simulated worker (deploy/sim_worker.c): the engine's
 * parameters from the configuration and the plan, then the engine thread and the io
 * thread (link.c, on the calling thread) until a stop, then both torn down.
 *
 * SIGTERM and SIGINT are blocked in every thread (the engine inherits the mask) and
 * read through a signalfd polled by the io loop (link.h). */
#ifndef TSR_WORKER_SERVE_H
#define TSR_WORKER_SERVE_H

#include "common/block_hash.h"
#include "common/config.h"
#include "common/tsr_status.h"
#include "worker/engine/engine.h"
#include "worker/link.h"
#include "worker/load/model_meta.h"

typedef struct tsr_worker_serve_opts {
        const tsr_config *cfg;
        const tsr_model_meta *meta;
        const tsr_worker_plan *plan;
        const tsr_engine_model *model;        /* NULL: skeleton mode (Submit refused) */
        tsr_block_hash_algo hash_algo;
        /* Packed ModelInfo, with and without the tokenizer (tsr_link_pack_model_info). */
        const uint8_t *model_info_full, *model_info_lean;
        size_t model_info_full_len, model_info_lean_len;
        const struct tsr_curve *curve;    /* may be NULL */
        void (*on_listening)(void *ud);   /* both sockets bound (tsr_link_opts); may be NULL */
        void (*on_stopping)(void *ud);    /* the first stop signal (tsr_link_opts); may be NULL */
        /* The engine thread's liveness ping and its period (tsr_engine_params); NULL/0: none. */
        void (*alive)(void *ud);
        uint32_t alive_interval_ms;
        double log_stats_interval_s;      /* 0 = no stats line */
} tsr_worker_serve_opts;

/* Run the worker until it stops.  Everything in o is borrowed.  TSR_OK after a clean
 * stop; otherwise the failure was logged (signalfd, memory, engine thread, a socket
 * that could not be bound). */
tsr_status tsr_worker_serve(const tsr_worker_serve_opts *o);

#endif
