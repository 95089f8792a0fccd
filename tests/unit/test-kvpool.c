/* test-kvpool.c — the KV pool's invariants: sharing, provenance-aware prefix lookup,
 * copy on write, eviction to the cold tier and back, offload/restore bit-exactness,
 * clean refusal when full, and a randomized stress run with the sanity checker after
 * every operation and every line's data verified. */
#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_kvpool.h"

static const struct kvl_kv_layout LAYOUT = {2, 2, 8, KVL_KV_F32}; /* 2 layers, kvw 16 */

static char g_disk[64]; /* the disk tier's file of pool_disk's pools */
static int32_t g_writeback; /* their write-behind buffers (0: the default) */

static kvl_pool_t *pool_disk(int hot_blocks, int cold_blocks, int disk_blocks) {
  struct kvl_pool_config c = {.layout = LAYOUT};
  size_t bb = kvl_kv_block_bytes(&LAYOUT);
  c.hot_bytes = (size_t)hot_blocks * bb;
  c.cold_bytes = (size_t)cold_blocks * bb;
  if (disk_blocks) {
    snprintf(g_disk, sizeof(g_disk), "/tmp/kvl-disk-tier-%d", (int)getpid());
    c.disk_bytes = (size_t)disk_blocks * bb;
    c.disk_path = g_disk;
    c.disk_writeback_blocks = g_writeback;
  }
  kvl_pool_t *p;
  KVL_ASSERT(kvl_pool_new(&c, &p) == 0);
  return p;
}

static kvl_pool_t *pool(int hot_blocks, int cold_blocks) { return pool_disk(hot_blocks, cold_blocks, 0); }

static void check(const kvl_pool_t *p) {
  char err[256];
  int rc = kvl_pool_check(p, err, sizeof(err));
  if (rc) fprintf(stderr, "pool check: %s\n", err);
  CHECK_EQ_INT(rc, 0);
}

/* What a "forward" writes at a position: a function of the tokens up to it, the
 * position, the writer and the layer (so shared prefixes hold identical data). */
static float value(const int32_t *tok, int32_t pos, kvl_writer_t w, int layer, int i, int kv) {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)w * 7919u ^ (uint64_t)layer * 104729u;
  for (int32_t j = 0; j <= pos; j++) h = (h ^ (uint32_t)tok[j]) * 1099511628211ull;
  h = (h ^ (uint64_t)(i * 2 + kv)) * 1099511628211ull;
  return (float)(h >> 40) / 16777216.0f;
}

static void *base_of(const kvl_line_t *l) { return kvl_pool_base(kvl_line_pool(l)); }

static void fill(kvl_line_t *l, int32_t from, int32_t to) {
  const int32_t *tok = kvl_line_tokens(l);
  const int32_t *bt = kvl_line_block_table(l);
  const int32_t *tables[] = {bt};
  float k[16], v[16];
  for (int32_t pos = from; pos < to; pos++)
    for (int layer = 0; layer < LAYOUT.n_layer; layer++) {
      kvl_writer_t w = kvl_line_writer(l, pos);
      for (int i = 0; i < 16; i++) { k[i] = value(tok, pos, w, layer, i, 0); v[i] = value(tok, pos, w, layer, i, 1); }
      int32_t seq = 0;
      kvl_kv_store(&LAYOUT, base_of(l), layer, 1, k, v, &pos, &seq, tables);
    }
}

static int verify(kvl_line_t *l) {
  const int32_t *tok = kvl_line_tokens(l);
  const int32_t *bt = kvl_line_block_table(l);
  float k[16], v[16];
  int bad = 0;
  for (int32_t pos = 0; pos < kvl_line_len(l); pos++)
    for (int layer = 0; layer < LAYOUT.n_layer; layer++) {
      kvl_kv_load(&LAYOUT, base_of(l), layer, pos, bt, k, v);
      kvl_writer_t w = kvl_line_writer(l, pos);
      for (int i = 0; i < 16; i++)
        bad += k[i] != value(tok, pos, w, layer, i, 0) || v[i] != value(tok, pos, w, layer, i, 1);
    }
  return bad;
}

static void seqn(int32_t *t, int n, int32_t start) {
  for (int i = 0; i < n; i++) t[i] = start + i;
}

