/* simd_avx2.c — AVX2 + FMA level (compiled with -mavx2 -mfma; called only after the
 * processor reported both). */
#include <immintrin.h>

#include "../backend-impl.h"

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static float dot(const float *a, const float *b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* 4 weight rows x 2 tokens: 8 accumulators, each weight load feeds 2 FMAs. */
static void kernel_4x2(const float *w, int64_t K, const float *x0, const float *x1, float out[2][4]) {
  __m256 acc[2][4];
  for (int t = 0; t < 2; t++)
    for (int r = 0; r < 4; r++) acc[t][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 a = _mm256_loadu_ps(x0 + k), b = _mm256_loadu_ps(x1 + k);
    for (int r = 0; r < 4; r++) {
      __m256 wr = _mm256_loadu_ps(w + r * K + k);
      acc[0][r] = _mm256_fmadd_ps(wr, a, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(wr, b, acc[1][r]);
    }
  }
  for (int r = 0; r < 4; r++) {
    out[0][r] = hsum8(acc[0][r]);
    out[1][r] = hsum8(acc[1][r]);
    for (int64_t j = k; j < K; j++) {
      out[0][r] += w[r * K + j] * x0[j];
      out[1][r] += w[r * K + j] * x1[j];
    }
  }
}

static void gemm_tile(const float *w, int nr, const float *x, int64_t ldx, int nt, float *y, int64_t ldy, int64_t K) {
  int r = 0;
  for (; r + 4 <= nr; r += 4) {
    int t = 0;
    for (; t + 2 <= nt; t += 2) {
      float o[2][4];
      kernel_4x2(w + (int64_t)r * K, K, x + t * ldx, x + (t + 1) * ldx, o);
      for (int i = 0; i < 4; i++) {
        y[t * ldy + r + i] = o[0][i];
        y[(t + 1) * ldy + r + i] = o[1][i];
      }
    }
    for (; t < nt; t++)
      for (int i = 0; i < 4; i++) y[t * ldy + r + i] = dot(w + (int64_t)(r + i) * K, x + t * ldx, K);
  }
  for (; r < nr; r++)
    for (int t = 0; t < nt; t++) y[t * ldy + r] = dot(w + (int64_t)r * K, x + t * ldx, K);
}

static void axpy(float a, const float *x, float *y, int64_t n) {
  __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; i++) y[i] += a * x[i];
}

static void scale(float a, float *y, int64_t n) {
  __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
  for (; i < n; i++) y[i] *= a;
}

const struct kvl__simd kvl__simd_avx2 = {"avx2", dot, gemm_tile, axpy, scale, kvl_dequant_row_ref, kvl__swiglu_scalar};
