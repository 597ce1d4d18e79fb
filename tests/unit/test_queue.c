/* common/queue: bounded, FIFO, wakes pollers, safe with several producers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <cmocka.h>

#include "common/queue.h"

static void test_fifo_and_bound(void **state) {
        tsr_queue *q = NULL;
        assert_int_equal(tsr_queue_new(0, &q), TSR_E_INVAL);
        assert_null(q);
        assert_int_equal(tsr_queue_new(3, &q), TSR_OK);
        assert_null(tsr_queue_pop(q));
        for (intptr_t i = 1; i <= 3; i++)
                assert_int_equal(tsr_queue_push(q, (void *)i), TSR_OK);
        assert_int_equal(tsr_queue_push(q, (void *)4), TSR_E_UNAVAILABLE);
        assert_int_equal(tsr_queue_len(q), 3);
        assert_ptr_equal(tsr_queue_pop(q), (void *)1);
        assert_int_equal(tsr_queue_push(q, (void *)4), TSR_OK);   /* wraps around */
        assert_ptr_equal(tsr_queue_pop(q), (void *)2);
        assert_ptr_equal(tsr_queue_pop(q), (void *)3);
        assert_ptr_equal(tsr_queue_pop(q), (void *)4);
        assert_null(tsr_queue_pop(q));
        tsr_queue_free(&q);
        assert_null(q);
}

static void test_fd_wakes_poller(void **state) {
        tsr_queue *q;
        struct pollfd pfd;
        assert_int_equal(tsr_queue_new(4, &q), TSR_OK);
        pfd.fd = tsr_queue_fd(q);
        pfd.events = POLLIN;
        assert_int_equal(poll(&pfd, 1, 0), 0);          /* nothing yet */
        tsr_queue_push(q, (void *)7);
        assert_int_equal(poll(&pfd, 1, 0), 1);
        tsr_queue_ack_fd(q);
        assert_int_equal(poll(&pfd, 1, 0), 0);          /* acked; the item is still there */
        assert_ptr_equal(tsr_queue_pop(q), (void *)7);
        tsr_queue_free(&q);
}

static void test_close_refuses_and_wakes(void **state) {
        tsr_queue *q;
        assert_int_equal(tsr_queue_new(4, &q), TSR_OK);
        tsr_queue_push(q, (void *)1);
        tsr_queue_close(q);
        assert_int_equal(tsr_queue_push(q, (void *)2), TSR_E_CLOSED);
        assert_ptr_equal(tsr_queue_pop_wait(q, -1), (void *)1);   /* queued items survive close */
        assert_null(tsr_queue_pop_wait(q, -1));                   /* closed + empty: no hang */
        tsr_queue_free(&q);
}

static void test_pop_wait_timeout(void **state) {
        tsr_queue *q;
        assert_int_equal(tsr_queue_new(1, &q), TSR_OK);
        assert_null(tsr_queue_pop_wait(q, 20));
        assert_null(tsr_queue_pop_wait(q, 0));
        tsr_queue_free(&q);
}

#define PRODUCERS 4
#define PER_PRODUCER 20000

static void *producer(void *arg) {
        tsr_queue *q = arg;
        for (intptr_t i = 1; i <= PER_PRODUCER; i++)
                while (tsr_queue_push(q, (void *)i) == TSR_E_UNAVAILABLE)
                        sched_yield();
        return NULL;
}

static void test_many_producers_nothing_lost(void **state) {
        tsr_queue *q;
        pthread_t th[PRODUCERS];
        long long sum = 0, n = 0;
        assert_int_equal(tsr_queue_new(64, &q), TSR_OK);
        for (int i = 0; i < PRODUCERS; i++)
                pthread_create(&th[i], NULL, producer, q);
        while (n < (long long)PRODUCERS * PER_PRODUCER) {
                void *item = tsr_queue_pop_wait(q, 1000);
                assert_non_null(item);
                sum += (intptr_t)item;
                n++;
        }
        for (int i = 0; i < PRODUCERS; i++)
                pthread_join(th[i], NULL);
        assert_int_equal(sum, (long long)PRODUCERS * PER_PRODUCER * (PER_PRODUCER + 1) / 2);
        assert_null(tsr_queue_pop(q));
        tsr_queue_free(&q);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_fifo_and_bound),
                cmocka_unit_test(test_fd_wakes_poller),
                cmocka_unit_test(test_close_refuses_and_wakes),
                cmocka_unit_test(test_pop_wait_timeout),
                cmocka_unit_test(test_many_producers_nothing_lost),
        };
        return cmocka_run_group_tests_name("queue", tests, NULL, NULL);
}
