/* fuzz_tokenizer.c - encode, decode and streaming decode, from bytes.
 *
 * The tokenizer is built once, from the committed llama3_style tokenizer.json
 * (tests/fixtures/tokenizers/; meson passes its path as TSR_FUZZ_TOKENIZER_JSON): byte-level
 * BPE with the Llama 3 Split regex, ignore_merges, special tokens, a BOS template and two
 * plain added tokens with lstrip/rstrip ("[USER]") and single_word ("fox").  What is fuzzed
 * is the text and the ids, not the loader (fuzz_model_meta reaches the loader).
 *
 * The first input byte picks the mode, the rest is the payload:
 *   even    the payload is text.  Encoding must succeed exactly when it is valid UTF-8
 *           (TSR_E_INVAL otherwise); add_special_tokens must put the BOS in front and
 *           change nothing else; decode(encode(x)) must give x back (checked with HF on
 *           20,000 random strings: it holds for this tokenizer unless the text holds
 *           "[USER]", whose lstrip/rstrip eats the spaces around it); the ids then go
 *           through the checks of the odd mode.
 *   odd     the payload is ids, two bytes each (little endian), taken modulo a little more
 *           than the vocabulary so that some are out of range; bit 1 of the selector sets
 *           skip_special_tokens.  Decoding must succeed exactly when every id is in range,
 *           and give valid UTF-8; pushing the ids one at a time through a tsr_detok must
 *           reject the out-of-range ones without changing the stream, every delta must be
 *           valid UTF-8, and the deltas plus the flush must equal the decode of the
 *           in-range ids, or, when that ends in U+FFFD, the decode of the longest prefix of
 *           them whose decode does not (what vLLM's DecodeStream hands out). */
#include <stdbool.h>
#include <string.h>

#include "common/tokenizer.h"
#include "fuzz.h"

#ifndef TSR_FUZZ_TOKENIZER_JSON
#error "meson defines TSR_FUZZ_TOKENIZER_JSON (tests/fuzz/meson.build)"
#endif

/* Inputs past this are cut: longer texts find nothing new and slow the run down.  Random
 * ids decode to broken UTF-8 most of the time, and a stream whose text ends in U+FFFD
 * re-decodes a growing window at every push (as vLLM's does), so a long run of them costs
 * O(n^2): 256 ids keep that at a few thousand executions a second under ASan. */
#define MAX_TEXT 4096
#define MAX_IDS 256

static tsr_tokenizer *tok;
static size_t vocab;
static int64_t bos;
static int64_t user_id;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        FILE *f = fopen(TSR_FUZZ_TOKENIZER_JSON, "rb");
        char err[512] = "";
        uint8_t *buf;
        long n;

        (void)argc;
        (void)argv;
        if (!f) {
                fprintf(stderr, "fuzz_tokenizer: cannot open %s\n", TSR_FUZZ_TOKENIZER_JSON);
                abort();
        }
        FUZZ_CHECK(fseek(f, 0, SEEK_END) == 0);
        n = ftell(f);
        FUZZ_CHECK(n > 0 && fseek(f, 0, SEEK_SET) == 0);
        buf = malloc((size_t)n);
        FUZZ_CHECK(buf != NULL);
        FUZZ_CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n);
        fclose(f);
        if (tsr_tokenizer_new_json(buf, (size_t)n, NULL, 0, &tok, err, sizeof(err)) != TSR_OK) {
                fprintf(stderr, "fuzz_tokenizer: %s: %s\n", TSR_FUZZ_TOKENIZER_JSON, err);
                abort();
        }
        free(buf);
        vocab = tsr_tokenizer_vocab_size(tok);
        bos = tsr_tokenizer_bos_id(tok);
        user_id = tsr_tokenizer_token_id(tok, "[USER]", 6);
        FUZZ_CHECK(vocab > 0 && bos >= 0 && tsr_tokenizer_add_bos(tok) && !tsr_tokenizer_add_eos(tok));
        FUZZ_CHECK(user_id >= 0);
        return 0;
}

/* The same rules as the reader in test_tokenizer.c: shortest form, no surrogates, at most
 * U+10FFFF. */

static bool same(const char *a, size_t na, const char *b, size_t nb) {
        return na == nb && (na == 0 || memcmp(a, b, na) == 0);
}

