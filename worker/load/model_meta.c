/* model_meta.c - model metadata from a Hugging Face folder or a GGUF file.
 *
 * Everything is copied out of the source files into heap memory owned by the
 * tsr_model_meta, so the JSON documents and the GGUF map are released before returning. */
#include "worker/load/model_meta.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/tokenizer.h"
#include "worker/load/gguf.h"

/* An eos_token_id list longer than this is a corrupt file, not a model. */
#define META_MAX_EOS_IDS 1024
/* GGUF keys are "<arch>.<name>"; an architecture name is a short identifier. */
#define META_MAX_ARCH_LEN 128
/* GGUF stores "no such token" as UINT32_MAX (-1 written through a uint32). */
#define GGUF_NO_TOKEN 0xFFFFFFFFu

/* Where messages go and which file they name. */
typedef struct meta_ctx {
        const char *file;
        char *err;
        size_t errlen;
} meta_ctx;

static tsr_status meta_fail(const meta_ctx *c, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
static tsr_status meta_fail(const meta_ctx *c, tsr_status st, const char *fmt, ...) {
        va_list ap;
        int n;

        if (!c->err || c->errlen == 0)
                return st;
        n = snprintf(c->err, c->errlen, "%s: ", c->file);
        if (n < 0 || (size_t)n >= c->errlen)
                return st;
        va_start(ap, fmt);
        vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
        va_end(ap);
        return st;
}

static char *path_join(const char *dir, const char *name) {
        size_t n = strlen(dir) + 1 + strlen(name) + 1;
        char *p = malloc(n);
        if (p)
                snprintf(p, n, "%s/%s", dir, name);
        return p;
}

static char *dup_bytes(const char *s, size_t len) {
        char *p = malloc(len + 1);
        if (!p)
                return NULL;
        if (len)
                memcpy(p, s, len);
        p[len] = '\0';
        return p;
}

/* Read a whole regular file of at most `limit` bytes; the copy is NUL-terminated (not
 * counted in *ret_len).  TSR_E_NOTFOUND when it does not exist. */
static tsr_status read_file(const meta_ctx *c, size_t limit, bool optional, uint8_t **ret, size_t *ret_len) {
        struct stat sb;
        uint8_t *buf = NULL;
        size_t got = 0;
        tsr_status st = TSR_OK;
        int fd;

        fd = open(c->file, O_RDONLY | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && optional)
                return TSR_E_NOTFOUND;          /* not an error for the caller: no message */
        if (fd < 0)
                return meta_fail(c, errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO, "%s", strerror(errno));
        if (fstat(fd, &sb) != 0) {
                st = meta_fail(c, TSR_E_IO, "%s", strerror(errno));
                goto done;
        }
        if (!S_ISREG(sb.st_mode)) {
                st = meta_fail(c, TSR_E_INVAL, "not a regular file");
                goto done;
        }
        if ((uint64_t)sb.st_size > limit) {
                st = meta_fail(c, TSR_E_LIMIT, "file is %lld bytes, over the %zu-byte limit", (long long)sb.st_size,
                               limit);
                goto done;
        }
        buf = malloc((size_t)sb.st_size + 1);
        if (!buf) {
                st = meta_fail(c, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        while (got < (size_t)sb.st_size) {
                ssize_t n = read(fd, buf + got, (size_t)sb.st_size - got);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        /* n == 0: the file shrank under us, which is as bad as an error. */
                        st = meta_fail(c, TSR_E_IO, "read failed: %s",
                                       n < 0 ? strerror(errno) : "unexpected end of file");
                        goto done;
                }
                got += (size_t)n;
        }
        buf[got] = '\0';
        *ret = buf;
        *ret_len = got;
        buf = NULL;
done:
        free(buf);
        close(fd);
        return st;
}

static tsr_status eos_add(const meta_ctx *c, tsr_model_meta *m, uint64_t id) {
        uint32_t *ids;
        size_t i;

        for (i = 0; i < m->n_eos_token_ids; i++)
                if (m->eos_token_ids[i] == id)
                        return TSR_OK;
        if (m->n_eos_token_ids >= META_MAX_EOS_IDS)
                return meta_fail(c, TSR_E_LIMIT, "more than %d EOS token ids", META_MAX_EOS_IDS);
        ids = realloc(m->eos_token_ids, (m->n_eos_token_ids + 1) * sizeof(*ids));
        if (!ids)
                return meta_fail(c, TSR_E_NOMEM, "out of memory");
        ids[m->n_eos_token_ids++] = (uint32_t)id;
        m->eos_token_ids = ids;
        return TSR_OK;
}

/* ---- Hugging Face folders ------------------------------------------------------- */

static tsr_status json_parse(const meta_ctx *c, const uint8_t *buf, size_t len, size_t flags, json_t **ret) {
        json_error_t jerr;
        json_t *root = json_loadb((const char *)buf, len, JSON_REJECT_DUPLICATES | flags, &jerr);

        if (!root)
                return meta_fail(c, TSR_E_INVAL, "invalid JSON at line %d column %d: %s", jerr.line, jerr.column,
                                 jerr.text);
        if (!json_is_object(root)) {
                json_decref(root);
                return meta_fail(c, TSR_E_INVAL, "expected a JSON object at the top level");
        }
        *ret = root;
        return TSR_OK;
}

/* config.json field `key`, falling back to "text_config" (multimodal configs keep the
 * language model's fields there).  NULL when absent or null.  `name` gets the path
 * used in messages. */
static json_t *cfg_get(json_t *root, const char *key, char *name, size_t namelen) {
        json_t *v = json_object_get(root, key), *tc;

        snprintf(name, namelen, "%s", key);
        if (v && !json_is_null(v))
                return v;
        tc = json_object_get(root, "text_config");
        if (!json_is_object(tc))
                return NULL;
        v = json_object_get(tc, key);
        if (!v || json_is_null(v))
                return NULL;
        snprintf(name, namelen, "text_config.%s", key);
        return v;
}

static tsr_status cfg_u32(const meta_ctx *c, json_t *root, const char *key, uint32_t *ret, bool *present) {
        char name[96];
        json_t *v = cfg_get(root, key, name, sizeof(name));
        json_int_t x;

        if (present)
                *present = false;
        if (!v)
                return TSR_OK;
        if (!json_is_integer(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected an integer", name);
        x = json_integer_value(v);
        if (x < 0 || x > (json_int_t)UINT32_MAX)
                return meta_fail(c, TSR_E_INVAL, "field '%s': %lld is out of range (0..%u)", name, (long long)x,
                                 UINT32_MAX);
        *ret = (uint32_t)x;
        if (present)
                *present = true;
        return TSR_OK;
}

static tsr_status cfg_i64(const meta_ctx *c, json_t *root, const char *key, int64_t *ret, bool *present) {
        char name[96];
        json_t *v = cfg_get(root, key, name, sizeof(name));

        *present = false;
        if (!v)
                return TSR_OK;
        if (!json_is_integer(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected an integer", name);
        *ret = json_integer_value(v);
        *present = true;
        return TSR_OK;
}

static tsr_status cfg_f64(const meta_ctx *c, json_t *root, const char *key, double *ret, bool *present) {
        char name[96];
        json_t *v = cfg_get(root, key, name, sizeof(name));

        if (present)
                *present = false;
        if (!v)
                return TSR_OK;
        if (!json_is_number(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected a number", name);
        *ret = json_number_value(v);
        if (present)
                *present = true;
        return TSR_OK;
}

static tsr_status cfg_bool(const meta_ctx *c, json_t *root, const char *key, bool *ret) {
        char name[96];
        json_t *v = cfg_get(root, key, name, sizeof(name));

        if (!v)
                return TSR_OK;
        if (!json_is_boolean(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected true or false", name);
        *ret = json_is_true(v);
        return TSR_OK;
}

/* A top-level string field copied to the heap; *ret stays NULL when absent or null. */
static tsr_status cfg_str(const meta_ctx *c, json_t *root, const char *key, char **ret) {
        json_t *v = json_object_get(root, key);
        const char *s;
        size_t len;

        if (!v || json_is_null(v))
                return TSR_OK;
        if (!json_is_string(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected a string", key);
        s = json_string_value(v);
        len = json_string_length(v);
        if (memchr(s, '\0', len))
                return meta_fail(c, TSR_E_INVAL, "field '%s': string contains a NUL character", key);
        *ret = dup_bytes(s, len);
        return *ret ? TSR_OK : meta_fail(c, TSR_E_NOMEM, "out of memory");
}

/* eos_token_id: an integer or a list of integers (null means none). */
static tsr_status cfg_eos(const meta_ctx *c, json_t *root, tsr_model_meta *m) {
        char name[96];
        json_t *v = cfg_get(root, "eos_token_id", name, sizeof(name)), *e;
        size_t i;
        tsr_status st;

        if (!v)
                return TSR_OK;
        if (json_is_integer(v)) {
                if (json_integer_value(v) < 0 || json_integer_value(v) > (json_int_t)UINT32_MAX)
                        return meta_fail(c, TSR_E_INVAL, "field '%s': %lld is not a token id", name,
                                         (long long)json_integer_value(v));
                return eos_add(c, m, (uint64_t)json_integer_value(v));
        }
        if (!json_is_array(v))
                return meta_fail(c, TSR_E_INVAL, "field '%s': expected an integer or a list of integers", name);
        json_array_foreach(v, i, e) {
                if (!json_is_integer(e))
                        return meta_fail(c, TSR_E_INVAL, "field '%s[%zu]': expected an integer", name, i);
                if (json_integer_value(e) < 0 || json_integer_value(e) > (json_int_t)UINT32_MAX)
                        return meta_fail(c, TSR_E_INVAL, "field '%s[%zu]': %lld is not a token id", name, i,
                                         (long long)json_integer_value(e));
                st = eos_add(c, m, (uint64_t)json_integer_value(e));
                if (st != TSR_OK)
                        return st;
        }
        return TSR_OK;
}

static tsr_status hf_config(const meta_ctx *c, json_t *root, tsr_model_meta *m) {
        json_t *archs = json_object_get(root, "architectures");
        bool present;
        int64_t bos;
        tsr_status st;

        if (archs && !json_is_null(archs)) {
                json_t *a0 = json_array_get(archs, 0);
                if (!json_is_array(archs) || (a0 && !json_is_string(a0)))
                        return meta_fail(c, TSR_E_INVAL, "field 'architectures': expected a list of strings");
                if (a0) {
                        m->architecture = dup_bytes(json_string_value(a0), strlen(json_string_value(a0)));
                        if (!m->architecture)
                                return meta_fail(c, TSR_E_NOMEM, "out of memory");
                }
        }
        st = cfg_str(c, root, "model_type", &m->model_type);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "max_position_embeddings", &m->max_model_len, NULL);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "vocab_size", &m->vocab_size, NULL);
        if (st == TSR_OK)
                st = cfg_i64(c, root, "bos_token_id", &bos, &present);
        if (st == TSR_OK && present) {
                if (bos < 0 || bos > (int64_t)UINT32_MAX)
                        return meta_fail(c, TSR_E_INVAL, "field 'bos_token_id': %lld is not a token id",
                                         (long long)bos);
                m->bos_token_id = bos;
        }
        if (st == TSR_OK)
                st = cfg_eos(c, root, m);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "hidden_size", &m->hidden_size, NULL);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "num_hidden_layers", &m->num_hidden_layers, NULL);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "num_attention_heads", &m->num_attention_heads, NULL);
        if (st == TSR_OK)
                st = cfg_u32(c, root, "num_key_value_heads", &m->num_key_value_heads, &present);
        if (st == TSR_OK && !present)
                m->num_key_value_heads = m->num_attention_heads;
        if (st == TSR_OK)
                st = cfg_u32(c, root, "head_dim", &m->head_dim, &present);
        if (st == TSR_OK && !present && m->num_attention_heads)
                m->head_dim = m->hidden_size / m->num_attention_heads;
        if (st == TSR_OK)
                st = cfg_u32(c, root, "intermediate_size", &m->intermediate_size, NULL);
        if (st == TSR_OK)
                st = cfg_f64(c, root, "rope_theta", &m->rope_theta, NULL);
        if (st == TSR_OK)
                st = cfg_f64(c, root, "rms_norm_eps", &m->rms_norm_eps, &present);
        /* NemotronH names its RMSNorm epsilon layer_norm_epsilon. */
        if (st == TSR_OK && !present)
                st = cfg_f64(c, root, "layer_norm_epsilon", &m->rms_norm_eps, NULL);
        if (st == TSR_OK)
                st = cfg_bool(c, root, "tie_word_embeddings", &m->tie_word_embeddings);
        return st;
}

static tsr_status hf_generation_config(const meta_ctx *c, json_t *root, tsr_model_meta *m) {
        bool present;
        int64_t bos;
        tsr_status st;

        st = cfg_eos(c, root, m);
        /* config.json wins for BOS; generation_config.json fills it in when config has none. */
        if (st == TSR_OK && m->bos_token_id < 0) {
                st = cfg_i64(c, root, "bos_token_id", &bos, &present);
                if (st == TSR_OK && present) {
                        if (bos < 0 || bos > (int64_t)UINT32_MAX)
                                return meta_fail(c, TSR_E_INVAL, "field 'bos_token_id': %lld is not a token id",
                                                 (long long)bos);
                        m->bos_token_id = bos;
                }
        }
        if (st == TSR_OK)
                st = cfg_f64(c, root, "temperature", &m->gen.temperature, &m->gen.has_temperature);
        if (st == TSR_OK)
                st = cfg_f64(c, root, "top_p", &m->gen.top_p, &m->gen.has_top_p);
        if (st == TSR_OK)
                st = cfg_i64(c, root, "top_k", &m->gen.top_k, &m->gen.has_top_k);
        if (st == TSR_OK)
                st = cfg_f64(c, root, "min_p", &m->gen.min_p, &m->gen.has_min_p);
        if (st == TSR_OK)
                st = cfg_f64(c, root, "repetition_penalty", &m->gen.repetition_penalty, &m->gen.has_repetition_penalty);
        if (st == TSR_OK)
                st = cfg_i64(c, root, "max_new_tokens", &m->gen.max_new_tokens, &m->gen.has_max_new_tokens);
        if (st == TSR_OK && m->gen.has_max_new_tokens && m->gen.max_new_tokens < 0)
                return meta_fail(c, TSR_E_INVAL, "field 'max_new_tokens': %lld is negative",
                                 (long long)m->gen.max_new_tokens);
        return st;
}

/* tokenizer_config.json "chat_template": a string, or a list of {"name", "template"}
 * objects of which the one named "default" is the chat template. */
static tsr_status hf_chat_template(const meta_ctx *c, json_t *root, tsr_model_meta *m) {
        json_t *v = json_object_get(root, "chat_template"), *e;
        size_t i;

        if (!v || json_is_null(v) || json_is_string(v))
                return cfg_str(c, root, "chat_template", &m->chat_template);
        if (!json_is_array(v))
                return meta_fail(c, TSR_E_INVAL,
                                 "field 'chat_template': expected a string or a list of {name, template}");
        json_array_foreach(v, i, e) {
                json_t *name = json_object_get(e, "name"), *tmpl = json_object_get(e, "template");
                if (!json_is_string(name) || !json_is_string(tmpl))
                        return meta_fail(c, TSR_E_INVAL,
                                         "field 'chat_template[%zu]': expected {\"name\": string, \"template\": string}",
                                         i);
                if (strcmp(json_string_value(name), "default") == 0 && !m->chat_template)
                        return cfg_str(c, e, "template", &m->chat_template);
        }
        return TSR_OK;
}

/* Read dir/name as JSON.  *ret stays NULL when the file is absent and !required. */
static tsr_status hf_read_json(meta_ctx *c, const char *dir, const char *name, bool required, size_t limit,
                               uint8_t **ret_buf, size_t *ret_len, json_t **ret) {
        char *path = path_join(dir, name);
        uint8_t *buf = NULL;
        size_t len = 0;
        json_t *root = NULL;
        tsr_status st;

        if (!path)
                return meta_fail(c, TSR_E_NOMEM, "out of memory");
        c->file = path;
        st = read_file(c, limit, !required, &buf, &len);
        if (st == TSR_E_NOTFOUND && !required) {
                st = TSR_OK;
                goto done;
        }
        if (st == TSR_E_NOTFOUND)
                st = meta_fail(c, st, "no such file (a Hugging Face model folder needs it)");
        if (st == TSR_OK)
                /* transformers writes model_max_length = 1e30 as an integer when a model
                 * sets none; jansson refuses integers past int64 ("too big integer").
                 * Nothing read from tokenizer_config.json is an integer: read them as
                 * reals there. */
                st = json_parse(c, buf, len, strcmp(name, "tokenizer_config.json") == 0 ? JSON_DECODE_INT_AS_REAL : 0,
                                &root);
        if (st == TSR_OK) {
                *ret = root;
                if (ret_buf) {
                        *ret_buf = buf;
                        *ret_len = len;
                        buf = NULL;
                }
        }
done:
        /* Messages are already written; the path must not outlive this call. */
        c->file = dir;
        free(buf);
        free(path);
        return st;
}

/* The tokenizer's EOS id first in eos_token_ids (added when the config files did not
 * list it): vLLM stops on the tokenizer's eos_token_id as EOS and on generation_config's
 * other ids as stop ids (engine.h, eos_ids).  tokenizer_config.json "eos_token" is a
 * string or {"content": ...}; its id is that of the tokenizer.json added token with this
 * content, else its entry in model.vocab.  Nothing resolvable (no eos_token, a string no
 * table has, a tokenizer.json jansson cannot parse - the router reports that one): the
 * order stays as read.  Startup only. */
static tsr_status hf_tokenizer_eos_first(const meta_ctx *c, json_t *tok_cfg, tsr_model_meta *m) {
        json_t *eos = json_object_get(tok_cfg, "eos_token"), *tok, *e, *id = NULL;
        const char *content;
        size_t i, at;

        if (json_is_object(eos))
                eos = json_object_get(eos, "content");
        if (!json_is_string(eos) || !m->tokenizer_json)
                return TSR_OK;
        content = json_string_value(eos);
        tok = json_loadb((const char *)m->tokenizer_json, m->tokenizer_json_len, 0, NULL);
        if (!tok)
                return TSR_OK;
        json_array_foreach(json_object_get(tok, "added_tokens"), i, e) {
                json_t *ct = json_object_get(e, "content");
                if (json_is_string(ct) && strcmp(json_string_value(ct), content) == 0) {
                        id = json_object_get(e, "id");
                        break;
                }
        }
        if (!id)
                id = json_object_get(json_object_get(json_object_get(tok, "model"), "vocab"), content);
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > (json_int_t)UINT32_MAX) {
                json_decref(tok);
                return TSR_OK;
        }
        uint32_t eos_id = (uint32_t)json_integer_value(id);
        json_decref(tok);
        for (at = 0; at < m->n_eos_token_ids && m->eos_token_ids[at] != eos_id; at++)
                ;
        if (at == m->n_eos_token_ids) {
                tsr_status st = eos_add(c, m, eos_id);
                if (st != TSR_OK)
                        return st;
        }
        memmove(m->eos_token_ids + 1, m->eos_token_ids, at * sizeof(*m->eos_token_ids));
        m->eos_token_ids[0] = eos_id;
        return TSR_OK;
}

static tsr_status hf_load(const char *dir, tsr_model_meta *m, char *err, size_t errlen) {
        meta_ctx c = {.file = dir, .err = err, .errlen = errlen};
        json_t *config = NULL, *gen = NULL, *tok_cfg = NULL;
        char *path = NULL;
        XXH64_state_t *h = NULL;
        tsr_status st;

        st = hf_read_json(&c, dir, "config.json", true, TSR_MODEL_META_MAX_SMALL_JSON, NULL, NULL, &config);
        if (st == TSR_OK) {
                path = path_join(dir, "config.json");
                c.file = path ? path : dir;
                st = path ? hf_config(&c, config, m) : meta_fail(&c, TSR_E_NOMEM, "out of memory");
                c.file = dir;
                free(path);
                path = NULL;
        }
        if (st == TSR_OK)
                st = hf_read_json(&c, dir, "generation_config.json", false, TSR_MODEL_META_MAX_SMALL_JSON, NULL, NULL,
                                  &gen);
        if (st == TSR_OK && gen) {
                path = path_join(dir, "generation_config.json");
                c.file = path ? path : dir;
                st = path ? hf_generation_config(&c, gen, m) : meta_fail(&c, TSR_E_NOMEM, "out of memory");
                c.file = dir;
                free(path);
                path = NULL;
        }
        if (st == TSR_OK) {
                path = path_join(dir, "tokenizer.json");
                c.file = path ? path : dir;
                st = path ? read_file(&c, TSR_MODEL_META_MAX_TOKENIZER_JSON, false, &m->tokenizer_json, &m->tokenizer_json_len)
                          : meta_fail(&c, TSR_E_NOMEM, "out of memory");
                if (st == TSR_E_NOTFOUND)
                        st = meta_fail(&c, st, "no such file (a Hugging Face model folder needs it)");
                c.file = dir;
                free(path);
                path = NULL;
        }
        if (st == TSR_OK)
                st = hf_read_json(&c, dir, "tokenizer_config.json", false, TSR_MODEL_META_MAX_SMALL_JSON,
                                  &m->tokenizer_config_json, &m->tokenizer_config_json_len, &tok_cfg);
        if (st == TSR_OK && tok_cfg) {
                path = path_join(dir, "tokenizer_config.json");
                c.file = path ? path : dir;
                st = path ? hf_chat_template(&c, tok_cfg, m) : meta_fail(&c, TSR_E_NOMEM, "out of memory");
                if (st == TSR_OK)
                        st = hf_tokenizer_eos_first(&c, tok_cfg, m);
                c.file = dir;
                free(path);
                path = NULL;
        }
        if (st == TSR_OK && !m->chat_template) {
                uint8_t *buf = NULL;
                size_t len = 0;

                path = path_join(dir, "chat_template.jinja");
                c.file = path ? path : dir;
                st = path ? read_file(&c, TSR_MODEL_META_MAX_SMALL_JSON, true, &buf, &len)
                          : meta_fail(&c, TSR_E_NOMEM, "out of memory");
                if (st == TSR_E_NOTFOUND)
                        st = TSR_OK;            /* optional: no template at all is fine */
                else if (st == TSR_OK && memchr(buf, '\0', len)) {
                        st = meta_fail(&c, TSR_E_INVAL, "template contains a NUL byte");
                        free(buf);
                } else if (st == TSR_OK)
                        m->chat_template = (char *)buf;
                c.file = dir;
                free(path);
                path = NULL;
        }
        if (st == TSR_OK) {
                h = XXH64_createState();
                if (!h || XXH64_reset(h, 0) != XXH_OK ||
                    XXH64_update(h, m->tokenizer_json, m->tokenizer_json_len) != XXH_OK ||
                    (m->tokenizer_config_json &&
                     XXH64_update(h, m->tokenizer_config_json, m->tokenizer_config_json_len) != XXH_OK))
                        st = meta_fail(&c, TSR_E_NOMEM, "out of memory");
                else
                        m->tokenizer_hash = XXH64_digest(h);
        }
        XXH64_freeState(h);
        json_decref(config);
        json_decref(gen);
        json_decref(tok_cfg);
        return st;
}

/* ---- GGUF files ----------------------------------------------------------------- */

/* An unsigned integer key, or the largest entry of a per-layer array of them. */
static tsr_status gguf_u32(const meta_ctx *c, const tsr_gguf *g, const char *key, uint32_t *ret, bool *present) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        uint64_t x = 0, e, i;
        tsr_gguf_value v;

        if (present)
                *present = false;
        if (!kv)
                return TSR_OK;
        if (kv->value.type == TSR_GGUF_TYPE_ARRAY) {
                for (i = 0; i < kv->value.count; i++) {
                        if (tsr_gguf_array_elem(&kv->value, i, &v) != TSR_OK || tsr_gguf_get_u64(&v, &e) != TSR_OK)
                                return meta_fail(c, TSR_E_INVAL, "key '%s': expected unsigned integers, found %s",
                                                 key, tsr_gguf_type_name(kv->value.elem_type));
                        x = e > x ? e : x;
                }
        } else if (tsr_gguf_get_u64(&kv->value, &x) != TSR_OK) {
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected an unsigned integer, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        }
        if (x > UINT32_MAX)
                return meta_fail(c, TSR_E_INVAL, "key '%s': %llu is out of range", key, (unsigned long long)x);
        *ret = (uint32_t)x;
        if (present)
                *present = true;
        return TSR_OK;
}

static tsr_status gguf_f64(const meta_ctx *c, const tsr_gguf *g, const char *key, double *ret) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);

        if (kv && tsr_gguf_get_f64(&kv->value, ret) != TSR_OK)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected a number, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        return TSR_OK;
}

static tsr_status gguf_bool(const meta_ctx *c, const tsr_gguf *g, const char *key, bool *ret) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);

        if (kv && tsr_gguf_get_bool(&kv->value, ret) != TSR_OK)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected a bool, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        return TSR_OK;
}

/* A string key copied to the heap; NULL when absent (an error if `required`). */
static tsr_status gguf_str(const meta_ctx *c, const tsr_gguf *g, const char *key, bool required, char **ret) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        const char *s;
        size_t len;

        if (!kv)
                return required ? meta_fail(c, TSR_E_INVAL, "key '%s': missing", key) : TSR_OK;
        if (tsr_gguf_get_str(&kv->value, &s, &len) != TSR_OK)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected a string, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        if (memchr(s, '\0', len))
                return meta_fail(c, TSR_E_INVAL, "key '%s': string contains a NUL byte", key);
        *ret = dup_bytes(s, len);
        return *ret ? TSR_OK : meta_fail(c, TSR_E_NOMEM, "out of memory");
}

