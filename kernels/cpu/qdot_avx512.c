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
#include "qunpack_avx512.h"
#include "kvl_error.h"


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


/* Activations of T tokens: token t's codes at q + t*K, scales at d + t*K/32, sums of
 * 16 at s + t*K/16. Every kernel unpacks a weight unit once and uses it for all T. */
struct acts { const int8_t *q; const float *d; const int32_t *s; int64_t K; int T; };

#define QA(a, t) ((a)->q + (int64_t)(t) * (a)->K)
#define DA(a, t) ((a)->d + (int64_t)(t) * ((a)->K / 32))
#define SA(a, t) ((a)->s + (int64_t)(t) * ((a)->K / 16))

/* Two 32-element blocks (b, b+1) of unsigned codes u against every token: the shared
 * inner loop of Q8_0 and Q5_0; the caller takes out offset x corr. */
static inline __attribute__((always_inline)) void pair_tokens(__m512i u, float wda, float wdb, int64_t b,
                                                             const struct acts *a, __m512 *acc, float *corr,
                                                             const int T) {
  for (int t = 0; t < T; t++) {
    const float *xd = DA(a, t);
    const int32_t *xs = SA(a, t);
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(QA(a, t) + 32 * b));
    float da = wda * xd[b], db = wdb * xd[b + 1];
    acc[t] = fmadd_i32(acc[t], dot, two_scales(da, db));
    corr[t] += da * (float)(xs[2 * b] + xs[2 * b + 1]) + db * (float)(xs[2 * b + 2] + xs[2 * b + 3]);
  }
}

static inline __attribute__((always_inline)) void dot_q8_0_n(const uint8_t *w, int64_t nb, const struct acts *a, float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  float corr[KVL__QDOT_MAX_T] = {0}, tail[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2, w += 68) {
    _mm_prefetch((const char *)w + 512, _MM_HINT_T0);
    pair_tokens(kvl__q8_0_pair(w), kvl__h2f(w), kvl__h2f(w + 34), b, a, acc, corr, T);
  }
  for (; b < nb; b++, w += 34)
    for (int t = 0; t < T; t++) {
      int32_t sum = 0;
      for (int i = 0; i < 32; i++) sum += (int8_t)w[2 + i] * QA(a, t)[32 * b + i];
      tail[t] += kvl__h2f(w) * DA(a, t)[b] * (float)sum;
    }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - 128.0f * corr[t] + tail[t];
}

