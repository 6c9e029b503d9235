// Sampling ops (launch.h "Sampling"): the greedy argmax over rows of logits, on the device so that
// a decode step brings back token ids, not R × V logits.
//
// Roofline: reads the R·V logits once (4 B each in fp32, 2 B in bf16), writes R ids; no FLOPs to
// speak of, so memory bound. One CTA per row streams its row with 16-byte loads, kUnroll of them
// in flight per thread: at the drafter's block (R = 16, V = 248320, fp32: 16 MB) the 16 CTAs sit
// on 16 SMs, each limited by what one SM can pull (~100-200 GB/s), so ~5-10 us; with more rows
// (several slots) the grid fills the GPU and approaches DRAM bandwidth (~4 TB/s).
// Ties: every thread keeps the lowest index attaining its maximum, and each combine (warp
// shuffles, then across warps) prefers the lower index on equal values, so the result is the
// lowest id of the row's maximum whatever the thread layout.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/launch.h"
#include "kernels/error.h"

namespace dflash::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxThreads = 1024;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

// The best (value, index) seen; index INT_MAX = none yet.
struct Best {
  float v;
  int i;
};

__device__ __forceinline__ void consider(Best& b, float v, int i) {
  if (!isnan(v) && (v > b.v || (v == b.v && i < b.i))) b = {v, i};
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// The 16 bytes q hold elements i0, i0 + 1, ... of the row.
__device__ __forceinline__ void consider16(Best& b, const uint4& q, int i0, float) {
  const float4 f = *reinterpret_cast<const float4*>(&q);
  consider(b, f.x, i0);
  consider(b, f.y, i0 + 1);
  consider(b, f.z, i0 + 2);
  consider(b, f.w, i0 + 3);
}
__device__ __forceinline__ void consider16(Best& b, const uint4& q, int i0, bf16) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    consider(b, f.x, i0 + 2 * k);
    consider(b, f.y, i0 + 2 * k + 1);
  }
}

__device__ __forceinline__ void warp_best(Best& b) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
    consider(b, v, i);
  }
}

// Row blockIdx.x: the elements before the row's first 16-byte boundary, then whole 16-byte vectors
// (kUnroll at a time per thread), then the tail.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) argmax_rows_kernel(const T* __restrict__ logits, int64_t ld, int V,
                                                                  int32_t* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(T);
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * ld;
  const int nt = static_cast<int>(blockDim.x);
  const int head = min(V, static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / sizeof(T)));
  const int nvec = (V - head) / kVec;
  const uint4* vec = reinterpret_cast<const uint4*>(row + head);
  Best b{-INFINITY, INT_MAX};
  for (int v = threadIdx.x; v < head; v += nt) consider(b, to_float(row[v]), v);
  int k = threadIdx.x;
  for (; k + (kUnroll - 1) * nt < nvec; k += kUnroll * nt) {
    uint4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) q[u] = __ldg(vec + k + u * nt);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) consider16(b, q[u], head + (k + u * nt) * kVec, T{});
  }
  for (; k < nvec; k += nt) consider16(b, __ldg(vec + k), head + k * kVec, T{});
  for (int v = head + nvec * kVec + static_cast<int>(threadIdx.x); v < V; v += nt) consider(b, to_float(row[v]), v);

  __shared__ Best warps[kMaxThreads / 32];
  warp_best(b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = lane < nt / 32 ? warps[lane] : Best{-INFINITY, INT_MAX};
    warp_best(b);
    if (lane == 0) out[blockIdx.x] = b.i == INT_MAX ? 0 : b.i;
  }
}

}  // namespace

void argmax_rows(const void* logits, bool bf16_logits, int64_t ld, int64_t R, int64_t V, int32_t* out, Stream s) {
  DFLASH_CHECK(R >= 0 && R < INT_MAX && V >= 1 && V < INT_MAX,
               "argmax_rows: need 0 <= R < 2^31 and 1 <= V < 2^31, got R=" << R << " V=" << V);
  DFLASH_CHECK(ld >= V, "argmax_rows: row stride ld=" << ld << " is smaller than V=" << V);
  if (R == 0) return;
  const size_t es = bf16_logits ? 2 : 4;
  DFLASH_CHECK(logits != nullptr && out != nullptr, "argmax_rows: null pointer (logits=" << logits << " out=" << out << ")");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(logits) % es == 0,
               "argmax_rows: logits " << logits << " are not aligned to their " << es << "-byte elements");
  // Threads: enough for kUnroll vectors each over the row, in whole warps, at most kMaxThreads.
  const int64_t per_thread = static_cast<int64_t>(16 / es) * kUnroll;
  const int threads = static_cast<int>(std::clamp<int64_t>((V + per_thread - 1) / per_thread + 31, 32, kMaxThreads) / 32 * 32);
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(R);
  if (bf16_logits)
    argmax_rows_kernel<bf16><<<grid, threads, 0, st>>>(static_cast<const bf16*>(logits), ld, static_cast<int>(V), out);
  else
    argmax_rows_kernel<float><<<grid, threads, 0, st>>>(static_cast<const float*>(logits), ld, static_cast<int>(V), out);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
