/* gguf_write.c — the GGUF writer: builds a version-3 file in memory, writes it at once.
 *
 * Used for the synthetic fixture models and the fuzz seed corpus; it writes exactly what
 * the reader accepts (tensor data aligned to general.alignment, default 32).
 */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_quant.h"

struct wkv {
  char *key;
  uint32_t type, elem;
  uint8_t *bytes;  /* the value as serialised after the type field */
  size_t len;
};

struct wtensor {
  char *name;
  uint32_t type, n_dims;
  uint64_t ne[KVL_GGUF_MAX_DIMS];
  uint8_t *data;
  size_t nbytes;
};

struct kvl_gguf_writer {
  struct wkv *kv;
  size_t n_kv, cap_kv;
  struct wtensor *t;
  size_t n_t, cap_t;
  uint32_t alignment;
};

kvl_gguf_writer_t *kvl_gguf_writer_new(void) {
  kvl_gguf_writer_t *w = calloc(1, sizeof(*w));
  if (w) w->alignment = KVL_GGUF_DEFAULT_ALIGNMENT;
  return w;
}

void kvl_gguf_writer_free(kvl_gguf_writer_t *w) {
  if (!w) return;
  for (size_t i = 0; i < w->n_kv; i++) { free(w->kv[i].key); free(w->kv[i].bytes); }
  for (size_t i = 0; i < w->n_t; i++) { free(w->t[i].name); free(w->t[i].data); }
  free(w->kv);
  free(w->t);
  free(w);
}

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return 0;
  size_t nc = *cap ? *cap * 2 : 16;
  void *p = realloc(*arr, nc * elem);
  if (!p) return KVL_ENOMEM;
  *arr = p;
  *cap = nc;
  return 0;
}

/* Append a kv whose serialised value (after the type) is `bytes`, taking ownership. */
static int add_kv(kvl_gguf_writer_t *w, const char *key, uint32_t type, uint8_t *bytes, size_t len) {
  for (size_t i = 0; i < w->n_kv; i++)
    if (!strcmp(w->kv[i].key, key)) { free(bytes); return KVL_EEXIST; }
  if (grow((void **)&w->kv, &w->cap_kv, w->n_kv, sizeof(*w->kv)) < 0) { free(bytes); return KVL_ENOMEM; }
  char *k = strdup(key);
  if (!k) { free(bytes); return KVL_ENOMEM; }
  w->kv[w->n_kv++] = (struct wkv){k, type, 0, bytes, len};
  return 0;
}

static size_t vsize(uint32_t t) {
  switch (t) {
  case KVL_GGUF_U8: case KVL_GGUF_I8: case KVL_GGUF_BOOL: return 1;
  case KVL_GGUF_U16: case KVL_GGUF_I16: return 2;
  case KVL_GGUF_U32: case KVL_GGUF_I32: case KVL_GGUF_F32: return 4;
  case KVL_GGUF_U64: case KVL_GGUF_I64: case KVL_GGUF_F64: return 8;
  default: return 0;
  }
}

int kvl_gguf_set_scalar(kvl_gguf_writer_t *w, const char *key, enum kvl_gguf_vtype t, const void *v) {
  size_t sz = vsize(t);
  if (!sz) return KVL_EINVAL;
  uint8_t *b = malloc(sz);
  if (!b) return KVL_ENOMEM;
  memcpy(b, v, sz);
  int rc = add_kv(w, key, t, b, sz);
  if (rc == 0 && !strcmp(key, "general.alignment") && t == KVL_GGUF_U32) {
    uint32_t a;
    memcpy(&a, v, 4);
    if (a && !(a & (a - 1))) w->alignment = a;
  }
  return rc;
}

int kvl_gguf_set_u32(kvl_gguf_writer_t *w, const char *k, uint32_t v) { return kvl_gguf_set_scalar(w, k, KVL_GGUF_U32, &v); }
int kvl_gguf_set_i32(kvl_gguf_writer_t *w, const char *k, int32_t v) { return kvl_gguf_set_scalar(w, k, KVL_GGUF_I32, &v); }
int kvl_gguf_set_u64(kvl_gguf_writer_t *w, const char *k, uint64_t v) { return kvl_gguf_set_scalar(w, k, KVL_GGUF_U64, &v); }
int kvl_gguf_set_f32(kvl_gguf_writer_t *w, const char *k, float v) { return kvl_gguf_set_scalar(w, k, KVL_GGUF_F32, &v); }
int kvl_gguf_set_f64(kvl_gguf_writer_t *w, const char *k, double v) { return kvl_gguf_set_scalar(w, k, KVL_GGUF_F64, &v); }
int kvl_gguf_set_bool(kvl_gguf_writer_t *w, const char *k, bool v) {
  uint8_t b = v ? 1 : 0;
  return kvl_gguf_set_scalar(w, k, KVL_GGUF_BOOL, &b);
}

int kvl_gguf_set_str(kvl_gguf_writer_t *w, const char *key, const char *v) {
  uint64_t n = strlen(v);
  uint8_t *b = malloc(8 + n);
  if (!b) return KVL_ENOMEM;
  memcpy(b, &n, 8);
  memcpy(b + 8, v, n);
  return add_kv(w, key, KVL_GGUF_STRING, b, 8 + n);
}

int kvl_gguf_set_arr(kvl_gguf_writer_t *w, const char *key, enum kvl_gguf_vtype elem,
                     const void *data, uint64_t n) {
  size_t sz = vsize(elem);
  if (!sz) return KVL_EINVAL;
  if (n > (SIZE_MAX - 12) / sz) return KVL_EOVERFLOW;
  size_t len = 12 + (size_t)n * sz;
  uint8_t *b = malloc(len);
  if (!b) return KVL_ENOMEM;
  uint32_t e = elem;
  memcpy(b, &e, 4);
  memcpy(b + 4, &n, 8);
  if (n) memcpy(b + 12, data, (size_t)n * sz);
  return add_kv(w, key, KVL_GGUF_ARRAY, b, len);
}

