/* placement.h - which worker gets a request: capacity filters, prefix overlap, load, pure
 * (docs/architecture.md describes the policy).
 *
 * The request path (router/request/dispatch.c, loop thread) lists the live workers
 * serving the model; tsr_placement_cand_fill builds one candidate per worker from that
 * worker's last Status, its prefix-cache mirror and what this router sent it since that
 * Status, and tsr_placement_pick returns an index.  Nothing here touches sockets or the
 * clock, so the unit tests drive it directly.
 *
 *   filter  kv_free >= (B - h) + reserve      room for the prefill and some decode
 *           kv_active / kv_total <= 0.8       not saturated
 *           num_waiting < queue_cap           queue not backed up
 *           (a worker that reports no KV total skips the two KV filters; when no
 *           candidate passes, all are kept: the engines queue, the router never
 *           refuses a request that some worker could take later)
 *   cost    when every candidate's Status carries the worker's step timing (its
 *           prefill rate P tokens/s and decode step D ms, measured by its engine):
 *           the estimated TTFT in ms,
 *             ((B - h + pending_prefill_blocks) * block_size + waiting_prompt_tokens) / P
 *             + 1.5 D when the worker is decoding (running or pending requests)
 *           otherwise, in blocks:
 *             max(0, (B - h) + Q) + w_d * D
 *             Q = waiting_prompt_tokens / block_size + pending_prefill_blocks
 *             D = kv_active + pending_decode_blocks
 *             w_d = TSR_PLACEMENT_DECODE_WEIGHT (1, below)
 *   guard   load = running + waiting + pending_requests; when max - min > 64 and
 *           max > 1.5 min, only workers with load <= min + 64 stay, and among them
 *           the longest prefix hit wins (SGLang's imbalance guard): a hot prefix
 *           cannot pile every request onto one worker
 *   pick    argmin cost; ties to fewer waiting, then lower load, then the earlier
 *           index (the caller lists workers from a rotating start)
 *
 * B = full blocks of the prompt, h = the leading ones the worker has cached.  The
 * "pending" terms are what this router dispatched there that the worker's last Status
 * does not count yet (its submit_acks say which).  Other routers' dispatches reach us
 * only through Status: a worker counts a Submit as waiting from the moment it reads it
 * and publishes a Status within 5 ms of it, so several routers see each other's
 * placements a few milliseconds late instead of up to a step or a status interval
 * (herding: without it, routers that each saw the same idle worker all sent there). */
#ifndef TSR_ROUTER_PLACEMENT_H
#define TSR_ROUTER_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* w_d: the weight of a block of running requests' KV against a block to prefill.
 * 1, as Dynamo (routers.md §6.4).  0.25 was measured (docs/benchmarks.md, "Router at
 * scale"): the prefix-cache hit rate rose (prefix_repetition on 4 workers 53% -> 80%,
 * on 16 64% -> 93%) but TTFT p50 fell behind, because the repeats piled onto the few
 * workers holding a prefix (load max/mean up to 8) and a request joining a running
 * batch waits for its decode step, while an idle worker that misses only prefills.
 * With 1, hot prefixes spread to idle workers and get cached there too. */
#define TSR_PLACEMENT_DECODE_WEIGHT 1.0

typedef struct tsr_placement_cand {
        size_t blocks;                   /* B */
        size_t hits;                     /* h (clamped to B) */
        uint32_t block_size;             /* 0 counts as 1 */
        uint64_t waiting_prompt_tokens;  /* the worker's queued prefill, in tokens */
        uint32_t num_running, num_waiting;
        uint64_t kv_total, kv_free, kv_active;  /* blocks; kv_total 0 = not reported */
        uint64_t reserve_blocks;         /* decode room wanted besides the prefill */
        /* Dispatched by this router since the worker's last Status. */
        uint64_t pending_prefill_blocks, pending_decode_blocks;
        uint32_t pending_requests;
        /* The worker's step timing (Status; 0 = not measured). */
        double prefill_tps;              /* prefill tokens per second */
        double decode_ms;                /* a decoding step's milliseconds */
} tsr_placement_cand;

/* What this router sent one worker that the worker's last Status does not count: the
 * "pending" terms above (the request layer sums them per worker). */
typedef struct tsr_placement_pending {
        uint64_t prefill_blocks, decode_blocks;
        uint32_t requests;
} tsr_placement_pending;

typedef struct tsr_placement_params {
        double saturation;               /* kv_active / kv_total above this is filtered (0.8) */
        uint32_t queue_cap;              /* num_waiting at or above this is filtered (128) */
        double guard_abs;                /* imbalance guard: absolute load gap (64) */
        double guard_rel;                /* ... and relative ratio (1.5) */
} tsr_placement_params;

