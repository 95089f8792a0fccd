/* sim.h — private to kernels/cuda/: CUDA's execution model on the CPU, for running the
 * backend's kernels (ops.cu, compiled as C++ with KVL_CUDA_SIM) in the unit tests of a
 * machine without a GPU. What a kernel sees:
 *
 *   - a grid of blocks, run one block at a time, every thread of the block a fiber (sim.cc);
 *     threadIdx / blockIdx per thread, blockDim / gridDim for the launch;
 *   - __syncthreads() and __syncwarp(): barriers over the block's and the warp's threads
 *     (warps of 32 consecutive linear thread ids); a thread that returns leaves them, as
 *     an exited thread does on the device;
 *   - __shfl_sync / __shfl_xor_sync / __shfl_down_sync: an exchange through the warp's
 *     slots between two warp barriers, so every live lane of the warp must take part;
 *   - __shared__ variables: function statics, one copy for the block that runs;
 *   - atomicAdd: a plain read-modify-write (the fibers switch only at barriers);
 *   - bf16 values and conversions with round-to-nearest-even (cuda_bf16.h's _rn).
 *
 * What it cannot show: speed, the device's memory model beyond the barriers (a race that
 * the barriers order here may still be one on the device), register and shared-memory
 * limits, and nvcc's code. It checks a kernel's indexing, tiling, masking and reductions
 * against the CPU reference; a GPU run (tests/gpu) checks the rest. */
#ifndef KVL_CUDA_SIM_H
#define KVL_CUDA_SIM_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>

extern "C" {
#include "kvl_quant.h" /* the bf16 conversions: the CPU's (round to nearest even, NaN kept) */
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
/* The runtime API's subset the backend (backend.cu) calls: "device" memory is host
 * memory; kernels and copies to the device run at once, copies to the host land at the
 * next cudaStreamSynchronize of their stream (a host read before it sees the old bytes;
 * another stream's synchronisation does not land them). Events order nothing here (work
 * runs at its launch); cudaEventSynchronize lands what the event's stream had queued when
 * it was recorded. One device, named "kvl_sim", compute 9.0, 132 multiprocessors (an
 * H100's), 4 GiB free. */
struct kvl_sim_stream;
typedef kvl_sim_stream *cudaStream_t;
struct kvl_sim_event;
typedef kvl_sim_event *cudaEvent_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2, cudaErrorInvalidDevice = 101 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum { cudaStreamNonBlocking = 1, cudaHostRegisterDefault = 0, cudaEventDisableTiming = 2 };
struct cudaDeviceProp {
  char name[256];
  int major, minor, multiProcessorCount;
};
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaMallocHost(void **p, size_t bytes); /* "pinned": plain host memory here */
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t st);
cudaError_t cudaStreamSynchronize(cudaStream_t st);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st);
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags);
cudaError_t cudaEventSynchronize(cudaEvent_t ev);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t e);

/* cuBLASLt's subset (cublasLt.h): column-major D = alpha op(A) op(B) + beta C with bf16 or
 * fp32 A and B and fp32 C = D, computed in fp32 (OpenBLAS's sgemm on the inputs widened to
 * fp32: bf16 x bf16 products are exact in fp32, the sums in fp32, as CUBLAS_COMPUTE_32F). */
enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum cublasLtMatmulDescAttributes_t { CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4 };
enum cublasLtMatmulPreferenceAttributes_t { CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1 };
struct kvl_sim_lt;
struct kvl_sim_desc {
  cublasOperation_t ta, tb;
};
struct kvl_sim_layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
typedef kvl_sim_lt *cublasLtHandle_t;
typedef kvl_sim_desc *cublasLtMatmulDesc_t;
typedef kvl_sim_layout *cublasLtMatrixLayout_t;
typedef struct kvl_sim_pref *cublasLtMatmulPreference_t;
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
};
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t ct, cudaDataType_t scale);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *v,
                                              size_t n);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t t, uint64_t rows, uint64_t cols,
                                          int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a, const void *v, size_t n);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int want,
                                              cublasLtMatmulHeuristicResult_t *r, int *found);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t la, const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                              const void *C, cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes, cudaStream_t st);

extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

struct __nv_bfloat16 {
  uint16_t bits;
};
static inline float __bfloat162float(__nv_bfloat16 h) { return kvl_bf16_to_fp32(h.bits); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kvl_fp32_to_bf16(f)}; }

namespace kvl_sim {
void sync_block();
void sync_warp();
/* this thread's value out, lane src's back (src outside the warp: this thread's own) */
uint64_t exchange(uint64_t bits, int src);
int lane();
void run(dim3 grid, dim3 block, const std::function<void()> &body);

template <typename T>
T shfl(T v, int src) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof(T));
  b = exchange(b, src);
  memcpy(&v, &b, sizeof(T));
  return v;
}

/* A kernel launch: the arguments converted to the kernel's parameters once, each thread
 * calling it with its own copies. */
template <typename... P, typename... A>
void launch(void (*k)(P...), dim3 grid, dim3 block, A... args) {
  std::tuple<P...> params(args...);
  run(grid, block, [&] { std::apply(k, std::tuple<P...>(params)); });
}
} // namespace kvl_sim

static inline void __syncthreads() { kvl_sim::sync_block(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)mask;
  kvl_sim::sync_warp();
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  (void)mask;
  const int l = kvl_sim::lane();
  return kvl_sim::shfl(v, (l & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  (void)mask, (void)width;
  return kvl_sim::shfl(v, kvl_sim::lane() ^ m);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  (void)mask;
  const int l = kvl_sim::lane();
  return kvl_sim::shfl(v, (l & (width - 1)) + (int)d < width ? l + (int)d : l);
}

/* the block's threads are fibers on one OS thread, switched only at barriers: a plain
 * read-modify-write is atomic here */
template <typename T>
T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}

#define KVL_LAUNCH(k, grid, block, st, ...) ((void)(st), kvl_sim::launch(k, dim3(grid), dim3(block), __VA_ARGS__))

#endif
