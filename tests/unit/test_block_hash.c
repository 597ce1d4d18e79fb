/* common/block_hash: known answers computed independently in Python, and the chain
 * properties the prefix cache and the router's placement rely on.
 *
 * The constants below were produced by this script (python 3.11, `pip install
 * xxhash` 4.1.0 bundling xxHash 0.8.4; XXH3 output is frozen since 0.8.0):
 *
 *   import hashlib, xxhash
 *   NONE = 0x9e3779b97f4a7c15
 *   def msg(p, ids, extra=b""):
 *       return p.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in ids) + extra
 *   def xx(p, ids, extra=b""): return xxhash.xxh3_64_intdigest(msg(p, ids, extra))
 *   def sha(p, ids, extra=b""): return int.from_bytes(hashlib.sha256(msg(p, ids, extra)).digest()[:8], "little")
 *   def chain(H, ids, bs, salt=b""):
 *       out, p = [], NONE
 *       for i in range(len(ids) // bs):
 *           p = H(p, ids[i*bs:(i+1)*bs], salt if i == 0 else b""); out.append(p)
 *       return out
 *   cases = {
 *    "empty": (NONE, [], b""),
 *    "four": (NONE, [1, 2, 3, 4], b""),
 *    "salted": (0x0123456789abcdef, [0xFFFFFFFF, 0, 128000, 7], b"salt"),
 *    "long300": (NONE, [(i * 2654435761) % 2**32 for i in range(300)], b""),
 *   }
 *   l300 = cases["long300"][1]
 *   cases["long300salt"] = (NONE, l300, b"s" * 100)         # streaming path with extra bytes
 *   cases["long200salt"] = (NONE, l300[:200], b"s" * 100)   # 908 bytes: one-shot path
 *   for k, (p, ids, e) in cases.items():
 *       print(k, "xx=0x%016x" % xx(p, ids, e), "sha=0x%016x" % sha(p, ids, e))
 *   ids10 = list(range(10))
 *   for H, n in ((xx, "xx"), (sha, "sha")):
 *       print("chain10 bs4", n, ["0x%016x" % v for v in chain(H, ids10, 4)])
 *       print("chain10 bs4 salt", n, ["0x%016x" % v for v in chain(H, ids10, 4, b"tenant-a")])
 *   big = [(i * 40503 + 17) % 151936 for i in range(1000)]
 *   for H, n in ((xx, "xx"), (sha, "sha")):
 *       c = chain(H, big, 16); print("big", n, len(c), "0x%016x" % c[0], "0x%016x" % c[-1])
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/block_hash.h"

static const tsr_block_hash_algo algos[] = {TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_XXHASH};

static void fill_long300(uint32_t *ids) {
        for (uint64_t i = 0; i < 300; i++)
                ids[i] = (uint32_t)((i * 2654435761u) % 4294967296u);
}

static void fill_big(uint32_t *ids, uint32_t n) {
        for (uint32_t i = 0; i < n; i++)
                ids[i] = (i * 40503u + 17u) % 151936u;
}

static void test_algo_parse(void **state) {
        tsr_block_hash_algo a = (tsr_block_hash_algo)42;

        assert_int_equal(tsr_block_hash_algo_parse("sha256", &a), TSR_OK);
        assert_int_equal(a, TSR_BLOCK_HASH_SHA256);
        assert_int_equal(tsr_block_hash_algo_parse("xxhash", &a), TSR_OK);
        assert_int_equal(a, TSR_BLOCK_HASH_XXHASH);
        assert_int_equal(tsr_block_hash_algo_parse("sha256_cbor", &a), TSR_OK);
        assert_int_equal(a, TSR_BLOCK_HASH_SHA256);
        assert_int_equal(tsr_block_hash_algo_parse("xxhash_cbor", &a), TSR_OK);
        assert_int_equal(a, TSR_BLOCK_HASH_XXHASH);
        /* failures leave the output alone */
        a = (tsr_block_hash_algo)42;
        assert_int_equal(tsr_block_hash_algo_parse("md5", &a), TSR_E_INVAL);
        assert_int_equal(tsr_block_hash_algo_parse("SHA256", &a), TSR_E_INVAL);
        assert_int_equal(tsr_block_hash_algo_parse("", &a), TSR_E_INVAL);
        assert_int_equal(tsr_block_hash_algo_parse(NULL, &a), TSR_E_INVAL);
        assert_int_equal(a, 42);
        assert_string_equal(tsr_block_hash_algo_name(TSR_BLOCK_HASH_SHA256), "sha256");
        assert_string_equal(tsr_block_hash_algo_name(TSR_BLOCK_HASH_XXHASH), "xxhash");
        assert_string_equal(tsr_block_hash_algo_name((tsr_block_hash_algo)7), "?");
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH + 1, 0, NULL, 0, NULL, 0, &(uint64_t){0}),
                         TSR_E_INVAL);
}

