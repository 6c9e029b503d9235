#pragma once
// CUDA kernels written in plain C++ (shared memory, __syncthreads, warp shuffles and ballots; no
// PTX, tensor cores or atomics) run on the CPU, so a machine without a GPU (CI) checks their
// indexing, barriers and arithmetic. A kernel source is included after this header with
// DFLASH_CUDA_EMULATION defined; its launcher calls emu::launch instead of <<<...>>>.
// Every CUDA thread of a block is a fiber (ucontext) on the calling thread; blocks run one after
// another; a fiber runs until it waits at a barrier (__syncthreads, or a warp's shuffle / ballot,
// which meet at a barrier of the warp's 32 threads) or returns, and a returned thread leaves its
// barriers (as an exited CUDA thread does). __shared__ variables are statics (one block at a time
// uses them). Compile the including file with -fno-strict-aliasing: the kernels' uint4 <-> bf16
// punning is sound in device code, not under the host compiler's aliasing rules. Not emulated: the
// device's own expf / __expf (the host's are used: they may differ in the last bit), atomics, and
// memory ordering across blocks (blocks never overlap here). A deadlock (a barrier some threads
// never reach) aborts with a message.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace emu {

struct Barrier {
  int expected = 0, arrived = 0;
  uint64_t gen = 0;
};

struct Fiber {
  ucontext_t ctx{};
  uint3 thread{};
  Barrier* waiting = nullptr;  // the barrier this fiber waits at, and its generation then
  uint64_t wait_gen = 0;
  bool done = false;
  int warp = 0;
};

struct Block {
  uint3 block{};
  dim3 block_dim, grid_dim;
  Barrier block_bar;
  std::vector<Barrier> warp_bars;
  std::vector<uint64_t> warp_buf;  // 32 words a warp: the shuffles' and ballots' exchange
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  ucontext_t main{};
  std::function<void()> body;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}
inline Fiber& self() { return *block()->current; }
inline int lane() { return static_cast<int>(self().thread.x % 32); }

inline void complete(Barrier& b) {
  b.arrived = 0;
  ++b.gen;
}

// Waits until every (remaining) thread of the barrier has arrived.
inline void wait(Barrier& b) {
  if (++b.arrived >= b.expected) return complete(b);
  Fiber& f = self();
  f.waiting = &b;
  f.wait_gen = b.gen;
  swapcontext(&f.ctx, &block()->main);
}

inline void leave(Barrier& b) {
  --b.expected;
  if (b.expected > 0 && b.arrived >= b.expected) complete(b);
}

inline void fiber_main() {
  Block& B = *block();
  B.body();
  Fiber& f = self();
  f.done = true;
  leave(B.warp_bars[static_cast<size_t>(f.warp)]);
  leave(B.block_bar);
  swapcontext(&f.ctx, &B.main);  // never resumed
}

// A kernel over grid x block (1-D blocks of at most 1024 threads), its arguments copied.
template <class Kernel, class... Args>
void launch(dim3 grid, dim3 blk, Kernel kernel, const Args&... args) {
  constexpr size_t kStack = 64 * 1024;
  const int n = static_cast<int>(blk.x);
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() < static_cast<size_t>(n)) stacks.push_back(std::make_unique<char[]>(kStack));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block B;
        B.block = {bx, by, bz};
        B.block_dim = blk;
        B.grid_dim = grid;
        B.block_bar.expected = n;
        const int warps = (n + 31) / 32;
        B.warp_bars.resize(static_cast<size_t>(warps));
        for (int w = 0; w < warps; ++w) B.warp_bars[static_cast<size_t>(w)].expected = std::min(32, n - 32 * w);
        B.warp_buf.assign(static_cast<size_t>(warps) * 32, 0);
        B.fibers.resize(static_cast<size_t>(n));
        B.body = [&] { kernel(args...); };
        block() = &B;
        for (int t = 0; t < n; ++t) {
          Fiber& f = B.fibers[static_cast<size_t>(t)];
          f.thread = {static_cast<unsigned>(t), 0, 0};
          f.warp = t / 32;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks[static_cast<size_t>(t)].get();
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_main, 0);
        }
        // Round robin over the runnable fibers until all have returned.
        for (int left = n; left > 0;) {
          bool progress = false;
          for (Fiber& f : B.fibers) {
            if (f.done || (f.waiting && f.waiting->gen == f.wait_gen)) continue;
            f.waiting = nullptr;
            B.current = &f;
            swapcontext(&B.main, &f.ctx);
            progress = true;
            if (f.done) --left;
          }
          if (!progress) {
            std::fprintf(stderr, "cuda emulation: deadlock in block (%u, %u, %u): %d threads wait at barriers\n", bx,
                         by, bz, left);
            std::abort();
          }
        }
        block() = nullptr;
      }
}

template <class T>
T shfl_xor(T v, int mask) {
  static_assert(sizeof(T) <= 8);
  Fiber& f = self();
  uint64_t* buf = block()->warp_buf.data() + 32 * f.warp;
  std::memcpy(&buf[lane()], &v, sizeof(T));
  Barrier& bar = block()->warp_bars[static_cast<size_t>(f.warp)];
  wait(bar);
  T r;
  std::memcpy(&r, &buf[lane() ^ mask], sizeof(T));
  wait(bar);
  return r;
}

inline unsigned ballot(bool pred) {
  Fiber& f = self();
  uint64_t* buf = block()->warp_buf.data() + 32 * f.warp;
  buf[lane()] = pred ? 1 : 0;
  Barrier& bar = block()->warp_bars[static_cast<size_t>(f.warp)];
  wait(bar);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (buf[i] ? 1u : 0u) << i;
  wait(bar);
  return r;
}

}  // namespace emu

#define threadIdx (::emu::self().thread)
#define blockIdx (::emu::block()->block)
#define blockDim (::emu::block()->block_dim)
#define gridDim (::emu::block()->grid_dim)
#define __syncthreads() (::emu::wait(::emu::block()->block_bar))
#define __shfl_xor_sync(mask, v, o) (::emu::shfl_xor((v), (o)))
#define __ballot_sync(mask, pred) (::emu::ballot(static_cast<bool>(pred)))
#define __popc(x) (__builtin_popcount(static_cast<unsigned>(x)))
#define __expf(x) (::expf(x))

template <class T>
T __ldg(const T* p) {
  return *p;
}
// Shared-memory addresses (ptx.cuh's helpers compile; the PTX ones are never called here).
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }
