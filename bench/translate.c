/* translate.c — bench-translate: time of kvl_translator_apply on spans of the real pair's
 * caches, both directions (DESIGN.md "Translation"; issue [translator]).
 *
 *   translate-<N>  translate N positions of a bf16 source cache into a bf16 target cache
 *                  (every target layer, K and V); value = milliseconds (median of -r runs).
 *
 * Extra fields per result: tokens/s, GB/s over the bytes that must move (the span of the
 * source KV read once + the target KV written) and that as % of the bandwidth roofline
 * (--bw, default from bench/results/roofline.json), GFLOP/s of the map multiplies and
 * % of the fp32 compute roofline: translation of a span is a GEMM, so it is
 * compute-bound long before it is memory-bound. Maps: the committed translators when
 * given (-t), else random maps of the right shapes (ν = 1, affine). Positions are
 * 0..N-1 on both sides. --precision: the products in fp32, in bf16
 * (kvl_translator_use_bf16), or both (default); each row says which ("precision"), and a
 * bf16 row gives its target cache's relative RMS difference to the fp32 one.
 *
 * --backend cuda: kvl_translator_apply_on the CUDA backend, three times: host pools in,
 * host pool out, the copies in the time (precision "cuda-bf16"); then with the pools kept
 * on the device as the scheduler's are (write stamps: the source read in place, the target
 * written in place and copied to the host; "cuda-bf16-kept", whose target cache should
 * equal the staged one: rel_rms_vs_staged); then kept and pinned, as the scheduler's pools
 * also are ("cuda-bf16-kept-pinned": the call returns with the translation queued and
 * the target coming back on a second stream; "call_ms" until it returns, "landed_ms"
 * until the target is on the host, kvl_backend_host_sync). Every value is the time until
 * the translation has run on the device (kvl_backend_sync). --shapes: no model files:
 * the pair's fingerprints, KV layouts and RoPEs from their known shapes (for a machine
 * without the models, e.g. a lent GPU; random maps then).
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_backend.h"
#include "bench_common.h"
#include "kvl_error.h"
#include "kvl_model.h"
#include "kvl_quant.h"
#include "kvl_translator.h"

static double roofline_value(const char *test) {
  json_error_t je;
  json_t *j = json_load_file("bench/results/roofline.json", 0, &je), *r;
  size_t i;
  double v = 0;
  if (!j) return 0;
  json_array_foreach(json_object_get(j, "results"), i, r) {
    if (!strcmp(json_string_value(json_object_get(r, "test")), test) &&
        json_integer_value(json_object_get(r, "threads")) != 1 && json_real_value(json_object_get(r, "value")) > v)
      v = json_real_value(json_object_get(r, "value")); /* all cores, best ISA */
  }
  json_decref(j);
  return v;
}

static char *model_path(const char *file) {
  const char *dir = getenv("KVLINGO_MODELS");
  char def[4096];
  if (!dir || !*dir) {
    snprintf(def, sizeof(def), "%s/.cache/kvlingo/models", getenv("HOME") ? getenv("HOME") : ".");
    dir = def;
  }
  char *p = malloc(strlen(dir) + strlen(file) + 2);
  sprintf(p, "%s/%s", dir, file);
  return p;
}

static kvl_translator_t *random_translator(const struct kvl_model_fingerprint *s,
                                           const struct kvl_model_fingerprint *d) {
  char err[256];
  kvl_translator_t *t;
  if (kvl_translator_new(s, d, true, &t, err, sizeof(err)) < 0) return NULL;
  int64_t rows = kvl_fingerprint_kv_width(s) + 1, cols = kvl_fingerprint_kv_width(d);
  float *m = malloc((size_t)(rows * cols) * sizeof(float));
  unsigned long long x = 7;
  for (int64_t i = 0; i < rows * cols; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    m[i] = (float)((x >> 40) * (1.0 / 16777216.0) - 0.5) * 0.1f;
  }
  for (int l = 0; l < d->n_layer; l++) {
    int32_t src = (int32_t)((int64_t)l * (s->n_layer - 1) / (d->n_layer > 1 ? d->n_layer - 1 : 1));
    kvl_translator_set_map(t, l, KVL_TRANSLATOR_K, &src, 1, m);
    kvl_translator_set_map(t, l, KVL_TRANSLATOR_V, &src, 1, m);
  }
  free(m);
  return t;
}

