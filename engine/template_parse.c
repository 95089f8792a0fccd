/* template_parse.c — tokens to syntax tree, following jinja2 3.1's grammar and operator
 * precedence (lowest first):
 *
 *   a if b else c  <  or  <  and  <  not  <  comparisons, in, not in (chained)
 *   <  + -  <  ~  <  * / // %  <  ** (left-associative, as jinja2)
 *   <  unary - +  <  primary, then .attr [item] (call), then | filter, is test, (call)
 *
 * so `-x|abs` is `(-x)|abs`, `'a' ~ 'b' is string` is `'a' ~ ('b' is string)` and
 * `1 + 2 ~ 3` is `1 + (2 ~ 3)`, all as in jinja2.
 */
#include <string.h>

#include "kvl_error.h"
#include "template-impl.h"

struct parser {
  struct kvl__arena *a;
  struct kvl__errsink *es;
  const struct kvl__token *t; /* tokens, ending with T_EOF */
  size_t n, i;
  int depth; /* expression / statement nesting, bounded so hostile input cannot overflow
                the C stack */
  int loops; /* for loops around the current statement (inside the innermost macro) */
};

enum { MAX_DEPTH = 200 };

static const struct kvl__token *cur(struct parser *p) { return &p->t[p->i]; }
static const struct kvl__token *peek(struct parser *p, size_t k) {
  return p->i + k < p->n ? &p->t[p->i + k] : &p->t[p->n - 1];
}
static const struct kvl__token *next(struct parser *p) {
  const struct kvl__token *t = &p->t[p->i];
  if (p->i + 1 < p->n) p->i++;
  return t;
}

static const char *describe(const struct kvl__token *t, char *buf, size_t len) {
  switch (t->type) {
    case KVL__T_EOF: return "end of template";
    case KVL__T_DATA: return "template data";
    case KVL__T_VAR_BEGIN: return "'{{'";
    case KVL__T_VAR_END: return "end of print statement '}}'";
    case KVL__T_BLOCK_BEGIN: return "'{%'";
    case KVL__T_BLOCK_END: return "end of statement block '%}'";
    case KVL__T_NAME: snprintf(buf, len, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->p); return buf;
    case KVL__T_STRING: return "string literal";
    case KVL__T_INT: return "integer literal";
    case KVL__T_FLOAT: return "float literal";
    case KVL__T_OP: {
      static const char *texts[] = {"",
#define KVL__OP_TEXT(name, text) text,
                                    KVL__OPS(KVL__OP_TEXT)
#undef KVL__OP_TEXT
      };
      snprintf(buf, len, "'%s'", texts[t->op]);
      return buf;
    }
  }
  return "?";
}

static _Noreturn void fail_code(struct parser *p, int code, const struct kvl__token *t,
                                const char *fmt, const char *arg) {
  char what[256];
  snprintf(what, sizeof(what), fmt, arg);
  kvl__fail(p->es, code, "template:%d:%d: %s", t->line, t->col, what);
}

static _Noreturn void fail_at(struct parser *p, const struct kvl__token *t, const char *fmt,
                              const char *arg) {
  fail_code(p, KVL_EFORMAT, t, fmt, arg);
}

static _Noreturn void unexpected(struct parser *p, const char *expected) {
  char buf[64], msg[200];
  snprintf(msg, sizeof(msg), "unexpected %s, expected %s", describe(cur(p), buf, sizeof(buf)),
           expected);
  fail_at(p, cur(p), "%s", msg);
}

static bool is_op(struct parser *p, enum kvl__op op) {
  return cur(p)->type == KVL__T_OP && cur(p)->op == op;
}
static bool tok_is_name(const struct kvl__token *t, const char *name) {
  return t->type == KVL__T_NAME && t->n == strlen(name) && memcmp(t->p, name, t->n) == 0;
}
static bool is_name(struct parser *p, const char *name) { return tok_is_name(cur(p), name); }

static void expect_op(struct parser *p, enum kvl__op op, const char *text) {
  if (!is_op(p, op)) unexpected(p, text);
  next(p);
}
static void expect_type(struct parser *p, enum kvl__tok type, const char *text) {
  if (cur(p)->type != type) unexpected(p, text);
  next(p);
}
static void expect_name(struct parser *p, const char *name) {
  if (!is_name(p, name)) {
    char e[64];
    snprintf(e, sizeof(e), "'%s'", name);
    unexpected(p, e);
  }
  next(p);
}

