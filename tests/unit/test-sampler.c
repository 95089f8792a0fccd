/* test-sampler.c — the sampler of kvl_sampler.h: greedy is the argmax; a fixed seed gives
 * the same tokens (also across threads) and n > 1 sub-streams differ; 10^5 draws of
 * temperature / top-k / top-p / min-p sampling pass a chi-squared test against the exact
 * truncated, renormalised distribution computed here independently; penalties and logit
 * bias give exactly the documented logits; log-probs are the raw model's; bad parameters
 * are refused by name. Ends with a 151936-token timing print (not asserted). */
#include <float.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "../kvl_test.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_sampler.h"

/* ---- helpers --------------------------------------------------------------------- */

static kvl_sampler_t *mk(const struct kvl_sampler_params *p, int V, int seq) {
  char err[256];
  kvl_sampler_t *s = NULL;
  int rc = kvl_sampler_new(p, V, seq, &s, err, sizeof(err));
  if (rc != 0) fprintf(stderr, "kvl_sampler_new: %s (%s)\n", err, kvl_err_name(rc));
  CHECK_EQ_INT(rc, 0);
  return s;
}

static struct kvl_sampler_params seeded(uint64_t seed) {
  struct kvl_sampler_params p;
  kvl_sampler_params_init(&p);
  p.seed = seed;
  p.has_seed = true;
  return p;
}

/* softmax(v / T) in double, -inf allowed */
static void softmax_d(const double *v, int n, double T, double *out) {
  double m = -INFINITY, z = 0;
  for (int i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
  for (int i = 0; i < n; i++) z += out[i] = v[i] == -INFINITY ? 0 : exp((v[i] - m) / T);
  for (int i = 0; i < n; i++) out[i] /= z;
}

/* The processed distribution must equal softmax(want / T). */
static void check_dist(kvl_sampler_t *s, const float *logits, const double *want, int V, double T,
                       int line) {
  float got[64];
  double exp_p[64];
  CHECK_EQ_INT(kvl_sampler_dist(s, logits, got), 0);
  softmax_d(want, V, T, exp_p);
  for (int i = 0; i < V; i++) {
    if (fabs(got[i] - exp_p[i]) > 2e-6) {
      fprintf(stderr, "line %d: token %d: p = %.7f, want %.7f\n", line, i, got[i], exp_p[i]);
      kvl_test_failed++;
    }
  }
}
#define CHECK_DIST(s, logits, want, V, T) check_dist(s, logits, want, V, T, __LINE__)

/* ---- greedy ---------------------------------------------------------------------- */

static void test_greedy_is_argmax(void) {
  enum { V = 1000 };
  static float lg[V];
  unsigned long long r = 7;
  struct kvl_sampler_params p = seeded(1);
  p.temperature = 0.0f;
  p.top_k = 5, p.top_p = 0.3f, p.min_p = 0.2f; /* irrelevant to greedy */
  kvl_sampler_t *s = mk(&p, V, 0);
  p.temperature = 1e-6f; /* below the greedy epsilon */
  kvl_sampler_t *s2 = mk(&p, V, 0);
  for (int t = 0; t < 50; t++) {
    int best = 0;
    for (int i = 0; i < V; i++) {
      lg[i] = 8.0f * kvl_test_randf(&r);
      if (lg[i] > lg[best]) best = i;
    }
    CHECK_EQ_INT(kvl_sampler_sample(s, lg, NULL), best);
    CHECK_EQ_INT(kvl_sampler_sample(s2, lg, NULL), best);
  }
  /* ties go to the lowest id; NaN never wins; one-hot distribution */
  for (int i = 0; i < V; i++) lg[i] = 0.0f;
  lg[0] = NAN, lg[17] = 3.0f, lg[400] = 3.0f;
  CHECK_EQ_INT(kvl_sampler_sample(s, lg, NULL), 17);
  static float pr[V];
  CHECK_EQ_INT(kvl_sampler_dist(s, lg, pr), 0);
  CHECK(pr[17] == 1.0f && pr[400] == 0.0f);
  kvl_sampler_free(s);
  kvl_sampler_free(s2);

  /* greedy is taken after penalties: repetition moves the argmax */
  float two[2] = {2.0f, 1.5f};
  p = seeded(1);
  p.temperature = 0.0f;
  p.repetition_penalty = 2.0f;
  s = mk(&p, 2, 0);
  CHECK_EQ_INT(kvl_sampler_sample(s, two, NULL), 0);
  int32_t prompt[] = {0};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, prompt, 1), 0);
  CHECK_EQ_INT(kvl_sampler_sample(s, two, NULL), 1);
  kvl_sampler_free(s);

  /* everything banned: no token, an error rather than a made-up one */
  struct kvl_logit_bias ban[2] = {{0, -INFINITY}, {1, -INFINITY}};
  p = seeded(1);
  p.bias = ban, p.n_bias = 2;
  s = mk(&p, 2, 0);
  CHECK_EQ_INT(kvl_sampler_sample(s, two, NULL), KVL_ERANGE);
  CHECK_EQ_INT(kvl_sampler_dist(s, two, pr), KVL_ERANGE);
  kvl_sampler_free(s);
  p.temperature = 0.0f;
  s = mk(&p, 2, 0);
  CHECK_EQ_INT(kvl_sampler_sample(s, two, NULL), KVL_ERANGE);
  kvl_sampler_free(s);
}

/* ---- seeds and sub-streams ------------------------------------------------------- */

enum { GEN_V = 500, GEN_T = 400 };

/* Generate GEN_T tokens from logits that depend on the step, with penalties on, so that
 * history, RNG and truncation all take part. */
