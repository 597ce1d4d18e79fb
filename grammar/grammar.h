/* grammar.h - structured outputs: xgrammar's C++ core behind a C API (issue #17).
 *
 * Two users.  The router validates a request's spec without a tokenizer
 * (tsr_grammar_check: xgrammar builds the Grammar from the schema / regex / EBNF and
 * refuses what it cannot) so bad input is a 400 before anything is submitted.  The
 * worker, which samples, owns the matchers: it builds one tsr_grammar_vocab from the
 * model's vocabulary at start, compiles each request's spec on its compile thread
 * (grammar/pool.h) and, each step, fills the request's bitmask and masks the logits
 * before the sampler (docs/architecture.md, "Structured outputs").
 *
 * Every C++ exception stops in grammar.cc and becomes a status and a message: nothing
 * unwinds into C, and no input makes the process abort.  Objects are not thread-safe
 * unless said; a tsr_grammar_vocab may compile from any number of threads at once
 * (xgrammar's GrammarCompiler is), a matcher belongs to one thread at a time. */
#ifndef TSR_GRAMMAR_H
#define TSR_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tsr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What constrains the output (the wire's StructuredOutput.kind: the same numbers). */
typedef enum tsr_grammar_kind {
        TSR_GRAMMAR_NONE = 0,
        TSR_GRAMMAR_JSON_SCHEMA = 1,   /* text: a JSON schema */
        TSR_GRAMMAR_JSON_OBJECT = 2,   /* any JSON object (text unused): vLLM compiles {"type": "object"} */
        TSR_GRAMMAR_REGEX = 3,         /* text: a regular expression, matched whole */
        TSR_GRAMMAR_CHOICE = 4,        /* text: a JSON array of strings, one of which is the output */
        TSR_GRAMMAR_EBNF = 5,          /* text: an EBNF (GBNF) grammar with a `root` rule */
} tsr_grammar_kind;

#define TSR_GRAMMAR_KIND_MAX TSR_GRAMMAR_EBNF

/* One request's constraint.  `text` is borrowed, `len` bytes (need not be NUL-terminated). */
typedef struct tsr_grammar_spec {
        tsr_grammar_kind kind;
        const char *text;
        size_t len;
        /* JSON kinds: whitespace between tokens is free (xgrammar's any_whitespace, vLLM's
         * default); false: the compact form only (vLLM's disable_any_whitespace). */
        bool any_whitespace;
} tsr_grammar_spec;

/* How the vocabulary's token strings are spelled (xgrammar's VocabType). */
typedef enum tsr_grammar_vocab_type {
        TSR_GRAMMAR_VOCAB_RAW = 0,           /* the bytes themselves */
        TSR_GRAMMAR_VOCAB_BYTE_FALLBACK = 1, /* SentencePiece: "▁" for space, <0xNN> byte tokens */
        TSR_GRAMMAR_VOCAB_BYTE_LEVEL = 2,    /* GPT-2's byte-to-unicode alphabet */
} tsr_grammar_vocab_type;

/* Whether xgrammar accepts the spec, without a vocabulary: the router's 400 check.  Any
 * thread.  TSR_OK; TSR_E_INVAL with a message (a schema xgrammar rejects, an invalid
 * regex or EBNF, a choice list that is empty or not strings); TSR_E_NOMEM. */
tsr_status tsr_grammar_check(const tsr_grammar_spec *spec, char *err, size_t errlen);

/* xgrammar's reading of a Hugging Face tokenizer.json (its decoder): the vocabulary type
 * and whether the tokenizer adds a prefix space.  TSR_E_INVAL if it cannot tell. */
tsr_status tsr_grammar_detect_hf(const char *tokenizer_json, size_t len, tsr_grammar_vocab_type *type,
                                 bool *add_prefix_space);

