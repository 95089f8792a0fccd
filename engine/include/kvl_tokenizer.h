/* kvl_tokenizer.h — byte-level BPE tokenizer built from a GGUF vocabulary (the GPT-2 /
 * Qwen2 family: tokenizer.ggml.model = "gpt2"), and the streaming detokenizer.
 *
 *   kvl_tokenizer_t *tk;
 *   if (kvl_tokenizer_from_gguf(g, &tk, err, sizeof(err)) < 0) die(err);
 *   int32_t *ids; size_t n;
 *   kvl_tokenizer_encode(tk, text, strlen(text), false, &ids, &n);   // user text: specials are plain text
 *   kvl_tokenizer_encode(tk, rendered_chat, len, true, &ids, &n);    // template output: specials recognised
 *   char *s; size_t sl;
 *   kvl_tokenizer_decode(tk, ids, n, false, &s, &sl);
 *   free(ids); free(s);
 *
 * Encoding: split on special tokens (control and user-defined entries of the vocabulary)
 * when asked, NFC-normalise each remaining segment (as the models' reference tokenizer
 * does), pre-tokenise with the Qwen2 regular expression (PCRE2, Unicode properties), map
 * bytes to the byte-level alphabet and apply the merges in rank order. Text must be valid
 * UTF-8 (KVL_EINVAL otherwise).
 */
#ifndef KVL_TOKENIZER_H
#define KVL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_gguf.h"

typedef struct kvl_tokenizer kvl_tokenizer_t;

/* Build from the GGUF's tokenizer.ggml.* metadata. The tokenizer copies what it needs:
 * g may be freed afterwards. Errors name the missing or malformed key. */
int kvl_tokenizer_from_gguf(const kvl_gguf_t *g, kvl_tokenizer_t **out, char *err, size_t errlen);
void kvl_tokenizer_free(kvl_tokenizer_t *tk);

int32_t kvl_tokenizer_n_vocab(const kvl_tokenizer_t *tk);
int32_t kvl_tokenizer_bos(const kvl_tokenizer_t *tk); /* -1 when none */
int32_t kvl_tokenizer_eos(const kvl_tokenizer_t *tk);
/* Id of a token by its vocabulary string ("<|im_end|>"), or -1. */
int32_t kvl_tokenizer_find(const kvl_tokenizer_t *tk, const char *token);
/* True for control / user-defined tokens (the ones split out with parse_special). */
bool kvl_tokenizer_is_special(const kvl_tokenizer_t *tk, int32_t id);
/* True for end-of-generation tokens (eos, <|im_end|>, <|endoftext|>, ...). */
bool kvl_tokenizer_is_eog(const kvl_tokenizer_t *tk, int32_t id);

/* Encode len bytes of UTF-8. *ids is malloc'd (caller frees). Returns 0, KVL_EINVAL for
 * invalid UTF-8, KVL_ENOMEM. */
int kvl_tokenizer_encode(const kvl_tokenizer_t *tk, const char *text, size_t len, bool parse_special,
                         int32_t **ids, size_t *n_ids);

/* As encode with parse_special, except inside the `n_literal` byte ranges literal[2k] ..
 * literal[2k+1] (sorted, disjoint), where special-token strings stay plain text. Used
 * for rendered chat templates: specials where the template wrote them, never inside a
 * message's content. Text is still pre-tokenised as one string across span edges. */
int kvl_tokenizer_encode_spans(const kvl_tokenizer_t *tk, const char *text, size_t len, bool parse_special,
                               const size_t *literal, size_t n_literal, int32_t **ids, size_t *n_ids);

/* The bytes a token stands for (byte-level decoded; specials as their text). Points into
 * the tokenizer; NULL for an id out of range. */
const char *kvl_tokenizer_token_bytes(const kvl_tokenizer_t *tk, int32_t id, size_t *len);

/* Decode ids to bytes (possibly not valid UTF-8 if the ids cut a character). *out is
 * malloc'd and NUL-terminated. skip_special drops control/user-defined tokens. */
int kvl_tokenizer_decode(const kvl_tokenizer_t *tk, const int32_t *ids, size_t n, bool skip_special,
                         char **out, size_t *len);

/* ---- streaming detokenizer ----------------------------------------------------------
 * Feeds generated ids one at a time and emits text that is safe to send: complete UTF-8
 * only, never a prefix of a stop string that may still complete. On a stop string the
 * text before it is emitted and generation should end with finish "stop"; an end token
 * ends it too (not emitted). */

enum kvl_finish { KVL_FINISH_NONE = 0, KVL_FINISH_STOP, KVL_FINISH_LENGTH };

typedef struct kvl_detok kvl_detok_t;

/* stops: NULL-terminated list of stop strings (copied), may be NULL. */
kvl_detok_t *kvl_detok_new(const kvl_tokenizer_t *tk, const char *const *stops);
void kvl_detok_free(kvl_detok_t *d);
/* Feed one id. Text ready to emit is appended to *out (malloc'd, NUL-terminated, may be
 * ""), caller frees. Returns KVL_FINISH_STOP when the id is an end token or completes a
 * stop string (then nothing after the stop is ever emitted), else KVL_FINISH_NONE. */
enum kvl_finish kvl_detok_push(kvl_detok_t *d, int32_t id, char **out, size_t *len);
/* End of generation for another reason (length): flush what is held back (incomplete
 * UTF-8 is replaced by U+FFFD, a held stop-string prefix is emitted). */
void kvl_detok_flush(kvl_detok_t *d, char **out, size_t *len);

#endif /* KVL_TOKENIZER_H */