static void generate(const struct kvl_sampler_params *p, int seq, int32_t *out) {
  float lg[GEN_V];
  kvl_sampler_t *s = mk(p, GEN_V, seq);
  int32_t prompt[] = {1, 2, 3, 2, 1};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, prompt, 5), 0);
  unsigned long long r = 12345;
  for (int t = 0; t < GEN_T; t++) {
    for (int i = 0; i < GEN_V; i++) lg[i] = 2.0f * kvl_test_randf(&r);
    out[t] = kvl_sampler_sample(s, lg, NULL);
    CHECK(out[t] >= 0);
    CHECK_EQ_INT(kvl_sampler_accept(s, out[t]), 0);
  }
  kvl_sampler_free(s);
}

static struct kvl_sampler_params gen_params(uint64_t seed, int n) {
  struct kvl_sampler_params p = seeded(seed);
  p.temperature = 0.9f, p.top_k = 100, p.top_p = 0.95f, p.min_p = 0.01f;
  p.repetition_penalty = 1.1f, p.presence_penalty = 0.2f, p.frequency_penalty = 0.1f;
  p.n = n;
  return p;
}

static int n_diff(const int32_t *a, const int32_t *b) {
  int d = 0;
  for (int t = 0; t < GEN_T; t++) d += a[t] != b[t];
  return d;
}

static void test_seed_reproducible(void) {
  static int32_t a[GEN_T], b[GEN_T], c[GEN_T];
  struct kvl_sampler_params p = gen_params(42, 1);
  generate(&p, 0, a);
  generate(&p, 0, b);
  CHECK_EQ_INT(n_diff(a, b), 0);
  p.seed = 43;
  generate(&p, 0, c);
  CHECK(n_diff(a, c) > GEN_T / 2);

  /* unseeded samplers draw their own seeds */
  p.has_seed = false;
  kvl_sampler_t *s1 = mk(&p, GEN_V, 0), *s2 = mk(&p, GEN_V, 0);
  CHECK(kvl_sampler_seed(s1) != kvl_sampler_seed(s2));
  kvl_sampler_free(s1);
  kvl_sampler_free(s2);
  p.has_seed = true;
  p.seed = 0xdeadbeef;
  s1 = mk(&p, GEN_V, 0);
  CHECK(kvl_sampler_seed(s1) == 0xdeadbeef);
  kvl_sampler_free(s1);
}

enum { N_SEQ = 4 };
struct thread_job {
  struct kvl_sampler_params p;
  int seq;
  int32_t out[GEN_T];
};
static void *thread_main(void *arg) {
  struct thread_job *j = arg;
  generate(&j->p, j->seq, j->out);
  return NULL;
}

static void test_n_substreams(void) {
  static int32_t serial[N_SEQ][GEN_T], again[GEN_T];
  struct kvl_sampler_params p = gen_params(7, N_SEQ);
  for (int i = 0; i < N_SEQ; i++) generate(&p, i, serial[i]);
  for (int i = 0; i < N_SEQ; i++)
    for (int j = i + 1; j < N_SEQ; j++) CHECK(n_diff(serial[i], serial[j]) > GEN_T / 2);
  generate(&p, 2, again);
  CHECK_EQ_INT(n_diff(serial[2], again), 0);

  /* the same streams, generated concurrently on their own threads */
  static struct thread_job jobs[N_SEQ];
  pthread_t th[N_SEQ];
  for (int i = 0; i < N_SEQ; i++) {
    jobs[i].p = p;
    jobs[i].seq = i;
    CHECK_EQ_INT(pthread_create(&th[i], NULL, thread_main, &jobs[i]), 0);
  }
  for (int i = 0; i < N_SEQ; i++) {
    pthread_join(th[i], NULL);
    CHECK_EQ_INT(n_diff(serial[i], jobs[i].out), 0);
  }

  /* greedy consumes no randomness and so is the same in every sub-stream */
  p.temperature = 0.0f;
  static int32_t g0[GEN_T], g1[GEN_T];
  generate(&p, 0, g0);
  generate(&p, 1, g1);
  CHECK_EQ_INT(n_diff(g0, g1), 0);
}

/* ---- chi-squared goodness of fit ------------------------------------------------- */

enum { CHI_V = 50, CHI_DRAWS = 100000 };

/* Upper 0.001 quantile of chi-squared with df degrees of freedom, by Wilson-Hilferty:
 * X ~ df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3 with z the normal 0.999 quantile. */
static double chi2_crit_001(int df) {
  const double z = 3.090232306167813;
  const double a = 2.0 / (9.0 * df);
  return df * pow(1.0 - a + z * sqrt(a), 3.0);
}

static const float *sort_logits;
static int by_logit_desc(const void *a, const void *b) {
  float x = sort_logits[*(const int *)a], y = sort_logits[*(const int *)b];
  return (x < y) - (x > y);
}

/* The exact sampling distribution, by the header's definition, with a full sort:
 * softmax(l / T) -> k largest -> renormalise -> shortest prefix reaching top_p ->
 * p >= min_p * p_max -> renormalise. Returns the margin of the top-p cut (how far the
 * cumulative mass at the cut is from top_p), so a test can refuse a knife-edge case. */
static double expected_dist(const float *l, int V, double T, int top_k, double top_p,
                            double min_p, double *pe) {
  int *ord = malloc((size_t)V * sizeof(*ord));
  double *w = malloc((size_t)V * sizeof(*w)), z = 0;
  for (int i = 0; i < V; i++) ord[i] = i;
  sort_logits = l;
  qsort(ord, (size_t)V, sizeof(*ord), by_logit_desc);
  int keep = top_k > 0 && top_k < V ? top_k : V;
  for (int r = 0; r < keep; r++) z += w[r] = exp(((double)l[ord[r]] - l[ord[0]]) / T);
  double margin = INFINITY;
  if (top_p < 1.0) {
    double cum = 0;
    for (int r = 0; r < keep; r++) {
      double prev = cum;
      cum += w[r] / z;
      if (cum >= top_p) {
        margin = fmin(cum - top_p, top_p - prev);
        keep = r + 1;
        break;
      }
    }
  }
  int m = 0;
  for (int r = 0; r < keep; r++) if (w[r] >= min_p * w[0]) m = r + 1; /* w is decreasing */
  keep = m;
  z = 0;
  for (int r = 0; r < keep; r++) z += w[r];
  for (int i = 0; i < V; i++) pe[i] = 0;
  for (int r = 0; r < keep; r++) pe[ord[r]] = w[r] / z;
  free(ord);
  free(w);
  return margin;
}

