/* clock.h - monotonic and wall clock helpers.  Thread-safe, no state. */
#ifndef TSR_CLOCK_H
#define TSR_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Monotonic nanoseconds since an arbitrary point (CLOCK_MONOTONIC). */
static inline uint64_t tsr_now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t tsr_now_ms(void) { return tsr_now_ns() / 1000000ull; }

/* Wall clock, for timestamps that cross processes (Status, `created`). */
static inline uint64_t tsr_wall_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Monotonic deadline `ms` from now, in ns. */
static inline uint64_t tsr_deadline_ns(uint64_t ms) { return tsr_now_ns() + ms * 1000000ull; }

#endif
