/* fuzz-ckpt.c — libFuzzer target for the distillation checkpoint reader
 * (kvl_distill_load_mem, what `kvlingo distill` reads to resume) against the maps of a
 * tiny model pair: any input is either refused with a message, leaving the maps, moments
 * and step exactly as they were (compared through a checkpoint written before and after),
 * or accepted with a step >= 0, after which the original checkpoint loads back.
 *
 * Version 2 checkpoints carry a CRC-32, so the fuzzer mostly reaches the shape and size
 * checks through version 1 files (no checksum), which the reader still accepts.
 *
 *   FUZZ_CKPT_SEEDS=DIR fuzz-ckpt-replay /dev/null   writes the seed corpus (the tiny
 *   maps' checkpoint as version 2 and as version 1) into DIR and exits */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tiny_fingerprint.h"
#include "../tiny_model.h"
#include "kvl_distill.h"
#include "kvl_error.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvl_distill_t *g_d; /* and what it is made of, kept for the process */
static kvl_model_t *g_m;
static void *g_buf;
static kvl_translator_t *g_id;
static kvl_dense_t *g_dense;
static uint8_t *g_ckpt; /* the checkpoint of g_d as set up */
static size_t g_len;
static char g_path[64];

static uint8_t *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  KVL_ASSERT(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  uint8_t *b = malloc((size_t)n + 1);
  KVL_ASSERT(b && fread(b, 1, (size_t)n, f) == (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return b;
}

/* g_d's state now, as the bytes of its checkpoint. */
static uint8_t *state(size_t *len) {
  char err[256];
  KVL_ASSERT(kvl_distill_save(g_d, g_path, err, sizeof(err)) == 0);
  return slurp(g_path, len);
}

static void write_file(const char *dir, const char *name, const uint8_t *b, size_t n) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  KVL_ASSERT(f && fwrite(b, 1, n, f) == n && fclose(f) == 0);
}

static void setup(void) {
  char err[256];
  g_m = tiny_model_load(&(struct tiny_opts){.n_layer = 2}, &g_buf);
  struct kvl_model_fingerprint fp;
  tiny_fingerprint(g_m, &fp);
  KVL_ASSERT(kvl_translator_identity(&fp, false, &g_id, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_dense_new(g_m, &g_dense, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_distill_new(g_id, g_dense, NULL, &g_d, err, sizeof(err)) == 0);
  snprintf(g_path, sizeof(g_path), "/tmp/fuzz-ckpt-%d.ckpt", (int)getpid());
  g_ckpt = state(&g_len);
  const char *seeds = getenv("FUZZ_CKPT_SEEDS");
  if (seeds) {
    write_file(seeds, "v2.seed", g_ckpt, g_len);
    uint8_t *v1 = malloc(g_len);
    memcpy(v1, g_ckpt, g_len - 4); /* version 1: no checksum */
    memcpy(v1, "KVLDIST1", 8);
    write_file(seeds, "v1.seed", v1, g_len - 4);
    free(v1);
    remove(g_path);
    exit(0);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_d) setup();
  char err[256] = "";
  int rc = kvl_distill_load_mem(g_d, data, size, "fuzz.ckpt", err, sizeof(err));
  if (rc < 0) {
    KVL_ASSERT(err[0] != '\0'); /* every refusal names its reason */
    size_t n;
    uint8_t *now = state(&n); /* and changes nothing */
    KVL_ASSERT(n == g_len && memcmp(now, g_ckpt, n) == 0);
    free(now);
  } else {
    KVL_ASSERT(kvl_distill_steps(g_d) >= 0);
    KVL_ASSERT(kvl_distill_load_mem(g_d, g_ckpt, g_len, "original", err, sizeof(err)) == 0);
  }
  remove(g_path);
  return 0;
}
