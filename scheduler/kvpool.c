/* kvpool.c — the paged KV pool: block handles, hot/cold slots, lines with provenance,
 * the provenance-aware prefix index, and the sanity checker. See kvl_kvpool.h. */
#include <fcntl.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvpool-impl.h"

/* ---- hashing --------------------------------------------------------------------- */

static uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 29);
}

/* Index bucket: parent chain key + tokens (writers are not part of it, so a lookup finds
 * the native and translated variants of the same tokens together). */
static uint64_t bucket_of(uint64_t parent, const int32_t *tok) {
  uint64_t h = mix(0x6b766c696e676f31ull, parent);
  for (int i = 0; i < BLK; i++) h = mix(h, (uint32_t)tok[i]);
  return h | 1; /* never 0 */
}

/* Chain key: the bucket plus the writers (provenance is part of a block's identity). */
uint64_t kvl__key_of(uint64_t parent, const int32_t *tok, const kvl_writer_t *w) {
  uint64_t h = bucket_of(parent, tok);
  for (int i = 0; i < BLK; i++) h = mix(h, w[i]);
  return h | 1;
}

static const uint64_t ROOT_KEY = 0x726f6f74ull; /* parent of a line's first block */

/* ---- small helpers ----------------------------------------------------------------- */

static void *grow(void *p, int32_t *cap, int32_t need, size_t elem) {
  if (need <= *cap) return p;
  int32_t nc = *cap ? *cap : 8;
  while (nc < need) nc *= 2;
  void *q = realloc(p, (size_t)nc * elem);
  if (q) *cap = nc;
  return q;
}

static void lru_remove(kvl_pool_t *p, struct lru *l, int32_t h) {
  struct blk *b = &p->blk[h];
  if (b->prev != NONE) p->blk[b->prev].next = b->next; else l->head = b->next;
  if (b->next != NONE) p->blk[b->next].prev = b->prev; else l->tail = b->prev;
  b->prev = b->next = NONE;
  l->n--;
}

void kvl__lru_push(kvl_pool_t *p, struct lru *l, int32_t h) { /* most recently used end */
  struct blk *b = &p->blk[h];
  b->prev = l->tail;
  b->next = NONE;
  if (l->tail != NONE) p->blk[l->tail].next = h; else l->head = h;
  l->tail = h;
  l->n++;
}

static struct lru *lru_of(kvl_pool_t *p, const struct blk *b) {
  return b->hot != NONE ? &p->hot_lru : b->cold != NONE ? &p->cold_lru : &p->disk_lru;
}

/* ---- the index (open addressing multimap on bucket) ---------------------------------- */

static int idx_rebuild(kvl_pool_t *p, size_t cap) {
  struct ientry *old = p->idx;
  size_t oc = p->idx_cap;
  p->idx = malloc(cap * sizeof(*p->idx));
  if (!p->idx) { p->idx = old; return KVL_ENOMEM; }
  for (size_t i = 0; i < cap; i++) p->idx[i] = (struct ientry){0, NONE};
  p->idx_cap = cap;
  p->idx_used = 0;
  for (size_t i = 0; i < oc; i++)
    if (old[i].h >= 0) {
      size_t j = old[i].bucket & (cap - 1);
      while (p->idx[j].h != NONE) j = (j + 1) & (cap - 1);
      p->idx[j] = old[i];
      p->idx_used++;
    }
  free(old);
  return 0;
}

int kvl__idx_insert(kvl_pool_t *p, int32_t h) {
  if ((p->idx_used + 1) * 10 > p->idx_cap * 7) {
    int rc = idx_rebuild(p, p->idx_cap * 2);
    if (rc) return rc;
  }
  uint64_t bk = bucket_of(p->blk[h].parent, p->blk[h].tokens);
  size_t j = bk & (p->idx_cap - 1);
  while (p->idx[j].h >= 0) j = (j + 1) & (p->idx_cap - 1);
  if (p->idx[j].h == NONE) p->idx_used++;
  p->idx[j] = (struct ientry){bk, h};
  return 0;
}

static void idx_delete(kvl_pool_t *p, int32_t h) {
  uint64_t bk = bucket_of(p->blk[h].parent, p->blk[h].tokens);
  for (size_t j = bk & (p->idx_cap - 1); p->idx[j].h != NONE; j = (j + 1) & (p->idx_cap - 1))
    if (p->idx[j].h == h) { p->idx[j].h = -2; return; }
  KVL_ASSERT(!"indexed block missing from the index");
}

/* The indexed block continuing `parent` with these tokens: the native variant if there is
 * one, else (policy ANY) the first translated one. */
static int32_t idx_find(const kvl_pool_t *p, uint64_t parent, const int32_t *tok, enum kvl_reuse policy) {
  uint64_t bk = bucket_of(parent, tok);
  int32_t translated = NONE;
  for (size_t j = bk & (p->idx_cap - 1); p->idx[j].h != NONE; j = (j + 1) & (p->idx_cap - 1)) {
    int32_t h = p->idx[j].h;
    if (h < 0 || p->idx[j].bucket != bk) continue;
    const struct blk *b = &p->blk[h];
    if (b->parent != parent || memcmp(b->tokens, tok, sizeof(b->tokens))) continue;
    bool native = true;
    for (int i = 0; i < BLK; i++) native &= b->writers[i] == KVL_WRITER_NATIVE;
    if (native) return h;
    if (translated == NONE) translated = h;
  }
  return policy == KVL_REUSE_ANY ? translated : NONE;
}

/* ---- handles and slots ---------------------------------------------------------------- */

int32_t kvl__pool_blk_new(kvl_pool_t *p) {
  int32_t h;
  if (p->n_blk_free) {
    h = p->blk_free[--p->n_blk_free];
  } else {
    struct blk *nb = grow(p->blk, &p->cap_blk, p->n_blk + 1, sizeof(*p->blk));
    if (!nb) return KVL_ENOMEM;
    p->blk = nb;
    int32_t *nf = realloc(p->blk_free, (size_t)p->cap_blk * sizeof(int32_t));
    if (!nf) return KVL_ENOMEM;
    p->blk_free = nf;
    h = p->n_blk++;
  }
  p->blk[h] = (struct blk){.used = true, .hot = NONE, .cold = NONE, .disk = NONE, .io = NONE, .prev = NONE, .next = NONE};
  return h;
}