int main(int argc, char **argv) {
  static const struct option opts[] = {{"runs", required_argument, 0, 'r'}, {"out", required_argument, 0, 'o'},
                                       {"translator", required_argument, 0, 't'}, {"bw", required_argument, 0, 'b'},
                                       {"max", required_argument, 0, 'm'}, {"precision", required_argument, 0, 'p'},
                                       {"backend", required_argument, 0, 'B'}, {"shapes", no_argument, 0, 'S'},
                                       {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int runs = 5, max_n = 16384, c, nt = 0;
  bool cuda = false, shapes = false;
  const char *out = "bench/results", *tfiles[8], *precision = "both";
  double bw = 0;
  while ((c = getopt_long(argc, argv, "r:o:t:b:m:p:h", opts, NULL)) != -1) {
    switch (c) {
    case 'r': runs = atoi(optarg); break;
    case 'o': out = optarg; break;
    case 't': if (nt < 8) tfiles[nt++] = optarg; break;
    case 'b': bw = atof(optarg); break;
    case 'm': max_n = atoi(optarg); break;
    case 'p': precision = optarg; break;
    case 'B':
      if (kvl_bench_backend_opt("bench-translate", optarg, &cuda)) return 2;
      break;
    case 'S': shapes = true; break;
    case 'h':
      printf("usage: bench-translate [-r RUNS] [-t TRANSLATOR ...] [--bw GB/s] [--max N] [-o DIR]\n"
             "                       [--precision fp32|bf16|both] [--backend cpu|cuda|cuda-sim] [--shapes]\n"
             "Times translating spans of 64, 512, 4096, 16384 (32768 with --max) tokens in each direction of the\n"
             "Qwen2.5-Coder pair; writes DIR/translate.json and .md. --precision: the products in\n"
             "fp32, in bf16 (kvl_translator_use_bf16; where the processor can), or both (default;\n"
             "the bf16 rows then carry their output's relative RMS difference to the fp32 one).\n"
             "--backend cuda: translate on the CUDA backend, pools staged (copies in and out included),\n"
             "kept on the device (the target still copied out), and kept and pinned (the scheduler's\n"
             "way: the call returns at once, the target comes back after it: call_ms, landed_ms);\n"
             "each value: until the translation has run on the device.\n"
             "--shapes: without the model files: the pair's shapes and random maps.\n");
      return 0;
    default: return 2;
    }
  }
  if (runs < 1) return 2;
  if (strcmp(precision, "fp32") && strcmp(precision, "bf16") && strcmp(precision, "both")) {
    fprintf(stderr, "bench-translate: --precision: expected fp32, bf16 or both, got '%s'\n", precision);
    return 2;
  }
  /* the CPU's rooflines (bench-roofline's file): no yardstick for a GPU */
  if (bw <= 0 && !cuda) bw = roofline_value("roofline-bandwidth");
  double flops_peak = cuda ? 0 : roofline_value("roofline-flops");
  char err[512];
  const char *files[2] = {"qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"};
  const char *names[2] = {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"};
  kvl_model_t *m[2] = {NULL, NULL};
  struct kvl_model_fingerprint fp[2];
  struct kvl_rope rope[2];
  kvl_backend_t *be = NULL; /* NULL: translator/apply.c on the host */
  if (cuda && !(be = kvl_bench_backend("bench-translate", true))) return 1;
  for (int i = 0; i < 2 && shapes; i++) {
    kvl_fingerprint_of_shape(&fp[i], i ? 28 : 24, 2, i ? 128 : 64, 1e6, names[i]); /* the pair's shapes */
    kvl_rope_init(&rope[i], fp[i].head_dim, (float)fp[i].rope_theta);
  }
  for (int i = 0; i < 2 && !shapes; i++) {
    char *p = model_path(files[i]);
    if (kvl_model_open(p, &m[i], err, sizeof(err)) < 0 ||
        kvl_fingerprint_from_gguf(kvl_model_gguf(m[i]), &fp[i], err, sizeof(err)) < 0) {
      fprintf(stderr, "bench-translate: %s: %s (scripts/fetch-models)\n", p, err);
      return 1;
    }
    rope[i] = *kvl_model_rope(m[i]);
    free(p);
  }
  kvl_bench_report_t *rep = kvl_bench_report_new("translate", argc, argv);
  static const int spans[] = {64, 512, 4096, 16384, 32768};
  for (int dir = 0; dir < 2; dir++) {
    int s = dir, d = 1 - dir;
    kvl_translator_t *t = NULL;
    const char *tname = "random nu=1 affine";
    for (int i = 0; i < nt && !t; i++) {
      kvl_translator_t *x;
      if (kvl_translator_load(tfiles[i], &x, err, sizeof(err)) == 0) {
        if (kvl_translator_check_models(x, &fp[s], &fp[d], err, sizeof(err)) == 0) {
          t = x;
          tname = strrchr(tfiles[i], '/') ? strrchr(tfiles[i], '/') + 1 : tfiles[i];
        } else
          kvl_translator_free(x);
      }
    }
    if (!t) t = random_translator(&fp[s], &fp[d]);
    struct kvl_kv_layout ls = {fp[s].n_layer, fp[s].n_kv_head, fp[s].head_dim, KVL_KV_BF16},
                         ld = {fp[d].n_layer, fp[d].n_kv_head, fp[d].head_dim, KVL_KV_BF16};
    int64_t flop_per_tok = 0;
    for (int l = 0; l < fp[d].n_layer; l++)
      for (int kv = 0; kv < 2; kv++) {
        struct kvl_translator_map mp;
        kvl_translator_get_map(t, l, kv, &mp);
        flop_per_tok += 2 * mp.rows * mp.cols;
      }
    for (size_t si = 0; si < sizeof(spans) / sizeof(spans[0]); si++) {
      int n = spans[si];
      if (n > max_n) break;
      int32_t nb = (n + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK;
      size_t ps_mapped = 0, pd_mapped = 0; /* as the daemon's pools */
      void *ps = kvl_huge_alloc((size_t)nb * kvl_kv_block_bytes(&ls), &ps_mapped),
           *pd = kvl_huge_alloc((size_t)nb * kvl_kv_block_bytes(&ld), &pd_mapped);
      int32_t *table = malloc((size_t)nb * sizeof(int32_t)), *pos = malloc((size_t)n * sizeof(int32_t));
      if (!ps || !pd || !table || !pos) {
        fprintf(stderr, "bench-translate: out of memory for %d positions\n", n);
        return 1;
      }
      /* a plausible source cache: small bf16 values (0x3c00..0x3cff ≈ 0.008..0.016) */
      uint16_t *h = ps;
      for (size_t i = 0; i < (size_t)nb * kvl_kv_block_bytes(&ls) / 2; i++) h[i] = (uint16_t)(0x3c00 | (i * 37 & 0xff));
      for (int32_t b = 0; b < nb; b++) table[b] = b;
      for (int i = 0; i < n; i++) pos[i] = i;
      struct kvl_translate_span sp = {.src_layout = &ls, .src_base = ps, .src_table = table,
                                      .src_rope = &rope[s], .src_pos = pos, .dst_layout = &ld,
                                      .dst_base = pd, .dst_table = table, .dst_rope = &rope[d],
                                      .dst_pos = pos, .n = n};
      /* --backend cuda's second pass: the pools kept on the device, as the scheduler's
       * (write stamps; the target's renewed before each call, as kvl_line_translate does) */
      uint64_t *stamps = malloc(2 * (size_t)nb * sizeof(uint64_t));
      if (!stamps) return 1;
      for (int32_t b = 0; b < 2 * nb; b++) stamps[b] = kvl_kv_stamp_new();
      const size_t dbytes = (size_t)nb * kvl_kv_block_bytes(&ld);
      uint16_t *ref = NULL; /* the fp32 products' target cache, to compare the bf16 one with */
      /* --backend cuda's third pass: kept and pinned, as the scheduler's pools are: the
       * call returns with the work queued, the target's blocks coming back on a second
       * stream ("call_ms", "landed_ms": kvl_backend_host_sync) */
      bool pin_s = false, pin_d = false;
      for (int prec = 0; prec < (cuda ? 3 : 2); prec++) {
        if (cuda && prec == 1) /* the device's own precision, staged then kept */
          sp.src_stamps = stamps, sp.dst_stamps = stamps + nb, sp.src_blocks = sp.dst_blocks = nb;
        if (cuda && prec == 2) {
          pin_s = kvl_backend_host_register(be, ps, (size_t)nb * kvl_kv_block_bytes(&ls));
          pin_d = kvl_backend_host_register(be, pd, dbytes);
          if (!pin_s || !pin_d) break;
        }
        if (!cuda && ((prec == 0 && !strcmp(precision, "bf16")) || (prec == 1 && !strcmp(precision, "fp32")))) continue;
        if (prec == 1 && !cuda && kvl_translator_use_bf16(t, true, err, sizeof(err)) < 0) {
          fprintf(stderr, "bench-translate: bf16: %s\n", err);
          break;
        }
        for (int32_t b = 0; b < nb && sp.dst_stamps; b++) stamps[nb + b] = kvl_kv_stamp_new();
        if (kvl_translator_apply_on(t, be, &sp, err, sizeof(err)) < 0) { /* warm-up, also a check */
          fprintf(stderr, "bench-translate: %s\n", err);
          return 1;
        }
        kvl_backend_host_sync(be, NULL, 0);
        double rel = -1;
        if (prec == 0) {
          ref = malloc(dbytes);
          memcpy(ref, pd, dbytes);
        } else if (ref) { /* both caches are bf16 */
          double d2 = 0, r2 = 0;
          for (size_t i = 0; i < dbytes / 2; i++) {
            double a = kvl_bf16_to_fp32(ref[i]), b = kvl_bf16_to_fp32(((uint16_t *)pd)[i]);
            d2 += (a - b) * (a - b), r2 += a * a;
          }
          rel = r2 > 0 ? sqrt(d2 / r2) : 0;
        }
        double *x = malloc(3 * (size_t)runs * sizeof(double)), *landed = x + runs, *call = x + 2 * runs;
        for (int r = 0; r < runs; r++) {
          for (int32_t b = 0; b < nb && sp.dst_stamps; b++) stamps[nb + b] = kvl_kv_stamp_new();
          double t0 = kvl_bench_now();
          kvl_translator_apply_on(t, be, &sp, err, sizeof(err));
          call[r] = kvl_bench_now() - t0;
          kvl_backend_sync(be); /* the translation has run on the device */
          x[r] = kvl_bench_now() - t0;
          kvl_backend_host_sync(be, NULL, 0);
          landed[r] = kvl_bench_now() - t0;
        }
        struct kvl_bench_stats st, sl, sc;
        kvl_bench_stats_compute(x, runs, &st);
        kvl_bench_stats_compute(landed, runs, &sl);
        kvl_bench_stats_compute(call, runs, &sc);
        double bytes = (double)n * ((double)fp[s].n_layer * 2 * kvl_fingerprint_kv_width(&fp[s]) * 2 +
                                    (double)fp[d].n_layer * 2 * kvl_fingerprint_kv_width(&fp[d]) * 2);
        char test[64], model[128];
        snprintf(test, sizeof(test), "translate-%d", n);
        snprintf(model, sizeof(model), "%s->%s", names[s], names[d]);
        json_t *res = kvl_bench_report_add(rep, model, test, st.median * 1e3, "ms", runs, st.sd * 1e3);
        json_object_set_new(res, "tokens_per_s", json_real(n / st.median));
        json_object_set_new(res, "gbps", json_real(bytes / st.median / 1e9));
        if (bw > 0) json_object_set_new(res, "bw_roofline_pct", json_real(100 * bytes / st.median / 1e9 / bw));
        json_object_set_new(res, "gflops", json_real((double)flop_per_tok * n / st.median / 1e9));
        if (flops_peak > 0)
          json_object_set_new(res, "compute_roofline_pct",
                              json_real(100 * (double)flop_per_tok * n / st.median / 1e9 / flops_peak));
        json_object_set_new(res, "translator", json_string(tname));
        json_object_set_new(res, "kv", json_string("bf16"));
        static const char *const cnames[3] = {"cuda-bf16", "cuda-bf16-kept", "cuda-bf16-kept-pinned"};
        const char *pname = cuda ? cnames[prec] : prec ? "bf16" : "fp32";
        json_object_set_new(res, "precision", json_string(pname));
        if (prec == 2) {
          json_object_set_new(res, "landed_ms", json_real(sl.median * 1e3));
          json_object_set_new(res, "call_ms", json_real(sc.median * 1e3));
        }
        json_object_set_new(res, "backend", json_string(be ? kvl_backend_name(be) : "cpu (translator/apply.c)"));
        if (shapes) json_object_set_new(res, "models", json_string("shapes only (--shapes)"));
        if (rel >= 0) json_object_set_new(res, cuda ? "rel_rms_vs_staged" : "rel_rms_vs_fp32", json_real(rel));
        fprintf(stderr, "%s %s %s: %.2f ms (%.0f tokens/s, %.1f GB/s, %.0f GFLOP/s)", model, test, pname,
                st.median * 1e3, n / st.median, bytes / st.median / 1e9, (double)flop_per_tok * n / st.median / 1e9);
        if (rel >= 0) fprintf(stderr, ", relative RMS difference to %s %.2e", cuda ? "staged" : "fp32", rel);
        if (prec == 2) fprintf(stderr, ", the call returns after %.2f ms, on the host after %.2f ms", sc.median * 1e3,
                               sl.median * 1e3);
        fprintf(stderr, "\n");
        free(x);
      }
      kvl_translator_use_bf16(t, false, NULL, 0);
      if (pin_s) kvl_backend_host_unregister(be, ps);
      if (pin_d) kvl_backend_host_unregister(be, pd);
      free(ref);
      kvl_huge_free(ps, ps_mapped);
      kvl_huge_free(pd, pd_mapped);
      free(table);
      free(pos);
      free(stamps);
    }
    kvl_translator_free(t);
  }
  int rc = kvl_bench_report_write(rep, out);
  kvl_bench_report_free(rep);
  for (int i = 0; i < 2; i++)
    if (m[i]) kvl_model_free(m[i]);
  return rc < 0 ? 1 : 0;
}
