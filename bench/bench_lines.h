/* bench_lines.h — what the quality benchmarks (multiturn, routing) share: a model beside its
 * KV pool, teacher-forced scoring of a token sequence appended natively to a line, and the
 * translation of a span of one model's line into another's.
 *
 *   struct kvl_bench_side s = {model, pool, translator_to_the_other};
 *   kvl_line_t *l = kvl_line_new(s.pool);
 *   double nll = 0; int k = 0;
 *   kvl_bench_line_score(&s, l, seq, 0, end, n - 1, end, &nll, &k, NULL, NULL);
 *
 * Positions run 0..; scoring position p means the NLL of seq[p + 1] given seq[0..p]. */
#ifndef KVL_BENCH_LINES_H
#define KVL_BENCH_LINES_H

#include <stdbool.h>
#include <stdint.h>

#include "kvl_kvpool.h"
#include "kvl_model.h"
#include "kvl_translator.h"

struct kvl_bench_side {
  kvl_model_t *m;
  kvl_pool_t *pool;
  const kvl_translator_t *to_other; /* this model -> the other one */
};

/* Append positions [from, to) of seq natively to line l (model s), run them (chunks of 256),
 * and for every position p in [score_from, to) with p + 1 < score_end add the NLL of
 * seq[p + 1] to *nll and count it in *n_scored. When nll_at / ent_at are given, they
 * receive the NLL and the entropy (nats) of the predicted distribution at position p,
 * indexed p - score_from. Returns 0 or a negative KVL error. */
int kvl_bench_line_score(struct kvl_bench_side *s, kvl_line_t *l, const int32_t *seq, int32_t from, int32_t to,
                         int32_t score_from, int32_t score_end, double *nll, int *n_scored, double *nll_at,
                         double *ent_at);

/* Translate positions [from, to) of src (model `from_side`) into dst (model `to_side`,
 * appended, recorded as written by `writer`): the protocol's way through
 * kvl_line_translate, which accepts native sources only, or — any_source — the naive way
 * that translates whatever wrote them. Errors are printed with the benchmark's name. */
int kvl_bench_line_translate(struct kvl_bench_side *from_side, struct kvl_bench_side *to_side, kvl_line_t *dst,
                             const kvl_line_t *src, int32_t from, int32_t to, kvl_writer_t writer, bool any_source,
                             const char *who);

/* Open the pair paths[0], paths[1]: each model beside a bf16 KV pool of `blocks` blocks,
 * and the translators <maps>/<a>-to-<b>[.<variant>].safetensors both ways (sd[i].to_other;
 * variant "" = the closed form), their products in bf16 when `bf16` (kvl_translator_use_bf16;
 * refused where the processor cannot). Errors are printed with the benchmark's name. */
int kvl_bench_pair_open(char paths[2][4200], const char *maps, const char *variant, bool bf16, size_t blocks,
                        struct kvl_bench_side sd[2], const char *who);
void kvl_bench_pair_close(struct kvl_bench_side sd[2]);

/* Free the scoring scratch (logits) at the end of a benchmark. */
void kvl_bench_lines_done(void);

#endif
