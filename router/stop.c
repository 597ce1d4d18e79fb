#include "stop.h"

#include <string.h>

size_t tsr_stop_utf8_count(const char *s, size_t len) {
        size_t n = 0;
        for (size_t i = 0; i < len; i++)
                n += ((unsigned char)s[i] & 0xc0) != 0x80;
        return n;
}

/* Byte offset where the last `chars` code points of text begin (0 if fewer). */
static size_t tail_start(const char *text, size_t len, size_t chars) {
        size_t i = len;
        while (i > 0 && chars > 0) {
                i--;
                if (((unsigned char)text[i] & 0xc0) != 0x80)
                        chars--;
        }
        return i;
}

static const char *find_bytes(const char *hay, size_t hay_len, const char *needle, size_t needle_len) {
        if (needle_len == 0 || needle_len > hay_len)
                return NULL;
        return memmem(hay, hay_len, needle, needle_len);
}

tsr_stop_match tsr_stop_check(const char *text, size_t text_len, size_t new_chars, const char *const *stops,
                              size_t n_stops, bool include_in_output) {
        tsr_stop_match m = {.index = -1, .cut_bytes = text_len};
        for (size_t k = 0; k < n_stops; k++) {
                size_t stop_len = strlen(stops[k]);
                size_t stop_chars = tsr_stop_utf8_count(stops[k], stop_len);
                /* Python: text.find(stop, 1 - new_chars - len(stop)): only the window that
                 * could hold a match touching the new text. */
                size_t from = tail_start(text, text_len, new_chars + stop_chars - 1);
                const char *hit = find_bytes(text + from, text_len - from, stops[k], stop_len);
                if (!hit)
                        continue;
                m.index = (int)k;
                m.cut_bytes = (size_t)(hit - text) + (include_in_output ? stop_len : 0);
                return m;
        }
        return m;
}

size_t tsr_stop_holdback_bytes(const char *text, size_t text_len, const char *const *stops, size_t n_stops,
                               bool include_in_output) {
        size_t longest = 0;
        if (include_in_output)
                return 0;
        for (size_t k = 0; k < n_stops; k++) {
                size_t c = tsr_stop_utf8_count(stops[k], strlen(stops[k]));
                if (c > longest)
                        longest = c;
        }
        if (longest <= 1)
                return 0;
        return text_len - tail_start(text, text_len, longest - 1);
}
