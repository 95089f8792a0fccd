/* kvl_fit.h — stage-1 fitting of translators (DESIGN.md "Fitting translators"): the
 * corpora, capturing both models' pre-RoPE K and V, second-moment statistics in float64,
 * closed-form solves, layer assignment, and the evaluation metrics.
 *
 * The statistics are *joint* over a pair of models A and B: every captured token gives a
 * row z = [k_A(layer 0) | ... | k_A(layer L_A-1) | k_B(layer 0) | ... | 1] (and the same
 * for values), and the fit keeps G = Σ w_t z_tᵀ z_t, (dim × dim, dim = L_A·w_A + L_B·w_B + 1).
 * One G serves both directions (A→B reads the A×B block, B→A its transpose), every layer
 * assignment (sub-blocks), affine and linear fits (with or without the constant column),
 * centred R² and linear CKA (the constant column gives the means). Captures stream
 * through: one sample's activations are in memory at a time.
 *
 *   kvl_fit_stats_t *fit = kvl_fit_stats_new(&fpA, &fpB, err, sizeof(err));
 *   for each sample: capture A and B (kvl_fit_capture), kvl_fit_stats_add(fit, ...);
 *   struct kvl_fit_solve_opts o = {.affine = true, .lambda = 1e-3};
 *   kvl_fit_solve(fit, KVL_FIT_A_TO_B, target_layer, KVL_TRANSLATOR_K, sources, nu, &o, map, ...);
 *   kvl_fit_sse(val, ..., map, &sse, &sst);            // validation error of that map
 *
 * Ridge: (X_SᵀX_S + λ·s·I) W = X_SᵀY with s the mean diagonal of X_SᵀX_S (so λ is
 * scale-free) and the intercept not penalised. Solved by Cholesky (LAPACK dpotrf/dpotrs,
 * OpenBLAS). Everything deterministic for a given corpus and options.
 */
#ifndef KVL_FIT_H
#define KVL_FIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_model.h"
#include "kvl_tokenizer.h"
#include "kvl_translator.h"

/* ---- corpora ------------------------------------------------------------------------ */

/* One sample: a token sequence cut from one corpus file. */
struct kvl_sample {
  int32_t *ids;   /* owned */
  int32_t n;
  int32_t file;   /* index of the file among the split's lines */
  bool chat;      /* wrapped in the chat template */
  char domain[8]; /* "code" | "prose" */
};

struct kvl_corpus_opts {
  const char *split_tsv;  /* translator/corpus/split.tsv */
  const char *split;      /* "fit" | "val" | "heldout" */
  const char *domain;     /* "code" | "prose" | NULL for both (interleaved) */
  int32_t ctx;            /* tokens per sample (samples shorter than min_tokens are dropped) */
  int32_t min_tokens;
  int32_t max_per_file;   /* samples cut from one file at most */
  int64_t max_tokens;     /* stop once this many tokens are in samples (0 = no limit) */
  int32_t chat_every;     /* every k-th sample is chat-formatted (0 = never); needs chat_model */
  const kvl_model_t *chat_model; /* whose template wraps chat samples */
};

/* Read the split file, tokenise its files of that split (and domain) in file order and
 * cut samples of opts->ctx tokens. A listed file that is missing or whose size differs
 * from the split's is refused by name (the corpus changed: rerun scripts/make-corpus).
 * Chat samples: the file's window is decoded, its first half put in a user message
 * ("Continue this file:") and its second half in the assistant's, through the model's
 * template. *out is malloc'd; free with kvl_samples_free. */
int kvl_corpus_samples(const struct kvl_corpus_opts *opts, const kvl_tokenizer_t *tk, struct kvl_sample **out,
                       int32_t *n_out, char *err, size_t errlen);
void kvl_samples_free(struct kvl_sample *s, int32_t n);

/* ---- capture ------------------------------------------------------------------------ */

/* Run model m over ids[0..n) (chunks of `chunk` tokens, fp32 KV in a private pool) and
 * capture every layer's pre-RoPE keys and values: k[l] and v[l] are caller arrays of
 * n × (n_kv_head·head_dim) floats. Optionally the logits of every token (n × n_vocab)
 * and the filled cache (pool/table returned malloc'd for the caller to keep; NULL to
 * drop it). */
struct kvl_capture_out {
  float **k, **v;         /* [n_layer] arrays, or NULL not to capture */
  float *logits;          /* (n − logits_from) × n_vocab, or NULL */
  int32_t logits_from;    /* first position whose logits are wanted */
  void **pool;            /* receives the fp32 KV pool (malloc'd), or NULL */
  int32_t **table;        /* receives its block table (malloc'd), or NULL */
};
int kvl_fit_capture(kvl_model_t *m, const int32_t *ids, int32_t n, int32_t chunk, const struct kvl_capture_out *o,
                    char *err, size_t errlen);

/* ---- statistics --------------------------------------------------------------------- */

typedef struct kvl_fit_stats kvl_fit_stats_t;

enum kvl_fit_dir { KVL_FIT_A_TO_B = 0, KVL_FIT_B_TO_A = 1 };

