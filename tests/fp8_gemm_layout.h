#pragma once
// FP8 GEMM operands in gemm_fp8's layouts (kernels/cuda/gemm.h "FP8") from the CPU reference's
// tensors (kernels/ops.h: Fp8Act / Fp8Weight): strided codes and the two scale layouts. Shared by
// the device tests (test_cuda_fp8.cpp) and the emulated ones (test_gemm_stream_emulated.cpp,
// test_fp8_emulated.cpp), with the tile quantizer's checker both of its tests share.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fp8.h"
#include "core/random.h"
#include "core/tensor.h"
#include "kernels/cpu/train_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/ops.h"

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

// quantize_fp8_tiles' outputs, as host copies (q, scale, qt, scale_t laid out as `p` says; qt's columns
// written up to qt_cols), against cpu::fake_quantize_e4m3 of x (host f32 [p.rows, p.cols]): every dequantized
// value (code times its tile's scale) bit-identical to the reference's, in the forward layout (block: 128 x 128
// blocks; columns: 1 x 128 rows, whose codes and scales must also equal quantize_fp8_act's, the scale rows past
// p.rows 1) and the transposed one (128 x 128 blocks, 128 x 1 columns), the transposed padding columns code 0,
// and no code outside the outputs changed from `poison`. Failures are reported with ADD_FAILURE / EXPECT (the
// first 5 of each kind with their coordinates).
struct TileOutputs {
  const uint8_t* q;
  const float* scale;
  const uint8_t* qt;
  const float* scale_t;
};
inline void expect_tile_quantizer_outputs(const dflash::Tensor& x, const dflash::cuda::Fp8TileQuantParams& p,
                                          int64_t qt_cols, const TileOutputs& o, uint8_t poison) {
  using dflash::fp8::blocks;
  auto same_bits = [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; };
  auto at = [](int64_t i) { return static_cast<size_t>(i); };
  const int64_t rows = p.rows, cols = p.cols;
  dflash::Tensor ref = x.clone();
  dflash::cpu::fake_quantize_e4m3(ref.data<float>(), rows, cols, 128, p.block ? 128 : 1);
  dflash::Tensor ref_rows;  // columns mode: the 1 x 128 rows and quantize_fp8_act's codes and scales
  dflash::ops::Fp8Act act;
  int64_t bad = 0, bad_t = 0, bad_pad = 0, stray = 0;
  if (!p.block) {
    ref_rows = x.clone();
    dflash::cpu::fake_quantize_e4m3(ref_rows.data<float>(), rows, cols, 1, 128);
    act = dflash::ops::quantize_fp8_act(x);
    for (int64_t r = rows; r < p.lds; ++r)
      for (int64_t g = 0; g < blocks(cols); ++g) bad_pad += o.scale[at(g * p.lds + r)] != 1.0f;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) {
      const float want = ref.data<float>()[r * cols + k];
      const uint8_t code = o.q[at(r * p.ldq + k)];
      if (p.block) {
        const float got = dflash::fp8::e4m3_to_float(code) * o.scale[at((r / 128) * p.lds + k / 128)];
        if (!same_bits(got, want) && bad++ < 5) ADD_FAILURE() << "q (" << r << ", " << k << "): " << got << " want " << want;
      } else {
        const float sc = o.scale[at((k / 128) * p.lds + r)];
        const float got = dflash::fp8::e4m3_to_float(code) * sc;
        const float want_row = ref_rows.data<float>()[r * cols + k];
        if ((!same_bits(got, want_row) || code != act.q.data<uint8_t>()[r * cols + k] ||
             !same_bits(sc, act.scale.data<float>()[r * blocks(cols) + k / 128])) &&
            bad++ < 5)
          ADD_FAILURE() << "q rows (" << r << ", " << k << "): " << got << " want " << want_row;
      }
      const float st = p.block ? o.scale_t[at((k / 128) * p.ldst + r / 128)] : o.scale_t[at((r / 128) * p.ldst + k)];
      const float got_t = dflash::fp8::e4m3_to_float(o.qt[at(k * p.ldqt + r)]) * st;
      if (!same_bits(got_t, want) && bad_t++ < 5) ADD_FAILURE() << "qt (" << k << ", " << r << "): " << got_t << " want " << want;
    }
  for (int64_t k = 0; k < cols; ++k) {
    for (int64_t r = rows; r < qt_cols; ++r) bad_pad += o.qt[at(k * p.ldqt + r)] != 0;
    for (int64_t r = qt_cols; r < p.ldqt; ++r) stray += o.qt[at(k * p.ldqt + r)] != poison;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = cols; k < p.ldq; ++k) stray += o.q[at(r * p.ldq + k)] != poison;
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(bad_t, 0);
  EXPECT_EQ(bad_pad, 0) << "the transposed padding columns must be code 0, the rows' padding scales 1";
  EXPECT_EQ(stray, 0) << "codes written outside the outputs";
}

}  // namespace fp8_gemm_layout
