/* qscales_avx2.h — the scale unpacking the AVX2 and AMX int8 kernels share (qdot_avx2.c,
 * qmatmul_avx2.c, qdot_amx.c). Include only from files compiled with -mavx2 -mf16c. */
#ifndef KVL_QSCALES_AVX2_H
#define KVL_QSCALES_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Q4_K's eight 6-bit scales and minimums of a super-block, from its 12 packed bytes, as
 * floats in sub-block order, 32 bits at a time (kvl_q4_k_scale_min: sub-blocks 0-3 keep
 * their low 6 bits in bytes 0-3 / 4-7; 4-7 take 4 bits from bytes 8-11 and their top 2
 * from the high bits of bytes 0-3 / 4-7). */
static inline void kvl__q4_k_scales8(const uint8_t *sc12, __m256 *s, __m256 *m) {
  uint32_t u[3];
  memcpy(u, sc12, 12);
  const uint32_t s_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
  const uint32_t s_hi = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
  *s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)s_hi, (int)s_lo)));
  *m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo)));
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

#endif
