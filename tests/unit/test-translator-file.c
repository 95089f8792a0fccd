/* test-translator-file.c — translator files: writer/reader round trips (fp32 exact, bf16
 * to rounding; linear and affine; ν = 1, 2, 4), every kind of malformed file refused by
 * name, translators refused against models they do not fit, fingerprints from GGUF. */
#include <jansson.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"
#include "kvl_translator.h"

static struct kvl_model_fingerprint fp_make(const char *arch, int n_layer, int n_kv, int hd, double theta,
                                            const char *hash, const char *name) {
  struct kvl_model_fingerprint fp;
  memset(&fp, 0, sizeof(fp));
  snprintf(fp.architecture, sizeof(fp.architecture), "%s", arch);
  fp.n_layer = n_layer;
  fp.n_kv_head = n_kv;
  fp.head_dim = hd;
  fp.rope_theta = theta;
  snprintf(fp.rope_scaling, sizeof(fp.rope_scaling), "none");
  snprintf(fp.tokenizer_hash, sizeof(fp.tokenizer_hash), "%s", hash);
  snprintf(fp.name, sizeof(fp.name), "%s", name);
  return fp;
}

/* A translator S→T with random maps; target layer l reads sources (l + i·step) mod n_S. */
static kvl_translator_t *make_tr(const struct kvl_model_fingerprint *s, const struct kvl_model_fingerprint *d,
                                 bool affine, int nu, unsigned long long seed) {
  kvl_translator_t *t = NULL;
  char err[256];
  int rc = kvl_translator_new(s, d, affine, &t, err, sizeof(err));
  CHECK_EQ_INT(rc, 0);
  if (rc < 0) return NULL;
  const int64_t rows = (int64_t)nu * kvl_fingerprint_kv_width(s) + affine, cols = kvl_fingerprint_kv_width(d);
  float *m = malloc((size_t)(rows * cols) * sizeof(*m));
  int32_t src[16];
  for (int l = 0; l < d->n_layer; l++)
    for (int w = 0; w < 2; w++) {
      for (int i = 0; i < nu; i++) src[i] = (l + w + i * (s->n_layer / nu)) % s->n_layer;
      for (int64_t i = 0; i < rows * cols; i++) m[i] = kvl_test_randf(&seed) * (i % 7 == 0 ? 100.f : 1.f);
      CHECK_EQ_INT(kvl_translator_set_map(t, l, (enum kvl_translator_kv)w, src, nu, m), 0);
    }
  free(m);
  return t;
}

static bool fp_equal(const struct kvl_model_fingerprint *a, const struct kvl_model_fingerprint *b) {
  return !strcmp(a->architecture, b->architecture) && a->n_layer == b->n_layer && a->n_kv_head == b->n_kv_head &&
         a->head_dim == b->head_dim && a->rope_theta == b->rope_theta && !strcmp(a->rope_scaling, b->rope_scaling) &&
         !strcmp(a->tokenizer_hash, b->tokenizer_hash) && !strcmp(a->name, b->name);
}

/* Loaded b against original a: same fingerprints, flags, sources; maps equal (fp32) or
 * equal to a's rounded to bf16. */
static void check_same(const kvl_translator_t *a, const kvl_translator_t *b, enum kvl_translator_dtype dt) {
  CHECK(fp_equal(kvl_translator_source(a), kvl_translator_source(b)));
  CHECK(fp_equal(kvl_translator_target(a), kvl_translator_target(b)));
  CHECK_EQ_INT(kvl_translator_affine(a), kvl_translator_affine(b));
  CHECK_EQ_INT(kvl_translator_dtype(b), dt);
  CHECK_EQ_INT(kvl_translator_n_layer(a), kvl_translator_n_layer(b));
  int bad = 0;
  double worst = 0;
  for (int l = 0; l < kvl_translator_n_layer(a); l++)
    for (int w = 0; w < 2; w++) {
      struct kvl_translator_map x, y;
      CHECK_EQ_INT(kvl_translator_get_map(a, l, (enum kvl_translator_kv)w, &x), 0);
      CHECK_EQ_INT(kvl_translator_get_map(b, l, (enum kvl_translator_kv)w, &y), 0);
      CHECK_EQ_INT(x.nu, y.nu);
      CHECK_EQ_INT(x.rows, y.rows);
      CHECK_EQ_INT(x.cols, y.cols);
      if (x.nu != y.nu || x.rows != y.rows || x.cols != y.cols) return;
      for (int i = 0; i < x.nu; i++) bad += x.sources[i] != y.sources[i];
      for (int64_t i = 0; i < x.rows * x.cols; i++) {
        float want = dt == KVL_TRANSLATOR_F32 ? x.data[i] : kvl_bf16_to_fp32(kvl_fp32_to_bf16(x.data[i]));
        bad += memcmp(&want, &y.data[i], sizeof(float)) != 0;
        double rel = fabs((double)y.data[i] - x.data[i]) / fmax(fabs((double)x.data[i]), 1e-30);
        if (rel > worst) worst = rel;
      }
    }
  CHECK_EQ_INT(bad, 0);
  CHECK(worst <= (dt == KVL_TRANSLATOR_F32 ? 0 : 1.0 / 256)); /* bf16: half an ulp, 2^-8 relative */
}

