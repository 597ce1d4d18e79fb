/* grammar_vocab.c - xgrammar's vocabulary from the worker's model metadata (see .h). */
#include "worker/engine/grammar_vocab.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"

/* GGUF: the token strings as stored; tokenizer.ggml.model says how they are spelled
 * ("gpt2": byte-level BPE; "llama": SentencePiece with <0xNN> byte fallback).  Control
 * tokens (type 3) are special. */
static tsr_status from_gguf(const tsr_model_meta *meta, size_t model_vocab, tsr_grammar_vocab **ret, char *err,
                            size_t errlen) {
        const tsr_gguf_tokenizer *g = meta->gguf_tokenizer;
        tsr_grammar_vocab_type type;
        size_t n = g->n_tokens < model_vocab ? g->n_tokens : model_vocab;
        const char **toks;
        tsr_status st;

        if (strcmp(g->model, "gpt2") == 0)
                type = TSR_GRAMMAR_VOCAB_BYTE_LEVEL;
        else if (strcmp(g->model, "llama") == 0)
                type = TSR_GRAMMAR_VOCAB_BYTE_FALLBACK;
        else {
                snprintf(err, errlen, "tokenizer.ggml.model \"%s\" has no structured-output vocabulary type", g->model);
                return TSR_E_UNSUPPORTED;
        }
        if (!(toks = calloc(n ? n : 1, sizeof(*toks))))
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n; i++)
                toks[i] = g->token_types && g->token_types[i] == 3 ? "" : g->tokens[i];
        st = tsr_grammar_vocab_new(toks, n, model_vocab, type, type == TSR_GRAMMAR_VOCAB_BYTE_FALLBACK && g->add_space_prefix,
                                   meta->eos_token_ids, meta->n_eos_token_ids, 2, ret, err, errlen);
        free(toks);
        return st;
}

/* tokenizer.json: the spellings from our tokenizer (added tokens included), the
 * spelling type from xgrammar's reading of the file's decoder. */
static tsr_status from_hf(const tsr_model_meta *meta, size_t model_vocab, tsr_grammar_vocab **ret, char *err,
                          size_t errlen) {
        tsr_tokenizer *t = NULL;
        tsr_grammar_vocab_type type;
        bool prefix_space;
        const char **toks = NULL;
        size_t n;
        tsr_status st;

        st = tsr_tokenizer_new_json(meta->tokenizer_json, meta->tokenizer_json_len, meta->tokenizer_config_json,
                                    meta->tokenizer_config_json_len, &t, err, errlen);
        if (st != TSR_OK)
                return st;
        if (tsr_grammar_detect_hf((const char *)meta->tokenizer_json, meta->tokenizer_json_len, &type, &prefix_space) !=
            TSR_OK) {
                snprintf(err, errlen, "cannot tell how tokenizer.json spells its tokens");
                st = TSR_E_UNSUPPORTED;
                goto done;
        }
        n = tsr_tokenizer_vocab_size(t);
        if (n > model_vocab)
                n = model_vocab;
        if (!(toks = calloc(n ? n : 1, sizeof(*toks)))) {
                st = TSR_E_NOMEM;
                goto done;
        }
        for (size_t i = 0; i < n; i++) {
                const char *s = tsr_tokenizer_token_str(t, (uint32_t)i);
                toks[i] = !s || tsr_tokenizer_is_special(t, (uint32_t)i) ? "" : s;
        }
        st = tsr_grammar_vocab_new(toks, n, model_vocab, type, prefix_space, meta->eos_token_ids,
                                   meta->n_eos_token_ids, 2, ret, err, errlen);
done:
        free(toks);
        tsr_tokenizer_free(&t);
        return st;
}

tsr_status tsr_engine_grammar_vocab(const tsr_model_meta *meta, size_t model_vocab, tsr_grammar_vocab **ret,
                                    char *err, size_t errlen) {
        if (meta->gguf_tokenizer)
                return from_gguf(meta, model_vocab, ret, err, errlen);
        if (meta->tokenizer_json)
                return from_hf(meta, model_vocab, ret, err, errlen);
        snprintf(err, errlen, "the model has no tokenizer");
        return TSR_E_UNSUPPORTED;
}
