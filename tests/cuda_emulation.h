#pragma once
// CUDA kernels run on the CPU, so a machine without a GPU (CI) checks their indexing, barriers and
// arithmetic: plain C++ kernels (shared memory, __syncthreads, warp shuffles and ballots, atomics)
// and those whose PTX has an emulation here (ptx.cuh under DFLASH_CUDA_EMULATION: ldmatrix x4,
// mma.sync m16n8k16 bf16 and m16n8k32 e4m3, the cp.async ring; wgmma.cuh: wgmma m64n64k16 bf16 from shared memory). A kernel source is included after this header with
// DFLASH_CUDA_EMULATION defined; its launches go through kernels/cuda/emulatable.cuh.
// Every CUDA thread of a block is a fiber (ucontext) on the calling thread; blocks run one after
// another; a fiber runs until it waits at a barrier (__syncthreads, or a warp's shuffle / ballot,
// which meet at a barrier of the warp's 32 threads, or of its half's 16 where the shuffle's mask is
// that half warp's) or returns, and a returned thread leaves its
// barriers (as an exited CUDA thread does). __shared__ variables are statics (one block at a time
// uses them). Compile the including file with -fno-strict-aliasing: the kernels' uint4 <-> bf16
// punning is sound in device code, not under the host compiler's aliasing rules. Not emulated: the
// device's own expf / __expf (the host's are used: they may differ in the last bit), the tensor
// cores' internal summation order (mma sums its 16 products and the accumulator in k order, in f32),
// and memory ordering across blocks (blocks never overlap here; an atomic is a plain add: fibers
// never interleave inside one). A deadlock (a barrier some threads never reach) aborts with a message.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "core/fp8.h"

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
  std::vector<Barrier> half_bars;  // two a warp: the shuffles whose mask is one half warp's 16 lanes
  std::vector<uint64_t> warp_buf;  // kWords words a lane: the shuffles', ballots', ldmatrix's and mma's exchange
  std::vector<unsigned char> smem;  // the launch's dynamic shared memory, from `origin` (1024-byte aligned)
  unsigned char* origin = nullptr;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  ucontext_t main{};
  std::function<void()> body;
};

constexpr int kWords = 16;

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
  leave(B.half_bars[static_cast<size_t>(f.thread.x / 16)]);
  leave(B.block_bar);
  swapcontext(&f.ctx, &B.main);  // never resumed
}

inline void* dynamic_smem() { return block()->origin; }

