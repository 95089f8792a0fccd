/* template.c — the chat-template evaluator: a tree walker over template_parse.c's syntax
 * tree with jinja2's semantics (Undefined, scoping, sandbox getattr/getitem), the
 * filters, tests, string/dict methods and globals HF templates use, and the public API
 * (kvl_template.h). See template-impl.h for memory and error handling. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_error.h"
#include "kvl_template.h"
#include "template-impl.h"

struct kvl_template {
  struct kvl__arena arena; /* tokens, tree, literals */
  struct kvl__node **body;
  size_t nbody;
};

/* ---- evaluator state ----------------------------------------------------------------- */

/* A scope: the template's top level, one for-loop iteration, or one macro call. `set`
 * writes into the innermost; lookups walk outwards. */
struct frame {
  struct frame *parent;
  size_t n, cap;
  const char **names;
  size_t *lens;
  struct kvl__val *vals;
};

enum fkind { F_GLOBAL, F_METHOD, F_MACRO };

struct kvl__func {
  enum fkind kind;
  int id;                       /* GLOBAL: enum global; METHOD: enum method */
  struct kvl__val self;         /* METHOD: the receiver */
  const struct kvl__node *macro;
  struct frame *closure;        /* MACRO: the scope it was defined in */
};

struct kvl__loop {
  size_t index0;
  const struct kvl__list *items; /* what is being iterated (after the loop filter) */
};

struct ctx {
  struct kvl__arena a;
  struct kvl__errsink es;
  jmp_buf jb;
  char msg[512];
  struct kvl__buf *out; /* where output goes (swapped for captures) */
  long steps;
  int calls; /* macro call depth */
};

enum { MAX_CALL_DEPTH = 64, MAX_RANGE = 100000, MAX_JSON_DEPTH = 512 };

static _Noreturn void efail(struct ctx *c, const struct kvl__node *at, int code, const char *fmt,
                            ...) __attribute__((format(printf, 4, 5)));

static _Noreturn void efail(struct ctx *c, const struct kvl__node *at, int code, const char *fmt,
                            ...) {
  char what[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  if (at) kvl__fail(&c->es, code, "template:%d:%d: %s", at->line, at->col, what);
  kvl__fail(&c->es, code, "template: %s", what);
}

static void *alloc(struct ctx *c, size_t n) { return kvl__xalloc(&c->a, &c->es, n); }

static void step(struct ctx *c, const struct kvl__node *at) {
  if (++c->steps > KVL_TEMPLATE_MAX_STEPS)
    efail(c, at, KVL_ERANGE, "template step limit (%ld) reached", KVL_TEMPLATE_MAX_STEPS);
}

static _Noreturn void fail_undef(struct ctx *c, const struct kvl__node *at,
                                 const struct kvl__val *u) {
  if (u->s.p) efail(c, at, KVL_EINVAL, "'%.*s' is undefined", (int)u->s.n, u->s.p);
  efail(c, at, KVL_EINVAL, "undefined value used");
}

static struct kvl__val mklist(struct ctx *c, enum kvl__vtype type, size_t n) {
  struct kvl__list *l = alloc(c, sizeof(*l));
  l->n = n;
  l->v = alloc(c, (n ? n : 1) * sizeof(*l->v));
  return (struct kvl__val){.type = type, .l = l};
}

static struct kvl__val mkdict(struct ctx *c, enum kvl__vtype type) {
  struct kvl__dict *d = alloc(c, sizeof(*d));
  memset(d, 0, sizeof(*d));
  return (struct kvl__val){.type = type, .d = d};
}

static struct kvl__val mkfunc(struct ctx *c, enum fkind kind, int id, struct kvl__val self) {
  struct kvl__func *f = alloc(c, sizeof(*f));
  memset(f, 0, sizeof(*f));
  f->kind = kind;
  f->id = id;
  f->self = self;
  return (struct kvl__val){.type = KVL__V_FUNC, .fn = f};
}

static struct kvl__val copy_str(struct ctx *c, const char *p, size_t n) {
  char *q = alloc(c, n + 1);
  if (n) memcpy(q, p, n);
  q[n] = 0;
  return kvl__str(q, n);
}

/* str(v) as a value (jinja2's soft_str: Undefined gives ""). */
static struct kvl__val to_str(struct ctx *c, const struct kvl__val *v) {
  if (v->type == KVL__V_STR) return *v;
  struct kvl__buf b = {.a = &c->a, .es = &c->es};
  kvl__put_str(&b, v);
  return kvl__str(b.p ? b.p : "", b.n);
}

static bool name_eq(const char *a, size_t an, const char *b) {
  return an == strlen(b) && memcmp(a, b, an) == 0;
}

/* ---- frames -------------------------------------------------------------------------- */

static struct frame *frame_new(struct ctx *c, struct frame *parent) {
  struct frame *f = alloc(c, sizeof(*f));
  memset(f, 0, sizeof(*f));
  f->parent = parent;
  return f;
}

static void frame_set(struct ctx *c, struct frame *f, const char *name, size_t len,
                      struct kvl__val v) {
  for (size_t i = 0; i < f->n; i++)
    if (f->lens[i] == len && memcmp(f->names[i], name, len) == 0) {
      f->vals[i] = v;
      return;
    }
  if (f->n == f->cap) {
    size_t cap = f->cap ? f->cap * 2 : 8;
    const char **names = alloc(c, cap * sizeof(*names));
    size_t *lens = alloc(c, cap * sizeof(*lens));
    struct kvl__val *vals = alloc(c, cap * sizeof(*vals));
    if (f->n) {
      memcpy(names, f->names, f->n * sizeof(*names));
      memcpy(lens, f->lens, f->n * sizeof(*lens));
      memcpy(vals, f->vals, f->n * sizeof(*vals));
    }
    f->names = names;
    f->lens = lens;
    f->vals = vals;
    f->cap = cap;
  }
  f->names[f->n] = name;
  f->lens[f->n] = len;
  f->vals[f->n] = v;
  f->n++;
}

enum global { G_RANGE, G_NAMESPACE, G_RAISE, G_DICT, G_STRFTIME, G_COUNT };
static const char *const global_names[G_COUNT] = {"range", "namespace", "raise_exception",
                                                  "dict", "strftime_now"};

static struct kvl__val lookup(struct ctx *c, struct frame *f, const char *name, size_t len) {
  for (; f; f = f->parent)
    for (size_t i = 0; i < f->n; i++)
      if (f->lens[i] == len && memcmp(f->names[i], name, len) == 0) return f->vals[i];
  for (int g = 0; g < G_COUNT; g++)
    if (name_eq(name, len, global_names[g])) return mkfunc(c, F_GLOBAL, g, kvl__none());
  struct kvl__val u = {.type = KVL__V_UNDEF};
  u.s.p = name;
  u.s.n = len;
  return u;
}

/* ---- strings ------------------------------------------------------------------------- */

/* Byte offsets of the code points of s (count + 1 entries, the last being n). */
static size_t *cp_offsets(struct ctx *c, const char *s, size_t n, size_t *count) {
  size_t cnt = kvl__utf8_len(s, n);
  size_t *off = alloc(c, (cnt + 1) * sizeof(*off));
  size_t i = 0, k = 0;
  uint32_t cp;
  while (i < n) {
    off[k++] = i;
    i += kvl__utf8_dec(s + i, n - i, &cp);
  }
  off[k] = n;
  *count = cnt;
  return off;
}

/* Simple one-to-one case mapping for ASCII, Latin-1, Latin Extended-A, Greek and
 * Cyrillic basic letters (Python maps all of Unicode; other scripts are left unchanged
 * here, as are the context-dependent final sigma and the one-to-many İ / ŉ). ß's upper
 * case "SS" is handled by str_case. */
static bool latin_ext_a_even_upper(uint32_t c) {
  return (c >= 0x100 && c <= 0x12f) || (c >= 0x132 && c <= 0x137) || (c >= 0x14a && c <= 0x177);
}
static bool latin_ext_a_odd_upper(uint32_t c) {
  return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
}
static uint32_t cp_upper(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0xb5) return c;
  if (c == 0xb5) return 0x39c;
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 32;
  if (c == 0xff) return 0x178;
  if (latin_ext_a_even_upper(c)) return c & ~1u;
  if (latin_ext_a_odd_upper(c)) return (c & 1) ? c : c - 1;
  if (c == 0x131) return 'I';
  if (c == 0x17f) return 'S';
  if (c >= 0x3b1 && c <= 0x3cb && c != 0x3c2) return c - 32;
  if (c == 0x3c2) return 0x3a3;
  if (c == 0x3ac) return 0x386;
  if (c >= 0x3ad && c <= 0x3af) return c - 37;
  if (c == 0x3cc) return 0x38c;
  if (c == 0x3cd || c == 0x3ce) return c - 63;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}
static uint32_t cp_lower(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0xc0) return c;
  if (c <= 0xde && c != 0xd7) return c + 32;
  if (c == 0x178) return 0xff;
  if (latin_ext_a_even_upper(c)) return c | 1u;
  if (latin_ext_a_odd_upper(c)) return (c & 1) ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3ab && c != 0x3a2) return c + 32;
  if (c == 0x386) return 0x3ac;
  if (c >= 0x388 && c <= 0x38a) return c + 37;
  if (c == 0x38c) return 0x3cc;
  if (c == 0x38e || c == 0x38f) return c + 63;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}
static bool cp_is_cased(uint32_t c) { return cp_upper(c) != c || cp_lower(c) != c || c == 0xdf; }

enum casemode { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_TITLE_PY, CASE_TITLE_JINJA };

static struct kvl__val str_case(struct ctx *c, struct kvl__val s, enum casemode mode) {
  struct kvl__buf b = {.a = &c->a, .es = &c->es};
  size_t i = 0;
  bool first = true, prev_cased = false;
  char u8[4];
  while (i < s.s.n) {
    uint32_t cp;
    size_t len = kvl__utf8_dec(s.s.p + i, s.s.n - i, &cp);
    bool up;
    switch (mode) {
      case CASE_UPPER: up = true; break;
      case CASE_LOWER: up = false; break;
      case CASE_CAPITALIZE: up = first; break;
      case CASE_TITLE_PY: up = !prev_cased; break;
      default: /* jinja's title: words start after runs of - whitespace ( { [ < */
        up = first;
        break;
    }
    if (up && cp == 0xdf) { /* ß: upper "SS", title case "Ss" */
      kvl__buf_puts(&b, mode == CASE_UPPER || mode == CASE_TITLE_JINJA ? "SS" : "Ss");
    } else {
      uint32_t m = up ? cp_upper(cp) : cp_lower(cp);
      kvl__buf_put(&b, u8, kvl__utf8_enc(m, u8));
    }
    if (mode == CASE_TITLE_JINJA)
      first = kvl__is_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
    else
      first = false;
    prev_cased = cp_is_cased(cp);
    i += len;
  }
  return kvl__str(b.p ? b.p : "", b.n);
}

