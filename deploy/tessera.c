/* tessera serve MODEL [vLLM flags]
 *
 * The embedded single-machine deployment: start one tessera-worker and one
 * tessera-router as child processes, give each the flags it owns, and supervise them.
 *
 *   - a worker that dies is logged (exit status or signal) and restarted with backoff
 *     (0.5 s doubling to 30 s, reset after 30 s of uptime) while the router keeps
 *     answering (503 on /health until the worker is back); a worker that exits 2
 *     (bad flags or model files: restarting cannot help) stops everything, exit 2;
 *   - a router that dies stops everything, exit 1 (2 if it rejected its flags);
 *   - SIGINT/SIGTERM/SIGHUP: SIGTERM to the router, which stops accepting and lets its
 *     in-flight requests finish (up to 10 s); once it has exited the worker gets
 *     SIGTERM; whatever still runs after 15 s gets SIGKILL; the launcher exits 0 once
 *     both are reaped.
 * Children are started with PR_SET_PDEATHSIG so that even a SIGKILLed launcher leaves
 * no orphans. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/config.h"
#include "common/log.h"

#define EXIT_BAD_CONFIG 2
#define BACKOFF_MIN_MS 500
#define BACKOFF_MAX_MS 30000
#define HEALTHY_UPTIME_MS 30000
#define STOP_GRACE_MS 15000

typedef struct child {
        const char *name;        /* "worker" | "router" */
        char **argv;             /* argv[0] is the binary path */
        pid_t pid;               /* 0 when not running */
        uint64_t started_ms;
        uint64_t restart_at_ms;  /* 0 = no restart pending */
        unsigned backoff_ms;
        unsigned restarts;
} child;

static void usage(FILE *out) {
        fprintf(out, "usage: tessera serve MODEL [options]   (tessera serve --help lists every option)\n"
                     "       tessera bench serve [options]   (vllm bench serve's flags; --help lists them)\n"
                     "       tessera doctor [--nnodes N --node-rank R --master-addr A --master-port P]\n"
                     "                                       (this node's report; the links of a multi-node replica)\n"
                     "       tessera curve-keygen PREFIX     (writes PREFIX.key and PREFIX.pub for --zmq-curve-*)\n"
                     "       tessera --version\n");
}

/* `tessera curve-keygen PREFIX`: a CurveZMQ key pair for --zmq-curve-secret-file
 * (PREFIX.key, the secret, mode 0600, never overwritten) and for the other side's
 * --zmq-curve-peers-file (PREFIX.pub). */
static int curve_keygen(int argc, char **argv) {
        char pub[41], sec[41], path[PATH_MAX];
        FILE *f;
        int fd;

        if (argc != 1 || argv[0][0] == '-') {
                fprintf(stderr, "usage: tessera curve-keygen PREFIX   (writes PREFIX.key and PREFIX.pub)\n");
                return 2;
        }
        if (zmq_curve_keypair(pub, sec) != 0) {
                fprintf(stderr, "tessera curve-keygen: %s (is libzmq built with CURVE?)\n", zmq_strerror(zmq_errno()));
                return 1;
        }
        snprintf(path, sizeof(path), "%s.key", argv[0]);
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd < 0 || !(f = fdopen(fd, "w"))) {
                fprintf(stderr, "tessera curve-keygen: %s: %s\n", path, strerror(errno));
                if (fd >= 0)
                        close(fd);
                return 1;
        }
        fprintf(f, "# CurveZMQ secret key (tessera curve-keygen): keep private\n%s\n", sec);
        memset(sec, 0, sizeof(sec));
        if (fclose(f) != 0)
                return 1;
        snprintf(path, sizeof(path), "%s.pub", argv[0]);
        if (!(f = fopen(path, "w"))) {
                fprintf(stderr, "tessera curve-keygen: %s: %s\n", path, strerror(errno));
                return 1;
        }
        fprintf(f, "%s\n", pub);
        if (fclose(f) != 0)
                return 1;
        printf("%s\n", pub);
        return 0;
}

/* Directory of this executable, for finding the other two binaries beside it (an
 * installed tree) or in the build tree (deploy/../worker, deploy/../router). */
