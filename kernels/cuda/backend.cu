// backend.cu - the CUDA backend: kernels.h's tsr_backend on one device.
//
// The context holds the device ordinal.  Every call of the backend first makes that
// device current on the calling thread (cudaSetDevice is cheap when it already is), so a
// thread may drive backends on different devices in turn, and two threads each their own.
// Kernels launch on the default stream (rmsnorm.cuh, add_rmsnorm.cuh); a stream per
// backend comes with the launchers that take one.  Memory is device memory: cudaMalloc,
// and cudaMemcpy for upload/download, which orders after the work queued on the default
// stream and returns when the copy is done (kernels.h: synchronous).
#include <stdlib.h>

#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/add_rmsnorm.cuh"
#include "kernels/cuda/rmsnorm.cuh"

struct cuda_ctx {
        int device;
};

static tsr_status use_device(tsr_backend *be) {
        TSR_CUDA_TRY(cudaSetDevice(static_cast<cuda_ctx *>(be->ctx)->device));
        return TSR_OK;
}

static void cuda_ctx_free(void *ctx) { free(ctx); }

static tsr_status cuda_mem_alloc(tsr_backend *be, size_t bytes, void **ret) {
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, bytes);     // 256-byte aligned
        if (e == cudaErrorMemoryAllocation) {
                (void)cudaGetLastError();          // not sticky: clear it
                return TSR_E_NOMEM;
        }
        TSR_CUDA_TRY(e);
        *ret = p;
        return TSR_OK;
}

static void cuda_mem_free(tsr_backend *be, void *p) {
        if (use_device(be) == TSR_OK)
                (void)cudaFree(p);
}

static tsr_status cuda_copy(tsr_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaMemcpy(dst, src, bytes, kind));
        return TSR_OK;
}

static tsr_status cuda_upload(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_copy(be, dst, src, bytes, cudaMemcpyHostToDevice);
}

static tsr_status cuda_download(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_copy(be, dst, src, bytes, cudaMemcpyDeviceToHost);
}

static tsr_status cuda_copy_d2d(tsr_backend *be, void *dst, const void *src, size_t bytes) {
        return cuda_copy(be, dst, src, bytes, cudaMemcpyDeviceToDevice);
}

static tsr_status cuda_synchronize(tsr_backend *be) {
        tsr_status st = use_device(be);
        if (st != TSR_OK)
                return st;
        TSR_CUDA_TRY(cudaDeviceSynchronize());
        return TSR_OK;
}

static tsr_status cuda_rmsnorm(tsr_backend *be, float *out, const float *x, const float *w, size_t rows, size_t dim,
                               float eps) {
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_rmsnorm(out, x, w, rows, dim, eps);
}

static tsr_status cuda_add_rmsnorm(tsr_backend *be, float *out, float *residual, const float *x, const float *w,
                                   size_t rows, size_t dim, float eps) {
        tsr_status st = use_device(be);
        return st != TSR_OK ? st : tsr_cuda_add_rmsnorm(out, residual, x, w, rows, dim, eps);
}

// Built by assignment: C++17 has no designated initialisers.  The ops CUDA does not
// have yet stay NULL (kernels.h: TSR_E_UNSUPPORTED), matmul included (no weight dtype).
static tsr_backend_ops make_cuda_ops(void) {
        tsr_backend_ops o = {};
        o.name = "cuda";
        o.host_memory = false;
        o.matmul_dtypes = 0;
        o.ctx_free = cuda_ctx_free;
        o.mem_alloc = cuda_mem_alloc;
        o.mem_free = cuda_mem_free;
        o.upload = cuda_upload;
        o.download = cuda_download;
        o.copy = cuda_copy_d2d;
        o.synchronize = cuda_synchronize;
        o.rmsnorm = cuda_rmsnorm;
        o.add_rmsnorm = cuda_add_rmsnorm;
        return o;
}

static const tsr_backend_ops cuda_ops = make_cuda_ops();

extern "C" tsr_status tsr_backend_cuda_new(int device, tsr_backend **ret) {
        int n = 0;
        if (!ret || device < 0)
                return TSR_E_INVAL;
        // Any failure to count devices (no driver, no device, a driver too old for this
        // runtime) means no usable device here, as before the backend had a handle.
        if (cudaGetDeviceCount(&n) != cudaSuccess || device >= n) {
                (void)cudaGetLastError();
                return TSR_E_NOTFOUND;
        }
        TSR_CUDA_TRY(cudaSetDevice(device));
        cuda_ctx *c = static_cast<cuda_ctx *>(malloc(sizeof *c));
        if (!c)
                return TSR_E_NOMEM;
        c->device = device;
        return tsr_backend_make(&cuda_ops, c, TSR_CPU_ISA_SCALAR, 1, ret);
}
