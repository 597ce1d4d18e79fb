/* gguf.c - GGUF v2/v3 reader: mmap, validate everything, then hand out views.
 *
 * The parser walks the bytes once with a cursor that checks every read against the
 * bytes left, so a count or a length taken from the file is compared with what is left
 * before anything is allocated or skipped on its behalf.  Parsed tables (keys, names,
 * string-array offsets, nested arrays) live in one arena freed by tsr_gguf_close. */
#include "worker/load/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/arena.h"
#include "common/tsr_status.h"

#define GGUF_MAGIC "GGUF"
/* Smallest encodings, used to reject counts that the bytes left could never hold:
 * a KV is a key length (8) + at least one key byte + a type tag (4) + a 1-byte value;
 * a tensor info is a name length (8) + one name byte + n_dims (4) + type (4) + offset (8). */
#define GGUF_MIN_KV_BYTES 14
#define GGUF_MIN_TENSOR_BYTES 25
#define GGUF_MIN_STRING_BYTES 8
#define GGUF_MIN_ARRAY_BYTES 12
/* The spec caps keys at 65535 bytes; anything longer is a corrupt length. */
#define GGUF_MAX_KEY_LEN 65535

struct tsr_gguf {
        const uint8_t *base;
        size_t size;
        void *map;                      /* NULL when the bytes are borrowed (open_memory) */
        uint32_t version;
        uint64_t alignment;
        uint64_t data_offset;
        tsr_gguf_kv *kvs;
        size_t n_kv;
        const tsr_gguf_kv **kv_sorted;  /* by key, for binary search */
        tsr_gguf_tensor *tensors;
        size_t n_tensors;
        const tsr_gguf_tensor **tensor_sorted;
        tsr_arena *arena;               /* everything above that was allocated */
};

/* A bounds-checked cursor over the file plus the error sink. */
typedef struct gguf_rd {
        const uint8_t *p;
        size_t len;
        size_t pos;
        const char *name;
        char *err;
        size_t errlen;
        tsr_arena *arena;
} gguf_rd;

struct ggml_type_info {
        const char *name;
        uint32_t blck_elems;
        uint32_t blck_bytes;
};

/* Block geometry of every ggml type this reader knows, indexed by the on-disk tag.
 * Sizes follow ggml's block structs (e.g. Q4_0: one fp16 scale + 32 4-bit values = 18). */
static const struct ggml_type_info ggml_types[] = {
        [TSR_GGML_TYPE_F32] = {"F32", 1, 4},
        [TSR_GGML_TYPE_F16] = {"F16", 1, 2},
        [TSR_GGML_TYPE_Q4_0] = {"Q4_0", 32, 18},
        [TSR_GGML_TYPE_Q4_1] = {"Q4_1", 32, 20},
        [TSR_GGML_TYPE_Q5_0] = {"Q5_0", 32, 22},
        [TSR_GGML_TYPE_Q5_1] = {"Q5_1", 32, 24},
        [TSR_GGML_TYPE_Q8_0] = {"Q8_0", 32, 34},
        [TSR_GGML_TYPE_Q8_1] = {"Q8_1", 32, 40},
        [TSR_GGML_TYPE_Q2_K] = {"Q2_K", 256, 84},
        [TSR_GGML_TYPE_Q3_K] = {"Q3_K", 256, 110},
        [TSR_GGML_TYPE_Q4_K] = {"Q4_K", 256, 144},
        [TSR_GGML_TYPE_Q5_K] = {"Q5_K", 256, 176},
        [TSR_GGML_TYPE_Q6_K] = {"Q6_K", 256, 210},
        [TSR_GGML_TYPE_Q8_K] = {"Q8_K", 256, 292},
        [TSR_GGML_TYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66},
        [TSR_GGML_TYPE_IQ2_XS] = {"IQ2_XS", 256, 74},
        [TSR_GGML_TYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98},
        [TSR_GGML_TYPE_IQ1_S] = {"IQ1_S", 256, 50},
        [TSR_GGML_TYPE_IQ4_NL] = {"IQ4_NL", 32, 18},
        [TSR_GGML_TYPE_IQ3_S] = {"IQ3_S", 256, 110},
        [TSR_GGML_TYPE_IQ2_S] = {"IQ2_S", 256, 82},
        [TSR_GGML_TYPE_IQ4_XS] = {"IQ4_XS", 256, 136},
        [TSR_GGML_TYPE_I8] = {"I8", 1, 1},
        [TSR_GGML_TYPE_I16] = {"I16", 1, 2},
        [TSR_GGML_TYPE_I32] = {"I32", 1, 4},
        [TSR_GGML_TYPE_I64] = {"I64", 1, 8},
        [TSR_GGML_TYPE_F64] = {"F64", 1, 8},
        [TSR_GGML_TYPE_IQ1_M] = {"IQ1_M", 256, 56},
        [TSR_GGML_TYPE_BF16] = {"BF16", 1, 2},
        [TSR_GGML_TYPE_TQ1_0] = {"TQ1_0", 256, 54},
        [TSR_GGML_TYPE_TQ2_0] = {"TQ2_0", 256, 66},
        [TSR_GGML_TYPE_MXFP4] = {"MXFP4", 32, 17},
        [TSR_GGML_TYPE_NVFP4] = {"NVFP4", 64, 36},
        [TSR_GGML_TYPE_Q1_0] = {"Q1_0", 128, 18},
};
#define N_GGML_TYPES (sizeof(ggml_types) / sizeof(ggml_types[0]))

