// sample.cu - kernels.h's tsr_backend_sample on the device: cpu/ref.c's tsr_ref_sample
// step for step, so both draw the same token from the same row and u.  One block of
// TSR_SAMPLE_CHUNKS threads per row; thread c owns chunk c (ref's sample_chunk) and sums
// it in index order; thread 0 adds the chunk sums in order, as ref does; every float
// operation is an _rn intrinsic (nvcc may not fuse them) and exp is exp.h's, ported below.
#include <math.h>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

#define CH TSR_SAMPLE_CHUNKS

// exp.h's tsr_exp with each step rounded once as there (fmaf is one fused step there too).
__device__ static float dev_exp(float x) {
        x = -104.0f > x ? -104.0f : x;
        x = 89.0f < x ? 89.0f : x;
        const float shift = 0x1.8p23f;
        float z = __fmaf_rn(x, 0x1.715476p+0f, shift);
        float n = __fsub_rn(z, shift);
        float r = __fmaf_rn(n, -0x1.62e43p-1f, x);
        r = __fmaf_rn(n, 0x1.05c61p-29f, r);
        float p = 1.9875691500e-4f;
        p = __fmaf_rn(p, r, 1.3981999507e-3f);
        p = __fmaf_rn(p, r, 8.3334519073e-3f);
        p = __fmaf_rn(p, r, 4.1665795894e-2f);
        p = __fmaf_rn(p, r, 1.6666665459e-1f);
        p = __fmaf_rn(p, r, 5.0000001201e-1f);
        float y = __fadd_rn(__fmaf_rn(p, __fmul_rn(r, r), r), 1.0f);
        int k = (int)(__float_as_uint(z) - __float_as_uint(shift)), k1 = k >> 1, k2 = k - k1;
        return __fmul_rn(__fmul_rn(y, __uint_as_float((uint32_t)(k1 + 127) << 23)),
                         __uint_as_float((uint32_t)(k2 + 127) << 23));
}

struct row_state {
        double part[CH];        // each chunk's sum (or count)
        double total;
        float t;
        int flag;
        uint32_t lo, hi;
};

// Thread 0 adds the chunks' parts in order; all threads get the total.
__device__ static double chunk_total(row_state *s, double mine) {
        s->part[threadIdx.x] = mine;
        __syncthreads();
        if (threadIdx.x == 0) {
                double t = 0.0;
                for (int c = 0; c < CH; c++)
                        t += s->part[c];
                s->total = t;
        }
        __syncthreads();
        double t = s->total;
        __syncthreads();
        return t;
}

__device__ static double chunk_mass(row_state *s, const float *e, size_t lo, size_t hi, float t) {
        double m = 0.0;
        for (size_t i = lo; i < hi; i++)
                if (e[i] >= t)
                        m = __dadd_rn(m, (double)e[i]);
        return chunk_total(s, m);
}

// ref's sample_threshold: the largest t (by bits) with count >= k (goal < 0) or mass >= goal.
__device__ static float threshold(row_state *s, const float *e, size_t lo, size_t hi, size_t k, double goal) {
        if (threadIdx.x == 0) {
                s->lo = 0;
                s->hi = 0x3f800001u;
        }
        __syncthreads();
        while (s->hi - s->lo > 1) {
                uint32_t mid = s->lo + (s->hi - s->lo) / 2;
                float t = __uint_as_float(mid);
                bool ok;
                if (goal < 0) {
                        double cnt = 0;
                        for (size_t i = lo; i < hi; i++)
                                cnt += e[i] >= t;
                        ok = chunk_total(s, cnt) >= (double)k;
                } else {
                        ok = chunk_mass(s, e, lo, hi, t) >= goal;
                }
                if (threadIdx.x == 0) {
                        if (ok)
                                s->lo = mid;
                        else
                                s->hi = mid;
                }
                __syncthreads();
        }
        float t = __uint_as_float(s->lo);
        __syncthreads();
        return t;
}

