// The FP8 quantization kernels (kernels/cuda/fp8.cu) run on the CPU through tests/cuda_emulation.h,
// so CI checks their indexing and arithmetic without a GPU: quantize_fp8_act against the CPU
// reference bit for bit (ops::quantize_fp8_act: the same division, reciprocal and rounding). The
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
#define gated_rms_norm_quant_fp8 gated_rms_norm_quant_fp8_emulated
#include "kernels/cuda/fp8.cu"
#undef fp8_act_scale_ld
#undef fp8_act_scale_elems
#undef quantize_fp8_act
#undef quantize_fp8_weight
#undef quantize_fp8_tiles
#undef rms_norm_quant_fp8
#undef swiglu_quant_fp8
#undef gated_rms_norm_quant_fp8
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
