/* backend.cu — the CUDA backend behind kvl_backend_ops: device memory, weights in bf16,
 * cuBLASLt GEMMs, and the kernels of ops.cu.
 *
 * Memory: one cudaMalloc at start (KVL_CUDA_MEM_MIB, default 80% of the free device
 * memory) sliced first-fit; no managed memory. A weight is dequantised once on the host
 * by the reference dequantiser (kvl_dequant_row_ref: the same values the CPU backend
 * sees), rounded to bf16, and kept on the device in the weight's kvl_wpack slot; a weight
 * without a slot is uploaded for the call only. GEMMs: bf16 inputs, fp32 accumulation and
 * output (CUBLAS_COMPUTE_32F), y = x · Wᵀ as cuBLASLt's column-major Yᵀ = W · Xᵀ.
 *
 * The interface passes host arrays. Outside kvl_backend_begin .. end each op copies its
 * inputs in and its outputs back; inside (a forward pass's layers) outputs stay in device
 * mirrors of their host ranges and later ops read them there (the section "activations
 * kept on the device"). A KV pool whose calls carry write stamps (the scheduler's) has a
 * copy on the device that attention reads in place, kept current block by block (the
 * section "the pool on the device"); other pools' blocks are staged per attention call.
 * Small uploads go through a pinned staging ring (to_dev).
 *
 * Compiled for the CPU too (sim-backend.cc, KVL_CUDA_SIM: sim.h's runtime and cuBLASLt
 * subsets, the kernels under its execution model), where it is kvl_backend_cuda_sim. */
#ifndef KVL_CUDA_SIM
#include <cublasLt.h>
#endif
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cuda-impl.h"

extern "C" {
#include "kvl_error.h"
#include "kvl_quant.h" /* kvl_fp32_to_bf16: the rounding the CPU's bf16 paths use */
}

KVL_CU_BEGIN

void kvl__cuda_fail(const char *what, cudaError_t e, const char *file, int line) {
  fprintf(stderr, "kvlingo: CUDA call failed at %s:%d: %s: %s\n", file, line, what, cudaGetErrorString(e));
  abort();
}

#define KVL_CKB(call)                                                                               \
  do {                                                                                              \
    cublasStatus_t s_ = (call);                                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                              \
      fprintf(stderr, "kvlingo: cuBLASLt call failed at %s:%d: %s: status %d\n", __FILE__, __LINE__, #call, \
              (int)s_);                                                                             \
      abort();                                                                                      \
    }                                                                                               \
  } while (0)

/* ---- the arena ---------------------------------------------------------------------- */

enum { MAX_FREE = 4096, ALIGN = 256 };

struct range {
  size_t off, len;
};

static struct arena {
  pthread_mutex_t mu;      /* initialised by init(), before the first slice */
  char *base;
  size_t size;
  struct range free_[MAX_FREE]; /* sorted by offset, coalesced */
  int n_free;
  struct range *used_;          /* live slices, for kvl__cuda_free */
  int n_used, cap_used;
} A;

void *kvl__cuda_alloc(size_t bytes) {
  size_t len = (bytes + ALIGN - 1) / ALIGN * ALIGN;
  if (len == 0) len = ALIGN;
  void *p = NULL;
  pthread_mutex_lock(&A.mu);
  for (int i = 0; i < A.n_free; i++) {
    if (A.free_[i].len < len) continue;
    size_t off = A.free_[i].off;
    A.free_[i].off += len, A.free_[i].len -= len;
    if (A.free_[i].len == 0) {
      memmove(&A.free_[i], &A.free_[i + 1], (size_t)(A.n_free - i - 1) * sizeof(A.free_[0]));
      A.n_free--;
    }
    if (A.n_used == A.cap_used) {
      int cap = A.cap_used ? 2 * A.cap_used : 256;
      struct range *u = (struct range *)realloc(A.used_, (size_t)cap * sizeof(*u));
      KVL_ASSERT(u);
      A.used_ = u, A.cap_used = cap;
    }
    A.used_[A.n_used].off = off, A.used_[A.n_used].len = len;
    A.n_used++;
    p = A.base + off;
    break;
  }
  pthread_mutex_unlock(&A.mu);
  return p;
}

void kvl__cuda_free(void *p) {
  if (!p) return;
  pthread_mutex_lock(&A.mu);
  size_t off = (size_t)((char *)p - A.base), len = 0;
  for (int i = 0; i < A.n_used; i++)
    if (A.used_[i].off == off) {
      len = A.used_[i].len;
      A.used_[i] = A.used_[--A.n_used];
      break;
    }
  KVL_ASSERT(len > 0); /* a slice this arena handed out */
  int i = 0;
  while (i < A.n_free && A.free_[i].off < off) i++;
  bool prev = i > 0 && A.free_[i - 1].off + A.free_[i - 1].len == off;
  bool next = i < A.n_free && off + len == A.free_[i].off;
  if (prev && next) {
    A.free_[i - 1].len += len + A.free_[i].len;
    memmove(&A.free_[i], &A.free_[i + 1], (size_t)(A.n_free - i - 1) * sizeof(A.free_[0]));
    A.n_free--;
  } else if (prev) {
    A.free_[i - 1].len += len;
  } else if (next) {
    A.free_[i].off = off, A.free_[i].len += len;
  } else {
    KVL_ASSERT(A.n_free < MAX_FREE);
    memmove(&A.free_[i + 1], &A.free_[i], (size_t)(A.n_free - i) * sizeof(A.free_[0]));
    A.free_[i].off = off, A.free_[i].len = len;
    A.n_free++;
  }
  pthread_mutex_unlock(&A.mu);
}

/* ---- the backend ------------------------------------------------------------------- */

struct cuda_state {
  int device, n_sm; /* n_sm: multiprocessors (the attention's key split) */
  cudaStream_t st;
  cudaStream_t wb;      /* a translation's target written back to the host (wb_fence) */
  cudaEvent_t wb_after; /* recorded on st, waited for by wb */
  cudaEvent_t wb_part;  /* recorded on wb after a translation's partly filled blocks (WB_PART) */
  cublasLtHandle_t lt;
  void *workspace; /* cuBLASLt's */
  size_t ws_bytes;
  pthread_mutex_t mu; /* one op at a time on the stream */
  char *pin;          /* pinned staging for uploads (NULL: none, copies from pageable memory) */
  size_t pin_bytes, pin_used;
};

static struct cuda_state S_;

/* a device slice for the duration of an op */
static void *dalloc(size_t bytes) {
  void *p = kvl__cuda_alloc(bytes);
  if (!p) {
    fprintf(stderr, "kvlingo: CUDA arena full (%zu bytes asked; KVL_CUDA_MEM_MIB sets its size)\n", bytes);
    abort();
  }
  return p;
}

/* the stream's copies and waits, counted (kvl_backend_traffic) */
static struct kvl_backend_traffic T_;

static void wait_stream(void);

/* An upload goes through the pinned staging ring where it fits (a quarter of the ring at
 * most): a copy from pageable memory may wait for the stream before it starts (the
 * driver stages it), one from pinned memory is queued like a kernel. The ring's bytes are
 * free again at the next wait for the stream (everything queued before it has run), so an
 * upload that finds the ring full waits (counted). Larger ones (weights, a pool's blocks
 * at depth) come from pageable memory. */
/* ---- pinned host memory other than the staging ring: the K/V rows' buffer (cudaMallocHost
 * at start) and ranges registered with kvl_backend_host_register (kvl_pool_pin) -------- */
enum { N_HREG = 32 };
static struct {
  char *p;
  size_t n;
} HR_[N_HREG];
static int n_hreg;

static bool in_hreg(const void *h, size_t n) {
  const char *c = (const char *)h;
  for (int i = 0; i < n_hreg; i++)
    if (c >= HR_[i].p && c + n <= HR_[i].p + HR_[i].n) return true;
  return false;
}

/* True where h's bytes went into the ring: h may be freed or rewritten at once. */
static bool to_dev(void *d, const void *h, size_t bytes) {
  const size_t len = (bytes + 63) / 64 * 64;
  bool staged = false;
  if (in_hreg(h, bytes)) {
    /* pinned already: straight from there */
  } else if (S_.pin && len <= S_.pin_bytes / 4) {
    if (S_.pin_used + len > S_.pin_bytes) wait_stream();
    char *p = S_.pin + S_.pin_used;
    S_.pin_used += len;
    memcpy(p, h, bytes);
    h = p, staged = true;
  } else {
    T_.bytes_pageable += bytes;
  }
  KVL_CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, S_.st));
  T_.copies_in++, T_.bytes_in += bytes;
  return staged;
}

static void to_host_on(void *h, const void *d, size_t bytes, cudaStream_t st) {
  if (!in_hreg(h, bytes)) T_.bytes_pageable += bytes;
  KVL_CK(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, st));
  T_.copies_out++, T_.bytes_out += bytes;
}

static void to_host(void *h, const void *d, size_t bytes) { to_host_on(h, d, bytes, S_.st); }

static void wait_stream(void) {
  KVL_CK(cudaStreamSynchronize(S_.st));
  T_.waits++;
  S_.pin_used = 0; /* every copy from the ring has run */
}

static void *upload(const void *h, size_t bytes) {
  void *d = dalloc(bytes);
  to_dev(d, h, bytes);
  return d;
}

/* ---- activations kept on the device (kvl_backend_begin .. kvl_backend_end) ----------
 * While the owner thread is between begin and end, an op's output lands in a mirror of
 * the host range it names (a device slice), marked newer than the host, and is not copied
 * back; an op reading a range inside a mirror takes the device's bytes. fetch copies the
 * overlapping newer mirrors to the host (and waits); end does so for the range it keeps
 * and drops every mirror.
 * A range that overlaps a mirror only partly is settled first (the mirror copied back and
 * dropped). Everything under S_.mu. */
struct mirror {
  char *host, *dev;
  size_t bytes;
  bool newer; /* the device's bytes are newer than the host's */
};
static struct {
  struct mirror *m;
  int n, cap, depth;
  pthread_t owner;
} M_;

static bool keeping(void) { return M_.depth > 0 && pthread_equal(M_.owner, pthread_self()); }

static bool overlaps(const struct mirror *m, const char *h, size_t n) {
  return h < m->host + m->bytes && m->host < h + n;
}

/* the newer mirrors overlapping [h, h + n) (every one: h NULL) copied to the host and
 * waited for; dropped if `drop` */
