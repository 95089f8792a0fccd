/* cmd_distill.c — `kvlingo distill`: stage-2 self-distillation of a translator through the
 * frozen target (DESIGN.md "Fitting translators"; translator/include/kvl_distill.h). */
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "kvl_distill.h"
#include "kvl_error.h"
#include "kvl_fit.h"
#include "kvl_train.h"

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvlingo distill -s SOURCE -t TARGET --init TRANSLATOR -o OUT [options]\n"
    "\n"
    "Train a translator SOURCE->TARGET by self-distillation through the frozen TARGET: each\n"
    "sample's prefix is translated with the current maps, the target runs the continuation\n"
    "on that cache, and the KL to the target's own predictions (from its native cache) is\n"
    "back-propagated into the maps (AdamW). Starts from a closed-form translator (--init);\n"
    "resumable (--checkpoint, written every --save-every seconds and on SIGINT/SIGTERM).\n"
    "\n"
    "  -s, --source MODEL     the source model (.gguf or a name in $KVLINGO_MODELS)\n"
    "  -t, --target MODEL     the target model (trained through; frozen)\n"
    "      --init FILE        the translator to start from (stage 1)\n"
    "  -o, --out FILE         the distilled translator (safetensors)\n"
    "      --corpus FILE      corpus split (default translator/corpus/split.tsv)\n"
    "      --samples N        training samples from the fit split (default 256)\n"
    "      --eval-samples N   held-out samples per domain (code, prose) for the KL curve\n"
    "                         (default 12, validation split)\n"
    "      --sample-dir DIR   the sample store: prepared samples are kept there and reused by\n"
    "                         every run with the same options (default ~/.cache/kvlingo/distill)\n"
    "      --prefix N         prefix tokens per sample (default 256)\n"
    "      --cont N           continuation tokens scored (default 32)\n"
    "      --topk K           target log-probs kept per position (default 64)\n"
    "      --steps N          optimizer steps (default 200)\n"
    "      --batch N          samples per step (default 8)\n"
    "      --lr X             peak learning rate (default 1e-4: tuned on the Qwen2.5-Coder pair)\n"
    "      --warmup F         warm-up fraction of the steps (default 0.05), then cosine decay\n"
    "      --clip X           gradient-norm clip (default 1.0)\n"
    "      --eval-every N     steps between held-out KL evaluations (default 25)\n"
    "      --seed N           sample order (default 1)\n"
    "      --checkpoint FILE  resume from / save to (default OUT.ckpt)\n"
    "      --save-every S     seconds between checkpoints (default 300); samples being\n"
    "                         prepared are stored as often, and on SIGINT/SIGTERM\n"
    "      --prepare-only     prepare the sample store (training and held-out) and exit;\n"
    "                         needs only -s and -t\n"
    "      --log FILE         the training curve as JSON lines (default OUT.log.jsonl)\n"
    "  -h, --help             this text\n"
    "\n"
    "example: kvlingo distill -s qwen2.5-coder-1.5b -t qwen2.5-coder-0.5b \\\n"
    "           --init translator/maps/qwen2.5-coder-1.5b-to-qwen2.5-coder-0.5b.safetensors \\\n"
    "           -o /tmp/1.5b-to-0.5b.distilled.safetensors --steps 400\n");
}

static volatile sig_atomic_t g_stop;
static void on_signal(int s) {
  (void)s;
  g_stop = 1;
}

/* A store entry's key (checked on load) and file name, for n samples. */
static void store_name(const struct kvl_cli_model *src, const struct kvl_cli_model *dst, const char *corpus,
                       const char *split, const char *domain, const char *store_dir, int32_t n, int32_t prefix,
                       int32_t cont, int32_t topk, char *key, size_t keylen, char *path, size_t pathlen) {
  struct stat st;
  snprintf(key, keylen, "src=%s:%s dst=%s:%s corpus=%s:%lld split=%s domain=%s n=%d prefix=%d cont=%d topk=%d",
           src->short_name, src->fp.tokenizer_hash, dst->short_name, dst->fp.tokenizer_hash, corpus,
           stat(corpus, &st) == 0 ? (long long)st.st_size : -1LL, split, domain ? domain : "all", n, prefix, cont, topk);
  snprintf(path, pathlen, "%s/%s-to-%s.%s%s%s.n%d-p%d-c%d-k%d.samples", store_dir, src->short_name, dst->short_name,
           split, domain ? "-" : "", domain ? domain : "", n, prefix, cont, topk);
}

