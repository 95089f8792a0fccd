/* ops.cu — the CUDA backend's own kernels: bf16 conversion, bias, RMSNorm, RoPE and its
 * inverse, SwiGLU, embedding rows, and attention over paged KV blocks. The GEMMs are
 * cuBLASLt's (backend.cu). Each kernel follows the scalar reference in kernels/ref/ (the
 * same formula; accumulation in fp32, or double where the reference's accuracy needs it),
 * and tests/gpu/test-cuda-ops.c checks it against the CPU. */
#include <math.h>

#include "cuda-impl.h"

static inline unsigned blocks_for(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }

__global__ void k_to_bf16(const float *x, __nv_bfloat16 *y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

void kvl__cu_to_bf16(const float *x, __nv_bfloat16 *y, int64_t n, cudaStream_t st) {
  if (n > 0) k_to_bf16<<<blocks_for(n, 256), 256, 0, st>>>(x, y, n);
}

__global__ void k_bias(float *y, const float *b, int64_t total, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) y[i] += b[i % n];
}

void kvl__cu_bias(float *y, const float *b, int n_tokens, int64_t n, cudaStream_t st) {
  int64_t total = (int64_t)n_tokens * n;
  if (total > 0) k_bias<<<blocks_for(total, 256), 256, 0, st>>>(y, b, total, n);
}

/* sum of v over the block (blockDim.x a multiple of 32, at most 1024) */
__device__ double block_sum(double v) {
  __shared__ double part[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  double s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < (int)(blockDim.x / 32); w++) s += part[w];
  __shared__ double total;
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  return total;
}

/* one block per row; the sum of squares in double, as the reference */
__global__ void k_rmsnorm(const float *x, const float *w, float *y, int n, float eps) {
  const float *xr = x + (int64_t)blockIdx.x * n;
  float *yr = y + (int64_t)blockIdx.x * n;
  double ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * xr[i];
  ss = block_sum(ss);
  double inv = 1.0 / sqrt(ss / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (float)(xr[i] * inv * w[i]);
}

void kvl__cu_rmsnorm(const float *x, const float *w, float *y, int n_tokens, int n, float eps, cudaStream_t st) {
  if (n_tokens > 0) k_rmsnorm<<<n_tokens, 256, 0, st>>>(x, w, y, n, eps);
}

/* neox pairs (i, i + d/2); the angle in double, as kvl_rope_table */
__global__ void k_rope(float *x, const int32_t *pos, const float *inv_freq, int n_tokens, int n_heads, int d,
                       bool inverse) {
  const int h2 = d / 2;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)n_tokens * n_heads * h2) return;
  int k = (int)(i % h2);
  int64_t th = i / h2; /* token * n_heads + head */
  int t = (int)(th / n_heads);
  double a = (double)pos[t] * (double)inv_freq[k];
  float c = (float)cos(a), s = (float)sin(a);
  if (inverse) s = -s;
  float *v = x + th * d;
  float p = v[k], q = v[k + h2];
  v[k] = p * c - q * s;
  v[k + h2] = p * s + q * c;
}

void kvl__cu_rope(float *x, const int32_t *pos, const float *inv_freq, int n_tokens, int n_heads, int head_dim,
                  bool inverse, cudaStream_t st) {
  int64_t n = (int64_t)n_tokens * n_heads * (head_dim / 2);
  if (n > 0) k_rope<<<blocks_for(n, 256), 256, 0, st>>>(x, pos, inv_freq, n_tokens, n_heads, head_dim, inverse);
}

__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kvl__cu_swiglu(const float *g, const float *u, float *y, int64_t n, cudaStream_t st) {
  if (n > 0) k_swiglu<<<blocks_for(n, 256), 256, 0, st>>>(g, u, y, n);
}

__global__ void k_embed(const __nv_bfloat16 *table, const int32_t *ids, float *y, int64_t cols) {
  const __nv_bfloat16 *row = table + (int64_t)ids[blockIdx.x] * cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) y[(int64_t)blockIdx.x * cols + i] = __bfloat162float(row[i]);
}

void kvl__cu_embed(const __nv_bfloat16 *table, const int32_t *ids, float *y, int n_tokens, int64_t cols,
                   cudaStream_t st) {
  if (n_tokens > 0) k_embed<<<n_tokens, 256, 0, st>>>(table, ids, y, cols);
}

