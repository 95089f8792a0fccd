/* chat.c — chat messages to tokens (see kvl_chat.h). Until the template interpreter
 * lands, only the ChatML family (Qwen) is rendered, by construction. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_chat.h"
#include "kvl_error.h"

static int fail(char *err, size_t errlen, int code, const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}

struct buf { int32_t *v; size_t n; };

static int append(struct buf *b, const kvl_tokenizer_t *tk, const char *s, bool special) {
  int32_t *ids;
  size_t n;
  int rc = kvl_tokenizer_encode(tk, s, strlen(s), special, &ids, &n);
  if (rc < 0) return rc;
  int32_t *nv = realloc(b->v, (b->n + n + 1) * sizeof(int32_t));
  if (!nv) { free(ids); return KVL_ENOMEM; }
  b->v = nv;
  memcpy(b->v + b->n, ids, n * sizeof(int32_t));
  b->n += n;
  free(ids);
  return 0;
}

int kvl_chat_encode_user(const kvl_model_t *m, const kvl_tokenizer_t *tk, const char *system, const char *user,
                         int32_t **ids, size_t *n_ids, char *err, size_t errlen) {
  const char *src;
  if (kvl_gguf_get_str(kvl_model_gguf(m), "tokenizer.chat_template", &src) < 0)
    return fail(err, errlen, KVL_ENOTSUP, "the model has no chat template");
  if (!strstr(src, "<|im_start|>"))
    return fail(err, errlen, KVL_ENOTSUP, "only ChatML templates are supported yet");
  struct buf b = {0};
  int rc = append(&b, tk, "<|im_start|>system\n", true);
  if (!rc) rc = append(&b, tk, system ? system : "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", false);
  if (!rc) rc = append(&b, tk, "<|im_end|>\n<|im_start|>user\n", true);
  if (!rc) rc = append(&b, tk, user, false);
  if (!rc) rc = append(&b, tk, "<|im_end|>\n<|im_start|>assistant\n", true);
  if (rc < 0) { free(b.v); return fail(err, errlen, rc, "cannot tokenize the conversation: %s", kvl_strerror(rc)); }
  *ids = b.v;
  *n_ids = b.n;
  return 0;
}
