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
#include "qunpack_avx2.h"

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

/* Eight vectors of 8 int32 lanes to one vector of their sums: lane i = the sum of v[i].
 * The kernels below dot eight 32-element units per token, reduce them with this, and scale
 * all eight with one multiply and one FMA: no per-unit float work, and one FMA per eight
 * units in each token's dependency chain. */
static inline __m256i hsum8x8(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4, __m256i v5, __m256i v6,
                              __m256i v7) {
  __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
  /* ab: the 128-bit halves of v0..v3's sums; cd: of v4..v7 */
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* A token's 16 sums of 16 (s16 of eight 32-element blocks) as eight sums of 32, in order */
static inline __m256i sums32(const int32_t *s16) {
  __m256i h = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)s16), _mm256_loadu_si256((const __m256i *)(s16 + 8)));
  return _mm256_permute4x64_epi64(h, 0xD8);
}

/* eight fp16 block scales, `stride` bytes apart */
static inline __m256 scales8(const uint8_t *w, int stride) {
  uint16_t h[8];
  for (int i = 0; i < 8; i++) memcpy(&h[i], w + i * stride, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

static inline __attribute__((always_inline)) void dot_q8_0(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  float tail[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi16(1);
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8, w += 8 * 34) {
    _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 1088, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 1152, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 1216, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 1280, _MM_HINT_T0);
    __m256i v[8], av[8];
    for (int i = 0; i < 8; i++) {
      v[i] = _mm256_loadu_si256((const __m256i *)(w + 34 * i + 2));
      av[i] = _mm256_sign_epi8(v[i], v[i]);
    }
    const __m256 wd = scales8(w, 34);
    for (int t = 0; t < T; t++) {
      const int8_t *x = QA(a, t) + 32 * b;
      __m256i p[8];
      for (int i = 0; i < 8; i++)
        p[i] = _mm256_madd_epi16(
            _mm256_maddubs_epi16(av[i], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * i)), v[i])), one);
      __m256i sum = hsum8x8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(wd, _mm256_loadu_ps(DA(a, t) + b)), acc[t]);
    }
  }
  for (; b < nb; b++, w += 34) { /* the last blocks of a row of fewer than 8 */
    __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2)), av = _mm256_sign_epi8(v, v);
    for (int t = 0; t < T; t++) {
      __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(QA(a, t) + 32 * b)), v);
      tail[t] += (float)hsum8_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(av, x), one)) * (h2f(w) * DA(a, t)[b]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]) + tail[t];
}

static inline __attribute__((always_inline)) void dot_q5_0(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  float tail[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8, w += 8 * 22) {
    _mm_prefetch((const char *)w + 704, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 768, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 832, _MM_HINT_T0);
    __m256i u[8];
    for (int i = 0; i < 8; i++) u[i] = kvl__q5_0_codes(w + 22 * i);
    const __m256 wd = scales8(w, 22);
    for (int t = 0; t < T; t++) {
      const int8_t *x = QA(a, t) + 32 * b;
      __m256i sum = hsum8x8(dot32(u[0], x), dot32(u[1], x + 32), dot32(u[2], x + 64), dot32(u[3], x + 96),
                            dot32(u[4], x + 128), dot32(u[5], x + 160), dot32(u[6], x + 192), dot32(u[7], x + 224));
      /* the offset 16 in integers: sum (u - 16) x = sum u x - 16 sum x */
      sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(sums32(SA(a, t) + 2 * b), 4));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(wd, _mm256_loadu_ps(DA(a, t) + b)), acc[t]);
    }
  }
  for (; b < nb; b++, w += 22) {
    __m256i u = kvl__q5_0_codes(w);
    for (int t = 0; t < T; t++) {
      int32_t dot = hsum8_i32(dot32(u, QA(a, t) + 32 * b)) - 16 * (SA(a, t)[2 * b] + SA(a, t)[2 * b + 1]);
      tail[t] += (float)dot * (h2f(w) * DA(a, t)[b]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]) + tail[t];
}

