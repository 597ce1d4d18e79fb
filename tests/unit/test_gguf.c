/* test_gguf.c - the GGUF reader on bytes written here and on real model files.
 *
 * A small writer builds a file with every value type, nested arrays and two tensors;
 * the test then checks every parsed field, truncates the file at every length, and
 * corrupts one field at a time to check each is rejected with a message naming it.
 * Real files (TSR_FIXTURES, TSR_SOURCE_ROOT/.cache/models) are checked against facts
 * read with the Python `gguf` package; tests skip when a file is absent. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>
#include "tests/tsr_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/buf.h"
#include "worker/load/gguf.h"
#include "worker/load/loader.h"
#include "tests/unit/gguf_writer.h"

/* ---- a minimal GGUF writer ---------------------------------------------------- */

static void w_f32(tsr_buf *b, float f) {
        uint32_t bits;
        memcpy(&bits, &f, 4);
        gw_u32(b, bits);
}

static void w_f64(tsr_buf *b, double d) {
        uint64_t bits;
        memcpy(&bits, &d, 8);
        gw_u64(b, bits);
}

static void w_pad(tsr_buf *b, size_t align) {
        while (b->len % align)
                gw_u8(b, 0);
}

static void put_u32(tsr_buf *b, size_t off, uint32_t x) {
        for (int i = 0; i < 4; i++)
                b->data[off + i] = (uint8_t)(x >> (8 * i));
}

static void put_u64(tsr_buf *b, size_t off, uint64_t x) {
        for (int i = 0; i < 8; i++)
                b->data[off + i] = (uint8_t)(x >> (8 * i));
}

/* Where the fields the corruption tests patch were written. */
struct sample {
        tsr_buf b;
        size_t off_version, off_n_tensors, off_n_kv;
        size_t off_key0_len;            /* length of the first key */
        size_t off_type_u8;             /* value type of "t.u8" */
        size_t off_key_i8;              /* the bytes of the key "t.i8" */
        size_t off_str_len;             /* length of the value of "t.str" */
        size_t off_arr_type, off_arr_count;     /* "t.arr_i32" */
        size_t off_align_value;
        size_t off_t0_ndims, off_t0_dim0;
        size_t off_t1_name;             /* the bytes of "b.weight" */
        size_t off_t1_dim0, off_t1_type, off_t1_offset;
        size_t data_start;
};

#define SAMPLE_ALIGN 64

static void build_sample(struct sample *s) {
        tsr_buf *b = &s->b;

        memset(s, 0, sizeof(*s));
        tsr_buf_init(b, 1 << 20);
        gw_bytes(b, "GGUF", 4);
        s->off_version = b->len;
        gw_u32(b, 3);
        s->off_n_tensors = b->len;
        gw_u64(b, 2);
        s->off_n_kv = b->len;
        gw_u64(b, 19);

        s->off_key0_len = b->len;
        gw_key(b, "general.architecture", TSR_GGUF_TYPE_STRING);
        gw_str(b, "llama");
        gw_str(b, "t.u8");
        s->off_type_u8 = b->len;
        gw_u32(b, TSR_GGUF_TYPE_UINT8);
        gw_u8(b, 200);
        gw_u64(b, 4);
        s->off_key_i8 = b->len;
        gw_bytes(b, "t.i8", 4);
        gw_u32(b, TSR_GGUF_TYPE_INT8);
        gw_u8(b, (uint8_t)-5);
        gw_key(b, "t.u16", TSR_GGUF_TYPE_UINT16);
        gw_le(b, 60000, 2);
        gw_key(b, "t.i16", TSR_GGUF_TYPE_INT16);
        gw_le(b, (uint16_t)-300, 2);
        gw_key(b, "t.u32", TSR_GGUF_TYPE_UINT32);
        gw_u32(b, 4000000000u);
        gw_key(b, "t.i32", TSR_GGUF_TYPE_INT32);
        gw_u32(b, (uint32_t)-70000);
        gw_key(b, "t.f32", TSR_GGUF_TYPE_FLOAT32);
        w_f32(b, 1.5f);
        gw_key(b, "t.bool", TSR_GGUF_TYPE_BOOL);
        gw_u8(b, 1);
        gw_key(b, "t.str", TSR_GGUF_TYPE_STRING);
        s->off_str_len = b->len;
        gw_str(b, "hello");
        gw_key(b, "t.u64", TSR_GGUF_TYPE_UINT64);
        gw_u64(b, UINT64_C(1) << 40);
        gw_key(b, "t.i64", TSR_GGUF_TYPE_INT64);
        gw_u64(b, (uint64_t)INT64_MIN);
        gw_key(b, "t.f64", TSR_GGUF_TYPE_FLOAT64);
        w_f64(b, 2.25);
        gw_key(b, "t.arr_i32", TSR_GGUF_TYPE_ARRAY);
        s->off_arr_type = b->len;
        gw_u32(b, TSR_GGUF_TYPE_INT32);
        s->off_arr_count = b->len;
        gw_u64(b, 3);
        gw_u32(b, 1);
        gw_u32(b, (uint32_t)-2);
        gw_u32(b, 3);
        gw_key(b, "t.arr_str", TSR_GGUF_TYPE_ARRAY);
        gw_u32(b, TSR_GGUF_TYPE_STRING);
        gw_u64(b, 3);
        gw_str(b, "a");
        gw_str(b, "bc");
        gw_str(b, "");
        gw_key(b, "t.arr_nested", TSR_GGUF_TYPE_ARRAY);   /* [[7, 8], [], [9]] of uint16 */
        gw_u32(b, TSR_GGUF_TYPE_ARRAY);
        gw_u64(b, 3);
        gw_u32(b, TSR_GGUF_TYPE_UINT16);
        gw_u64(b, 2);
        gw_le(b, 7, 2);
        gw_le(b, 8, 2);
        gw_u32(b, TSR_GGUF_TYPE_UINT16);
        gw_u64(b, 0);
        gw_u32(b, TSR_GGUF_TYPE_UINT16);
        gw_u64(b, 1);
        gw_le(b, 9, 2);
        gw_key(b, "t.arr_f64", TSR_GGUF_TYPE_ARRAY);
        gw_u32(b, TSR_GGUF_TYPE_FLOAT64);
        gw_u64(b, 2);
        w_f64(b, -1.0);
        w_f64(b, 0.5);
        gw_key(b, "t.arr_empty", TSR_GGUF_TYPE_ARRAY);
        gw_u32(b, TSR_GGUF_TYPE_STRING);
        gw_u64(b, 0);
        gw_key(b, "general.alignment", TSR_GGUF_TYPE_UINT32);
        s->off_align_value = b->len;
        gw_u32(b, SAMPLE_ALIGN);

        /* Tensor 0: "a.weight", F32 [4, 3] at 0 (48 bytes). */
        gw_str(b, "a.weight");
        s->off_t0_ndims = b->len;
        gw_u32(b, 2);
        s->off_t0_dim0 = b->len;
        gw_u64(b, 4);
        gw_u64(b, 3);
        gw_u32(b, TSR_GGML_TYPE_F32);
        gw_u64(b, 0);
        /* Tensor 1: "b.weight", Q4_0 [64, 2] at 64 (4 blocks of 18 bytes). */
        gw_u64(b, 8);
        s->off_t1_name = b->len;
        gw_bytes(b, "b.weight", 8);
        gw_u32(b, 2);
        s->off_t1_dim0 = b->len;
        gw_u64(b, 64);
        gw_u64(b, 2);
        s->off_t1_type = b->len;
        gw_u32(b, TSR_GGML_TYPE_Q4_0);
        s->off_t1_offset = b->len;
        gw_u64(b, SAMPLE_ALIGN);

        w_pad(b, SAMPLE_ALIGN);
        s->data_start = b->len;
        for (int i = 0; i < 12; i++)
                w_f32(b, (float)i * 0.5f);
        w_pad(b, SAMPLE_ALIGN);
        for (int i = 0; i < 72; i++)
                gw_u8(b, (uint8_t)(0xA0 + i));
}

