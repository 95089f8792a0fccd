/* translator.c — the in-memory translator: building it, reading it, and checking it
 * against a pair of models. Files are in file.c; GGUF fingerprints in fingerprint.c. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "translator-impl.h"

int64_t kvl_fingerprint_kv_width(const struct kvl_model_fingerprint *fp) {
  KVL_ASSERT(fp);
  return (int64_t)fp->n_kv_head * fp->head_dim;
}

/* Is s (up to its NUL within n bytes) present, NUL-terminated and non-empty? */
static bool str_ok(const char *s, size_t n) { return s[0] && memchr(s, '\0', n); }

/* Valid UTF-8 (the file stores fingerprints as JSON)? s is NUL-terminated. */
static bool utf8_ok(const char *s) {
  json_t *j = json_string(s);
  json_decref(j);
  return j != NULL;
}

void kvl_fingerprint_of_shape(struct kvl_model_fingerprint *fp, int32_t n_layer, int32_t n_kv_head, int32_t head_dim,
                              double rope_theta, const char *name) {
  memset(fp, 0, sizeof(*fp));
  snprintf(fp->architecture, sizeof(fp->architecture), "qwen2");
  fp->n_layer = n_layer, fp->n_kv_head = n_kv_head, fp->head_dim = head_dim, fp->rope_theta = rope_theta;
  snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "none");
  snprintf(fp->tokenizer_hash, sizeof(fp->tokenizer_hash), "0");
  snprintf(fp->name, sizeof(fp->name), "%s", name ? name : "");
}

int kvl_fingerprint_validate(const struct kvl_model_fingerprint *fp, char *err, size_t errlen) {
  KVL_ASSERT(fp);
  if (!str_ok(fp->architecture, sizeof(fp->architecture)))
    return kvl_errf(err, errlen, KVL_EINVAL, "architecture is empty or too long");
  if (fp->n_layer < 1 || fp->n_layer > KVL__TR_MAX_LAYERS)
    return kvl_errf(err, errlen, KVL_EINVAL, "n_layer %d is outside 1..%d", (int)fp->n_layer,
                        KVL__TR_MAX_LAYERS);
  if (fp->n_kv_head < 1 || fp->n_kv_head > KVL__TR_MAX_HEADS)
    return kvl_errf(err, errlen, KVL_EINVAL, "n_kv_head %d is outside 1..%d", (int)fp->n_kv_head,
                        KVL__TR_MAX_HEADS);
  if (fp->head_dim < 1 || fp->head_dim > KVL__TR_MAX_HEAD_DIM)
    return kvl_errf(err, errlen, KVL_EINVAL, "head_dim %d is outside 1..%d", (int)fp->head_dim,
                        KVL__TR_MAX_HEAD_DIM);
  if (kvl_fingerprint_kv_width(fp) > KVL__TR_MAX_WIDTH)
    return kvl_errf(err, errlen, KVL_EINVAL, "KV width %lld (n_kv_head × head_dim) exceeds %d",
                        (long long)kvl_fingerprint_kv_width(fp), KVL__TR_MAX_WIDTH);
  if (!(fp->rope_theta > 0) || !isfinite(fp->rope_theta))
    return kvl_errf(err, errlen, KVL_EINVAL, "rope_theta %g is not a positive number", fp->rope_theta);
  if (!str_ok(fp->rope_scaling, sizeof(fp->rope_scaling)))
    return kvl_errf(err, errlen, KVL_EINVAL, "rope_scaling is empty or too long (use \"none\")");
  if (!str_ok(fp->tokenizer_hash, sizeof(fp->tokenizer_hash)))
    return kvl_errf(err, errlen, KVL_EINVAL, "tokenizer_hash is empty or too long");
  for (const char *c = fp->tokenizer_hash; *c; c++)
    if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
      return kvl_errf(err, errlen, KVL_EINVAL, "tokenizer_hash '%s' is not lowercase hex", fp->tokenizer_hash);
  if (!memchr(fp->name, '\0', sizeof(fp->name)))
    return kvl_errf(err, errlen, KVL_EINVAL, "name is not NUL-terminated");
  if (!utf8_ok(fp->architecture) || !utf8_ok(fp->rope_scaling) || !utf8_ok(fp->name))
    return kvl_errf(err, errlen, KVL_EINVAL, "a string field is not valid UTF-8");
  return 0;
}

