/* test-backend-ops.c — every kernel op x shape x dtype on every CPU SIMD level this
 * processor runs, against the scalar reference, with a per-op error bound (normalised
 * mean squared error, as ggml's test-backend-ops). `--perf` times the ops instead.
 *
 *   test-backend-ops            correctness (unit suite)
 *   test-backend-ops --perf [LEVEL...]   throughput of each op on model-sized shapes (the
 *                                        fastest call in 0.4 s) on the levels named, e.g.
 *                                        avx2int8 avx2int8mm; default all
 */
#include <time.h>
#include <dirent.h>
#include <pthread.h>

#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "../../kernels/backend-impl.h"

#include "../ops_fixtures.h"

static int n_cases, n_bad;
static double worst_i8, worst_bf16;
static void report(const char *be, const char *op, const char *desc, double err, double bound) {
  n_cases++;
  bool ok = err <= bound && err == err;
  if (!ok) {
    n_bad++;
    kvl_test_failed++;
    fprintf(stderr, "FAIL %-11s %-9s %-40s nmse=%.3g > %.1g\n", be, op, desc, err, bound);
  }
}

static const uint32_t wtypes[] = {KVL_TYPE_F32, KVL_TYPE_F16, KVL_TYPE_BF16, KVL_TYPE_Q4_0, KVL_TYPE_Q4_1,
                                  KVL_TYPE_Q5_0, KVL_TYPE_Q5_1, KVL_TYPE_Q8_0, KVL_TYPE_Q4_K, KVL_TYPE_Q5_K,
                                  KVL_TYPE_Q6_K};

/* Batch invariance: a token alone, through the level's exact twin (as prefill chunks and
 * the attention sink run), gives the same bits as its row of the batch: the first token,
 * and with `last` the last one. */
static void alone_is_same(kvl_backend_t *be, const struct kvl_weight *w, const float *x, const float *y, int T,
                          bool last) {
  const int64_t rows = w->rows, cols = w->cols;
  float *y1 = malloc((size_t)rows * sizeof(float));
  for (int i = 0; i < (last ? 2 : 1); i++) {
    const int t = i ? T - 1 : 0;
    kvl_matmul(kvl_backend_exact(be), w, x + (size_t)t * cols, y1, 1);
    CHECK(memcmp(y1, y + (size_t)t * rows, (size_t)rows * sizeof(float)) == 0);
  }
  free(y1);
}

/* A matmul case's weight, bias, input and reference product: the same for every level
 * (each case's data comes from its own seed), so made once and kept for all of them. The
 * scalar reference at -O0 under the sanitizers cost most of this test's time when it was
 * recomputed per level. */
enum { MM_TYPES = sizeof(wtypes) / sizeof(wtypes[0]), MM_SHAPES = 32 };
struct mm_case { void *wd; float *bias, *x, *x0, *yr; }; /* x0: x as made, to check no level wrote it */
static struct mm_case mm_cases[MM_TYPES][MM_SHAPES];

static const struct mm_case *mm_case(size_t ti, size_t si, uint32_t ty, int64_t rows, int64_t cols, int T) {
  struct mm_case *c = &mm_cases[ti][si];
  if (c->wd) return c;
  /* each case's data from its own seed, so that adding a case leaves the others' alone
   * (the one-row, one-token cases are single dot products whose relative error depends
   * on how near zero their random data puts them) */
  seed = 0x9e3779b97f4a7c15ull * (ti * 64 + si + 1);
  c->wd = make_weight(ty, rows, cols);
  c->bias = malloc((size_t)rows * sizeof(float));
  fill(c->bias, (size_t)rows, 0.5f);
  c->x = malloc((size_t)T * cols * sizeof(float));
  fill(c->x, (size_t)T * cols, 1.0f);
  c->x0 = malloc((size_t)T * cols * sizeof(float));
  memcpy(c->x0, c->x, (size_t)T * cols * sizeof(float));
  c->yr = malloc((size_t)T * rows * sizeof(float));
  struct kvl_weight w = {ty, cols, rows, c->wd, si % 2 ? c->bias : NULL, NULL};
  kvl_matmul_ref(&w, c->x, c->yr, T);
  return c;
}

static void mm_cases_free(void) {
  for (size_t ti = 0; ti < MM_TYPES; ti++)
    for (size_t si = 0; si < MM_SHAPES; si++) {
      struct mm_case *c = &mm_cases[ti][si];
      free(c->wd), free(c->bias), free(c->x), free(c->x0), free(c->yr);
    }
}

