/* file.c — translator files: the validating safetensors reader and the writer.
 *
 * The reader trusts nothing: the header length is checked against the file, the JSON
 * header against the safetensors rules (known dtypes, shapes whose byte size matches
 * their data_offsets with overflow checks, offsets inside the data section, tensors
 * covering the data section exactly once), then against kvlingo's layout (metadata
 * keys, fingerprints, the four tensors of every target layer and nothing else, source
 * ids and map shapes). Only then are maps copied out (and widened from bf16), each
 * value checked finite. Every refusal names what is wrong.
 *
 * The writer lays out all source-id tensors first, then all maps (so every tensor is
 * aligned to its element size when the header is padded to 8 bytes), layer by layer,
 * K before V; the header's keys come in that same order after __metadata__.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvl_error.h"
#include "kvl_quant.h"
#include "translator-impl.h"

#define fail kvl_errf /* short: used on nearly every line below */

#define MAX_HEADER 100000000ull /* safetensors' own limit on the JSON header */
#define MAX_RANK 8

enum dt { DT_F32, DT_BF16, DT_I32 };
static const char *const dt_name[] = {"F32", "BF16", "I32"};
static const size_t dt_size[] = {4, 2, 4};

/* The four tensors of a target layer, in the order the writer emits them. */
enum slot { SLOT_K_SOURCES, SLOT_V_SOURCES, SLOT_K, SLOT_V, SLOT_COUNT };
static const char *const slot_suffix[] = {"k_sources", "v_sources", "k", "v"};

/* One tensor entry of the header, checked against the safetensors rules. */
struct entry {
  const char *name;        /* the header's key (owned by the parsed JSON) */
  enum dt dtype;
  int rank;
  int64_t shape[MAX_RANK];
  uint64_t begin, end;     /* [begin, end) within the data section */
};

static uint64_t rd_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static void wr_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* "[2, 3]" into buf, for messages. */
static const char *shape_str(const int64_t *shape, int rank, char *buf, size_t n) {
  size_t o = 0;
  o += (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < rank && o < n; i++)
    o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (o < n) snprintf(buf + o, n - o, "]");
  return buf;
}

/* A non-negative JSON integer, or false. */
static bool get_uint(const json_t *j, uint64_t *out) {
  if (!json_is_integer(j) || json_integer_value(j) < 0) return false;
  *out = (uint64_t)json_integer_value(j);
  return true;
}

/* Check one header entry against the safetensors rules; data_len = data section bytes. */
static int parse_entry(const char *name, json_t *v, uint64_t data_len, struct entry *e, char *err,
                       size_t errlen) {
  e->name = name;
  if (!json_is_object(v)) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': header entry is not an object", name);
  const char *k;
  json_t *f;
  json_object_foreach(v, k, f) {
    if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets"))
      return fail(err, errlen, KVL_EFORMAT, "tensor '%s': unknown field '%s'", name, k);
  }
  json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
         *off = json_object_get(v, "data_offsets");
  if (!dt) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': missing 'dtype'", name);
  if (!sh) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': missing 'shape'", name);
  if (!off) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': missing 'data_offsets'", name);
  if (!json_is_string(dt)) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': dtype is not a string", name);
  const char *ds = json_string_value(dt);
  int d = -1;
  for (int i = 0; i < 3; i++)
    if (!strcmp(ds, dt_name[i])) d = i;
  if (d < 0)
    return fail(err, errlen, KVL_EBADTYPE, "tensor '%s': dtype '%.32s' is not supported (F32, BF16 or I32)", name,
                ds);
  e->dtype = (enum dt)d;

  if (!json_is_array(sh)) return fail(err, errlen, KVL_EFORMAT, "tensor '%s': shape is not an array", name);
  if (json_array_size(sh) > MAX_RANK)
    return fail(err, errlen, KVL_EFORMAT, "tensor '%s': rank %zu exceeds %d", name, json_array_size(sh), MAX_RANK);
  e->rank = (int)json_array_size(sh);
  uint64_t count = 1;
  bool over = false;
  for (int i = 0; i < e->rank; i++) {
    uint64_t x;
    if (!get_uint(json_array_get(sh, (size_t)i), &x))
      return fail(err, errlen, KVL_EFORMAT, "tensor '%s': shape[%d] is not a non-negative integer", name, i);
    e->shape[i] = (int64_t)x;
    over |= __builtin_mul_overflow(count, x, &count);
  }
  if (!json_is_array(off) || json_array_size(off) != 2)
    return fail(err, errlen, KVL_EFORMAT, "tensor '%s': data_offsets is not a [begin, end] pair", name);
  if (!get_uint(json_array_get(off, 0), &e->begin) || !get_uint(json_array_get(off, 1), &e->end))
    return fail(err, errlen, KVL_EFORMAT, "tensor '%s': data_offsets are not non-negative integers", name);
  if (e->begin > e->end)
    return fail(err, errlen, KVL_EFORMAT, "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] run backwards",
                name, e->begin, e->end);
  if (e->end > data_len)
    return fail(err, errlen, KVL_ETRUNC,
                "tensor '%s': data_offsets end %" PRIu64 " is beyond the %" PRIu64 "-byte data section", name,
                e->end, data_len);
  uint64_t nbytes;
  char sb[160];
  if (over || __builtin_mul_overflow(count, (uint64_t)dt_size[d], &nbytes))
    return fail(err, errlen, KVL_EOVERFLOW, "tensor '%s': shape %s overflows", name,
                shape_str(e->shape, e->rank, sb, sizeof(sb)));
  if (nbytes != e->end - e->begin)
    return fail(err, errlen, KVL_EFORMAT,
                "tensor '%s': shape %s of %s needs %" PRIu64 " bytes, data_offsets span %" PRIu64, name,
                shape_str(e->shape, e->rank, sb, sizeof(sb)), dt_name[d], nbytes, e->end - e->begin);
  return 0;
}

