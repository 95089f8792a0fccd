/* test-detok.c — tokenizer on the tiny vocabulary, and the streaming detokenizer: for
 * random token sequences the stream equals the full decode, only valid UTF-8 is ever
 * emitted, and stop strings are cut exactly (also across tokens). */
#include <unistr.h>

#include "../kvl_test.h"
#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_tokenizer.h"

static kvl_tokenizer_t *tiny(void **buf) {
  size_t len;
  KVL_ASSERT(tiny_tokenizer_gguf(buf, &len) == 0);
  kvl_gguf_t *g;
  char err[256];
  KVL_ASSERT(kvl_gguf_open_mem(*buf, len, &g, err, sizeof(err)) == 0);
  kvl_tokenizer_t *tk;
  int rc = kvl_tokenizer_from_gguf(g, &tk, err, sizeof(err));
  if (rc) fprintf(stderr, "%s\n", err);
  KVL_ASSERT(rc == 0);
  kvl_gguf_free(g); /* the tokenizer keeps copies */
  return tk;
}

static void test_encode_basics(void) {
  void *buf;
  kvl_tokenizer_t *tk = tiny(&buf);
  int32_t *ids;
  size_t n;
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, "hello world", 11, false, &ids, &n), 0);
  CHECK_EQ_INT(n, 2); /* "hello" and " world" are merged words */
  char *s;
  size_t l;
  CHECK_EQ_INT(kvl_tokenizer_decode(tk, ids, n, false, &s, &l), 0);
  CHECK(!strcmp(s, "hello world"));
  free(s);
  free(ids);
  const char *t = "<|im_start|>hi<|im_end|>";
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, t, strlen(t), true, &ids, &n), 0);
  CHECK(n == 4 && ids[0] == kvl_tokenizer_find(tk, "<|im_start|>") && ids[3] == kvl_tokenizer_find(tk, "<|im_end|>"));
  free(ids);
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, t, strlen(t), false, &ids, &n), 0);
  for (size_t i = 0; i < n; i++) CHECK(!kvl_tokenizer_is_special(tk, ids[i]));
  free(ids);
  /* NFC: e + combining acute becomes the precomposed character (one merged token) */
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, "e\xcc\x81", 3, false, &ids, &n), 0);
  CHECK_EQ_INT(n, 1);
  free(ids);
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, "bad \xff utf8", 10, false, &ids, &n), KVL_EINVAL);
  CHECK(kvl_tokenizer_is_eog(tk, kvl_tokenizer_find(tk, "<|im_end|>")));
  kvl_tokenizer_free(tk);
  free(buf);
}

/* Concatenate all emitted text of a stream of ids. */
static char *stream(kvl_tokenizer_t *tk, const int32_t *ids, int n, const char *const *stops, enum kvl_finish *fin,
                    int *bad_utf8) {
  kvl_detok_t *d = kvl_detok_new(tk, stops);
  size_t cap = 4096, len = 0;
  char *all = malloc(cap);
  *fin = KVL_FINISH_LENGTH;
  for (int i = 0; i <= n; i++) {
    char *o;
    size_t ol;
    enum kvl_finish f = KVL_FINISH_NONE;
    if (i < n) f = kvl_detok_push(d, ids[i], &o, &ol);
    else kvl_detok_flush(d, &o, &ol);
    if (u8_check((const uint8_t *)o, ol)) (*bad_utf8)++;
    if (len + ol + 1 > cap) { cap = (len + ol + 1) * 2; all = realloc(all, cap); }
    memcpy(all + len, o, ol);
    len += ol;
    free(o);
    if (f == KVL_FINISH_STOP) { *fin = KVL_FINISH_STOP; break; }
  }
  all[len] = 0;
  kvl_detok_free(d);
  return all;
}

