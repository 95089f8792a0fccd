/* qmatmul_lanes.h — the driver of the tokens-in-lanes int8 matmuls (qmatmul_avx2.c: 8
 * tokens per vector; qmatmul_avx512.c: 16), shared by both: the activations regrouped per
 * TG tokens, token tiles, row blocks unpacked once per tile, each block against each token
 * group through the file's own `run`, which writes its RB x TG results to v. Include only
 * from those files (compiled with at least -mavx2 -mf16c). */
#ifndef KVL_QMATMUL_LANES_H
#define KVL_QMATMUL_LANES_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../backend-impl.h"
#include "kvl_error.h"
#include "qunpack_avx2.h"
#if defined(__AVX512F__)
#include "vmath_avx512.h"
#endif

/* The processor's L2 per core in bytes (512 KiB where the system does not say). */
static inline int64_t kvl__l2_bytes(void) {
  const long v = sysconf(_SC_LEVEL2_CACHE_SIZE); /* glibc: from CPUID data it keeps */
  return v >= 65536 ? v : 524288;
}

enum { KVL__LANES_MAX = 128 }; /* RB x TG at most (AVX-512: 8 rows x 16 tokens) */

/* A block of RB unpacked rows (A: RB x K codes; ws, go: RB x ng group factors) against one
 * group of TG tokens (Bj: K/4 rows of TG x 4 activation bytes; XD, CB, XS: per 16-element
 * slot and token, the activation scale, scale x code sum, and the code sum itself), results
 * to v[r * TG + t]. */
typedef void kvl__lanes_fn(uint32_t type, const uint8_t *A, int64_t K, const float *ws, const float *go, int64_t ng,
                           const int8_t *Bj, const float *XD, const float *CB, const int32_t *XS, float *v,
                           const char *pf, int64_t pf_lines);

/* pf_lines cache lines from pf (NULL: none) on their way to L2, spread over a kernel's
 * steps (its scale groups): per lines at step g (per = kvl__lanes_pf_per(pf_lines, steps),
 * computed once before the loop: a division per step showed in its profile) —
 * kvl__lanes_fn: the next row block's packed weights, fetched while this one computes */
static inline int64_t kvl__lanes_pf_per(int64_t pf_lines, int64_t steps) { return (pf_lines + steps - 1) / steps; }
static inline __attribute__((always_inline)) void kvl__lanes_prefetch(const char *pf, int64_t pf_lines, int64_t g,
                                                                      int64_t per) {
  if (!pf) return;
  const int64_t end = (g + 1) * per < pf_lines ? (g + 1) * per : pf_lines;
  for (int64_t i = g * per; i < end; i++) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
}
/* The same for a block of nr <= RB rows read straight from the packed weights (w: the
 * block's first row, rows row_bytes apart), without the unpacked copy: for one token group
 * (decode batches), where the copy is not reused. NULL where a format has none. */
typedef void kvl__lanes_direct_fn(uint32_t type, const uint8_t *w, size_t row_bytes, int nr, int64_t K,
                                  const int8_t *Bj, const float *XD, const float *CB, const int32_t *XS, float *v,
                                  const char *pf, int64_t pf_lines);
/* The results of a full block (RB rows x TG tokens, v as `run` writes it: row r's TG
 * tokens at v + r * TG) plus the rows' bias (b; NULL: none) to y (the block's first token
 * and row; tokens N floats apart), transposed in registers. NULL: a scalar loop. Partial
 * blocks take the scalar loop. */
typedef void kvl__lanes_store_fn(const float *v, const float *b, float *y, int64_t N);

/* dst[i * TG + t] = src[t * ld + i] for i < n and t < TG: TG rows of 32-bit values (codes
 * four at a time, sums, or scales: the bits are moved, not read as integers) transposed,
 * TG x TG tiles through registers where the file's level has them */
