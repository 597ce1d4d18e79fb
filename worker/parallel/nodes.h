/* nodes.h - a replica over several nodes (issue #20): pp / nnodes consecutive pipeline
 * stages per node (the runner's; one usually), node 0 (the leader) schedules and
 * serves, nodes 1 .. n-1 (followers, started with --headless) run their stages of every
 * step.  Below, "stage" is a node's part.
 *
 * Joining.  Every node binds a comm listener on the address its traffic to node 0 leaves
 * from and meets the others at --master-addr:--master-port (bootstrap.h: NodeHello with
 * a fingerprint of the model file and of everything the stages must agree on, NodeSetup
 * with a new epoch).  The group is then the comm layer's zmq backend, one rank per node.
 * Each follower first says what its KV pool holds (blocks, state slots); the leader takes
 * the minimum over the nodes, itself included, and only then serves (Status READY).
 *
 * One step, on the leader's engine thread: the control header and the step plan (the
 * engine's sequences: block tables as changes (tsr_plan_tables), tokens, positions,
 * state slots; the followers need nothing else, since the block ids are global and each
 * node stores its own layers' KV) go to every follower; stage 0 runs; its output goes to node 1, whose output goes to
 * node 2, ...; the last node sends the logits rows back to node 0, each row the engine
 * offers as its token (no logprobs, penalty, bias or grammar) as that token, sampled
 * there as node 0's sampler would (nodes.c token_back).  Every stage-to-stage
 * message starts with its sender's status (a stage that failed still sends, so the step
 * fails at once everywhere while the group stays up).
 *
 * Micro-batches (TESSERA_PP_MAX_IN_FLIGHT): tsr_nodes_submit is a step's first half (the
 * plan out, stage 0, its output on to node 1) and tsr_nodes_wait its second (the logits
 * rows back), so node 0 can start the next step while the followers run this one; every
 * node runs the steps in the order they come (the messages of one tag are FIFO).
 *
 * Failures.  A comm failure (a follower killed: TSR_E_CLOSED within a fraction of a
 * second; a host gone silent: ZeroMQ's heartbeat, 5 s; a stall past the step deadline:
 * TSR_E_TIMEOUT) fails the step and takes the group down: tsr_nodes_up turns false (the
 * worker's Status says UNHEALTHY, so routers place nowhere here), steps fail at once with
 * TSR_E_UNAVAILABLE, and a thread of this module waits for the nodes to meet again (a
 * follower returns to the rendezvous by itself, or is restarted by its supervisor).  The
 * new group is installed by the engine thread in tsr_nodes_generation, which then
 * returns a new number: a follower may have restarted with an empty KV pool, so the
 * engine forgets its prefix cache before it schedules on the new group.  A follower whose
 * group breaks goes back to the rendezvous once; if node 0 does not come within the join
 * deadline it exits non-zero, to be restarted.
 *
 * Threads: the leader's tsr_nodes_step from the thread that runs the engine's forward
 * (the engine thread, or its step thread with --async-scheduling), tsr_nodes_generation
 * and tsr_nodes_idle from the engine thread, one call at a time: the engine never
 * calls the model's kv_generation or idle while a step runs (engine.h);
 * tsr_nodes_renewal_pending, tsr_nodes_up and tsr_nodes_abort from any thread;
 * start/free from the main thread.  tsr_nodes_follow runs on the follower's main thread;
 * tsr_nodes_stop from any thread (a signal thread). */
#ifndef TSR_PARALLEL_NODES_H
#define TSR_PARALLEL_NODES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "worker/engine/engine.h"

typedef struct tsr_nodes tsr_nodes;

typedef struct tsr_nodes_cfg {
        uint32_t nnodes;                /* 2 .. TSR_COMM_MAX_RANKS; one pipeline stage each */
        uint32_t node_rank;
        const char *master_addr;
        uint16_t master_port;
        const char *fingerprint;        /* what every node must agree on, as key=value lines */
        uint32_t join_timeout_ms;       /* bound of one rendezvous */
        uint32_t step_timeout_ms;       /* bound of every wait inside a step */
        /* This node's KV pool: blocks and recurrent-state slots (the leader's own). */
        uint64_t kv_blocks;
        uint32_t state_slots;
        uint32_t n_kv_tables;           /* block tables per sequence (engine.h; 0 or 1: one) */
} tsr_nodes_cfg;

/* What a follower's stage does with one step: `in` holds io_floats from the previous
 * stage; `out` receives io_floats for the next stage, or out_floats (the logits rows) on
 * the last.  The sequences are the leader's plan, decoded. */
typedef tsr_status (*tsr_nodes_stage_fn)(void *ud, const tsr_engine_seq *seqs, size_t n_seqs, const float *in,
                                         float *out);

/* ---- the leader (node 0) ---- */

/* Meet the followers (bounded by cfg->join_timeout_ms) and hear their KV capacity.
 * *kv_blocks / *state_slots: the minimum over every node (the engine's capacity).
 * TSR_E_TIMEOUT (a node never came: err names it), TSR_E_PROTO (a node disagrees: err
 * names the node and the field), TSR_E_IO, TSR_E_NOMEM.  Main thread. */
tsr_status tsr_nodes_lead(const tsr_nodes_cfg *cfg, uint64_t *kv_blocks, uint32_t *state_slots, tsr_nodes **ret,
                          char *err, size_t errlen);
/* One step.  stage0(stage0_ud, act) runs stage 0 of `seqs` into act (io_floats), between
 * the plan's sending and the activations' (the followers decode the plan meanwhile); the
 * logits rows (out_floats) land in `logits`.  Returns the first failing stage's status,
 * TSR_E_UNAVAILABLE while the group is down, or the comm's failure, which takes the
 * group down (above).  The engine's forward thread (above). */
