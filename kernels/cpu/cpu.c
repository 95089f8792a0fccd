/* cpu.c — the CPU backend: OpenMP across rows/tokens/heads, SIMD levels chosen at run
 * time (AMX int8, AVX-512 VNNI with or without its tokens-in-lanes kernel, AVX-512F, AVX2
 * with or without its int8 kernels, portable C), forceable with KVL_CPU=level.
 *
 * A matmul takes, in this order: the whole-matmul int8 kernels (AMX tiles, or AVX-512 VNNI
 * or AVX2 with tokens in lanes; batches from qmatmul_min_t tokens), the int8
 * decode kernels (up to 16 tokens), bf16 GEMMs through oneDNN (the avx512bf16 level), or
 * fp32: weights dequantised a chunk of rows at a time, then the level's outer-product
 * kernel (gemm_xt, batch-invariant) or, on the portable level, gemm_tile. */
#include <cpuid.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backend-impl.h"
#include "kvl_error.h"

#define KVL__ROWS 16 /* weight rows dequantised per tile */

/* KVL_DECODE=exact turns the int8-activation decode path off (fp32 everywhere). */
static bool int8_decode_enabled(void) {
  static int on = -1;
  if (on < 0) {
    const char *e = getenv("KVL_DECODE");
    on = !(e && !strcmp(e, "exact"));
  }
  return on;
}

/* KVL_DECODE=scalar-scales keeps the per-token scalar kernels for 2..16 tokens (the
 * vector-scale ones are the default; both are tested). */
static bool vec_decode_enabled(void) {
  static int on = -1;
  if (on < 0) {
    const char *e = getenv("KVL_DECODE");
    on = !(e && !strcmp(e, "scalar-scales"));
  }
  return on;
}

/* The most tokens a product takes on the int8 decode kernels: the level's own limit, or
 * KVL_DECODE_INT8_MAX=N (1..KVL__QDOT_USE_T; 0 = never) for measuring where the crossover
 * with fp32 lies on a processor (bench/README.md). */
static int qdot_max_t(const kvl_backend_t *be) {
  static int env = -2;
  if (env == -2) {
    const char *e = getenv("KVL_DECODE_INT8_MAX");
    env = e && *e ? atoi(e) : -1;
    if (env > KVL__QDOT_USE_T) env = KVL__QDOT_USE_T;
  }
  if (env >= 0) return env;
  return be->qdot_max_t ? be->qdot_max_t : KVL__QDOT_USE_T;
}

static bool qdot_type(uint32_t t) {
  return t == KVL_TYPE_Q8_0 || t == KVL_TYPE_Q5_0 || t == KVL_TYPE_Q4_K || t == KVL_TYPE_Q6_K;
}

/* Small batches on quantised weights: activations to int8 once, then one pass over the
 * weight rows with VNNI dot products. */
/* The activations of n_tokens rows of K to int8 per 32 (codes, scales, sums of 16: the
 * layout kvl__q8_act documents), in three new arrays the caller frees. */
static void q8_acts(const kvl_backend_t *be, const float *x, int64_t K, int n_tokens, int8_t **xq, float **xd,
                    int32_t **xs) {
  KVL_ASSERT(be->q8_act);
  *xq = malloc((size_t)n_tokens * (size_t)K);
  *xd = malloc((size_t)n_tokens * (size_t)(K / 32) * sizeof(float));
  *xs = malloc((size_t)n_tokens * (size_t)(K / 16) * sizeof(int32_t));
  KVL_ASSERT(*xq && *xd && *xs);
#pragma omp parallel for schedule(static) if (n_tokens > 16)
  for (int t = 0; t < n_tokens; t++)
    be->q8_act(x + (int64_t)t * K, K, *xq + (int64_t)t * K, *xd + (int64_t)t * (K / 32), *xs + (int64_t)t * (K / 16));
}

void kvl__q4_k_act_factors(const float *xd, const int32_t *xs, int64_t K, float *xf) {
  for (int64_t b = 0; b < K / 256; b++)
    for (int i = 0; i < 8; i++) {
      const float d = xd[8 * b + i];
      xf[16 * b + i] = d;
      xf[16 * b + 8 + i] = d * (float)(xs[16 * b + 2 * i] + xs[16 * b + 2 * i + 1]);
    }
}

void kvl__q5_0_quads_pack(const void *src, void *dst, int64_t rows, int64_t K) {
  const int64_t nb = K / 32;
  const size_t rb = (size_t)nb * 22;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *s = (const uint8_t *)src + (size_t)r * rb;
    uint8_t *d = (uint8_t *)dst + (size_t)r * rb, *q = d + 2 * nb;
    for (int64_t b = 0; b < nb; b++) memcpy(d + 2 * b, s + 22 * b, 2);
    for (int64_t b = 0; b < nb; b += 4, q += 80) {
      uint64_t lo = 0, hi = 0;
      for (int k = 0; k < 4; k++) {
        const uint8_t *blk = s + 22 * (b + k);
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        memcpy(q + 16 * k, blk + 6, 16);
        lo |= (uint64_t)(qh & 0xffffu) << (16 * k);
        hi |= (uint64_t)(qh >> 16) << (16 * k);
      }
      memcpy(q + 64, &lo, 8);
      memcpy(q + 72, &hi, 8);
    }
  }
}

/* Q4_K with its 6-bit scales and mins unpacked to bytes (KVL__TYPE_Q4_K_SB): per block
 * d, dmin (fp16), the eight scales, the eight mins, the 128 code bytes (148 bytes) */
void kvl__q4_k_sb_pack(const void *src, void *dst, int64_t rows, int64_t K) {
  const int64_t nb = K / 256;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *s = (const uint8_t *)src + (size_t)r * (size_t)nb * 144;
    uint8_t *d = (uint8_t *)dst + (size_t)r * (size_t)nb * KVL__Q4_K_SB_BYTES;
    for (int64_t b = 0; b < nb; b++, s += 144, d += KVL__Q4_K_SB_BYTES) {
      const uint8_t *q = s + 4;
      memcpy(d, s, 4);
      for (int j = 0; j < 8; j++) {
        d[4 + j] = j < 4 ? q[j] & 63 : (uint8_t)((q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4);
        d[12 + j] = j < 4 ? q[j + 4] & 63 : (uint8_t)((q[j + 4] >> 4) | (q[j] >> 6) << 4);
      }
      memcpy(d + 20, s + 16, 128);
    }
  }
}

