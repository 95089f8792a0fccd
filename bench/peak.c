/* peak.c — the arithmetic peak per data type (peak.h): register-resident chains of one
 * instruction, enough independent ones to cover its latency on every port that runs it.
 * Nothing here reads memory inside the loops; each kernel returns a value built from all
 * its chains, which the caller keeps, so no chain can be dropped. */
#include "peak.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bench_common.h"

typedef float (*peak_fn)(int64_t iters);

/* 16 named accumulators, each updated by OP(acc) once per step (named, not an array:
 * GCC keeps them in registers without copies). */
#define CHAINS16(T, INIT, OP, SUM)                                                          \
  T c0 = INIT(0), c1 = INIT(1), c2 = INIT(2), c3 = INIT(3), c4 = INIT(4), c5 = INIT(5),      \
    c6 = INIT(6), c7 = INIT(7), c8 = INIT(8), c9 = INIT(9), c10 = INIT(10), c11 = INIT(11), \
    c12 = INIT(12), c13 = INIT(13), c14 = INIT(14), c15 = INIT(15);                         \
  for (int64_t i = 0; i < iters; i++) {                                                     \
    c0 = OP(c0); c1 = OP(c1); c2 = OP(c2); c3 = OP(c3); c4 = OP(c4); c5 = OP(c5);           \
    c6 = OP(c6); c7 = OP(c7); c8 = OP(c8); c9 = OP(c9); c10 = OP(c10); c11 = OP(c11);       \
    c12 = OP(c12); c13 = OP(c13); c14 = OP(c14); c15 = OP(c15);                             \
  }                                                                                         \
  T s = SUM(SUM(SUM(SUM(c0, c1), SUM(c2, c3)), SUM(SUM(c4, c5), SUM(c6, c7))),              \
            SUM(SUM(SUM(c8, c9), SUM(c10, c11)), SUM(SUM(c12, c13), SUM(c14, c15))))

/* ---- f32: x = x * a + b ------------------------------------------------------------
 * 16 chains (12 on AVX2) cover FMA latency x ports (4 cycles x 2 ports on current
 * Intel/AMD cores). a = 1 - 2^-20 and b = 2^-20 pull every chain towards 1, so nothing
 * overflows or goes denormal however long it runs. */
#define FMA_A (1.0f - 0x1p-20f)
#define FMA_B 0x1p-20f

__attribute__((target("avx512f"))) static float f32_avx512(int64_t iters) {
  const __m512 a = _mm512_set1_ps(FMA_A), b = _mm512_set1_ps(FMA_B);
#define INIT(j) _mm512_set1_ps(0.5f + 0.05f * (float)(j))
#define OP(c) _mm512_fmadd_ps(c, a, b)
  CHAINS16(__m512, INIT, OP, _mm512_add_ps);
#undef INIT
#undef OP
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float f32_avx2(int64_t iters) {
  const __m256 a = _mm256_set1_ps(FMA_A), b = _mm256_set1_ps(FMA_B);
  __m256 c[12];
  for (int j = 0; j < 12; j++) c[j] = _mm256_set1_ps(0.5f + 0.05f * (float)j);
  for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) c[j] = _mm256_fmadd_ps(c[j], a, b);
  __m256 s = c[0];
  for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, c[j]);
  float v[8];
  _mm256_storeu_ps(v, s);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

/* ---- bf16: c += a . b over pairs (vdpbf16ps), fp32 accumulators ---------------------
 * a = 1, b = 2^-20: each chain grows by 2^-19 a step, far from overflow. */
__attribute__((target("avx512f,avx512bf16"))) static float bf16_avx512(int64_t iters) {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-20f), _mm512_set1_ps(0x1p-20f));
#define INIT(j) _mm512_set1_ps((float)(j))
#define OP(c) _mm512_dpbf16_ps(c, a, b)
  CHAINS16(__m512, INIT, OP, _mm512_add_ps);
#undef INIT
#undef OP
  return _mm512_reduce_add_ps(s);
}

