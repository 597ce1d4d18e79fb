// mamba.cu - kernels.h's Mamba-2 mixer (tsr_backend_mamba_mixer), relu_sq and round_bf16 on the
// device, beside their CPU specification (cpu/mamba.c, cpu/ref.c).  The mixer runs the
// recurrence for every token (cpu/mamba.c also runs the chunked form on whole chunks: the
// same sum in another order), so it agrees with the CPU backends within tolerance, not
// bitwise; within the CUDA backend the bits are fixed (no atomics, fixed reduction
// orders).  Four launches on the stream, in this order:
//   1. conv: each row's xBC through the causal conv and SiLU, and its heads' steps Δ,
//      into the work arrays (reads the slots' conv state as it was before the step);
//   2. scan: a block per (sequence, head), its tokens in order; a warp per head channel p
//      at a time, the lanes over the state entries; the prefix-cache saves of the SSM
//      state as the tokens pass them;
//   3. gate and norm: a block per (row, group);
//   4. conv state: a thread per (sequence, channel): the saves' rows first, then the
//      slot's K-1 rows moved on in place (row r from window row n + r, rows ascending:
//      what it reads is not yet written).
// Every product and sum is spelled with the _rn intrinsics, so nvcc fuses none into an FMA.
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

static const int kThreads = 256;
static const int kScanWarps = 4;

static unsigned grid_for(size_t n) {
        size_t b = (n + kThreads - 1) / kThreads;
        return (unsigned)(b < 65536 ? b : 65536);
}

__device__ static inline float silu_f(float a) { return __fdiv_rn(a, __fadd_rn(1.0f, expf(-a))); }

// torch.nn.functional.softplus (beta 1, threshold 20).
__device__ static inline float softplus_f(float a) { return a > 20.0f ? a : log1pf(expf(a)); }

struct mamba_args {
        tsr_cuda_mamba_shape s;
        tsr_mamba_weights w;
        const float *proj;
        float *conv, *ssm, *y, *leaves;
        float *xbc, *dt;                // work: (rows, conv_dim), (rows, H)
        const uint32_t *seq;            // (n_seqs, TSR_CUDA_MAMBA_SEQ_WORDS)
        const uint32_t *row_seq;        // (rows,) the sequence of each row
        const uint32_t *saves;          // (total saves, 2): pos, slot
};

__device__ static inline size_t d_inner(const tsr_cuda_mamba_shape &s) { return s.heads * s.head_dim; }
__device__ static inline size_t conv_dim(const tsr_cuda_mamba_shape &s) {
        return d_inner(s) + 2 * s.groups * s.state;
}

// Window row w (0 .. K-2+n) of sequence q for channel ch: the slot's conv state row w
// before the step, then the sequence's own xBC rows.
__device__ static inline float window(const mamba_args &a, const uint32_t *q, size_t w, size_t ch) {
        size_t K = a.s.conv_kernel, cd = conv_dim(a.s), pr = d_inner(a.s) + cd + a.s.heads;
        if (w < K - 1)
                return a.conv[(size_t)q[TSR_CUDA_MAMBA_SLOT] * (K - 1) * cd + w * cd + ch];
        return a.proj[((size_t)q[TSR_CUDA_MAMBA_ROW] + w - (K - 1)) * pr + d_inner(a.s) + ch];
}

__global__ static void conv_kernel(mamba_args a, size_t rows) {
        size_t cd = conv_dim(a.s), H = a.s.heads, K = a.s.conv_kernel, width = cd + H;
        size_t pr = d_inner(a.s) + cd + H;
        for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < rows * width;
             e += (size_t)gridDim.x * blockDim.x) {
                size_t r = e / width, ch = e % width;
                if (a.row_seq[r] == TSR_CUDA_MAMBA_NO_SEQ)
                        continue;
                const uint32_t *q = a.seq + (size_t)a.row_seq[r] * TSR_CUDA_MAMBA_SEQ_WORDS;
                size_t t = r - q[TSR_CUDA_MAMBA_ROW];
                if (ch < cd) {
                        float acc = a.w.conv_b ? a.w.conv_b[ch] : 0.0f;
                        for (size_t k = 0; k < K; k++)
                                acc = __fadd_rn(acc, __fmul_rn(a.w.conv_w[ch * K + k], window(a, q, t + k, ch)));
                        a.xbc[r * cd + ch] = silu_f(acc);
                } else {
                        size_t h = ch - cd;
                        float d = softplus_f(__fadd_rn(a.proj[r * pr + d_inner(a.s) + cd + h], a.w.dt_bias[h]));
                        a.dt[r * H + h] = fminf(fmaxf(d, a.s.dt_min), a.s.dt_max);
                }
        }
}

