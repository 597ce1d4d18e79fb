/* comm_nccl_none.c - the NCCL entry points of a build without the CUDA toolkit or NCCL
 * (meson did not find them, or -Dcuda=disabled): the backend is refused, clearly. */
#include "worker/parallel/comm_impl.h"

int tsr_comm_nccl_available(void) { return 0; }

tsr_status tsr_comm_nccl_unique_id(tsr_comm_nccl_id *ret, char *err, size_t errlen) {
        (void)ret;
        tsr_errf(err, errlen, "comm nccl: this build has no NCCL (CUDA toolkit or nccl.h not found)");
        return TSR_E_UNSUPPORTED;
}

tsr_status tsr_comm_nccl_new(const tsr_comm_desc *d, tsr_comm **ret, char *err, size_t errlen) {
        (void)d;
        (void)ret;
        return tsr_comm_nccl_unique_id(NULL, err, errlen);
}
