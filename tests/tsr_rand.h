/* tsr_rand.h - the tests' fixed-seed random numbers (header-only, one state per test
 * executable): xorshift64*, so a failing case is the same case on every machine.
 * Include after <cmocka.h>. */
#ifndef TSR_TEST_RAND_H
#define TSR_TEST_RAND_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* Uniform in [-1, 1). */
static inline float frand(void) {
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return (float)((rng_state * 0x2545f4914f6cdd1dull) >> 40) / (float)(1u << 23) - 1.0f;
}

/* n values uniform in [-amp, amp), new memory (free); the case fails when out of memory. */
static inline float *rand_vec(size_t n, float amp) {
        float *v = malloc(n * sizeof(float));
        assert_non_null(v);
        for (size_t i = 0; i < n; i++)
                v[i] = frand() * amp;
        return v;
}

#endif
