/* fuzz-spill.c — libFuzzer target for the spill snapshot reader (kvl_pool_load_mem, what
 * the daemon reads back at start): any input is either refused with a message and leaves
 * the pool empty, or is loaded into the cold tier so that the pool passes its sanity
 * checker and the loaded chains can be attached, offloaded, restored, extended and freed
 * with the checker passing after each step.
 *
 * Every record is checksummed, so random bytes rarely get past the checks; an input
 * refused for a checksum is therefore loaded a second time with its checksums recomputed
 * (zlib's crc32, as the reader's), so the fuzzer also reaches what a file with valid
 * checksums but arbitrary records does. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "fuzz-spill.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool g_verbose; /* FUZZ_SPILL_VERBOSE=1: say what each input does */

static void check(const kvl_pool_t *p) {
  char err[256];
  if (kvl_pool_check(p, err, sizeof(err))) {
    fprintf(stderr, "pool check: %s\n", err);
    KVL_ASSERT(!"pool check failed");
  }
}

static uint32_t crc(const uint8_t *b, size_t n) { return (uint32_t)crc32(0L, b, (uInt)n); }

/* Recompute the header's and every whole record's checksum in place. */
static void fix_checksums(uint8_t *b, size_t size, size_t rec) {
  uint32_t hl, c;
  if (size < 12) return;
  memcpy(&hl, b + 8, 4);
  if (hl < 24 || hl > size) return;
  c = crc(b, hl - 4);
  memcpy(b + hl - 4, &c, 4);
  for (size_t at = hl; rec <= size - at; at += rec) {
    c = crc(b + at, rec - 4);
    memcpy(b + at + rec - 4, &c, 4);
  }
}

/* Use what was loaded: each record's block on its own, then all records' tokens as one
 * sequence (a seed's records are one chain, in order). */
static void exercise(kvl_pool_t *p, const uint8_t *b, size_t size, size_t rec) {
  uint32_t hl;
  memcpy(&hl, b + 8, 4);
  int32_t toks[8 * KVL_KV_BLOCK];
  int32_t n = 0;
  for (size_t at = hl; rec <= size - at && n < 8 * KVL_KV_BLOCK; at += rec, n += KVL_KV_BLOCK)
    memcpy(toks + n, b + at + 8, sizeof(int32_t) * KVL_KV_BLOCK);
  struct kvl_prefix_hit hit;
  for (int32_t i = 0; i < n; i += KVL_KV_BLOCK) {
    kvl_line_t *l = kvl_line_new(p);
    KVL_ASSERT(l);
    int rc = kvl_line_attach_prefix(l, toks + i, KVL_KV_BLOCK, KVL_REUSE_ANY, &hit);
    KVL_ASSERT(rc == 0 || rc == KVL_EFULL);
    KVL_ASSERT(hit.n_tokens == hit.n_native + hit.n_translated && hit.n_tokens <= KVL_KV_BLOCK);
    check(p);
    kvl_line_free(l);
  }
  kvl_line_t *l = kvl_line_new(p);
  KVL_ASSERT(l);
  for (int policy = 0; policy < 2; policy++) {
    int rc = kvl_line_attach_prefix(l, toks, n, policy ? KVL_REUSE_ANY : KVL_REUSE_NATIVE_ONLY, &hit);
    KVL_ASSERT(rc == 0 || rc == KVL_EFULL);
    if (g_verbose) fprintf(stderr, "  %s: %d of %d tokens (%d translated)\n", policy ? "any" : "native-only", hit.n_tokens, n, hit.n_translated);
    KVL_ASSERT(kvl_line_len(l) == hit.n_tokens && hit.n_tokens % KVL_KV_BLOCK == 0 && hit.n_tokens <= n);
    if (!policy) KVL_ASSERT(hit.n_translated == 0);
    for (int32_t pos = 0; pos < hit.n_tokens; pos++) /* provenance came from the file */
      KVL_ASSERT(policy || kvl_line_writer(l, pos) == KVL_WRITER_NATIVE);
    check(p);
    if (hit.n_tokens) {
      rc = kvl_line_offload(l);
      KVL_ASSERT(rc == 0 || rc == KVL_EFULL);
      check(p);
      rc = kvl_line_restore(l);
      KVL_ASSERT(rc == 0 || rc == KVL_EFULL);
      check(p);
      if (rc == 0 && kvl_line_is_hot(l)) { /* write past the loaded blocks (a shared tail is copied first) */
        int32_t t = 7;
        rc = kvl_line_append(l, &t, 1, KVL_WRITER_NATIVE);
        KVL_ASSERT(rc == 0 || rc == KVL_EFULL);
        check(p);
      }
    }
    kvl_line_free(l);
    check(p);
    l = kvl_line_new(p);
    KVL_ASSERT(l);
  }
  kvl_line_free(l);
  kvl_pool_evict(p, SPILL_FUZZ_HOT);
  check(p);
}

/* One load into a fresh pool; returns the load's result. */
static int load(const uint8_t *b, size_t size, size_t rec) {
  kvl_pool_t *p = spill_fuzz_pool();
  char err[256] = "";
  int32_t n = -1;
  int rc = kvl_pool_load_mem(p, b, size, "fuzz.snapshot", SPILL_FUZZ_FINGERPRINT, &n, err, sizeof(err));
  struct kvl_pool_stats st;
  kvl_pool_stats(p, &st);
  if (g_verbose) fprintf(stderr, "load: %s\n", rc < 0 ? err : "ok");
  if (rc < 0) {
    KVL_ASSERT(err[0] != '\0'); /* every refusal names its reason */
    KVL_ASSERT(n == 0 && st.cold_used == 0 && st.hot_used == 0 && st.hot_cached == 0); /* nothing trusted */
  } else {
    KVL_ASSERT(n >= 0 && n <= SPILL_FUZZ_COLD && st.cold_used == n && st.hot_used == 0);
    check(p);
    exercise(p, b, size, rec);
  }
  kvl_pool_free(p);
  return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  size_t rec = 8 + (sizeof(int32_t) + sizeof(kvl_writer_t)) * KVL_KV_BLOCK +
               kvl_kv_block_bytes(&SPILL_FUZZ_LAYOUT) + 4;
  g_verbose = getenv("FUZZ_SPILL_VERBOSE") != NULL;
  if (load(data, size, rec) != KVL_EFORMAT) return 0;
  uint8_t *b = malloc(size ? size : 1);
  KVL_ASSERT(b);
  memcpy(b, data, size);
  fix_checksums(b, size, rec);
  load(b, size, rec);
  free(b);
  return 0;
}
