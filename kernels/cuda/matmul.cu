// matmul.cu - kernels.h's matmul through cuBLAS: out[r,i] = sum_k w[i,k] x[r,k].
//
// The layouts.  Tessera's arrays are row-major; cuBLAS reads column-major.  A row-major
// (R, C) array with row stride C is, read column-major, the (C, R) matrix with leading
// dimension C: its transpose, for free.  So, column-major:
//   x (rows, n) row-major  = X  (n, rows),  ld n
//   w (d, n)    row-major  = Wc (n, d),     ld n
//   out (rows, d) row-major = O (d, rows),  ld d
// and we want O[i, r] = sum_k w[i,k] x[r,k] = sum_k Wc[k,i] X[k,r] = (Wc^T X)[i, r]:
//   C = op(A) op(B) with A = Wc (transposed: CUBLAS_OP_T, lda n), B = X (CUBLAS_OP_N,
//   ldb n), m = d, n = rows, k = n, C = O with ldc d.
// Summation order: cuBLAS's own (tiles, FMAs, possibly split-K) and its choice of kernel
// may depend on rows, so unlike cpu/ref.c the CUDA matmul is not bitwise batch invariant:
// it is within the float32 summation bound of ref (tests/kernels/test_ops.c).
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/cuda_check.h"

extern "C" tsr_status tsr_cuda_matmul_f32(cublasHandle_t h, float *out, const float *x, const float *w, size_t rows,
                                          size_t n, size_t d) {
        const float alpha = 1.0f, beta = 0.0f;
        if (rows == 0)
                return TSR_OK;
        TSR_CUBLAS_TRY(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)d, (int)rows, (int)n, &alpha, w, (int)n, x,
                                   (int)n, &beta, out, (int)d));
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_matmul_bf16(cublasHandle_t h, float *out, const uint16_t *xb, const uint16_t *w,
                                           size_t rows, size_t n, size_t d) {
        const float alpha = 1.0f, beta = 0.0f;
        if (rows == 0)
                return TSR_OK;
        // bf16 x bf16 products are exact in float32; CUBLAS_COMPUTE_32F accumulates in float32.
        TSR_CUBLAS_TRY(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)d, (int)rows, (int)n, &alpha, w, CUDA_R_16BF,
                                    (int)n, xb, CUDA_R_16BF, (int)n, &beta, out, CUDA_R_32F, (int)d,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return TSR_OK;
}
