/* vmath_avx512.h — vector math shared by the AVX-512 kernels (attention's softmax, the
 * SwiGLU activation, a register transpose for attention's keys and the lanes kernels'
 * activations). Include only from files compiled with -mavx512f. */
#ifndef KVL_VMATH_AVX512_H
#define KVL_VMATH_AVX512_H

#include <immintrin.h>

/* e^x for every lane: Cephes' range reduction (x = n ln2 + r, |r| <= ln2/2) and degree-7
 * polynomial, scaled by 2^n; within ~2 ulp of expf; lanes below -104 give 0. */
static inline __m512 kvl__exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/* r[c] = column c of the 16 x 16 matrix of 32-bit lanes whose row j was r[j], the bits
 * moved as they are (integers go through it cast: the lanes kernels' activations): pairs
 * of rows interleaved by 32 then 64 bits within 128-bit lanes, then the lanes gathered by
 * two rounds of 128-bit shuffles */
static inline __attribute__((always_inline)) void kvl__transpose16(__m512 r[16]) {
  __m512 t[16], u[16], v[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 16; b += 4) {
    u[b] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[b]), _mm512_castps_pd(t[b + 2])));
    u[b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[b]), _mm512_castps_pd(t[b + 2])));
    u[b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[b + 1]), _mm512_castps_pd(t[b + 3])));
    u[b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[b + 1]), _mm512_castps_pd(t[b + 3])));
  }
  for (int i = 0; i < 4; i++) {
    v[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
    v[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
    v[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
    v[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0xdd);
  }
}

#endif
