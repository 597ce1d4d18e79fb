/* test_safetensors.c - the safetensors reader, and Llama loading from Hugging Face folders.
 *
 * The reader is fed small files built in memory: a valid one, every truncation of it
 * (each copied into a buffer of exactly that size, so ASan sees any read past it), every
 * byte of it overwritten with a few values, and one file per validation rule.  Each bad
 * file must fail with the right status and a message naming the tensor or field.
 *
 * The loader is checked against transformers on tests/fixtures/tiny-llama3-hf (written
 * by tests/fixtures/make_tiny_llama_hf.py): a tiny random LlamaForCausalLM with llama3
 * RoPE scaling, as float32 shards with an index (f32/) and as one bfloat16 file (bf16/),
 * whose golden is transformers run on the same bf16 weights widened to float32:
 *   full-sequence logits of 3 prompts       max |Δ| <= 1e-4, same argmax
 *   prefill + 8 one-token decode steps      bitwise our full-sequence rows; vs
 *                                           transformers' KV-cache path <= 1e-4
 *   greedy 16 tokens per prompt (decoding)  token-exact
 * and for load errors on patched copies of the fixture in a temporary folder. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/unit/test_util.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "kernels/kernels.h"
#include "worker/model/llama.h"
#include "worker/load/safetensors.h"
#include "worker/model/llama_weights.h"

/* The reference backend the forwards run on (made in main). */
static tsr_backend *ref_be;

#define FIXTURE "tests/fixtures/tiny-llama3-hf"

/* ---- helpers ------------------------------------------------------------------------ */

/* A .safetensors image: 8-byte little-endian length, `header`, `data_len` data bytes
 * (0, 1, 2, ... mod 251).  `hlen_override` (when not 0) replaces the length field. */
static uint8_t *mk_file(const char *header, size_t data_len, uint64_t hlen_override, size_t *len) {
        size_t hl = strlen(header);
        uint8_t *p = malloc(8 + hl + data_len + 1);
        uint64_t h = hlen_override ? hlen_override : hl;

        assert_non_null(p);
        for (int i = 0; i < 8; i++)
                p[i] = (uint8_t)(h >> (8 * i));
        memcpy(p + 8, header, hl);
        for (size_t i = 0; i < data_len; i++)
                p[8 + hl + i] = (uint8_t)(i % 251);
        *len = 8 + hl + data_len;
        return p;
}

/* Open `header` + data in memory; returns the status, message in err.  The bytes sit in a
 * buffer of exactly their size so a read past them is an ASan error. */
static tsr_status open_hdr(const char *header, size_t data_len, uint64_t hlen_override, char *err, size_t errlen) {
        size_t n;
        uint8_t *p = mk_file(header, data_len, hlen_override, &n);
        uint8_t *exact = malloc(n ? n : 1);
        tsr_safetensors *f = NULL;
        tsr_status st;

        memcpy(exact, p, n);
        free(p);
        err[0] = 0;
        st = tsr_safetensors_open_memory(exact, n, &f, err, errlen);
        if (st == TSR_OK)
                assert_non_null(f);
        else
                assert_null(f);
        tsr_safetensors_close(&f);
        free(exact);
        return st;
}

#define expect_err(st_expr, want_st, needle)                                                        \
        do {                                                                                        \
                tsr_status s_ = (st_expr);                                                          \
                if (s_ != (want_st) || !strstr(err, (needle)))                                      \
                        fail_msg("%s: status %d (want %d), message '%s' (want '%s')", #st_expr, s_,  \
                                 (int)(want_st), err, (needle));                                     \
        } while (0)

/* ---- the reader on in-memory files ---------------------------------------------------- */

/* 24 data bytes: a F32 [2, 2] at 8..24, a BF16 [2, 2] at 0..8, an empty I64 [0, 3]. */
static const char *const GOOD =
        "{\"__metadata__\":{\"format\":\"pt\",\"who\":\"test\"},"
        "\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,24]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
        "\"e\":{\"dtype\":\"I64\",\"shape\":[0,3],\"data_offsets\":[8,8]}}   ";

static void test_parse_ok(void **state) {
        char err[256];
        size_t n;
        uint8_t *p = mk_file(GOOD, 24, 0, &n);
        tsr_safetensors *f = NULL;
        const char *k, *v;

        assert_int_equal(tsr_safetensors_open_memory(p, n, &f, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_safetensors_n_tensors(f), 3);
        assert_int_equal(tsr_safetensors_data_offset(f), 8 + strlen(GOOD));
        assert_int_equal(tsr_safetensors_file_size(f), n);
        assert_string_equal(tsr_safetensors_path(f), "<memory>");
        /* header order */
        assert_string_equal(tsr_safetensors_tensor_at(f, 0)->name, "w");
        assert_string_equal(tsr_safetensors_tensor_at(f, 1)->name, "b");
        assert_string_equal(tsr_safetensors_tensor_at(f, 2)->name, "e");
        assert_null(tsr_safetensors_tensor_at(f, 3));
        const tsr_safetensors_tensor *w = tsr_safetensors_find(f, "w"), *e = tsr_safetensors_find(f, "e");
        assert_non_null(w);
        assert_int_equal(w->dtype, TSR_ST_F32);
        assert_int_equal(w->n_dims, 2);
        assert_int_equal(w->shape[0], 2);
        assert_int_equal(w->shape[1], 2);
        assert_int_equal(w->shape[2], 1);
        assert_int_equal(w->n_elements, 4);
        assert_int_equal(w->n_bytes, 16);
        assert_int_equal(w->offset, 8);
        assert_ptr_equal(w->data, p + 8 + strlen(GOOD) + 8);
        assert_int_equal(e->n_elements, 0);
        assert_null(e->data);
        assert_int_equal(tsr_safetensors_find(f, "b")->dtype, TSR_ST_BF16);
        assert_null(tsr_safetensors_find(f, "x"));
        assert_null(tsr_safetensors_find(f, NULL));
        assert_int_equal(tsr_safetensors_n_metadata(f), 2);
        assert_int_equal(tsr_safetensors_metadata_at(f, 1, &k, &v), TSR_OK);
        assert_string_equal(k, "who");
        assert_string_equal(v, "test");
        assert_string_equal(tsr_safetensors_metadata(f, "format"), "pt");
        assert_null(tsr_safetensors_metadata(f, "nope"));
        assert_int_equal(tsr_safetensors_metadata_at(f, 2, &k, &v), TSR_E_NOTFOUND);
        tsr_safetensors_close(&f);
        assert_null(f);
        tsr_safetensors_close(&f);
        tsr_safetensors_close(NULL);

        assert_string_equal(tsr_safetensors_dtype_name(TSR_ST_F8_E4M3), "F8_E4M3");
        assert_string_equal(tsr_safetensors_dtype_name((tsr_safetensors_dtype)99), "?");
        assert_int_equal(tsr_safetensors_dtype_bits(TSR_ST_F4), 4);
        assert_int_equal(tsr_safetensors_dtype_bits(TSR_ST_BF16), 16);
        assert_int_equal(tsr_safetensors_dtype_bits((tsr_safetensors_dtype)99), 0);

        /* no tensors at all, and nothing after the header: valid */
        assert_int_equal(open_hdr("{}", 0, 0, err, sizeof err), TSR_OK);
        assert_int_equal(open_hdr("{\"__metadata__\":{}}", 0, 0, err, sizeof err), TSR_OK);
        /* every dtype name the format defines parses */
        static const char *const dts[] = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3",
                                          "F6_E3M2", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64",
                                          "U64", "F64", "C64"};
        for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
                char h[160];
                uint32_t bits = 0;
                for (unsigned d = 0; d < TSR_ST_N_DTYPES; d++)
                        if (strcmp(tsr_safetensors_dtype_name((tsr_safetensors_dtype)d), dts[i]) == 0)
                                bits = tsr_safetensors_dtype_bits((tsr_safetensors_dtype)d);
                assert_true(bits > 0);
                /* 8 elements: a whole number of bytes for every width */
                snprintf(h, sizeof h, "{\"t\":{\"dtype\":\"%s\",\"shape\":[8],\"data_offsets\":[0,%u]}}", dts[i], bits);
                assert_int_equal(open_hdr(h, bits, 0, err, sizeof err), TSR_OK);
        }
        free(p);
}

