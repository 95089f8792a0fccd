/* train.c — the differentiable Qwen2 forward/backward on dense fp32 weights (kvl_train.h).
 *
 *   per layer:  x = rmsnorm(h) ; q,k,v = x·Wᵀ + b ; rope(q), rope(k)
 *               a = attention(q, [prefix K ; k], [prefix V ; v]) ; h += a·Woᵀ
 *               x = rmsnorm(h) ; h += (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ
 *   logits = rmsnorm(h)·Woutᵀ
 * The same arithmetic as engine/qwen2.c (which reads quantised blocks); the backward
 * walks it in reverse and stops at the prefix K/V (the weights are frozen). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_quant.h"
#include "kvl_train.h"
#include "model-impl.h"

/* ---- ops ------------------------------------------------------------------------------ */

void kvl_op_linear_forward(float *out, const float *inp, const float *w, const float *bias, int T, int C, int OC) {
  kvl_sgemm(false, true, T, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
  if (bias)
    for (int t = 0; t < T; t++)
      for (int o = 0; o < OC; o++) out[(size_t)t * OC + o] += bias[o];
}

void kvl_op_linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                            int T, int C, int OC) {
  if (dinp) kvl_sgemm(false, false, T, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  if (dw) kvl_sgemm(true, false, OC, C, T, 1.0f, dout, OC, inp, C, 1.0f, dw, C);
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

/* Per head h (KV group g = h / (H / KVH)), as matrix products (kvl_sgemm, one thread per
 * head inside the parallel loop):  S = scale Q_h K_gᵀ (T x N), masked past key P + t,
 * A = softmax(S) row-wise, O_h = A V_g.  The masked probabilities are stored as 0, so the
 * products may run over all N keys. */
void kvl_op_attention_forward(float *out, float *att, const float *q, const float *k, const float *v, int T, int P,
                              int H, int KVH, int D) {
  const int N = P + T, group = H / KVH;
  const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; h++) {
    const int g = h / group;
    float *a = att + (size_t)h * T * N;
    kvl_sgemm(false, true, T, N, D, scale, q + (size_t)h * D, H * D, k + (size_t)g * D, KVH * D, 0.0f, a, N);
    for (int t = 0; t < T; t++) {
      float *r = a + (size_t)t * N;
      const int nk = P + t + 1;
      float mx = -INFINITY;
      for (int j = 0; j < nk; j++) mx = r[j] > mx ? r[j] : mx;
      double z = 0;
      for (int j = 0; j < nk; j++) {
        r[j] = expf(r[j] - mx);
        z += r[j];
      }
      const float iz = (float)(1.0 / z);
      for (int j = 0; j < nk; j++) r[j] *= iz;
      for (int j = nk; j < N; j++) r[j] = 0;
    }
    kvl_sgemm(false, false, T, D, N, 1.0f, a, N, v + (size_t)g * D, KVH * D, 0.0f, out + (size_t)h * D, H * D);
  }
}

/* dA = dO_h V_gᵀ ; dS = A ⊙ (dA - rowsum(A ⊙ dA)) · scale ; dQ_h += dS K_g ;
 * dK_g += dSᵀ Q_h ; dV_g += Aᵀ dO_h.  Heads run in parallel, each into its own dK/dV
 * scratch; the heads of a group are then added in head order (the same bits for any
 * number of threads). */
void kvl_op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *att, const float *q,
                               const float *k, const float *v, int T, int P, int H, int KVH, int D) {
  const int N = P + T, group = H / KVH;
  const float scale = 1.0f / sqrtf((float)D);
  float *ds = malloc((size_t)H * T * N * sizeof(float));
  float *sk = calloc((size_t)H * N * D, sizeof(float)), *sv = calloc((size_t)H * N * D, sizeof(float));
  KVL_ASSERT(ds && sk && sv);
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; h++) {
    const int g = h / group;
    const float *a = att + (size_t)h * T * N, *doh = dout + (size_t)h * D;
    float *d = ds + (size_t)h * T * N;
    kvl_sgemm(false, true, T, N, D, 1.0f, doh, H * D, v + (size_t)g * D, KVH * D, 0.0f, d, N);
    for (int t = 0; t < T; t++) {
      const float *ar = a + (size_t)t * N;
      float *dr = d + (size_t)t * N;
      double sum = 0;
      for (int j = 0; j < N; j++) sum += (double)ar[j] * dr[j];
      for (int j = 0; j < N; j++) dr[j] = ar[j] * (dr[j] - (float)sum) * scale;
    }
    kvl_sgemm(false, false, T, D, N, 1.0f, d, N, k + (size_t)g * D, KVH * D, 1.0f, dq + (size_t)h * D, H * D);
    kvl_sgemm(true, false, N, D, T, 1.0f, d, N, q + (size_t)h * D, H * D, 0.0f, sk + (size_t)h * N * D, D);
    kvl_sgemm(true, false, N, D, T, 1.0f, a, N, doh, H * D, 0.0f, sv + (size_t)h * N * D, D);
  }