static void mirrors_settle(const char *h, size_t n, bool drop) {
  bool copied = false;
  for (int i = 0; i < M_.n; i++)
    if ((!h || overlaps(&M_.m[i], h, n)) && M_.m[i].newer) {
      to_host(M_.m[i].host, M_.m[i].dev, M_.m[i].bytes);
      copied = true;
    }
  if (copied) wait_stream();
  for (int i = M_.n - 1; i >= 0; i--) {
    if (h && !overlaps(&M_.m[i], h, n)) continue;
    M_.m[i].newer = false;
    if (drop) {
      kvl__cuda_free(M_.m[i].dev);
      M_.m[i] = M_.m[--M_.n];
    }
  }
}

/* the mirror holding [h, h + n) whole, or NULL (any overlapping it partly settled first;
 * an op's inputs and output are one range or disjoint ones, so none of its own) */
static struct mirror *mirror_of(const void *hp, size_t n) {
  const char *h = (const char *)hp;
  bool part = false;
  for (int i = 0; i < M_.n; i++) {
    if (h >= M_.m[i].host && h + n <= M_.m[i].host + M_.m[i].bytes) return &M_.m[i];
    part |= overlaps(&M_.m[i], h, n);
  }
  if (part) mirrors_settle(h, n, true);
  return NULL;
}

static struct mirror *mirror_new(void *h, size_t n) {
  if (M_.n == M_.cap) {
    const int cap = M_.cap ? 2 * M_.cap : 32;
    struct mirror *m = (struct mirror *)realloc(M_.m, (size_t)cap * sizeof(*m));
    KVL_ASSERT(m);
    M_.m = m, M_.cap = cap;
  }
  struct mirror *m = &M_.m[M_.n++];
  m->host = (char *)h, m->dev = (char *)dalloc(n), m->bytes = n, m->newer = false;
  return m;
}

/* an op's device bytes for a host range: a mirror's (temp false) or a slice of the op's own */
struct dbuf {
  char *d;
  bool temp;
};

/* an input: its mirror, or uploaded */
static struct dbuf d_in(const void *h, size_t n) {
  struct mirror *m = keeping() ? mirror_of(h, n) : NULL;
  if (m) return {m->dev + ((const char *)h - m->host), false};
  return {(char *)upload(h, n), true};
}

/* an output (inout: read first, as RoPE's in-place rotation): kept, its mirror made where
 * there is none; or a slice the op copies back (d_result) */
static struct dbuf d_out(void *h, size_t n, bool inout) {
  if (!keeping()) return {(char *)(inout ? upload(h, n) : dalloc(n)), true};
  struct mirror *m = mirror_of(h, n);
  if (!m) {
    m = mirror_new(h, n);
    if (inout) to_dev(m->dev, h, n);
  }
  m->newer = true;
  return {m->dev + ((char *)h - m->host), false};
}

/* the output copied back unless kept */
static void d_result(struct dbuf b, void *h, size_t n) {
  if (b.temp) to_host(h, b.d, n);
}

/* an op's end: its results on the host unless kept (a wait), then its own slices freed
 * (while keeping, without a wait: later work on the stream runs after the op's) */
static void d_done(struct dbuf *b, int n) {
  if (!keeping()) wait_stream();
  for (int i = 0; i < n; i++)
    if (b[i].temp) kvl__cuda_free(b[i].d);
}

/* ---- small read-only tables (RMSNorm weights, RoPE frequencies) ----------------------
 * Kept on the device with a host shadow: found again by host address and size while the
 * host bytes still equal the shadow (a memcmp, ~0.1 us per KiB, instead of an upload per
 * op: 2 x 3.5 KiB of norm weights per layer and step of the 0.5B), copied again when they
 * differ (a caller's buffer reused for other values). Up to 64 KiB each, 64 of them, the
 * least recently used replaced; a new copy queued on the stream after the kernels that
 * read the old one. */
enum { N_KCONST = 64, KCONST_MAX = 65536 };
struct kconst {
  const void *host;
  size_t bytes;
  char *shadow, *dev;
  uint64_t used;
};
static struct kconst KC_[N_KCONST];
static uint64_t kc_clock;

/* the device copy of the small table [h, h + n): a dbuf the op does not free */
static struct dbuf d_const(const void *h, size_t n) {
  if (n == 0 || n > KCONST_MAX) return {(char *)upload(h, n), true};
  struct kconst *e = NULL, *victim = &KC_[0];
  for (int i = 0; i < N_KCONST && !e; i++) {
    if (KC_[i].host == h && KC_[i].bytes == n) e = &KC_[i];
    else if (KC_[i].used < victim->used) victim = &KC_[i];
  }
  if (e && memcmp(e->shadow, h, n) == 0) {
    e->used = ++kc_clock;
    return {e->dev, false};
  }
  if (!e) {
    e = victim;
    kvl__cuda_free(e->dev);
    free(e->shadow);
    e->host = h, e->bytes = n, e->dev = (char *)dalloc(n), e->shadow = (char *)malloc(n);
    KVL_ASSERT(e->shadow);
  }
  memcpy(e->shadow, h, n);
  to_dev(e->dev, h, n);
  e->used = ++kc_clock;
  return {e->dev, false};
}

/* ---- small per-step arrays (positions, sequence ids, block tables, tiles, slots) ----
 * The same few arrays go with every layer's ops of a step: a 0.5B decode step made 169
 * copies of a few bytes each (two RoPEs, attention's four, the K/V store's one per layer),
 * each one a DMA queued between kernels. Kept by content: a copy whose bytes equal the
 * array's (a hash, then a memcmp against the host shadow) is taken again, so a step copies
 * each distinct array once. Up to 4 KiB each, 32 of them; the least recently used is
 * rewritten in place, its new bytes queued on the stream after the kernels that read the
 * old ones. */
enum { N_KSMALL = 32, KSMALL_MAX = 4096 };
struct ksmall {
  uint64_t hash, used;
  size_t bytes;
  char *shadow, *dev;
};
static struct ksmall KS_[N_KSMALL];
static uint64_t ks_clock;

/* the device copy of the small array [h, h + n): a dbuf the op does not free */
static struct dbuf d_small(const void *h, size_t n) {
  if (n == 0 || n > KSMALL_MAX) return {(char *)upload(h, n), true};
  uint64_t hash = 0xcbf29ce484222325ull, w; /* FNV-style over 8-byte words: a filter, memcmp decides */
  size_t i = 0;
  for (; i + 8 <= n; i += 8) memcpy(&w, (const char *)h + i, 8), hash = (hash ^ w) * 0x100000001b3ull;
  for (; i < n; i++) hash = (hash ^ ((const unsigned char *)h)[i]) * 0x100000001b3ull;
  struct ksmall *victim = &KS_[0];
  for (int i = 0; i < N_KSMALL; i++) {
    struct ksmall *e = &KS_[i];
    if (e->dev && e->hash == hash && e->bytes == n && memcmp(e->shadow, h, n) == 0) {
      e->used = ++ks_clock;
      return {e->dev, false};
    }
    if (e->used < victim->used) victim = e;
  }
  if (!victim->dev) {
    victim->dev = (char *)dalloc(KSMALL_MAX), victim->shadow = (char *)malloc(KSMALL_MAX);
    KVL_ASSERT(victim->shadow);
  }
  memcpy(victim->shadow, h, n);
  to_dev(victim->dev, h, n);
  victim->hash = hash, victim->bytes = n, victim->used = ++ks_clock;
  return {victim->dev, false};
}

/* ---- the forward's new K/V rows for the host pool, deferred (kvl_kv_put) -------------
 * Within a bracket, for a pool kept on the device, the new rows go into the device copy
 * at once and into the host pool at the bracket's end: each layer's rows are queued for
 * copying into a pinned buffer (no wait), and kvl_backend_end, after its one wait, stores
 * them. So a decode step waits for the device once, not once per layer. Until then the
 * host pool lacks them, and nothing reads it: kvl_kv_put brings the blocks it writes
 * current on the device before writing rows there, so no later copy from the host takes
 * them back (KVL_CUDA_KV_CHECK stores them first, without counting the wait). The kernel
 * that writes a layer's rows into the device copy also writes them, fp32, into a device
 * buffer beside the pinned one, which comes over in one copy queued before the bracket's
 * wait (a 0.5B decode step: 1 copy out instead of 48). Rows that do not fit the buffers
 * (KV_PEND_MIB: a long prefill) are stored per layer as outside a bracket. */
enum { KV_PEND_MIB = 8 };
struct kv_pend {
  const struct kvl_kv_layout *layout;
  void *base;
  int layer, n_tokens;
  const int32_t *pos, *seq;
  const int32_t *const *tables;
  size_t off; /* its K rows at KP_.buf + off, the V rows after them */
};
static struct {
  char *buf; /* pinned */
  char *dev; /* the same bytes on the device, first (made at the first use) */
  size_t cap, used, fetched;
  struct kv_pend *p;
  int n, n_cap;
} KP_;

/* the queued rows' copy to the pinned buffer, queued on the stream (not waited for) */
static void kv_pend_fetch(void) {
  if (KP_.used > KP_.fetched) to_host(KP_.buf + KP_.fetched, KP_.dev + KP_.fetched, KP_.used - KP_.fetched);
  KP_.fetched = KP_.used;
}

static void wb_fence_rows(const void *base, const int32_t *const *tables, const int32_t *seq, const int32_t *pos,
                          int n);

/* the queued rows stored into the host pool, after a wait unless `waited` (their copy
 * queued before it) */
static void kv_pend_flush(bool waited, bool counted) {
  if (!KP_.n) return;
  for (int i = 0; i < KP_.n; i++) /* into a block still coming back: after it */
    wb_fence_rows(KP_.p[i].base, KP_.p[i].tables, KP_.p[i].seq, KP_.p[i].pos, KP_.p[i].n_tokens);
  if (KP_.used > KP_.fetched) {
    kv_pend_fetch();
    waited = false;
  }
  if (!waited) {
    if (counted) wait_stream();
    else KVL_CK(cudaStreamSynchronize(S_.st));
  }
  for (int i = 0; i < KP_.n; i++) {
    const struct kv_pend *q = &KP_.p[i];
    const float *k = (const float *)(KP_.buf + q->off);
    kvl_kv_store(q->layout, q->base, q->layer, q->n_tokens, k,
                 k + (size_t)q->n_tokens * (size_t)q->layout->n_kv_head * (size_t)q->layout->head_dim, q->pos, q->seq,
                 q->tables);
  }
  KP_.n = 0, KP_.used = 0, KP_.fetched = 0;
}

static void cu_begin(kvl_backend_t *be) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  if (M_.depth == 0) M_.depth = 1, M_.owner = pthread_self();
  else if (pthread_equal(M_.owner, pthread_self())) M_.depth++;
  /* else another thread keeps its activations: this one's ops copy theirs back */
  pthread_mutex_unlock(&S_.mu);
}

