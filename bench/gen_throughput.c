/* gen_throughput.c — serving throughput of the continuous-batching scheduler: aggregate
 * generation tokens/s, time to first token and inter-token latency (p50/p99) for N
 * concurrent streams, with and without shared-prefix traffic (test "gen-throughput").
 *
 *   bench-gen-throughput [-m MODEL.gguf]... [-c 1,4,16,64] [-n TOKENS] [--prefix-share]
 *                        [--kv bf16|f32] [--step-tokens N] [--backend cpu|cuda|cuda-sim] [--out DIR]
 *
 * Each run submits N requests at once (fixed seed: prompt lengths drawn from 64..256
 * tokens, greedy decoding of TOKENS tokens each; with --prefix-share every prompt
 * starts with the same 128-token system prefix) and steps the scheduler until idle.
 * One run per concurrency: the machine has 2 cores, so a run of 64 streams is long.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_backend.h"
#include "bench_common.h"
#include "kvl_error.h"
#include "kvl_model.h"
#include "kvl_sched.h"

struct stream {
  double t_submit, t_first, t_last;
  double *itl;   /* inter-token gaps, ms */
  int n_itl, n_tok;
  uint64_t digest; /* FNV-1a over the tokens generated, in order */
};

struct run {
  struct stream *s;
  int n;
  double t0;
  long cached, prompt;   /* prompt tokens served from the prefix cache / in all */
};

static void on_token(void *ud, uint64_t id, const struct kvl_token_event *ev) {
  struct run *r = ud;
  struct stream *s = &r->s[(id - 1) % (uint64_t)r->n];
  double t = kvl_bench_now() * 1e3;
  if (ev->token >= 0) {
    if (s->n_tok == 0) s->t_first = t;
    else s->itl[s->n_itl++] = t - s->t_last;
    s->t_last = t;
    s->n_tok++;
    for (int b = 0; b < 4; b++) s->digest = (s->digest ^ (((uint32_t)ev->token >> (8 * b)) & 0xffu)) * 0x100000001b3ull;
  }
  if (ev->final) {
    r->cached += ev->usage.cached_native + ev->usage.cached_translated;
    r->prompt += ev->usage.prompt_tokens;
  }
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
  if (n == 0) return 0;
  qsort(v, (size_t)n, sizeof(double), cmp_d);
  int i = (int)ceil(p / 100.0 * n) - 1;
  return v[i < 0 ? 0 : i];
}

