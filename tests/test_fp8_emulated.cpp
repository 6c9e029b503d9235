// The FP8 quantization kernels (kernels/cuda/fp8.cu) run on the CPU through tests/cuda_emulation.h,
// so CI checks their indexing and arithmetic without a GPU: quantize_fp8_act against the CPU
// reference bit for bit (ops::quantize_fp8_act: the same division, reciprocal and rounding), and
// quantize_fp8_tiles (the FP8 drafter's operands) against the fake quantizer of the same tiles. The
// residual step fused with the quantization (norm.cu's add_rms_norm_quant_fp8) is checked against
// these in test_norm_emulated.cpp. The device's own runs are test_cuda_fp8's.
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "fp8_gemm_layout.h"  // (first: gemm.h's real declarations, for its layout helpers)
// Renamed, so that the emulated definitions sit beside the library's real ones in one test binary.
#define fp8_act_scale_ld fp8_act_scale_ld_emulated
#define fp8_act_scale_elems fp8_act_scale_elems_emulated
#define quantize_fp8_act quantize_fp8_act_emulated
#define quantize_fp8_weight quantize_fp8_weight_emulated
#define quantize_fp8_tiles quantize_fp8_tiles_emulated
#define rms_norm_quant_fp8 rms_norm_quant_fp8_emulated
#define swiglu_quant_fp8 swiglu_quant_fp8_emulated
#define sigmoid_gate_quant_fp8 sigmoid_gate_quant_fp8_emulated
#define sigmoid_gate_quant_fp8_supported sigmoid_gate_quant_fp8_supported_emulated
#define gated_rms_norm_quant_fp8 gated_rms_norm_quant_fp8_emulated
#include "kernels/cuda/fp8.cu"
#undef fp8_act_scale_ld
#undef fp8_act_scale_elems
#undef quantize_fp8_act
#undef quantize_fp8_weight
#undef quantize_fp8_tiles
#undef rms_norm_quant_fp8
#undef swiglu_quant_fp8
#undef sigmoid_gate_quant_fp8
#undef sigmoid_gate_quant_fp8_supported
#undef gated_rms_norm_quant_fp8
// (from here on the emulated kernels go by their _emulated names; kernels/ops.h has a quantize_fp8_act too)

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "kernels/cpu/train_ops.h"
#include "kernels/ops.h"

namespace {

using namespace dflash;
namespace cu = dflash::cuda;

uint64_t g_stream = 8400;

// Host bf16 [R, C] (fp8_gemm_layout::group_scaled_values).
Tensor rand_bf16(int64_t R, int64_t C, float sd) {
  return fp8_gemm_layout::group_scaled_values(R, C, sd, {4244, g_stream++, 0}).to_dtype(DType::BF16);
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> s;
  bool operator==(const Quantized& o) const {
    return q == o.q && s.size() == o.s.size() && std::memcmp(s.data(), o.s.data(), s.size() * sizeof(float)) == 0;
  }
};

Quantized buffers(int64_t M, int64_t K) {
  return {std::vector<uint8_t>(static_cast<size_t>(M * K), 0xAB), std::vector<float>(cu::fp8_act_scale_elems_emulated(M, K), NAN)};
}

Quantized quantize(const Tensor& x_bf16) {
  const int64_t M = x_bf16.size(0), K = x_bf16.size(1);
  Quantized out = buffers(M, K);
  cu::Fp8ActQuantParams p{x_bf16.raw_data(), K, out.q.data(), K, out.s.data(), M, K};
  cu::quantize_fp8_act_emulated(p, nullptr);
  return out;
}

}  // namespace

// quantize_fp8_act's codes and scales (padding entries 1) equal the CPU reference's bit for bit:
// partial last groups, one and several tokens, the grid-stride loop over more groups than the grid,
// NaN inputs of both signs.
TEST(Fp8Emulated, QuantizeActMatchesTheCpuBitForBit) {
  for (int64_t M : {1, 5, 37})
    for (int64_t K : {128, 96, 640, 1040}) {
      SCOPED_TRACE("M " + std::to_string(M) + " K " + std::to_string(K));
      Tensor x = rand_bf16(M, K, 1.0f);
      if (M > 1) {  // NaN of either sign: code 0x7F, the group's scale from the other values
        reinterpret_cast<uint16_t*>(x.raw_data())[3] = 0x7FC1;
        reinterpret_cast<uint16_t*>(x.raw_data())[K + 5] = 0xFFC1;
      }
      const Quantized got = quantize(x);
      const ops::Fp8Act ref = ops::quantize_fp8_act(x.to_dtype(DType::F32));
      EXPECT_EQ(std::memcmp(got.q.data(), ref.q.raw_data(), got.q.size()), 0) << "codes";
      EXPECT_TRUE(fp8_gemm_layout::act_scales_for_gemm(ref.scale) == std::vector<float>(got.s)) << "scales";
    }
}