static inline __attribute__((always_inline)) void dot_q5_0_n(const uint8_t *w, int64_t nb, const struct acts *a, float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  float corr[KVL__QDOT_MAX_T] = {0}, tail[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2, w += 44) {
    _mm_prefetch((const char *)w + 384, _MM_HINT_T0);
    pair_tokens(kvl__q5_0_pair(w), kvl__h2f(w), kvl__h2f(w + 22), b, a, acc, corr, T);
  }
  for (; b < nb; b++, w += 22) {
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    for (int t = 0; t < T; t++) {
      const int8_t *xq = QA(a, t);
      int32_t sum = 0;
      for (int j = 0; j < 16; j++) {
        int x0 = (int)((w[6 + j] & 0x0f) | (((qh >> j) << 4) & 0x10)) - 16;
        int x1 = (int)((w[6 + j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        sum += x0 * xq[32 * b + j] + x1 * xq[32 * b + 16 + j];
      }
      tail[t] += kvl__h2f(w) * DA(a, t)[b] * (float)sum;
    }
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - 16.0f * corr[t] + tail[t];
}


static inline __attribute__((always_inline)) void dot_q4_k_n(const uint8_t *w, int64_t nb, const struct acts *a, float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  float mins[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 144) {
    _mm_prefetch((const char *)w + 576, _MM_HINT_T0); /* 4 blocks ahead */
    _mm_prefetch((const char *)w + 640, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 704, _MM_HINT_T0);
    float d = kvl__h2f(w), dmin = kvl__h2f(w + 2);
    const uint8_t *sc = w + 4, *q = w + 16;
    for (int j = 0; j < 4; j++) {
      __m512i u = kvl__q4_k_unit(q, j);
      uint8_t s0, m0, s1, m1;
      kvl_q4_k_scale_min(2 * j, sc, &s0, &m0);
      kvl_q4_k_scale_min(2 * j + 1, sc, &s1, &m1);
      float f0 = d * (float)s0, f1 = d * (float)s1, g0 = dmin * (float)m0, g1 = dmin * (float)m1;
      for (int t = 0; t < T; t++) {
        const float *xd = DA(a, t) + 8 * b;
        const int32_t *xs = SA(a, t) + 16 * b;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(QA(a, t) + 256 * b + 64 * j));
        acc[t] = fmadd_i32(acc[t], dot, two_scales(f0 * xd[2 * j], f1 * xd[2 * j + 1]));
        mins[t] += g0 * xd[2 * j] * (float)(xs[4 * j] + xs[4 * j + 1]) +
                   g1 * xd[2 * j + 1] * (float)(xs[4 * j + 2] + xs[4 * j + 3]);
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - mins[t];
}

static inline __attribute__((always_inline)) void dot_q6_k_n(const uint8_t *w, int64_t nb, const struct acts *a, float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  float corr[KVL__QDOT_MAX_T] = {0};
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 630 + o, _MM_HINT_T0); /* 3 blocks ahead */
    float d = kvl__h2f(w + 208);
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int n = 0; n < 2; n++) {
      __m512i units[2];
      kvl__q6_k_half(w, n, units);
      const int8_t *g = sc + 8 * n; /* 8 group scales of 16 */
      for (int k = 0; k < 2; k++) { /* elements 64k .. 64k+63 of this half */
        __m512i u = units[k];
        float dg[4];
        for (int tt = 0; tt < 4; tt++) dg[tt] = d * (float)g[4 * k + tt];
        for (int t = 0; t < T; t++) {
          const float *dx = DA(a, t) + 8 * b + 4 * n;   /* 4 activation blocks of 32 */
          const int32_t *s = SA(a, t) + 16 * b + 8 * n; /* 8 sums of 16 */
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                            _mm512_loadu_si512(QA(a, t) + 256 * b + 128 * n + 64 * k));
          /* lanes of 4 elements: each group of 16 = 4 lanes, scale d * sc * dx */
          float f0 = dg[0] * dx[2 * k], f1 = dg[1] * dx[2 * k], f2 = dg[2] * dx[2 * k + 1], f3 = dg[3] * dx[2 * k + 1];
          __m512 scale = _mm512_set_ps(f3, f3, f3, f3, f2, f2, f2, f2, f1, f1, f1, f1, f0, f0, f0, f0);
          acc[t] = fmadd_i32(acc[t], dot, scale);
          corr[t] += f0 * (float)s[4 * k] + f1 * (float)s[4 * k + 1] + f2 * (float)s[4 * k + 2] + f3 * (float)s[4 * k + 3];
        }
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - 32.0f * corr[t];
}

/* ---- one token: the decode GEMV -----------------------------------------------------
 *
 * A single token does little arithmetic per weight byte, so the weights' latency decides:
 * the kernels below prefetch 4 KiB ahead of the row they read (measured on the 2-core
 * Xeon: 0.5B tg128 32.5 -> 40.6 tokens/s going from one group ahead to 4 KiB; 8 KiB is
 * worse again). The K-quant kernels prefetch into L2 (T1): with prefetches into L1 the
 * prefetch instructions themselves stalled on the line fill buffers, and the 1.5B (mostly
 * Q4_K/Q6_K) went 15.1 -> 16.6 tokens/s with T1; for Q5_0/Q8_0 T0 measured better.
 * Figures: `build/bench/bench-prefill-decode -p 0 -n 128 -r 3` per model (3-run medians);
 * the committed run is bench/results/prefill-decode.md. */

/* ---- one token, 32-element formats: scales sixteen blocks at a time ------------------
 *
 * For a single decode token the scalar work per pair of blocks in pair_tokens (two fp16
 * conversions, the scale products, the lane blend, the offset correction) costs more than
 * the dot product. Here sixteen blocks' fp16 weight scales are gathered and converted in
 * one go and multiplied by the activation scales in one vector; each pair's lane scales
 * are a permute of that vector, and the offset correction is one FMA per sixteen blocks
 * (weight scale x activation scale x the block's activation sum). Same arithmetic as
 * pair_tokens in another order; the last group is partial (masked lanes), and a row of an
 * odd number of blocks goes through pair_tokens. */

/* per-block sums of the activation codes times their scales, blocks b..b+15 (lanes
 * past `m` blocks zero) */
static inline __m512 block_sums16(const struct acts *a, int64_t b, __mmask16 m) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const int32_t *xs = SA(a, 0) + 2 * b;
  /* two sums of 16 codes per block: lanes 0-15 hold blocks b..b+7, lanes 16-31 b+8..b+15 */
  __mmask16 lo = (__mmask16)(m & 0xff ? 0xffffu >> (16 - 2 * __builtin_popcount(m & 0xff)) : 0);
  __mmask16 hi = (__mmask16)(m >> 8 ? 0xffffu >> (16 - 2 * __builtin_popcount(m >> 8)) : 0);
  __m512i s0 = _mm512_maskz_loadu_epi32(lo, xs), s1 = _mm512_maskz_loadu_epi32(hi, xs + 16);
  __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(s0, even, s1), _mm512_permutex2var_epi32(s0, odd, s1));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(m, DA(a, 0) + b));
}

/* The fp16 scales at the start of up to 16 blocks of `stride` bytes (22: Q5_0, 34:
 * Q8_0; m: the blocks there are, a prefix), as floats (zero past m). The scales sit at
 * even byte offsets, so they are words: each 128-byte window of the blocks (two loads,
 * masked to the blocks' end) gives the scales in it to one word permute (vpermt2w,
 * AVX512BW), merged by mask into words 0-15. A 16-lane gather did this before, slow on a
 * Zen 4 (test-backend-ops --perf, 4864 x 1536, one token: Q5_0 28.5 -> 30.6 GB/s, Q8_0
 * 49 -> 57). The same values: bit-identical results. */
static const uint16_t scale_words[2][16] = { /* block i's scale: word i of its window */
    {0, 11, 22, 33, 44, 55, 2, 13, 24, 35, 46, 57, 4, 15, 26, 37},  /* stride 22: 3 windows */
    {0, 17, 34, 51, 4, 21, 38, 55, 8, 25, 42, 59, 12, 29, 46, 63}}; /* stride 34: 4 */
static const __mmask32 scale_window[2][4] = {{0x3f, 0xfc0, 0xf000, 0}, {0xf, 0xf0, 0xf00, 0xf000}};

static inline __attribute__((always_inline)) __m512 block_scales16(const uint8_t *w, const int stride, __mmask16 m) {
  const int q8 = stride == 34, nw = q8 ? 4 : 3;
  const int64_t end = (int64_t)stride * __builtin_popcount(m); /* bytes of the blocks there are */
  const __m512i idx = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)scale_words[q8]));
  __m512i r = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < nw; j++) {
    const int64_t a0 = end - 128 * j, a1 = a0 - 64; /* bytes there in each half of the window */
    if (a0 <= 0) break;
    const __m512i lo = a0 >= 64 ? _mm512_loadu_si512(w + 128 * j)
                                : _mm512_maskz_loadu_epi8(((__mmask64)1 << a0) - 1, w + 128 * j);
    const __m512i hi = a1 <= 0    ? _mm512_setzero_si512()
                       : a1 >= 64 ? _mm512_loadu_si512(w + 128 * j + 64)
                                  : _mm512_maskz_loadu_epi8(((__mmask64)1 << a1) - 1, w + 128 * j + 64);
    r = _mm512_mask_mov_epi16(r, scale_window[q8][j] & (__mmask32)m, _mm512_permutex2var_epi16(lo, idx, hi));
  }
  return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
}

static inline __attribute__((always_inline)) void dotn_blocks16(const uint8_t *w, int64_t nb, const struct acts *a,
                                                                const int stride, const int q5, float *out, const int T);
static inline __attribute__((always_inline)) float dot1_blocks16(const uint8_t *w, int64_t nb, const struct acts *a,
                                                               const int stride, const int q5) {
  float out;
  dotn_blocks16(w, nb, a, stride, q5, &out, 1); /* the several-token form's one-token case */
  return out;
}

