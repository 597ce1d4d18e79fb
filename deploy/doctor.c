/* doctor.c - `tessera doctor`: what a node offers a replica, and whether the nodes of a
 * multi-node replica can reach each other through the comm layer (issue #18).
 *
 *   tessera doctor                                   this node only
 *   tessera doctor --nnodes N --node-rank R --master-addr A --master-port P
 *                  [--timeout S] [--sizes B,B,...] [--json FILE]
 *
 * On one node it reports the CPU, memory, /dev/shm, the locked-memory limit, GPUs,
 * InfiniBand ports, whether this build has NCCL, and every NCCL_* variable in effect,
 * with a warning for each setting known to break multi-GPU serving (a 64 MB /dev/shm, a
 * memlock limit with InfiniBand present).
 *
 * With --nnodes it runs on every node of a replica with the flags `tessera serve` takes
 * (vLLM's names), joins them through the rendezvous of worker/parallel/bootstrap.h and
 * the comm layer's zmq backend (the CPU data plane between nodes), then measures:
 *   - each link node 0 <-> node q: round trips of each size, the bytes checked both ways;
 *     latency is half the smallest size's round trip, bandwidth the largest size over
 *     half its round trip;
 *   - all_reduce_sum over every node at each size, its result checked bitwise against the
 *     reference reduction tree (tsr_comm_tree_sum of every node's known input).
 * Node 0 prints the table.
 *
 * The NCCL half (--nccl auto: where every node has a CUDA device and the build has NCCL;
 * on: required, and run even on one GPU; off): every GPU of every node one rank of one
 * communicator (worker/parallel/nccl_probe.h), an all-reduce at each size checked bitwise
 * against the reference tree and timed (nccl-tests' algbw / busbw), round trips between
 * rank 0 and every other rank, and the transport of each channel connection read from
 * NCCL's own INFO lines (nccl_log.h): the doctor sets NCCL_DEBUG=INFO and a
 * NCCL_DEBUG_FILE of its own where the user set neither, and node 0 warns when a node
 * sends between nodes over NET/Socket (the seeds' check) or over IB without GDRDMA.
 * UNTESTED ON GPUS so far: scripts/gpu-check.sh runs it with --nccl on.
 *
 * Exit 0 when every check passed, 1 when one failed (the line says which), 2 on bad flags.
 *
 * Threads: the main thread (the zmq comm is used from the thread that made it); the NCCL
 * half runs a thread per local GPU inside tsr_nccl_probe_run. */
#include <errno.h>
#include <glob.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "kernels/kernels.h"
#include "worker/parallel/bootstrap.h"
#include "worker/parallel/comm.h"
#include "worker/parallel/nccl_log.h"
#include "worker/parallel/nccl_probe.h"

#define MAX_SIZES 16
#define EXIT_FAIL 1
#define EXIT_USAGE 2

typedef struct doctor_opts {
        long nnodes, node_rank, master_port, timeout_s;
        const char *master_addr, *json_path;
        const char *nccl;                    /* "auto", "on", "off" */
        size_t sizes[MAX_SIZES];
        int n_sizes;
        char sizes_text[256];
} doctor_opts;

static void usage(FILE *f) {
        fprintf(f, "usage: tessera doctor [--nnodes N --node-rank R --master-addr ADDR --master-port PORT]\n"
                   "                      [--timeout SECONDS] [--sizes BYTES,BYTES,...] [--json FILE]\n"
                   "                      [--nccl auto|on|off]\n\n"
                   "Reports what this node offers a replica (CPU, memory, /dev/shm, memlock, GPUs,\n"
                   "InfiniBand, NCCL).  With --nnodes, run it on every node of a multi-node replica with\n"
                   "the same flags `tessera serve` takes: the nodes meet at node 0's --master-addr and\n"
                   "--master-port, then each link's latency and bandwidth and an all-reduce over every\n"
                   "node are measured and checked.  Where every node has GPUs and this build has NCCL\n"
                   "(--nccl auto; on: required), the same over NCCL with every GPU a rank, and the\n"
                   "transport of each NCCL channel read from NCCL_DEBUG=INFO (TCP sockets between nodes\n"
                   "are flagged).  Exit 0: every check passed; 1: one failed.\n");
}

static bool parse_long(const char *s, long lo, long hi, long *out) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || *end || v < lo || v > hi)
                return false;
        *out = v;
        return true;
}

static bool parse_sizes(const char *s, doctor_opts *o) {
        char buf[256];
        if (strlen(s) >= sizeof(buf))
                return false;
        snprintf(buf, sizeof(buf), "%s", s);
        snprintf(o->sizes_text, sizeof(o->sizes_text), "%s", s);
        o->n_sizes = 0;
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                long v;
                if (o->n_sizes == MAX_SIZES || !parse_long(t, 4, 1L << 30, &v) || v % 4)
                        return false;
                o->sizes[o->n_sizes++] = (size_t)v;
        }
        return o->n_sizes > 0;
}

