/* tokenizer.h - Hugging Face compatible BPE tokenizer and incremental detokenizer.
 *
 * Built from a tokenizer.json (byte-level BPE as in GPT-2 / Llama 3 / Llama 4 / SmolLM2,
 * or SentencePiece-style Metaspace + byte_fallback BPE as in Llama 2), or from a GGUF
 * file's tokenizer.ggml.* metadata.  The goal is ids and text byte-identical to the
 * Python `tokenizers` package (Tokenizer.encode(text, add_special_tokens).ids and
 * Tokenizer.decode(ids, skip_special_tokens)).
 *
 * Threads: a tsr_tokenizer is immutable after creation; any number of threads may call
 * encode/decode/accessors on it at once (all scratch state is per call).  A tsr_detok is
 * one stream's state: one thread at a time.  It borrows its tokenizer, which must outlive it.
 *
 * Supported tokenizer.json parts (anything else is TSR_E_UNSUPPORTED with a message naming
 * the field):
 *   model        BPE: vocab, merges ("a b" strings or [a, b] pairs), byte_fallback,
 *                ignore_merges, unk_token, fuse_unk (continuing_subword_prefix and
 *                end_of_word_suffix must be empty or null; dropout must be null or 0)
 *   normalizer   null, Prepend, Replace (String pattern), NFC, NFD, NFKC, NFKD (utf8proc),
 *                Sequence
 *   pre_tokenizer null, ByteLevel (add_prefix_space, use_regex; must come last),
 *                Split (String or Regex pattern, any behavior, invert), Metaspace
 *                (replacement, prepend_scheme always/first/never, split), Digits, Sequence
 *   post_processor null, TemplateProcessing (the "single" template), ByteLevel, Sequence
 *   decoder      ByteLevel, Metaspace, Replace (String pattern), ByteFallback, Fuse,
 *                Strip, Sequence; ByteLevel and ByteFallback must come before any Fuse
 *   added_tokens special, lstrip, rstrip, normalized, single_word
 */
#ifndef TSR_TOKENIZER_H
#define TSR_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "tsr_status.h"

typedef struct tsr_tokenizer tsr_tokenizer;
typedef struct tsr_detok tsr_detok;

/* A GGUF file's tokenizer.ggml.* metadata, borrowed for the duration of
 * tsr_tokenizer_new_gguf (nothing is kept).  Kept free of worker/ types so that common/
 * depends on nothing; the worker copies its tsr_gguf_tokenizer fields in. */
typedef struct tsr_tok_gguf {
        const char *model;              /* "gpt2" or "llama" */
        const char *pre;                /* tokenizer.ggml.pre, NULL if absent */
        const char *const *tokens;      /* [n_tokens] NUL-terminated */
        size_t n_tokens;
        const float *scores;            /* [n_tokens], NULL if absent (required for "llama") */
        const int32_t *token_types;     /* [n_tokens], NULL if absent: 3 control, 4 user-defined */
        const char *const *merges;      /* [n_merges] "left right" (required for "gpt2") */
        size_t n_merges;
        int64_t bos_id, eos_id, unk_id, pad_id; /* -1 when absent */
        bool add_bos, add_eos, add_space_prefix;
} tsr_tok_gguf;

/* Build a tokenizer from tokenizer.json bytes and, optionally, tokenizer_config.json bytes
 * (used for bos_token/eos_token and add_bos_token/add_eos_token; NULL/0 when absent).  The
 * inputs are borrowed.  On success *ret is a new tokenizer for tsr_tokenizer_free.  Returns
 * TSR_E_INVAL (malformed JSON or field), TSR_E_UNSUPPORTED (a component not listed above)
 * or TSR_E_NOMEM, with a message in `err` (if not NULL). */
tsr_status tsr_tokenizer_new_json(const uint8_t *json, size_t len, const uint8_t *config_json,
                                  size_t config_len, tsr_tokenizer **ret, char *err, size_t errlen);

