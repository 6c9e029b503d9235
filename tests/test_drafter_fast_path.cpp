// The drafter's fast-path plan (drafter/fast_path.h): host logic only, driven with the compute
// capability and head dim passed in, so it runs without a GPU (and in a build without CUDA).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "drafter/fast_path.h"
#include "core/error.h"

using namespace dflash;
using namespace dflash::drafter;

namespace {

DrafterConfig config_with_head_dim(int64_t d) {
  DrafterConfig c;
  c.head_dim = d;
  return c;
}

std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message() + " | " + e.hint();
  }
  return "";
}

}  // namespace

TEST(DrafterFastPath, TensorCoreKernelsWhenTheKernelsTakeTheHeadDim) {
  const DrafterPlan p = drafter_plan(config_with_head_dim(128), Device::cuda(0), 9, 0, {true, "wgmma sm_90a"}, true);
  EXPECT_EQ(p.device, "cuda:0");
  EXPECT_FALSE(p.attention_fallback());
  EXPECT_EQ(p.summary(), "drafter attention: tensor-core kernels (wgmma sm_90a, head_dim 128)");
  EXPECT_EQ(p.attention_json(),
            (nlohmann::json{{"path", "fast"}, {"kernel", "wgmma sm_90a"}, {"reason", "head_dim 128 on sm_90"}}));
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_EQ(p.steps[0].step, "block_attention");
  for (const DrafterStepPlan& s : p.steps) EXPECT_EQ(s.path, "fast") << s.step;
  EXPECT_EQ(p.to_json()["steps"].size(), 3u);
}

TEST(DrafterFastPath, FallbackIsNamedAndRefusedUnderRequireFastPath) {
  const DrafterConfig c = config_with_head_dim(96);
  const DrafterPlan p = drafter_plan(c, Device::cuda(1), 8, 6, {false, ""}, false);
  EXPECT_TRUE(p.attention_fallback());
  const std::string why = "head_dim 96 on sm_86; the tensor-core kernels take head_dim 64 or 128 on sm_80+";
  EXPECT_EQ(p.summary(), "drafter attention: FALLBACK kernel (" + why + ")");
  EXPECT_EQ(p.attention_json(), (nlohmann::json{{"path", "fallback"}, {"reason", why}}));
  const std::string msg = refusal([&] { drafter_plan(c, Device::cuda(1), 8, 6, {false, ""}, true); });
  EXPECT_EQ(msg,
            "require_fast_path is set, but the drafter's attention would run the fallback kernel on cuda:1: " + why +
                " | set model.drafter.head_dim: 128 (with num_attention_heads / num_key_value_heads to match), or "
                "kernels.require_fast_path: false to accept the fallback (tens of times slower)");
}

TEST(DrafterFastPath, CpuReferencePlan) {
  const DrafterPlan p = make_cpu_drafter_plan(config_with_head_dim(128));
  EXPECT_EQ(p.device, "cpu");
  EXPECT_EQ(p.attention_json(), (nlohmann::json{{"path", "cpu"}, {"reason", "the CPU reference (double)"}}));
  for (const DrafterStepPlan& s : p.steps) EXPECT_EQ(s.path, "cpu") << s.step;
}

// make_drafter_plan asks the kernels: head dims 64 / 128 on sm_80+ take the tensor cores (which of
// them runs is the device's to say), anything else falls back; a build without CUDA refuses.
TEST(DrafterFastPath, TheKernelsDecide) {
#if DFLASH_WITH_CUDA
  for (int64_t d : {64, 128}) {
    EXPECT_FALSE(make_drafter_plan(config_with_head_dim(d), Device::cuda(0), 9, 0, true).attention_fallback()) << d;
    EXPECT_FALSE(make_drafter_plan(config_with_head_dim(d), Device::cuda(0), 8, 0, true).attention_fallback()) << d;
    EXPECT_TRUE(make_drafter_plan(config_with_head_dim(d), Device::cuda(0), 7, 5, false).attention_fallback()) << d;
  }
  for (int64_t d : {32, 96, 256})
    EXPECT_TRUE(make_drafter_plan(config_with_head_dim(d), Device::cuda(0), 9, 0, false).attention_fallback()) << d;
  EXPECT_THROW(make_drafter_plan(config_with_head_dim(96), Device::cuda(0), 9, 0, true), Error);
#else
  EXPECT_NE(refusal([] { make_drafter_plan(config_with_head_dim(128), Device::cuda(0), 9, 0, false); })
                .find("needs the CUDA backend"),
            std::string::npos);
#endif
}