static int parse_args(int argc, char **argv, doctor_opts *o) {
        *o = (doctor_opts){.nnodes = 1, .node_rank = 0, .master_port = 0, .timeout_s = 60, .nccl = "auto"};
        parse_sizes("4096,1048576,16777216", o);
        for (int i = 1; i < argc; i += 2) {    /* every option takes a value, but --help */
                const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
                bool ok = true;
                if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
                        usage(stdout);
                        return 0;
                }
                if (!v) {
                        fprintf(stderr, "tessera doctor: error: %s needs a value (or is not an option)\n", a);
                        return EXIT_USAGE;
                }
                if (strcmp(a, "--nnodes") == 0)
                        ok = parse_long(v, 1, TSR_COMM_MAX_RANKS, &o->nnodes);
                else if (strcmp(a, "--node-rank") == 0)
                        ok = parse_long(v, 0, TSR_COMM_MAX_RANKS - 1, &o->node_rank);
                else if (strcmp(a, "--master-addr") == 0)
                        o->master_addr = v;
                else if (strcmp(a, "--master-port") == 0)
                        ok = parse_long(v, 1, 65535, &o->master_port);
                else if (strcmp(a, "--timeout") == 0)
                        ok = parse_long(v, 1, 3600, &o->timeout_s);
                else if (strcmp(a, "--sizes") == 0)
                        ok = parse_sizes(v, o);
                else if (strcmp(a, "--json") == 0)
                        o->json_path = v;
                else if (strcmp(a, "--nccl") == 0) {
                        o->nccl = v;
                        ok = strcmp(v, "auto") == 0 || strcmp(v, "on") == 0 || strcmp(v, "off") == 0;
                }
                else {
                        fprintf(stderr, "tessera doctor: error: unrecognized argument %s\n", a);
                        usage(stderr);
                        return EXIT_USAGE;
                }
                if (!ok) {
                        fprintf(stderr, "tessera doctor: error: argument %s: invalid value '%s'\n", a, v);
                        return EXIT_USAGE;
                }
        }
        if (o->node_rank >= o->nnodes) {
                fprintf(stderr, "tessera doctor: error: --node-rank %ld must be below --nnodes %ld\n", o->node_rank,
                        o->nnodes);
                return EXIT_USAGE;
        }
        if (o->nnodes > 1 && (!o->master_addr || !o->master_port)) {
                fprintf(stderr, "tessera doctor: error: --nnodes %ld needs --master-addr and --master-port (node 0's "
                                "address and a free port on it)\n", o->nnodes);
                return EXIT_USAGE;
        }
        return -1;
}

/* ---- this node ------------------------------------------------------------------------ */

static char *read_line_of(const char *path, const char *prefix) {
        FILE *f = fopen(path, "r");
        char line[4096];
        char *out = NULL;
        if (!f)
                return NULL;
        while (!out && fgets(line, sizeof(line), f))
                if (!prefix || strncmp(line, prefix, strlen(prefix)) == 0) {
                        line[strcspn(line, "\n")] = 0;
                        const char *v = prefix ? strchr(line, ':') : NULL;
                        v = v ? v + 1 + strspn(v + 1, " \t") : line;
                        out = strdup(v);
                }
        fclose(f);
        return out;
}

static bool has_flag(const char *flags, const char *want) {
        size_t n = strlen(want);
        for (const char *p = flags; p && (p = strstr(p, want)); p += n)
                if ((p == flags || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0))
                        return true;
        return false;
}

/* Fills `node` (JSON) and prints the report; warnings go to *warnings. */
static void report_node(json_t *node, int *warnings) {
        char *model = read_line_of("/proc/cpuinfo", "model name");
        char *flags = read_line_of("/proc/cpuinfo", "flags");
        char *mem = read_line_of("/proc/meminfo", "MemTotal");
        char host[256] = "?";
        static const char *const isa[] = {"avx2", "f16c", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                                          "amx_bf16", "amx_int8", NULL};
        char isa_text[256] = "";
        size_t off = 0;
        gethostname(host, sizeof(host) - 1);
        for (int i = 0; isa[i]; i++)
                if (has_flag(flags, isa[i]) && off < sizeof(isa_text))
                        off += (size_t)snprintf(isa_text + off, sizeof(isa_text) - off, "%s%s", off ? " " : "", isa[i]);
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        double mem_gib = mem ? strtod(mem, NULL) / (1024.0 * 1024.0) : 0;
        struct statvfs sv;
        double shm_gib = statvfs("/dev/shm", &sv) == 0 ? (double)sv.f_blocks * (double)sv.f_frsize / (1u << 30) : -1;
        struct rlimit ml;
        bool memlock_unlimited = getrlimit(RLIMIT_MEMLOCK, &ml) == 0 && ml.rlim_cur == RLIM_INFINITY;
        double memlock_mib = memlock_unlimited ? -1 : (double)ml.rlim_cur / (1u << 20);
        printf("node: host %s, CPU \"%s\", %ld cores, ISA: %s; memory %.1f GiB; /dev/shm %.1f GiB; memlock %s",
               host, model ? model : "?", cores, isa_text[0] ? isa_text : "baseline", mem_gib, shm_gib,
               memlock_unlimited ? "unlimited" : "");
        if (!memlock_unlimited)
                printf("%.0f MiB", memlock_mib);
        printf("\n");
        /* the level the worker's fast CPU kernels run at here (what --dtype auto decides on:
         * bfloat16 from avx512_bf16 up) */
        const char *kernel_isa = tsr_cpu_isa_name(tsr_cpu_isa_best());
        printf("kernels: cpu-fast at %s\n", kernel_isa);
        json_object_set_new(node, "host", json_string(host));
        json_object_set_new(node, "cpu", json_string(model ? model : "?"));
        json_object_set_new(node, "cores", json_integer(cores));
        json_object_set_new(node, "isa", json_string(isa_text));
        json_object_set_new(node, "kernel_isa", json_string(kernel_isa));
        json_object_set_new(node, "memory_gib", json_real(mem_gib));
        json_object_set_new(node, "shm_gib", json_real(shm_gib));
        json_object_set_new(node, "memlock_unlimited", json_boolean(memlock_unlimited));

        /* GPUs: the device nodes and the driver's version file (no CUDA call: a node
         * without the driver still gets its report). */
        glob_t g = {0};
        size_t n_gpu = glob("/dev/nvidia[0-9]*", 0, NULL, &g) == 0 ? g.gl_pathc : 0;
        globfree(&g);
        char *driver = read_line_of("/proc/driver/nvidia/version", NULL);
        printf("gpu: %zu NVIDIA device%s%s%s; NCCL %s\n", n_gpu, n_gpu == 1 ? "" : "s", driver ? ", driver: " : "",
               driver ? driver : "", tsr_comm_nccl_available() ? "built in" : "not in this build");
        json_object_set_new(node, "gpus", json_integer((json_int_t)n_gpu));
        json_object_set_new(node, "nccl_built", json_boolean(tsr_comm_nccl_available()));
        free(driver);

        /* InfiniBand / RoCE ports, as the kernel lists them. */
        json_t *ib = json_array();
        g = (glob_t){0};
        if (glob("/sys/class/infiniband/*/ports/*", 0, NULL, &g) == 0)
                for (size_t i = 0; i < g.gl_pathc; i++) {
                        char p[512];
                        snprintf(p, sizeof(p), "%s/state", g.gl_pathv[i]);
                        char *state = read_line_of(p, NULL);
                        snprintf(p, sizeof(p), "%s/rate", g.gl_pathv[i]);
                        char *rate = read_line_of(p, NULL);
                        snprintf(p, sizeof(p), "%s/link_layer", g.gl_pathv[i]);
                        char *layer = read_line_of(p, NULL);
                        printf("infiniband: %s: %s, %s, %s\n", g.gl_pathv[i] + strlen("/sys/class/infiniband/"),
                               state ? state : "?", rate ? rate : "?", layer ? layer : "?");
                        json_array_append_new(ib, json_pack("{s:s, s:s, s:s}", "port", g.gl_pathv[i],
                                                            "state", state ? state : "?", "rate", rate ? rate : "?"));
                        free(state);
                        free(rate);
                        free(layer);
                }
        if (json_array_size(ib) == 0)
                printf("infiniband: none (/sys/class/infiniband is empty: NCCL between nodes would use sockets)\n");
        globfree(&g);
        json_object_set_new(node, "infiniband", ib);

        extern char **environ;
        json_t *env = json_object();
        for (char **e = environ; *e; e++)
                if (strncmp(*e, "NCCL_", 5) == 0) {
                        const char *eq = strchr(*e, '=');
                        char name[128];
                        snprintf(name, sizeof(name), "%.*s", eq ? (int)(eq - *e) : 0, *e);
                        printf("env: %s\n", *e);
                        json_object_set_new(env, name, json_string(eq ? eq + 1 : ""));
                }
        json_object_set_new(node, "nccl_env", env);

        if (shm_gib >= 0 && shm_gib < 1.0) {
                printf("warning: /dev/shm is %.2f GiB: NCCL's shared-memory transport between GPUs of this node "
                       "needs more (Docker: --shm-size; Kubernetes: an emptyDir with medium Memory on /dev/shm)\n",
                       shm_gib);
                (*warnings)++;
        }
        if (json_array_size(ib) > 0 && !memlock_unlimited) {
                printf("warning: the locked-memory limit is %.0f MiB with InfiniBand present: RDMA registers GPU "
                       "and host buffers; set LimitMEMLOCK=infinity (systemd) or ulimit -l unlimited\n",
                       memlock_mib);
                (*warnings)++;
        }
        free(model);
        free(flags);
        free(mem);
}

/* ---- the group ------------------------------------------------------------------------ */

/* The known input of node r for the all-reduce check: small integers times a power of
 * two, so the reference tree's sum is exact and any lost or misplaced element shows. */
static void fill_pattern(float *buf, size_t count, int rank) {
        for (size_t i = 0; i < count; i++)
                buf[i] = (float)((int)((i * 7 + (size_t)rank * 13) % 251) - 125) * 0.25f;
}

