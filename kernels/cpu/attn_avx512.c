/* attn_avx512.c — attention over the paged KV cache with AVX-512, tiled like flash
 * attention: no score matrix is materialised, and each KV block is read (and widened
 * from bf16) once for a tile of query rows instead of once per query row.
 *
 * A tile is up to TQ consecutive tokens of one sequence (a prefill chunk; a decode token
 * is a tile of one) times the `group` query heads that share one KV head: R rows. The
 * keys go in steps of sb blocks of KVL_KV_BLOCK (16) keys (sb = 4 for heads of 64, else
 * 1), at positions that are multiples of the step; for every step and every row that
 * sees at least one of its keys (causal: key position <= the row's position):
 *
 *   scores   per block, whose keys are widened transposed (one vector per element:
 *            the 16 keys in lanes), d FMAs of the query's broadcast elements: the
 *            block's 16 scores, no horizontal sums;
 *   softmax  online, per row and step: the running max m, the running sum l, and the
 *            rescale of the output accumulator by exp(m_old - m_new), with a vector exp
 *            (kvl__exp512): once per step;
 *   values   acc += p_j * v_j over the visible keys, d/16 FMAs per key.
 *
 * Every row's arithmetic is the same whatever else is in its tile (masked keys add exact
 * zeros, and the steps are fixed by position), so a token's output does not depend on how
 * its prompt was chunked. With bf16 KV on a processor with AVX512_BF16 the scores and
 * values are bf16 dot products instead (below: nothing widened, half the instructions).
 * Compiled with -mavx512f -mavx512bw -mavx512vl (the bf16 functions carry their own
 * target); called only when the processor has them. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"
#include "vmath_avx512.h"

enum { TQ = 16, SB = 4 }; /* tokens per tile; KV blocks per softmax step, at most */

/* the sum of a row's 8 score chains, in one fixed order */
static inline __m512 sum8(const __m512 *s) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])),
                       _mm512_add_ps(_mm512_add_ps(s[4], s[5]), _mm512_add_ps(s[6], s[7])));
}

/* the 16 scores of NR (1 or 2) query rows against a block whose keys are stored transposed
 * (kt[c * 16 + j] = element c of key j; keys past the block zero): lane j = q . key j, one
 * FMA per element with the query's element broadcast, in 8 chains per row (c mod 8) summed
 * at the end. No horizontal sums: scoring a key row by row cost 16 FMA chains plus a
 * 46-operation transpose-and-add tree per block and row. Two rows share each key vector's
 * load; a row's chains and sums are the same either way, so its bits do not depend on
 * whether it was paired. */
static inline __attribute__((always_inline)) void scores_f32(const float *q0, const float *q1, const float *kt, int d,
                                                            const int NR, __m512 *r0, __m512 *r1) {
  __m512 s[8], u[8];
  for (int k = 0; k < 8; k++) s[k] = _mm512_setzero_ps(), u[k] = _mm512_setzero_ps();
  for (int c = 0; c < d; c += 8) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
      __m512 kv = _mm512_load_ps(kt + (c + k) * 16);
      if (NR == 2) __asm__("" : "+v"(kv)); /* one load for both rows: GCC otherwise folds it into each FMA */
      s[k] = _mm512_fmadd_ps(_mm512_set1_ps(q0[c + k]), kv, s[k]);
      if (NR == 2) u[k] = _mm512_fmadd_ps(_mm512_set1_ps(q1[c + k]), kv, u[k]);
    }
  }
  *r0 = sum8(s);
  if (NR == 2) *r1 = sum8(u);
}

/* acc (d floats) = acc * corr + sum over the first nv keys of p[j] * vb[j], for NR rows
 * over the same keys (acc1, corr1, p1: the second's; each value vector loaded once for
 * both, per row the same chains in the same order); ND = d / 16 accumulators per row in
 * registers (NR 2: ND <= 8) */