static inline __attribute__((always_inline)) void dot_q4_k(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++, w += 144) {
    _mm_prefetch((const char *)w + 576, _MM_HINT_T1); /* 4 blocks ahead */
    _mm_prefetch((const char *)w + 640, _MM_HINT_T1);
    _mm_prefetch((const char *)w + 704, _MM_HINT_T1);
    __m256 sc, mn;
    kvl__q4_k_scales8(w + 4, &sc, &mn);
    sc = _mm256_mul_ps(sc, _mm256_set1_ps(h2f(w)));
    mn = _mm256_mul_ps(mn, _mm256_set1_ps(h2f(w + 2)));
    const uint8_t *qs = w + 16;
    __m256i u[8]; /* sub-block 2j: low nibbles of qs[32j..], 2j+1: high nibbles */
    for (int j = 0; j < 4; j++) {
      __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
      u[2 * j] = _mm256_and_si256(q, lo4);
      u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
    }
    for (int t = 0; t < T; t++) {
      const int8_t *x = QA(a, t) + 256 * b;
      __m256i sum = hsum8x8(dot32(u[0], x), dot32(u[1], x + 32), dot32(u[2], x + 64), dot32(u[3], x + 96),
                            dot32(u[4], x + 128), dot32(u[5], x + 160), dot32(u[6], x + 192), dot32(u[7], x + 224));
      const __m256 xd = _mm256_loadu_ps(DA(a, t) + 8 * b);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sc, xd), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sums32(SA(a, t) + 16 * b)), _mm256_mul_ps(mn, xd), acc[t]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]);
}

static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, int64_t nb, const struct acts *a,
                                                          float *out, const int T) {
  __m256 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 630 + o, _MM_HINT_T1); /* 3 blocks ahead */
    const __m256 d = _mm256_set1_ps(h2f(w + 208));
    const int8_t *sc = (const int8_t *)(w + 192);
    __m256i u[8]; /* unit 4n + k: elements 128n + 32k .. +31 */
    kvl__q6_k_half32(w, 0, u);
    kvl__q6_k_half32(w, 1, u + 4);
    /* the 16 group scales: unit i's elements 0-15 take sc[2i], 16-31 sc[2i+1] (int16 lanes
     * 0-7 and 8-15 of its pair sums) */
    __m256i gs[8];
    for (int i = 0; i < 8; i++) gs[i] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1]), _mm_set1_epi16(sc[2 * i]));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    for (int t = 0; t < T; t++) {
      const int8_t *x = QA(a, t) + 256 * b;
      __m256i p[8];
      for (int i = 0; i < 8; i++)
        p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i))), gs[i]);
      __m256i sum = hsum8x8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
      /* the offset 32 in integers: unit i's correction sc[2i] s16[2i] + sc[2i+1] s16[2i+1] */
      const int32_t *s16 = SA(a, t) + 16 * b;
      __m256i xs16 = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)s16), _mm256_loadu_si256((const __m256i *)(s16 + 8))),
          0xD8);
      sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(sc16, xs16), 5));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_loadu_ps(DA(a, t) + 8 * b)), acc[t]);
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]);
}

/* Q4_K, one token (kvl__qdot1_avx2) or a few at once (kvl__qdot1n_avx2, each block
 * unpacked once, every token's operations those it has alone: bit-identical): each
 * 32-element unit's int32 lanes converted and multiplied by its scale d x sc x xd,
 * broadcast from memory, into two accumulators; the minimums' correction one FMA per
 * block against the token's factors xf (kvl__q4_k_act_factors: per block the eight xd,
 * then the eight xd x code sums). dot_q4_k reduced each unit to a scalar first (hadds
 * and cross-lane permutes, slow on AMD's 256-bit units): on a Zen 2 (110 KiB of weights
 * in L2, one thread) 50-52 -> 34-35 cycles per block (a throwaway micro-benchmark;
 * bench/README.md). The same integer sums, scaled in another order: results agree with
 * dot_q4_k to float rounding. Two accumulators: four were slower. */
static inline __attribute__((always_inline)) void dotn_q4_k(const uint8_t *w, int64_t nb, int64_t K, const int8_t *xq,
                                                            const float *xf, float *out, const int T) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc0[KVL__QDOT1_MAX_T], acc1[KVL__QDOT1_MAX_T], corr[KVL__QDOT1_MAX_T];
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 144) {
    const __m128i sm = kvl__q4_k_scale_bytes(w + 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)(const void *)w)); /* d, dmin */
    const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_broadcastss_ps(dd));
    const __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                                    _mm256_broadcastss_ps(_mm_movehdup_ps(dd)));
    __m256i u[8]; /* unit 2j: the low nibbles of codes 32j.., 2j+1 the high */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
      u[2 * j] = _mm256_and_si256(q, lo4), u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      const float *f = xf + t * (K / 16) + 16 * b;
      const int8_t *x = xq + t * K + 256 * b;
      float s[8] __attribute__((aligned(32)));
      _mm256_store_ps(s, _mm256_mul_ps(sc, _mm256_loadu_ps(f)));
      corr[t] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(f + 8), corr[t]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u[2 * j], _mm256_loadu_si256((const __m256i *)(x + 64 * j))), ones);
        const __m256i p1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(u[2 * j + 1], _mm256_loadu_si256((const __m256i *)(x + 64 * j + 32))), ones);
        acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(s + 2 * j), acc0[t]);
        acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(s + 2 * j + 1), acc1[t]);
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = hsum8(_mm256_sub_ps(_mm256_add_ps(acc0[t], acc1[t]), corr[t]));
}

