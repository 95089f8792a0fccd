/* qmatmul_ab.c — the tokens-in-lanes int8 matmul of two source trees called in turn
 * (bench/kernel-ab/qmatmul-ab builds it): on a shared host the speed drifts by 10-30 %
 * within seconds, so separate runs of an old and a new build cannot tell a 5 % change
 * from the neighbours; calls that alternate, each tree on its own copy of the weights,
 * with the order swapped every round, see the same drift. Prints, per format and token
 * count, each tree's median and fastest GOP/s, the ratio of medians (b / a), and the
 * largest relative difference between their outputs (0 when the change is exact).
 *
 *   qmatmul-ab-run T[,T...] ROUNDS COPIES   COPIES weight matrices per tree cycled through
 *                                           (1: the matrix stays in L3; 8 or more: streamed
 *                                           from memory, as a model's layers are)
 *
 * qmm_a / qmm_b: kvl__qmatmul_<level> of each tree, renamed at compile time. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_quant.h"

typedef int qmm_fn(uint32_t, const void *, size_t, int64_t, int64_t, const int8_t *, const float *, const int32_t *, int,
                   const float *, float *);
qmm_fn qmm_a, qmm_b;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* the formats: block elements, block bytes, where their fp16 factors sit (set to a sane
 * value: random bits would make infinities and NaNs, and denormals slow the float units) */
static const struct {
  uint32_t type;
  const char *name;
  int elems, bytes, f16[2];
} formats[] = {{KVL_TYPE_Q8_0, "Q8_0", 32, 34, {0, -1}},
               {KVL_TYPE_Q5_0, "Q5_0", 32, 22, {0, -1}},
               {KVL_TYPE_Q4_K, "Q4_K", 256, 144, {0, 2}},
               {KVL_TYPE_Q6_K, "Q6_K", 256, 210, {208, -1}}};

static void one(int f, int64_t N, int64_t K, int T, int rounds, int copies) {
  const size_t rb = (size_t)(K / formats[f].elems) * formats[f].bytes, mat = rb * (size_t)N;
  uint8_t *wa = malloc(mat * copies), *wb = malloc(mat * copies);
  int8_t *xq = malloc((size_t)T * K);
  float *xd = malloc((size_t)T * (K / 32) * sizeof(float)), *ya = malloc((size_t)T * N * sizeof(float)),
        *yb = malloc((size_t)T * N * sizeof(float));
  int32_t *xs = malloc((size_t)T * (K / 16) * sizeof(int32_t));
  double *ta = malloc(rounds * sizeof(double)), *tb = malloc(rounds * sizeof(double));
  if (!wa || !wb || !xq || !xd || !ya || !yb || !xs || !ta || !tb) { fprintf(stderr, "out of memory\n"); exit(1); }
  srand(1);
  for (size_t i = 0; i < mat * copies; i++) wa[i] = (uint8_t)rand();
  for (size_t b = 0; b < mat * copies / formats[f].bytes; b++)
    for (int h = 0; h < 2; h++)
      if (formats[f].f16[h] >= 0) wa[b * formats[f].bytes + formats[f].f16[h]] = 0, wa[b * formats[f].bytes + formats[f].f16[h] + 1] = 0x20;
  memcpy(wb, wa, mat * copies);
  for (int64_t i = 0; i < (int64_t)T * K; i++) xq[i] = (int8_t)(rand() % 255 - 127);
  for (int64_t i = 0; i < (int64_t)T * (K / 32); i++) xd[i] = 0.01f;
  for (int64_t i = 0; i < (int64_t)T * (K / 16); i++) {
    xs[i] = 0;
    for (int j = 0; j < 16; j++) xs[i] += xq[i * 16 + j];
  }
  qmm_a(formats[f].type, wa, rb, N, K, xq, xd, xs, T, NULL, ya);
  qmm_b(formats[f].type, wb, rb, N, K, xq, xd, xs, T, NULL, yb);
  double diff = 0;
  for (int64_t i = 0; i < (int64_t)T * N; i++) {
    const double d = ya[i] > yb[i] ? ya[i] - yb[i] : yb[i] - ya[i], s = ya[i] < 0 ? -ya[i] : ya[i];
    if (d / (s + 1.0) > diff) diff = d / (s + 1.0);
  }
  for (int r = 0; r < rounds; r++) {
    const size_t c = (size_t)(r % copies) * mat;
    for (int k = 0; k < 2; k++) {
      const bool a_now = (k == 0) == ((r & 1) == 0); /* a first on even rounds, b first on odd */
      const double t0 = now();
      if (a_now) qmm_a(formats[f].type, wa + c, rb, N, K, xq, xd, xs, T, NULL, ya);
      else qmm_b(formats[f].type, wb + c, rb, N, K, xq, xd, xs, T, NULL, yb);
      (a_now ? ta : tb)[r] = now() - t0;
    }
  }
  qsort(ta, rounds, sizeof(double), cmp);
  qsort(tb, rounds, sizeof(double), cmp);
  const double gop = 2.0 * N * K * T * 1e-9;
  printf("%-5s %lldx%lld T=%-4d a %6.1f (best %6.1f)  b %6.1f (best %6.1f) GOP/s  b/a %.3f  max rel diff %.1e\n",
         formats[f].name, (long long)N, (long long)K, T, gop / ta[rounds / 2], gop / ta[0], gop / tb[rounds / 2],
         gop / tb[0], ta[rounds / 2] / tb[rounds / 2], diff);
  free(wa), free(wb), free(xq), free(xd), free(ya), free(yb), free(xs), free(ta), free(tb);
}

int main(int argc, char **argv) {
  if (argc != 4 && argc != 6) {
    fprintf(stderr, "usage: qmatmul-ab-run T[,T...] ROUNDS COPIES [N K]\n");
    return 2;
  }
  /* default: 4864 x 1536 (between the models' FFN shapes: the 0.5B's 4864 x 896 and the
   * 1.5B's 8960 x 1536); the 1.5B's down projection is 1536 x 8960 */
  const int64_t N = argc == 6 ? atoll(argv[4]) : 4864, K = argc == 6 ? atoll(argv[5]) : 1536;
  if (N < 1 || K < 256 || K % 256) { fprintf(stderr, "qmatmul-ab-run: N >= 1 and K a multiple of 256\n"); return 2; }
  const int rounds = atoi(argv[2]), copies = atoi(argv[3]);
  if (rounds < 1 || copies < 1) { fprintf(stderr, "qmatmul-ab-run: ROUNDS and COPIES must be >= 1\n"); return 2; }
  char *list = strdup(argv[1]);
  for (char *save, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    const int T = atoi(tok);
    if (T < 1) { fprintf(stderr, "qmatmul-ab-run: bad token count '%s'\n", tok); return 2; }
    for (int f = 0; f < 4; f++) one(f, N, K, T, rounds, copies);
  }
  free(list);
  return 0;
}