/* Parse from an exactly-sized heap copy so ASan flags any read past the end. */
static tsr_status open_copy(const tsr_buf *b, size_t len, tsr_gguf **g, char *err, size_t errlen, void **copy) {
        *copy = malloc(len ? len : 1);
        assert_non_null(*copy);
        if (len)
                memcpy(*copy, b->data, len);
        return tsr_gguf_open_memory(*copy, len, g, err, errlen);
}

static const tsr_gguf_value *kv(const tsr_gguf *g, const char *key) {
        const tsr_gguf_kv *e = tsr_gguf_find_kv(g, key);
        assert_non_null(e);
        return &e->value;
}

static void test_sample_fields(void **state) {
        struct sample s;
        tsr_gguf *g = NULL;
        char err[256] = "";
        void *copy;
        const tsr_gguf_value *v;
        tsr_gguf_value e, inner;
        const tsr_gguf_tensor *t;
        uint64_t u;
        int64_t i;
        double d;
        bool bo;
        const char *str;
        size_t len;

        build_sample(&s);
        assert_int_equal(open_copy(&s.b, s.b.len, &g, err, sizeof(err), &copy), TSR_OK);
        assert_int_equal(tsr_gguf_version(g), 3);
        assert_int_equal(tsr_gguf_alignment(g), SAMPLE_ALIGN);
        assert_int_equal(tsr_gguf_data_offset(g), s.data_start);
        assert_int_equal(tsr_gguf_file_size(g), s.b.len);
        assert_int_equal(tsr_gguf_n_kv(g), 19);
        assert_string_equal(tsr_gguf_kv_at(g, 0)->key, "general.architecture");
        assert_string_equal(tsr_gguf_kv_at(g, 18)->key, "general.alignment");
        assert_null(tsr_gguf_kv_at(g, 19));
        assert_null(tsr_gguf_find_kv(g, "missing.key"));
        assert_null(tsr_gguf_find_kv(g, "t.u"));

        v = kv(g, "general.architecture");
        assert_int_equal(tsr_gguf_get_str(v, &str, &len), TSR_OK);
        assert_int_equal(len, 5);
        assert_memory_equal(str, "llama", 5);
        assert_int_equal(tsr_gguf_get_u64(v, &u), TSR_E_INVAL);

        v = kv(g, "t.u8");
        assert_int_equal(v->type, TSR_GGUF_TYPE_UINT8);
        assert_int_equal(tsr_gguf_get_u64(v, &u), TSR_OK);
        assert_int_equal(u, 200);
        v = kv(g, "t.i8");
        assert_int_equal(tsr_gguf_get_i64(v, &i), TSR_OK);
        assert_int_equal(i, -5);
        u = 77;
        assert_int_equal(tsr_gguf_get_u64(v, &u), TSR_E_INVAL);     /* negative */
        assert_int_equal(u, 77);                                    /* untouched on failure */
        assert_int_equal(tsr_gguf_get_u64(kv(g, "t.u16"), &u), TSR_OK);
        assert_int_equal(u, 60000);
        assert_int_equal(tsr_gguf_get_i64(kv(g, "t.i16"), &i), TSR_OK);
        assert_int_equal(i, -300);
        assert_int_equal(tsr_gguf_get_u64(kv(g, "t.u32"), &u), TSR_OK);
        assert_int_equal(u, 4000000000u);
        assert_int_equal(tsr_gguf_get_i64(kv(g, "t.i32"), &i), TSR_OK);
        assert_int_equal(i, -70000);
        assert_int_equal(tsr_gguf_get_f64(kv(g, "t.f32"), &d), TSR_OK);
        assert_true(d == 1.5);
        assert_int_equal(tsr_gguf_get_bool(kv(g, "t.bool"), &bo), TSR_OK);
        assert_true(bo);
        assert_int_equal(tsr_gguf_get_bool(kv(g, "t.u8"), &bo), TSR_E_INVAL);
        assert_int_equal(tsr_gguf_get_str(kv(g, "t.str"), &str, &len), TSR_OK);
        assert_int_equal(len, 5);
        assert_memory_equal(str, "hello", 5);
        assert_int_equal(tsr_gguf_get_u64(kv(g, "t.u64"), &u), TSR_OK);
        assert_int_equal(u, UINT64_C(1) << 40);
        assert_int_equal(tsr_gguf_get_i64(kv(g, "t.i64"), &i), TSR_OK);
        assert_true(i == INT64_MIN);
        assert_int_equal(tsr_gguf_get_f64(kv(g, "t.f64"), &d), TSR_OK);
        assert_true(d == 2.25);
        assert_int_equal(tsr_gguf_get_f64(kv(g, "t.i32"), &d), TSR_OK);     /* integers widen */
        assert_true(d == -70000.0);

        v = kv(g, "t.arr_i32");
        assert_int_equal(v->type, TSR_GGUF_TYPE_ARRAY);
        assert_int_equal(v->elem_type, TSR_GGUF_TYPE_INT32);
        assert_int_equal(v->count, 3);
        assert_int_equal(tsr_gguf_array_elem(v, 1, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_i64(&e, &i), TSR_OK);
        assert_int_equal(i, -2);
        assert_int_equal(tsr_gguf_array_elem(v, 2, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_i64(&e, &i), TSR_OK);
        assert_int_equal(i, 3);
        assert_int_equal(tsr_gguf_array_elem(v, 3, &e), TSR_E_NOTFOUND);
        assert_int_equal(tsr_gguf_array_elem(kv(g, "t.u8"), 0, &e), TSR_E_INVAL);

        v = kv(g, "t.arr_str");
        assert_int_equal(v->elem_type, TSR_GGUF_TYPE_STRING);
        assert_int_equal(v->count, 3);
        assert_int_equal(tsr_gguf_array_elem(v, 1, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_str(&e, &str, &len), TSR_OK);
        assert_int_equal(len, 2);
        assert_memory_equal(str, "bc", 2);
        assert_int_equal(tsr_gguf_array_elem(v, 2, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_str(&e, &str, &len), TSR_OK);
        assert_int_equal(len, 0);
        assert_int_equal(tsr_gguf_array_elem(v, 0, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_str(&e, &str, &len), TSR_OK);
        assert_int_equal(len, 1);
        assert_memory_equal(str, "a", 1);

        v = kv(g, "t.arr_nested");
        assert_int_equal(v->elem_type, TSR_GGUF_TYPE_ARRAY);
        assert_int_equal(v->count, 3);
        assert_int_equal(tsr_gguf_array_elem(v, 0, &e), TSR_OK);
        assert_int_equal(e.type, TSR_GGUF_TYPE_ARRAY);
        assert_int_equal(e.elem_type, TSR_GGUF_TYPE_UINT16);
        assert_int_equal(e.count, 2);
        assert_int_equal(tsr_gguf_array_elem(&e, 1, &inner), TSR_OK);
        assert_int_equal(tsr_gguf_get_u64(&inner, &u), TSR_OK);
        assert_int_equal(u, 8);
        assert_int_equal(tsr_gguf_array_elem(v, 1, &e), TSR_OK);
        assert_int_equal(e.count, 0);
        assert_int_equal(tsr_gguf_array_elem(v, 2, &e), TSR_OK);
        assert_int_equal(tsr_gguf_array_elem(&e, 0, &inner), TSR_OK);
        assert_int_equal(tsr_gguf_get_u64(&inner, &u), TSR_OK);
        assert_int_equal(u, 9);

        v = kv(g, "t.arr_f64");
        assert_int_equal(tsr_gguf_array_elem(v, 0, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_f64(&e, &d), TSR_OK);
        assert_true(d == -1.0);
        assert_int_equal(kv(g, "t.arr_empty")->count, 0);

        assert_int_equal(tsr_gguf_n_tensors(g), 2);
        t = tsr_gguf_tensor_at(g, 0);
        assert_string_equal(t->name, "a.weight");
        assert_int_equal(t->type, TSR_GGML_TYPE_F32);
        assert_int_equal(t->n_dims, 2);
        assert_int_equal(t->dims[0], 4);
        assert_int_equal(t->dims[1], 3);
        assert_int_equal(t->dims[2], 1);
        assert_int_equal(t->dims[3], 1);
        assert_int_equal(t->n_elements, 12);
        assert_int_equal(t->n_bytes, 48);
        assert_int_equal(t->offset, 0);
        assert_ptr_equal(t->data, (const uint8_t *)copy + s.data_start);
        {
                float f;
                memcpy(&f, (const uint8_t *)t->data + 5 * 4, 4);
                assert_true(f == 2.5f);
        }
        t = tsr_gguf_find_tensor(g, "b.weight");
        assert_non_null(t);
        assert_ptr_equal(t, tsr_gguf_tensor_at(g, 1));
        assert_int_equal(t->type, TSR_GGML_TYPE_Q4_0);
        assert_int_equal(t->n_elements, 128);
        assert_int_equal(t->n_bytes, 72);
        assert_int_equal(t->offset, SAMPLE_ALIGN);
        assert_int_equal(((const uint8_t *)t->data)[0], 0xA0);
        assert_int_equal(((const uint8_t *)t->data)[71], 0xA0 + 71);
        assert_null(tsr_gguf_find_tensor(g, "c.weight"));
        assert_null(tsr_gguf_tensor_at(g, 2));

        tsr_gguf_close(&g);
        assert_null(g);
        tsr_gguf_close(&g);     /* NULL is fine */
        free(copy);
        tsr_buf_done(&s.b);
}

static void test_type_tables(void **state) {
        static const struct { uint32_t t; const char *name; uint32_t blck, bytes; } want[] = {
                {TSR_GGML_TYPE_F32, "F32", 1, 4},       {TSR_GGML_TYPE_F16, "F16", 1, 2},
                {TSR_GGML_TYPE_BF16, "BF16", 1, 2},     {TSR_GGML_TYPE_Q4_0, "Q4_0", 32, 18},
                {TSR_GGML_TYPE_Q4_1, "Q4_1", 32, 20},   {TSR_GGML_TYPE_Q5_0, "Q5_0", 32, 22},
                {TSR_GGML_TYPE_Q5_1, "Q5_1", 32, 24},   {TSR_GGML_TYPE_Q8_0, "Q8_0", 32, 34},
                {TSR_GGML_TYPE_Q2_K, "Q2_K", 256, 84},  {TSR_GGML_TYPE_Q3_K, "Q3_K", 256, 110},
                {TSR_GGML_TYPE_Q4_K, "Q4_K", 256, 144}, {TSR_GGML_TYPE_Q5_K, "Q5_K", 256, 176},
                {TSR_GGML_TYPE_Q6_K, "Q6_K", 256, 210}, {TSR_GGML_TYPE_Q8_K, "Q8_K", 256, 292},
                {TSR_GGML_TYPE_IQ4_NL, "IQ4_NL", 32, 18}, {TSR_GGML_TYPE_IQ4_XS, "IQ4_XS", 256, 136},
        };
        uint32_t blck = 0, bytes = 0;

        for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
                assert_string_equal(tsr_ggml_type_name(want[k].t), want[k].name);
                assert_int_equal(tsr_ggml_type_size(want[k].t, &blck, &bytes), TSR_OK);
                assert_int_equal(blck, want[k].blck);
                assert_int_equal(bytes, want[k].bytes);
        }
        assert_null(tsr_ggml_type_name(4));     /* retired Q4_2 */
        assert_null(tsr_ggml_type_name(31));
        assert_null(tsr_ggml_type_name(1000));
        assert_int_equal(tsr_ggml_type_size(5, &blck, &bytes), TSR_E_INVAL);
        assert_string_equal(tsr_gguf_type_name(TSR_GGUF_TYPE_FLOAT64), "float64");
        assert_string_equal(tsr_gguf_type_name((tsr_gguf_type)99), "?");
}

static void test_truncated_everywhere(void **state) {
        struct sample s;
        char err[256];

        build_sample(&s);
        for (size_t len = 0; len < s.b.len; len++) {
                tsr_gguf *g = NULL;
                void *copy;
                tsr_status st;

                err[0] = '\0';
                st = open_copy(&s.b, len, &g, err, sizeof(err), &copy);
                if (st == TSR_OK)
                        fail_msg("truncated at %zu of %zu bytes but open succeeded", len, s.b.len);
                assert_null(g);
                assert_true(strncmp(err, "<memory>: ", 10) == 0);
                free(copy);
        }
        tsr_buf_done(&s.b);
}

/* Patch the sample, open it, and expect failure with every `needle` in the message. */
static void expect_reject(struct sample *s, tsr_status want, const char *needle1, const char *needle2) {
        tsr_gguf *g = NULL;
        char err[512] = "";
        void *copy;
        tsr_status st = open_copy(&s->b, s->b.len, &g, err, sizeof(err), &copy);

        if (st == TSR_OK || (want != TSR_OK && st != want) || !strstr(err, needle1) ||
            (needle2 && !strstr(err, needle2)))
                fail_msg("status %d, message \"%s\"; wanted \"%s\" / \"%s\"", st, err, needle1,
                         needle2 ? needle2 : "");
        assert_null(g);
        free(copy);
        tsr_buf_done(&s->b);
}

static void test_corrupt_fields(void **state) {
        struct sample s;

        build_sample(&s);
        s.b.data[0] = 'X';
        expect_reject(&s, TSR_E_INVAL, "not a GGUF file", NULL);

        build_sample(&s);
        put_u32(&s.b, s.off_version, 1);
        expect_reject(&s, TSR_E_UNSUPPORTED, "version", "not supported");

        build_sample(&s);
        put_u32(&s.b, s.off_version, 0x03000000u);
        expect_reject(&s, TSR_E_UNSUPPORTED, "big-endian", NULL);

        build_sample(&s);
        put_u64(&s.b, s.off_n_kv, UINT64_C(1) << 40);
        expect_reject(&s, TSR_E_INVAL, "metadata_kv_count", NULL);

        build_sample(&s);
        put_u64(&s.b, s.off_n_tensors, UINT64_MAX);
        expect_reject(&s, TSR_E_INVAL, "tensor_count", NULL);

        build_sample(&s);
        put_u64(&s.b, s.off_key0_len, UINT64_C(1) << 50);
        expect_reject(&s, TSR_E_INVAL, "metadata key 0", "runs past the end");

        build_sample(&s);
        put_u32(&s.b, s.off_type_u8, 13);
        expect_reject(&s, TSR_E_INVAL, "key 't.u8'", "unknown value type 13");

        build_sample(&s);
        s.b.data[s.off_key_i8 + 2] = 'u';       /* "t.i8" -> "t.u8" */
        expect_reject(&s, TSR_E_INVAL, "duplicate metadata key 't.u8'", NULL);

        build_sample(&s);
        put_u64(&s.b, s.off_str_len, 1u << 20);
        expect_reject(&s, TSR_E_INVAL, "key 't.str'", "runs past the end");

        build_sample(&s);
        put_u32(&s.b, s.off_arr_type, 77);
        expect_reject(&s, TSR_E_INVAL, "key 't.arr_i32'", "unknown array element type 77");

        build_sample(&s);
        put_u64(&s.b, s.off_arr_count, UINT64_C(1) << 61);
        expect_reject(&s, TSR_E_INVAL, "key 't.arr_i32'", "array count");

        build_sample(&s);
        put_u32(&s.b, s.off_align_value, 48);
        expect_reject(&s, TSR_E_INVAL, "general.alignment", "power of two");

        build_sample(&s);
        put_u32(&s.b, s.off_align_value, 0);
        expect_reject(&s, TSR_E_INVAL, "general.alignment", NULL);

        build_sample(&s);
        put_u32(&s.b, s.off_t0_ndims, 5);
        expect_reject(&s, TSR_E_INVAL, "tensor 'a.weight'", "n_dims 5");

        build_sample(&s);
        put_u64(&s.b, s.off_t0_dim0, UINT64_C(1) << 62);       /* 2^62 * 3 > 2^63 */
        expect_reject(&s, TSR_E_INVAL, "tensor 'a.weight'", "dims overflow");

        build_sample(&s);
        put_u64(&s.b, s.off_t0_dim0, UINT64_MAX);
        expect_reject(&s, TSR_E_INVAL, "tensor 'a.weight'", "dims overflow");

        build_sample(&s);
        put_u32(&s.b, s.off_t1_type, 4);
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "unknown ggml type 4");

        build_sample(&s);
        put_u32(&s.b, s.off_t1_type, 9999);
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "unknown ggml type 9999");

        build_sample(&s);
        put_u64(&s.b, s.off_t1_dim0, 48);       /* not a multiple of Q4_0's 32 */
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "block size");

        build_sample(&s);
        put_u64(&s.b, s.off_t1_offset, SAMPLE_ALIGN + 4);
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "not a multiple of the alignment");

        build_sample(&s);
        put_u64(&s.b, s.off_t1_offset, 2 * SAMPLE_ALIGN);
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "outside the file");

        build_sample(&s);
        put_u64(&s.b, s.off_t1_offset, UINT64_MAX - 63);       /* aligned, and offset + size wraps */
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "outside the file");

        build_sample(&s);
        put_u64(&s.b, s.off_t1_dim0, UINT64_C(1) << 40);       /* fits the counts, not the file */
        expect_reject(&s, TSR_E_INVAL, "tensor 'b.weight'", "outside the file");

        build_sample(&s);
        s.b.data[s.off_t1_name] = 'a';
        expect_reject(&s, TSR_E_INVAL, "duplicate tensor name 'a.weight'", NULL);

        build_sample(&s);
        s.b.data[s.off_t1_name + 1] = '\0';
        expect_reject(&s, TSR_E_INVAL, "tensor 1 name", "NUL");
}

