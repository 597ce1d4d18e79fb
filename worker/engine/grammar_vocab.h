/* grammar_vocab.h - the worker's structured-output vocabulary: xgrammar's view of the
 * model's tokenizer (grammar/grammar.h), built once at start from the same tokenizer
 * the worker sends routers in ModelInfo (GGUF tokenizer.ggml.* or tokenizer.json). */
#ifndef TSR_WORKER_GRAMMAR_VOCAB_H
#define TSR_WORKER_GRAMMAR_VOCAB_H

#include "grammar/grammar.h"
#include "worker/load/model_meta.h"

/* The vocabulary over `model_vocab` logits (ids the tokenizer lacks are never allowed);
 * the stop tokens are meta's EOS ids.  Special (control) tokens are never allowed by a
 * grammar.  Main thread, at start (about 0.1 s for a 50k vocabulary).  *ret on success
 * only; TSR_E_INVAL / TSR_E_UNSUPPORTED with a message, TSR_E_NOMEM. */
tsr_status tsr_engine_grammar_vocab(const tsr_model_meta *meta, size_t model_vocab, tsr_grammar_vocab **ret,
                                    char *err, size_t errlen);

#endif
