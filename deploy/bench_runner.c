/* bench_runner.c - bench_runner.h's timed rounds through the worker's runner. */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "deploy/bench_runner.h"
#include "worker/engine/engine.h"

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t tsr_bench_runner_blocks(const tsr_bench_runner_opts *o) {
        int max_b = 1;
        for (size_t i = 0; i < o->n_batches; i++)
                max_b = o->batches[i] > max_b ? o->batches[i] : max_b;
        size_t ctx = (size_t)(16 + o->steps > o->prefill ? 16 + o->steps : o->prefill);
        return (size_t)max_b * ((ctx + TSR_BENCH_BLOCK - 1) / TSR_BENCH_BLOCK);
}

int tsr_bench_runner_run(tsr_runner *r, const tsr_bench_runner_opts *o, size_t vocab, double *decode_ms,
                         double *prefill_ms) {
        const tsr_engine_model *m = tsr_runner_model(r);
        int max_b = 1, rc = -1;
        for (size_t i = 0; i < o->n_batches; i++)
                max_b = o->batches[i] > max_b ? o->batches[i] : max_b;
        size_t ctx = (size_t)(16 + o->steps > o->prefill ? 16 + o->steps : o->prefill);
        size_t n_table = (ctx + TSR_BENCH_BLOCK - 1) / TSR_BENCH_BLOCK, n_tables = o->n_tables ? o->n_tables : 1;
        size_t per_seq = n_tables * n_table;
        uint32_t *tables = malloc((size_t)max_b * per_seq * sizeof(uint32_t));
        uint32_t *tokens = malloc((size_t)(o->prefill > 16 ? o->prefill : 16) * sizeof(uint32_t));
        tsr_engine_seq *seqs = calloc((size_t)max_b, sizeof *seqs);
        float *logits = malloc((size_t)max_b * vocab * sizeof(float));
        uint32_t *next = malloc((size_t)max_b * sizeof(uint32_t));
        if (!tables || !tokens || !seqs || !logits || !next)
                goto out;
        for (size_t b = 0; b < (size_t)max_b; b++)
                for (size_t i = 0; i < per_seq; i++)
                        tables[b * per_seq + i] = (uint32_t)(b * n_table + i % n_table);
        for (int i = 0; i < (o->prefill > 16 ? o->prefill : 16); i++)
                tokens[i] = (uint32_t)(17 + 131 * i) % (uint32_t)vocab;
        for (size_t bi = 0; bi < o->n_batches; bi++) {
                int B = o->batches[bi];
                double best = 1e30;
                for (int rep = 0; rep < o->repeat; rep++) {
                        for (int b = 0; b < B; b++)
                                seqs[b] = (tsr_engine_seq){.block_table = tables + (size_t)b * per_seq,
                                                           .n_table = n_table, .tokens = tokens, .n = 16,
                                                           .want_logits = true, .state_slot = (uint32_t)b};
                        if (m->forward(m->ud, seqs, (size_t)B, logits) != TSR_OK)
                                goto out;
                        double t0 = now_s();
                        for (int s = 0; s < o->steps; s++) {
                                for (int b = 0; b < B; b++) {
                                        next[b] = (uint32_t)(b * 7 + s) % (uint32_t)vocab;
                                        seqs[b].tokens = &next[b];
                                        seqs[b].n = 1;
                                        seqs[b].past_len = 16 + (size_t)s;
                                }
                                if (m->forward(m->ud, seqs, (size_t)B, logits) != TSR_OK)
                                        goto out;
                        }
                        double ms = (now_s() - t0) * 1e3 / o->steps;
                        best = ms < best ? ms : best;
                }
                decode_ms[bi] = best;
        }
        double best = 1e30;
        for (int rep = 0; rep < o->repeat; rep++) {
                seqs[0] = (tsr_engine_seq){.block_table = tables, .n_table = n_table, .tokens = tokens,
                                           .n = (size_t)o->prefill, .want_logits = true};
                double t0 = now_s();
                if (m->forward(m->ud, seqs, 1, logits) != TSR_OK)
                        goto out;
                double ms = (now_s() - t0) * 1e3;
                best = ms < best ? ms : best;
        }
        *prefill_ms = best;
        rc = 0;
out:
        free(tables);
        free(tokens);
        free(seqs);
        free(logits);
        free(next);
        return rc;
}

