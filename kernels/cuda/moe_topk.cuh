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

// The warp's max (kMax) or min of v (__reduce_*_sync on sm_80+, a shuffle tree below).
template <bool kMax, class T>
__device__ __forceinline__ T warp_reduce_extreme(T v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if constexpr (kMax) return __reduce_max_sync(0xffffffffu, v);
  else return __reduce_min_sync(0xffffffffu, v);
#else
  for (int o = 16; o; o >>= 1) {
    const T w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? (w > v ? w : v) : (w < v ? w : v);
  }
  return v;
#endif
}

// One warp, E <= 32 kPer logits (kPer a lane). Each round takes the warp's largest p in three warp
// collectives where a shuffle tree took ten: the max of the lanes' keys (a lane's best p's bits + 1,
// 0 for none: p >= 0, so the bits order as the values), then the least expert among the lanes that
// hold it; the winning lane alone looks for its next best.
template <int kPer>
__device__ __forceinline__ void warp_topk_n(const float* __restrict__ row, int E, int k, bool renorm, int lane,
                                            int& my_e, float& my_w) {
  float p[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = i * 32 + lane;
    p[i] = e < E ? row[e] : -INFINITY;
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
  // The lane's best: its largest p, the first (lowest e) of equal values; -2 / INT32_MAX for none
  // (NaN p never compares larger: never chosen).
  float best = -2.0f;
  int be = INT32_MAX;
  auto lane_best = [&] {
    best = -2.0f;
    be = INT32_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (p[i] > best) {
        best = p[i];
        be = i * 32 + lane;
      }
  };
  lane_best();
  float chosen_p = 0, my_p = 0;
  my_e = -1;
  for (int j = 0; j < k; ++j) {
    const unsigned key = best >= 0.0f ? __float_as_uint(best) + 1u : 0u;
    const unsigned top = warp_reduce_extreme<true>(key);
    const int we = warp_reduce_extreme<false>(key == top ? be : INT32_MAX);  // ties: the lower expert
    const float wp = __uint_as_float(top - 1u);
    if (be == we) {  // the winning lane: its next best
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (i * 32 + lane == we) p[i] = -1.0f;
      lane_best();
    }
    chosen_p += wp;
    if (lane == j) {
      my_p = wp;
      my_e = we;
    }
  }
  my_w = renorm ? my_p / chosen_p : my_p;
}

// Every lane of the warp calls it. Lane j < k gets choice j: its expert and its weight (p, or p over
// the chosen p's sum when renorm). `row`: the token's E fp32 logits. The registers a lane holds
// follow E (the sums and the max over a lane's values take its padding as 0 and -inf: the same bits
// for every kPer).
__device__ __forceinline__ void warp_topk(const float* __restrict__ row, int E, int k, bool renorm, int lane,
                                          int& my_e, float& my_w) {
  if (E <= 256) warp_topk_n<8>(row, E, k, renorm, lane, my_e, my_w);
  else warp_topk_n<kMaxE / 32>(row, E, k, renorm, lane, my_e, my_w);
}

}  // namespace dflash::cuda::moe_detail