static const char *const gguf_type_names[] = {
        "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
        "bool", "string", "array", "uint64", "int64", "float64",
};
#define N_GGUF_TYPES (sizeof(gguf_type_names) / sizeof(gguf_type_names[0]))

/* Fixed encoded size of a scalar type; 0 for string and array (variable). */
static const uint8_t gguf_type_sizes[N_GGUF_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *tsr_gguf_type_name(tsr_gguf_type t) {
        return (unsigned)t < N_GGUF_TYPES ? gguf_type_names[t] : "?";
}

const char *tsr_ggml_type_name(uint32_t t) {
        return t < N_GGML_TYPES ? ggml_types[t].name : NULL;
}

tsr_status tsr_ggml_type_size(uint32_t t, uint32_t *blck_elems, uint32_t *blck_bytes) {
        if (t >= N_GGML_TYPES || !ggml_types[t].name)
                return TSR_E_INVAL;
        *blck_elems = ggml_types[t].blck_elems;
        *blck_bytes = ggml_types[t].blck_bytes;
        return TSR_OK;
}

/* Little-endian loads, byte by byte, so the reader is right on any host and never
 * makes an unaligned access. */
static uint16_t ld_u16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }
static uint32_t ld_u32(const uint8_t *p) {
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t ld_u64(const uint8_t *p) { return (uint64_t)ld_u32(p) | (uint64_t)ld_u32(p + 4) << 32; }

static tsr_status rd_fail(gguf_rd *r, tsr_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static tsr_status rd_fail(gguf_rd *r, tsr_status st, const char *fmt, ...) {
        va_list ap;
        int n;

        if (!r->err || r->errlen == 0)
                return st;
        n = snprintf(r->err, r->errlen, "%s: ", r->name);
        if (n < 0 || (size_t)n >= r->errlen)
                return st;
        va_start(ap, fmt);
        vsnprintf(r->err + n, r->errlen - (size_t)n, fmt, ap);
        va_end(ap);
        return st;
}

static size_t rd_left(const gguf_rd *r) { return r->len - r->pos; }

static tsr_status rd_need(gguf_rd *r, uint64_t n, const char *what) {
        if (n > rd_left(r))
                return rd_fail(r, TSR_E_INVAL, "truncated: %s needs %llu bytes at offset %zu but only %zu are left",
                               what, (unsigned long long)n, r->pos, rd_left(r));
        return TSR_OK;
}

static tsr_status rd_u32(gguf_rd *r, uint32_t *ret, const char *what) {
        tsr_status st = rd_need(r, 4, what);
        if (st != TSR_OK)
                return st;
        *ret = ld_u32(r->p + r->pos);
        r->pos += 4;
        return TSR_OK;
}

static tsr_status rd_u64(gguf_rd *r, uint64_t *ret, const char *what) {
        tsr_status st = rd_need(r, 8, what);
        if (st != TSR_OK)
                return st;
        *ret = ld_u64(r->p + r->pos);
        r->pos += 8;
        return TSR_OK;
}

/* A gguf_string_t: u64 length then that many bytes (no NUL). */
static tsr_status rd_str(gguf_rd *r, const uint8_t **s, uint64_t *len, const char *what) {
        char ctx[192];
        uint64_t n;
        tsr_status st;

        snprintf(ctx, sizeof(ctx), "%s length", what);
        st = rd_u64(r, &n, ctx);
        if (st != TSR_OK)
                return st;
        if (n > rd_left(r))
                return rd_fail(r, TSR_E_INVAL, "%s: string length %llu runs past the end of the file (%zu bytes left)",
                               what, (unsigned long long)n, rd_left(r));
        *s = r->p + r->pos;
        *len = n;
        r->pos += n;
        return TSR_OK;
}

static tsr_status parse_value(gguf_rd *r, uint32_t type, tsr_gguf_value *v, unsigned depth, const char *what);

static tsr_status parse_array(gguf_rd *r, tsr_gguf_value *v, unsigned depth, const char *what) {
        char ctx[224];
        uint32_t elem_type;
        uint64_t count, i, min_bytes;
        size_t start;
        tsr_status st;

        snprintf(ctx, sizeof(ctx), "%s array type", what);
        st = rd_u32(r, &elem_type, ctx);
        if (st != TSR_OK)
                return st;
        if (elem_type >= N_GGUF_TYPES)
                return rd_fail(r, TSR_E_INVAL, "%s: unknown array element type %u", what, elem_type);
        if (elem_type == TSR_GGUF_TYPE_ARRAY && depth + 1 >= TSR_GGUF_MAX_ARRAY_DEPTH)
                return rd_fail(r, TSR_E_INVAL, "%s: arrays nested more than %d deep", what, TSR_GGUF_MAX_ARRAY_DEPTH);
        snprintf(ctx, sizeof(ctx), "%s array count", what);
        st = rd_u64(r, &count, ctx);
        if (st != TSR_OK)
                return st;
        min_bytes = gguf_type_sizes[elem_type];
        if (elem_type == TSR_GGUF_TYPE_STRING)
                min_bytes = GGUF_MIN_STRING_BYTES;
        else if (elem_type == TSR_GGUF_TYPE_ARRAY)
                min_bytes = GGUF_MIN_ARRAY_BYTES;
        if (count > rd_left(r) / min_bytes)
                return rd_fail(r, TSR_E_INVAL, "%s: array count %llu of %s is more than the %zu bytes left can hold",
                               what, (unsigned long long)count, gguf_type_names[elem_type], rd_left(r));

        v->type = TSR_GGUF_TYPE_ARRAY;
        v->elem_type = (tsr_gguf_type)elem_type;
        v->count = count;
        v->_data = r->p + r->pos;
        v->_len = 0;
        v->_str_off = NULL;
        v->_elems = NULL;
        start = r->pos;

        if (elem_type == TSR_GGUF_TYPE_STRING) {
                /* count <= bytes left / 8, so this table is never bigger than the file. */
                uint64_t *off = count ? tsr_arena_alloc(r->arena, count * sizeof(*off)) : NULL;
                if (count && !off)
                        return rd_fail(r, TSR_E_NOMEM, "%s: out of memory", what);
                for (i = 0; i < count; i++) {
                        const uint8_t *s;
                        uint64_t len;

                        off[i] = r->pos - start;
                        snprintf(ctx, sizeof(ctx), "%s element %llu", what, (unsigned long long)i);
                        st = rd_str(r, &s, &len, ctx);
                        if (st != TSR_OK)
                                return st;
                }
                v->_str_off = off;
        } else if (elem_type == TSR_GGUF_TYPE_ARRAY) {
                tsr_gguf_value *elems = count ? tsr_arena_calloc(r->arena, count, sizeof(*elems)) : NULL;
                if (count && !elems)
                        return rd_fail(r, TSR_E_NOMEM, "%s: out of memory", what);
                for (i = 0; i < count; i++) {
                        snprintf(ctx, sizeof(ctx), "%s element %llu", what, (unsigned long long)i);
                        st = parse_value(r, TSR_GGUF_TYPE_ARRAY, &elems[i], depth + 1, ctx);
                        if (st != TSR_OK)
                                return st;
                }
                v->_elems = elems;
        } else {
                r->pos += count * min_bytes;    /* checked against the bytes left above */
        }
        return TSR_OK;
}

static tsr_status parse_value(gguf_rd *r, uint32_t type, tsr_gguf_value *v, unsigned depth, const char *what) {
        const uint8_t *s;
        uint64_t len;
        tsr_status st;

        if (type >= N_GGUF_TYPES)
                return rd_fail(r, TSR_E_INVAL, "%s: unknown value type %u", what, type);
        if (type == TSR_GGUF_TYPE_ARRAY)
                return parse_array(r, v, depth, what);
        if (type == TSR_GGUF_TYPE_STRING) {
                st = rd_str(r, &s, &len, what);
                if (st != TSR_OK)
                        return st;
        } else {
                len = gguf_type_sizes[type];
                st = rd_need(r, len, what);
                if (st != TSR_OK)
                        return st;
                s = r->p + r->pos;
                r->pos += len;
        }
        memset(v, 0, sizeof(*v));
        v->type = (tsr_gguf_type)type;
        v->count = 1;
        v->_data = s;
        v->_len = type == TSR_GGUF_TYPE_STRING ? len : 0;
        return TSR_OK;
}

/* Copy a key or tensor name out of the map as a C string; they may not hold NUL. */
static tsr_status dup_name(gguf_rd *r, const uint8_t *s, uint64_t len, char **ret, const char *what) {
        char *p;

        if (len == 0)
                return rd_fail(r, TSR_E_INVAL, "%s: empty name", what);
        if (memchr(s, '\0', len))
                return rd_fail(r, TSR_E_INVAL, "%s: name contains a NUL byte", what);
        p = tsr_arena_strndup(r->arena, (const char *)s, len);
        if (!p)
                return rd_fail(r, TSR_E_NOMEM, "%s: out of memory", what);
        *ret = p;
        return TSR_OK;
}

static int cmp_kv(const void *a, const void *b) {
        return strcmp((*(const tsr_gguf_kv *const *)a)->key, (*(const tsr_gguf_kv *const *)b)->key);
}

static int cmp_tensor(const void *a, const void *b) {
        return strcmp((*(const tsr_gguf_tensor *const *)a)->name, (*(const tsr_gguf_tensor *const *)b)->name);
}

static tsr_status parse_header(gguf_rd *r, tsr_gguf *g, uint64_t *n_kv, uint64_t *n_tensors) {
        uint32_t version;
        tsr_status st;

        st = rd_need(r, 4, "magic");
        if (st != TSR_OK)
                return st;
        if (memcmp(r->p, GGUF_MAGIC, 4) != 0)
                return rd_fail(r, TSR_E_INVAL, "not a GGUF file: magic is %02x %02x %02x %02x, expected \"GGUF\"",
                               r->p[0], r->p[1], r->p[2], r->p[3]);
        r->pos = 4;
        st = rd_u32(r, &version, "version");
        if (st != TSR_OK)
                return st;
        if (version == 0x02000000u || version == 0x03000000u)
                return rd_fail(r, TSR_E_UNSUPPORTED, "version: big-endian GGUF files are not supported");
        if (version != 2 && version != 3)
                return rd_fail(r, TSR_E_UNSUPPORTED, "version: GGUF version %u is not supported (only 2 and 3)",
                               version);
        st = rd_u64(r, n_tensors, "tensor_count");
        if (st != TSR_OK)
                return st;
        st = rd_u64(r, n_kv, "metadata_kv_count");
        if (st != TSR_OK)
                return st;
        if (*n_kv > rd_left(r) / GGUF_MIN_KV_BYTES)
                return rd_fail(r, TSR_E_INVAL,
                               "metadata_kv_count: %llu key/value pairs cannot fit in the %zu bytes left",
                               (unsigned long long)*n_kv, rd_left(r));
        if (*n_tensors > rd_left(r) / GGUF_MIN_TENSOR_BYTES)
                return rd_fail(r, TSR_E_INVAL, "tensor_count: %llu tensors cannot fit in the %zu bytes left",
                               (unsigned long long)*n_tensors, rd_left(r));
        g->version = version;
        return TSR_OK;
}

static tsr_status parse_kvs(gguf_rd *r, tsr_gguf *g, uint64_t n_kv) {
        char ctx[160];
        uint64_t i;
        tsr_status st;

        g->kvs = n_kv ? tsr_arena_calloc(r->arena, n_kv, sizeof(*g->kvs)) : NULL;
        g->kv_sorted = n_kv ? tsr_arena_calloc(r->arena, n_kv, sizeof(*g->kv_sorted)) : NULL;
        if (n_kv && (!g->kvs || !g->kv_sorted))
                return rd_fail(r, TSR_E_NOMEM, "metadata: out of memory");
        for (i = 0; i < n_kv; i++) {
                tsr_gguf_kv *kv = &g->kvs[i];
                const uint8_t *key;
                uint64_t key_len;
                uint32_t type;
                char *name;

                snprintf(ctx, sizeof(ctx), "metadata key %llu", (unsigned long long)i);
                st = rd_str(r, &key, &key_len, ctx);
                if (st != TSR_OK)
                        return st;
                if (key_len > GGUF_MAX_KEY_LEN)
                        return rd_fail(r, TSR_E_INVAL, "%s: key length %llu is over the %d-byte limit", ctx,
                                       (unsigned long long)key_len, GGUF_MAX_KEY_LEN);
                st = dup_name(r, key, key_len, &name, ctx);
                if (st != TSR_OK)
                        return st;
                kv->key = name;
                snprintf(ctx, sizeof(ctx), "key '%.100s'", name);
                st = rd_u32(r, &type, ctx);
                if (st != TSR_OK)
                        return st;
                st = parse_value(r, type, &kv->value, 0, ctx);
                if (st != TSR_OK)
                        return st;
                g->kv_sorted[i] = kv;
                g->n_kv = i + 1;
        }
        if (n_kv)
                qsort(g->kv_sorted, n_kv, sizeof(*g->kv_sorted), cmp_kv);
        for (i = 1; i < n_kv; i++)
                if (strcmp(g->kv_sorted[i - 1]->key, g->kv_sorted[i]->key) == 0)
                        return rd_fail(r, TSR_E_INVAL, "duplicate metadata key '%.100s'", g->kv_sorted[i]->key);
        return TSR_OK;
}

static tsr_status parse_alignment(gguf_rd *r, tsr_gguf *g) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, "general.alignment");
        uint32_t a;

        g->alignment = TSR_GGUF_DEFAULT_ALIGNMENT;
        if (!kv)
                return TSR_OK;
        if (kv->value.type != TSR_GGUF_TYPE_UINT32)
                return rd_fail(r, TSR_E_INVAL, "key 'general.alignment': expected uint32, found %s",
                               tsr_gguf_type_name(kv->value.type));
        a = ld_u32(kv->value._data);
        if (a == 0 || (a & (a - 1)) != 0)
                return rd_fail(r, TSR_E_INVAL, "key 'general.alignment': %u is not a power of two", a);
        g->alignment = a;
        return TSR_OK;
}

