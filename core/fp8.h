#pragma once
// FP8 e4m3 (the "fn" variant of the official -FP8 checkpoints: 1 sign, 4 exponent bits with bias 7,
// 3 mantissa bits, no infinities, NaN = S.1111.111, largest finite 448) and the block-scaling
// recipe those checkpoints were made with (DeepSeek-V3's, transformers' FineGrainedFP8):
//   weights:     128 x 128 blocks, w ~= q * weight_scale_inv[block], weight_scale_inv = amax / 448
//   activations: per token, 1 x 128 groups, x ~= q * s[token, group],  s = amax / 448 (dynamic)
// with amax clamped below at kFp8AmaxFloor (an all-zero block gets a tiny scale, not 0 / 0), and
// x / scale (activations: x * (1 / scale), kernels/ops.h quantize_fp8_act) clamped to [-448, 448]
// before the round-to-nearest-even cast. Host and device code.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DFLASH_FP8_HD __host__ __device__ __forceinline__
#else
#define DFLASH_FP8_HD inline
#endif

namespace dflash::fp8 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr int64_t kBlock = 128;          // weight blocks kBlock x kBlock, activation groups 1 x kBlock
inline constexpr float kAmaxFloor = 1e-10f;     // transformers' per_token_group_quant_fp8 eps
inline constexpr uint8_t kE4m3NaN = 0x7F;

// The 128-wide blocks (or activation groups) that cover n rows or columns, the last one partial.
DFLASH_FP8_HD constexpr int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// The value of an e4m3 code (exact in f32).
DFLASH_FP8_HD float e4m3_to_float(uint8_t v) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 0x7;
  if (exp == 0xF && man == 0x7) return NAN;
  // subnormal: man/8 * 2^-6; normal: (1 + man/8) * 2^(exp - 7)
  const float mag = exp == 0 ? static_cast<float>(man) * 0.001953125f /* 2^-9 */
                             : ldexpf(1.0f + static_cast<float>(man) * 0.125f, static_cast<int>(exp) - 7);
  return sign ? -mag : mag;
}

// The e4m3 code nearest to x (ties to even mantissa), saturating: |x| > 448 gives +-448; NaN gives
// NaN. (CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) does the same.)
DFLASH_FP8_HD uint8_t e4m3_from_float(float x) {
  if (x != x) return kE4m3NaN;
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 31) << 7);
  float a = fabsf(x);
  if (a >= kE4m3Max) return static_cast<uint8_t>(sign | 0x7E);  // 448 (also +-inf)
  if (a == 0.0f) return sign;                                     // +-0 (frexp would say binade 2^-1)
  // Scale into the subnormal grid or find the binade; round the mantissa to 3 bits, ties to even.
  int e;
  frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1): binade exponent e - 1
  int be = e - 1;  // a in [2^be, 2^(be+1))
  if (be < -6) be = -6;  // subnormals share the quantum of the smallest binade
  const float quantum = ldexpf(1.0f, be - 3);
  float q = a / quantum;                  // exact (power of two), in [0, 16)
  float r = rintf(q);                     // round half to even (default rounding mode)
  int n = static_cast<int>(r);            // multiples of the quantum: 8..16 in a binade, 0..8 below
  if (n == 16) {  // rounded up into the next binade
    n = 8;
    be += 1;
  }
  if (be == -6 && n < 8) return static_cast<uint8_t>(sign | n);  // subnormal (or zero)
  const int exp = be + 7;
  if (exp > 15 || (exp == 15 && n - 8 > 6)) return static_cast<uint8_t>(sign | 0x7E);
  return static_cast<uint8_t>(sign | (exp << 3) | (n - 8));
}

}  // namespace dflash::fp8
