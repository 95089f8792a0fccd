/* kvpool-impl.h — private to scheduler/: the pool's data structures, shared by
 * kvpool.c (blocks, lines, index, tiers) and spill.c (the snapshot file). */
#ifndef KVL_KVPOOL_IMPL_H
#define KVL_KVPOOL_IMPL_H

#include <pthread.h>
#include <sys/types.h>

#include "kvl_kvpool.h"

#define BLK KVL_KV_BLOCK
#define NONE (-1)

/* A block handle: the identity of 16 positions' K/V, wherever the data is. */
struct blk {
  bool used;                  /* handle allocated */
  int32_t refs;               /* lines holding it */
  int32_t hot, cold, disk;    /* slot in the hot arena / cold tier / disk tier, or NONE (exactly one) */
  int32_t io;                 /* a read from disk in flight: the hot slot reserved for it, else NONE */
  bool indexed;               /* in the prefix index: full, committed, never written again */
  uint64_t key;               /* chain key: H(parent key, tokens, writers) (when indexed) */
  uint64_t parent;            /* the parent's chain key (when indexed) */
  int32_t tokens[BLK];        /* content description, for exact index matches */
  kvl_writer_t writers[BLK];
  int32_t prev, next;         /* LRU links (cached blocks: refs == 0 && indexed) */
};

struct lru { int32_t head, tail, n; }; /* head = least recently used */

struct run { int32_t start, len; kvl_writer_t w; };

struct kvl_line {
  kvl_pool_t *p;
  int32_t len;
  int32_t *tok;         /* [cap_tok] */
  int32_t cap_tok;
  struct run *runs;     /* writer runs, in order, covering 0..len */
  int32_t n_runs, cap_runs;
  int32_t *blocks;      /* handles, one per started block */
  int32_t *table;       /* their hot slots (valid when the line is hot) */
  int32_t n_blocks, cap_blocks;
  kvl_line_t *prev, *next; /* the pool's list of lines (for the checker) */
};

/* The disk tier's I/O (diskio.c): one thread, a FIFO of operations, a done list. */
struct io_op {
  struct io_op *next;
  bool read;                  /* else a write */
  bool ok;                    /* set by the I/O thread */
  int32_t slot, h;            /* disk slot; the block it was asked for */
  int32_t stage;              /* write: its staging buffer */
  uint8_t *dst;               /* read: the reserved hot slot's memory */
};

struct kvl_diskio {
  pthread_t thread;
  bool started, sync_ready, quit, hold;
  pthread_mutex_t mu;
  pthread_cond_t work, done_cv;
  struct io_op *q_head, *q_tail;       /* submitted (under mu) */
  struct io_op *done_head, *done_tail; /* finished, not yet applied (under mu) */
  int32_t in_flight;                   /* submitted and not yet applied (compute thread) */
  int fd;
  size_t bb;
  uint8_t *stage_mem;                  /* the write-behind: n_stage block buffers */
  int32_t n_stage, n_stage_free, *stage_free;
  int32_t *slot_stage;                 /* disk slot -> the stage of its owner's pending write, or NONE */
};

struct ientry { uint64_t bucket; int32_t h; }; /* h: handle, NONE = empty, -2 = deleted */

struct kvl_pool {
  struct kvl_kv_layout layout;
  size_t bb;                      /* bytes per block */
  uint8_t *hot_mem, *cold_mem;
  size_t hot_mapped;              /* hot_mem's size for kvl_huge_free */
  kvl_backend_t *pinned_by;       /* kvl_pool_pin's backend, or NULL */
  bool hot_pinned;
  int32_t n_hot, n_cold;
  int32_t *hot_owner, *cold_owner; /* slot -> handle or NONE */
  int32_t *hot_free, *cold_free;   /* stacks of free slots */
  uint64_t *hot_stamp;            /* per hot slot: a new kvl_kv_stamp_new() at each write by the pool or
                                     through kvl_pool_written (a device backend's copy of the arena) */
  int32_t n_hot_free, n_cold_free;
  struct blk *blk;
  int32_t n_blk, cap_blk;
  int32_t *blk_free;
  int32_t n_blk_free;
  struct lru hot_lru, cold_lru, disk_lru;
  int disk_fd;                    /* the disk tier's file (unlinked when opened), or -1 */
  int32_t n_disk, n_disk_free;
  int32_t *disk_owner, *disk_free;
  struct kvl_diskio io;           /* the disk tier's I/O thread (when there is a disk tier) */
  struct ientry *idx;
  size_t idx_cap, idx_used;       /* used counts deleted entries too */
  kvl_line_t *lines;
  int32_t n_lines;
  struct kvl_pool_stats st;
};


/* Internals shared between the module's files (kvl__ prefix, STYLE.md §1). */
uint64_t kvl__key_of(uint64_t parent, const int32_t *tok, const kvl_writer_t *w);
int32_t kvl__pool_blk_new(kvl_pool_t *p);
int kvl__idx_insert(kvl_pool_t *p, int32_t h);
void kvl__lru_push(kvl_pool_t *p, struct lru *l, int32_t h);
/* A block's K/V bytes wherever they are (a disk block is read into tmp, synchronously:
 * the snapshot at shutdown only); NULL when a disk read fails. */
const uint8_t *kvl__blk_data(kvl_pool_t *p, int32_t h, uint8_t *tmp);

/* diskio.c */
int kvl__io_start(struct kvl_diskio *io, int fd, size_t bb, int32_t n_slots, int32_t n_stage);
void kvl__io_stop(struct kvl_diskio *io);
/* Queue a write of data (copied into a staging buffer) to a disk slot; false when the
 * write-behind is full (or out of memory): nothing queued then. */
bool kvl__io_write(struct kvl_diskio *io, int32_t h, int32_t slot, const uint8_t *data);
/* Queue a read of a disk slot into dst (a reserved hot slot); false when out of memory. */
bool kvl__io_read(struct kvl_diskio *io, int32_t h, int32_t slot, uint8_t *dst);
/* The bytes of the slot owner's write still in flight, or NULL. */
const uint8_t *kvl__io_staged(const struct kvl_diskio *io, int32_t slot);
/* Finished operations, in order (the caller applies and frees them); wait: block until at
 * least one finished (timeout_ms < 0: no limit) when any is in flight. */
struct io_op *kvl__io_take_done(struct kvl_diskio *io, bool wait, int timeout_ms);
void kvl__io_hold(struct kvl_diskio *io, bool hold);
bool kvl__disk_pread(int fd, uint8_t *buf, size_t n, off_t off);

#endif
