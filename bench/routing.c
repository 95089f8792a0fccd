/* routing.c — Benchmark 3, held-out NLL half (test "routing-nll"): what the `cascade` router
 * buys, as quality against large-model tokens. On held-out documents (code and prose),
 * a prompt of P tokens and a continuation of C tokens scored teacher-forced:
 *   always-small   the 0.5B scores every continuation token on its own cache;
 *   always-large   the 1.5B does, on its own cache (it prefilled the whole prompt);
 *   cascade τ      the small model scores; after each token, the mean entropy of its last
 *                  `window` predicted distributions is checked (as the daemon's router
 *                  does) and once it passes τ the large model takes over from the
 *                  translated cache of the small one — prompt and continuation so far —
 *                  computes the last token natively and scores the rest;
 *   cascade-tail τ the same switch points, the large model translating all but the last
 *                  `tail` tokens and computing those natively (a hybrid handoff);
 *   cascade-reprefill τ   the same switch points, the large model computing the whole
 *                  history itself (what a router without translation pays).
 * --head N: in the translated handoffs the large model also computes the first N positions
 * itself (the attention sink), translating only what lies between head and tail.
 * Quality is the mean NLL per continuation token; the gain of a setting is the share of
 * always-large's improvement over always-small it keeps. Cost is the large model's share of
 * the scored tokens and the tokens it computes. The bar: some τ keeps ≥ 90% of
 * the gain with ≤ 50% of the large model's tokens. A bound on what the entropy signal can
 * do at all ("per-token-entropy-bound"): the gain kept if the 10/25/50/75% of tokens where
 * the small model is least sure went to the large model one by one, on its native cache.
 *
 *   bench-routing [--small S.gguf --large L.gguf] [--maps DIR] [--variant distilled] [--precision fp32|bf16]
 *                 [-n 48] [--prompt 192] [--cont 64] [--window 8] [--tail 32] [--head 0]
 *                 [--thresholds 0.5,0.75,1,1.25,1.5,2,2.5,3] [--out DIR]
 *
 * Documents: -n/2 code and -n/2 prose from the held-out split (one per file). The pass
 * rate on Python tasks through the daemon is the other half (bench/routing-tasks.py).
 * Writes bench/results/routing-nll.json (+ .md).
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

enum { MAX_TAU = 16 };

static int parse_list(const char *s, double *out, int max) {
  int n = 0;
  char *end;
  while (*s && n < max) {
    out[n++] = strtod(s, &end);
    if (end == s) return -1;
    s = *end == ',' ? end + 1 : end;
  }
  return n;
}

/* The first continuation index the large model scores under threshold tau: after the
 * small model's j-th token (0-based) with at least `w` tokens seen, the mean of the last w
 * entropies passes tau -> the switch happens before token j + 1. C when it never does. */
static int32_t switch_point(const double *ent, int32_t C, int w, double tau) {
  double acc = 0;
  for (int32_t j = 0; j < C; j++) {
    acc += ent[j];
    if (j >= w) acc -= ent[j - w];
    if (j + 1 >= w && acc / w > tau) return j + 1;
  }
  return C;
}

static const double *g_ent; /* qsort's key: the small model's entropies */
static int by_entropy_desc(const void *a, const void *b) {
  double x = g_ent[*(const size_t *)a], y = g_ent[*(const size_t *)b];
  return x < y ? 1 : x > y ? -1 : 0;
}