/* Arrays nested deeper than TSR_GGUF_MAX_ARRAY_DEPTH are refused (the parser recurses). */
static void test_nesting_limit(void **state) {
        for (int depth = TSR_GGUF_MAX_ARRAY_DEPTH - 1; depth <= TSR_GGUF_MAX_ARRAY_DEPTH + 2; depth++) {
                tsr_buf b;
                tsr_gguf *g = NULL;
                char err[256] = "";
                void *copy;
                tsr_status st;

                tsr_buf_init(&b, 1 << 16);
                gw_bytes(&b, "GGUF", 4);
                gw_u32(&b, 2);
                gw_u64(&b, 0);
                gw_u64(&b, 1);
                gw_key(&b, "deep", TSR_GGUF_TYPE_ARRAY);
                for (int k = 1; k < depth; k++) {      /* `depth` arrays in all, one element each */
                        gw_u32(&b, TSR_GGUF_TYPE_ARRAY);
                        gw_u64(&b, 1);
                }
                gw_u32(&b, TSR_GGUF_TYPE_UINT8);
                gw_u64(&b, 1);
                gw_u8(&b, 42);
                st = open_copy(&b, b.len, &g, err, sizeof(err), &copy);
                if (depth <= TSR_GGUF_MAX_ARRAY_DEPTH) {
                        assert_int_equal(st, TSR_OK);
                        assert_int_equal(tsr_gguf_version(g), 2);
                        assert_int_equal(tsr_gguf_n_tensors(g), 0);
                        tsr_gguf_close(&g);
                } else {
                        assert_int_equal(st, TSR_E_INVAL);
                        assert_non_null(strstr(err, "key 'deep'"));
                        assert_non_null(strstr(err, "nested"));
                }
                free(copy);
                tsr_buf_done(&b);
        }
}