static inline __attribute__((always_inline)) void pv_f32(float *acc0, float *acc1, float corr0, float corr1,
                                                        const float *p0, const float *p1, const float *vb, int nv,
                                                        const int ND, const int NR) {
  /* unrolled, so that a[] lives in registers: without it GCC kept it on the stack, and
   * every key paid a store-to-load round trip per 16 lanes (perf annotate: half of the
   * attention's time; pp2048 on the 0.5B, bench/README.md) */
  __m512 a[16], b[8];
  const __m512 c0 = _mm512_set1_ps(corr0), c1 = _mm512_set1_ps(corr1);
#pragma GCC unroll 16
  for (int c = 0; c < ND; c++) {
    a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc0 + 16 * c), c0);
    if (NR == 2) b[c] = _mm512_mul_ps(_mm512_loadu_ps(acc1 + 16 * c), c1);
  }
  for (int j = 0; j < nv; j++) {
    const __m512 pa = _mm512_set1_ps(p0[j]), pb = NR == 2 ? _mm512_set1_ps(p1[j]) : pa;
#pragma GCC unroll 16
    for (int c = 0; c < ND; c++) {
      __m512 v = _mm512_load_ps(vb + j * 16 * ND + 16 * c);
      if (NR == 2) __asm__("" : "+v"(v));
      a[c] = _mm512_fmadd_ps(pa, v, a[c]);
      if (NR == 2) b[c] = _mm512_fmadd_ps(pb, v, b[c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < ND; c++) {
    _mm512_storeu_ps(acc0 + 16 * c, a[c]);
    if (NR == 2) _mm512_storeu_ps(acc1 + 16 * c, b[c]);
  }
}

static void pv(float *acc, float corr, const float *p, const float *vb, int nv, int d) {
  switch (d) {
  case 64: pv_f32(acc, NULL, corr, 0, p, NULL, vb, nv, 4, 1); return;
  case 128: pv_f32(acc, NULL, corr, 0, p, NULL, vb, nv, 8, 1); return;
  case 256: pv_f32(acc, NULL, corr, 0, p, NULL, vb, nv, 16, 1); return;
  }
  /* other widths: one 16-lane slice at a time (same arithmetic per lane) */
  const __m512 cr = _mm512_set1_ps(corr);
  for (int c = 0; c < d; c += 16) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), cr);
    for (int j = 0; j < nv; j++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_load_ps(vb + j * d + c), a);
    _mm512_storeu_ps(acc + c, a);
  }
}

/* nj rows of one KV head of a block, widened to fp32 (bf16 is the top half of an fp32);
 * rows nj..15 of kb zero */
static void widen(const struct kvl_kv_layout *l, const void *src, int kh, int nj, float *dst) {
  const int d = l->head_dim, kvw = l->n_kv_head * d;
  for (int j = 0; j < nj; j++) {
    size_t off = (size_t)j * kvw + (size_t)kh * d;
    if (l->dtype == KVL_KV_F32) {
      memcpy(dst + j * d, (const float *)src + off, (size_t)d * 4);
    } else {
      const uint16_t *s = (const uint16_t *)src + off;
      for (int c = 0; c < d; c += 16) {
        __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + c))), 16);
        _mm512_store_ps(dst + j * d + c, _mm512_castsi512_ps(v));
      }
    }
  }
}

/* the same, transposed for scores_f32: dst[c * 16 + j] = element c of key j, keys nj..15
 * zero; 16 x 16 tiles through registers */
static void widen_t(const struct kvl_kv_layout *l, const void *src, int kh, int nj, float *dst) {
  const int d = l->head_dim, kvw = l->n_kv_head * d;
  for (int c0 = 0; c0 < d; c0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; j++) {
      const size_t off = (size_t)j * kvw + (size_t)kh * d + (size_t)c0;
      if (j >= nj) r[j] = _mm512_setzero_ps();
      else if (l->dtype == KVL_KV_F32) r[j] = _mm512_loadu_ps((const float *)src + off);
      else
        r[j] = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + off))), 16));
    }
    kvl__transpose16(r);
    for (int c = 0; c < 16; c++) _mm512_store_ps(dst + (size_t)(c0 + c) * 16, r[c]);
  }
}

/* the keys of this step (nk from j0) that the token at index t sees */
static inline int visible(const struct kvl_attn_args *a, int t, int j0, int nk) {
  return a->pos[t] + 1 - j0 < nk ? a->pos[t] + 1 - j0 : nk;
}

