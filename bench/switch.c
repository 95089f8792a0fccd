/* switch.c — the headline benchmark: time to first token when a conversation moves to the
 * other model, by translating its KV cache (the KV-Lingo switch) versus re-prefilling the
 * whole conversation in the incoming model (test "switch-ttft", value = speed-up ×).
 *
 *   bench-switch [--small S.gguf --large L.gguf] [--maps DIR] [-c 64,512,2048,8192]
 *                [-r RUNS] [--turn N] [--out DIR]
 *
 * For each context length C and direction S -> T: the source model prefills a C-token
 * conversation (its kept line, not timed), then a new user turn of N tokens arrives for
 * the target model:
 *   translated  the target's line is extended by translating the C positions from the
 *               source's line, then the turn (and the last position) is prefilled;
 *   reprefill   the same request declining translation (what a server without
 *               translators does): the target prefills all C + N positions.
 * TTFT is from submit to the first token, both through the same scheduler and kernels;
 * every run uses a fresh token sequence, so no prefix cache helps either path. Medians
 * over RUNS runs. The machine has 2 cores: long contexts take minutes per run.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "kvl_error.h"
#include "kvl_model.h"
#include "kvl_sched.h"
#include "kvl_translator.h"

struct probe {
  double ttft_ms;
  struct kvl_usage usage;
  bool done;
};

static void on_token(void *ud, uint64_t id, const struct kvl_token_event *ev) {
  (void)id;
  struct probe *p = ud;
  if (ev->token >= 0 && p->ttft_ms == 0) p->ttft_ms = ev->ttft_ms;
  if (ev->final) { p->usage = ev->usage; p->done = true; }
}

static int run(kvl_sched_t *s, int model, const int32_t *ids, int32_t n, uint64_t conv, bool no_translate,
               struct probe *p) {
  memset(p, 0, sizeof(*p));
  struct kvl_request q = {.model = model, .prompt = ids, .n_prompt = n, .max_tokens = 1, .conversation = conv,
                          .no_translate = no_translate,
                          .reuse = no_translate ? KVL_REUSE_NATIVE_ONLY : KVL_REUSE_ANY};
  kvl_sampler_params_init(&q.sampling);
  q.sampling.temperature = 0;
  uint64_t id;
  char err[256];
  if (kvl_sched_submit(s, &q, on_token, p, &id, err, sizeof(err)) < 0) {
    fprintf(stderr, "bench-switch: %s\n", err);
    return -1;
  }
  while (!kvl_sched_idle(s))
    if (kvl_sched_step(s) < 0) return -1;
  return p->done ? 0 : -1;
}

static void usage(FILE *f) {
  fprintf(f, "usage: bench-switch [--small S.gguf --large L.gguf] [--maps DIR] [-c 64,512,2048,8192]\n"
             "                    [-r RUNS] [--turn N] [--out DIR]\n"
             "Time to first token after a model switch: translated KV cache vs full re-prefill.\n");
}

int main(int argc, char **argv) {
  static char paths[2][4200], maps[4200];
  kvl_bench_model_path("0.5b", paths[0], sizeof(paths[0]));
  kvl_bench_model_path("1.5b", paths[1], sizeof(paths[1]));
  snprintf(maps, sizeof(maps), "%s/translator/maps", KVL_BENCH_SOURCE_ROOT);
  int ctx[16] = {64, 512, 2048, 8192}, n_ctx = 4, runs = 5, turn = 32;
  const char *out = "bench/results";
  static const struct option opts[] = {{"small", required_argument, 0, 'S'}, {"large", required_argument, 0, 'L'},
                                       {"maps", required_argument, 0, 'M'}, {"turn", required_argument, 0, 'T'},
                                       {"out", required_argument, 0, 'O'}, {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "c:r:h", opts, NULL)) != -1) {
    switch (c) {
    case 'S': snprintf(paths[0], sizeof(paths[0]), "%s", optarg); break;
    case 'L': snprintf(paths[1], sizeof(paths[1]), "%s", optarg); break;
    case 'M': snprintf(maps, sizeof(maps), "%s", optarg); break;
    case 'T': turn = atoi(optarg); break;
    case 'O': out = optarg; break;
    case 'r': runs = atoi(optarg); break;
    case 'c': {
      n_ctx = 0;
      for (char *t = strtok(optarg, ","); t && n_ctx < 16; t = strtok(NULL, ",")) ctx[n_ctx++] = atoi(t);
      break;
    }
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (runs < 1 || turn < 1 || n_ctx < 1) { usage(stderr); return 2; }
  char err[512];
  kvl_model_t *m[2];
  for (int i = 0; i < 2; i++)
    if (kvl_model_open(paths[i], &m[i], err, sizeof(err)) < 0) { fprintf(stderr, "bench-switch: %s\n", err); return 1; }
  for (int i = 0; i < 2; i++) kvl_model_prepare(m[i], kvl_backend_cpu()); /* as the daemon does at load */
  int max_ctx = 0;
  for (int i = 0; i < n_ctx; i++) max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;
  kvl_sched_t *s;
  kvl_sched_new(&(struct kvl_sched_config){.step_tokens = 512, .max_seqs = 8}, &s);
  int mid[2];
  for (int i = 0; i < 2; i++) {
    struct kvl_kv_layout kl = kvl_model_kv_layout(m[i], KVL_KV_BF16);
    /* room for a few lines of the longest context (kept source, target, prefix cache) */
    size_t blocks = 4 * ((size_t)max_ctx + (size_t)turn + 64) / KVL_KV_BLOCK + 64;
    struct kvl_sched_model sm = {kvl_bench_model_name(paths[i]), m[i], kvl_backend_cpu(),
                                 {kl, blocks * kvl_kv_block_bytes(&kl), blocks * kvl_kv_block_bytes(&kl), 0, NULL, 0, true}, 0};
    if (kvl_sched_add_model(s, &sm, &mid[i], err, sizeof(err)) < 0) { fprintf(stderr, "bench-switch: %s\n", err); return 1; }
  }
  kvl_translator_t *t[2];
  for (int i = 0; i < 2; i++) {
    char p[8600];
    snprintf(p, sizeof(p), "%s/%s-to-%s.safetensors", maps, kvl_bench_model_name(paths[i]), kvl_bench_model_name(paths[1 - i]));
    if (kvl_translator_load(p, &t[i], err, sizeof(err)) < 0 ||
        kvl_sched_add_translator(s, mid[i], mid[1 - i], t[i], NULL, err, sizeof(err)) < 0) {
      fprintf(stderr, "bench-switch: %s\n", err);
      return 1;
    }
  }
  kvl_bench_report_t *rep = kvl_bench_report_new("switch-sched", argc, argv);
  int32_t *ids = malloc(((size_t)max_ctx + (size_t)turn) * sizeof(int32_t));
  unsigned long long seed = 777;
  uint64_t conv = 1;
  for (int ci = 0; ci < n_ctx; ci++) {
    int C = ctx[ci], N = C + turn;
    for (int dir = 0; dir < 2; dir++) {
      int S = dir, T = 1 - dir;
      double tr[32], rp[32];
      struct probe pr = {0};
      for (int k = 0; k < runs && k < 32; k++) {
        for (int j = 0; j < N; j++) { /* ordinary (non-special) ids, fresh every run */
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          ids[j] = 200 + (int32_t)((seed >> 33) % 150000);
        }
        struct probe p;
        /* the conversation so far, on the source (its kept line; not timed) */
        if (run(s, mid[S], ids, C, conv, false, &p) < 0) return 1;
        if (run(s, mid[T], ids, N, conv, false, &pr) < 0) return 1;
        tr[k] = pr.ttft_ms;
        if (pr.usage.translated != C) fprintf(stderr, "bench-switch: translated %d of %d positions\n", pr.usage.translated, C);
        conv++;
        for (int j = 0; j < N; j++) { /* the re-prefill run: other tokens, so no cache helps */
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          ids[j] = 200 + (int32_t)((seed >> 33) % 150000);
        }
        if (run(s, mid[T], ids, N, 0, true, &p) < 0) return 1;
        rp[k] = p.ttft_ms;
        kvl_sched_conversations_expire(s, -1); /* drop kept lines: each run starts alike */
        fprintf(stderr, "  %s -> %s, %d tokens: translated %.1f ms, reprefill %.1f ms\n", kvl_bench_model_name(paths[S]),
                kvl_bench_model_name(paths[T]), C, tr[k], rp[k]);
      }
      struct kvl_bench_stats st, sr;
      int n = runs < 32 ? runs : 32;
      kvl_bench_stats_compute(tr, n, &st);
      kvl_bench_stats_compute(rp, n, &sr);
      double x[32];
      for (int k = 0; k < n; k++) x[k] = rp[k] / tr[k];
      char direction[160];
      snprintf(direction, sizeof(direction), "%s->%s", kvl_bench_model_name(paths[S]), kvl_bench_model_name(paths[T]));
      json_t *res = kvl_bench_report_add(rep, kvl_bench_model_name(paths[T]), "switch-ttft", sr.median / st.median, "x", n,
                                         kvl_bench_sd(x, n));
      json_object_set_new(res, "direction", json_string(direction));
      json_object_set_new(res, "context_tokens", json_integer(C));
      json_object_set_new(res, "turn_tokens", json_integer(turn));
      json_object_set_new(res, "translated_ms", json_real(st.median));
      json_object_set_new(res, "translated_sd_ms", json_real(st.sd));
      json_object_set_new(res, "reprefill_ms", json_real(sr.median));
      json_object_set_new(res, "reprefill_sd_ms", json_real(sr.sd));
      json_object_set_new(res, "translated_positions", json_integer(pr.usage.translated));
      json_object_set_new(res, "prefilled_positions", json_integer(pr.usage.prefilled));
    }
  }
  int rc = kvl_bench_report_write(rep, out);
  kvl_bench_report_free(rep);
  kvl_sched_free(s);
  for (int i = 0; i < 2; i++) {
    kvl_translator_free(t[i]);
    kvl_model_free(m[i]);
  }
  free(ids);
  return rc < 0 ? 1 : 0;
}
