/* safetensors.c - .safetensors reader: mmap, validate the whole header, hand out views.
 *
 * The 8-byte length is checked against the cap and the file before jansson sees the
 * header, jansson parses exactly those bytes (it validates UTF-8 and rejects duplicate
 * keys), and every number taken from the JSON is range-checked before it is used as a
 * size or an offset, so no file can make the reader touch a byte outside the map.
 * Names, metadata strings and tables live in one arena freed by tsr_safetensors_close. */
#include "worker/load/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/arena.h"

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

struct st_meta {
        const char *key, *value;
};

struct tsr_safetensors {
        const uint8_t *base;
        size_t size;
        void *map;                      /* NULL when the bytes are borrowed (open_memory) */
        size_t map_size;
        const char *path;               /* arena copy */
        uint64_t data_offset;
        tsr_safetensors_tensor *tensors;
        size_t n_tensors;
        const tsr_safetensors_tensor **sorted;  /* by name, for binary search */
        struct st_meta *meta;
        size_t n_meta;
        tsr_arena *arena;
};

static const struct {
        const char *name;
        uint32_t bits;
} st_dtypes[TSR_ST_N_DTYPES] = {
        [TSR_ST_BOOL] = {"BOOL", 8},
        [TSR_ST_U8] = {"U8", 8},
        [TSR_ST_I8] = {"I8", 8},
        [TSR_ST_F8_E5M2] = {"F8_E5M2", 8},
        [TSR_ST_F8_E4M3] = {"F8_E4M3", 8},
        [TSR_ST_F8_E8M0] = {"F8_E8M0", 8},
        [TSR_ST_F4] = {"F4", 4},
        [TSR_ST_F6_E2M3] = {"F6_E2M3", 6},
        [TSR_ST_F6_E3M2] = {"F6_E3M2", 6},
        [TSR_ST_I16] = {"I16", 16},
        [TSR_ST_U16] = {"U16", 16},
        [TSR_ST_F16] = {"F16", 16},
        [TSR_ST_BF16] = {"BF16", 16},
        [TSR_ST_I32] = {"I32", 32},
        [TSR_ST_U32] = {"U32", 32},
        [TSR_ST_F32] = {"F32", 32},
        [TSR_ST_I64] = {"I64", 64},
        [TSR_ST_U64] = {"U64", 64},
        [TSR_ST_F64] = {"F64", 64},
        [TSR_ST_C64] = {"C64", 64},
};

const char *tsr_safetensors_dtype_name(tsr_safetensors_dtype d) {
        return (unsigned)d < TSR_ST_N_DTYPES ? st_dtypes[d].name : "?";
}

uint32_t tsr_safetensors_dtype_bits(tsr_safetensors_dtype d) {
        return (unsigned)d < TSR_ST_N_DTYPES ? st_dtypes[d].bits : 0;
}

static tsr_status st_fail(const char *file, char *err, size_t errlen, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 5, 6)));
static tsr_status st_fail(const char *file, char *err, size_t errlen, tsr_status st, const char *fmt, ...) {
        va_list ap;
        int n;

        if (!err || errlen == 0)
                return st;
        n = snprintf(err, errlen, "%s: ", file);
        if (n < 0 || (size_t)n >= errlen)
                return st;
        va_start(ap, fmt);
        vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
        va_end(ap);
        return st;
}

/* Map a regular file read-only.  A zero-byte file gives *map NULL and *size 0. */
static tsr_status map_file(const char *path, void **map, size_t *size, char *err, size_t errlen) {
        struct stat sb;
        tsr_status st = TSR_OK;
        int fd = open(path, O_RDONLY | O_CLOEXEC);

        if (fd < 0)
                return st_fail(path, err, errlen, errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO, "%s", strerror(errno));
        *map = NULL;
        *size = 0;
        if (fstat(fd, &sb) != 0) {
                st = st_fail(path, err, errlen, TSR_E_IO, "%s", strerror(errno));
        } else if (!S_ISREG(sb.st_mode)) {
                st = st_fail(path, err, errlen, TSR_E_INVAL, "not a regular file");
        } else if (sb.st_size > 0) {
                /* Private and read-only: weights are never written through the map. */
                void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
                if (p == MAP_FAILED) {
                        st = st_fail(path, err, errlen, TSR_E_IO, "mmap: %s", strerror(errno));
                } else {
                        *map = p;
                        *size = (size_t)sb.st_size;
                }
        }
        close(fd);
        return st;
}