static void fill_bytes(unsigned char *buf, size_t n, uint32_t seed) {
        for (size_t i = 0; i < n; i++)
                buf[i] = (unsigned char)((i * 31 + seed * 17) >> 3);
}

/* Rounds of round trips so a size takes about 50 ms, at least 3. */
static int rounds_for(size_t bytes) {
        size_t r = (64u << 20) / (bytes + 1);
        return r < 3 ? 3 : r > 200 ? 200 : (int)r;
}

/* Node 0 <-> node q: node 0 sends, q checks and echoes, node 0 checks.  Every node runs
 * the same schedule (nodes other than 0 and q skip).  Returns the best round trip (ns)
 * on node 0; *ok false when a byte differed. */
static tsr_status link_test(tsr_comm *c, int q, size_t bytes, uint64_t tag, double *rtt_ns, bool *ok) {
        int me = tsr_comm_rank(c);
        *rtt_ns = 0;
        if (me != 0 && me != q)         /* not this node's link */
                return TSR_OK;
        unsigned char *out = malloc(bytes), *in = malloc(bytes);
        tsr_status st = out && in ? TSR_OK : TSR_E_NOMEM;
        int rounds = rounds_for(bytes);
        double best = 1e30;
        if (st == TSR_OK)
                fill_bytes(out, bytes, (uint32_t)q);
        for (int r = 0; st == TSR_OK && r < rounds; r++) {
                if (me == 0) {
                        uint64_t t0 = tsr_now_ns();
                        if ((st = tsr_comm_send(c, out, bytes, q, tag, NULL)) == TSR_OK &&
                            (st = tsr_comm_recv(c, in, bytes, q, tag, NULL)) == TSR_OK) {
                                double t = (double)(tsr_now_ns() - t0);
                                best = t < best ? t : best;
                                *ok = *ok && memcmp(in, out, bytes) == 0;
                        }
                } else if (me == q) {
                        if ((st = tsr_comm_recv(c, in, bytes, 0, tag, NULL)) == TSR_OK) {
                                *ok = *ok && memcmp(in, out, bytes) == 0;
                                st = tsr_comm_send(c, in, bytes, 0, tag, NULL);
                        }
                }
        }
        free(out);
        free(in);
        *rtt_ns = best;
        return st;
}

/* all_reduce_sum of every node's pattern, checked bitwise against the reference tree;
 * then timed.  *mean_ns: mean per call. */
static tsr_status all_reduce_test(tsr_comm *c, size_t bytes, double *mean_ns, bool *ok) {
        int n = tsr_comm_size(c), me = tsr_comm_rank(c);
        size_t count = bytes / sizeof(float);
        float *buf = malloc(bytes), *want = malloc(bytes);
        float **parts = calloc((size_t)n, sizeof(float *));
        tsr_status st = buf && want && parts ? TSR_OK : TSR_E_NOMEM;
        for (int r = 0; st == TSR_OK && r < n; r++)
                if (!(parts[r] = malloc(bytes)))
                        st = TSR_E_NOMEM;
        if (st == TSR_OK) {
                for (int r = 0; r < n; r++)
                        fill_pattern(parts[r], count, r);
                tsr_comm_tree_sum((const float *const *)parts, n, want, count);
                fill_pattern(buf, count, me);
                st = tsr_comm_all_reduce_sum(c, buf, count, NULL);
        }
        if (st == TSR_OK)
                *ok = *ok && memcmp(buf, want, bytes) == 0;
        int rounds = rounds_for(bytes * 2);
        uint64_t t0 = tsr_now_ns();
        for (int r = 0; st == TSR_OK && r < rounds; r++)
                st = tsr_comm_all_reduce_sum(c, buf, count, NULL);
        *mean_ns = (double)(tsr_now_ns() - t0) / rounds;
        for (int r = 0; parts && r < n; r++)
                free(parts[r]);
        free(parts);
        free(buf);
        free(want);
        return st;
}

static const char *human_bytes(size_t b, char *buf, size_t len) {
        if (b >= (1u << 20) && b % (1u << 20) == 0)
                snprintf(buf, len, "%zu MiB", b >> 20);
        else if (b >= 1024 && b % 1024 == 0)
                snprintf(buf, len, "%zu KiB", b >> 10);
        else
                snprintf(buf, len, "%zu B", b);
        return buf;
}

/* ---- NCCL ------------------------------------------------------------------------------- */

/* What each node tells the others after its NCCL run (fixed size: all_gather'd raw). */
typedef struct nccl_summary {
        int32_t gpus, status, connections;
        int32_t by_kind[TSR_NCCL_KINDS];
        char version[48], network[32];
} nccl_summary;

/* Where NCCL_DEBUG=INFO output goes for the doctor to read: a file of our own unless the
 * user chose one (then its name may hold %h / %p, and the transports are not read here). */
static char nccl_debug_path[64];

static void nccl_capture_debug(void) {
        if (!getenv("NCCL_DEBUG"))
                setenv("NCCL_DEBUG", "INFO", 1);
        if (getenv("NCCL_DEBUG_FILE"))
                return;
        snprintf(nccl_debug_path, sizeof(nccl_debug_path), "/tmp/tessera-doctor-nccl.XXXXXX");
        int fd = mkstemp(nccl_debug_path);
        if (fd < 0) {
                nccl_debug_path[0] = 0;
                return;
        }
        close(fd);
        setenv("NCCL_DEBUG_FILE", nccl_debug_path, 1);
}

