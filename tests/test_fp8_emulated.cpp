// The FP8 quantization kernels (kernels/cuda/fp8.cu) run on the CPU through tests/cuda_emulation.h,
// so CI checks their indexing and arithmetic without a GPU: quantize_fp8_act against the CPU
// reference bit for bit (ops::quantize_fp8_act: the same division, reciprocal and rounding), and the
// residual step fused with the quantization (add_rms_norm_quant_fp8) against its unfused forms run
// the same way: its codes and scales equal quantize_fp8_act of its own bf16 row and
// rms_norm_quant_fp8 of the updated h, bit for bit, and h equals the bf16 sum. (The emulated rsqrtf
// is 1 / sqrtf, so a row's bits may differ from a GPU's in the last place; the comparisons are
// between kernels that share it.) The device's own runs are test_cuda_fp8's.
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
#define add_rms_norm_quant_fp8 add_rms_norm_quant_fp8_emulated
#define add_rms_norm_quant_fp8_supported add_rms_norm_quant_fp8_supported_emulated
#define swiglu_quant_fp8 swiglu_quant_fp8_emulated
#define gated_rms_norm_quant_fp8 gated_rms_norm_quant_fp8_emulated
#define add_norm_quant add_norm_quant_emulated
#include "kernels/cuda/fp8.cu"
#undef fp8_act_scale_ld
#undef fp8_act_scale_elems
#undef quantize_fp8_act
#undef quantize_fp8_weight
#undef quantize_fp8_tiles
#undef rms_norm_quant_fp8
#undef add_rms_norm_quant_fp8
#undef add_rms_norm_quant_fp8_supported
#undef swiglu_quant_fp8
#undef gated_rms_norm_quant_fp8
#undef add_norm_quant
// (from here on the emulated kernels go by their _emulated names; kernels/ops.h has a quantize_fp8_act too)

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
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
// partial last groups, one and several tokens, the grid-stride loop over more groups than the grid.
TEST(Fp8Emulated, QuantizeActMatchesTheCpuBitForBit) {
  for (int64_t M : {1, 5, 37})
    for (int64_t K : {128, 96, 640, 1040}) {
      SCOPED_TRACE("M " + std::to_string(M) + " K " + std::to_string(K));
      const Tensor x = rand_bf16(M, K, 1.0f);
      const Quantized got = quantize(x);
      const ops::Fp8Act ref = ops::quantize_fp8_act(x.to_dtype(DType::F32));
      EXPECT_EQ(std::memcmp(got.q.data(), ref.q.raw_data(), got.q.size()), 0) << "codes";
      EXPECT_TRUE(fp8_gemm_layout::act_scales_for_gemm(ref.scale) == std::vector<float>(got.s)) << "scales";
    }
}

// The fused residual step: h = bf16(h + d) bit for bit; its codes and scales equal quantize_fp8_act
// of its own bf16 row (the unfused pair's second half) and rms_norm_quant_fp8 of the updated h (the
// same norm arithmetic); without y the same codes and y untouched. Widths of the block-per-row
// kernel: 1040 (a partial last group), 2048, 5120; one row, a decode step's 16.
TEST(Fp8Emulated, AddRmsNormQuantEqualsItsUnfusedForms) {
  const float eps = 1e-6f;
  for (int64_t rows : {1, 16})
    for (int64_t D : {1040, 2048, 5120}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
      ASSERT_TRUE(cu::add_rms_norm_quant_fp8_supported_emulated(D));
      const Tensor h0 = rand_bf16(rows, D, 1.0f), d = rand_bf16(rows, D, 0.5f), w = rand_bf16(1, D, 0.3f);
      // h after the add: the f32 sum of the two bf16 values, rounded to bf16.
      Tensor sum = h0.to_dtype(DType::F32);
      const Tensor df = d.to_dtype(DType::F32);
      for (int64_t i = 0; i < sum.numel(); ++i) sum.data<float>()[i] += df.data<float>()[i];
      const Tensor h_want = sum.to_dtype(DType::BF16);

      Tensor h = h0.clone(), y = Tensor::empty({rows, D}, DType::BF16);
      std::memset(y.raw_data(), 0xFF, y.nbytes());
      Quantized fused = buffers(rows, D);
      cu::add_rms_norm_quant_fp8_emulated(h.raw_data(), d.raw_data(), w.raw_data(), y.raw_data(), rows, D, eps, fused.q.data(), D,
                                 fused.s.data(), nullptr);
      EXPECT_EQ(std::memcmp(h.raw_data(), h_want.raw_data(), h.nbytes()), 0) << "h != bf16(h + d)";
      EXPECT_TRUE(fused == quantize(y)) << "codes / scales != quantize_fp8_act of the fused kernel's own y";
      Quantized norm_quant = buffers(rows, D);
      cu::rms_norm_quant_fp8_emulated(h_want.raw_data(), D, w.raw_data(), rows, D, eps, norm_quant.q.data(), D,
                             norm_quant.s.data(), nullptr);
      EXPECT_TRUE(fused == norm_quant) << "codes / scales != rms_norm_quant_fp8 of the updated h";

      Tensor h2 = h0.clone(), y2 = Tensor::empty({rows, D}, DType::BF16);
      std::memset(y2.raw_data(), 0xFF, y2.nbytes());
      Quantized no_y = buffers(rows, D);
      cu::add_rms_norm_quant_fp8_emulated(h2.raw_data(), d.raw_data(), w.raw_data(), nullptr, rows, D, eps, no_y.q.data(), D,
                                 no_y.s.data(), nullptr);
      EXPECT_TRUE(no_y == fused) << "without y";
      EXPECT_EQ(std::memcmp(h2.raw_data(), h_want.raw_data(), h2.nbytes()), 0) << "h != bf16(h + d) without y";
      std::vector<unsigned char> ff(y2.nbytes(), 0xFF);
      EXPECT_EQ(std::memcmp(y2.raw_data(), ff.data(), ff.size()), 0) << "y written though not given";
    }
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(1024)) << "a warp-per-row width";
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(8208)) << "past the register cache";
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(1032)) << "D % 16 != 0";
}