static struct kvl__node *mk(struct parser *p, enum kvl__nkind kind, const struct kvl__token *at) {
  struct kvl__node *nd = kvl__xalloc(p->a, p->es, sizeof(*nd));
  memset(nd, 0, sizeof(*nd));
  nd->kind = kind;
  nd->line = at->line;
  nd->col = at->col;
  return nd;
}

/* A growing array of node pointers in the arena. */
struct nodes {
  struct kvl__node **v;
  size_t n, cap;
};
static void push(struct parser *p, struct nodes *l, struct kvl__node *nd) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 4;
    struct kvl__node **v = kvl__arena_grow(p->a, l->v, l->n * sizeof(*v), cap * sizeof(*v));
    if (!v) kvl__fail(p->es, KVL_ENOMEM, "template too large");
    l->v = v;
    l->cap = cap;
  }
  l->v[l->n++] = nd;
}

static void enter(struct parser *p) {
  if (++p->depth > MAX_DEPTH) fail_at(p, cur(p), "%s", "template nested too deeply");
}
static void leave(struct parser *p) { p->depth--; }

static struct kvl__node *parse_expression(struct parser *p, bool with_condexpr);
static struct kvl__node *parse_tuple(struct parser *p, bool with_condexpr, bool explicit_parens,
                                     const char *extra_end);
static struct kvl__node *parse_unary(struct parser *p, bool with_filter);
static struct kvl__node *parse_postfix(struct parser *p, struct kvl__node *nd);

/* (args...) after the '(' has been seen; fills nd's args and keywords. */
static void parse_call_args(struct parser *p, struct kvl__node *nd) {
  struct nodes pos = {0}, kwv = {0};
  const char **kwn = NULL;
  size_t *kwnl = NULL;
  size_t nkw = 0, kwcap = 0;
  expect_op(p, KVL__OP_LPAREN, "'('");
  while (!is_op(p, KVL__OP_RPAREN)) {
    if (pos.n || nkw) {
      expect_op(p, KVL__OP_COMMA, "',' or ')'");
      if (is_op(p, KVL__OP_RPAREN)) break;
    }
    if (is_op(p, KVL__OP_MUL) || is_op(p, KVL__OP_POW))
      fail_at(p, cur(p), "%s", "*args and **kwargs in calls are not supported");
    if (cur(p)->type == KVL__T_NAME && peek(p, 1)->type == KVL__T_OP &&
        peek(p, 1)->op == KVL__OP_ASSIGN) {
      const struct kvl__token *name = next(p);
      next(p);
      if (nkw == kwcap) {
        size_t cap = kwcap ? kwcap * 2 : 4;
        kwn = kvl__arena_grow(p->a, kwn, nkw * sizeof(*kwn), cap * sizeof(*kwn));
        kwnl = kvl__arena_grow(p->a, kwnl, nkw * sizeof(*kwnl), cap * sizeof(*kwnl));
        if (!kwn || !kwnl) kvl__fail(p->es, KVL_ENOMEM, "template too large");
        kwcap = cap;
      }
      kwn[nkw] = name->p;
      kwnl[nkw] = name->n;
      nkw++;
      push(p, &kwv, parse_expression(p, true));
    } else {
      if (nkw) fail_at(p, cur(p), "%s", "positional argument after keyword argument");
      push(p, &pos, parse_expression(p, true));
    }
  }
  next(p);
  nd->args = pos.v;
  nd->nargs = pos.n;
  nd->kwn = kwn;
  nd->kwnl = kwnl;
  nd->kwv = kwv.v;
  nd->nkw = nkw;
}

static struct kvl__node *lit(struct parser *p, const struct kvl__token *at, struct kvl__val v) {
  struct kvl__node *nd = mk(p, KVL__N_LIT, at);
  nd->lit = v;
  return nd;
}

