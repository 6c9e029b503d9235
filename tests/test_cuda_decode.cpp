// CUDA decode / verify kernels (kernels/cuda/gdn_decode.cu, attention_decode.cu) against the f32
// CPU reference ops (kernels/cpu/decode.cpp), from the op-case tables (kernels/cases/gdn_cases.h,
// attention_cases.h): the conv update, the gated delta rule on a state pool and the KV-cache
// append + attention, fast and fallback, on seeded random bf16 inputs (the CPU gets the same
// values in f32). Several sequences sit in permuted pool slots with unused slots between them,
// which must stay bit-identical, as must the whole pool when update_state is false; outputs (and
// the attention workspace) are poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cases/attention_cases.h"
#include "kernels/cases/gdn_cases.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/gemm.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "test_util.h"

using namespace dflash;
using cases::host_f32;
using cases::offsets_of;
using cases::Knob;

namespace {

Tensor gpu_out(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0));
  poison(t);
  return t;
}
Tensor cu_seqlens_gpu(const ops::SeqOffsets& s) { return cases::device_i32(s.offsets); }
cuda::Stream stream0() { return DeviceContext::get(0).stream(); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }
void* at_bf16(const Tensor& t, int64_t off) { return static_cast<uint16_t*>(t.raw_data()) + off; }
int sm_major() { return cuda_device_info(0).major; }

// A launcher pair under test: fast and fallback of one op, and a check that either rejects the
// parameters `p` changed by `mutate`.
template <class Params>
struct Launchers {
  void (*fast)(const Params&, cuda::Stream);
  void (*fallback)(const Params&, cuda::Stream);
  Params p;
  template <class Mutate>
  void rejects(Mutate mutate, bool on_fast) const {
    Params q = p;
    mutate(q);
    EXPECT_THROW((on_fast ? fast : fallback)(q, stream0()), Error);
  }
};

}  // namespace

// ---- conv update ---------------------------------------------------------------------------------
// Bounds (ConvUpdateCase) as causal_conv1d's (test_cuda_gdn.cpp): f32 taps in the reference's
// order, one bf16 rounding: 1e-2. The new state is a copy of bf16 inputs: exact, over the whole
// pool (updated slots as the reference, the others, and all when verifying, untouched). Fast and
// fallback use the same fmaf order: equal bit for bit.
TEST(CudaDecode, ConvUpdateFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double worst_fast = 0, worst_fb = 0;
  int runs_checked = 0;
  uint64_t seed = 9000;
  for (const cases::ConvUpdateCase& c : cases::conv_update_check_cases()) {
    SCOPED_TRACE(c.describe());
    const cases::ConvUpdateData data = cases::draw(c, seed++);
    const cases::ConvUpdateData::Ref ref = data.reference(c);
    auto run = [&](const cases::Variant<cuda::ConvUpdateParams>& v, Tensor& y, Tensor& st) {
      y = gpu_out({c.N(), c.C}, DType::BF16);
      st = data.state0.clone();
      v.launch(data.params(c, y.raw_data(), st.raw_data()), stream0());
    };
    Tensor yfb, sfb;
    run(cases::kConvUpdateFallback, yfb, sfb);
    const double efb = max_rel_err(yfb, ref.y);
    worst_fb = std::max(worst_fb, efb);
    EXPECT_LT(efb, c.y_bound) << "fallback";
    EXPECT_EQ(max_rel_err(sfb, ref.state), 0.0) << "fallback state";
    ASSERT_EQ(cuda::causal_conv1d_update_fast_supported(c.C, c.K), c.K <= 4);
    if (!c.fast_ok()) continue;
    Tensor yf, sf;
    run(cases::kConvUpdateFast, yf, sf);
    const double ef = max_rel_err(yf, ref.y);
    worst_fast = std::max(worst_fast, ef);
    EXPECT_LT(ef, c.y_bound) << "fast";
    EXPECT_EQ(max_rel_err(yf, yfb), 0.0) << "fast vs fallback";
    EXPECT_EQ(max_rel_err(sf, ref.state), 0.0) << "fast state";
    // The token-parallel kernel (prompt pieces): the same values and states bit for bit.
    Tensor yr, sr;
    run(cases::kConvUpdateRuns, yr, sr);
    EXPECT_EQ(max_rel_err(yr, yfb), 0.0) << "runs vs fallback";
    EXPECT_EQ(max_rel_err(sr, ref.state), 0.0) << "runs state";
    ++runs_checked;
  }
  // Every run length through the runs kernel's sequence boundaries (tuning knob): 8 .. 512 tokens a thread.
  for (int R : {8, 16, 512}) {
    const cases::ConvUpdateCase c{"", {1, 1, 300, 1, 2, 0, 77}, 160, 4, 176, true, true, 2};
    SCOPED_TRACE(c.describe() + " R " + std::to_string(R));
    const cases::ConvUpdateData data = cases::draw(c, seed++);
    const cases::ConvUpdateData::Ref ref = data.reference(c);
    Tensor yr = gpu_out({c.N(), c.C}, DType::BF16), sr = data.state0.clone();
    cuda::tuning::conv_tokens_per_thread = R;
    cases::kConvUpdateRuns.launch(data.params(c, yr.raw_data(), sr.raw_data()), stream0());
    cuda::tuning::conv_tokens_per_thread = 0;
    EXPECT_LT(max_rel_err(yr, ref.y), c.y_bound) << "runs";
    EXPECT_EQ(max_rel_err(sr, ref.state), 0.0) << "runs state";
  }
  EXPECT_GT(runs_checked, 100);
  std::printf("causal_conv1d_update: worst normalised error vs CPU: fast %.3g, fallback %.3g; runs == fallback on %d cases\n",
              worst_fast, worst_fb, runs_checked);
}

