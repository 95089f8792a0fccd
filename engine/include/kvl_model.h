/* kvl_model.h — a model loaded from GGUF and its forward pass over a paged KV cache.
 *
 *   char err[256];
 *   kvl_model_t *m;
 *   if (kvl_model_open("qwen.gguf", &m, err, sizeof(err)) < 0) die(err);
 *   const struct kvl_model_hparams *hp = kvl_model_hparams(m);
 *   struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_BF16);
 *   void *pool = calloc(n_blocks, kvl_kv_block_bytes(&kl));     // the scheduler owns this later
 *   int32_t table[] = {0, 1, 2};                                  // sequence 0's blocks
 *   const int32_t *tables[] = {table};
 *   struct kvl_kv_view kv = {&kl, pool, tables};
 *   struct kvl_batch b = {.n_tokens = n, .tokens = ids, .pos = pos, .seq = seq, .logits = want};
 *   float *logits = malloc(n_wanted * hp->n_vocab * sizeof(float));
 *   kvl_model_forward(m, kvl_backend_cpu(), &b, &kv, logits, NULL);
 *
 * A batch mixes sequences freely: prefill chunks (several consecutive positions of one
 * sequence) and single decode tokens. For every token, positions 0 .. pos-1 of its
 * sequence must already be in the cache or earlier in the same batch; the forward
 * writes each token's K (after RoPE) and V at its position, then attends causally.
 *
 * Ownership: the model maps its file read-only and owns it until kvl_model_free; the
 * forward allocates its scratch per call and frees it before returning.
 */
#ifndef KVL_MODEL_H
#define KVL_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_gguf.h"
#include "kvl_kernels.h"

typedef struct kvl_model kvl_model_t;

struct kvl_model_hparams {
  char arch[32];        /* general.architecture ("qwen2") */
  char name[128];       /* general.name, or the file name */
  int n_layer;
  int n_embd;           /* residual width */
  int n_ff;             /* MLP hidden width */
  int n_head;           /* query heads */
  int n_kv_head;        /* KV heads (grouped-query attention) */
  int head_dim;
  int n_vocab;
  int n_ctx_train;      /* context length the model was trained for */
  float rope_theta;
  float rms_eps;
  bool tied_output;     /* no output.weight: the embedding table is the output head */
};

/* Open a GGUF file and check it is a model we can run: architecture, every tensor
 * present with its shape and a dequantisable type. Errors name what is wrong. The weights
 * are read into 2 MiB pages (KVL_GGUF_HUGEPAGES); KVL_WEIGHTS=mmap maps the file instead
 * (shared page cache, nothing read up front). */
int kvl_model_open(const char *path, kvl_model_t **out, char *err, size_t errlen);
/* The same from an opened GGUF; on success the model owns g (freed with the model). */
int kvl_model_from_gguf(kvl_gguf_t *g, const char *name, kvl_model_t **out, char *err, size_t errlen);
void kvl_model_free(kvl_model_t *m);
/* MODEL as given when it is a readable file, else the first (by name) *.gguf in
 * $KVLINGO_MODELS (default ~/.cache/kvlingo/models) whose file name starts with MODEL
 * ("qwen2.5-coder-0.5b"). A malloc'd path, or NULL when nothing matches. */
char *kvl_model_resolve(const char *m);

/* Let be make now the copies of the product weights it would make at their first use
 * (kvl_backend_prepare: on a CPU with AVX-512 VNNI, Q5_0 rearranged for decode); returns
 * the bytes of the copies the model's weights then have. The daemon and the benchmarks
 * call it after loading. */
size_t kvl_model_prepare(kvl_model_t *m, kvl_backend_t *be);
const struct kvl_model_hparams *kvl_model_hparams(const kvl_model_t *m);
const kvl_gguf_t *kvl_model_gguf(const kvl_model_t *m);
/* The geometry of this model's KV pool in the given storage type. */
struct kvl_kv_layout kvl_model_kv_layout(const kvl_model_t *m, enum kvl_kv_dtype dtype);
/* Attention-sink rows (position 0) stored from memory instead of computed, since load:
 * position 0 attends only to itself, so the forward remembers its K/V per first token. */
uint64_t kvl_model_sink_hits(const kvl_model_t *m);
/* The model's RoPE (theta, head dim): the same generator the forward uses. */
const struct kvl_rope *kvl_model_rope(const kvl_model_t *m);

struct kvl_batch {
  int n_tokens;
  const int32_t *tokens;  /* [T] token ids */
  const int32_t *pos;     /* [T] position of each token in its sequence */
  const int32_t *seq;     /* [T] index into the KV view's block tables */
  const int8_t *logits;   /* [T] nonzero: produce logits for this token (KVL_LOGITS_TOP: its
                             summary may do, kvl_model_forward_top); NULL: for every token */
};

struct kvl_kv_view {
  const struct kvl_kv_layout *layout; /* must equal kvl_model_kv_layout(m, dtype) */
  void *base;                         /* the pool */
  const int32_t *const *block_tables; /* per sequence: logical block -> physical block */
  /* optional: the pool's write stamps ([n_blocks], kvl_attn_args.kv_stamps): a device
   * backend keeps the pool on its device between calls (the scheduler's pools give them) */
  uint64_t *stamps;
  int32_t n_blocks;
};

/* Optional: copies of intermediate values for tests and translator fitting. */
struct kvl_capture {
  int n_layers;
  const int *layers;  /* which layers */
  float **k_pre;      /* per listed layer: [T][n_kv_head*head_dim] keys before RoPE (or NULL) */
  float **v;          /* per listed layer: [T][n_kv_head*head_dim] values (or NULL) */
};

/* Run one batch. logits: [number of tokens with logits wanted][n_vocab], in batch
 * order. Returns 0, or KVL_EINVAL (with nothing written to the cache) for a token id
 * out of the vocabulary or a negative position. */
int kvl_model_forward(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b,
                      const struct kvl_kv_view *kv, float *logits, const struct kvl_capture *cap);

/* kvl_model_forward for a sampler (the scheduler's): top [rows with logits wanted] tells
 * per row what it got. A token whose b->logits[t] is KVL_LOGITS_TOP asks for the summary
 * of its row only (struct kvl_logit_top: the 64 largest logits, the log-partition, the
 * entropy); where the backend summarises on its device (kvl_logits_top) and the whole
 * batch's logits are computed there (every token wants them: a decode step), such a row
 * gets top[r] with top[r].full = 0 and its logits row is left unwritten, so 552 bytes
 * cross instead of 4 x n_vocab. Every other row is written as by kvl_model_forward, with
 * top[r].full = 1 (always so on the CPU backend). The caller sets top[r].temperature (and
 * u) before: > 0 asks for a draw from the whole row at that temperature in the summary
 * (struct kvl_logit_top), for a sampler without truncation. */
#define KVL_LOGITS_TOP 2
int kvl_model_forward_top(kvl_model_t *m, kvl_backend_t *be, const struct kvl_batch *b,
                          const struct kvl_kv_view *kv, float *logits, struct kvl_logit_top *top);

#endif /* KVL_MODEL_H */