static struct kvl__node *parse_primary(struct parser *p) {
  const struct kvl__token *t = cur(p);
  struct kvl__node *nd;
  enter(p);
  switch (t->type) {
    case KVL__T_NAME:
      next(p);
      if (tok_is_name(t, "true") || tok_is_name(t, "True")) nd = lit(p, t, kvl__bool(true));
      else if (tok_is_name(t, "false") || tok_is_name(t, "False")) nd = lit(p, t, kvl__bool(false));
      else if (tok_is_name(t, "none") || tok_is_name(t, "None")) nd = lit(p, t, kvl__none());
      else {
        nd = mk(p, KVL__N_NAME, t);
        nd->name = t->p;
        nd->namelen = t->n;
      }
      break;
    case KVL__T_STRING: {
      next(p);
      if (cur(p)->type != KVL__T_STRING) {
        nd = lit(p, t, kvl__str(t->p, t->n));
        break;
      }
      struct kvl__buf b = {.a = p->a, .es = p->es}; /* adjacent literals concatenate */
      kvl__buf_put(&b, t->p, t->n);
      while (cur(p)->type == KVL__T_STRING) {
        kvl__buf_put(&b, cur(p)->p, cur(p)->n);
        next(p);
      }
      nd = lit(p, t, kvl__str(b.p ? b.p : "", b.n));
      break;
    }
    case KVL__T_INT: next(p); nd = lit(p, t, kvl__int(t->i)); break;
    case KVL__T_FLOAT: next(p); nd = lit(p, t, kvl__float(t->f)); break;
    case KVL__T_OP:
      if (t->op == KVL__OP_LPAREN) {
        next(p);
        nd = parse_tuple(p, true, true, NULL);
        expect_op(p, KVL__OP_RPAREN, "')'");
        break;
      }
      if (t->op == KVL__OP_LBRACKET) {
        struct nodes items = {0};
        next(p);
        while (!is_op(p, KVL__OP_RBRACKET)) {
          if (items.n) {
            expect_op(p, KVL__OP_COMMA, "',' or ']'");
            if (is_op(p, KVL__OP_RBRACKET)) break;
          }
          push(p, &items, parse_expression(p, true));
        }
        next(p);
        nd = mk(p, KVL__N_LIST, t);
        nd->args = items.v;
        nd->nargs = items.n;
        break;
      }
      if (t->op == KVL__OP_LBRACE) {
        struct nodes keys = {0}, vals = {0};
        next(p);
        while (!is_op(p, KVL__OP_RBRACE)) {
          if (keys.n) {
            expect_op(p, KVL__OP_COMMA, "',' or '}'");
            if (is_op(p, KVL__OP_RBRACE)) break;
          }
          push(p, &keys, parse_expression(p, true));
          expect_op(p, KVL__OP_COLON, "':'");
          push(p, &vals, parse_expression(p, true));
        }
        next(p);
        nd = mk(p, KVL__N_DICT, t);
        nd->args = keys.v;
        nd->nargs = keys.n;
        nd->kwv = vals.v;
        nd->nkw = vals.n;
        break;
      }
      /* fall through */
    default: unexpected(p, "an expression");
  }
  leave(p);
  return nd;
}

/* One subscript inside [ ]: an expression or a slice start:stop:step. */
static struct kvl__node *parse_subscribed(struct parser *p) {
  const struct kvl__token *at = cur(p);
  struct kvl__node *start = NULL;
  if (!is_op(p, KVL__OP_COLON)) {
    start = parse_expression(p, true);
    if (!is_op(p, KVL__OP_COLON)) return start;
  }
  next(p); /* the first ':' */
  struct kvl__node *sl = mk(p, KVL__N_SLICE, at);
  sl->b = start;
  if (!is_op(p, KVL__OP_COLON) && !is_op(p, KVL__OP_RBRACKET) && !is_op(p, KVL__OP_COMMA))
    sl->c = parse_expression(p, true);
  if (is_op(p, KVL__OP_COLON)) {
    next(p);
    if (!is_op(p, KVL__OP_RBRACKET) && !is_op(p, KVL__OP_COMMA)) sl->d = parse_expression(p, true);
  }
  return sl;
}

static struct kvl__node *parse_postfix(struct parser *p, struct kvl__node *nd) {
  for (;;) {
    const struct kvl__token *t = cur(p);
    if (is_op(p, KVL__OP_DOT)) {
      next(p);
      const struct kvl__token *a = cur(p);
      if (a->type == KVL__T_NAME) {
        next(p);
        struct kvl__node *g = mk(p, KVL__N_GETATTR, t);
        g->a = nd;
        g->name = a->p;
        g->namelen = a->n;
        nd = g;
      } else if (a->type == KVL__T_INT) {
        next(p);
        struct kvl__node *g = mk(p, KVL__N_GETITEM, t);
        g->a = nd;
        g->b = lit(p, a, kvl__int(a->i));
        nd = g;
      } else {
        unexpected(p, "an attribute name");
      }
    } else if (is_op(p, KVL__OP_LBRACKET)) {
      next(p);
      struct nodes subs = {0};
      while (!is_op(p, KVL__OP_RBRACKET)) {
        if (subs.n) expect_op(p, KVL__OP_COMMA, "',' or ']'");
        if (is_op(p, KVL__OP_RBRACKET)) break;
        push(p, &subs, parse_subscribed(p));
      }
      next(p);
      if (subs.n == 0) fail_at(p, t, "%s", "empty subscript");
      if (subs.n == 1 && subs.v[0]->kind == KVL__N_SLICE) {
        subs.v[0]->a = nd;
        nd = subs.v[0];
      } else {
        struct kvl__node *g = mk(p, KVL__N_GETITEM, t);
        g->a = nd;
        if (subs.n == 1) {
          g->b = subs.v[0];
        } else {
          for (size_t k = 0; k < subs.n; k++)
            if (subs.v[k]->kind == KVL__N_SLICE)
              fail_at(p, t, "%s", "slices inside a tuple subscript are not supported");
          g->b = mk(p, KVL__N_TUPLE, t);
          g->b->args = subs.v;
          g->b->nargs = subs.n;
        }
        nd = g;
      }
    } else if (is_op(p, KVL__OP_LPAREN)) {
      struct kvl__node *c = mk(p, KVL__N_CALL, t);
      c->line = nd->line; /* a failing call reports where the callee starts */
      c->col = nd->col;
      c->a = nd;
      parse_call_args(p, c);
      nd = c;
    } else {
      return nd;
    }
  }
}

