/* dequant_avx512.c — AVX-512 dequantisation of the block formats the real models use
 * (Q8_0, Q5_0, Q4_K, Q6_K), 16 lanes at a time. Same operations in the same order as the
 * scalar reference (products, then the offset; no fused multiply-add), so the results
 * are bit-identical to it (test-backend-ops checks). Compiled with -mavx512f -mavx512bw -mf16c. */
#include <immintrin.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"
#include "qunpack_avx512.h"

static inline float h2f(const uint8_t *p) { /* F16C: exact, as the reference */
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* 16 bytes -> 16 x int32 */
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* one Q5_0 block's (b: 22 bytes) 32 signed codes (-16..15) as two vectors of 16 int32 */
static inline void q5_0_codes32(const uint8_t *b, __m512i *x0, __m512i *x1) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f), c16 = _mm512_set1_epi32(16);
  uint32_t qh;
  memcpy(&qh, b + 2, 4);
  __m512i q = u8x16(b + 6);
  __m512i a = _mm512_and_si512(q, lo4), c = _mm512_srli_epi32(q, 4);
  a = _mm512_mask_or_epi32(a, (__mmask16)(qh & 0xffff), a, c16);
  c = _mm512_mask_or_epi32(c, (__mmask16)(qh >> 16), c, c16);
  *x0 = _mm512_sub_epi32(a, c16), *x1 = _mm512_sub_epi32(c, c16);
}

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
  for (int64_t i = 0; i < nb; i++, b += 22, y += 32) {
    __m512 d = _mm512_set1_ps(h2f(b));
    __m512i x0, x1;
    q5_0_codes32(b, &x0, &x1);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(x0), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(x1), d));
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

/* ---- one row dotted with fp32 activations, dequantised in registers ---------------------
 *
 * kvl__simd.dequant_dot: the attention sink's rows (kvl_backend_fp32, one token) took every
 * weight row through dequantisation into a buffer and a dot product with it: six vector
 * operations and a store per 16 weights, then a load and an FMA. Here the codes go from
 * bytes to floats and into an FMA with x directly, and each group's scale multiplies its
 * partial sum once: d·sc·Σ q·x for the group, the offset (Q4_K's dmin·m, Q5_0's 16, Q6_K's 32)
 * as its scale times Σ x over the group (xs: the sums of x per 16 elements, once per product)
 * or, for Q5_0, subtracted from the codes as integers. fp32 throughout, in another order
 * than dequantise-then-dot: results agree to float rounding (test-backend-ops, the sink
 * twins' matmul). On a Zen 4 the 1.5B's sink row (bench-prefill-decode -p 1 -n 0, logits
 * included) went from 120-150 to 78-80 ms; per-16 conversions of Q6_K's codes and scalar
 * Q4_K scales had kept a first version at ~100. */

/* acc + (float)q · x, lane by lane (16 elements) */
static inline __m512 fq(__m512i q, const float *x, __m512 acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(x), acc); }

static float dd_q8_0(const uint8_t *b, const float *x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; i++, b += 34, x += 32) {
    __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))),
                             _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))),
                        _mm512_loadu_ps(x + 16), s);
    acc = _mm512_fmadd_ps(s, _mm512_set1_ps(h2f(b)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

static float dd_q5_0(const uint8_t *b, const float *x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; i++, b += 22, x += 32) {
    __m512i x0, x1;
    q5_0_codes32(b, &x0, &x1);
    __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(x0), _mm512_loadu_ps(x));
    s = fq(x1, x + 16, s);
    acc = _mm512_fmadd_ps(s, _mm512_set1_ps(h2f(b)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

/* Q4_K: the block's eight group scales d·sc and offsets dmin·m unpacked in a vector
 * (kvl__q4_k_group_scales); the offsets meet the sums of x per 32 in one FMA per block. */
static float dd_q4_k(const uint8_t *b, const float *x, const float *xs, int64_t nb) {
  const __m512i lo4 = _mm512_set1_epi32(0x0f);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512 acc = _mm512_setzero_ps();
  __m256 corr = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; i++, b += 144, xs += 16) {
    float ws[8], go[8];
    kvl__q4_k_group_scales(b, ws, go);
    const __m512 s16 = _mm512_loadu_ps(xs);
    const __m256 x32 = _mm512_castps512_ps256(_mm512_add_ps(_mm512_permutexvar_ps(even, s16), _mm512_permutexvar_ps(odd, s16)));
    corr = _mm256_fmadd_ps(_mm256_loadu_ps(go), x32, corr);
    const uint8_t *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32, x += 64) {
      const __m512i v0 = u8x16(q), v1 = u8x16(q + 16);
      __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, lo4)), _mm512_loadu_ps(x));
      __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(x + 32));
      lo = fq(_mm512_and_si512(v1, lo4), x + 16, lo);
      hi = fq(_mm512_srli_epi32(v1, 4), x + 48, hi);
      acc = _mm512_fmadd_ps(lo, _mm512_set1_ps(ws[2 * j]), acc);
      acc = _mm512_fmadd_ps(hi, _mm512_set1_ps(ws[2 * j + 1]), acc);
    }
  }
  return _mm512_reduce_add_ps(_mm512_sub_ps(acc, _mm512_zextps256_ps512(corr)));
}

/* Q6_K: each half's 128 codes built as bytes by the int8 kernels' unpacker (two 512-bit
 * vectors: a few operations per 64 codes, where building them in 32-bit lanes took four or
 * five per 16), widened 16 at a time; the offset of 32 is each group's scale times its
 * sum of x, one FMA per block over the sixteen groups. */
static float dd_q6_k(const uint8_t *b, const float *x, const float *xs, int64_t nb) {
  __m512 acc = _mm512_setzero_ps(), corr = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; i++, b += 210, x += 256, xs += 16) {
    const __m512 gs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                                    _mm512_set1_ps(h2f(b + 208)));
    corr = _mm512_fmadd_ps(gs, _mm512_loadu_ps(xs), corr);
    float g[16];
    _mm512_storeu_ps(g, gs);
    for (int n = 0; n < 2; n++) {
      __m512i u[2];
      kvl__q6_k_half(b, n, u);
      for (int k = 0; k < 2; k++) {
        const __m128i c[4] = {_mm512_castsi512_si128(u[k]), _mm512_extracti32x4_epi32(u[k], 1),
                              _mm512_extracti32x4_epi32(u[k], 2), _mm512_extracti32x4_epi32(u[k], 3)};
        for (int e = 0; e < 4; e++) { /* elements 128n + 64k + 16e .. +15: group 8n + 4k + e */
          const int o = 128 * n + 64 * k + 16 * e;
          const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c[e])), _mm512_loadu_ps(x + o));
          acc = _mm512_fmadd_ps(p, _mm512_set1_ps(g[o / 16]), acc);
        }
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_fnmadd_ps(corr, _mm512_set1_ps(32.0f), acc));
}

int kvl__dequant_dot_avx512(uint32_t type, const void *row, const float *x, const float *xs, int64_t K, float *out) {
  switch (type) {
  case KVL_TYPE_Q8_0: *out = dd_q8_0(row, x, K / 32); return 0;
  case KVL_TYPE_Q5_0: *out = dd_q5_0(row, x, K / 32); return 0;
  case KVL_TYPE_Q4_K: *out = dd_q4_k(row, x, xs, K / 256); return 0;
  case KVL_TYPE_Q6_K: *out = dd_q6_k(row, x, xs, K / 256); return 0;
  default: return KVL_ENOTSUP;
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
