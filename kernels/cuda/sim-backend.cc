/* sim-backend.cc — backend.cu compiled for the CPU (meson defines KVL_CUDA_SIM): the whole
 * CUDA backend, its host side as written, its kernels under sim.h and its runtime and
 * cuBLASLt calls on sim-runtime.cc, as kvl_backend_cuda_sim() (sim-ops.h). */
#include "backend.cu"
