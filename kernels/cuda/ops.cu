/* ops.cu — the CUDA backend's own kernels: bf16 conversion, bias, RMSNorm, RoPE and its
 * inverse, SwiGLU, embedding rows, attention over paged KV blocks, translation's gather and
 * store, and the logits' summaries for sampling. The GEMMs are
 * cuBLASLt's (backend.cu). Each kernel follows the scalar reference in kernels/ref/ (the
 * same formula; accumulation in fp32, or double where the reference's accuracy needs it),
 * and tests/gpu/test-cuda-ops.c checks it against the CPU. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-impl.h"

extern "C" {
#include "kvl_error.h"
}

KVL_CU_BEGIN

static inline unsigned blocks_for(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }

__global__ void k_to_bf16(const float *x, __nv_bfloat16 *y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

void kvl__cu_to_bf16(const float *x, __nv_bfloat16 *y, int64_t n, cudaStream_t st) {
  if (n > 0) KVL_LAUNCH(k_to_bf16, blocks_for(n, 256), 256, st, x, y, n);
}

__global__ void k_bias(float *y, const float *b, int64_t total, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) y[i] += b[i % n];
}

void kvl__cu_bias(float *y, const float *b, int n_tokens, int64_t n, cudaStream_t st) {
  int64_t total = (int64_t)n_tokens * n;
  if (total > 0) KVL_LAUNCH(k_bias, blocks_for(total, 256), 256, st, y, b, total, n);
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
  if (n_tokens > 0) KVL_LAUNCH(k_rmsnorm, n_tokens, 256, st, x, w, y, n, eps);
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
  if (n > 0) KVL_LAUNCH(k_rope, blocks_for(n, 256), 256, st, x, pos, inv_freq, n_tokens, n_heads, head_dim, inverse);
}

__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kvl__cu_swiglu(const float *g, const float *u, float *y, int64_t n, cudaStream_t st) {
  if (n > 0) KVL_LAUNCH(k_swiglu, blocks_for(n, 256), 256, st, g, u, y, n);
}

__global__ void k_add(float *h, const float *x, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h[i] += x[i];
}

void kvl__cu_add(float *h, const float *x, int64_t n, cudaStream_t st) {
  if (n > 0) KVL_LAUNCH(k_add, blocks_for(n, 256), 256, st, h, x, n);
}

__global__ void k_embed(const __nv_bfloat16 *table, const int32_t *ids, float *y, int64_t cols) {
  const __nv_bfloat16 *row = table + (int64_t)ids[blockIdx.x] * cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) y[(int64_t)blockIdx.x * cols + i] = __bfloat162float(row[i]);
}

void kvl__cu_embed(const __nv_bfloat16 *table, const int32_t *ids, float *y, int n_tokens, int64_t cols,
                   cudaStream_t st) {
  if (n_tokens > 0) KVL_LAUNCH(k_embed, n_tokens, 256, st, table, ids, y, cols);
}

/* ---- attention ---------------------------------------------------------------------
 *
 * Both paths run the CPU's flash recurrence (an online softmax: running max m and sum l,
 * the accumulator rescaled by e^(m_old - m_new)) over the staged blocks.
 *
 * Warp path (any head width up to 256; KVL_CUDA_ATTN=warp forces it): one warp per
 * (token, query head), lane l holding elements l, l + 32, ... of the query and the
 * accumulator, walking positions 0..pos one at a time, a score being a warp-wide sum.
 *
 * Tiled path (head widths 64 and 128): one block of 4 warps per (query tile, head group,
 * key split). A tile is 16 rows: up to 16 consecutive positions of one sequence for one
 * query head, or, where every token of the batch is alone in its tile (decode), one token
 * for hpc query heads sharing a KV head (grouped-query packing: the group's K and V read
 * once). Each warp owns 4 rows. Per step the block stages 32 keys and their values in
 * shared memory as fp32 (key rows padded to D + 4 floats: lane j reads key j's row with
 * 16-byte loads, no bank conflicts); lane j scores key j against the warp's 4 queries,
 * the warp takes each row's max and sum with shuffles, and lane l adds the probability-
 * weighted values into its D/32 accumulator elements per row. With n_split > 1 (few
 * blocks for the device: decode) each block takes one chunk of the keys and writes its
 * rows' (m, l, unnormalised accumulator); k_attn_combine merges the chunks per row. */