static void cu_fetch(kvl_backend_t *be, const void *p, size_t bytes) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  if (keeping()) mirrors_settle((const char *)p, bytes, false);
  pthread_mutex_unlock(&S_.mu);
}

static bool cu_traffic(const kvl_backend_t *be, struct kvl_backend_traffic *t) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  *t = T_;
  pthread_mutex_unlock(&S_.mu);
  return true;
}

static void cu_end(kvl_backend_t *be, const void *keep, size_t bytes) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  if (keeping() && --M_.depth == 0) {
    kv_pend_fetch(); /* before the wait below */
    const unsigned long long w0 = T_.waits;
    if (keep && bytes) mirrors_settle((const char *)keep, bytes, true);
    kv_pend_flush(T_.waits != w0, true); /* the deferred K/V rows to the host pool: one wait for all */
    for (int i = 0; i < M_.n; i++) kvl__cuda_free(M_.m[i].dev); /* scratch: not copied back */
    M_.n = 0;
  }
  pthread_mutex_unlock(&S_.mu);
}

/* a weight on the device: bf16 rows x cols, and its bias (fp32) */
struct dweight {
  __nv_bfloat16 *w;
  float *bias;
  void *q;         /* the GGUF rows as they are, for decode products (KVL_CUDA_QGEMV), or NULL */
  uint32_t qtype;
  size_t q_row_bytes;
};

/* KVL_CUDA_QGEMV=1: products of up to KVL__CU_QGEMV_MAX_T tokens on the GGUF blocks
 * (kvl__cu_qgemv) for the formats it takes, the weights' quantised rows kept on the device
 * beside the bf16 copy; default off until a GPU run shows it faster (scripts/gpu-check) */
static bool qgemv_on(void) { /* read when a weight's device copy is made */
  const char *e = getenv("KVL_CUDA_QGEMV");
  return e && strcmp(e, "1") == 0;
}

static void dweight_free(struct dweight *d) {
  kvl__cuda_free(d->w);
  kvl__cuda_free(d->bias);
  kvl__cuda_free(d->q);
}

static void release_pack(struct kvl_wpack *p) {
  struct dweight *d = (struct dweight *)p->impl;
  dweight_free(d);
  free(d);
  p->impl = NULL, p->bytes = 0, p->owner = NULL, p->release = NULL;
}

static void make_dweight(const struct kvl_weight *w, struct dweight *d) {
  const size_t rb = kvl_row_size(w->type, (uint64_t)w->cols);
  float *row = (float *)malloc((size_t)w->cols * sizeof(float));
  uint16_t *hb = (uint16_t *)malloc((size_t)w->rows * (size_t)w->cols * sizeof(uint16_t));
  KVL_ASSERT(row && hb);
  for (int64_t r = 0; r < w->rows; r++) {
    KVL_ASSERT(kvl_dequant_row_ref(w->type, (const uint8_t *)w->data + (size_t)r * rb, row, w->cols) == 0);
    for (int64_t c = 0; c < w->cols; c++) hb[(size_t)r * (size_t)w->cols + (size_t)c] = kvl_fp32_to_bf16(row[c]);
  }
  d->w = (__nv_bfloat16 *)upload(hb, (size_t)w->rows * (size_t)w->cols * sizeof(uint16_t));
  d->bias = w->bias ? (float *)upload(w->bias, (size_t)w->rows * sizeof(float)) : NULL;
  d->q = NULL, d->qtype = w->type, d->q_row_bytes = rb;
  if (qgemv_on() && kvl__cu_qgemv_takes(w->type, w->cols)) d->q = upload(w->data, (size_t)w->rows * rb);
  wait_stream(); /* the host copies are freed next */
  free(row);
  free(hb);
}

/* The weight's device copy: from its pack slot (made on first use), or made for this call
 * (*temp set: the caller frees it). */
static const struct dweight *get_dweight(kvl_backend_t *be, const struct kvl_weight *w, struct dweight *temp,
                                         bool *is_temp) {
  struct kvl_wpack *p = w->pack;
  if (p && p->impl && p->owner == be) {
    *is_temp = false;
    return (const struct dweight *)p->impl;
  }
  make_dweight(w, temp);
  if (p && !p->impl) { /* keep it */
    struct dweight *d = (struct dweight *)malloc(sizeof(*d));
    KVL_ASSERT(d);
    *d = *temp;
    p->impl = d;
    p->bytes = (size_t)w->rows * (size_t)w->cols * 2 + (w->bias ? (size_t)w->rows * 4 : 0) +
               (d->q ? (size_t)w->rows * d->q_row_bytes : 0);
    p->owner = be;
    p->release = release_pack;
    *is_temp = false;
    return d;
  }
  *is_temp = true;
  return temp;
}

static bool cu_supports(const kvl_backend_t *be, enum kvl_op op, uint32_t wtype) {
  (void)be;
  if (op == KVL_OP_MATMUL || op == KVL_OP_EMBED) {
    const struct kvl_type_traits *t = kvl_type_traits(wtype);
    return t && t->can_dequant;
  }
  return op < KVL_OP_COUNT_;
}

/* A GEMM's cuBLASLt descriptors and chosen algorithm, made once per shape: building them
 * and asking the heuristic cost more than a decode step's small GEMM itself. A shape is
 * column-major C (m x n, ldc) = op(A) (m x k) . B (k x n, ldb), op(A) = A or Aᵀ (lda), bf16
 * inputs, fp32 C; a model has a handful of (m, k), a scheduler a few dozen n and
 * translation a few run lengths, so a small table replaced round-robin holds them. Used
 * under S_.mu. */
enum { N_PLANS = 128 };

struct gemm_plan {
  bool trans_a;
  int64_t m, n, k, lda, ldb, ldc;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
};

static struct gemm_plan plans[N_PLANS];
static int n_plans, next_plan;

static void plan_free(struct gemm_plan *p) {
  cublasLtMatrixLayoutDestroy(p->la);
  cublasLtMatrixLayoutDestroy(p->lb);
  cublasLtMatrixLayoutDestroy(p->lc);
  cublasLtMatmulDescDestroy(p->op);
}

static const struct gemm_plan *gemm_plan(bool trans_a, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                                         int64_t ldc) {
  for (int i = 0; i < n_plans; i++) {
    const struct gemm_plan *q = &plans[i];
    if (q->trans_a == trans_a && q->m == m && q->n == n && q->k == k && q->lda == lda && q->ldb == ldb &&
        q->ldc == ldc)
      return q;
  }
  struct gemm_plan *p;
  if (n_plans < N_PLANS) {
    p = &plans[n_plans++];
  } else { /* full: the oldest goes */
    p = &plans[next_plan];
    next_plan = (next_plan + 1) % N_PLANS;
    plan_free(p);
  }
  p->trans_a = trans_a, p->m = m, p->n = n, p->k = k, p->lda = lda, p->ldb = ldb, p->ldc = ldc;
  KVL_CKB(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t tA = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tB = CUBLAS_OP_N;
  KVL_CKB(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA)));
  KVL_CKB(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB)));
  if (trans_a)
    KVL_CKB(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, (uint64_t)k, (uint64_t)m, lda));
  else
    KVL_CKB(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, (uint64_t)m, (uint64_t)k, lda));
  KVL_CKB(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, (uint64_t)k, (uint64_t)n, ldb));
  KVL_CKB(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, (uint64_t)m, (uint64_t)n, ldc));
  cublasLtMatmulPreference_t pref;
  KVL_CKB(cublasLtMatmulPreferenceCreate(&pref));
  KVL_CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &S_.ws_bytes,
                                               sizeof(S_.ws_bytes)));
  cublasLtMatmulHeuristicResult_t h;
  int found = 0;
  KVL_CKB(cublasLtMatmulAlgoGetHeuristic(S_.lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &h, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  if (found < 1) {
    fprintf(stderr, "kvlingo: cuBLASLt has no algorithm for a %lld x %lld x %lld bf16 GEMM\n", (long long)m,
            (long long)n, (long long)k);
    abort();
  }
  p->algo = h.algo;
  return p;
}

static void gemm_ex(bool trans_a, int64_t m, int64_t n, int64_t k, const __nv_bfloat16 *A, int64_t lda,
                    const __nv_bfloat16 *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  const struct gemm_plan *p = gemm_plan(trans_a, m, n, k, lda, ldb, ldc);
  const float one = 1.0f;
  KVL_CKB(cublasLtMatmul(S_.lt, p->op, &one, A, p->la, B, p->lb, &beta, C, p->lc, C, p->lc, &p->algo, S_.workspace,
                         S_.ws_bytes, S_.st));
}

/* Yᵀ (N x T, column-major) = W (K x N column-major, transposed) · Xᵀ (K x T) */
static void gemm(const __nv_bfloat16 *W, const __nv_bfloat16 *X, float *Y, int64_t N, int64_t K, int T) {
  gemm_ex(true, N, T, K, W, K, X, K, 0.0f, Y, N);
}

static void cu_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  if (n_tokens <= 0) return;
  pthread_mutex_lock(&S_.mu);
  struct dweight temp;
  bool is_temp;
  const struct dweight *d = get_dweight(be, w, &temp, &is_temp);
  const size_t xn = (size_t)n_tokens * (size_t)w->cols, yn = (size_t)n_tokens * (size_t)w->rows;
  const bool q = d->q && n_tokens <= KVL__CU_QGEMV_MAX_T;
  struct dbuf b[3] = {d_in(x, xn * sizeof(float)), {q ? NULL : (char *)dalloc(xn * sizeof(__nv_bfloat16)), !q},
                      d_out(y, yn * sizeof(float), false)};
  if (q) {
    kvl__cu_qgemv(d->q, d->qtype, d->q_row_bytes, (const float *)b[0].d, (float *)b[2].d, (int)w->rows, (int)w->cols,
                  n_tokens, S_.st);
  } else {
    kvl__cu_to_bf16((const float *)b[0].d, (__nv_bfloat16 *)b[1].d, (int64_t)xn, S_.st);
    gemm(d->w, (const __nv_bfloat16 *)b[1].d, (float *)b[2].d, w->rows, w->cols, n_tokens);
  }
  if (d->bias) kvl__cu_bias((float *)b[2].d, d->bias, n_tokens, w->rows, S_.st);
  d_result(b[2], y, yn * sizeof(float));
  d_done(b, 3);
  if (is_temp) dweight_free(&temp);
  pthread_mutex_unlock(&S_.mu);
}

