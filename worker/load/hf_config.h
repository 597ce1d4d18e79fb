/* hf_config.h - a Hugging Face model folder's config.json: the file, read with a size
 * cap, and its typed fields, with errors that name the file and the field.  The model
 * families' config readers (worker/model/llama_config_hf.c, llama4_config.c,
 * nemotron_h_config.c) share it, so every family reports a bad config the same way.
 *
 * Field getters: absent or null gives `def`, or, when `required`, TSR_E_INVAL
 * "PATH: field 'KEY' missing"; a value of the wrong type or out of range is TSR_E_INVAL
 * "PATH: field 'KEY': expected ...".  *ret is written only on TSR_OK.  Pure; any thread.
 * tsr_hf_config_read does blocking file I/O (the main thread, at start-up). */
#ifndef TSR_WORKER_LOAD_HF_CONFIG_H
#define TSR_WORKER_LOAD_HF_CONFIG_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

#define TSR_HF_CONFIG_MAX_BYTES (16u << 20)

/* DIR/config.json into a malloc'd, NUL-terminated *buf of *len bytes (free() it);
 * `path` (path_len bytes) gets the file's path for messages.  TSR_E_NOTFOUND (no such
 * file), TSR_E_IO (not a regular file, read error), TSR_E_LIMIT (over
 * TSR_HF_CONFIG_MAX_BYTES), TSR_E_NOMEM, TSR_E_INVAL (NULL arguments, path too long). */
tsr_status tsr_hf_config_read(const char *dir, char *path, size_t path_len, char **buf, size_t *len, char *err,
                              size_t errlen);

/* The same for another small JSON file of the folder, DIR/NAME (hf_quant_config.json). */
tsr_status tsr_hf_file_read(const char *dir, const char *name, char *path, size_t path_len, char **buf, size_t *len,
                            char *err, size_t errlen);

/* An integer in 0..UINT32_MAX. */
tsr_status tsr_hf_u32(const char *path, json_t *obj, const char *key, bool required, uint32_t def, uint32_t *ret,
                      char *err, size_t errlen);
/* An optional integer in lo..hi. */
tsr_status tsr_hf_u32_in(const char *path, json_t *obj, const char *key, uint32_t def, uint32_t lo, uint32_t hi,
                         uint32_t *ret, char *err, size_t errlen);
/* A finite number; `where` ("" or e.g. "rope_scaling.") prefixes the key in messages,
 * for a field of a nested object. */
tsr_status tsr_hf_f64(const char *path, json_t *obj, const char *where, const char *key, bool required, double def,
                      double *ret, char *err, size_t errlen);
/* An optional finite number, as float. */
tsr_status tsr_hf_f32(const char *path, json_t *obj, const char *key, double def, float *ret, char *err,
                      size_t errlen);
/* An optional true or false. */
tsr_status tsr_hf_bool(const char *path, json_t *obj, const char *key, bool def, bool *ret, char *err,
                       size_t errlen);

#endif