/* One row's online softmax over a step: its nb blocks of raw scores (sc: q . k; the
 * first nv keys visible) scaled, the running maximum *m and sum *l brought up to date,
 * the weights exp(s - m) to p; returns the accumulator's correction exp(m_old - m_new). */
static inline __attribute__((always_inline)) float softmax_step(__m512 *sc, int nb, int nv, float scale, float *m,
                                                                float *l, float *p) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 vis[SB];
  for (int b = 0; b < nb; b++) {
    const int left = nv - b * KVL_KV_BLOCK;
    vis[b] = left >= 16 ? (__mmask16)0xffffu : (__mmask16)(0xffffu >> (16 - left));
    sc[b] = _mm512_mul_ps(sc[b], _mm512_set1_ps(scale));
    sc[b] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[b], sc[b]);
    mx = _mm512_max_ps(mx, sc[b]);
  }
  const float bm = _mm512_reduce_max_ps(mx), nm = bm > *m ? bm : *m;
  /* exp(-inf) = 0 on the first block; a maximum that did not move needs no expf (exp(0)
   * is 1 exactly, so the bits are the same): at depth the running maximum settles early,
   * and expf per row and block was 5.5 % of the 0.5B's 8k prefill in the AVX2 kernel (perf, Zen 2) */
  const float corr = nm == *m ? 1.0f : expf(*m - nm);
  __m512 ps = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const __m512 e = _mm512_maskz_mov_ps(vis[b], kvl__exp512(_mm512_sub_ps(sc[b], _mm512_set1_ps(nm))));
    ps = _mm512_add_ps(ps, e);
    _mm512_store_ps(p + b * KVL_KV_BLOCK, e);
  }
  *l = *l * corr + _mm512_reduce_add_ps(ps);
  *m = nm;
  return corr;
}

/* ---- bf16 dot products (AVX512_BF16) -------------------------------------------------
 *
 * With bf16 KV on a processor that has AVX512_BF16 (AMD Zen 4 and later, Intel Sapphire
 * Rapids and later) the scores and the weighted values are vdpbf16ps: two bf16 products
 * added into each fp32 lane, the work of two FMAs in one instruction at the FMA's rate
 * (bench/kernel-ab/pipes.c), on the keys and values as the cache stores them (no
 * widening). The query and the softmax weights are rounded to bf16 (nearest even) for
 * the products; scores, the running maximum and sum, and the accumulators stay fp32 — the
 * split flash attention makes on GPUs. Heads of 64 and 128; KVL_ATTN=fp32 (cpu.c) keeps
 * the fp32 products above. As there, a row's arithmetic does not depend on its tile or on
 * whether it was paired. */
#define BF16 __attribute__((target("avx512bf16")))

/* a block's keys for scores_bf: dst vector c (of d/2) lane j = elements 2c, 2c+1 of key
 * j as a bf16 pair, keys nj..15 zero: 16 x 16 transposes of 32-bit pairs */
BF16 static void keys_pairs(const struct kvl_kv_layout *l, const void *src, int kh, int nj, uint32_t *dst) {
  const int d = l->head_dim, kvw = l->n_kv_head * d;
  for (int c0 = 0; c0 < d / 2; c0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; j++)
      r[j] = j < nj ? _mm512_loadu_ps((const uint16_t *)src + (size_t)j * kvw + (size_t)kh * d + 2 * c0)
                    : _mm512_setzero_ps();
    kvl__transpose16(r);
    for (int c = 0; c < 16; c++) _mm512_store_ps(dst + (size_t)(c0 + c) * 16, r[c]);
  }
}

/* a block's values for pv_bf: per pair of keys (2p, 2p+1) and 32 elements, two vectors
 * whose lanes hold an element of both keys as a bf16 pair (unpack low / high of the two
 * rows: lane 4L + i of the low one is element 8L + i, of the high one 8L + 4 + i); keys
 * nj..15 zero */