static void test_share_and_provenance(void) {
  kvl_pool_t *p = pool(32, 16);
  int32_t toks[64];
  seqn(toks, 64, 100);
  /* A: 40 native positions, committed (2 full blocks indexed) */
  kvl_line_t *a = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(a, toks, 40, KVL_WRITER_NATIVE), 0);
  fill(a, 0, 40);
  kvl_line_commit(a);
  check(p);
  /* B: same prompt finds 32 cached positions, shares A's blocks */
  kvl_line_t *b = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(b, toks, 50, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK(hit.n_tokens == 32 && hit.n_native == 32 && hit.n_translated == 0);
  CHECK(kvl_line_block_table(b)[0] == kvl_line_block_table(a)[0]);
  CHECK_EQ_INT(kvl_line_append(b, toks + 32, 18, KVL_WRITER_NATIVE), 0);
  fill(b, 32, 50);
  CHECK_EQ_INT(verify(a), 0);
  CHECK_EQ_INT(verify(b), 0);
  check(p);
  /* T: the same 32 tokens, first block translated (writer 7), second native on top */
  kvl_line_t *t = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(t, toks, 16, 7), 0);
  CHECK_EQ_INT(kvl_line_append(t, toks + 16, 16, KVL_WRITER_NATIVE), 0);
  fill(t, 0, 32);
  kvl_line_commit(t);
  check(p);
  CHECK_EQ_INT(kvl_line_native_span(t, 16, 32), 0);
  CHECK_EQ_INT(kvl_line_native_span(t, 10, 20), KVL_EINVAL); /* touches translated positions */
  /* A's lines are gone but its native blocks stay cached: a native-only lookup finds
   * them, not T's chain (whose first block is translated) */
  kvl_line_free(a);
  kvl_line_free(b);
  kvl_line_t *c = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_attach_prefix(c, toks, 32, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 32);
  CHECK_EQ_INT(hit.n_translated, 0);
  CHECK_EQ_INT(verify(c), 0);
  kvl_line_free(c);
  /* now tokens only T holds natively-on-top-of-translated: a different second block */
  int32_t toks2[32];
  memcpy(toks2, toks, sizeof(toks2));
  kvl_line_t *u = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(u, toks2, 16, 9), 0); /* translated by another translator */
  toks2[20] = 5;
  CHECK_EQ_INT(kvl_line_append(u, toks2 + 16, 16, KVL_WRITER_NATIVE), 0);
  fill(u, 0, 32);
  kvl_line_commit(u);
  kvl_line_t *d = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_attach_prefix(d, toks2, 32, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 16); /* native block 0 from A; block 1 sits on a translated parent */
  kvl_line_free(d);
  d = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_attach_prefix(d, toks2, 32, KVL_REUSE_ANY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 16); /* block 0 prefers A's native entry; its child differs */
  kvl_line_free(d);
  kvl_line_free(u);
  kvl_line_free(t);
  check(p);
  kvl_pool_free(p);
}

static void test_translated_only(void) {
  kvl_pool_t *p = pool(16, 0);
  int32_t toks[32];
  seqn(toks, 32, 7);
  kvl_line_t *t = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(t, toks, 32, 3), 0);
  fill(t, 0, 32);
  kvl_line_commit(t);
  kvl_line_t *x = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(x, toks, 32, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 0);
  CHECK_EQ_INT(kvl_line_attach_prefix(x, toks, 32, KVL_REUSE_ANY, &hit), 0);
  CHECK(hit.n_tokens == 32 && hit.n_translated == 32 && hit.n_native == 0);
  CHECK_EQ_INT(kvl_line_native_span(x, 0, 1), KVL_EINVAL); /* never a translation source */
  CHECK_EQ_INT(verify(x), 0);
  kvl_line_free(x);
  kvl_line_free(t);
  check(p);
  kvl_pool_free(p);
}