/* chi-squared of counts against probabilities pe (over CHI_DRAWS), pooling the cells
 * with an expected count below 5 into one; *df_out = cells - 1. */
static double chi2(const long *cnt, const double *pe, int V, int *df_out) {
  double stat = 0, pool_e = 0, pool_o = 0;
  int cells = 0;
  for (int i = 0; i < V; i++) {
    double e = pe[i] * CHI_DRAWS;
    if (e <= 0) continue;
    if (e < 5) { pool_e += e; pool_o += (double)cnt[i]; continue; }
    stat += (cnt[i] - e) * (cnt[i] - e) / e;
    cells++;
  }
  if (pool_e > 0) {
    stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
    cells++;
  }
  *df_out = cells - 1;
  return stat;
}

static float chi_logits[CHI_V];

static void chi_case(const char *name, float T, int top_k, float top_p, float min_p) {
  double pe[CHI_V];
  double margin = expected_dist(chi_logits, CHI_V, T, top_k, top_p, min_p, pe);
  CHECK(margin > 1e-3); /* the case itself is not on a rounding knife-edge */

  struct kvl_sampler_params p = seeded(2024);
  p.temperature = T, p.top_k = top_k, p.top_p = top_p, p.min_p = min_p;
  kvl_sampler_t *s = mk(&p, CHI_V, 0);

  float pd[CHI_V]; /* the sampler's own distribution is the exact one */
  CHECK_EQ_INT(kvl_sampler_dist(s, chi_logits, pd), 0);
  double maxerr = 0;
  int allowed = 0;
  for (int i = 0; i < CHI_V; i++) {
    maxerr = fmax(maxerr, fabs(pd[i] - pe[i]));
    CHECK((pd[i] > 0) == (pe[i] > 0));
    allowed += pe[i] > 0;
  }
  CHECK(maxerr < 1e-6);

  long cnt[CHI_V] = {0};
  for (int d = 0; d < CHI_DRAWS; d++) {
    int32_t t = kvl_sampler_sample(s, chi_logits, NULL);
    CHECK(t >= 0 && t < CHI_V);
    if (t >= 0 && t < CHI_V) cnt[t]++;
  }
  long outside = 0;
  for (int i = 0; i < CHI_V; i++) if (pe[i] == 0) outside += cnt[i];
  CHECK_EQ_INT(outside, 0);

  int df;
  double x2 = chi2(cnt, pe, CHI_V, &df);
  double crit = chi2_crit_001(df);
  printf("  %-34s kept %2d/%d  chi2 = %7.2f  df = %2d  crit(p=0.001) = %6.2f  %s\n", name,
         allowed, CHI_V, x2, df, crit, x2 < crit ? "pass" : "FAIL");
  CHECK(df >= 1);
  CHECK(x2 < crit);
  kvl_sampler_free(s);
}

static void test_chi2_distributions(void) {
  unsigned long long r = 99;
  for (int i = 0; i < CHI_V; i++) chi_logits[i] = 3.0f * kvl_test_randf(&r);
  chi_case("temperature 1", 1.0f, 0, 1.0f, 0.0f);
  chi_case("temperature 0.7", 0.7f, 0, 1.0f, 0.0f);
  chi_case("top_k 8", 1.0f, 8, 1.0f, 0.0f);
  chi_case("top_p 0.8", 1.0f, 0, 0.8f, 0.0f);
  chi_case("min_p 0.1", 1.0f, 0, 1.0f, 0.1f);
  chi_case("T 1.3, top_k 20, top_p 0.9, min_p .05", 1.3f, 20, 0.9f, 0.05f);
  chi_case("T 0.8, top_k 30, top_p 0.6", 0.8f, 30, 0.6f, 0.0f);

  /* the test has power: draws at T = 1 are refused against the T = 0.9 distribution */
  double pe[CHI_V];
  expected_dist(chi_logits, CHI_V, 0.9, 0, 1.0, 0.0, pe);
  struct kvl_sampler_params p = seeded(5);
  kvl_sampler_t *s = mk(&p, CHI_V, 0);
  long cnt[CHI_V] = {0};
  for (int d = 0; d < CHI_DRAWS; d++) cnt[kvl_sampler_sample(s, chi_logits, NULL)]++;
  int df;
  double x2 = chi2(cnt, pe, CHI_V, &df);
  printf("  %-34s chi2 = %7.2f  df = %2d  crit(p=0.001) = %6.2f  (must exceed)\n",
         "T 1 draws vs T 0.9 (power check)", x2, df, chi2_crit_001(df));
  CHECK(x2 > chi2_crit_001(df));
  kvl_sampler_free(s);
}