static void dot_q8_0(const uint8_t *w, int64_t nb, const struct acts *a, float *out) {
  if (a->T > 1) {
    dot_q8_0_n(w, nb, a, out, a->T);
    return;
  }
  if (nb % 2) dot_q8_0_n(w, nb, a, out, 1);
  else *out = dot1_blocks16(w, nb, a, 34, 0);
}

static void dot_q5_0(const uint8_t *w, int64_t nb, const struct acts *a, float *out) {
  if (a->T > 1) {
    dot_q5_0_n(w, nb, a, out, a->T);
    return;
  }
  if (nb % 2) dot_q5_0_n(w, nb, a, out, 1);
  else *out = dot1_blocks16(w, nb, a, 22, 1);
}

/* four Q5_0 blocks (p: the first, 22 bytes apart) as codes 0..31 in quad order: lo holds
 * the low nibbles (elements 0-15 of each block, 16 bytes per block), hi the high ones
 * (16-31), each plus its fifth bit as 16 (a masked add from two 64-bit byte masks) */
static inline __attribute__((always_inline)) void q5_0_quad(const uint8_t *p, __m512i *lo, __m512i *hi) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
  /* the four blocks are 88 bytes, 44 words: block k's codes are words 11k+3..11k+10, its
   * fifth bits words 11k+1 (elements 0-15) and 11k+2 (16-31); two word permutes put the
   * codes in lane k and the fifth bits in two 64-bit masks (AVX512BW only) */
  static const uint16_t code_words[32] = {3,  4,  5,  6,  7,  8,  9,  10, 14, 15, 16, 17, 18, 19, 20, 21,
                                          25, 26, 27, 28, 29, 30, 31, 32, 36, 37, 38, 39, 40, 41, 42, 43};
  static const uint16_t bit_words[32] = {1, 12, 23, 34, 2, 13, 24, 35};
  const __m512i codes = _mm512_loadu_si512(code_words), bits = _mm512_loadu_si512(bit_words);
  const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_maskz_loadu_epi8(((__mmask64)1 << 24) - 1, p + 64);
  const __m512i v = _mm512_permutex2var_epi16(w0, codes, w1);
  const __m128i h = _mm512_castsi512_si128(_mm512_permutex2var_epi16(w0, bits, w1));
  const __mmask64 mlo = _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(h));
  const __mmask64 mhi = _cvtu64_mask64((uint64_t)_mm_extract_epi64(h, 1));
  *lo = _mm512_mask_add_epi8(_mm512_and_si512(v, lo4), mlo, _mm512_and_si512(v, lo4), bit4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  *hi = _mm512_mask_add_epi8(*hi, mhi, *hi, bit4);
}

/* Q5_0, one token, activations in quad order (kvl__q8_order): four blocks' 16 code bytes
 * in one register, whose low nibbles are elements 0-15 of the four blocks and high
 * nibbles 16-31, where quad order puts the matching activations. The fifth bits go in as
 * two 64-bit byte masks (a masked add of 16). So four blocks cost two dpbusd and about a
 * dozen vector operations instead of two pairs' thirty. nb a multiple of 4. Same
 * arithmetic as dot1_blocks16 in another order. */
static inline __attribute__((always_inline)) void dotn_q5_0_quads(const uint8_t *w, int64_t nb, int64_t K,
                                                                  const int8_t *xp, const struct acts *a, float *out,
                                                                  const int T, const int rq);
static float dot1_q5_0_quads(const uint8_t *w, int64_t nb, const int8_t *xp, const struct acts *a) {
  float out;
  dotn_q5_0_quads(w, nb, 0, xp, a, &out, 1, 0); /* the several-token form's one-token case */
  return out;
}

/* Q4_K, one token, one block: its eight sub-block scales times d times the eight
 * activation scales xd (the return), and the mins' correction added to *corr (dmin x min x
 * activation scale x code sum of each 32, from the sums of 16 xs). */
static inline __m256 q4_k_block1(const uint8_t *w, const float *xd_, const int32_t *xs, __m256 *corr) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m256 scf, mnf;
  kvl__q4_k_scales8(w + 4, &scf, &mnf);
  __m256 xd = _mm256_loadu_ps(xd_);
  __m512i s16 = _mm512_loadu_si512(xs); /* sums of 16 codes */
  __m256i s8 = _mm512_castsi512_si256(_mm512_add_epi32(_mm512_permutexvar_epi32(even, s16),
                                                       _mm512_permutexvar_epi32(odd, s16)));
  *corr = _mm256_fmadd_ps(_mm256_mul_ps(mnf, _mm256_set1_ps(kvl__h2f(w + 2))), _mm256_mul_ps(xd, _mm256_cvtepi32_ps(s8)),
                          *corr);
  return _mm256_mul_ps(_mm256_mul_ps(scf, _mm256_set1_ps(kvl__h2f(w))), xd);
}

/* Q4_K, one token: a block's eight 6-bit scales and mins unpacked together with 32-bit
 * masks (the 12 scale bytes hold scales 0-3 and mins 0-3 in their low 6 bits, and scales
 * and mins 4-7 split over the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7),
 * multiplied by the eight activation scales in one vector; the mins' correction is one
 * FMA per block. Same arithmetic as dot_q4_k_n in another order. */
static float dot1_q4_k(const uint8_t *w, int64_t nb, const struct acts *a) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  __m256 corr = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 144) {
    _mm_prefetch((const char *)w + 4096, _MM_HINT_T1); /* 4 KiB ahead */
    _mm_prefetch((const char *)w + 4160, _MM_HINT_T1);
    _mm_prefetch((const char *)w + 4224, _MM_HINT_T1);
    __m256 sc = q4_k_block1(w, DA(a, 0) + 8 * b, SA(a, 0) + 16 * b, &corr);
    __m512 sc16 = _mm512_castps256_ps512(sc);
    const uint8_t *q = w + 16;
    const int8_t *xq = QA(a, 0) + 256 * b;
    for (int j = 0; j < 4; j += 2) {
      __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kvl__q4_k_unit(q, j), _mm512_loadu_si512(xq + 64 * j));
      __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kvl__q4_k_unit(q, j + 1), _mm512_loadu_si512(xq + 64 * j + 64));
      __m512i i0 = _mm512_add_epi32(lanes, _mm512_set1_epi32(2 * j));
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(i0, sc16), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(_mm512_add_epi32(i0, _mm512_set1_epi32(2)), sc16),
                             acc1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(acc0, acc1), _mm512_zextps256_ps512(corr)));
}

