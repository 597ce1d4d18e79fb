/* gen_config.h - the sampling defaults a worker announces in ModelInfo
 * (GenerationDefaults), from vLLM's --generation-config and --override-generation-config
 * resolved as vLLM's ModelConfig.get_diff_sampling_param does (vllm/config/model.py):
 *
 *   auto  the model's own generation_config.json (already read into tsr_model_meta);
 *   vllm  none: the router falls back to vLLM's neutral values;
 *   DIR   DIR/generation_config.json, read with model_meta's parser; none when DIR has
 *         no such file (vLLM falls back without a word too); a malformed file is an error;
 *
 * then the override's keys are laid on top, with `vllm` too, and a null value removes a
 * default (vLLM drops keys whose merged value is None).  Only vLLM's six keys count:
 * temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (the
 * default max_tokens of a request that gives none); other keys are ignored as vLLM
 * ignores them.  Non-logging, plain data; called once at startup. */
#ifndef TSR_GEN_CONFIG_H
#define TSR_GEN_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "worker/load/model_meta.h"

/* tsr_gen_defaults (model_meta.h): has_x says x is a default; a field without it is
 * left to the router's neutral value. */

/* What the override does to one key. */
typedef enum tsr_gen_action {
        TSR_GEN_KEEP = 0,       /* key absent: the loaded default stays */
        TSR_GEN_SET,            /* a value: it replaces (or adds) the default */
        TSR_GEN_CLEAR,          /* null: the default is removed */
} tsr_gen_action;

typedef struct tsr_gen_override {
        tsr_gen_action temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens;
        tsr_gen_defaults values;        /* the values of the keys whose action is SET */
} tsr_gen_override;

/* Parse --override-generation-config.  NULL means "{}".  The text must be a JSON
 * object; each of the six keys, when present, must be a number (top_k and
 * max_new_tokens an integer, max_new_tokens not negative) or null.  Returns TSR_OK, or
 * TSR_E_INVAL with a message naming the flag (and the key) in `err`. */
tsr_status tsr_gen_override_parse(const char *text, tsr_gen_override *ret, char *err, size_t errlen);

/* The defaults for --generation-config `source` ("auto", "vllm" or a folder) with
 * `ov` laid over them (ov may be NULL).  `model` is the loaded model (read for
 * "auto" only).  *ret_no_file (may be NULL) is set when source is a folder without a
 * generation_config.json.  Returns TSR_OK, or the status of
 * tsr_model_meta_load_generation_config with its message (naming the folder or the
 * file) in `err`.  Blocking file I/O for a folder. */
tsr_status tsr_gen_defaults_resolve(const char *source, const tsr_model_meta *model, const tsr_gen_override *ov,
                                    tsr_gen_defaults *ret, bool *ret_no_file, char *err, size_t errlen);

/* "temperature=0.7 top_p=0.9 ..." for the startup log ("none" when empty). */
void tsr_gen_defaults_format(const tsr_gen_defaults *d, char *buf, size_t len);

#endif
