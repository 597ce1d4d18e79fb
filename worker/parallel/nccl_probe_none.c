/* nccl_probe_none.c - nccl_probe.h in a build without NCCL: no devices, nothing to run. */
#include "worker/parallel/nccl_probe.h"

int tsr_nccl_probe_devices(void) { return 0; }

tsr_status tsr_nccl_probe_run(const tsr_nccl_probe_cfg *cfg, tsr_nccl_probe_out *out, char *err, size_t errlen) {
        (void)cfg;
        (void)out;
        tsr_errf(err, errlen, "nccl probe: this build has no NCCL (CUDA toolkit or nccl.h not found)");
        return TSR_E_UNSUPPORTED;
}
