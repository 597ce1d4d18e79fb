/* model_meta.h - what the worker knows about a model before it loads any weights.
 *
 * Read from a Hugging Face folder (config.json, tokenizer.json, and optionally
 * tokenizer_config.json, generation_config.json, chat_template.jinja) or from a .gguf
 * file's metadata.  The worker sends most of this to routers in ModelInfo (tokenizer,
 * chat template, EOS ids, max_model_len, generation defaults) and uses the dims to size
 * the KV cache.  Non-logging: failures come back as a status and a message naming the
 * file and the field, e.g. "/m/config.json: field 'num_hidden_layers': expected an
 * integer".  A loaded tsr_model_meta is plain data, immutable, safe to share read-only. */
#ifndef TSR_MODEL_META_H
#define TSR_MODEL_META_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/tsr_status.h"

/* Caps on files read into memory; a bigger file is TSR_E_LIMIT. */
#define TSR_MODEL_META_MAX_TOKENIZER_JSON (256u << 20)
#define TSR_MODEL_META_MAX_SMALL_JSON (16u << 20)     /* config, tokenizer_config, generation_config, .jinja */

/* The tokenizer stored in a GGUF file's tokenizer.ggml.* keys (GGUF only). */
typedef struct tsr_gguf_tokenizer {
        char *model;            /* tokenizer.ggml.model: "llama" (SentencePiece), "gpt2" (byte-level BPE), ... */
        char *pre;              /* tokenizer.ggml.pre, NULL if absent */
        char **tokens;          /* [n_tokens] NUL-terminated */
        size_t n_tokens;
        float *scores;          /* [n_tokens], NULL if absent */
        int32_t *token_types;   /* [n_tokens], NULL if absent */
        char **merges;          /* [n_merges] "left right" */
        size_t n_merges;
        int64_t bos_id, eos_id, unk_id, pad_id;  /* -1 when absent (or stored as 0xFFFFFFFF) */
        /* Defaults when the key is absent, as llama.cpp does: add_bos and add_space_prefix
         * true for model "llama", false otherwise; add_eos false. */
        bool add_bos, add_eos, add_space_prefix;
} tsr_gguf_tokenizer;

/* The sampling defaults of a generation_config.json (vLLM reads these six keys);
 * has_x says x was given.  Also what a worker announces, after --generation-config and
 * --override-generation-config (gen_config.h). */
typedef struct tsr_gen_defaults {
        bool has_temperature;
        double temperature;
        bool has_top_p;
        double top_p;
        bool has_top_k;
        int64_t top_k;
        bool has_min_p;
        double min_p;
        bool has_repetition_penalty;
        double repetition_penalty;
        bool has_max_new_tokens;
        int64_t max_new_tokens;
} tsr_gen_defaults;

