/* translator-impl.h — the translator's layout, shared by the files of translator/ only. */
#ifndef KVL_TRANSLATOR_IMPL_H
#define KVL_TRANSLATOR_IMPL_H

#include "kvl_kernels.h"
#include "kvl_translator.h"

/* Limits a real model stays far below; anything above is a corrupt file or fingerprint. */
#define KVL__TR_MAX_LAYERS 4096
#define KVL__TR_MAX_HEADS 4096
#define KVL__TR_MAX_HEAD_DIM 65536
#define KVL__TR_MAX_WIDTH (1 << 20) /* n_kv_head · head_dim */

/* One map slot: K or V of one target layer. */
struct kvl__tr_map {
  int32_t nu;         /* source layers; 0 = slot not set */
  int32_t *sources;   /* nu ids */
  int64_t rows;       /* nu·w_S + affine */
  float *data;        /* (rows, w_T) row-major */
  /* kvl_translator_use_bf16: the first nu·w_S rows rounded to bf16, the intercept row
   * (affine) as an fp32 bias; NULL otherwise */
  uint16_t *wb;
  float *wbias;
};

struct kvl_translator {
  struct kvl_model_fingerprint src;  /* S */
  struct kvl_model_fingerprint dst;  /* T */
  bool affine;                       /* maps carry a last intercept row */
  enum kvl_translator_dtype dtype;   /* as stored in the file (F32 when built) */
  int64_t w_src, w_dst;              /* KV widths n_kv_head·head_dim */
  struct kvl__tr_map (*maps)[2];     /* [n_layer_T][K, V] */
  bool bf16;                         /* every slot has its bf16 copy (kvl_translator_use_bf16) */
  struct kvl_wpack dev;              /* a device backend's copy of the maps (kvl_translator_apply_on):
                                        a cache, written through a const translator; dropped
                                        when a map is set */
  char *fit_json;                    /* NULL or a JSON object as text */
  char *scores_json;
};

/* Take ownership of (sources, data) for a slot, freeing what it held. No checks. */
void kvl__tr_slot_put(kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which, int32_t *sources,
                      int32_t nu, float *data);

/* Is s NULL or the text of a JSON object? */
bool kvl__tr_is_json_object(const char *s);

#endif