static void nccl_read_debug(tsr_nccl_log *log) {
        tsr_nccl_log_init(log);
        if (!nccl_debug_path[0])
                return;
        FILE *f = fopen(nccl_debug_path, "r");
        char line[1024];
        while (f && fgets(line, sizeof(line), f))
                tsr_nccl_log_line(log, line);
        if (f)
                fclose(f);
        unlink(nccl_debug_path);
}

/* The NCCL half: every GPU of every node a rank of one communicator.  `zc` is the nodes'
 * zmq group (NULL on one node): GPU counts, node 0's NCCL id and each node's summary go
 * over it.  Returns 0, or EXIT_FAIL with a FAILED line. */
static int nccl_phase(const doctor_opts *o, tsr_comm *zc, json_t *root, int *warnings) {
        int n_nodes = zc ? tsr_comm_size(zc) : 1, me = zc ? tsr_comm_rank(zc) : 0;
        int32_t mine = (int32_t)tsr_nccl_probe_devices();      /* 0 in a build without NCCL */
        bool nccl_off = strcmp(o->nccl, "off") == 0, nccl_on = strcmp(o->nccl, "on") == 0;
        int32_t gpus[TSR_COMM_MAX_RANKS] = {mine};
        json_t *jn = json_object();
        json_object_set_new(root, "nccl", jn);
        if (zc && tsr_comm_all_gather(zc, &mine, gpus, sizeof(mine), NULL) != TSR_OK) {
                printf("doctor: FAILED: the nodes' GPU counts could not be exchanged\n");
                return EXIT_FAIL;
        }
        int total = 0, first = 0, without = -1;
        for (int q = 0; q < n_nodes; q++) {
                if (q < me)
                        first += gpus[q];
                total += gpus[q];
                if (gpus[q] == 0 && without < 0)
                        without = q;
        }
        /* one GPU in all has no link to measure; --nccl on runs its one-rank group anyway */
        if (nccl_off || without >= 0 || (total < 2 && !nccl_on)) {
                /* the reason, as this node knows it */
                char why[160];
                if (nccl_off)
                        snprintf(why, sizeof(why), "--nccl off");
                else if (without < 0)
                        snprintf(why, sizeof(why), "one GPU: no link to measure");
                else if (without == me)
                        snprintf(why, sizeof(why), "%s", tsr_comm_nccl_available() ? "no CUDA device on this node"
                                                                                   : "this build has no NCCL");
                else
                        snprintf(why, sizeof(why), "node %d has no CUDA device or no NCCL", without);
                json_object_set_new(jn, "run", json_false());
                json_object_set_new(jn, "reason", json_string(why));
                if (nccl_on) {
                        printf("doctor: FAILED: --nccl on, but NCCL cannot run: %s\n", why);
                        json_object_set_new(root, "error", json_string(why));
                        return EXIT_FAIL;
                }
                printf("nccl: not run (%s)\n", why);
                return 0;
        }
        nccl_capture_debug();
        /* node 0 makes the id; a failure travels as status so no node waits for it */
        struct {
                int32_t status;
                tsr_comm_nccl_id id;
        } idmsg = {0};
        char err[512] = "";
        if (me == 0)
                idmsg.status = (int32_t)tsr_comm_nccl_unique_id(&idmsg.id, err, sizeof(err));
        if (zc && tsr_comm_broadcast(zc, &idmsg, sizeof(idmsg), 0, NULL) != TSR_OK) {
                printf("doctor: FAILED: node 0's NCCL id did not arrive\n");
                return EXIT_FAIL;
        }
        if (idmsg.status != TSR_OK) {
                printf("doctor: FAILED: NCCL on node 0: %s\n", err[0] ? err : tsr_status_str(idmsg.status));
                return EXIT_FAIL;
        }
        printf("nccl: %d GPU%s on %d node%s, this node's ranks %d..%d\n", total, total == 1 ? "" : "s", n_nodes,
               n_nodes == 1 ? "" : "s", first, first + mine - 1);
        fflush(stdout);
        tsr_nccl_probe_cfg cfg = {.id = &idmsg.id, .first_rank = first, .n_local = mine, .size = total,
                                  .sizes = o->sizes, .n_sizes = o->n_sizes,
                                  .timeout_ms = (uint32_t)o->timeout_s * 1000u};
        tsr_nccl_probe_out out;
        tsr_status st = tsr_nccl_probe_run(&cfg, &out, err, sizeof(err));
        tsr_nccl_log log;
        nccl_read_debug(&log);

        nccl_summary sum = {.gpus = mine, .status = (int32_t)st, .connections = log.connections}, all[TSR_COMM_MAX_RANKS];
        memcpy(sum.by_kind, log.by_kind, sizeof(sum.by_kind));
        snprintf(sum.version, sizeof(sum.version), "%s", log.version);
        snprintf(sum.network, sizeof(sum.network), "%s", log.network);
        all[0] = sum;
        if (zc && tsr_comm_all_gather(zc, &sum, all, sizeof(sum), NULL) != TSR_OK) {
                printf("doctor: FAILED: the nodes' NCCL results could not be exchanged\n");
                return EXIT_FAIL;
        }
        json_object_set_new(jn, "run", json_true());
        json_object_set_new(jn, "ranks", json_integer(total));
        json_object_set_new(jn, "version", json_string(log.version));
        json_object_set_new(jn, "network", json_string(log.network));
        json_t *jt = json_object();
        char line[1024];
        size_t off = 0;
        for (int i = 0; i < log.n_transports; i++) {
                json_object_set_new(jt, log.transports[i].text, json_integer(log.transports[i].count));
                if (off < sizeof(line))
                        off += (size_t)snprintf(line + off, sizeof(line) - off, "%s%s x %d", i ? ", " : "",
                                                log.transports[i].text, log.transports[i].count);
        }
        json_object_set_new(jn, "transports", jt);
        if (log.version[0])
                printf("nccl: version %s%s%s\n", log.version, log.network[0] ? ", network " : "", log.network);
        if (!nccl_debug_path[0])
                printf("nccl: NCCL_DEBUG_FILE is set (%s): the transports are in that file, not read here\n",
                       getenv("NCCL_DEBUG_FILE"));
        else if (log.connections)
                printf("nccl: this node's channel connections: %d (%s)\n", log.connections, line);
        else if (total > 1)
                printf("nccl: no channel lines from NCCL (NCCL_DEBUG=%s hides them; INFO shows them)\n",
                       getenv("NCCL_DEBUG"));
        if (log.warnings)
                printf("nccl: NCCL warned %d time%s, first: %s\n", log.warnings, log.warnings == 1 ? "" : "s",
                       log.first_warning);
        for (int q = 0; q < n_nodes; q++)
                if (all[q].status != TSR_OK) {
                        printf("doctor: FAILED: NCCL on node %d: %s\n", q,
                               q == me && err[0] ? err : tsr_status_str(all[q].status));
                        json_object_set_new(jn, "error", json_string(q == me && err[0] ? err : tsr_status_str(all[q].status)));
                        return EXIT_FAIL;
                }

        bool ok = true;
        json_t *jr = json_array(), *jl = json_array();
        json_object_set_new(jn, "all_reduce", jr);
        json_object_set_new(jn, "links", jl);
        for (int i = 0; i < o->n_sizes; i++) {
                char a[32];
                double algbw = (double)o->sizes[i] / (out.all_reduce_us[i] * 1e3);
                double busbw = algbw * 2.0 * (total - 1) / total;      /* nccl-tests' bus bandwidth */
                if (me == 0)
                        printf("nccl all_reduce over %d GPUs, %s: %.1f us, algbw %.3f GB/s, busbw %.3f GB/s; result %s\n",
                               total, human_bytes(o->sizes[i], a, sizeof(a)), out.all_reduce_us[i], algbw, busbw,
                               out.all_reduce_ok[i] ? "bitwise equal to the reference tree"
                                                    : "DIFFERS from the reference tree");
                json_array_append_new(jr, json_pack("{s:I, s:f, s:f, s:b}", "bytes", (json_int_t)o->sizes[i], "us",
                                                    out.all_reduce_us[i], "busbw_gbps", busbw, "bitwise_ok",
                                                    out.all_reduce_ok[i]));
                ok = ok && out.all_reduce_ok[i];
        }
        for (int q = 1; q < total; q++) {
                char a[32], b[32];
                int node = 0;
                for (int acc = gpus[0]; q >= acc && node + 1 < n_nodes; acc += gpus[++node])
                        ;
                if (me == 0)
                        printf("nccl link rank 0 <-> rank %d (node %d): %s one way %.1f us; %s %.3f GB/s; bytes %s\n",
                               q, node, human_bytes(o->sizes[0], a, sizeof(a)), out.link_latency_us[q],
                               human_bytes(o->sizes[o->n_sizes - 1], b, sizeof(b)), out.link_gbps[q],
                               out.link_ok[q] ? "checked" : "DIFFER");
                if (me == 0 || node == me)
                        json_array_append_new(jl, json_pack("{s:i, s:i, s:f, s:f, s:b}", "rank", q, "node", node,
                                                            "latency_us", out.link_latency_us[q], "gbps",
                                                            out.link_gbps[q], "bytes_ok", out.link_ok[q]));
                ok = ok && out.link_ok[q];
        }
        /* the seeds' check (003): between nodes, NET/IB/.../GDRDMA is the efficient path and
         * NET/Socket the inefficient one; node 0 reports every node's */
        for (int q = 0; me == 0 && n_nodes > 1 && q < n_nodes; q++) {
                if (all[q].by_kind[TSR_NCCL_NET_SOCKET] > 0) {
                        printf("warning: NCCL on node %d sends between nodes over TCP sockets (NET/Socket, %d of %d "
                               "channel connections): tensor parallelism across nodes will be slow; check "
                               "InfiniBand/RoCE (NCCL_IB_HCA, ibstat) or which interface NCCL_SOCKET_IFNAME picks "
                               "(docs/troubleshooting.md)\n", q, all[q].by_kind[TSR_NCCL_NET_SOCKET],
                               all[q].connections);
                        (*warnings)++;
                } else if (all[q].by_kind[TSR_NCCL_NET_IB] > 0) {
                        printf("warning: NCCL on node %d uses InfiniBand without GPUDirect RDMA (NET/IB without "
                               "/GDRDMA, %d connections): check the nvidia-peermem module\n", q,
                               all[q].by_kind[TSR_NCCL_NET_IB]);
                        (*warnings)++;
                }
                if (strcmp(all[q].version, all[0].version) != 0) {
                        printf("warning: node %d runs NCCL %s, node 0 runs %s\n", q, all[q].version, all[0].version);
                        (*warnings)++;
                }
        }
        if (!ok) {
                printf("doctor: FAILED: NCCL results differed (above)\n");
                return EXIT_FAIL;
        }
        return 0;
}

