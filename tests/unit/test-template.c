/* test-template.c — the chat-template interpreter's lexer, parser and evaluator edge
 * cases (kvl_template.h). Expected strings are what jinja2 3.1 renders in transformers'
 * configuration; the conversation-level byte-for-byte comparison against jinja2 itself
 * is test-template-oracle.py. */
#include <string.h>

#include <jansson.h>

#include "kvl_template.h"
#include "kvl_test.h"

/* Render src with the JSON context ctx ("{}" if NULL); returns the code and the output
 * (or error message) in out. */
static int render(const char *src, const char *ctx, char *out, size_t outlen) {
  char err[512];
  kvl_template_t *t;
  out[0] = 0;
  int rc = kvl_template_parse(src, &t, err, sizeof(err));
  if (rc < 0) {
    snprintf(out, outlen, "%s", err);
    return rc;
  }
  json_error_t jerr;
  json_t *j = json_loads(ctx ? ctx : "{}", JSON_ALLOW_NUL, &jerr);
  if (!j) {
    fprintf(stderr, "bad test JSON: %s\n", jerr.text);
    kvl_template_free(t);
    return -9999;
  }
  char *text;
  size_t len;
  rc = kvl_template_render(t, j, &text, &len, err, sizeof(err));
  if (rc == 0) {
    snprintf(out, outlen, "%.*s", (int)len, text);
    free(text);
  } else {
    CHECK(text == NULL && len == 0);
    snprintf(out, outlen, "%s", err);
  }
  json_decref(j);
  kvl_template_free(t);
  return rc;
}

#define EXPECT(src, ctx, want)                                                          \
  do {                                                                                  \
    char out_[4096];                                                                    \
    int rc_ = render((src), (ctx), out_, sizeof(out_));                                 \
    if (rc_ != 0 || strcmp(out_, (want)) != 0) {                                        \
      fprintf(stderr, "%s:%d: %s\n  want [%s]\n  got  [%s] (rc %d)\n", __FILE__,        \
              __LINE__, (src), (want), out_, rc_);                                      \
      kvl_test_failed++;                                                                \
    }                                                                                   \
  } while (0)

#define EXPECT_ERR(src, ctx, code, msg_part)                                            \
  do {                                                                                  \
    char out_[4096];                                                                    \
    int rc_ = render((src), (ctx), out_, sizeof(out_));                                 \
    if (rc_ != (code) || !strstr(out_, (msg_part))) {                                   \
      fprintf(stderr, "%s:%d: %s\n  want error %d containing [%s]\n  got  [%s] (rc %d)\n", \
              __FILE__, __LINE__, (src), (code), (msg_part), out_, rc_);                \
      kvl_test_failed++;                                                                \
    }                                                                                   \
  } while (0)

static void test_whitespace_control(void) {
  /* trim_blocks removes the newline after %}, lstrip_blocks the indent before {% */
  EXPECT("a\n  {% if true %}\n  b\n  {% endif %}\nc", NULL, "a\n  b\nc");
  EXPECT("  {{ 'x' }}\n", NULL, "  x");           /* no lstrip for {{, trailing \n dropped */
  EXPECT("x\n\n", NULL, "x\n");                    /* only one trailing newline dropped */
  EXPECT("a  {%- if true -%}  b  {%- endif -%}  c", NULL, "abc");
  EXPECT("a \n {{- 'b' -}} \n c", NULL, "abc");
  EXPECT("  {%+ if true %}x{% endif +%}\ny", NULL, "  x\ny");
  EXPECT("a {# c #} b\n  {# line #}\nc", NULL, "a  b\nc");
  EXPECT("a\r\nb\rc", NULL, "a\nb\nc");
  EXPECT("{% raw %}{{ x }}{% endraw %}", NULL, "{{ x }}");
  EXPECT("x  {% if true %}y{% endif %}", NULL, "x  y"); /* not at a line start */
  EXPECT("{% if true %}\n\nz{% endif %}", NULL, "\nz");
}

