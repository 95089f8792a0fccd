/* distill.c — stage-2 self-distillation of translator maps (kvl_distill.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "kvl_distill.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_fit.h"
#include "kvl_quant.h"

/* ---- samples -------------------------------------------------------------------------- */

void kvl_distill_sample_free(struct kvl_distill_sample *s) {
  if (!s) return;
  free(s->tokens);
  free(s->src_k);
  free(s->src_v);
  free(s->top_ids);
  free(s->top_lp);
  memset(s, 0, sizeof(*s));
}

size_t kvl_distill_sample_bytes(const struct kvl_distill_sample *s) {
  return (size_t)s->m * sizeof(int32_t) + 2 * (size_t)s->n_layer_src * s->P * s->w_src * sizeof(uint16_t) +
         (size_t)s->m * s->k * (sizeof(int32_t) + sizeof(float));
}

/* The k largest of row[0..n) as log-probs (log_softmax), largest first. */
static void top_k(const float *row, int32_t n, int32_t k, int32_t *ids, float *lp) {
  float mx = -INFINITY;
  for (int32_t i = 0; i < n; i++) mx = row[i] > mx ? row[i] : mx;
  double z = 0;
  for (int32_t i = 0; i < n; i++) z += exp((double)row[i] - mx);
  float lz = mx + (float)log(z);
  int32_t have = 0;
  for (int32_t i = 0; i < n; i++) {
    if (have == k && row[i] <= row[ids[k - 1]]) continue;
    int32_t j = have < k ? have++ : k - 1; /* insertion into the sorted short list */
    while (j > 0 && row[ids[j - 1]] < row[i]) {
      ids[j] = ids[j - 1];
      j--;
    }
    ids[j] = i;
  }
  for (int32_t j = 0; j < have; j++) lp[j] = row[ids[j]] - lz;
}

int kvl_distill_prepare(kvl_model_t *src, kvl_model_t *dst, const int32_t *ids, int32_t n, int32_t m, int32_t topk,
                        struct kvl_distill_sample *out, char *err, size_t errlen) {
  memset(out, 0, sizeof(*out));
  if (n < 2 || m < 1 || topk < 1) return kvl_errf(err, errlen, KVL_EINVAL, "distill sample: prefix %d, continuation %d, top-k %d", n, m, topk);
  const struct kvl_model_hparams *hs = kvl_model_hparams(src), *hd = kvl_model_hparams(dst);
  const int32_t P = n - 1, LS = hs->n_layer, W = hs->n_kv_head * hs->head_dim, V = hd->n_vocab;
  if (topk > V) topk = V;
  out->P = P;
  out->m = m;
  out->n_layer_src = LS;
  out->w_src = W;
  out->k = topk;
  float **k = calloc((size_t)LS, sizeof(float *)), **v = calloc((size_t)LS, sizeof(float *));
  float *logits = malloc((size_t)m * V * sizeof(float));
  out->tokens = malloc((size_t)m * sizeof(int32_t));
  out->src_k = malloc((size_t)LS * P * W * sizeof(uint16_t));
  out->src_v = malloc((size_t)LS * P * W * sizeof(uint16_t));
  out->top_ids = malloc((size_t)m * topk * sizeof(int32_t));
  out->top_lp = malloc((size_t)m * topk * sizeof(float));
  int rc = k && v && logits && out->tokens && out->src_k && out->src_v && out->top_ids && out->top_lp ? 0 : KVL_ENOMEM;
  for (int32_t l = 0; l < LS && rc == 0; l++)
    if (!(k[l] = malloc((size_t)P * W * sizeof(float))) || !(v[l] = malloc((size_t)P * W * sizeof(float)))) rc = KVL_ENOMEM;
  if (rc == 0) rc = kvl_fit_capture(src, ids, P, 256, &(struct kvl_capture_out){.k = k, .v = v}, err, errlen);
  if (rc == 0)
    rc = kvl_fit_capture(dst, ids, n + m - 1, 256, &(struct kvl_capture_out){.logits = logits, .logits_from = n - 1}, err,
                         errlen);
  if (rc == 0) {
    for (int32_t l = 0; l < LS; l++)
      for (size_t i = 0; i < (size_t)P * W; i++) {
        out->src_k[(size_t)l * P * W + i] = kvl_fp32_to_bf16(k[l][i]);
        out->src_v[(size_t)l * P * W + i] = kvl_fp32_to_bf16(v[l][i]);
      }
    for (int32_t t = 0; t < m; t++) {
      out->tokens[t] = ids[n - 1 + t];
      top_k(logits + (size_t)t * V, V, topk, out->top_ids + (size_t)t * topk, out->top_lp + (size_t)t * topk);
    }
  }
  for (int32_t l = 0; l < LS && k && v; l++) {
    free(k[l]);
    free(v[l]);
  }
  free(k);
  free(v);
  free(logits);
  if (rc == KVL_ENOMEM) kvl_errf(err, errlen, rc, "distill sample: out of memory");
  if (rc < 0) kvl_distill_sample_free(out);
  return rc;
}

