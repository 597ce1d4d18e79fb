/* queue.h - bounded multi-producer single-consumer queue of pointers, for handing
 * messages between threads (worker io <-> engine).
 *
 * A full queue is an answer, not a reason to grow: push returns TSR_E_UNAVAILABLE
 * and the producer turns that into backpressure (every queue has a bound).  The consumer can
 * sleep in tsr_queue_pop_wait, or poll tsr_queue_fd() (an eventfd) together with
 * its sockets, e.g. as a zmq_pollitem_t with .fd set.
 *
 * Ownership: items are opaque; a pushed item belongs to the queue until popped.
 * tsr_queue_free does not free items left inside (pop them first). */
#ifndef TSR_QUEUE_H
#define TSR_QUEUE_H

#include <stddef.h>
#include <stdint.h>
#include "tsr_status.h"

typedef struct tsr_queue tsr_queue;

/* `capacity` >= 1.  *ret is written only on success. */
tsr_status tsr_queue_new(size_t capacity, tsr_queue **ret);
void tsr_queue_free(tsr_queue **q);

/* Any thread.  TSR_OK, TSR_E_UNAVAILABLE when full, TSR_E_CLOSED after close. */
tsr_status tsr_queue_push(tsr_queue *q, void *item);
/* Consumer thread.  The oldest item, or NULL when empty. */
void *tsr_queue_pop(tsr_queue *q);
/* Consumer thread.  Waits up to timeout_ms (-1 = forever) for an item; NULL on
 * timeout, or when the queue is closed and empty. */
void *tsr_queue_pop_wait(tsr_queue *q, int64_t timeout_ms);
/* Readable while items may be waiting.  The consumer calls tsr_queue_ack_fd() once
 * woken, then pops until NULL (the fd is re-armed by every later push). */
int tsr_queue_fd(const tsr_queue *q);
void tsr_queue_ack_fd(tsr_queue *q);
/* Refuse further pushes and wake every waiter.  Items already queued stay poppable. */
void tsr_queue_close(tsr_queue *q);
size_t tsr_queue_len(tsr_queue *q);

#endif