TEST(CudaDecode, ConvUpdateRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  // One sequence of 4 tokens in slot 1 of a pool of 2.
  const cases::ConvUpdateCase c{"", {4}, 64, 4, 0, true, true, 1};
  const cases::ConvUpdateData data = cases::draw(c, 1);
  Tensor y = Tensor::empty({4, 64}, DType::BF16, Device::cuda(0)), st = data.state0.clone();
  const cuda::ConvUpdateParams p = data.params(c, y.raw_data(), st.raw_data());
  EXPECT_NO_THROW(cuda::causal_conv1d_update_fast(p, stream0()));
  EXPECT_NO_THROW(cuda::causal_conv1d_update_runs(p, stream0()));
  {  // the runs kernel takes the vec8 kernel's shapes only
    const Launchers<cuda::ConvUpdateParams> runs{cuda::causal_conv1d_update_runs, cuda::causal_conv1d_update_fallback, p};
    runs.rejects([](cuda::ConvUpdateParams& q) { q.K = 5; }, true);
    runs.rejects([&](cuda::ConvUpdateParams& q) { q.x = at_bf16(data.x, 1); q.C = 56; }, true);
  }
  const Launchers<cuda::ConvUpdateParams> op{cuda::causal_conv1d_update_fast, cuda::causal_conv1d_update_fallback, p};
  op.rejects([](cuda::ConvUpdateParams& q) { q.K = 5; }, true);
  op.rejects([](cuda::ConvUpdateParams& q) { q.C = 60; }, true);
  op.rejects([](cuda::ConvUpdateParams& q) { q.ldx = 60; q.C = 56; }, true);        // rows not 16-byte aligned
  op.rejects([&](cuda::ConvUpdateParams& q) { q.x = at_bf16(data.x, 1); q.C = 56; }, true);  // misaligned pointer
  op.rejects([](cuda::ConvUpdateParams& q) { q.ldx = 32; }, false);                 // ldx < C
  op.rejects([](cuda::ConvUpdateParams& q) { q.num_slots = 0; }, false);
  op.rejects([](cuda::ConvUpdateParams& q) { q.K = 0; }, false);
  op.rejects([](cuda::ConvUpdateParams& q) { q.state = nullptr; }, false);
  EXPECT_STREQ(cuda::causal_conv1d_update_kernel_name(10240, 4), "vec8");
  EXPECT_STREQ(cuda::causal_conv1d_update_kernel_name(10240, 5), "fallback");
  DeviceContext::get(0).synchronize();
}

