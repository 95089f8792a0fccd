/* pipes.c — which AVX-512 operations compete with vpdpbusd for the same execution pipes:
 * a loop of 16 independent vpdpbusd alone, then with 4 of another operation mixed in;
 * where the loop gets slower, the operation takes a vpdpbusd pipe (the lanes kernels'
 * float epilogue: bench/README.md, session 36). Run on an idle machine:
 *
 *   cc -O2 bench/kernel-ab/pipes.c -o /tmp/pipes && /tmp/pipes
 *
 * Needs AVX-512 VNNI at run time (says so and stops otherwise). */
#include <cpuid.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERS 20000000L
/* 16 independent OP per iteration (zmm0-7, twice) */
#define OP16(op)                                                                                               \
  ".rept 2\n" op " %%zmm20, %%zmm21, %%zmm0\n" op " %%zmm20, %%zmm21, %%zmm1\n" op " %%zmm20, %%zmm21, %%zmm2\n"   \
  op " %%zmm20, %%zmm21, %%zmm3\n" op " %%zmm20, %%zmm21, %%zmm4\n" op " %%zmm20, %%zmm21, %%zmm5\n"             \
  op " %%zmm20, %%zmm21, %%zmm6\n" op " %%zmm20, %%zmm21, %%zmm7\n.endr\n"
#define DP16 OP16("vpdpbusd")
#define X4(op) op " %%zmm22, %%zmm23, %%zmm8\n" op " %%zmm22, %%zmm23, %%zmm9\n" \
               op " %%zmm22, %%zmm23, %%zmm10\n" op " %%zmm22, %%zmm23, %%zmm11\n"
/* the fastest of 5 timings of ITERS iterations of body, in ns per iteration */
#define TIME(var, body)                                                                                       \
  do {                                                                                                         \
    var = 1e30;                                                                                                \
    for (int r = 0; r < 5; r++) {                                                                              \
      const double t0 = now();                                                                                 \
      __asm__ volatile("mov %0, %%rcx\n1:\n" body "dec %%rcx\njnz 1b\n" ::"r"(ITERS)                   \
                       : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",         \
                         "xmm9", "xmm10", "xmm11");                                                            \
      const double dt = (now() - t0) / ITERS * 1e9;                                                            \
      var = dt < var ? dt : var;                                                                                \
    }                                                                                                          \
  } while (0)

int main(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(c & (1u << 11)) || !(b & (1u << 16))) {
    puts("pipes: this processor has no AVX-512 VNNI");
    return 0;
  }
  double base, t;
  TIME(base, DP16);
  printf("16 vpdpbusd alone            %6.3f ns per iteration\n", base);
  static const char *names[] = {"vmulps", "vfmadd231ps", "vpmulld", "vpmaddwd", "vcvtdq2ps", "vaddps",
                                "vpaddd", "vpslld $3 (shift)", "vpsllvd (shift by lane)"};
  for (int i = 0; i < 9; i++) {
    switch (i) {
    case 0: TIME(t, DP16 X4("vmulps")); break;
    case 1: TIME(t, DP16 X4("vfmadd231ps")); break;
    case 2: TIME(t, DP16 X4("vpmulld")); break;
    case 3: TIME(t, DP16 X4("vpmaddwd")); break;
    case 4:
      TIME(t, DP16 "vcvtdq2ps %%zmm22, %%zmm8\n vcvtdq2ps %%zmm22, %%zmm9\n vcvtdq2ps %%zmm22, %%zmm10\n"
              "vcvtdq2ps %%zmm22, %%zmm11\n");
      break;
    case 5: TIME(t, DP16 X4("vaddps")); break;
    case 6: TIME(t, DP16 X4("vpaddd")); break;
    case 7:
      TIME(t, DP16 "vpslld $3, %%zmm23, %%zmm8\n vpslld $3, %%zmm23, %%zmm9\n vpslld $3, %%zmm23, %%zmm10\n"
              "vpslld $3, %%zmm23, %%zmm11\n");
      break;
    default: TIME(t, DP16 X4("vpsllvd"));
    }
    printf("  + 4 %-22s %6.3f ns  (x%.3f: %s)\n", names[i], t, t / base,
           t / base > 1.1 ? "shares vpdpbusd's pipes" : "free");
  }
  /* AVX512_BF16 (leaf 7, subleaf 1, EAX bit 5): vdpbf16ps, two bf16 products added into
   * each fp32 lane, against vfmadd231ps; the same time per instruction is twice the work
   * (the attention's bf16 products: bench/README.md, session 37) */
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) {
    double fma, dpbf;
    TIME(fma, OP16("vfmadd231ps"));
    TIME(dpbf, OP16("vdpbf16ps"));
    printf("16 vfmadd231ps alone         %6.3f ns per iteration\n16 vdpbf16ps alone           %6.3f ns (x%.3f)\n", fma,
           dpbf, dpbf / fma);
  }
  return 0;
}
