/* qwen2.c — the Qwen2 forward pass over a paged KV cache.
 *
 *   h = embed(tokens)                                     (T, E)
 *   per layer:  x = rmsnorm(h) ; q,k,v = x·Wᵀ + b          (T, H·D) (T, KV) (T, KV)
 *               rope(q), rope(k) at pos ; store k,v at (seq, pos)
 *               h += attention(q, cache) · Woᵀ
 *               x = rmsnorm(h) ; h += (silu(x·Wgᵀ) ⊙ x·Wuᵀ) · Wdᵀ
 *   logits = rmsnorm(h[wanted]) · Woutᵀ                    (n_out, V)
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "model-impl.h"

/* y = x·Wᵀ with the rows of the attention sink (sink[t]) through `sb`, one row per product
 * (so a sink row's numerics never depend on how many prompts started in its batch), and
 * the others through `be` in runs of consecutive rows. */
static void matmul_rows(kvl_backend_t *be, kvl_backend_t *sb, const bool *sink, const struct kvl_weight *w,
                        const float *x, float *y, int T) {
  if (sb == be) {
    kvl_matmul(be, w, x, y, T);
    return;
  }
  const size_t K = (size_t)w->cols, N = (size_t)w->rows;
  for (int t0 = 0, t1; t0 < T; t0 = t1) {
    for (t1 = t0 + 1; t1 < T && !sink[t0] && !sink[t1];) t1++;
    kvl_matmul(sink[t0] ? sb : be, w, x + t0 * K, y + t0 * N, t1 - t0);
  }
}

/* The sink rows of token tok computed on sb: copied into out (rows_len floats, counted as a
 * hit) when out is not NULL; whether they are known. */
static bool sink_find(kvl_model_t *m, const kvl_backend_t *sb, int32_t tok, float *out, size_t rows_len) {
  bool found = false;
  pthread_mutex_lock(&m->sinks.mu);
  for (int i = 0; i < m->sinks.n && !found; i++)
    if (m->sinks.tok[i] == tok && m->sinks.be[i] == sb) {
      found = true;
      if (out) {
        memcpy(out, m->sinks.kv[i], rows_len * sizeof(float));
        m->sinks.hits++;
      }
    }
  pthread_mutex_unlock(&m->sinks.mu);
  return found;
}

/* Remember the sink rows of tok (takes rows; a full table replaces round-robin). */
static void sink_keep(kvl_model_t *m, const kvl_backend_t *sb, int32_t tok, float *rows) {
  pthread_mutex_lock(&m->sinks.mu);
  bool known = false;
  for (int i = 0; i < m->sinks.n; i++) known |= m->sinks.tok[i] == tok && m->sinks.be[i] == sb;
  const int cap = (int)(sizeof(m->sinks.tok) / sizeof(m->sinks.tok[0]));
  if (!known) {
    int i = m->sinks.n < cap ? m->sinks.n++ : (int)(m->sinks.next++ % (unsigned)cap);
    free(m->sinks.kv[i]);
    m->sinks.tok[i] = tok, m->sinks.be[i] = sb, m->sinks.kv[i] = rows;
    rows = NULL;
  }
  pthread_mutex_unlock(&m->sinks.mu);
  free(rows);
}

/* m's landing buffer of at least n bytes for head_end (model-impl.h), or a malloc'd one
 * while another thread holds it; NULL: out of memory */
static char *land_take(kvl_model_t *m, kvl_backend_t *hb, size_t n) {
  char *p = NULL;
  pthread_mutex_lock(&m->land.mu);
  if (!m->land.busy) {
    if (n > m->land.n) { /* grown to the largest step's: a new mapping, pinned again */
      if (m->land.pinned_by) kvl_backend_host_unregister(m->land.pinned_by, m->land.p);
      if (m->land.p) kvl_huge_free(m->land.p, m->land.mapped);
      const size_t want = (n + 4095) & ~(size_t)4095;
      m->land.p = kvl_huge_alloc(want, &m->land.mapped);
      m->land.n = m->land.p ? want : 0;
      m->land.pinned_by = m->land.p && kvl_backend_host_register(hb, m->land.p, want) ? hb : NULL;
    }
    if (m->land.p) p = m->land.p, m->land.busy = true;
  }
  pthread_mutex_unlock(&m->land.mu);
  return p ? p : malloc(n);
}

static void land_give(kvl_model_t *m, char *p) {
  pthread_mutex_lock(&m->land.mu);
  if (p && p == m->land.p) m->land.busy = false;
  else free(p);
  pthread_mutex_unlock(&m->land.mu);
}

