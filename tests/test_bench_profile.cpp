// target_bench --profile's aggregation of per-op records (host code): categories, GEMMs per shape,
// shares, the in-forward / alone ratio and its 5% mark, the totals and the CSV rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "bench/profile.h"
#include "core/error.h"

using namespace dflash;
using namespace dflash::bench;
using target::ForwardOp;
using target::GemmShape;
using target::OpProfile;

namespace {

const GemmShape kInProj{8192, 16480, 5120, 5120, 16480};
const GemmShape kDown{8192, 5120, 17408, 17408, 5120};
const GemmShape kDownShort{2048, 5120, 17408, 17408, 5120};

// One forward: embedding, two GDN in-projections, swiglu twice, two down projections (one of another
// shape); ms scaled by `k` so the two forwards differ.
OpProfile forward(double k) {
  OpProfile p;
  p.ops = {{ForwardOp::Embedding, {}, 0.01 * k},
           {ForwardOp::GdnInProj, kInProj, 2.0 * k},
           {ForwardOp::Swiglu, {}, 0.1 * k},
           {ForwardOp::MlpDown, kDown, 1.0 * k},
           {ForwardOp::GdnInProj, kInProj, 2.2 * k},
           {ForwardOp::Swiglu, {}, 0.1 * k},
           {ForwardOp::MlpDown, kDownShort, 0.3 * k}};
  p.span_ms = 6.0 * k;
  return p;
}

const OpSummary& find(const ProfileSummary& s, ForwardOp op, const GemmShape& g = {}) {
  auto it = std::find_if(s.ops.begin(), s.ops.end(), [&](const OpSummary& o) { return o.op == op && o.gemm == g; });
  EXPECT_NE(it, s.ops.end()) << target::forward_op_name(op);
  return *it;
}

}  // namespace

TEST(BenchProfile, NamesCoverEveryOp) {
  for (int i = 0; i < target::kNumForwardOps; ++i) EXPECT_FALSE(target::kForwardOpNames[static_cast<size_t>(i)].empty());
  EXPECT_EQ(target::forward_op_name(ForwardOp::MlpGateUp), "mlp_gate_up");
  EXPECT_EQ(target::forward_op_name(ForwardOp::CaptureCopy), "capture_copy");
  int gemms = 0;
  for (int i = 0; i < target::kNumForwardOps; ++i) gemms += target::forward_op_is_gemm(static_cast<ForwardOp>(i));
  EXPECT_EQ(gemms, 7);  // the layers' six projections and the decoder's LM head
  EXPECT_FALSE(target::forward_op_is_gemm(ForwardOp::Attention));
}

TEST(BenchProfile, CategoriesSharesAndTotals) {
  const ProfileSummary s = summarize_profile({forward(1.0), forward(1.5)}, 10.0);
  EXPECT_EQ(s.forwards, 2);
  // Enum order, then shape: embedding, gdn_in_proj, swiglu, mlp_down (M 2048), mlp_down (M 8192).
  ASSERT_EQ(s.ops.size(), 5u);
  EXPECT_EQ(s.ops[0].op, ForwardOp::Embedding);
  EXPECT_EQ(s.ops[1].op, ForwardOp::GdnInProj);
  EXPECT_EQ(s.ops[2].op, ForwardOp::Swiglu);
  EXPECT_EQ(s.ops[3].gemm, kDownShort);
  EXPECT_EQ(s.ops[4].gemm, kDown);

  const OpSummary& in = find(s, ForwardOp::GdnInProj, kInProj);
  EXPECT_DOUBLE_EQ(in.calls_per_forward, 2);
  EXPECT_NEAR(in.ms_per_forward, (4.2 + 6.3) / 2, 1e-12);
  EXPECT_NEAR(in.share, 5.25 / 10.0, 1e-12);
  EXPECT_NEAR(in.mean_us, 5250.0 / 2, 1e-9);
  EXPECT_NEAR(in.tflops(), kInProj.flops() / 2.625e-3 / 1e12, 1e-9);
  EXPECT_EQ(in.call_us.samples.size(), 4u);
  const OpSummary& sw = find(s, ForwardOp::Swiglu);
  EXPECT_DOUBLE_EQ(sw.calls_per_forward, 2);
  EXPECT_DOUBLE_EQ(sw.tflops(), 0);  // not a GEMM: no shape

  const double per_fwd = (1.0 + 1.5) / 2;  // mean scale
  EXPECT_NEAR(s.ops_ms, 5.71 * per_fwd, 1e-9);
  EXPECT_NEAR(s.gemm_ms, 5.5 * per_fwd, 1e-9);
  EXPECT_NEAR(s.span_ms, 6.0 * per_fwd, 1e-12);
  EXPECT_NEAR(s.gaps_ms(), 0.29 * per_fwd, 1e-9);
  EXPECT_DOUBLE_EQ(s.reference_ms, 10.0);
  // Without a reference, shares are of the profiled span.
  EXPECT_DOUBLE_EQ(summarize_profile({forward(1.0)}, 0).reference_ms, 6.0);
}

TEST(BenchProfile, RatioToAloneAndSlowMark) {
  ProfileSummary s = summarize_profile({forward(1.0), forward(1.0)}, 0);
  OpSummary& in = s.ops[1];  // gdn_in_proj: calls 2000 and 2200 µs, p50 2100
  EXPECT_DOUBLE_EQ(in.ratio(), 0);  // not measured yet
  EXPECT_FALSE(in.slow());
  in.isolated_us = summarize({2000, 2000, 2000}, {}, 0);
  EXPECT_NEAR(in.ratio(), 1.05, 1e-12);
  EXPECT_FALSE(in.slow());  // exactly 5%: within
  EXPECT_NEAR(in.excess_ms_per_forward(), 2 * (2100.0 - 2000.0) / 1e3, 1e-12);
  in.isolated_us = summarize({1990}, {}, 0);
  EXPECT_TRUE(in.slow());
  const std::string table = profile_table(s);
  EXPECT_NE(table.find("SLOW"), std::string::npos) << table;
  EXPECT_NE(table.find("gdn_in_proj (1.055)"), std::string::npos) << table;
  EXPECT_NE(table.find("between ops"), std::string::npos);
}

TEST(BenchProfile, CsvRows) {
  ProfileSummary s = summarize_profile({forward(1.0), forward(1.0)}, 8.0);
  s.ops[1].isolated_us = summarize({2000, 2100}, {2000, 2100}, 0.02);  // noisy rounds
  const std::vector<Row> rows = profile_rows(s, "fast", "qwen3_5 T8192");
  auto has = [&](const std::string& kernel, const std::string& metric, const std::string& shape) -> const Row* {
    for (const Row& r : rows)
      if (r.kernel == kernel && r.metric == metric && r.shape == shape) return &r;
    return nullptr;
  };
  const Row* ratio = has("forward/gdn_in_proj", "in_forward_over_isolated", "qwen3_5 T8192 M8192 N16480 K5120");
  ASSERT_NE(ratio, nullptr);
  EXPECT_NEAR(ratio->p50, 2100.0 / 2050.0, 1e-12);
  EXPECT_TRUE(ratio->noisy);
  EXPECT_EQ(ratio->bench, "target_bench");
  EXPECT_EQ(ratio->mode, "fast");
  const Row* share = has("forward/swiglu", "share", "qwen3_5 T8192");
  ASSERT_NE(share, nullptr);
  EXPECT_NEAR(share->p50, 100.0 * 0.2 / 8.0, 1e-12);
  // A GEMM not timed alone has no ratio row; every GEMM has its TFLOP/s.
  EXPECT_EQ(has("forward/mlp_down", "in_forward_over_isolated", "qwen3_5 T8192 M8192 N5120 K17408"), nullptr);
  EXPECT_NE(has("forward/mlp_down", "achieved", "qwen3_5 T8192 M2048 N5120 K17408"), nullptr);
  EXPECT_EQ(has("forward/swiglu", "achieved", "qwen3_5 T8192"), nullptr);
  const Row* gaps = has("forward/total", "gaps", "qwen3_5 T8192");
  ASSERT_NE(gaps, nullptr);
  EXPECT_NEAR(gaps->p50, 0.29, 1e-9);
}

TEST(BenchProfile, StridedGemmShapeNamesItsStrides) {
  OpProfile p;
  p.ops = {{ForwardOp::AttnOProj, GemmShape{64, 5120, 6144, 8192, 5120}, 0.1}};
  p.span_ms = 0.1;
  const std::vector<Row> rows = profile_rows(summarize_profile({p}, 0), "fast", "x");
  EXPECT_EQ(rows.front().shape, "x M64 N5120 K6144 ldx8192 ldy5120");
}

TEST(BenchProfile, EmptyInputIsAnError) {
  EXPECT_THROW(summarize_profile({}, 1.0), Error);
  EXPECT_THROW(summarize_profile({OpProfile{}}, 1.0), Error);
}
