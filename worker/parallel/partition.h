/* partition.h - which layers each pipeline stage holds (issue #20), as vLLM splits them.
 *
 * vLLM's rule (vllm/distributed/utils.py get_pp_indices): every stage gets
 * n_layers / pp layers and the remainder goes one layer each to the stages just before
 * the last one (the last stage already holds the final norm and lm_head): 30 layers over
 * 4 stages are 7, 8, 8, 7.  VLLM_PP_LAYER_PARTITION="a,b,..." replaces the rule with an
 * explicit count per stage.  Pure; any thread. */
#ifndef TSR_PARALLEL_PARTITION_H
#define TSR_PARALLEL_PARTITION_H

#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

/* The layer counts of `pp` stages of a model of `n_layers` layers into counts[pp]:
 * `partition` (VLLM_PP_LAYER_PARTITION's value; NULL or "" for vLLM's rule) when given.
 * TSR_E_INVAL with one line in err (naming the value, the stage count and the layer count)
 * when pp is 0 or greater than n_layers, or the partition is not pp positive integers
 * summing to n_layers; counts is written only on success. */
tsr_status tsr_pp_partition(uint32_t n_layers, uint32_t pp, const char *partition, uint32_t *counts, char *err,
                            size_t errlen);

#endif