static void test_matmul(kvl_backend_t *be) {
  static const struct { int64_t rows, cols; int T; } shapes[] = {
    {1, 256, 1}, {7, 512, 3}, {33, 256, 4}, {17, 768, 5}, {64, 1024, 17}, {130, 256, 1}, {40, 512, 16}, {9, 256, 7},
    /* single decode tokens over rows of 16-block groups plus a partial one (8 rows: the
     * tight 1e-3 bound applies, so a wrong scale in the last group fails) */
    {8, 1024, 1}, {8, 1280, 1}, {8, 4864, 1},
    /* batched decode on AMX tiles: partial 16-row groups, a last chunk of 128 elements (the
     * 32-element formats) */
    {20, 896, 9}, {37, 1280, 16}, {16, 2304, 2},
    /* the tokens-in-lanes kernels (qmatmul_lanes.h): 41 tokens are several token groups
     * (8 per vector on AVX2, 16 on AVX-512), 13 rows a partial row block; tiles hold twice
     * the L2 of activations, so 250 tokens over 8960 (140 KiB per 16 tokens) are two tiles
     * of equal size wherever L2 is 1 MiB or less (Zen 3/4/5) */
    {13, 4864, 41}, {6, 2304, 75}, {9, 8960, 250},
    /* decode batches of 6 tokens (qdot1n's widest case), and 3 over a width that is not a
     * multiple of 128 (Q5_0's 16-block form instead of its quads) */
    {11, 512, 6}, {5, 192, 3},
  };
  _Static_assert(sizeof(shapes) / sizeof(shapes[0]) <= MM_SHAPES, "mm_cases holds every shape");
  for (size_t ti = 0; ti < sizeof(wtypes) / sizeof(wtypes[0]); ti++)
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
      uint32_t ty = wtypes[ti];
      int64_t rows = shapes[si].rows, cols = shapes[si].cols;
      int T = shapes[si].T;
      if (ty == KVL_TYPE_F32 && si == 1) cols = 509; /* a dense odd width: SIMD tails */
      if (!kvl_row_size(ty, (uint64_t)cols)) continue; /* a width the format's blocks do not tile */
      const struct mm_case *mc = mm_case(ti, si, ty, rows, cols, T);
      void *wd = mc->wd;
      float *bias = mc->bias, *x = mc->x;
      const float *yr = mc->yr;
      struct kvl_wpack slot = {0}; /* for the bf16 level's repacked copy */
      struct kvl_weight w = {ty, cols, rows, wd, si % 2 ? bias : NULL, be->bf16_min_t ? &slot : NULL};
      float *y = malloc((size_t)T * rows * sizeof(float));
      kvl_matmul(be, &w, x, y, T);
      /* the input is shared by every level's case: a level that wrote into it would fail
       * the levels after it, not itself */
      CHECK(memcmp(x, mc->x0, (size_t)T * cols * sizeof(float)) == 0);
      char desc[96];
      snprintf(desc, sizeof(desc), "%s rows=%lld cols=%lld T=%d%s", kvl_type_name(ty), (long long)rows,
               (long long)cols, T, w.bias ? " +bias" : "");
      /* the int8-activation decode path (small batches, 4 formats) has quantisation error */
      bool i8type = ty == KVL_TYPE_Q8_0 || ty == KVL_TYPE_Q5_0 || ty == KVL_TYPE_Q4_K || ty == KVL_TYPE_Q6_K;
      bool amx = be->qmatmul_min_t && T >= be->qmatmul_min_t && i8type;
      bool int8 = (be->qdot && T <= KVL__QDOT_USE_T && i8type) || amx;
      /* bf16 GEMMs: both operands rounded to 8 significant bits, fp32 accumulation */
      bool bf16 = be->bf16_min_t && T >= be->bf16_min_t && !int8;
      report(kvl_backend_name(be), amx ? "matmul-amx" : int8 ? "matmul-i8" : bf16 ? "matmul-bf16" : "matmul", desc,
             nmse(y, yr, (size_t)T * rows),
             /* a single dot product can be near zero: its relative error says little */
             int8 ? (rows * T >= 8 ? 1e-3 : 5e-2) : bf16 ? (rows * T >= 8 ? 1e-4 : 1e-2)
                  : be->row_dots && rows * T < 8 ? 1e-6 : 1e-10);
      if (bf16) {
        CHECK(slot.impl != NULL && slot.bytes >= (size_t)rows * (size_t)cols * 2);
        worst_bf16 = fmax(worst_bf16, nmse(y, yr, (size_t)T * rows));
        alone_is_same(be, &w, x, y, T, false);
      }
      /* AMX tiles (every size in the exact twin) and the fp32 products (outer-product
       * form): the last token too, past the first tile of 16 tokens where T > 16. A bf16
       * level's exact twin takes bf16 at every size while the level computes small
       * batches of these formats in fp32: there the twin is checked against itself. */
      const bool twin_bf16 = kvl_backend_exact(be)->bf16_min_t && !int8 && !bf16;
      /* (the sink twins' lone tokens go through dot products: no batch matches them) */
      if (amx || (!int8 && !bf16 && !twin_bf16 && !be->row_dots)) alone_is_same(be, &w, x, y, T, true);
      if (twin_bf16) {
        float *ye = malloc((size_t)T * rows * sizeof(float));
        kvl_matmul(kvl_backend_exact(be), &w, x, ye, T);
        report(kvl_backend_name(kvl_backend_exact(be)), "matmul-bf16", desc, nmse(ye, yr, (size_t)T * rows),
               rows * T >= 8 ? 1e-4 : 1e-2);
        alone_is_same(be, &w, x, ye, T, true);
        free(ye);
      }
      /* decode batches of up to KVL__QDOT1_MAX_T tokens on the single-token kernel
       * (qdot_matmul; Q4_K and Q6_K with each block unpacked once for all, qdot1n): every
       * token as if it were alone */
      if (be->qdot1 && int8 && !amx && T > 1 && T <= KVL__QDOT1_MAX_T) {
        float *y1 = malloc((size_t)rows * sizeof(float));
        for (int t = 0; t < T; t++) {
          kvl_matmul(be, &w, x + (size_t)t * cols, y1, 1);
          CHECK(memcmp(y1, y + (size_t)t * rows, (size_t)rows * sizeof(float)) == 0);
        }
        free(y1);
      }
      kvl_wpack_release(&slot);
      CHECK(slot.impl == NULL);
      if (int8 && rows * T >= 8) worst_i8 = fmax(worst_i8, nmse(y, yr, (size_t)T * rows));
      if (int8 && getenv("KVL_TEST_VERBOSE")) printf("  i8 %-40s nmse %.2e\n", desc, nmse(y, yr, (size_t)T * rows));
      free(y);
    }
}

static void test_elementwise(kvl_backend_t *be) {
  for (int n = 1; n <= 1536; n = n * 3 + 5) {
    int T = 3;
    float *x = malloc((size_t)T * n * 4), *w = malloc((size_t)n * 4), *y = malloc((size_t)T * n * 4), *yr = malloc((size_t)T * n * 4);
    fill(x, (size_t)T * n, 3.0f);
    fill(w, (size_t)n, 1.0f);
    kvl_rmsnorm(be, x, w, y, T, n, 1e-6f);
    kvl_rmsnorm_ref(x, w, yr, T, n, 1e-6f);
    char desc[64];
    snprintf(desc, sizeof(desc), "n=%d T=%d", n, T);
    report(kvl_backend_name(be), "rmsnorm", desc, nmse(y, yr, (size_t)T * n), 1e-12);
    kvl_swiglu(be, x, w, y, n);
    kvl_swiglu_ref(x, w, yr, n);
    report(kvl_backend_name(be), "swiglu", desc, nmse(y, yr, (size_t)n), 1e-12);
    free(x); free(w); free(y); free(yr);
  }
}

static void test_rope(kvl_backend_t *be) {
  static const struct { int d, heads; float theta; } cases[] = {{64, 14, 1e6f}, {128, 2, 1e6f}, {32, 3, 1e4f}};
  int32_t pos[] = {0, 1, 15, 16, 1000, 32767};
  int T = 6;
  for (size_t c = 0; c < 3; c++) {
    struct kvl_rope r;
    CHECK_EQ_INT(kvl_rope_init(&r, cases[c].d, cases[c].theta), 0);
    size_t n = (size_t)T * cases[c].heads * cases[c].d;
    float *x = malloc(n * 4), *y = malloc(n * 4), *yr = malloc(n * 4);
    fill(x, n, 2.0f);
    for (int inv = 0; inv < 2; inv++) {
      memcpy(y, x, n * 4);
      memcpy(yr, x, n * 4);
      kvl_rope(be, &r, y, pos, T, cases[c].heads, inv);
      kvl_rope_ref(&r, yr, pos, T, cases[c].heads, inv);
      char desc[64];
      snprintf(desc, sizeof(desc), "d=%d heads=%d%s", cases[c].d, cases[c].heads, inv ? " inverse" : "");
      report(kvl_backend_name(be), "rope", desc, nmse(y, yr, n), 1e-12);
    }
    /* the inverse undoes the rotation */
    memcpy(y, x, n * 4);
    kvl_rope(be, &r, y, pos, T, cases[c].heads, false);
    kvl_rope(be, &r, y, pos, T, cases[c].heads, true);
    report(kvl_backend_name(be), "rope", "forward then inverse = identity", nmse(y, x, n), 1e-12);
    free(x); free(y); free(yr);
  }
  struct kvl_rope r;
  CHECK_EQ_INT(kvl_rope_init(&r, 63, 1e4f), KVL_EINVAL);
  CHECK_EQ_INT(kvl_rope_init(&r, 64, 0.5f), KVL_EINVAL);
}

