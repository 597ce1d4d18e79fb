/* request.h - the generation request path of the router.
 *
 *   POST /v1/completions, /v1/chat/completions
 *     loop:        content-type check, register the disconnect callback
 *     thread pool: tsr_oai_parse (JSON, validation)          [tsr_request_parse_work]
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

struct tsr_router_ctx;
typedef struct tsr_request_layer tsr_request_layer;

tsr_status tsr_request_layer_new(struct tsr_router_ctx *r, tsr_request_layer **ret);
/* Loop thread, at shutdown: close the deadline timer (before the loop's last run). */
void tsr_request_layer_close(tsr_request_layer *l);
/* Abort what is in flight and free.  Accepts NULL; clears *l. */
void tsr_request_layer_free(tsr_request_layer **l);

void tsr_request_handle_generate(tsr_request_layer *l, tsr_http_conn *c, tsr_http_request *req, tsr_oai_kind kind);
void tsr_request_handle_tokenize(tsr_request_layer *l, tsr_http_conn *c, tsr_http_request *req);
void tsr_request_handle_detokenize(tsr_request_layer *l, tsr_http_conn *c, tsr_http_request *req);

/* Requests being served now (for logs and shutdown). */
size_t tsr_request_layer_active(const tsr_request_layer *l);

#endif
