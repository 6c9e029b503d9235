#pragma once
// FP8 GEMM operands in gemm_fp8's layouts (kernels/cuda/gemm.h "FP8") from the CPU reference's
// tensors (kernels/ops.h: Fp8Act / Fp8Weight): strided codes and the two scale layouts. Shared by
// the device tests (test_cuda_fp8.cpp) and the emulated streaming GEMM (test_gemm_stream_emulated.cpp).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fp8.h"
#include "core/random.h"
#include "core/tensor.h"
#include "kernels/cuda/gemm.h"

namespace fp8_gemm_layout {

// Host f32 [R, C] of bf16-representable values: N(0, stddev) times 2^e with e in [-3, 3] varying by
// row and 128-column group, so that neighbouring groups and blocks get different scales (a wrong
// scale index shows). `key`: the draw's counter-based RNG key.
inline dflash::Tensor group_scaled_values(int64_t R, int64_t C, float stddev, dflash::RandomParams key) {
  dflash::Tensor f = dflash::Tensor::empty({R, C}, dflash::DType::F32);
  dflash::fill_normal(f, key, 0.0f, stddev);
  float* v = f.data<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) v[r * C + c] *= std::ldexp(1.0f, static_cast<int>((r + 3 * (c / 128)) % 7) - 3);
  return f.to_dtype(dflash::DType::BF16).to_dtype(dflash::DType::F32);
}

// Codes [R, C] (host U8, contiguous) into a byte vector of rows ld apart (padding `pad`).
inline std::vector<uint8_t> strided_codes(const dflash::Tensor& q, int64_t ld, uint8_t pad) {
  const int64_t R = q.size(0), C = q.size(1);
  std::vector<uint8_t> out(static_cast<size_t>(R * ld), pad);
  for (int64_t r = 0; r < R; ++r) std::memcpy(out.data() + r * ld, q.data<uint8_t>() + r * C, static_cast<size_t>(C));
  return out;
}

// Where gemm_fp8 reads a scale.
inline int64_t act_scale_at(int64_t m, int64_t g, int64_t M) { return g * dflash::cuda::fp8_act_scale_ld(M) + m; }
inline int64_t weight_scale_at(int64_t nb, int64_t kb, int64_t K) { return nb * dflash::cuda::fp8_weight_scale_ld(K) + kb; }

// The reference's scales [M, G] / [Nb, Kb] in gemm_fp8's layouts (padding 1).
inline std::vector<float> act_scales_for_gemm(const dflash::Tensor& s) {
  const int64_t M = s.size(0), G = s.size(1);
  std::vector<float> out(dflash::cuda::fp8_act_scale_elems(M, G * dflash::fp8::kBlock), 1.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) out[static_cast<size_t>(act_scale_at(m, g, M))] = s.data<float>()[m * G + g];
  return out;
}
inline std::vector<float> weight_scales_for_gemm(const dflash::Tensor& s, int64_t K) {
  const int64_t Nb = s.size(0), Kb = s.size(1);
  std::vector<float> out(static_cast<size_t>(Nb * dflash::cuda::fp8_weight_scale_ld(K)), 1.0f);
  for (int64_t nb = 0; nb < Nb; ++nb)
    for (int64_t kb = 0; kb < Kb; ++kb) out[static_cast<size_t>(weight_scale_at(nb, kb, K))] = s.data<float>()[nb * Kb + kb];
  return out;
}

}  // namespace fp8_gemm_layout
