/* cli.h — subcommands of the `kvlingo` command (private to clients/cli). */
#ifndef KVL_CLI_H
#define KVL_CLI_H

int kvl_cli_info(int argc, char **argv);
int kvl_cli_run(int argc, char **argv);

#endif