static void self_dir(char *out, size_t n) {
        ssize_t len = readlink("/proc/self/exe", out, n - 1);
        if (len <= 0) {
                snprintf(out, n, ".");
                return;
        }
        out[len] = '\0';
        char *slash = strrchr(out, '/');
        if (slash)
                *slash = '\0';
}

static char *find_binary(const char *name, const char *subdir) {
        char dir[PATH_MAX], path[PATH_MAX + 64];
        self_dir(dir, sizeof(dir));
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        if (access(path, X_OK) == 0)
                return strdup(path);
        snprintf(path, sizeof(path), "%s/../%s/%s", dir, subdir, name);
        if (access(path, X_OK) == 0)
                return realpath(path, NULL);
        return strdup(name);   /* execvp searches PATH */
}

/* Replace this process by the tool `name` (found like the worker and router), with
 * argv[1] (the subcommand) as its argv[0].  Returns only when exec failed. */
static int exec_tool(const char *name, char **argv) {
        char *path = find_binary(name, "deploy");
        argv[1] = path;
        execvp(path, argv + 1);
        fprintf(stderr, "tessera: cannot run %s: %s\n", path, strerror(errno));
        free(path);
        return EXIT_BAD_CONFIG;
}

/* A probe of whether the worker could listen on the port: with SO_REUSEADDR, as
 * ZeroMQ listens, so a port left in TIME_WAIT by the last worker's connections counts as
 * free (it is for the worker) and one with a listener does not. */
static int bind_loopback(int port) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (fd < 0)
                return -1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
                close(fd);
                return -1;
        }
        return fd;
}

/* Two consecutive free loopback ports (requests on P, Status on P+1).  The ports are
 * released before the worker binds them; losing that race makes the worker exit 1,
 * and the supervisor restarts it on the same ports.  They are taken below the kernel's
 * ephemeral range (ip_local_port_range), where no outgoing connection (the router's
 * ZeroMQ reconnects, HTTP clients) can be given P+1 as its local port in the meantime:
 * CI once saw a worker restarted 7 times on a Status port held that way.  Neither may be
 * one of the n_avoid ports `avoid`: the router's HTTP port, which is free until the router
 * binds it (CI once saw the pair drawn on it, the worker restarted every 30 s on a port
 * the router held and the router's ZeroMQ talking to its own HTTP server), and a
 * multi-node replica's --master-port, free until node 0's worker binds it for the
 * rendezvous (drawn there, node 0's worker fails to meet and restarts for ever). */
static bool port_avoided(int port, const int *avoid, size_t n_avoid) {
        for (size_t i = 0; i < n_avoid; i++)
                if (port == avoid[i])
                        return true;
        return false;
}

static int pick_port_pair(const int *avoid, size_t n_avoid) {
        int lo = 32768, hi = 60999;
        FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
        if (f) {
                if (fscanf(f, "%d %d", &lo, &hi) != 2)
                        lo = 32768;
                fclose(f);
        }
        if (lo > 10000 + 2) {
                unsigned seed = (unsigned)getpid() ^ (unsigned)tsr_now_ms();
                for (int tries = 0; tries < 200; tries++) {
                        int port = 10000 + (int)(rand_r(&seed) % (unsigned)(lo - 10000 - 1));
                        if (port_avoided(port, avoid, n_avoid) || port_avoided(port + 1, avoid, n_avoid))
                                continue;
                        int fd = bind_loopback(port), fd2 = fd >= 0 ? bind_loopback(port + 1) : -1;
                        if (fd >= 0)
                                close(fd);
                        if (fd2 >= 0) {
                                close(fd2);
                                return port;
                        }
                }
        }
        for (int tries = 0; tries < 50; tries++) {   /* no room below: any free pair */
                struct sockaddr_in a;
                socklen_t alen = sizeof(a);
                int fd = bind_loopback(0), fd2;
                if (fd < 0)
                        return -1;
                getsockname(fd, (struct sockaddr *)&a, &alen);
                int port = ntohs(a.sin_port);
                fd2 = port < 65535 && !port_avoided(port, avoid, n_avoid) && !port_avoided(port + 1, avoid, n_avoid)
                              ? bind_loopback(port + 1) : -1;
                close(fd);
                if (fd2 >= 0) {
                        close(fd2);
                        return port;
                }
        }
        return -1;
}

