/* gemm_bf16.c — prefill GEMMs in bf16 through oneDNN's matmul (Debian's libdnnl 2.6, its
 * OpenMP build: the process keeps one thread runtime). On a processor with AMX it runs on
 * the tile unit (brgemm "avx512_core_amx_bf16"), else on AVX-512-BF16. The CPU level
 * "avx512bf16" (KVL_CPU=avx512bf16) uses it; kvl_backend_cpu() does not pick it on its own
 * yet (docs/architecture.md, "CPU levels").
 *
 * Each weight is repacked once, at its first prefill-sized product: dequantised row by
 * row (the SIMD level's own dequant), rounded to bf16 and reordered into the blocked
 * layout oneDNN asks for. The copy lives in the weight's kvl_wpack slot (its owner
 * releases it: kvl_model_free) and is counted by kvl_wpack_total_bytes().
 *
 * Batch invariance: oneDNN's results for a row depend on the M it was planned for (the
 * blocking changes), so every product runs 64 rows at a time through one primitive per
 * (K, N) — the last block padded with zero rows — and a position's result does not depend
 * on how its prefill was chunked. Activations are rounded to bf16, products accumulate in
 * fp32. Anything oneDNN refuses returns an error (the caller falls back to fp32); the
 * first reason is printed once.
 *
 * Also kvl_gemm_bf16 (kvl_kernels.h): the same matmul on plain bf16 operands the caller
 * owns (translation's bf16 maps and source rows), one cached primitive per shape. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dnnl.h>

#include "../backend-impl.h"
#include "kvl_error.h"

enum { MB = 64, MAX_PRIMS = 64 };

struct packed { /* behind kvl_wpack.impl */
  dnnl_memory_t mem; /* the blocked bf16 weights, K x N */
  void *buf;
};

struct prim {
  int64_t K, N;
  dnnl_primitive_t p;
  dnnl_memory_desc_t wmd; /* the weights layout it wants */
};

static struct {
  pthread_once_t once;
  bool ok;
  dnnl_engine_t eng;
  dnnl_stream_t stream;
  pthread_mutex_t mu; /* the caches and the one stream */
  struct prim prims[MAX_PRIMS];
  int n_prims;
  char impl[96];
} g = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

static void warn_once(const char *what, dnnl_status_t st) {
  static atomic_int said;
  if (atomic_exchange(&said, 1)) return;
  fprintf(stderr, "kvlingo: bf16 GEMM unavailable (%s: oneDNN status %d); computing in fp32\n", what, (int)st);
}

static void init(void) {
  dnnl_status_t st;
  if ((st = dnnl_engine_create(&g.eng, dnnl_cpu, 0)) != dnnl_success) { warn_once("engine", st); return; }
  if ((st = dnnl_stream_create(&g.stream, g.eng, dnnl_stream_default_flags)) != dnnl_success) {
    warn_once("stream", st);
    return;
  }
  g.ok = true;
}

bool kvl__bf16_gemm_usable(void) {
  __builtin_cpu_init();
  /* every processor with AMX-BF16 also has AVX512-BF16 (and clang knows only this name) */
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  pthread_once(&g.once, init);
  return g.ok;
}

const char *kvl__bf16_gemm_impl(void) { return g.impl[0] ? g.impl : "not used yet"; }

