/* gguf.h - read-only GGUF (v2/v3) reader.
 *
 * Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.  A file is a header
 * (magic "GGUF", version, tensor count, metadata count), the metadata key/value pairs,
 * the tensor infos, padding to `general.alignment` (default 32), then the tensor data.
 * Everything is little-endian; big-endian files are rejected.
 *
 * tsr_gguf_open maps the file read-only and validates all of it before returning: every
 * length and count against the bytes left, every value type, every tensor's ggml type,
 * shape and data range.  Model files come from users and the reader is fuzzed, so no
 * input may make it read out of bounds; a bad file gives a status and a message naming
 * the file and the field or tensor.  After a successful open the accessors below cannot
 * fail on bounds, only on a type mismatch.
 *
 * Strings in the file are not NUL-terminated: string values come back as pointer+length
 * into the map.  Keys and tensor names are copied and NUL-terminated (they must not
 * contain NUL bytes).  A tsr_gguf is immutable after open, so it may be read from any
 * number of threads; everything it hands out lives until tsr_gguf_close. */
#ifndef TSR_GGUF_H
#define TSR_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

#define TSR_GGUF_DEFAULT_ALIGNMENT 32
#define TSR_GGUF_MAX_DIMS 4
#define TSR_GGUF_MAX_ARRAY_DEPTH 8      /* arrays of arrays nest at most this deep */

/* Metadata value types; the numbers are the on-disk tags. */
typedef enum tsr_gguf_type {
        TSR_GGUF_TYPE_UINT8 = 0,
        TSR_GGUF_TYPE_INT8 = 1,
        TSR_GGUF_TYPE_UINT16 = 2,
        TSR_GGUF_TYPE_INT16 = 3,
        TSR_GGUF_TYPE_UINT32 = 4,
        TSR_GGUF_TYPE_INT32 = 5,
        TSR_GGUF_TYPE_FLOAT32 = 6,
        TSR_GGUF_TYPE_BOOL = 7,
        TSR_GGUF_TYPE_STRING = 8,
        TSR_GGUF_TYPE_ARRAY = 9,
        TSR_GGUF_TYPE_UINT64 = 10,
        TSR_GGUF_TYPE_INT64 = 11,
        TSR_GGUF_TYPE_FLOAT64 = 12,
} tsr_gguf_type;

/* ggml tensor types; the numbers are the on-disk tags (gaps are retired types, which the
 * reader rejects as unknown). */
typedef enum tsr_ggml_type {
        TSR_GGML_TYPE_F32 = 0,
        TSR_GGML_TYPE_F16 = 1,
        TSR_GGML_TYPE_Q4_0 = 2,
        TSR_GGML_TYPE_Q4_1 = 3,
        TSR_GGML_TYPE_Q5_0 = 6,
        TSR_GGML_TYPE_Q5_1 = 7,
        TSR_GGML_TYPE_Q8_0 = 8,
        TSR_GGML_TYPE_Q8_1 = 9,
        TSR_GGML_TYPE_Q2_K = 10,
        TSR_GGML_TYPE_Q3_K = 11,
        TSR_GGML_TYPE_Q4_K = 12,
        TSR_GGML_TYPE_Q5_K = 13,
        TSR_GGML_TYPE_Q6_K = 14,
        TSR_GGML_TYPE_Q8_K = 15,
        TSR_GGML_TYPE_IQ2_XXS = 16,
        TSR_GGML_TYPE_IQ2_XS = 17,
        TSR_GGML_TYPE_IQ3_XXS = 18,
        TSR_GGML_TYPE_IQ1_S = 19,
        TSR_GGML_TYPE_IQ4_NL = 20,
        TSR_GGML_TYPE_IQ3_S = 21,
        TSR_GGML_TYPE_IQ2_S = 22,
        TSR_GGML_TYPE_IQ4_XS = 23,
        TSR_GGML_TYPE_I8 = 24,
        TSR_GGML_TYPE_I16 = 25,
        TSR_GGML_TYPE_I32 = 26,
        TSR_GGML_TYPE_I64 = 27,
        TSR_GGML_TYPE_F64 = 28,
        TSR_GGML_TYPE_IQ1_M = 29,
        TSR_GGML_TYPE_BF16 = 30,
        TSR_GGML_TYPE_TQ1_0 = 34,
        TSR_GGML_TYPE_TQ2_0 = 35,
        TSR_GGML_TYPE_MXFP4 = 39,
        TSR_GGML_TYPE_NVFP4 = 40,
        TSR_GGML_TYPE_Q1_0 = 41,
} tsr_ggml_type;

/* One metadata value.  Public fields may be read directly; the `_` ones belong to the
 * accessors.  Arrays: `elem_type` and `count` describe the elements; use
 * tsr_gguf_array_elem to reach one.  Scalars and strings: count is 1. */
typedef struct tsr_gguf_value {
        tsr_gguf_type type;
        tsr_gguf_type elem_type;                /* arrays only */
        uint64_t count;                         /* arrays: number of elements */
        const uint8_t *_data;                   /* scalar bytes, string bytes, or first element */
        uint64_t _len;                          /* strings: length in bytes */
        const uint64_t *_str_off;               /* arrays of strings: offset of each element from _data */
        const struct tsr_gguf_value *_elems;    /* arrays of arrays: the parsed elements */
} tsr_gguf_value;

typedef struct tsr_gguf_kv {
        const char *key;        /* NUL-terminated copy, owned by the tsr_gguf */
        tsr_gguf_value value;
} tsr_gguf_kv;