static bool argv_has(char **argv, const char *flag) {
        for (; *argv; argv++)
                if (strcmp(*argv, flag) == 0)
                        return true;
        return false;
}

/* argv = [binary, child flags..., extra...] */
static char **build_argv(char *binary, char **flags, const char **extra) {
        size_t n = 1, k = 0;
        for (char **f = flags; *f; f++)
                n++;
        for (const char **e = extra; e && *e; e++)
                n++;
        char **argv = calloc(n + 1, sizeof(char *));
        if (!argv)
                return NULL;
        argv[k++] = binary;
        for (char **f = flags; *f; f++)
                argv[k++] = *f;
        for (const char **e = extra; e && *e; e++)
                argv[k++] = (char *)*e;
        return argv;
}

static pid_t spawn(child *c, const sigset_t *blocked) {
        pid_t parent = getpid();
        pid_t pid = fork();
        if (pid < 0) {
                log_error("fork for %s: %s", c->name, strerror(errno));
                return -1;
        }
        if (pid == 0) {
                /* The child dies with the launcher, even if the launcher is SIGKILLed. */
                prctl(PR_SET_PDEATHSIG, SIGTERM);
                if (getppid() != parent)
                        _exit(1);
                sigprocmask(SIG_UNBLOCK, blocked, NULL);
                execvp(c->argv[0], c->argv);
                fprintf(stderr, "tessera: cannot run %s: %s\n", c->argv[0], strerror(errno));
                _exit(127);
        }
        c->pid = pid;
        c->started_ms = tsr_now_ms();
        log_info("started %s pid %d: %s", c->name, (int)pid, c->argv[0]);
        return pid;
}

