/* gguf_writer.h - the primitives of a minimal GGUF writer for tests that build a file
 * (test_gguf's samples and corruptions, test_parallel's block-format Llama): little-
 * endian values appended to a tsr_buf, GGUF strings and key headers.  Header-only;
 * include after <cmocka.h> (a failed append fails the test). */
#ifndef TSR_TEST_GGUF_WRITER_H
#define TSR_TEST_GGUF_WRITER_H

#include <stdint.h>
#include <string.h>

#include "common/buf.h"
#include "worker/load/gguf.h"

static inline void gw_bytes(tsr_buf *b, const void *p, size_t n) {
        assert_int_equal(tsr_buf_append(b, p, n), TSR_OK);
}

static inline void gw_u8(tsr_buf *b, uint8_t x) { gw_bytes(b, &x, 1); }

static inline void gw_le(tsr_buf *b, uint64_t x, int n) {
        for (int i = 0; i < n; i++)
                gw_u8(b, (uint8_t)(x >> (8 * i)));
}

static inline void gw_u32(tsr_buf *b, uint32_t x) { gw_le(b, x, 4); }
static inline void gw_u64(tsr_buf *b, uint64_t x) { gw_le(b, x, 8); }

/* A GGUF string: its u64 length, then its bytes. */
static inline void gw_str(tsr_buf *b, const char *s) {
        gw_u64(b, strlen(s));
        gw_bytes(b, s, strlen(s));
}

/* A key-value pair's head: the key, then the value's type. */
static inline void gw_key(tsr_buf *b, const char *key, tsr_gguf_type t) {
        gw_str(b, key);
        gw_u32(b, t);
}

#endif