/* A token id key: -1 when absent or UINT32_MAX, else it must name a token. */
static tsr_status gguf_token_id(const meta_ctx *c, const tsr_gguf *g, const char *key, size_t n_tokens,
                                int64_t *ret) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        uint64_t id;

        *ret = -1;
        if (!kv)
                return TSR_OK;
        if (tsr_gguf_get_u64(&kv->value, &id) != TSR_OK)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected an unsigned integer, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        if (id == GGUF_NO_TOKEN)
                return TSR_OK;
        if (id >= n_tokens)
                return meta_fail(c, TSR_E_INVAL, "key '%s': token id %llu is out of range (%zu tokens)", key,
                                 (unsigned long long)id, n_tokens);
        *ret = (int64_t)id;
        return TSR_OK;
}

/* An array of strings as a NULL-free char *[n] whose strings share one allocation,
 * owned through (*ret)[0]. */
static tsr_status gguf_str_array(const meta_ctx *c, const tsr_gguf *g, const char *key, char ***ret, size_t *ret_n) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        tsr_gguf_value v;
        const char *s;
        size_t len, total = 0, i, n;
        char **arr, *pool;

        if (!kv)
                return TSR_OK;
        if (kv->value.type != TSR_GGUF_TYPE_ARRAY || kv->value.elem_type != TSR_GGUF_TYPE_STRING)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected an array of strings", key);
        n = (size_t)kv->value.count;
        if (n == 0)
                return TSR_OK;
        for (i = 0; i < n; i++) {
                tsr_gguf_array_elem(&kv->value, i, &v);
                tsr_gguf_get_str(&v, &s, &len);
                if (memchr(s, '\0', len))
                        return meta_fail(c, TSR_E_INVAL, "key '%s': element %zu contains a NUL byte", key, i);
                total += len + 1;       /* bounded by the file size, so no overflow */
        }
        arr = malloc(n * sizeof(*arr));
        pool = malloc(total);
        if (!arr || !pool) {
                free(arr);
                free(pool);
                return meta_fail(c, TSR_E_NOMEM, "out of memory");
        }
        for (i = 0; i < n; i++) {
                tsr_gguf_array_elem(&kv->value, i, &v);
                tsr_gguf_get_str(&v, &s, &len);
                memcpy(pool, s, len);
                pool[len] = '\0';
                arr[i] = pool;
                pool += len + 1;
        }
        *ret = arr;
        *ret_n = n;
        return TSR_OK;
}