static void describe_exit(int status, char *out, size_t n) {
        if (WIFEXITED(status))
                snprintf(out, n, "exited with status %d", WEXITSTATUS(status));
        else if (WIFSIGNALED(status))
                snprintf(out, n, "was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
                snprintf(out, n, "stopped (status 0x%x)", status);
}

static void stop_children(child *kids, size_t n, int sig) {
        for (size_t i = 0; i < n; i++)
                if (kids[i].pid > 0)
                        kill(kids[i].pid, sig);
}

int main(int argc, char **argv) {
        tsr_config cfg;
        char err[1024] = "";
        char listen_ep[64], status_ep[64], worker_spec[140];
        char **worker_flags = NULL, **router_flags = NULL;
        child kids[2] = {{.name = "worker"}, {.name = "router"}};
        child *worker = &kids[0], *router = &kids[1];
        sigset_t sigs;
        int sfd = -1, rc = EXIT_BAD_CONFIG, nflags;
        bool stopping = false;
        bool draining = false;      /* ordered stop: router first, then the worker */
        uint64_t kill_at_ms = 0;

        tsr_log_init("tessera", TSR_LOG_INFO);
        tsr_log_set_thread("main");
        tsr_config_init(&cfg);
        if (argc >= 2 && (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-V") == 0)) {
                printf("tessera %s\n", TSR_VERSION);
                return 0;
        }
        if (argc >= 2 && strcmp(argv[1], "curve-keygen") == 0)
                return curve_keygen(argc - 2, argv + 2);
        /* `tessera bench serve ...` and `tessera doctor ...` are binaries of their own
         * (they link libcurl / the comm layer, the launcher does not): replace this process. */
        if (argc >= 2 && strcmp(argv[1], "bench") == 0)
                return exec_tool("tessera-bench", argv);
        if (argc >= 2 && strcmp(argv[1], "doctor") == 0)
                return exec_tool("tessera-doctor", argv);
        if (argc < 2 || strcmp(argv[1], "serve") != 0) {
                if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
                        usage(stdout);
                        return 0;
                }
                usage(stderr);
                return EXIT_BAD_CONFIG;
        }
        if (tsr_config_parse(&cfg, argc - 1, argv + 1, true, err, sizeof(err)) != TSR_OK ||
            (!cfg.help && !cfg.version && tsr_config_validate(&cfg, err, sizeof(err)) != TSR_OK)) {
                fprintf(stderr, "tessera serve: error: %s\n", err);
                goto out;
        }
        if (cfg.help) {
                tsr_config_print_help(stdout, "usage: tessera serve MODEL [options]", TSR_OWNER_ALL);
                rc = 0;
                goto out;
        }
        if (cfg.version) {
                printf("tessera %s\n", TSR_VERSION);
                rc = 0;
                goto out;
        }
        if (!cfg.model) {
                fprintf(stderr, "tessera serve: error: the following arguments are required: MODEL\n");
                goto out;
        }
        if (tsr_config_child_argv(&cfg, TSR_OWNER_WORKER, &worker_flags, &nflags) != TSR_OK ||
            tsr_config_child_argv(&cfg, TSR_OWNER_ROUTER, &router_flags, &nflags) != TSR_OK) {
                fprintf(stderr, "tessera serve: error: out of memory\n");
                goto out;
        }

        /* The worker's endpoints: the user's --listen/--status-listen, or two free
         * loopback ports chosen here. */
        const char *worker_extra[5] = {NULL};
        if (argv_has(worker_flags, "--listen")) {
                snprintf(listen_ep, sizeof(listen_ep), "%s", cfg.worker_listen);
                if (cfg.status_listen)
                        snprintf(worker_spec, sizeof(worker_spec), "%s,%s", cfg.worker_listen, cfg.status_listen);
                else
                        snprintf(worker_spec, sizeof(worker_spec), "%s", cfg.worker_listen);
        } else {
                /* cfg.port is the router's (a follower's launcher runs none; avoided all the same) */
                const int avoid[] = {cfg.port, cfg.nnodes > 1 ? cfg.master_port : -1};
                int port = pick_port_pair(avoid, sizeof avoid / sizeof avoid[0]);
                if (port < 0) {
                        fprintf(stderr, "tessera serve: error: no free loopback port for the worker\n");
                        rc = 1;
                        goto out;
                }
                snprintf(listen_ep, sizeof(listen_ep), "tcp://127.0.0.1:%d", port);
                snprintf(status_ep, sizeof(status_ep), "tcp://127.0.0.1:%d", port + 1);
                snprintf(worker_spec, sizeof(worker_spec), "%s,%s", listen_ep, status_ep);
                worker_extra[0] = "--listen";
                worker_extra[1] = listen_ep;
                worker_extra[2] = "--status-listen";
                worker_extra[3] = status_ep;
        }
        const char *router_extra[] = {"--worker", worker_spec, NULL};
        worker->argv = build_argv(find_binary("tessera-worker", "worker"), worker_flags, worker_extra);
        router->argv = build_argv(find_binary("tessera-router", "router"), router_flags, router_extra);
        if (!worker->argv || !router->argv) {
                fprintf(stderr, "tessera serve: error: out of memory\n");
                goto out;
        }

        sigemptyset(&sigs);
        sigaddset(&sigs, SIGCHLD);
        sigaddset(&sigs, SIGTERM);
        sigaddset(&sigs, SIGINT);
        sigaddset(&sigs, SIGHUP);
        sigprocmask(SIG_BLOCK, &sigs, NULL);
        sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);
        if (sfd < 0) {
                log_error("signalfd: %s", strerror(errno));
                rc = 1;
                goto out;
        }
        /* --headless: a follower node of a multi-node replica runs the worker alone (node 0
         * serves the API), restarted like any worker. */
        if (spawn(worker, &sigs) < 0 || (!cfg.headless && spawn(router, &sigs) < 0)) {
                stop_children(kids, 2, SIGTERM);
                stopping = true;
                rc = 1;
        } else {
                if (cfg.headless)
                        log_info("headless: node rank %d of %d serves its pipeline stage of %s for node 0 at %s:%d "
                                 "(no router here)", cfg.node_rank, cfg.nnodes, cfg.model, cfg.master_addr,
                                 cfg.master_port);
                else
                        log_info("serving %s on http://%s:%d (worker at %s)", cfg.model,
                                 cfg.host ? cfg.host : "0.0.0.0", cfg.port, listen_ep);
                rc = 0;
        }

        while (worker->pid > 0 || router->pid > 0 || (!stopping && worker->restart_at_ms)) {
                uint64_t now = tsr_now_ms();
                int timeout = -1;
                struct pollfd pfd = {.fd = sfd, .events = POLLIN};

                if (!stopping && worker->restart_at_ms)
                        timeout = worker->restart_at_ms > now ? (int)(worker->restart_at_ms - now) : 0;
                if (stopping && kill_at_ms)
                        timeout = kill_at_ms > now ? (int)(kill_at_ms - now) : 0;
                if (poll(&pfd, 1, timeout) < 0 && errno != EINTR)
                        break;
                now = tsr_now_ms();

                if (pfd.revents & POLLIN) {
                        struct signalfd_siginfo si;
                        while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
                                if (si.ssi_signo != SIGCHLD && !stopping) {
                                        /* Router first: it stops accepting and lets the streams it
                                         * is serving finish, which needs the worker; the worker
                                         * gets SIGTERM once the router is gone. */
                                        log_info("%s: stopping the router (in-flight requests finish), then the worker",
                                                 strsignal((int)si.ssi_signo));
                                        stopping = true;
                                        draining = true;
                                        kill_at_ms = now + STOP_GRACE_MS;
                                        if (router->pid > 0)
                                                kill(router->pid, SIGTERM);
                                        else
                                                stop_children(kids, 2, SIGTERM);
                                }
                                if (si.ssi_signo != SIGCHLD)
                                        continue;
                                int status;
                                pid_t pid;
                                while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
                                        char how[128];
                                        child *c = pid == worker->pid ? worker : pid == router->pid ? router : NULL;
                                        if (!c)
                                                continue;
                                        c->pid = 0;
                                        describe_exit(status, how, sizeof(how));
                                        if (stopping) {
                                                log_info("%s %s", c->name, how);
                                                if (draining && c == router && worker->pid > 0)
                                                        kill(worker->pid, SIGTERM);
                                                continue;
                                        }
                                        if (c == router) {
                                                log_error("router %s: stopping", how);
                                                rc = WIFEXITED(status) && WEXITSTATUS(status) == EXIT_BAD_CONFIG
                                                             ? EXIT_BAD_CONFIG : 1;
                                                stopping = true;
                                                kill_at_ms = now + STOP_GRACE_MS;
                                                stop_children(kids, 2, SIGTERM);
                                        } else if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_BAD_CONFIG) {
                                                log_error("worker %s: its flags or model files are bad (see its "
                                                          "log above); restarting cannot help: stopping", how);
                                                rc = EXIT_BAD_CONFIG;
                                                stopping = true;
                                                kill_at_ms = now + STOP_GRACE_MS;
                                                stop_children(kids, 2, SIGTERM);
                                        } else {
                                                if (now - c->started_ms >= HEALTHY_UPTIME_MS || !c->backoff_ms)
                                                        c->backoff_ms = BACKOFF_MIN_MS;
                                                else if (c->backoff_ms < BACKOFF_MAX_MS)
                                                        c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS
                                                                                ? BACKOFF_MAX_MS : c->backoff_ms * 2;
                                                c->restart_at_ms = now + c->backoff_ms;
                                                log_warn("worker %s: restarting in %u ms (restart #%u)", how,
                                                         c->backoff_ms, c->restarts + 1);
                                        }
                                }
                        }
                }
                if (!stopping && worker->restart_at_ms && now >= worker->restart_at_ms) {
                        worker->restart_at_ms = 0;
                        worker->restarts++;
                        if (spawn(worker, &sigs) < 0)
                                worker->restart_at_ms = now + BACKOFF_MAX_MS;
                }
                if (stopping && kill_at_ms && now >= kill_at_ms) {
                        log_warn("children still running %d ms after SIGTERM: sending SIGKILL", STOP_GRACE_MS);
                        stop_children(kids, 2, SIGKILL);
                        kill_at_ms = 0;
                }
        }
        log_info("exit %d", rc);
out:
        if (sfd >= 0)
                close(sfd);
        if (worker->argv)
                free(worker->argv[0]);
        if (router->argv)
                free(router->argv[0]);
        free(worker->argv);
        free(router->argv);
        tsr_config_free_argv(worker_flags);
        tsr_config_free_argv(router_flags);
        tsr_config_done(&cfg);
        return rc;
}
