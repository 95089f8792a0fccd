/* test-forward.c — the Qwen2 forward pass on tiny synthetic models: batched runs that
 * mix prefill chunks and decode tokens across block boundaries, on scattered blocks,
 * against one-sequence-at-a-time runs on the reference backend; bf16 KV; keys rotated
 * back from the cache; and refusal of bad models and bad batches by name. */
#include <omp.h>

#include "../kvl_test.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_model.h"

static kvl_model_t *load_tiny(const struct tiny_opts *o, void **buf, char *err, size_t errlen, int *rc_out) {
  size_t len;
  int rc = tiny_qwen2(o, buf, &len);
  KVL_ASSERT(rc == 0);
  kvl_gguf_t *g;
  rc = kvl_gguf_open_mem(*buf, len, &g, err, errlen);
  KVL_ASSERT(rc == 0);
  kvl_model_t *m = NULL;
  rc = kvl_model_from_gguf(g, "tiny", &m, err, errlen);
  if (rc < 0) kvl_gguf_free(g);
  if (rc_out) *rc_out = rc;
  return m;
}

/* The default tiny model (tiny_opts all zero); NULL after a failed CHECK. */
static kvl_model_t *load_default(void **buf) {
  char err[256];
  struct tiny_opts o = {0};
  kvl_model_t *m = load_tiny(&o, buf, err, sizeof(err), NULL);
  CHECK(m != NULL);
  return m;
}

enum { LA = 37, LB = 21 };

/* One sequence alone, one prefill, contiguous blocks, reference backend: the truth. */
static float *solo_logits(kvl_model_t *m, const int32_t *toks, int n, enum kvl_kv_dtype dt, kvl_backend_t *be) {
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, dt);
  void *pool = calloc(8, kvl_kv_block_bytes(&kl));
  int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7}, pos[64], seq[64];
  const int32_t *tables[] = {table};
  for (int i = 0; i < n; i++) { pos[i] = i; seq[i] = 0; }
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  struct kvl_batch b = {n, toks, pos, seq, NULL};
  float *lg = malloc((size_t)n * hp->n_vocab * sizeof(float));
  CHECK_EQ_INT(kvl_model_forward(m, be, &b, &kv, lg, NULL), 0);
  free(pool);
  return lg;
}

static double max_rel(const float *a, const float *b, size_t n) {
  double num = 0, den = 1e-6;
  for (size_t i = 0; i < n; i++) {
    num = fmax(num, fabs((double)a[i] - b[i]));
    den = fmax(den, fabs((double)b[i]));
  }
  return num / den;
}

/* Three engine steps over two sequences on scattered blocks:
 *   step 1: A[0..19] (prefill chunk) + B[0..4]
 *   step 2: A[20..36] (chunk crossing blocks 1 and 2) + B[5] (decode)
 *   step 3: B[6..20] + nothing from A
 * All positions produce logits; each must match the solo reference run. */