static void release_packed(struct kvl_wpack *p) {
  struct packed *k = p->impl;
  if (k->mem) dnnl_memory_destroy(k->mem);
  free(k->buf);
  kvl__wpack_count(-(long long)p->bytes);
  free(k);
  p->impl = NULL;
  p->bytes = 0;
  p->owner = NULL;
  p->release = NULL;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* The primitive for a 64 x K by K x N product (under g.mu). */
static struct prim *prim_for(int64_t K, int64_t N) {
  for (int i = 0; i < g.n_prims; i++)
    if (g.prims[i].K == K && g.prims[i].N == N) return &g.prims[i];
  if (g.n_prims == MAX_PRIMS) return NULL;
  dnnl_memory_desc_t smd, wmd, dmd;
  dnnl_dims_t sd = {MB, K}, wd = {K, N}, dd = {MB, N};
  dnnl_matmul_desc_t mm;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_primitive_t p = NULL;
  dnnl_status_t st;
  if ((st = dnnl_memory_desc_init_by_tag(&smd, 2, sd, dnnl_bf16, dnnl_ab)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_tag(&wmd, 2, wd, dnnl_bf16, dnnl_format_tag_any)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab)) != dnnl_success ||
      (st = dnnl_matmul_desc_init(&mm, &smd, &wmd, NULL, &dmd)) != dnnl_success ||
      (st = dnnl_primitive_desc_create(&pd, &mm, NULL, g.eng, NULL)) != dnnl_success ||
      (st = dnnl_primitive_create(&p, pd)) != dnnl_success) {
    warn_once("matmul primitive", st);
    if (pd) dnnl_primitive_desc_destroy(pd);
    return NULL;
  }
  struct prim *r = &g.prims[g.n_prims++];
  r->K = K, r->N = N, r->p = p;
  r->wmd = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  const char *impl = NULL;
  if (!g.impl[0] && dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl)
    snprintf(g.impl, sizeof(g.impl), "%s", impl);
  dnnl_primitive_desc_destroy(pd);
  return r;
}

/* Repack w into its slot in the layout `want` (under g.mu). */
static int pack(const struct kvl__simd *s, const struct kvl_weight *w, const dnnl_memory_desc_t *want) {
  const int64_t K = w->cols, N = w->rows;
  const size_t rb = kvl_row_size(w->type, (uint64_t)K);
  uint16_t *plain = malloc((size_t)N * (size_t)K * sizeof(uint16_t)); /* [N][K]: "ba" of K x N */
  if (!plain) return KVL_ENOMEM;
  int bad = 0;
#pragma omp parallel
  {
    float *row = malloc((size_t)K * sizeof(float));
    if (!row) {
#pragma omp atomic write
      bad = 1;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; r++) {
      if (!row) continue;
      if (w->type == KVL_TYPE_F32) memcpy(row, (const float *)w->data + r * K, (size_t)K * sizeof(float));
      else s->dequant(w->type, (const uint8_t *)w->data + (size_t)r * rb, row, K);
      uint16_t *o = plain + (size_t)r * (size_t)K;
      for (int64_t k = 0; k < K; k++) o[k] = to_bf16(row[k]);
    }
    free(row);
  }
  if (bad) {
    free(plain);
    return KVL_ENOMEM;
  }
  const size_t bytes = dnnl_memory_desc_get_size(want);
  struct packed *k = calloc(1, sizeof(*k));
  dnnl_memory_desc_t pmd;
  dnnl_dims_t wd = {K, N};
  dnnl_memory_t from = NULL;
  dnnl_primitive_desc_t rpd = NULL;
  dnnl_primitive_t rp = NULL;
  dnnl_status_t st = dnnl_success;
  int rc = 0;
  if (!k || !(k->buf = aligned_alloc(64, (bytes + 63) / 64 * 64))) {
    rc = KVL_ENOMEM;
    goto out;
  }
  if ((st = dnnl_memory_desc_init_by_tag(&pmd, 2, wd, dnnl_bf16, dnnl_ba)) != dnnl_success ||
      (st = dnnl_memory_create(&from, &pmd, g.eng, plain)) != dnnl_success ||
      (st = dnnl_memory_create(&k->mem, want, g.eng, k->buf)) != dnnl_success ||
      (st = dnnl_reorder_primitive_desc_create(&rpd, &pmd, g.eng, want, g.eng, NULL)) != dnnl_success ||
      (st = dnnl_primitive_create(&rp, rpd)) != dnnl_success) {
    warn_once("weight reorder", st);
    rc = KVL_ENOTSUP;
    goto out;
  }
  dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, k->mem}};
  if ((st = dnnl_primitive_execute(rp, g.stream, 2, args)) != dnnl_success ||
      (st = dnnl_stream_wait(g.stream)) != dnnl_success) {
    warn_once("weight reorder", st);
    rc = KVL_ENOTSUP;
    goto out;
  }
  w->pack->impl = k;
  w->pack->bytes = bytes;
  w->pack->owner = &g;
  w->pack->release = release_packed;
  kvl__wpack_count((long long)bytes);
  k = NULL;
