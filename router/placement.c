/* placement.c - the placement inputs and formula (see placement.h). */
#include "router/placement.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "router/worker_link.h"

static uint64_t prefill_blocks(const tsr_placement_cand *c) {
        return c->hits < c->blocks ? (uint64_t)(c->blocks - c->hits) : 0;
}

double tsr_placement_load(const tsr_placement_cand *c) {
        return (double)c->num_running + (double)c->num_waiting + (double)c->pending_requests;
}

double tsr_placement_cost(const tsr_placement_cand *c) {
        double bs = c->block_size ? (double)c->block_size : 1.0;
        double q = (double)c->waiting_prompt_tokens / bs + (double)c->pending_prefill_blocks;
        double d = (double)c->kv_active + (double)c->pending_decode_blocks;
        return (double)prefill_blocks(c) + q + TSR_PLACEMENT_DECODE_WEIGHT * d;
}

bool tsr_placement_timed(const tsr_placement_cand *c) { return c->prefill_tps > 0 && c->decode_ms > 0; }

double tsr_placement_ttft_ms(const tsr_placement_cand *c) {
        double bs = c->block_size ? (double)c->block_size : 1.0;
        double tokens = (double)(prefill_blocks(c) + c->pending_prefill_blocks) * bs + (double)c->waiting_prompt_tokens;
        bool decoding = c->num_running + c->pending_requests > 0;
        return tokens / c->prefill_tps * 1e3 + (decoding ? 1.5 * c->decode_ms : 0.0);
}

int tsr_placement_passes(const tsr_placement_cand *c, const tsr_placement_params *p) {
        if (c->num_waiting >= p->queue_cap)
                return 0;
        if (c->kv_total == 0)           /* no KV report: nothing to filter on */
                return 1;
        if (c->kv_free < prefill_blocks(c) + c->reserve_blocks)
                return 0;
        return (double)c->kv_active <= p->saturation * (double)c->kv_total;
}

/* Strictly better than the incumbent under the tie-break order of placement.h. */
static bool better(const tsr_placement_cand *a, double cost_a, const tsr_placement_cand *b, double cost_b) {
        if (cost_a != cost_b)
                return cost_a < cost_b;
        if (a->num_waiting != b->num_waiting)
                return a->num_waiting < b->num_waiting;
        return tsr_placement_load(a) < tsr_placement_load(b);
}

/* The cost pick compares: the estimated TTFT when every candidate reports its step
 * timing, else the block cost (a worker that has not measured yet, an older worker). */
static double pick_cost(const tsr_placement_cand *c, bool timed) {
        return timed ? tsr_placement_ttft_ms(c) : tsr_placement_cost(c);
}

size_t tsr_placement_pick(const tsr_placement_cand *c, size_t n, const tsr_placement_params *p,
                          tsr_placement_path *path) {
        tsr_placement_params defaults = TSR_PLACEMENT_DEFAULTS;
        bool *keep, timed = true;
        size_t kept = 0, best = (size_t)-1;
        double min_load = 0, max_load = 0;
        tsr_placement_path how = TSR_PLACE_COST;

        if (n == 0)
                return (size_t)-1;
        if (!p)
                p = &defaults;
        for (size_t i = 0; i < n; i++)
                timed = timed && tsr_placement_timed(&c[i]);
        keep = calloc(n, sizeof(*keep));       /* NULL (no memory): plain argmin over all */
        for (size_t i = 0; keep && i < n; i++)
                kept += (keep[i] = tsr_placement_passes(&c[i], p));
        if (keep && kept == 0) {
                how = TSR_PLACE_ALL_FILTERED;
                for (size_t i = 0; i < n; i++)
                        keep[i] = true;
        }

        for (size_t i = 0, first = 1; i < n; i++) {
                if (keep && !keep[i])
                        continue;
                double l = tsr_placement_load(&c[i]);
                if (first || l < min_load)
                        min_load = l;
                if (first || l > max_load)
                        max_load = l;
                first = 0;
        }
        if (keep && max_load - min_load > p->guard_abs && max_load > p->guard_rel * min_load) {
                /* Imbalance guard: among the not-overloaded, the longest prefix hit;
                 * equal hits fall back to the cost order. */
                how = TSR_PLACE_GUARD;
                for (size_t i = 0; i < n; i++) {
                        if (!keep[i] || tsr_placement_load(&c[i]) > min_load + p->guard_abs)
                                continue;
                        if (best == (size_t)-1 || c[i].hits > c[best].hits ||
                            (c[i].hits == c[best].hits &&
                             better(&c[i], pick_cost(&c[i], timed), &c[best], pick_cost(&c[best], timed))))
                                best = i;
                }
        } else {
                for (size_t i = 0; i < n; i++) {
                        if (keep && !keep[i])
                                continue;
                        if (best == (size_t)-1 ||
                            better(&c[i], pick_cost(&c[i], timed), &c[best], pick_cost(&c[best], timed)))
                                best = i;
                }
        }
        free(keep);
        if (path)
                *path = how;
        return best;
}

