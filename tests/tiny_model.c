/* tiny_model.c — see tiny_model.h. Weight types are mixed on purpose (F32, F16, Q8_0,
 * Q5_0, Q4_0, Q4_K, Q6_K) so the tiny model runs every matmul path the real ones use. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_model.h"
#include "kvl_quant.h"
#include "kvl_test.h"
#include "tiny_model.h"

enum { E = 64, H = 4, KVH = 2, D = 16, F = 256, V = 300 };

struct gen {
  kvl_gguf_writer_t *w;
  const struct tiny_opts *o;
  unsigned long long s;
  int rc;
};

/* Random K-quant blocks with scales giving values of about +-scale. */
static void kquant_random(struct gen *g, uint32_t type, unsigned char *dst, size_t bytes, float scale) {
  size_t bs = kvl_type_traits(type)->type_size;
  for (size_t i = 0; i < bytes; i++) dst[i] = (unsigned char)kvl_test_rand(&g->s);
  for (size_t b = 0; b < bytes / bs; b++) {
    unsigned char *blk = dst + b * bs;
    if (type == KVL_TYPE_Q6_K) {
      uint16_t d = kvl_fp32_to_fp16(scale / (32.0f * 64.0f));
      for (int j = 0; j < 16; j++) blk[192 + j] = (unsigned char)(int8_t)(32 + j); /* scales */
      memcpy(blk + 208, &d, 2);
    } else { /* Q4_K, Q5_K: d, dmin */
      uint16_t d = kvl_fp32_to_fp16(scale / (15.0f * 40.0f)), dm = kvl_fp32_to_fp16(scale / 40.0f);
      memcpy(blk, &d, 2);
      memcpy(blk + 2, &dm, 2);
    }
  }
}

static void tensor(struct gen *g, const char *name, uint32_t type, int64_t cols, int64_t rows, float scale) {
  if (g->rc) return;
  if (g->o->skip_tensor && !strcmp(g->o->skip_tensor, name)) return;
  if (g->o->bad_shape && !strcmp(g->o->bad_shape, name)) rows += 1;
  int64_t n = cols * (rows ? rows : 1);
  size_t bytes = kvl_row_size(type, (uint64_t)cols) * (size_t)(rows ? rows : 1);
  unsigned char *dst = malloc(bytes);
  float *x = malloc((size_t)n * sizeof(float));
  if (type == KVL_TYPE_Q4_K || type == KVL_TYPE_Q6_K) {
    kquant_random(g, type, dst, bytes, scale);
  } else {
    for (int64_t i = 0; i < n; i++) x[i] = kvl_test_randf(&g->s) * scale;
    if (rows == 0 && strstr(name, "norm")) /* norms near 1 */
      for (int64_t i = 0; i < n; i++) x[i] = 1.0f + 0.2f * x[i] / scale;
    kvl_quant_row_ref(type, x, dst, n);
  }
  uint64_t ne[2] = {(uint64_t)cols, (uint64_t)rows};
  g->rc = kvl_gguf_add_tensor(g->w, name, type, rows ? 2 : 1, ne, dst, bytes);
  free(dst);
  free(x);
}

static int tokenizer_meta(kvl_gguf_writer_t *w, int n_vocab);