// ---- gated delta rule on a state pool --------------------------------------------------------------
// q / k as gdn_prep leaves them (l2-normalised, q scaled, bf16); the CPU runs them with l2norm_qk =
// false, scale 1. Bounds (PoolCase) as the recurrent kernel's (test_cuda_delta_rule.cpp): outputs
// rounded once to bf16, 2e-2; the fp32 state 1e-3 (different summation order). Slots of sequences
// without tokens, unused slots, and every slot when verifying stay bit-identical.
namespace {

void check_pool(const cases::PoolCase& c, uint64_t seed, double* worst_out, double* worst_state) {
  SCOPED_TRACE(c.describe());
  const cases::PoolData data = cases::draw(c, seed);
  const int64_t N = c.N(), S = data.layout.S;
  const std::vector<int32_t> slots = data.layout.slots(0);
  const Tensor pool0 = host_f32(data.pool0);
  for (bool update : {true, false}) {
    const cases::PoolData::Ref ref = data.reference(update);
    // {-1, -1}: the fallback; else the fast kernel with {warps per CTA, column groups per warp}
    // (0 = automatic).
    std::vector<std::pair<int, int>> variants = {{-1, -1}};
    if (c.fast_ok()) variants.insert(variants.end(), c.fast_knobs.begin(), c.fast_knobs.end());
    for (auto [warps, cg] : variants) {
      for (bool with_out : {true, false}) {
        if (!with_out && warps > 0) continue;
        Knob knob_w(cuda::tuning::gdn_pool_warps, std::max(warps, 0));
        Knob knob_cg(cuda::tuning::gdn_pool_cg, std::max(cg, 0));
        Tensor out = gpu_out({N, c.Hv, c.dv}, DType::BF16), pool = data.pool0.clone();
        (warps < 0 ? cases::kPoolFallback : cases::kPoolFast)
            .launch(data.params(pool.data<float>(), with_out ? out.raw_data() : nullptr, update), stream0());
        const std::string what = std::string(warps < 0 ? "fallback"
                                                       : "fast warps " + std::to_string(warps) + " cg " + std::to_string(cg)) +
                                 (update ? " update" : " verify") + (with_out ? "" : " no out");
        const Tensor pool_h = pool.to(Device::cpu());
        if (with_out) {
          const double eo = max_rel_err(out, ref.out);
          EXPECT_LT(eo, c.out_bound) << "out " << what;
          *worst_out = std::max(*worst_out, eo);
        } else {
          EXPECT_TRUE(std::isnan(host_f32(out).item_at(0)) || N == 0) << "out written although null " << what;
        }
        for (int64_t s = 0; s < S; ++s) {
          const Tensor got = pool_h.select(slots[s]).contiguous(), want = ref.pool.select(slots[s]).contiguous();
          if (update && c.lens[s] > 0) {
            const double es = max_rel_err(got, want);
            EXPECT_LT(es, c.state_bound) << "state of seq " << s << " " << what;
            *worst_state = std::max(*worst_state, es);
          } else {
            EXPECT_TRUE(bit_equal(got, pool0.select(slots[s]).contiguous())) << "slot of seq " << s << " changed " << what;
          }
        }
        for (int32_t u : data.layout.unused(0))
          EXPECT_TRUE(bit_equal(pool_h.select(u).contiguous(), pool0.select(u).contiguous()))
              << "unused slot " << u << " changed " << what;
      }
    }
  }
}

}  // namespace