#define TSR_PLACEMENT_DEFAULTS ((tsr_placement_params){0.8, 128, 64.0, 1.5})

/* Why a pick came out as it did, for logs and metrics. */
typedef enum tsr_placement_path {
        TSR_PLACE_COST = 0,              /* argmin cost over the filtered candidates */
        TSR_PLACE_ALL_FILTERED = 1,      /* no candidate passed: argmin cost over all */
        TSR_PLACE_GUARD = 2,             /* the imbalance guard chose by prefix hits */
} tsr_placement_path;

double tsr_placement_cost(const tsr_placement_cand *c);
/* Whether c's worker reported its step timing (prefill_tps and decode_ms > 0). */
bool tsr_placement_timed(const tsr_placement_cand *c);
/* The estimated time to first token on c's worker, in ms (needs timing): the prompt's
 * uncached blocks, the prefill queued and pending there, at its prefill rate, plus 1.5
 * decode steps when it is decoding (the rest of the current step, on average half,
 * and the step our prefill joins). */
double tsr_placement_ttft_ms(const tsr_placement_cand *c);
/* requests running, waiting, and sent since the last Status */
double tsr_placement_load(const tsr_placement_cand *c);
int tsr_placement_passes(const tsr_placement_cand *c, const tsr_placement_params *p);
/* Index of the chosen candidate, (size_t)-1 when n == 0.  `path` may be NULL. */
size_t tsr_placement_pick(const tsr_placement_cand *c, size_t n, const tsr_placement_params *p,
                          tsr_placement_path *path);

/* --routing-policy least_load: the lowest tsr_placement_load, ties to the earlier
 * index; (size_t)-1 when n == 0. */
size_t tsr_placement_pick_least_load(const tsr_placement_cand *c, size_t n);

/* Decode room a request asks of a worker: ceil(max_tokens / block_size), capped at
 * 16 blocks so that a chat request defaulting to "the rest of the context" does not
 * filter out every worker. */
uint64_t tsr_placement_reserve(uint64_t max_tokens, uint32_t block_size);

/* Prompts this router placed in the last TSR_PLACEMENT_RECENT_NS, per worker (kv
 * policy).  A worker's STORED events for a prompt reach the mirror only after its
 * prefill ran and the next Status went out (100 ms and more later); until then a
 * second request with the same prefix sees no hit anywhere and the kv policy placed
 * it by load, often elsewhere, computing the prefix twice.  routers.md §6.4's fallback
 * "approximate tree keyed by routed requests" (Dynamo's ApproxKvIndexer), kept short
 * because the exact mirror takes over once the events arrive.  At Poisson 1.5 req/s
 * per worker it adds 1-2 points of hit rate (docs/benchmarks.md, "Router at scale");
 * bursts of one prefix are where it counts.
 * The worker's engine makes a request wait for prompt blocks that another running
 * request is computing, so a recent placement counts as a hit, like the mirror's.
 * A ring of the last TSR_PLACEMENT_RECENT_MAX placements with their hash chains;
 * one per request layer (loop thread), zero-initialised, freed by _done. */
#define TSR_PLACEMENT_RECENT_MAX 256
#define TSR_PLACEMENT_RECENT_NS (2000ull * 1000000ull)

typedef struct tsr_placement_recent_entry {
        const void *w;                   /* the worker, by identity; NULL = free slot */
        uint64_t at_ns;                  /* monotonic time of the placement */
        uint64_t *hashes;                /* the prompt's block-hash chain (owned) */
        size_t n;
} tsr_placement_recent_entry;

typedef struct tsr_placement_recent {
        tsr_placement_recent_entry e[TSR_PLACEMENT_RECENT_MAX];
        size_t next;
} tsr_placement_recent;

/* Remember that the prompt with chain hashes[0..n) went to w at now_ns (n == 0 or no
 * memory: nothing is remembered, which only costs placement quality). */
void tsr_placement_recent_add(tsr_placement_recent *r, const void *w, const uint64_t *hashes, size_t n,
                              uint64_t now_ns);
/* One request's view of the ring: for each worker with a live entry sharing at least
 * the prompt's first block, the longest shared run (sorted by worker, one per worker). */
typedef struct tsr_placement_recent_hit {
        const void *w;
        size_t hits;
} tsr_placement_recent_hit;

typedef struct tsr_placement_recent_match {
        tsr_placement_recent_hit h[TSR_PLACEMENT_RECENT_MAX];
        size_t n;
} tsr_placement_recent_match;

