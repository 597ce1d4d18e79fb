/* modelopt.h - NVIDIA ModelOpt quantized checkpoints (FP8, NVFP4; models.md §4): which
 * quantization a Hugging Face folder announces, whether --quantization agrees with it,
 * and one quantized linear weight read with its scales into a tensor the CPU matmul
 * computes on (kernels.h tsr_backend_matmul_scaled).
 *
 * Detection as vLLM: config.json "quantization_config" (ModelOpt >= 0.31: quant_method
 * "modelopt", quant_algo, ignore, kv_cache_scheme, group_size) or, when config.json has
 * none, the legacy hf_quant_config.json ("quantization": quant_algo,
 * kv_cache_quant_algo, exclude_modules, group_size).  quant_algo FP8 (per-tensor W8A8,
 * static activation scale) or NVFP4 (group_size 16); anything else is refused with what
 * is supported.  Whether a module is quantized is decided by its tensors (dtype and the
 * scales present), the exclude list only cross-checks it (tsr_modelopt_excluded).
 *
 * Tensors of a quantized linear X (the checkpoint's names and dtypes):
 *   FP8    X.weight F8_E4M3 [out, in], X.weight_scale F32 scalar, X.input_scale F32 scalar
 *   NVFP4  X.weight U8 [out, in/2] (element 2k low nibble of byte k), X.weight_scale F8_E4M3
 *          [out, in/16], X.weight_scale_2 F32 scalar, X.input_scale F32 scalar
 * A scalar is shape [] or [1].  In memory FP8 keeps the file's bytes; NVFP4 is the same
 * bytes regrouped into dtype.h's 9-byte blocks (each block's scale byte before its eight
 * code bytes, so one pointer walks a row), never widened.
 *
 * Non-logging: statuses and messages naming the file and the tensor or field.  Reading
 * is blocking file I/O (the main thread, at start-up); the results are plain data. */
#ifndef TSR_WORKER_LOAD_MODELOPT_H
#define TSR_WORKER_LOAD_MODELOPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/tensor.h"
#include "worker/load/safetensors.h"

typedef enum tsr_modelopt_algo {
        TSR_MODELOPT_NONE = 0,          /* no quantization announced */
        TSR_MODELOPT_FP8,
        TSR_MODELOPT_NVFP4,
} tsr_modelopt_algo;

typedef struct tsr_modelopt_config {
        tsr_modelopt_algo algo;
        bool kv_cache_fp8;              /* kv_cache_quant_algo "FP8" / kv_cache_scheme float 8 bits */
        uint32_t group_size;            /* NVFP4: 16 (the only one); FP8: 0 */
        char source[512];               /* the file the config came from */
        char **exclude;                 /* exclude_modules / ignore, [n_exclude] */
        size_t n_exclude;
} tsr_modelopt_config;

/* Read what the folder `dir` announces into *ret (algo NONE, TSR_OK, when it announces no
 * quantization).  TSR_E_UNSUPPORTED: another quant_method or quant_algo, an NVFP4 group
 * size other than 16 (the message names the file, the field and what is supported);
 * TSR_E_INVAL: malformed JSON or field; TSR_E_IO, TSR_E_LIMIT, TSR_E_NOMEM.  *ret is
 * cleared first; free with tsr_modelopt_config_done. */
tsr_status tsr_modelopt_config_read(const char *dir, tsr_modelopt_config *ret, char *err, size_t errlen);
/* Free the exclude list; accepts NULL; leaves *c zeroed. */
void tsr_modelopt_config_done(tsr_modelopt_config *c);

/* "FP8", "NVFP4", "none". */
const char *tsr_modelopt_algo_name(tsr_modelopt_algo a);
/* vLLM's --quantization name of the method: "modelopt" (FP8), "modelopt_fp4" (NVFP4). */
const char *tsr_modelopt_method(tsr_modelopt_algo a);

/* The --quantization values Tessera implements (common/config.c refuses the others). */
#define TSR_MODELOPT_FLAG_VALUES "modelopt, modelopt_fp4, fp8"

/* Whether --quantization `flag` (NULL: not given, always agrees) agrees with the
 * checkpoint: modelopt with FP8, modelopt_fp4 with NVFP4, fp8 with FP8 (the same
 * per-tensor e4m3 W8A8 format).  TSR_E_INVAL with a message naming the flag, the value,
 * the checkpoint's algorithm and its file otherwise (a flag with an unquantized
 * checkpoint included: online quantization is not implemented). */
tsr_status tsr_modelopt_check_flag(const tsr_modelopt_config *c, const char *flag, const char *dir, char *err,
                                   size_t errlen);