/* Every prefix of a valid file is invalid, and reading it stays in bounds. */
static void test_truncations(void **state) {
        char err[256];
        size_t n;
        uint8_t *p = mk_file(GOOD, 24, 0, &n);

        for (size_t len = 0; len < n; len++) {
                uint8_t *exact = malloc(len ? len : 1);
                tsr_safetensors *f = NULL;
                memcpy(exact, p, len);
                err[0] = 0;
                tsr_status st = tsr_safetensors_open_memory(exact, len, &f, err, sizeof err);
                if (st != TSR_E_INVAL)
                        fail_msg("prefix of %zu bytes: status %d, '%s'", len, st, err);
                assert_null(f);
                assert_true(strncmp(err, "<memory>: ", 10) == 0);
                free(exact);
        }
        free(p);
}

/* Every byte overwritten with a few values: any status, no crash, no stray read. */
static void test_byte_mutations(void **state) {
        static const uint8_t vals[] = {0x00, 0x01, 0x22, 0x2c, 0x30, 0x39, 0x5b, 0x7d, 0x80, 0xff};
        char err[256];
        size_t n, ok = 0, bad = 0;
        uint8_t *p = mk_file(GOOD, 24, 0, &n);

        for (size_t i = 0; i < n; i++) {
                for (size_t v = 0; v < sizeof vals; v++) {
                        uint8_t *exact = malloc(n);
                        tsr_safetensors *f = NULL;
                        memcpy(exact, p, n);
                        exact[i] = vals[v];
                        if (tsr_safetensors_open_memory(exact, n, &f, err, sizeof err) == TSR_OK) {
                                /* whatever parsed must describe bytes inside the buffer */
                                for (size_t t = 0; t < tsr_safetensors_n_tensors(f); t++) {
                                        const tsr_safetensors_tensor *x = tsr_safetensors_tensor_at(f, t);
                                        if (x->n_bytes) {
                                                const uint8_t *d = x->data;
                                                assert_true(d >= exact && d + x->n_bytes <= exact + n);
                                        }
                                }
                                ok++;
                        } else {
                                assert_null(f);
                                bad++;
                        }
                        tsr_safetensors_close(&f);
                        free(exact);
                }
        }
        print_message("byte mutations: %zu parsed, %zu refused\n", ok, bad);
        assert_true(bad > 0 && ok > 0);
        free(p);
}

static void test_validation_errors(void **state) {
        char err[512];
        tsr_safetensors *f = NULL;

        /* lengths */
        expect_err(tsr_safetensors_open_memory("", 0, &f, err, sizeof err), TSR_E_INVAL, "shorter than the 8-byte");
        expect_err(tsr_safetensors_open_memory("\x02\0\0\0\0\0\0", 7, &f, err, sizeof err), TSR_E_INVAL,
                   "7 bytes");
        expect_err(open_hdr("{}", 0, 1ull << 40, err, sizeof err), TSR_E_LIMIT, "over the 100000000-byte limit");
        expect_err(open_hdr("{}", 0, UINT64_MAX, err, sizeof err), TSR_E_LIMIT, "limit");
        expect_err(open_hdr("{}", 0, TSR_SAFETENSORS_MAX_HEADER + 1ull, err, sizeof err), TSR_E_LIMIT, "limit");
        expect_err(open_hdr("{}", 0, 3, err, sizeof err), TSR_E_INVAL, "runs past the end");
        expect_err(open_hdr("{}", 0, TSR_SAFETENSORS_MAX_HEADER, err, sizeof err), TSR_E_INVAL, "runs past the end");
        assert_int_equal(tsr_safetensors_open_memory(NULL, 5, &f, err, sizeof err), TSR_E_INVAL);

        /* JSON */
        expect_err(open_hdr("", 0, 0, err, sizeof err), TSR_E_INVAL, "invalid JSON");
        expect_err(open_hdr("{\"a\":", 0, 0, err, sizeof err), TSR_E_INVAL, "invalid JSON");
        expect_err(open_hdr("[1,2]", 0, 0, err, sizeof err), TSR_E_INVAL, "header: not a JSON object");
        expect_err(open_hdr("{} {}", 0, 0, err, sizeof err), TSR_E_INVAL, "invalid JSON");
        expect_err(open_hdr("{\"a\xff\":1}", 0, 0, err, sizeof err), TSR_E_INVAL, "invalid JSON");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                            "\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                            8, 0, err, sizeof err),
                   TSR_E_INVAL, "duplicate");
        expect_err(open_hdr("{\"t\":[]}", 0, 0, err, sizeof err), TSR_E_INVAL, "'t': entry is not an object");

        /* fields */
        expect_err(open_hdr("{\"t\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err), TSR_E_INVAL,
                   "'t': 'dtype' missing");
        expect_err(open_hdr("{\"t\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "'dtype' missing or not a string");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F99\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "unknown dtype 'F99'");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "unknown dtype");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err), TSR_E_INVAL,
                   "'shape' missing");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "shape[0] is not a non-negative integer");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4, 0, err,
                            sizeof err),
                   TSR_E_INVAL, "shape[0]");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, 0,
                            err, sizeof err),
                   TSR_E_INVAL, "9 dims");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
                            0, err, sizeof err),
                   TSR_E_INVAL, "overflows");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[9223372036854775807,2],\"data_offsets\":[0,4]}}", 4,
                            0, err, sizeof err),
                   TSR_E_INVAL, "overflows");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", 4,
                            0, err, sizeof err),
                   TSR_E_INVAL, "invalid JSON");      /* jansson: too big an integer */
        /* a zero dim makes any other dims harmless */
        assert_int_equal(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[0,9223372036854775807,9223372036854775807],"
                                  "\"data_offsets\":[0,0]}}",
                                  0, 0, err, sizeof err),
                         TSR_OK);
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, 0, err, sizeof err),
                   TSR_E_INVAL, "not a whole number of bytes");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, 0, err,
                            sizeof err),
                   TSR_E_INVAL, "unknown field 'x'");
        expect_err(open_hdr("{\"__metadata__\":{\"a\":1}}", 0, 0, err, sizeof err), TSR_E_INVAL,
                   "'__metadata__' entry 'a' is not a string");
        expect_err(open_hdr("{\"__metadata__\":[]}", 0, 0, err, sizeof err), TSR_E_INVAL, "not an object");

        /* offsets */
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, 0, err, sizeof err), TSR_E_INVAL,
                   "'data_offsets' must be two");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "'data_offsets' must be two");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, 0, err,
                            sizeof err),
                   TSR_E_INVAL, "'data_offsets' must be two");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "'data_offsets' must be two");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "decrease");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 3, 0, err, sizeof err),
                   TSR_E_INVAL, "run past the 3-byte data section");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[9223372036854775800,"
                            "9223372036854775804]}}",
                            4, 0, err, sizeof err),
                   TSR_E_INVAL, "run past");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, 0, err, sizeof err),
                   TSR_E_INVAL, "hold 4 bytes, but F32 shape of 2 elements needs 8");
        expect_err(open_hdr("{\"t\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 0, err, sizeof err),
                   TSR_E_INVAL, "needs 4");
        expect_err(open_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                            12, 0, err, sizeof err),
                   TSR_E_INVAL, "overlaps tensor");
        expect_err(open_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                            8, 0, err, sizeof err),
                   TSR_E_INVAL, "overlaps");
        expect_err(open_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                            20, 0, err, sizeof err),
                   TSR_E_INVAL, "'b': 4 unused bytes before");
        expect_err(open_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, 0, err, sizeof err),
                   TSR_E_INVAL, "'a': 4 unused bytes");
        expect_err(open_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, 0, err, sizeof err),
                   TSR_E_INVAL, "4 bytes after the last tensor");
        expect_err(open_hdr("{}", 1, 0, err, sizeof err), TSR_E_INVAL, "1 bytes after the last tensor");
        assert_null(f);
}

