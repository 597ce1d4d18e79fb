/* cpu/ref.c - scalar reference kernels: the executable specification.
 * Never optimise this file; fast paths live elsewhere and are tested against it. */
#include <math.h>

#include "kernels/kernels.h"

static tsr_status ref_rmsnorm(float *out, const float *x, const float *w, size_t rows, size_t dim, float eps) {
        if (!out || !x || !w || dim == 0)
                return TSR_E_INVAL;
        for (size_t r = 0; r < rows; r++) {
                const float *xr = x + r * dim;
                float *outr = out + r * dim;
                /* Sum of squares in one fixed order (index 0..dim-1), in double, so the
                 * result never depends on batch size: the batch-invariance promise. */
                double ss = 0.0;
                for (size_t i = 0; i < dim; i++)
                        ss += (double)xr[i] * (double)xr[i];
                float scale = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
                for (size_t i = 0; i < dim; i++)
                        outr[i] = xr[i] * scale * w[i];
        }
        return TSR_OK;
}

static tsr_status ref_sync(void) { return TSR_OK; }

static const tsr_kernels_ops cpu_ref_ops = {
        .name = "cpu-ref",
        .rmsnorm = ref_rmsnorm,
        .sync = ref_sync,
};

const tsr_kernels_ops *tsr_kernels_cpu_ref(void) { return &cpu_ref_ops; }
