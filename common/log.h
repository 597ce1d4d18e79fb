/* log.h - the levelled logger, the one piece of global state in Tessera.
 *
 * Every line has the same fields, written with a single write(2) so lines from
 * different threads never interleave:
 *
 *   tessera-worker 1234.567890 INFO  engine  req=cmpl-42 message key=value
 *
 * process name, monotonic seconds, level, thread name (set per thread with
 * tsr_log_set_thread), the request id when there is one ("-" otherwise), then the
 * message, whose key=value extras are part of the format string.
 * The level comes from tsr_log_init, overridable by TESSERA_LOG_LEVEL or
 * VLLM_LOGGING_LEVEL (debug|info|warning|error).  Thread-safe. */
#ifndef TSR_LOG_H
#define TSR_LOG_H

#include <stdbool.h>
#include "tsr_status.h"

typedef enum tsr_log_level {
        TSR_LOG_DEBUG = 0,
        TSR_LOG_INFO = 1,
        TSR_LOG_WARN = 2,
        TSR_LOG_ERROR = 3,
} tsr_log_level;

/* Set the process name and the default minimum level.  Call once from main. */
void tsr_log_init(const char *process, tsr_log_level min_level);
void tsr_log_set_level(tsr_log_level min_level);
/* Parse "debug", "info", "warning"/"warn", "error" (case-insensitive). */
bool tsr_log_parse_level(const char *s, tsr_log_level *ret);
/* Name the calling thread in log lines (copied; at most 15 chars kept). */
void tsr_log_set_thread(const char *name);
bool tsr_log_enabled(tsr_log_level level);

void tsr_log(tsr_log_level level, const char *req_id, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

#define log_debug(...) do { if (tsr_log_enabled(TSR_LOG_DEBUG)) tsr_log(TSR_LOG_DEBUG, NULL, __VA_ARGS__); } while (0)
#define log_info(...)  tsr_log(TSR_LOG_INFO, NULL, __VA_ARGS__)
#define log_warn(...)  tsr_log(TSR_LOG_WARN, NULL, __VA_ARGS__)
#define log_error(...) tsr_log(TSR_LOG_ERROR, NULL, __VA_ARGS__)
#define log_req(level, req, ...) tsr_log((level), (req), __VA_ARGS__)

/* Log at error level and hand back `st`: `return log_err(st, "bind %s failed", ep);` */
#define log_err(st, ...) (tsr_log(TSR_LOG_ERROR, NULL, __VA_ARGS__), (st))

#endif
