/* tensor.h - a typed view of backend memory: dtype, shape, strides, and which backend
 * owns the bytes.
 *
 * A tensor is a plain struct that callers embed (weights tables, a model description),
 * in the style of llama2.c's annotated arrays with the annotations made data.  Shapes
 * are row-major and outermost first: shape[n_dims - 1] is the row, the index that varies
 * fastest, written (rows, cols) as in kernels.h.  A row of a block format (dtype.h) is
 * packed blocks, so the last dimension is always contiguous and a multiple of the
 * dtype's block_elems.
 *
 * Strides are in BYTES, because an element of a block format has no byte address of its
 * own while a row of it does: stride[i] for i < n_dims - 1 is the distance between
 * consecutive indices of dimension i; stride[n_dims - 1] is the block's size in bytes
 * (the step between blocks along a row, block_bytes).  Unused dimensions have shape 1
 * and the stride of the dimension inside them, so a 2-D tensor is a 4-D one too.
 *
 * `backend` says whose memory `data` is (host memory for the CPU backends, device memory
 * for CUDA): the ops and the memory calls of that backend are the only ones that may
 * touch it.  NULL means host memory no backend owns (a mapped file, a caller's array).
 * Not thread-safe in itself: the backend's rules (kernels.h) apply to the data. */
#ifndef TSR_KERNELS_TENSOR_H
#define TSR_KERNELS_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"
#include "kernels/dtype.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TSR_TENSOR_MAX_DIMS 4

typedef struct tsr_tensor {
        tsr_dtype dtype;
        uint32_t n_dims;                        /* 1 .. TSR_TENSOR_MAX_DIMS */
        size_t shape[TSR_TENSOR_MAX_DIMS];      /* elements per dimension, outermost first */
        size_t stride[TSR_TENSOR_MAX_DIMS];     /* bytes (see above) */
        tsr_backend *backend;                   /* owner of data's memory; NULL: host, nobody's */
        void *data;                             /* first byte of element [0, 0, ...] */
        bool owns_data;                         /* data came from tsr_tensor_alloc: tsr_tensor_done frees it */
        /* fp8_e4m3 and nvfp4 weights: their per-tensor scales for tsr_backend_matmul_scaled
         * (ModelOpt's weight_scale / weight_scale_2 and input_scale); zero otherwise. */
        tsr_matmul_scales scales;
} tsr_tensor;

/* Describe existing memory `data` (of `be`, or host memory when be is NULL) as a
 * contiguous tensor of `dtype` and `shape` (n_dims entries).  Borrows data: the tensor
 * does not free it.  TSR_E_INVAL for a dtype out of range, n_dims outside 1..4, a zero
 * dimension, or a last dimension that is not a multiple of the dtype's block;
 * TSR_E_LIMIT when the size overflows.  *t written only on success. */
tsr_status tsr_tensor_init(tsr_tensor *t, tsr_dtype dtype, uint32_t n_dims, const size_t *shape, tsr_backend *be,
                           void *data);
/* The same, with new memory from tsr_backend_mem_alloc(be) that the tensor owns
 * (uninitialised).  TSR_E_NOMEM (TSR_E_CUDA) from the allocation, or the errors above. */
tsr_status tsr_tensor_alloc(tsr_tensor *t, tsr_backend *be, tsr_dtype dtype, uint32_t n_dims, const size_t *shape);
/* Free the memory the tensor owns (tsr_backend_mem_free) and clear *t; borrowed memory
 * is left alone.  Accepts NULL and a cleared tensor. */
void tsr_tensor_done(tsr_tensor *t);

/* Elements in all (product of the shape). */
size_t tsr_tensor_n_elems(const tsr_tensor *t);
/* Bytes of one row (the last dimension). */
size_t tsr_tensor_row_bytes(const tsr_tensor *t);
/* Bytes of the whole tensor when contiguous. */
size_t tsr_tensor_n_bytes(const tsr_tensor *t);
/* True when the rows are packed back to back with no gaps (strides of tsr_tensor_init). */
bool tsr_tensor_is_contiguous(const tsr_tensor *t);

#ifdef __cplusplus
}
#endif

#endif
