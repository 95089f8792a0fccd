/* qmatmul_avx2.c — matmuls of several tokens (batched decode; prefill on the
 * "avx2int8mm" level's exact twin) on the four int8 GGUF formats with AVX2 only, the
 * AMX kernel's plan (qdot_amx.c) on 256-bit registers: tokens in lanes.
 *
 * The per-token kernels (qdot_avx2.c) reduce every 32-element unit to a scalar per token
 * (horizontal adds) and then scale it: at 16 tokens that float work, not the products,
 * bounds them. Here a vector holds 8 tokens. Per block of 4 weight rows and 8 tokens:
 *
 *   A  (4 rows x K bytes)     the rows' unsigned codes (signed for Q8_0), unpacked once
 *   B  (K/4 x 32 bytes)       the 8 tokens' int8 activations, 4 consecutive elements per
 *                             32-bit lane (prepared once per call)
 *   per 4 elements and row:   vpbroadcastd of the row's 4 codes, vpmaddubsw against B:
 *                             16-bit pair sums per token, added up in 16 bits over as many
 *                             steps as cannot overflow (Q4_K 8, Q5_0 4, Q6_K 2: codes
 *                             < 16, 32, 64 against |x| <= 127), then vpmaddwd to 32 bits
 *   per scale group and row:  acc[t] += S[t] * ws * xd[t] - go * xd[t] * sum(xq[t])
 *
 * with the group's weight scale ws and offset go (Q4_K: d*sc and dmin*m; Q6_K: d*sc and
 * 32*d*sc; Q5_0: d and 16*d; Q8_0: d and none: its signed codes enter as |w| against
 * sign(w)*x, one step per 16-bit sum) and the activation scale xd and code sum of the
 * token's 32-block (16-block for Q6_K). Where go is 2^s x ws (Q5_0, Q6_K) the offset
 * is taken in integers instead: the 32-bit sum starts at -2^s x sum(xq[t]). Same quantities as the other int8 kernels, summed
 * in another order: results agree to float rounding. A token's result depends on its own
 * activations only (lanes past n_tokens are zero), so a row is bit-identical however the
 * tokens were batched: the level's exact twin takes this kernel for every size.
 *
 * Compiled with -mavx2 -mfma -mf16c; called only when the processor has them. Block
 * layouts: kernels/ref/quant_ref.c. */
#include <immintrin.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "qmatmul_lanes.h"

enum { TG = 8, RB = 4 }; /* tokens per vector; rows per block */

/* The rows of a block against one group of 8 tokens: acc[r] lane t = row r . token t.
 * SB: elements per scale group; DEPTH: 4-element steps summed in 16 bits; Q8: signed codes. */
static inline __attribute__((always_inline)) void block(const uint8_t *A, int64_t K, const float *ws, const float *go,
                                                       int64_t ng, const int8_t *Bj, const float *XDj,
                                                       const float *CBj, const int32_t *XSj, const int SB,
                                                       const int DEPTH, const bool Q8, const int OFF_SHIFT,
                                                       const char *pf, int64_t pf_lines, __m256 acc[RB]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  const int64_t pf_per = kvl__lanes_pf_per(pf_lines, ng);
  for (int64_t g = 0; g < ng; g++) {
    kvl__lanes_prefetch(pf, pf_lines, g, pf_per);
    const int64_t gi = g * SB / 16; /* the group's slot of XD, CB and XS (16-element slots) */
    /* OFF_SHIFT: the format's offset is 2^OFF_SHIFT x its scale (Q5_0 16, Q6_K 32); the
     * integer sums start at minus that many times the tokens' code sums, which takes the
     * offset off exactly (the 32-bit stage has the room the 16-bit one lacks) */
    const __m256i s0 = OFF_SHIFT ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                                    _mm256_slli_epi32(_mm256_load_si256((const __m256i *)(XSj + gi * TG)), OFF_SHIFT))
                                 : _mm256_setzero_si256();
    __m256i s32[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) s32[r] = s0;
#pragma GCC unroll 8
    for (int h = 0; h < SB / 4; h += DEPTH) {
      __m256i s16[RB];
  #pragma GCC unroll 8
      for (int r = 0; r < RB; r++) s16[r] = _mm256_setzero_si256();
  #pragma GCC unroll 8
      for (int i = h; i < h + DEPTH; i++) {
        const __m256i xb = _mm256_load_si256((const __m256i *)(Bj + (g * SB / 4 + i) * 32));
    #pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
          int32_t wv;
          memcpy(&wv, A + r * K + g * SB + 4 * i, 4);
          const __m256i wb = _mm256_set1_epi32(wv);
          if (Q8)
            s16[r] = _mm256_maddubs_epi16(_mm256_abs_epi8(wb), _mm256_sign_epi8(xb, wb));
          else
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wb, xb));
        }
      }
  #pragma GCC unroll 8
      for (int r = 0; r < RB; r++) s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s16[r], ones));
    }
    const __m256 xd = _mm256_load_ps(XDj + gi * TG), cb = _mm256_load_ps(CBj + gi * TG);
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(_mm256_set1_ps(ws[r * ng + g]), xd), acc[r]);
      if (!Q8 && !OFF_SHIFT) acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(go[r * ng + g]), cb, acc[r]);
    }
  }
}

