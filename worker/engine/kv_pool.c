/* kv_pool.c - see kv_pool.h. */
#include "worker/engine/kv_pool.h"

#include <stdlib.h>
#include <string.h>

/* Bytes per element of what a KV group stores; 0 for a dtype a cache cannot hold. */
static uint64_t elt_bytes(tsr_dtype t) {
        switch (t) {
        case TSR_DTYPE_F32: return 4;
        case TSR_DTYPE_BF16:
        case TSR_DTYPE_F16: return 2;
        case TSR_DTYPE_FP8_E4M3:
        case TSR_DTYPE_FP8_E5M2: return 1;
        default: return 0;
        }
}

/* Bytes of K and V of one layer of paged group g for one block. */
static uint64_t layer_block_bytes(const tsr_kv_group *g, uint32_t block_size) {
        return 2ull * g->n_kv_heads * g->head_dim * block_size * elt_bytes(g->dtype);
}

bool tsr_kv_groups_hybrid(const tsr_kv_group *groups, size_t n_groups) {
        for (size_t i = 0; i < n_groups; i++)
                if (groups[i].kind == TSR_KV_CHUNKED_LOCAL)
                        return true;
        return false;
}

size_t tsr_kv_tables(const tsr_kv_group *groups, size_t n_groups, uint32_t *out_chunk) {
        size_t n = 0;

        if (!tsr_kv_groups_hybrid(groups, n_groups)) {
                if (out_chunk)
                        out_chunk[0] = 0;
                return 1;
        }
        for (size_t i = 0; i < n_groups; i++) {
                if (!tsr_kv_group_paged(&groups[i]))
                        continue;
                if (out_chunk)
                        out_chunk[n] = groups[i].kind == TSR_KV_CHUNKED_LOCAL ? groups[i].chunk : 0;
                n++;
        }
        return n;
}

uint64_t tsr_kv_block_bytes(const tsr_kv_group *groups, size_t n_groups, uint32_t block_size) {
        bool hybrid = tsr_kv_groups_hybrid(groups, n_groups);
        uint64_t bytes = 0;

        for (size_t i = 0; i < n_groups; i++) {
                const tsr_kv_group *g = &groups[i];
                uint64_t b;
                if (!tsr_kv_group_paged(g))     /* state: per request slot, not per block */
                        continue;
                b = g->n_layers * layer_block_bytes(g, block_size);
                if (!hybrid)                    /* K and V rows of every layer of every group */
                        bytes += b;
                else if (b > bytes)             /* the shared arrays: the widest group's */
                        bytes = b;
        }
        return bytes;
}

uint64_t tsr_kv_blocks_per_request(const tsr_kv_group *groups, size_t n_groups, uint32_t block_size,
                                   uint64_t n_tokens, uint64_t max_step_tokens) {
        uint32_t chunk[TSR_KV_GROUPS_MAX];
        size_t n = tsr_kv_tables(groups, n_groups, chunk);
        uint64_t full, total = 0;

        if (block_size == 0 || tsr_kv_block_bytes(groups, n_groups, block_size) == 0)
                return 0;
        full = (n_tokens + block_size - 1) / block_size;
        for (size_t i = 0; i < n; i++) {
                /* a chunk, plus what one step may write past it, may straddle one more block */
                uint64_t t = chunk[i] ? chunk[i] + max_step_tokens : n_tokens, b;
                b = t < n_tokens ? (t + block_size - 1) / block_size + 1 : full;
                total += b < full ? b : full;
        }
        return total;
}

uint64_t tsr_kv_slot_bytes(const tsr_kv_group *groups, size_t n_groups) {
        uint64_t bytes = 0;

        for (size_t i = 0; i < n_groups; i++)
                if (groups[i].kind == TSR_KV_MAMBA_STATE)
                        bytes += (uint64_t)groups[i].n_layers * (groups[i].conv_elems + groups[i].ssm_elems) *
                                 elt_bytes(groups[i].dtype);
        return bytes;
}

