/* apply.c — translating a span of one model's KV cache into another's (DESIGN.md
 * "Translation"): load the source layers once per chunk of positions and un-rotate their
 * keys, multiply the ν layers each map reads by the map (kvl_sgemm in fp32, or
 * kvl_gemm_bf16 after kvl_translator_use_bf16), rotate with the target RoPE, store. And
 * the scalar reference. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_error.h"
#include "kvl_kernels.h"
#include "translator-impl.h"

#define APPLY_CHUNK 512      /* positions per pass: bounds the scratch at any span length */
#define APPLY_CHUNK_BF16 512 /* the same for the bf16 path (kvl_translator_pick_precision times one of each) */

/* Everything that can be refused, checked before anything is written. */
static int check_span(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err, size_t errlen) {
  if (!t || !s) return kvl_errf(err, errlen, KVL_EINVAL, "translator or span is NULL");
  if (s->n < 0) return kvl_errf(err, errlen, KVL_EINVAL, "span length %d is negative", (int)s->n);
  if (strcmp(t->dst.architecture, "qwen2") != 0)
    return kvl_errf(err, errlen, KVL_ENOTSUP,
                    "target architecture '%s' is not supported (only qwen2: k-norm targets are not implemented)",
                    t->dst.architecture);
  if (strcmp(t->src.architecture, "qwen2") != 0)
    return kvl_errf(err, errlen, KVL_ENOTSUP,
                    "source architecture '%s' is not supported (only qwen2: a k-norm source's pre-RoPE keys "
                    "cannot be recovered from its cache)",
                    t->src.architecture);
  if (!s->src_layout || !s->dst_layout || !s->src_rope || !s->dst_rope)
    return kvl_errf(err, errlen, KVL_EINVAL, "span: a layout or RoPE is NULL");
  const struct kvl_kv_layout *ls = s->src_layout, *ld = s->dst_layout;
  int64_t ws = (int64_t)ls->n_kv_head * ls->head_dim, wd = (int64_t)ld->n_kv_head * ld->head_dim;
  if (ls->n_layer != t->src.n_layer)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "source n_layer: translator %d, layout %d", (int)t->src.n_layer,
                    ls->n_layer);
  if (ws != t->w_src)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "source kv width: translator %lld, layout %lld (%d x %d)",
                    (long long)t->w_src, (long long)ws, ls->n_kv_head, ls->head_dim);
  if (ld->n_layer != t->dst.n_layer)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "target n_layer: translator %d, layout %d", (int)t->dst.n_layer,
                    ld->n_layer);
  if (wd != t->w_dst)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "target kv width: translator %lld, layout %lld (%d x %d)",
                    (long long)t->w_dst, (long long)wd, ld->n_kv_head, ld->head_dim);
  if (s->src_rope->head_dim != ls->head_dim)
    return kvl_errf(err, errlen, KVL_EINVAL, "source RoPE head_dim %d, layout head_dim %d", s->src_rope->head_dim,
                    ls->head_dim);
  if (s->dst_rope->head_dim != ld->head_dim)
    return kvl_errf(err, errlen, KVL_EINVAL, "target RoPE head_dim %d, layout head_dim %d", s->dst_rope->head_dim,
                    ld->head_dim);
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++)
      if (t->maps[l][w].nu == 0)
        return kvl_errf(err, errlen, KVL_ENOENT, "target layer %d: %s map not set", (int)l, w ? "V" : "K");
  if (s->n == 0) return 0;
  if (!s->src_base || !s->src_table || !s->src_pos || !s->dst_base || !s->dst_table || !s->dst_pos)
    return kvl_errf(err, errlen, KVL_EINVAL, "span: a pool, block table or position array is NULL");
  for (int32_t i = 0; i < s->n; i++)
    if (s->src_pos[i] < 0 || s->dst_pos[i] < 0)
      return kvl_errf(err, errlen, KVL_EINVAL, "token %d: negative position (source %d, target %d)", (int)i,
                      (int)s->src_pos[i], (int)s->dst_pos[i]);
  return 0;
}

