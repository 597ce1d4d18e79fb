/* buf.h - growable byte buffer with a hard cap.
 *
 * Embedded by its owner (tsr_buf_init/tsr_buf_done).  Appends past `limit` fail with
 * TSR_E_LIMIT and leave the buffer unchanged: every client-controlled size in
 * Tessera goes through one of these.  Not thread-safe. */
#ifndef TSR_BUF_H
#define TSR_BUF_H

#include <stddef.h>
#include <stdint.h>
#include "tsr_status.h"

typedef struct tsr_buf {
        uint8_t *data;    /* NUL-terminated after every successful append (not counted in len) */
        size_t len;
        size_t alloc;
        size_t limit;     /* most bytes len may reach */
} tsr_buf;

void tsr_buf_init(tsr_buf *b, size_t limit);
void tsr_buf_done(tsr_buf *b);
/* Make room for `n` more bytes without changing len. */
tsr_status tsr_buf_reserve(tsr_buf *b, size_t n);
tsr_status tsr_buf_append(tsr_buf *b, const void *p, size_t n);
tsr_status tsr_buf_append_str(tsr_buf *b, const char *s);
tsr_status tsr_buf_appendf(tsr_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Drop the first `n` bytes (n > len drops everything). */
void tsr_buf_consume(tsr_buf *b, size_t n);
void tsr_buf_reset(tsr_buf *b);
/* Hand the bytes to the caller (free() them); the buffer becomes empty. */
uint8_t *tsr_buf_steal(tsr_buf *b, size_t *len);

#endif