/* ---- files and sets ------------------------------------------------------------------ */

static char tmpdir[256];

static void rm_tree(const char *dir) {
        DIR *d = opendir(dir);
        struct dirent *e;
        char p[1024];

        if (!d)
                return;
        while ((e = readdir(d))) {
                if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                        continue;
                snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
                unlink(p);
        }
        closedir(d);
        rmdir(dir);
}

static void mk_tmpdir(void) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpdir, sizeof tmpdir, "%s/tsr_st_XXXXXX", base ? base : "/tmp");
        assert_non_null(mkdtemp(tmpdir));
}

static void write_bytes(const char *dir, const char *name, const void *p, size_t n) {
        char path[1024];
        FILE *f;

        snprintf(path, sizeof path, "%s/%s", dir, name);
        f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(p, 1, n, f), n);
        assert_int_equal(fclose(f), 0);
}

static void write_json(const char *dir, const char *name, json_t *j) {
        char *s = json_dumps(j, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
        assert_non_null(s);
        write_bytes(dir, name, s, strlen(s));
        free(s);
}

/* Copy the tensors of `src` to dir/name as a new file, dropping `drop` (may be NULL),
 * giving `retype` (may be NULL) the dtype `new_dtype`, and adding an F32 tensor `extra`
 * of 4 elements (may be NULL). */
static void copy_st(const tsr_safetensors *src, const char *dir, const char *name, const char *drop,
                    const char *retype, const char *new_dtype, const char *extra) {
        json_t *h = json_object();
        uint64_t off = 0;
        size_t total = 0;

        for (size_t i = 0; i < tsr_safetensors_n_tensors(src); i++)
                total += tsr_safetensors_tensor_at(src, i)->n_bytes;
        uint8_t *data = malloc(total + 16);
        assert_non_null(data);
        for (size_t i = 0; i < tsr_safetensors_n_tensors(src); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_tensor_at(src, i);
                if (drop && strcmp(t->name, drop) == 0)
                        continue;
                json_t *shape = json_array(), *e = json_object();
                for (uint32_t d = 0; d < t->n_dims; d++)
                        json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
                const char *dt = retype && strcmp(t->name, retype) == 0 ? new_dtype
                                                                          : tsr_safetensors_dtype_name(t->dtype);
                json_object_set_new(e, "dtype", json_string(dt));
                json_object_set_new(e, "shape", shape);
                json_object_set_new(e, "data_offsets",
                                    json_pack("[II]", (json_int_t)off, (json_int_t)(off + t->n_bytes)));
                json_object_set_new(h, t->name, e);
                memcpy(data + off, t->data, t->n_bytes);
                off += t->n_bytes;
        }
        if (extra) {
                json_object_set_new(h, extra,
                                    json_pack("{s:s,s:[i],s:[II]}", "dtype", "F32", "shape", 4, "data_offsets",
                                              (json_int_t)off, (json_int_t)(off + 16)));
                memset(data + off, 0, 16);
                off += 16;
        }
        char *hs = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
        size_t hl = strlen(hs), n = 8 + hl + off;
        uint8_t *file = malloc(n);
        for (int i = 0; i < 8; i++)
                file[i] = (uint8_t)((uint64_t)hl >> (8 * i));
        memcpy(file + 8, hs, hl);
        memcpy(file + 8 + hl, data, off);
        write_bytes(dir, name, file, n);
        free(file);
        free(hs);
        free(data);
        json_decref(h);
}

static void test_open_files_and_sets(void **state) {
        char path[1024], p2[1024], err[512];
        tsr_safetensors *f = NULL;
        tsr_safetensors_set *s = NULL;
        const char *file = NULL;

        expect_err(tsr_safetensors_open("/nonexistent/model.safetensors", &f, err, sizeof err), TSR_E_NOTFOUND,
                   "/nonexistent/model.safetensors: ");
        expect_err(tsr_safetensors_open("/", &f, err, sizeof err), TSR_E_INVAL, "not a regular file");
        assert_non_null(tsr_test_src_path(FIXTURE "/bf16", path, sizeof path));       /* committed */

        /* one file */
        assert_int_equal(tsr_safetensors_set_open(path, &s, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_safetensors_set_n_files(s), 1);
        assert_int_equal(tsr_safetensors_set_n_tensors(s), 21);
        assert_non_null(strstr(tsr_safetensors_set_source(s), "bf16/model.safetensors"));
        const tsr_safetensors_tensor *t = tsr_safetensors_set_find(s, "model.layers.1.mlp.down_proj.weight", &file);
        assert_non_null(t);
        assert_int_equal(t->dtype, TSR_ST_BF16);
        assert_int_equal(t->shape[0], 64);
        assert_int_equal(t->shape[1], 128);
        assert_non_null(strstr(file, "bf16/model.safetensors"));
        assert_null(tsr_safetensors_set_find(s, "model.layers.2.mlp.down_proj.weight", &file));
        assert_string_equal(tsr_safetensors_metadata(tsr_safetensors_set_file(s, 0), "format"), "pt");
        assert_null(tsr_safetensors_set_file(s, 1));
        assert_null(tsr_safetensors_set_tensor_at(s, 21, NULL));
        tsr_safetensors_set_close(&s);

        /* shards with an index */
        assert_non_null(tsr_test_src_path(FIXTURE "/f32", path, sizeof path));
        assert_int_equal(tsr_safetensors_set_open(path, &s, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_safetensors_set_n_files(s), 3);
        assert_int_equal(tsr_safetensors_set_n_tensors(s), 21);
        assert_non_null(strstr(tsr_safetensors_set_source(s), "model.safetensors.index.json"));
        t = tsr_safetensors_set_find(s, "lm_head.weight", &file);
        assert_non_null(t);
        assert_int_equal(t->dtype, TSR_ST_F32);
        assert_non_null(strstr(file, "model-00003-of-00003.safetensors"));
        t = tsr_safetensors_set_find(s, "model.embed_tokens.weight", &file);
        assert_non_null(strstr(file, "model-00001-of-00003.safetensors"));
        for (size_t i = 1; i < tsr_safetensors_set_n_tensors(s); i++)      /* name order */
                assert_true(strcmp(tsr_safetensors_set_tensor_at(s, i - 1, NULL)->name,
                                   tsr_safetensors_set_tensor_at(s, i, NULL)->name) < 0);
        tsr_safetensors_set_close(&s);
        tsr_safetensors_set_close(&s);
        tsr_safetensors_set_close(NULL);

        /* index errors, in a scratch folder */
        mk_tmpdir();
        expect_err(tsr_safetensors_set_open(tmpdir, &s, err, sizeof err), TSR_E_NOTFOUND,
                   "no model.safetensors.index.json or model.safetensors");
        assert_null(s);
        assert_non_null(tsr_test_src_path(FIXTURE "/bf16/model.safetensors", p2, sizeof p2));
        assert_int_equal(tsr_safetensors_open(p2, &f, err, sizeof err), TSR_OK);
        copy_st(f, tmpdir, "a.safetensors", NULL, NULL, NULL, NULL);
        static const struct {
                const char *index, *needle;
                tsr_status st;
        } bad[] = {
                {"{", "invalid JSON", TSR_E_INVAL},
                {"{}", "'weight_map' missing", TSR_E_INVAL},
                {"{\"weight_map\":{}}", "empty", TSR_E_INVAL},
                {"{\"weight_map\":{\"lm_head.weight\":3}}", "weight_map['lm_head.weight']", TSR_E_INVAL},
                {"{\"weight_map\":{\"lm_head.weight\":\"../a.safetensors\"}}", "not the name of a file", TSR_E_INVAL},
                {"{\"weight_map\":{\"lm_head.weight\":\"..\"}}", "not the name of a file", TSR_E_INVAL},
                {"{\"weight_map\":{\"lm_head.weight\":\"\"}}", "not the name of a file", TSR_E_INVAL},
                {"{\"weight_map\":{\"lm_head.weight\":\"b.safetensors\"}}", "b.safetensors: ", TSR_E_NOTFOUND},
                {"{\"weight_map\":{\"lm_head.weight\":\"a.safetensors\",\"nope\":\"a.safetensors\"}}",
                 "a.safetensors: tensor 'nope' missing", TSR_E_NOTFOUND},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                write_bytes(tmpdir, "model.safetensors.index.json", bad[i].index, strlen(bad[i].index));
                expect_err(tsr_safetensors_set_open(tmpdir, &s, err, sizeof err), bad[i].st, bad[i].needle);
                assert_null(s);
        }
        const char *good = "{\"metadata\":{},\"weight_map\":{\"lm_head.weight\":\"a.safetensors\","
                           "\"model.norm.weight\":\"a.safetensors\"}}";
        write_bytes(tmpdir, "model.safetensors.index.json", good, strlen(good));
        assert_int_equal(tsr_safetensors_set_open(tmpdir, &s, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_safetensors_set_n_tensors(s), 2);
        assert_non_null(tsr_safetensors_set_find(s, "model.norm.weight", NULL));
        /* in the file but not in the map: not part of the set */
        assert_null(tsr_safetensors_set_find(s, "model.embed_tokens.weight", NULL));
        tsr_safetensors_set_close(&s);
        tsr_safetensors_close(&f);
        rm_tree(tmpdir);
}

/* ---- HF config.json ------------------------------------------------------------------ */

static void test_config_hf(void **state) {
        char err[512];
        tsr_llama_config a, b, c;
        const char *v5 = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,"
                         "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":16,"
                         "\"intermediate_size\":128,\"vocab_size\":300,\"max_position_embeddings\":256,"
                         "\"rms_norm_eps\":1e-05,\"tie_word_embeddings\":false,\"hidden_act\":\"silu\","
                         "\"attention_bias\":false,\"mlp_bias\":false,"
                         "\"rope_parameters\":{\"rope_type\":\"llama3\",\"rope_theta\":500000.0,\"factor\":8.0,"
                         "\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
                         "\"original_max_position_embeddings\":64}}";
        const char *v4 = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,"
                         "\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                         "\"intermediate_size\":128,\"vocab_size\":300,\"max_position_embeddings\":256,"
                         "\"rms_norm_eps\":1e-05,\"rope_theta\":500000,"
                         "\"rope_scaling\":{\"type\":\"llama3\",\"factor\":8,"
                         "\"low_freq_factor\":1,\"high_freq_factor\":4,"
                         "\"original_max_position_embeddings\":64}}";

        assert_int_equal(tsr_llama_config_from_hf_json(v5, strlen(v5), "c.json", &a, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_llama_config_from_hf_json(v4, strlen(v4), "c.json", &b, err, sizeof err), TSR_OK);
        assert_memory_equal(&a, &b, sizeof a);
        assert_int_equal(a.dim, 64);
        assert_int_equal(a.n_layers, 2);
        assert_int_equal(a.n_heads, 4);
        assert_int_equal(a.n_kv_heads, 2);
        assert_int_equal(a.head_dim, 16);
        assert_int_equal(a.hidden_dim, 128);
        assert_int_equal(a.vocab_size, 300);
        assert_int_equal(a.max_seq_len, 256);
        assert_true(a.rms_eps == 1e-5f);
        assert_true(a.rope_theta == 500000.0);
        assert_int_equal(a.rope_layout, TSR_ROPE_NEOX);
        assert_true(a.rope_llama3);
        assert_true(a.rope_factor == 8.0 && a.rope_low_freq_factor == 1.0 && a.rope_high_freq_factor == 4.0);
        assert_int_equal(a.rope_original_max_pos, 64);
        assert_false(a.tied_embeddings);

        /* defaults: kv heads, head_dim, eps 1e-6, theta 10000, no scaling, untied; model_type alone */
        const char *min = "{\"model_type\":\"llama\",\"hidden_size\":96,\"num_hidden_layers\":1,"
                          "\"num_attention_heads\":3,\"intermediate_size\":10,\"vocab_size\":7,"
                          "\"rope_scaling\":null,\"tie_word_embeddings\":true}";
        assert_int_equal(tsr_llama_config_from_hf_json(min, strlen(min), "c.json", &c, err, sizeof err), TSR_OK);
        assert_int_equal(c.n_kv_heads, 3);
        assert_int_equal(c.head_dim, 32);
        assert_true(c.rms_eps == 1e-6f);
        assert_true(c.rope_theta == 10000.0);
        assert_false(c.rope_llama3);
        assert_true(c.tied_embeddings);
        assert_int_equal(c.max_seq_len, 0);
        const char *dflt = "{\"model_type\":\"llama\",\"hidden_size\":96,\"num_hidden_layers\":1,"
                           "\"num_attention_heads\":3,\"intermediate_size\":10,\"vocab_size\":7,"
                           "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":20000}}";
        assert_int_equal(tsr_llama_config_from_hf_json(dflt, strlen(dflt), "c.json", &c, err, sizeof err), TSR_OK);
        assert_true(c.rope_theta == 20000.0);
        assert_false(c.rope_llama3);

        static const struct {
                const char *from, *to, *needle;
                tsr_status st;
        } bad[] = {
                {"LlamaForCausalLM", "Qwen2ForCausalLM", "architecture 'Qwen2ForCausalLM' is not supported",
                 TSR_E_UNSUPPORTED},
                {"[\"LlamaForCausalLM\"]", "\"LlamaForCausalLM\"", "'architectures'", TSR_E_INVAL},
                {"\"hidden_size\":64", "\"hidden_size\":\"64\"", "'hidden_size'", TSR_E_INVAL},
                {"\"hidden_size\":64,", "", "'hidden_size' missing", TSR_E_INVAL},
                {"\"vocab_size\":300", "\"vocab_size\":-1", "'vocab_size'", TSR_E_INVAL},
                {"\"vocab_size\":300", "\"vocab_size\":0", "non-zero", TSR_E_INVAL},
                {"\"num_key_value_heads\":2", "\"num_key_value_heads\":3", "not a multiple", TSR_E_INVAL},
                {"\"head_dim\":16", "\"head_dim\":15", "even", TSR_E_INVAL},
                {"\"rms_norm_eps\":1e-05", "\"rms_norm_eps\":0", "rms_norm_eps", TSR_E_INVAL},
                {"\"hidden_act\":\"silu\"", "\"hidden_act\":\"gelu\"", "hidden_act 'gelu'", TSR_E_UNSUPPORTED},
                {"\"attention_bias\":false", "\"attention_bias\":true", "'attention_bias'", TSR_E_UNSUPPORTED},
                {"\"mlp_bias\":false", "\"mlp_bias\":true", "'mlp_bias'", TSR_E_UNSUPPORTED},
                {"\"mlp_bias\":false", "\"partial_rotary_factor\":0.5", "partial_rotary_factor",
                 TSR_E_UNSUPPORTED},
                {"\"rope_type\":\"llama3\"", "\"rope_type\":\"yarn\"", "rope type 'yarn'", TSR_E_UNSUPPORTED},
                {"\"rope_type\":\"llama3\",", "", "rope_parameters.rope_type' missing", TSR_E_INVAL},
                {"\"factor\":8.0,", "", "'rope_parameters.factor' missing", TSR_E_INVAL},
                {"\"factor\":8.0", "\"factor\":\"8\"", "rope_parameters.factor", TSR_E_INVAL},
                {"\"high_freq_factor\":4.0", "\"high_freq_factor\":0.5", "low_freq_factor <= high_freq",
                 TSR_E_INVAL},
                {"\"original_max_position_embeddings\":64", "\"original_max_position_embeddings\":0",
                 "original_max_position_embeddings", TSR_E_INVAL},
                {"\"rope_theta\":500000.0", "\"rope_theta\":-1", "rope_theta", TSR_E_INVAL},
                {"\"tie_word_embeddings\":false", "\"tie_word_embeddings\":1", "tie_word_embeddings", TSR_E_INVAL},
                {"{\"architectures\"", "[{\"architectures\"", "invalid JSON", TSR_E_INVAL},
                {"\"hidden_size\":64", "\"hidden_size\":64,\"hidden_size\":64", "duplicate", TSR_E_INVAL},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                char buf[2048];
                const char *at = strstr(v5, bad[i].from);
                assert_non_null(at);
                snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - v5), v5, bad[i].to, at + strlen(bad[i].from));
                c.dim = 12345;
                expect_err(tsr_llama_config_from_hf_json(buf, strlen(buf), "c.json", &c, err, sizeof err), bad[i].st,
                           bad[i].needle);
                assert_non_null(strstr(err, "c.json: "));
                assert_int_equal(c.dim, 12345);         /* untouched on failure */
        }
        const char *mt = "{\"model_type\":\"mistral\",\"hidden_size\":64}";
        expect_err(tsr_llama_config_from_hf_json(mt, strlen(mt), "c.json", &c, err, sizeof err), TSR_E_UNSUPPORTED,
                   "model_type 'mistral'");
        expect_err(tsr_llama_config_from_hf_json("[]", 2, "c.json", &c, err, sizeof err), TSR_E_INVAL,
                   "expected a JSON object");
}

/* ---- the tiny Llama 3 against transformers ---------------------------------------------- */

static json_t *golden;

static int golden_setup(void **state) {
        char path[1024];
        json_error_t je;

        if (tsr_test_src_path(FIXTURE "/golden.json", path, sizeof path))
                golden = json_load_file(path, 0, &je);
        return 0;
}

static int golden_teardown(void **state) {
        json_decref(golden);
        golden = NULL;
        return 0;
}

static float *load_logits(const char *name, size_t n) {
        char rel[512], path[1024];
        float *v = malloc(n * sizeof(float));
        FILE *f;

        snprintf(rel, sizeof rel, FIXTURE "/%s", name);
        assert_non_null(tsr_test_src_path(rel, path, sizeof path));
        f = fopen(path, "rb");
        assert_non_null(f);
        assert_int_equal(fread(v, sizeof(float), n, f), n);     /* little-endian host assumed (x86, arm) */
        assert_int_equal(fgetc(f), EOF);
        fclose(f);
        return v;
}

static void check_variant(const char *variant, uint32_t want_dtype) {
        char path[1024], err[512];
        tsr_llama *m = NULL;
        tsr_llama_kv *kv = NULL;
        tsr_load_stats st;
        json_t *var = json_object_get(json_object_get(golden, "variants"), variant);
        json_t *ps = json_object_get(golden, "prompts");
        size_t n_prompts = json_array_size(ps), rows = 0, n_steps;
        double worst = 0, worst_dec = 0;

        assert_non_null(golden);                                              /* committed */
        assert_non_null(var);
        assert_non_null(tsr_test_src_path(FIXTURE, path, sizeof path));
        snprintf(path + strlen(path), sizeof path - strlen(path), "/%s",
                 json_string_value(json_object_get(var, "dir")));
        tsr_status s = tsr_llama_load(path, NULL, NULL, NULL, &m, &st, err, sizeof err);
        if (s != TSR_OK)
                fail_msg("%s", err);
        const tsr_llama_config *c = tsr_llama_config_of(m);
        size_t V = c->vocab_size;
        assert_int_equal(V, json_integer_value(json_object_get(golden, "vocab_size")));
        assert_int_equal(c->rope_layout, TSR_ROPE_NEOX);
        assert_true(c->rope_llama3);
        assert_false(c->tied_embeddings);
        assert_int_equal(st.n_tensors, 21);
        assert_int_equal(st.f32_bytes, 112448 * 4);
        assert_int_equal(st.file_bytes, 112448 * (want_dtype == TSR_ST_F32 ? 4 : 2));

        uint32_t ids[128];
        for (size_t pi = 0; pi < n_prompts; pi++)
                rows += tsr_test_prompt_ids(golden, pi, ids, 128);
        n_steps = (size_t)json_integer_value(json_object_get(json_object_get(golden, "decode"), "steps"));
        size_t dec_prompt = (size_t)json_integer_value(json_object_get(json_object_get(golden, "decode"), "prompt"));
        float *want = load_logits(json_string_value(json_object_get(var, "logits_file")), (rows + n_steps) * V);
        float *got = malloc(128 * V * sizeof(float)), *step = malloc(V * sizeof(float));
        assert_int_equal(tsr_llama_kv_new(m, 128, 4, &kv), TSR_OK);

        /* full sequence */
        size_t row = 0;
        for (size_t pi = 0; pi < n_prompts; pi++) {
                size_t n = tsr_test_prompt_ids(golden, pi, ids, 128);
                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, got), TSR_OK);
                for (size_t t = 0; t < n; t++) {
                        const float *w = want + (row + t) * V, *g = got + t * V;
                        for (size_t i = 0; i < V; i++) {
                                double d = fabs((double)g[i] - w[i]);
                                worst = fmax(worst, d);
                                if (!(d <= 1e-4))
                                        fail_msg("%s prompt %zu pos %zu id %zu: %.7g, transformers %.7g", variant, pi,
                                                 t, i, g[i], w[i]);
                        }
                        assert_int_equal(tsr_test_argmax(g, V), tsr_test_argmax(w, V));
                }
                if (pi == dec_prompt) {
                        /* prefill all but the last steps, then one token at a time: bitwise the
                         * full-sequence rows (batch invariance), and transformers' cache path */
                        float *full = malloc(n * V * sizeof(float));
                        memcpy(full, got, n * V * sizeof(float));
                        assert_true(n > n_steps);
                        assert_int_equal(tsr_llama_kv_truncate(kv, 0), TSR_OK);
                        assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n - n_steps, 0, TSR_LLAMA_LOGITS_LAST,
                                                           step),
                                         TSR_OK);
                        assert_memory_equal(step, full + (n - n_steps - 1) * V, V * sizeof(float));
                        for (size_t k = 0; k < n_steps; k++) {
                                size_t t = n - n_steps + k;
                                assert_int_equal(tsr_llama_forward(m, ref_be, kv, &ids[t], 1, t, TSR_LLAMA_LOGITS_LAST,
                                                                   step),
                                                 TSR_OK);
                                assert_memory_equal(step, full + t * V, V * sizeof(float));
                                const float *w = want + (rows + k) * V;
                                for (size_t i = 0; i < V; i++)
                                        worst_dec = fmax(worst_dec, fabs((double)step[i] - w[i]));
                        }
                        assert_true(worst_dec <= 1e-4);
                        free(full);
                }
                row += n;
        }

        /* greedy continuations through the decode path */
        json_t *greedy = json_object_get(var, "greedy");
        size_t agree = 0, total = 0;
        for (size_t pi = 0; pi < n_prompts; pi++) {
                json_t *gw = json_array_get(greedy, pi);
                size_t n = tsr_test_prompt_ids(golden, pi, ids, 128);
                assert_int_equal(tsr_llama_kv_truncate(kv, 0), TSR_OK);
                assert_int_equal(tsr_llama_forward(m, ref_be, kv, ids, n, 0, TSR_LLAMA_LOGITS_LAST, step), TSR_OK);
                for (size_t s2 = 0; s2 < json_array_size(gw); s2++) {
                        uint32_t tok = (uint32_t)tsr_test_argmax(step, V);
                        long long w = json_integer_value(json_array_get(gw, s2));
                        total++;
                        if (tok != w)
                                fail_msg("%s prompt %zu greedy step %zu: %u, transformers %lld", variant, pi, s2, tok, w);
                        agree++;
                        assert_int_equal(tsr_llama_forward(m, ref_be, kv, &tok, 1, n + s2, TSR_LLAMA_LOGITS_LAST, step),
                                         TSR_OK);
                }
        }
        assert_int_equal(total, 16 * n_prompts);
        print_message("tiny-llama3-hf %s: %zu tensors, %.0f KB in files; max |dlogit| full %.3g, decode path %.3g "
                      "(max |logit| %.3g); greedy %zu/%zu tokens equal\n",
                      variant, st.n_tensors, (double)st.file_bytes / 1024, worst, worst_dec,
                      json_real_value(json_object_get(var, "max_abs_logit")), agree, total);
        tsr_llama_kv_free(&kv);
        tsr_llama_free(&m);
        free(want);
        free(got);
        free(step);
}

