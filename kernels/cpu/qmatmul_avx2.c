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
 * token's 32-block (16-block for Q6_K). Same quantities as the other int8 kernels, summed
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

#include "../backend-impl.h"
#include "kvl_error.h"
#include "qunpack_avx2.h"

enum { TG = 8, RB = 4, CH = 256 }; /* tokens per vector; rows per block; elements per unpacked chunk */

static inline float h2f(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* One chunk (elements k0..k0+L) of one weight row: codes into a (L bytes), the group
 * scales and offsets into ws, go (L/SB each). */
static inline void unpack(uint32_t type, const uint8_t *row, int64_t k0, int L, uint8_t *a, float *ws, float *go) {
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
    const float d = h2f(b + 208);
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
      memcpy(a + 32 * s, b + 34 * s + 2, 32);
      ws[s] = h2f(b + 34 * s), go[s] = 0.0f;
    }
    break;
  }
  case KVL_TYPE_Q5_0: {
    const uint8_t *b = row + (k0 / 32) * 22;
    for (int s = 0; s < L / 32; s++) {
      const uint8_t *blk = b + 22 * s;
      _mm256_storeu_si256((__m256i *)(a + 32 * s), kvl__q5_0_codes(blk));
      ws[s] = h2f(blk), go[s] = 16.0f * ws[s];
    }
    break;
  }
  }
}

/* The rows of a block against one group of 8 tokens: acc[r] lane t = row r . token t.
 * SB: elements per scale group; DEPTH: 4-element steps summed in 16 bits; Q8: signed codes. */
static inline __attribute__((always_inline)) void block(const uint8_t *A, int64_t K, const float *ws, const float *go,
                                                       int64_t ng, const int8_t *Bj, const float *XDj,
                                                       const float *CBj, const int SB, const int DEPTH, const bool Q8,
                                                       __m256 acc[RB]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; g++) {
    __m256i s32[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) s32[r] = _mm256_setzero_si256();
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
    const int64_t gi = g * SB / 16; /* the group's slot of XD and CB (16-element slots) */
    const __m256 xd = _mm256_load_ps(XDj + gi * TG), cb = _mm256_load_ps(CBj + gi * TG);
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(_mm256_set1_ps(ws[r * ng + g]), xd), acc[r]);
      if (!Q8) acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(go[r * ng + g]), cb, acc[r]);
    }
  }
}