static void cu_rmsnorm(kvl_backend_t *be, const float *x, const float *w, float *y, int n_tokens, int n, float eps) {
  (void)be;
  if (n_tokens <= 0) return;
  pthread_mutex_lock(&S_.mu);
  const size_t bytes = (size_t)n_tokens * (size_t)n * sizeof(float);
  /* one block per row: y may be x */
  struct dbuf b[3] = {d_in(x, bytes), d_const(w, (size_t)n * sizeof(float)), d_out(y, bytes, x == y)};
  kvl__cu_rmsnorm((const float *)b[0].d, (const float *)b[1].d, (float *)b[2].d, n_tokens, n, eps, S_.st);
  d_result(b[2], y, bytes);
  d_done(b, 3);
  pthread_mutex_unlock(&S_.mu);
}

static void cu_rope(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens,
                    int n_heads, bool inverse) {
  (void)be;
  if (n_tokens <= 0) return;
  pthread_mutex_lock(&S_.mu);
  const size_t bytes = (size_t)n_tokens * (size_t)n_heads * (size_t)r->head_dim * sizeof(float);
  struct dbuf b[3] = {d_out(x, bytes, true), d_small(pos, (size_t)n_tokens * sizeof(int32_t)),
                      d_const(r->inv_freq, (size_t)(r->head_dim / 2) * sizeof(float))};
  kvl__cu_rope((float *)b[0].d, (const int32_t *)b[1].d, (const float *)b[2].d, n_tokens, n_heads, r->head_dim,
               inverse, S_.st);
  d_result(b[0], x, bytes);
  d_done(b, 3);
  pthread_mutex_unlock(&S_.mu);
}

static void cu_swiglu(kvl_backend_t *be, const float *g, const float *u, float *y, int64_t n) {
  (void)be;
  if (n <= 0) return;
  pthread_mutex_lock(&S_.mu);
  const size_t bytes = (size_t)n * sizeof(float);
  struct dbuf b[3] = {d_in(g, bytes), d_in(u, bytes), {NULL, false}};
  b[2] = d_out(y, bytes, y == g || y == u); /* elementwise: y may be g or u */
  kvl__cu_swiglu((const float *)b[0].d, (const float *)b[1].d, (float *)b[2].d, n, S_.st);
  d_result(b[2], y, bytes);
  d_done(b, 3);
  pthread_mutex_unlock(&S_.mu);
}

static void cu_add(kvl_backend_t *be, float *h, const float *x, int64_t n) {
  (void)be;
  if (n <= 0) return;
  pthread_mutex_lock(&S_.mu);
  const size_t bytes = (size_t)n * sizeof(float);
  struct dbuf b[2] = {d_in(x, bytes), {NULL, false}};
  b[1] = d_out(h, bytes, true);
  kvl__cu_add((float *)b[1].d, (const float *)b[0].d, n, S_.st);
  d_result(b[1], h, bytes);
  d_done(b, 2);
  pthread_mutex_unlock(&S_.mu);
}

/* the summaries of the rows, and the rows asked for copied in order on the device: in a
 * decode step's bracket only these reach the host at its end. KVL_CUDA_LOGITS_TOP=0
 * declines (every row crosses whole: A/B runs). */
static bool cu_logits_top(kvl_backend_t *be, const float *logits, int n_rows, int n_vocab, const int8_t *full,
                          const float *temperature, const double *u, struct kvl_logit_top *top, float *rows) {
  (void)be;
  static int on = -1;
  if (on < 0) on = !getenv("KVL_CUDA_LOGITS_TOP") || strcmp(getenv("KVL_CUDA_LOGITS_TOP"), "0") != 0;
  if (!on) return false;
  pthread_mutex_lock(&S_.mu);
  const size_t row_bytes = (size_t)n_vocab * sizeof(float);
  int n_full = 0;
  for (int r = 0; full && r < n_rows; r++) n_full += full[r] != 0;
  struct dbuf b[5] = {d_in(logits, (size_t)n_rows * row_bytes), d_out(top, (size_t)n_rows * sizeof(*top), false),
                      {NULL, false}, {NULL, false}, {NULL, false}}; /* 3, 4: the draws' temperatures and points */
  if (temperature && u)
    b[3] = d_small(temperature, (size_t)n_rows * sizeof(float)), b[4] = d_small(u, (size_t)n_rows * sizeof(double));
  kvl__cu_logits_top((const float *)b[0].d, n_rows, n_vocab, (struct kvl_logit_top *)b[1].d, (const float *)b[3].d,
                     (const double *)b[4].d, S_.st);
  if (n_full > 0) {
    b[2] = d_out(rows, (size_t)n_full * row_bytes, false);
    for (int r = 0, j = 0; r < n_rows; r++)
      if (full[r])
        KVL_CK(cudaMemcpyAsync(b[2].d + (size_t)j++ * row_bytes, b[0].d + (size_t)r * row_bytes, row_bytes,
                               cudaMemcpyDeviceToDevice, S_.st));
    d_result(b[2], rows, (size_t)n_full * row_bytes);
  }
  d_result(b[1], top, (size_t)n_rows * sizeof(*top));
  d_done(b, 5);
  pthread_mutex_unlock(&S_.mu);
  return true;
}

/* rows of the device bf16 table (the tied output head shares it): bf16 values */
static void cu_embed(kvl_backend_t *be, const struct kvl_weight *t, const int32_t *ids, float *y, int n_tokens) {
  if (n_tokens <= 0) return;
  pthread_mutex_lock(&S_.mu);
  struct dweight temp;
  bool is_temp;
  const struct dweight *d = get_dweight(be, t, &temp, &is_temp);
  const size_t bytes = (size_t)n_tokens * (size_t)t->cols * sizeof(float);
  struct dbuf b[2] = {d_small(ids, (size_t)n_tokens * sizeof(int32_t)), d_out(y, bytes, false)};
  kvl__cu_embed(d->w, (const int32_t *)b[0].d, (float *)b[1].d, n_tokens, t->cols, S_.st);
  d_result(b[1], y, bytes);
  d_done(b, 2);
  if (is_temp) dweight_free(&temp);
  pthread_mutex_unlock(&S_.mu);
}

/* ---- the pool on the device ----------------------------------------------------------
 *
 * A pool whose calls carry write stamps (kvl_attn_args.kv_stamps: the scheduler's) gets a
 * device copy of its whole hot arena, one arena slice, with the stamp each block was
 * copied under. Attention (and kvl_kv_put) copies only the blocks it reads whose stamp
 * changed since (the pool's restores and copies on write, rows written on the host), runs
 * of consecutive blocks in one copy each, then reads the copy in place through the
 * physical block tables; kvl_kv_put writes the forward's new rows into both the host pool
 * and the copy, so a block read every step is copied once, and a new one (a fresh stamp)
 * never. Up to N_DEVPOOL pools: the least
 * recently used one's copy makes room, and where the arena has none the others' copies go
 * (least recently used first); kvl_kv_pool_gone drops a freed pool's; a pool whose copy
 * still does not fit is staged per call as a pool without stamps is (a warning, once);
 * KVL_CUDA_KV_KEEP=0 stages every pool (for A/B runs). KVL_CUDA_KV_CHECK=1
 * compares, at every attention call, the layer's rows the batch reads in the copy with
 * the host pool's and aborts on a difference (tests). Under S_.mu. */
enum { N_DEVPOOL = 8 };
struct devpool {
  const void *base; /* the host arena */
  int32_t n_blocks;
  size_t bb;
  char *mem;        /* NULL: no room (staged) */
  uint64_t *stamp;  /* [n_blocks] the stamp each device block was copied under (0: never) */
  uint64_t used;    /* last use, for the replacement */
  uint8_t *wb;      /* [n_blocks] its host bytes still coming back on S_.wb (wb_fence), or NULL */
};
static struct devpool DP_[N_DEVPOOL];
static uint64_t dp_clock;

/* ---- a translation's target written back on a second stream ---------------------------
 * A translation into a kept pool whose hot arena is pinned writes its target's blocks in
 * the device copy; they go back to the host on S_.wb, after an event on S_.st, and the
 * translation returns without waiting for them (nor for its kernels): the incoming
 * model's first step runs while they copy (32k positions of the 1.5B are 0.9 GB: tens of
 * ms over PCIe, more than the translation and the step together). Those blocks are marked
 * in their copy's `wb` until wb_fence waits for the stream; it runs before anything else
 * touches their host bytes or their device copy's memory: rows a step stores into them
 * (kv_pend_flush, the per-layer store in cu_kv_put: the last block is often filled in
 * part, and the next step writes there), an upload of them, the KV check, another
 * write-back of them, a dropped copy, an unregistration, and the pool's own host copies
 * and other backends' readers (kvl_backend_host_sync, which kvl_kvpool.h calls). A step's
 * device writes into a block still being copied are harmless: the host's rows are stored
 * after the fence, so the host ends with the step's bytes either way.
 * The partly filled blocks go first, followed by the event S_.wb_part, and are marked
 * WB_PART: the next step's rows (which go there) wait for that event only, not for the
 * whole target; every partial copy queued before the latest event has landed with it.
 * KVL_CUDA_WB_ASYNC=0: every block at once (A/B runs). Under S_.mu. */
enum { WB_WHOLE = 1, WB_PART = 2 }; /* devpool.wb marks */
static bool wb_any; /* some copy's wb has a mark */

static void wb_fence(void) {
  if (!wb_any) return;
  KVL_CK(cudaStreamSynchronize(S_.wb));
  T_.waits++;
  for (int i = 0; i < N_DEVPOOL; i++)
    if (DP_[i].wb) memset(DP_[i].wb, 0, (size_t)DP_[i].n_blocks);
  wb_any = false;
}

static bool wb_marked(const struct devpool *d, int32_t b) { return wb_any && d && d->wb && b >= 0 && d->wb[b]; }

/* the copy of the pool whose hot arena holds host bytes [p, p + n), or NULL */
static struct devpool *devpool_at(const void *p, size_t n) {
  const char *c = (const char *)p;
  for (int i = 0; i < N_DEVPOOL; i++) {
    const char *b = (const char *)DP_[i].base;
    if (DP_[i].mem && b && c >= b && c + n <= b + (size_t)DP_[i].n_blocks * DP_[i].bb) return &DP_[i];
  }
  return NULL;
}