#pragma omp parallel for schedule(static)
  for (int j = 0; j < N; j++)
    for (int h = 0; h < H; h++) {
      const int g = h / group;
      float *dkj = dk + ((size_t)j * KVH + g) * D, *dvj = dv + ((size_t)j * KVH + g) * D;
      const float *skj = sk + ((size_t)h * N + j) * D, *svj = sv + ((size_t)h * N + j) * D;
      for (int i = 0; i < D; i++) {
        dkj[i] += skj[i];
        dvj[i] += svj[i];
      }
    }
  free(ds);
  free(sk);
  free(sv);
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

/* What one layer keeps for the backward: rows of all sequences one after another; the
 * attention's keys, values and probabilities per sequence (offsets in kvl_dense_acts). */
struct lacts {
  float *h_in, *xn, *rstd1, *q, *kall, *vall, *att, *ao, *h_mid, *xn2, *rstd2, *g, *u, *s;
};

struct kvl_dense_acts {
  int32_t n_seq, R;          /* sequences, rows in all */
  int32_t *P, *T;            /* [n_seq] */
  size_t *row, *kv, *at;     /* [n_seq]: first row; offset in kall / vall (floats); in att */
  size_t kv_total, at_total; /* floats of kall (= vall) and att per layer */
  int32_t *pos;              /* [R] */
  struct lacts *L;
  float *h_fin, *rstd_f, *xf;
  float *mem;
};

void kvl_dense_acts_free(kvl_dense_acts_t *a) {
  if (!a) return;
  free(a->P);
  free(a->T);
  free(a->row);
  free(a->kv);
  free(a->at);
  free(a->pos);
  free(a->L);
  free(a->mem);
  free(a);
}

/* The layout of a batch: rows, offsets, positions. */
static kvl_dense_acts_t *acts_new(const struct kvl_dense_seq *seq, int32_t n_seq, int H, int KV) {
  kvl_dense_acts_t *a = calloc(1, sizeof(*a));
  if (!a) return NULL;
  a->n_seq = n_seq;
  a->P = malloc((size_t)n_seq * sizeof(int32_t));
  a->T = malloc((size_t)n_seq * sizeof(int32_t));
  a->row = malloc((size_t)n_seq * sizeof(size_t));
  a->kv = malloc((size_t)n_seq * sizeof(size_t));
  a->at = malloc((size_t)n_seq * sizeof(size_t));
  if (!a->P || !a->T || !a->row || !a->kv || !a->at) goto oom;
  for (int32_t b = 0; b < n_seq; b++) {
    const size_t N = (size_t)seq[b].P + (size_t)seq[b].T;
    a->P[b] = seq[b].P;
    a->T[b] = seq[b].T;
    a->row[b] = (size_t)a->R;
    a->kv[b] = a->kv_total;
    a->at[b] = a->at_total;
    a->R += seq[b].T;
    a->kv_total += N * (size_t)KV;
    a->at_total += (size_t)H * (size_t)seq[b].T * N;
  }
  if (!(a->pos = malloc((size_t)a->R * sizeof(int32_t)))) goto oom;
  for (int32_t b = 0; b < n_seq; b++)
    for (int32_t t = 0; t < seq[b].T; t++) a->pos[a->row[b] + (size_t)t] = seq[b].P + t;
  return a;
oom:
  kvl_dense_acts_free(a);
  return NULL;
}

