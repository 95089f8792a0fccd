/* gguf.c — the validating GGUF reader.
 *
 * Parsing happens once, at open: every length and count is checked against the bytes
 * that remain before it is used to allocate or to index, so no later accessor can read
 * out of bounds. Strings the rest of kvlingo uses by name (keys, tensor names, scalar
 * string values) are copied NUL-terminated into one arena; big string arrays (the
 * vocabulary) stay in the mapping and are reached through an offset table.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_kernels.h"
#include "kvl_quant.h"

#define GGUF_MAGIC "GGUF"
#define MAX_STRING_LEN (1u << 30)   /* 1 GiB: longer is corrupt, not a real key/value */
#define MAX_NAME_LEN 4096           /* keys and tensor names */

struct kv {
  const char *key;        /* arena */
  uint32_t type;          /* enum kvl_gguf_vtype */
  uint32_t elem;          /* element type when type == ARRAY */
  uint64_t n;             /* array count (1 for scalars) */
  const uint8_t *raw;     /* scalar value or first array element, in the mapping */
  const char *str;        /* scalar string: arena copy */
  uint64_t *str_off;      /* string array: offset (from raw) of each element's length */
};

struct kvl_gguf {
  const uint8_t *base;    /* the file's bytes */
  size_t size;
  bool mapped;            /* base came from mmap (unmap map_size bytes at free) */
  size_t map_size;
  uint32_t version;
  uint32_t alignment;
  size_t data_off;        /* start of the tensor data section */
  int64_t n_kv, n_tensors;
  struct kv *kv;
  struct kvl_gguf_tensor *tensors;
  char *arena;            /* NUL-terminated copies */
  size_t arena_len, arena_cap;
  int64_t *kv_idx;        /* open-addressing hash of keys -> kv index (-1 empty) */
  int64_t *t_idx;         /* same for tensor names */
  size_t kv_mask, t_mask; /* table size - 1 (a power of two >= 2n) */
};

/* FNV-1a: names are short; a hostile file with many names stays O(n), not O(n^2). */
static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

static int64_t *index_new(int64_t n, size_t *mask) {
  size_t cap = 8;
  while (cap < (size_t)n * 2) cap *= 2;
  int64_t *t = malloc(cap * sizeof(*t));
  if (t) memset(t, 0xff, cap * sizeof(*t));
  *mask = cap - 1;
  return t;
}

/* Insert entry i under name (names(i) gives an entry's name); false if already there. */
static bool index_put(int64_t *tab, size_t mask, const char *name, int64_t i,
                      const char *(*name_of)(const void *, int64_t), const void *ctx) {
  for (size_t h = hash_str(name) & mask;; h = (h + 1) & mask) {
    if (tab[h] < 0) { tab[h] = i; return true; }
    if (!strcmp(name_of(ctx, tab[h]), name)) return false;
  }
}

static int64_t index_get(const int64_t *tab, size_t mask, const char *name,
                         const char *(*name_of)(const void *, int64_t), const void *ctx) {
  if (!tab) return -1;
  for (size_t h = hash_str(name) & mask;; h = (h + 1) & mask) {
    if (tab[h] < 0) return -1;
    if (!strcmp(name_of(ctx, tab[h]), name)) return tab[h];
  }
}

static const char *kv_name(const void *g, int64_t i) { return ((const struct kvl_gguf *)g)->kv[i].key; }
static const char *t_name(const void *g, int64_t i) { return ((const struct kvl_gguf *)g)->tensors[i].name; }

/* Parsing cursor with the error sink. */
struct cur {
  const uint8_t *p;
  size_t pos, len;
  char *err;
  size_t errlen;
};