tsr_status tsr_nodes_step(tsr_nodes *n, const tsr_engine_seq *seqs, size_t n_seqs, size_t io_floats,
                          size_t out_floats, tsr_status (*stage0)(void *ud, float *act), void *stage0_ud,
                          float *logits);
/* tsr_nodes_step in two halves, for micro-batches: submit sends the plan, runs stage 0 and
 * sends its output on (TSR_OK: the step is in flight, its wait owed; else it is not, and
 * a comm failure took the group down); wait receives the oldest step's logits rows.  The
 * followers run the steps in the order they come.  A wait after the group failed under
 * an earlier step answers TSR_E_UNAVAILABLE.  The engine's forward thread (above). */
tsr_status tsr_nodes_submit(tsr_nodes *n, const tsr_engine_seq *seqs, size_t n_seqs, size_t io_floats,
                            size_t out_floats, tsr_status (*stage0)(void *ud, float *act), void *stage0_ud);
tsr_status tsr_nodes_wait(tsr_nodes *n, size_t out_floats, float *logits);
/* Install a group that has met again, if one has; returns the group's generation (1 for
 * the first, + 1 for each new one).  Engine thread, before it schedules a step, never
 * while a step runs (the old group is freed here). */
uint64_t tsr_nodes_generation(tsr_nodes *n);
/* Whether a group that met again waits for tsr_nodes_generation.  Any thread. */
bool tsr_nodes_renewal_pending(tsr_nodes *n);
/* While the engine waits for work: drive the group's sockets (tsr_comm_progress), so a
 * follower that died is noticed (the group goes down, Status UNHEALTHY) within about
 * two polls.  Engine thread. */
void tsr_nodes_idle(tsr_nodes *n);
/* Whether a group is up (installed or waiting to be).  Any thread. */
bool tsr_nodes_up(const tsr_nodes *n);
/* Fail the step in flight, if any (tsr_comm_abort).  Any thread. */
void tsr_nodes_abort(tsr_nodes *n);
/* Stop the rejoin thread, free the group (the followers see it close); NULL is fine. */
void tsr_nodes_free(tsr_nodes **n);

/* ---- a follower (node r > 0, --headless) ---- */

/* Serve stage cfg->node_rank of every step until stopped: meet node 0, say this node's
 * capacity, run steps; when the group breaks, meet again (bounded by the join deadline).
 * Returns TSR_OK after tsr_nodes_stop, else why it gave up (err: one line).  Main thread. */
tsr_status tsr_nodes_follow(const tsr_nodes_cfg *cfg, tsr_nodes_stage_fn fn, void *ud, size_t hidden_floats,
                            size_t vocab, char *err, size_t errlen);
/* Make tsr_nodes_follow return promptly.  Any thread, not a signal handler. */
void tsr_nodes_stop(void);

/* ---- the step plan on the wire (exposed for the tests) ---- */

/* What one end knows of the sequences' block tables, so that a plan carries only what
 * changed in them (vLLM's scheduler output sends a running request's new block ids, not
 * its table): each seq_id's tables as the last plan that held it had them, for the
 * sequences of the last TSR_PLAN_TABLES_AGE plans.  The leader updates its copy as it
 * packs each plan and a follower its own as it unpacks them, in the same order, and both
 * forget the same entries, so the two agree without a word about it; a new group starts
 * both empty.  Zeroed = empty. */
#define TSR_PLAN_TABLES_AGE 16
/* The smallest vocabulary whose rows come back from the last node with their logprobs
 * (tsr_engine_model.answers_logprobs): the longest answer (token, logprob, rank, n_top,
 * 20 ids, 20 logprobs) fits in a row, so the last node lays answers over rows in place. */
#define TSR_NODES_LP_MIN_VOCAB (4 + 2 * TSR_SAMPLER_MAX_LOGPROBS)

typedef struct tsr_plan_table {
        uint64_t seq_id;
        uint64_t last_plan;             /* the plan (count) that last held it */
        size_t n_table;                 /* entries per table */
        uint32_t *blocks;               /* [n_tables x n_table] */
} tsr_plan_table;

typedef struct tsr_plan_tables {
        tsr_plan_table *e;              /* sorted by seq_id */
        size_t n, cap;
        uint64_t plans;                 /* plans packed or unpacked */
        /* block-table words the plans carried, and what whole tables would have taken */
        uint64_t words_sent, words_whole;
} tsr_plan_tables;

/* Forget every table (a new group); the counters stay. */
void tsr_plan_tables_clear(tsr_plan_tables *t);

/* Encode `seqs` (each with n_tables block tables of n_table entries, one after the other:
 * engine.h) into a new buffer (*buf, *len; free()), their tables as changes against
 * `known` as it was before the plan (NULL: whole tables), which then holds them (for a
 * seq_id met twice in the plan, or shared: 0 where nobody set it, the last one's).  Such
 * ids cost bytes, never correctness.  TSR_E_NOMEM. */
tsr_status tsr_nodes_plan_pack(tsr_plan_tables *known, const tsr_engine_seq *seqs, size_t n_seqs,
                               uint32_t n_tables, uint8_t **buf, size_t *len);
/* Decode a plan of sequences with n_tables block tables each, their tables completed
 * from `known` (NULL: a plan with changes is refused), which then holds them: *seqs
 * points into one allocation (free(*seqs)) whose arrays point into itself.  TSR_E_PROTO
 * for anything malformed (lengths that disagree, counts past the buffer, changes to a
 * table this end does not hold); TSR_E_NOMEM.  Never reads past buf + len. */
tsr_status tsr_nodes_plan_unpack(tsr_plan_tables *known, const uint8_t *buf, size_t len, uint32_t n_tables,
                                 tsr_engine_seq **seqs, size_t *n_seqs);

#endif
