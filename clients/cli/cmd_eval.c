/* cmd_eval.c — `kvlingo eval`: translators scored on held-out text against the target's
 * native cache, the source's own score and the no-context floor (DESIGN.md "Fitting",
 * Evaluation). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "cli.h"
#include "kvl_error.h"
#include "kvl_fit.h"
#include "kvl_model.h"
#include "kvl_tokenizer.h"
#include "kvl_translator.h"

#define FIRST 16 /* the first continuation tokens, scored separately */

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvlingo eval -a MODEL_A -b MODEL_B -t TRANSLATOR [-t ...] [options]\n"
    "\n"
    "For held-out samples (prefix x1..xn, continuation y1..ym) of each domain: the target's\n"
    "continuation NLL from its native cache; from the translated cache (the source prefills\n"
    "x1..x(n-1), the translator maps it, the target runs xn and y teacher-forced); the source's\n"
    "own; and the target seeing only xn (the no-context floor). Reports KL(native||translated),\n"
    "delta ln PPL, first-16-token NLL, greedy agreement, per-layer held-out R2 of the\n"
    "translated cache, with paired bootstrap 95%% intervals. Writes eval.json and eval.md.\n"
    "\n"
    "  -a, --model-a MODEL    first model (.gguf path or name in $KVLINGO_MODELS)\n"
    "  -b, --model-b MODEL    second model\n"
    "  -t, --translator FILE  a translator between them, either direction (repeatable);\n"
    "                         FILE:bf16 scores it with its products in bf16\n"
    "      --corpus FILE      corpus split (default translator/corpus/split.tsv)\n"
    "      --domains LIST     code,prose (default both)\n"
    "      --samples N        held-out samples per domain (default 24)\n"
    "      --prefix N         prefix tokens n (default 256)\n"
    "      --cont M           continuation tokens m (default 32)\n"
    "      --boot R           bootstrap resamples (default 2000)\n"
    "      --native-prefix N  the target computes the first N prefix positions itself (the\n"
    "                         attention sink) and only positions N..n-2 are translated (default 0)\n"
    "  -o, --out DIR          where eval.json and eval.md go (default .)\n"
    "      --write-scores     store each translator's held-out scores in its file (kvlingo.scores)\n"
    "  -h, --help             this text\n"
    "\n"
    "example: kvlingo eval -a qwen2.5-coder-0.5b -b qwen2.5-coder-1.5b \\\n"
    "           -t translator/maps/qwen2.5-coder-0.5b-to-qwen2.5-coder-1.5b.nu1-r2-affine.safetensors\n");
}

struct model_side {
  char *path, short_name[128];
  kvl_model_t *m;
  kvl_tokenizer_t *tk;
  struct kvl_model_fingerprint fp;
  struct kvl_kv_layout kl;
  int L, V;
  int64_t w;
  /* per sample */
  void *pool;
  int32_t *table;
  float *lp, *lp_floor; /* m × V log-probs: native, no context */
  double *sy, *syy, *cnt; /* per layer and K/V: sums of the native pre-RoPE cache (R²'s centring) */
};

struct tr_entry {
  char path[4096];
  bool bf16;      /* "FILE:bf16": its products in bf16 (kvl_translator_use_bf16) */
  char name[256];
  kvl_translator_t *t;
  int src, dst;   /* indices into the two sides */
  double *nll, *nll16, *kl, *agree, *ms; /* per sample of the current domain */
  double *sse;    /* per target layer and K/V: squared error of the translated cache */
};

/* Run tokens at positions p0.. of an existing cache, logits for all of them (log-probs). */
static int run_on(struct model_side *s, void *pool, const int32_t *table, const int32_t *ids, int n, int32_t p0,
                  float *lp) {
  int32_t *pos = malloc((size_t)n * sizeof(int32_t)), *seq = calloc((size_t)n, sizeof(int32_t));
  for (int i = 0; i < n; i++) pos[i] = p0 + i;
  const int32_t *tables[] = {table};
  struct kvl_kv_view kv = {&s->kl, pool, tables, NULL, 0};
  struct kvl_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seq = seq, .logits = NULL};
  int rc = kvl_model_forward(s->m, kvl_backend_cpu(), &b, &kv, lp, NULL);
  free(pos);
  free(seq);
  if (rc == 0) kvl_log_softmax(lp, n, s->V);
  return rc;
}

