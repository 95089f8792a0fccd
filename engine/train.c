/* train.c — the differentiable Qwen2 forward/backward on dense fp32 weights (kvl_train.h).
 *
 *   per layer:  x = rmsnorm(h) ; q,k,v = x·Wᵀ + b ; rope(q), rope(k)
 *               a = attention(q, [prefix K ; k], [prefix V ; v]) ; h += a·Woᵀ
 *               x = rmsnorm(h) ; h += (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ
 *   logits = rmsnorm(h)·Woutᵀ
 * The same arithmetic as engine/qwen2.c (which reads quantised blocks); the backward
 * walks it in reverse and stops at the prefix K/V (the weights are frozen). */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_quant.h"
#include "kvl_train.h"
#include "model-impl.h"

/* ---- ops ------------------------------------------------------------------------------ */

void kvl_op_linear_forward(float *out, const float *inp, const float *w, const float *bias, int T, int C, int OC) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
  if (bias)
    for (int t = 0; t < T; t++)
      for (int o = 0; o < OC; o++) out[(size_t)t * OC + o] += bias[o];
}

void kvl_op_linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                            int T, int C, int OC) {
  if (dinp) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  if (dw) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, T, 1.0f, dout, OC, inp, C, 1.0f, dw, C);
  if (dbias)
    for (int t = 0; t < T; t++)
      for (int o = 0; o < OC; o++) dbias[o] += dout[(size_t)t * OC + o];
}

void kvl_op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *g, int T, int C, float eps) {
  for (int t = 0; t < T; t++) {
    const float *x = inp + (size_t)t * C;
    double ss = 0;
    for (int i = 0; i < C; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / C + eps));
    rstd[t] = r;
    for (int i = 0; i < C; i++) out[(size_t)t * C + i] = x[i] * r * g[i];
  }
}

/* y_i = x_i r g_i, r = (mean x² + eps)^-1/2:  dx_i = r g_i dy_i - x_i r³ (Σ_j dy_j g_j x_j) / C */
void kvl_op_rmsnorm_backward(float *dinp, const float *dout, const float *inp, const float *g, const float *rstd, int T,
                             int C) {
  for (int t = 0; t < T; t++) {
    const float *x = inp + (size_t)t * C, *dy = dout + (size_t)t * C;
    double dot = 0;
    for (int i = 0; i < C; i++) dot += (double)dy[i] * g[i] * x[i];
    double r = rstd[t], k = r * r * r * dot / C;
    for (int i = 0; i < C; i++) dinp[(size_t)t * C + i] += (float)(r * g[i] * dy[i] - x[i] * k);
  }
}

void kvl_op_rope_forward(const struct kvl_rope *r, float *x, const int32_t *pos, int T, int H) {
  kvl_rope_ref(r, x, pos, T, H, false);
}

void kvl_op_rope_backward(const struct kvl_rope *r, float *dx, const int32_t *pos, int T, int H) {
  kvl_rope_ref(r, dx, pos, T, H, true); /* a rotation's transpose is its inverse */
}