/* ---- the sample store ------------------------------------------------------------------- */

#define SAMPLE_MAGIC "KVLSMPL1"
#define SAMPLE_MAX_DIM (1 << 24)

int kvl_distill_samples_save(const char *path, const char *key, const struct kvl_distill_sample *s, int32_t n,
                             char *err, size_t errlen) {
  char tmp[4200];
  snprintf(tmp, sizeof(tmp), "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (!f) return kvl_errf(err, errlen, KVL_EIO, "sample store %s: %s", tmp, strerror(errno));
  uint32_t klen = (uint32_t)strlen(key);
  bool ok = fwrite(SAMPLE_MAGIC, 1, 8, f) == 8 && fwrite(&klen, sizeof(klen), 1, f) == 1 &&
            fwrite(key, 1, klen, f) == klen && fwrite(&n, sizeof(n), 1, f) == 1;
  for (int32_t i = 0; i < n && ok; i++) {
    const struct kvl_distill_sample *x = &s[i];
    int32_t dims[5] = {x->P, x->m, x->n_layer_src, x->w_src, x->k};
    size_t kv = (size_t)x->n_layer_src * x->P * x->w_src, top = (size_t)x->m * x->k;
    ok = fwrite(dims, sizeof(dims), 1, f) == 1 && fwrite(x->tokens, sizeof(int32_t), (size_t)x->m, f) == (size_t)x->m &&
         fwrite(x->src_k, sizeof(uint16_t), kv, f) == kv && fwrite(x->src_v, sizeof(uint16_t), kv, f) == kv &&
         fwrite(x->top_ids, sizeof(int32_t), top, f) == top && fwrite(x->top_lp, sizeof(float), top, f) == top;
  }
  if (fclose(f) != 0) ok = false;
  if (!ok || rename(tmp, path) != 0) {
    remove(tmp);
    return kvl_errf(err, errlen, KVL_EIO, "sample store %s: write failed", path);
  }
  return 0;
}

/* Reads a store from f (closed here); `path` names it in errors. */
static int load_stream(FILE *f, const char *path, const char *key, struct kvl_distill_sample **out, int32_t *n_out,
                       char *err, size_t errlen) {
  char magic[8];
  uint32_t klen = 0;
  int32_t n = 0;
  /* the file's size bounds every count and allocation below */
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  if (size < 0 || fseek(f, 0, SEEK_SET) != 0) size = -1;
  bool ok = size >= 0 && fread(magic, 1, 8, f) == 8 && !memcmp(magic, SAMPLE_MAGIC, 8) && fread(&klen, sizeof(klen), 1, f) == 1 &&
            klen < 65536;
  char *k = ok ? malloc((size_t)klen + 1) : NULL;
  ok = ok && k && fread(k, 1, klen, f) == klen;
  if (ok) k[klen] = 0;
  if (ok && strcmp(k, key) != 0) {
    free(k);
    fclose(f);
    return kvl_errf(err, errlen, KVL_EMISMATCH, "sample store %s: made for other options", path);
  }
  free(k);
  ok = ok && fread(&n, sizeof(n), 1, f) == 1 && n >= 0 && n <= SAMPLE_MAX_DIM &&
       (int64_t)n * 5 * (int64_t)sizeof(int32_t) <= (int64_t)size - ftell(f);
  struct kvl_distill_sample *s = ok ? calloc((size_t)(n > 0 ? n : 1), sizeof(*s)) : NULL;
  ok = ok && s;
  int32_t got = 0;
  for (; got < n && ok; got++) {
    struct kvl_distill_sample *x = &s[got];
    int32_t dims[5];
    ok = fread(dims, sizeof(dims), 1, f) == 1;
    for (int j = 0; j < 5 && ok; j++) ok = dims[j] > 0 && dims[j] <= SAMPLE_MAX_DIM;
    if (!ok) break;
    x->P = dims[0], x->m = dims[1], x->n_layer_src = dims[2], x->w_src = dims[3], x->k = dims[4];
    size_t kv = (size_t)x->n_layer_src * x->P * x->w_src, top = (size_t)x->m * x->k;
    ok = kv <= ((size_t)1 << 40) && top <= ((size_t)1 << 40) &&
         (size_t)x->m * 4 + kv * 4 + top * 8 <= (size_t)(size - ftell(f));
    x->tokens = ok ? malloc((size_t)x->m * sizeof(int32_t)) : NULL;
    x->src_k = ok ? malloc(kv * sizeof(uint16_t)) : NULL;
    x->src_v = ok ? malloc(kv * sizeof(uint16_t)) : NULL;
    x->top_ids = ok ? malloc(top * sizeof(int32_t)) : NULL;
    x->top_lp = ok ? malloc(top * sizeof(float)) : NULL;
    ok = ok && x->tokens && x->src_k && x->src_v && x->top_ids && x->top_lp &&
         fread(x->tokens, sizeof(int32_t), (size_t)x->m, f) == (size_t)x->m &&
         fread(x->src_k, sizeof(uint16_t), kv, f) == kv && fread(x->src_v, sizeof(uint16_t), kv, f) == kv &&
         fread(x->top_ids, sizeof(int32_t), top, f) == top && fread(x->top_lp, sizeof(float), top, f) == top;
  }
  ok = ok && fgetc(f) == EOF;
  fclose(f);
  if (!ok) {
    for (int32_t i = 0; s && i < n; i++) kvl_distill_sample_free(&s[i]); /* calloc'd: unread ones are empty */
    free(s);
    return kvl_errf(err, errlen, KVL_EFORMAT, "sample store %s: truncated or not a sample store", path);
  }
  *out = s;
  *n_out = n;
  return 0;
}

int kvl_distill_samples_load(const char *path, const char *key, struct kvl_distill_sample **out, int32_t *n_out,
                             char *err, size_t errlen) {
  *out = NULL;
  *n_out = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return kvl_errf(err, errlen, KVL_ENOENT, "sample store %s: %s", path, strerror(errno));
  return load_stream(f, path, key, out, n_out, err, errlen);
}

int kvl_distill_samples_load_mem(const void *data, size_t len, const char *key, struct kvl_distill_sample **out,
                                 int32_t *n_out, char *err, size_t errlen) {
  *out = NULL;
  *n_out = 0;
  FILE *f = len ? fmemopen((void *)data, len, "rb") : NULL;
  if (!f) return kvl_errf(err, errlen, KVL_EFORMAT, "sample store <memory>: empty");
  return load_stream(f, "<memory>", key, out, n_out, err, errlen);
}

/* ---- the trainable maps ------------------------------------------------------------------ */

struct pmap {
  int32_t nu, sources[64];
  int64_t rows, cols;
  float *w, *g, *m1, *m2;
};

struct kvl_distill {
  kvl_dense_t *target;
  struct kvl_distill_opts o;
  bool affine;
  int32_t n_layer, w_src, w_dst;
  struct pmap *maps; /* [n_layer][2]: K then V */
  int64_t step, params;
  struct kvl_model_fingerprint fp_src, fp_dst;
};

void kvl_distill_free(kvl_distill_t *d) {
  if (!d) return;
  for (int32_t i = 0; d->maps && i < 2 * d->n_layer; i++) {
    free(d->maps[i].w);
    free(d->maps[i].g);
    free(d->maps[i].m1);
    free(d->maps[i].m2);
  }
  free(d->maps);
  free(d);
}

int kvl_distill_new(const kvl_translator_t *init, kvl_dense_t *target, const struct kvl_distill_opts *o,
                    kvl_distill_t **out, char *err, size_t errlen) {
  *out = NULL;
  kvl_distill_t *d = calloc(1, sizeof(*d));
  if (!d) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  d->target = target;
  d->o = o ? *o : (struct kvl_distill_opts){0};
  if (d->o.beta1 == 0) d->o.beta1 = 0.9f;
  if (d->o.beta2 == 0) d->o.beta2 = 0.999f;
  if (d->o.eps == 0) d->o.eps = 1e-8f;
  if (d->o.clip == 0 && !o) d->o.clip = 1.0f;
  d->affine = kvl_translator_affine(init);
  d->fp_src = *kvl_translator_source(init);
  d->fp_dst = *kvl_translator_target(init);
  d->n_layer = kvl_translator_n_layer(init);
  d->w_src = d->fp_src.n_kv_head * d->fp_src.head_dim;
  d->w_dst = d->fp_dst.n_kv_head * d->fp_dst.head_dim;
  const struct kvl_model_hparams *hp = kvl_model_hparams(kvl_dense_model(target));
  if (hp->n_layer != d->n_layer || hp->n_kv_head * hp->head_dim != d->w_dst) {
    kvl_distill_free(d);
    return kvl_errf(err, errlen, KVL_EMISMATCH, "distill: the translator's target is not the dense model '%s'", hp->name);
  }
  d->maps = calloc((size_t)d->n_layer * 2, sizeof(*d->maps));
  if (!d->maps) {
    kvl_distill_free(d);
    return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  }
  for (int32_t l = 0; l < d->n_layer; l++)
    for (int which = 0; which < 2; which++) {
      struct kvl_translator_map tm;
      int rc = kvl_translator_get_map(init, l, (enum kvl_translator_kv)which, &tm);
      if (rc < 0 || tm.nu > 64) {
        kvl_distill_free(d);
        return kvl_errf(err, errlen, rc < 0 ? rc : KVL_ENOTSUP, "distill: layer %d's %s map is not usable", l, which ? "V" : "K");
      }
      struct pmap *p = &d->maps[2 * l + which];
      p->nu = tm.nu;
      memcpy(p->sources, tm.sources, (size_t)tm.nu * sizeof(int32_t));
      p->rows = tm.rows;
      p->cols = tm.cols;
      size_t n = (size_t)tm.rows * tm.cols;
      p->w = malloc(n * sizeof(float));
      p->g = calloc(n, sizeof(float));
      p->m1 = calloc(n, sizeof(float));
      p->m2 = calloc(n, sizeof(float));
      if (!p->w || !p->g || !p->m1 || !p->m2) {
        kvl_distill_free(d);
        return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
      }
      memcpy(p->w, tm.data, n * sizeof(float));
      d->params += (int64_t)n;
    }
  *out = d;
  return 0;
}

int64_t kvl_distill_params(const kvl_distill_t *d) { return d->params; }
int64_t kvl_distill_steps(const kvl_distill_t *d) { return d->step; }

/* X = the map's source rows of the sample, concatenated (+ a column of ones): [P][rows]. */
static void gather(const kvl_distill_t *d, const struct pmap *p, const uint16_t *src, int32_t P, float *x) {
  const int32_t W = d->w_src;
  for (int32_t t = 0; t < P; t++) {
    float *row = x + (size_t)t * p->rows;
    for (int32_t j = 0; j < p->nu; j++) {
      const uint16_t *s = src + ((size_t)p->sources[j] * P + t) * W;
      for (int32_t i = 0; i < W; i++) row[(size_t)j * W + i] = kvl_bf16_to_fp32(s[i]);
    }
    if (d->affine) row[p->rows - 1] = 1.0f;
  }
}

/* The forward (and, with grads, the backward) of n samples in one batch through the
 * target: kl[b] gets sample b's mean KL; its gradient is added scaled by scale / m_b. */
static int run(kvl_distill_t *d, const struct kvl_distill_sample *const *s, int32_t n, float scale, double *kl,
               bool grads) {
  const int32_t L = d->n_layer, W = d->w_dst;
  const kvl_model_t *tm = kvl_dense_model(d->target);
  const int32_t V = kvl_model_hparams(tm)->n_vocab, KVH = d->fp_dst.n_kv_head;
  int64_t rows = 0, max_P = 0, max_rows = 0;
  for (int32_t b = 0; b < n; b++) {
    if (s[b]->n_layer_src != d->fp_src.n_layer || s[b]->w_src != d->w_src) return KVL_EMISMATCH;
    for (int32_t i = 0; i < s[b]->m; i++)
      if (s[b]->tokens[i] < 0 || s[b]->tokens[i] >= V) return KVL_EFORMAT;
    for (int64_t i = 0; i < (int64_t)s[b]->m * s[b]->k; i++)
      if (s[b]->top_ids[i] < 0 || s[b]->top_ids[i] >= V) return KVL_EFORMAT;
    rows += s[b]->m;
    max_P = s[b]->P > max_P ? s[b]->P : max_P;
  }
  for (int32_t i = 0; i < 2 * L; i++) max_rows = d->maps[i].rows > max_rows ? d->maps[i].rows : max_rows;
  /* pk[b][l], pv[b][l]: sample b's translated prefix (then, with grads, its gradient) */
  float ***pk = calloc((size_t)n, sizeof(float **)), ***pv = calloc((size_t)n, sizeof(float **));
  struct kvl_dense_seq *seq = calloc((size_t)n, sizeof(*seq));
  float *x = malloc((size_t)max_P * max_rows * sizeof(float)), *logits = malloc((size_t)rows * V * sizeof(float));
  float *dlog = grads ? malloc((size_t)rows * V * sizeof(float)) : NULL;
  int32_t *pos = malloc((size_t)(max_P ? max_P : 1) * sizeof(int32_t));
  int rc = pk && pv && seq && x && logits && pos && (!grads || dlog) ? 0 : KVL_ENOMEM;
  for (int32_t b = 0; b < n && rc == 0; b++) {
    if (!(pk[b] = calloc((size_t)L, sizeof(float *))) || !(pv[b] = calloc((size_t)L, sizeof(float *)))) rc = KVL_ENOMEM;
    for (int32_t l = 0; l < L && rc == 0; l++)
      if (!(pk[b][l] = calloc((size_t)s[b]->P * W, sizeof(float))) || !(pv[b][l] = calloc((size_t)s[b]->P * W, sizeof(float))))
        rc = KVL_ENOMEM;
  }
  for (int32_t t = 0; t < max_P && pos; t++) pos[t] = t;
  const struct kvl_rope *rope = kvl_model_rope(tm);
  /* the translated prefixes: K = rope(X·Mk), V = Y·Mv */
  for (int32_t b = 0; b < n && rc == 0; b++) {
    const int32_t P = s[b]->P;
    for (int32_t l = 0; l < L; l++)
      for (int which = 0; which < 2; which++) {
        const struct pmap *p = &d->maps[2 * l + which];
        gather(d, p, which ? s[b]->src_v : s[b]->src_k, P, x);
        kvl_sgemm(false, false, P, p->cols, p->rows, 1.0f, x, p->rows, p->w, p->cols, 0.0f,
                  which ? pv[b][l] : pk[b][l], W);
        if (!which) kvl_op_rope_forward(rope, pk[b][l], pos, P, KVH);
      }
    seq[b] = (struct kvl_dense_seq){.pk = (const float *const *)pk[b], .pv = (const float *const *)pv[b], .P = P,
                                    .tokens = s[b]->tokens, .T = s[b]->m};
  }
  kvl_dense_acts_t *acts = NULL;
  if (rc == 0) rc = kvl_dense_forward_batch(d->target, seq, n, logits, &acts);
  for (int32_t b = 0, r = 0; b < n && rc == 0; r += s[b]->m, b++) {
    const int32_t m = s[b]->m;
    double sum = 0;
    for (int32_t t = 0; t < m; t++) {
      const size_t row = (size_t)(r + t);
      sum += kvl_op_kl_topk(logits + row * V, V, s[b]->top_ids + (size_t)t * s[b]->k,
                            s[b]->top_lp + (size_t)t * s[b]->k, s[b]->k, grads ? dlog + row * V : NULL, scale / (float)m);
    }
    if (kl) kl[b] = sum / m;
  }
  if (rc == 0 && grads) {
    for (int32_t b = 0; b < n; b++)
      for (int32_t l = 0; l < L; l++) {
        memset(pk[b][l], 0, (size_t)s[b]->P * W * sizeof(float));
        memset(pv[b][l], 0, (size_t)s[b]->P * W * sizeof(float));
      }
    rc = kvl_dense_backward_batch(d->target, acts, dlog, (float *const *const *)pk, (float *const *const *)pv);
    /* pk, pv now hold the gradients */
    for (int32_t b = 0; b < n && rc == 0; b++) {
      const int32_t P = s[b]->P;
      for (int32_t l = 0; l < L; l++)
        for (int which = 0; which < 2; which++) {
          struct pmap *p = &d->maps[2 * l + which];
          if (!which) kvl_op_rope_backward(rope, pk[b][l], pos, P, KVH);
          gather(d, p, which ? s[b]->src_v : s[b]->src_k, P, x);
          kvl_sgemm(true, false, p->rows, p->cols, P, 1.0f, x, p->rows, which ? pv[b][l] : pk[b][l], W, 1.0f, p->g,
                    p->cols);
        }
    }
  }
  kvl_dense_acts_free(acts);
  for (int32_t b = 0; b < n; b++) {
    for (int32_t l = 0; l < L && pk && pk[b]; l++) free(pk[b][l]);
    for (int32_t l = 0; l < L && pv && pv[b]; l++) free(pv[b][l]);
    if (pk) free(pk[b]);
    if (pv) free(pv[b]);
  }
  free(pk);
  free(pv);
  free(seq);
  free(x);
  free(logits);
  free(dlog);
  free(pos);
  return rc;
}

int kvl_distill_accumulate_batch(kvl_distill_t *d, const struct kvl_distill_sample *const *s, int32_t n, float scale,
                                 double *kl) {
  return n < 1 ? KVL_EINVAL : run(d, s, n, scale, kl, true);
}

int kvl_distill_eval_batch(kvl_distill_t *d, const struct kvl_distill_sample *const *s, int32_t n, double *kl) {
  return n < 1 ? KVL_EINVAL : run(d, s, n, 1.0f, kl, false);
}

int kvl_distill_accumulate(kvl_distill_t *d, const struct kvl_distill_sample *s, float scale, double *kl) {
  double k = 0;
  int rc = run(d, &s, 1, scale, &k, true);
  if (kl) *kl = k;
  return rc;
}

int kvl_distill_eval(kvl_distill_t *d, const struct kvl_distill_sample *s, double *kl) {
  double k = 0;
  int rc = run(d, &s, 1, 1.0f, &k, false);
  if (kl) *kl = k;
  return rc;
}

void kvl_distill_update(kvl_distill_t *d, float lr, double *grad_norm) {
  double ss = 0;
  for (int32_t i = 0; i < 2 * d->n_layer; i++) {
    const struct pmap *p = &d->maps[i];
    for (int64_t j = 0; j < p->rows * p->cols; j++) ss += (double)p->g[j] * p->g[j];
  }
  double norm = sqrt(ss), f = d->o.clip > 0 && norm > d->o.clip ? d->o.clip / norm : 1.0;
  if (grad_norm) *grad_norm = norm;
  d->step++;
  const double b1 = d->o.beta1, b2 = d->o.beta2, c1 = 1.0 - pow(b1, (double)d->step), c2 = 1.0 - pow(b2, (double)d->step);
  for (int32_t i = 0; i < 2 * d->n_layer; i++) {
    struct pmap *p = &d->maps[i];
    for (int64_t j = 0; j < p->rows * p->cols; j++) {
      double g = p->g[j] * f;
      p->m1[j] = (float)(b1 * p->m1[j] + (1 - b1) * g);
      p->m2[j] = (float)(b2 * p->m2[j] + (1 - b2) * g * g);
      double upd = (p->m1[j] / c1) / (sqrt(p->m2[j] / c2) + d->o.eps) + d->o.weight_decay * p->w[j];
      p->w[j] -= (float)(lr * upd);
      p->g[j] = 0;
    }
  }
}

int kvl_distill_export(const kvl_distill_t *d, kvl_translator_t *t) {
  for (int32_t l = 0; l < d->n_layer; l++)
    for (int which = 0; which < 2; which++) {
      const struct pmap *p = &d->maps[2 * l + which];
      int rc = kvl_translator_set_map(t, l, (enum kvl_translator_kv)which, p->sources, p->nu, p->w);
      if (rc < 0) return rc;
    }
  return 0;
}

/* ---- checkpoints: "KVLDIST2", step, map count, then per map rows, cols, w, m1, m2, and a
 * crc32 of all that (zlib's). "KVLDIST1" (before 2026-12-02) is the same without the crc. */

static bool put_crc(FILE *f, const void *p, size_t size, size_t n, uLong *crc) {
  *crc = crc32(*crc, p, (uInt)(size * n));
  return fwrite(p, size, n, f) == n;
}

int kvl_distill_save(const kvl_distill_t *d, const char *path, char *err, size_t errlen) {
  char tmp[4200];
  snprintf(tmp, sizeof(tmp), "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (!f) return kvl_errf(err, errlen, KVL_EIO, "checkpoint %s: %s", tmp, strerror(errno));
  int64_t n = 2 * (int64_t)d->n_layer;
  uLong crc = crc32(0L, Z_NULL, 0);
  bool ok = put_crc(f, "KVLDIST2", 1, 8, &crc) && put_crc(f, &d->step, sizeof(d->step), 1, &crc) &&
            put_crc(f, &n, sizeof(n), 1, &crc);
  for (int64_t i = 0; i < n && ok; i++) {
    const struct pmap *p = &d->maps[i];
    size_t e = (size_t)(p->rows * p->cols);
    ok = put_crc(f, &p->rows, sizeof(p->rows), 1, &crc) && put_crc(f, &p->cols, sizeof(p->cols), 1, &crc) &&
         put_crc(f, p->w, sizeof(float), e, &crc) && put_crc(f, p->m1, sizeof(float), e, &crc) &&
         put_crc(f, p->m2, sizeof(float), e, &crc);
  }
  uint32_t c32 = (uint32_t)crc;
  ok = ok && fwrite(&c32, 4, 1, f) == 1 && fflush(f) == 0 && fsync(fileno(f)) == 0; /* on disk before the rename */
  if (fclose(f) != 0) ok = false;
  if (!ok || rename(tmp, path) != 0) {
    remove(tmp);
    return kvl_errf(err, errlen, KVL_EIO, "checkpoint %s: write failed", path);
  }
  return 0;
}

/* Read what save wrote, checking the shapes against d's maps; into d's maps only when
 * `into` (the second pass), otherwise into a scratch buffer (the first pass only checks).
 * Returns 0, or 1 for a wrong shape or size, 2 for a checksum mismatch. */
static int ckpt_pass(kvl_distill_t *d, FILE *f, bool into, int64_t *step_out) {
  char magic[8];
  int64_t step, n;
  if (fread(magic, 1, 8, f) != 8) return 1;
  bool v2 = !memcmp(magic, "KVLDIST2", 8);
  if (!v2 && memcmp(magic, "KVLDIST1", 8)) return 1;
  uLong crc = crc32(crc32(0L, Z_NULL, 0), (const Bytef *)magic, 8);
  if (fread(&step, sizeof(step), 1, f) != 1 || fread(&n, sizeof(n), 1, f) != 1 || step < 0 || n != 2 * (int64_t)d->n_layer)
    return 1;
  crc = crc32(crc, (const Bytef *)&step, sizeof(step));
  crc = crc32(crc, (const Bytef *)&n, sizeof(n));
  float *scratch = NULL;
  int bad = 0;
  for (int64_t i = 0; i < n && !bad; i++) {
    struct pmap *p = &d->maps[i];
    int64_t rc[2];
    if (fread(rc, sizeof(int64_t), 2, f) != 2 || rc[0] != p->rows || rc[1] != p->cols) { bad = 1; break; }
    crc = crc32(crc, (const Bytef *)rc, sizeof(rc));
    size_t e = (size_t)(p->rows * p->cols);
    float *dst[3] = {p->w, p->m1, p->m2};
    if (!into) {
      float *ns = realloc(scratch, e * sizeof(float));
      if (!ns) { bad = 1; break; }
      scratch = ns;
    }
    for (int k = 0; k < 3 && !bad; k++) {
      float *to = into ? dst[k] : scratch;
      if (fread(to, sizeof(float), e, f) != e) { bad = 1; break; }
      crc = crc32(crc, (const Bytef *)to, (uInt)(e * sizeof(float)));
    }
  }
  free(scratch);
  if (bad) return 1;
  uint32_t c32 = 0;
  if (v2 && fread(&c32, 4, 1, f) != 1) return 1;
  if (fgetc(f) != EOF) return 1;
  if (v2 && c32 != (uint32_t)crc) return 2;
  *step_out = step;
  return 0;
}

static int ckpt_load_stream(kvl_distill_t *d, FILE *f, const char *path, char *err, size_t errlen) {
  int64_t step = 0;
  int bad = ckpt_pass(d, f, false, &step); /* check everything before touching the maps */
  if (!bad) {
    rewind(f);
    if (ckpt_pass(d, f, true, &step))
      return kvl_errf(err, errlen, KVL_EIO, "checkpoint %s changed while it was read: start over", path);
  }
  if (bad == 2) return kvl_errf(err, errlen, KVL_EFORMAT, "checkpoint %s: checksum mismatch (damaged)", path);
  if (bad) return kvl_errf(err, errlen, KVL_EFORMAT, "checkpoint %s: not a checkpoint of these maps (shapes or size differ)", path);
  d->step = step;
  return 0;
}

int kvl_distill_load(kvl_distill_t *d, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "rb");
  if (!f) return kvl_errf(err, errlen, KVL_ENOENT, "checkpoint %s: %s", path, strerror(errno));
  int rc = ckpt_load_stream(d, f, path, err, errlen);
  fclose(f);
  return rc;
}

int kvl_distill_load_mem(kvl_distill_t *d, const void *data, size_t len, const char *name, char *err, size_t errlen) {
  FILE *f = len ? fmemopen((void *)data, len, "rb") : NULL;
  if (!f) return len ? kvl_errf(err, errlen, KVL_ENOMEM, "checkpoint %s: %s", name, strerror(errno))
                     : kvl_errf(err, errlen, KVL_EFORMAT, "checkpoint %s: empty", name);
  int rc = ckpt_load_stream(d, f, name, err, errlen);
  fclose(f);
  return rc;
}
