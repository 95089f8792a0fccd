/* tokenizer.c — byte-level BPE (GPT-2 / Qwen2 vocabularies from GGUF) and the streaming
 * detokenizer. See kvl_tokenizer.h for the contract. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uninorm.h>
#include <unistr.h>

#include "kvl_error.h"
#include "kvl_tokenizer.h"

/* The Qwen2 pre-tokenizer expression (as its tokenizer.json states it). */
static const char *const QWEN2_PATTERN =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

struct strmap { /* open addressing: string (in `keys`) -> int32 */
  const char **keys;
  uint32_t *klen;
  int32_t *vals;
  size_t mask;
};

struct pairmap { /* (left id, right id) -> rank, merged id */
  uint64_t *keys; /* 0 = empty; key = ((left+1) << 32) | (right+1) */
  int32_t *rank, *merged;
  size_t mask;
};

struct kvl_tokenizer {
  int32_t n_vocab;
  char **text;            /* vocabulary strings as stored (byte-level alphabet) */
  uint32_t *text_len;
  char **bytes;           /* what each token decodes to */
  uint32_t *bytes_len;
  uint8_t *type;
  struct strmap vocab;
  struct pairmap merges;
  int32_t byte_id[256];   /* token of each single byte */
  int32_t *specials;      /* control + user-defined ids, longest text first */
  int n_specials;
  int32_t bos, eos;
  bool *eog;
  pcre2_code *re;
};

static uint64_t fnv(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
  return h;
}

static uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static size_t table_size(size_t n) {
  size_t c = 16;
  while (c < n * 2) c *= 2;
  return c;
}

static int strmap_init(struct strmap *m, size_t n) {
  size_t c = table_size(n);
  m->keys = calloc(c, sizeof(*m->keys));
  m->klen = calloc(c, sizeof(*m->klen));
  m->vals = calloc(c, sizeof(*m->vals));
  m->mask = c - 1;
  return m->keys && m->klen && m->vals ? 0 : KVL_ENOMEM;
}

static int32_t strmap_get(const struct strmap *m, const char *s, size_t n) {
  for (size_t h = fnv(s, n) & m->mask;; h = (h + 1) & m->mask) {
    if (!m->keys[h]) return -1;
    if (m->klen[h] == n && !memcmp(m->keys[h], s, n)) return m->vals[h];
  }
}

/* Insert; an existing key keeps its first value (the lowest id, as the reference does). */
static void strmap_put(struct strmap *m, const char *s, size_t n, int32_t v) {
  for (size_t h = fnv(s, n) & m->mask;; h = (h + 1) & m->mask) {
    if (!m->keys[h]) { m->keys[h] = s; m->klen[h] = (uint32_t)n; m->vals[h] = v; return; }
    if (m->klen[h] == n && !memcmp(m->keys[h], s, n)) return;
  }
}

static uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)(a + 1) << 32) | (uint32_t)(b + 1); }

static bool pairmap_get(const struct pairmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged) {
  uint64_t k = pair_key(a, b);
  for (size_t h = mix64(k) & m->mask;; h = (h + 1) & m->mask) {
    if (!m->keys[h]) return false;
    if (m->keys[h] == k) { *rank = m->rank[h]; *merged = m->merged[h]; return true; }
  }
}

static void pairmap_put(struct pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
  uint64_t k = pair_key(a, b);
  for (size_t h = mix64(k) & m->mask;; h = (h + 1) & m->mask) {
    if (!m->keys[h]) { m->keys[h] = k; m->rank[h] = rank; m->merged[h] = merged; return; }
    if (m->keys[h] == k) return; /* first (lowest) rank wins */
  }
}

/* GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
 * shifted to code points 256.. in byte order. */