static int run_group(const doctor_opts *o, json_t *root, int *warnings) {
        char addr[128], bind_ep[200], err[1024];
        tsr_comm_zmq_listener *l = NULL;
        tsr_bootstrap_group g = {0};
        tsr_comm *c = NULL;
        int rc = EXIT_FAIL;
        bool all_ok = true;
        char fingerprint[512];

        /* The address this node is reached at: the one its traffic to node 0 leaves from. */
        if (tsr_bootstrap_local_addr(o->master_addr, (uint16_t)o->master_port, addr, sizeof(addr), err,
                                     sizeof(err)) != TSR_OK) {
                printf("doctor: FAILED: %s\n", err);
                return EXIT_FAIL;
        }
        snprintf(bind_ep, sizeof(bind_ep), "tcp://%s:*", addr);
        if (tsr_comm_zmq_listener_new(bind_ep, &l, err, sizeof(err)) != TSR_OK) {
                printf("doctor: FAILED: %s\n", err);
                return EXIT_FAIL;
        }
        /* What every node must agree on: the schedule of tests below. */
        snprintf(fingerprint, sizeof(fingerprint), "purpose=doctor\nsizes=%s\nnccl=%s\n", o->sizes_text, o->nccl);
        tsr_bootstrap_cfg bc = {.nnodes = (uint32_t)o->nnodes, .node_rank = (uint32_t)o->node_rank,
                                .master_addr = o->master_addr, .master_port = (uint16_t)o->master_port,
                                .purpose = "doctor", .fingerprint = fingerprint,
                                .data_endpoint = tsr_comm_zmq_listener_endpoint(l),
                                .timeout_ms = (uint32_t)o->timeout_s * 1000u};
        printf("doctor: node %ld of %ld, data endpoint %s, meeting at %s:%ld\n", o->node_rank, o->nnodes,
               bc.data_endpoint, o->master_addr, o->master_port);
        fflush(stdout);
        uint64_t t0 = tsr_now_ns();
        if (tsr_bootstrap_rendezvous(&bc, &g, err, sizeof(err)) != TSR_OK) {
                printf("doctor: FAILED: %s\n", err);
                json_object_set_new(root, "error", json_string(err));
                tsr_comm_zmq_listener_free(&l);
                return EXIT_FAIL;
        }
        printf("rendezvous: %ld nodes in %.0f ms, epoch %016llx\n", o->nnodes, (double)(tsr_now_ns() - t0) / 1e6,
               (unsigned long long)g.epoch);
        json_t *nodes = json_array();
        for (uint32_t q = 0; q < g.nnodes; q++) {
                printf("  node %u: host %s, %s\n", q, g.hostnames[q], g.endpoints[q]);
                json_array_append_new(nodes, json_pack("{s:i, s:s, s:s}", "rank", (int)q, "host", g.hostnames[q],
                                                       "endpoint", g.endpoints[q]));
        }
        json_object_set_new(root, "nodes", nodes);
        char epoch_hex[17];
        snprintf(epoch_hex, sizeof(epoch_hex), "%016llx", (unsigned long long)g.epoch);
        json_object_set_new(root, "epoch", json_string(epoch_hex));
        tsr_comm_desc d = {.backend = TSR_COMM_BACKEND_ZMQ, .rank = (int)o->node_rank, .size = (int)o->nnodes,
                           .timeout_ms = (uint32_t)o->timeout_s * 1000u, .epoch = g.epoch, .zmq_listener = &l,
                           .endpoints = (const char *const *)g.endpoints};
        tsr_status st = tsr_comm_new(&d, &c, err, sizeof(err));
        if (st != TSR_OK) {
                printf("doctor: FAILED: the comm group: %s\n", err);
                json_object_set_new(root, "error", json_string(err));
                goto out;
        }
        json_t *links = json_array(), *reduces = json_array();
        json_object_set_new(root, "links", links);
        json_object_set_new(root, "all_reduce", reduces);
        uint64_t tag = 1;
        for (int q = 1; st == TSR_OK && q < o->nnodes; q++) {
                json_t *jl = json_object();
                json_t *js = json_array();
                bool ok = true;
                double lat_us = 0, gbps = 0;
                for (int i = 0; st == TSR_OK && i < o->n_sizes; i++) {
                        double rtt;
                        st = link_test(c, q, o->sizes[i], tag++, &rtt, &ok);
                        if (st == TSR_OK && o->node_rank == 0) {
                                json_array_append_new(js, json_pack("{s:I, s:f}", "bytes", (json_int_t)o->sizes[i],
                                                                    "round_trip_us", rtt / 1e3));
                                if (i == 0)
                                        lat_us = rtt / 2e3;
                                if (i == o->n_sizes - 1)
                                        gbps = (double)o->sizes[i] / (rtt / 2);
                        }
                }
                if (o->node_rank == 0 && st == TSR_OK) {
                        char a[32], b[32];
                        printf("link 0 <-> %d (host %s): %s one way %.1f us; %s %.3f GB/s; bytes %s\n", q,
                               g.hostnames[q], human_bytes(o->sizes[0], a, sizeof(a)), lat_us,
                               human_bytes(o->sizes[o->n_sizes - 1], b, sizeof(b)), gbps,
                               ok ? "checked" : "DIFFER");
                }
                /* node 0 times each link; node q checked the bytes of its own */
                if (o->node_rank == 0) {
                        json_object_set_new(jl, "peer", json_integer(q));
                        json_object_set_new(jl, "latency_us", json_real(lat_us));
                        json_object_set_new(jl, "bandwidth_gbps", json_real(gbps));
                        json_object_set_new(jl, "sizes", js);
                } else {
                        json_object_set_new(jl, "peer", json_integer(0));
                        json_decref(js);
                }
                json_object_set_new(jl, "bytes_ok", json_boolean(ok));
                if (o->node_rank == 0 || o->node_rank == q)
                        json_array_append_new(links, jl);
                else
                        json_decref(jl);
                all_ok = all_ok && ok;
        }
        for (int i = 0; st == TSR_OK && i < o->n_sizes; i++) {
                double ns;
                bool ok = true;
                char a[32];
                st = all_reduce_test(c, o->sizes[i], &ns, &ok);
                if (st != TSR_OK)
                        break;
                printf("all_reduce over %ld nodes, %s: %.1f us, %.3f GB/s; result %s\n", o->nnodes,
                       human_bytes(o->sizes[i], a, sizeof(a)), ns / 1e3, (double)o->sizes[i] / ns,
                       ok ? "bitwise equal to the reference tree" : "DIFFERS from the reference tree");
                json_array_append_new(reduces, json_pack("{s:I, s:f, s:b}", "bytes", (json_int_t)o->sizes[i], "us",
                                                         ns / 1e3, "bitwise_ok", ok));
                all_ok = all_ok && ok;
        }
        if (st == TSR_OK && nccl_phase(o, c, root, warnings) != 0)
                goto out;
        if (st == TSR_OK)
                st = tsr_comm_barrier(c);
        if (st != TSR_OK) {
                snprintf(err, sizeof(err), "the comm group failed: %s", tsr_status_str(st));
                printf("doctor: FAILED: %s\n", err);
                json_object_set_new(root, "error", json_string(err));
                goto out;
        }
        if (!all_ok) {
                printf("doctor: FAILED: bytes differed between nodes (above)\n");
                json_object_set_new(root, "error", json_string("bytes differed between nodes"));
                goto out;
        }
        rc = 0;
out:
        tsr_comm_free(&c);
        tsr_comm_zmq_listener_free(&l);
        tsr_bootstrap_group_free(&g);
        return rc;
}

