// fpmm.cu - the fp8 e4m3 / NVFP4 matmul with per-tensor scales on the device (fpmm.cuh):
// the exact kernels of kernels/quant/fpmm.h, and cuBLASLt's FP8 GEMM for the W8A8 case.
//
// The exact kernels.  A group of 8 threads computes one output (weight row i, x row r):
// thread j sums fpmm.h's lane j (k = j, j + 8, ... ; NVFP4 W4A4: blocks b = j, j + 8, ...)
// in order, every multiply and add rounded once (fpmm_math.cuh, which the unit suite's
// test_fpmm_host runs on the host against cpu-ref), then three shuffles add the lanes as
// cpu/ref.c's pair tree,
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (a + b == b + a bit for bit), and
// the final scale is one multiply.  A block's 32 groups take consecutive outputs with
// the row index fastest, so the four groups of a warp mostly read the same weight row.
// The e4m3 values come from a per-block table of the 256 codes (minifloat.cuh's exact
// decoding).  This is the reference's arithmetic on CUDA cores, not a fast kernel: for
// prefill-sized batches it rereads each weight row once per x row.
//
// cuBLASLt (the W8A8 case it supports): A = the weights, (d, n) row-major = (n, d)
// column-major with op T (the "TN" layout FP8 requires), B = the e4m3 codes of x, (n,
// rows) column-major, D = out float32 (d, rows) column-major; alpha = input * weight as
// fpmm.h's one final scale; float32 accumulation (no fast-accumulate mode).  The
// algorithm for a shape (and the alignment of its arrays, which cuBLASLt's choice
// depends on) is asked for once and kept; a shape without one runs the exact kernels.
#include <cublasLt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fpmm.cuh"
#include "kernels/cuda/fpmm_math.cuh"
#include "kernels/cuda/minifloat.cuh"

static const int threads = 256;
#define GROUPS_PER_BLOCK 32             // threads / 8: outputs a block computes
#define LT_CACHE 512                    // GEMM shapes whose cuBLASLt answer is kept

// ---- activation quantizers (fpmm.h) -----------------------------------------------------

__global__ static void quantize_fp8_kernel(uint8_t *codes, const float *x, size_t count, float input) {
        size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < count)
                codes[i] = tsr_fpmm_cuda_quantize_fp8(x[i], input);
}

// One thread per 16-element block of x (blocks = rows * n/16, contiguous since n % 16 == 0).
__global__ static void quantize_nvfp4_kernel(int8_t *a, float *sfa, const float *x, size_t blocks, float input) {
        size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (b < blocks)
                tsr_fpmm_cuda_quantize_nvfp4_block(x + 16 * b, input, a + 16 * b, sfa + b);
}

// ---- the exact matmul ------------------------------------------------------------------

// out[r, i] for every (i, r): fpmm_math.cuh's lane sums, the pair tree by shuffles.
template <int K>
__global__ static void fpmm_exact_kernel(float *out, const float *x, const uint8_t *xc, const int8_t *a,
                                         const float *sfa, const uint8_t *w, size_t row_bytes, size_t rows,
                                         size_t n, size_t d, float scale) {
        __shared__ float e4m3[256];
        for (unsigned c = threadIdx.x; c < 256; c += blockDim.x)
                e4m3[c] = tsr_cuda_e4m3_to_f32(c);
        __syncthreads();
        size_t g = (size_t)blockIdx.x * GROUPS_PER_BLOCK + threadIdx.x / 8;
        unsigned j = threadIdx.x % 8;
        bool live = g < rows * d;
        size_t i = live ? g / rows : 0, r = live ? g % rows : 0;
        float lane = live ? tsr_fpmm_cuda_lane<K>(x, xc, a, sfa, w + i * row_bytes, r, n, j, e4m3) : 0.0f;
        // the pair tree over the group's eight lanes (every thread of the warp shuffles)
        lane = __fadd_rn(lane, __shfl_xor_sync(0xffffffffu, lane, 1));
        lane = __fadd_rn(lane, __shfl_xor_sync(0xffffffffu, lane, 2));
        lane = __fadd_rn(lane, __shfl_xor_sync(0xffffffffu, lane, 4));
        if (live && j == 0)
                out[r * d + i] = __fmul_rn(lane, scale);
}

