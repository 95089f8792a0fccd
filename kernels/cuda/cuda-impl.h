/* cuda-impl.h — private to kernels/cuda/: the device arena, the error check, and the
 * kernels' launchers (ops.cu) that the backend (backend.cu) calls. CUDA C++, or plain C++
 * under sim.h (sim-ops.cc). */
#ifndef KVL_CUDA_IMPL_H
#define KVL_CUDA_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "cu-compat.h"

extern "C" {
#include "../backend-impl.h"
}

KVL_CU_BEGIN

/* A failed CUDA call is a broken device or a bug, not a client's mistake: say which call
 * and where, and stop (as KVL_ASSERT does). */
void kvl__cuda_fail(const char *what, cudaError_t e, const char *file, int line);
#define KVL_CK(call)                                                                                \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess) kvl__cuda_fail(#call, e_, __FILE__, __LINE__);                           \
  } while (0)

/* The device arena: one cudaMalloc at start, sliced first-fit (weights, KV staging,
 * activations); 256-byte aligned slices. NULL when it is full. */
void *kvl__cuda_alloc(size_t bytes);
void kvl__cuda_free(void *p);

/* ---- kernels (ops.cu); all on `st`, asynchronous ---- */
void kvl__cu_to_bf16(const float *x, __nv_bfloat16 *y, int64_t n, cudaStream_t st);
void kvl__cu_bias(float *y, const float *b, int n_tokens, int64_t n, cudaStream_t st);
void kvl__cu_rmsnorm(const float *x, const float *w, float *y, int n_tokens, int n, float eps, cudaStream_t st);
void kvl__cu_rope(float *x, const int32_t *pos, const float *inv_freq, int n_tokens, int n_heads, int head_dim,
                  bool inverse, cudaStream_t st);
void kvl__cu_swiglu(const float *g, const float *u, float *y, int64_t n, cudaStream_t st);
void kvl__cu_add(float *h, const float *x, int64_t n, cudaStream_t st); /* h += x */
void kvl__cu_embed(const __nv_bfloat16 *table, const int32_t *ids, float *y, int n_tokens, int64_t cols,
                   cudaStream_t st);
/* Attention over one layer's KV (ops.cu explains the paths), in the pool's device copy or
 * staged. Staging: local block i is a copy of the host pool's K slab of the layer, then
 * its V slab (src[i], slab bytes together: K[16][kvw] then V[16][kvw], fp32 or bf16);
 * tables[s * max_blocks + j] is the local block of sequence s's logical block j, or with
 * `physical` its block in the pool (the device copy's tables); -1 past the blocks the
 * batch reads. */
struct kvl__cu_attn_stage {
  int n_seq, max_blocks, n_local;
  int32_t *tables;  /* [n_seq][max_blocks] */
  const void **src; /* [n_local] */
  size_t slab;
};
int kvl__cu_attn_stage_make(const struct kvl_attn_args *a, bool physical, kvl__cu_attn_stage *s); /* 0, KVL_ENOMEM */
void kvl__cu_attn_stage_free(kvl__cu_attn_stage *s);

/* How a batch runs: the warp path, or tiled (n_tiles query tiles, whose token starts
 * plan_make writes to tiles[0..n_tiles], n_tokens + 1 entries at most; hpc query heads
 * per tile; the keys in n_split chunks of `chunk`, n_sm the device's multiprocessors). */
enum { KVL__CU_ATTN_WARP, KVL__CU_ATTN_TILED };
struct kvl__cu_attn_plan {
  int path, n_tiles, hpc, n_split, chunk;
};
kvl__cu_attn_plan kvl__cu_attn_plan_make(const struct kvl_attn_args *a, int n_sm, int32_t *tiles);
/* the floats of scratch (part) a plan's key chunks take; 0: none */
size_t kvl__cu_attn_part_floats(const kvl__cu_attn_plan *p, const struct kvl_attn_args *a);
/* the device's copies of the batch (a's host arrays give the shapes) */
struct kvl__cu_attn_dev {
  const float *q;
  float *out, *part;
  const int32_t *pos, *seq, *tiles, *tables;
  const void *blocks; /* the layer's K slab of block 0 */
  int max_blocks;
  int64_t bstride;    /* elements from one block's slab to the next's (staged: 2 * 16 * kvw) */
};
void kvl__cu_attention(const kvl__cu_attn_plan *p, const struct kvl_attn_args *a, const kvl__cu_attn_dev *dv,
                       cudaStream_t st);

/* Translation (the span's blocks staged on the device in local order; ops.cu explains) */
struct kvl__cu_kv_geom {
  int n_kv_head, head_dim, bf16;
  int64_t block_bytes, slab_bytes;
};
void kvl__cu_tr_gather(const void *blocks, const kvl__cu_kv_geom *g, const int32_t *blk, const int32_t *slot,
                       const int32_t *pos, const float *inv_freq, const int32_t *layers, int n_layers, int n_src,
                       bool keys, int n, __nv_bfloat16 *x, cudaStream_t st);
void kvl__cu_tr_fill(float *y, const float *bias, int n, int w, cudaStream_t st);
/* rows y[n][w] into slab `slab` of the blocks (2L: layer L's K, 2L + 1: its V), rotated at
 * pos first where inv_freq is given: translation's target rows and the forward's new K/V;
 * also copied as they are to copy [n][w] where it is not NULL */
void kvl__cu_kv_store_rows(const float *y, void *blocks, const kvl__cu_kv_geom *g, const int32_t *blk,
                           const int32_t *slot, const int32_t *pos, const float *inv_freq, int slab, int n,
                           float *copy, cudaStream_t st);

/* y[t][r] = W[r] . x[t] for t < n_tokens <= KVL__CU_QGEMV_MAX_T on the GGUF rows of w as
 * they are (type Q8_0, Q5_0, Q4_K or Q6_K: kvl__cu_qgemv_takes), x and y fp32 */
enum { KVL__CU_QGEMV_MAX_T = 8 };
bool kvl__cu_qgemv_takes(uint32_t type, int64_t cols);
void kvl__cu_qgemv(const void *w, uint32_t type, size_t row_bytes, const float *x, float *y, int rows, int cols,
                   int n_tokens, cudaStream_t st);

/* The summaries of logits [n_rows][n_vocab] (kvl_logits_top_ref's, `full` untouched), the
 * draw of row r where temp (device, NULL: none) has temp[r] > 0, at u[r] */
void kvl__cu_logits_top(const float *logits, int n_rows, int n_vocab, kvl_logit_top *top, const float *temp,
                        const double *u, cudaStream_t st);

KVL_CU_END

#endif