// ---- the fused decode chain and the fused commit (gdn_fused.cu) -------------------------------------
namespace {

// The fused chain's FP8 out (rows() rows, scales fp8_act_scale_ld(rows())) against
// gated_rms_norm_quant_fp8 over the N real rows (scales fp8_act_scale_ld(N)): the real rows' codes and
// scales bit for bit; the pad rows zero codes, the scales of rows [N, lds) 1.
void check_fp8_out(const cases::ChainCase& c, const cases::ChainData::Outputs& f, const cases::ChainData::Outputs& u) {
  const int64_t N = c.N(), R = c.rows(), V = c.V(), G = V / 128;
  const int64_t lds_f = cuda::fp8_act_scale_ld(R), lds_u = cuda::fp8_act_scale_ld(N);
  const Tensor fq = f.out_q.to(Device::cpu()), uq = u.out_q.to(Device::cpu());
  const Tensor fs = f.out_scale.to(Device::cpu()), us = u.out_scale.to(Device::cpu());
  const auto* fqb = static_cast<const uint8_t*>(fq.raw_data());
  const auto* uqb = static_cast<const uint8_t*>(uq.raw_data());
  // (both start poisoned: NaN codes 0x7F, NaN scales; finite inputs give neither, so unwritten fails)
  int64_t bad_codes = 0, bad_scales = 0, bad_pad_codes = 0, bad_pad_scales = 0, nan_codes = 0;
  for (int64_t m = 0; m < R; ++m)
    for (int64_t j = 0; j < V; ++j) {
      if (m < N) {
        bad_codes += fqb[m * V + j] != uqb[m * V + j];
        nan_codes += (fqb[m * V + j] & 0x7F) == 0x7F;
      } else {
        bad_pad_codes += fqb[m * V + j] != 0;
      }
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < lds_f; ++m) {
      const float got = fs.data<float>()[g * lds_f + m];
      if (m < N) bad_scales += !(got > 0.0f) || std::memcmp(&got, us.data<float>() + g * lds_u + m, sizeof(float)) != 0;
      else bad_pad_scales += got != 1.0f;
    }
  EXPECT_EQ(nan_codes, 0) << "NaN codes (unwritten?) in the real rows";
  EXPECT_EQ(bad_codes, 0) << "fp8 codes: fused != gated_rms_norm_quant_fp8";
  EXPECT_EQ(bad_scales, 0) << "fp8 scales: fused != gated_rms_norm_quant_fp8";
  EXPECT_EQ(bad_pad_codes, 0) << "pad rows' codes not zero";
  EXPECT_EQ(bad_pad_scales, 0) << "scales of rows [N, lds) not 1";
}

}  // namespace

// The fused chain against its unfused twin (the four kernels it replaces) on the same inputs: every
// output bit for bit (out, both state pools including unused slots, and for a verify the saved
// conv / q / k / g / beta); the unfused chain against the CPU ops on the GPU's roundings
// (ChainCase bounds; the conv state is a copy of bf16 inputs: exact).
TEST(CudaDecode, FusedGdnChainEqualsUnfusedAndMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  if (sm_major() < 9) GTEST_SKIP() << "the fused chain launches thread-block clusters (sm_90)";
  uint64_t seed = 9900;
  double worst_out = 0, worst_state = 0;
  int ran = 0;
  for (const cases::ChainCase& c : cases::chain_check_cases()) {
    SCOPED_TRACE(c.describe());
    ASSERT_TRUE(c.fused_ok());
    const cases::ChainData data = cases::draw(c, seed++);
    cases::ChainData::Outputs u = data.outputs(c), f = data.outputs(c);
    data.run_unfused(c, u, stream0());
    cuda::gdn_decode_fused(data.fused_params(c, f), stream0());
    DeviceContext::get(0).synchronize();
    auto same = [&](const Tensor& a, const Tensor& b, const char* what) {
      EXPECT_TRUE(bit_equal(a.to(Device::cpu()), b.to(Device::cpu()))) << what << ": fused != unfused";
    };
    if (c.fp8_out) check_fp8_out(c, f, u);
    else same(f.out, u.out, "out");
    same(f.conv_state, u.conv_state, "conv state pool");
    same(f.state, u.state, "recurrent state pool");
    if (!c.update) {
      same(f.conv, u.conv, "saved conv");
      same(f.q, u.q, "saved q");
      same(f.k, u.k, "saved k");
      same(f.g, u.g, "saved g");
      same(f.beta, u.beta, "saved beta");
    }
    const cases::ChainData::Ref ref = data.reference(c);
    // (fp8 out: the twin's quantizer has its own CPU check; the bf16 cases of the same dims check out)
    const double eo = c.fp8_out ? 0.0 : max_rel_err(u.out, ref.out), es = max_rel_err(u.state, ref.state);
    EXPECT_LT(eo, c.out_bound);
    EXPECT_LT(es, c.state_bound);
    EXPECT_EQ(max_rel_err(u.conv_state, ref.conv_state), 0.0);
    worst_out = std::max(worst_out, eo);
    worst_state = std::max(worst_state, es);
    ++ran;
  }
  EXPECT_GE(ran, 24);
  std::printf("gdn_decode_fused == unfused chain on %d cases; unfused vs CPU: out %.3g, state %.3g\n", ran, worst_out,
              worst_state);
}

