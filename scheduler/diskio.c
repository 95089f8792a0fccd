/* diskio.c — the disk tier's I/O thread (DESIGN.md: the compute thread never does I/O).
 *
 * The compute thread queues two kinds of operation and never waits for them:
 *   write: a block leaving the cold tier is copied into one of a bounded set of staging
 *          buffers (the write-behind), and the thread pwrites it to its disk slot; until
 *          then a lookup that wants the block takes it from the staging buffer;
 *   read:  kvl_pool_prefetch asks for a disk block back into a hot slot reserved for it.
 * One thread takes operations in submission order (so a slot's writes and reads land in
 * the order they were asked for) and hands them back on a done list; the compute thread
 * applies them to the pool's bookkeeping (kvpool.c, kvl_pool_io_poll) when it polls. Only
 * the compute thread touches the pool's state; this thread touches only the file, the
 * staging buffers it was given and the hot slots reserved for its reads. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvpool-impl.h"

static bool full_pwrite(int fd, const uint8_t *buf, size_t n, off_t off) {
  for (size_t done = 0; done < n;) {
    ssize_t k = pwrite(fd, buf + done, n - done, off + (off_t)done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    done += (size_t)k;
  }
  return true;
}

bool kvl__disk_pread(int fd, uint8_t *buf, size_t n, off_t off) {
  for (size_t done = 0; done < n;) {
    ssize_t k = pread(fd, buf + done, n - done, off + (off_t)done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false; /* an error, or a file cut short */
    done += (size_t)k;
  }
  return true;
}

static void *io_main(void *arg) {
  struct kvl_diskio *io = arg;
  pthread_mutex_lock(&io->mu);
  for (;;) {
    while ((!io->q_head || io->hold) && !io->quit) pthread_cond_wait(&io->work, &io->mu);
    if (!io->q_head) break; /* quit, and nothing left */
    struct io_op *op = io->q_head;
    io->q_head = op->next;
    if (!io->q_head) io->q_tail = NULL;
    pthread_mutex_unlock(&io->mu);
    off_t off = (off_t)op->slot * (off_t)io->bb;
    op->ok = op->read ? kvl__disk_pread(io->fd, op->dst, io->bb, off)
                      : full_pwrite(io->fd, io->stage_mem + (size_t)op->stage * io->bb, io->bb, off);
    pthread_mutex_lock(&io->mu);
    op->next = NULL;
    if (io->done_tail) io->done_tail->next = op; else io->done_head = op;
    io->done_tail = op;
    pthread_cond_broadcast(&io->done_cv);
  }
  pthread_mutex_unlock(&io->mu);
  return NULL;
}

int kvl__io_start(struct kvl_diskio *io, int fd, size_t bb, int32_t n_slots, int32_t n_stage) {
  memset(io, 0, sizeof(*io));
  io->fd = fd;
  io->bb = bb;
  io->n_stage = n_stage;
  io->stage_mem = malloc((size_t)n_stage * bb);
  io->stage_free = malloc((size_t)n_stage * sizeof(int32_t));
  io->slot_stage = malloc((size_t)n_slots * sizeof(int32_t));
  if (!io->stage_mem || !io->stage_free || !io->slot_stage) return KVL_ENOMEM;
  for (int32_t i = 0; i < n_stage; i++) io->stage_free[i] = n_stage - 1 - i;
  io->n_stage_free = n_stage;
  for (int32_t i = 0; i < n_slots; i++) io->slot_stage[i] = NONE;
  pthread_mutex_init(&io->mu, NULL);
  pthread_cond_init(&io->work, NULL);
  pthread_cond_init(&io->done_cv, NULL);
  io->sync_ready = true;
  if (pthread_create(&io->thread, NULL, io_main, io) != 0) return KVL_ENOMEM;
  io->started = true;
  return 0;
}

/* Finish what was queued (a write or read in flight may touch memory the pool is about to
 * free), then let the thread go. Operations never applied are simply released. */
void kvl__io_stop(struct kvl_diskio *io) {
  if (io->started) {
    pthread_mutex_lock(&io->mu);
    io->quit = true;
    io->hold = false;
    pthread_cond_signal(&io->work);
    pthread_mutex_unlock(&io->mu);
    pthread_join(io->thread, NULL);
    io->started = false;
  }
  for (struct io_op *op = io->done_head, *next; op; op = next) {
    next = op->next;
    free(op);
  }
  io->done_head = io->done_tail = NULL;
  if (io->sync_ready) {
    pthread_mutex_destroy(&io->mu);
    pthread_cond_destroy(&io->work);
    pthread_cond_destroy(&io->done_cv);
    io->sync_ready = false;
  }
  free(io->stage_mem);
  free(io->stage_free);
  free(io->slot_stage);
  io->stage_mem = NULL;
  io->stage_free = io->slot_stage = NULL;
}

void kvl__io_hold(struct kvl_diskio *io, bool hold) {
  if (!io->started) return;
  pthread_mutex_lock(&io->mu);
  io->hold = hold;
  pthread_cond_signal(&io->work);
  pthread_mutex_unlock(&io->mu);
}

static void submit(struct kvl_diskio *io, struct io_op *op) {
  op->next = NULL;
  pthread_mutex_lock(&io->mu);
  if (io->q_tail) io->q_tail->next = op; else io->q_head = op;
  io->q_tail = op;
  pthread_cond_signal(&io->work);
  pthread_mutex_unlock(&io->mu);
  io->in_flight++;
}

bool kvl__io_write(struct kvl_diskio *io, int32_t h, int32_t slot, const uint8_t *data) {
  if (!io->n_stage_free) return false; /* the write-behind is full */
  struct io_op *op = calloc(1, sizeof(*op));
  if (!op) return false;
  op->stage = io->stage_free[--io->n_stage_free];
  op->slot = slot;
  op->h = h;
  memcpy(io->stage_mem + (size_t)op->stage * io->bb, data, io->bb);
  io->slot_stage[slot] = op->stage; /* the slot's newest bytes, until written */
  submit(io, op);
  return true;
}

bool kvl__io_read(struct kvl_diskio *io, int32_t h, int32_t slot, uint8_t *dst) {
  struct io_op *op = calloc(1, sizeof(*op));
  if (!op) return false;
  op->read = true;
  op->slot = slot;
  op->h = h;
  op->stage = NONE;
  op->dst = dst;
  submit(io, op);
  return true;
}

const uint8_t *kvl__io_staged(const struct kvl_diskio *io, int32_t slot) {
  if (!io->slot_stage || io->slot_stage[slot] == NONE) return NULL;
  return io->stage_mem + (size_t)io->slot_stage[slot] * io->bb;
}

struct io_op *kvl__io_take_done(struct kvl_diskio *io, bool wait, int timeout_ms) {
  if (!io->started || !io->in_flight) return NULL;
  pthread_mutex_lock(&io->mu);
  if (wait && !io->done_head) {
    if (timeout_ms < 0) {
      while (!io->done_head) pthread_cond_wait(&io->done_cv, &io->mu);
    } else {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += timeout_ms / 1000;
      ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
      if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
      while (!io->done_head && pthread_cond_timedwait(&io->done_cv, &io->mu, &ts) == 0) {}
    }
  }
  struct io_op *list = io->done_head;
  io->done_head = io->done_tail = NULL;
  pthread_mutex_unlock(&io->mu);
  return list;
}