static void test_cow_and_truncate(void) {
  kvl_pool_t *p = pool(16, 0);
  int32_t toks[40];
  seqn(toks, 40, 1);
  kvl_line_t *a = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(a, toks, 20, KVL_WRITER_NATIVE), 0);
  fill(a, 0, 20);
  kvl_line_t *b = kvl_line_fork(a);
  CHECK(b != NULL);
  int32_t other[4] = {900, 901, 902, 903};
  CHECK_EQ_INT(kvl_line_append(b, other, 4, KVL_WRITER_NATIVE), 0); /* tail block shared: copied */
  fill(b, 20, 24);
  CHECK(kvl_line_block_table(b)[1] != kvl_line_block_table(a)[1]);
  CHECK(kvl_line_block_table(b)[0] == kvl_line_block_table(a)[0]);
  CHECK_EQ_INT(verify(a), 0);
  CHECK_EQ_INT(verify(b), 0);
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.cow_copies, 1);
  /* an edited turn: truncate into a committed (indexed) block, then write: copied too */
  kvl_line_commit(a);
  CHECK_EQ_INT(kvl_line_truncate(a, 10), 0);
  CHECK_EQ_INT(kvl_line_append(a, other, 4, KVL_WRITER_NATIVE), 0);
  fill(a, 10, 14);
  CHECK_EQ_INT(verify(a), 0);
  CHECK_EQ_INT(verify(b), 0);
  CHECK_EQ_INT(kvl_line_truncate(a, 99), KVL_EINVAL);
  check(p);
  kvl_line_free(a);
  kvl_line_free(b);
  check(p);
  kvl_pool_free(p);
}

static void test_tiers(void) {
  kvl_pool_t *p = pool(4, 4);
  int32_t toks[64];
  seqn(toks, 64, 50);
  kvl_line_t *a = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(a, toks, 48, KVL_WRITER_NATIVE), 0);
  fill(a, 0, 48);
  kvl_line_commit(a);
  /* offload -> restore is bit-exact and frees the hot slots meanwhile */
  CHECK_EQ_INT(kvl_line_offload(a), 0);
  CHECK(!kvl_line_is_hot(a));
  CHECK_EQ_INT(kvl_pool_available(p), 4);
  check(p);
  CHECK_EQ_INT(kvl_line_restore(a), 0);
  CHECK_EQ_INT(verify(a), 0);
  kvl_line_free(a); /* 3 cached blocks */
  /* a new line needs all 4 hot slots: cached blocks go to the cold tier, not away */
  kvl_line_t *b = kvl_line_new(p);
  int32_t other[64];
  seqn(other, 64, 5000);
  CHECK_EQ_INT(kvl_line_append(b, other, 64, KVL_WRITER_NATIVE), 0);
  fill(b, 0, 64);
  CHECK_EQ_INT(kvl_line_append(b, other, 1, KVL_WRITER_NATIVE), KVL_EFULL); /* no room: nothing changes */
  CHECK_EQ_INT(kvl_line_len(b), 64);
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.evicted_to_cold, 3 + 3); /* offload + eviction */
  check(p);
  kvl_line_free(b);
  /* the conversation comes back: its blocks are found in the cold tier and restored */
  kvl_line_t *c = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(c, toks, 48, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 48);
  CHECK_EQ_INT(hit.n_restored, 3);
  CHECK_EQ_INT(verify(c), 0);
  check(p);
  kvl_line_free(c);
  kvl_pool_free(p);
}