/* Q4_K, one token, activations in pair order (kvl__q8_order): a 512-bit load of 64 code
 * bytes holds units 2p and 2p+1; its low nibbles are elements 128p..128p+31 and
 * 128p+64..128p+95 of the block, its high nibbles 128p+32..63 and 128p+96..127, which is
 * where pair order puts the matching activations. So a pair of units costs one load and
 * three logic operations instead of eight, and the sub-block scales follow by permute.
 * The block's 6-bit scales and mins are unpacked in a vector register
 * (kvl__q4_k_scale_bytes), lanes 0-7 the scales and 8-15 the mins, times (d, dmin) and
 * the token's factors xf (kvl__q4_k_act_factors: the activation scales, and scale x code
 * sum per 32): one product gives the dots' scales in
 * lanes 0-7 and, fused into corr, the mins' correction in lanes 8-15. Same arithmetic
 * as dot1_q4_k in another order. */
static inline __attribute__((always_inline)) void dotn_q4_k_pairs(const uint8_t *w, int64_t nb, int64_t K,
                                                                  const int8_t *xp, const float *xf, float *out,
                                                                  const int T, const int sb);
static float dot1_q4_k_pairs(const uint8_t *w, int64_t nb, const int8_t *xp, const float *xf) {
  float out;
  dotn_q4_k_pairs(w, nb, 0, xp, xf, &out, 1, 0); /* the several-token form's one-token case */
  return out;
}

/* ---- 2..6 tokens through the single-token kernels, each weight block unpacked once ------
 *
 * A decode step of a few streams ran the single-token kernel once per token on a row
 * while it was in L1: the codes' unpacking and the block's scales were redone for every
 * token. Here they are done once per block and every token runs the single-token
 * kernel's own operations on them, in its order (per token: the same products, sums and
 * accumulators), so each token's result has the bits it has alone (test-backend-ops
 * checks). Registers: three or four vectors per token. */
#define QDOT1N_MAX 6

/* sb: w is KVL__TYPE_Q4_K_SB (the scales and mins already bytes: one load instead of
 * kvl__q4_k_scale_bytes's eight operations; the same values, the same bits). A Zen 4,
 * one token, 4864 x 1536 in L3 (test-backend-ops --perf): 46 -> 53 GB/s of GGUF bytes. */
static inline __attribute__((always_inline)) void dotn_q4_k_pairs(const uint8_t *w, int64_t nb, int64_t K,
                                                                  const int8_t *xp, const float *xf, float *out,
                                                                  const int T, const int sb) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i ilo0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i ihi0 = _mm512_add_epi32(ilo0, _mm512_set1_epi32(1));
  const __m512i ilo1 = _mm512_add_epi32(ilo0, _mm512_set1_epi32(4));
  const __m512i ihi1 = _mm512_add_epi32(ilo0, _mm512_set1_epi32(5));
  const __m512i dsel = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc0[QDOT1N_MAX], acc1[QDOT1N_MAX], corr[QDOT1N_MAX];
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += sb ? KVL__Q4_K_SB_BYTES : 144) {
    _mm_prefetch((const char *)w + 4096, _MM_HINT_T1);
    _mm_prefetch((const char *)w + 4160, _MM_HINT_T1);
    _mm_prefetch((const char *)w + 4224, _MM_HINT_T1);
    const __m128i sm = sb ? _mm_loadu_si128((const __m128i *)(w + 4)) : kvl__q4_k_scale_bytes(w + 4);
    const __m512 dm = _mm512_permutexvar_ps(dsel, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadu_si32(w))));
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), dm);
    const uint8_t *cq = w + (sb ? 20 : 16);
    const __m512i r0 = _mm512_loadu_si512(cq), r1 = _mm512_loadu_si512(cq + 64);
    const __m512i u0 = _mm512_and_si512(r0, lo4), u1 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4);
    const __m512i u2 = _mm512_and_si512(r1, lo4), u3 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), lo4);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      const __m512 xfb = _mm512_loadu_ps(xf + t * (K / 16) + 16 * b);
      const __m512 sc16 = _mm512_mul_ps(f, xfb);
      corr[t] = _mm512_fmadd_ps(f, xfb, corr[t]);
      const int8_t *x = xp + t * K + 256 * b;
      const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(x));
      const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, _mm512_loadu_si512(x + 64));
      const __m512i d2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u2, _mm512_loadu_si512(x + 128));
      const __m512i d3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u3, _mm512_loadu_si512(x + 192));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(ilo0, sc16), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(ihi0, sc16), acc1[t]);
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_permutexvar_ps(ilo1, sc16), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d3), _mm512_permutexvar_ps(ihi1, sc16), acc1[t]);
    }
  }
  for (int t = 0; t < T; t++) {
    const __m256 c8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(corr[t]), 1));
    out[t] = _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(acc0[t], acc1[t]), _mm512_zextps256_ps512(c8)));
  }
}

static inline __attribute__((always_inline)) void dotn_q6_k(const uint8_t *w, int64_t nb, int64_t K, const int8_t *xq,
                                                            const float *xd, const int32_t *xs, float *out, const int T) {
  const __m512i quads = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512 acc0[QDOT1N_MAX], acc1[QDOT1N_MAX], corr[QDOT1N_MAX];
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 4096 + o, _MM_HINT_T1);
    const __m512 gs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192)))),
                                    _mm512_set1_ps(kvl__h2f(w + 208)));
    __m512i units[2][2];
    kvl__q6_k_half(w, 0, units[0]);
    kvl__q6_k_half(w, 1, units[1]);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      const __m512 xdv = _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_loadu_ps(xd + t * (K / 32) + 8 * b)));
      const __m512 sc = _mm512_mul_ps(gs, xdv);
      corr[t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_loadu_si512(xs + t * (K / 16) + 16 * b)), corr[t]);
      const int8_t *x = xq + t * K + 256 * b;
      for (int n = 0; n < 2; n++) {
        const __m512i i0 = _mm512_add_epi32(quads, _mm512_set1_epi32(8 * n));
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), units[n][0], _mm512_loadu_si512(x + 128 * n));
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), units[n][1], _mm512_loadu_si512(x + 128 * n + 64));
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(i0, sc), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(_mm512_add_epi32(i0, _mm512_set1_epi32(4)), sc),
                                  acc1[t]);
      }
    }
  }
  for (int t = 0; t < T; t++)
    out[t] = _mm512_reduce_add_ps(_mm512_fnmadd_ps(corr[t], _mm512_set1_ps(32.0f), _mm512_add_ps(acc0[t], acc1[t])));
}

