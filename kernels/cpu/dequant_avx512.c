/* dequant_avx512.c — AVX-512 dequantisation of the block formats the real models use
 * (Q8_0, Q5_0, Q4_K, Q6_K), 16 lanes at a time. Same operations in the same order as the
 * scalar reference (products, then the offset; no fused multiply-add), so the results
 * are bit-identical to it (test-backend-ops checks). Compiled with -mavx512f -mavx512bw -mf16c. */
#include <immintrin.h>
#include <string.h>

#include "../backend-impl.h"

static inline float h2f(const uint8_t *p) { /* F16C: exact, as the reference */
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* 16 bytes -> 16 x int32 */
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

static void q8_0(const uint8_t *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
    __m512 d = _mm512_set1_ps(h2f(b));
    for (int h = 0; h < 2; h++) {
      __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * h)));
      _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
    }
  }
}

static void q5_0(const uint8_t *b, float *y, int64_t nb) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f), c16 = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < nb; i++, b += 22, y += 32) {
    __m512 d = _mm512_set1_ps(h2f(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m512i q = u8x16(b + 6);
    __m512i x0 = _mm512_and_si512(q, lo4), x1 = _mm512_srli_epi32(q, 4);
    x0 = _mm512_mask_or_epi32(x0, (__mmask16)(qh & 0xffff), x0, c16);
    x1 = _mm512_mask_or_epi32(x1, (__mmask16)(qh >> 16), x1, c16);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(x0, c16)), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(x1, c16)), d));
  }
}

static void q4_k(const uint8_t *b, float *y, int64_t nb) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f);
  for (int64_t i = 0; i < nb; i++, b += 144) {
    float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32) {
      uint8_t s, m;
      kvl_q4_k_scale_min(2 * j, sc, &s, &m);
      __m512 d1 = _mm512_set1_ps(d * (float)s), m1 = _mm512_set1_ps(dmin * (float)m);
      kvl_q4_k_scale_min(2 * j + 1, sc, &s, &m);
      __m512 d2 = _mm512_set1_ps(d * (float)s), m2 = _mm512_set1_ps(dmin * (float)m);
      for (int h = 0; h < 2; h++) {
        __m512i v = u8x16(q + 16 * h);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, lo4)), hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        _mm512_storeu_ps(y + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d1, lo), m1));
        _mm512_storeu_ps(y + 32 + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d2, hi), m2));
      }
      y += 64;
    }
  }
}

static void q6_k(const uint8_t *b, float *y, int64_t nb) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f), three = _mm512_set1_epi32(3), c32 = _mm512_set1_epi32(32);
  for (int64_t i = 0; i < nb; i++, b += 210) {
    float d = h2f(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int g = 0; g < 2; g++) { /* l = 16g .. 16g+15, is = g */
        __m512i a = u8x16(ql + 16 * g), c = u8x16(ql + 32 + 16 * g), h = u8x16(qh + 16 * g);
        __m512i q1 = _mm512_or_si512(_mm512_and_si512(a, lo4), _mm512_slli_epi32(_mm512_and_si512(h, three), 4));
        __m512i q2 = _mm512_or_si512(_mm512_and_si512(c, lo4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), three), 4));
        __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(a, 4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), three), 4));
        __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(c, 4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 6), three), 4));
        __m512i qs[4] = {q1, q2, q3, q4};
        for (int k = 0; k < 4; k++) {
          __m512 ds = _mm512_set1_ps(d * (float)sc[g + 2 * k]);
          _mm512_storeu_ps(y + 32 * k + 16 * g, _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_sub_epi32(qs[k], c32))));
        }
      }
    }
  }
}

int kvl__dequant_avx512(uint32_t type, const void *src, float *dst, int64_t n) {
  switch (type) {
  case KVL_TYPE_Q8_0: q8_0(src, dst, n / 32); return 0;
  case KVL_TYPE_Q5_0: q5_0(src, dst, n / 32); return 0;
  case KVL_TYPE_Q4_K: q4_k(src, dst, n / 256); return 0;
  case KVL_TYPE_Q6_K: q6_k(src, dst, n / 256); return 0;
  default: return kvl_dequant_row_ref(type, src, dst, n);
  }
}