static void test_literals(void) {
  EXPECT("{{ 'a\\nb' }}|{{ \"q\\\"\" }}|{{ '\\x41\\u00e9\\101' }}|{{ '\\q' }}", NULL,
         "a\nb|q\"|A\xc3\xa9" "A|\\q");
  EXPECT("{{ 'a' 'b' }}{{ 1_000 }} {{ 0x1f }} {{ 1.5e3 }} {{ 2e-5 }}", NULL, "ab1000 31 1500.0 2e-05");
  EXPECT("{{ true }} {{ False }} {{ none }} {{ [1, 'a', none] }} {{ (1,) }} {{ () }}", NULL,
         "True False None [1, 'a', None] (1,) ()");
  EXPECT("{{ {'a': 1, 'b': [true]} }} {{ {} }} {{ [] }}", NULL, "{'a': 1, 'b': [True]} {} []");
  EXPECT("{{ \"it's\" }} {{ [\"it's\"] }} {{ ['say \"x\"', \"a'\\\"b\"] }}", NULL,
         "it's [\"it's\"] ['say \"x\"', 'a\\'\"b']");
  EXPECT("{{ 1e16 }} {{ 1e15 }} {{ 0.1 + 0.2 }} {{ 1/3 }} {{ -0.0 }} {{ 1e-4 }} {{ 123.456 }}",
         NULL, "1e+16 1000000000000000.0 0.30000000000000004 0.3333333333333333 -0.0 0.0001 123.456");
}

static void test_operators(void) {
  EXPECT("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 4 / 2 }}", NULL,
         "3 -4 2 -2 3.5 2.0");
  EXPECT("{{ -7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2 ** 3 ** 2 }}", NULL,
         "-4.0 0.5 1024 0.5 64");
  EXPECT("{{ 2 * 3 ~ 4 }} {{ 'a' ~ 'b' is string }} {{ -2 ** 2 }} {{ true + 1 }}", NULL,
         "64 aTrue 4 2");
  EXPECT("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'b' in 'abc' }} {{ 1 not in [1] }} {{ not 1 in [2] }}",
         NULL, "True False True False True");
  EXPECT("{{ 1 == 1.0 }} {{ [1] == (1,) }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}", NULL,
         "True False True True");
  EXPECT("{{ 0 or 'x' }} {{ 1 and [] }} {{ none or none }} {{ 'y' if 0 else 'n' }}[{{ 'z' if 0 }}]",
         NULL, "x [] None n[]");
  EXPECT("{{ 'ab' * 2 }} {{ 2 * [0] }} {{ [1] + [2] }} {{ 'x' ~ 1 ~ none ~ 2.5 }}", NULL,
         "abab [0, 0] [1, 2] x1None2.5");
  EXPECT_ERR("{{ 'a' + 1 }}", NULL, KVL_EINVAL, "template:1:8: unsupported operand");
  EXPECT_ERR("{{ 1 / 0 }}", NULL, KVL_EINVAL, "division by zero");
  EXPECT_ERR("{{ 1 < 'a' }}", NULL, KVL_EINVAL, "not supported");
  EXPECT_ERR("{{ 9223372036854775807 + 1 }}", NULL, KVL_ERANGE, "overflow");
  EXPECT_ERR("{{ '%s' % 1 }}", NULL, KVL_EINVAL, "formatting");
}

static void test_undefined(void) {
  EXPECT("[{{ x }}] {{ x is defined }} {{ x | length }} {{ x | default('d') }} {{ not x }}", NULL,
         "[] False 0 d True");
  EXPECT("{% for i in x %}no{% endfor %}{{ 'a' in x }} {{ x == x }} {{ x ~ 'y' }}", NULL,
         "False True y");
  EXPECT("{{ d.missing is defined }} {{ d['missing'] is defined }} [{{ d.missing }}]",
         "{\"d\": {}}", "False False []");
  EXPECT("{{ n.x is defined }} {{ l[5] is defined }} {{ l[-1] }}", "{\"n\": null, \"l\": [1, 2]}",
         "False False 2");
  EXPECT_ERR("{{ x.y }}", NULL, KVL_EINVAL, "'x' is undefined");
  EXPECT_ERR("{{ x + 1 }}", NULL, KVL_EINVAL, "'x' is undefined");
  EXPECT_ERR("{{ x() }}", NULL, KVL_EINVAL, "'x' is undefined");
  EXPECT_ERR("{{ x | tojson }}", NULL, KVL_EINVAL, "not JSON serializable");
}