// The fused commit (every layer in one kernel) against the unfused commit (conv update + pool delta
// rule per layer, update_state) from a verify's saved inputs: the states bit for bit, for accepted
// counts 1, 5 and 16, the committed sequence second in its batch (row0 > 0), three layers.
TEST(CudaDecode, FusedCommitEqualsUnfusedLayers) {
  DFLASH_REQUIRE_GPU();
  if (sm_major() < 9) GTEST_SKIP() << "the fused chain launches thread-block clusters (sm_90)";
  const cases::ChainCase c{"", {3, 16}, 2, 6, 128, 128, 4, false, 2, 8};
  const int64_t C = c.C(), P = c.P(), row0 = 3;
  struct Layer {
    cases::ChainData data;
    cases::ChainData::Outputs saved;
  };
  std::vector<Layer> layers;
  for (uint64_t l = 0; l < 3; ++l) {
    Layer L{cases::draw(c, 9950 + l), {}};
    L.saved = L.data.outputs(c);
    cuda::gdn_decode_fused(L.data.fused_params(c, L.saved), stream0());  // a verify: the saved inputs
    layers.push_back(std::move(L));
  }
  const int32_t slot = layers[0].data.layout.slots(0)[1];
  const Tensor d_slot = cases::device_i32(std::vector<int32_t>{slot}), scratch = gpu_out({16, C}, DType::BF16);
  for (int n : {1, 5, 16}) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const Tensor cu = cu_seqlens_gpu(offsets_of({n}));
    cuda::GdnCommitParams fp;
    fp.slot = i32(d_slot);
    fp.n = n;
    fp.ldx = P, fp.ldv = C, fp.C = C, fp.K = c.K, fp.Hk = c.Hk, fp.Hv = c.Hv, fp.dk = c.dk, fp.dv = c.dv;
    fp.num_slots = layers[0].data.layout.pool();
    std::vector<Tensor> uc, us, fc, fs;
    for (Layer& L : layers) {
      uc.push_back(L.data.conv_state0.clone()), us.push_back(L.data.state0.clone());
      fc.push_back(L.data.conv_state0.clone()), fs.push_back(L.data.state0.clone());
      cuda::ConvUpdateParams cp;
      cp.x = at_bf16(L.data.proj, row0 * P);
      cp.ldx = P;
      cp.w = L.data.conv_w.raw_data();
      cp.y = scratch.raw_data();
      cp.state = uc.back().raw_data();
      cp.slots = i32(d_slot);
      cp.cu_seqlens = i32(cu);
      cp.num_seqs = 1, cp.N = n, cp.C = C, cp.K = c.K, cp.num_slots = fp.num_slots;
      cp.silu = true, cp.update_state = true;
      cuda::causal_conv1d_update_fast(cp, stream0());
      cuda::DeltaRulePoolParams dp;
      dp.q = at_bf16(L.saved.q, row0 * c.Hk * c.dk);
      dp.k = at_bf16(L.saved.k, row0 * c.Hk * c.dk);
      dp.v = at_bf16(L.saved.conv, row0 * C + 2 * c.Hk * c.dk);
      dp.ldv = C;
      dp.g = L.saved.g.data<float>() + row0 * c.Hv;
      dp.beta = L.saved.beta.data<float>() + row0 * c.Hv;
      dp.state = us.back().data<float>();
      dp.slots = i32(d_slot);
      dp.out = nullptr;
      dp.cu_seqlens = i32(cu);
      dp.num_seqs = 1, dp.N = n, dp.Hk = c.Hk, dp.Hv = c.Hv, dp.dk = c.dk, dp.dv = c.dv, dp.num_slots = fp.num_slots;
      dp.update_state = true;
      cuda::gated_delta_rule_pool_fast(dp, stream0());
      cuda::GdnCommitLayer& F = fp.layers[fp.num_layers++];
      F.conv_state = fc.back().raw_data();
      F.state = fs.back().data<float>();
      F.x = at_bf16(L.data.proj, row0 * P);
      F.q = dp.q, F.k = dp.k, F.v = dp.v, F.g = dp.g, F.beta = dp.beta;
    }
    cuda::gdn_commit_fused(fp, stream0());
    DeviceContext::get(0).synchronize();
    for (size_t l = 0; l < layers.size(); ++l) {
      EXPECT_TRUE(bit_equal(fc[l].to(Device::cpu()), uc[l].to(Device::cpu()))) << "conv state of layer " << l;
      EXPECT_TRUE(bit_equal(fs[l].to(Device::cpu()), us[l].to(Device::cpu()))) << "recurrent state of layer " << l;
      EXPECT_FALSE(bit_equal(fs[l].to(Device::cpu()), layers[l].data.state0.to(Device::cpu()))) << "layer " << l << " not committed";
    }
  }
  cuda::GdnCommitParams bad;
  bad.dk = bad.dv = 128, bad.K = 4, bad.Hk = 2, bad.Hv = 6, bad.C = C, bad.ldx = P, bad.ldv = C, bad.n = 17, bad.num_layers = 1;
  EXPECT_THROW(cuda::gdn_commit_fused(bad, stream0()), Error) << "17 tokens";
}