/* The level's dequantisation is bit-identical to the reference for every type. */
static void test_dequant(kvl_backend_t *be) {
  for (size_t ti = 0; ti < sizeof(wtypes) / sizeof(wtypes[0]); ti++) {
    void *wd = make_weight(wtypes[ti], 3, 1024);
    float y[3 * 1024], yr[3 * 1024];
    CHECK_EQ_INT(be->simd->dequant(wtypes[ti], wd, y, 3 * 1024), 0);
    CHECK_EQ_INT(kvl_dequant_row_ref(wtypes[ti], wd, yr, 3 * 1024), 0);
    report(kvl_backend_name(be), "dequant", kvl_type_name(wtypes[ti]), memcmp(y, yr, sizeof(y)) ? 1.0 : 0.0, 0);
    free(wd);
  }
}

static void test_embed(kvl_backend_t *be) {
  for (size_t ti = 0; ti < sizeof(wtypes) / sizeof(wtypes[0]); ti++) {
    void *wd = make_weight(wtypes[ti], 50, 256);
    struct kvl_weight w = {wtypes[ti], 256, 50, wd, NULL, NULL};
    int32_t ids[] = {0, 49, 7, 7};
    float y[4 * 256], yr[4 * 256];
    kvl_embed(be, &w, ids, y, 4);
    kvl_embed_ref(&w, ids, yr, 4);
    report(kvl_backend_name(be), "embed", kvl_type_name(wtypes[ti]), nmse(y, yr, 4 * 256), 0);
    free(wd);
  }
}

/* attention through the backend, and through the AVX-512 kernel's fp32 products */
static void attn_backend(kvl_backend_t *be, const struct kvl_attn_args *a) { kvl_attention(be, a); }
static void attn_avx512_fp32(kvl_backend_t *be, const struct kvl_attn_args *a) {
  (void)be;
  kvl__attention_avx512(a, false);
}

/* The attention cases (two sequences with scattered physical blocks; a prefill chunk
 * crossing block boundaries in one and single decode tokens in the other, in one call)
 * through `run` against the reference: fp32 arithmetic to 1e-10; where
 * the products are bf16 (bf16: the AVX-512 attention's bf16 path, which rounds the query
 * and the softmax weights to 8 significant bits) to 3e-5 */
static void test_attention_run(kvl_backend_t *be, const char *name, attn_fixture_fn *run, bool bf16) {
  for (int c = 0; c < ATTN_N_CASES; c++) {
    struct attn_fixture f;
    char desc[96];
    attn_fixture_case(&f, c, desc, sizeof(desc));
    const int T = f.a.n_tokens, d = f.l.head_dim, qw = f.a.n_head * d;
    float *o, *orf;
    const double err = attn_fixture_run(&f, be, run, &o, &orf);
    const bool bf_case = bf16 && f.l.dtype == KVL_KV_BF16 && (d == 64 || d == 128);
    report(name, "attention", desc, err, bf_case ? 3e-5 : 1e-10);
    /* a token's output does not depend on its batch: each one alone, bit for bit */
    bool same = true;
    for (int t = 0; t < T; t++) {
      struct kvl_attn_args one = f.a;
      one.n_tokens = 1, one.q = f.q + (size_t)t * qw, one.out = orf, one.pos = f.pos + t, one.seq = f.sq + t;
      run(be, &one);
      same = same && !memcmp(orf, o + (size_t)t * qw, (size_t)qw * 4);
    }
    if (!same) printf("FAIL %s attention %s: a token alone differs from the batch\n", name, desc);
    CHECK(same);
    free(o), free(orf);
    attn_fixture_free(&f);
  }
}

static void test_attention(kvl_backend_t *be) {
  const bool avx512 = be->simd == &kvl__simd_avx512;
  test_attention_run(be, kvl_backend_name(be), attn_backend, avx512 && kvl__attn_bf16());
  if (!avx512 || strcmp(kvl_backend_name(be), "cpu-avx512")) return;
#if defined(__GNUC__) && !defined(__clang__) /* clang 14's __builtin_cpu_supports lacks it */
  /* the bf16 products exactly where the processor has them (KVL_ATTN unset in the tests) */
  if (!getenv("KVL_ATTN")) CHECK(kvl__attn_bf16() == (bool)__builtin_cpu_supports("avx512bf16"));
#endif
  if (!kvl__attn_bf16()) return;
  /* where the levels take the bf16 products, the fp32 ones too (KVL_ATTN=fp32) — and the
   * two really differ on a bf16 cache (the bf16 path is taken, not a bound wide enough
   * for either) */
  test_attention_run(be, "cpu-avx512 (KVL_ATTN=fp32)", attn_avx512_fp32, false);
  for (int c = 1; c < ATTN_N_CASES; c += 2) { /* odd cases: bf16 KV */
    struct attn_fixture f;
    char desc[96];
    attn_fixture_case(&f, c, desc, sizeof(desc));
    const int d = f.l.head_dim;
    const size_t n = (size_t)f.a.n_tokens * f.a.n_head * d;
    float *o = malloc(n * 4), *of = malloc(n * 4);
    struct kvl_attn_args a = f.a;
    a.out = o;
    kvl_attention(be, &a);
    a.out = of;
    kvl__attention_avx512(&a, false);
    const bool differ = memcmp(o, of, n * 4) != 0;
    if ((d == 64 || d == 128) != differ)
      printf("FAIL attention %s: bf16 and fp32 products %s\n", desc, differ ? "differ" : "agree");
    CHECK((d == 64 || d == 128) == differ);
    free(o), free(of);
    attn_fixture_free(&f);
  }
}

/* fp32 bits -> bf16 by the definition: a NaN keeps its top bits and is made quiet;
 * otherwise the dropped 16 bits round to nearest, ties to the even result (an exponent
 * carry gives the next binade or infinity, as it should) */
static uint16_t bf16_want(uint32_t u) {
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
  uint32_t hi = u >> 16, lo = u & 0xffffu;
  if (lo > 0x8000u || (lo == 0x8000u && (hi & 1u))) hi++;
  return (uint16_t)hi;
}

