/* fuzz-spill.h — the pool that fuzz-spill loads inputs into and that spill-make-seeds
 * writes its seeds from: the spill header must match it byte for byte to get past the
 * header check, so both take the geometry and fingerprint from here. */
#ifndef KVL_FUZZ_SPILL_H
#define KVL_FUZZ_SPILL_H

#include "kvl_error.h"
#include "kvl_kvpool.h"

/* 1 layer, 1 KV head of 4: a 256-byte bf16 block, so records stay small for the fuzzer */
static const struct kvl_kv_layout SPILL_FUZZ_LAYOUT = {1, 1, 4, KVL_KV_BF16};
#define SPILL_FUZZ_FINGERPRINT "fuzz|T1"
#define SPILL_FUZZ_HOT 4  /* blocks */
#define SPILL_FUZZ_COLD 6 /* blocks: fewer than a large seed holds, so loading stops early */

static inline kvl_pool_t *spill_fuzz_pool(void) {
  size_t bb = kvl_kv_block_bytes(&SPILL_FUZZ_LAYOUT);
  struct kvl_pool_config c = {.layout = SPILL_FUZZ_LAYOUT, .hot_bytes = SPILL_FUZZ_HOT * bb,
                              .cold_bytes = SPILL_FUZZ_COLD * bb};
  kvl_pool_t *p;
  KVL_ASSERT(kvl_pool_new(&c, &p) == 0);
  return p;
}

#endif
