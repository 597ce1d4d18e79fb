/* fuzz_gguf.c - bytes -> tsr_gguf_open_memory, then every accessor over what it accepted.
 *
 * gguf.h promises that a file which opens is fully validated: no accessor can then read
 * out of bounds, only fail on a type mismatch.  So after a successful open this walks
 * every key/value (each getter on each value, every array element, arrays of arrays
 * recursively) and every tensor (its shape arithmetic, its data range, the first and
 * last byte of its data).  libFuzzer hands the input in a heap block of exactly `size`
 * bytes, so ASan reports any read past the file's end.
 *
 * The input is the file itself, with no selector byte: the seeds are real GGUF files
 * (tests/fuzz/make_corpus.py) and their magic must stay at offset 0. */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "worker/load/gguf.h"
#include "fuzz.h"

static bool type_is_int(tsr_gguf_type t) {
        switch (t) {
        case TSR_GGUF_TYPE_UINT8:
        case TSR_GGUF_TYPE_INT8:
        case TSR_GGUF_TYPE_UINT16:
        case TSR_GGUF_TYPE_INT16:
        case TSR_GGUF_TYPE_UINT32:
        case TSR_GGUF_TYPE_INT32:
        case TSR_GGUF_TYPE_UINT64:
        case TSR_GGUF_TYPE_INT64:
                return true;
        default:
                return false;
        }
}

static bool type_is_signed(tsr_gguf_type t) {
        return t == TSR_GGUF_TYPE_INT8 || t == TSR_GGUF_TYPE_INT16 || t == TSR_GGUF_TYPE_INT32 ||
               t == TSR_GGUF_TYPE_INT64;
}

/* The largest magnitude each integer width can hold, to check the getters widen right. */
static uint64_t int_max(tsr_gguf_type t) {
        switch (t) {
        case TSR_GGUF_TYPE_UINT8: return UINT8_MAX;
        case TSR_GGUF_TYPE_INT8: return INT8_MAX;
        case TSR_GGUF_TYPE_UINT16: return UINT16_MAX;
        case TSR_GGUF_TYPE_INT16: return INT16_MAX;
        case TSR_GGUF_TYPE_UINT32: return UINT32_MAX;
        case TSR_GGUF_TYPE_INT32: return INT32_MAX;
        case TSR_GGUF_TYPE_INT64: return INT64_MAX;
        default: return UINT64_MAX;
        }
}

static void walk_value(const tsr_gguf_value *v, unsigned depth) {
        uint64_t u = 0;
        int64_t i = 0;
        double d = 0;
        bool b = false;
        const char *s = NULL;
        size_t len = 0;
        tsr_status su, si, sd, sb, ss;

        /* open counts the outermost array as depth 1 */
        FUZZ_CHECK(depth <= TSR_GGUF_MAX_ARRAY_DEPTH);
        FUZZ_CHECK(strcmp(tsr_gguf_type_name(v->type), "?") != 0);
        su = tsr_gguf_get_u64(v, &u);
        si = tsr_gguf_get_i64(v, &i);
        sd = tsr_gguf_get_f64(v, &d);
        sb = tsr_gguf_get_bool(v, &b);
        ss = tsr_gguf_get_str(v, &s, &len);
        FUZZ_CHECK(su == TSR_OK || su == TSR_E_INVAL);
        FUZZ_CHECK(si == TSR_OK || si == TSR_E_INVAL);
        FUZZ_CHECK(sd == TSR_OK || sd == TSR_E_INVAL);
        FUZZ_CHECK((sb == TSR_OK) == (v->type == TSR_GGUF_TYPE_BOOL));
        FUZZ_CHECK((ss == TSR_OK) == (v->type == TSR_GGUF_TYPE_STRING));

        if (type_is_int(v->type)) {
                /* Every integer fits one of the two getters and converts to double. */
                FUZZ_CHECK(su == TSR_OK || si == TSR_OK);
                FUZZ_CHECK(sd == TSR_OK);
                if (su == TSR_OK)
                        FUZZ_CHECK(u <= int_max(v->type));
                if (su == TSR_OK && si == TSR_OK)
                        FUZZ_CHECK((uint64_t)i == u);
                if (!type_is_signed(v->type))
                        FUZZ_CHECK(su == TSR_OK);
                if (si == TSR_OK && i < 0)
                        FUZZ_CHECK(su == TSR_E_INVAL && type_is_signed(v->type));
        } else {
                FUZZ_CHECK(su == TSR_E_INVAL && si == TSR_E_INVAL);
                FUZZ_CHECK((sd == TSR_OK) ==
                           (v->type == TSR_GGUF_TYPE_FLOAT32 || v->type == TSR_GGUF_TYPE_FLOAT64));
        }
        if (ss == TSR_OK)
                fuzz_touch(s, len);

        if (v->type == TSR_GGUF_TYPE_ARRAY) {
                tsr_gguf_value e;

                FUZZ_CHECK(v->elem_type != TSR_GGUF_TYPE_ARRAY || depth < TSR_GGUF_MAX_ARRAY_DEPTH);
                for (uint64_t k = 0; k < v->count; k++) {
                        FUZZ_CHECK(tsr_gguf_array_elem(v, k, &e) == TSR_OK);
                        FUZZ_CHECK(e.type == v->elem_type);
                        walk_value(&e, e.type == TSR_GGUF_TYPE_ARRAY ? depth + 1 : depth);
                }
                FUZZ_CHECK(tsr_gguf_array_elem(v, v->count, &e) == TSR_E_NOTFOUND);
        } else {
                tsr_gguf_value e;

                FUZZ_CHECK(tsr_gguf_array_elem(v, 0, &e) == TSR_E_INVAL);
        }
}

