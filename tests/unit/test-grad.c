/* test-grad.c — every backward op against central finite differences, and an end-to-end
 * gradient check through a tiny Qwen2 model: loss = KL(target || model) on T positions
 * that attend to a prefix whose K and V come from per-layer linear maps of "source"
 * activations (what stage-2 distillation trains); d loss / d maps from the backward
 * equals the finite differences.
 *
 * Loss for an op: L = Σ w ⊙ out with fixed random w (so dout = w), accumulated in double;
 * each checked entry is perturbed by ±eps. Passes when |analytic - numeric| <= tol ·
 * max(|analytic|, |numeric|, 2% of the largest analytic entry) for every entry checked:
 * the forward runs in fp32, so entries far below the tensor's scale are round-off. */
#include <math.h>

#include "../kvl_test.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_model.h"
#include "kvl_train.h"

static unsigned long long g_rs = 99;
static float frand(void) { return (float)((double)(kvl_test_rand(&g_rs) % 2000001) / 1e6 - 1.0); }
static void fill(float *x, size_t n, float s) {
  for (size_t i = 0; i < n; i++) x[i] = frand() * s;
}

static double dotw(const float *out, const float *w, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)out[i] * w[i];
  return s;
}

/* compare analytic g[i] with the numeric derivative of loss() in x[i] for `n_check` entries */
static int check_grad(const char *what, float *x, size_t n, const float *g, double (*loss)(void *), void *ctx,
                      float eps, double tol, int n_check) {
  int bad = 0;
  double worst = 0, gmax = 0;
  for (size_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(g[i]));
  for (int c = 0; c < n_check; c++) {
    size_t i = n_check >= (int)n ? (size_t)c % n : (size_t)(kvl_test_rand(&g_rs) % n);
    if (n_check >= (int)n && c >= (int)n) break;
    float keep = x[i];
    x[i] = keep + eps;
    double lp = loss(ctx);
    x[i] = keep - eps;
    double lm = loss(ctx);
    x[i] = keep;
    double num = (lp - lm) / (2.0 * eps), an = g[i];
    /* fp32 forward: round-off of the loss, divided by 2 eps, is the floor */
    double den = fmax(fmax(fabs(num), fabs(an)), 2e-2 * gmax);
    double rel = fabs(num - an) / den;
    worst = rel > worst ? rel : worst;
    if (rel > tol) {
      if (bad < 5) fprintf(stderr, "  %s[%zu]: analytic %.6g numeric %.6g\n", what, i, an, num);
      bad++;
    }
  }
  printf("  %-28s worst relative error %.2e over %d entries\n", what, worst, n_check < (int)n ? n_check : (int)n);
  return bad;
}

/* ---- ops ------------------------------------------------------------------------------ */

enum { T = 5, C = 24, OC = 12, H = 4, KVH = 2, D = 8, P = 6, V = 40 };

struct lin { float inp[T * C], w[OC * C], b[OC], out[T * OC], wt[T * OC]; };
static double lin_loss(void *ctx) {
  struct lin *l = ctx;
  kvl_op_linear_forward(l->out, l->inp, l->w, l->b, T, C, OC);
  return dotw(l->out, l->wt, T * OC);
}

static void test_linear(void) {
  static struct lin l;
  fill(l.inp, T * C, 1); fill(l.w, OC * C, 0.5f); fill(l.b, OC, 0.5f); fill(l.wt, T * OC, 1);
  float di[T * C] = {0}, dw[OC * C] = {0}, db[OC] = {0};
  kvl_op_linear_backward(di, dw, db, l.wt, l.inp, l.w, T, C, OC);
  CHECK_EQ_INT(check_grad("linear d input", l.inp, T * C, di, lin_loss, &l, 0.25f, 1e-3, 1000), 0);
  CHECK_EQ_INT(check_grad("linear d weight", l.w, OC * C, dw, lin_loss, &l, 0.25f, 1e-3, 1000), 0);
  CHECK_EQ_INT(check_grad("linear d bias", l.b, OC, db, lin_loss, &l, 0.25f, 1e-3, 1000), 0);
}

struct rms { float inp[T * C], g[C], out[T * C], rstd[T], wt[T * C]; };
static double rms_loss(void *ctx) {
  struct rms *r = ctx;
  kvl_op_rmsnorm_forward(r->out, r->rstd, r->inp, r->g, T, C, 1e-6f);
  return dotw(r->out, r->wt, T * C);
}

