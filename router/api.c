/* api.c - the HTTP routes of the router: vLLM's paths, shapes and error bodies.
 * Loop thread only.
 *
 * Served here: /health, /ping, /version, /v1/models, /metrics, /admin/workers[/drain|/resume]; the generation and
 * tokenizer endpoints are handed to request.h (router/request/). */
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/buf.h"
#include "common/log.h"
#include "router.h"

static void respond_json(tsr_http_conn *c, int status, json_t *body) {
        char *text = json_dumps(body, JSON_COMPACT);
        if (!text) {
                tsr_http_conn_respond_error(c, 500, "Internal Server Error", "out of memory");
        } else {
                tsr_http_conn_respond(c, status, "application/json", text, strlen(text), NULL);
                free(text);
        }
        json_decref(body);
}

/* FastAPI's own bodies for routing errors: {"detail": "..."}. */
static void respond_detail(tsr_http_conn *c, int status, const char *detail) {
        respond_json(c, status, json_pack("{s:s}", "detail", detail));
}

/* vLLM guards paths under /v1 with --api-key (Authorization: Bearer KEY, scheme
 * case-insensitive) and answers 401 {"error":"Unauthorized"}; Tessera's /admin/ too.  Compare in constant
 * time over the longest candidate so timing leaks no prefix. */
static bool authorized(const tsr_router_ctx *r, const tsr_http_request *req) {
        const char *h;
        size_t given_len;
        bool ok = false;

        if (r->cfg->api_key.n == 0 || (strncmp(req->path, "/v1", 3) != 0 && strncmp(req->path, "/admin/", 7) != 0) ||
            strcmp(req->method, "OPTIONS") == 0)
                return true;
        h = tsr_http_request_header(req, "authorization");
        if (!h || strncasecmp(h, "bearer ", 7) != 0)
                return false;
        h += 7;
        given_len = strlen(h);
        for (size_t k = 0; k < r->cfg->api_key.n; k++) {
                const char *key = r->cfg->api_key.items[k];
                size_t key_len = strlen(key);
                unsigned char diff = given_len != key_len;
                for (size_t i = 0; i < key_len; i++)
                        diff |= (unsigned char)(key[i] ^ (i < given_len ? h[i] : 0));
                ok |= diff == 0;
        }
        return ok;
}

/* Healthy = a request could be served now: some worker is live and the router has
 * built its model's tokenizer (and template).  A worker live before its tokenizer is
 * ready would turn the first completion after a 200 into a 503 "still loading",
 * which a client that waited for /health (as for vLLM) does not expect. */
bool tsr_api_can_serve(tsr_router_ctx *r) {
        for (size_t i = 0; i < tsr_worker_pool_count(r->workers); i++) {
                tsr_worker *w = tsr_worker_pool_get(r->workers, i);
                const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
                const Tessera__V1__Status *st = tsr_worker_status(w);
                if (!tsr_worker_live(w) || !tsr_worker_accepting(w) || !mi || mi->n_served_model_names == 0 ||
                    (st && st->state == TESSERA__V1__STATUS__STATE__UNHEALTHY))
                        continue;
                tsr_models_entry *m = tsr_models_registry_find(r->models, mi->served_model_names[0]);
                if (m && m->ready)
                        return true;
        }
        return false;
}

static void handle_health(tsr_router_ctx *r, tsr_http_conn *c) {
        bool ok = tsr_api_can_serve(r);
        for (size_t i = 0; ok && r->loops_ready && i < r->n_http; i++)
                if ((int)i != r->loop_index)
                        ok = atomic_load_explicit(&r->loops_ready[i], memory_order_relaxed);
        tsr_http_conn_respond(c, ok ? 200 : 503, NULL, "", 0, NULL);
}

static void handle_version(tsr_router_ctx *r, tsr_http_conn *c) {
        respond_json(c, 200, json_pack("{s:s}", "version", TSR_VERSION));
}

static bool name_seen(json_t *data, const char *name) {
        size_t i;
        json_t *card;
        json_array_foreach(data, i, card) {
                if (strcmp(json_string_value(json_object_get(card, "id")), name) == 0)
                        return true;
        }
        return false;
}

/* One card per served name of every live worker (vLLM: one per --served-model-name,
 * all sharing `root`).  Names served by several workers appear once. */
