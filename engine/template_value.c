/* template_value.c — arena, UTF-8 helpers and the template values' Python behaviour:
 * str(), repr(), json.dumps(), ==, <, truthiness (template-impl.h). */
#include <math.h>
#include <stdarg.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "template-impl.h"

/* ---- arena -------------------------------------------------------------------------- */

struct kvl__chunk {
  struct kvl__chunk *next;
  size_t cap;  /* bytes of data[] */
  size_t used; /* bytes handed out, aligned */
  size_t last; /* offset of the most recent allocation, for kvl__arena_grow */
  alignas(16) unsigned char data[];
};

enum { CHUNK_MIN = 64 * 1024 };

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

void *kvl__arena_alloc(struct kvl__arena *a, size_t n) {
  KVL_ASSERT(a);
  if (n > SIZE_MAX / 2) return NULL;
  size_t need = align16(n ? n : 1);
  struct kvl__chunk *c = a->head;
  if (!c || c->cap - c->used < need) {
    size_t cap = need > CHUNK_MIN ? need : CHUNK_MIN;
    size_t bytes = sizeof(*c) + cap;
    if (a->limit && a->total + bytes > a->limit) return NULL;
    c = malloc(bytes);
    if (!c) return NULL;
    c->cap = cap;
    c->used = 0;
    c->last = 0;
    c->next = a->head;
    a->head = c;
    a->total += bytes;
  }
  c->last = c->used;
  c->used += need;
  return c->data + c->last;
}

void *kvl__arena_grow(struct kvl__arena *a, void *p, size_t old, size_t n) {
  struct kvl__chunk *c = a->head;
  if (p && c && (unsigned char *)p == c->data + c->last && n <= SIZE_MAX / 2 &&
      c->cap - c->last >= align16(n ? n : 1)) {
    c->used = c->last + align16(n ? n : 1);
    return p;
  }
  void *q = kvl__arena_alloc(a, n);
  if (q && p && old) memcpy(q, p, old < n ? old : n);
  return q;
}

void kvl__arena_free(struct kvl__arena *a) {
  struct kvl__chunk *c = a->head;
  while (c) {
    struct kvl__chunk *next = c->next;
    free(c);
    c = next;
  }
  a->head = NULL;
  a->total = 0;
}

_Noreturn void kvl__fail(struct kvl__errsink *es, int code, const char *fmt, ...) {
  es->code = code;
  if (es->msg && es->msglen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(es->msg, es->msglen, fmt, ap);
    va_end(ap);
  }
  longjmp(*es->jb, 1);
}

void *kvl__xalloc(struct kvl__arena *a, struct kvl__errsink *es, size_t n) {
  void *p = kvl__arena_alloc(a, n);
  if (!p) kvl__fail(es, KVL_ENOMEM, "template memory limit reached (%zu bytes)", a->limit);
  return p;
}

/* ---- buffers ------------------------------------------------------------------------ */

void kvl__buf_put(struct kvl__buf *b, const char *p, size_t n) {
  if (!n) return;
  if (b->cap - b->n < n) {
    if (n > SIZE_MAX / 4 - b->n) kvl__fail(b->es, KVL_EOVERFLOW, "output too large");
    size_t cap = b->cap ? b->cap : 64;
    while (cap - b->n < n) cap *= 2;
    char *q = kvl__arena_grow(b->a, b->p, b->n, cap);
    if (!q) kvl__fail(b->es, KVL_ENOMEM, "template memory limit reached (%zu bytes)", b->a->limit);
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, p, n);
  b->n += n;
}

void kvl__buf_puts(struct kvl__buf *b, const char *s) { kvl__buf_put(b, s, strlen(s)); }
void kvl__buf_putc(struct kvl__buf *b, char c) { kvl__buf_put(b, &c, 1); }

void kvl__buf_printf(struct kvl__buf *b, const char *fmt, ...) {
  char tmp[128];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
  va_end(ap);
  KVL_ASSERT(n >= 0 && (size_t)n < sizeof(tmp)); /* only used for short numbers */
  kvl__buf_put(b, tmp, (size_t)n);
}

/* ---- UTF-8 -------------------------------------------------------------------------- */

