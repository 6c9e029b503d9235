// CUDA GatedDeltaNet kernels (kernels/cuda/gdn_conv.cu, gdn_recurrent.cu) against the fp32 CPU
// reference ops, from the op-case table (kernels/cases/gdn_cases.h): causal_conv1d (fast and
// fallback) and gdn_prep (l2norm + gates); the delta rule's table runs in test_cuda_delta_rule.cpp.
// Inputs are bf16 drawn on the GPU (the CPU gets the same values in f32); every output is poisoned
// (NaN) before the launch. The parameter checks (rejects) are written out here; last, print-only
// timings at the Qwen3.6-27B shape.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "kernels/cases/gdn_cases.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/gdn.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "cuda_timing.h"
#include "test_util.h"

using namespace dflash;
using cases::Knob;

namespace {

cuda::Stream stream0() { return DeviceContext::get(0).stream(); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }
// Element pointer `off` elements into a bf16 tensor.
void* at_bf16(const Tensor& t, int64_t off) { return static_cast<uint16_t*>(t.raw_data()) + off; }
Tensor cu_seqlens_gpu(const std::vector<int64_t>& lens) { return cases::device_i32(cases::offsets_of(lens).offsets); }

}  // namespace

// ---- causal conv ---------------------------------------------------------------------------------
// Bounds (ConvCase::y_bound): the kernels accumulate the K taps in f32 in the reference's order and
// round once to bf16, so against the f32 CPU output the normalised error is at most half a bf16 ulp
// of the largest output (2^-9 ~ 2e-3): bound 1e-2. Fast and fallback use the same fmaf order, so
// they must agree bit for bit (zero padding contributes fmaf(w, 0, acc) = acc exactly); shapes the
// fast kernel does not take (K > 4, odd C / ldx / column offsets) it must refuse.
// Measured on an H200: worst 3.4e-3 (fast), 3.7e-3 (fallback); fast == fallback everywhere.
TEST(CudaGdn, CausalConvFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double worst_fast = 0, worst_fb = 0;
  uint64_t seed = 7000;
  for (const cases::ConvCase& c : cases::conv_check_cases()) {
    SCOPED_TRACE(c.describe());
    const cases::ConvData data = cases::draw(c, seed++);
    const Tensor ref = data.reference(c);
    Tensor yfb = cases::poisoned({c.N(), c.C}, DType::BF16, Device::cuda(0));
    cases::kConvFallback.launch(data.params(c, yfb.raw_data()), stream0());
    const double efb = max_rel_err(yfb, ref);
    worst_fb = std::max(worst_fb, efb);
    EXPECT_LT(efb, c.y_bound) << "fallback";
    if (c.C % 8 == 0) {
      ASSERT_EQ(cuda::causal_conv1d_fast_supported(c.C, c.K), c.K <= 4);
    }
    if (!c.fast_ok()) {
      Tensor yf = cases::poisoned({c.N(), c.C}, DType::BF16, Device::cuda(0));
      EXPECT_THROW(cases::kConvFast.launch(data.params(c, yf.raw_data()), stream0()), Error);
      continue;
    }
    for (int R : c.runs) {  // tokens per thread: the automatic choice and forced ones
      Knob knob(cuda::tuning::conv_tokens_per_thread, R);
      Tensor yf = cases::poisoned({c.N(), c.C}, DType::BF16, Device::cuda(0));
      cases::kConvFast.launch(data.params(c, yf.raw_data()), stream0());
      const double ef = max_rel_err(yf, ref);
      worst_fast = std::max(worst_fast, ef);
      EXPECT_LT(ef, c.y_bound) << "fast R " << R;
      EXPECT_EQ(max_rel_err(yf, yfb), 0.0) << "fast vs fallback R " << R;
    }
  }
  std::printf("causal_conv1d: worst normalised error vs CPU: fast %.3g, fallback %.3g\n", worst_fast, worst_fb);
}

TEST(CudaGdn, CausalConvRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const cases::ConvCase c{"", {4}, 64, 4};
  const cases::ConvData data = cases::draw(c, 1);
  Tensor y = Tensor::empty({4, 64}, DType::BF16, Device::cuda(0));
  const cuda::ConvParams p = data.params(c, y.raw_data());
  EXPECT_NO_THROW(cuda::causal_conv1d_fast(p, stream0()));
  auto fast_throws = [&](auto mutate) {
    cuda::ConvParams q = p;
    mutate(q);
    EXPECT_THROW(cuda::causal_conv1d_fast(q, stream0()), Error);
  };
  fast_throws([](cuda::ConvParams& q) { q.K = 5; });
  fast_throws([](cuda::ConvParams& q) { q.K = 0; });
  fast_throws([](cuda::ConvParams& q) { q.C = 60; });
  fast_throws([](cuda::ConvParams& q) { q.ldx = 63; q.C = 56; });  // rows not 16-byte aligned
  fast_throws([&](cuda::ConvParams& q) { q.x = at_bf16(data.x[0], 1); q.C = 56; });  // misaligned pointer
  fast_throws([](cuda::ConvParams& q) { q.ldx = 32; });  // ldx < C
  fast_throws([](cuda::ConvParams& q) { q.num_seqs = 0; });
  EXPECT_FALSE(cuda::causal_conv1d_fast_supported(60, 4));
  EXPECT_FALSE(cuda::causal_conv1d_fast_supported(64, 5));
  EXPECT_TRUE(cuda::causal_conv1d_fast_supported(10240, 4));
  cuda::ConvParams q = p;
  q.ldx = 32;
  EXPECT_THROW(cuda::causal_conv1d_fallback(q, stream0()), Error);
  q = p;
  q.K = 0;
  EXPECT_THROW(cuda::causal_conv1d_fallback(q, stream0()), Error);
  DeviceContext::get(0).synchronize();
}

