/* test-cuda-sim.c — the CUDA backend's attention kernels (kernels/cuda/ops.cu) run on the
 * CPU under kernels/cuda/sim.h against the scalar reference, with the plan forced (no key
 * split, an H100's 132 multiprocessors, the warp path): every plan's indexing, tiling,
 * masking, reductions and merge. The other ops, and the whole backend, run under the same
 * simulation in test-cuda-ops --sim (cuda-ops-sim). What only a GPU run
 * shows: speed, and anything of the device's own (memory ordering beyond the barriers,
 * resource limits, nvcc's code).
 *
 * Bounds as the gpu suite's for these ops: normalised squared error 1e-10 (fp32 kernels
 * against the references, whose sums run in another order or in double). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kvl_test.h"
#include "../ops_fixtures.h"
#include "sim-ops.h"

static void report(const char *op, const char *desc, const char *plan, double err, double bound) {
  const bool ok = err <= bound;
  printf("%s %-9s %-34s %-30s nmse %.3e (bound %.0e)\n", ok ? "ok  " : "FAIL", op, desc, plan, err, bound);
  CHECK(ok);
}

/* the plan the sim took: the tiled path for head widths 64 and 128 unless forced */
static void check_plan(const struct attn_fixture *f, const char *plan, bool forced_warp) {
  const bool tiled = !forced_warp && (f->l.head_dim == 64 || f->l.head_dim == 128);
  CHECK(strncmp(plan, tiled ? "tiled" : "warp", tiled ? 5 : 4) == 0);
}

static int sim_sm; /* the multiprocessors the attention plans for (0: no key split) */
static char last_plan[64];
static void run_sim(kvl_backend_t *be, const struct kvl_attn_args *a) {
  (void)be;
  kvl__cu_sim_attention(a, sim_sm, last_plan, sizeof(last_plan));
}

/* The harness's eight cases (head widths 64, 128, 32, 16; fp32 and bf16 KV), each run as
 * the mixed batch (a prefill chunk over block boundaries and two decode tokens) in one key
 * chunk and in several (an H100's 132 multiprocessors), then its two decode tokens alone
 * (grouped-query packing and key chunks), then forced onto the warp path. */
static void test_attention(void) {
  for (int c = 0; c < ATTN_N_CASES; c++) {
    struct attn_fixture f;
    char desc[96];
    attn_fixture_case(&f, c, desc, sizeof(desc));
    for (int run = 0; run < 4; run++) {
      const struct attn_fixture g = run == 2 ? attn_fixture_decode(&f) : f;
      sim_sm = run == 0 ? 0 : 132;
      if (run == 3) setenv("KVL_CUDA_ATTN", "warp", 1);
      float *o, *orf;
      const double e = attn_fixture_run(&g, NULL, run_sim, &o, &orf);
      if (run == 3) unsetenv("KVL_CUDA_ATTN");
      char d2[128];
      snprintf(d2, sizeof(d2), "%s%s", desc, run == 2 ? " decode" : "");
      report("attention", d2, last_plan, e, 1e-10);
      check_plan(&g, last_plan, run == 3);
      const bool tiled = run < 3 && (f.l.head_dim == 64 || f.l.head_dim == 128);
      /* the mixed batch: tiles 16 + 16 + 1 of the prefill chunk and one per decode token;
       * the decode tokens alone: one tile each with the group's query heads in it; keys
       * 0..95 in one chunk, or in three of 32 for 132 multiprocessors */
      char want[64];
      snprintf(want, sizeof(want), "tiled tiles=%d hpc=%d split=%s", run == 2 ? 2 : 5,
               run == 2 ? f.a.n_head / f.l.n_kv_head : 1, run == 0 ? "1x96" : "3x32");
      if (tiled && strcmp(last_plan, want)) printf("FAIL plan %s, expected %s\n", last_plan, want);
      if (tiled) CHECK(strcmp(last_plan, want) == 0);
      free(o), free(orf);
    }
    attn_fixture_free(&f);
  }
}

int main(void) {
  RUN(test_attention);
  return TEST_EXIT();
}
