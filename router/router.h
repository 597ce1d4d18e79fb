/* router.h - the router's context: created in main, passed to every module.
 * No globals.  One per event loop (--router-threads); each is used by
 * its loop's thread only, except `metrics`, which every loop shares. */
#ifndef TSR_ROUTER_H
#define TSR_ROUTER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "common/config.h"
#include "http_server.h"
#include "metrics.h"
#include "models.h"
#include "request.h"
#include "worker_link.h"

typedef struct tsr_router_ctx {
        uv_loop_t *loop;
        const tsr_config *cfg;
        tsr_http_server *http;
        tsr_worker_pool *workers;
        tsr_models_registry *models;
        tsr_request_layer *requests;
        tsr_metrics *metrics;        /* shared by every loop (--router-threads), locked inside */
        char router_id[64];
        uint64_t started_unix_s;
        int loop_index;              /* 0 .. --router-threads - 1 */
        /* Every loop's HTTP server, for the connection counts in /metrics (their
         * counters are atomic); n_http = --router-threads. */
        tsr_http_server *const *all_http;
        size_t n_http;
        /* Whether each loop could serve a request now (tsr_api_can_serve), published by
         * its own loop every TSR_READY_PUBLISH_MS; n_http entries; NULL with one loop.
         * /health asks every loop, since a client's next connection may land on any. */
        atomic_bool *loops_ready;
} tsr_router_ctx;

#define TSR_READY_PUBLISH_MS 100

/* Loop thread: some worker is live and this loop has built its model's tokenizer. */
bool tsr_api_can_serve(tsr_router_ctx *r);

/* The HTTP handler for every request (api.c); `ud` is the tsr_router_ctx. */
void tsr_api_handle(void *ud, tsr_http_conn *c, tsr_http_request *req);

#endif