/* Q8_0, and Q5_0 where K is not a multiple of 128, T tokens (a[t]: token t): the whole
 * row, nb even (K a multiple of 64), in groups of 16 blocks, the last one partial */
static inline __attribute__((always_inline)) void dotn_blocks16(const uint8_t *w, int64_t nb, const struct acts *a,
                                                                const int stride, const int q5, float *out, const int T) {
  __m512 acc0[QDOT1N_MAX], acc1[QDOT1N_MAX], corr[QDOT1N_MAX], sc[QDOT1N_MAX];
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  /* stride 0: KVL__TYPE_Q8_0_SC (the scales first, then the codes as u8) */
  const uint8_t *const w0 = w, *const codes = w + 2 * nb;
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16, w += 16 * stride) {
    int n = nb - b < 16 ? (int)(nb - b) : 16;
    __mmask16 m = (__mmask16)(0xffffu >> (16 - n));
    if (stride)
      for (int o = 0; o < 16 * stride; o += 64) _mm_prefetch((const char *)w + 4096 + o, _MM_HINT_T0);
    else
      for (int o = 0; o < 16 * 32; o += 64) _mm_prefetch((const char *)codes + 32 * b + 4096 + o, _MM_HINT_T0);
    __m512 ws = stride ? block_scales16(w, stride, m) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w0 + 2 * b));
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      sc[t] = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(m, DA(&a[t], 0) + b));
      corr[t] = _mm512_fmadd_ps(ws, block_sums16(&a[t], b, m), corr[t]);
    }
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      const uint8_t *p = w + j * stride;
      __m512i u0, u1;
      if (!stride)
        u0 = _mm512_loadu_si512(codes + 32 * (b + j)), u1 = _mm512_loadu_si512(codes + 32 * (b + j + 2));
      else if (q5) u0 = kvl__q5_0_pair(p), u1 = kvl__q5_0_pair(p + 2 * stride);
      else u0 = kvl__q8_0_pair(p), u1 = kvl__q8_0_pair(p + 2 * stride);
      __m512i i0 = _mm512_add_epi32(lanes, _mm512_set1_epi32(j));
      __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(2));
#pragma GCC unroll 6
      for (int t = 0; t < T; t++) {
        const int8_t *xq = QA(&a[t], 0);
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(xq + 32 * (b + j)));
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, _mm512_loadu_si512(xq + 32 * (b + j + 2)));
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(i0, sc[t]), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(i1, sc[t]), acc1[t]);
      }
    }
    if (j < n) {
      const uint8_t *p = w + j * stride;
      __m512i u0 = !stride ? _mm512_loadu_si512(codes + 32 * (b + j)) : q5 ? kvl__q5_0_pair(p) : kvl__q8_0_pair(p);
      for (int t = 0; t < T; t++) {
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(QA(&a[t], 0) + 32 * (b + j)));
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0),
                                  _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(j)), sc[t]), acc0[t]);
      }
    }
  }
  for (int t = 0; t < T; t++)
    out[t] = _mm512_reduce_add_ps(_mm512_fnmadd_ps(corr[t], _mm512_set1_ps(q5 ? 16.0f : 128.0f), _mm512_add_ps(acc0[t], acc1[t])));
}

/* Q5_0 in quad order (dot1_q5_0_quads) for T tokens (xp: token t's codes at t x K).
 * rq: w is the quads copy (KVL__TYPE_Q5_0_QUADS, kvl__q5_0_quads_pack), whose four
 * blocks' codes are one load in quad order already and their fifth bits two mask loads
 * (kmovq from memory), so q5_0_quad's two word permutes, masked load and moves through
 * general registers go, and 16 blocks' scales are one 32-byte load; the same operations
 * after that, the same bits. test-backend-ops --perf (4864 x 1536, a Zen 4): one token
 * 30 -> 49 GB/s of weights, four 0.42 -> 0.32 ms. */
static inline __attribute__((always_inline)) void dotn_q5_0_quads(const uint8_t *w, int64_t nb, int64_t K,
                                                                  const int8_t *xp, const struct acts *a, float *out,
                                                                  const int T, const int rq) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc0[QDOT1N_MAX], acc1[QDOT1N_MAX], corr[QDOT1N_MAX], sc[QDOT1N_MAX];
  for (int t = 0; t < T; t++) acc0[t] = acc1[t] = corr[t] = _mm512_setzero_ps();
  const uint8_t *q = w + 2 * nb; /* rq: the quads, 80 bytes each */
  for (int64_t b = 0; b < nb; b += 16, w += rq ? 0 : 16 * 22) {
    int n = nb - b < 16 ? (int)(nb - b) : 16;
    __mmask16 m = (__mmask16)(0xffffu >> (16 - n));
    if (!rq)
      for (int o = 0; o < 16 * 22; o += 64) _mm_prefetch((const char *)w + 4096 + o, _MM_HINT_T0);
    __m512 ws = rq ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + 2 * b)) : block_scales16(w, 22, m);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
      sc[t] = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(m, DA(&a[t], 0) + b));
      corr[t] = _mm512_fmadd_ps(ws, block_sums16(&a[t], b, m), corr[t]);
    }
    for (int j = 0; j < n; j += 4, q += 80) {
      __m512i lo, hi;
      if (rq) {
        _mm_prefetch((const char *)q + 4096, _MM_HINT_T0);
        _mm_prefetch((const char *)q + 4096 + 64, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(q);
        const __mmask64 mlo = _load_mask64((__mmask64 *)(uintptr_t)(q + 64));
        const __mmask64 mhi = _load_mask64((__mmask64 *)(uintptr_t)(q + 72));
        const __m512i l = _mm512_and_si512(v, lo4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        lo = _mm512_mask_add_epi8(l, mlo, l, bit4), hi = _mm512_mask_add_epi8(h, mhi, h, bit4);
      } else q5_0_quad(w + j * 22, &lo, &hi);
      const __m512i iq = _mm512_add_epi32(quad, _mm512_set1_epi32(j));
#pragma GCC unroll 6
      for (int t = 0; t < T; t++) {
        const int8_t *x = xp + t * K + 32 * (b + j);
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 64));
        __m512 s4 = _mm512_permutexvar_ps(iq, sc[t]);
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s4, acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s4, acc1[t]);
      }
    }
  }
  for (int t = 0; t < T; t++)
    out[t] = _mm512_reduce_add_ps(_mm512_fnmadd_ps(corr[t], _mm512_set1_ps(16.0f), _mm512_add_ps(acc0[t], acc1[t])));
}