static inline __attribute__((always_inline)) void kvl__lanes_t32(const int32_t *src, int64_t ld, int64_t n,
                                                                 const int TG, int32_t *dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (TG == 16)
    for (; i + 16 <= n; i += 16) {
      __m512 r[16];
      for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_ps(src + t * ld + i);
      kvl__transpose16(r);
      for (int c = 0; c < 16; c++) _mm512_storeu_ps(dst + (i + c) * 16, r[c]);
    }
#endif
  if (TG == 8)
    for (; i + 8 <= n; i += 8) {
      __m256i r[8], u[8];
      for (int t = 0; t < 8; t++) r[t] = _mm256_loadu_si256((const __m256i *)(src + t * ld + i));
      for (int t = 0; t < 8; t += 2) {
        u[t] = _mm256_unpacklo_epi32(r[t], r[t + 1]);
        u[t + 1] = _mm256_unpackhi_epi32(r[t], r[t + 1]);
      }
      for (int t = 0; t < 8; t += 4) {
        r[t] = _mm256_unpacklo_epi64(u[t], u[t + 2]);
        r[t + 1] = _mm256_unpackhi_epi64(u[t], u[t + 2]);
        r[t + 2] = _mm256_unpacklo_epi64(u[t + 1], u[t + 3]);
        r[t + 3] = _mm256_unpackhi_epi64(u[t + 1], u[t + 3]);
      }
      /* r[4a + c], 128-bit lane l: column 4l + c of rows 4a..4a+3 */
      for (int c = 0; c < 4; c++) {
        _mm256_storeu_si256((__m256i *)(dst + (i + c) * 8), _mm256_permute2x128_si256(r[c], r[4 + c], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (i + c + 4) * 8), _mm256_permute2x128_si256(r[c], r[4 + c], 0x31));
      }
    }
  for (; i < n; i++)
    for (int t = 0; t < TG; t++) dst[i * TG + t] = src[t * ld + i];
}

/* One group of tn <= TG tokens (xq, xd, xs: its first token's codes, block scales and
 * 16-element code sums) laid out for the kernels: b row i holds elements 4i..4i+3 of the
 * TG tokens; per 16-element slot and token the scale of its 32-block (xdv), the slot's code
 * sum (xsv) and the two multiplied (cbv); with fold (32-element groups) xsv and cbv hold
 * both halves, in the even slot. Tokens past tn are zero. A full group goes through the
 * transposes: scalar loops after a memset of every slot took ~3-4 % of the 0.5B's pp512
 * on a Zen 4 (perf: the memset 1.6 %), and most of the 1.5B's k and v products (256 rows:
 * 1.07-1.13x faster with the transposes, qmatmul-ab --shape 256x1536). */
static inline __attribute__((always_inline)) void kvl__lanes_regroup(const int8_t *xq, const float *xd,
                                                                     const int32_t *xs, int64_t K, int tn, const int TG,
                                                                     bool fold, int32_t *b, float *xdv, float *cbv,
                                                                     int32_t *xsv) {
  const int64_t ns = K / 16; /* 16-element slots */
  if (tn == TG) {
    kvl__lanes_t32((const int32_t *)xq, K / 4, K / 4, TG, b);
    kvl__lanes_t32(xs, ns, ns, TG, xsv);
    /* the block scales transposed into the first ns / 2 slots, then each copied to its two
     * slots from the top down (slot g reads slot g / 2 before that one is overwritten) */
    kvl__lanes_t32((const int32_t *)xd, K / 32, K / 32, TG, (int32_t *)xdv);
    for (int64_t g = ns - 1; g >= 0; g--)
      for (int t = 0; t < TG; t++) xdv[g * TG + t] = xdv[(g / 2) * TG + t];
    for (int64_t g = 0; g < ns; g++)
      for (int t = 0; t < TG; t++) cbv[g * TG + t] = xdv[g * TG + t] * (float)xsv[g * TG + t];
  } else {
    memset(b, 0, (size_t)K * TG);
    memset(xdv, 0, (size_t)ns * TG * sizeof(float));
    memset(cbv, 0, (size_t)ns * TG * sizeof(float));
    memset(xsv, 0, (size_t)ns * TG * sizeof(int32_t));
    for (int t = 0; t < tn; t++) {
      const int8_t *q = xq + (int64_t)t * K;
      for (int64_t i = 0; i < K / 4; i++) memcpy(b + i * TG + t, q + 4 * i, 4);
      for (int64_t g = 0; g < ns; g++) {
        const float d = xd[(int64_t)t * (K / 32) + g / 2];
        xdv[g * TG + t] = d;
        xsv[g * TG + t] = xs[(int64_t)t * ns + g];
        cbv[g * TG + t] = d * (float)xsv[g * TG + t];
      }
    }
  }
  if (fold)
    for (int64_t g = 0; g < ns; g += 2)
      for (int t = 0; t < TG; t++) cbv[g * TG + t] += cbv[(g + 1) * TG + t], xsv[g * TG + t] += xsv[(g + 1) * TG + t];
}

