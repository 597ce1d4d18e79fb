#include "buf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tsr_buf_init(tsr_buf *b, size_t limit) {
        b->data = NULL;
        b->len = 0;
        b->alloc = 0;
        b->limit = limit;
}

void tsr_buf_done(tsr_buf *b) {
        free(b->data);
        tsr_buf_init(b, b->limit);
}

tsr_status tsr_buf_reserve(tsr_buf *b, size_t n) {
        size_t want, alloc;
        uint8_t *p;

        if (n > b->limit || b->len > b->limit - n)
                return TSR_E_LIMIT;
        want = b->len + n + 1;          /* +1 for the terminating NUL */
        if (want <= b->alloc)
                return TSR_OK;
        alloc = b->alloc ? b->alloc : 64;
        while (alloc < want)
                alloc = alloc > SIZE_MAX / 2 ? want : alloc * 2;
        if (alloc > b->limit + 1)
                alloc = b->limit + 1 >= want ? b->limit + 1 : want;
        p = realloc(b->data, alloc);
        if (!p)
                return TSR_E_NOMEM;
        b->data = p;
        b->alloc = alloc;
        return TSR_OK;
}

tsr_status tsr_buf_append(tsr_buf *b, const void *p, size_t n) {
        tsr_status st = tsr_buf_reserve(b, n);
        if (st != TSR_OK)
                return st;
        if (n)
                memcpy(b->data + b->len, p, n);
        b->len += n;
        b->data[b->len] = '\0';
        return TSR_OK;
}

tsr_status tsr_buf_append_str(tsr_buf *b, const char *s) { return tsr_buf_append(b, s, strlen(s)); }

tsr_status tsr_buf_appendf(tsr_buf *b, const char *fmt, ...) {
        va_list ap;
        int n;
        tsr_status st;

        va_start(ap, fmt);
        n = vsnprintf(NULL, 0, fmt, ap);
        va_end(ap);
        if (n < 0)
                return TSR_E_INVAL;
        st = tsr_buf_reserve(b, (size_t)n);
        if (st != TSR_OK)
                return st;
        va_start(ap, fmt);
        vsnprintf((char *)b->data + b->len, (size_t)n + 1, fmt, ap);
        va_end(ap);
        b->len += (size_t)n;
        return TSR_OK;
}

void tsr_buf_consume(tsr_buf *b, size_t n) {
        if (n >= b->len) {
                b->len = 0;
        } else {
                memmove(b->data, b->data + n, b->len - n);
                b->len -= n;
        }
        if (b->data)
                b->data[b->len] = '\0';
}

void tsr_buf_reset(tsr_buf *b) {
        b->len = 0;
        if (b->data)
                b->data[0] = '\0';
}

uint8_t *tsr_buf_steal(tsr_buf *b, size_t *len) {
        uint8_t *p = b->data;
        if (len)
                *len = b->len;
        b->data = NULL;
        b->len = 0;
        b->alloc = 0;
        return p;
}
