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

static void add_inplace(float *h, const float *d, size_t n) {
  for (size_t i = 0; i < n; i++) h[i] += d[i];
}

/* y = x·Wᵀ with the rows of the attention sink (sink[t]) through `sb`, the others through
 * `be`: a row's numerics depend on its own position only. The sink rows of a batch (one
 * per new prompt) go through `sb` together, gathered into `tmp` (T·max(cols, rows)). */
static void matmul_rows(kvl_backend_t *be, kvl_backend_t *sb, const bool *sink, const struct kvl_weight *w,
                        const float *x, float *y, int T, float *tmp) {
  if (sb == be) {
    kvl_matmul(be, w, x, y, T);
    return;
  }
  const size_t K = (size_t)w->cols, N = (size_t)w->rows;
  int ns = 0;
  for (int t = 0; t < T; t++)
    if (sink[t]) memcpy(tmp + (size_t)ns++ * K, x + (size_t)t * K, K * sizeof(float));
  float *ys = tmp + (size_t)ns * K;
  kvl_matmul(sb, w, tmp, ys, ns);
  for (int t = 0, i = 0; t < T; t++)
    if (sink[t]) memcpy(y + (size_t)t * N, ys + (size_t)i++ * N, N * sizeof(float));
  for (int t0 = 0, t1; t0 < T; t0 = t1) { /* the others, in runs of consecutive rows */
    for (t1 = t0 + 1; t1 < T && sink[t1] == sink[t0];) t1++;
    if (!sink[t0]) kvl_matmul(be, w, x + (size_t)t0 * K, y + (size_t)t0 * N, t1 - t0);
  }
}

int kvl_model_forward(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b,
                      const struct kvl_kv_view *kv, float *logits, const struct kvl_capture *cap) {
  const struct kvl_model_hparams *hp = &m->hp;
  const int T = b->n_tokens, E = hp->n_embd, D = hp->head_dim, H = hp->n_head;
  const int KV = hp->n_kv_head * D, F = hp->n_ff;
  KVL_ASSERT(kv->layout->n_layer == hp->n_layer && kv->layout->n_kv_head == hp->n_kv_head &&
             kv->layout->head_dim == D);
  if (T <= 0) return 0;
  for (int t = 0; t < T; t++)
    if (b->tokens[t] < 0 || b->tokens[t] >= hp->n_vocab || b->pos[t] < 0 || b->seq[t] < 0) return KVL_EINVAL;
  /* The backend's approximate decode kernels only for batches of single decode tokens: a
   * prefill chunk (two tokens of one sequence) or the attention sink (position 0) runs
   * exact, so a prompt's cache does not depend on how its prefill was chunked or cached. */
  if (T <= 64) {
    bool exact = false;
    for (int t = 0; t < T && !exact; t++) {
      exact = b->pos[t] == 0;
      for (int u = 0; u < t && !exact; u++) exact = b->seq[u] == b->seq[t];
    }
    if (exact) be = kvl_backend_exact(be);
  }
  /* the attention sink's rows in fp32: every later position attends to it */
  kvl_backend_t *sb = kvl_backend_fp32(be);
  bool *sink = malloc((size_t)T * sizeof(bool));
  if (!sink) return KVL_ENOMEM;
  int n_sink = 0;
  for (int t = 0; t < T; t++) n_sink += sink[t] = b->pos[t] == 0;
  if (!n_sink) sb = be;
  /* the sink rows' inputs and outputs, gathered (the widest product: the output head) */
  size_t widest = (size_t)(F > hp->n_vocab ? F : hp->n_vocab) + (size_t)(E > F ? E : F);
  float *tmp = n_sink ? malloc((size_t)n_sink * widest * sizeof(float)) : NULL;
  if (n_sink && !tmp) {
    free(sink);
    return KVL_ENOMEM;
  }

  /* scratch: one allocation sliced by a size table (STYLE.md §8) */
  size_t sizes[] = {(size_t)T * E, (size_t)T * E, (size_t)T * E, (size_t)T * KV, (size_t)T * KV,
                    (size_t)T * E, (size_t)T * F, (size_t)T * F};
  size_t total = 0;
  for (size_t i = 0; i < 8; i++) total += sizes[i];
  float *mem = malloc(total * sizeof(float));
  if (!mem) {
    free(sink);
    free(tmp);
    return KVL_ENOMEM;
  }
  float *p = mem, *slot[8];
  for (size_t i = 0; i < 8; i++) { slot[i] = p; p += sizes[i]; }
  float *h = slot[0], *x = slot[1], *q = slot[2], *k = slot[3], *v = slot[4], *att = slot[5];
  float *gate = slot[6], *up = slot[7];

  kvl_embed(be, &m->tok_embd, b->tokens, h, T);
  for (int il = 0; il < hp->n_layer; il++) {
    const struct kvl_layer *L = &m->layers[il];
    kvl_rmsnorm(be, h, L->attn_norm, x, T, E, hp->rms_eps);
    matmul_rows(be, sb, sink, &L->wq, x, q, T, tmp);
    matmul_rows(be, sb, sink, &L->wk, x, k, T, tmp);
    matmul_rows(be, sb, sink, &L->wv, x, v, T, tmp);
    if (cap)
      for (int c = 0; c < cap->n_layers; c++)
        if (cap->layers[c] == il) {
          if (cap->k_pre && cap->k_pre[c]) memcpy(cap->k_pre[c], k, (size_t)T * KV * sizeof(float));
          if (cap->v && cap->v[c]) memcpy(cap->v[c], v, (size_t)T * KV * sizeof(float));
        }
    kvl_rope(be, &m->rope, q, b->pos, T, H, false);
    kvl_rope(be, &m->rope, k, b->pos, T, hp->n_kv_head, false);
    kvl_kv_store(kv->layout, kv->base, il, T, k, v, b->pos, b->seq, kv->block_tables);
    struct kvl_attn_args a = {T, q, att, b->pos, b->seq, kv->block_tables, H, il, kv->layout, kv->base,
                              1.0f / sqrtf((float)D)};
    kvl_attention(be, &a);
    matmul_rows(be, sb, sink, &L->wo, att, x, T, tmp);
    add_inplace(h, x, (size_t)T * E);
    kvl_rmsnorm(be, h, L->ffn_norm, x, T, E, hp->rms_eps);
    matmul_rows(be, sb, sink, &L->w_gate, x, gate, T, tmp);
    matmul_rows(be, sb, sink, &L->w_up, x, up, T, tmp);
    kvl_swiglu(be, gate, up, gate, (int64_t)T * F);
    matmul_rows(be, sb, sink, &L->w_down, gate, x, T, tmp);
    add_inplace(h, x, (size_t)T * E);
  }
  /* gather the rows that want logits, normalise, project */
  int n_out = 0;
  for (int t = 0; t < T; t++)
    if (!b->logits || b->logits[t]) {
      if (n_out != t) memcpy(h + (size_t)n_out * E, h + (size_t)t * E, (size_t)E * sizeof(float));
      sink[n_out++] = sink[t];
    }
  if (n_out > 0 && logits) {
    kvl_rmsnorm(be, h, m->output_norm, x, n_out, E, hp->rms_eps);
    matmul_rows(be, sb, sink, &m->output, x, logits, n_out, tmp);
  }
  free(mem);
  free(sink);
  free(tmp);
  return 0;
}
