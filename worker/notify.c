/* systemd notify protocol for tessera-worker: see notify.h.  Threads: the loading
 * ticker (its own), the main/io thread (READY, STOPPING) and the engine thread (WATCHDOG);
 * sd_notify itself opens a socket per call and is safe from any of them. */
#include "worker/notify.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#ifdef TSR_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "common/clock.h"
#include "common/log.h"

#define LOAD_TICK_S 10
#define LOAD_EXTEND_USEC 30000000ull   /* three ticks: one ticker that stalls ends the start */

#ifdef TSR_HAVE_SYSTEMD
static struct {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        pthread_t thread;
        bool running;
        bool stop;
        char model[256];
} loading = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static uint64_t watchdog_interval_ns;   /* written by the main thread before the engine starts */
static uint64_t last_alive_ns;          /* engine thread only */

/* User + system CPU time of the whole process, ns: reading and converting weights
 * spends it on some thread; a load blocked forever does not. */
static uint64_t cpu_ns(void) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) != 0)
                return 0;
        return ((uint64_t)ru.ru_utime.tv_sec + (uint64_t)ru.ru_stime.tv_sec) * 1000000000ull +
               ((uint64_t)ru.ru_utime.tv_usec + (uint64_t)ru.ru_stime.tv_usec) * 1000ull;
}

static void *loading_main(void *arg) {
        uint64_t last_cpu = 0;
        (void)arg;
        tsr_log_set_thread("notify");
        pthread_mutex_lock(&loading.mu);
        for (;;) {   /* the first extension goes out even when the load ends at once */
                uint64_t cpu = cpu_ns();
                struct timespec until;
                if (cpu != last_cpu) {
                        sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%llu\nSTATUS=loading %s",
                                   (unsigned long long)LOAD_EXTEND_USEC, loading.model);
                        last_cpu = cpu;
                }
                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_sec += LOAD_TICK_S;
                while (!loading.stop && pthread_cond_timedwait(&loading.cv, &loading.mu, &until) == 0) {
                }
                if (loading.stop)
                        break;
        }
        pthread_mutex_unlock(&loading.mu);
        return NULL;
}
#endif

void tsr_notify_loading_begin(const char *model) {
#ifdef TSR_HAVE_SYSTEMD
        if (!getenv("NOTIFY_SOCKET") || loading.running)
                return;
        snprintf(loading.model, sizeof(loading.model), "%s", model ? model : "the model");
        loading.stop = false;
        if (pthread_create(&loading.thread, NULL, loading_main, NULL) == 0)
                loading.running = true;
        else
                log_warn("cannot start the start-up notifier thread: TimeoutStartSec= applies to the whole load");
#else
        (void)model;
#endif
}

void tsr_notify_loading_end(void) {
#ifdef TSR_HAVE_SYSTEMD
        if (!loading.running)
                return;
        pthread_mutex_lock(&loading.mu);
        loading.stop = true;
        pthread_cond_signal(&loading.cv);
        pthread_mutex_unlock(&loading.mu);
        pthread_join(loading.thread, NULL);
        loading.running = false;
#endif
}

void tsr_notify_ready(void *ud) {
        (void)ud;
        tsr_notify_loading_end();
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "READY=1\nSTATUS=serving");
#endif
}

void tsr_notify_stopping(void *ud) {
        (void)ud;
#ifdef TSR_HAVE_SYSTEMD
        sd_notify(0, "STOPPING=1\nSTATUS=draining in-flight requests");
#endif
}

uint32_t tsr_notify_watchdog_interval_ms(void) {
#ifdef TSR_HAVE_SYSTEMD
        uint64_t usec = 0;
        if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0)
                return 0;
        watchdog_interval_ns = usec * 1000ull / 2;
        return watchdog_interval_ns / 1000000ull ? (uint32_t)(watchdog_interval_ns / 1000000ull) : 1;
#else
        return 0;
#endif
}

void tsr_notify_alive(void *ud) {
        (void)ud;
#ifdef TSR_HAVE_SYSTEMD
        uint64_t now = tsr_now_ns();
        if (!watchdog_interval_ns || now - last_alive_ns < watchdog_interval_ns)
                return;
        last_alive_ns = now;
        sd_notify(0, "WATCHDOG=1");
#endif
}
