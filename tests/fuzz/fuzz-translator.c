/* fuzz-translator.c — libFuzzer target for the translator file reader: any input must
 * give either a translator whose every map is in bounds and consistent with its
 * fingerprints, or an error with a message. An accepted input must also survive a
 * save/load round trip unchanged (F32: bit-exact). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_translator.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char err[256];
  kvl_translator_t *t;
  if (kvl_translator_load_mem(data, size, &t, err, sizeof(err)) < 0) {
    KVL_ASSERT(err[0] != '\0'); /* every refusal names its reason */
    KVL_ASSERT(t == NULL);
    return 0;
  }
  const struct kvl_model_fingerprint *s = kvl_translator_source(t), *d = kvl_translator_target(t);
  const int64_t ws = kvl_fingerprint_kv_width(s), wd = kvl_fingerprint_kv_width(d);
  volatile float sink = 0;
  for (int32_t l = 0; l < kvl_translator_n_layer(t); l++)
    for (int w = 0; w < 2; w++) {
      struct kvl_translator_map m;
      KVL_ASSERT(kvl_translator_get_map(t, l, (enum kvl_translator_kv)w, &m) == 0);
      KVL_ASSERT(m.nu >= 1 && m.nu <= s->n_layer);
      KVL_ASSERT(m.rows == m.nu * ws + (kvl_translator_affine(t) ? 1 : 0) && m.cols == wd);
      for (int32_t i = 0; i < m.nu; i++) KVL_ASSERT(m.sources[i] >= 0 && m.sources[i] < s->n_layer);
      for (int64_t i = 0; i < m.rows * m.cols; i++) {
        KVL_ASSERT(isfinite(m.data[i]));
        sink += m.data[i];
      }
    }
  (void)sink;
  KVL_ASSERT(kvl_translator_check_models(t, s, d, err, sizeof(err)) == 0);

  /* round trip: what was accepted is written back and read back the same */
  void *buf;
  size_t len;
  KVL_ASSERT(kvl_translator_save_mem(t, KVL_TRANSLATOR_F32, &buf, &len, err, sizeof(err)) == 0);
  kvl_translator_t *u;
  KVL_ASSERT(kvl_translator_load_mem(buf, len, &u, err, sizeof(err)) == 0);
  for (int32_t l = 0; l < kvl_translator_n_layer(t); l++)
    for (int w = 0; w < 2; w++) {
      struct kvl_translator_map a, b;
      kvl_translator_get_map(t, l, (enum kvl_translator_kv)w, &a);
      kvl_translator_get_map(u, l, (enum kvl_translator_kv)w, &b);
      KVL_ASSERT(a.nu == b.nu && !memcmp(a.sources, b.sources, (size_t)a.nu * sizeof(*a.sources)));
      KVL_ASSERT(!memcmp(a.data, b.data, (size_t)(a.rows * a.cols) * sizeof(*a.data)));
    }
  KVL_ASSERT(kvl_translator_check_models(u, s, d, err, sizeof(err)) == 0);
  kvl_translator_free(u);
  free(buf);
  kvl_translator_free(t);
  return 0;
}
