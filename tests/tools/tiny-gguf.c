/* tiny-gguf.c — write a tiny synthetic Qwen2 model with a tokenizer and a chat template to
 * a file, for tests that need a model on disk (the daemon's fast tier).
 *
 *   tiny-gguf OUT.gguf [N_LAYER [SEED]]
 */
#include <stdio.h>
#include <stdlib.h>

#include "../tiny_model.h"

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: tiny-gguf OUT.gguf [N_LAYER [SEED]]\n");
    return 2;
  }
  struct tiny_opts o = {.tokenizer = 1, .n_layer = argc > 2 ? atoi(argv[2]) : 2,
                        .seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 12345};
  void *buf;
  size_t len;
  if (tiny_qwen2(&o, &buf, &len) != 0) return 1;
  FILE *f = fopen(argv[1], "wb");
  if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
    perror(argv[1]);
    return 1;
  }
  free(buf);
  return 0;
}