static void byte_alphabet(uint32_t cp_of_byte[256]) {
  int n = 0;
  for (int b = 0; b < 256; b++) {
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    cp_of_byte[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
  }
}

static size_t put_utf8(uint32_t cp, char *o) {
  if (cp < 0x80) { o[0] = (char)cp; return 1; }
  if (cp < 0x800) { o[0] = (char)(0xc0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
  o[0] = (char)(0xe0 | cp >> 12);
  o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
  o[2] = (char)(0x80 | (cp & 0x3f));
  return 3;
}

/* Decode a vocabulary string from the byte-level alphabet back to bytes; false when a
 * character is outside the alphabet (then the token is used as raw text). */
static bool unmap_bytes(const char *s, size_t n, const int16_t byte_of_cp[324], char *out, size_t *olen) {
  size_t o = 0;
  for (size_t i = 0; i < n;) {
    ucs4_t cp;
    int l = u8_mbtouc(&cp, (const uint8_t *)s + i, n - i);
    if (l <= 0 || cp >= 324 || byte_of_cp[cp] < 0) return false;
    out[o++] = (char)byte_of_cp[cp];
    i += (size_t)l;
  }
  *olen = o;
  return true;
}

void kvl_tokenizer_free(kvl_tokenizer_t *tk) {
  if (!tk) return;
  if (tk->text)
    for (int32_t i = 0; i < tk->n_vocab; i++) { free(tk->text[i]); free(tk->bytes[i]); }
  free(tk->text);
  free(tk->text_len);
  free(tk->bytes);
  free(tk->bytes_len);
  free(tk->type);
  free(tk->eog);
  free(tk->vocab.keys);
  free(tk->vocab.klen);
  free(tk->vocab.vals);
  free(tk->merges.keys);
  free(tk->merges.rank);
  free(tk->merges.merged);
  free(tk->specials);
  if (tk->re) pcre2_code_free(tk->re);
  free(tk);
}

static int cmp_special_len(const void *a, const void *b, void *ctx) {
  const kvl_tokenizer_t *tk = ctx;
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  if (tk->text_len[x] != tk->text_len[y]) return tk->text_len[x] > tk->text_len[y] ? -1 : 1;
  return x < y ? -1 : 1;
}

int kvl_tokenizer_from_gguf(const kvl_gguf_t *g, kvl_tokenizer_t **out, char *err, size_t errlen) {
  *out = NULL;
  const char *model;
  if (kvl_gguf_get_str(g, "tokenizer.ggml.model", &model) < 0)
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing metadata key 'tokenizer.ggml.model'");
  if (strcmp(model, "gpt2"))
    return kvl_errf(err, errlen, KVL_ENOTSUP, "tokenizer model '%s' is not supported yet (supported: gpt2 byte-level BPE)", model);
  const char *pre = "default";
  kvl_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
  if (strcmp(pre, "qwen2"))
    return kvl_errf(err, errlen, KVL_ENOTSUP, "pre-tokenizer '%s' is not supported yet (supported: qwen2)", pre);
  enum kvl_gguf_vtype et;
  uint64_t nv, nm, ntt;
  if (kvl_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &nv) < 0 || et != KVL_GGUF_STRING || nv == 0 || nv > (1u << 24))
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing or malformed 'tokenizer.ggml.tokens'");
  if (kvl_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &nm) < 0 || et != KVL_GGUF_STRING)
    return kvl_errf(err, errlen, KVL_EFORMAT, "missing or malformed 'tokenizer.ggml.merges'");
  bool have_types = kvl_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &ntt) == 0 && ntt == nv;

  kvl_tokenizer_t *tk = calloc(1, sizeof(*tk));
  if (!tk) return KVL_ENOMEM;
  int rc = KVL_ENOMEM;
  tk->n_vocab = (int32_t)nv;
  tk->text = calloc(nv, sizeof(char *));
  tk->text_len = calloc(nv, sizeof(uint32_t));
  tk->bytes = calloc(nv, sizeof(char *));
  tk->bytes_len = calloc(nv, sizeof(uint32_t));
  tk->type = calloc(nv, 1);
  tk->eog = calloc(nv, sizeof(bool));
  tk->specials = calloc(nv, sizeof(int32_t));
  if (!tk->text || !tk->text_len || !tk->bytes || !tk->bytes_len || !tk->type || !tk->eog || !tk->specials ||
      strmap_init(&tk->vocab, nv) < 0)
    goto fail;

  uint32_t cp_of_byte[256];
  int16_t byte_of_cp[324];
  byte_alphabet(cp_of_byte);
  memset(byte_of_cp, 0xff, sizeof(byte_of_cp));
  for (int b = 0; b < 256; b++) byte_of_cp[cp_of_byte[b]] = (int16_t)b;

  for (uint64_t i = 0; i < nv; i++) {
    const char *s;
    size_t n;
    kvl_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &n);
    int64_t ty = TT_NORMAL;
    if (have_types) kvl_gguf_arr_int(g, "tokenizer.ggml.token_type", i, &ty);
    tk->type[i] = (uint8_t)ty;
    if (!(tk->text[i] = malloc(n + 1)) || !(tk->bytes[i] = malloc(n + 1))) goto fail;
    memcpy(tk->text[i], s, n);
    tk->text[i][n] = '\0';
    tk->text_len[i] = (uint32_t)n;
    size_t bl;
    if (ty == TT_NORMAL && unmap_bytes(s, n, byte_of_cp, tk->bytes[i], &bl)) {
      tk->bytes_len[i] = (uint32_t)bl;
    } else {
      memcpy(tk->bytes[i], s, n);
      tk->bytes_len[i] = (uint32_t)n;
    }
    tk->bytes[i][tk->bytes_len[i]] = '\0';
    strmap_put(&tk->vocab, tk->text[i], n, (int32_t)i);
    if (ty == TT_CONTROL || ty == TT_USER) tk->specials[tk->n_specials++] = (int32_t)i;
  }
  qsort_r(tk->specials, (size_t)tk->n_specials, sizeof(int32_t), cmp_special_len, tk);
  for (int b = 0; b < 256; b++) {
    char tmp[4];
    size_t l = put_utf8(cp_of_byte[b], tmp);
    tk->byte_id[b] = strmap_get(&tk->vocab, tmp, l);
    if (tk->byte_id[b] < 0) { rc = kvl_errf(err, errlen, KVL_EFORMAT, "vocabulary lacks the token for byte 0x%02x", b); goto fail; }
  }

  /* merges "left right" -> (rank, id of left+right) */
  size_t c = table_size(nm);
  tk->merges.keys = calloc(c, sizeof(uint64_t));
  tk->merges.rank = calloc(c, sizeof(int32_t));
  tk->merges.merged = calloc(c, sizeof(int32_t));
  tk->merges.mask = c - 1;
  if (!tk->merges.keys || !tk->merges.rank || !tk->merges.merged) goto fail;
  char *buf = NULL;
  size_t bcap = 0;
  for (uint64_t i = 0; i < nm; i++) {
    const char *s;
    size_t n;
    kvl_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &n);
    const char *sp = memchr(s, ' ', n);
    if (!sp || sp == s || sp == s + n - 1) {
      free(buf);
      rc = kvl_errf(err, errlen, KVL_EFORMAT, "merge %llu ('%.*s') is not 'left right'", (unsigned long long)i, (int)(n > 40 ? 40 : n), s);
      goto fail;
    }
    size_t ll = (size_t)(sp - s), rl = n - ll - 1;
    int32_t a = strmap_get(&tk->vocab, s, ll), b = strmap_get(&tk->vocab, sp + 1, rl);
    if (n > bcap) { bcap = n * 2; char *nb = realloc(buf, bcap); if (!nb) { free(buf); goto fail; } buf = nb; }
    memcpy(buf, s, ll);
    memcpy(buf + ll, sp + 1, rl);
    int32_t m = strmap_get(&tk->vocab, buf, ll + rl);
    if (a < 0 || b < 0 || m < 0) continue; /* a merge into nothing we know: unusable, skip */
    pairmap_put(&tk->merges, a, b, (int32_t)i, m);
  }
  free(buf);

  int64_t v;
  tk->bos = kvl_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &v) == 0 && v >= 0 && v < (int64_t)nv ? (int32_t)v : -1;
  tk->eos = kvl_gguf_get_int(g, "tokenizer.ggml.eos_token_id", &v) == 0 && v >= 0 && v < (int64_t)nv ? (int32_t)v : -1;
  if (tk->eos >= 0) tk->eog[tk->eos] = true;
  static const char *const eog_names[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"};
  for (size_t i = 0; i < sizeof(eog_names) / sizeof(eog_names[0]); i++) {
    int32_t id = strmap_get(&tk->vocab, eog_names[i], strlen(eog_names[i]));
    if (id >= 0 && (tk->type[id] == TT_CONTROL || tk->type[id] == TT_USER)) tk->eog[id] = true;
  }

  int ec;
  PCRE2_SIZE eo;
  tk->re = pcre2_compile((PCRE2_SPTR)QWEN2_PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK,
                         &ec, &eo, NULL);
  if (!tk->re) { rc = kvl_errf(err, errlen, KVL_EINVAL, "pre-tokenizer pattern does not compile (PCRE2 error %d at %zu)", ec, (size_t)eo); goto fail; }
  pcre2_jit_compile(tk->re, PCRE2_JIT_COMPLETE); /* best effort: the interpreter works too */
  *out = tk;
  return 0;
fail:
  kvl_tokenizer_free(tk);
  if (rc == KVL_ENOMEM) kvl_errf(err, errlen, rc, "out of memory building the tokenizer");
  return rc;
}