/* Forget a handle entirely: its slots are freed and it leaves the index. */
static void blk_drop(kvl_pool_t *p, int32_t h) {
  struct blk *b = &p->blk[h];
  KVL_ASSERT(b->used && b->refs == 0 && b->io == NONE);
  if (b->indexed) idx_delete(p, h);
  if (b->hot != NONE) { p->hot_owner[b->hot] = NONE; p->hot_free[p->n_hot_free++] = b->hot; }
  if (b->cold != NONE) { p->cold_owner[b->cold] = NONE; p->cold_free[p->n_cold_free++] = b->cold; }
  if (b->disk != NONE) {
    p->io.slot_stage[b->disk] = NONE; /* a write still in flight finishes for nobody */
    p->disk_owner[b->disk] = NONE;
    p->disk_free[p->n_disk_free++] = b->disk;
  }
  b->used = false;
  p->blk_free[p->n_blk_free++] = h;
}

/* A hot slot's host bytes, for the pool to read or write: copies into them that the
 * pinning backend left running (kvl_pool_host_sync) waited for first. */
static uint8_t *hot_data(kvl_pool_t *p, int32_t slot) {
  uint8_t *d = p->hot_mem + (size_t)slot * p->bb;
  if (p->hot_pinned) kvl_backend_host_sync(p->pinned_by, d, p->bb);
  return d;
}
/* A hot slot's bytes are (about to be) written by the pool: a device's copy of it is old. */
static void hot_written(kvl_pool_t *p, int32_t slot) { p->hot_stamp[slot] = kvl_kv_stamp_new(); }
/* A slot handed out to a new block: nothing of it is read before the forward writes it. */
static void hot_fresh(kvl_pool_t *p, int32_t slot) { p->hot_stamp[slot] = kvl_kv_stamp_fresh(); }
static uint8_t *cold_data(kvl_pool_t *p, int32_t slot) { return p->cold_mem + (size_t)slot * p->bb; }

static off_t disk_off(const kvl_pool_t *p, int32_t slot) { return (off_t)slot * (off_t)p->bb; }

const uint8_t *kvl__blk_data(kvl_pool_t *p, int32_t h, uint8_t *tmp) {
  const struct blk *b = &p->blk[h];
  if (b->hot != NONE) return hot_data(p, b->hot);
  if (b->cold != NONE) return cold_data(p, b->cold);
  const uint8_t *staged = kvl__io_staged(&p->io, b->disk);
  if (staged) return staged;
  return kvl__disk_pread(p->disk_fd, tmp, p->bb, disk_off(p, b->disk)) ? tmp : NULL;
}

/* Move a cached cold block to the disk tier (dropping the disk tier's least recently
 * used block if full), or drop it when there is no disk tier or the write-behind is full.
 * The write itself is queued to the I/O thread: its bytes stay in a staging buffer until
 * written, and a failed write drops the block then (kvl_pool_io_poll). */
static void cold_to_disk(kvl_pool_t *p, int32_t h) {
  struct blk *b = &p->blk[h];
  int32_t d = NONE;
  if (p->n_disk_free) d = p->disk_free[--p->n_disk_free];
  else if (p->disk_lru.head != NONE) {
    int32_t victim = p->disk_lru.head;
    lru_remove(p, &p->disk_lru, victim);
    blk_drop(p, victim);
    p->st.dropped++;
    d = p->disk_free[--p->n_disk_free];
  }
  if (d != NONE && !kvl__io_write(&p->io, h, d, cold_data(p, b->cold))) {
    p->disk_free[p->n_disk_free++] = d;
    p->st.disk_busy++;
    d = NONE;
  }
  if (d == NONE) {
    blk_drop(p, h);
    p->st.dropped++;
    return;
  }
  p->disk_owner[d] = h;
  p->cold_owner[b->cold] = NONE;
  p->cold_free[p->n_cold_free++] = b->cold;
  b->cold = NONE;
  b->disk = d;
  kvl__lru_push(p, &p->disk_lru, h);
  p->st.spilled_to_disk++;
}

/* A free cold slot, passing the least recently used cold cached block on to the disk
 * tier (or dropping it) if needed. */
static int32_t cold_slot(kvl_pool_t *p) {
  if (p->n_cold_free) return p->cold_free[--p->n_cold_free];
  if (p->cold_lru.head == NONE) return NONE;
  int32_t victim = p->cold_lru.head;
  lru_remove(p, &p->cold_lru, victim);
  cold_to_disk(p, victim);
  return p->cold_free[--p->n_cold_free];
}

/* Move a hot block to the cold tier (or drop it when it is cached and no cold room). */
static int to_cold(kvl_pool_t *p, int32_t h, bool may_drop) {
  struct blk *b = &p->blk[h];
  int32_t c = cold_slot(p);
  if (c == NONE) {
    if (!may_drop) return KVL_EFULL;
    blk_drop(p, h);
    p->st.dropped++;
    return 0;
  }
  memcpy(cold_data(p, c), hot_data(p, b->hot), p->bb);
  p->cold_owner[c] = h;
  p->hot_owner[b->hot] = NONE;
  p->hot_free[p->n_hot_free++] = b->hot;
  b->hot = NONE;
  b->cold = c;
  p->st.evicted_to_cold++;
  return 0;
}

/* A free hot slot, evicting the least recently used cached hot block if needed. */
static int32_t hot_slot(kvl_pool_t *p) {
  if (!p->n_hot_free) {
    if (p->hot_lru.head == NONE) return NONE;
    int32_t victim = p->hot_lru.head;
    lru_remove(p, &p->hot_lru, victim);
    to_cold(p, victim, true);
    if (p->blk[victim].used) kvl__lru_push(p, &p->cold_lru, victim);
  }
  return p->hot_free[--p->n_hot_free];
}

