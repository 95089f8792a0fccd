/* model-impl.h — private to engine/: the loaded model's layout. */
#ifndef KVL_MODEL_IMPL_H
#define KVL_MODEL_IMPL_H

#include <pthread.h>

#include "kvl_model.h"

struct kvl_layer {
  const float *attn_norm;           /* [n_embd] */
  struct kvl_weight wq, wk, wv, wo; /* q/k/v carry their biases */
  const float *ffn_norm;            /* [n_embd] */
  struct kvl_weight w_gate, w_up, w_down;
};

struct kvl_model {
  kvl_gguf_t *gguf;                 /* owned: the weights live in its mapping */
  struct kvl_model_hparams hp;
  struct kvl_rope rope;
  struct kvl_weight tok_embd;       /* [n_vocab rows][n_embd] */
  struct kvl_weight output;         /* output.weight, or tok_embd when tied */
  const float *output_norm;
  struct kvl_layer *layers;         /* [n_layer] */
  struct kvl_wpack *packs;          /* backends' repacked copies: 7 per layer + output */
  int n_packs;
  /* The attention sink's K/V per first token: position 0 attends only to itself, so its
   * cache rows depend on the token alone (and the fp32 backend that computed them).
   * qwen2.c fills it on first use and then stores the rows instead of recomputing them:
   * a full fp32 forward of one row (~0.2 s on the 1.5B) per new prompt. */
  struct {
    pthread_mutex_t mu;
    int n;                          /* entries filled */
    unsigned next;                  /* the next to replace once all are filled */
    uint64_t hits;                  /* rows stored from here (kvl_model_sink_hits) */
    int32_t tok[16];
    const kvl_backend_t *be[16];
    float *kv[16];                  /* [n_layer][K row, V row] post-RoPE, n_kv_head·head_dim each */
  } sinks;
  /* Where a decode step's summaries and whole rows land from the device (qwen2.c
   * head_end): kept between steps and pinned by the head's backend, so that they come
   * back by DMA; a thread that finds it in use takes a malloc'd one. */
  struct {
    pthread_mutex_t mu;
    char *p;                        /* kvl_huge_alloc'd, or NULL */
    size_t n, mapped;               /* usable (and pinned) bytes; the mapping's */
    kvl_backend_t *pinned_by;       /* or NULL */
    bool busy;
  } land;
};

#endif
