/* cmd_info.c — `kvlingo info MODEL.gguf`: metadata and tensor table of a GGUF file. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: kvlingo info [--tensors] MODEL.gguf\n"
          "\n"
          "Print a GGUF file's metadata (long arrays summarised) and, with --tensors,\n"
          "every tensor's type, shape and size. The file is validated first: a corrupt\n"
          "or truncated file is refused with the reason.\n");
}

static void print_value(const kvl_gguf_t *g, int i) {
  const char *key = kvl_gguf_kv_key(g, i);
  enum kvl_gguf_vtype t = kvl_gguf_kv_type(g, i);
  int64_t iv;
  double fv;
  const char *s;
  if (t == KVL_GGUF_STRING) {
    kvl_gguf_get_str(g, key, &s);
    size_t n = strlen(s);
    if (n > 72 || strchr(s, '\n'))
      printf("%.60s... (%zu chars)", strchr(s, '\n') ? "<multi-line>" : s, n);
    else
      printf("\"%s\"", s);
  } else if (t == KVL_GGUF_ARRAY) {
    enum kvl_gguf_vtype e;
    uint64_t n;
    kvl_gguf_get_arr(g, key, &e, &n);
    printf("[%s x %" PRIu64 "]", kvl_gguf_vtype_name(e), n);
    for (uint64_t j = 0; j < n && j < 4; j++) {
      if (e == KVL_GGUF_STRING) {
        size_t len;
        kvl_gguf_arr_str(g, key, j, &s, &len);
        printf(" \"%.*s\"", (int)(len > 20 ? 20 : len), s);
      } else if (kvl_gguf_arr_int(g, key, j, &iv) == 0) {
        printf(" %" PRId64, iv);
      } else if (kvl_gguf_arr_float(g, key, j, &fv) == 0) {
        printf(" %g", fv);
      }
    }
    if (n > 4) printf(" ...");
  } else if (t == KVL_GGUF_BOOL) {
    bool b;
    kvl_gguf_get_bool(g, key, &b);
    printf("%s", b ? "true" : "false");
  } else if (t == KVL_GGUF_F32 || t == KVL_GGUF_F64) {
    kvl_gguf_get_float(g, key, &fv);
    printf("%g", fv);
  } else if (kvl_gguf_get_int(g, key, &iv) == 0) {
    printf("%" PRId64, iv);
  }
}

int kvl_cli_info(int argc, char **argv) {
  bool tensors = false;
  const char *path = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(stdout); return 0; }
    if (!strcmp(argv[i], "--tensors")) tensors = true;
    else if (argv[i][0] == '-') { fprintf(stderr, "kvlingo info: unknown option '%s'\n", argv[i]); return 2; }
    else path = argv[i];
  }
  if (!path) { usage(stderr); return 2; }
  char err[512];
  kvl_gguf_t *g;
  int rc = kvl_gguf_open(path, &g, err, sizeof(err));
  if (rc < 0) {
    fprintf(stderr, "kvlingo info: %s: %s\n", path, err[0] ? err : kvl_strerror(rc));
    return 1;
  }
  printf("%s: GGUF v%u, %zu bytes, %" PRId64 " metadata keys, %" PRId64 " tensors, alignment %u\n", path,
         kvl_gguf_version(g), kvl_gguf_file_size(g), kvl_gguf_n_kv(g), kvl_gguf_n_tensors(g), kvl_gguf_alignment(g));
  for (int i = 0; i < kvl_gguf_n_kv(g); i++) {
    printf("  %-44s %-7s ", kvl_gguf_kv_key(g, i), kvl_gguf_vtype_name(kvl_gguf_kv_type(g, i)));
    print_value(g, i);
    putchar('\n');
  }
  /* type histogram */
  uint64_t count[KVL_TYPE_COUNT_] = {0}, bytes[KVL_TYPE_COUNT_] = {0}, params = 0;
  for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
    const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
    count[t->type]++;
    bytes[t->type] += t->nbytes;
    params += t->n_elements;
  }
  printf("tensor types:");
  for (int ty = 0; ty < KVL_TYPE_COUNT_; ty++)
    if (count[ty]) printf(" %s x%" PRIu64 " (%.1f MiB)", kvl_type_name((uint32_t)ty), count[ty], bytes[ty] / 1048576.0);
  printf("\nparameters: %" PRIu64 "\n", params);
  if (tensors)
    for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
      const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
      printf("  %-32s %-5s [", t->name, kvl_type_name(t->type));
      for (uint32_t d = 0; d < t->n_dims; d++) printf("%s%" PRIu64, d ? ", " : "", t->ne[d]);
      printf("] %zu bytes @%" PRIu64 "\n", t->nbytes, t->offset);
    }
  kvl_gguf_free(g);
  return 0;
}