/* kv store/load round trip and the block geometry */
static void test_kv(void) {
  struct kvl_kv_layout l = {2, 2, 64, KVL_KV_F32};
  CHECK_EQ_INT(kvl_kv_block_bytes(&l), 2 * 2 * 16 * 128 * 4);
  l.dtype = KVL_KV_BF16;
  CHECK_EQ_INT(kvl_kv_block_bytes(&l), 2 * 2 * 16 * 128 * 2);
  void *pool = calloc(4, kvl_kv_block_bytes(&l));
  int32_t bt[] = {3, 1};
  const int32_t *bts[] = {bt};
  float k[128], v[128], k2[128], v2[128];
  fill(k, 128, 1);
  fill(v, 128, 1);
  int32_t pos = 17, sq = 0;
  kvl_kv_store(&l, pool, 1, 1, k, v, &pos, &sq, bts);
  kvl_kv_load(&l, pool, 1, 17, bt, k2, v2);
  float maxe = 0;
  for (int i = 0; i < 128; i++) maxe = fmaxf(maxe, fmaxf(fabsf(k[i] - k2[i]), fabsf(v[i] - v2[i])));
  CHECK(maxe <= 1.0f / 128); /* bf16: 8 bits of mantissa on values in [-1, 1) */
  /* it landed in physical block 1, slot 1, layer 1 */
  const uint16_t *kp = (const uint16_t *)kvl_kv_k_ptr(&l, pool, 1, 1) + 128;
  CHECK(kp[0] == kvl_fp32_to_bf16(k[0]));
  /* the store rounds to nearest, ties to even, keeps NaNs NaN (quiet) and infinities,
   * subnormals and signed zeros as they are; the load widens exactly. The expected bits
   * come from bf16_want below (written from the definition, with branches), not from
   * the library's conversion that the store's vectorised loop uses. */
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                              0xffa00000u, 0x7f800001u, 0x00000001u, 0x807fffffu, 0x80000000u, 0x7f7fffffu,
                              0x477fefffu, 0xc77ff000u, 0x00000000u, 0x3f7fff80u};
  for (int i = 0; i < 128; i++) {
    uint32_t u = special[i % 16] ^ (i >= 16 ? (uint32_t)i << 3 : 0u);
    memcpy(&k[i], &u, 4);
  }
  kvl_kv_store(&l, pool, 1, 1, k, v, &pos, &sq, bts);
  kvl_kv_load(&l, pool, 1, 17, bt, k2, v2);
  int bad = 0;
  for (int i = 0; i < 128; i++) {
    uint32_t u, back = (uint32_t)kp[i] << 16, got;
    memcpy(&u, &k[i], 4);
    memcpy(&got, &k2[i], 4);
    bad += kp[i] != bf16_want(u) || got != back;
  }
  CHECK_EQ_INT(bad, 0);
  free(pool);
}

/* The vector-scale int8 kernels (2..16 tokens) against the per-token scalar ones: the
 * same arithmetic in another order, so they agree to float rounding. */
/* The one-token cases: the four int8 formats at the 1.5B's width (1536) and the 0.5B's
 * (896: 28 blocks, a partial group for the 32-element formats; none for the K-quants) */
static bool one_token_case(size_t c, uint32_t *type, int64_t *K) {
  static const uint32_t ty[] = {KVL_TYPE_Q8_0, KVL_TYPE_Q5_0, KVL_TYPE_Q4_K, KVL_TYPE_Q6_K};
  *type = ty[c % 4];
  *K = c < 4 ? 1536 : 896;
  return !(*K % 256 && (*type == KVL_TYPE_Q4_K || *type == KVL_TYPE_Q6_K));
}

/* T tokens' int8 activations of width K (random x, quantised by `quant`) as the decode
 * kernels take them: codes xq, scales xd, sums of 16 xs, the Q4_K factors xf where
 * K % 256 == 0; xp, the reordered codes, is left for the caller (kvl__q8_order). */
struct q8_acts {
  float *x, *xd, *xf;
  int8_t *xq, *xp;
  int32_t *xs;
};
typedef void (*q8_quant_fn)(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16);
static struct q8_acts q8_acts_new(int T, int64_t K, q8_quant_fn quant) {
  struct q8_acts a = {malloc((size_t)T * K * 4), malloc((size_t)T * (K / 32) * 4), malloc((size_t)T * (K / 16) * 4),
                      malloc((size_t)T * K), malloc((size_t)T * K), malloc((size_t)T * (K / 16) * 4)};
  fill(a.x, (size_t)T * K, 1.0f);
  for (int t = 0; t < T; t++) {
    quant(a.x + t * K, K, a.xq + t * K, a.xd + t * (K / 32), a.xs + t * (K / 16));
    if (K % 256 == 0) kvl__q4_k_act_factors(a.xd + t * (K / 32), a.xs + t * (K / 16), K, a.xf + t * (K / 16));
  }
  return a;
}
static void q8_acts_free(struct q8_acts *a) {
  free(a->x), free(a->xd), free(a->xf), free(a->xq), free(a->xp), free(a->xs);
}