/* Thousands of random operations; the checker after each; every line's data verified. */
static void stress(int disk_blocks) {
  kvl_pool_t *p = pool_disk(24, 12, disk_blocks);
  enum { L = 12 };
  kvl_line_t *lines[L] = {0};
  unsigned long long s = 424242;
  int32_t base[4][96];
  for (int k = 0; k < 4; k++) seqn(base[k], 96, 1000 * (k + 1)); /* 4 shared "system prompts" */
  int ops = 0, full = 0, bad = 0, restarts = 0;
  char err[256];
  struct kvl_pool_stats tot = {0}, st;
#define ADD_STATS()                                                                                            \
  do {                                                                                                         \
    kvl_pool_stats(p, &st);                                                                                    \
    tot.evicted_to_cold += st.evicted_to_cold, tot.spilled_to_disk += st.spilled_to_disk;                      \
    tot.dropped += st.dropped, tot.restored += st.restored, tot.restored_from_disk += st.restored_from_disk;    \
    tot.cow_copies += st.cow_copies, tot.disk_busy += st.disk_busy;                                             \
  } while (0)
  for (int it = 0; it < 6000; it++) {
    int i = (int)(kvl_test_rand(&s) % L), op = (int)(kvl_test_rand(&s) % 10);
    if (it % 500 == 499) {
      /* restart: every line ends, the cache is saved, a new pool loads it back */
      char path[] = "/tmp/kvl-stress-spill-XXXXXX";
      int fd = mkstemp(path);
      close(fd);
      for (int j = 0; j < L; j++) { kvl_line_free(lines[j]); lines[j] = NULL; }
      CHECK_EQ_INT(kvl_pool_save(p, path, "stress", err, sizeof(err)), 0);
      ADD_STATS();
      kvl_pool_free(p);
      p = pool_disk(24, 12, disk_blocks);
      int32_t nl;
      CHECK_EQ_INT(kvl_pool_load(p, path, "stress", &nl, err, sizeof(err)), 0);
      restarts++;
      unlink(path);
      continue;
    }
    kvl_line_t *l = lines[i];
    if (!l) {
      l = lines[i] = kvl_line_new(p);
      int k = (int)(kvl_test_rand(&s) % 4), n = 1 + (int)(kvl_test_rand(&s) % 80);
      struct kvl_prefix_hit hit;
      enum kvl_reuse pol = op < 8 ? KVL_REUSE_NATIVE_ONLY : KVL_REUSE_ANY;
      if (disk_blocks && op % 2 == 0) { /* read back what went to disk; sometimes wait for it */
        if (kvl_pool_prefetch(p, base[k], n, pol) > 0 && op % 4 == 0) kvl_pool_io_drain(p);
      } else if (disk_blocks && op == 5) {
        kvl_pool_io_poll(p);
      }
      int rc = kvl_line_attach_prefix(l, base[k], n, pol, &hit);
      if (rc == KVL_EFULL) full++;
      rc = kvl_line_append(l, base[k] + hit.n_tokens, n - hit.n_tokens,
                           kvl_test_rand(&s) % 5 ? KVL_WRITER_NATIVE : (kvl_writer_t)(1 + kvl_test_rand(&s) % 2));
      if (rc == 0) fill(l, hit.n_tokens, n);
      else if (rc == KVL_EFULL) full++;
    } else if (op < 3) {
      if (!kvl_line_is_hot(l) && kvl_line_restore(l) < 0) { full++; continue; }
      int32_t t[8];
      int n = 1 + (int)(kvl_test_rand(&s) % 8);
      for (int j = 0; j < n; j++) t[j] = (int32_t)(kvl_test_rand(&s) % 50);
      int32_t at = kvl_line_len(l);
      int rc = kvl_line_append(l, t, n, KVL_WRITER_NATIVE);
      if (rc == 0) fill(l, at, at + n);
      else if (rc == KVL_EFULL) full++;
    } else if (op == 3) {
      kvl_line_commit(l);
    } else if (op == 4) {
      kvl_line_free(l);
      lines[i] = NULL;
    } else if (op == 5) {
      if (kvl_line_offload(l) == KVL_EFULL) full++;
    } else if (op == 6) {
      if (kvl_line_restore(l) == KVL_EFULL) full++;
    } else if (op == 7) {
      kvl_pool_evict(p, 1 + (int32_t)(kvl_test_rand(&s) % 4));
    } else if (op == 8) {
      kvl_line_truncate(l, (int32_t)(kvl_test_rand(&s) % (uint64_t)(kvl_line_len(l) + 1)));
    } else if (kvl_line_is_hot(l)) {
      kvl_line_t *f = kvl_line_fork(l);
      int j = (int)(kvl_test_rand(&s) % L);
      if (lines[j]) kvl_line_free(lines[j]);
      lines[j] = f;
    }
    ops++;
    if (kvl_pool_check(p, err, sizeof(err))) { fprintf(stderr, "after op %d: %s\n", it, err); bad++; break; }
    for (int j = 0; j < L; j++)
      if (lines[j] && kvl_line_is_hot(lines[j])) bad += verify(lines[j]) != 0;
    if (bad) { fprintf(stderr, "data mismatch after op %d\n", it); break; }
  }
  printf("  %d operations (%d restarts through the spill file), %d refused for room (KVL_EFULL), %d failures\n", ops,
         restarts, full, bad);
  CHECK_EQ_INT(bad, 0);
  for (int j = 0; j < L; j++) kvl_line_free(lines[j]);
  kvl_pool_io_drain(p);
  check(p);
  ADD_STATS();
#undef ADD_STATS
  printf("  evicted to cold %llu, spilled to disk %llu, dropped %llu (%llu for a full write-behind), restored %llu "
         "(%llu from disk), copy-on-write %llu\n",
         (unsigned long long)tot.evicted_to_cold, (unsigned long long)tot.spilled_to_disk, (unsigned long long)tot.dropped,
         (unsigned long long)tot.disk_busy, (unsigned long long)tot.restored, (unsigned long long)tot.restored_from_disk,
         (unsigned long long)tot.cow_copies);
  CHECK_EQ_INT(st.hot_used, 0);
  if (disk_blocks) CHECK(tot.spilled_to_disk > 0 && tot.restored_from_disk > 0);
  kvl_pool_free(p);
}

