/* bench_backend.h — the benchmarks' --backend cpu|cuda|cuda-sim, for those that link the
 * kernels (bench_common does not: bench-roofline needs none of them). cuda-sim: the CUDA
 * backend compiled for the CPU (kernels/cuda/sim.h): its copies and waits are the
 * device's, its times are not (a check of what a GPU run will do, not a measurement). */
#ifndef KVL_BENCH_BACKEND_H
#define KVL_BENCH_BACKEND_H

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "kvl_kernels.h"
#include "sim-ops.h"

static bool kvl_bench_sim_; /* --backend cuda-sim */

/* --backend cpu|cuda|cuda-sim: sets *cuda (cuda-sim too) and returns 0, or says what is
 * wrong (as `prog`) and returns 2 (the usage status). */
static inline int kvl_bench_backend_opt(const char *prog, const char *arg, bool *cuda) {
  if (strcmp(arg, "cpu") && strcmp(arg, "cuda") && strcmp(arg, "cuda-sim")) {
    fprintf(stderr, "%s: --backend is cpu, cuda or cuda-sim, not '%s'\n", prog, arg);
    return 2;
  }
  kvl_bench_sim_ = !strcmp(arg, "cuda-sim");
  *cuda = strcmp(arg, "cpu") != 0;
  return 0;
}

/* The backend asked for: the CPU's, or the CUDA one; NULL with the reason said (as
 * `prog`) where there is no GPU or no CUDA build. */
static inline kvl_backend_t *kvl_bench_backend(const char *prog, bool cuda) {
  char why[256];
  kvl_backend_t *be = !cuda            ? kvl_backend_cpu()
                       : kvl_bench_sim_ ? kvl_backend_cuda_sim(why, sizeof(why))
                                        : kvl_backend_cuda(why, sizeof(why));
  if (!be) fprintf(stderr, "%s: --backend %s: %s\n", prog, kvl_bench_sim_ ? "cuda-sim" : "cuda", why);
  return be;
}

/* res's "attn": the products of be's attention over this cache (kvl_backend_attention;
 * left out for backends that do not say) */
static inline void kvl_bench_attn_field(json_t *res, const kvl_backend_t *be, bool kv_bf16) {
  const char *attn = kvl_backend_attention(be, kv_bf16);
  if (res && attn) json_object_set_new(res, "attn", json_string(attn));
}

#endif