/* Bring a cold block back, or a disk block whose write is still in flight (from its
 * staging buffer: no I/O); the caller made sure a hot slot can be had. */
static int restore_blk(kvl_pool_t *p, int32_t h) {
  struct blk *b = &p->blk[h];
  int32_t s = hot_slot(p);
  if (s == NONE) return KVL_EFULL;
  if (b->disk != NONE) {
    const uint8_t *staged = kvl__io_staged(&p->io, b->disk);
    KVL_ASSERT(staged && b->io == NONE);
    memcpy(hot_data(p, s), staged, p->bb);
    p->io.slot_stage[b->disk] = NONE;
    p->disk_owner[b->disk] = NONE;
    p->disk_free[p->n_disk_free++] = b->disk;
    b->disk = NONE;
    p->st.restored_from_disk++;
  } else {
    memcpy(hot_data(p, s), cold_data(p, b->cold), p->bb);
    p->cold_owner[b->cold] = NONE;
    p->cold_free[p->n_cold_free++] = b->cold;
    b->cold = NONE;
  }
  p->hot_owner[s] = h;
  hot_written(p, s);
  b->hot = s;
  p->st.restored++;
  return 0;
}

static void ref(kvl_pool_t *p, int32_t h) {
  struct blk *b = &p->blk[h];
  if (b->refs++ == 0 && b->indexed) lru_remove(p, lru_of(p, b), h);
}

static void unref(kvl_pool_t *p, int32_t h) {
  struct blk *b = &p->blk[h];
  KVL_ASSERT(b->refs > 0);
  if (--b->refs) return;
  if (b->indexed) kvl__lru_push(p, lru_of(p, b), h); /* cached: evictable, findable */
  else blk_drop(p, h);
}

/* ---- pool ------------------------------------------------------------------------------ */

