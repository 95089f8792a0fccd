/* cmd_run.c — `kvlingo run`: generate from a model file in-process (no daemon). */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvl_error.h"
#include "kvl_model.h"
#include "kvl_sampler.h"
#include "kvl_tokenizer.h"
#include "kvl_chat.h"

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvlingo run [-m MODEL] -p PROMPT [options]\n"
    "\n"
    "Generate text from a GGUF model in this process and stream it to the terminal,\n"
    "then print prompt and generation speed.\n"
    "\n"
    "  -m, --model MODEL      a .gguf path, or a name looked up in $KVLINGO_MODELS\n"
    "                         (default ~/.cache/kvlingo/models): 'qwen2.5-coder-0.5b' (default)\n"
    "  -p, --prompt TEXT      the prompt ('-' reads it from standard input)\n"
    "  -n, --max-tokens N     tokens to generate at most (default 256)\n"
    "      --chat             wrap the prompt as a user message in the model's chat template\n"
    "  -s, --system TEXT      system message for --chat\n"
    "      --temperature T    0 = greedy (default 0)\n"
    "      --top-k K          keep the K most likely tokens (0 = off)\n"
    "      --top-p P          nucleus sampling (1 = off)\n"
    "      --min-p P          drop tokens below P x the top probability (0 = off)\n"
    "      --repeat-penalty R repetition penalty (1 = off)\n"
    "      --seed S           random seed (fixed seed => same output)\n"
    "      --stop TEXT        stop at this string (repeatable)\n"
    "      --kv f32|bf16      KV cache storage (default bf16)\n"
    "      --chunk N          prefill chunk size in tokens (default 512)\n"
    "  -h, --help             this text\n"
    "\n"
    "example: kvlingo run -p 'def fibonacci(n):' -n 64\n"
    "         kvlingo run --chat -p 'Write a Python function that reverses a list.'\n");
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *read_stdin(void) {
  size_t cap = 4096, n = 0;
  char *s = malloc(cap);
  size_t r;
  while (s && (r = fread(s + n, 1, cap - n - 1, stdin)) > 0) {
    n += r;
    if (n + 1 == cap) { cap *= 2; char *ns = realloc(s, cap); if (!ns) { free(s); return NULL; } s = ns; }
  }
  if (s) s[n] = '\0';
  return s;
}