// quantize_fp8_tiles against cpu::fake_quantize_e4m3 of the same tiles (test_cuda_fp8's
// TileQuantizerEqualsTheFakeQuantizerBitForBit, smaller): block mode (128 x 128: q and the transposed
// codes, one scale a tile) and columns mode (qt in 128 x 1 tiles along the rows, q in 1 x 128 groups:
// quantize_fp8_act's codes and scales), partial tiles, padded rows of x, the transposed padding
// columns as code 0 and nothing written outside the outputs.
TEST(Fp8Emulated, TileQuantizerEqualsTheFakeQuantizerBitForBit) {
  struct Case {
    bool block;
    int64_t rows, cols, pad_x;
  };
  const Case cases[] = {{true, 208, 264, 8}, {true, 130, 128, 0}, {false, 200, 264, 8}, {false, 37, 136, 0}};
  constexpr uint8_t kPoison = 0xAB;
  using fp8::blocks;
  auto round_up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << (c.block ? "block" : "columns") << " rows=" << c.rows << " cols=" << c.cols
                                    << " ldx=cols+" << c.pad_x);
    const Tensor x = rand_bf16(c.rows, c.cols, 1.0f).to_dtype(DType::F32);
    const int64_t ldx = c.cols + c.pad_x;
    std::vector<uint16_t> xb(static_cast<size_t>(c.rows * ldx), 0x7FC0);  // padding columns: NaN (never read)
    const Tensor x16 = x.to_dtype(DType::BF16);
    for (int64_t r = 0; r < c.rows; ++r)
      std::memcpy(xb.data() + r * ldx, static_cast<const uint16_t*>(x16.raw_data()) + r * c.cols,
                  static_cast<size_t>(c.cols) * 2);
    const int64_t qt_cols = c.block ? round_up(c.rows, 16) : round_up(c.rows, 128);
    cu::Fp8TileQuantParams p;
    p.x = xb.data(), p.ldx = ldx, p.rows = c.rows, p.cols = c.cols, p.block = c.block;
    p.ldq = round_up(c.cols, 16) + 16;
    p.lds = c.block ? cu::fp8_weight_scale_ld(c.cols) : cu::fp8_act_scale_ld_emulated(c.rows);
    p.ldst = c.block ? cu::fp8_weight_scale_ld(c.rows) : cu::fp8_act_scale_ld_emulated(c.cols);
    if (!c.block) p.rows_padded = qt_cols;
    p.ldqt = qt_cols + 16;
    std::vector<uint8_t> q(static_cast<size_t>(c.rows * p.ldq), kPoison), qt(static_cast<size_t>(c.cols * p.ldqt), kPoison);
    std::vector<float> s(static_cast<size_t>(blocks(c.block ? c.rows : c.cols) * p.lds), NAN);
    std::vector<float> st(static_cast<size_t>(blocks(c.block ? c.cols : qt_cols) * p.ldst), NAN);
    p.q = q.data(), p.scale = s.data(), p.qt = qt.data(), p.scale_t = st.data();
    cu::quantize_fp8_tiles_emulated(p, nullptr);
    fp8_gemm_layout::expect_tile_quantizer_outputs(x, p, qt_cols, {q.data(), s.data(), qt.data(), st.data()}, kPoison);
  }
}

// The encoders' NaN rule on four packed codes at once (fp8_act::nan_codes_positive): every byte whose
// low 7 bits are all ones (e4m3's NaN, either sign: the device's cvt may keep the sign; the host's
// here never does) becomes 0x7F, every other byte stays, whatever its neighbours: all byte values in
// every position, beside every value of the byte below it (the one a carry would come from).
TEST(Fp8Emulated, NanCodesLoseTheirSignAndNothingElseChanges) {
  int64_t bad = 0;
  for (uint32_t lo = 0; lo < 256; ++lo)
    for (uint32_t hi = 0; hi < 256; ++hi)
      for (int pos = 0; pos < 3; ++pos) {
        const uint32_t w = (lo << (8 * pos)) | (hi << (8 * pos + 8)) | (pos == 0 ? 0xA5000000u : 0x000000A5u);
        const uint32_t got = cu::fp8_act::nan_codes_positive(w);
        for (int b = 0; b < 4; ++b) {
          const uint32_t in = (w >> (8 * b)) & 0xFF, out = (got >> (8 * b)) & 0xFF;
          const uint32_t want = (in & 0x7F) == 0x7F ? 0x7F : in;
          if (out != want && bad++ < 5) ADD_FAILURE() << std::hex << "word " << w << " byte " << b << ": " << out;
        }
      }
  EXPECT_EQ(bad, 0);
}