static bool in_chars(uint32_t cp, const struct kvl__val *chars) {
  if (!chars) return kvl__is_space(cp);
  size_t i = 0;
  while (i < chars->s.n) {
    uint32_t x;
    i += kvl__utf8_dec(chars->s.p + i, chars->s.n - i, &x);
    if (x == cp) return true;
  }
  return false;
}

/* str.strip / lstrip / rstrip with chars (NULL: whitespace). */
static struct kvl__val str_strip(struct ctx *c, struct kvl__val s, const struct kvl__val *chars,
                                 bool left, bool right) {
  size_t cnt, *off = cp_offsets(c, s.s.p, s.s.n, &cnt);
  size_t lo = 0, hi = cnt;
  uint32_t cp;
  while (left && lo < hi && (kvl__utf8_dec(s.s.p + off[lo], s.s.n - off[lo], &cp), in_chars(cp, chars)))
    lo++;
  while (right && hi > lo &&
         (kvl__utf8_dec(s.s.p + off[hi - 1], s.s.n - off[hi - 1], &cp), in_chars(cp, chars)))
    hi--;
  return kvl__str(s.s.p + off[lo], off[hi] - off[lo]);
}

static const char *memmem_(const char *h, size_t hn, const char *n, size_t nn) {
  if (nn == 0) return h;
  if (nn > hn) return NULL;
  for (size_t i = 0; i + nn <= hn; i++)
    if (h[i] == n[0] && memcmp(h + i, n, nn) == 0) return h + i;
  return NULL;
}

static struct kvl__val str_replace(struct ctx *c, struct kvl__val s, struct kvl__val old,
                                   struct kvl__val new, long long count) {
  struct kvl__buf b = {.a = &c->a, .es = &c->es};
  if (old.s.n == 0) { /* Python inserts `new` around every code point */
    size_t cnt, *off = cp_offsets(c, s.s.p, s.s.n, &cnt);
    long long done = 0;
    for (size_t k = 0; k <= cnt; k++) {
      if (count < 0 || done < count) {
        kvl__buf_put(&b, new.s.p, new.s.n);
        done++;
      }
      if (k < cnt) kvl__buf_put(&b, s.s.p + off[k], off[k + 1] - off[k]);
    }
    return kvl__str(b.p ? b.p : "", b.n);
  }
  const char *p = s.s.p, *end = s.s.p + s.s.n;
  long long done = 0;
  while (count < 0 || done < count) {
    const char *hit = memmem_(p, (size_t)(end - p), old.s.p, old.s.n);
    if (!hit) break;
    kvl__buf_put(&b, p, (size_t)(hit - p));
    kvl__buf_put(&b, new.s.p, new.s.n);
    p = hit + old.s.n;
    done++;
  }
  kvl__buf_put(&b, p, (size_t)(end - p));
  return kvl__str(b.p ? b.p : "", b.n);
}

/* A list builder. */
struct lb {
  struct kvl__val *v;
  size_t n, cap;
};
static void lb_push(struct ctx *c, struct lb *l, struct kvl__val v) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 8;
    struct kvl__val *nv = kvl__arena_grow(&c->a, l->v, l->n * sizeof(*nv), cap * sizeof(*nv));
    if (!nv) kvl__fail(&c->es, KVL_ENOMEM, "template memory limit reached");
    l->v = nv;
    l->cap = cap;
  }
  l->v[l->n++] = v;
}
static struct kvl__val lb_done(struct ctx *c, struct lb *l, enum kvl__vtype type) {
  struct kvl__list *li = alloc(c, sizeof(*li));
  li->n = l->n;
  li->v = l->v ? l->v : alloc(c, sizeof(*li->v));
  return (struct kvl__val){.type = type, .l = li};
}

/* str.split(sep, maxsplit) */
static struct kvl__val str_split(struct ctx *c, struct kvl__val s, const struct kvl__val *sep,
                                 long long maxsplit, const struct kvl__node *at) {
  struct lb out = {0};
  const char *p = s.s.p, *end = s.s.p + s.s.n;
  if (!sep) {
    long long splits = 0;
    for (;;) {
      uint32_t cp;
      size_t len;
      while (p < end && (len = kvl__utf8_dec(p, (size_t)(end - p), &cp), kvl__is_space(cp))) p += len;
      if (p >= end) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        lb_push(c, &out, kvl__str(p, (size_t)(end - p)));
        break;
      }
      const char *w = p;
      while (p < end && (len = kvl__utf8_dec(p, (size_t)(end - p), &cp), !kvl__is_space(cp))) p += len;
      lb_push(c, &out, kvl__str(w, (size_t)(p - w)));
      splits++;
    }
    return lb_done(c, &out, KVL__V_LIST);
  }
  if (sep->s.n == 0) efail(c, at, KVL_EINVAL, "empty separator");
  long long splits = 0;
  for (;;) {
    const char *hit = (maxsplit < 0 || splits < maxsplit)
                          ? memmem_(p, (size_t)(end - p), sep->s.p, sep->s.n)
                          : NULL;
    if (!hit) {
      lb_push(c, &out, kvl__str(p, (size_t)(end - p)));
      break;
    }
    lb_push(c, &out, kvl__str(p, (size_t)(hit - p)));
    p = hit + sep->s.n;
    splits++;
  }
  return lb_done(c, &out, KVL__V_LIST);
}

/* ---- iteration, getattr, getitem ------------------------------------------------------ */

/* The items `for x in v` visits (Python iter()): list/tuple items, dict keys, string
 * characters; Undefined is empty. */
static const struct kvl__list *iter_list(struct ctx *c, const struct kvl__val *v,
                                         const struct kvl__node *at) {
  switch (v->type) {
    case KVL__V_LIST:
    case KVL__V_TUPLE: return v->l;
    case KVL__V_DICT: {
      struct kvl__val l = mklist(c, KVL__V_LIST, v->d->n);
      for (size_t i = 0; i < v->d->n; i++) l.l->v[i] = v->d->k[i];
      return l.l;
    }
    case KVL__V_STR: {
      size_t cnt, *off = cp_offsets(c, v->s.p, v->s.n, &cnt);
      struct kvl__val l = mklist(c, KVL__V_LIST, cnt);
      for (size_t i = 0; i < cnt; i++) l.l->v[i] = kvl__str(v->s.p + off[i], off[i + 1] - off[i]);
      return l.l;
    }
    case KVL__V_UNDEF: {
      static struct kvl__list empty = {0, NULL};
      return &empty;
    }
    default: efail(c, at, KVL_EINVAL, "'%s' object is not iterable", kvl__type_name(v));
  }
}

enum method {
  M_STARTSWITH, M_ENDSWITH, M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_UPPER, M_LOWER,
  M_CAPITALIZE, M_TITLE, M_REPLACE, M_FIND, M_COUNT, M_JOIN, M_ISDIGIT, M_ISALPHA, M_ISSPACE,
  M_STR_END,
  M_ITEMS = M_STR_END, M_KEYS, M_VALUES, M_GET, M_DICT_END,
  M_CYCLE = M_DICT_END, M_COUNT_ALL
};
static const char *const method_names[M_COUNT_ALL] = {
    "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "upper", "lower",
    "capitalize", "title", "replace", "find", "count", "join", "isdigit", "isalpha", "isspace",
    "items", "keys", "values", "get", "cycle"};

static int find_method(int from, int to, const char *name, size_t len) {
  for (int m = from; m < to; m++)
    if (name_eq(name, len, method_names[m])) return m;
  return -1;
}

static struct kvl__val loop_attr(struct ctx *c, const struct kvl__val *v, const char *name,
                                 size_t len) {
  const struct kvl__loop *lp = v->loop;
  size_t n = lp->items->n, i = lp->index0;
  if (name_eq(name, len, "index")) return kvl__int((long long)i + 1);
  if (name_eq(name, len, "index0")) return kvl__int((long long)i);
  if (name_eq(name, len, "revindex")) return kvl__int((long long)(n - i));
  if (name_eq(name, len, "revindex0")) return kvl__int((long long)(n - i - 1));
  if (name_eq(name, len, "first")) return kvl__bool(i == 0);
  if (name_eq(name, len, "last")) return kvl__bool(i + 1 == n);
  if (name_eq(name, len, "length")) return kvl__int((long long)n);
  if (name_eq(name, len, "depth")) return kvl__int(1);
  if (name_eq(name, len, "depth0")) return kvl__int(0);
  if (name_eq(name, len, "previtem")) return i ? lp->items->v[i - 1] : kvl__undef("previtem");
  if (name_eq(name, len, "nextitem")) return i + 1 < n ? lp->items->v[i + 1] : kvl__undef("nextitem");
  if (name_eq(name, len, "cycle")) return mkfunc(c, F_METHOD, M_CYCLE, *v);
  struct kvl__val u = {.type = KVL__V_UNDEF};
  u.s.p = name;
  u.s.n = len;
  return u;
}

/* jinja2's sandboxed getattr: a Python attribute (a method) first, then the item. */
static struct kvl__val getattr_(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v,
                                const char *name, size_t len) {
  struct kvl__val u = {.type = KVL__V_UNDEF};
  u.s.p = name;
  u.s.n = len;
  if (len && name[0] == '_') return u; /* private attributes are unsafe in the sandbox */
  int m;
  switch (v->type) {
    case KVL__V_UNDEF: fail_undef(c, at, v);
    case KVL__V_STR:
      m = find_method(0, M_STR_END, name, len);
      return m >= 0 ? mkfunc(c, F_METHOD, m, *v) : u;
    case KVL__V_DICT: {
      m = find_method(M_STR_END, M_DICT_END, name, len);
      if (m >= 0) return mkfunc(c, F_METHOD, m, *v);
      struct kvl__val *x = kvl__dict_get_str(v->d, name, len);
      return x ? *x : u;
    }
    case KVL__V_NS: {
      struct kvl__val *x = kvl__dict_get_str(v->d, name, len);
      return x ? *x : u;
    }
    case KVL__V_LOOP: return loop_attr(c, v, name, len);
    default: return u;
  }
}

