/* xgr_shim.h - the C face of xgrammar's C++ core that a Tessera worker would need for
 * structured outputs (issue #17): compile a JSON schema over a vocabulary, then per
 * step fill the allowed-token bitmask and advance on the sampled token.  A probe (see
 * probe.sh): not built by meson, not used by the engine. */
#ifndef TSR_XGR_SHIM_H
#define TSR_XGR_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tsr_xgr_compiler tsr_xgr_compiler;
typedef struct tsr_xgr_grammar tsr_xgr_grammar;
typedef struct tsr_xgr_matcher tsr_xgr_matcher;

/* vocab: the tokenizer's token strings as stored (byte-level: GPT-2's byte-to-unicode
 * alphabet), vocab_type 0 raw, 1 byte fallback, 2 byte level.  NULL on error (err). */
tsr_xgr_compiler *tsr_xgr_compiler_new(const char *const *vocab, int n_vocab, int vocab_type, const int32_t *stop_ids,
                                       int n_stop, int threads, char *err, size_t errlen);
void tsr_xgr_compiler_free(tsr_xgr_compiler *c);
/* A JSON schema (strict, no free whitespace); NULL and err when xgrammar rejects it. */
tsr_xgr_grammar *tsr_xgr_compile_json_schema(tsr_xgr_compiler *c, const char *schema, char *err, size_t errlen);
void tsr_xgr_grammar_free(tsr_xgr_grammar *g);

tsr_xgr_matcher *tsr_xgr_matcher_new(const tsr_xgr_grammar *g);
void tsr_xgr_matcher_free(tsr_xgr_matcher *m);
/* int32 words of a bitmask for n_vocab tokens (bit i of word i/32: token i allowed). */
int tsr_xgr_bitmask_words(int n_vocab);
/* Fill mask for the next token: 1 when it restricts anything, 0 when all is allowed. */
int tsr_xgr_fill_bitmask(tsr_xgr_matcher *m, int32_t *mask, int n_vocab);
/* Advance on a sampled token: 1 accepted, 0 refused (the grammar does not allow it). */
int tsr_xgr_accept(tsr_xgr_matcher *m, int32_t token);
int tsr_xgr_terminated(const tsr_xgr_matcher *m);

#ifdef __cplusplus
}
#endif
#endif
