/* simd_avx512.c — AVX-512F level (compiled with -mavx512f -mfma; called only after the
 * processor reported AVX-512F). Tails use masked loads, so any length works. */
#include <immintrin.h>

#include "../backend-impl.h"
#include "vmath_avx512.h"

static inline __mmask16 tail_mask(int64_t left) { return (__mmask16)((1u << left) - 1u); }

static float dot(const float *a, const float *b, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  if (i < n) {
    __mmask16 m = tail_mask(n - i);
    s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}


/* Prefill products in outer-product form (kvl__simd.gemm_xt): 16 tokens in the lanes, a
 * weight element broadcast, one FMA per k in k order for every (row, token); the same
 * lane arithmetic in every shape, so a token's bits do not depend on its batch. */
static inline __attribute__((always_inline)) void xt_block(const float *w, int64_t ldw, int64_t K, const float *xg,
                                                          float *y, int64_t ldy, int nt, bool more, const int NR) {
  __m512 acc[8];
  float buf[16] = {0};
#pragma GCC unroll 8
  for (int r = 0; r < NR; r++) {
    if (more)
      for (int t = 0; t < nt; t++) buf[t] = y[t * ldy + r];
    acc[r] = _mm512_loadu_ps(buf);
  }
  for (int64_t k = 0; k < K; k++) {
    __m512 x0 = _mm512_loadu_ps(xg + 16 * k);
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ldw + k]), x0, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; r++) {
    _mm512_storeu_ps(buf, acc[r]);
    for (int t = 0; t < nt; t++) y[t * ldy + r] = buf[t];
  }
}

static void gemm_xt(const float *w, int64_t ldw, int nr, const float *xg, int nt, float *y, int64_t ldy, int64_t K,
                    bool more) {
  for (int r = 0; r < nr; r += 8) {
    const float *wr = w + (int64_t)r * ldw;
    switch (nr - r < 8 ? nr - r : 8) {
    case 8: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 8); break;
    case 7: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 7); break;
    case 6: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 6); break;
    case 5: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 5); break;
    case 4: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 4); break;
    case 3: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 3); break;
    case 2: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 2); break;
    default: xt_block(wr, ldw, K, xg, y + r, ldy, nt, more, 1); break;
    }
  }
}

static void axpy(float a, const float *x, float *y, int64_t n) {
  __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

static void scale(float a, float *y, int64_t n) {
  __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(va, _mm512_loadu_ps(y + i)));
  if (i < n) {
    __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
  }
}

/* silu(g) * u = g / (1 + e^-g) * u, with the vector exp */
static void swiglu(const float *g, const float *u, float *y, int64_t n) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    __m512 e = kvl__exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 r = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(m, u + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
}

const struct kvl__simd kvl__simd_avx512 = {"avx512", dot, NULL, axpy, scale, kvl__dequant_avx512, swiglu,
                                           gemm_xt, kvl__dequant_dot_avx512};