void kvl__q8_0_sc_pack(const void *src, void *dst, int64_t rows, int64_t K) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *s = (const uint8_t *)src + (size_t)r * (size_t)nb * 34;
    uint8_t *d = (uint8_t *)dst + (size_t)r * (size_t)nb * 34, *q = d + 2 * nb;
    for (int64_t b = 0; b < nb; b++) {
      memcpy(d + 2 * b, s + 34 * b, 2);
      for (int i = 0; i < 32; i++) q[32 * b + i] = s[34 * b + 2 + i] ^ 0x80;
    }
  }
}

/* The one-token kernels' copies (KVL__TYPE_Q5_0_QUADS, KVL__TYPE_Q4_K_SB, KVL__TYPE_Q8_0_SC), made by
 * kvl_backend_prepare or at the weight's first decode product, kept in its kvl_wpack
 * slot. A copy is the matrix's size again (the GGUF bytes stay: prefill, the 7..16-token
 * kernels and the fp32 sink rows read them); KVL_DECODE_REPACK says which formats get one
 * (decode_repack below). */
static const char copy_owner = 'q';
/* The packers run on the calling thread alone, no OpenMP: the daemon prepares its models
 * (kvl_model_prepare) on its main thread or a libuv worker, and a parallel region there
 * gave that thread an OpenMP pool of its own beside the compute thread's. With more
 * OpenMP threads than CPUs, libgomp's workers spin only briefly before sleeping, so every
 * region of every forward pass paid a wake-up: a switch's first token (bench/switch-ttft.py
 * -c 64, in turn) 95 -> 68-73 ms (1.5B -> 0.5B) and 233-238 -> 186-206 ms (0.5B -> 1.5B)
 * once the packers went serial, re-prefills 10-15 % faster. */
static pthread_mutex_t copy_mu = PTHREAD_MUTEX_INITIALIZER;
struct decode_copy { void *mem; size_t mapped, row_bytes; uint32_t type; };

static void copy_release(struct kvl_wpack *p) {
  struct decode_copy *k = p->impl;
  kvl_huge_free(k->mem, k->mapped);
  kvl__wpack_count(-(long long)p->bytes);
  free(k);
  p->impl = NULL, p->bytes = 0, p->owner = NULL, p->release = NULL;
}

/* KVL_DECODE_REPACK: which formats get a copy, a comma-separated list of q5_0, q4_k, q8_0
 * (or all, or 0); default q5_0. Bits: 1 Q5_0, 2 Q4_K, 4 Q8_0. The Q4_K and Q8_0 copies
 * are off by default: their kernels are faster on a matrix in L3 (test-backend-ops --perf,
 * 4864 x 1536, one token, a Zen 4: Q4_K 46 -> 53 GB/s, Q8_0 57 -> 88), but the models'
 * tg128 did not move beyond the noise (bench-prefill-decode -p 0 -n 128 -r 5, in turn:
 * the 1.5B with Q4_K's, five pairs, +0.3 tokens/s on ~36, for 613 MiB more; the 0.5B
 * with Q8_0's (its output head), six pairs, median +0.8 on ~92, for 139 MiB more): those
 * products wait on memory, not on the unpacking. Q5_0's moved the 0.5B 74 -> 94. */
static int decode_repack(void) {
  static int on = -1;
  if (on < 0) {
    const char *e = getenv("KVL_DECODE_REPACK");
    on = e ? 0 : 1;
    for (const char *t = e; t && *t;) {
      const size_t n = strcspn(t, ",");
      static const struct { const char *name; int bits; } names[] = {{"q5_0", 1}, {"q4_k", 2}, {"q8_0", 4},
                                                                    {"all", 7},  {"0", 0},    {"off", 0}};
      const size_t nn = sizeof(names) / sizeof(names[0]);
      size_t k = 0;
      while (k < nn && !(strlen(names[k].name) == n && !strncmp(t, names[k].name, n))) k++;
      if (k == nn)
        fprintf(stderr, "kvlingo: KVL_DECODE_REPACK=%s: '%.*s' is not q5_0, q4_k, q8_0, all or 0; ignored\n", e,
                (int)n, t);
      else on |= names[k].bits;
      t += n + (t[n] == ',');
    }
    if (!int8_decode_enabled()) on = 0;
  }
  return on;
}

const void *kvl__decode_copy(const struct kvl_weight *w, uint32_t *type, size_t *row_bytes) {
  struct kvl_wpack *p = w->pack;
  const int want = w->type == KVL_TYPE_Q5_0 && w->cols % 128 == 0   ? 1
                   : w->type == KVL_TYPE_Q4_K && w->cols % 256 == 0 ? 2
                   : w->type == KVL_TYPE_Q8_0 && w->cols % 64 == 0  ? 4
                                                                     : 0;
  if (!p || !(decode_repack() & want)) return NULL;
  struct decode_copy *k = __atomic_load_n((struct decode_copy **)&p->impl, __ATOMIC_ACQUIRE);
  if (!k) {
    pthread_mutex_lock(&copy_mu);
    if (!p->impl) {
      const size_t rb = want == 2 ? (size_t)(w->cols / 256) * KVL__Q4_K_SB_BYTES
                                  : kvl_row_size(w->type, (uint64_t)w->cols);
      const size_t bytes = rb * (size_t)w->rows;
      struct decode_copy *n = malloc(sizeof(*n));
      if (n && (n->mem = kvl_huge_alloc(bytes, &n->mapped))) {
        if (want == 1) kvl__q5_0_quads_pack(w->data, n->mem, w->rows, w->cols);
        else if (want == 2) kvl__q4_k_sb_pack(w->data, n->mem, w->rows, w->cols);
        else kvl__q8_0_sc_pack(w->data, n->mem, w->rows, w->cols);
        n->row_bytes = rb;
        n->type = want == 1 ? KVL__TYPE_Q5_0_QUADS : want == 2 ? KVL__TYPE_Q4_K_SB : KVL__TYPE_Q8_0_SC;
        p->bytes = bytes, p->owner = &copy_owner, p->release = copy_release;
        kvl__wpack_count((long long)bytes);
        __atomic_store_n((struct decode_copy **)&p->impl, n, __ATOMIC_RELEASE);
      } else free(n);
    }
    pthread_mutex_unlock(&copy_mu);
    k = __atomic_load_n((struct decode_copy **)&p->impl, __ATOMIC_ACQUIRE);
  }
  if (!k || p->owner != &copy_owner) return NULL;
  *type = k->type, *row_bytes = k->row_bytes;
  return k->mem;
}