size_t tsr_placement_pick_least_load(const tsr_placement_cand *c, size_t n) {
        size_t best = (size_t)-1;
        for (size_t i = 0; i < n; i++)
                if (best == (size_t)-1 || tsr_placement_load(&c[i]) < tsr_placement_load(&c[best]))
                        best = i;
        return best;
}

uint64_t tsr_placement_reserve(uint64_t max_tokens, uint32_t block_size) {
        uint64_t bs = block_size ? block_size : 1;
        uint64_t blocks = max_tokens / bs + (max_tokens % bs != 0);
        return blocks < 16 ? blocks : 16;
}

void tsr_placement_cand_fill(tsr_placement_cand *c, const tsr_worker *w, const Tessera__V1__Status *st,
                             const tsr_placement_pending *p, uint32_t block_size, uint64_t max_tokens,
                             const uint64_t *hashes, size_t n_hashes) {
        memset(c, 0, sizeof(*c));
        c->block_size = block_size;
        if (st) {
                c->num_running = st->num_running;
                c->num_waiting = st->num_waiting;
                c->waiting_prompt_tokens = st->waiting_prompt_tokens;
                c->kv_total = st->kv_blocks_total;
                c->kv_free = st->kv_blocks_free;
                c->kv_active = st->kv_blocks_active;
                c->prefill_tps = st->prefill_tokens_per_s;
                c->decode_ms = st->decode_step_ms;
        }
        if (p) {
                c->pending_prefill_blocks = p->prefill_blocks;
                c->pending_decode_blocks = p->decode_blocks;
                c->pending_requests = p->requests;
        }
        c->reserve_blocks = tsr_placement_reserve(max_tokens, c->block_size);
        if (hashes) {
                c->blocks = n_hashes;
                c->hits = n_hashes ? tsr_worker_prefix_hits(w, hashes, n_hashes) : 0;
        }
}

void tsr_placement_pending_add(tsr_placement_pending *p, const tsr_placement_cand *c) {
        p->prefill_blocks += c->blocks - (c->hits < c->blocks ? c->hits : c->blocks);
        p->decode_blocks += c->blocks;
        p->requests++;
}

/* total += t (sign > 0) or total -= t (t is one of the items total counts). */
static void pending_plus(tsr_placement_pending *total, const tsr_placement_pending *t, int sign) {
        if (sign > 0) {
                total->prefill_blocks += t->prefill_blocks;
                total->decode_blocks += t->decode_blocks;
                total->requests += t->requests;
        } else {
                total->prefill_blocks -= t->prefill_blocks;
                total->decode_blocks -= t->decode_blocks;
                total->requests -= t->requests;
        }
}

void tsr_placement_sent_prune(tsr_placement_sent_list *l, uint64_t boot_epoch, uint64_t status_seq, bool acked,
                              uint64_t ack) {
        size_t kept = 0;
        if (l->boot_epoch != boot_epoch) {
                l->n = 0;
                l->boot_epoch = boot_epoch;
        }
        memset(&l->total, 0, sizeof(l->total));
        for (size_t i = 0; i < l->n; i++) {
                if (acked ? l->items[i].id > ack : l->items[i].status_seq == status_seq) {
                        l->items[kept] = l->items[i];
                        pending_plus(&l->total, &l->items[kept++].terms, 1);
                }
        }
        l->n = kept;
        l->pruned = true;
        l->pruned_seq = status_seq;
}

bool tsr_placement_sent_add(tsr_placement_sent_list *l, uint64_t id, uint64_t status_seq,
                            const tsr_placement_cand *c) {
        tsr_placement_sent *e;
        if (l->n == TSR_PLACEMENT_SENT_MAX) {
                pending_plus(&l->total, &l->items[0].terms, -1);
                memmove(l->items, l->items + 1, (l->n - 1) * sizeof(*l->items));
                l->n--;
        }
        if (l->n == l->cap) {
                size_t cap = l->cap ? 2 * l->cap : 16;
                tsr_placement_sent *grown = realloc(l->items, cap * sizeof(*grown));
                if (!grown)
                        return false;
                l->items = grown;
                l->cap = cap;
        }
        e = &l->items[l->n++];
        memset(e, 0, sizeof(*e));
        e->id = id;
        e->status_seq = status_seq;
        tsr_placement_pending_add(&e->terms, c);
        pending_plus(&l->total, &e->terms, 1);
        return true;
}

