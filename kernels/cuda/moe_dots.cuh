#pragma once
// Row dot products of the MoE kernels that stream weight rows against a few token rows (a warp a
// weight row): moe_decode.cu's decode kernels and moe.cu's router of decode / verify steps. Every
// (row, token) sum is taken in an order fixed by K alone (the lane's 16-byte units in order, then
// the caller's warp butterfly), so a token's values do not depend on how many tokens come with it.
// Plain C++ (no PTX): the emulated tests run them on the CPU.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/moe_fp8.cuh"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda::moe_detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint4 ldg16(const bf16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// A weight row in 8-element units: bf16 as stored, or e4m3 codes with their 128 x 128 block scales
// (FP8 experts, MoeBlockParams::experts_*_scale), each value the bf16-rounded code · scale: exactly
// what the loader's dequantization (f32 product, round to nearest even) puts in a bf16 row, so both
// rows give the same bits. load(u) fetches unit u (columns 8u .. 8u + 7), unpack makes it floats.
struct Bf16Row {
  const bf16* p = nullptr;
  using Raw = uint4;
  __device__ __forceinline__ Raw load(int u) const { return ldg16(p + 8 * u); }
  __device__ __forceinline__ void unpack(const Raw& r, int, float (&f)[8]) const { vec::unpack(r, f); }
};
struct Fp8Row {
  const uint8_t* p = nullptr;   // the row's codes
  const float* scale = nullptr;  // the row's block scales, one per 128 columns
  using Raw = uint2;
  __device__ __forceinline__ Raw load(int u) const { return __ldg(reinterpret_cast<const uint2*>(p + 8 * u)); }
  __device__ __forceinline__ void unpack(const Raw& r, int u, float (&f)[8]) const {
    moe_detail::unpack_e4m3x8(r, __ldg(scale + (u >> 4)), f);
  }
};
template <class W>
__device__ __forceinline__ typename W::Raw zero_raw() {
  typename W::Raw r;
  memset(&r, 0, sizeof(r));
  return r;
}

// Lane partial sums of kW weight rows w[i] (K elements each) against T <= kT token rows x + t·ldx:
// acc[i][t]. kB units of every row are loaded before any is used.
template <class W, int kW, int kT, int kB>
__device__ __forceinline__ void dots(const W (&w)[kW], const bf16* __restrict__ x, int64_t ldx, int T, int K, int lane,
                                     float (&acc)[kW][kT]) {
#pragma unroll
  for (int i = 0; i < kW; ++i)
#pragma unroll
    for (int t = 0; t < kT; ++t) acc[i][t] = 0.0f;
  const int units = K >> 3;
  for (int u0 = 0; u0 < units; u0 += 32 * kB) {
    typename W::Raw wr[kW][kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int u = u0 + 32 * b + lane;
#pragma unroll
      for (int i = 0; i < kW; ++i) wr[i][b] = u < units ? w[i].load(u) : zero_raw<W>();
    }
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      if (t < T) {
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int u = u0 + 32 * b + lane;
          if (u < units) {
            const uint4 xr = ldg16(x + t * ldx + 8 * u);
            float xf[8];
            vec::unpack(xr, xf);
#pragma unroll
            for (int i = 0; i < kW; ++i) {
              float wf[8];
              w[i].unpack(wr[i][b], u, wf);
#pragma unroll
              for (int q = 0; q < 8; ++q) acc[i][t] = fmaf(wf[q], xf[q], acc[i][t]);
            }
          }
        }
      }
    }
  }
}

// Lane partial sums of kW dot products, weight row w[i] against its own activation row a[i] (K each).
template <class W, int kW, int kB>
__device__ __forceinline__ void pair_dots(const W (&w)[kW], const bf16* const (&a)[kW], int K, int lane,
                                          float (&acc)[kW]) {
#pragma unroll
  for (int i = 0; i < kW; ++i) acc[i] = 0.0f;
  const int units = K >> 3;
  for (int u0 = 0; u0 < units; u0 += 32 * kB) {
    typename W::Raw wr[kW][kB];
    uint4 ar[kW][kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int u = u0 + 32 * b + lane;
#pragma unroll
      for (int i = 0; i < kW; ++i) {
        wr[i][b] = u < units ? w[i].load(u) : zero_raw<W>();
        ar[i][b] = u < units ? ldg16(a[i] + 8 * u) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int u = u0 + 32 * b + lane;
      if (u < units) {
#pragma unroll
        for (int i = 0; i < kW; ++i) {
          float wf[8], af[8];
          w[i].unpack(wr[i][b], u, wf);
          vec::unpack(ar[i][b], af);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[i] = fmaf(wf[q], af[q], acc[i]);
        }
      }
    }
  }
}


}  // namespace dflash::cuda::moe_detail
