/* sim.cc — the CPU execution model of sim.h. The blocks of a launch run one after
 * another; a block's threads are fibers on one OS thread (a stack each, switched by
 * kvl_sim_switch below: callee-saved registers and the FP control words, nothing else).
 * A fiber runs until it waits at a barrier or ends; the scheduler resumes the live fibers
 * in turn, a waiting one going straight back until its barrier is released. Even blocks
 * take their threads in ascending order, odd ones in descending: a read that a missing
 * barrier leaves ahead of another thread's write shows in one order or the other. A round in
 * which no fiber arrived anywhere or ended is a deadlock (threads waiting at different
 * barriers, or a shuffle some lanes never reach): reported, then abort. Under ASan the
 * switches are announced (__sanitizer_start/finish_switch_fiber) so that it follows the
 * stacks. */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <vector>

#if !defined(__x86_64__)
#error "sim.cc switches stacks with x86-64 code"
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#include <sanitizer/common_interface_defs.h>
#define SIM_ASAN 1
#endif
#endif

/* Save the callee-saved registers on this stack, store its pointer in *from, continue on
 * `to` (a stack saved the same way, or made by fiber_stack). The FP control words are not
 * switched: every fiber runs on the launching thread and none changes them. */
extern "C" void kvl_sim_switch(void **from, void *to);
__asm__(".text\n"
        ".globl kvl_sim_switch\n"
        ".type kvl_sim_switch,@function\n"
        "kvl_sim_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size kvl_sim_switch, .-kvl_sim_switch\n"
        ".section .note.GNU-stack,\"\",@progbits\n"
        ".text\n");

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace kvl_sim {
namespace {

const size_t STACK_BYTES = (size_t)1 << 20;

struct fiber {
  void *sp;
  char *stack;
  bool done;
  void *fake; /* ASan's fake stack of this fiber while it is switched out */
};

struct barrier {
  int expected, arrived;
  unsigned gen;
};

struct warp_ctx {
  barrier bar;
  int size; /* its lanes at launch (the block's last warp may have fewer than 32) */
  uint64_t slot[32];
};

std::vector<fiber> fibers;
std::vector<warp_ctx> warps;
barrier block_bar;
void *main_sp;
const void *main_bottom;
size_t main_size;
int cur;       /* the running fiber: its linear thread id */
bool progress; /* an arrival or an end since the round began */
const std::function<void()> *body;

inline void asan_start(void **fake, const void *bottom, size_t size) {
#ifdef SIM_ASAN
  __sanitizer_start_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}
inline void asan_finish(void *fake, const void **bottom, size_t *size) {
#ifdef SIM_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}

void yield() {
  fiber &f = fibers[(size_t)cur];
  asan_start(&f.fake, main_bottom, main_size);
  kvl_sim_switch(&f.sp, main_sp);
  asan_finish(f.fake, &main_bottom, &main_size);
}

void wait(barrier &b) {
  progress = true;
  if (++b.arrived == b.expected) {
    b.arrived = 0, b.gen++;
    return;
  }
  const unsigned g = b.gen;
  while (b.gen == g) yield();
}

void drop(barrier &b) {
  b.expected--;
  if (b.arrived > 0 && b.arrived == b.expected) b.arrived = 0, b.gen++;
}

[[noreturn]] void entry() {
  asan_finish(nullptr, &main_bottom, &main_size);
  (*body)();
  fiber &f = fibers[(size_t)cur];
  drop(warps[(size_t)cur / 32].bar);
  drop(block_bar);
  f.done = true;
  progress = true;
  asan_start(nullptr, main_bottom, main_size); /* this fiber's fake stack goes */
  kvl_sim_switch(&f.sp, main_sp);
  abort(); /* never resumed */
}

/* a fresh stack whose first switch "returns" into entry(): six zero registers, then
 * entry's address, 16-byte aligned as after a call */
void *fiber_stack(char *stack) {
  uintptr_t top = ((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)(top - 16);
  sp[0] = (uint64_t)(uintptr_t)&entry;
  sp[1] = 0;
  sp -= 6;
  for (int i = 0; i < 6; i++) sp[i] = 0;
  return sp;
}

/* Stacks: a fiber takes one when it first runs and gives it back when it ends, so the
 * threads of a kernel without barriers run one after another on the same stack. */
std::vector<char *> spare;
char *stack_take() {
  if (spare.empty()) {
    void *s = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) {
      fprintf(stderr, "kvl_sim: no memory for a fiber's stack\n");
      abort();
    }
    return (char *)s;
  }
  char *s = spare.back();
  spare.pop_back();
  return s;
}

} // namespace

void sync_block() { wait(block_bar); }
void sync_warp() { wait(warps[(size_t)cur / 32].bar); }
int lane() { return cur % 32; }

uint64_t exchange(uint64_t bits, int src) {
  warp_ctx &w = warps[(size_t)cur / 32];
  w.slot[cur % 32] = bits;
  wait(w.bar);
  const uint64_t r = src >= 0 && src < w.size ? w.slot[src] : bits;
  wait(w.bar);
  return r;
}

void run(dim3 grid, dim3 block, const std::function<void()> &fn) {
  gridDim = grid, blockDim = block;
  const int nt = (int)(block.x * block.y * block.z);
  if ((int)fibers.size() < nt) fibers.resize((size_t)nt, fiber{nullptr, nullptr, false, nullptr});
  body = &fn;
  for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
      for (unsigned bx = 0; bx < grid.x; bx++) {
        block_bar = barrier{nt, 0, 0};
        warps.assign((size_t)(nt + 31) / 32, warp_ctx{});
        for (size_t w = 0; w < warps.size(); w++) {
          const int left = nt - 32 * (int)w;
          warps[w].size = left < 32 ? left : 32;
          warps[w].bar = barrier{warps[w].size, 0, 0};
        }
        for (int i = 0; i < nt; i++) fibers[(size_t)i].stack = nullptr, fibers[(size_t)i].done = false;
        blockIdx = dim3(bx, by, bz);
        for (int live = nt; live > 0;) {
          progress = false;
          for (int j = 0; j < nt; j++) {
            const int i = (bx + by + bz) % 2 ? nt - 1 - j : j; /* odd blocks run their threads last first */
            fiber &f = fibers[(size_t)i];
            if (f.done) continue;
            if (!f.stack) f.stack = stack_take(), f.sp = fiber_stack(f.stack);
            cur = i;
            threadIdx = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
            void *fake = nullptr;
            asan_start(&fake, f.stack, STACK_BYTES);
            kvl_sim_switch(&main_sp, f.sp);
            asan_finish(fake, nullptr, nullptr);
            if (f.done) live--, spare.push_back(f.stack);
          }
          if (!progress && live > 0) {
            fprintf(stderr, "kvl_sim: deadlock in block (%u,%u,%u): %d threads wait at barriers that cannot open\n",
                    bx, by, bz, live);
            abort();
          }
        }
      }
}

} // namespace kvl_sim
