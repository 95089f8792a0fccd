/* kv.c — the paged KV cache's geometry (where a block keeps a layer's K and V), the
 * store/load of rows, and the RoPE table generator shared by every RoPE user. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_kernels.h"
#include "kvl_quant.h"

/* Block layout (block-major, so a block is one contiguous unit for tier copies):
 *   block b: for layer l in 0..n_layer-1: K[KVL_KV_BLOCK][kvw], V[KVL_KV_BLOCK][kvw]
 * with kvw = n_kv_head * head_dim elements of the pool's dtype. */
static size_t elem_size(enum kvl_kv_dtype d) { return d == KVL_KV_BF16 ? 2 : 4; }

static size_t slab_bytes(const struct kvl_kv_layout *l) { /* one K (or V) of one layer */
  return (size_t)KVL_KV_BLOCK * (size_t)l->n_kv_head * (size_t)l->head_dim * elem_size(l->dtype);
}

size_t kvl_kv_block_bytes(const struct kvl_kv_layout *l) { return 2 * (size_t)l->n_layer * slab_bytes(l); }

void *kvl_huge_alloc(size_t bytes, size_t *mapped) {
  const size_t huge = (size_t)2 << 20;
  const size_t sz = bytes ? (bytes + huge - 1) & ~(huge - 1) : huge; /* 0 bytes: one page, a valid pointer */
  /* over-allocate by one huge page so the start can be aligned to one */
  uint8_t *raw = mmap(NULL, sz + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  uint8_t *m = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
  if (m > raw) munmap(raw, (size_t)(m - raw));
  if (m + sz < raw + sz + huge) munmap(m + sz, (size_t)(raw + sz + huge - (m + sz)));
#ifdef MADV_HUGEPAGE
  madvise(m, sz, MADV_HUGEPAGE); /* advice: refused where THP is off, which is fine */
#endif
  *mapped = sz;
  return m;
}

void kvl_huge_free(void *p, size_t mapped) {
  if (p) munmap(p, mapped);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it, older kernels say EINVAL */
#endif

struct prefault {
  uint8_t *p;
  size_t bytes;
  int id, n;
};

static void *prefault_main(void *arg) { /* 2 MiB pieces, dealt round-robin */
  const struct prefault *f = arg;
  const size_t piece = (size_t)2 << 20;
  for (size_t off = (size_t)f->id * piece; off < f->bytes; off += (size_t)f->n * piece) {
    uint8_t *q = f->p + off;
    const size_t len = f->bytes - off < piece ? f->bytes - off : piece;
    if (madvise(q, len, MADV_POPULATE_WRITE) == 0) continue;
    for (size_t i = 0; i < len; i += 4096) /* a write fault per page, the byte kept */
      __atomic_fetch_add(q + i, 0, __ATOMIC_RELAXED);
  }
  return NULL;
}

double kvl_huge_prefault(void *p, size_t bytes) {
  if (!p || !bytes) return 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  const int n = ncpu < 1 ? 1 : ncpu > 4 ? 4 : (int)ncpu;
  struct prefault f[4];
  pthread_t th[4];
  bool started[4] = {false};
  for (int i = 0; i < n; i++) {
    f[i] = (struct prefault){p, bytes, i, n};
    started[i] = i > 0 && pthread_create(&th[i], NULL, prefault_main, &f[i]) == 0;
  }
  prefault_main(&f[0]);
  for (int i = 1; i < n; i++) {
    if (started[i]) pthread_join(th[i], NULL);
    else prefault_main(&f[i]); /* no thread: its share here */
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
}

void *kvl_kv_k_ptr(const struct kvl_kv_layout *l, void *base, int32_t block, int layer) {
  return (uint8_t *)base + (size_t)block * kvl_kv_block_bytes(l) + (size_t)(2 * layer) * slab_bytes(l);
}

void *kvl_kv_v_ptr(const struct kvl_kv_layout *l, void *base, int32_t block, int layer) {
  return (uint8_t *)base + (size_t)block * kvl_kv_block_bytes(l) + (size_t)(2 * layer + 1) * slab_bytes(l);
}

static void put_row(enum kvl_kv_dtype d, void *dst, const float *src, int n) {
  if (d == KVL_KV_F32) {
    memcpy(dst, src, (size_t)n * 4);
  } else {
    uint16_t *o = dst;
#pragma omp simd
    for (int i = 0; i < n; i++) o[i] = kvl_fp32_to_bf16(src[i]);
  }
}

static void get_row(enum kvl_kv_dtype d, const void *src, float *dst, int n) {
  if (d == KVL_KV_F32) {
    memcpy(dst, src, (size_t)n * 4);
  } else {
    const uint16_t *s = src;
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = kvl_bf16_to_fp32(s[i]);
  }
}

uint64_t kvl_kv_stamp_new(void) {
  static _Atomic uint64_t next = 1;
  return atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
}

uint64_t kvl_kv_stamp_fresh(void) { return kvl_kv_stamp_new() | KVL_KV_STAMP_FRESH; }

void kvl_kv_stamp_rows(const struct kvl_attn_args *a) {
  if (!a->kv_stamps) return;
  int32_t last = -1;
  for (int t = 0; t < a->n_tokens; t++) {
    const int32_t b = a->block_tables[a->seq[t]][a->pos[t] / KVL_KV_BLOCK];
    KVL_ASSERT(b >= 0 && b < a->kv_blocks);
    if (b != last) a->kv_stamps[b] = kvl_kv_stamp_new(); /* a run of tokens in one block: one new stamp */
    last = b;
  }
}

void kvl_kv_store(const struct kvl_kv_layout *l, void *base, int layer, int n_tokens,
                  const float *k, const float *v, const int32_t *pos, const int32_t *seq,
                  const int32_t *const *block_tables) {
  int kvw = l->n_kv_head * l->head_dim;
  size_t es = elem_size(l->dtype);
  for (int t = 0; t < n_tokens; t++) {
    KVL_ASSERT(pos[t] >= 0);
    int32_t blk = block_tables[seq[t]][pos[t] / KVL_KV_BLOCK];
    size_t off = (size_t)(pos[t] % KVL_KV_BLOCK) * (size_t)kvw * es;
    put_row(l->dtype, (uint8_t *)kvl_kv_k_ptr(l, base, blk, layer) + off, k + (size_t)t * kvw, kvw);
    put_row(l->dtype, (uint8_t *)kvl_kv_v_ptr(l, base, blk, layer) + off, v + (size_t)t * kvw, kvw);
  }
}

void kvl_kv_load(const struct kvl_kv_layout *l, const void *base, int layer, int32_t pos,
                 const int32_t *block_table, float *k, float *v) {
  int kvw = l->n_kv_head * l->head_dim;
  int32_t blk = block_table[pos / KVL_KV_BLOCK];
  size_t off = (size_t)(pos % KVL_KV_BLOCK) * (size_t)kvw * elem_size(l->dtype);
  if (k) get_row(l->dtype, (const uint8_t *)kvl_kv_k_ptr(l, (void *)base, blk, layer) + off, k, kvw);
  if (v) get_row(l->dtype, (const uint8_t *)kvl_kv_v_ptr(l, (void *)base, blk, layer) + off, v, kvw);
}

void kvl_kv_load_unrotated_bf16(const struct kvl_kv_layout *l, const void *base, int layer, int32_t pos,
                                const int32_t *block_table, const float *cos_t, const float *sin_t, uint16_t *k,
                                uint16_t *v) {
  const int d = l->head_dim, h2 = d / 2, kvw = l->n_kv_head * d;
  const int32_t blk = block_table[pos / KVL_KV_BLOCK];
  const size_t off = (size_t)(pos % KVL_KV_BLOCK) * (size_t)kvw * elem_size(l->dtype);
  const uint8_t *kp = (const uint8_t *)kvl_kv_k_ptr(l, (void *)base, blk, layer) + off;
  const uint8_t *vp = (const uint8_t *)kvl_kv_v_ptr(l, (void *)base, blk, layer) + off;
  if (v) {
    if (l->dtype == KVL_KV_BF16) {
      memcpy(v, vp, (size_t)kvw * sizeof(uint16_t));
    } else {
      const float *s = (const float *)vp;
#pragma omp simd
      for (int i = 0; i < kvw; i++) v[i] = kvl_fp32_to_bf16(s[i]);
    }
  }
  if (!k) return;
  for (int h = 0; h < l->n_kv_head; h++) {
    uint16_t *o = k + (size_t)h * d;
    /* kvl_rope_tab's inverse: x[i] c - x[i+h2] (-s), x[i] (-s) + x[i+h2] c (no contraction) */
    if (l->dtype == KVL_KV_BF16) {
      const uint16_t *x = (const uint16_t *)kp + (size_t)h * d;
#pragma omp simd
      for (int i = 0; i < h2; i++) {
        const float a = kvl_bf16_to_fp32(x[i]), b = kvl_bf16_to_fp32(x[i + h2]), si = -sin_t[i];
        o[i] = kvl_fp32_to_bf16(a * cos_t[i] - b * si);
        o[i + h2] = kvl_fp32_to_bf16(a * si + b * cos_t[i]);
      }
    } else {
      const float *x = (const float *)kp + (size_t)h * d;
#pragma omp simd
      for (int i = 0; i < h2; i++) {
        const float a = x[i], b = x[i + h2], si = -sin_t[i];
        o[i] = kvl_fp32_to_bf16(a * cos_t[i] - b * si);
        o[i + h2] = kvl_fp32_to_bf16(a * si + b * cos_t[i]);
      }
    }
  }
}

int kvl_rope_init(struct kvl_rope *r, int head_dim, float theta) {
  if (head_dim <= 0 || head_dim % 2 || head_dim / 2 > 256 || !(theta > 1.0f)) return KVL_EINVAL;
  r->head_dim = head_dim;
  r->theta = theta;
  /* theta^(-2i/d) in fp32, as the reference implementations compute their inverse
   * frequencies (an fp32 power of an fp32 exponent). */
  for (int i = 0; i < head_dim / 2; i++)
    r->inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
  return 0;
}

void kvl_rope_table(const struct kvl_rope *r, int32_t pos, float *c, float *s) {
  /* the angle in double: exact product of the fp32 frequency and the position */
  for (int i = 0; i < r->head_dim / 2; i++) {
    double a = (double)pos * (double)r->inv_freq[i];
    c[i] = (float)cos(a);
    s[i] = (float)sin(a);
  }
}

void kvl_rope_tab(const float *cos_t, const float *sin_t, float *x, int n_tokens, int n_heads, int head_dim,
                  bool inverse) {
  const int h2 = head_dim / 2;
  for (int t = 0; t < n_tokens; t++) {
    const float *c = cos_t + (size_t)t * h2, *sn = sin_t + (size_t)t * h2;
    const float sg = inverse ? -1.0f : 1.0f; /* -s exactly: a sign flip */
    for (int h = 0; h < n_heads; h++) {
      float *v = x + ((size_t)t * n_heads + h) * head_dim;
#pragma omp simd
      for (int i = 0; i < h2; i++) {
        const float a = v[i], b = v[i + h2], si = sg * sn[i];
        v[i] = a * c[i] - b * si;
        v[i + h2] = a * si + b * c[i];
      }
    }
  }
}
