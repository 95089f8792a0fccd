/* spill.c — the pool's snapshot file: save indexed blocks, load them back into the cold
 * tier at start (see kvl_kvpool.h "persistence"). Layout, little-endian:
 *
 *   header  "KVLSPIL1" | u32 header bytes | u32 block tokens (16) | u64 block bytes
 *           | i32 n_layer, n_kv_head, head_dim, dtype | u32 fingerprint length | fingerprint
 *           | u64 record count | u32 crc32 (IEEE, zlib's) of everything before it
 *   record  u64 parent key | i32 tokens[16] | u16 writers[16] | block bytes of K/V data
 *           | u32 crc32 of the record
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "kvl_error.h"
#include "kvpool-impl.h"

struct wbuf { uint8_t *b; size_t n, cap; bool oom; };
static void put(struct wbuf *w, const void *p, size_t n) {
  if (w->oom) return;
  if (w->n + n > w->cap) {
    size_t nc = (w->n + n) * 2;
    uint8_t *nb = realloc(w->b, nc);
    if (!nb) { w->oom = true; return; }
    w->b = nb;
    w->cap = nc;
  }
  memcpy(w->b + w->n, p, n);
  w->n += n;
}

static const char MAGIC[8] = {'K', 'V', 'L', 'S', 'P', 'I', 'L', '1'};

static void header(struct wbuf *w, const kvl_pool_t *p, const char *fp, uint64_t n_records) {
  uint32_t fl = (uint32_t)strlen(fp), hb = 0, bt = KVL_KV_BLOCK;
  uint64_t bb = p->bb;
  int32_t geo[4] = {p->layout.n_layer, p->layout.n_kv_head, p->layout.head_dim, (int32_t)p->layout.dtype};
  put(w, MAGIC, 8);
  size_t hb_at = w->n;
  put(w, &hb, 4);
  put(w, &bt, 4);
  put(w, &bb, 8);
  put(w, geo, sizeof(geo));
  put(w, &fl, 4);
  put(w, fp, fl);
  put(w, &n_records, 8);
  if (w->oom) return;
  hb = (uint32_t)(w->n + 4);
  memcpy(w->b + hb_at, &hb, 4);
  uint32_t crc = (uint32_t)crc32(0L, w->b, w->n);
  put(w, &crc, 4);
}

int kvl_pool_save(const kvl_pool_t *p, const char *path, const char *fp, char *err, size_t errlen) {
  uint64_t n = 0;
  for (int32_t h = 0; h < p->n_blk; h++) n += p->blk[h].used && p->blk[h].indexed;
  struct wbuf w = {0};
  header(&w, p, fp, n);
  uint8_t *tmpblk = malloc(p->bb);
  if (!tmpblk) w.oom = true;
  for (int32_t h = 0; h < p->n_blk && !w.oom; h++) {
    const struct blk *b = &p->blk[h];
    if (!b->used || !b->indexed) continue;
    const uint8_t *data = kvl__blk_data((kvl_pool_t *)p, h, tmpblk);
    if (!data) continue; /* an unreadable disk block is not carried over */
    size_t at = w.n;
    put(&w, &b->parent, 8);
    put(&w, b->tokens, sizeof(b->tokens));
    put(&w, b->writers, sizeof(b->writers));
    put(&w, data, p->bb);
    if (w.oom) break;
    uint32_t crc = (uint32_t)crc32(0L, w.b + at, w.n - at);
    put(&w, &crc, 4);
  }
  free(tmpblk);
  if (w.oom) { free(w.b); return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory writing the spill snapshot"); }
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 16);
  if (!tmp) { free(w.b); return KVL_ENOMEM; }
  snprintf(tmp, pl + 16, "%s.tmp%d", path, (int)getpid());
  int rc = 0;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) { rc = kvl_errf(err, errlen, -errno, "cannot create '%s': %s", tmp, strerror(errno)); goto out; }
  for (size_t off = 0; off < w.n;) {
    ssize_t k = write(fd, w.b + off, w.n - off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) { rc = kvl_errf(err, errlen, -errno, "cannot write '%s': %s", tmp, strerror(errno)); break; }
    off += (size_t)k;
  }
  if (rc == 0 && fsync(fd) < 0) rc = kvl_errf(err, errlen, -errno, "cannot sync '%s': %s", tmp, strerror(errno));
  close(fd);
  if (rc == 0 && rename(tmp, path) < 0) rc = kvl_errf(err, errlen, -errno, "cannot rename to '%s': %s", path, strerror(errno));
  if (rc) unlink(tmp);
out:
  free(tmp);
  free(w.b);
  return rc;
}