/* The large-vocabulary paths (radix top-k, bucketed top-p) against the full sort. */
static void test_truncation_large_vocab(void) {
  enum { V = 20000 };
  static float lg[V], pd[V];
  static double pe[V];
  unsigned long long r = 31337;
  for (int i = 0; i < V; i++) lg[i] = 4.0f * kvl_test_randf(&r) + (i % 97 == 0 ? 6.0f : 0.0f);
  struct { float T; int k; float top_p, min_p; } cases[] = {
      {1.0f, 1, 1.0f, 0.0f},     {1.0f, 7, 1.0f, 0.0f},      {0.5f, 300, 1.0f, 0.0f},
      {1.0f, V - 1, 1.0f, 0.0f}, {1.0f, 0, 0.05f, 0.0f},     {1.0f, 0, 0.5f, 0.0f},
      {2.0f, 0, 0.9f, 0.0f},     {1.0f, 0, 0.997f, 0.0f},    {0.3f, 0, 0.93f, 0.0f},
      {1.0f, 5000, 0.9f, 0.0f},  {1.0f, 0, 0.8f, 0.01f},     {1.0f, 0, 1.0f, 0.3f},
  };
  for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
    struct kvl_sampler_params p = seeded(1);
    p.temperature = cases[ci].T, p.top_k = cases[ci].k;
    p.top_p = cases[ci].top_p, p.min_p = cases[ci].min_p;
    double margin = expected_dist(lg, V, p.temperature, p.top_k, p.top_p, p.min_p, pe);
    kvl_sampler_t *s = mk(&p, V, 0);
    CHECK_EQ_INT(kvl_sampler_dist(s, lg, pd), 0);
    double maxerr = 0;
    int kept = 0, kept_want = 0;
    for (int i = 0; i < V; i++) {
      maxerr = fmax(maxerr, fabs(pd[i] - pe[i]));
      kept += pd[i] > 0, kept_want += pe[i] > 0;
    }
    /* the sampler's probabilities are floats (relative error < 6e-8 each), so its
     * cumulative mass is within ~6e-8 of the exact one: a cut must be clear of that */
    if (!(margin > 2e-7) || maxerr > 1e-6 || kept != kept_want) {
      fprintf(stderr, "case %zu: kept %d, want %d, max |dp| %g, top-p margin %g\n", ci, kept,
              kept_want, maxerr, margin);
      kvl_test_failed++;
    }
    kvl_sampler_free(s);
  }

  /* ties and bans: logits on a coarse grid, a third of the vocabulary banned; top-k keeps
   * exactly k, and nothing dropped beats anything kept */
  static struct kvl_logit_bias ban[V / 3];
  for (int i = 0; i < V / 3; i++) ban[i] = (struct kvl_logit_bias){3 * i, -INFINITY};
  for (int i = 0; i < V; i++) lg[i] = (float)(int)(8.0f * kvl_test_randf(&r));
  int ks[] = {1, 10, 500, 9000, V - V / 3, V - 10};
  for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
    struct kvl_sampler_params p = seeded(1);
    p.top_k = ks[ki], p.bias = ban, p.n_bias = V / 3;
    kvl_sampler_t *s = mk(&p, V, 0);
    CHECK_EQ_INT(kvl_sampler_dist(s, lg, pd), 0);
    int kept = 0;
    float min_kept = INFINITY, max_dropped = -INFINITY;
    for (int i = 0; i < V; i++) {
      bool banned = i % 3 == 0 && i / 3 < V / 3;
      if (pd[i] > 0) {
        kept++;
        min_kept = fminf(min_kept, lg[i]);
        CHECK(!banned);
      } else if (!banned) {
        max_dropped = fmaxf(max_dropped, lg[i]);
      }
    }
    int allowed = V - V / 3;
    CHECK_EQ_INT(kept, ks[ki] < allowed ? ks[ki] : allowed);
    CHECK(max_dropped <= min_kept);
    kvl_sampler_free(s);
  }
}

/* ---- sampling from a row's summary (kvl_logits_top_ref, kvl_sampler_sample_top) -- */

struct vid {
  float v;
  int32_t id;
};

static int vid_desc(const void *a, const void *b) {
  const struct vid *x = a, *y = b;
  if (x->v != y->v) return x->v < y->v ? 1 : -1;
  return (x->id > y->id) - (x->id < y->id);
}

/* the summary against a full sort of the cleaned row, and lse / entropy in long double */
static void check_summary(const float *row, int V, const char *what) {
  struct kvl_logit_top t;
  kvl_logits_top_ref(row, V, &t);
  struct vid *all = malloc((size_t)V * sizeof(*all));
  long double mx = -INFINITY;
  for (int i = 0; i < V; i++) {
    float v = row[i] != row[i] ? -INFINITY : row[i] > FLT_MAX ? FLT_MAX : row[i];
    all[i] = (struct vid){v, i};
    mx = v > mx ? v : mx;
  }
  qsort(all, (size_t)V, sizeof(*all), vid_desc);
  const int n = V < KVL_LOGIT_TOP ? V : KVL_LOGIT_TOP;
  int bad = t.n != n;
  for (int i = 0; i < n && !bad; i++) bad = t.id[i] != all[i].id || memcmp(&t.val[i], &all[i].v, 4) != 0;
  long double z = 0, ez = 0;
  for (int i = 0; i < V && mx > -INFINITY; i++)
    if (all[i].v > -INFINITY) {
      long double d = (long double)all[i].v - mx, e = expl(d);
      z += e, ez += e * d;
    }
  const double lse = mx > -INFINITY ? (double)(mx + logl(z)) : -INFINITY;
  const double h = mx > -INFINITY ? (double)(logl(z) - ez / z) : 0;
  bad |= !(lse == t.lse || fabs(lse - t.lse) <= 1e-6 * fmax(1, fabs(lse))) || !(fabs(h - t.entropy) <= 1e-5);
  if (bad) fprintf(stderr, "summary %s: n %d, lse %g / %g, entropy %g / %g\n", what, t.n, t.lse, lse, t.entropy, h);
  CHECK(!bad);
  free(all);
}