/* Which source layers the K maps (bit 0) and the V maps (bit 1) read: each is loaded once
 * per chunk, however many maps read it (with ν = 4, a source layer serves about four). */
static void mark_sources(const kvl_translator_t *t, uint8_t *use) {
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++)
      for (int j = 0; j < t->maps[l][w].nu; j++) use[t->maps[l][w].sources[j]] |= (uint8_t)(1u << w);
}

/* Target layer l of n positions: keys rotated with the target's RoPE (tables dcs, dsn),
 * both stored at dp[i]. */
static void rotate_store(const struct kvl_translate_span *s, int l, int n, const float *dcs, const float *dsn, float *yk,
                         const float *yv, int wd, const int32_t *dp) {
  const int hd = s->dst_rope->head_dim / 2;
  const int32_t *tables[] = {s->dst_table}, seq0 = 0;
#pragma omp parallel for schedule(static)
  for (int i = 0; i < n; i++) {
    kvl_rope_tab(dcs + (size_t)i * hd, dsn + (size_t)i * hd, yk + (size_t)i * wd, 1, s->dst_layout->n_kv_head,
                 s->dst_layout->head_dim, false);
    kvl_kv_store(s->dst_layout, s->dst_base, l, 1, yk + (size_t)i * wd, yv + (size_t)i * wd, dp + i, &seq0, tables);
  }
}

/* y[n][w_T] = the map's input rows times the map, read in place from the chunk's
 * position-major scratch (cache: [position][source layer][w_S], per_pos floats per
 * position): one sgemm per run of consecutive source layers among the map's ν (a strided
 * view, K = the run's length x w_S), each added to y; when affine, y starts as the
 * intercept row. Nothing is gathered: copying each map's ν rows side by side took 9 % of
 * a long span's translation (43 of the pair's 48 maps read non-consecutive layers). */
static void product(const kvl_translator_t *t, const struct kvl__tr_map *mp, const float *cache, int64_t per_pos, int n,
                    float *y) {
  const int64_t ws = t->w_src, wd = t->w_dst;
  float beta = 0.0f;
  if (t->affine) {
    const float *bias = mp->data + (int64_t)mp->nu * ws * wd;
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * wd, bias, (size_t)wd * sizeof(float));
    beta = 1.0f;
  }
  for (int j = 0; j < mp->nu;) {
    int len = 1;
    while (j + len < mp->nu && mp->sources[j + len] == mp->sources[j] + len) len++;
    kvl_sgemm(false, false, n, wd, len * ws, 1.0f, cache + (size_t)mp->sources[j] * ws, per_pos,
              mp->data + (size_t)j * ws * wd, wd, beta, y, wd);
    beta = 1.0f;
    j += len;
  }
}

int kvl_translator_use_bf16(kvl_translator_t *t, bool on, char *err, size_t errlen) {
  if (!t) return kvl_errf(err, errlen, KVL_EINVAL, "translator is NULL");
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++) {
      struct kvl__tr_map *m = &t->maps[l][w];
      free(m->wb);
      free(m->wbias);
      m->wb = NULL;
      m->wbias = NULL;
    }
  t->bf16 = false;
  if (!on) return 0;
  if (!kvl_gemm_bf16_usable())
    return kvl_errf(err, errlen, KVL_ENOTSUP, "this processor has no bf16 GEMM (AVX512-BF16 or AMX): staying in fp32");
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++) {
      struct kvl__tr_map *m = &t->maps[l][w];
      if (m->nu == 0) continue; /* apply refuses an unset map by itself */
      const int64_t k = (int64_t)m->nu * t->w_src;
      m->wb = malloc((size_t)(k * t->w_dst) * sizeof(uint16_t));
      m->wbias = t->affine ? malloc((size_t)t->w_dst * sizeof(float)) : NULL;
      if (!m->wb || (t->affine && !m->wbias)) {
        kvl_translator_use_bf16(t, false, NULL, 0);
        return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory for the bf16 maps");
      }
      for (int64_t i = 0; i < k * t->w_dst; i++) m->wb[i] = kvl_fp32_to_bf16(m->data[i]);
      if (t->affine) memcpy(m->wbias, m->data + k * t->w_dst, (size_t)t->w_dst * sizeof(float));
    }
  t->bf16 = true;
  return 0;
}

