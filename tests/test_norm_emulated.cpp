// The norm family's kernels (kernels/cuda/norm.cu) run on the CPU through tests/cuda_emulation.h, so CI
// checks them without a GPU where the bits between two device paths are the claim: add_rms_norm's
// block-per-row kernel against its twin, the generic row kernel (tuning::add_norm_rows 0), and the
// same kernel with the FP8 quantization as its output (add_rms_norm_quant_fp8) against add_rms_norm
// then quantize_fp8_act and against rms_norm_quant_fp8 (fp8.cu, emulated in test_fp8_emulated.cpp's
// unit): h, y, codes and scales bit for bit; and gated_rms_norm_quant_fp8 against gated_rms_norm then
// quantize_fp8_act. (The emulated rsqrtf is 1 / sqrtf: a GPU's bits may differ in the last place, but both sides
// of each comparison share it.) The device's own runs: CudaOps.AddRmsNorm,
// CudaFp8.AddRmsNormQuantEqualsAddRmsNormThenQuantize.
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "fp8_gemm_layout.h"  // (first: gemm.h's real declarations)
// Renamed, so that the emulated definitions sit beside the library's real ones in one test binary.
#define rms_norm rms_norm_emulated
#define add_rms_norm add_rms_norm_emulated
#define gated_rms_norm gated_rms_norm_emulated
#define rms_norm_fwd rms_norm_fwd_emulated
#define rms_norm_bwd rms_norm_bwd_emulated
#define gated_norm_blocks gated_norm_blocks_emulated
#define add_norm_rows add_norm_rows_emulated
#define add_norm_quant add_norm_quant_emulated
#define add_rms_norm_quant_fp8 add_rms_norm_quant_fp8_emulated
#define add_rms_norm_quant_fp8_supported add_rms_norm_quant_fp8_supported_emulated
#include "kernels/cuda/norm.cu"
#undef rms_norm
#undef add_rms_norm
#undef gated_rms_norm
#undef rms_norm_fwd
#undef rms_norm_bwd
#undef gated_norm_blocks
#undef add_norm_rows
#undef add_norm_quant
#undef add_rms_norm_quant_fp8
#undef add_rms_norm_quant_fp8_supported

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dflash::cuda {  // fp8.cu's emulated definitions (test_fp8_emulated.cpp's unit)
size_t fp8_act_scale_elems_emulated(int64_t M, int64_t K);
void quantize_fp8_act_emulated(const Fp8ActQuantParams& p, Stream s);
void rms_norm_quant_fp8_emulated(const void* x, int64_t ldx, const void* w, int64_t rows, int64_t D, float eps, uint8_t* q,
                                 int64_t ldq, float* scale, Stream s);
void gated_rms_norm_quant_fp8_emulated(const void* core, const void* z, int64_t ldz, const void* w, int64_t N, int64_t Hv,
                                       int64_t dv, float eps, uint8_t* q, int64_t ldq, float* scale, Stream s);
}  // namespace dflash::cuda