static int cmp_entry(const void *a, const void *b) {
  const struct entry *x = *(const struct entry *const *)a, *y = *(const struct entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* The tensors must tile the data section: sorted by offset, each begins where the last
 * ended, the first at 0, the last at data_len. */
static int check_coverage(struct entry *e, size_t n, uint64_t data_len, char *err, size_t errlen) {
  struct entry **s = malloc((n ? n : 1) * sizeof(*s));
  if (!s) return fail(err, errlen, KVL_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++) s[i] = &e[i];
  qsort(s, n, sizeof(*s), cmp_entry);
  uint64_t at = 0;
  int rc = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    if (s[i]->begin < at)
      rc = fail(err, errlen, KVL_EFORMAT,
                "tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64 ") overlap", s[i - 1]->name,
                s[i - 1]->begin, s[i - 1]->end, s[i]->name, s[i]->begin, s[i]->end);
    else if (s[i]->begin > at)
      rc = fail(err, errlen, KVL_EFORMAT,
                "data section bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor (before '%s')", at, s[i]->begin,
                s[i]->name);
    at = s[i]->end;
  }
  if (!rc && at != data_len)
    rc = fail(err, errlen, KVL_EFORMAT, "data section has %" PRIu64 " trailing bytes that belong to no tensor",
              data_len - at);
  free(s);
  return rc;
}

/* "layers.<l>.<suffix>" with l canonical decimal: fills layer and slot, else false. */
static bool parse_name(const char *name, int64_t *layer, enum slot *slot) {
  if (strncmp(name, "layers.", 7)) return false;
  const char *p = name + 7;
  if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return false;
  int64_t l = 0;
  int digits = 0;
  for (; *p >= '0' && *p <= '9'; p++, digits++) {
    if (digits >= 9) return false;
    l = l * 10 + (*p - '0');
  }
  if (*p++ != '.') return false;
  for (int s = 0; s < SLOT_COUNT; s++)
    if (!strcmp(p, slot_suffix[s])) {
      *layer = l;
      *slot = (enum slot)s;
      return true;
    }
  return false;
}

/* ---- fingerprints as JSON ------------------------------------------------------- */

static const char *const fp_keys[] = {"architecture", "n_layer", "n_kv_head", "head_dim", "kv_width",
                                      "rope_theta", "rope_scaling", "tokenizer_hash", "name"};

static json_t *fp_to_json(const struct kvl_model_fingerprint *fp) {
  return json_pack("{s:s, s:i, s:i, s:i, s:I, s:f, s:s, s:s, s:s}", "architecture", fp->architecture, "n_layer",
                   (int)fp->n_layer, "n_kv_head", (int)fp->n_kv_head, "head_dim", (int)fp->head_dim, "kv_width",
                   (json_int_t)kvl_fingerprint_kv_width(fp), "rope_theta", fp->rope_theta, "rope_scaling",
                   fp->rope_scaling, "tokenizer_hash", fp->tokenizer_hash, "name", fp->name);
}