#define dotn_q5_0_quads_gguf(...) dotn_q5_0_quads(__VA_ARGS__, 0)
#define dotn_q5_0_quads_rq(...) dotn_q5_0_quads(__VA_ARGS__, 1)
#define dotn_q4_k_pairs_gguf(...) dotn_q4_k_pairs(__VA_ARGS__, 0)
#define dotn_q4_k_pairs_sb(...) dotn_q4_k_pairs(__VA_ARGS__, 1)

#define N1CASE(f, T, ...)                                                                                      \
  case T:                                                                                                      \
    f(__VA_ARGS__, T);                                                                                         \
    return 0;
/* the kernel f for 2..6 tokens (n_tokens; returns 0); other counts fall through */
#define N1SWITCH(f, ...)                                                                                       \
  switch (n_tokens) {                                                                                          \
    N1CASE(f, 2, __VA_ARGS__)                                                                                  \
    N1CASE(f, 3, __VA_ARGS__)                                                                                  \
    N1CASE(f, 4, __VA_ARGS__)                                                                                  \
    N1CASE(f, 5, __VA_ARGS__)                                                                                  \
    N1CASE(f, 6, __VA_ARGS__)                                                                                  \
  default: break;                                                                                              \
  }

int kvl__qdot1n_avx512vnni(uint32_t type, const void *w, int64_t K, int n_tokens, const int8_t *xq, const int8_t *xp,
                           const float *xd, const int32_t *xs, const float *xf, float *out) {
  if (type == KVL_TYPE_Q4_K && xf) {
    N1SWITCH(dotn_q4_k_pairs_gguf, w, K / 256, K, xp, xf, out)
  }
  if (type == KVL__TYPE_Q4_K_SB && xf && K % 256 == 0) {
    N1SWITCH(dotn_q4_k_pairs_sb, w, K / 256, K, xp, xf, out)
  }
  struct acts a[QDOT1N_MAX];
  for (int t = 0; t < n_tokens && t < QDOT1N_MAX; t++)
    a[t] = (struct acts){xq + t * K, xd + t * (K / 32), xs + t * (K / 16), K, 1};
  if (type == KVL_TYPE_Q5_0 && K % 128 == 0) {
    N1SWITCH(dotn_q5_0_quads_gguf, w, K / 32, K, xp, a, out)
  }
  if (type == KVL__TYPE_Q5_0_QUADS && K % 128 == 0) {
    N1SWITCH(dotn_q5_0_quads_rq, w, K / 32, K, xp, a, out)
  }
  if ((type == KVL_TYPE_Q5_0 || type == KVL_TYPE_Q8_0) && K % 64 == 0) { /* the single-token kernel's even nb */
    const int stride = type == KVL_TYPE_Q5_0 ? 22 : 34, q5 = type == KVL_TYPE_Q5_0;
    N1SWITCH(dotn_blocks16, w, K / 32, a, stride, q5, out)
  }
  if (type == KVL__TYPE_Q8_0_SC && K % 64 == 0) {
    N1SWITCH(dotn_blocks16, w, K / 32, a, 0, 0, out)
  }
  if (type == KVL_TYPE_Q6_K) {
    N1SWITCH(dotn_q6_k, w, K / 256, K, xq, xd, xs, out)
  }
  return KVL_ENOTSUP;
}

static void dot_q4_k(const uint8_t *w, int64_t nb, const struct acts *a, float *out) {
  if (a->T == 1) *out = dot1_q4_k(w, nb, a);
  else dot_q4_k_n(w, nb, a, out, a->T);
}

/* Q6_K, one token: a block's sixteen int8 group scales (16 elements each) times d times
 * each group's activation scale in one vector; a unit's lane scales (4 lanes per group)
 * are a permute of it, and the offset correction is one FMA per block against the sums
 * of 16 activation codes. Same arithmetic as dot_q6_k_n in another order. */
static float dot1_q6_k(const uint8_t *w, int64_t nb, const struct acts *a) {
  float out;
  dotn_q6_k(w, nb, 0, QA(a, 0), DA(a, 0), SA(a, 0), &out, 1); /* the several-token form's one-token case */
  return out;
}

static void dot_q6_k(const uint8_t *w, int64_t nb, const struct acts *a, float *out) {
  if (a->T == 1) *out = dot1_q6_k(w, nb, a);
  else dot_q6_k_n(w, nb, a, out, a->T);
}

int kvl__qdot_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd,
                         const int32_t *xs, int n_tokens, float *out) {
  if (n_tokens < 1 || n_tokens > KVL__QDOT_MAX_T) return KVL_EINVAL;
  struct acts a = {xq, xd, xs, K, n_tokens};
  switch (type) {
  case KVL_TYPE_Q8_0: dot_q8_0(w, K / 32, &a, out); return 0;
  case KVL_TYPE_Q5_0: dot_q5_0(w, K / 32, &a, out); return 0;
  case KVL_TYPE_Q4_K: dot_q4_k(w, K / 256, &a, out); return 0;
  case KVL_TYPE_Q6_K: dot_q6_k(w, K / 256, &a, out); return 0;
  default: return KVL_ENOTSUP;
  }
}

/* The 16-byte chunks of every 128 codes, in the order a format's one-token kernel reads
 * them: Q4_K's 512-bit code loads hold (32, 32) low and (32, 32) high nibbles of two
 * units, Q5_0's hold the low and the high 16 nibbles of four blocks. */
static const uint8_t pair_order[8] = {0, 1, 4, 5, 2, 3, 6, 7}, quad_order[8] = {0, 2, 4, 6, 1, 3, 5, 7};