// ---- gdn_prep ----------------------------------------------------------------------------------
// Bounds (PrepCase): q/k: l2norm in f32 then one rounding to bf16: normalised error <= 2^-9 of the
// largest element, bound 1e-2. g/beta: f32 on both sides (expf/log1pf vs std::exp/log1p, a few
// ulp): bound 1e-5. Every persistent grid size gives the same bits.
// Measured on an H200: q/k <= 3.2e-3, g <= 1.1e-7, beta <= 1.3e-7.
TEST(CudaGdn, PrepMatchesCpuL2NormAndGates) {
  DFLASH_REQUIRE_GPU();
  uint64_t seed = 7500;
  for (const cases::PrepCase& c : cases::prep_check_cases()) {
    const cases::PrepData data = cases::draw(c, seed++);
    const cases::PrepOutputs ref = data.reference(c);
    // The automatic persistent grid, and 1 or 3 blocks (every lane group streams many rows and
    // each thread several gates).
    Tensor q0, k0;
    for (int blocks : c.blocks) {
      Knob knob(cuda::tuning::prep_blocks, blocks);
      cases::PrepOutputs out = data.poisoned_outputs(c);
      cuda::gdn_prep(data.params(c, out), stream0());
      const std::string what = c.describe() + " blocks " + std::to_string(blocks);
      const double eq = max_rel_err(out.q, ref.q), ek = max_rel_err(out.k, ref.k);
      const double eg = max_rel_err(out.g, ref.g), eb = max_rel_err(out.beta, ref.beta);
      EXPECT_LT(eq, c.qk_bound) << "q " << what;
      EXPECT_LT(ek, c.qk_bound) << "k " << what;
      EXPECT_LT(eg, c.gate_bound) << "g " << what;
      EXPECT_LT(eb, c.gate_bound) << "beta " << what;
      std::printf("gdn_prep %s: q %.3g k %.3g g %.3g beta %.3g\n", what.c_str(), eq, ek, eg, eb);
      if (blocks == c.blocks.front()) {
        q0 = out.q;
        k0 = out.k;
      } else {
        EXPECT_EQ(max_rel_err(out.q, q0), 0.0) << "q " << what << " vs the first grid";
        EXPECT_EQ(max_rel_err(out.k, k0), 0.0) << "k " << what << " vs the first grid";
      }
    }
  }
}

TEST(CudaGdn, PrepRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  cuda::GdnPrepParams bad;
  bad.N = 4;
  bad.Hk = 2;
  bad.Hv = 4;
  bad.dk = 16;
  bad.ld_conv = 63;  // < 2*Hk*dk
  bad.ld_ab = 8;
  bad.scale = 0.25f;
  EXPECT_THROW(cuda::gdn_prep(bad, stream0()), Error);
  bad.ld_conv = 64;
  bad.ld_ab = 3;  // < Hv
  EXPECT_THROW(cuda::gdn_prep(bad, stream0()), Error);
}

// ---- recurrent gated delta rule: the table's check runs in test_cuda_delta_rule.cpp -----------------
TEST(CudaGdn, RecurrentDeltaRuleRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const Tensor cu = cu_seqlens_gpu({0});  // N = 0: the kernel only writes (no) state
  cuda::DeltaRuleParams p;
  p.cu_seqlens = i32(cu);
  p.num_seqs = 1;
  p.N = 0;
  p.Hk = 2;
  p.Hv = 6;
  p.dk = 16;
  p.dv = 16;
  p.ldv = 96;
  EXPECT_NO_THROW(cuda::recurrent_gated_delta_rule(p, stream0()));
  const auto throws =
      throws_after_edit(p, [](const cuda::DeltaRuleParams& q) { cuda::recurrent_gated_delta_rule(q, stream0()); });
  throws([](cuda::DeltaRuleParams& q) { q.Hv = 5; });      // not a multiple of Hk
  throws([](cuda::DeltaRuleParams& q) { q.dk = 2048; });   // above the supported dk
  throws([](cuda::DeltaRuleParams& q) { q.ldv = 95; });    // ldv < Hv*dv
  throws([](cuda::DeltaRuleParams& q) { q.num_seqs = 0; });
  throws([](cuda::DeltaRuleParams& q) { q.N = 4; });       // null q/k/v/... pointers
  DeviceContext::get(0).synchronize();
}