out:
  if (rp) dnnl_primitive_destroy(rp);
  if (rpd) dnnl_primitive_desc_destroy(rpd);
  if (from) dnnl_memory_destroy(from);
  if (k) {
    if (k->mem) dnnl_memory_destroy(k->mem);
    free(k->buf);
    free(k);
  }
  free(plain);
  return rc;
}

int kvl__bf16_matmul(const struct kvl__simd *s, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  if (!w->pack || n_tokens <= 0 || !kvl__bf16_gemm_usable()) return KVL_ENOTSUP;
  if (w->pack->impl && w->pack->owner != &g) return KVL_ENOTSUP; /* another backend's copy */
  const int64_t K = w->cols, N = w->rows;
  pthread_mutex_lock(&g.mu);
  struct prim *p = prim_for(K, N);
  int rc = p ? 0 : KVL_ENOTSUP;
  if (rc == 0 && !w->pack->impl) rc = pack(s, w, &p->wmd);
  struct packed *k = rc == 0 ? w->pack->impl : NULL;
  dnnl_memory_desc_t smd, dmd;
  dnnl_dims_t sd = {MB, K}, dd = {MB, N};
  dnnl_memory_t ms = NULL, md = NULL;
  uint16_t *xb = rc ? NULL : aligned_alloc(64, ((size_t)MB * (size_t)K * 2 + 63) / 64 * 64);
  float *yb = rc ? NULL : aligned_alloc(64, ((size_t)MB * (size_t)N * 4 + 63) / 64 * 64);
  dnnl_status_t st = dnnl_success;
  if (rc == 0 && (!xb || !yb)) rc = KVL_ENOMEM;
  if (rc == 0 &&
      ((st = dnnl_memory_desc_init_by_tag(&smd, 2, sd, dnnl_bf16, dnnl_ab)) != dnnl_success ||
       (st = dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab)) != dnnl_success ||
       (st = dnnl_memory_create(&ms, &smd, g.eng, xb)) != dnnl_success ||
       (st = dnnl_memory_create(&md, &dmd, g.eng, yb)) != dnnl_success)) {
    warn_once("memory", st);
    rc = KVL_ENOTSUP;
  }
  for (int t0 = 0; rc == 0 && t0 < n_tokens; t0 += MB) {
    const int nt = n_tokens - t0 < MB ? n_tokens - t0 : MB;
    const float *xs = x + (int64_t)t0 * K;
    for (int64_t i = 0; i < (int64_t)nt * K; i++) xb[i] = to_bf16(xs[i]);
    if (nt < MB) memset(xb + (int64_t)nt * K, 0, (size_t)(MB - nt) * (size_t)K * sizeof(uint16_t));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ms}, {DNNL_ARG_WEIGHTS, k->mem}, {DNNL_ARG_DST, md}};
    if ((st = dnnl_primitive_execute(p->p, g.stream, 3, args)) != dnnl_success ||
        (st = dnnl_stream_wait(g.stream)) != dnnl_success) {
      warn_once("matmul", st);
      rc = KVL_ENOTSUP;
      break;
    }
    float *yo = y + (int64_t)t0 * N;
    for (int t = 0; t < nt; t++)
      for (int64_t r = 0; r < N; r++)
        yo[(int64_t)t * N + r] = yb[(int64_t)t * N + r] + (w->bias ? w->bias[r] : 0.0f);
  }
  pthread_mutex_unlock(&g.mu);
  if (ms) dnnl_memory_destroy(ms);
  if (md) dnnl_memory_destroy(md);
  free(xb);
  free(yb);
  return rc;
}

/* ---- kvl_gemm_bf16: plain bf16 operands (translation's products) -------------------- */

struct gprim {
  int64_t M, N, K, lda, ldb;
  bool bias;
  dnnl_primitive_t p;
};

static struct {
  struct gprim prims[MAX_PRIMS];
  int n;
} gg; /* under g.mu */

bool kvl_gemm_bf16_usable(void) { return kvl__bf16_gemm_usable(); }

