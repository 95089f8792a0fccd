/* fit.c — stage-1 fitting: capture, joint second moments in float64, ridge solves by
 * Cholesky, layer assignment, validation error and CKA (kvl_fit.h). */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_fit.h"

/* LAPACK (OpenBLAS exports it): Cholesky factorisation and solve, column-major. */
void dpotrf_(const char *uplo, const int *n, double *a, const int *lda, int *info);
void dpotrs_(const char *uplo, const int *n, const int *nrhs, const double *a, const int *lda, double *b,
             const int *ldb, int *info);

#define ADD_CHUNK 256 /* token rows per dsyrk */

struct kvl_fit_stats {
  struct kvl_model_fingerprint fp[2];
  int32_t L[2];
  int64_t w[2], off[2];
  int64_t dim;       /* L0·w0 + L1·w1 + 1; the last column is the constant */
  double *G[2];      /* K, V: dim × dim row-major, upper triangle valid */
  int64_t tokens, samples;
};

/* ---- capture ------------------------------------------------------------------------ */

int kvl_fit_capture(kvl_model_t *m, const int32_t *ids, int32_t n, int32_t chunk, const struct kvl_capture_out *o,
                    char *err, size_t errlen) {
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  if (n < 1 || chunk < 1) return kvl_errf(err, errlen, KVL_EINVAL, "capture: %d tokens, chunk %d", n, chunk);
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  int32_t nb = (n + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK;
  void *pool = calloc((size_t)nb, kvl_kv_block_bytes(&kl));
  int32_t *table = malloc((size_t)nb * sizeof(int32_t));
  int32_t *pos = malloc((size_t)chunk * sizeof(int32_t)), *seq = calloc((size_t)chunk, sizeof(int32_t));
  int8_t *want = calloc((size_t)chunk, 1);
  int *layers = malloc((size_t)hp->n_layer * sizeof(int));
  float **kp = calloc((size_t)hp->n_layer, sizeof(float *)), **vp = calloc((size_t)hp->n_layer, sizeof(float *));
  float dummy;
  int rc = 0;
  if (!pool || !table || !pos || !seq || !want || !layers || !kp || !vp) {
    rc = KVL_ENOMEM;
    goto out;
  }
  for (int32_t i = 0; i < nb; i++) table[i] = i;
  for (int l = 0; l < hp->n_layer; l++) layers[l] = l;
  const int32_t *tables[] = {table};
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  int64_t w = (int64_t)hp->n_kv_head * hp->head_dim;
  int64_t n_logits = 0;
  for (int32_t p0 = 0; p0 < n; p0 += chunk) {
    int32_t T = n - p0 < chunk ? n - p0 : chunk;
    int32_t nl = 0;
    for (int32_t i = 0; i < T; i++) {
      pos[i] = p0 + i;
      want[i] = o->logits != NULL && p0 + i >= o->logits_from;
      nl += want[i];
    }
    for (int l = 0; l < hp->n_layer; l++) {
      kp[l] = o->k ? o->k[l] + (size_t)p0 * w : NULL;
      vp[l] = o->v ? o->v[l] + (size_t)p0 * w : NULL;
    }
    struct kvl_capture cap = {hp->n_layer, layers, kp, vp};
    struct kvl_batch b = {.n_tokens = T, .tokens = ids + p0, .pos = pos, .seq = seq, .logits = want};
    float *lg = nl ? o->logits + (size_t)n_logits * hp->n_vocab : &dummy;
    /* fp32 throughout: translators are fitted and distilled on the exact model */
    if ((rc = kvl_model_forward(m, kvl_backend_fp32(kvl_backend_cpu()), &b, &kv, lg, &cap)) < 0) {
      kvl_errf(err, errlen, rc, "capture: forward failed at position %d", p0);
      goto out;
    }
    n_logits += nl;
  }
  if (o->pool) {
    *o->pool = pool;
    pool = NULL;
  }
  if (o->table) {
    *o->table = table;
    table = NULL;
  }
out:
  free(pool);
  free(table);
  free(pos);
  free(seq);
  free(want);
  free(layers);
  free(kp);
  free(vp);
  return rc;
}

/* ---- statistics --------------------------------------------------------------------- */

kvl_fit_stats_t *kvl_fit_stats_new(const struct kvl_model_fingerprint *a, const struct kvl_model_fingerprint *b,
                                   char *err, size_t errlen) {
  if (kvl_fingerprint_validate(a, err, errlen) < 0 || kvl_fingerprint_validate(b, err, errlen) < 0) return NULL;
  kvl_fit_stats_t *s = calloc(1, sizeof(*s));
  if (!s) return NULL;
  s->fp[0] = *a;
  s->fp[1] = *b;
  for (int i = 0; i < 2; i++) {
    s->L[i] = s->fp[i].n_layer;
    s->w[i] = kvl_fingerprint_kv_width(&s->fp[i]);
  }
  s->off[0] = 0;
  s->off[1] = s->L[0] * s->w[0];
  s->dim = s->off[1] + s->L[1] * s->w[1] + 1;
  for (int k = 0; k < 2; k++) {
    s->G[k] = calloc((size_t)(s->dim * s->dim), sizeof(double));
    if (!s->G[k]) {
      kvl_errf(err, errlen, KVL_ENOMEM, "fit statistics: %lld x %lld doubles", (long long)s->dim,
               (long long)s->dim);
      kvl_fit_stats_free(s);
      return NULL;
    }
  }
  return s;
}

void kvl_fit_stats_free(kvl_fit_stats_t *s) {
  if (!s) return;
  free(s->G[0]);
  free(s->G[1]);
  free(s);
}

int64_t kvl_fit_stats_tokens(const kvl_fit_stats_t *s) { return s->tokens; }
int64_t kvl_fit_stats_samples(const kvl_fit_stats_t *s) { return s->samples; }
const struct kvl_model_fingerprint *kvl_fit_stats_model(const kvl_fit_stats_t *s, int which) {
  return &s->fp[which ? 1 : 0];
}

int kvl_fit_stats_add(kvl_fit_stats_t *s, float *const *kA, float *const *vA, float *const *kB, float *const *vB,
                      const double *weight, int32_t n) {
  if (n <= 0) return 0;
  double *z = malloc((size_t)ADD_CHUNK * (size_t)s->dim * sizeof(double));
  if (!z) return KVL_ENOMEM;
  for (int kv = 0; kv < 2; kv++) {
    float *const *src[2] = {kv ? vA : kA, kv ? vB : kB};
    for (int32_t t0 = 0; t0 < n; t0 += ADD_CHUNK) {
      int32_t T = n - t0 < ADD_CHUNK ? n - t0 : ADD_CHUNK;
      for (int32_t t = 0; t < T; t++) {
        double sw = weight ? sqrt(weight[t0 + t]) : 1.0;
        double *row = z + (size_t)t * s->dim;
        for (int m = 0; m < 2; m++)
          for (int32_t l = 0; l < s->L[m]; l++) {
            const float *x = src[m][l] + (size_t)(t0 + t) * s->w[m];
            double *d = row + s->off[m] + l * s->w[m];
            for (int64_t i = 0; i < s->w[m]; i++) d[i] = sw * x[i];
          }
        row[s->dim - 1] = sw;
      }
      cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)s->dim, T, 1.0, z, (int)s->dim, 1.0, s->G[kv],
                  (int)s->dim);
    }
  }
  free(z);
  s->tokens += n;
  s->samples++;
  return 0;
}