static int fp_str(const char *key, json_t *o, const char *field, char *dst, size_t cap, bool null_is_none,
                  char *err, size_t errlen) {
  json_t *v = json_object_get(o, field);
  if (null_is_none && json_is_null(v)) {
    snprintf(dst, cap, "none");
    return 0;
  }
  if (!json_is_string(v)) return fail(err, errlen, KVL_EFORMAT, "%s: '%s' is not a string", key, field);
  if (json_string_length(v) >= cap)
    return fail(err, errlen, KVL_EFORMAT, "%s: '%s' is longer than %zu bytes", key, field, cap - 1);
  memcpy(dst, json_string_value(v), json_string_length(v) + 1);
  return 0;
}

static int fp_int(const char *key, json_t *o, const char *field, int64_t max, int32_t *dst, char *err,
                  size_t errlen) {
  json_t *v = json_object_get(o, field);
  if (!json_is_integer(v)) return fail(err, errlen, KVL_EFORMAT, "%s: '%s' is not an integer", key, field);
  json_int_t x = json_integer_value(v);
  if (x < 1 || x > max)
    return fail(err, errlen, KVL_EFORMAT, "%s: '%s' is %lld, outside 1..%lld", key, field, (long long)x,
                (long long)max);
  *dst = (int32_t)x;
  return 0;
}

/* Parse the metadata string `text` under `key` into *fp. */
static int fp_from_json(const char *key, const char *text, struct kvl_model_fingerprint *fp, char *err,
                        size_t errlen) {
  json_error_t je;
  json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &je);
  int rc = 0;
  if (!o) return fail(err, errlen, KVL_EFORMAT, "%s is not valid JSON: %s", key, je.text);
  memset(fp, 0, sizeof(*fp));
  if (!json_is_object(o)) {
    rc = fail(err, errlen, KVL_EFORMAT, "%s is not a JSON object", key);
    goto out;
  }
  const char *k;
  json_t *v;
  json_object_foreach(o, k, v) {
    bool known = false;
    for (size_t i = 0; i < sizeof(fp_keys) / sizeof(fp_keys[0]); i++) known |= !strcmp(k, fp_keys[i]);
    if (!known) {
      rc = fail(err, errlen, KVL_EFORMAT, "%s: unknown key '%.64s'", key, k);
      goto out;
    }
  }
  for (size_t i = 0; i < sizeof(fp_keys) / sizeof(fp_keys[0]); i++)
    if (!json_object_get(o, fp_keys[i])) {
      rc = fail(err, errlen, KVL_EFORMAT, "%s: missing '%s'", key, fp_keys[i]);
      goto out;
    }
  if ((rc = fp_str(key, o, "architecture", fp->architecture, sizeof(fp->architecture), false, err, errlen)) ||
      (rc = fp_int(key, o, "n_layer", KVL__TR_MAX_LAYERS, &fp->n_layer, err, errlen)) ||
      (rc = fp_int(key, o, "n_kv_head", KVL__TR_MAX_HEADS, &fp->n_kv_head, err, errlen)) ||
      (rc = fp_int(key, o, "head_dim", KVL__TR_MAX_HEAD_DIM, &fp->head_dim, err, errlen)) ||
      (rc = fp_str(key, o, "rope_scaling", fp->rope_scaling, sizeof(fp->rope_scaling), true, err, errlen)) ||
      (rc = fp_str(key, o, "tokenizer_hash", fp->tokenizer_hash, sizeof(fp->tokenizer_hash), false, err,
                   errlen)) ||
      (rc = fp_str(key, o, "name", fp->name, sizeof(fp->name), false, err, errlen)))
    goto out;
  json_t *th = json_object_get(o, "rope_theta"), *kw = json_object_get(o, "kv_width");
  if (!json_is_number(th)) {
    rc = fail(err, errlen, KVL_EFORMAT, "%s: 'rope_theta' is not a number", key);
    goto out;
  }
  fp->rope_theta = json_number_value(th);
  if (!json_is_integer(kw) || json_integer_value(kw) != kvl_fingerprint_kv_width(fp)) {
    rc = fail(err, errlen, KVL_EFORMAT, "%s: 'kv_width' is not n_kv_head × head_dim = %lld", key,
              (long long)kvl_fingerprint_kv_width(fp));
    goto out;
  }
  char sub[200];
  if ((rc = kvl_fingerprint_validate(fp, sub, sizeof(sub))) < 0) rc = fail(err, errlen, KVL_EFORMAT, "%s: %s", key, sub);