static void st_free(tsr_safetensors *f) {
        if (!f)
                return;
        if (f->map)
                munmap(f->map, f->map_size);
        tsr_arena_free(&f->arena);
        free(f);
}

static tsr_status parse_dtype(const char *s, tsr_safetensors_dtype *ret) {
        for (unsigned i = 0; i < TSR_ST_N_DTYPES; i++) {
                if (strcmp(s, st_dtypes[i].name) == 0) {
                        *ret = (tsr_safetensors_dtype)i;
                        return TSR_OK;
                }
        }
        return TSR_E_INVAL;
}

/* A JSON integer in 0 .. INT64_MAX (jansson refuses larger ones at parse time). */
static bool json_u64(json_t *v, uint64_t *ret) {
        if (!json_is_integer(v) || json_integer_value(v) < 0)
                return false;
        *ret = (uint64_t)json_integer_value(v);
        return true;
}

/* Fill `t` from the header entry `v` of tensor `name`; checks everything that does not
 * depend on the other tensors. */
static tsr_status parse_entry(const tsr_safetensors *f, const char *name, json_t *v, uint64_t data_len,
                              tsr_safetensors_tensor *t, char *err, size_t errlen) {
        json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
        json_t *offs = json_object_get(v, "data_offsets"), *x;
        uint64_t n = 1, begin, end, bits, bytes;
        bool zero = false;
        const char *key;
        size_t i;

        if (!json_is_object(v))
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': entry is not an object", name);
        json_object_foreach(v, key, x) {
                if (strcmp(key, "dtype") != 0 && strcmp(key, "shape") != 0 && strcmp(key, "data_offsets") != 0)
                        return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': unknown field '%.100s'",
                                       name, key);
        }
        if (!json_is_string(dt))
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': 'dtype' missing or not a string",
                               name);
        if (parse_dtype(json_string_value(dt), &t->dtype) != TSR_OK)
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': unknown dtype '%.40s'", name,
                               json_string_value(dt));
        if (!json_is_array(shape))
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': 'shape' missing or not an array",
                               name);
        if (json_array_size(shape) > TSR_SAFETENSORS_MAX_DIMS)
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': %zu dims, more than %d", name,
                               json_array_size(shape), TSR_SAFETENSORS_MAX_DIMS);
        t->n_dims = (uint32_t)json_array_size(shape);
        for (i = 0; i < t->n_dims; i++) {
                if (!json_u64(json_array_get(shape, i), &t->shape[i]))
                        return st_fail(f->path, err, errlen, TSR_E_INVAL,
                                       "tensor '%.200s': shape[%zu] is not a non-negative integer", name, i);
                if (t->shape[i] == 0)
                        zero = true;
        }
        for (; i < TSR_SAFETENSORS_MAX_DIMS; i++)
                t->shape[i] = 1;
        /* The element count times the bits per element must fit in 64 bits; a zero dim
         * makes the product 0 whatever the other dims are. */
        bits = st_dtypes[t->dtype].bits;
        if (zero) {
                n = 0;
        } else {
                for (i = 0; i < t->n_dims; i++) {
                        if (t->shape[i] > (UINT64_MAX / 64) / n)
                                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                                               "tensor '%.200s': shape's element count overflows", name);
                        n *= t->shape[i];
                }
        }
        if ((n * bits) % 8 != 0)
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "tensor '%.200s': %llu elements of %s are not a whole number of bytes", name,
                               (unsigned long long)n, st_dtypes[t->dtype].name);
        bytes = n * bits / 8;
        if (!json_is_array(offs) || json_array_size(offs) != 2 || !json_u64(json_array_get(offs, 0), &begin) ||
            !json_u64(json_array_get(offs, 1), &end))
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "tensor '%.200s': 'data_offsets' must be two non-negative integers", name);
        if (begin > end)
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "tensor '%.200s': data_offsets [%llu, %llu] decrease",
                               name, (unsigned long long)begin, (unsigned long long)end);
        if (end > data_len)
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "tensor '%.200s': data_offsets [%llu, %llu] run past the %llu-byte data section", name,
                               (unsigned long long)begin, (unsigned long long)end, (unsigned long long)data_len);
        if (end - begin != bytes)
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "tensor '%.200s': data_offsets [%llu, %llu] hold %llu bytes, but %s shape of %llu "
                               "elements needs %llu",
                               name, (unsigned long long)begin, (unsigned long long)end,
                               (unsigned long long)(end - begin), st_dtypes[t->dtype].name, (unsigned long long)n,
                               (unsigned long long)bytes);
        t->n_elements = n;
        t->n_bytes = bytes;
        t->offset = begin;
        t->data = bytes ? f->base + f->data_offset + begin : NULL;
        return TSR_OK;
}

