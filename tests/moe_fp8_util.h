#pragma once
// FP8 experts for the MoE kernels' tests (kernels/cuda/moe_fp8.cuh): random e4m3 codes with random
// 128 x 128 block scales, laid out as MoeBlockParams::experts_*_scale says, and their values as the
// loader's dequantization makes them (the f32 product code · scale, rounded to bf16): what FP8
// experts must compute bit for bit like.
#include <cstdint>
#include <random>

#include "core/fp8.h"
#include "core/tensor.h"

struct Fp8Experts {
  dflash::Tensor codes;  // u8 [E, R, K]
  dflash::Tensor scale;  // f32 [E, row blocks, ceil(K / 128)]
  dflash::Tensor bf16;   // bf16 [E, R, K]: the dequantized values
};

// Rows [0, split) and [split, R) are blocked apart (gate|up: split = I; down: split = R).
inline Fp8Experts make_fp8_experts(int64_t E, int64_t R, int64_t K, int64_t split, uint32_t seed) {
  using namespace dflash;
  const int64_t kb = fp8::blocks(K), rb = fp8::blocks(split) + fp8::blocks(R - split);
  Fp8Experts f{Tensor::empty({E, R, K}, DType::U8), Tensor::empty({E, rb, kb}, DType::F32), {}};
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> code(0, 0x7e);  // every finite magnitude (0x7f is NaN)
  std::uniform_real_distribution<float> sc(0.0005f, 0.004f);
  auto* q = f.codes.data<uint8_t>();
  for (int64_t i = 0; i < E * R * K; ++i) q[i] = static_cast<uint8_t>(code(gen) | ((gen() & 1u) << 7));
  for (int64_t i = 0; i < E * rb * kb; ++i) f.scale.data<float>()[i] = sc(gen);
  Tensor v = Tensor::empty({E, R, K}, DType::F32);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t block = r < split ? r / fp8::kBlock : fp8::blocks(split) + (r - split) / fp8::kBlock;
      for (int64_t c = 0; c < K; ++c)
        v.data<float>()[(e * R + r) * K + c] =
            fp8::e4m3_to_float(q[(e * R + r) * K + c]) * f.scale.data<float>()[(e * rb + block) * kb + c / fp8::kBlock];
    }
  f.bf16 = v.to_dtype(DType::BF16);
  return f;
}