static const struct kvl_model_fingerprint *src_fp(void) {
  static struct kvl_model_fingerprint s;
  s = fp_make("qwen2", 6, 2, 4, 1000000.0, "0123456789abcdef", "small \xce\xbd model");
  return &s;
}
static const struct kvl_model_fingerprint *dst_fp(void) {
  static struct kvl_model_fingerprint d;
  d = fp_make("qwen2", 5, 2, 8, 1000000.0, "0123456789abcdef", "large");
  return &d;
}

static void test_roundtrip(void) {
  const int nus[] = {1, 2, 4};
  for (int a = 0; a < 2; a++)
    for (int k = 0; k < 3; k++)
      for (int dt = 0; dt < 2; dt++) {
        kvl_translator_t *t = make_tr(src_fp(), dst_fp(), a, nus[k], 42 + (unsigned)k);
        if (!t) continue;
        CHECK_EQ_INT(kvl_translator_set_fit_json(t, "{\"method\":\"ridge\",\"lambda\":0.01,\"nu\":2}"), 0);
        if (k == 1) CHECK_EQ_INT(kvl_translator_set_scores_json(t, "{\"kl\":[0.1,0.2]}"), 0);
        void *buf;
        size_t len;
        char err[256];
        CHECK_EQ_INT(kvl_translator_save_mem(t, (enum kvl_translator_dtype)dt, &buf, &len, err, sizeof(err)), 0);
        CHECK_EQ_INT(len % 8, 0);
        kvl_translator_t *u = NULL;
        int rc = kvl_translator_load_mem(buf, len, &u, err, sizeof(err));
        if (rc) fprintf(stderr, "load: %s\n", err);
        CHECK_EQ_INT(rc, 0);
        if (u) {
          check_same(t, u, (enum kvl_translator_dtype)dt);
          CHECK(!strcmp(kvl_translator_fit_json(u), kvl_translator_fit_json(t)));
          CHECK(k == 1 ? !strcmp(kvl_translator_scores_json(u), "{\"kl\":[0.1,0.2]}")
                       : kvl_translator_scores_json(u) == NULL);
          /* deterministic: saving the loaded one gives the same bytes */
          void *buf2;
          size_t len2;
          CHECK_EQ_INT(kvl_translator_save_mem(u, (enum kvl_translator_dtype)dt, &buf2, &len2, err, sizeof(err)), 0);
          CHECK(len2 == len && !memcmp(buf, buf2, len));
          free(buf2);
          CHECK_EQ_INT(kvl_translator_check_models(u, src_fp(), dst_fp(), err, sizeof(err)), 0);
        }
        kvl_translator_free(u);
        free(buf);
        kvl_translator_free(t);
      }
}

