/* cores.c - how many kernel threads a CPU backend starts by default: one per physical
 * core this process may run on.  An SMT sibling shares its core's vector units, so a
 * second matmul thread there mostly waits (llama.cpp and vLLM's CPU backend count
 * physical cores too) and the siblings are left to the engine's other threads (io,
 * sampling) and to the router. */
#include "kernels/kernels.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* <root>/cpu<cpu>/topology/<name> as a non-negative integer; -1 when unreadable. */
static long topology_value(const char *root, int cpu, const char *name) {
        char path[512];
        long v = -1;
        snprintf(path, sizeof path, "%s/cpu%d/topology/%s", root, cpu, name);
        FILE *f = fopen(path, "r");
        if (!f)
                return -1;
        if (fscanf(f, "%ld", &v) != 1 || v < 0)
                v = -1;
        fclose(f);
        return v;
}

int tsr_cpu_cores_of(const int *cpus, size_t n, const char *sysfs_cpu_root) {
        long (*seen)[2] = calloc(n ? n : 1, sizeof *seen);
        size_t distinct = 0;
        if (!seen)
                return (int)n;
        for (size_t i = 0; i < n; i++) {
                long pkg = topology_value(sysfs_cpu_root, cpus[i], "physical_package_id");
                long core = topology_value(sysfs_cpu_root, cpus[i], "core_id");
                if (pkg < 0 || core < 0) {      /* no topology (a container without /sys): count CPUs */
                        free(seen);
                        return (int)n;
                }
                size_t k = 0;
                while (k < distinct && !(seen[k][0] == pkg && seen[k][1] == core))
                        k++;
                if (k == distinct) {
                        seen[distinct][0] = pkg;
                        seen[distinct][1] = core;
                        distinct++;
                }
        }
        free(seen);
        return (int)distinct;
}

int tsr_cpu_default_threads(void) {
        cpu_set_t set;
        int cpus[CPU_SETSIZE];
        size_t n = 0;
        if (sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) == 0) {
                long online = sysconf(_SC_NPROCESSORS_ONLN);
                return online > 0 ? (int)online : 1;
        }
        for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &set))
                        cpus[n++] = c;
        int cores = tsr_cpu_cores_of(cpus, n, "/sys/devices/system/cpu");
        return cores > 0 ? cores : 1;
}
