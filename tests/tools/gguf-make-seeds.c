/* gguf-make-seeds.c — writes small valid GGUF files covering every metadata type,
 * every tensor type and a non-default alignment: the fuzz seed corpus.
 *
 *   gguf-make-seeds DIR
 */
#include <stdio.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

static int save(kvl_gguf_writer_t *w, const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s.seed", dir, name);
  int rc = kvl_gguf_writer_to_file(w, path);
  kvl_gguf_writer_free(w);
  if (rc < 0) fprintf(stderr, "%s: %s\n", path, kvl_strerror(rc));
  return rc;
}

int main(int argc, char **argv) {
  if (argc != 2) { fprintf(stderr, "usage: gguf-make-seeds DIR\n"); return 2; }
  const char *dir = argv[1];
  int rc = 0;
  float x[512];
  for (int i = 0; i < 512; i++) x[i] = (float)((i * 37) % 101 - 50) / 25.0f;
  unsigned char buf[512 * 4];

  /* 1: metadata of every type, no tensors */
  kvl_gguf_writer_t *w = kvl_gguf_writer_new();
  kvl_gguf_set_str(w, "general.architecture", "qwen2");
  kvl_gguf_set_u32(w, "qwen2.block_count", 2);
  kvl_gguf_set_i32(w, "a.i32", -1);
  kvl_gguf_set_u64(w, "a.u64", 5);
  kvl_gguf_set_f32(w, "a.f32", 1.5f);
  kvl_gguf_set_f64(w, "a.f64", 2.5);
  kvl_gguf_set_bool(w, "a.bool", true);
  uint8_t u8 = 1; int16_t i16 = -2;
  kvl_gguf_set_scalar(w, "a.u8", KVL_GGUF_U8, &u8);
  kvl_gguf_set_scalar(w, "a.i16", KVL_GGUF_I16, &i16);
  const char *toks[] = {"<|endoftext|>", "a", "\xc4\xa0" "b"};
  kvl_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
  int32_t tt[] = {3, 1, 1};
  kvl_gguf_set_arr(w, "tokenizer.ggml.token_type", KVL_GGUF_I32, tt, 3);
  rc |= save(w, dir, "meta-all-types");

  /* 2: one tensor of each dequantisable type that has a quantiser, plus raw K-quant blocks */
  w = kvl_gguf_writer_new();
  kvl_gguf_set_str(w, "general.architecture", "qwen2");
  static const uint32_t types[] = {KVL_TYPE_F32, KVL_TYPE_F16, KVL_TYPE_BF16, KVL_TYPE_Q4_0,
                                   KVL_TYPE_Q4_1, KVL_TYPE_Q5_0, KVL_TYPE_Q5_1, KVL_TYPE_Q8_0};
  for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
    char name[64];
    snprintf(name, sizeof(name), "t.%s", kvl_type_name(types[i]));
    uint64_t ne[] = {64};
    kvl_quant_row_ref(types[i], x, buf, 64);
    kvl_gguf_add_tensor(w, name, types[i], 1, ne, buf, kvl_row_size(types[i], 64));
  }
  static const uint32_t ktypes[] = {KVL_TYPE_Q4_K, KVL_TYPE_Q5_K, KVL_TYPE_Q6_K};
  for (size_t i = 0; i < 3; i++) {
    char name[64];
    snprintf(name, sizeof(name), "t.%s", kvl_type_name(ktypes[i]));
    for (int j = 0; j < 256; j++) buf[j] = (unsigned char)(j * 7);
    uint64_t ne[] = {256, 1};
    kvl_gguf_add_tensor(w, name, ktypes[i], 2, ne, buf, kvl_row_size(ktypes[i], 256));
  }
  rc |= save(w, dir, "tensors-all-types");

  /* 3: alignment 64 and a 3-d tensor */
  w = kvl_gguf_writer_new();
  kvl_gguf_set_u32(w, "general.alignment", 64);
  uint64_t ne3[] = {4, 2, 3};
  kvl_gguf_add_tensor(w, "cube", KVL_TYPE_F32, 3, ne3, x, 24 * 4);
  uint64_t ne1[] = {8};
  kvl_gguf_add_tensor(w, "vec", KVL_TYPE_F32, 1, ne1, x, 32);
  rc |= save(w, dir, "align64");

  /* 4: empty file: header only */
  w = kvl_gguf_writer_new();
  rc |= save(w, dir, "empty");
  return rc ? 1 : 0;
}
