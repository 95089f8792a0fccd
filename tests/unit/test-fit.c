/* test-fit.c — stage-1 fitting on a synthetic pair whose target KV is an exact affine
 * function of chosen source layers: the solve recovers the maps, R² and greedy find the
 * layers, statistics survive a save/load, assignments and metrics behave. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_fit.h"
#include "kvl_test.h"

enum { LA = 4, WA = 8, LB = 3, WB = 12, NU = 2, NFIT = 3000, NVAL = 1000 };

static struct kvl_model_fingerprint fp_make(int n_layer, int n_kv, int hd, const char *name) {
  struct kvl_model_fingerprint fp;
  memset(&fp, 0, sizeof(fp));
  snprintf(fp.architecture, sizeof(fp.architecture), "qwen2");
  fp.n_layer = n_layer;
  fp.n_kv_head = n_kv;
  fp.head_dim = hd;
  fp.rope_theta = 10000;
  snprintf(fp.rope_scaling, sizeof(fp.rope_scaling), "none");
  snprintf(fp.tokenizer_hash, sizeof(fp.tokenizer_hash), "0123456789abcdef");
  snprintf(fp.name, sizeof(fp.name), "%s", name);
  return fp;
}

static struct kvl_model_fingerprint g_a, g_b;
/* True maps: target layer l, K reads A's layers {l, l+1}, V reads {0, l+1}. */
static double g_map[2][LB][(NU * WA + 1) * WB];
static int32_t k_src(int l, int j) { return (int32_t)(l + j); }
static int32_t v_src(int l, int j) { return j == 0 ? 0 : (int32_t)(l + 1); }

static void make_maps(void) {
  unsigned long long s = 42;
  for (int kv = 0; kv < 2; kv++)
    for (int l = 0; l < LB; l++)
      for (int i = 0; i < (NU * WA + 1) * WB; i++) g_map[kv][l][i] = kvl_test_randf(&s);
}

/* n tokens of random source KV (with a mean offset) and the exact targets. */
static kvl_fit_stats_t *make_stats(int n, unsigned long long seed, const double *weight) {
  char err[256];
  kvl_fit_stats_t *st = kvl_fit_stats_new(&g_a, &g_b, err, sizeof(err));
  CHECK(st != NULL);
  float *kA[LA], *vA[LA], *kB[LB], *vB[LB];
  for (int l = 0; l < LA; l++) {
    kA[l] = malloc((size_t)n * WA * sizeof(float));
    vA[l] = malloc((size_t)n * WA * sizeof(float));
    for (int i = 0; i < n * WA; i++) {
      kA[l][i] = kvl_test_randf(&seed) + 0.5f * (float)(i % WA) / WA;
      vA[l][i] = kvl_test_randf(&seed) - 0.25f;
    }
  }
  for (int l = 0; l < LB; l++) {
    kB[l] = malloc((size_t)n * WB * sizeof(float));
    vB[l] = malloc((size_t)n * WB * sizeof(float));
    for (int kv = 0; kv < 2; kv++)
      for (int t = 0; t < n; t++)
        for (int c = 0; c < WB; c++) {
          const double *M = g_map[kv][l];
          double y = M[NU * WA * WB + c]; /* intercept row */
          for (int j = 0; j < NU; j++) {
            const float *x = (kv ? vA[kv ? v_src(l, j) : 0] : kA[k_src(l, j)]) + (size_t)t * WA;
            for (int i = 0; i < WA; i++) y += x[i] * M[(j * WA + i) * WB + c];
          }
          (kv ? vB[l] : kB[l])[(size_t)t * WB + c] = (float)y;
        }
  }
  CHECK_EQ_INT(kvl_fit_stats_add(st, kA, vA, kB, vB, weight, n), 0);
  for (int l = 0; l < LA; l++) {
    free(kA[l]);
    free(vA[l]);
  }
  for (int l = 0; l < LB; l++) {
    free(kB[l]);
    free(vB[l]);
  }
  return st;
}

static kvl_fit_stats_t *g_fit, *g_val;