/* before rows are stored on the host at positions pos of sequences seq (tables: theirs) */
static void wb_fence_rows(const void *base, const int32_t *const *tables, const int32_t *seq, const int32_t *pos,
                          int n) {
  if (!wb_any) return;
  const struct devpool *d = devpool_at(base, 1);
  bool part = false;
  for (int t = 0; d && d->wb && t < n; t++) {
    const int32_t b = tables[seq[t]][pos[t] / KVL_KV_BLOCK];
    if (wb_marked(d, b) && d->wb[b] == WB_WHOLE) {
      wb_fence();
      return;
    }
    part |= wb_marked(d, b);
  }
  if (part) { /* the partly filled blocks only */
    KVL_CK(cudaEventSynchronize(S_.wb_part));
    T_.waits++;
    for (int i = 0; i < N_DEVPOOL; i++)
      for (int32_t b = 0; DP_[i].wb && b < DP_[i].n_blocks; b++)
        if (DP_[i].wb[b] == WB_PART) DP_[i].wb[b] = 0;
  }
}

static void cu_sync(kvl_backend_t *be) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  wait_stream();
  pthread_mutex_unlock(&S_.mu);
}

static void cu_host_sync(kvl_backend_t *be, const void *p, size_t bytes) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  if (wb_any) {
    const struct devpool *d = p ? devpool_at(p, bytes ? bytes : 1) : NULL;
    bool hit = !p; /* bytes outside every pool's copy have nothing coming back (a drop fences) */
    if (d && d->wb) {
      const size_t off = (size_t)((const char *)p - (const char *)d->base);
      for (size_t b = off / d->bb; !hit && b * d->bb < off + bytes && b < (size_t)d->n_blocks; b++) hit = d->wb[b];
    }
    if (hit) wb_fence();
  }
  pthread_mutex_unlock(&S_.mu);
}

static void devpool_drop(struct devpool *d) {
  if (d->wb) wb_fence(); /* its memory may still be read by S_.wb */
  kvl__cuda_free(d->mem);
  free(d->stamp);
  free(d->wb);
  *d = devpool{};
}

/* the device copy of the pool at base (made at first use), or NULL: staged */
static struct devpool *devpool_get(const void *base, const struct kvl_kv_layout *l, const uint64_t *stamps,
                                   int32_t n_blocks) {
  static int keep = -1; /* KVL_CUDA_KV_KEEP=0: every pool staged (A/B runs) */
  if (keep < 0) keep = !getenv("KVL_CUDA_KV_KEEP") || strcmp(getenv("KVL_CUDA_KV_KEEP"), "0") != 0;
  if (!stamps || n_blocks <= 0 || !keep) return NULL;
  const size_t bb = kvl_kv_block_bytes(l);
  struct devpool *victim = &DP_[0];
  for (int i = 0; i < N_DEVPOOL; i++) {
    struct devpool *d = &DP_[i];
    if (d->base == base) {
      if (d->n_blocks == n_blocks && d->bb == bb) {
        d->used = ++dp_clock;
        return d->mem ? d : NULL;
      }
      victim = d; /* the same arena with another geometry: a new pool there */
      break;
    }
    if (d->used < victim->used) victim = d;
  }
  devpool_drop(victim);
  victim->base = base, victim->n_blocks = n_blocks, victim->bb = bb, victim->used = ++dp_clock;
  victim->mem = (char *)kvl__cuda_alloc((size_t)n_blocks * bb);
  while (!victim->mem) { /* no room: the other copies go, least recently used first (freed pools' among them) */
    struct devpool *old = NULL;
    for (int i = 0; i < N_DEVPOOL; i++)
      if (&DP_[i] != victim && DP_[i].mem && (!old || DP_[i].used < old->used)) old = &DP_[i];
    if (!old) break;
    devpool_drop(old);
    victim->mem = (char *)kvl__cuda_alloc((size_t)n_blocks * bb);
  }
  victim->stamp = (uint64_t *)calloc((size_t)n_blocks, sizeof(uint64_t));
  if (!victim->mem || !victim->stamp) {
    static bool told;
    if (!told)
      fprintf(stderr, "kvlingo: CUDA arena has no room for a KV pool of %zu MiB: its blocks are copied per "
                      "call (KVL_CUDA_MEM_MIB sets the arena)\n", (size_t)n_blocks * bb >> 20);
    told = true;
    kvl__cuda_free(victim->mem);
    free(victim->stamp);
    victim->mem = NULL, victim->stamp = NULL;
    return NULL;
  }
  return victim;
}

/* kvl_kv_pool_gone: the copy of the pool at base dropped */
static void cu_pool_gone(const void *base) {
  pthread_mutex_lock(&S_.mu);
  for (int i = 0; i < N_DEVPOOL; i++)
    if (DP_[i].base == base) devpool_drop(&DP_[i]);
  pthread_mutex_unlock(&S_.mu);
}

static struct devpool *devpool_of(const struct kvl_attn_args *a) {
  return devpool_get(a->kv_base, a->kv, a->kv_stamps, a->kv_blocks);
}

static int cmp_i32(const void *x, const void *y) {
  const int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
  return (a > b) - (a < b);
}

/* Of the blocks ids[0..n) (-1: none), those whose copy is older than the pool's stamp
 * copied from the host arena at base and marked current; where skip[i] is set, block
 * ids[i] is left alone (its caller overwrites it whole). */
static void devpool_sync(struct devpool *d, const void *base, const uint64_t *stamps, const int32_t *ids, size_t n,
                         const uint8_t *skip) {
  std::vector<int32_t> stale;
  for (size_t i = 0; i < n; i++) {
    const int32_t b = ids[i];
    if (b < 0 || (skip && skip[i])) continue;
    KVL_ASSERT(b < d->n_blocks);
    if (d->stamp[b] != stamps[b]) {
      if (wb_marked(d, b)) wb_fence(); /* (the pool waits before writing its host bytes) */
      d->stamp[b] = stamps[b];
      if (!(stamps[b] & KVL_KV_STAMP_FRESH)) stale.push_back(b); /* a new block's old bytes are never read */
    }
  }
  if (stale.size() > 1) qsort(stale.data(), stale.size(), sizeof(int32_t), cmp_i32); /* (data() may be NULL) */
  for (size_t i = 0; i < stale.size();) {
    size_t r = 1;
    while (i + r < stale.size() && stale[i + r] == stale[i] + (int32_t)r) r++;
    to_dev(d->mem + (size_t)stale[i] * d->bb, (const char *)base + (size_t)stale[i] * d->bb, r * d->bb);
    i += r;
  }
}

/* where in a block the layer's K slab starts (its V slab follows) */
static size_t slab_offset(const struct kvl_attn_args *a) {
  return (size_t)((const char *)kvl_kv_k_ptr(a->kv, (void *)a->kv_base, 0, a->layer) - (const char *)a->kv_base);
}

/* KVL_CUDA_KV_CHECK: the rows of the layer the batch reads, device copy against host pool */
static void devpool_check(const struct devpool *d, const struct kvl_attn_args *a, const kvl__cu_attn_stage *sg) {
  kv_pend_flush(false, false); /* the host pool made current first (the wait not counted) */
  if (wb_any) KVL_CK(cudaStreamSynchronize(S_.wb)); /* and the write-backs landed (marks kept: not counted) */
  const struct kvl_kv_layout *l = a->kv;
  const size_t row = (size_t)l->n_kv_head * (size_t)l->head_dim * (l->dtype == KVL_KV_BF16 ? 2 : 4);
  const size_t half = KVL_KV_BLOCK * row, off = slab_offset(a);
  std::vector<int32_t> last((size_t)sg->n_seq, -1);
  for (int t = 0; t < a->n_tokens; t++)
    if (a->pos[t] > last[(size_t)a->seq[t]]) last[(size_t)a->seq[t]] = a->pos[t];
  std::vector<char> got(2 * half);
  for (int q = 0; q < sg->n_seq; q++)
    for (int j = 0; j * KVL_KV_BLOCK <= last[(size_t)q]; j++) {
      const int32_t b = sg->tables[(size_t)q * sg->max_blocks + j];
      /* not counted in kvl_backend_traffic: the check is not the backend's work */
      KVL_CK(cudaMemcpyAsync(got.data(), d->mem + (size_t)b * d->bb + off, 2 * half, cudaMemcpyDeviceToHost, S_.st));
      KVL_CK(cudaStreamSynchronize(S_.st));
      const char *host = (const char *)a->kv_base + (size_t)b * d->bb + off;
      for (int r = 0; r < KVL_KV_BLOCK && j * KVL_KV_BLOCK + r <= last[(size_t)q]; r++)
        for (int kv = 0; kv < 2; kv++)
          if (memcmp(got.data() + kv * half + r * row, host + kv * half + r * row, row)) {
            fprintf(stderr, "kvlingo: KVL_CUDA_KV_CHECK: the device copy of block %d (layer %d, %s row %d: "
                            "sequence %d position %d) differs from the host pool\n", (int)b, a->layer,
                    kv ? "V" : "K", r, q, j * KVL_KV_BLOCK + r);
            abort();
          }
    }
}

static bool kv_check(void) { /* read per call (tests turn it off and on) */
  const char *e = getenv("KVL_CUDA_KV_CHECK");
  return e && *e && strcmp(e, "0") != 0;
}

/* The plan picks the kernel, its tiles and key chunks. The blocks the batch's sequences
 * read: in the pool's device copy where it has one (kept current, read in place), else
 * this layer's K and V slabs (adjacent in the pool) copied to the device in local order
 * with the block tables rewritten to local ids (kvl__cu_attn_stage_make). */