out:
  json_decref(o);
  return rc;
}

/* ---- reader ------------------------------------------------------------------------ */

static const char *const meta_known[] = {"kvlingo.format_version", "kvlingo.source", "kvlingo.target",
                                         "kvlingo.affine", "kvlingo.dtype", "kvlingo.fit", "kvlingo.scores"};

static int meta_required(json_t *meta, const char *key, const char **out, char *err, size_t errlen) {
  json_t *v = json_object_get(meta, key);
  if (!v) return fail(err, errlen, KVL_EFORMAT, "missing metadata key '%s'", key);
  *out = json_string_value(v); /* strings checked already */
  return 0;
}

/* Check __metadata__ and make the (empty) translator it describes. */
static int read_metadata(json_t *meta, kvl_translator_t **out, char *err, size_t errlen) {
  if (!meta) return fail(err, errlen, KVL_EFORMAT, "header has no __metadata__ (kvlingo.* keys are required)");
  if (!json_is_object(meta)) return fail(err, errlen, KVL_EFORMAT, "__metadata__ is not an object");
  const char *k;
  json_t *v;
  json_object_foreach(meta, k, v) {
    if (!json_is_string(v))
      return fail(err, errlen, KVL_EFORMAT, "metadata key '%.64s' is not a string (nested values are JSON strings)",
                  k);
    if (strncmp(k, "kvlingo.", 8)) continue; /* another tool's: ignored */
    bool known = false;
    for (size_t i = 0; i < sizeof(meta_known) / sizeof(meta_known[0]); i++) known |= !strcmp(k, meta_known[i]);
    if (!known) return fail(err, errlen, KVL_EFORMAT, "unknown metadata key '%.64s'", k);
  }
  const char *ver = NULL, *src = NULL, *dst = NULL, *aff = NULL, *dts = NULL;
  int rc;
  if ((rc = meta_required(meta, "kvlingo.format_version", &ver, err, errlen)) ||
      (rc = meta_required(meta, "kvlingo.source", &src, err, errlen)) ||
      (rc = meta_required(meta, "kvlingo.target", &dst, err, errlen)) ||
      (rc = meta_required(meta, "kvlingo.affine", &aff, err, errlen)) ||
      (rc = meta_required(meta, "kvlingo.dtype", &dts, err, errlen)))
    return rc;
  if (strcmp(ver, "1"))
    return fail(err, errlen, KVL_ENOTSUP, "kvlingo.format_version is '%.32s'; this kvlingo reads version %d", ver,
                KVL_TRANSLATOR_FORMAT_VERSION);
  bool affine;
  if (!strcmp(aff, "true")) affine = true;
  else if (!strcmp(aff, "false")) affine = false;
  else return fail(err, errlen, KVL_EFORMAT, "kvlingo.affine is '%.32s', expected \"true\" or \"false\"", aff);
  enum kvl_translator_dtype dtype;
  if (!strcmp(dts, "F32")) dtype = KVL_TRANSLATOR_F32;
  else if (!strcmp(dts, "BF16")) dtype = KVL_TRANSLATOR_BF16;
  else return fail(err, errlen, KVL_EFORMAT, "kvlingo.dtype is '%.32s', expected \"F32\" or \"BF16\"", dts);
  struct kvl_model_fingerprint fs, fd;
  if ((rc = fp_from_json("kvlingo.source", src, &fs, err, errlen)) ||
      (rc = fp_from_json("kvlingo.target", dst, &fd, err, errlen)))
    return rc;
  const char *fit = json_string_value(json_object_get(meta, "kvlingo.fit"));
  const char *scores = json_string_value(json_object_get(meta, "kvlingo.scores"));
  if (!kvl__tr_is_json_object(fit)) return fail(err, errlen, KVL_EFORMAT, "kvlingo.fit is not a JSON object");
  if (!kvl__tr_is_json_object(scores)) return fail(err, errlen, KVL_EFORMAT, "kvlingo.scores is not a JSON object");
  kvl_translator_t *t;
  if ((rc = kvl_translator_new(&fs, &fd, affine, &t, err, errlen)) < 0) return rc;
  t->dtype = dtype;
  if ((rc = kvl_translator_set_fit_json(t, fit)) < 0 || (rc = kvl_translator_set_scores_json(t, scores)) < 0) {
    kvl_translator_free(t);
    return fail(err, errlen, rc, "out of memory");
  }
  *out = t;
  return 0;
}

