/* fuzz_config_yaml.c - `--config FILE.yaml` and the command line, from bytes.
 *
 * The first input byte picks the mode, the rest is the payload:
 *   even    the payload is a YAML file: tsr_config_load_yaml, then tsr_config_validate;
 *   odd     the payload, split on NUL bytes, is argv[1..] for tsr_config_parse (bit 1
 *           of the selector: allow a positional MODEL, as the worker does), then
 *           tsr_config_validate.
 * Either way a config that validates is rendered back to child argv for each owner and
 * parsed again (what `tessera serve` does to hand flags to its children), and that
 * parse must succeed and validate too.  tsr_config_done runs on every path, so
 * LeakSanitizer sees any string a failed load forgot.
 *
 * The loader wants a path ending in .yaml, which a memfd's /proc path does not, so the
 * payload goes to a memfd behind a per-process symlink $TMPDIR/tsr-fuzz-config-PID.yaml
 * (fuzz.h: fuzz_file), removed at exit. */
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "fuzz.h"

#define MAX_ARGS 256

static fuzz_file yaml;

static void remove_yaml(void) { fuzz_file_hide(&yaml); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        const char *tmp = getenv("TMPDIR");
        char name[64];

        snprintf(name, sizeof(name), "tsr-fuzz-config-%d.yaml", (int)getpid());
        fuzz_file_init(&yaml, tmp && *tmp ? tmp : "/tmp", name);
        atexit(remove_yaml);
        /* The parser falls back to VLLM_API_KEY; the environment must not change results. */
        unsetenv("VLLM_API_KEY");
        return 0;
}

static void check_failure(tsr_status st, const char *err) {
        FUZZ_CHECK(st == TSR_E_INVAL || st == TSR_E_UNSUPPORTED || st == TSR_E_IO || st == TSR_E_NOTFOUND ||
                   st == TSR_E_NOMEM);
        FUZZ_CHECK(err[0] != '\0');
}

/* A validated config, rendered as a child's argv and parsed back, must validate again:
 * otherwise `tessera serve` would start a child that refuses its own flags. */
static void check_child_argv(const tsr_config *cfg) {
        static const unsigned owners[] = {TSR_OWNER_ROUTER, TSR_OWNER_WORKER, TSR_OWNER_LAUNCHER};

        for (size_t k = 0; k < sizeof(owners) / sizeof(owners[0]); k++) {
                tsr_config child;
                char **argv = NULL, **full, err[512] = "";
                int argc = 0;
                tsr_status st;

                st = tsr_config_child_argv(cfg, owners[k], &argv, &argc);
                FUZZ_CHECK(st == TSR_OK || st == TSR_E_NOMEM);
                if (st != TSR_OK)
                        continue;
                FUZZ_CHECK(argc >= 0 && argv[argc] == NULL);
                /* The child's argv[0] is its program, which child_argv leaves to the caller. */
                full = calloc((size_t)argc + 2, sizeof(*full));
                FUZZ_CHECK(full != NULL);
                full[0] = "tessera-child";
                memcpy(full + 1, argv, (size_t)argc * sizeof(*argv));
                tsr_config_init(&child);
                st = tsr_config_parse(&child, argc + 1, full, owners[k] == TSR_OWNER_WORKER, err, sizeof(err));
                if (st == TSR_OK)
                        st = tsr_config_validate(&child, err, sizeof(err));
                if (st != TSR_OK) {
                        fprintf(stderr, "child argv for owner %u does not parse back: %s\n", owners[k], err);
                        for (int i = 0; i < argc; i++)
                                fprintf(stderr, "  argv[%d] = '%s'\n", i + 1, argv[i]);
                }
                FUZZ_CHECK(st == TSR_OK);
                tsr_config_done(&child);
                free(full);
                tsr_config_free_argv(argv);
        }
}

static void run_yaml(const uint8_t *p, size_t n) {
        tsr_config cfg;
        char err[512] = "";
        tsr_status st;

        fuzz_file_set(&yaml, p, n);
        tsr_config_init(&cfg);
        st = tsr_config_load_yaml(&cfg, yaml.path, err, sizeof(err));
        if (st == TSR_OK)
                st = tsr_config_validate(&cfg, err, sizeof(err));
        if (st == TSR_OK)
                check_child_argv(&cfg);
        else
                check_failure(st, err);
        tsr_config_done(&cfg);
}

static void run_argv(const uint8_t *p, size_t n, bool allow_model) {
        char *buf, *argv[MAX_ARGS + 1], err[512] = "";
        int argc = 0;
        size_t start = 0;
        tsr_config cfg;
        tsr_status st;

        /* One copy with a NUL after the last byte, so every piece is a C string. */
        buf = malloc(n + 1);
        FUZZ_CHECK(buf != NULL);
        memcpy(buf, p, n);
        buf[n] = '\0';
        argv[argc++] = "tessera";
        for (size_t i = 0; i <= n && argc < MAX_ARGS; i++) {
                if (i == n || buf[i] == '\0') {
                        argv[argc++] = buf + start;
                        start = i + 1;
                }
        }
        argv[argc] = NULL;

        tsr_config_init(&cfg);
        st = tsr_config_parse(&cfg, argc, argv, allow_model, err, sizeof(err));
        if (st == TSR_OK && !cfg.help && !cfg.version)
                st = tsr_config_validate(&cfg, err, sizeof(err));
        if (st == TSR_OK && !cfg.help && !cfg.version)
                check_child_argv(&cfg);
        else if (st != TSR_OK)
                check_failure(st, err);
        tsr_config_done(&cfg);
        free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 1)
                return 0;
        if (data[0] & 1)
                run_argv(data + 1, size - 1, (data[0] & 2) != 0);
        else
                run_yaml(data + 1, size - 1);
        return 0;
}