static int fail(struct cur *c, int code, const char *fmt, ...) {
  if (c->err && c->errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}

static size_t remaining(const struct cur *c) { return c->len - c->pos; }

static int rd(struct cur *c, void *dst, size_t n, const char *what) {
  if (remaining(c) < n)
    return fail(c, KVL_ETRUNC, "file truncated reading %s at offset %zu (needs %zu bytes, %zu left)",
                what, c->pos, n, remaining(c));
  memcpy(dst, c->p + c->pos, n);
  c->pos += n;
  return 0;
}

static int rd_u32(struct cur *c, uint32_t *v, const char *what) { return rd(c, v, 4, what); }
static int rd_u64(struct cur *c, uint64_t *v, const char *what) { return rd(c, v, 8, what); }

static size_t vtype_size(uint32_t t) {
  switch (t) {
  case KVL_GGUF_U8: case KVL_GGUF_I8: case KVL_GGUF_BOOL: return 1;
  case KVL_GGUF_U16: case KVL_GGUF_I16: return 2;
  case KVL_GGUF_U32: case KVL_GGUF_I32: case KVL_GGUF_F32: return 4;
  case KVL_GGUF_U64: case KVL_GGUF_I64: case KVL_GGUF_F64: return 8;
  default: return 0; /* string, array, unknown */
  }
}

const char *kvl_gguf_vtype_name(uint32_t t) {
  static const char *names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                "string", "array", "u64", "i64", "f64"};
  return t < KVL_GGUF_VTYPE_COUNT_ ? names[t] : "unknown";
}

/* Copy n bytes into the arena, NUL-terminated; returns the copy or NULL (no memory). */
static const char *arena_put(struct kvl_gguf *g, const void *s, size_t n) {
  if (g->arena_len + n + 1 > g->arena_cap) return NULL;
  char *d = g->arena + g->arena_len;
  memcpy(d, s, n);
  d[n] = '\0';
  g->arena_len += n + 1;
  return d;
}

/* Read a GGUF string header; returns its bytes (in the mapping) through *s, *n. */
static int rd_str(struct cur *c, const uint8_t **s, uint64_t *n, size_t max, const char *what) {
  int rc = rd_u64(c, n, what);
  if (rc) return rc;
  if (*n > max)
    return fail(c, KVL_EFORMAT, "%s at offset %zu has absurd length %llu", what, c->pos - 8,
                (unsigned long long)*n);
  if (*n > remaining(c))
    return fail(c, KVL_ETRUNC, "file truncated inside %s at offset %zu (length %llu, %zu bytes left)",
                what, c->pos, (unsigned long long)*n, remaining(c));
  *s = c->p + c->pos;
  c->pos += (size_t)*n;
  return 0;
}

/* First pass over one metadata value: validates and records it. The arena was sized
 * from the file length, so arena_put cannot run out (checked anyway). */
static int parse_value(struct cur *c, struct kvl_gguf *g, struct kv *kv) {
  int rc;
  if (kv->type == KVL_GGUF_STRING) {
    const uint8_t *s;
    uint64_t n;
    if ((rc = rd_str(c, &s, &n, MAX_STRING_LEN, "string value"))) return rc;
    kv->raw = s;
    kv->n = 1;
    if (!(kv->str = arena_put(g, s, (size_t)n))) return fail(c, KVL_ENOMEM, "out of memory");
    return 0;
  }
  if (kv->type != KVL_GGUF_ARRAY) {
    size_t sz = vtype_size(kv->type);
    if (!sz) return fail(c, KVL_EFORMAT, "key '%s' has unknown value type %u", kv->key, kv->type);
    if (remaining(c) < sz) return fail(c, KVL_ETRUNC, "file truncated in the value of '%s'", kv->key);
    kv->raw = c->p + c->pos;
    kv->n = 1;
    c->pos += sz;
    return 0;
  }
  /* array */
  if ((rc = rd_u32(c, &kv->elem, "array element type"))) return rc;
  if ((rc = rd_u64(c, &kv->n, "array length"))) return rc;
  if (kv->elem == KVL_GGUF_ARRAY)
    return fail(c, KVL_ENOTSUP, "key '%s' is an array of arrays (not supported)", kv->key);
  if (kv->elem == KVL_GGUF_STRING) {
    /* each element needs at least its 8-byte length */
    if (kv->n > remaining(c) / 8)
      return fail(c, KVL_EFORMAT, "key '%s': string array of %llu elements cannot fit in the %zu bytes left",
                  kv->key, (unsigned long long)kv->n, remaining(c));
    kv->raw = c->p + c->pos;
    kv->str_off = malloc(sizeof(*kv->str_off) * (size_t)(kv->n ? kv->n : 1));
    if (!kv->str_off) return fail(c, KVL_ENOMEM, "out of memory for string array '%s'", kv->key);
    for (uint64_t i = 0; i < kv->n; i++) {
      const uint8_t *s;
      uint64_t n;
      kv->str_off[i] = (uint64_t)(c->p + c->pos - kv->raw);
      if ((rc = rd_str(c, &s, &n, MAX_STRING_LEN, "string array element"))) return rc;
    }
    return 0;
  }
  size_t sz = vtype_size(kv->elem);
  if (!sz) return fail(c, KVL_EFORMAT, "key '%s' is an array of unknown type %u", kv->key, kv->elem);
  if (kv->n > remaining(c) / sz)
    return fail(c, KVL_ETRUNC, "key '%s': array of %llu %s elements runs past the end of the file",
                kv->key, (unsigned long long)kv->n, kvl_gguf_vtype_name(kv->elem));
  kv->raw = c->p + c->pos;
  c->pos += (size_t)kv->n * sz;
  return 0;
}