static void qdot_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  const int64_t K = w->cols, N = w->rows;
  const size_t rb = kvl_row_size(w->type, (uint64_t)K);
  int8_t *xq;
  float *xd;
  int32_t *xs;
  q8_acts(be, x, K, n_tokens, &xq, &xd, &xs);
  /* up to KVL__QDOT1_MAX_T tokens: each token's codes also in the order the format's
   * single-token kernel reads them (kvl__qdot1_*), and that kernel once per token on a row
   * while it is in L1. On a Zen 5 two tokens cost 0.37 ms through the several-token kernel
   * and two single-token passes 0.2 (Q4_K, 4864 x 1536; test-backend-ops --perf); the 1.5B's
   * decode step with 2 / 3 streams went from 84 / 93 ms to 47 / 64 (bench-gen-throughput).
   * qdot1n runs the same kernel for all the tokens at once (where it has the format), each block
   * unpacked once (bit-identical per token); on a Zen 4, 2 / 4 streams 58-64 / 99-114 ms ->
   * 47 / 77-82 (in turn); at 8 tokens it lost to the lanes kernel (176 against 162 ms). */
  int8_t *xp = NULL, *xp_own = NULL;
  float *xf = NULL; /* Q4_K: the per-token scale factors (kvl__q4_k_act_factors) */
  if (n_tokens <= KVL__QDOT1_MAX_T && be->qdot1) {
    xp = xq; /* natural order unless the level reads another */
    if (be->q8_order) {
      xp = xp_own = malloc((size_t)n_tokens * (size_t)K);
      KVL_ASSERT(xp);
      for (int t = 0; t < n_tokens; t++) be->q8_order(w->type, xq + (int64_t)t * K, K, xp + (int64_t)t * K);
    }
    if (w->type == KVL_TYPE_Q4_K) {
      xf = malloc((size_t)n_tokens * (size_t)(K / 16) * sizeof(float));
      KVL_ASSERT(xf);
      for (int t = 0; t < n_tokens; t++)
        kvl__q4_k_act_factors(xd + (int64_t)t * (K / 32), xs + (int64_t)t * (K / 16), K, xf + (int64_t)t * (K / 16));
    }
  }
  /* 1..6 tokens: the weight's copy for these kernels where it has one (kvl__decode_copy) */
  uint32_t wt = w->type;
  const void *wd = w->data;
  size_t rb1 = rb;
  if (xp && be->decode_copies) {
    const void *c = kvl__decode_copy(w, &wt, &rb1);
    if (c) wd = c;
  }
  /* several tokens: the per-token scales as vectors, prepared once (kvl__qdot_vec_*) */
  float *sx = NULL, *cx = NULL;
  if (!xp && n_tokens >= 2 && be->qdot_vec && K % 64 == 0 && vec_decode_enabled()) {
    sx = malloc((size_t)n_tokens * (size_t)(K / 4) * sizeof(float));
    cx = malloc((size_t)n_tokens * (size_t)(K / 4) * sizeof(float));
    KVL_ASSERT(sx && cx);
    for (int t = 0; t < n_tokens; t++)
      kvl__q8_act_vec(xd + (int64_t)t * (K / 32), xs + (int64_t)t * (K / 16), K, sx + (int64_t)t * (K / 4),
                      cx + (int64_t)t * (K / 4));
  }
  /* Static: each thread reads one contiguous half of the matrix, a stream the hardware
   * prefetcher follows; with dynamic chunks of 64 rows the threads hopped between 40 KiB
   * pieces and decode read the 0.5B's small matrices at ~55 % of the bandwidth. On the
   * Zen 5, tg128 went 66 -> 88 tokens/s (0.5B) and 32 -> 41 (1.5B), back to back. */
  /* one token on a level with a row loop: each thread's contiguous rows in one call */
  int rows_rc = n_tokens == 1 && xp && be->qdot1_rows ? 0 : -1;
  if (rows_rc == 0) {
#pragma omp parallel reduction(| : rows_rc)
    {
      const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
      const int64_t r0 = N * id / nt, r1 = N * (id + 1) / nt;
      if (r1 > r0)
        rows_rc |= be->qdot1_rows(wt, (const uint8_t *)wd + (size_t)r0 * rb1, rb1, r1 - r0, K, xq, xp, xd, xs, xf,
                                  w->bias ? w->bias + r0 : NULL, y + r0);
    }
  }
  if (rows_rc != 0) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
      const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb, *row1 = (const uint8_t *)wd + (size_t)r * rb1;
      float v[KVL__QDOT_MAX_T];
      if (xp) {
        if (n_tokens < 2 || !be->qdot1n || be->qdot1n(wt, row1, K, n_tokens, xq, xp, xd, xs, xf, v) != 0)
          for (int t = 0; t < n_tokens; t++)
            be->qdot1(wt, row1, K, xq + (int64_t)t * K, xp + (int64_t)t * K, xd + (int64_t)t * (K / 32),
                      xs + (int64_t)t * (K / 16), xf ? xf + (int64_t)t * (K / 16) : NULL, v + t);
      } else if (sx) be->qdot_vec(w->type, row, K, xq, sx, cx, n_tokens, v);
      else be->qdot(w->type, row, K, xq, xd, xs, n_tokens, v);
      for (int t = 0; t < n_tokens; t++) y[(int64_t)t * N + r] = v[t] + (w->bias ? w->bias[r] : 0.0f);
    }
  }
  free(xp_own);
  free(xf);
  free(sx);
  free(cx);
  free(xq);
  free(xd);
  free(xs);
}

static inline const struct kvl__simd *S(const kvl_backend_t *be) { return be->simd; }

static bool cpu_supports(const kvl_backend_t *be, enum kvl_op op, uint32_t wtype) {
  (void)be;
  if (op == KVL_OP_MATMUL || op == KVL_OP_EMBED) {
    const struct kvl_type_traits *t = kvl_type_traits(wtype);
    return t && t->can_dequant;
  }
  return op < KVL_OP_COUNT_;
}

/* Products on the levels with an outer-product kernel (kvl__simd.gemm_xt: AVX2, AVX-512F),
 * for every size: a token's result is the same bits alone or in any batch, so the level
 * is its own exact twin. The activations are interleaved 16 tokens at a time once per
 * product. The weights go by chunks of R rows and ranges of KVL__XT_K elements: each
 * (chunk, range) is dequantised into a buffer that stays in L2 and meets every group of
 * tokens, the sums carried across ranges in y (exact), so the activations are re-read
 * once per chunk of rows, not once per handful of rows. */