/* Python slice index normalisation (PySlice_AdjustIndices). */
static size_t slice_indices(struct ctx *c, const struct kvl__node *at, size_t len,
                            const struct kvl__val *sv, const struct kvl__val *ev,
                            const struct kvl__val *stv, long long *start, long long *step) {
  long long st = 1, s, e, n = (long long)len;
  const struct kvl__val *args[3] = {sv, ev, stv};
  long long got[3] = {0, 0, 0};
  bool have[3] = {false, false, false};
  for (int k = 0; k < 3; k++) {
    if (!args[k] || args[k]->type == KVL__V_NONE) continue;
    if (args[k]->type == KVL__V_INT) got[k] = args[k]->i;
    else if (args[k]->type == KVL__V_BOOL) got[k] = args[k]->b;
    else if (args[k]->type == KVL__V_UNDEF) fail_undef(c, at, args[k]);
    else efail(c, at, KVL_EINVAL, "slice indices must be integers or None");
    have[k] = true;
  }
  if (have[2]) st = got[2];
  if (st == 0) efail(c, at, KVL_EINVAL, "slice step cannot be zero");
  if (!have[0]) s = st < 0 ? n - 1 : 0;
  else {
    s = got[0];
    if (s < 0) { s += n; if (s < 0) s = st < 0 ? -1 : 0; }
    else if (s >= n) s = st < 0 ? n - 1 : n;
  }
  if (!have[1]) e = st < 0 ? -1 : n;
  else {
    e = got[1];
    if (e < 0) { e += n; if (e < 0) e = st < 0 ? -1 : 0; }
    else if (e >= n) e = st < 0 ? n - 1 : n;
  }
  *start = s;
  *step = st;
  if (st < 0) return e < s ? (size_t)((s - e - 1) / (-st) + 1) : 0;
  return s < e ? (size_t)((e - s - 1) / st + 1) : 0;
}

static struct kvl__val do_slice(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v,
                                const struct kvl__val *s, const struct kvl__val *e,
                                const struct kvl__val *st) {
  long long start, stp;
  if (v->type == KVL__V_LIST || v->type == KVL__V_TUPLE) {
    size_t cnt = slice_indices(c, at, v->l->n, s, e, st, &start, &stp);
    struct kvl__val r = mklist(c, v->type, cnt);
    for (size_t k = 0; k < cnt; k++) r.l->v[k] = v->l->v[start + (long long)k * stp];
    return r;
  }
  if (v->type == KVL__V_STR) {
    size_t n, *off = cp_offsets(c, v->s.p, v->s.n, &n);
    size_t cnt = slice_indices(c, at, n, s, e, st, &start, &stp);
    if (stp == 1) return kvl__str(v->s.p + off[start], off[start + (long long)cnt] - off[start]);
    struct kvl__buf b = {.a = &c->a, .es = &c->es};
    for (size_t k = 0; k < cnt; k++) {
      long long i = start + (long long)k * stp;
      kvl__buf_put(&b, v->s.p + off[i], off[i + 1] - off[i]);
    }
    return kvl__str(b.p ? b.p : "", b.n);
  }
  if (v->type == KVL__V_UNDEF) fail_undef(c, at, v);
  return kvl__undef(NULL); /* TypeError is swallowed by the sandbox's getitem */
}

/* jinja2's sandboxed getitem: obj[key], then (for a string key) the attribute. */
static struct kvl__val getitem_(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v,
                                const struct kvl__val *key) {
  if (v->type == KVL__V_UNDEF) fail_undef(c, at, v);
  bool int_key = key->type == KVL__V_INT || key->type == KVL__V_BOOL;
  long long k = key->type == KVL__V_BOOL ? key->b : key->i;
  switch (v->type) {
    case KVL__V_LIST:
    case KVL__V_TUPLE:
      if (int_key) {
        long long n = (long long)v->l->n;
        if (k < 0) k += n;
        if (k >= 0 && k < n) return v->l->v[k];
        return kvl__undef(NULL);
      }
      break;
    case KVL__V_STR:
      if (int_key) {
        size_t n, *off = cp_offsets(c, v->s.p, v->s.n, &n);
        if (k < 0) k += (long long)n;
        if (k >= 0 && k < (long long)n) return kvl__str(v->s.p + off[k], off[k + 1] - off[k]);
        return kvl__undef(NULL);
      }
      break;
    case KVL__V_DICT:
    case KVL__V_NS: {
      struct kvl__val *x = kvl__dict_get(v->d, key);
      if (x) return *x;
      break;
    }
    default: break;
  }
  if (key->type == KVL__V_STR) return getattr_(c, at, v, key->s.p, key->s.n);
  return kvl__undef(NULL);
}

/* `a in b` */
static bool contains(struct ctx *c, const struct kvl__node *at, const struct kvl__val *b,
                     const struct kvl__val *a) {
  switch (b->type) {
    case KVL__V_STR:
      if (a->type == KVL__V_UNDEF) fail_undef(c, at, a);
      if (a->type != KVL__V_STR)
        efail(c, at, KVL_EINVAL, "'in <string>' requires string as left operand, not %s",
              kvl__type_name(a));
      return memmem_(b->s.p, b->s.n, a->s.p, a->s.n) != NULL;
    case KVL__V_LIST:
    case KVL__V_TUPLE:
      for (size_t i = 0; i < b->l->n; i++)
        if (kvl__eq(&b->l->v[i], a)) return true;
      return false;
    case KVL__V_DICT: return kvl__dict_get(b->d, a) != NULL;
    case KVL__V_UNDEF: return false;
    default:
      efail(c, at, KVL_EINVAL, "argument of type '%s' is not iterable", kvl__type_name(b));
  }
}

/* ---- arithmetic ---------------------------------------------------------------------- */

static bool is_num(const struct kvl__val *v) {
  return v->type == KVL__V_BOOL || v->type == KVL__V_INT || v->type == KVL__V_FLOAT;
}
static bool is_intlike(const struct kvl__val *v) {
  return v->type == KVL__V_BOOL || v->type == KVL__V_INT;
}
static long long as_int(const struct kvl__val *v) { return v->type == KVL__V_BOOL ? v->b : v->i; }
static double as_float(const struct kvl__val *v) {
  return v->type == KVL__V_FLOAT ? v->f : (double)as_int(v);
}

static const char *op_text(int op) {
  switch (op) {
    case KVL__OP_ADD: return "+";
    case KVL__OP_SUB: return "-";
    case KVL__OP_MUL: return "*";
    case KVL__OP_DIV: return "/";
    case KVL__OP_FLOORDIV: return "//";
    case KVL__OP_MOD: return "%";
    case KVL__OP_POW: return "**";
    default: return "~";
  }
}

static _Noreturn void bad_operands(struct ctx *c, const struct kvl__node *at, int op,
                                   const struct kvl__val *a, const struct kvl__val *b) {
  if (a->type == KVL__V_UNDEF) fail_undef(c, at, a);
  if (b->type == KVL__V_UNDEF) fail_undef(c, at, b);
  efail(c, at, KVL_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'", op_text(op),
        kvl__type_name(a), kvl__type_name(b));
}

static struct kvl__val repeat(struct ctx *c, const struct kvl__node *at, const struct kvl__val *s,
                              long long times) {
  if (times <= 0) {
    if (s->type == KVL__V_STR) return kvl__str("", 0);
    return mklist(c, s->type, 0);
  }
  size_t unit = s->type == KVL__V_STR ? s->s.n : s->l->n;
  if (unit && (unsigned long long)times > (KVL_TEMPLATE_MAX_RENDER_BYTES / unit))
    efail(c, at, KVL_ERANGE, "repetition too large");
  if (s->type == KVL__V_STR) {
    struct kvl__buf b = {.a = &c->a, .es = &c->es};
    for (long long i = 0; i < times; i++) kvl__buf_put(&b, s->s.p, s->s.n);
    return kvl__str(b.p ? b.p : "", b.n);
  }
  struct kvl__val r = mklist(c, s->type, unit * (size_t)times);
  for (long long i = 0; i < times; i++)
    if (unit) memcpy(r.l->v + (size_t)i * unit, s->l->v, unit * sizeof(*r.l->v));
  return r;
}

/* Python's float floor division and modulo (float_divmod). */
static void float_divmod(double vx, double wx, double *floordiv, double *modv) {
  double mod = fmod(vx, wx);
  double div = (vx - mod) / wx;
  if (mod) {
    if ((wx < 0) != (mod < 0)) {
      mod += wx;
      div -= 1.0;
    }
  } else {
    mod = copysign(0.0, wx);
  }
  double fd;
  if (div) {
    fd = floor(div);
    if (div - fd > 0.5) fd += 1.0;
  } else {
    fd = copysign(0.0, vx / wx);
  }
  *floordiv = fd;
  *modv = mod;
}

static struct kvl__val binop(struct ctx *c, const struct kvl__node *at, int op,
                             const struct kvl__val *a, const struct kvl__val *b) {
  if (op == KVL__OP_TILDE) {
    struct kvl__buf buf = {.a = &c->a, .es = &c->es};
    kvl__put_str(&buf, a);
    kvl__put_str(&buf, b);
    return kvl__str(buf.p ? buf.p : "", buf.n);
  }
  bool nums = is_num(a) && is_num(b), ints = is_intlike(a) && is_intlike(b);
  long long x = ints ? as_int(a) : 0, y = ints ? as_int(b) : 0, r;
  switch (op) {
    case KVL__OP_ADD:
      if (ints) {
        if (__builtin_add_overflow(x, y, &r)) efail(c, at, KVL_ERANGE, "integer overflow");
        return kvl__int(r);
      }
      if (nums) return kvl__float(as_float(a) + as_float(b));
      if (a->type == KVL__V_STR && b->type == KVL__V_STR) {
        char *p = alloc(c, a->s.n + b->s.n + 1);
        memcpy(p, a->s.p, a->s.n);
        memcpy(p + a->s.n, b->s.p, b->s.n);
        p[a->s.n + b->s.n] = 0;
        return kvl__str(p, a->s.n + b->s.n);
      }
      if (a->type == b->type && (a->type == KVL__V_LIST || a->type == KVL__V_TUPLE)) {
        struct kvl__val l = mklist(c, a->type, a->l->n + b->l->n);
        if (a->l->n) memcpy(l.l->v, a->l->v, a->l->n * sizeof(*l.l->v));
        if (b->l->n) memcpy(l.l->v + a->l->n, b->l->v, b->l->n * sizeof(*l.l->v));
        return l;
      }
      break;
    case KVL__OP_SUB:
      if (ints) {
        if (__builtin_sub_overflow(x, y, &r)) efail(c, at, KVL_ERANGE, "integer overflow");
        return kvl__int(r);
      }
      if (nums) return kvl__float(as_float(a) - as_float(b));
      break;
    case KVL__OP_MUL:
      if (ints) {
        if (__builtin_mul_overflow(x, y, &r)) efail(c, at, KVL_ERANGE, "integer overflow");
        return kvl__int(r);
      }
      if (nums) return kvl__float(as_float(a) * as_float(b));
      if ((a->type == KVL__V_STR || a->type == KVL__V_LIST || a->type == KVL__V_TUPLE) && is_intlike(b))
        return repeat(c, at, a, as_int(b));
      if ((b->type == KVL__V_STR || b->type == KVL__V_LIST || b->type == KVL__V_TUPLE) && is_intlike(a))
        return repeat(c, at, b, as_int(a));
      break;
    case KVL__OP_DIV:
      if (nums) {
        if (as_float(b) == 0.0) efail(c, at, KVL_EINVAL, "division by zero");
        return kvl__float(as_float(a) / as_float(b));
      }
      break;
    case KVL__OP_FLOORDIV:
    case KVL__OP_MOD:
      if (ints) {
        if (y == 0) efail(c, at, KVL_EINVAL, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) {
          if (op == KVL__OP_MOD) return kvl__int(0);
          efail(c, at, KVL_ERANGE, "integer overflow");
        }
        long long q = x / y, m = x % y;
        if (m && ((m < 0) != (y < 0))) {
          q--;
          m += y;
        }
        return kvl__int(op == KVL__OP_MOD ? m : q);
      }
      if (nums) {
        double fd, md;
        if (as_float(b) == 0.0) efail(c, at, KVL_EINVAL, "float division by zero");
        float_divmod(as_float(a), as_float(b), &fd, &md);
        return kvl__float(op == KVL__OP_MOD ? md : fd);
      }
      if (op == KVL__OP_MOD && a->type == KVL__V_STR)
        efail(c, at, KVL_EINVAL, "printf-style string formatting ('%%') is not supported");
      break;
    case KVL__OP_POW:
      if (ints && y >= 0) {
        long long acc = 1, base = x;
        for (long long e = y; e; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(acc, base, &acc))
            efail(c, at, KVL_ERANGE, "integer overflow");
          if (e > 1 && __builtin_mul_overflow(base, base, &base))
            efail(c, at, KVL_ERANGE, "integer overflow");
        }
        return kvl__int(acc);
      }
      if (nums) {
        double fx = as_float(a), fy = as_float(b);
        if (fx == 0.0 && fy < 0) efail(c, at, KVL_EINVAL, "0.0 cannot be raised to a negative power");
        if (fx < 0 && fy != floor(fy)) efail(c, at, KVL_EINVAL, "complex results are not supported");
        return kvl__float(pow(fx, fy));
      }
      break;
    default: break;
  }
  bad_operands(c, at, op, a, b);
}

