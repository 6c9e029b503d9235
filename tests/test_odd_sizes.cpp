// Model sizes the GPU kernels constrain (issue 26), decided at start-up by the plans (host logic: runs
// without a GPU, in CI). The GPU side of the same sizes is tests/test_cuda_odd_sizes.cpp.
//  - a target's projection sizes that are not multiples of 8 are named by unaligned_gemm_sizes, and
//    (CUDA build) its plan's gemm step is the named fallback, which require_fast_path refuses;
//  - the FP8 target with a projection size not a multiple of 16 is refused by make_plan, naming
//    the field and the way out (bf16), before any weight is read;
//  - the CUDA drafter refuses hidden_size / head_dim not multiples of 8 (naming the field and what
//    to do) and runs an odd intermediate_size on the named gemm fallback.
#include <gtest/gtest.h>

#include "drafter/config.h"
#include "drafter/fast_path.h"
#include "target_model/fast_path.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

TargetConfig tiny() {
  return TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/tiny/config.json");
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "in: " << (text)

drafter::DrafterPlan plan_of(const drafter::DrafterConfig& dc, bool require_fast_path = false) {
  drafter::BlockAttentionKernels k;
  k.tensor_cores = dc.head_dim == 64 || dc.head_dim == 128;
  k.kernel = "mma.sync";
  return drafter::drafter_plan(dc, Device::cuda(0), 9, 0, k, require_fast_path);
}

}  // namespace

TEST(OddSizes, UnalignedGemmSizesNameTheFields) {
  TargetConfig c = tiny();
  EXPECT_EQ(unaligned_gemm_sizes(c), "");
  c.vocab_size = 777;  // the vocabulary is no GEMM's K or row stride (the logits rows are padded)
  EXPECT_EQ(unaligned_gemm_sizes(c), "");
  c.intermediate_size = 1001;
  EXPECT_EQ(unaligned_gemm_sizes(c), "intermediate_size=1001");
  c.hidden_size = 333;
  c.linear_value_head_dim = 18;  // 4 value heads x 18 = 72: a multiple of 8, not named
  EXPECT_EQ(unaligned_gemm_sizes(c), "hidden_size=333, intermediate_size=1001");
  c.linear_num_value_heads = 6;  // 6 x 18 = 108
  c.head_dim = 40;               // 4 x 40 = 160: fine
  c.validate();
  EXPECT_EQ(unaligned_gemm_sizes(c), "hidden_size=333, intermediate_size=1001, linear_num_value_heads x "
                                     "linear_value_head_dim = 6 x 18 = 108");
  check_gpu_sizes(c, Precision::Bf16);  // bf16 takes every size: no throw
}

TEST(OddSizes, Fp8TargetNeedsMultiplesOf16AndIsRefusedByThePlan) {
  TargetConfig c = tiny();
  check_gpu_sizes(c, Precision::Fp8);  // every size a multiple of 16: no throw
  c.intermediate_size = 1000;          // a multiple of 8, not of 16
  const std::string e = error_of([&] { make_plan(c, Device::cuda(0), {}, 9, Precision::Fp8); });
  EXPECT_HAS(e, "the FP8 target on the GPU needs every projection's input size a multiple of 16");
  EXPECT_HAS(e, "intermediate_size=1000");
  EXPECT_HAS(e, "model.target.precision: bf16");
  EXPECT_EQ(error_of([&] { make_decode_plan(c, Device::cuda(0), {}, 9, Precision::Fp8); }), e);
  EXPECT_EQ(error_of([&] { make_plan(c, Device::cpu(), {}, 9, Precision::Fp8); }), "") << "the CPU reference takes it";
}

TEST(OddSizes, RopeKernelLimitsAreRefusedByThePlan) {
  TargetConfig c = tiny();
  c.head_dim = 512;
  c.partial_rotary_factor = 1.0;  // 512 rotary dims
  c.validate();
  const std::string e = error_of([&] { make_plan(c, Device::cuda(0), {}, 9); });
  EXPECT_HAS(e, "head_dim 512 x partial_rotary_factor 1 = 512 rotary dims; the GPU's q/k norm + RoPE kernel takes at most 256");
  EXPECT_EQ(error_of([&] { make_decode_plan(c, Device::cuda(0), {}, 9); }), e);
  c.partial_rotary_factor = 0.25;  // 128 rotary dims: fine
  EXPECT_EQ(error_of([&] { check_gpu_sizes(c, Precision::Bf16); }), "");
  c.head_dim = 4096;
  c.partial_rotary_factor = 1.0 / 32;
  EXPECT_HAS(error_of([&] { check_gpu_sizes(c, Precision::Bf16); }), "head_dim 4096 is too large for the GPU's q/k norm");
}

