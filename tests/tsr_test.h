/* tsr_test.h - the one way a cmocka test skips.
 *
 * A skip names its reason key first ("[skip:KEY] text"), which tests/summarize.py checks
 * against tests/skips.py: only a reason that holds on this machine (no GPU, a CPU
 * without that ISA level, no ../shared/fixtures in a user's clone) is an allowed skip;
 * any other key, e.g. "not-fetched" for a download that failed, fails the run.
 * Include after <cmocka.h>. */
#ifndef TSR_TEST_H
#define TSR_TEST_H

/* Reason keys (tests/skips.py has the machine check of each). */
#define TSR_SKIP_NO_SHARED "no-shared-fixtures"      /* ../shared/fixtures absent */
#define TSR_SKIP_NOT_FETCHED "not-fetched"           /* never allowed: the test command fetches it */

/* Print "[skip:KEY] <fmt ...>" and skip the current cmocka case. */
#define TSR_SKIP(key, fmt, ...) do {                                                   \
                print_message("[skip:%s] " fmt "\n", key, ##__VA_ARGS__);              \
                skip();                                                                \
        } while (0)

#endif