/* ---- arguments ----------------------------------------------------------------------- */

struct args {
  struct kvl__val *pos;
  size_t npos;
  const char **kwn;
  size_t *kwnl;
  struct kvl__val *kwv;
  size_t nkw;
};

static struct kvl__val eval(struct ctx *c, const struct kvl__node *nd, struct frame *f);

static struct args eval_args(struct ctx *c, const struct kvl__node *nd, struct frame *f,
                             size_t skip) {
  struct args a = {0};
  a.npos = nd->nargs > skip ? nd->nargs - skip : 0;
  a.pos = alloc(c, (a.npos ? a.npos : 1) * sizeof(*a.pos));
  for (size_t i = 0; i < a.npos; i++) a.pos[i] = eval(c, nd->args[skip + i], f);
  a.nkw = nd->nkw;
  a.kwn = nd->kwn;
  a.kwnl = nd->kwnl;
  a.kwv = alloc(c, (a.nkw ? a.nkw : 1) * sizeof(*a.kwv));
  for (size_t i = 0; i < a.nkw; i++) a.kwv[i] = eval(c, nd->kwv[i], f);
  return a;
}

/* Bind arguments to the NULL-terminated parameter names; slots[i] is set (have[i] true)
 * for each parameter given. Unknown keywords and surplus positionals are errors. */
static void bind(struct ctx *c, const struct kvl__node *at, const char *what, const struct args *a,
                 const char *const *params, struct kvl__val *slots, bool *have) {
  size_t np = 0;
  while (params[np]) np++;
  for (size_t i = 0; i < np; i++) have[i] = false;
  if (a->npos > np)
    efail(c, at, KVL_EINVAL, "%s takes at most %zu argument(s) (%zu given)", what, np, a->npos);
  for (size_t i = 0; i < a->npos; i++) {
    slots[i] = a->pos[i];
    have[i] = true;
  }
  for (size_t k = 0; k < a->nkw; k++) {
    size_t i;
    for (i = 0; i < np; i++)
      if (name_eq(a->kwn[k], a->kwnl[k], params[i])) break;
    if (i == np)
      efail(c, at, KVL_EINVAL, "%s got an unexpected keyword argument '%.*s'", what,
            (int)a->kwnl[k], a->kwn[k]);
    if (have[i]) efail(c, at, KVL_EINVAL, "%s got multiple values for '%s'", what, params[i]);
    slots[i] = a->kwv[k];
    have[i] = true;
  }
}

static struct kvl__val need_str(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v,
                                const char *what) {
  if (v->type == KVL__V_STR) return *v;
  if (v->type == KVL__V_UNDEF) fail_undef(c, at, v);
  efail(c, at, KVL_EINVAL, "%s must be a string, not %s", what, kvl__type_name(v));
}

static long long need_int(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v,
                          const char *what) {
  if (is_intlike(v)) return as_int(v);
  if (v->type == KVL__V_UNDEF) fail_undef(c, at, v);
  efail(c, at, KVL_EINVAL, "%s must be an integer, not %s", what, kvl__type_name(v));
}

/* ---- tests --------------------------------------------------------------------------- */

enum test {
  T_DEFINED, T_UNDEFINED, T_NONE, T_BOOLEAN, T_FALSE, T_TRUE, T_INTEGER, T_FLOAT, T_NUMBER,
  T_STRING, T_MAPPING, T_ITERABLE, T_SEQUENCE, T_CALLABLE, T_SAMEAS, T_EVEN, T_ODD,
  T_DIVISIBLEBY, T_EQ, T_EQUALTO, T_NE, T_LT, T_LESSTHAN, T_LE, T_GT, T_GREATERTHAN, T_GE,
  T_IN, T_LOWER, T_UPPER, T_ESCAPED, T_FILTER, T_TEST, T_COUNT
};
static const char *const test_names[T_COUNT] = {
    "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number",
    "string", "mapping", "iterable", "sequence", "callable", "sameas", "even", "odd",
    "divisibleby", "eq", "equalto", "ne", "lt", "lessthan", "le", "gt", "greaterthan", "ge",
    "in", "lower", "upper", "escaped", "filter", "test"};

int kvl__test_index(const char *name, size_t n) {
  for (int i = 0; i < T_COUNT; i++)
    if (name_eq(name, n, test_names[i])) return i;
  return -1;
}

static bool str_is_case(struct ctx *c, const struct kvl__val *v, bool upper) {
  (void)c;
  if (v->type != KVL__V_STR) return false;
  bool cased = false;
  size_t i = 0;
  while (i < v->s.n) {
    uint32_t cp;
    i += kvl__utf8_dec(v->s.p + i, v->s.n - i, &cp);
    if (!cp_is_cased(cp)) continue;
    cased = true;
    if (upper ? cp_upper(cp) != cp : cp_lower(cp) != cp) return false;
  }
  return cased;
}

static bool run_test(struct ctx *c, const struct kvl__node *at, int test, const struct kvl__val *v,
                     const struct args *a) {
  static const char *const one[] = {"other", NULL};
  static const char *const none_p[] = {NULL};
  struct kvl__val arg = kvl__none();
  bool have = false;
  bool takes_arg = test == T_SAMEAS || test == T_DIVISIBLEBY || (test >= T_EQ && test <= T_IN);
  bind(c, at, test_names[test], a, takes_arg ? one : none_p, &arg, &have);
  if (takes_arg && !have)
    efail(c, at, KVL_EINVAL, "test '%s' needs an argument", test_names[test]);
  switch (test) {
    case T_DEFINED: return v->type != KVL__V_UNDEF;
    case T_UNDEFINED: return v->type == KVL__V_UNDEF;
    case T_NONE: return v->type == KVL__V_NONE;
    case T_BOOLEAN: return v->type == KVL__V_BOOL;
    case T_FALSE: return v->type == KVL__V_BOOL && !v->b;
    case T_TRUE: return v->type == KVL__V_BOOL && v->b;
    case T_INTEGER: return v->type == KVL__V_INT;
    case T_FLOAT: return v->type == KVL__V_FLOAT;
    case T_NUMBER: return is_num(v);
    case T_STRING: return v->type == KVL__V_STR;
    case T_MAPPING: return v->type == KVL__V_DICT;
    case T_ITERABLE:
    case T_SEQUENCE:
      return v->type == KVL__V_STR || v->type == KVL__V_LIST || v->type == KVL__V_TUPLE ||
             v->type == KVL__V_DICT || v->type == KVL__V_UNDEF;
    case T_CALLABLE: return v->type == KVL__V_FUNC || v->type == KVL__V_LOOP;
    case T_SAMEAS:
      if (v->type != arg.type) return false;
      switch (v->type) {
        case KVL__V_NONE: return true;
        case KVL__V_BOOL: return v->b == arg.b;
        case KVL__V_INT: return v->i == arg.i && v->i >= -5 && v->i <= 256; /* CPython's cache */
        case KVL__V_STR: return v->s.p == arg.s.p && v->s.n == arg.s.n;
        case KVL__V_LIST:
        case KVL__V_TUPLE: return v->l == arg.l;
        case KVL__V_DICT:
        case KVL__V_NS: return v->d == arg.d;
        default: return false;
      }
    case T_EVEN:
    case T_ODD:
    case T_DIVISIBLEBY: {
      struct kvl__val d = test == T_DIVISIBLEBY ? arg : kvl__int(2);
      struct kvl__val m = binop(c, at, KVL__OP_MOD, v, &d);
      struct kvl__val want = kvl__int(test == T_ODD ? 1 : 0);
      return kvl__eq(&m, &want);
    }
    case T_EQ:
    case T_EQUALTO: return kvl__eq(v, &arg);
    case T_NE: return !kvl__eq(v, &arg);
    case T_LT:
    case T_LESSTHAN: return kvl__cmp(&c->es, v, &arg) < 0;
    case T_LE: return kvl__cmp(&c->es, v, &arg) <= 0;
    case T_GT:
    case T_GREATERTHAN: return kvl__cmp(&c->es, v, &arg) > 0;
    case T_GE: return kvl__cmp(&c->es, v, &arg) >= 0;
    case T_IN: return contains(c, at, &arg, v);
    case T_LOWER: return str_is_case(c, v, false);
    case T_UPPER: return str_is_case(c, v, true);
    case T_ESCAPED: return false;
    case T_FILTER: return v->type == KVL__V_STR && kvl__filter_index(v->s.p, v->s.n) >= 0;
    case T_TEST: return v->type == KVL__V_STR && kvl__test_index(v->s.p, v->s.n) >= 0;
  }
  return false;
}

/* ---- filters ------------------------------------------------------------------------- */

enum filter {
  FL_TOJSON, FL_TRIM, FL_LENGTH, FL_COUNT, FL_STRING, FL_UPPER, FL_LOWER, FL_CAPITALIZE,
  FL_TITLE, FL_DEFAULT, FL_D, FL_ITEMS, FL_JOIN, FL_FIRST, FL_LAST, FL_LIST, FL_REVERSE,
  FL_REPLACE, FL_INT, FL_FLOAT, FL_ABS, FL_MAP, FL_SELECT, FL_REJECT, FL_SELECTATTR,
  FL_REJECTATTR, FL_SAFE, FL_SUM, FL_COUNT_ALL
};
static const char *const filter_names[FL_COUNT_ALL] = {
    "tojson", "trim", "length", "count", "string", "upper", "lower", "capitalize", "title",
    "default", "d", "items", "join", "first", "last", "list", "reverse", "replace", "int",
    "float", "abs", "map", "select", "reject", "selectattr", "rejectattr", "safe", "sum"};