// The table's cases: Qwen3.6-27B decode at batch 1 and 8, verify T = 16, GVA ratios 1..3, dv 64,
// dk 64 / 256, T > 16 (several staged chunks), empty sequences, and dims only the fallback takes.
TEST(CudaDecode, DeltaRulePoolFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double wo = 0, ws = 0;
  uint64_t seed = 9500;
  for (const cases::PoolCase& c : cases::pool_check_cases()) check_pool(c, seed++, &wo, &ws);
  std::printf("gated_delta_rule_pool: worst normalised error vs CPU: out %.3g, state %.3g\n", wo, ws);
}

TEST(CudaDecode, DeltaRulePoolRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const Tensor cu = cu_seqlens_gpu(offsets_of({0})), sl = cases::device_i32(std::vector<int32_t>{0});
  Tensor pool = Tensor::zeros({1, 2, 128, 128}, DType::F32, Device::cuda(0));
  cuda::DeltaRulePoolParams p;
  p.state = pool.data<float>();
  p.slots = i32(sl);
  p.cu_seqlens = i32(cu);
  p.num_seqs = 1;
  p.Hk = 1;
  p.Hv = 2;
  p.dk = 128;
  p.dv = 128;
  p.ldv = 256;
  p.num_slots = 1;
  EXPECT_NO_THROW(cuda::gated_delta_rule_pool_fast(p, stream0()));
  EXPECT_NO_THROW(cuda::gated_delta_rule_pool_fallback(p, stream0()));
  const Launchers<cuda::DeltaRulePoolParams> op{cuda::gated_delta_rule_pool_fast, cuda::gated_delta_rule_pool_fallback, p};
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dk = 96; }, true);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dv = 12; q.ldv = 24; }, true);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.Hk = 2; q.Hv = 3; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dk = 2048; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.num_slots = 0; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.N = 3; }, false);      // null q / k / v / g / beta
  EXPECT_TRUE(cuda::gated_delta_rule_pool_fast_supported(128, 128, 9));
  EXPECT_TRUE(cuda::gated_delta_rule_pool_fast_supported(64, 64, 8));
  EXPECT_FALSE(cuda::gated_delta_rule_pool_fast_supported(128, 128, 7));
  EXPECT_STREQ(cuda::gated_delta_rule_pool_kernel_name(128, 128, 9), "register-resident");
  EXPECT_STREQ(cuda::gated_delta_rule_pool_kernel_name(20, 12, 9), "fallback");
  DeviceContext::get(0).synchronize();
}

