/* template-render — render a chat template with kvlingo's interpreter (kvl_template.h).
 *
 *   template-render TEMPLATE [CONTEXT.json|-]
 *   template-render --gguf MODEL.gguf [CONTEXT.json|-]   (tokenizer.chat_template)
 *   template-render [--gguf] TEMPLATE --batch < contexts.jsonl
 *
 * The single form prints the rendering to stdout byte for byte; on an error it prints
 * the message to stderr and exits 1. The context defaults to stdin.
 *
 * --batch reads one JSON context per line and, for each, writes "OK <n>\n" and the n
 * bytes of the rendering, or "ERR <n>\n" and an n-byte message, each followed by "\n";
 * it exits 0 unless the template itself does not parse. The oracle test uses it to
 * render hundreds of conversations in one process.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvl_error.h"
#include "kvl_gguf.h"
#include "kvl_template.h"

static char *slurp(FILE *f, size_t *len) {
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap + 1);
  if (!buf) return NULL;
  size_t got;
  while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      char *nb = realloc(buf, cap * 2 + 1);
      if (!nb) {
        free(buf);
        return NULL;
      }
      buf = nb;
      cap *= 2;
    }
  }
  buf[n] = 0;
  *len = n;
  return buf;
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (!f) return NULL;
  char *s = slurp(f, len);
  if (f != stdin) fclose(f);
  return s;
}

static void record(const char *tag, const char *p, size_t n) {
  printf("%s %zu\n", tag, n);
  fwrite(p, 1, n, stdout);
  putchar('\n');
}

int main(int argc, char **argv) {
  bool gguf = false, batch = false;
  const char *tpath = NULL, *cpath = "-";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--gguf") == 0) gguf = true;
    else if (strcmp(argv[i], "--batch") == 0) batch = true;
    else if (!tpath) tpath = argv[i];
    else cpath = argv[i];
  }
  if (!tpath) {
    fprintf(stderr, "usage: %s [--gguf] TEMPLATE [CONTEXT.json|-] | [--gguf] TEMPLATE --batch\n",
            argv[0]);
    return 2;
  }
  char err[512];
  char *src = NULL;
  size_t srclen;
  if (gguf) {
    kvl_gguf_t *g;
    const char *s;
    if (kvl_gguf_open(tpath, &g, err, sizeof(err)) < 0) {
      fprintf(stderr, "%s: %s\n", tpath, err);
      return 1;
    }
    if (kvl_gguf_get_str(g, "tokenizer.chat_template", &s) < 0) {
      fprintf(stderr, "%s: no tokenizer.chat_template\n", tpath);
      kvl_gguf_free(g);
      return 1;
    }
    src = strdup(s);
    kvl_gguf_free(g);
  } else {
    src = read_file(tpath, &srclen);
  }
  if (!src) {
    fprintf(stderr, "%s: cannot read\n", tpath);
    return 1;
  }
  kvl_template_t *t;
  int rc = kvl_template_parse(src, &t, err, sizeof(err));
  free(src);
  if (rc < 0) {
    fprintf(stderr, "%s: %s (%s)\n", tpath, err, kvl_err_name(rc));
    return 1;
  }

  int status = 0;
  if (batch) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) > 0) {
      json_error_t jerr;
      json_t *ctx = json_loadb(line, (size_t)n, JSON_ALLOW_NUL, &jerr);
      if (!ctx) {
        record("ERR", jerr.text, strlen(jerr.text));
        continue;
      }
      char *out;
      size_t len;
      rc = kvl_template_render(t, ctx, &out, &len, err, sizeof(err));
      if (rc == 0) {
        record("OK", out, len);
        free(out);
      } else {
        record("ERR", err, strlen(err));
      }
      json_decref(ctx);
    }
    free(line);
  } else {
    size_t clen;
    char *ctext = read_file(cpath, &clen);
    json_error_t jerr;
    json_t *ctx = ctext ? json_loadb(ctext, clen, JSON_ALLOW_NUL, &jerr) : NULL;
    bool readable = ctext != NULL;
    free(ctext);
    if (!ctx) {
      fprintf(stderr, "%s: bad JSON context: %s\n", cpath, readable ? jerr.text : "cannot read");
      kvl_template_free(t);
      return 1;
    }
    char *out;
    size_t len;
    rc = kvl_template_render(t, ctx, &out, &len, err, sizeof(err));
    json_decref(ctx);
    if (rc == 0) {
      fwrite(out, 1, len, stdout);
      free(out);
    } else {
      fprintf(stderr, "%s (%s)\n", err, kvl_err_name(rc));
      status = 1;
    }
  }
  kvl_template_free(t);
  return status;
}