namespace {

using namespace dflash;
namespace cu = dflash::cuda;

uint64_t g_stream = 8500;

Tensor rand_bf16(int64_t R, int64_t C, float sd) {
  return fp8_gemm_layout::group_scaled_values(R, C, sd, {4245, g_stream++, 0}).to_dtype(DType::BF16);
}

bool same(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace

// add_rms_norm: the block-per-row kernel (rows of 1024 < D <= 8192) and the generic row kernel give the
// same h and y bit for bit (the same sums in the same order).
TEST(NormEmulated, AddRmsNormRowsKernelEqualsItsTwin) {
  for (int64_t rows : {1, 5})
    for (int64_t D : {1040, 5120}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
      const Tensor h0 = rand_bf16(rows, D, 1.0f), d = rand_bf16(rows, D, 0.5f), w = rand_bf16(1, D, 0.3f);
      Tensor h[2] = {h0.clone(), h0.clone()}, y[2] = {Tensor::zeros({rows, D}, DType::BF16), Tensor::zeros({rows, D}, DType::BF16)};
      for (int k : {0, 1}) {
        cu::tuning::add_norm_rows_emulated = k;
        cu::add_rms_norm_emulated(h[k].raw_data(), d.raw_data(), w.raw_data(), y[k].raw_data(), rows, D, 1e-6f, nullptr);
      }
      cu::tuning::add_norm_rows_emulated = 1;
      EXPECT_TRUE(same(h[0], h[1])) << "h";
      EXPECT_TRUE(same(y[0], y[1])) << "y";
    }
}

// The fused residual step against add_rms_norm (its block-per-row kernel) then quantize_fp8_act: h, y,
// the codes and the scales (padding entries included) bit for bit; h = bf16(h + d); the codes also
// rms_norm_quant_fp8's of the updated h (the same norm arithmetic); without y the same codes and y
// untouched. Widths of the block-per-row kernel: 1040 (a partial last group), 2048, 5120; one row, a
// decode step's 16; other widths refused.
TEST(NormEmulated, AddRmsNormQuantEqualsAddRmsNormThenQuantize) {
  const float eps = 1e-6f;
  for (int64_t rows : {1, 16})
    for (int64_t D : {1040, 2048, 5120}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
      ASSERT_TRUE(cu::add_rms_norm_quant_fp8_supported_emulated(D));
      const Tensor h0 = rand_bf16(rows, D, 1.0f), d = rand_bf16(rows, D, 0.5f), w = rand_bf16(1, D, 0.3f);
      const size_t S = cu::fp8_act_scale_elems_emulated(rows, D);
      // Unfused.
      Tensor h1 = h0.clone(), y1 = Tensor::zeros({rows, D}, DType::BF16);
      cu::add_rms_norm_emulated(h1.raw_data(), d.raw_data(), w.raw_data(), y1.raw_data(), rows, D, eps, nullptr);
      std::vector<uint8_t> q1(static_cast<size_t>(rows * D), 0xAB);
      std::vector<float> s1(S, NAN);
      cu::Fp8ActQuantParams qp{y1.raw_data(), D, q1.data(), D, s1.data(), rows, D};
      cu::quantize_fp8_act_emulated(qp, nullptr);
      // Fused.
      Tensor h2 = h0.clone(), y2 = Tensor::zeros({rows, D}, DType::BF16);
      std::vector<uint8_t> q2(q1.size(), 0xAB);
      std::vector<float> s2(S, NAN);
      cu::add_rms_norm_quant_fp8_emulated(h2.raw_data(), d.raw_data(), w.raw_data(), y2.raw_data(), rows, D, eps, q2.data(),
                                          D, s2.data(), nullptr);
      EXPECT_TRUE(same(h1, h2)) << "h";
      EXPECT_TRUE(same(y1, y2)) << "y";
      EXPECT_EQ(q1, q2) << "codes";
      EXPECT_EQ(std::memcmp(s1.data(), s2.data(), S * sizeof(float)), 0) << "scales";
      // h after the add: the f32 sum of the two bf16 values, rounded to bf16.
      Tensor sum = h0.to_dtype(DType::F32);
      const Tensor df = d.to_dtype(DType::F32);
      for (int64_t i = 0; i < sum.numel(); ++i) sum.data<float>()[i] += df.data<float>()[i];
      const Tensor h_want = sum.to_dtype(DType::BF16);
      EXPECT_TRUE(same(h2, h_want)) << "h != bf16(h + d)";
      std::vector<uint8_t> q3(q1.size(), 0xAB);
      std::vector<float> s3(S, NAN);
      cu::rms_norm_quant_fp8_emulated(h_want.raw_data(), D, w.raw_data(), rows, D, eps, q3.data(), D, s3.data(), nullptr);
      EXPECT_EQ(q3, q2) << "codes != rms_norm_quant_fp8 of the updated h";
      EXPECT_EQ(std::memcmp(s3.data(), s2.data(), S * sizeof(float)), 0) << "scales != rms_norm_quant_fp8's";
      // Without y: the same codes, h as before, y untouched.
      Tensor h4 = h0.clone(), y4 = Tensor::empty({rows, D}, DType::BF16);
      std::memset(y4.raw_data(), 0xFF, y4.nbytes());
      std::vector<uint8_t> q4(q1.size(), 0xAB);
      std::vector<float> s4(S, NAN);
      cu::add_rms_norm_quant_fp8_emulated(h4.raw_data(), d.raw_data(), w.raw_data(), nullptr, rows, D, eps, q4.data(), D,
                                          s4.data(), nullptr);
      EXPECT_EQ(q4, q2) << "codes without y";
      EXPECT_EQ(std::memcmp(s4.data(), s2.data(), S * sizeof(float)), 0) << "scales without y";
      EXPECT_TRUE(same(h4, h_want)) << "h != bf16(h + d) without y";
      std::vector<unsigned char> ff(y4.nbytes(), 0xFF);
      EXPECT_EQ(std::memcmp(y4.raw_data(), ff.data(), ff.size()), 0) << "y written though not given";
    }
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(1024)) << "a warp-per-row width";
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(8208)) << "past the register cache";
  EXPECT_FALSE(cu::add_rms_norm_quant_fp8_supported_emulated(1032)) << "D % 16 != 0";
}