static void walk_tensor(const tsr_gguf *g, const tsr_gguf_tensor *t, const uint8_t *file, size_t size) {
        uint32_t blck_elems = 0, blck_bytes = 0;
        uint64_t n = 1, data_off = tsr_gguf_data_offset(g);

        FUZZ_CHECK(t->name != NULL);
        FUZZ_CHECK(tsr_gguf_find_tensor(g, t->name) == t);
        FUZZ_CHECK(tsr_ggml_type_name(t->type) != NULL);
        FUZZ_CHECK(tsr_ggml_type_size(t->type, &blck_elems, &blck_bytes) == TSR_OK);
        FUZZ_CHECK(blck_elems > 0 && blck_bytes > 0);
        FUZZ_CHECK(t->n_dims <= TSR_GGUF_MAX_DIMS);
        for (uint32_t k = 0; k < TSR_GGUF_MAX_DIMS; k++) {
                if (k >= t->n_dims)
                        FUZZ_CHECK(t->dims[k] == 1);
                FUZZ_CHECK(t->dims[k] == 0 || n <= UINT64_MAX / t->dims[k]);
                n *= t->dims[k];
        }
        FUZZ_CHECK(n == t->n_elements);
        FUZZ_CHECK(t->n_elements < (UINT64_C(1) << 63));
        FUZZ_CHECK(t->n_elements % blck_elems == 0);
        FUZZ_CHECK(t->n_bytes == t->n_elements / blck_elems * blck_bytes);
        FUZZ_CHECK(t->offset % tsr_gguf_alignment(g) == 0);
        if (t->n_bytes == 0) {
                FUZZ_CHECK(t->data == NULL);
                return;
        }
        FUZZ_CHECK(data_off <= size && t->offset <= size - data_off && t->n_bytes <= size - data_off - t->offset);
        FUZZ_CHECK((const uint8_t *)t->data == file + data_off + t->offset);
        fuzz_touch(t->data, 1);
        fuzz_touch((const uint8_t *)t->data + t->n_bytes - 1, 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        tsr_gguf *g = NULL;
        char err[256];
        tsr_status st;
        uint64_t align;

        err[0] = '\0';
        st = tsr_gguf_open_memory(data, size, &g, err, sizeof(err));
        if (st != TSR_OK) {
                FUZZ_CHECK(st == TSR_E_INVAL || st == TSR_E_UNSUPPORTED || st == TSR_E_NOMEM);
                FUZZ_CHECK(g == NULL);
                FUZZ_CHECK(err[0] != '\0');
                return 0;
        }
        FUZZ_CHECK(g != NULL);
        FUZZ_CHECK(tsr_gguf_version(g) == 2 || tsr_gguf_version(g) == 3);
        FUZZ_CHECK(tsr_gguf_file_size(g) == size);
        /* The data section may start past the end of a file without tensor data. */
        align = tsr_gguf_alignment(g);
        FUZZ_CHECK(align > 0 && (align & (align - 1)) == 0);
        FUZZ_CHECK(tsr_gguf_data_offset(g) % align == 0);

        for (size_t k = 0; k < tsr_gguf_n_kv(g); k++) {
                const tsr_gguf_kv *kv = tsr_gguf_kv_at(g, k);

                FUZZ_CHECK(kv != NULL && kv->key != NULL);
                FUZZ_CHECK(tsr_gguf_find_kv(g, kv->key) == kv);
                walk_value(&kv->value, kv->value.type == TSR_GGUF_TYPE_ARRAY ? 1 : 0);
        }
        FUZZ_CHECK(tsr_gguf_kv_at(g, tsr_gguf_n_kv(g)) == NULL);
        for (size_t k = 0; k < tsr_gguf_n_tensors(g); k++) {
                const tsr_gguf_tensor *t = tsr_gguf_tensor_at(g, k);

                FUZZ_CHECK(t != NULL);
                walk_tensor(g, t, data, size);
        }
        FUZZ_CHECK(tsr_gguf_tensor_at(g, tsr_gguf_n_tensors(g)) == NULL);

        tsr_gguf_close(&g);
        FUZZ_CHECK(g == NULL);
        return 0;
}
