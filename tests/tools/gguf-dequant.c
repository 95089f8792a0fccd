/* gguf-dequant.c — test tool: dequantise with kvlingo's reference kernels and write
 * raw little-endian fp32 to stdout, for the oracle tests to compare against the `gguf`
 * Python package.
 *
 *   gguf-dequant FILE.gguf           every dequantisable tensor, in file order
 *   gguf-dequant --raw TYPE N        N elements of blocks read from stdin (TYPE by name)
 *   gguf-dequant --list FILE.gguf    "name type n_elements" per tensor
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

static int write_all(const void *p, size_t n) { return fwrite(p, 1, n, stdout) == n ? 0 : -1; }

static int raw_mode(const char *tname, long long n) {
  uint32_t type = UINT32_MAX;
  for (uint32_t t = 0; t < KVL_TYPE_COUNT_; t++)
    if (kvl_type_traits(t) && !strcmp(kvl_type_name(t), tname)) type = t;
  size_t bytes = kvl_row_size(type, (uint64_t)n);
  if (type == UINT32_MAX || !bytes) { fprintf(stderr, "bad type or count\n"); return 2; }
  unsigned char *src = malloc(bytes);
  float *dst = malloc((size_t)n * sizeof(float));
  if (!src || !dst || fread(src, 1, bytes, stdin) != bytes) { fprintf(stderr, "short input\n"); return 1; }
  int rc = kvl_dequant_row_ref(type, src, dst, n);
  if (rc) { fprintf(stderr, "dequant: %s\n", kvl_strerror(rc)); return 1; }
  rc = write_all(dst, (size_t)n * sizeof(float));
  free(src);
  free(dst);
  return rc ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 4 && !strcmp(argv[1], "--raw")) return raw_mode(argv[2], atoll(argv[3]));
  bool list = argc == 3 && !strcmp(argv[1], "--list");
  if (argc != 2 && !list) {
    fprintf(stderr, "usage: gguf-dequant [--list] FILE.gguf | --raw TYPE N\n");
    return 2;
  }
  char err[512];
  kvl_gguf_t *g;
  const char *path = argv[argc - 1];
  if (kvl_gguf_open(path, &g, err, sizeof(err)) < 0) { fprintf(stderr, "%s: %s\n", path, err); return 1; }
  float *buf = NULL;
  size_t cap = 0;
  for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
    const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
    if (list) { printf("%s %s %" PRIu64 "\n", t->name, kvl_type_name(t->type), t->n_elements); continue; }
    if (!kvl_type_traits(t->type)->can_dequant || t->n_elements == 0) continue;
    /* row by row so the buffer stays one row wide */
    size_t row_bytes = kvl_row_size(t->type, t->ne[0]);
    if (t->ne[0] > cap) { cap = t->ne[0]; buf = realloc(buf, cap * sizeof(float)); }
    uint64_t rows = t->n_elements / t->ne[0];
    for (uint64_t r = 0; r < rows; r++) {
      kvl_dequant_row_ref(t->type, (const unsigned char *)t->data + r * row_bytes, buf, (int64_t)t->ne[0]);
      if (write_all(buf, t->ne[0] * sizeof(float))) { kvl_gguf_free(g); return 1; }
    }
  }
  free(buf);
  kvl_gguf_free(g);
  return 0;
}