/* Build the tokenizer a GGUF file describes, as transformers' GGUF loader builds it:
 * "gpt2" is byte-level BPE with the file's merges and the split regex chosen by `pre`
 * ("llama-bpe"/"llama3"/... the Llama 3 pattern, "llama4"/"gpt-4o" the o200k pattern,
 * "tekken" the Tekken pattern; anything else, "smollm" included, the GPT-2 pattern of
 * ByteLevel(use_regex=true)), with one difference: for the Llama 3, o200k and Tekken names
 * ignore_merges is on, as in those models' own tokenizer.json and in llama.cpp (transformers'
 * converter drops it and then disagrees with the original tokenizer on words such as
 * "Việt"); "llama" is SentencePiece-style BPE with byte fallback whose
 * merges are derived from the vocabulary and ranked by token score (best first), a
 * Metaspace pre-tokenizer and the Llama 2 decoder.  Control (3) and user-defined (4)
 * tokens become special and plain added tokens.  Errors as for tsr_tokenizer_new_json. */
tsr_status tsr_tokenizer_new_gguf(const tsr_tok_gguf *d, tsr_tokenizer **ret, char *err, size_t errlen);

/* Accepts NULL and *t == NULL; clears *t. */
void tsr_tokenizer_free(tsr_tokenizer **t);

/* Encode `len` bytes of UTF-8 text.  Special-token text in the input is matched as the
 * special token (HF's default).  add_special_tokens applies the post-processor (BOS/EOS).
 * On success *ids is a malloc'd array of *n_ids ids (the caller frees it; NULL when
 * *n_ids == 0).  Returns TSR_E_INVAL if `text` is not valid UTF-8 (HF works on Python str,
 * which cannot hold invalid UTF-8, so there is no reference behaviour to copy), TSR_E_LIMIT
 * if the regex engine gives up on the input, TSR_E_NOMEM. */
tsr_status tsr_tokenizer_encode(const tsr_tokenizer *t, const char *text, size_t len,
                                bool add_special_tokens, uint32_t **ids, size_t *n_ids);

/* Decode ids to text.  On success *text is malloc'd, NUL-terminated (not counted in *len),
 * always valid UTF-8 (broken byte sequences become U+FFFD as HF does).  Returns TSR_E_INVAL
 * if an id is out of range (HF silently drops those; a router should never produce one).
 *
 * There is no spaces_between_special_tokens flag, because for these tokenizers it changes
 * nothing.  vLLM decodes every tokenizer.json model with the fast tokenizer: v1's
 * FastIncrementalDetokenizer (vllm/v1/engine/detokenizer.py, vllm-project/vllm@e372329d)
 * streams through tokenizers' DecodeStream and consults the flag only when both it and
 * skip_special_tokens are false, and then only to replace the delta of an added token that
 * directly follows another added token with that token's bare content.  The space-joining
 * rule of transformers' slow _decode (and vLLM's
 * _convert_tokens_to_string_with_added_encoders) runs only for slow tokenizers, which
 * Tessera never builds.  With HF tokenizers 0.23.3 the replacement changed no output in
 * 3,000 random id sequences (40% added tokens) for any golden family here; it matters only
 * for a tokenizer.json with no decoder, where HF joins tokens with spaces ("<s> </s>" vs
 * "<s></s>"), and no model we serve lacks a decoder. */
tsr_status tsr_tokenizer_decode(const tsr_tokenizer *t, const uint32_t *ids, size_t n,
                                bool skip_special_tokens, char **text, size_t *len);

