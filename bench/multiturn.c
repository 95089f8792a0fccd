/* multiturn.c — multi-turn quality of the switching protocol (the paper's figure 5; test
 * "multiturn-nll"): 10-turn conversations cut from held-out documents, the two models
 * alternating (small first). Per turn, the NLL of the reference continuation under the
 * model serving that turn, with three caches:
 *   reprefill  the model computes the whole history itself (the reference);
 *   protocol   DESIGN.md's multi-turn protocol: its own line, extended by translating only
 *              what the other model wrote natively since it last ran, the new user turn
 *              prefilled, nothing translated twice;
 *   naive      the whole history is re-translated from the other model's cache at every
 *              switch, so old spans pass through several translators.
 *
 *   bench-multiturn [--small S.gguf --large L.gguf] [--maps DIR] [-n CONVERSATIONS]
 *                   [--variant distilled] [--precision fp32|bf16] [--turn-user 48] [--turn-cont 32] [--head 32] [--out DIR]
 *
 * --head N: the protocol and the naive scheme compute the first N positions natively in
 * every model and translate only what comes after (the daemon's translate_native_head,
 * 32 by default: the attention sink's block and the next; 0 translates from position 0.
 *
 * A conversation is one held-out corpus sample (translator/corpus/split.tsv, code and
 * prose interleaved) of 10 × (user + continuation) tokens: turn t's user tokens are the
 * next `turn-user` tokens of the document, its continuation the `turn-cont` after them
 * (teacher-forced: the serving model computes them natively, as it would its answer).
 * The translators are DIR/<a>-to-<b>[.<variant>].safetensors: the shipped distilled ones by
 * default, `--variant ""` for the closed form. KV in bf16, as the daemon serves. Writes
 * bench/results/multiturn-nll.json (+ .md).
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_lines.h"
#include "kvl_error.h"
#include "kvl_fit.h"
#include "kvl_kvpool.h"
#include "kvl_model.h"
#include "kvl_translator.h"

enum { TURNS = 10, METHODS = 3 };
static const char *const METHOD[METHODS] = {"reprefill", "protocol", "naive"};

int main(int argc, char **argv) {
  static char paths[2][4200], maps[4200], split[4200];
  kvl_bench_model_path("0.5b", paths[0], sizeof(paths[0]));
  kvl_bench_model_path("1.5b", paths[1], sizeof(paths[1]));
  snprintf(maps, sizeof(maps), "%s/translator/maps", KVL_BENCH_SOURCE_ROOT);
  snprintf(split, sizeof(split), "%s/translator/corpus/split.tsv", KVL_BENCH_SOURCE_ROOT);
  int n_conv = 8, tu = 48, tc = 32, head = 32;
  const char *out = "bench/results", *variant = "distilled";
  bool bf16 = false; /* --precision bf16: the translators' products in bf16, as kvlingod serves where it can */
  static const struct option opts[] = {{"small", required_argument, 0, 'S'}, {"large", required_argument, 0, 'L'},
                                       {"maps", required_argument, 0, 'M'}, {"variant", required_argument, 0, 'V'}, {"precision", required_argument, 0, 'P'}, {"turn-user", required_argument, 0, 'U'},
                                       {"turn-cont", required_argument, 0, 'C'}, {"out", required_argument, 0, 'O'}, {"head", required_argument, 0, 'H'},
                                       {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "n:h", opts, NULL)) != -1) {
    switch (c) {
    case 'S': snprintf(paths[0], sizeof(paths[0]), "%s", optarg); break;
    case 'L': snprintf(paths[1], sizeof(paths[1]), "%s", optarg); break;
    case 'M': snprintf(maps, sizeof(maps), "%s", optarg); break;
    case 'V': variant = optarg; break;
    case 'P':
      if (strcmp(optarg, "bf16") && strcmp(optarg, "fp32")) {
        fprintf(stderr, "bench-multiturn: --precision: expected fp32 or bf16, got '%s'\n", optarg);
        return 2;
      }
      bf16 = !strcmp(optarg, "bf16");
      break;
    case 'U': tu = atoi(optarg); break;
    case 'C': tc = atoi(optarg); break;
    case 'H': head = atoi(optarg); break;
    case 'O': out = optarg; break;
    case 'n': n_conv = atoi(optarg); break;
    default:
      fprintf(c == 'h' ? stdout : stderr, "usage: bench-multiturn [--small S.gguf --large L.gguf] [--maps DIR] [-n N] "
                                          "[--variant distilled] [--turn-user 48] [--turn-cont 32] [--head 32] [--out DIR]\n");
      return c == 'h' ? 0 : 2;
    }
  }
  char err[512];
  struct kvl_bench_side sd[2];
  const int32_t L = TURNS * (tu + tc);
  if (kvl_bench_pair_open(paths, maps, variant, bf16, 6 * ((size_t)L / KVL_KV_BLOCK + 2), sd, "bench-multiturn") < 0) return 1;
  kvl_tokenizer_t *tk;
  if (kvl_tokenizer_from_gguf(kvl_model_gguf(sd[0].m), &tk, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
  struct kvl_corpus_opts co = {.split_tsv = split, .split = "heldout", .domain = NULL, .ctx = L, .min_tokens = L,
                               .max_per_file = 1, .max_tokens = (int64_t)L * n_conv};
  struct kvl_sample *smp;
  int32_t n_smp;
  if (kvl_corpus_samples(&co, tk, &smp, &n_smp, err, sizeof(err)) < 0) { fprintf(stderr, "bench-multiturn: %s\n", err); return 1; }
  if (n_smp > n_conv) n_smp = n_conv;
  /* per method, turn, conversation: mean NLL per continuation token */
  double *nll = calloc((size_t)METHODS * TURNS * (size_t)n_smp, sizeof(double));
  for (int32_t si = 0; si < n_smp; si++) {
    const int32_t *seq = smp[si].ids;
    kvl_line_t *proto[2] = {kvl_line_new(sd[0].pool), kvl_line_new(sd[1].pool)}, *naive = NULL;
    int naive_side = -1;
    for (int t = 0; t < TURNS; t++) {
      int M = t % 2, S = 1 - M;
      int32_t n = t * (tu + tc) + tu, end = n + tc;
      double v[METHODS] = {0};
      int k[METHODS] = {0};
      /* reprefill */
      kvl_line_t *rl = kvl_line_new(sd[M].pool);
      if (kvl_bench_line_score(&sd[M], rl, seq, 0, end, n - 1, end, &v[0], &k[0], NULL, NULL) < 0) return 1;
      kvl_line_free(rl);
      /* protocol */
      kvl_line_t *pl = proto[M], *other = proto[S];
      for (int32_t p = kvl_line_len(pl); p < n - 1;) {
        bool nat = p >= head && p < kvl_line_len(other) && kvl_line_writer(other, p) == KVL_WRITER_NATIVE;
        int32_t e = p + 1;
        while (e < n - 1 && (e >= head && e < kvl_line_len(other) && kvl_line_writer(other, e) == KVL_WRITER_NATIVE) == nat)
          e++;
        double dummy = 0;
        int dk = 0;
        if (nat ? kvl_bench_line_translate(&sd[S], &sd[M], pl, other, p, e, (kvl_writer_t)(S + 1), false, "bench-multiturn") < 0
                : kvl_bench_line_score(&sd[M], pl, seq, p, e, end, end, &dummy, &dk, NULL, NULL) < 0)
          return 1;
        p = e;
      }
      if (kvl_bench_line_score(&sd[M], pl, seq, n - 1, end, n - 1, end, &v[1], &k[1], NULL, NULL) < 0) return 1;
      /* naive: translate everything from the last cache, whatever wrote it */
      int32_t have = 0;
      if (naive && naive_side != M) {
        kvl_line_t *nl = kvl_line_new(sd[M].pool);
        int32_t nh = head < kvl_line_len(naive) ? head : kvl_line_len(naive);
        double dummy = 0;
        int dk = 0;
        if ((nh > 0 && kvl_bench_line_score(&sd[M], nl, seq, 0, nh, end, end, &dummy, &dk, NULL, NULL) < 0) ||
            kvl_bench_line_translate(&sd[naive_side], &sd[M], nl, naive, nh, kvl_line_len(naive), (kvl_writer_t)(S + 1),
                                     true, "bench-multiturn") < 0)
          return 1;
        kvl_line_free(naive);
        naive = nl;
      } else if (!naive) {
        naive = kvl_line_new(sd[M].pool);
      }
      naive_side = M;
      have = kvl_line_len(naive);
      double dummy = 0;
      int dk = 0;
      if (have < n - 1 && kvl_bench_line_score(&sd[M], naive, seq, have, n - 1, end, end, &dummy, &dk, NULL, NULL) < 0) return 1;
      if (kvl_bench_line_score(&sd[M], naive, seq, n - 1, end, n - 1, end, &v[2], &k[2], NULL, NULL) < 0) return 1;
      for (int mth = 0; mth < METHODS; mth++) nll[((size_t)mth * TURNS + t) * n_smp + si] = v[mth] / k[mth];
      fprintf(stderr, "  conversation %d (%s), turn %d on %s: reprefill %.3f protocol %.3f naive %.3f nats/token\n", si + 1,
              smp[si].domain, t + 1, kvl_bench_model_name(paths[M]), v[0] / k[0], v[1] / k[1], v[2] / k[2]);
    }
    kvl_line_free(proto[0]);
    kvl_line_free(proto[1]);
    kvl_line_free(naive);
  }
  kvl_bench_report_t *rep = kvl_bench_report_new("multiturn-nll", argc, argv);
  for (int t = 0; t < TURNS; t++)
    for (int mth = 0; mth < METHODS; mth++) {
      double *x = nll + ((size_t)mth * TURNS + t) * n_smp, d[256];
      struct kvl_bench_stats st;
      kvl_bench_stats_compute(x, n_smp, &st);
      json_t *r = kvl_bench_report_add(rep, kvl_bench_model_name(paths[t % 2]), "multiturn-nll", st.mean, "nats/token", n_smp, st.sd);
      json_object_set_new(r, "turn", json_integer(t + 1));
      json_object_set_new(r, "method", json_string(METHOD[mth]));
      json_object_set_new(r, "translators", json_string(*variant ? variant : "closed-form"));
      json_object_set_new(r, "precision", json_string(bf16 ? "bf16" : "fp32"));
      json_object_set_new(r, "native_head", json_integer(mth > 0 ? head : 0));
      if (mth > 0) { /* paired difference to the reference, with its standard error */
        for (int32_t i = 0; i < n_smp && i < 256; i++) d[i] = x[i] - nll[((size_t)0 * TURNS + t) * n_smp + i];
        struct kvl_bench_stats sdiff;
        kvl_bench_stats_compute(d, n_smp < 256 ? n_smp : 256, &sdiff);
        json_object_set_new(r, "minus_reprefill", json_real(sdiff.mean));
        json_object_set_new(r, "minus_reprefill_se", json_real(sdiff.sd / sqrt((double)n_smp)));
      }
    }
  int rc = kvl_bench_report_write(rep, out);
  kvl_bench_report_free(rep);
  kvl_samples_free(smp, n_smp);
  free(nll);
  kvl_bench_lines_done();
  kvl_tokenizer_free(tk);
  kvl_bench_pair_close(sd);
  return rc < 0 ? 1 : 0;
}