static void str_array_free(char **arr) {
        if (arr)
                free(arr[0]);   /* the pool */
        free(arr);
}

static void gguf_tokenizer_free(tsr_gguf_tokenizer *t) {
        if (!t)
                return;
        free(t->model);
        free(t->pre);
        str_array_free(t->tokens);
        free(t->scores);
        free(t->token_types);
        str_array_free(t->merges);
        free(t);
}

/* A per-token numeric array (scores, token types): must have one entry per token. */
static tsr_status gguf_token_numbers(const meta_ctx *c, const tsr_gguf *g, const char *key, size_t n_tokens,
                                     float **ret_f, int32_t **ret_i) {
        const tsr_gguf_kv *kv = tsr_gguf_find_kv(g, key);
        tsr_gguf_value v;
        float *f = NULL;
        int32_t *n = NULL;
        size_t i;

        if (!kv)
                return TSR_OK;
        if (kv->value.type != TSR_GGUF_TYPE_ARRAY)
                return meta_fail(c, TSR_E_INVAL, "key '%s': expected an array, found %s", key,
                                 tsr_gguf_type_name(kv->value.type));
        if (kv->value.count != n_tokens)
                return meta_fail(c, TSR_E_INVAL, "key '%s': %llu entries for %zu tokens", key,
                                 (unsigned long long)kv->value.count, n_tokens);
        if (ret_f)
                f = malloc(n_tokens * sizeof(*f));
        else
                n = malloc(n_tokens * sizeof(*n));
        if (!f && !n)
                return meta_fail(c, TSR_E_NOMEM, "out of memory");
        for (i = 0; i < n_tokens; i++) {
                double d;
                int64_t x;

                tsr_gguf_array_elem(&kv->value, i, &v);
                if (f && (v.type == TSR_GGUF_TYPE_FLOAT32 || v.type == TSR_GGUF_TYPE_FLOAT64) &&
                    tsr_gguf_get_f64(&v, &d) == TSR_OK) {
                        f[i] = (float)d;
                } else if (n && tsr_gguf_get_i64(&v, &x) == TSR_OK && x >= INT32_MIN && x <= INT32_MAX) {
                        n[i] = (int32_t)x;
                } else {
                        free(f);
                        free(n);
                        return meta_fail(c, TSR_E_INVAL, "key '%s': expected an array of %s, found %s", key,
                                         f ? "floats" : "int32", tsr_gguf_type_name(kv->value.elem_type));
                }
        }
        if (ret_f)
                *ret_f = f;
        else
                *ret_i = n;
        return TSR_OK;
}