#define KVL__XT_K 1024  /* elements per range of k (a multiple of every block size) */
#define KVL__XT_ROWS 96 /* rows per chunk at most: 96 x 1024 fp32 = 384 KiB */

static void xt_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  const struct kvl__simd *s = S(be);
  const int64_t K = w->cols, N = w->rows;
  const size_t rb = kvl_row_size(w->type, (uint64_t)K);
  const struct kvl_type_traits *tr = kvl_type_traits(w->type);
  const int64_t bs = tr->blck;
  const size_t bb = tr->type_size;
  const bool dense = w->type == KVL_TYPE_F32;
  const int n_groups = (n_tokens + 15) / 16;
  float *xg = aligned_alloc(64, (size_t)n_groups * (size_t)K * 16 * sizeof(float));
  KVL_ASSERT(xg);
#pragma omp parallel for schedule(static) if (n_groups > 1)
  for (int g = 0; g < n_groups; g++) {
    float *d = xg + (size_t)g * (size_t)K * 16;
    for (int j = 0; j < 16; j++) {
      const int t = 16 * g + j;
      if (t < n_tokens)
        for (int64_t k = 0; k < K; k++) d[k * 16 + j] = x[(int64_t)t * K + k];
      else
        for (int64_t k = 0; k < K; k++) d[k * 16 + j] = 0.0f;
    }
  }
  /* chunks: at most KVL__XT_ROWS rows, and at least 4 per thread when the matrix is short */
  int R = KVL__XT_ROWS;
  const int per = (int)(N / (4 * omp_get_max_threads())) / 6 * 6;
  if (per < R) R = per < 6 ? 6 : per;
  const int64_t n_chunks = (N + R - 1) / R;
  const int64_t kr = KVL__XT_K / bs * bs > 0 ? KVL__XT_K / bs * bs : bs; /* ranges of whole blocks */
#pragma omp parallel
  {
    float *wf = dense ? NULL : malloc((size_t)R * (size_t)kr * sizeof(float));
    KVL_ASSERT(dense || wf);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < n_chunks; c++) {
      const int64_t r0 = c * R;
      const int nr = (int)(N - r0 < R ? N - r0 : R);
      for (int64_t k0 = 0; k0 < K; k0 += kr) {
        const int64_t kn = K - k0 < kr ? K - k0 : kr;
        const float *wt;
        int64_t ldw;
        if (dense) {
          wt = (const float *)w->data + r0 * K + k0, ldw = K;
        } else {
          for (int r = 0; r < nr; r++)
            s->dequant(w->type, (const uint8_t *)w->data + (size_t)(r0 + r) * rb + (size_t)(k0 / bs) * bb,
                       wf + (size_t)r * kn, kn);
          wt = wf, ldw = kn;
        }
        for (int g = 0; g < n_groups; g++) {
          const int nt = n_tokens - 16 * g < 16 ? n_tokens - 16 * g : 16;
          s->gemm_xt(wt, ldw, nr, xg + (size_t)g * (size_t)K * 16 + (size_t)k0 * 16, nt, y + (int64_t)16 * g * N + r0,
                     N, kn, k0 > 0);
        }
      }
      if (w->bias)
        for (int t = 0; t < n_tokens; t++)
          for (int r = 0; r < nr; r++) y[(int64_t)t * N + r0 + r] += w->bias[r0 + r];
    }
    free(wf);
  }
  free(xg);
}

/* Batched decode and prefill on AMX int8 tiles or AVX2: the activations to int8 as for the
 * decode kernels, then 16 weight rows x 16 tokens per tile product (cpu/qdot_amx.c), or 4
 * rows x 8 tokens per block of vectors (cpu/qmatmul_avx2.c). Each
 * token's result depends on its own activations only, so a prompt's cache does not
 * depend on how its prefill was chunked. Nonzero: the kernel refused (a width it does not
 * tile); compute it another way. */
static int qmatmul_call(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  const int64_t K = w->cols, N = w->rows;
  if (K % 64) return KVL_EINVAL;
  int8_t *xq;
  float *xd;
  int32_t *xs;
  q8_acts(be, x, K, n_tokens, &xq, &xd, &xs);
  int rc = be->qmatmul(w->type, w->data, kvl_row_size(w->type, (uint64_t)K), N, K, xq, xd, xs, n_tokens, w->bias, y);
  free(xq);
  free(xd);
  free(xs);
  return rc;
}

/* One token on the sink twins (kvl_backend.row_dots): each thread dots its rows with x one
 * at a time (k along the lanes), dequantised in registers where the level can
 * (kvl__simd.dequant_dot), else into a buffer that stays in L1/L2. The outer-product kernel
 * (xt_matmul) gives a lone token the bits it would have in any batch, at one FMA per
 * weight with fifteen of sixteen lanes idle; the sink's rows need no batch to match (they
 * are always computed alone). On a Zen 4 the 1.5B's fp32 sink row took ~0.33 s that way,
 * ~10 % of bench-gen-throughput -c 16 whose prompts start with 16 different tokens; ~0.15 s
 * through the buffer; ~0.08 s dequantised in registers (bench-prefill-decode -p 1 -n 0: one
 * position-0 token with its logits, 120-150 -> 78-80 ms in turn). */
static void row_dot_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y) {
  const struct kvl__simd *s = S(be);
  const int64_t K = w->cols, N = w->rows;
  const size_t rb = kvl_row_size(w->type, (uint64_t)K);
  const bool dense = w->type == KVL_TYPE_F32;
  /* where the level dots a quantised row without dequantising it into a buffer
   * (kvl__simd.dequant_dot: about half the vector operations), x's sums of 16 for it */
  float *xs = NULL;
  float probe;
  if (!dense && s->dequant_dot && K % 16 == 0 && (xs = malloc((size_t)(K / 16) * sizeof(float)))) {
    for (int64_t i = 0; i < K / 16; i++) {
      float a = 0.0f;
      for (int k = 0; k < 16; k++) a += x[16 * i + k];
      xs[i] = a;
    }
    if (s->dequant_dot(w->type, w->data, x, xs, 0, &probe) != 0) free(xs), xs = NULL; /* the format covered? */
  }
#pragma omp parallel
  {
    float *wf = dense || xs ? NULL : aligned_alloc(64, (size_t)((K + 15) / 16 * 16) * sizeof(float)); /* whole 64 bytes */
    KVL_ASSERT(dense || xs || wf);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; r++) {
      const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb;
      float v;
      if (xs) s->dequant_dot(w->type, row, x, xs, K, &v);
      else {
        if (!dense) s->dequant(w->type, row, wf, K);
        v = s->dot(dense ? (const float *)(const void *)row : wf, x, K);
      }
      y[r] = v + (w->bias ? w->bias[r] : 0.0f);
    }
    free(wf);
  }
  free(xs);
}