int kvl__filter_index(const char *name, size_t n) {
  for (int i = 0; i < FL_COUNT_ALL; i++)
    if (name_eq(name, n, filter_names[i])) return i;
  return -1;
}

static long long length(struct ctx *c, const struct kvl__node *at, const struct kvl__val *v) {
  switch (v->type) {
    case KVL__V_STR: return (long long)kvl__utf8_len(v->s.p, v->s.n);
    case KVL__V_LIST:
    case KVL__V_TUPLE: return (long long)v->l->n;
    case KVL__V_DICT: return (long long)v->d->n;
    case KVL__V_UNDEF: return 0;
    default: efail(c, at, KVL_EINVAL, "object of type '%s' has no len()", kvl__type_name(v));
  }
}

/* attribute lookup used by map/selectattr/join(attribute=): "a.b" and "0" parts */
static struct kvl__val attr_path(struct ctx *c, const struct kvl__node *at, struct kvl__val v,
                                 const struct kvl__val *path) {
  if (is_intlike(path)) return getitem_(c, at, &v, path);
  struct kvl__val p = need_str(c, at, path, "attribute");
  size_t i = 0;
  while (i <= p.s.n) {
    size_t j = i;
    while (j < p.s.n && p.s.p[j] != '.') j++;
    bool digits = j > i;
    for (size_t k = i; k < j; k++)
      if (p.s.p[k] < '0' || p.s.p[k] > '9') digits = false;
    if (digits) {
      struct kvl__val key = kvl__int(strtoll(p.s.p + i, NULL, 10));
      v = getitem_(c, at, &v, &key);
    } else {
      struct kvl__val key = kvl__str(p.s.p + i, j - i);
      v = getitem_(c, at, &v, &key);
    }
    i = j + 1;
  }
  return v;
}

/* Python-like parse of a whole string as a number; false when it is not one. */
static bool parse_num(const struct kvl__val *s, bool want_int, long long *iv, double *fv) {
  char tmp[128];
  size_t k = 0;
  for (size_t i = 0; i < s->s.n && k + 1 < sizeof(tmp); i++)
    if (s->s.p[i] != '_') tmp[k++] = s->s.p[i];
  if (k + 1 >= sizeof(tmp) || k == 0) return false;
  tmp[k] = 0;
  char *end;
  errno = 0;
  if (want_int) {
    *iv = strtoll(tmp, &end, 10);
  } else {
    *fv = strtod(tmp, &end);
  }
  while (*end == ' ' || *end == '\t' || *end == '\n') end++;
  return end != tmp && *end == 0 && errno == 0;
}

static struct kvl__val call_filter(struct ctx *c, const struct kvl__node *at, int id,
                                   struct kvl__val v, struct args *a, struct frame *f);

static struct kvl__val filter(struct ctx *c, const struct kvl__node *at, int id, struct kvl__val v,
                              struct args *a, struct frame *f) {
  struct kvl__val s[4];
  bool h[4];
  const char *what = filter_names[id];
  switch (id) {
    case FL_TOJSON: {
      static const char *const p[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__json_opts o = {.indent = -1};
      o.ensure_ascii = h[0] && kvl__truthy(&s[0]);
      if (h[1] && s[1].type != KVL__V_NONE) {
        o.indent = (int)need_int(c, at, &s[1], "indent");
        if (o.indent < 0) o.indent = 0;
        if (o.indent > 64) efail(c, at, KVL_EINVAL, "indent too large");
      }
      if (h[2] && s[2].type != KVL__V_NONE) {
        if ((s[2].type != KVL__V_LIST && s[2].type != KVL__V_TUPLE) || s[2].l->n != 2)
          efail(c, at, KVL_EINVAL, "separators must be a pair of strings");
        struct kvl__val is = need_str(c, at, &s[2].l->v[0], "separator");
        struct kvl__val ks = need_str(c, at, &s[2].l->v[1], "separator");
        o.item_sep = is.s.p;
        o.item_sep_n = is.s.n;
        o.key_sep = ks.s.p;
        o.key_sep_n = ks.s.n;
      }
      o.sort_keys = h[3] && kvl__truthy(&s[3]);
      if (v.type == KVL__V_UNDEF)
        efail(c, at, KVL_EINVAL, "Object of type Undefined is not JSON serializable");
      struct kvl__buf b = {.a = &c->a, .es = &c->es};
      kvl__put_json(&b, &v, &o);
      return kvl__str(b.p ? b.p : "", b.n);
    }
    case FL_TRIM: {
      static const char *const p[] = {"chars", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__val chars = h[0] && s[0].type != KVL__V_NONE ? need_str(c, at, &s[0], "chars") : s[0];
      return str_strip(c, to_str(c, &v), h[0] && s[0].type != KVL__V_NONE ? &chars : NULL, true, true);
    }
    case FL_LENGTH:
    case FL_COUNT: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      return kvl__int(length(c, at, &v));
    }
    case FL_STRING:
    case FL_SAFE: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      return id == FL_SAFE && v.type != KVL__V_UNDEF ? v : to_str(c, &v);
    }
    case FL_UPPER:
    case FL_LOWER:
    case FL_CAPITALIZE:
    case FL_TITLE: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      enum casemode m = id == FL_UPPER ? CASE_UPPER : id == FL_LOWER ? CASE_LOWER
                        : id == FL_CAPITALIZE ? CASE_CAPITALIZE : CASE_TITLE_JINJA;
      return str_case(c, to_str(c, &v), m);
    }
    case FL_DEFAULT:
    case FL_D: {
      static const char *const p[] = {"default_value", "boolean", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__val dv = h[0] ? s[0] : kvl__str("", 0);
      bool boolean = h[1] && kvl__truthy(&s[1]);
      if (v.type == KVL__V_UNDEF || (boolean && !kvl__truthy(&v))) return dv;
      return v;
    }
    case FL_ITEMS: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      if (v.type == KVL__V_UNDEF) return mklist(c, KVL__V_LIST, 0);
      if (v.type != KVL__V_DICT) efail(c, at, KVL_EINVAL, "Can only get item pairs from a mapping.");
      struct kvl__val l = mklist(c, KVL__V_LIST, v.d->n);
      for (size_t i = 0; i < v.d->n; i++) {
        struct kvl__val t = mklist(c, KVL__V_TUPLE, 2);
        t.l->v[0] = v.d->k[i];
        t.l->v[1] = v.d->v[i];
        l.l->v[i] = t;
      }
      return l;
    }
    case FL_JOIN: {
      static const char *const p[] = {"d", "attribute", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__val sep = h[0] ? to_str(c, &s[0]) : kvl__str("", 0);
      const struct kvl__list *items = iter_list(c, &v, at);
      struct kvl__buf b = {.a = &c->a, .es = &c->es};
      for (size_t i = 0; i < items->n; i++) {
        if (i) kvl__buf_put(&b, sep.s.p, sep.s.n);
        struct kvl__val it = items->v[i];
        if (h[1] && s[1].type != KVL__V_NONE) it = attr_path(c, at, it, &s[1]);
        kvl__put_str(&b, &it);
      }
      return kvl__str(b.p ? b.p : "", b.n);
    }
    case FL_FIRST:
    case FL_LAST: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      const struct kvl__list *items = iter_list(c, &v, at);
      if (!items->n) return kvl__undef(NULL);
      return items->v[id == FL_FIRST ? 0 : items->n - 1];
    }
    case FL_LIST:
    case FL_REVERSE: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      if (id == FL_REVERSE && v.type == KVL__V_STR) {
        struct kvl__val st = kvl__int(-1);
        return do_slice(c, at, &v, NULL, NULL, &st);
      }
      const struct kvl__list *items = iter_list(c, &v, at);
      struct kvl__val l = mklist(c, KVL__V_LIST, items->n);
      for (size_t i = 0; i < items->n; i++)
        l.l->v[i] = items->v[id == FL_LIST ? i : items->n - 1 - i];
      return l;
    }
    case FL_REPLACE: {
      static const char *const p[] = {"old", "new", "count", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0] || !h[1]) efail(c, at, KVL_EINVAL, "replace needs old and new");
      long long count = h[2] && s[2].type != KVL__V_NONE ? need_int(c, at, &s[2], "count") : -1;
      return str_replace(c, to_str(c, &v), to_str(c, &s[0]), to_str(c, &s[1]), count);
    }
    case FL_INT:
    case FL_FLOAT: {
      static const char *const p[] = {"default", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__val dv = h[0] ? s[0] : (id == FL_INT ? kvl__int(0) : kvl__float(0.0));
      long long iv;
      double fv;
      if (id == FL_INT) {
        if (is_intlike(&v)) return kvl__int(as_int(&v));
        if (v.type == KVL__V_FLOAT && isfinite(v.f) && fabs(v.f) < 9.2e18) return kvl__int((long long)v.f);
        if (v.type == KVL__V_STR) {
          if (parse_num(&v, true, &iv, &fv)) return kvl__int(iv);
          if (parse_num(&v, false, &iv, &fv) && isfinite(fv) && fabs(fv) < 9.2e18)
            return kvl__int((long long)fv);
        }
        return dv;
      }
      if (is_num(&v)) return kvl__float(as_float(&v));
      if (v.type == KVL__V_STR && parse_num(&v, false, &iv, &fv)) return kvl__float(fv);
      return dv;
    }
    case FL_ABS: {
      static const char *const p[] = {NULL};
      bind(c, at, what, a, p, s, h);
      if (v.type == KVL__V_FLOAT) return kvl__float(fabs(v.f));
      if (is_intlike(&v)) {
        long long x = as_int(&v);
        if (x == INT64_MIN) efail(c, at, KVL_ERANGE, "integer overflow");
        return kvl__int(x < 0 ? -x : x);
      }
      if (v.type == KVL__V_UNDEF) fail_undef(c, at, &v);
      efail(c, at, KVL_EINVAL, "bad operand type for abs(): '%s'", kvl__type_name(&v));
    }
    case FL_MAP: {
      const struct kvl__list *items = iter_list(c, &v, at);
      struct kvl__val l = mklist(c, KVL__V_LIST, items->n);
      const struct kvl__val *attr = NULL, *dflt = NULL;
      for (size_t k = 0; k < a->nkw; k++) {
        if (name_eq(a->kwn[k], a->kwnl[k], "attribute")) attr = &a->kwv[k];
        else if (name_eq(a->kwn[k], a->kwnl[k], "default")) dflt = &a->kwv[k];
        else efail(c, at, KVL_EINVAL, "map got an unexpected keyword argument");
      }
      if (attr) {
        if (a->npos) efail(c, at, KVL_EINVAL, "map: positional arguments with attribute=");
        for (size_t i = 0; i < items->n; i++) {
          l.l->v[i] = attr_path(c, at, items->v[i], attr);
          if (dflt && l.l->v[i].type == KVL__V_UNDEF) l.l->v[i] = *dflt;
        }
        return l;
      }
      if (!a->npos) efail(c, at, KVL_EINVAL, "map needs a filter name or attribute=");
      struct kvl__val fname = need_str(c, at, &a->pos[0], "filter name");
      int fid = kvl__filter_index(fname.s.p, fname.s.n);
      if (fid < 0) efail(c, at, KVL_EINVAL, "no filter named '%.*s'", (int)fname.s.n, fname.s.p);
      struct args rest = {.pos = a->pos + 1, .npos = a->npos - 1};
      for (size_t i = 0; i < items->n; i++) l.l->v[i] = call_filter(c, at, fid, items->v[i], &rest, f);
      return l;
    }
    case FL_SELECT:
    case FL_REJECT:
    case FL_SELECTATTR:
    case FL_REJECTATTR: {
      bool attr = id == FL_SELECTATTR || id == FL_REJECTATTR;
      bool want = id == FL_SELECT || id == FL_SELECTATTR;
      if (a->nkw) efail(c, at, KVL_EINVAL, "%s takes no keyword arguments", what);
      size_t k = 0;
      struct kvl__val path = kvl__none();
      if (attr) {
        if (!a->npos) efail(c, at, KVL_EINVAL, "%s needs an attribute", what);
        path = a->pos[k++];
      }
      int tid = -1;
      if (k < a->npos) {
        struct kvl__val tn = need_str(c, at, &a->pos[k++], "test name");
        tid = kvl__test_index(tn.s.p, tn.s.n);
        if (tid < 0) efail(c, at, KVL_EINVAL, "no test named '%.*s'", (int)tn.s.n, tn.s.p);
      }
      struct args targs = {.pos = a->pos + k, .npos = a->npos - k};
      const struct kvl__list *items = iter_list(c, &v, at);
      struct lb out = {0};
      for (size_t i = 0; i < items->n; i++) {
        struct kvl__val x = attr ? attr_path(c, at, items->v[i], &path) : items->v[i];
        bool r = tid < 0 ? kvl__truthy(&x) : run_test(c, at, tid, &x, &targs);
        if (r == want) lb_push(c, &out, items->v[i]);
      }
      return lb_done(c, &out, KVL__V_LIST);
    }
    case FL_SUM: {
      static const char *const p[] = {"attribute", "start", NULL};
      bind(c, at, what, a, p, s, h);
      struct kvl__val acc = h[1] ? s[1] : kvl__int(0);
      const struct kvl__list *items = iter_list(c, &v, at);
      for (size_t i = 0; i < items->n; i++) {
        struct kvl__val x = h[0] && s[0].type != KVL__V_NONE ? attr_path(c, at, items->v[i], &s[0])
                                                             : items->v[i];
        acc = binop(c, at, KVL__OP_ADD, &acc, &x);
      }
      return acc;
    }
  }
  efail(c, at, KVL_ENOTSUP, "filter not implemented");
}

