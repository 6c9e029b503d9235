#pragma once
// The FP8 activation quantizer's device arithmetic (issue 18), shared by fp8.cu's kernels and the
// fused producers elsewhere (norm.cu's add_rms_norm_quant_fp8): per (token, 128-column group) scale =
// max(amax, 1e-10) / 448 and codes e4m3(x · (1 / scale)), bit for bit the CPU reference's
// quantize_fp8_act (kernels/cpu/fp8.cpp); a group is 16 lanes of a half warp holding 8 values each.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "core/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda::fp8_act {

constexpr int kGroupLanes = 16;  // lanes per 128-column activation group
constexpr int kUnit = 8;         // bf16 per 16-byte access

__device__ __forceinline__ float unit_amax(const float (&v)[kUnit]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < kUnit; ++i) a = fmaxf(a, fabsf(v[i]));  // NaN ignored, as std::max in the reference
  return a;
}

// The reference's scale: max(amax, floor) / 448 (amax is never NaN here).
__device__ __forceinline__ float scale_of(float amax) { return __fdiv_rn(fmaxf(amax, fp8::kAmaxFloor), fp8::kE4m3Max); }

// 8 values -> 8 e4m3 codes (byte i = code of v[i]) of v[i] / scale (weights: IEEE division, as the
// checkpoints were made) or v[i] * inv with inv = 1 / scale (activations: one correctly rounded
// reciprocal per group and a multiply per element, as the CPU reference's quantize_fp8_act). The
// reference's clamp to +-448 is the cvt's satfinite (a finite quotient beyond 448, or an infinite one,
// gives +-448 either way); NaN stays NaN (the reference's NaN code is 0x7F whatever the sign; the
// cvt may keep a negative NaN's sign, so nan_codes_positive clears it).
// A code is NaN iff its low 7 bits are all ones (satfinite never makes one of a finite value): per
// byte, t = b & 0x7F plus 1 carries into bit 7 exactly then (no carry leaves the byte), and that bit
// is the sign bit to clear. Four codes in four integer operations, where a compare and a select per
// value cost three times that in this issue-bound kernel family.
__device__ __forceinline__ uint32_t nan_codes_positive(uint32_t w) {
  const uint32_t nan_signs = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan_signs;
}
static_assert(fp8::kE4m3NaN == 0x7F, "nan_codes_positive leaves NaN codes as 0x7F");
template <bool kDivide>
__device__ __forceinline__ uint2 encode_as(const float (&v)[kUnit], float scale_or_inv) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kUnit; i += 2) {
    const float a = kDivide ? __fdiv_rn(v[i], scale_or_inv) : __fmul_rn(v[i], scale_or_inv);
    const float b = kDivide ? __fdiv_rn(v[i + 1], scale_or_inv) : __fmul_rn(v[i + 1], scale_or_inv);
    const uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);  // low byte: a
    w[i / 4] |= pair << (16 * ((i / 2) % 2));
  }
  return make_uint2(nan_codes_positive(w[0]), nan_codes_positive(w[1]));
}
__device__ __forceinline__ uint2 encode(const float (&v)[kUnit], float scale) { return encode_as<true>(v, scale); }
__device__ __forceinline__ uint2 encode_act(const float (&v)[kUnit], float scale) {
  return encode_as<false>(v, __frcp_rn(scale));
}

// Writes the codes of one unit and the group's scale (lane 0 of the group; with the padding entries
// m in [M, lds) of the group's row of scales, written as 1 by the last token's group).
__device__ __forceinline__ void quantize_group(const float (&v)[kUnit], bool active, unsigned mask, int lane, int m,
                                               int M, int g, uint8_t* q, float* scale, int64_t lds) {
  float amax = unit_amax(v);  // inactive units hold zeros
#pragma unroll
  for (int o = kGroupLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
  const float s = scale_of(amax);
  if (active) *reinterpret_cast<uint2*>(q) = encode_act(v, s);
  if (lane == 0) {
    scale[g * lds + m] = s;
    if (m == M - 1)
      for (int64_t p = M; p < lds; ++p) scale[g * lds + p] = 1.0f;
  }
}

// The checks every fused producer shares: its quantized output [M, K] (row stride ldq) and scales.
inline void check_quant_output(const char* who, const uint8_t* q, int64_t ldq, const float* scale, int64_t M, int64_t K) {
  DFLASH_CHECK(K > 0 && K % 16 == 0 && ldq >= K && M * ldq < (int64_t{1} << 31) && M * fp8::blocks(K) < (int64_t{1} << 31),
               who << ": need K > 0 a multiple of 16, ldq >= K and M * ldq < 2^31, got M=" << M << " K=" << K
                   << " ldq=" << ldq);
  DFLASH_CHECK(q != nullptr && scale != nullptr,
               who << ": null output (q=" << static_cast<const void*>(q) << " scale=" << scale << ")");
  DFLASH_CHECK_HINT(vec::aligned16(q) && vec::aligned16(scale) && ldq % 16 == 0,
                    who << ": q and scale must be 16-byte aligned with ldq % 16 == 0, got q=" << static_cast<const void*>(q)
                        << " ldq=" << ldq << " scale=" << scale,
                    "these are what gemm_fp8 needs of its operand");
}

}  // namespace dflash::cuda::fp8_act
