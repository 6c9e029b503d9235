// The whole target forward on the GPU (bf16) against the transformers golden hidden states, the
// CPU reference on the same bf16 weights, and itself with every step on the fallback kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>

#include "target_model/model.h"
#include "target_model/model_cuda.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
#include "kernels/ops.h"
#include "core/io/safetensors.h"
#include "target_model/weights.h"
#include "bf16_storage.h"
#include "real_dims.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

const std::string kHf = std::string(DFLASH_TEST_DATA_DIR) + "/hf/";
// bf16 activations and weights through 4-6 layers against an f32 reference: measured errors are
// printed; 3e-2 (normalized by the largest reference value) is the bound.
constexpr double kBf16Bound = 3e-2;

KernelPolicies all(KernelPolicy p) { return KernelPolicies::all(p); }

// Sequences of these lengths with deterministic ids.
std::vector<std::vector<int32_t>> packed_batch(std::initializer_list<int> lengths, int64_t vocab) {
  std::vector<std::vector<int32_t>> batch;
  for (int len : lengths) {
    std::vector<int32_t> seq;
    for (int t = 0; t < len; ++t) seq.push_back((t * 37 + len) % static_cast<int>(vocab));
    batch.push_back(seq);
  }
  return batch;
}

// Every layer in `ids`, of a against b, within bound; prints each error after `what`.
void expect_layers_close(const ForwardResult& a, const ForwardResult& b, const std::vector<int64_t>& ids,
                         const char* what, double bound) {
  for (int64_t id : ids) {
    const double e = max_rel_err(a.layers.at(id), b.layers.at(id));
    std::printf("%s, layer %lld: max rel err %.2e\n", what, static_cast<long long>(id), e);
    EXPECT_LE(e, bound) << what << ", layer " << id;
  }
}

// An HF checkpoint under tests/data (`dir`, shown as `name`) on the GPU: every layer of the sequences
// of `lengths` against the transformers golden and the CPU reference on the same bf16 weights, on the
// fast path (auto) and on every fallback; what ran is what was planned (for an MoE model: its kernel).
void expect_golden(const std::string& name, const std::string& dir, const std::vector<int>& lengths) {
  DFLASH_REQUIRE_GPU();
  TargetConfig cfg = TargetConfig::from_file(dir);
  const int sm = cuda_device_info(0).major;
  io::SafetensorsFile golden(dir + "/golden.safetensors");
  // The CPU reference on exactly the bf16-rounded weights the GPU uses.
  TargetModel cpu(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  ForwardOptions opt;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) opt.capture.push_back(i);
  opt.final_norm = true;
  for (KernelPolicy pol : {KernelPolicy::Auto, KernelPolicy::Fallback}) {
    FastPathPlan plan = make_plan(cfg, Device::cuda(0), all(pol), sm);
    if (cfg.is_moe()) {
      EXPECT_EQ(plan.moe_kernel, pol == KernelPolicy::Auto ? "moe_grouped_mma" : "moe_loop_gemm_bf16") << plan.moe;
    }
    CudaTargetModel gpu(cfg, load_weights(cfg, dir, DType::BF16, Device::cuda(0)), plan);
    for (int T : lengths) {
      std::vector<int32_t> ids = ids_of(golden.tensor("ids." + std::to_string(T)));
      ForwardResult r = gpu.forward({ids}, opt);
      ForwardResult rc = cpu.forward({ids}, opt);
      double worst_hf = 0, worst_cpu = 0;
      for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
        const double e = max_rel_err(r.layers.at(i), golden.tensor("layer." + std::to_string(T) + "." + std::to_string(i)));
        const double ec = max_rel_err(r.layers.at(i), rc.layers.at(i));
        EXPECT_LE(e, kBf16Bound) << name << " " << policy_name(pol) << " T=" << T << " layer " << i;
        EXPECT_LE(ec, kBf16Bound) << name << " " << policy_name(pol) << " T=" << T << " layer " << i;
        worst_hf = std::max(worst_hf, e);
        worst_cpu = std::max(worst_cpu, ec);
      }
      EXPECT_LE(max_rel_err(r.final_hidden, golden.tensor("final." + std::to_string(T))), kBf16Bound);
      std::printf("%s gpu %-8s T=%3d: max rel err vs transformers %.2e, vs cpu reference %.2e\n", name.c_str(),
                  policy_name(pol), T, worst_hf, worst_cpu);
    }
    // What ran is what was planned: one forward a length.
    auto mm = gpu.counters().mismatches(gpu.plan(), lengths.size());
    EXPECT_TRUE(mm.empty()) << mm.front();
  }
}