BF16 static void values_pairs(const struct kvl_kv_layout *l, const void *src, int kh, int nj, uint32_t *dst) {
  const int d = l->head_dim, kvw = l->n_kv_head * d;
  for (int p = 0; p < KVL_KV_BLOCK / 2; p++) {
    const uint16_t *s0 = (const uint16_t *)src + (size_t)(2 * p) * kvw + (size_t)kh * d, *s1 = s0 + kvw;
    for (int ch = 0; ch < d / 32; ch++) {
      const __m512i v0 = 2 * p < nj ? _mm512_loadu_si512(s0 + 32 * ch) : _mm512_setzero_si512();
      const __m512i v1 = 2 * p + 1 < nj ? _mm512_loadu_si512(s1 + 32 * ch) : _mm512_setzero_si512();
      _mm512_store_si512(dst + ((size_t)p * (d / 16) + 2 * ch) * 16, _mm512_unpacklo_epi16(v0, v1));
      _mm512_store_si512(dst + ((size_t)p * (d / 16) + 2 * ch + 1) * 16, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

/* a query row (d floats) as d / 2 bf16 pairs */
BF16 static void query_pairs(const float *q, int d, uint32_t *dst) {
  for (int c = 0; c < d; c += 32)
    _mm512_storeu_si512(dst + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(q + c)));
}

/* scores_f32 on bf16 pairs for NR (1 or 2) rows against one block (keys_pairs' layout): 8
 * chains per row (pair c mod 8), each key vector loaded once for both rows */
BF16 static inline __attribute__((always_inline)) void scores_bf(const uint32_t *q0, const uint32_t *q1,
                                                                const uint32_t *kt, int d, const int NR, __m512 *r0,
                                                                __m512 *r1) {
  __m512 s[8], u[8];
  for (int k = 0; k < 8; k++) s[k] = _mm512_setzero_ps(), u[k] = _mm512_setzero_ps();
  for (int c = 0; c < d / 2; c += 8) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
      __m512 kv = _mm512_load_ps(kt + (c + k) * 16);
      if (NR == 2) __asm__("" : "+v"(kv));
      s[k] = _mm512_dpbf16_ps(s[k], (__m512bh)_mm512_set1_epi32((int)q0[c + k]), (__m512bh)kv);
      if (NR == 2) u[k] = _mm512_dpbf16_ps(u[k], (__m512bh)_mm512_set1_epi32((int)q1[c + k]), (__m512bh)kv);
    }
  }
  *r0 = sum8(s);
  if (NR == 2) *r1 = sum8(u);
}

/* the softmax weights of nb blocks (f32, zero past the visible keys) as bf16 */
BF16 static inline void weights_bf(const float *p, int nb, uint16_t *pb) {
  for (int b = 0; b < nb; b++)
    _mm256_store_si256((__m256i *)(pb + 16 * b), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p + 16 * b)));
}

/* pv_f32 on bf16 pairs for NR rows: acc = acc * corr + the first nv keys' weights (pb, bf16)
 * times their values (values_pairs' layout: key pair p's ND = d / 16 vectors), a pair of
 * keys per vdpbf16ps; acc in values_pairs' lane order (out_bf puts it back) */
BF16 static inline __attribute__((always_inline)) void pv_bf(float *acc0, float *acc1, float corr0, float corr1,
                                                            const uint16_t *p0, const uint16_t *p1,
                                                            const uint32_t *vp, int nv, const int ND, const int NR) {
  __m512 a[8], b[8];
#pragma GCC unroll 8
  for (int c = 0; c < ND; c++) {
    a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc0 + 16 * c), _mm512_set1_ps(corr0));
    if (NR == 2) b[c] = _mm512_mul_ps(_mm512_loadu_ps(acc1 + 16 * c), _mm512_set1_ps(corr1));
  }
  for (int p = 0; p < (nv + 1) / 2; p++) {
    uint32_t w0, w1 = 0;
    memcpy(&w0, p0 + 2 * p, 4);
    if (NR == 2) memcpy(&w1, p1 + 2 * p, 4);
    const __m512bh pa = (__m512bh)_mm512_set1_epi32((int)w0), pb = (__m512bh)_mm512_set1_epi32((int)w1);
#pragma GCC unroll 8
    for (int c = 0; c < ND; c++) {
      __m512 v = _mm512_load_ps(vp + ((size_t)p * ND + c) * 16);
      if (NR == 2) __asm__("" : "+v"(v));
      a[c] = _mm512_dpbf16_ps(a[c], pa, (__m512bh)v);
      if (NR == 2) b[c] = _mm512_dpbf16_ps(b[c], pb, (__m512bh)v);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < ND; c++) {
    _mm512_storeu_ps(acc0 + 16 * c, a[c]);
    if (NR == 2) _mm512_storeu_ps(acc1 + 16 * c, b[c]);
  }
}

