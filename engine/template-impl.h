/* template-impl.h — private types of the chat-template interpreter (kvl_template.h).
 *
 * The interpreter is split over four files that share these types:
 *   template_value.c  arena, UTF-8 helpers, values and their Python conversions
 *                     (str(), repr(), json.dumps(), ==, <, truthiness)
 *   template_lex.c    source -> tokens, with Jinja's whitespace control
 *   template_parse.c  tokens -> syntax tree
 *   template.c        the tree-walking evaluator, filters, tests, methods, public API
 *
 * Memory: everything a template owns (tokens, tree, literal values) lives in one arena
 * freed by kvl_template_free; everything one render makes lives in a per-render arena
 * freed when the render returns (h2o's per-request pool). Values are therefore plain
 * structs copied by value with no reference counts; lists and dicts are never changed
 * after they are built (the sandbox jinja2 runs in is immutable too) except namespaces,
 * which are the one mutable object and are shared by reference, as in Python.
 *
 * Errors: the parser and the evaluator are recursive walkers in which almost every call
 * can fail (bad input, type error, memory limit). Rather than threading a return code
 * through every level, a failure records its message and longjmp()s back to the entry
 * point (kvl_template_parse / kvl_template_render), which frees the arena and returns
 * the code. Nothing between holds a resource outside the arena, so nothing leaks. The
 * jump is always an explicit call to a noreturn kvl__*_fail function, never a macro.
 */
#ifndef KVL_TEMPLATE_IMPL_H
#define KVL_TEMPLATE_IMPL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- arena -------------------------------------------------------------------------- */

struct kvl__chunk;

struct kvl__arena {
  struct kvl__chunk *head; /* newest chunk first */
  size_t total;            /* bytes malloc'ed so far, chunk headers included */
  size_t limit;            /* kvl__arena_alloc fails (returns NULL) beyond this */
};

/* 16-byte aligned memory from the arena, or NULL when malloc fails or the limit would be
 * passed. Zero bytes gives a valid unique pointer. */
void *kvl__arena_alloc(struct kvl__arena *a, size_t n);
/* Grow the block p (old bytes, the most recent allocation or not) to n bytes: in place
 * when p is the last allocation of the newest chunk, else a copy. NULL as alloc. */
void *kvl__arena_grow(struct kvl__arena *a, void *p, size_t old, size_t n);
void kvl__arena_free(struct kvl__arena *a);

/* ---- values ------------------------------------------------------------------------- */

enum kvl__vtype {
  KVL__V_UNDEF, /* jinja2 Undefined: prints "", falsy, most operations fail */
  KVL__V_NONE,
  KVL__V_BOOL,
  KVL__V_INT,   /* Python int, limited to 64 bits (overflow is an error) */
  KVL__V_FLOAT,
  KVL__V_STR,   /* UTF-8 bytes with explicit length; NUL allowed */
  KVL__V_LIST,
  KVL__V_TUPLE, /* same storage as a list; differs in repr() and equality */
  KVL__V_DICT,  /* insertion-ordered, keys are values */
  KVL__V_NS,    /* namespace(): a dict whose attributes may be assigned */
  KVL__V_FUNC,  /* global function, bound method or macro */
  KVL__V_LOOP,  /* the `loop` object of a for loop */
};

struct kvl__list;
struct kvl__dict;
struct kvl__func;
struct kvl__loop;

struct kvl__val {
  enum kvl__vtype type;
  union {
    bool b;
    long long i;
    double f;
    struct {
      const char *p; /* STR: the bytes; UNDEF: the name that was missing (may be NULL) */
      size_t n;
    } s;
    struct kvl__list *l; /* LIST, TUPLE */
    struct kvl__dict *d; /* DICT, NS */
    struct kvl__func *fn;
    struct kvl__loop *loop;
  };
};

struct kvl__list {
  size_t n;
  struct kvl__val *v;
};

struct kvl__dict {
  size_t n, cap;
  struct kvl__val *k; /* keys, in insertion order */
  struct kvl__val *v; /* values */
};

/* Where a failing helper in template_value.c reports: set by the evaluator. */
struct kvl__errsink {
  jmp_buf *jb;
  int code;
  char *msg;
  size_t msglen;
};

/* Append-only byte buffer in an arena. */
struct kvl__buf {
  struct kvl__arena *a;
  struct kvl__errsink *es;
  char *p;
  size_t n, cap;
};