class CudaGolden : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(CudaGolden, MatchesTransformersAndTheCpuReference) { expect_golden(GetParam(), kHf + GetParam(), {1, 37, 130}); }

INSTANTIATE_TEST_SUITE_P(HfCheckpoints, CudaGolden, ::testing::Values("tiny_a", "tiny_b"));

// Fast and fallback paths agree on a random model with the real head dims (d = 128 GDN, 256
// attention) and a packed batch of sequences, and a batch equals its sequences run alone.
TEST(CudaModel, FastEqualsFallbackAndBatchEqualsSingles) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  const int sm = cuda_device_info(0).major;
  FastPathPlan fast = make_plan(c, Device::cuda(0), {}, sm);
  ASSERT_TRUE(fast.fallbacks().empty()) << fast.fallbacks().front();
  CudaTargetModel a(c, random_weights(c, 3, DType::BF16, Device::cuda(0)), fast);
  CudaTargetModel b(c, random_weights(c, 3, DType::BF16, Device::cuda(0)),
                    make_plan(c, Device::cuda(0), all(KernelPolicy::Fallback), sm));
  const std::vector<std::vector<int32_t>> batch = packed_batch({65, 1, 200, 64}, c.vocab_size);
  ForwardOptions opt;
  opt.capture = {3, 7};
  ForwardResult ra = a.forward(batch, opt), rb = b.forward(batch, opt);
  expect_layers_close(ra, rb, opt.capture, "fast vs fallback", kBf16Bound);
  for (size_t s = 0; s < batch.size(); ++s) {
    ForwardResult single = a.forward({batch[s]}, opt);
    Tensor mine = ra.layers.at(7).to(Device::cpu()).slice(0, ra.offsets[s], ra.offsets[s + 1]);
    EXPECT_LE(max_rel_err(mine, single.layers.at(7)), 1e-2) << "sequence " << s;
  }
  // skip_unused_layers (the trainer's forward): layers after the last captured one (3) do not run,
  // and layer 3's output is the whole stack's bit for bit.
  ASSERT_GT(c.num_hidden_layers, 4);
  ForwardOptions skip;
  skip.capture = {3};
  skip.skip_unused_layers = true;
  const uint64_t gemm0 = a.counters().get(Step::Gemm, Path::Fast);
  ForwardResult rs = a.forward(batch, skip);
  EXPECT_EQ(a.counters().get(Step::Gemm, Path::Fast) - gemm0, 4u) << "layers after layer 3 ran";
  const Tensor x = ra.layers.at(3).to(Device::cpu()), y = rs.layers.at(3).to(Device::cpu());
  ASSERT_EQ(x.nbytes(), y.nbytes());
  EXPECT_EQ(std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()), 0);
}