static tsr_status parse_tensor_info(gguf_rd *r, tsr_gguf_tensor *t, uint64_t i) {
        char ctx[160];
        const uint8_t *s;
        uint64_t len, n_el = 1, n_blocks;
        uint32_t n_dims, type, d;
        char *name;
        tsr_status st;

        snprintf(ctx, sizeof(ctx), "tensor %llu name", (unsigned long long)i);
        st = rd_str(r, &s, &len, ctx);
        if (st != TSR_OK)
                return st;
        st = dup_name(r, s, len, &name, ctx);
        if (st != TSR_OK)
                return st;
        t->name = name;
        snprintf(ctx, sizeof(ctx), "tensor '%.100s' n_dims", name);
        st = rd_u32(r, &n_dims, ctx);
        if (st != TSR_OK)
                return st;
        if (n_dims > TSR_GGUF_MAX_DIMS)
                return rd_fail(r, TSR_E_INVAL, "tensor '%.100s': n_dims %u is more than %d", name, n_dims,
                               TSR_GGUF_MAX_DIMS);
        t->n_dims = n_dims;
        for (d = 0; d < TSR_GGUF_MAX_DIMS; d++)
                t->dims[d] = 1;
        snprintf(ctx, sizeof(ctx), "tensor '%.100s' dims", name);
        for (d = 0; d < n_dims; d++) {
                st = rd_u64(r, &t->dims[d], ctx);
                if (st != TSR_OK)
                        return st;
        }
        /* ggml counts elements in int64_t: keep every product below 2^63. */
        for (d = 0; d < TSR_GGUF_MAX_DIMS; d++) {
                if (t->dims[d] > (uint64_t)INT64_MAX ||
                    (t->dims[d] && n_el > (uint64_t)INT64_MAX / t->dims[d]))
                        return rd_fail(r, TSR_E_INVAL, "tensor '%.100s': dims overflow (dims[%u] = %llu)", name, d,
                                       (unsigned long long)t->dims[d]);
                n_el *= t->dims[d];
        }
        t->n_elements = n_el;
        snprintf(ctx, sizeof(ctx), "tensor '%.100s' type", name);
        st = rd_u32(r, &type, ctx);
        if (st != TSR_OK)
                return st;
        if (type >= N_GGML_TYPES || !ggml_types[type].name)
                return rd_fail(r, TSR_E_INVAL, "tensor '%.100s': unknown ggml type %u", name, type);
        t->type = (tsr_ggml_type)type;
        if (t->dims[0] % ggml_types[type].blck_elems != 0)
                return rd_fail(r, TSR_E_INVAL,
                               "tensor '%.100s': dims[0] = %llu is not a multiple of the %s block size %u", name,
                               (unsigned long long)t->dims[0], ggml_types[type].name, ggml_types[type].blck_elems);
        n_blocks = n_el / ggml_types[type].blck_elems;
        if (n_blocks > UINT64_MAX / ggml_types[type].blck_bytes)
                return rd_fail(r, TSR_E_INVAL, "tensor '%.100s': byte size overflows", name);
        t->n_bytes = n_blocks * ggml_types[type].blck_bytes;
        snprintf(ctx, sizeof(ctx), "tensor '%.100s' offset", name);
        return rd_u64(r, &t->offset, ctx);
}