static void test_open_errors(void **state) {
        tsr_gguf *g = NULL;
        char err[256] = "";
        char path[] = "/tmp/tsr_gguf_testXXXXXX";
        int fd;

        assert_int_equal(tsr_gguf_open("/nonexistent/x.gguf", &g, err, sizeof(err)), TSR_E_NOTFOUND);
        assert_non_null(strstr(err, "/nonexistent/x.gguf"));
        assert_null(g);
        assert_int_equal(tsr_gguf_open("/tmp", &g, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "not a regular file"));

        fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_int_equal(tsr_gguf_open(path, &g, err, sizeof(err)), TSR_E_INVAL);  /* empty file */
        assert_non_null(strstr(err, path));
        assert_non_null(strstr(err, "magic"));
        assert_int_equal(write(fd, "GGUF\x03\0\0\0", 8), 8);
        assert_int_equal(tsr_gguf_open(path, &g, NULL, 0), TSR_E_INVAL);        /* no message buffer */
        assert_int_equal(tsr_gguf_open(path, &g, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "tensor_count"));
        assert_null(g);
        close(fd);
        unlink(path);
}

/* ---- real files ----------------------------------------------------------------- */

static tsr_gguf *open_real(const char *env, const char *rel, char *path, size_t pathlen) {
        const char *dir = getenv(env);
        char err[512] = "";
        tsr_gguf *g = NULL;

        if (!dir)
                return NULL;
        snprintf(path, pathlen, "%s/%s", dir, rel);
        if (access(path, R_OK) != 0)
                return NULL;
        if (tsr_gguf_open(path, &g, err, sizeof(err)) != TSR_OK)
                fail_msg("%s", err);
        return g;
}

