#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <stdlib.h>
#include <unistd.h>

#include "clock.h"

/* The log sink is Tessera's one global (everything else is passed in a context): written once in main before
 * threads start, read-only afterwards except for the level, which is a plain int
 * read racily on purpose (a stale level for one line is harmless). */
static char g_process[32] = "tessera";
static volatile int g_min_level = TSR_LOG_INFO;
static _Thread_local char t_thread[16] = "main";

static const char *level_name(tsr_log_level l) {
        switch (l) {
        case TSR_LOG_DEBUG: return "DEBUG";
        case TSR_LOG_INFO: return "INFO";
        case TSR_LOG_WARN: return "WARN";
        case TSR_LOG_ERROR: return "ERROR";
        }
        return "?";
}

bool tsr_log_parse_level(const char *s, tsr_log_level *ret) {
        static const struct { const char *name; tsr_log_level level; } names[] = {
                {"debug", TSR_LOG_DEBUG}, {"info", TSR_LOG_INFO}, {"warning", TSR_LOG_WARN},
                {"warn", TSR_LOG_WARN}, {"error", TSR_LOG_ERROR}, {"critical", TSR_LOG_ERROR},
        };
        if (!s)
                return false;
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
                if (strcasecmp(s, names[i].name) == 0) {
                        *ret = names[i].level;
                        return true;
                }
        return false;
}

void tsr_log_init(const char *process, tsr_log_level min_level) {
        tsr_log_level env_level;
        if (process)
                snprintf(g_process, sizeof(g_process), "%s", process);
        g_min_level = min_level;
        if (tsr_log_parse_level(getenv("TESSERA_LOG_LEVEL"), &env_level) ||
            tsr_log_parse_level(getenv("VLLM_LOGGING_LEVEL"), &env_level))
                g_min_level = env_level;
}

void tsr_log_set_level(tsr_log_level min_level) { g_min_level = min_level; }

void tsr_log_set_thread(const char *name) { snprintf(t_thread, sizeof(t_thread), "%s", name ? name : "?"); }

bool tsr_log_enabled(tsr_log_level level) { return (int)level >= g_min_level; }

void tsr_log(tsr_log_level level, const char *req_id, const char *fmt, ...) {
        char line[4096];
        int n, m;
        uint64_t ns;
        va_list ap;

        if (!tsr_log_enabled(level))
                return;
        ns = tsr_now_ns();
        n = snprintf(line, sizeof(line), "%s %llu.%06llu %-5s %-7s req=%s ", g_process,
                     (unsigned long long)(ns / 1000000000ull), (unsigned long long)(ns % 1000000000ull) / 1000,
                     level_name(level), t_thread, req_id && *req_id ? req_id : "-");
        if (n < 0)
                return;
        va_start(ap, fmt);
        m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
        va_end(ap);
        if (m < 0)
                m = 0;
        n += m;
        if (n > (int)sizeof(line) - 2)
                n = (int)sizeof(line) - 2;      /* truncated: keep the newline */
        line[n++] = '\n';
        /* One write per line; a short write to a pipe of < PIPE_BUF bytes cannot happen. */
        ssize_t w = write(STDERR_FILENO, line, (size_t)n);
        (void)w;
}