/* name or name.name..., for filters and tests. */
static void dotted_name(struct parser *p, const char **name, size_t *len) {
  const struct kvl__token *t = cur(p);
  if (t->type != KVL__T_NAME) unexpected(p, "a name");
  next(p);
  const char *start = t->p;
  const char *end = t->p + t->n;
  while (is_op(p, KVL__OP_DOT) && peek(p, 1)->type == KVL__T_NAME) {
    next(p);
    end = cur(p)->p + cur(p)->n;
    next(p);
  }
  *name = start;
  *len = (size_t)(end - start);
}

static struct kvl__node *parse_filter_expr(struct parser *p, struct kvl__node *nd) {
  for (;;) {
    const struct kvl__token *t = cur(p);
    if (is_op(p, KVL__OP_PIPE)) {
      next(p);
      const struct kvl__token *nt = cur(p);
      struct kvl__node *f = mk(p, KVL__N_FILTER, nt);
      dotted_name(p, &f->name, &f->namelen);
      f->builtin = kvl__filter_index(f->name, f->namelen);
      if (f->builtin < 0) {
        char nm[64];
        snprintf(nm, sizeof(nm), "%.*s", (int)(f->namelen > 40 ? 40 : f->namelen), f->name);
        fail_code(p, KVL_ENOTSUP, nt, "no filter named '%s'", nm);
      }
      f->a = nd;
      if (is_op(p, KVL__OP_LPAREN)) parse_call_args(p, f);
      nd = f;
    } else if (is_name(p, "is")) {
      next(p);
      struct kvl__node *te = mk(p, KVL__N_TEST, t);
      if (is_name(p, "not")) {
        next(p);
        te->op = 1;
      }
      const struct kvl__token *nt = cur(p);
      dotted_name(p, &te->name, &te->namelen);
      te->builtin = kvl__test_index(te->name, te->namelen);
      if (te->builtin < 0) {
        char nm[64];
        snprintf(nm, sizeof(nm), "%.*s", (int)(te->namelen > 40 ? 40 : te->namelen), te->name);
        fail_code(p, KVL_ENOTSUP, nt, "no test named '%s'", nm);
      }
      te->a = nd;
      const struct kvl__token *c = cur(p);
      if (is_op(p, KVL__OP_LPAREN)) {
        parse_call_args(p, te);
      } else if ((c->type == KVL__T_NAME || c->type == KVL__T_STRING || c->type == KVL__T_INT ||
                  c->type == KVL__T_FLOAT ||
                  (c->type == KVL__T_OP && (c->op == KVL__OP_LPAREN || c->op == KVL__OP_LBRACKET ||
                                            c->op == KVL__OP_LBRACE))) &&
                 !is_name(p, "else") && !is_name(p, "or") && !is_name(p, "and")) {
        if (is_name(p, "is")) fail_at(p, c, "%s", "you cannot chain multiple tests with is");
        struct kvl__node *arg = parse_postfix(p, parse_primary(p));
        te->args = kvl__xalloc(p->a, p->es, sizeof(*te->args));
        te->args[0] = arg;
        te->nargs = 1;
      }
      nd = te;
    } else if (is_op(p, KVL__OP_LPAREN)) {
      struct kvl__node *c = mk(p, KVL__N_CALL, t);
      c->line = nd->line; /* a failing call reports where the callee starts */
      c->col = nd->col;
      c->a = nd;
      parse_call_args(p, c);
      nd = c;
    } else {
      return nd;
    }
  }
}

