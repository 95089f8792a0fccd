/* detok.c — the streaming detokenizer: emits only complete UTF-8 and never a prefix of
 * a stop string that may still complete; cuts exactly at a stop string. */
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_tokenizer.h"

struct kvl_detok {
  const kvl_tokenizer_t *tk;
  char **stops;
  size_t *stop_len;
  int n_stops;
  char *pend;        /* bytes received, not yet emitted */
  size_t n, cap;
  bool done;
};

kvl_detok_t *kvl_detok_new(const kvl_tokenizer_t *tk, const char *const *stops) {
  kvl_detok_t *d = calloc(1, sizeof(*d));
  if (!d) return NULL;
  d->tk = tk;
  int n = 0;
  while (stops && stops[n]) n++;
  d->stops = calloc((size_t)n + 1, sizeof(char *));
  d->stop_len = calloc((size_t)n + 1, sizeof(size_t));
  if (!d->stops || !d->stop_len) { kvl_detok_free(d); return NULL; }
  for (int i = 0; i < n; i++) {
    if (!stops[i][0]) continue; /* an empty stop string would stop at once: ignored */
    d->stops[d->n_stops] = strdup(stops[i]);
    if (!d->stops[d->n_stops]) { kvl_detok_free(d); return NULL; }
    d->stop_len[d->n_stops++] = strlen(stops[i]);
  }
  return d;
}

void kvl_detok_free(kvl_detok_t *d) {
  if (!d) return;
  for (int i = 0; i < d->n_stops; i++) free(d->stops[i]);
  free(d->stops);
  free(d->stop_len);
  free(d->pend);
  free(d);
}

/* Length of the UTF-8 sequence starting with byte c, 0 for a byte that cannot start one. */
static int seq_len(uint8_t c) {
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) return 2;
  if (c >= 0xe0 && c <= 0xef) return 3;
  if (c >= 0xf0 && c <= 0xf4) return 4;
  return 0;
}

/* Is s[0..l) a valid sequence (continuation bytes and the first-continuation ranges
 * that exclude overlongs, surrogates and > U+10FFFF)? Checks only the bytes present. */
static bool seq_ok(const uint8_t *s, int have) {
  for (int i = 1; i < have; i++)
    if ((s[i] & 0xc0) != 0x80) return false;
  if (have >= 2) {
    if (s[0] == 0xe0 && s[1] < 0xa0) return false;
    if (s[0] == 0xed && s[1] > 0x9f) return false;
    if (s[0] == 0xf0 && s[1] < 0x90) return false;
    if (s[0] == 0xf4 && s[1] > 0x8f) return false;
  }
  return true;
}

/* Append src[0..n) to the output as valid UTF-8: invalid bytes become U+FFFD. Stops
 * before an incomplete final sequence unless `final`; returns bytes consumed. */
static size_t sanitize(const uint8_t *src, size_t n, bool final, char *dst, size_t *dl) {
  size_t i = 0, o = *dl;
  while (i < n) {
    int l = seq_len(src[i]);
    if (l == 0) { memcpy(dst + o, "\xef\xbf\xbd", 3); o += 3; i++; continue; }
    int have = (size_t)l <= n - i ? l : (int)(n - i);
    if (!seq_ok(src + i, have)) { memcpy(dst + o, "\xef\xbf\xbd", 3); o += 3; i++; continue; }
    if (have < l) {
      if (!final) break; /* may complete with the next token */
      memcpy(dst + o, "\xef\xbf\xbd", 3);
      o += 3;
      i = n;
      break;
    }
    memcpy(dst + o, src + i, (size_t)l);
    o += (size_t)l;
    i += (size_t)l;
  }
  *dl = o;
  return i;
}

/* Emit the first `upto` pending bytes (sanitised), keep the rest. */
static void emit(kvl_detok_t *d, size_t upto, bool final, char **out, size_t *len) {
  char *o = malloc(upto * 3 + 1); /* worst case: every byte becomes U+FFFD */
  size_t ol = 0;
  size_t used = o ? sanitize((const uint8_t *)d->pend, upto, final, o, &ol) : 0;
  if (used) memmove(d->pend, d->pend + used, d->n - used);
  d->n -= used;
  if (o) o[ol] = '\0';
  *out = o;
  *len = ol;
}

enum kvl_finish kvl_detok_push(kvl_detok_t *d, int32_t id, char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  if (d->done) { *out = calloc(1, 1); return KVL_FINISH_STOP; }
  if (kvl_tokenizer_is_eog(d->tk, id)) {
    d->done = true;
    emit(d, d->n, true, out, len);
    return KVL_FINISH_STOP;
  }
  size_t bl = 0;
  const char *b = kvl_tokenizer_token_bytes(d->tk, id, &bl);
  if (!b) bl = 0;
  if (d->n + bl + 1 > d->cap) {
    size_t nc = (d->n + bl + 1) * 2;
    char *np = realloc(d->pend, nc);
    if (!np) { *out = calloc(1, 1); return KVL_FINISH_NONE; }
    d->pend = np;
    d->cap = nc;
  }
  memcpy(d->pend + d->n, b, bl);
  d->n += bl;
  /* the earliest complete stop string ends generation; text before it is emitted */
  size_t cut = SIZE_MAX;
  for (int s = 0; s < d->n_stops; s++) {
    if (d->stop_len[s] > d->n) continue;
    for (size_t i = 0; i + d->stop_len[s] <= d->n; i++)
      if (!memcmp(d->pend + i, d->stops[s], d->stop_len[s])) { if (i < cut) cut = i; break; }
  }
  if (cut != SIZE_MAX) {
    d->done = true;
    emit(d, cut, true, out, len);
    d->n = 0;
    return KVL_FINISH_STOP;
  }
  /* hold back the longest suffix that is a proper prefix of some stop string */
  size_t hold = 0;
  for (int s = 0; s < d->n_stops; s++)
    for (size_t k = d->stop_len[s] - 1; k > hold; k--)
      if (k <= d->n && !memcmp(d->pend + d->n - k, d->stops[s], k)) { hold = k; break; }
  emit(d, d->n - hold, false, out, len);
  return KVL_FINISH_NONE;
}

void kvl_detok_flush(kvl_detok_t *d, char **out, size_t *len) {
  emit(d, d->n, true, out, len);
  d->done = true;
}