static void test_known_answers_single(void **state) {
        static const uint32_t four[] = {1, 2, 3, 4};
        static const uint32_t salted[] = {0xFFFFFFFFu, 0, 128000, 7};
        uint32_t long300[300];
        uint64_t h;

        fill_long300(long300);
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, TSR_BLOCK_HASH_NONE, NULL, 0, NULL, 0, &h), TSR_OK);
        assert_int_equal(h, UINT64_C(0xf1d44f947e9fe56b));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_NONE, NULL, 0, NULL, 0, &h), TSR_OK);
        assert_int_equal(h, UINT64_C(0xcbb02314777f4e61));

        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, TSR_BLOCK_HASH_NONE, four, 4, NULL, 0, &h), TSR_OK);
        assert_int_equal(h, UINT64_C(0x7cff296f338bc24c));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_NONE, four, 4, NULL, 0, &h), TSR_OK);
        assert_int_equal(h, UINT64_C(0x151113154e7953b3));

        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, UINT64_C(0x0123456789abcdef), salted, 4, "salt", 4, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0xca3785f59e708e5c));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, UINT64_C(0x0123456789abcdef), salted, 4, "salt", 4, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x0bb2a616b0261b17));

        char salt100[100];
        memset(salt100, 's', sizeof(salt100));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, TSR_BLOCK_HASH_NONE, long300, 300, salt100, 100, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x6c43cc38763d460e));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_NONE, long300, 300, salt100, 100, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x991687d6dd57367a));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, TSR_BLOCK_HASH_NONE, long300, 200, salt100, 100, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x44cfa7746dbb4aa3));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_NONE, long300, 200, salt100, 100, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x39ed9777122910a0));

        /* 300 ids: crosses the 64-id staging chunk and the one-shot size (xxhash streams) */
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_XXHASH, TSR_BLOCK_HASH_NONE, long300, 300, NULL, 0, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0xb36deb5f0d2f0b01));
        assert_int_equal(tsr_block_hash(TSR_BLOCK_HASH_SHA256, TSR_BLOCK_HASH_NONE, long300, 300, NULL, 0, &h),
                         TSR_OK);
        assert_int_equal(h, UINT64_C(0x63932b680ed95af6));
}

/* The reusable hasher and the one-shot function agree (xxhash hashes messages up to
 * 1096 bytes from a stack buffer and streams longer ones). */
static void test_hasher_matches_oneshot(void **state) {
        uint32_t ids[300];
        fill_long300(ids);
        for (size_t a = 0; a < 2; a++) {
                tsr_block_hasher *h = NULL;
                assert_int_equal(tsr_block_hasher_new(algos[a], &h), TSR_OK);
                assert_int_equal(tsr_block_hasher_algo(h), algos[a]);
                for (size_t n = 0; n <= 300; n += 37) {
                        uint64_t x = 0, y = 1;
                        assert_int_equal(tsr_block_hasher_hash(h, n, ids, n, NULL, 0, &x), TSR_OK);
                        assert_int_equal(tsr_block_hash(algos[a], n, ids, n, NULL, 0, &y), TSR_OK);
                        assert_int_equal(x, y);
                }
                tsr_block_hasher_free(&h);
                assert_null(h);
                tsr_block_hasher_free(&h); /* NULL is fine */
        }
        assert_int_equal(tsr_block_hasher_new((tsr_block_hash_algo)9, &(tsr_block_hasher *){NULL}), TSR_E_INVAL);
}

