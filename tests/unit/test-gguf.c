/* test-gguf.c — GGUF writer/reader round trip, and every kind of bad file refused by
 * name (truncation at every byte, hostile counts, sizes, types and offsets). */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

/* ---- a byte builder for hand-made (possibly hostile) files ------------------------ */
struct bb { unsigned char b[4096]; size_t n; };
static void put(struct bb *b, const void *p, size_t n) { memcpy(b->b + b->n, p, n); b->n += n; }
static void u32(struct bb *b, uint32_t v) { put(b, &v, 4); }
static void u64(struct bb *b, uint64_t v) { put(b, &v, 8); }
static void str(struct bb *b, const char *s) { u64(b, strlen(s)); put(b, s, strlen(s)); }
static void hdr(struct bb *b, uint32_t version, uint64_t nt, uint64_t nkv) {
  b->n = 0;
  put(b, "GGUF", 4);
  u32(b, version);
  u64(b, nt);
  u64(b, nkv);
}

/* Open b and expect failure `code` with `msg` in the error. */
static void expect_err(struct bb *b, int code, const char *msg, int line) {
  char err[256];
  kvl_gguf_t *g = (kvl_gguf_t *)1;
  int rc = kvl_gguf_open_mem(b->b, b->n, &g, err, sizeof(err));
  if (rc != code || !strstr(err, msg) || g != NULL) {
    fprintf(stderr, "line %d: got %s '%s', want %s with '%s'\n", line, kvl_err_name(rc), err,
            kvl_err_name(code), msg);
    kvl_test_failed++;
  }
}
#define EXPECT_ERR(code, msg) expect_err(&b, code, msg, __LINE__)

static kvl_gguf_writer_t *sample_writer(void) {
  kvl_gguf_writer_t *w = kvl_gguf_writer_new();
  CHECK(w != NULL);
  CHECK_EQ_INT(kvl_gguf_set_str(w, "general.architecture", "qwen2"), 0);
  CHECK_EQ_INT(kvl_gguf_set_u32(w, "qwen2.block_count", 2), 0);
  CHECK_EQ_INT(kvl_gguf_set_i32(w, "test.i32", -7), 0);
  CHECK_EQ_INT(kvl_gguf_set_u64(w, "test.u64", 1ull << 40), 0);
  CHECK_EQ_INT(kvl_gguf_set_f32(w, "test.f32", 0.5f), 0);
  CHECK_EQ_INT(kvl_gguf_set_f64(w, "test.f64", -0.25), 0);
  CHECK_EQ_INT(kvl_gguf_set_bool(w, "test.bool", true), 0);
  uint8_t u8 = 200; int8_t i8 = -100; uint16_t u16 = 60000; int16_t i16 = -30000; int64_t i64 = -(1ll << 50);
  CHECK_EQ_INT(kvl_gguf_set_scalar(w, "test.u8", KVL_GGUF_U8, &u8), 0);
  CHECK_EQ_INT(kvl_gguf_set_scalar(w, "test.i8", KVL_GGUF_I8, &i8), 0);
  CHECK_EQ_INT(kvl_gguf_set_scalar(w, "test.u16", KVL_GGUF_U16, &u16), 0);
  CHECK_EQ_INT(kvl_gguf_set_scalar(w, "test.i16", KVL_GGUF_I16, &i16), 0);
  CHECK_EQ_INT(kvl_gguf_set_scalar(w, "test.i64", KVL_GGUF_I64, &i64), 0);
  const char *toks[] = {"a", "", "<|im_start|>", "\xc4\xa0hello"};
  CHECK_EQ_INT(kvl_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 4), 0);
  int32_t types[] = {1, 1, 3, 1};
  CHECK_EQ_INT(kvl_gguf_set_arr(w, "tokenizer.ggml.token_type", KVL_GGUF_I32, types, 4), 0);
  float sc[] = {0.5f, -1.5f};
  CHECK_EQ_INT(kvl_gguf_set_arr(w, "test.farr", KVL_GGUF_F32, sc, 2), 0);
  CHECK_EQ_INT(kvl_gguf_set_u32(w, "qwen2.block_count", 3), KVL_EEXIST);
  /* tensors: one f32, one q8_0 (2 rows of 64), one q4_k (1 row of 256) */
  float x[512];
  unsigned long long s = 7;
  for (int i = 0; i < 512; i++) x[i] = kvl_test_randf(&s);
  uint64_t ne1[] = {5};
  CHECK_EQ_INT(kvl_gguf_add_tensor(w, "a.bias", KVL_TYPE_F32, 1, ne1, x, 20), 0);
  unsigned char q8[4 * 34];
  CHECK_EQ_INT(kvl_quant_row_ref(KVL_TYPE_Q8_0, x, q8, 128), 0);
  uint64_t ne2[] = {64, 2};
  CHECK_EQ_INT(kvl_gguf_add_tensor(w, "a.weight", KVL_TYPE_Q8_0, 2, ne2, q8, sizeof(q8)), 0);
  unsigned char q4k[144];
  for (int i = 0; i < 144; i++) q4k[i] = (unsigned char)kvl_test_rand(&s);
  q4k[0] = 0x00; q4k[1] = 0x3c; q4k[2] = 0x00; q4k[3] = 0x38; /* d = 1, dmin = 0.5 */
  uint64_t ne3[] = {256, 1};
  CHECK_EQ_INT(kvl_gguf_add_tensor(w, "b.weight", KVL_TYPE_Q4_K, 2, ne3, q4k, sizeof(q4k)), 0);
  CHECK_EQ_INT(kvl_gguf_add_tensor(w, "b.weight", KVL_TYPE_Q4_K, 2, ne3, q4k, sizeof(q4k)), KVL_EEXIST);
  CHECK_EQ_INT(kvl_gguf_add_tensor(w, "c.weight", KVL_TYPE_Q4_K, 2, ne3, q4k, 100), KVL_EMISMATCH);
  return w;
}

