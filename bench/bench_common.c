/* bench_common.c — clock, statistics, machine description and the BENCH-FORMAT writer
 * (JSON through jansson, plus a markdown table made from the same JSON object). */
#include "bench_common.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Where `git rev-parse` runs: the source tree the benchmark was built from (set by
 * bench/meson.build), so the hash is right whatever the current directory is. */
#ifndef KVL_BENCH_SOURCE_ROOT
#define KVL_BENCH_SOURCE_ROOT "."
#endif

/* ---- clock and statistics -------------------------------------------------------- */

double kvl_bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

void kvl_bench_stats_compute(const double *x, int n, struct kvl_bench_stats *out) {
  memset(out, 0, sizeof(*out));
  if (n < 1) return;
  double sum = 0;
  for (int i = 0; i < n; i++) sum += x[i];
  out->n = n;
  out->mean = sum / n;
  double ss = 0;
  for (int i = 0; i < n; i++) ss += (x[i] - out->mean) * (x[i] - out->mean);
  out->sd = n > 1 ? sqrt(ss / (n - 1)) : 0.0;
  double *s = malloc((size_t)n * sizeof(*s));
  if (!s) abort(); /* a few doubles: failing here is not a benchmark result worth having */
  memcpy(s, x, (size_t)n * sizeof(*s));
  qsort(s, (size_t)n, sizeof(*s), cmp_double);
  out->min = s[0];
  out->max = s[n - 1];
  out->median = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  free(s);
}

double kvl_bench_median(const double *x, int n) {
  struct kvl_bench_stats st;
  kvl_bench_stats_compute(x, n, &st);
  return st.median;
}

double kvl_bench_sd(const double *x, int n) {
  struct kvl_bench_stats st;
  kvl_bench_stats_compute(x, n, &st);
  return st.sd;
}

/* ---- machine, git, date, command ------------------------------------------------- */

/* The CPU flags that matter to our kernels, in the order they are reported. */
static const char *const wanted_flags[] = {
  "avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile",
};

/* Value of a "key<TAB>: value" line of /proc/cpuinfo, trimmed, in place. */
static char *cpuinfo_value(char *line) {
  char *c = strchr(line, ':');
  if (!c) return NULL;
  c++;
  while (*c == ' ' || *c == '\t') c++;
  size_t l = strlen(c);
  while (l > 0 && (c[l - 1] == '\n' || c[l - 1] == ' ' || c[l - 1] == '\t')) c[--l] = '\0';
  return c;
}

static bool has_word(const char *list, const char *w) {
  size_t wl = strlen(w);
  for (const char *p = list; (p = strstr(p, w)) != NULL; p += wl) {
    bool start = p == list || p[-1] == ' ' || p[-1] == '\t';
    bool end = p[wl] == '\0' || p[wl] == ' ' || p[wl] == '\t' || p[wl] == '\n';
    if (start && end) return true;
  }
  return false;
}

json_t *kvl_bench_machine(void) {
  char *cpu = NULL, *flags = NULL;
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (f) {
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0 && (!cpu || !flags)) {
      char *v;
      if (!cpu && !strncmp(line, "model name", 10) && (v = cpuinfo_value(line))) cpu = strdup(v);
      else if (!flags && !strncmp(line, "flags", 5) && (v = cpuinfo_value(line))) flags = strdup(v);
    }
    free(line);
    fclose(f);
  }
  double mem_gib = 0;
  if ((f = fopen("/proc/meminfo", "r"))) {
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof(line), f))
      if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) { mem_gib = round((double)kb / (1024.0 * 1024.0) * 10) / 10; break; }
    fclose(f);
  }
  json_t *fl = json_array();
  for (size_t i = 0; flags && i < sizeof(wanted_flags) / sizeof(wanted_flags[0]); i++)
    if (has_word(flags, wanted_flags[i])) json_array_append_new(fl, json_string(wanted_flags[i]));
  json_t *m = json_pack("{s:s, s:o, s:I, s:f}", "cpu", cpu ? cpu : "unknown", "flags", fl, "cores",
                        (json_int_t)sysconf(_SC_NPROCESSORS_ONLN), "mem_gib", mem_gib);
  free(cpu);
  free(flags);
  return m;
}

static bool is_hex(const char *s) {
  if (!*s) return false;
  for (; *s; s++)
    if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'))) return false;
  return true;
}

/* s quoted for a POSIX shell if it contains anything but plainly safe characters.
 * Returns a malloc'd string. */
