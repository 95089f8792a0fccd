/* prefill_decode.c — bench-prefill-decode: prompt-processing and generation speed of the
 * engine's forward pass, one sequence, on the CPU backend.
 *
 *   pp<N>  prefill N tokens in one forward (logits for the last token only); tokens/s
 *          = N / time of that forward. With -d D (pp<N>@d<D>, llama-bench's "@ d"), D
 *          positions are in the cache first and the N tokens attend to them: a new
 *          turn's prefill after a history, what a model switch computes.
 *   tg<N>  after an untimed 16-token prompt, N single-token decode steps, each a forward
 *          with logits; tokens/s = N / time of the N steps. With --tg-depth D
 *          (tg<N>@d<D>) the prompt is D tokens: decode at the end of a long history, whose
 *          KV each step reads (on a device backend: from its copy of the pool, or staged
 *          per layer with KVL_CUDA_KV_KEEP=0). Each step asks for its row's summary
 *          (KVL_LOGITS_TOP: what the scheduler's greedy and top-k samplers take; on a
 *          device backend the row stays there), or, with --full-logits, for the row.
 *          With --bw, roofline_pct =
 *          weight bytes read per token x tokens/s / bandwidth: how close decode runs to
 *          the memory-bound limit (KV reads, small at these lengths, are not counted).
 *
 * pp rows carry roofline_pct too: the matmul operations of the transformer blocks per
 * token (2 x their weights; attention and the once-per-forward output head are not
 * counted) x tokens/s / the arithmetic peak of the data type the backend's prefill
 * matmuls run in (peak.h; int8 dot products on the int8 levels, bf16 on avx512bf16, fp32
 * otherwise), measured by this program before the models run (or given with --peak).
 *
 * Token ids are fixed pseudo-random ids in [1000, 20000) (no tokenizer): speed does not
 * depend on which tokens are fed. Each figure is the median of -r runs; pp runs after
 * one untimed warm-up forward (which also faults the mapped weights in). Writes
 * <out>/prefill-decode.json and .md (shared/BENCH-FORMAT.md). The engine is driven
 * exactly as clients/cli/cmd_run.c drives it.
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <omp.h>

#include "bench_backend.h"
#include "bench_common.h"
#include "peak.h"
#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_model.h"

#define TG_PROMPT 16       /* tokens of context before the decode steps of tg<N> */
#define MAX_MODELS 16
#define BW_MIB 1024        /* --bw auto: the read probe's buffer, far beyond any L3 here */
#define TOKEN_SEED 0x6b766c696e676fULL /* "kvlingo" */
#define TOKEN_LO 1000
#define TOKEN_HI 20000