static tsr_status gguf_load_tokenizer(const meta_ctx *c, const tsr_gguf *g, tsr_gguf_tokenizer **ret) {
        tsr_gguf_tokenizer *t = calloc(1, sizeof(*t));
        tsr_status st;

        if (!t)
                return meta_fail(c, TSR_E_NOMEM, "out of memory");
        st = gguf_str(c, g, "tokenizer.ggml.model", true, &t->model);
        if (st == TSR_OK)
                st = gguf_str(c, g, "tokenizer.ggml.pre", false, &t->pre);
        if (st == TSR_OK)
                st = gguf_str_array(c, g, "tokenizer.ggml.tokens", &t->tokens, &t->n_tokens);
        if (st == TSR_OK && t->n_tokens == 0)
                st = meta_fail(c, TSR_E_INVAL, "key 'tokenizer.ggml.tokens': missing or empty");
        if (st == TSR_OK && t->n_tokens > UINT32_MAX)
                st = meta_fail(c, TSR_E_INVAL, "key 'tokenizer.ggml.tokens': too many tokens");
        if (st == TSR_OK)
                st = gguf_token_numbers(c, g, "tokenizer.ggml.scores", t->n_tokens, &t->scores, NULL);
        if (st == TSR_OK)
                st = gguf_token_numbers(c, g, "tokenizer.ggml.token_type", t->n_tokens, NULL, &t->token_types);
        if (st == TSR_OK)
                st = gguf_str_array(c, g, "tokenizer.ggml.merges", &t->merges, &t->n_merges);
        if (st == TSR_OK)
                st = gguf_token_id(c, g, "tokenizer.ggml.bos_token_id", t->n_tokens, &t->bos_id);
        if (st == TSR_OK)
                st = gguf_token_id(c, g, "tokenizer.ggml.eos_token_id", t->n_tokens, &t->eos_id);
        if (st == TSR_OK)
                st = gguf_token_id(c, g, "tokenizer.ggml.unknown_token_id", t->n_tokens, &t->unk_id);
        if (st == TSR_OK)
                st = gguf_token_id(c, g, "tokenizer.ggml.padding_token_id", t->n_tokens, &t->pad_id);
        if (st == TSR_OK) {
                /* llama.cpp's defaults: SentencePiece ("llama") adds BOS and a leading space. */
                bool spm = strcmp(t->model, "llama") == 0;
                t->add_bos = spm;
                t->add_space_prefix = spm;
                t->add_eos = false;
                st = gguf_bool(c, g, "tokenizer.ggml.add_bos_token", &t->add_bos);
        }
        if (st == TSR_OK)
                st = gguf_bool(c, g, "tokenizer.ggml.add_eos_token", &t->add_eos);
        if (st == TSR_OK)
                st = gguf_bool(c, g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix);
        if (st != TSR_OK) {
                gguf_tokenizer_free(t);
                return st;
        }
        *ret = t;
        return TSR_OK;
}