static inline __attribute__((always_inline)) int
kvl__qmatmul_lanes(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                   const float *xd, const int32_t *xs, int T, const float *bias, float *y, const int TG, const int RB,
                   const bool q8_offset, kvl__lanes_fn *run, kvl__lanes_fn *run2, kvl__lanes_direct_fn *direct,
                   kvl__lanes_store_fn *store) {
  enum { CH = 256 }; /* elements per unpacked chunk */
  KVL_ASSERT(RB * TG <= KVL__LANES_MAX);
  const bool kq = type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q6_K;
  if (!kq && type != KVL_TYPE_Q8_0 && type != KVL_TYPE_Q5_0) return KVL_ENOTSUP;
  if (T < 1 || K % 32 || (kq && K % 256)) return KVL_EINVAL;
  const int SB = type == KVL_TYPE_Q6_K ? 16 : 32;
  const int ntg = (T + TG - 1) / TG;                           /* groups of TG tokens */
  const int64_t n_blocks = (N + RB - 1) / RB, ng = K / SB;       /* RB-row blocks; scale groups per row */
  const size_t bsz = (size_t)K * TG, fsz = (size_t)(K / 16) * TG; /* per token group */
  /* token tiles (prefill): as many groups as keep their activations within 3/4 of the L2
   * (room left for the unpacked block and the weights streaming in), in tiles of equal
   * size; the tile-major order unpacks a row block once per tile (1 tile: decode batches).
   * Tiles too small unpack too often: with a quarter of L2 (256 KiB on a Zen 4) the 1.5B's
   * down projection (K = 8960: 140 KiB per group) had one group per tile, and twice the L2
   * made it 14-42 % faster at 64-512 tokens (bench/kernel-ab/qmatmul-ab --shape 1536x8960)
   * there, where the rest of a tile came from a fast L3. On an Intel Xeon (2 MiB L2, a
   * mesh L3) twice the L2 left the down projection reading its activations from L3 for
   * every row block: 3/4 of the L2 (8 groups per tile at 512 tokens) made Q6_K 1.55-1.74x
   * and the other formats 1.04-1.23x faster at 512 tokens, 8960x1536 at 512-2048 tokens
   * 0.93-1.24x (noise; the tiles there hardly change). A Zen 4 has not been re-measured
   * with it. The whole batch in one tile lost 40-60 % at 2048 tokens (an 18 MiB tile). */
  const int64_t budget = kvl__l2_bytes() * 3 / 4;
  const int64_t most = budget / (int64_t)bsz > 1 ? budget / (int64_t)bsz : 1, n_tiles = (ntg + most - 1) / most;
  const int64_t tpt = (ntg + n_tiles - 1) / n_tiles; /* tiles of equal size */
  int8_t *B = aligned_alloc(64, bsz * ntg);
  float *XD = aligned_alloc(64, fsz * ntg * sizeof(float)), *CB = aligned_alloc(64, fsz * ntg * sizeof(float));
  int32_t *XS = aligned_alloc(64, fsz * ntg * sizeof(int32_t));
  if (!B || !XD || !CB || !XS) {
    free(B), free(XD), free(CB), free(XS);
    return KVL_ENOMEM;
  }
  int rc = 0;
#pragma omp parallel
  {
    /* per token group: B row i holds elements 4i..4i+3 of its TG tokens; per 16-element
     * slot and token the scale of its 32-block (XD), the slot's code sum (XS) and the two
     * multiplied (CB); for 32-element groups XS and CB hold both halves, in the even slot */
#pragma omp for schedule(static)
    for (int j = 0; j < ntg; j++) {
      const int t0 = TG * j, tn = T - t0 < TG ? T - t0 : TG;
      kvl__lanes_regroup(xq + (int64_t)t0 * K, xd + (int64_t)t0 * (K / 32), xs + (int64_t)t0 * (K / 16), K, tn, TG,
                         SB == 32, (int32_t *)(B + bsz * j), XD + fsz * j, CB + fsz * j, XS + fsz * j);
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
    /* guided: each thread first takes a long run of consecutive row blocks (a stream the
     * hardware prefetcher follows), then smaller pieces that even out the end. With dynamic
     * pieces of 4 blocks the threads hopped between 20-30 KiB pieces: qmatmul-ab -T 16 on a
     * Zen 4, guided / dynamic 4: the 1.5B's output head (--shape 151936x1536 --copies 1)
     * 1.07-1.29, 4864x1536 streamed 1.04-1.13; 64-256 tokens -4 to +7 % */
#pragma omp for schedule(guided, 4)
    for (int64_t it = 0; it < n_tiles * n_blocks; it++) {
      if (rc) continue;
      const int64_t bi = it % n_blocks, tile = it / n_blocks, r0 = bi * RB;
      const int nr = (int)(N - r0 < RB ? N - r0 : RB);
      const bool straight = direct && ntg == 1;
      for (int r = 0; r < nr && have != bi && !straight; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)(r0 + r) * row_bytes;
        for (int64_t k0 = 0; k0 < K; k0 += CH) {
          const int L = (int)(K - k0 < CH ? K - k0 : CH);
          kvl__unpack_chunk(type, row, k0, L, A + (size_t)r * K + k0, ws + r * ng + k0 / SB, go + r * ng + k0 / SB, q8_offset);
        }
      }
      have = bi;
      /* the next row block's weights on their way to L2 while this one runs, a few lines per
       * scale group of the block's first kernel call: with few token groups the unpacking
       * waited for memory (a 32-token forward of the 0.5B, pp32@d512, from about 290 to 333
       * tokens/s on a Zen 4; kernels A/B with streamed weights: +3-20 % at 16-32 tokens,
       * neutral to +6 % at 64-256). All of a block's lines prefetched at once, before the
       * kernel, held the core while the fill buffers drained: 27 % of the driver's time at
       * the 1.5B's pp32@d512 on an Intel Xeon (perf) sat on that loop. */
      const char *pf = NULL;
      int64_t pf_lines = 0;
      if (it + 1 < n_tiles * n_blocks) {
        const int64_t nb0 = ((it + 1) % n_blocks) * RB, nn = N - nb0 < RB ? N - nb0 : RB;
        pf = (const char *)w + (size_t)nb0 * row_bytes;
        pf_lines = ((int64_t)(nn * row_bytes) + 63) / 64;
      }
      const int j_end = (int)((tile + 1) * tpt < ntg ? (tile + 1) * tpt : ntg);
      for (int j = (int)(tile * tpt); j < j_end;) {
        const int8_t *Bj = B + bsz * j;
        const float *xdv = XD + fsz * j, *cbv = CB + fsz * j;
        const int pair = run2 && !straight && j + 1 < j_end ? 2 : 1;
        float v[2 * KVL__LANES_MAX] __attribute__((aligned(64))); /* RB x TG results per group */
        if (straight) direct(type, (const uint8_t *)w + (size_t)r0 * row_bytes, row_bytes, nr, K, Bj, xdv, cbv, XS + fsz * j, v, pf, pf_lines);
        else (pair == 2 ? run2 : run)(type, A, K, ws, go, ng, Bj, xdv, cbv, XS + fsz * j, v, pf, pf_lines);
        pf = NULL; /* once per row block */
        for (int h = 0; h < pair; h++, j++) {
          const float *vh = v + h * RB * TG;
          const int t0 = TG * j, tn = T - t0 < TG ? T - t0 : TG;
          /* the scalar loop, a transposed store of 4-byte pieces to TG rows of y, took 5 % of
           * the 1.5B's pp512 on a Zen 4 (perf) */
          if (store && tn == TG && nr == RB) store(vh, bias ? bias + r0 : NULL, y + (int64_t)t0 * N + r0, N);
          else
            for (int t = 0; t < tn; t++)
              for (int r = 0; r < nr; r++) y[(int64_t)(t0 + t) * N + r0 + r] = vh[r * TG + t] + (bias ? bias[r0 + r] : 0.0f);
        }
      }
    }
    free(A);
    free(ws);
    free(go);
  }
  free(B);
  free(XD);
  free(CB);
  free(XS);
  return rc;
}

#endif
