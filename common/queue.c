#include "queue.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

struct tsr_queue {
        pthread_mutex_t mu;
        pthread_cond_t nonempty;
        void **items;        /* ring of `capacity` slots */
        size_t capacity;
        size_t head;         /* next to pop */
        size_t len;
        bool closed;
        int efd;
};

tsr_status tsr_queue_new(size_t capacity, tsr_queue **ret) {
        tsr_queue *q;
        pthread_condattr_t ca;

        if (capacity == 0)
                return TSR_E_INVAL;
        q = calloc(1, sizeof(*q));
        if (!q)
                return TSR_E_NOMEM;
        q->items = calloc(capacity, sizeof(void *));
        if (!q->items) {
                free(q);
                return TSR_E_NOMEM;
        }
        q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (q->efd < 0) {
                free(q->items);
                free(q);
                return TSR_E_IO;
        }
        q->capacity = capacity;
        pthread_mutex_init(&q->mu, NULL);
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&q->nonempty, &ca);
        pthread_condattr_destroy(&ca);
        *ret = q;
        return TSR_OK;
}

void tsr_queue_free(tsr_queue **qp) {
        tsr_queue *q;
        if (!qp || !*qp)
                return;
        q = *qp;
        close(q->efd);
        pthread_cond_destroy(&q->nonempty);
        pthread_mutex_destroy(&q->mu);
        free(q->items);
        free(q);
        *qp = NULL;
}

static void signal_fd(tsr_queue *q) {
        uint64_t one = 1;
        /* EAGAIN means the counter is already huge: still readable, nothing lost. */
        ssize_t n = write(q->efd, &one, sizeof(one));
        (void)n;
}

tsr_status tsr_queue_push(tsr_queue *q, void *item) {
        tsr_status st = TSR_OK;

        pthread_mutex_lock(&q->mu);
        if (q->closed) {
                st = TSR_E_CLOSED;
        } else if (q->len == q->capacity) {
                st = TSR_E_UNAVAILABLE;
        } else {
                q->items[(q->head + q->len) % q->capacity] = item;
                q->len++;
                pthread_cond_signal(&q->nonempty);
        }
        pthread_mutex_unlock(&q->mu);
        if (st == TSR_OK)
                signal_fd(q);
        return st;
}

static void *pop_locked(tsr_queue *q) {
        void *item;
        if (q->len == 0)
                return NULL;
        item = q->items[q->head];
        q->items[q->head] = NULL;
        q->head = (q->head + 1) % q->capacity;
        q->len--;
        return item;
}

void *tsr_queue_pop(tsr_queue *q) {
        void *item;
        pthread_mutex_lock(&q->mu);
        item = pop_locked(q);
        pthread_mutex_unlock(&q->mu);
        return item;
}

void *tsr_queue_pop_wait(tsr_queue *q, int64_t timeout_ms) {
        struct timespec deadline;
        void *item;

        clock_gettime(CLOCK_MONOTONIC, &deadline);
        if (timeout_ms > 0) {
                deadline.tv_sec += timeout_ms / 1000;
                deadline.tv_nsec += (timeout_ms % 1000) * 1000000L;
                if (deadline.tv_nsec >= 1000000000L) {
                        deadline.tv_sec++;
                        deadline.tv_nsec -= 1000000000L;
                }
        }
        pthread_mutex_lock(&q->mu);
        while (q->len == 0 && !q->closed && timeout_ms != 0) {
                int rc = timeout_ms < 0 ? pthread_cond_wait(&q->nonempty, &q->mu)
                                        : pthread_cond_timedwait(&q->nonempty, &q->mu, &deadline);
                if (rc == ETIMEDOUT)
                        break;
        }
        item = pop_locked(q);
        pthread_mutex_unlock(&q->mu);
        return item;
}

int tsr_queue_fd(const tsr_queue *q) { return q->efd; }

void tsr_queue_ack_fd(tsr_queue *q) {
        uint64_t v;
        ssize_t n = read(q->efd, &v, sizeof(v));
        (void)n;
}

void tsr_queue_close(tsr_queue *q) {
        pthread_mutex_lock(&q->mu);
        q->closed = true;
        pthread_cond_broadcast(&q->nonempty);
        pthread_mutex_unlock(&q->mu);
        signal_fd(q);
}

size_t tsr_queue_len(tsr_queue *q) {
        size_t n;
        pthread_mutex_lock(&q->mu);
        n = q->len;
        pthread_mutex_unlock(&q->mu);
        return n;
}