// ---- KV cache append and attention over it -----------------------------------------------------------
// Bounds (DecodeAttentionCase): append: bf16 copies, exact; the rest of the cache (other positions,
// unused slots) unchanged. Attention: bf16 q / K / V, fp32 softmax, P rounded to bf16 for P·V
// (fast), one bf16 rounding of the output: 2e-2 normalised, as the prefill flash kernels. The new
// k / v are appended from the columns of fused [q | k | v] rows (ldk = ldv = Hq·d + 2·Hkv·d).
namespace {

void check_attention(const cases::DecodeAttentionCase& c, uint64_t seed, double* worst_fast, double* worst_fb) {
  SCOPED_TRACE(c.describe());
  const cases::DecodeAttentionData data = cases::draw(c, seed);
  const cases::DecodeAttentionData::Ref ref = data.reference(c);
  Tensor kc = data.k_cache0.clone(), vc = data.v_cache0.clone();
  cuda::kv_cache_append(data.append_params(c, kc.raw_data(), vc.raw_data()), stream0());
  EXPECT_EQ(max_rel_err(kc, ref.k_cache), 0.0) << "k cache after append";
  EXPECT_EQ(max_rel_err(vc, ref.v_cache), 0.0) << "v cache after append";
  {
    Tensor out = gpu_out({c.N(), c.Hq, c.d}, DType::BF16);
    cases::kDecodeAttentionFallback.launch(data.params(c, kc.raw_data(), vc.raw_data(), out.raw_data()), stream0());
    const double e = max_rel_err(out, ref.out);
    EXPECT_LT(e, c.out_bound) << "fallback";
    *worst_fb = std::max(*worst_fb, e);
  }
  if (!c.fast_ok()) return;
  // Automatic splits with the workspace they want, no workspace (one split), and forced splits.
  for (int splits : c.splits) {
    Knob knob(cuda::tuning::attn_decode_splits, std::max(splits, 0));
    Tensor out = gpu_out({c.N(), c.Hq, c.d}, DType::BF16);
    const size_t ws_bytes = data.workspace_bytes(c, splits);  // 0 for -1
    Tensor ws = gpu_out({std::max<int64_t>(static_cast<int64_t>(ws_bytes / 4), 1)}, DType::F32);
    cases::kDecodeAttentionFast.launch(data.params(c, kc.raw_data(), vc.raw_data(), out.raw_data(), 0,
                                                   splits < 0 ? nullptr : ws.raw_data(), ws_bytes),
                                       stream0());
    const double e = max_rel_err(out, ref.out);
    EXPECT_LT(e, c.out_bound) << "fast splits " << splits << " (workspace " << ws_bytes << " B)";
    *worst_fast = std::max(*worst_fast, e);
  }
  // Neither kernel writes the caches.
  EXPECT_EQ(max_rel_err(kc, ref.k_cache), 0.0) << "k cache after attention";
}

}  // namespace

// The table's cases: the target's decode / verify at several contexts and batches, the drafter's
// full and sliding layers, GVA ratios 1..3, odd T, d 64 / 96 (fallback only), more query rows than
// a CTA holds.
TEST(CudaDecode, KvAppendAndAttentionDecodeMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double wf = 0, wb = 0;
  uint64_t seed = 9800;
  for (const cases::DecodeAttentionCase& c : cases::decode_attention_check_cases()) check_attention(c, seed++, &wf, &wb);
  std::printf("attention_decode: worst normalised error vs CPU: fast %.3g, fallback %.3g\n", wf, wb);
}