/* One pass over the ring for the prompt hashes[0..n) at now_ns, into *m: an entry counts
 * when it is younger than TSR_PLACEMENT_RECENT_NS and shares the first hash.  The chain
 * is chained (hash i covers blocks 0..i), so a shared hash at i means a shared prefix up
 * to i: a binary search per such entry.  Once per request, not per candidate worker:
 * at 64 workers the per-worker scan of all 256 entries was 15-20 us of a 28 us placement
 * (docs/benchmarks.md, "Router at scale"). */
void tsr_placement_recent_scan(const tsr_placement_recent *r, const uint64_t *hashes, size_t n, uint64_t now_ns,
                               tsr_placement_recent_match *m);
/* w's hits in a scan's result (0: none), by binary search. */
size_t tsr_placement_recent_lookup(const tsr_placement_recent_match *m, const void *w);
/* The longest leading run of hashes[0..n) shared with a prompt placed on w within
 * TSR_PLACEMENT_RECENT_NS of now_ns: the whole ring for one worker (lookup after a scan
 * gives the same; tests and tessera-bench-mirror compare the two). */
size_t tsr_placement_recent_hits(const tsr_placement_recent *r, const void *w, const uint64_t *hashes, size_t n,
                                 uint64_t now_ns);
/* Forget every placement on w (the worker left; its address may be reused). */
void tsr_placement_recent_forget(tsr_placement_recent *r, const void *w);
void tsr_placement_recent_done(tsr_placement_recent *r);

struct tsr_worker;
struct Tessera__V1__Status;

/* Fill *c for worker w from its last Status `st` (NULL: none yet, no load known), what
 * this router sent it since (`p`, NULL: nothing), the block size of the prompt's hash
 * chain and the request's max_tokens (the decode reserve), and for the kv policy the
 * prompt's block-hash chain: B is n_hashes, h the leading ones in w's prefix-cache
 * mirror (`hashes` NULL or n_hashes 0: both 0, which the other policies pass).
 * Loop thread: reads w's mirror and Status, which only the loop writes. */
void tsr_placement_cand_fill(tsr_placement_cand *c, const struct tsr_worker *w, const struct Tessera__V1__Status *st,
                             const tsr_placement_pending *p, uint32_t block_size, uint64_t max_tokens,
                             const uint64_t *hashes, size_t n_hashes);

/* Count a dispatch to the worker of candidate c in p: its prefill blocks (B - h), its
 * decode blocks (B) and one request. */
void tsr_placement_pending_add(tsr_placement_pending *p, const tsr_placement_cand *c);

/* The Submits this router sent one worker that the worker's Status may not count yet,
 * oldest first.  A Submit leaves once a Status acknowledges its id (the worker's
 * submit_acks entry for this router: every id up to it was read and is counted), or,
 * from a worker whose Status carries no acknowledgement for us, once a Status newer
 * than the one current when it was sent arrives (which may drop one the Status does
 * not count yet: the rule before acknowledgements).  A new boot epoch empties it. */
typedef struct tsr_placement_sent {
        uint64_t id;                     /* the Submit's request id: increasing per router */
        uint64_t status_seq;             /* the worker's Status seq when it was sent */
        tsr_placement_pending terms;
} tsr_placement_sent;

typedef struct tsr_placement_sent_list {
        uint64_t boot_epoch;
        tsr_placement_sent *items;
        size_t n, cap;
        tsr_placement_pending total;     /* the items' terms, summed as they come and go */
        /* The Status last pruned against (tsr_placement_sent_prune), so that a caller
         * prunes once per Status, not once per placement. */
        bool pruned;
        uint64_t pruned_seq;
} tsr_placement_sent_list;

/* Most Submits kept per worker; past it the oldest are forgotten (a worker that
 * acknowledges nothing for that long is down, or about to be declared so). */
#define TSR_PLACEMENT_SENT_MAX 4096

/* Drop what the worker's current Status (boot_epoch, status_seq; `acked`: it has an
 * acknowledgement `ack` for us) counts, as above, and remember that Status. */
void tsr_placement_sent_prune(tsr_placement_sent_list *l, uint64_t boot_epoch, uint64_t status_seq, bool acked,
                              uint64_t ack);
/* Append Submit `id`, sent while Status status_seq was current, placed as candidate
 * c; false when out of memory (then it is simply not counted). */
bool tsr_placement_sent_add(tsr_placement_sent_list *l, uint64_t id, uint64_t status_seq,
                            const tsr_placement_cand *c);
/* The sum of l's Submits (l NULL: zeros): placement's "pending" terms for that worker. */
void tsr_placement_sent_sum(const tsr_placement_sent_list *l, tsr_placement_pending *sum);
void tsr_placement_sent_free(tsr_placement_sent_list *l);

#endif
