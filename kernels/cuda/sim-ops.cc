/* sim-ops.cc — ops.cu compiled for the CPU (meson defines KVL_CUDA_SIM: cu-compat.h takes
 * sim.h), and the C entry points of sim-ops.h. "Device" memory is host memory here. */
#include "ops.cu"

#include <stdio.h>
#include <vector>

#include "sim-ops.h"

using namespace kvl_cusim;

extern "C" void kvl__cu_sim_attention(const struct kvl_attn_args *a, int n_sm, char *plan, size_t planlen) {
  kvl__cu_attn_stage sg;
  KVL_ASSERT(kvl__cu_attn_stage_make(a, false, &sg) == 0);
  std::vector<int32_t> tiles((size_t)a->n_tokens + 1);
  const kvl__cu_attn_plan p = kvl__cu_attn_plan_make(a, n_sm, tiles.data());
  std::vector<char> blocks((size_t)sg.n_local * sg.slab + 1);
  for (int i = 0; i < sg.n_local; i++) memcpy(blocks.data() + (size_t)i * sg.slab, sg.src[i], sg.slab);
  std::vector<float> part(kvl__cu_attn_part_floats(&p, a) + 1);
  kvl__cu_attn_dev dv = {a->q,          a->out,        part.data(),
                         a->pos,        a->seq,        tiles.data(),
                         sg.tables,     blocks.data(), sg.max_blocks,
                         (int64_t)(sg.slab / (a->kv->dtype == KVL_KV_BF16 ? 2 : 4))};
  kvl__cu_attention(&p, a, &dv, NULL);
  if (plan && planlen)
    snprintf(plan, planlen, "%s tiles=%d hpc=%d split=%dx%d", p.path == KVL__CU_ATTN_TILED ? "tiled" : "warp",
             p.n_tiles, p.hpc, p.n_split, p.chunk);
  kvl__cu_attn_stage_free(&sg);
}