/* A vocabulary and its compiler (xgrammar's TokenizerInfo + GrammarCompiler, with
 * xgrammar's cache of compiled grammars keyed by the spec).  `tokens` (n_tokens,) are
 * the tokenizer's spellings; NULL or "" marks a special token, never allowed (the stop
 * ids excepted).  vocab_size >= n_tokens is the model's logits width (ids past the
 * tokenizer are never allowed).  stop_ids: the tokens that end a complete output (EOS).
 * `threads`: xgrammar's compile threads per grammar.  *ret written on success only;
 * TSR_E_INVAL with a message, TSR_E_NOMEM. */
typedef struct tsr_grammar_vocab tsr_grammar_vocab;
tsr_status tsr_grammar_vocab_new(const char *const *tokens, size_t n_tokens, size_t vocab_size,
                                 tsr_grammar_vocab_type type, bool add_prefix_space, const uint32_t *stop_ids,
                                 size_t n_stop, int threads, tsr_grammar_vocab **ret, char *err, size_t errlen);
/* Accepts NULL and *v == NULL; clears *v.  No compile may be running on it. */
void tsr_grammar_vocab_free(tsr_grammar_vocab **v);
size_t tsr_grammar_vocab_size(const tsr_grammar_vocab *v);

/* A spec compiled over a vocabulary: the matchers' shared, read-only tables.  Slow
 * (hundreds of ms for a large schema, microseconds when cached): never on the engine
 * thread.  Any thread.  *ret on success only; TSR_E_INVAL with xgrammar's message. */
typedef struct tsr_grammar_compiled tsr_grammar_compiled;
tsr_status tsr_grammar_compile(tsr_grammar_vocab *v, const tsr_grammar_spec *spec, tsr_grammar_compiled **ret,
                               char *err, size_t errlen);
void tsr_grammar_compiled_free(tsr_grammar_compiled **g);

/* One request's position in its grammar.  The matcher keeps what it needs of `g` (which
 * may be freed after).  It remembers every accepted token, so it can be rolled back to
 * any earlier length (a step whose token was dropped, a preemption).  NULL on OOM. */
typedef struct tsr_grammar_matcher tsr_grammar_matcher;
tsr_grammar_matcher *tsr_grammar_matcher_new(const tsr_grammar_compiled *g);
void tsr_grammar_matcher_free(tsr_grammar_matcher **m);

/* 32-bit words of a bitmask over `vocab` tokens: bit (id % 32) of word id / 32 set =
 * token id allowed. */
size_t tsr_grammar_mask_words(size_t vocab);
/* The tokens allowed next, into mask (tsr_grammar_mask_words(vocab) words).  Returns
 * TSR_OK, or TSR_E_INVAL when the matcher has already terminated (mask unchanged). */
tsr_status tsr_grammar_fill_mask(tsr_grammar_matcher *m, uint32_t *mask, size_t vocab);
/* Advance on `token`: TSR_OK, or TSR_E_INVAL if the grammar does not allow it (the
 * matcher is unchanged). */
tsr_status tsr_grammar_accept(tsr_grammar_matcher *m, uint32_t token);
/* Tokens accepted so far (including a stop token). */
size_t tsr_grammar_n_accepted(const tsr_grammar_matcher *m);
/* Undo the last n accepted tokens (n <= tsr_grammar_n_accepted). */
tsr_status tsr_grammar_rollback(tsr_grammar_matcher *m, size_t n);
/* The output is complete: a stop token was accepted. */
bool tsr_grammar_terminated(const tsr_grammar_matcher *m);

/* Masked tokens' logits to -inf (bit clear in mask).  logits (vocab,). */
void tsr_grammar_apply_mask(float *logits, size_t vocab, const uint32_t *mask);
/* Whether every allowed token (mask) is one of ids (n_ids,): nothing but a stop token
 * may come next.  False when none is allowed. */
bool tsr_grammar_mask_only(const uint32_t *mask, size_t vocab, const uint32_t *ids, size_t n_ids);

#ifdef __cplusplus
}
#endif
#endif
