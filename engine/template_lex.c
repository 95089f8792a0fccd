/* template_lex.c — template source to tokens, with jinja2's whitespace control as
 * transformers configures it (trim_blocks=True, lstrip_blocks=True,
 * keep_trailing_newline=False).
 *
 * The rules, as jinja2 3.1's lexer applies them:
 *  - \r\n and \r become \n everywhere; one trailing newline of the source is dropped.
 *  - `{%-`, `{#-`, `{{-` strip all whitespace before the tag; `-%}`, `-#}`, `-}}` strip
 *    all whitespace after it.
 *  - lstrip_blocks: whitespace other than newlines between the start of a line and a
 *    `{%` or `{#` tag is removed, unless the tag is written `{%+` / `{#+`. "Start of a
 *    line" includes the start of the template and the point right after a tag whose
 *    match ended with a newline.
 *  - trim_blocks: one newline right after `%}` or `#}` is removed, unless `+%}` / `+#}`.
 *  - Inside a tag, `%}` / `}}` only end it when brackets are balanced.
 *  - `{% raw %}...{% endraw %}` passes its body through as text.
 */
#include <stdlib.h>
#include <string.h>

#include "kvl_error.h"
#include "template-impl.h"

struct lexer {
  struct kvl__arena *a;
  struct kvl__errsink *es;
  const char *s; /* normalized source */
  size_t n;
  struct kvl__token *toks;
  size_t ntok, cap;
  /* line/col cache: byte lc_pos is on line lc_line, which starts at byte lc_start */
  size_t lc_pos, lc_line, lc_start;
};

static void where(struct lexer *lx, size_t pos, int *line, int *col) {
  if (pos < lx->lc_pos) {
    lx->lc_pos = 0;
    lx->lc_line = 1;
    lx->lc_start = 0;
  }
  for (size_t i = lx->lc_pos; i < pos && i < lx->n; i++) {
    if (lx->s[i] == '\n') {
      lx->lc_line++;
      lx->lc_start = i + 1;
    }
  }
  lx->lc_pos = pos;
  *line = (int)lx->lc_line;
  *col = (int)(pos - lx->lc_start + 1);
}

static _Noreturn void lex_fail(struct lexer *lx, size_t pos, const char *what) {
  int line, col;
  where(lx, pos, &line, &col);
  kvl__fail(lx->es, KVL_EFORMAT, "template:%d:%d: %s", line, col, what);
}

static struct kvl__token *emit(struct lexer *lx, enum kvl__tok type, size_t pos) {
  if (lx->ntok == lx->cap) {
    size_t cap = lx->cap ? lx->cap * 2 : 256;
    struct kvl__token *t = kvl__arena_grow(lx->a, lx->toks, lx->ntok * sizeof(*t), cap * sizeof(*t));
    if (!t) kvl__fail(lx->es, KVL_ENOMEM, "template too large");
    lx->toks = t;
    lx->cap = cap;
  }
  struct kvl__token *t = &lx->toks[lx->ntok++];
  memset(t, 0, sizeof(*t));
  t->type = type;
  where(lx, pos, &t->line, &t->col);
  return t;
}

/* Python's \s at pos: length of the whitespace code point there, or 0. */
static size_t space_at(const struct lexer *lx, size_t pos) {
  if (pos >= lx->n) return 0;
  uint32_t cp;
  size_t len = kvl__utf8_dec(lx->s + pos, lx->n - pos, &cp);
  return kvl__is_space(cp) ? len : 0;
}

static size_t skip_space(const struct lexer *lx, size_t pos) {
  size_t len;
  while ((len = space_at(lx, pos))) pos += len;
  return pos;
}

/* Start of the trailing whitespace of s[from, to) (Python str.rstrip()). */
static size_t rstrip_pos(const struct lexer *lx, size_t from, size_t to) {
  size_t end = to;
  while (end > from) {
    size_t start = end - 1;
    while (start > from && ((unsigned char)lx->s[start] & 0xc0) == 0x80) start--;
    uint32_t cp;
    kvl__utf8_dec(lx->s + start, end - start, &cp);
    if (!kvl__is_space(cp)) break;
    end = start;
  }
  return end;
}

