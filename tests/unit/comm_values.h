/* comm_values.h - the deterministic inputs of the comm tests (test_comm.c on the CPU
 * backends, test_comm_nccl.c on GPUs), so both reduce the same numbers. */
#ifndef TSR_TEST_COMM_VALUES_H
#define TSR_TEST_COMM_VALUES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

static inline uint32_t mix(uint32_t x) {
        x ^= x >> 16;
        x *= 0x7feb352du;
        x ^= x >> 15;
        x *= 0x846ca68bu;
        x ^= x >> 16;
        return x;
}

static inline uint32_t value_hash(uint32_t rank, uint32_t seed, size_t i) {
        return mix(rank * 0x9e3779b9u ^ seed * 0x85ebca6bu ^ (uint32_t)i * 0xc2b2ae35u);
}

/* Values over 40 binades with both signs, so the summation order shows in the bits. */
static inline float value(uint32_t rank, uint32_t seed, size_t i) {
        uint32_t h = value_hash(rank, seed, i);
        float m = (float)((int)(h % 2001u) - 1000) / 997.0f;
        return ldexpf(m, (int)((h >> 12) % 41u) - 20);
}

#endif
