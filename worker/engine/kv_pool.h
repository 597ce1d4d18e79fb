/* kv_pool.h - the memory of the paged KV cache, allocated per layer group.
 *
 * A model family declares what each of its layers keeps between steps as groups of layers
 * with the same shape of state (tsr_kv_group: full attention today; chunked local
 * attention and Mamba state slots are the later families' kinds).  The worker sizes the
 * cache from the groups (tsr_kv_block_bytes against --kv-cache-memory) and allocates it
 * here, group by group, layer by layer; the family's forward only borrows the arrays
 * (family.h, kv_bind).  Block ids are the engine's (kv_cache.c), drawn from one shared
 * pool as vLLM's groups share one BlockPool; each paged group (full or chunked-local
 * attention) has its own block table per request (kv_cache.h).
 *
 * With a chunked-local group (a hybrid model, vLLM's hybrid allocator) the paged groups
 * share their layer arrays, as vLLM shares one KV tensor between the j-th layers of every
 * group: layer j of each paged group reads and writes array j, so one block id is one
 * block of max(n_layers) layers' K and V, and a block given to any group is memory that
 * group alone uses.  Such paged groups must store rows of one shape (n_kv_heads,
 * head_dim, dtype); a family splits its layers into groups of (nearly) equal size so no
 * block goes half used (llama4_family.c).  Without one (full attention only) every group
 * has arrays of its own and one block id indexes them all: one block table per request.
 *
 * Built by the main thread at start-up, then written by the forward on the engine thread
 * (or its step thread) only. */
#ifndef TSR_WORKER_ENGINE_KV_POOL_H
#define TSR_WORKER_ENGINE_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/dtype.h"
#include "kernels/kernels.h"

/* What a layer keeps per token (or per sequence) between steps. */
typedef enum tsr_kv_kind {
        TSR_KV_FULL_ATTENTION = 0,      /* K and V of every past position, in paged blocks */
        /* A recurrent layer's state (Mamba-2: conv window + SSM state), one fixed-size
         * record per *request slot*, not per token: the engine gives each running request
         * one slot (tsr_engine_params.state_slots) and the forward reads/writes it there. */
        TSR_KV_MAMBA_STATE = 1,
        /* K and V of the positions of the current attention chunk only (Llama 4's RoPE
         * layers: position p attends to [floor(p / chunk) * chunk, p]), in paged blocks;
         * the engine frees the blocks wholly before the chunk (vLLM's
         * ChunkedLocalAttentionSpec). */
        TSR_KV_CHUNKED_LOCAL = 2,
} tsr_kv_kind;

/* A group of layers whose cache looks the same. */
typedef struct tsr_kv_group {
        tsr_kv_kind kind;
        uint32_t n_layers;              /* layers of this group the shard holds */
        uint32_t n_kv_heads;
        uint32_t head_dim;
        tsr_dtype dtype;                /* what the cache stores: float32, or fp8_e4m3 for a full-
                                         * attention group under --kv-cache-dtype fp8 (CPU only) */
        /* TSR_KV_MAMBA_STATE: elements per slot per layer of its two arrays (conv state,
         * SSM state); n_kv_heads and head_dim are unused.  Full attention: unused. */
        uint64_t conv_elems, ssm_elems;
        uint32_t chunk;                 /* TSR_KV_CHUNKED_LOCAL: attention_chunk_size (tokens, > 0) */
} tsr_kv_group;

/* Whether group g keeps K and V rows in paged blocks (full or chunked-local attention). */
static inline bool tsr_kv_group_paged(const tsr_kv_group *g) {
        return g->kind == TSR_KV_FULL_ATTENTION || g->kind == TSR_KV_CHUNKED_LOCAL;
}

#define TSR_KV_GROUPS_MAX 4

/* Bytes one block of `block_size` tokens takes: K and V per layer summed over the
 * full-attention groups, or, with a chunked-local group, of the paged group with the most
 * layers (their arrays are shared, see above); state groups take none.  0 for no groups
 * or a zero size. */
uint64_t tsr_kv_block_bytes(const tsr_kv_group *groups, size_t n_groups, uint32_t block_size);
/* Blocks one request of `n_tokens` tokens holds at most, summed over the paged groups:
 * ceil(n_tokens / block_size) per full-attention group; per chunked-local group the
 * blocks of one chunk plus a step's prefill of `max_step_tokens` tokens (vLLM's
 * ChunkedLocalAttentionSpec.max_memory_usage_bytes), never more than the full group's.
 * The capacity lines and the pool sizing check use it; 0 without paged groups. */
uint64_t tsr_kv_blocks_per_request(const tsr_kv_group *groups, size_t n_groups, uint32_t block_size,
                                   uint64_t n_tokens, uint64_t max_step_tokens);