static void test_rmsnorm(void) {
  static struct rms r;
  fill(r.inp, T * C, 2); fill(r.g, C, 1); fill(r.wt, T * C, 1);
  rms_loss(&r);
  float di[T * C] = {0};
  kvl_op_rmsnorm_backward(di, r.wt, r.inp, r.g, r.rstd, T, C);
  CHECK_EQ_INT(check_grad("rmsnorm d input", r.inp, T * C, di, rms_loss, &r, 1e-2f, 1e-2, 1000), 0);
}

struct rp { struct kvl_rope rope; int32_t pos[T]; float x[T * H * D], y[T * H * D], wt[T * H * D]; };
static double rope_loss(void *ctx) {
  struct rp *r = ctx;
  memcpy(r->y, r->x, sizeof(r->x));
  kvl_op_rope_forward(&r->rope, r->y, r->pos, T, H);
  return dotw(r->y, r->wt, T * H * D);
}

static void test_rope(void) {
  static struct rp r;
  KVL_ASSERT(kvl_rope_init(&r.rope, D, 10000.0f) == 0);
  for (int t = 0; t < T; t++) r.pos[t] = 3 + 7 * t;
  fill(r.x, T * H * D, 1); fill(r.wt, T * H * D, 1);
  float dx[T * H * D];
  memcpy(dx, r.wt, sizeof(dx));
  kvl_op_rope_backward(&r.rope, dx, r.pos, T, H);
  CHECK_EQ_INT(check_grad("rope d input", r.x, T * H * D, dx, rope_loss, &r, 1e-2f, 1e-3, 1000), 0);
}

struct sw { float g[T * C], u[T * C], out[T * C], wt[T * C]; };
static double sw_loss(void *ctx) {
  struct sw *s = ctx;
  kvl_op_swiglu_forward(s->out, s->g, s->u, T * C);
  return dotw(s->out, s->wt, T * C);
}

static void test_swiglu(void) {
  static struct sw s;
  fill(s.g, T * C, 3); fill(s.u, T * C, 1); fill(s.wt, T * C, 1);
  float dg[T * C] = {0}, du[T * C] = {0};
  kvl_op_swiglu_backward(dg, du, s.wt, s.g, s.u, T * C);
  CHECK_EQ_INT(check_grad("swiglu d gate", s.g, T * C, dg, sw_loss, &s, 1e-2f, 1e-2, 1000), 0);
  CHECK_EQ_INT(check_grad("swiglu d up", s.u, T * C, du, sw_loss, &s, 1e-2f, 1e-2, 1000), 0);
}

struct at {
  float q[T * H * D], k[(P + T) * KVH * D], v[(P + T) * KVH * D], out[T * H * D], att[H * T * (P + T)], wt[T * H * D];
};
static double at_loss(void *ctx) {
  struct at *a = ctx;
  kvl_op_attention_forward(a->out, a->att, a->q, a->k, a->v, T, P, H, KVH, D);
  return dotw(a->out, a->wt, T * H * D);
}

/* The forward against the definition, one query, head and key at a time in double:
 * out[t][h] = Σ_{j <= P+t} softmax_j(q·k_j / sqrt(D)) v_j, k and v of h's group. */
static void attention_ref(double *out, const float *q, const float *k, const float *v) {
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) {
      const int g = h / (H / KVH), nk = P + t + 1;
      double s[P + T], mx = -INFINITY, z = 0;
      for (int j = 0; j < nk; j++) {
        s[j] = 0;
        for (int i = 0; i < D; i++) s[j] += (double)q[(t * H + h) * D + i] * k[(j * KVH + g) * D + i];
        s[j] /= sqrt((double)D);
        mx = fmax(mx, s[j]);
      }
      for (int j = 0; j < nk; j++) z += (s[j] = exp(s[j] - mx));
      for (int i = 0; i < D; i++) {
        double o = 0;
        for (int j = 0; j < nk; j++) o += s[j] / z * v[(j * KVH + g) * D + i];
        out[(t * H + h) * D + i] = o;
      }
    }
}