// The FP8 target (issue 18) against the CPU FP8 reference on the same e4m3 codes and block scales:
// the official-layout tiny_a (tests/reference/make_fp8_checkpoint.py; partial 128-blocks, FP8 groups
// that cannot fuse) and a random target with the real head dims quantized at load on the GPU. The
// GPU rounds each GEMM input to bf16 before quantizing it (the CPU quantizes f32), so a code moves
// by one e4m3 step (~6%) wherever an input sits within a bf16 rounding of a code boundary (~2% of
// them): per GEMM ~1% of difference, 5x the bf16 path's, which a random network's layers then
// amplify. So the tighter bound kFp8Bound holds one layer of each kind (a 2-layer model, measured
// 0.048 and 0.056 at 4d73020; the bf16 path's own GPU-vs-CPU difference is ~0.01-0.02 per layer),
// kFp8DeepBound the 4 random layers of tiny_a (measured up to 0.21; a wrong scale layout or column
// offset gives O(1)); measured values are printed.
TEST(CudaModel, Fp8MatchesTheCpuFp8Reference) {
  DFLASH_REQUIRE_GPU();
  constexpr double kFp8Bound = 8e-2, kFp8DeepBound = 0.35;
  const int sm = cuda_device_info(0).major;
  if (!fp8_gemm_supported(sm)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  const std::string dir = std::string(DFLASH_TEST_DATA_DIR) + "/fp8/tiny_a";
  const TargetConfig cfg = TargetConfig::from_file(dir);
  TargetModel cpu(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  CudaTargetModel gpu(cfg, load_weights(cfg, dir, DType::BF16, Device::cuda(0)),
                      make_plan(cfg, Device::cuda(0), {}, sm, Precision::Fp8));
  EXPECT_NE(gpu.plan().summary().find("fp8 GEMMs"), std::string::npos) << gpu.plan().summary();
  io::SafetensorsFile golden(kHf + "tiny_a/golden.safetensors");
  ForwardOptions opt;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) opt.capture.push_back(i);
  for (int T : {1, 37, 130}) {
    std::vector<int32_t> ids = ids_of(golden.tensor("ids." + std::to_string(T)));
    ForwardResult r = gpu.forward({ids}, opt), rc = cpu.forward({ids}, opt);
    double worst = 0;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      const double e = max_rel_err(r.layers.at(i), rc.layers.at(i));
      EXPECT_LE(e, i == 0 ? kFp8Bound : kFp8DeepBound) << "tiny_a fp8 T=" << T << " layer " << i;
      worst = std::max(worst, e);
    }
    std::printf("tiny_a fp8 gpu T=%3d: max rel err vs the cpu fp8 reference %.2e\n", T, worst);
  }
  auto mm = gpu.counters().mismatches(gpu.plan(), 3);
  EXPECT_TRUE(mm.empty()) << mm.front();

  // Random weights quantized on the GPU at load: the codes and scales of the CPU quantizer on the
  // same bf16 values, and the forward within kFp8Bound of the CPU FP8 reference.
  TargetConfig c = real_dims();
  c.num_hidden_layers = 2;  // one layer of each kind
  c.layer_types = {LayerType::LinearAttention, LayerType::FullAttention};
  c.validate();
  TargetWeights gw = random_weights(c, 3, DType::BF16, Device::cuda(0), Precision::Fp8);
  TargetWeights hw = bf16_random_weights_f32(c, 3);
  apply_precision(hw, Precision::Fp8);
  std::map<std::string, std::pair<Tensor, Tensor>> host;
  for_each_projection(hw, [&](const std::string& n, Tensor& w, Tensor& s) { host[n] = {w, s}; });
  int64_t same = 0, total = 0;
  for_each_projection(gw, [&](const std::string& n, Tensor& w, Tensor& s) {
    ASSERT_EQ(w.dtype(), DType::F8E4M3) << n;
    const Tensor values = ops::dequantize_fp8(ops::Fp8Weight{w.to(Device::cpu()), s.to(Device::cpu())});
    const Tensor& ref = host.at(n).first;
    same += std::memcmp(values.raw_data(), ref.raw_data(), ref.nbytes()) == 0;
    ++total;
  });
  EXPECT_EQ(same, total) << "projections quantized on the GPU identically to the CPU";
  TargetModel hcpu(c, std::move(hw));
  CudaTargetModel hgpu(c, std::move(gw), make_plan(c, Device::cuda(0), {}, sm, Precision::Fp8));
  const std::vector<std::vector<int32_t>> batch = packed_batch({65, 1, 200}, c.vocab_size);
  ForwardOptions o2;
  o2.capture = {0, 1};
  ForwardResult ra = hgpu.forward(batch, o2), rb = hcpu.forward(batch, o2);
  expect_layers_close(ra, rb, o2.capture, "fp8 real dims gpu vs cpu fp8 reference", kFp8Bound);
  // A plan of the other precision is refused, naming both.
  const std::string e = error_of([&] {
    CudaTargetModel bad(c, random_weights(c, 3, DType::BF16, Device::cuda(0), Precision::Fp8),
                        make_plan(c, Device::cuda(0), {}, sm, Precision::Bf16));
  });
  EXPECT_NE(e.find("the weights are FP8 but the plan's gemm steps are gemm_bf16"), std::string::npos) << e;
}

