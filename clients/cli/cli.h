/* cli.h — subcommands of the `kvlingo` command (private to clients/cli). */
#ifndef KVL_CLI_H
#define KVL_CLI_H

#include <stdint.h>

int kvl_cli_info(int argc, char **argv);
int kvl_cli_run(int argc, char **argv);
int kvl_cli_fit(int argc, char **argv);
int kvl_cli_eval(int argc, char **argv);
int kvl_cli_generate(int argc, char **argv);
int kvl_cli_chat(int argc, char **argv);
int kvl_cli_models(int argc, char **argv);
int kvl_cli_health(int argc, char **argv);

/* Monotonic seconds. */
double kvl_cli_now(void);
/* A progress bar with ETA on stderr (redrawn on a terminal, every 5% otherwise). */
void kvl_cli_progress(const char *what, int64_t done, int64_t total, double t0);

#endif