int main(int argc, char **argv) {
  static char paths[2][4200], maps[4200], split[4200];
  kvl_bench_model_path("0.5b", paths[0], sizeof(paths[0]));
  kvl_bench_model_path("1.5b", paths[1], sizeof(paths[1]));
  snprintf(maps, sizeof(maps), "%s/translator/maps", KVL_BENCH_SOURCE_ROOT);
  snprintf(split, sizeof(split), "%s/translator/corpus/split.tsv", KVL_BENCH_SOURCE_ROOT);
  int n_docs = 48, P = 192, C = 64, w = 8, tail = 32, head = 0;
  double tau[MAX_TAU];
  int n_tau = parse_list("0.5,0.75,1,1.25,1.5,2,2.5,3", tau, MAX_TAU);
  const char *out = "bench/results", *variant = "distilled";
  bool bf16 = false; /* --precision bf16: the translators' products in bf16, as kvlingod serves where it can */
  static const struct option opts[] = {{"small", required_argument, 0, 'S'}, {"large", required_argument, 0, 'L'},
                                       {"maps", required_argument, 0, 'M'}, {"variant", required_argument, 0, 'V'}, {"precision", required_argument, 0, 'R'},
                                       {"prompt", required_argument, 0, 'P'}, {"cont", required_argument, 0, 'C'},
                                       {"window", required_argument, 0, 'W'}, {"tail", required_argument, 0, 'K'}, {"head", required_argument, 0, 'H'}, {"thresholds", required_argument, 0, 'T'},
                                       {"out", required_argument, 0, 'O'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "n:h", opts, NULL)) != -1) {
    switch (c) {
    case 'S': snprintf(paths[0], sizeof(paths[0]), "%s", optarg); break;
    case 'L': snprintf(paths[1], sizeof(paths[1]), "%s", optarg); break;
    case 'M': snprintf(maps, sizeof(maps), "%s", optarg); break;
    case 'V': variant = optarg; break;
    case 'R':
      if (strcmp(optarg, "bf16") && strcmp(optarg, "fp32")) {
        fprintf(stderr, "bench-routing: --precision: expected fp32 or bf16, got '%s'\n", optarg);
        return 2;
      }
      bf16 = !strcmp(optarg, "bf16");
      break;
    case 'P': P = atoi(optarg); break;
    case 'C': C = atoi(optarg); break;
    case 'W': w = atoi(optarg); break;
    case 'K': tail = atoi(optarg); break;
    case 'H': head = atoi(optarg); break;
    case 'T': n_tau = parse_list(optarg, tau, MAX_TAU); break;
    case 'O': out = optarg; break;
    case 'n': n_docs = atoi(optarg); break;
    default:
      fprintf(c == 'h' ? stdout : stderr,
              "usage: bench-routing [--small S.gguf --large L.gguf] [--maps DIR] [--variant distilled] [-n 48]\n"
              "                     [--prompt 192] [--cont 64] [--window 8] [--tail 32] [--head 0] [--thresholds 0.5,1,2]\n"
              "                     [--out DIR]\n");
      return c == 'h' ? 0 : 2;
    }
  }
  if (n_tau < 1 || P < 2 || C < 2 || w < 1 || w > C || n_docs < 2 || tail < 1 || tail >= P) {
    fprintf(stderr, "bench-routing: bad options (thresholds, --prompt >= 2, 1 <= --window <= --cont, -n >= 2, "
                    "1 <= --tail < --prompt)\n");
    return 2;
  }
  char err[512];
  struct kvl_bench_side sd[2];
  const int32_t N = P + C;
  if (kvl_bench_pair_open(paths, maps, variant, bf16, 4 * ((size_t)N / KVL_KV_BLOCK + 2), sd, "bench-routing") < 0) return 1;
  kvl_tokenizer_t *tk;
  if (kvl_tokenizer_from_gguf(kvl_model_gguf(sd[0].m), &tk, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
  /* half code, half prose */
  struct kvl_sample *smp[2];
  int32_t n_smp[2];
  static const char *const DOM[2] = {"code", "prose"};
  for (int d = 0; d < 2; d++) {
    struct kvl_corpus_opts co = {.split_tsv = split, .split = "heldout", .domain = DOM[d], .ctx = N, .min_tokens = N,
                                 .max_per_file = 1, .max_tokens = (int64_t)N * (n_docs / 2)};
    if (kvl_corpus_samples(&co, tk, &smp[d], &n_smp[d], err, sizeof(err)) < 0) { fprintf(stderr, "bench-routing: %s\n", err); return 1; }
    if (n_smp[d] > n_docs / 2) n_smp[d] = n_docs / 2;
  }
  const int32_t D = n_smp[0] + n_smp[1];
  /* per document: the small and large model's per-token NLL and the small one's entropies;
   * per document and threshold: the switch point and the NLL of the tokens after it on the
   * translated cache */
  double *ns = calloc((size_t)D * C, sizeof(double)), *nl = calloc((size_t)D * C, sizeof(double));
  double *es = calloc((size_t)D * C, sizeof(double)), *nt = calloc((size_t)D * n_tau * 2, sizeof(double));
  int32_t *sw = calloc((size_t)D * n_tau, sizeof(int32_t));
  int *dom = calloc((size_t)D, sizeof(int));
  double t_small = 0, t_large = 0, t_switch = 0;
  int32_t n_switch_runs = 0;
  int32_t ci = 0, pi = 0;
  for (int32_t di = 0; di < D; di++) {
    /* interleave code and prose while both last */
    int d = (di % 2 == 0 && ci < n_smp[0]) || pi >= n_smp[1] ? 0 : 1;
    const int32_t *seq = smp[d][d ? pi++ : ci++].ids;
    dom[di] = d;
    double *s_n = ns + (size_t)di * C, *l_n = nl + (size_t)di * C, *s_e = es + (size_t)di * C;
    double acc = 0, t0;
    int k = 0;
    kvl_line_t *ls = kvl_line_new(sd[0].pool), *ll = kvl_line_new(sd[1].pool);
    t0 = kvl_bench_now();
    if (kvl_bench_line_score(&sd[0], ls, seq, 0, N, P - 1, N, &acc, &k, s_n, s_e) < 0) return 1;
    t_small += kvl_bench_now() - t0;
    acc = 0, k = 0;
    t0 = kvl_bench_now();
    if (kvl_bench_line_score(&sd[1], ll, seq, 0, N, P - 1, N, &acc, &k, l_n, NULL) < 0) return 1;
    t_large += kvl_bench_now() - t0;
    kvl_line_free(ll);
    /* the large model on the translated cache, once per distinct switch point, with the
     * last token only (kind 0) or the last `tail` tokens (kind 1) computed natively */
    for (int ti = 0; ti < n_tau; ti++) {
      int32_t s = switch_point(s_e, C, w, tau[ti]);
      sw[(size_t)di * n_tau + ti] = s;
      int prev = -1;
      for (int tj = 0; tj < ti; tj++)
        if (sw[(size_t)di * n_tau + tj] == s) prev = tj;
      for (int kind = 0; kind < 2; kind++) {
        double v = 0;
        if (s < C && prev >= 0) {
          v = nt[((size_t)di * n_tau + prev) * 2 + kind];
        } else if (s < C) {
          /* the small model holds positions 0..N-1 natively; token P+s is the first the
           * large one predicts: it takes 0..h-1 translated and runs h..N-1 natively, where
           * h = P+s-1 (the last token the small model wrote) less the native tail */
          int32_t h = P - 1 + s - (kind ? tail - 1 : 0);
          if (h < 1) h = 1;
          kvl_line_t *lt = kvl_line_new(sd[1].pool);
          t0 = kvl_bench_now();
          int32_t h0 = head < h ? head : 0; /* --head: the first positions computed natively too */
          double hv = 0;
          int hk = 0;
          if (h0 > 0 && kvl_bench_line_score(&sd[1], lt, seq, 0, h0, N, N, &hv, &hk, NULL, NULL) < 0) return 1;
          if (kvl_bench_line_translate(&sd[0], &sd[1], lt, ls, h0, h, (kvl_writer_t)1, false, "bench-routing") < 0) return 1;
          int kk = 0;
          if (kvl_bench_line_score(&sd[1], lt, seq, h, N, P - 1 + s, N, &v, &kk, NULL, NULL) < 0) return 1;
          t_switch += kvl_bench_now() - t0;
          n_switch_runs++;
          kvl_line_free(lt);
        }
        nt[((size_t)di * n_tau + ti) * 2 + kind] = v;
      }
    }
    kvl_line_free(ls);
    double ms = 0, ml = 0;
    for (int32_t j = 0; j < C; j++) ms += s_n[j], ml += l_n[j];
    fprintf(stderr, "  document %d/%d (%s): small %.3f large %.3f nats/token; switch at", di + 1, D, DOM[d], ms / C, ml / C);
    for (int ti = 0; ti < n_tau; ti++) fprintf(stderr, " %d", sw[(size_t)di * n_tau + ti]);
    int32_t s0 = sw[(size_t)di * n_tau];
    if (s0 < C) { /* after the first threshold's switch: who scores the tail how well */
      double a = 0, b = 0;
      for (int32_t j = s0; j < C; j++) a += s_n[j], b += l_n[j];
      fprintf(stderr, "; after %d: small %.3f, large native %.3f, translated %.3f, translated + %d native %.3f", s0,
              a / (C - s0), b / (C - s0), nt[(size_t)di * n_tau * 2] / (C - s0), tail,
              nt[(size_t)di * n_tau * 2 + 1] / (C - s0));
    }
    fprintf(stderr, "\n");
  }
  /* settings: 0 always-small, 1 always-large, then per tau the three handoffs (KINDS) */
  static const char *const KIND[3] = {"cascade", "cascade-tail", "cascade-reprefill"};
  const int n_set = 2 + 3 * n_tau;
  double *q = calloc((size_t)n_set * D, sizeof(double)); /* mean NLL per token, per document */
  double *lf = calloc((size_t)n_set * D, sizeof(double)); /* large model's share of scored tokens */
  double *lc = calloc((size_t)n_set * D, sizeof(double)); /* tokens the large model computes */
  for (int32_t di = 0; di < D; di++) {
    const double *s_n = ns + (size_t)di * C, *l_n = nl + (size_t)di * C;
    double a = 0, b = 0;
    for (int32_t j = 0; j < C; j++) a += s_n[j], b += l_n[j];
    q[0 * D + di] = a / C, lf[0 * D + di] = 0, lc[0 * D + di] = 0;
    q[1 * D + di] = b / C, lf[1 * D + di] = 1, lc[1 * D + di] = N;
    for (int ti = 0; ti < n_tau; ti++) {
      int32_t s = sw[(size_t)di * n_tau + ti];
      double head = 0, tail_native = 0;
      for (int32_t j = 0; j < s; j++) head += s_n[j];
      for (int32_t j = s; j < C; j++) tail_native += l_n[j];
      for (int kind = 0; kind < 3; kind++) {
        size_t i = (size_t)(2 + 3 * ti + kind) * D + di;
        q[i] = (head + (kind < 2 ? nt[((size_t)di * n_tau + ti) * 2 + kind] : tail_native)) / C;
        lf[i] = (double)(C - s) / C;
        /* computed by the large model: from the first native position to the end */
        lc[i] = s == C ? 0 : kind == 0 ? C - s + 1 : kind == 1 ? C - s + tail : P + C;
      }
    }
  }
  kvl_bench_report_t *rep = kvl_bench_report_new("routing-nll", argc, argv);
  const char *large = kvl_bench_model_name(paths[1]), *small = kvl_bench_model_name(paths[0]);
  double gain_full = 0;
  for (int32_t di = 0; di < D; di++) gain_full += q[0 * D + di] - q[1 * D + di];
  gain_full /= D;
  for (int si = 0; si < n_set; si++) {
    double *x = q + (size_t)si * D, d[4096];
    struct kvl_bench_stats st, sdiff;
    kvl_bench_stats_compute(x, D, &st);
    const char *setting = si == 0 ? "always-small" : si == 1 ? "always-large" : KIND[(si - 2) % 3];
    json_t *r = kvl_bench_report_add(rep, si == 0 ? small : large, "routing-nll", st.mean, "nats/token", D, st.sd);
    json_object_set_new(r, "setting", json_string(setting));
    if (si >= 2) {
      json_object_set_new(r, "max_mean_entropy", json_real(tau[(si - 2) / 3]));
      json_object_set_new(r, "window", json_integer(w));
      json_object_set_new(r, "native_tail", json_integer((si - 2) % 3 == 0 ? 1 : (si - 2) % 3 == 1 ? tail : P + C));
      if ((si - 2) % 3 < 2) json_object_set_new(r, "native_head", json_integer(head));
    }
    double m_lf = 0, m_lc = 0, dom_q[2] = {0}, dom_n[2] = {0};
    for (int32_t di = 0; di < D; di++) {
      m_lf += lf[(size_t)si * D + di], m_lc += lc[(size_t)si * D + di];
      dom_q[dom[di]] += x[di], dom_n[dom[di]]++;
      d[di < 4096 ? di : 4095] = q[0 * D + di] - x[di];
    }
    kvl_bench_stats_compute(d, D < 4096 ? D : 4096, &sdiff);
    json_object_set_new(r, "nll_code", json_real(dom_n[0] ? dom_q[0] / dom_n[0] : NAN));
    json_object_set_new(r, "nll_prose", json_real(dom_n[1] ? dom_q[1] / dom_n[1] : NAN));
    json_object_set_new(r, "gain_over_small", json_real(sdiff.mean));
    json_object_set_new(r, "gain_over_small_se", json_real(sdiff.sd / sqrt((double)D)));
    json_object_set_new(r, "gain_fraction", json_real(gain_full > 0 ? sdiff.mean / gain_full : NAN));
    json_object_set_new(r, "large_token_fraction", json_real(m_lf / D));
    json_object_set_new(r, "large_tokens_computed", json_real(m_lc / D));
    json_object_set_new(r, "translators", json_string(*variant ? variant : "closed-form"));
      json_object_set_new(r, "precision", json_string(bf16 ? "bf16" : "fp32"));
    json_object_set_new(r, "prompt_tokens", json_integer(P));
    json_object_set_new(r, "cont_tokens", json_integer(C));
    fprintf(stderr, "%-18s %s tau %-5.2f  NLL %.4f  gain %5.1f%%  large tokens %5.1f%% (%.0f computed)\n", setting,
            si >= 2 ? "" : " ", si >= 2 ? tau[(si - 2) / 3] : 0.0, st.mean,
            gain_full > 0 ? 100 * sdiff.mean / gain_full : NAN, 100 * m_lf / D, m_lc / D);
  }
  /* How selective the signal is: were the router free to hand any single token to the
   * large model (no cost to switching, the large model on its native cache), the share of
   * always-large's gain it would keep by taking the tokens where the small model's entropy
   * is highest, against taking them at random (the share itself). */
  {
    const size_t T = (size_t)D * C;
    double total = 0;
    size_t *idx = malloc(T * sizeof(size_t));
    for (size_t i = 0; i < T; i++) idx[i] = i, total += ns[i] - nl[i];
    g_ent = es;
    qsort(idx, T, sizeof(size_t), by_entropy_desc);
    static const double SHARE[4] = {0.1, 0.25, 0.5, 0.75};
    for (int k = 0; k < 4; k++) {
      size_t n = (size_t)(SHARE[k] * (double)T);
      double g = 0;
      for (size_t i = 0; i < n; i++) g += ns[idx[i]] - nl[idx[i]];
      double nll = 0;
      for (size_t i = 0; i < T; i++) nll += ns[i];
      nll = (nll - g) / (double)T;
      json_t *r = kvl_bench_report_add(rep, large, "routing-nll", nll, "nats/token", D, 0);
      json_object_set_new(r, "setting", json_string("per-token-entropy-bound"));
      json_object_set_new(r, "large_token_fraction", json_real(SHARE[k]));
      json_object_set_new(r, "gain_fraction", json_real(total > 0 ? g / total : NAN));
      json_object_set_new(r, "translators", json_string("none (native caches)"));
      fprintf(stderr, "per-token bound      the %2.0f%% highest-entropy tokens to the large model: gain %5.1f%%\n",
              100 * SHARE[k], total > 0 ? 100 * g / total : NAN);
    }
    free(idx);
  }
  fprintf(stderr, "time: small %.1f s, large %.1f s (%d documents of %d tokens), %d translated handoffs %.1f s\n", t_small,
          t_large, D, N, n_switch_runs, t_switch);
  int rc = kvl_bench_report_write(rep, out);
  kvl_bench_report_free(rep);
  for (int d = 0; d < 2; d++) kvl_samples_free(smp[d], n_smp[d]);
  free(ns), free(nl), free(es), free(nt), free(sw), free(dom), free(q), free(lf), free(lc);
  kvl_bench_lines_done();
  kvl_tokenizer_free(tk);
  kvl_bench_pair_close(sd);
  return rc < 0 ? 1 : 0;
}