// model.drafter.precision: fp8 (issue 31): the plan's gemm step names the block-scaled FP8 GEMMs; sizes
// that are not multiples of 128 are refused, naming each field, and so is a GPU that is not sm_90.
TEST(DrafterFastPath, Fp8LinearsArePlannedOrRefusedNamingWhy) {
  DrafterConfig c = config_with_head_dim(128);
  c.hidden_size = 5120, c.num_attention_heads = 32, c.num_key_value_heads = 8, c.intermediate_size = 17408;
  const DrafterPlan p = drafter_plan(c, Device::cuda(0), 9, 0, {true, "wgmma sm_90a"}, true, true);
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_EQ(p.steps[1].step, "gemm");
  EXPECT_EQ(p.steps[1].path, "fast");
  EXPECT_NE(p.steps[1].kernel.find("gemm_fp8"), std::string::npos) << p.steps[1].kernel;
  EXPECT_NE(p.steps[1].reason.find("model.drafter.precision: fp8"), std::string::npos) << p.steps[1].reason;
  EXPECT_EQ(p.summary(), "drafter attention: tensor-core kernels (wgmma sm_90a, head_dim 128); drafter linears: block-scaled fp8");
  EXPECT_EQ(drafter_plan(c, Device::cuda(0), 9, 0, {true, "wgmma sm_90a"}, true).steps[1].kernel, "cuBLASLt gemm_ex");
  const std::string sm = refusal([&] { drafter_plan(c, Device::cuda(0), 8, 9, {true, "mma.sync"}, true, true); });
  EXPECT_NE(sm.find("needs an sm_90 GPU"), std::string::npos) << sm;
  EXPECT_NE(sm.find("cuda:0 is sm_89"), std::string::npos) << sm;
  DrafterConfig odd = c;
  odd.hidden_size = 5120 + 64, odd.head_dim = 64, odd.num_key_value_heads = 3, odd.intermediate_size = 17408 + 8;
  const std::string msg = refusal([&] { check_fp8_drafter_sizes(odd); });
  for (const char* field : {"hidden_size 5184", "kv_dim 192 = num_key_value_heads 3 x head_dim 64", "intermediate_size 17416",
                            "model.drafter.precision: bf16"})
    EXPECT_NE(msg.find(field), std::string::npos) << field << " in: " << msg;
  EXPECT_EQ(msg.find("q_dim"), std::string::npos) << "q_dim 2048 is a multiple of 128: " << msg;
  EXPECT_EQ(refusal([&] { check_fp8_drafter_sizes(c); }), "");
}

// model.drafter.lm_head_precision: fp8: the plan's lm_head_ce step names the FP8 form; a GPU that is not
// sm_90 is refused, naming the fix.
TEST(DrafterFastPath, Fp8LmHeadIsPlannedOrRefusedNamingWhy) {
  DrafterConfig c = config_with_head_dim(128);
  const DrafterPlan p = drafter_plan(c, Device::cuda(0), 9, 0, {true, "wgmma sm_90a"}, true, false, true);
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_EQ(p.steps[2].step, "lm_head_ce");
  EXPECT_EQ(p.steps[2].kernel, "linear_ce fp8 (cuBLASLt gemm_fp8)");
  EXPECT_NE(p.steps[2].reason.find("model.drafter.lm_head_precision: fp8"), std::string::npos) << p.steps[2].reason;
  EXPECT_EQ(drafter_plan(c, Device::cuda(0), 9, 0, {true, "wgmma sm_90a"}, true).steps[2].kernel, "linear_ce");
  const std::string sm = refusal([&] { drafter_plan(c, Device::cuda(0), 8, 9, {true, "mma.sync"}, true, false, true); });
  EXPECT_NE(sm.find("model.drafter.lm_head_precision: fp8 needs an sm_90 GPU"), std::string::npos) << sm;
  EXPECT_NE(sm.find("model.drafter.lm_head_precision: bf16"), std::string::npos) << sm;
}