// A kernel over grid x block (1-D blocks of at most 1024 threads) with `smem` bytes of dynamic
// shared memory (zeroed, 16-byte aligned), its arguments copied.
template <class Kernel, class... Args>
void launch(dim3 grid, dim3 blk, size_t smem, Kernel kernel, const Args&... args) {
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
        B.half_bars.resize(static_cast<size_t>(2 * warps));
        for (int h = 0; h < 2 * warps; ++h) B.half_bars[static_cast<size_t>(h)].expected = std::max(0, std::min(16, n - 16 * h));
        B.warp_buf.assign(static_cast<size_t>(warps) * 32 * kWords, 0);
        B.smem.assign(smem + 1024 + 16, 0);
        B.origin = B.smem.data() + (1024 - reinterpret_cast<uintptr_t>(B.smem.data()) % 1024) % 1024;
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

// The calling lane's exchange words (lane l's start at words(l)), and its warp's barrier.
inline uint64_t* words(int l) { return block()->warp_buf.data() + (32 * self().warp + l) * kWords; }
inline Barrier& warp_bar() { return block()->warp_bars[static_cast<size_t>(self().warp)]; }

// The barrier a shuffle of this member mask meets at: the calling lane's half warp where the mask is
// exactly that half's lanes (a half warp's 16-lane group may shuffle while the other half does
// something else, as on the device), else the whole warp's.
inline Barrier& shfl_bar(unsigned members) {
  const unsigned half = 0xFFFFu << (16 * (lane() / 16));
  if (members == half) return block()->half_bars[static_cast<size_t>(self().thread.x / 16)];
  return warp_bar();
}

// A shuffle: every lane gets lane src's value (src computed by each lane for itself).
template <class T>
T shfl_from(T v, int src, unsigned members) {
  static_assert(sizeof(T) <= 8);
  Barrier& bar = shfl_bar(members);
  std::memcpy(words(lane()), &v, sizeof(T));
  wait(bar);
  T r;
  std::memcpy(&r, words(src), sizeof(T));
  wait(bar);
  return r;
}
template <class T>
T shfl_xor(T v, int mask, unsigned members = 0xffffffffu) {
  return shfl_from(v, lane() ^ mask, members);
}
// __shfl_sync: every lane gets lane src's value.
template <class T>
T shfl(T v, int src, unsigned members = 0xffffffffu) {
  return shfl_from(v, src & 31, members);
}

// __shfl_up_sync: lane l gets lane l - d's value (its own below d).
template <class T>
T shfl_up(T v, int d) {
  static_assert(sizeof(T) <= 8);
  std::memcpy(words(lane()), &v, sizeof(T));
  wait(warp_bar());
  T r = v;
  if (lane() >= d) std::memcpy(&r, words(lane() - d), sizeof(T));
  wait(warp_bar());
  return r;
}

// __reduce_max_sync / __reduce_min_sync (sm_80+): every lane gets the warp's max / min.
template <class T, class Op>
T reduce(T v, Op op) {
  std::memcpy(words(lane()), &v, sizeof(T));
  wait(warp_bar());
  T r = v;
  for (int i = 0; i < 32; ++i) {
    T o;
    std::memcpy(&o, words(i), sizeof(T));
    r = op(r, o);
  }
  wait(warp_bar());
  return r;
}

inline unsigned ballot(bool pred) {
  words(lane())[0] = pred ? 1 : 0;
  wait(warp_bar());
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (words(i)[0] ? 1u : 0u) << i;
  wait(warp_bar());
  return r;
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i..8i+7 give the row addresses of matrix i; lane l
// receives of matrix i the 32-bit word at row l / 4, columns 2 (l % 4), 2 (l % 4) + 1.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const auto* addr = static_cast<const unsigned char*>(p);
  std::memcpy(words(lane()), &addr, sizeof(addr));
  wait(warp_bar());
  for (int i = 0; i < 4; ++i) {
    const unsigned char* row;
    std::memcpy(&row, words(8 * i + lane() / 4), sizeof(row));
    std::memcpy(&r[i], row + 4 * (lane() % 4), 4);
  }
  wait(warp_bar());
}

inline float bf16_lo(uint32_t w) { return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w & 0xffffu))); }
inline float bf16_hi(uint32_t w) { return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w >> 16))); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, c += a · b, with lane l = 4 g + t holding
// a: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); b: (k 2t..2t+1, n g), (k 2t+8.., n g);
// c: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). Each element: the accumulator, then the 16 products
// in k order, in f32.
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  uint64_t* mine = words(lane());
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  wait(warp_bar());
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const uint64_t* w = words(l);
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) {
      A[rows[i]][cols[i]] = bf16_lo(static_cast<uint32_t>(w[i]));
      A[rows[i]][cols[i] + 1] = bf16_hi(static_cast<uint32_t>(w[i]));
    }
    B[2 * t][g] = bf16_lo(static_cast<uint32_t>(w[4]));
    B[2 * t + 1][g] = bf16_hi(static_cast<uint32_t>(w[4]));
    B[2 * t + 8][g] = bf16_lo(static_cast<uint32_t>(w[5]));
    B[2 * t + 9][g] = bf16_hi(static_cast<uint32_t>(w[5]));
  }
  wait(warp_bar());
  const int g = lane() / 4, t = lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
    c[i] = s;
  }
}

// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (ptx.cuh's mma_e4m3): lane l = 4 g + t holds
// a: (g, 4t..4t+3), (g+8, 4t..), (g, 4t+16..), (g+8, 4t+16..), b: (k 4t..4t+3, n g), (k 4t+16.., n g),
// four codes a register, the lowest byte first; c as mma_bf16's. Each element: the accumulator, then
// the 32 products (exact in f32) in k order, in f32.
inline void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  uint64_t* mine = words(lane());
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  wait(warp_bar());
  static const auto e4m3 = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[static_cast<size_t>(c)] = ::dflash::fp8::e4m3_to_float(static_cast<uint8_t>(c));
    return v;
  }();
  float A[16][32], B[32][8];
  for (int l = 0; l < 32; ++l) {
    const uint64_t* w = words(l);
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {4 * t, 4 * t, 4 * t + 16, 4 * t + 16};
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j)
        A[rows[i]][cols[i] + j] = e4m3[(w[i] >> (8 * j)) & 0xFF];
    for (int j = 0; j < 4; ++j) {
      B[4 * t + j][g] = e4m3[(w[4] >> (8 * j)) & 0xFF];
      B[4 * t + 16 + j][g] = e4m3[(w[5] >> (8 * j)) & 0xFF];
    }
  }
  wait(warp_bar());
  const int g = lane() / 4, t = lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int k = 0; k < 32; ++k) s += A[rows[i]][k] * B[k][cols[i]];
    c[i] = s;
  }
}