int kvl_pool_new(const struct kvl_pool_config *c, kvl_pool_t **out) {
  *out = NULL;
  kvl_pool_t *p = calloc(1, sizeof(*p));
  if (!p) return KVL_ENOMEM;
  p->layout = c->layout;
  p->bb = kvl_kv_block_bytes(&c->layout);
  if (p->bb == 0) { free(p); return KVL_EINVAL; }
  size_t nh = c->hot_bytes / p->bb, nc = c->cold_bytes / p->bb;
  if (nh < 1 || nh > INT32_MAX / 2 || nc > INT32_MAX / 2) { free(p); return KVL_EINVAL; }
  p->n_hot = (int32_t)nh;
  p->n_cold = (int32_t)nc;
  /* in 2 MiB pages where the kernel gives them: attention at depth and translation read
   * a layer's rows from blocks all over the arena, and with 4 KiB pages every block's
   * slab was its own TLB entry (and its own fault, zeroing, on first use) */
  p->hot_mem = nh <= SIZE_MAX / p->bb ? kvl_huge_alloc(nh * p->bb, &p->hot_mapped) : NULL;
  p->cold_mem = nc ? malloc(nc * p->bb) : NULL;
  p->hot_owner = malloc(nh * sizeof(int32_t));
  p->hot_free = malloc(nh * sizeof(int32_t));
  p->hot_stamp = malloc(nh * sizeof(uint64_t));
  p->cold_owner = malloc((nc + 1) * sizeof(int32_t));
  p->cold_free = malloc((nc + 1) * sizeof(int32_t));
  if (!p->hot_mem || (nc && !p->cold_mem) || !p->hot_owner || !p->hot_free || !p->hot_stamp || !p->cold_owner ||
      !p->cold_free || idx_rebuild(p, 64) < 0) {
    kvl_pool_free(p);
    return KVL_ENOMEM;
  }
  if (c->prefault) p->st.prefault_ms = kvl_huge_prefault(p->hot_mem, nh * p->bb);
  for (int32_t i = 0; i < p->n_hot; i++) {
    p->hot_owner[i] = NONE;
    p->hot_free[i] = p->n_hot - 1 - i;
    hot_fresh(p, i);
  }
  for (int32_t i = 0; i < p->n_cold; i++) { p->cold_owner[i] = NONE; p->cold_free[i] = p->n_cold - 1 - i; }
  p->n_hot_free = p->n_hot;
  p->n_cold_free = p->n_cold;
  p->hot_lru = p->cold_lru = p->disk_lru = (struct lru){NONE, NONE, 0};
  p->disk_fd = -1;
  size_t nd = c->disk_path && c->disk_bytes ? c->disk_bytes / p->bb : 0;
  if (nd > INT32_MAX / 2) nd = INT32_MAX / 2;
  if (nd) {
    /* unlinked as soon as it is open: the tier is this process's scratch (what survives a
     * restart is the shutdown snapshot, kvl_pool_save), so a process that dies without
     * freeing the pool (the OOM killer, SIGKILL) leaves no file behind, and a second one
     * given the same path (two daemons with one pid in different containers, one volume)
     * gets a file of its own instead of truncating a live one */
    p->disk_fd = open(c->disk_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (p->disk_fd >= 0) unlink(c->disk_path);
    p->disk_owner = malloc(nd * sizeof(int32_t));
    p->disk_free = malloc(nd * sizeof(int32_t));
    if (p->disk_fd < 0 || !p->disk_owner || !p->disk_free) {
      int rc = p->disk_fd < 0 ? KVL_EIO : KVL_ENOMEM;
      kvl_pool_free(p);
      return rc;
    }
    p->n_disk = (int32_t)nd;
    for (int32_t i = 0; i < p->n_disk; i++) { p->disk_owner[i] = NONE; p->disk_free[i] = p->n_disk - 1 - i; }
    p->n_disk_free = p->n_disk;
    int32_t n_stage = c->disk_writeback_blocks > 0 ? c->disk_writeback_blocks : KVL_DISK_WRITEBACK_DEFAULT;
    int rc = kvl__io_start(&p->io, p->disk_fd, p->bb, p->n_disk, n_stage);
    if (rc < 0) {
      kvl_pool_free(p);
      return rc;
    }
  }
  *out = p;
  return 0;
}

void kvl_pool_free(kvl_pool_t *p) {
  if (!p) return;
  KVL_ASSERT(p->n_lines == 0);
  kvl__io_stop(&p->io); /* its reads land in hot slots: stop it before the arena goes */
  if (p->hot_mem) kvl_kv_pool_gone(p->hot_mem); /* a device's copy of the arena goes with it */
  if (p->hot_pinned) kvl_backend_host_unregister(p->pinned_by, p->hot_mem);
  kvl_huge_free(p->hot_mem, p->hot_mapped);
  free(p->cold_mem);
  free(p->hot_owner);
  free(p->hot_free);
  free(p->hot_stamp);
  free(p->cold_owner);
  free(p->cold_free);
  if (p->disk_fd >= 0) close(p->disk_fd);
  free(p->disk_owner);
  free(p->disk_free);
  free(p->blk);
  free(p->blk_free);
  free(p->idx);
  free(p);
}

bool kvl_pool_pin(kvl_pool_t *p, kvl_backend_t *be) {
  KVL_ASSERT(!p->pinned_by);
  p->pinned_by = be;
  p->hot_pinned = kvl_backend_host_register(be, p->hot_mem, (size_t)p->n_hot * p->bb);
  return p->hot_pinned;
}

void kvl_pool_host_sync(kvl_pool_t *p, kvl_backend_t *reader) {
  if (p->hot_pinned && reader != p->pinned_by) kvl_backend_host_sync(p->pinned_by, NULL, 0);
}

void *kvl_pool_base(kvl_pool_t *p) { return p->hot_mem; }
uint64_t *kvl_pool_stamps(kvl_pool_t *p) { return p->hot_stamp; }
int32_t kvl_pool_hot_blocks(const kvl_pool_t *p) { return p->n_hot; }

void kvl_line_written(kvl_line_t *l, int32_t from, int32_t to) {
  KVL_ASSERT(kvl_line_is_hot(l) && from >= 0 && to <= l->len);
  for (int32_t i = from / BLK; i < l->n_blocks && i * BLK < to; i++) hot_written(l->p, l->p->blk[l->blocks[i]].hot);
}
const struct kvl_kv_layout *kvl_pool_layout(const kvl_pool_t *p) { return &p->layout; }
int32_t kvl_pool_available(const kvl_pool_t *p) { return p->n_hot_free + p->hot_lru.n; }

void kvl_pool_stats(const kvl_pool_t *p, struct kvl_pool_stats *s) {
  *s = p->st;
  s->hot_blocks = p->n_hot;
  s->hot_cached = p->hot_lru.n;
  s->hot_used = p->n_hot - p->n_hot_free - p->hot_lru.n;
  s->cold_blocks = p->n_cold;
  s->cold_used = p->n_cold - p->n_cold_free;
  s->disk_blocks = p->n_disk;
  s->disk_used = p->n_disk - p->n_disk_free;
  s->disk_in_flight = p->io.in_flight;
}

/* ---- the disk tier's I/O, applied on this (the compute) thread ------------------------------ */

/* A block whose disk I/O failed: forgotten, its slot never trusted. */
static void disk_lost(kvl_pool_t *p, int32_t h) {
  blk_drop(p, h);
  p->st.dropped++;
  p->st.disk_errors++;
}

static void io_apply(kvl_pool_t *p, struct io_op *op) {
  struct kvl_diskio *io = &p->io;
  io->in_flight--;
  if (!op->read) {
    io->stage_free[io->n_stage_free++] = op->stage;
    if (io->slot_stage[op->slot] != op->stage) return; /* its block left (restored, dropped) */
    io->slot_stage[op->slot] = NONE;
    int32_t h = p->disk_owner[op->slot];
    if (op->ok || h == NONE) return;
    lru_remove(p, &p->disk_lru, h); /* the owner's bytes never reached the file */
    disk_lost(p, h);
    return;
  }
  struct blk *b = &p->blk[op->h];
  KVL_ASSERT(b->used && b->disk == op->slot && b->io != NONE && b->refs == 0);
  int32_t s = b->io;
  b->io = NONE;
  if (!op->ok) { /* unreadable: the block is forgotten, and a chain through it ends there */
    p->hot_owner[s] = NONE;
    p->hot_free[p->n_hot_free++] = s;
    disk_lost(p, op->h);
    return;
  }
  p->disk_owner[b->disk] = NONE;
  p->disk_free[p->n_disk_free++] = b->disk;
  b->disk = NONE;
  b->hot = s; /* a cached hot block now: attach shares it as it is */
  hot_written(p, s);
  kvl__lru_push(p, &p->hot_lru, op->h);
  p->st.restored_from_disk++;
  p->st.restored++;
}

static void io_apply_all(kvl_pool_t *p, struct io_op *list) {
  for (struct io_op *op = list, *next; op; op = next) {
    next = op->next;
    io_apply(p, op);
    free(op);
  }
}

void kvl_pool_io_poll(kvl_pool_t *p) { io_apply_all(p, kvl__io_take_done(&p->io, false, 0)); }

bool kvl_pool_io_wait(kvl_pool_t *p, int timeout_ms) {
  if (!p->io.in_flight) return false;
  io_apply_all(p, kvl__io_take_done(&p->io, true, timeout_ms));
  return true;
}

void kvl_pool_io_hold(kvl_pool_t *p, bool hold) { kvl__io_hold(&p->io, hold); }

void kvl_pool_io_drain(kvl_pool_t *p) {
  while (p->io.in_flight) io_apply_all(p, kvl__io_take_done(&p->io, true, -1));
}

int32_t kvl_pool_prefetch(kvl_pool_t *p, const int32_t *tokens, int32_t n, enum kvl_reuse policy) {
  if (p->disk_fd < 0) return 0;
  kvl_pool_io_poll(p);
  int32_t pending = 0;
  uint64_t parent = ROOT_KEY;
  for (int32_t i = 0; i < n / BLK; i++) {
    int32_t h = idx_find(p, parent, tokens + i * BLK, policy);
    if (h == NONE) break;
    struct blk *b = &p->blk[h];
    parent = b->key;
    if (b->disk == NONE) continue;
    if (b->io != NONE) { pending++; continue; }
    if (kvl__io_staged(&p->io, b->disk)) continue; /* attach takes it from the staging buffer */
    /* Read straight into a hot slot, where attach needs it anyway (reserved meanwhile).
     * Off the disk LRU first: making room may pass blocks down to the disk tier, which
     * drops its LRU head when full. */
    lru_remove(p, &p->disk_lru, h);
    int32_t slot = hot_slot(p);
    if (slot == NONE) { kvl__lru_push(p, &p->disk_lru, h); break; }
    p->hot_owner[slot] = h;
    hot_written(p, slot);
    if (!kvl__io_read(&p->io, h, b->disk, hot_data(p, slot))) {
      p->hot_owner[slot] = NONE;
      p->hot_free[p->n_hot_free++] = slot;
      kvl__lru_push(p, &p->disk_lru, h);
      break;
    }
    b->io = slot;
    pending++;
  }
  return pending;
}

int32_t kvl_pool_evict(kvl_pool_t *p, int32_t n) {
  int32_t freed = 0;
  while (freed < n && p->hot_lru.head != NONE) {
    int32_t victim = p->hot_lru.head;
    lru_remove(p, &p->hot_lru, victim);
    to_cold(p, victim, true);
    if (p->blk[victim].used) kvl__lru_push(p, &p->cold_lru, victim);
    freed++;
  }
  return freed;
}

/* ---- lines ------------------------------------------------------------------------------ */

kvl_line_t *kvl_line_new(kvl_pool_t *p) {
  kvl_line_t *l = calloc(1, sizeof(*l));
  if (!l) return NULL;
  l->p = p;
  l->next = p->lines;
  if (p->lines) p->lines->prev = l;
  p->lines = l;
  p->n_lines++;
  return l;
}

void kvl_line_free(kvl_line_t *l) {
  if (!l) return;
  kvl_pool_t *p = l->p;
  for (int32_t i = l->n_blocks - 1; i >= 0; i--) unref(p, l->blocks[i]); /* tail first: LRU keeps prefixes longest */
  if (l->prev) l->prev->next = l->next; else p->lines = l->next;
  if (l->next) l->next->prev = l->prev;
  p->n_lines--;
  free(l->tok);
  free(l->runs);
  free(l->blocks);
  free(l->table);
  free(l);
}

static int line_reserve(kvl_line_t *l, int32_t len, int32_t n_blocks) {
  if (len < 1) len = 1; /* keep the arrays allocated: NULL means out of memory below */
  if (n_blocks < 1) n_blocks = 1;
  int32_t *t = grow(l->tok, &l->cap_tok, len, sizeof(int32_t));
  if (!t) return KVL_ENOMEM;
  l->tok = t;
  int32_t cap = l->cap_blocks;
  int32_t *b = grow(l->blocks, &cap, n_blocks, sizeof(int32_t));
  if (!b) return KVL_ENOMEM;
  l->blocks = b;
  if (cap != l->cap_blocks) {
    int32_t *tb = realloc(l->table, (size_t)cap * sizeof(int32_t));
    if (!tb) return KVL_ENOMEM;
    l->table = tb;
    l->cap_blocks = cap;
  }
  return 0;
}

static int add_run(kvl_line_t *l, int32_t start, int32_t len, kvl_writer_t w) {
  if (len == 0) return 0;
  if (l->n_runs && l->runs[l->n_runs - 1].w == w && l->runs[l->n_runs - 1].start + l->runs[l->n_runs - 1].len == start) {
    l->runs[l->n_runs - 1].len += len;
    return 0;
  }
  struct run *r = grow(l->runs, &l->cap_runs, l->n_runs + 1, sizeof(*l->runs));
  if (!r) return KVL_ENOMEM;
  l->runs = r;
  l->runs[l->n_runs++] = (struct run){start, len, w};
  return 0;
}

kvl_line_t *kvl_line_fork(const kvl_line_t *src) {
  kvl_line_t *l = kvl_line_new(src->p);
  if (!l) return NULL;
  if (line_reserve(l, src->len, src->n_blocks) < 0) { kvl_line_free(l); return NULL; }
  for (int32_t i = 0; i < src->n_runs; i++)
    if (add_run(l, src->runs[i].start, src->runs[i].len, src->runs[i].w) < 0) { kvl_line_free(l); return NULL; }
  memcpy(l->tok, src->tok, (size_t)src->len * sizeof(int32_t));
  l->len = src->len;
  for (int32_t i = 0; i < src->n_blocks; i++) {
    l->blocks[i] = src->blocks[i];
    l->table[i] = src->table[i];
    ref(src->p, src->blocks[i]);
  }
  l->n_blocks = src->n_blocks;
  return l;
}

kvl_pool_t *kvl_line_pool(const kvl_line_t *l) { return l->p; }
int32_t kvl_line_len(const kvl_line_t *l) { return l->len; }
const int32_t *kvl_line_tokens(const kvl_line_t *l) { return l->tok; }

kvl_writer_t kvl_line_writer(const kvl_line_t *l, int32_t pos) {
  KVL_ASSERT(pos >= 0 && pos < l->len);
  for (int32_t i = 0; i < l->n_runs; i++)
    if (pos < l->runs[i].start + l->runs[i].len) return l->runs[i].w;
  KVL_ASSERT(!"position outside the writer runs");
  return KVL_WRITER_NATIVE;
}

bool kvl_line_is_hot(const kvl_line_t *l) {
  for (int32_t i = 0; i < l->n_blocks; i++)
    if (l->p->blk[l->blocks[i]].hot == NONE) return false;
  return true;
}

const int32_t *kvl_line_block_table(const kvl_line_t *l) {
  for (int32_t i = 0; i < l->n_blocks; i++) {
    int32_t s = l->p->blk[l->blocks[i]].hot;
    KVL_ASSERT(s != NONE); /* restore the line before computing on it */
    l->table[i] = s;
  }
  return l->table;
}

/* Fill a block's content description from the line (positions bi*16 ..). */
static void describe(const kvl_line_t *l, int32_t bi, struct blk *b) {
  for (int i = 0; i < BLK; i++) {
    int32_t pos = bi * BLK + i;
    b->tokens[i] = pos < l->len ? l->tok[pos] : -1;
    b->writers[i] = pos < l->len ? kvl_line_writer(l, pos) : KVL_WRITER_NATIVE;
  }
}

int kvl_line_append(kvl_line_t *l, const int32_t *tokens, int32_t n, kvl_writer_t writer) {
  kvl_pool_t *p = l->p;
  if (n < 0) return KVL_EINVAL;
  if (n == 0) return 0;
  KVL_ASSERT(kvl_line_is_hot(l));
  int32_t new_len = l->len + n, need_blocks = (new_len + BLK - 1) / BLK;
  bool cow = false;
  if (l->len % BLK) {
    struct blk *tail = &p->blk[l->blocks[l->n_blocks - 1]];
    cow = tail->refs > 1 || tail->indexed; /* shared, or findable by others: never written */
  }
  int32_t want = need_blocks - l->n_blocks + (cow ? 1 : 0);
  if (want > kvl_pool_available(p)) return KVL_EFULL;
  int rc = line_reserve(l, new_len, need_blocks);
  if (rc < 0) return rc;
  struct run *runs = grow(l->runs, &l->cap_runs, l->n_runs + 1, sizeof(*l->runs));
  if (!runs) return KVL_ENOMEM;
  l->runs = runs;
  if (cow) {
    int32_t old = l->blocks[l->n_blocks - 1], h = kvl__pool_blk_new(p);
    if (h < 0) return h;
    int32_t s = hot_slot(p);
    KVL_ASSERT(s != NONE);
    struct blk *b = &p->blk[h];
    b->hot = s;
    b->refs = 1;
    p->hot_owner[s] = h;
    hot_written(p, s);
    memcpy(hot_data(p, s), hot_data(p, p->blk[old].hot), p->bb);
    l->blocks[l->n_blocks - 1] = h;
    unref(p, old);
    p->st.cow_copies++;
  }
  while (l->n_blocks < need_blocks) {
    int32_t h = kvl__pool_blk_new(p);
    if (h < 0) return h;
    int32_t s = hot_slot(p);
    KVL_ASSERT(s != NONE);
    p->blk[h].hot = s;
    p->blk[h].refs = 1;
    p->hot_owner[s] = h;
    hot_fresh(p, s); /* a new owner: whatever a device holds of the slot is someone else's, and unread */
    l->blocks[l->n_blocks++] = h;
  }
  memcpy(l->tok + l->len, tokens, (size_t)n * sizeof(int32_t));
  rc = add_run(l, l->len, n, writer);
  KVL_ASSERT(rc == 0); /* capacity reserved above */
  l->len = new_len;
  return 0;
}

int kvl_line_truncate(kvl_line_t *l, int32_t len) {
  if (len < 0 || len > l->len) return KVL_EINVAL;
  int32_t keep = (len + BLK - 1) / BLK;
  while (l->n_blocks > keep) unref(l->p, l->blocks[--l->n_blocks]);
  while (l->n_runs && l->runs[l->n_runs - 1].start >= len) l->n_runs--;
  if (l->n_runs && l->runs[l->n_runs - 1].start + l->runs[l->n_runs - 1].len > len)
    l->runs[l->n_runs - 1].len = len - l->runs[l->n_runs - 1].start;
  l->len = len;
  return 0;
}

void kvl_line_commit(kvl_line_t *l) {
  kvl_pool_t *p = l->p;
  uint64_t parent = ROOT_KEY;
  for (int32_t bi = 0; bi < l->len / BLK; bi++) {
    int32_t h = l->blocks[bi];
    struct blk *b = &p->blk[h];
    if (b->indexed) { parent = b->key; continue; }
    describe(l, bi, b);
    b->parent = parent;
    b->key = kvl__key_of(parent, b->tokens, b->writers);
    /* an identical block (same tokens, same writers) indexed by someone else wins; ours
     * stays private and is freed with its last line */
    bool dup = false;
    uint64_t bk = bucket_of(parent, b->tokens);
    for (size_t j = bk & (p->idx_cap - 1); p->idx[j].h != NONE; j = (j + 1) & (p->idx_cap - 1))
      if (p->idx[j].h >= 0 && p->blk[p->idx[j].h].key == b->key) { dup = true; break; }
    if (!dup && kvl__idx_insert(p, h) == 0) b->indexed = true;
    parent = b->key;
  }
}

int kvl_line_attach_prefix(kvl_line_t *l, const int32_t *tokens, int32_t n, enum kvl_reuse policy,
                           struct kvl_prefix_hit *hit) {
  kvl_pool_t *p = l->p;
  *hit = (struct kvl_prefix_hit){0};
  KVL_ASSERT(l->len == 0 && l->n_blocks == 0);
  int32_t nb = n / BLK, found = 0;
  int rc = line_reserve(l, nb * BLK, nb);
  if (rc < 0) return rc;
  uint64_t parent = ROOT_KEY;
  for (; found < nb; found++) {
    int32_t h = idx_find(p, parent, tokens + found * BLK, policy);
    if (h == NONE) break;
    const struct blk *b = &p->blk[h];
    if (b->disk != NONE && (b->io != NONE || !kvl__io_staged(&p->io, b->disk)))
      break; /* on disk: kvl_pool_prefetch brings it back first (the compute thread never reads) */
    ref(p, h); /* pinned: no longer evictable while we restore others */
    l->blocks[found] = h;
    parent = p->blk[h].key;
  }
  int32_t cold = 0;
  for (int32_t i = 0; i < found; i++) cold += p->blk[l->blocks[i]].hot == NONE;
  if (cold > kvl_pool_available(p)) {
    for (int32_t i = found - 1; i >= 0; i--) unref(p, l->blocks[i]);
    return KVL_EFULL;
  }
  for (int32_t i = 0; i < found; i++)
    if (p->blk[l->blocks[i]].hot == NONE) {
      rc = restore_blk(p, l->blocks[i]);
      KVL_ASSERT(rc == 0);
      hit->n_restored++;
    }
  l->n_blocks = found;
  for (int32_t i = 0; i < found; i++) {
    const struct blk *b = &p->blk[l->blocks[i]];
    for (int j = 0; j < BLK; j++) {
      l->tok[i * BLK + j] = b->tokens[j];
      if (add_run(l, i * BLK + j, 1, b->writers[j]) < 0) return KVL_ENOMEM;
      if (b->writers[j] == KVL_WRITER_NATIVE) hit->n_native++; else hit->n_translated++;
    }
  }
  l->len = found * BLK;
  hit->n_tokens = l->len;
  return 0;
}

int kvl_line_native_span(const kvl_line_t *l, int32_t from, int32_t to) {
  if (from < 0 || to > l->len || from > to) return KVL_EINVAL;
  for (int32_t i = 0; i < l->n_runs; i++) {
    const struct run *r = &l->runs[i];
    if (r->start < to && r->start + r->len > from && r->w != KVL_WRITER_NATIVE) return KVL_EINVAL;
  }
  return 0;
}

int kvl_line_offload(kvl_line_t *l) {
  kvl_pool_t *p = l->p;
  int32_t need = 0;
  for (int32_t i = 0; i < l->n_blocks; i++) {
    const struct blk *b = &p->blk[l->blocks[i]];
    need += b->refs == 1 && b->hot != NONE;
  }
  if (need > p->n_cold_free + p->cold_lru.n) return KVL_EFULL;
  for (int32_t i = 0; i < l->n_blocks; i++) {
    int32_t h = l->blocks[i];
    if (p->blk[h].refs == 1 && p->blk[h].hot != NONE) {
      int rc = to_cold(p, h, false);
      KVL_ASSERT(rc == 0);
    }
  }
  return 0;
}

int kvl_line_restore(kvl_line_t *l) {
  kvl_pool_t *p = l->p;
  int32_t need = 0;
  for (int32_t i = 0; i < l->n_blocks; i++) need += p->blk[l->blocks[i]].hot == NONE;
  if (need > kvl_pool_available(p)) return KVL_EFULL;
  for (int32_t i = 0; i < l->n_blocks; i++)
    if (p->blk[l->blocks[i]].hot == NONE) {
      int rc = restore_blk(p, l->blocks[i]);
      KVL_ASSERT(rc == 0);
    }
  return 0;
}

/* ---- sanity checker ------------------------------------------------------------------------ */

int kvl_pool_check(const kvl_pool_t *p, char *err, size_t errlen) {
  int32_t *refs = calloc((size_t)p->n_blk + 1, sizeof(int32_t));
  int rc = 0;
  if (!refs) return KVL_ENOMEM;
  int32_t n_lines = 0;
  for (const kvl_line_t *l = p->lines; l; l = l->next, n_lines++) {
    if (l->n_blocks != (l->len + BLK - 1) / BLK) { rc = kvl_errf(err, errlen, KVL_EINVAL, "line has %d blocks for %d positions", l->n_blocks, l->len); goto out; }
    int32_t covered = 0;
    for (int32_t i = 0; i < l->n_runs; i++) {
      if (l->runs[i].start != covered || l->runs[i].len <= 0) { rc = kvl_errf(err, errlen, KVL_EINVAL, "writer runs not contiguous at %d", covered); goto out; }
      covered += l->runs[i].len;
    }
    if (covered != l->len) { rc = kvl_errf(err, errlen, KVL_EINVAL, "writer runs cover %d of %d positions", covered, l->len); goto out; }
    for (int32_t i = 0; i < l->n_blocks; i++) {
      int32_t h = l->blocks[i];
      if (h < 0 || h >= p->n_blk || !p->blk[h].used) { rc = kvl_errf(err, errlen, KVL_EINVAL, "line holds a dead block handle %d", h); goto out; }
      refs[h]++;
      const struct blk *b = &p->blk[h];
      if (b->indexed) /* an indexed block's content is what the line says it holds */
        for (int j = 0; j < BLK; j++) {
          int32_t pos = i * BLK + j;
          if (pos < l->len && (b->tokens[j] != l->tok[pos] || b->writers[j] != kvl_line_writer(l, pos))) {
            rc = kvl_errf(err, errlen, KVL_EINVAL, "line position %d disagrees with its indexed block", pos);
            goto out;
          }
        }
    }
  }
  if (n_lines != p->n_lines) { rc = kvl_errf(err, errlen, KVL_EINVAL, "%d lines listed, %d counted", n_lines, p->n_lines); goto out; }
  int32_t hot_in_use = 0, cold_in_use = 0, disk_in_use = 0, on_hot_lru = 0, on_cold_lru = 0, on_disk_lru = 0, indexed = 0;
  int32_t reading = 0; /* blocks with a read from disk in flight: each holds a reserved hot slot */
  for (int32_t h = 0; h < p->n_blk; h++) {
    const struct blk *b = &p->blk[h];
    if (!b->used) continue;
    if (b->refs != refs[h]) { rc = kvl_errf(err, errlen, KVL_EINVAL, "block %d: refcount %d but %d references", h, b->refs, refs[h]); goto out; }
    int tiers = (b->hot != NONE) + (b->cold != NONE) + (b->disk != NONE);
    if (tiers != 1) { rc = kvl_errf(err, errlen, KVL_EINVAL, "block %d is in %d tiers", h, tiers); goto out; }
    if (b->disk != NONE && (b->refs || p->disk_owner[b->disk] != h)) { rc = kvl_errf(err, errlen, KVL_EINVAL, "disk slot %d: block %d referenced or not its owner", b->disk, h); goto out; }
    if (b->hot != NONE && p->hot_owner[b->hot] != h) { rc = kvl_errf(err, errlen, KVL_EINVAL, "hot slot %d not owned by block %d", b->hot, h); goto out; }
    if (b->cold != NONE && p->cold_owner[b->cold] != h) { rc = kvl_errf(err, errlen, KVL_EINVAL, "cold slot %d not owned by block %d", b->cold, h); goto out; }
    if (b->refs == 0 && !b->indexed) { rc = kvl_errf(err, errlen, KVL_EINVAL, "block %d is unreferenced and unindexed (leaked)", h); goto out; }
    if (b->io != NONE) {
      if (b->disk == NONE || b->refs || !b->indexed || b->io < 0 || b->io >= p->n_hot || p->hot_owner[b->io] != h || b->prev != NONE || b->next != NONE || p->disk_lru.head == h || kvl__io_staged(&p->io, b->disk)) { rc = kvl_errf(err, errlen, KVL_EINVAL, "block %d: a read in flight, but not a lone unreferenced disk block owning its hot slot %d", h, b->io); goto out; }
      reading++;
    }
    hot_in_use += b->hot != NONE;
    cold_in_use += b->cold != NONE;
    disk_in_use += b->disk != NONE;
    indexed += b->indexed;
    if (b->indexed && b->key != kvl__key_of(b->parent, b->tokens, b->writers)) { rc = kvl_errf(err, errlen, KVL_EINVAL, "block %d: key does not match content", h); goto out; }
  }
  for (int32_t h = p->hot_lru.head, prev = NONE; h != NONE; prev = h, h = p->blk[h].next, on_hot_lru++)
    if (p->blk[h].prev != prev || p->blk[h].refs || p->blk[h].hot == NONE || !p->blk[h].indexed) { rc = kvl_errf(err, errlen, KVL_EINVAL, "hot LRU corrupt at block %d", h); goto out; }
  for (int32_t h = p->cold_lru.head, prev = NONE; h != NONE; prev = h, h = p->blk[h].next, on_cold_lru++)
    if (p->blk[h].prev != prev || p->blk[h].refs || p->blk[h].cold == NONE || !p->blk[h].indexed) { rc = kvl_errf(err, errlen, KVL_EINVAL, "cold LRU corrupt at block %d", h); goto out; }
  for (int32_t h = p->disk_lru.head, prev = NONE; h != NONE; prev = h, h = p->blk[h].next, on_disk_lru++)
    if (p->blk[h].prev != prev || p->blk[h].refs || p->blk[h].disk == NONE || !p->blk[h].indexed) { rc = kvl_errf(err, errlen, KVL_EINVAL, "disk LRU corrupt at block %d", h); goto out; }
  if (on_hot_lru != p->hot_lru.n || on_cold_lru != p->cold_lru.n || on_disk_lru != p->disk_lru.n) { rc = kvl_errf(err, errlen, KVL_EINVAL, "LRU counts wrong"); goto out; }
  int32_t cached = 0;
  for (int32_t h = 0; h < p->n_blk; h++) cached += p->blk[h].used && p->blk[h].refs == 0 && p->blk[h].io == NONE;
  if (cached != on_hot_lru + on_cold_lru + on_disk_lru) { rc = kvl_errf(err, errlen, KVL_EINVAL, "%d cached blocks, %d on LRU lists", cached, on_hot_lru + on_cold_lru + on_disk_lru); goto out; }
  if (disk_in_use + p->n_disk_free != p->n_disk) { rc = kvl_errf(err, errlen, KVL_EINVAL, "disk slots: %d used + %d free != %d", disk_in_use, p->n_disk_free, p->n_disk); goto out; }
  if (hot_in_use + reading + p->n_hot_free != p->n_hot) { rc = kvl_errf(err, errlen, KVL_EINVAL, "hot slots: %d used + %d being read into + %d free != %d", hot_in_use, reading, p->n_hot_free, p->n_hot); goto out; }
  if (cold_in_use + p->n_cold_free != p->n_cold) { rc = kvl_errf(err, errlen, KVL_EINVAL, "cold slots: %d used + %d free != %d", cold_in_use, p->n_cold_free, p->n_cold); goto out; }
  if (p->disk_fd >= 0) {
    for (int32_t d = 0; d < p->n_disk; d++)
      if (p->io.slot_stage[d] != NONE && p->disk_owner[d] == NONE) { rc = kvl_errf(err, errlen, KVL_EINVAL, "disk slot %d: staged bytes for no block", d); goto out; }
    if (p->io.n_stage_free + (p->io.in_flight - reading) != p->io.n_stage) { rc = kvl_errf(err, errlen, KVL_EINVAL, "write-behind: %d free + %d writes in flight != %d buffers", p->io.n_stage_free, p->io.in_flight - reading, p->io.n_stage); goto out; }
  }
  for (int32_t i = 0; i < p->n_hot_free; i++)
    if (p->hot_owner[p->hot_free[i]] != NONE) { rc = kvl_errf(err, errlen, KVL_EINVAL, "free hot slot %d is owned", p->hot_free[i]); goto out; }
  for (int32_t i = 0; i < p->n_cold_free; i++)
    if (p->cold_owner[p->cold_free[i]] != NONE) { rc = kvl_errf(err, errlen, KVL_EINVAL, "free cold slot %d is owned", p->cold_free[i]); goto out; }
  int32_t in_index = 0;
  for (size_t j = 0; j < p->idx_cap; j++) {
    int32_t h = p->idx[j].h;
    if (h < 0) continue;
    in_index++;
    if (!p->blk[h].used || !p->blk[h].indexed || p->idx[j].bucket != bucket_of(p->blk[h].parent, p->blk[h].tokens)) {
      rc = kvl_errf(err, errlen, KVL_EINVAL, "index entry %zu is stale (block %d)", j, h);
      goto out;
    }
  }
  if (in_index != indexed) rc = kvl_errf(err, errlen, KVL_EINVAL, "%d indexed blocks, %d index entries", indexed, in_index);
out:
  free(refs);
  return rc;
}
