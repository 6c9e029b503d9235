// The fast-path plan: which kernel each layer runs and why, policies, require_fast_path, counters.
// Pure host logic (the kernels' capability checks are host functions): runs without a GPU.
#include <gtest/gtest.h>

#include "target_model/fast_path.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

TargetConfig qwen27b() {
  return TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/qwen3.6-27b/config.json");
}

}  // namespace

TEST(FastPath, Qwen27bIsAllFastOnHopper) {
  FastPathPlan plan = make_plan(qwen27b(), Device::cuda(0), {}, 9);
  EXPECT_EQ(plan.summary(), "48/48 GatedDeltaNet layers on the fast path, 16/16 attention layers on the fast path");
  EXPECT_TRUE(plan.fallbacks().empty());
  EXPECT_EQ(plan.layers[0].step(Step::Conv).kernel, "causal_conv1d_fast");
  EXPECT_EQ(plan.layers[0].step(Step::DeltaRule).kernel, "chunk_gated_delta_rule");
  EXPECT_EQ(plan.layers[3].step(Step::Attention).kernel, "flash_attention_fwd");
  EXPECT_NE(plan.layers[0].step(Step::DeltaRule).reason.find("dk=128 dv=128"), std::string::npos);
  plan.require_all_fast();  // no throw
  nlohmann::json j = plan.to_json();
  EXPECT_EQ(j["layers"].size(), 64u);
  EXPECT_EQ(j["layers"][3]["steps"][0]["path"], "fast");
}

TEST(FastPath, ForcedFallbackIsVisibleAndRefusedWhenFastIsRequired) {
  KernelPolicies pol;
  pol.delta_rule = KernelPolicy::Fallback;
  FastPathPlan plan = make_plan(qwen27b(), Device::cuda(0), pol, 9);
  EXPECT_EQ(plan.summary(), "0/48 GatedDeltaNet layers on the fast path, 16/16 attention layers on the fast path");
  ASSERT_EQ(plan.fallbacks().size(), 48u);
  EXPECT_NE(plan.fallbacks()[0].find("recurrent_gated_delta_rule"), std::string::npos);
  EXPECT_NE(plan.fallbacks()[0].find("forced by config (kernels.delta_rule: fallback)"), std::string::npos);
  EXPECT_NE(plan.table().find("fallback: forced by config"), std::string::npos);
  pol.require_fast_path = true;
  const std::string e = error_of([&] { make_plan(qwen27b(), Device::cuda(0), pol, 9); });
  EXPECT_NE(e.find("require_fast_path is set, but 48 step(s) would run a fallback kernel"), std::string::npos) << e;
  EXPECT_NE(e.find("layer 0 (linear_attention) delta_rule"), std::string::npos) << e;
  EXPECT_NE(e.find("layer 62 (linear_attention) delta_rule"), std::string::npos) << e;
}

TEST(FastPath, UnsupportedShapesFallBackWithTheReason) {
  TargetConfig c = qwen27b();
  c.linear_key_head_dim = 96;  // not a chunk-kernel shape
  c.head_dim = 96;             // not a flash-kernel head dim
  c.partial_rotary_factor = 0.5;
  FastPathPlan plan = make_plan(c, Device::cuda(0), {}, 9);
  EXPECT_EQ(plan.summary(), "0/48 GatedDeltaNet layers on the fast path, 0/16 attention layers on the fast path");
  EXPECT_NE(plan.layers[0].step(Step::DeltaRule).reason.find("dk=96 dv=128"), std::string::npos);
  EXPECT_NE(plan.layers[3].step(Step::Attention).reason.find("head dim 96"), std::string::npos);
  EXPECT_EQ(plan.layers[0].step(Step::Conv).path, Path::Fast);  // the conv does not care
  KernelPolicies pol;
  pol.delta_rule = KernelPolicy::Fast;
  const std::string e = error_of([&] { make_plan(c, Device::cuda(0), pol, 9); });
  EXPECT_NE(e.find("kernels.delta_rule: fast requested, but layer 0 cannot use chunk_gated_delta_rule"), std::string::npos) << e;
  // An old GPU generation gets the fallback, and says so.
  FastPathPlan old = make_plan(qwen27b(), Device::cuda(0), {}, 7);
  EXPECT_EQ(old.layers[3].step(Step::Attention).path, Path::Fallback);
  EXPECT_NE(old.layers[3].step(Step::Attention).reason.find("sm_7x"), std::string::npos);
}