template <typename KV>
__device__ inline float kv_at(const KV *p);
template <>
__device__ inline float kv_at<float>(const float *p) { return *p; }
template <>
__device__ inline float kv_at<__nv_bfloat16>(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

struct attn_k {
  const float *q;
  float *out, *part;
  const int32_t *pos, *seq, *tiles, *tables;
  const void *blocks;
  int max_blocks, n_head, n_kv_head, d, hpc, chunk, n_rows;
  float scale;
  int64_t bstride; /* elements from a block's K slab of the layer to the next block's */
};

template <typename KV>
__global__ void k_attn_warp(attn_k k) {
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, d = k.d;
  const int kh = h / (k.n_head / k.n_kv_head), kvw = k.n_kv_head * d, per = (d + 31) / 32;
  const float *qh = k.q + ((int64_t)t * k.n_head + h) * d;
  const KV *blocks = (const KV *)k.blocks;
  float qv[8], acc[8];
  for (int e = 0; e < per; e++) {
    int c = lane + 32 * e;
    qv[e] = c < d ? qh[c] : 0.0f;
    acc[e] = 0.0f;
  }
  const int32_t *bt = k.tables + (int64_t)k.seq[t] * k.max_blocks;
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= k.pos[t]; j++) {
    const KV *blk = blocks + (int64_t)bt[j / 16] * k.bstride;
    const KV *kr = blk + (int64_t)(j % 16) * kvw + (int64_t)kh * d, *vr = kr + (int64_t)16 * kvw;
    float s = 0.0f;
    for (int e = 0; e < per; e++) {
      int c = lane + 32 * e;
      if (c < d) s += qv[e] * kv_at(kr + c);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= k.scale;
    float nm = fmaxf(m, s), corr = expf(m - nm), p = expf(s - nm);
    l = l * corr + p;
    for (int e = 0; e < per; e++) {
      int c = lane + 32 * e;
      if (c < d) acc[e] = acc[e] * corr + p * kv_at(vr + c);
    }
    m = nm;
  }
  float *o = k.out + ((int64_t)t * k.n_head + h) * d;
  for (int e = 0; e < per; e++) {
    int c = lane + 32 * e;
    if (c < d) o[c] = acc[e] / l;
  }
}

enum { ATT_ROWS = 16, ATT_BK = 32, ATT_WARPS = 4, ATT_RW = ATT_ROWS / ATT_WARPS };

template <typename KV, int D>
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attn_tiled(attn_k k) {
  static_assert(ATT_RW == 4, "a warp's rows travel as one float4");
  constexpr int DP = D + 4, E = D / 32;
  __shared__ float4 qs4[ATT_ROWS * D / 4];  /* the rows' queries, times the scale */
  __shared__ float4 ks4[ATT_BK * DP / 4];   /* the step's keys, rows of DP floats */
  __shared__ float vs[ATT_BK][D];           /* the step's values */
  __shared__ float4 ps4[ATT_WARPS][ATT_BK]; /* per warp and key: its 4 rows' probabilities */
  float *qs = (float *)qs4, *ks = (float *)ks4;
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32;
  const int t0 = k.tiles[blockIdx.x], nt = k.tiles[blockIdx.x + 1] - t0, nrows = nt * k.hpc;
  const int h0 = blockIdx.y * k.hpc, kh = h0 / (k.n_head / k.n_kv_head), kvw = k.n_kv_head * D;
  for (int i = tid; i < ATT_ROWS * D; i += blockDim.x) {
    const int r = i / D, c = i % D;
    qs[i] = r < nrows ? k.q[((int64_t)(t0 + r / k.hpc) * k.n_head + h0 + r % k.hpc) * D + c] * k.scale : 0.0f;
  }
  int rp[ATT_RW]; /* each row's position (-1: no row) */
  float m[ATT_RW], l[ATT_RW], acc[ATT_RW][E];
  for (int r = 0; r < ATT_RW; r++) {
    const int row = w * ATT_RW + r;
    rp[r] = row < nrows ? k.pos[t0 + row / k.hpc] : -1;
    m[r] = -INFINITY, l[r] = 0.0f;
    for (int e = 0; e < E; e++) acc[r][e] = 0.0f;
  }
  /* the tile's positions ascend: its last token sees the most keys */
  const int lo = blockIdx.z * k.chunk, last = k.pos[t0 + nt - 1];
  const int hi = lo + k.chunk < last + 1 ? lo + k.chunk : last + 1;
  const int32_t *bt = k.tables + (int64_t)k.seq[t0] * k.max_blocks;
  const KV *blocks = (const KV *)k.blocks;
  for (int j0 = lo; j0 < hi; j0 += ATT_BK) {
    __syncthreads(); /* the previous step's readers are done */
    for (int i = tid; i < ATT_BK * D; i += blockDim.x) {
      const int j = i / D, c = i % D, key = j0 + j;
      float kv = 0.0f, vv = 0.0f;
      if (key < hi) {
        const KV *kp = blocks + (int64_t)bt[key / 16] * k.bstride + (int64_t)(key % 16) * kvw + (int64_t)kh * D + c;
        kv = kv_at(kp);
        vv = kv_at(kp + (int64_t)16 * kvw);
      }
      ks[j * DP + c] = kv;
      vs[j][c] = vv;
    }
    __syncthreads();
    const int key = j0 + lane;
    const float4 *kr = (const float4 *)(ks + lane * DP);
    float s[ATT_RW] = {0.0f, 0.0f, 0.0f, 0.0f}, p[ATT_RW];
    for (int c4 = 0; c4 < D / 4; c4++) {
      const float4 kk = kr[c4];
      for (int r = 0; r < ATT_RW; r++) {
        const float4 qq = qs4[(w * ATT_RW + r) * (D / 4) + c4];
        s[r] += qq.x * kk.x + qq.y * kk.y + qq.z * kk.z + qq.w * kk.w;
      }
    }
    for (int r = 0; r < ATT_RW; r++) {
      const float sr = key < hi && key <= rp[r] ? s[r] : -INFINITY;
      float mx = sr;
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float nm = fmaxf(m[r], mx);
      p[r] = sr == -INFINITY ? 0.0f : expf(sr - nm);
      float sum = p[r];
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float corr = m[r] == nm ? 1.0f : expf(m[r] - nm); /* both -inf: nothing yet */
      l[r] = l[r] * corr + sum;
      for (int e = 0; e < E; e++) acc[r][e] *= corr;
      m[r] = nm;
    }
    ps4[w][lane] = make_float4(p[0], p[1], p[2], p[3]);
    __syncwarp();
    for (int j = 0; j < ATT_BK; j++) {
      const float4 pj = ps4[w][j];
      for (int e = 0; e < E; e++) {
        const float v = vs[j][lane + 32 * e];
        acc[0][e] += pj.x * v, acc[1][e] += pj.y * v, acc[2][e] += pj.z * v, acc[3][e] += pj.w * v;
      }
    }
  }
  for (int r = 0; r < ATT_RW; r++) {
    const int row = w * ATT_RW + r;
    if (row >= nrows) continue;
    const int64_t idx = (int64_t)(t0 + row / k.hpc) * k.n_head + h0 + row % k.hpc;
    if (gridDim.z == 1) {
      for (int e = 0; e < E; e++) k.out[idx * D + lane + 32 * e] = acc[r][e] / l[r];
    } else {
      float *pp = k.part + ((int64_t)blockIdx.z * k.n_rows + idx) * (D + 2);
      if (lane == 0) pp[0] = m[r], pp[1] = l[r];
      for (int e = 0; e < E; e++) pp[2 + lane + 32 * e] = acc[r][e];
    }
  }
}

/* one warp per (token, head): the chunks' (m, l, acc) merged, acc / l to out */
__global__ void k_attn_combine(attn_k k, int n_split) {
  const int64_t idx = blockIdx.x;
  const int d = k.d;
  float mx = -INFINITY, l = 0.0f;
  for (int s = 0; s < n_split; s++) mx = fmaxf(mx, k.part[((int64_t)s * k.n_rows + idx) * (d + 2)]);
  for (int s = 0; s < n_split; s++) {
    const float *pp = k.part + ((int64_t)s * k.n_rows + idx) * (d + 2);
    if (pp[0] != -INFINITY) l += pp[1] * expf(pp[0] - mx);
  }
  for (int c = threadIdx.x; c < d; c += 32) {
    float a = 0.0f;
    for (int s = 0; s < n_split; s++) {
      const float *pp = k.part + ((int64_t)s * k.n_rows + idx) * (d + 2);
      if (pp[0] != -INFINITY) a += pp[2 + c] * expf(pp[0] - mx);
    }
    k.out[idx * d + c] = a / l;
  }
}

int kvl__cu_attn_stage_make(const struct kvl_attn_args *a, bool physical, kvl__cu_attn_stage *s) {
  const struct kvl_kv_layout *l = a->kv;
  *s = kvl__cu_attn_stage{};
  for (int t = 0; t < a->n_tokens; t++) {
    if (a->seq[t] + 1 > s->n_seq) s->n_seq = a->seq[t] + 1;
    if (a->pos[t] / KVL_KV_BLOCK + 1 > s->max_blocks) s->max_blocks = a->pos[t] / KVL_KV_BLOCK + 1;
  }
  /* blocks needed per sequence: up to its highest position in the batch */
  int *need = (int *)calloc((size_t)s->n_seq, sizeof(int));
  const size_t n_tab = (size_t)s->n_seq * (size_t)s->max_blocks;
  s->tables = (int32_t *)malloc((n_tab > 0 ? n_tab : 1) * sizeof(int32_t));
  if (!need || !s->tables) {
    free(need);
    kvl__cu_attn_stage_free(s);
    return KVL_ENOMEM;
  }
  for (size_t i = 0; i < n_tab; i++) s->tables[i] = -1;
  for (int t = 0; t < a->n_tokens; t++)
    if (a->pos[t] / KVL_KV_BLOCK + 1 > need[a->seq[t]]) need[a->seq[t]] = a->pos[t] / KVL_KV_BLOCK + 1;
  for (int q = 0; q < s->n_seq; q++) s->n_local += need[q];
  s->src = (const void **)malloc((size_t)(s->n_local > 0 ? s->n_local : 1) * sizeof(void *));
  if (!s->src) {
    free(need);
    kvl__cu_attn_stage_free(s);
    return KVL_ENOMEM;
  }
  s->slab = 2 * (size_t)KVL_KV_BLOCK * (size_t)l->n_kv_head * (size_t)l->head_dim * (l->dtype == KVL_KV_BF16 ? 2 : 4);
  int next = 0;
  for (int q = 0; q < s->n_seq; q++)
    for (int j = 0; j < need[q]; j++) {
      s->src[next] = kvl_kv_k_ptr(l, (void *)a->kv_base, a->block_tables[q][j], a->layer);
      s->tables[(size_t)q * s->max_blocks + j] = physical ? a->block_tables[q][j] : next;
      next++;
    }
  free(need);
  return 0;
}

void kvl__cu_attn_stage_free(kvl__cu_attn_stage *s) {
  free(s->tables);
  free(s->src);
  s->tables = NULL, s->src = NULL;
}

kvl__cu_attn_plan kvl__cu_attn_plan_make(const struct kvl_attn_args *a, int n_sm, int32_t *tiles) {
  kvl__cu_attn_plan p = {KVL__CU_ATTN_WARP, a->n_tokens, 1, 1, 0};
  const int d = a->kv->head_dim, G = a->n_head / a->kv->n_kv_head;
  const char *e = getenv("KVL_CUDA_ATTN");
  if ((d != 64 && d != 128) || (e && !strcmp(e, "warp"))) return p;
  p.path = KVL__CU_ATTN_TILED;
  p.n_tiles = kvl__attn_tiles(a, ATT_ROWS, tiles);
  if (p.n_tiles == a->n_tokens)
    for (int h = G < ATT_ROWS ? G : ATT_ROWS; h > 1 && p.hpc == 1; h--)
      if (G % h == 0) p.hpc = h;
  int keys = 0;
  for (int t = 0; t < a->n_tokens; t++)
    if (a->pos[t] + 1 > keys) keys = a->pos[t] + 1;
  p.chunk = (keys + ATT_BK - 1) / ATT_BK * ATT_BK;
  /* fewer than two blocks per multiprocessor: split the keys */
  const int blocks = p.n_tiles * (a->n_head / p.hpc);
  if (n_sm > 0 && blocks < 2 * n_sm) {
    const int want = (2 * n_sm + blocks - 1) / blocks;
    p.chunk = ((keys + want - 1) / want + ATT_BK - 1) / ATT_BK * ATT_BK;
    p.n_split = (keys + p.chunk - 1) / p.chunk;
  }
  return p;
}

size_t kvl__cu_attn_part_floats(const kvl__cu_attn_plan *p, const struct kvl_attn_args *a) {
  if (p->n_split <= 1) return 0;
  return (size_t)p->n_split * (size_t)a->n_tokens * (size_t)a->n_head * ((size_t)a->kv->head_dim + 2);
}

void kvl__cu_attention(const kvl__cu_attn_plan *p, const struct kvl_attn_args *a, const kvl__cu_attn_dev *dv,
                       cudaStream_t st) {
  if (a->n_tokens <= 0) return;
  const int d = a->kv->head_dim;
  const bool bf16 = a->kv->dtype == KVL_KV_BF16;
  const attn_k k = {dv->q,      dv->out,     dv->part,         dv->pos, dv->seq, dv->tiles, dv->tables, dv->blocks,
                    dv->max_blocks, a->n_head, a->kv->n_kv_head, d,       p->hpc,  p->chunk,  a->n_tokens * a->n_head,
                    a->scale,       dv->bstride};
  if (p->path == KVL__CU_ATTN_WARP) {
    const dim3 grid((unsigned)a->n_tokens, (unsigned)a->n_head);
    if (bf16) KVL_LAUNCH(k_attn_warp<__nv_bfloat16>, grid, 32, st, k);
    else KVL_LAUNCH(k_attn_warp<float>, grid, 32, st, k);
    return;
  }
  void (*kern)(attn_k);
  if (bf16) kern = d == 64 ? k_attn_tiled<__nv_bfloat16, 64> : k_attn_tiled<__nv_bfloat16, 128>;
  else kern = d == 64 ? k_attn_tiled<float, 64> : k_attn_tiled<float, 128>;
  const dim3 grid((unsigned)p->n_tiles, (unsigned)(a->n_head / p->hpc), (unsigned)p->n_split);
  KVL_LAUNCH(kern, grid, ATT_WARPS * 32, st, k);
  if (p->n_split > 1) KVL_LAUNCH(k_attn_combine, k.n_rows, 32, st, k, p->n_split);
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
    KVL_LAUNCH(k_tr_gather<__nv_bfloat16>, grid, 128, st, (const char *)blocks, *g, blk, slot, pos, inv_freq, layers,
               n_src, keys, x);
  else
    KVL_LAUNCH(k_tr_gather<float>, grid, 128, st, (const char *)blocks, *g, blk, slot, pos, inv_freq, layers, n_src,
               keys, x);
}

/* y[i][c] = bias[c] (or 0) for i < n, c < w */
__global__ void k_tr_fill(float *y, const float *bias, int64_t total, int w) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) y[i] = bias ? bias[i % w] : 0.0f;
}