/* The two default models (file in the models directory, short name). */
static const char *const default_models[][2] = {
  {"qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b"},
  {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b"},
};

struct bench_opts {
  const char *models[MAX_MODELS]; /* model file paths */
  int n_models;
  int pp[8];                      /* prefill lengths N of pp<N> */
  int n_pp;                       /* how many; 0 skips pp */
  int pp_max;
  int depth;                      /* positions already in the cache before pp<N> (-d) */
  int tg_depth;                   /* the prompt before tg<N> (--tg-depth; 0: TG_PROMPT) */
  int tg;                         /* decode steps N of tg<N>; 0 skips tg */
  bool full_logits;               /* --full-logits: each decode step's whole row to the host */
  int runs;                       /* timed runs per figure */
  enum kvl_kv_dtype kv;           /* KV cache storage */
  double bw_gbps;                 /* memory bandwidth for roofline_pct; 0 = not given */
  bool bw_auto;                   /* --bw auto: measured around each model's tg runs */
  double peak_gops;               /* arithmetic peak of the prefill's dtype; 0 = none */
  const struct kvl_bench_peak *peak; /* the probe it was measured with, if measured */
  const char *out;                /* results directory */
  bool cuda;                      /* --backend cuda */
};

/* The model's short name from its file name: directory, ".gguf", a quantisation suffix
 * ("-q4_k_m", "-f16", ...) and "-instruct" removed. Returns a malloc'd string. */
static char *short_name(const char *path) {
  const char *b = strrchr(path, '/');
  char *s = strdup(b ? b + 1 : path);
  if (!s) return NULL;
  size_t l = strlen(s);
  if (l > 5 && !strcasecmp(s + l - 5, ".gguf")) s[l -= 5] = '\0';
  char *d = strrchr(s, '-');
  if (d && ((tolower((unsigned char)d[1]) == 'q' && isdigit((unsigned char)d[2])) || !strcasecmp(d, "-f16") ||
            !strcasecmp(d, "-bf16") || !strcasecmp(d, "-f32")))
    *d = '\0';
  l = strlen(s);
  if (l > 9 && !strcasecmp(s + l - 9, "-instruct")) s[l - 9] = '\0';
  return s;
}

/* Bytes of weights one token's forward reads: every tensor in full, except the token
 * embedding when a separate output head exists (then only its one row is read). */
static uint64_t weight_bytes_per_token(const kvl_model_t *m) {
  const kvl_gguf_t *g = kvl_model_gguf(m);
  const bool tied = kvl_model_hparams(m)->tied_output;
  uint64_t sum = 0;
  for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
    const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
    uint64_t rows = t->ne[0] ? t->n_elements / t->ne[0] : 1;
    if (!tied && !strcmp(t->name, "token_embd.weight") && rows > 0) sum += t->nbytes / rows;
    else sum += t->nbytes;
  }
  return sum;
}

/* Operations of one token's pass through the transformer blocks' matmuls: 2 per weight
 * of every blk.* matrix. */
static double block_ops_per_token(const kvl_model_t *m) {
  const kvl_gguf_t *g = kvl_model_gguf(m);
  double sum = 0;
  for (int64_t i = 0; i < kvl_gguf_n_tensors(g); i++) {
    const struct kvl_gguf_tensor *t = kvl_gguf_tensor(g, i);
    if (!strncmp(t->name, "blk.", 4) && t->n_dims >= 2 && t->ne[1] > 1) sum += 2.0 * (double)t->n_elements;
  }
  return sum;
}

/* The peak probe for the data type a CPU backend's prefill matmuls run in (by its name:
 * cpu.c's levels), or NULL (the portable level, CUDA). */
static const struct kvl_bench_peak *prefill_peak(const char *backend) {
  if (strstr(backend, "cpu-amx-int8")) return kvl_bench_peak_find("s8", "amx");
  if (strstr(backend, "cpu-avx512-vnni-mm")) return kvl_bench_peak_find("s8", "avx512vnni");
  if (strstr(backend, "cpu-avx2-int8-mm")) return kvl_bench_peak_find("s8", "avx2");
  if (strstr(backend, "cpu-avx512-bf16")) {  /* oneDNN takes the AMX tiles where it can */
    const struct kvl_bench_peak *amx = kvl_bench_peak_find("bf16", "amx");
    return kvl_bench_peak_usable(amx) ? amx : kvl_bench_peak_find("bf16", "avx512bf16");
  }
  if (!strncmp(backend, "cpu-avx512", 10)) return kvl_bench_peak_find("f32", "avx512");
  if (!strncmp(backend, "cpu-avx2", 8)) return kvl_bench_peak_find("f32", "avx2");
  return NULL;
}

/* n fixed pseudo-random token ids in [TOKEN_LO, TOKEN_HI) (splitmix64, fixed seed),
 * folded into the vocabulary if it is smaller. */
static void fill_tokens(int32_t *ids, int n, int n_vocab) {
  uint64_t x = TOKEN_SEED;
  for (int i = 0; i < n; i++) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    int32_t id = TOKEN_LO + (int32_t)(z % (TOKEN_HI - TOKEN_LO));
    ids[i] = id < n_vocab ? id : id % n_vocab;
  }
}