static struct kvl__node *parse_unary(struct parser *p, bool with_filter) {
  const struct kvl__token *t = cur(p);
  struct kvl__node *nd;
  enter(p);
  if (is_op(p, KVL__OP_SUB) || is_op(p, KVL__OP_ADD)) {
    next(p);
    nd = mk(p, t->op == KVL__OP_SUB ? KVL__N_NEG : KVL__N_POS, t);
    nd->a = parse_unary(p, false);
  } else {
    nd = parse_primary(p);
  }
  nd = parse_postfix(p, nd);
  if (with_filter) nd = parse_filter_expr(p, nd);
  leave(p);
  return nd;
}

static struct kvl__node *binop(struct parser *p, const struct kvl__token *at, int op,
                               struct kvl__node *l, struct kvl__node *r) {
  struct kvl__node *nd = mk(p, KVL__N_BINOP, at);
  nd->op = op;
  nd->a = l;
  nd->b = r;
  return nd;
}

static struct kvl__node *parse_pow(struct parser *p) {
  struct kvl__node *l = parse_unary(p, true);
  while (is_op(p, KVL__OP_POW)) {
    const struct kvl__token *t = next(p);
    l = binop(p, t, KVL__OP_POW, l, parse_unary(p, true));
  }
  return l;
}

static struct kvl__node *parse_math2(struct parser *p) {
  struct kvl__node *l = parse_pow(p);
  while (is_op(p, KVL__OP_MUL) || is_op(p, KVL__OP_DIV) || is_op(p, KVL__OP_FLOORDIV) ||
         is_op(p, KVL__OP_MOD)) {
    const struct kvl__token *t = next(p);
    l = binop(p, t, t->op, l, parse_pow(p));
  }
  return l;
}

static struct kvl__node *parse_concat(struct parser *p) {
  struct kvl__node *l = parse_math2(p);
  while (is_op(p, KVL__OP_TILDE)) {
    const struct kvl__token *t = next(p);
    l = binop(p, t, KVL__OP_TILDE, l, parse_math2(p));
  }
  return l;
}

static struct kvl__node *parse_math1(struct parser *p) {
  struct kvl__node *l = parse_concat(p);
  while (is_op(p, KVL__OP_ADD) || is_op(p, KVL__OP_SUB)) {
    const struct kvl__token *t = next(p);
    l = binop(p, t, t->op, l, parse_concat(p));
  }
  return l;
}

static struct kvl__node *parse_compare(struct parser *p) {
  const struct kvl__token *at = cur(p);
  struct kvl__node *first = parse_math1(p);
  struct nodes rhs = {0};
  int *ops = NULL;
  size_t cap = 0;
  for (;;) {
    int op;
    const struct kvl__token *t = cur(p);
    if (t->type == KVL__T_OP && t->op == KVL__OP_EQ) op = KVL__C_EQ;
    else if (t->type == KVL__T_OP && t->op == KVL__OP_NE) op = KVL__C_NE;
    else if (t->type == KVL__T_OP && t->op == KVL__OP_LT) op = KVL__C_LT;
    else if (t->type == KVL__T_OP && t->op == KVL__OP_LE) op = KVL__C_LE;
    else if (t->type == KVL__T_OP && t->op == KVL__OP_GT) op = KVL__C_GT;
    else if (t->type == KVL__T_OP && t->op == KVL__OP_GE) op = KVL__C_GE;
    else if (tok_is_name(t, "in")) op = KVL__C_IN;
    else if (tok_is_name(t, "not") && tok_is_name(peek(p, 1), "in")) op = KVL__C_NOTIN;
    else break;
    next(p);
    if (op == KVL__C_NOTIN) next(p);
    if (rhs.n == cap) {
      cap = cap ? cap * 2 : 4;
      ops = kvl__arena_grow(p->a, ops, rhs.n * sizeof(*ops), cap * sizeof(*ops));
      if (!ops) kvl__fail(p->es, KVL_ENOMEM, "template too large");
    }
    ops[rhs.n] = op;
    push(p, &rhs, parse_math1(p));
  }
  if (!rhs.n) return first;
  struct kvl__node *nd = mk(p, KVL__N_COMPARE, at);
  nd->a = first;
  nd->args = rhs.v;
  nd->nargs = rhs.n;
  nd->ops = ops;
  return nd;
}

static struct kvl__node *parse_not(struct parser *p) {
  if (is_name(p, "not")) {
    const struct kvl__token *t = next(p);
    enter(p);
    struct kvl__node *nd = mk(p, KVL__N_NOT, t);
    nd->a = parse_not(p);
    leave(p);
    return nd;
  }
  return parse_compare(p);
}