static void test_qdot_vec(void) {
  kvl_backend_t *be = kvl_backend_cpu_level("avx512vnni");
  if (!be) { printf("  (no AVX-512 VNNI: skipped)\n"); return; }
  static const uint32_t ty[] = {KVL_TYPE_Q8_0, KVL_TYPE_Q5_0, KVL_TYPE_Q4_K, KVL_TYPE_Q6_K};
  const int64_t K = 1536, R = 37; /* the AMX kernel: two whole 16-row groups and a partial one */
  const bool amx = kvl__amx_usable(), lanes2 = kvl_backend_cpu_level("avx2int8mm") != NULL,
             lanes512 = kvl_backend_cpu_level("avx512vnnimm") != NULL;
  double worst = 0, worst_amx = 0, worst_lanes = 0;
  for (size_t i = 0; i < 4; i++) {
    void *wd = make_weight(ty[i], R, K);
    const size_t rb = kvl_row_size(ty[i], K);
    for (int T = 2; T <= KVL__QDOT_MAX_T; T++) {
      float *x = malloc((size_t)T * K * 4);
      fill(x, (size_t)T * K, 1.0f);
      int8_t *xq = malloc((size_t)T * K);
      float *xd = malloc((size_t)T * (K / 32) * 4), *sx = malloc((size_t)T * (K / 4) * 4), *cx = malloc((size_t)T * (K / 4) * 4);
      int32_t *xs = malloc((size_t)T * (K / 16) * 4);
      float *ya = malloc((size_t)T * R * 4), *y2 = malloc((size_t)T * R * 4), *y5 = malloc((size_t)T * R * 4);
      for (int t = 0; t < T; t++) {
        kvl__q8_act(x + t * K, K, xq + t * K, xd + t * (K / 32), xs + t * (K / 16));
        kvl__q8_act_vec(xd + t * (K / 32), xs + t * (K / 16), K, sx + t * (K / 4), cx + t * (K / 4));
      }
      if (amx) CHECK_EQ_INT(kvl__qmatmul_amx(ty[i], wd, rb, R, K, xq, xd, xs, T, NULL, ya), 0);
      if (lanes2) CHECK_EQ_INT(kvl__qmatmul_avx2(ty[i], wd, rb, R, K, xq, xd, xs, T, NULL, y2), 0);
      if (lanes512) CHECK_EQ_INT(kvl__qmatmul_avx512vnni(ty[i], wd, rb, R, K, xq, xd, xs, T, NULL, y5), 0);
      for (int r = 0; r < R; r++) {
        const uint8_t *row = (const uint8_t *)wd + (size_t)r * rb;
        float a[KVL__QDOT_MAX_T], b[KVL__QDOT_MAX_T];
        CHECK_EQ_INT(be->qdot(ty[i], row, K, xq, xd, xs, T, a), 0);
        if (r < 3) CHECK_EQ_INT(be->qdot_vec(ty[i], row, K, xq, sx, cx, T, b), 0);
        for (int t = 0; t < T; t++) {
          if (r < 3) worst = fmax(worst, fabs((double)a[t] - b[t]) / (fabs((double)a[t]) + 1.0));
          if (amx) worst_amx = fmax(worst_amx, fabs((double)a[t] - ya[(size_t)t * R + r]) / (fabs((double)a[t]) + 1.0));
          if (lanes2) worst_lanes = fmax(worst_lanes, fabs((double)a[t] - y2[(size_t)t * R + r]) / (fabs((double)a[t]) + 1.0));
          if (lanes512)
            worst_lanes = fmax(worst_lanes, fabs((double)a[t] - y5[(size_t)t * R + r]) / (fabs((double)a[t]) + 1.0));
        }
      }
      free(x); free(xq); free(xd); free(sx); free(cx); free(xs); free(ya); free(y2); free(y5);
    }
    free(wd);
  }
  /* one token: the reordered-activation kernels (Q4_K pairs, Q5_0 quads) and the shared
   * entry (others: the same kernel) */
  double worst1 = 0;
  for (size_t c = 0; c < 8; c++) {
    uint32_t tc;
    int64_t K;
    if (!one_token_case(c, &tc, &K)) continue;
    void *wd = make_weight(tc, R, K);
    const size_t rb = kvl_row_size(tc, K);
    struct q8_acts ac = q8_acts_new(1, K, kvl__q8_act);
    int8_t *xq = ac.xq, *xp = ac.xp;
    float *xd = ac.xd, *xf = ac.xf;
    int32_t *xs = ac.xs;
    CHECK_EQ_INT(kvl__q8_order(tc, xq, K, xp), tc == KVL_TYPE_Q4_K || tc == KVL_TYPE_Q5_0);
    for (int r = 0; r < R; r++) {
      const uint8_t *row = (const uint8_t *)wd + (size_t)r * rb;
      float a, b;
      CHECK_EQ_INT(be->qdot(tc, row, K, xq, xd, xs, 1, &a), 0);
      CHECK_EQ_INT(be->qdot1(tc, row, K, xq, xp, xd, xs, tc == KVL_TYPE_Q4_K ? xf : NULL, &b), 0);
      if (tc != KVL_TYPE_Q4_K && tc != KVL_TYPE_Q5_0) CHECK(a == b);
      worst1 = fmax(worst1, fabs((double)a - b) / (fabs((double)a) + 1.0));
    }
    q8_acts_free(&ac);
    free(wd);
  }
  printf("  one token, reordered-activation kernels vs natural order: worst relative difference %.2e\n", worst1);
  CHECK(worst1 < 1e-5);
  printf("  vector-scale vs scalar-scale int8 kernels, T = 2..16, 4 formats: worst relative difference %.2e\n", worst);
  CHECK(worst < 1e-4); /* the offset terms cancel large sums: rounding shows at ~1e-5 */
  /* the tokens-in-lanes kernels: the same integer sums, scaled in another order */
  printf("  tokens-in-lanes kernels (%s) vs scalar-scale int8 kernels, same cases: worst relative difference %.2e\n",
         lanes512 ? "AVX2, AVX-512 VNNI" : "AVX2", worst_lanes);
  CHECK(worst_lanes < 1e-4);
  if (amx) {
    printf("  AMX tiles vs scalar-scale int8 kernels, same cases: worst relative difference %.2e\n", worst_amx);
    CHECK(worst_amx < 1e-4);
  } else {
    printf("  (no AMX int8, or the kernel refused the tile state: the AMX kernel not tested)\n");
  }
}

/* The AVX2 activation quantiser gives the codes, scales and sums of the definition
 * (d = max|x| / 127, q = x / d rounded to nearest even, sums of 16 codes), as the AVX-512
 * one does: the two int8 levels read the same activations. */
/* The one-token kernels (qdot1; on AVX2 Q4_K on its factors, Q6_K with the group scales
 * in the integer sums) against the several-token kernel (qdot, which reduces each unit to
 * a scalar first); qdot1n's tokens and qdot1_rows' rows (with a bias) bit for bit against
 * qdot1's, on the AVX2 and the AVX-512 VNNI levels (the latter with its codes in the
 * order kvl__q8_order gives): 4 formats, the 1.5B's width and the 0.5B's (a partial
 * 8-block group) */
static void test_qdot1_level(const char *level, q8_quant_fn quant) {
  kvl_backend_t *be = kvl_backend_cpu_level(level);
  if (!be) { printf("  (no %s: skipped)\n", level); return; }
  enum { R = 9, T = 5 };
  double worst = 0;
  for (size_t c = 0; c < 8; c++) {
    uint32_t ty;
    int64_t K;
    if (!one_token_case(c, &ty, &K)) continue;
    void *wd = make_weight(ty, R, K);
    const size_t rb = kvl_row_size(ty, K);
    struct q8_acts ac = q8_acts_new(T, K, quant);
    const int8_t *xq = ac.xq, *xp = ac.xq;
    const float *xd = ac.xd, *xf = ac.xf;
    const int32_t *xs = ac.xs;
    const float *f = ty == KVL_TYPE_Q4_K ? xf : NULL;
    if (be->q8_order && be->q8_order(ty, xq, K, ac.xp)) {
      for (int t = 1; t < T; t++) be->q8_order(ty, xq + t * K, K, ac.xp + t * K);
      xp = ac.xp;
    }
    /* the row loop: every row the bits qdot1 gives it, plus its bias */
    float yr[R], bias[R];
    for (int r = 0; r < R; r++) bias[r] = 0.25f * (float)(r - 4);
    CHECK_EQ_INT(be->qdot1_rows(ty, wd, rb, R, K, xq, xp, xd, xs, f, bias, yr), 0);
    for (int r = 0; r < R; r++) {
      const uint8_t *row = (const uint8_t *)wd + (size_t)r * rb;
      float a[T], b[T], n[T];
      CHECK_EQ_INT(be->qdot(ty, row, K, xq, xd, xs, T, a), 0);
      CHECK_EQ_INT(be->qdot1n(ty, row, K, T, xq, xp, xd, xs, f, n), 0);
      for (int t = 0; t < T; t++) {
        CHECK_EQ_INT(be->qdot1(ty, row, K, xq + t * K, xp + t * K, xd + t * (K / 32), xs + t * (K / 16),
                               f ? f + t * (K / 16) : NULL, &b[t]), 0);
        CHECK(memcmp(&b[t], &n[t], sizeof(float)) == 0);
        if (t == 0) {
          const float e = b[0] + bias[r];
          CHECK(memcmp(&e, &yr[r], sizeof(float)) == 0);
        }
        worst = fmax(worst, fabs((double)a[t] - b[t]) / (fabs((double)a[t]) + 1.0));
      }
    }
    q8_acts_free(&ac);
    free(wd);
  }
  printf("  %s one-token kernels vs the several-token kernel: worst relative difference %.2e\n", level, worst);
  CHECK(worst < 1e-4); /* as the vector-scale kernels: offsets cancel large sums, rounding shows at ~1e-5 */
}

