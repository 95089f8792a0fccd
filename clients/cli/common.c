/* common.c — helpers shared by the subcommands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvl_error.h"

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

int kvl_cli_model_open(struct kvl_cli_model *s, const char *arg, char *err, size_t errlen) {
  memset(s, 0, sizeof(*s));
  s->path = kvl_model_resolve(arg);
  if (!s->path) return kvl_errf(err, errlen, KVL_ENOENT, "model '%s' not found (scripts/fetch-models)", arg);
  int rc = kvl_model_open(s->path, &s->m, err, errlen);
  if (rc == 0) rc = kvl_tokenizer_from_gguf(kvl_model_gguf(s->m), &s->tk, err, errlen);
  if (rc == 0) rc = kvl_fingerprint_from_gguf(kvl_model_gguf(s->m), &s->fp, err, errlen);
  if (rc < 0) return rc;
  const char *b = strrchr(s->path, '/');
  snprintf(s->short_name, sizeof(s->short_name), "%s", b ? b + 1 : s->path);
  char *cut = strstr(s->short_name, "-instruct");
  if (!cut) cut = strstr(s->short_name, ".gguf");
  if (cut) *cut = 0;
  s->L = s->fp.n_layer;
  s->w = kvl_fingerprint_kv_width(&s->fp);
  return 0;
}

void kvl_cli_model_close(struct kvl_cli_model *s) {
  kvl_tokenizer_free(s->tk);
  kvl_model_free(s->m);
  free(s->path);
  memset(s, 0, sizeof(*s));
}
