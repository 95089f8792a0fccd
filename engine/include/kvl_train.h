/* kvl_train.h — the differentiable forward and backward pass of a frozen Qwen2 model,
 * for training translators by self-distillation (DESIGN.md "Fitting translators", stage 2).
 *
 * The model stays frozen: gradients flow from the loss back to the *prefix KV* the model
 * attended to (which a translator produced), never into the weights. The backward needs
 * Wᵀ, so it runs on a dense fp32 copy of the weights (kvl_dense_new dequantises the GGUF
 * blocks once), with OpenBLAS GEMMs; the serving kernels are not involved.
 *
 *   kvl_dense_t *d;
 *   kvl_dense_new(model, &d, err, sizeof(err));            // ~4 bytes per parameter
 *   kvl_dense_acts_t *a;
 *   kvl_dense_forward(d, pk, pv, P, tokens, T, logits, &a); // prefix K (after RoPE) / V per layer
 *   float loss = 0;
 *   for (int t = 0; t < T; t++)
 *     loss += kvl_op_kl_topk(logits + t * V, V, ids[t], lps[t], K, dlogits + t * V, 1.0f / T);
 *   kvl_dense_backward(d, a, dlogits, dpk, dpv);             // += d loss / d prefix K, V
 *   kvl_dense_acts_free(a);
 *
 * Ops come in <op>_forward / <op>_backward pairs (llm.c's layout); a backward *adds* into
 * the gradients of its inputs, so shared inputs (the residual stream) accumulate. Every
 * backward is checked against finite differences (tests/unit/test-grad.c).
 */
#ifndef KVL_TRAIN_H
#define KVL_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "kvl_kernels.h"
#include "kvl_model.h"

/* ---- ops ----------------------------------------------------------------------------- */

/* out[T][OC] = inp[T][C] · w[OC][C]ᵀ (+ bias[OC]). */
void kvl_op_linear_forward(float *out, const float *inp, const float *w, const float *bias, int T, int C, int OC);
/* dinp[T][C] += dout · w; dw[OC][C] += doutᵀ · inp; dbias += Σ_t dout (each may be NULL). */
void kvl_op_linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                            int T, int C, int OC);
/* out = inp / rms(inp) · g per row; rstd[T] saved for the backward. */
void kvl_op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *g, int T, int C, float eps);
void kvl_op_rmsnorm_backward(float *dinp, const float *dout, const float *inp, const float *g, const float *rstd, int T,
                             int C);
/* RoPE in place on x[T][H][D] at positions pos; the backward of a rotation is the inverse
 * rotation of the gradient (also in place). */
void kvl_op_rope_forward(const struct kvl_rope *r, float *x, const int32_t *pos, int T, int H);
void kvl_op_rope_backward(const struct kvl_rope *r, float *dx, const int32_t *pos, int T, int H);
/* out = silu(g) · u, elementwise over n. */
void kvl_op_swiglu_forward(float *out, const float *g, const float *u, int64_t n);
void kvl_op_swiglu_backward(float *dg, float *du, const float *dout, const float *g, const float *u, int64_t n);
/* Causal grouped-query attention of T queries at positions P .. P+T-1 over P + T keys:
 * q[T][H][D], k, v[P+T][KVH][D] (prefix first, then the queries' own), out[T][H][D];
 * query t sees keys 0 .. P+t; scale 1/sqrt(D). att[H][T][P+T] keeps the probabilities. */
void kvl_op_attention_forward(float *out, float *att, const float *q, const float *k, const float *v, int T, int P,
                              int H, int KVH, int D);
void kvl_op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *att, const float *q,
                               const float *k, const float *v, int T, int P, int H, int KVH, int D);
/* KL(p || softmax(logits)) for a target given as its top-K ids with log-probs (the rest of
 * its mass, 1 - Σ p, shaped like q over the other ids): returns the KL; dlogits (may be
 * NULL) gets scale · (q - p̂) (written, not added). K = V gives the exact KL. */
float kvl_op_kl_topk(const float *logits, int V, const int32_t *ids, const float *logp, int K, float *dlogits,
                     float scale);

/* ---- the dense model ------------------------------------------------------------------- */

typedef struct kvl_dense kvl_dense_t;
typedef struct kvl_dense_acts kvl_dense_acts_t;

/* Dequantise every weight of m to fp32 (m must outlive d). KVL_ENOMEM, or KVL_ENOTSUP for
 * an architecture other than qwen2. */
int kvl_dense_new(const kvl_model_t *m, kvl_dense_t **out, char *err, size_t errlen);
void kvl_dense_free(kvl_dense_t *d);
size_t kvl_dense_bytes(const kvl_dense_t *d);
const kvl_model_t *kvl_dense_model(const kvl_dense_t *d);

/* One sequence: a prefix of P positions given per layer as K after RoPE and V, pk[l] and
 * pv[l] each [P][n_kv_head·head_dim], then tokens[0..T) at positions P .. P+T-1. Writes
 * logits[T][n_vocab]; *acts (new) keeps what the backward needs. 0 or KVL_ENOMEM. */
int kvl_dense_forward(kvl_dense_t *d, const float *const *pk, const float *const *pv, int32_t P, const int32_t *tokens,
                      int32_t T, float *logits, kvl_dense_acts_t **acts);
/* Back-propagate dlogits[T][n_vocab] through the frozen model: dpk[l], dpv[l] ([P][KV])
 * get d loss / d prefix K (after RoPE) and V *added*. 0 or KVL_ENOMEM. */
int kvl_dense_backward(kvl_dense_t *d, const kvl_dense_acts_t *acts, const float *dlogits, float *const *dpk,
                       float *const *dpv);

/* A batch of sequences in one pass: every linear layer runs once over all their rows (the
 * weights are streamed once per batch instead of once per sequence), the attention per
 * sequence over its own prefix. The same arithmetic as one kvl_dense_forward per sequence
 * up to rounding; logits[Σ T][n_vocab] in sequence order. */
struct kvl_dense_seq {
  const float *const *pk, *const *pv; /* [n_layer], each [P][n_kv_head·head_dim] */
  int32_t P;
  const int32_t *tokens; /* [T] at positions P .. P+T-1 */
  int32_t T;
};
int kvl_dense_forward_batch(kvl_dense_t *d, const struct kvl_dense_seq *seq, int32_t n_seq, float *logits,
                            kvl_dense_acts_t **acts);
/* dlogits[Σ T][n_vocab]; dpk[b][l], dpv[b][l] ([P_b][KV]) get sequence b's gradients added. */
int kvl_dense_backward_batch(kvl_dense_t *d, const kvl_dense_acts_t *acts, const float *dlogits,
                             float *const *const *dpk, float *const *const *dpv);
void kvl_dense_acts_free(kvl_dense_acts_t *a);

#endif /* KVL_TRAIN_H */