static void test_loops_and_scope(void) {
  const char *ctx = "{\"xs\": [\"a\", \"b\", \"c\"]}";
  EXPECT("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}"
         "{{ loop.last }}{{ loop.length }},{% endfor %}",
         ctx, "103TrueFalse3,212FalseFalse3,321FalseTrue3,");
  EXPECT("{% for x in xs %}{{ loop.previtem | default('-') }}{{ loop.nextitem | default('-') }}"
         "{{ loop.cycle(1, 2) }} {% endfor %}",
         ctx, "-b1 ac2 b-1 ");
  EXPECT("{% for x in xs if x != 'b' %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}", ctx,
         "a2c2");
  EXPECT("{% for x in [] %}x{% else %}none{% endfor %}", NULL, "none");
  EXPECT("{% for k, v in {'a': 1, 'b': 2} | items %}{{ k }}={{ v }};{% endfor %}", NULL, "a=1;b=2;");
  EXPECT("{% for c in 'h\xc3\xa9' %}[{{ c }}]{% endfor %}{% for k in {'p': 1} %}{{ k }}{% endfor %}",
         NULL, "[h][\xc3\xa9]p");
  /* set inside a loop is per iteration; a namespace carries state out */
  EXPECT("{% set n = 0 %}{% set ns = namespace(n=0) %}{% for x in xs %}{% set n = n + 1 %}"
         "{% set ns.n = ns.n + 1 %}{% endfor %}{{ n }} {{ ns.n }}",
         ctx, "0 3");
  EXPECT("{% if true %}{% set y = 5 %}{% endif %}{{ y }}", NULL, "5"); /* if has no scope */
  EXPECT("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}"
         "{% break %}{% endif %}{{ i }}{% endfor %}",
         NULL, "013");
  EXPECT("{% for x in xs %}{% for y in xs %}{{ loop.index }}{% endfor %}{{ loop.index }}|{% endfor %}",
         ctx, "1231|1232|1233|");
  EXPECT("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set s %}x{{ a }}{% endset %}{{ s }}", NULL, "12x1");
  EXPECT_ERR("{% for a, b in [1] %}{% endfor %}", NULL, KVL_EINVAL, "not iterable");
  EXPECT_ERR("{% for a, b in [[1]] %}{% endfor %}", NULL, KVL_EINVAL, "unpack");
  EXPECT_ERR("{% for x in 5 %}{% endfor %}", NULL, KVL_EINVAL, "not iterable");
  EXPECT_ERR("{% set x = 1 %}{% set x.a = 2 %}", NULL, KVL_EINVAL, "non-namespace");
  EXPECT_ERR("{% set ns = namespace(_a=1) %}", NULL, KVL_EINVAL, "underscore");
}

static void test_macros(void) {
  EXPECT("{% macro f(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ f(1) }}{{ f(1, b=2) }}{{ f(b=3, a=4) }}",
         NULL, "[1B][12][43]");
  EXPECT("{% macro f(a) %}{{ a is defined }}{% endmacro %}{{ f() }}", NULL, "False");
  EXPECT_ERR("{% macro f(a) %}{% endmacro %}{{ f(1, 2) }}", NULL, KVL_EINVAL, "not more than");
  EXPECT_ERR("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", NULL, KVL_ERANGE, "recursion");
}

