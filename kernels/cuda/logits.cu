// logits.cu - what a device computes of a request's logits row so that only the token
// and its logprobs come back (kernels.h tsr_backend_logit_rules, tsr_backend_logprobs):
// cpu/ref.c's tsr_ref_logit_rules and tsr_ref_logprobs are the specifications.  One
// block of 256 threads per row in both.
//
// logit_rules: every step is one IEEE operation written with the _rn intrinsics (no
// contraction), so the rows equal ref's bitwise.  The allowed ids' values are kept in
// `kept` while the row becomes -inf; the bias runs on one thread in list order (an id
// may be listed twice); the penalty ids are distinct, so their threads never meet.
//
// logprobs: the row's maximum and log-sum-exp exactly as softmax.cu's log_softmax
// (the same reductions, so the values are the CUDA log_softmax's bits), then the rank
// (a count) and the top k by k passes of a block argmax, each over the entries after
// the last one taken in (value desc, index asc) order.
#include <math.h>
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int threads = 256;   // a power of two: the trees need it

__global__ static void logit_rules_kernel(float *x, int n, const uint32_t *hdr, const uint32_t *words, float *kept) {
        const uint32_t *h = hdr + (size_t)blockIdx.x * TSR_CUDA_RULE_WORDS;
        float *xr = x + (size_t)blockIdx.x * n;
        uint32_t n_allowed = h[TSR_CUDA_RULE_N_ALLOWED], n_masked = h[TSR_CUDA_RULE_N_MASKED];
        uint32_t n_bias = h[TSR_CUDA_RULE_N_BIAS], n_pen = h[TSR_CUDA_RULE_N_PEN];
        const uint32_t *allowed = words + h[TSR_CUDA_RULE_ALLOWED], *masked = words + h[TSR_CUDA_RULE_MASKED];
        const uint32_t *bias_ids = words + h[TSR_CUDA_RULE_BIAS], *pen_ids = words + h[TSR_CUDA_RULE_PEN];
        const float *bias = reinterpret_cast<const float *>(bias_ids + n_bias);
        const float *counts = reinterpret_cast<const float *>(pen_ids + n_pen);
        float rep = __uint_as_float(h[TSR_CUDA_RULE_REP]), freq = __uint_as_float(h[TSR_CUDA_RULE_FREQ]);
        float pres = __uint_as_float(h[TSR_CUDA_RULE_PRES]);

        if (n_allowed) {
                float *k = kept + h[TSR_CUDA_RULE_KEPT];        // the row's share of kept
                for (uint32_t j = threadIdx.x; j < n_allowed; j += blockDim.x)
                        k[j] = xr[allowed[j]];
                __syncthreads();
                for (int i = threadIdx.x; i < n; i += blockDim.x)
                        xr[i] = -INFINITY;
                __syncthreads();
                for (uint32_t j = threadIdx.x; j < n_allowed; j += blockDim.x)
                        xr[allowed[j]] = k[j];  // an id listed twice: the same value twice
                __syncthreads();
        }
        for (uint32_t j = threadIdx.x; j < n_masked; j += blockDim.x)
                xr[masked[j]] = -INFINITY;
        __syncthreads();
        if (threadIdx.x == 0)
                for (uint32_t j = 0; j < n_bias; j++)
                        xr[bias_ids[j]] = __fadd_rn(xr[bias_ids[j]], bias[j]);
        __syncthreads();
        for (uint32_t j = threadIdx.x; j < n_pen; j += blockDim.x) {
                float w = xr[pen_ids[j]], c = counts[j];
                if (rep != 1.0f)
                        w = w > 0.0f ? __fdiv_rn(w, rep) : __fmul_rn(w, rep);
                if (c > 0.0f) {
                        w = __fsub_rn(w, __fmul_rn(freq, c));
                        w = __fsub_rn(w, pres);
                }
                xr[pen_ids[j]] = w;
        }
}

extern "C" tsr_status tsr_cuda_logit_rules(cudaStream_t stream, float *x, size_t rows, size_t n, const uint32_t *hdr,
                                           const uint32_t *words, float *kept) {
        if (rows == 0)
                return TSR_OK;
        logit_rules_kernel<<<(unsigned)rows, threads, 0, stream>>>(x, (int)n, hdr, words, kept);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

__global__ static void logprobs_kernel(tsr_row_logprobs *out, const float *x, int n, const uint32_t *tokens,
                                       const uint32_t *top) {
        __shared__ float fpart[threads];
        __shared__ double dpart[threads];
        __shared__ uint32_t upart[threads];
        __shared__ int flags;                   // 1: a NaN or +inf; 2: something above -inf
        const float *xr = x + (size_t)blockIdx.x * n;
        tsr_row_logprobs *o = out + blockIdx.x;
        uint32_t tok = tokens[blockIdx.x], k = top[blockIdx.x];
        if (tok >= (uint32_t)n)
                return;                 // the whole block: the row is skipped
        if (threadIdx.x == 0)
                flags = 0;
        __syncthreads();
        int f = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
                float v = xr[i];
                f |= (isnan(v) || v == INFINITY) ? 1 : 0;
                f |= v != -INFINITY ? 2 : 0;
        }
        if (f)
                atomicOr(&flags, f);
        __syncthreads();
        if (flags != 2) {               // no distribution: rank 0
                if (threadIdx.x == 0) {
                        o->logprob = 0.0f;
                        o->rank = 0;
                }
                return;
        }
        // softmax.cu's log_softmax constants, the same reductions
        float m = xr[0];
        for (int i = threadIdx.x; i < n; i += blockDim.x)
                if (xr[i] > m)
                        m = xr[i];
        float max = tsr_block_max_fixed_tree(m, fpart);
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
                s += exp((double)xr[i] - (double)max);
        float lse = (float)log(tsr_block_sum_fixed_tree(s, dpart));
        float lt = __fsub_rn(__fsub_rn(xr[tok], max), lse);
        uint32_t cnt = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
                cnt += __fsub_rn(__fsub_rn(xr[i], max), lse) >= lt ? 1u : 0u;
        uint32_t rank = tsr_block_sum_fixed_tree(cnt, upart);
        if (threadIdx.x == 0) {
                o->logprob = lt;
                o->rank = rank;
        }
        float pv = INFINITY;            // the last entry taken: none yet
        uint32_t pi = UINT32_MAX;
        for (uint32_t j = 0; j < k; j++) {
                float bv = -INFINITY;
                uint32_t bi = UINT32_MAX;
                for (int i = threadIdx.x; i < n; i += blockDim.x) {
                        float v = __fsub_rn(__fsub_rn(xr[i], max), lse);
                        bool after = pi == UINT32_MAX || v < pv || (v == pv && (uint32_t)i > pi);
                        if (after && tsr_first_max_before(v, (uint32_t)i, bv, bi)) {
                                bv = v;
                                bi = (uint32_t)i;
                        }
                }
                tsr_block_first_max(&bv, &bi, fpart, upart);    // to every thread
                if (threadIdx.x == 0) {
                        o->top_logprobs[j] = bv;
                        o->top_ids[j] = bi;
                }
                pv = bv;
                pi = bi;
        }
}

extern "C" tsr_status tsr_cuda_logprobs(cudaStream_t stream, tsr_row_logprobs *out, const float *x, size_t rows,
                                        size_t n, const uint32_t *tokens, const uint32_t *top) {
        if (rows == 0)
                return TSR_OK;
        logprobs_kernel<<<(unsigned)rows, threads, 0, stream>>>(out, x, (int)n, tokens, top);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
