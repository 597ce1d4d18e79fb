/* block_hash.c - chained prefix-block hash (layout in block_hash.h).
 *
 * Both algorithms are fed the message in pieces through a streaming interface, so a
 * block of any size is hashed without building the message in memory.  Token ids
 * are converted to little-endian through a small stack buffer, which makes the
 * result independent of the host's byte order. */
#include "block_hash.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <xxhash.h>

struct tsr_block_hasher {
        tsr_block_hash_algo algo;
        EVP_MD_CTX *md_ctx;       /* sha256 only */
        EVP_MD *md;               /* sha256 only; fetched once, freed in _free */
        XXH3_state_t *xxh;        /* xxhash only */
};

/* Ids are staged in chunks of this many so no allocation depends on the block size. */
#define BLOCK_HASH_CHUNK 64
/* Messages up to this size are xxhashed one-shot from a stack buffer: XXH3's
 * streaming reset/update/digest costs more than hashing a 16-id block itself. */
#define BLOCK_HASH_ONESHOT_BYTES (8 + 4 * 256 + 64)

static void put_le64(uint8_t *p, uint64_t v) {
        for (int i = 0; i < 8; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le64(const uint8_t *p) {
        uint64_t v = 0;
        for (int i = 7; i >= 0; i--)
                v = (v << 8) | p[i];
        return v;
}

/* Lay the whole message out in `buf` when it fits; returns its length, or 0. */
static size_t msg_pack(uint8_t *buf, uint64_t parent, const uint32_t *ids, size_t n, const void *extra,
                       size_t extra_len) {
        if (n > (BLOCK_HASH_ONESHOT_BYTES - 8) / 4 || extra_len > BLOCK_HASH_ONESHOT_BYTES - 8 - 4 * n)
                return 0;
        put_le64(buf, parent);
        for (size_t j = 0; j < n; j++) {
                uint32_t t = ids[j];
                buf[8 + 4 * j + 0] = (uint8_t)t;
                buf[8 + 4 * j + 1] = (uint8_t)(t >> 8);
                buf[8 + 4 * j + 2] = (uint8_t)(t >> 16);
                buf[8 + 4 * j + 3] = (uint8_t)(t >> 24);
        }
        if (extra_len)
                memcpy(buf + 8 + 4 * n, extra, extra_len);
        return 8 + 4 * n + extra_len;
}

tsr_status tsr_block_hash_algo_parse(const char *name, tsr_block_hash_algo *ret) {
        if (!name)
                return TSR_E_INVAL;
        /* The *_cbor spellings select vLLM's CBOR serialisation of the hashed tuple;
         * Tessera has one byte layout, so they only choose the hash function. */
        if (!strcmp(name, "sha256") || !strcmp(name, "sha256_cbor")) {
                *ret = TSR_BLOCK_HASH_SHA256;
                return TSR_OK;
        }
        if (!strcmp(name, "xxhash") || !strcmp(name, "xxhash_cbor")) {
                *ret = TSR_BLOCK_HASH_XXHASH;
                return TSR_OK;
        }
        return TSR_E_INVAL;
}

const char *tsr_block_hash_algo_name(tsr_block_hash_algo a) {
        switch (a) {
        case TSR_BLOCK_HASH_SHA256:
                return "sha256";
        case TSR_BLOCK_HASH_XXHASH:
                return "xxhash";
        }
        return "?";
}

tsr_status tsr_block_hasher_new(tsr_block_hash_algo a, tsr_block_hasher **ret) {
        tsr_block_hasher *h;
        tsr_status st = TSR_E_NOMEM;

        if (a != TSR_BLOCK_HASH_SHA256 && a != TSR_BLOCK_HASH_XXHASH)
                return TSR_E_INVAL;
        h = calloc(1, sizeof(*h));
        if (!h)
                return TSR_E_NOMEM;
        h->algo = a;
        if (a == TSR_BLOCK_HASH_SHA256) {
                h->md_ctx = EVP_MD_CTX_new();
                if (!h->md_ctx)
                        goto fail;
                /* An explicit fetch, once: EVP_sha256() would repeat the provider
                 * lookup inside every EVP_DigestInit_ex. */
                h->md = EVP_MD_fetch(NULL, "SHA256", NULL);
                if (!h->md) {
                        st = TSR_E_INTERNAL;
                        goto fail;
                }
        } else {
                h->xxh = XXH3_createState();
                if (!h->xxh)
                        goto fail;
        }
        *ret = h;
        return TSR_OK;
fail:
        tsr_block_hasher_free(&h);
        return st;
}

void tsr_block_hasher_free(tsr_block_hasher **hp) {
        tsr_block_hasher *h = hp ? *hp : NULL;

        if (!h)
                return;
        EVP_MD_CTX_free(h->md_ctx);
        EVP_MD_free(h->md);
        XXH3_freeState(h->xxh);
        free(h);
        *hp = NULL;
}

tsr_block_hash_algo tsr_block_hasher_algo(const tsr_block_hasher *h) { return h->algo; }

/* Feed `n` bytes to whichever hash `h` runs.  false when OpenSSL or XXH3 fails. */
static bool hasher_update(tsr_block_hasher *h, const void *p, size_t n) {
        if (n == 0)
                return true;
        if (h->algo == TSR_BLOCK_HASH_SHA256)
                return EVP_DigestUpdate(h->md_ctx, p, n) == 1;
        return XXH3_64bits_update(h->xxh, p, n) == XXH_OK;
}

tsr_status tsr_block_hasher_hash(tsr_block_hasher *h, uint64_t parent, const uint32_t *ids, size_t n,
                                 const void *extra, size_t extra_len, uint64_t *ret) {
        uint8_t buf[4 * BLOCK_HASH_CHUNK];
        uint8_t digest[EVP_MAX_MD_SIZE];
        unsigned int digest_len = 0;
        uint64_t v;

        if (h->algo == TSR_BLOCK_HASH_XXHASH) {
                uint8_t msg[BLOCK_HASH_ONESHOT_BYTES];
                size_t len = msg_pack(msg, parent, ids, n, extra, extra_len);
                if (len) {
                        *ret = XXH3_64bits(msg, len);
                        return TSR_OK;
                }
        }
        if (h->algo == TSR_BLOCK_HASH_SHA256) {
                if (EVP_DigestInit_ex(h->md_ctx, h->md, NULL) != 1)
                        return TSR_E_INTERNAL;
        } else if (XXH3_64bits_reset(h->xxh) != XXH_OK) {
                return TSR_E_INTERNAL;
        }
        put_le64(buf, parent);
        if (!hasher_update(h, buf, 8))
                return TSR_E_INTERNAL;
        for (size_t i = 0; i < n;) {
                size_t k = n - i < BLOCK_HASH_CHUNK ? n - i : BLOCK_HASH_CHUNK;
                for (size_t j = 0; j < k; j++) {
                        uint32_t t = ids[i + j];
                        buf[4 * j + 0] = (uint8_t)t;
                        buf[4 * j + 1] = (uint8_t)(t >> 8);
                        buf[4 * j + 2] = (uint8_t)(t >> 16);
                        buf[4 * j + 3] = (uint8_t)(t >> 24);
                }
                if (!hasher_update(h, buf, 4 * k))
                        return TSR_E_INTERNAL;
                i += k;
        }
        if (!hasher_update(h, extra, extra_len))
                return TSR_E_INTERNAL;
        if (h->algo == TSR_BLOCK_HASH_SHA256) {
                if (EVP_DigestFinal_ex(h->md_ctx, digest, &digest_len) != 1 || digest_len < 8)
                        return TSR_E_INTERNAL;
                v = get_le64(digest);
        } else {
                v = XXH3_64bits_digest(h->xxh);
        }
        *ret = v;
        return TSR_OK;
}

tsr_status tsr_block_hash(tsr_block_hash_algo a, uint64_t parent, const uint32_t *ids, size_t n,
                          const void *extra, size_t extra_len, uint64_t *ret) {
        tsr_block_hasher *h = NULL;
        tsr_status st;

        /* a short xxhash message needs no state object */
        if (a == TSR_BLOCK_HASH_XXHASH) {
                uint8_t msg[BLOCK_HASH_ONESHOT_BYTES];
                size_t len = msg_pack(msg, parent, ids, n, extra, extra_len);
                if (len) {
                        *ret = XXH3_64bits(msg, len);
                        return TSR_OK;
                }
        }
        st = tsr_block_hasher_new(a, &h);
        if (st != TSR_OK)
                return st;
        st = tsr_block_hasher_hash(h, parent, ids, n, extra, extra_len, ret);
        tsr_block_hasher_free(&h);
        return st;
}

tsr_status tsr_block_hash_chain(tsr_block_hash_algo a, const uint32_t *ids, size_t n_ids, size_t block_size,
                                const void *salt, size_t salt_len, uint64_t *out, size_t *n_out) {
        tsr_block_hasher *h = NULL;
        uint64_t parent = TSR_BLOCK_HASH_NONE;
        size_t n_blocks;
        tsr_status st;

        if (block_size == 0)
                return TSR_E_INVAL;
        n_blocks = n_ids / block_size;
        st = tsr_block_hasher_new(a, &h);
        if (st != TSR_OK)
                return st;
        for (size_t i = 0; i < n_blocks; i++) {
                st = tsr_block_hasher_hash(h, parent, ids + i * block_size, block_size, i == 0 ? salt : NULL,
                                           i == 0 ? salt_len : 0, &out[i]);
                if (st != TSR_OK)
                        goto done;
                parent = out[i];
        }
        *n_out = n_blocks;
done:
        tsr_block_hasher_free(&h);
        return st;
}