/* the same rank and top tokens; the largest log-prob gap so far in *worst */
static bool same_info(const struct kvl_sample_info *a, const struct kvl_sample_info *b, double *worst) {
  bool ok = a->rank == b->rank && a->n_top == b->n_top;
  *worst = fmax(*worst, fabs(a->logprob - b->logprob));
  for (int j = 0; j < a->n_top && ok; j++) {
    ok = a->top[j].token == b->top[j].token;
    *worst = fmax(*worst, fabs(a->top[j].logprob - b->top[j].logprob));
  }
  return ok;
}

static void test_summary(void) {
  enum { V = 151936 };
  static float lg[V];
  unsigned long long r = 77;
  for (int i = 0; i < V; i++) lg[i] = 3.0f * kvl_test_randf(&r) + (i % 1013 == 0 ? 5.0f : 0.0f);
  check_summary(lg, V, "152k random");
  /* ties at the cut (a coarse grid: the lower ids kept), NaN, +-inf, -0 and +0 */
  for (int i = 0; i < 1000; i++) lg[i] = (float)(int)(4.0f * kvl_test_randf(&r));
  lg[5] = NAN, lg[9] = INFINITY, lg[11] = -INFINITY, lg[12] = -0.0f, lg[13] = 0.0f, lg[700] = INFINITY;
  check_summary(lg, 1000, "1000 on a grid, NaN and infinities");
  check_summary(lg, 40, "40 entries (fewer than 64)");
  for (int i = 0; i < 100; i++) lg[i] = i % 2 ? -INFINITY : NAN;
  check_summary(lg, 100, "nothing finite");

  /* which samplers a summary is enough for: fixed by the params */
  struct { float T; int k; float rep; int n_bias; bool enough; } ce[] = {
      {0.0f, 0, 1.0f, 0, true},   {0.7f, 40, 1.0f, 0, true},  {1.0f, 64, 1.0f, 0, true},
      {1.0f, 65, 1.0f, 0, false}, {1.0f, 0, 1.0f, 0, false},  {0.0f, 0, 1.1f, 0, false},
      {0.7f, 40, 1.0f, 1, false},
  };
  struct kvl_logit_bias b1 = {3, 1.0f};
  for (size_t i = 0; i < sizeof(ce) / sizeof(ce[0]); i++) {
    struct kvl_sampler_params p = seeded(1);
    p.temperature = ce[i].T, p.top_k = ce[i].k, p.repetition_penalty = ce[i].rep;
    p.bias = &b1, p.n_bias = ce[i].n_bias;
    kvl_sampler_t *s = mk(&p, V, 0);
    CHECK(kvl_sampler_top_enough(s) == ce[i].enough);
    kvl_sampler_free(s);
  }

  /* where it is enough: the same tokens, RNG draws and info as from the full rows */
  struct { float T; int k; float top_p, min_p; int top_lp; } cs[] = {
      {0.0f, 0, 1.0f, 0.0f, 0},   {0.0f, 0, 1.0f, 0.0f, 5},   {0.7f, 40, 1.0f, 0.0f, 0},
      {1.0f, 64, 0.9f, 0.0f, 3},  {1.3f, 20, 1.0f, 0.05f, 20}, {1.0f, 1, 1.0f, 0.0f, 1},
      {2.0f, 50, 0.5f, 0.1f, 0},
  };
  struct kvl_logit_top t;
  for (size_t ci = 0; ci < sizeof(cs) / sizeof(cs[0]); ci++) {
    struct kvl_sampler_params p = seeded(5 + ci);
    p.temperature = cs[ci].T, p.top_k = cs[ci].k, p.top_p = cs[ci].top_p, p.min_p = cs[ci].min_p;
    p.logprobs = true, p.top_logprobs = cs[ci].top_lp;
    kvl_sampler_t *sf = mk(&p, V, 0), *st = mk(&p, V, 0);
    CHECK(kvl_sampler_top_enough(st));
    int same = 0, steps = 40;
    double worst_lp = 0;
    for (int step = 0; step < steps; step++) {
      for (int i = 0; i < V; i++) lg[i] = 2.0f * kvl_test_randf(&r) + (i % 4099 == step ? 6.0f : 0.0f);
      kvl_logits_top_ref(lg, V, &t);
      struct kvl_sample_info a, b;
      int32_t ta = kvl_sampler_sample(sf, lg, &a), tb = kvl_sampler_sample_top(st, &t, &b);
      same += ta == tb && same_info(&a, &b, &worst_lp);
    }
    if (same != steps || worst_lp > 1e-5)
      fprintf(stderr, "summary case %zu: %d of %d steps agree, max |d logprob| %g\n", ci, same, steps, worst_lp);
    CHECK_EQ_INT(same, steps);
    CHECK(worst_lp <= 1e-5);
    kvl_sampler_free(sf), kvl_sampler_free(st);
  }

  /* without truncation: a draw made with the summary (the reference's, at the point the
   * sampler took in advance), and the whole row drawn at a point taken in advance: the
   * same tokens and info as the plain path, one point of the stream per token */
  struct { float T; int top_lp; } cd[] = {{1.0f, 0}, {0.7f, 5}, {1.5f, 20}};
  for (size_t ci = 0; ci < sizeof(cd) / sizeof(cd[0]); ci++) {
    struct kvl_sampler_params p = seeded(50 + ci);
    p.temperature = cd[ci].T, p.logprobs = true, p.top_logprobs = cd[ci].top_lp;
    kvl_sampler_t *sf = mk(&p, V, 0), *st = mk(&p, V, 0), *sp = mk(&p, V, 0);
    CHECK(kvl_sampler_draw_enough(st) && !kvl_sampler_top_enough(st));
    int same = 0, steps = 30;
    double worst_lp = 0;
    for (int step = 0; step < steps; step++) {
      for (int i = 0; i < V; i++) lg[i] = 2.0f * kvl_test_randf(&r) + (i % 4099 == step ? 6.0f : 0.0f);
      struct kvl_logit_top tt, tp;
      kvl_sampler_predraw(st, &tt);
      kvl_sampler_predraw(st, &tt); /* twice asked: the same point */
      kvl_logits_top_ref(lg, V, &tt);
      kvl_sampler_predraw(sp, &tp);
      struct kvl_sample_info a, b, c;
      int32_t ta = kvl_sampler_sample(sf, lg, &a), tb = kvl_sampler_sample_top(st, &tt, &b);
      int32_t tc = kvl_sampler_sample(sp, lg, &c);
      same += ta == tb && ta == tc && same_info(&a, &b, &worst_lp) && same_info(&a, &c, &worst_lp);
    }
    if (same != steps || worst_lp > 1e-5)
      fprintf(stderr, "draw case %zu: %d of %d steps agree, max |d logprob| %g\n", ci, same, steps, worst_lp);
    CHECK_EQ_INT(same, steps);
    CHECK(worst_lp <= 1e-5);
    kvl_sampler_free(sf), kvl_sampler_free(st), kvl_sampler_free(sp);
  }
}

