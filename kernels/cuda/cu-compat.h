/* cu-compat.h — private to kernels/cuda/: what the kernels (ops.cu) take from CUDA. Under
 * nvcc, its headers; compiled as plain C++ with KVL_CUDA_SIM, sim.h, which runs the same
 * kernels on the CPU (the unit suite's cuda-sim test). A launch is written
 * KVL_LAUNCH(kernel, grid, block, stream, args...) so that both can read it. */
#ifndef KVL_CU_COMPAT_H
#define KVL_CU_COMPAT_H

/* KVL_CU_BEGIN / KVL_CU_END enclose the backend's C++ code: in the CPU build, namespace
 * kvl_cusim, so that a program may link both (tests/gpu/test-cuda-ops --sim); its C entry
 * points take KVL_CU_ENTRY's names (kvl_backend_cuda_sim, ...). */
#ifdef KVL_CUDA_SIM
#include "sim.h"
#define KVL_CU_BEGIN namespace kvl_cusim {
#define KVL_CU_END }
#define KVL_CU_ENTRY(name) name##_sim
#else
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#define KVL_LAUNCH(k, grid, block, st, ...) k<<<grid, block, 0, st>>>(__VA_ARGS__)
#define KVL_CU_BEGIN
#define KVL_CU_END
#define KVL_CU_ENTRY(name) name
#endif

#endif