int kvl__qmatmul_avx2(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, const int32_t *xs, int T, const float *bias, float *y) {
  const bool kq = type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q6_K;
  if (!kq && type != KVL_TYPE_Q8_0 && type != KVL_TYPE_Q5_0) return KVL_ENOTSUP;
  if (T < 1 || K % 32 || (kq && K % 256)) return KVL_EINVAL;
  const int SB = type == KVL_TYPE_Q6_K ? 16 : 32;
  const int ntg = (T + TG - 1) / TG;                           /* groups of 8 tokens */
  const int64_t n_blocks = (N + RB - 1) / RB, ng = K / SB;       /* 4-row blocks; scale groups per row */
  const size_t bsz = (size_t)K * TG, fsz = (size_t)(K / 16) * TG; /* per token group */
  /* token tiles (prefill): as many groups as keep their activations within ~128 KiB (L2),
   * so that every row block meets a tile from cache; the tile-major order unpacks a row
   * block once per tile (1 tile: decode batches) */
  const int64_t tpt = (int64_t)(131072 / bsz) > 1 ? (int64_t)(131072 / bsz) : 1, n_tiles = (ntg + tpt - 1) / tpt;
  int8_t *B = aligned_alloc(32, bsz * ntg);
  float *XD = aligned_alloc(32, fsz * ntg * sizeof(float)), *CB = aligned_alloc(32, fsz * ntg * sizeof(float));
  if (!B || !XD || !CB) {
    free(B), free(XD), free(CB);
    return KVL_ENOMEM;
  }
  int rc = 0;
#pragma omp parallel
  {
    /* per token group: B row i holds elements 4i..4i+3 of its 8 tokens; per 16-element
     * slot and token the scale of its 32-block (XD) and that scale times the slot's code sum
     * (CB; for 32-element groups both halves, in the even slot) */
#pragma omp for schedule(static)
    for (int j = 0; j < ntg; j++) {
      const int t0 = TG * j, tn = T - t0 < TG ? T - t0 : TG;
      int32_t *b = (int32_t *)(B + bsz * j);
      float *xdv = XD + fsz * j, *cbv = CB + fsz * j;
      memset(b, 0, bsz);
      memset(xdv, 0, fsz * sizeof(float));
      memset(cbv, 0, fsz * sizeof(float));
      for (int t = 0; t < tn; t++) {
        const int8_t *q = xq + (int64_t)(t0 + t) * K;
        for (int64_t i = 0; i < K / 4; i++) memcpy(b + i * TG + t, q + 4 * i, 4);
        for (int64_t g = 0; g < K / 16; g++) {
          const float d = xd[(int64_t)(t0 + t) * (K / 32) + g / 2];
          xdv[g * TG + t] = d;
          cbv[g * TG + t] = d * (float)xs[(int64_t)(t0 + t) * (K / 16) + g];
        }
      }
      if (SB == 32)
        for (int64_t g = 0; g < K / 16; g += 2)
          _mm256_store_ps(cbv + g * TG, _mm256_add_ps(_mm256_load_ps(cbv + g * TG), _mm256_load_ps(cbv + (g + 1) * TG)));
    }
    /* a block's rows unpacked whole (codes, group scales and offsets); rows past N zero */
    uint8_t *A = calloc((size_t)RB * (size_t)K, 1);
    float *ws = calloc((size_t)RB * (size_t)ng, sizeof(float)), *go = calloc((size_t)RB * (size_t)ng, sizeof(float));
    if (!A || !ws || !go) {
#pragma omp atomic write
      rc = KVL_ENOMEM;
    }
#pragma omp barrier
    int64_t have = -1; /* the row block A holds */
#pragma omp for schedule(dynamic, 4)
    for (int64_t it = 0; it < n_tiles * n_blocks; it++) {
      if (rc) continue;
      const int64_t bi = it % n_blocks, tile = it / n_blocks, r0 = bi * RB;
      const int nr = (int)(N - r0 < RB ? N - r0 : RB);
      for (int r = 0; r < nr && have != bi; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)(r0 + r) * row_bytes;
        for (int64_t k0 = 0; k0 < K; k0 += CH) {
          const int L = (int)(K - k0 < CH ? K - k0 : CH);
          unpack(type, row, k0, L, A + (size_t)r * K + k0, ws + r * ng + k0 / SB, go + r * ng + k0 / SB);
        }
      }
      have = bi;
      const int j_end = (int)((tile + 1) * tpt < ntg ? (tile + 1) * tpt : ntg);
      for (int j = (int)(tile * tpt); j < j_end; j++) {
        const int8_t *Bj = B + bsz * j;
        const float *xdv = XD + fsz * j, *cbv = CB + fsz * j;
        __m256 acc[RB];
        switch (type) {
        case KVL_TYPE_Q4_K: block(A, K, ws, go, ng, Bj, xdv, cbv, 32, 8, false, acc); break;
        case KVL_TYPE_Q5_0: block(A, K, ws, go, ng, Bj, xdv, cbv, 32, 4, false, acc); break;
        case KVL_TYPE_Q6_K: block(A, K, ws, go, ng, Bj, xdv, cbv, 16, 2, false, acc); break;
        default: block(A, K, ws, go, ng, Bj, xdv, cbv, 32, 1, true, acc); break;
        }
        float v[RB][TG] __attribute__((aligned(32)));
        for (int r = 0; r < RB; r++) _mm256_store_ps(v[r], acc[r]);
        const int t0 = TG * j, tn = T - t0 < TG ? T - t0 : TG;
        for (int t = 0; t < tn; t++)
          for (int r = 0; r < nr; r++) y[(int64_t)(t0 + t) * N + r0 + r] = v[r][t] + (bias ? bias[r0 + r] : 0.0f);
      }
    }
    free(A);
    free(ws);
    free(go);
  }
  free(B);
  free(XD);
  free(CB);
  return rc;
}