/* vLLM's is_layer_excluded: `module` (a tensor name without ".weight") matches an entry
 * exactly, contains it as a substring, or matches it as an fnmatch wildcard; a name
 * with a "language_model." prefix is also tried without it. */
bool tsr_modelopt_excluded(const tsr_modelopt_config *c, const char *module);
/* The exclude entries that match no tensor of `set` (as vLLM warns about them): up to
 * `cap` of them into out[]; returns how many there are. */
size_t tsr_modelopt_unmatched_excludes(const tsr_modelopt_config *c, const tsr_safetensors_set *set,
                                       const char **out, size_t cap);

/* True when a safetensors dtype is one a ModelOpt weight is stored in (F8_E4M3, U8). */
bool tsr_modelopt_weight_dtype(tsr_safetensors_dtype d);

/* Read the quantized linear `module` (its .weight, found as `weight` in `file`, and its
 * scale tensors from `set`) of logical shape (rows, cols) into *ret: new 64-byte aligned
 * memory (free(ret->data)), dtype fp8_e4m3 or nvfp4, shape (rows, cols), scales set.
 * Errors (the message names the file and the tensor): TSR_E_INVAL for a weight whose
 * dtype the config does not announce, a missing or misshapen scale, a scale that is not
 * a finite positive number, an NVFP4 block size other than 16 (read off the scale's
 * shape), a module the exclude list names; TSR_E_NOMEM. */
tsr_status tsr_modelopt_load_weight(const tsr_modelopt_config *c, const tsr_safetensors_set *set, const char *module,
                                    const tsr_safetensors_tensor *weight, const char *file, uint64_t rows,
                                    uint64_t cols, tsr_tensor *ret, char *err, size_t errlen);

/* The F32 scalar "<module>.input_scale" (a quantized linear's static activation scale)
 * into *ret, without its weight: an expert-parallel rank of an NVFP4 checkpoint reads
 * the other ranks' experts' (vLLM's global-scale NVFP4 MoE keeps every expert's).
 * TSR_E_INVAL (the message names the file and the tensor) when it is missing or not a
 * finite positive F32 scalar. */
tsr_status tsr_modelopt_input_scale(const tsr_safetensors_set *set, const char *module, float *ret, char *err,
                                    size_t errlen);

/* A quantized MoE expert stack in transformers' BMM layout (models.md §4.2: Llama 4's
 * FP8 `experts.gate_up_proj` / `experts.down_proj`, F8_E4M3 [experts, rows, cols] with
 * the F32 scalars "<name>_weight_scale" and "<name>_input_scale" shared by every expert,
 * as ModelOpt's one quantizer per 3-D weight writes them) into *ret: the bytes as stored
 * in new 64-byte aligned memory (free(ret->data)), a 3-D fp8_e4m3 tensor, scales set.
 * TSR_E_UNSUPPORTED for an NVFP4 stack (its block-scale layout is unverified: the
 * per-expert export is read instead); TSR_E_INVAL and TSR_E_NOMEM as
 * tsr_modelopt_load_weight. */
tsr_status tsr_modelopt_load_stack(const tsr_modelopt_config *c, const tsr_safetensors_set *set, const char *name,
                                   const tsr_safetensors_tensor *weight, const char *file, uint64_t experts,
                                   uint64_t rows, uint64_t cols, tsr_tensor *ret, char *err, size_t errlen);

/* The FP8 KV cache scales (models.md §4.5) of layers first .. first + n - 1: the F32
 * scalars "<layer>.k_proj.k_scale" and "<layer>.v_proj.v_scale" (ModelOpt), else
 * "<layer>.k_scale" / "<layer>.v_scale", else one "<layer>.kv_scale" (vLLM's deprecated
 * form) or "<layer>.kv_cache_scaling_factor" for both, where <layer> is layer_fmt (e.g.
 * "model.layers.%u.self_attn") with the layer number.  As vLLM's BaseKVCacheMethod: a
 * layer with both uses them, a layer with one uses it for K and V, a layer with neither
 * keeps what k_scale[i] / v_scale[i] hold (the caller's 1.0).
 * *n_found: the layers that had at least one.  TSR_E_INVAL (the message names the file
 * and the tensor) for a scale that is not a finite positive F32 scalar. */
tsr_status tsr_modelopt_kv_scales(const tsr_safetensors_set *set, const char *layer_fmt, uint32_t first, uint32_t n,
                                  float *k_scale, float *v_scale, uint32_t *n_found, char *err, size_t errlen);

#endif