static void cpu_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  if (be->row_dots && n_tokens == 1) {
    row_dot_matmul(be, w, x, y);
    return;
  }
  if (be->qmatmul_min_t && n_tokens >= be->qmatmul_min_t && qdot_type(w->type) && int8_decode_enabled() &&
      qmatmul_call(be, w, x, y, n_tokens) == 0)
    return;
  if (be->qdot && n_tokens <= qdot_max_t(be) && qdot_type(w->type) && int8_decode_enabled()) {
    qdot_matmul(be, w, x, y, n_tokens);
    return;
  }
  if (be->bf16_min_t && n_tokens >= be->bf16_min_t && w->pack && kvl__bf16_matmul(S(be), w, x, y, n_tokens) == 0)
    return;
  if (S(be)->gemm_xt) {
    xt_matmul(be, w, x, y, n_tokens);
    return;
  }
  /* the portable level: a tile of rows dequantised, every token against it */
  const struct kvl__simd *s = S(be);
  const int64_t K = w->cols, N = w->rows;
  const size_t rb = kvl_row_size(w->type, (uint64_t)K);
  const int64_t n_tiles = (N + KVL__ROWS - 1) / KVL__ROWS;
  const bool dense = w->type == KVL_TYPE_F32;
#pragma omp parallel
  {
    float *wf = dense ? NULL : malloc((size_t)KVL__ROWS * (size_t)K * sizeof(float));
    float *yt = malloc((size_t)KVL__ROWS * 4 * sizeof(float));
    KVL_ASSERT((dense || wf) && yt);
#pragma omp for schedule(dynamic, 4)
    for (int64_t tile = 0; tile < n_tiles; tile++) {
      int64_t r0 = tile * KVL__ROWS;
      int nr = (int)(N - r0 < KVL__ROWS ? N - r0 : KVL__ROWS);
      const float *wt;
      if (dense) {
        wt = (const float *)w->data + r0 * K;
      } else {
        for (int r = 0; r < nr; r++)
          s->dequant(w->type, (const uint8_t *)w->data + (size_t)(r0 + r) * rb, wf + (size_t)r * K, K);
        wt = wf;
      }
      /* y[t][r0..r0+nr) for all tokens, 4 tokens at a time through a small buffer */
      for (int t = 0; t < n_tokens; t += 4) {
        int nt = n_tokens - t < 4 ? n_tokens - t : 4;
        s->gemm_tile(wt, nr, x + (int64_t)t * K, K, nt, yt, KVL__ROWS, K);
        for (int i = 0; i < nt; i++) {
          float *yr = y + (int64_t)(t + i) * N + r0;
          for (int r = 0; r < nr; r++) yr[r] = yt[i * KVL__ROWS + r] + (w->bias ? w->bias[r0 + r] : 0.0f);
        }
      }
    }
    free(wf);
    free(yt);
  }
}

static void cpu_rmsnorm(kvl_backend_t *be, const float *x, const float *w, float *y, int n_tokens, int n, float eps) {
  const struct kvl__simd *s = S(be);
#pragma omp parallel for schedule(static) if (n_tokens > 4)
  for (int t = 0; t < n_tokens; t++) {
    const float *xt = x + (size_t)t * n;
    float *yt = y + (size_t)t * n;
    float inv = 1.0f / sqrtf(s->dot(xt, xt, n) / (float)n + eps);
    for (int i = 0; i < n; i++) yt[i] = xt[i] * inv * w[i];
  }
}

static void cpu_rope(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens,
                     int n_heads, bool inverse) {
  (void)be;
  const int d = r->head_dim, h2 = d / 2;
#pragma omp parallel for schedule(static) if (n_tokens > 4)
  for (int t = 0; t < n_tokens; t++) {
    float c[256], sn[256];
    kvl_rope_table(r, pos[t], c, sn);
    if (inverse)
      for (int i = 0; i < h2; i++) sn[i] = -sn[i];
    for (int h = 0; h < n_heads; h++) {
      float *v = x + ((size_t)t * n_heads + h) * d;
      for (int i = 0; i < h2; i++) {
        float a = v[i], b = v[i + h2];
        v[i] = a * c[i] - b * sn[i];
        v[i + h2] = a * sn[i] + b * c[i];
      }
    }
  }
}

static void cpu_swiglu(kvl_backend_t *be, const float *g, const float *u, float *y, int64_t n) {
  const struct kvl__simd *s = S(be);
  const int64_t chunk = 4096;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; i += chunk) s->swiglu(g + i, u + i, y + i, n - i < chunk ? n - i : chunk);
}

static void cpu_embed(kvl_backend_t *be, const struct kvl_weight *table, const int32_t *ids, float *y, int n_tokens) {
  (void)be;
  kvl_embed_ref(table, ids, y, n_tokens);
}

/* A decode token's tile reads each block once, from wherever the pool put it (16 rows of
 * 2 x head_dim bytes, n_kv_head x that apart), and the widening's loads waited for memory
 * (perf annotate, the 1.5B at 16 decode streams: 60 % of the attention's samples on them).
 * test-backend-ops --perf, 16 decode streams of the 1.5B, four rounds in turn: AVX-512
 * 1024 positions 78-102 -> 73-83 ms, 256 positions 18.7-22.8 -> 18.4-19.2 ms; AVX2
 * (avx2int8mm) medians 78.8 -> 71.8 and 17.9 -> 16.3 ms. */
void kvl__attn_prefetch(const struct kvl_attn_args *a, const int32_t *bt, int j0, int nb, int kh, int last) {
  const struct kvl_kv_layout *l = a->kv;
  const size_t row = (size_t)l->head_dim * (l->dtype == KVL_KV_F32 ? 4 : 2), stride = (size_t)l->n_kv_head * row;
  for (int b = 0; b < nb && j0 + b * KVL_KV_BLOCK <= last; b++) {
    const int jb = j0 + b * KVL_KV_BLOCK, nj = last + 1 - jb < KVL_KV_BLOCK ? last + 1 - jb : KVL_KV_BLOCK;
    const char *k = (const char *)kvl_kv_k_ptr(l, (void *)a->kv_base, bt[jb / KVL_KV_BLOCK], a->layer) + kh * row;
    const char *v = (const char *)kvl_kv_v_ptr(l, (void *)a->kv_base, bt[jb / KVL_KV_BLOCK], a->layer) + kh * row;
    for (int j = 0; j < nj; j++)
      for (size_t c = 0; c < row; c += 64) {
        __builtin_prefetch(k + j * stride + c, 0, 3);
        __builtin_prefetch(v + j * stride + c, 0, 3);
      }
  }
}