/* The name of a set stored by a preparation that has not finished: PATH.partial. */
static void partial_name(const struct kvl_cli_model *src, const struct kvl_cli_model *dst, const char *corpus,
                         const char *split, const char *domain, const char *store_dir, int32_t n, int32_t prefix,
                         int32_t cont, int32_t topk, char *key, size_t keylen, char *path, size_t pathlen) {
  store_name(src, dst, corpus, split, domain, store_dir, n, prefix, cont, topk, key, keylen, path, pathlen);
  strncat(path, ".partial", pathlen - strlen(path) - 1);
}

/* The largest stored set of the same options with fewer than `want` samples: the corpus
 * hands out its windows in a fixed order, so those are the first samples of `want`. A set
 * stored by an interrupted preparation (PATH.partial, of up to `want`) counts too; its name
 * goes to `partial` (else "") so that the run completing it removes it. */
static int load_smaller(const struct kvl_cli_model *src, const struct kvl_cli_model *dst, const char *corpus,
                        const char *split, const char *domain, const char *store_dir, int32_t want, int32_t prefix,
                        int32_t cont, int32_t topk, struct kvl_distill_sample **out, int32_t *n_out, char *partial,
                        size_t partial_len) {
  char key[1024], path[4400], err[512];
  partial[0] = 0;
  /* (want, partial), (want - 1, complete), (want - 1, partial), ...: stat is cheap, n a few hundred */
  for (int32_t n = want, part = 1; n >= 1; n -= part, part = !part) {
    if (part) partial_name(src, dst, corpus, split, domain, store_dir, n, prefix, cont, topk, key, sizeof(key), path, sizeof(path));
    else store_name(src, dst, corpus, split, domain, store_dir, n, prefix, cont, topk, key, sizeof(key), path, sizeof(path));
    if (access(path, R_OK) != 0) continue;
    if (kvl_distill_samples_load(path, key, out, n_out, err, sizeof(err)) == 0 && *n_out == n) {
      fprintf(stderr, "%d samples from %s; preparing the other %d\n", n, path, want - n);
      if (part) snprintf(partial, partial_len, "%s", path);
      return 0;
    }
    if (*out) {
      for (int32_t i = 0; i < *n_out; i++) kvl_distill_sample_free(&(*out)[i]);
      free(*out);
      *out = NULL;
    }
  }
  *n_out = 0;
  return KVL_ENOENT;
}

/* Samples of one split (and domain) from the sample store, or prepared and stored there
 * (only those beyond a smaller stored set of the same options). */