// The residual step fused with the next projections' FP8 quantization (cuda::add_rms_norm_quant_fp8,
// tuning::add_norm_quant) and the attention's output gate fused with o_proj's (cuda::sigmoid_gate_quant_fp8,
// tuning::gate_quant) give the unfused forward's bits: every layer's hidden state and the final
// norm's output, a prefill batch of three sequences and a one-token forward; hidden 2048 (the fused
// kernel takes 1024 < D <= 8192), one layer of each kind and a third whose input the attention
// layer's residual step quantizes; each fusion alone and both.
TEST(CudaModel, Fp8FusedNormQuantGivesTheUnfusedBits) {
  DFLASH_REQUIRE_GPU();
  const int sm = cuda_device_info(0).major;
  if (!fp8_gemm_supported(sm)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  TargetConfig c = real_dims();
  c.hidden_size = 2048;
  c.num_hidden_layers = 3;
  c.layer_types = {LayerType::LinearAttention, LayerType::FullAttention, LayerType::LinearAttention};
  c.validate();
  ASSERT_TRUE(cuda::add_rms_norm_quant_fp8_supported(c.hidden_size));
  CudaTargetModel gpu(c, random_weights(c, 5, DType::BF16, Device::cuda(0), Precision::Fp8),
                      make_plan(c, Device::cuda(0), {}, sm, Precision::Fp8));
  ForwardOptions o;
  o.capture = {0, 1, 2};
  o.final_norm = true;
  ASSERT_TRUE(c.attn_output_gate);
  const int saved[2] = {cuda::tuning::add_norm_quant, cuda::tuning::gate_quant};
  for (const std::vector<std::vector<int32_t>>& batch :
       {packed_batch({65, 1, 200}, c.vocab_size), packed_batch({1}, c.vocab_size)}) {
    cuda::tuning::add_norm_quant = cuda::tuning::gate_quant = 0;
    const ForwardResult a = gpu.forward(batch, o);
    for (const auto& [anq, gq] : {std::pair{1, 0}, {0, 1}, {1, 1}}) {
      SCOPED_TRACE(testing::Message() << "add_norm_quant " << anq << ", gate_quant " << gq);
      cuda::tuning::add_norm_quant = anq;
      cuda::tuning::gate_quant = gq;
      const ForwardResult b = gpu.forward(batch, o);
      for (int64_t i : o.capture) EXPECT_TRUE(bit_equal(a.layers.at(i), b.layers.at(i))) << "layer " << i;
      EXPECT_TRUE(bit_equal(a.final_hidden, b.final_hidden)) << "final norm";
    }
  }
  cuda::tuning::add_norm_quant = saved[0];
  cuda::tuning::gate_quant = saved[1];
}

// The HF tiny qwen3_5_moe model on the GPU (bf16, kernels/cuda/moe.h): every layer against the
// transformers golden and the CPU reference on the same bf16 weights, on the grouped GEMM (auto)
// and on the per-expert gemm_bf16 fallback; what ran is what was planned. One token: the plain bound
// (measured on an H200, h200-moegpu: 6.3e-3 auto, 6.9e-3 fallback).
const std::string kMoeDir = std::string(DFLASH_TEST_DATA_DIR) + "/hf_moe/tiny_moe";

TEST(CudaMoeGolden, OneTokenMatchesTransformersAndTheCpuReference) {
  ASSERT_TRUE(TargetConfig::from_file(kMoeDir).is_moe());
  expect_golden("tiny_moe", kMoeDir, {1});
}

namespace {

// Rows `rows` of a [N, H] tensor (host f32), for errors over a subset of tokens.
Tensor pick_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  const Tensor h = t.to(Device::cpu()).to_dtype(DType::F32).contiguous();
  const int64_t H = h.size(1);
  Tensor out = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::F32);
  for (size_t j = 0; j < rows.size(); ++j)
    std::copy(h.data<float>() + rows[j] * H, h.data<float>() + (rows[j] + 1) * H, out.data<float>() + j * H);
  return out;
}