static void cu_attention(kvl_backend_t *be, const struct kvl_attn_args *a) {
  (void)be;
  if (a->n_tokens <= 0) return;
  kvl__cu_attn_stage sg;
  int32_t *tiles = (int32_t *)malloc(((size_t)a->n_tokens + 1) * sizeof(int32_t));
  pthread_mutex_lock(&S_.mu);
  struct devpool *dp = devpool_of(a);
  KVL_ASSERT(tiles && kvl__cu_attn_stage_make(a, dp != NULL, &sg) == 0);
  const kvl__cu_attn_plan plan = kvl__cu_attn_plan_make(a, S_.n_sm, tiles);
  const size_t es = a->kv->dtype == KVL_KV_BF16 ? 2 : 4;
  char *dblocks = NULL;
  if (dp) {
    devpool_sync(dp, a->kv_base, a->kv_stamps, sg.tables, (size_t)sg.n_seq * (size_t)sg.max_blocks, NULL);
    if (kv_check()) devpool_check(dp, a, &sg);
  } else {
    dblocks = (char *)dalloc((size_t)(sg.n_local > 0 ? sg.n_local : 1) * sg.slab);
    for (int i = 0; i < sg.n_local; i++) to_dev(dblocks + (size_t)i * sg.slab, sg.src[i], sg.slab);
  }
  const size_t qbytes = (size_t)a->n_tokens * (size_t)a->n_head * (size_t)a->kv->head_dim * sizeof(float);
  const size_t part = kvl__cu_attn_part_floats(&plan, a);
  const bool tiled = plan.path == KVL__CU_ATTN_TILED;
  struct dbuf b[8] = {
      {dblocks, dblocks != NULL},
      d_in(a->q, qbytes),
      d_out(a->out, qbytes, false),
      {part ? (char *)dalloc(part * sizeof(float)) : NULL, part > 0},
      d_small(a->pos, (size_t)a->n_tokens * sizeof(int32_t)),
      d_small(a->seq, (size_t)a->n_tokens * sizeof(int32_t)),
      tiled ? d_small(tiles, ((size_t)plan.n_tiles + 1) * sizeof(int32_t)) : dbuf{NULL, false},
      d_small(sg.tables, (size_t)sg.n_seq * (size_t)sg.max_blocks * sizeof(int32_t))};
  kvl__cu_attn_dev dv = {};
  dv.q = (const float *)b[1].d, dv.out = (float *)b[2].d, dv.part = (float *)b[3].d;
  dv.pos = (const int32_t *)b[4].d, dv.seq = (const int32_t *)b[5].d, dv.tiles = (const int32_t *)b[6].d;
  dv.tables = (const int32_t *)b[7].d, dv.max_blocks = sg.max_blocks;
  if (dp) {
    dv.blocks = dp->mem + slab_offset(a);
    dv.bstride = (int64_t)(dp->bb / es);
  } else {
    dv.blocks = dblocks, dv.bstride = (int64_t)(sg.slab / es);
  }
  kvl__cu_attention(&plan, a, &dv, S_.st);
  KVL_CK(cudaGetLastError());
  d_result(b[2], a->out, qbytes);
  d_done(b, 8);
  pthread_mutex_unlock(&S_.mu);
  kvl__cu_attn_stage_free(&sg);
  free(tiles);
}

/* The new rows into the pool's device copy (the blocks they go into brought current
 * first) and into the host pool: at once (the caller's k and v brought back first where
 * they are kept on the device: one wait for both when adjacent), or, within a bracket,
 * queued for the bracket's end (the section above). */
static void cu_kv_put(kvl_backend_t *be, const struct kvl_attn_args *a, const float *k, const float *v) {
  (void)be;
  const int T = a->n_tokens, kvw = a->kv->n_kv_head * a->kv->head_dim;
  if (T <= 0) return;
  const size_t n = (size_t)T * (size_t)kvw * sizeof(float);
  pthread_mutex_lock(&S_.mu);
  struct devpool *dp = devpool_of(a);
  if (dp && keeping() && KP_.cap && !KP_.dev) KP_.dev = (char *)kvl__cuda_alloc(KP_.cap); /* NULL: per layer */
  const bool defer = dp && keeping() && KP_.dev && KP_.used + 2 * n <= KP_.cap;
  if (!defer) {
    if (keeping()) {
      if (v == k + (size_t)T * kvw) {
        mirrors_settle((const char *)k, 2 * n, false);
      } else {
        mirrors_settle((const char *)k, n, false);
        mirrors_settle((const char *)v, n, false);
      }
    }
    wb_fence_rows(a->kv_base, a->block_tables, a->seq, a->pos, T);
    pthread_mutex_unlock(&S_.mu);
    kvl_kv_store(a->kv, (void *)a->kv_base, a->layer, T, k, v, a->pos, a->seq, a->block_tables);
    pthread_mutex_lock(&S_.mu);
    dp = devpool_of(a);
    if (!dp) kvl_kv_stamp_rows(a); /* the host's rows only: no copy of ours is current now */
  }
  if (dp) {
    std::vector<int32_t> where(2 * (size_t)T);
    for (int t = 0; t < T; t++) {
      where[(size_t)t] = a->block_tables[a->seq[t]][a->pos[t] / KVL_KV_BLOCK];
      where[(size_t)T + t] = a->pos[t] % KVL_KV_BLOCK;
      KVL_ASSERT(where[(size_t)t] >= 0 && where[(size_t)t] < dp->n_blocks);
    }
    /* the blocks written: current before rows go in (a later copy of one from the host
     * would take back deferred rows); the batch's other blocks attention brings current */
    devpool_sync(dp, a->kv_base, a->kv_stamps, where.data(), (size_t)T, NULL);
    struct kvl__cu_kv_geom g;
    g.n_kv_head = a->kv->n_kv_head, g.head_dim = a->kv->head_dim, g.bf16 = a->kv->dtype == KVL_KV_BF16;
    g.block_bytes = (int64_t)dp->bb, g.slab_bytes = (int64_t)KVL_KV_BLOCK * kvw * (g.bf16 ? 2 : 4);
    struct dbuf b[3] = {d_in(k, n), d_in(v, n), d_small(where.data(), where.size() * sizeof(int32_t))};
    const int32_t *dw = (const int32_t *)b[2].d;
    float *copy = defer ? (float *)(KP_.dev + KP_.used) : NULL; /* the rows for the host pool, K then V */
    kvl__cu_kv_store_rows((const float *)b[0].d, dp->mem, &g, dw, dw + T, NULL, NULL, 2 * a->layer, T, copy, S_.st);
    kvl__cu_kv_store_rows((const float *)b[1].d, dp->mem, &g, dw, dw + T, NULL, NULL, 2 * a->layer + 1, T,
                          copy ? copy + (size_t)T * kvw : NULL, S_.st);
    KVL_CK(cudaGetLastError());
    if (defer) { /* the rows to the pinned buffer, for the host pool at the bracket's end */
      if (KP_.n == KP_.n_cap) {
        const int cap = KP_.n_cap ? 2 * KP_.n_cap : 64;
        struct kv_pend *p = (struct kv_pend *)realloc(KP_.p, (size_t)cap * sizeof(*p));
        KVL_ASSERT(p);
        KP_.p = p, KP_.n_cap = cap;
      }
      struct kv_pend *q = &KP_.p[KP_.n++];
      q->layout = a->kv, q->base = (void *)a->kv_base, q->layer = a->layer, q->n_tokens = T;
      q->pos = a->pos, q->seq = a->seq, q->tables = a->block_tables, q->off = KP_.used;
      KP_.used += (2 * n + 63) / 64 * 64; /* written by the kernels above; fetched at the end */
    }
    d_done(b, 3);
  }
  pthread_mutex_unlock(&S_.mu);
}

/* ---- translation ----------------------------------------------------------------------
 *
 * The span's source blocks and the target blocks it writes are staged on the device (runs
 * of consecutive physical blocks in one copy each; a target block the span fills entirely
 * is not copied in), the maps are kept in bf16 in the translator's pack slot, and per
 * chunk of positions: the used source layers' keys un-rotated and values gathered into
 * position-major bf16 scratch [position][source layer][w_src] (so the consecutive layers a
 * map reads are one strided matrix), then per target layer and K/V one cuBLASLt product per
 * run of consecutive source layers (fp32 accumulation; the intercept as C's start), the
 * keys rotated with the target RoPE and everything stored in the target's dtype. Then the
 * target blocks go back to the host pool. Where the span gives both pools' write stamps and
 * both have device copies (the section "the pool on the device"), nothing is staged: the
 * source is read from its copy and the target written into its copy in place (only blocks
 * whose stamp changed copied in first, as attention does), the target blocks copied from
 * there to the host, and the copy marked current under the stamps the caller gave them:
 * the target model's next step finds them on the device. */
enum { TR_CHUNK = 4096 };

struct tr_dev_maps { /* a translator's maps on the device: a kvl_tr_args pack's impl */
  int n;             /* 2 x target layers */
  __nv_bfloat16 **w; /* device [nu * w_src][w_dst] row-major (column-major: w_dst x nu * w_src) */
  float **bias;      /* device [w_dst] or NULL */
};

static void tr_maps_free(struct tr_dev_maps *d) {
  if (!d) return;
  for (int i = 0; i < d->n; i++) {
    if (d->w) kvl__cuda_free(d->w[i]);
    if (d->bias) kvl__cuda_free(d->bias[i]);
  }
  free(d->w);
  free(d->bias);
  free(d);
}

static void release_tr_pack(struct kvl_wpack *p) {
  tr_maps_free((struct tr_dev_maps *)p->impl);
  p->impl = NULL, p->bytes = 0, p->owner = NULL, p->release = NULL;
}

/* The maps in bf16 on the device (bias fp32); NULL when the arena is full. */
static struct tr_dev_maps *tr_maps_make(const struct kvl_tr_args *a, int64_t ws, int64_t wd, size_t *bytes) {
  const int n = 2 * a->dst_layout->n_layer;
  struct tr_dev_maps *d = (struct tr_dev_maps *)calloc(1, sizeof(*d));
  KVL_ASSERT(d);
  d->n = n;
  d->w = (__nv_bfloat16 **)calloc((size_t)n, sizeof(*d->w));
  d->bias = (float **)calloc((size_t)n, sizeof(*d->bias));
  KVL_ASSERT(d->w && d->bias);
  *bytes = 0;
  for (int i = 0; i < n; i++) {
    const struct kvl_tr_map_ref *m = &a->maps[i];
    const size_t cnt = (size_t)m->nu * (size_t)ws * (size_t)wd;
    uint16_t *h = (uint16_t *)malloc(cnt * sizeof(uint16_t));
    KVL_ASSERT(h);
    for (size_t j = 0; j < cnt; j++) h[j] = kvl_fp32_to_bf16(m->w[j]);
    d->w[i] = (__nv_bfloat16 *)kvl__cuda_alloc(cnt * sizeof(uint16_t));
    if (m->bias) d->bias[i] = (float *)kvl__cuda_alloc((size_t)wd * sizeof(float));
    if (!d->w[i] || (m->bias && !d->bias[i])) {
      free(h);
      tr_maps_free(d);
      return NULL;
    }
    if (!to_dev(d->w[i], h, cnt * sizeof(uint16_t))) wait_stream(); /* h is freed next */
    if (m->bias) to_dev(d->bias[i], m->bias, (size_t)wd * sizeof(float));
    free(h);
    *bytes += cnt * sizeof(uint16_t) + (m->bias ? (size_t)wd * sizeof(float) : 0);
  }
  return d;
}

/* One side of the span: the blocks its positions touch, in logical order, and each
 * position's (local block, slot). */
struct tr_side {
  int n_local;
  int32_t *phys;  /* [n_local] physical block of each local block */
  uint8_t *full;  /* [n_local] every slot of the block is in the span */
  int32_t *where; /* [2n]: local block of position i at [i], its slot at [n + i] */
};