// A block per (sequence, head): blockIdx.x = seq * H + h; kScanWarps warps, warp w takes
// the head's channels p = w, w + kScanWarps, ...; lane l its state entries n = l, l + 32, ...
// The read-out sum: each lane's entries in n order, then the lanes by a butterfly of
// shuffles (the same tree every time).
__global__ static void scan_kernel(mamba_args a) {
        size_t H = a.s.heads, P = a.s.head_dim, NS = a.s.state, G = a.s.groups, hpg = H / G;
        size_t h = blockIdx.x % H, di = d_inner(a.s), cd = conv_dim(a.s);
        const uint32_t *q = a.seq + (size_t)(blockIdx.x / H) * TSR_CUDA_MAMBA_SEQ_WORDS;
        size_t row0 = q[TSR_CUDA_MAMBA_ROW], n = q[TSR_CUDA_MAMBA_N], past = q[TSR_CUDA_MAMBA_PAST];
        const uint32_t *saves = a.saves + 2 * (size_t)q[TSR_CUDA_MAMBA_SAVE_FIRST];
        size_t n_saves = q[TSR_CUDA_MAMBA_N_SAVES], next_save = 0, g = h / hpg;
        unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        float *S = a.ssm + (size_t)q[TSR_CUDA_MAMBA_SLOT] * H * P * NS + h * P * NS;
        float A = a.w.A[h], Dh = a.w.D[h];

        for (size_t t = 0; t < n; t++) {
                size_t r = row0 + t;
                const float *xbc = a.xbc + r * cd, *B = xbc + di + g * NS, *C = xbc + di + G * NS + g * NS;
                float d = a.dt[r * H + h], dA = expf(__fmul_rn(d, A));
                for (size_t p = warp; p < P; p += kScanWarps) {
                        float xv = xbc[h * P + p], acc = 0.0f;
                        float *Sp = S + p * NS;
                        for (size_t s = lane; s < NS; s += 32) {
                                float v = __fadd_rn(__fmul_rn(Sp[s], dA), __fmul_rn(__fmul_rn(d, B[s]), xv));
                                Sp[s] = v;
                                acc = __fadd_rn(acc, __fmul_rn(v, C[s]));
                        }
                        for (int off = 16; off > 0; off /= 2)
                                acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
                        if (lane == 0)
                                a.y[r * di + h * P + p] = __fadd_rn(acc, __fmul_rn(xv, Dh));
                }
                if (next_save < n_saves && saves[2 * next_save] == past + t + 1) {
                        // every warp's writes of S for this token first
                        __syncthreads();
                        float *to = a.ssm + (size_t)saves[2 * next_save + 1] * H * P * NS + h * P * NS;
                        for (size_t i = threadIdx.x; i < P * NS; i += blockDim.x)
                                to[i] = S[i];
                        __syncthreads();
                        next_save++;
                }
        }
}

// A block per (row, group): y *= silu(z) over the group's channels, then its norm, or
// (leaves) the sums of squares of the row's n_leaves channel slices.
__global__ static void gate_norm_kernel(mamba_args a, size_t rows) {
        __shared__ float partial[kThreads];
        size_t G = a.s.groups, di = d_inner(a.s), gs = di / G, cd = conv_dim(a.s);
        size_t r = blockIdx.x / G, g = blockIdx.x % G, pr = di + cd + a.s.heads;
        float *u = a.y + r * di + g * gs;
        const float *z = a.proj + r * pr + g * gs;
        if (a.row_seq[r] == TSR_CUDA_MAMBA_NO_SEQ)     // a row of no sequence: left as it is
                return;
        for (size_t e = threadIdx.x; e < gs; e += blockDim.x)
                u[e] = __fmul_rn(u[e], silu_f(z[e]));
        __syncthreads();
        if (a.leaves) {
                size_t lw = gs / a.s.n_leaves;
                for (size_t l = 0; l < a.s.n_leaves; l++) {
                        float part = 0.0f;
                        for (size_t e = l * lw + threadIdx.x; e < (l + 1) * lw; e += blockDim.x)
                                part = __fadd_rn(part, __fmul_rn(u[e], u[e]));
                        float ss = tsr_block_sum_fixed_tree(part, partial);
                        if (threadIdx.x == 0)
                                a.leaves[l * rows + r] = ss;
                }
                return;
        }
        float part = 0.0f;
        for (size_t e = threadIdx.x; e < gs; e += blockDim.x)
                part = __fadd_rn(part, __fmul_rn(u[e], u[e]));
        float ss = tsr_block_sum_fixed_tree(part, partial);
        float rs = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(ss, (float)gs), a.s.eps)));
        for (size_t e = threadIdx.x; e < gs; e += blockDim.x)
                u[e] = __fmul_rn(a.w.norm[g * gs + e], __fmul_rn(u[e], rs));
}