int32_t kvl_tokenizer_n_vocab(const kvl_tokenizer_t *tk) { return tk->n_vocab; }
int32_t kvl_tokenizer_bos(const kvl_tokenizer_t *tk) { return tk->bos; }
int32_t kvl_tokenizer_eos(const kvl_tokenizer_t *tk) { return tk->eos; }
int32_t kvl_tokenizer_find(const kvl_tokenizer_t *tk, const char *s) { return strmap_get(&tk->vocab, s, strlen(s)); }
bool kvl_tokenizer_is_special(const kvl_tokenizer_t *tk, int32_t id) {
  return id >= 0 && id < tk->n_vocab && (tk->type[id] == TT_CONTROL || tk->type[id] == TT_USER);
}
bool kvl_tokenizer_is_eog(const kvl_tokenizer_t *tk, int32_t id) { return id >= 0 && id < tk->n_vocab && tk->eog[id]; }

const char *kvl_tokenizer_token_bytes(const kvl_tokenizer_t *tk, int32_t id, size_t *len) {
  if (id < 0 || id >= tk->n_vocab) return NULL;
  if (len) *len = tk->bytes_len[id];
  return tk->bytes[id];
}

/* ---- encoding ------------------------------------------------------------------------ */

struct ids { int32_t *v; size_t n, cap; };