static void run_mixed(kvl_model_t *m, enum kvl_kv_dtype dt, double bound) {
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  const int NV = hp->n_vocab;
  int32_t A[LA], B[LB];
  unsigned long long s = 99;
  for (int i = 0; i < LA; i++) A[i] = (int32_t)(kvl_test_rand(&s) % (unsigned)NV);
  for (int i = 0; i < LB; i++) B[i] = (int32_t)(kvl_test_rand(&s) % (unsigned)NV);
  float *refA = solo_logits(m, A, LA, KVL_KV_F32, kvl_backend_ref());
  float *refB = solo_logits(m, B, LB, KVL_KV_F32, kvl_backend_ref());

  struct kvl_kv_layout kl = kvl_model_kv_layout(m, dt);
  void *pool = calloc(12, kvl_kv_block_bytes(&kl));
  int32_t tA[] = {7, 2, 10}, tB[] = {4, 11};
  const int32_t *tables[] = {tA, tB};
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  float *gotA = malloc((size_t)LA * NV * 4), *gotB = malloc((size_t)LB * NV * 4);
  static const struct { int a0, a1, b0, b1; } steps[] = {{0, 20, 0, 5}, {20, 37, 5, 6}, {37, 37, 6, 21}};
  for (int st = 0; st < 3; st++) {
    int32_t toks[64], pos[64], seq[64];
    int T = 0;
    for (int i = steps[st].a0; i < steps[st].a1; i++) { toks[T] = A[i]; pos[T] = i; seq[T++] = 0; }
    for (int i = steps[st].b0; i < steps[st].b1; i++) { toks[T] = B[i]; pos[T] = i; seq[T++] = 1; }
    float *lg = malloc((size_t)T * NV * 4);
    struct kvl_batch b = {T, toks, pos, seq, NULL};
    CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b, &kv, lg, NULL), 0);
    for (int t = 0; t < T; t++)
      memcpy((seq[t] ? gotB : gotA) + (size_t)pos[t] * NV, lg + (size_t)t * NV, (size_t)NV * 4);
    free(lg);
  }
  double ea = max_rel(gotA, refA, (size_t)LA * NV), eb = max_rel(gotB, refB, (size_t)LB * NV);
  printf("  %s KV: max rel error A %.2e, B %.2e (bound %.0e)\n", dt == KVL_KV_BF16 ? "bf16" : "f32 ", ea, eb, bound);
  CHECK(ea < bound && eb < bound);

  /* keys rotated back from the cache are the pre-RoPE keys a capture sees */
  int layer = 1;
  const int KV = hp->n_kv_head * hp->head_dim;
  float *kpre = malloc((size_t)LA * KV * 4);
  float *kp[] = {kpre};
  struct kvl_capture cap = {1, &layer, kp, NULL};
  struct kvl_kv_layout kl32 = kvl_model_kv_layout(m, KVL_KV_F32);
  void *pool2 = calloc(3, kvl_kv_block_bytes(&kl32));
  int32_t t2[] = {2, 0, 1}, pos[LA], seq[LA];
  const int32_t *tables2[] = {t2};
  for (int i = 0; i < LA; i++) { pos[i] = i; seq[i] = 0; }
  struct kvl_kv_view kv2 = {&kl32, pool2, tables2, NULL, 0};
  int8_t want[LA] = {0};
  want[LA - 1] = 1;
  struct kvl_batch b = {LA, A, pos, seq, want};
  float *lg = malloc((size_t)NV * 4);
  CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b, &kv2, lg, &cap), 0);
  CHECK(max_rel(lg, refA + (size_t)(LA - 1) * NV, (size_t)NV) < 1e-4); /* only the wanted row */
  double err = 0;
  float *kr = malloc((size_t)KV * 4);
  for (int p = 0; p < LA; p++) {
    kvl_kv_load(&kl32, pool2, layer, p, t2, kr, NULL);
    kvl_rope(kvl_backend_cpu(), kvl_model_rope(m), kr, &pos[p], 1, hp->n_kv_head, true);
    err = fmax(err, max_rel(kr, kpre + (size_t)p * KV, (size_t)KV));
  }
  printf("  keys un-rotated from the cache vs captured pre-RoPE keys: max rel error %.2e\n", err);
  CHECK(err < 1e-5);
  free(kr); free(lg); free(pool2); free(kpre);
  free(pool); free(gotA); free(gotB); free(refA); free(refB);
}

static void test_mixed_batches(void) {
  void *buf;
  char err[256];
  struct tiny_opts o = {0};
  kvl_model_t *m = load_tiny(&o, &buf, err, sizeof(err), NULL);
  CHECK(m != NULL);
  if (!m) { fprintf(stderr, "%s\n", err); return; }
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  CHECK_EQ_INT(hp->n_layer, 2);
  CHECK_EQ_INT(hp->head_dim, 16);
  CHECK_EQ_INT(hp->n_vocab, 300);
  CHECK(!hp->tied_output);
  run_mixed(m, KVL_KV_F32, 1e-4);
  run_mixed(m, KVL_KV_BF16, 3e-2);
  kvl_model_free(m);
  free(buf);
}

static void test_tied(void) {
  void *buf;
  char err[256];
  struct tiny_opts o = {.tied = 1, .n_layer = 3};
  kvl_model_t *m = load_tiny(&o, &buf, err, sizeof(err), NULL);
  CHECK(m != NULL && kvl_model_hparams(m)->tied_output);
  if (m) run_mixed(m, KVL_KV_F32, 1e-4);
  kvl_model_free(m);
  free(buf);
}

static void expect_refusal(const struct tiny_opts *o, int code, const char *msg) {
  void *buf;
  char err[256] = "";
  int rc;
  kvl_model_t *m = load_tiny(o, &buf, err, sizeof(err), &rc);
  CHECK(m == NULL);
  CHECK_EQ_INT(rc, code);
  CHECK_STR_CONTAINS(err, msg);
  kvl_model_free(m);
  free(buf);
}

static void test_refusals(void) {
  struct tiny_opts o = {.arch = "mamba"};
  expect_refusal(&o, KVL_ENOTSUP, "unsupported architecture 'mamba'");
  o = (struct tiny_opts){.skip_tensor = "blk.1.attn_k.bias"};
  expect_refusal(&o, KVL_EFORMAT, "missing tensor 'blk.1.attn_k.bias'");
  o = (struct tiny_opts){.bad_shape = "blk.0.ffn_up.weight"};
  expect_refusal(&o, KVL_EMISMATCH, "tensor 'blk.0.ffn_up.weight' has shape [64, 257], expected [64, 256]");
  o = (struct tiny_opts){.skip_tensor = "token_embd.weight"};
  expect_refusal(&o, KVL_EFORMAT, "missing tensor 'token_embd.weight'");

  /* a bad batch is refused before anything is written */
  void *buf;
  char err[256];
  o = (struct tiny_opts){0};
  kvl_model_t *m = load_tiny(&o, &buf, err, sizeof(err), NULL);
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  void *pool = calloc(1, kvl_kv_block_bytes(&kl));
  int32_t table[] = {0}, toks[] = {5, 300}, pos[] = {0, 1}, seq[] = {0, 0};
  const int32_t *tables[] = {table};
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  struct kvl_batch b = {2, toks, pos, seq, NULL};
  float lg[2 * 300];
  CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b, &kv, lg, NULL), KVL_EINVAL);
  toks[1] = 6;
  pos[1] = -1;
  CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b, &kv, lg, NULL), KVL_EINVAL);
  unsigned char zero[4096] = {0};
  CHECK(memcmp(pool, zero, sizeof(zero) < kvl_kv_block_bytes(&kl) ? sizeof(zero) : kvl_kv_block_bytes(&kl)) == 0);
  free(pool);
  kvl_model_free(m);
  free(buf);
}

