/* qdot_avx512.c — decode-path dot products on the GGUF block formats with int8
 * activations and AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products per instruction).
 *
 * Activations are quantised per 32 elements (d = max|x| / 127, q = round(x / d)), as
 * llama.cpp does for its CPU decode; weights are used in their file layout, unpacked
 * in registers. This trades a small, bounded error (test-backend-ops bounds it, and the
 * real-model golden tests measure it on the decode path) for reading each weight byte
 * once with little arithmetic. Compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni -mf16c; called only when the processor has them.
 *
 * Block layouts: kernels/ref/quant_ref.c. In every format the unsigned code u of an
 * element (0..15, 0..31 or 0..63, or q + 128 for Q8_0) multiplies the int8 activation,
 * and the format's offset is taken out with the activation sums: sum (u - o) x =
 * sum u x - o sum x.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"

static inline float h2f(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void kvl__q8_act(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16) {
  for (int64_t b = 0; b < K / 32; b++) {
    __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float db = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = db;
    __m512 s = _mm512_set1_ps(id);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
    _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
    s16[2 * b] = _mm512_reduce_add_epi32(i0);
    s16[2 * b + 1] = _mm512_reduce_add_epi32(i1);
  }
}

/* per-lane int32 dot sums -> float, times per-lane scales, into acc */
static inline __m512 fmadd_i32(__m512 acc, __m512i dot, __m512 scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}

/* scales for lanes 0-7 (a) and 8-15 (b) */
static inline __m512 two_scales(float a, float b) {
  return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

static float dot_q8_0(const uint8_t *w, int64_t nb, const int8_t *xq, const float *xd, const int32_t *xs) {
  __m512 acc = _mm512_setzero_ps();
  float corr = 0;
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2, w += 68) {
    _mm_prefetch((const char *)w + 512, _MM_HINT_T0);
    __m256i wa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), flip);
    __m256i wb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 36)), flip);
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(wa), wb, 1);
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(xq + 32 * b));
    float da = h2f(w) * xd[b], db = h2f(w + 34) * xd[b + 1];
    acc = fmadd_i32(acc, dot, two_scales(da, db));
    corr += da * (float)(xs[2 * b] + xs[2 * b + 1]) + db * (float)(xs[2 * b + 2] + xs[2 * b + 3]);
  }
  float tail = 0;
  for (; b < nb; b++, w += 34) {
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int8_t)w[2 + i] * xq[32 * b + i];
    tail += h2f(w) * xd[b] * (float)s;
  }
  return _mm512_reduce_add_ps(acc) - 128.0f * corr + tail;
}

