/* device_arrays.h - what the families that run on a device backend (llama4.c,
 * nemotron_h.c) share: moving a model's weight arrays into the device's memory in one
 * all-or-nothing pass, and binding a step's activation arrays to ones kept in the
 * device's memory for the model's life.  Main thread (the move), or the one thread that
 * runs the model's forward (the activations). */
#ifndef TSR_WORKER_MODEL_DEVICE_ARRAYS_H
#define TSR_WORKER_MODEL_DEVICE_ARRAYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"
#include "kernels/kernels.h"

/* The refusals every family's to_backend shares: a model split by tensor, expert or
 * pipeline parallelism (`split`), weights kept as `qdtype` (TSR_DTYPE_F32: none) whose
 * matmul the backend lacks.  TSR_E_UNSUPPORTED with err naming `family` and the cause;
 * TSR_OK when the model may go. */
tsr_status tsr_dev_check(const tsr_backend *be, const char *family, bool split, tsr_dtype qdtype, char *err,
                         size_t errlen);

/* One host array to move: where the model points at it, and its bytes (dev: scratch). */
typedef struct tsr_dev_array {
        void **at;
        size_t bytes;
        void *dev;
} tsr_dev_array;

/* The arrays a model moves, gathered one by one (zero-initialise it). */
typedef struct tsr_dev_list {
        tsr_dev_array *a;
        size_t n, cap;
        bool nomem;                     /* an add failed: the move answers TSR_E_NOMEM */
} tsr_dev_list;

/* A weight upload's progress, for its log lines (the loader's own progress lines stop at
 * the host): one a tenth of the bytes when the upload is large (TSR_DEV_PROGRESS_MIN
 * bytes or more: a GPU-sized model takes seconds), and one at the end with the time and
 * the rate.  Main thread. */
#define TSR_DEV_PROGRESS_MIN ((size_t)1 << 30)
typedef struct tsr_dev_progress {
        const char *device;             /* the backend's name */
        size_t total, done;
        unsigned tenths;                /* the tenths already logged */
        uint64_t t0_ns;
} tsr_dev_progress;

/* Start counting an upload of `total` bytes to be. */
void tsr_dev_progress_start(tsr_dev_progress *p, const tsr_backend *be, size_t total);
/* `bytes` more copied: a line when they cross a tenth of a large upload. */
void tsr_dev_progress_add(tsr_dev_progress *p, size_t bytes);
/* The closing line: "weights on the D device: X MB in N arrays, S s (R MB/s)". */
void tsr_dev_progress_done(const tsr_dev_progress *p, size_t n_arrays);
/* The tenths of `total` that `done` has reached (0..10), for a large total; 0 below
 * TSR_DEV_PROGRESS_MIN (no lines but the last). */
unsigned tsr_dev_progress_tenths(size_t done, size_t total);

/* Add the host array *at of `bytes` bytes; nothing when *at is NULL. */
void tsr_dev_list_add(tsr_dev_list *l, void **at, size_t bytes);

/* Copy the list's arrays into be's memory; once every copy succeeded, free the host
 * arrays and point each *at at its copy, and log one line.  A total larger than the
 * device's free memory is TSR_E_NOMEM before any allocation (err: the sizes); a failed
 * allocation or copy frees the copies made, leaves every host array as it was and names
 * the cause in err.  The list is emptied either way. */
tsr_status tsr_dev_list_move(tsr_backend *be, tsr_dev_list *l, char *err, size_t errlen);

/* A step's n activation arrays *acts[i] of n_floats[i] floats (at least one each): with
 * mem NULL, fresh host arrays (malloc; the caller frees them); else views of the kept
 * device arrays kept[i] (of kept_bytes[i] bytes), each grown first where too small (its
 * old contents are a step's scratch: not kept).  TSR_E_NOMEM: some *acts[i] are NULL,
 * the rest set (free as above). */
tsr_status tsr_acts_bind(tsr_backend *mem, float **kept, size_t *kept_bytes, float **const *acts,
                         const size_t *n_floats, size_t n);

#endif