static void test_stress(void) { stress(0); }
static void test_stress_disk(void) { stress(16); }
static void test_stress_disk_writeback(void) { /* a write-behind of 2: full often */
  g_writeback = 2;
  stress(16);
  g_writeback = 0;
}

/* A line of 64 other tokens takes every hot slot of a 4-block pool: the cached blocks move
 * down a tier (and the writes to disk land: drained). */
static void push_down(kvl_pool_t *p, const int32_t *other) {
  kvl_line_t *b = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(b, other, 64, KVL_WRITER_NATIVE), 0);
  fill(b, 0, 64);
  kvl_line_free(b);
  kvl_pool_io_drain(p);
}

/* Attach toks[0..48) to a new line: the tokens found (their data verified), the line freed. */
static int32_t attach48(kvl_pool_t *p, const int32_t *toks) {
  kvl_line_t *c = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(c, toks, 48, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(verify(c), 0);
  kvl_line_free(c);
  check(p);
  return hit.n_tokens;
}

/* A pool of 4 hot, 1 cold and 4 disk blocks (and `writeback` write-behind buffers) holding
 * toks[0..48) as 3 cached hot blocks; other[] is a line of 64 different tokens. */
static kvl_pool_t *disk_pool_48(int32_t writeback, int32_t *toks, int32_t *other) {
  g_writeback = writeback;
  kvl_pool_t *p = pool_disk(4, 1, 4);
  g_writeback = 0;
  seqn(toks, 64, 700);
  seqn(other, 64, 9000);
  kvl_line_t *a = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(a, toks, 48, KVL_WRITER_NATIVE), 0);
  fill(a, 0, 48);
  kvl_line_commit(a);
  kvl_line_free(a);
  return p;
}

/* The disk tier's open file, found among this process's descriptors by the name it had
 * (the pool unlinks it once open: "/tmp/... (deleted)"), or -1. */
static int disk_fd(void) {
  char want[sizeof(g_disk) + 16], link[256], path[300];
  snprintf(want, sizeof(want), "%s (deleted)", g_disk);
  DIR *d = opendir("/proc/self/fd");
  int fd = -1;
  for (struct dirent *e; d && fd < 0 && (e = readdir(d));) {
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    const ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n > 0 && (link[n] = 0, strcmp(link, want) == 0)) fd = atoi(e->d_name);
  }
  if (d) closedir(d);
  return fd;
}

/* hot -> cold -> disk and back, bit-exact, the disk I/O on the pool's I/O thread: attach
 * stops at a block on disk until kvl_pool_prefetch has read it back (or takes it from the
 * write-behind while its write is in flight); an unreadable block, or one whose write
 * failed, is forgotten, not trusted, and the chain before it still serves. */