/* A tensor-parallel rank's load (issue #20) of the f32 and bf16 copies: rank 1 of 2
 * reads its share only (the stats count it: under the whole model's floats, the
 * norms whole) and comes back split for that rank, so that a caller that
 * never calls tsr_llama_shard_tp still holds a consistent model (bf16 conversion reads
 * only what was loaded: ASan would see an overflow); shard_tp for the same rank is a
 * no-op, for another rank an error naming both. */
static void test_tp_share_load(void **state) {
        (void)state;
        static const char *const dirs[] = {"f32", "bf16"};
        for (size_t d = 0; d < 2; d++) {
                char path[1024], err[512] = "";
                tsr_llama *m = NULL;
                tsr_load_stats st = {0};
                tsr_shard_spec r1 = {.tp_rank = 1, .tp_size = 2, .first_layer = 0, .last_layer = 1};
                assert_non_null(tsr_test_src_path(FIXTURE, path, sizeof path));
                snprintf(path + strlen(path), sizeof path - strlen(path), "/%s", dirs[d]);
                if (tsr_llama_load(path, &r1, NULL, NULL, &m, &st, err, sizeof err) != TSR_OK)
                        fail_msg("%s: %s", path, err);
                assert_int_equal(st.n_tensors, 21);
                assert_true(st.f32_bytes < 112448 * 4 * 3 / 4);
                assert_int_equal(tsr_llama_shard_tp(m, 1, 2, err, sizeof err), TSR_OK);
                assert_int_equal(tsr_llama_shard_tp(m, 0, 2, err, sizeof err), TSR_E_INVAL);
                assert_non_null(strstr(err, "read as tensor parallel rank 1 of 2's share, not tensor parallel rank 0 of 2's"));
                assert_int_equal(tsr_llama_use_bf16(m), TSR_OK);
                tsr_llama_free(&m);
        }
}