/* Whether the groups are a hybrid of full and chunked-local attention (some group is
 * TSR_KV_CHUNKED_LOCAL): then every paged group keeps its own block table per request. */
bool tsr_kv_groups_hybrid(const tsr_kv_group *groups, size_t n_groups);
/* The block tables a request holds: one per paged group of a hybrid, else 1 (all groups
 * under one table).  out_chunk[i] (when not NULL, TSR_KV_GROUPS_MAX entries) receives
 * table i's chunk (0: full attention), in the order of the paged groups. */
size_t tsr_kv_tables(const tsr_kv_group *groups, size_t n_groups, uint32_t *out_chunk);
/* Bytes one request's state slot takes, summed over the TSR_KV_MAMBA_STATE groups; 0
 * when the model keeps no per-request state. */
uint64_t tsr_kv_slot_bytes(const tsr_kv_group *groups, size_t n_groups);

/* One group's memory: for each of its layers a K and a V array of
 * (n_blocks, block_size, n_kv_heads, head_dim) elements of spec.dtype (layer j of every
 * paged group is the same array: see above); for a
 * TSR_KV_MAMBA_STATE group, k is the conv state (n_slots, conv_elems) and v the SSM
 * state (n_slots, ssm_elems) of each layer. */
typedef struct tsr_kv_pool_group {
        tsr_kv_group spec;
        void **k, **v;                  /* [spec.n_layers] */
        /* Full attention: per layer, the factors an fp8 cache's codes are scaled by
         * (kernels.h tsr_kv_view k_scale, v_scale); 1.0 from tsr_kv_pool_new_on, the
         * checkpoint's where it has them (the runner sets them before kv_bind).  Unused for
         * float32.  NULL for a state group. */
        float *k_scale, *v_scale;       /* [spec.n_layers] */
} tsr_kv_pool_group;

typedef struct tsr_kv_pool {
        uint64_t n_blocks;
        uint32_t block_size;
        uint32_t n_slots;               /* request state slots (0 without a state group) */
        size_t n_groups;
        tsr_kv_pool_group groups[TSR_KV_GROUPS_MAX];
        uint64_t bytes;                 /* == n_blocks * tsr_kv_block_bytes(groups) + n_slots * tsr_kv_slot_bytes */
        /* A hybrid's shared arrays of the paged groups: [n_paged_layers] each (max n_layers
         * of the paged groups); groups[g].k[j] == paged_k[j] for every paged group g.
         * NULL and 0 otherwise. */
        void **paged_k, **paged_v;
        uint32_t n_paged_layers;
        tsr_backend *be;                /* whose memory the arrays are (tsr_kv_pool_new_on); NULL: malloc */
} tsr_kv_pool;

/* Allocate n_blocks blocks of block_size tokens for each group (none: an empty pool, a
 * pipeline stage whose layers keep no state).  TSR_E_INVAL (groups NULL with n_groups >
 * 0, too many, zero sizes, a dtype without a byte size, a chunked group without a chunk,
 * paged groups of different row shapes), TSR_E_LIMIT (size overflows),
 * TSR_E_NOMEM; *ret written only on success. */
tsr_status tsr_kv_pool_new(const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks, uint32_t block_size,
                           tsr_kv_pool **ret);
/* The same with n_slots request state slots for the TSR_KV_MAMBA_STATE groups
 * (TSR_E_INVAL when there are such groups and n_slots is 0). */
tsr_status tsr_kv_pool_new_slots(const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks, uint32_t block_size,
                                 uint32_t n_slots, tsr_kv_pool **ret);
/* The same in backend `be`'s memory (tsr_backend_mem_alloc: device memory on CUDA); be
 * NULL: malloc, as tsr_kv_pool_new_slots.  `be` must outlive the pool. */
tsr_status tsr_kv_pool_new_on(tsr_backend *be, const tsr_kv_group *groups, size_t n_groups, uint64_t n_blocks,
                              uint32_t block_size, uint32_t n_slots, tsr_kv_pool **ret);
/* Accepts NULL and *p == NULL; clears *p. */
void tsr_kv_pool_free(tsr_kv_pool **p);

/* What --kv-cache-dtype asks the cache to store: "auto" (or NULL) float32, "fp8" and
 * "fp8_e4m3" (the same format) fp8_e4m3; *ret written and true for those, false for any
 * other value (common/config.c refuses the rest before). */
bool tsr_kv_cache_dtype_parse(const char *flag, tsr_dtype *ret);
/* Make every paged group of groups[n] store `dtype` (state groups keep theirs):
 * the sizing (tsr_kv_block_bytes) and the pool then follow. */
void tsr_kv_groups_set_dtype(tsr_kv_group *groups, size_t n, tsr_dtype dtype);

#endif
