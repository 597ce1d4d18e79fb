/* test_cuda_fpmm.c - tsr_backend_matmul_scaled on CUDA (kernels/cuda/fpmm.cu): ModelOpt's
 * fp8 e4m3 and NVFP4 weights with their scales, suite 'gpu'.
 *
 * Two CUDA backends against cpu-ref (kernels/quant/fpmm.h's specification) over odd
 * shapes (SIMD-like tails, k not a multiple of 8, one output, 200 rows), activation
 * quantization on and off (weight-only), and x with an infinity or a NaN in row 0:
 *   exact  made with TESSERA_CUDA_FPMM=exact, the bitwise kernels only: every output
 *          BITWISE cpu-ref's (NaN for NaN), and the last row alone bitwise the same row
 *          in the batch (batch invariance);
 *   auto   the backend as the worker makes it: cuBLASLt's FP8 GEMM for fp8 weights with
 *          an activation scale where n and d are multiples of 16 (on a GPU that has one,
 *          sm_89+), else the exact kernels.  A shape cuBLASLt could take is held to
 *          fpmm.h's summation bound (both sums of the same exact products in float32:
 *          2 n 2^-24 sum|terms| x scale, plus the final scale's rounding); every other
 *          shape must be bitwise as above.
 * Arrays are placed at the device allocation's start (256-byte aligned) or 4 or 16 bytes
 * past it, so cuBLASLt's alignment rule is crossed.  Prints how many GEMMs each path ran
 * (a GPU without cuBLASLt's FP8 GEMM runs them all exactly, and says so).
 * Exit 77 (meson: skipped) without a CUDA device; a failure prints the case and the
 * first mismatches. */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/quant/fpmm.h"
#include "kernels/quant/quant.h"
#include "tests/kernels/fpmm_cases.h"

static int failures;
static size_t n_bitwise, n_bounded;

static void die(const char *what, tsr_status st) {
        printf("FAIL %s: %s\n", what, tsr_status_str(st));
        exit(1);
}

static void *dev_put(tsr_backend *be, const void *src, size_t bytes, size_t offset, void **base) {
        tsr_status st = tsr_backend_mem_alloc(be, bytes + offset, base);
        if (st != TSR_OK)
                die("device alloc", st);
        void *p = (uint8_t *)*base + offset;
        if (src && (st = tsr_backend_upload(be, p, src, bytes)) != TSR_OK)
                die("upload", st);
        return p;
}

/* out (rows, d) on `be` for the host arrays, the output `offset` bytes into its allocation. */
static void run_on(tsr_backend *be, float *out, const float *x, const uint8_t *w, size_t w_bytes, tsr_dtype t,
                   const tsr_matmul_scales *s, size_t rows, size_t n, size_t d, size_t offset) {
        void *bx, *bw, *bo;
        float *dx = dev_put(be, x, rows * n * sizeof(float), 0, &bx);
        void *dw = dev_put(be, w, w_bytes, 0, &bw);
        float *dout = dev_put(be, NULL, rows * d * sizeof(float), offset, &bo);
        tsr_status st = tsr_backend_matmul_scaled(be, dout, dx, dw, t, s, rows, n, d);
        if (st == TSR_OK)
                st = tsr_backend_synchronize(be);
        if (st == TSR_OK)
                st = tsr_backend_download(be, out, dout, rows * d * sizeof(float));
        if (st != TSR_OK)
                die("matmul_scaled on the device", st);
        tsr_backend_mem_free(be, bx), tsr_backend_mem_free(be, bw), tsr_backend_mem_free(be, bo);
}

/* fpmm.h's bound for a float32 sum of the same exact products in another order. */
static size_t compare_bounded(const char *what, const float *got, const float *want, const float *x,
                              const uint8_t *w, const tsr_matmul_scales *s, size_t rows, size_t n, size_t d) {
        float *xq = malloc(n * sizeof(float));
        double scale = (double)s->input * s->weight;
        size_t bad = 0;
        for (size_t r = 0; r < rows; r++) {
                tsr_fpmm_fp8_quantize_row(x + r * n, n, s->input, xq);
                for (size_t i = 0; i < d; i++) {
                        double abs_sum = 0, g = got[r * d + i], v = want[r * d + i];
                        for (size_t k = 0; k < n; k++)
                                abs_sum += fabs((double)xq[k] * tsr_fp8_e4m3_to_f32(w[i * n + k]));
                        if (isnan(v) || isnan(g)) {
                                if (!(isnan(v) && isnan(g)) && bad++ < 4)
                                        printf("FAIL %s [%zu,%zu]: %.9g, cpu-ref %.9g (NaN on one side)\n", what, r, i,
                                               g, v);
                                continue;
                        }
                        double bound = 2.0 * (double)n * 0x1p-24 * abs_sum * scale + 2 * 0x1p-24 * fabs(v) + 1e-37;
                        if (!(fabs(g - v) <= bound) && bad++ < 4)
                                printf("FAIL %s [%zu,%zu]: %.9g, cpu-ref %.9g (bound %.3g)\n", what, r, i, g, v, bound);
                }
        }
        free(xq);
        return bad;
}

