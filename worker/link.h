/* link.h - the worker's io thread: ZeroMQ sockets and protobuf, nothing else.
 *
 *   ROUTER bind (--listen)          <- routers' DEALERs: Hello, Submit, Abort, Drain, Shutdown
 *                                   -> ModelInfo, Output, Error (addressed by routing id)
 *   PUB    bind (--status-listen)   -> Status every status_interval_ms
 *
 * The sockets are owned by the thread that calls tsr_link_run and never touched by
 * any other (a ZeroMQ socket is not thread-safe).  Decoded Submit/Abort go to the engine inbox;
 * the engine's replies come back on the outbox, whose eventfd is polled beside the
 * sockets. */
#ifndef TSR_WORKER_LINK_H
#define TSR_WORKER_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/queue.h"
#include "common/config.h"
#include "common/tsr_status.h"
#include "worker/engine/kv_cache.h"
#include "worker/load/gen_config.h"
#include "worker/load/model_meta.h"

/* What this worker serves, decided at start-up (main.c): ModelInfo carries it. */
typedef struct tsr_worker_plan {
        char status_listen[512];
        char worker_id[300];
        uint32_t max_model_len;
        uint64_t kv_blocks_total;
        uint64_t kv_block_bytes;
        uint32_t state_slots;           /* recurrent-state slots (a Mamba hybrid's), 0: none */
        uint64_t state_slot_bytes;      /* bytes of one */
        uint32_t state_block;           /* prefix caching of a hybrid: its states every this many tokens */
        uint32_t prefill_align;         /* engine.h tsr_engine_params.prefill_align */
        /* Block tables per request (kv_pool.h tsr_kv_tables): 1, or one per paged group of
         * a hybrid of full and chunked-local attention (Llama 4), with their chunks (0:
         * full attention) for the engine; and the blocks one request of max_model_len
         * holds at most (tsr_kv_blocks_per_request), which the capacity lines divide by. */
        uint32_t n_kv_tables;
        uint32_t kv_chunk[TSR_KV_TABLES_MAX];
        uint64_t kv_blocks_per_request;
        uint32_t max_num_seqs;
        uint32_t max_num_batched_tokens;
        uint64_t boot_epoch;
        uint64_t weight_bytes;          /* resident weight bytes over every rank (the load's) */
        uint32_t tensor_parallel_size, pipeline_parallel_size;
} tsr_worker_plan;

/* Pack ModelInfo twice: with the tokenizer (*full) and without it (*lean, for routers
 * that have it cached).  Everything is read from the arguments (borrowed); the caller
 * frees both buffers.  `ready`: a model runner exists; `dtype`: what its weights are held
 * in.  Main thread, at start-up. */
tsr_status tsr_link_pack_model_info(const tsr_config *cfg, const tsr_model_meta *m, const tsr_gen_defaults *gd,
                                    const tsr_worker_plan *p, bool ready, const char *dtype, uint8_t **full,
                                    size_t *full_len, uint8_t **lean, size_t *lean_len);

typedef struct tsr_link_opts {
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
        /* Called once at the first stop signal, before draining (e.g. STOPPING=1); may be NULL. */
        void (*on_stopping)(void *ud);
        void *ud;
        /* The engine's model (may be NULL): while its `available` says no, Status says
         * UNHEALTHY (a multi-node replica whose nodes are apart). */
        const struct tsr_engine_model *model;
        /* Bytes of one KV block and of one recurrent-state slot (the plan's), for
         * Status' kv_bytes_total / kv_bytes_used. */
        uint64_t kv_block_bytes, state_slot_bytes;
} tsr_link_opts;

/* Bind the sockets and run the io loop on the calling thread until a Shutdown message
 * arrives, or stop_fd (a signalfd for SIGTERM/SIGINT) becomes readable and the engine
 * then reports TSR_ENGINE_OUT_STOPPED (new Submits are refused meanwhile; a second signal
 * stops at once).  Borrows the queues.  Returns TSR_OK on a clean stop, TSR_E_IO if a socket could not be bound
 * (logged with the endpoint). */
tsr_status tsr_link_run(const tsr_link_opts *o, tsr_queue *inbox, tsr_queue *outbox, int stop_fd);

#endif