static void test_qdot1_avx2(void) { test_qdot1_level("avx2int8", kvl__q8_act_avx2); }
static void test_qdot1_avx512(void) { test_qdot1_level("avx512vnni", kvl__q8_act); }

/* One-token products on the decode copies (kvl__decode_copy: Q5_0 in quads, Q4_K with
 * its scales as bytes, Q8_0 with its scales first) against the GGUF rows: the Q5_0
 * packer's bytes (every fifth bit where the kernels look for it) and the same bits from
 * kvl_matmul with a pack slot as without, for 1..6 tokens (the row kernel, qdot1n; the
 * Q4_K copy's scale bytes come from portable C, the GGUF path's from a vector unpack);
 * the copy is counted while it lives; where K does not suit the copy none is made; the
 * avx512bf16 level keeps none. */
/* The threads of this process (/proc/self/task), or -1 where it cannot tell. */
static int n_tasks(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* On a fresh thread (as the daemon's main thread or a libuv worker is to OpenMP): the
 * threads of the process before and after the three packers ran there. */
static void *packers_thread(void *arg) {
  int *n = arg;
  /* Q8_0's rows are the longest of the three formats' (34 bytes per 32 elements) */
  uint8_t *w = make_weight(KVL_TYPE_Q8_0, 64, 1536), *p = malloc(kvl_row_size(KVL_TYPE_Q8_0, 1536) * 64);
  n[0] = n_tasks();
  kvl__q5_0_quads_pack(w, p, 64, 1536); /* any bytes will do: only the threads are counted */
  kvl__q4_k_sb_pack(w, p, 64, 1536);
  kvl__q8_0_sc_pack(w, p, 64, 1536);
  n[1] = n_tasks();
  free(w), free(p);
  return NULL;
}

static void test_decode_copies(void) {
  /* the packers start no threads: an OpenMP region on a thread other than the compute
   * thread leaves a second pool beside its team, and libgomp with more threads than CPUs
   * sleeps between regions (every forward then pays wake-ups: bench/README, session 36) */
  int n[2] = {0, 0};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, packers_thread, n) == 0);
  pthread_join(th, NULL);
  CHECK(n[0] < 0 || n[1] == n[0]);

  static const struct { uint32_t type; int64_t K; } cs[] = {
    {KVL_TYPE_Q5_0, 128}, {KVL_TYPE_Q5_0, 896}, {KVL_TYPE_Q5_0, 1536}, {KVL_TYPE_Q5_0, 4864}, {KVL_TYPE_Q5_0, 864},
    {KVL_TYPE_Q4_K, 256}, {KVL_TYPE_Q4_K, 1536}, {KVL_TYPE_Q4_K, 8960}, {KVL_TYPE_Q8_0, 1536}, {KVL_TYPE_Q8_0, 896},
    {KVL_TYPE_Q8_0, 64}, {KVL_TYPE_Q8_0, 4864}};
  const int64_t R = 37;
  uint8_t *w = make_weight(KVL_TYPE_Q5_0, 1, 128), *p = malloc(88);
  kvl__q5_0_quads_pack(w, p, 1, 128);
  for (int k = 0; k < 4; k++) {
    const uint8_t *blk = w + 22 * k;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    CHECK(memcmp(p + 2 * k, blk, 2) == 0 && memcmp(p + 8 + 16 * k, blk + 6, 16) == 0);
    for (int i = 0; i < 32; i++) /* element i's fifth bit: mask i / 16, bit 16k + i % 16 */
      CHECK_EQ_INT(p[8 + 64 + 8 * (i / 16) + (16 * k + i % 16) / 8] >> (i % 8) & 1, qh >> i & 1);
  }
  free(w), free(p);
  kvl_backend_t *bf = kvl_backend_cpu_level("avx512bf16");
  CHECK(!bf || !bf->decode_copies); /* its weights' slots hold the bf16 copies for prefill */
  static const char *levels[] = {"avx512vnni", "avx512vnnimm", "amx"};
  for (int l = 0; l < 3; l++) {
    kvl_backend_t *be = kvl_backend_cpu_level(levels[l]);
    if (!be) continue;
    CHECK(be->decode_copies);
    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
      const int64_t K = cs[i].K;
      const uint32_t ty = cs[i].type;
      void *wd = make_weight(ty, R, K);
      struct kvl_wpack slot = {0};
      const struct kvl_weight plain = {ty, K, R, wd, NULL, NULL}, slotted = {ty, K, R, wd, NULL, &slot};
      const size_t before = kvl_wpack_total_bytes();
      for (int T = 1; T <= KVL__QDOT1_MAX_T; T++) {
        float *x = malloc((size_t)T * K * 4), *y0 = malloc((size_t)T * R * 4), *y1 = malloc((size_t)T * R * 4);
        fill(x, (size_t)T * K, 1.0f);
        kvl_matmul(be, &plain, x, y0, T);
        kvl_matmul(be, &slotted, x, y1, T);
        CHECK(memcmp(y0, y1, (size_t)T * R * 4) == 0);
        free(x), free(y0), free(y1);
      }
      const size_t made = ty == KVL_TYPE_Q4_K ? (size_t)(K / 256) * KVL__Q4_K_SB_BYTES * R
                          : ty == KVL_TYPE_Q8_0 || K % 128 == 0 ? kvl_row_size(ty, K) * R
                                                                : 0;
      CHECK(kvl_wpack_total_bytes() - before == made && (slot.impl != NULL) == (made != 0));
      kvl_wpack_release(&slot);
      CHECK(kvl_wpack_total_bytes() == before && !slot.impl);
      free(wd);
    }
  }
}

static void test_q8_act(void) {
  if (!kvl_backend_cpu_level("avx2int8")) { printf("  (no AVX2: skipped)\n"); return; }
  const int64_t K = 1536;
  float *x = malloc((size_t)K * 4);
  fill(x, (size_t)K, 3.0f);
  x[7] = 0.0f, x[40] = -x[41]; /* a zero, and a block whose extreme is negative */
  for (int i = 64; i < 96; i++) x[i] = 0.0f; /* an all-zero block: scale 0, codes 0 */
  int8_t q[1536], qv[1536];
  float d[48], dv[48];
  int32_t s[96], sv[96];
  kvl__q8_act_avx2(x, K, q, d, s);
  for (int64_t b = 0; b < K / 32; b++) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
    float id = amax > 0 ? 127.0f / amax : 0.0f;
    CHECK(d[b] == amax / 127.0f);
    for (int h = 0; h < 2; h++) {
      int32_t sum = 0;
      for (int i = 16 * h; i < 16 * h + 16; i++) {
        int v = (int)nearbyintf(x[32 * b + i] * id);
        CHECK_EQ_INT(q[32 * b + i], v);
        sum += v;
      }
      CHECK_EQ_INT(s[2 * b + h], sum);
    }
  }
  if (kvl_backend_cpu_level("avx512vnni")) {
    kvl__q8_act(x, K, qv, dv, sv);
    CHECK(memcmp(q, qv, sizeof(q)) == 0 && memcmp(d, dv, sizeof(d)) == 0 && memcmp(s, sv, sizeof(s)) == 0);
  }
  free(x);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A bf16 pool of n_blocks blocks filled with small floats (any bits below magnitude 2). */