/* ---- s8: unsigned x signed bytes, 4 per int32 lane ---------------------------------
 * Integer accumulators wrap harmlessly (the instructions define it). */
/* GCC 12 surrounds _mm512_dpbusd_epi32 chains with register copies (two per product
 * in this loop); the instruction written out keeps the loop to the 16 products. */
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline __m512i dpbusd(__m512i c, __m512i a,
                                                                                          __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
  return c;
}

__attribute__((target("avx512f,avx512vnni"))) static float s8_avx512vnni(int64_t iters) {
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
#define INIT(j) _mm512_set1_epi32(j)
#define OP(c) dpbusd(c, a, b)
  CHAINS16(__m512i, INIT, OP, _mm512_add_epi32);
#undef INIT
#undef OP
  return (float)_mm512_reduce_add_epi32(s);
}

/* AVX2 has no int8 dot product: the int8 kernels (qdot_avx2.c, qmatmul_avx2.c) pair
 * vpmaddubsw (u8 x s8 -> s16 pairs) with vpmaddwd by ones (-> s32) and vpaddd. The
 * products do not depend on the accumulators, so the empty asm tells the compiler the
 * inputs change every step (otherwise it would hoist them out of the loop); the
 * processor sees no instruction for it. */
__attribute__((target("avx2"))) static float s8_avx2(int64_t iters) {
  const __m256i b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3), a3 = _mm256_set1_epi8(4);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
  for (int64_t i = 0; i < iters; i++) {
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3));
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b), ones));
    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b), ones));
    c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(_mm256_maddubs_epi16(a2, b), ones));
    c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(_mm256_maddubs_epi16(a3, b), ones));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
  int32_t v[8];
  _mm256_storeu_si256((__m256i *)v, s);
  return (float)(v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]);
}

/* ---- AMX: four 16x16 accumulator tiles, two A and two B tiles ----------------------
 * Tiles 0-3 accumulate, 4-5 hold A (16 rows x 64 bytes), 6-7 hold B (16 rows x 64 bytes:
 * 64 int8 or 32 bf16 pairs per row), loaded once; each step issues the four products.
 * Linux grants the tile state to a process that asks for it (arch_prctl). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tilecfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static bool amx_granted(unsigned edx_bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> edx_bit & 1)) return false;
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

__attribute__((target("amx-tile"))) static void amx_setup(const void *src) {
  struct tilecfg cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, src, 64);
  _tile_loadd(5, src, 64);
  _tile_loadd(6, src, 64);
  _tile_loadd(7, src, 64);
}

__attribute__((target("amx-tile"))) static float amx_finish(void) {
  _Alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  float v = out[0];
  _tile_stored(3, out, 64);
  _tile_release();
  return v + out[255];
}

__attribute__((target("amx-tile,amx-int8"))) static float s8_amx(int64_t iters) {
  _Alignas(64) uint8_t src[16 * 64];
  memset(src, 1, sizeof(src));
  amx_setup(src);
  for (int64_t i = 0; i < iters; i++) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  return amx_finish();
}

__attribute__((target("amx-tile,amx-bf16"))) static float bf16_amx(int64_t iters) {
  _Alignas(64) uint16_t src[16 * 32];
  for (int i = 0; i < 16 * 32; i++) src[i] = 0x3580; /* bf16 2^-20 */
  amx_setup(src);
  for (int64_t i = 0; i < iters; i++) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  return amx_finish();
}

/* ---- the table ------------------------------------------------------------------------ */

enum { U_AVX512F, U_AVX2FMA, U_AVX512BF16, U_AVX512VNNI, U_AVX2, U_AMX_INT8, U_AMX_BF16 };

