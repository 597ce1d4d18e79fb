/* safetensors.h - read-only reader of Hugging Face .safetensors files and sharded sets.
 *
 * Format (https://huggingface.co/docs/safetensors, the reference parser is the Rust
 * crate): an 8-byte little-endian header length N, N bytes of JSON, then the data
 * section, which is every byte after the header.  The JSON is one object; each key but
 * "__metadata__" names a tensor:
 *     "name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}
 * where the offsets are relative to the start of the data section and the tensor's bytes
 * are row-major, little-endian.  "__metadata__", if present, maps strings to strings.
 *
 * tsr_safetensors_open maps the file read-only and validates all of it before returning,
 * as the Rust crate does and stricter: N at most TSR_SAFETENSORS_MAX_HEADER and within
 * the file; valid UTF-8 JSON with unique keys; every entry exactly those three fields;
 * a known dtype; a shape whose element count and byte size do not overflow; offsets with
 * begin <= end, end - begin equal to the shape's byte size, and the tensors (sorted by
 * offset) tiling the data section exactly: no overlap, no gap, nothing after the last.
 * Model files come from users, so no input may make it read out of bounds; a bad file
 * gives TSR_E_INVAL and a message naming the file and the tensor or field.
 *
 * Known dtypes the loaders cannot convert (F64, integers, FP8, ...) are accepted here so
 * a file can be inspected; the loader refuses them per tensor.  Tensor data is only
 * byte-aligned in general (the data section starts at 8 + N): read it with memcpy.
 *
 * A tsr_safetensors is immutable after open and may be read from any number of threads;
 * what it hands out lives until tsr_safetensors_close. */
#ifndef TSR_SAFETENSORS_H
#define TSR_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

/* A header longer than this is a corrupt length, not a model (the Rust crate's cap is
 * 100 MB too; Llama 3.1 405B's biggest shard header is under 100 KB). */
#define TSR_SAFETENSORS_MAX_HEADER (100u * 1000u * 1000u)
/* Tensors of more dims are rejected (real checkpoints use at most 5). */
#define TSR_SAFETENSORS_MAX_DIMS 8
/* model.safetensors.index.json larger than this is rejected. */
#define TSR_SAFETENSORS_MAX_INDEX (64u << 20)

typedef enum tsr_safetensors_dtype {
        TSR_ST_BOOL = 0,
        TSR_ST_U8,
        TSR_ST_I8,
        TSR_ST_F8_E5M2,
        TSR_ST_F8_E4M3,
        TSR_ST_F8_E8M0,
        TSR_ST_F4,              /* float4 e2m1, two per byte */
        TSR_ST_F6_E2M3,         /* float6, packed */
        TSR_ST_F6_E3M2,
        TSR_ST_I16,
        TSR_ST_U16,
        TSR_ST_F16,
        TSR_ST_BF16,
        TSR_ST_I32,
        TSR_ST_U32,
        TSR_ST_F32,
        TSR_ST_I64,
        TSR_ST_U64,
        TSR_ST_F64,
        TSR_ST_C64,             /* complex of two float32 */
        TSR_ST_N_DTYPES
} tsr_safetensors_dtype;

typedef struct tsr_safetensors_tensor {
        const char *name;               /* NUL-terminated, owned by the file */
        tsr_safetensors_dtype dtype;
        uint32_t n_dims;                /* 0 = a scalar (one element) */
        uint64_t shape[TSR_SAFETENSORS_MAX_DIMS];       /* row-major: shape[n_dims-1] varies fastest */
        uint64_t n_elements;            /* product of the shape; < 2^63 */
        uint64_t n_bytes;               /* n_elements * bits / 8 */
        uint64_t offset;                /* data_offsets[0], from the start of the data section */
        const void *data;               /* n_bytes readable bytes; NULL when n_bytes is 0 */
} tsr_safetensors_tensor;

typedef struct tsr_safetensors tsr_safetensors;

/* Map `path` read-only and parse it.  On success *ret owns the map (tsr_safetensors_close).
 * TSR_E_NOTFOUND (no such file), TSR_E_IO, TSR_E_INVAL (malformed; message names the
 * file and the tensor or field), TSR_E_LIMIT (header length over the cap), TSR_E_NOMEM. */