static void test_attention(void) {
  static struct at a;
  fill(a.q, sizeof(a.q) / 4, 1); fill(a.k, sizeof(a.k) / 4, 1); fill(a.v, sizeof(a.v) / 4, 1); fill(a.wt, sizeof(a.wt) / 4, 1);
  at_loss(&a);
  static double want[T * H * D];
  attention_ref(want, a.q, a.k, a.v);
  double worst = 0;
  for (int i = 0; i < T * H * D; i++) worst = fmax(worst, fabs(a.out[i] - want[i]));
  printf("  attention forward vs reference: max |diff| %.2e\n", worst);
  CHECK(worst < 1e-5);
  static float dq[T * H * D], dk[(P + T) * KVH * D], dv[(P + T) * KVH * D];
  kvl_op_attention_backward(dq, dk, dv, a.wt, a.att, a.q, a.k, a.v, T, P, H, KVH, D);
  CHECK_EQ_INT(check_grad("attention d q", a.q, sizeof(a.q) / 4, dq, at_loss, &a, 1e-2f, 1e-2, 1000), 0);
  CHECK_EQ_INT(check_grad("attention d k", a.k, sizeof(a.k) / 4, dk, at_loss, &a, 1e-2f, 1e-2, 1000), 0);
  CHECK_EQ_INT(check_grad("attention d v", a.v, sizeof(a.v) / 4, dv, at_loss, &a, 1e-2f, 1e-2, 1000), 0);
}

struct kl { float z[V]; int32_t ids[V]; float lp[V]; int K; };
static double kl_loss(void *ctx) {
  struct kl *k = ctx;
  return kvl_op_kl_topk(k->z, V, k->ids, k->lp, k->K, NULL, 1);
}

static void test_kl(void) {
  static struct kl k;
  fill(k.z, V, 3);
  for (int pass = 0; pass < 2; pass++) {
    k.K = pass == 0 ? V : 6; /* the exact KL, then top-6 + tail */
    float t[V], mx = -1e30f;
    fill(t, V, 4);
    for (int i = 0; i < V; i++) mx = t[i] > mx ? t[i] : mx;
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(t[i] - mx);
    for (int i = 0; i < V; i++) { k.ids[i] = (i * 7) % V; k.lp[i] = (float)(t[k.ids[i]] - mx - log(z)); }
    float dz[V];
    double l = kvl_op_kl_topk(k.z, V, k.ids, k.lp, k.K, dz, 1);
    CHECK(l >= 0);
    CHECK_EQ_INT(check_grad(pass == 0 ? "KL (full) d logits" : "KL (top-6 + tail) d logits", k.z, V, dz, kl_loss, &k,
                            1e-2f, 1e-2, 1000), 0);
  }
  /* KL of a distribution with itself is 0 */
  float same[V];
  int32_t ids[V];
  double z = 0;
  for (int i = 0; i < V; i++) z += exp(k.z[i]);
  for (int i = 0; i < V; i++) { ids[i] = i; same[i] = (float)(k.z[i] - log(z)); }
  CHECK(fabs(kvl_op_kl_topk(k.z, V, ids, same, V, NULL, 1)) < 1e-5);
}

/* ---- end to end: maps -> prefix K/V -> the tiny model -> KL ----------------------------- */

struct e2e {
  kvl_dense_t *d;
  const struct kvl_rope *rope;
  int NL, KV, P2, T2, Vv, K;
  float *X, *Y;        /* source activations [P][KV] per layer */
  float *M, *N;        /* maps [KV][KV] per layer */
  float **pk, **pv;
  int32_t *tok, *pos, *ids;
  float *lp, *logits;
};

static void prefix_of(struct e2e *e) {
  for (int l = 0; l < e->NL; l++) {
    kvl_op_linear_forward(e->pk[l], e->X + (size_t)l * e->P2 * e->KV, e->M + (size_t)l * e->KV * e->KV, NULL, e->P2,
                          e->KV, e->KV); /* rows of M are outputs: K = X Mᵀ */
    kvl_op_linear_forward(e->pv[l], e->Y + (size_t)l * e->P2 * e->KV, e->N + (size_t)l * e->KV * e->KV, NULL, e->P2,
                          e->KV, e->KV);
    kvl_op_rope_forward(e->rope, e->pk[l], e->pos, e->P2, e->KV / kvl_model_hparams(kvl_dense_model(e->d))->head_dim);
  }
}

static double e2e_loss(void *ctx) {
  struct e2e *e = ctx;
  prefix_of(e);
  kvl_dense_acts_t *a;
  KVL_ASSERT(kvl_dense_forward(e->d, (const float *const *)e->pk, (const float *const *)e->pv, e->P2, e->tok, e->T2,
                               e->logits, &a) == 0);
  kvl_dense_acts_free(a);
  double l = 0;
  for (int t = 0; t < e->T2; t++)
    l += kvl_op_kl_topk(e->logits + (size_t)t * e->Vv, e->Vv, e->ids + t * e->K, e->lp + t * e->K, e->K, NULL,
                        1.0f / e->T2);
  return l / e->T2;
}