/* ---- save / load -------------------------------------------------------------------- */

static const char STATS_MAGIC[8] = {'K', 'V', 'L', 'F', 'I', 'T', 'S', '1'};

int kvl_fit_stats_save(const kvl_fit_stats_t *s, const char *path, const char *tag, char *err, size_t errlen) {
  char tmp[4096];
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) return kvl_errf(err, errlen, KVL_EIO, "%s: %s", tmp, strerror(errno));
  uint32_t tl = (uint32_t)strlen(tag);
  int ok = fwrite(STATS_MAGIC, 8, 1, f) == 1 && fwrite(&tl, 4, 1, f) == 1 && fwrite(tag, 1, tl, f) == tl &&
           fwrite(s->fp, sizeof(s->fp), 1, f) == 1 && fwrite(&s->tokens, 8, 1, f) == 1 &&
           fwrite(&s->samples, 8, 1, f) == 1;
  for (int k = 0; ok && k < 2; k++)
    ok = fwrite(s->G[k], sizeof(double), (size_t)(s->dim * s->dim), f) == (size_t)(s->dim * s->dim);
  if (fclose(f) != 0) ok = 0;
  if (!ok || rename(tmp, path) < 0) {
    unlink(tmp);
    return kvl_errf(err, errlen, KVL_EIO, "%s: write failed (%s)", path, strerror(errno));
  }
  return 0;
}