static double nll_of(const float *lp, const int32_t *y, int from, int to, int V) {
  double s = 0;
  for (int j = from; j < to; j++) s -= lp[(size_t)j * V + y[j]];
  return s / (to - from);
}

static int open_model(struct model_side *s, const char *arg, char *err, size_t errlen) {
  struct kvl_cli_model cm;
  int rc = kvl_cli_model_open(&cm, arg, err, errlen);
  s->path = cm.path;
  memcpy(s->short_name, cm.short_name, sizeof(s->short_name));
  s->m = cm.m;
  s->tk = cm.tk;
  s->fp = cm.fp;
  if (rc < 0) return rc;
  s->kl = kvl_model_kv_layout(s->m, KVL_KV_F32);
  s->L = cm.L;
  s->w = cm.w;
  s->V = kvl_model_hparams(s->m)->n_vocab;
  return 0;
}

static json_t *stat_json(const double *d, int n, int reps, uint64_t seed) {
  double mean = 0;
  for (int i = 0; i < n; i++) mean += d[i];
  mean /= n;
  double lo, hi;
  kvl_bootstrap_ci(d, n, reps, seed, &lo, &hi);
  return json_pack("{s:f,s:f,s:f}", "mean", mean, "lo", lo, "hi", hi);
}

int kvl_cli_eval(int argc, char **argv) {
  enum { O_CORPUS = 1000, O_DOMAINS, O_SAMPLES, O_PREFIX, O_CONT, O_BOOT, O_NATIVE, O_SCORES };
  static const struct option opts[] = {
    {"model-a", required_argument, 0, 'a'}, {"model-b", required_argument, 0, 'b'},
    {"translator", required_argument, 0, 't'}, {"corpus", required_argument, 0, O_CORPUS},
    {"domains", required_argument, 0, O_DOMAINS}, {"samples", required_argument, 0, O_SAMPLES},
    {"prefix", required_argument, 0, O_PREFIX}, {"cont", required_argument, 0, O_CONT},
    {"boot", required_argument, 0, O_BOOT}, {"out", required_argument, 0, 'o'},
    {"native-prefix", required_argument, 0, O_NATIVE}, {"write-scores", no_argument, 0, O_SCORES},
    {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  const char *arg_a = NULL, *arg_b = NULL, *corpus = "translator/corpus/split.tsv", *out = ".";
  const char *domains = "code,prose";
  int n_samples = 24, n = 256, m = 32, reps = 2000, native = 0;
  bool write_scores = false;
  struct tr_entry *tr = calloc((size_t)argc, sizeof(*tr));
  int nt = 0, c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "a:b:t:o:h", opts, NULL)) != -1) {
    switch (c) {
    case 'a': arg_a = optarg; break;
    case 'b': arg_b = optarg; break;
    case 't': {
      struct tr_entry *e = &tr[nt++];
      snprintf(e->path, sizeof(e->path), "%s", optarg);
      size_t len = strlen(e->path);
      if (len > 5 && strcmp(e->path + len - 5, ":bf16") == 0) {
        e->path[len - 5] = 0;
        e->bf16 = true;
      }
      break;
    }
    case 'o': out = optarg; break;
    case O_CORPUS: corpus = optarg; break;
    case O_DOMAINS: domains = optarg; break;
    case O_SAMPLES: n_samples = atoi(optarg); break;
    case O_PREFIX: n = atoi(optarg); break;
    case O_CONT: m = atoi(optarg); break;
    case O_BOOT: reps = atoi(optarg); break;
    case O_NATIVE: native = atoi(optarg); break;
    case O_SCORES: write_scores = true; break;
    case 'h': usage(stdout); free(tr); return 0;
    default: usage(stderr); free(tr); return 2;
    }
  }
  if (!arg_a || !arg_b || nt == 0 || n_samples < 2 || n < 2 || m < FIRST || reps < 100 || native < 0 ||
      native >= n - 1) {
    usage(stderr);
    free(tr);
    return 2;
  }
  char err[512];
  struct model_side S[2] = {0};
  int rc = open_model(&S[0], arg_a, err, sizeof(err));
  if (rc == 0) rc = open_model(&S[1], arg_b, err, sizeof(err));
  if (rc == 0 && S[0].V != S[1].V) rc = kvl_errf(err, sizeof(err), KVL_EMISMATCH, "vocabularies differ");
  for (int i = 0; i < nt && rc == 0; i++) {
    if ((rc = kvl_translator_load(tr[i].path, &tr[i].t, err, sizeof(err))) < 0) break;
    const char *b = strrchr(tr[i].path, '/');
    snprintf(tr[i].name, sizeof(tr[i].name), "%.200s", b ? b + 1 : tr[i].path); /* room for "+bf16" */
    char *dot = strstr(tr[i].name, ".safetensors");
    if (dot) *dot = 0;
    if (tr[i].bf16) {
      if ((rc = kvl_translator_use_bf16(tr[i].t, true, err, sizeof(err))) < 0) break;
      snprintf(tr[i].name + strlen(tr[i].name), sizeof(tr[i].name) - strlen(tr[i].name), "+bf16");
    }
    char e2[512];
    if (kvl_translator_check_models(tr[i].t, &S[0].fp, &S[1].fp, err, sizeof(err)) == 0) tr[i].src = 0;
    else if (kvl_translator_check_models(tr[i].t, &S[1].fp, &S[0].fp, e2, sizeof(e2)) == 0) tr[i].src = 1;
    else {
      rc = kvl_errf(err, sizeof(err), KVL_EMISMATCH, "%s fits neither direction: %s", tr[i].path, err);
      break;
    }
    tr[i].dst = 1 - tr[i].src;
    struct model_side *T = &S[tr[i].dst];
    tr[i].sse = calloc((size_t)T->L * 2, sizeof(double));
    tr[i].nll = malloc((size_t)n_samples * sizeof(double));
    tr[i].nll16 = malloc((size_t)n_samples * sizeof(double));
    tr[i].kl = malloc((size_t)n_samples * sizeof(double));
    tr[i].agree = malloc((size_t)n_samples * sizeof(double));
    tr[i].ms = malloc((size_t)n_samples * sizeof(double));
  }
  if (rc < 0) {
    fprintf(stderr, "kvlingo eval: %s\n", err);
    return 1;
  }
  mkdir(out, 0755);
  json_t *res = json_object(), *cfgj = json_pack("{s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:i}", "model_a", S[0].short_name,
                                                  "model_b", S[1].short_name, "corpus", corpus, "samples",
                                                  n_samples, "prefix", n, "cont", m, "boot", reps,
                                                  "native_prefix", native);
  json_object_set_new(res, "config", cfgj);
  json_t *trj = json_object();
  json_object_set_new(res, "translators", trj);
  json_t *natj = json_object();
  json_object_set_new(res, "native", natj);
  for (int i = 0; i < nt; i++) {
    json_t *e = json_object();
    json_object_set_new(e, "source", json_string(S[tr[i].src].short_name));
    json_object_set_new(e, "target", json_string(S[tr[i].dst].short_name));
    const char *fj = kvl_translator_fit_json(tr[i].t);
    if (fj) json_object_set_new(e, "fit", json_loads(fj, 0, NULL));
    json_object_set_new(e, "domains", json_object());
    json_object_set_new(trj, tr[i].name, e);
  }
  int V = S[0].V;
  for (int k = 0; k < 2; k++) {
    S[k].lp = malloc((size_t)m * V * sizeof(float));
    S[k].lp_floor = malloc((size_t)m * V * sizeof(float));
    S[k].sy = calloc((size_t)S[k].L * 2 * (size_t)S[k].w, sizeof(double));
    S[k].syy = calloc((size_t)S[k].L * 2, sizeof(double));
    S[k].cnt = calloc((size_t)S[k].L * 2, sizeof(double));
  }
  float *lp_tr = malloc((size_t)m * V * sizeof(float));
  double *nat_nll[2], *nat_nll16[2], *fl_nll[2], *fl_nll16[2];
  for (int k = 0; k < 2; k++) {
    nat_nll[k] = malloc((size_t)n_samples * sizeof(double));
    nat_nll16[k] = malloc((size_t)n_samples * sizeof(double));
    fl_nll[k] = malloc((size_t)n_samples * sizeof(double));
    fl_nll16[k] = malloc((size_t)n_samples * sizeof(double));
  }
  float *ka = malloc((size_t)(S[0].w > S[1].w ? S[0].w : S[1].w) * 4 * sizeof(float));
  char *dl = strdup(domains), *save, *dom;
  double t_start = kvl_cli_now();
  for (dom = strtok_r(dl, ",", &save); dom && rc == 0; dom = strtok_r(NULL, ",", &save)) {
    struct kvl_corpus_opts co = {.split_tsv = corpus, .split = "heldout", .domain = dom, .ctx = n + m,
                                 .min_tokens = n + m, .max_per_file = 1, .max_tokens = 0};
    struct kvl_sample *smp;
    int32_t ns;
    if ((rc = kvl_corpus_samples(&co, S[0].tk, &smp, &ns, err, sizeof(err))) < 0) break;
    if (ns < n_samples) {
      rc = kvl_errf(err, sizeof(err), KVL_ERANGE, "held-out %s has %d samples of %d tokens, %d asked", dom, ns,
                    n + m, n_samples);
      kvl_samples_free(smp, ns);
      break;
    }
    char what[64];
    snprintf(what, sizeof(what), "eval %s", dom);
    double t0 = kvl_cli_now();
    for (int si = 0; si < n_samples && rc == 0; si++) {
      const int32_t *ids = smp[si].ids, *y = ids + n;
      for (int k = 0; k < 2 && rc == 0; k++) {
        struct kvl_capture_out co2 = {.logits = S[k].lp, .logits_from = n - 1, .pool = &S[k].pool,
                                      .table = &S[k].table};
        if ((rc = kvl_fit_capture(S[k].m, ids, n + m - 1, 512, &co2, err, sizeof(err))) < 0) break;
        kvl_log_softmax(S[k].lp, m, V);
        nat_nll[k][si] = nll_of(S[k].lp, y, 0, m, V);
        nat_nll16[k][si] = nll_of(S[k].lp, y, 0, FIRST, V);
        struct kvl_capture_out cf = {.logits = S[k].lp_floor, .logits_from = 0};
        if ((rc = kvl_fit_capture(S[k].m, ids + n - 1, m, 512, &cf, err, sizeof(err))) < 0) break;
        kvl_log_softmax(S[k].lp_floor, m, V);
        fl_nll[k][si] = nll_of(S[k].lp_floor, y, 0, m, V);
        fl_nll16[k][si] = nll_of(S[k].lp_floor, y, 0, FIRST, V);
        /* the native cache's pre-RoPE sums, once per sample: R²'s total sum of squares */
        for (int l = 0; l < S[k].L; l++)
          for (int32_t p = 0; p < n - 1; p++) {
            float *kn = ka, *vn = ka + S[k].w;
            kvl_kv_load(&S[k].kl, S[k].pool, l, p, S[k].table, kn, vn);
            kvl_rope(kvl_backend_cpu(), kvl_model_rope(S[k].m), kn, &p, 1, S[k].kl.n_kv_head, true);
            for (int kv = 0; kv < 2; kv++) {
              const float *b = kv ? vn : kn;
              size_t li = (size_t)l * 2 + kv;
              double *sy = S[k].sy + li * S[k].w;
              for (int64_t q = 0; q < S[k].w; q++) {
                sy[q] += b[q];
                S[k].syy[li] += (double)b[q] * b[q];
              }
              S[k].cnt[li] += 1;
            }
          }
      }
      for (int i = 0; i < nt && rc == 0; i++) {
        struct model_side *Sr = &S[tr[i].src], *T = &S[tr[i].dst];
        int32_t nb = (n + m + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK;
        void *pool = calloc((size_t)nb, kvl_kv_block_bytes(&T->kl));
        int32_t *table = malloc((size_t)nb * sizeof(int32_t)), *pos = malloc((size_t)n * sizeof(int32_t));
        for (int32_t b = 0; b < nb; b++) table[b] = b;
        for (int32_t p = 0; p < n; p++) pos[p] = p;
        struct kvl_translate_span sp = {.src_layout = &Sr->kl, .src_base = Sr->pool, .src_table = Sr->table,
                                        .src_rope = kvl_model_rope(Sr->m), .src_pos = pos + native,
                                        .dst_layout = &T->kl, .dst_base = pool, .dst_table = table,
                                        .dst_rope = kvl_model_rope(T->m), .dst_pos = pos + native,
                                        .n = n - 1 - native};
        if (native > 0) { /* the first positions natively (logits discarded) */
          float *tmp = malloc((size_t)native * V * sizeof(float));
          rc = run_on(T, pool, table, ids, native, 0, tmp);
          free(tmp);
        }
        double ta = kvl_cli_now();
        if (rc == 0) rc = kvl_translator_apply(tr[i].t, &sp, err, sizeof(err));
        tr[i].ms[si] = (kvl_cli_now() - ta) * 1e3;
        if (rc == 0) rc = run_on(T, pool, table, ids + n - 1, m, n - 1, lp_tr);
        if (rc == 0) {
          tr[i].nll[si] = nll_of(lp_tr, y, 0, m, V);
          tr[i].nll16[si] = nll_of(lp_tr, y, 0, FIRST, V);
          double kl = 0, ag = 0;
          for (int j = 0; j < m; j++) {
            bool same;
            kl += kvl_kl_row(T->lp + (size_t)j * V, lp_tr + (size_t)j * V, V, &same);
            ag += same;
          }
          tr[i].kl[si] = kl / m;
          tr[i].agree[si] = ag / m;
          /* held-out R² of the translated cache against the native one: the squared error is
           * the same before and after RoPE (a rotation at the same position), so no un-rotation */
          float *kt = ka, *vt = ka + T->w, *kn = ka + 2 * T->w, *vn = ka + 3 * T->w;
          for (int l = 0; l < T->L; l++)
            for (int32_t p = 0; p < n - 1; p++) {
              kvl_kv_load(&T->kl, pool, l, p, table, kt, vt);
              kvl_kv_load(&T->kl, T->pool, l, p, T->table, kn, vn);
              for (int kv = 0; kv < 2; kv++) {
                const float *a = kv ? vt : kt, *b = kv ? vn : kn;
                double e = 0;
                for (int64_t q = 0; q < T->w; q++) e += ((double)a[q] - b[q]) * ((double)a[q] - b[q]);
                tr[i].sse[(size_t)l * 2 + kv] += e;
              }
            }
        }
        free(pool);
        free(table);
        free(pos);
      }
      for (int k = 0; k < 2; k++) {
        free(S[k].pool);
        free(S[k].table);
        S[k].pool = NULL;
        S[k].table = NULL;
      }
      kvl_cli_progress(what, si + 1, n_samples, t0);
    }
    kvl_samples_free(smp, ns);
    if (rc < 0) break;
    /* summaries of this domain */
    for (int k = 0; k < 2; k++) {
      json_t *d = json_object_get(natj, S[k].short_name);
      if (!d) json_object_set_new(natj, S[k].short_name, d = json_object());
      json_t *o = json_object();
      json_object_set_new(o, "nll", stat_json(nat_nll[k], n_samples, reps, 1));
      json_object_set_new(o, "nll16", stat_json(nat_nll16[k], n_samples, reps, 2));
      json_object_set_new(o, "floor_nll", stat_json(fl_nll[k], n_samples, reps, 3));
      json_object_set_new(o, "floor_nll16", stat_json(fl_nll16[k], n_samples, reps, 4));
      json_object_set_new(d, dom, o);
    }
    double *diff = malloc((size_t)n_samples * sizeof(double));
    for (int i = 0; i < nt; i++) {
      int s = tr[i].src, t = tr[i].dst;
      json_t *o = json_object();
      json_object_set_new(o, "nll", stat_json(tr[i].nll, n_samples, reps, 5));
      json_object_set_new(o, "nll16", stat_json(tr[i].nll16, n_samples, reps, 6));
      json_object_set_new(o, "kl", stat_json(tr[i].kl, n_samples, reps, 7));
      json_object_set_new(o, "agree", stat_json(tr[i].agree, n_samples, reps, 8));
      json_object_set_new(o, "translate_ms", stat_json(tr[i].ms, n_samples, reps, 9));
      for (int j = 0; j < n_samples; j++) diff[j] = tr[i].nll[j] - nat_nll[t][j];
      json_object_set_new(o, "dlnppl", stat_json(diff, n_samples, reps, 10));
      for (int j = 0; j < n_samples; j++) diff[j] = fl_nll16[t][j] - tr[i].nll16[j];
      json_object_set_new(o, "gain16_over_floor", stat_json(diff, n_samples, reps, 11));
      for (int j = 0; j < n_samples; j++) diff[j] = nat_nll[s][j] - tr[i].nll[j];
      json_object_set_new(o, "gain_over_source", stat_json(diff, n_samples, reps, 12));
      for (int j = 0; j < n_samples; j++) diff[j] = nat_nll16[s][j] - tr[i].nll16[j];
      json_object_set_new(o, "gain16_over_source", stat_json(diff, n_samples, reps, 13));
      /* the share of the no-context → native gap the translated cache closes (ratio of means) */
      double fl = 0, nat = 0, tn = 0;
      for (int j = 0; j < n_samples; j++) {
        fl += fl_nll[t][j];
        nat += nat_nll[t][j];
        tn += tr[i].nll[j];
      }
      json_object_set_new(o, "gap_closed", json_real(fl > nat ? (fl - tn) / (fl - nat) : 0));
      json_object_set_new(json_object_get(json_object_get(trj, tr[i].name), "domains"), dom, o);
    }
    free(diff);
  }
  free(dl);
  if (rc < 0) {
    fprintf(stderr, "kvlingo eval: %s\n", err);
    return 1;
  }
  /* per-layer held-out R² */
  for (int i = 0; i < nt; i++) {
    struct model_side *T = &S[tr[i].dst];
    json_t *rk = json_array(), *rv = json_array();
    for (int l = 0; l < T->L; l++)
      for (int kv = 0; kv < 2; kv++) {
        size_t li = (size_t)l * 2 + kv;
        double sst = T->syy[li], *sy = T->sy + li * T->w;
        for (int64_t q = 0; q < T->w; q++) sst -= sy[q] * sy[q] / T->cnt[li];
        json_array_append_new(kv ? rv : rk, json_real(round((1 - tr[i].sse[li] / sst) * 1e4) / 1e4));
      }
    json_t *e = json_object_get(trj, tr[i].name);
    json_object_set_new(e, "heldout_r2_k", rk);
    json_object_set_new(e, "heldout_r2_v", rv);
  }
  json_object_set_new(res, "seconds", json_real(kvl_cli_now() - t_start));
  for (int i = 0; i < nt && write_scores; i++) {
    if (tr[i].bf16) {
      fprintf(stderr, "eval: %s: scores of the bf16 products are not stored (the file's scores are fp32's)\n",
              tr[i].path);
      continue;
    }
    json_t *e = json_object_get(trj, tr[i].name), *sc = json_pack("{s:s,s:i,s:i,s:i,s:i}", "split", "heldout",
                                                                   "samples", n_samples, "prefix", n, "cont", m,
                                                                   "native_prefix", native);
    const char *dn;
    json_t *o;
    json_object_foreach(json_object_get(e, "domains"), dn, o) {
      json_t *d = json_object();
      static const char *const keys[] = {"kl", "dlnppl", "nll16", "gain16_over_floor", "gain16_over_source",
                                         "agree"};
      for (int k = 0; k < 6; k++)
        json_object_set(d, keys[k], json_object_get(o, keys[k]));
      json_object_set_new(sc, dn, d);
    }
    char *txt = json_dumps(sc, JSON_COMPACT | JSON_REAL_PRECISION(5));
    json_decref(sc);
    char err2[512];
    if (kvl_translator_set_scores_json(tr[i].t, txt) < 0 ||
        kvl_translator_save(tr[i].t, tr[i].path, kvl_translator_dtype(tr[i].t), err2, sizeof(err2)) < 0)
      fprintf(stderr, "kvlingo eval: could not store scores in %s\n", tr[i].path);
    else
      fprintf(stderr, "eval: scores stored in %s\n", tr[i].path);
    free(txt);
  }
  char path[4096];
  snprintf(path, sizeof(path), "%s/eval.json", out);
  json_dump_file(res, path, JSON_INDENT(1));
  /* markdown */
  snprintf(path, sizeof(path), "%s/eval.md", out);
  FILE *f = fopen(path, "w");
  if (f) {
    fprintf(f, "Held-out continuation NLL (nats/token), %d samples per domain, prefix %d, continuation %d; "
               "[95%% paired bootstrap]. first16: NLL of the first %d continuation tokens.\n\n",
            n_samples, n, m, FIRST);
    const char *dk;
    json_t *dv;
    json_object_foreach(natj, dk, dv) {
      const char *dn;
      json_t *o;
      json_object_foreach(dv, dn, o) {
        fprintf(f, "- native %s, %s: NLL %.3f, first16 %.3f; no-context floor NLL %.3f, first16 %.3f\n", dk, dn,
                json_real_value(json_object_get(json_object_get(o, "nll"), "mean")),
                json_real_value(json_object_get(json_object_get(o, "nll16"), "mean")),
                json_real_value(json_object_get(json_object_get(o, "floor_nll"), "mean")),
                json_real_value(json_object_get(json_object_get(o, "floor_nll16"), "mean")));
      }
    }
    fprintf(f, "\n| translator | domain | NLL | Δ ln PPL vs native | KL(native‖transl.) | first16 NLL | "
               "first16 gain over floor | first16 gain over the source on its own | gap closed | greedy agree |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nt; i++) {
      json_t *ds = json_object_get(json_object_get(trj, tr[i].name), "domains");
      const char *dn;
      json_t *o;
      json_object_foreach(ds, dn, o) {
#define MEAN(k) json_real_value(json_object_get(json_object_get(o, k), "mean"))
#define LO(k) json_real_value(json_object_get(json_object_get(o, k), "lo"))
#define HI(k) json_real_value(json_object_get(json_object_get(o, k), "hi"))
        fprintf(f, "| %s | %s | %.3f | %.3f [%.3f, %.3f] | %.3f [%.3f, %.3f] | %.3f | %.3f [%.3f, %.3f] | "
                   "%.3f [%.3f, %.3f] | %.0f%% | %.2f |\n",
                tr[i].name, dn, MEAN("nll"), MEAN("dlnppl"), LO("dlnppl"), HI("dlnppl"), MEAN("kl"), LO("kl"),
                HI("kl"), MEAN("nll16"), MEAN("gain16_over_floor"), LO("gain16_over_floor"),
                HI("gain16_over_floor"), MEAN("gain16_over_source"), LO("gain16_over_source"),
                HI("gain16_over_source"), 100 * json_real_value(json_object_get(o, "gap_closed")), MEAN("agree"));
      }
    }
    fclose(f);
  }
  fprintf(stderr, "eval: %s/eval.json, %s/eval.md (%.0f s)\n", out, out, kvl_cli_now() - t_start);
  json_decref(res);
  return 0;
}