void kvl__cu_tr_fill(float *y, const float *bias, int n, int w, cudaStream_t st) {
  int64_t total = (int64_t)n * w;
  if (total > 0) KVL_LAUNCH(k_tr_fill, blocks_for(total, 256), 256, st, y, bias, total, w);
}

/* Rows y[i][w] stored into slab `slab` (2L: layer L's keys, 2L + 1: its values) of the
 * blocks, rotated forward at pos[i] first where inv_freq is given (translation's keys),
 * and copied as they are to copy[i][w] where it is given (the forward's rows for the host
 * pool); one block per position, a thread per pair. */
template <typename KV>
__global__ void k_kv_store_rows(const float *y, char *blocks, kvl__cu_kv_geom g, const int32_t *blk,
                                const int32_t *slot, const int32_t *pos, const float *inv_freq, int slab, float *copy) {
  const int i = blockIdx.x, d = g.head_dim, h2 = d / 2, w = g.n_kv_head * d;
  KV *row = (KV *)(blocks + (int64_t)blk[i] * g.block_bytes + (int64_t)slab * g.slab_bytes) + (int64_t)slot[i] * w;
  const float *yr = y + (int64_t)i * w;
  for (int p = threadIdx.x; p < g.n_kv_head * h2; p += blockDim.x) {
    const int h = p / h2, k = p % h2;
    const float a = yr[h * d + k], b = yr[h * d + k + h2];
    if (copy) copy[(int64_t)i * w + h * d + k] = a, copy[(int64_t)i * w + h * d + k + h2] = b;
    if (inv_freq) {
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

void kvl__cu_kv_store_rows(const float *y, void *blocks, const kvl__cu_kv_geom *g, const int32_t *blk,
                           const int32_t *slot, const int32_t *pos, const float *inv_freq, int slab, int n,
                           float *copy, cudaStream_t st) {
  if (n <= 0) return;
  if (g->bf16)
    KVL_LAUNCH(k_kv_store_rows<__nv_bfloat16>, n, 128, st, y, (char *)blocks, *g, blk, slot, pos, inv_freq, slab,
               copy);
  else
    KVL_LAUNCH(k_kv_store_rows<float>, n, 128, st, y, (char *)blocks, *g, blk, slot, pos, inv_freq, slab, copy);
}

/* ---- logits summarised for sampling (kvl_logits_top; kvl_logits_top_ref's contract) ---
 *
 * One block per row. Pass 1: the max of the cleaned logits (NaN -> -inf, +inf -> FLT_MAX);
 * pass 2: sum e^(l - max) and sum e^(l - max)(l - max) in double, for the log-partition and
 * the entropy. Then the k-th largest entry (k = min(KVL_LOGIT_TOP, n)) by a radix select
 * on an order-preserving key of the float, 8 bits a round from the top (4 passes of
 * 256-bin histograms in shared memory): `need` counts how many entries equal to the key
 * found are still to take. The entries above it land in shared slots in any order; of
 * those equal to it, all when that is exactly `need` (the usual case), else the lowest
 * ids, one thread walking the row in order. Last, each of the k candidates finds its rank
 * in (value descending, id ascending) by comparing with the others, and writes itself
 * there. */
__device__ inline float clean_logit(float x) {
  if (x != x) return -INFINITY;
  return x > FLT_MAX ? FLT_MAX : x;
}

/* ascending with the float (-inf lowest); -0 and +0 one key */
__device__ inline uint32_t logit_key(float v) {
  if (v == 0.0f) v = 0.0f;
  uint32_t b;
  memcpy(&b, &v, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ float block_max(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  __shared__ float total;
  if (threadIdx.x == 0) {
    float m = part[0];
    for (int w = 1; w < (int)(blockDim.x / 32); w++) m = fmaxf(m, part[w]);
    total = m;
  }
  __syncthreads();
  return total;
}

__global__ void k_logits_top(const float *logits, int n, kvl_logit_top *top, const float *temp, const double *u) {
  const float *x = logits + (int64_t)blockIdx.x * n;
  kvl_logit_top *o = top + blockIdx.x;
  const int k = n < KVL_LOGIT_TOP ? n : KVL_LOGIT_TOP, tid = threadIdx.x;
  float mx = -INFINITY;
  for (int i = tid; i < n; i += blockDim.x) mx = fmaxf(mx, clean_logit(x[i]));
  mx = block_max(mx);
  double z = 0, ez = 0;
  if (mx > -INFINITY)
    for (int i = tid; i < n; i += blockDim.x) {
      const double d = (double)clean_logit(x[i]) - mx;
      if (d == -INFINITY) continue;
      const double e = exp(d);
      z += e, ez += e * d;
    }
  z = block_sum(z);
  ez = block_sum(ez);

  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix, pmask, need, n_eq;
  if (tid == 0) prefix = 0, pmask = 0, need = (uint32_t)k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
      const uint32_t key = logit_key(clean_logit(x[i]));
      if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t d = 255;
      while (hist[d] < need) need -= hist[d--];
      prefix |= d << shift, pmask |= 255u << shift, n_eq = hist[d];
    }
    __syncthreads();
  }

  __shared__ float cv[KVL_LOGIT_TOP];
  __shared__ int32_t cid[KVL_LOGIT_TOP];
  __shared__ uint32_t n_above, n_tied;
  if (tid == 0) n_above = 0, n_tied = 0;
  __syncthreads();
  const uint32_t first_tied = (uint32_t)k - need; /* the slots of the tied entries */
  for (int i = tid; i < n; i += blockDim.x) {
    const float v = clean_logit(x[i]);
    const uint32_t key = logit_key(v);
    uint32_t s = KVL_LOGIT_TOP;
    if (key > prefix) s = atomicAdd(&n_above, 1u);
    else if (key == prefix && n_eq == need) s = first_tied + atomicAdd(&n_tied, 1u);
    if (s < (uint32_t)KVL_LOGIT_TOP) cv[s] = v, cid[s] = i;
  }
  if (tid == 0 && n_eq != need)
    for (int i = 0, s = (int)first_tied; i < n && s < k; i++) {
      const float v = clean_logit(x[i]);
      if (logit_key(v) == prefix) cv[s] = v, cid[s++] = i;
    }
  __syncthreads();
  if (tid < k) {
    const float v = cv[tid];
    const int32_t id = cid[tid];
    int r = 0;
    for (int j = 0; j < k; j++) r += cv[j] > v || (cv[j] == v && cid[j] < id);
    o->val[r] = v, o->id[r] = id;
  }
  const float T = temp ? temp[blockIdx.x] : 0.0f;
  const double uu = u ? u[blockIdx.x] : 0.0;
  if (tid == 0) {
    o->n = k;
    o->lse = mx > -INFINITY ? (float)(mx + log(z)) : -INFINITY;
    o->entropy = mx > -INFINITY ? (float)(log(z) - ez / z) : 0.0f;
    o->temperature = T, o->u = uu, o->drawn = -1, o->drawn_val = -INFINITY, o->drawn_rank = 0;
  }
  if (!(T > 0.0f) || !(mx > -INFINITY)) return; /* the whole block */

  /* the draw: each thread's chunk of consecutive ids summed in double, the chunks' prefix
   * by one thread, then the chunk where u x sum falls walked in id order */
  const float inv_t = 1.0f / T;
  const int C = (n + (int)blockDim.x - 1) / (int)blockDim.x, lo = tid * C < n ? tid * C : n,
            hi = lo + C < n ? lo + C : n;
  double cs = 0;
  for (int i = lo; i < hi; i++) cs += expf((clean_logit(x[i]) - mx) * inv_t);
  __shared__ double pre[256];
  __shared__ double target;
  __shared__ int over; /* the last chunk with mass: takes a target that rounding put past the sum */
  __shared__ int32_t drawn;
  pre[tid] = cs;
  __syncthreads();
  if (tid == 0) {
    double acc = 0;
    int last = -1;
    for (int t = 0; t < (int)blockDim.x; t++) {
      const double c = pre[t];
      pre[t] = acc;
      acc += c;
      if (c > 0) last = t;
    }
    target = uu * acc;
    over = target >= acc ? last : -1;
    drawn = -1;
  }
  __syncthreads();
  if ((cs > 0 && pre[tid] <= target && target < pre[tid] + cs) || tid == over) {
    double cum = pre[tid];
    int32_t d = -1;
    for (int i = lo; i < hi; i++) {
      const float p = expf((clean_logit(x[i]) - mx) * inv_t);
      if (p <= 0.0f) continue;
      d = i; /* the chunk's last positive one, should rounding overrun */
      cum += p;
      if (target < cum) break;
    }
    drawn = d;
  }
  __syncthreads();
  if (drawn < 0) return; /* cannot happen: mx is finite, so some p is 1 */
  const float vt = clean_logit(x[drawn]);
  double above = 0;
  for (int i = tid; i < n; i += blockDim.x) above += clean_logit(x[i]) > vt;
  above = block_sum(above);
  if (tid == 0) o->drawn = drawn, o->drawn_val = vt, o->drawn_rank = 1 + (int32_t)above;
}

void kvl__cu_logits_top(const float *logits, int n_rows, int n_vocab, kvl_logit_top *top, const float *temp,
                        const double *u, cudaStream_t st) {
  if (n_rows > 0 && n_vocab > 0) KVL_LAUNCH(k_logits_top, n_rows, 256, st, logits, n_vocab, top, temp, u);
}

/* ---- decode products on the GGUF blocks themselves (KVL_CUDA_QGEMV) ------------------
 *
 * y[t][r] = sum_k W[r][k] x[t][k] for a few tokens, the weight rows read as the file
 * stores them (Q8_0, Q5_0, Q4_K, Q6_K: 1.06 .. 0.56 bytes per weight, against bf16's 2):
 * a decode step reads its weights once, so fewer bytes is less time where bandwidth
 * bounds it. One warp per row, each lane a 32-element unit at a time (a Q8_0 / Q5_0 block,
 * a k-quant's sub-block with its scale), dequantised in registers in fp32 exactly as the
 * reference (kvl_dequant_row_ref) does, multiplied with each token's x in fp32. */
__device__ inline float fp16_bits(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t b;
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-8f; /* m x 2^-24: zero or subnormal */
    memcpy(&b, &v, 4);
    b |= sign;
  } else if (e == 31) {
    b = sign | 0x7f800000u | (m << 13);
  } else {
    b = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &b, 4);
  return f;
}

__device__ inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* unit j (elements 32j .. 32j + 31) of a row of the given type */
__device__ inline void dq_unit(uint32_t type, const uint8_t *row, int j, float *o) {
  if (type == 8) { /* Q8_0: d, 32 codes */
    const uint8_t *b = row + (size_t)j * 34;
    const float d = fp16_bits(le16(b));
    for (int l = 0; l < 32; l++) o[l] = d * (float)(int8_t)b[2 + l];
  } else if (type == 6) { /* Q5_0: d, 32 fifth bits, 16 bytes of nibbles */
    const uint8_t *b = row + (size_t)j * 22;
    const float d = fp16_bits(le16(b));
    const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    for (int l = 0; l < 16; l++) {
      o[l] = d * (float)((int)((b[6 + l] & 0xf) | (((qh >> l) & 1u) << 4)) - 16);
      o[l + 16] = d * (float)((int)((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1u) << 4)) - 16);
    }
  } else if (type == 12) { /* Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
    const uint8_t *b = row + (size_t)(j / 8) * 144, *sc = b + 4, *q = b + 16 + (j % 8 / 2) * 32;
    const int s = j % 8;
    int scl, mn;
    if (s < 4) {
      scl = sc[s] & 63, mn = sc[s + 4] & 63;
    } else {
      scl = (sc[s + 4] & 0xf) | ((sc[s - 4] >> 6) << 4);
      mn = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
    const float d = fp16_bits(le16(b)) * (float)scl, m = fp16_bits(le16(b + 2)) * (float)mn;
    for (int l = 0; l < 32; l++) o[l] = d * (float)((s & 1) ? q[l] >> 4 : q[l] & 0xf) - m;
  } else { /* Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d */
    const uint8_t *b = row + (size_t)(j / 8) * 210;
    const int s = j % 8, half = s / 4, qd = s % 4;
    const uint8_t *ql = b + half * 64 + (qd & 1) * 32, *qh = b + 128 + half * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + half * 8 + qd * 2;
    const float d = fp16_bits(le16(b + 208));
    for (int l = 0; l < 32; l++) {
      const int lo = qd < 2 ? ql[l] & 0xf : ql[l] >> 4;
      const int q = (lo | (((qh[l] >> (2 * qd)) & 3) << 4)) - 32;
      o[l] = d * (float)sc[l / 16] * (float)q;
    }
  }
}

__global__ void k_qgemv(const uint8_t *w, uint32_t type, int64_t row_bytes, const float *x, float *y, int rows,
                        int cols, int n_tokens) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= rows) return; /* a whole warp */
  const uint8_t *row = w + (int64_t)r * row_bytes;
  float acc[KVL__CU_QGEMV_MAX_T];
  for (int t = 0; t < KVL__CU_QGEMV_MAX_T; t++) acc[t] = 0.0f;
  float u[32];
  for (int j = lane; j < cols / 32; j += 32) {
    dq_unit(type, row, j, u);
    for (int t = 0; t < n_tokens; t++) {
      const float *xt = x + (int64_t)t * cols + (int64_t)j * 32;
      float a = 0.0f;
      for (int l = 0; l < 32; l++) a += u[l] * xt[l];
      acc[t] += a;
    }
  }
  for (int t = 0; t < n_tokens; t++) {
    float a = acc[t];
    for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(0xffffffffu, a, o);
    if (lane == 0) y[(int64_t)t * rows + r] = a;
  }
}

bool kvl__cu_qgemv_takes(uint32_t type, int64_t cols) {
  if (type == 8 || type == 6) return cols % 32 == 0;
  if (type == 12 || type == 14) return cols % 256 == 0;
  return false;
}

void kvl__cu_qgemv(const void *w, uint32_t type, size_t row_bytes, const float *x, float *y, int rows, int cols,
                   int n_tokens, cudaStream_t st) {
  if (rows > 0 && n_tokens > 0)
    KVL_LAUNCH(k_qgemv, blocks_for(rows, 4), 128, st, (const uint8_t *)w, type, (int64_t)row_bytes, x, y, rows, cols,
               n_tokens);
}

KVL_CU_END