int kvl_fit_stats_load(const char *path, const char *tag, const struct kvl_model_fingerprint *a,
                       const struct kvl_model_fingerprint *b, kvl_fit_stats_t **out, char *err, size_t errlen) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) return kvl_errf(err, errlen, KVL_ENOENT, "%s: %s", path, strerror(errno));
  char magic[8];
  uint32_t tl = 0;
  int rc = 0;
  struct kvl_model_fingerprint fp[2];
  char *t = NULL;
  kvl_fit_stats_t *s = NULL;
  if (fread(magic, 8, 1, f) != 1 || memcmp(magic, STATS_MAGIC, 8) != 0 || fread(&tl, 4, 1, f) != 1 || tl > 65536) {
    rc = kvl_errf(err, errlen, KVL_EFORMAT, "%s: not a kvlingo fit-statistics file", path);
    goto out;
  }
  t = calloc(tl + 1, 1);
  if (!t || fread(t, 1, tl, f) != tl || fread(fp, sizeof(fp), 1, f) != 1) {
    rc = kvl_errf(err, errlen, KVL_ETRUNC, "%s: truncated", path);
    goto out;
  }
  if (strcmp(t, tag) != 0) {
    rc = kvl_errf(err, errlen, KVL_EMISMATCH, "%s: made with other options (%s, now %s)", path, t, tag);
    goto out;
  }
  const struct kvl_model_fingerprint *want[2] = {a, b};
  for (int i = 0; i < 2; i++)
    if (fp[i].n_layer != want[i]->n_layer || fp[i].n_kv_head != want[i]->n_kv_head ||
        fp[i].head_dim != want[i]->head_dim || strcmp(fp[i].tokenizer_hash, want[i]->tokenizer_hash) != 0 ||
        strcmp(fp[i].architecture, want[i]->architecture) != 0) {
      rc = kvl_errf(err, errlen, KVL_EMISMATCH, "%s: model %c is %s, not %s", path, 'A' + i, fp[i].name,
                    want[i]->name);
      goto out;
    }
  if (!(s = kvl_fit_stats_new(&fp[0], &fp[1], err, errlen))) {
    rc = KVL_ENOMEM;
    goto out;
  }
  if (fread(&s->tokens, 8, 1, f) != 1 || fread(&s->samples, 8, 1, f) != 1) rc = KVL_ETRUNC;
  for (int k = 0; rc == 0 && k < 2; k++)
    if (fread(s->G[k], sizeof(double), (size_t)(s->dim * s->dim), f) != (size_t)(s->dim * s->dim)) rc = KVL_ETRUNC;
  if (rc < 0) {
    kvl_errf(err, errlen, rc, "%s: truncated", path);
    kvl_fit_stats_free(s);
    s = NULL;
  }
out:
  fclose(f);
  free(t);
  *out = s;
  return rc;
}

/* ---- solving ------------------------------------------------------------------------ */

static inline double gat(const kvl_fit_stats_t *s, int kv, int64_t i, int64_t j) {
  return i <= j ? s->G[kv][i * s->dim + j] : s->G[kv][j * s->dim + i];
}

/* Column indices of the inputs: ν source blocks, then the constant when affine. */
static int64_t *input_cols(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, const int32_t *src, int32_t nu,
                           bool affine, int64_t *p) {
  int m = dir == KVL_FIT_A_TO_B ? 0 : 1;
  *p = nu * s->w[m] + (affine ? 1 : 0);
  int64_t *idx = malloc((size_t)*p * sizeof(int64_t));
  if (!idx) return NULL;
  int64_t r = 0;
  for (int32_t j = 0; j < nu; j++)
    for (int64_t i = 0; i < s->w[m]; i++) idx[r++] = s->off[m] + src[j] * s->w[m] + i;
  if (affine) idx[r++] = s->dim - 1;
  return idx;
}

int64_t kvl_fit_map_rows(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t nu, bool affine) {
  return nu * s->w[dir == KVL_FIT_A_TO_B ? 0 : 1] + (affine ? 1 : 0);
}