/* Check a layer's source-id tensor and copy it out. */
static int read_sources(const kvl_translator_t *t, const struct entry *e, const uint8_t *data, int32_t **out,
                        int32_t *nu, char *err, size_t errlen) {
  char sb[160];
  if (e->dtype != DT_I32)
    return fail(err, errlen, KVL_EBADTYPE, "tensor '%s' is %s, expected I32", e->name, dt_name[e->dtype]);
  if (e->rank != 1)
    return fail(err, errlen, KVL_EMISMATCH, "tensor '%s' has shape %s, expected [ν] (one dimension)", e->name,
                shape_str(e->shape, e->rank, sb, sizeof(sb)));
  const int64_t n = e->shape[0];
  if (n < 1 || n > t->src.n_layer)
    return fail(err, errlen, KVL_EMISMATCH, "tensor '%s' lists %lld source layers, expected 1..%d", e->name,
                (long long)n, (int)t->src.n_layer);
  int32_t *s = malloc((size_t)n * sizeof(*s));
  if (!s) return fail(err, errlen, KVL_ENOMEM, "out of memory");
  const uint8_t *p = data + e->begin;
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 | (uint32_t)p[4 * i + 2] << 16 |
                 (uint32_t)p[4 * i + 3] << 24;
    s[i] = (int32_t)u;
    if (s[i] < 0 || s[i] >= t->src.n_layer) {
      free(s);
      return fail(err, errlen, KVL_ERANGE, "tensor '%s'[%lld] is source layer %d, outside 0..%d", e->name,
                  (long long)i, (int)(int32_t)u, (int)t->src.n_layer - 1);
    }
    for (int64_t j = 0; j < i; j++)
      if (s[j] == s[i]) {
        free(s);
        return fail(err, errlen, KVL_EFORMAT, "tensor '%s' lists source layer %d twice", e->name, (int)(int32_t)u);
      }
  }
  *out = s;
  *nu = (int32_t)n;
  return 0;
}

/* Check a map tensor against its sources and the widths, and widen it to fp32. */
static int read_map(const kvl_translator_t *t, const struct entry *e, int32_t nu, const uint8_t *data,
                    float **out, char *err, size_t errlen) {
  char sb[160];
  const enum dt want = t->dtype == KVL_TRANSLATOR_BF16 ? DT_BF16 : DT_F32;
  if (e->dtype != want)
    return fail(err, errlen, KVL_EBADTYPE, "tensor '%s' is %s but kvlingo.dtype says %s", e->name,
                dt_name[e->dtype], dt_name[want]);
  const int64_t rows = (int64_t)nu * t->w_src + (t->affine ? 1 : 0), cols = t->w_dst;
  if (e->rank != 2 || e->shape[0] != rows || e->shape[1] != cols)
    return fail(err, errlen, KVL_EMISMATCH,
                "tensor '%s' has shape %s, expected [%lld, %lld] (ν=%d × w_S %lld%s, w_T %lld)", e->name,
                shape_str(e->shape, e->rank, sb, sizeof(sb)), (long long)rows, (long long)cols, (int)nu,
                (long long)t->w_src, t->affine ? " + 1 intercept row" : "", (long long)cols);
  const int64_t n = rows * cols; /* its bytes are in the file: no overflow */
  float *m = malloc((size_t)(n ? n : 1) * sizeof(*m));
  if (!m) return fail(err, errlen, KVL_ENOMEM, "out of memory");
  const uint8_t *p = data + e->begin;
  for (int64_t i = 0; i < n; i++) {
    if (want == DT_BF16) {
      m[i] = kvl_bf16_to_fp32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
    } else {
      uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 | (uint32_t)p[4 * i + 2] << 16 |
                   (uint32_t)p[4 * i + 3] << 24;
      memcpy(&m[i], &u, sizeof(u));
    }
    if (!isfinite(m[i])) {
      free(m);
      return fail(err, errlen, KVL_EFORMAT, "tensor '%s' element %lld (row %lld, column %lld) is not finite",
                  e->name, (long long)i, (long long)(i / cols), (long long)(i % cols));
    }
  }
  *out = m;
  return 0;
}