bool kvl__q8_order(uint32_t type, const int8_t *xq, int64_t K, int8_t *xp) {
  const uint8_t *o = type == KVL_TYPE_Q4_K ? pair_order : type == KVL_TYPE_Q5_0 && K % 128 == 0 ? quad_order : NULL;
  if (!o) return false;
  for (int64_t c = 0; c + 128 <= K; c += 128)
    for (int i = 0; i < 8; i++) memcpy(xp + c + 16 * i, xq + c + 16 * o[i], 16);
  return true;
}

int kvl__qdot1_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const int8_t *xp,
                          const float *xd, const int32_t *xs, const float *xf, float *out) {
  if (type == KVL_TYPE_Q4_K && xf) {
    *out = dot1_q4_k_pairs(w, K / 256, xp, xf);
    return 0;
  }
  if (type == KVL__TYPE_Q8_0_SC) {
    if (K % 64) return KVL_ENOTSUP;
    struct acts a = {xq, xd, xs, K, 1};
    dotn_blocks16(w, K / 32, &a, 0, 0, out, 1);
    return 0;
  }
  if (type == KVL__TYPE_Q4_K_SB) {
    if (!xf || K % 256) return KVL_ENOTSUP;
    dotn_q4_k_pairs(w, K / 256, 0, xp, xf, out, 1, 1);
    return 0;
  }
  if (type == KVL_TYPE_Q5_0 && K % 128 == 0) {
    struct acts a = {xq, xd, xs, K, 1};
    *out = dot1_q5_0_quads(w, K / 32, xp, &a);
    return 0;
  }
  if (type == KVL__TYPE_Q5_0_QUADS) {
    if (K % 128) return KVL_ENOTSUP;
    struct acts a = {xq, xd, xs, K, 1};
    dotn_q5_0_quads(w, K / 32, 0, xp, &a, out, 1, 1);
    return 0;
  }
  return kvl__qdot_avx512vnni(type, w, K, xq, xd, xs, 1, out);
}

/* One token against a run of rows (the qdot1_rows contract): the single-token kernels
 * above inlined into one loop per format, each row the bits kvl__qdot1_avx512vnni gives
 * it. Per row the indirect call, the format's dispatch and the activations' set-up of
 * the per-row path (7 % of the 1.5B's decode in perf record on a Zen 4, besides the
 * kernels; its rows are 6 Q4_K blocks) went: tg128 there 32-35 -> 36-38 tokens/s (1.5B),
 * 58-64 -> 68-69 (0.5B). */
int kvl__qdot1_rows_avx512vnni(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t K,
                               const int8_t *xq, const int8_t *xp, const float *xd, const int32_t *xs,
                               const float *xf, const float *bias, float *y) {
  const struct acts a = {xq, xd, xs, K, 1};
  const uint8_t *p = w;
  float v;
#define ROWS(...)                                                                                              \
  for (int64_t r = 0; r < n_rows; r++, p += row_bytes) {                                                     \
    __VA_ARGS__;                                                                                               \
    y[r] = v + (bias ? bias[r] : 0.0f);                                                                        \
  }                                                                                                            \
  return 0
  switch (type) {
  case KVL_TYPE_Q4_K:
    if (!xf || K % 256) return KVL_ENOTSUP;
    ROWS(dotn_q4_k_pairs(p, K / 256, 0, xp, xf, &v, 1, 0));
  case KVL__TYPE_Q4_K_SB:
    if (!xf || K % 256) return KVL_ENOTSUP;
    ROWS(dotn_q4_k_pairs(p, K / 256, 0, xp, xf, &v, 1, 1));
  case KVL_TYPE_Q6_K:
    if (K % 256) return KVL_ENOTSUP;
    ROWS(dotn_q6_k(p, K / 256, 0, xq, xd, xs, &v, 1));
  case KVL_TYPE_Q5_0:
    if (K % 128 == 0) { ROWS(dotn_q5_0_quads(p, K / 32, 0, xp, &a, &v, 1, 0)); }
    ROWS(dot_q5_0(p, K / 32, &a, &v));
  case KVL__TYPE_Q5_0_QUADS:
    if (K % 128) return KVL_ENOTSUP;
    ROWS(dotn_q5_0_quads(p, K / 32, 0, xp, &a, &v, 1, 1));
  case KVL_TYPE_Q8_0: ROWS(dot_q8_0(p, K / 32, &a, &v));
  case KVL__TYPE_Q8_0_SC:
    if (K % 64) return KVL_ENOTSUP;
    ROWS(dotn_blocks16(p, K / 32, &a, 0, 0, &v, 1));
  default: return KVL_ENOTSUP;
  }
#undef ROWS
}

/* ---- many tokens: per-token scales as vectors ------------------------------------------
 *
 * For 2..16 tokens the per-token scalar work of the kernels above (scale products, the
 * offset correction) costs more than the dot product itself. Here it is prepared once per
 * matmul as two vectors per token and 64-element unit p (kvl__q8_act_vec):
 *   sx[p]: lanes 0-7 = d[2p], lanes 8-15 = d[2p+1]          (the activation scales)
 *   cx[p]: lanes 0, 4, 8, 12 = d * (sum of each 16 codes), others 0
 * and each unit of a weight row costs, per token, one dpbusd, one conversion, one
 * multiply and two FMAs: acc += cvt(dot) * (ws * sx) - gs * cx, with the unit's weight
 * scales ws and offset scales gs built once for all tokens. Same arithmetic as above, in
 * another order (results agree to float rounding). K must be a multiple of 64. */

void kvl__q8_act_vec(const float *xd, const int32_t *s16, int64_t K, float *sx, float *cx) {
  for (int64_t p = 0; p < K / 64; p++) {
    __m512 s = two_scales(xd[2 * p], xd[2 * p + 1]);
    _mm512_storeu_ps(sx + 16 * p, s);
    __m512 c = _mm512_setzero_ps();
    c = _mm512_mask_mov_ps(c, 0x0001, _mm512_set1_ps(xd[2 * p] * (float)s16[4 * p]));
    c = _mm512_mask_mov_ps(c, 0x0010, _mm512_set1_ps(xd[2 * p] * (float)s16[4 * p + 1]));
    c = _mm512_mask_mov_ps(c, 0x0100, _mm512_set1_ps(xd[2 * p + 1] * (float)s16[4 * p + 2]));
    c = _mm512_mask_mov_ps(c, 0x1000, _mm512_set1_ps(xd[2 * p + 1] * (float)s16[4 * p + 3]));
    _mm512_storeu_ps(cx + 16 * p, c);
  }
}

