/* attn_avx2.c — the tiled attention of attn_avx512.c on AVX2: a tile of up to TQ
 * consecutive tokens of one sequence times the query heads of one KV head reads (and
 * widens from bf16) each KV block once; per row, online softmax over the block's 16 keys.
 *
 * With 16 ymm registers the 16 keys of a block are scored 8 at a time (8 partial-sum
 * vectors over the head width, reduced by one vhaddps tree), and the values are added
 * 64 lanes of the head at a time (8 accumulators). A row's arithmetic is the same
 * whatever else is in its tile (masked keys add exact zeros), so a token's output does
 * not depend on how its prompt was chunked. Compiled with -mavx2 -mfma; called only when
 * the processor has them. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"
#include "vmath_avx2.h"

enum { TQ = 16 }; /* tokens per tile */

/* lane i = the sum of the 8 lanes of v[i] */
static inline __m256 hsum8x8(const __m256 v[8]) {
  __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* the scores of one query row against 8 keys (rows of kb, d floats each) */
static inline __m256 scores8(const float *q, const float *kb, int d) {
  __m256 s[8];
  for (int j = 0; j < 8; j++) s[j] = _mm256_setzero_ps();
  for (int c = 0; c < d; c += 8) {
    __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) s[j] = _mm256_fmadd_ps(_mm256_load_ps(kb + j * d + c), qc, s[j]);
  }
  return hsum8x8(s);
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* acc (d floats) = acc * corr + sum over the first nv keys of p[j] * vb[j], 64 lanes at
 * a time (8 accumulators), then 8 */
static void pv(float *acc, float corr, const float *p, const float *vb, int nv, int d) {
  const __m256 cr = _mm256_set1_ps(corr);
  int c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + c0 + 8 * c), cr);
    for (int j = 0; j < nv; j++) {
      const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_load_ps(vb + j * d + c0 + 8 * c), a[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
  }
  for (; c0 < d; c0 += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + c0), cr);
    for (int j = 0; j < nv; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_load_ps(vb + j * d + c0), a);
    _mm256_storeu_ps(acc + c0, a);
  }
}

/* nj rows of one KV head of a block, widened to fp32 (bf16 is the top half of an fp32) */
static void widen(const struct kvl_kv_layout *l, const void *src, int kh, int nj, float *dst) {
  const int d = l->head_dim, kvw = l->n_kv_head * d;
  for (int j = 0; j < nj; j++) {
    size_t off = (size_t)j * kvw + (size_t)kh * d;
    if (l->dtype == KVL_KV_F32) {
      memcpy(dst + j * d, (const float *)src + off, (size_t)d * 4);
    } else {
      const uint16_t *s = (const uint16_t *)src + off;
      for (int c = 0; c < d; c += 8) {
        __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + c))), 16);
        _mm256_store_ps(dst + j * d + c, _mm256_castsi256_ps(v));
      }
    }
  }
}

bool kvl__attention_avx2_fits(const struct kvl_attn_args *a) {
  const int d = a->kv->head_dim;
  return d % 8 == 0 && d <= 512 && a->n_head % a->kv->n_kv_head == 0;
}

