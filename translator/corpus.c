/* corpus.c — fitting and evaluation samples from the committed corpus split
 * (translator/corpus/split.tsv, written by scripts/make-corpus). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "kvl_chat.h"
#include "kvl_error.h"
#include "kvl_fit.h"
#include "kvl_template.h"

void kvl_samples_free(struct kvl_sample *s, int32_t n) {
  if (!s) return;
  for (int32_t i = 0; i < n; i++) free(s[i].ids);
  free(s);
}

static int read_file(const char *path, long want, char **out, size_t *len, char *err, size_t errlen) {
  struct stat st;
  if (stat(path, &st) < 0)
    return kvl_errf(err, errlen, KVL_ENOENT, "corpus file %s: %s (rerun scripts/setup; the split lists Debian's files)",
                    path, strerror(errno));
  if (st.st_size != want)
    return kvl_errf(err, errlen, KVL_EMISMATCH,
                    "corpus file %s has %lld bytes, the split says %ld: the corpus changed (scripts/make-corpus)",
                    path, (long long)st.st_size, want);
  FILE *f = fopen(path, "rb");
  if (!f) return kvl_errf(err, errlen, KVL_EIO, "corpus file %s: %s", path, strerror(errno));
  char *buf = malloc((size_t)want + 1);
  if (!buf) {
    fclose(f);
    return KVL_ENOMEM;
  }
  size_t got = fread(buf, 1, (size_t)want, f);
  fclose(f);
  if ((long)got != want) {
    free(buf);
    return kvl_errf(err, errlen, KVL_EIO, "corpus file %s: short read", path);
  }
  buf[want] = 0;
  *out = buf;
  *len = got;
  return 0;
}

/* Move i back to the start of a UTF-8 character. */
static size_t char_start(const char *s, size_t i) {
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
  return i;
}

/* A chat sample from bytes [b0, b1) of a file: first half as the user's message, second
 * half as the assistant's answer, cut at a line break near the middle. */
static int chat_sample(const kvl_template_t *tmpl, const kvl_tokenizer_t *tk, const char *text, size_t b0, size_t b1,
                       int32_t **ids, size_t *n, char *err, size_t errlen) {
  size_t mid = b0 + (b1 - b0) / 2;
  for (size_t k = mid; k < b1 && k < mid + 200; k++)
    if (text[k] == '\n') {
      mid = k + 1;
      break;
    }
  mid = char_start(text, mid);
  char *user = malloc(mid - b0 + 32);
  if (!user) return KVL_ENOMEM;
  int ul = sprintf(user, "Continue this file:\n\n");
  memcpy(user + ul, text + b0, mid - b0);
  user[ul + (mid - b0)] = 0;
  json_t *msgs = json_array();
  json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", user));
  json_array_append_new(msgs, json_pack("{s:s,s:s%}", "role", "assistant", "content", text + mid, b1 - mid));
  json_t *ctx = json_pack("{s:o,s:b}", "messages", msgs, "add_generation_prompt", 0);
  free(user);
  int rc = kvl_chat_encode(tmpl, tk, ctx, ids, n, NULL, NULL, err, errlen);
  json_decref(ctx);
  return rc;
}