static void hash_bytes(XXH64_state_t *h, const void *p, size_t n) { XXH64_update(h, p, n); }

static void hash_u64(XXH64_state_t *h, uint64_t x) {
        uint8_t b[8];
        int i;

        for (i = 0; i < 8; i++)
                b[i] = (uint8_t)(x >> (8 * i));
        hash_bytes(h, b, sizeof(b));
}

static void hash_u8(XXH64_state_t *h, uint8_t x) { hash_bytes(h, &x, 1); }

static void hash_str(XXH64_state_t *h, const char *s) {
        size_t n;

        if (!s) {
                hash_u64(h, UINT64_MAX);
                return;
        }
        n = strlen(s);
        hash_u64(h, n);
        hash_bytes(h, s, n);
}

/* The canonical serialisation documented at tsr_model_meta.tokenizer_hash. */
static tsr_status gguf_tokenizer_hash(const tsr_gguf_tokenizer *t, const char *chat_template, uint64_t *ret) {
        XXH64_state_t *h = XXH64_createState();
        size_t i;

        if (!h || XXH64_reset(h, 0) != XXH_OK) {
                XXH64_freeState(h);
                return TSR_E_NOMEM;
        }
        hash_str(h, t->model);
        hash_str(h, t->pre);
        hash_u64(h, t->n_tokens);
        for (i = 0; i < t->n_tokens; i++)
                hash_str(h, t->tokens[i]);
        hash_u8(h, t->scores != NULL);
        for (i = 0; t->scores && i < t->n_tokens; i++) {
                uint32_t bits;
                memcpy(&bits, &t->scores[i], sizeof(bits));
                hash_bytes(h, (uint8_t[4]){(uint8_t)bits, (uint8_t)(bits >> 8), (uint8_t)(bits >> 16),
                                           (uint8_t)(bits >> 24)}, 4);
        }
        hash_u8(h, t->token_types != NULL);
        for (i = 0; t->token_types && i < t->n_tokens; i++) {
                uint32_t x = (uint32_t)t->token_types[i];
                hash_bytes(h, (uint8_t[4]){(uint8_t)x, (uint8_t)(x >> 8), (uint8_t)(x >> 16), (uint8_t)(x >> 24)}, 4);
        }
        hash_u64(h, t->n_merges);
        for (i = 0; i < t->n_merges; i++)
                hash_str(h, t->merges[i]);
        hash_u64(h, (uint64_t)t->bos_id);
        hash_u64(h, (uint64_t)t->eos_id);
        hash_u64(h, (uint64_t)t->unk_id);
        hash_u64(h, (uint64_t)t->pad_id);
        hash_u8(h, t->add_bos);
        hash_u8(h, t->add_eos);
        hash_u8(h, t->add_space_prefix);
        hash_str(h, chat_template);
        *ret = XXH64_digest(h);
        XXH64_freeState(h);
        return TSR_OK;
}

