/* peak.h — the processor's arithmetic peak per data type, measured: register-resident
 * chains of the instruction each of the CPU backend's matmul paths is built on.
 *
 *   dtype  isa          instruction            MACs per instruction
 *   f32    avx512       vfmadd (zmm)           16
 *   f32    avx2         vfmadd (ymm)           8
 *   bf16   avx512bf16   vdpbf16ps (zmm)        32
 *   bf16   amx          tdpbf16ps (16x16x32)   8192
 *   s8     avx512vnni   vpdpbusd (zmm)         64
 *   s8     avx2         vpmaddubsw+vpmaddwd    32 (per pair, plus the vpaddd)
 *   s8     amx          tdpbusd (16x16x64)     16384
 *
 * One multiply-add counts as 2 operations for every dtype, so the figures compare with
 * FLOP counts of matmuls (GOP/s; GFLOP/s for the float types).
 *
 *   const struct kvl_bench_peak *p = kvl_bench_peak_find("s8", "avx512vnni");
 *   if (p && kvl_bench_peak_usable(p)) gops = kvl_bench_peak_measure(p, 2, 5, NULL);
 */
#ifndef KVL_BENCH_PEAK_H
#define KVL_BENCH_PEAK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvl_bench_peak {
  const char *dtype; /* "f32", "bf16", "s8" */
  const char *isa;   /* "avx512", "avx2", "avx512bf16", "avx512vnni", "amx" */
  const char *unit;  /* "GFLOP/s" for floats, "GOP/s" for s8 */
};

/* The probes this build has (whether or not the processor runs them): i in
 * [0, kvl_bench_peak_count()), in the order of the table above. */
int kvl_bench_peak_count(void);
const struct kvl_bench_peak *kvl_bench_peak_at(int i);

/* The probe for (dtype, isa), or NULL. */
const struct kvl_bench_peak *kvl_bench_peak_find(const char *dtype, const char *isa);

/* Whether this processor (and, for AMX, this kernel: the tile state is granted per
 * process) runs the probe. */
bool kvl_bench_peak_usable(const struct kvl_bench_peak *p);

/* The median over `runs` timed runs (after a warm-up) of `threads` threads each running
 * the probe for about 0.25 s, in 1e9 operations/s; the runs' values go to samples[0..runs)
 * when it is not NULL. Returns a negative value when the probe is not usable. */
double kvl_bench_peak_measure(const struct kvl_bench_peak *p, int threads, int runs, double *samples);

/* Read bandwidth in GB/s (1e9 B/s): the median of `runs` reads (after a warm-up) by
 * `threads` threads of a fresh `mib` MiB buffer on huge pages, first touched by those
 * threads, with the widest reader the processor has (its name to *isa: "avx512", "avx2"
 * or "scalar"; isa may be NULL); the runs' values to samples when it is not NULL.
 * Negative when the buffer cannot be had. bench-roofline's figure, and bench-prefill-decode
 * --bw auto's. */
double kvl_bench_read_bandwidth(size_t mib, int threads, int runs, double *samples, const char **isa);

#endif