int main(int argc, char **argv) {
        doctor_opts o;
        int rc = parse_args(argc, argv, &o), warnings = 0;
        if (rc >= 0)
                return rc;
        tsr_log_init("tessera-doctor", TSR_LOG_WARN);
        json_t *root = json_object(), *node = json_object();
        json_object_set_new(root, "node_rank", json_integer(o.node_rank));
        json_object_set_new(root, "nnodes", json_integer(o.nnodes));
        json_object_set_new(root, "version", json_string(TSR_VERSION));
        printf("tessera doctor %s\n", TSR_VERSION);
        report_node(node, &warnings);
        json_object_set_new(root, "node", node);
        rc = o.nnodes > 1 ? run_group(&o, root, &warnings) : nccl_phase(&o, NULL, root, &warnings);
        json_object_set_new(root, "warnings", json_integer(warnings));
        json_object_set_new(root, "ok", json_boolean(rc == 0));
        if (rc == 0)
                printf("doctor: OK%s (%d warning%s)\n", o.nnodes > 1 ? ", every node reached and checked" : "",
                       warnings, warnings == 1 ? "" : "s");
        if (o.json_path && json_dump_file(root, o.json_path, JSON_INDENT(2)) != 0) {
                fprintf(stderr, "tessera doctor: cannot write %s\n", o.json_path);
                rc = EXIT_FAIL;
        }
        json_decref(root);
        return rc;
}
