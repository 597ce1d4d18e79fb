/* engine.c - the engine thread.  Until issue #4 this is the skeleton: no model runner,
 * every Submit refused with a clear, retryable Error; capacity reported as configured. */
#include "engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

struct tsr_engine {
        pthread_t thread;
        engine_params params;
        tsr_queue *inbox;
        tsr_queue *outbox;
        engine_stats stats;
};

void engine_in_free(engine_in *in) {
        if (!in)
                return;
        tsr_wire_free(in->env);
        free(in);
}

void engine_out_free(engine_out *out) { free(out); }

/* The engine never blocks on the network; a full outbox means the io thread is
 * behind, so wait for it briefly (bounded) rather than drop a reply. */
static void push_out(tsr_engine *e, engine_out *out) {
        for (int tries = 0; tries < 1000; tries++) {
                tsr_status st = tsr_queue_push(e->outbox, out);
                if (st == TSR_OK)
                        return;
                if (st == TSR_E_CLOSED)
                        break;
                nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        }
        log_warn("outbox full or closed: dropped a %s message",
                 out->kind == ENGINE_OUT_STATS ? "stats" : "error");
        engine_out_free(out);
}

static void publish_stats(tsr_engine *e) {
        engine_out *out = calloc(1, sizeof(*out));
        if (!out)
                return;
        out->kind = ENGINE_OUT_STATS;
        out->stats = e->stats;
        push_out(e, out);
}

static void refuse_submit(tsr_engine *e, engine_in *in) {
        engine_out *out = calloc(1, sizeof(*out));
        if (!out)
                return;
        out->kind = ENGINE_OUT_ERROR;
        memcpy(out->router_id, in->router_id, in->router_id_len);
        out->router_id_len = in->router_id_len;
        snprintf(out->request_id, sizeof(out->request_id), "%s", in->env->submit->request_id);
        out->error_code = TESSERA__V1__ERROR_CODE__ERROR_UNAVAILABLE;
        out->retryable = true;
        snprintf(out->message, sizeof(out->message),
                 "this worker has no model runner yet (engine issue #4): it serves model info only");
        log_req(TSR_LOG_INFO, out->request_id, "submit refused: no model runner (prompt_tokens=%zu)",
                in->env->submit->n_prompt_token_ids);
        push_out(e, out);
}

static void *engine_main(void *arg) {
        tsr_engine *e = arg;
        engine_in *in;

        tsr_log_set_thread("engine");
        log_info("engine up: kv_blocks=%llu block_size=%u max_model_len=%u (no model runner: skeleton)",
                 (unsigned long long)e->params.kv_blocks_total, e->params.block_size, e->params.max_model_len);
        publish_stats(e);
        /* pop_wait returns NULL only when the inbox is closed and empty. */
        while ((in = tsr_queue_pop_wait(e->inbox, -1)) != NULL) {
                switch (in->kind) {
                case ENGINE_IN_SUBMIT:
                        refuse_submit(e, in);
                        break;
                case ENGINE_IN_ABORT:
                        /* Nothing runs, so nothing to abort; Abort is idempotent anyway. */
                        break;
                }
                engine_in_free(in);
        }
        log_info("engine stopped");
        return NULL;
}

tsr_status tsr_engine_start(const engine_params *p, tsr_queue *inbox, tsr_queue *outbox, tsr_engine **ret) {
        tsr_engine *e = calloc(1, sizeof(*e));
        if (!e)
                return TSR_E_NOMEM;
        e->params = *p;
        e->inbox = inbox;
        e->outbox = outbox;
        e->stats.ready = false;
        e->stats.kv_blocks_total = p->kv_blocks_total;
        e->stats.kv_blocks_free = p->kv_blocks_total;
        e->stats.max_num_seqs = p->max_num_seqs;
        if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
                free(e);
                return TSR_E_INTERNAL;
        }
        *ret = e;
        return TSR_OK;
}

void tsr_engine_stop(tsr_engine **ep) {
        tsr_engine *e;
        if (!ep || !*ep)
                return;
        e = *ep;
        tsr_queue_close(e->inbox);
        pthread_join(e->thread, NULL);
        free(e);
        *ep = NULL;
}