/* ---- attention ---------------------------------------------------------------------
 *
 * One warp per (token, query head): lane l holds elements l, l + 32, ... of the query and
 * of the output accumulator (head_dim <= 256: at most 8 each). The warp walks the
 * sequence's positions 0..pos in order with an online softmax (running max m and sum
 * l, the accumulator rescaled by e^(m_old - m_new)), a score being a warp-wide sum. The
 * same recurrence as the CPU's flash attention, without tiling: correct first; a tiled
 * prefill kernel and a split-K decode kernel are the next step. */
template <typename KV>
__device__ inline float kv_at(const KV *p);
template <>
__device__ inline float kv_at<float>(const float *p) { return *p; }
template <>
__device__ inline float kv_at<__nv_bfloat16>(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

template <typename KV>
__global__ void k_attention(const float *q, float *out, const int32_t *pos, const int32_t *seq, const int32_t *tables,
                            int max_blocks, const KV *blocks, int n_head, int n_kv_head, int d, float scale) {
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int kh = h / (n_head / n_kv_head), kvw = n_kv_head * d, per = (d + 31) / 32;
  const float *qh = q + ((int64_t)t * n_head + h) * d;
  float qv[8], acc[8];
  for (int e = 0; e < per; e++) {
    int c = lane + 32 * e;
    qv[e] = c < d ? qh[c] : 0.0f;
    acc[e] = 0.0f;
  }
  const int32_t *bt = tables + (int64_t)seq[t] * max_blocks;
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= pos[t]; j++) {
    const KV *blk = blocks + (int64_t)bt[j / 16] * 2 * 16 * kvw;
    const KV *k = blk + (int64_t)(j % 16) * kvw + (int64_t)kh * d, *v = k + (int64_t)16 * kvw;
    float s = 0.0f;
    for (int e = 0; e < per; e++) {
      int c = lane + 32 * e;
      if (c < d) s += qv[e] * kv_at(k + c);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= scale;
    float nm = fmaxf(m, s), corr = expf(m - nm), p = expf(s - nm);
    l = l * corr + p;
    for (int e = 0; e < per; e++) {
      int c = lane + 32 * e;
      if (c < d) acc[e] = acc[e] * corr + p * kv_at(v + c);
    }
    m = nm;
  }
  float *o = out + ((int64_t)t * n_head + h) * d;
  for (int e = 0; e < per; e++) {
    int c = lane + 32 * e;
    if (c < d) o[c] = acc[e] / l;
  }
}

void kvl__cu_attention(const float *q, float *out, const int32_t *pos, const int32_t *seq, const int32_t *tables,
                       int max_blocks, const void *blocks, int n_tokens, int n_head, int n_kv_head, int head_dim,
                       bool bf16, float scale, cudaStream_t st) {
  if (n_tokens <= 0) return;
  dim3 grid((unsigned)n_tokens, (unsigned)n_head);
  if (bf16)
    k_attention<__nv_bfloat16><<<grid, 32, 0, st>>>(q, out, pos, seq, tables, max_blocks,
                                                    (const __nv_bfloat16 *)blocks, n_head, n_kv_head, head_dim, scale);
  else
    k_attention<float><<<grid, 32, 0, st>>>(q, out, pos, seq, tables, max_blocks, (const float *)blocks, n_head,
                                            n_kv_head, head_dim, scale);
}

/* ---- translation (backend.cu's cu_translate) ---------------------------------------
 *
 * The span's source and target blocks sit on the device in local order (blocks[b] at
 * b * block_bytes, each block's layers as in the host pool: layer L's K slab at
 * 2L * slab, its V slab at (2L + 1) * slab). Position i of the chunk lives in local
 * block blk[i], slot slot[i], at RoPE position pos[i]. Angles in double, cos and sin
 * rounded to float, the rotation in float: kvl_rope_table and kvl_rope_tab's arithmetic. */
template <typename KV>
__device__ inline void kv_put(KV *p, float v);
template <>
__device__ inline void kv_put<float>(float *p, float v) { *p = v; }
template <>
__device__ inline void kv_put<__nv_bfloat16>(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

/* x[i][layer][w_src] (bf16) = the un-rotated key (keys) or the value of source layer
 * layers[y] at chunk position i; one block per (position, layer), a thread per pair. */
template <typename KV>
__global__ void k_tr_gather(const char *blocks, kvl__cu_kv_geom g, const int32_t *blk, const int32_t *slot,
                            const int32_t *pos, const float *inv_freq, const int32_t *layers, int n_src, bool keys,
                            __nv_bfloat16 *x) {
  const int i = blockIdx.x, L = layers[blockIdx.y], d = g.head_dim, h2 = d / 2, w = g.n_kv_head * d;
  const char *slab = blocks + (int64_t)blk[i] * g.block_bytes + (int64_t)(2 * L + (keys ? 0 : 1)) * g.slab_bytes;
  const KV *row = (const KV *)slab + (int64_t)slot[i] * w;
  __nv_bfloat16 *out = x + ((int64_t)i * n_src + L) * w;
  for (int p = threadIdx.x; p < g.n_kv_head * h2; p += blockDim.x) {
    const int h = p / h2, k = p % h2;
    const float a = kv_at(row + h * d + k), b = kv_at(row + h * d + k + h2);
    if (keys) {
      const double ang = (double)pos[i] * (double)inv_freq[k];
      const float c = (float)cos(ang), si = -(float)sin(ang); /* inverse: -sin exactly */
      out[h * d + k] = __float2bfloat16_rn(a * c - b * si);
      out[h * d + k + h2] = __float2bfloat16_rn(a * si + b * c);
    } else {
      out[h * d + k] = __float2bfloat16_rn(a);
      out[h * d + k + h2] = __float2bfloat16_rn(b);
    }
  }
}

void kvl__cu_tr_gather(const void *blocks, const kvl__cu_kv_geom *g, const int32_t *blk, const int32_t *slot,
                       const int32_t *pos, const float *inv_freq, const int32_t *layers, int n_layers, int n_src,
                       bool keys, int n, __nv_bfloat16 *x, cudaStream_t st) {
  if (n <= 0 || n_layers <= 0) return;
  dim3 grid((unsigned)n, (unsigned)n_layers);
  if (g->bf16)
    k_tr_gather<__nv_bfloat16><<<grid, 128, 0, st>>>((const char *)blocks, *g, blk, slot, pos, inv_freq, layers, n_src,
                                                     keys, x);
  else
    k_tr_gather<float><<<grid, 128, 0, st>>>((const char *)blocks, *g, blk, slot, pos, inv_freq, layers, n_src, keys,
                                             x);
}

/* y[i][c] = bias[c] (or 0) for i < n, c < w */
__global__ void k_tr_fill(float *y, const float *bias, int64_t total, int w) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) y[i] = bias ? bias[i % w] : 0.0f;
}