/* gguf_u32 / gguf_f64 of the key "<arch>.<suffix>".  The architecture name was
 * length-checked, so the key always fits. */
static tsr_status gguf_arch_u32(const meta_ctx *c, const tsr_gguf *g, const char *arch, const char *suffix,
                                uint32_t *ret, bool *present) {
        char key[META_MAX_ARCH_LEN + 64];

        snprintf(key, sizeof(key), "%s.%s", arch, suffix);
        return gguf_u32(c, g, key, ret, present);
}

static tsr_status gguf_arch_f64(const meta_ctx *c, const tsr_gguf *g, const char *arch, const char *suffix,
                                double *ret) {
        char key[META_MAX_ARCH_LEN + 64];

        snprintf(key, sizeof(key), "%s.%s", arch, suffix);
        return gguf_f64(c, g, key, ret);
}

static tsr_status gguf_load(const char *path, tsr_model_meta *m, char *err, size_t errlen) {
        meta_ctx c = {.file = path, .err = err, .errlen = errlen};
        tsr_gguf *g = NULL;
        const char *arch;
        int64_t eot, eom;
        bool present;
        tsr_status st;

        st = tsr_gguf_open(path, &g, err, errlen);
        if (st != TSR_OK)
                return st;
        st = gguf_str(&c, g, "general.architecture", true, &m->architecture);
        if (st == TSR_OK && strlen(m->architecture) > META_MAX_ARCH_LEN)
                st = meta_fail(&c, TSR_E_INVAL, "key 'general.architecture': longer than %d bytes", META_MAX_ARCH_LEN);
        if (st == TSR_OK) {
                m->model_type = strdup(m->architecture);
                if (!m->model_type)
                        st = meta_fail(&c, TSR_E_NOMEM, "out of memory");
        }
        if (st != TSR_OK)
                goto done;
        arch = m->architecture;
        st = gguf_arch_u32(&c, g, arch, "context_length", &m->max_model_len, NULL);
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "embedding_length", &m->hidden_size, NULL);
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "block_count", &m->num_hidden_layers, NULL);
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "attention.head_count", &m->num_attention_heads, NULL);
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "attention.head_count_kv", &m->num_key_value_heads, &present);
        if (st == TSR_OK && !present)
                m->num_key_value_heads = m->num_attention_heads;
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "attention.key_length", &m->head_dim, &present);
        if (st == TSR_OK && !present && m->num_attention_heads)
                m->head_dim = m->hidden_size / m->num_attention_heads;
        if (st == TSR_OK)
                st = gguf_arch_u32(&c, g, arch, "feed_forward_length", &m->intermediate_size, NULL);
        if (st == TSR_OK)
                st = gguf_arch_f64(&c, g, arch, "rope.freq_base", &m->rope_theta);
        if (st == TSR_OK)
                st = gguf_arch_f64(&c, g, arch, "attention.layer_norm_rms_epsilon", &m->rms_norm_eps);
        /* llama.cpp reuses the embedding matrix as the output projection when a file
         * has no output.weight; that is what tied embeddings look like in GGUF. */
        m->tie_word_embeddings = tsr_gguf_find_tensor(g, "output.weight") == NULL;
        if (st == TSR_OK)
                st = gguf_load_tokenizer(&c, g, &m->gguf_tokenizer);
        if (st != TSR_OK)
                goto done;
        m->vocab_size = (uint32_t)m->gguf_tokenizer->n_tokens;
        m->bos_token_id = m->gguf_tokenizer->bos_id;
        st = gguf_token_id(&c, g, "tokenizer.ggml.eot_token_id", m->gguf_tokenizer->n_tokens, &eot);
        if (st == TSR_OK)
                st = gguf_token_id(&c, g, "tokenizer.ggml.eom_token_id", m->gguf_tokenizer->n_tokens, &eom);
        if (st == TSR_OK && m->gguf_tokenizer->eos_id >= 0)
                st = eos_add(&c, m, (uint64_t)m->gguf_tokenizer->eos_id);
        if (st == TSR_OK && eot >= 0)
                st = eos_add(&c, m, (uint64_t)eot);
        if (st == TSR_OK && eom >= 0)
                st = eos_add(&c, m, (uint64_t)eom);
        if (st == TSR_OK)
                st = gguf_str(&c, g, "tokenizer.chat_template", false, &m->chat_template);
        if (st == TSR_OK && gguf_tokenizer_hash(m->gguf_tokenizer, m->chat_template, &m->tokenizer_hash) != TSR_OK)
                st = meta_fail(&c, TSR_E_NOMEM, "out of memory");
