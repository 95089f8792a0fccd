/* kvl_distill.h — stage 2: self-distillation of a translator through the frozen target
 * (DESIGN.md "Fitting translators"; the paper's stage 2).
 *
 * A sample is a prefix x₁..xₙ and a continuation y₁..yₘ from the fit split, prepared
 * once: the source's pre-RoPE K/V of x₁..xₙ₋₁ (bf16) and the target's own next-token
 * distributions at xₙ, y₁..yₘ₋₁ (top-k log-probs; the rest is tail mass). A training
 * step translates each sample's prefix with the current maps, runs the target over
 * xₙ, y₁..yₘ₋₁ on that translated cache (the dense, differentiable copy: kvl_train.h),
 * takes loss = mean over positions of KL(native ‖ translated), back-propagates through
 * the frozen target into the maps (d map = Xᵀ · d prefix, through RoPE's inverse for
 * keys) and updates them with AdamW.
 *
 *   struct kvl_distill_sample s;
 *   kvl_distill_prepare(src, dst, ids, n, m, 64, &s, err, sizeof(err));   // once per sample
 *   kvl_distill_t *d;
 *   kvl_distill_new(init_translator, dense_target, &opts, &d, err, sizeof(err));
 *   for (step...) {
 *     kvl_distill_accumulate_batch(d, batch, 8, 1.0f / 8, kl);          // grads add up
 *     kvl_distill_update(d, lr, &grad_norm);                              // clip, AdamW, zero
 *   }
 *   kvl_distill_export(d, out_translator);                                // maps -> a translator
 */
#ifndef KVL_DISTILL_H
#define KVL_DISTILL_H

#include <stddef.h>
#include <stdint.h>

#include "kvl_model.h"
#include "kvl_train.h"
#include "kvl_translator.h"

struct kvl_distill_sample {
  int32_t P;          /* prefix positions translated (n - 1) */
  int32_t m;          /* positions the target runs and is scored on */
  int32_t *tokens;    /* [m]: xₙ, y₁ .. yₘ₋₁ */
  int32_t n_layer_src, w_src;
  uint16_t *src_k;    /* bf16 [n_layer_src][P][w_src]: the source's pre-RoPE keys */
  uint16_t *src_v;    /* bf16 values, same shape */
  int32_t k;          /* top-k of each target distribution */
  int32_t *top_ids;   /* [m][k] */
  float *top_lp;      /* [m][k] native log-probs (the tail mass is 1 - Σ exp) */
};

/* Prepare a sample from ids[0 .. n + m - 1): prefix ids[0..n), continuation ids[n..n+m).
 * Runs the source over ids[0..n-1) and the target over ids[0..n+m-1) natively. */
int kvl_distill_prepare(kvl_model_t *src, kvl_model_t *dst, const int32_t *ids, int32_t n, int32_t m, int32_t topk,
                        struct kvl_distill_sample *out, char *err, size_t errlen);
void kvl_distill_sample_free(struct kvl_distill_sample *s);
/* Bytes a prepared sample holds. */
size_t kvl_distill_sample_bytes(const struct kvl_distill_sample *s);

/* The sample store: prepared samples on disk ("KVLSMPL1", a key string, the count, then
 * each sample's fields), so that a run and every resumption of it prepare them once.
 * `key` names what the samples were made from (models, corpus, split, n, m, k); load
 * returns KVL_ENOENT for a missing file and KVL_EMISMATCH for another key, and refuses a
 * truncated or inconsistent file by name (KVL_EFORMAT). Save writes a temporary file and
 * renames it. */
int kvl_distill_samples_save(const char *path, const char *key, const struct kvl_distill_sample *s, int32_t n,
                             char *err, size_t errlen);
int kvl_distill_samples_load(const char *path, const char *key, struct kvl_distill_sample **out, int32_t *n_out,
                             char *err, size_t errlen);
/* The same from memory (the fuzz target's entry). */
int kvl_distill_samples_load_mem(const void *data, size_t len, const char *key, struct kvl_distill_sample **out,
                                 int32_t *n_out, char *err, size_t errlen);

struct kvl_distill_opts {
  float beta1, beta2, eps;   /* AdamW; defaults 0.9, 0.999, 1e-8 */
  float weight_decay;        /* decoupled, towards 0; default 0 (the recipe: none) */
  float clip;                /* global gradient-norm clip; default 1.0 (0: none) */
};

typedef struct kvl_distill kvl_distill_t;

/* Trainable maps initialised from `init` (copied; every map set), training through the
 * dense target `target` (borrowed; the translator's target model). */
int kvl_distill_new(const kvl_translator_t *init, kvl_dense_t *target, const struct kvl_distill_opts *o,
                    kvl_distill_t **out, char *err, size_t errlen);
void kvl_distill_free(kvl_distill_t *d);
/* Parameters (map entries) trained. */
int64_t kvl_distill_params(const kvl_distill_t *d);

/* Forward + backward of one sample with the current maps: the gradient of its mean KL
 * is added (scaled by `scale`, e.g. 1 / batch) into the accumulators; *kl = its mean KL
 * (nats per position). */
int kvl_distill_accumulate(kvl_distill_t *d, const struct kvl_distill_sample *s, float scale, double *kl);
/* The mean KL of a sample with the current maps, no gradient. */
int kvl_distill_eval(kvl_distill_t *d, const struct kvl_distill_sample *s, double *kl);
/* The same for n samples in one batch through the target (its linear layers stream their
 * weights once for all n; the way to train on a CPU): kl[b] gets sample b's mean KL. */
int kvl_distill_accumulate_batch(kvl_distill_t *d, const struct kvl_distill_sample *const *s, int32_t n, float scale,
                                 double *kl);
int kvl_distill_eval_batch(kvl_distill_t *d, const struct kvl_distill_sample *const *s, int32_t n, double *kl);
/* Clip the accumulated gradient to the global norm, take one AdamW step at `lr`, zero
 * the accumulators. *grad_norm (optional) gets the norm before clipping. */
void kvl_distill_update(kvl_distill_t *d, float lr, double *grad_norm);
/* Steps taken so far. */
int64_t kvl_distill_steps(const kvl_distill_t *d);

/* The current maps into t (same shapes as init: a copy of it, or a translator made by
 * kvl_translator_new for the same pair). */
int kvl_distill_export(const kvl_distill_t *d, kvl_translator_t *t);
/* Checkpoint: maps, both AdamW moments and the step count, checksummed, to `path`
 * (temporary file, synced, renamed over it). Load checks the whole file (shapes, size,
 * checksum) before it changes anything: a refused checkpoint leaves d as it was. */
int kvl_distill_save(const kvl_distill_t *d, const char *path, char *err, size_t errlen);
int kvl_distill_load(kvl_distill_t *d, const char *path, char *err, size_t errlen);
/* The same from bytes in memory; `name` is the file's name for the messages. */
int kvl_distill_load_mem(kvl_distill_t *d, const void *data, size_t len, const char *name, char *err, size_t errlen);

#endif /* KVL_DISTILL_H */