static void test_filters(void) {
  EXPECT("{{ ' x ' | trim }}|{{ 'xyx' | trim('x') }}|{{ 'abc' | length }}|{{ 'h\xc3\xa9\xf0\x9f\x98\x80' | length }}",
         NULL, "x|y|3|3");
  EXPECT("{{ 'aB' | upper }}{{ 'aB' | lower }}{{ 'aB c' | capitalize }}{{ 'a-b c(d' | title }}",
         NULL, "ABabAb cA-B C(D");
  EXPECT("{{ 1 | string ~ 2 }} {{ [1, 2] | join(', ') }} {{ [1, 2] | first }} {{ [1, 2] | last }}",
         NULL, "12 1, 2 1 2");
  EXPECT("{{ [] | first is defined }} {{ 'ab' | list }} {{ [1, 2] | reverse | list }} {{ 'ab' | reverse }}",
         NULL, "False ['a', 'b'] [2, 1] ba");
  EXPECT("{{ '' | default('e') }}|{{ '' | default('e', true) }}|{{ none | d('n') }}", NULL, "|e|None");
  EXPECT("{{ 'aaa' | replace('a', 'b', 2) }} {{ '12' | int + 1 }} {{ 'x' | int }} {{ '2.5' | float }} {{ -3 | abs }}",
         NULL, "bba 13 0 2.5 3");
  EXPECT("{{ [{'a': 1}, {'a': 2}] | map(attribute='a') | list }} {{ [1, 2, 3] | select('odd') | list }}"
         " {{ [{'r': 'u'}, {'r': 's'}] | selectattr('r', 'equalto', 's') | list }} {{ [1, 2] | sum }}",
         NULL, "[1, 2] [1, 3] [{'r': 's'}] 3");
  EXPECT("{{ {'a': 1} | items | list }} {{ nothing | items | list }}", NULL, "[('a', 1)] []");
  EXPECT_ERR("{{ none | items }}", NULL, KVL_EINVAL, "mapping");
  EXPECT_ERR("{{ 5 | length }}", NULL, KVL_EINVAL, "has no len()");
  EXPECT_ERR("{{ [1] | items }}", NULL, KVL_EINVAL, "mapping");
}

static void test_tojson(void) {
  const char *ctx = "{\"v\": {\"b\": [1, 2.5, -0.0, 1e20, null, true], \"a\": \"\xc3\xa9\\n\\\"<>&'\\u0001\"}}";
  EXPECT("{{ v | tojson }}", ctx,
         "{\"b\": [1, 2.5, -0.0, 1e+20, null, true], \"a\": \"\xc3\xa9\\n\\\"<>&'\\u0001\"}");
  EXPECT("{{ v | tojson(indent=2, sort_keys=true) }}", ctx,
         "{\n  \"a\": \"\xc3\xa9\\n\\\"<>&'\\u0001\",\n  \"b\": [\n    1,\n    2.5,\n    -0.0,\n"
         "    1e+20,\n    null,\n    true\n  ]\n}");
  EXPECT("{{ v.b | tojson(separators=(',', ':')) }} {{ 'x\xf0\x9f\x98\x80' | tojson(ensure_ascii=true) }}",
         ctx, "[1,2.5,-0.0,1e+20,null,true] \"x\\ud83d\\ude00\"");
  EXPECT("{{ {1: 'a', none: 'b', true: 'c'} | tojson }} {{ [] | tojson(indent=2) }}", NULL,
         "{\"1\": \"c\", \"null\": \"b\"} []"); /* 1 and true are one key */
  EXPECT_ERR("{{ namespace(a=1) | tojson }}", NULL, KVL_EINVAL, "not JSON serializable");
}

static void test_strings(void) {
  const char *ctx = "{\"s\": \"  h\xc3\xa9llo w\xc3\xb6rld  \"}";
  EXPECT("[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s.strip(' hd') }}]", ctx,
         "[h\xc3\xa9llo w\xc3\xb6rld][h\xc3\xa9llo w\xc3\xb6rld  ][  h\xc3\xa9llo w\xc3\xb6rld][\xc3\xa9llo w\xc3\xb6rl]");
  EXPECT("{{ s.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a b c'.split(' ', 1) }} {{ ' a  b '.split(none, 1) }}",
         ctx, "['h\xc3\xa9llo', 'w\xc3\xb6rld'] ['a', 'b', '', 'c'] ['a', 'b c'] ['a', 'b ']");
  EXPECT("{{ s[2:4] }} {{ s[::-1] }} {{ s[-3] }} {{ s[100:] }}|{{ 'abcdef'[1::2] }} {{ [1, 2, 3][::-1] }}",
         ctx, "h\xc3\xa9   dlr\xc3\xb6w oll\xc3\xa9h   d |bdf [3, 2, 1]");
  EXPECT("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'a-b'.replace('-', '+') }}"
         " {{ 'abcb'.find('b') }} {{ 'abcb'.count('b') }} {{ ', '.join(['x', 'y']) }} {{ 'Ab'.upper() }}",
         NULL, "True True a+b 1 2 x, y AB");
  EXPECT("{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b', 2) }} {{ {'a': 1}.keys() | list }} {{ {'a': 1}.items() | list }}",
         NULL, "1 2 ['a'] [('a', 1)]");
  EXPECT("{{ 'x'.nope is defined }} {{ s._private is defined }}", ctx, "False False");
  EXPECT_ERR("{{ 'x'.nope() }}", NULL, KVL_EINVAL, "undefined");
  EXPECT_ERR("{{ 'abc'[::0] }}", NULL, KVL_EINVAL, "step cannot be zero");
}

