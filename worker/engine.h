/* engine.h - the worker's engine thread and the messages it trades with the io thread.
 *
 * Threads (docs/threading.md): the io thread (link.c) owns the sockets and decodes
 * protobuf; the engine thread owns the model, the KV cache and the scheduler.  They
 * talk only through two bounded queues: `inbox` (io -> engine, engine_in items) and
 * `outbox` (engine -> io, engine_out items).  Whoever pops an item owns it and frees
 * it with engine_in_free / engine_out_free.
 *
 * Until the engine issue (#4) lands, the engine has no model runner: it answers every
 * Submit with a retryable UNAVAILABLE Error saying so, and reports the KV capacity it
 * was configured with (all free). */
#ifndef TSR_WORKER_ENGINE_H
#define TSR_WORKER_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/queue.h"
#include "common/wire.h"

#define ENGINE_ROUTER_ID_MAX 255

typedef struct engine_params {
        uint64_t kv_blocks_total;
        uint32_t block_size;
        uint32_t max_model_len;
        uint32_t max_num_seqs;
        uint32_t max_num_batched_tokens;
} engine_params;

/* What the engine publishes about itself; the io thread turns it into Status. */
typedef struct engine_stats {
        bool ready;                     /* a model runner exists and accepts Submit */
        uint64_t kv_blocks_total;
        uint64_t kv_blocks_free;
        uint64_t kv_blocks_active;
        uint32_t num_running;
        uint32_t num_waiting;
        uint32_t max_num_seqs;
        uint64_t waiting_prompt_tokens;
        uint64_t num_preemptions_total;
        uint64_t prefix_cache_queries_total;
        uint64_t prefix_cache_hits_total;
        uint64_t prompt_tokens_total;
        uint64_t generation_tokens_total;
} engine_stats;

typedef enum engine_in_kind {
        ENGINE_IN_SUBMIT,      /* env->submit */
        ENGINE_IN_ABORT,       /* env->abort */
} engine_in_kind;

typedef struct engine_in {
        engine_in_kind kind;
        uint8_t router_id[ENGINE_ROUTER_ID_MAX];
        size_t router_id_len;
        tsr_envelope *env;     /* owned; decoded and validated by the io thread */
} engine_in;

typedef enum engine_out_kind {
        ENGINE_OUT_ERROR,      /* an Error for one request of router_id */
        ENGINE_OUT_STATS,      /* a new engine_stats snapshot */
} engine_out_kind;

typedef struct engine_out {
        engine_out_kind kind;
        uint8_t router_id[ENGINE_ROUTER_ID_MAX];
        size_t router_id_len;
        char request_id[TSR_WIRE_MAX_ID_LEN + 1];
        Tessera__V1__ErrorCode error_code;
        bool retryable;
        char message[256];
        engine_stats stats;
} engine_out;

void engine_in_free(engine_in *in);
void engine_out_free(engine_out *out);

typedef struct tsr_engine tsr_engine;

/* Start the engine thread.  Borrows both queues (they must outlive the engine).
 * *ret written only on success. */
tsr_status tsr_engine_start(const engine_params *p, tsr_queue *inbox, tsr_queue *outbox, tsr_engine **ret);
/* Close the inbox, let the thread finish, join it.  Accepts NULL; clears *e. */
void tsr_engine_stop(tsr_engine **e);

#endif