int kvl__attn_tiles(const struct kvl_attn_args *a, int tq, int *tile) {
  int n = 0;
  for (int t = 0; t < a->n_tokens; t++)
    if (n == 0 || t - tile[n - 1] == tq || a->seq[t] != a->seq[t - 1] || a->pos[t] != a->pos[t - 1] + 1) tile[n++] = t;
  tile[n] = a->n_tokens;
  return n;
}

/* Whether the AVX-512 attention takes bf16 products (attn_avx512.c): the processor has
 * AVX512_BF16 (CPUID leaf 7, subleaf 1, EAX bit 5; clang 14's __builtin_cpu_supports does
 * not know it) and KVL_ATTN is not "fp32". Every AVX-512 level and its twins alike, so a
 * prompt's cache does not depend on which of them ran a chunk. */
bool kvl__attn_bf16(void) {
  static int on = -1;
  if (on < 0) {
    unsigned ea = 0, eb, ec, ed;
    const char *e = getenv("KVL_ATTN");
    on = __get_cpuid_count(7, 1, &ea, &eb, &ec, &ed) && (ea & (1u << 5)) && !(e && !strcmp(e, "fp32"));
  }
  return on;
}

/* Flash-style: for each (token, query head) an online softmax streamed over the cache
 * block by block; nothing of size positions x positions is materialised. */
static void cpu_attention(kvl_backend_t *be, const struct kvl_attn_args *a) {
  const struct kvl__simd *s = S(be);
  if (s == &kvl__simd_avx512 && kvl__attention_avx512_fits(a)) {
    kvl__attention_avx512(a, kvl__attn_bf16());
    return;
  }
  if (s == &kvl__simd_avx2 && kvl__attention_avx2_fits(a)) {
    kvl__attention_avx2(a);
    return;
  }
  const struct kvl_kv_layout *l = a->kv;
  const int d = l->head_dim, kvw = l->n_kv_head * d, group = a->n_head / l->n_kv_head;
  const int n_items = a->n_tokens * l->n_kv_head;
#pragma omp parallel
  {
    float *kb = malloc((size_t)KVL_KV_BLOCK * d * sizeof(float));
    float *vb = malloc((size_t)KVL_KV_BLOCK * d * sizeof(float));
    float *acc = malloc((size_t)group * d * sizeof(float));
    float *m = malloc((size_t)group * sizeof(float)), *lsum = malloc((size_t)group * sizeof(float));
    KVL_ASSERT(kb && vb && acc && m && lsum);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < n_items; item++) {
      int t = item / l->n_kv_head, kh = item % l->n_kv_head;
      const int32_t *bt = a->block_tables[a->seq[t]];
      int n = a->pos[t] + 1;
      for (int g = 0; g < group; g++) { m[g] = -INFINITY; lsum[g] = 0; }
      memset(acc, 0, (size_t)group * d * sizeof(float));
      for (int j0 = 0; j0 < n; j0 += KVL_KV_BLOCK) {
        int nj = n - j0 < KVL_KV_BLOCK ? n - j0 : KVL_KV_BLOCK;
        const void *ks = kvl_kv_k_ptr(l, (void *)a->kv_base, bt[j0 / KVL_KV_BLOCK], a->layer);
        const void *vs = kvl_kv_v_ptr(l, (void *)a->kv_base, bt[j0 / KVL_KV_BLOCK], a->layer);
        /* this KV head's rows of the block, as fp32 */
        for (int j = 0; j < nj; j++) {
          size_t off = (size_t)j * kvw + (size_t)kh * d;
          if (l->dtype == KVL_KV_F32) {
            memcpy(kb + j * d, (const float *)ks + off, (size_t)d * 4);
            memcpy(vb + j * d, (const float *)vs + off, (size_t)d * 4);
          } else {
            /* bf16 is the top half of an fp32: a shift, in a loop the compiler vectorises */
            const uint16_t *k16 = (const uint16_t *)ks + off, *v16 = (const uint16_t *)vs + off;
            uint32_t *kw = (uint32_t *)(kb + j * d), *vw = (uint32_t *)(vb + j * d);
            for (int i = 0; i < d; i++) {
              kw[i] = (uint32_t)k16[i] << 16;
              vw[i] = (uint32_t)v16[i] << 16;
            }
          }
        }
        for (int g = 0; g < group; g++) {
          const float *q = a->q + ((size_t)t * a->n_head + kh * group + g) * d;
          float sc[KVL_KV_BLOCK], bm = -INFINITY;
          for (int j = 0; j < nj; j++) {
            sc[j] = s->dot(q, kb + j * d, d) * a->scale;
            bm = sc[j] > bm ? sc[j] : bm;
          }
          float nm = bm > m[g] ? bm : m[g];
          float corr = expf(m[g] - nm); /* exp(-inf) = 0 on the first block */
          float *ag = acc + (size_t)g * d;
          if (corr != 1.0f) s->scale(corr, ag, d);
          lsum[g] *= corr;
          for (int j = 0; j < nj; j++) {
            float p = expf(sc[j] - nm);
            lsum[g] += p;
            s->axpy(p, vb + j * d, ag, d);
          }
          m[g] = nm;
        }
      }
      for (int g = 0; g < group; g++) {
        float *o = a->out + ((size_t)t * a->n_head + kh * group + g) * d;
        float inv = 1.0f / lsum[g];
        for (int i = 0; i < d; i++) o[i] = acc[(size_t)g * d + i] * inv;
      }
    }
    free(kb);
    free(vb);
    free(acc);
    free(m);
    free(lsum);
  }
}

static const struct kvl_backend_ops cpu_ops = {
  .supports = cpu_supports,
  .matmul = cpu_matmul,
  .rmsnorm = cpu_rmsnorm,
  .rope = cpu_rope,
  .swiglu = cpu_swiglu,
  .embed = cpu_embed,
  .attention = cpu_attention,
};