// Token n's gap between its k-th and (k+1)-th largest logit (logits [N, E] host f32): how far the
// routing of n is from a tie (softmax is monotonic, so the top-k of the logits is the top-k of p).
double topk_gap(const Tensor& logits, int64_t n, int64_t k) {
  const int64_t E = logits.size(1);
  std::vector<float> row(logits.data<float>() + n * E, logits.data<float>() + (n + 1) * E);
  std::sort(row.begin(), row.end(), std::greater<float>());
  return k < E ? static_cast<double>(row[k - 1]) - row[k] : INFINITY;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : to_doubles(t)) m = std::max(m, std::abs(v));
  return m;
}

bool same_choices(const Tensor& a, const Tensor& b, int64_t n, int64_t k) {
  std::vector<int32_t> x(a.data<int32_t>() + n * k, a.data<int32_t>() + (n + 1) * k);
  std::vector<int32_t> y(b.data<int32_t>() + n * k, b.data<int32_t>() + (n + 1) * k);
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  return x == y;
}

}  // namespace

// Longer sequences (T = 37, 130) of the HF tiny MoE, where a plain 3e-2 bound over every token
// failed on the GPU (h200-moegpu: 3.7e-2 / 0.45, both kernels alike). Two causes, both found in
// h200-moe5 and neither a bug:
//  - Routing flips at near ties. With E = 8 and top-2, transformers' own f32 logits put some tokens'
//    2nd and 3rd expert within 0.001-0.02 of each other (T = 130: layer 0 token 41 at 0.0138, layer 1
//    tokens 7 / 100 / 113 at 0.0011 / 0.0077 / 0.0010; the logits reach |8|), and bf16 activations
//    move a logit by more; a flipped expert changes that token's output by O(1) and, through the
//    GatedDeltaNet state and attention, the later tokens of the later layers (0.45 at T = 130). With
//    transformers' routing forced on the GPU the same forward is within 2.2e-2 (grouped) / 2.4e-2
//    (fallback).
//  - bf16 storage itself. At T = 37 nothing flips and the attention layer still ends 4.0e-2 from
//    transformers, the final norm 4.9e-2: exactly what the CPU reference loses when the activations
//    the GPU stores in bf16 are rounded there (tests/bf16_storage.h: 4.01e-2 and 4.95e-2).
// So each bound here is max(3e-2, twice what bf16 storage alone costs at that length and layer,
// measured by the emulation on the CPU in this test; the GPU measured 1.0-1.5x of it), and:
//  1. Routing forced (ForwardOptions::router_logits = transformers' logits): every layer, every token
//     and the final norm within the bound against transformers and the CPU reference; the GPU's own
//     router logits (computed, unused) within the logit bound of transformers'.
//  2. Routing free (its own, as in use): in every layer up to the first with a flip (whose router
//     inputs no flip has reached) each choice unlike transformers' is a near tie (transformers' gap
//     between its k-th and (k+1)-th logit below twice the logit bound x the largest logit) and the
//     tokens routed alike are within the bound; in every layer the tokens before the first flipped
//     position are within the bound.
// A wrong layout, gate or weight at T > 1 fails 1 by O(1); a routing bug fails 2's near-tie check.
TEST(CudaMoeGolden, LongerSequencesMatchTransformersWhereRoutingAgrees) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig cfg = TargetConfig::from_file(kMoeDir);
  ASSERT_TRUE(cfg.is_moe());
  const int64_t k = cfg.num_experts_per_tok, L = cfg.num_hidden_layers;
  const int sm = cuda_device_info(0).major;
  io::SafetensorsFile golden(kMoeDir + "/golden.safetensors");
  TargetModel cpu(cfg, load_weights(cfg, kMoeDir, DType::F32, Device::cpu()));
  auto g = [&](const std::string& name) { return golden.tensor(name).to_dtype(DType::F32).contiguous(); };
  auto all_rows = [](int64_t T) {
    std::vector<int64_t> r(static_cast<size_t>(T));
    std::iota(r.begin(), r.end(), 0);
    return r;
  };
  for (KernelPolicy pol : {KernelPolicy::Auto, KernelPolicy::Fallback}) {
    CudaTargetModel gpu(cfg, load_weights(cfg, kMoeDir, DType::BF16, Device::cuda(0)),
                        make_plan(cfg, Device::cuda(0), all(pol), sm));
    for (int T : {37, 130}) {
      const std::string ts = std::to_string(T);
      SCOPED_TRACE(std::string(policy_name(pol)) + " T=" + ts);
      const std::vector<int32_t> ids = ids_of(golden.tensor("ids." + ts));
      std::map<int64_t, Tensor> hf_logits;
      for (int64_t i = 0; i < L; ++i) hf_logits[i] = g("router." + ts + "." + std::to_string(i) + ".logits");
      ForwardOptions opt;
      for (int64_t i = 0; i < L; ++i) opt.capture.push_back(i);
      opt.final_norm = true;
      opt.capture_routing = true;
      const ForwardResult rc = cpu.forward({ids}, opt);
      // What bf16 storage alone costs, with transformers' routing (so on every token).
      const Bf16Storage emu = bf16_storage_forward(cpu, ids, true, &hf_logits);
      // The bound of layer i over `rows`, and of its router logits.
      auto bound = [&](int64_t i, const std::vector<int64_t>& rows) {
        return std::max(kBf16Bound, 2 * max_rel_err(pick_rows(emu.layers.at(i), rows),
                                                     pick_rows(g("layer." + ts + "." + std::to_string(i)), rows)));
      };
      auto logit_bound = [&](int64_t i) { return std::max(kBf16Bound, 2 * max_rel_err(emu.routing.at(i).logits, hf_logits.at(i))); };

      // 1. Routing forced.
      ForwardOptions forced = opt;
      forced.router_logits = &hf_logits;
      const ForwardResult rf = gpu.forward({ids}, forced);
      std::string line;
      for (int64_t i = 0; i < L; ++i) {
        const std::string li = ts + "." + std::to_string(i);
        const double b = bound(i, all_rows(T)), bl = logit_bound(i);
        const double e = max_rel_err(rf.layers.at(i), g("layer." + li));
        const double ec = max_rel_err(rf.layers.at(i), rc.layers.at(i));
        const double el = max_rel_err(rf.routing.at(i).logits, hf_logits.at(i));
        EXPECT_LE(e, b) << "forced routing, layer " << i << " vs transformers";
        EXPECT_LE(ec, b) << "forced routing, layer " << i << " vs the cpu reference";
        EXPECT_LE(el, bl) << "the GPU's own router logits of layer " << i << " vs transformers'";
        const Tensor want = golden.tensor("router." + li + ".experts").contiguous();
        for (int64_t n = 0; n < T; ++n)
          EXPECT_TRUE(same_choices(rf.routing.at(i).experts, want, n, k)) << "forced choice, layer " << i << " token " << n;
        char buf[96];
        std::snprintf(buf, sizeof buf, " %.2e (bound %.2e, logits %.2e)", std::max(e, ec), b, el);
        line += buf;
      }
      const double ef = max_rel_err(rf.final_hidden, g("final." + ts));
      const double bf = std::max(kBf16Bound, 2 * max_rel_err(emu.final_hidden, g("final." + ts)));
      EXPECT_LE(ef, bf) << "forced routing, final norm";
      std::printf("tiny_moe gpu %-8s T=%3d routing forced, max rel err per layer:%s; final norm %.2e (bound %.2e)\n",
                  policy_name(pol), T, line.c_str(), ef, bf);

      // 2. Routing free.
      const ForwardResult r = gpu.forward({ids}, opt);
      int64_t first_pos = T, first_layer = L;
      std::vector<std::vector<int64_t>> flipped(static_cast<size_t>(L));
      for (int64_t i = 0; i < L; ++i) {
        const Tensor want = golden.tensor("router." + ts + "." + std::to_string(i) + ".experts").contiguous();
        for (int64_t n = 0; n < T; ++n)
          if (!same_choices(r.routing.at(i).experts, want, n, k)) {
            flipped[static_cast<size_t>(i)].push_back(n);
            first_pos = std::min(first_pos, n);
            first_layer = std::min(first_layer, i);
          }
      }
      std::vector<int64_t> before(static_cast<size_t>(first_pos));
      std::iota(before.begin(), before.end(), 0);
      for (int64_t i = 0; i < L; ++i) {
        const std::string li = ts + "." + std::to_string(i);
        const Tensor& hl = hf_logits.at(i);
        const std::vector<int64_t>& fl = flipped[static_cast<size_t>(i)];
        // A near tie: transformers' gap below twice the logit bound (each of the two logits may move by it).
        const double tie = 2 * logit_bound(i) * max_abs(hl);
        std::string flips;
        for (int64_t n : fl) {
          char buf[48];
          std::snprintf(buf, sizeof buf, " %lld:%.4f", static_cast<long long>(n), topk_gap(hl, n, k));
          flips += buf;
        }
        if (i <= first_layer) {
          for (int64_t n : fl)
            EXPECT_LT(topk_gap(hl, n, k), tie) << "layer " << i << " token " << n << ": routed differently, not a near tie";
          EXPECT_LE(max_rel_err(r.routing.at(i).logits, hl), logit_bound(i)) << "router logits, layer " << i;
          std::vector<int64_t> agree;
          for (int64_t n = 0; n < T; ++n)
            if (std::find(fl.begin(), fl.end(), n) == fl.end()) agree.push_back(n);
          EXPECT_LE(max_rel_err(pick_rows(r.layers.at(i), agree), pick_rows(g("layer." + li), agree)), bound(i, agree))
              << "layer " << i << ", tokens routed as transformers routed them";
        }
        if (first_pos > 0) {
          EXPECT_LE(max_rel_err(pick_rows(r.layers.at(i), before), pick_rows(g("layer." + li), before)), bound(i, before))
              << "layer " << i << ", tokens before the first flip (" << first_pos << ")";
        }
        std::printf("tiny_moe gpu %-8s T=%3d layer %lld: %zu token(s) routed unlike transformers%s%s (near tie: gap < %.3f)\n",
                    policy_name(pol), T, static_cast<long long>(i), fl.size(), flips.empty() ? "" : ", token:gap",
                    flips.c_str(), tie);
      }
      double all_err = 0;
      for (int64_t i = 0; i < L; ++i) all_err = std::max(all_err, max_rel_err(r.layers.at(i), g("layer." + ts + "." + std::to_string(i))));
      std::printf("tiny_moe gpu %-8s T=%3d routing free: first flip at token %lld (layer %lld); all tokens, all layers: "
                  "max rel err %.2e\n",
                  policy_name(pol), T, static_cast<long long>(first_pos), static_cast<long long>(first_layer), all_err);
    }
    auto mm = gpu.counters().mismatches(gpu.plan(), 4);  // two forwards a length
    EXPECT_TRUE(mm.empty()) << mm.front();
  }
}