static bool starts(const struct lexer *lx, size_t pos, const char *lit) {
  size_t n = strlen(lit);
  return pos + n <= lx->n && memcmp(lx->s + pos, lit, n) == 0;
}

/* Text s[from, to) before a tag with whitespace sign `sign`; emits the DATA token after
 * applying `-` stripping or lstrip_blocks (when `lstrip_ok`, i.e. not a {{ tag). */
static void emit_text(struct lexer *lx, size_t from, size_t to, char sign, bool lstrip_ok,
                      bool line_starting) {
  if (sign == '-') {
    to = rstrip_pos(lx, from, to);
  } else if (sign != '+' && lstrip_ok) {
    size_t l = to;
    while (l > from && lx->s[l - 1] != '\n') l--;
    if ((l > from || line_starting) && l < to && rstrip_pos(lx, l, to) == l) to = l;
  }
  if (to > from) {
    struct kvl__token *t = emit(lx, KVL__T_DATA, from);
    t->p = lx->s + from;
    t->n = to - from;
  }
}

/* Is there `{%[-+]? raw %}` (or `-%}`) at pos? Returns the end of the match or 0. */
static size_t raw_begin(const struct lexer *lx, size_t pos, char *sign) {
  size_t p = pos + 2;
  *sign = 0;
  if (p < lx->n && (lx->s[p] == '-' || lx->s[p] == '+')) *sign = lx->s[p++];
  p = skip_space(lx, p);
  if (!starts(lx, p, "raw")) return 0;
  p = skip_space(lx, p + 3);
  if (starts(lx, p, "-%}")) return skip_space(lx, p + 3);
  if (starts(lx, p, "%}")) return p + 2;
  return 0;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Unescape a string literal body s[from, to) as jinja2 does (Python's unicode-escape
 * codec after backslashreplace). */
static void unescape(struct lexer *lx, size_t from, size_t to, struct kvl__token *t) {
  struct kvl__buf b = {.a = lx->a, .es = lx->es};
  size_t i = from;
  char u8[4];
  while (i < to) {
    char c = lx->s[i];
    if (c != '\\') {
      size_t j = i;
      while (j < to && lx->s[j] != '\\') j++;
      kvl__buf_put(&b, lx->s + i, j - i);
      i = j;
      continue;
    }
    KVL_ASSERT(i + 1 < to); /* the scanner never ends a literal on a backslash */
    char e = lx->s[i + 1];
    i += 2;
    switch (e) {
      case '\n': break;
      case '\\': kvl__buf_putc(&b, '\\'); break;
      case '\'': kvl__buf_putc(&b, '\''); break;
      case '"': kvl__buf_putc(&b, '"'); break;
      case 'a': kvl__buf_putc(&b, '\a'); break;
      case 'b': kvl__buf_putc(&b, '\b'); break;
      case 'f': kvl__buf_putc(&b, '\f'); break;
      case 'n': kvl__buf_putc(&b, '\n'); break;
      case 'r': kvl__buf_putc(&b, '\r'); break;
      case 't': kvl__buf_putc(&b, '\t'); break;
      case 'v': kvl__buf_putc(&b, '\v'); break;
      case 'x':
      case 'u':
      case 'U': {
        int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (int k = 0; k < nd; k++) {
          int h = i < to ? hexval(lx->s[i]) : -1;
          if (h < 0) lex_fail(lx, i, "truncated \\x, \\u or \\U escape in string");
          cp = cp * 16 + (uint32_t)h;
          i++;
        }
        if (cp > 0x10ffff) lex_fail(lx, i, "illegal Unicode character in string");
        kvl__buf_put(&b, u8, kvl__utf8_enc(cp, u8));
        break;
      }
      case 'N': lex_fail(lx, i - 2, "\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = (uint32_t)(e - '0');
          for (int k = 0; k < 2 && i < to && lx->s[i] >= '0' && lx->s[i] <= '7'; k++)
            cp = cp * 8 + (uint32_t)(lx->s[i++] - '0');
          kvl__buf_put(&b, u8, kvl__utf8_enc(cp, u8));
        } else if ((unsigned char)e >= 0x80) {
          /* backslashreplace turned the character into \xNN / \uNNNN / \UNNNNNNNN, and
           * the backslash before it escapes that escape's own backslash */
          uint32_t cp;
          size_t len = kvl__utf8_dec(lx->s + i - 1, to - (i - 1), &cp);
          i = i - 1 + len;
          kvl__buf_putc(&b, '\\');
          if (cp < 0x100) kvl__buf_printf(&b, "x%02x", cp);
          else if (cp < 0x10000) kvl__buf_printf(&b, "u%04x", cp);
          else kvl__buf_printf(&b, "U%08x", cp);
        } else {
          kvl__buf_putc(&b, '\\');
          kvl__buf_putc(&b, e);
        }
    }
  }
  t->p = b.p ? b.p : "";
  t->n = b.n;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

/* Digits with single underscores between them (\d+(_\d+)*); returns the end or pos. */
static size_t digits(const struct lexer *lx, size_t pos) {
  if (pos >= lx->n || !is_digit(lx->s[pos])) return pos;
  size_t p = pos;
  while (p < lx->n && is_digit(lx->s[p])) p++;
  while (p + 1 < lx->n && lx->s[p] == '_' && is_digit(lx->s[p + 1])) {
    p++;
    while (p < lx->n && is_digit(lx->s[p])) p++;
  }
  return p;
}

/* Copy s[from, to) without underscores into a NUL-terminated temporary. */
static char *number_text(struct lexer *lx, size_t from, size_t to) {
  char *t = kvl__xalloc(lx->a, lx->es, to - from + 1);
  size_t k = 0;
  for (size_t i = from; i < to; i++)
    if (lx->s[i] != '_') t[k++] = lx->s[i];
  t[k] = 0;
  return t;
}

/* One number token at pos (which holds a digit); returns its end. */
static size_t lex_number(struct lexer *lx, size_t pos) {
  size_t d = digits(lx, pos);
  bool after_dot = pos > 0 && lx->s[pos - 1] == '.';
  size_t end = 0;
  if (!after_dot) { /* float: D.D, D[.D]e[+-]D */
    size_t p = d;
    bool frac = false;
    if (p < lx->n && lx->s[p] == '.' && digits(lx, p + 1) > p + 1) {
      p = digits(lx, p + 1);
      frac = true;
    }
    if (p < lx->n && (lx->s[p] == 'e' || lx->s[p] == 'E')) {
      size_t q = p + 1;
      if (q < lx->n && (lx->s[q] == '+' || lx->s[q] == '-')) q++;
      size_t e = digits(lx, q);
      if (e > q) end = e;
    }
    if (!end && frac) end = p;
  }
  if (end) {
    struct kvl__token *t = emit(lx, KVL__T_FLOAT, pos);
    t->f = strtod(number_text(lx, pos, end), NULL);
    return end;
  }
  struct kvl__token *t = emit(lx, KVL__T_INT, pos);
  int base = 10;
  size_t from = pos, p = d;
  if (lx->s[pos] == '0' && pos + 1 < lx->n) {
    char x = lx->s[pos + 1];
    base = (x == 'x' || x == 'X') ? 16 : (x == 'o' || x == 'O') ? 8 : (x == 'b' || x == 'B') ? 2 : 10;
    if (base != 10) {
      from = pos + 2;
      p = from;
      while (p < lx->n && (lx->s[p] == '_' || (hexval(lx->s[p]) >= 0 && hexval(lx->s[p]) < base)))
        p++;
      if (p == from) lex_fail(lx, pos, "invalid integer literal");
    } else {
      p = pos + 1; /* 0(_?0)* */
      while (p < lx->n && (lx->s[p] == '0' || (lx->s[p] == '_' && p + 1 < lx->n && lx->s[p + 1] == '0')))
        p++;
    }
  }
  errno = 0;
  char *txt = number_text(lx, from, p);
  t->i = strtoll(txt, NULL, base);
  if (errno == ERANGE) lex_fail(lx, pos, "integer literal too large");
  return p;
}

/* Tokens of one {% %} or {{ }} tag starting at pos (after the opener); returns the
 * position after the tag's end (whitespace control applied) and whether that match
 * ended with a newline. */
static size_t lex_tag(struct lexer *lx, size_t pos, bool block, bool *nl_end) {
  char stack[256];
  size_t depth = 0;
  for (;;) {
    if (depth == 0) {
      size_t end = 0;
      if (block) {
        if (starts(lx, pos, "+%}")) end = pos + 3;
        else if (starts(lx, pos, "-%}")) end = skip_space(lx, pos + 3);
        else if (starts(lx, pos, "%}")) end = pos + 2 + (starts(lx, pos + 2, "\n") ? 1 : 0);
      } else {
        if (starts(lx, pos, "-}}")) end = skip_space(lx, pos + 3);
        else if (starts(lx, pos, "}}")) end = pos + 2;
      }
      if (end) {
        emit(lx, block ? KVL__T_BLOCK_END : KVL__T_VAR_END, pos);
        *nl_end = lx->s[end - 1] == '\n';
        return end;
      }
    }
    if (pos >= lx->n) lex_fail(lx, pos, block ? "unexpected end of template, expected '%}'"
                                              : "unexpected end of template, expected '}}'");
    size_t sp = space_at(lx, pos);
    if (sp) {
      pos += sp;
      continue;
    }
    char c = lx->s[pos];
    if (is_digit(c)) {
      pos = lex_number(lx, pos);
    } else if (is_name_start(c)) {
      size_t e = pos;
      while (e < lx->n && (is_name_start(lx->s[e]) || is_digit(lx->s[e]))) e++;
      struct kvl__token *t = emit(lx, KVL__T_NAME, pos);
      t->p = lx->s + pos;
      t->n = e - pos;
      pos = e;
    } else if (c == '\'' || c == '"') {
      size_t e = pos + 1;
      while (e < lx->n && lx->s[e] != c) e += lx->s[e] == '\\' && e + 1 < lx->n ? 2 : 1;
      if (e >= lx->n) lex_fail(lx, pos, "unterminated string literal");
      struct kvl__token *t = emit(lx, KVL__T_STRING, pos);
      unescape(lx, pos + 1, e, t);
      pos = e + 1;
    } else {
      static const struct { enum kvl__op op; const char *text; } ops[] = {
#define KVL__OP_ROW(name, text) {KVL__OP_##name, text},
          KVL__OPS(KVL__OP_ROW)
#undef KVL__OP_ROW
      };
      size_t k;
      for (k = 0; k < sizeof(ops) / sizeof(ops[0]); k++)
        if (starts(lx, pos, ops[k].text)) break;
      if (k == sizeof(ops) / sizeof(ops[0])) {
        char msg[64];
        snprintf(msg, sizeof(msg), "unexpected char '%c'", c);
        lex_fail(lx, pos, msg);
      }
      if (c == '(' || c == '[' || c == '{') {
        if (depth == sizeof(stack)) lex_fail(lx, pos, "brackets nested too deeply");
        stack[depth++] = c == '(' ? ')' : c == '[' ? ']' : '}';
      } else if (c == ')' || c == ']' || c == '}') {
        char msg[64];
        if (!depth) {
          snprintf(msg, sizeof(msg), "unexpected '%c'", c);
          lex_fail(lx, pos, msg);
        }
        if (stack[depth - 1] != c) {
          snprintf(msg, sizeof(msg), "unexpected '%c', expected '%c'", c, stack[depth - 1]);
          lex_fail(lx, pos, msg);
        }
        depth--;
      }
      struct kvl__token *t = emit(lx, KVL__T_OP, pos);
      t->op = ops[k].op;
      pos += strlen(ops[k].text);
    }
  }
}

void kvl__lex(struct kvl__arena *a, struct kvl__errsink *es, const char *src,
              struct kvl__token **out, size_t *nout) {
  struct lexer lx = {.a = a, .es = es, .lc_line = 1};
  /* normalize newlines, drop one trailing newline */
  size_t srcn = strlen(src);
  char *s = kvl__xalloc(a, es, srcn + 1);
  size_t n = 0;
  for (size_t i = 0; i < srcn; i++) {
    if (src[i] == '\r') {
      s[n++] = '\n';
      if (i + 1 < srcn && src[i + 1] == '\n') i++;
    } else {
      s[n++] = src[i];
    }
  }
  if (n && s[n - 1] == '\n') n--;
  s[n] = 0;
  lx.s = s;
  lx.n = n;

  size_t pos = 0;
  bool line_starting = true;
  while (pos < n) {
    /* the next tag opener */
    size_t q = pos;
    while (q + 1 < n && !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#')))
      q++;
    if (q + 1 >= n) {
      emit_text(&lx, pos, n, 0, false, line_starting);
      break;
    }
    char kind = s[q + 1];
    char sign = (q + 2 < n && (s[q + 2] == '-' || s[q + 2] == '+')) ? s[q + 2] : 0;
    char rsign;
    size_t rend = kind == '%' ? raw_begin(&lx, q, &rsign) : 0;
    if (rend) {
      emit_text(&lx, pos, q, rsign, true, line_starting);
      /* the body up to {%[-+]? endraw [-+]?%} */
      size_t e = rend;
      for (;;) {
        while (e + 1 < n && !(s[e] == '{' && s[e + 1] == '%')) e++;
        if (e + 1 >= n) lex_fail(&lx, q, "missing end of raw directive");
        size_t p = e + 2;
        char esign = (p < n && (s[p] == '-' || s[p] == '+')) ? s[p] : 0;
        if (esign) p++;
        p = skip_space(&lx, p);
        if (starts(&lx, p, "endraw")) {
          p = skip_space(&lx, p + 6);
          size_t end = 0;
          if (starts(&lx, p, "+%}")) end = p + 3;
          else if (starts(&lx, p, "-%}")) end = skip_space(&lx, p + 3);
          else if (starts(&lx, p, "%}")) end = p + 2 + (starts(&lx, p + 2, "\n") ? 1 : 0);
          if (end) {
            /* line_starting is false here: the raw opener's match ended with '}' or
             * whitespace jinja2 does not count as a line start unless it was '\n' */
            emit_text(&lx, rend, e, esign, true, s[rend - 1] == '\n');
            pos = end;
            line_starting = s[end - 1] == '\n';
            break;
          }
        }
        e += 2;
      }
      continue;
    }
    emit_text(&lx, pos, q, sign, kind != '{', line_starting);
    size_t body = q + 2 + (sign ? 1 : 0);
    if (kind == '#') {
      size_t r = body;
      while (r + 1 < n && !(s[r] == '#' && s[r + 1] == '}')) r++;
      if (r + 1 >= n) lex_fail(&lx, q, "missing end of comment tag");
      size_t end;
      if (r > body && s[r - 1] == '-') end = skip_space(&lx, r + 2);
      else if (r > body && s[r - 1] == '+') end = r + 2;
      else end = r + 2 + (starts(&lx, r + 2, "\n") ? 1 : 0);
      pos = end;
      line_starting = s[end - 1] == '\n';
      continue;
    }
    emit(&lx, kind == '%' ? KVL__T_BLOCK_BEGIN : KVL__T_VAR_BEGIN, q);
    bool nl_end = false;
    pos = lex_tag(&lx, body, kind == '%', &nl_end);
    line_starting = nl_end;
  }
  emit(&lx, KVL__T_EOF, n);
  *out = lx.toks;
  *nout = lx.ntok;
}