static int parse(struct kvl_gguf *g, char *err, size_t errlen) {
  struct cur c = {g->base, 0, g->size, err, errlen};
  int rc;
  char magic[4];
  if ((rc = rd(&c, magic, 4, "magic"))) return rc;
  if (memcmp(magic, GGUF_MAGIC, 4))
    return fail(&c, KVL_EFORMAT, "not a GGUF file (magic %02x %02x %02x %02x)", (uint8_t)magic[0],
                (uint8_t)magic[1], (uint8_t)magic[2], (uint8_t)magic[3]);
  if ((rc = rd_u32(&c, &g->version, "version"))) return rc;
  if (g->version != 2 && g->version != 3)
    return fail(&c, KVL_ENOTSUP, "unsupported GGUF version %u (2 and 3 are supported)", g->version);
  uint64_t n_tensors = 0, n_kv = 0;
  if ((rc = rd_u64(&c, &n_tensors, "tensor count"))) return rc;
  if ((rc = rd_u64(&c, &n_kv, "metadata count"))) return rc;
  /* minimal encodings: a kv is >= 8 (key len) + 4 (type) + 1 bytes; a tensor info is
   * >= 8 + 4 + 8 + 4 + 8 bytes. More than that cannot fit in the file. */
  if (n_kv > remaining(&c) / 13)
    return fail(&c, KVL_EFORMAT, "absurd metadata count %llu for a %zu-byte file", (unsigned long long)n_kv, g->size);
  if (n_tensors > remaining(&c) / 32)
    return fail(&c, KVL_EFORMAT, "absurd tensor count %llu for a %zu-byte file", (unsigned long long)n_tensors, g->size);
  g->n_kv = (int64_t)n_kv;
  g->n_tensors = (int64_t)n_tensors;

  /* Everything we copy is a substring of the file plus one NUL per string, and there
   * are fewer strings than bytes: 2x the file (capped by what can be copied) suffices. */
  g->arena_cap = g->size + (size_t)n_kv * 2 + (size_t)n_tensors + 16;
  g->arena = malloc(g->arena_cap);
  g->kv = calloc(n_kv ? n_kv : 1, sizeof(*g->kv));
  g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(*g->tensors));
  g->kv_idx = index_new(g->n_kv, &g->kv_mask);
  g->t_idx = index_new(g->n_tensors, &g->t_mask);
  if (!g->arena || !g->kv || !g->tensors || !g->kv_idx || !g->t_idx)
    return fail(&c, KVL_ENOMEM, "out of memory");

  g->alignment = KVL_GGUF_DEFAULT_ALIGNMENT;
  for (int64_t i = 0; i < g->n_kv; i++) {
    struct kv *kv = &g->kv[i];
    const uint8_t *s;
    uint64_t n;
    if ((rc = rd_str(&c, &s, &n, MAX_NAME_LEN, "metadata key"))) return rc;
    if (!(kv->key = arena_put(g, s, (size_t)n))) return fail(&c, KVL_ENOMEM, "out of memory");
    if (strlen(kv->key) != n) return fail(&c, KVL_EFORMAT, "metadata key %lld contains a NUL byte", (long long)i);
    if (!index_put(g->kv_idx, g->kv_mask, kv->key, i, kv_name, g))
      return fail(&c, KVL_EFORMAT, "duplicate metadata key '%s'", kv->key);
    if ((rc = rd_u32(&c, &kv->type, "value type"))) return rc;
    if ((rc = parse_value(&c, g, kv))) return rc;
    if (!strcmp(kv->key, "general.alignment")) {
      if (kv->type != KVL_GGUF_U32) return fail(&c, KVL_EFORMAT, "general.alignment must be u32, is %s", kvl_gguf_vtype_name(kv->type));
      uint32_t a;
      memcpy(&a, kv->raw, 4);
      if (a == 0 || (a & (a - 1)) || a > (1u << 20))
        return fail(&c, KVL_EFORMAT, "general.alignment %u is not a power of two up to 1 MiB", a);
      g->alignment = a;
    }
  }

  for (int64_t i = 0; i < g->n_tensors; i++) {
    struct kvl_gguf_tensor *t = &g->tensors[i];
    const uint8_t *s;
    uint64_t n;
    if ((rc = rd_str(&c, &s, &n, MAX_NAME_LEN, "tensor name"))) return rc;
    if (!(t->name = arena_put(g, s, (size_t)n))) return fail(&c, KVL_ENOMEM, "out of memory");
    if (strlen(t->name) != n) return fail(&c, KVL_EFORMAT, "tensor %lld's name contains a NUL byte", (long long)i);
    if ((rc = rd_u32(&c, &t->n_dims, "tensor dimension count"))) return rc;
    if (t->n_dims < 1 || t->n_dims > KVL_GGUF_MAX_DIMS)
      return fail(&c, KVL_EFORMAT, "tensor '%s' has %u dimensions (1..%d allowed)", t->name, t->n_dims, KVL_GGUF_MAX_DIMS);
    uint64_t ne_all = 1;
    for (int d = 0; d < KVL_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
      if ((rc = rd_u64(&c, &t->ne[d], "tensor dimension"))) return rc;
      if (t->ne[d] > (uint64_t)INT64_MAX || (t->ne[d] && ne_all > (uint64_t)INT64_MAX / t->ne[d]))
        return fail(&c, KVL_EOVERFLOW, "tensor '%s': element count overflows", t->name);
      ne_all *= t->ne[d];
    }
    t->n_elements = ne_all;
    if ((rc = rd_u32(&c, &t->type, "tensor type"))) return rc;
    const struct kvl_type_traits *tt = kvl_type_traits(t->type);
    if (!tt) return fail(&c, KVL_EBADTYPE, "tensor '%s' has unknown type %u", t->name, t->type);
    if (t->ne[0] % tt->blck)
      return fail(&c, KVL_EFORMAT, "tensor '%s': row length %llu is not a multiple of %s's block of %u",
                  t->name, (unsigned long long)t->ne[0], tt->name, tt->blck);
    if ((rc = rd_u64(&c, &t->offset, "tensor offset"))) return rc;
    if (t->offset % g->alignment)
      return fail(&c, KVL_EFORMAT, "tensor '%s': offset %llu is not aligned to %u", t->name,
                  (unsigned long long)t->offset, g->alignment);
    uint64_t nb = t->n_elements / tt->blck;
    if (nb > SIZE_MAX / tt->type_size) return fail(&c, KVL_EOVERFLOW, "tensor '%s': byte size overflows", t->name);
    t->nbytes = (size_t)nb * tt->type_size;
    if (!index_put(g->t_idx, g->t_mask, t->name, i, t_name, g))
      return fail(&c, KVL_EFORMAT, "duplicate tensor name '%s'", t->name);
  }

  /* data section: aligned after the header */
  size_t pad = (g->alignment - c.pos % g->alignment) % g->alignment;
  g->data_off = c.pos + pad;
  if (g->n_tensors > 0 && g->data_off > g->size)
    return fail(&c, KVL_ETRUNC, "file truncated before the tensor data (header ends at %zu, file is %zu bytes)",
                c.pos, g->size);
  size_t data_len = g->data_off <= g->size ? g->size - g->data_off : 0;
  for (int64_t i = 0; i < g->n_tensors; i++) {
    struct kvl_gguf_tensor *t = &g->tensors[i];
    if (t->offset > data_len || t->nbytes > data_len - t->offset)
      return fail(&c, KVL_ETRUNC, "tensor '%s': data [%llu, +%zu) is out of bounds (data section holds %zu bytes)",
                  t->name, (unsigned long long)t->offset, t->nbytes, data_len);
    t->data = g->base + g->data_off + t->offset;
  }
  return 0;
}

