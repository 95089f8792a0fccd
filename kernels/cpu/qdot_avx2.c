/* qdot_avx2.c — the int8-activation decode products for processors with AVX2 but no
 * AVX-512 (the "avx2int8" level): the same contract as kvl__qdot_avx512vnni (backend-impl.h),
 * on 256-bit registers with vpmaddubsw (u8 x s8 pairs to int16) and vpmaddwd (int16
 * pairs to int32).
 *
 * Activations are quantised per 32 as for the AVX-512 kernels (kvl__q8_act_avx2 gives the
 * same codes, scales and sums as kvl__q8_act). A weight unit is unpacked once for all T
 * tokens. vpmaddubsw saturates its int16 pair sums, so every unsigned code here stays
 * below 64 (2 x 63 x 127 < 32767), except Q8_0, whose signed codes enter as |w| against
 * sign(w)·x (2 x 128 x 127 < 32767). Offsets (Q5_0's 16, Q6_K's 32, Q4_K's minimum) come
 * out with the activations' sums of 16, as in qdot_avx512.c.
 *
 * Compiled with -mavx2 -mfma -mf16c; called only when the processor has them. Block
 * layouts: kernels/ref/quant_ref.c. */
#include <immintrin.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline int32_t hsum8_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

static inline float h2f(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void kvl__q8_act_avx2(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i fix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; b++) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    float db = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    d[b] = db;
    __m256 s = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], s));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], s));
    s16[2 * b] = hsum8_i32(_mm256_add_epi32(i0, i1));
    s16[2 * b + 1] = hsum8_i32(_mm256_add_epi32(i2, i3));
    /* int32 -> int8 with saturation; the packs interleave 128-bit lanes, the permute undoes it */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p, fix));
  }
}

/* 32 unsigned codes (< 128) times 32 int8 activations: 8 int32 lanes, lane i the sum of
 * elements 4i .. 4i+3 */
static inline __m256i dot32(__m256i u, const int8_t *x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)x)), _mm256_set1_epi16(1));
}

struct acts { const int8_t *q; const float *d; const int32_t *s; int64_t K; };

#define QA(a, t) ((a)->q + (int64_t)(t) * (a)->K)
#define DA(a, t) ((a)->d + (int64_t)(t) * ((a)->K / 32))
#define SA(a, t) ((a)->s + (int64_t)(t) * ((a)->K / 16))

static inline __attribute__((always_inline)) void dot_q8_0(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 34) {
    _mm_prefetch((const char *)w + 512, _MM_HINT_T0);
    __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2));
    __m256i av = _mm256_sign_epi8(v, v);
    float wd = h2f(w);
    for (int t = 0; t < T; t++) {
      __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(QA(a, t) + 32 * b)), v);
      __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(av, x), _mm256_set1_epi16(1));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wd * DA(a, t)[b]), acc[t]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]);
}

/* Q5_0's 32 fifth bits (bit j of qh for element j) as bytes 0x10 or 0 */
static inline __m256i q5_high_bits(uint32_t qh) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) void dot_q5_0(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  float corr[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++, w += 22) {
    _mm_prefetch((const char *)w + 384, _MM_HINT_T0);
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    __m128i qs = _mm_loadu_si128((const __m128i *)(w + 6));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), lo4);
    u = _mm256_or_si256(u, q5_high_bits(qh));
    float wd = h2f(w);
    for (int t = 0; t < T; t++) {
      float f = wd * DA(a, t)[b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(u, QA(a, t) + 32 * b)), _mm256_set1_ps(f), acc[t]);
      corr[t] += f * (float)(SA(a, t)[2 * b] + SA(a, t)[2 * b + 1]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]) - 16.0f * corr[t];
}