static void test_end_to_end(void) {
  void *buf;
  kvl_model_t *m = tiny_model_load(&(struct tiny_opts){.n_layer = 2}, &buf);
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  char err[256];
  struct e2e e = {0};
  KVL_ASSERT(kvl_dense_new(m, &e.d, err, sizeof(err)) == 0);
  e.rope = kvl_model_rope(m);
  e.NL = hp->n_layer;
  e.KV = hp->n_kv_head * hp->head_dim;
  e.P2 = 9;
  e.T2 = 6;
  e.Vv = hp->n_vocab;
  e.K = 8;
  e.X = malloc(sizeof(float) * e.NL * e.P2 * e.KV);
  e.Y = malloc(sizeof(float) * e.NL * e.P2 * e.KV);
  e.M = malloc(sizeof(float) * e.NL * e.KV * e.KV);
  e.N = malloc(sizeof(float) * e.NL * e.KV * e.KV);
  fill(e.X, (size_t)e.NL * e.P2 * e.KV, 2);
  fill(e.Y, (size_t)e.NL * e.P2 * e.KV, 2);
  fill(e.M, (size_t)e.NL * e.KV * e.KV, 0.3f);
  fill(e.N, (size_t)e.NL * e.KV * e.KV, 0.3f);
  e.pk = malloc(sizeof(float *) * e.NL);
  e.pv = malloc(sizeof(float *) * e.NL);
  float **dpk = malloc(sizeof(float *) * e.NL), **dpv = malloc(sizeof(float *) * e.NL);
  for (int l = 0; l < e.NL; l++) {
    e.pk[l] = malloc(sizeof(float) * e.P2 * e.KV);
    e.pv[l] = malloc(sizeof(float) * e.P2 * e.KV);
    dpk[l] = calloc((size_t)e.P2 * e.KV, sizeof(float));
    dpv[l] = calloc((size_t)e.P2 * e.KV, sizeof(float));
  }
  e.tok = malloc(sizeof(int32_t) * e.T2);
  e.pos = malloc(sizeof(int32_t) * e.P2);
  e.ids = malloc(sizeof(int32_t) * e.T2 * e.K);
  e.lp = malloc(sizeof(float) * e.T2 * e.K);
  e.logits = malloc(sizeof(float) * e.T2 * e.Vv);
  for (int t = 0; t < e.T2; t++) e.tok[t] = (int32_t)(kvl_test_rand(&g_rs) % (unsigned)e.Vv);
  for (int p = 0; p < e.P2; p++) e.pos[p] = p;
  for (int t = 0; t < e.T2; t++) { /* a target: top-8 with 0.7 of the mass, the rest in the tail */
    double s = 0;
    float w[8];
    for (int k = 0; k < e.K; k++) { w[k] = 0.2f + (frand() + 1); s += w[k]; }
    for (int k = 0; k < e.K; k++) {
      e.ids[t * e.K + k] = (int32_t)((t * 37 + k * 11) % e.Vv);
      e.lp[t * e.K + k] = (float)log(0.7 * w[k] / s);
    }
  }
  /* analytic: d loss / d prefix, then through RoPE and the maps */
  prefix_of(&e);
  kvl_dense_acts_t *a;
  CHECK_EQ_INT(kvl_dense_forward(e.d, (const float *const *)e.pk, (const float *const *)e.pv, e.P2, e.tok, e.T2, e.logits,
                                 &a), 0);
  float *dlog = malloc(sizeof(float) * e.T2 * e.Vv);
  for (int t = 0; t < e.T2; t++)
    kvl_op_kl_topk(e.logits + (size_t)t * e.Vv, e.Vv, e.ids + t * e.K, e.lp + t * e.K, e.K, dlog + (size_t)t * e.Vv,
                   1.0f / e.T2);
  CHECK_EQ_INT(kvl_dense_backward(e.d, a, dlog, dpk, dpv), 0);
  kvl_dense_acts_free(a);
  float *dM = calloc((size_t)e.NL * e.KV * e.KV, sizeof(float)), *dN = calloc((size_t)e.NL * e.KV * e.KV, sizeof(float));
  for (int l = 0; l < e.NL; l++) {
    kvl_op_rope_backward(e.rope, dpk[l], e.pos, e.P2, e.KV / hp->head_dim);
    kvl_op_linear_backward(NULL, dM + (size_t)l * e.KV * e.KV, NULL, dpk[l], e.X + (size_t)l * e.P2 * e.KV,
                           e.M + (size_t)l * e.KV * e.KV, e.P2, e.KV, e.KV);
    kvl_op_linear_backward(NULL, dN + (size_t)l * e.KV * e.KV, NULL, dpv[l], e.Y + (size_t)l * e.P2 * e.KV,
                           e.N + (size_t)l * e.KV * e.KV, e.P2, e.KV, e.KV);
  }
  printf("  end to end: tiny model (%d layers), prefix %d, %d positions, loss %.4f\n", e.NL, e.P2, e.T2, e2e_loss(&e));
  CHECK_EQ_INT(check_grad("e2e d K-maps", e.M, (size_t)e.NL * e.KV * e.KV, dM, e2e_loss, &e, 1e-2f, 2e-2, 60), 0);
  CHECK_EQ_INT(check_grad("e2e d V-maps", e.N, (size_t)e.NL * e.KV * e.KV, dN, e2e_loss, &e, 1e-2f, 2e-2, 60), 0);
  for (int l = 0; l < e.NL; l++) { free(e.pk[l]); free(e.pv[l]); free(dpk[l]); free(dpv[l]); }
  free(e.pk); free(e.pv); free(dpk); free(dpv); free(e.X); free(e.Y); free(e.M); free(e.N); free(dM); free(dN);
  free(e.tok); free(e.pos); free(e.ids); free(e.lp); free(e.logits); free(dlog);
  kvl_dense_free(e.d);
  kvl_model_free(m);
  free(buf);
}

