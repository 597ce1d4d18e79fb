/* exit_codes.h - what a worker's exit status tells its supervisor (tessera serve,
 * systemd, Kubernetes): 1 is worth a restart with backoff, 2 is not (docs/deployment.md,
 * "tessera serve"; deploy/systemd's units stop restarting on 2). */
#ifndef TSR_WORKER_EXIT_CODES_H
#define TSR_WORKER_EXIT_CODES_H

enum {
        TSR_EXIT_OK = 0,        /* clean stop (SIGTERM, Shutdown) */
        TSR_EXIT_RUNTIME = 1,   /* failed while running (socket bind, engine fault): restart may help */
        TSR_EXIT_CONFIG = 2,    /* bad flags, config file or model files: restarting cannot help */
};

#endif
