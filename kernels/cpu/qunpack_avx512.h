/* qunpack_avx512.h — unpacking GGUF weight units into unsigned int8 codes in AVX-512
 * registers: shared by the VNNI decode kernels (qdot_avx512.c) and the AMX tile kernels
 * (qdot_amx.c). Include only from files compiled with -mavx512f -mavx512bw -mavx2 -mf16c.
 *
 * In every format the unsigned code u of an element (0..15, 0..31 or 0..63, or q + 128
 * for Q8_0) times a scale, less an offset, is the weight: the kernels multiply u with the
 * int8 activations and take the offset out with the activation sums. Block layouts:
 * kernels/ref/quant_ref.c. */
#ifndef KVL_QUNPACK_AVX512_H
#define KVL_QUNPACK_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qunpack_avx2.h" /* kvl__h2f; the AVX2 unpackers */

/* Q8_0 blocks b, b+1 (34 bytes each): codes q + 128, as u8. */
static inline __m512i kvl__q8_0_pair(const uint8_t *w) {
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  __m256i wa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), flip);
  __m256i wb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 36)), flip);
  return _mm512_inserti64x4(_mm512_castsi256_si512(wa), wb, 1);
}

/* Q5_0 blocks b, b+1 (22 bytes each): 5-bit codes 0..31. */
static inline __m512i kvl__q5_0_pair(const uint8_t *w) {
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
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
  return _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
}

/* Q4_K: the 64 codes 0..15 of unit j (elements 64j..64j+63) of a block's 128 code bytes. */
static inline __m512i kvl__q4_k_unit(const uint8_t *q, int j) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
  __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Q6_K: half n (elements 128n..128n+127) of a block as two units of 64 codes 0..63.
 * The 64 low-nibble bytes of the half are one 512-bit load: their low nibbles are
 * elements 0..63 of the half and their high nibbles 64..127, in order. The two high bits
 * of element i sit in qh byte i % 32 at bit 2 * (i / 32): shifted by 4, 2, 0 and -2 bits
 * (a per-lane 16-bit shift of qh broadcast to both halves) they land on bits 4-5, and
 * one select (vpternlog) puts them under the nibble. */
static inline void kvl__q6_k_half(const uint8_t *w, int n, __m512i u[2]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f), six = _mm512_set1_epi8(0x3f);
  const __m512i sl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i sr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  __m512i ql = _mm512_loadu_si512(w + 64 * n);
  __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * n)));
  /* 0xca = lo4 ? a : b: nibble from a, bits 4-7 from b; then keep 6 bits */
  u[0] = _mm512_and_si512(_mm512_ternarylogic_epi32(lo4, ql, _mm512_sllv_epi16(h, sl), 0xca), six);
  u[1] = _mm512_and_si512(_mm512_ternarylogic_epi32(lo4, _mm512_srli_epi16(ql, 4), _mm512_srlv_epi16(h, sr), 0xca), six);
}

#endif
