/* fuzz-config.c — libFuzzer target for kvlingod's configuration reader
 * (kvld_config_load_mem over libyaml, then kvld_config_check): any input is either read
 * into a configuration whose counts are within their arrays and whose strings end inside
 * their fields, or refused with a message naming the place; the check then passes or
 * says why not. Nothing else: no crash, no read past a field, no leak. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "kvl_error.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ENDS(field) KVL_ASSERT(memchr((field), 0, sizeof(field)) != NULL)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static struct kvld_config c; /* ~40 KB: not on the fuzzer's stack */
  char err[512] = "";
  kvld_config_defaults(&c, "/src");
  int rc = kvld_config_load_mem(&c, data, size, "fuzz.yaml", err, sizeof(err));
  if (rc < 0) {
    KVL_ASSERT(!strncmp(err, "config fuzz.yaml", 16)); /* every refusal names the file */
    return 0;
  }
  KVL_ASSERT(rc == 0);
  KVL_ASSERT(c.n_models >= 0 && c.n_models <= KVLD_MAX_MODELS);
  KVL_ASSERT(c.n_translators >= 0 && c.n_translators <= KVLD_MAX_TRANSLATORS);
  ENDS(c.listen);
  ENDS(c.auth_token);
  ENDS(c.admin_token);
  ENDS(c.tls_cert);
  ENDS(c.tls_key);
  ENDS(c.log_level);
  ENDS(c.default_model);
  ENDS(c.spill_dir);
  ENDS(c.replica_id);
  ENDS(c.router.policy);
  ENDS(c.router.small);
  ENDS(c.router.large);
  for (int i = 0; i < c.n_models; i++) {
    ENDS(c.models[i].name);
    ENDS(c.models[i].path);
    ENDS(c.models[i].kv_dtype);
  }
  for (int i = 0; i < c.n_translators; i++) ENDS(c.translators[i]);
  err[0] = 0;
  if (kvld_config_check(&c, err, sizeof(err)) < 0) KVL_ASSERT(err[0] != 0);
  return 0;
}