static struct kvl__val call_filter(struct ctx *c, const struct kvl__node *at, int id,
                                   struct kvl__val v, struct args *a, struct frame *f) {
  return filter(c, at, id, v, a, f);
}

/* ---- calls --------------------------------------------------------------------------- */

static void exec_body(struct ctx *c, struct kvl__node *const *body, size_t n, struct frame *f,
                      int *ctl);

static struct kvl__val call_macro(struct ctx *c, const struct kvl__node *at,
                                  const struct kvl__func *fn, const struct args *a) {
  const struct kvl__node *m = fn->macro;
  if (c->calls >= MAX_CALL_DEPTH) efail(c, at, KVL_ERANGE, "macro recursion too deep");
  struct frame *f = frame_new(c, fn->closure);
  bool *have = alloc(c, (m->nkw ? m->nkw : 1) * sizeof(*have));
  struct kvl__val *vals = alloc(c, (m->nkw ? m->nkw : 1) * sizeof(*vals));
  for (size_t i = 0; i < m->nkw; i++) have[i] = false;
  if (a->npos > m->nkw)
    efail(c, at, KVL_EINVAL, "macro '%.*s' takes not more than %zu argument(s)", (int)m->namelen,
          m->name, m->nkw);
  for (size_t i = 0; i < a->npos; i++) {
    vals[i] = a->pos[i];
    have[i] = true;
  }
  for (size_t k = 0; k < a->nkw; k++) {
    size_t i;
    for (i = 0; i < m->nkw; i++)
      if (a->kwnl[k] == m->kwnl[i] && memcmp(a->kwn[k], m->kwn[i], a->kwnl[k]) == 0) break;
    if (i == m->nkw || have[i])
      efail(c, at, KVL_EINVAL, "macro '%.*s' got an unexpected or repeated argument '%.*s'",
            (int)m->namelen, m->name, (int)a->kwnl[k], a->kwn[k]);
    vals[i] = a->kwv[k];
    have[i] = true;
  }
  for (size_t i = 0; i < m->nkw; i++) {
    if (!have[i]) {
      if (m->kwv[i]) {
        vals[i] = eval(c, m->kwv[i], f);
      } else {
        vals[i] = (struct kvl__val){.type = KVL__V_UNDEF};
        vals[i].s.p = m->kwn[i];
        vals[i].s.n = m->kwnl[i];
      }
    }
    frame_set(c, f, m->kwn[i], m->kwnl[i], vals[i]);
  }
  struct kvl__buf capture = {.a = &c->a, .es = &c->es};
  struct kvl__buf *saved = c->out;
  c->out = &capture;
  c->calls++;
  int ctl = 0;
  exec_body(c, m->body, m->nbody, f, &ctl);
  c->calls--;
  c->out = saved;
  return kvl__str(capture.p ? capture.p : "", capture.n);
}

static struct kvl__val call_global(struct ctx *c, const struct kvl__node *at, int g,
                                   const struct args *a) {
  switch (g) {
    case G_RANGE: {
      if (a->nkw || a->npos < 1 || a->npos > 3)
        efail(c, at, KVL_EINVAL, "range expects 1 to 3 integer arguments");
      long long start = 0, stop, stp = 1;
      if (a->npos == 1) {
        stop = need_int(c, at, &a->pos[0], "range argument");
      } else {
        start = need_int(c, at, &a->pos[0], "range argument");
        stop = need_int(c, at, &a->pos[1], "range argument");
        if (a->npos == 3) stp = need_int(c, at, &a->pos[2], "range argument");
      }
      if (stp == 0) efail(c, at, KVL_EINVAL, "range() arg 3 must not be zero");
      long double cnt = stp > 0 ? (start < stop ? ((long double)stop - start - 1) / stp + 1 : 0)
                                : (start > stop ? ((long double)start - stop - 1) / -(long double)stp + 1 : 0);
      if (cnt > MAX_RANGE)
        efail(c, at, KVL_ERANGE, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).",
              MAX_RANGE);
      size_t n = (size_t)cnt;
      struct kvl__val l = mklist(c, KVL__V_LIST, n);
      for (size_t i = 0; i < n; i++) l.l->v[i] = kvl__int(start + (long long)i * stp);
      return l;
    }
    case G_NAMESPACE:
    case G_DICT: {
      struct kvl__val d = mkdict(c, g == G_NAMESPACE ? KVL__V_NS : KVL__V_DICT);
      if (a->npos > 1) efail(c, at, KVL_EINVAL, "%s expects at most 1 positional argument", global_names[g]);
      if (a->npos == 1) {
        const struct kvl__val *src = &a->pos[0];
        if (src->type == KVL__V_DICT || src->type == KVL__V_NS) {
          for (size_t i = 0; i < src->d->n; i++) kvl__dict_set(&c->a, &c->es, d.d, src->d->k[i], src->d->v[i]);
        } else {
          const struct kvl__list *items = iter_list(c, src, at);
          for (size_t i = 0; i < items->n; i++) {
            const struct kvl__val *it = &items->v[i];
            if ((it->type != KVL__V_LIST && it->type != KVL__V_TUPLE) || it->l->n != 2)
              efail(c, at, KVL_EINVAL, "%s: sequence elements must be pairs", global_names[g]);
            kvl__dict_set(&c->a, &c->es, d.d, it->l->v[0], it->l->v[1]);
          }
        }
      }
      for (size_t k = 0; k < a->nkw; k++)
        kvl__dict_set(&c->a, &c->es, d.d, kvl__str(a->kwn[k], a->kwnl[k]), a->kwv[k]);
      if (g == G_NAMESPACE)
        for (size_t i = 0; i < d.d->n; i++)
          if (d.d->k[i].type == KVL__V_STR && d.d->k[i].s.n && d.d->k[i].s.p[0] == '_')
            efail(c, at, KVL_EINVAL, "Chat templates cannot store underscore-prefixed attributes on a namespace");
      return d;
    }
    case G_RAISE: {
      struct kvl__val m = a->npos ? to_str(c, &a->pos[0]) : kvl__str("", 0);
      efail(c, at, KVL_EINVAL, "%.*s", (int)(m.s.n > 300 ? 300 : m.s.n), m.s.p);
    }
    case G_STRFTIME: {
      if (a->npos != 1 || a->nkw) efail(c, at, KVL_EINVAL, "strftime_now expects one format string");
      struct kvl__val fmt = need_str(c, at, &a->pos[0], "format");
      char *f0 = alloc(c, fmt.s.n + 1);
      memcpy(f0, fmt.s.p, fmt.s.n);
      f0[fmt.s.n] = 0;
      time_t now = time(NULL);
      struct tm tm;
      localtime_r(&now, &tm);
      char buf[512];
      size_t n = strftime(buf, sizeof(buf), f0, &tm);
      return copy_str(c, buf, n);
    }
  }
  efail(c, at, KVL_EINVAL, "unknown global");
}