static kvl_backend_t be_scalar = {.name = "cpu-scalar", .ops = &cpu_ops, .simd = &kvl__simd_scalar};
static kvl_backend_t be_avx2 = {.name = "cpu-avx2", .ops = &cpu_ops, .simd = &kvl__simd_avx2};
/* AVX2 with the int8-activation decode kernels (vpmaddubsw) for 1..16 tokens; fp32 above */
static kvl_backend_t be_avx2int8 = {.name = "cpu-avx2-int8", .ops = &cpu_ops, .simd = &kvl__simd_avx2,
                                    .qdot = kvl__qdot_avx2, .qdot1 = kvl__qdot1_avx2, .qdot1n = kvl__qdot1n_avx2,
                                    .qdot1_rows = kvl__qdot1_rows_avx2,
                                    .q8_act = kvl__q8_act_avx2};
/* The same, with batches of 6 or more tokens on the tokens-in-lanes kernel (a vector holds
 * 8 tokens; below 6 the per-token kernels cost less: test-backend-ops --perf); its exact
 * twin (prefill chunks; the attention sink's rows go to fp32) takes that kernel for every
 * size, so a prompt's cache does not depend on its chunking. The AVX2 default. */
static kvl_backend_t be_avx2int8mm = {.name = "cpu-avx2-int8-mm", .ops = &cpu_ops, .simd = &kvl__simd_avx2,
                                      .qdot = kvl__qdot_avx2, .qdot1 = kvl__qdot1_avx2, .qdot1n = kvl__qdot1n_avx2,
                                      .qdot1_rows = kvl__qdot1_rows_avx2,
                                      .q8_act = kvl__q8_act_avx2, .qmatmul = kvl__qmatmul_avx2, .qmatmul_min_t = 6};
static kvl_backend_t be_avx2int8mm_exact = {.name = "cpu-avx2-int8-mm-prefill", .ops = &cpu_ops,
                                            .simd = &kvl__simd_avx2, .q8_act = kvl__q8_act_avx2,
                                            .qmatmul = kvl__qmatmul_avx2, .qmatmul_min_t = 1};
static kvl_backend_t be_avx512 = {.name = "cpu-avx512", .ops = &cpu_ops, .simd = &kvl__simd_avx512};
/* the fp32 twins of the int8 levels (kvl_backend_fp32: the attention sink, captures):
 * their level's fp32 products, and one-token products as dot products (row_dot_matmul) */
static kvl_backend_t be_avx512_sink = {.name = "cpu-avx512-fp32", .ops = &cpu_ops, .simd = &kvl__simd_avx512,
                                       .row_dots = true};
static kvl_backend_t be_avx2_sink = {.name = "cpu-avx2-fp32", .ops = &cpu_ops, .simd = &kvl__simd_avx2,
                                     .row_dots = true};
#define VNNI_DECODE                                                                                            \
  .q8_act = kvl__q8_act, .qdot = kvl__qdot_avx512vnni, .qdot1 = kvl__qdot1_avx512vnni, .q8_order = kvl__q8_order, \
  .qdot1n = kvl__qdot1n_avx512vnni, .qdot1_rows = kvl__qdot1_rows_avx512vnni,                                \
  .qdot_vec = kvl__qdot_vec_avx512vnni
/* The int8 levels keep decode copies in the weights' kvl_wpack slots (kvl__decode_copy);
 * the avx512bf16 level does not: the slot holds its bf16 copy for prefill. */
static kvl_backend_t be_avx512vnni = {.name = "cpu-avx512-vnni", .ops = &cpu_ops, .simd = &kvl__simd_avx512, VNNI_DECODE,
                                      .decode_copies = true};
/* The same, with batches of 7 or more tokens on the tokens-in-lanes kernel (16 per vector,
 * vpdpbusd: it costs about the same for 4 tokens as for 16); up to 6 the single-token
 * kernel runs once per token, or for all of them at once (qdot_matmul). On a Zen 5, the 1.5B's decode step (ITL p50,
 * bench-gen-throughput -n 64) with the lanes kernel from 4 tokens: 4 streams 134 ms, 8
 * streams 131; with the single-token kernel per token: 4 streams 84, 6 115, 8 154. Its
 * exact twin takes the lanes kernel for every size (int8 prefill).
 * The default where AVX-512 VNNI is present and AMX is not (AMD Zen 4/5, Intel before
 * Sapphire Rapids). */
static kvl_backend_t be_avx512vnnimm = {.name = "cpu-avx512-vnni-mm", .ops = &cpu_ops, .simd = &kvl__simd_avx512,
                                        VNNI_DECODE, .qmatmul = kvl__qmatmul_avx512vnni, .qmatmul_min_t = 7,
                                        .decode_copies = true};
static kvl_backend_t be_avx512vnnimm_exact = {.name = "cpu-avx512-vnni-mm-prefill", .ops = &cpu_ops,
                                              .simd = &kvl__simd_avx512, .q8_act = kvl__q8_act,
                                              .qmatmul = kvl__qmatmul_avx512vnni, .qmatmul_min_t = 1};
/* AMX int8 tiles for decode batches of 4 or more tokens on the four int8 formats (the
 * VNNI kernels below that: a tile product costs the same for 1 and 16 tokens, and at 4
 * both cost the same); its exact twin (prefill chunks; the attention sink's rows go to
 * fp32) takes the tiles for every size, so a prompt's cache does not depend on its
 * chunking. */
static kvl_backend_t be_amx = {.name = "cpu-amx-int8", .ops = &cpu_ops, .simd = &kvl__simd_avx512, VNNI_DECODE,
                               .qmatmul = kvl__qmatmul_amx, .qmatmul_min_t = 4, .decode_copies = true};
static kvl_backend_t be_amx_exact = {.name = "cpu-amx-int8-prefill", .ops = &cpu_ops, .simd = &kvl__simd_avx512,
                                     .q8_act = kvl__q8_act,
                                     .qmatmul = kvl__qmatmul_amx, .qmatmul_min_t = 1};
/* bf16 GEMMs (oneDNN, AMX where present) for every product above the int8 decode sizes;
 * its exact twin (prefill chunks, the attention sink) takes bf16 for every size, so a
 * prompt's cache does not depend on how its prefill was chunked. */
static kvl_backend_t be_avx512bf16 = {.name = "cpu-avx512-bf16", .ops = &cpu_ops, .simd = &kvl__simd_avx512, VNNI_DECODE,
                                      .bf16_min_t = KVL__QDOT_USE_T + 1};
static kvl_backend_t be_avx512bf16_exact = {.name = "cpu-avx512-bf16-prefill", .ops = &cpu_ops,
                                            .simd = &kvl__simd_avx512, .bf16_min_t = 1};