static void test_known_answers_chain(void **state) {
        static const uint32_t ids10[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
        uint32_t big[1000];
        uint64_t out[64];
        size_t n = 0;

        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, ids10, 10, 4, NULL, 0, out, &n), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(out[0], UINT64_C(0xfbb3af2da4fb7839));
        assert_int_equal(out[1], UINT64_C(0x227420db30e6c985));
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, ids10, 10, 4, "tenant-a", 8, out, &n), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(out[0], UINT64_C(0x6f701adfcf99ee72));
        assert_int_equal(out[1], UINT64_C(0x3fb3d7a93ffcc14b));
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_SHA256, ids10, 10, 4, NULL, 0, out, &n), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(out[0], UINT64_C(0x906f55e5ab9025de));
        assert_int_equal(out[1], UINT64_C(0x627d8249d1c41c33));
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_SHA256, ids10, 10, 4, "tenant-a", 8, out, &n), TSR_OK);
        assert_int_equal(n, 2);
        assert_int_equal(out[0], UINT64_C(0x6690b479fb6660e3));
        assert_int_equal(out[1], UINT64_C(0xf2a08c7ae5464bb5));

        fill_big(big, 1000);
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, big, 1000, 16, NULL, 0, out, &n), TSR_OK);
        assert_int_equal(n, 62);
        assert_int_equal(out[0], UINT64_C(0x868fe9d7c6bf1f6b));
        assert_int_equal(out[61], UINT64_C(0x330928c6419a2840));
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_SHA256, big, 1000, 16, NULL, 0, out, &n), TSR_OK);
        assert_int_equal(n, 62);
        assert_int_equal(out[0], UINT64_C(0x443cd3f994fec59e));
        assert_int_equal(out[61], UINT64_C(0x0e7525573bca16a3));
}

/* The chain equals block-by-block hashing with the documented parents; only full
 * blocks are hashed; bad block size leaves outputs alone. */
static void test_chain_definition(void **state) {
        uint32_t big[1000];
        uint64_t out[64], h;
        size_t n = 99;

        fill_big(big, 1000);
        for (size_t a = 0; a < 2; a++) {
                assert_int_equal(tsr_block_hash_chain(algos[a], big, 1000, 16, "s", 1, out, &n), TSR_OK);
                uint64_t parent = TSR_BLOCK_HASH_NONE;
                for (size_t i = 0; i < n; i++) {
                        assert_int_equal(tsr_block_hash(algos[a], parent, big + 16 * i, 16, i ? NULL : "s", i ? 0 : 1,
                                                        &h),
                                         TSR_OK);
                        assert_int_equal(out[i], h);
                        parent = h;
                }
                /* shorter than one block: nothing hashed */
                n = 99;
                assert_int_equal(tsr_block_hash_chain(algos[a], big, 15, 16, NULL, 0, out, &n), TSR_OK);
                assert_int_equal(n, 0);
                assert_int_equal(tsr_block_hash_chain(algos[a], NULL, 0, 16, NULL, 0, out, &n), TSR_OK);
                assert_int_equal(n, 0);
                /* a partial tail changes nothing */
                uint64_t out2[64];
                size_t n2 = 0;
                assert_int_equal(tsr_block_hash_chain(algos[a], big, 16 * 5 + 7, 16, NULL, 0, out2, &n2), TSR_OK);
                assert_int_equal(n2, 5);
                assert_int_equal(tsr_block_hash_chain(algos[a], big, 16 * 5, 16, NULL, 0, out, &n), TSR_OK);
                assert_int_equal(n, 5);
                assert_memory_equal(out, out2, 5 * sizeof(uint64_t));
                n = 99;
                assert_int_equal(tsr_block_hash_chain(algos[a], big, 10, 0, NULL, 0, out, &n), TSR_E_INVAL);
                assert_int_equal(n, 99);
        }
}

