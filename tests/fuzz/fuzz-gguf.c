/* fuzz-gguf.c — libFuzzer target for the GGUF reader: any input must give either a
 * handle whose every accessor stays in bounds, or an error with a message. */
#include <stdint.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char err[256];
  kvl_gguf_t *g;
  if (kvl_gguf_open_mem(data, size, &g, err, sizeof(err)) < 0) {
    KVL_ASSERT(err[0] != '\0'); /* every refusal names its reason */
    return 0;
  }
  /* touch everything the reader promises is valid */
  volatile uint64_t sink = 0;
  for (int i = 0; i < kvl_gguf_n_kv(g); i++) {
    const char *key = kvl_gguf_kv_key(g, i);
    enum kvl_gguf_vtype e;
    uint64_t n;
    int64_t iv;
    double fv;
    const char *s;
    size_t len;
    if (kvl_gguf_get_arr(g, key, &e, &n) == 0) {
      for (uint64_t j = 0; j < n && j < 64; j++) {
        if (kvl_gguf_arr_str(g, key, j, &s, &len) == 0 && len) sink += (uint8_t)s[len - 1];
        if (kvl_gguf_arr_int(g, key, j, &iv) == 0) sink += (uint64_t)iv;
        if (kvl_gguf_arr_float(g, key, j, &fv) == 0) sink += (uint64_t)(fv == fv);
      }
    } else if (kvl_gguf_get_str(g, key, &s) == 0) {
      sink += strlen(s);
    } else if (kvl_gguf_get_int(g, key, &iv) == 0 || kvl_gguf_get_float(g, key, &fv) == 0) {
      sink++;
    }
    KVL_ASSERT(kvl_gguf_find_key(g, key) == i);
  }
  float row[512];
  for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
    const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
    KVL_ASSERT(kvl_gguf_find_tensor(g, t->name) == t);
    if (t->nbytes) sink += ((const uint8_t *)t->data)[t->nbytes - 1];
    const struct kvl_type_traits *tt = kvl_type_traits(t->type);
    if (tt->can_dequant && t->ne[0] <= 512 && t->ne[0] > 0 && t->nbytes >= kvl_row_size(t->type, t->ne[0]))
      kvl_dequant_row_ref(t->type, t->data, row, (int64_t)t->ne[0]);
  }
  (void)sink;
  kvl_gguf_free(g);
  return 0;
}