int kvl_translator_load_mem(const void *buf, size_t len, kvl_translator_t **out, char *err, size_t errlen) {
  KVL_ASSERT(out && (buf || !len));
  *out = NULL;
  if (err && errlen) err[0] = '\0';
  const uint8_t *p = buf;
  if (len < 8) return fail(err, errlen, KVL_ETRUNC, "file is %zu bytes, too short for the 8-byte header length", len);
  const uint64_t hlen = rd_le64(p);
  if (hlen > len - 8)
    return fail(err, errlen, KVL_ETRUNC, "header length %" PRIu64 " exceeds the %zu bytes after the length field",
                hlen, len - 8);
  if (hlen > MAX_HEADER)
    return fail(err, errlen, KVL_EFORMAT, "header length %" PRIu64 " exceeds the %llu-byte limit", hlen, MAX_HEADER);
  if (hlen < 2)
    return fail(err, errlen, KVL_EFORMAT, "header length %" PRIu64 " is too short for a JSON object", hlen);
  if (p[8] != '{')
    return fail(err, errlen, KVL_EFORMAT, "header does not start with '{' (not a safetensors file?)");
  const uint8_t *data = p + 8 + hlen;
  const uint64_t data_len = len - 8 - hlen;

  json_error_t je;
  json_t *root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return fail(err, errlen, KVL_EFORMAT, "header is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                je.column);
  int rc = 0;
  kvl_translator_t *t = NULL;
  struct entry *ents = NULL;
  int64_t(*idx)[SLOT_COUNT] = NULL;
  if (!json_is_object(root)) {
    rc = fail(err, errlen, KVL_EFORMAT, "header is not a JSON object");
    goto out;
  }

  /* 1. safetensors rules: every entry, then their tiling of the data section */
  size_t n_ent = 0;
  json_t *meta = NULL;
  ents = calloc(json_object_size(root) + 1, sizeof(*ents));
  if (!ents) {
    rc = fail(err, errlen, KVL_ENOMEM, "out of memory");
    goto out;
  }
  const char *key;
  json_t *val;
  json_object_foreach(root, key, val) {
    if (!strcmp(key, "__metadata__")) {
      meta = val;
      continue;
    }
    if ((rc = parse_entry(key, val, data_len, &ents[n_ent], err, errlen)) < 0) goto out;
    n_ent++;
  }
  if ((rc = check_coverage(ents, n_ent, data_len, err, errlen)) < 0) goto out;

  /* 2. kvlingo's metadata */
  if ((rc = read_metadata(meta, &t, err, errlen)) < 0) goto out;

  /* 3. names: the four tensors of every target layer, nothing else */
  const int32_t L = t->dst.n_layer;
  idx = malloc((size_t)L * sizeof(*idx));
  if (!idx) {
    rc = fail(err, errlen, KVL_ENOMEM, "out of memory");
    goto out;
  }
  memset(idx, 0xff, (size_t)L * sizeof(*idx));
  for (size_t i = 0; i < n_ent; i++) {
    int64_t l;
    enum slot s;
    if (!parse_name(ents[i].name, &l, &s)) {
      rc = fail(err, errlen, KVL_EFORMAT,
                "unknown tensor '%.80s' (expected layers.<l>.k, .v, .k_sources, .v_sources)", ents[i].name);
      goto out;
    }
    if (l >= L) {
      rc = fail(err, errlen, KVL_EFORMAT, "tensor '%s' is for target layer %lld, but the target has %d layers",
                ents[i].name, (long long)l, (int)L);
      goto out;
    }
    idx[l][s] = (int64_t)i; /* names are unique (duplicate keys refused), so is each slot */
  }

  /* 4. per layer: sources, then maps shaped by them */
  for (int32_t l = 0; l < L; l++) {
    for (int s = 0; s < SLOT_COUNT; s++)
      if (idx[l][s] < 0) {
        rc = fail(err, errlen, KVL_EFORMAT, "missing tensor 'layers.%d.%s'", (int)l, slot_suffix[s]);
        goto out;
      }
    for (int w = 0; w < 2; w++) {
      int32_t *src = NULL, nu = 0;
      float *map = NULL;
      if ((rc = read_sources(t, &ents[idx[l][w == 0 ? SLOT_K_SOURCES : SLOT_V_SOURCES]], data, &src, &nu, err,
                             errlen)) < 0)
        goto out;
      if ((rc = read_map(t, &ents[idx[l][w == 0 ? SLOT_K : SLOT_V]], nu, data, &map, err, errlen)) < 0) {
        free(src);
        goto out;
      }
      kvl__tr_slot_put(t, l, (enum kvl_translator_kv)w, src, nu, map);
    }
  }
  *out = t;
  t = NULL;
out:
  free(idx);
  free(ents);
  kvl_translator_free(t);
  json_decref(root);
  return rc;
}

int kvl_translator_load(const char *path, kvl_translator_t **out, char *err, size_t errlen) {
  KVL_ASSERT(path && out);
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(err, errlen, -errno, "cannot open '%s': %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) < 0) {
    int e = errno;
    close(fd);
    return fail(err, errlen, -e, "cannot stat '%s': %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return fail(err, errlen, KVL_EINVAL, "'%s' is not a regular file", path);
  }
  const size_t size = (size_t)st.st_size;
  void *map = NULL;
  if (size) {
    map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      int e = errno;
      close(fd);
      return fail(err, errlen, -e, "cannot map '%s': %s", path, strerror(e));
    }
  }
  close(fd);
  int rc = kvl_translator_load_mem(map, size, out, err, errlen);
  if (map) munmap(map, size);
  return rc;
}

/* ---- writer ------------------------------------------------------------------------ */

/* Add one tensor entry to the header object. */
static int add_entry(json_t *root, const char *name, enum dt d, int rank, const int64_t *shape, uint64_t begin,
                     uint64_t end) {
  json_t *sh = json_array();
  if (!sh) return KVL_ENOMEM;
  for (int i = 0; i < rank; i++)
    if (json_array_append_new(sh, json_integer((json_int_t)shape[i]))) {
      json_decref(sh);
      return KVL_ENOMEM;
    }
  json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", dt_name[d], "shape", sh, "data_offsets",
                        (json_int_t)begin, (json_int_t)end);
  if (!e || json_object_set_new(root, name, e)) return KVL_ENOMEM;
  return 0;
}