static const struct probe {
  struct kvl_bench_peak pub;
  peak_fn f;
  double ops_per_iter; /* per thread: chains x MACs per instruction x 2 */
  int need;
} probes[] = {
  {{"f32", "avx512", "GFLOP/s"}, f32_avx512, 16 * 16 * 2.0, U_AVX512F},
  {{"f32", "avx2", "GFLOP/s"}, f32_avx2, 12 * 8 * 2.0, U_AVX2FMA},
  {{"bf16", "avx512bf16", "GFLOP/s"}, bf16_avx512, 16 * 32 * 2.0, U_AVX512BF16},
  {{"bf16", "amx", "GFLOP/s"}, bf16_amx, 4 * 16 * 16 * 32 * 2.0, U_AMX_BF16},
  {{"s8", "avx512vnni", "GOP/s"}, s8_avx512vnni, 16 * 64 * 2.0, U_AVX512VNNI},
  {{"s8", "avx2", "GOP/s"}, s8_avx2, 4 * 32 * 2.0, U_AVX2},
  {{"s8", "amx", "GOP/s"}, s8_amx, 4 * 16 * 16 * 64 * 2.0, U_AMX_INT8},
};
#define N_PROBES ((int)(sizeof(probes) / sizeof(probes[0])))

int kvl_bench_peak_count(void) { return N_PROBES; }

const struct kvl_bench_peak *kvl_bench_peak_at(int i) { return i >= 0 && i < N_PROBES ? &probes[i].pub : NULL; }

static const struct probe *probe_of(const struct kvl_bench_peak *p) {
  for (int i = 0; i < N_PROBES; i++)
    if (p == &probes[i].pub) return &probes[i];
  return NULL;
}

const struct kvl_bench_peak *kvl_bench_peak_find(const char *dtype, const char *isa) {
  for (int i = 0; i < N_PROBES; i++)
    if (!strcmp(probes[i].pub.dtype, dtype) && !strcmp(probes[i].pub.isa, isa)) return &probes[i].pub;
  return NULL;
}

bool kvl_bench_peak_usable(const struct kvl_bench_peak *p) {
  const struct probe *q = probe_of(p);
  if (!q) return false;
  __builtin_cpu_init();
  switch (q->need) {
  case U_AVX512F: return __builtin_cpu_supports("avx512f");
  case U_AVX2FMA: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  case U_AVX512BF16: return __builtin_cpu_supports("avx512bf16");
  case U_AVX512VNNI: return __builtin_cpu_supports("avx512vnni");
  case U_AVX2: return __builtin_cpu_supports("avx2");
  case U_AMX_INT8: return amx_granted(25);
  case U_AMX_BF16: return amx_granted(22);
  }
  return false;
}

/* Everything a kernel returns lands here, so no call can be optimised away. */
static volatile float sink;

/* Seconds for `threads` threads to each run `iters` steps of f. */
static double time_probe(peak_fn f, int64_t iters, int threads) {
  float total = 0;
  double t0 = kvl_bench_now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  total += f(iters);
  double dt = kvl_bench_now() - t0;
  sink += total;
  return dt;
}

double kvl_bench_peak_measure(const struct kvl_bench_peak *p, int threads, int runs, double *samples) {
  const struct probe *q = probe_of(p);
  if (!q || !kvl_bench_peak_usable(p) || threads < 1 || runs < 1) return -1;
  /* steps calibrated on one thread so that one run takes about 0.25 s */
  int64_t iters = 1 << 10;
  double dt;
  while ((dt = time_probe(q->f, iters, 1)) < 0.02) iters *= 8;
  iters = (int64_t)((double)iters * 0.25 / dt) + 1;
  double *s = samples ? samples : malloc((size_t)runs * sizeof(*s));
  if (!s) return -1;
  time_probe(q->f, iters, threads); /* warm-up (and frequency settling) */
  for (int r = 0; r < runs; r++) s[r] = q->ops_per_iter * (double)iters * threads / time_probe(q->f, iters, threads) / 1e9;
  double med = kvl_bench_median(s, runs);
  if (!samples) free(s);
  return med;
}

/* ---- memory read bandwidth (peak.h) ---------------------------------------------------
 * Each reader sums n floats (n a multiple of READ_STEP, p 64-byte aligned) into 8
 * independent accumulators, so the adds never limit the loads; the sum is returned so the
 * loads cannot be dropped. */
#define READ_STEP 128 /* floats per loop iteration: 512 bytes, 8 cache lines */