/* Incremental detokenizer for streaming.  Push ids one at a time; each push returns the
 * text that became final (possibly empty).  Every delta is valid UTF-8: bytes of an
 * unfinished UTF-8 sequence, a run of <0xNN> byte tokens, or characters a decoder may still
 * strip are held back until they are settled.  Deltas are malloc'd and NUL-terminated (the
 * caller frees them; never NULL on success).
 *
 * The concatenation of every delta and the flush is the text vLLM returns for these ids, in
 * a stream or in a whole response: vLLM (v1 FastIncrementalDetokenizer, 0.12) keeps only what
 * tokenizers' DecodeStream hands out, and DecodeStream hands out nothing while the decode so
 * far ends in U+FFFD.  So the text is tsr_tokenizer_decode of all the ids pushed when that
 * does not end in U+FFFD, and otherwise the decode of the longest prefix of them whose
 * decode does not (a stream cut inside a multi-byte character loses that character's bytes
 * instead of ending in U+FFFD).  Text ending in U+FFFD is held back, so no delta has to be
 * taken back.  Not mimicked: the DecodeStream restart vLLM does when a <0xNN> run turns an
 * earlier byte into U+FFFD ("Invalid prefix", byte_fallback tokenizers only).
 * tsr_detok_prime gives the stream the prompt, as vLLM does (below). */
tsr_status tsr_detok_new(const tsr_tokenizer *t, bool skip_special_tokens, tsr_detok **ret);
/* Prime the stream with the request's prompt ids, before the first push, as vLLM 0.33's
 * FastIncrementalDetokenizer does: it builds its DecodeStream with ids=prompt_token_ids (the
 * whole prompt), and tokenizers (0.23) then takes decode(prompt) as the stream's prefix, so
 * the text handed out is decode(prompt + generated) less its first len(decode(prompt))
 * bytes.  For byte-level tokenizers that is the unprimed text; for SentencePiece-style
 * decoders (Metaspace, Strip) the first generated token keeps its leading space ("Hello"
 * + "▁world" streams " world", not "world").  When decode(prompt) ends in U+FFFD (a token-id
 * prompt cut inside a character) DecodeStream keeps an empty prefix and its first chunk is
 * the prompt's text and the generated text together; that is reproduced too.  n == 0 is a
 * no-op.  Ids with no spelling are skipped, as HF's decode drops them.  At most once, before
 * any push: TSR_E_INVAL otherwise.  TSR_E_NOMEM (the stream is then unusable). */
tsr_status tsr_detok_prime(tsr_detok *d, const uint32_t *prompt_ids, size_t n);
/* TSR_E_INVAL for an out-of-range id (the stream is unchanged). */
tsr_status tsr_detok_push(tsr_detok *d, uint32_t id, char **delta, size_t *delta_len);
/* End of stream: returns what was held back (see above).  The detok may not be pushed again. */
tsr_status tsr_detok_flush(tsr_detok *d, char **delta, size_t *delta_len);
/* Accepts NULL and *d == NULL; clears *d. */
void tsr_detok_free(tsr_detok **d);

/* Accessors.  All are pure reads. */
/* One more than the highest id (model vocab and added tokens). */
size_t tsr_tokenizer_vocab_size(const tsr_tokenizer *t);
/* The id of a token spelled `tok` (as in the vocab / added_tokens), or -1. */
int64_t tsr_tokenizer_token_id(const tsr_tokenizer *t, const char *tok, size_t len);
/* The spelling of token `id` (NUL-terminated, owned by the tokenizer), or NULL if unused. */
const char *tsr_tokenizer_token_str(const tsr_tokenizer *t, uint32_t id);
/* -1 when unknown. */
int64_t tsr_tokenizer_bos_id(const tsr_tokenizer *t);
int64_t tsr_tokenizer_eos_id(const tsr_tokenizer *t);
/* Whether add_special_tokens puts a BOS / EOS id around the text. */
bool tsr_tokenizer_add_bos(const tsr_tokenizer *t);
bool tsr_tokenizer_add_eos(const tsr_tokenizer *t);
/* Whether `id` is an added token marked special (skipped by skip_special_tokens). */
bool tsr_tokenizer_is_special(const tsr_tokenizer *t, uint32_t id);

#endif
