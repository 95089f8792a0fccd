/* backend.c — the public op entry points: argument checks, then the backend's table. */
#include <pthread.h>
#include <stdatomic.h>

#include "backend-impl.h"
#include "kvl_error.h"

const char *kvl_backend_name(const kvl_backend_t *be) { return be->name; }

const char *kvl_backend_attention(const kvl_backend_t *be, bool kv_bf16) {
  if (!be || !be->simd) return NULL;
  return kv_bf16 && be->simd == &kvl__simd_avx512 && kvl__attn_bf16() ? "bf16" : "fp32";
}

void kvl_wpack_release(struct kvl_wpack *p) {
  if (p && p->impl && p->release) p->release(p);
}

static _Atomic long long wpack_bytes;

void kvl__wpack_count(long long delta) { atomic_fetch_add(&wpack_bytes, delta); }

size_t kvl_wpack_total_bytes(void) { return (size_t)atomic_load(&wpack_bytes); }

void kvl_backend_prepare(kvl_backend_t *be, const struct kvl_weight *w) {
  uint32_t type;
  size_t rb;
  if (be && be->decode_copies) kvl__decode_copy(w, &type, &rb);
}

bool kvl_backend_supports(const kvl_backend_t *be, enum kvl_op op, uint32_t wtype) {
  return be->ops->supports(be, op, wtype);
}

void kvl_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens) {
  KVL_ASSERT(w->cols > 0 && w->rows > 0 && n_tokens >= 0);
  be->ops->matmul(be, w, x, y, n_tokens);
}

void kvl_rmsnorm(kvl_backend_t *be, const float *x, const float *w, float *y, int n_tokens, int n, float eps) {
  be->ops->rmsnorm(be, x, w, y, n_tokens, n, eps);
}

void kvl_rope(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens,
              int n_heads, bool inverse) {
  be->ops->rope(be, r, x, pos, n_tokens, n_heads, inverse);
}

void kvl_swiglu(kvl_backend_t *be, const float *g, const float *u, float *y, int64_t n) {
  be->ops->swiglu(be, g, u, y, n);
}

void kvl_embed(kvl_backend_t *be, const struct kvl_weight *t, const int32_t *ids, float *y, int n_tokens) {
  be->ops->embed(be, t, ids, y, n_tokens);
}

void kvl_attention(kvl_backend_t *be, const struct kvl_attn_args *a) {
  KVL_ASSERT(a->n_head > 0 && a->kv && a->n_head % a->kv->n_kv_head == 0);
  be->ops->attention(be, a);
}

void kvl_add(kvl_backend_t *be, float *h, const float *x, int64_t n) {
  if (be->ops->add) {
    be->ops->add(be, h, x, n);
    return;
  }
  for (int64_t i = 0; i < n; i++) h[i] += x[i];
}

static struct {
  pthread_mutex_t mu;
  void (*fn[4])(const void *base);
  int n;
} gone_ = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};

void kvl__kv_pool_gone_hook(void (*fn)(const void *base)) {
  pthread_mutex_lock(&gone_.mu);
  KVL_ASSERT(gone_.n < 4);
  gone_.fn[gone_.n++] = fn;
  pthread_mutex_unlock(&gone_.mu);
}

void kvl_kv_pool_gone(const void *base) {
  pthread_mutex_lock(&gone_.mu);
  for (int i = 0; i < gone_.n; i++) gone_.fn[i](base);
  pthread_mutex_unlock(&gone_.mu);
}

void kvl_kv_put(kvl_backend_t *be, const struct kvl_attn_args *a, const float *k, const float *v) {
  if (be->ops->kv_put) {
    be->ops->kv_put(be, a, k, v);
    return;
  }
  kvl_kv_store(a->kv, (void *)a->kv_base, a->layer, a->n_tokens, k, v, a->pos, a->seq, a->block_tables);
  kvl_kv_stamp_rows(a); /* a device's copy of these blocks (another backend's) is old now */
}

void kvl_backend_begin(kvl_backend_t *be) {
  if (be->ops->begin) be->ops->begin(be);
}

void kvl_backend_fetch(kvl_backend_t *be, const void *p, size_t bytes) {
  if (be->ops->fetch) be->ops->fetch(be, p, bytes);
}

void kvl_backend_end(kvl_backend_t *be, const void *keep, size_t bytes) {
  if (be->ops->end) be->ops->end(be, keep, bytes);
}

bool kvl_backend_traffic(const kvl_backend_t *be, struct kvl_backend_traffic *t) {
  *t = (struct kvl_backend_traffic){0};
  return be->ops->traffic && be->ops->traffic(be, t);
}

bool kvl_logits_top(kvl_backend_t *be, const float *logits, int n_rows, int n_vocab, const int8_t *full,
                    const float *temperature, const double *u, struct kvl_logit_top *top, float *rows) {
  return be->ops->logits_top && n_rows > 0 &&
         be->ops->logits_top(be, logits, n_rows, n_vocab, full, temperature, u, top, rows);
}

bool kvl_backend_host_register(kvl_backend_t *be, void *p, size_t bytes) {
  return be && be->ops->host_register && p && bytes && be->ops->host_register(be, p, bytes);
}

void kvl_backend_host_unregister(kvl_backend_t *be, void *p) {
  if (be && be->ops->host_unregister && p) be->ops->host_unregister(be, p);
}

void kvl_backend_host_sync(kvl_backend_t *be, const void *p, size_t bytes) {
  if (be && be->ops->host_sync) be->ops->host_sync(be, p, bytes);
}

void kvl_backend_sync(kvl_backend_t *be) {
  if (be && be->ops->sync) be->ops->sync(be);
}

bool kvl_backend_can_translate(const kvl_backend_t *be) { return be && be->ops->translate; }

int kvl_backend_translate(kvl_backend_t *be, const struct kvl_tr_args *a, char *err, size_t errlen) {
  if (!kvl_backend_can_translate(be))
    return kvl_errf(err, errlen, KVL_ENOTSUP, "backend %s does not translate on its own", be ? be->name : "(none)");
  if (a->n <= 0) return 0;
  return be->ops->translate(be, a, err, errlen);
}
