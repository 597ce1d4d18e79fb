/* models.c - the model registry (see models.h). */
#include "models.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct tsr_models_registry {
        uv_loop_t *loop;
        const tsr_config *cfg;
        tsr_models_entry **items;
        size_t n;
        bool closing;
};

/* A build job: inputs are deep copies (the ModelInfo envelopes belong to worker_link
 * and may be replaced while the job runs); outputs are installed on the loop. */
typedef struct build_job {
        uv_work_t work;
        tsr_models_registry *reg;
        tsr_models_entry *entry;
        Tessera__V1__ModelInfo *tok_src;   /* unpacked copy */
        char *template_src;
        char *template_origin;
        /* results */
        tsr_tokenizer *tok;
        tsr_template *tpl;
        char err[512];
} build_job;

tsr_models_entry *tsr_models_ref(tsr_models_entry *m) {
        m->refs++;
        return m;
}

void tsr_models_unref(tsr_models_entry *m) {
        if (!m || --m->refs > 0)
                return;
        tsr_tokenizer_free(&m->tok);
        tsr_template_free(&m->tpl);
        for (size_t i = 0; i < m->n_names; i++)
                free(m->names[i]);
        free(m->names);
        free(m->name);
        free(m->root);
        free(m->load_error);
        free(m->bos_token);
        free(m->eos_token);
        free(m->eos_ids);
        free(m);
}

tsr_status tsr_models_registry_new(uv_loop_t *loop, const tsr_config *cfg, tsr_models_registry **ret) {
        tsr_models_registry *r = calloc(1, sizeof(*r));
        if (!r)
                return TSR_E_NOMEM;
        r->loop = loop;
        r->cfg = cfg;
        *ret = r;
        return TSR_OK;
}

void tsr_models_registry_free(tsr_models_registry **rp) {
        tsr_models_registry *r;
        if (!rp || !*rp)
                return;
        r = *rp;
        for (size_t i = 0; i < r->n; i++)
                tsr_models_unref(r->items[i]);
        free(r->items);
        free(r);
        *rp = NULL;
}

size_t tsr_models_registry_count(const tsr_models_registry *r) { return r->n; }
tsr_models_entry *tsr_models_registry_at(tsr_models_registry *r, size_t i) { return i < r->n ? r->items[i] : NULL; }

bool tsr_models_served_by(const tsr_models_entry *m, const Tessera__V1__ModelInfo *mi) {
        return mi && mi->n_served_model_names && strcmp(mi->served_model_names[0], m->name) == 0;
}

tsr_models_entry *tsr_models_registry_find(tsr_models_registry *r, const char *name) {
        if (!name || !*name)
                return r->n ? r->items[0] : NULL;
        for (size_t i = 0; i < r->n; i++)
                for (size_t k = 0; k < r->items[i]->n_names; k++)
                        if (strcmp(r->items[i]->names[k], name) == 0)
                                return r->items[i];
        return NULL;
}

/* --chat-template: a file, or the template itself (vLLM accepts both). */
static char *load_template_override(const char *arg, char **origin) {
        FILE *f = fopen(arg, "rb");
        if (f) {
                char *buf = NULL;
                size_t cap = 0, len = 0;
                for (;;) {
                        if (len + 4096 + 1 > cap) {
                                char *g = realloc(buf, cap = cap ? cap * 2 : 8192);
                                if (!g) {
                                        free(buf);
                                        fclose(f);
                                        return NULL;
                                }
                                buf = g;
                        }
                        size_t n = fread(buf + len, 1, 4096, f);
                        len += n;
                        if (n < 4096)
                                break;
                        if (len > (16u << 20))
                                break;
                }
                fclose(f);
                buf[len] = '\0';
                *origin = strdup(arg);
                return buf;
        }
        *origin = strdup("--chat-template (inline)");
        return strdup(arg);
}