static int check_args(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t layer, const int32_t *src, int32_t nu,
                      char *err, size_t errlen) {
  int ms = dir == KVL_FIT_A_TO_B ? 0 : 1, mt = 1 - ms;
  if (layer < 0 || layer >= s->L[mt]) return kvl_errf(err, errlen, KVL_ERANGE, "target layer %d out of range", layer);
  if (nu < 1 || nu > s->L[ms]) return kvl_errf(err, errlen, KVL_ERANGE, "nu %d out of range", nu);
  for (int32_t j = 0; j < nu; j++)
    if (src[j] < 0 || src[j] >= s->L[ms])
      return kvl_errf(err, errlen, KVL_ERANGE, "source layer %d out of range", src[j]);
  return 0;
}

int kvl_fit_solve(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t layer, enum kvl_translator_kv which,
                  const int32_t *sources, int32_t nu, const struct kvl_fit_solve_opts *o, double *map, char *err,
                  size_t errlen) {
  int rc = check_args(s, dir, layer, sources, nu, err, errlen);
  if (rc < 0) return rc;
  int mt = dir == KVL_FIT_A_TO_B ? 1 : 0, kv = which == KVL_TRANSLATOR_V;
  int64_t p;
  int64_t *idx = input_cols(s, dir, sources, nu, o->affine, &p);
  int64_t wt = s->w[mt], y0 = s->off[mt] + layer * wt;
  double *A = malloc((size_t)(p * p) * sizeof(double)), *B = malloc((size_t)(p * wt) * sizeof(double));
  if (!idx || !A || !B) {
    rc = KVL_ENOMEM;
    goto out;
  }
  double diag = 0;
  int64_t nd = 0;
  for (int64_t i = 0; i < p; i++) {
    for (int64_t j = 0; j < p; j++) A[j * p + i] = gat(s, kv, idx[i], idx[j]);
    if (idx[i] != s->dim - 1) {
      diag += A[i * p + i];
      nd++;
    }
  }
  double ridge = o->lambda * (nd ? diag / nd : 0);
  for (int64_t i = 0; i < p; i++)
    if (idx[i] != s->dim - 1) A[i * p + i] += ridge;
  for (int64_t c = 0; c < wt; c++)
    for (int64_t r = 0; r < p; r++) B[c * p + r] = gat(s, kv, idx[r], y0 + c);
  int ip = (int)p, nrhs = (int)wt, info = 0;
  dpotrf_("L", &ip, A, &ip, &info);
  if (info != 0) {
    rc = kvl_errf(err, errlen, KVL_EINVAL,
                  "target layer %d %s: the normal equations are not positive definite (%lld tokens; raise lambda "
                  "or add data)",
                  layer, kv ? "V" : "K", (long long)s->tokens);
    goto out;
  }
  dpotrs_("L", &ip, &nrhs, A, &ip, B, &ip, &info);
  for (int64_t r = 0; r < p; r++)
    for (int64_t c = 0; c < wt; c++) map[r * wt + c] = B[c * p + r];
out:
  free(idx);
  free(A);
  free(B);
  return rc;
}

int kvl_fit_sse(const kvl_fit_stats_t *s, enum kvl_fit_dir dir, int32_t layer, enum kvl_translator_kv which,
                const int32_t *sources, int32_t nu, bool affine, const double *map, double *sse, double *sst) {
  int mt = dir == KVL_FIT_A_TO_B ? 1 : 0, kv = which == KVL_TRANSLATOR_V;
  int64_t p;
  int64_t *idx = input_cols(s, dir, sources, nu, affine, &p);
  int64_t wt = s->w[mt], y0 = s->off[mt] + layer * wt, c1 = s->dim - 1;
  double *A = malloc((size_t)(p * p) * sizeof(double)), *M = malloc((size_t)(p * wt) * sizeof(double));
  if (!idx || !A || !M) {
    free(idx);
    free(A);
    free(M);
    return KVL_ENOMEM;
  }
  for (int64_t i = 0; i < p; i++)
    for (int64_t j = 0; j < p; j++) A[i * p + j] = gat(s, kv, idx[i], idx[j]);
  /* M = XᵀX · W */
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)p, (int)wt, (int)p, 1.0, A, (int)p, map, (int)wt, 0.0,
              M, (int)wt);
  double n = gat(s, kv, c1, c1), e = 0, t = 0;
  for (int64_t c = 0; c < wt; c++) {
    double yy = gat(s, kv, y0 + c, y0 + c), ym = gat(s, kv, c1, y0 + c);
    double xy = 0, quad = 0;
    for (int64_t r = 0; r < p; r++) {
      xy += map[r * wt + c] * gat(s, kv, idx[r], y0 + c);
      quad += map[r * wt + c] * M[r * wt + c];
    }
    e += yy - 2 * xy + quad;
    t += yy - (n > 0 ? ym * ym / n : 0);
  }
  free(idx);
  free(A);
  free(M);
  *sse = e;
  *sst = t;
  return 0;
}