static void test_roundtrip(void) {
  kvl_gguf_writer_t *w = sample_writer();
  void *buf;
  size_t len;
  CHECK_EQ_INT(kvl_gguf_writer_to_mem(w, &buf, &len), 0);
  kvl_gguf_writer_free(w);
  char err[256];
  kvl_gguf_t *g;
  int rc = kvl_gguf_open_mem(buf, len, &g, err, sizeof(err));
  if (rc) fprintf(stderr, "open: %s\n", err);
  CHECK_EQ_INT(rc, 0);
  if (rc) { free(buf); return; }
  CHECK_EQ_INT(kvl_gguf_version(g), 3);
  CHECK_EQ_INT(kvl_gguf_n_kv(g), 15);
  CHECK_EQ_INT(kvl_gguf_n_tensors(g), 3);
  const char *s;
  int64_t iv;
  double fv;
  bool bv;
  CHECK_EQ_INT(kvl_gguf_get_str(g, "general.architecture", &s), 0);
  CHECK(!strcmp(s, "qwen2"));
  CHECK_EQ_INT(kvl_gguf_get_int(g, "qwen2.block_count", &iv), 0); CHECK_EQ_INT(iv, 2);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.i32", &iv), 0); CHECK_EQ_INT(iv, -7);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.u64", &iv), 0); CHECK_EQ_INT(iv, 1ll << 40);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.u8", &iv), 0); CHECK_EQ_INT(iv, 200);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.i8", &iv), 0); CHECK_EQ_INT(iv, -100);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.u16", &iv), 0); CHECK_EQ_INT(iv, 60000);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.i16", &iv), 0); CHECK_EQ_INT(iv, -30000);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "test.i64", &iv), 0); CHECK_EQ_INT(iv, -(1ll << 50));
  CHECK_EQ_INT(kvl_gguf_get_float(g, "test.f32", &fv), 0); CHECK(fv == 0.5);
  CHECK_EQ_INT(kvl_gguf_get_float(g, "test.f64", &fv), 0); CHECK(fv == -0.25);
  CHECK_EQ_INT(kvl_gguf_get_bool(g, "test.bool", &bv), 0); CHECK(bv);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "general.architecture", &iv), KVL_EBADTYPE);
  CHECK_EQ_INT(kvl_gguf_get_str(g, "qwen2.block_count", &s), KVL_EBADTYPE);
  CHECK_EQ_INT(kvl_gguf_get_int(g, "missing.key", &iv), KVL_ENOENT);
  enum kvl_gguf_vtype e;
  uint64_t n;
  CHECK_EQ_INT(kvl_gguf_get_arr(g, "tokenizer.ggml.tokens", &e, &n), 0);
  CHECK_EQ_INT(e, KVL_GGUF_STRING);
  CHECK_EQ_INT(n, 4);
  size_t sl;
  CHECK_EQ_INT(kvl_gguf_arr_str(g, "tokenizer.ggml.tokens", 2, &s, &sl), 0);
  CHECK(sl == 12 && !memcmp(s, "<|im_start|>", 12));
  CHECK_EQ_INT(kvl_gguf_arr_str(g, "tokenizer.ggml.tokens", 1, &s, &sl), 0);
  CHECK_EQ_INT(sl, 0);
  CHECK_EQ_INT(kvl_gguf_arr_str(g, "tokenizer.ggml.tokens", 4, &s, &sl), KVL_ERANGE);
  CHECK_EQ_INT(kvl_gguf_arr_int(g, "tokenizer.ggml.token_type", 2, &iv), 0); CHECK_EQ_INT(iv, 3);
  CHECK_EQ_INT(kvl_gguf_arr_float(g, "test.farr", 1, &fv), 0); CHECK(fv == -1.5);
  CHECK_EQ_INT(kvl_gguf_arr_int(g, "tokenizer.ggml.tokens", 0, &iv), KVL_EBADTYPE);
  CHECK(kvl_gguf_find_key(g, "test.bool") >= 0);
  const struct kvl_gguf_tensor *t = kvl_gguf_find_tensor(g, "a.weight");
  CHECK(t != NULL);
  if (t) {
    CHECK_EQ_INT(t->type, KVL_TYPE_Q8_0);
    CHECK_EQ_INT(t->ne[0], 64);
    CHECK_EQ_INT(t->ne[1], 2);
    CHECK_EQ_INT(t->nbytes, 4 * 34);
    CHECK(((uintptr_t)t->data - (uintptr_t)buf - kvl_gguf_data_offset(g)) % 32 == 0);
  }
  t = kvl_gguf_find_tensor(g, "b.weight");
  CHECK(t != NULL && t->type == KVL_TYPE_Q4_K && t->nbytes == 144);
  if (t) { /* first element: d * sc0 * q - dmin * m0 from the hand-set scales */
    float y[256];
    CHECK_EQ_INT(kvl_dequant_row_ref(t->type, t->data, y, 256), 0);
    const unsigned char *q = t->data;
    float want = 1.0f * (float)(q[4] & 63) * (float)(q[16] & 15) - 0.5f * (float)(q[8] & 63);
    CHECK(y[0] == want);
  }
  CHECK(kvl_gguf_find_tensor(g, "nope") == NULL);
  kvl_gguf_free(g);

  /* every strict prefix that cuts into the header or the tensor data must be refused */
  size_t need = 0;
  {
    kvl_gguf_open_mem(buf, len, &g, err, sizeof(err));
    for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
      t = kvl_gguf_tensor(g, i);
      size_t end = kvl_gguf_data_offset(g) + t->offset + t->nbytes;
      if (end > need) need = end;
    }
    kvl_gguf_free(g);
  }
  int accepted = 0;
  for (size_t cut = 0; cut < need; cut++) {
    unsigned char *p = malloc(cut ? cut : 1); /* exact-size copy: ASan sees any overread */
    memcpy(p, buf, cut);
    if (kvl_gguf_open_mem(p, cut, &g, err, sizeof(err)) == 0) { accepted++; kvl_gguf_free(g); }
    else CHECK(err[0] != '\0');
    free(p);
  }
  CHECK_EQ_INT(accepted, 0);
  free(buf);
}