static void handle_models(tsr_router_ctx *r, tsr_http_conn *c) {
        json_t *data = json_array();
        json_int_t created = (json_int_t)r->started_unix_s;

        for (size_t i = 0; i < tsr_worker_pool_count(r->workers); i++) {
                tsr_worker *w = tsr_worker_pool_get(r->workers, i);
                const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
                if (!mi || !tsr_worker_live(w))
                        continue;
                for (size_t k = 0; k < mi->n_served_model_names; k++) {
                        const char *name = mi->served_model_names[k];
                        if (name_seen(data, name))
                                continue;
                        json_t *perm = json_pack(
                                "{s:s, s:s, s:I, s:b, s:b, s:b, s:b, s:b, s:b, s:s, s:n, s:b}", "id",
                                "modelperm-tessera", "object", "model_permission", "created", created,
                                "allow_create_engine", 0, "allow_sampling", 1, "allow_logprobs", 1,
                                "allow_search_indices", 0, "allow_view", 1, "allow_fine_tuning", 0,
                                "organization", "*", "group", "is_blocking", 0);
                        json_array_append_new(
                                data, json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:I, s:[o]}", "id", name, "object",
                                                "model", "created", created, "owned_by", "vllm", "root",
                                                mi->model_root, "parent", "max_model_len",
                                                (json_int_t)mi->max_model_len, "permission", perm));
                }
        }
        respond_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* ------------------------------------------------------------------ admin
 * Tessera's own operations on the fleet (vLLM has none: one process is one engine).
 * Guarded by --api-key like /v1. */

static const char *status_state_name(const Tessera__V1__Status *st) {
        if (!st)
                return "unknown";
        switch (st->state) {
        case TESSERA__V1__STATUS__STATE__STARTING:
                return "starting";
        case TESSERA__V1__STATUS__STATE__READY:
                return "ready";
        case TESSERA__V1__STATUS__STATE__DRAINING:
                return "draining";
        case TESSERA__V1__STATUS__STATE__UNHEALTHY:
                return "unhealthy";
        default:
                return "unknown";
        }
}

static json_t *worker_json(tsr_worker *w) {
        const Tessera__V1__Status *st = tsr_worker_status(w);
        const Tessera__V1__ModelInfo *mi = tsr_worker_model_info(w);
        json_t *o = json_pack("{s:s, s:b, s:s}", "worker", tsr_worker_endpoint(w), "live", tsr_worker_live(w),
                              "state", status_state_name(st));
        if (!o)
                return NULL;
        if (mi && mi->n_served_model_names)
                json_object_set_new(o, "model", json_string(mi->served_model_names[0]));
        /* Which process answers there: boot_epoch changes on every worker start, so a
         * rolling restart can wait for the new one (live, "ready", another epoch)
         * before stopping the next worker. */
        if (mi && mi->worker_id && mi->worker_id[0])
                json_object_set_new(o, "worker_id", json_string(mi->worker_id));
        if (st) {
                json_object_set_new(o, "boot_epoch", json_integer((json_int_t)st->boot_epoch));
                json_object_set_new(o, "num_running", json_integer(st->num_running));
                json_object_set_new(o, "num_waiting", json_integer(st->num_waiting));
                json_object_set_new(o, "kv_blocks_total", json_integer((json_int_t)st->kv_blocks_total));
                json_object_set_new(o, "kv_blocks_free", json_integer((json_int_t)st->kv_blocks_free));
                /* drained: draining and nothing left to finish */
                json_object_set_new(o, "drained", json_boolean(st->state == TESSERA__V1__STATUS__STATE__DRAINING &&
                                                               st->num_running == 0 && st->num_waiting == 0));
        }
        /* This router's copy of the worker's prefix cache (what kv placement reads). */
        json_object_set_new(o, "prefix_cache_mirror",
                            json_pack("{s:I, s:b}", "blocks", (json_int_t)tsr_worker_mirror_size(w), "exact",
                                      tsr_worker_mirror_exact(w)));
        return o;
}