int kvl_cli_run(int argc, char **argv) {
  enum { O_CHAT = 1000, O_TEMP, O_TOPK, O_TOPP, O_MINP, O_SEED, O_STOP, O_KV, O_CHUNK, O_REP };
  static const struct option opts[] = {
    {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
    {"max-tokens", required_argument, 0, 'n'}, {"system", required_argument, 0, 's'},
    {"chat", no_argument, 0, O_CHAT}, {"temperature", required_argument, 0, O_TEMP},
    {"top-k", required_argument, 0, O_TOPK}, {"top-p", required_argument, 0, O_TOPP},
    {"min-p", required_argument, 0, O_MINP}, {"seed", required_argument, 0, O_SEED},
    {"stop", required_argument, 0, O_STOP}, {"kv", required_argument, 0, O_KV},
    {"chunk", required_argument, 0, O_CHUNK}, {"repeat-penalty", required_argument, 0, O_REP},
    {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  const char *model = "qwen2.5-coder-0.5b", *prompt = NULL, *system = NULL;
  const char *stops[17] = {0};
  int n_stops = 0, max_tokens = 256, chunk = 512;
  bool chat = false;
  enum kvl_kv_dtype kvdt = KVL_KV_BF16;
  struct kvl_sampler_params sp;
  kvl_sampler_params_init(&sp);
  sp.temperature = 0.0f;
  optind = 1;
  int c;
  while ((c = getopt_long(argc, argv, "m:p:n:s:h", opts, NULL)) != -1) {
    switch (c) {
    case 'm': model = optarg; break;
    case 'p': prompt = optarg; break;
    case 'n': max_tokens = atoi(optarg); break;
    case 's': system = optarg; break;
    case O_CHAT: chat = true; break;
    case O_TEMP: sp.temperature = strtof(optarg, NULL); break;
    case O_TOPK: sp.top_k = atoi(optarg); break;
    case O_TOPP: sp.top_p = strtof(optarg, NULL); break;
    case O_MINP: sp.min_p = strtof(optarg, NULL); break;
    case O_REP: sp.repetition_penalty = strtof(optarg, NULL); break;
    case O_SEED: sp.seed = strtoull(optarg, NULL, 10); sp.has_seed = true; break;
    case O_STOP: if (n_stops < 16) stops[n_stops++] = optarg; break;
    case O_KV: kvdt = !strcmp(optarg, "f32") ? KVL_KV_F32 : KVL_KV_BF16; break;
    case O_CHUNK: chunk = atoi(optarg); break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (!prompt) { fprintf(stderr, "kvlingo run: a prompt is required (-p TEXT)\n\n"); usage(stderr); return 2; }
  if (max_tokens < 0 || chunk < 1) { fprintf(stderr, "kvlingo run: -n and --chunk must be positive\n"); return 2; }
  char *stdin_prompt = NULL;
  if (!strcmp(prompt, "-")) prompt = stdin_prompt = read_stdin();
  char *path = kvl_model_resolve(model);
  if (!path) {
    fprintf(stderr, "kvlingo run: no model '%s' (not a file, and no match in $KVLINGO_MODELS); run scripts/fetch-models\n", model);
    return 1;
  }
  char err[512];
  kvl_model_t *m;
  double t0 = now();
  if (kvl_model_open(path, &m, err, sizeof(err)) < 0) { fprintf(stderr, "kvlingo run: %s\n", err); return 1; }
  kvl_tokenizer_t *tk;
  if (kvl_tokenizer_from_gguf(kvl_model_gguf(m), &tk, err, sizeof(err)) < 0) {
    fprintf(stderr, "kvlingo run: %s: %s\n", path, err);
    return 1;
  }
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  fprintf(stderr, "kvlingo run: %s (%s, %d layers) on %s, loaded in %.2f s\n", hp->name, path, hp->n_layer,
          kvl_backend_name(kvl_backend_cpu()), now() - t0);

  /* prompt -> ids: with --chat through the model's template (specials recognised in the
   * template's output only; the user's text is escaped by construction) */
  int32_t *ids = NULL;
  size_t n_ids = 0;
  int rc;
  if (chat) {
    rc = kvl_chat_encode_user(m, tk, system, prompt, &ids, &n_ids, err, sizeof(err));
    if (rc < 0) { fprintf(stderr, "kvlingo run: %s\n", err); return 1; }
  } else {
    rc = kvl_tokenizer_encode(tk, prompt, strlen(prompt), false, &ids, &n_ids);
  }
  if (rc < 0 || n_ids == 0) {
    fprintf(stderr, "kvlingo run: cannot tokenize the prompt: %s\n", rc < 0 ? kvl_strerror(rc) : "empty prompt");
    return 1;
  }
  size_t n_ctx = n_ids + (size_t)max_tokens;
  if (n_ctx > (size_t)hp->n_ctx_train) {
    fprintf(stderr, "kvlingo run: prompt (%zu tokens) + %d new tokens exceed the model's context of %d\n", n_ids,
            max_tokens, hp->n_ctx_train);
    return 1;
  }
  kvl_sampler_t *smp;
  if (kvl_sampler_new(&sp, hp->n_vocab, 0, &smp, err, sizeof(err)) < 0) { fprintf(stderr, "kvlingo run: %s\n", err); return 2; }
  kvl_sampler_accept_prompt(smp, ids, n_ids);

  struct kvl_kv_layout kl = kvl_model_kv_layout(m, kvdt);
  int nb = (int)((n_ctx + KVL_KV_BLOCK) / KVL_KV_BLOCK);
  void *pool = calloc((size_t)nb, kvl_kv_block_bytes(&kl));
  int32_t *table = malloc((size_t)nb * sizeof(int32_t));
  if (!pool || !table) { fprintf(stderr, "kvlingo run: out of memory for the KV cache\n"); return 1; }
  for (int i = 0; i < nb; i++) table[i] = i;
  const int32_t *tables[] = {table};
  struct kvl_kv_view kv = {&kl, pool, tables, NULL, 0};
  float *logits = malloc((size_t)hp->n_vocab * sizeof(float));
  int32_t *pos = malloc((size_t)chunk * sizeof(int32_t)), *seq = calloc((size_t)chunk, sizeof(int32_t));
  int8_t *want = calloc((size_t)chunk, 1);
  kvl_backend_t *be = kvl_backend_cpu();

  if (!chat) fputs(prompt, stdout);
  fflush(stdout);
  double tp0 = now();
  for (size_t c0 = 0; c0 < n_ids; c0 += (size_t)chunk) {
    int T = (int)(n_ids - c0 < (size_t)chunk ? n_ids - c0 : (size_t)chunk);
    for (int t = 0; t < T; t++) { pos[t] = (int32_t)(c0 + t); want[t] = c0 + t == n_ids - 1; }
    struct kvl_batch b = {T, ids + c0, pos, seq, want};
    if ((rc = kvl_model_forward(m, be, &b, &kv, logits, NULL)) < 0) { fprintf(stderr, "forward: %s\n", kvl_strerror(rc)); return 1; }
  }
  double tp = now() - tp0;
  kvl_detok_t *dt = kvl_detok_new(tk, stops);
  int n_gen = 0;
  enum kvl_finish fin = KVL_FINISH_LENGTH;
  double tg0 = now();
  for (int32_t p = (int32_t)n_ids; n_gen < max_tokens; p++) {
    struct kvl_sample_info info;
    int32_t tok = kvl_sampler_sample(smp, logits, &info);
    if (tok < 0) { fprintf(stderr, "\nkvlingo run: sampling failed: %s\n", kvl_strerror(tok)); break; }
    kvl_sampler_accept(smp, tok);
    n_gen++;
    char *out;
    size_t ol;
    enum kvl_finish f = kvl_detok_push(dt, tok, &out, &ol);
    if (out) { fwrite(out, 1, ol, stdout); fflush(stdout); free(out); }
    if (f == KVL_FINISH_STOP) { fin = KVL_FINISH_STOP; break; }
    if (n_gen == max_tokens) break;
    pos[0] = p;
    want[0] = 1;
    struct kvl_batch b = {1, &tok, pos, seq, want};
    if ((rc = kvl_model_forward(m, be, &b, &kv, logits, NULL)) < 0) { fprintf(stderr, "forward: %s\n", kvl_strerror(rc)); return 1; }
  }
  if (fin == KVL_FINISH_LENGTH) {
    char *out;
    size_t ol;
    kvl_detok_flush(dt, &out, &ol);
    if (out) { fwrite(out, 1, ol, stdout); free(out); }
  }
  double tg = now() - tg0;
  printf("\n");
  fprintf(stderr, "\nkvlingo run: finish_reason=%s  prompt %zu tokens in %.2f s (%.1f t/s)  generated %d tokens in %.2f s (%.1f t/s)\n",
          fin == KVL_FINISH_STOP ? "stop" : "length", n_ids, tp, n_ids / tp, n_gen, tg, n_gen > 0 ? n_gen / tg : 0.0);
  kvl_detok_free(dt);
  kvl_sampler_free(smp);
  free(logits); free(pos); free(seq); free(want); free(pool); free(table); free(ids); free(path); free(stdin_prompt);
  kvl_tokenizer_free(tk);
  kvl_model_free(m);
  return 0;
}
