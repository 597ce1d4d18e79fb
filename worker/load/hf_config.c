/* hf_config.c - config.json of a Hugging Face folder: the file and its typed fields
 * (hf_config.h). */
#include "worker/load/hf_config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

tsr_status tsr_hf_config_read(const char *dir, char *path, size_t path_len, char **buf, size_t *len, char *err,
                              size_t errlen) {
        return tsr_hf_file_read(dir, "config.json", path, path_len, buf, len, err, errlen);
}

tsr_status tsr_hf_file_read(const char *dir, const char *name, char *path, size_t path_len, char **buf, size_t *len,
                            char *err, size_t errlen) {
        struct stat sb;
        char *b = NULL;
        size_t got = 0;
        tsr_status st;
        int fd;

        if (!dir || !name || !path || !path_len || !buf || !len)
                return TSR_E_INVAL;
        if ((size_t)snprintf(path, path_len, "%s/%s", dir, name) >= path_len) {
                tsr_errf(err, errlen, "%s: path too long", dir);
                return TSR_E_INVAL;
        }
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
                tsr_errf(err, errlen, "%s: %s", path, strerror(errno));
                return errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO;
        }
        if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
                tsr_errf(err, errlen, "%s: not a readable regular file", path);
                st = TSR_E_IO;
                goto done;
        }
        if ((uint64_t)sb.st_size > TSR_HF_CONFIG_MAX_BYTES) {
                tsr_errf(err, errlen, "%s: %lld bytes, over the %u-byte limit", path, (long long)sb.st_size,
                         TSR_HF_CONFIG_MAX_BYTES);
                st = TSR_E_LIMIT;
                goto done;
        }
        if (!(b = malloc((size_t)sb.st_size + 1))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                st = TSR_E_NOMEM;
                goto done;
        }
        while (got < (size_t)sb.st_size) {
                ssize_t n = read(fd, b + got, (size_t)sb.st_size - got);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        tsr_errf(err, errlen, "%s: read failed: %s", path, n < 0 ? strerror(errno) : "file shrank");
                        st = TSR_E_IO;
                        goto done;
                }
                got += (size_t)n;
        }
        b[got] = '\0';
        *buf = b;
        *len = got;
        b = NULL;
        st = TSR_OK;
done:
        free(b);
        close(fd);
        return st;
}

/* The field, or NULL when absent or null (then: missing if required). */
static json_t *field(const char *path, json_t *obj, const char *where, const char *key, bool required,
                     tsr_status *st, char *err, size_t errlen) {
        json_t *v = json_object_get(obj, key);

        *st = TSR_OK;
        if (v && !json_is_null(v))
                return v;
        if (required) {
                tsr_errf(err, errlen, "%s: field '%s%s' missing", path, where, key);
                *st = TSR_E_INVAL;
        }
        return NULL;
}

static tsr_status u32_range(const char *path, json_t *obj, const char *key, bool required, uint32_t def, uint32_t lo,
                           uint32_t hi, uint32_t *ret, char *err, size_t errlen) {
        tsr_status st;
        json_t *v = field(path, obj, "", key, required, &st, err, errlen);

        if (!v) {
                if (st == TSR_OK)
                        *ret = def;
                return st;
        }
        if (!json_is_integer(v) || json_integer_value(v) < (json_int_t)lo || json_integer_value(v) > (json_int_t)hi) {
                tsr_errf(err, errlen, "%s: field '%s': expected an integer in %" PRIu32 "..%" PRIu32, path, key, lo, hi);
                return TSR_E_INVAL;
        }
        *ret = (uint32_t)json_integer_value(v);
        return TSR_OK;
}

tsr_status tsr_hf_u32(const char *path, json_t *obj, const char *key, bool required, uint32_t def, uint32_t *ret,
                      char *err, size_t errlen) {
        return u32_range(path, obj, key, required, def, 0, UINT32_MAX, ret, err, errlen);
}

tsr_status tsr_hf_u32_in(const char *path, json_t *obj, const char *key, uint32_t def, uint32_t lo, uint32_t hi,
                         uint32_t *ret, char *err, size_t errlen) {
        return u32_range(path, obj, key, false, def, lo, hi, ret, err, errlen);
}

tsr_status tsr_hf_f64(const char *path, json_t *obj, const char *where, const char *key, bool required, double def,
                      double *ret, char *err, size_t errlen) {
        tsr_status st;
        json_t *v = field(path, obj, where ? where : "", key, required, &st, err, errlen);

        if (!v) {
                if (st == TSR_OK)
                        *ret = def;
                return st;
        }
        if (!json_is_number(v) || !isfinite(json_number_value(v))) {
                tsr_errf(err, errlen, "%s: field '%s%s': expected a finite number", path, where ? where : "", key);
                return TSR_E_INVAL;
        }
        *ret = json_number_value(v);
        return TSR_OK;
}

tsr_status tsr_hf_f32(const char *path, json_t *obj, const char *key, double def, float *ret, char *err,
                      size_t errlen) {
        double d;
        tsr_status st = tsr_hf_f64(path, obj, "", key, false, def, &d, err, errlen);
        if (st == TSR_OK)
                *ret = (float)d;
        return st;
}

tsr_status tsr_hf_bool(const char *path, json_t *obj, const char *key, bool def, bool *ret, char *err,
                       size_t errlen) {
        tsr_status st;
        json_t *v = field(path, obj, "", key, false, &st, err, errlen);

        if (!v) {
                *ret = def;
                return TSR_OK;
        }
        if (!json_is_boolean(v)) {
                tsr_errf(err, errlen, "%s: field '%s': expected true or false", path, key);
                return TSR_E_INVAL;
        }
        *ret = json_is_true(v);
        return TSR_OK;
}