bool kvl_translator_is_bf16(const kvl_translator_t *t) { return t && t->bf16; }

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The deepest map's product for one chunk (APPLY_CHUNK_BF16 = APPLY_CHUNK positions),
 * timed in each precision on made-up rows as apply runs it: fp32 as every thread's own
 * single-threaded sgemm at once (the time per chunk: the wall time over the threads), bf16
 * as one kvl_gemm_bf16 across them; turns taken, the best of PICK_REPS each after a
 * warm-up call (which also compiles the bf16 primitive apply will use). Products only: the
 * rest of an apply (loading, RoPE, storing) costs about the same either way. */
#define PICK_REPS 5
int kvl_translator_pick_precision(kvl_translator_t *t, double *ms_fp32, double *ms_bf16, char *err, size_t errlen) {
  if (ms_fp32) *ms_fp32 = 0;
  if (ms_bf16) *ms_bf16 = 0;
  if (!t) return kvl_errf(err, errlen, KVL_EINVAL, "translator is NULL");
  int rc = kvl_translator_use_bf16(t, true, err, errlen);
  if (rc == KVL_ENOTSUP) return 0; /* no bf16 GEMM here: stays fp32 */
  if (rc < 0) return rc;
  const struct kvl__tr_map *mp = NULL;
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++)
      if (t->maps[l][w].nu && (!mp || t->maps[l][w].nu > mp->nu)) mp = &t->maps[l][w];
  if (!mp) return 0; /* no map set yet: nothing to time */
  const int64_t M = APPLY_CHUNK_BF16, N = t->w_dst, K = (int64_t)mp->nu * t->w_src;
  const int nth = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
  float *a = malloc((size_t)(M * K) * sizeof(float)), *c = malloc((size_t)(nth * M * N) * sizeof(float));
  uint16_t *ab = malloc((size_t)(M * K) * sizeof(uint16_t));
  if (!a || !c || !ab) {
    free(a), free(c), free(ab);
    kvl_translator_use_bf16(t, false, NULL, 0);
    return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory for the precision probe");
  }
  uint32_t x = 12345;
  for (int64_t i = 0; i < M * K; i++) { /* values of a cache's size, no denormals */
    x = x * 1664525u + 1013904223u;
    a[i] = (float)((int32_t)(x >> 8) - (1 << 23)) / (float)(1 << 21);
    ab[i] = kvl_fp32_to_bf16(a[i]);
  }
  double best[2] = {1e30, 1e30};
  for (int rep = -1; rep < PICK_REPS && rc == 0; rep++) {
    const double t0 = now_ms();
#pragma omp parallel num_threads(nth)
    kvl_sgemm(false, false, M, N, K, 1.0f, a, K, mp->data, N, 0.0f, c + (size_t)omp_get_thread_num() * M * N, N);
    const double t1 = now_ms();
    rc = kvl_gemm_bf16(M, N, K, ab, K, mp->wb, N, mp->wbias, c, N);
    const double t2 = now_ms(), f = (t1 - t0) / nth, b = t2 - t1; /* ms per chunk */
    if (rep >= 0) {
      best[0] = f < best[0] ? f : best[0];
      best[1] = b < best[1] ? b : best[1];
    }
  }
  free(a), free(c), free(ab);
  if (rc < 0 || best[0] <= best[1]) kvl_translator_use_bf16(t, false, NULL, 0);
  if (rc == 0) {
    if (ms_fp32) *ms_fp32 = best[0];
    if (ms_bf16) *ms_bf16 = best[1];
  }
  return 0;
}

