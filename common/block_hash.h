/* block_hash.h - the chained prefix-block hash, shared by the worker's prefix cache
 * (worker/kv_cache) and the router's placement (router/sched).  One function on both
 * sides, so a router can predict exactly which blocks a worker has cached from the
 * BlockHashEvent stream (proto/tessera.proto) and the request's token ids.
 *
 * Byte layout (normative; tests/unit/test_block_hash.c carries Python that reproduces it):
 *
 *   msg_i  = parent_i   8 bytes, uint64 little-endian
 *         || ids        4 bytes per token id, uint32 little-endian, in order
 *         || extra      extra_len raw bytes (the request's cache_salt), block 0 only
 *   parent_0 = TSR_BLOCK_HASH_NONE; parent_i = hash_{i-1}
 *
 *   xxhash:  hash_i = XXH3_64bits(msg_i)                 (XXH3, 64-bit, seed 0)
 *   sha256:  hash_i = first 8 bytes of SHA-256(msg_i), read as uint64 little-endian
 *
 * In Python:  m = p.to_bytes(8,'little') + b''.join(t.to_bytes(4,'little') for t in ids) + salt
 *             xxhash.xxh3_64_intdigest(m)   or   int.from_bytes(hashlib.sha256(m).digest()[:8],'little')
 *
 * The message carries no lengths: it is unambiguous because every hashed block of one
 * cache holds exactly block_size ids (only FULL blocks are hashed) and only block 0 has
 * extra bytes.  An empty salt and no salt hash the same.  Unlike vLLM (pickle/CBOR
 * of a tuple, random NONE_HASH per process) the seed is fixed, so every worker and
 * router agree without exchanging it; Tessera's hashes never equal vLLM's.
 *
 * Pure functions, no globals; a tsr_block_hasher is owned by one thread at a time. */
#ifndef TSR_BLOCK_HASH_H
#define TSR_BLOCK_HASH_H

#include <stddef.h>
#include <stdint.h>
#include "tsr_status.h"

/* parent of block 0: the 64-bit golden-ratio constant (floor(2^64 / phi)). */
#define TSR_BLOCK_HASH_NONE UINT64_C(0x9e3779b97f4a7c15)

typedef enum tsr_block_hash_algo {
        TSR_BLOCK_HASH_SHA256 = 0,
        TSR_BLOCK_HASH_XXHASH = 1,
} tsr_block_hash_algo;

/* Parse a --prefix-caching-hash-algo value: "sha256", "xxhash", and vLLM's
 * "sha256_cbor" / "xxhash_cbor", which name a serialisation Tessera does not use and
 * are treated as "sha256" / "xxhash" (the layout above).  Case-sensitive, as vLLM's
 * argparse choices.  TSR_E_INVAL for anything else (NULL included); *ret written
 * only on success. */
tsr_status tsr_block_hash_algo_parse(const char *name, tsr_block_hash_algo *ret);
/* "sha256" or "xxhash"; "?" for a value outside the enum.  Never NULL. */
const char *tsr_block_hash_algo_name(tsr_block_hash_algo a);

/* A reusable hashing context: it holds the OpenSSL / XXH3 state so that hashing a
 * chain allocates nothing per block (the KV cache hashes on the engine's hot path and
 * must not fail half-way through a commit).  *ret written only on success;
 * TSR_E_INVAL for an unknown algo, TSR_E_NOMEM, TSR_E_INTERNAL if OpenSSL has no
 * SHA-256.  free accepts NULL and clears the caller's pointer. */
typedef struct tsr_block_hasher tsr_block_hasher;
tsr_status tsr_block_hasher_new(tsr_block_hash_algo a, tsr_block_hasher **ret);
void tsr_block_hasher_free(tsr_block_hasher **h);
tsr_block_hash_algo tsr_block_hasher_algo(const tsr_block_hasher *h);

/* hash = H(parent || ids[0..n) || extra[0..extra_len)), layout above.  `ids` may be
 * NULL when n == 0, `extra` when extra_len == 0.  TSR_OK, or TSR_E_INTERNAL if
 * OpenSSL fails; *ret written only on success. */
tsr_status tsr_block_hasher_hash(tsr_block_hasher *h, uint64_t parent, const uint32_t *ids, size_t n,
                                 const void *extra, size_t extra_len, uint64_t *ret);

/* One-shot form of tsr_block_hasher_hash (creates and frees a hasher: one small
 * allocation for sha256).  Same returns, plus TSR_E_INVAL / TSR_E_NOMEM. */
tsr_status tsr_block_hash(tsr_block_hash_algo a, uint64_t parent, const uint32_t *ids, size_t n,
                          const void *extra, size_t extra_len, uint64_t *ret);

/* Hash the chain of FULL blocks of a token sequence: out[i] = hash of ids[i*bs ..
 * (i+1)*bs), parent TSR_BLOCK_HASH_NONE and `salt` for block 0.  `out` has room for
 * n_ids / block_size values (the partial tail block is not hashed); *n_out gets that
 * count.  TSR_E_INVAL when block_size == 0 (nothing written).  *n_out is written
 * only on success; after TSR_E_INTERNAL (OpenSSL failed mid-chain) a prefix of `out`
 * may hold hashes.  Router loop thread or engine thread; cost O(n_ids). */
tsr_status tsr_block_hash_chain(tsr_block_hash_algo a, const uint32_t *ids, size_t n_ids, size_t block_size,
                                const void *salt, size_t salt_len, uint64_t *out, size_t *n_out);

#endif