int kvl_translator_save_mem(const kvl_translator_t *t, enum kvl_translator_dtype dtype, void **buf, size_t *len,
                            char *err, size_t errlen) {
  KVL_ASSERT(t && buf && len);
  KVL_ASSERT(dtype == KVL_TRANSLATOR_F32 || dtype == KVL_TRANSLATOR_BF16);
  *buf = NULL;
  *len = 0;
  const int32_t L = t->dst.n_layer;
  for (int32_t l = 0; l < L; l++)
    for (int w = 0; w < 2; w++)
      if (!t->maps[l][w].nu)
        return fail(err, errlen, KVL_EINVAL, "target layer %d has no %c map", (int)l, w ? 'V' : 'K');
  const enum dt mdt = dtype == KVL_TRANSLATOR_BF16 ? DT_BF16 : DT_F32;
  int rc = KVL_ENOMEM;
  char *hdr = NULL;
  uint8_t *out = NULL;
  json_t *root = json_object(), *meta = json_object();
  json_t *fs = fp_to_json(&t->src), *fd = fp_to_json(&t->dst);
  char *fs_s = fs ? json_dumps(fs, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
  char *fd_s = fd ? json_dumps(fd, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
  if (!root || !meta || !fs_s || !fd_s) goto nomem;
  if (json_object_set_new(meta, "kvlingo.format_version", json_string("1")) ||
      json_object_set_new(meta, "kvlingo.source", json_string(fs_s)) ||
      json_object_set_new(meta, "kvlingo.target", json_string(fd_s)) ||
      json_object_set_new(meta, "kvlingo.affine", json_string(t->affine ? "true" : "false")) ||
      json_object_set_new(meta, "kvlingo.dtype", json_string(dt_name[mdt])) ||
      (t->fit_json && json_object_set_new(meta, "kvlingo.fit", json_string(t->fit_json))) ||
      (t->scores_json && json_object_set_new(meta, "kvlingo.scores", json_string(t->scores_json))) ||
      json_object_set(root, "__metadata__", meta))
    goto nomem;

  /* layout: all source tensors, then all maps */
  uint64_t at = 0;
  char name[64];
  for (int pass = 0; pass < 2; pass++)
    for (int32_t l = 0; l < L; l++)
      for (int w = 0; w < 2; w++) {
        const struct kvl__tr_map *m = &t->maps[l][w];
        const int slot = pass == 0 ? (w ? SLOT_V_SOURCES : SLOT_K_SOURCES) : (w ? SLOT_V : SLOT_K);
        snprintf(name, sizeof(name), "layers.%d.%s", (int)l, slot_suffix[slot]);
        int64_t shape[2] = {pass == 0 ? m->nu : m->rows, t->w_dst};
        uint64_t nb = pass == 0 ? (uint64_t)m->nu * 4 : (uint64_t)m->rows * (uint64_t)t->w_dst * dt_size[mdt];
        if (add_entry(root, name, pass == 0 ? DT_I32 : mdt, pass == 0 ? 1 : 2, shape, at, at + nb) < 0) goto nomem;
        at += nb;
      }
  hdr = json_dumps(root, JSON_COMPACT);
  if (!hdr) goto nomem;
  const size_t hl = strlen(hdr), hpad = (8 - (8 + hl) % 8) % 8, total = 8 + hl + hpad + (size_t)at;
  out = malloc(total);
  if (!out) goto nomem;
  wr_le64(out, hl + hpad);
  memcpy(out + 8, hdr, hl);
  memset(out + 8 + hl, ' ', hpad);
  uint8_t *d = out + 8 + hl + hpad;
  for (int32_t l = 0; l < L; l++)
    for (int w = 0; w < 2; w++) {
      const struct kvl__tr_map *m = &t->maps[l][w];
      for (int32_t i = 0; i < m->nu; i++)
        for (int b = 0; b < 4; b++) *d++ = (uint8_t)((uint32_t)m->sources[i] >> (8 * b));
    }
  for (int32_t l = 0; l < L; l++)
    for (int w = 0; w < 2; w++) {
      const struct kvl__tr_map *m = &t->maps[l][w];
      const int64_t n = m->rows * t->w_dst;
      for (int64_t i = 0; i < n; i++) {
        if (mdt == DT_BF16) {
          uint16_t h = kvl_fp32_to_bf16(m->data[i]);
          if (!isfinite(kvl_bf16_to_fp32(h))) {
            rc = fail(err, errlen, KVL_ERANGE, "layers.%d.%c element %lld (%g) overflows bf16", (int)l,
                      w ? 'v' : 'k', (long long)i, (double)m->data[i]);
            goto fail_out;
          }
          *d++ = (uint8_t)h;
          *d++ = (uint8_t)(h >> 8);
        } else {
          uint32_t u;
          memcpy(&u, &m->data[i], sizeof(u));
          for (int b = 0; b < 4; b++) *d++ = (uint8_t)(u >> (8 * b));
        }
      }
    }
  KVL_ASSERT((size_t)(d - out) == total);
  *buf = out;
  *len = total;
  out = NULL;
  rc = 0;
  goto done;
nomem:
  rc = fail(err, errlen, KVL_ENOMEM, "out of memory");
fail_out:
done:
  free(out);
  free(hdr);
  free(fs_s);
  free(fd_s);
  json_decref(fs);
  json_decref(fd);
  json_decref(meta);
  json_decref(root);
  return rc;
}

int kvl_translator_save(const kvl_translator_t *t, const char *path, enum kvl_translator_dtype dtype, char *err,
                        size_t errlen) {
  KVL_ASSERT(path);
  void *buf;
  size_t len;
  int rc = kvl_translator_save_mem(t, dtype, &buf, &len, err, errlen);
  if (rc < 0) return rc;
  size_t pl = strlen(path) + 32;
  char *tmp = malloc(pl);
  if (!tmp) {
    free(buf);
    return fail(err, errlen, KVL_ENOMEM, "out of memory");
  }
  snprintf(tmp, pl, "%s.tmp%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    rc = fail(err, errlen, -errno, "cannot create '%s': %s", tmp, strerror(errno));
    goto out;
  }
  for (size_t off = 0; off < len;) {
    ssize_t n = write(fd, (uint8_t *)buf + off, len - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = fail(err, errlen, -errno, "cannot write '%s': %s", tmp, strerror(errno));
      close(fd);
      unlink(tmp);
      goto out;
    }
    off += (size_t)n;
  }
  int e = fsync(fd) < 0 ? errno : 0;
  if (close(fd) < 0 && !e) e = errno;
  if (e) {
    rc = fail(err, errlen, -e, "cannot write '%s': %s", tmp, strerror(e));
    unlink(tmp);
    goto out;
  }
  if (rename(tmp, path) < 0) {
    rc = fail(err, errlen, -errno, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    unlink(tmp);
  }
out:
  free(tmp);
  free(buf);
  return rc;
}