static int cmp_offset(const void *a, const void *b) {
        const tsr_safetensors_tensor *x = *(const tsr_safetensors_tensor *const *)a;
        const tsr_safetensors_tensor *y = *(const tsr_safetensors_tensor *const *)b;
        /* Zero-byte tensors sort before a tensor starting at the same offset. */
        if (x->offset != y->offset)
                return x->offset < y->offset ? -1 : 1;
        return (x->n_bytes > y->n_bytes) - (x->n_bytes < y->n_bytes);
}

static int cmp_name(const void *a, const void *b) {
        return strcmp((*(const tsr_safetensors_tensor *const *)a)->name,
                      (*(const tsr_safetensors_tensor *const *)b)->name);
}

/* The tensors must tile the data section: sorted by offset, each starts where the one
 * before ended, the first at 0, the last ending at the end of the file. */
static tsr_status check_tiling(tsr_safetensors *f, uint64_t data_len, char *err, size_t errlen) {
        const tsr_safetensors_tensor **by_off = NULL;
        uint64_t at = 0;
        tsr_status st = TSR_OK;

        if (f->n_tensors) {
                by_off = malloc(f->n_tensors * sizeof *by_off);
                if (!by_off)
                        return st_fail(f->path, err, errlen, TSR_E_NOMEM, "out of memory");
                for (size_t i = 0; i < f->n_tensors; i++)
                        by_off[i] = &f->tensors[i];
                qsort(by_off, f->n_tensors, sizeof *by_off, cmp_offset);
        }
        for (size_t i = 0; i < f->n_tensors && st == TSR_OK; i++) {
                const tsr_safetensors_tensor *t = by_off[i];
                if (t->offset < at)
                        st = st_fail(f->path, err, errlen, TSR_E_INVAL,
                                     "tensor '%.200s': data at [%llu, %llu) overlaps tensor '%.200s'", t->name,
                                     (unsigned long long)t->offset, (unsigned long long)(t->offset + t->n_bytes),
                                     by_off[i - 1]->name);
                else if (t->offset > at)
                        st = st_fail(f->path, err, errlen, TSR_E_INVAL,
                                     "tensor '%.200s': %llu unused bytes before its data at offset %llu (tensors "
                                     "must tile the data section)",
                                     t->name, (unsigned long long)(t->offset - at), (unsigned long long)t->offset);
                else
                        at = t->offset + t->n_bytes;
        }
        if (st == TSR_OK && at != data_len)
                st = st_fail(f->path, err, errlen, TSR_E_INVAL,
                             "%llu bytes after the last tensor's data (the data section is %llu bytes, tensors "
                             "cover %llu)",
                             (unsigned long long)(data_len - at), (unsigned long long)data_len,
                             (unsigned long long)at);
        free(by_off);
        return st;
}