/* The dense model is the serving model: the engine's forward over P + T tokens (reference
 * backend, fp32 KV) and the dense forward over the same T tokens on the engine's own
 * prefix K/V give the same logits. */
static void test_dense_equals_engine(void) {
  void *buf;
  kvl_model_t *m = tiny_model_load(&(struct tiny_opts){.n_layer = 2}, &buf);
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  enum { PP = 21, TT = 7, NB = 4 };
  const int NV = hp->n_vocab, KV = hp->n_kv_head * hp->head_dim, NL = hp->n_layer;
  int32_t tok[PP + TT], pos[PP + TT], seq[PP + TT];
  for (int i = 0; i < PP + TT; i++) { tok[i] = (int32_t)(kvl_test_rand(&g_rs) % (unsigned)NV); pos[i] = i; seq[i] = 0; }
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  void *pool = calloc(NB, kvl_kv_block_bytes(&kl));
  int32_t table[NB] = {0, 1, 2, 3};
  const int32_t *tables[1] = {table};
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  float *ref = malloc(sizeof(float) * (PP + TT) * NV), *got = malloc(sizeof(float) * TT * NV);
  struct kvl_batch b = {PP + TT, tok, pos, seq, NULL};
  CHECK_EQ_INT(kvl_model_forward(m, kvl_backend_ref(), &b, &kv, ref, NULL), 0);
  float **pk = malloc(sizeof(float *) * NL), **pv = malloc(sizeof(float *) * NL);
  for (int l = 0; l < NL; l++) {
    pk[l] = malloc(sizeof(float) * PP * KV);
    pv[l] = malloc(sizeof(float) * PP * KV);
    for (int p = 0; p < PP; p++) kvl_kv_load(&kl, pool, l, p, table, pk[l] + (size_t)p * KV, pv[l] + (size_t)p * KV);
  }
  kvl_dense_t *d;
  char err[256];
  CHECK_EQ_INT(kvl_dense_new(m, &d, err, sizeof(err)), 0);
  kvl_dense_acts_t *a;
  CHECK_EQ_INT(kvl_dense_forward(d, (const float *const *)pk, (const float *const *)pv, PP, tok + PP, TT, got, &a), 0);
  double worst = 0, scale = 0;
  for (int t = 0; t < TT; t++)
    for (int i = 0; i < NV; i++) {
      worst = fmax(worst, fabs(got[(size_t)t * NV + i] - ref[(size_t)(PP + t) * NV + i]));
      scale = fmax(scale, fabs(ref[(size_t)(PP + t) * NV + i]));
    }
  printf("  dense forward vs the engine's: max |Δ logit| %.2e (logits up to %.2f), dense copy %zu bytes\n", worst, scale,
         kvl_dense_bytes(d));
  CHECK(worst < 1e-4 * fmax(scale, 1));
  kvl_dense_acts_free(a);
  kvl_dense_free(d);
  for (int l = 0; l < NL; l++) { free(pk[l]); free(pv[l]); }
  free(pk); free(pv); free(ref); free(got); free(pool);
  kvl_model_free(m);
  free(buf);
}

int main(void) {
  RUN(test_linear);
  RUN(test_rmsnorm);
  RUN(test_rope);
  RUN(test_swiglu);
  RUN(test_attention);
  RUN(test_kl);
  RUN(test_dense_equals_engine);
  RUN(test_end_to_end);
  return TEST_EXIT();
}