/* keep_bf16 (tsr_load_opts; the runner sets it whenever the weights become bfloat16): the
 * bf16 fixture's seven matmuls a layer and its embedding / lm_head table(s) stay BF16 as
 * stored, so the load holds 2 bytes, not 4, for each of their weights; after
 * tsr_llama_use_bf16 the kept model holds 2 bytes less per table element than the
 * widened-then-converted one (whose embedding stays float32) and gives bitwise its
 * logits, on the reference and the fast backend.  As tensor-parallel rank 1 of 2 the share is cut from the mapped
 * file and the split (tsr_llama_shard_tp) runs on the kept bytes. */
static void test_bf16_kept_as_stored(void **state) {
        (void)state;
        char path[1024], err[512] = "";
        tsr_llama *conv = NULL, *kept = NULL;
        tsr_llama_kv *kv = NULL;
        tsr_load_stats sc = {0}, sk = {0};
        tsr_backend *fast = NULL;
        const tsr_load_opts keep = {.keep_bf16 = true};
        uint32_t ids[128];

        assert_non_null(tsr_test_src_path(FIXTURE "/bf16", path, sizeof path));
        if (tsr_llama_load(path, NULL, NULL, NULL, &conv, &sc, err, sizeof err) != TSR_OK ||
            tsr_llama_load_opts(path, NULL, NULL, &keep, NULL, NULL, &kept, &sk, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        const tsr_llama_config *c = tsr_llama_config_of(conv);
        size_t V = c->vocab_size, L = c->n_layers, dim = c->dim, hd = c->head_dim;
        size_t mm = L * (2 * c->n_heads * hd * dim + 2 * c->n_kv_heads * hd * dim + 3 * (size_t)c->hidden_dim * dim);
        size_t tables = (c->tied_embeddings ? 1 : 2) * V * dim;
        assert_int_equal(sc.resident_bytes, 112448 * 4);
        assert_int_equal(sk.resident_bytes, 112448 * 4 - (mm + tables) * 2);   /* all at 2 bytes */
        assert_int_equal(tsr_llama_use_bf16(conv), TSR_OK);
        assert_int_equal(tsr_llama_use_bf16(kept), TSR_OK);
        /* converted: the float32 embedding and a bf16 lm_head; kept: the one table as stored
         * (tied), or both at 2 bytes */
        assert_int_equal(tsr_llama_resident_bytes(kept), tsr_llama_resident_bytes(conv) - V * dim * (c->tied_embeddings ? 4 : 2));
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = 2}, &fast), TSR_OK);
        float *a = malloc(128 * V * sizeof(float)), *b = malloc(128 * V * sizeof(float));
        assert_true(a && b);
        tsr_backend *bes[] = {ref_be, fast};
        for (size_t k = 0; k < 2; k++)
                for (size_t pi = 0; pi < json_array_size(json_object_get(golden, "prompts")); pi++) {
                        size_t n = tsr_test_prompt_ids(golden, pi, ids, 128);
                        assert_int_equal(tsr_llama_kv_new(conv, 128, 4, &kv), TSR_OK);
                        assert_int_equal(tsr_llama_forward(conv, bes[k], kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, a), TSR_OK);
                        tsr_llama_kv_free(&kv);
                        assert_int_equal(tsr_llama_kv_new(kept, 128, 4, &kv), TSR_OK);
                        assert_int_equal(tsr_llama_forward(kept, bes[k], kv, ids, n, 0, TSR_LLAMA_LOGITS_ALL, b), TSR_OK);
                        tsr_llama_kv_free(&kv);
                        assert_memory_equal(a, b, n * V * sizeof(float));
                }
        tsr_llama_free(&conv);
        tsr_llama_free(&kept);

        /* rank 1 of 2: its share kept (under half the matmul bytes), split on the bytes */
        tsr_shard_spec r1 = {.tp_rank = 1, .tp_size = 2, .first_layer = 0, .last_layer = (uint32_t)L - 1};
        if (tsr_llama_load_opts(path, NULL, &r1, &keep, NULL, NULL, &kept, &sk, err, sizeof err) != TSR_OK)
                fail_msg("%s", err);
        assert_int_equal(tsr_llama_shard_tp(kept, 1, 2, err, sizeof err), TSR_OK);
        assert_int_equal(tsr_llama_use_bf16(kept), TSR_OK);
        tsr_llama_free(&kept);
        tsr_backend_free(&fast);
        free(a);
        free(b);
}

