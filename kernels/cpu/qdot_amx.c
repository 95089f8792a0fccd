/* qdot_amx.c — matmuls of 2 or more tokens (batched decode, prefill) on the GGUF block
 * formats with AMX int8 tiles (tdpbusd: a 16x16 block of u8 x s8 dot products of up to
 * 64 elements in one instruction).
 *
 * The VNNI kernels (qdot_avx512.c) pay per token and 64 weights a dot, a conversion and
 * three multiply-adds; at 16 tokens that arithmetic, not memory, bounds batched decode.
 * Here a tile product does 16 weight rows x 16 tokens at once. Per block of 16 rows:
 *
 *   A  (16 rows x SB bytes)  the unsigned codes of the rows over one scale group (SB = 32
 *                            elements, 16 for Q6_K): the block is unpacked once, whole
 *   B  (SB/4 rows x 64 B)    the int8 activations of 16 tokens over the same elements, in
 *                            the tile unit's 4-byte-interleaved layout (prepared per call)
 *   C  (16 x 16 int32)       their dot products, then in fp32 per row r:
 *         acc[r][t] += C[r][t] * ws[r] * xd[t] - go[r] * xd[t] * sum(xq[t])
 *
 * with the group's weight scale ws and offset go (Q4_K: d*sc and dmin*m; Q6_K: d*sc and
 * 32*d*sc; Q8_0: d and 128*d; Q5_0: d and 16*d) and the activation scale xd and code sum
 * of the token's 32-block. Same quantities as the VNNI kernels, summed in another order:
 * results agree to float rounding. A token's result depends on its own activations only
 * (tokens past n_tokens are zero columns), so a row is bit-identical however the tokens
 * were batched. Products are issued a round (two groups) ahead of their fold, and A/B
 * alternate between two tile pairs, so the tile unit rarely waits on the vector unit.
 *
 * Compiled with -mamx-tile -mamx-int8 and AVX-512; used only after kvl__amx_usable()
 * (cpuid, and the kernel's permission for the tile state: arch_prctl). */
#include <immintrin.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../backend-impl.h"
#include "kvl_error.h"
#include "qunpack_avx2.h"
#include "qunpack_avx512.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

bool kvl__amx_usable(void) {
  static int ok = -1;
  if (ok >= 0) return ok;
  unsigned a, b, c, d;
  bool has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
  const char *e = getenv("KVL_AMX");
  if (e && !strcmp(e, "0")) has = false;
  /* Linux hands out the 8 KiB tile state only to processes that ask for it */
  ok = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

/* tiles: 0-3 = C (two rounds of two groups), 4, 5 = A, 6, 7 = B (alternating, so a load
 * never waits for the product still reading the previous one); A is SB bytes wide, B has
 * SB/4 rows */
struct tilecfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void tiles_config(int SB) {
  struct tilecfg c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int i = 0; i < 4; i++) c.rows[i] = 16, c.colsb[i] = 64;
  for (int i = 4; i < 6; i++) c.rows[i] = 16, c.colsb[i] = (uint16_t)SB;
  for (int i = 6; i < 8; i++) c.rows[i] = (uint8_t)(SB / 4), c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

enum { CH = 256 }; /* elements per chunk of a row: one K-quant block, eight 32-blocks */

/* One chunk (elements k0..k0+L) of one weight row: codes into a (L bytes), the group
 * scales and offsets into ws, go (L/SB each). */
static inline void unpack(uint32_t type, const uint8_t *row, int64_t k0, int L, uint8_t *a, float *ws, float *go) {
  switch (type) {
  case KVL_TYPE_Q4_K: {
    const uint8_t *b = row + (k0 / 256) * 144;
    for (int j = 0; j < 4; j++) _mm512_storeu_si512(a + 64 * j, kvl__q4_k_unit(b + 16, j));
    kvl__q4_k_group_scales(b, ws, go);
    break;
  }
  case KVL_TYPE_Q6_K: {
    const uint8_t *b = row + (k0 / 256) * 210;
    float d = kvl__h2f(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int n = 0; n < 2; n++) {
      __m512i u[2];
      kvl__q6_k_half(b, n, u);
      _mm512_storeu_si512(a + 128 * n, u[0]);
      _mm512_storeu_si512(a + 128 * n + 64, u[1]);
    }
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))),
                             _mm512_set1_ps(d));
    _mm512_storeu_ps(ws, f);
    _mm512_storeu_ps(go, _mm512_mul_ps(f, _mm512_set1_ps(32.0f)));
    break;
  }
  case KVL_TYPE_Q8_0: {
    const uint8_t *b = row + (k0 / 32) * 34;
    for (int p = 0; p < L / 64; p++) _mm512_storeu_si512(a + 64 * p, kvl__q8_0_pair(b + 68 * p));
    for (int s = 0; s < L / 32; s++) ws[s] = kvl__h2f(b + 34 * s), go[s] = 128.0f * ws[s];
    break;
  }
  case KVL_TYPE_Q5_0: {
    const uint8_t *b = row + (k0 / 32) * 22;
    for (int p = 0; p < L / 64; p++) _mm512_storeu_si512(a + 64 * p, kvl__q5_0_pair(b + 44 * p));
    for (int s = 0; s < L / 32; s++) ws[s] = kvl__h2f(b + 22 * s), go[s] = 16.0f * ws[s];
    break;
  }
  }
}

