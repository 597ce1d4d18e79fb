/* CUDA add_rmsnorm against the CPU reference over a shape table with odd sizes: the
 * updated residual bitwise (float adds round the same on both), the normed output
 * within rmsnorm's tolerance, for out separate and out == x (the forward's use).
 * Device memory through the backend (tsr_backend_mem_alloc, upload, download).
 * Exit 77 (meson: skipped) when there is no CUDA device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

static const struct { size_t rows, dim; } shapes[] = {
        {1, 1}, {1, 3}, {3, 127}, {7, 64}, {2, 128}, {1, 4097}, {17, 576}, {5, 8192}, {33, 257},
};

static float frand(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

/* The CUDA backend every device call below goes through (made in main). */
static tsr_backend *gpu;

/* n floats of device memory holding `h` (NULL: uninitialised); false (and a message) on
 * any failure. */
static int to_dev(float **d, const float *h, size_t n) {
        void *p = NULL;
        if (tsr_backend_mem_alloc(gpu, n * sizeof(float), &p) != TSR_OK ||
            (h && tsr_backend_upload(gpu, p, h, n * sizeof(float)) != TSR_OK)) {
                fprintf(stderr, "device alloc/upload failed\n");
                tsr_backend_mem_free(gpu, p);
                return 0;
        }
        *d = p;
        return 1;
}

static int from_dev(float *h, const float *d, size_t n) {
        if (tsr_backend_download(gpu, h, d, n * sizeof(float)) != TSR_OK) {
                fprintf(stderr, "download failed\n");
                return 0;
        }
        return 1;
}

/* Compare one run: residual bitwise, out within tolerance; returns the mismatches. */
static int compare(const char *tag, size_t rows, size_t dim, const float *got_res, const float *want_res,
                   const float *got, const float *want) {
        int bad = 0;
        for (size_t i = 0; i < rows * dim; i++) {
                if (memcmp(&got_res[i], &want_res[i], sizeof(float)) != 0 && bad++ < 10)
                        fprintf(stderr, "%s rows=%zu dim=%zu i=%zu: residual cuda %.9g ref %.9g\n", tag, rows, dim, i,
                                got_res[i], want_res[i]);
                float tol = 1e-5f + 1e-4f * fabsf(want[i]);
                if (!(fabsf(got[i] - want[i]) <= tol) && bad++ < 10)
                        fprintf(stderr, "%s rows=%zu dim=%zu i=%zu: out cuda %.8g ref %.8g\n", tag, rows, dim, i, got[i],
                                want[i]);
        }
        return bad;
}

int main(void) {
        tsr_backend *ref = NULL;
        int failures = 0, cases = 0;
        tsr_status st = tsr_backend_cuda_new(0, &gpu);

        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND) {
                printf("[skip:no-gpu] no CUDA device\n");
                return 77;
        }
        if (st != TSR_OK || tsr_backend_cpu_ref_new(&ref) != TSR_OK) {
                fprintf(stderr, "cannot make the backends: %s\n", tsr_status_str(st));
                return 1;
        }
        if (!tsr_backend_supports(gpu, TSR_OP_ADD_RMSNORM, TSR_DTYPE_F32)) {
                fprintf(stderr, "the CUDA backend has no add_rmsnorm\n");
                return 1;
        }
        srand(4321);
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
                size_t rows = shapes[s].rows, dim = shapes[s].dim, n = rows * dim;
                float *res = malloc(n * sizeof(float)), *x = malloc(n * sizeof(float)), *w = malloc(dim * sizeof(float));
                float *want_res = malloc(n * sizeof(float)), *want = malloc(n * sizeof(float));
                float *got_res = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
                float *dres = NULL, *dx = NULL, *dw = NULL, *dout = NULL;

                for (size_t i = 0; i < n; i++) {
                        res[i] = frand() * 4.0f;
                        x[i] = frand() * 2.0f;
                }
                for (size_t i = 0; i < dim; i++)
                        w[i] = 1.0f + frand();
                memcpy(want_res, res, n * sizeof(float));
                tsr_backend_add_rmsnorm(ref, want, want_res, x, w, rows, dim, 1e-5f);

                /* out separate from x */
                if (!to_dev(&dres, res, n) || !to_dev(&dx, x, n) || !to_dev(&dw, w, dim) || !to_dev(&dout, NULL, n))
                        return 1;
                if (tsr_backend_add_rmsnorm(gpu, dout, dres, dx, dw, rows, dim, 1e-5f) != TSR_OK ||
                    tsr_backend_synchronize(gpu) != TSR_OK) {
                        fprintf(stderr, "add_rmsnorm launch failed rows=%zu dim=%zu\n", rows, dim);
                        return 1;
                }
                if (!from_dev(got_res, dres, n) || !from_dev(got, dout, n))
                        return 1;
                failures += compare("add_rmsnorm", rows, dim, got_res, want_res, got, want) != 0;
                cases++;

                /* out == x: the forward writes the normed row over the sublayer's output */
                if (tsr_backend_upload(gpu, dres, res, n * sizeof(float)) != TSR_OK)
                        return 1;
                if (tsr_backend_add_rmsnorm(gpu, dx, dres, dx, dw, rows, dim, 1e-5f) != TSR_OK ||
                    tsr_backend_synchronize(gpu) != TSR_OK) {
                        fprintf(stderr, "add_rmsnorm (out == x) launch failed rows=%zu dim=%zu\n", rows, dim);
                        return 1;
                }
                if (!from_dev(got_res, dres, n) || !from_dev(got, dx, n))
                        return 1;
                failures += compare("add_rmsnorm out == x", rows, dim, got_res, want_res, got, want) != 0;
                cases++;

                tsr_backend_mem_free(gpu, dres);
                tsr_backend_mem_free(gpu, dx);
                tsr_backend_mem_free(gpu, dw);
                tsr_backend_mem_free(gpu, dout);
                free(res);
                free(x);
                free(w);
                free(want_res);
                free(want);
                free(got_res);
                free(got);
        }
        /* argument checks: rejected before any launch */
        float *d = NULL;
        if (!to_dev(&d, NULL, 16))
                return 1;
        if (tsr_backend_add_rmsnorm(gpu, NULL, d, d, d, 1, 4, 1e-5f) != TSR_E_INVAL ||
            tsr_backend_add_rmsnorm(gpu, d, NULL, d, d, 1, 4, 1e-5f) != TSR_E_INVAL ||
            tsr_backend_add_rmsnorm(gpu, d, d + 4, d, d, 1, 0, 1e-5f) != TSR_E_INVAL ||
            tsr_backend_add_rmsnorm(gpu, d, d + 4, d, d + 8, 0, 4, 1e-5f) != TSR_OK) {
                fprintf(stderr, "add_rmsnorm argument checks wrong\n");
                failures++;
        }
        tsr_backend_mem_free(gpu, d);
        tsr_backend_free(&gpu);
        tsr_backend_free(&ref);
        printf("%d of %d cases failed\n", failures, cases);
        return failures ? 1 : 0;
}