static int ids_push(struct ids *a, int32_t x) {
  if (a->n == a->cap) {
    size_t nc = a->cap ? a->cap * 2 : 64;
    int32_t *nv = realloc(a->v, nc * sizeof(int32_t));
    if (!nv) return KVL_ENOMEM;
    a->v = nv;
    a->cap = nc;
  }
  a->v[a->n++] = x;
  return 0;
}

/* BPE over one pre-token: start from single bytes, merge the lowest-ranked adjacent pair
 * until none is in the merge table. */
static int bpe_piece(const kvl_tokenizer_t *tk, const uint8_t *s, size_t n, struct ids *out) {
  int32_t stack[64], *sym = n <= 64 ? stack : malloc(n * sizeof(int32_t));
  if (!sym) return KVL_ENOMEM;
  for (size_t i = 0; i < n; i++) sym[i] = tk->byte_id[s[i]];
  size_t m = n;
  for (;;) {
    int32_t best_rank = INT32_MAX, best_id = -1, r, id;
    size_t best = 0;
    for (size_t i = 0; i + 1 < m; i++)
      if (pairmap_get(&tk->merges, sym[i], sym[i + 1], &r, &id) && r < best_rank) {
        best_rank = r;
        best_id = id;
        best = i;
      }
    if (best_id < 0) break;
    /* merge every occurrence of this pair, left to right (as the reference does) */
    int32_t a = sym[best], b = sym[best + 1];
    size_t w = 0;
    for (size_t i = 0; i < m;) {
      if (i + 1 < m && sym[i] == a && sym[i + 1] == b && i >= best) { sym[w++] = best_id; i += 2; }
      else sym[w++] = sym[i++];
    }
    m = w;
  }
  int rc = 0;
  for (size_t i = 0; i < m && !rc; i++) rc = ids_push(out, sym[i]);
  if (sym != stack) free(sym);
  return rc;
}