/* acc[r] += C[r] * ws[r] * xd - go[r] * cb, for the 16 rows of a stored C tile */
static inline __attribute__((always_inline)) void fold(const int32_t *c, const float *ws, const float *go, int gstride,
                                                      __m512 xd, __m512 cb, __m512 *acc) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; r++) {
    __m512 s = _mm512_mul_ps(_mm512_set1_ps(ws[r * gstride]), xd);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), s, acc[r]);
    acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(go[r * gstride]), cb, acc[r]);
  }
}

int kvl__qmatmul_amx(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                     const float *xd, const int32_t *xs, int T, const float *bias, float *y) {
  const int SB = type == KVL_TYPE_Q6_K ? 16 : 32;
  bool kq = type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q6_K;
  if (T < 1 || K % 64 || (kq && K % 256) || !kvl__amx_usable()) return KVL_EINVAL;
  if (!kq && type != KVL_TYPE_Q8_0 && type != KVL_TYPE_Q5_0) return KVL_ENOTSUP;
  const int nt = (T + 15) / 16; /* tiles of 16 tokens */
  const int64_t n_blocks = (N + 15) / 16, ng = K / SB; /* 16-row blocks; scale groups per row */
  /* per token tile: the activations as B tiles (row k/4 holds elements 4(k/4)..+3 of its 16
   * tokens), and per 16-element group g and token the scale of its 32-block (XD) and that
   * scale times the group's code sum (CB; for 32-element groups both halves, even slot) */
  const size_t bsz = (size_t)K * 16, fsz = (size_t)(K / 16) * 16;
  int8_t *B = aligned_alloc(64, bsz * nt);
  float *XD = aligned_alloc(64, fsz * nt * sizeof(float)), *CB = aligned_alloc(64, fsz * nt * sizeof(float));
  if (!B || !XD || !CB) {
    free(B), free(XD), free(CB);
    return KVL_ENOMEM;
  }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int j = 0; j < nt; j++) {
      const int t0 = 16 * j, tn = T - t0 < 16 ? T - t0 : 16;
      int8_t *b = B + bsz * j;
      float *xdv = XD + fsz * j, *cbv = CB + fsz * j;
      /* B row i: the 4 codes 4i..4i+3 of each token, a gather of 16 dwords K bytes apart */
      const __m512i toks = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)K));
      const __mmask16 live = (__mmask16)((1u << tn) - 1);
      const int8_t *q = xq + (int64_t)t0 * K;
      for (int64_t i = 0; i < K / 4; i++)
        _mm512_store_si512(b + 64 * i, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, toks, q + 4 * i, 1));
      memset(xdv, 0, fsz * sizeof(float));
      memset(cbv, 0, fsz * sizeof(float));
      for (int t = 0; t < tn; t++)
        for (int64_t g = 0; g < K / 16; g++) {
          float d = xd[(int64_t)(t0 + t) * (K / 32) + g / 2];
          xdv[g * 16 + t] = d;
          cbv[g * 16 + t] = d * (float)xs[(int64_t)(t0 + t) * (K / 16) + g];
        }
      if (SB == 32)
        for (int64_t g = 0; g < K / 16; g += 2)
          _mm512_store_ps(cbv + g * 16, _mm512_add_ps(_mm512_load_ps(cbv + g * 16), _mm512_load_ps(cbv + (g + 1) * 16)));
    }
    tiles_config(SB);
    /* a block's 16 rows unpacked whole (codes, group scales and offsets: L2-sized) */
    uint8_t *A = aligned_alloc(64, (size_t)16 * K);
    float *ws = malloc((size_t)16 * ng * sizeof(float)), *go = malloc((size_t)16 * ng * sizeof(float));
    int32_t *C = aligned_alloc(64, 4 * 256 * sizeof(int32_t));
    KVL_ASSERT(A && ws && go && C);
    memset(A, 0, (size_t)16 * K); /* rows past N stay zero */