static void test_exact_recovery(void) {
  char err[256];
  double map[(NU * WA + 1) * WB];
  for (int kv = 0; kv < 2; kv++)
    for (int l = 0; l < LB; l++) {
      int32_t src[NU];
      for (int j = 0; j < NU; j++) src[j] = kv ? v_src(l, j) : k_src(l, j);
      struct kvl_fit_solve_opts o = {.affine = true, .lambda = 1e-12};
      CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, l, kv, src, NU, &o, map, err, sizeof(err)), 0);
      double num = 0, den = 0;
      for (int i = 0; i < (NU * WA + 1) * WB; i++) {
        num = fmax(num, fabs(map[i] - g_map[kv][l][i]));
        den = fmax(den, fabs(g_map[kv][l][i]));
      }
      if (num / den >= 1e-5) fprintf(stderr, "layer %d %c: relative error %.3g\n", l, kv ? 'V' : 'K', num / den);
      CHECK(num / den < 1e-5);
      double sse, sst;
      CHECK_EQ_INT(kvl_fit_sse(g_val, KVL_FIT_A_TO_B, l, kv, src, NU, true, map, &sse, &sst), 0);
      CHECK(sst > 0 && sse / sst < 1e-9); /* R² = 1 on unseen tokens */
      /* the check can fail: a linear fit cannot absorb the intercept, the wrong layers fit nothing */
      o.affine = false;
      CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, l, kv, src, NU, &o, map, err, sizeof(err)), 0);
      CHECK_EQ_INT(kvl_fit_sse(g_val, KVL_FIT_A_TO_B, l, kv, src, NU, false, map, &sse, &sst), 0);
      CHECK(sse / sst > 1e-3);
      int32_t wrong[NU], nw = 0; /* the two layers the target does not read */
      for (int32_t j = 0; j < LA; j++)
        if (j != src[0] && j != src[1]) wrong[nw++] = j;
      o.affine = true;
      CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, l, kv, wrong, NU, &o, map, err, sizeof(err)), 0);
      CHECK_EQ_INT(kvl_fit_sse(g_val, KVL_FIT_A_TO_B, l, kv, wrong, NU, true, map, &sse, &sst), 0);
      CHECK(sse / sst > 0.2);
    }
  /* the reverse direction is solvable too (not exact) */
  int32_t one = 0;
  struct kvl_fit_solve_opts o = {.affine = true, .lambda = 1e-6};
  double rmap[(WB + 1) * WA];
  CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_B_TO_A, 1, KVL_TRANSLATOR_K, &one, 1, &o, rmap, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fit_map_rows(g_fit, KVL_FIT_B_TO_A, 1, true), WB + 1);
  /* refusals */
  int32_t bad = LA;
  CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, 0, KVL_TRANSLATOR_K, &bad, 1, &o, map, err, sizeof(err)),
               KVL_ERANGE);
  CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, LB, KVL_TRANSLATOR_K, &one, 1, &o, map, err, sizeof(err)),
               KVL_ERANGE);
}

static void test_assignments(void) {
  char err[256];
  double r2[LA * LB];
  for (int kv = 0; kv < 2; kv++) {
    CHECK_EQ_INT(kvl_fit_pair_r2(g_fit, g_val, KVL_FIT_A_TO_B, kv, 1e-6, r2, err, sizeof(err)), 0);
    for (int l = 0; l < LB; l++) {
      int32_t got[NU], greedy[NU];
      kvl_fit_assign_r2(r2, LA, LB, l, NU, got);
      CHECK_EQ_INT(kvl_fit_assign_greedy(g_fit, g_val, KVL_FIT_A_TO_B, l, kv, NU, 1e-6, greedy, err, sizeof(err)), 0);
      if (greedy[0] > greedy[1]) {
        int32_t x = greedy[0];
        greedy[0] = greedy[1];
        greedy[1] = x;
      }
      for (int j = 0; j < NU; j++) {
        int32_t want = kv ? v_src(l, j) : k_src(l, j);
        CHECK_EQ_INT(got[j], want);
        CHECK_EQ_INT(greedy[j], want);
      }
    }
  }
  /* relative depth: a window centred on l·(Ls−1)/(Lt−1), shifted inward at the ends */
  int32_t d[4];
  kvl_fit_assign_depth(24, 28, 0, 4, d);
  CHECK(d[0] == 0 && d[3] == 3);
  kvl_fit_assign_depth(24, 28, 27, 4, d);
  CHECK(d[0] == 20 && d[3] == 23);
  kvl_fit_assign_depth(24, 28, 14, 1, d);
  CHECK_EQ_INT(d[0], 12); /* 14·23/27 = 11.93 */
  kvl_fit_assign_depth(28, 24, 23, 1, d);
  CHECK_EQ_INT(d[0], 27);
  kvl_fit_assign_depth(28, 24, 12, 2, d);
  CHECK(d[0] == 14 && d[1] == 15); /* c = 14.09: window [13.6, 14.6] rounds to 14 */
}