/* Are a map's sources consecutive ascending layers? Then its input rows are one strided
 * view of the position-major scratch, and nothing is gathered. */
static bool consecutive(const struct kvl__tr_map *mp) {
  for (int j = 1; j < mp->nu; j++)
    if (mp->sources[j] != mp->sources[0] + j) return false;
  return true;
}

/* The bf16 path: the chunk's source rows are converted once into position-major scratch
 * [position][source layer][w_S] (bf16), so the ν consecutive layers a map reads are one
 * matrix with leading dimension n_S·w_S; one kvl_gemm_bf16 per map and chunk, its M
 * rounded up to a multiple of 64 (few primitive shapes; the rows past the span are
 * scratch, computed and dropped). Returns 0, KVL_ENOMEM, or KVL_ENOTSUP if a product
 * was refused: the caller then runs the fp32 path, which rewrites every position and layer
 * of the span. */
static int apply_bf16(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err, size_t errlen) {
  const int n_src = t->src.n_layer, ws = (int)t->w_src, wd = (int)t->w_dst;
  const int chunk = s->n < APPLY_CHUNK_BF16 ? (int)((s->n + 63) / 64 * 64) : APPLY_CHUNK_BF16;
  const int hs = s->src_rope->head_dim / 2, hd = s->dst_rope->head_dim / 2;
  const size_t per_pos = (size_t)n_src * (size_t)ws;
  int64_t max_k = 0;
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++)
      if ((int64_t)t->maps[l][w].nu * ws > max_k) max_k = (int64_t)t->maps[l][w].nu * ws;
  uint8_t *use = calloc((size_t)n_src, 1);
  uint16_t *ck = calloc((size_t)chunk * per_pos, sizeof(uint16_t)), *cv = calloc((size_t)chunk * per_pos, sizeof(uint16_t));
  uint16_t *x = calloc((size_t)chunk * (size_t)max_k, sizeof(uint16_t)); /* gathered rows, non-consecutive sources */
  float *tab = malloc((size_t)chunk * (size_t)(2 * hs + 2 * hd) * sizeof(float));
  float *yk = malloc((size_t)chunk * (size_t)wd * sizeof(float)), *yv = malloc((size_t)chunk * (size_t)wd * sizeof(float));
  int rc = 0;
  if (!use || !ck || !cv || !x || !tab || !yk || !yv) {
    rc = kvl_errf(err, errlen, KVL_ENOMEM, "translating %d positions: out of memory for the scratch", (int)s->n);
    goto out;
  }
  mark_sources(t, use);
  float *scs = tab, *ssn = tab + (size_t)chunk * hs, *dcs = ssn + (size_t)chunk * hs, *dsn = dcs + (size_t)chunk * hd;
  for (int32_t i0 = 0; i0 < s->n; i0 += chunk) {
    const int n = s->n - i0 < chunk ? (int)(s->n - i0) : chunk, m_rows = (n + 63) / 64 * 64;
    const int32_t *sp = s->src_pos + i0, *dp = s->dst_pos + i0;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
      kvl_rope_table(s->src_rope, sp[i], scs + (size_t)i * hs, ssn + (size_t)i * hs);
      kvl_rope_table(s->dst_rope, dp[i], dcs + (size_t)i * hd, dsn + (size_t)i * hd);
      for (int L = 0; L < n_src; L++)
        if (use[L])
          kvl_kv_load_unrotated_bf16(s->src_layout, s->src_base, L, sp[i], s->src_table, scs + (size_t)i * hs,
                                     ssn + (size_t)i * hs,
                                     use[L] & 1 ? ck + (size_t)i * per_pos + (size_t)L * ws : NULL,
                                     use[L] & 2 ? cv + (size_t)i * per_pos + (size_t)L * ws : NULL);
    }
    for (int32_t l = 0; l < t->dst.n_layer; l++) {
      for (int w = 0; w < 2; w++) {
        const struct kvl__tr_map *mp = &t->maps[l][w];
        const uint16_t *c = w == KVL_TRANSLATOR_K ? ck : cv, *a;
        const int64_t k = (int64_t)mp->nu * ws;
        int64_t lda;
        if (consecutive(mp)) {
          a = c + (size_t)mp->sources[0] * ws;
          lda = (int64_t)per_pos;
        } else {
#pragma omp parallel for schedule(static)
          for (int i = 0; i < n; i++)
            for (int j = 0; j < mp->nu; j++)
              memcpy(x + (size_t)i * k + (size_t)j * ws, c + (size_t)i * per_pos + (size_t)mp->sources[j] * ws,
                     (size_t)ws * sizeof(uint16_t));
          a = x;
          lda = k;
        }
        rc = kvl_gemm_bf16(m_rows, wd, k, a, lda, mp->wb, wd, mp->wbias, w == KVL_TRANSLATOR_K ? yk : yv, wd);
        if (rc < 0) { /* the caller computes the whole span in fp32, over whatever was written */
          rc = KVL_ENOTSUP;
          goto out;
        }
      }
      rotate_store(s, (int)l, n, dcs, dsn, yk, yv, wd, dp);
    }
  }
