/* cudagraph.h - vLLM's CUDA graph settings (--compilation-config, --enforce-eager,
 * --max-num-seqs) turned into the decode batch sizes the worker records (issue #16;
 * llama.h's tsr_llama_set_graphs runs them).
 *
 * vLLM's default list of sizes: max = min(2 x max_num_seqs, 512); 1, 2, 4, the multiples
 * of 8 below 256, then the multiples of 16 from 256 to max.  Tessera's default max is
 * also at most TSR_CUDAGRAPH_DEFAULT_MAX (32): on an H200 (session 21, SmolLM2 shape,
 * 1k/1k) graphs gave c=1 +61% and c=32 +4-7% output tok/s but c=256 -3 to -6%, because a
 * replay first walks the step's ops on the host (staging every kv op's block tables)
 * before anything is queued, where eager launches overlap that walk with the device;
 * above 32 steps run eagerly, as vLLM runs the batches past its largest size.  An
 * explicit cudagraph_capture_sizes or max_cudagraph_capture_size is taken as given.
 * Tessera keeps the sizes up to the first one that holds max_num_seqs sequences: a
 * decode step never has more, so the larger graphs would never run.  A step of n
 * sequences runs the graph of the smallest size >= n (vLLM pads its batch the same way). */
#ifndef TSR_WORKER_MODEL_CUDAGRAPH_H
#define TSR_WORKER_MODEL_CUDAGRAPH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

/* The most sizes a list may hold (vLLM's default at max_num_seqs 256 has 67). */
#define TSR_CUDAGRAPH_MAX_SIZES 512
#define TSR_CUDAGRAPH_DEFAULT_MAX 32

typedef struct tsr_cudagraph_sizes {
        uint32_t sizes[TSR_CUDAGRAPH_MAX_SIZES];        /* ascending, no repeats */
        size_t n;                                       /* 0: every step eager */
        bool compile_keys;      /* the JSON named torch.compile's level / mode: no effect here */
} tsr_cudagraph_sizes;

/* The sizes for `compilation_config` (vLLM's --compilation-config JSON object; NULL or
 * "" = {}), enforce_eager (no sizes) and max_num_seqs (> 0).  Keys read:
 * cudagraph_capture_sizes (positive integers, the list instead of the default),
 * max_cudagraph_capture_size (a positive integer: the default list's max, or the
 * largest of the given list kept), cudagraph_mode ("NONE": no sizes; "FULL",
 * "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE": whole decode steps, which is what Tessera
 * records; "PIECEWISE" refused: Tessera has no piecewise graphs); level and mode
 * (torch.compile's) accepted with no effect (ret->compile_keys).  Any other key, a
 * value of the wrong type, or text that is not a JSON object: TSR_E_INVAL with one line
 * in err naming the flag, the key and what is accepted. */
tsr_status tsr_cudagraph_sizes_for(const char *compilation_config, bool enforce_eager, uint32_t max_num_seqs,
                                   tsr_cudagraph_sizes *ret, char *err, size_t errlen);

/* sizes[0..n) sorted ascending in place, repeats and zeros dropped; returns how many are
 * left (the list of sizes both the flags and llama.h's tsr_llama_set_graphs keep). */
size_t tsr_cudagraph_sort_sizes(uint32_t *sizes, size_t n);

#endif