/* Run pp and tg on one model and add their results to the report. Returns 0, or -1
 * after printing why. */
static int bench_model(const char *path, const char *name, const struct bench_opts *o, kvl_bench_report_t *rep) {
  char err[512];
  kvl_model_t *m = NULL;
  void *pool = NULL;
  size_t pool_mapped = 0;
  uint64_t *stamps = NULL;
  int32_t *table = NULL, *ids = NULL, *pos = NULL, *seq = NULL;
  int8_t *want = NULL;
  float *logits = NULL;
  double *s = NULL;
  int ret = -1, rc;

  double t0 = kvl_bench_now();
  if (kvl_model_open(path, &m, err, sizeof(err)) < 0) {
    fprintf(stderr, "bench-prefill-decode: %s: %s\n", path, err);
    return -1;
  }
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  kvl_backend_t *be = kvl_bench_backend("bench-prefill-decode", o->cuda);
  if (!be) goto out;
  const size_t repacked = kvl_model_prepare(m, be); /* as the daemon does at load */
  const int threads = omp_get_max_threads();
  const char *kvname = o->kv == KVL_KV_F32 ? "f32" : "bf16";
  fprintf(stderr, "bench-prefill-decode: %s (%s, %d layers) on %s, %d threads, kv %s, loaded in %.2f s", name, path,
          hp->n_layer, kvl_backend_name(be), threads, kvname, kvl_bench_now() - t0);
  fprintf(stderr, " (%.0f MiB repacked)\n", (double)repacked / (1 << 20));

  const int pp_end = o->n_pp > 0 ? o->depth + o->pp_max : 0;
  const int tg_prompt = o->tg_depth > 0 ? o->tg_depth : TG_PROMPT;
  const int n_ctx = pp_end > tg_prompt + o->tg ? pp_end : tg_prompt + o->tg;
  int n_batch = o->pp_max > tg_prompt ? o->pp_max : tg_prompt;
  if (o->depth > n_batch) n_batch = o->depth;
  if (n_ctx > hp->n_ctx_train) {
    fprintf(stderr, "bench-prefill-decode: %s: %d tokens exceed the model's context of %d\n", name, n_ctx,
            hp->n_ctx_train);
    goto out;
  }
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, o->kv);
  int nb = (n_ctx + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK;
  pool = kvl_huge_alloc((size_t)nb * kvl_kv_block_bytes(&kl), &pool_mapped); /* as the daemon's pools */
  table = malloc((size_t)nb * sizeof(*table));
  ids = malloc((size_t)n_ctx * sizeof(*ids));
  pos = malloc((size_t)n_batch * sizeof(*pos));
  seq = calloc((size_t)n_batch, sizeof(*seq));
  want = calloc((size_t)n_batch, sizeof(*want));
  logits = malloc((size_t)hp->n_vocab * sizeof(*logits));
  s = malloc((size_t)o->runs * sizeof(*s));
  stamps = malloc((size_t)nb * sizeof(*stamps));
  if (!pool || !table || !ids || !pos || !seq || !want || !logits || !s || !stamps) {
    fprintf(stderr, "bench-prefill-decode: out of memory\n");
    goto out;
  }
  for (int i = 0; i < nb; i++) table[i] = i, stamps[i] = kvl_kv_stamp_fresh();
  const int32_t *tables[] = {table};
  /* write stamps, as the scheduler's pools have: a device backend keeps the pool there;
   * fresh, as a scheduler pool's new blocks (every run writes its positions before it
   * reads them), so the device copies none of their old bytes in */
  struct kvl_kv_view kv = {&kl, pool, tables, stamps, nb};
  fill_tokens(ids, n_ctx, hp->n_vocab);
  struct kvl_bench_stats st;
  char test[32];

  /* The depth: an untimed forward writes positions 0..D-1 once; every pp<N> run then
   * attends to them (as a turn's prefill attends to the history before it). */
  if (o->n_pp > 0 && o->depth > 0) {
    for (int t = 0; t < o->depth; t++) { pos[t] = t; want[t] = t == o->depth - 1; }
    struct kvl_batch b = {o->depth, ids, pos, seq, want};
    if ((rc = kvl_model_forward(m, be, &b, &kv, logits, NULL)) < 0) {
      fprintf(stderr, "bench-prefill-decode: %s depth %d: forward: %s\n", name, o->depth, kvl_strerror(rc));
      goto out;
    }
  }

  /* pp<N>: one forward of N tokens at positions D..D+N-1 (overwriting them each run),
   * logits for the last. Run -1 is the warm-up. */
  for (int pi = 0; pi < o->n_pp; pi++) {
    const int pp = o->pp[pi];
    if (o->depth > 0) snprintf(test, sizeof(test), "pp%d@d%d", pp, o->depth);
    else snprintf(test, sizeof(test), "pp%d", pp);
    for (int t = 0; t < pp; t++) { pos[t] = o->depth + t; want[t] = t == pp - 1; }
    struct kvl_batch b = {pp, ids + o->depth, pos, seq, want};
    for (int r = -1; r < o->runs; r++) {
      double ts = kvl_bench_now();
      if ((rc = kvl_model_forward(m, be, &b, &kv, logits, NULL)) < 0) {
        fprintf(stderr, "bench-prefill-decode: %s %s: forward: %s\n", name, test, kvl_strerror(rc));
        goto out;
      }
      double dt = kvl_bench_now() - ts;
      if (r < 0) {
        fprintf(stderr, "  %s %s warm-up: %.1f tokens/s (%.3f s)\n", name, test, pp / dt, dt);
        continue;
      }
      s[r] = pp / dt;
      fprintf(stderr, "  %s %s run %d/%d: %.1f tokens/s (%.3f s)\n", name, test, r + 1, o->runs, s[r], dt);
    }
    kvl_bench_stats_compute(s, o->runs, &st);
    json_t *res = kvl_bench_report_add(rep, name, test, st.median, "tokens/s", o->runs, st.sd);
    json_object_set_new(res, "kv", json_string(kvname));
    json_object_set_new(res, "threads", json_integer(threads));
    json_object_set_new(res, "backend", json_string(kvl_backend_name(be)));
    kvl_bench_attn_field(res, be, !strcmp(kvname, "bf16"));
    json_object_set_new(res, "depth", json_integer(o->depth));
    /* the memory the backend's repacked weight copies take (bf16 for prefill, Q5_0 for decode) */
    json_object_set_new(res, "repacked_mib", json_real((double)kvl_wpack_total_bytes() / (1 << 20)));
    printf("%-20s %-7s %9.1f tokens/s  (sd %.1f, %d runs)", name, test, st.median, st.sd, o->runs);
    if (o->peak_gops > 0) {
      const double gop = block_ops_per_token(m) / 1e9, pct = gop * st.median / o->peak_gops * 100.0;
      json_object_set_new(res, "gop_per_token", json_real(gop));
      json_object_set_new(res, "peak_gops", json_real(o->peak_gops));
      if (o->peak) {
        json_object_set_new(res, "peak_dtype", json_string(o->peak->dtype));
        json_object_set_new(res, "peak_isa", json_string(o->peak->isa));
      }
      json_object_set_new(res, "roofline_pct", json_real(pct));
      printf("  %.1f%% of %.0f %s%s%s (%.2f GOP/token)", pct, o->peak_gops, o->peak ? o->peak->unit : "GOP/s",
             o->peak ? " " : "", o->peak ? o->peak->dtype : "", gop);
    }
    printf("\n");
  }

  /* tg<N>: an untimed TG_PROMPT-token prefill (which also warms the weights), then N
   * timed decode steps, each one token with logits, as a generation loop runs them. */
  if (o->tg > 0) {
    if (o->tg_depth > 0) snprintf(test, sizeof(test), "tg%d@d%d", o->tg, o->tg_depth);
    else snprintf(test, sizeof(test), "tg%d", o->tg);
    /* --bw auto: the read bandwidth just before and just after (a shared host's changes
     * by the minute: 34 and 62 GB/s within half an hour on a 2-core Zen 4); the larger of
     * the two is the roofline, so a window of low bandwidth cannot inflate the figure */
    double bw_before = 0, bw_after = 0;
    if (o->bw_auto) bw_before = kvl_bench_read_bandwidth(BW_MIB, threads, 3, NULL, NULL);
    struct kvl_backend_traffic tr0, tr1, tr = {0}; /* a device's copies and waits in the timed steps */
    for (int r = 0; r < o->runs; r++) {
      for (int t = 0; t < tg_prompt; t++) { pos[t] = t; want[t] = t == tg_prompt - 1; }
      struct kvl_batch b = {tg_prompt, ids, pos, seq, want};
      if ((rc = kvl_model_forward(m, be, &b, &kv, logits, NULL)) < 0) {
        fprintf(stderr, "bench-prefill-decode: %s %s: prompt forward: %s\n", name, test, kvl_strerror(rc));
        goto out;
      }
      kvl_backend_traffic(be, &tr0);
      double ts = kvl_bench_now();
      for (int i = 0; i < o->tg; i++) {
        pos[0] = tg_prompt + i;
        want[0] = o->full_logits ? 1 : KVL_LOGITS_TOP;
        struct kvl_batch d = {1, ids + tg_prompt + i, pos, seq, want};
        struct kvl_logit_top top = {.temperature = 0}; /* no draw */
        if ((rc = kvl_model_forward_top(m, be, &d, &kv, logits, &top)) < 0) {
          fprintf(stderr, "bench-prefill-decode: %s %s: decode forward: %s\n", name, test, kvl_strerror(rc));
          goto out;
        }
      }
      double dt = kvl_bench_now() - ts;
      kvl_backend_traffic(be, &tr1);
      tr.copies_in += tr1.copies_in - tr0.copies_in, tr.copies_out += tr1.copies_out - tr0.copies_out;
      tr.bytes_in += tr1.bytes_in - tr0.bytes_in, tr.bytes_out += tr1.bytes_out - tr0.bytes_out;
      tr.waits += tr1.waits - tr0.waits;
      s[r] = o->tg / dt;
      fprintf(stderr, "  %s %s run %d/%d: %.2f tokens/s (%.3f s)\n", name, test, r + 1, o->runs, s[r], dt);
    }
    kvl_bench_stats_compute(s, o->runs, &st);
    if (o->bw_auto) bw_after = kvl_bench_read_bandwidth(BW_MIB, threads, 3, NULL, NULL);
    const double bw = o->bw_auto ? (bw_before > bw_after ? bw_before : bw_after) : o->bw_gbps;
    const uint64_t wbytes = weight_bytes_per_token(m);
    json_t *res = kvl_bench_report_add(rep, name, test, st.median, "tokens/s", o->runs, st.sd);
    json_object_set_new(res, "kv", json_string(kvname));
    json_object_set_new(res, "threads", json_integer(threads));
    json_object_set_new(res, "backend", json_string(kvl_backend_name(be)));
    kvl_bench_attn_field(res, be, !strcmp(kvname, "bf16"));
    json_object_set_new(res, "prompt_tokens", json_integer(tg_prompt));
    json_object_set_new(res, "decode_logits", json_string(o->full_logits ? "full" : "summary"));
    json_object_set_new(res, "weight_mib_per_token", json_real((double)wbytes / (1 << 20)));
    json_object_set_new(res, "repacked_mib", json_real((double)kvl_wpack_total_bytes() / (1 << 20)));
    if (kvl_backend_traffic(be, &tr1)) { /* per decoded token, over every timed step */
      const double steps = (double)o->tg * o->runs;
      json_object_set_new(res, "device_waits_per_token", json_real((double)tr.waits / steps));
      json_object_set_new(res, "device_copies_per_token", json_real((double)(tr.copies_in + tr.copies_out) / steps));
      json_object_set_new(res, "device_kib_per_token", json_real((double)(tr.bytes_in + tr.bytes_out) / 1024 / steps));
      json_object_set_new(res, "device_kib_in_per_token", json_real((double)tr.bytes_in / 1024 / steps));
      json_object_set_new(res, "device_kib_out_per_token", json_real((double)tr.bytes_out / 1024 / steps));
      fprintf(stderr, "  %s %s per token on the device: %.1f waits, %.1f copies in (%.1f KiB) and %.1f out (%.1f KiB)\n",
              name, test, (double)tr.waits / steps, (double)tr.copies_in / steps, (double)tr.bytes_in / 1024 / steps,
              (double)tr.copies_out / steps, (double)tr.bytes_out / 1024 / steps);
    }
    printf("%-20s %-7s %9.2f tokens/s  (sd %.2f, %d runs)", name, test, st.median, st.sd, o->runs);
    if (bw > 0) {
      double pct = (double)wbytes * st.median / (bw * 1e9) * 100.0;
      json_object_set_new(res, "roofline_pct", json_real(pct));
      json_object_set_new(res, "bw_gbps", json_real(bw));
      if (o->bw_auto) {
        json_object_set_new(res, "bw_before_gbps", json_real(bw_before));
        json_object_set_new(res, "bw_after_gbps", json_real(bw_after));
      }
      printf("  %.1f%% of %.1f GB/s (%.1f MiB weights/token)", pct, bw, (double)wbytes / (1 << 20));
    }
    printf("\n");
  }
  ret = 0;
out:
  free(s);
  free(logits);
  free(want);
  free(seq);
  free(pos);
  free(ids);
  free(table);
  kvl_huge_free(pool, pool_mapped);
  free(stamps);
  kvl_model_free(m);
  return ret;
}

