/* ops_ref.c — scalar references of every forward-pass op: the slow truth the backends
 * are tested against. Plain loops, double accumulation, no threads, no SIMD. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_kernels.h"

void kvl_matmul_ref(const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  size_t rb = kvl_row_size(w->type, (uint64_t)w->cols);
  float *row = malloc((size_t)w->cols * sizeof(float));
  KVL_ASSERT(row && rb);
  for (int64_t r = 0; r < w->rows; r++) {
    kvl_dequant_row_ref(w->type, (const uint8_t *)w->data + (size_t)r * rb, row, w->cols);
    for (int t = 0; t < n_tokens; t++) {
      double acc = 0;
      const float *xt = x + (size_t)t * w->cols;
      for (int64_t k = 0; k < w->cols; k++) acc += (double)row[k] * xt[k];
      if (w->bias) acc += w->bias[r];
      y[(size_t)t * w->rows + r] = (float)acc;
    }
  }
  free(row);
}

void kvl_rmsnorm_ref(const float *x, const float *w, float *y, int n_tokens, int n, float eps) {
  for (int t = 0; t < n_tokens; t++) {
    const float *xt = x + (size_t)t * n;
    float *yt = y + (size_t)t * n;
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)xt[i] * xt[i];
    double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) yt[i] = (float)(xt[i] * inv * w[i]);
  }
}

void kvl_rope_ref(const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens, int n_heads, bool inverse) {
  int d = r->head_dim, h2 = d / 2;
  float c[256], s[256];
  for (int t = 0; t < n_tokens; t++) {
    kvl_rope_table(r, pos[t], c, s);
    for (int h = 0; h < n_heads; h++) {
      float *v = x + ((size_t)t * n_heads + h) * d;
      for (int i = 0; i < h2; i++) {
        double si = inverse ? -s[i] : s[i];
        double a = v[i], b = v[i + h2];
        v[i] = (float)(a * c[i] - b * si);
        v[i + h2] = (float)(a * si + b * c[i]);
      }
    }
  }
}

void kvl_swiglu_ref(const float *g, const float *u, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = (float)((double)g[i] / (1.0 + exp(-(double)g[i])) * u[i]);
}

void kvl_embed_ref(const struct kvl_weight *table, const int32_t *ids, float *y, int n_tokens) {
  size_t rb = kvl_row_size(table->type, (uint64_t)table->cols);
  for (int t = 0; t < n_tokens; t++) {
    KVL_ASSERT(ids[t] >= 0 && ids[t] < table->rows);
    kvl_dequant_row_ref(table->type, (const uint8_t *)table->data + (size_t)ids[t] * rb,
                        y + (size_t)t * table->cols, table->cols);
  }
}

void kvl_attention_ref(const struct kvl_attn_args *a) {
  const struct kvl_kv_layout *l = a->kv;
  int d = l->head_dim, kvw = l->n_kv_head * d, group = a->n_head / l->n_kv_head;
  KVL_ASSERT(a->n_head % l->n_kv_head == 0);
  int max_pos = 0;
  for (int t = 0; t < a->n_tokens; t++) max_pos = a->pos[t] > max_pos ? a->pos[t] : max_pos;
  float *k = malloc((size_t)(max_pos + 1) * kvw * sizeof(float));
  float *v = malloc((size_t)(max_pos + 1) * kvw * sizeof(float));
  double *sc = malloc((size_t)(max_pos + 1) * sizeof(double));
  KVL_ASSERT(k && v && sc);
  for (int t = 0; t < a->n_tokens; t++) {
    int n = a->pos[t] + 1;
    for (int j = 0; j < n; j++)
      kvl_kv_load(l, a->kv_base, a->layer, j, a->block_tables[a->seq[t]], k + (size_t)j * kvw, v + (size_t)j * kvw);
    for (int h = 0; h < a->n_head; h++) {
      const float *q = a->q + ((size_t)t * a->n_head + h) * d;
      int kh = h / group;
      double mx = -INFINITY, sum = 0;
      for (int j = 0; j < n; j++) {
        double s = 0;
        for (int i = 0; i < d; i++) s += (double)q[i] * k[(size_t)j * kvw + kh * d + i];
        sc[j] = s * a->scale;
        if (sc[j] > mx) mx = sc[j];
      }
      for (int j = 0; j < n; j++) sum += (sc[j] = exp(sc[j] - mx));
      float *o = a->out + ((size_t)t * a->n_head + h) * d;
      for (int i = 0; i < d; i++) {
        double acc = 0;
        for (int j = 0; j < n; j++) acc += sc[j] * v[(size_t)j * kvw + kh * d + i];
        o[i] = (float)(acc / sum);
      }
    }
  }
  free(k);
  free(v);
  free(sc);
}

void kvl_logits_top_ref(const float *row, int n_vocab, struct kvl_logit_top *out) {
  const int N = n_vocab < KVL_LOGIT_TOP ? n_vocab : KVL_LOGIT_TOP;
  float mx = -INFINITY;
  int nt = 0;
  for (int i = 0; i < n_vocab; i++) { /* the max, and the N largest by insertion (lower ids first on ties) */
    const float v = kvl_logit_clean(row[i]);
    mx = v > mx ? v : mx;
    if (nt == N && !(v > out->val[N - 1])) continue;
    int j = nt < N ? nt++ : N - 1;
    while (j > 0 && out->val[j - 1] < v) {
      out->val[j] = out->val[j - 1], out->id[j] = out->id[j - 1];
      j--;
    }
    out->val[j] = v, out->id[j] = i;
  }
  out->n = N;
  out->lse = -INFINITY, out->entropy = 0;
  out->drawn = -1, out->drawn_val = -INFINITY, out->drawn_rank = 0;
  if (mx == -INFINITY) return;
  if (out->temperature > 0) { /* the draw: cumulative sums in double, in id order */
    const float inv_t = 1.0f / out->temperature;
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) sum += expf((kvl_logit_clean(row[i]) - mx) * inv_t);
    const double target = out->u * sum;
    double cum = 0;
    for (int i = 0; i < n_vocab; i++) {
      const float p = expf((kvl_logit_clean(row[i]) - mx) * inv_t);
      if (p <= 0.0f) continue;
      out->drawn = i; /* the last positive one, should rounding overrun */
      cum += p;
      if (target < cum) break;
    }
    out->drawn_val = kvl_logit_clean(row[out->drawn]);
    int32_t above = 0;
    for (int i = 0; i < n_vocab; i++) above += kvl_logit_clean(row[i]) > out->drawn_val;
    out->drawn_rank = 1 + above;
  }
  double z = 0, ez = 0;
  for (int i = 0; i < n_vocab; i++) {
    const double d = (double)kvl_logit_clean(row[i]) - mx;
    if (d == -INFINITY) continue;
    const double e = exp(d);
    z += e, ez += e * d;
  }
  out->lse = (float)(mx + log(z));
  out->entropy = (float)(log(z) - ez / z);
}
