/* chat.c — chat messages to tokens through the chat template (see kvl_chat.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_chat.h"
#include "kvl_error.h"

/* Markers cannot occur in valid content: they use a private-use code point pair. */
#define MARK_OPEN "\xef\xb7\x90kvl"  /* U+FDD0 (a noncharacter) + "kvl" */
#define MARK_CLOSE "\xef\xb7\x91"    /* U+FDD1 */

static json_t *context_with(const json_t *ctx, const kvl_tokenizer_t *tk, bool markers) {
  json_t *c = json_deep_copy(ctx);
  if (!c) return NULL;
  const char *names[2] = {"bos_token", "eos_token"};
  int32_t ids[2] = {kvl_tokenizer_bos(tk), kvl_tokenizer_eos(tk)};
  for (int i = 0; i < 2; i++)
    if (!json_object_get(c, names[i])) {
      size_t l = 0;
      const char *s = ids[i] >= 0 ? kvl_tokenizer_token_bytes(tk, ids[i], &l) : "";
      json_object_set_new(c, names[i], json_stringn(s ? s : "", s ? l : 0));
    }
  if (markers) {
    json_t *msgs = json_object_get(c, "messages");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
      if (!json_is_string(json_object_get(m, "content"))) continue;
      char mk[48];
      snprintf(mk, sizeof(mk), MARK_OPEN "%zu" MARK_CLOSE, i);
      json_object_set_new(m, "content", json_string(mk));
    }
  }
  return c;
}

int kvl_chat_encode(const kvl_template_t *t, const kvl_tokenizer_t *tk, const json_t *context, int32_t **ids,
                    size_t *n_ids, char **text_out, bool *literal_ok, char *err, size_t errlen) {
  *ids = NULL;
  *n_ids = 0;
  if (text_out) *text_out = NULL;
  json_t *real_ctx = context_with(context, tk, false), *mark_ctx = context_with(context, tk, true);
  char *real = NULL, *marked = NULL, *rebuilt = NULL;
  size_t rl = 0, ml = 0, *spans = NULL, n_spans = 0;
  int rc;
  if (!real_ctx || !mark_ctx) { rc = kvl_errf(err, errlen, KVL_ENOMEM, "out of memory"); goto out; }
  if ((rc = kvl_template_render(t, real_ctx, &real, &rl, err, errlen)) < 0) goto out;
  bool ok = kvl_template_render(t, mark_ctx, &marked, &ml, NULL, 0) == 0;
  /* put the contents back at the markers, recording where they land */
  json_t *msgs = json_object_get(real_ctx, "messages");
  if (ok) {
    rebuilt = malloc(rl + 1);
    spans = malloc(sizeof(size_t) * 2 * (json_array_size(msgs) + 1) * 4);
    size_t cap_spans = (json_array_size(msgs) + 1) * 4, o = 0;
    ok = rebuilt && spans;
    for (size_t i = 0; ok && i < ml;) {
      if (ml - i >= strlen(MARK_OPEN) && !memcmp(marked + i, MARK_OPEN, strlen(MARK_OPEN))) {
        char *end;
        unsigned long k = strtoul(marked + i + strlen(MARK_OPEN), &end, 10);
        const char *content = json_string_value(json_object_get(json_array_get(msgs, k), "content"));
        size_t cl = content ? strlen(content) : 0;
        if (!content || strncmp(end, MARK_CLOSE, strlen(MARK_CLOSE)) || o + cl > rl || n_spans == cap_spans ||
            memcmp(real + o, content, cl)) { ok = false; break; }
        memcpy(rebuilt + o, content, cl);
        spans[2 * n_spans] = o;
        spans[2 * n_spans + 1] = o + cl;
        n_spans++;
        o += cl;
        i = (size_t)(end - marked) + strlen(MARK_CLOSE);
      } else {
        if (o >= rl || real[o] != marked[i]) { ok = false; break; }
        rebuilt[o++] = marked[i++];
      }
    }
    ok = ok && o == rl;
  }
  if (literal_ok) *literal_ok = ok;
  rc = kvl_tokenizer_encode_spans(tk, real, rl, true, ok ? spans : NULL, ok ? n_spans : 0, ids, n_ids);
  if (rc < 0) kvl_errf(err, errlen, rc, "cannot tokenize the rendered conversation: %s", kvl_strerror(rc));
  if (rc == 0 && text_out) { *text_out = real; real = NULL; }
out:
  free(real);
  free(marked);
  free(rebuilt);
  free(spans);
  json_decref(real_ctx);
  json_decref(mark_ctx);
  return rc;
}

int kvl_chat_encode_user(const kvl_model_t *m, const kvl_tokenizer_t *tk, const char *system, const char *user,
                         int32_t **ids, size_t *n_ids, char *err, size_t errlen) {
  const char *src;
  if (kvl_gguf_get_str(kvl_model_gguf(m), "tokenizer.chat_template", &src) < 0)
    return kvl_errf(err, errlen, KVL_ENOTSUP, "the model has no chat template (tokenizer.chat_template)");
  kvl_template_t *t;
  int rc = kvl_template_parse(src, &t, err, errlen);
  if (rc < 0) return rc;
  json_t *msgs = json_array();
  if (system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content", system));
  json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", user));
  json_t *ctx = json_pack("{s:o,s:b}", "messages", msgs, "add_generation_prompt", 1);
  rc = kvl_chat_encode(t, tk, ctx, ids, n_ids, NULL, NULL, err, errlen);
  json_decref(ctx);
  kvl_template_free(t);
  return rc;
}
