/* cmd_fit.c — `kvlingo fit`: stage-1 (closed-form) translators for a pair of models, both
 * directions, from one pass of both models over the corpus (DESIGN.md "Fitting"). */
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

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvlingo fit -a MODEL_A -b MODEL_B [options]\n"
    "\n"
    "Fit closed-form (ridge) KV translators A->B and B->A. Both models run once over the\n"
    "corpus' fit and validation splits; their pre-RoPE keys and values go into float64\n"
    "second moments (checkpointed: an interrupted fit resumes), from which every layer\n"
    "assignment, nu, linear and affine map is solved; the ridge penalty of each map is\n"
    "chosen on the validation split. Writes one translator per variant and fit-report.json.\n"
    "\n"
    "  -a, --model-a MODEL    first model (.gguf path or name in $KVLINGO_MODELS)\n"
    "  -b, --model-b MODEL    second model (same tokenizer)\n"
    "      --corpus FILE      corpus split (default translator/corpus/split.tsv)\n"
    "      --tokens N         fit-split tokens (default 32768)\n"
    "      --val-tokens N     validation-split tokens (default 8192)\n"
    "      --ctx N            tokens per sample (default 512)\n"
    "      --chat-every K     every K-th sample wrapped in the chat template (default 4, 0 = none)\n"
    "      --sink-weight W    weight of position 0 (the attention sink) in the fit (default 1)\n"
    "      --nu LIST          source layers per target layer (default 1,2,4)\n"
    "      --assign LIST      depth,r2,greedy (default all three)\n"
    "      --kind LIST        linear,affine (default both)\n"
    "      --lambdas LIST     ridge grid, relative to the mean diagonal (default 1e-5,1e-4,1e-3,1e-2,1e-1)\n"
    "      --work DIR         statistics and checkpoints (default ~/.cache/kvlingo/fit)\n"
    "  -o, --out DIR          where translators and fit-report.json go (default: the work dir)\n"
    "      --dtype f32|bf16   map storage (default bf16)\n"
    "  -h, --help             this text\n"
    "\n"
    "example: kvlingo fit -a qwen2.5-coder-0.5b -b qwen2.5-coder-1.5b --nu 1,2,4\n");
}

/* "1,2,4" -> ints; returns count. */
static int parse_ints(const char *s, int *out, int max) {
  int n = 0;
  char *dup = strdup(s), *save, *tok;
  for (tok = strtok_r(dup, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save)) out[n++] = atoi(tok);
  free(dup);
  return n;
}

static uint64_t fnv_file(const char *path) {
  uint64_t h = 1469598103934665603ULL;
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  int c;
  while ((c = fgetc(f)) != EOF) h = (h ^ (uint64_t)c) * 1099511628211ULL;
  fclose(f);
  return h;
}