static struct kvl__val call_method(struct ctx *c, const struct kvl__node *at, int m,
                                   const struct kvl__val *self, const struct args *a) {
  struct kvl__val s[4];
  bool h[4];
  const char *what = method_names[m];
  static const char *const none_p[] = {NULL};
  switch (m) {
    case M_STARTSWITH:
    case M_ENDSWITH: {
      static const char *const p[] = {"prefix", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0]) efail(c, at, KVL_EINVAL, "%s needs an argument", what);
      const struct kvl__val *cands = &s[0];
      size_t nc = 1;
      if (s[0].type == KVL__V_TUPLE) {
        cands = s[0].l->v;
        nc = s[0].l->n;
      }
      for (size_t i = 0; i < nc; i++) {
        struct kvl__val x = need_str(c, at, &cands[i], what);
        if (x.s.n > self->s.n) continue;
        const char *p0 = m == M_STARTSWITH ? self->s.p : self->s.p + self->s.n - x.s.n;
        if (!x.s.n || memcmp(p0, x.s.p, x.s.n) == 0) return kvl__bool(true);
      }
      return kvl__bool(false);
    }
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
      static const char *const p[] = {"chars", NULL};
      bind(c, at, what, a, p, s, h);
      bool given = h[0] && s[0].type != KVL__V_NONE;
      struct kvl__val chars = given ? need_str(c, at, &s[0], "chars") : s[0];
      return str_strip(c, *self, given ? &chars : NULL, m != M_RSTRIP, m != M_LSTRIP);
    }
    case M_SPLIT: {
      static const char *const p[] = {"sep", "maxsplit", NULL};
      bind(c, at, what, a, p, s, h);
      bool given = h[0] && s[0].type != KVL__V_NONE;
      struct kvl__val sep = given ? need_str(c, at, &s[0], "sep") : s[0];
      long long maxsplit = h[1] ? need_int(c, at, &s[1], "maxsplit") : -1;
      return str_split(c, *self, given ? &sep : NULL, maxsplit, at);
    }
    case M_UPPER:
    case M_LOWER:
    case M_CAPITALIZE:
    case M_TITLE:
      bind(c, at, what, a, none_p, s, h);
      return str_case(c, *self, m == M_UPPER ? CASE_UPPER : m == M_LOWER ? CASE_LOWER
                                : m == M_CAPITALIZE ? CASE_CAPITALIZE : CASE_TITLE_PY);
    case M_REPLACE: {
      static const char *const p[] = {"old", "new", "count", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0] || !h[1]) efail(c, at, KVL_EINVAL, "replace needs old and new");
      return str_replace(c, *self, need_str(c, at, &s[0], "old"), need_str(c, at, &s[1], "new"),
                         h[2] ? need_int(c, at, &s[2], "count") : -1);
    }
    case M_FIND:
    case M_COUNT: {
      static const char *const p[] = {"sub", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0]) efail(c, at, KVL_EINVAL, "%s needs an argument", what);
      struct kvl__val sub = need_str(c, at, &s[0], "sub");
      if (m == M_FIND) {
        const char *hit = memmem_(self->s.p, self->s.n, sub.s.p, sub.s.n);
        return kvl__int(hit ? (long long)kvl__utf8_len(self->s.p, (size_t)(hit - self->s.p)) : -1);
      }
      if (!sub.s.n) return kvl__int((long long)kvl__utf8_len(self->s.p, self->s.n) + 1);
      long long cnt = 0;
      const char *p0 = self->s.p, *end = self->s.p + self->s.n, *hit;
      while ((hit = memmem_(p0, (size_t)(end - p0), sub.s.p, sub.s.n))) {
        cnt++;
        p0 = hit + sub.s.n;
      }
      return kvl__int(cnt);
    }
    case M_JOIN: {
      static const char *const p[] = {"iterable", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0]) efail(c, at, KVL_EINVAL, "join needs an argument");
      const struct kvl__list *items = iter_list(c, &s[0], at);
      struct kvl__buf b = {.a = &c->a, .es = &c->es};
      for (size_t i = 0; i < items->n; i++) {
        if (i) kvl__buf_put(&b, self->s.p, self->s.n);
        struct kvl__val x = need_str(c, at, &items->v[i], "join item");
        kvl__buf_put(&b, x.s.p, x.s.n);
      }
      return kvl__str(b.p ? b.p : "", b.n);
    }
    case M_ISDIGIT:
    case M_ISALPHA:
    case M_ISSPACE: {
      bind(c, at, what, a, none_p, s, h);
      if (!self->s.n) return kvl__bool(false);
      size_t i = 0;
      while (i < self->s.n) {
        uint32_t cp;
        i += kvl__utf8_dec(self->s.p + i, self->s.n - i, &cp);
        bool ok = m == M_ISDIGIT ? (cp >= '0' && cp <= '9')
                  : m == M_ISSPACE ? kvl__is_space(cp)
                                   : ((cp | 32) >= 'a' && (cp | 32) <= 'z') || (cp >= 0xc0 && cp_is_cased(cp));
        if (!ok) return kvl__bool(false);
      }
      return kvl__bool(true);
    }
    case M_ITEMS:
    case M_KEYS:
    case M_VALUES: {
      bind(c, at, what, a, none_p, s, h);
      const struct kvl__dict *d = self->d;
      struct kvl__val l = mklist(c, KVL__V_LIST, d->n);
      for (size_t i = 0; i < d->n; i++) {
        if (m == M_KEYS) {
          l.l->v[i] = d->k[i];
        } else if (m == M_VALUES) {
          l.l->v[i] = d->v[i];
        } else {
          struct kvl__val t = mklist(c, KVL__V_TUPLE, 2);
          t.l->v[0] = d->k[i];
          t.l->v[1] = d->v[i];
          l.l->v[i] = t;
        }
      }
      return l;
    }
    case M_GET: {
      static const char *const p[] = {"key", "default", NULL};
      bind(c, at, what, a, p, s, h);
      if (!h[0]) efail(c, at, KVL_EINVAL, "get needs a key");
      struct kvl__val *x = kvl__dict_get(self->d, &s[0]);
      return x ? *x : h[1] ? s[1] : kvl__none();
    }
    case M_CYCLE: {
      if (!a->npos || a->nkw) efail(c, at, KVL_EINVAL, "no items for cycling given");
      return a->pos[self->loop->index0 % a->npos];
    }
  }
  efail(c, at, KVL_EINVAL, "unknown method");
}

static struct kvl__val call(struct ctx *c, const struct kvl__node *at, const struct kvl__val *fv,
                            const struct args *a) {
  step(c, at);
  if (fv->type == KVL__V_UNDEF) fail_undef(c, at, fv);
  if (fv->type != KVL__V_FUNC)
    efail(c, at, KVL_EINVAL, "'%s' object is not callable", kvl__type_name(fv));
  switch (fv->fn->kind) {
    case F_GLOBAL: return call_global(c, at, fv->fn->id, a);
    case F_METHOD: return call_method(c, at, fv->fn->id, &fv->fn->self, a);
    case F_MACRO: return call_macro(c, at, fv->fn, a);
  }
  efail(c, at, KVL_EINVAL, "bad function");
}

/* ---- expressions --------------------------------------------------------------------- */

static struct kvl__val eval(struct ctx *c, const struct kvl__node *nd, struct frame *f) {
  switch (nd->kind) {
    case KVL__N_LIT: return nd->lit;
    case KVL__N_NAME: return lookup(c, f, nd->name, nd->namelen);
    case KVL__N_GETATTR: {
      struct kvl__val o = eval(c, nd->a, f);
      return getattr_(c, nd, &o, nd->name, nd->namelen);
    }
    case KVL__N_GETITEM: {
      struct kvl__val o = eval(c, nd->a, f);
      struct kvl__val k = eval(c, nd->b, f);
      return getitem_(c, nd, &o, &k);
    }
    case KVL__N_SLICE: {
      struct kvl__val o = eval(c, nd->a, f);
      struct kvl__val s = nd->b ? eval(c, nd->b, f) : kvl__none();
      struct kvl__val e = nd->c ? eval(c, nd->c, f) : kvl__none();
      struct kvl__val st = nd->d ? eval(c, nd->d, f) : kvl__none();
      return do_slice(c, nd, &o, &s, &e, &st);
    }
    case KVL__N_CALL: {
      struct kvl__val fv = eval(c, nd->a, f);
      struct args a = eval_args(c, nd, f, 0);
      return call(c, nd, &fv, &a);
    }
    case KVL__N_FILTER: {
      struct kvl__val v = eval(c, nd->a, f);
      struct args a = eval_args(c, nd, f, 0);
      step(c, nd);
      return filter(c, nd, nd->builtin, v, &a, f);
    }
    case KVL__N_TEST: {
      struct kvl__val v = eval(c, nd->a, f);
      struct args a = eval_args(c, nd, f, 0);
      bool r = run_test(c, nd, nd->builtin, &v, &a);
      return kvl__bool(nd->op ? !r : r);
    }
    case KVL__N_NEG:
    case KVL__N_POS: {
      struct kvl__val v = eval(c, nd->a, f);
      if (v.type == KVL__V_FLOAT) return kvl__float(nd->kind == KVL__N_NEG ? -v.f : v.f);
      if (is_intlike(&v)) {
        long long x = as_int(&v);
        if (nd->kind == KVL__N_POS) return kvl__int(x);
        if (x == INT64_MIN) efail(c, nd, KVL_ERANGE, "integer overflow");
        return kvl__int(-x);
      }
      if (v.type == KVL__V_UNDEF) fail_undef(c, nd, &v);
      efail(c, nd, KVL_EINVAL, "bad operand type for unary %s: '%s'",
            nd->kind == KVL__N_NEG ? "-" : "+", kvl__type_name(&v));
    }
    case KVL__N_NOT: {
      struct kvl__val v = eval(c, nd->a, f);
      return kvl__bool(!kvl__truthy(&v));
    }
    case KVL__N_BINOP: {
      struct kvl__val l = eval(c, nd->a, f);
      struct kvl__val r = eval(c, nd->b, f);
      return binop(c, nd, nd->op, &l, &r);
    }
    case KVL__N_AND: {
      struct kvl__val l = eval(c, nd->a, f);
      return kvl__truthy(&l) ? eval(c, nd->b, f) : l;
    }
    case KVL__N_OR: {
      struct kvl__val l = eval(c, nd->a, f);
      return kvl__truthy(&l) ? l : eval(c, nd->b, f);
    }
    case KVL__N_COMPARE: {
      struct kvl__val l = eval(c, nd->a, f);
      for (size_t i = 0; i < nd->nargs; i++) {
        struct kvl__val r = eval(c, nd->args[i], f);
        bool ok;
        switch (nd->ops[i]) {
          case KVL__C_EQ: ok = kvl__eq(&l, &r); break;
          case KVL__C_NE: ok = !kvl__eq(&l, &r); break;
          case KVL__C_LT: ok = kvl__cmp(&c->es, &l, &r) < 0; break;
          case KVL__C_LE: ok = kvl__cmp(&c->es, &l, &r) <= 0; break;
          case KVL__C_GT: ok = kvl__cmp(&c->es, &l, &r) > 0; break;
          case KVL__C_GE: ok = kvl__cmp(&c->es, &l, &r) >= 0; break;
          case KVL__C_IN: ok = contains(c, nd, &r, &l); break;
          default: ok = !contains(c, nd, &r, &l); break;
        }
        if (!ok) return kvl__bool(false);
        l = r;
      }
      return kvl__bool(true);
    }
    case KVL__N_COND: {
      struct kvl__val t = eval(c, nd->a, f);
      if (kvl__truthy(&t)) return eval(c, nd->b, f);
      return nd->c ? eval(c, nd->c, f) : kvl__undef(NULL);
    }
    case KVL__N_LIST:
    case KVL__N_TUPLE: {
      struct kvl__val l = mklist(c, nd->kind == KVL__N_LIST ? KVL__V_LIST : KVL__V_TUPLE, nd->nargs);
      for (size_t i = 0; i < nd->nargs; i++) l.l->v[i] = eval(c, nd->args[i], f);
      return l;
    }
    case KVL__N_DICT: {
      struct kvl__val d = mkdict(c, KVL__V_DICT);
      for (size_t i = 0; i < nd->nargs; i++) {
        struct kvl__val k = eval(c, nd->args[i], f);
        if (k.type == KVL__V_LIST || k.type == KVL__V_DICT || k.type == KVL__V_NS || k.type == KVL__V_UNDEF)
          efail(c, nd, KVL_EINVAL, "unhashable type: '%s'", kvl__type_name(&k));
        kvl__dict_set(&c->a, &c->es, d.d, k, eval(c, nd->kwv[i], f));
      }
      return d;
    }
    default: break;
  }
  efail(c, nd, KVL_EINVAL, "not an expression");
}