static tsr_status parse_tensors(gguf_rd *r, tsr_gguf *g, uint64_t n_tensors) {
        uint64_t i, data_len;
        tsr_status st;

        g->tensors = n_tensors ? tsr_arena_calloc(r->arena, n_tensors, sizeof(*g->tensors)) : NULL;
        g->tensor_sorted = n_tensors ? tsr_arena_calloc(r->arena, n_tensors, sizeof(*g->tensor_sorted)) : NULL;
        if (n_tensors && (!g->tensors || !g->tensor_sorted))
                return rd_fail(r, TSR_E_NOMEM, "tensor infos: out of memory");
        for (i = 0; i < n_tensors; i++) {
                st = parse_tensor_info(r, &g->tensors[i], i);
                if (st != TSR_OK)
                        return st;
                g->tensor_sorted[i] = &g->tensors[i];
                g->n_tensors = i + 1;
        }
        if (n_tensors)
                qsort(g->tensor_sorted, n_tensors, sizeof(*g->tensor_sorted), cmp_tensor);
        for (i = 1; i < n_tensors; i++)
                if (strcmp(g->tensor_sorted[i - 1]->name, g->tensor_sorted[i]->name) == 0)
                        return rd_fail(r, TSR_E_INVAL, "duplicate tensor name '%.100s'", g->tensor_sorted[i]->name);

        /* The data section starts at the next multiple of the alignment.  A file without
         * tensor data may end before that (no padding was written). */
        g->data_offset = (r->pos + g->alignment - 1) / g->alignment * g->alignment;
        data_len = g->data_offset < r->len ? r->len - g->data_offset : 0;
        for (i = 0; i < n_tensors; i++) {
                tsr_gguf_tensor *t = &g->tensors[i];

                if (t->offset % g->alignment != 0)
                        return rd_fail(r, TSR_E_INVAL,
                                       "tensor '%.100s': offset %llu is not a multiple of the alignment %llu", t->name,
                                       (unsigned long long)t->offset, (unsigned long long)g->alignment);
                if (t->n_bytes > data_len || t->offset > data_len - t->n_bytes)
                        return rd_fail(r, TSR_E_INVAL,
                                       "tensor '%.100s': data at offset %llu, %llu bytes, is outside the file's "
                                       "%llu-byte data section",
                                       t->name, (unsigned long long)t->offset, (unsigned long long)t->n_bytes,
                                       (unsigned long long)data_len);
                t->data = t->n_bytes ? r->p + g->data_offset + t->offset : NULL;
        }
        return TSR_OK;
}