// ---- timings (print only) ------------------------------------------------------------------------
namespace {

// Median of `iters` event-timed launches after `warm` warm-up launches, in ms.
float time_ms(const std::function<void()>& launch, int warm, int iters) {
  return static_cast<float>(median_ms(stream0(), warm, iters, launch));
}

}  // namespace

TEST(CudaGdn, TimingsPrintOnly) {
  DFLASH_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  // The conv over the in-projection output rows of Qwen3.6-27B: [q 2048 | k 2048 | v 6144 | z 6144 |
  // b 48 | a 48], the first 10240 columns.
  const cases::ConvCase conv{"", {8192}, 10240, 4, 10240 + 6144 + 48 + 48};
  const cases::ConvData cd = cases::draw(conv, 7900);
  Tensor y = Tensor::empty({conv.N(), conv.C}, DType::BF16, gpu);
  const cuda::ConvParams p = cd.params(conv, y.raw_data());
  const double bytes = 2.0 * conv.N() * conv.C * 2;
  std::printf("causal_conv1d T=%lld C=%lld K=%lld (roofline %.1f MB, 0.080 ms at 4.2 TB/s):\n",
              static_cast<long long>(conv.N()), static_cast<long long>(conv.C), static_cast<long long>(conv.K),
              bytes / 1e6);
  for (int R : {0, 32, 64, 96, 128, 160, 192, 256}) {
    Knob knob(cuda::tuning::conv_tokens_per_thread, R);
    const float ms = time_ms([&] { cases::kConvFast.launch(p, stream0()); }, 5, 30);
    std::printf("  fast  R=%-4s %8.4f ms  %7.1f GB/s\n", R ? std::to_string(R).c_str() : "auto", ms,
                bytes / (ms * 1e-3) / 1e9);
  }
  {
    const float ms = time_ms([&] { cases::kConvFallback.launch(p, stream0()); }, 2, 10);
    std::printf("  fallback    %8.4f ms  %7.1f GB/s\n", ms, bytes / (ms * 1e-3) / 1e9);
  }
  {  // The ceiling: a device-to-device copy of the same N·C·2 bytes (read + write counted).
    Tensor dst = Tensor::empty({conv.N(), conv.C}, DType::BF16, gpu);
    const float ms = time_ms(
        [&] {
          cudaMemcpyAsync(dst.raw_data(), y.raw_data(), static_cast<size_t>(conv.N() * conv.C * 2),
                          cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream0()));
        },
        3, 30);
    std::printf("  d2d copy    %8.4f ms  %7.1f GB/s (ceiling)\n", ms, bytes / (ms * 1e-3) / 1e9);
  }

  // gdn_prep and the recurrent rule at the same shape (Hk 16, Hv 48, d 128).
  const cases::PrepCase prep{8192, 16, 48, 128, 128};
  const cases::PrepData pd = cases::draw(prep, 7901);
  cases::PrepOutputs po = pd.poisoned_outputs(prep);
  const cuda::GdnPrepParams pp = pd.params(prep, po);
  const double prep_bytes = prep.N * (2.0 * prep.Hk * prep.dk * 2 * 2 + prep.Hv * (2 * 2 + 2 * 4));
  for (int blocks : {0, 132, 264, 396, 528, 792}) {  // persistent grid (0: as many blocks as fit)
    Knob knob(cuda::tuning::prep_blocks, blocks);
    const float ms = time_ms([&] { cuda::gdn_prep(pp, stream0()); }, 3, 20);
    std::printf("gdn_prep T=%lld Hk=%lld Hv=%lld dk=%lld blocks %d: %.4f ms  %.1f GB/s\n",
                static_cast<long long>(prep.N), static_cast<long long>(prep.Hk), static_cast<long long>(prep.Hv),
                static_cast<long long>(prep.dk), blocks, ms, prep_bytes / (ms * 1e-3) / 1e9);
  }
  // kernel_bench's gdn shapes T8192 and 8 x 1024 tokens (several sequences fill more of the GPU).
  for (const cases::RuleCase& c : cases::rule_perf_cases(false)) {
    if (c.N() != 8192) continue;
    const cases::RuleData rd = cases::draw(c, 7902);
    Tensor out = Tensor::empty({c.N(), c.Hv, c.dv}, DType::BF16, gpu);
    Tensor state = Tensor::empty({static_cast<int64_t>(c.lens.size()), c.Hv, c.dk, c.dv}, DType::F32, gpu);
    const cuda::DeltaRuleParams rp = rd.params(out.raw_data(), state.data<float>());
    for (int rows : {0, 8, 16, 32}) {
      Knob knob(cuda::tuning::recurrent_rows_per_thread, rows);
      const float ms = time_ms([&] { cases::kRecurrentFallback.launch(rp, stream0()); }, 1, 5);
      std::printf("recurrent_gated_delta_rule %s Hk=%lld Hv=%lld d=%lld rows/thread %-4s: %.3f ms (%.1f us/token)\n",
                  c.shape.c_str(), static_cast<long long>(c.Hk), static_cast<long long>(c.Hv),
                  static_cast<long long>(c.dk), rows ? std::to_string(rows).c_str() : "auto", ms, ms * 1e3 / c.N());
    }
  }
  DeviceContext::get(0).synchronize();
}