__global__ static void conv_state_kernel(mamba_args a, size_t n_seqs) {
        size_t cd = conv_dim(a.s), K = a.s.conv_kernel;
        for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n_seqs * cd;
             e += (size_t)gridDim.x * blockDim.x) {
                size_t ch = e % cd;
                const uint32_t *q = a.seq + (e / cd) * TSR_CUDA_MAMBA_SEQ_WORDS;
                const uint32_t *saves = a.saves + 2 * (size_t)q[TSR_CUDA_MAMBA_SAVE_FIRST];
                size_t past = q[TSR_CUDA_MAMBA_PAST], n = q[TSR_CUDA_MAMBA_N];
                for (size_t k = 0; k < q[TSR_CUDA_MAMBA_N_SAVES]; k++) {
                        size_t t = saves[2 * k] - past;
                        float *to = a.conv + (size_t)saves[2 * k + 1] * (K - 1) * cd;
                        for (size_t r = 0; r + 1 < K; r++)
                                to[r * cd + ch] = window(a, q, t + r, ch);
                }
                float *cs = a.conv + (size_t)q[TSR_CUDA_MAMBA_SLOT] * (K - 1) * cd;
                for (size_t r = 0; r + 1 < K; r++)
                        cs[r * cd + ch] = window(a, q, n + r, ch);
        }
}

extern "C" tsr_status tsr_cuda_mamba_mixer(cudaStream_t stream, const tsr_cuda_mamba_shape *s,
                                           const tsr_mamba_weights *w, const float *proj, size_t rows, float *conv,
                                           float *ssm, const uint32_t *seq, size_t n_seqs, const uint32_t *row_seq,
                                           const uint32_t *saves, float *y, float *leaves, float *work) {
        mamba_args a = {*s, *w, proj, conv, ssm, y, leaves, NULL, NULL, seq, row_seq, saves};
        size_t cd = s->heads * s->head_dim + 2 * s->groups * s->state;
        a.xbc = work;
        a.dt = work + rows * cd;
        conv_kernel<<<grid_for(rows * (cd + s->heads)), kThreads, 0, stream>>>(a, rows);
        TSR_CUDA_TRY(cudaGetLastError());
        scan_kernel<<<(unsigned)(n_seqs * s->heads), 32 * kScanWarps, 0, stream>>>(a);
        TSR_CUDA_TRY(cudaGetLastError());
        gate_norm_kernel<<<(unsigned)(rows * s->groups), kThreads, 0, stream>>>(a, rows);
        TSR_CUDA_TRY(cudaGetLastError());
        if (s->conv_kernel > 1) {
                conv_state_kernel<<<grid_for(n_seqs * cd), kThreads, 0, stream>>>(a, n_seqs);
                TSR_CUDA_TRY(cudaGetLastError());
        }
        return TSR_OK;
}

// max(x, 0)^2, a NaN kept: cpu/ref.c's tsr_ref_relu_sq.
__global__ static void relu_sq_kernel(float *x, size_t n) {
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
                float v = x[i];
                x[i] = v > 0.0f || isnan(v) ? __fmul_rn(v, v) : 0.0f;
        }
}

// tsr_f32_to_bf16 then back: bf16.cuh's rounding, the low 16 bits cleared.
__global__ static void round_bf16_kernel(float *x, size_t n) {
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
                x[i] = __uint_as_float((uint32_t)tsr_cuda_f32_to_bf16_bits(x[i]) << 16);
}

extern "C" tsr_status tsr_cuda_round_bf16(cudaStream_t stream, float *x, size_t n) {
        round_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}

extern "C" tsr_status tsr_cuda_relu_sq(cudaStream_t stream, float *x, size_t n) {
        relu_sq_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n);
        TSR_CUDA_TRY(cudaGetLastError());
        return TSR_OK;
}
