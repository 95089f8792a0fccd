/* sim-runtime.cc — the CUDA runtime's and cuBLASLt's subsets of sim.h on the CPU, for the
 * backend (backend.cu) compiled with KVL_CUDA_SIM. Not a GPU: a stand-in that lets the
 * backend's host side (arena, staging, plans, translation's chunks) run its real code in
 * the unit suite; the gpu suite runs the same code against the real libraries. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "sim.h"

struct kvl_sim_lt {
  int unused;
};
struct kvl_sim_pref {
  size_t ws;
};

cudaError_t cudaGetDeviceCount(int *n) {
  *n = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
  if (dev != 0) return cudaErrorInvalidDevice;
  *p = cudaDeviceProp{};
  snprintf(p->name, sizeof(p->name), "kvl_sim (CUDA's execution model on the CPU)");
  p->major = 9, p->minor = 0, p->multiProcessorCount = 132;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
  *free_b = *total_b = (size_t)4 << 30;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
  *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

/* A copy to the host lands at the next cudaStreamSynchronize of its stream, as on a
 * device, where the host may read it only after that: a read before it sees the old bytes
 * here too. A copy to the device is made at once (from pageable memory the runtime copies
 * the source before it returns), and kernels run at their launch, in stream order. */
namespace {
struct pending {
  void *dst;
  std::vector<char> bytes;
  unsigned long long seq; /* its place among the stream's copies */
};
} // namespace
struct kvl_sim_stream {
  std::vector<pending> to_host;
  unsigned long long queued;
};
struct kvl_sim_event {
  kvl_sim_stream *st;
  unsigned long long upto; /* the stream's copies queued when it was recorded */
};
/* the copies of st queued up to `upto` land, in order */
static void land(kvl_sim_stream *st, unsigned long long upto) {
  std::vector<pending> &q = st->to_host;
  size_t k = 0;
  for (size_t i = 0; i < q.size(); i++) {
    if (q[i].seq <= upto) memcpy(q[i].dst, q[i].bytes.data(), q[i].bytes.size());
    else if (k++ != i) q[k - 1] = std::move(q[i]);
  }
  q.resize(k);
}
cudaError_t cudaMallocHost(void **p, size_t bytes) {
  *p = malloc(bytes ? bytes : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}

/* registration pins nothing here; the backend's bookkeeping of it is what the tests see */
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags) {
  (void)flags;
  return p && bytes ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaHostUnregister(void *p) { return p ? cudaSuccess : cudaErrorInvalidValue; }

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t st) {
  if (!bytes) return cudaSuccess;
  if (!st) return cudaErrorInvalidValue; /* the backend never uses the legacy default stream */
  if (kind == cudaMemcpyDeviceToHost)
    st->to_host.push_back(pending{dst, std::vector<char>((const char *)src, (const char *)src + bytes), ++st->queued});
  else memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
  if (!st) return cudaErrorInvalidValue;
  land(st, st->queued);
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags) {
  (void)flags;
  *st = new kvl_sim_stream{{}, 0}; /* lives as long as the process, as the backend's do */
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags) {
  (void)flags;
  *ev = new kvl_sim_event{nullptr, 0};
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st) {
  if (!ev || !st) return cudaErrorInvalidValue;
  ev->st = st, ev->upto = st->queued;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags) {
  (void)flags;
  return st && ev ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  if (!ev) return cudaErrorInvalidValue;
  if (ev->st) land(ev->st, ev->upto);
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInvalidDevice: return "invalid device ordinal";
  }
  return "unknown error";
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  *h = new kvl_sim_lt{0};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t ct, cudaDataType_t scale) {
  if (ct != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new kvl_sim_desc{CUBLAS_OP_N, CUBLAS_OP_N};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *v,
                                              size_t n) {
  if (n != sizeof(cublasOperation_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
  memcpy(a == CUBLASLT_MATMUL_DESC_TRANSA ? &d->ta : &d->tb, v, n);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t t, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if ((t != CUDA_R_32F && t != CUDA_R_16BF) || ld < (int64_t)rows) return CUBLAS_STATUS_NOT_SUPPORTED;
  *l = new kvl_sim_layout{t, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  *p = new kvl_sim_pref{0};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a, const void *v, size_t n) {
  if (a != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES || n != sizeof(size_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
  memcpy(&p->ws, v, n);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

/* the shapes cublasLtMatmul takes: op(A) m x k, op(B) k x n, C and D m x n, fp32 C */
static bool shapes_ok(const kvl_sim_desc *d, const kvl_sim_layout *a, const kvl_sim_layout *b,
                      const kvl_sim_layout *c) {
  const uint64_t m = d->ta == CUBLAS_OP_N ? a->rows : a->cols, ka = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
  const uint64_t kb = d->tb == CUBLAS_OP_N ? b->rows : b->cols, n = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
  return c->type == CUDA_R_32F && c->rows == m && c->cols == n && ka == kb;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int want,
                                              cublasLtMatmulHeuristicResult_t *r, int *found) {
  (void)h, (void)p;
  *found = 0;
  if (want < 1 || !shapes_ok(d, a, b, c) || !shapes_ok(d, a, b, dl)) return CUBLAS_STATUS_NOT_SUPPORTED;
  r[0] = cublasLtMatmulHeuristicResult_t{};
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

/* a matrix of layout l widened to fp32, same column-major layout */
static std::vector<float> widen(const void *x, const kvl_sim_layout *l) {
  const size_t n = (size_t)l->ld * (l->cols - 1) + l->rows;
  std::vector<float> f(n);
  if (l->type == CUDA_R_32F) memcpy(f.data(), x, n * sizeof(float));
  else
    for (size_t i = 0; i < n; i++) f[i] = __bfloat162float(((const __nv_bfloat16 *)x)[i]);
  return f;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t la, const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                              const void *C, cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes, cudaStream_t st) {
  (void)h, (void)algo, (void)ws, (void)ws_bytes, (void)st;
  if (!shapes_ok(d, la, lb, lc) || !shapes_ok(d, la, lb, ld)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const int m = (int)lc->rows, n = (int)lc->cols, k = (int)(d->ta == CUBLAS_OP_N ? la->cols : la->rows);
  float a = *(const float *)alpha, b = *(const float *)beta;
  if (C != D)
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) ((float *)D)[(size_t)j * ld->ld + i] = ((const float *)C)[(size_t)j * lc->ld + i];
  const std::vector<float> fa = widen(A, la), fb = widen(B, lb);
  cblas_sgemm(CblasColMajor, d->ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
              d->tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, a, fa.data(), (int)la->ld, fb.data(),
              (int)lb->ld, b, (float *)D, (int)ld->ld);
  return CUBLAS_STATUS_SUCCESS;
}