/* a row's output from its accumulator in values_pairs' order, times inv */
static inline void out_bf(const float *acc, int d, float inv, float *o) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 iv = _mm512_set1_ps(inv);
  for (int c = 0; c < d; c += 32) {
    const __m512 a = _mm512_loadu_ps(acc + c), b = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), iv));
    _mm512_storeu_ps(o + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), iv));
  }
}

bool kvl__attention_avx512_fits(const struct kvl_attn_args *a) {
  const int d = a->kv->head_dim;
  return d % 16 == 0 && d <= 256 && a->n_head % a->kv->n_kv_head == 0;
}

/* the bf16 path's query rows of a tile */
BF16 static void tile_queries_bf(const struct kvl_attn_args *a, int t0, int R, int group, int kh, uint32_t *q2) {
  const int d = a->kv->head_dim;
  for (int i = 0; i < R; i++) {
    const float *q = a->q + ((size_t)(t0 + i / group) * a->n_head + kh * group + i % group) * d;
    query_pairs(q, d, q2 + (size_t)i * (d / 2));
  }
}

/* A softmax step of a tile: its keys and values (kb, vb: widened, or bf16 pairs), the
 * tile's rows and their running state. Passed by value: through a pointer, every store
 * to acc (-fno-strict-aliasing) made the compiler reload the fields, and 16 decode
 * streams' attention ran ~15 % slower */
struct step {
  const struct kvl_attn_args *a;
  int t0, R, group, kh, j0, nk;
  const void *kb, *vb;
  const uint32_t *q2; /* bf16 path: the tile's queries */
  float *acc, *m, *lsum;
};

/* row i (NR 1) or rows i, i + 1 (NR 2, heads of 64 or 128), seeing the step's first nv keys:
 * scores, online softmax, weighted values, in fp32 */