static uint64_t key_u64(const tsr_gguf *g, const char *key) {
        uint64_t u = 0;
        assert_int_equal(tsr_gguf_get_u64(kv(g, key), &u), TSR_OK);
        return u;
}

static void assert_key_str(const tsr_gguf *g, const char *key, const char *want) {
        const char *s;
        size_t len;

        assert_int_equal(tsr_gguf_get_str(kv(g, key), &s, &len), TSR_OK);
        if (len != strlen(want) || memcmp(s, want, len) != 0)
                fail_msg("%s: \"%.*s\", wanted \"%s\"", key, (int)len, s, want);
}

static void assert_elem_str(const tsr_gguf *g, const char *key, uint64_t i, const char *want) {
        tsr_gguf_value e;
        const char *s;
        size_t len;

        assert_int_equal(tsr_gguf_array_elem(kv(g, key), i, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_str(&e, &s, &len), TSR_OK);
        if (len != strlen(want) || memcmp(s, want, len) != 0)
                fail_msg("%s[%llu]: \"%.*s\", wanted \"%s\"", key, (unsigned long long)i, (int)len, s, want);
}

static const tsr_gguf_tensor *tensor(const tsr_gguf *g, const char *name, tsr_ggml_type type, uint64_t d0,
                                     uint64_t d1, uint64_t n_bytes, uint64_t offset) {
        const tsr_gguf_tensor *t = tsr_gguf_find_tensor(g, name);

        assert_non_null(t);
        assert_int_equal(t->type, type);
        assert_int_equal(t->dims[0], d0);
        assert_int_equal(t->dims[1], d1);
        assert_int_equal(t->n_bytes, n_bytes);
        assert_int_equal(t->offset, offset);
        return t;
}

static void test_stories260k(void **state) {
        char path[4096];
        tsr_gguf *g = open_real("TSR_FIXTURES", "models/stories260K.gguf", path, sizeof(path));
        const tsr_gguf_tensor *t;
        tsr_gguf_value e;
        double d;
        int64_t i;

        if (!g)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", path);
        assert_int_equal(tsr_gguf_version(g), 3);
        assert_int_equal(tsr_gguf_n_kv(g), 19);
        assert_int_equal(tsr_gguf_n_tensors(g), 48);
        assert_int_equal(tsr_gguf_alignment(g), 32);
        assert_int_equal(tsr_gguf_data_offset(g), 14176);
        assert_int_equal(tsr_gguf_file_size(g), 1185376);
        assert_key_str(g, "general.architecture", "llama");
        assert_key_str(g, "tokenizer.ggml.model", "llama");
        assert_int_equal(key_u64(g, "llama.context_length"), 2048);
        assert_int_equal(key_u64(g, "llama.embedding_length"), 64);
        assert_int_equal(key_u64(g, "llama.block_count"), 5);
        assert_int_equal(key_u64(g, "llama.feed_forward_length"), 172);
        assert_int_equal(key_u64(g, "llama.attention.head_count"), 8);
        assert_int_equal(key_u64(g, "llama.attention.head_count_kv"), 4);
        assert_int_equal(key_u64(g, "tokenizer.ggml.bos_token_id"), 1);
        assert_int_equal(key_u64(g, "tokenizer.ggml.eos_token_id"), 2);
        assert_int_equal(key_u64(g, "tokenizer.ggml.padding_token_id"), 0xFFFFFFFFu);
        assert_int_equal(tsr_gguf_get_f64(kv(g, "llama.attention.layer_norm_rms_epsilon"), &d), TSR_OK);
        assert_true(fabs(d - 1e-5) < 1e-9);
        assert_int_equal(kv(g, "tokenizer.ggml.tokens")->count, 512);
        assert_elem_str(g, "tokenizer.ggml.tokens", 0, "<unk>");
        assert_elem_str(g, "tokenizer.ggml.tokens", 100, "<0x61>");
        assert_int_equal(tsr_gguf_array_elem(kv(g, "tokenizer.ggml.scores"), 300, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_f64(&e, &d), TSR_OK);
        assert_true(d == -41.0);
        assert_int_equal(tsr_gguf_array_elem(kv(g, "tokenizer.ggml.token_type"), 0, &e), TSR_OK);
        assert_int_equal(tsr_gguf_get_i64(&e, &i), TSR_OK);
        assert_int_equal(i, 2);
        tensor(g, "blk.0.ffn_down.weight", TSR_GGML_TYPE_F32, 172, 64, 44032, 355840);
        t = tensor(g, "output_norm.weight", TSR_GGML_TYPE_F32, 64, 1, 256, 131072);
        assert_int_equal(t->n_dims, 1);
        assert_memory_equal(t->data, "\xef\x54\x1d\x40\x6e\x04\xaf\x3f", 8);   /* 2.458309, 1.3673227 */
        assert_non_null(tsr_gguf_find_tensor(g, "output.weight"));
        tsr_gguf_close(&g);
}

static void test_llama2_tiny_random(void **state) {
        char path[4096];
        tsr_gguf *g = open_real("TSR_FIXTURES", "models/llama-2-tiny-random.gguf", path, sizeof(path));
        const tsr_gguf_tensor *t;

        if (!g)
                TSR_SKIP(TSR_SKIP_NO_SHARED, "%s absent", path);
        assert_int_equal(tsr_gguf_version(g), 3);
        assert_int_equal(tsr_gguf_n_kv(g), 18);
        assert_int_equal(tsr_gguf_n_tensors(g), 12);
        assert_int_equal(tsr_gguf_data_offset(g), 724416);
        assert_key_str(g, "general.architecture", "llama");
        assert_key_str(g, "general.name", "LLaMA v2");
        assert_key_str(g, "tokenizer.ggml.model", "llama");
        assert_int_equal(key_u64(g, "llama.context_length"), 4096);
        assert_int_equal(key_u64(g, "llama.embedding_length"), 8);
        assert_int_equal(key_u64(g, "llama.block_count"), 1);
        assert_int_equal(key_u64(g, "llama.feed_forward_length"), 32);
        assert_int_equal(key_u64(g, "llama.attention.head_count"), 2);
        assert_int_equal(key_u64(g, "llama.attention.head_count_kv"), 2);
        assert_int_equal(key_u64(g, "general.file_type"), 1);
        assert_int_equal(key_u64(g, "tokenizer.ggml.bos_token_id"), 1);
        assert_int_equal(key_u64(g, "tokenizer.ggml.eos_token_id"), 2);
        assert_int_equal(key_u64(g, "tokenizer.ggml.unknown_token_id"), 0);
        assert_int_equal(kv(g, "tokenizer.ggml.tokens")->count, 32000);
        assert_elem_str(g, "tokenizer.ggml.tokens", 31999, "\xe7\xbb\x99");     /* U+7ED9 */
        tensor(g, "token_embd.weight", TSR_GGML_TYPE_F16, 8, 32000, 512000, 0);
        t = tensor(g, "blk.0.attn_k.weight", TSR_GGML_TYPE_F16, 8, 8, 128, 512128);
        assert_memory_equal(t->data, "\xc0\x25\x08\x1c\x35\x23\x1f\x12", 8);
        t = tensor(g, "output_norm.weight", TSR_GGML_TYPE_F32, 8, 1, 32, 514112);
        assert_memory_equal(t->data, "\x00\x00\x80\x3f\x00\x00\x80\x3f", 8);   /* 1.0f, 1.0f */
        tsr_gguf_close(&g);
}

/* The loader drops the pages of a tensor it has read from the process (release_file_pages
 * in loader.c: madvise MADV_DONTNEED) only where they are a file's: a GGUF opened from
 * memory keeps every byte (DONTNEED would zero borrowed anonymous pages), and from a file
 * the same tensor read twice gives the same floats (the second read faults the pages back
 * in).  The tensor spans 16 pages so the release has whole pages to drop. */
static float release_value(size_t i) { return (float)i * 0.25f - 1000.0f; }
static float *release_dst;

static bool release_bind(void *model, const tsr_tensor_name *n, uint32_t layer, tsr_load_slot *ret) {
        (void)model, (void)n, (void)layer;
        free(release_dst);
        release_dst = NULL;
        *ret = (tsr_load_slot){.dst = &release_dst, .rows = 64, .cols = 256};
        return true;
}

static void test_load_releases_only_file_pages(void **state) {
        (void)state;
        enum { N = 64 * 256, ALIGN = 4096 };
        tsr_buf b;
        tsr_buf_init(&b, 1 << 20);
        gw_bytes(&b, "GGUF", 4);
        gw_u32(&b, 3);
        gw_u64(&b, 1);                          /* tensors */
        gw_u64(&b, 1);                          /* key-value pairs */
        gw_key(&b, "general.alignment", TSR_GGUF_TYPE_UINT32);
        gw_u32(&b, ALIGN);
        gw_str(&b, "w.weight");
        gw_u32(&b, 2);
        gw_u64(&b, 256);                        /* ggml order: columns first */
        gw_u64(&b, 64);
        gw_u32(&b, 0);                          /* F32 */
        gw_u64(&b, 0);
        while (b.len % ALIGN)
                gw_u8(&b, 0);
        for (size_t i = 0; i < N; i++) {
                float f = release_value(i);
                gw_bytes(&b, &f, sizeof f);
        }
        /* borrowed bytes, page-aligned so the tensor's 16 pages are whole */
        uint8_t *mem = aligned_alloc(ALIGN, (b.len + ALIGN - 1) / ALIGN * ALIGN);
        assert_non_null(mem);
        memcpy(mem, b.data, b.len);
        tsr_tensor_name table[] = {{.logical = "w", .gguf = "w.weight"}};
        tsr_shard_spec spec = tsr_shard_spec_whole(1);
        char err[256], path[] = "/tmp/tsr_gguf_release_XXXXXX";
        tsr_gguf *g = NULL;
        assert_int_equal(tsr_gguf_open_memory(mem, b.len, &g, err, sizeof err), TSR_OK);
        assert_false(tsr_gguf_file_mapped(g));
        tsr_tensor_source src = {.g = g, .src = "<memory>"};
        assert_int_equal(tsr_load_tensors(&src, table, 1, &spec, release_bind, NULL, NULL, NULL, NULL, err,
                                          sizeof err), TSR_OK);
        assert_memory_equal(mem, b.data, b.len);        /* every borrowed byte as it was */
        tsr_gguf_close(&g);

        int fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, b.data, b.len), (ssize_t)b.len);
        close(fd);
        assert_int_equal(tsr_gguf_open(path, &g, err, sizeof err), TSR_OK);
        assert_true(tsr_gguf_file_mapped(g));
        src = (tsr_tensor_source){.g = g, .src = path};
        for (int pass = 0; pass < 2; pass++) {          /* the second read after the pages were dropped */
                assert_int_equal(tsr_load_tensors(&src, table, 1, &spec, release_bind, NULL, NULL, NULL, NULL, err,
                                                  sizeof err), TSR_OK);
                for (size_t i = 0; i < N; i++)
                        if (release_dst[i] != release_value(i))
                                fail_msg("pass %d element %zu: %g", pass, i, (double)release_dst[i]);
        }
        tsr_gguf_close(&g);
        unlink(path);
        free(release_dst);
        release_dst = NULL;
        free(mem);
        tsr_buf_done(&b);
}
/* tsr_load_tensors' tensor-parallel slices (issue #20) on SmolLM2's block formats:
 * rows of the Q8_0 embedding and of a Q4_1 attn_k, columns of a Q4_1 ffn_down, each
 * bitwise the same rows / columns of the whole tensor widened in one call; the stats
 * count the slices; a slice outside the matrix is refused naming the tensor. */