static int gemm_descs(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, dnnl_memory_desc_t *a,
                      dnnl_memory_desc_t *b, dnnl_memory_desc_t *bias, dnnl_memory_desc_t *c, int64_t ldc) {
  dnnl_dims_t ad = {M, K}, bd = {K, N}, cd = {M, N}, zd = {1, N};
  dnnl_dims_t as = {lda, 1}, bs = {ldb, 1}, cs = {ldc, 1};
  dnnl_status_t st;
  if ((st = dnnl_memory_desc_init_by_strides(a, 2, ad, dnnl_bf16, as)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(b, 2, bd, dnnl_bf16, bs)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_tag(bias, 2, zd, dnnl_f32, dnnl_ab)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(c, 2, cd, dnnl_f32, cs)) != dnnl_success) {
    warn_once("gemm memory descriptors", st);
    return KVL_ENOTSUP;
  }
  return 0;
}

/* The primitive for one shape (under g.mu); C's leading dimension is N. */
static struct gprim *gprim_for(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, bool bias) {
  for (int i = 0; i < gg.n; i++) {
    struct gprim *q = &gg.prims[i];
    if (q->M == M && q->N == N && q->K == K && q->lda == lda && q->ldb == ldb && q->bias == bias) return q;
  }
  if (gg.n == MAX_PRIMS) return NULL;
  dnnl_memory_desc_t a, b, z, c;
  if (gemm_descs(M, N, K, lda, ldb, &a, &b, &z, &c, N) < 0) return NULL;
  dnnl_matmul_desc_t mm;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_primitive_t p = NULL;
  dnnl_status_t st;
  if ((st = dnnl_matmul_desc_init(&mm, &a, &b, bias ? &z : NULL, &c)) != dnnl_success ||
      (st = dnnl_primitive_desc_create(&pd, &mm, NULL, g.eng, NULL)) != dnnl_success) {
    warn_once("gemm primitive", st);
    if (pd) dnnl_primitive_desc_destroy(pd);
    return NULL;
  }
  /* oneDNN's reference matmul would be orders of magnitude slower than our fp32 path */
  const char *impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl ||
      strncmp(impl, "ref", 3) == 0 || (st = dnnl_primitive_create(&p, pd)) != dnnl_success) {
    warn_once(impl && strncmp(impl, "ref", 3) == 0 ? "gemm primitive: only oneDNN's reference" : "gemm primitive",
              st);
    dnnl_primitive_desc_destroy(pd);
    return NULL;
  }
  dnnl_primitive_desc_destroy(pd);
  struct gprim *q = &gg.prims[gg.n++];
  *q = (struct gprim){M, N, K, lda, ldb, bias, p};
  return q;
}

int kvl_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                  const float *bias, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return 0;
  if (!kvl__bf16_gemm_usable() || ldc != N) return KVL_ENOTSUP;
  pthread_mutex_lock(&g.mu);
  struct gprim *q = gprim_for(M, N, K, lda, ldb, bias != NULL);
  int rc = q ? 0 : KVL_ENOTSUP;
  dnnl_memory_desc_t a, b, z, c;
  dnnl_memory_t ma = NULL, mb = NULL, mz = NULL, mc = NULL;
  dnnl_status_t st = dnnl_success;
  if (rc == 0 && gemm_descs(M, N, K, lda, ldb, &a, &b, &z, &c, ldc) < 0) rc = KVL_ENOTSUP;
  if (rc == 0 && ((st = dnnl_memory_create(&ma, &a, g.eng, (void *)A)) != dnnl_success ||
                  (st = dnnl_memory_create(&mb, &b, g.eng, (void *)B)) != dnnl_success ||
                  (bias && (st = dnnl_memory_create(&mz, &z, g.eng, (void *)bias)) != dnnl_success) ||
                  (st = dnnl_memory_create(&mc, &c, g.eng, C)) != dnnl_success)) {
    warn_once("gemm memory", st);
    rc = KVL_ENOTSUP;
  }
  if (rc == 0) {
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_BIAS, mz}};
    if ((st = dnnl_primitive_execute(q->p, g.stream, bias ? 4 : 3, args)) != dnnl_success ||
        (st = dnnl_stream_wait(g.stream)) != dnnl_success) {
      warn_once("gemm", st);
      rc = KVL_ENOTSUP;
    }
  }
  pthread_mutex_unlock(&g.mu);
  if (ma) dnnl_memory_destroy(ma);
  if (mb) dnnl_memory_destroy(mb);
  if (mz) dnnl_memory_destroy(mz);
  if (mc) dnnl_memory_destroy(mc);
  return rc;
}