static void usage(FILE *f) {
  fprintf(f,
    "usage: bench-prefill-decode [-m MODEL.gguf]... [options]\n"
    "\n"
    "Prefill (pp<N>) and decode (tg<N>) speed of the engine on the CPU backend; writes\n"
    "<out>/prefill-decode.json and .md. Run it on a quiet machine.\n"
    "\n"
    "  -m, --model PATH   a .gguf file (repeatable); default: qwen2.5-coder-0.5b and -1.5b\n"
    "                     (q4_k_m) in $KVLINGO_MODELS (default ~/.cache/kvlingo/models)\n"
    "  -p, --prefill N,.. pp<N>: prefill N tokens in one forward, for each N given\n"
    "                     (default 512; llama-bench's set: -p 64,512,2048; 0 = skip)\n"
    "  -d, --depth D      pp<N>@d<D>: D positions are in the cache before the N tokens\n"
    "                     (a new turn's prefill after a D-token history; default 0)\n"
    "  -n, --decode N     tg<N>: N decode steps after a %d-token prompt (default 128; 0 = skip)\n"
    "      --tg-depth D   tg<N>@d<D>: the decode steps after a D-token prompt instead\n"
    "      --full-logits  each decode step brings its whole row of logits to the host (default:\n"
    "                     its summary, the 64 largest and the log-partition, as the scheduler\n"
    "                     takes for greedy and top-k sampling; the same work on the CPU)\n"
    "  -r, --runs N       timed runs per figure (default 5)\n"
    "      --kv bf16|f32  KV cache storage (default bf16)\n"
    "      --backend cpu|cuda|cuda-sim  the CPU backend (default), the CUDA one (kernels/cuda/),\n"
    "                          or the CUDA one compiled for the CPU (copies and waits, not times)\n"
    "      --bw GBPS|auto memory bandwidth (e.g. bench-roofline's all-cores figure): adds\n"
    "                     roofline_pct to tg results; auto: read bandwidth measured just\n"
    "                     before and after each model's tg runs (1 GiB, 3 reads), the larger\n"
    "      --peak GOPS    arithmetic peak for the pp results' roofline_pct (default: measured\n"
    "                     here, for the data type of the backend's prefill matmuls; 0 = none)\n"
    "      --out DIR      where to write the results (default bench/results)\n"
    "  -h, --help         this text\n"
    "\n"
    "Threads: OpenMP's (OMP_NUM_THREADS); SIMD level: KVL_CPU=scalar|avx2|avx2int8|avx2int8mm|avx512|avx512vnni|avx512vnnimm|amx|avx512bf16;\n"
    "attention's products: KVL_ATTN=fp32 keeps them fp32 where AVX512_BF16 makes them bf16 (\"attn\" in the results).\n",
    TG_PROMPT);
}

