/* ops_fixtures.h — random inputs, quantised weights and the error measure shared by the
 * kernel harnesses (unit/test-backend-ops.c, gpu/test-cuda-ops.c). Static functions: include
 * from one test file each. */
#ifndef KVL_OPS_FIXTURES_H
#define KVL_OPS_FIXTURES_H

#include <stdlib.h>
#include <string.h>

#include <math.h>

#include "kvl_kernels.h"
#include "kvl_quant.h"
#include "kvl_test.h"

static unsigned long long seed = 1;

static void fill(float *x, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = kvl_test_randf(&seed) * scale;
}

/* Weight data of `type`: quantised random values; K-quants from random bytes with
 * sane scales (their quantisers are not needed for this). */
static inline void *make_weight(uint32_t type, int64_t rows, int64_t cols) {
  size_t rb = kvl_row_size(type, (uint64_t)cols);
  unsigned char *d = malloc(rb * (size_t)rows);
  float *tmp = malloc((size_t)cols * sizeof(float));
  for (int64_t r = 0; r < rows; r++) {
    unsigned char *row = d + (size_t)r * rb;
    if (type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q5_K || type == KVL_TYPE_Q6_K) {
      for (size_t i = 0; i < rb; i++) row[i] = (unsigned char)kvl_test_rand(&seed);
      size_t bs = kvl_type_traits(type)->type_size;
      for (size_t b = 0; b < rb / bs; b++) {
        unsigned char *blk = row + b * bs;
        uint16_t h = kvl_fp32_to_fp16(0.002f * (1 + (float)(kvl_test_rand(&seed) % 100) / 100));
        uint16_t h2 = kvl_fp32_to_fp16(0.001f);
        if (type == KVL_TYPE_Q6_K) { memcpy(blk + 208, &h, 2); }
        else { memcpy(blk, &h, 2); memcpy(blk + 2, &h2, 2); }
      }
    } else {
      fill(tmp, (size_t)cols, 1.0f);
      kvl_quant_row_ref(type, tmp, row, cols);
    }
  }
  free(tmp);
  return d;
}

static double nmse(const float *a, const float *ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double e = (double)a[i] - ref[i];
    num += e * e;
    den += (double)ref[i] * ref[i];
  }
  return den > 0 ? num / den : num;
}

/* The attention harness's case, one geometry: two sequences on scattered blocks of a
 * 3-layer pool (positions 0..79 and 0..95 filled in every layer) and a batch of a prefill
 * chunk crossing block boundaries (seq 0 at 13..45) with single decode tokens (seq 1 at 95,
 * seq 0 at 79); queries filled. a->out is the caller's. */
struct attn_fixture {
  struct kvl_kv_layout l;
  void *pool;
  int32_t bt0[5], bt1[6], pos[96], sq[96];
  const int32_t *bts[2];
  float *q;
  struct kvl_attn_args a;
};

static void attn_fixture_init(struct attn_fixture *f, int n_kv, int d, int n_head, enum kvl_kv_dtype dt) {
  static const int32_t bt0[] = {5, 2, 9, 0, 11}, bt1[] = {3, 14, 7, 1, 12, 6};
  f->l = (struct kvl_kv_layout){3, n_kv, d, dt};
  memcpy(f->bt0, bt0, sizeof(bt0));
  memcpy(f->bt1, bt1, sizeof(bt1));
  f->bts[0] = f->bt0, f->bts[1] = f->bt1;
  const int kvw = n_kv * d, qw = n_head * d;
  f->pool = calloc(16, kvl_kv_block_bytes(&f->l));
  float *k = malloc(96 * (size_t)kvw * 4), *v = malloc(96 * (size_t)kvw * 4);
  for (int s = 0; s < 2; s++) {
    int n = s ? 96 : 80;
    for (int i = 0; i < n; i++) f->pos[i] = i, f->sq[i] = s;
    for (int layer = 0; layer < 3; layer++) {
      fill(k, (size_t)n * kvw, 1.0f);
      fill(v, (size_t)n * kvw, 1.0f);
      kvl_kv_store(&f->l, f->pool, layer, n, k, v, f->pos, f->sq, f->bts);
    }
  }
  free(k), free(v);
  int T = 0;
  for (int p = 13; p <= 45; p++) f->pos[T] = p, f->sq[T++] = 0;
  f->pos[T] = 95, f->sq[T++] = 1;
  f->pos[T] = 79, f->sq[T++] = 0;
  f->q = malloc((size_t)T * qw * 4);
  fill(f->q, (size_t)T * qw, 1.0f);
  f->a = (struct kvl_attn_args){T,  f->q,  NULL,   f->pos, f->sq, f->bts, n_head, 1, &f->l,
                               f->pool, 1.0f / sqrtf((float)d), NULL, 0};
}

static void attn_fixture_free(struct attn_fixture *f) {
  free(f->pool);
  free(f->q);
}

/* The attention cases both harnesses run: four geometries (the real models' head widths
 * 64 and 128, two narrower ones) x fp32 and bf16 KV. Case i's fixture, and its name. */
#define ATTN_N_CASES 8
static void attn_fixture_case(struct attn_fixture *f, int i, char *desc, size_t desclen) {
  static const struct { int n_kv, d, n_head; } geo[] = {{2, 64, 14}, {2, 128, 12}, {1, 32, 4}, {4, 16, 4}};
  const int gi = i / 2;
  const bool bf16 = i % 2;
  attn_fixture_init(f, geo[gi].n_kv, geo[gi].d, geo[gi].n_head, bf16 ? KVL_KV_BF16 : KVL_KV_F32);
  snprintf(desc, desclen, "heads=%d/%d d=%d kv=%s T=%d", geo[gi].n_head, geo[gi].n_kv, geo[gi].d,
           bf16 ? "bf16" : "f32", f->a.n_tokens);
}

/* The case's batch cut to its two decode tokens (the last two): a copy of f sharing its
 * arrays, not to be freed. */
static inline struct attn_fixture attn_fixture_decode(const struct attn_fixture *f) {
  struct attn_fixture g = *f;
  const int T = f->a.n_tokens;
  g.a.n_tokens = 2;
  g.a.q = f->q + (size_t)(T - 2) * f->a.n_head * f->l.head_dim;
  g.a.pos = f->a.pos + T - 2;
  g.a.seq = f->a.seq + T - 2;
  return g;
}

/* How a test calls the attention op: through `be`, or one path of a kernel. */
typedef void attn_fixture_fn(kvl_backend_t *be, const struct kvl_attn_args *a);

/* The fixture through `run` (NULL: kvl_attention on `be`) into *o and through the
 * reference into *orf (both new, [T][n_head * d], the caller frees them); their nmse. */
static inline double attn_fixture_run(const struct attn_fixture *f, kvl_backend_t *be, attn_fixture_fn *run, float **o,
                                      float **orf) {
  const size_t n = (size_t)f->a.n_tokens * f->a.n_head * f->l.head_dim;
  *o = malloc(n * 4), *orf = malloc(n * 4);
  struct kvl_attn_args a = f->a;
  a.out = *o;
  if (run) run(be, &a);
  else kvl_attention(be, &a);
  a.out = *orf;
  kvl_attention_ref(&a);
  return nmse(*o, *orf, n);
}

#endif