typedef struct tsr_model_meta {
        char *path;                     /* as given to tsr_model_meta_load */
        char *format;                   /* "hf" or "gguf" */
        char *architecture;             /* HF: config.json architectures[0] (NULL if absent); GGUF: general.architecture */
        char *model_type;               /* HF: config.json model_type (NULL if absent); GGUF: general.architecture */
        uint32_t max_model_len;         /* max_position_embeddings / <arch>.context_length; 0 if unknown */
        uint32_t vocab_size;            /* HF: config.json vocab_size; GGUF: number of tokens */
        int64_t bos_token_id;           /* -1 if absent */
        /* Union in first-seen order, without duplicates, of config.json eos_token_id (int or
         * list), generation_config.json eos_token_id (int or list); for GGUF of
         * tokenizer.ggml.eos_token_id, .eot_token_id and .eom_token_id.  The tokenizer's
         * own EOS is [0] (HF: tokenizer_config.json eos_token looked up in tokenizer.json,
         * moved or added to the front; GGUF: tokenizer.ggml.eos_token_id is first). */
        uint32_t *eos_token_ids;
        size_t n_eos_token_ids;
        /* tokenizer_config.json "chat_template" (a string, or the list of {name, template}
         * where the "default" entry is taken), else chat_template.jinja in the folder,
         * else GGUF tokenizer.chat_template.  NULL if none.  NUL-terminated. */
        char *chat_template;
        uint8_t *tokenizer_json;        /* HF only: tokenizer.json bytes, NUL-terminated (not counted) */
        size_t tokenizer_json_len;
        uint8_t *tokenizer_config_json; /* HF only, NULL if the file is absent; NUL-terminated */
        size_t tokenizer_config_json_len;
        tsr_gguf_tokenizer *gguf_tokenizer;     /* GGUF only */
        /* XXH64, seed 0.  HF: over tokenizer.json's bytes followed by tokenizer_config.json's
         * (nothing for an absent file).  GGUF: over the canonical serialisation below, so two
         * files with the same tokenizer hash the same whatever their key order:
         *   str(model) str(pre) u64(n_tokens) str(token)*n_tokens
         *   u8(scores present) [f32 bits]*n_tokens if present
         *   u8(token_types present) [i32]*n_tokens if present
         *   u64(n_merges) str(merge)*n_merges
         *   i64(bos) i64(eos) i64(unk) i64(pad) u8(add_bos) u8(add_eos) u8(add_space_prefix)
         *   str(chat_template)
         * where integers are little-endian, str(s) is u64(length) then the bytes, and an
         * absent string is u64(UINT64_MAX) with no bytes. */
        uint64_t tokenizer_hash;

        /* Generation defaults (generation_config.json; GGUF has none).  has_x says x was given. */
        tsr_gen_defaults gen;

        /* Dims as the config states them; 0 when the source does not give them.  The worker
         * sizes the KV cache from its model family's description (worker/model/family.h,
         * read once by the family), not from these; they serve a model of no family (its
         * advertised capacity, main.c plan_kv_groups) and tools.  HF fields missing at
         * the top level of config.json are looked up in "text_config" (multimodal configs
         * such as Llama 4).  GGUF: <arch>.embedding_length, .block_count,
         * .attention.head_count, .attention.head_count_kv, .attention.key_length,
         * .feed_forward_length, .rope.freq_base, .attention.layer_norm_rms_epsilon; a
         * per-layer array gives its largest entry. */
        uint32_t hidden_size;
        uint32_t num_hidden_layers;
        uint32_t num_attention_heads;
        uint32_t num_key_value_heads;   /* defaults to num_attention_heads */
        uint32_t head_dim;              /* explicit, else hidden_size / num_attention_heads */
        uint32_t intermediate_size;
        double rope_theta;
        double rms_norm_eps;
        bool tie_word_embeddings;       /* HF: config field (default false); GGUF: no output.weight tensor */
} tsr_model_meta;

/* Load the metadata of the model at `path`: a folder (Hugging Face) or a file whose
 * name ends in ".gguf".  On success *ret is a new tsr_model_meta the caller frees with
 * tsr_model_meta_free.  Returns TSR_E_NOTFOUND (path, config.json or tokenizer.json
 * missing), TSR_E_INVAL (malformed file or field), TSR_E_LIMIT (a file over its cap),
 * TSR_E_UNSUPPORTED, TSR_E_IO or TSR_E_NOMEM, with a message in `err` (if not NULL).
 * Blocking file I/O: call it at startup, not from a loop thread. */
tsr_status tsr_model_meta_load(const char *path, tsr_model_meta **ret, char *err, size_t errlen);
/* Read only DIR/generation_config.json (vLLM's --generation-config DIR), with the
 * parser tsr_model_meta_load uses for a model folder's, into *ret.  Returns
 * TSR_E_NOTFOUND, with no message, when DIR has no generation_config.json;
 * TSR_E_INVAL (DIR missing or not a directory, malformed JSON or field), TSR_E_LIMIT,
 * TSR_E_IO or TSR_E_NOMEM with a message naming DIR or the file.  Blocking. */
tsr_status tsr_model_meta_load_generation_config(const char *dir, tsr_gen_defaults *ret, char *err, size_t errlen);
/* Accepts NULL and *m == NULL; clears *m. */
void tsr_model_meta_free(tsr_model_meta **m);
/* The model's tokenizer (common/tokenizer.h), from its GGUF tokenizer.ggml.* keys or its
 * tokenizer.json (and tokenizer_config.json), into *ret on success (free with
 * tsr_tokenizer_free).  TSR_E_UNSUPPORTED when the model has neither; else the
 * tokenizer's own status and err. */
struct tsr_tokenizer;
tsr_status tsr_model_meta_tokenizer(const tsr_model_meta *m, struct tsr_tokenizer **ret, char *err, size_t errlen);

#endif
