/* request.h - the generation request path of the router.
 *
 *   POST /v1/completions, /v1/chat/completions
 *     loop:        content-type check, register the disconnect callback
 *     thread pool: oai_parse (JSON, validation)          [tsr_request_parse_work]
 *     loop:        resolve the model (404), flags that need the config
 *     thread pool: chat template render, tokenization    [prep_work]
 *     loop:        context-length checks, sampling defaults from the model's
 *                  generation_config, one Submit per choice (prompts x n) to the
 *                  live worker serving the model that placement picks
 *                  (--routing-policy; placement.h)
 *     loop:        Outputs -> incremental detokenizer -> stop strings -> SSE chunks
 *                  or the final JSON body; Abort to the worker on a stop string or a
 *                  client disconnect
 *   A worker Error marked retryable, or a worker that dies, before a choice produced
 *   a token: the choice is resubmitted elsewhere (3 attempts); after tokens were
 *   streamed the stream ends with an error event.
 *
 *   POST /tokenize, /detokenize: vLLM's shapes, on the thread pool.
 * Loop thread only (the jobs it queues touch only their own request).
 *
 * The code is in router/request/: core.c (the request object, lifetime, in-flight
 * table, errors, completion, these entry points), prepare.c (parse and preparation),
 * dispatch.c (placement, Submit, worker events), stream.c (logprobs, SSE),
 * tokenize.c (/tokenize, /detokenize); request_int.h is what they share. */
#ifndef TSR_ROUTER_REQUEST_H
#define TSR_ROUTER_REQUEST_H

#include "http_server.h"
#include "openai.h"

struct router_ctx;
typedef struct request_layer request_layer;

tsr_status request_layer_new(struct router_ctx *r, request_layer **ret);
/* Loop thread, at shutdown: close the deadline timer (before the loop's last run). */
void request_layer_close(request_layer *l);
/* Abort what is in flight and free.  Accepts NULL; clears *l. */
void request_layer_free(request_layer **l);

void request_handle_generate(request_layer *l, http_conn *c, http_request *req, oai_kind kind);
void request_handle_tokenize(request_layer *l, http_conn *c, http_request *req);
void request_handle_detokenize(request_layer *l, http_conn *c, http_request *req);

/* Requests being served now (for logs and shutdown). */
size_t request_layer_active(const request_layer *l);

#endif