int kvl_dense_forward_batch(kvl_dense_t *d, const struct kvl_dense_seq *seq, int32_t n_seq, float *logits,
                            kvl_dense_acts_t **acts) {
  const struct kvl_model_hparams *hp = &d->m->hp;
  const int E = hp->n_embd, H = hp->n_head, KVH = hp->n_kv_head, D = hp->head_dim, F = hp->n_ff, NL = hp->n_layer;
  const int QW = H * D, KV = KVH * D;
  *acts = NULL;
  if (n_seq < 1) return KVL_EINVAL;
  kvl_dense_acts_t *a = acts_new(seq, n_seq, H, KV);
  if (!a) return KVL_ENOMEM;
  const size_t R = (size_t)a->R;
  size_t per = R * E * 4 + R * 2 + R * QW * 2 + a->kv_total * 2 + a->at_total + R * F * 3;
  size_t total = per * NL + R * E * 2 + R;
  a->mem = malloc(total * sizeof(float));
  a->L = calloc((size_t)NL, sizeof(*a->L));
  float *h = malloc(R * E * sizeof(float)), *tmp = malloc(R * E * sizeof(float));
  float *kc = malloc(R * KV * sizeof(float)), *vc = malloc(R * KV * sizeof(float));
  int32_t *tok = malloc(R * sizeof(int32_t));
  if (!a->mem || !a->L || !h || !tmp || !kc || !vc || !tok) {
    free(h);
    free(tmp);
    free(kc);
    free(vc);
    free(tok);
    kvl_dense_acts_free(a);
    return KVL_ENOMEM;
  }
  float *p = a->mem;
#define TAKE(n) (p += (n), p - (n))
  for (int l = 0; l < NL; l++) {
    struct lacts *A = &a->L[l];
    A->h_in = TAKE(R * E);
    A->xn = TAKE(R * E);
    A->rstd1 = TAKE(R);
    A->q = TAKE(R * QW);
    A->kall = TAKE(a->kv_total);
    A->vall = TAKE(a->kv_total);
    A->att = TAKE(a->at_total);
    A->ao = TAKE(R * QW);
    A->h_mid = TAKE(R * E);
    A->xn2 = TAKE(R * E);
    A->rstd2 = TAKE(R);
    A->g = TAKE(R * F);
    A->u = TAKE(R * F);
    A->s = TAKE(R * F);
  }
  a->h_fin = TAKE(R * E);
  a->xf = TAKE(R * E);
  a->rstd_f = TAKE(R);
#undef TAKE
  for (int32_t b = 0; b < n_seq; b++) memcpy(tok + a->row[b], seq[b].tokens, (size_t)seq[b].T * sizeof(int32_t));
  kvl_embed_ref(&d->m->tok_embd, tok, h, (int)R);
  for (int l = 0; l < NL; l++) {
    const struct dlayer *L = &d->L[l];
    struct lacts *A = &a->L[l];
    memcpy(A->h_in, h, R * E * sizeof(float));
    kvl_op_rmsnorm_forward(A->xn, A->rstd1, h, L->attn_norm, (int)R, E, hp->rms_eps);
    kvl_op_linear_forward(A->q, A->xn, L->wq, L->bq, (int)R, E, QW);
    kvl_op_linear_forward(kc, A->xn, L->wk, L->bk, (int)R, E, KV);
    kvl_op_linear_forward(vc, A->xn, L->wv, L->bv, (int)R, E, KV);
    kvl_op_rope_forward(&d->m->rope, A->q, a->pos, (int)R, H);
    kvl_op_rope_forward(&d->m->rope, kc, a->pos, (int)R, KVH);
    /* each sequence's keys and values: its prefix, then its own rows */
    for (int32_t b = 0; b < n_seq; b++) {
      const size_t P = (size_t)seq[b].P, T = (size_t)seq[b].T;
      float *kb = A->kall + a->kv[b], *vb = A->vall + a->kv[b];
      memcpy(kb, seq[b].pk[l], P * KV * sizeof(float));
      memcpy(vb, seq[b].pv[l], P * KV * sizeof(float));
      memcpy(kb + P * KV, kc + a->row[b] * KV, T * KV * sizeof(float));
      memcpy(vb + P * KV, vc + a->row[b] * KV, T * KV * sizeof(float));
      kvl_op_attention_forward(A->ao + a->row[b] * QW, A->att + a->at[b], A->q + a->row[b] * QW, kb, vb, (int)T,
                               (int)P, H, KVH, D);
    }
    kvl_op_linear_forward(tmp, A->ao, L->wo, NULL, (int)R, QW, E);
    for (size_t i = 0; i < R * E; i++) h[i] += tmp[i];
    memcpy(A->h_mid, h, R * E * sizeof(float));
    kvl_op_rmsnorm_forward(A->xn2, A->rstd2, h, L->ffn_norm, (int)R, E, hp->rms_eps);
    kvl_op_linear_forward(A->g, A->xn2, L->wg, NULL, (int)R, E, F);
    kvl_op_linear_forward(A->u, A->xn2, L->wu, NULL, (int)R, E, F);
    kvl_op_swiglu_forward(A->s, A->g, A->u, (int64_t)R * F);
    kvl_op_linear_forward(tmp, A->s, L->wd, NULL, (int)R, F, E);
    for (size_t i = 0; i < R * E; i++) h[i] += tmp[i];
  }
  memcpy(a->h_fin, h, R * E * sizeof(float));
  kvl_op_rmsnorm_forward(a->xf, a->rstd_f, h, d->m->output_norm, (int)R, E, hp->rms_eps);
  if (logits) kvl_op_linear_forward(logits, a->xf, d->out, NULL, (int)R, E, hp->n_vocab);
  free(h);
  free(tmp);
  free(kc);
  free(vc);
  free(tok);
  *acts = a;
  return 0;
}