static int mkdirs(const char *dir) {
  char tmp[4096];
  snprintf(tmp, sizeof(tmp), "%s", dir);
  for (char *p = tmp + 1; *p; p++)
    if (*p == '/') {
      *p = 0;
      mkdir(tmp, 0755);
      *p = '/';
    }
  return mkdir(tmp, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

/* Capture both models over one split into statistics, resuming from a checkpoint. */
static int capture_split(struct kvl_cli_model *A, struct kvl_cli_model *B, const struct kvl_corpus_opts *co, const char *work,
                         const char *split, const char *tag, double sink_weight, kvl_fit_stats_t **out, char *err,
                         size_t errlen) {
  char final[4000], partial[4100];
  snprintf(final, sizeof(final), "%s/%s-%s.%s.stats", work, A->short_name, B->short_name, split);
  snprintf(partial, sizeof(partial), "%s.partial", final);
  if (kvl_fit_stats_load(final, tag, &A->fp, &B->fp, out, err, errlen) == 0) {
    fprintf(stderr, "fit: %s statistics from %s (%lld tokens)\n", split, final,
            (long long)kvl_fit_stats_tokens(*out));
    return 0;
  }
  struct kvl_sample *smp;
  int32_t ns;
  int rc = kvl_corpus_samples(co, A->tk, &smp, &ns, err, errlen);
  if (rc < 0) return rc;
  int64_t total = 0;
  for (int32_t i = 0; i < ns; i++) total += smp[i].n;
  kvl_fit_stats_t *st = NULL;
  if (kvl_fit_stats_load(partial, tag, &A->fp, &B->fp, &st, err, errlen) == 0)
    fprintf(stderr, "fit: resuming %s from %lld of %d samples\n", split, (long long)kvl_fit_stats_samples(st), ns);
  else if (!(st = kvl_fit_stats_new(&A->fp, &B->fp, err, errlen))) {
    kvl_samples_free(smp, ns);
    return KVL_ENOMEM;
  }
  int32_t ctx = co->ctx;
  float **buf = calloc((size_t)2 * (A->L + B->L), sizeof(float *));
  for (int l = 0; l < A->L; l++) {
    buf[l] = malloc((size_t)ctx * A->w * sizeof(float));
    buf[A->L + l] = malloc((size_t)ctx * A->w * sizeof(float));
  }
  for (int l = 0; l < B->L; l++) {
    buf[2 * A->L + l] = malloc((size_t)ctx * B->w * sizeof(float));
    buf[2 * A->L + B->L + l] = malloc((size_t)ctx * B->w * sizeof(float));
  }
  float **kA = buf, **vA = buf + A->L, **kB = buf + 2 * A->L, **vB = buf + 2 * A->L + B->L;
  double *wt = malloc((size_t)ctx * sizeof(double));
  double t0 = kvl_cli_now(), last_ckpt = t0;
  int64_t done_tok = 0;
  for (int32_t i = 0; i < (int32_t)kvl_fit_stats_samples(st) && i < ns; i++) done_tok += smp[i].n;
  int64_t start_tok = done_tok;
  char what[32];
  snprintf(what, sizeof(what), "capture %s", split);
  for (int32_t i = (int32_t)kvl_fit_stats_samples(st); i < ns && rc == 0; i++) {
    struct kvl_capture_out oa = {.k = kA, .v = vA}, ob = {.k = kB, .v = vB};
    if ((rc = kvl_fit_capture(A->m, smp[i].ids, smp[i].n, 512, &oa, err, errlen)) < 0) break;
    if ((rc = kvl_fit_capture(B->m, smp[i].ids, smp[i].n, 512, &ob, err, errlen)) < 0) break;
    for (int32_t t = 0; t < smp[i].n; t++) wt[t] = t == 0 ? sink_weight : 1.0;
    if ((rc = kvl_fit_stats_add(st, kA, vA, kB, vB, wt, smp[i].n)) < 0) break;
    done_tok += smp[i].n;
    double now = kvl_cli_now();
    kvl_cli_progress(what, done_tok - start_tok, total - start_tok, t0);
    if (now - last_ckpt > 600 && i + 1 < ns) {
      if ((rc = kvl_fit_stats_save(st, partial, tag, err, errlen)) < 0) break;
      last_ckpt = kvl_cli_now();
    }
  }
  for (int i = 0; i < 2 * (A->L + B->L); i++) free(buf[i]);
  free(buf);
  free(wt);
  kvl_samples_free(smp, ns);
  if (rc == 0) rc = kvl_fit_stats_save(st, final, tag, err, errlen);
  if (rc < 0) {
    kvl_fit_stats_free(st);
    return rc;
  }
  remove(partial);
  *out = st;
  return 0;
}

static json_t *matrix_json(const double *m, int rows, int cols) {
  json_t *a = json_array();
  for (int r = 0; r < rows; r++) {
    json_t *row = json_array();
    for (int c = 0; c < cols; c++) json_array_append_new(row, json_real(round(m[r * cols + c] * 1e5) / 1e5));
    json_array_append_new(a, row);
  }
  return a;
}

static json_t *ints_json(const int32_t *v, int n) {
  json_t *a = json_array();
  for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
  return a;
}

struct fit_cfg {
  int nus[8], n_nu;
  bool assign[3], kind[2]; /* kind[0] linear, kind[1] affine */
  double lambdas[16];
  int n_lambda;
  const char *out;
  enum kvl_translator_dtype dtype;
  char provenance[1400];
};

/* Solve every variant of one direction; write translators and add to the report. */
static int solve_direction(const kvl_fit_stats_t *fit, const kvl_fit_stats_t *val, enum kvl_fit_dir dir,
                           struct kvl_cli_model *S, struct kvl_cli_model *T, const struct fit_cfg *cfg, json_t *report, char *err,
                           size_t errlen) {
  int rc = 0;
  int Ls = S->L, Lt = T->L;
  double *r2[2];
  json_t *d = json_object();
  char dname[300];
  snprintf(dname, sizeof(dname), "%s-to-%s", S->short_name, T->short_name);
  json_object_set_new(report, dname, d);
  for (int kv = 0; kv < 2; kv++) {
    r2[kv] = malloc((size_t)Ls * Lt * sizeof(double));
    if ((rc = kvl_fit_pair_r2(fit, val, dir, kv, 1e-3, r2[kv], err, errlen)) < 0) return rc;
    json_object_set_new(d, kv ? "pair_r2_v" : "pair_r2_k", matrix_json(r2[kv], Ls, Lt));
  }
  /* greedy orders, up to the largest nu, computed once */
  int max_nu = 0;
  for (int i = 0; i < cfg->n_nu; i++) max_nu = cfg->nus[i] > max_nu ? cfg->nus[i] : max_nu;
  int32_t *greedy[2] = {NULL, NULL};
  if (cfg->assign[KVL_ASSIGN_GREEDY] && max_nu > 1) {
    double t0 = kvl_cli_now();
    for (int kv = 0; kv < 2; kv++) {
      greedy[kv] = malloc((size_t)Lt * max_nu * sizeof(int32_t));
      for (int l = 0; l < Lt && rc == 0; l++) {
        rc = kvl_fit_assign_greedy(fit, val, dir, l, kv, max_nu, 1e-2, greedy[kv] + l * max_nu, err, errlen);
        kvl_cli_progress("greedy", kv * Lt + l + 1, 2 * Lt, t0);
      }
    }
  }
  json_t *variants = json_array();
  json_object_set_new(d, "variants", variants);
  int64_t max_rows = kvl_fit_map_rows(fit, dir, max_nu, true);
  double *map = malloc((size_t)(max_rows * T->w) * sizeof(double)), *best = malloc((size_t)(max_rows * T->w) * sizeof(double));
  float *mapf = malloc((size_t)(max_rows * T->w) * sizeof(float));
  for (int ni = 0; ni < cfg->n_nu && rc == 0; ni++) {
    int nu = cfg->nus[ni];
    for (int as = 0; as < 3 && rc == 0; as++) {
      if (!cfg->assign[as] || (as == KVL_ASSIGN_GREEDY && nu == 1)) continue; /* greedy ν=1 is r2 */
      for (int kind = 0; kind < 2 && rc == 0; kind++) {
        if (!cfg->kind[kind]) continue;
        bool affine = kind == 1;
        kvl_translator_t *tr;
        if ((rc = kvl_translator_new(&S->fp, &T->fp, affine, &tr, err, errlen)) < 0) break;
        json_t *v = json_object(), *layers = json_array();
        double sum_r2[2] = {0, 0};
        char vname[400];
        snprintf(vname, sizeof(vname), "%s.nu%d-%s-%s", dname, nu, kvl_fit_assign_name(as),
                 affine ? "affine" : "linear");
        double t0 = kvl_cli_now();
        for (int l = 0; l < Lt && rc == 0; l++) {
          json_t *lj = json_object();
          for (int kv = 0; kv < 2 && rc == 0; kv++) {
            int32_t src[64];
            if (as == KVL_ASSIGN_DEPTH) kvl_fit_assign_depth(Ls, Lt, l, nu, src);
            else if (as == KVL_ASSIGN_R2) kvl_fit_assign_r2(r2[kv], Ls, Lt, l, nu, src);
            else {
              memcpy(src, greedy[kv] + l * max_nu, (size_t)nu * sizeof(int32_t));
              for (int a = 1; a < nu; a++) /* ascending */
                for (int b = a; b > 0 && src[b - 1] > src[b]; b--) {
                  int32_t x = src[b];
                  src[b] = src[b - 1];
                  src[b - 1] = x;
                }
            }
            int64_t rows = kvl_fit_map_rows(fit, dir, nu, affine);
            double best_sse = INFINITY, best_lambda = 0, sst = 0;
            for (int li = 0; li < cfg->n_lambda; li++) {
              struct kvl_fit_solve_opts o = {.affine = affine, .lambda = cfg->lambdas[li]};
              if (kvl_fit_solve(fit, dir, l, kv, src, nu, &o, map, err, errlen) < 0) continue;
              double sse;
              kvl_fit_sse(val, dir, l, kv, src, nu, affine, map, &sse, &sst);
              if (sse < best_sse) {
                best_sse = sse;
                best_lambda = cfg->lambdas[li];
                memcpy(best, map, (size_t)(rows * T->w) * sizeof(double));
              }
            }
            if (!isfinite(best_sse)) {
              rc = kvl_errf(err, errlen, KVL_EINVAL, "%s layer %d: no lambda gave a solvable system", vname, l);
              break;
            }
            for (int64_t i = 0; i < rows * T->w; i++) mapf[i] = (float)best[i];
            if ((rc = kvl_translator_set_map(tr, l, kv, src, nu, mapf)) < 0) {
              kvl_errf(err, errlen, rc, "%s layer %d: map rejected", vname, l);
              break;
            }
            double lr2 = sst > 0 ? 1 - best_sse / sst : 0;
            sum_r2[kv] += lr2;
            json_object_set_new(lj, kv ? "v_sources" : "k_sources", ints_json(src, nu));
            json_object_set_new(lj, kv ? "v_lambda" : "k_lambda", json_real(best_lambda));
            json_object_set_new(lj, kv ? "v_r2" : "k_r2", json_real(round(lr2 * 1e5) / 1e5));
          }
          json_array_append_new(layers, lj);
          kvl_cli_progress(vname + strlen(dname) + 1, l + 1, Lt, t0);
        }
        if (rc == 0) {
          json_object_set_new(v, "name", json_string(vname));
          json_object_set_new(v, "nu", json_integer(nu));
          json_object_set_new(v, "assign", json_string(kvl_fit_assign_name(as)));
          json_object_set_new(v, "affine", json_boolean(affine));
          json_object_set_new(v, "val_r2_k", json_real(round(sum_r2[0] / Lt * 1e5) / 1e5));
          json_object_set_new(v, "val_r2_v", json_real(round(sum_r2[1] / Lt * 1e5) / 1e5));
          json_object_set_new(v, "layers", layers);
          json_array_append_new(variants, v);
          char fitj[2048 + sizeof(cfg->provenance)];
          snprintf(fitj, sizeof(fitj),
                   "{\"method\":\"ridge\",\"stage\":1,\"nu\":%d,\"assign\":\"%s\",\"val_r2_k\":%.5f,"
                   "\"val_r2_v\":%.5f,%s}",
                   nu, kvl_fit_assign_name(as), sum_r2[0] / Lt, sum_r2[1] / Lt, cfg->provenance);
          kvl_translator_set_fit_json(tr, fitj);
          char path[4096];
          snprintf(path, sizeof(path), "%s/%s.safetensors", cfg->out, vname);
          rc = kvl_translator_save(tr, path, cfg->dtype, err, errlen);
          fprintf(stderr, "fit: %s  val R² K %.4f V %.4f -> %s\n", vname, sum_r2[0] / Lt, sum_r2[1] / Lt, path);
        } else {
          json_decref(v);
          json_decref(layers);
        }
        kvl_translator_free(tr);
      }
    }
  }
  free(map);
  free(best);
  free(mapf);
  free(greedy[0]);
  free(greedy[1]);
  free(r2[0]);
  free(r2[1]);
  return rc;
}

int kvl_cli_fit(int argc, char **argv) {
  enum { O_CORPUS = 1000, O_TOKENS, O_VAL, O_CTX, O_CHAT, O_SINK, O_NU, O_ASSIGN, O_KIND, O_LAMBDAS, O_WORK, O_DTYPE };
  static const struct option opts[] = {
    {"model-a", required_argument, 0, 'a'}, {"model-b", required_argument, 0, 'b'},
    {"corpus", required_argument, 0, O_CORPUS}, {"tokens", required_argument, 0, O_TOKENS},
    {"val-tokens", required_argument, 0, O_VAL}, {"ctx", required_argument, 0, O_CTX},
    {"chat-every", required_argument, 0, O_CHAT}, {"sink-weight", required_argument, 0, O_SINK},
    {"nu", required_argument, 0, O_NU}, {"assign", required_argument, 0, O_ASSIGN},
    {"kind", required_argument, 0, O_KIND}, {"lambdas", required_argument, 0, O_LAMBDAS},
    {"work", required_argument, 0, O_WORK}, {"out", required_argument, 0, 'o'},
    {"dtype", required_argument, 0, O_DTYPE}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  struct kvl_cli_model A = {0}, B = {0};
  const char *arg_a = NULL, *arg_b = NULL;
  const char *corpus = "translator/corpus/split.tsv", *work = NULL;
  int64_t tokens = 32768, val_tokens = 8192;
  int ctx = 512, chat_every = 4;
  double sink = 1.0;
  struct fit_cfg cfg = {.nus = {1, 2, 4}, .n_nu = 3, .assign = {true, true, true}, .kind = {true, true},
                        .lambdas = {1e-5, 1e-4, 1e-3, 1e-2, 1e-1}, .n_lambda = 5, .dtype = KVL_TRANSLATOR_BF16};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "a:b:o:h", opts, NULL)) != -1) {
    switch (c) {
    case 'a': arg_a = optarg; break;
    case 'b': arg_b = optarg; break;
    case 'o': cfg.out = optarg; break;
    case O_CORPUS: corpus = optarg; break;
    case O_TOKENS: tokens = atoll(optarg); break;
    case O_VAL: val_tokens = atoll(optarg); break;
    case O_CTX: ctx = atoi(optarg); break;
    case O_CHAT: chat_every = atoi(optarg); break;
    case O_SINK: sink = atof(optarg); break;
    case O_NU: cfg.n_nu = parse_ints(optarg, cfg.nus, 8); break;
    case O_ASSIGN:
      for (int i = 0; i < 3; i++) cfg.assign[i] = strstr(optarg, kvl_fit_assign_name(i)) != NULL;
      break;
    case O_KIND:
      cfg.kind[0] = strstr(optarg, "linear") != NULL;
      cfg.kind[1] = strstr(optarg, "affine") != NULL;
      break;
    case O_LAMBDAS: {
      cfg.n_lambda = 0;
      char *dup = strdup(optarg), *save, *t;
      for (t = strtok_r(dup, ",", &save); t && cfg.n_lambda < 16; t = strtok_r(NULL, ",", &save))
        cfg.lambdas[cfg.n_lambda++] = atof(t);
      free(dup);
      break;
    }
    case O_WORK: work = optarg; break;
    case O_DTYPE: cfg.dtype = !strcmp(optarg, "f32") ? KVL_TRANSLATOR_F32 : KVL_TRANSLATOR_BF16; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (!arg_a || !arg_b || ctx < 16 || tokens < ctx || val_tokens < 1 || cfg.n_nu < 1 || cfg.n_lambda < 1 ||
      sink <= 0) {
    usage(stderr);
    return 2;
  }
  for (int i = 0; i < cfg.n_nu; i++)
    if (cfg.nus[i] < 1 || cfg.nus[i] > 64) {
      fprintf(stderr, "kvlingo fit: nu %d out of range 1..64\n", cfg.nus[i]);
      return 2;
    }
  char defwork[4096];
  if (!work) {
    snprintf(defwork, sizeof(defwork), "%s/.cache/kvlingo/fit", getenv("HOME") ? getenv("HOME") : ".");
    work = defwork;
  }
  if (!cfg.out) cfg.out = work;
  if (mkdirs(work) < 0 || mkdirs(cfg.out) < 0) {
    fprintf(stderr, "kvlingo fit: cannot create %s or %s: %s\n", work, cfg.out, strerror(errno));
    return 1;
  }
  char err[512];
  int rc = kvl_cli_model_open(&A, arg_a, err, sizeof(err));
  if (rc == 0) rc = kvl_cli_model_open(&B, arg_b, err, sizeof(err));
  if (rc < 0) {
    fprintf(stderr, "kvlingo fit: %s\n", err);
    kvl_cli_model_close(&A);
    kvl_cli_model_close(&B);
    return 1;
  }
  if (strcmp(A.fp.tokenizer_hash, B.fp.tokenizer_hash) != 0) {
    fprintf(stderr, "kvlingo fit: %s and %s have different tokenizers (%s, %s); only same-tokenizer pairs are "
                    "supported so far\n", A.short_name, B.short_name, A.fp.tokenizer_hash, B.fp.tokenizer_hash);
    kvl_cli_model_close(&A);
    kvl_cli_model_close(&B);
    return 1;
  }
  for (int i = 0; i < cfg.n_nu; i++)
    if (cfg.nus[i] > A.L || cfg.nus[i] > B.L) {
      fprintf(stderr, "kvlingo fit: nu %d exceeds a model's %d layers\n", cfg.nus[i], A.L < B.L ? A.L : B.L);
      kvl_cli_model_close(&A);
      kvl_cli_model_close(&B);
      return 2;
    }
  char tag[1024];
  snprintf(tag, sizeof(tag), "corpus=%016llx ctx=%d chat=%d sink=%g tokens=%lld/%lld",
           (unsigned long long)fnv_file(corpus), ctx, chat_every, sink, (long long)tokens, (long long)val_tokens);
  snprintf(cfg.provenance, sizeof(cfg.provenance),
           "\"corpus\":\"%s\",\"options\":\"%s\",\"fit_tokens\":%lld,\"val_tokens\":%lld", corpus, tag,
           (long long)tokens, (long long)val_tokens);
  struct kvl_corpus_opts co = {.split_tsv = corpus, .split = "fit", .ctx = ctx, .min_tokens = 64,
                               .max_per_file = 1, .max_tokens = tokens, .chat_every = chat_every,
                               .chat_model = A.m};
  kvl_fit_stats_t *fit = NULL, *val = NULL;
  rc = capture_split(&A, &B, &co, work, "fit", tag, sink, &fit, err, sizeof(err));
  if (rc == 0) {
    co.split = "val";
    co.max_tokens = val_tokens;
    rc = capture_split(&A, &B, &co, work, "val", tag, sink, &val, err, sizeof(err));
  }
  json_t *report = json_object();
  if (rc == 0) {
    json_object_set_new(report, "options", json_string(tag));
    json_object_set_new(report, "fit_tokens", json_integer(kvl_fit_stats_tokens(fit)));
    json_object_set_new(report, "val_tokens", json_integer(kvl_fit_stats_tokens(val)));
    json_object_set_new(report, "model_a", json_string(A.short_name));
    json_object_set_new(report, "model_b", json_string(B.short_name));
    for (int kv = 0; kv < 2; kv++) {
      double *cka = malloc((size_t)A.L * B.L * sizeof(double));
      kvl_fit_cka(val, kv, cka);
      json_object_set_new(report, kv ? "cka_v" : "cka_k", matrix_json(cka, A.L, B.L));
      free(cka);
    }
    rc = solve_direction(fit, val, KVL_FIT_A_TO_B, &A, &B, &cfg, report, err, sizeof(err));
    if (rc == 0) rc = solve_direction(fit, val, KVL_FIT_B_TO_A, &B, &A, &cfg, report, err, sizeof(err));
  }
  if (rc == 0) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/fit-report.json", cfg.out);
    if (json_dump_file(report, path, JSON_INDENT(1) | JSON_COMPACT) < 0) {
      fprintf(stderr, "kvlingo fit: cannot write %s\n", path);
      rc = KVL_EIO;
    } else
      fprintf(stderr, "fit: report %s\n", path);
  } else
    fprintf(stderr, "kvlingo fit: %s\n", err);
  json_decref(report);
  kvl_fit_stats_free(fit);
  kvl_fit_stats_free(val);
  kvl_cli_model_close(&A);
  kvl_cli_model_close(&B);
  return rc < 0 ? 1 : 0;
}