/* ---- penalties and bias, exactly ------------------------------------------------- */

static const float pen_logits[6] = {2.0f, -1.0f, 0.5f, 1.0f, -0.5f, 0.0f};

static void test_repetition_penalty(void) {
  struct kvl_sampler_params p = seeded(1);
  p.repetition_penalty = 2.0f;
  kvl_sampler_t *s = mk(&p, 6, 0);
  double none[6] = {2, -1, 0.5, 1, -0.5, 0};
  CHECK_DIST(s, pen_logits, none, 6, 1.0);
  int32_t prompt[] = {0, 1, 0};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, prompt, 3), 0);
  CHECK_EQ_INT(kvl_sampler_accept(s, 1), 0);
  /* seen: 0 (positive, divided) and 1 (negative, multiplied), once however often */
  double want[6] = {1, -2, 0.5, 1, -0.5, 0};
  CHECK_DIST(s, pen_logits, want, 6, 1.0);
  kvl_sampler_free(s);

  /* a window of the last 2 context tokens */
  p.repetition_last_n = 2;
  s = mk(&p, 6, 0);
  int32_t pr4[] = {0, 1, 2, 3};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, pr4, 4), 0);
  double w1[6] = {2, -1, 0.25, 0.5, -0.5, 0};
  CHECK_DIST(s, pen_logits, w1, 6, 1.0);
  CHECK_EQ_INT(kvl_sampler_accept(s, 4), 0); /* window now {3, 4} */
  double w2[6] = {2, -1, 0.5, 0.5, -1.0, 0};
  CHECK_DIST(s, pen_logits, w2, 6, 1.0);
  CHECK_EQ_INT(kvl_sampler_accept(s, 4), 0); /* window {4, 4} */
  double w3[6] = {2, -1, 0.5, 1, -1.0, 0};
  CHECK_DIST(s, pen_logits, w3, 6, 1.0);
  kvl_sampler_free(s);
}

static void test_presence_frequency(void) {
  struct kvl_sampler_params p = seeded(1);
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  kvl_sampler_t *s = mk(&p, 6, 0);
  int32_t prompt[] = {0, 0, 3};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, prompt, 3), 0); /* the prompt does not count */
  int32_t gen[] = {2, 2, 5, 2};
  for (int i = 0; i < 4; i++) CHECK_EQ_INT(kvl_sampler_accept(s, gen[i]), 0);
  double want[6] = {2, -1, 0.5 - 0.5 - 3 * 0.25, 1, -0.5, 0 - 0.5 - 0.25};
  CHECK_DIST(s, pen_logits, want, 6, 1.0);
  kvl_sampler_free(s);

  /* negative values encourage repeats */
  p.presence_penalty = -1.0f, p.frequency_penalty = 0.0f;
  s = mk(&p, 6, 0);
  CHECK_EQ_INT(kvl_sampler_accept(s, 4), 0);
  double want2[6] = {2, -1, 0.5, 1, 0.5, 0};
  CHECK_DIST(s, pen_logits, want2, 6, 1.0);
  kvl_sampler_free(s);
}

static void test_bias_and_order(void) {
  struct kvl_logit_bias b[] = {{1, 3.0f}, {0, -INFINITY}, {1, 0.5f}};
  struct kvl_sampler_params p = seeded(3);
  p.bias = b, p.n_bias = 3;
  kvl_sampler_t *s = mk(&p, 6, 0);
  b[0].bias = 99.0f; /* the sampler kept its own copy */
  double want[6] = {-INFINITY, 2.5, 0.5, 1, -0.5, 0};
  CHECK_DIST(s, pen_logits, want, 6, 1.0);
  long zero = 0;
  for (int i = 0; i < 2000; i++) zero += kvl_sampler_sample(s, pen_logits, NULL) == 0;
  CHECK_EQ_INT(zero, 0);
  kvl_sampler_free(s);

  /* bias -> repetition -> presence/frequency -> temperature: token 3 has logit 1, bias
   * -3, is in the context (x2 as it is negative by then) and was generated once:
   * (1 - 3) * 2 - 0.5 - 0.25 = -4.75, then / T = 2. */
  struct kvl_logit_bias b3[] = {{3, -3.0f}};
  p = seeded(3);
  p.bias = b3, p.n_bias = 1;
  p.repetition_penalty = 2.0f, p.presence_penalty = 0.5f, p.frequency_penalty = 0.25f;
  p.temperature = 2.0f;
  s = mk(&p, 6, 0);
  CHECK_EQ_INT(kvl_sampler_accept(s, 3), 0);
  double want3[6] = {2, -1, 0.5, -4.75, -0.5, 0};
  CHECK_DIST(s, pen_logits, want3, 6, 2.0);
  kvl_sampler_free(s);
}

/* ---- log-probs ------------------------------------------------------------------- */