int kvl_gguf_set_arr_str(kvl_gguf_writer_t *w, const char *key, const char *const *v, uint64_t n) {
  size_t len = 12;
  for (uint64_t i = 0; i < n; i++) len += 8 + strlen(v[i]);
  uint8_t *b = malloc(len), *p = b;
  if (!b) return KVL_ENOMEM;
  uint32_t e = KVL_GGUF_STRING;
  memcpy(p, &e, 4);
  memcpy(p + 4, &n, 8);
  p += 12;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t sl = strlen(v[i]);
    memcpy(p, &sl, 8);
    memcpy(p + 8, v[i], sl);
    p += 8 + sl;
  }
  return add_kv(w, key, KVL_GGUF_ARRAY, b, len);
}

int kvl_gguf_add_tensor(kvl_gguf_writer_t *w, const char *name, uint32_t type,
                        uint32_t n_dims, const uint64_t *ne, const void *data, size_t nbytes) {
  if (n_dims < 1 || n_dims > KVL_GGUF_MAX_DIMS) return KVL_EINVAL;
  uint64_t rows = 1;
  for (uint32_t d = 1; d < n_dims; d++) rows *= ne[d];
  size_t row = kvl_row_size(type, ne[0]);
  if (!row || rows > SIZE_MAX / row || row * rows != nbytes) return KVL_EMISMATCH;
  for (size_t i = 0; i < w->n_t; i++)
    if (!strcmp(w->t[i].name, name)) return KVL_EEXIST;
  if (grow((void **)&w->t, &w->cap_t, w->n_t, sizeof(*w->t)) < 0) return KVL_ENOMEM;
  struct wtensor t = {.name = strdup(name), .type = type, .n_dims = n_dims, .nbytes = nbytes};
  t.data = malloc(nbytes ? nbytes : 1);
  if (!t.name || !t.data) { free(t.name); free(t.data); return KVL_ENOMEM; }
  for (int d = 0; d < KVL_GGUF_MAX_DIMS; d++) t.ne[d] = (uint32_t)d < n_dims ? ne[d] : 1;
  memcpy(t.data, data, nbytes);
  w->t[w->n_t++] = t;
  return 0;
}

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

int kvl_gguf_writer_to_mem(kvl_gguf_writer_t *w, void **out, size_t *out_len) {
  /* header size */
  size_t hdr = 4 + 4 + 8 + 8;
  for (size_t i = 0; i < w->n_kv; i++) hdr += 8 + strlen(w->kv[i].key) + 4 + w->kv[i].len;
  for (size_t i = 0; i < w->n_t; i++) hdr += 8 + strlen(w->t[i].name) + 4 + 8 * w->t[i].n_dims + 4 + 8;
  size_t data_off = align_up(hdr, w->alignment), total = data_off;
  uint64_t *offs = calloc(w->n_t ? w->n_t : 1, sizeof(*offs));
  if (!offs) return KVL_ENOMEM;
  for (size_t i = 0; i < w->n_t; i++) {
    offs[i] = total - data_off;
    total = align_up(total + w->t[i].nbytes, w->alignment);
  }
  uint8_t *buf = calloc(1, total ? total : 1), *p = buf;
  if (!buf) { free(offs); return KVL_ENOMEM; }
#define PUT(src, n) (memcpy(p, (src), (n)), p += (n))
  uint32_t version = 3;
  uint64_t nt = w->n_t, nkv = w->n_kv;
  PUT("GGUF", 4);
  PUT(&version, 4);
  PUT(&nt, 8);
  PUT(&nkv, 8);
  for (size_t i = 0; i < w->n_kv; i++) {
    uint64_t kl = strlen(w->kv[i].key);
    PUT(&kl, 8);
    PUT(w->kv[i].key, kl);
    PUT(&w->kv[i].type, 4);
    PUT(w->kv[i].bytes, w->kv[i].len);
  }
  for (size_t i = 0; i < w->n_t; i++) {
    uint64_t nl = strlen(w->t[i].name);
    PUT(&nl, 8);
    PUT(w->t[i].name, nl);
    PUT(&w->t[i].n_dims, 4);
    PUT(w->t[i].ne, 8 * w->t[i].n_dims);
    PUT(&w->t[i].type, 4);
    PUT(&offs[i], 8);
  }
#undef PUT
  KVL_ASSERT((size_t)(p - buf) == hdr);
  for (size_t i = 0; i < w->n_t; i++) memcpy(buf + data_off + offs[i], w->t[i].data, w->t[i].nbytes);
  free(offs);
  *out = buf;
  *out_len = total;
  return 0;
}

int kvl_gguf_writer_to_file(kvl_gguf_writer_t *w, const char *path) {
  void *buf;
  size_t len;
  int rc = kvl_gguf_writer_to_mem(w, &buf, &len);
  if (rc < 0) return rc;
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 16);
  if (!tmp) { free(buf); return KVL_ENOMEM; }
  snprintf(tmp, pl + 16, "%s.tmp%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) { rc = -errno; goto out; }
  for (size_t off = 0; off < len;) {
    ssize_t n = write(fd, (uint8_t *)buf + off, len - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = -errno;
      close(fd);
      unlink(tmp);
      goto out;
    }
    off += (size_t)n;
  }
  if (close(fd) < 0 || rename(tmp, path) < 0) { rc = -errno; unlink(tmp); }
out:
  free(tmp);
  free(buf);
  return rc;
}
