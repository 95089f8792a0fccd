/* tiny_model.h — tiny synthetic Qwen2 models (random weights, real layout, several
 * quantisation types) written by our own GGUF writer, for the fast unit tier. */
#ifndef KVL_TINY_MODEL_H
#define KVL_TINY_MODEL_H

#include <stddef.h>
#include <stdint.h>

struct tiny_opts {
  const char *arch;        /* "qwen2" unless testing refusal */
  const char *skip_tensor; /* omit this tensor (refusal tests) */
  const char *bad_shape;   /* write this tensor with one row too many */
  int n_layer;             /* default 2 */
  int tied;                /* no output.weight */
  int tokenizer;           /* add the tiny vocabulary (padded to the model's 300) and a ChatML template */
  uint64_t seed;
};

/* Serialise a tiny model (n_embd 64, 4 heads over 2 KV heads of 16, n_ff 256, vocab 300)
 * into a malloc'd buffer. Returns 0 or a KVL_E* code. */
int tiny_qwen2(const struct tiny_opts *o, void **buf, size_t *len);

/* Write a tiny model (options o) and load it; *buf (malloc'd) holds the file the model
 * maps, freed by the caller after kvl_model_free. Aborts on any failure (tests only). */
struct kvl_model;
struct kvl_model *tiny_model_load(const struct tiny_opts *o, void **buf);

/* Add a tiny byte-level BPE vocabulary (tokenizer.ggml.*, model gpt2, pre qwen2) to a
 * writer: the 256 byte tokens, a few dozen merges (ASCII words, a 2-byte and a 4-byte
 * UTF-8 character), and the specials <|endoftext|>, <|im_start|>, <|im_end|>. */
int tiny_tokenizer_meta(void *writer);

/* A GGUF with only the tiny vocabulary, serialised into a malloc'd buffer. */
int tiny_tokenizer_gguf(void **buf, size_t *len);

#endif