int kvl_dense_backward_batch(kvl_dense_t *d, const kvl_dense_acts_t *a, const float *dlogits, float *const *const *dpk,
                             float *const *const *dpv) {
  const struct kvl_model_hparams *hp = &d->m->hp;
  const int E = hp->n_embd, H = hp->n_head, KVH = hp->n_kv_head, D = hp->head_dim, F = hp->n_ff, NL = hp->n_layer;
  const int QW = H * D, KV = KVH * D;
  const size_t R = (size_t)a->R;
  size_t sz[] = {R * E, R * E, R * E, R * F, R * F, R * F, R * QW, R * QW, a->kv_total, a->kv_total, R * KV, R * KV};
  enum { NS = sizeof(sz) / sizeof(sz[0]) };
  size_t total = 0;
  for (size_t i = 0; i < NS; i++) total += sz[i];
  float *mem = calloc(total, sizeof(float));
  if (!mem) return KVL_ENOMEM;
  float *p = mem, *sl[NS];
  for (size_t i = 0; i < NS; i++) { sl[i] = p; p += sz[i]; }
  float *dh = sl[0], *dx = sl[1], *dh2 = sl[2], *ds = sl[3], *dg = sl[4], *du = sl[5], *dao = sl[6], *dq = sl[7];
  float *dk = sl[8], *dv = sl[9], *dkc = sl[10], *dvc = sl[11];
  /* logits = xf · Woutᵀ ; xf = rmsnorm(h_fin) */
  kvl_op_linear_backward(dx, NULL, NULL, dlogits, a->xf, d->out, (int)R, E, hp->n_vocab);
  kvl_op_rmsnorm_backward(dh, dx, a->h_fin, d->m->output_norm, a->rstd_f, (int)R, E);
  for (int l = NL - 1; l >= 0; l--) {
    const struct dlayer *L = &d->L[l];
    const struct lacts *A = &a->L[l];
    /* MLP: h = h_mid + s·Wdᵀ */
    memset(ds, 0, sz[3] * sizeof(float));
    memset(dg, 0, sz[4] * sizeof(float));
    memset(du, 0, sz[5] * sizeof(float));
    memset(dx, 0, sz[1] * sizeof(float));
    kvl_op_linear_backward(ds, NULL, NULL, dh, A->s, L->wd, (int)R, F, E);
    kvl_op_swiglu_backward(dg, du, ds, A->g, A->u, (int64_t)R * F);
    kvl_op_linear_backward(dx, NULL, NULL, dg, A->xn2, L->wg, (int)R, E, F);
    kvl_op_linear_backward(dx, NULL, NULL, du, A->xn2, L->wu, (int)R, E, F);
    memcpy(dh2, dh, sz[2] * sizeof(float)); /* residual */
    kvl_op_rmsnorm_backward(dh2, dx, A->h_mid, L->ffn_norm, A->rstd2, (int)R, E);
    /* attention: h_mid = h_in + ao·Woᵀ, per sequence over its own keys */
    memset(dao, 0, sz[6] * sizeof(float));
    memset(dq, 0, sz[7] * sizeof(float));
    memset(dk, 0, sz[8] * sizeof(float));
    memset(dv, 0, sz[9] * sizeof(float));
    kvl_op_linear_backward(dao, NULL, NULL, dh2, A->ao, L->wo, (int)R, QW, E);
    for (int32_t b = 0; b < a->n_seq; b++) {
      const size_t P = (size_t)a->P[b], T = (size_t)a->T[b], r = a->row[b];
      float *dkb = dk + a->kv[b], *dvb = dv + a->kv[b];
      kvl_op_attention_backward(dq + r * QW, dkb, dvb, dao + r * QW, A->att + a->at[b], A->q + r * QW,
                                A->kall + a->kv[b], A->vall + a->kv[b], (int)T, (int)P, H, KVH, D);
      for (size_t i = 0; i < P * KV; i++) {
        dpk[b][l][i] += dkb[i];
        dpv[b][l][i] += dvb[i];
      }
      memcpy(dkc + r * KV, dkb + P * KV, T * KV * sizeof(float));
      memcpy(dvc + r * KV, dvb + P * KV, T * KV * sizeof(float));
    }
    kvl_op_rope_backward(&d->m->rope, dq, a->pos, (int)R, H);
    kvl_op_rope_backward(&d->m->rope, dkc, a->pos, (int)R, KVH);
    memset(dx, 0, sz[1] * sizeof(float));
    kvl_op_linear_backward(dx, NULL, NULL, dq, A->xn, L->wq, (int)R, E, QW);
    kvl_op_linear_backward(dx, NULL, NULL, dkc, A->xn, L->wk, (int)R, E, KV);
    kvl_op_linear_backward(dx, NULL, NULL, dvc, A->xn, L->wv, (int)R, E, KV);
    memcpy(dh, dh2, sz[0] * sizeof(float)); /* residual */
    kvl_op_rmsnorm_backward(dh, dx, A->h_in, L->attn_norm, A->rstd1, (int)R, E);
  }
  free(mem);
  return 0;
}

int kvl_dense_forward(kvl_dense_t *d, const float *const *pk, const float *const *pv, int32_t P, const int32_t *tokens,
                      int32_t T, float *logits, kvl_dense_acts_t **acts) {
  const struct kvl_dense_seq s = {.pk = pk, .pv = pv, .P = P, .tokens = tokens, .T = T};
  return kvl_dense_forward_batch(d, &s, 1, logits, acts);
}

int kvl_dense_backward(kvl_dense_t *d, const kvl_dense_acts_t *a, const float *dlogits, float *const *dpk,
                       float *const *dpv) {
  return kvl_dense_backward_batch(d, a, dlogits, &dpk, &dpv);
}