static struct kvl__node *parse_and(struct parser *p) {
  struct kvl__node *l = parse_not(p);
  while (is_name(p, "and")) {
    const struct kvl__token *t = next(p);
    struct kvl__node *nd = mk(p, KVL__N_AND, t);
    nd->a = l;
    nd->b = parse_not(p);
    l = nd;
  }
  return l;
}

static struct kvl__node *parse_or(struct parser *p) {
  struct kvl__node *l = parse_and(p);
  while (is_name(p, "or")) {
    const struct kvl__token *t = next(p);
    struct kvl__node *nd = mk(p, KVL__N_OR, t);
    nd->a = l;
    nd->b = parse_and(p);
    l = nd;
  }
  return l;
}

static struct kvl__node *parse_condexpr(struct parser *p) {
  struct kvl__node *e1 = parse_or(p);
  while (is_name(p, "if")) {
    const struct kvl__token *t = next(p);
    struct kvl__node *nd = mk(p, KVL__N_COND, t);
    nd->b = e1;
    nd->a = parse_or(p);
    if (is_name(p, "else")) {
      next(p);
      enter(p);
      nd->c = parse_condexpr(p);
      leave(p);
    }
    e1 = nd;
  }
  return e1;
}

static struct kvl__node *parse_expression(struct parser *p, bool with_condexpr) {
  enter(p);
  struct kvl__node *nd = with_condexpr ? parse_condexpr(p) : parse_or(p);
  leave(p);
  return nd;
}

static bool is_tuple_end(struct parser *p, const char *extra_end) {
  const struct kvl__token *t = cur(p);
  if (t->type == KVL__T_VAR_END || t->type == KVL__T_BLOCK_END) return true;
  if (t->type == KVL__T_OP && t->op == KVL__OP_RPAREN) return true;
  return extra_end && tok_is_name(t, extra_end);
}

static struct kvl__node *parse_tuple(struct parser *p, bool with_condexpr, bool explicit_parens,
                                     const char *extra_end) {
  const struct kvl__token *at = cur(p);
  struct nodes items = {0};
  bool is_tuple = false;
  for (;;) {
    if (items.n) expect_op(p, KVL__OP_COMMA, "','");
    if (is_tuple_end(p, extra_end)) break;
    push(p, &items, parse_expression(p, with_condexpr));
    if (is_op(p, KVL__OP_COMMA)) is_tuple = true;
    else break;
  }
  if (!is_tuple) {
    if (items.n) return items.v[0];
    if (!explicit_parens) unexpected(p, "an expression");
  }
  struct kvl__node *nd = mk(p, KVL__N_TUPLE, at);
  nd->args = items.v;
  nd->nargs = items.n;
  return nd;
}

/* ---- statements --------------------------------------------------------------------- */

/* Parse statements until a {% NAME where NAME is one of `ends` (NULL-terminated); the
 * cursor is left on that NAME. With ends == NULL, until the end of the template. */
static void subparse(struct parser *p, const char *const *ends, struct nodes *out);

static bool is_one_of(const struct kvl__token *t, const char *const *names) {
  for (; names && *names; names++)
    if (tok_is_name(t, *names)) return true;
  return false;
}

/* Assignment target: name, (name, name...) or, when with_namespace, name.attr. */
static void parse_target(struct parser *p, bool with_namespace, struct kvl__node *stmt) {
  struct nodes names = {0};
  bool paren = false;
  if (with_namespace && cur(p)->type == KVL__T_NAME && peek(p, 1)->type == KVL__T_OP &&
      peek(p, 1)->op == KVL__OP_DOT && peek(p, 2)->type == KVL__T_NAME) {
    const struct kvl__token *ns = next(p);
    next(p);
    const struct kvl__token *attr = next(p);
    struct kvl__node *g = mk(p, KVL__N_GETATTR, ns);
    g->a = mk(p, KVL__N_NAME, ns);
    g->a->name = ns->p;
    g->a->namelen = ns->n;
    g->name = attr->p;
    g->namelen = attr->n;
    push(p, &names, g);
    stmt->args = names.v;
    stmt->nargs = 1;
    return;
  }
  if (is_op(p, KVL__OP_LPAREN)) {
    paren = true;
    next(p);
  }
  for (;;) {
    const struct kvl__token *t = cur(p);
    if (t->type != KVL__T_NAME || tok_is_name(t, "true") || tok_is_name(t, "false") ||
        tok_is_name(t, "none") || tok_is_name(t, "True") || tok_is_name(t, "False") ||
        tok_is_name(t, "None"))
      unexpected(p, "a variable name to assign to");
    next(p);
    struct kvl__node *nm = mk(p, KVL__N_NAME, t);
    nm->name = t->p;
    nm->namelen = t->n;
    push(p, &names, nm);
    if (!is_op(p, KVL__OP_COMMA)) break;
    next(p);
    if (paren && is_op(p, KVL__OP_RPAREN)) break;
    if (!paren && (is_name(p, "in") || is_op(p, KVL__OP_ASSIGN))) break;
  }
  if (paren) expect_op(p, KVL__OP_RPAREN, "')'");
  stmt->args = names.v;
  stmt->nargs = names.n;
  stmt->op = names.n > 1 || paren; /* unpacking */
}

