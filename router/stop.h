/* stop.h - stop strings on the detokenized output, matched as vLLM's detokenizer does
 * (vllm/v1/engine/detokenizer.py, check_stop_strings):
 *
 *   - after each new piece of text, the stop strings are tried IN LIST ORDER and the
 *     first one found wins (not the earliest position); the search only covers text
 *     that could contain a new match (the last len(stop) + new - 1 characters);
 *   - the output is cut before the stop string, or after it with
 *     include_stop_str_in_output;
 *   - while streaming, the last (longest stop - 1) characters are held back (unless
 *     include_stop_str_in_output) so no client ever sees the start of a stop string
 *     that is later removed.
 * Lengths are in Unicode code points as Python counts them; the text is UTF-8.
 * Pure functions; any thread. */
#ifndef TSR_ROUTER_STOP_H
#define TSR_ROUTER_STOP_H

#include <stdbool.h>
#include <stddef.h>

typedef struct tsr_stop_match {
        int index;              /* which stop string matched, -1 = none */
        size_t cut_bytes;       /* the output keeps this many bytes */
} tsr_stop_match;

/* `text` is the whole output so far (text_len bytes, valid UTF-8); the last
 * `new_chars` code points are new since the previous call. */
tsr_stop_match tsr_stop_check(const char *text, size_t text_len, size_t new_chars, const char *const *stops,
                              size_t n_stops, bool include_in_output);

/* How many bytes at the end of `text` to hold back from a stream: the last
 * (max stop length in code points - 1) code points; 0 when include_in_output or there
 * are no stop strings. */
size_t tsr_stop_holdback_bytes(const char *text, size_t text_len, const char *const *stops, size_t n_stops,
                               bool include_in_output);

/* Code points in a UTF-8 string (continuation bytes not counted). */
size_t tsr_stop_utf8_count(const char *s, size_t len);

#endif
