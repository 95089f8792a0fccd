/* fuzz-samples.c — libFuzzer target for the distillation sample store reader
 * (kvl_distill_samples_load_mem): any input gives either samples whose every count is
 * positive and whose arrays are as long as those counts say, or an error with a message;
 * nothing is allocated beyond what the input can hold. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_distill.h"
#include "kvl_error.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char err[256] = "";
  struct kvl_distill_sample *s;
  int32_t n;
  if (kvl_distill_samples_load_mem(data, size, "fuzz", &s, &n, err, sizeof(err)) < 0) {
    KVL_ASSERT(err[0] != '\0'); /* every refusal names its reason */
    KVL_ASSERT(s == NULL && n == 0);
    return 0;
  }
  volatile int64_t sink = 0;
  for (int32_t i = 0; i < n; i++) {
    const struct kvl_distill_sample *x = &s[i];
    KVL_ASSERT(x->P > 0 && x->m > 0 && x->n_layer_src > 0 && x->w_src > 0 && x->k > 0);
    /* touch the last element of every array: ASan reports a short allocation */
    size_t kv = (size_t)x->n_layer_src * x->P * x->w_src, top = (size_t)x->m * x->k;
    sink += (int64_t)x->tokens[x->m - 1] + x->src_k[kv - 1] + x->src_v[kv - 1] + (int64_t)x->top_ids[top - 1] +
            (int64_t)(x->top_lp[top - 1] == x->top_lp[top - 1]); /* no float -> int conversion of arbitrary bits */
    KVL_ASSERT(kvl_distill_sample_bytes(x) > 0);
  }
  (void)sink;
  for (int32_t i = 0; i < n; i++) kvl_distill_sample_free(&s[i]);
  free(s);
  return 0;
}