/* The end of a decode step's bracket, its logits [T][V] still on be's device: the rows
 * whose token asked for KVL_LOGITS_TOP summarised there (kvl_logits_top) and only the
 * summaries and the other rows brought to the host, where hb has the op; else the rows. */
static void head_end(kvl_model_t *m, kvl_backend_t *be, kvl_backend_t *hb, const struct kvl_batch *b,
                     float *logits, struct kvl_logit_top *top, int T, int V) {
  const size_t row_bytes = (size_t)V * sizeof(float), top_bytes = (size_t)T * sizeof(*top);
  int n_sum = 0;
  for (int t = 0; top && b->logits && t < T; t++) n_sum += b->logits[t] == KVL_LOGITS_TOP;
  if ((size_t)n_sum * row_bytes <= top_bytes) n_sum = 0; /* a vocabulary too small to gain */
  int8_t *full = n_sum > 0 ? malloc((size_t)T) : NULL;
  char *ob = NULL;
  size_t ob_bytes = top_bytes;
  float *temp = NULL; /* the draws asked for (top[r].temperature > 0), else NULL */
  double *u = NULL;
  if (full) {
    bool draws = false;
    for (int t = 0; t < T; t++) {
      full[t] = b->logits[t] != KVL_LOGITS_TOP;
      draws |= !full[t] && top[t].temperature > 0;
    }
    ob_bytes += (size_t)(T - n_sum) * row_bytes;
    ob = land_take(m, hb, ob_bytes);
    if (draws && (temp = malloc((size_t)T * sizeof(float))) && (u = malloc((size_t)T * sizeof(double))))
      for (int t = 0; t < T; t++) temp[t] = full[t] ? 0.0f : top[t].temperature, u[t] = top[t].u;
    if (draws && !u) land_give(m, ob), ob = NULL; /* out of memory: the rows come whole */
  }
  if (!ob ||
      !kvl_logits_top(hb, logits, T, V, full, temp, u, (struct kvl_logit_top *)ob, (float *)(ob + top_bytes))) {
    kvl_backend_end(be, logits, (size_t)T * row_bytes);
    for (int r = 0; top && r < T; r++) top[r].full = 1;
  } else {
    kvl_backend_end(be, ob, ob_bytes);
    memcpy(top, ob, top_bytes);
    for (int r = 0, j = 0; r < T; r++) {
      top[r].full = full[r];
      if (full[r]) memcpy(logits + (size_t)r * V, ob + top_bytes + (size_t)j++ * row_bytes, row_bytes);
    }
  }
  free(full);
  land_give(m, ob);
  free(temp);
  free(u);
}