static tsr_status parse_metadata(tsr_safetensors *f, json_t *md, char *err, size_t errlen) {
        const char *key;
        json_t *v;
        size_t i = 0;

        if (!json_is_object(md))
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "'__metadata__' is not an object");
        f->meta = tsr_arena_calloc(f->arena, json_object_size(md) + 1, sizeof *f->meta);
        if (!f->meta)
                return st_fail(f->path, err, errlen, TSR_E_NOMEM, "out of memory");
        json_object_foreach(md, key, v) {
                if (!json_is_string(v))
                        return st_fail(f->path, err, errlen, TSR_E_INVAL,
                                       "'__metadata__' entry '%.100s' is not a string", key);
                f->meta[i].key = tsr_arena_strdup(f->arena, key);
                f->meta[i].value = tsr_arena_strndup(f->arena, json_string_value(v), json_string_length(v));
                if (!f->meta[i].key || !f->meta[i].value)
                        return st_fail(f->path, err, errlen, TSR_E_NOMEM, "out of memory");
                i++;
        }
        f->n_meta = i;
        return TSR_OK;
}

static tsr_status parse_header(tsr_safetensors *f, char *err, size_t errlen) {
        uint64_t hlen = 0, data_len;
        json_error_t je;
        json_t *root = NULL, *v;
        const char *key;
        size_t n = 0;
        tsr_status st = TSR_OK;

        if (f->size < 8)
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "file is %zu bytes, shorter than the 8-byte header length", f->size);
        for (int i = 7; i >= 0; i--)
                hlen = hlen << 8 | f->base[i];
        if (hlen > TSR_SAFETENSORS_MAX_HEADER)
                return st_fail(f->path, err, errlen, TSR_E_LIMIT, "header length %llu is over the %u-byte limit",
                               (unsigned long long)hlen, TSR_SAFETENSORS_MAX_HEADER);
        if (hlen > f->size - 8)
                return st_fail(f->path, err, errlen, TSR_E_INVAL,
                               "header length %llu runs past the end of the file (%zu bytes follow the length)",
                               (unsigned long long)hlen, f->size - 8);
        f->data_offset = 8 + hlen;
        data_len = f->size - f->data_offset;
        root = json_loadb((const char *)f->base + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
        if (!root)
                return st_fail(f->path, err, errlen, TSR_E_INVAL, "header: invalid JSON at line %d column %d: %s",
                               je.line, je.column, je.text);
        if (!json_is_object(root)) {
                st = st_fail(f->path, err, errlen, TSR_E_INVAL, "header: not a JSON object");
                goto done;
        }
        f->tensors = tsr_arena_calloc(f->arena, json_object_size(root) + 1, sizeof *f->tensors);
        f->sorted = tsr_arena_calloc(f->arena, json_object_size(root) + 1, sizeof *f->sorted);
        if (!f->tensors || !f->sorted) {
                st = st_fail(f->path, err, errlen, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        json_object_foreach(root, key, v) {
                if (strcmp(key, "__metadata__") == 0) {
                        if ((st = parse_metadata(f, v, err, errlen)) != TSR_OK)
                                goto done;
                        continue;
                }
                tsr_safetensors_tensor *t = &f->tensors[n];
                if ((st = parse_entry(f, key, v, data_len, t, err, errlen)) != TSR_OK)
                        goto done;
                if (!(t->name = tsr_arena_strdup(f->arena, key))) {
                        st = st_fail(f->path, err, errlen, TSR_E_NOMEM, "out of memory");
                        goto done;
                }
                f->sorted[n] = t;
                n++;
        }
        f->n_tensors = n;
        /* jansson already refused duplicate keys; sorting is for lookups. */
        qsort(f->sorted, n, sizeof *f->sorted, cmp_name);
        st = check_tiling(f, data_len, err, errlen);
done:
        json_decref(root);
        return st;
}

static tsr_status st_parse(const uint8_t *p, size_t len, const char *path, tsr_safetensors **ret, char *err,
                           size_t errlen) {
        tsr_safetensors *f = calloc(1, sizeof *f);
        tsr_status st;

        if (f)
                f->arena = tsr_arena_new(16 * 1024, 0);
        if (!f || !f->arena || !(f->path = tsr_arena_strdup(f->arena, path))) {
                st_free(f);
                return st_fail(path, err, errlen, TSR_E_NOMEM, "out of memory");
        }
        f->base = p;
        f->size = len;
        if ((st = parse_header(f, err, errlen)) != TSR_OK) {
                st_free(f);
                return st;
        }
        *ret = f;
        return TSR_OK;
}

tsr_status tsr_safetensors_open_memory(const void *data, size_t len, tsr_safetensors **ret, char *err,
                                       size_t errlen) {
        if ((!data && len) || !ret)
                return TSR_E_INVAL;
        return st_parse(data, len, "<memory>", ret, err, errlen);
}

tsr_status tsr_safetensors_open(const char *path, tsr_safetensors **ret, char *err, size_t errlen) {
        void *map = NULL;
        size_t size = 0;
        tsr_safetensors *f = NULL;
        tsr_status st;

        if (!path || !ret)
                return TSR_E_INVAL;
        if ((st = map_file(path, &map, &size, err, errlen)) != TSR_OK)
                return st;
        if ((st = st_parse(map, size, path, &f, err, errlen)) != TSR_OK) {
                if (map)
                        munmap(map, size);
                return st;
        }
        f->map = map;                   /* owned by the tsr_safetensors from here */
        f->map_size = size;
        *ret = f;
        return TSR_OK;
}

void tsr_safetensors_close(tsr_safetensors **f) {
        if (!f || !*f)
                return;
        st_free(*f);
        *f = NULL;
}

const char *tsr_safetensors_path(const tsr_safetensors *f) { return f->path; }
size_t tsr_safetensors_file_size(const tsr_safetensors *f) { return f->size; }
uint64_t tsr_safetensors_data_offset(const tsr_safetensors *f) { return f->data_offset; }
size_t tsr_safetensors_n_tensors(const tsr_safetensors *f) { return f->n_tensors; }

const tsr_safetensors_tensor *tsr_safetensors_tensor_at(const tsr_safetensors *f, size_t i) {
        return i < f->n_tensors ? &f->tensors[i] : NULL;
}

const tsr_safetensors_tensor *tsr_safetensors_find(const tsr_safetensors *f, const char *name) {
        size_t lo = 0, hi = f->n_tensors;

        if (!name)
                return NULL;
        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                int c = strcmp(f->sorted[mid]->name, name);
                if (c == 0)
                        return f->sorted[mid];
                if (c < 0)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return NULL;
}

size_t tsr_safetensors_n_metadata(const tsr_safetensors *f) { return f->n_meta; }

tsr_status tsr_safetensors_metadata_at(const tsr_safetensors *f, size_t i, const char **key, const char **value) {
        if (i >= f->n_meta)
                return TSR_E_NOTFOUND;
        if (key)
                *key = f->meta[i].key;
        if (value)
                *value = f->meta[i].value;
        return TSR_OK;
}

const char *tsr_safetensors_metadata(const tsr_safetensors *f, const char *key) {
        for (size_t i = 0; key && i < f->n_meta; i++)
                if (strcmp(f->meta[i].key, key) == 0)
                        return f->meta[i].value;
        return NULL;
}

/* ---- sets ------------------------------------------------------------------------ */

struct set_entry {
        const char *name;               /* the tensor's own name (owned by its file) */
        size_t file;
        const tsr_safetensors_tensor *t;
};

struct tsr_safetensors_set {
        tsr_safetensors **files;
        size_t n_files;
        struct set_entry *entries;      /* with an index: sorted by name; else NULL */
        size_t n_entries;
        char *source;                   /* the index's path or model.safetensors's */
};

static char *path_join(const char *dir, const char *name) {
        size_t n = strlen(dir) + 1 + strlen(name) + 1;
        char *p = malloc(n);
        if (p)
                snprintf(p, n, "%s/%s", dir, name);
        return p;
}

static int cmp_entry(const void *a, const void *b) {
        return strcmp(((const struct set_entry *)a)->name, ((const struct set_entry *)b)->name);
}

void tsr_safetensors_set_close(tsr_safetensors_set **sp) {
        tsr_safetensors_set *s;

        if (!sp || !*sp)
                return;
        s = *sp;
        for (size_t i = 0; i < s->n_files; i++)
                tsr_safetensors_close(&s->files[i]);
        free(s->files);
        free(s->entries);
        free(s->source);
        free(s);
        *sp = NULL;
}

/* A weight_map value must name a file directly inside the folder. */
static bool plain_file_name(const char *s) {
        return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static tsr_status open_indexed(tsr_safetensors_set *s, const char *dir, const char *ipath, const uint8_t *buf,
                               size_t len, char *err, size_t errlen) {
        json_error_t je;
        json_t *root, *wm, *v;
        const char **names = NULL;      /* file names in first-seen order, borrowed from root */
        const char *key;
        size_t n_names = 0, k = 0;
        tsr_status st = TSR_OK;

        if (len > TSR_SAFETENSORS_MAX_INDEX)
                return st_fail(ipath, err, errlen, TSR_E_LIMIT, "file is %zu bytes, over the %u-byte limit", len,
                               TSR_SAFETENSORS_MAX_INDEX);
        root = json_loadb((const char *)buf, len, JSON_REJECT_DUPLICATES, &je);
        if (!root)
                return st_fail(ipath, err, errlen, TSR_E_INVAL, "invalid JSON at line %d column %d: %s", je.line,
                               je.column, je.text);
        wm = json_object_get(root, "weight_map");
        if (!json_is_object(root) || !json_is_object(wm) || json_object_size(wm) == 0) {
                st = st_fail(ipath, err, errlen, TSR_E_INVAL, "'weight_map' missing, empty or not an object");
                goto done;
        }
        names = calloc(json_object_size(wm), sizeof *names);
        s->files = calloc(json_object_size(wm), sizeof *s->files);
        s->entries = calloc(json_object_size(wm), sizeof *s->entries);
        if (!names || !s->files || !s->entries) {
                st = st_fail(ipath, err, errlen, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        /* Open each file once, in the order the map first names it. */
        json_object_foreach(wm, key, v) {
                size_t f;
                if (!json_is_string(v) || !plain_file_name(json_string_value(v)) ||
                    strlen(json_string_value(v)) != json_string_length(v)) {
                        st = st_fail(ipath, err, errlen, TSR_E_INVAL,
                                     "weight_map['%.200s']: not the name of a file in the folder", key);
                        goto done;
                }
                for (f = 0; f < n_names; f++)
                        if (strcmp(names[f], json_string_value(v)) == 0)
                                break;
                if (f == n_names) {
                        char *p = path_join(dir, json_string_value(v));
                        if (!p) {
                                st = st_fail(ipath, err, errlen, TSR_E_NOMEM, "out of memory");
                                goto done;
                        }
                        st = tsr_safetensors_open(p, &s->files[s->n_files], err, errlen);
                        free(p);
                        if (st != TSR_OK)
                                goto done;
                        names[n_names++] = json_string_value(v);
                        s->n_files++;
                }
                const tsr_safetensors_tensor *t = tsr_safetensors_find(s->files[f], key);
                if (!t) {
                        st = st_fail(tsr_safetensors_path(s->files[f]), err, errlen, TSR_E_NOTFOUND,
                                     "tensor '%.200s' missing (%s maps it to this file)", key, ST_INDEX_NAME);
                        goto done;
                }
                s->entries[k++] = (struct set_entry){.name = t->name, .file = f, .t = t};
        }
        s->n_entries = k;
        qsort(s->entries, k, sizeof *s->entries, cmp_entry);
done:
        free(names);
        json_decref(root);
        return st;
}

tsr_status tsr_safetensors_set_open(const char *dir, tsr_safetensors_set **ret, char *err, size_t errlen) {
        tsr_safetensors_set *s;
        char *ipath = NULL, *spath = NULL;
        void *map = NULL;
        size_t size = 0;
        tsr_status st;

        if (!dir || !ret)
                return TSR_E_INVAL;
        s = calloc(1, sizeof *s);
        ipath = path_join(dir, ST_INDEX_NAME);
        spath = path_join(dir, ST_SINGLE_NAME);
        if (!s || !ipath || !spath) {
                st = st_fail(dir, err, errlen, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        st = map_file(ipath, &map, &size, err, errlen);
        if (st == TSR_OK) {
                st = open_indexed(s, dir, ipath, map, size, err, errlen);
                if (map)
                        munmap(map, size);
        } else if (st == TSR_E_NOTFOUND) {
                s->files = calloc(1, sizeof *s->files);
                if (!s->files) {
                        st = st_fail(dir, err, errlen, TSR_E_NOMEM, "out of memory");
                        goto done;
                }
                st = tsr_safetensors_open(spath, &s->files[0], err, errlen);
                if (st == TSR_OK)
                        s->n_files = 1;
                else if (st == TSR_E_NOTFOUND)
                        st_fail(dir, err, errlen, st, "no %s or %s", ST_INDEX_NAME, ST_SINGLE_NAME);
        }
        if (st == TSR_OK) {
                s->source = s->entries ? ipath : spath;
                if (s->entries)
                        ipath = NULL;
                else
                        spath = NULL;
        }
done:
        free(ipath);
        free(spath);
        if (st != TSR_OK) {
                tsr_safetensors_set_close(&s);
                return st;
        }
        *ret = s;
        return TSR_OK;
}

const char *tsr_safetensors_set_source(const tsr_safetensors_set *s) { return s->source; }
size_t tsr_safetensors_set_n_files(const tsr_safetensors_set *s) { return s->n_files; }

const tsr_safetensors *tsr_safetensors_set_file(const tsr_safetensors_set *s, size_t i) {
        return i < s->n_files ? s->files[i] : NULL;
}

const tsr_safetensors_tensor *tsr_safetensors_set_find(const tsr_safetensors_set *s, const char *name,
                                                       const char **file) {
        if (!name)
                return NULL;
        if (!s->entries) {
                const tsr_safetensors_tensor *t = s->n_files ? tsr_safetensors_find(s->files[0], name) : NULL;
                if (t && file)
                        *file = tsr_safetensors_path(s->files[0]);
                return t;
        }
        struct set_entry key = {.name = name};
        const struct set_entry *e = bsearch(&key, s->entries, s->n_entries, sizeof key, cmp_entry);
        if (!e)
                return NULL;
        if (file)
                *file = tsr_safetensors_path(s->files[e->file]);
        return e->t;
}

size_t tsr_safetensors_set_n_tensors(const tsr_safetensors_set *s) {
        return s->entries ? s->n_entries : s->n_files ? tsr_safetensors_n_tensors(s->files[0]) : 0;
}

const tsr_safetensors_tensor *tsr_safetensors_set_tensor_at(const tsr_safetensors_set *s, size_t i,
                                                            const char **file) {
        if (i >= tsr_safetensors_set_n_tensors(s))
                return NULL;
        if (!s->entries) {
                if (file)
                        *file = tsr_safetensors_path(s->files[0]);
                return tsr_safetensors_tensor_at(s->files[0], i);
        }
        if (file)
                *file = tsr_safetensors_path(s->files[s->entries[i].file]);
        return s->entries[i].t;
}