done:
        tsr_gguf_close(&g);
        return st;
}

/* ---- entry points --------------------------------------------------------------- */

static bool ends_with(const char *s, const char *suffix) {
        size_t n = strlen(s), k = strlen(suffix);
        return n >= k && strcmp(s + n - k, suffix) == 0;
}

tsr_status tsr_model_meta_load(const char *path, tsr_model_meta **ret, char *err, size_t errlen) {
        meta_ctx c = {.file = path, .err = err, .errlen = errlen};
        tsr_model_meta *m = NULL;
        struct stat sb;
        bool is_dir;
        tsr_status st;

        if (stat(path, &sb) != 0)
                return meta_fail(&c, errno == ENOENT ? TSR_E_NOTFOUND : TSR_E_IO, "%s", strerror(errno));
        is_dir = S_ISDIR(sb.st_mode);
        if (!is_dir && !(S_ISREG(sb.st_mode) && ends_with(path, ".gguf")))
                return meta_fail(&c, TSR_E_INVAL, "not a model folder or a .gguf file");
        m = calloc(1, sizeof(*m));
        if (!m)
                return meta_fail(&c, TSR_E_NOMEM, "out of memory");
        m->bos_token_id = -1;
        m->path = strdup(path);
        m->format = strdup(is_dir ? "hf" : "gguf");
        if (!m->path || !m->format) {
                st = meta_fail(&c, TSR_E_NOMEM, "out of memory");
                goto done;
        }
        st = is_dir ? hf_load(path, m, err, errlen) : gguf_load(path, m, err, errlen);
done:
        if (st != TSR_OK) {
                tsr_model_meta_free(&m);
                return st;
        }
        *ret = m;
        return TSR_OK;
}