// ---- cuBLASLt ----------------------------------------------------------------------------

struct lt_shape {
        size_t rows, n, d;
        unsigned align;                 // the arrays' common alignment (bytes, <= 256)
        bool ok;                        // algo holds cuBLASLt's choice; false: it has none
        cublasLtMatmulAlgo_t algo;
};

struct tsr_cuda_fpmm_lt {
        cublasLtHandle_t h;
        void *ws;
        size_t ws_bytes;
        lt_shape shapes[LT_CACHE];
        size_t n_shapes, next;          // next: the entry a full cache replaces
        bool said_none;                 // the line about a shape without a GEMM was printed
        uint64_t lt_calls, exact_calls;
};

// The largest power of two (<= 256) dividing the address.
static unsigned align_of(const void *p) {
        uintptr_t u = (uintptr_t)p;
        unsigned a = 256;
        while (a > 1 && u % a != 0)
                a /= 2;
        return a;
}

// The alignment the three arrays share.
static unsigned common_align(const void *out, const void *w, const void *act) {
        unsigned a = align_of(out), b = align_of(w), c = align_of(act);
        a = b < a ? b : a;
        return c < a ? c : a;
}

// The operation and layouts of out = alpha * W^T X (see the top).  The caller destroys them.
static cublasStatus_t lt_describe(size_t rows, size_t n, size_t d, cublasLtMatmulDesc_t *op,
                                  cublasLtMatrixLayout_t *la, cublasLtMatrixLayout_t *lb, cublasLtMatrixLayout_t *ld) {
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasStatus_t s = cublasLtMatmulDescCreate(op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        if (s == CUBLAS_STATUS_SUCCESS)
                s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
        if (s == CUBLAS_STATUS_SUCCESS)
                s = cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
        if (s == CUBLAS_STATUS_SUCCESS)
                s = cublasLtMatrixLayoutCreate(la, CUDA_R_8F_E4M3, n, d, (int64_t)n);
        if (s == CUBLAS_STATUS_SUCCESS)
                s = cublasLtMatrixLayoutCreate(lb, CUDA_R_8F_E4M3, n, rows, (int64_t)n);
        if (s == CUBLAS_STATUS_SUCCESS)
                s = cublasLtMatrixLayoutCreate(ld, CUDA_R_32F, d, rows, (int64_t)d);
        return s;
}

static void lt_undescribe(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                          cublasLtMatrixLayout_t ld) {
        if (ld)
                (void)cublasLtMatrixLayoutDestroy(ld);
        if (lb)
                (void)cublasLtMatrixLayoutDestroy(lb);
        if (la)
                (void)cublasLtMatrixLayoutDestroy(la);
        if (op)
                (void)cublasLtMatmulDescDestroy(op);
}

// cuBLASLt's algorithm for the shape, asked for now: false when it has none.
static bool lt_ask(tsr_cuda_fpmm_lt *lt, lt_shape *s) {
        cublasLtMatmulDesc_t op = NULL;
        cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
        cublasLtMatmulPreference_t pref = NULL;
        cublasLtMatmulHeuristicResult_t res = {};
        int found = 0;
        uint32_t align = s->align;
        cublasStatus_t st = lt_describe(s->rows, s->n, s->d, &op, &la, &lb, &ld);
        if (st == CUBLAS_STATUS_SUCCESS)
                st = cublasLtMatmulPreferenceCreate(&pref);
        if (st == CUBLAS_STATUS_SUCCESS)
                st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt->ws_bytes,
                                                          sizeof lt->ws_bytes);
        // cuBLASLt assumes 256-byte aligned arrays unless told: say what ours are
        const cublasLtMatmulPreferenceAttributes_t aligns[] = {
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        for (size_t i = 0; st == CUBLAS_STATUS_SUCCESS && i < sizeof aligns / sizeof *aligns; i++)
                st = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof align);
        if (st == CUBLAS_STATUS_SUCCESS)
                st = cublasLtMatmulAlgoGetHeuristic(lt->h, op, la, lb, ld, ld, pref, 1, &res, &found);
        if (pref)
                (void)cublasLtMatmulPreferenceDestroy(pref);
        lt_undescribe(op, la, lb, ld);
        s->ok = st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
        if (s->ok)
                s->algo = res.algo;
        if (!s->ok && !lt->said_none) {
                lt->said_none = true;
                fprintf(stderr, "cuda: cuBLASLt has no FP8 GEMM for rows %zu n %zu d %zu (%s, %d found): such "
                        "shapes run the exact fp8 kernel\n", s->rows, s->n, s->d, cublasGetStatusName(st), found);
        }
        return s->ok;
}