static int parse_int(const char *s, const char *what, int min) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < min || v > 1 << 24) {
    fprintf(stderr, "bench-prefill-decode: %s must be an integer >= %d, not '%s'\n", what, min, s);
    exit(2);
  }
  return (int)v;
}

int main(int argc, char **argv) {
  enum { O_KV = 1000, O_BW, O_OUT, O_BACKEND, O_PEAK, O_TG_DEPTH, O_FULL_LOGITS };
  static const struct option lopts[] = {
    {"model", required_argument, 0, 'm'}, {"prefill", required_argument, 0, 'p'},
    {"depth", required_argument, 0, 'd'}, {"decode", required_argument, 0, 'n'}, {"runs", required_argument, 0, 'r'},
    {"kv", required_argument, 0, O_KV}, {"bw", required_argument, 0, O_BW},
    {"out", required_argument, 0, O_OUT}, {"backend", required_argument, 0, O_BACKEND},
    {"peak", required_argument, 0, O_PEAK}, {"tg-depth", required_argument, 0, O_TG_DEPTH},
    {"full-logits", no_argument, 0, O_FULL_LOGITS},
    {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  struct bench_opts o = {.pp = {512}, .n_pp = 1, .pp_max = 512, .tg = 128, .runs = 5, .kv = KVL_KV_BF16,
                         .peak_gops = -1, .out = "bench/results"};
  int c;
  char *end;
  while ((c = getopt_long(argc, argv, "m:p:d:n:r:h", lopts, NULL)) != -1) {
    switch (c) {
    case 'm':
      if (o.n_models == MAX_MODELS) { fprintf(stderr, "bench-prefill-decode: at most %d models\n", MAX_MODELS); return 2; }
      o.models[o.n_models++] = optarg;
      break;
    case 'p': {
      o.n_pp = 0, o.pp_max = 0;
      char *list = strdup(optarg);
      for (char *save, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int v = parse_int(tok, "-p", 0);
        if (v == 0) continue;
        if (o.n_pp == 8) { fprintf(stderr, "bench-prefill-decode: at most 8 prefill lengths\n"); return 2; }
        o.pp[o.n_pp++] = v;
        if (v > o.pp_max) o.pp_max = v;
      }
      free(list);
      break;
    }
    case 'd': o.depth = parse_int(optarg, "-d", 0); break;
    case 'n': o.tg = parse_int(optarg, "-n", 0); break;
    case O_TG_DEPTH: o.tg_depth = parse_int(optarg, "--tg-depth", 1); break;
    case O_FULL_LOGITS: o.full_logits = true; break;
    case 'r': o.runs = parse_int(optarg, "-r", 1); break;
    case O_BACKEND:
      if (kvl_bench_backend_opt("bench-prefill-decode", optarg, &o.cuda)) return 2;
      break;
    case O_KV:
      if (!strcmp(optarg, "bf16")) o.kv = KVL_KV_BF16;
      else if (!strcmp(optarg, "f32")) o.kv = KVL_KV_F32;
      else { fprintf(stderr, "bench-prefill-decode: --kv is bf16 or f32, not '%s'\n", optarg); return 2; }
      break;
    case O_BW:
      if (!strcmp(optarg, "auto")) {
        o.bw_auto = true;
        break;
      }
      o.bw_gbps = strtod(optarg, &end);
      if (*end || !(o.bw_gbps > 0)) { fprintf(stderr, "bench-prefill-decode: --bw must be a positive number of GB/s\n"); return 2; }
      break;
    case O_PEAK:
      o.peak_gops = strtod(optarg, &end);
      if (*end || !(o.peak_gops >= 0)) { fprintf(stderr, "bench-prefill-decode: --peak must be a number of GOP/s >= 0\n"); return 2; }
      break;
    case O_OUT: o.out = optarg; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind < argc) { fprintf(stderr, "bench-prefill-decode: unexpected argument '%s'\n", argv[optind]); return 2; }
  if (o.n_pp == 0 && o.tg == 0) { fprintf(stderr, "bench-prefill-decode: nothing to do (-p 0 and -n 0)\n"); return 2; }

  /* Model paths and names: given ones as they are, else the defaults that exist. */
  char *paths[MAX_MODELS] = {0}, *names[MAX_MODELS] = {0};
  int n = 0;
  if (o.n_models > 0) {
    for (int i = 0; i < o.n_models; i++) {
      paths[n] = strdup(o.models[i]);
      names[n] = short_name(o.models[i]);
      if (!paths[n] || !names[n]) { fprintf(stderr, "bench-prefill-decode: out of memory\n"); return 1; }
      n++;
    }
  } else {
    const char *dir = getenv("KVLINGO_MODELS");
    char def[4096];
    if (!dir || !*dir) {
      snprintf(def, sizeof(def), "%s/.cache/kvlingo/models", getenv("HOME") ? getenv("HOME") : ".");
      dir = def;
    }
    for (size_t i = 0; i < sizeof(default_models) / sizeof(default_models[0]); i++) {
      char p[4200];
      snprintf(p, sizeof(p), "%s/%s", dir, default_models[i][0]);
      if (access(p, R_OK) != 0) {
        fprintf(stderr, "bench-prefill-decode: %s not found, skipped (scripts/fetch-models fetches it)\n", p);
        continue;
      }
      paths[n] = strdup(p);
      names[n] = strdup(default_models[i][1]);
      if (!paths[n] || !names[n]) { fprintf(stderr, "bench-prefill-decode: out of memory\n"); return 1; }
      n++;
    }
    if (n == 0) { fprintf(stderr, "bench-prefill-decode: no model to run (give -m PATH)\n"); return 1; }
  }

  /* The arithmetic peak of the prefill's data type, measured now (a few seconds) unless
   * given. */
  if (o.peak_gops < 0) {
    o.peak_gops = 0;
    o.peak = o.cuda || o.n_pp == 0 ? NULL : prefill_peak(kvl_backend_name(kvl_backend_cpu()));
    if (o.peak && kvl_bench_peak_usable(o.peak)) {
      o.peak_gops = kvl_bench_peak_measure(o.peak, omp_get_max_threads(), 3, NULL);
      fprintf(stderr, "bench-prefill-decode: peak %s on %s, %d threads: %.0f %s\n", o.peak->dtype, o.peak->isa,
              omp_get_max_threads(), o.peak_gops, o.peak->unit);
    }
  }

  kvl_bench_report_t *rep = kvl_bench_report_new("prefill-decode", argc, argv);
  if (!rep) { fprintf(stderr, "bench-prefill-decode: out of memory\n"); return 1; }
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++) rc = bench_model(paths[i], names[i], &o, rep);
  /* A failed model ends the run without a results file: a partial file would look like
   * a complete measurement. */
  if (rc == 0) {
    rc = kvl_bench_report_write(rep, o.out);
    if (rc == 0) printf("wrote %s/prefill-decode.json and %s/prefill-decode.md\n", o.out, o.out);
  }
  kvl_bench_report_free(rep);
  for (int i = 0; i < n; i++) { free(paths[i]); free(names[i]); }
  return rc < 0 ? 1 : 0;
}