__global__ static void sample_kernel(uint32_t *out, float *x, size_t n, const tsr_draw *draws) {
        __shared__ row_state s;
        const tsr_draw d = draws[blockIdx.x];
        if (d.temperature == 0.0f)
                return;         // uniform over the block
        float *e = x + blockIdx.x * n;
        size_t len = (n + CH - 1) / CH, lo = threadIdx.x * len < n ? threadIdx.x * len : n;
        size_t hi = lo + len < n ? lo + len : n;

        // validity and the maximum of x (exact in any order)
        int bad = 0;
        float xmax = -INFINITY;
        for (size_t i = lo; i < hi; i++) {
                float v = e[i];
                bad |= isnan(v) || v == INFINITY;
                xmax = v > xmax ? v : xmax;
        }
        s.part[threadIdx.x] = xmax;
        if (threadIdx.x == 0)
                s.flag = 0;
        __syncthreads();
        if (bad)
                s.flag = 1;
        if (threadIdx.x == 0) {
                float mx = -INFINITY;
                for (int c = 0; c < CH; c++)
                        mx = (float)s.part[c] > mx ? (float)s.part[c] : mx;
                s.t = mx;
        }
        __syncthreads();
        xmax = s.t;
        if (s.flag || xmax == -INFINITY) {
                if (threadIdx.x == 0)
                        out[blockIdx.x] = TSR_ARGMAX_NONE;
                return;
        }
        float m = __fdiv_rn(xmax, d.temperature);
        for (size_t i = lo; i < hi; i++) {
                float w = __fdiv_rn(e[i], d.temperature);
                e[i] = isinf(m) ? (w == m ? 1.0f : 0.0f) : dev_exp(__fsub_rn(w, m));
        }
        __syncthreads();
        if (d.min_p > 0.0f) {
                double z = chunk_mass(&s, e, lo, hi, 0.0f);
                float thr = __fmul_rn((float)__drcp_rn(z), d.min_p);
                for (size_t i = lo; i < hi; i++)
                        if ((float)__ddiv_rn((double)e[i], z) < thr)
                                e[i] = 0.0f;
                __syncthreads();
        }
        if (d.top_k > 0 && (size_t)d.top_k < n) {
                float t = threshold(&s, e, lo, hi, (size_t)d.top_k, -1.0);
                for (size_t i = lo; i < hi; i++)
                        if (e[i] < t)
                                e[i] = 0.0f;
                __syncthreads();
        }
        if (d.top_p < 1.0f) {
                double goal = __dmul_rn((double)d.top_p, chunk_mass(&s, e, lo, hi, 0.0f));
                float t = threshold(&s, e, lo, hi, 0, goal);
                for (size_t i = lo; i < hi; i++)
                        if (e[i] < t)
                                e[i] = 0.0f;
                __syncthreads();
        }
        double target = __dmul_rn(d.u, chunk_mass(&s, e, lo, hi, 0.0f));
        double mine = 0.0;
        for (size_t i = lo; i < hi; i++)
                mine = __dadd_rn(mine, (double)e[i]);
        s.part[threadIdx.x] = mine;
        __syncthreads();
        if (threadIdx.x != 0)
                return;
        double cum = 0.0;
        for (int c = 0; c < CH; c++) {
                size_t clo = (size_t)c * len < n ? (size_t)c * len : n, chi = clo + len < n ? clo + len : n;
                if (!(__dadd_rn(cum, s.part[c]) > target)) {
                        cum = __dadd_rn(cum, s.part[c]);
                        continue;
                }
                for (size_t i = clo; i < chi; i++) {
                        if (e[i] <= 0.0f)
                                continue;
                        cum = __dadd_rn(cum, (double)e[i]);
                        if (cum > target) {
                                out[blockIdx.x] = (uint32_t)i;
                                return;
                        }
                }
        }
        for (size_t i = n; i-- > 0;)
                if (e[i] > 0.0f) {
                        out[blockIdx.x] = (uint32_t)i;
                        return;
                }
        out[blockIdx.x] = TSR_ARGMAX_NONE;
}

extern "C" tsr_status tsr_cuda_sample(cudaStream_t stream, uint32_t *out, float *x, size_t rows, size_t n,
                                      const tsr_draw *draws) {
        if (rows == 0)
                return TSR_OK;
        sample_kernel<<<(unsigned)rows, CH, 0, stream>>>(out, x, n, draws);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