out:
  free(use);
  free(ck);
  free(cv);
  free(x);
  free(tab);
  free(yk);
  free(yv);
  return rc;
}

int kvl_translator_apply(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err, size_t errlen) {
  int rc = check_span(t, s, err, errlen);
  if (rc < 0 || s->n == 0) return rc;
  if (t->bf16) {
    rc = apply_bf16(t, s, err, errlen);
    if (rc != KVL_ENOTSUP) return rc;
  }
  /* fp32: the span in chunks, each chunk wholly on one thread (loading, un-rotating, its
   * products as single-threaded sgemms, rotating, storing): no barrier between the steps
   * and no product split across threads. Chunks of at most APPLY_CHUNK, and no fewer
   * than the threads. Every thread's scratch is allocated before anything is written. */
  const int n_src = t->src.n_layer, ws = (int)t->w_src, wd = (int)t->w_dst;
  const int nth = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
  int chunk = (int)((s->n + nth - 1) / nth);
  chunk = chunk > APPLY_CHUNK ? APPLY_CHUNK : chunk;
  const int n_chunks = (int)((s->n + chunk - 1) / chunk), n_scr = n_chunks < nth ? n_chunks : nth;
  const int hs = s->src_rope->head_dim / 2, hd = s->dst_rope->head_dim / 2;
  const int64_t per_pos = (int64_t)n_src * ws; /* the scratch's floats per position */
  const size_t per_thread = (size_t)2 * chunk * per_pos /* ck, cv */ + (size_t)chunk * (2 * hs + 2 * hd) /* RoPE tables */ +
                            (size_t)2 * chunk * wd /* yk, yv */;
  uint8_t *use = calloc((size_t)n_src, 1); /* mark_sources */
  float *scratch = malloc((size_t)n_scr * per_thread * sizeof(float));
  if (!use || !scratch) {
    free(use);
    free(scratch);
    return kvl_errf(err, errlen, KVL_ENOMEM, "translating %d positions: out of memory for the scratch", (int)s->n);
  }
  mark_sources(t, use);
#pragma omp parallel num_threads(n_scr)
  {
    float *ck = scratch + (size_t)omp_get_thread_num() * per_thread, *cv = ck + (size_t)chunk * per_pos;
    float *scs = cv + (size_t)chunk * per_pos;
    float *ssn = scs + (size_t)chunk * hs, *dcs = ssn + (size_t)chunk * hs, *dsn = dcs + (size_t)chunk * hd;
    float *yk = dsn + (size_t)chunk * hd, *yv = yk + (size_t)chunk * wd;
#pragma omp for schedule(dynamic, 1)
    for (int c = 0; c < n_chunks; c++) {
      const int32_t i0 = (int32_t)c * chunk;
      const int n = s->n - i0 < chunk ? (int)(s->n - i0) : chunk;
      const int32_t *sp = s->src_pos + i0, *dp = s->dst_pos + i0;
      for (int i = 0; i < n; i++) {
        kvl_rope_table(s->src_rope, sp[i], scs + (size_t)i * hs, ssn + (size_t)i * hs);
        kvl_rope_table(s->dst_rope, dp[i], dcs + (size_t)i * hd, dsn + (size_t)i * hd);
        for (int L = 0; L < n_src; L++) {
          if (!use[L]) continue;
          float *k = use[L] & 1 ? ck + (size_t)i * per_pos + (size_t)L * ws : NULL;
          float *v = use[L] & 2 ? cv + (size_t)i * per_pos + (size_t)L * ws : NULL;
          kvl_kv_load(s->src_layout, s->src_base, L, sp[i], s->src_table, k, v);
          if (k) /* un-rotate with this position's tables */
            kvl_rope_tab(scs + (size_t)i * hs, ssn + (size_t)i * hs, k, 1, s->src_layout->n_kv_head,
                         s->src_layout->head_dim, true);
        }
      }
      for (int32_t l = 0; l < t->dst.n_layer; l++) {
        product(t, &t->maps[l][KVL_TRANSLATOR_K], ck, per_pos, n, yk);
        product(t, &t->maps[l][KVL_TRANSLATOR_V], cv, per_pos, n, yv);
        rotate_store(s, (int)l, n, dcs, dsn, yk, yv, wd, dp);
      }
    }
  }
  free(use);
  free(scratch);
  return 0;
}

