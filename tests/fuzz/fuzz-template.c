/* fuzz-template.c — libFuzzer target for the chat-template interpreter (kvl_template.h).
 * A template comes from a model file, so it is untrusted: any input is either refused by
 * the parser with "template:LINE:COL: ..." or parsed, and a parsed template renders a
 * fixed conversation (with a tool and a tool call) either to text or to one of the
 * documented errors with a message; the limits of a render (steps, pool) hold. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvl_error.h"
#include "kvl_template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static json_t *context(void) {
  static json_t *ctx;
  if (!ctx) {
    json_error_t je;
    ctx = json_loads("{\"messages\": ["
                     "  {\"role\": \"system\", \"content\": \"You are terse.\"},"
                     "  {\"role\": \"user\", \"content\": \"Sum 2 and 3.\"},"
                     "  {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\","
                     "     \"function\": {\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}}]},"
                     "  {\"role\": \"tool\", \"name\": \"add\", \"content\": \"5\"},"
                     "  {\"role\": \"assistant\", \"content\": \"5, caf\\u00e9 \\u4e2d\"}],"
                     " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"add\","
                     "   \"parameters\": {\"type\": \"object\"}}}],"
                     " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}",
                     0, &je);
    KVL_ASSERT(ctx);
  }
  return ctx;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 1 << 16) return 0; /* chat templates are a few KB; keep runs fast */
  char *src = malloc(size + 1);
  KVL_ASSERT(src);
  memcpy(src, data, size);
  src[size] = 0;
  char err[256] = "";
  kvl_template_t *t = NULL;
  int rc = kvl_template_parse(src, &t, err, sizeof(err));
  free(src);
  if (rc < 0) {
    KVL_ASSERT(t == NULL);
    KVL_ASSERT(rc == KVL_EFORMAT || rc == KVL_ENOTSUP || rc == KVL_ENOMEM);
    KVL_ASSERT(err[0] != 0);
    return 0;
  }
  char *out = (char *)1;
  size_t len = 1;
  err[0] = 0;
  rc = kvl_template_render(t, context(), &out, &len, err, sizeof(err));
  if (rc == 0) {
    KVL_ASSERT(out && out[len] == 0);
    KVL_ASSERT(len <= KVL_TEMPLATE_MAX_RENDER_BYTES);
    free(out);
  } else {
    KVL_ASSERT(rc == KVL_EINVAL || rc == KVL_ERANGE || rc == KVL_ENOMEM);
    KVL_ASSERT(out == NULL && len == 0 && err[0] != 0);
  }
  kvl_template_free(t);
  return 0;
}
