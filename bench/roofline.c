/* roofline.c — bench-roofline: the machine's own limits, the ceilings other benchmarks
 * are judged against.
 *
 *   roofline-bandwidth  memory read bandwidth (GB/s = 1e9 B/s) over a buffer far larger
 *                       than the last-level cache, 1 thread and all cores; AVX-512 loads
 *                       when the processor has them, else AVX2, else plain C.
 *   roofline-flops      arithmetic peak per data type and ISA (peak.h: f32 FMA on AVX-512
 *                       and AVX2, bf16 dot products on AVX-512-BF16 and AMX, int8 dot
 *                       products on AVX-512 VNNI, AVX2 and AMX: the instructions the
 *                       backend's matmuls are built on), GFLOP/s or GOP/s (GOP/s for s8;
 *                       one multiply-add = 2 operations), 1 thread and all cores; the
 *                       `dtype` and `isa` fields name the probe.
 *
 * Every figure is the median of -r runs (default 5) after one untimed warm-up run; "best"
 * is the fastest run. Writes <out>/roofline.json and .md (shared/BENCH-FORMAT.md).
 */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>

#include "bench_common.h"
#include "peak.h"

/* ---- main -------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
    "usage: bench-roofline [options]\n"
    "\n"
    "Measure this machine's memory read bandwidth and its arithmetic peak per data type\n"
    "(f32, bf16, s8) and ISA it has, one thread and all cores; write <out>/roofline.json\n"
    "and <out>/roofline.md. Run it on a quiet machine.\n"
    "\n"
    "  --mib N        read buffer in MiB (default 2048; keep it far above the L3 cache)\n"
    "  -r, --runs N   timed runs per figure, after one warm-up (default 5)\n"
    "  -t, --threads N  threads for the all-cores figures (default: online cores)\n"
    "  --out DIR      where to write the results (default bench/results)\n"
    "  -h, --help     this text\n");
}

static long parse_pos(const char *s, const char *what) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < 1) {
    fprintf(stderr, "bench-roofline: %s must be a positive integer, not '%s'\n", what, s);
    exit(2);
  }
  return v;
}

int main(int argc, char **argv) {
  enum { O_MIB = 1000, O_OUT };
  static const struct option opts[] = {
    {"mib", required_argument, 0, O_MIB}, {"runs", required_argument, 0, 'r'},
    {"threads", required_argument, 0, 't'}, {"out", required_argument, 0, O_OUT},
    {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  long mib = 2048, runs = 5, cores = sysconf(_SC_NPROCESSORS_ONLN);
  const char *out = "bench/results";
  int c;
  while ((c = getopt_long(argc, argv, "r:t:h", opts, NULL)) != -1) {
    switch (c) {
    case O_MIB: mib = parse_pos(optarg, "--mib"); break;
    case 'r': runs = parse_pos(optarg, "--runs"); break;
    case 't': cores = parse_pos(optarg, "--threads"); break;
    case O_OUT: out = optarg; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind < argc) { fprintf(stderr, "bench-roofline: unexpected argument '%s'\n", argv[optind]); return 2; }
  if (cores < 1) cores = 1;
  omp_set_dynamic(0);

  __builtin_cpu_init();
  kvl_bench_report_t *rep = kvl_bench_report_new("roofline", argc, argv);
  double *s = malloc((size_t)runs * sizeof(*s));
  if (!rep || !s) { fprintf(stderr, "bench-roofline: out of memory\n"); return 1; }
  int thread_counts[2] = {1, (int)cores};
  int n_counts = cores > 1 ? 2 : 1;
  struct kvl_bench_stats st;

  /* Bandwidth (peak.h): per thread count its own buffer, first touched by its threads */
  for (int k = 0; k < n_counts; k++) {
    const int th = thread_counts[k];
    const char *risa;
    if (kvl_bench_read_bandwidth((size_t)mib, th, (int)runs, s, &risa) < 0) {
      fprintf(stderr, "bench-roofline: cannot allocate %ld MiB\n", mib);
      return 1;
    }
    for (long r = 0; r < runs; r++)
      fprintf(stderr, "roofline-bandwidth %s threads=%d run %ld/%ld: %.2f GB/s\n", risa, th, r + 1, runs, s[r]);
    kvl_bench_stats_compute(s, (int)runs, &st);
    json_t *o = kvl_bench_report_add(rep, NULL, "roofline-bandwidth", st.median, "GB/s", (int)runs, st.sd);
    json_object_set_new(o, "threads", json_integer(th));
    json_object_set_new(o, "isa", json_string(risa));
    json_object_set_new(o, "buffer_mib", json_integer(mib));
    json_object_set_new(o, "best", json_real(st.max));
    printf("roofline-bandwidth  %-6s threads=%-3d %8.2f GB/s  (sd %.2f, best %.2f)\n", risa, th, st.median, st.sd,
           st.max);
  }

  /* Arithmetic peaks, per data type and ISA the processor has (peak.h). */
  for (int k = 0; k < kvl_bench_peak_count(); k++) {
    const struct kvl_bench_peak *p = kvl_bench_peak_at(k);
    if (!kvl_bench_peak_usable(p)) {
      fprintf(stderr, "roofline-flops: %s on %s not supported by this processor, skipped\n", p->dtype, p->isa);
      continue;
    }
    for (int t = 0; t < n_counts; t++) {
      int th = thread_counts[t];
      kvl_bench_peak_measure(p, th, (int)runs, s);
      for (long r = 0; r < runs; r++)
        fprintf(stderr, "roofline-flops %s %s threads=%d run %ld/%ld: %.1f %s\n", p->dtype, p->isa, th, r + 1, runs,
                s[r], p->unit);
      kvl_bench_stats_compute(s, (int)runs, &st);
      json_t *o = kvl_bench_report_add(rep, NULL, "roofline-flops", st.median, p->unit, (int)runs, st.sd);
      json_object_set_new(o, "dtype", json_string(p->dtype));
      json_object_set_new(o, "isa", json_string(p->isa));
      json_object_set_new(o, "threads", json_integer(th));
      json_object_set_new(o, "best", json_real(st.max));
      printf("roofline-flops      %-4s %-10s threads=%-3d %8.1f %s  (sd %.1f, best %.1f)\n", p->dtype, p->isa, th,
             st.median, p->unit, st.sd, st.max);
    }
  }

  int rc = kvl_bench_report_write(rep, out);
  if (rc == 0) printf("wrote %s/roofline.json and %s/roofline.md\n", out, out);
  kvl_bench_report_free(rep);
  free(s);
  return rc < 0 ? 1 : 0;
}