static void test_file_io(void) {
  char dir[] = "/tmp/kvl-tr-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char path[256], err[256];
  snprintf(path, sizeof(path), "%s/t.safetensors", dir);
  kvl_translator_t *t = make_tr(src_fp(), dst_fp(), true, 2, 7), *u = NULL;
  CHECK_EQ_INT(kvl_translator_save(t, path, KVL_TRANSLATOR_BF16, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_load(path, &u, err, sizeof(err)), 0);
  if (u) check_same(t, u, KVL_TRANSLATOR_BF16);
  kvl_translator_free(u);
  /* nothing else left in the directory (the temporary was renamed) */
  char tmp[300];
  snprintf(tmp, sizeof(tmp), "%s/t.safetensors.tmp%ld", dir, (long)getpid());
  CHECK(access(tmp, F_OK) != 0);
  /* missing file, directory */
  snprintf(tmp, sizeof(tmp), "%s/nope", dir);
  CHECK_EQ_INT(kvl_translator_load(tmp, &u, err, sizeof(err)), KVL_ENOENT);
  CHECK_STR_CONTAINS(err, "cannot open");
  CHECK(u == NULL);
  CHECK_EQ_INT(kvl_translator_load(dir, &u, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "not a regular file");
  /* an empty file */
  snprintf(tmp, sizeof(tmp), "%s/empty", dir);
  FILE *f = fopen(tmp, "wb");
  if (f) fclose(f);
  CHECK_EQ_INT(kvl_translator_load(tmp, &u, err, sizeof(err)), KVL_ETRUNC);
  CHECK_STR_CONTAINS(err, "file is 0 bytes");
  unlink(tmp);
  unlink(path);
  rmdir(dir);
  kvl_translator_free(t);
}

static void test_writer_refusals(void) {
  char err[256];
  kvl_translator_t *t = NULL;
  struct kvl_model_fingerprint bad = *src_fp();
  bad.n_layer = 0;
  CHECK_EQ_INT(kvl_translator_new(&bad, dst_fp(), false, &t, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "source fingerprint: n_layer 0 is outside");
  bad = *dst_fp();
  snprintf(bad.tokenizer_hash, sizeof(bad.tokenizer_hash), "XYZ");
  CHECK_EQ_INT(kvl_translator_new(src_fp(), &bad, false, &t, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "target fingerprint: tokenizer_hash 'XYZ' is not lowercase hex");
  bad = *dst_fp();
  snprintf(bad.name, sizeof(bad.name), "bad \xff utf8");
  CHECK_EQ_INT(kvl_translator_new(src_fp(), &bad, false, &t, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "UTF-8");

  CHECK_EQ_INT(kvl_translator_new(src_fp(), dst_fp(), false, &t, err, sizeof(err)), 0);
  float m[6 * 8 * 16] = {0};
  int32_t s2[] = {1, 1}, s_out[] = {6}, s_ok[] = {5, 0};
  struct kvl_translator_map x;
  CHECK_EQ_INT(kvl_translator_get_map(t, 0, KVL_TRANSLATOR_K, &x), KVL_ENOENT);
  CHECK_EQ_INT(kvl_translator_get_map(t, 5, KVL_TRANSLATOR_K, &x), KVL_ERANGE);
  CHECK_EQ_INT(kvl_translator_set_map(t, 5, KVL_TRANSLATOR_K, s_ok, 2, m), KVL_ERANGE);
  CHECK_EQ_INT(kvl_translator_set_map(t, -1, KVL_TRANSLATOR_K, s_ok, 2, m), KVL_ERANGE);
  CHECK_EQ_INT(kvl_translator_set_map(t, 0, KVL_TRANSLATOR_K, s_ok, 0, m), KVL_EINVAL);
  CHECK_EQ_INT(kvl_translator_set_map(t, 0, KVL_TRANSLATOR_K, s2, 2, m), KVL_EINVAL);
  CHECK_EQ_INT(kvl_translator_set_map(t, 0, KVL_TRANSLATOR_K, s_out, 1, m), KVL_ERANGE);
  m[3] = NAN;
  CHECK_EQ_INT(kvl_translator_set_map(t, 0, KVL_TRANSLATOR_K, s_ok, 2, m), KVL_EINVAL);
  m[3] = 0;
  CHECK_EQ_INT(kvl_translator_set_fit_json(t, "[1,2]"), KVL_EINVAL);
  CHECK_EQ_INT(kvl_translator_set_scores_json(t, "{"), KVL_EINVAL);
  for (int l = 0; l < 5; l++) CHECK_EQ_INT(kvl_translator_set_map(t, l, KVL_TRANSLATOR_K, s_ok, 2, m), 0);
  void *buf = NULL;
  size_t len;
  CHECK_EQ_INT(kvl_translator_save_mem(t, KVL_TRANSLATOR_F32, &buf, &len, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "target layer 0 has no V map");
  CHECK(buf == NULL);
  m[9] = 3.4e38f; /* finite in fp32, beyond bf16's largest */
  for (int l = 0; l < 5; l++) CHECK_EQ_INT(kvl_translator_set_map(t, l, KVL_TRANSLATOR_V, s_ok, 2, m), 0);
  CHECK_EQ_INT(kvl_translator_save_mem(t, KVL_TRANSLATOR_F32, &buf, &len, err, sizeof(err)), 0);
  free(buf);
  CHECK_EQ_INT(kvl_translator_save_mem(t, KVL_TRANSLATOR_BF16, &buf, &len, err, sizeof(err)), KVL_ERANGE);
  CHECK_STR_CONTAINS(err, "layers.0.v element 9");
  CHECK_STR_CONTAINS(err, "overflows bf16");
  CHECK_EQ_INT(kvl_translator_save(t, "/nonexistent-dir/x.safetensors", KVL_TRANSLATOR_F32, err, sizeof(err)),
               KVL_ENOENT);
  CHECK_STR_CONTAINS(err, "cannot create");
  kvl_translator_free(t);
}

/* ---- malformed files ------------------------------------------------------------- */

/* The tiny valid file the refusals start from: S has 3 layers of width 2, T 2 layers of
 * width 4, affine, ν = 2: maps are [5, 4]. */
static void base_file(void **buf, size_t *len) {
  struct kvl_model_fingerprint s = fp_make("qwen2", 3, 1, 2, 10000.0, "ab", "s"),
                               d = fp_make("qwen2", 2, 2, 2, 10000.0, "ab", "d");
  kvl_translator_t *t = make_tr(&s, &d, true, 2, 3);
  char err[256];
  CHECK_EQ_INT(kvl_translator_save_mem(t, KVL_TRANSLATOR_F32, buf, len, err, sizeof(err)), 0);
  kvl_translator_free(t);
}

struct parsed {
  json_t *root;         /* the header */
  uint8_t *data;        /* the data section (a copy) */
  size_t dlen;
};

static struct parsed parse(void) {
  void *buf;
  size_t len;
  base_file(&buf, &len);
  const uint8_t *p = buf;
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | p[i];
  struct parsed r;
  json_error_t je;
  r.root = json_loadb((const char *)p + 8, n, 0, &je);
  KVL_ASSERT(r.root);
  r.dlen = len - 8 - n;
  r.data = malloc(r.dlen + 64);
  memcpy(r.data, p + 8 + n, r.dlen);
  free(buf);
  return r;
}

/* Serialise header text + data into a file image. */
static uint8_t *image(const char *hdr, const uint8_t *data, size_t dlen, size_t *len) {
  size_t hl = strlen(hdr);
  *len = 8 + hl + dlen;
  uint8_t *b = malloc(*len);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  memcpy(b + 8, hdr, hl);
  memcpy(b + 8 + hl, data, dlen);
  return b;
}

static void expect_bytes(const uint8_t *b, size_t len, int code, const char *msg, int line) {
  char err[256] = "";
  kvl_translator_t *t = (kvl_translator_t *)1;
  int rc = kvl_translator_load_mem(b, len, &t, err, sizeof(err));
  if (rc != code || !strstr(err, msg) || t != NULL) {
    fprintf(stderr, "line %d: got %s '%s', want %s with '%s'\n", line, kvl_err_name(rc), err, kvl_err_name(code),
            msg);
    kvl_test_failed++;
    if (rc == 0) kvl_translator_free(t);
  }
}

/* Load p (header re-serialised) and expect failure. Frees p. */
static void expect_parsed(struct parsed p, int code, const char *msg, int line) {
  char *hdr = json_dumps(p.root, JSON_COMPACT);
  size_t len;
  uint8_t *b = image(hdr, p.data, p.dlen, &len);
  expect_bytes(b, len, code, msg, line);
  free(b);
  free(hdr);
  json_decref(p.root);
  free(p.data);
}
#define EXPECT_P(p, code, msg) expect_parsed(p, code, msg, __LINE__)
#define EXPECT_H(hdr, code, msg)                                   \
  do {                                                             \
    size_t len_;                                                   \
    uint8_t *b_ = image(hdr, (const uint8_t *)"", 0, &len_);       \
    expect_bytes(b_, len_, code, msg, __LINE__);                   \
    free(b_);                                                      \
  } while (0)

static json_t *ent(struct parsed *p, const char *name) { return json_object_get(p->root, name); }
static json_t *meta(struct parsed *p) { return json_object_get(p->root, "__metadata__"); }
static void set_off(struct parsed *p, const char *name, long long b, long long e) {
  json_object_set_new(ent(p, name), "data_offsets", json_pack("[I, I]", (json_int_t)b, (json_int_t)e));
}
static long long off(struct parsed *p, const char *name, int i) {
  return json_integer_value(json_array_get(json_object_get(ent(p, name), "data_offsets"), (size_t)i));
}
/* Replace one field of the fingerprint JSON in metadata key `key`. */
static void fp_edit(struct parsed *p, const char *key, const char *field, json_t *v) {
  json_t *fp = json_loads(json_string_value(json_object_get(meta(p), key)), 0, NULL);
  if (v) json_object_set_new(fp, field, v);
  else json_object_del(fp, field);
  char *s = json_dumps(fp, JSON_COMPACT);
  json_object_set_new(meta(p), key, json_string(s));
  free(s);
  json_decref(fp);
}

static void test_malformed(void) {
  /* the base itself loads */
  {
    struct parsed p = parse();
    char *hdr = json_dumps(p.root, JSON_COMPACT);
    size_t len;
    uint8_t *b = image(hdr, p.data, p.dlen, &len);
    kvl_translator_t *t = NULL;
    char err[256];
    CHECK_EQ_INT(kvl_translator_load_mem(b, len, &t, err, sizeof(err)), 0);
    kvl_translator_free(t);
    /* every truncation of a valid file is refused, never a crash */
    int refused = 0;
    for (size_t n = 0; n < len; n++) {
      t = NULL;
      refused += kvl_translator_load_mem(b, n, &t, err, sizeof(err)) < 0 && t == NULL && err[0];
    }
    CHECK_EQ_INT(refused, (long long)len);
    /* the 8-byte length too short / too long */
    expect_bytes(b, 5, KVL_ETRUNC, "too short for the 8-byte header length", __LINE__);
    b[0] = (uint8_t)(b[0] + 1);
    expect_bytes(b, len, KVL_EFORMAT, "not valid JSON", __LINE__); /* one data byte now in the JSON */
    b[0] = 0xff; b[1] = 0xff; b[2] = 0xff;
    expect_bytes(b, len, KVL_ETRUNC, "exceeds the", __LINE__);
    free(b);
    free(hdr);
    json_decref(p.root);
    free(p.data);
  }
  EXPECT_H("", KVL_EFORMAT, "too short for a JSON object");
  EXPECT_H("[1, 2, 3]", KVL_EFORMAT, "does not start with '{'");
  EXPECT_H("{\"a\": ", KVL_EFORMAT, "header is not valid JSON");
  EXPECT_H("{\"a\": 1, \"a\": 2}", KVL_EFORMAT, "duplicate");
  EXPECT_H("{}   ", KVL_EFORMAT, "no __metadata__");
  EXPECT_H("{\"__metadata__\": []}", KVL_EFORMAT, "__metadata__ is not an object");
  EXPECT_H("{\"__metadata__\": {\"x\": 1}}", KVL_EFORMAT, "metadata key 'x' is not a string");
  EXPECT_H("{\"t\": 5}", KVL_EFORMAT, "tensor 't': header entry is not an object");

  struct parsed p;
  /* safetensors rules */
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "dtype", json_string("F16"));
  EXPECT_P(p, KVL_EBADTYPE, "tensor 'layers.0.k': dtype 'F16' is not supported");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "dtype", json_integer(1));
  EXPECT_P(p, KVL_EFORMAT, "dtype is not a string");
  p = parse(); json_object_del(ent(&p, "layers.1.v"), "shape");
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.1.v': missing 'shape'");
  p = parse(); json_object_set_new(ent(&p, "layers.1.v"), "extra", json_true());
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.1.v': unknown field 'extra'");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[i, i]", 4, 5));
  EXPECT_P(p, KVL_EMISMATCH, "tensor 'layers.0.k' has shape [4, 5], expected [5, 4]");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[i, i]", 4, 4));
  EXPECT_P(p, KVL_EFORMAT, "shape [4, 4] of F32 needs 64 bytes, data_offsets span 80");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[i, f]", 5, 4.0));
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.0.k': shape[1] is not a non-negative integer");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[i, i]", -5, -4));
  EXPECT_P(p, KVL_EFORMAT, "shape[0] is not a non-negative integer");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[I, I, I]", (json_int_t)1 << 40,
                                                                             (json_int_t)1 << 40, (json_int_t)1 << 40));
  EXPECT_P(p, KVL_EOVERFLOW, "tensor 'layers.0.k': shape [1099511627776, 1099511627776, 1099511627776] overflows");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "shape", json_pack("[i,i,i,i,i,i,i,i,i]", 1, 1, 1, 1, 1, 1, 1, 1, 1));
  EXPECT_P(p, KVL_EFORMAT, "rank 9 exceeds 8");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k"), "data_offsets", json_pack("[i]", 0));
  EXPECT_P(p, KVL_EFORMAT, "data_offsets is not a [begin, end] pair");
  p = parse(); set_off(&p, "layers.0.k", off(&p, "layers.0.k", 1), off(&p, "layers.0.k", 0));
  EXPECT_P(p, KVL_EFORMAT, "run backwards");
  p = parse(); set_off(&p, "layers.1.v", off(&p, "layers.1.v", 0) + 8, off(&p, "layers.1.v", 1) + 8);
  EXPECT_P(p, KVL_ETRUNC, "tensor 'layers.1.v': data_offsets end 360 is beyond the 352-byte data section");
  p = parse(); p.dlen -= 4;
  EXPECT_P(p, KVL_ETRUNC, "is beyond the 348-byte data section");
  p = parse(); p.dlen += 12;
  EXPECT_P(p, KVL_EFORMAT, "data section has 12 trailing bytes that belong to no tensor");
  /* overlap: layers.0.v_sources moved onto layers.0.k_sources */
  p = parse(); set_off(&p, "layers.0.v_sources", off(&p, "layers.0.k_sources", 0), off(&p, "layers.0.k_sources", 1));
  EXPECT_P(p, KVL_EFORMAT, "tensors 'layers.0.k_sources' [0, 8) and 'layers.0.v_sources' [0, 8) overlap");
  /* gap: the last tensor moved 8 bytes on, the section grown to match */
  p = parse(); set_off(&p, "layers.1.v", off(&p, "layers.1.v", 0) + 8, off(&p, "layers.1.v", 1) + 8); p.dlen += 8;
  EXPECT_P(p, KVL_EFORMAT, "data section bytes [272, 280) belong to no tensor (before 'layers.1.v')");

  /* metadata */
  p = parse(); json_object_del(meta(&p), "kvlingo.dtype");
  EXPECT_P(p, KVL_EFORMAT, "missing metadata key 'kvlingo.dtype'");
  p = parse(); json_object_del(meta(&p), "kvlingo.source");
  EXPECT_P(p, KVL_EFORMAT, "missing metadata key 'kvlingo.source'");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.format_version", json_string("2"));
  EXPECT_P(p, KVL_ENOTSUP, "kvlingo.format_version is '2'; this kvlingo reads version 1");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.affine", json_string("yes"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.affine is 'yes', expected \"true\" or \"false\"");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.dtype", json_string("F16"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.dtype is 'F16'");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.shiny", json_string("1"));
  EXPECT_P(p, KVL_EFORMAT, "unknown metadata key 'kvlingo.shiny'");
  p = parse(); json_object_set_new(meta(&p), "format", json_string("pt")); /* another tool's key: fine */
  {
    char *hdr = json_dumps(p.root, JSON_COMPACT);
    size_t len;
    uint8_t *b = image(hdr, p.data, p.dlen, &len);
    kvl_translator_t *t = NULL;
    char err[256];
    CHECK_EQ_INT(kvl_translator_load_mem(b, len, &t, err, sizeof(err)), 0);
    kvl_translator_free(t);
    free(b); free(hdr); json_decref(p.root); free(p.data);
  }
  p = parse(); json_object_set_new(meta(&p), "kvlingo.fit", json_string("[1]"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.fit is not a JSON object");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.scores", json_string("{"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.scores is not a JSON object");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.target", json_string("{not json"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.target is not valid JSON");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.target", json_string("[7]"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.target is not a JSON object");
  p = parse(); fp_edit(&p, "kvlingo.source", "head_dim", NULL);
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.source: missing 'head_dim'");
  p = parse(); fp_edit(&p, "kvlingo.source", "colour", json_string("blue"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.source: unknown key 'colour'");
  p = parse(); fp_edit(&p, "kvlingo.target", "n_layer", json_integer(0));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.target: 'n_layer' is 0, outside 1..4096");
  p = parse(); fp_edit(&p, "kvlingo.target", "n_kv_head", json_string("2"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.target: 'n_kv_head' is not an integer");
  p = parse(); fp_edit(&p, "kvlingo.target", "kv_width", json_integer(5));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.target: 'kv_width' is not n_kv_head × head_dim = 4");
  p = parse(); fp_edit(&p, "kvlingo.source", "rope_theta", json_real(-1));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.source: rope_theta -1 is not a positive number");
  p = parse(); fp_edit(&p, "kvlingo.source", "tokenizer_hash", json_string("not-hex"));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.source: tokenizer_hash 'not-hex' is not lowercase hex");
  p = parse(); fp_edit(&p, "kvlingo.source", "architecture", json_string(""));
  EXPECT_P(p, KVL_EFORMAT, "kvlingo.source: architecture is empty");

  /* kvlingo layout */
  p = parse(); json_object_set(p.root, "extra", ent(&p, "layers.0.k")); json_object_del(p.root, "layers.0.k");
  EXPECT_P(p, KVL_EFORMAT, "unknown tensor 'extra'");
  p = parse(); json_object_set(p.root, "layers.00.k", ent(&p, "layers.0.k")); json_object_del(p.root, "layers.0.k");
  EXPECT_P(p, KVL_EFORMAT, "unknown tensor 'layers.00.k'");
  p = parse(); json_object_set(p.root, "layers.2.k", ent(&p, "layers.1.k")); json_object_del(p.root, "layers.1.k");
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.2.k' is for target layer 2, but the target has 2 layers");
  /* a missing tensor: its bytes given to its neighbour would break shapes, so the
   * target grows instead: layer 2's tensors are then missing */
  p = parse(); fp_edit(&p, "kvlingo.target", "n_layer", json_integer(3));
  EXPECT_P(p, KVL_EFORMAT, "missing tensor 'layers.2.k_sources'");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k_sources"), "dtype", json_string("F32"));
  EXPECT_P(p, KVL_EBADTYPE, "tensor 'layers.0.k_sources' is F32, expected I32");
  p = parse(); json_object_set_new(ent(&p, "layers.0.k_sources"), "shape", json_pack("[i, i]", 1, 2));
  EXPECT_P(p, KVL_EMISMATCH, "tensor 'layers.0.k_sources' has shape [1, 2], expected [ν]");
  p = parse(); p.data[off(&p, "layers.1.v_sources", 0)] = 9;
  EXPECT_P(p, KVL_ERANGE, "tensor 'layers.1.v_sources'[0] is source layer 9, outside 0..2");
  p = parse(); p.data[off(&p, "layers.1.v_sources", 0) + 3] = 0x80;
  EXPECT_P(p, KVL_ERANGE, "outside 0..2");
  p = parse(); memcpy(p.data + off(&p, "layers.0.k_sources", 0) + 4, p.data + off(&p, "layers.0.k_sources", 0), 4);
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.0.k_sources' lists source layer 0 twice");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.affine", json_string("false"));
  EXPECT_P(p, KVL_EMISMATCH, "tensor 'layers.0.k' has shape [5, 4], expected [4, 4] (ν=2 × w_S 2, w_T 4)");
  p = parse(); fp_edit(&p, "kvlingo.target", "head_dim", json_integer(4)); fp_edit(&p, "kvlingo.target", "kv_width", json_integer(8));
  EXPECT_P(p, KVL_EMISMATCH, "expected [5, 8] (ν=2 × w_S 2 + 1 intercept row, w_T 8)");
  p = parse(); json_object_set_new(meta(&p), "kvlingo.dtype", json_string("BF16"));
  EXPECT_P(p, KVL_EBADTYPE, "tensor 'layers.0.k' is F32 but kvlingo.dtype says BF16");
  p = parse(); { float nan = NAN; memcpy(p.data + off(&p, "layers.1.k", 0) + 4 * 6, &nan, 4); }
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.1.k' element 6 (row 1, column 2) is not finite");
  p = parse(); { float inf = -INFINITY; memcpy(p.data + off(&p, "layers.0.v", 0), &inf, 4); }
  EXPECT_P(p, KVL_EFORMAT, "tensor 'layers.0.v' element 0 (row 0, column 0) is not finite");
  /* sources ν larger than the source model */
  {
    p = parse();
    /* rewrite: give layers.0.k_sources 4 entries by stealing layers.0.v_sources' bytes
     * is not possible without a shift; instead claim n_layer_S = 1 */
    fp_edit(&p, "kvlingo.source", "n_layer", json_integer(1));
    EXPECT_P(p, KVL_EMISMATCH, "tensor 'layers.0.k_sources' lists 2 source layers, expected 1..1");
  }
}

/* ---- models -------------------------------------------------------------------- */

static void test_check_models(void) {
  kvl_translator_t *t = make_tr(src_fp(), dst_fp(), false, 1, 5);
  char err[512];
  CHECK_EQ_INT(kvl_translator_check_models(t, src_fp(), dst_fp(), err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_check_models(t, NULL, NULL, err, sizeof(err)), 0);
  struct kvl_model_fingerprint d = *dst_fp(), s = *src_fp();
  d.n_layer = 24;
  CHECK_EQ_INT(kvl_translator_check_models(t, src_fp(), &d, err, sizeof(err)), KVL_EMISMATCH);
  CHECK(!strcmp(err, "target n_layer: translator 5, model 24"));
  /* swapped models: named per side and per field */
  CHECK_EQ_INT(kvl_translator_check_models(t, dst_fp(), src_fp(), err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "source n_layer: translator 6, model 5; source head_dim: translator 4, model 8");
  CHECK_STR_CONTAINS(err, "target n_layer: translator 5, model 6; target head_dim: translator 8, model 4");
  s = *src_fp();
  snprintf(s.architecture, sizeof(s.architecture), "gemma3");
  snprintf(s.tokenizer_hash, sizeof(s.tokenizer_hash), "ffff");
  snprintf(s.rope_scaling, sizeof(s.rope_scaling), "yarn:4");
  s.rope_theta = 10000.0;
  s.n_kv_head = 1;
  snprintf(s.name, sizeof(s.name), "another name"); /* not compared */
  CHECK_EQ_INT(kvl_translator_check_models(t, &s, NULL, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "source architecture: translator 'qwen2', model 'gemma3'");
  CHECK_STR_CONTAINS(err, "source n_kv_head: translator 2, model 1");
  CHECK_STR_CONTAINS(err, "source rope_theta: translator 1000000, model 10000");
  CHECK_STR_CONTAINS(err, "source rope_scaling: translator 'none', model 'yarn:4'");
  CHECK_STR_CONTAINS(err, "source tokenizer_hash: translator 0123456789abcdef, model ffff");
  CHECK(!strstr(err, "name"));
  s = *src_fp();
  snprintf(s.name, sizeof(s.name), "renamed");
  s.rope_theta *= 1 + 1e-9; /* float rounding of the base: same model */
  CHECK_EQ_INT(kvl_translator_check_models(t, &s, dst_fp(), err, sizeof(err)), 0);
  /* a short buffer is cut, never overrun */
  char small[24];
  CHECK_EQ_INT(kvl_translator_check_models(t, dst_fp(), src_fp(), small, sizeof(small)), KVL_EMISMATCH);
  CHECK_EQ_INT(strlen(small), sizeof(small) - 1);
  kvl_translator_free(t);
}

/* ---- fingerprints from GGUF ---------------------------------------------------------- */

static kvl_gguf_t *gguf_with(const char *const *toks, int n_tok, bool key_length, bool scaling, void **mem) {
  kvl_gguf_writer_t *w = kvl_gguf_writer_new();
  kvl_gguf_set_str(w, "general.architecture", "qwen2");
  kvl_gguf_set_str(w, "general.name", "Tiny Coder");
  kvl_gguf_set_u32(w, "qwen2.block_count", 24);
  kvl_gguf_set_u32(w, "qwen2.embedding_length", 896);
  kvl_gguf_set_u32(w, "qwen2.attention.head_count", 14);
  kvl_gguf_set_u32(w, "qwen2.attention.head_count_kv", 2);
  kvl_gguf_set_f32(w, "qwen2.rope.freq_base", 1000000.0f);
  if (key_length) kvl_gguf_set_u32(w, "qwen2.attention.key_length", 128);
  if (scaling) {
    kvl_gguf_set_str(w, "qwen2.rope.scaling.type", "yarn");
    kvl_gguf_set_f32(w, "qwen2.rope.scaling.factor", 4.0f);
  }
  if (toks) kvl_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n_tok);
  size_t len;
  CHECK_EQ_INT(kvl_gguf_writer_to_mem(w, mem, &len), 0);
  kvl_gguf_writer_free(w);
  kvl_gguf_t *g = NULL;
  char err[256];
  CHECK_EQ_INT(kvl_gguf_open_mem(*mem, len, &g, err, sizeof(err)), 0);
  return g;
}

static void test_fingerprint_gguf(void) {
  const char *t1[] = {"ab", "c", "<|im_start|>"}, *t2[] = {"a", "bc", "<|im_start|>"};
  void *m1, *m2, *m3, *m4;
  kvl_gguf_t *g1 = gguf_with(t1, 3, false, false, &m1), *g2 = gguf_with(t2, 3, true, true, &m2),
             *g3 = gguf_with(t1, 3, false, false, &m3), *g4 = gguf_with(NULL, 0, false, false, &m4);
  struct kvl_model_fingerprint f1, f2, f3, f4;
  char err[256];
  CHECK_EQ_INT(kvl_fingerprint_from_gguf(g1, &f1, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fingerprint_from_gguf(g2, &f2, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fingerprint_from_gguf(g3, &f3, err, sizeof(err)), 0);
  CHECK(!strcmp(f1.architecture, "qwen2"));
  CHECK_EQ_INT(f1.n_layer, 24);
  CHECK_EQ_INT(f1.n_kv_head, 2);
  CHECK_EQ_INT(f1.head_dim, 64); /* 896 / 14 */
  CHECK_EQ_INT(kvl_fingerprint_kv_width(&f1), 128);
  CHECK(f1.rope_theta == 1000000.0);
  CHECK(!strcmp(f1.rope_scaling, "none"));
  CHECK(!strcmp(f1.name, "Tiny Coder"));
  CHECK_EQ_INT(strlen(f1.tokenizer_hash), 16);
  CHECK(fp_equal(&f1, &f3));                              /* deterministic */
  CHECK(strcmp(f1.tokenizer_hash, f2.tokenizer_hash) != 0); /* token boundaries count */
  CHECK_EQ_INT(f2.head_dim, 128);                         /* key_length wins */
  CHECK(!strcmp(f2.rope_scaling, "yarn:4"));
  CHECK_EQ_INT(kvl_fingerprint_from_gguf(g4, &f4, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, "tokenizer.ggml.tokens");
  /* a translator made from GGUF fingerprints checks against them */
  kvl_translator_t *t = NULL;
  CHECK_EQ_INT(kvl_translator_new(&f1, &f2, false, &t, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_check_models(t, &f1, &f2, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_translator_check_models(t, &f2, &f1, err, sizeof(err)), KVL_EMISMATCH);
  CHECK_STR_CONTAINS(err, "source head_dim: translator 64, model 128");
  kvl_translator_free(t);
  kvl_gguf_free(g1); kvl_gguf_free(g2); kvl_gguf_free(g3); kvl_gguf_free(g4);
  free(m1); free(m2); free(m3); free(m4);

  /* a GGUF missing a hyperparameter is named */
  kvl_gguf_writer_t *w = kvl_gguf_writer_new();
  kvl_gguf_set_str(w, "general.architecture", "qwen2");
  kvl_gguf_set_u32(w, "qwen2.block_count", 24);
  void *mem;
  size_t len;
  kvl_gguf_writer_to_mem(w, &mem, &len);
  kvl_gguf_writer_free(w);
  kvl_gguf_t *g;
  CHECK_EQ_INT(kvl_gguf_open_mem(mem, len, &g, err, sizeof(err)), 0);
  CHECK_EQ_INT(kvl_fingerprint_from_gguf(g, &f4, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, "missing metadata key 'qwen2.attention.head_count_kv'");
  kvl_gguf_free(g);
  free(mem);
}

int main(void) {
  RUN(test_roundtrip);
  RUN(test_file_io);
  RUN(test_writer_refusals);
  RUN(test_malformed);
  RUN(test_check_models);
  RUN(test_fingerprint_gguf);
  return TEST_EXIT();
}
