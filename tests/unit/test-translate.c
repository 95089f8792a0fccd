/* test-translate.c — applying translators to spans on the tiny synthetic model:
 * identity made hard to fake (identity maps, a random orthogonal map on the source side
 * composed with its transpose, shifted target positions), the sgemm kernel against the
 * scalar reference on a random cross-shape translator, refusals by name, and lines of two
 * pools extended by translation with their provenance (kvl_line_translate). */
#include "../kvl_test.h"
#include "../tiny_fingerprint.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_model.h"
#include "kvl_kvpool.h"
#include "kvl_translator.h"

enum { NP = 40, NC = 10, SHIFT = 7, NBLK = 16 };

static kvl_model_t *g_m;
static void *g_buf;
static struct kvl_model_fingerprint g_fp;
static struct kvl_kv_layout g_kl;
static void *g_pool;           /* NBLK blocks shared by every cache below */
static int32_t P[NP], C[NC];   /* prefix and continuation tokens */
static float *g_kpre[2], *g_v[2]; /* captured during A's prefill, [NP][w] per layer */
static float *g_refA;          /* A's continuation logits [NC][n_vocab] */
static int g_w, g_nv;

/* Four caches on scattered blocks of one pool. */
static int32_t tA[] = {5, 1, 7, 2}, tB[] = {0, 3, 6, 4}, tX[] = {8, 11, 9, 10}, tE[] = {12, 15, 13, 14};

static double max_rel(const float *a, const float *b, size_t n) {
  double num = 0, den = 1e-6;
  for (size_t i = 0; i < n; i++) {
    num = fmax(num, fabs((double)a[i] - b[i]));
    den = fmax(den, fabs((double)b[i]));
  }
  return num / den;
}

static void clear_cache(const int32_t *table) {
  size_t bb = kvl_kv_block_bytes(&g_kl);
  for (int i = 0; i < 4; i++) memset((char *)g_pool + (size_t)table[i] * bb, 0, bb);
}

/* Forward n tokens at positions pos0.. of the cache `table`; returns all logits. */
static float *run(const int32_t *table, const int32_t *toks, int n, int32_t pos0, const struct kvl_capture *cap) {
  int32_t pos[64], seq[64];
  for (int i = 0; i < n; i++) { pos[i] = pos0 + i; seq[i] = 0; }
  const int32_t *tables[] = {table};
  struct kvl_kv_view kv = {&g_kl, g_pool, tables, NULL, 0};
  struct kvl_batch b = {n, toks, pos, seq, NULL};
  float *lg = malloc((size_t)n * g_nv * sizeof(float));
  CHECK_EQ_INT(kvl_model_forward(g_m, kvl_backend_cpu(), &b, &kv, lg, cap), 0);
  return lg;
}

static int translate(const kvl_translator_t *t, const int32_t *src_table, const int32_t *dst_table, int32_t dst0,
                     bool ref) {
  int32_t sp[NP], dp[NP];
  for (int i = 0; i < NP; i++) { sp[i] = i; dp[i] = dst0 + i; }
  const struct kvl_rope *r = kvl_model_rope(g_m);
  struct kvl_translate_span s = {&g_kl, g_pool, src_table, r, sp, &g_kl, g_pool, dst_table, r, dp, NP, NULL, NULL, 0, 0};
  char err[256] = "";
  int rc = ref ? kvl_translator_apply_ref(t, &s, err, sizeof(err)) : kvl_translator_apply(t, &s, err, sizeof(err));
  if (rc < 0) fprintf(stderr, "apply: %s\n", err);
  return rc;
}

/* A translator of the tiny model to itself, layer ℓ from layer ℓ, with these maps
 * (w×w; the intercept row, when affine, is 0). */