static void test_tests(void) {
  EXPECT("{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.0 is float }}{{ 'a' is string }}"
         "{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ none is none }}",
         NULL, "TrueTrueTrueTrueTrueTrueTrueTrueTrue");
  EXPECT("{{ 1 is true }}{{ true is true }}{{ false is false }}{{ 4 is even }}{{ 3 is odd }}"
         "{{ 9 is divisibleby 3 }}{{ 1 is not none }}{{ 2 is eq 2 }}{{ 2 is in [1, 2] }}",
         NULL, "FalseTrueTrueTrueTrueTrueTrueTrueTrue");
  EXPECT("{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'upper' is filter }}{{ 'odd' is test }}", NULL,
         "TrueTrueTrueTrue");
}

static void test_errors(void) {
  EXPECT_ERR("{{ raise_exception('Roles must alternate') }}", NULL, KVL_EINVAL,
             "template:1:4: Roles must alternate");
  EXPECT_ERR("a\n  {{ x | nosuchfilter }}", NULL, KVL_ENOTSUP, "template:2:10: no filter named 'nosuchfilter'");
  EXPECT_ERR("{{ x is nosuchtest }}", NULL, KVL_ENOTSUP, "no test named");
  EXPECT_ERR("{% include 'x' %}", NULL, KVL_ENOTSUP, "unsupported tag 'include'");
  EXPECT_ERR("{% if true %}x", NULL, KVL_EFORMAT, "expected 'elif'");
  EXPECT_ERR("line1\n{{ 1 + }}", NULL, KVL_EFORMAT, "template:2:8: unexpected end of print statement");
  EXPECT_ERR("{{ (1 }}", NULL, KVL_EFORMAT, "template:1:7: unexpected '}', expected ')'");
  EXPECT_ERR("{{ [1) }}", NULL, KVL_EFORMAT, "unexpected ')', expected ']'");
  EXPECT_ERR("{{ 'abc }}", NULL, KVL_EFORMAT, "unterminated string");
  EXPECT_ERR("{{ x ", NULL, KVL_EFORMAT, "unexpected end of template");
  EXPECT_ERR("{# never closed", NULL, KVL_EFORMAT, "missing end of comment");
  EXPECT_ERR("{% break %}", NULL, KVL_EFORMAT, "outside of a loop");
  EXPECT_ERR("{% endfor %}", NULL, KVL_ENOTSUP, "endfor");
  EXPECT_ERR("{{ 'x' is defined is defined }}", NULL, KVL_EFORMAT, "");
  EXPECT_ERR("{{ '\\xZZ' }}", NULL, KVL_EFORMAT, "escape");
  EXPECT_ERR("{{ 99999999999999999999 }}", NULL, KVL_EFORMAT, "too large");
  EXPECT_ERR("{{ 1 | int(1, 2, 3) }}", NULL, KVL_EINVAL, "at most");
  EXPECT_ERR("{{ 1 | replace(z=1) }}", NULL, KVL_EINVAL, "unexpected keyword");
  EXPECT_ERR("{% for i in range(100001) %}{% endfor %}", NULL, KVL_ERANGE, "Range too big");
}