static inline __attribute__((always_inline)) void rows_f32(const struct step st, int i, int nv, const int NR) {
  const struct kvl_attn_args *a = st.a;
  const int d = a->kv->head_dim, nb = (nv + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK, g = st.group;
  const float *kb = st.kb, *vb = st.vb;
  const float *q0 = a->q + ((size_t)(st.t0 + i / g) * a->n_head + st.kh * g + i % g) * d;
  const float *q1 = NR == 2 ? a->q + ((size_t)(st.t0 + (i + 1) / g) * a->n_head + st.kh * g + (i + 1) % g) * d : NULL;
  __m512 sc[SB], sc1[SB];
  float pj[SB * KVL_KV_BLOCK] __attribute__((aligned(64))), pj1[SB * KVL_KV_BLOCK] __attribute__((aligned(64)));
  for (int b = 0; b < nb; b++) scores_f32(q0, q1, kb + (size_t)b * KVL_KV_BLOCK * d, d, NR, &sc[b], &sc1[b]);
  const float corr = softmax_step(sc, nb, nv, a->scale, &st.m[i], &st.lsum[i], pj);
  float *a0 = st.acc + (size_t)i * d;
  if (NR == 1) {
    pv(a0, corr, pj, vb, nv, d);
    return;
  }
  const float corr1 = softmax_step(sc1, nb, nv, a->scale, &st.m[i + 1], &st.lsum[i + 1], pj1);
  if (d == 64) pv_f32(a0, a0 + d, corr, corr1, pj, pj1, vb, nv, 4, 2);
  else pv_f32(a0, a0 + d, corr, corr1, pj, pj1, vb, nv, 8, 2);
}

/* the same with bf16 products */
BF16 static inline __attribute__((always_inline)) void rows_bf_n(const struct step st, int i, int nv, const int NR) {
  const int d = st.a->kv->head_dim, h2 = d / 2, nb = (nv + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK;
  const uint32_t *kt = st.kb, *vp = st.vb, *qa = st.q2 + (size_t)i * h2, *qb = qa + h2;
  __m512 sc[SB], sc1[SB];
  float pj[SB * KVL_KV_BLOCK] __attribute__((aligned(64))), pj1[SB * KVL_KV_BLOCK] __attribute__((aligned(64)));
  uint16_t pb[SB * KVL_KV_BLOCK] __attribute__((aligned(64))), pb1[SB * KVL_KV_BLOCK] __attribute__((aligned(64)));
  for (int b = 0; b < nb; b++) scores_bf(qa, qb, kt + (size_t)b * KVL_KV_BLOCK * h2, d, NR, &sc[b], &sc1[b]);
  const float corr = softmax_step(sc, nb, nv, st.a->scale, &st.m[i], &st.lsum[i], pj);
  float corr1 = 0;
  weights_bf(pj, nb, pb);
  if (NR == 2) {
    corr1 = softmax_step(sc1, nb, nv, st.a->scale, &st.m[i + 1], &st.lsum[i + 1], pj1);
    weights_bf(pj1, nb, pb1);
  }
  float *a0 = st.acc + (size_t)i * d;
  if (d == 64) pv_bf(a0, a0 + d, corr, corr1, pb, pb1, vp, nv, 4, NR);
  else pv_bf(a0, a0 + d, corr, corr1, pb, pb1, vp, nv, 8, NR);
}

/* rows_bf_n for one or two rows: not always_inline, since a function of another target
 * may not inline it even where the call is dead (step_f32's step_rows); step_bf inlines
 * it (flatten) */
BF16 static void rows_bf(const struct step st, int i, int nv, int NR) {
  if (NR == 2) rows_bf_n(st, i, nv, 2);
  else rows_bf_n(st, i, nv, 1);
}

/* The tile's rows over one step: in pairs where both see the same keys (every step but a
 * tile's causal edge) on heads of 64 or 128, each key and value vector loaded once for
 * two rows; one path's row work (bf: a compile-time constant) */
static inline __attribute__((always_inline)) void step_rows(const struct step st, const bool bf) {
  const int d = st.a->kv->head_dim;
  for (int i = 0; i < st.R;) {
    const int nv = visible(st.a, st.t0 + i / st.group, st.j0, st.nk);
    if (nv <= 0) {
      i++;
      continue;
    }
    const bool pair = i + 1 < st.R && (d == 64 || d == 128) &&
                      visible(st.a, st.t0 + (i + 1) / st.group, st.j0, st.nk) == nv;
    if (bf) rows_bf(st, i, nv, pair ? 2 : 1);
    else pair ? rows_f32(st, i, nv, 2) : rows_f32(st, i, nv, 1);
    i += pair ? 2 : 1;
  }
}

BF16 __attribute__((flatten)) static void step_bf(const struct step st) { step_rows(st, true); }
static void step_f32(const struct step st) { step_rows(st, false); }

void kvl__attention_avx512(const struct kvl_attn_args *a, bool bf16) {
  const struct kvl_kv_layout *l = a->kv;
  const int d = l->head_dim, group = a->n_head / l->n_kv_head;
  int *tile = malloc((size_t)(a->n_tokens + 1) * sizeof(int));
  KVL_ASSERT(tile);
  const int n_tiles = kvl__attn_tiles(a, TQ, tile);
  const int n_items = n_tiles * l->n_kv_head;
  /* KV blocks per softmax step: 4 for heads of 64 (0.5B pp2048 +6 %), 1 for wider ones
   * (1.5B, heads of 128: pp512 -4 % with 4; back-to-back runs on a Zen 5). With the bf16
   * products 4 for both: on a Zen 4, in turn, the 1.5B's pp64@d4096 101 -> 107-108
   * tokens/s, pp2048 163-170 -> 172-175, pp512 171-184 either way (the host's noise;
   * bench-prefill-decode -m <1.5B> -p 64 -d 4096 -n 0 -r 3, and -p 512,2048 -n 0 -r 3),
   * test-backend-ops --perf's attention turn (32 tokens after 8192) 199 -> 158-184 ms */
  const bool bf = bf16 && l->dtype == KVL_KV_BF16 && (d == 64 || d == 128);
  const int sb = d <= 64 || bf ? SB : 1;
#pragma omp parallel
  {
    /* the step's keys and values: widened to fp32, or (bf) as bf16 pairs in half the room */
    float *kb = aligned_alloc(64, (size_t)SB * KVL_KV_BLOCK * d * sizeof(float));
    float *vb = aligned_alloc(64, (size_t)SB * KVL_KV_BLOCK * d * sizeof(float));
    float *acc = malloc((size_t)TQ * group * d * sizeof(float));
    float *m = malloc((size_t)TQ * group * sizeof(float)), *lsum = malloc((size_t)TQ * group * sizeof(float));
    uint32_t *q2 = bf ? aligned_alloc(64, (size_t)TQ * group * d * 2) : NULL; /* the tile's queries in bf16 */
    KVL_ASSERT(kb && vb && acc && m && lsum && (q2 || !bf));
    /* later tiles see more keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
    for (int it = n_items - 1; it >= 0; it--) {
      const int ti = it / l->n_kv_head, kh = it % l->n_kv_head;
      const int t0 = tile[ti], tn = tile[ti + 1] - t0, R = tn * group;
      const int32_t *bt = a->block_tables[a->seq[t0]];
      const int last = a->pos[t0 + tn - 1];
      for (int i = 0; i < R; i++) m[i] = -INFINITY, lsum[i] = 0;
      memset(acc, 0, (size_t)R * d * sizeof(float));
      if (bf) tile_queries_bf(a, t0, R, group, kh, q2);
      for (int j0 = 0; j0 <= last; j0 += sb * KVL_KV_BLOCK) {
        const int nk = last + 1 - j0 < sb * KVL_KV_BLOCK ? last + 1 - j0 : sb * KVL_KV_BLOCK; /* keys in this step */
        for (int b = 0; b * KVL_KV_BLOCK < nk; b++) {
          const int jb = j0 + b * KVL_KV_BLOCK, nj = nk - b * KVL_KV_BLOCK < KVL_KV_BLOCK ? nk - b * KVL_KV_BLOCK : KVL_KV_BLOCK;
          const void *ks = kvl_kv_k_ptr(l, (void *)a->kv_base, bt[jb / KVL_KV_BLOCK], a->layer);
          const void *vs = kvl_kv_v_ptr(l, (void *)a->kv_base, bt[jb / KVL_KV_BLOCK], a->layer);
          if (bf) {
            keys_pairs(l, ks, kh, nj, (uint32_t *)kb + (size_t)b * KVL_KV_BLOCK * d / 2);
            values_pairs(l, vs, kh, nj, (uint32_t *)vb + (size_t)b * KVL_KV_BLOCK * d / 2);
            continue;
          }
          float *kbb = kb + (size_t)b * KVL_KV_BLOCK * d, *vbb = vb + (size_t)b * KVL_KV_BLOCK * d;
          widen_t(l, ks, kh, nj, kbb);
          widen(l, vs, kh, nj, vbb);
        }
        kvl__attn_prefetch(a, bt, j0 + sb * KVL_KV_BLOCK, sb, kh, last);
        const struct step st = {a, t0, R, group, kh, j0, nk, kb, vb, q2, acc, m, lsum};
        if (bf) step_bf(st);
        else step_f32(st);
      }
      for (int i = 0; i < R; i++) {
        const int t = t0 + i / group, h = kh * group + i % group;
        float *o = a->out + ((size_t)t * a->n_head + h) * d;
        if (bf) {
          out_bf(acc + (size_t)i * d, d, 1.0f / lsum[i], o);
          continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / lsum[i]);
        for (int c = 0; c < d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)i * d + c), inv));
      }
    }
    free(kb);
    free(vb);
    free(acc);
    free(m);
    free(lsum);
    free(q2);
  }
  free(tile);
}