void kvl__cu_tr_fill(float *y, const float *bias, int n, int w, cudaStream_t st) {
  int64_t total = (int64_t)n * w;
  if (total > 0) k_tr_fill<<<blocks_for(total, 256), 256, 0, st>>>(y, bias, total, w);
}

/* Target layer `layer`'s keys (rotated forward at pos[i]) or values y[i][w] stored into
 * the target blocks; one block per position, a thread per pair. */
template <typename KV>
__global__ void k_tr_store(const float *y, char *blocks, kvl__cu_kv_geom g, const int32_t *blk, const int32_t *slot,
                           const int32_t *pos, const float *inv_freq, int layer, bool keys) {
  const int i = blockIdx.x, d = g.head_dim, h2 = d / 2, w = g.n_kv_head * d;
  KV *row = (KV *)(blocks + (int64_t)blk[i] * g.block_bytes + (int64_t)(2 * layer + (keys ? 0 : 1)) * g.slab_bytes) +
            (int64_t)slot[i] * w;
  const float *yr = y + (int64_t)i * w;
  for (int p = threadIdx.x; p < g.n_kv_head * h2; p += blockDim.x) {
    const int h = p / h2, k = p % h2;
    const float a = yr[h * d + k], b = yr[h * d + k + h2];
    if (keys) {
      const double ang = (double)pos[i] * (double)inv_freq[k];
      const float c = (float)cos(ang), si = (float)sin(ang);
      kv_put(row + h * d + k, a * c - b * si);
      kv_put(row + h * d + k + h2, a * si + b * c);
    } else {
      kv_put(row + h * d + k, a);
      kv_put(row + h * d + k + h2, b);
    }
  }
}

void kvl__cu_tr_store(const float *y, void *blocks, const kvl__cu_kv_geom *g, const int32_t *blk, const int32_t *slot,
                      const int32_t *pos, const float *inv_freq, int layer, bool keys, int n, cudaStream_t st) {
  if (n <= 0) return;
  if (g->bf16)
    k_tr_store<__nv_bfloat16><<<n, 128, 0, st>>>(y, (char *)blocks, *g, blk, slot, pos, inv_freq, layer, keys);
  else
    k_tr_store<float><<<n, 128, 0, st>>>(y, (char *)blocks, *g, blk, slot, pos, inv_freq, layer, keys);
}