void kvl__buf_put(struct kvl__buf *b, const char *p, size_t n);
void kvl__buf_puts(struct kvl__buf *b, const char *s);
void kvl__buf_putc(struct kvl__buf *b, char c);
void kvl__buf_printf(struct kvl__buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Record (code, printf message) in es and longjmp to es->jb. */
_Noreturn void kvl__fail(struct kvl__errsink *es, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Arena allocation that fails through es (KVL_ENOMEM) instead of returning NULL. */
void *kvl__xalloc(struct kvl__arena *a, struct kvl__errsink *es, size_t n);

static inline struct kvl__val kvl__undef(const char *name) {
  struct kvl__val v = {.type = KVL__V_UNDEF};
  v.s.p = name;
  v.s.n = name ? __builtin_strlen(name) : 0;
  return v;
}
static inline struct kvl__val kvl__none(void) { return (struct kvl__val){.type = KVL__V_NONE}; }
static inline struct kvl__val kvl__bool(bool b) {
  return (struct kvl__val){.type = KVL__V_BOOL, .b = b};
}
static inline struct kvl__val kvl__int(long long i) {
  return (struct kvl__val){.type = KVL__V_INT, .i = i};
}
static inline struct kvl__val kvl__float(double f) {
  return (struct kvl__val){.type = KVL__V_FLOAT, .f = f};
}
static inline struct kvl__val kvl__str(const char *p, size_t n) {
  struct kvl__val v = {.type = KVL__V_STR};
  v.s.p = p;
  v.s.n = n;
  return v;
}

/* Python type name ("str", "int", "list", "NoneType", ...) for error messages. */
const char *kvl__type_name(const struct kvl__val *v);
/* Python truthiness (Undefined is false). */
bool kvl__truthy(const struct kvl__val *v);
/* Python ==, with jinja2's Undefined equal only to Undefined. */
bool kvl__eq(const struct kvl__val *a, const struct kvl__val *b);
/* Python <: -1 / 0 / 1 ordering of a and b; fails through es with a TypeError message
 * for unorderable types. */
int kvl__cmp(struct kvl__errsink *es, const struct kvl__val *a, const struct kvl__val *b);
/* Append Python's str(v) (jinja2 prints Undefined as "") / repr(v) to b. */
void kvl__put_str(struct kvl__buf *b, const struct kvl__val *v);
void kvl__put_repr(struct kvl__buf *b, const struct kvl__val *v);
/* Python repr(float). */
void kvl__put_float(struct kvl__buf *b, double f);

/* json.dumps(v, ensure_ascii, indent, separators, sort_keys): indent < 0 means None;
 * item_sep / key_sep NULL mean Python's defaults for the given indent. */
struct kvl__json_opts {
  bool ensure_ascii;
  int indent;
  const char *item_sep;
  size_t item_sep_n;
  const char *key_sep;
  size_t key_sep_n;
  bool sort_keys;
};
void kvl__put_json(struct kvl__buf *b, const struct kvl__val *v, const struct kvl__json_opts *o);

/* dict helpers: lookup returns NULL when absent; set replaces or appends. */
struct kvl__val *kvl__dict_get(const struct kvl__dict *d, const struct kvl__val *key);
struct kvl__val *kvl__dict_get_str(const struct kvl__dict *d, const char *key, size_t n);
void kvl__dict_set(struct kvl__arena *a, struct kvl__errsink *es, struct kvl__dict *d,
                   struct kvl__val key, struct kvl__val val);

/* ---- UTF-8 and Python string predicates ---------------------------------------------- */

/* Decode one code point at p (n bytes left); returns its length (1 for invalid bytes,
 * which decode as themselves). */
size_t kvl__utf8_dec(const char *p, size_t n, uint32_t *cp);
size_t kvl__utf8_enc(uint32_t cp, char out[4]);
/* Number of code points. */
size_t kvl__utf8_len(const char *p, size_t n);
/* Python str.isspace() for one code point (also what `\s` matches in Python's re). */
bool kvl__is_space(uint32_t cp);

/* ---- lexer -------------------------------------------------------------------------- */

enum kvl__tok {
  KVL__T_EOF,
  KVL__T_DATA,        /* template text, whitespace control already applied */
  KVL__T_VAR_BEGIN,   /* {{ */
  KVL__T_VAR_END,     /* }} */
  KVL__T_BLOCK_BEGIN, /* {% */
  KVL__T_BLOCK_END,   /* %} */
  KVL__T_NAME,
  KVL__T_STRING,      /* value already unescaped */
  KVL__T_INT,
  KVL__T_FLOAT,
  KVL__T_OP,
};

/* Operators, longest first where one is a prefix of another. */
#define KVL__OPS(X)                                                                      \
  X(FLOORDIV, "//") X(POW, "**") X(EQ, "==") X(NE, "!=") X(GE, ">=") X(LE, "<=")         \
  X(ADD, "+") X(SUB, "-") X(DIV, "/") X(MUL, "*") X(MOD, "%") X(TILDE, "~")              \
  X(LBRACKET, "[") X(RBRACKET, "]") X(LPAREN, "(") X(RPAREN, ")") X(LBRACE, "{")         \
  X(RBRACE, "}") X(GT, ">") X(LT, "<") X(ASSIGN, "=") X(DOT, ".") X(COLON, ":")          \
  X(PIPE, "|") X(COMMA, ",") X(SEMICOLON, ";")

enum kvl__op {
  KVL__OP_NONE,
#define KVL__OP_ENUM(name, text) KVL__OP_##name,
  KVL__OPS(KVL__OP_ENUM)
#undef KVL__OP_ENUM
};

struct kvl__token {
  enum kvl__tok type;
  enum kvl__op op; /* T_OP */
  int line, col;   /* 1-based, col in bytes */
  const char *p;   /* DATA, NAME, STRING: the text (arena or source) */
  size_t n;
  long long i;     /* INT */
  double f;        /* FLOAT */
};

/* Tokenize src (NUL-terminated) into an arena array ending with T_EOF. */
void kvl__lex(struct kvl__arena *a, struct kvl__errsink *es, const char *src,
              struct kvl__token **out, size_t *n);

/* ---- syntax tree -------------------------------------------------------------------- */

enum kvl__nkind {
  /* expressions */
  KVL__N_LIT,     /* lit */
  KVL__N_NAME,    /* name */
  KVL__N_GETATTR, /* a.name */
  KVL__N_GETITEM, /* a[b] */
  KVL__N_SLICE,   /* a[b:c:d], each of b c d may be NULL */
  KVL__N_CALL,    /* a(args, kw) */
  KVL__N_FILTER,  /* a | name(args, kw) */
  KVL__N_TEST,    /* a is [not] name(args); op = 1 when negated */
  KVL__N_NEG,     /* -a */
  KVL__N_POS,     /* +a */
  KVL__N_NOT,     /* not a */
  KVL__N_BINOP,   /* a op b, op one of ADD SUB MUL DIV FLOORDIV MOD POW TILDE */
  KVL__N_AND,
  KVL__N_OR,
  KVL__N_COMPARE, /* a, then (ops[i], args[i]) pairs: a < b <= c */
  KVL__N_COND,    /* b if a else c (c may be NULL) */
  KVL__N_LIST,    /* args */
  KVL__N_TUPLE,   /* args */
  KVL__N_DICT,    /* args = keys, kwv = values */
  /* statements */
  KVL__N_DATA,     /* name = text */
  KVL__N_OUTPUT,   /* {{ a }} */
  KVL__N_IF,       /* if a: body, else: orelse (an N_IF for elif) */
  KVL__N_FOR,      /* for targets(args, names) in a [if b]: body else orelse */
  KVL__N_SET,      /* set target(args: names / N_GETATTR on a name) = a, or body capture */
  KVL__N_MACRO,    /* macro name(params=kwn, defaults=kwv): body */
  KVL__N_BREAK,
  KVL__N_CONTINUE,
  KVL__N_BLOCK,    /* body only: {% generation %} */
};

/* Compare operators inside N_COMPARE. */
enum kvl__cmpop { KVL__C_EQ, KVL__C_NE, KVL__C_LT, KVL__C_LE, KVL__C_GT, KVL__C_GE,
                  KVL__C_IN, KVL__C_NOTIN };

struct kvl__node {
  enum kvl__nkind kind;
  int op;                    /* BINOP: enum kvl__op; TEST: negated */
  int line, col;             /* where it starts, for error messages */
  struct kvl__node *a, *b, *c, *d;
  struct kvl__node **args;   /* positional arguments / items / targets / statements */
  size_t nargs;
  const char **kwn;          /* keyword names (CALL, FILTER, MACRO params) */
  size_t *kwnl;              /* their lengths */
  struct kvl__node **kwv;    /* keyword values (NULL entry: macro param without default) */
  size_t nkw;
  int *ops;                  /* COMPARE: enum kvl__cmpop per extra operand */
  const char *name;          /* NAME, GETATTR, FILTER, TEST, DATA, MACRO */
  size_t namelen;
  int builtin;               /* FILTER / TEST: index into the evaluator's table */
  struct kvl__val lit;       /* LIT */
  struct kvl__node **body;   /* IF, FOR, SET (capture), MACRO, BLOCK */
  size_t nbody;
  struct kvl__node **orelse; /* IF (elif/else), FOR (else) */
  size_t norelse;
};

/* Parse tokens into a statement list. Filter and test names are resolved through
 * kvl__filter_index / kvl__test_index (template.c) so unknown ones fail here, with the
 * position, as jinja2 fails at compile time. */
void kvl__parse(struct kvl__arena *a, struct kvl__errsink *es, const struct kvl__token *toks,
                size_t ntoks, struct kvl__node ***body, size_t *nbody);
int kvl__filter_index(const char *name, size_t n);
int kvl__test_index(const char *name, size_t n);

#endif /* KVL_TEMPLATE_IMPL_H */