// The GatedDeltaNet output norm fused with its FP8 quantization (gated_rms_norm_quant_fp8, fp8.cu) against
// gated_rms_norm (norm.cu) then quantize_fp8_act: codes and scales bit for bit. dv 128 (a head a group) and
// 256 (two groups a head), z strided inside a wider row (the in-projection's output), more rows than the
// emulated persistent grid's lane groups (the grid-stride loop).
TEST(NormEmulated, GatedRmsNormQuantEqualsGatedRmsNormThenQuantize) {
  const float eps = 1e-6f;
  struct Case {
    int64_t N, Hv, dv, z_off, z_pad;
  };
  for (const Case& c : {Case{1, 1, 128, 0, 0}, Case{7, 3, 128, 64, 8}, Case{5, 2, 256, 0, 16}, Case{70, 2, 128, 0, 0}}) {
    SCOPED_TRACE("N " + std::to_string(c.N) + " Hv " + std::to_string(c.Hv) + " dv " + std::to_string(c.dv));
    const int64_t K = c.Hv * c.dv, ldz = c.z_off + K + c.z_pad;
    const Tensor core = rand_bf16(c.N * c.Hv, c.dv, 1.0f), proj = rand_bf16(c.N, ldz, 2.0f), w = rand_bf16(1, c.dv, 0.3f);
    const void* z = static_cast<const uint16_t*>(proj.raw_data()) + c.z_off;
    const size_t S = cu::fp8_act_scale_elems_emulated(c.N, K);
    Tensor y = Tensor::zeros({c.N, K}, DType::BF16);
    cu::gated_rms_norm_emulated(core.raw_data(), z, ldz, w.raw_data(), y.raw_data(), c.N, c.Hv, c.dv, eps, nullptr);
    std::vector<uint8_t> q1(static_cast<size_t>(c.N * K), 0xAB), q2(q1.size(), 0xAB);
    std::vector<float> s1(S, NAN), s2(S, NAN);
    cu::Fp8ActQuantParams qp{y.raw_data(), K, q1.data(), K, s1.data(), c.N, K};
    cu::quantize_fp8_act_emulated(qp, nullptr);
    cu::gated_rms_norm_quant_fp8_emulated(core.raw_data(), z, ldz, w.raw_data(), c.N, c.Hv, c.dv, eps, q2.data(), K,
                                          s2.data(), nullptr);
    EXPECT_EQ(q1, q2) << "codes";
    EXPECT_EQ(std::memcmp(s1.data(), s2.data(), S * sizeof(float)), 0) << "scales";
  }
}