void kvl__attention_avx2(const struct kvl_attn_args *a) {
  const struct kvl_kv_layout *l = a->kv;
  const int d = l->head_dim, group = a->n_head / l->n_kv_head;
  int *tile = malloc((size_t)(a->n_tokens + 1) * sizeof(int));
  KVL_ASSERT(tile);
  const int n_tiles = kvl__attn_tiles(a, TQ, tile);
  const int n_items = n_tiles * l->n_kv_head;
#pragma omp parallel
  {
    float *kb = aligned_alloc(32, (size_t)KVL_KV_BLOCK * d * sizeof(float));
    float *vb = aligned_alloc(32, (size_t)KVL_KV_BLOCK * d * sizeof(float));
    float *acc = malloc((size_t)TQ * group * d * sizeof(float));
    float *m = malloc((size_t)TQ * group * sizeof(float)), *lsum = malloc((size_t)TQ * group * sizeof(float));
    KVL_ASSERT(kb && vb && acc && m && lsum);
    /* later tiles see more keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
    for (int it = n_items - 1; it >= 0; it--) {
      const int ti = it / l->n_kv_head, kh = it % l->n_kv_head;
      const int t0 = tile[ti], tn = tile[ti + 1] - t0, R = tn * group;
      const int32_t *bt = a->block_tables[a->seq[t0]];
      const int last = a->pos[t0 + tn - 1];
      for (int i = 0; i < R; i++) m[i] = -INFINITY, lsum[i] = 0;
      memset(acc, 0, (size_t)R * d * sizeof(float));
      for (int j0 = 0; j0 <= last; j0 += KVL_KV_BLOCK) {
        const int nj = last + 1 - j0 < KVL_KV_BLOCK ? last + 1 - j0 : KVL_KV_BLOCK;
        widen(l, kvl_kv_k_ptr(l, (void *)a->kv_base, bt[j0 / KVL_KV_BLOCK], a->layer), kh, nj, kb);
        widen(l, kvl_kv_v_ptr(l, (void *)a->kv_base, bt[j0 / KVL_KV_BLOCK], a->layer), kh, nj, vb);
        kvl__attn_prefetch(a, bt, j0 + KVL_KV_BLOCK, 1, kh, last);
        memset(kb + (size_t)nj * d, 0, (size_t)(KVL_KV_BLOCK - nj) * d * sizeof(float));
        for (int i = 0; i < R; i++) {
          const int t = t0 + i / group, h = kh * group + i % group;
          const int nv = a->pos[t] + 1 - j0 < nj ? a->pos[t] + 1 - j0 : nj; /* keys this row sees */
          if (nv <= 0) continue;
          const float *q = a->q + ((size_t)t * a->n_head + h) * d;
          const __m256 sc = _mm256_set1_ps(a->scale), ninf = _mm256_set1_ps(-INFINITY);
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          /* keys 0-7 and 8-15 of the block; those past nv masked */
          __m256 vis0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lane));
          __m256 vis1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), lane));
          __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(scores8(q, kb, d), sc), vis0);
          __m256 s1 = nv > 8 ? _mm256_blendv_ps(ninf, _mm256_mul_ps(scores8(q, kb + 8 * d, d), sc), vis1) : ninf;
          const float bm = hmax8(_mm256_max_ps(s0, s1)), nm = bm > m[i] ? bm : m[i];
          /* exp(-inf) = 0 on the first block; a maximum that did not move needs no expf (exp(0)
           * is 1 exactly, so the bits are the same): at depth the running maximum settles early,
           * and expf per row and block was 5.5 % of the 0.5B's 8k prefill on a Zen 2 (perf) */
          const float corr = nm == m[i] ? 1.0f : expf(m[i] - nm);
          const __m256 vm = _mm256_set1_ps(nm);
          __m256 p0 = _mm256_and_ps(vis0, kvl__exp256(_mm256_sub_ps(s0, vm)));
          __m256 p1 = _mm256_and_ps(vis1, kvl__exp256(_mm256_sub_ps(s1, vm)));
          lsum[i] = lsum[i] * corr + hsum8(_mm256_add_ps(p0, p1));
          float pj[16] __attribute__((aligned(32)));
          _mm256_store_ps(pj, p0);
          _mm256_store_ps(pj + 8, p1);
          pv(acc + (size_t)i * d, corr, pj, vb, nv, d);
          m[i] = nm;
        }
      }
      for (int i = 0; i < R; i++) {
        const int t = t0 + i / group, h = kh * group + i % group;
        float *o = a->out + ((size_t)t * a->n_head + h) * d;
        const __m256 inv = _mm256_set1_ps(1.0f / lsum[i]);
        for (int c = 0; c < d; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)i * d + c), inv));
      }
    }
    free(kb);
    free(vb);
    free(acc);
    free(m);
    free(lsum);
  }
  free(tile);
}