static void end_block(struct parser *p) { expect_type(p, KVL__T_BLOCK_END, "'%}'"); }

static struct kvl__node *parse_if(struct parser *p, const struct kvl__token *at) {
  static const char *const ends[] = {"elif", "else", "endif", NULL};
  static const char *const endif[] = {"endif", NULL};
  struct kvl__node *nd = mk(p, KVL__N_IF, at);
  nd->a = parse_tuple(p, false, false, NULL);
  end_block(p);
  struct nodes body = {0}, orelse = {0};
  subparse(p, ends, &body);
  nd->body = body.v;
  nd->nbody = body.n;
  const struct kvl__token *t = next(p);
  if (tok_is_name(t, "elif")) {
    push(p, &orelse, parse_if(p, t));
  } else if (tok_is_name(t, "else")) {
    end_block(p);
    subparse(p, endif, &orelse);
    next(p);
    end_block(p);
  } else {
    end_block(p);
  }
  nd->orelse = orelse.v;
  nd->norelse = orelse.n;
  return nd;
}

static struct kvl__node *parse_for(struct parser *p, const struct kvl__token *at) {
  static const char *const ends[] = {"endfor", "else", NULL};
  static const char *const endfor[] = {"endfor", NULL};
  struct kvl__node *nd = mk(p, KVL__N_FOR, at);
  parse_target(p, false, nd);
  expect_name(p, "in");
  nd->a = parse_tuple(p, false, false, "recursive");
  if (is_name(p, "if")) {
    next(p);
    nd->b = parse_expression(p, true);
  }
  if (is_name(p, "recursive")) fail_code(p, KVL_ENOTSUP, cur(p), "%s", "recursive loops are not supported");
  end_block(p);
  struct nodes body = {0}, orelse = {0};
  p->loops++;
  subparse(p, ends, &body);
  p->loops--;
  if (tok_is_name(next(p), "else")) {
    end_block(p);
    subparse(p, endfor, &orelse);
    next(p);
  }
  end_block(p);
  nd->body = body.v;
  nd->nbody = body.n;
  nd->orelse = orelse.v;
  nd->norelse = orelse.n;
  return nd;
}

static struct kvl__node *parse_set(struct parser *p, const struct kvl__token *at) {
  static const char *const ends[] = {"endset", NULL};
  struct kvl__node *nd = mk(p, KVL__N_SET, at);
  parse_target(p, true, nd);
  if (is_op(p, KVL__OP_ASSIGN)) {
    next(p);
    nd->a = parse_tuple(p, true, false, NULL);
    end_block(p);
    return nd;
  }
  if (nd->nargs != 1 || nd->op) unexpected(p, "'='");
  end_block(p);
  struct nodes body = {0};
  subparse(p, ends, &body);
  next(p);
  end_block(p);
  nd->body = body.v;
  nd->nbody = body.n;
  return nd;
}