/* ---- statements ---------------------------------------------------------------------- */

enum { CTL_NONE, CTL_BREAK, CTL_CONTINUE };

/* Assign v to the targets of a for/set node (names, or unpacking). */
static void assign(struct ctx *c, const struct kvl__node *nd, struct frame *f, struct kvl__val v) {
  if (!nd->op) {
    frame_set(c, f, nd->args[0]->name, nd->args[0]->namelen, v);
    return;
  }
  const struct kvl__list *items = iter_list(c, &v, nd);
  if (items->n != nd->nargs)
    efail(c, nd, KVL_EINVAL, "%s values to unpack (expected %zu, got %zu)",
          items->n < nd->nargs ? "not enough" : "too many", nd->nargs, items->n);
  for (size_t i = 0; i < nd->nargs; i++)
    frame_set(c, f, nd->args[i]->name, nd->args[i]->namelen, items->v[i]);
}

static void exec_for(struct ctx *c, const struct kvl__node *nd, struct frame *f) {
  struct kvl__val seq = eval(c, nd->a, f);
  const struct kvl__list *items = iter_list(c, &seq, nd);
  /* one scope reused by every iteration (cleared each time), so a long loop does not
   * allocate per iteration */
  struct frame *it = frame_new(c, f);
  if (nd->b) { /* the loop filter: `for x in xs if cond` */
    struct lb kept = {0};
    for (size_t i = 0; i < items->n; i++) {
      step(c, nd);
      it->n = 0;
      assign(c, nd, it, items->v[i]);
      struct kvl__val t = eval(c, nd->b, it);
      if (kvl__truthy(&t)) lb_push(c, &kept, items->v[i]);
    }
    items = lb_done(c, &kept, KVL__V_LIST).l;
  }
  struct kvl__loop *lp = alloc(c, sizeof(*lp));
  lp->items = items;
  for (size_t i = 0; i < items->n; i++) {
    step(c, nd);
    it->n = 0;
    lp->index0 = i;
    assign(c, nd, it, items->v[i]);
    frame_set(c, it, "loop", 4, (struct kvl__val){.type = KVL__V_LOOP, .loop = lp});
    int ctl = CTL_NONE;
    exec_body(c, nd->body, nd->nbody, it, &ctl);
    if (ctl == CTL_BREAK) break;
  }
  if (!items->n && nd->norelse) {
    int ctl = CTL_NONE;
    exec_body(c, nd->orelse, nd->norelse, frame_new(c, f), &ctl);
  }
}

static void exec_set(struct ctx *c, const struct kvl__node *nd, struct frame *f) {
  struct kvl__val v;
  if (nd->a) {
    v = eval(c, nd->a, f);
  } else {
    struct kvl__buf capture = {.a = &c->a, .es = &c->es};
    struct kvl__buf *saved = c->out;
    c->out = &capture;
    int ctl = CTL_NONE;
    exec_body(c, nd->body, nd->nbody, f, &ctl);
    c->out = saved;
    v = kvl__str(capture.p ? capture.p : "", capture.n);
  }
  const struct kvl__node *t = nd->args[0];
  if (t->kind == KVL__N_GETATTR) { /* ns.attr = v */
    struct kvl__val ns = lookup(c, f, t->a->name, t->a->namelen);
    if (ns.type != KVL__V_NS)
      efail(c, nd, KVL_EINVAL, "cannot assign attribute on non-namespace object");
    if (t->namelen && t->name[0] == '_')
      efail(c, nd, KVL_EINVAL, "Chat templates cannot store underscore-prefixed attributes on a namespace");
    kvl__dict_set(&c->a, &c->es, ns.d, kvl__str(t->name, t->namelen), v);
    return;
  }
  assign(c, nd, f, v);
}

static void exec_body(struct ctx *c, struct kvl__node *const *body, size_t n, struct frame *f,
                      int *ctl) {
  for (size_t i = 0; i < n && *ctl == CTL_NONE; i++) {
    const struct kvl__node *nd = body[i];
    step(c, nd);
    switch (nd->kind) {
      case KVL__N_DATA: kvl__buf_put(c->out, nd->name, nd->namelen); break;
      case KVL__N_OUTPUT: {
        struct kvl__val v = eval(c, nd->a, f);
        kvl__put_str(c->out, &v);
        break;
      }
      case KVL__N_IF: {
        struct kvl__val t = eval(c, nd->a, f);
        if (kvl__truthy(&t)) exec_body(c, nd->body, nd->nbody, f, ctl);
        else exec_body(c, nd->orelse, nd->norelse, f, ctl);
        break;
      }
      case KVL__N_FOR: exec_for(c, nd, f); break;
      case KVL__N_SET: exec_set(c, nd, f); break;
      case KVL__N_MACRO: {
        struct kvl__val m = mkfunc(c, F_MACRO, 0, kvl__none());
        m.fn->macro = nd;
        m.fn->closure = f;
        frame_set(c, f, nd->name, nd->namelen, m);
        break;
      }
      case KVL__N_BREAK: *ctl = CTL_BREAK; break;
      case KVL__N_CONTINUE: *ctl = CTL_CONTINUE; break;
      case KVL__N_BLOCK: exec_body(c, nd->body, nd->nbody, f, ctl); break;
      default: efail(c, nd, KVL_EINVAL, "not a statement");
    }
  }
}

/* ---- JSON context -------------------------------------------------------------------- */

static struct kvl__val from_json(struct ctx *c, const json_t *j, int depth) {
  if (depth > MAX_JSON_DEPTH) efail(c, NULL, KVL_EINVAL, "context nested too deeply");
  switch (json_typeof(j)) {
    case JSON_NULL: return kvl__none();
    case JSON_TRUE: return kvl__bool(true);
    case JSON_FALSE: return kvl__bool(false);
    case JSON_INTEGER: return kvl__int((long long)json_integer_value(j));
    case JSON_REAL: return kvl__float(json_real_value(j));
    case JSON_STRING: return kvl__str(json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
      size_t n = json_array_size(j);
      struct kvl__val l = mklist(c, KVL__V_LIST, n);
      for (size_t i = 0; i < n; i++) l.l->v[i] = from_json(c, json_array_get(j, i), depth + 1);
      return l;
    }
    case JSON_OBJECT: {
      struct kvl__val d = mkdict(c, KVL__V_DICT);
      const char *k;
      json_t *v;
      json_object_foreach((json_t *)j, k, v) {
        kvl__dict_set(&c->a, &c->es, d.d, kvl__str(k, strlen(k)), from_json(c, v, depth + 1));
      }
      return d;
    }
  }
  return kvl__none();
}

/* ---- public API ---------------------------------------------------------------------- */

static void set_err(char *err, size_t errlen, const char *msg) {
  if (err && errlen) snprintf(err, errlen, "%s", msg);
}

int kvl_template_parse(const char *src, kvl_template_t **out, char *err, size_t errlen) {
  KVL_ASSERT(src && out);
  *out = NULL;
  /* the jump buffer and message live on the heap, so nothing the parser changes is an
   * automatic variable of this frame when longjmp returns here */
  struct parse_state {
    struct kvl__errsink es;
    jmp_buf jb;
    char msg[512];
  } *ps = calloc(1, sizeof(*ps));
  kvl_template_t *t = calloc(1, sizeof(*t));
  if (!t || !ps) {
    free(t);
    free(ps);
    set_err(err, errlen, "out of memory");
    return KVL_ENOMEM;
  }
  ps->es.jb = &ps->jb;
  ps->es.msg = ps->msg;
  ps->es.msglen = sizeof(ps->msg);
  t->arena.limit = KVL_TEMPLATE_MAX_PARSE_BYTES;
  if (setjmp(ps->jb)) {
    int rc = ps->es.code;
    set_err(err, errlen, ps->msg);
    kvl__arena_free(&t->arena);
    free(t);
    free(ps);
    return rc;
  }
  struct kvl__token *toks;
  size_t ntoks;
  kvl__lex(&t->arena, &ps->es, src, &toks, &ntoks);
  kvl__parse(&t->arena, &ps->es, toks, ntoks, &t->body, &t->nbody);
  free(ps);
  *out = t;
  return 0;
}

int kvl_template_render(const kvl_template_t *t, const json_t *context, char **out, size_t *len,
                        char *err, size_t errlen) {
  KVL_ASSERT(t && out && len);
  *out = NULL;
  *len = 0;
  if (!context || !json_is_object(context)) {
    set_err(err, errlen, "template context must be a JSON object");
    return KVL_EINVAL;
  }
  struct ctx *c = calloc(1, sizeof(*c)); /* heap: nothing longjmp'd over is automatic */
  if (!c) {
    set_err(err, errlen, "out of memory");
    return KVL_ENOMEM;
  }
  c->a.limit = KVL_TEMPLATE_MAX_RENDER_BYTES;
  c->es.jb = &c->jb;
  c->es.msg = c->msg;
  c->es.msglen = sizeof(c->msg);
  if (setjmp(c->jb)) {
    int rc = c->es.code;
    set_err(err, errlen, c->msg);
    kvl__arena_free(&c->a);
    free(c);
    return rc;
  }
  struct frame *root = frame_new(c, NULL);
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)context, k, v) {
    frame_set(c, root, k, strlen(k), from_json(c, v, 0));
  }
  struct kvl__buf *ob = alloc(c, sizeof(*ob));
  memset(ob, 0, sizeof(*ob));
  ob->a = &c->a;
  ob->es = &c->es;
  c->out = ob;
  int ctl = CTL_NONE;
  exec_body(c, t->body, t->nbody, root, &ctl);
  char *res = malloc(ob->n + 1);
  if (!res) kvl__fail(&c->es, KVL_ENOMEM, "out of memory");
  if (ob->n) memcpy(res, ob->p, ob->n);
  res[ob->n] = 0;
  *out = res;
  *len = ob->n;
  kvl__arena_free(&c->a);
  free(c);
  return 0;
}

void kvl_template_free(kvl_template_t *t) {
  if (!t) return;
  kvl__arena_free(&t->arena);
  free(t);
}