/* One segment without specials: NFC, pre-tokenise, BPE each piece. */
static int encode_segment(const kvl_tokenizer_t *tk, const uint8_t *s, size_t n, struct ids *out) {
  if (n == 0) return 0;
  size_t nl = 0;
  uint8_t *norm = u8_normalize(UNINORM_NFC, s, n, NULL, &nl);
  if (!norm) return KVL_ENOMEM;
  pcre2_match_data *md = pcre2_match_data_create_from_pattern(tk->re, NULL);
  if (!md) { free(norm); return KVL_ENOMEM; }
  int rc = 0;
  size_t at = 0;
  while (at < nl && !rc) {
    int mr = pcre2_match(tk->re, norm, nl, at, PCRE2_NO_UTF_CHECK, md, NULL);
    size_t ms = nl, me = nl;
    if (mr >= 0) {
      PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
      ms = ov[0];
      me = ov[1];
    }
    if (ms > at) rc = bpe_piece(tk, norm + at, ms - at, out); /* unmatched gap: its own piece */
    if (!rc && me > ms) rc = bpe_piece(tk, norm + ms, me - ms, out);
    if (me == ms) { /* empty match (cannot happen with this pattern): step one character */
      if (ms >= nl) break;
      int l = u8_mblen(norm + ms, nl - ms);
      me = ms + (size_t)(l > 0 ? l : 1);
      if (!rc) rc = bpe_piece(tk, norm + ms, me - ms, out);
    }
    at = me;
  }
  pcre2_match_data_free(md);
  free(norm);
  return rc;
}

int kvl_tokenizer_encode(const kvl_tokenizer_t *tk, const char *text, size_t len, bool parse_special,
                         int32_t **ids_out, size_t *n_out) {
  return kvl_tokenizer_encode_spans(tk, text, len, parse_special, NULL, 0, ids_out, n_out);
}

/* Is byte i inside one of the literal spans (sorted [start, end) pairs)? */
static bool in_spans(const size_t *spans, size_t n_spans, size_t i) {
  for (size_t k = 0; k < n_spans; k++)
    if (i >= spans[2 * k] && i < spans[2 * k + 1]) return true;
  return false;
}

int kvl_tokenizer_encode_spans(const kvl_tokenizer_t *tk, const char *text, size_t len, bool parse_special,
                               const size_t *literal, size_t n_literal, int32_t **ids_out, size_t *n_out) {
  *ids_out = NULL;
  *n_out = 0;
  if (u8_check((const uint8_t *)text, len) != NULL) return KVL_EINVAL;
  struct ids out = {0};
  int rc = 0;
  size_t seg = 0;
  if (parse_special) {
    for (size_t i = 0; i < len && !rc;) {
      int32_t hit = -1;
      if ((text[i] == '<' || text[i] == '[') && !in_spans(literal, n_literal, i)) /* specials start so */
        for (int k = 0; k < tk->n_specials; k++) {
          int32_t id = tk->specials[k];
          if (tk->text_len[id] <= len - i && !memcmp(text + i, tk->text[id], tk->text_len[id]) &&
              !in_spans(literal, n_literal, i + tk->text_len[id] - 1)) { hit = id; break; }
        }
      if (hit < 0) { i++; continue; }
      rc = encode_segment(tk, (const uint8_t *)text + seg, i - seg, &out);
      if (!rc) rc = ids_push(&out, hit);
      i += tk->text_len[hit];
      seg = i;
    }
  }
  if (!rc) rc = encode_segment(tk, (const uint8_t *)text + seg, len - seg, &out);
  if (rc) { free(out.v); return rc; }
  *ids_out = out.v ? out.v : calloc(1, sizeof(int32_t));
  *n_out = out.n;
  return *ids_out ? 0 : KVL_ENOMEM;
}

int kvl_tokenizer_decode(const kvl_tokenizer_t *tk, const int32_t *ids, size_t n, bool skip_special, char **out,
                         size_t *len) {
  size_t total = 1;
  for (size_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= tk->n_vocab) return KVL_EINVAL;
    total += tk->bytes_len[ids[i]];
  }
  char *s = malloc(total), *p = s;
  if (!s) return KVL_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    if (skip_special && kvl_tokenizer_is_special(tk, ids[i])) continue;
    memcpy(p, tk->bytes[ids[i]], tk->bytes_len[ids[i]]);
    p += tk->bytes_len[ids[i]];
  }
  *p = '\0';
  *out = s;
  *len = (size_t)(p - s);
  return 0;
}