int tiny_qwen2(const struct tiny_opts *o, void **buf, size_t *len) {
  struct gen g = {kvl_gguf_writer_new(), o, o->seed ? o->seed : 12345, 0};
  if (!g.w) return KVL_ENOMEM;
  int n_layer = o->n_layer ? o->n_layer : 2;
  const char *arch = o->arch ? o->arch : "qwen2";
  char k[96];
  kvl_gguf_set_str(g.w, "general.architecture", arch);
  kvl_gguf_set_str(g.w, "general.name", "tiny-qwen2");
#define HP(key, val) (snprintf(k, sizeof(k), "%s." key, arch), kvl_gguf_set_u32(g.w, k, (val)))
  HP("block_count", (uint32_t)n_layer);
  HP("context_length", 4096);
  HP("embedding_length", E);
  HP("feed_forward_length", F);
  HP("attention.head_count", H);
  HP("attention.head_count_kv", KVH);
#undef HP
  snprintf(k, sizeof(k), "%s.rope.freq_base", arch);
  kvl_gguf_set_f32(g.w, k, 10000.0f);
  snprintf(k, sizeof(k), "%s.attention.layer_norm_rms_epsilon", arch);
  kvl_gguf_set_f32(g.w, k, 1e-6f);

  tensor(&g, "token_embd.weight", KVL_TYPE_Q8_0, E, V, 1.0f);
  tensor(&g, "output_norm.weight", KVL_TYPE_F32, E, 0, 1.0f);
  if (!o->tied) tensor(&g, "output.weight", KVL_TYPE_Q5_0, E, V, 0.3f);
  for (int i = 0; i < n_layer; i++) {
    char n[64];
#define T(suf, type, cols, rows, sc) (snprintf(n, sizeof(n), "blk.%d." suf, i), tensor(&g, n, type, cols, rows, sc))
    T("attn_norm.weight", KVL_TYPE_F32, E, 0, 1.0f);
    T("attn_q.weight", i % 2 ? KVL_TYPE_Q4_0 : KVL_TYPE_Q8_0, E, E, 0.25f);
    T("attn_q.bias", KVL_TYPE_F32, E, 0, 0.1f);
    T("attn_k.weight", KVL_TYPE_Q8_0, E, KVH * D, 0.25f);
    T("attn_k.bias", KVL_TYPE_F32, KVH * D, 0, 0.5f);
    T("attn_v.weight", KVL_TYPE_F16, E, KVH * D, 0.25f);
    T("attn_v.bias", KVL_TYPE_F32, KVH * D, 0, 0.1f);
    T("attn_output.weight", KVL_TYPE_Q5_0, E, E, 0.15f);
    T("ffn_norm.weight", KVL_TYPE_F32, E, 0, 1.0f);
    T("ffn_gate.weight", KVL_TYPE_Q8_0, E, F, 0.25f);
    T("ffn_up.weight", KVL_TYPE_F32, E, F, 0.25f);
    T("ffn_down.weight", i % 2 ? KVL_TYPE_Q6_K : KVL_TYPE_Q4_K, F, E, 0.1f);
#undef T
  }
  if (o->tokenizer && !g.rc) {
    g.rc = tokenizer_meta(g.w, V);
    if (!g.rc)
      g.rc = kvl_gguf_set_str(g.w, "tokenizer.chat_template",
                              "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                              "message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                              "{{ '<|im_start|>assistant\n' }}{% endif %}");
  }
  int rc = g.rc ? g.rc : kvl_gguf_writer_to_mem(g.w, buf, len);
  kvl_gguf_writer_free(g.w);
  return rc;
}

/* ---- tiny tokenizer ------------------------------------------------------------ */

static size_t cp_utf8(uint32_t cp, char *o) {
  if (cp < 0x80) { o[0] = (char)cp; return 1; }
  o[0] = (char)(0xc0 | cp >> 6);
  o[1] = (char)(0x80 | (cp & 0x3f));
  return 2;
}

/* the byte-level alphabet's character for byte b, as UTF-8 */
static void byte_char(int b, char out[4]) {
  int n = 0;
  uint32_t cp = 0;
  for (int x = 0; x <= b; x++) {
    bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    cp = printable ? (uint32_t)x : (uint32_t)(256 + n++);
  }
  out[cp_utf8(cp, out)] = 0;
}

int tiny_tokenizer_meta(void *writer) { return tokenizer_meta(writer, 0); }

