/* common.c — helpers shared by the subcommands. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

/* MODEL as given if it is a file, else the first *.gguf in the models directory whose
 * name starts with MODEL. Returns a malloc'd path or NULL. */
char *kvl_cli_resolve_model(const char *m) {
  if (access(m, R_OK) == 0) return strdup(m);
  const char *dir = getenv("KVLINGO_MODELS");
  char def[4096];
  if (!dir || !*dir) {
    snprintf(def, sizeof(def), "%s/.cache/kvlingo/models", getenv("HOME") ? getenv("HOME") : ".");
    dir = def;
  }
  DIR *d = opendir(dir);
  if (!d) return NULL;
  struct dirent *e;
  char *found = NULL;
  size_t ml = strlen(m);
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf") && !strncmp(e->d_name, m, ml) &&
        (!found || strcmp(e->d_name, strrchr(found, '/') + 1) < 0)) {
      free(found);
      size_t n = strlen(dir) + l + 2;
      found = malloc(n);
      snprintf(found, n, "%s/%s", dir, e->d_name);
    }
  }
  closedir(d);
  return found;
}


double kvl_cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void kvl_cli_progress(const char *what, int64_t done, int64_t total, double t0) {
  static int64_t last_bucket = -1;
  if (!isatty(2)) { /* a log: one line per 5% */
    int64_t bucket = total > 0 ? done * 20 / total : 20;
    if (bucket == last_bucket && done != total) return;
    last_bucket = bucket;
  }
  double el = kvl_cli_now() - t0, eta = done > 0 ? el * (double)(total - done) / (double)done : 0;
  int w = 30, f = total > 0 ? (int)(w * done / total) : w;
  char bar[64];
  for (int i = 0; i < w; i++) bar[i] = i < f ? '#' : '.';
  bar[w] = 0;
  fprintf(stderr, "%s%-14s [%s] %lld/%lld  %5.0fs elapsed  ETA %5.0fs%s", isatty(2) ? "\r" : "", what, bar,
          (long long)done, (long long)total, el, eta, isatty(2) && done < total ? "" : "\n");
  fflush(stderr);
}
