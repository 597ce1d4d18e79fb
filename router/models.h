/* models.h - the models this router serves, learned from the workers' ModelInfo.
 *
 * One entry per served model (its first served name), holding what the request path
 * needs to turn text into token ids and back: the tokenizer and the chat template
 * (built once per tokenizer hash on the libuv thread pool, never on the loop), EOS
 * ids, max_model_len and the generation defaults.  Entries are reference-counted:
 * a request holds its model while it is being served, so a worker restart that
 * rebuilds the entry never pulls the tokenizer from under a request.
 * Loop thread only, except that a ready entry's tokenizer and template are immutable
 * and may be used from thread-pool jobs that hold a reference. */
#ifndef TSR_ROUTER_MODELS_H
#define TSR_ROUTER_MODELS_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "common/config.h"
#include "common/template.h"
#include "common/tokenizer.h"
#include "common/wire.h"

typedef struct tsr_models_entry {
        int refs;
        char *name;                 /* first served name: responses' `model`, metrics' model_name */
        char **names;               /* every served name */
        size_t n_names;
        char *root;
        uint64_t tokenizer_hash;
        bool ready;                 /* tokenizer (and template, if any) built */
        char *load_error;           /* set when building failed */
        tsr_tokenizer *tok;
        tsr_template *tpl;          /* NULL when the model has no chat template */
        char *bos_token;            /* spelled, for the template context ("" if none) */
        char *eos_token;
        uint32_t *eos_ids;
        size_t n_eos_ids;
        uint32_t max_model_len;
        uint32_t block_size;
        uint32_t vocab_size;
        uint32_t max_logprobs;
        Tessera__V1__GenerationDefaults gen;   /* copied scalars */
} tsr_models_entry;

typedef struct tsr_models_registry tsr_models_registry;

tsr_status tsr_models_registry_new(uv_loop_t *loop, const tsr_config *cfg, tsr_models_registry **ret);
/* Stop accepting work; entries are freed as their last reference goes. */
void tsr_models_registry_free(tsr_models_registry **r);

/* A worker's ModelInfo (and the ModelInfo that carries its tokenizer bytes, which may
 * be an earlier one) arrived: create or refresh the model's entry. */
void tsr_models_registry_on_info(tsr_models_registry *r, const Tessera__V1__ModelInfo *mi,
                                 const Tessera__V1__ModelInfo *tokenizer_src);

/* The entry serving `name` (NULL or "" = the first model), or NULL.  Borrowed. */
tsr_models_entry *tsr_models_registry_find(tsr_models_registry *r, const char *name);
size_t tsr_models_registry_count(const tsr_models_registry *r);
tsr_models_entry *tsr_models_registry_at(tsr_models_registry *r, size_t i);

tsr_models_entry *tsr_models_ref(tsr_models_entry *m);
void tsr_models_unref(tsr_models_entry *m);

/* Whether `mi` serves the model `m` (same first served name). */
bool tsr_models_served_by(const tsr_models_entry *m, const Tessera__V1__ModelInfo *mi);

#endif
