/* kvl_gguf.h — GGUF model files: a validating reader over mmap, and a writer.
 *
 * The reader maps the file read-only and checks every count, length, offset and size
 * against the file before anything uses it, so truncated, corrupt or hostile files give
 * an error that names the problem (never a crash). Tensor data is used in place.
 *
 *   char err[256];
 *   kvl_gguf_t *g;
 *   if (kvl_gguf_open("model.gguf", &g, err, sizeof(err)) < 0) { puts(err); return 1; }
 *   int64_t n_layer;
 *   kvl_gguf_get_int(g, "qwen2.block_count", &n_layer);
 *   const struct kvl_gguf_tensor *t = kvl_gguf_find_tensor(g, "token_embd.weight");
 *   ... t->data, t->type, t->ne[0] (row length), t->ne[1] (rows) ...
 *   kvl_gguf_free(g);
 *
 * Shapes follow GGUF: ne[0] is the innermost (contiguous) dimension, so a weight of
 * ne = {in, out} is stored as `out` rows of `in` elements each.
 *
 * The writer builds a file in memory (metadata, then tensors) and writes it at once; it
 * makes the tiny synthetic fixture models and the fuzz seed corpus.
 */
#ifndef KVL_GGUF_H
#define KVL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVL_GGUF_MAX_DIMS 4
#define KVL_GGUF_DEFAULT_ALIGNMENT 32

/* Metadata value types (GGUF numbering). */
enum kvl_gguf_vtype {
  KVL_GGUF_U8 = 0,
  KVL_GGUF_I8 = 1,
  KVL_GGUF_U16 = 2,
  KVL_GGUF_I16 = 3,
  KVL_GGUF_U32 = 4,
  KVL_GGUF_I32 = 5,
  KVL_GGUF_F32 = 6,
  KVL_GGUF_BOOL = 7,
  KVL_GGUF_STRING = 8,
  KVL_GGUF_ARRAY = 9,
  KVL_GGUF_U64 = 10,
  KVL_GGUF_I64 = 11,
  KVL_GGUF_F64 = 12,
  KVL_GGUF_VTYPE_COUNT_
};

struct kvl_gguf_tensor {
  const char *name;                 /* NUL-terminated copy, owned by the reader */
  uint32_t n_dims;                  /* 1 .. KVL_GGUF_MAX_DIMS */
  uint64_t ne[KVL_GGUF_MAX_DIMS];   /* elements per dimension; unused ones are 1 */
  uint64_t n_elements;              /* product of ne */
  uint32_t type;                    /* enum kvl_type (kvl_quant.h) */
  uint64_t offset;                  /* from the start of the data section */
  size_t nbytes;                    /* bytes of data */
  const void *data;                 /* into the mapping; aligned to the file's alignment */
};

typedef struct kvl_gguf kvl_gguf_t;

/* ---- reader ------------------------------------------------------------------- */

/* Map and validate a file. On failure returns a negative KVL_E* code and writes a
 * message naming the problem into err (when errlen > 0); *out is then NULL. */
int kvl_gguf_open(const char *path, kvl_gguf_t **out, char *err, size_t errlen);

/* Where the file's bytes live. MMAP: mapped from the page cache (4 KiB pages, shared
 * with other processes reading the file, nothing read up front). HUGEPAGES: read once into
 * private memory the kernel backs with 2 MiB pages where transparent huge pages allow it:
 * decode streams every weight once per token, and 4 KiB pages cost it TLB misses (about
 * 12% of tg128 on the 1.5B; docs/architecture.md). */
enum kvl_gguf_load { KVL_GGUF_MMAP, KVL_GGUF_HUGEPAGES };
int kvl_gguf_open_with(const char *path, enum kvl_gguf_load how, kvl_gguf_t **out, char *err, size_t errlen);

/* Validate a buffer already in memory; buf must outlive the handle (not copied). */
int kvl_gguf_open_mem(const void *buf, size_t len, kvl_gguf_t **out, char *err, size_t errlen);

/* Unmap and free; NULL is fine. */
void kvl_gguf_free(kvl_gguf_t *g);

uint32_t kvl_gguf_version(const kvl_gguf_t *g);
uint32_t kvl_gguf_alignment(const kvl_gguf_t *g);
size_t kvl_gguf_file_size(const kvl_gguf_t *g);
size_t kvl_gguf_data_offset(const kvl_gguf_t *g); /* where the tensor data starts */

