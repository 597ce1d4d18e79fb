/* partition.c - the layer split of pipeline stages (partition.h). */
#include "worker/parallel/partition.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>


tsr_status tsr_pp_partition(uint32_t n_layers, uint32_t pp, const char *partition, uint32_t *counts, char *err,
                            size_t errlen) {
        uint32_t parts[1024];
        uint64_t sum = 0;
        size_t n = 0;

        if (pp == 0 || pp > 1024) {
                tsr_errf(err, errlen, "--pipeline-parallel-size %u: expected 1 .. 1024", pp);
                return TSR_E_INVAL;
        }
        if (pp > n_layers) {
                tsr_errf(err, errlen, "--pipeline-parallel-size %u is greater than the model's %u hidden layers: "
                         "every pipeline stage needs at least one layer", pp, n_layers);
                return TSR_E_INVAL;
        }
        if (!partition || !*partition) {
                for (uint32_t i = 0; i < pp; i++)
                        parts[i] = n_layers / pp;
                /* vLLM: partitions[-i] += 1 for i in 2 .. remainder + 1 */
                for (uint32_t i = 2; i < n_layers % pp + 2; i++)
                        parts[pp - i]++;
                memcpy(counts, parts, pp * sizeof *counts);
                return TSR_OK;
        }
        for (const char *p = partition;;) {
                char *end;
                long v;
                errno = 0;
                v = strtol(p, &end, 10);
                if (end == p || errno || v < 0 || v > (long)UINT32_MAX || (*end && *end != ',') || n == 1024) {
                        tsr_errf(err, errlen, "VLLM_PP_LAYER_PARTITION=%s: expected comma-separated layer counts, "
                                 "one per pipeline stage", partition);
                        return TSR_E_INVAL;
                }
                parts[n++] = (uint32_t)v;
                sum += (uint64_t)v;
                if (!*end)
                        break;
                p = end + 1;
        }
        /* vLLM's own wording for the two mismatches, so a runbook's grep finds them. */
        if (n != pp) {
                tsr_errf(err, errlen, "VLLM_PP_LAYER_PARTITION=%s: len(partition_list)=%zu does not match "
                         "pp_size=%u.", partition, n, pp);
                return TSR_E_INVAL;
        }
        if (sum != n_layers) {
                tsr_errf(err, errlen, "VLLM_PP_LAYER_PARTITION=%s: sum(partition_list)=%llu does not match "
                         "num_hidden_layers=%u.", partition, (unsigned long long)sum, n_layers);
                return TSR_E_INVAL;
        }
        for (size_t i = 0; i < n; i++)
                if (parts[i] == 0) {
                        tsr_errf(err, errlen, "VLLM_PP_LAYER_PARTITION=%s: stage %zu has no layer: every pipeline "
                                 "stage needs at least one", partition, i);
                        return TSR_E_INVAL;
                }
        memcpy(counts, parts, pp * sizeof *counts);
        return TSR_OK;
}
