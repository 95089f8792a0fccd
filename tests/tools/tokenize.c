/* tokenize.c — test tool: kvlingo's tokenizer over framed records, for the oracles.
 *
 *   tokenize MODEL.gguf [--special] [--decode]
 *
 * stdin: records of <u32 length><bytes>; stdout per record: <i32 count><count x i32 ids>
 * (count -1 = refused, e.g. invalid UTF-8). --decode: stdin records are <u32 n><n x i32>
 * and stdout records are <u32 length><bytes>. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_tokenizer.h"

static int rd(void *p, size_t n) { return fread(p, 1, n, stdin) == n ? 0 : -1; }

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: tokenize MODEL.gguf [--special] [--decode]\n"); return 2; }
  bool special = false, decode = false;
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "--special")) special = true;
    if (!strcmp(argv[i], "--decode")) decode = true;
  }
  char err[512];
  kvl_gguf_t *g;
  if (kvl_gguf_open(argv[1], &g, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
  kvl_tokenizer_t *tk;
  if (kvl_tokenizer_from_gguf(g, &tk, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
  kvl_gguf_free(g);
  uint32_t n;
  while (rd(&n, 4) == 0) {
    if (decode) {
      int32_t *ids = malloc((size_t)n * 4 + 4);
      if (rd(ids, (size_t)n * 4)) return 1;
      char *s;
      size_t l;
      if (kvl_tokenizer_decode(tk, ids, n, false, &s, &l) < 0) return 1;
      uint32_t l32 = (uint32_t)l;
      fwrite(&l32, 4, 1, stdout);
      fwrite(s, 1, l, stdout);
      free(s);
      free(ids);
      continue;
    }
    char *buf = malloc((size_t)n + 1);
    if (rd(buf, n)) return 1;
    int32_t *ids;
    size_t ni;
    int rc = kvl_tokenizer_encode(tk, buf, n, special, &ids, &ni);
    int32_t cnt = rc < 0 ? -1 : (int32_t)ni;
    fwrite(&cnt, 4, 1, stdout);
    if (rc == 0) fwrite(ids, 4, ni, stdout);
    free(ids);
    free(buf);
  }
  kvl_tokenizer_free(tk);
  return 0;
}
