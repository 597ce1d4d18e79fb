/* tensor.c - tensor.h: contiguous strides from a shape, and the memory a tensor owns. */
#include <string.h>

#include "kernels/tensor.h"

tsr_status tsr_tensor_init(tsr_tensor *t, tsr_dtype dtype, uint32_t n_dims, const size_t *shape, tsr_backend *be,
                           void *data) {
        const tsr_dtype_info *info = tsr_dtype_get_info(dtype);
        tsr_tensor x = {.dtype = dtype, .n_dims = n_dims, .backend = be, .data = data};
        size_t bytes;

        if (!t || !info || !shape || n_dims == 0 || n_dims > TSR_TENSOR_MAX_DIMS)
                return TSR_E_INVAL;
        for (uint32_t i = 0; i < TSR_TENSOR_MAX_DIMS; i++) {
                x.shape[i] = i < n_dims ? shape[i] : 1;
                if (x.shape[i] == 0)
                        return TSR_E_INVAL;
        }
        tsr_status st = tsr_dtype_row_bytes(dtype, x.shape[n_dims - 1], &bytes);
        if (st != TSR_OK)
                return st;
        /* Innermost first: a block's bytes, then one row, then each outer dimension. */
        x.stride[n_dims - 1] = info->block_bytes;
        for (uint32_t i = n_dims - 1; i-- > 0;) {
                x.stride[i] = bytes;
                if (x.shape[i] > SIZE_MAX / bytes)
                        return TSR_E_LIMIT;
                bytes *= x.shape[i];
        }
        for (uint32_t i = n_dims; i < TSR_TENSOR_MAX_DIMS; i++)
                x.stride[i] = x.stride[n_dims - 1];
        *t = x;
        return TSR_OK;
}

tsr_status tsr_tensor_alloc(tsr_tensor *t, tsr_backend *be, tsr_dtype dtype, uint32_t n_dims, const size_t *shape) {
        tsr_tensor x;
        void *p = NULL;

        if (!be)
                return TSR_E_INVAL;
        tsr_status st = tsr_tensor_init(&x, dtype, n_dims, shape, be, NULL);
        if (st != TSR_OK)
                return st;
        st = tsr_backend_mem_alloc(be, tsr_tensor_n_bytes(&x), &p);
        if (st != TSR_OK)
                return st;
        x.data = p;
        x.owns_data = true;
        *t = x;
        return TSR_OK;
}

void tsr_tensor_done(tsr_tensor *t) {
        if (!t)
                return;
        if (t->owns_data)
                tsr_backend_mem_free(t->backend, t->data);
        memset(t, 0, sizeof *t);
}

size_t tsr_tensor_n_elems(const tsr_tensor *t) {
        size_t n = 1;
        for (uint32_t i = 0; i < t->n_dims; i++)
                n *= t->shape[i];
        return n;
}

size_t tsr_tensor_row_bytes(const tsr_tensor *t) {
        size_t bytes = 0;
        tsr_dtype_row_bytes(t->dtype, t->shape[t->n_dims - 1], &bytes);
        return bytes;
}

size_t tsr_tensor_n_bytes(const tsr_tensor *t) {
        size_t bytes = tsr_tensor_row_bytes(t);
        for (uint32_t i = 0; i + 1 < t->n_dims; i++)
                bytes *= t->shape[i];
        return bytes;
}

bool tsr_tensor_is_contiguous(const tsr_tensor *t) {
        const tsr_dtype_info *info = tsr_dtype_get_info(t->dtype);
        size_t want = tsr_tensor_row_bytes(t);

        if (!info || t->stride[t->n_dims - 1] != info->block_bytes)
                return false;
        for (uint32_t i = t->n_dims - 1; i-- > 0;) {
                if (t->shape[i] > 1 && t->stride[i] != want)
                        return false;
                want *= t->shape[i];
        }
        return true;
}