void tsr_placement_sent_sum(const tsr_placement_sent_list *l, tsr_placement_pending *sum) {
        if (l)
                *sum = l->total;
        else
                memset(sum, 0, sizeof(*sum));
}

void tsr_placement_sent_free(tsr_placement_sent_list *l) {
        free(l->items);
        memset(l, 0, sizeof(*l));
}

static void recent_free(tsr_placement_recent_entry *e) {
        free(e->hashes);
        memset(e, 0, sizeof(*e));
}

void tsr_placement_recent_add(tsr_placement_recent *r, const void *w, const uint64_t *hashes, size_t n,
                              uint64_t now_ns) {
        tsr_placement_recent_entry *e = &r->e[r->next];
        uint64_t *copy;
        if (!w || !hashes || n == 0 || !(copy = malloc(n * sizeof(*copy))))
                return;
        memcpy(copy, hashes, n * sizeof(*copy));
        recent_free(e);
        *e = (tsr_placement_recent_entry){.w = w, .at_ns = now_ns, .hashes = copy, .n = n};
        r->next = (r->next + 1) % TSR_PLACEMENT_RECENT_MAX;
}

/* The leading run of hashes[0..n) that entry e shares (its first hash already equal). */
static size_t shared_run(const tsr_placement_recent_entry *e, const uint64_t *hashes, size_t n) {
        size_t lo = 1, hi = e->n < n ? e->n : n;        /* invariant: hashes[lo - 1] shared */
        while (lo < hi) {
                size_t mid = lo + (hi - lo + 1) / 2;
                if (e->hashes[mid - 1] == hashes[mid - 1])
                        lo = mid;
                else
                        hi = mid - 1;
        }
        return lo;
}

static int hit_by_worker(const void *a, const void *b) {
        uintptr_t x = (uintptr_t)((const tsr_placement_recent_hit *)a)->w;
        uintptr_t y = (uintptr_t)((const tsr_placement_recent_hit *)b)->w;
        return x < y ? -1 : x > y;
}

void tsr_placement_recent_scan(const tsr_placement_recent *r, const uint64_t *hashes, size_t n, uint64_t now_ns,
                               tsr_placement_recent_match *m) {
        size_t k = 0;
        m->n = 0;
        for (size_t i = 0; hashes && n && i < TSR_PLACEMENT_RECENT_MAX; i++) {
                const tsr_placement_recent_entry *e = &r->e[i];
                if (!e->w || now_ns - e->at_ns > TSR_PLACEMENT_RECENT_NS || e->hashes[0] != hashes[0])
                        continue;
                m->h[k++] = (tsr_placement_recent_hit){.w = e->w, .hits = shared_run(e, hashes, n)};
        }
        if (k > 1)
                qsort(m->h, k, sizeof(m->h[0]), hit_by_worker);
        for (size_t i = 0; i < k; i++) {                /* one per worker: its best */
                if (m->n && m->h[m->n - 1].w == m->h[i].w) {
                        if (m->h[i].hits > m->h[m->n - 1].hits)
                                m->h[m->n - 1].hits = m->h[i].hits;
                } else {
                        m->h[m->n++] = m->h[i];
                }
        }
}

size_t tsr_placement_recent_lookup(const tsr_placement_recent_match *m, const void *w) {
        tsr_placement_recent_hit key = {.w = w};
        const tsr_placement_recent_hit *h = m->n ? bsearch(&key, m->h, m->n, sizeof(m->h[0]), hit_by_worker) : NULL;
        return h ? h->hits : 0;
}

size_t tsr_placement_recent_hits(const tsr_placement_recent *r, const void *w, const uint64_t *hashes, size_t n,
                                 uint64_t now_ns) {
        size_t best = 0;
        for (size_t i = 0; w && hashes && i < TSR_PLACEMENT_RECENT_MAX; i++) {
                const tsr_placement_recent_entry *e = &r->e[i];
                if (e->w != w || now_ns - e->at_ns > TSR_PLACEMENT_RECENT_NS || n == 0 || e->hashes[0] != hashes[0])
                        continue;
                size_t k = shared_run(e, hashes, n);
                best = k > best ? k : best;
        }
        return best;
}

void tsr_placement_recent_forget(tsr_placement_recent *r, const void *w) {
        for (size_t i = 0; i < TSR_PLACEMENT_RECENT_MAX; i++)
                if (r->e[i].w == w)
                        recent_free(&r->e[i]);
}

void tsr_placement_recent_done(tsr_placement_recent *r) {
        for (size_t i = 0; i < TSR_PLACEMENT_RECENT_MAX; i++)
                recent_free(&r->e[i]);
        r->next = 0;
}
