/* registry.c - the model families this worker runs, and how a model finds its own. */
#include "worker/model/family.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A new family is one line here (and its file in meson.build). */
static const tsr_model_family *const families[] = {&tsr_family_llama, &tsr_family_llama4, &tsr_family_nemotron_h};

#define N_FAMILIES (sizeof families / sizeof families[0])

static bool in_list(const char *const *list, const char *s) {
        for (; s && list && *list; list++)
                if (strcmp(*list, s) == 0)
                        return true;
        return false;
}

const tsr_model_family *tsr_family_find(const char *format, const char *architecture, const char *model_type) {
        bool gguf = format && strcmp(format, "gguf") == 0;

        for (size_t i = 0; i < N_FAMILIES; i++) {
                const tsr_model_family *f = families[i];
                if (gguf ? in_list(f->gguf_architectures, architecture)
                         : architecture ? in_list(f->hf_architectures, architecture)
                                        : in_list(f->hf_model_types, model_type))
                        return f;
        }
        return NULL;
}

const char *tsr_family_names(bool (*has)(const tsr_model_family *f), char *buf, size_t len) {
        size_t o = 0;

        if (len)
                buf[0] = '\0';
        for (size_t i = 0; i < N_FAMILIES && o < len; i++)
                if (has(families[i]))
                        o += (size_t)snprintf(buf + o, len - o, "%s%s", o ? ", " : "", families[i]->name);
        return buf;
}

bool tsr_family_has_stages(const tsr_model_family *f) { return f->forward_stage != NULL; }
bool tsr_family_has_tp(const tsr_model_family *f) { return f->tp_shard != NULL; }
bool tsr_family_has_tp_quantized(const tsr_model_family *f) { return f->tp_shard && f->tp_quantized; }
bool tsr_family_has_ep(const tsr_model_family *f) { return f->ep_shard != NULL; }
bool tsr_family_has_device(const tsr_model_family *f) { return f->to_backend != NULL; }

tsr_status tsr_model_desc_read(const tsr_model_family *f, const char *path, bool gguf, tsr_model_desc *ret,
                               char *err, size_t errlen) {
        tsr_model_desc d = {.family = f, .gguf = gguf};
        tsr_status st;

        if (!f || !path || !ret)
                return TSR_E_INVAL;
        if ((st = f->read_config(path, gguf, &d, err, errlen)) == TSR_OK)
                *ret = d;
        else
                tsr_model_desc_done(&d);
        return st;
}

void tsr_model_desc_done(tsr_model_desc *d) {
        if (!d)
                return;
        free(d->config);
        d->config = NULL;
}