static void test_logprobs(void) {
  enum { V = 20 };
  float lg[V];
  unsigned long long r = 3;
  for (int i = 0; i < V; i++) lg[i] = 4.0f * kvl_test_randf(&r);
  double lsm[V], m = -INFINITY, z = 0;
  for (int i = 0; i < V; i++) m = fmax(m, lg[i]);
  for (int i = 0; i < V; i++) z += exp(lg[i] - m);
  for (int i = 0; i < V; i++) lsm[i] = lg[i] - m - log(z);

  /* processing (temperature, bias, penalties, top-k) does not change the raw log-probs */
  struct kvl_logit_bias b[] = {{4, 5.0f}};
  struct kvl_sampler_params p = seeded(11);
  p.temperature = 0.5f, p.top_k = 3, p.bias = b, p.n_bias = 1;
  p.repetition_penalty = 1.5f;
  p.logprobs = true, p.top_logprobs = KVL_SAMPLER_MAX_LOGPROBS;
  kvl_sampler_t *s = mk(&p, V, 0);
  int32_t prompt[] = {1, 2};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, prompt, 2), 0);
  for (int t = 0; t < 20; t++) {
    struct kvl_sample_info info;
    int32_t tok = kvl_sampler_sample(s, lg, &info);
    CHECK(tok >= 0 && tok == info.token);
    CHECK_EQ_INT(info.n_top, V);
    double sum = 0;
    for (int j = 0; j < info.n_top; j++) {
      sum += exp(info.top[j].logprob);
      CHECK(fabs(info.top[j].logprob - lsm[info.top[j].token]) < 1e-5);
      if (j) CHECK(info.top[j].logprob <= info.top[j - 1].logprob);
    }
    CHECK(fabs(sum - 1.0) < 1e-5);
    CHECK(fabs(info.logprob - lsm[tok]) < 1e-5);
    int rank = 1;
    for (int i = 0; i < V; i++) rank += lg[i] > lg[tok];
    CHECK_EQ_INT(info.rank, rank);
    CHECK_EQ_INT(info.top[rank - 1].token, tok);
  }
  kvl_sampler_free(s);

  /* top 5 of a larger vocabulary; greedy path; off by default */
  enum { V2 = 3000 };
  static float big[V2];
  for (int i = 0; i < V2; i++) big[i] = 6.0f * kvl_test_randf(&r);
  p = seeded(1);
  p.temperature = 0.0f, p.logprobs = true, p.top_logprobs = 5;
  s = mk(&p, V2, 0);
  struct kvl_sample_info info;
  int32_t tok = kvl_sampler_sample(s, big, &info);
  CHECK_EQ_INT(info.n_top, 5);
  CHECK_EQ_INT(info.top[0].token, tok);
  CHECK_EQ_INT(info.rank, 1);
  for (int j = 0; j < 5; j++) {
    int above = 0;
    for (int i = 0; i < V2; i++) above += big[i] > big[info.top[j].token];
    CHECK_EQ_INT(above, j);
  }
  kvl_sampler_free(s);
  p.logprobs = false, p.top_logprobs = 0;
  s = mk(&p, V2, 0);
  kvl_sampler_sample(s, big, &info);
  CHECK(isnan(info.logprob) && info.n_top == 0 && info.rank == 0);
  kvl_sampler_free(s);
}

/* ---- invalid parameters ---------------------------------------------------------- */

static void expect_bad(const struct kvl_sampler_params *p, int V, const char *msg, int line) {
  char err[256] = "";
  int rc = kvl_sampler_params_validate(p, V, err, sizeof(err));
  kvl_sampler_t *s = (kvl_sampler_t *)1;
  char err2[256] = "";
  int rc2 = kvl_sampler_new(p, V, 0, &s, err2, sizeof(err2));
  if (rc != KVL_EINVAL || !strstr(err, msg) || rc2 != KVL_EINVAL || s != NULL ||
      strcmp(err, err2) != 0) {
    fprintf(stderr, "line %d: got %s '%s' / %s '%s', want KVL_EINVAL with '%s'\n", line,
            kvl_err_name(rc), err, kvl_err_name(rc2), err2, msg);
    kvl_test_failed++;
  }
}
#define BAD(field, value, msg)                                                   \
  do {                                                                           \
    struct kvl_sampler_params q_;                                                \
    kvl_sampler_params_init(&q_);                                                \
    q_.field = value;                                                            \
    expect_bad(&q_, 50, msg, __LINE__);                                          \
  } while (0)