struct vacts { const int8_t *q; const float *sx, *cx; int64_t K; };

#define VQ(a, t) ((a)->q + (int64_t)(t) * (a)->K)
#define VS(a, t) ((a)->sx + (int64_t)(t) * ((a)->K / 4))
#define VC(a, t) ((a)->cx + (int64_t)(t) * ((a)->K / 4))

static inline __attribute__((always_inline)) void unit_tokens(__m512i u, __m512 ws, __m512 gs, int64_t p,
                                                             const struct vacts *a, __m512 *acc, const int T) {
  for (int t = 0; t < T; t++) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(VQ(a, t) + 64 * p));
    __m512 s = _mm512_mul_ps(ws, _mm512_loadu_ps(VS(a, t) + 16 * p));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[t]);
    acc[t] = _mm512_fnmadd_ps(gs, _mm512_loadu_ps(VC(a, t) + 16 * p), acc[t]);
  }
}

static inline __attribute__((always_inline)) void vdot_q8_0(const uint8_t *w, int64_t nb, const struct vacts *a,
                                                           float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < nb / 2; p++, w += 68) {
    _mm_prefetch((const char *)w + 512, _MM_HINT_T0);
    float wda = kvl__h2f(w), wdb = kvl__h2f(w + 34);
    unit_tokens(kvl__q8_0_pair(w), two_scales(wda, wdb), two_scales(128.0f * wda, 128.0f * wdb), p, a, acc, T);
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

static inline __attribute__((always_inline)) void vdot_q5_0(const uint8_t *w, int64_t nb, const struct vacts *a,
                                                           float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < nb / 2; p++, w += 44) {
    _mm_prefetch((const char *)w + 384, _MM_HINT_T0);
    float wda = kvl__h2f(w), wdb = kvl__h2f(w + 22);
    unit_tokens(kvl__q5_0_pair(w), two_scales(wda, wdb), two_scales(16.0f * wda, 16.0f * wdb), p, a, acc, T);
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

static inline __attribute__((always_inline)) void vdot_q4_k(const uint8_t *w, int64_t nb, const struct vacts *a,
                                                           float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 144) {
    _mm_prefetch((const char *)w + 576, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 640, _MM_HINT_T0);
    _mm_prefetch((const char *)w + 704, _MM_HINT_T0);
    float d = kvl__h2f(w), dmin = kvl__h2f(w + 2);
    const uint8_t *sc = w + 4, *q = w + 16;
    for (int j = 0; j < 4; j++) {
      uint8_t s0, m0, s1, m1;
      kvl_q4_k_scale_min(2 * j, sc, &s0, &m0);
      kvl_q4_k_scale_min(2 * j + 1, sc, &s1, &m1);
      unit_tokens(kvl__q4_k_unit(q, j), two_scales(d * (float)s0, d * (float)s1), two_scales(dmin * (float)m0, dmin * (float)m1),
                  4 * b + j, a, acc, T);
    }
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

static inline __attribute__((always_inline)) void vdot_q6_k(const uint8_t *w, int64_t nb, const struct vacts *a,
                                                           float *out, const int T) {
  __m512 acc[KVL__QDOT_MAX_T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, w += 210) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + 630 + o, _MM_HINT_T0);
    float d = kvl__h2f(w + 208);
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int n = 0; n < 2; n++) {
      __m512i units[2];
      kvl__q6_k_half(w, n, units);
      const int8_t *g = sc + 8 * n;
      for (int k = 0; k < 2; k++) {
        __m512i u = units[k];
        float f0 = d * (float)g[4 * k], f1 = d * (float)g[4 * k + 1], f2 = d * (float)g[4 * k + 2],
              f3 = d * (float)g[4 * k + 3];
        __m512 ws = _mm512_set_ps(f3, f3, f3, f3, f2, f2, f2, f2, f1, f1, f1, f1, f0, f0, f0, f0);
        unit_tokens(u, ws, _mm512_mul_ps(ws, _mm512_set1_ps(32.0f)), 4 * b + 2 * n + k, a, acc, T);
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

#define VCASE(f, T)                                                                                            \
  case T:                                                                                                      \
    f(w, nb, a, out, T);                                                                                       \
    break;
#define VDISPATCH(f)                                                                                           \
  static void f##_any(const uint8_t *w, int64_t nb, const struct vacts *a, float *out, int T) {              \
    switch (T) {                                                                                               \
      VCASE(f, 2) VCASE(f, 3) VCASE(f, 4) VCASE(f, 5) VCASE(f, 6) VCASE(f, 7) VCASE(f, 8) VCASE(f, 9)        \
      VCASE(f, 10) VCASE(f, 11) VCASE(f, 12) VCASE(f, 13) VCASE(f, 14) VCASE(f, 15) VCASE(f, 16)             \
    default: f(w, nb, a, out, 1);                                                                              \
    }                                                                                                          \
  }
VDISPATCH(vdot_q8_0)
VDISPATCH(vdot_q5_0)
VDISPATCH(vdot_q4_k)
VDISPATCH(vdot_q6_k)

int kvl__qdot_vec_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *sx,
                             const float *cx, int n_tokens, float *out) {
  if (n_tokens < 1 || n_tokens > KVL__QDOT_MAX_T || K % 64) return KVL_EINVAL;
  struct vacts a = {xq, sx, cx, K};
  switch (type) {
  case KVL_TYPE_Q8_0: vdot_q8_0_any(w, K / 32, &a, out, n_tokens); return 0;
  case KVL_TYPE_Q5_0: vdot_q5_0_any(w, K / 32, &a, out, n_tokens); return 0;
  case KVL_TYPE_Q4_K: vdot_q4_k_any(w, K / 256, &a, out, n_tokens); return 0;
  case KVL_TYPE_Q6_K: vdot_q6_k_any(w, K / 256, &a, out, n_tokens); return 0;
  default: return KVL_ENOTSUP;
  }
}