static int open_common(struct kvl_gguf *g, kvl_gguf_t **out, char *err, size_t errlen) {
  int rc = parse(g, err, errlen);
  if (rc < 0) {
    kvl_gguf_free(g);
    *out = NULL;
    return rc;
  }
  *out = g;
  return 0;
}

int kvl_gguf_open_mem(const void *buf, size_t len, kvl_gguf_t **out, char *err, size_t errlen) {
  KVL_ASSERT(out != NULL && (buf != NULL || len == 0));
  if (err && errlen) err[0] = '\0';
  struct kvl_gguf *g = calloc(1, sizeof(*g));
  if (!g) return KVL_ENOMEM;
  g->base = buf;
  g->size = len;
  return open_common(g, out, err, errlen);
}

/* The file's bytes in private anonymous memory that the kernel may back with 2 MiB pages
 * (transparent huge pages in "madvise" or "always" mode; with "never" these are plain
 * pages). NULL with errno set on failure. */
static void *read_hugepages(int fd, size_t size, size_t *map_size) {
  size_t sz;
  uint8_t *m = kvl_huge_alloc(size, &sz);
  if (!m) return NULL;
  for (size_t off = 0; off < size;) {
    ssize_t r = pread(fd, m + off, size - off, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      kvl_huge_free(m, sz);
      errno = e;
      return NULL;
    }
    off += (size_t)r;
  }
  mprotect(m, sz, PROT_READ);
  *map_size = sz;
  return m;
}