static struct kvl__node *parse_macro(struct parser *p, const struct kvl__token *at) {
  static const char *const ends[] = {"endmacro", NULL};
  struct kvl__node *nd = mk(p, KVL__N_MACRO, at);
  const struct kvl__token *name = cur(p);
  expect_type(p, KVL__T_NAME, "a macro name");
  nd->name = name->p;
  nd->namelen = name->n;
  expect_op(p, KVL__OP_LPAREN, "'('");
  struct nodes defaults = {0};
  const char **pn = NULL;
  size_t *pl = NULL, np = 0;
  while (!is_op(p, KVL__OP_RPAREN)) {
    if (np) expect_op(p, KVL__OP_COMMA, "',' or ')'");
    if (is_op(p, KVL__OP_RPAREN)) break;
    const struct kvl__token *pt = cur(p);
    expect_type(p, KVL__T_NAME, "a parameter name");
    pn = kvl__arena_grow(p->a, pn, np * sizeof(*pn), (np + 1) * sizeof(*pn));
    pl = kvl__arena_grow(p->a, pl, np * sizeof(*pl), (np + 1) * sizeof(*pl));
    if (!pn || !pl) kvl__fail(p->es, KVL_ENOMEM, "template too large");
    pn[np] = pt->p;
    pl[np] = pt->n;
    np++;
    if (is_op(p, KVL__OP_ASSIGN)) {
      next(p);
      push(p, &defaults, parse_expression(p, true));
    } else {
      if (defaults.n && defaults.v[defaults.n - 1])
        fail_at(p, pt, "%s", "non-default argument follows default argument");
      push(p, &defaults, NULL);
    }
  }
  next(p);
  end_block(p);
  struct nodes body = {0};
  int loops = p->loops;
  p->loops = 0;
  subparse(p, ends, &body);
  p->loops = loops;
  next(p);
  end_block(p);
  nd->kwn = pn;
  nd->kwnl = pl;
  nd->kwv = defaults.v;
  nd->nkw = np;
  nd->body = body.v;
  nd->nbody = body.n;
  return nd;
}

static struct kvl__node *parse_statement(struct parser *p) {
  const struct kvl__token *t = cur(p);
  if (t->type != KVL__T_NAME) unexpected(p, "a statement name");
  next(p);
  struct kvl__node *nd;
  enter(p);
  if (tok_is_name(t, "if")) {
    nd = parse_if(p, t);
  } else if (tok_is_name(t, "for")) {
    nd = parse_for(p, t);
  } else if (tok_is_name(t, "set")) {
    nd = parse_set(p, t);
  } else if (tok_is_name(t, "macro")) {
    nd = parse_macro(p, t);
  } else if (tok_is_name(t, "break") || tok_is_name(t, "continue")) {
    if (!p->loops) fail_at(p, t, "'%s' outside of a loop", tok_is_name(t, "break") ? "break" : "continue");
    nd = mk(p, tok_is_name(t, "break") ? KVL__N_BREAK : KVL__N_CONTINUE, t);
    end_block(p);
  } else if (tok_is_name(t, "generation")) {
    /* transformers' {% generation %} marks assistant text; it renders its body as is */
    static const char *const ends[] = {"endgeneration", NULL};
    nd = mk(p, KVL__N_BLOCK, t);
    end_block(p);
    struct nodes body = {0};
    subparse(p, ends, &body);
    next(p);
    end_block(p);
    nd->body = body.v;
    nd->nbody = body.n;
  } else {
    char nm[64];
    snprintf(nm, sizeof(nm), "%.*s", (int)(t->n > 40 ? 40 : t->n), t->p);
    fail_code(p, KVL_ENOTSUP, t, "unknown or unsupported tag '%s'", nm);
  }
  leave(p);
  return nd;
}

static void subparse(struct parser *p, const char *const *ends, struct nodes *out) {
  for (;;) {
    const struct kvl__token *t = cur(p);
    switch (t->type) {
      case KVL__T_EOF:
        if (ends) {
          char e[64];
          snprintf(e, sizeof(e), "'%s'", ends[0]);
          unexpected(p, e);
        }
        return;
      case KVL__T_DATA: {
        next(p);
        struct kvl__node *nd = mk(p, KVL__N_DATA, t);
        nd->name = t->p;
        nd->namelen = t->n;
        push(p, out, nd);
        break;
      }
      case KVL__T_VAR_BEGIN: {
        next(p);
        struct kvl__node *nd = mk(p, KVL__N_OUTPUT, t);
        nd->a = parse_tuple(p, true, false, NULL);
        expect_type(p, KVL__T_VAR_END, "'}}'");
        push(p, out, nd);
        break;
      }
      case KVL__T_BLOCK_BEGIN:
        next(p);
        if (ends && is_one_of(cur(p), ends)) return;
        push(p, out, parse_statement(p));
        break;
      default: unexpected(p, "template data or a tag");
    }
  }
}

void kvl__parse(struct kvl__arena *a, struct kvl__errsink *es, const struct kvl__token *toks,
                size_t ntoks, struct kvl__node ***body, size_t *nbody) {
  KVL_ASSERT(ntoks > 0 && toks[ntoks - 1].type == KVL__T_EOF);
  struct parser p = {.a = a, .es = es, .t = toks, .n = ntoks};
  struct nodes out = {0};
  subparse(&p, NULL, &out);
  *body = out.v;
  *nbody = out.n;
}
