/* fuzz-tokenizer.c — libFuzzer target: random bytes -> encode (with and without special
 * parsing) -> decode. Invalid UTF-8 must be refused; valid text must come back as its
 * NFC form; the streaming detokenizer must emit the same text. Tiny vocabulary, built
 * once in memory. */
#include <stdint.h>
#include <string.h>
#include <uninorm.h>
#include <unistr.h>

#include "../tiny_model.h"
#include "kvl_error.h"
#include "kvl_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvl_tokenizer_t *tk;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!tk) {
    void *buf;
    size_t len;
    kvl_gguf_t *g;
    char err[128];
    KVL_ASSERT(tiny_tokenizer_gguf(&buf, &len) == 0);
    KVL_ASSERT(kvl_gguf_open_mem(buf, len, &g, err, sizeof(err)) == 0);
    KVL_ASSERT(kvl_tokenizer_from_gguf(g, &tk, err, sizeof(err)) == 0);
    kvl_gguf_free(g);
    free(buf);
  }
  bool special = size > 0 && (data[0] & 1);
  int32_t *ids;
  size_t n;
  int rc = kvl_tokenizer_encode(tk, (const char *)data, size, special, &ids, &n);
  bool valid = u8_check(data, size) == NULL;
  KVL_ASSERT(valid ? rc == 0 : rc == KVL_EINVAL);
  if (rc) return 0;
  char *s;
  size_t l;
  KVL_ASSERT(kvl_tokenizer_decode(tk, ids, n, false, &s, &l) == 0);
  size_t nl;
  uint8_t *nfc = u8_normalize(UNINORM_NFC, data, size, NULL, &nl);
  KVL_ASSERT(nfc && nl == l && !memcmp(nfc, s, l));
  free(nfc);
  /* streaming without stops gives the same bytes (the text is valid UTF-8) */
  kvl_detok_t *d = kvl_detok_new(tk, NULL);
  size_t at = 0;
  for (size_t i = 0; i <= n; i++) {
    char *o;
    size_t ol;
    enum kvl_finish f = KVL_FINISH_NONE;
    if (i < n) f = kvl_detok_push(d, ids[i], &o, &ol);
    else kvl_detok_flush(d, &o, &ol);
    KVL_ASSERT(at + ol <= l && !memcmp(s + at, o, ol));
    at += ol;
    free(o);
    if (f == KVL_FINISH_STOP) break; /* an end token in the input (parsed special) */
  }
  kvl_detok_free(d);
  free(s);
  free(ids);
  return 0;
}