int kvl_corpus_samples(const struct kvl_corpus_opts *o, const kvl_tokenizer_t *tk, struct kvl_sample **out,
                       int32_t *n_out, char *err, size_t errlen) {
  *out = NULL;
  *n_out = 0;
  if (!o || !o->split_tsv || !o->split || o->ctx < 2 || o->max_per_file < 1)
    return kvl_errf(err, errlen, KVL_EINVAL, "corpus options: split file, split, ctx >= 2 and max_per_file >= 1 needed");
  kvl_template_t *tmpl = NULL;
  if (o->chat_every > 0) {
    const char *src;
    if (!o->chat_model || kvl_gguf_get_str(kvl_model_gguf(o->chat_model), "tokenizer.chat_template", &src) < 0)
      return kvl_errf(err, errlen, KVL_EINVAL, "chat samples need a model with a chat template");
    int rc = kvl_template_parse(src, &tmpl, err, errlen);
    if (rc < 0) return rc;
  }
  FILE *f = fopen(o->split_tsv, "r");
  if (!f) {
    kvl_template_free(tmpl);
    return kvl_errf(err, errlen, KVL_ENOENT, "corpus split %s: %s", o->split_tsv, strerror(errno));
  }
  struct kvl_sample *v = NULL;
  int32_t n = 0, cap = 0, file = -1;
  int64_t tokens = 0;
  int rc = 0, lineno = 0;
  char line[8192];
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    if (line[0] == '#' || line[0] == '\n') continue;
    line[strcspn(line, "\n")] = 0;
    char *split = strtok(line, "\t"), *dom = strtok(NULL, "\t"), *bytes = strtok(NULL, "\t"),
         *path = strtok(NULL, "\t");
    if (!split || !dom || !bytes || !path) {
      rc = kvl_errf(err, errlen, KVL_EFORMAT, "%s:%d: expected split, domain, bytes, path", o->split_tsv, lineno);
      break;
    }
    if (strcmp(split, o->split) != 0 || (o->domain && strcmp(dom, o->domain) != 0)) continue;
    file++;
    char *text = NULL;
    size_t len = 0;
    if ((rc = read_file(path, atol(bytes), &text, &len, err, errlen)) < 0) break;
    int32_t *ids;
    size_t nid;
    if ((rc = kvl_tokenizer_encode(tk, text, len, false, &ids, &nid)) < 0) {
      free(text);
      rc = kvl_errf(err, errlen, rc, "corpus file %s: not valid UTF-8", path);
      break;
    }
    double bytes_per_tok = nid ? (double)len / nid : 4.0;
    for (int32_t k = 0; k < o->max_per_file; k++) {
      size_t t0 = (size_t)k * o->ctx;
      if (t0 + o->min_tokens > nid) break;
      if (n == cap) {
        cap = cap ? 2 * cap : 64;
        struct kvl_sample *nv = realloc(v, (size_t)cap * sizeof(*v));
        if (!nv) {
          rc = KVL_ENOMEM;
          break;
        }
        v = nv;
      }
      struct kvl_sample *s = &v[n];
      memset(s, 0, sizeof(*s));
      snprintf(s->domain, sizeof(s->domain), "%s", dom);
      s->file = file;
      size_t tn = nid - t0 < (size_t)o->ctx ? nid - t0 : (size_t)o->ctx;
      if (tmpl && n % o->chat_every == o->chat_every - 1) {
        size_t b0 = char_start(text, (size_t)(t0 * bytes_per_tok));
        size_t b1 = (size_t)((t0 + tn) * bytes_per_tok);
        b1 = b1 >= len ? len : char_start(text, b1);
        int32_t *cid = NULL;
        size_t cn = 0;
        if (b1 > b0 + 64 && chat_sample(tmpl, tk, text, b0, b1, &cid, &cn, err, errlen) == 0) {
          if (cn < (size_t)o->min_tokens) { /* the byte estimate fell short: the plain sample instead */
            free(cid);
            cid = NULL;
          }
        }
        if (cid) {
          s->ids = cid;
          s->n = (int32_t)(cn < (size_t)o->ctx ? cn : (size_t)o->ctx);
          s->chat = true;
        }
      }
      if (!s->ids) {
        s->ids = malloc(tn * sizeof(int32_t));
        if (!s->ids) {
          rc = KVL_ENOMEM;
          break;
        }
        memcpy(s->ids, ids + t0, tn * sizeof(int32_t));
        s->n = (int32_t)tn;
      }
      tokens += s->n;
      n++;
      if (o->max_tokens && tokens >= o->max_tokens) break;
    }
    free(ids);
    free(text);
    if (rc < 0 || (o->max_tokens && tokens >= o->max_tokens)) break;
  }
  fclose(f);
  kvl_template_free(tmpl);
  if (rc < 0) {
    kvl_samples_free(v, n);
    return rc;
  }
  if (n == 0) {
    kvl_samples_free(v, n);
    return kvl_errf(err, errlen, KVL_ENOENT, "%s: no files of split '%s'%s%s", o->split_tsv, o->split,
                    o->domain ? ", domain " : "", o->domain ? o->domain : "");
  }
  *out = v;
  *n_out = n;
  return 0;
}