void kvl_op_swiglu_forward(float *out, const float *g, const float *u, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* silu(g) = g σ(g); silu'(g) = σ(g) (1 + g (1 - σ(g))) */
void kvl_op_swiglu_backward(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float s = 1.0f / (1.0f + expf(-g[i]));
    du[i] += dout[i] * g[i] * s;
    dg[i] += dout[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

void kvl_op_attention_forward(float *out, float *att, const float *q, const float *k, const float *v, int T, int P,
                              int H, int KVH, int D) {
  const int N = P + T, group = H / KVH;
  const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; h++) {
    const int g = h / group;
    for (int t = 0; t < T; t++) {
      const float *qt = q + ((size_t)t * H + h) * D;
      float *a = att + ((size_t)h * T + t) * N;
      const int nk = P + t + 1;
      float mx = -INFINITY;
      for (int j = 0; j < nk; j++) {
        const float *kj = k + ((size_t)j * KVH + g) * D;
        float s = 0;
        for (int i = 0; i < D; i++) s += qt[i] * kj[i];
        a[j] = s * scale;
        mx = a[j] > mx ? a[j] : mx;
      }
      double z = 0;
      for (int j = 0; j < nk; j++) {
        a[j] = expf(a[j] - mx);
        z += a[j];
      }
      for (int j = 0; j < nk; j++) a[j] = (float)(a[j] / z);
      for (int j = nk; j < N; j++) a[j] = 0;
      float *o = out + ((size_t)t * H + h) * D;
      memset(o, 0, (size_t)D * sizeof(float));
      for (int j = 0; j < nk; j++) {
        const float *vj = v + ((size_t)j * KVH + g) * D;
        for (int i = 0; i < D; i++) o[i] += a[j] * vj[i];
      }
    }
  }
}

/* da_j = dout·v_j ; ds_j = a_j (da_j - Σ a da) ; dq += scale Σ ds_j k_j ; dk_j += scale ds_j q ;
 * dv_j += a_j dout. Heads of one KV group write the same dk/dv rows: groups run in
 * parallel, the heads of a group in sequence. */
void kvl_op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *att, const float *q,
                               const float *k, const float *v, int T, int P, int H, int KVH, int D) {
  const int N = P + T, group = H / KVH;
  const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel
  {
    float *da = malloc((size_t)N * sizeof(float));
#pragma omp for schedule(static)
    for (int g = 0; g < KVH; g++)
      for (int h = g * group; h < (g + 1) * group; h++)
        for (int t = 0; t < T; t++) {
          const float *a = att + ((size_t)h * T + t) * N, *qt = q + ((size_t)t * H + h) * D;
          const float *dot = dout + ((size_t)t * H + h) * D;
          float *dqt = dq + ((size_t)t * H + h) * D;
          const int nk = P + t + 1;
          double sum = 0;
          for (int j = 0; j < nk; j++) {
            const float *vj = v + ((size_t)j * KVH + g) * D;
            float *dvj = dv + ((size_t)j * KVH + g) * D;
            float s = 0;
            for (int i = 0; i < D; i++) {
              s += dot[i] * vj[i];
              dvj[i] += a[j] * dot[i];
            }
            da[j] = s;
            sum += (double)a[j] * s;
          }
          for (int j = 0; j < nk; j++) {
            float ds = a[j] * (da[j] - (float)sum) * scale;
            const float *kj = k + ((size_t)j * KVH + g) * D;
            float *dkj = dk + ((size_t)j * KVH + g) * D;
            for (int i = 0; i < D; i++) {
              dqt[i] += ds * kj[i];
              dkj[i] += ds * qt[i];
            }
          }
        }
    free(da);
  }
}

float kvl_op_kl_topk(const float *logits, int V, const int32_t *ids, const float *logp, int K, float *dlogits,
                     float scale) {
  float mx = -INFINITY;
  for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
  double z = 0;
  for (int i = 0; i < V; i++) z += exp((double)logits[i] - mx);
  double lse = mx + log(z), p_top = 0, q_top = 0, kl = 0;
  for (int k = 0; k < K; k++) {
    double p = exp((double)logp[k]), lq = (double)logits[ids[k]] - lse;
    p_top += p;
    q_top += exp(lq);
    if (p > 0) kl += p * ((double)logp[k] - lq);
  }
  double p_tail = 1.0 - p_top, q_tail = 1.0 - q_top;
  if (K >= V || p_tail < 1e-6) p_tail = 0; /* no tail (or only round-off of one) */
  if (p_tail > 0 && q_tail > 0) kl += p_tail * (log(p_tail) - log(q_tail));
  if (dlogits) {
    double f = q_tail > 1e-12 ? p_tail / q_tail : 0; /* the tail of p̂ is shaped like q */
    for (int i = 0; i < V; i++) dlogits[i] = (float)(scale * exp((double)logits[i] - lse) * (1.0 - f));
    for (int k = 0; k < K; k++) {
      double q = exp((double)logits[ids[k]] - lse);
      dlogits[ids[k]] = (float)(scale * (q - exp((double)logp[k])));
    }
  }
  return (float)kl;
}

/* ---- the dense model ------------------------------------------------------------------- */

struct dlayer {
  const float *attn_norm, *ffn_norm;     /* borrowed from the model */
  float *wq, *wk, *wv, *wo, *wg, *wu, *wd; /* dense [out][in] */
  const float *bq, *bk, *bv;             /* borrowed */
};

struct kvl_dense {
  const kvl_model_t *m;
  struct dlayer *L;
  float *out;        /* [V][E] */
  bool out_owned;
  size_t bytes;
};

static float *dense_of(const struct kvl_weight *w, size_t *bytes) {
  float *d = malloc((size_t)w->rows * (size_t)w->cols * sizeof(float));
  if (!d) return NULL;
  size_t rb = kvl_row_size(w->type, (uint64_t)w->cols);
  for (int64_t r = 0; r < w->rows; r++)
    if (kvl_dequant_row_ref(w->type, (const uint8_t *)w->data + (size_t)r * rb, d + (size_t)r * w->cols, w->cols) < 0) {
      free(d);
      return NULL;
    }
  *bytes += (size_t)w->rows * (size_t)w->cols * sizeof(float);
  return d;
}

void kvl_dense_free(kvl_dense_t *d) {
  if (!d) return;
  if (d->L)
    for (int l = 0; l < d->m->hp.n_layer; l++) {
      struct dlayer *L = &d->L[l];
      free(L->wq); free(L->wk); free(L->wv); free(L->wo); free(L->wg); free(L->wu); free(L->wd);
    }
  free(d->L);
  free(d->out);
  free(d);
}

int kvl_dense_new(const kvl_model_t *m, kvl_dense_t **out, char *err, size_t errlen) {
  *out = NULL;
  if (strcmp(m->hp.arch, "qwen2"))
    return kvl_errf(err, errlen, KVL_ENOTSUP, "dense copy: architecture '%s' (only qwen2 so far)", m->hp.arch);
  kvl_dense_t *d = calloc(1, sizeof(*d));
  if (!d) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  d->m = m;
  d->L = calloc((size_t)m->hp.n_layer, sizeof(*d->L));
  if (!d->L) goto oom;
  for (int l = 0; l < m->hp.n_layer; l++) {
    const struct kvl_layer *S = &m->layers[l];
    struct dlayer *L = &d->L[l];
    L->attn_norm = S->attn_norm;
    L->ffn_norm = S->ffn_norm;
    L->bq = S->wq.bias;
    L->bk = S->wk.bias;
    L->bv = S->wv.bias;
    if (!(L->wq = dense_of(&S->wq, &d->bytes)) || !(L->wk = dense_of(&S->wk, &d->bytes)) ||
        !(L->wv = dense_of(&S->wv, &d->bytes)) || !(L->wo = dense_of(&S->wo, &d->bytes)) ||
        !(L->wg = dense_of(&S->w_gate, &d->bytes)) || !(L->wu = dense_of(&S->w_up, &d->bytes)) ||
        !(L->wd = dense_of(&S->w_down, &d->bytes)))
      goto oom;
  }
  if (!(d->out = dense_of(&m->output, &d->bytes))) goto oom;
  *out = d;
  return 0;
oom:
  kvl_dense_free(d);
  return kvl_errf(err, errlen, KVL_ENOMEM, "dense copy of '%s': out of memory (fp32 weights: ~4 bytes per parameter)",
                  m->hp.name);
}

size_t kvl_dense_bytes(const kvl_dense_t *d) { return d->bytes; }
const kvl_model_t *kvl_dense_model(const kvl_dense_t *d) { return d->m; }

/* What one layer keeps for the backward. */
struct lacts {
  float *h_in, *xn, *rstd1, *q, *kall, *vall, *att, *ao, *h_mid, *xn2, *rstd2, *g, *u, *s;
};

struct kvl_dense_acts {
  int32_t P, T;
  int32_t *pos;
  struct lacts *L;
  float *h_fin, *rstd_f, *xf;
  float *mem;
};

void kvl_dense_acts_free(kvl_dense_acts_t *a) {
  if (!a) return;
  free(a->pos);
  free(a->L);
  free(a->mem);
  free(a);
}

int kvl_dense_forward(kvl_dense_t *d, const float *const *pk, const float *const *pv, int32_t P, const int32_t *tokens,
                      int32_t T, float *logits, kvl_dense_acts_t **acts) {
  const struct kvl_model_hparams *hp = &d->m->hp;
  const int E = hp->n_embd, H = hp->n_head, KVH = hp->n_kv_head, D = hp->head_dim, F = hp->n_ff, NL = hp->n_layer;
  const int QW = H * D, KV = KVH * D, N = P + T;
  *acts = NULL;
  kvl_dense_acts_t *a = calloc(1, sizeof(*a));
  if (!a) return KVL_ENOMEM;
  a->P = P;
  a->T = T;
  size_t per = (size_t)T * E * 4 + (size_t)T * 2 + (size_t)T * QW * 2 + (size_t)N * KV * 2 + (size_t)H * T * N +
               (size_t)T * F * 3;
  size_t total = per * NL + (size_t)T * E * 2 + T;
  a->mem = malloc(total * sizeof(float));
  a->L = calloc((size_t)NL, sizeof(*a->L));
  a->pos = malloc((size_t)T * sizeof(int32_t));
  if (!a->mem || !a->L || !a->pos) {
    kvl_dense_acts_free(a);
    return KVL_ENOMEM;
  }
  for (int t = 0; t < T; t++) a->pos[t] = P + t;
  float *p = a->mem;
#define TAKE(n) (p += (n), p - (n))
  for (int l = 0; l < NL; l++) {
    struct lacts *A = &a->L[l];
    A->h_in = TAKE((size_t)T * E);
    A->xn = TAKE((size_t)T * E);
    A->rstd1 = TAKE((size_t)T);
    A->q = TAKE((size_t)T * QW);
    A->kall = TAKE((size_t)N * KV);
    A->vall = TAKE((size_t)N * KV);
    A->att = TAKE((size_t)H * T * N);
    A->ao = TAKE((size_t)T * QW);
    A->h_mid = TAKE((size_t)T * E);
    A->xn2 = TAKE((size_t)T * E);
    A->rstd2 = TAKE((size_t)T);
    A->g = TAKE((size_t)T * F);
    A->u = TAKE((size_t)T * F);
    A->s = TAKE((size_t)T * F);
  }
  a->h_fin = TAKE((size_t)T * E);
  a->xf = TAKE((size_t)T * E);
  a->rstd_f = TAKE((size_t)T);
#undef TAKE
  float *h = malloc((size_t)T * E * sizeof(float)), *tmp = malloc((size_t)T * E * sizeof(float));
  if (!h || !tmp) {
    free(h);
    free(tmp);
    kvl_dense_acts_free(a);
    return KVL_ENOMEM;
  }
  kvl_embed_ref(&d->m->tok_embd, tokens, h, T);
  for (int l = 0; l < NL; l++) {
    const struct dlayer *L = &d->L[l];
    struct lacts *A = &a->L[l];
    memcpy(A->h_in, h, (size_t)T * E * sizeof(float));
    kvl_op_rmsnorm_forward(A->xn, A->rstd1, h, L->attn_norm, T, E, hp->rms_eps);
    kvl_op_linear_forward(A->q, A->xn, L->wq, L->bq, T, E, QW);
    memcpy(A->kall, pk[l], (size_t)P * KV * sizeof(float));
    memcpy(A->vall, pv[l], (size_t)P * KV * sizeof(float));
    float *k = A->kall + (size_t)P * KV, *v = A->vall + (size_t)P * KV;
    kvl_op_linear_forward(k, A->xn, L->wk, L->bk, T, E, KV);
    kvl_op_linear_forward(v, A->xn, L->wv, L->bv, T, E, KV);
    kvl_op_rope_forward(&d->m->rope, A->q, a->pos, T, H);
    kvl_op_rope_forward(&d->m->rope, k, a->pos, T, KVH);
    kvl_op_attention_forward(A->ao, A->att, A->q, A->kall, A->vall, T, P, H, KVH, D);
    kvl_op_linear_forward(tmp, A->ao, L->wo, NULL, T, QW, E);
    for (size_t i = 0; i < (size_t)T * E; i++) h[i] += tmp[i];
    memcpy(A->h_mid, h, (size_t)T * E * sizeof(float));
    kvl_op_rmsnorm_forward(A->xn2, A->rstd2, h, L->ffn_norm, T, E, hp->rms_eps);
    kvl_op_linear_forward(A->g, A->xn2, L->wg, NULL, T, E, F);
    kvl_op_linear_forward(A->u, A->xn2, L->wu, NULL, T, E, F);
    kvl_op_swiglu_forward(A->s, A->g, A->u, (int64_t)T * F);
    kvl_op_linear_forward(tmp, A->s, L->wd, NULL, T, F, E);
    for (size_t i = 0; i < (size_t)T * E; i++) h[i] += tmp[i];
  }
  memcpy(a->h_fin, h, (size_t)T * E * sizeof(float));
  kvl_op_rmsnorm_forward(a->xf, a->rstd_f, h, d->m->output_norm, T, E, hp->rms_eps);
  if (logits) kvl_op_linear_forward(logits, a->xf, d->out, NULL, T, E, hp->n_vocab);
  free(h);
  free(tmp);
  *acts = a;
  return 0;
}

int kvl_dense_backward(kvl_dense_t *d, const kvl_dense_acts_t *a, const float *dlogits, float *const *dpk,
                       float *const *dpv) {
  const struct kvl_model_hparams *hp = &d->m->hp;
  const int E = hp->n_embd, H = hp->n_head, KVH = hp->n_kv_head, D = hp->head_dim, F = hp->n_ff, NL = hp->n_layer;
  const int QW = H * D, KV = KVH * D, P = a->P, T = a->T, N = P + T;
  size_t sz[] = {(size_t)T * E, (size_t)T * E, (size_t)T * E, (size_t)T * F, (size_t)T * F, (size_t)T * F,
                 (size_t)T * QW, (size_t)T * QW, (size_t)N * KV, (size_t)N * KV};
  size_t total = 0;
  for (size_t i = 0; i < sizeof(sz) / sizeof(sz[0]); i++) total += sz[i];
  float *mem = calloc(total, sizeof(float));
  if (!mem) return KVL_ENOMEM;
  float *p = mem, *sl[10];
  for (size_t i = 0; i < 10; i++) { sl[i] = p; p += sz[i]; }
  float *dh = sl[0], *dx = sl[1], *dh2 = sl[2], *ds = sl[3], *dg = sl[4], *du = sl[5], *dao = sl[6], *dq = sl[7];
  float *dk = sl[8], *dv = sl[9];
  /* logits = xf · Woutᵀ ; xf = rmsnorm(h_fin) */
  kvl_op_linear_backward(dx, NULL, NULL, dlogits, a->xf, d->out, T, E, hp->n_vocab);
  kvl_op_rmsnorm_backward(dh, dx, a->h_fin, d->m->output_norm, a->rstd_f, T, E);
  for (int l = NL - 1; l >= 0; l--) {
    const struct dlayer *L = &d->L[l];
    const struct lacts *A = &a->L[l];
    /* MLP: h = h_mid + s·Wdᵀ */
    memset(ds, 0, sz[3] * sizeof(float));
    memset(dg, 0, sz[4] * sizeof(float));
    memset(du, 0, sz[5] * sizeof(float));
    memset(dx, 0, sz[1] * sizeof(float));
    kvl_op_linear_backward(ds, NULL, NULL, dh, A->s, L->wd, T, F, E);
    kvl_op_swiglu_backward(dg, du, ds, A->g, A->u, (int64_t)T * F);
    kvl_op_linear_backward(dx, NULL, NULL, dg, A->xn2, L->wg, T, E, F);
    kvl_op_linear_backward(dx, NULL, NULL, du, A->xn2, L->wu, T, E, F);
    memcpy(dh2, dh, sz[2] * sizeof(float)); /* residual */
    kvl_op_rmsnorm_backward(dh2, dx, A->h_mid, L->ffn_norm, A->rstd2, T, E);
    /* attention: h_mid = h_in + ao·Woᵀ */
    memset(dao, 0, sz[6] * sizeof(float));
    memset(dq, 0, sz[7] * sizeof(float));
    memset(dk, 0, sz[8] * sizeof(float));
    memset(dv, 0, sz[9] * sizeof(float));
    kvl_op_linear_backward(dao, NULL, NULL, dh2, A->ao, L->wo, T, QW, E);
    kvl_op_attention_backward(dq, dk, dv, dao, A->att, A->q, A->kall, A->vall, T, P, H, KVH, D);
    for (size_t i = 0; i < (size_t)P * KV; i++) {
      dpk[l][i] += dk[i];
      dpv[l][i] += dv[i];
    }
    float *dkc = dk + (size_t)P * KV, *dvc = dv + (size_t)P * KV;
    kvl_op_rope_backward(&d->m->rope, dq, a->pos, T, H);
    kvl_op_rope_backward(&d->m->rope, dkc, a->pos, T, KVH);
    memset(dx, 0, sz[1] * sizeof(float));
    kvl_op_linear_backward(dx, NULL, NULL, dq, A->xn, L->wq, T, E, QW);
    kvl_op_linear_backward(dx, NULL, NULL, dkc, A->xn, L->wk, T, E, KV);
    kvl_op_linear_backward(dx, NULL, NULL, dvc, A->xn, L->wv, T, E, KV);
    memcpy(dh, dh2, sz[0] * sizeof(float)); /* residual */
    kvl_op_rmsnorm_backward(dh, dx, A->h_in, L->attn_norm, A->rstd1, T, E);
  }
  free(mem);
  return 0;
}