static void fill_kv_pool(void *pool, int n_blocks, const struct kvl_kv_layout *l) {
  fill(pool, (size_t)n_blocks * kvl_kv_block_bytes(l) / 4, 0.5f);
  for (size_t i = 0; i < (size_t)n_blocks * kvl_kv_block_bytes(l) / 2; i++) ((uint16_t *)pool)[i] &= 0xbfff;
}

/* The best of five passes of attention over every layer in turn, in seconds. */
static double time_attention(kvl_backend_t *be, struct kvl_attn_args *a, int n_layer) {
  double best = 1e30;
  for (int round = 0; round < 5; round++) {
    const double t0 = now();
    for (int layer = 0; layer < n_layer; layer++) a->layer = layer, kvl_attention(be, a);
    const double t = now() - t0;
    best = t < best ? t : best;
  }
  return best;
}

/* A new turn's prefill attention after a long history (a switch's first step, a chat's
 * next turn): one sequence, 32 tokens at positions D .. D+31 over a cache of D+32
 * positions, the 1.5B's geometry (28 layers, 2 KV heads of 128, 12 query heads) and the
 * 0.5B's (24 layers, 2 of 64, 14); bf16; the layers in turn. */
static void perf_attention_turn(kvl_backend_t *be) {
  static const struct { const char *name; struct kvl_kv_layout l; int n_head; } geo[] = {
      {"1.5B", {28, 2, 128, KVL_KV_BF16}, 12}, {"0.5B", {24, 2, 64, KVL_KV_BF16}, 14}};
  for (size_t gi = 0; gi < sizeof(geo) / sizeof(geo[0]); gi++) {
    const struct kvl_kv_layout l = geo[gi].l;
    const int T = 32, D = 8192, nb = (D + T) / KVL_KV_BLOCK, n_head = geo[gi].n_head, qw = n_head * l.head_dim;
    void *pool = calloc((size_t)nb, kvl_kv_block_bytes(&l));
    int32_t *ids = malloc((size_t)nb * sizeof(int32_t)), *pos = malloc((size_t)T * sizeof(int32_t));
    int32_t *sq = calloc((size_t)T, sizeof(int32_t));
    float *q = malloc((size_t)T * qw * 4), *o = malloc((size_t)T * qw * 4);
    CHECK(pool && ids && pos && sq && q && o);
    for (int i = 0; i < nb; i++) ids[i] = i;
    fill_kv_pool(pool, nb, &l);
    fill(q, (size_t)T * qw, 1.0f);
    for (int t = 0; t < T; t++) pos[t] = D + t;
    const int32_t *bts[] = {ids};
    struct kvl_attn_args a = {T, q, o, pos, sq, bts, n_head, 0, &l, pool, 0.088f, NULL, 0};
    const double best = time_attention(be, &a, l.n_layer);
    const double flop = 4.0 * T * (D + T / 2.0) * n_head * l.head_dim * l.n_layer; /* QK and PV */
    printf("  attention turn, %s: 32 tokens after %d positions, %d layers: %7.2f ms  %6.1f GFLOP/s\n", geo[gi].name, D,
           l.n_layer, best * 1e3, flop / best * 1e-9);
    free(pool);
    free(ids), free(pos), free(sq), free(q), free(o);
  }
}

/* Decode attention as the scheduler runs it: 16 streams, a token each, every stream's
 * blocks scattered over a pool of the 1.5B's geometry (28 layers, 2 KV heads of 128, 12
 * query heads; bf16); one layer per call, the layers in turn, so that the keys come from
 * memory as in a real step. */
static void perf_attention(kvl_backend_t *be) {
  const struct kvl_kv_layout l = {28, 2, 128, KVL_KV_BF16};
  static const int ctxs[] = {256, 1024};
  for (size_t ci = 0; ci < sizeof(ctxs) / sizeof(ctxs[0]); ci++) {
    const int S = 16, ctx = ctxs[ci], nb = ctx / KVL_KV_BLOCK, n_blocks = S * nb, n_head = 12, qw = n_head * 128;
    void *pool = calloc((size_t)n_blocks, kvl_kv_block_bytes(&l));
    int32_t *ids = malloc((size_t)n_blocks * sizeof(int32_t)), *pos = malloc((size_t)S * sizeof(int32_t));
    int32_t *sq = malloc((size_t)S * sizeof(int32_t));
    const int32_t **bts = malloc((size_t)S * sizeof(*bts));
    float *q = malloc((size_t)S * qw * 4), *o = malloc((size_t)S * qw * 4);
    CHECK(pool && ids && pos && sq && bts && q && o);
    for (int i = 0; i < n_blocks; i++) ids[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) { /* a shuffled pool */
      const int j = (int)(kvl_test_rand(&seed) % (uint64_t)(i + 1)), t = ids[i];
      ids[i] = ids[j], ids[j] = t;
    }
    fill_kv_pool(pool, n_blocks, &l);
    fill(q, (size_t)S * qw, 1.0f);
    for (int s = 0; s < S; s++) bts[s] = ids + (size_t)s * nb, pos[s] = ctx - 1, sq[s] = s;
    struct kvl_attn_args a = {S, q, o, pos, sq, bts, n_head, 0, &l, pool, 0.088f, NULL, 0};
    const double best = time_attention(be, &a, l.n_layer);
    const double bytes = (double)S * ctx * l.n_layer * 2 * l.n_kv_head * l.head_dim * 2;
    printf("  attention decode, 16 streams x %d positions, 28 layers: %7.2f ms  %6.2f GB/s of KV\n", ctx, best * 1e3,
           bytes / best * 1e-9);
    free(pool);
    free(ids), free(pos), free(sq), free(bts), free(q), free(o);
  }
}

/* A prompt's last token through the 0.5B's output head (151936 x 896 Q8_0) on the level
 * and on its exact twin (the prefill chunks' backend): the engine takes the level's. */