// swiglu_quant_fp8 (the down projection's input in the FP8 target and drafter) against SwiGLU as
// cuda::swiglu computes and stores it (silu(g) * u in f32, rounded to bf16) then the CPU reference
// quantizer: codes and scales bit for bit; gate | up halves of one [N, 2I] row, partial last groups.
TEST(Fp8Emulated, SwigluQuantEqualsSwigluThenQuantize) {
  for (int64_t N : {1, 5, 37})
    for (int64_t I : {128, 336}) {
      SCOPED_TRACE("N " + std::to_string(N) + " I " + std::to_string(I));
      const Tensor gu = rand_bf16(N, 2 * I, 1.0f), guf = gu.to_dtype(DType::F32);
      Tensor y = Tensor::empty({N, I}, DType::F32);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < I; ++i)
          y.data<float>()[n * I + i] =
              cu::vec::silu(guf.data<float>()[n * 2 * I + i]) * guf.data<float>()[n * 2 * I + I + i];
      const Tensor y_stored = y.to_dtype(DType::BF16).to_dtype(DType::F32);  // as cuda::swiglu stores it
      Quantized got = buffers(N, I);
      cu::swiglu_quant_fp8_emulated(gu.raw_data(), N, I, got.q.data(), I, got.s.data(), nullptr);
      const ops::Fp8Act ref = ops::quantize_fp8_act(y_stored);
      EXPECT_EQ(std::memcmp(got.q.data(), ref.q.raw_data(), got.q.size()), 0) << "codes";
      EXPECT_TRUE(fp8_gemm_layout::act_scales_for_gemm(ref.scale) == got.s) << "scales";
    }
}

// sigmoid_gate_quant_fp8 (the gated attention's o_proj input in the FP8 target) against the gate as
// cuda::sigmoid_gate computes and stores it (x * sigmoid(g) in f32, rounded to bf16) then the CPU reference
// quantizer: codes and scales bit for bit; the gate read at its row and head strides (the q projection's
// [q | gate] per head), heads of 8, 64 and 256 columns (groups across heads when d < 128), partial last groups.
TEST(Fp8Emulated, SigmoidGateQuantEqualsSigmoidGateThenQuantize) {
  for (int64_t N : {1, 6})
    for (const auto& [H, d] : {std::pair<int64_t, int64_t>{3, 256}, {5, 64}, {22, 8}}) {
      SCOPED_TRACE("N " + std::to_string(N) + " H " + std::to_string(H) + " d " + std::to_string(d));
      const int64_t K = H * d, hsg = 2 * d, ldg = H * hsg + 24;
      const Tensor x = rand_bf16(N, K, 2.0f), gate = rand_bf16(N, ldg, 3.0f);
      const Tensor xf = x.to_dtype(DType::F32), gf = gate.to_dtype(DType::F32);
      Tensor y = Tensor::empty({N, K}, DType::F32);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < d; ++j)
            y.data<float>()[n * K + h * d + j] =
                xf.data<float>()[n * K + h * d + j] * cu::vec::sigmoid(gf.data<float>()[n * ldg + h * hsg + d + j]);
      const Tensor y_stored = y.to_dtype(DType::BF16).to_dtype(DType::F32);  // as cuda::sigmoid_gate stores it
      Quantized got = buffers(N, K);
      const uint16_t* g0 = reinterpret_cast<const uint16_t*>(gate.raw_data()) + d;  // the gate half of each head
      cu::sigmoid_gate_quant_fp8_emulated(x.raw_data(), g0, ldg, hsg, N, H, d, got.q.data(), K, got.s.data(), nullptr);
      const ops::Fp8Act ref = ops::quantize_fp8_act(y_stored);
      EXPECT_EQ(std::memcmp(got.q.data(), ref.q.raw_data(), got.q.size()), 0) << "codes";
      EXPECT_TRUE(fp8_gemm_layout::act_scales_for_gemm(ref.scale) == got.s) << "scales";
    }
}

// quantize_fp8_weight (a bf16 checkpoint or random weights quantized at load) against the CPU
// reference's 128 x 128 blocks bit for bit: codes (IEEE division, as the checkpoints were made) and
// scales at ld_scale (padding entries not written), partial blocks at both edges, NaN of either sign.
TEST(Fp8Emulated, QuantizeWeightMatchesTheCpuBitForBit) {
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{128, 128}, {200, 336}, {130, 96}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K));
    Tensor w = rand_bf16(N, K, 0.05f);
    reinterpret_cast<uint16_t*>(w.raw_data())[7] = 0x7FC1;
    reinterpret_cast<uint16_t*>(w.raw_data())[K + 9] = 0xFFC1;
    const int64_t Kb = fp8::blocks(K), Nb = fp8::blocks(N), ld = Kb + 3;
    std::vector<uint8_t> q(static_cast<size_t>(N * K), 0xAB);
    std::vector<float> s(static_cast<size_t>(Nb * ld), NAN);
    cu::quantize_fp8_weight_emulated(w.raw_data(), N, K, q.data(), s.data(), ld, nullptr);
    const ops::Fp8Weight ref = ops::quantize_fp8_weight(w.to_dtype(DType::F32));
    EXPECT_EQ(std::memcmp(q.data(), ref.q.raw_data(), q.size()), 0) << "codes";
    int64_t bad = 0;
    for (int64_t nb = 0; nb < Nb; ++nb)
      for (int64_t kb = 0; kb < ld; ++kb) {
        const float got = s[static_cast<size_t>(nb * ld + kb)];
        if (kb >= Kb) bad += !std::isnan(got);  // padding: not written
        else bad += std::memcmp(&got, ref.scale_inv.data<float>() + nb * Kb + kb, 4) != 0;
      }
    EXPECT_EQ(bad, 0) << "scales";
  }
}