static void test_invalid_params(void) {
  struct kvl_sampler_params p;
  kvl_sampler_params_init(&p);
  char err[256] = "x";
  CHECK_EQ_INT(kvl_sampler_params_validate(&p, 50, err, sizeof(err)), 0);
  CHECK(err[0] == '\0');
  expect_bad(&p, 0, "n_vocab", __LINE__);

  BAD(temperature, -0.5f, "temperature must be in [0, 100] (got -0.5)");
  BAD(temperature, NAN, "temperature");
  BAD(temperature, 1000.0f, "temperature");
  BAD(top_p, 0.0f, "top_p must be in (0, 1] (got 0)");
  BAD(top_p, 1.5f, "top_p");
  BAD(min_p, -0.1f, "min_p must be in [0, 1]");
  BAD(min_p, 1.01f, "min_p");
  BAD(top_k, -1, "top_k must be >= 0");
  BAD(repetition_penalty, 0.0f, "repetition_penalty must be in (0, 10]");
  BAD(repetition_penalty, 11.0f, "repetition_penalty");
  BAD(repetition_penalty, INFINITY, "repetition_penalty");
  BAD(repetition_last_n, -1, "repetition_last_n");
  BAD(presence_penalty, 2.5f, "presence_penalty must be in [-2, 2]");
  BAD(frequency_penalty, -3.0f, "frequency_penalty must be in [-2, 2]");
  BAD(n, 0, "n must be in [1, 128]");
  BAD(top_logprobs, 21, "top_logprobs must be in [0, 20]");
  BAD(top_logprobs, 3, "top_logprobs (3) requires logprobs");
  BAD(n_bias, 2, "logit_bias: 2 entries but no array");

  struct kvl_logit_bias b[1];
  kvl_sampler_params_init(&p);
  p.bias = b, p.n_bias = 1;
  b[0] = (struct kvl_logit_bias){50, 1.0f};
  expect_bad(&p, 50, "logit_bias: token 50 is outside the vocabulary [0, 50)", __LINE__);
  b[0] = (struct kvl_logit_bias){-1, 1.0f};
  expect_bad(&p, 50, "token -1 is outside", __LINE__);
  b[0] = (struct kvl_logit_bias){3, 200.0f};
  expect_bad(&p, 50, "bias for token 3 must be in [-100, 100] or -inf (got 200)", __LINE__);
  b[0] = (struct kvl_logit_bias){3, NAN};
  expect_bad(&p, 50, "bias for token 3", __LINE__);
  b[0] = (struct kvl_logit_bias){3, INFINITY};
  expect_bad(&p, 50, "bias for token 3", __LINE__);
  b[0] = (struct kvl_logit_bias){3, -INFINITY};
  CHECK_EQ_INT(kvl_sampler_params_validate(&p, 50, NULL, 0), 0);

  /* sequence index outside [0, n); tokens outside the vocabulary */
  kvl_sampler_params_init(&p);
  p.n = 2;
  kvl_sampler_t *s;
  CHECK_EQ_INT(kvl_sampler_new(&p, 50, 2, &s, err, sizeof(err)), KVL_EINVAL);
  CHECK_STR_CONTAINS(err, "sequence index 2");
  CHECK(s == NULL);
  p.repetition_penalty = 1.2f;
  s = mk(&p, 50, 1);
  int32_t bad_prompt[] = {3, 50};
  CHECK_EQ_INT(kvl_sampler_accept_prompt(s, bad_prompt, 2), KVL_EINVAL);
  CHECK_EQ_INT(kvl_sampler_accept(s, -1), KVL_EINVAL);
  CHECK_EQ_INT(kvl_sampler_accept(s, 49), 0);
  kvl_sampler_free(s);
  kvl_sampler_free(NULL);
}

/* ---- the real vocabulary: timing, printed ---------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void time_case(const char *name, struct kvl_sampler_params p, const float *lg, int V,
                      int iters) {
  kvl_sampler_t *s = mk(&p, V, 0);
  static int32_t hist[2000];
  unsigned long long r = 77;
  if (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f) {
    for (int i = 0; i < 2000; i++) hist[i] = (int32_t)(kvl_test_rand(&r) % (unsigned)V);
    kvl_sampler_accept_prompt(s, hist, 1500);
    for (int i = 1500; i < 2000; i++) kvl_sampler_accept(s, hist[i]);
  }
  struct kvl_sample_info info;
  kvl_sampler_sample(s, lg, &info); /* warm the scratch */
  double t0 = now_s();
  for (int i = 0; i < iters; i++) CHECK(kvl_sampler_sample(s, lg, &info) >= 0);
  double dt = (now_s() - t0) / iters;
  printf("  %-44s %8.3f ms/token\n", name, dt * 1e3);
  kvl_sampler_free(s);
}

static void test_timing_152k(void) {
  enum { V = 151936 };
  static float peaked[V], flat[V];
  unsigned long long r = 4242;
  for (int i = 0; i < V; i++) {
    /* a bulk of logits around 0 with a few tokens well above it, like a real LM head */
    peaked[i] = 2.5f * (kvl_test_randf(&r) + kvl_test_randf(&r) + kvl_test_randf(&r));
    flat[i] = 1.0f * kvl_test_randf(&r);
  }
  for (int i = 0; i < 40; i++) peaked[kvl_test_rand(&r) % V] = 12.0f + 4.0f * kvl_test_randf(&r);
  const int it = 20;
  struct kvl_sampler_params p = seeded(1);
  p.temperature = 0.0f;
  time_case("greedy", p, peaked, V, it);
  p.logprobs = true, p.top_logprobs = 20;
  time_case("greedy + logprobs (top 20)", p, peaked, V, it);
  p = seeded(1);
  time_case("temperature 1, full vocabulary", p, peaked, V, it);
  p.top_k = 50;
  time_case("top_k 50", p, peaked, V, it);
  p = seeded(1);
  p.top_p = 0.9f;
  time_case("top_p 0.9", p, peaked, V, it);
  time_case("top_p 0.9, near-flat logits (worst case)", p, flat, V, it);
  p = seeded(1);
  p.min_p = 0.05f;
  time_case("min_p 0.05", p, peaked, V, it);
  p = seeded(1);
  p.temperature = 0.7f, p.top_k = 40, p.top_p = 0.95f, p.min_p = 0.05f;
  p.repetition_penalty = 1.1f, p.presence_penalty = 0.3f, p.frequency_penalty = 0.1f;
  p.logprobs = true, p.top_logprobs = 5;
  time_case("everything, 2000-token history, logprobs 5", p, peaked, V, it);
}

int main(void) {
  RUN(test_greedy_is_argmax);
  RUN(test_seed_reproducible);
  RUN(test_n_substreams);
  RUN(test_chi2_distributions);
  RUN(test_truncation_large_vocab);
  RUN(test_summary);
  RUN(test_repetition_penalty);
  RUN(test_presence_frequency);
  RUN(test_bias_and_order);
  RUN(test_logprobs);
  RUN(test_invalid_params);
  RUN(test_timing_152k);
  return TEST_EXIT();
}