int kvl_gguf_open_with(const char *path, enum kvl_gguf_load how, kvl_gguf_t **out, char *err, size_t errlen) {
  KVL_ASSERT(path != NULL && out != NULL);
  *out = NULL;
  if (err && errlen) err[0] = '\0';
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = -errno;
    if (err && errlen) snprintf(err, errlen, "cannot open '%s': %s", path, strerror(-e));
    return e;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    if (err && errlen) snprintf(err, errlen, "'%s' is not a regular file", path);
    return KVL_EINVAL;
  }
  struct kvl_gguf *g = calloc(1, sizeof(*g));
  if (!g) { close(fd); return KVL_ENOMEM; }
  g->size = (size_t)st.st_size;
  if (g->size > 0) {
    void *m;
    if (how == KVL_GGUF_HUGEPAGES) {
      m = read_hugepages(fd, g->size, &g->map_size);
    } else {
      m = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
      g->map_size = g->size;
    }
    if (m == NULL || m == MAP_FAILED) {
      int e = -errno;
      close(fd);
      free(g);
      if (err && errlen)
        snprintf(err, errlen, "cannot %s '%s': %s", how == KVL_GGUF_HUGEPAGES ? "read" : "map", path, strerror(-e));
      return e;
    }
    g->base = m;
    g->mapped = true;
  } else {
    g->base = (const uint8_t *)"";
  }
  close(fd);
  return open_common(g, out, err, errlen);
}