static void test_stream_random(void) {
  void *buf;
  kvl_tokenizer_t *tk = tiny(&buf);
  unsigned long long s = 7;
  int n_vocab = kvl_tokenizer_n_vocab(tk), mism = 0, bad = 0, stop_bad = 0, stops_hit = 0;
  int32_t eos = kvl_tokenizer_find(tk, "<|im_end|>");
  for (int iter = 0; iter < 3000; iter++) {
    int n = 1 + (int)(kvl_test_rand(&s) % 40);
    int32_t ids[40];
    /* mostly valid text: bytes of multi-byte characters split across tokens */
    bool any_bytes = iter % 4 == 0; /* a quarter: arbitrary ids (invalid UTF-8 possible) */
    for (int i = 0; i < n; i++) {
      int r = (int)(kvl_test_rand(&s) % 10);
      if (any_bytes) ids[i] = (int32_t)(kvl_test_rand(&s) % (unsigned)n_vocab);
      else if (r < 5) ids[i] = 32 + (int32_t)(kvl_test_rand(&s) % 95);              /* ASCII byte tokens */
      else if (r < 7) ids[i] = 256 + (int32_t)(kvl_test_rand(&s) % (unsigned)(n_vocab - 259)); /* merged */
      else if (i + 1 < n) { ids[i] = 0xc3; ids[++i] = 0xa9; }                        /* e-acute, split */
      else ids[i] = 'z';
      if (kvl_tokenizer_is_special(tk, ids[i])) ids[i] = 'a';
    }
    char *full;
    size_t fl;
    kvl_tokenizer_decode(tk, ids, (size_t)n, false, &full, &fl);
    enum kvl_finish fin;
    char *got = stream(tk, ids, n, NULL, &fin, &bad);
    /* the stream equals the full decode whenever that is valid UTF-8 */
    if (!u8_check((const uint8_t *)full, fl) && strcmp(got, full)) mism++;
    free(got);
    /* a stop string taken from the middle of the text cuts exactly at its first occurrence */
    if (fl >= 4) {
      size_t a = kvl_test_rand(&s) % (fl - 2), b = a + 1 + kvl_test_rand(&s) % (fl - a - 1 < 6 ? fl - a - 1 : 6);
      char stop[16];
      memcpy(stop, full + a, b - a);
      stop[b - a] = 0;
      if (!memchr(stop, 0, b - a) && !u8_check((const uint8_t *)full, fl) && !u8_check((const uint8_t *)stop, b - a)) {
        const char *stops[] = {"zzz-never", stop, NULL};
        got = stream(tk, ids, n, stops, &fin, &bad);
        size_t first = (size_t)(strstr(full, stop) - full);
        if (fin != KVL_FINISH_STOP || strlen(got) != first || memcmp(got, full, first)) stop_bad++;
        stops_hit++;
        free(got);
      }
    }
    /* an end token stops the stream and is not emitted */
    ids[n / 2] = eos;
    got = stream(tk, ids, n, NULL, &fin, &bad);
    if (fin != KVL_FINISH_STOP) stop_bad++;
    free(got);
    free(full);
  }
  printf("  3000 random streams: %d differ from the full decode, %d chunks of invalid UTF-8, %d/%d stop cuts wrong\n",
         mism, bad, stop_bad, stops_hit);
  CHECK_EQ_INT(mism, 0);
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(stop_bad, 0);
  CHECK(stops_hit > 1000);
  kvl_tokenizer_free(tk);
  free(buf);
}

/* A stop string split over several tokens is held back, then cut. */
static void test_stop_across_tokens(void) {
  void *buf;
  kvl_tokenizer_t *tk = tiny(&buf);
  int32_t *ids;
  size_t n;
  const char *text = "say hello world then";
  CHECK_EQ_INT(kvl_tokenizer_encode(tk, text, strlen(text), false, &ids, &n), 0);
  const char *stops[] = {"lo wor", NULL};
  kvl_detok_t *d = kvl_detok_new(tk, stops);
  char emitted[256] = "";
  enum kvl_finish f = KVL_FINISH_NONE;
  for (size_t i = 0; i < n && f == KVL_FINISH_NONE; i++) {
    char *o;
    size_t ol;
    f = kvl_detok_push(d, ids[i], &o, &ol);
    CHECK(strstr(o, "lo") == NULL || strstr(o, "lo wor") == NULL);
    strncat(emitted, o, sizeof(emitted) - strlen(emitted) - 1);
    free(o);
  }
  CHECK_EQ_INT(f, KVL_FINISH_STOP);
  CHECK(!strcmp(emitted, "say hel"));
  kvl_detok_free(d);
  free(ids);
  kvl_tokenizer_free(tk);
  free(buf);
}

int main(void) {
  RUN(test_encode_basics);
  RUN(test_stream_random);
  RUN(test_stop_across_tokens);
  return TEST_EXIT();
}