static void test_weights_and_cka(void) {
  char err[256];
  /* weight 3 on every token: the same solution as weight 1 (ridge is scale-free) */
  double *w = malloc(NFIT * sizeof(double));
  for (int i = 0; i < NFIT; i++) w[i] = 3.0;
  kvl_fit_stats_t *s3 = make_stats(NFIT, 1, w); /* g_fit's tokens */
  free(w);
  int32_t src[NU] = {0, 1};
  double m1[(NU * WA + 1) * WB], m3[(NU * WA + 1) * WB];
  struct kvl_fit_solve_opts o = {.affine = true, .lambda = 1e-3};
  CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, 0, KVL_TRANSLATOR_K, src, NU, &o, m1, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fit_solve(s3, KVL_FIT_A_TO_B, 0, KVL_TRANSLATOR_K, src, NU, &o, m3, err, sizeof(err)), 0);
  double dmax = 0;
  for (int i = 0; i < (NU * WA + 1) * WB; i++) dmax = fmax(dmax, fabs(m1[i] - m3[i]));
  CHECK(dmax < 1e-9);
  kvl_fit_stats_free(s3);
  /* CKA: in [0, 1]; B's K layer 0 (from A's 0 and 1) is closer to A's 0 than to A's 3 */
  double cka[LA * LB];
  CHECK_EQ_INT(kvl_fit_cka(g_val, KVL_TRANSLATOR_K, cka), 0);
  for (int i = 0; i < LA * LB; i++) CHECK(cka[i] >= 0 && cka[i] <= 1 + 1e-12);
  CHECK(cka[0 * LB + 0] > 5 * cka[3 * LB + 0]);
}

static void test_save_load(void) {
  char dir[] = "/tmp/kvl-fit-XXXXXX", path[256], err[256];
  CHECK(mkdtemp(dir) != NULL);
  snprintf(path, sizeof(path), "%s/s.stats", dir);
  CHECK_EQ_INT(kvl_fit_stats_save(g_fit, path, "opts-1", err, sizeof(err)), 0);
  kvl_fit_stats_t *l = NULL;
  CHECK_EQ_INT(kvl_fit_stats_load(path, "opts-1", &g_a, &g_b, &l, err, sizeof(err)), 0);
  CHECK(l && kvl_fit_stats_tokens(l) == NFIT && kvl_fit_stats_samples(l) == 1);
  int32_t src[NU] = {1, 2};
  double m1[(NU * WA + 1) * WB], m2[(NU * WA + 1) * WB];
  struct kvl_fit_solve_opts o = {.affine = true, .lambda = 1e-4};
  CHECK_EQ_INT(kvl_fit_solve(g_fit, KVL_FIT_A_TO_B, 1, KVL_TRANSLATOR_K, src, NU, &o, m1, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fit_solve(l, KVL_FIT_A_TO_B, 1, KVL_TRANSLATOR_K, src, NU, &o, m2, err, sizeof(err)), 0);
  CHECK(memcmp(m1, m2, sizeof(m1)) == 0);
  kvl_fit_stats_free(l);
  /* other options, other models, not a stats file: refused by name */
  CHECK_EQ_INT(kvl_fit_stats_load(path, "opts-2", &g_a, &g_b, &l, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "opts-1");
  CHECK(l == NULL);
  CHECK_EQ_INT(kvl_fit_stats_load(path, "opts-1", &g_b, &g_a, &l, err, sizeof(err)), KVL_EMISMATCH);
  FILE *f = fopen(path, "r+b");
  fputc('X', f);
  fclose(f);
  CHECK_EQ_INT(kvl_fit_stats_load(path, "opts-1", &g_a, &g_b, &l, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, path);
  unlink(path);
  rmdir(dir);
}

static void test_metrics(void) {
  float p[5] = {1, 2, 3, 4, 5}, q[5] = {5, 4, 3, 2, 1};
  kvl_log_softmax(p, 1, 5);
  kvl_log_softmax(q, 1, 5);
  double s = 0;
  for (int i = 0; i < 5; i++) s += exp(p[i]);
  CHECK(fabs(s - 1) < 1e-6);
  bool same;
  CHECK(kvl_kl_row(p, p, 5, &same) < 1e-9 && same);
  double kl = kvl_kl_row(p, q, 5, &same), ref = 0;
  for (int i = 0; i < 5; i++) ref += exp(p[i]) * (p[i] - q[i]);
  CHECK(!same && fabs(kl - ref) < 1e-6 && kl > 0);
  double d[40], lo, hi;
  for (int i = 0; i < 40; i++) d[i] = 1.5;
  kvl_bootstrap_ci(d, 40, 500, 1, &lo, &hi);
  CHECK(lo == 1.5 && hi == 1.5);
  for (int i = 0; i < 40; i++) d[i] = i % 2 ? 1.0 : -1.0; /* mean 0 */
  kvl_bootstrap_ci(d, 40, 2000, 1, &lo, &hi);
  CHECK(lo < 0 && hi > 0 && hi - lo < 1.0);
}

int main(void) {
  g_a = fp_make(LA, 2, WA / 2, "A");
  g_b = fp_make(LB, 3, WB / 3, "B");
  make_maps();
  g_fit = make_stats(NFIT, 1, NULL);
  g_val = make_stats(NVAL, 2, NULL);
  RUN(test_exact_recovery);
  RUN(test_assignments);
  RUN(test_weights_and_cka);
  RUN(test_save_load);
  RUN(test_metrics);
  kvl_fit_stats_free(g_fit);
  kvl_fit_stats_free(g_val);
  return TEST_EXIT();
}
