/* device_arrays.c - see device_arrays.h. */
#include "worker/model/device_arrays.h"

#include <stdlib.h>

#include "common/clock.h"
#include "common/log.h"

tsr_status tsr_dev_check(const tsr_backend *be, const char *family, bool split, tsr_dtype qdtype, char *err,
                         size_t errlen) {
        if (split) {
                tsr_errf(err, errlen, "tensor, expert or pipeline parallelism of %s on the %s backend is not "
                         "supported yet", family, tsr_backend_name(be));
                return TSR_E_UNSUPPORTED;
        }
        if (qdtype != TSR_DTYPE_F32 && !tsr_backend_supports(be, TSR_OP_MATMUL, qdtype)) {
                tsr_errf(err, errlen, "weights kept as %s cannot go to the %s backend yet",
                         tsr_dtype_get_info(qdtype)->name, tsr_backend_name(be));
                return TSR_E_UNSUPPORTED;
        }
        return TSR_OK;
}

unsigned tsr_dev_progress_tenths(size_t done, size_t total) {
        if (total < TSR_DEV_PROGRESS_MIN)
                return 0;
        if (done >= total)
                return 10;
        return (unsigned)((double)done / (double)total * 10.0);
}

void tsr_dev_progress_start(tsr_dev_progress *p, const tsr_backend *be, size_t total) {
        *p = (tsr_dev_progress){.device = tsr_backend_name(be), .total = total, .t0_ns = tsr_now_ns()};
}

static double mb_per_s(size_t bytes, double s) { return s > 0 ? (double)bytes / 1e6 / s : 0.0; }

void tsr_dev_progress_add(tsr_dev_progress *p, size_t bytes) {
        p->done += bytes;
        unsigned t = tsr_dev_progress_tenths(p->done, p->total);
        if (t <= p->tenths || t == 10)  /* the last tenth is the closing line's */
                return;
        p->tenths = t;
        double s = (double)(tsr_now_ns() - p->t0_ns) / 1e9;
        log_info("copying weights to the %s device: %.1f/%.1f MB (%u%%), %.1f MB/s", p->device,
                 (double)p->done / 1e6, (double)p->total / 1e6, 10 * t, mb_per_s(p->done, s));
}

void tsr_dev_progress_done(const tsr_dev_progress *p, size_t n_arrays) {
        double s = (double)(tsr_now_ns() - p->t0_ns) / 1e9;
        log_info("weights on the %s device: %.1f MB in %zu arrays, %.2f s (%.1f MB/s)", p->device,
                 (double)p->done / 1e6, n_arrays, s, mb_per_s(p->done, s));
}

void tsr_dev_list_add(tsr_dev_list *l, void **at, size_t bytes) {
        if (!*at || l->nomem)
                return;
        if (l->n == l->cap) {
                size_t cap = l->cap ? 2 * l->cap : 64;
                tsr_dev_array *a = realloc(l->a, cap * sizeof *a);
                if (!a) {
                        l->nomem = true;
                        return;
                }
                l->a = a;
                l->cap = cap;
        }
        l->a[l->n++] = (tsr_dev_array){.at = at, .bytes = bytes};
}

/* Copy the n arrays a into be's memory, all or nothing (tsr_dev_list_move). */
static tsr_status arrays_move(tsr_backend *be, tsr_dev_array *a, size_t n, char *err, size_t errlen) {
        size_t need = 0, free_b = 0, total_b = 0;
        tsr_status st = TSR_OK;

        for (size_t i = 0; i < n; i++)
                need += a[i].bytes;
        /* a model larger than the device is one clear error here, before any allocation */
        if (tsr_backend_mem_info(be, &free_b, &total_b) == TSR_OK && need > free_b) {
                tsr_errf(err, errlen, "the weights need %.2f GiB on the %s device, which has %.2f GiB free of "
                         "%.2f GiB", (double)need / (1 << 30), tsr_backend_name(be), (double)free_b / (1 << 30),
                         (double)total_b / (1 << 30));
                return TSR_E_NOMEM;
        }
        /* every copy first, the host arrays untouched; then the swap: a failure leaves the
         * model as it was */
        tsr_dev_progress pr;
        tsr_dev_progress_start(&pr, be, need);
        for (size_t i = 0; i < n; i++)
                a[i].dev = NULL;
        for (size_t i = 0; i < n && st == TSR_OK; i++)
                if ((st = tsr_backend_mem_alloc(be, a[i].bytes, &a[i].dev)) == TSR_OK &&
                    (st = tsr_backend_upload(be, a[i].dev, *a[i].at, a[i].bytes)) == TSR_OK)
                        tsr_dev_progress_add(&pr, a[i].bytes);
        if (st != TSR_OK) {
                for (size_t i = 0; i < n; i++)
                        tsr_backend_mem_free(be, a[i].dev);
                tsr_errf(err, errlen, "cannot copy the weights to the %s backend: %s", tsr_backend_name(be),
                         tsr_status_str(st));
                return st;
        }
        for (size_t i = 0; i < n; i++) {
                free(*a[i].at);
                *a[i].at = a[i].dev;
        }
        tsr_dev_progress_done(&pr, n);
        return TSR_OK;
}

tsr_status tsr_dev_list_move(tsr_backend *be, tsr_dev_list *l, char *err, size_t errlen) {
        tsr_status st = l->nomem ? TSR_E_NOMEM : arrays_move(be, l->a, l->n, err, errlen);
        free(l->a);
        *l = (tsr_dev_list){0};
        return st;
}

tsr_status tsr_acts_bind(tsr_backend *mem, float **kept, size_t *kept_bytes, float **const *acts,
                         const size_t *n_floats, size_t n) {
        for (size_t i = 0; i < n; i++) {
                size_t bytes = (n_floats[i] ? n_floats[i] : 1) * sizeof(float);
                if (!mem) {
                        if (!(*acts[i] = malloc(bytes)))
                                return TSR_E_NOMEM;
                        continue;
                }
                if (kept_bytes[i] < bytes) {    /* grow the kept array (its contents are a step's) */
                        tsr_backend_mem_free(mem, kept[i]);
                        kept[i] = NULL;
                        kept_bytes[i] = 0;
                        if (tsr_backend_mem_alloc(mem, bytes, (void **)&kept[i]) != TSR_OK)
                                return TSR_E_NOMEM;
                        kept_bytes[i] = bytes;
                }
                *acts[i] = kept[i];
        }
        return TSR_OK;
}