/* Bytes of one layer's K (conv state) and V (SSM state) arrays of group g. */
static void layer_bytes(const tsr_kv_group *g, uint64_t n_blocks, uint32_t block_size, uint32_t n_slots,
                        size_t *k, size_t *v) {
        if (g->kind == TSR_KV_MAMBA_STATE) {
                *k = (size_t)(n_slots * g->conv_elems * elt_bytes(g->dtype));
                *v = (size_t)(n_slots * g->ssm_elems * elt_bytes(g->dtype));
        } else {
                *k = *v = (size_t)(n_blocks * block_size * g->n_kv_heads * g->head_dim * elt_bytes(g->dtype));
        }
}

tsr_status tsr_kv_pool_new(const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks, uint32_t block_size,
                           tsr_kv_pool **ret) {
        return tsr_kv_pool_new_slots(groups, n_groups, n_blocks, block_size, 0, ret);
}

tsr_status tsr_kv_pool_new_slots(const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks, uint32_t block_size,
                                 uint32_t n_slots, tsr_kv_pool **ret) {
        return tsr_kv_pool_new_on(NULL, groups, n_groups, n_blocks, block_size, n_slots, ret);
}

/* One layer array: `be`'s memory, or the heap's. */
static void *pool_alloc(tsr_backend *be, size_t bytes) {
        void *p = NULL;
        if (!be)
                return malloc(bytes);
        return bytes && tsr_backend_mem_alloc(be, bytes, &p) == TSR_OK ? p : NULL;
}

static void pool_release(tsr_backend *be, void *p) {
        if (be)
                tsr_backend_mem_free(be, p);
        else
                free(p);
}

tsr_status tsr_kv_pool_new_on(tsr_backend *be, const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks,
                              uint32_t block_size, uint32_t n_slots, tsr_kv_pool **ret) {
        tsr_kv_pool *p;

        bool hybrid;
        uint32_t n_paged = 0;
        const tsr_kv_group *widest = NULL;

        /* no groups: an empty pool, for a pipeline stage whose layers keep nothing */
        if ((!groups && n_groups) || !ret || n_groups > TSR_KV_GROUPS_MAX || n_blocks == 0 || block_size == 0)
                return TSR_E_INVAL;
        hybrid = tsr_kv_groups_hybrid(groups, n_groups);
        for (size_t i = 0; i < n_groups; i++) {
                const tsr_kv_group *g = &groups[i];
                if (g->kind == TSR_KV_CHUNKED_LOCAL && g->chunk == 0)
                        return TSR_E_INVAL;
                if (hybrid && tsr_kv_group_paged(g)) {
                        /* shared arrays: one row shape for every paged group */
                        if (widest && (g->n_kv_heads != widest->n_kv_heads || g->head_dim != widest->head_dim ||
                                       g->dtype != widest->dtype))
                                return TSR_E_INVAL;
                        if (!widest || g->n_layers > n_paged) {
                                widest = g;
                                n_paged = g->n_layers;
                        }
                }
                if (g->kind == TSR_KV_MAMBA_STATE) {
                        uint64_t rec = (g->conv_elems + g->ssm_elems) * elt_bytes(g->dtype);
                        if (g->n_layers == 0 || rec == 0 || n_slots == 0)
                                return TSR_E_INVAL;
                        if (n_slots > SIZE_MAX / rec)
                                return TSR_E_LIMIT;
                        continue;
                }
                uint64_t row = (uint64_t)g->n_kv_heads * g->head_dim * elt_bytes(g->dtype);
                if (g->n_layers == 0 || row == 0)
                        return TSR_E_INVAL;
                if (n_blocks > SIZE_MAX / block_size / row)
                        return TSR_E_LIMIT;
        }
        if (!(p = calloc(1, sizeof *p)))
                return TSR_E_NOMEM;
        p->be = be;
        p->n_blocks = n_blocks;
        p->block_size = block_size;
        p->n_slots = tsr_kv_slot_bytes(groups, n_groups) ? n_slots : 0;
        if (hybrid) {
                size_t k_bytes, v_bytes;
                layer_bytes(widest, n_blocks, block_size, 0, &k_bytes, &v_bytes);
                if (!(p->paged_k = calloc(n_paged, sizeof *p->paged_k)) ||
                    !(p->paged_v = calloc(n_paged, sizeof *p->paged_v)))
                        goto nomem;
                p->n_paged_layers = n_paged;
                for (uint32_t j = 0; j < n_paged; j++)
                        if (!(p->paged_k[j] = pool_alloc(be, k_bytes)) || !(p->paged_v[j] = pool_alloc(be, v_bytes)))
                                goto nomem;
        }
        for (size_t i = 0; i < n_groups; i++) {
                tsr_kv_pool_group *pg = &p->groups[i];
                size_t k_bytes, v_bytes;
                layer_bytes(&groups[i], n_blocks, block_size, p->n_slots, &k_bytes, &v_bytes);
                pg->spec = groups[i];
                p->n_groups = i + 1;    /* from here tsr_kv_pool_free frees this group too */
                if (!(pg->k = calloc(pg->spec.n_layers, sizeof *pg->k)) ||
                    !(pg->v = calloc(pg->spec.n_layers, sizeof *pg->v)))
                        goto nomem;
                if (tsr_kv_group_paged(&pg->spec)) {
                        if (!(pg->k_scale = malloc(pg->spec.n_layers * sizeof *pg->k_scale)) ||
                            !(pg->v_scale = malloc(pg->spec.n_layers * sizeof *pg->v_scale)))
                                goto nomem;
                        for (uint32_t l = 0; l < pg->spec.n_layers; l++)
                                pg->k_scale[l] = pg->v_scale[l] = 1.0f;
                }
                /* Uninitialised: a block is written before any position of it is read, a
                 * state slot zeroed by the forward that starts a sequence in it. */
                if (hybrid && tsr_kv_group_paged(&pg->spec)) {
                        /* borrowed from the shared arrays: freed once, below */
                        memcpy(pg->k, p->paged_k, pg->spec.n_layers * sizeof *pg->k);
                        memcpy(pg->v, p->paged_v, pg->spec.n_layers * sizeof *pg->v);
                        continue;
                }
                for (uint32_t l = 0; l < pg->spec.n_layers; l++)
                        if (!(pg->k[l] = pool_alloc(be, k_bytes)) || !(pg->v[l] = pool_alloc(be, v_bytes)))
                                goto nomem;
        }
        p->bytes = n_blocks * tsr_kv_block_bytes(groups, n_groups, block_size) +
                   (uint64_t)p->n_slots * tsr_kv_slot_bytes(groups, n_groups);
        *ret = p;
        return TSR_OK;
nomem:
        tsr_kv_pool_free(&p);
        return TSR_E_NOMEM;
}