static tsr_status build_tokenizer(const Tessera__V1__ModelInfo *mi, tsr_tokenizer **tok, char *err, size_t errlen) {
        if (mi->tokenizer_case == TESSERA__V1__MODEL_INFO__TOKENIZER_HF) {
                const Tessera__V1__HfTokenizer *hf = mi->hf;
                return tsr_tokenizer_new_json(hf->tokenizer_json.data, hf->tokenizer_json.len,
                                              hf->tokenizer_config_json.len ? hf->tokenizer_config_json.data : NULL,
                                              hf->tokenizer_config_json.len, tok, err, errlen);
        }
        if (mi->tokenizer_case == TESSERA__V1__MODEL_INFO__TOKENIZER_GGUF) {
                const Tessera__V1__GgufTokenizer *g = mi->gguf;
                tsr_tok_gguf d = {
                        .model = g->model,
                        .pre = g->pre && *g->pre ? g->pre : NULL,
                        .tokens = (const char *const *)g->tokens,
                        .n_tokens = g->n_tokens,
                        .scores = g->n_scores ? g->scores : NULL,
                        .token_types = g->n_token_types ? g->token_types : NULL,
                        .merges = (const char *const *)g->merges,
                        .n_merges = g->n_merges,
                        .bos_id = g->bos_token_id,
                        .eos_id = g->eos_token_id,
                        .unk_id = g->unk_token_id,
                        .pad_id = g->pad_token_id,
                        .add_bos = g->add_bos_token,
                        .add_eos = g->add_eos_token,
                        .add_space_prefix = g->add_space_prefix,
                };
                return tsr_tokenizer_new_gguf(&d, tok, err, errlen);
        }
        snprintf(err, errlen, "the worker sent no tokenizer");
        return TSR_E_INVAL;
}

static void build_work(uv_work_t *w) {   /* thread pool */
        build_job *j = w->data;
        char err[400] = "";
        if (build_tokenizer(j->tok_src, &j->tok, err, sizeof(err)) != TSR_OK) {
                snprintf(j->err, sizeof(j->err), "tokenizer: %s", err);
                return;
        }
        if (j->template_src && *j->template_src &&
            tsr_template_parse(j->template_src, strlen(j->template_src), &j->tpl, err, sizeof(err)) != TSR_OK)
                snprintf(j->err, sizeof(j->err), "chat template (%s): %s", j->template_origin, err);
}

static char *token_spelling(const tsr_tokenizer *t, int64_t id) {
        const char *s = id >= 0 ? tsr_tokenizer_token_str(t, (uint32_t)id) : NULL;
        return strdup(s ? s : "");
}

static void build_done(uv_work_t *w, int status) {   /* loop */
        build_job *j = w->data;
        tsr_models_entry *m = j->entry;

        if (j->err[0] || status != 0) {
                free(m->load_error);
                m->load_error = strdup(j->err[0] ? j->err : "cancelled");
                log_error("model %s: cannot serve: %s", m->name, m->load_error);
                tsr_tokenizer_free(&j->tok);
                tsr_template_free(&j->tpl);
        } else {
                tsr_tokenizer_free(&m->tok);
                tsr_template_free(&m->tpl);
                m->tok = j->tok;
                m->tpl = j->tpl;
                free(m->bos_token);
                free(m->eos_token);
                m->bos_token = token_spelling(m->tok, tsr_tokenizer_bos_id(m->tok));
                m->eos_token = token_spelling(m->tok, tsr_tokenizer_eos_id(m->tok));
                m->ready = true;
                log_info("model %s: tokenizer ready (vocab %zu), chat template %s", m->name,
                         tsr_tokenizer_vocab_size(m->tok), m->tpl ? j->template_origin : "none");
        }
        tessera__v1__model_info__free_unpacked(j->tok_src, NULL);
        free(j->template_src);
        free(j->template_origin);
        tsr_models_unref(m);
        free(j);
}

/* Deep copy of a ModelInfo through its wire form: the job outlives the envelope. */
static Tessera__V1__ModelInfo *copy_info(const Tessera__V1__ModelInfo *mi) {
        size_t n = tessera__v1__model_info__get_packed_size(mi);
        uint8_t *buf = malloc(n ? n : 1);
        Tessera__V1__ModelInfo *copy;
        if (!buf)
                return NULL;
        tessera__v1__model_info__pack(mi, buf);
        copy = tessera__v1__model_info__unpack(NULL, n, buf);
        free(buf);
        return copy;
}