static void test_limits(void) {
  /* deeply nested expressions fail cleanly instead of overflowing the stack */
  char src[8192];
  size_t n = 0;
  n += (size_t)snprintf(src + n, sizeof(src) - n, "{{ ");
  for (int i = 0; i < 2000; i++) src[n++] = '(';
  src[n++] = '1';
  for (int i = 0; i < 2000; i++) src[n++] = ')';
  snprintf(src + n, sizeof(src) - n, " }}");
  EXPECT_ERR(src, NULL, KVL_EFORMAT, "nested too deeply");
  /* a string doubled 40 times hits the render memory limit */
  EXPECT_ERR("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
             "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
             NULL, KVL_ENOMEM, "memory limit");
  EXPECT_ERR("{{ 'x' * 1000000000 }}", NULL, KVL_ERANGE, "repetition");
  EXPECT_ERR("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
             "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
             NULL, KVL_ENOMEM, "memory limit");
  /* steps: nested ranges */
  EXPECT_ERR("{% set r = range(5000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", NULL,
             KVL_ERANGE, "step limit");
}

static void test_api(void) {
  char err[256];
  kvl_template_t *t;
  CHECK_EQ_INT(kvl_template_parse("{{ messages[0].content }}", &t, err, sizeof(err)), 0);
  /* a context that is not an object */
  json_t *arr = json_array();
  char *out = (char *)1;
  size_t len = 7;
  CHECK_EQ_INT(kvl_template_render(t, arr, &out, &len, err, sizeof(err)), KVL_EINVAL);
  CHECK(out == NULL && len == 0);
  json_decref(arr);
  /* content with an embedded NUL comes through whole */
  json_error_t jerr;
  json_t *ctx = json_loads("{\"messages\": [{\"content\": \"a\\u0000b\"}]}", JSON_ALLOW_NUL, &jerr);
  CHECK(ctx != NULL);
  CHECK_EQ_INT(kvl_template_render(t, ctx, &out, &len, NULL, 0), 0);
  CHECK_EQ_INT(len, 3);
  CHECK(memcmp(out, "a\0b", 3) == 0 && out[3] == 0);
  free(out);
  json_decref(ctx);
  kvl_template_free(t);
  kvl_template_free(NULL);
  /* parse failure leaves *out NULL; err may be NULL */
  t = (kvl_template_t *)1;
  CHECK_EQ_INT(kvl_template_parse("{% if %}", &t, NULL, 0), KVL_EFORMAT);
  CHECK(t == NULL);
}

/* The Qwen2.5 template's shape: system default, tool calls, grouped tool results. */
static void test_chatml_shape(void) {
  const char *tpl =
      "{%- for message in messages %}"
      "{%- if message.role == 'tool' %}"
      "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
      "\n<tool_response>\n{{ message.content }}\n</tool_response>"
      "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
      "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
      "{%- for tc in message.tool_calls %}{% if tc.function is defined %}{% set tc = tc.function %}{% endif %}"
      "\n<tool_call>\n{\"name\": \"{{ tc.name }}\", \"arguments\": {{ tc.arguments | tojson }}}\n</tool_call>"
      "{%- endfor %}<|im_end|>\n{% endif %}{% endfor %}"
      "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  const char *ctx =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"},"
      " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"name\": \"f\","
      " \"arguments\": {\"x\": 1}}}]},"
      " {\"role\": \"tool\", \"content\": \"r1\"}, {\"role\": \"tool\", \"content\": \"r2\"}],"
      " \"add_generation_prompt\": true}";
  /* trim_blocks eats the "\n" after each {% endif %}: that is why the real template
   * writes those newlines inside {{- '...' }} */
  EXPECT(tpl, ctx,
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", "
         "\"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n<|im_start|>user<tool_response>\nr1\n"
         "</tool_response><tool_response>\nr2\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
}

int main(void) {
  RUN(test_whitespace_control);
  RUN(test_literals);
  RUN(test_operators);
  RUN(test_undefined);
  RUN(test_loops_and_scope);
  RUN(test_macros);
  RUN(test_filters);
  RUN(test_tojson);
  RUN(test_strings);
  RUN(test_tests);
  RUN(test_errors);
  RUN(test_limits);
  RUN(test_api);
  RUN(test_chatml_shape);
  return TEST_EXIT();
}