bool tsr_gguf_file_mapped(const tsr_gguf *g) { return g && g->map; }

static void gguf_free(tsr_gguf *g) {
        if (!g)
                return;
        if (g->map)
                munmap(g->map, g->size);
        tsr_arena_free(&g->arena);
        free(g);
}

/* Parse `len` bytes at `p`.  On success the new tsr_gguf borrows `p`; the caller sets
 * `map` when it owns a mapping. */
static tsr_status gguf_parse(const uint8_t *p, size_t len, const char *name, tsr_gguf **ret, char *err,
                             size_t errlen) {
        gguf_rd r = {.p = p, .len = len, .pos = 0, .name = name, .err = err, .errlen = errlen};
        uint64_t n_kv = 0, n_tensors = 0;
        tsr_gguf *g;
        tsr_status st;

        g = calloc(1, sizeof(*g));
        if (g)
                g->arena = tsr_arena_new(64 * 1024, 0);
        if (!g || !g->arena) {
                st = rd_fail(&r, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        g->base = p;
        g->size = len;
        r.arena = g->arena;
        st = parse_header(&r, g, &n_kv, &n_tensors);
        if (st == TSR_OK)
                st = parse_kvs(&r, g, n_kv);
        if (st == TSR_OK)
                st = parse_alignment(&r, g);
        if (st == TSR_OK)
                st = parse_tensors(&r, g, n_tensors);
done:
        if (st != TSR_OK) {
                gguf_free(g);
                return st;
        }
        *ret = g;
        return TSR_OK;
}

tsr_status tsr_gguf_open_memory(const void *data, size_t len, tsr_gguf **ret, char *err, size_t errlen) {
        if (!data && len)
                return TSR_E_INVAL;
        return gguf_parse(data, len, "<memory>", ret, err, errlen);
}

static tsr_status path_fail(const char *path, tsr_status st, char *err, size_t errlen, const char *what) {
        if (err && errlen)
                snprintf(err, errlen, "%s: %s", path, what);
        return st;
}

tsr_status tsr_gguf_open(const char *path, tsr_gguf **ret, char *err, size_t errlen) {
        struct stat sb;
        void *map = NULL;
        tsr_gguf *g = NULL;
        tsr_status st;
        int fd;

        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return path_fail(path, errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO, err, errlen, strerror(errno));
        if (fstat(fd, &sb) != 0) {
                st = path_fail(path, TSR_E_IO, err, errlen, strerror(errno));
                goto done;
        }
        if (!S_ISREG(sb.st_mode)) {
                st = path_fail(path, TSR_E_INVAL, err, errlen, "not a regular file");
                goto done;
        }
        if (sb.st_size > 0) {
                /* Read-only and private: the weights are never written through the map. */
                map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
                if (map == MAP_FAILED) {
                        map = NULL;
                        st = path_fail(path, TSR_E_IO, err, errlen, strerror(errno));
                        goto done;
                }
        }
        st = gguf_parse(map, (size_t)sb.st_size, path, &g, err, errlen);
        if (st == TSR_OK) {
                g->map = map;           /* the tsr_gguf owns the mapping from here */
                map = NULL;
                *ret = g;
        }
done:
        if (map)
                munmap(map, (size_t)sb.st_size);
        close(fd);
        return st;
}

void tsr_gguf_close(tsr_gguf **g) {
        if (!g || !*g)
                return;
        gguf_free(*g);
        *g = NULL;
}

uint32_t tsr_gguf_version(const tsr_gguf *g) { return g->version; }
uint64_t tsr_gguf_alignment(const tsr_gguf *g) { return g->alignment; }
uint64_t tsr_gguf_data_offset(const tsr_gguf *g) { return g->data_offset; }
size_t tsr_gguf_file_size(const tsr_gguf *g) { return g->size; }
size_t tsr_gguf_n_kv(const tsr_gguf *g) { return g->n_kv; }
size_t tsr_gguf_n_tensors(const tsr_gguf *g) { return g->n_tensors; }

const tsr_gguf_kv *tsr_gguf_kv_at(const tsr_gguf *g, size_t i) { return i < g->n_kv ? &g->kvs[i] : NULL; }

const tsr_gguf_tensor *tsr_gguf_tensor_at(const tsr_gguf *g, size_t i) {
        return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const tsr_gguf_kv *tsr_gguf_find_kv(const tsr_gguf *g, const char *key) {
        size_t lo = 0, hi = g->n_kv;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                int c = strcmp(key, g->kv_sorted[mid]->key);
                if (c == 0)
                        return g->kv_sorted[mid];
                if (c < 0)
                        hi = mid;
                else
                        lo = mid + 1;
        }
        return NULL;
}

const tsr_gguf_tensor *tsr_gguf_find_tensor(const tsr_gguf *g, const char *name) {
        size_t lo = 0, hi = g->n_tensors;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                int c = strcmp(name, g->tensor_sorted[mid]->name);
                if (c == 0)
                        return g->tensor_sorted[mid];
                if (c < 0)
                        hi = mid;
                else
                        lo = mid + 1;
        }
        return NULL;
}

/* Integer value as sign + magnitude; false for non-integer types. */
static bool value_int(const tsr_gguf_value *v, bool *neg, uint64_t *mag) {
        const uint8_t *p = v->_data;
        int64_t s;

        *neg = false;
        switch (v->type) {
        case TSR_GGUF_TYPE_UINT8:
                *mag = p[0];
                return true;
        case TSR_GGUF_TYPE_UINT16:
                *mag = ld_u16(p);
                return true;
        case TSR_GGUF_TYPE_UINT32:
                *mag = ld_u32(p);
                return true;
        case TSR_GGUF_TYPE_UINT64:
                *mag = ld_u64(p);
                return true;
        case TSR_GGUF_TYPE_INT8:
                s = (int8_t)p[0];
                break;
        case TSR_GGUF_TYPE_INT16:
                s = (int16_t)ld_u16(p);
                break;
        case TSR_GGUF_TYPE_INT32:
                s = (int32_t)ld_u32(p);
                break;
        case TSR_GGUF_TYPE_INT64:
                s = (int64_t)ld_u64(p);
                break;
        default:
                return false;
        }
        *neg = s < 0;
        /* Negate in unsigned arithmetic so INT64_MIN does not overflow. */
        *mag = s < 0 ? 0 - (uint64_t)s : (uint64_t)s;
        return true;
}

tsr_status tsr_gguf_get_u64(const tsr_gguf_value *v, uint64_t *ret) {
        bool neg;
        uint64_t mag;

        if (!value_int(v, &neg, &mag) || neg)
                return TSR_E_INVAL;
        *ret = mag;
        return TSR_OK;
}

tsr_status tsr_gguf_get_i64(const tsr_gguf_value *v, int64_t *ret) {
        bool neg;
        uint64_t mag;

        if (!value_int(v, &neg, &mag))
                return TSR_E_INVAL;
        if (neg) {
                *ret = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
                return TSR_OK;
        }
        if (mag > (uint64_t)INT64_MAX)
                return TSR_E_INVAL;
        *ret = (int64_t)mag;
        return TSR_OK;
}

tsr_status tsr_gguf_get_f64(const tsr_gguf_value *v, double *ret) {
        bool neg;
        uint64_t mag;

        if (v->type == TSR_GGUF_TYPE_FLOAT32) {
                uint32_t bits = ld_u32(v->_data);
                float f;
                memcpy(&f, &bits, sizeof(f));
                *ret = f;
                return TSR_OK;
        }
        if (v->type == TSR_GGUF_TYPE_FLOAT64) {
                uint64_t bits = ld_u64(v->_data);
                double d;
                memcpy(&d, &bits, sizeof(d));
                *ret = d;
                return TSR_OK;
        }
        if (!value_int(v, &neg, &mag))
                return TSR_E_INVAL;
        *ret = neg ? -(double)mag : (double)mag;
        return TSR_OK;
}

tsr_status tsr_gguf_get_bool(const tsr_gguf_value *v, bool *ret) {
        if (v->type != TSR_GGUF_TYPE_BOOL)
                return TSR_E_INVAL;
        *ret = v->_data[0] != 0;
        return TSR_OK;
}

tsr_status tsr_gguf_get_str(const tsr_gguf_value *v, const char **s, size_t *len) {
        if (v->type != TSR_GGUF_TYPE_STRING)
                return TSR_E_INVAL;
        *s = (const char *)v->_data;
        *len = (size_t)v->_len;
        return TSR_OK;
}

tsr_status tsr_gguf_array_elem(const tsr_gguf_value *arr, uint64_t i, tsr_gguf_value *ret) {
        tsr_gguf_value e;

        if (arr->type != TSR_GGUF_TYPE_ARRAY)
                return TSR_E_INVAL;
        if (i >= arr->count)
                return TSR_E_NOTFOUND;
        if (arr->elem_type == TSR_GGUF_TYPE_ARRAY) {
                *ret = arr->_elems[i];
                return TSR_OK;
        }
        memset(&e, 0, sizeof(e));
        e.type = arr->elem_type;
        e.count = 1;
        if (arr->elem_type == TSR_GGUF_TYPE_STRING) {
                const uint8_t *p = arr->_data + arr->_str_off[i];
                e._len = ld_u64(p);
                e._data = p + 8;
        } else {
                e._data = arr->_data + i * gguf_type_sizes[arr->elem_type];
        }
        *ret = e;
        return TSR_OK;
}

tsr_status tsr_gguf_arch_u32(const tsr_gguf *g, const char *path, const char *arch, const char *key, bool required,
                             uint32_t def, int64_t elem, uint32_t *ret, char *err, size_t errlen) {
        char name[128];
        uint64_t v;
        tsr_gguf_value e;
        snprintf(name, sizeof name, "%s.%s", arch, key);
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, name);
        if (!kv) {
                if (required) {
                        tsr_errf(err, errlen, "%s: metadata key '%s' missing", path, name);
                        return TSR_E_INVAL;
                }
                *ret = def;
                return TSR_OK;
        }
        const tsr_gguf_value *val = &kv->value;
        if (kv->value.type == TSR_GGUF_TYPE_ARRAY) {
                if (elem < 0 || tsr_gguf_array_elem(&kv->value, (uint64_t)elem, &e) != TSR_OK) {
                        tsr_errf(err, errlen, "%s: metadata key '%s': expected %s", path, name,
                                 elem < 0 ? "a number" : "an entry per layer");
                        return TSR_E_INVAL;
                }
                val = &e;
        }
        if (tsr_gguf_get_u64(val, &v) != TSR_OK || v > UINT32_MAX) {
                tsr_errf(err, errlen, "%s: metadata key '%s': expected an unsigned 32-bit integer", path, name);
                return TSR_E_INVAL;
        }
        *ret = (uint32_t)v;
        return TSR_OK;
}

tsr_status tsr_gguf_arch_f64(const tsr_gguf *g, const char *path, const char *arch, const char *key, double def,
                             double *ret, char *err, size_t errlen) {
        char name[128];
        snprintf(name, sizeof name, "%s.%s", arch, key);
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, name);
        if (!kv) {
                *ret = def;
                return TSR_OK;
        }
        if (tsr_gguf_get_f64(&kv->value, ret) != TSR_OK || !isfinite(*ret)) {
                tsr_errf(err, errlen, "%s: metadata key '%s': expected a finite number", path, name);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}
