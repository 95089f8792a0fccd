/* replay.c — runs a libFuzzer target over files or directories of inputs, without
 * libFuzzer (any compiler, any sanitizer): how CI replays the committed corpora. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) { perror(path); return -1; }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *buf = malloc(n > 0 ? (size_t)n : 1); /* exact size: sanitizers see overreads */
  if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) { fclose(f); free(buf); return -1; }
  fclose(f);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  long count = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) < 0) { perror(argv[i]); return 1; }
    if (!S_ISDIR(st.st_mode)) {
      if (run_file(argv[i]) < 0) return 1;
      count++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    struct dirent *e;
    while (d && (e = readdir(d))) {
      if (e->d_name[0] == '.') continue;
      char p[4096];
      snprintf(p, sizeof(p), "%s/%s", argv[i], e->d_name);
      if (run_file(p) < 0) return 1;
      count++;
    }
    if (d) closedir(d);
  }
  printf("replayed %ld inputs\n", count);
  return count > 0 ? 0 : 1;
}