typedef struct tsr_gguf_tensor {
        const char *name;       /* NUL-terminated copy, owned by the tsr_gguf */
        tsr_ggml_type type;
        uint32_t n_dims;        /* 0..4 as stored; 0 means a single element */
        uint64_t dims[TSR_GGUF_MAX_DIMS];  /* ggml order: dims[0] varies fastest; unused dims are 1 */
        uint64_t n_elements;    /* product of dims, < 2^63 */
        uint64_t n_bytes;       /* n_elements / block size * block bytes */
        uint64_t offset;        /* from the start of the data section; a multiple of the alignment */
        const void *data;       /* into the map: n_bytes readable bytes (NULL when n_bytes is 0) */
} tsr_gguf_tensor;

typedef struct tsr_gguf tsr_gguf;

/* Map `path` read-only and parse it.  On success *ret owns the map (close with
 * tsr_gguf_close).  Returns TSR_E_NOTFOUND if the file does not exist, TSR_E_IO if it
 * cannot be read, TSR_E_INVAL for a malformed file, TSR_E_UNSUPPORTED for a GGUF version
 * other than 2 or 3, TSR_E_NOMEM.  On failure `err` (if not NULL) gets a message naming
 * the file and the field. */
tsr_status tsr_gguf_open(const char *path, tsr_gguf **ret, char *err, size_t errlen);
/* The same over bytes in memory, which the caller keeps alive and unchanged until
 * tsr_gguf_close (they are borrowed, not copied).  Messages name the file "<memory>". */
tsr_status tsr_gguf_open_memory(const void *data, size_t len, tsr_gguf **ret, char *err, size_t errlen);
/* Unmap and free.  Accepts NULL and *g == NULL; clears *g. */
void tsr_gguf_close(tsr_gguf **g);
/* Whether g's bytes are its own read-only private map of a file (tsr_gguf_open), which
 * madvise(MADV_DONTNEED) may drop and a later read faults back in; false for borrowed
 * bytes (tsr_gguf_open_memory), where the same call would lose them. */
bool tsr_gguf_file_mapped(const tsr_gguf *g);

uint32_t tsr_gguf_version(const tsr_gguf *g);
/* general.alignment, or 32 when absent. */
uint64_t tsr_gguf_alignment(const tsr_gguf *g);
/* Byte offset of the data section from the start of the file. */
uint64_t tsr_gguf_data_offset(const tsr_gguf *g);
size_t tsr_gguf_file_size(const tsr_gguf *g);

/* Metadata, in file order.  Keys are unique (duplicates are rejected at open). */
size_t tsr_gguf_n_kv(const tsr_gguf *g);
const tsr_gguf_kv *tsr_gguf_kv_at(const tsr_gguf *g, size_t i);
/* NULL when the key is absent.  O(log n). */
const tsr_gguf_kv *tsr_gguf_find_kv(const tsr_gguf *g, const char *key);

/* Typed reads.  Each returns TSR_OK and writes *ret, or TSR_E_INVAL (ret untouched) when
 * the value's type does not fit:
 *   get_u64: any integer type holding a value >= 0;
 *   get_i64: any integer type holding a value <= INT64_MAX;
 *   get_f64: FLOAT32, FLOAT64 or any integer type;
 *   get_bool: BOOL only (any non-zero byte is true);
 *   get_str: STRING only; *s points into the map, is not NUL-terminated, *len bytes. */
tsr_status tsr_gguf_get_u64(const tsr_gguf_value *v, uint64_t *ret);
tsr_status tsr_gguf_get_i64(const tsr_gguf_value *v, int64_t *ret);
tsr_status tsr_gguf_get_f64(const tsr_gguf_value *v, double *ret);
tsr_status tsr_gguf_get_bool(const tsr_gguf_value *v, bool *ret);
tsr_status tsr_gguf_get_str(const tsr_gguf_value *v, const char **s, size_t *len);
/* Element `i` of an array, as a value the getters above accept (it borrows from `arr`).
 * TSR_E_INVAL if `arr` is not an array, TSR_E_NOTFOUND if i >= count.  O(1). */
tsr_status tsr_gguf_array_elem(const tsr_gguf_value *arr, uint64_t i, tsr_gguf_value *ret);

/* A model family's metadata key "<arch>.<key>" as a u32, for the config readers: an
 * array value's element `elem` (a per-layer list; elem < 0: an array is an error), a
 * scalar as it is.  Absent: *ret = def unless `required`.  TSR_E_INVAL with `err` naming
 * `path` and the key ("missing", "expected an unsigned 32-bit integer", "expected an
 * entry per layer"). */
tsr_status tsr_gguf_arch_u32(const tsr_gguf *g, const char *path, const char *arch, const char *key, bool required,
                             uint32_t def, int64_t elem, uint32_t *ret, char *err, size_t errlen);
/* The same as a finite number (never required: absent is def). */
tsr_status tsr_gguf_arch_f64(const tsr_gguf *g, const char *path, const char *arch, const char *key, double def,
                             double *ret, char *err, size_t errlen);

/* Tensors, in file order.  Names are unique (duplicates are rejected at open). */
size_t tsr_gguf_n_tensors(const tsr_gguf *g);
const tsr_gguf_tensor *tsr_gguf_tensor_at(const tsr_gguf *g, size_t i);
/* NULL when absent.  O(log n). */
const tsr_gguf_tensor *tsr_gguf_find_tensor(const tsr_gguf *g, const char *name);

/* "uint8" ... "float64"; "?" for a value outside the enum.  Never NULL. */
const char *tsr_gguf_type_name(tsr_gguf_type t);
/* "F32", "Q4_K", ...; NULL for an unknown or retired tag. */
const char *tsr_ggml_type_name(uint32_t t);
/* Elements per block and bytes per block of a known ggml type (1 and 4 for F32).
 * TSR_E_INVAL for an unknown tag, outputs untouched. */
tsr_status tsr_ggml_type_size(uint32_t t, uint32_t *blck_elems, uint32_t *blck_bytes);

#endif
