/* exit_codes.h - what a worker's exit status tells its supervisor (tessera serve,
 * systemd, Kubernetes).  docs/operations.md has the table. */
#ifndef TSR_WORKER_EXIT_CODES_H
#define TSR_WORKER_EXIT_CODES_H

enum {
        TSR_EXIT_OK = 0,        /* clean stop (SIGTERM, Shutdown) */
        TSR_EXIT_RUNTIME = 1,   /* failed while running (socket bind, engine fault): restart may help */
        TSR_EXIT_CONFIG = 2,    /* bad flags, config file or model files: restarting cannot help */
};

#endif
