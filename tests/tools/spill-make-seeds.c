/* spill-make-seeds.c — writes spill snapshots of fuzz-spill's pool (tests/fuzz/fuzz-spill.h):
 * one chain with native and translated blocks, two lines sharing a prefix, an empty
 * pool, and one written for another fingerprint: the seed corpus of fuzz-spill.
 *
 *   spill-make-seeds DIR
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../fuzz/fuzz-spill.h"
#include "kvl_kernels.h"

/* Give the line's positions [from, to) K/V that depend on token and position. */
static void fill(kvl_line_t *l, int32_t from, int32_t to) {
  const int32_t *tok = kvl_line_tokens(l);
  const int32_t *tables[] = {kvl_line_block_table(l)};
  const struct kvl_kv_layout *ly = &SPILL_FUZZ_LAYOUT;
  int32_t seq = 0;
  for (int32_t pos = from; pos < to; pos++) {
    float k[4], v[4];
    for (int i = 0; i < 4; i++) {
      k[i] = (float)(tok[pos] % 97) / 8.0f + (float)i;
      v[i] = (float)pos / 16.0f - (float)i;
    }
    kvl_kv_store(ly, kvl_pool_base(kvl_line_pool(l)), 0, 1, k, v, &pos, &seq, tables);
  }
}

static kvl_line_t *line(kvl_pool_t *p, const int32_t *tok, int32_t n_native, int32_t n_translated) {
  kvl_line_t *l = kvl_line_new(p);
  KVL_ASSERT(l && kvl_line_append(l, tok, n_native, KVL_WRITER_NATIVE) == 0);
  if (n_translated) KVL_ASSERT(kvl_line_append(l, tok + n_native, n_translated, 1) == 0);
  fill(l, 0, n_native + n_translated);
  kvl_line_commit(l);
  return l;
}

static void save(kvl_pool_t *p, const char *dir, const char *name, const char *fp) {
  char path[512], err[256];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  if (kvl_pool_save(p, path, fp, err, sizeof(err))) {
    fprintf(stderr, "spill-make-seeds: %s\n", err);
    exit(1);
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: spill-make-seeds DIR\n");
    return 2;
  }
  int32_t tok[64];
  for (int i = 0; i < 64; i++) tok[i] = 100 + i * 7;

  kvl_pool_t *p = spill_fuzz_pool();
  save(p, argv[1], "empty.seed", SPILL_FUZZ_FINGERPRINT);
  kvl_line_t *a = line(p, tok, 40, 24); /* blocks: native, native, mixed, translated */
  save(p, argv[1], "chain.seed", SPILL_FUZZ_FINGERPRINT);
  save(p, argv[1], "other-fingerprint.seed", "other|T2");
  kvl_line_free(a);
  kvl_pool_free(p);

  p = spill_fuzz_pool(); /* two lines sharing their first 32 tokens */
  a = line(p, tok, 48, 0);
  kvl_line_free(a);
  int32_t tok2[48];
  for (int i = 0; i < 48; i++) tok2[i] = i < 32 ? tok[i] : 5000 + i;
  kvl_line_t *b = kvl_line_new(p);
  struct kvl_prefix_hit hit;
  KVL_ASSERT(kvl_line_attach_prefix(b, tok2, 48, KVL_REUSE_NATIVE_ONLY, &hit) == 0 && hit.n_tokens == 32);
  KVL_ASSERT(kvl_line_append(b, tok2 + 32, 16, KVL_WRITER_NATIVE) == 0);
  fill(b, 32, 48);
  kvl_line_commit(b);
  save(p, argv[1], "shared-prefix.seed", SPILL_FUZZ_FINGERPRINT);
  kvl_line_free(b);
  kvl_pool_free(p);
  return 0;
}