size_t kvl__utf8_dec(const char *s, size_t n, uint32_t *cp) {
  const unsigned char *p = (const unsigned char *)s;
  if (n == 0) { *cp = 0; return 0; }
  unsigned c = p[0];
  size_t len;
  uint32_t v, min;
  if (c < 0x80) { *cp = c; return 1; }
  if ((c & 0xe0) == 0xc0) { len = 2; v = c & 0x1f; min = 0x80; }
  else if ((c & 0xf0) == 0xe0) { len = 3; v = c & 0x0f; min = 0x800; }
  else if ((c & 0xf8) == 0xf0) { len = 4; v = c & 0x07; min = 0x10000; }
  else { *cp = c; return 1; }
  if (len > n) { *cp = c; return 1; }
  for (size_t i = 1; i < len; i++) {
    if ((p[i] & 0xc0) != 0x80) { *cp = c; return 1; }
    v = (v << 6) | (p[i] & 0x3f);
  }
  if (v < min || v > 0x10ffff) { *cp = c; return 1; }
  *cp = v;
  return len;
}

size_t kvl__utf8_enc(uint32_t cp, char out[4]) {
  if (cp < 0x80) { out[0] = (char)cp; return 1; }
  if (cp < 0x800) {
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (char)(0xe0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  out[0] = (char)(0xf0 | (cp >> 18));
  out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  out[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

size_t kvl__utf8_len(const char *p, size_t n) {
  size_t count = 0, i = 0;
  uint32_t cp;
  while (i < n) {
    i += kvl__utf8_dec(p + i, n - i, &cp);
    count++;
  }
  return count;
}

bool kvl__is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Approximation of Python's str.isprintable() for repr(): control, format, separator
 * (other than ' '), surrogate and private-use code points are escaped; unassigned ones
 * are not known here and print as themselves. */
static bool py_printable(uint32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f)) return false;
  if ((c >= 0x205f && c <= 0x206f) || c == 0x3000 || c == 0xfeff) return false;
  if ((c >= 0xd800 && c <= 0xf8ff) || (c >= 0xfff9 && c <= 0xfffb)) return false;
  if (c >= 0xf0000) return false;
  return true;
}

/* ---- Python behaviour --------------------------------------------------------------- */

const char *kvl__type_name(const struct kvl__val *v) {
  switch (v->type) {
    case KVL__V_UNDEF: return "Undefined";
    case KVL__V_NONE: return "NoneType";
    case KVL__V_BOOL: return "bool";
    case KVL__V_INT: return "int";
    case KVL__V_FLOAT: return "float";
    case KVL__V_STR: return "str";
    case KVL__V_LIST: return "list";
    case KVL__V_TUPLE: return "tuple";
    case KVL__V_DICT: return "dict";
    case KVL__V_NS: return "Namespace";
    case KVL__V_FUNC: return "function";
    case KVL__V_LOOP: return "LoopContext";
  }
  return "?";
}

bool kvl__truthy(const struct kvl__val *v) {
  switch (v->type) {
    case KVL__V_UNDEF:
    case KVL__V_NONE: return false;
    case KVL__V_BOOL: return v->b;
    case KVL__V_INT: return v->i != 0;
    case KVL__V_FLOAT: return v->f != 0.0;
    case KVL__V_STR: return v->s.n != 0;
    case KVL__V_LIST:
    case KVL__V_TUPLE: return v->l->n != 0;
    case KVL__V_DICT: return v->d->n != 0;
    default: return true;
  }
}

static bool is_num(const struct kvl__val *v) {
  return v->type == KVL__V_BOOL || v->type == KVL__V_INT || v->type == KVL__V_FLOAT;
}
static long long num_int(const struct kvl__val *v) {
  return v->type == KVL__V_BOOL ? (long long)v->b : v->i;
}

bool kvl__eq(const struct kvl__val *a, const struct kvl__val *b) {
  if (is_num(a) && is_num(b)) {
    if (a->type == KVL__V_FLOAT || b->type == KVL__V_FLOAT) {
      double x = a->type == KVL__V_FLOAT ? a->f : (double)num_int(a);
      double y = b->type == KVL__V_FLOAT ? b->f : (double)num_int(b);
      return x == y;
    }
    return num_int(a) == num_int(b);
  }
  if (a->type != b->type) return false;
  switch (a->type) {
    case KVL__V_UNDEF:
    case KVL__V_NONE: return true;
    case KVL__V_STR: return a->s.n == b->s.n && memcmp(a->s.p, b->s.p, a->s.n) == 0;
    case KVL__V_LIST:
    case KVL__V_TUPLE:
      if (a->l->n != b->l->n) return false;
      for (size_t i = 0; i < a->l->n; i++)
        if (!kvl__eq(&a->l->v[i], &b->l->v[i])) return false;
      return true;
    case KVL__V_DICT:
      if (a->d->n != b->d->n) return false;
      for (size_t i = 0; i < a->d->n; i++) {
        const struct kvl__val *o = kvl__dict_get(b->d, &a->d->k[i]);
        if (!o || !kvl__eq(&a->d->v[i], o)) return false;
      }
      return true;
    case KVL__V_NS: return a->d == b->d;
    case KVL__V_FUNC: return a->fn == b->fn;
    case KVL__V_LOOP: return a->loop == b->loop;
    default: return false;
  }
}

int kvl__cmp(struct kvl__errsink *es, const struct kvl__val *a, const struct kvl__val *b) {
  if (is_num(a) && is_num(b)) {
    if (a->type == KVL__V_FLOAT || b->type == KVL__V_FLOAT) {
      double x = a->type == KVL__V_FLOAT ? a->f : (double)num_int(a);
      double y = b->type == KVL__V_FLOAT ? b->f : (double)num_int(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    long long x = num_int(a), y = num_int(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a->type == KVL__V_STR && b->type == KVL__V_STR) {
    /* UTF-8 byte order is code point order, which is Python's str order */
    size_t n = a->s.n < b->s.n ? a->s.n : b->s.n;
    int r = n ? memcmp(a->s.p, b->s.p, n) : 0;
    if (r) return r < 0 ? -1 : 1;
    return a->s.n < b->s.n ? -1 : a->s.n > b->s.n ? 1 : 0;
  }
  if (a->type == b->type && (a->type == KVL__V_LIST || a->type == KVL__V_TUPLE)) {
    size_t n = a->l->n < b->l->n ? a->l->n : b->l->n;
    for (size_t i = 0; i < n; i++)
      if (!kvl__eq(&a->l->v[i], &b->l->v[i])) return kvl__cmp(es, &a->l->v[i], &b->l->v[i]);
    return a->l->n < b->l->n ? -1 : a->l->n > b->l->n ? 1 : 0;
  }
  if (a->type == KVL__V_UNDEF || b->type == KVL__V_UNDEF) {
    const struct kvl__val *u = a->type == KVL__V_UNDEF ? a : b;
    kvl__fail(es, KVL_EINVAL, "'%.*s' is undefined", (int)u->s.n, u->s.p ? u->s.p : "");
  }
  kvl__fail(es, KVL_EINVAL, "'<' not supported between instances of '%s' and '%s'",
            kvl__type_name(a), kvl__type_name(b));
}

void kvl__put_float(struct kvl__buf *b, double f) {
  if (isnan(f)) { kvl__buf_puts(b, "nan"); return; }
  if (isinf(f)) { kvl__buf_puts(b, f < 0 ? "-inf" : "inf"); return; }
  /* shortest digits that read back to f, as Python's repr */
  char tmp[40];
  int prec;
  for (prec = 0; prec < 17; prec++) {
    snprintf(tmp, sizeof(tmp), "%.*e", prec, f);
    if (strtod(tmp, NULL) == f) break;
  }
  snprintf(tmp, sizeof(tmp), "%.*e", prec, f);
  /* tmp is [-]d[.ddd]e[+-]xx: split into sign, digits, exponent */
  char digits[24];
  size_t nd = 0;
  const char *p = tmp;
  bool neg = *p == '-';
  if (neg) p++;
  for (; *p && *p != 'e'; p++)
    if (*p != '.') digits[nd++] = *p;
  int exp10 = atoi(p + 1);
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  if (neg) kvl__buf_putc(b, '-');
  if (exp10 >= -5 + 1 && exp10 < 16) {
    if (exp10 >= 0) {
      for (int i = 0; i <= exp10; i++) kvl__buf_putc(b, (size_t)i < nd ? digits[i] : '0');
      kvl__buf_putc(b, '.');
      if ((size_t)exp10 + 1 < nd) kvl__buf_put(b, digits + exp10 + 1, nd - (size_t)exp10 - 1);
      else kvl__buf_putc(b, '0');
    } else {
      kvl__buf_puts(b, "0.");
      for (int i = 0; i < -exp10 - 1; i++) kvl__buf_putc(b, '0');
      kvl__buf_put(b, digits, nd);
    }
  } else {
    kvl__buf_putc(b, digits[0]);
    if (nd > 1) {
      kvl__buf_putc(b, '.');
      kvl__buf_put(b, digits + 1, nd - 1);
    }
    kvl__buf_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
  }
}

static void put_repr_str(struct kvl__buf *b, const char *s, size_t n) {
  bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
  char q = has_sq && !has_dq ? '"' : '\'';
  kvl__buf_putc(b, q);
  size_t i = 0;
  while (i < n) {
    uint32_t c;
    size_t len = kvl__utf8_dec(s + i, n - i, &c);
    if (c == (uint32_t)q || c == '\\') {
      kvl__buf_putc(b, '\\');
      kvl__buf_putc(b, (char)c);
    } else if (c == '\n') {
      kvl__buf_puts(b, "\\n");
    } else if (c == '\r') {
      kvl__buf_puts(b, "\\r");
    } else if (c == '\t') {
      kvl__buf_puts(b, "\\t");
    } else if (!py_printable(c)) {
      if (c <= 0xff) kvl__buf_printf(b, "\\x%02x", c);
      else if (c <= 0xffff) kvl__buf_printf(b, "\\u%04x", c);
      else kvl__buf_printf(b, "\\U%08x", c);
    } else {
      kvl__buf_put(b, s + i, len);
    }
    i += len;
  }
  kvl__buf_putc(b, q);
}

static void put_seq(struct kvl__buf *b, const struct kvl__val *v) {
  bool tuple = v->type == KVL__V_TUPLE;
  kvl__buf_putc(b, tuple ? '(' : '[');
  for (size_t i = 0; i < v->l->n; i++) {
    if (i) kvl__buf_puts(b, ", ");
    kvl__put_repr(b, &v->l->v[i]);
  }
  if (tuple && v->l->n == 1) kvl__buf_putc(b, ',');
  kvl__buf_putc(b, tuple ? ')' : ']');
}

static void put_dict(struct kvl__buf *b, const struct kvl__dict *d) {
  kvl__buf_putc(b, '{');
  for (size_t i = 0; i < d->n; i++) {
    if (i) kvl__buf_puts(b, ", ");
    kvl__put_repr(b, &d->k[i]);
    kvl__buf_puts(b, ": ");
    kvl__put_repr(b, &d->v[i]);
  }
  kvl__buf_putc(b, '}');
}

void kvl__put_str(struct kvl__buf *b, const struct kvl__val *v) {
  switch (v->type) {
    case KVL__V_UNDEF: return;
    case KVL__V_STR: kvl__buf_put(b, v->s.p, v->s.n); return;
    default: kvl__put_repr(b, v); return;
  }
}

void kvl__put_repr(struct kvl__buf *b, const struct kvl__val *v) {
  switch (v->type) {
    case KVL__V_UNDEF: kvl__buf_puts(b, "Undefined"); return;
    case KVL__V_NONE: kvl__buf_puts(b, "None"); return;
    case KVL__V_BOOL: kvl__buf_puts(b, v->b ? "True" : "False"); return;
    case KVL__V_INT: kvl__buf_printf(b, "%lld", v->i); return;
    case KVL__V_FLOAT: kvl__put_float(b, v->f); return;
    case KVL__V_STR: put_repr_str(b, v->s.p, v->s.n); return;
    case KVL__V_LIST:
    case KVL__V_TUPLE: put_seq(b, v); return;
    case KVL__V_DICT: put_dict(b, v->d); return;
    case KVL__V_NS:
      kvl__buf_puts(b, "<Namespace ");
      put_dict(b, v->d);
      kvl__buf_putc(b, '>');
      return;
    case KVL__V_FUNC: kvl__buf_puts(b, "<function>"); return;
    case KVL__V_LOOP: kvl__buf_puts(b, "<LoopContext>"); return;
  }
}

/* ---- json.dumps --------------------------------------------------------------------- */

static void put_json_str(struct kvl__buf *b, const char *s, size_t n, bool ascii) {
  kvl__buf_putc(b, '"');
  size_t i = 0;
  while (i < n) {
    uint32_t c;
    size_t len = kvl__utf8_dec(s + i, n - i, &c);
    switch (c) {
      case '"': kvl__buf_puts(b, "\\\""); break;
      case '\\': kvl__buf_puts(b, "\\\\"); break;
      case '\n': kvl__buf_puts(b, "\\n"); break;
      case '\r': kvl__buf_puts(b, "\\r"); break;
      case '\t': kvl__buf_puts(b, "\\t"); break;
      case '\b': kvl__buf_puts(b, "\\b"); break;
      case '\f': kvl__buf_puts(b, "\\f"); break;
      default:
        if (c < 0x20 || (ascii && c >= 0x7f)) {
          if (c > 0xffff) {
            uint32_t v = c - 0x10000;
            kvl__buf_printf(b, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
          } else {
            kvl__buf_printf(b, "\\u%04x", c);
          }
        } else {
          kvl__buf_put(b, s + i, len);
        }
    }
    i += len;
  }
  kvl__buf_putc(b, '"');
}

static void json_newline(struct kvl__buf *b, const struct kvl__json_opts *o, int level) {
  kvl__buf_putc(b, '\n');
  for (int i = 0; i < o->indent * level; i++) kvl__buf_putc(b, ' ');
}

/* The JSON form of a dict key, as json.dumps converts it. */
static struct kvl__val json_key(struct kvl__buf *b, const struct kvl__val *k) {
  struct kvl__buf kb = {.a = b->a, .es = b->es};
  switch (k->type) {
    case KVL__V_STR: return *k;
    case KVL__V_NONE: return kvl__str("null", 4);
    case KVL__V_BOOL: return k->b ? kvl__str("true", 4) : kvl__str("false", 5);
    case KVL__V_INT: kvl__buf_printf(&kb, "%lld", k->i); break;
    case KVL__V_FLOAT:
      if (isnan(k->f)) return kvl__str("NaN", 3);
      if (isinf(k->f)) return k->f < 0 ? kvl__str("-Infinity", 9) : kvl__str("Infinity", 8);
      kvl__put_float(&kb, k->f);
      break;
    default:
      kvl__fail(b->es, KVL_EINVAL, "keys must be str, int, float, bool or None, not %s",
                kvl__type_name(k));
  }
  return kvl__str(kb.p, kb.n);
}

static int json_depth_guard(struct kvl__buf *b, int level) {
  if (level > 512) kvl__fail(b->es, KVL_ERANGE, "tojson: nesting too deep");
  return level;
}

static void put_json(struct kvl__buf *b, const struct kvl__val *v, const struct kvl__json_opts *o,
                     int level) {
  json_depth_guard(b, level);
  const char *isep = o->item_sep, *ksep = o->key_sep;
  size_t isep_n = o->item_sep_n, ksep_n = o->key_sep_n;
  if (!isep) {
    isep = o->indent >= 0 ? "," : ", ";
    isep_n = strlen(isep);
  }
  if (!ksep) {
    ksep = ": ";
    ksep_n = 2;
  }
  switch (v->type) {
    case KVL__V_NONE: kvl__buf_puts(b, "null"); return;
    case KVL__V_BOOL: kvl__buf_puts(b, v->b ? "true" : "false"); return;
    case KVL__V_INT: kvl__buf_printf(b, "%lld", v->i); return;
    case KVL__V_FLOAT:
      if (isnan(v->f)) kvl__buf_puts(b, "NaN");
      else if (isinf(v->f)) kvl__buf_puts(b, v->f < 0 ? "-Infinity" : "Infinity");
      else kvl__put_float(b, v->f);
      return;
    case KVL__V_STR: put_json_str(b, v->s.p, v->s.n, o->ensure_ascii); return;
    case KVL__V_LIST:
    case KVL__V_TUPLE:
      if (v->l->n == 0) { kvl__buf_puts(b, "[]"); return; }
      kvl__buf_putc(b, '[');
      for (size_t i = 0; i < v->l->n; i++) {
        if (i) kvl__buf_put(b, isep, isep_n);
        if (o->indent >= 0) json_newline(b, o, level + 1);
        put_json(b, &v->l->v[i], o, level + 1);
      }
      if (o->indent >= 0) json_newline(b, o, level);
      kvl__buf_putc(b, ']');
      return;
    case KVL__V_DICT: {
      const struct kvl__dict *d = v->d;
      if (d->n == 0) { kvl__buf_puts(b, "{}"); return; }
      size_t *order = kvl__xalloc(b->a, b->es, d->n * sizeof(*order));
      struct kvl__val *keys = kvl__xalloc(b->a, b->es, d->n * sizeof(*keys));
      for (size_t i = 0; i < d->n; i++) {
        order[i] = i;
        keys[i] = json_key(b, &d->k[i]);
      }
      if (o->sort_keys) { /* insertion sort: stable, dicts are small */
        for (size_t i = 1; i < d->n; i++) {
          size_t j = i, cur = order[i];
          while (j > 0 && kvl__cmp(b->es, &keys[order[j - 1]], &keys[cur]) > 0) {
            order[j] = order[j - 1];
            j--;
          }
          order[j] = cur;
        }
      }
      kvl__buf_putc(b, '{');
      for (size_t i = 0; i < d->n; i++) {
        if (i) kvl__buf_put(b, isep, isep_n);
        if (o->indent >= 0) json_newline(b, o, level + 1);
        put_json_str(b, keys[order[i]].s.p, keys[order[i]].s.n, o->ensure_ascii);
        kvl__buf_put(b, ksep, ksep_n);
        put_json(b, &d->v[order[i]], o, level + 1);
      }
      if (o->indent >= 0) json_newline(b, o, level);
      kvl__buf_putc(b, '}');
      return;
    }
    default:
      kvl__fail(b->es, KVL_EINVAL, "Object of type %s is not JSON serializable",
                kvl__type_name(v));
  }
}

void kvl__put_json(struct kvl__buf *b, const struct kvl__val *v, const struct kvl__json_opts *o) {
  put_json(b, v, o, 0);
}

/* ---- dicts -------------------------------------------------------------------------- */

struct kvl__val *kvl__dict_get(const struct kvl__dict *d, const struct kvl__val *key) {
  for (size_t i = 0; i < d->n; i++)
    if (kvl__eq(&d->k[i], key)) return &d->v[i];
  return NULL;
}

struct kvl__val *kvl__dict_get_str(const struct kvl__dict *d, const char *key, size_t n) {
  for (size_t i = 0; i < d->n; i++)
    if (d->k[i].type == KVL__V_STR && d->k[i].s.n == n && memcmp(d->k[i].s.p, key, n) == 0)
      return &d->v[i];
  return NULL;
}

void kvl__dict_set(struct kvl__arena *a, struct kvl__errsink *es, struct kvl__dict *d,
                   struct kvl__val key, struct kvl__val val) {
  struct kvl__val *slot = kvl__dict_get(d, &key);
  if (slot) {
    *slot = val;
    return;
  }
  if (d->n == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : 4;
    struct kvl__val *k = kvl__xalloc(a, es, cap * sizeof(*k));
    struct kvl__val *v = kvl__xalloc(a, es, cap * sizeof(*v));
    if (d->n) {
      memcpy(k, d->k, d->n * sizeof(*k));
      memcpy(v, d->v, d->n * sizeof(*v));
    }
    d->k = k;
    d->v = v;
    d->cap = cap;
  }
  d->k[d->n] = key;
  d->v[d->n] = val;
  d->n++;
}