int kvl_translator_apply_on(const kvl_translator_t *t, kvl_backend_t *be, const struct kvl_translate_span *s,
                            char *err, size_t errlen) {
  if (!kvl_backend_can_translate(be)) return kvl_translator_apply(t, s, err, errlen);
  int rc = check_span(t, s, err, errlen);
  if (rc < 0 || s->n == 0) return rc;
  const int n = 2 * t->dst.n_layer;
  struct kvl_tr_map_ref *maps = malloc((size_t)n * sizeof(*maps));
  if (!maps) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  for (int i = 0; i < n; i++) {
    const struct kvl__tr_map *m = &t->maps[i / 2][i & 1 ? KVL_TRANSLATOR_V : KVL_TRANSLATOR_K];
    maps[i] = (struct kvl_tr_map_ref){m->nu, m->sources, m->data,
                                      t->affine ? m->data + (size_t)m->nu * (size_t)t->w_src * (size_t)t->w_dst : NULL};
  }
  struct kvl_tr_args a = {.src_layout = s->src_layout, .dst_layout = s->dst_layout, .src_base = s->src_base,
                          .dst_base = s->dst_base, .src_table = s->src_table, .dst_table = s->dst_table,
                          .src_pos = s->src_pos, .dst_pos = s->dst_pos, .n = s->n, .src_rope = s->src_rope,
                          .dst_rope = s->dst_rope, .maps = maps,
                          .pack = (struct kvl_wpack *)&t->dev, /* a cache: kept in a const translator */
                          .src_stamps = s->src_stamps, .dst_stamps = s->dst_stamps, .src_blocks = s->src_blocks,
                          .dst_blocks = s->dst_blocks};
  rc = kvl_backend_translate(be, &a, err, errlen);
  free(maps);
  return rc;
}

/* y[w_T] = x · map, accumulated in double. */
static void matvec_ref(const struct kvl__tr_map *mp, int64_t cols, const float *x, float *y) {
  for (int64_t c = 0; c < cols; c++) {
    double acc = 0;
    for (int64_t r = 0; r < mp->rows; r++) acc += (double)x[r] * (double)mp->data[r * cols + c];
    y[c] = (float)acc;
  }
}

