/* gen_config.c - --generation-config and --override-generation-config (see gen_config.h). */
#include "worker/load/gen_config.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <jansson.h>

#define FLAG "--override-generation-config"

/* One override key: a float or an integer field of tsr_gen_defaults. */
typedef struct override_key {
        const char *name;
        bool integer;
        size_t action;          /* offsetof in tsr_gen_override */
        size_t has;             /* offsetof in tsr_gen_defaults: the has_x flag */
        size_t value;           /* offsetof in tsr_gen_defaults: x (double or int64_t) */
} override_key;

#define KEY(name, integer) \
        {#name, integer, offsetof(tsr_gen_override, name), offsetof(tsr_gen_defaults, has_##name), \
         offsetof(tsr_gen_defaults, name)}

static const override_key override_keys[] = {
        KEY(temperature, false), KEY(top_p, false), KEY(top_k, true),
        KEY(min_p, false), KEY(repetition_penalty, false), KEY(max_new_tokens, true),
};
#undef KEY

static tsr_status fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static tsr_status fail(char *err, size_t errlen, const char *fmt, ...) {
        va_list ap;

        if (err && errlen) {
                va_start(ap, fmt);
                vsnprintf(err, errlen, fmt, ap);
                va_end(ap);
        }
        return TSR_E_INVAL;
}

tsr_status tsr_gen_override_parse(const char *text, tsr_gen_override *ret, char *err, size_t errlen) {
        tsr_gen_override ov = {0};
        json_error_t jerr;
        json_t *root;
        tsr_status st = TSR_OK;

        if (!text) {
                *ret = ov;
                return TSR_OK;
        }
        root = json_loads(text, JSON_DECODE_ANY, &jerr);
        if (!root)
                return fail(err, errlen, FLAG ": not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                            jerr.column);
        if (!json_is_object(root)) {
                st = fail(err, errlen, FLAG ": expected a JSON object such as '{\"temperature\": 0.5}'");
                goto done;
        }
        for (size_t i = 0; i < sizeof(override_keys) / sizeof(override_keys[0]); i++) {
                const override_key *k = &override_keys[i];
                json_t *v = json_object_get(root, k->name);
                tsr_gen_action *action = (tsr_gen_action *)((char *)&ov + k->action);
                void *value = (char *)&ov.values + k->value;

                if (!v)
                        continue;
                if (json_is_null(v)) {
                        *action = TSR_GEN_CLEAR;
                        continue;
                }
                if (k->integer && !json_is_integer(v)) {
                        st = fail(err, errlen, FLAG ": key '%s': expected an integer or null", k->name);
                        goto done;
                }
                if (!json_is_number(v)) {   /* true/false are not numbers here */
                        st = fail(err, errlen, FLAG ": key '%s': expected a number or null", k->name);
                        goto done;
                }
                if (k->integer)
                        *(int64_t *)value = (int64_t)json_integer_value(v);
                else
                        *(double *)value = json_number_value(v);
                *action = TSR_GEN_SET;
        }
        if (ov.max_new_tokens == TSR_GEN_SET && ov.values.max_new_tokens < 0)
                st = fail(err, errlen, FLAG ": key 'max_new_tokens': %" PRId64 " is negative",
                          ov.values.max_new_tokens);
done:
        json_decref(root);
        if (st == TSR_OK)
                *ret = ov;
        return st;
}

tsr_status tsr_gen_defaults_resolve(const char *source, const tsr_model_meta *model, const tsr_gen_override *ov,
                                    tsr_gen_defaults *ret, bool *ret_no_file, char *err, size_t errlen) {
        tsr_gen_defaults d = {0};
        tsr_status st;

        if (ret_no_file)
                *ret_no_file = false;
        if (!source || strcmp(source, "auto") == 0) {
                if (model)
                        d = model->gen;
        } else if (strcmp(source, "vllm") != 0) {
                st = tsr_model_meta_load_generation_config(source, &d, err, errlen);
                if (st == TSR_E_NOTFOUND) {
                        if (ret_no_file)
                                *ret_no_file = true;
                } else if (st != TSR_OK) {
                        return st;
                }
        }
        for (size_t i = 0; ov && i < sizeof(override_keys) / sizeof(override_keys[0]); i++) {
                const override_key *k = &override_keys[i];
                tsr_gen_action action = *(const tsr_gen_action *)((const char *)ov + k->action);
                size_t size = k->integer ? sizeof(int64_t) : sizeof(double);

                if (action == TSR_GEN_KEEP)
                        continue;
                *(bool *)((char *)&d + k->has) = action == TSR_GEN_SET;
                if (action == TSR_GEN_SET)
                        memcpy((char *)&d + k->value, (const char *)&ov->values + k->value, size);
        }
        *ret = d;
        return TSR_OK;
}

void tsr_gen_defaults_format(const tsr_gen_defaults *d, char *buf, size_t len) {
        size_t n = 0;
        int w;

        if (!len)
                return;
        buf[0] = '\0';
#define PUT(...)                                                                          \
        do {                                                                              \
                w = snprintf(buf + n, len - n, "%s" __VA_ARGS__);                         \
                if (w < 0 || (size_t)w >= len - n)                                        \
                        return;                                                           \
                n += (size_t)w;                                                           \
        } while (0)
        if (d->has_temperature)
                PUT("temperature=%g", n ? " " : "", d->temperature);
        if (d->has_top_p)
                PUT("top_p=%g", n ? " " : "", d->top_p);
        if (d->has_top_k)
                PUT("top_k=%" PRId64, n ? " " : "", d->top_k);
        if (d->has_min_p)
                PUT("min_p=%g", n ? " " : "", d->min_p);
        if (d->has_repetition_penalty)
                PUT("repetition_penalty=%g", n ? " " : "", d->repetition_penalty);
        if (d->has_max_new_tokens)
                PUT("max_new_tokens=%" PRId64, n ? " " : "", d->max_new_tokens);
#undef PUT
        if (!n)
                snprintf(buf, len, "none");
}
