/* fuzz.h - what the libFuzzer targets in tests/fuzz share.
 *
 * A harness states the properties the code under test promises (a status from the
 * documented set, a message on failure, a round trip that holds) and checks them with
 * FUZZ_CHECK.  A broken property aborts, which libFuzzer reports like any crash and
 * saves the input, so a wrong answer is found the same way as a wild read. */
#ifndef TSR_FUZZ_H
#define TSR_FUZZ_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define FUZZ_CHECK(cond)                                                                        \
        do {                                                                                    \
                if (!(cond)) {                                                                  \
                        fprintf(stderr, "%s:%d: fuzz property broken: %s\n", __FILE__, __LINE__, \
                                #cond);                                                         \
                        abort();                                                                \
                }                                                                               \
        } while (0)

/* The entry points libFuzzer calls; declared here so -Wmissing-prototypes stays quiet. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Read every byte of a range the code under test handed out, so ASan checks that all of
 * it is really there; the empty asm takes the sum as an input so the loop cannot be dropped. */
static inline void fuzz_touch(const void *p, size_t n) {
        const uint8_t *b = p;
        uint8_t x = 0;

        for (size_t i = 0; i < n; i++)
                x ^= b[i];
        __asm__ volatile("" : : "r"(x));
}

/* A file the code under test opens by name, whose bytes live in a memfd.
 *
 * The loaders want a path (with a given suffix: .yaml, config.json), and rewriting a
 * real file per input is slow: ext4 flushes a file that is truncated and rewritten on
 * close, which held a target to ~500 inputs/s.  So `path` is a symlink to
 * /proc/self/fd/N: opening it reopens the memfd at offset 0, and replacing the content
 * is an ftruncate and a pwrite in memory.  Removing the symlink makes the file absent. */
typedef struct fuzz_file {
        int fd;
        bool present;
        char path[300];
} fuzz_file;

static inline void fuzz_file_hide(fuzz_file *f) {
        if (f->present)
                FUZZ_CHECK(unlink(f->path) == 0);
        f->present = false;
}

static inline void fuzz_file_init(fuzz_file *f, const char *dir, const char *name) {
        char target[64];

        FUZZ_CHECK((size_t)snprintf(f->path, sizeof(f->path), "%s/%s", dir, name) < sizeof(f->path));
        f->fd = memfd_create(name, MFD_CLOEXEC);
        FUZZ_CHECK(f->fd >= 0);
        f->present = false;
        snprintf(target, sizeof(target), "/proc/self/fd/%d", f->fd);
        unlink(f->path);        /* a leftover of a killed run with the same pid */
        FUZZ_CHECK(symlink(target, f->path) == 0);
        f->present = true;
}

static inline void fuzz_file_set(fuzz_file *f, const void *p, size_t n) {
        char target[64];
        const uint8_t *b = p;
        off_t off = 0;

        FUZZ_CHECK(ftruncate(f->fd, 0) == 0);
        while (n > 0) {
                ssize_t w = pwrite(f->fd, b, n, off);
                if (w < 0 && errno == EINTR)
                        continue;
                FUZZ_CHECK(w > 0);
                b += w;
                off += w;
                n -= (size_t)w;
        }
        if (!f->present) {
                snprintf(target, sizeof(target), "/proc/self/fd/%d", f->fd);
                FUZZ_CHECK(symlink(target, f->path) == 0);
                f->present = true;
        }
}

/* Well-formed UTF-8 (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF).
 * Written here, apart from common/tokenizer.c's own check, so the harnesses judge the
 * code under test with an independent oracle. */
static inline bool fuzz_valid_utf8(const uint8_t *p, size_t n) {
        size_t i = 0;

        while (i < n) {
                unsigned c = p[i], need;
                uint8_t lo = 0x80, hi = 0xBF;

                if (c < 0x80) {
                        i++;
                        continue;
                }
                if (c >= 0xC2 && c <= 0xDF) {
                        need = 1;
                } else if (c >= 0xE0 && c <= 0xEF) {
                        need = 2;
                        lo = c == 0xE0 ? 0xA0 : 0x80;
                        hi = c == 0xED ? 0x9F : 0xBF;
                } else if (c >= 0xF0 && c <= 0xF4) {
                        need = 3;
                        lo = c == 0xF0 ? 0x90 : 0x80;
                        hi = c == 0xF4 ? 0x8F : 0xBF;
                } else {
                        return false;
                }
                for (unsigned k = 1; k <= need; k++) {
                        if (i + k >= n)
                                return false;
                        if (p[i + k] < (k == 1 ? lo : 0x80) || p[i + k] > (k == 1 ? hi : 0xBF))
                                return false;
                }
                i += need + 1;
        }
        return true;
}

#endif
