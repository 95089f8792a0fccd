/* cli.h — subcommands of the `kvlingo` command (private to clients/cli). */
#ifndef KVL_CLI_H
#define KVL_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "kvl_model.h"
#include "kvl_tokenizer.h"
#include "kvl_translator.h"

int kvl_cli_info(int argc, char **argv);
int kvl_cli_run(int argc, char **argv);
int kvl_cli_fit(int argc, char **argv);
int kvl_cli_eval(int argc, char **argv);
int kvl_cli_distill(int argc, char **argv);
int kvl_cli_generate(int argc, char **argv);
int kvl_cli_chat(int argc, char **argv);
int kvl_cli_models(int argc, char **argv);
int kvl_cli_health(int argc, char **argv);

/* A model opened for fit / eval: file, tokenizer, fingerprint, and a short name from the
 * file ("qwen2.5-coder-0.5b" for qwen2.5-coder-0.5b-instruct-q4_k_m.gguf). */
struct kvl_cli_model {
  char *path, short_name[128];
  kvl_model_t *m;
  kvl_tokenizer_t *tk;
  struct kvl_model_fingerprint fp;
  int L;      /* layers */
  int64_t w;  /* KV width of a layer */
};
/* arg: a path or a name in $KVLINGO_MODELS (kvl_model_resolve). Close even on failure. */
int kvl_cli_model_open(struct kvl_cli_model *s, const char *arg, char *err, size_t errlen);
void kvl_cli_model_close(struct kvl_cli_model *s);
/* Monotonic seconds. */
double kvl_cli_now(void);
/* A progress bar with ETA on stderr (redrawn on a terminal, every 5% otherwise). */
void kvl_cli_progress(const char *what, int64_t done, int64_t total, double t0);

#endif