void tsr_kv_pool_free(tsr_kv_pool **pp) {
        tsr_kv_pool *p;

        if (!pp || !*pp)
                return;
        p = *pp;
        for (size_t i = 0; i < p->n_groups; i++) {
                tsr_kv_pool_group *g = &p->groups[i];
                for (uint32_t l = 0; l < g->spec.n_layers && !(p->paged_k && tsr_kv_group_paged(&g->spec)); l++) {
                        if (g->k)
                                pool_release(p->be, g->k[l]);
                        if (g->v)
                                pool_release(p->be, g->v[l]);
                }
                free(g->k);
                free(g->v);
                free(g->k_scale);
                free(g->v_scale);
        }
        for (uint32_t j = 0; j < p->n_paged_layers; j++) {
                pool_release(p->be, p->paged_k[j]);
                pool_release(p->be, p->paged_v[j]);
        }
        free(p->paged_k);
        free(p->paged_v);
        free(p);
        *pp = NULL;
}

bool tsr_kv_cache_dtype_parse(const char *flag, tsr_dtype *ret) {
        if (!flag || strcmp(flag, "auto") == 0)
                *ret = TSR_DTYPE_F32;
        else if (strcmp(flag, "fp8") == 0 || strcmp(flag, "fp8_e4m3") == 0)
                *ret = TSR_DTYPE_FP8_E4M3;
        else if (strcmp(flag, "fp8_e5m2") == 0)
                *ret = TSR_DTYPE_FP8_E5M2;
        else if (strcmp(flag, "bfloat16") == 0)
                *ret = TSR_DTYPE_BF16;
        else
                return false;
        return true;
}

void tsr_kv_groups_set_dtype(tsr_kv_group *groups, size_t n, tsr_dtype dtype) {
        for (size_t i = 0; i < n; i++)
                if (tsr_kv_group_paged(&groups[i]))
                        groups[i].dtype = dtype;
}
