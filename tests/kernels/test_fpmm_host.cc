// test_fpmm_host.cc - the arithmetic of kernels/cuda/fpmm.cu's exact kernels
// (fpmm_math.cuh: the activation quantizers and one thread's lane of a dot product)
// compiled for the host and run as the kernels run it: x quantized element by element
// (fp8) or block by block (NVFP4), each output's eight lanes from tsr_fpmm_cuda_lane, the
// pair tree the kernel's three shuffles compute (lane j adds lane j ^ 1, then j ^ 2,
// then j ^ 4: thread 0 ends with ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))), one
// final multiply.  Every output must be BITWISE cpu-ref's tsr_backend_matmul_scaled
// (kernels/quant/fpmm.h) over fp8 and NVFP4, activation quantization on and off, odd
// shapes, an infinity or a NaN in x, a NaN weight code.  The __*_rn intrinsics are the
// host's IEEE operations (one rounding each; -ffp-contract=off), as on the device.  What
// this cannot see (the launch geometry, the shuffles themselves, cuBLASLt) is the GPU
// suite's test_cuda_fpmm.  Suite 'unit': no GPU needed.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define __device__
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
#include "kernels/cuda/fpmm_math.cuh"

#include "tests/kernels/fpmm_cases.h"

static int failures;

// The eight lanes combined as the kernel's shuffles combine them (as seen by thread 0).
static float pair_tree(const float l[8]) {
        float s1[8], s2[8];
        for (int j = 0; j < 8; j++)
                s1[j] = __fadd_rn(l[j], l[j ^ 1]);
        for (int j = 0; j < 8; j++)
                s2[j] = __fadd_rn(s1[j], s1[j ^ 2]);
        return __fadd_rn(s2[0], s2[4]);
}

// The exact kernels' result for the whole matmul, into out (rows, d).
static void device_math(float *out, const float *x, const uint8_t *w, tsr_dtype t, const tsr_matmul_scales *s,
                        size_t rows, size_t n, size_t d) {
        bool nv = t == TSR_DTYPE_NVFP4, act = s->input > 0;
        float e4m3[256], lanes[8];
        for (unsigned c = 0; c < 256; c++)
                e4m3[c] = tsr_cuda_e4m3_to_f32(c);
        uint8_t *xc = (uint8_t *)malloc(rows * n);
        int8_t *a = (int8_t *)malloc(rows * n);
        float *sfa = (float *)malloc((rows * n / 16 + 1) * sizeof(float));
        for (size_t i = 0; act && !nv && i < rows * n; i++)
                xc[i] = tsr_fpmm_cuda_quantize_fp8(x[i], s->input);
        for (size_t b = 0; act && nv && b < rows * (n / 16); b++)
                tsr_fpmm_cuda_quantize_nvfp4_block(x + 16 * b, s->input, a + 16 * b, sfa + b);
        float scale = act ? s->input * s->weight : s->weight;
        size_t row_bytes = nv ? n / 16 * 9 : n;
        for (size_t i = 0; i < d; i++)
                for (size_t r = 0; r < rows; r++) {
                        const uint8_t *wi = w + i * row_bytes;
                        for (unsigned j = 0; j < 8; j++)
                                lanes[j] = nv && act ? tsr_fpmm_cuda_lane<TSR_FPMM_NV_A>(x, xc, a, sfa, wi, r, n, j, e4m3)
                                           : nv      ? tsr_fpmm_cuda_lane<TSR_FPMM_NV_W>(x, xc, a, sfa, wi, r, n, j, e4m3)
                                           : act     ? tsr_fpmm_cuda_lane<TSR_FPMM_FP8_A>(x, xc, a, sfa, wi, r, n, j, e4m3)
                                                     : tsr_fpmm_cuda_lane<TSR_FPMM_FP8_W>(x, xc, a, sfa, wi, r, n, j, e4m3);
                        out[r * d + i] = __fmul_rn(pair_tree(lanes), scale);
                }
        free(xc), free(a), free(sfa);
}

int main(void) {
        static const size_t n_fp8[] = {1, 3, 7, 8, 9, 17, 33, 129, 256}, n_nv[] = {16, 48, 128, 144, 272};
        static const size_t d_list[] = {1, 3, 17, 37}, rows_list[] = {1, 3, 5, 9};
        tsr_backend *ref = NULL;
        size_t cases = 0;
        if (tsr_backend_cpu_ref_new(&ref) != TSR_OK) {
                printf("FAIL: cpu-ref\n");
                return 1;
        }
        for (int ti = 0; ti < 2; ti++) {
                tsr_dtype t = ti ? TSR_DTYPE_NVFP4 : TSR_DTYPE_FP8_E4M3;
                const size_t *ns = ti ? n_nv : n_fp8;
                size_t nn = ti ? sizeof n_nv / sizeof *n_nv : sizeof n_fp8 / sizeof *n_fp8;
                for (size_t ai = 0; ai < nn; ai++)
                        for (size_t bi = 0; bi < sizeof d_list / sizeof *d_list; bi++)
                                for (size_t ci = 0; ci < sizeof rows_list / sizeof *rows_list; ci++)
                                        for (int xvar = 0; xvar < 3; xvar++)
                                                for (int act = 0; act < 2; act++)
                                                        for (int nan_w = 0; nan_w < 2; nan_w++) {
                        size_t n = ns[ai], d = d_list[bi], rows = rows_list[ci], w_bytes;
                        uint8_t *w = fpmm_make_w(t, d, n, nan_w, &w_bytes);
                        float *x = fpmm_make_x(rows, n, xvar);
                        float *want = (float *)malloc(rows * d * sizeof(float)), *got = (float *)malloc(rows * d * sizeof(float));
                        tsr_matmul_scales s = fpmm_scales(t, act);
                        char what[160];
                        snprintf(what, sizeof what, "%s %s rows %zu n %zu d %zu x%d%s", tsr_dtype_name(t),
                                 act ? "act-quant" : "weight-only", rows, n, d, xvar, nan_w ? " NaN weight" : "");
                        if (tsr_backend_matmul_scaled(ref, want, x, w, t, &s, rows, n, d) != TSR_OK) {
                                printf("FAIL %s: cpu-ref refused it\n", what);
                                failures++;
                        } else {
                                device_math(got, x, w, t, &s, rows, n, d);
                                if (fpmm_compare_bitwise(what, got, want, rows * d)) {
                                        printf("FAIL %s: not bitwise cpu-ref\n", what);
                                        failures++;
                                }
                        }
                        cases++;
                        free(w), free(x), free(want), free(got);
                }
        }
        tsr_backend_free(&ref);
        printf("fpmm.cu's arithmetic on the host: %zu cases, %s (%d failed)\n", cases,
               failures ? "FAIL" : "every output bitwise cpu-ref's", failures);
        return failures ? 1 : 0;
}