static void test_tiny_llama3_f32(void **state) { check_variant("f32", TSR_ST_F32); }

static void test_tiny_llama3_bf16(void **state) { check_variant("bf16", TSR_ST_BF16); }

/* ---- load errors on patched copies ------------------------------------------------------ */

/* Copy the bf16 fixture's config.json (patched by `patch`, may be NULL) and model file
 * (as copy_st) into the scratch folder, then load it. */
static tsr_status load_patched(void (*patch)(json_t *cfg), const char *drop, const char *retype,
                               const char *new_dtype, const char *extra, const tsr_shard_spec *spec, char *err,
                               size_t errlen) {
        char path[1024];
        tsr_safetensors *f = NULL;
        tsr_llama *m = NULL;
        json_error_t je;
        json_t *cfg;

        assert_non_null(tsr_test_src_path(FIXTURE "/bf16/config.json", path, sizeof path));
        cfg = json_load_file(path, JSON_PRESERVE_ORDER, &je);
        assert_non_null(cfg);
        if (patch)
                patch(cfg);
        write_json(tmpdir, "config.json", cfg);
        json_decref(cfg);
        assert_non_null(tsr_test_src_path(FIXTURE "/bf16/model.safetensors", path, sizeof path));
        assert_int_equal(tsr_safetensors_open(path, &f, err, errlen), TSR_OK);
        copy_st(f, tmpdir, "model.safetensors", drop, retype, new_dtype, extra);
        tsr_safetensors_close(&f);
        err[0] = 0;
        tsr_status st = tsr_llama_load(tmpdir, spec, NULL, NULL, &m, NULL, err, errlen);
        if (st == TSR_OK)
                assert_non_null(m);
        else
                assert_null(m);
        tsr_llama_free(&m);
        return st;
}