static int prepare(struct kvl_cli_model *src, struct kvl_cli_model *dst, const char *corpus, const char *split,
                   const char *domain, const char *store_dir, int32_t want, int32_t prefix, int32_t cont, int32_t topk,
                   double save_every, struct kvl_distill_sample **out, int32_t *n_out, char *err, size_t errlen) {
  char key[1024], path[4400], what[32];
  store_name(src, dst, corpus, split, domain, store_dir, want, prefix, cont, topk, key, sizeof(key), path, sizeof(path));
  snprintf(what, sizeof(what), "%s%s%s", split, domain ? " " : "", domain ? domain : "");
  int rc = kvl_distill_samples_load(path, key, out, n_out, err, errlen);
  if (rc == 0) {
    fprintf(stderr, "%s: %d samples from %s\n", what, *n_out, path);
    return 0;
  }
  if (rc != KVL_ENOENT) fprintf(stderr, "%s; preparing them again\n", err);
  struct kvl_distill_sample *have = NULL;
  int32_t n_have = 0;
  /* the partial store the prepared samples supersede, removed once a larger set is stored:
   * the one this run grew from, then the last one it wrote */
  char superseded[4400] = "";
  if (rc == KVL_ENOENT)
    load_smaller(src, dst, corpus, split, domain, store_dir, want, prefix, cont, topk, &have, &n_have, superseded,
                 sizeof(superseded));
  struct kvl_corpus_opts co = {.split_tsv = corpus, .split = split, .domain = domain, .ctx = prefix + cont,
                               .min_tokens = prefix + cont, .max_per_file = 4,
                               .max_tokens = (int64_t)(prefix + cont) * want, .chat_every = 4, .chat_model = dst->m};
  struct kvl_sample *smp;
  int32_t n_smp;
  rc = kvl_corpus_samples(&co, dst->tk, &smp, &n_smp, err, errlen);
  if (rc < 0) {
    for (int32_t i = 0; i < n_have; i++) kvl_distill_sample_free(&have[i]);
    free(have);
    return rc;
  }
  const int32_t n = n_smp < want ? n_smp : want;
  *out = calloc((size_t)(n > 0 ? n : 1), sizeof(**out));
  /* the stored ones, where their scored tokens are this corpus's windows (else all again) */
  int32_t reuse = n_have < n ? n_have : n;
  for (int32_t i = 0; i < reuse; i++)
    if (smp[i].n < prefix + cont || have[i].m != cont ||
        memcmp(have[i].tokens, smp[i].ids + prefix - 1, (size_t)cont * sizeof(int32_t))) {
      fprintf(stderr, "%s: stored sample %d is not the corpus's window %d; preparing all %d\n", what, i, i, n);
      reuse = 0;
    }
  for (int32_t i = 0; i < n_have; i++) {
    if (i < reuse) (*out)[i] = have[i];
    else kvl_distill_sample_free(&have[i]);
  }
  free(have);
  double t0 = kvl_cli_now(), t_saved = t0;
  int32_t done = reuse, kept = reuse; /* prepared so far; of those, stored */
  mkdir(store_dir, 0755);             /* one level: the default's parent is the model cache's */
  for (int32_t i = reuse; i < n && rc == 0 && !g_stop; i++) {
    if (smp[i].n < prefix + cont) { /* the corpus guarantees min_tokens; never read past a sample */
      rc = kvl_errf(err, errlen, KVL_EFORMAT, "corpus sample %d of %s has %d tokens, %d needed", i, what, smp[i].n,
                    prefix + cont);
      break;
    }
    rc = kvl_distill_prepare(src->m, dst->m, smp[i].ids, prefix, cont, topk, &(*out)[i], err, errlen);
    if (rc == 0) done = i + 1;
    kvl_cli_progress(what, i + 1 - reuse, n - reuse, t0);
    /* the prepared ones are kept every save_every seconds and on a signal, as the partial
     * store of the first `done` windows, which the next run finds (load_smaller) */
    if (rc == 0 && done < n && (g_stop || kvl_cli_now() - t_saved > save_every)) {
      char k2[1024], p2[4400], e2[512];
      partial_name(src, dst, corpus, split, domain, store_dir, done, prefix, cont, topk, k2, sizeof(k2), p2, sizeof(p2));
      if (kvl_distill_samples_save(p2, k2, *out, done, e2, sizeof(e2)) < 0) {
        fprintf(stderr, "\nkvlingo distill: %s (not stored)\n", e2);
      } else {
        if (superseded[0]) remove(superseded);
        snprintf(superseded, sizeof(superseded), "%s", p2);
        kept = done;
      }
      t_saved = kvl_cli_now();
    }
  }
  kvl_samples_free(smp, n_smp);
  if (rc == 0 && done < n) { /* stopped by a signal: the prepared ones are stored (above) */
    for (int32_t i = 0; i < done; i++) kvl_distill_sample_free(&(*out)[i]);
    free(*out);
    *out = NULL;
    *n_out = 0;
    fprintf(stderr, "\n%s: stopped; %d of %d samples stored; the same command continues\n", what, kept, n);
    return kvl_errf(err, errlen, KVL_ECANCELED, "stopped while preparing the %s samples", what);
  }
  *n_out = n;
  if (rc == 0) {
    if (kvl_distill_samples_save(path, key, *out, n, err, errlen) < 0) {
      fprintf(stderr, "kvlingo distill: %s (not stored)\n", err);
    } else {
      fprintf(stderr, "%s: stored in %s\n", what, path);
      if (superseded[0]) remove(superseded); /* the complete set holds it */
    }
  }
  return rc;
}