int kvl_translator_new(const struct kvl_model_fingerprint *src, const struct kvl_model_fingerprint *dst,
                       bool affine, kvl_translator_t **out, char *err, size_t errlen) {
  KVL_ASSERT(src && dst && out);
  *out = NULL;
  char sub[200];
  int rc;
  if ((rc = kvl_fingerprint_validate(src, sub, sizeof(sub))) < 0)
    return kvl_errf(err, errlen, rc, "source fingerprint: %s", sub);
  if ((rc = kvl_fingerprint_validate(dst, sub, sizeof(sub))) < 0)
    return kvl_errf(err, errlen, rc, "target fingerprint: %s", sub);
  kvl_translator_t *t = calloc(1, sizeof(*t));
  if (!t) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  t->src = *src;
  t->dst = *dst;
  t->affine = affine;
  t->dtype = KVL_TRANSLATOR_F32;
  t->w_src = kvl_fingerprint_kv_width(src);
  t->w_dst = kvl_fingerprint_kv_width(dst);
  t->maps = calloc((size_t)dst->n_layer, sizeof(*t->maps));
  if (!t->maps) {
    free(t);
    return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  }
  *out = t;
  return 0;
}

void kvl_translator_free(kvl_translator_t *t) {
  if (!t) return;
  kvl_wpack_release(&t->dev);
  for (int32_t l = 0; t->maps && l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++) {
      free(t->maps[l][w].sources);
      free(t->maps[l][w].data);
      free(t->maps[l][w].wb);
      free(t->maps[l][w].wbias);
    }
  free(t->maps);
  free(t->fit_json);
  free(t->scores_json);
  free(t);
}

void kvl__tr_slot_put(kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which, int32_t *sources,
                      int32_t nu, float *data) {
  struct kvl__tr_map *m = &t->maps[layer][which];
  kvl_wpack_release(&t->dev); /* the device copy holds the old map */
  free(m->sources);
  free(m->data);
  free(m->wb);
  free(m->wbias);
  m->wb = NULL;
  m->wbias = NULL;
  t->bf16 = false; /* a new map has no bf16 copy: back to fp32 until asked again */
  m->sources = sources;
  m->data = data;
  m->nu = nu;
  m->rows = (int64_t)nu * t->w_src + (t->affine ? 1 : 0);
}

int kvl_translator_set_map(kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which,
                           const int32_t *sources, int32_t nu, const float *map) {
  KVL_ASSERT(t && sources && map);
  KVL_ASSERT(which == KVL_TRANSLATOR_K || which == KVL_TRANSLATOR_V);
  if (layer < 0 || layer >= t->dst.n_layer) return KVL_ERANGE;
  if (nu < 1 || nu > t->src.n_layer) return KVL_EINVAL;
  for (int32_t i = 0; i < nu; i++) {
    if (sources[i] < 0 || sources[i] >= t->src.n_layer) return KVL_ERANGE;
    for (int32_t j = 0; j < i; j++)
      if (sources[j] == sources[i]) return KVL_EINVAL;
  }
  /* nu <= 4096 and w <= 2^20: rows·cols < 2^53, no overflow in int64 */
  const int64_t rows = (int64_t)nu * t->w_src + (t->affine ? 1 : 0);
  const int64_t n = rows * t->w_dst;
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(map[i])) return KVL_EINVAL;
  if ((uint64_t)n > SIZE_MAX / sizeof(float)) return KVL_EOVERFLOW;
  int32_t *s = malloc((size_t)nu * sizeof(*s));
  float *d = malloc((size_t)n * sizeof(*d));
  if (!s || !d) {
    free(s);
    free(d);
    return KVL_ENOMEM;
  }
  memcpy(s, sources, (size_t)nu * sizeof(*s));
  memcpy(d, map, (size_t)n * sizeof(*d));
  kvl__tr_slot_put(t, layer, which, s, nu, d);
  return 0;
}

bool kvl__tr_is_json_object(const char *s) {
  if (!s) return true;
  json_error_t je;
  json_t *j = json_loads(s, JSON_REJECT_DUPLICATES, &je);
  bool ok = j && json_is_object(j);
  json_decref(j);
  return ok;
}

static int set_json(char **slot, const char *json) {
  if (!kvl__tr_is_json_object(json)) return KVL_EINVAL;
  char *copy = NULL;
  if (json && !(copy = strdup(json))) return KVL_ENOMEM;
  free(*slot);
  *slot = copy;
  return 0;
}