static int tr_side_make(const int32_t *table, const int32_t *pos, int32_t n, struct tr_side *sd) {
  int32_t max_lb = 0;
  for (int32_t i = 0; i < n; i++)
    if (pos[i] / KVL_KV_BLOCK > max_lb) max_lb = pos[i] / KVL_KV_BLOCK;
  int32_t *loc = (int32_t *)malloc(((size_t)max_lb + 1) * sizeof(int32_t));
  uint8_t *cnt = (uint8_t *)calloc((size_t)max_lb + 1, 1);
  sd->phys = (int32_t *)malloc(((size_t)max_lb + 1) * sizeof(int32_t));
  sd->full = (uint8_t *)calloc((size_t)max_lb + 1, 1);
  sd->where = (int32_t *)malloc(2 * (size_t)n * sizeof(int32_t));
  if (!loc || !cnt || !sd->phys || !sd->full || !sd->where) {
    free(loc), free(cnt);
    return KVL_ENOMEM;
  }
  for (int32_t b = 0; b <= max_lb; b++) loc[b] = -1;
  for (int32_t i = 0; i < n; i++) loc[pos[i] / KVL_KV_BLOCK] = 0, cnt[pos[i] / KVL_KV_BLOCK]++;
  sd->n_local = 0;
  for (int32_t b = 0; b <= max_lb; b++)
    if (loc[b] == 0) {
      sd->phys[sd->n_local] = table[b];
      sd->full[sd->n_local] = cnt[b] >= KVL_KV_BLOCK; /* positions are distinct within a span */
      loc[b] = sd->n_local++;
    }
  for (int32_t i = 0; i < n; i++) {
    sd->where[i] = loc[pos[i] / KVL_KV_BLOCK];
    sd->where[n + i] = pos[i] % KVL_KV_BLOCK;
  }
  free(loc), free(cnt);
  return 0;
}

static void tr_side_free(struct tr_side *sd) {
  free(sd->phys), free(sd->full), free(sd->where);
}

/* Copy local blocks [0, n_local) between the host pool and the device (the staging, local
 * block j at j * bb; or a pool's device copy, dev_physical: at its physical block), runs of
 * consecutive physical blocks in one copy; skip (or NULL): leave out the blocks where
 * skip[j] is set. Copies to the host on stream st, to the device on S_.st. */
static void tr_copy_blocks(const struct tr_side *sd, char *host, char *dev, bool dev_physical, size_t bb,
                           bool to_device, const uint8_t *skip, cudaStream_t st) {
  for (int j = 0; j < sd->n_local;) {
    if (skip && skip[j]) {
      j++;
      continue;
    }
    int r = 1;
    while (j + r < sd->n_local && sd->phys[j + r] == sd->phys[j] + r && !(skip && skip[j + r])) r++;
    char *h = host + (size_t)sd->phys[j] * bb, *d = dev + (size_t)(dev_physical ? sd->phys[j] : j) * bb;
    if (to_device)
      to_dev(d, h, (size_t)r * bb);
    else
      to_host_on(h, d, (size_t)r * bb, st);
    j += r;
  }
}

static struct kvl__cu_kv_geom tr_geom(const struct kvl_kv_layout *l, const void *base) {
  struct kvl__cu_kv_geom g;
  g.n_kv_head = l->n_kv_head, g.head_dim = l->head_dim, g.bf16 = l->dtype == KVL_KV_BF16;
  g.block_bytes = (int64_t)kvl_kv_block_bytes(l);
  const char *k0 = (const char *)kvl_kv_k_ptr(l, (void *)base, 0, 0);
  const char *v0 = (const char *)kvl_kv_v_ptr(l, (void *)base, 0, 0);
  g.slab_bytes = (int64_t)(v0 - k0);
  return g;
}

static int cu_translate(kvl_backend_t *be, const struct kvl_tr_args *a, char *err, size_t errlen) {
  const struct kvl_kv_layout *ls = a->src_layout, *ld = a->dst_layout;
  const int n_src = ls->n_layer, n_dst = ld->n_layer, n = (int)a->n;
  const int64_t ws = (int64_t)ls->n_kv_head * ls->head_dim, wd = (int64_t)ld->n_kv_head * ld->head_dim;
  const int hs = ls->head_dim / 2, hd = ld->head_dim / 2;
  /* which source layers the K maps and the V maps read */
  int32_t *lay = (int32_t *)malloc(2 * (size_t)n_src * sizeof(int32_t));
  uint8_t *use = (uint8_t *)calloc((size_t)n_src, 1);
  struct tr_side src = {0, NULL, NULL, NULL}, dst = {0, NULL, NULL, NULL};
  int rc = 0;
  if (!lay || !use || tr_side_make(a->src_table, a->src_pos, a->n, &src) < 0 ||
      tr_side_make(a->dst_table, a->dst_pos, a->n, &dst) < 0) {
    rc = kvl_errf(err, errlen, KVL_ENOMEM, "translating %d positions on %s: out of host memory", n, be->name);
    free(lay), free(use);
    tr_side_free(&src), tr_side_free(&dst);
    return rc;
  }
  for (int i = 0; i < 2 * n_dst; i++)
    for (int j = 0; j < a->maps[i].nu; j++) use[a->maps[i].sources[j]] |= (uint8_t)(1u << (i & 1));
  int n_k = 0, n_v = 0;
  for (int L = 0; L < n_src; L++) {
    if (use[L] & 1) lay[n_k++] = L;
  }
  for (int L = 0; L < n_src; L++) {
    if (use[L] & 2) lay[n_src + n_v++] = L;
  }
  const struct kvl__cu_kv_geom gs = tr_geom(ls, a->src_base), gd = tr_geom(ld, a->dst_base);
  const int chunk = n < TR_CHUNK ? n : TR_CHUNK;

  pthread_mutex_lock(&S_.mu);
  struct tr_dev_maps *dm = NULL;
  bool maps_temp = false;
  if (a->pack && a->pack->impl && a->pack->owner == be) {
    dm = (struct tr_dev_maps *)a->pack->impl;
  } else {
    size_t bytes = 0;
    dm = tr_maps_make(a, ws, wd, &bytes);
    if (dm && a->pack && !a->pack->impl) {
      a->pack->impl = dm, a->pack->bytes = bytes, a->pack->owner = be, a->pack->release = release_tr_pack;
    } else {
      maps_temp = true;
    }
  }
  /* the pools' device copies where both have one: read and written in place */
  struct devpool *ps = devpool_get(a->src_base, ls, a->src_stamps, a->src_blocks);
  struct devpool *pd = ps ? devpool_get(a->dst_base, ld, a->dst_stamps, a->dst_blocks) : NULL;
  if (!pd || ps->base != a->src_base) ps = pd = NULL; /* (the second may have taken the first's place) */
  char *dsrc = ps ? NULL : (char *)kvl__cuda_alloc((size_t)src.n_local * (size_t)gs.block_bytes);
  char *ddst = pd ? NULL : (char *)kvl__cuda_alloc((size_t)dst.n_local * (size_t)gd.block_bytes);
  char *const vsrc = ps ? ps->mem : dsrc, *const vdst = pd ? pd->mem : ddst;
  int32_t *didx = (int32_t *)kvl__cuda_alloc((6 * (size_t)n + 2 * (size_t)n_src) * sizeof(int32_t));
  float *dfreq = (float *)kvl__cuda_alloc((size_t)(hs + hd) * sizeof(float));
  __nv_bfloat16 *xk = (__nv_bfloat16 *)kvl__cuda_alloc((size_t)chunk * (size_t)n_src * (size_t)ws * 2);
  __nv_bfloat16 *xv = (__nv_bfloat16 *)kvl__cuda_alloc((size_t)chunk * (size_t)n_src * (size_t)ws * 2);
  float *y = (float *)kvl__cuda_alloc((size_t)chunk * (size_t)wd * sizeof(float));
  if (!dm || !vsrc || !vdst || !didx || !dfreq || !xk || !xv || !y) {
    rc = kvl_errf(err, errlen, KVL_ENOMEM,
                  "translating %d positions on %s: the device arena is full (KVL_CUDA_MEM_MIB sets its size)", n,
                  be->name);
    goto out;
  }
  {
    /* positions: source (local block, slot, position), target the same, then the layer lists */
    int32_t *h = (int32_t *)malloc((6 * (size_t)n + 2 * (size_t)n_src) * sizeof(int32_t));
    KVL_ASSERT(h);
    memcpy(h, src.where, 2 * (size_t)n * sizeof(int32_t));
    memcpy(h + 2 * (size_t)n, a->src_pos, (size_t)n * sizeof(int32_t));
    memcpy(h + 3 * (size_t)n, dst.where, 2 * (size_t)n * sizeof(int32_t));
    for (int i = 0; i < n && pd; i++) /* in the copies: physical blocks */
      h[i] = src.phys[h[i]], h[3 * (size_t)n + i] = dst.phys[h[3 * (size_t)n + i]];
    memcpy(h + 5 * (size_t)n, a->dst_pos, (size_t)n * sizeof(int32_t));
    memcpy(h + 6 * (size_t)n, lay, 2 * (size_t)n_src * sizeof(int32_t));
    const bool h_free = to_dev(didx, h, (6 * (size_t)n + 2 * (size_t)n_src) * sizeof(int32_t));
    to_dev(dfreq, a->src_rope->inv_freq, (size_t)hs * sizeof(float));
    to_dev(dfreq + hs, a->dst_rope->inv_freq, (size_t)hd * sizeof(float));
    if (pd) {
      devpool_sync(ps, a->src_base, a->src_stamps, src.phys, (size_t)src.n_local, NULL);
      devpool_sync(pd, a->dst_base, a->dst_stamps, dst.phys, (size_t)dst.n_local, dst.full);
    } else {
      wb_fence(); /* the host pools are read */
      tr_copy_blocks(&src, (char *)a->src_base, dsrc, false, (size_t)gs.block_bytes, true, NULL, S_.st);
      tr_copy_blocks(&dst, (char *)a->dst_base, ddst, false, (size_t)gd.block_bytes, true, dst.full, S_.st);
    }
    if (!h_free || !pd) wait_stream(); /* h is freed next; the staged blocks are read */
    free(h);
  }
  {
    const int32_t *s_blk = didx, *s_slot = didx + n, *s_pos = didx + 2 * (size_t)n;
    const int32_t *d_blk = didx + 3 * (size_t)n, *d_slot = didx + 4 * (size_t)n, *d_pos = didx + 5 * (size_t)n;
    const int32_t *lay_k = didx + 6 * (size_t)n, *lay_v = lay_k + n_src;
    for (int c0 = 0; c0 < n; c0 += chunk) {
      const int nc = n - c0 < chunk ? n - c0 : chunk;
      kvl__cu_tr_gather(vsrc, &gs, s_blk + c0, s_slot + c0, s_pos + c0, dfreq, lay_k, n_k, n_src, true, nc, xk,
                        S_.st);
      kvl__cu_tr_gather(vsrc, &gs, s_blk + c0, s_slot + c0, s_pos + c0, dfreq, lay_v, n_v, n_src, false, nc, xv,
                        S_.st);
      for (int i = 0; i < 2 * n_dst; i++) {
        const struct kvl_tr_map_ref *m = &a->maps[i];
        const __nv_bfloat16 *x = (i & 1) ? xv : xk;
        float beta = 0.0f;
        if (dm->bias[i]) {
          kvl__cu_tr_fill(y, dm->bias[i], nc, (int)wd, S_.st);
          beta = 1.0f;
        }
        for (int j = 0; j < m->nu;) { /* one product per run of consecutive source layers */
          int len = 1;
          while (j + len < m->nu && m->sources[j + len] == m->sources[j] + len) len++;
          gemm_ex(false, wd, nc, (int64_t)len * ws, dm->w[i] + (size_t)j * (size_t)ws * (size_t)wd, wd,
                  x + (size_t)m->sources[j] * (size_t)ws, (int64_t)n_src * ws, beta, y, wd);
          beta = 1.0f;
          j += len;
        }
        kvl__cu_kv_store_rows(y, vdst, &gd, d_blk + c0, d_slot + c0, d_pos + c0, (i & 1) ? NULL : dfreq + hs, i,
                              nc, NULL, S_.st);
      }
    }
    KVL_CK(cudaGetLastError());
    /* the target to the host: on S_.wb where the arena is pinned, not waited for (every
     * block marked; the kernels, queued on S_.st, not waited for either: the next op on the
     * stream runs after them, and the device slices freed below go back to the arena in
     * stream order); otherwise now */
    static int async = -1;
    if (async < 0) async = !getenv("KVL_CUDA_WB_ASYNC") || strcmp(getenv("KVL_CUDA_WB_ASYNC"), "0") != 0;
    const bool wb = async && pd && in_hreg(a->dst_base, (size_t)pd->n_blocks * pd->bb) &&
                    (pd->wb || (pd->wb = (uint8_t *)calloc((size_t)pd->n_blocks, 1)));
    for (int j = 0; pd && j < dst.n_local; j++)
      if (wb_marked(pd, dst.phys[j])) { /* a block still coming back from before: one write-back at a time */
        wb_fence();
        break;
      }
    if (wb) {
      KVL_CK(cudaEventRecord(S_.wb_after, S_.st));
      KVL_CK(cudaStreamWaitEvent(S_.wb, S_.wb_after, 0));
      std::vector<uint8_t> part((size_t)dst.n_local);
      for (int j = 0; j < dst.n_local; j++) part[(size_t)j] = !dst.full[j];
      tr_copy_blocks(&dst, (char *)a->dst_base, vdst, true, (size_t)gd.block_bytes, false, dst.full, S_.wb);
      KVL_CK(cudaEventRecord(S_.wb_part, S_.wb));
      tr_copy_blocks(&dst, (char *)a->dst_base, vdst, true, (size_t)gd.block_bytes, false, part.data(), S_.wb);
      for (int j = 0; j < dst.n_local; j++) pd->wb[dst.phys[j]] = dst.full[j] ? WB_WHOLE : WB_PART;
      wb_any = true;
    } else {
      tr_copy_blocks(&dst, (char *)a->dst_base, vdst, pd != NULL, (size_t)gd.block_bytes, false, NULL, S_.st);
      wait_stream();
    }
    for (int j = 0; j < dst.n_local && pd; j++) pd->stamp[dst.phys[j]] = a->dst_stamps[dst.phys[j]]; /* current */
  }
out:
  kvl__cuda_free(dsrc);
  kvl__cuda_free(ddst);
  kvl__cuda_free(didx);
  kvl__cuda_free(dfreq);
  kvl__cuda_free(xk);
  kvl__cuda_free(xv);
  kvl__cuda_free(y);
  if (maps_temp) tr_maps_free(dm);
  pthread_mutex_unlock(&S_.mu);
  free(lay), free(use);
  tr_side_free(&src), tr_side_free(&dst);
  return rc;
}

