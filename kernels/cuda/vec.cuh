#pragma once
// Device building blocks shared by the memory-bound kernel families (norm.cu, rope.cu,
// elementwise.cu, optimizer.cu, fp8.cu): 16-byte bf16 / fp32 fragments, the activation functions
// as every fused kernel must compute them, warp / group / block sums, and the host helpers of their
// launchers. One copy, so a fused kernel computes its unfused twin's values bit for bit.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/cuda/check.h"
#include "core/device.h"
#include "kernels/cuda/ptx.cuh"

namespace dflash::cuda::vec {

using bf16 = __nv_bfloat16;

// ---- fragments ------------------------------------------------------------------------------------

// 8 bf16 held in a 16-byte register value -> f32 (ptx::unpack8, for an array of 8). Load the uint4
// into a local first: passing *reinterpret_cast<const uint4*>(p) straight in compiles to four 4-byte
// loads (seen in the PTX).
__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[8]) { ptx::unpack8(raw, v); }

__device__ __forceinline__ float ld_f(const float* p) { return *p; }
__device__ __forceinline__ float ld_f(const bf16* p) { return __bfloat162float(*p); }

// 8 consecutive elements (16-byte aligned for bf16, 32-byte region for fp32) as floats.
__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);  // one 16-byte load (kept as a value: see unpack)
  unpack(raw, v);
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// W consecutive elements as floats: W == 8 uses 16-byte accesses (aligned), W == 1 is scalar.
// Stores round to nearest even for bf16.
template <int W, class T>
__device__ __forceinline__ void load(const T* p, float (&v)[W]) {
  if constexpr (W == 8) load8(p, v);
  else {
    static_assert(W == 1);
    v[0] = ld_f(p);
  }
}
template <int W, class T>
__device__ __forceinline__ void store(T* p, const float (&v)[W]) {
  if constexpr (W == 8) store8(p, v);
  else if constexpr (sizeof(T) == 4) *p = v[0];
  else *p = __float2bfloat16_rn(v[0]);
}

// ---- math -----------------------------------------------------------------------------------------

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// __expf is exact enough for bf16 outputs (relative error ~1e-6 for |x| < 100) and keeps the
// pointwise kernels far below the instruction budget of a bandwidth-bound loop.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }

// ---- reductions -----------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of the kBlock / 32 warps' values v (each warp's lane 0 writes its v to red[warp]; every
// thread of the block must call it), in warp order.
template <int kBlock, class T>
__device__ __forceinline__ T sum_of_warps(T v, T* red) {
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  T s = 0;
#pragma unroll
  for (int i = 0; i < kBlock / 32; ++i) s += red[i];
  return s;
}

// Sum over a group of G threads: G <= 32 are aligned lanes of one warp (every lane of the warp
// must call it), G > 32 is the whole block of G threads (uses `red`, G / 32 floats, once per kernel).
template <int G>
__device__ __forceinline__ float group_sum(float v, float* red) {
  if constexpr (G <= 32) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    static_assert(G % 32 == 0);
    return sum_of_warps<G>(warp_sum(v), red);
  }
}

// Sum over a block of kBlock threads (all must call); red holds kBlock/32 values. The leading
// barrier makes repeated calls (one per row) safe. Fixed order: deterministic.
template <int kBlock, class T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  v = warp_sum(v);
  __syncthreads();
  return sum_of_warps<kBlock>(v, red);
}

// ---- host helpers of the launchers ----------------------------------------------------------------

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline unsigned blocks_for(int64_t work, int64_t per_block, int64_t cap = int64_t{1} << 20) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, cap)));
}

// A stream-ordered scratch buffer from the caching allocator of the current device.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    DFLASH_CUDA_CHECK(cudaGetDevice(&device_));
    ptr_ = device_alloc::allocate(bytes, device_);
  }
  ~Scratch() { device_alloc::release(ptr_, device_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* f32() const { return static_cast<float*>(ptr_); }

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace dflash::cuda::vec

namespace dflash::cuda::detail {
// dw[c] += Σ_p partial[p, c] for p = 0 .. parts-1 in order: the second pass of the deterministic
// weight-gradient reductions of the norm backward kernels (norm.cu, rope.cu). Defined in norm.cu.
void reduce_partials(const float* partial, int parts, int64_t D, float* dw, void* stream);
}  // namespace dflash::cuda::detail