int main(int argc, char **argv) {
  const char *models[4];
  int n_models = 0, n_tokens = 32, step_tokens = 256, conc[8] = {1, 4, 16, 64}, n_conc = 4;
  bool share = false;
  const char *out = "bench/results";
  enum kvl_kv_dtype kvdt = KVL_KV_BF16;
  bool cuda = false;
  float temperature = 0;
  static const struct option opts[] = {{"prefix-share", no_argument, 0, 'P'}, {"kv", required_argument, 0, 'K'},
                                       {"temperature", required_argument, 0, 'T'},
                                       {"step-tokens", required_argument, 0, 'S'}, {"out", required_argument, 0, 'O'},
                                       {"backend", required_argument, 0, 'B'},
                                       {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "m:c:n:h", opts, NULL)) != -1) {
    switch (c) {
    case 'm': if (n_models < 4) models[n_models++] = optarg; break;
    case 'n': n_tokens = atoi(optarg); break;
    case 'c': {
      n_conc = 0;
      for (const char *t = optarg; *t && n_conc < 8; t += strcspn(t, ",") + (t[strcspn(t, ",")] == ',')) /* argv kept */
        conc[n_conc++] = atoi(t);
      break;
    }
    case 'P': share = true; break;
    case 'K': kvdt = !strcmp(optarg, "f32") ? KVL_KV_F32 : KVL_KV_BF16; break;
    case 'S': step_tokens = atoi(optarg); break;
    case 'T': temperature = (float)atof(optarg); break;
    case 'O': out = optarg; break;
    case 'B':
      if (kvl_bench_backend_opt("bench-gen-throughput", optarg, &cuda)) return 2;
      break;
    default:
      fprintf(c == 'h' ? stdout : stderr,
              "usage: bench-gen-throughput [-m MODEL.gguf]... [-c 1,4,16,64] [-n TOKENS] [--prefix-share] "
              "[--kv bf16|f32] [--step-tokens N] [--temperature T] [--backend cpu|cuda|cuda-sim] [--out DIR]\n%s",
              c != 'h' ? ""
                       : "\nServing throughput of the scheduler: N streams submitted at once (prompts of 64..256\n"
                         "tokens, fixed seed), greedy by default; aggregate generated tokens/s over the whole run (prefill\n"
                         "included), TTFT and inter-token latency p50/p99. Writes DIR/gen-throughput[-shared].json/.md.\n\n"
                         "  -m MODEL.gguf      repeatable; default: qwen2.5-coder-1.5b in $KVLINGO_MODELS\n"
                         "  -c LIST            concurrencies (default 1,4,16,64)\n"
                         "  -n TOKENS          generated per stream (default 32)\n"
                         "  --prefix-share     every prompt starts with the same 128-token prefix (hit rate)\n"
                         "  --kv bf16|f32      KV cache storage (default bf16)\n"
                         "  --step-tokens N    the scheduler's per-step token budget (default 256)\n"
                         "  --temperature T    sample at T from the whole distribution, stream i seeded i\n"
                         "                     (default 0: greedy)\n"
                         "  --backend cpu|cuda|cuda-sim the CPU backend (default), the CUDA one (kernels/cuda/),\n"
                         "                     or the CUDA one compiled for the CPU (copies and waits, not times)\n"
                         "  --out DIR          default bench/results\n");
      return c == 'h' ? 0 : 2;
    }
  }
  static char defpath[4200];
  if (n_models == 0) {
    kvl_bench_model_path("1.5b", defpath, sizeof(defpath));
    models[n_models++] = defpath;
  }
  kvl_backend_t *be = kvl_bench_backend("bench-gen-throughput", cuda);
  if (!be) return 1;
  kvl_bench_report_t *rep = kvl_bench_report_new(share ? "gen-throughput-shared" : "gen-throughput", argc, argv);
  for (int mi = 0; mi < n_models; mi++) {
    char err[512];
    kvl_model_t *m;
    if (kvl_model_open(models[mi], &m, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
    kvl_model_prepare(m, be); /* as the daemon does at load */
    const struct kvl_model_hparams *hp = kvl_model_hparams(m);
    for (int ci = 0; ci < n_conc; ci++) {
      int N = conc[ci];
      kvl_sched_t *s;
      kvl_sched_new(&(struct kvl_sched_config){.step_tokens = step_tokens, .max_seqs = N > 64 ? N : 64}, &s);
      struct kvl_kv_layout kl = kvl_model_kv_layout(m, kvdt);
      size_t blocks = (size_t)N * ((256 + (size_t)n_tokens) / KVL_KV_BLOCK + 2) + 16;
      struct kvl_sched_model sm = {kvl_bench_model_name(models[mi]), m, be,
                                   {kl, blocks * kvl_kv_block_bytes(&kl), 0, 0, NULL, 0, true}, 0};
      int mid;
      if (kvl_sched_add_model(s, &sm, &mid, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
      struct run run = {calloc((size_t)N, sizeof(struct stream)), N, 0, 0, 0};
      for (int i = 0; i < N; i++) run.s[i].digest = 0xcbf29ce484222325ull;
      unsigned long long seed = 12345;
      /* ids 1000..19999 (a tiny test model's vocabulary: all of it) */
      const int32_t lo = hp->n_vocab >= 20000 ? 1000 : 0, span = hp->n_vocab >= 20000 ? 19000 : hp->n_vocab;
      int32_t prefix[128];
      for (int j = 0; j < 128; j++) prefix[j] = lo + (int32_t)((j * 7919) % span);
      int32_t **prompts = calloc((size_t)N, sizeof(int32_t *));
      int total_prompt = 0;
      for (int i = 0; i < N; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int len = 64 + (int)((seed >> 33) % 193);
        prompts[i] = malloc((size_t)len * sizeof(int32_t));
        for (int j = 0; j < len; j++) {
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          prompts[i][j] = share && j < 128 && len > 128 ? prefix[j] : lo + (int32_t)((seed >> 33) % (unsigned)span);
        }
        run.s[i].itl = malloc((size_t)n_tokens * sizeof(double));
        total_prompt += len;
        struct kvl_request q = {.model = mid, .prompt = prompts[i], .n_prompt = len, .max_tokens = n_tokens};
        kvl_sampler_params_init(&q.sampling);
        q.sampling.temperature = temperature;
        q.sampling.seed = (uint64_t)i, q.sampling.has_seed = true;
        uint64_t id;
        run.s[i].t_submit = kvl_bench_now() * 1e3;
        if (kvl_sched_submit(s, &q, on_token, &run, &id, err, sizeof(err)) < 0) { fprintf(stderr, "%s\n", err); return 1; }
      }
      struct kvl_backend_traffic tr0, tr1; /* a device's copies and waits, prefill and decode */
      kvl_backend_traffic(be, &tr0);
      double t0 = kvl_bench_now();
      while (!kvl_sched_idle(s))
        if (kvl_sched_step(s) < 0) { fprintf(stderr, "step failed\n"); return 1; }
      double secs = kvl_bench_now() - t0;
      double *ttft = malloc((size_t)N * sizeof(double)), *itl = malloc((size_t)N * (size_t)n_tokens * sizeof(double));
      int n_itl = 0, gen = 0;
      for (int i = 0; i < N; i++) {
        ttft[i] = run.s[i].t_first - run.s[i].t_submit;
        for (int k = 0; k < run.s[i].n_itl; k++) itl[n_itl++] = run.s[i].itl[k];
        gen += run.s[i].n_tok;
      }
      struct kvl_pool_stats st;
      kvl_pool_stats(kvl_sched_pool(s, mid), &st);
      double tps = gen / secs;
      json_t *res = kvl_bench_report_add(rep, kvl_bench_model_name(models[mi]), "gen-throughput", tps, "tokens/s", 1, 0);
      json_object_set_new(res, "concurrency", json_integer(N));
      json_object_set_new(res, "ttft_p50_ms", json_real(pct(ttft, N, 50)));
      json_object_set_new(res, "ttft_p99_ms", json_real(pct(ttft, N, 99)));
      json_object_set_new(res, "itl_p50_ms", json_real(pct(itl, n_itl, 50)));
      json_object_set_new(res, "itl_p99_ms", json_real(pct(itl, n_itl, 99)));
      json_object_set_new(res, "prompt_tokens", json_integer(total_prompt));
      json_object_set_new(res, "generated_tokens", json_integer(gen));
      json_object_set_new(res, "temperature", json_real(temperature));
      uint64_t dg = 0xcbf29ce484222325ull; /* the streams' digests in submission order */
      for (int i = 0; i < N; i++) dg = (dg ^ run.s[i].digest) * 0x100000001b3ull;
      char dgs[24];
      snprintf(dgs, sizeof(dgs), "%016llx", (unsigned long long)dg);
      json_object_set_new(res, "tokens_digest", json_string(dgs)); /* the same tokens, the same digest */
      json_object_set_new(res, "prefix_share", json_boolean(share));
      json_object_set_new(res, "prefix_hit_rate", json_real(run.prompt ? (double)run.cached / (double)run.prompt : 0));
      json_object_set_new(res, "kv", json_string(kvdt == KVL_KV_BF16 ? "bf16" : "f32"));
      json_object_set_new(res, "backend", json_string(kvl_backend_name(be)));
      kvl_bench_attn_field(res, be, kvdt == KVL_KV_BF16);
      if (kvl_backend_traffic(be, &tr1) && gen > 0) { /* per generated token, the prompts' work included */
        json_object_set_new(res, "device_waits_per_token", json_real((double)(tr1.waits - tr0.waits) / gen));
        json_object_set_new(res, "device_kib_in_per_token", json_real((double)(tr1.bytes_in - tr0.bytes_in) / 1024 / gen));
        json_object_set_new(res, "device_kib_out_per_token",
                            json_real((double)(tr1.bytes_out - tr0.bytes_out) / 1024 / gen));
      }
      fprintf(stderr, "%s c=%d: %.1f tokens/s, ttft p50 %.0f ms, itl p50 %.0f ms (%d prompt tokens, %.0f%% from the cache, %.1f s)\n",
              kvl_bench_model_name(models[mi]), N, tps, pct(ttft, N, 50), pct(itl, n_itl, 50), total_prompt,
              run.prompt ? 100.0 * (double)run.cached / (double)run.prompt : 0.0, secs);
      for (int i = 0; i < N; i++) { free(prompts[i]); free(run.s[i].itl); }
      free(prompts); free(run.s); free(ttft); free(itl);
      kvl_sched_free(s);
      (void)hp;
    }
    kvl_model_free(m);
  }
  int rc = kvl_bench_report_write(rep, out);
  kvl_bench_report_free(rep);
  return rc < 0 ? 1 : 0;
}
