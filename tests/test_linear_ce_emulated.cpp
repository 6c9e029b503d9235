// The fused linear cross-entropy's row kernel (kernels/cuda/linear_ce.cu) runs on the CPU through
// tests/cuda_emulation.h, so CI checks the FP8 form's gradient output without a GPU: per row the
// softmax statistics (ce, argmax) and the logits' gradient scale · weight · (softmax − onehot) as
// 1 x 128 e4m3 codes and scales in gemm_fp8's activation layout, straight from the fp32 logits. The
// GEMMs around it are cuBLASLt's (the device's test: CudaLinearCe.Fp8FormMatchesTheCpuFp8Simulation).
//
// Checks, against the gradient in double: every group's scale = max(amax, 1e-10) / 448 (relative
// 1e-5: the kernel's fp32 exp against double), every code within half an e4m3 step of value / scale
// (2^-4 of it, or 2^-10 below the normal range) — a code of the wrong column, group or row is off by
// far more; the columns [V, ld) and the GEMM's padding rows coded 0 with scales 1; a weight-0 row all
// zeros; ce and argmax as the double reference's.
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "kernels/cuda/gemm.h"  // (first: the real declarations the launcher calls)
#define linear_ce linear_ce_emulated
#define linear_ce_workspace linear_ce_workspace_emulated
#define linear_ce_fp8_vocab_ld linear_ce_fp8_vocab_ld_emulated
#include "kernels/cuda/linear_ce.cu"
#undef linear_ce
#undef linear_ce_workspace
#undef linear_ce_fp8_vocab_ld

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/fp8.h"
#include "core/random.h"
#include "core/tensor.h"

namespace {

using namespace dflash;

TEST(LinearCeEmulated, Fp8GradientRowsAreTheQuantizedSoftmaxGradient) {
  // V = 999: eight groups, the last of 103 columns; ld = 1008 (the FP8 form's padded vocabulary, one whole
  // 8-column unit past V).
  const int V = 999, n = 3, np = 4;
  const int64_t ld = cuda::linear_ce_fp8_vocab_ld_emulated(V), lds = cuda::fp8_act_scale_ld(np);
  ASSERT_EQ(ld, 1008);
  const int G = (V + 127) / 128;
  Tensor z = Tensor::empty({np, ld}, DType::F32);
  fill_normal(z, {4250, 1, 0}, 0.0f, 2.5f);
  z.data<float>()[1 * ld + 17] = 12.0f;  // row 1: a dominant logit at its label (p ~ 0.9)
  const std::vector<int32_t> labels = {5, 17, 998};
  const std::vector<float> weights = {0.7f, 1.0f, 0.0f};  // row 2: no loss weight
  const float grad_scale = 0.25f;
  std::vector<uint8_t> q(static_cast<size_t>(np * ld), 0xAB);  // poisoned
  std::vector<float> s(static_cast<size_t>(G * lds), NAN);
  std::vector<float> ce(n, NAN);
  std::vector<int32_t> am(n, -7);
  const cuda::GradDst dst{q.data(), ld, s.data(), lds};
  cuda::launch_kernel(cuda::ce_rows_kernel<cuda::GradOut::Fp8>, dim3(np), dim3(cuda::kThreads), 0, nullptr,
                      static_cast<const float*>(z.data<float>()), dst, labels.data(), weights.data(), grad_scale,
                      ce.data(), am.data(), int64_t{0}, int64_t{n}, V, ld);

  int64_t bad_code = 0, bad_scale = 0, bad_pad = 0;
  for (int r = 0; r < np; ++r) {
    const float* zr = z.data<float>() + r * ld;
    if (r >= n) {  // the GEMM's padding row
      for (int64_t v = 0; v < ld; ++v) bad_pad += q[r * ld + v] != 0;
      for (int g = 0; g < G; ++g) bad_pad += s[g * lds + r] != 1.0f;
      continue;
    }
    int best = 0;
    for (int v = 1; v < V; ++v)
      if (zr[v] > zr[best]) best = v;
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(zr[v]) - zr[best]);
    const double lse = zr[best] + std::log(sum);
    EXPECT_NEAR(ce[r], lse - zr[labels[r]], 1e-4) << "row " << r;
    EXPECT_EQ(am[r], best) << "row " << r;
    const double scale = static_cast<double>(grad_scale) * weights[r];
    for (int g = 0; g < G; ++g) {
      double amax = 0;
      std::vector<double> want(128, 0.0);
      for (int j = 0; j < 128 && g * 128 + j < V; ++j) {
        const int v = g * 128 + j;
        want[j] = scale * (std::exp(zr[v] - lse) - (v == labels[r] ? 1.0 : 0.0));
        amax = std::max(amax, std::abs(want[j]));
      }
      const double s_want = std::max(amax, 1e-10) / 448.0, s_got = s[g * lds + r];
      if (!(std::abs(s_got - s_want) <= 1e-5 * s_want) && bad_scale++ < 5)
        ADD_FAILURE() << "scale of row " << r << " group " << g << ": " << s_got << ", want " << s_want;
      for (int j = 0; j < 128 && g * 128 + j < ld; ++j) {
        const int64_t v = g * 128 + j;
        const uint8_t code = q[r * ld + v];
        if (v >= V) {
          bad_pad += code != 0;
          continue;
        }
        const double got = static_cast<double>(fp8::e4m3_to_float(code)) * s_got;
        const double tol = std::max(std::abs(want[j]) * 0.0625, s_got / 1024.0) * 1.001 + 1e-5 * std::abs(want[j]);
        if (!(std::abs(got - want[j]) <= tol) && bad_code++ < 5)
          ADD_FAILURE() << "code of row " << r << " column " << v << ": " << got << ", want " << want[j];
        if (weights[r] == 0.0f) bad_code += code != 0;
      }
    }
  }
  EXPECT_EQ(bad_code, 0);
  EXPECT_EQ(bad_scale, 0);
  EXPECT_EQ(bad_pad, 0) << "the padding columns and rows: codes 0, scales 1";
}

}  // namespace