#pragma omp for schedule(dynamic, 1)
    for (int64_t bi = 0; bi < n_blocks; bi++) {
      const int64_t r0 = bi * 16;
      const int nr = (int)(N - r0 < 16 ? N - r0 : 16);
      for (int r = 0; r < nr; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)(r0 + r) * row_bytes;
        for (int64_t k0 = 0; k0 < K; k0 += CH) {
          const int L = (int)(K - k0 < CH ? K - k0 : CH);
          unpack(type, row, k0, L, A + (size_t)r * K + k0, ws + r * ng + k0 / SB, go + r * ng + k0 / SB);
        }
      }
      for (int j = 0; j < nt; j++) {
        const int8_t *Bj = B + bsz * j;
        const float *xdv = XD + fsz * j, *cbv = CB + fsz * j;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        /* rounds of two groups: round i's products (C 0,1 or 2,3) are issued before round
         * i-1's are stored and folded */
        for (int64_t s = 0; s <= ng; s += 2) {
          const bool odd = (s / 2) & 1;
          if (s < ng) {
            const int8_t *b0 = Bj + s * SB / 4 * 64, *b1 = b0 + SB / 4 * 64;
            _tile_loadd(4, A + s * SB, K);
            _tile_loadd(6, b0, 64);
            _tile_loadd(5, A + (s + 1) * SB, K);
            _tile_loadd(7, b1, 64);
            if (odd) {
              _tile_zero(2);
              _tile_zero(3);
              _tile_dpbusd(2, 4, 6);
              _tile_dpbusd(3, 5, 7);
            } else {
              _tile_zero(0);
              _tile_zero(1);
              _tile_dpbusd(0, 4, 6);
              _tile_dpbusd(1, 5, 7);
            }
          }
          if (s >= 2) { /* round s-2, in the other pair of C tiles */
            const int64_t p = s - 2, g0 = p * SB / 16, g1 = (p + 1) * SB / 16;
            if (odd) {
              _tile_stored(0, C, 64);
              _tile_stored(1, C + 256, 64);
            } else {
              _tile_stored(2, C, 64);
              _tile_stored(3, C + 256, 64);
            }
            fold(C, ws + p, go + p, (int)ng, _mm512_load_ps(xdv + 16 * g0), _mm512_load_ps(cbv + 16 * g0), acc);
            fold(C + 256, ws + p + 1, go + p + 1, (int)ng, _mm512_load_ps(xdv + 16 * g1),
                 _mm512_load_ps(cbv + 16 * g1), acc);
          }
        }
        /* out by token: 16 consecutive rows of y per store (a column of acc) */
        float v[256] __attribute__((aligned(64)));
        for (int r = 0; r < 16; r++) _mm512_store_ps(v + 16 * r, acc[r]);
        const __m512i col = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
        const __mmask16 rows = (__mmask16)((1u << nr) - 1);
        const __m512 bb = bias ? _mm512_maskz_loadu_ps(rows, bias + r0) : _mm512_setzero_ps();
        const int t0 = 16 * j, tn = T - t0 < 16 ? T - t0 : 16;
        for (int t = 0; t < tn; t++)
          _mm512_mask_storeu_ps(y + (int64_t)(t0 + t) * N + r0, rows,
                                _mm512_add_ps(_mm512_i32gather_ps(col, v + t, 4), bb));
      }
    }
    _tile_release();
    free(A);
    free(ws);
    free(go);
    free(C);
  }
  free(B);
  free(XD);
  free(CB);
  return 0;
}
