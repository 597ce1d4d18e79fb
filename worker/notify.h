/* The worker's side of systemd's notify protocol (sd_notify(3), systemd.service(5)
 * Type=notify, WatchdogSec=).  Every function is a no-op when the build has no libsystemd
 * (TSR_HAVE_SYSTEMD unset) or the process was not started by systemd (no NOTIFY_SOCKET),
 * so a worker started by hand, by `tessera serve` or by Kubernetes behaves the same. */
#ifndef TSR_WORKER_NOTIFY_H
#define TSR_WORKER_NOTIFY_H

#include <stdint.h>

/* Main thread, before the model load: starts a thread that, every 10 s while the process
 * is still using CPU (the load progresses), sends EXTEND_TIMEOUT_USEC=30 s, so a model of
 * any size is not killed by TimeoutStartSec while a load that hangs (no CPU time spent
 * for 30 s) still is. */
void tsr_notify_loading_begin(const char *model);
/* Main thread: stops that thread (idempotent; also safe without a begin). */
void tsr_notify_loading_end(void);
/* io thread, once both sockets are bound: READY=1.  Ends the loading thread first. */
void tsr_notify_ready(void *ud);
/* io thread, at the first stop signal: STOPPING=1 (drain within --shutdown-timeout). */
void tsr_notify_stopping(void *ud);
/* Half of WatchdogSec in ms (how often the engine must call tsr_notify_alive), or 0 when
 * the service has no watchdog.  Main thread. */
uint32_t tsr_notify_watchdog_interval_ms(void);
/* Engine thread, once per loop turn (engine_params.alive): WATCHDOG=1, at most once per
 * interval.  A hung step stops these and systemd restarts the worker. */
void tsr_notify_alive(void *ud);

#endif