/* ---- layer assignment --------------------------------------------------------------- */

const char *kvl_fit_assign_name(enum kvl_fit_assign a) {
  switch (a) {
  case KVL_ASSIGN_DEPTH: return "depth";
  case KVL_ASSIGN_R2: return "r2";
  case KVL_ASSIGN_GREEDY: return "greedy";
  }
  return "?";
}

void kvl_fit_assign_depth(int32_t n_src, int32_t n_tgt, int32_t layer, int32_t nu, int32_t *out) {
  double c = n_tgt > 1 ? (double)layer * (n_src - 1) / (n_tgt - 1) : 0;
  int32_t start = (int32_t)lround(c - (nu - 1) / 2.0);
  if (start > n_src - nu) start = n_src - nu;
  if (start < 0) start = 0;
  for (int32_t j = 0; j < nu; j++) out[j] = start + j;
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* Centred R² on val of a map fitted on fit. */
static int fit_r2(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir, int32_t layer,
                  enum kvl_translator_kv which, const int32_t *src, int32_t nu, double lambda, double *r2, char *err,
                  size_t errlen) {
  struct kvl_fit_solve_opts o = {.affine = true, .lambda = lambda};
  int64_t rows = kvl_fit_map_rows(fit, dir, nu, true), wt = fit->w[dir == KVL_FIT_A_TO_B ? 1 : 0];
  double *map = malloc((size_t)(rows * wt) * sizeof(double));
  if (!map) return KVL_ENOMEM;
  int rc = kvl_fit_solve(fit, dir, layer, which, src, nu, &o, map, err, errlen);
  double sse = 0, sst = 1;
  if (rc == 0) rc = kvl_fit_sse(val, dir, layer, which, src, nu, true, map, &sse, &sst);
  free(map);
  *r2 = sst > 0 ? 1 - sse / sst : 0;
  return rc;
}

int kvl_fit_pair_r2(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir,
                    enum kvl_translator_kv which, double lambda, double *r2, char *err, size_t errlen) {
  int ms = dir == KVL_FIT_A_TO_B ? 0 : 1, mt = 1 - ms;
  for (int32_t j = 0; j < fit->L[ms]; j++)
    for (int32_t l = 0; l < fit->L[mt]; l++) {
      int rc = fit_r2(fit, val, dir, l, which, &j, 1, lambda, &r2[j * fit->L[mt] + l], err, errlen);
      if (rc < 0) return rc;
    }
  return 0;
}

void kvl_fit_assign_r2(const double *r2, int32_t n_src, int32_t n_tgt, int32_t layer, int32_t nu, int32_t *out) {
  bool used[4096] = {0};
  for (int32_t k = 0; k < nu; k++) {
    int32_t best = -1;
    for (int32_t j = 0; j < n_src && j < 4096; j++)
      if (!used[j] && (best < 0 || r2[j * n_tgt + layer] > r2[best * n_tgt + layer])) best = j;
    used[best] = true;
    out[k] = best;
  }
  qsort(out, (size_t)nu, sizeof(int32_t), cmp_i32);
}

int kvl_fit_assign_greedy(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir,
                          int32_t layer, enum kvl_translator_kv which, int32_t nu, double lambda, int32_t *out,
                          char *err, size_t errlen) {
  int ms = dir == KVL_FIT_A_TO_B ? 0 : 1;
  int32_t sel[64];
  if (nu > 64 || nu > fit->L[ms]) return kvl_errf(err, errlen, KVL_ERANGE, "greedy: nu %d too large", nu);
  for (int32_t k = 0; k < nu; k++) {
    double best_r2 = -INFINITY;
    int32_t best = -1;
    for (int32_t j = 0; j < fit->L[ms]; j++) {
      bool taken = false;
      for (int32_t q = 0; q < k; q++) taken |= sel[q] == j;
      if (taken) continue;
      sel[k] = j;
      double r2;
      int rc = fit_r2(fit, val, dir, layer, which, sel, k + 1, lambda, &r2, err, errlen);
      if (rc < 0) return rc;
      if (r2 > best_r2) {
        best_r2 = r2;
        best = j;
      }
    }
    sel[k] = best;
  }
  memcpy(out, sel, (size_t)nu * sizeof(int32_t));
  return 0;
}

/* ---- CKA ---------------------------------------------------------------------------- */

/* Centred cross-moment block between column ranges [i0, i0+wi) and [j0, j0+wj). */
static double centred(const kvl_fit_stats_t *s, int kv, int64_t i, int64_t j, double n) {
  int64_t c1 = s->dim - 1;
  return gat(s, kv, i, j) - gat(s, kv, c1, i) * gat(s, kv, c1, j) / n;
}

static double frob2(const kvl_fit_stats_t *s, int kv, int64_t i0, int64_t wi, int64_t j0, int64_t wj, double n) {
  double f = 0;
  for (int64_t i = 0; i < wi; i++)
    for (int64_t j = 0; j < wj; j++) {
      double c = centred(s, kv, i0 + i, j0 + j, n);
      f += c * c;
    }
  return f;
}

int kvl_fit_cka(const kvl_fit_stats_t *s, enum kvl_translator_kv which, double *cka) {
  int kv = which == KVL_TRANSLATOR_V;
  double n = gat(s, kv, s->dim - 1, s->dim - 1);
  if (n <= 0) return KVL_EINVAL;
  double *self[2];
  for (int m = 0; m < 2; m++) {
    self[m] = malloc((size_t)s->L[m] * sizeof(double));
    if (!self[m]) return KVL_ENOMEM;
    for (int32_t l = 0; l < s->L[m]; l++) {
      int64_t o = s->off[m] + l * s->w[m];
      self[m][l] = sqrt(frob2(s, kv, o, s->w[m], o, s->w[m], n));
    }
  }
  for (int32_t a = 0; a < s->L[0]; a++)
    for (int32_t b = 0; b < s->L[1]; b++) {
      double x = frob2(s, kv, s->off[0] + a * s->w[0], s->w[0], s->off[1] + b * s->w[1], s->w[1], n);
      double d = self[0][a] * self[1][b];
      cka[a * s->L[1] + b] = d > 0 ? x / d : 0;
    }
  free(self[0]);
  free(self[1]);
  return 0;
}

/* ---- evaluation metrics ------------------------------------------------------------- */

void kvl_log_softmax(float *x, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++) {
    float *v = x + r * n, mx = v[0];
    for (int64_t i = 1; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += exp((double)v[i] - mx);
    float lse = mx + (float)log(sum);
    for (int64_t i = 0; i < n; i++) v[i] -= lse;
  }
}

double kvl_kl_row(const float *lp, const float *lq, int64_t n, bool *same_argmax) {
  double kl = 0;
  int64_t ap = 0, aq = 0;
  for (int64_t i = 0; i < n; i++) {
    if (lp[i] > -80.0f) kl += exp((double)lp[i]) * ((double)lp[i] - lq[i]);
    if (lp[i] > lp[ap]) ap = i;
    if (lq[i] > lq[aq]) aq = i;
  }
  if (same_argmax) *same_argmax = ap == aq;
  return kl > 0 ? kl : 0;
}

static int cmp_dbl(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

void kvl_bootstrap_ci(const double *d, int n, int reps, uint64_t seed, double *lo, double *hi) {
  double *m = malloc((size_t)reps * sizeof(double));
  if (!m || n < 1) {
    *lo = *hi = NAN;
    free(m);
    return;
  }
  uint64_t x = seed * 2862933555777941757ULL + 3037000493ULL;
  for (int r = 0; r < reps; r++) {
    double s = 0;
    for (int i = 0; i < n; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
      s += d[x % (uint64_t)n];
    }
    m[r] = s / n;
  }
  qsort(m, (size_t)reps, sizeof(double), cmp_dbl);
  *lo = m[(int)(0.025 * (reps - 1))];
  *hi = m[(int)(0.975 * (reps - 1))];
  free(m);
}
