/* serve.c - the engine and io threads of a worker process (see serve.h). */
#include "worker/serve.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "common/log.h"
#include "common/queue.h"
#include "worker/engine/grammar_vocab.h"

tsr_status tsr_worker_serve(const tsr_worker_serve_opts *o) {
        const tsr_config *cfg = o->cfg;
        tsr_queue *inbox = NULL, *outbox = NULL;
        tsr_engine *engine = NULL;
        tsr_grammar_vocab *gvocab = NULL;
        tsr_grammar_pool *gpool = NULL;
        sigset_t stop_signals;
        tsr_status st = TSR_E_INTERNAL;
        int sfd;

        sigemptyset(&stop_signals);
        sigaddset(&stop_signals, SIGTERM);
        sigaddset(&stop_signals, SIGINT);
        pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);
        sfd = signalfd(-1, &stop_signals, SFD_CLOEXEC | SFD_NONBLOCK);
        if (sfd < 0) {
                log_error("signalfd: %s", strerror(errno));
                return TSR_E_IO;
        }
        if (tsr_queue_new(4096, &inbox) != TSR_OK || tsr_queue_new(4096, &outbox) != TSR_OK) {
                log_error("out of memory");
                st = TSR_E_NOMEM;
                goto out;
        }
        /* Structured outputs: the vocabulary xgrammar masks over and the compile thread.
         * Without them the worker still serves; such requests are refused. */
        if (o->model) {
                char gerr[256] = "";
                if (tsr_engine_grammar_vocab(o->meta, o->model->vocab, &gvocab, gerr, sizeof(gerr)) != TSR_OK ||
                    tsr_grammar_pool_new(gvocab, &gpool) != TSR_OK)
                        log_warn("structured outputs unavailable: %s", gerr[0] ? gerr : "out of memory");
        }
        tsr_engine_params ep = {
                .grammar = gpool,
                .model = o->model,
                .kv_blocks_total = o->plan->kv_blocks_total,
                .block_size = (uint32_t)cfg->block_size,
                .max_model_len = o->plan->max_model_len,
                .max_num_seqs = o->plan->max_num_seqs,
                .max_num_batched_tokens = o->plan->max_num_batched_tokens,
                .enable_prefix_caching = cfg->enable_prefix_caching != TSR_TRI_FALSE,
                .state_slots = o->plan->state_slots,
                .state_block = o->plan->state_block,
                .prefill_align = o->plan->prefill_align,
                .n_kv_tables = o->plan->n_kv_tables,
                .hash_algo = o->hash_algo,
                .priority_scheduling = strcmp(cfg->scheduling_policy, "priority") == 0,
                .eos_ids = o->meta->eos_token_ids,
                .n_eos_ids = o->meta->n_eos_token_ids,
                .seed = (uint64_t)cfg->seed,
                /* SIGTERM: link.c stops admitting, the engine finishes or aborts (engine.h) */
                .shutdown_timeout_ms = (uint64_t)cfg->shutdown_timeout * 1000u,
                .async_scheduling = cfg->async_scheduling,
                .long_prefill_token_threshold = (uint32_t)cfg->long_prefill_token_threshold,
                .alive = o->alive,
                .alive_interval_ms = o->alive_interval_ms,
        };
        memcpy(ep.kv_chunk, o->plan->kv_chunk, sizeof ep.kv_chunk);
        if (tsr_engine_start(&ep, inbox, outbox, &engine) != TSR_OK) {
                log_error("cannot start the engine thread");
                goto out;
        }
        tsr_link_opts lo = {
                .listen = cfg->worker_listen,
                .status_listen = o->plan->status_listen,
                .status_interval_ms = cfg->status_interval_ms,
                .worker_id = o->plan->worker_id,
                .boot_epoch = o->plan->boot_epoch,
                .model_info_full = o->model_info_full,
                .model_info_full_len = o->model_info_full_len,
                .model_info_lean = o->model_info_lean,
                .model_info_lean_len = o->model_info_lean_len,
                .tokenizer_hash = o->meta->tokenizer_hash,
                .on_listening = o->on_listening,
                .on_stopping = o->on_stopping,
                .curve = o->curve,
                .log_stats_interval_s = o->log_stats_interval_s,
                .model = o->model,
                .kv_block_bytes = o->plan->kv_block_bytes,
                .state_slot_bytes = o->plan->state_slot_bytes,
        };
        st = tsr_link_run(&lo, inbox, outbox, sfd);
out:
        tsr_engine_stop(&engine);
        tsr_grammar_pool_free(&gpool);   /* after the engine: it held jobs */
        tsr_grammar_vocab_free(&gvocab);
        if (outbox) {
                tsr_engine_out *eo;
                while ((eo = tsr_queue_pop(outbox)) != NULL)
                        tsr_engine_out_free(eo);
        }
        if (inbox) {
                tsr_engine_in *ei;
                while ((ei = tsr_queue_pop(inbox)) != NULL)
                        tsr_engine_in_free(ei);
        }
        tsr_queue_free(&inbox);
        tsr_queue_free(&outbox);
        close(sfd);
        return st;
}
