/* translator-make-seeds.c — writes small translator files, valid ones covering
 * F32 / BF16, linear / affine, ν = 1, 2, 4, optional metadata, and a few broken ones
 * (truncated, a source id out of range, an unknown metadata key): the fuzz seed corpus
 * of fuzz-translator.
 *
 *   translator-make-seeds DIR
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_translator.h"

static struct kvl_model_fingerprint fp(const char *arch, int n_layer, int n_kv, int hd, double theta,
                                       const char *scaling, const char *name) {
  struct kvl_model_fingerprint f;
  memset(&f, 0, sizeof(f));
  snprintf(f.architecture, sizeof(f.architecture), "%s", arch);
  f.n_layer = n_layer;
  f.n_kv_head = n_kv;
  f.head_dim = hd;
  f.rope_theta = theta;
  snprintf(f.rope_scaling, sizeof(f.rope_scaling), "%s", scaling);
  snprintf(f.tokenizer_hash, sizeof(f.tokenizer_hash), "cbf29ce484222325");
  snprintf(f.name, sizeof(f.name), "%s", name);
  return f;
}

/* A translator whose target layer l reads sources l, l+1, ... (mod n_S). */
static kvl_translator_t *build(const struct kvl_model_fingerprint *s, const struct kvl_model_fingerprint *d,
                               bool affine, int nu) {
  kvl_translator_t *t;
  char err[256];
  if (kvl_translator_new(s, d, affine, &t, err, sizeof(err)) < 0) {
    fprintf(stderr, "%s\n", err);
    exit(1);
  }
  const int64_t rows = nu * kvl_fingerprint_kv_width(s) + affine, cols = kvl_fingerprint_kv_width(d);
  float m[256];
  int32_t src[8];
  for (int l = 0; l < d->n_layer; l++)
    for (int w = 0; w < 2; w++) {
      for (int i = 0; i < nu; i++) src[i] = (l + w + i) % s->n_layer;
      for (int64_t i = 0; i < rows * cols; i++) m[i] = (float)((i * 37 + l * 11 + w) % 29 - 14) / 8.0f;
      if (kvl_translator_set_map(t, l, (enum kvl_translator_kv)w, src, nu, m) < 0) exit(1);
    }
  return t;
}

static void put(const char *dir, const char *name, const void *buf, size_t len) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(buf, 1, len, f) != len || fclose(f)) {
    perror(path);
    exit(1);
  }
}

/* Write buf with the first `from` in its JSON header replaced by `to` (the header length
 * adjusted): hand-made files for paths the fuzzer reaches slowly through the JSON. */
static void put_edited(const char *dir, const char *name, const unsigned char *buf, size_t len, const char *from,
                       const char *to) {
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--) hl = hl << 8 | buf[i];
  const unsigned char *at = memmem(buf + 8, hl, from, strlen(from));
  if (!at) {
    fprintf(stderr, "%s: '%s' not in the header\n", name, from);
    exit(1);
  }
  size_t nl = len - strlen(from) + strlen(to), pre = (size_t)(at - buf);
  unsigned char *o = malloc(nl);
  memcpy(o, buf, pre);
  memcpy(o + pre, to, strlen(to));
  memcpy(o + pre + strlen(to), at + strlen(from), len - pre - strlen(from));
  hl = hl - strlen(from) + strlen(to);
  for (int i = 0; i < 8; i++) o[i] = (unsigned char)(hl >> (8 * i));
  put(dir, name, o, nl);
  free(o);
}

static void save(kvl_translator_t *t, enum kvl_translator_dtype dt, const char *dir, const char *name, void **buf,
                 size_t *len) {
  char err[256];
  if (kvl_translator_save_mem(t, dt, buf, len, err, sizeof(err)) < 0) {
    fprintf(stderr, "%s: %s\n", name, err);
    exit(1);
  }
  put(dir, name, *buf, *len);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: translator-make-seeds DIR\n");
    return 2;
  }
  const char *dir = argv[1];
  void *buf;
  size_t len;

  /* 1: linear, F32, ν = 1, one target layer */
  struct kvl_model_fingerprint s1 = fp("qwen2", 2, 1, 2, 10000.0, "none", "s"), d1 = fp("qwen2", 1, 1, 2, 10000.0, "none", "d");
  kvl_translator_t *t = build(&s1, &d1, false, 1);
  save(t, KVL_TRANSLATOR_F32, dir, "linear-f32-nu1.seed", &buf, &len);
  put_edited(dir, "rope-scaling-null.seed", buf, len, "\\\"rope_scaling\\\":\\\"none\\\"",
             "\\\"rope_scaling\\\":null");
  put_edited(dir, "broken-sources-rank2.seed", buf, len, "\"shape\":[1]", "\"shape\":[1,1]");
  put_edited(dir, "broken-rank9.seed", buf, len, "\"shape\":[1]", "\"shape\":[1,1,1,1,1,1,1,1,1]");
  put_edited(dir, "broken-shape-overflow.seed", buf, len, "\"shape\":[1]",
             "\"shape\":[4294967296,4294967296,4294967296]");
  /* broken: truncated in the data, and a source id out of range */
  put(dir, "broken-truncated.seed", buf, len - 3);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--) hl = hl << 8 | ((unsigned char *)buf)[i];
  ((unsigned char *)buf)[8 + hl] = 7; /* layers.0.k_sources[0] = 7 */
  put(dir, "broken-source-id.seed", buf, len);
  free(buf);
  kvl_translator_free(t);

  /* 2: affine, BF16, ν = 2, cross-width, fit and scores */
  struct kvl_model_fingerprint s2 = fp("qwen2", 3, 1, 2, 1000000.0, "none", "Qwen2.5-Coder-0.5B"),
                               d2 = fp("qwen2", 2, 2, 2, 1000000.0, "none", "Qwen2.5-Coder-1.5B");
  t = build(&s2, &d2, true, 2);
  kvl_translator_set_fit_json(t, "{\"method\":\"ridge\",\"lambda\":0.01,\"assignment\":\"depth\"}");
  kvl_translator_set_scores_json(t, "{\"kl\":0.25,\"dlnppl\":[0.1,0.3]}");
  save(t, KVL_TRANSLATOR_BF16, dir, "affine-bf16-nu2.seed", &buf, &len);
  /* broken: an unknown kvlingo.* key (same length: the header length still holds) */
  char *k = memmem(buf, len, "kvlingo.dtype", 13);
  if (k) memcpy(k, "kvlingo.dtypx", 13);
  put(dir, "broken-meta-key.seed", buf, len);
  free(buf);
  kvl_translator_free(t);

  /* 3: affine, F32, ν = 2, RoPE scaling and a non-ASCII name */
  struct kvl_model_fingerprint s3 = fp("gemma3", 2, 1, 1, 10000.0, "yarn:4", "\xce\xbd-small"),
                               d3 = fp("qwen2", 2, 1, 2, 500000.0, "linear:2", "large");
  t = build(&s3, &d3, true, 2);
  save(t, KVL_TRANSLATOR_F32, dir, "affine-f32-scaling.seed", &buf, &len);
  free(buf);
  kvl_translator_free(t);

  /* 4: linear, BF16, ν = 4 */
  struct kvl_model_fingerprint s4 = fp("qwen2", 4, 1, 1, 10000.0, "none", "a"), d4 = fp("qwen2", 2, 1, 2, 10000.0, "none", "b");
  t = build(&s4, &d4, false, 4);
  save(t, KVL_TRANSLATOR_BF16, dir, "linear-bf16-nu4.seed", &buf, &len);
  free(buf);
  kvl_translator_free(t);
  return 0;
}