/* a pool's arenas pinned (KVL_CUDA_PIN_POOLS=0: never) */
static bool cu_host_register(kvl_backend_t *be, void *p, size_t bytes) {
  (void)be;
  static int on = -1;
  if (on < 0) on = !getenv("KVL_CUDA_PIN_POOLS") || strcmp(getenv("KVL_CUDA_PIN_POOLS"), "0") != 0;
  if (!on) return false;
  pthread_mutex_lock(&S_.mu);
  bool ok = n_hreg < N_HREG;
  const cudaError_t e = ok ? cudaHostRegister(p, bytes, cudaHostRegisterDefault) : cudaSuccess;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    fprintf(stderr, "kvlingo: CUDA would not pin %zu MiB of host memory (%s): its copies take the pageable path\n",
            bytes >> 20, cudaGetErrorString(e));
    ok = false;
  }
  if (ok) HR_[n_hreg].p = (char *)p, HR_[n_hreg].n = bytes, n_hreg++;
  pthread_mutex_unlock(&S_.mu);
  return ok;
}

static void cu_host_unregister(kvl_backend_t *be, void *p) {
  (void)be;
  pthread_mutex_lock(&S_.mu);
  for (int i = 0; i < n_hreg; i++)
    if (HR_[i].p == (char *)p) {
      wait_stream(); /* no copy queued from or to it may outlive the registration */
      wb_fence();
      KVL_CK(cudaHostUnregister(p));
      HR_[i] = HR_[--n_hreg];
      break;
    }
  pthread_mutex_unlock(&S_.mu);
}

static const struct kvl_backend_ops cuda_ops = {cu_supports, cu_matmul,    cu_rmsnorm,   cu_rope, cu_swiglu,
                                                cu_embed,    cu_attention, cu_translate, cu_add,  cu_begin,
                                                cu_fetch,    cu_end,       cu_traffic,   cu_kv_put,
                                                cu_logits_top, cu_host_register, cu_host_unregister,
                                                cu_host_sync, cu_sync};

static kvl_backend_t be_cuda;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static char init_err[512];
static char be_name[512];

static void init(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    snprintf(init_err, sizeof(init_err), "no CUDA device (%s)",
             e != cudaSuccess ? cudaGetErrorString(e) : "the driver sees none");
    return;
  }
  const char *dev = getenv("KVL_CUDA_DEVICE");
  S_.device = dev ? atoi(dev) : 0;
  if (S_.device < 0 || S_.device >= n) {
    snprintf(init_err, sizeof(init_err), "KVL_CUDA_DEVICE=%d, but there are %d devices", S_.device, n);
    return;
  }
  if ((e = cudaSetDevice(S_.device)) != cudaSuccess) {
    snprintf(init_err, sizeof(init_err), "cudaSetDevice(%d): %s", S_.device, cudaGetErrorString(e));
    return;
  }
  pthread_mutex_init(&A.mu, NULL);
  cudaDeviceProp prop;
  KVL_CK(cudaGetDeviceProperties(&prop, S_.device));
  if (prop.major < 8) {
    snprintf(init_err, sizeof(init_err), "%.256s (compute %d.%d): bf16 GEMMs need compute 8.0 or newer", prop.name,
             prop.major, prop.minor);
    return;
  }
  S_.n_sm = prop.multiProcessorCount;
  size_t free_b = 0, total_b = 0;
  KVL_CK(cudaMemGetInfo(&free_b, &total_b));
  const char *mib = getenv("KVL_CUDA_MEM_MIB");
  size_t want = mib ? (size_t)strtoull(mib, NULL, 10) << 20 : free_b / 10 * 8;
  if (want == 0 || want > free_b) {
    snprintf(init_err, sizeof(init_err), "cannot reserve %zu MiB (%zu MiB free)", want >> 20, free_b >> 20);
    return;
  }
  if ((e = cudaMalloc((void **)&A.base, want)) != cudaSuccess) {
    snprintf(init_err, sizeof(init_err), "cudaMalloc(%zu MiB): %s", want >> 20, cudaGetErrorString(e));
    return;
  }
  A.size = want;
  A.free_[0].off = 0, A.free_[0].len = want;
  A.n_free = 1;
  KVL_CK(cudaStreamCreateWithFlags(&S_.st, cudaStreamNonBlocking));
  KVL_CK(cudaStreamCreateWithFlags(&S_.wb, cudaStreamNonBlocking));
  KVL_CK(cudaEventCreateWithFlags(&S_.wb_after, cudaEventDisableTiming));
  KVL_CK(cudaEventCreateWithFlags(&S_.wb_part, cudaEventDisableTiming));
  KVL_CKB(cublasLtCreate(&S_.lt));
  S_.ws_bytes = (size_t)32 << 20;
  S_.workspace = dalloc(S_.ws_bytes);
  const char *pin = getenv("KVL_CUDA_PINNED_MIB");
  S_.pin_bytes = (pin ? (size_t)strtoull(pin, NULL, 10) : 16) << 20;
  if (S_.pin_bytes && cudaMallocHost((void **)&S_.pin, S_.pin_bytes) != cudaSuccess) {
    fprintf(stderr, "kvlingo: no pinned staging (%zu MiB): uploads come from pageable memory\n", S_.pin_bytes >> 20);
    (void)cudaGetLastError();
    S_.pin = NULL, S_.pin_bytes = 0;
  }
  KP_.cap = (size_t)KV_PEND_MIB << 20;
  if (cudaMallocHost((void **)&KP_.buf, KP_.cap) != cudaSuccess) { /* the rows then stored per layer */
    (void)cudaGetLastError();
    KP_.buf = NULL, KP_.cap = 0;
  } else { /* pinned: its copies count as such (in_hreg) */
    HR_[n_hreg].p = KP_.buf, HR_[n_hreg].n = KP_.cap, n_hreg++;
  }
  pthread_mutex_init(&S_.mu, NULL);
  snprintf(be_name, sizeof(be_name), "cuda:%d (%.256s, compute %d.%d, %zu MiB arena)", S_.device, prop.name, prop.major,
           prop.minor, want >> 20);
  be_cuda.name = be_name;
  be_cuda.ops = &cuda_ops;
  kvl__kv_pool_gone_hook(cu_pool_gone);
}

extern "C" kvl_backend_t *KVL_CU_ENTRY(kvl_backend_cuda)(char *why, size_t whylen) {
  pthread_once(&once, init);
  if (!be_cuda.ops) {
    if (why && whylen) snprintf(why, whylen, "%.*s", (int)(whylen - 1), init_err);
    return NULL;
  }
  return &be_cuda;
}


KVL_CU_END
