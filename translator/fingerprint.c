/* fingerprint.c — a model's fingerprint read from its GGUF metadata (see
 * kvl_fingerprint_from_gguf in kvl_translator.h for the exact keys and hash). */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "translator-impl.h"

static int req_int(const kvl_gguf_t *g, const char *arch, const char *suffix, int64_t lo, int64_t hi, int64_t *out,
                   char *err, size_t errlen) {
  char key[160];
  snprintf(key, sizeof(key), "%s.%s", arch, suffix);
  int rc = kvl_gguf_get_int(g, key, out);
  if (rc == KVL_ENOENT) return kvl_errf(err, errlen, KVL_EFORMAT, "missing metadata key '%s'", key);
  if (rc < 0) return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is not an integer", key);
  if (*out < lo || *out > hi)
    return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is %lld, outside %lld..%lld", key,
                        (long long)*out, (long long)lo, (long long)hi);
  return 0;
}

/* 0 and *out, or KVL_ENOENT when absent; other failures named. */
static int opt_int(const kvl_gguf_t *g, const char *arch, const char *suffix, int64_t lo, int64_t hi, int64_t *out,
                   char *err, size_t errlen) {
  char key[160];
  snprintf(key, sizeof(key), "%s.%s", arch, suffix);
  if (kvl_gguf_find_key(g, key) < 0) return KVL_ENOENT;
  return req_int(g, arch, suffix, lo, hi, out, err, errlen);
}

int kvl_fingerprint_from_gguf(const struct kvl_gguf *g, struct kvl_model_fingerprint *fp, char *err,
                              size_t errlen) {
  KVL_ASSERT(g && fp);
  memset(fp, 0, sizeof(*fp));
  const char *arch, *s;
  if (kvl_gguf_get_str(g, "general.architecture", &arch) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing string 'general.architecture'");
  if (!arch[0] || strlen(arch) >= sizeof(fp->architecture))
    return kvl_errf(err, errlen, KVL_EFORMAT, "general.architecture '%.80s' is empty or too long", arch);
  memcpy(fp->architecture, arch, strlen(arch) + 1);

  int64_t n_layer, n_kv, n_embd, n_head, kl, vl;
  int rc;
  if ((rc = req_int(g, arch, "block_count", 1, KVL__TR_MAX_LAYERS, &n_layer, err, errlen)) ||
      (rc = req_int(g, arch, "attention.head_count_kv", 1, KVL__TR_MAX_HEADS, &n_kv, err, errlen)))
    return rc;
  rc = opt_int(g, arch, "attention.key_length", 1, KVL__TR_MAX_HEAD_DIM, &kl, err, errlen);
  if (rc == KVL_ENOENT) {
    if ((rc = req_int(g, arch, "embedding_length", 1, INT32_MAX, &n_embd, err, errlen)) ||
        (rc = req_int(g, arch, "attention.head_count", 1, KVL__TR_MAX_HEADS, &n_head, err, errlen)))
      return rc;
    if (n_embd % n_head)
      return kvl_errf(err, errlen, KVL_EFORMAT, "embedding width %lld is not a multiple of the %lld heads",
                          (long long)n_embd, (long long)n_head);
    kl = n_embd / n_head;
  } else if (rc < 0) {
    return rc;
  }
  rc = opt_int(g, arch, "attention.value_length", 1, KVL__TR_MAX_HEAD_DIM, &vl, err, errlen);
  if (rc < 0 && rc != KVL_ENOENT) return rc;
  if (rc == 0 && vl != kl)
    return kvl_errf(err, errlen, KVL_ENOTSUP, "key head width %lld differs from value head width %lld",
                        (long long)kl, (long long)vl);
  fp->n_layer = (int32_t)n_layer;
  fp->n_kv_head = (int32_t)n_kv;
  fp->head_dim = (int32_t)kl;

  char key[160];
  snprintf(key, sizeof(key), "%s.rope.freq_base", arch);
  fp->rope_theta = 10000.0;
  if (kvl_gguf_find_key(g, key) >= 0 && kvl_gguf_get_float(g, key, &fp->rope_theta) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is not a number", key);

  /* RoPE scaling: "none", or "<type>:<factor>" */
  double factor = 0;
  snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
  if (kvl_gguf_find_key(g, key) >= 0 && kvl_gguf_get_float(g, key, &factor) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is not a number", key);
  snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
  double lin = 0;
  char lkey[160];
  snprintf(lkey, sizeof(lkey), "%s.rope.scale_linear", arch);
  if (kvl_gguf_get_str(g, key, &s) == 0 && strcmp(s, "none")) {
    if (strlen(s) > 32) return kvl_errf(err, errlen, KVL_EFORMAT, "metadata key '%s' is too long", key);
    if (factor > 0) snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "%s:%g", s, factor);
    else snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "%s", s);
  } else if (kvl_gguf_get_float(g, lkey, &lin) == 0 && lin != 1.0) {
    snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "linear:%g", lin);
  } else {
    snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "none");
  }

  /* tokenizer: FNV-1a 64 over (u64 LE length, bytes) of every token, in order */
  enum kvl_gguf_vtype et;
  uint64_t n_tok;
  if (kvl_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n_tok) < 0 || et != KVL_GGUF_STRING)
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing string array 'tokenizer.ggml.tokens'");
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n_tok; i++) {
    size_t len;
    if (kvl_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len) < 0)
      return kvl_errf(err, errlen, KVL_EFORMAT, "tokenizer.ggml.tokens[%llu] is unreadable",
                          (unsigned long long)i);
    for (int b = 0; b < 8; b++) h = (h ^ (uint8_t)((uint64_t)len >> (8 * b))) * 1099511628211ull;
    for (size_t j = 0; j < len; j++) h = (h ^ (uint8_t)s[j]) * 1099511628211ull;
  }
  snprintf(fp->tokenizer_hash, sizeof(fp->tokenizer_hash), "%016llx", (unsigned long long)h);

  /* name: informational; truncated, and made ASCII if it is not valid UTF-8 */
  if (kvl_gguf_get_str(g, "general.name", &s) == 0) {
    snprintf(fp->name, sizeof(fp->name), "%s", s);
    json_t *j = json_string(fp->name);
    if (!j)
      for (char *c = fp->name; *c; c++)
        if ((unsigned char)*c >= 0x80) *c = '?';
    json_decref(j);
  }
  char sub[200];
  if ((rc = kvl_fingerprint_validate(fp, sub, sizeof(sub))) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "%s", sub);
  return 0;
}
