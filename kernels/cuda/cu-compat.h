/* cu-compat.h — private to kernels/cuda/: what the kernels (ops.cu) take from CUDA. Under
 * nvcc, its headers; compiled as plain C++ with KVL_CUDA_SIM, sim.h, which runs the same
 * kernels on the CPU (the unit suite's cuda-sim test). A launch is written
 * KVL_LAUNCH(kernel, grid, block, stream, args...) so that both can read it. */
#ifndef KVL_CU_COMPAT_H
#define KVL_CU_COMPAT_H

#ifdef KVL_CUDA_SIM
#include "sim.h"
#else
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#define KVL_LAUNCH(k, grid, block, st, ...) k<<<grid, block, 0, st>>>(__VA_ARGS__)
#endif

#endif