static void test_disk_tier(void) {
  int32_t toks[64], other[64];
  kvl_pool_t *p = disk_pool_48(0, toks, other);
  /* the writes are held: the two blocks passed on to disk are in the write-behind */
  kvl_pool_io_hold(p, true);
  kvl_line_t *b = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(b, other, 64, KVL_WRITER_NATIVE), 0); /* needs all 4 hot slots */
  fill(b, 0, 64);
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.evicted_to_cold, 3);
  CHECK_EQ_INT(st.spilled_to_disk, 2); /* the cold tier holds 1 */
  CHECK_EQ_INT(st.disk_used, 2);
  CHECK_EQ_INT(st.disk_in_flight, 2);
  check(p);
  kvl_line_free(b); /* b's blocks were never committed: dropped, hot slots free */
  CHECK_EQ_INT(kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY), 0); /* nothing to read: all in memory */
  CHECK_EQ_INT(attach48(p, toks), 48);
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.restored_from_disk, 2); /* from the write-behind */
  kvl_pool_io_hold(p, false);
  kvl_pool_io_drain(p);
  check(p);
  /* to disk again, written this time: attach alone stops at the first block on disk */
  push_down(p, other);
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.disk_used, 2);
  CHECK(attach48(p, toks) < 48);
  /* ... prefetch reads them back (the read held, so it is seen in flight) */
  kvl_pool_io_hold(p, true);
  CHECK_EQ_INT(kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY), 2);
  CHECK_EQ_INT(kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY), 2); /* asked once, read once */
  check(p);
  CHECK(attach48(p, toks) < 48); /* still in flight: not used */
  kvl_pool_io_hold(p, false);
  uint64_t before = st.restored_from_disk;
  int rounds = 0;
  while (kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY) > 0 && rounds++ < 16) {
    kvl_pool_io_drain(p);
    check(p);
  }
  CHECK_EQ_INT(attach48(p, toks), 48);
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.restored_from_disk, before + 2);
  CHECK(rounds <= 1); /* the reads asked for above were all there was to wait for */
  /* again to disk, then the file is cut: the unreadable block and what follows are not used */
  push_down(p, other);
  const int fd = disk_fd();
  CHECK(fd >= 0);
  CHECK_EQ_INT(ftruncate(fd, 0), 0);
  for (int i = 0; i < 4 && kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY) > 0; i++) kvl_pool_io_drain(p);
  CHECK(attach48(p, toks) < 48);
  kvl_pool_stats(p, &st);
  CHECK(st.disk_errors >= 1);
  struct stat sb;
  CHECK(fstat(fd, &sb) == 0 && (sb.st_mode & 0777) == 0600);
  CHECK(stat(g_disk, &sb) != 0); /* no name while in use: a crash leaves nothing behind */
  kvl_pool_free(p);
  CHECK(disk_fd() < 0); /* closed with the pool */
}

/* A write that fails (the file may not grow: RLIMIT_FSIZE) drops its block when the I/O
 * thread reports it; a full write-behind drops instead of waiting. */
static void test_disk_write_fails(void) {
  int32_t toks[64], other[64];
  kvl_pool_t *p = disk_pool_48(1, toks, other);
  struct rlimit old, none = {0, 0};
  CHECK_EQ_INT(getrlimit(RLIMIT_FSIZE, &old), 0);
  none.rlim_max = old.rlim_max;
  void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
  CHECK_EQ_INT(setrlimit(RLIMIT_FSIZE, &none), 0);
  kvl_pool_io_hold(p, true);
  kvl_line_t *b = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(b, other, 64, KVL_WRITER_NATIVE), 0);
  fill(b, 0, 64);
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.spilled_to_disk, 1); /* one write-behind buffer: */
  CHECK_EQ_INT(st.disk_busy, 1);       /* the second block is dropped, not waited for */
  check(p);
  kvl_pool_io_hold(p, false);
  kvl_pool_io_drain(p);
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, prev);
  kvl_pool_stats(p, &st);
  CHECK_EQ_INT(st.disk_errors, 1);
  CHECK_EQ_INT(st.disk_used, 0);
  check(p);
  kvl_line_free(b);
  CHECK_EQ_INT(kvl_pool_prefetch(p, toks, 48, KVL_REUSE_NATIVE_ONLY), 0);
  CHECK(attach48(p, toks) < 48);
  kvl_pool_free(p);
}

/* save -> "restart" (a new pool) -> load -> a returning request finds its blocks,
 * bit-exact; a damaged or foreign file is refused whole. */