int kvl_pool_load(kvl_pool_t *p, const char *path, const char *fp, int32_t *n_loaded, char *err, size_t errlen) {
  if (n_loaded) *n_loaded = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return kvl_errf(err, errlen, -errno, "cannot open spill file '%s': %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { close(fd); return kvl_errf(err, errlen, KVL_EINVAL, "'%s' is not a regular file", path); }
  size_t size = (size_t)st.st_size;
  uint8_t *buf = malloc(size ? size : 1);
  if (!buf) { close(fd); return KVL_ENOMEM; }
  size_t got = 0;
  while (got < size) {
    ssize_t k = read(fd, buf + got, size - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got += (size_t)k;
  }
  close(fd);
  int rc = got == size ? kvl_pool_load_mem(p, buf, size, path, fp, n_loaded, err, errlen)
                       : kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s' is truncated", path);
  free(buf);
  return rc;
}

int kvl_pool_load_mem(kvl_pool_t *p, const uint8_t *buf, size_t size, const char *path, const char *fp,
                      int32_t *n_loaded, char *err, size_t errlen) {
  if (n_loaded) *n_loaded = 0;
  KVL_ASSERT(p->n_blk - p->n_blk_free == 0 && p->n_lines == 0); /* an empty pool */
  int rc = 0;
  /* the header we would write for this pool must match byte for byte (but the count) */
  struct wbuf w = {0};
  header(&w, p, fp, 0);
  if (w.oom) { rc = KVL_ENOMEM; goto out; }
  size_t hl = w.n; /* this pool's header length */
  if (size < 16) { rc = kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s' is truncated", path); goto out; }
  if (memcmp(buf, MAGIC, 8)) { rc = kvl_errf(err, errlen, KVL_EFORMAT, "'%s' is not a kvlingo spill file", path); goto out; }
  uint32_t fhl, crc;
  memcpy(&fhl, buf + 8, 4);
  if (fhl < 24 || fhl > size) { rc = kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s' is truncated", path); goto out; }
  memcpy(&crc, buf + fhl - 4, 4);
  if ((uint32_t)crc32(0L, buf, fhl - 4) != crc) { rc = kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s': header checksum mismatch (damaged)", path); goto out; }
  /* same layout, dtype, block size and fingerprint: the headers agree but for the count */
  if (fhl != hl || memcmp(buf, w.b, hl - 12)) {
    rc = kvl_errf(err, errlen, KVL_EMISMATCH,
              "spill file '%s' was written for another model, translator, KV dtype or block size", path);
    goto out;
  }
  uint64_t n_rec;
  memcpy(&n_rec, buf + hl - 12, 8);
  size_t rec = 8 + sizeof(int32_t) * KVL_KV_BLOCK + sizeof(kvl_writer_t) * KVL_KV_BLOCK + p->bb + 4;
  if (n_rec > (size - hl) / rec || hl + n_rec * rec != size) {
    rc = kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s': %llu records do not fit its %zu bytes (damaged)", path,
              (unsigned long long)n_rec, size);
    goto out;
  }
  for (uint64_t i = 0; i < n_rec; i++) { /* verify everything before trusting anything */
    const uint8_t *r = buf + hl + i * rec;
    memcpy(&crc, r + rec - 4, 4);
    if ((uint32_t)crc32(0L, r, rec - 4) != crc) {
      rc = kvl_errf(err, errlen, KVL_EFORMAT, "spill file '%s': record %llu checksum mismatch (damaged)", path, (unsigned long long)i);
      goto out;
    }
  }
  int32_t loaded = 0;
  for (uint64_t i = 0; i < n_rec && p->n_cold_free > 0; i++) {
    const uint8_t *r = buf + hl + i * rec;
    int32_t h = kvl__pool_blk_new(p);
    if (h < 0) { rc = h; break; }
    struct blk *b = &p->blk[h];
    memcpy(&b->parent, r, 8);
    memcpy(b->tokens, r + 8, sizeof(b->tokens));
    memcpy(b->writers, r + 8 + sizeof(b->tokens), sizeof(b->writers));
    b->key = kvl__key_of(b->parent, b->tokens, b->writers);
    int32_t c = p->cold_free[--p->n_cold_free];
    memcpy(p->cold_mem + (size_t)c * p->bb, r + 8 + sizeof(b->tokens) + sizeof(b->writers), p->bb);
    p->cold_owner[c] = h;
    b->cold = c;
    if (kvl__idx_insert(p, h) < 0) { rc = KVL_ENOMEM; break; }
    b->indexed = true;
    kvl__lru_push(p, &p->cold_lru, h);
    loaded++;
  }
  if (n_loaded) *n_loaded = loaded;
out:
  free(w.b);
  return rc;
}