static void perf_head(kvl_backend_t *be) {
  const int64_t rows = 151936, cols = 896;
  void *wd = make_weight(KVL_TYPE_Q8_0, rows, cols);
  float *x = malloc(cols * 4), *y = malloc(rows * 4);
  fill(x, cols, 1);
  const struct kvl_weight w = {KVL_TYPE_Q8_0, cols, rows, wd, NULL, NULL};
  kvl_backend_t *ex = kvl_backend_exact(be);
  double s[2] = {1e30, 1e30};
  for (int r = 0; r < 16; r++) /* the two in turn, the fastest of each */
    for (int i = 0; i < 2; i++) {
      const double t0 = now();
      kvl_matmul(i ? ex : be, &w, x, y, 1);
      const double t = now() - t0;
      s[i] = t < s[i] ? t : s[i];
    }
  printf("  output head 151936x896 Q8_0, one token: %8.2f ms here, %8.2f ms on %s\n", s[0] * 1e3, s[1] * 1e3,
         kvl_backend_name(ex));
  free(wd), free(x), free(y);
}

static void perf(kvl_backend_t *be) {
  kvl_cpu_flush_denormals(); /* as every forward pass does: the timings are the engine's */
  printf("\n%s\n", kvl_backend_name(be));
  static const uint32_t pt[] = {KVL_TYPE_F32, KVL_TYPE_Q8_0, KVL_TYPE_Q5_0, KVL_TYPE_Q4_K, KVL_TYPE_Q6_K};
  static const int Ts[] = {1, 4, 8, 16, 64, 256};
  for (size_t i = 0; i < sizeof(pt) / sizeof(pt[0]); i++)
    for (size_t j = 0; j < sizeof(Ts) / sizeof(Ts[0]); j++) {
      int64_t rows = 4864, cols = 1536;
      int T = Ts[j];
      void *wd = make_weight(pt[i], rows, cols);
      struct kvl_wpack slot = {0}; /* as a model's weights have: room for a repacked copy */
      struct kvl_weight w = {pt[i], cols, rows, wd, NULL, &slot};
      float *x = malloc((size_t)T * cols * 4), *y = malloc((size_t)T * rows * 4);
      fill(x, (size_t)T * cols, 1);
      kvl_matmul(be, &w, x, y, T);
      /* the fastest of the calls in 0.4 s: on a shared host the mean mostly measures the
       * neighbours, the minimum the code */
      double t0 = now(), t1 = t0, s = 1e30;
      do {
        kvl_matmul(be, &w, x, y, T);
        const double t2 = now();
        s = t2 - t1 < s ? t2 - t1 : s;
        t1 = t2;
      } while (t1 - t0 < 0.4);
      printf("  matmul %-5s %lldx%lld T=%-4d %8.2f ms  %7.1f GFLOP/s  %6.2f GB/s weights\n", kvl_type_name(pt[i]),
             (long long)rows, (long long)cols, T, s * 1e3, 2.0 * rows * cols * T / s * 1e-9,
             kvl_row_size(pt[i], cols) * rows / s * 1e-9);
      kvl_wpack_release(&slot);
      free(wd); free(x); free(y);
    }
  perf_attention(be);
  perf_attention_turn(be);
  perf_head(be);
}

/* kvl_sgemm (oneDNN; KVL_SGEMM=openblas runs it on OpenBLAS) against a double-precision product,
 * every transpose combination, with alpha, beta and leading dimensions wider than the
 * matrices. */
static void test_sgemm(void) {
  const int64_t M = 37, N = 29, K = 53, pad = 3;
  double worst = 0;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
      float *A = malloc((size_t)(ta ? K : M) * lda * 4), *B = malloc((size_t)(tb ? N : K) * ldb * 4);
      float *C = malloc((size_t)M * ldc * 4), *C0 = malloc((size_t)M * ldc * 4);
      fill(A, (size_t)(ta ? K : M) * lda, 1.0f);
      fill(B, (size_t)(tb ? N : K) * ldb, 1.0f);
      fill(C, (size_t)M * ldc, 1.0f);
      memcpy(C0, C, (size_t)M * ldc * 4);
      kvl_sgemm(ta, tb, M, N, K, 0.5f, A, lda, B, ldb, 2.0f, C, ldc);
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          double acc = 0;
          for (int64_t k = 0; k < K; k++)
            acc += (double)(ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
          const double want = 0.5 * acc + 2.0 * C0[i * ldc + j];
          worst = fmax(worst, fabs(want - C[i * ldc + j]) / (fabs(want) + 1.0));
        }
      for (int64_t i = 0; i < M; i++) /* the padding columns untouched */
        for (int64_t j = N; j < ldc; j++) CHECK(C[i * ldc + j] == C0[i * ldc + j]);
      free(A), free(B), free(C), free(C0);
    }
  printf("  kvl_sgemm (%s), 4 transpose cases: worst relative error %.2e\n",
         getenv("KVL_SGEMM") ? getenv("KVL_SGEMM") : "onednn", worst);
  CHECK(worst < 1e-5);
}

int main(int argc, char **argv) {
  const char *levels[] = {"scalar",     "avx2",         "avx2int8", "avx2int8mm", "avx512",
                          "avx512vnni", "avx512vnnimm", "amx",      "avx512bf16"};
  bool do_perf = argc > 1 && !strcmp(argv[1], "--perf");
  if (!do_perf) setenv("KVL_DECODE_REPACK", "all", 1); /* every decode copy is tested (default: Q5_0's) */
  for (int i = 0; i < (int)(sizeof(levels) / sizeof(levels[0])); i++) {
    kvl_backend_t *be = kvl_backend_cpu_level(levels[i]);
    if (!be) { printf("skip %s (not supported by this processor)\n", levels[i]); continue; }
    if (do_perf) { /* --perf [LEVEL...]: those levels only */
      bool want = argc == 2;
      for (int a = 2; a < argc; a++) want |= !strcmp(argv[a], levels[i]);
      if (want) perf(be);
      continue;
    }
    int before = n_bad;
    test_matmul(be);
    test_elementwise(be);
    test_rope(be);
    test_embed(be);
    test_dequant(be);
    test_attention(be);
    printf("%s %s\n", n_bad == before ? "ok  " : "FAIL", kvl_backend_name(be));
  }
  /* the fp32 twins of the int8 levels (the attention sink, captures): one-token products
   * as dot products, against the reference like every level */
  static const char *int8_levels[] = {"avx512vnni", "avx2int8"};
  for (int i = 0; i < 2 && !do_perf; i++) {
    kvl_backend_t *be = kvl_backend_cpu_level(int8_levels[i]);
    if (!be) continue;
    kvl_backend_t *sb = kvl_backend_fp32(be);
    int before = n_bad;
    CHECK(sb != be && sb->row_dots && !sb->qdot && !sb->qmatmul && !sb->bf16_min_t);
    test_matmul(sb);
    printf("%s %s\n", n_bad == before ? "ok  " : "FAIL", kvl_backend_name(sb));
  }
  if (!do_perf) {
    RUN(test_kv);
    RUN(test_qdot_vec);
    RUN(test_qdot1_avx2);
    RUN(test_qdot1_avx512);
    RUN(test_decode_copies);
    RUN(test_q8_act);
    RUN(test_sgemm);
    mm_cases_free();
    printf("%d cases, %d failed; int8 decode path worst nmse %.2e; bf16 GEMM worst nmse %.2e\n", n_cases, n_bad,
           worst_i8, worst_bf16);
  }
  return TEST_EXIT();
}