static float dot_q5_0(const uint8_t *w, int64_t nb, const int8_t *xq, const float *xd, const int32_t *xs) {
  __m512 acc = _mm512_setzero_ps();
  float corr = 0;
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2, w += 44) {
    _mm_prefetch((const char *)w + 384, _MM_HINT_T0);
    __m256i v[2];
    for (int k = 0; k < 2; k++) {
      const uint8_t *blk = w + 22 * k;
      __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
      __m128i lo = _mm_and_si128(qs, lo4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), lo4);
      __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
      uint32_t qh;
      memcpy(&qh, blk + 2, 4);
      v[k] = _mm256_mask_blend_epi8((__mmask32)qh, u, _mm256_or_si256(u, bit4));
    }
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(xq + 32 * b));
    float da = h2f(w) * xd[b], db = h2f(w + 22) * xd[b + 1];
    acc = fmadd_i32(acc, dot, two_scales(da, db));
    corr += da * (float)(xs[2 * b] + xs[2 * b + 1]) + db * (float)(xs[2 * b + 2] + xs[2 * b + 3]);
  }
  float tail = 0;
  for (; b < nb; b++, w += 22) {
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    int32_t s = 0;
    for (int j = 0; j < 16; j++) {
      int x0 = (int)((w[6 + j] & 0x0f) | (((qh >> j) << 4) & 0x10)) - 16;
      int x1 = (int)((w[6 + j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
      s += x0 * xq[32 * b + j] + x1 * xq[32 * b + 16 + j];
    }
    tail += h2f(w) * xd[b] * (float)s;
  }
  return _mm512_reduce_add_ps(acc) - 16.0f * corr + tail;
}

static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

static float dot_q4_k(const uint8_t *w, int64_t nb, const int8_t *xq, const float *xd, const int32_t *xs) {
  __m512 acc = _mm512_setzero_ps();
  float mins = 0;
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++, w += 144, xq += 256, xd += 8, xs += 16) {
    _mm_prefetch((const char *)w + 576, _MM_HINT_T0); /* 4 blocks ahead */
    _mm_prefetch((const char *)w + 640, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 704, _MM_HINT_T0);
    float d = h2f(w), dmin = h2f(w + 2);
    const uint8_t *sc = w + 4, *q = w + 16;
    for (int j = 0; j < 4; j++) {
      __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
      __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
      __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(xq + 64 * j));
      int s0, m0, s1, m1;
      scale_min_k4(2 * j, sc, &s0, &m0);
      scale_min_k4(2 * j + 1, sc, &s1, &m1);
      acc = fmadd_i32(acc, dot, two_scales(d * (float)s0 * xd[2 * j], d * (float)s1 * xd[2 * j + 1]));
      mins += dmin * ((float)m0 * xd[2 * j] * (float)(xs[4 * j] + xs[4 * j + 1]) +
                      (float)m1 * xd[2 * j + 1] * (float)(xs[4 * j + 2] + xs[4 * j + 3]));
    }
  }
  return _mm512_reduce_add_ps(acc) - mins;
}

static float dot_q6_k(const uint8_t *w, int64_t nb, const int8_t *xq, const float *xd, const int32_t *xs) {
  __m512 acc = _mm512_setzero_ps();
  float corr = 0;
  const __m256i lo4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 630 + o, _MM_HINT_T0); /* 3 blocks ahead */
    float d = h2f(w + 208);
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int n = 0; n < 2; n++) {
      const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
      __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32));
      __m256i h = _mm256_loadu_si256((const __m256i *)qh);
      __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
      __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, lo4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
      __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
      __m256i q4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), lo4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
      const int8_t *x = xq + 256 * b + 128 * n;
      const float *dx = xd + 8 * b + 4 * n;           /* 4 activation blocks of 32 */
      const int32_t *s = xs + 16 * b + 8 * n;         /* 8 sums of 16 */
      const int8_t *g = sc + 8 * n;                   /* 8 group scales of 16 */
      for (int k = 0; k < 2; k++) {                   /* elements 64k .. 64k+63 */
        __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(k ? q3 : q1), k ? q4 : q2, 1);
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(x + 64 * k));
        /* lanes of 4 elements: groups of 16 = 4 lanes, each with scale sc * dx */
        float f[4];
        for (int t = 0; t < 4; t++) f[t] = d * (float)g[4 * k + t] * dx[2 * k + t / 2];
        __m512 scale = _mm512_set_ps(f[3], f[3], f[3], f[3], f[2], f[2], f[2], f[2], f[1], f[1], f[1], f[1], f[0], f[0],
                                     f[0], f[0]);
        acc = fmadd_i32(acc, dot, scale);
        for (int t = 0; t < 4; t++) corr += f[t] * (float)s[4 * k + t];
      }
    }
  }
  return _mm512_reduce_add_ps(acc) - 32.0f * corr;
}

int kvl__qdot_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd,
                         const int32_t *xs, float *out) {
  switch (type) {
  case KVL_TYPE_Q8_0: *out = dot_q8_0(w, K / 32, xq, xd, xs); return 0;
  case KVL_TYPE_Q5_0: *out = dot_q5_0(w, K / 32, xq, xd, xs); return 0;
  case KVL_TYPE_Q4_K: *out = dot_q4_k(w, K / 256, xq, xd, xs); return 0;
  case KVL_TYPE_Q6_K: *out = dot_q6_k(w, K / 256, xq, xd, xs); return 0;
  default: return KVL_ENOTSUP;
  }
}
