/* cudagraph.c - vLLM's CUDA graph settings to the decode batch sizes (cudagraph.h). */
#include "worker/model/cudagraph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#define FLAG "--compilation-config"

static int cmp_u32(const void *a, const void *b) {
        uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
        return x < y ? -1 : x > y;
}

size_t tsr_cudagraph_sort_sizes(uint32_t *sizes, size_t n) {
        size_t kept = 0;
        if (n)
                qsort(sizes, n, sizeof *sizes, cmp_u32);
        for (size_t i = 0; i < n; i++)
                if (sizes[i] && (kept == 0 || sizes[kept - 1] != sizes[i]))
                        sizes[kept++] = sizes[i];
        return kept;
}

/* vLLM's default list up to max (ascending). */
static void default_sizes(uint32_t max, tsr_cudagraph_sizes *ret) {
        static const uint32_t first[] = {1, 2, 4};
        ret->n = 0;
        for (size_t i = 0; i < 3; i++)
                if (first[i] <= max)
                        ret->sizes[ret->n++] = first[i];
        for (uint32_t s = 8; s < 256 && s <= max; s += 8)
                ret->sizes[ret->n++] = s;
        for (uint32_t s = 256; s <= max && ret->n < TSR_CUDAGRAPH_MAX_SIZES; s += 16)
                ret->sizes[ret->n++] = s;
}

/* A JSON integer in [1, UINT32_MAX]. */
static bool positive_u32(const json_t *v, uint32_t *out) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > (json_int_t)UINT32_MAX)
                return false;
        *out = (uint32_t)json_integer_value(v);
        return true;
}

static tsr_status parse(json_t *o, bool *none, uint32_t *max_size, tsr_cudagraph_sizes *given, bool *have_given,
                        bool *compile_keys, char *err, size_t errlen) {
        const char *key;
        json_t *v;

        json_object_foreach(o, key, v) {
                if (strcmp(key, "cudagraph_mode") == 0) {
                        const char *m = json_string_value(v);
                        if (!m) {
                                snprintf(err, errlen, FLAG ": cudagraph_mode must be a string");
                                return TSR_E_INVAL;
                        }
                        if (strcmp(m, "NONE") == 0) {
                                *none = true;
                        } else if (strcmp(m, "PIECEWISE") == 0) {
                                snprintf(err, errlen, FLAG ": cudagraph_mode PIECEWISE is not implemented: Tessera "
                                         "records whole decode steps (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) "
                                         "or none (NONE)");
                                return TSR_E_INVAL;
                        } else if (strcmp(m, "FULL") != 0 && strcmp(m, "FULL_DECODE_ONLY") != 0 &&
                                   strcmp(m, "FULL_AND_PIECEWISE") != 0) {
                                snprintf(err, errlen, FLAG ": cudagraph_mode '%s': expected NONE, FULL, "
                                         "FULL_DECODE_ONLY or FULL_AND_PIECEWISE", m);
                                return TSR_E_INVAL;
                        }
                } else if (strcmp(key, "cudagraph_capture_sizes") == 0) {
                        size_t i;
                        json_t *e;
                        if (!json_is_array(v) || json_array_size(v) > TSR_CUDAGRAPH_MAX_SIZES) {
                                snprintf(err, errlen, FLAG ": cudagraph_capture_sizes must be a list of at most %d "
                                         "positive integers", TSR_CUDAGRAPH_MAX_SIZES);
                                return TSR_E_INVAL;
                        }
                        given->n = 0;
                        json_array_foreach(v, i, e) {
                                if (!positive_u32(e, &given->sizes[given->n++])) {
                                        snprintf(err, errlen, FLAG ": cudagraph_capture_sizes[%zu] is not a positive "
                                                 "integer", i);
                                        return TSR_E_INVAL;
                                }
                        }
                        *have_given = true;
                } else if (strcmp(key, "max_cudagraph_capture_size") == 0) {
                        if (!positive_u32(v, max_size)) {
                                snprintf(err, errlen, FLAG ": max_cudagraph_capture_size must be a positive integer");
                                return TSR_E_INVAL;
                        }
                } else if (strcmp(key, "level") == 0 || strcmp(key, "mode") == 0) {
                        *compile_keys = true;   /* torch.compile's: nothing to compile in C */
                } else {
                        snprintf(err, errlen, FLAG ": key '%s' is not implemented (Tessera reads "
                                 "cudagraph_capture_sizes, max_cudagraph_capture_size and cudagraph_mode; level and "
                                 "mode have no effect)", key);
                        return TSR_E_INVAL;
                }
        }
        return TSR_OK;
}

tsr_status tsr_cudagraph_sizes_for(const char *compilation_config, bool enforce_eager, uint32_t max_num_seqs,
                                   tsr_cudagraph_sizes *ret, char *err, size_t errlen) {
        tsr_cudagraph_sizes *given;
        bool none = false, have_given = false;
        uint32_t max_size = 0;
        tsr_status st = TSR_OK;

        if (!ret || max_num_seqs == 0)
                return TSR_E_INVAL;
        memset(ret, 0, sizeof *ret);
        if (!(given = calloc(1, sizeof *given)))
                return TSR_E_NOMEM;
        if (compilation_config && *compilation_config) {
                json_error_t je;
                json_t *o = json_loads(compilation_config, JSON_REJECT_DUPLICATES, &je);
                if (!json_is_object(o)) {
                        snprintf(err, errlen, FLAG ": expected a JSON object such as '{\"cudagraph_capture_sizes\": "
                                 "[1, 2, 4, 8]}'%s%s", o ? "" : ": ", o ? "" : je.text);
                        st = TSR_E_INVAL;
                } else {
                        st = parse(o, &none, &max_size, given, &have_given, &ret->compile_keys, err, errlen);
                }
                json_decref(o);
        }
        if (st == TSR_OK && !none && !enforce_eager) {
                if (have_given) {
                        ret->n = 0;
                        given->n = tsr_cudagraph_sort_sizes(given->sizes, given->n);
                        for (size_t i = 0; i < given->n; i++)
                                if (!max_size || given->sizes[i] <= max_size)
                                        ret->sizes[ret->n++] = given->sizes[i];
                } else {
                        uint64_t twice = 2 * (uint64_t)max_num_seqs;
                        uint32_t vllm = twice < 512 ? (uint32_t)twice : 512;
                        default_sizes(max_size ? max_size
                                               : vllm < TSR_CUDAGRAPH_DEFAULT_MAX ? vllm : TSR_CUDAGRAPH_DEFAULT_MAX,
                                      ret);
                }
                /* the sizes past the first that holds max_num_seqs never run */
                for (size_t i = 0; i < ret->n; i++)
                        if (ret->sizes[i] >= max_num_seqs) {
                                ret->n = i + 1;
                                break;
                        }
        }
        free(given);
        return st;
}