/* F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know
 * "f16c", and the fuzz build (tests/fuzz/README.md) is a clang build */
static bool has_f16c(void) {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

kvl_backend_t *kvl_backend_cpu_level(const char *level) {
  __builtin_cpu_init();
  if (!strcmp(level, "scalar")) return &be_scalar;
  if (!strcmp(level, "avx2"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &be_avx2 : NULL;
  const bool avx2i8 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  if (!strcmp(level, "avx2int8")) return avx2i8 ? &be_avx2int8 : NULL;
  if (!strcmp(level, "avx2int8mm")) return avx2i8 ? &be_avx2int8mm : NULL;
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
  if (!strcmp(level, "avx512")) return avx512 ? &be_avx512 : NULL;
  if (!strcmp(level, "avx512vnni")) return avx512 && __builtin_cpu_supports("avx512vnni") ? &be_avx512vnni : NULL;
  if (!strcmp(level, "avx512vnnimm"))
    return avx512 && __builtin_cpu_supports("avx512vnni") && has_f16c() ? &be_avx512vnnimm : NULL;
  if (!strcmp(level, "amx")) return avx512 && __builtin_cpu_supports("avx512vnni") && kvl__amx_usable() ? &be_amx : NULL;
  if (!strcmp(level, "avx512bf16"))
    return avx512 && __builtin_cpu_supports("avx512vnni") && kvl__bf16_gemm_usable() ? &be_avx512bf16 : NULL;
  return NULL;
}

kvl_backend_t *kvl_backend_exact(kvl_backend_t *be) {
  if (be == &be_avx512bf16) return &be_avx512bf16_exact;
  if (be == &be_amx) return &be_amx_exact;
  if (be == &be_avx2int8) return &be_avx2;
  if (be == &be_avx2int8mm) return &be_avx2int8mm_exact;
  if (be == &be_avx512vnnimm) return &be_avx512vnnimm_exact;
  return be == &be_avx512vnni ? &be_avx512 : be;
}

kvl_backend_t *kvl_backend_fp32(kvl_backend_t *be) {
  if (be == &be_avx512vnni || be == &be_avx512vnnimm || be == &be_avx512vnnimm_exact || be == &be_amx ||
      be == &be_amx_exact || be == &be_avx512bf16 || be == &be_avx512bf16_exact)
    return &be_avx512_sink;
  if (be == &be_avx2int8 || be == &be_avx2int8mm || be == &be_avx2int8mm_exact) return &be_avx2_sink;
  return be; /* scalar, avx2, avx512, the reference, other backends: fp32 already */
}

/* Denormal floats flushed to zero, as inputs (DAZ) and results (FTZ), on the calling
 * thread and its OpenMP team, once per thread (threads the team starts later copy the
 * setting from it). Intel cores take a microcode assist for an arithmetic operation on a
 * denormal: decode attention over a pool holding some (test-backend-ops --perf's random
 * bf16 bits) ran 2.6-3.5x slower on a 2-core Xeon; AMD Zen cores pay nothing. Operands
 * that small change no result of a forward pass beyond its rounding, and the real models
 * ran as fast either way: insurance against the slow path. KVL_DENORMALS=keep leaves
 * IEEE gradual underflow. */
void kvl_cpu_flush_denormals(void) {
  static _Thread_local bool done;
  if (done) return;
  done = true;
  const char *e = getenv("KVL_DENORMALS");
  if (e && !strcmp(e, "keep")) return;
  enum { FTZ = 0x8000, DAZ = 0x0040 }; /* MXCSR bits */
  __builtin_ia32_ldmxcsr(__builtin_ia32_stmxcsr() | FTZ | DAZ);
#pragma omp parallel
  __builtin_ia32_ldmxcsr(__builtin_ia32_stmxcsr() | FTZ | DAZ);
}

kvl_backend_t *kvl_backend_cpu_auto(void) {
  static const char *const order[] = {"amx", "avx512vnnimm", "avx512vnni", "avx512", "avx2int8mm", "avx2"};
  for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
    kvl_backend_t *be = kvl_backend_cpu_level(order[i]);
    if (be) return be;
  }
  return &be_scalar;
}

kvl_backend_t *kvl_backend_cpu(void) {
  static kvl_backend_t *chosen;
  if (chosen) return chosen;
  const char *force = getenv("KVL_CPU");
  kvl_backend_t *be = NULL;
  if (force && *force) {
    be = kvl_backend_cpu_level(force);
    if (!be) fprintf(stderr, "kvlingo: KVL_CPU=%s is not available on this processor; choosing automatically\n", force);
  }
  if (!be) be = kvl_backend_cpu_auto();
  chosen = be;
  return be;
}

/* ---- the reference backend: the scalar _ref functions behind the same table, so a
 * whole forward pass can run on the slow truth (tests) ---------------------------- */

static bool ref_supports(const kvl_backend_t *be, enum kvl_op op, uint32_t wtype) { return cpu_supports(be, op, wtype); }
static void ref_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n) {
  (void)be;
  kvl_matmul_ref(w, x, y, n);
}
static void ref_rmsnorm(kvl_backend_t *be, const float *x, const float *w, float *y, int T, int n, float eps) {
  (void)be;
  kvl_rmsnorm_ref(x, w, y, T, n, eps);
}
static void ref_rope(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int T, int nh, bool inv) {
  (void)be;
  kvl_rope_ref(r, x, pos, T, nh, inv);
}
static void ref_swiglu(kvl_backend_t *be, const float *g, const float *u, float *y, int64_t n) {
  (void)be;
  kvl_swiglu_ref(g, u, y, n);
}
static void ref_embed(kvl_backend_t *be, const struct kvl_weight *t, const int32_t *ids, float *y, int n) {
  (void)be;
  kvl_embed_ref(t, ids, y, n);
}
static void ref_attention(kvl_backend_t *be, const struct kvl_attn_args *a) {
  (void)be;
  kvl_attention_ref(a);
}

static const struct kvl_backend_ops ref_ops = {.supports = ref_supports,
                                               .matmul = ref_matmul,
                                               .rmsnorm = ref_rmsnorm,
                                               .rope = ref_rope,
                                               .swiglu = ref_swiglu,
                                               .embed = ref_embed,
                                               .attention = ref_attention};
static kvl_backend_t be_ref = {.name = "ref", .ops = &ref_ops, .simd = &kvl__simd_scalar};

kvl_backend_t *kvl_backend_ref(void) { return &be_ref; }
