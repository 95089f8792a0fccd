/* bench_lines.c — teacher-forced scoring on lines and span translation (bench_lines.h). */
#include "bench_lines.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "kvl_error.h"

static float *g_logits;
static size_t g_cap;

void kvl_bench_lines_done(void) {
  free(g_logits);
  g_logits = NULL;
  g_cap = 0;
}

int kvl_bench_line_score(struct kvl_bench_side *s, kvl_line_t *l, const int32_t *seq, int32_t from, int32_t to,
                         int32_t score_from, int32_t score_end, double *nll, int *n_scored, double *nll_at,
                         double *ent_at) {
  const int32_t V = kvl_model_hparams(s->m)->n_vocab;
  for (int32_t c0 = from; c0 < to; c0 += 256) {
    int32_t c1 = c0 + 256 < to ? c0 + 256 : to, T = c1 - c0;
    int rc = kvl_line_append(l, seq + c0, T, KVL_WRITER_NATIVE);
    if (rc < 0) return rc;
    int32_t pos[256], sq[256];
    int8_t want[256];
    int32_t n_want = 0;
    for (int32_t i = 0; i < T; i++) {
      pos[i] = c0 + i;
      sq[i] = 0;
      want[i] = c0 + i >= score_from && c0 + i + 1 < score_end;
      n_want += want[i];
    }
    if ((size_t)n_want * (size_t)V > g_cap) {
      float *g = realloc(g_logits, (size_t)n_want * (size_t)V * sizeof(float));
      if (!g) return KVL_ENOMEM;
      g_logits = g;
      g_cap = (size_t)n_want * (size_t)V;
    }
    const int32_t *tables[1] = {kvl_line_block_table(l)};
    struct kvl_kv_view kv = {kvl_pool_layout(s->pool), kvl_pool_base(s->pool), tables, NULL, 0};
    struct kvl_batch b = {T, seq + c0, pos, sq, want};
    rc = kvl_model_forward(s->m, kvl_backend_cpu(), &b, &kv, n_want ? g_logits : NULL, NULL);
    if (rc < 0) return rc;
    int32_t row = 0;
    for (int32_t i = 0; i < T; i++) {
      if (!want[i]) continue;
      const float *z = g_logits + (size_t)row++ * V;
      float mx = -INFINITY;
      for (int32_t k = 0; k < V; k++) mx = z[k] > mx ? z[k] : mx;
      double sum = 0, zsum = 0; /* entropy = log Σe^(z-mx) - Σ p (z - mx) */
      for (int32_t k = 0; k < V; k++) {
        double e = exp((double)z[k] - mx);
        sum += e;
        zsum += e * ((double)z[k] - mx);
      }
      double v = -((double)z[seq[c0 + i + 1]] - mx - log(sum));
      *nll += v;
      (*n_scored)++;
      if (nll_at) nll_at[c0 + i - score_from] = v;
      if (ent_at) ent_at[c0 + i - score_from] = log(sum) - zsum / sum;
    }
  }
  return 0;
}

int kvl_bench_line_translate(struct kvl_bench_side *from_side, struct kvl_bench_side *to_side, kvl_line_t *dst,
                             const kvl_line_t *src, int32_t from, int32_t to, kvl_writer_t writer, bool any_source,
                             const char *who) {
  char err[256];
  if (!any_source) {
    int rc = kvl_line_translate(dst, src, from_side->to_other, NULL, writer, from, to, kvl_model_rope(from_side->m),
                                kvl_model_rope(to_side->m), err, sizeof(err));
    if (rc < 0) fprintf(stderr, "%s: %s\n", who, err);
    return rc;
  }
  int rc = kvl_line_append(dst, kvl_line_tokens(src) + from, to - from, writer);
  if (rc < 0) return rc;
  int32_t *pos = malloc((size_t)(to - from) * sizeof(int32_t));
  if (!pos) return KVL_ENOMEM;
  for (int32_t i = 0; i < to - from; i++) pos[i] = from + i;
  struct kvl_translate_span sp = {.src_layout = kvl_pool_layout(from_side->pool), .src_base = kvl_pool_base(from_side->pool),
                                  .src_table = kvl_line_block_table(src), .src_rope = kvl_model_rope(from_side->m),
                                  .src_pos = pos, .dst_layout = kvl_pool_layout(to_side->pool),
                                  .dst_base = kvl_pool_base(to_side->pool), .dst_table = kvl_line_block_table(dst),
                                  .dst_rope = kvl_model_rope(to_side->m), .dst_pos = pos, .n = to - from};
  kvl_line_written(dst, from, to); /* the target's rows are about to change */
  rc = kvl_translator_apply(from_side->to_other, &sp, err, sizeof(err));
  free(pos);
  if (rc < 0) fprintf(stderr, "%s: %s\n", who, err);
  return rc;
}

int kvl_bench_pair_open(char paths[2][4200], const char *maps, const char *variant, bool bf16, size_t blocks,
                        struct kvl_bench_side sd[2], const char *who) {
  char err[512];
  memset(sd, 0, 2 * sizeof(*sd));
  for (int i = 0; i < 2; i++) {
    if (kvl_model_open(paths[i], &sd[i].m, err, sizeof(err)) < 0) {
      fprintf(stderr, "%s: %s\n", who, err);
      return KVL_EINVAL;
    }
    kvl_model_prepare(sd[i].m, kvl_backend_cpu()); /* as the daemon does at load */
    struct kvl_kv_layout kl = kvl_model_kv_layout(sd[i].m, KVL_KV_BF16);
    struct kvl_pool_config pc = {.layout = kl, .hot_bytes = blocks * kvl_kv_block_bytes(&kl)};
    int rc = kvl_pool_new(&pc, &sd[i].pool);
    if (rc < 0) return rc;
  }
  for (int i = 0; i < 2; i++) {
    char p[8600];
    kvl_translator_t *t;
    snprintf(p, sizeof(p), "%s/%s-to-%s%s%s.safetensors", maps, kvl_bench_model_name(paths[i]),
             kvl_bench_model_name(paths[1 - i]), *variant ? "." : "", variant);
    if (kvl_translator_load(p, &t, err, sizeof(err)) < 0) {
      fprintf(stderr, "%s: %s\n", who, err);
      return KVL_EINVAL;
    }
    sd[i].to_other = t;
    if (bf16 && kvl_translator_use_bf16(t, true, err, sizeof(err)) < 0) {
      fprintf(stderr, "%s: %s: %s\n", who, p, err);
      return KVL_ENOTSUP;
    }
  }
  return 0;
}

void kvl_bench_pair_close(struct kvl_bench_side sd[2]) {
  for (int i = 0; i < 2; i++) {
    kvl_translator_free((kvl_translator_t *)sd[i].to_other);
    kvl_pool_free(sd[i].pool);
    kvl_model_free(sd[i].m);
  }
}