[[noreturn]] inline void not_emulated(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s is not emulated\n", what);
  std::abort();
}

// wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 with both operands in shared memory, K-major,
// 128-byte swizzle (wgmma.cuh's descriptors: start >> 4 in bits 0-13, the stride between 8-row
// groups >> 4 in bits 32-45, the swizzle mode in bits 62-63; addresses are offsets in the dynamic
// shared memory, see __cvta_generic_to_shared below): element (r, k) of A [64 x 16] or of B
// [64 (n) x 16] at start + (r / 8) stride + (r % 8) 128 + 2k, address bits 4-6 XORed with bits 7-9.
// Thread (warp w of its warpgroup, lane 4g + t) holds d[4i + 2h + j] = (row 16w + g + 8h, column
// 8i + 2t + j); each: the accumulator (0 when !accumulate), then the 16 products in k order, in f32.
// Completes when issued (the fences, commits and waits are no-ops).
inline void wgmma_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  auto element = [](uint64_t desc, int r, int k) {
    if ((desc >> 62) != 1) {
      std::fprintf(stderr, "cuda emulation: wgmma descriptor without the 128-byte swizzle\n");
      std::abort();
    }
    const uint32_t start = static_cast<uint32_t>(desc & 0x3FFF) << 4, sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
    const uint32_t logical = start + static_cast<uint32_t>(r / 8) * sbo + static_cast<uint32_t>(r % 8) * 128 + 2 * k;
    const uint32_t phys = logical ^ (((logical >> 7) & 7) << 4);
    uint16_t v;
    std::memcpy(&v, block()->origin + phys, 2);
    return __bfloat162float(__ushort_as_bfloat16(v));
  };
  const int w = self().warp % 4, g = lane() / 4, t = lane() % 4;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) {
      const int row = 16 * w + g + 8 * (j >> 1), col = 8 * i + 2 * t + (j & 1);
      float s = accumulate ? d[4 * i + j] : 0.0f;
      for (int k = 0; k < 16; ++k) s += element(desc_a, row, k) * element(desc_b, col, k);
      d[4 * i + j] = s;
    }
}

}  // namespace emu

#define threadIdx (::emu::self().thread)
#define blockIdx (::emu::block()->block)
#define blockDim (::emu::block()->block_dim)
#define gridDim (::emu::block()->grid_dim)
#define __syncthreads() (::emu::wait(::emu::block()->block_bar))
#define __syncwarp(...) (::emu::wait(::emu::warp_bar()))
#define __shfl_xor_sync(mask, v, o) (::emu::shfl_xor((v), (o), static_cast<unsigned>(mask)))
#define __shfl_up_sync(mask, v, d) (::emu::shfl_up((v), (d)))
#define __shfl_sync(mask, v, src) (::emu::shfl((v), (src), static_cast<unsigned>(mask)))
#define __ballot_sync(mask, pred) (::emu::ballot(static_cast<bool>(pred)))
#define __all_sync(mask, pred) (::emu::ballot(static_cast<bool>(pred)) == 0xffffffffu)
#define __popc(x) (__builtin_popcount(static_cast<unsigned>(x)))
#define __reduce_max_sync(mask, v) (::emu::reduce((v), [](auto a, auto b) { return a > b ? a : b; }))
#define __reduce_min_sync(mask, v) (::emu::reduce((v), [](auto a, auto b) { return a < b ? a : b; }))
#define __expf(x) (::expf(x))
// IEEE round-to-nearest f32 arithmetic is the host's (no FMA contraction on x86-64 without -mfma);
// rsqrtf is the device's approximation, here 1 / sqrtf: bits may differ from a GPU's in the last place.
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }

inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <class T>
T __ldg(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return *p;
}
template <class T>
void __stcg(T* p, T v) {
  *p = v;
}
inline void __threadfence() {}  // blocks run one after another: every write is seen
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old | v;
  return old;
}
// The runtime calls of emulated launchers (no device: memory is host memory, there is one "device").
#define cudaMemsetAsync(p, v, n, s) (std::memset((p), (v), (n)), cudaSuccess)
#define cudaGetDevice(d) (*(d) = 0, cudaSuccess)
#define cudaFuncSetAttribute(...) cudaSuccess
// Shared-memory addresses: offsets in the launch's dynamic shared memory (what wgmma descriptors
// hold; ptx.cuh's PTX users of them are never called here).
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<size_t>(static_cast<const unsigned char*>(p) - ::emu::block()->origin);
}
