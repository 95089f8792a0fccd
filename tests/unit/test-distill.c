/* test-distill.c — stage-2 self-distillation on tiny models: a translator between two
 * copies of one model, started from a corrupted identity (identity + noise, so its
 * closed form is wrong), is trained through the frozen target; the KL on samples it never
 * saw falls by more than half (how far the maps move towards identity is printed: directions
 * the data never excites stay free). Checkpoints
 * round-trip exactly; a checkpoint of other shapes is refused. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../kvl_test.h"
#include "../tiny_fingerprint.h"
#include "../tiny_model.h"
#include "kvl_distill.h"
#include "kvl_error.h"

enum { NTRAIN = 24, NTEST = 4, PREFIX = 24, CONT = 8 };

static double identity_distance(const kvl_translator_t *t) {
  double ss = 0;
  for (int32_t l = 0; l < kvl_translator_n_layer(t); l++)
    for (int which = 0; which < 2; which++) {
      struct kvl_translator_map m;
      KVL_ASSERT(kvl_translator_get_map(t, l, (enum kvl_translator_kv)which, &m) == 0);
      for (int64_t r = 0; r < m.rows; r++)
        for (int64_t c = 0; c < m.cols; c++) {
          double e = m.data[r * m.cols + c] - (r == c ? 1.0 : 0.0);
          ss += e * e;
        }
    }
  return sqrt(ss);
}

static double mean_kl(kvl_distill_t *d, struct kvl_distill_sample *s, int n) {
  double sum = 0, kl;
  for (int i = 0; i < n; i++) {
    KVL_ASSERT(kvl_distill_eval(d, &s[i], &kl) == 0);
    sum += kl;
  }
  return sum / n;
}

int main(void) {
  void *buf;
  kvl_model_t *m = tiny_model_load(&(struct tiny_opts){.n_layer = 2}, &buf);
  struct kvl_model_fingerprint fp;
  tiny_fingerprint(m, &fp);
  char err[256];
  /* a corrupted identity: I + noise on every map */
  kvl_translator_t *id, *bad;
  KVL_ASSERT(kvl_translator_identity(&fp, false, &id, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_translator_new(&fp, &fp, false, &bad, err, sizeof(err)) == 0);
  unsigned long long rs = 7;
  for (int32_t l = 0; l < kvl_translator_n_layer(id); l++)
    for (int which = 0; which < 2; which++) {
      struct kvl_translator_map mp;
      KVL_ASSERT(kvl_translator_get_map(id, l, (enum kvl_translator_kv)which, &mp) == 0);
      float *w = malloc(sizeof(float) * (size_t)(mp.rows * mp.cols));
      for (int64_t i = 0; i < mp.rows * mp.cols; i++)
        w[i] = mp.data[i] + 0.25f * (float)((double)(kvl_test_rand(&rs) % 2001) / 1000.0 - 1.0);
      KVL_ASSERT(kvl_translator_set_map(bad, l, (enum kvl_translator_kv)which, mp.sources, mp.nu, w) == 0);
      free(w);
    }
  /* samples: random token sequences, the same model as source and target */
  struct kvl_distill_sample tr[NTRAIN], te[NTEST];
  int32_t ids[PREFIX + CONT];
  for (int i = 0; i < NTRAIN + NTEST; i++) {
    for (int j = 0; j < PREFIX + CONT; j++) ids[j] = (int32_t)(kvl_test_rand(&rs) % 300);
    CHECK_EQ_INT(kvl_distill_prepare(m, m, ids, PREFIX, CONT, 16, i < NTRAIN ? &tr[i] : &te[i - NTRAIN], err, sizeof(err)), 0);
  }
  CHECK(kvl_distill_sample_bytes(&tr[0]) > 0);
  /* the sample store: a round trip is exact; another key, a truncated file, a missing one
   * are refused by name */
  {
    const char *sp = "test-distill.samples";
    struct kvl_distill_sample *ls;
    int32_t ln;
    CHECK_EQ_INT(kvl_distill_samples_save(sp, "k=1", te, NTEST, err, sizeof(err)), 0);
    CHECK_EQ_INT(kvl_distill_samples_load(sp, "k=1", &ls, &ln, err, sizeof(err)), 0);
    CHECK_EQ_INT(ln, NTEST);
    for (int i = 0; i < ln && i < NTEST; i++) {
      const struct kvl_distill_sample *a = &te[i], *b = &ls[i];
      size_t kv = (size_t)a->n_layer_src * a->P * a->w_src, top = (size_t)a->m * a->k;
      CHECK(a->P == b->P && a->m == b->m && a->n_layer_src == b->n_layer_src && a->w_src == b->w_src && a->k == b->k);
      CHECK(!memcmp(a->tokens, b->tokens, (size_t)a->m * 4) && !memcmp(a->src_k, b->src_k, kv * 2) &&
            !memcmp(a->src_v, b->src_v, kv * 2) && !memcmp(a->top_ids, b->top_ids, top * 4) &&
            !memcmp(a->top_lp, b->top_lp, top * 4));
      kvl_distill_sample_free(&ls[i]);
    }
    free(ls);
    CHECK_EQ_INT(kvl_distill_samples_load(sp, "k=2", &ls, &ln, err, sizeof(err)), KVL_EMISMATCH);
    CHECK_STR_CONTAINS(err, sp);
    FILE *f = fopen(sp, "r+b");
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fclose(f);
    CHECK(truncate(sp, len - 3) == 0);
    CHECK_EQ_INT(kvl_distill_samples_load(sp, "k=1", &ls, &ln, err, sizeof(err)), KVL_EFORMAT);
    CHECK_STR_CONTAINS(err, sp);
    CHECK(ls == NULL && ln == 0);
    remove(sp);
    CHECK_EQ_INT(kvl_distill_samples_load(sp, "k=1", &ls, &ln, err, sizeof(err)), KVL_ENOENT);
  }
  kvl_dense_t *dense;
  CHECK_EQ_INT(kvl_dense_new(m, &dense, err, sizeof(err)), 0);
  /* the true identity scores ~0: the samples and the target agree */
  kvl_distill_t *d;
  CHECK_EQ_INT(kvl_distill_new(id, dense, NULL, &d, err, sizeof(err)), 0);
  double kl_id = mean_kl(d, te, NTEST);
  kvl_distill_free(d);
  CHECK_EQ_INT(kvl_distill_new(bad, dense, &(struct kvl_distill_opts){.clip = 1.0f}, &d, err, sizeof(err)), 0);
  double kl0 = mean_kl(d, te, NTEST), dist0 = identity_distance(bad);
  double kl;
  for (int step = 0; step < 80; step++) {
    for (int b = 0; b < 4; b++) CHECK_EQ_INT(kvl_distill_accumulate(d, &tr[(step * 4 + b) % NTRAIN], 0.25f, &kl), 0);
    kvl_distill_update(d, 2e-2f, NULL);
  }
  double kl1 = mean_kl(d, te, NTEST);
  kvl_translator_t *out;
  KVL_ASSERT(kvl_translator_new(&fp, &fp, false, &out, err, sizeof(err)) == 0);
  CHECK_EQ_INT(kvl_distill_export(d, out), 0);
  double dist1 = identity_distance(out);
  printf("  held-out KL: identity %.2e, corrupted %.4f -> %.4f after %lld steps (%.0f%% less); distance to identity "
         "%.2f -> %.2f; %lld parameters\n", kl_id, kl0, kl1, (long long)kvl_distill_steps(d), 100 * (1 - kl1 / kl0), dist0,
         dist1, (long long)kvl_distill_params(d));
  CHECK(kl_id < 1e-5);
  CHECK(kl1 < 0.5 * kl0);
  /* a batch through the target equals its samples one by one (per-sample KL, gradient norm,
   * the step taken), with prefixes and continuations of different lengths in one batch */
  {
    struct kvl_distill_sample mixed[2];
    int32_t ids2[40];
    for (int j = 0; j < 40; j++) ids2[j] = (int32_t)(kvl_test_rand(&rs) % 300);
    CHECK_EQ_INT(kvl_distill_prepare(m, m, ids2, 11, 5, 16, &mixed[0], err, sizeof(err)), 0);
    CHECK_EQ_INT(kvl_distill_prepare(m, m, ids2 + 3, 30, 3, 16, &mixed[1], err, sizeof(err)), 0);
    const struct kvl_distill_sample *bs[3] = {&mixed[0], &tr[5], &mixed[1]};
    kvl_distill_t *da, *db;
    const struct kvl_distill_opts big_clip = {.clip = 1e9f};
    KVL_ASSERT(kvl_distill_new(bad, dense, &big_clip, &da, err, sizeof(err)) == 0);
    KVL_ASSERT(kvl_distill_new(bad, dense, &big_clip, &db, err, sizeof(err)) == 0);
    double ka[3], kb[3], na, nb, worst = 0;
    for (int b = 0; b < 3; b++) CHECK_EQ_INT(kvl_distill_accumulate(da, bs[b], 1.0f / 3, &ka[b]), 0);
    CHECK_EQ_INT(kvl_distill_accumulate_batch(db, bs, 3, 1.0f / 3, kb), 0);
    kvl_distill_update(da, 1e-2f, &na);
    kvl_distill_update(db, 1e-2f, &nb);
    for (int b = 0; b < 3; b++) worst = fmax(worst, fabs(ka[b] - kb[b]) / fmax(ka[b], 1e-12));
    kvl_translator_t *ta, *tb;
    KVL_ASSERT(kvl_translator_new(&fp, &fp, false, &ta, err, sizeof(err)) == 0);
    KVL_ASSERT(kvl_translator_new(&fp, &fp, false, &tb, err, sizeof(err)) == 0);
    CHECK_EQ_INT(kvl_distill_export(da, ta), 0);
    CHECK_EQ_INT(kvl_distill_export(db, tb), 0);
    double dmax = 0;
    for (int32_t l = 0; l < kvl_translator_n_layer(ta); l++)
      for (int which = 0; which < 2; which++) {
        struct kvl_translator_map ma, mb;
        KVL_ASSERT(kvl_translator_get_map(ta, l, (enum kvl_translator_kv)which, &ma) == 0);
        KVL_ASSERT(kvl_translator_get_map(tb, l, (enum kvl_translator_kv)which, &mb) == 0);
        for (int64_t i = 0; i < ma.rows * ma.cols; i++) dmax = fmax(dmax, fabs((double)ma.data[i] - mb.data[i]));
      }
    printf("  batch of 3 (prefixes 11, %d, 30) vs one by one: KL rel. diff %.1e, gradient norm %.6f vs %.6f, "
           "maps after a step differ by %.1e\n", (int)tr[5].P, worst, nb, na, dmax);
    CHECK(ka[0] > 0 && ka[1] > 0 && ka[2] > 0);
    CHECK(worst < 1e-4);
    CHECK(fabs(na - nb) <= 1e-4 * na);
    CHECK(dmax < 1e-4); /* a step moves each entry by up to lr = 1e-2 */
    kvl_translator_free(ta);
    kvl_translator_free(tb);
    kvl_distill_free(da);
    kvl_distill_free(db);
    kvl_distill_sample_free(&mixed[0]);
    kvl_distill_sample_free(&mixed[1]);
  }
  /* checkpoints: save, move on, load -> the saved maps and step again */
  const char *ck = "test-distill.ckpt";
  CHECK_EQ_INT(kvl_distill_save(d, ck, err, sizeof(err)), 0);
  double kl_saved = mean_kl(d, te, NTEST);
  int64_t step_saved = kvl_distill_steps(d);
  CHECK_EQ_INT(kvl_distill_accumulate(d, &tr[0], 1, &kl), 0);
  kvl_distill_update(d, 1e-1f, NULL);
  CHECK(mean_kl(d, te, NTEST) != kl_saved);
  CHECK_EQ_INT(kvl_distill_load(d, ck, err, sizeof(err)), 0);
  CHECK(mean_kl(d, te, NTEST) == kl_saved && kvl_distill_steps(d) == step_saved);
  /* a damaged checkpoint (one flipped bit in a map; then one cut short) is refused by name
   * and changes nothing: move on, try to load, the maps and step are those moved on to */
  {
    FILE *f = fopen(ck, "rb");
    CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    unsigned char *bytes = malloc((size_t)size);
    CHECK(fread(bytes, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    CHECK_EQ_INT(kvl_distill_accumulate(d, &tr[0], 1, &kl), 0);
    kvl_distill_update(d, 1e-1f, NULL);
    double kl_now = mean_kl(d, te, NTEST);
    int64_t step_now = kvl_distill_steps(d);
    const char *bad = "test-distill-bad.ckpt";
    for (int cut = 0; cut < 2; cut++) {
      f = fopen(bad, "wb");
      bytes[size / 2] ^= cut ? 0 : 0x10;
      CHECK(fwrite(bytes, 1, (size_t)(cut ? size - 4 : size), f) == (size_t)(cut ? size - 4 : size));
      bytes[size / 2] ^= cut ? 0 : 0x10;
      fclose(f);
      CHECK_EQ_INT(kvl_distill_load(d, bad, err, sizeof(err)), KVL_EFORMAT);
      CHECK_STR_CONTAINS(err, "test-distill-bad.ckpt");
      CHECK_STR_CONTAINS(err, cut ? "size differ" : "checksum mismatch");
      CHECK(mean_kl(d, te, NTEST) == kl_now && kvl_distill_steps(d) == step_now);
    }
    remove(bad);
    free(bytes);
  }
  /* a checkpoint of another shape is refused by name */
  void *buf3;
  kvl_model_t *m3 = tiny_model_load(&(struct tiny_opts){.n_layer = 3}, &buf3);
  struct kvl_model_fingerprint fp3;
  tiny_fingerprint(m3, &fp3);
  kvl_translator_t *id3;
  kvl_dense_t *dense3;
  kvl_distill_t *d3;
  KVL_ASSERT(kvl_translator_identity(&fp3, false, &id3, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_dense_new(m3, &dense3, err, sizeof(err)) == 0);
  KVL_ASSERT(kvl_distill_new(id3, dense3, NULL, &d3, err, sizeof(err)) == 0);
  CHECK_EQ_INT(kvl_distill_load(d3, ck, err, sizeof(err)), KVL_EFORMAT);
  CHECK_STR_CONTAINS(err, "test-distill.ckpt");
  /* and a translator for another model is refused */
  kvl_distill_t *dx;
  CHECK_EQ_INT(kvl_distill_new(id3, dense, NULL, &dx, err, sizeof(err)), KVL_EMISMATCH);
  remove(ck);
  kvl_distill_free(d3);
  kvl_dense_free(dense3);
  kvl_translator_free(id3);
  kvl_model_free(m3);
  free(buf3);
  for (int i = 0; i < NTRAIN; i++) kvl_distill_sample_free(&tr[i]);
  for (int i = 0; i < NTEST; i++) kvl_distill_sample_free(&te[i]);
  kvl_translator_free(out);
  kvl_translator_free(bad);
  kvl_translator_free(id);
  kvl_distill_free(d);
  kvl_dense_free(dense);
  kvl_model_free(m);
  free(buf);
  return TEST_EXIT();
}
