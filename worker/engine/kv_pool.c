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

uint64_t tsr_kv_block_bytes(const tsr_kv_group *groups, size_t n_groups, uint32_t block_size) {
        uint64_t bytes = 0;

        for (size_t i = 0; i < n_groups; i++) {
                const tsr_kv_group *g = &groups[i];
                switch (g->kind) {
                case TSR_KV_FULL_ATTENTION:     /* K and V rows of every layer of the group */
                        bytes += 2ull * g->n_layers * g->n_kv_heads * g->head_dim * block_size * elt_bytes(g->dtype);
                        break;
                case TSR_KV_MAMBA_STATE:        /* per request slot, not per block */
                        break;
                }
        }
        return bytes;
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

        if (!groups || !ret || n_groups == 0 || n_groups > TSR_KV_GROUPS_MAX || n_blocks == 0 || block_size == 0)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n_groups; i++) {
                const tsr_kv_group *g = &groups[i];
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
        for (size_t i = 0; i < n_groups; i++) {
                tsr_kv_pool_group *pg = &p->groups[i];
                size_t k_bytes, v_bytes;
                layer_bytes(&groups[i], n_blocks, block_size, p->n_slots, &k_bytes, &v_bytes);
                pg->spec = groups[i];
                p->n_groups = i + 1;    /* from here tsr_kv_pool_free frees this group too */
                if (!(pg->k = calloc(pg->spec.n_layers, sizeof *pg->k)) ||
                    !(pg->v = calloc(pg->spec.n_layers, sizeof *pg->v)))
                        goto nomem;
                if (pg->spec.kind == TSR_KV_FULL_ATTENTION) {
                        if (!(pg->k_scale = malloc(pg->spec.n_layers * sizeof *pg->k_scale)) ||
                            !(pg->v_scale = malloc(pg->spec.n_layers * sizeof *pg->v_scale)))
                                goto nomem;
                        for (uint32_t l = 0; l < pg->spec.n_layers; l++)
                                pg->k_scale[l] = pg->v_scale[l] = 1.0f;
                }
                /* Uninitialised: a block is written before any position of it is read, a
                 * state slot zeroed by the forward that starts a sequence in it. */
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
                for (uint32_t l = 0; l < g->spec.n_layers; l++) {
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
        free(p);
        *pp = NULL;
}

bool tsr_kv_cache_dtype_parse(const char *flag, tsr_dtype *ret) {
        if (!flag || strcmp(flag, "auto") == 0)
                *ret = TSR_DTYPE_F32;
        else if (strcmp(flag, "fp8") == 0 || strcmp(flag, "fp8_e4m3") == 0)
                *ret = TSR_DTYPE_FP8_E4M3;
        else
                return false;
        return true;
}

void tsr_kv_groups_set_dtype(tsr_kv_group *groups, size_t n, tsr_dtype dtype) {
        for (size_t i = 0; i < n; i++)
                if (groups[i].kind == TSR_KV_FULL_ATTENTION)
                        groups[i].dtype = dtype;
}