static lt_shape *lt_find(tsr_cuda_fpmm_lt *lt, size_t rows, size_t n, size_t d, unsigned align) {
        for (size_t i = 0; i < lt->n_shapes; i++) {
                lt_shape *s = &lt->shapes[i];
                if (s->rows == rows && s->n == n && s->d == d && s->align == align)
                        return s;
        }
        lt_shape *s = lt->n_shapes < LT_CACHE ? &lt->shapes[lt->n_shapes++] : &lt->shapes[lt->next++ % LT_CACHE];
        *s = lt_shape{rows, n, d, align, false, {}};
        lt_ask(lt, s);
        return s;
}

extern "C" tsr_status tsr_cuda_fpmm_lt_new(void *workspace, size_t workspace_bytes, tsr_cuda_fpmm_lt **ret) {
        tsr_cuda_fpmm_lt *lt = static_cast<tsr_cuda_fpmm_lt *>(calloc(1, sizeof *lt));
        if (!lt)
                return TSR_E_NOMEM;
        cublasStatus_t s = cublasLtCreate(&lt->h);
        if (s != CUBLAS_STATUS_SUCCESS) {
                fprintf(stderr, "cuda: cublasLtCreate failed (%s): the fp8 matmuls run the exact kernels\n",
                        cublasGetStatusName(s));
                free(lt);
                return TSR_E_CUDA;
        }
        lt->ws = workspace;
        lt->ws_bytes = workspace_bytes;
        *ret = lt;
        return TSR_OK;
}

extern "C" void tsr_cuda_fpmm_lt_free(tsr_cuda_fpmm_lt *lt) {
        if (!lt)
                return;
        (void)cublasLtDestroy(lt->h);
        free(lt);
}

extern "C" bool tsr_cuda_fpmm_lt_applies(tsr_cuda_fpmm_lt *lt, const float *out, const void *w, const void *act,
                                         tsr_dtype t, bool quantized_x, size_t rows, size_t n, size_t d) {
        if (!lt || t != TSR_DTYPE_FP8_E4M3 || !quantized_x || n % 16 != 0 || d % 16 != 0 || rows == 0)
                return false;
        unsigned align = common_align(out, w, act);
        return align >= 16 && lt_find(lt, rows, n, d, align)->ok;
}

extern "C" void tsr_cuda_fpmm_lt_counts(const tsr_cuda_fpmm_lt *lt, uint64_t *lt_calls, uint64_t *exact_calls) {
        *lt_calls = lt ? lt->lt_calls : 0;
        *exact_calls = lt ? lt->exact_calls : 0;
}

// ---- the call ----------------------------------------------------------------------------

extern "C" bool tsr_cuda_fpmm_fits(size_t rows, size_t n, size_t d) {
        return rows <= INT_MAX && n <= INT_MAX && d <= INT_MAX &&
               (rows * d + GROUPS_PER_BLOCK - 1) / GROUPS_PER_BLOCK <= INT_MAX &&
               (rows * n + threads - 1) / threads <= INT_MAX;
}

// The NVFP4 block scales after the codes, 16-byte aligned.
static size_t sfa_offset(size_t rows, size_t n) { return (rows * n + 15) & ~(size_t)15; }