static char *shell_quote(const char *s) {
  static const char safe[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-";
  size_t l = strlen(s);
  if (l > 0 && strspn(s, safe) == l) return strdup(s);
  char *q = malloc(4 * l + 3), *o = q;
  if (!q) return NULL;
  *o++ = '\'';
  for (; *s; s++) {
    if (*s == '\'') { memcpy(o, "'\\''", 4); o += 4; }
    else *o++ = *s;
  }
  *o++ = '\'';
  *o = '\0';
  return q;
}

void kvl_bench_git_hash(char *buf, size_t len) {
  snprintf(buf, len, "unknown");
  char *root = shell_quote(KVL_BENCH_SOURCE_ROOT);
  if (!root) return;
  char cmd[4200];
  snprintf(cmd, sizeof(cmd), "git -C %s rev-parse --short HEAD 2>/dev/null", root);
  free(root);
  FILE *p = popen(cmd, "r");
  if (!p) return;
  char out[64] = "";
  bool got = fgets(out, sizeof(out), p) != NULL;
  int st = pclose(p);
  out[strcspn(out, "\r\n")] = '\0';
  if (got && st == 0 && is_hex(out)) snprintf(buf, len, "%s", out);
}

void kvl_bench_date_utc(char *buf, size_t len) {
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

char *kvl_bench_command_line(int argc, char **argv) {
  size_t cap = 1, n = 0;
  char *out = malloc(cap);
  if (!out) return NULL;
  out[0] = '\0';
  for (int i = 0; i < argc; i++) {
    char *q = shell_quote(argv[i]);
    if (!q) { free(out); return NULL; }
    size_t ql = strlen(q);
    char *no = realloc(out, cap + ql + 1);
    if (!no) { free(q); free(out); return NULL; }
    out = no;
    cap += ql + 1;
    if (i > 0) out[n++] = ' ';
    memcpy(out + n, q, ql + 1);
    n += ql;
    free(q);
  }
  return out;
}

int kvl_bench_mkdir_p(const char *path) {
  if (!*path) return -ENOENT;
  char *p = strdup(path);
  if (!p) return -ENOMEM;
  int rc = 0;
  for (char *s = p + 1;; s++) {
    if (*s == '/' || *s == '\0') {
      char c = *s;
      *s = '\0';
      if (mkdir(p, 0777) < 0 && errno != EEXIST) { rc = -errno; break; }
      *s = c;
      if (c == '\0') break;
    }
  }
  free(p);
  return rc;
}

/* ---- the report ------------------------------------------------------------------- */

struct kvl_bench_report {
  char *name;      /* benchmark name: the "benchmark" key and the files' stem */
  json_t *root;    /* the whole document, results included */
  json_t *results; /* borrowed: root["results"] */
};

kvl_bench_report_t *kvl_bench_report_new(const char *name, int argc, char **argv) {
  kvl_bench_report_t *r = calloc(1, sizeof(*r));
  char git[64], date[32];
  char *cmd = kvl_bench_command_line(argc, argv);
  if (!r || !cmd) goto fail;
  kvl_bench_git_hash(git, sizeof(git));
  kvl_bench_date_utc(date, sizeof(date));
  r->name = strdup(name);
  r->results = json_array();
  r->root = json_pack("{s:s, s:s, s:s, s:o, s:s, s:O}", "benchmark", name, "git", git, "date", date,
                      "machine", kvl_bench_machine(), "command", cmd, "results", r->results);
  json_decref(r->results); /* root holds it now; r->results stays a borrowed pointer */
  if (!r->name || !r->root) goto fail;
  free(cmd);
  return r;
fail:
  free(cmd);
  kvl_bench_report_free(r);
  return NULL;
}

void kvl_bench_report_free(kvl_bench_report_t *r) {
  if (!r) return;
  json_decref(r->root);
  free(r->name);
  free(r);
}

json_t *kvl_bench_report_add(kvl_bench_report_t *r, const char *model, const char *test,
                             double value, const char *unit, int runs, double sd) {
  json_t *o = json_object();
  if (!o) return NULL;
  if (model) json_object_set_new(o, "model", json_string(model));
  json_object_set_new(o, "test", json_string(test));
  json_object_set_new(o, "value", json_real(value));
  json_object_set_new(o, "unit", json_string(unit));
  json_object_set_new(o, "runs", json_integer(runs));
  json_object_set_new(o, "sd", json_real(sd));
  if (json_array_append_new(r->results, o) < 0) return NULL;
  return o;
}

size_t kvl_bench_report_count(const kvl_bench_report_t *r) { return json_array_size(r->results); }

/* Write text to path via a temporary file and rename. Returns 0 or -errno. */
static int write_file(const char *path, const char *text) {
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 5);
  if (!tmp) return -ENOMEM;
  snprintf(tmp, pl + 5, "%s.tmp", path);
  int rc = 0;
  FILE *f = fopen(tmp, "w");
  if (!f) { rc = -errno; goto out; }
  if (fputs(text, f) < 0) rc = -errno;
  if (fclose(f) != 0 && rc == 0) rc = -errno;
  if (rc == 0 && rename(tmp, path) < 0) rc = -errno;
  if (rc < 0) unlink(tmp);
out:
  if (rc < 0) fprintf(stderr, "bench: cannot write %s: %s\n", path, strerror(-rc));
  free(tmp);
  return rc;
}

/* A growing string for the markdown text. */
struct sbuf {
  char *s;
  size_t n, cap;
  bool oom;
};

static void sb_add(struct sbuf *b, const char *s, size_t l) {
  if (b->oom) return;
  if (b->n + l + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 1024;
    while (nc < b->n + l + 1) nc *= 2;
    char *ns = realloc(b->s, nc);
    if (!ns) { b->oom = true; return; }
    b->s = ns;
    b->cap = nc;
  }
  memcpy(b->s + b->n, s, l);
  b->n += l;
  b->s[b->n] = '\0';
}

static void sb_puts(struct sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* A markdown table cell: '|' escaped, line breaks as spaces. */
static void sb_cell_text(struct sbuf *b, const char *s) {
  for (; *s; s++) {
    if (*s == '|') sb_puts(b, "\\|");
    else if (*s == '\n' || *s == '\r') sb_puts(b, " ");
    else sb_add(b, s, 1);
  }
}

/* Numbers for people: about four significant digits, fixed notation. */
static void fmt_real(char *buf, size_t len, double v) {
  double a = fabs(v);
  if (a >= 1000) snprintf(buf, len, "%.0f", v);
  else if (a >= 100) snprintf(buf, len, "%.1f", v);
  else if (a >= 1) snprintf(buf, len, "%.2f", v);
  else if (a == 0) snprintf(buf, len, "0");
  else snprintf(buf, len, "%.3g", v);
}

static void sb_cell_json(struct sbuf *b, const json_t *v) {
  char num[64];
  switch (json_typeof(v)) {
  case JSON_STRING: sb_cell_text(b, json_string_value(v)); break;
  case JSON_INTEGER: snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(v)); sb_puts(b, num); break;
  case JSON_REAL: fmt_real(num, sizeof(num), json_real_value(v)); sb_puts(b, num); break;
  case JSON_TRUE: sb_puts(b, "true"); break;
  case JSON_FALSE: sb_puts(b, "false"); break;
  case JSON_NULL: break;
  default: {
    char *s = json_dumps(v, JSON_COMPACT);
    if (s) { sb_cell_text(b, s); free(s); }
  }
  }
}

/* The markdown rendering of a report document. Returns a malloc'd string or NULL. */
static char *render_markdown(const json_t *root) {
  static const char *const fixed[] = {"model", "test", "value", "unit", "runs", "sd"};
  const size_t n_fixed = sizeof(fixed) / sizeof(fixed[0]);
  const json_t *results = json_object_get(root, "results");
  const json_t *machine = json_object_get(root, "machine");
  struct sbuf b = {0};
  char line[1024];

  /* Columns: the fixed ones, then every extra key in order of first appearance. */
  json_t *cols = json_array();
  for (size_t i = 0; i < n_fixed; i++) json_array_append_new(cols, json_string(fixed[i]));
  size_t i;
  json_t *res;
  json_array_foreach(results, i, res) {
    const char *key;
    json_t *val;
    json_object_foreach(res, key, val) {
      (void)val;
      bool seen = false;
      for (size_t c = 0; c < json_array_size(cols) && !seen; c++)
        seen = !strcmp(json_string_value(json_array_get(cols, c)), key);
      if (!seen) json_array_append_new(cols, json_string(key));
    }
  }

  snprintf(line, sizeof(line), "# %s\n\n", json_string_value(json_object_get(root, "benchmark")));
  sb_puts(&b, line);
  snprintf(line, sizeof(line), "- git `%s`, %s\n", json_string_value(json_object_get(root, "git")),
           json_string_value(json_object_get(root, "date")));
  sb_puts(&b, line);
  sb_puts(&b, "- machine: ");
  sb_cell_text(&b, json_string_value(json_object_get(machine, "cpu")));
  snprintf(line, sizeof(line), ", %" JSON_INTEGER_FORMAT " cores, %.1f GiB, flags:",
           json_integer_value(json_object_get(machine, "cores")), json_real_value(json_object_get(machine, "mem_gib")));
  sb_puts(&b, line);
  json_t *fl;
  json_array_foreach(json_object_get(machine, "flags"), i, fl) {
    sb_puts(&b, " ");
    sb_puts(&b, json_string_value(fl));
  }
  sb_puts(&b, "\n- command: `");
  sb_puts(&b, json_string_value(json_object_get(root, "command")));
  sb_puts(&b, "`\n- value is the median over `runs`; sd its standard deviation\n\n|");

  size_t nc = json_array_size(cols);
  for (size_t c = 0; c < nc; c++) {
    sb_puts(&b, " ");
    sb_cell_text(&b, json_string_value(json_array_get(cols, c)));
    sb_puts(&b, " |");
  }
  sb_puts(&b, "\n|");
  for (size_t c = 0; c < nc; c++) { /* right-aligned: a column of numbers only */
    bool text = false, any = false;
    json_array_foreach(results, i, res) {
      const json_t *v = json_object_get(res, json_string_value(json_array_get(cols, c)));
      any |= v != NULL;
      text |= v && !json_is_number(v);
    }
    sb_puts(&b, any && !text ? "---:|" : "---|");
  }
  sb_puts(&b, "\n");
  json_array_foreach(results, i, res) {
    sb_puts(&b, "|");
    for (size_t c = 0; c < nc; c++) {
      const json_t *v = json_object_get(res, json_string_value(json_array_get(cols, c)));
      sb_puts(&b, " ");
      if (v) sb_cell_json(&b, v);
      sb_puts(&b, " |");
    }
    sb_puts(&b, "\n");
  }
  json_decref(cols);
  if (b.oom) { free(b.s); return NULL; }
  return b.s;
}

int kvl_bench_report_write(kvl_bench_report_t *r, const char *dir) {
  int rc = kvl_bench_mkdir_p(dir);
  if (rc < 0) {
    fprintf(stderr, "bench: cannot create %s: %s\n", dir, strerror(-rc));
    return rc;
  }
  size_t pl = strlen(dir) + strlen(r->name) + 8;
  char *path = malloc(pl);
  char *js = json_dumps(r->root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7));
  char *md = render_markdown(r->root);
  if (!path || !js || !md) { rc = -ENOMEM; goto out; }
  size_t jl = strlen(js);
  char *jsn = realloc(js, jl + 2); /* end the file with a newline */
  if (!jsn) { rc = -ENOMEM; goto out; }
  js = jsn;
  memcpy(js + jl, "\n", 2);
  snprintf(path, pl, "%s/%s.json", dir, r->name);
  if ((rc = write_file(path, js)) < 0) goto out;
  snprintf(path, pl, "%s/%s.md", dir, r->name);
  rc = write_file(path, md);
out:
  if (rc == -ENOMEM) fprintf(stderr, "bench: out of memory writing the %s report\n", r->name);
  free(path);
  free(js);
  free(md);
  return rc;
}

const char *kvl_bench_model_name(const char *path) {
  const char *s = strrchr(path, '/');
  s = s ? s + 1 : path;
  /* the real pair by its file's name only: another file whose path says "0.5b" (a cut or
   * grown copy, scripts/gguf-reshape) keeps its own name in the results */
  if (!strncmp(s, "qwen2.5-coder-0.5b", 18)) return "qwen2.5-coder-0.5b";
  if (!strncmp(s, "qwen2.5-coder-1.5b", 18)) return "qwen2.5-coder-1.5b";
  return s;
}

void kvl_bench_model_path(const char *size, char *buf, size_t len) {
  const char *dir = getenv("KVLINGO_MODELS"), *home = getenv("HOME");
  if (dir) snprintf(buf, len, "%s/qwen2.5-coder-%s-instruct-q4_k_m.gguf", dir, size);
  else snprintf(buf, len, "%s/.cache/kvlingo/models/qwen2.5-coder-%s-instruct-q4_k_m.gguf", home ? home : ".", size);
}
