/* bench_backend.h — the benchmarks' --backend cpu|cuda, for those that link the kernels
 * (bench_common does not: bench-roofline needs none of them). */
#ifndef KVL_BENCH_BACKEND_H
#define KVL_BENCH_BACKEND_H

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "kvl_kernels.h"

/* --backend cpu|cuda: sets *cuda and returns 0, or says what is wrong (as `prog`) and
 * returns 2 (the usage status). */
static inline int kvl_bench_backend_opt(const char *prog, const char *arg, bool *cuda) {
  if (strcmp(arg, "cpu") && strcmp(arg, "cuda")) {
    fprintf(stderr, "%s: --backend is cpu or cuda, not '%s'\n", prog, arg);
    return 2;
  }
  *cuda = !strcmp(arg, "cuda");
  return 0;
}

/* The backend asked for: the CPU's, or the CUDA one; NULL with the reason said (as
 * `prog`) where there is no GPU or no CUDA build. */
static inline kvl_backend_t *kvl_bench_backend(const char *prog, bool cuda) {
  char why[256];
  kvl_backend_t *be = cuda ? kvl_backend_cuda(why, sizeof(why)) : kvl_backend_cpu();
  if (!be) fprintf(stderr, "%s: --backend cuda: %s\n", prog, why);
  return be;
}

/* res's "attn": the products of be's attention over this cache (kvl_backend_attention;
 * left out for backends that do not say) */
static inline void kvl_bench_attn_field(json_t *res, const kvl_backend_t *be, bool kv_bf16) {
  const char *attn = kvl_backend_attention(be, kv_bf16);
  if (res && attn) json_object_set_new(res, "attn", json_string(attn));
}

#endif
