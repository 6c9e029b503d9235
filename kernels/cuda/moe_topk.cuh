#pragma once
// The MoE router's top-k for one token, by one warp (moe.cu's moe_topk kernel and moe_decode.cu's
// decode kernels share it, so both route a token identically): the E logits in registers (E / 32
// per lane), the softmax as the CPU computes it (max, sum of exp(l - max), p = e / sum), k rounds
// of a warp argmax over p (ties: the lower expert index, as the CPU's partial_sort comparator).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace dflash::cuda::moe_detail {

constexpr int kMaxE = 1024;

// Every lane of the warp calls it. Lane j < k gets choice j: its expert and its weight (p, or p over
// the chosen p's sum when renorm). `row`: the token's E fp32 logits (kCoherent: written by other
// blocks of the same launch, read through L2).
template <bool kCoherent = false>
__device__ __forceinline__ void warp_topk(const float* __restrict__ row, int E, int k, bool renorm, int lane,
                                          int& my_e, float& my_w) {
  constexpr int kPer = kMaxE / 32;
  float p[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = i * 32 + lane;
    p[i] = e < E ? (kCoherent ? __ldcg(row + e) : row[e]) : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = i * 32 + lane;
    p[i] = e < E ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = (i * 32 + lane) < E ? p[i] / sum : -1.0f;  // taken ones become -1
  float chosen_p = 0, my_p = 0;
  my_e = -1;
  for (int j = 0; j < k; ++j) {
    float best = -2.0f;
    int be = INT32_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = i * 32 + lane;
      if (p[i] > best) {  // i ascending: the first (lowest e) of equal values stays
        best = p[i];
        be = e;
      }
    }
    for (int o = 16; o; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ob > best || (ob == best && oe < be)) {
        best = ob;
        be = oe;
      }
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (i * 32 + lane == be) p[i] = -1.0f;
    chosen_p += best;
    if (lane == j) {
      my_p = best;
      my_e = be;
    }
  }
  my_w = renorm ? my_p / chosen_p : my_p;
}

}  // namespace dflash::cuda::moe_detail