/* GET /admin/workers: every worker this router knows, with its last Status. */
static void handle_admin_workers(tsr_router_ctx *r, tsr_http_conn *c) {
        json_t *data = json_array();
        for (size_t i = 0; data && i < tsr_worker_pool_count(r->workers); i++)
                json_array_append_new(data, worker_json(tsr_worker_pool_get(r->workers, i)));
        respond_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* POST /admin/workers/drain {"worker": ENDPOINT, "reason"?: TEXT}: the worker stops
 * taking new requests (its Submits get a retryable UNAVAILABLE, so routers place them
 * elsewhere), finishes what it runs and reports DRAINING; every router sees that in
 * its Status and stops placing there.  A drained worker stays drained until it
 * restarts (a rolling restart: drain, wait for "drained" in GET /admin/workers,
 * restart) or until POST /admin/workers/resume with the same body (resume = true):
 * it takes requests again and reports READY.  A worker stopping on SIGTERM cannot be
 * resumed (it logs that and stays DRAINING).  The answer is the worker as
 * GET /admin/workers lists it, with "drain_requested" or "resume_requested". */
static void handle_admin_drain(tsr_router_ctx *r, tsr_http_conn *c, const tsr_http_request *req, bool resume) {
        json_error_t jerr;
        json_t *body = json_loadb((const char *)req->body, req->body_len, 0, &jerr);
        const char *endpoint = NULL, *reason = resume ? "resume requested through the router's /admin/workers/resume"
                                                      : "drain requested through the router's /admin/workers/drain";
        tsr_worker *w;
        tsr_envelope env;
        Tessera__V1__Drain dr;

        if (!body || !json_is_object(body)) {
                tsr_http_conn_respond_error(c, 400, "BadRequestError", "expected a JSON object {\"worker\": ENDPOINT}");
                json_decref(body);
                return;
        }
        endpoint = json_string_value(json_object_get(body, "worker"));
        if (json_is_string(json_object_get(body, "reason")))
                reason = json_string_value(json_object_get(body, "reason"));
        if (!endpoint) {
                tsr_http_conn_respond_error(c, 400, "BadRequestError", "\"worker\" (a string, the worker's endpoint) is required");
                json_decref(body);
                return;
        }
        w = tsr_worker_pool_find(r->workers, endpoint);
        if (!w) {
                char msg[512];
                snprintf(msg, sizeof(msg), "no worker %.400s behind this router (GET /admin/workers lists them)", endpoint);
                tsr_http_conn_respond_error(c, 404, "NotFoundError", msg);
                json_decref(body);
                return;
        }
        tessera__v1__envelope__init(&env);
        tessera__v1__drain__init(&dr);
        dr.reason = (char *)reason;
        dr.resume = resume;
        env.msg_case = TESSERA__V1__ENVELOPE__MSG_DRAIN;
        env.drain = &dr;
        if (tsr_worker_send(w, &env) != TSR_OK) {
                tsr_http_conn_respond_error(c, 503, "ServiceUnavailableError", "the worker's socket did not take the Drain");
                json_decref(body);
                return;
        }
        log_info("worker %s: %s sent (%s)", endpoint, resume ? "Drain (resume)" : "Drain", reason);
        json_t *o = worker_json(w);
        json_decref(body);          /* after: reason may point into it */
        if (o)   /* asked for; its Status says so once the worker has it */
                json_object_set_new(o, resume ? "resume_requested" : "drain_requested", json_true());
        respond_json(c, 200, o);
}

/* The HTTP server counts its connections itself (it knows nothing of the registry);
 * copy its totals in before rendering.  Errors here only lose a sample, never the scrape. */
static void sync_connection_metrics(tsr_router_ctx *r) {
        tsr_http_server_stats sum = {0}, st;
        size_t open = 0, n = r->all_http ? r->n_http : 1;

        /* Every loop's server (--router-threads): their counters are atomic. */
        for (size_t i = 0; i < n; i++) {
                const tsr_http_server *s = r->all_http ? r->all_http[i] : r->http;
                if (!s)
                        continue;
                tsr_http_server_get_stats(s, &st);
                open += tsr_http_server_num_connections(s);
                sum.accepted += st.accepted;
                sum.rejected_cap += st.rejected_cap;
                sum.header_timeouts += st.header_timeouts;
                sum.body_timeouts += st.body_timeouts;
                sum.idle_timeouts += st.idle_timeouts;
        }
        tsr_metrics_gauge_set(r->metrics, TSR_METRICS_CONNECTIONS, NULL, (double)open);
        tsr_metrics_counter_set_total(r->metrics, TSR_METRICS_CONNECTIONS_ACCEPTED, NULL, (double)sum.accepted);
        tsr_metrics_counter_set_total(r->metrics, TSR_METRICS_CONNECTIONS_DROPPED, "cap", (double)sum.rejected_cap);
        tsr_metrics_counter_set_total(r->metrics, TSR_METRICS_CONNECTIONS_DROPPED, "header_timeout",
                                      (double)sum.header_timeouts);
        tsr_metrics_counter_set_total(r->metrics, TSR_METRICS_CONNECTIONS_DROPPED, "body_timeout",
                                      (double)sum.body_timeouts);
        tsr_metrics_counter_set_total(r->metrics, TSR_METRICS_CONNECTIONS_DROPPED, "idle_timeout",
                                      (double)sum.idle_timeouts);
}

static void handle_metrics(tsr_router_ctx *r, tsr_http_conn *c) {
        tsr_buf out;
        sync_connection_metrics(r);
        tsr_buf_init(&out, 64u << 20);
        if (tsr_metrics_render(r->metrics, &out) != TSR_OK)
                tsr_http_conn_respond_error(c, 500, "InternalServerError", "metrics exposition failed");
        else
                tsr_http_conn_respond(c, 200, TSR_METRICS_CONTENT_TYPE, out.data, out.len, NULL);
        tsr_buf_done(&out);
}

typedef struct route {
        const char *path;
        const char *methods;   /* space-separated */
        int id;
} route;

enum {
        R_HEALTH, R_PING, R_VERSION, R_MODELS, R_COMPLETIONS, R_CHAT, R_TOKENIZE, R_DETOKENIZE, R_METRICS,
        R_ADMIN_WORKERS, R_ADMIN_DRAIN, R_ADMIN_RESUME,
};

static const route routes[] = {
        {"/health", "GET", R_HEALTH},
        {"/ping", "GET POST", R_PING},
        {"/version", "GET", R_VERSION},
        {"/v1/models", "GET", R_MODELS},
        {"/v1/completions", "POST", R_COMPLETIONS},
        {"/v1/chat/completions", "POST", R_CHAT},
        {"/tokenize", "POST", R_TOKENIZE},
        {"/detokenize", "POST", R_DETOKENIZE},
        {"/metrics", "GET", R_METRICS},
        {"/metrics/", "GET", R_METRICS},
        {"/admin/workers", "GET", R_ADMIN_WORKERS},
        {"/admin/workers/drain", "POST", R_ADMIN_DRAIN},
        {"/admin/workers/resume", "POST", R_ADMIN_RESUME},
};

static bool method_allowed(const char *methods, const char *m) {
        size_t n = strlen(m);
        for (const char *p = methods; (p = strstr(p, m)) != NULL; p += n)
                if ((p == methods || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0'))
                        return true;
        return false;
}

void tsr_api_handle(void *ud, tsr_http_conn *c, tsr_http_request *req) {
        tsr_router_ctx *r = ud;
        const route *rt = NULL;

        for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
                if (strcmp(req->path, routes[i].path) == 0)
                        rt = &routes[i];
        if (!rt) {
                respond_detail(c, 404, "Not Found");
                return;
        }
        if (!method_allowed(rt->methods, req->method)) {
                respond_detail(c, 405, "Method Not Allowed");
                return;
        }
        if (!authorized(r, req)) {
                respond_json(c, 401, json_pack("{s:s}", "error", "Unauthorized"));
                return;
        }
        switch (rt->id) {
        case R_HEALTH:
        case R_PING:
                handle_health(r, c);
                break;
        case R_VERSION:
                handle_version(r, c);
                break;
        case R_MODELS:
                handle_models(r, c);
                break;
        case R_COMPLETIONS:
                tsr_request_handle_generate(r->requests, c, req, TSR_OAI_COMPLETIONS);
                break;
        case R_CHAT:
                tsr_request_handle_generate(r->requests, c, req, TSR_OAI_CHAT);
                break;
        case R_TOKENIZE:
                tsr_request_handle_tokenize(r->requests, c, req);
                break;
        case R_DETOKENIZE:
                tsr_request_handle_detokenize(r->requests, c, req);
                break;
        case R_METRICS:
                handle_metrics(r, c);
                break;
        case R_ADMIN_WORKERS:
                handle_admin_workers(r, c);
                break;
        case R_ADMIN_DRAIN:
        case R_ADMIN_RESUME:
                handle_admin_drain(r, c, req, rt->id == R_ADMIN_RESUME);
                break;
        }
}
