/* sim-ops.h — the CUDA backend compiled for the CPU (sim.h), for tests: the whole backend
 * (the tests, the benchmarks' --backend cuda-sim, kvlingod's `backend: cuda-sim`), and its
 * attention alone with the plan forced. Built on every machine (no CUDA toolkit needed). */
#ifndef KVL_CU_SIM_OPS_H
#define KVL_CU_SIM_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The whole CUDA backend on the CPU (sim-backend.cc): kvl_backend_cuda's contract, device
 * "kvl_sim"; its results are the CUDA backend's, its times mean nothing. */
kvl_backend_t *kvl_backend_cuda_sim(char *why, size_t whylen);

/* The attention op as backend.cu runs it (staging, plan for n_sm multiprocessors, the
 * kernels); the plan it took described in plan ("tiled tiles=3 hpc=1 split=1x96", ...). */
void kvl__cu_sim_attention(const struct kvl_attn_args *a, int n_sm, char *plan, size_t planlen);

#ifdef __cplusplus
}
#endif

#endif