static void one_case(tsr_backend *ref, tsr_backend *exact, tsr_backend *fast, tsr_dtype t, size_t rows, size_t n,
                     size_t d, int xvar, bool act, bool nan_w, size_t offset) {
        size_t w_bytes, len = rows * d;
        uint8_t *w = fpmm_make_w(t, d, n, nan_w, &w_bytes);
        float *x = fpmm_make_x(rows, n, xvar), *want = malloc(len * sizeof(float));
        float *got = malloc(len * sizeof(float)), *one = malloc(d * sizeof(float));
        tsr_matmul_scales s = fpmm_scales(t, act);
        char what[200];
        snprintf(what, sizeof what, "%s %s rows %zu n %zu d %zu x%d%s out+%zu", tsr_dtype_name(t),
                 act ? "act-quant" : "weight-only", rows, n, d, xvar, nan_w ? " NaN weight" : "", offset);
        tsr_status st = tsr_backend_matmul_scaled(ref, want, x, w, t, &s, rows, n, d);
        if (st != TSR_OK)
                die("cpu-ref matmul_scaled", st);

        run_on(exact, got, x, w, w_bytes, t, &s, rows, n, d, offset);
        size_t bad = fpmm_compare_bitwise(what, got, want, len);
        run_on(exact, one, x + (rows - 1) * n, w, w_bytes, t, &s, 1, n, d, offset);
        bad += fpmm_compare_bitwise(what, one, want + (rows - 1) * d, d);
        n_bitwise++;

        uint64_t lt0, ex0, lt1, ex1;
        tsr_backend_cuda_fpmm_counts(fast, &lt0, &ex0);
        run_on(fast, got, x, w, w_bytes, t, &s, rows, n, d, offset);
        tsr_backend_cuda_fpmm_counts(fast, &lt1, &ex1);
        if (lt1 > lt0) {        /* cuBLASLt took it: the summation bound */
                bad += compare_bounded(what, got, want, x, w, &s, rows, n, d);
                n_bounded++;
        } else {
                bad += fpmm_compare_bitwise(what, got, want, len);
                n_bitwise++;
        }
        if (bad) {
                printf("FAIL %s: %zu outputs off\n", what, bad);
                failures++;
        }
        free(w), free(x), free(want), free(got), free(one);
}

int main(void) {
        tsr_backend *ref = NULL, *exact = NULL, *fast = NULL;
        setenv("TESSERA_CUDA_FPMM", "exact", 1);
        tsr_status st = tsr_backend_cuda_new(0, &exact);
        unsetenv("TESSERA_CUDA_FPMM");
        if (st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND) {
                printf("[skip:no-gpu] %s\n", st == TSR_E_UNSUPPORTED ? "CUDA not built" : "no CUDA device");
                return 77;
        }
        if (st != TSR_OK || (st = tsr_backend_cuda_new(0, &fast)) != TSR_OK ||
            (st = tsr_backend_cpu_ref_new(&ref)) != TSR_OK)
                die("backends", st);

        static const size_t n_fp8[] = {1, 3, 7, 8, 9, 17, 33, 129, 16, 64, 128, 4096}, n_nv[] = {16, 48, 128, 144, 272};
        static const size_t d_list[] = {1, 3, 17, 37, 16, 48, 256}, rows_list[] = {1, 3, 5, 9, 32, 33, 200};
        for (int ti = 0; ti < 2; ti++) {
                tsr_dtype t = ti ? TSR_DTYPE_NVFP4 : TSR_DTYPE_FP8_E4M3;
                const size_t *ns = ti ? n_nv : n_fp8;
                size_t nn = ti ? sizeof n_nv / sizeof *n_nv : sizeof n_fp8 / sizeof *n_fp8;
                for (size_t a = 0; a < nn; a++)
                        for (size_t b = 0; b < sizeof d_list / sizeof *d_list; b++)
                                for (size_t c = 0; c < sizeof rows_list / sizeof *rows_list; c++)
                                        for (int act = 0; act < 2; act++) {
                                                if (ns[a] * d_list[b] * rows_list[c] > ((size_t)1 << 26))
                                                        continue;       /* the float64 bound's loop */
                                                size_t k = a + b + c + (size_t)act;
                                                one_case(ref, exact, fast, t, rows_list[c], ns[a], d_list[b], (int)(k % 3),
                                                         act, false, k % 4 == 0 ? 0 : k % 4 == 1 ? 4 : 16);
                                        }
                /* a NaN weight code / block scale: the exact kernels carry it as cpu-ref */
                one_case(ref, exact, fast, t, 3, ti ? 48 : 33, 5, 0, true, true, 0);
                one_case(ref, exact, fast, t, 3, ti ? 48 : 33, 5, 0, false, true, 0);
        }
        uint64_t lt = 0, ex = 0;
        tsr_backend_cuda_fpmm_counts(fast, &lt, &ex);
        printf("fpmm on cuda: %zu cases bitwise cpu-ref, %zu within the summation bound; the auto backend ran %llu "
               "GEMMs on cuBLASLt, %llu on the exact kernels%s\n", n_bitwise, n_bounded, (unsigned long long)lt,
               (unsigned long long)ex, lt ? "" : " (no cuBLASLt FP8 GEMM on this GPU: all exact)");
        tsr_backend_free(&fast);
        tsr_backend_free(&exact);
        tsr_backend_free(&ref);
        printf("%s (%d failed case%s)\n", failures ? "FAIL" : "OK", failures, failures == 1 ? "" : "s");
        return failures ? 1 : 0;
}