static void test_file_io(void) {
  char path[] = "/tmp/kvl-test-gguf-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  kvl_gguf_writer_t *w = sample_writer();
  CHECK_EQ_INT(kvl_gguf_writer_to_file(w, path), 0);
  kvl_gguf_writer_free(w);
  char err[256];
  kvl_gguf_t *g;
  CHECK_EQ_INT(kvl_gguf_open(path, &g, err, sizeof(err)), 0);
  kvl_gguf_t *h = NULL;
  /* read into 2 MiB pages: the same tensors, the same bytes, at a huge-page-aligned base */
  CHECK_EQ_INT(kvl_gguf_open_with(path, KVL_GGUF_HUGEPAGES, &h, err, sizeof(err)), 0);
  if (g && h) {
    CHECK_EQ_INT(kvl_gguf_n_tensors(g), 3);
    CHECK_EQ_INT(kvl_gguf_n_tensors(h), 3);
    for (int64_t i = 0; i < 3; i++) {
      const struct kvl_gguf_tensor *a = kvl_gguf_tensor(g, i), *b = kvl_gguf_tensor(h, i);
      CHECK(a->nbytes == b->nbytes && !memcmp(a->data, b->data, a->nbytes));
      CHECK((uintptr_t)b->data % 32 == 0);
    }
  }
  kvl_gguf_free(g);
  kvl_gguf_free(h);
  unlink(path);
  CHECK_EQ_INT(kvl_gguf_open_with(path, KVL_GGUF_HUGEPAGES, &g, err, sizeof(err)), KVL_ENOENT);
  CHECK_EQ_INT(kvl_gguf_open(path, &g, err, sizeof(err)), KVL_ENOENT);
  CHECK_STR_CONTAINS(err, "cannot open");
  CHECK_EQ_INT(kvl_gguf_open("/tmp", &g, err, sizeof(err)), KVL_EINVAL);
}