static void test_spill_restart(void) {
  char path[] = "/tmp/kvl-spill-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  kvl_pool_t *p = pool(8, 4);
  int32_t toks[70];
  seqn(toks, 70, 300);
  kvl_line_t *a = kvl_line_new(p);
  CHECK_EQ_INT(kvl_line_append(a, toks, 40, KVL_WRITER_NATIVE), 0);
  CHECK_EQ_INT(kvl_line_append(a, toks + 40, 30, 4), 0); /* a translated tail block */
  fill(a, 0, 70);
  kvl_line_commit(a);
  char err[256];
  CHECK_EQ_INT(kvl_pool_save(p, path, "qwen-test|T4", err, sizeof(err)), 0);
  struct stat st;
  CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
  kvl_line_free(a);
  kvl_pool_free(p);

  p = pool(8, 4); /* the restarted daemon */
  int32_t n = 0;
  CHECK_EQ_INT(kvl_pool_load(p, path, "qwen-test|T4", &n, err, sizeof(err)), 0);
  CHECK_EQ_INT(n, 4);
  check(p);
  kvl_line_t *b = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(b, toks, 70, KVL_REUSE_ANY, &hit), 0);
  CHECK(hit.n_tokens == 64 && hit.n_restored == 4 && hit.n_native == 40 && hit.n_translated == 24);
  CHECK_EQ_INT(verify(b), 0);
  kvl_line_free(b);
  kvl_pool_free(p);

  p = pool(8, 4);
  CHECK_EQ_INT(kvl_pool_load(p, path, "another-model", &n, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "another model");
  /* flip one byte of block data: the whole file is refused, the pool stays empty */
  FILE *f = fopen(path, "r+b");
  fseek(f, -100, SEEK_END);
  int c = fgetc(f);
  fseek(f, -100, SEEK_END);
  fputc(c ^ 0x40, f);
  fclose(f);
  CHECK_EQ_INT(kvl_pool_load(p, path, "qwen-test|T4", &n, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, "checksum mismatch");
  CHECK_EQ_INT(n, 0);
  check(p);
  truncate(path, 50);
  CHECK_EQ_INT(kvl_pool_load(p, path, "qwen-test|T4", &n, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, "truncated");
  kvl_pool_free(p);
  unlink(path);
}

static long resident_pages(void) {
  long size = 0, rss = -1;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f && fscanf(f, "%ld %ld", &size, &rss) != 2) rss = -1;
  if (f) fclose(f);
  return rss;
}

/* kvl_huge_prefault makes the pages resident and changes no byte; a pool asked to
 * prefault reports its time and works as any other. */
static void test_prefault(void) {
  const size_t bytes = ((size_t)17 << 20) + 3 * 4096 + 100; /* not a whole number of pieces or pages */
  size_t mapped;
  uint8_t *m = kvl_huge_alloc(bytes, &mapped);
  KVL_ASSERT(m != NULL);
  m[0] = 7, m[5 << 20] = 9, m[bytes - 1] = 11; /* three pages written before */
  const long before = resident_pages();
  const double ms = kvl_huge_prefault(m, bytes);
  const long after = resident_pages();
  CHECK(ms >= 0);
  CHECK(before >= 0 && after >= 0); /* /proc/self/statm read */
  /* at least the untouched part became resident (the pages written before: huge ones at most) */
  CHECK(after - before >= (long)((bytes >> 12) - 3 * 512));
  size_t nonzero = 0;
  for (size_t i = 0; i < bytes; i++) nonzero += m[i] != 0;
  CHECK_EQ_INT((int)nonzero, 3);
  CHECK(m[0] == 7 && m[5 << 20] == 9 && m[bytes - 1] == 11);
  CHECK(kvl_huge_prefault(NULL, 0) == 0);
  kvl_huge_free(m, mapped);

  struct kvl_pool_config c = {.layout = LAYOUT, .prefault = true};
  c.hot_bytes = 64 * kvl_kv_block_bytes(&LAYOUT);
  kvl_pool_t *p;
  KVL_ASSERT(kvl_pool_new(&c, &p) == 0);
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  CHECK(st.prefault_ms > 0);
  kvl_line_t *l = kvl_line_new(p);
  int32_t tok[40];
  seqn(tok, 40, 1);
  KVL_ASSERT(kvl_line_append(l, tok, 40, KVL_WRITER_NATIVE) == 0);
  fill(l, 0, 40);
  CHECK_EQ_INT(verify(l), 0);
  check(p);
  kvl_line_free(l);
  kvl_pool_free(p);
}

int main(void) {
  RUN(test_prefault);
  RUN(test_spill_restart);
  RUN(test_share_and_provenance);
  RUN(test_translated_only);
  RUN(test_cow_and_truncate);
  RUN(test_tiers);
  RUN(test_stress);
  RUN(test_disk_tier);
  RUN(test_disk_write_fails);
  RUN(test_stress_disk);
  RUN(test_stress_disk_writeback);
  return TEST_EXIT();
}
