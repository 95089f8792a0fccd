/* sgemm.c — the dense fp32 products of translation and training (kvl_sgemm): oneDNN's
 * sgemm, which JIT-compiles for the processor it runs on (AVX-512 on a Zen 5, where
 * Debian's OpenBLAS 0.3.21 does not know the core and runs its Haswell kernels: at the
 * translation's and training's shapes oneDNN ran 1.5-2.2x faster there, bench/README.md).
 * OpenBLAS where oneDNN refuses, or when KVL_SGEMM=openblas asks for it (to compare).
 * Inside an OpenMP parallel region (the training's per-head attention) each call runs on
 * its own thread, as OpenBLAS's OpenMP build did. */
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_kernels.h"

static bool use_openblas(void) {
  static int v = -1;
  if (v < 0) {
    const char *e = getenv("KVL_SGEMM");
    v = e && strcmp(e, "openblas") == 0;
  }
  return v;
}

void kvl_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
               const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (!use_openblas() && dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C,
                                    ldc) == dnnl_success)
    return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N,
              (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}