static kvl_translator_t *make_self(const float *kmap, const float *vmap, bool affine) {
  kvl_translator_t *t;
  char err[256];
  CHECK_EQ_INT(kvl_translator_new(&g_fp, &g_fp, affine, &t, err, sizeof(err)), 0);
  int rows = g_w + affine;
  float *k = calloc((size_t)rows * g_w, 4), *v = calloc((size_t)rows * g_w, 4);
  memcpy(k, kmap, (size_t)g_w * g_w * 4);
  memcpy(v, vmap, (size_t)g_w * g_w * 4);
  for (int32_t l = 0; l < g_fp.n_layer; l++) {
    CHECK_EQ_INT(kvl_translator_set_map(t, l, KVL_TRANSLATOR_K, &l, 1, k), 0);
    CHECK_EQ_INT(kvl_translator_set_map(t, l, KVL_TRANSLATOR_V, &l, 1, v), 0);
  }
  free(k);
  free(v);
  return t;
}

/* Translate A's prefix into a cleared cache with t, run the continuation there, and
 * return the max relative error of its logits against A's own continuation. */
static double continuation_error(const kvl_translator_t *t, const int32_t *src_table, const int32_t *dst_table) {
  clear_cache(dst_table);
  CHECK_EQ_INT(translate(t, src_table, dst_table, 0, false), 0);
  float *lg = run(dst_table, C, NC, NP, NULL);
  double e = max_rel(lg, g_refA, (size_t)NC * g_nv);
  free(lg);
  return e;
}