/* Q6_K, one token or a few (kvl__qdot1_avx2, kvl__qdot1n_avx2): unit i (32 elements) is
 * two 16-element groups, its int32 lanes 0-3 and 4-7 after vpmaddwd, so the groups' int8
 * scales go into that vpmaddwd as int16 words ([sc 2i] x 8, [sc 2i+1] x 8: one in-lane
 * shuffle of the block's scales per unit) and the unit's float scale d x xd is one
 * broadcast from memory; the offset 32 comes off as 32 x sum sc x (code sum of 16) per
 * unit in integers (vpmaddwd of the scales and the token's sums). dot_q6_k built each
 * unit's scale words from scalars and reduced units with hadds. The same integer sums
 * scaled in another order: results agree with dot_q6_k to float rounding. */
static inline __attribute__((always_inline)) void dotn_q6_k(const uint8_t *w, int64_t nb, int64_t K, const int8_t *xq,
                                                            const float *xd, const int32_t *xs, float *out, const int T) {
  /* per unit i & 3: its scale words from the block's 8 scales (in both 128-bit lanes) */
  static const int8_t sel[4][32] __attribute__((aligned(32))) = {
      {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
      {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
      {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
      {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};
  __m256 acc0[KVL__QDOT1_MAX_T], acc1[KVL__QDOT1_MAX_T], corr[KVL__QDOT1_MAX_T];
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 210) {
    const __m256 d = _mm256_set1_ps(kvl__h2f(w + 208));
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8); /* the 16 scales as words, in order */
    /* scales 0-7 (units 0-3) and 8-15 (units 4-7) as words, in both lanes */
    const __m256i g0 = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));
    const __m256i g1 = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1));
    __m256i u[8]; /* unit 4n + k: elements 128n + 32k .. +31 */
    kvl__q6_k_half32(w, 0, u);
    kvl__q6_k_half32(w, 1, u + 4);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      const int8_t *x = xq + t * K + 256 * b;
      const __m256 xdv = _mm256_loadu_ps(xd + t * (K / 32) + 8 * b);
      float s[8] __attribute__((aligned(32)));
      _mm256_store_ps(s, _mm256_mul_ps(d, xdv));
      /* the offset: per unit sum over its two groups of sc x code sum, scaled as the unit */
      const int32_t *s16 = xs + t * (K / 16) + 16 * b;
      const __m256i xs16 = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)s16), _mm256_loadu_si256((const __m256i *)(s16 + 8))),
          0xD8);
      corr[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, xs16)), _mm256_loadu_ps(s), corr[t]);
#pragma GCC unroll 8
      for (int i = 0; i < 8; i += 2) {
        const __m256i gs0 = _mm256_shuffle_epi8(i < 4 ? g0 : g1, _mm256_load_si256((const __m256i *)sel[i & 3]));
        const __m256i gs1 = _mm256_shuffle_epi8(i < 4 ? g0 : g1, _mm256_load_si256((const __m256i *)sel[(i + 1) & 3]));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i))), gs0);
        const __m256i p1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(u[i + 1], _mm256_loadu_si256((const __m256i *)(x + 32 * i + 32))), gs1);
        acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(s + i), acc0[t]);
        acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(s + i + 1), acc1[t]);
      }
    }
  }
  for (int t = 0; t < T; t++)
    out[t] = hsum8(_mm256_fnmadd_ps(corr[t], _mm256_set1_ps(32.0f), _mm256_add_ps(acc0[t], acc1[t])));
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