TEST(FastPath, CpuPlanAndCounters) {
  FastPathPlan plan = make_plan(qwen27b(), Device::cpu(), {}, 0);
  EXPECT_EQ(plan.summary(), "48 GatedDeltaNet + 16 attention layers on the CPU reference (cpu)");
  PathCounters counters;
  for (int f = 0; f < 2; ++f)
    for (const LayerPlan& l : plan.layers)
      for (const StepPlan& s : l.steps) counters.add(s.step, s.path);
  EXPECT_TRUE(counters.mismatches(plan, 2).empty());
  counters.add(Step::Attention, Path::Fallback);
  auto mm = counters.mismatches(plan, 2);
  ASSERT_EQ(mm.size(), 1u);
  EXPECT_EQ(mm[0], "attention fallback: planned 0, ran 1");
  EXPECT_EQ(counters.get(Step::Conv, Path::Cpu), 96u);
  counters.reset();
  EXPECT_EQ(counters.get(Step::Conv, Path::Cpu), 0u);
  EXPECT_THROW(parse_policy("fastest", "kernels.conv"), Error);
}

#if DFLASH_WITH_CUDA
// The decode plan's fused GatedDeltaNet chain runs in steps of at most kGdnChainMaxSeqs sequences
// (larger steps take the unfused kernels, faster there: fast_path.h); the plan says so.
TEST(FastPath, DecodePlanBoundsTheFusedChainBySequences) {
  const FastPathPlan plan = make_decode_plan(qwen27b(), Device::cuda(0), {}, 9, Precision::Bf16);
  ASSERT_TRUE(plan.fusion.gdn_chain) << plan.summary();
  EXPECT_EQ(plan.fusion.gdn_chain_max_seqs, FastPathPlan::kGdnChainMaxSeqs);
  EXPECT_NE(plan.summary().find("fused GatedDeltaNet chain (steps of <= " + std::to_string(FastPathPlan::kGdnChainMaxSeqs) +
                                " sequences)"),
            std::string::npos)
      << plan.summary();
  EXPECT_EQ(plan.to_json()["decode_fusion"]["gdn_chain_max_seqs"], FastPathPlan::kGdnChainMaxSeqs);
}

// FP8 targets take the fused GatedDeltaNet chain (writing out_proj's quantized input) and the fused,
// overlapped commit as bf16 ones do; the skinny bf16 GEMM is not theirs.
TEST(FastPath, Fp8DecodePlansTakeTheChainAndTheFusedCommit) {
  const FastPathPlan plan = make_decode_plan(qwen27b(), Device::cuda(0), {}, 9, Precision::Fp8);
  EXPECT_TRUE(plan.fusion.gdn_chain) << plan.summary();
  EXPECT_TRUE(plan.fusion.commit);
  EXPECT_TRUE(plan.fusion.commit_overlap);
  EXPECT_FALSE(plan.fusion.skinny_gemm);
  EXPECT_NE(plan.summary().find("fused commit (side stream)"), std::string::npos) << plan.summary();
  EXPECT_FALSE(make_decode_plan(qwen27b(), Device::cuda(0), {}, 8, Precision::Fp8).fusion.commit);  // below sm_90
}

// The MoE decode kernels (cuda::MoeImpl::Decode) stay out of the decode plan (slower than the
// grouped path in a measured decode); the plan names them, in its summary and JSON, when a caller turns them on (dflash_eval /
// generate_bench --decode-variant moe_decode).
TEST(FastPath, MoeDecodeKernelsAreNamedWhenOn) {
  FastPathPlan plan = make_decode_plan(qwen27b(), Device::cuda(0), {}, 9, Precision::Bf16);
  EXPECT_FALSE(plan.fusion.moe_decode);
  EXPECT_EQ(plan.summary().find("MoE decode kernels"), std::string::npos) << plan.summary();
  EXPECT_EQ(plan.to_json()["decode_fusion"]["moe_decode"], false);
  plan.fusion.moe_decode = true;
  EXPECT_NE(plan.summary().find("MoE decode kernels (steps of <= 16 rows)"), std::string::npos) << plan.summary();
  EXPECT_EQ(plan.to_json()["decode_fusion"]["moe_decode"], true);
}

// The skinny GEMM (issuing its weight loads before the PDL wait) is the decode plan's for MoE targets
// on sm_90 in bf16 (their projections: attention and GatedDeltaNet; measured faster in the 35B-A3B
// step), not for dense ones (slower at the 27B's shapes) nor below sm_90; never SwiGLU in down_proj.
TEST(FastPath, MoeDecodePlansTakeTheSkinnyGemm) {
  const TargetConfig moe = TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/qwen3.6-35b-a3b/config.json");
  const FastPathPlan plan = make_decode_plan(moe, Device::cuda(0), {}, 9, Precision::Bf16);
  EXPECT_TRUE(plan.fusion.skinny_gemm) << plan.summary();
  EXPECT_FALSE(plan.fusion.swiglu_gemm);
  EXPECT_NE(plan.summary().find("skinny GEMMs"), std::string::npos) << plan.summary();
  EXPECT_EQ(plan.to_json()["decode_fusion"]["skinny_gemm"], true);
  EXPECT_FALSE(make_decode_plan(moe, Device::cuda(0), {}, 8, Precision::Bf16).fusion.skinny_gemm);
  EXPECT_FALSE(make_decode_plan(qwen27b(), Device::cuda(0), {}, 9, Precision::Bf16).fusion.skinny_gemm);
}
#endif
