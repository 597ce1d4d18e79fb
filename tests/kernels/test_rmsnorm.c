/* CUDA rmsnorm against the CPU reference over a shape table with odd sizes.
 * Exit 77 (meson: skipped) when there is no CUDA device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "kernels/kernels.h"

static const struct { size_t rows, dim; } shapes[] = {
        {1, 1}, {1, 3}, {3, 127}, {7, 64}, {2, 128}, {1, 4097}, {17, 576}, {5, 8192},
};

static float frand(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

int main(void) {
        const tsr_kernels_ops *ref = tsr_kernels_cpu_ref();
        const tsr_kernels_ops *gpu = tsr_kernels_cuda();
        int failures = 0;

        if (!gpu) {
                printf("[skip:no-gpu] no CUDA device\n");
                return 77;
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
                ref->rmsnorm(want, x, w, rows, dim, 1e-5f);
                if (cudaMalloc((void **)&dx, n * sizeof(float)) != cudaSuccess ||
                    cudaMalloc((void **)&dw, dim * sizeof(float)) != cudaSuccess ||
                    cudaMalloc((void **)&dout, n * sizeof(float)) != cudaSuccess) {
                        fprintf(stderr, "cudaMalloc failed\n");
                        return 1;
                }
                cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice);
                cudaMemcpy(dw, w, dim * sizeof(float), cudaMemcpyHostToDevice);
                if (gpu->rmsnorm(dout, dx, dw, rows, dim, 1e-5f) != TSR_OK || gpu->sync() != TSR_OK) {
                        fprintf(stderr, "rmsnorm launch failed rows=%zu dim=%zu\n", rows, dim);
                        return 1;
                }
                cudaMemcpy(got, dout, n * sizeof(float), cudaMemcpyDeviceToHost);
                for (size_t i = 0; i < n; i++) {
                        float tol = 1e-5f + 1e-4f * fabsf(want[i]);
                        if (!(fabsf(got[i] - want[i]) <= tol)) {
                                if (bad++ < 10)
                                        fprintf(stderr, "rmsnorm rows=%zu dim=%zu i=%zu: cuda %.8g ref %.8g\n",
                                                rows, dim, i, got[i], want[i]);
                        }
                }
                failures += bad != 0;
                cudaFree(dx);
                cudaFree(dw);
                cudaFree(dout);
                free(x);
                free(w);
                free(want);
                free(got);
        }
        printf("%d of %zu shapes failed\n", failures, sizeof(shapes) / sizeof(shapes[0]));
        return failures ? 1 : 0;
}