extern "C" size_t tsr_cuda_fpmm_scratch_bytes(tsr_dtype t, bool quantized_x, size_t rows, size_t n) {
        if (!quantized_x)
                return 0;
        return t == TSR_DTYPE_NVFP4 ? sfa_offset(rows, n) + rows * (n / 16) * sizeof(float) : rows * n;
}

extern "C" tsr_status tsr_cuda_fpmm(cudaStream_t stream, tsr_cuda_fpmm_lt *lt, bool use_lt, float *out,
                                    const float *x, const void *w, tsr_dtype t, float weight_scale, float input_scale, size_t rows,
                                    size_t n, size_t d, void *scratch) {
        bool nv = t == TSR_DTYPE_NVFP4, act = input_scale > 0;
        uint8_t *xc = static_cast<uint8_t *>(scratch);
        int8_t *a = static_cast<int8_t *>(scratch);
        float *sfa = act && nv ? reinterpret_cast<float *>(xc + sfa_offset(rows, n)) : NULL;
        if (act && nv) {
                size_t blocks = rows * (n / 16);
                quantize_nvfp4_kernel<<<(unsigned)((blocks + threads - 1) / threads), threads, 0, stream>>>(a, sfa, x,
                                                                                                           blocks,
                                                                                                           input_scale);
        } else if (act) {
                quantize_fp8_kernel<<<(unsigned)((rows * n + threads - 1) / threads), threads, 0, stream>>>(
                        xc, x, rows * n, input_scale);
        }
        TSR_CUDA_TRY(cudaGetLastError());
        float scale = act ? input_scale * weight_scale : weight_scale;     // fpmm.h's one final scale
        if (lt && use_lt) {
                lt_shape *s = lt_find(lt, rows, n, d, common_align(out, w, xc));
                cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
                if (s->ok) {
                        const float beta = 0.0f;
                        cublasLtMatmulDesc_t op = NULL;
                        cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
                        st = lt_describe(rows, n, d, &op, &la, &lb, &ld);
                        if (st == CUBLAS_STATUS_SUCCESS)
                                st = cublasLtMatmul(lt->h, op, &scale, w, la, xc, lb, &beta, out, ld, out, ld, &s->algo,
                                                    lt->ws, lt->ws_bytes, stream);
                        lt_undescribe(op, la, lb, ld);
                }
                if (st == CUBLAS_STATUS_SUCCESS) {
                        lt->lt_calls++;
                        return TSR_OK;
                }
                if (s->ok)      // refused at the call: this shape runs the exact kernels from now on
                        fprintf(stderr, "cuda: cuBLASLt's FP8 GEMM failed for rows %zu n %zu d %zu (%s): the exact "
                                "fp8 kernel runs it\n", rows, n, d, cublasGetStatusName(st));
                s->ok = false;
        }
        size_t row_bytes = nv ? n / 16 * 9 : n, blocks = (rows * d + GROUPS_PER_BLOCK - 1) / GROUPS_PER_BLOCK;
        const uint8_t *wb = static_cast<const uint8_t *>(w);
        if (nv && act)
                fpmm_exact_kernel<TSR_FPMM_NV_A><<<(unsigned)blocks, threads, 0, stream>>>(out, x, NULL, a, sfa, wb, row_bytes,
                                                                                   rows, n, d, scale);
        else if (nv)
                fpmm_exact_kernel<TSR_FPMM_NV_W><<<(unsigned)blocks, threads, 0, stream>>>(out, x, NULL, NULL, NULL, wb,
                                                                                   row_bytes, rows, n, d, scale);
        else if (act)
                fpmm_exact_kernel<TSR_FPMM_FP8_A><<<(unsigned)blocks, threads, 0, stream>>>(out, x, xc, NULL, NULL, wb,
                                                                                    row_bytes, rows, n, d, scale);
        else
                fpmm_exact_kernel<TSR_FPMM_FP8_W><<<(unsigned)blocks, threads, 0, stream>>>(out, x, NULL, NULL, NULL, wb,
                                                                                    row_bytes, rows, n, d, scale);
        TSR_CUDA_TRY(cudaGetLastError());
        if (lt)
                lt->exact_calls++;
        return TSR_OK;
}