static tsr_status fill_entry(tsr_models_entry *m, const Tessera__V1__ModelInfo *mi) {
        for (size_t i = 0; i < m->n_names; i++)
                free(m->names[i]);
        free(m->names);
        free(m->root);
        free(m->eos_ids);
        m->names = calloc(mi->n_served_model_names, sizeof(char *));
        m->eos_ids = calloc(mi->n_eos_token_ids + 1, sizeof(uint32_t));
        m->root = strdup(mi->model_root);
        if (!m->names || !m->eos_ids || !m->root)
                return TSR_E_NOMEM;
        for (m->n_names = 0; m->n_names < mi->n_served_model_names; m->n_names++)
                if (!(m->names[m->n_names] = strdup(mi->served_model_names[m->n_names])))
                        return TSR_E_NOMEM;
        memcpy(m->eos_ids, mi->eos_token_ids, mi->n_eos_token_ids * sizeof(uint32_t));
        m->n_eos_ids = mi->n_eos_token_ids;
        m->max_model_len = mi->max_model_len;
        m->block_size = mi->block_size;
        m->vocab_size = mi->vocab_size;
        m->max_logprobs = mi->max_logprobs;
        tessera__v1__generation_defaults__init(&m->gen);
        if (mi->generation_defaults) {
                const Tessera__V1__GenerationDefaults *g = mi->generation_defaults;
                m->gen.has_temperature = g->has_temperature;
                m->gen.temperature = g->temperature;
                m->gen.has_top_p = g->has_top_p;
                m->gen.top_p = g->top_p;
                m->gen.has_top_k = g->has_top_k;
                m->gen.top_k = g->top_k;
                m->gen.has_min_p = g->has_min_p;
                m->gen.min_p = g->min_p;
                m->gen.has_repetition_penalty = g->has_repetition_penalty;
                m->gen.repetition_penalty = g->repetition_penalty;
                m->gen.has_max_new_tokens = g->has_max_new_tokens;
                m->gen.max_new_tokens = g->max_new_tokens;
        }
        return TSR_OK;
}

void tsr_models_registry_on_info(tsr_models_registry *r, const Tessera__V1__ModelInfo *mi,
                                 const Tessera__V1__ModelInfo *tok_src) {
        tsr_models_entry *m = NULL, **grown;
        build_job *j;

        for (size_t i = 0; i < r->n; i++)
                if (strcmp(r->items[i]->name, mi->served_model_names[0]) == 0)
                        m = r->items[i];
        if (m && (m->ready || !m->load_error) && m->tokenizer_hash == mi->tokenizer_hash) {
                fill_entry(m, mi);   /* same tokenizer: refresh the scalars only */
                return;
        }
        if (!m) {
                m = calloc(1, sizeof(*m));
                grown = m ? realloc(r->items, (r->n + 1) * sizeof(*grown)) : NULL;
                if (!m || !grown || !(m->name = strdup(mi->served_model_names[0]))) {
                        free(m);
                        log_error("out of memory registering model %s", mi->served_model_names[0]);
                        return;
                }
                m->refs = 1;
                r->items = grown;
                r->items[r->n++] = m;
        }
        if (fill_entry(m, mi) != TSR_OK) {
                log_error("out of memory registering model %s", m->name);
                return;
        }
        m->tokenizer_hash = mi->tokenizer_hash;
        m->ready = false;
        free(m->load_error);
        m->load_error = NULL;
        if (!tok_src) {
                m->load_error = strdup("no tokenizer received from the worker");
                return;
        }
        j = calloc(1, sizeof(*j));
        if (!j || !(j->tok_src = copy_info(tok_src))) {
                free(j);
                m->load_error = strdup("out of memory");
                return;
        }
        if (r->cfg->chat_template) {
                j->template_src = load_template_override(r->cfg->chat_template, &j->template_origin);
        } else {
                j->template_src = strdup(mi->chat_template ? mi->chat_template : "");
                j->template_origin = strdup("from the model");
        }
        j->reg = r;
        j->entry = tsr_models_ref(m);
        j->work.data = j;
        if (uv_queue_work(r->loop, &j->work, build_work, build_done) != 0) {
                tsr_models_unref(m);
                tessera__v1__model_info__free_unpacked(j->tok_src, NULL);
                free(j->template_src);
                free(j->template_origin);
                free(j);
                m->load_error = strdup("cannot queue the tokenizer build");
        }
}