#if DFLASH_WITH_CUDA
TEST(OddSizes, GemmFallbackIsNamedInThePlanAndRefusedWhenFastIsRequired) {
  TargetConfig c = tiny();
  c.vocab_size = 777;
  FastPathPlan p = make_plan(c, Device::cuda(0), {}, 9);
  for (const LayerPlan& l : p.layers) {  // an odd vocabulary keeps the GEMMs on the fast path
    EXPECT_EQ(l.step(Step::Gemm).kernel, "gemm_bf16");
    EXPECT_EQ(l.step(Step::Gemm).path, Path::Fast);
  }
  c.intermediate_size = 1001;
  for (const FastPathPlan& q : {make_plan(c, Device::cuda(0), {}, 9), make_decode_plan(c, Device::cuda(0), {}, 9)}) {
    for (const LayerPlan& l : q.layers) {
      const StepPlan& g = l.step(Step::Gemm);
      EXPECT_EQ(g.kernel, kGemmUnalignedKernel);
      EXPECT_EQ(g.path, Path::Fallback);
      EXPECT_HAS(g.reason, "intermediate_size=1001 not multiples of 8");
    }
    size_t gemm_lines = 0;
    for (const std::string& f : q.fallbacks()) gemm_lines += f.find(" gemm: gemm_bf16_unaligned") != std::string::npos;
    EXPECT_EQ(gemm_lines, static_cast<size_t>(c.num_hidden_layers));
  }
  const std::string e = error_of([&] { make_plan(c, Device::cuda(0), KernelPolicies::all(KernelPolicy::Auto, true), 9); });
  EXPECT_HAS(e, "require_fast_path is set");
  EXPECT_HAS(e, "gemm: gemm_bf16_unaligned");
  EXPECT_HAS(e, "intermediate_size=1001");
}
#endif

TEST(OddSizes, CudaDrafterRefusesHiddenAndHeadDimsAndRunsAnOddIntermediateOnTheFallback) {
  TargetConfig t = tiny();
  t.vocab_size = 777;
  drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(t, 2, 776, 8);
  drafter::DrafterPlan p = plan_of(dc);  // an odd vocabulary: all fast
  EXPECT_EQ(p.steps[1].step, "gemm");
  EXPECT_EQ(p.steps[1].path, "fast");

  dc.intermediate_size = 1001;
  p = plan_of(dc);
  EXPECT_EQ(p.steps[1].path, "fallback");
  EXPECT_HAS(p.steps[1].reason, "intermediate_size 1001 is not a multiple of 8");
  const std::string fast = error_of([&] { plan_of(dc, true); });
  EXPECT_HAS(fast, "require_fast_path is set, but the drafter's GEMMs would run the fallback kernels");
  EXPECT_HAS(fast, "set model.drafter.intermediate_size to a multiple of 8");

  drafter::DrafterConfig hd = drafter::DrafterConfig::for_target(t, 2, 776, 8);
  hd.head_dim = 36;
  const std::string eh = error_of([&] { plan_of(hd); });
  EXPECT_HAS(eh, "the CUDA drafter needs these sizes multiples of 8");
  EXPECT_HAS(eh, "head_dim 36 (model.drafter.head_dim)");
  EXPECT_HAS(eh, "set model.drafter.head_dim to a multiple of 8");

  hd.head_dim = 512;
  EXPECT_HAS(error_of([&] { plan_of(hd); }), "head_dim 512 (model.drafter.head_dim) above 256");

  t.hidden_size = 333;
  const drafter::DrafterConfig odd = drafter::DrafterConfig::for_target(t, 2, 776, 8);
  const std::string e = error_of([&] { plan_of(odd); });
  EXPECT_HAS(e, "hidden_size 333 (the target's");
  EXPECT_HAS(e, "CPU backend (parallel.device: cpu)");
  EXPECT_EQ(error_of([&] { drafter::check_cuda_drafter_sizes(odd); }), e);
}
