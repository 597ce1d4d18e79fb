/* fuzz_model_meta.c - a Hugging Face model folder (or a .gguf file) from bytes ->
 * tsr_model_meta_load.
 *
 * tsr_model_meta_load reads files by name from a folder, so the input is cut into the
 * files of one, on NUL bytes (JSON text has no raw NUL, so the cut never lands inside a
 * sensible file):
 *   config.json \0 generation_config.json \0 tokenizer_config.json \0 tokenizer.json
 *   \0 chat_template.jinja
 * A piece that is there is written even when empty (an empty file is a case of its
 * own); the files after the last piece are absent.  tokenizer.json is required and only
 * its bytes are kept (the tokenizer parses it, later), so when absent a minimal one is
 * written.  An input that starts with the GGUF magic is written whole as model.gguf and
 * loaded as one, which reaches the GGUF side's tokenizer and dims extraction that the
 * plain GGUF target does not.
 *
 * The folder is made once per process under $TMPDIR and removed at exit; its files are
 * memfds behind symlinks (fuzz.h: fuzz_file), so an input costs no disk writes. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/load/model_meta.h"
#include "fuzz.h"

static const char *const files[] = {"config.json", "generation_config.json", "tokenizer_config.json",
                                    "tokenizer.json", "chat_template.jinja"};
#define N_FILES (sizeof(files) / sizeof(files[0]))
#define TOKENIZER_JSON 3

static char dir[256];
static fuzz_file hf[N_FILES];
static fuzz_file gguf_file;

static void remove_dir(void) {
        for (size_t i = 0; i < N_FILES; i++)
                fuzz_file_hide(&hf[i]);
        fuzz_file_hide(&gguf_file);
        rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        const char *tmp = getenv("TMPDIR");

        snprintf(dir, sizeof(dir), "%s/tsr-fuzz-meta-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        FUZZ_CHECK(mkdtemp(dir) != NULL);
        for (size_t i = 0; i < N_FILES; i++)
                fuzz_file_init(&hf[i], dir, files[i]);
        fuzz_file_init(&gguf_file, dir, "model.gguf");
        atexit(remove_dir);
        return 0;
}

/* What a loaded meta promises, whichever the source. */
static void check_meta(const tsr_model_meta *m, bool gguf) {
        FUZZ_CHECK(m->path != NULL && m->format != NULL);
        FUZZ_CHECK(strcmp(m->format, gguf ? "gguf" : "hf") == 0);
        FUZZ_CHECK(m->n_eos_token_ids == 0 || m->eos_token_ids != NULL);
        for (size_t i = 0; i < m->n_eos_token_ids; i++)
                for (size_t j = 0; j < i; j++)
                        FUZZ_CHECK(m->eos_token_ids[i] != m->eos_token_ids[j]);
        if (m->chat_template)
                fuzz_touch(m->chat_template, strlen(m->chat_template) + 1);
        if (m->architecture)
                fuzz_touch(m->architecture, strlen(m->architecture) + 1);
        if (m->model_type)
                fuzz_touch(m->model_type, strlen(m->model_type) + 1);
        if (!gguf) {
                FUZZ_CHECK(m->tokenizer_json != NULL);
                /* NUL-terminated past the counted bytes, as the header says. */
                FUZZ_CHECK(m->tokenizer_json[m->tokenizer_json_len] == '\0');
                if (m->tokenizer_config_json)
                        FUZZ_CHECK(m->tokenizer_config_json[m->tokenizer_config_json_len] == '\0');
                FUZZ_CHECK(m->gguf_tokenizer == NULL);
        } else if (m->gguf_tokenizer) {
                const tsr_gguf_tokenizer *t = m->gguf_tokenizer;

                FUZZ_CHECK(t->n_tokens == 0 || t->tokens != NULL);
                for (size_t i = 0; i < t->n_tokens; i++)
                        fuzz_touch(t->tokens[i], strlen(t->tokens[i]) + 1);
                for (size_t i = 0; i < t->n_merges; i++)
                        fuzz_touch(t->merges[i], strlen(t->merges[i]) + 1);
                if (t->scores)
                        fuzz_touch(t->scores, t->n_tokens * sizeof(*t->scores));
                if (t->token_types)
                        fuzz_touch(t->token_types, t->n_tokens * sizeof(*t->token_types));
        }
}

static void load(const char *path, bool gguf) {
        tsr_model_meta *m = NULL;
        char err[512] = "";
        tsr_status st;

        st = tsr_model_meta_load(path, &m, err, sizeof(err));
        if (st != TSR_OK) {
                FUZZ_CHECK(st == TSR_E_NOTFOUND || st == TSR_E_INVAL || st == TSR_E_LIMIT ||
                           st == TSR_E_UNSUPPORTED || st == TSR_E_IO || st == TSR_E_NOMEM);
                FUZZ_CHECK(m == NULL);
                FUZZ_CHECK(err[0] != '\0');
                return;
        }
        FUZZ_CHECK(m != NULL);
        check_meta(m, gguf);
        tsr_model_meta_free(&m);
        FUZZ_CHECK(m == NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        static const char min_tokenizer[] = "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}";
        size_t start = 0, piece = 0;

        if (size >= 4 && memcmp(data, "GGUF", 4) == 0) {
                fuzz_file_set(&gguf_file, data, size);
                load(gguf_file.path, true);
                return 0;
        }
        /* A file the input does not reach is absent, whatever an earlier input wrote. */
        for (size_t i = 0; i <= size && piece < N_FILES; i++) {
                if (i == size || data[i] == '\0') {
                        fuzz_file_set(&hf[piece], data + start, i - start);
                        piece++;
                        start = i + 1;
                }
        }
        for (size_t i = piece; i < N_FILES; i++)
                fuzz_file_hide(&hf[i]);
        if (piece <= TOKENIZER_JSON)
                fuzz_file_set(&hf[TOKENIZER_JSON], min_tokenizer, sizeof(min_tokenizer) - 1);
        load(dir, false);
        return 0;
}
