/* simd_scalar.c — the portable level: plain C the compiler may vectorise for the
 * baseline ISA. Used on processors without AVX2 and as a forced path in tests. */
#include <math.h>

#include "../backend-impl.h"

static float dot(const float *a, const float *b, int64_t n) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; i++) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

static void gemm_tile(const float *w, int nr, const float *x, int64_t ldx, int nt, float *y, int64_t ldy, int64_t K) {
  for (int t = 0; t < nt; t++)
    for (int r = 0; r < nr; r++) y[t * ldy + r] = dot(w + (int64_t)r * K, x + t * ldx, K);
}

static void axpy(float a, const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale(float a, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] *= a;
}

void kvl__swiglu_scalar(const float *g, const float *u, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

const struct kvl__simd kvl__simd_scalar = {"scalar", dot, gemm_tile, axpy, scale, kvl_dequant_row_ref, kvl__swiglu_scalar,
                                           NULL, NULL};
