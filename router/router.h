/* router.h - the router's context: created in main, passed to every module.
 * No globals (STYLE.md 1.6).  Loop thread only. */
#ifndef TSR_ROUTER_H
#define TSR_ROUTER_H

#include <stdint.h>
#include <uv.h>

#include "common/config.h"
#include "http_server.h"
#include "metrics.h"
#include "models.h"
#include "request.h"
#include "worker_link.h"

typedef struct router_ctx {
        uv_loop_t *loop;
        const tsr_config *cfg;
        http_server *http;
        worker_pool *workers;
        model_registry *models;
        request_layer *requests;
        tsr_metrics *metrics;
        char router_id[64];
        uint64_t started_unix_s;
} router_ctx;

/* The HTTP handler for every request (api.c); `ud` is the router_ctx. */
void router_api_handle(void *ud, http_conn *c, http_request *req);

#endif