/* The tiny vocabulary, padded with control tokens <|pad_N|> to n_vocab entries (0: none). */
static int tokenizer_meta(kvl_gguf_writer_t *w, int n_vocab) {
  enum { NB = 256 };
  static const char *const merges[][2] = {
    {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"\xc4\xa0", "w"}, {"o", "r"}, {"\xc4\xa0w", "or"},
    {"\xc4\xa0wor", "l"}, {"\xc4\xa0worl", "d"}, {"\xc4\xa0", "t"}, {"\xc4\xa0t", "h"}, {"\xc4\xa0th", "e"},
    {"d", "e"}, {"de", "f"}, {"\xc4\xa0", "\xc4\xa0"}, {"\xc4\xa0\xc4\xa0", "\xc4\xa0\xc4\xa0"},
    {"\xc3\x83", "\xc2\xa9"},                          /* bytes c3 a9: e-acute */
    {"\xc3\xb0", "\xc5\x81"}, {"\xc2\x9f", "\xc2\x98"}, {"\xc3\xb0\xc5\x81", "\xc2\x9f\xc2\x98"}, /* f0 9f 98 .. */
    {"i", "n"}, {"\xc4\xa0", "in"}, {"1", "2"}, {"\xc4\x8a", "\xc4\x8a"},
  };
  enum { NM = sizeof(merges) / sizeof(merges[0]) };
  static const char *const specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  enum { NT = NB + NM + 3, MAXV = 512 };
  const char *toks[MAXV];
  char store[NB + NM][64], pads[MAXV - NT][24];
  int32_t types[MAXV];
  int nt = NT;
  for (; nt < n_vocab && nt < MAXV; nt++) {
    snprintf(pads[nt - NT], sizeof(pads[0]), "<|pad_%d|>", nt - NT);
    toks[nt] = pads[nt - NT];
    types[nt] = 3;
  }
  for (int b = 0; b < NB; b++) { byte_char(b, store[b]); toks[b] = store[b]; types[b] = 1; }
  char mstore[NM][64];
  const char *mm[NM];
  for (int i = 0; i < NM; i++) {
    snprintf(store[NB + i], 64, "%s%s", merges[i][0], merges[i][1]);
    toks[NB + i] = store[NB + i];
    types[NB + i] = 1;
    snprintf(mstore[i], 64, "%s %s", merges[i][0], merges[i][1]);
    mm[i] = mstore[i];
  }
  for (int i = 0; i < 3; i++) { toks[NB + NM + i] = specials[i]; types[NB + NM + i] = 3; }
  int rc = kvl_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
  if (!rc) rc = kvl_gguf_set_str(w, "tokenizer.ggml.pre", "qwen2");
  if (!rc) rc = kvl_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)nt);
  if (!rc) rc = kvl_gguf_set_arr(w, "tokenizer.ggml.token_type", KVL_GGUF_I32, types, (uint64_t)nt);
  if (!rc) rc = kvl_gguf_set_arr_str(w, "tokenizer.ggml.merges", mm, NM);
  if (!rc) rc = kvl_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", NB + NM + 2);
  if (!rc) rc = kvl_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", NB + NM);
  return rc;
}

int tiny_tokenizer_gguf(void **buf, size_t *len) {
  kvl_gguf_writer_t *w = kvl_gguf_writer_new();
  if (!w) return KVL_ENOMEM;
  int rc = kvl_gguf_set_str(w, "general.architecture", "tokenizer-only");
  if (!rc) rc = tiny_tokenizer_meta(w);
  if (!rc) rc = kvl_gguf_writer_to_mem(w, buf, len);
  kvl_gguf_writer_free(w);
  return rc;
}

struct kvl_model *tiny_model_load(const struct tiny_opts *o, void **buf) {
  size_t len;
  KVL_ASSERT(tiny_qwen2(o, buf, &len) == 0);
  kvl_gguf_t *g;
  char err[256];
  KVL_ASSERT(kvl_gguf_open_mem(*buf, len, &g, err, sizeof(err)) == 0);
  kvl_model_t *m;
  KVL_ASSERT(kvl_model_from_gguf(g, "tiny", &m, err, sizeof(err)) == 0);
  return m;
}
