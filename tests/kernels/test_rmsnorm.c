/* CUDA rmsnorm against the CPU reference over a shape table with odd sizes.
 * Device memory through the backend (tsr_backend_mem_alloc, upload, download).
 * Exit 77 (meson: skipped) when there is no CUDA device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/kernels.h"

static const struct { size_t rows, dim; } shapes[] = {
        {1, 1}, {1, 3}, {3, 127}, {7, 64}, {2, 128}, {1, 4097}, {17, 576}, {5, 8192},
};

static float frand(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

/* n floats of device memory holding `h` (NULL: uninitialised); NULL and a message on failure. */
static float *to_dev(tsr_backend *gpu, const float *h, size_t n) {
        void *d = NULL;
        if (tsr_backend_mem_alloc(gpu, n * sizeof(float), &d) != TSR_OK ||
            (h && tsr_backend_upload(gpu, d, h, n * sizeof(float)) != TSR_OK)) {
                fprintf(stderr, "device alloc/upload of %zu floats failed\n", n);
                tsr_backend_mem_free(gpu, d);
                return NULL;
        }
        return d;
}

int main(void) {
        tsr_backend *ref = NULL, *gpu = NULL;
        int failures = 0;
        tsr_status st = tsr_backend_cuda_new(0, &gpu);

        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND) {
                printf("[skip:no-gpu] no CUDA device\n");
                return 77;
        }
        if (st != TSR_OK || tsr_backend_cpu_ref_new(&ref) != TSR_OK) {
                fprintf(stderr, "cannot make the backends: %s\n", tsr_status_str(st));
                return 1;
        }
        srand(1234);
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
                size_t rows = shapes[s].rows, dim = shapes[s].dim, n = rows * dim;
                float *x = malloc(n * sizeof(float)), *w = malloc(dim * sizeof(float));
                float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
                float *dx, *dw, *dout;
                int bad = 0;

                for (size_t i = 0; i < n; i++)
                        x[i] = frand() * 4.0f;
                for (size_t i = 0; i < dim; i++)
                        w[i] = 1.0f + frand();
                tsr_backend_rmsnorm(ref, want, x, w, rows, dim, 1e-5f);
                if (!(dx = to_dev(gpu, x, n)) || !(dw = to_dev(gpu, w, dim)) || !(dout = to_dev(gpu, NULL, n)))
                        return 1;
                if (tsr_backend_rmsnorm(gpu, dout, dx, dw, rows, dim, 1e-5f) != TSR_OK ||
                    tsr_backend_synchronize(gpu) != TSR_OK) {
                        fprintf(stderr, "rmsnorm launch failed rows=%zu dim=%zu\n", rows, dim);
                        return 1;
                }
                if (tsr_backend_download(gpu, got, dout, n * sizeof(float)) != TSR_OK) {
                        fprintf(stderr, "download failed\n");
                        return 1;
                }
                for (size_t i = 0; i < n; i++) {
                        float tol = 1e-5f + 1e-4f * fabsf(want[i]);
                        if (!(fabsf(got[i] - want[i]) <= tol)) {
                                if (bad++ < 10)
                                        fprintf(stderr, "rmsnorm rows=%zu dim=%zu i=%zu: cuda %.8g ref %.8g\n",
                                                rows, dim, i, got[i], want[i]);
                        }
                }
                failures += bad != 0;
                tsr_backend_mem_free(gpu, dx);
                tsr_backend_mem_free(gpu, dw);
                tsr_backend_mem_free(gpu, dout);
                free(x);
                free(w);
                free(want);
                free(got);
        }
        tsr_backend_free(&gpu);
        tsr_backend_free(&ref);
        printf("%d of %zu shapes failed\n", failures, sizeof(shapes) / sizeof(shapes[0]));
        return failures ? 1 : 0;
}