static void gather_ref(const kvl_translator_t *t, const struct kvl_translate_span *s, const struct kvl__tr_map *mp,
                       bool keys, int32_t pos, float *x) {
  int64_t ws = t->w_src;
  for (int j = 0; j < mp->nu; j++) {
    float *row = x + (size_t)j * ws;
    kvl_kv_load(s->src_layout, s->src_base, mp->sources[j], pos, s->src_table, keys ? row : NULL, keys ? NULL : row);
    if (keys) kvl_rope_ref(s->src_rope, row, &pos, 1, s->src_layout->n_kv_head, true);
  }
  if (t->affine) x[mp->rows - 1] = 1.0f;
}

int kvl_translator_apply_ref(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err,
                             size_t errlen) {
  int rc = check_span(t, s, err, errlen);
  if (rc < 0 || s->n == 0) return rc;
  int64_t max_rows = 0;
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int w = 0; w < 2; w++)
      if (t->maps[l][w].rows > max_rows) max_rows = t->maps[l][w].rows;
  float *x = malloc((size_t)max_rows * sizeof(float));
  float *yk = malloc((size_t)t->w_dst * sizeof(float)), *yv = malloc((size_t)t->w_dst * sizeof(float));
  if (!x || !yk || !yv) {
    rc = kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
    goto out;
  }
  const int32_t *tables[] = {s->dst_table};
  const int32_t seq0 = 0;
  for (int32_t l = 0; l < t->dst.n_layer; l++)
    for (int32_t i = 0; i < s->n; i++) {
      gather_ref(t, s, &t->maps[l][KVL_TRANSLATOR_K], true, s->src_pos[i], x);
      matvec_ref(&t->maps[l][KVL_TRANSLATOR_K], t->w_dst, x, yk);
      kvl_rope_ref(s->dst_rope, yk, &s->dst_pos[i], 1, s->dst_layout->n_kv_head, false);
      gather_ref(t, s, &t->maps[l][KVL_TRANSLATOR_V], false, s->src_pos[i], x);
      matvec_ref(&t->maps[l][KVL_TRANSLATOR_V], t->w_dst, x, yv);
      kvl_kv_store(s->dst_layout, s->dst_base, (int)l, 1, yk, yv, &s->dst_pos[i], &seq0, tables);
    }
out:
  free(x);
  free(yk);
  free(yv);
  return rc;
}

int kvl_translator_identity(const struct kvl_model_fingerprint *fp, bool affine, kvl_translator_t **out,
                            char *err, size_t errlen) {
  KVL_ASSERT(out);
  *out = NULL;
  if (!fp) return kvl_errf(err, errlen, KVL_EINVAL, "fingerprint is NULL");
  kvl_translator_t *t;
  int rc = kvl_translator_new(fp, fp, affine, &t, err, errlen);
  if (rc < 0) return rc;
  int64_t w = kvl_fingerprint_kv_width(fp), rows = w + (affine ? 1 : 0);
  float *map = calloc((size_t)rows * (size_t)w, sizeof(float));
  if (!map) {
    kvl_translator_free(t);
    return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory for a %lld x %lld map", (long long)rows, (long long)w);
  }
  for (int64_t i = 0; i < w; i++) map[i * w + i] = 1.0f;
  for (int32_t l = 0; l < fp->n_layer && rc == 0; l++) {
    rc = kvl_translator_set_map(t, l, KVL_TRANSLATOR_K, &l, 1, map);
    if (rc == 0) rc = kvl_translator_set_map(t, l, KVL_TRANSLATOR_V, &l, 1, map);
  }
  free(map);
  if (rc < 0) {
    kvl_translator_free(t);
    return kvl_errf(err, errlen, rc, "identity translator: setting a map failed (%s)", kvl_strerror(rc));
  }
  *out = t;
  return 0;
}
