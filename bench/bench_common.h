/* bench_common.h — what every benchmark shares: a clock, statistics over repeated runs,
 * and the writer of the one result format (shared/BENCH-FORMAT.md).
 *
 *   kvl_bench_report_t *r = kvl_bench_report_new("roofline", argc, argv);
 *   double s[5];
 *   for (int i = 0; i < 5; i++) { double t0 = kvl_bench_now(); work(); s[i] = kvl_bench_now() - t0; }
 *   struct kvl_bench_stats st;
 *   kvl_bench_stats_compute(s, 5, &st);
 *   json_t *res = kvl_bench_report_add(r, NULL, "roofline-bandwidth", gbps(st.median), "GB/s", 5, sd);
 *   json_object_set_new(res, "threads", json_integer(2));    // extra fields: plain jansson
 *   if (kvl_bench_report_write(r, "bench/results") < 0) ...  // <dir>/roofline.json + .md
 *   kvl_bench_report_free(r);
 *
 * The report fills "benchmark", "git", "date", "machine" and "command" itself; results
 * are appended in order. The markdown table is made from the same JSON object that is
 * written, so the two never disagree.
 */
#ifndef KVL_BENCH_COMMON_H
#define KVL_BENCH_COMMON_H

#include <stddef.h>

#include <jansson.h>

/* Seconds on the monotonic clock (CLOCK_MONOTONIC): only differences mean anything. */
double kvl_bench_now(void);

/* Summary of n repeated measurements. */
struct kvl_bench_stats {
  int n;          /* number of samples */
  double median;  /* middle value (mean of the two middle ones for even n) */
  double sd;      /* sample standard deviation (n - 1 in the denominator); 0 for n < 2 */
  double min;     /* smallest sample */
  double max;     /* largest sample */
  double mean;    /* arithmetic mean */
};

/* Statistics of x[0..n-1] (x is not modified). n must be >= 1. */
void kvl_bench_stats_compute(const double *x, int n, struct kvl_bench_stats *out);
double kvl_bench_median(const double *x, int n);
double kvl_bench_sd(const double *x, int n);

/* The "machine" block: {"cpu", "flags", "cores", "mem_gib"}, read from /proc and sysconf.
 * Returns a new reference (caller owns it), never NULL except when out of memory. */
json_t *kvl_bench_machine(void);

/* Short hash of the source tree's HEAD (`git rev-parse --short HEAD`), or "unknown".
 * Writes a NUL-terminated string into buf. */
void kvl_bench_git_hash(char *buf, size_t len);

/* Current time in UTC as ISO 8601, "2026-12-01T10:00:00Z". */
void kvl_bench_date_utc(char *buf, size_t len);

/* The command line, each argument quoted for a POSIX shell where it needs it, so it can
 * be pasted back. Returns a malloc'd string (caller frees) or NULL when out of memory. */
char *kvl_bench_command_line(int argc, char **argv);

/* Create directory `path` and its parents (like mkdir -p). Returns 0 or -errno. */
int kvl_bench_mkdir_p(const char *path);

/* The real pair's short name as ListModels reports it ("qwen2.5-coder-1.5b") for a file
 * path; other files: their base name. */
const char *kvl_bench_model_name(const char *path);
/* The path of the Qwen2.5-Coder model of that size ("0.5b", "1.5b", q4_k_m) in
 * $KVLINGO_MODELS (default ~/.cache/kvlingo/models). */
void kvl_bench_model_path(const char *size, char *buf, size_t len);

typedef struct kvl_bench_report kvl_bench_report_t;

/* A report for benchmark `name` (the file stem); argv is recorded as "command".
 * Returns NULL when out of memory. */
kvl_bench_report_t *kvl_bench_report_new(const char *name, int argc, char **argv);
void kvl_bench_report_free(kvl_bench_report_t *r);

/* Append one result {"model", "test", "value", "unit", "runs", "sd"} (model may be NULL
 * for machine-wide tests: the key is then left out). Returns the result object,
 * borrowed (owned by the report), for adding extra fields; NULL when out of memory. */
json_t *kvl_bench_report_add(kvl_bench_report_t *r, const char *model, const char *test,
                             double value, const char *unit, int runs, double sd);

/* Number of results added so far. */
size_t kvl_bench_report_count(const kvl_bench_report_t *r);

/* Write <dir>/<name>.json and <dir>/<name>.md (dir created if missing; each file
 * written under a temporary name, then renamed). Returns 0 or -errno; a message
 * naming the file goes to stderr on failure. */
int kvl_bench_report_write(kvl_bench_report_t *r, const char *dir);

#endif /* KVL_BENCH_COMMON_H */