/* Same prefix -> same leading hashes; a differing token changes its block and every
 * later one, never an earlier one. */
static void test_chain_prefix_property(void **state) {
        enum { N = 16 * 8, BS = 16 };
        uint32_t x[N], y[N];
        uint64_t hx[8], hy[8];
        size_t nx, ny;

        fill_big(x, N);
        for (size_t a = 0; a < 2; a++) {
                for (size_t pos = 0; pos < N; pos += 13) {
                        memcpy(y, x, sizeof(x));
                        y[pos] ^= 1;
                        assert_int_equal(tsr_block_hash_chain(algos[a], x, N, BS, NULL, 0, hx, &nx), TSR_OK);
                        assert_int_equal(tsr_block_hash_chain(algos[a], y, N, BS, NULL, 0, hy, &ny), TSR_OK);
                        assert_int_equal(nx, 8);
                        assert_int_equal(ny, 8);
                        for (size_t b = 0; b < 8; b++) {
                                if (b < pos / BS)
                                        assert_int_equal(hx[b], hy[b]);
                                else
                                        assert_int_not_equal(hx[b], hy[b]);
                        }
                }
                /* a longer sequence with the same prefix extends the chain */
                assert_int_equal(tsr_block_hash_chain(algos[a], x, 3 * BS, BS, NULL, 0, hy, &ny), TSR_OK);
                assert_int_equal(ny, 3);
                assert_memory_equal(hx, hy, 3 * sizeof(uint64_t));
        }
}

/* The salt enters block 0 only, yet changes every block (through the parent). */
static void test_salt(void **state) {
        enum { N = 16 * 4, BS = 16 };
        uint32_t x[N];
        uint64_t h0[4], h1[4], h2[4], h3[4], h;
        size_t n;

        fill_big(x, N);
        for (size_t a = 0; a < 2; a++) {
                assert_int_equal(tsr_block_hash_chain(algos[a], x, N, BS, NULL, 0, h0, &n), TSR_OK);
                assert_int_equal(tsr_block_hash_chain(algos[a], x, N, BS, "", 0, h1, &n), TSR_OK);
                assert_memory_equal(h0, h1, sizeof(h0)); /* empty salt == no salt */
                assert_int_equal(tsr_block_hash_chain(algos[a], x, N, BS, "tenant-a", 8, h2, &n), TSR_OK);
                assert_int_equal(tsr_block_hash_chain(algos[a], x, N, BS, "tenant-b", 8, h3, &n), TSR_OK);
                for (size_t b = 0; b < 4; b++) {
                        assert_int_not_equal(h0[b], h2[b]);
                        assert_int_not_equal(h2[b], h3[b]);
                }
                /* block 1 of the salted chain is the unsalted hash of its ids under the
                 * salted parent: the salt is not mixed in again */
                assert_int_equal(tsr_block_hash(algos[a], h2[0], x + BS, BS, NULL, 0, &h), TSR_OK);
                assert_int_equal(h, h2[1]);
        }
        /* the two algorithms differ */
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_SHA256, x, N, BS, NULL, 0, h0, &n), TSR_OK);
        assert_int_equal(tsr_block_hash_chain(TSR_BLOCK_HASH_XXHASH, x, N, BS, NULL, 0, h1, &n), TSR_OK);
        assert_int_not_equal(h0[0], h1[0]);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_algo_parse),
                cmocka_unit_test(test_known_answers_single),
                cmocka_unit_test(test_hasher_matches_oneshot),
                cmocka_unit_test(test_known_answers_chain),
                cmocka_unit_test(test_chain_definition),
                cmocka_unit_test(test_chain_prefix_property),
                cmocka_unit_test(test_salt),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