/* hb: the backend of the output head (the caller's, where be is its exact twin) */
static int forward_rows(kvl_model_t *m, kvl_backend_t *be, kvl_backend_t *hb, kvl_backend_t *sb,
                        const struct kvl_batch *b, const struct kvl_kv_view *kv, float *logits,
                        struct kvl_logit_top *top, const struct kvl_capture *cap) {
  const struct kvl_model_hparams *hp = &m->hp;
  const int T = b->n_tokens, E = hp->n_embd, D = hp->head_dim, H = hp->n_head;
  const int KV = hp->n_kv_head * D, F = hp->n_ff;
  const size_t rows_len = (size_t)hp->n_layer * 2 * KV;
  bool *sink = malloc((size_t)T * sizeof(bool));
  float **fill = calloc((size_t)T, sizeof(float *)); /* sink rows to remember, per row */
  if (!sink || !fill) {
    free(sink);
    free(fill);
    return KVL_ENOMEM;
  }
  bool any = false;
  for (int t = 0; t < T; t++) {
    any |= sink[t] = b->pos[t] == 0;
    if (sink[t] && !sink_find(m, sb, b->tokens[t], NULL, 0)) fill[t] = malloc(rows_len * sizeof(float));
  }
  kvl_backend_t *hsb = any ? sb : hb; /* the head's rows of the sink */
  if (!any) sb = be;

  /* scratch: one allocation sliced by a size table (STYLE.md §8) */
  size_t sizes[] = {(size_t)T * E, (size_t)T * E, (size_t)T * E, (size_t)T * KV, (size_t)T * KV,
                    (size_t)T * E, (size_t)T * F, (size_t)T * F};
  size_t total = 0;
  for (size_t i = 0; i < 8; i++) total += sizes[i];
  float *mem = malloc(total * sizeof(float));
  if (!mem) {
    for (int t = 0; t < T; t++) free(fill[t]);
    free(sink);
    free(fill);
    return KVL_ENOMEM;
  }
  float *p = mem, *slot[8];
  for (size_t i = 0; i < 8; i++) { slot[i] = p; p += sizes[i]; }
  float *h = slot[0], *x = slot[1], *q = slot[2], *k = slot[3], *v = slot[4], *att = slot[5];
  float *gate = slot[6], *up = slot[7];
  KVL_ASSERT(v == k + (size_t)T * KV); /* one fetch brings both to the host */

  /* the layers' activations may stay on be's device (kvl_backend_begin): the host reads
   * k and v only after fetching them, and writes h through kvl_add */
  const size_t kv_bytes = (size_t)T * KV * sizeof(float);
  kvl_backend_begin(be);
  kvl_embed(be, &m->tok_embd, b->tokens, h, T);
  for (int il = 0; il < hp->n_layer; il++) {
    const struct kvl_layer *L = &m->layers[il];
    kvl_rmsnorm(be, h, L->attn_norm, x, T, E, hp->rms_eps);
    matmul_rows(be, sb, sink, &L->wq, x, q, T);
    matmul_rows(be, sb, sink, &L->wk, x, k, T);
    matmul_rows(be, sb, sink, &L->wv, x, v, T);
    if (cap)
      for (int c = 0; c < cap->n_layers; c++)
        if (cap->layers[c] == il) {
          kvl_backend_fetch(be, k, 2 * kv_bytes);
          if (cap->k_pre && cap->k_pre[c]) memcpy(cap->k_pre[c], k, kv_bytes);
          if (cap->v && cap->v[c]) memcpy(cap->v[c], v, kv_bytes);
        }
    kvl_rope(be, &m->rope, q, b->pos, T, H, false);
    kvl_rope(be, &m->rope, k, b->pos, T, hp->n_kv_head, false);
    struct kvl_attn_args a = {T,          q,        att,           b->pos,      b->seq, kv->block_tables,
                              H,          il,       kv->layout,    kv->base,    1.0f / sqrtf((float)D),
                              kv->stamps, kv->n_blocks};
    kvl_kv_put(be, &a, k, v); /* k and v: adjacent slots, brought to the host in one wait */
    if (any) kvl_backend_fetch(be, k, 2 * kv_bytes);
    for (int t = 0; t < T; t++)
      if (fill[t]) {
        memcpy(fill[t] + (size_t)il * 2 * KV, k + (size_t)t * KV, (size_t)KV * sizeof(float));
        memcpy(fill[t] + ((size_t)il * 2 + 1) * KV, v + (size_t)t * KV, (size_t)KV * sizeof(float));
      }
    kvl_attention(be, &a);
    matmul_rows(be, sb, sink, &L->wo, att, x, T);
    kvl_add(be, h, x, (int64_t)T * E);
    kvl_rmsnorm(be, h, L->ffn_norm, x, T, E, hp->rms_eps);
    matmul_rows(be, sb, sink, &L->w_gate, x, gate, T);
    matmul_rows(be, sb, sink, &L->w_up, x, up, T);
    kvl_swiglu(be, gate, up, gate, (int64_t)T * F);
    matmul_rows(be, sb, sink, &L->w_down, gate, x, T);
    kvl_add(be, h, x, (int64_t)T * E);
  }
  /* the rows that want logits, normalised and projected: when every row does (decode), the
   * head runs in the bracket too and end keeps the logits (one wait for the step); else
   * end keeps h (the rest is scratch) and the rows are gathered on the host first */
  bool all = logits != NULL;
  for (int t = 0; t < T && all; t++) all = !b->logits || b->logits[t];
  int n_out = T;
  if (!all) {
    kvl_backend_end(be, h, (size_t)T * E * sizeof(float));
    n_out = 0;
    for (int t = 0; t < T; t++)
      if (!b->logits || b->logits[t]) {
        if (n_out != t) memcpy(h + (size_t)n_out * E, h + (size_t)t * E, (size_t)E * sizeof(float));
        sink[n_out++] = sink[t];
      }
  }
  if (n_out > 0 && logits) {
    kvl_rmsnorm(be, h, m->output_norm, x, n_out, E, hp->rms_eps);
    matmul_rows(hb, hsb, sink, &m->output, x, logits, n_out);
  }
  if (all) head_end(m, be, hb, b, logits, top, T, hp->n_vocab);
  else
    for (int r = 0; top && r < n_out; r++) top[r].full = 1;
  free(mem);
  for (int t = 0; t < T; t++)
    if (fill[t]) sink_keep(m, sb, b->tokens[t], fill[t]); /* takes it */
  free(sink);
  free(fill);
  return 0;
}

