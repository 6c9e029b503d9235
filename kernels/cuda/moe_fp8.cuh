#pragma once
// FP8 experts (the official Qwen3.5/3.6-MoE-FP8 checkpoints' e4m3 codes with 128 x 128 block
// scales), as moe.cu's dequantization and moe_decode.cu's decode kernels read them: every value the
// bf16-rounded code · scale, i.e. exactly what the loader's dequantization (an f32 product, rounded to
// nearest even) stores in a bf16 expert, so FP8 experts give the bf16 experts' bits (W8A16).
// Block layout per expert: gate|up [2I, H] has 2·ceil(I/128) row blocks (the gate rows' blocks, then
// the up rows', as each projection is scaled apart), down [H, I] ceil(H/128); ceil(K/128) column blocks.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/vec.cuh"

namespace dflash::cuda::moe_detail {

// The scale row of weight row r of a matrix whose rows [0, split) and [split, R) are scaled apart
// (gate|up: split = I; down: split = R, one part).
__device__ __forceinline__ int fp8_row_block(int r, int split) {
  return r < split ? r / 128 : (split + 127) / 128 + (r - split) / 128;
}
__host__ __device__ __forceinline__ int fp8_row_blocks(int R, int split) {
  return (split + 127) / 128 + (R - split + 127) / 128;
}

// The block scale of 8-value unit u (values 8u .. 8u + 7, row-major) of El experts [R, K].
__device__ __forceinline__ float fp8_unit_scale(const float* __restrict__ scale, int64_t u, int R, int K, int split) {
  const int ku = K / 8, kb = (K + 127) / 128;
  const int64_t row = u / ku;  // over all experts' rows
  const int c8 = static_cast<int>(u - row * ku), e = static_cast<int>(row / R), r = static_cast<int>(row - int64_t{e} * R);
  return scale[(static_cast<int64_t>(e) * fp8_row_blocks(R, split) + fp8_row_block(r, split)) * kb + c8 / 16];
}

// 8 e4m3 codes (little-endian in r) -> their bf16-rounded values times `scale`.
__device__ __forceinline__ void unpack_e4m3x8(const uint2& r, float scale, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i < 2 ? r.x : r.y;
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((word >> (16 * (i & 1))) & 0xffffu), __NV_E4M3);
    const float2 v = __half22float2(__half2(h));
    f[2 * i] = vec::round_bf16(v.x * scale);
    f[2 * i + 1] = vec::round_bf16(v.y * scale);
  }
}

// 2 e4m3 codes (little-endian in q) -> their bf16-rounded values times `scale`, packed as an mma
// operand register (the lower k in the low half).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t q, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(q), __NV_E4M3);
  const float2 v = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(v.x * scale, v.y * scale);
  uint32_t r;
  memcpy(&r, &b, sizeof(r));
  return r;
}

}  // namespace dflash::cuda::moe_detail