/* The four formats' blocks (each its constants) */
static void run(uint32_t type, const uint8_t *A, int64_t K, const float *ws, const float *go, int64_t ng,
                const int8_t *Bj, const float *XD, const float *CB, const int32_t *XS, float *v, const char *pf,
                int64_t pf_lines) {
  __m256 acc[RB];
  switch (type) { /* Q4_K's offset dmin x m is its own float: through CB */
  case KVL_TYPE_Q4_K: block(A, K, ws, go, ng, Bj, XD, CB, XS, 32, 8, false, 0, pf, pf_lines, acc); break;
  case KVL_TYPE_Q5_0: block(A, K, ws, go, ng, Bj, XD, CB, XS, 32, 4, false, 4, pf, pf_lines, acc); break;
  case KVL_TYPE_Q6_K: block(A, K, ws, go, ng, Bj, XD, CB, XS, 16, 2, false, 5, pf, pf_lines, acc); break;
  default: block(A, K, ws, go, ng, Bj, XD, CB, XS, 32, 1, true, 0, pf, pf_lines, acc); break;
  }
  for (int r = 0; r < RB; r++) _mm256_store_ps(v + r * TG, acc[r]);
}

/* kvl__lanes_store_fn for 4 rows x 8 tokens: the rows' vectors transposed in registers,
 * so that each token's 4 results go to y as one store. The same additions (result + bias,
 * + 0 without one) as the driver's scalar loop: bit-identical. */
static void store_4(const float *v, const float *b, float *y, int64_t N) {
  const __m256 r0 = _mm256_load_ps(v), r1 = _mm256_load_ps(v + TG), r2 = _mm256_load_ps(v + 2 * TG),
               r3 = _mm256_load_ps(v + 3 * TG);
  const __m256 a = _mm256_unpacklo_ps(r0, r1), c = _mm256_unpackhi_ps(r0, r1);
  const __m256 e = _mm256_unpacklo_ps(r2, r3), g = _mm256_unpackhi_ps(r2, r3);
  /* q[i]: 128-bit lane l holds the 4 rows of token 4l + i */
  const __m256 q[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(e))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(e))),
                       _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(c), _mm256_castps_pd(g))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(c), _mm256_castps_pd(g)))};
  const __m128 bv = b ? _mm_loadu_ps(b) : _mm_setzero_ps();
  for (int i = 0; i < 4; i++) {
    _mm_storeu_ps(y + (int64_t)i * N, _mm_add_ps(_mm256_castps256_ps128(q[i]), bv));
    _mm_storeu_ps(y + (int64_t)(4 + i) * N, _mm_add_ps(_mm256_extractf128_ps(q[i], 1), bv));
  }
}

int kvl__qmatmul_avx2(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, const int32_t *xs, int T, const float *bias, float *y) {
  return kvl__qmatmul_lanes(type, w, row_bytes, N, K, xq, xd, xs, T, bias, y, TG, RB, false, run, NULL, NULL, store_4);
}