__attribute__((target("avx512f"))) static float read_avx512(const float *p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (size_t i = 0; i < n; i += READ_STEP) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i + 0));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
    a4 = _mm512_add_ps(a4, _mm512_load_ps(p + i + 64));
    a5 = _mm512_add_ps(a5, _mm512_load_ps(p + i + 80));
    a6 = _mm512_add_ps(a6, _mm512_load_ps(p + i + 96));
    a7 = _mm512_add_ps(a7, _mm512_load_ps(p + i + 112));
  }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2"))) static float read_avx2(const float *p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (size_t i = 0; i < n; i += READ_STEP) {
    /* 16 loads of 32 bytes; 8 accumulators, each fed twice */
    a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_load_ps(p + i + 0), _mm256_load_ps(p + i + 8)));
    a1 = _mm256_add_ps(a1, _mm256_add_ps(_mm256_load_ps(p + i + 16), _mm256_load_ps(p + i + 24)));
    a2 = _mm256_add_ps(a2, _mm256_add_ps(_mm256_load_ps(p + i + 32), _mm256_load_ps(p + i + 40)));
    a3 = _mm256_add_ps(a3, _mm256_add_ps(_mm256_load_ps(p + i + 48), _mm256_load_ps(p + i + 56)));
    a4 = _mm256_add_ps(a4, _mm256_add_ps(_mm256_load_ps(p + i + 64), _mm256_load_ps(p + i + 72)));
    a5 = _mm256_add_ps(a5, _mm256_add_ps(_mm256_load_ps(p + i + 80), _mm256_load_ps(p + i + 88)));
    a6 = _mm256_add_ps(a6, _mm256_add_ps(_mm256_load_ps(p + i + 96), _mm256_load_ps(p + i + 104)));
    a7 = _mm256_add_ps(a7, _mm256_add_ps(_mm256_load_ps(p + i + 112), _mm256_load_ps(p + i + 120)));
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

/* Portable fallback (the compiler's baseline vectorisation). */
static float read_scalar(const float *p, size_t n) {
  float a[8] = {0};
  for (size_t i = 0; i < n; i += 8)
    for (int j = 0; j < 8; j++) a[j] += p[i + j];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

/* Everything a reader returns lands here, so no read can be optimised away. */
static volatile float read_sink;

typedef float (*read_fn)(const float *p, size_t n);

/* Seconds for `threads` threads to read their shares of buf[0..n) once. */
static double time_read(read_fn f, const float *buf, size_t n, int threads) {
  float total = 0;
  double t0 = kvl_bench_now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    size_t steps = n / READ_STEP, t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
    size_t lo = steps * t / nt * READ_STEP, hi = steps * (t + 1) / nt * READ_STEP;
    total += f(buf + lo, hi - lo);
  }
  double dt = kvl_bench_now() - t0;
  read_sink += total;
  return dt;
}

double kvl_bench_read_bandwidth(size_t mib, int threads, int runs, double *samples, const char **isa) {
  const size_t bytes = mib << 20, n = bytes / sizeof(float);
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa) *isa = has512 ? "avx512" : has2 ? "avx2" : "scalar";
  /* 2 MiB-aligned, advised onto huge pages so TLB misses do not cost bandwidth, first
   * touched by the threads that read it */
  float *buf = aligned_alloc(2u << 20, bytes);
  double *s = samples ? samples : malloc((size_t)(runs > 0 ? runs : 1) * sizeof(double));
  if (!buf || !s || runs < 1) {
    free(buf);
    if (!samples) free(s);
    return -1.0;
  }
  madvise(buf, bytes, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * (1.0f / 1024.0f);
  const read_fn f = has512 ? read_avx512 : has2 ? read_avx2 : read_scalar;
  time_read(f, buf, n, threads); /* warm-up */
  for (int r = 0; r < runs; r++) s[r] = (double)bytes / time_read(f, buf, n, threads) / 1e9;
  const double med = kvl_bench_median(s, runs);
  if (!samples) free(s);
  free(buf);
  return med;
}