static struct { uint64_t rows, cols; tsr_load_slice slice; float *dst; } slice_case;

static bool slice_bind(void *model, const tsr_tensor_name *n, uint32_t layer, tsr_load_slot *ret) {
        (void)model, (void)n, (void)layer;
        *ret = (tsr_load_slot){.dst = &slice_case.dst, .rows = slice_case.rows, .cols = slice_case.cols,
                               .slice = slice_case.slice};
        return true;
}

static void test_load_slices(void **state) {
        (void)state;
        char path[4096], err[512];
        tsr_gguf *g = open_real("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", path, sizeof(path));
        if (!g)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-model.sh fetches it)", path);
        static const struct {
                const char *name;
                uint64_t rows, cols;
                tsr_load_slice slice;
        } cases[] = {
                {"token_embd.weight", 49152, 576, {TSR_LOAD_SLICE_ROWS, 1, {{24576, 24576}}}},     /* Q8_0 */
                {"blk.0.attn_k.weight", 192, 576, {TSR_LOAD_SLICE_ROWS, 1, {{64, 64}}}},           /* Q4_1 */
                /* a fused projection's parts, out of order */
                {"blk.0.attn_k.weight", 192, 576, {TSR_LOAD_SLICE_ROWS, 3, {{128, 32}, {0, 16}, {191, 1}}}},
                {"blk.0.attn_k.weight", 192, 576, {TSR_LOAD_SLICE_COLS, 1, {{37, 100}}}},          /* mid-block */
                {"blk.0.attn_k.weight", 192, 576, {TSR_LOAD_SLICE_COLS, 2, {{500, 40}, {0, 32}}}}, /* two ranges */
                {"blk.0.ffn_down.weight", 576, 1536, {TSR_LOAD_SLICE_COLS, 1, {{768, 768}}}},     /* Q4_1 */
        };
        tsr_tensor_source src = {.g = g, .src = path};
        tsr_shard_spec spec = tsr_shard_spec_whole(30);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                tsr_tensor_name table[] = {{.logical = "x", .gguf = cases[c].name}};
                const tsr_gguf_tensor *t = tsr_gguf_find_tensor(g, cases[c].name);
                tsr_load_stats stats = {0};
                assert_non_null(t);
                float *whole = malloc(cases[c].rows * cases[c].cols * sizeof(float));
                assert_non_null(whole);
                assert_int_equal(tsr_ggml_dequantize(t->type, t->data, cases[c].rows * cases[c].cols, whole), TSR_OK);
                slice_case.rows = cases[c].rows;
                slice_case.cols = cases[c].cols;
                slice_case.slice = cases[c].slice;
                slice_case.dst = NULL;
                assert_int_equal(tsr_load_tensors(&src, table, 1, &spec, slice_bind, NULL, NULL, NULL, &stats, err,
                                                  sizeof err), TSR_OK);
                assert_non_null(slice_case.dst);
                const tsr_load_slice *sl = &cases[c].slice;
                bool rows = sl->axis == TSR_LOAD_SLICE_ROWS;
                uint64_t out_rows = 0, out_cols = rows ? cases[c].cols : sl->range[0][1];
                if (rows) {
                        for (uint32_t i = 0; i < sl->n_ranges; i++)     /* the ranges in order */
                                for (uint64_t k = 0; k < sl->range[i][1]; k++, out_rows++)
                                        assert_memory_equal(slice_case.dst + out_rows * out_cols,
                                                            whole + (sl->range[i][0] + k) * cases[c].cols,
                                                            out_cols * sizeof(float));
                } else {
                        for (uint32_t i = 1; i < sl->n_ranges; i++)
                                out_cols += sl->range[i][1];
                        for (out_rows = 0; out_rows < cases[c].rows; out_rows++)
                                for (uint32_t i = 0, at = 0; i < sl->n_ranges; at += (uint32_t)sl->range[i][1], i++)
                                        assert_memory_equal(slice_case.dst + out_rows * out_cols + at,
                                                            whole + out_rows * cases[c].cols + sl->range[i][0],
                                                            sl->range[i][1] * sizeof(float));
                }
                assert_int_equal(stats.f32_bytes, out_rows * out_cols * sizeof(float));
                assert_int_equal(stats.resident_bytes, out_rows * out_cols * sizeof(float));
                /* the bytes read: a row slice's rows, every row for a column slice */
                assert_int_equal(stats.file_bytes, rows ? t->n_bytes / cases[c].rows * out_rows : t->n_bytes);
                free(slice_case.dst);
                free(whole);
        }
        /* a slice past the matrix: refused, the tensor named */
        tsr_tensor_name table[] = {{.logical = "x", .gguf = "blk.0.attn_k.weight"}};
        slice_case.rows = 192;
        slice_case.cols = 576;
        slice_case.slice = (tsr_load_slice){TSR_LOAD_SLICE_COLS, 1, {{500, 100}}};
        slice_case.dst = NULL;
        assert_int_equal(tsr_load_tensors(&src, table, 1, &spec, slice_bind, NULL, NULL, NULL, NULL, err, sizeof err),
                         TSR_E_INVAL);
        assert_non_null(strstr(err, "tensor 'blk.0.attn_k.weight': columns [500, 600) of a (192, 576) matrix: out of "
                                    "range"));
        assert_null(slice_case.dst);
        slice_case.slice = (tsr_load_slice){TSR_LOAD_SLICE_ROWS, 2, {{0, 16}, {180, 13}}};     /* the second range */
        assert_int_equal(tsr_load_tensors(&src, table, 1, &spec, slice_bind, NULL, NULL, NULL, NULL, err, sizeof err),
                         TSR_E_INVAL);
        assert_non_null(strstr(err, "rows [180, 193) of a (192, 576) matrix: out of range"));
        assert_null(slice_case.dst);
        tsr_gguf_close(&g);
}