/* Q4_K's 6-bit scale and minimum of sub-block j (0..7) from the 12 packed bytes */
static inline void q4_k_scale_min(int j, const uint8_t *q, int *s, int *m) {
  if (j < 4) {
    *s = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *s = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

static inline __attribute__((always_inline)) void dot_q4_k(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  float mins[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++, w += 144) {
    _mm_prefetch((const char *)w + 576, _MM_HINT_T1); /* 4 blocks ahead */
    _mm_prefetch((const char *)w + 640, _MM_HINT_T1);
    _mm_prefetch((const char *)w + 704, _MM_HINT_T1);
    float d = h2f(w), dmin = h2f(w + 2);
    const uint8_t *sc = w + 4, *qs = w + 16;
    for (int j = 0; j < 4; j++) {
      __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
      __m256i u0 = _mm256_and_si256(q, lo4), u1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
      int s0, m0, s1, m1;
      q4_k_scale_min(2 * j, sc, &s0, &m0);
      q4_k_scale_min(2 * j + 1, sc, &s1, &m1);
      float f0 = d * (float)s0, f1 = d * (float)s1, g0 = dmin * (float)m0, g1 = dmin * (float)m1;
      for (int t = 0; t < T; t++) {
        const float *xd = DA(a, t) + 8 * b + 2 * j;
        const int32_t *xs = SA(a, t) + 16 * b + 4 * j;
        const int8_t *x = QA(a, t) + 256 * b + 64 * j;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(u0, x)), _mm256_set1_ps(f0 * xd[0]), acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(u1, x + 32)), _mm256_set1_ps(f1 * xd[1]), acc[t]);
        mins[t] += g0 * xd[0] * (float)(xs[0] + xs[1]) + g1 * xd[1] * (float)(xs[2] + xs[3]);
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]) - mins[t];
}

static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  float corr[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 630 + o, _MM_HINT_T1); /* 3 blocks ahead */
    float d = h2f(w + 208);
    for (int n = 0; n < 2; n++) { /* halves of 128 elements */
      const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
      const int8_t *sc = (const int8_t *)(w + 192) + 8 * n;
      __m256i la = _mm256_loadu_si256((const __m256i *)ql), lb = _mm256_loadu_si256((const __m256i *)(ql + 32));
      __m256i h = _mm256_loadu_si256((const __m256i *)qh);
      /* element 128n + 32k + l (l < 32): a nibble of ql and two bits of qh[l] */
      __m256i u[4];
      u[0] = _mm256_or_si256(_mm256_and_si256(la, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 4), hi2));
      u[1] = _mm256_or_si256(_mm256_and_si256(lb, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 2), hi2));
      u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), lo4), _mm256_and_si256(h, hi2));
      u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), lo4),
                             _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
      for (int k = 0; k < 4; k++) {
        /* groups of 16: elements 0-15 scale sc[2k], 16-31 sc[2k+1] (int16 lanes 0-7, 8-15) */
        __m256i gs = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
        for (int t = 0; t < T; t++) {
          const int64_t blk = 8 * b + 4 * n + k; /* the activation block of 32 */
          __m256i p = _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)(QA(a, t) + 32 * blk)));
          float f = d * DA(a, t)[blk];
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, gs)), _mm256_set1_ps(f), acc[t]);
          const int32_t *xs = SA(a, t) + 2 * blk;
          corr[t] += f * (float)(sc[2 * k] * xs[0] + sc[2 * k + 1] * xs[1]);
        }
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]) - 32.0f * corr[t];
}

/* One instance per token count, so each kernel's token loop is unrolled. */
#define KVL__DISPATCH_T(fn, w, nb, a, out, T)                                                                      \
  switch (T) {                                                                                                      \
  case 1: fn(w, nb, a, out, 1); break;                                                                              \
  case 2: fn(w, nb, a, out, 2); break;                                                                              \
  case 3: fn(w, nb, a, out, 3); break;                                                                              \
  case 4: fn(w, nb, a, out, 4); break;                                                                              \
  default: fn(w, nb, a, out, T); break;                                                                             \
  }

int kvl__qdot_avx2(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd, const int32_t *xs,
                   int n_tokens, float *out) {
  if (n_tokens < 1 || n_tokens > KVL__QDOT_MAX_T || K % 32) return KVL_ENOTSUP;
  const struct acts a = {xq, xd, xs, K};
  const uint8_t *p = w;
  switch (type) {
  case KVL_TYPE_Q8_0: KVL__DISPATCH_T(dot_q8_0, p, K / 32, &a, out, n_tokens); return 0;
  case KVL_TYPE_Q5_0: KVL__DISPATCH_T(dot_q5_0, p, K / 32, &a, out, n_tokens); return 0;
  case KVL_TYPE_Q4_K:
    if (K % 256) return KVL_ENOTSUP;
    KVL__DISPATCH_T(dot_q4_k, p, K / 256, &a, out, n_tokens);
    return 0;
  case KVL_TYPE_Q6_K:
    if (K % 256) return KVL_ENOTSUP;
    KVL__DISPATCH_T(dot_q6_k, p, K / 256, &a, out, n_tokens);
    return 0;
  default: return KVL_ENOTSUP;
  }
}
