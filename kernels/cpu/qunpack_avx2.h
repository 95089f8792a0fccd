/* qunpack_avx2.h — unpacking GGUF weight units into unsigned int8 codes and their scales
 * in AVX2 registers: shared by the per-token int8 kernels (qdot_avx2.c), the tokens-in-lanes
 * ones (qmatmul_avx2.c, qmatmul_avx512.c), and (the Q4_K scales) the AMX ones (qdot_amx.c). Include only from
 * files compiled with -mavx2 -mf16c. Block layouts: kernels/ref/quant_ref.c. */
#ifndef KVL_QUNPACK_AVX2_H
#define KVL_QUNPACK_AVX2_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kvl_quant.h"

/* Q4_K's eight 6-bit scales and eight minimums of a super-block from its 12 packed bytes
 * (kvl_q4_k_scale_min: sub-blocks 0-3 keep their low 6 bits in bytes 0-3 / 4-7; 4-7 take 4
 * bits from bytes 8-11 and their top 2 from the high bits of bytes 0-3 / 4-7), as bytes
 * [scales 0-7, mins 0-7], built in one register: as 32-bit words u0 u1 u2, scales 0-3 =
 * u0 & 0x3f.., scales 4-7 = (u2 & 0x0f..) | ((u0 >> 2) & 0x30..), mins 0-3 = u1 & 0x3f..,
 * mins 4-7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 2) & 0x30..). Reads 16 bytes from sc12 (the 4
 * after the scales are the block's codes). Built in scalars and stored, the vector load of
 * them could not be forwarded from the stores: the one-token Q4_K kernel ran 12 % slower. */
static inline __m128i kvl__q4_k_scale_bytes(const uint8_t *sc12) {
  const __m128i u = _mm_loadu_si128((const __m128i *)sc12);
  const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i c = _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)), _mm_setr_epi32(0, 2, 0, 2));
  return _mm_or_si128(_mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                      _mm_and_si128(c, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

/* the same as floats in sub-block order */
static inline void kvl__q4_k_scales8(const uint8_t *sc12, __m256 *s, __m256 *m) {
  const __m128i b = kvl__q4_k_scale_bytes(sc12);
  *s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  *m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

/* A Q4_K block's (b: 144 bytes) eight group scales d*sc and offsets dmin*m, stored to
 * ws[8] and go[8]: the per-group factors of the whole-matmul kernels. */
static inline void kvl__q4_k_group_scales(const uint8_t *b, float *ws, float *go) {
  uint16_t h[2];
  memcpy(h, b, 4);
  __m256 s, m;
  kvl__q4_k_scales8(b + 4, &s, &m);
  _mm256_storeu_ps(ws, _mm256_mul_ps(s, _mm256_set1_ps(_cvtsh_ss(h[0]))));
  _mm256_storeu_ps(go, _mm256_mul_ps(m, _mm256_set1_ps(_cvtsh_ss(h[1]))));
}

/* Q5_0's 32 fifth bits (bit j of qh for element j) as bytes 0x10 or 0 */
static inline __m256i kvl__q5_high_bits(uint32_t qh) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* one Q5_0 block's (22 bytes) 32 unsigned codes (0..31) */
static inline __m256i kvl__q5_0_codes(const uint8_t *w) {
  uint32_t qh;
  memcpy(&qh, w + 2, 4);
  __m128i qs = _mm_loadu_si128((const __m128i *)(w + 6));
  __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0f));
  return _mm256_or_si256(u, kvl__q5_high_bits(qh));
}

/* Q6_K: half n (elements 128n..128n+127) of a block (w: 210 bytes) as four units of 32
 * codes 0..63. Element 128n + 32k + l of unit k: a nibble of ql (byte l + 32(k & 1), the
 * high one for k >= 2) under bits 2k, 2k+1 of qh[l]. */
static inline void kvl__q6_k_half32(const uint8_t *w, int n, __m256i u[4]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
  const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
  __m256i la = _mm256_loadu_si256((const __m256i *)ql), lb = _mm256_loadu_si256((const __m256i *)(ql + 32));
  __m256i h = _mm256_loadu_si256((const __m256i *)qh);
  u[0] = _mm256_or_si256(_mm256_and_si256(la, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 4), hi2));
  u[1] = _mm256_or_si256(_mm256_and_si256(lb, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 2), hi2));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), lo4), _mm256_and_si256(h, hi2));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), lo4), _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
}

static inline float kvl__h2f(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* One chunk (elements k0..k0+L, L <= 256) of one weight row, for the tokens-in-lanes
 * kernels: unsigned codes into a (L bytes), the group scales and offsets into ws, go (L/SB
 * each: SB = 16 for Q6_K, else 32). Q8_0's signed codes stay signed, unless q8_offset:
 * then they are stored plus 128 (unsigned), with offset 128 * scale, as the other formats. */
static inline void kvl__unpack_chunk(uint32_t type, const uint8_t *row, int64_t k0, int L, uint8_t *a, float *ws,
                                     float *go, bool q8_offset) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  switch (type) {
  case KVL_TYPE_Q4_K: {
    const uint8_t *b = row + (k0 / 256) * 144;
    for (int j = 0; j < 4; j++) { /* byte i of 32j..: element 64j+i (low nibble), 64j+32+i (high) */
      __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
      _mm256_storeu_si256((__m256i *)(a + 64 * j), _mm256_and_si256(raw, lo4));
      _mm256_storeu_si256((__m256i *)(a + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4));
    }
    kvl__q4_k_group_scales(b, ws, go);
    break;
  }
  case KVL_TYPE_Q6_K: {
    const uint8_t *b = row + (k0 / 256) * 210;
    const float d = kvl__h2f(b + 208);
    for (int n = 0; n < 2; n++) {
      __m256i u[4];
      kvl__q6_k_half32(b, n, u);
      for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(a + 128 * n + 32 * k), u[k]);
    }
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++) {
      __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)))),
                               _mm256_set1_ps(d));
      _mm256_storeu_ps(ws + 8 * h, f);
      _mm256_storeu_ps(go + 8 * h, _mm256_mul_ps(f, _mm256_set1_ps(32.0f)));
    }
    break;
  }
  case KVL_TYPE_Q8_0: {
    const uint8_t *b = row + (k0 / 32) * 34;
    for (int s = 0; s < L / 32; s++) {
      const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 34 * s + 2));
      _mm256_storeu_si256((__m256i *)(a + 32 * s), q8_offset ? _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)) : c);
      ws[s] = kvl__h2f(b + 34 * s), go[s] = q8_offset ? 128.0f * ws[s] : 0.0f;
    }
    break;
  }
  case KVL_TYPE_Q5_0: {
    const uint8_t *b = row + (k0 / 32) * 22;
    for (int s = 0; s < L / 32; s++) {
      const uint8_t *blk = b + 22 * s;
      _mm256_storeu_si256((__m256i *)(a + 32 * s), kvl__q5_0_codes(blk));
      ws[s] = kvl__h2f(blk), go[s] = 16.0f * ws[s];
    }
    break;
  }
  }
}

#endif
