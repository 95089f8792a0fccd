/* model-impl.h — private to engine/: the loaded model's layout. */
#ifndef KVL_MODEL_IMPL_H
#define KVL_MODEL_IMPL_H

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
};

#endif