static void setup(void) {
  size_t len;
  struct tiny_opts o = {0};
  KVL_ASSERT(tiny_qwen2(&o, &g_buf, &len) == 0);
  kvl_gguf_t *g;
  char err[256];
  KVL_ASSERT(kvl_gguf_open_mem(g_buf, len, &g, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_model_from_gguf(g, "tiny", &g_m, err, sizeof(err)) == 0);
  const struct kvl_model_hparams *hp = kvl_model_hparams(g_m);
  tiny_fingerprint(g_m, &g_fp);
  g_w = hp->n_kv_head * hp->head_dim;
  g_nv = hp->n_vocab;
  g_kl = kvl_model_kv_layout(g_m, KVL_KV_F32);
  g_pool = calloc(NBLK, kvl_kv_block_bytes(&g_kl));
  unsigned long long s = 4242;
  for (int i = 0; i < NP; i++) P[i] = (int32_t)(kvl_test_rand(&s) % (unsigned)g_nv);
  for (int i = 0; i < NC; i++) C[i] = (int32_t)(kvl_test_rand(&s) % (unsigned)g_nv);
  /* cache A: the prefix natively, capturing pre-RoPE keys and values */
  int layers[] = {0, 1};
  for (int l = 0; l < 2; l++) {
    g_kpre[l] = malloc((size_t)NP * g_w * 4);
    g_v[l] = malloc((size_t)NP * g_w * 4);
  }
  struct kvl_capture cap = {2, layers, g_kpre, g_v};
  free(run(tA, P, NP, 0, &cap));
  g_refA = run(tA, C, NC, NP, NULL);
}

static void test_identity(void) {
  char err[256];
  for (int affine = 0; affine < 2; affine++) {
    kvl_translator_t *t;
    CHECK_EQ_INT(kvl_translator_identity(&g_fp, affine, &t, err, sizeof(err)), 0);
    double e = continuation_error(t, tA, tB);
    printf("  (a) identity%s: continuation logits vs native, max rel error %.2e\n", affine ? " affine" : "", e);
    CHECK(e < 1e-4);
    kvl_translator_free(t);
  }
  /* the comparison can fail: a translator that halves the keys changes the logits */
  float *half = calloc((size_t)g_w * g_w, 4), *eye = calloc((size_t)g_w * g_w, 4);
  for (int i = 0; i < g_w; i++) { half[i * g_w + i] = 0.5f; eye[i * g_w + i] = 1.0f; }
  kvl_translator_t *t = make_self(half, eye, false);
  double e = continuation_error(t, tA, tB);
  printf("  control: keys halved, max rel error %.2e (must be large)\n", e);
  CHECK(e > 1e-3);
  kvl_translator_free(t);
  /* and so can an empty cache */
  clear_cache(tB);
  float *lg = run(tB, C, NC, NP, NULL);
  e = max_rel(lg, g_refA, (size_t)NC * g_nv);
  printf("  control: empty cache, max rel error %.2e (must be large)\n", e);
  CHECK(e > 1e-3);
  free(lg);
  free(half);
  free(eye);
}

/* A random orthogonal w×w matrix (modified Gram–Schmidt in double, rows). */
static void random_orthogonal(float *q, int w, unsigned long long seed) {
  double *a = malloc((size_t)w * w * sizeof(double));
  for (int i = 0; i < w * w; i++) a[i] = kvl_test_randf(&seed);
  for (int i = 0; i < w; i++) {
    for (int j = 0; j < i; j++) {
      double d = 0;
      for (int k = 0; k < w; k++) d += a[i * w + k] * a[j * w + k];
      for (int k = 0; k < w; k++) a[i * w + k] -= d * a[j * w + k];
    }
    double nn = 0;
    for (int k = 0; k < w; k++) nn += a[i * w + k] * a[i * w + k];
    nn = sqrt(nn);
    for (int k = 0; k < w; k++) a[i * w + k] /= nn;
  }
  for (int i = 0; i < w * w; i++) q[i] = (float)a[i];
  free(a);
}

static void test_orthogonal(void) {
  int w = g_w;
  float *q = malloc((size_t)w * w * 4), *qt = malloc((size_t)w * w * 4), *qqt = malloc((size_t)w * w * 4);
  random_orthogonal(q, w, 777);
  for (int i = 0; i < w; i++)
    for (int j = 0; j < w; j++) qt[i * w + j] = q[j * w + i];
  double off = 0;
  for (int i = 0; i < w; i++)
    for (int j = 0; j < w; j++) {
      float acc = 0; /* in float: not exactly I */
      for (int k = 0; k < w; k++) acc += q[i * w + k] * qt[k * w + j];
      qqt[i * w + j] = acc;
      off = fmax(off, fabs(acc - (i == j)));
    }
  printf("  Q·Qᵀ in float: max |Q·Qᵀ - I| = %.2e\n", off);
  CHECK(off > 0 && off < 1e-5);
  /* (b1) two translations: A --Q--> X (a different cache) --Qᵀ--> B */
  kvl_translator_t *tq = make_self(q, q, false), *tqt = make_self(qt, qt, false);
  clear_cache(tX);
  CHECK_EQ_INT(translate(tq, tA, tX, 0, false), 0);
  float *ka = malloc((size_t)w * 4), *kx = malloc((size_t)w * 4);
  double diff = 0;
  for (int p = 0; p < NP; p++) {
    kvl_kv_load(&g_kl, g_pool, 1, p, tA, ka, NULL);
    kvl_kv_load(&g_kl, g_pool, 1, p, tX, kx, NULL);
    diff = fmax(diff, max_rel(kx, ka, (size_t)w));
  }
  printf("  source side rotated by Q: keys differ from native by %.2e (must be large)\n", diff);
  CHECK(diff > 0.1);
  double e = continuation_error(tqt, tX, tB);
  printf("  (b) Q then Qᵀ: continuation logits vs native, max rel error %.2e\n", e);
  CHECK(e < 1e-4);
  /* (b2) one translator with maps Q·Qᵀ, linear and affine (intercept 0) */
  for (int affine = 0; affine < 2; affine++) {
    kvl_translator_t *t = make_self(qqt, qqt, affine);
    e = continuation_error(t, tA, tB);
    printf("  (b) maps Q·Qᵀ%s: continuation logits vs native, max rel error %.2e\n", affine ? " affine" : "", e);
    CHECK(e < 1e-4);
    kvl_translator_free(t);
  }
  kvl_translator_free(tq);
  kvl_translator_free(tqt);
  free(ka);
  free(kx);
  free(q);
  free(qt);
  free(qqt);
}

/* (c) A's positions 0..39 to E's 7..46: E's keys rotated back at the new positions are
 * the pre-RoPE keys captured during A's forward, E's stored keys are those rotated at
 * the new positions, values unchanged; and A's own keys rotated back equal the capture. */
static void test_shifted(void) {
  char err[256];
  kvl_translator_t *t;
  CHECK_EQ_INT(kvl_translator_identity(&g_fp, false, &t, err, sizeof(err)), 0);
  clear_cache(tE);
  CHECK_EQ_INT(translate(t, tA, tE, SHIFT, false), 0);
  int w = g_w, nh = g_kl.n_kv_head;
  const struct kvl_rope *r = kvl_model_rope(g_m);
  float *k = malloc((size_t)w * 4), *v = malloc((size_t)w * 4), *kr = malloc((size_t)w * 4);
  double e_un = 0, e_rot = 0, e_v = 0, e_a = 0;
  for (int l = 0; l < 2; l++)
    for (int32_t p = 0; p < NP; p++) {
      int32_t q = p + SHIFT;
      const float *kp = g_kpre[l] + (size_t)p * w, *vp = g_v[l] + (size_t)p * w;
      kvl_kv_load(&g_kl, g_pool, l, q, tE, k, v);
      memcpy(kr, kp, (size_t)w * 4); /* captured pre-RoPE key rotated at the new position */
      kvl_rope_ref(r, kr, &q, 1, nh, false);
      e_rot = fmax(e_rot, max_rel(k, kr, (size_t)w));
      e_v = fmax(e_v, max_rel(v, vp, (size_t)w));
      kvl_rope_ref(r, k, &q, 1, nh, true);
      e_un = fmax(e_un, max_rel(k, kp, (size_t)w));
      kvl_kv_load(&g_kl, g_pool, l, p, tA, k, NULL);
      kvl_rope_ref(r, k, &p, 1, nh, true);
      e_a = fmax(e_a, max_rel(k, kp, (size_t)w));
    }
  printf("  (c) shifted +%d: un-rotated keys vs captured pre-RoPE %.2e, stored keys vs captured rotated at "
         "the new positions %.2e, values %.2e; native keys un-rotated vs captured %.2e\n",
         SHIFT, e_un, e_rot, e_v, e_a);
  CHECK(e_un < 1e-5 && e_rot < 1e-5 && e_v < 1e-5 && e_a < 1e-5);
  /* the target positions really moved: position 0..6 of E untouched, and keys at 7
   * differ from the unshifted translation's keys at 7 (a different rotation) */
  kvl_kv_load(&g_kl, g_pool, 0, 3, tE, k, v);
  double z = 0;
  for (int i = 0; i < w; i++) z = fmax(z, fabs(k[i]) + fabs(v[i]));
  CHECK(z == 0);
  kvl_kv_load(&g_kl, g_pool, 0, SHIFT, tE, k, NULL);
  kvl_kv_load(&g_kl, g_pool, 0, SHIFT, tA, kr, NULL);
  CHECK(max_rel(k, kr, (size_t)w) > 1e-2);
  free(k);
  free(v);
  free(kr);
  kvl_translator_free(t);
}

/* The sgemm kernel against the scalar reference: a random cross-shape translator
 * (source 2 layers × 2×16, target 3 layers × 2×8, ν = 2, affine) over 300 scattered
 * positions (more than one chunk), random source cache. */
static void test_kernel_vs_ref(void) {
  struct kvl_model_fingerprint dfp = g_fp;
  dfp.n_layer = 3;
  dfp.head_dim = 8;
  dfp.rope_theta = 1e6;
  snprintf(dfp.name, sizeof(dfp.name), "tiny-target");
  char err[256];
  kvl_translator_t *t;
  CHECK_EQ_INT(kvl_translator_new(&g_fp, &dfp, true, &t, err, sizeof(err)), 0);
  int ws = g_w, wd = 16, rows = 2 * ws + 1;
  unsigned long long s = 31337;
  float *map = malloc((size_t)rows * wd * 4);
  for (int32_t l = 0; l < 3; l++)
    for (int which = 0; which < 2; which++) {
      int32_t src[2] = {(l + which) % 2, (l + which + 1) % 2};
      for (int i = 0; i < rows * wd; i++) map[i] = kvl_test_randf(&s) * 0.25f;
      CHECK_EQ_INT(kvl_translator_set_map(t, l, (enum kvl_translator_kv)which, src, 2, map), 0);
    }
  enum { N = 300, NB = 20 };
  struct kvl_kv_layout sl = g_kl, dl = {3, 2, 8, KVL_KV_F32};
  void *spool = calloc(NB, kvl_kv_block_bytes(&sl));
  void *d1 = calloc(NB + 1, kvl_kv_block_bytes(&dl)), *d2 = calloc(NB + 1, kvl_kv_block_bytes(&dl));
  int32_t stab[NB], dtab[NB + 1], sp[N], dp[N], seq0 = 0;
  for (int i = 0; i < NB; i++) stab[i] = (i * 7) % NB;
  for (int i = 0; i <= NB; i++) dtab[i] = NB - i;
  const int32_t *stabs[] = {stab};
  float *k = malloc((size_t)ws * 4), *v = malloc((size_t)ws * 4);
  for (int l = 0; l < 2; l++)
    for (int32_t p = 0; p < NB * KVL_KV_BLOCK; p++) {
      for (int i = 0; i < ws; i++) { k[i] = kvl_test_randf(&s) * 3; v[i] = kvl_test_randf(&s); }
      kvl_kv_store(&sl, spool, l, 1, k, v, &p, &seq0, stabs);
    }
  for (int i = 0; i < N; i++) { sp[i] = (i * 13 + 5) % (NB * KVL_KV_BLOCK); dp[i] = i + 11; }
  struct kvl_rope dr;
  CHECK_EQ_INT(kvl_rope_init(&dr, 8, 1e6f), 0);
  struct kvl_translate_span sp1 = {&sl, spool, stab, kvl_model_rope(g_m), sp, &dl, d1, dtab, &dr, dp, N, NULL, NULL, 0, 0};
  struct kvl_translate_span sp2 = sp1;
  sp2.dst_base = d2;
  CHECK_EQ_INT(kvl_translator_apply(t, &sp1, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_apply_ref(t, &sp2, err, sizeof(err)), 0);
  size_t nf = (NB + 1) * kvl_kv_block_bytes(&dl) / 4;
  double e = max_rel(d1, d2, nf), mag = 0;
  for (size_t i = 0; i < nf; i++) mag = fmax(mag, fabs(((float *)d2)[i]));
  printf("  kernel vs reference (ν = 2, affine, 2×2×16 -> 3×2×8, %d positions): max rel error %.2e (|max| %.2f)\n",
         N, e, mag);
  CHECK(e < 1e-5 && mag > 1);
  /* the bf16 products (kvl_translator_use_bf16): every input and map entry rounded to bf16
   * (relative error <= 2^-9 each), fp32 accumulation. RMS relative error expected
   * ~2^-9 = 2e-3; bounded at 8e-3 RMS and 3e-2 at the worst element. One map reads its
   * sources in order (a strided view), the other reversed (gathered): both paths run. */
  if (kvl_gemm_bf16_usable()) {
    void *d3 = calloc(NB + 1, kvl_kv_block_bytes(&dl));
    struct kvl_translate_span sp3 = sp1;
    sp3.dst_base = d3;
    CHECK_EQ_INT(kvl_translator_use_bf16(t, true, err, sizeof(err)), 0);
    CHECK(kvl_translator_is_bf16(t));
    CHECK_EQ_INT(kvl_translator_apply(t, &sp3, err, sizeof(err)), 0);
    double d2s = 0, r2s = 0;
    for (size_t i = 0; i < nf; i++) {
      double a = ((float *)d3)[i], b = ((float *)d2)[i];
      d2s += (a - b) * (a - b), r2s += b * b;
    }
    double eb = max_rel(d3, d2, nf), rms = sqrt(d2s / r2s);
    printf("  bf16 products vs reference: RMS relative error %.2e, max rel error %.2e\n", rms, eb);
    CHECK(rms < 8e-3 && eb < 3e-2 && rms > 0);
    /* setting a map returns the translator to fp32 (its bf16 copy would be stale) */
    CHECK_EQ_INT(kvl_translator_set_map(t, 0, KVL_TRANSLATOR_K, (int32_t[]){0, 1}, 2, map), 0);
    CHECK(!kvl_translator_is_bf16(t));
    free(d3);
  } else {
    printf("  bf16 products: this processor has no bf16 GEMM (AVX512-BF16 or AMX); use_bf16 refuses\n");
    CHECK_EQ_INT(kvl_translator_use_bf16(t, true, err, sizeof(err)), KVL_ENOTSUP);
    CHECK(!kvl_translator_is_bf16(t));
  }
  /* auto precision (kvl_translator_pick_precision): the faster of the two timed, bf16 kept
   * only if it won; without a bf16 GEMM nothing is timed and fp32 stays */
  double mf = -1, mb = -1;
  CHECK_EQ_INT(kvl_translator_pick_precision(t, &mf, &mb, err, sizeof(err)), 0);
  printf("  precision probe: fp32 %.3f ms, bf16 %.3f ms -> %s\n", mf, mb, kvl_translator_is_bf16(t) ? "bf16" : "fp32");
  if (kvl_gemm_bf16_usable()) CHECK(mf > 0 && mb > 0 && kvl_translator_is_bf16(t) == (mb < mf));
  else CHECK(mf == 0 && mb == 0 && !kvl_translator_is_bf16(t));
  free(k);
  free(v);
  free(map);
  free(spool);
  free(d1);
  free(d2);
  kvl_translator_free(t);
}

/* kvl_kv_load_unrotated_bf16 (the bf16 path's source rows) gives the bits of
 * kvl_kv_load + kvl_rope_tab(inverse) + rounding to bf16, on bf16 and fp32 caches. */
static void test_load_unrotated(void) {
  struct kvl_rope r;
  CHECK_EQ_INT(kvl_rope_init(&r, 16, 1e6f), 0);
  unsigned long long s = 99;
  int bad = 0, n = 0;
  for (int dt = 0; dt < 2; dt++) {
    struct kvl_kv_layout l = {2, 3, 16, dt ? KVL_KV_F32 : KVL_KV_BF16};
    const int w = 3 * 16;
    void *pool = calloc(4, kvl_kv_block_bytes(&l));
    int32_t table[4] = {2, 0, 3, 1}, seq0 = 0;
    const int32_t *tabs[] = {table};
    float k[48], v[48], c[8], sn[8];
    uint16_t kb[48], vb[48];
    for (int layer = 0; layer < 2; layer++)
      for (int32_t p = 0; p < 64; p++) {
        for (int i = 0; i < w; i++) { k[i] = kvl_test_randf(&s) * 4; v[i] = kvl_test_randf(&s); }
        kvl_kv_store(&l, pool, layer, 1, k, v, &p, &seq0, tabs);
      }
    for (int layer = 0; layer < 2; layer++)
      for (int32_t p = 0; p < 64; p += 5) {
        kvl_rope_table(&r, p * 37 + 1, c, sn);
        kvl_kv_load(&l, pool, layer, p, table, k, v);
        kvl_rope_tab(c, sn, k, 1, 3, 16, true);
        kvl_kv_load_unrotated_bf16(&l, pool, layer, p, table, c, sn, kb, vb);
        for (int i = 0; i < w; i++, n++)
          bad += kb[i] != kvl_fp32_to_bf16(k[i]) || vb[i] != kvl_fp32_to_bf16(v[i]);
      }
    free(pool);
  }
  printf("  un-rotated bf16 source rows: %d of %d elements differ from load + inverse RoPE + rounding\n", bad, n);
  CHECK(bad == 0 && n > 1000);
}

static void test_refusals(void) {
  char err[256];
  kvl_translator_t *t;
  CHECK_EQ_INT(kvl_translator_identity(&g_fp, false, &t, err, sizeof(err)), 0);
  int32_t pos[2] = {0, 1};
  const struct kvl_rope *r = kvl_model_rope(g_m);
  struct kvl_kv_layout bad = g_kl;
  bad.n_layer = 3;
  void *dst = calloc(1, kvl_kv_block_bytes(&g_kl));
  int32_t dt[] = {0};
  struct kvl_translate_span s = {&bad, g_pool, tA, r, pos, &g_kl, dst, dt, r, pos, 2, NULL, NULL, 0, 0};
  err[0] = 0;
  CHECK_EQ_INT(kvl_translator_apply(t, &s, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "source n_layer: translator 2, layout 3");
  printf("  refused: %s\n", err);
  bad = g_kl;
  bad.head_dim = 8;
  s.src_layout = &g_kl;
  s.dst_layout = &bad;
  CHECK_EQ_INT(kvl_translator_apply_ref(t, &s, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "target kv width: translator 32, layout 16");
  printf("  refused: %s\n", err);
  s.dst_layout = &g_kl;
  int32_t negpos[2] = {0, -1};
  s.dst_pos = negpos;
  CHECK_EQ_INT(kvl_translator_apply(t, &s, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "negative position");
  s.dst_pos = pos;
  kvl_translator_free(t);
  /* a target with a k-norm architecture */
  struct kvl_model_fingerprint g3 = g_fp;
  snprintf(g3.architecture, sizeof(g3.architecture), "gemma3");
  CHECK_EQ_INT(kvl_translator_identity(&g3, false, &t, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_apply(t, &s, err, sizeof(err)), KVL_ENOTSUP);
  CHECK_STR_CONTAINS(err, "target architecture 'gemma3'");
  printf("  refused: %s\n", err);
  kvl_translator_free(t);
  /* a map not set */
  CHECK_EQ_INT(kvl_translator_new(&g_fp, &g_fp, false, &t, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_apply(t, &s, err, sizeof(err)), KVL_ENOENT);
  CHECK_STR_CONTAINS(err, "target layer 0: K map not set");
  kvl_translator_free(t);
  /* nothing was written by any refusal */
  size_t nf = kvl_kv_block_bytes(&g_kl) / 4;
  double z = 0;
  for (size_t i = 0; i < nf; i++) z = fmax(z, fabs(((float *)dst)[i]));
  CHECK(z == 0);
  free(dst);
}

/* Forward n tokens at positions pos0.. of a pool line; returns all logits. */
static float *run_line(kvl_line_t *l, const int32_t *toks, int n, int32_t pos0) {
  int32_t pos[64], seq[64];
  for (int i = 0; i < n; i++) { pos[i] = pos0 + i; seq[i] = 0; }
  const int32_t *tables[] = {kvl_line_block_table(l)};
  kvl_pool_t *p = kvl_line_pool(l);
  struct kvl_kv_view kv = {kvl_pool_layout(p), kvl_pool_base(p), tables, NULL, 0};
  struct kvl_batch b = {n, toks, pos, seq, NULL};
  float *lg = malloc((size_t)n * g_nv * sizeof(float));
  CHECK_EQ_INT(kvl_model_forward(g_m, kvl_backend_cpu(), &b, &kv, lg, NULL), 0);
  return lg;
}

/* Two pools of the same model (a model "translated" to itself): the source line prefills
 * natively, the target line is extended by translation with writer 3, then continues
 * natively; logits equal the native continuation; provenance says who wrote what. */
static void test_pool_lines(void) {
  char err[256];
  struct kvl_pool_config c = {.layout = g_kl, .hot_bytes = 8 * kvl_kv_block_bytes(&g_kl),
                              .cold_bytes = 8 * kvl_kv_block_bytes(&g_kl)};
  kvl_pool_t *ps, *pd;
  CHECK_EQ_INT(kvl_pool_new(&c, &ps), 0);
  CHECK_EQ_INT(kvl_pool_new(&c, &pd), 0);
  kvl_line_t *ls = kvl_line_new(ps), *ld = kvl_line_new(pd);
  CHECK_EQ_INT(kvl_line_append(ls, P, NP, KVL_WRITER_NATIVE), 0);
  free(run_line(ls, P, NP, 0));
  kvl_translator_t *t;
  CHECK_EQ_INT(kvl_translator_identity(&g_fp, true, &t, err, sizeof(err)), 0);
  const struct kvl_rope *r = kvl_model_rope(g_m);
  /* refusals leave the target as it was */
  CHECK_EQ_INT(kvl_line_translate(ld, ls, t, NULL, KVL_WRITER_NATIVE, 0, NP, r, r, err, sizeof(err)), KVL_EINVAL);
  CHECK_EQ_INT(kvl_line_translate(ld, ls, t, NULL, 3, 5, NP, r, r, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "starts at 5");
  CHECK_EQ_INT(kvl_line_translate(ld, ls, t, NULL, 3, 0, NP + 1, r, r, err, sizeof(err)), KVL_EINVAL);
  CHECK_EQ_INT(kvl_line_len(ld), 0);
  /* in two pieces, to show spans chain */
  CHECK_EQ_INT(kvl_line_translate(ld, ls, t, NULL, 3, 0, 17, r, r, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_line_translate(ld, ls, t, NULL, 3, 17, NP, r, r, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_line_len(ld), NP);
  CHECK_EQ_INT(kvl_line_writer(ld, 0), 3);
  CHECK_EQ_INT(kvl_line_writer(ld, NP - 1), 3);
  CHECK(memcmp(kvl_line_tokens(ld), P, sizeof(P)) == 0);
  CHECK_EQ_INT(kvl_line_append(ld, C, NC, KVL_WRITER_NATIVE), 0);
  float *lg = run_line(ld, C, NC, NP);
  double e = max_rel(lg, g_refA, (size_t)NC * g_nv);
  if (e >= 1e-5) fprintf(stderr, "pool-line identity: max rel %.3g\n", e);
  CHECK(e < 1e-5);
  free(lg);
  CHECK_EQ_INT(kvl_line_writer(ld, NP), KVL_WRITER_NATIVE);
  /* a translated position is never a translation source */
  kvl_line_t *l2 = kvl_line_new(ps);
  CHECK_EQ_INT(kvl_line_translate(l2, ld, t, NULL, 4, 0, NP, r, r, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "translated positions");
  CHECK_EQ_INT(kvl_line_len(l2), 0);
  CHECK_EQ_INT(kvl_pool_check(ps, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_pool_check(pd, err, sizeof(err)), 0);
  /* the translated blocks are indexed apart from native ones */
  kvl_line_commit(ld);
  kvl_line_t *l3 = kvl_line_new(pd);
  struct kvl_prefix_hit hit;
  CHECK_EQ_INT(kvl_line_attach_prefix(l3, P, NP, KVL_REUSE_NATIVE_ONLY, &hit), 0);
  CHECK_EQ_INT(hit.n_tokens, 0);
  kvl_line_free(l3);
  l3 = kvl_line_new(pd);
  CHECK_EQ_INT(kvl_line_attach_prefix(l3, P, NP, KVL_REUSE_ANY, &hit), 0);
  CHECK_EQ_INT(hit.n_translated, 32);
  kvl_line_free(l3);
  kvl_line_free(l2);
  kvl_line_free(ls);
  kvl_line_free(ld);
  kvl_translator_free(t);
  kvl_pool_free(ps);
  kvl_pool_free(pd);
}

int main(void) {
  setenv("KVL_DECODE", "exact", 1);
  setup();
  RUN(test_identity);
  RUN(test_orthogonal);
  RUN(test_shifted);
  RUN(test_kernel_vs_ref);
  RUN(test_load_unrotated);
  RUN(test_refusals);
  RUN(test_pool_lines);
  for (int l = 0; l < 2; l++) { free(g_kpre[l]); free(g_v[l]); }
  free(g_refA);
  free(g_pool);
  kvl_model_free(g_m);
  free(g_buf);
  return TEST_EXIT();
}