static const char *const k_domains[2] = {"code", "prose"};

/* Samples per pass through the target (kvl_distill_accumulate_batch): a step of --batch
 * samples takes ceil(batch / MICRO) passes. 8 x 32 rows keep the 1.5B's activations for the
 * backward near 1.3 GiB. */
enum { MICRO = 8 };

/* The mean KL over n samples, MICRO at a time (kvl_distill_eval_batch). */
static double mean_kl(kvl_distill_t *d, struct kvl_distill_sample *s, int32_t n) {
  double sum = 0, kl[MICRO];
  const struct kvl_distill_sample *b[MICRO];
  for (int32_t i = 0; i < n; i += MICRO) {
    const int32_t k = n - i < MICRO ? n - i : MICRO;
    for (int32_t j = 0; j < k; j++) b[j] = &s[i + j];
    if (kvl_distill_eval_batch(d, b, k, kl) == 0)
      for (int32_t j = 0; j < k; j++) sum += kl[j];
  }
  return n ? sum / n : 0;
}

struct run_info {
  const char *init_path;
  int32_t batch, n_tr, prefix, cont, topk, steps;
  double lr, warmup;
  unsigned seed;
};

/* The current maps as a translator at `path`: the pair's fingerprints, provenance. */
static int write_translator(kvl_distill_t *d, const kvl_translator_t *init, struct kvl_cli_model *src,
                            struct kvl_cli_model *dst, const struct run_info *ri, double heldout, const char *path,
                            char *err, size_t errlen) {
  kvl_translator_t *out = NULL;
  int rc = kvl_translator_new(&src->fp, &dst->fp, kvl_translator_affine(init), &out, err, errlen);
  if (rc == 0 && (rc = kvl_distill_export(d, out)) == 0) {
    json_t *fit = json_pack("{s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:i,s:i,s:f}", "stage", "distill", "init",
                            ri->init_path, "steps", (int)kvl_distill_steps(d), "steps_planned", ri->steps, "batch",
                            ri->batch, "samples", ri->n_tr, "prefix", ri->prefix, "cont", ri->cont, "lr", ri->lr,
                            "warmup", ri->warmup, "topk", ri->topk, "seed", (int)ri->seed, "val_kl", heldout);
    char *js = json_dumps(fit, JSON_COMPACT);
    kvl_translator_set_fit_json(out, js);
    free(js);
    json_decref(fit);
    rc = kvl_translator_save(out, path, kvl_translator_dtype(init), err, errlen);
  }
  kvl_translator_free(out);
  return rc;
}