tsr_status tsr_model_meta_load_generation_config(const char *dir, tsr_gen_defaults *ret, char *err, size_t errlen) {
        meta_ctx c = {.file = dir, .err = err, .errlen = errlen};
        tsr_model_meta tmp = {.bos_token_id = -1};   /* hf_generation_config's output; only .gen is kept */
        json_t *gen = NULL;
        char *path = NULL;
        struct stat sb;
        tsr_status st;

        /* A missing folder is a mistyped flag, not a folder without the file: INVAL. */
        if (stat(dir, &sb) != 0)
                return meta_fail(&c, errno == ENOENT || errno == ENOTDIR ? TSR_E_INVAL : TSR_E_IO, "%s",
                                 strerror(errno));
        if (!S_ISDIR(sb.st_mode))
                return meta_fail(&c, TSR_E_INVAL, "not a directory");
        st = hf_read_json(&c, dir, "generation_config.json", false, TSR_MODEL_META_MAX_SMALL_JSON, NULL, NULL, &gen);
        if (st == TSR_OK && !gen)
                return TSR_E_NOTFOUND;  /* absent: no message, the caller decides */
        if (st == TSR_OK) {
                path = path_join(dir, "generation_config.json");
                c.file = path ? path : dir;
                st = path ? hf_generation_config(&c, gen, &tmp) : meta_fail(&c, TSR_E_NOMEM, "out of memory");
        }
        json_decref(gen);
        free(path);
        free(tmp.eos_token_ids);
        if (st == TSR_OK)
                *ret = tmp.gen;
        return st;
}

void tsr_model_meta_free(tsr_model_meta **mp) {
        tsr_model_meta *m;

        if (!mp || !*mp)
                return;
        m = *mp;
        free(m->path);
        free(m->format);
        free(m->architecture);
        free(m->model_type);
        free(m->eos_token_ids);
        free(m->chat_template);
        free(m->tokenizer_json);
        free(m->tokenizer_config_json);
        gguf_tokenizer_free(m->gguf_tokenizer);
        free(m);
        *mp = NULL;
}

tsr_status tsr_model_meta_tokenizer(const tsr_model_meta *m, tsr_tokenizer **ret, char *err, size_t errlen) {
        const tsr_gguf_tokenizer *g = m->gguf_tokenizer;
        if (g) {
                tsr_tok_gguf d = {
                        .model = g->model, .pre = g->pre,
                        .tokens = (const char *const *)g->tokens, .n_tokens = g->n_tokens,
                        .scores = g->scores, .token_types = g->token_types,
                        .merges = (const char *const *)g->merges, .n_merges = g->n_merges,
                        .bos_id = g->bos_id, .eos_id = g->eos_id, .unk_id = g->unk_id, .pad_id = g->pad_id,
                        .add_bos = g->add_bos, .add_eos = g->add_eos, .add_space_prefix = g->add_space_prefix,
                };
                return tsr_tokenizer_new_gguf(&d, ret, err, errlen);
        }
        if (m->tokenizer_json)
                return tsr_tokenizer_new_json(m->tokenizer_json, m->tokenizer_json_len, m->tokenizer_config_json,
                                              m->tokenizer_config_json_len, ret, err, errlen);
        snprintf(err, errlen, "%s: the model has no tokenizer", m->path);
        return TSR_E_UNSUPPORTED;
}
