/* translator-identity.c — write an identity translator file (target layer l reads source
 * layer l, maps = I) between two GGUF models of the same layout, for tests: between
 * copies of one model a switch through it must change nothing.
 *
 *   translator-identity SRC.gguf DST.gguf OUT.safetensors
 */
#include <stdio.h>
#include <string.h>

#include "kvl_gguf.h"
#include "kvl_translator.h"

static int fingerprint(const char *path, struct kvl_model_fingerprint *fp, char *err, size_t errlen) {
  kvl_gguf_t *g;
  int rc = kvl_gguf_open(path, &g, err, errlen);
  if (rc < 0) return rc;
  rc = kvl_fingerprint_from_gguf(g, fp, err, errlen);
  kvl_gguf_free(g);
  return rc;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: translator-identity SRC.gguf DST.gguf OUT.safetensors\n");
    return 2;
  }
  char err[512];
  struct kvl_model_fingerprint src, dst;
  if (fingerprint(argv[1], &src, err, sizeof(err)) < 0 || fingerprint(argv[2], &dst, err, sizeof(err)) < 0) {
    fprintf(stderr, "translator-identity: %s\n", err);
    return 1;
  }
  if (src.n_layer != dst.n_layer || src.n_kv_head != dst.n_kv_head || src.head_dim != dst.head_dim) {
    fprintf(stderr, "translator-identity: the models' layouts differ\n");
    return 1;
  }
  kvl_translator_t *t;
  if (kvl_translator_identity(&src, false, &t, err, sizeof(err)) < 0 ||
      kvl_translator_save(t, argv[3], KVL_TRANSLATOR_F32, err, sizeof(err)) < 0) {
    fprintf(stderr, "translator-identity: %s\n", err);
    return 1;
  }
  kvl_translator_free(t);
  return 0;
}
