/* main.c — the `kvlingo` command: dispatch to subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

struct cmd {
  const char *name;
  int (*fn)(int argc, char **argv);
  const char *help;
};

static const struct cmd cmds[] = {
  {"run", kvl_cli_run, "generate text from a model file, in this process"},
  {"info", kvl_cli_info, "show a GGUF model's metadata and tensors"},
    {"fit", kvl_cli_fit, "fit closed-form KV translators between two models (stage 1)"},
    {"distill", kvl_cli_distill, "train a translator by self-distillation through the target (stage 2)"},
    {"eval", kvl_cli_eval, "score translators on held-out text against native caches"},
    {"generate", kvl_cli_generate, "stream a completion from a running kvlingod (gRPC)"},
    {"chat", kvl_cli_chat, "interactive chat with a running kvlingod, history kept"},
    {"models", kvl_cli_models, "list a kvlingod's models and translators"},
    {"health", kvl_cli_health, "check a kvlingod's health (exit 0 when serving)"},
};

static void usage(FILE *f) {
  fprintf(f,
          "usage: kvlingo <command> [options]\n"
          "\n"
          "kvlingo serves several LLMs at once and moves conversations between them by\n"
          "translating KV caches. Commands:\n\n");
  for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
    fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
  fprintf(f,
          "\n"
          "Run 'kvlingo <command> --help' for a command's options.\n"
          "Models: scripts/fetch-models puts them in $KVLINGO_MODELS (~/.cache/kvlingo/models).\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version")) {
    puts("kvlingo 0.1.0");
    return 0;
  }
  for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
    if (!strcmp(argv[1], cmds[i].name)) return cmds[i].fn(argc - 1, argv + 1);
  fprintf(stderr, "kvlingo: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