/* Decode and stream `ids` (some may be out of range) with one skip setting. */
static void check_ids(const uint32_t *ids, size_t n, bool skip) {
        uint32_t *in_range = malloc((n + 1) * sizeof(uint32_t));
        size_t n_in = 0, len = 0, acc_len = 0, dl;
        char *text = NULL, *acc = malloc(1), *delta;
        tsr_detok *d = NULL;
        tsr_status st;

        FUZZ_CHECK(in_range != NULL && acc != NULL);
        for (size_t i = 0; i < n; i++)
                if (ids[i] < vocab)
                        in_range[n_in++] = ids[i];

        st = tsr_tokenizer_decode(tok, ids, n, skip, &text, &len);
        if (n_in < n) {
                FUZZ_CHECK(st == TSR_E_INVAL && text == NULL);
                st = tsr_tokenizer_decode(tok, in_range, n_in, skip, &text, &len);
        }
        FUZZ_CHECK(st == TSR_OK && text != NULL);
        FUZZ_CHECK(text[len] == '\0');
        FUZZ_CHECK(fuzz_valid_utf8((const uint8_t *)text, len));
        for (size_t m = n_in; m > 0 && len >= 3 && memcmp(text + len - 3, "\xEF\xBF\xBD", 3) == 0;) {
                free(text);
                text = NULL;
                FUZZ_CHECK(tsr_tokenizer_decode(tok, in_range, --m, skip, &text, &len) == TSR_OK);
        }

        FUZZ_CHECK(tsr_detok_new(tok, skip, &d) == TSR_OK && d != NULL);
        for (size_t i = 0; i <= n; i++) {
                delta = NULL;
                if (i < n) {
                        st = tsr_detok_push(d, ids[i], &delta, &dl);
                        if (ids[i] >= vocab) {
                                FUZZ_CHECK(st == TSR_E_INVAL && delta == NULL);
                                continue;
                        }
                } else {
                        st = tsr_detok_flush(d, &delta, &dl);
                }
                FUZZ_CHECK(st == TSR_OK && delta != NULL && delta[dl] == '\0');
                FUZZ_CHECK(fuzz_valid_utf8((const uint8_t *)delta, dl));
                acc = realloc(acc, acc_len + dl + 1);
                FUZZ_CHECK(acc != NULL);
                memcpy(acc + acc_len, delta, dl);
                acc_len += dl;
                free(delta);
        }
        tsr_detok_free(&d);
        FUZZ_CHECK(d == NULL);
        if (!same(acc, acc_len, text, len)) {
                fprintf(stderr, "streamed \"%.*s\" but decoded \"%s\" (skip=%d)\n", (int)acc_len, acc, text, skip);
                FUZZ_CHECK(!"deltas equal the decode");
        }
        free(acc);
        free(text);
        free(in_range);
}

static void check_text(const uint8_t *p, size_t n) {
        uint32_t *ids = NULL, *ids_sp = NULL;
        size_t n_ids = 0, n_sp = 0, len = 0;
        char *text = NULL;
        bool valid = fuzz_valid_utf8(p, n);
        tsr_status st;

        st = tsr_tokenizer_encode(tok, (const char *)p, n, false, &ids, &n_ids);
        if (!valid) {
                FUZZ_CHECK(st == TSR_E_INVAL && ids == NULL);
                return;
        }
        FUZZ_CHECK(st == TSR_OK);
        FUZZ_CHECK((n == 0) == (n_ids == 0));
        FUZZ_CHECK(n_ids == 0 || ids != NULL);
        for (size_t i = 0; i < n_ids; i++)
                FUZZ_CHECK(ids[i] < vocab);

        FUZZ_CHECK(tsr_tokenizer_encode(tok, (const char *)p, n, true, &ids_sp, &n_sp) == TSR_OK);
        FUZZ_CHECK(n_sp == n_ids + 1 && ids_sp[0] == (uint32_t)bos);
        FUZZ_CHECK(n_ids == 0 || memcmp(ids_sp + 1, ids, n_ids * sizeof(uint32_t)) == 0);

        FUZZ_CHECK(tsr_tokenizer_decode(tok, ids, n_ids, false, &text, &len) == TSR_OK);
        if (!memmem(p, n, "[USER]", 6) && !same(text, len, (const char *)p, n)) {
                fprintf(stderr, "decode(encode(x)) = \"%s\" for x = \"%.*s\"\n", text, (int)n, (const char *)p);
                FUZZ_CHECK(!"decode(encode(x)) == x");
        }
        free(text);

        check_ids(ids, n_ids, false);
        check_ids(ids_sp, n_sp, true);
        free(ids);
        free(ids_sp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        uint8_t sel;

        if (size == 0)
                return 0;
        sel = data[0];
        data++;
        size--;
        if (!(sel & 1)) {
                check_text(data, size < MAX_TEXT ? size : MAX_TEXT);
        } else {
                size_t n = size / 2 < MAX_IDS ? size / 2 : MAX_IDS;
                uint32_t *ids = malloc((n + 1) * sizeof(uint32_t));

                FUZZ_CHECK(ids != NULL);
                /* A few ids past the end, so the out-of-range paths run too. */
                for (size_t i = 0; i < n; i++)
                        ids[i] = (uint32_t)(data[2 * i] | data[2 * i + 1] << 8) % (uint32_t)(vocab + 8);
                check_ids(ids, n, (sel & 2) != 0);
                free(ids);
        }
        return 0;
}