int kvl__qdot1_avx2(uint32_t type, const void *w, int64_t K, const int8_t *xq, const int8_t *xp, const float *xd,
                    const int32_t *xs, const float *xf, float *out) {
  (void)xp; /* the kernels read the codes in their natural order (no kvl__q8_order) */
  if (type == KVL_TYPE_Q4_K && xf && K % 256 == 0) {
    dotn_q4_k(w, K / 256, K, xq, xf, out, 1);
    return 0;
  }
  if (type == KVL_TYPE_Q6_K && K % 256 == 0) {
    dotn_q6_k(w, K / 256, K, xq, xd, xs, out, 1);
    return 0;
  }
  return kvl__qdot_avx2(type, w, K, xq, xd, xs, 1, out);
}

/* fn(args..., T) instantiated for T = 1..KVL__QDOT1_MAX_T, so each token loop is unrolled */
_Static_assert(KVL__QDOT1_MAX_T == 6, "DOTN_SWITCH's cases");
#define DOTN_SWITCH(n, fn, ...)                                                                                    \
  switch (n) {                                                                                                     \
  case 1: fn(__VA_ARGS__, 1); break;                                                                               \
  case 2: fn(__VA_ARGS__, 2); break;                                                                               \
  case 3: fn(__VA_ARGS__, 3); break;                                                                               \
  case 4: fn(__VA_ARGS__, 4); break;                                                                               \
  case 5: fn(__VA_ARGS__, 5); break;                                                                               \
  default: fn(__VA_ARGS__, 6); break;                                                                              \
  }

int kvl__qdot1n_avx2(uint32_t type, const void *w, int64_t K, int n_tokens, const int8_t *xq, const int8_t *xp,
                     const float *xd, const int32_t *xs, const float *xf, float *out) {
  (void)xp;
  if (n_tokens < 1 || n_tokens > KVL__QDOT1_MAX_T) return KVL_ENOTSUP;
  if (type == KVL_TYPE_Q4_K && xf && K % 256 == 0) {
    DOTN_SWITCH(n_tokens, dotn_q4_k, w, K / 256, K, xq, xf, out)
    return 0;
  }
  if (type == KVL_TYPE_Q6_K && K % 256 == 0) {
    DOTN_SWITCH(n_tokens, dotn_q6_k, w, K / 256, K, xq, xd, xs, out)
    return 0;
  }
  /* the other formats' kernels give each token the bits it has alone */
  return kvl__qdot_avx2(type, w, K, xq, xd, xs, n_tokens, out);
}

/* Rows r = 0 .. n_rows-1 of a product with one token, each row's dot plus its bias to y[r]:
 * the kernels of kvl__qdot1_avx2 (the same bits per row), the format's dispatch done once
 * instead of per row. The 0.5B's rows are 28 blocks (K = 896): per-row dispatch, the call
 * and the reduction cost about 40 cycles a row, ~15 % of a Q5_0 row's time on a Zen 2. */
int kvl__qdot1_rows_avx2(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t K, const int8_t *xq,
                         const int8_t *xp, const float *xd, const int32_t *xs, const float *xf, const float *bias,
                         float *y) {
  (void)xp; /* natural order: this level has no q8_order */
  const struct acts a = {xq, xd, xs, K};
  const uint8_t *p = w;
  float v;
  switch (type) {
  case KVL_TYPE_Q8_0:
    for (int64_t r = 0; r < n_rows; r++, p += row_bytes) dot_q8_0(p, K / 32, &a, &v, 1), y[r] = v + (bias ? bias[r] : 0.0f);
    return 0;
  case KVL_TYPE_Q5_0:
    for (int64_t r = 0; r < n_rows; r++, p += row_bytes) dot_q5_0(p, K / 32, &a, &v, 1), y[r] = v + (bias ? bias[r] : 0.0f);
    return 0;
  case KVL_TYPE_Q4_K:
    if (K % 256 || !xf) return KVL_ENOTSUP;
    for (int64_t r = 0; r < n_rows; r++, p += row_bytes) dotn_q4_k(p, K / 256, K, xq, xf, &v, 1), y[r] = v + (bias ? bias[r] : 0.0f);
    return 0;
  case KVL_TYPE_Q6_K:
    if (K % 256) return KVL_ENOTSUP;
    for (int64_t r = 0; r < n_rows; r++, p += row_bytes) dotn_q6_k(p, K / 256, K, xq, xd, xs, &v, 1), y[r] = v + (bias ? bias[r] : 0.0f);
    return 0;
  default: return KVL_ENOTSUP;
  }
}