int kvl_gguf_open(const char *path, kvl_gguf_t **out, char *err, size_t errlen) {
  return kvl_gguf_open_with(path, KVL_GGUF_MMAP, out, err, errlen);
}

void kvl_gguf_free(kvl_gguf_t *g) {
  if (!g) return;
  if (g->kv)
    for (int64_t i = 0; i < g->n_kv; i++) free(g->kv[i].str_off);
  free(g->kv);
  free(g->tensors);
  free(g->arena);
  free(g->kv_idx);
  free(g->t_idx);
  if (g->mapped) munmap((void *)g->base, g->map_size);
  free(g);
}

uint32_t kvl_gguf_version(const kvl_gguf_t *g) { return g->version; }
uint32_t kvl_gguf_alignment(const kvl_gguf_t *g) { return g->alignment; }
size_t kvl_gguf_file_size(const kvl_gguf_t *g) { return g->size; }
size_t kvl_gguf_data_offset(const kvl_gguf_t *g) { return g->data_off; }
int64_t kvl_gguf_n_kv(const kvl_gguf_t *g) { return g->n_kv; }
int64_t kvl_gguf_n_tensors(const kvl_gguf_t *g) { return g->n_tensors; }

int kvl_gguf_find_key(const kvl_gguf_t *g, const char *key) {
  int64_t i = index_get(g->kv_idx, g->kv_mask, key, kv_name, g);
  return i < 0 ? KVL_ENOENT : (int)i;
}

const char *kvl_gguf_kv_key(const kvl_gguf_t *g, int i) {
  KVL_ASSERT(i >= 0 && i < g->n_kv);
  return g->kv[i].key;
}

enum kvl_gguf_vtype kvl_gguf_kv_type(const kvl_gguf_t *g, int i) {
  KVL_ASSERT(i >= 0 && i < g->n_kv);
  return (enum kvl_gguf_vtype)g->kv[i].type;
}

/* Read one numeric element of type t at p as int64 / double. */
static bool num_int(uint32_t t, const uint8_t *p, int64_t *out) {
  union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32; uint64_t u64; int64_t i64; } v;
  size_t sz = vtype_size(t);
  if (!sz || t == KVL_GGUF_F32 || t == KVL_GGUF_F64) return false;
  memcpy(&v, p, sz);
  switch (t) {
  case KVL_GGUF_U8: case KVL_GGUF_BOOL: *out = v.u8; return true;
  case KVL_GGUF_I8: *out = v.i8; return true;
  case KVL_GGUF_U16: *out = v.u16; return true;
  case KVL_GGUF_I16: *out = v.i16; return true;
  case KVL_GGUF_U32: *out = v.u32; return true;
  case KVL_GGUF_I32: *out = v.i32; return true;
  case KVL_GGUF_U64: if (v.u64 > (uint64_t)INT64_MAX) return false; *out = (int64_t)v.u64; return true;
  case KVL_GGUF_I64: *out = v.i64; return true;
  default: return false;
  }
}

static bool num_float(uint32_t t, const uint8_t *p, double *out) {
  if (t == KVL_GGUF_F32) { float f; memcpy(&f, p, 4); *out = f; return true; }
  if (t == KVL_GGUF_F64) { memcpy(out, p, 8); return true; }
  int64_t i;
  if (num_int(t, p, &i)) { *out = (double)i; return true; }
  return false;
}

static const struct kv *lookup(const kvl_gguf_t *g, const char *key) {
  int i = kvl_gguf_find_key(g, key);
  return i < 0 ? NULL : &g->kv[i];
}

int kvl_gguf_get_int(const kvl_gguf_t *g, const char *key, int64_t *out) {
  const struct kv *kv = lookup(g, key);
  if (!kv) return KVL_ENOENT;
  return num_int(kv->type, kv->raw, out) ? 0 : KVL_EBADTYPE;
}