int kvl_translator_set_fit_json(kvl_translator_t *t, const char *json) {
  KVL_ASSERT(t);
  return set_json(&t->fit_json, json);
}

int kvl_translator_set_scores_json(kvl_translator_t *t, const char *json) {
  KVL_ASSERT(t);
  return set_json(&t->scores_json, json);
}

const struct kvl_model_fingerprint *kvl_translator_source(const kvl_translator_t *t) { return &t->src; }
const struct kvl_model_fingerprint *kvl_translator_target(const kvl_translator_t *t) { return &t->dst; }
bool kvl_translator_affine(const kvl_translator_t *t) { return t->affine; }
enum kvl_translator_dtype kvl_translator_dtype(const kvl_translator_t *t) { return t->dtype; }
int32_t kvl_translator_n_layer(const kvl_translator_t *t) { return t->dst.n_layer; }
const char *kvl_translator_fit_json(const kvl_translator_t *t) { return t->fit_json; }
const char *kvl_translator_scores_json(const kvl_translator_t *t) { return t->scores_json; }

int kvl_translator_get_map(const kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which,
                           struct kvl_translator_map *out) {
  KVL_ASSERT(t && out);
  KVL_ASSERT(which == KVL_TRANSLATOR_K || which == KVL_TRANSLATOR_V);
  if (layer < 0 || layer >= t->dst.n_layer) return KVL_ERANGE;
  const struct kvl__tr_map *m = &t->maps[layer][which];
  if (m->nu == 0) return KVL_ENOENT;
  *out = (struct kvl_translator_map){m->nu, m->sources, m->rows, t->w_dst, m->data};
  return 0;
}

/* ---- model check ------------------------------------------------------------------ */

/* Appends "; "-separated differences into a bounded buffer. */
struct diff {
  char *buf;
  size_t len, cap;
  int n;
};

static void diff_add(struct diff *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void diff_add(struct diff *d, const char *fmt, ...) {
  d->n++;
  if (!d->buf || !d->cap) return;
  if (d->n > 1 && d->len + 2 < d->cap) {
    memcpy(d->buf + d->len, "; ", 3);
    d->len += 2;
  }
  if (d->len + 1 >= d->cap) return;
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(d->buf + d->len, d->cap - d->len, fmt, ap);
  va_end(ap);
  if (w > 0) d->len += (size_t)w < d->cap - d->len ? (size_t)w : d->cap - d->len - 1;
}

static void compare(struct diff *d, const char *side, const struct kvl_model_fingerprint *tr,
                    const struct kvl_model_fingerprint *m) {
  if (strcmp(tr->architecture, m->architecture))
    diff_add(d, "%s architecture: translator '%s', model '%s'", side, tr->architecture, m->architecture);
  if (tr->n_layer != m->n_layer)
    diff_add(d, "%s n_layer: translator %d, model %d", side, (int)tr->n_layer, (int)m->n_layer);
  if (tr->n_kv_head != m->n_kv_head)
    diff_add(d, "%s n_kv_head: translator %d, model %d", side, (int)tr->n_kv_head, (int)m->n_kv_head);
  if (tr->head_dim != m->head_dim)
    diff_add(d, "%s head_dim: translator %d, model %d", side, (int)tr->head_dim, (int)m->head_dim);
  double a = tr->rope_theta, b = m->rope_theta;
  if (!(fabs(a - b) <= 1e-6 * fmax(fabs(a), fabs(b))))
    diff_add(d, "%s rope_theta: translator %.9g, model %.9g", side, a, b);
  if (strcmp(tr->rope_scaling, m->rope_scaling))
    diff_add(d, "%s rope_scaling: translator '%s', model '%s'", side, tr->rope_scaling, m->rope_scaling);
  if (strcmp(tr->tokenizer_hash, m->tokenizer_hash))
    diff_add(d, "%s tokenizer_hash: translator %s, model %s", side, tr->tokenizer_hash, m->tokenizer_hash);
}

int kvl_translator_check_models(const kvl_translator_t *t, const struct kvl_model_fingerprint *src,
                                const struct kvl_model_fingerprint *dst, char *err, size_t errlen) {
  KVL_ASSERT(t);
  struct diff d = {err, 0, errlen, 0};
  if (err && errlen) err[0] = '\0';
  if (src) compare(&d, "source", &t->src, src);
  if (dst) compare(&d, "target", &t->dst, dst);
  return d.n ? KVL_EMISMATCH : 0;
}