kvl_fit_stats_t *kvl_fit_stats_new(const struct kvl_model_fingerprint *a, const struct kvl_model_fingerprint *b,
                                   char *err, size_t errlen);
void kvl_fit_stats_free(kvl_fit_stats_t *s);

/* Add n tokens: kA[l] (n × w_A) for each of A's layers, kB[l] likewise, vA, vB; weight
 * per token (NULL = 1). Accumulated in float64 (dsyrk). */
int kvl_fit_stats_add(kvl_fit_stats_t *s, float *const *kA, float *const *vA, float *const *kB, float *const *vB,
                      const double *weight, int32_t n);

/* Tokens and samples added so far (the weight sum is the constant column's moment). */
int64_t kvl_fit_stats_tokens(const kvl_fit_stats_t *s);
int64_t kvl_fit_stats_samples(const kvl_fit_stats_t *s);
const struct kvl_model_fingerprint *kvl_fit_stats_model(const kvl_fit_stats_t *s, int which /* 0 = A, 1 = B */);

/* Save / load (a checkpoint: resumable fits). The file carries both fingerprints and a
 * caller tag (the options that produced it); load refuses a file whose fingerprints or
 * tag differ, naming what differs. Saved through a temporary file renamed into place. */
int kvl_fit_stats_save(const kvl_fit_stats_t *s, const char *path, const char *tag, char *err, size_t errlen);
int kvl_fit_stats_load(const char *path, const char *tag, const struct kvl_model_fingerprint *a,
                       const struct kvl_model_fingerprint *b, kvl_fit_stats_t **out, char *err, size_t errlen);

/* ---- solving ------------------------------------------------------------------------ */

struct kvl_fit_solve_opts {
  bool affine;    /* add the intercept row */
  double lambda;  /* ridge, relative to the mean diagonal of X_SᵀX_S */
};

/* Rows of a map for ν source layers. */
int64_t kvl_fit_map_rows(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t nu, bool affine);

/* Solve one map: target layer `layer`, K or V, reading `sources` (ν source layers, in
 * concatenation order). map: rows × w_T fp64, as kvl_translator_map lays it out. */
int kvl_fit_solve(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t layer, enum kvl_translator_kv which,
                  const int32_t *sources, int32_t nu, const struct kvl_fit_solve_opts *o, double *map, char *err,
                  size_t errlen);

/* The weighted squared error of a map on the statistics `s` (fit or validation), and
 * the centred total sum of squares of the target (so R² = 1 − sse/sst). */
int kvl_fit_sse(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t layer, enum kvl_translator_kv which,
                const int32_t *sources, int32_t nu, bool affine, const double *map, double *sse, double *sst);

/* Layer assignments (DESIGN.md): */
enum kvl_fit_assign { KVL_ASSIGN_DEPTH = 0, KVL_ASSIGN_R2 = 1, KVL_ASSIGN_GREEDY = 2 };
const char *kvl_fit_assign_name(enum kvl_fit_assign a);

/* Relative depth: the ν consecutive source layers centred on ℓ·(L_S−1)/(L_T−1), shifted
 * inward at the ends of the stack. */
void kvl_fit_assign_depth(int32_t n_src, int32_t n_tgt, int32_t layer, int32_t nu, int32_t *out);

/* Single-layer centred R² on `val` of every (source layer, target layer) pair, each fitted
 * on `fit` (affine, ridge lambda): r2[src * n_tgt + tgt]. */
int kvl_fit_pair_r2(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir,
                    enum kvl_translator_kv which, double lambda, double *r2, char *err, size_t errlen);

/* The ν sources of target layer `layer`: R² (the ν best single layers from a pair_r2
 * table) or greedy (orthogonal matching pursuit: add the source layer whose joint fit on
 * `fit` has the best validation R²). R² sources come out in ascending layer order; greedy
 * ones in the order chosen, so the first k of a greedy ν are the greedy k (sort them
 * before use if the order matters). */
void kvl_fit_assign_r2(const double *r2, int32_t n_src, int32_t n_tgt, int32_t layer, int32_t nu, int32_t *out);
int kvl_fit_assign_greedy(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir,
                          int32_t layer, enum kvl_translator_kv which, int32_t nu, double lambda, int32_t *out,
                          char *err, size_t errlen);

/* Linear CKA between every layer of A and every layer of B on these statistics (keys or
 * values): cka[a * L_B + b]. */
int kvl_fit_cka(const kvl_fit_stats_t *s, enum kvl_translator_kv which, double *cka);

/* ---- evaluation metrics (kvlingo eval) ---------------------------------------------- */

/* Row-wise log-softmax in place: x[rows][n]. */
void kvl_log_softmax(float *x, int64_t rows, int64_t n);

/* Per position of two log-prob rows (reference p, other q): KL(p‖q), and whether the
 * argmaxes agree. */
double kvl_kl_row(const float *lp, const float *lq, int64_t n, bool *same_argmax);

/* Paired bootstrap of the mean of d[0..n): `reps` resamples (deterministic for `seed`);
 * lo/hi the 2.5% and 97.5% quantiles of the resampled means. */
void kvl_bootstrap_ci(const double *d, int n, int reps, uint64_t seed, double *lo, double *hi);

#endif /* KVL_FIT_H */