// Batch invariance, what speculative decoding needs to reproduce greedy decoding bit for bit: with
// absolute splits (split_keys), each of T = 16 verify rows equals the T = 1 decode of that token at
// its position over the same cache, exactly — across a split boundary, at several context lengths,
// for the target (causal) and the drafter's sliding layer. Without split_keys they need not.
TEST(CudaDecode, AttentionDecodeWithAbsoluteSplitsIsBatchInvariant) {
  DFLASH_REQUIRE_GPU();
  if (!cuda::attention_decode_fast_supported(256, sm_major())) GTEST_SKIP() << "no fast kernel on this GPU";
  struct Case {
    int64_t Hq, Hkv, d, past, window, split_keys;
  };
  uint64_t seed = 9900;
  for (const Case& x : {Case{24, 4, 256, 250, 0, 128}, Case{24, 4, 256, 1000, 0, 192}, Case{24, 4, 256, 3, 0, 64},
                        Case{32, 8, 128, 700, 100, 128}}) {
    // The verify call's case: T = 16 queries after `past` cached tokens, one slot, capacity 7 past it.
    const cases::DecodeAttentionCase c{"", {16}, {x.past}, x.Hq, x.Hkv, x.d, true, x.window, 0, 7, x.split_keys};
    const cases::DecodeAttentionData data = cases::draw(c, seed++);
    // n queries from row q_row of the case's at position past (the verify call: n = 16, q_row 0).
    auto run = [&](int64_t past, int64_t n, int64_t q_row) {
      const Tensor cu = cu_seqlens_gpu(offsets_of({n})), pd = cases::device_i32(std::vector<int64_t>{past});
      Tensor out = gpu_out({n, c.Hq, c.d}, DType::BF16);
      cuda::AttentionDecodeParams p = data.params(c, data.k_cache0.raw_data(), data.v_cache0.raw_data(), out.raw_data());
      p.q = at_bf16(data.q, q_row * c.Hq * c.d), p.past_len = i32(pd), p.cu_seqlens = i32(cu);
      p.N = n, p.max_new = n, p.key_bound = past + n;
      Tensor ws = gpu_out({static_cast<int64_t>(cuda::attention_decode_workspace(p) / 4) + 1}, DType::F32);
      p.workspace = ws.raw_data(), p.workspace_bytes = cuda::attention_decode_workspace(p);
      cases::kDecodeAttentionFast.launch(p, stream0());
      return host_f32(out);
    };
    const Tensor verify = run(x.past, 16, 0);
    for (int64_t t = 0; t < 16; ++t) {
      const Tensor one = run(x.past + t, 1, t);
      EXPECT_TRUE(bit_equal(one, verify.slice(0, t, t + 1).contiguous()))
          << "row " << t << " past " << x.past << " split_keys " << x.split_keys << " d " << x.d;
    }
  }
}

TEST(CudaDecode, AttentionDecodeRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  // One token after an empty context in the only slot of a pool of 1, capacity 8; Hq 4, Hkv 2, d 128.
  const cases::DecodeAttentionCase c{"", {1}, {0}, 4, 2, 128, true, 0, 0, 7};
  const cases::DecodeAttentionData data = cases::draw(c, 1);
  Tensor kc = data.k_cache0.clone(), vc = data.v_cache0.clone(), out = gpu_out({1, 4, 128}, DType::BF16);
  const cuda::AttentionDecodeParams p = data.params(c, kc.raw_data(), vc.raw_data(), out.raw_data());
  EXPECT_NO_THROW(cuda::attention_decode_fast(p, stream0()));
  const Launchers<cuda::AttentionDecodeParams> op{cuda::attention_decode_fast, cuda::attention_decode_fallback, p};
  op.rejects([](cuda::AttentionDecodeParams& x) { x.d = 96; }, true);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.Hq = 5; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.scale = 0.0f; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.window = -1; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.max_new = 2; }, false);  // > N
  op.rejects([](cuda::AttentionDecodeParams& x) { x.num_slots = 0; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.q = nullptr; }, false);
  EXPECT_TRUE(cuda::attention_decode_fast_supported(256, 9));
  EXPECT_FALSE(cuda::attention_decode_fast_supported(96, 9));
  EXPECT_STREQ(cuda::attention_decode_kernel_name(256, 9), "flash-decoding mma.sync");
  EXPECT_STREQ(cuda::attention_decode_kernel_name(96, 9), "fallback");
  cuda::KvAppendParams a = data.append_params(c, kc.raw_data(), vc.raw_data());
  EXPECT_NO_THROW(cuda::kv_cache_append(a, stream0()));
  a.ldk = 100;  // < Hkv·d
  EXPECT_THROW(cuda::kv_cache_append(a, stream0()), Error);
  DeviceContext::get(0).synchronize();
}