int kvl_cli_distill(int argc, char **argv) {
  const char *src_arg = NULL, *dst_arg = NULL, *init_path = NULL, *out_path = NULL, *ckpt = NULL, *log_path = NULL;
  const char *corpus = "translator/corpus/split.tsv"; /* relative to the checkout, like fit and eval */
  const char *sample_dir = NULL;
  int32_t n_train = 256, n_eval = 12, prefix = 256, cont = 32, topk = 64, steps = 200, batch = 8, eval_every = 25;
  double lr = 1e-4, warmup = 0.05, clip = 1.0, save_every = 300;
  unsigned seed = 1;
  int prepare_only = 0;
  enum { O_INIT = 1000, O_CORPUS, O_SAMPLES, O_EVAL_SAMPLES, O_PREFIX, O_CONT, O_TOPK, O_STEPS, O_BATCH, O_LR,
         O_WARMUP, O_CLIP, O_EVAL_EVERY, O_SEED, O_CKPT, O_SAVE_EVERY, O_LOG, O_SAMPLE_DIR, O_PREPARE_ONLY };
  static const struct option opts[] = {
    {"source", required_argument, 0, 's'}, {"target", required_argument, 0, 't'}, {"init", required_argument, 0, O_INIT},
    {"out", required_argument, 0, 'o'}, {"corpus", required_argument, 0, O_CORPUS},
    {"samples", required_argument, 0, O_SAMPLES}, {"eval-samples", required_argument, 0, O_EVAL_SAMPLES},
    {"prefix", required_argument, 0, O_PREFIX}, {"cont", required_argument, 0, O_CONT},
    {"topk", required_argument, 0, O_TOPK}, {"steps", required_argument, 0, O_STEPS},
    {"batch", required_argument, 0, O_BATCH}, {"lr", required_argument, 0, O_LR},
    {"warmup", required_argument, 0, O_WARMUP}, {"clip", required_argument, 0, O_CLIP},
    {"eval-every", required_argument, 0, O_EVAL_EVERY}, {"seed", required_argument, 0, O_SEED},
    {"checkpoint", required_argument, 0, O_CKPT}, {"save-every", required_argument, 0, O_SAVE_EVERY},
    {"log", required_argument, 0, O_LOG}, {"sample-dir", required_argument, 0, O_SAMPLE_DIR},
    {"prepare-only", no_argument, 0, O_PREPARE_ONLY}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "s:t:o:h", opts, NULL)) != -1) {
    switch (c) {
    case 's': src_arg = optarg; break;
    case 't': dst_arg = optarg; break;
    case 'o': out_path = optarg; break;
    case O_INIT: init_path = optarg; break;
    case O_CORPUS: corpus = optarg; break;
    case O_SAMPLES: n_train = atoi(optarg); break;
    case O_EVAL_SAMPLES: n_eval = atoi(optarg); break;
    case O_PREFIX: prefix = atoi(optarg); break;
    case O_CONT: cont = atoi(optarg); break;
    case O_TOPK: topk = atoi(optarg); break;
    case O_STEPS: steps = atoi(optarg); break;
    case O_BATCH: batch = atoi(optarg); break;
    case O_LR: lr = atof(optarg); break;
    case O_WARMUP: warmup = atof(optarg); break;
    case O_CLIP: clip = atof(optarg); break;
    case O_EVAL_EVERY: eval_every = atoi(optarg); break;
    case O_SEED: seed = (unsigned)strtoul(optarg, NULL, 10); break;
    case O_CKPT: ckpt = optarg; break;
    case O_SAVE_EVERY: save_every = atof(optarg); break;
    case O_LOG: log_path = optarg; break;
    case O_SAMPLE_DIR: sample_dir = optarg; break;
    case O_PREPARE_ONLY: prepare_only = 1; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (!src_arg || !dst_arg || (!prepare_only && (!init_path || !out_path))) {
    usage(stderr);
    return 2;
  }
  if (n_train < 1 || prefix < 2 || cont < 1 || topk < 1 || steps < 1 || batch < 1 || !(lr > 0) || warmup < 0 || warmup >= 1) {
    fprintf(stderr, "kvlingo distill: samples, prefix >= 2, cont, topk, steps, batch must be positive; lr > 0; warmup in [0, 1)\n");
    return 2;
  }
  char ckpt_buf[4200], log_buf[4200];
  if (!ckpt && out_path) { snprintf(ckpt_buf, sizeof(ckpt_buf), "%s.ckpt", out_path); ckpt = ckpt_buf; }
  if (!log_path && out_path) { snprintf(log_buf, sizeof(log_buf), "%s.log.jsonl", out_path); log_path = log_buf; }
  char err[1024], dir_buf[4200];
  if (!sample_dir) {
    snprintf(dir_buf, sizeof(dir_buf), "%s/.cache/kvlingo/distill", getenv("HOME") ? getenv("HOME") : ".");
    sample_dir = dir_buf;
  }
  struct kvl_cli_model src = {0}, dst = {0};
  kvl_translator_t *init = NULL;
  kvl_dense_t *dense = NULL;
  kvl_distill_t *d = NULL;
  struct kvl_distill_sample *tr = NULL, *ev[2] = {NULL, NULL};
  int32_t n_tr = 0, n_ev[2] = {0, 0};
  int rc = kvl_cli_model_open(&src, src_arg, err, sizeof(err));
  if (rc == 0) rc = kvl_cli_model_open(&dst, dst_arg, err, sizeof(err));
  if (rc == 0 && !prepare_only) rc = kvl_translator_load(init_path, &init, err, sizeof(err));
  if (rc == 0 && !prepare_only) rc = kvl_translator_check_models(init, &src.fp, &dst.fp, err, sizeof(err));
  double t0 = kvl_cli_now();
  if (rc == 0 && !prepare_only) {
    fprintf(stderr, "dense fp32 copy of %s ...\n", dst.short_name);
    rc = kvl_dense_new(dst.m, &dense, err, sizeof(err));
  }
  if (rc == 0 && !prepare_only)
    rc = kvl_distill_new(init, dense, &(struct kvl_distill_opts){.clip = (float)clip}, &d, err, sizeof(err));
  signal(SIGINT, on_signal); /* from here a signal stops preparation or training, keeping what is done */
  signal(SIGTERM, on_signal);
  if (rc == 0)
    rc = prepare(&src, &dst, corpus, "fit", NULL, sample_dir, n_train, prefix, cont, topk, save_every, &tr, &n_tr, err, sizeof(err));
  for (int j = 0; j < 2 && rc == 0; j++)
    rc = prepare(&src, &dst, corpus, "val", k_domains[j], sample_dir, n_eval, prefix, cont, topk, save_every, &ev[j], &n_ev[j], err,
                 sizeof(err));
  if (rc < 0) {
    fprintf(stderr, "kvlingo distill: %s\n", err);
    goto done;
  }
  if (prepare_only) {
    fprintf(stderr, "%s -> %s: %d training samples, %d held-out (prefix %d, %d scored) in %s; prepared in %.0f s\n",
            src.short_name, dst.short_name, n_tr, n_ev[0] + n_ev[1], prefix, cont, sample_dir, kvl_cli_now() - t0);
    goto done;
  }
  fprintf(stderr, "%s -> %s: %lld parameters; %d training samples, %d held-out (prefix %d, %d scored); dense copy %.1f GiB; "
                  "samples %.1f MiB; prepared in %.0f s\n",
          src.short_name, dst.short_name, (long long)kvl_distill_params(d), n_tr, n_ev[0] + n_ev[1], prefix, cont,
          kvl_dense_bytes(dense) / 1073741824.0, n_tr ? (double)kvl_distill_sample_bytes(&tr[0]) * n_tr / 1048576.0 : 0,
          kvl_cli_now() - t0);
  if (access(ckpt, R_OK) == 0) {
    if ((rc = kvl_distill_load(d, ckpt, err, sizeof(err))) < 0) {
      fprintf(stderr, "kvlingo distill: %s (remove it to start over)\n", err);
      goto done;
    }
    fprintf(stderr, "resumed from %s at step %lld\n", ckpt, (long long)kvl_distill_steps(d));
  }
  FILE *lg = fopen(log_path, kvl_distill_steps(d) > 0 ? "a" : "w");
  if (!lg) {
    fprintf(stderr, "kvlingo distill: cannot write %s\n", log_path);
    rc = KVL_EIO;
    goto done;
  }
  struct run_info ri = {init_path, batch, n_tr, prefix, cont, topk, steps, lr, warmup, seed};
  double hk_code = mean_kl(d, ev[0], n_ev[0]), hk_prose = mean_kl(d, ev[1], n_ev[1]), kl0 = (hk_code + hk_prose) / 2;
  if (kvl_distill_steps(d) == 0) {
    fprintf(lg, "{\"step\":0,\"heldout_kl\":%.6f,\"heldout_kl_code\":%.6f,\"heldout_kl_prose\":%.6f}\n", kl0, hk_code,
            hk_prose);
    fflush(lg);
  }
  fprintf(stderr, "held-out KL at step %lld: %.4f (code %.4f, prose %.4f)\n", (long long)kvl_distill_steps(d), kl0,
          hk_code, hk_prose);
  double t_before = 0; /* seconds the run took before this resumption (its log's last record) */
  double best = kl0;   /* the lowest held-out KL so far: OUT holds those maps */
  bool wrote = false;
  if (kvl_distill_steps(d) > 0) { /* percentages against the start of the run, from its log */
    FILE *lf = fopen(log_path, "r");
    char line[1024];
    for (int first = 1; lf && fgets(line, sizeof(line), lf); first = 0) {
      json_t *r = json_loads(line, 0, NULL);
      double k = json_number_value(json_object_get(r, "heldout_kl"));
      if (first && k > 0) kl0 = k;
      if (first) best = INFINITY; /* resumed: the best of the run so far, from its log */
      if (k > 0 && k < best) {
        best = k;
        wrote = json_integer_value(json_object_get(r, "step")) > 0; /* OUT was written for it */
      }
      if (json_integer_value(json_object_get(r, "step")) <= kvl_distill_steps(d) && json_object_get(r, "seconds"))
        t_before = json_number_value(json_object_get(r, "seconds"));
      json_decref(r);
    }
    if (lf) fclose(lf);
  }
  /* a fixed permutation per epoch from the seed: the same run for the same seed */
  int32_t *order = malloc((size_t)n_tr * sizeof(int32_t));
  const struct kvl_distill_sample **picked = malloc((size_t)batch * sizeof(*picked));
  double *kls = malloc((size_t)batch * sizeof(double));
  if (!order || !picked || !kls) {
    fprintf(stderr, "kvlingo distill: out of memory\n");
    free(order);
    free(picked);
    free(kls);
    fclose(lg);
    rc = KVL_ENOMEM;
    goto done;
  }
  for (int32_t i = 0; i < n_tr; i++) order[i] = i;
  unsigned long long rs = seed * 0x9E3779B97F4A7C15ull + 1;
  double t_start = kvl_cli_now(), t_saved = t_start;
  int64_t first = kvl_distill_steps(d);
  for (int64_t step = first; step < steps && !g_stop; step++) {
    int64_t pos = step * batch;
    double lr_t = step < warmup * steps ? lr * fmin(1.0, (step + 1) / (warmup * steps))
                                        : lr * 0.5 * (1 + cos(M_PI * (step - warmup * steps) / ((1 - warmup) * steps)));
    double kl_sum = 0, gn;
    for (int32_t b = 0; b < batch; b++, pos++) {
      int32_t epoch = (int32_t)(pos / n_tr), i = (int32_t)(pos % n_tr);
      if (i == 0) { /* reshuffle deterministically at each epoch start */
        rs = (seed + 1ull) * 0x9E3779B97F4A7C15ull + (unsigned long long)epoch;
        for (int32_t k = n_tr - 1; k > 0; k--) {
          rs = rs * 6364136223846793005ull + 1442695040888963407ull;
          int32_t j = (int32_t)((rs >> 33) % (unsigned long long)(k + 1)), t = order[k];
          order[k] = order[j];
          order[j] = t;
        }
      }
      picked[b] = &tr[order[i]];
    }
    /* the step's samples through the target MICRO at a time: one pass streams the weights
     * for all of them, and the activations kept for the backward stay bounded */
    rc = 0;
    for (int32_t b = 0; b < batch && rc >= 0; b += MICRO)
      rc = kvl_distill_accumulate_batch(d, picked + b, batch - b < MICRO ? batch - b : MICRO, 1.0f / (float)batch, kls + b);
    if (rc < 0) break;
    for (int32_t b = 0; b < batch; b++) kl_sum += kls[b];
    kvl_distill_update(d, (float)lr_t, &gn);
    fprintf(lg, "{\"step\":%lld,\"train_kl\":%.6f,\"grad_norm\":%.6f,\"lr\":%.3g,\"batch\":%d,\"seconds\":%.1f",
            (long long)(step + 1), kl_sum / batch, gn, lr_t, batch, t_before + kvl_cli_now() - t_start);
    if ((step + 1) % eval_every == 0 || step + 1 == steps) {
      hk_code = mean_kl(d, ev[0], n_ev[0]);
      hk_prose = mean_kl(d, ev[1], n_ev[1]);
      double hk = (hk_code + hk_prose) / 2;
      fprintf(lg, ",\"heldout_kl\":%.6f,\"heldout_kl_code\":%.6f,\"heldout_kl_prose\":%.6f", hk, hk_code, hk_prose);
      fprintf(stderr, "\rstep %lld: train KL %.4f, held-out KL %.4f (code %.4f, prose %.4f; %.0f%% of the start)%s     \n",
              (long long)(step + 1), kl_sum / batch, hk, hk_code, hk_prose, 100 * hk / kl0, hk < best ? ", best" : "");
      if (hk < best) { /* model selection on the validation split: OUT is the best maps seen */
        best = hk;
        if (write_translator(d, init, &src, &dst, &ri, hk, out_path, err, sizeof(err)) < 0)
          fprintf(stderr, "kvlingo distill: %s\n", err);
        else
          wrote = true;
      }
    }
    fprintf(lg, "}\n");
    fflush(lg);
    kvl_cli_progress("distill", step + 1 - first, steps - first, t_start);
    if (kvl_cli_now() - t_saved > save_every || g_stop) {
      if (kvl_distill_save(d, ckpt, err, sizeof(err)) < 0) fprintf(stderr, "kvlingo distill: %s\n", err);
      t_saved = kvl_cli_now();
    }
  }
  free(order);
  free(picked);
  free(kls);
  fclose(lg);
  if (rc < 0) {
    fprintf(stderr, "kvlingo distill: step failed (%s)\n", kvl_strerror(rc));
    goto done;
  }
  if ((rc = kvl_distill_save(d, ckpt, err, sizeof(err))) < 0) {
    fprintf(stderr, "kvlingo distill: %s\n", err);
    goto done;
  }
  if (g_stop && kvl_distill_steps(d) < steps) { /* a signal during the last step: the run is complete */
    fprintf(stderr, "stopped at step %lld; run the same command again to resume from %s\n", (long long)kvl_distill_steps(d), ckpt);
    goto done;
  }
  /* OUT already holds the best maps on the validation split; without any improvement
   * (or evaluations), the last ones */
  if (!wrote) {
    fprintf(stderr, "kvlingo distill: the held-out KL never went below the start's; writing the last maps\n");
    rc = write_translator(d, init, &src, &dst, &ri, best, out_path, err, sizeof(err));
  }
  if (rc < 0) fprintf(stderr, "kvlingo distill: %s\n", err);
  else fprintf(stderr, "%s: the maps with the lowest held-out KL (%.4f, %.0f%% of the start; %lld steps run)\n", out_path,
               best, 100 * best / kl0, (long long)kvl_distill_steps(d));
done:
  for (int32_t i = 0; i < n_tr; i++) kvl_distill_sample_free(&tr[i]);
  for (int j = 0; j < 2; j++) {
    for (int32_t i = 0; i < n_ev[j]; i++) kvl_distill_sample_free(&ev[j][i]);
    free(ev[j]);
  }
  free(tr);
  kvl_distill_free(d);
  kvl_dense_free(dense);
  kvl_translator_free(init);
  kvl_cli_model_close(&src);
  kvl_cli_model_close(&dst);
  return rc < 0 ? 1 : 0;
}