/* Metadata by index (0 .. n_kv-1) or key. */
int64_t kvl_gguf_n_kv(const kvl_gguf_t *g);
int kvl_gguf_find_key(const kvl_gguf_t *g, const char *key); /* index or KVL_ENOENT */
const char *kvl_gguf_kv_key(const kvl_gguf_t *g, int i);
enum kvl_gguf_vtype kvl_gguf_kv_type(const kvl_gguf_t *g, int i);

/* Typed getters by key: 0, KVL_ENOENT (missing) or KVL_EBADTYPE (wrong type).
 * get_int accepts every integer type (and bool); get_float f32/f64 and integers. */
int kvl_gguf_get_int(const kvl_gguf_t *g, const char *key, int64_t *out);
int kvl_gguf_get_float(const kvl_gguf_t *g, const char *key, double *out);
int kvl_gguf_get_bool(const kvl_gguf_t *g, const char *key, bool *out);
/* NUL-terminated copy owned by the reader (a string with an embedded NUL is cut). */
int kvl_gguf_get_str(const kvl_gguf_t *g, const char *key, const char **out);

/* Arrays: element type and count. */
int kvl_gguf_get_arr(const kvl_gguf_t *g, const char *key, enum kvl_gguf_vtype *elem, uint64_t *n);
/* Element i of a numeric array as int64 / double (converted from its stored type). */
int kvl_gguf_arr_int(const kvl_gguf_t *g, const char *key, uint64_t i, int64_t *out);
int kvl_gguf_arr_float(const kvl_gguf_t *g, const char *key, uint64_t i, double *out);
/* Element i of a string array: pointer into the mapping (NOT NUL-terminated) + length. */
int kvl_gguf_arr_str(const kvl_gguf_t *g, const char *key, uint64_t i, const char **s, size_t *len);
/* Raw little-endian elements of a numeric array (may be unaligned: memcpy them). */
const void *kvl_gguf_arr_data(const kvl_gguf_t *g, const char *key);

/* Tensors. */
int64_t kvl_gguf_n_tensors(const kvl_gguf_t *g);
const struct kvl_gguf_tensor *kvl_gguf_tensor(const kvl_gguf_t *g, int64_t i);
const struct kvl_gguf_tensor *kvl_gguf_find_tensor(const kvl_gguf_t *g, const char *name);

/* Human-readable name of a metadata type ("u32", "string", ...). */
const char *kvl_gguf_vtype_name(uint32_t t);

/* ---- writer ------------------------------------------------------------------- */

typedef struct kvl_gguf_writer kvl_gguf_writer_t;

kvl_gguf_writer_t *kvl_gguf_writer_new(void);
void kvl_gguf_writer_free(kvl_gguf_writer_t *w);

/* Each setter appends one key (a key set twice is KVL_EEXIST). Values are copied. */
int kvl_gguf_set_u32(kvl_gguf_writer_t *w, const char *key, uint32_t v);
int kvl_gguf_set_i32(kvl_gguf_writer_t *w, const char *key, int32_t v);
int kvl_gguf_set_u64(kvl_gguf_writer_t *w, const char *key, uint64_t v);
int kvl_gguf_set_f32(kvl_gguf_writer_t *w, const char *key, float v);
int kvl_gguf_set_f64(kvl_gguf_writer_t *w, const char *key, double v);
int kvl_gguf_set_bool(kvl_gguf_writer_t *w, const char *key, bool v);
int kvl_gguf_set_str(kvl_gguf_writer_t *w, const char *key, const char *v);
/* A scalar of any fixed-size type, from its little-endian bytes. */
int kvl_gguf_set_scalar(kvl_gguf_writer_t *w, const char *key, enum kvl_gguf_vtype t, const void *v);
/* Numeric array of n elements of type `elem`, from raw little-endian data. */
int kvl_gguf_set_arr(kvl_gguf_writer_t *w, const char *key, enum kvl_gguf_vtype elem,
                     const void *data, uint64_t n);
int kvl_gguf_set_arr_str(kvl_gguf_writer_t *w, const char *key, const char *const *v, uint64_t n);

/* Add a tensor; `data` (nbytes = kvl_row_size(type, ne[0]) * rows) is copied. */
int kvl_gguf_add_tensor(kvl_gguf_writer_t *w, const char *name, uint32_t type,
                        uint32_t n_dims, const uint64_t *ne, const void *data, size_t nbytes);

/* Serialise to a malloc'd buffer (caller frees) or to a file (written to a temporary
 * name, then renamed: a crash never leaves a half file under the final name). */
int kvl_gguf_writer_to_mem(kvl_gguf_writer_t *w, void **buf, size_t *len);
int kvl_gguf_writer_to_file(kvl_gguf_writer_t *w, const char *path);

#endif /* KVL_GGUF_H */
