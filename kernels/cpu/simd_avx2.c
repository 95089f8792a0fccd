/* simd_avx2.c — AVX2 + FMA level (compiled with -mavx2 -mfma; called only after the
 * processor reported both). */
#include <immintrin.h>

#include "../backend-impl.h"
#include "vmath_avx2.h"

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

/* ---- prefill products in outer-product form ------------------------------------------
 *
 * Tokens along the lanes: the activations of 16 tokens are interleaved per element
 * (xg[k][16], kvl__simd.gemm_xt), a weight element is broadcast, and each (row, token)
 * lane accumulates w[r][k] * x[t][k] by one FMA per k, in k order. A lane's arithmetic is
 * the same in every kernel shape below, so a token gets the same bits alone or in any
 * batch (no horizontal sums, no blocking of k), and the batch can be chunked anyhow. */

/* NR rows (<= 6) x NV vectors of 8 tokens (1 or 2): 12 accumulators at most. With `more`
 * the accumulators start from y (an earlier range of k: fp32 stores and loads are exact,
 * so splitting k changes no bit). */
static inline __attribute__((always_inline)) void xt_block(const float *w, int64_t ldw, int64_t K, const float *xg,
                                                          float *y, int64_t ldy, int nt, bool more, const int NR,
                                                          const int NV) {
  __m256 acc[6][2];
  float buf[16] = {0};
#pragma GCC unroll 6
  for (int r = 0; r < NR; r++) {
    if (more)
      for (int t = 0; t < nt; t++) buf[t] = y[t * ldy + r];
    acc[r][0] = _mm256_loadu_ps(buf);
    if (NV > 1) acc[r][1] = _mm256_loadu_ps(buf + 8);
  }
  for (int64_t k = 0; k < K; k++) {
    __m256 x0 = _mm256_loadu_ps(xg + 16 * k), x1 = NV > 1 ? _mm256_loadu_ps(xg + 16 * k + 8) : x0;
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      __m256 b = _mm256_broadcast_ss(w + r * ldw + k);
      acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
      if (NV > 1) acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < NR; r++) {
    _mm256_storeu_ps(buf, acc[r][0]);
    if (NV > 1) _mm256_storeu_ps(buf + 8, acc[r][1]);
    for (int t = 0; t < nt; t++) y[t * ldy + r] = buf[t];
  }
}

#define XT_ROWS(NV)                                                                                             \
  switch (n) {                                                                                                  \
  case 6: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 6, NV); break;                                         \
  case 5: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 5, NV); break;                                         \
  case 4: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 4, NV); break;                                         \
  case 3: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 3, NV); break;                                         \
  case 2: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 2, NV); break;                                         \
  default: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 1, NV); break;                                        \
  }

static void gemm_xt(const float *w, int64_t ldw, int nr, const float *xg, int nt, float *y, int64_t ldy, int64_t K,
                    bool more) {
  for (int r = 0; r < nr; r += 6) {
    const int n = nr - r < 6 ? nr - r : 6;
    const float *wr = w + (int64_t)r * ldw;
    if (nt > 8) {
      XT_ROWS(2)
    } else {
      XT_ROWS(1)
    }
  }
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

/* silu(g) * u = g / (1 + e^-g) * u, with the vector exp */
static void swiglu(const float *g, const float *u, float *y, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 e = kvl__exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  if (i < n) kvl__swiglu_scalar(g + i, u + i, y + i, n - i);
}

const struct kvl__simd kvl__simd_avx2 = {"avx2", dot, NULL, axpy, scale, kvl__dequant_avx2, swiglu,
                                         gemm_xt, NULL};