static void test_hostile(void) {
  struct bb b;
  b.n = 0; put(&b, "GGU", 3);                 EXPECT_ERR(KVL_ETRUNC, "magic");
  hdr(&b, 3, 0, 0); b.b[0] = 'X';             EXPECT_ERR(KVL_EFORMAT, "not a GGUF file");
  hdr(&b, 1, 0, 0);                           EXPECT_ERR(KVL_ENOTSUP, "version 1");
  hdr(&b, 4, 0, 0);                           EXPECT_ERR(KVL_ENOTSUP, "version 4");
  hdr(&b, 3, 0, 1ull << 60);                  EXPECT_ERR(KVL_EFORMAT, "absurd metadata count");
  hdr(&b, 3, UINT64_MAX, 0);                  EXPECT_ERR(KVL_EFORMAT, "absurd tensor count");
  hdr(&b, 3, 0, 1); u64(&b, 1ull << 62); u64(&b, 0); EXPECT_ERR(KVL_EFORMAT, "absurd length");
  hdr(&b, 3, 0, 1); u64(&b, 100); put(&b, "abc", 3); u32(&b, 0); u32(&b, 0);
                                              EXPECT_ERR(KVL_ETRUNC, "metadata key");
  hdr(&b, 3, 0, 1); str(&b, "k"); u32(&b, 13); u64(&b, 0);
                                              EXPECT_ERR(KVL_EFORMAT, "unknown value type 13");
  hdr(&b, 3, 0, 1); str(&b, "k"); u32(&b, KVL_GGUF_ARRAY); u32(&b, KVL_GGUF_ARRAY); u64(&b, 1);
                                              EXPECT_ERR(KVL_ENOTSUP, "array of arrays");
  hdr(&b, 3, 0, 1); str(&b, "k"); u32(&b, KVL_GGUF_ARRAY); u32(&b, KVL_GGUF_U32); u64(&b, 1ull << 61);
                                              EXPECT_ERR(KVL_ETRUNC, "runs past the end");
  hdr(&b, 3, 0, 1); str(&b, "k"); u32(&b, KVL_GGUF_ARRAY); u32(&b, KVL_GGUF_STRING); u64(&b, 1ull << 40);
                                              EXPECT_ERR(KVL_EFORMAT, "cannot fit");
  hdr(&b, 3, 0, 2); str(&b, "k"); u32(&b, KVL_GGUF_U8); put(&b, "x", 1);
  str(&b, "k"); u32(&b, KVL_GGUF_U8); put(&b, "x", 1);
                                              EXPECT_ERR(KVL_EFORMAT, "duplicate metadata key 'k'");
  hdr(&b, 3, 0, 1); str(&b, "general.alignment"); u32(&b, KVL_GGUF_U32); u32(&b, 24);
                                              EXPECT_ERR(KVL_EFORMAT, "not a power of two");
  hdr(&b, 3, 0, 1); str(&b, "general.alignment"); u32(&b, KVL_GGUF_U64); u64(&b, 32);
                                              EXPECT_ERR(KVL_EFORMAT, "must be u32");
  /* tensor infos */
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 0);  u64(&b, 0); u64(&b, 0); u64(&b, 0);
                                              EXPECT_ERR(KVL_EFORMAT, "has 0 dimensions");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 5); u64(&b, 1); u64(&b, 1); u64(&b, 1);
                                              EXPECT_ERR(KVL_EFORMAT, "has 5 dimensions");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 2); u64(&b, 1ull << 40); u64(&b, 1ull << 40); u32(&b, 0); u64(&b, 0);
                                              EXPECT_ERR(KVL_EOVERFLOW, "overflows");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 1); u64(&b, 32); u32(&b, 77); u64(&b, 0);
                                              EXPECT_ERR(KVL_EBADTYPE, "unknown type 77");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 1); u64(&b, 100); u32(&b, KVL_TYPE_Q4_K); u64(&b, 0);
                                              EXPECT_ERR(KVL_EFORMAT, "not a multiple of Q4_K's block of 256");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 1); u64(&b, 4); u32(&b, KVL_TYPE_F32); u64(&b, 8);
                                              EXPECT_ERR(KVL_EFORMAT, "not aligned");
  hdr(&b, 3, 1, 0); str(&b, "t"); u32(&b, 1); u64(&b, 4); u32(&b, KVL_TYPE_F32); u64(&b, 0);
  while (b.n % 32) b.b[b.n++] = 0;
  put(&b, "0123456789abcde", 15);           /* 15 of the 16 bytes */
                                              EXPECT_ERR(KVL_ETRUNC, "tensor 't': data [0, +16) is out of bounds");
  b.b[b.n++] = 'f';                           /* now complete: accepted */
  {
    kvl_gguf_t *g;
    char err[128];
    CHECK_EQ_INT(kvl_gguf_open_mem(b.b, b.n, &g, err, sizeof(err)), 0);
    kvl_gguf_free(g);
  }
  hdr(&b, 3, 2, 0);
  str(&b, "t"); u32(&b, 1); u64(&b, 4); u32(&b, KVL_TYPE_F32); u64(&b, 0);
  str(&b, "t"); u32(&b, 1); u64(&b, 4); u32(&b, KVL_TYPE_F32); u64(&b, 32);
                                              EXPECT_ERR(KVL_EFORMAT, "duplicate tensor name 't'");
  hdr(&b, 3, 1, 0); u64(&b, 2); put(&b, "a\0", 2); u32(&b, 1); u64(&b, 4); u32(&b, 0); u64(&b, 0);
                                              EXPECT_ERR(KVL_EFORMAT, "contains a NUL");
}

int main(void) {
  RUN(test_roundtrip);
  RUN(test_file_io);
  RUN(test_hostile);
  return TEST_EXIT();
}
