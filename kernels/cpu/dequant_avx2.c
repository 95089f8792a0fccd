/* dequant_avx2.c — AVX2 dequantisation of the block formats the real models use (Q8_0,
 * Q5_0, Q4_K, Q6_K), 8 lanes at a time, for the fp32 products of the AVX2 levels. The
 * operations and their order are the scalar reference's (products, then the offset; no
 * fused multiply-add), so the results are bit-identical to it (test-backend-ops checks).
 * Compiled with -mavx2 -mf16c. */
#include <immintrin.h>
#include <string.h>

#include "../backend-impl.h"

static inline float h2f(const uint8_t *p) { /* F16C: exact, as the reference */
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* 8 bytes -> 8 x int32 */
static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static void q8_0(const uint8_t *b, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
    __m256 d = _mm256_set1_ps(h2f(b));
    for (int h = 0; h < 4; h++) {
      __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * h)));
      _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
  }
}

static void q5_0(const uint8_t *b, float *y, int64_t nb) {
  const __m256i lo4 = _mm256_set1_epi32(0x0f), c16 = _mm256_set1_epi32(16);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t i = 0; i < nb; i++, b += 22, y += 32) {
    __m256 d = _mm256_set1_ps(h2f(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int h = 0; h < 2; h++) { /* elements 8h .. 8h+7 and 16 + 8h .. */
      __m256i q = u8x8(b + 6 + 8 * h);
      __m256i x0 = _mm256_and_si256(q, lo4), x1 = _mm256_srli_epi32(q, 4);
      /* the fifth bits of elements 8h.. (bits 8h..) and 16+8h.. (bits 16+8h..) */
      __m256i h0 = _mm256_set1_epi32((int)((qh >> (8 * h)) & 0xff)), h1 = _mm256_set1_epi32((int)((qh >> (16 + 8 * h)) & 0xff));
      h0 = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h0, bit), bit), c16);
      h1 = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h1, bit), bit), c16);
      x0 = _mm256_or_si256(x0, h0);
      x1 = _mm256_or_si256(x1, h1);
      _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(x0, c16)), d));
      _mm256_storeu_ps(y + 16 + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(x1, c16)), d));
    }
  }
}

static void q4_k(const uint8_t *b, float *y, int64_t nb) {
  const __m256i lo4 = _mm256_set1_epi32(0x0f);
  for (int64_t i = 0; i < nb; i++, b += 144) {
    float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32) {
      uint8_t s, m;
      kvl_q4_k_scale_min(2 * j, sc, &s, &m);
      __m256 d1 = _mm256_set1_ps(d * (float)s), m1 = _mm256_set1_ps(dmin * (float)m);
      kvl_q4_k_scale_min(2 * j + 1, sc, &s, &m);
      __m256 d2 = _mm256_set1_ps(d * (float)s), m2 = _mm256_set1_ps(dmin * (float)m);
      for (int h = 0; h < 4; h++) {
        __m256i v = u8x8(q + 8 * h);
        __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, lo4)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(y + 8 * h, _mm256_sub_ps(_mm256_mul_ps(d1, lo), m1));
        _mm256_storeu_ps(y + 32 + 8 * h, _mm256_sub_ps(_mm256_mul_ps(d2, hi), m2));
      }
      y += 64;
    }
  }
}

static void q6_k(const uint8_t *b, float *y, int64_t nb) {
  const __m256i lo4 = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3), c32 = _mm256_set1_epi32(32);
  for (int64_t i = 0; i < nb; i++, b += 210) {
    float d = h2f(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int g = 0; g < 4; g++) { /* l = 8g .. 8g+7, is = g / 2 */
        __m256i a = u8x8(ql + 8 * g), c = u8x8(ql + 32 + 8 * g), h = u8x8(qh + 8 * g);
        __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_slli_epi32(_mm256_and_si256(h, three), 4));
        __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, lo4),
                                     _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), three), 4));
        __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                     _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), three), 4));
        __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4),
                                     _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 6), three), 4));
        __m256i qs[4] = {q1, q2, q3, q4};
        for (int k = 0; k < 4; k++) {
          __m256 ds = _mm256_set1_ps(d * (float)sc[g / 2 + 2 * k]);
          _mm256_storeu_ps(y + 32 * k + 8 * g, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_sub_epi32(qs[k], c32))));
        }
      }
    }
  }
}

int kvl__dequant_avx2(uint32_t type, const void *src, float *dst, int64_t n) {
  switch (type) {
  case KVL_TYPE_Q8_0: q8_0(src, dst, n / 32); return 0;
  case KVL_TYPE_Q5_0: q5_0(src, dst, n / 32); return 0;
  case KVL_TYPE_Q4_K: q4_k(src, dst, n / 256); return 0;
  case KVL_TYPE_Q6_K: q6_k(src, dst, n / 256); return 0;
  default: return kvl_dequant_row_ref(type, src, dst, n);
  }
}