static void patch_arch(json_t *c) {
        json_object_set_new(c, "architectures", json_pack("[s]", "MixtralForCausalLM"));
}
static void patch_inter(json_t *c) { json_object_set_new(c, "intermediate_size", json_integer(96)); }
static void patch_tied(json_t *c) { json_object_set_new(c, "tie_word_embeddings", json_true()); }

static void test_load_errors(void **state) {
        char path[1024], err[512], file[1100];
        tsr_llama *m = NULL;

        assert_non_null(tsr_test_src_path(FIXTURE "/bf16", path, sizeof path));       /* committed */
        mk_tmpdir();
        snprintf(file, sizeof file, "%s/model.safetensors", tmpdir);

        /* a folder without config.json */
        expect_err(tsr_llama_load(tmpdir, NULL, NULL, NULL, &m, NULL, err, sizeof err),
                   TSR_E_NOTFOUND, "config.json");
        assert_null(m);

        /* the unpatched copy loads */
        assert_int_equal(load_patched(NULL, NULL, NULL, NULL, NULL, NULL, err, sizeof err), TSR_OK);
        /* tied embeddings: lm_head.weight is ignored, even when absent */
        assert_int_equal(load_patched(patch_tied, "lm_head.weight", NULL, NULL, NULL, NULL, err, sizeof err), TSR_OK);

        /* config.json but no weights */
        char mpath[1100];
        snprintf(mpath, sizeof mpath, "%s/model.safetensors", tmpdir);
        unlink(mpath);
        expect_err(tsr_llama_load(tmpdir, NULL, NULL, NULL, &m, NULL, err, sizeof err),
                   TSR_E_NOTFOUND, "no model.safetensors.index.json or model.safetensors");

        expect_err(load_patched(patch_arch, NULL, NULL, NULL, NULL, NULL, err, sizeof err), TSR_E_UNSUPPORTED,
                   "architecture 'MixtralForCausalLM' is not supported");
        assert_non_null(strstr(err, "/config.json: "));
        expect_err(load_patched(NULL, "model.layers.1.self_attn.v_proj.weight", NULL, NULL, NULL, NULL, err,
                                sizeof err),
                   TSR_E_NOTFOUND, "tensor 'model.layers.1.self_attn.v_proj.weight' missing");
        assert_non_null(strstr(err, file));
        expect_err(load_patched(NULL, "lm_head.weight", NULL, NULL, NULL, NULL, err, sizeof err), TSR_E_NOTFOUND,
                   "'lm_head.weight' missing");
        expect_err(load_patched(patch_inter, NULL, NULL, NULL, NULL, NULL, err, sizeof err), TSR_E_INVAL,
                   "tensor 'model.layers.0.mlp.gate_proj.weight': shape [128, 64], expected [96, 64]");
        assert_non_null(strstr(err, file));
        /* I16 has BF16's size, so the file stays valid and only the loader refuses it */
        expect_err(load_patched(NULL, NULL, "model.norm.weight", "I16", NULL, NULL, err, sizeof err),
                   TSR_E_UNSUPPORTED, "tensor 'model.norm.weight': dtype I16 is not supported");
        assert_non_null(strstr(err, file));
        expect_err(load_patched(NULL, NULL, NULL, NULL, "model.layers.0.self_attn.q_proj.bias", NULL, err, sizeof err),
                   TSR_E_UNSUPPORTED, "'model.layers.0.self_attn.q_proj.bias': biases are not supported");
        /* A pipeline stage's layer range and a tensor-parallel rank's share load
         * (test_parallel.c runs them); a rank past the size and a range past the last
         * layer are refused. */
        tsr_shard_spec tp2 = {.tp_rank = 2, .tp_size = 2, .first_layer = 0, .last_layer = 1};
        expect_err(load_patched(NULL, NULL, NULL, NULL, NULL, &tp2, err, sizeof err), TSR_E_UNSUPPORTED,
                   "shard tp 2/2 layers 0..1: a rank below the tensor parallel size and a layer range within 0..1 "
                   "are supported");
        tsr_shard_spec past = {.tp_rank = 0, .tp_size = 1, .first_layer = 1, .last_layer = 2};
        expect_err(load_patched(NULL, NULL, NULL, NULL, NULL, &past, err, sizeof err), TSR_E_UNSUPPORTED,
                   "a layer range within 0..1");
        rm_tree(tmpdir);
}

int main(void) {
        const struct CMUnitTest reader[] = {
                cmocka_unit_test(test_parse_ok),
                cmocka_unit_test(test_truncations),
                cmocka_unit_test(test_byte_mutations),
                cmocka_unit_test(test_validation_errors),
                cmocka_unit_test(test_open_files_and_sets),
                cmocka_unit_test(test_config_hf),
        };
        const struct CMUnitTest model[] = {
                cmocka_unit_test(test_tiny_llama3_f32),
                cmocka_unit_test(test_tiny_llama3_bf16),
                cmocka_unit_test(test_load_errors),
                cmocka_unit_test(test_tp_share_load),
                cmocka_unit_test(test_bf16_kept_as_stored),
        };
        if (tsr_backend_cpu_ref_new(&ref_be) != TSR_OK)
                return 1;
        int failed = cmocka_run_group_tests_name("safetensors", reader, NULL, NULL);
        failed += cmocka_run_group_tests_name("safetensors_llama", model, golden_setup, golden_teardown);
        tsr_backend_free(&ref_be);
        return failed ? 1 : 0;
}
