/* tiny_fingerprint.h — a translator fingerprint for a tiny test model (which has no
 * tokenizer, so kvl_fingerprint_from_gguf cannot make one): its layout, a fixed
 * tokenizer hash. */
#ifndef KVL_TINY_FINGERPRINT_H
#define KVL_TINY_FINGERPRINT_H

#include <stdio.h>
#include <string.h>

#include "kvl_model.h"
#include "kvl_translator.h"

static inline void tiny_fingerprint(const kvl_model_t *m, struct kvl_model_fingerprint *fp) {
  const struct kvl_model_hparams *hp = kvl_model_hparams(m);
  memset(fp, 0, sizeof(*fp));
  snprintf(fp->architecture, sizeof(fp->architecture), "%s", hp->arch);
  fp->n_layer = hp->n_layer;
  fp->n_kv_head = hp->n_kv_head;
  fp->head_dim = hp->head_dim;
  fp->rope_theta = hp->rope_theta;
  snprintf(fp->rope_scaling, sizeof(fp->rope_scaling), "none");
  snprintf(fp->tokenizer_hash, sizeof(fp->tokenizer_hash), "0123abcd");
  snprintf(fp->name, sizeof(fp->name), "tiny");
}

#endif