static int forward(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b, const struct kvl_kv_view *kv,
                   float *logits, struct kvl_logit_top *top, const struct kvl_capture *cap) {
  const struct kvl_model_hparams *hp = &m->hp;
  const int T = b->n_tokens, D = hp->head_dim, KV = hp->n_kv_head * D;
  KVL_ASSERT(kv->layout->n_layer == hp->n_layer && kv->layout->n_kv_head == hp->n_kv_head &&
             kv->layout->head_dim == D);
  if (T <= 0) return 0;
  kvl_cpu_flush_denormals();
  for (int t = 0; t < T; t++)
    if (b->tokens[t] < 0 || b->tokens[t] >= hp->n_vocab || b->pos[t] < 0 || b->seq[t] < 0) return KVL_EINVAL;
  /* The backend's approximate decode kernels only for batches of single decode tokens: a
   * prefill chunk (two tokens of one sequence) or the attention sink (position 0) runs
   * exact, so a prompt's cache does not depend on how its prefill was chunked or cached.
   * The output head writes no cache: it stays on the caller's backend (hb), whose
   * one-token kernels read the head once for a prompt's last token, where the exact
   * twin's batch kernel (the int8 levels' tokens-in-lanes one, 1 of 16 lanes used)
   * unpacked every row of it first: 0.5B head 10.0 -> 4.0 ms on a Zen 4 (test-backend-ops
   * --perf avx512vnnimm, "output head"), ~5 % of its pp64. Chunks of more than 64 tokens
   * took the caller's backend for the head already. */
  kvl_backend_t *hb = be;
  if (T <= 64) {
    bool exact = false;
    for (int t = 0; t < T && !exact; t++) {
      exact = b->pos[t] == 0;
      for (int u = 0; u < t && !exact; u++) exact = b->seq[u] == b->seq[t];
    }
    if (exact) be = kvl_backend_exact(be);
  }
  /* the attention sink's rows in fp32 (every later position attends to it); those that
   * want no logits and were computed before are stored, not computed again */
  kvl_backend_t *sb = kvl_backend_fp32(be);
  const size_t rows_len = (size_t)hp->n_layer * 2 * KV;
  int n_keep = 0;
  int32_t *keep = malloc((size_t)T * 3 * sizeof(int32_t));
  int8_t *keep_lg = b->logits ? malloc((size_t)T) : NULL;
  float *rows = malloc(rows_len * sizeof(float));
  if (!keep || (b->logits && !keep_lg) || !rows) {
    free(keep), free(keep_lg), free(rows);
    return KVL_ENOMEM;
  }
  kvl_backend_begin(be); /* the stored sinks' rows to a device's copy of the pool without a wait each */
  for (int t = 0; t < T; t++) {
    if (!cap && b->pos[t] == 0 && b->logits && !b->logits[t] && sink_find(m, sb, b->tokens[t], rows, rows_len)) {
      for (int il = 0; il < hp->n_layer; il++) {
        struct kvl_attn_args a = {1,  NULL, NULL,       &b->pos[t], &b->seq[t], kv->block_tables, hp->n_head,
                                  il, kv->layout, kv->base, 0.0f, kv->stamps, kv->n_blocks};
        kvl_kv_put(be, &a, rows + (size_t)il * 2 * KV, rows + ((size_t)il * 2 + 1) * KV);
      }
      continue;
    }
    keep[n_keep] = b->tokens[t], keep[T + n_keep] = b->pos[t], keep[2 * T + n_keep] = b->seq[t];
    if (keep_lg) keep_lg[n_keep] = b->logits[t];
    n_keep++;
  }
  kvl_backend_end(be, NULL, 0);
  int rc = 0;
  if (n_keep == T) rc = forward_rows(m, be, hb, sb, b, kv, logits, top, cap);
  else if (n_keep > 0) {
    struct kvl_batch r = {n_keep, keep, keep + T, keep + 2 * T, keep_lg};
    rc = forward_rows(m, be, hb, sb, &r, kv, logits, top, cap);
  }
  free(keep), free(keep_lg), free(rows);
  return rc;
}

int kvl_model_forward(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b,
                      const struct kvl_kv_view *kv, float *logits, const struct kvl_capture *cap) {
  return forward(m, be, b, kv, logits, NULL, cap);
}

int kvl_model_forward_top(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b,
                          const struct kvl_kv_view *kv, float *logits, struct kvl_logit_top *top) {
  return forward(m, be, b, kv, logits, top, NULL);
}