int kvl_gguf_get_float(const kvl_gguf_t *g, const char *key, double *out) {
  const struct kv *kv = lookup(g, key);
  if (!kv) return KVL_ENOENT;
  return num_float(kv->type, kv->raw, out) ? 0 : KVL_EBADTYPE;
}

int kvl_gguf_get_bool(const kvl_gguf_t *g, const char *key, bool *out) {
  const struct kv *kv = lookup(g, key);
  if (!kv) return KVL_ENOENT;
  if (kv->type != KVL_GGUF_BOOL) return KVL_EBADTYPE;
  *out = kv->raw[0] != 0;
  return 0;
}

int kvl_gguf_get_str(const kvl_gguf_t *g, const char *key, const char **out) {
  const struct kv *kv = lookup(g, key);
  if (!kv) return KVL_ENOENT;
  if (kv->type != KVL_GGUF_STRING) return KVL_EBADTYPE;
  *out = kv->str;
  return 0;
}

int kvl_gguf_get_arr(const kvl_gguf_t *g, const char *key, enum kvl_gguf_vtype *elem, uint64_t *n) {
  const struct kv *kv = lookup(g, key);
  if (!kv) return KVL_ENOENT;
  if (kv->type != KVL_GGUF_ARRAY) return KVL_EBADTYPE;
  if (elem) *elem = (enum kvl_gguf_vtype)kv->elem;
  if (n) *n = kv->n;
  return 0;
}

static const struct kv *lookup_arr(const kvl_gguf_t *g, const char *key, uint64_t i, int *rc) {
  const struct kv *kv = lookup(g, key);
  *rc = !kv ? KVL_ENOENT : kv->type != KVL_GGUF_ARRAY ? KVL_EBADTYPE : i >= kv->n ? KVL_ERANGE : 0;
  return *rc ? NULL : kv;
}

int kvl_gguf_arr_int(const kvl_gguf_t *g, const char *key, uint64_t i, int64_t *out) {
  int rc;
  const struct kv *kv = lookup_arr(g, key, i, &rc);
  if (!kv) return rc;
  size_t sz = vtype_size(kv->elem);
  return sz && num_int(kv->elem, kv->raw + i * sz, out) ? 0 : KVL_EBADTYPE;
}

int kvl_gguf_arr_float(const kvl_gguf_t *g, const char *key, uint64_t i, double *out) {
  int rc;
  const struct kv *kv = lookup_arr(g, key, i, &rc);
  if (!kv) return rc;
  size_t sz = vtype_size(kv->elem);
  return sz && num_float(kv->elem, kv->raw + i * sz, out) ? 0 : KVL_EBADTYPE;
}

int kvl_gguf_arr_str(const kvl_gguf_t *g, const char *key, uint64_t i, const char **s, size_t *len) {
  int rc;
  const struct kv *kv = lookup_arr(g, key, i, &rc);
  if (!kv) return rc;
  if (kv->elem != KVL_GGUF_STRING) return KVL_EBADTYPE;
  const uint8_t *p = kv->raw + kv->str_off[i];
  uint64_t n;
  memcpy(&n, p, 8);
  *s = (const char *)p + 8;
  *len = (size_t)n;
  return 0;
}

const void *kvl_gguf_arr_data(const kvl_gguf_t *g, const char *key) {
  const struct kv *kv = lookup(g, key);
  if (!kv || kv->type != KVL_GGUF_ARRAY || kv->elem == KVL_GGUF_STRING) return NULL;
  return kv->raw;
}

const struct kvl_gguf_tensor *kvl_gguf_tensor(const kvl_gguf_t *g, int64_t i) {
  KVL_ASSERT(i >= 0 && i < g->n_tensors);
  return &g->tensors[i];
}

const struct kvl_gguf_tensor *kvl_gguf_find_tensor(const kvl_gguf_t *g, const char *name) {
  int64_t i = index_get(g->t_idx, g->t_mask, name, t_name, g);
  return i < 0 ? NULL : &g->tensors[i];
}