static void test_smollm2(void **state) {
        char path[4096];
        tsr_gguf *g = open_real("TSR_SOURCE_ROOT", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf", path, sizeof(path));
        const tsr_gguf_tensor *t;
        const char *s;
        size_t len;
        double d;
        bool b = true;

        if (!g)
                TSR_SKIP(TSR_SKIP_NOT_FETCHED, "%s absent (scripts/fetch-model.sh fetches it)", path);
        assert_int_equal(tsr_gguf_version(g), 3);
        assert_int_equal(tsr_gguf_n_kv(g), 33);
        assert_int_equal(tsr_gguf_n_tensors(g), 272);
        assert_int_equal(tsr_gguf_data_offset(g), 1785664);
        assert_int_equal(tsr_gguf_file_size(g), 98362432);
        assert_key_str(g, "general.architecture", "llama");
        assert_key_str(g, "general.size_label", "135M");
        assert_key_str(g, "tokenizer.ggml.model", "gpt2");
        assert_key_str(g, "tokenizer.ggml.pre", "smollm");
        assert_int_equal(key_u64(g, "llama.context_length"), 8192);
        assert_int_equal(key_u64(g, "llama.embedding_length"), 576);
        assert_int_equal(key_u64(g, "llama.block_count"), 30);
        assert_int_equal(key_u64(g, "llama.feed_forward_length"), 1536);
        assert_int_equal(key_u64(g, "llama.attention.head_count"), 9);
        assert_int_equal(key_u64(g, "llama.attention.head_count_kv"), 3);
        assert_int_equal(key_u64(g, "llama.vocab_size"), 49152);
        assert_int_equal(tsr_gguf_get_f64(kv(g, "llama.rope.freq_base"), &d), TSR_OK);
        assert_true(d == 100000.0);
        assert_int_equal(tsr_gguf_get_bool(kv(g, "tokenizer.ggml.add_bos_token"), &b), TSR_OK);
        assert_false(b);
        assert_int_equal(key_u64(g, "tokenizer.ggml.bos_token_id"), 1);
        assert_int_equal(key_u64(g, "tokenizer.ggml.eos_token_id"), 2);
        assert_int_equal(key_u64(g, "tokenizer.ggml.padding_token_id"), 2);
        assert_int_equal(kv(g, "general.languages")->count, 1);
        assert_elem_str(g, "general.languages", 0, "en");
        assert_int_equal(kv(g, "tokenizer.ggml.tokens")->count, 49152);
        assert_elem_str(g, "tokenizer.ggml.tokens", 0, "<|endoftext|>");
        assert_elem_str(g, "tokenizer.ggml.tokens", 2, "<|im_end|>");
        assert_elem_str(g, "tokenizer.ggml.tokens", 49151, "ectable");
        assert_int_equal(kv(g, "tokenizer.ggml.merges")->count, 48900);
        assert_elem_str(g, "tokenizer.ggml.merges", 0, "\xc4\xa0 t");          /* "Ġ t" */
        assert_elem_str(g, "tokenizer.ggml.merges", 48899, "ect able");
        assert_int_equal(tsr_gguf_get_str(kv(g, "tokenizer.chat_template"), &s, &len), TSR_OK);
        assert_int_equal(len, 368);
        assert_memory_equal(s, "{% for message in messages %}", 29);
        t = tensor(g, "token_embd.weight", TSR_GGML_TYPE_Q8_0, 576, 49152, 30081024, 0);
        assert_memory_equal(t->data, "\x32\x19\xd6\x0d\x13\xf7\xe5\xee", 8);
        tensor(g, "blk.0.ffn_down.weight", TSR_GGML_TYPE_Q4_1, 1536, 576, 552960, 30083328);
        tensor(g, "blk.0.attn_k.weight", TSR_GGML_TYPE_Q4_1, 576, 192, 69120, 31744512);
        t = tensor(g, "output_norm.weight", TSR_GGML_TYPE_F32, 576, 1, 2304, 96574464);
        assert_memory_equal(t->data, "\x00\x00\xe1\x3f\x00\x00\xe9\x3f", 8);   /* 1.7578125, 1.8203125 */
        assert_null(tsr_gguf_find_tensor(g, "output.weight"));                  /* tied embeddings */
        tsr_gguf_close(&g);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_sample_fields),
                cmocka_unit_test(test_type_tables),
                cmocka_unit_test(test_truncated_everywhere),
                cmocka_unit_test(test_corrupt_fields),
                cmocka_unit_test(test_nesting_limit),
                cmocka_unit_test(test_open_errors),
                cmocka_unit_test(test_stories260k),
                cmocka_unit_test(test_llama2_tiny_random),
                cmocka_unit_test(test_smollm2),
                cmocka_unit_test(test_load_slices),
                cmocka_unit_test(test_load_releases_only_file_pages),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