tsr_status tsr_safetensors_open(const char *path, tsr_safetensors **ret, char *err, size_t errlen);
/* The same over bytes the caller keeps alive and unchanged until close (borrowed, not
 * copied).  Messages name the file "<memory>". */
tsr_status tsr_safetensors_open_memory(const void *data, size_t len, tsr_safetensors **ret, char *err,
                                       size_t errlen);
/* Accepts NULL and *f == NULL; clears *f. */
void tsr_safetensors_close(tsr_safetensors **f);

/* The path given to open ("<memory>" for open_memory). */
const char *tsr_safetensors_path(const tsr_safetensors *f);
size_t tsr_safetensors_file_size(const tsr_safetensors *f);
/* Byte offset of the data section from the start of the file (8 + header length). */
uint64_t tsr_safetensors_data_offset(const tsr_safetensors *f);

/* Tensors, in header order.  Names are unique. */
size_t tsr_safetensors_n_tensors(const tsr_safetensors *f);
const tsr_safetensors_tensor *tsr_safetensors_tensor_at(const tsr_safetensors *f, size_t i);
/* NULL when absent.  O(log n). */
const tsr_safetensors_tensor *tsr_safetensors_find(const tsr_safetensors *f, const char *name);

/* "__metadata__" entries, in header order (keys unique); NULL value when absent. */
size_t tsr_safetensors_n_metadata(const tsr_safetensors *f);
tsr_status tsr_safetensors_metadata_at(const tsr_safetensors *f, size_t i, const char **key, const char **value);
const char *tsr_safetensors_metadata(const tsr_safetensors *f, const char *key);

/* "F32", "BF16", ... (the header spelling); "?" outside the enum.  Never NULL. */
const char *tsr_safetensors_dtype_name(tsr_safetensors_dtype d);
/* Bits per element; 0 outside the enum. */
uint32_t tsr_safetensors_dtype_bits(tsr_safetensors_dtype d);

/* ---- a checkpoint folder: one file or index-mapped shards --------------------------- */

typedef struct tsr_safetensors_set tsr_safetensors_set;

/* Open the weights of the Hugging Face folder `dir`:
 *  - model.safetensors.index.json present: its "weight_map" (tensor name -> file name in
 *    `dir`, a plain name without '/' or "..") decides where each tensor lives; every
 *    file it names is opened and must hold the tensors mapped to it;
 *  - else model.safetensors.
 * TSR_E_NOTFOUND when neither exists or a mapped tensor is not in its file; TSR_E_INVAL
 * for a bad index; the errors of tsr_safetensors_open otherwise.  Messages name the file. */
tsr_status tsr_safetensors_set_open(const char *dir, tsr_safetensors_set **ret, char *err, size_t errlen);
/* Accepts NULL and *s == NULL; clears *s. */
void tsr_safetensors_set_close(tsr_safetensors_set **s);

/* What the set was opened from, for messages: the index's path, or model.safetensors's. */
const char *tsr_safetensors_set_source(const tsr_safetensors_set *s);
size_t tsr_safetensors_set_n_files(const tsr_safetensors_set *s);
const tsr_safetensors *tsr_safetensors_set_file(const tsr_safetensors_set *s, size_t i);
/* The tensor `name` and (if `file` is not NULL) the path of the file holding it; NULL
 * when the set has no such tensor.  With an index only mapped names are found. */
const tsr_safetensors_tensor *tsr_safetensors_set_find(const tsr_safetensors_set *s, const char *name,
                                                       const char **file);
/* Every tensor of the set, i < n: with an index the mapped ones in name order, else the
 * file's in header order.  NULL when i is out of range; *file as tsr_safetensors_set_find. */
size_t tsr_safetensors_set_n_tensors(const tsr_safetensors_set *s);
const tsr_safetensors_tensor *tsr_safetensors_set_tensor_at(const tsr_safetensors_set *s, size_t i,
                                                            const char **file);

#endif