/* The attention sink's rows: once computed for a first token, a prompt that starts with it
 * (and wants no logits there) stores the remembered rows instead of computing them — the
 * same bits, in the cache and in the logits, alone in a batch or with other rows. */
static void test_sink_rows(void) {
  void *buf;
  kvl_model_t *m = load_default(&buf);
  if (!m) return;
  const int NV = kvl_model_hparams(m)->n_vocab, n = 20;
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  const size_t pool_len = 2 * kvl_kv_block_bytes(&kl);
  int32_t toks[20], pos[20], seq[20] = {0}, table[2] = {0, 1};
  int8_t want[20] = {0};
  unsigned long long r = 7;
  for (int i = 0; i < n; i++) toks[i] = (int32_t)(kvl_test_rand(&r) % (unsigned)NV), pos[i] = i;
  want[n - 1] = 1;
  const int32_t *tables[] = {table};
  void *pools[3];
  float lg[3][300];
  for (int run = 0; run < 3; run++) {
    pools[run] = calloc(1, pool_len);
    struct kvl_kv_view kv = {&kl, pools[run], tables, NULL, 0};
    if (run < 2) { /* 0: computes and remembers position 0; 1: stores it */
      struct kvl_batch b = {n, toks, pos, seq, want};
      CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b, &kv, lg[run], NULL), 0);
    } else { /* the sink alone in its batch (nothing left to compute), then the rest */
      struct kvl_batch b0 = {1, toks, pos, seq, want}, b1 = {n - 1, toks + 1, pos + 1, seq + 1, want + 1};
      CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b0, &kv, NULL, NULL), 0);
      CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_cpu(), &b1, &kv, lg[run], NULL), 0);
    }
    CHECK_EQ_INT((int)kvl_model_sink_hits(m), run); /* run 0 computed it, 1 and 2 stored it */
  }
  CHECK(memcmp(pools[0], pools[1], pool_len) == 0 && memcmp(pools[0], pools[2], pool_len) == 0);
  CHECK(memcmp(lg[0], lg[1], sizeof(lg[0])) == 0 && memcmp(lg[0], lg[2], sizeof(lg[0])) == 0);
  for (int run = 0; run < 3; run++) free(pools[run]);
  kvl_model_free(m);
  free(buf);
}

/* A forward pass flushes denormals on its thread and on every thread of its OpenMP team
 * (kvl_cpu_flush_denormals): a denormal operand reads as zero (DAZ), and a product
 * below the normal range is zero (FTZ). Run first, with the team started before any
 * forward pass, so that its threads cannot have copied the setting when they started. */
static int denormal_arithmetic(void) {
  volatile float tiny = 1e-40f, small = 1e-20f; /* a denormal; a normal whose square is one */
  return (tiny * 1e10f != 0.0f) + (small * small != 0.0f); /* IEEE: 1e-30 and 1e-40 */
}
static int team_denormal_arithmetic(int *threads) {
  int bad = 0, n = 0;
#pragma omp parallel reduction(+ : bad, n)
  bad += denormal_arithmetic(), n += 1;
  *threads = n;
  return bad;
}
static void test_denormals(void) {
  int threads;
  CHECK_EQ_INT(team_denormal_arithmetic(&threads), 2 * threads); /* starts the team: IEEE still */
  void *buf;
  kvl_model_t *m = load_default(&buf);
  if (!m) return;
  const int32_t toks[] = {1, 2, 3};
  float *lg = solo_logits(m, toks, 3, KVL_KV_F32, kvl_backend_cpu());
  CHECK_EQ_INT(denormal_arithmetic(), 0);
  CHECK_EQ_INT(team_denormal_arithmetic(&threads), 0);
  CHECK_EQ_INT(threads, omp_get_max_threads());
  free(lg);
  kvl_model_free(m);
  free(buf);
}

int main(void) {
  /* compare exact arithmetic: the int8-activation decode path has its own bounds
   * (test-backend-ops, and the real-model decode goldens) */
  setenv("KVL_DECODE", "exact", 1);
  RUN(test_denormals); /* first: see there */
  RUN(test_mixed_batches);
  RUN(test_tied);
  RUN(test_refusals);
  RUN(test_sink_rows);
  return TEST_EXIT();
}
