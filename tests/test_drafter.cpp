// The DFlash drafter CPU reference: gradients of every parameter and of the context features
// against central finite differences in float64, the mask (and the three published bugs), labels
// and decay weights, anchors, the chunked CE, config parsing and the HF export / import; the
// inference proposer (decode.h) against the training forward, and the greedy argmax op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>

#include "drafter/batch.h"
#include "drafter/config.h"
#include "drafter/decode.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "core/random.h"
#include "kernels/cpu/gemm.h"
#include "target_model/config.h"
#include "core/io/safetensors.h"
#include "test_drafters.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::drafter;

namespace {

uint64_t g_stream = 100;

Tensor randn64(const Shape& s, float mean = 0.0f, float stddev = 1.0f, DType dt = DType::F64) {
  Tensor t = Tensor::empty(s, dt);
  fill_normal(t, {777, g_stream++, 0}, mean, stddev);
  return t;
}

// H=16, 2 layers (full, sliding window 5), 2 heads / 1 kv head of 8, I=24, V=37, B=4, k=2 captured layers.
DrafterConfig tiny_config() {
  return full_and_sliding_drafter("tiny", {.hidden = 16, .intermediate = 24, .vocab = 37, .heads = 2, .kv_heads = 1,
                                           .head_dim = 8, .sliding_window = 5, .block_size = 4});
}

// Weights with enough spread that attention is far from uniform; norm weights around 1.
DrafterWeights tiny_weights(const DrafterConfig& c, DType dt = DType::F64) {
  DrafterWeights w = DrafterWeights::zeros(c, dt);
  for (auto& e : w.entries(c)) *e.tensor = e.is_norm ? randn64(e.shape, 1.0f, 0.2f, dt) : randn64(e.shape, 0.0f, 0.35f, dt);
  return w;
}

FrozenTarget tiny_target(const DrafterConfig& c) {
  return {randn64({c.vocab_size, c.hidden_size}), randn64({c.vocab_size, c.hidden_size}, 0.0f, 0.6f)};
}

// Sequence 0: S = 12 with 3 anchors (the last block runs past the end); sequence 1: S = 7, 1 anchor.
DrafterBatch tiny_batch(const DrafterConfig& c) {
  DrafterBatch b;
  b.seqs.offsets = {0, 12, 19};
  b.context = randn64({19, c.context_dim()});
  for (int i = 0; i < 19; ++i) b.tokens.push_back((i * 7 + 3) % 36);  // never the mask token 36
  b.loss_mask = {0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, /*seq 1*/ 0, 1, 1, 1, 1, 1, 1};
  b.blocks = {{0, 2}, {0, 6}, {0, 9}, {1, 1}};
  return b;
}

double loss_of(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& t, const DrafterBatch& b) {
  return forward_backward(c, w, t, b, StepOptions{}).loss();
}

Tensor hidden_of(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& t, const DrafterBatch& b,
                 StepOptions o = {}) {
  Tensor h;
  forward_backward(c, w, t, b, o, nullptr, nullptr, &h);
  return h;
}

// Largest |difference| over the rows of block `blk` (B rows each) of two final-hidden tensors.
double block_diff(const Tensor& x, const Tensor& y, int64_t blk, int64_t B, int64_t only_row = -1) {
  const int64_t H = x.size(1);
  double m = 0;
  for (int64_t j = 0; j < B; ++j) {
    if (only_row >= 0 && j != only_row) continue;
    for (int64_t c = 0; c < H; ++c) {
      const int64_t i = (blk * B + j) * H + c;
      m = std::max(m, std::abs(x.data<double>()[i] - y.data<double>()[i]));
    }
  }
  return m;
}

// The f32 step (any options) gives the same loss and gradients, bit for bit, on 1 and on 3 threads.
void expect_same_bits_on_1_and_3_threads(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& t,
                                         const DrafterBatch& b, const StepOptions& o) {
  const int saved = cpu::cpu_threads();
  DrafterWeights g1 = DrafterWeights::zeros(c, DType::F32), g3 = DrafterWeights::zeros(c, DType::F32);
  cpu::set_cpu_threads(1);
  const double l1 = forward_backward(c, w, t, b, o, &g1).loss();
  cpu::set_cpu_threads(3);
  const double l3 = forward_backward(c, w, t, b, o, &g3).loss();
  cpu::set_cpu_threads(saved);
  EXPECT_EQ(l1, l3);
  auto x = g1.entries(c), y = g3.entries(c);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(std::memcmp(x[i].tensor->raw_data(), y[i].tensor->raw_data(), x[i].tensor->nbytes()), 0) << x[i].name;
}

}  // namespace

// ---------------------------------------------------------------- gradients

TEST(Drafter, GradientsMatchFiniteDifferencesInDouble) {
  const DrafterConfig c = tiny_config();
  DrafterWeights w = tiny_weights(c);
  const FrozenTarget t = tiny_target(c);
  DrafterBatch b = tiny_batch(c);
  DrafterWeights g = DrafterWeights::zeros(c, DType::F64);
  Tensor gctx;
  const StepStats st = forward_backward(c, w, t, b, StepOptions{}, &g, &gctx);
  ASSERT_GT(st.weight_sum, 0);
  ASSERT_TRUE(std::isfinite(st.loss()));

  const double h = 1e-5;
  // Relative error of one tensor: max |fd - analytic| over the sampled elements, divided by the
  // largest |analytic| among them. Bound 1e-6 (central differences in double give ~1e-9).
  auto check = [&](const std::string& name, Tensor& param, const Tensor& grad, auto&& loss) {
    const int64_t n = param.numel(), samples = std::min<int64_t>(n, 6);
    double max_diff = 0, max_ref = 0;
    for (int64_t s = 0; s < samples; ++s) {
      const int64_t i = (s * n) / samples + (s * 7) % std::max<int64_t>(1, n / samples);
      double* p = param.data<double>() + i;
      const double orig = *p;
      *p = orig + h;
      const double lp = loss();
      *p = orig - h;
      const double lm = loss();
      *p = orig;
      const double fd = (lp - lm) / (2 * h), an = grad.item_at(i);
      max_diff = std::max(max_diff, std::abs(fd - an));
      max_ref = std::max(max_ref, std::abs(an));
    }
    const double err = max_diff / std::max(max_ref, 1e-12);
    std::printf("  fd %-44s max|g| %.3e  rel err %.2e\n", name.c_str(), max_ref, err);
    EXPECT_GT(max_ref, 1e-7) << name << ": sampled gradients are all ~0, the check is vacuous";
    EXPECT_LT(err, 1e-6) << name;
    return err;
  };
  auto loss = [&] { return loss_of(c, w, t, b); };
  auto we = w.entries(c);
  auto ge = g.entries(c);
  double worst = 0;
  for (size_t k = 0; k < we.size(); ++k) worst = std::max(worst, check(we[k].name, *we[k].tensor, *ge[k].tensor, loss));
  worst = std::max(worst, check("context features (fc input)", b.context, gctx, loss));
  std::printf("  worst relative error over %zu tensors: %.2e\n", we.size() + 1, worst);
}

TEST(Drafter, GradientsAccumulateAndF32PathAgrees) {
  const DrafterConfig c = tiny_config();
  const DrafterWeights w64 = tiny_weights(c);
  DrafterWeights w32 = DrafterWeights::zeros(c, DType::F32);
  auto e64 = const_cast<DrafterWeights&>(w64).entries(c);
  auto e32 = w32.entries(c);
  for (size_t i = 0; i < e64.size(); ++i) *e32[i].tensor = e64[i].tensor->to_dtype(DType::F32);
  const FrozenTarget t = tiny_target(c);
  const DrafterBatch b = tiny_batch(c);
  DrafterWeights g64 = DrafterWeights::zeros(c, DType::F64), g32 = DrafterWeights::zeros(c, DType::F32);
  forward_backward(c, w64, t, b, {}, &g64);
  forward_backward(c, w32, t, b, {}, &g32);
  forward_backward(c, w32, t, b, {}, &g32);  // gradients add up
  auto a = g64.entries(c), z = g32.entries(c);
  for (size_t i = 0; i < a.size(); ++i) {
    Tensor twice = a[i].tensor->clone();
    for (int64_t k = 0; k < twice.numel(); ++k) twice.data<double>()[k] *= 2;
    EXPECT_LT(max_rel_err(*z[i].tensor, twice), 1e-5) << a[i].name;
  }
}

// DrafterMath::F32 (the CPU backend's fast step: float, GEMMs on kernels/cpu/gemm.h) against the double
// reference on the same weights and batch, for every mask variant: the loss within 1e-5 (relative), the
// final hidden states and every gradient (the context's too) within 1e-4 (max_rel_err; f32 sums over at
// most a few hundred terms give ~1e-6), the same top-1 counts; and the same bits on 1 and 3 threads.
TEST(Drafter, F32MathMatchesTheDoubleReference) {
  const DrafterConfig c = tiny_config();
  const DrafterWeights w = tiny_weights(c, DType::F32);
  const FrozenTarget t = tiny_target(c);
  const DrafterBatch b = tiny_batch(c);
  for (MaskVariant v : {MaskVariant::Correct, MaskVariant::CausalInBlock, MaskVariant::AnchorInclusive}) {
    SCOPED_TRACE(static_cast<int>(v));
    StepOptions o64, o32;
    o64.mask = o32.mask = v;
    o32.math = DrafterMath::F32;
    DrafterWeights g64 = DrafterWeights::zeros(c, DType::F64), g32 = DrafterWeights::zeros(c, DType::F32);
    Tensor c64, c32, h64, h32;
    const StepStats s64 = forward_backward(c, w, t, b, o64, &g64, &c64, &h64);
    const StepStats s32 = forward_backward(c, w, t, b, o32, &g32, &c32, &h32);
    EXPECT_NEAR(s32.loss(), s64.loss(), 1e-5 * s64.loss());
    EXPECT_EQ(s32.correct, s64.correct);
    EXPECT_LT(max_rel_err(h32, h64), 1e-4) << "final hidden states";
    EXPECT_LT(max_rel_err(c32, c64), 1e-4) << "context gradient";
    auto a = g64.entries(c), z = g32.entries(c);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(max_rel_err(*z[i].tensor, *a[i].tensor), 1e-4) << a[i].name;
  }
  StepOptions o;
  o.math = DrafterMath::F32;
  expect_same_bits_on_1_and_3_threads(c, w, t, b, o);
}

// StepOptions::fp8_linears (model.drafter.precision: fp8 on the CPU backend): the f32 step with every
// linear layer's operands rounded to block-scaled e4m3 (drafter/ref_math.h linear_fp8). Against the
// plain f32 step on the same weights and batch: the loss, the final hidden states and every gradient
// move by e4m3's rounding (3 mantissa bits: about 3% RMS per operand with 1 x 128 scales, so ~4% per
// linear, compounding through the two layers' attention and MLP; measured on this tiny drafter: loss
// 2.5e-2, final hidden states 0.15, context gradient 0.15 relative Frobenius error, gradients up to
// 0.52 for a norm weight, whose gradient is a sum with cancellations), and they do move (the
// quantization is not skipped); the same bits on 1 and 3 threads; the double reference refuses it.
// (The tiles themselves: Fp8Quantize.FakeQuantizeTilesEqualTheQuantizers; the loss over a real run:
// docs/training.md.)
// The FP8 tests' inputs: the tiny drafter in f32, its target and batch, and the f32 step's options.
struct TinyF32Step {
  DrafterConfig c = tiny_config();
  DrafterWeights w = tiny_weights(c, DType::F32);
  FrozenTarget t = tiny_target(c);
  DrafterBatch b = tiny_batch(c);
  StepOptions o32 = f32();
  static StepOptions f32() {
    StepOptions o;
    o.math = DrafterMath::F32;
    return o;
  }
};

// Relative Frobenius error of x against y: ||x - y|| / ||y||.
static double rel_fro(const Tensor& x, const Tensor& y) {
  const Tensor a = x.to_dtype(DType::F64).contiguous(), r = y.to_dtype(DType::F64).contiguous();
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = a.data<double>()[i] - r.data<double>()[i];
    num += d * d;
    den += r.data<double>()[i] * r.data<double>()[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

TEST(Drafter, Fp8LinearsStayNearTheF32Step) {
  const TinyF32Step s;
  const auto& [c, w, t, b, o32] = s;
  StepOptions o8 = o32;
  o8.fp8_linears = true;
  DrafterWeights g32 = DrafterWeights::zeros(c, DType::F32), g8 = DrafterWeights::zeros(c, DType::F32);
  Tensor c32, c8, h32, h8;
  const StepStats s32 = forward_backward(c, w, t, b, o32, &g32, &c32, &h32);
  const StepStats s8 = forward_backward(c, w, t, b, o8, &g8, &c8, &h8);
  const double loss_rel = std::abs(s8.loss() - s32.loss()) / s32.loss();
  double worst = 0;
  std::string worst_name;
  auto a = g32.entries(c), z = g8.entries(c);
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = rel_fro(*z[i].tensor, *a[i].tensor);
    EXPECT_LT(e, 0.7) << a[i].name;
    if (e > worst) worst = e, worst_name = a[i].name;
  }
  std::printf("fp8 linears vs f32: loss %.3e relative, final hidden %.3e, context gradient %.3e, worst gradient %.3e (%s)\n",
              loss_rel, rel_fro(h8, h32), rel_fro(c8, c32), worst, worst_name.c_str());
  EXPECT_LT(loss_rel, 0.05);
  EXPECT_GT(loss_rel, 0.0);  // quantized, not skipped
  EXPECT_LT(rel_fro(h8, h32), 0.25);
  EXPECT_GT(rel_fro(h8, h32), 1e-3);
  EXPECT_LT(rel_fro(c8, c32), 0.25);
  expect_same_bits_on_1_and_3_threads(c, w, t, b, o8);
  StepOptions o64 = o8;
  o64.math = DrafterMath::F64;
  EXPECT_NE(error_of([&] { forward_backward(c, w, t, b, o64); }).find("FP8 linears run on the f32 step"), std::string::npos);
}

// StepOptions::fp8_wgrad_x_blocks (model.drafter.fp8_wgrad_x_tiles: 128x128): the weight gradients'
// x operand in 128 x 128 blocks instead of 128 x 1 tiles along the tokens. Only the linear layers' weight
// gradients may change: the loss, the final hidden states, the context gradient and the norm weights'
// gradients keep their bits; the linears' weight gradients move (the option is not skipped), and stay as
// near the f32 step's as the 128 x 1 tiles' do (each within 1.5x of that error + 0.02; measured on this
// tiny drafter: printed); the same bits on 1 and 3 threads.
TEST(Drafter, Fp8WgradXBlocksChangeOnlyTheWeightGradients) {
  const TinyF32Step s;
  const auto& [c, w, t, b, o32] = s;
  StepOptions o8 = o32, ob = o32;
  o8.fp8_linears = ob.fp8_linears = true;
  ob.fp8_wgrad_x_blocks = true;
  DrafterWeights g32 = DrafterWeights::zeros(c, DType::F32), g8 = DrafterWeights::zeros(c, DType::F32);
  DrafterWeights gb = DrafterWeights::zeros(c, DType::F32);
  Tensor c32, c8, cb, h32, h8, hb;
  forward_backward(c, w, t, b, o32, &g32, &c32, &h32);
  const StepStats s8 = forward_backward(c, w, t, b, o8, &g8, &c8, &h8);
  const StepStats sb = forward_backward(c, w, t, b, ob, &gb, &cb, &hb);
  EXPECT_EQ(s8.loss(), sb.loss());
  EXPECT_EQ(rel_fro(hb, h8), 0.0);
  EXPECT_EQ(rel_fro(cb, c8), 0.0);
  auto e32 = g32.entries(c), e8 = g8.entries(c), eb = gb.entries(c);
  int moved = 0;
  for (size_t i = 0; i < e32.size(); ++i) {
    const std::string& name = e32[i].name;
    const bool norm = name.find("norm") != std::string::npos || name.find("layernorm") != std::string::npos;
    const double d = rel_fro(*eb[i].tensor, *e8[i].tensor);
    if (norm) {
      EXPECT_EQ(d, 0.0) << name;
      continue;
    }
    moved += d > 0;
    const double err8 = rel_fro(*e8[i].tensor, *e32[i].tensor), errb = rel_fro(*eb[i].tensor, *e32[i].tensor);
    std::printf("  %-40s vs f32: 128x1 %.3e, 128x128 %.3e\n", name.c_str(), err8, errb);
    EXPECT_LT(errb, 1.5 * err8 + 0.02) << name;
  }
  EXPECT_GT(moved, 0) << "the option changed no weight gradient";
  expect_same_bits_on_1_and_3_threads(c, w, t, b, ob);
}

// StepOptions::fp8_lm_head (model.drafter.lm_head_precision: fp8 on the CPU backend): the f32 step with
// the LM-head cross-entropy's operands rounded to e4m3 (the head 128 x 128, the final states and the
// logits' gradient 1 x 128). Only the loss and the gradients change: the loss moves (quantized, not
// skipped) by less than 5%, every gradient by less than 0.6 (max_rel_err: one rounded GEMM each way,
// ~5% RMS per element, but a norm weight's gradient is a sum with cancellations: 0.15-0.37 measured on
// this tiny drafter across input draws, as the FP8 linears' 0.52); the forward's final hidden states
// do not move at all; the same bits on 1 and 3 threads; the double reference refuses it.
TEST(Drafter, Fp8LmHeadStaysNearTheF32Step) {
  const TinyF32Step s;
  const auto& [c, w, t, b, o32] = s;
  StepOptions o8 = o32;
  o8.fp8_lm_head = true;
  DrafterWeights g32 = DrafterWeights::zeros(c, DType::F32), g8 = DrafterWeights::zeros(c, DType::F32);
  Tensor c32, c8, h32, h8;
  const StepStats s32 = forward_backward(c, w, t, b, o32, &g32, &c32, &h32);
  const StepStats s8 = forward_backward(c, w, t, b, o8, &g8, &c8, &h8);
  const double loss_rel = std::abs(s8.loss() - s32.loss()) / s32.loss();
  EXPECT_GT(loss_rel, 0.0);
  EXPECT_LT(loss_rel, 0.05);
  EXPECT_EQ(max_rel_err(h8, h32), 0.0) << "the FP8 LM head changed the drafter's forward";
  auto a = g32.entries(c), z = g8.entries(c);
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = max_rel_err(*z[i].tensor, *a[i].tensor);
    if (e > worst) worst = e, worst_name = a[i].name;
    EXPECT_LT(e, 0.6) << a[i].name;
  }
  EXPECT_GT(worst, 1e-3) << "the gradients did not move: the logits' gradient was not quantized";
  std::printf("fp8 LM head vs f32: loss %.3e relative, worst gradient %.3e (%s, max_rel_err)\n", loss_rel, worst,
              worst_name.c_str());
  expect_same_bits_on_1_and_3_threads(c, w, t, b, o8);
  StepOptions o64 = o8;
  o64.math = DrafterMath::F64;
  EXPECT_NE(error_of([&] { forward_backward(c, w, t, b, o64); }).find("the FP8 LM head runs on the f32 step"),
            std::string::npos);
}

// training.blocks_per_pass (issue 31): a batch's blocks in passes over the same context give the loss,
// the accuracy counts and every gradient (the context's too) of one pass over all of them, within the
// summation order (double: 1e-13); a pass size of 0 or of all blocks is one pass; without a fixed
// normalisation (grad_scale 0) more than one pass is refused; the batch's blocks are restored.
TEST(Drafter, BlockPassesGiveTheGradientsOfOnePass) {
  const DrafterConfig c = tiny_config();
  const DrafterWeights w = tiny_weights(c);
  const FrozenTarget t = tiny_target(c);
  DrafterBatch b = tiny_batch(c);
  StepOptions o;
  o.grad_scale = 0.37;
  DrafterWeights g1 = DrafterWeights::zeros(c, DType::F64);
  Tensor gc1;
  const StepStats s1 = forward_backward(c, w, t, b, o, &g1, &gc1);
  for (const int64_t per_pass : {1, 3}) {
    DrafterWeights gp = DrafterWeights::zeros(c, DType::F64);
    Tensor gcp = Tensor::zeros(b.context.shape(), DType::F64);
    int passes = 0, lasts = 0;
    const StepStats sp = for_each_block_pass(b, per_pass, o.grad_scale, [&](bool last) {
      ++passes, lasts += last;
      EXPECT_LE(static_cast<int64_t>(b.blocks.size()), per_pass);
      Tensor gc;
      const StepStats st = forward_backward(c, w, t, b, o, &gp, &gc);
      for (int64_t i = 0; i < gc.numel(); ++i) gcp.data<double>()[i] += gc.data<double>()[i];
      return st;
    });
    EXPECT_EQ(passes, per_pass == 1 ? 4 : 2);
    EXPECT_EQ(lasts, 1);
    EXPECT_EQ(b.blocks.size(), 4u);
    EXPECT_EQ(b.blocks[2].anchor, 9);
    EXPECT_NEAR(sp.weighted_ce_sum, s1.weighted_ce_sum, 1e-13 * s1.weighted_ce_sum);
    EXPECT_DOUBLE_EQ(sp.weight_sum, s1.weight_sum);
    EXPECT_EQ(sp.correct, s1.correct);
    EXPECT_EQ(sp.counted, s1.counted);
    EXPECT_EQ(sp.num_blocks, s1.num_blocks);
    auto a = g1.entries(c), z = gp.entries(c);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(max_rel_err(*z[i].tensor, *a[i].tensor), 1e-13) << a[i].name << ", " << per_pass;
    EXPECT_LT(max_rel_err(gcp, gc1), 1e-13) << "context, " << per_pass;
  }
  int passes = 0;
  for (const int64_t per_pass : {0, 4, 9}) for_each_block_pass(b, per_pass, 0.0, [&](bool last) { EXPECT_TRUE(last); ++passes; return StepStats{}; });
  EXPECT_EQ(passes, 3);
  EXPECT_THROW(for_each_block_pass(b, 2, 0.0, [](bool) { return StepStats{}; }), Error);
  EXPECT_EQ(b.blocks.size(), 4u);
}

// ---------------------------------------------------------------- mask

TEST(DrafterMask, DirectRules) {
  const int64_t a = 7, B = 4, W = 5;
  for (int64_t j = 0; j < B; ++j) {
    for (int64_t t = 0; t < 12; ++t) {
      // Full layers: context strictly before the anchor, no window.
      EXPECT_EQ(mask_allows(AttnType::Full, 0, a, j, false, t), t < a) << j << " " << t;
      // Sliding: also within the window of the query position a + j.
      EXPECT_EQ(mask_allows(AttnType::Sliding, W, a, j, false, t), t < a && t >= a + j - (W - 1)) << j << " " << t;
    }
    for (int64_t jj = 0; jj < B; ++jj) {
      EXPECT_TRUE(mask_allows(AttnType::Full, 0, a, j, true, jj)) << "full layers see the whole own block";
      EXPECT_EQ(mask_allows(AttnType::Sliding, W, a, j, true, jj), jj <= j);
    }
  }
  // The buggy variants differ exactly where the bugs are.
  EXPECT_TRUE(mask_allows(AttnType::Full, 0, a, 0, false, a, MaskVariant::AnchorInclusive));
  EXPECT_FALSE(mask_allows(AttnType::Full, 0, a, 0, false, a, MaskVariant::Correct));
  EXPECT_FALSE(mask_allows(AttnType::Full, 0, a, 1, true, 2, MaskVariant::CausalInBlock));
  EXPECT_TRUE(mask_allows(AttnType::Full, 0, a, 1, true, 2, MaskVariant::Correct));
}

namespace {
struct MaskFixture {
  DrafterConfig c = tiny_config();
  DrafterWeights w = tiny_weights(c);
  FrozenTarget t = tiny_target(c);
  DrafterBatch b = tiny_batch(c);
};

// True when perturbing the context feature AT the anchor of block 1 (anchor 6) changes that
// block's outputs: what the `<=` bug does. The feature just before the anchor must always matter.
bool anchor_leaks(MaskVariant v) {
  MaskFixture f;
  StepOptions o;
  o.mask = v;
  const Tensor base = hidden_of(f.c, f.w, f.t, f.b, o);
  DrafterBatch p = f.b;
  p.context = f.b.context.clone();
  for (int64_t k = 0; k < p.context.size(1); ++k) p.context.data<double>()[5 * p.context.size(1) + k] += 1.0;
  EXPECT_GT(block_diff(base, hidden_of(f.c, f.w, f.t, p, o), 1, 4), 1e-6) << "position a-1 must be seen";
  p.context = f.b.context.clone();
  for (int64_t k = 0; k < p.context.size(1); ++k) p.context.data<double>()[6 * p.context.size(1) + k] += 1.0;
  return block_diff(base, hidden_of(f.c, f.w, f.t, p, o), 1, 4) > 0;
}

// True when the first row of a block cannot see the later rows (changing the mask token's
// embedding leaves row 0 unchanged): the causal-in-block bug on full-attention layers.
bool causal_in_block(MaskVariant v, std::vector<AttnType> types = {AttnType::Full, AttnType::Sliding}) {
  MaskFixture f;
  f.c.layer_types = types;
  StepOptions o;
  o.mask = v;
  const Tensor base = hidden_of(f.c, f.w, f.t, f.b, o);
  FrozenTarget p{f.t.embed_tokens.clone(), f.t.lm_head};
  for (int64_t k = 0; k < f.c.hidden_size; ++k) p.embed_tokens.data<double>()[f.c.mask_token_id * f.c.hidden_size + k] += 1.0;
  const Tensor pert = hidden_of(f.c, f.w, p, f.b, o);
  bool row0_blind = true;
  for (int64_t blk = 0; blk < 4; ++blk) {
    EXPECT_GT(block_diff(base, pert, blk, 4, 3), 1e-6) << "the last row reads the mask embedding";
    row0_blind = row0_blind && block_diff(base, pert, blk, 4, 0) == 0;
  }
  return row0_blind;
}

// Σ w·CE / Σ w by hand from the final hidden states, labels token[a + k] (k >= 1), weights
// [a+k < S]·loss_mask[a+k]·exp(-(k-1)/gamma): compares the model's loss with that.
bool labels_shifted(int64_t shift) {
  MaskFixture f;
  StepOptions o;
  o.label_shift = shift;
  Tensor hf;
  const StepStats st = forward_backward(f.c, f.w, f.t, f.b, o, nullptr, nullptr, &hf);
  const int64_t B = 4, H = f.c.hidden_size, V = f.c.vocab_size;
  double num = 0, den = 0;
  for (size_t bi = 0; bi < f.b.blocks.size(); ++bi) {
    const Block& blk = f.b.blocks[bi];
    const int64_t off = f.b.seqs.offsets[blk.seq], S = f.b.seqs.offsets[blk.seq + 1] - off;
    for (int64_t k = 1; k < B; ++k) {
      const int64_t p = blk.anchor + k;
      if (p >= S || !f.b.loss_mask[off + p]) continue;
      const double wgt = std::exp(-(k - 1) / 7.0);
      std::vector<double> z(V);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        double s = 0;
        for (int64_t c = 0; c < H; ++c)
          s += hf.data<double>()[(bi * B + k) * H + c] * f.t.lm_head.data<double>()[v * H + c];
        mx = std::max(mx, z[v] = s);
      }
      double se = 0;
      for (double x : z) se += std::exp(x - mx);
      num += wgt * (mx + std::log(se) - z[f.b.tokens[off + p]]);
      den += wgt;
    }
  }
  EXPECT_NEAR(st.weight_sum, den, shift == 0 ? 1e-12 : 1e9);
  return std::abs(st.loss() - num / den) > 1e-10;
}
}  // namespace

TEST(DrafterMask, ContextStopsStrictlyBeforeTheAnchor) {
  EXPECT_FALSE(anchor_leaks(MaskVariant::Correct));
  EXPECT_TRUE(anchor_leaks(MaskVariant::AnchorInclusive)) << "the test must catch the <= bug";
}

TEST(DrafterMask, FullLayersSeeTheWholeBlock) {
  EXPECT_FALSE(causal_in_block(MaskVariant::Correct));
  EXPECT_TRUE(causal_in_block(MaskVariant::CausalInBlock)) << "the test must catch a causal in-block mask";
  // Sliding layers are causal in the block: with no full layer, row 0 is blind to later rows.
  EXPECT_TRUE(causal_in_block(MaskVariant::Correct, {AttnType::Sliding, AttnType::Sliding}));
}

TEST(DrafterMask, LabelsAreTheTokensAtAnchorPlusK) {
  EXPECT_FALSE(labels_shifted(0));
  EXPECT_TRUE(labels_shifted(1)) << "the test must catch shifted labels";
  EXPECT_TRUE(labels_shifted(-1));
  const std::vector<uint8_t> m(10, 1);
  for (int64_t k = 1; k < 4; ++k) EXPECT_EQ(block_label(m.data(), 10, 3, k, 7.0).position, 3 + k);
  EXPECT_EQ(block_label(m.data(), 10, 3, 0, 7.0).weight, 0.0) << "the anchor itself is never predicted";
}

TEST(DrafterMask, NoOtherBlockAndNoOtherSequence) {
  MaskFixture f;
  const Tensor base = hidden_of(f.c, f.w, f.t, f.b);
  // Another anchor token for block 2 (anchor 9): blocks 0, 1 and 3 unchanged, block 2 changed.
  DrafterBatch p = f.b;
  p.tokens[9] = 35;
  const Tensor h1 = hidden_of(f.c, f.w, f.t, p);
  EXPECT_EQ(block_diff(base, h1, 0, 4), 0);
  EXPECT_EQ(block_diff(base, h1, 1, 4), 0);
  EXPECT_EQ(block_diff(base, h1, 3, 4), 0);
  EXPECT_GT(block_diff(base, h1, 2, 4), 1e-6);
  // Context of sequence 1 changed: the blocks of sequence 0 are unchanged.
  p = f.b;
  p.context = f.b.context.clone();
  for (int64_t n = 12; n < 19; ++n)
    for (int64_t k = 0; k < p.context.size(1); ++k) p.context.data<double>()[n * p.context.size(1) + k] += 1.0;
  const Tensor h2 = hidden_of(f.c, f.w, f.t, p);
  for (int64_t blk = 0; blk < 3; ++blk) EXPECT_EQ(block_diff(base, h2, blk, 4), 0);
  EXPECT_GT(block_diff(base, h2, 3, 4), 1e-6);
}

// ---------------------------------------------------------------- loss, anchors, CE

TEST(DrafterLoss, WeightsByHand) {
  const std::vector<uint8_t> m = {0, 1, 1, 1, 0, 1};  // S = 6
  const double g = 2.0;
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 1, 1, g).weight, 1.0);             // pos 2
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 1, 2, g).weight, std::exp(-0.5));  // pos 3
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 1, 3, g).weight, 0.0);             // pos 4: loss_mask 0
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 3, 2, g).weight, std::exp(-0.5));  // pos 5
  EXPECT_EQ(block_label(m.data(), 6, 3, 3, g).position, -1);                   // pos 6 >= S
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 3, 3, g).weight, 0.0);
  EXPECT_DOUBLE_EQ(block_label(m.data(), 6, 0, 6, 7.0).weight, 0.0);  // pos 6 >= S

  // Σ w of a forward over the tiny batch, by hand (gamma 7, B 4).
  MaskFixture f;
  const StepStats st = forward_backward(f.c, f.w, f.t, f.b, {});
  const double e1 = std::exp(-1 / 7.0), e2 = std::exp(-2 / 7.0);
  // seq 0, anchor 2: pos 3,4,5 -> 1 + e1 + e2; anchor 6: pos 7 masked, 8, 9 -> e1 + e2;
  // anchor 9: pos 10, 11, (12 >= S) -> 1 + e1; seq 1 anchor 1: pos 2,3,4 -> 1 + e1 + e2.
  EXPECT_NEAR(st.weight_sum, 3 + 4 * e1 + 3 * e2, 1e-12);
  EXPECT_EQ(st.num_blocks, 4);
  EXPECT_EQ(st.counted[1], 3);
  EXPECT_EQ(st.counted[3], 3);
  EXPECT_GE(st.accept_len(), 1.0);
}

TEST(DrafterLoss, AnchorsSampledWithoutReplacementSorted) {
  std::vector<uint8_t> m(40, 1);
  m[0] = m[10] = m[11] = m[25] = 0;
  std::vector<int64_t> cand;
  for (int64_t t = 0; t + 1 < 40; ++t)
    if (m[t] && m[t + 1]) cand.push_back(t);
  EXPECT_EQ(sample_anchors(m.data(), 40, 1000, 1, 2), cand) << "fewer candidates than asked: all of them";
  const auto a = sample_anchors(m.data(), 40, 8, 1, 2);
  ASSERT_EQ(a.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(std::find(cand.begin(), cand.end(), a[i]) != cand.end()) << a[i];
    if (i) {
      EXPECT_LT(a[i - 1], a[i]) << "sorted, no repeats";
    }
  }
  EXPECT_EQ(a, sample_anchors(m.data(), 40, 8, 1, 2)) << "seeded";
  EXPECT_NE(a, sample_anchors(m.data(), 40, 8, 2, 2));
  EXPECT_NE(a, sample_anchors(m.data(), 40, 8, 1, 3));
  // Every candidate gets drawn with roughly equal frequency.
  std::vector<int> hits(40, 0);
  for (uint64_t s = 0; s < 2000; ++s)
    for (int64_t t : sample_anchors(m.data(), 40, 4, s, 0)) ++hits[t];
  const double expect = 2000.0 * 4 / static_cast<double>(cand.size());
  for (int64_t t : cand) EXPECT_NEAR(hits[t], expect, 0.25 * expect) << t;
}

// make_batch / add_block_weights against the loop dflash_train ran inline before they existed (copied
// here as the reference): the same blocks on every TP shard and the same Σw, bit for bit, whatever
// the seed, step and shard count; the shards' blocks are disjoint and together all of them.
TEST(DrafterBatch, MatchesTheTrainersRoundRobinBitForBit) {
  const int64_t B = 5;
  const double gamma = 3.0;
  for (uint64_t seed : {0ull, 7ull, 123456789ull}) {
    std::vector<std::vector<int32_t>> ids;
    std::vector<std::vector<uint8_t>> masks;
    std::vector<int64_t> indices;
    for (int64_t s = 0; s < 5; ++s) {
      const int64_t S = 3 + 17 * s + static_cast<int64_t>(seed % 5);
      Tensor u = Tensor::empty({S}, DType::F32);
      fill_uniform(u, {seed, 9 + static_cast<uint64_t>(s), 0}, 0.0f, 1.0f);
      ids.emplace_back(), masks.emplace_back();
      for (int64_t n = 0; n < S; ++n) {
        ids.back().push_back(static_cast<int32_t>(u.data<float>()[n] * 1000.0f));
        masks.back().push_back(u.data<float>()[n] < 0.7f ? 1 : 0);
      }
      indices.push_back(1000 * s + 3);
    }
    for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{41}}) {
      for (int tp : {1, 2, 3}) {
        std::vector<Block> all;
        for (int rank = 0; rank < tp; ++rank) {
          // The reference: train.cpp's micro-batch loop as it was.
          std::vector<Block> want;
          double want_w = 0.25;
          int64_t blk = 0;
          for (size_t s = 0; s < ids.size(); ++s) {
            const int64_t S = static_cast<int64_t>(ids[s].size());
            const uint64_t stream = (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(indices[s]);
            for (int64_t a : sample_anchors(masks[s].data(), S, 4, seed, stream)) {
              if (blk++ % tp != rank) continue;
              want.push_back({static_cast<int64_t>(s), a});
              for (int64_t k = 1; k < B; ++k) want_w += block_label(masks[s].data(), S, a, k, gamma).weight;
            }
          }
          std::vector<BatchSequence> in;
          for (size_t s = 0; s < ids.size(); ++s)
            in.push_back({ids[s], masks[s], (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(indices[s])});
          const DrafterBatch b = make_batch(in, {4, seed, rank, tp});
          ASSERT_EQ(b.blocks.size(), want.size()) << "seed " << seed << " step " << step << " rank " << rank << "/" << tp;
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_EQ(b.blocks[i].seq, want[i].seq);
            EXPECT_EQ(b.blocks[i].anchor, want[i].anchor);
          }
          const double w = add_block_weights(b, B, gamma, 0.25);
          EXPECT_EQ(std::memcmp(&w, &want_w, sizeof w), 0) << w << " vs " << want_w;
          ASSERT_EQ(b.seqs.num_sequences(), 5);
          for (size_t s = 0; s < ids.size(); ++s) {
            const int64_t off = b.seqs.offsets[s];
            EXPECT_TRUE(std::equal(ids[s].begin(), ids[s].end(), b.tokens.begin() + off));
            EXPECT_TRUE(std::equal(masks[s].begin(), masks[s].end(), b.loss_mask.begin() + off));
          }
          all.insert(all.end(), b.blocks.begin(), b.blocks.end());
        }
        const DrafterBatch whole = make_batch(
            [&] {
              std::vector<BatchSequence> in;
              for (size_t s = 0; s < ids.size(); ++s)
                in.push_back({ids[s], masks[s], (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(indices[s])});
              return in;
            }(),
            {4, seed});
        EXPECT_EQ(all.size(), whole.blocks.size()) << "the shards together hold every block once";
      }
    }
  }
  EXPECT_TRUE(make_batch({}, {4, 1}).blocks.empty()) << "an empty batch has no blocks";
  EXPECT_THROW(sample_blocks({1, 1}, ops::SeqOffsets{{0, 2}}, {0}, {4, 1, 2, 2}), Error) << "shard 2 of 2";
}

TEST(DrafterLoss, ChunkedCeEqualsUnchunked) {
  const int64_t R = 10, H = 16, V = 37;
  const Tensor hid = randn64({R, H}), head = randn64({V, H}, 0.0f, 0.5f, DType::F32);
  std::vector<int32_t> labels;
  std::vector<double> w;
  for (int64_t r = 0; r < R; ++r) {
    labels.push_back(static_cast<int32_t>((r * 11 + 5) % V));
    w.push_back(r % 4 == 3 ? 0.0 : 0.3 + 0.1 * r);
  }
  // Unchunked, by hand: full [R, V] logits.
  double num = 0, den = 0;
  std::vector<double> dref(R * H, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    if (w[r] == 0) continue;
    std::vector<double> z(V);
    for (int64_t v = 0; v < V; ++v) {
      z[v] = 0;
      for (int64_t c = 0; c < H; ++c) z[v] += hid.data<double>()[r * H + c] * head.data<float>()[v * H + c];
    }
    double mx = *std::max_element(z.begin(), z.end()), se = 0;
    for (double x : z) se += std::exp(x - mx);
    const double lse = mx + std::log(se);
    num += w[r] * (lse - z[labels[r]]);
    den += w[r];
    for (int64_t v = 0; v < V; ++v) {
      const double gz = w[r] * 0.5 * (std::exp(z[v] - lse) - (v == labels[r]));
      for (int64_t c = 0; c < H; ++c) dref[r * H + c] += gz * head.data<float>()[v * H + c];
    }
  }
  for (int64_t chunk : {1, 3, 10, 64}) {
    std::vector<double> dh(R * H, 0.0);
    std::vector<int32_t> am;
    const CeSums s = fused_linear_ce(hid.data<double>(), R, H, head, labels, w, chunk, 0.5, dh.data(), &am);
    EXPECT_NEAR(s.weighted_ce_sum, num, 1e-12 * std::abs(num)) << chunk;
    EXPECT_NEAR(s.weight_sum, den, 1e-12) << chunk;
    double md = 0;
    for (size_t i = 0; i < dh.size(); ++i) md = std::max(md, std::abs(dh[i] - dref[i]));
    EXPECT_LT(md, 1e-12) << chunk;
    EXPECT_EQ(am[3], -1) << "rows of weight 0 are skipped";
  }
  // Through the model: the chunk size does not change the loss or the gradients.
  MaskFixture f;
  StepOptions a, b;
  a.ce_chunk_rows = 1;
  b.ce_chunk_rows = 1000;
  DrafterWeights ga = DrafterWeights::zeros(f.c, DType::F64), gb = DrafterWeights::zeros(f.c, DType::F64);
  EXPECT_NEAR(forward_backward(f.c, f.w, f.t, f.b, a, &ga).loss(), forward_backward(f.c, f.w, f.t, f.b, b, &gb).loss(), 1e-13);
  EXPECT_LT(max_rel_err(ga.fc, gb.fc), 1e-12);
}

// ---------------------------------------------------------------- config

TEST(DrafterConfig, DefaultTargetLayerIdsFollowZLab) {
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(64, 5), (std::vector<int64_t>{1, 16, 31, 46, 61}));
  EXPECT_EQ(default_target_layer_ids(10, 5), (std::vector<int64_t>{1, 2, 4, 6, 7})) << "Python round: half to even";
  EXPECT_EQ(default_target_layer_ids(36, 1), (std::vector<int64_t>{18}));
}

TEST(DrafterConfig, JsonRoundTripAndDefaults) {
  const DrafterConfig c = tiny_config();
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j["architectures"][0], "DFlashDraftModel");
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["dflash_config"]["mask_token_id"], 36);
  const DrafterConfig r = DrafterConfig::from_json(j, "rt");
  EXPECT_EQ(r.to_json(), j);
  nlohmann::json k = j;
  k["dflash_config"].erase("target_layer_ids");
  k.erase("layer_types");
  k["num_target_layers"] = 36;
  const DrafterConfig d = DrafterConfig::from_json(k, "defaults");
  EXPECT_EQ(d.target_layer_ids, (std::vector<int64_t>{1, 33}));
  EXPECT_EQ(d.layer_types, (std::vector<AttnType>{AttnType::Full, AttnType::Full}));
}

TEST(DrafterConfig, BadConfigsNameTheField) {
  const nlohmann::json good = tiny_config().to_json();
  auto err = [&](auto edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { DrafterConfig::from_json(j, "cfg.json"); });
  };
  EXPECT_NE(err([](auto& j) { j["dflash_config"].erase("mask_token_id"); }).find("dflash_config.mask_token_id"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["dflash_config"]["mask_token_id"] = 37; }).find("dflash_config.mask_token_id"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["dflash_config"]["target_layer_ids"] = {1, 6}; }).find("target_layer_ids[1]"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["layer_types"] = {"full_attention"}; }).find("layer_types"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["layer_types"][1] = "linear_attention"; }).find("layer_types[1]"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["sliding_window"] = nullptr; }).find("sliding_window"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["num_key_value_heads"] = 3; }).find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["architectures"] = {"Qwen3ForCausalLM"}; }).find("architectures"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["model_type"] = "llama"; }).find("model_type"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j.erase("hidden_size"); }).find("'hidden_size' is missing"), std::string::npos);
  EXPECT_NE(err([](auto& j) { j["block_size"] = 1; }).find("block_size"), std::string::npos);
  EXPECT_EQ(err([](auto&) {}), "");
}

// ---------------------------------------------------------------- export / import

namespace {
std::string tmp_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("dflash_test_drafter_" + name);
  std::filesystem::remove_all(p);
  return p.string();
}
std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

TEST(DrafterExport, RoundTripIsBitExactInBf16) {
  const DrafterConfig c = tiny_config();
  DrafterWeights w = DrafterWeights::random(c, 42, 0.5f, DType::F32);
  const std::string dir = tmp_dir("rt");
  export_hf(dir, c, w);
  LoadedDrafter l = import_hf(dir, DType::F32);
  EXPECT_EQ(l.config.to_json(), c.to_json());
  auto a = w.entries(c), b = l.weights.entries(c);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor want = a[i].tensor->to_dtype(DType::BF16).to_dtype(DType::F32);
    ASSERT_EQ(b[i].tensor->shape(), want.shape()) << a[i].name;
    EXPECT_EQ(std::memcmp(want.raw_data(), b[i].tensor->raw_data(), want.nbytes()), 0) << a[i].name;
  }
  const io::SafetensorsFile f((std::filesystem::path(dir) / "model.safetensors").string());
  EXPECT_EQ(f.size(), a.size());
  EXPECT_EQ(f.info("layers.1.self_attn.q_norm.weight").dtype, DType::BF16);
  EXPECT_TRUE(f.has("fc.weight") && f.has("hidden_norm.weight") && f.has("norm.weight"));
  // Export of the imported weights: the same bytes.
  const std::string dir2 = tmp_dir("rt2");
  export_hf(dir2, l.config, l.weights);
  EXPECT_EQ(slurp(dir + "/model.safetensors"), slurp(dir2 + "/model.safetensors"));
  EXPECT_EQ(slurp(dir + "/config.json"), slurp(dir2 + "/config.json"));
}

TEST(DrafterExport, BadCheckpointListsNames) {
  const DrafterConfig c = tiny_config();
  DrafterWeights w = DrafterWeights::random(c, 1);
  const std::string dir = tmp_dir("bad");
  export_hf(dir, c, w);
  std::vector<std::pair<std::string, Tensor>> t;
  for (auto& e : w.entries(c)) {
    if (e.name == "layers.0.mlp.up_proj.weight") continue;  // missing
    if (e.name == "norm.weight") t.emplace_back(e.name, Tensor::zeros({3}, DType::BF16));  // mis-shaped
    else t.emplace_back(e.name, e.tensor->to_dtype(DType::BF16));
  }
  t.emplace_back("lm_head.weight", Tensor::zeros({2, 2}, DType::BF16));  // unexpected
  io::save_safetensors(dir + "/model.safetensors", t);
  const std::string e = error_of([&] { import_hf(dir); });
  EXPECT_NE(e.find("missing (1): layers.0.mlp.up_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("unexpected (1): lm_head.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("mis-shaped (1): norm.weight [3] (expected [16])"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { import_hf(tmp_dir("nothing")); }), "");
}

TEST(Drafter, BadInputsAreRefused) {
  MaskFixture f;
  DrafterBatch b = f.b;
  b.blocks = {{0, 6}, {0, 2}};
  EXPECT_NE(error_of([&] { forward_backward(f.c, f.w, f.t, b, {}); }).find("sorted"), std::string::npos);
  b = f.b;
  b.blocks = {{0, 12}};
  EXPECT_NE(error_of([&] { forward_backward(f.c, f.w, f.t, b, {}); }).find("anchor 12"), std::string::npos);
  b = f.b;
  b.tokens[4] = 37;
  EXPECT_NE(error_of([&] { forward_backward(f.c, f.w, f.t, b, {}); }).find("outside the vocabulary"), std::string::npos);
  b = f.b;
  b.context = randn64({19, 16});
  EXPECT_NE(error_of([&] { forward_backward(f.c, f.w, f.t, b, {}); }).find("context"), std::string::npos);
}

// An independent PyTorch implementation (tests/reference/make_drafter_reference.py: float64,
// autograd, torch 2.11 on the GPU machine's CPU) on fixed inputs: two sequences, five blocks of 4
// (some running past the sequence end), a full and a sliding layer. The C++ CPU reference must give
// the same loss and the same gradient for every parameter and for the context features.
TEST(DrafterReference, MatchesPyTorchAutograd) {
  const std::string dir = std::string(DFLASH_TEST_DATA_DIR) + "/drafter_ref";
  LoadedDrafter d = import_hf(dir, DType::F64);
  auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  auto f64 = [&](const std::string& n) { return ref.tensor(n).to_dtype(DType::F64); };
  DrafterBatch batch;
  batch.context = f64("context");
  const Tensor tokens = ref.tensor("tokens"), mask = ref.tensor("loss_mask"), offsets = ref.tensor("offsets"),
               blocks = ref.tensor("blocks");
  batch.tokens.assign(tokens.data<int32_t>(), tokens.data<int32_t>() + tokens.numel());
  batch.loss_mask.assign(mask.data<uint8_t>(), mask.data<uint8_t>() + mask.numel());
  batch.seqs.offsets.assign(offsets.data<int64_t>(), offsets.data<int64_t>() + offsets.numel());
  for (int64_t b = 0; b < blocks.size(0); ++b)
    batch.blocks.push_back({blocks.data<int64_t>()[2 * b], blocks.data<int64_t>()[2 * b + 1]});
  FrozenTarget target{f64("embed_tokens"), f64("lm_head")};
  StepOptions opt;
  opt.gamma = 7.0;
  opt.ce_chunk_rows = 3;  // several chunks, the last one partial
  DrafterWeights grads = DrafterWeights::zeros(d.config, DType::F64);
  Tensor grad_context;
  const StepStats st = forward_backward(d.config, d.weights, target, batch, opt, &grads, &grad_context);
  const double torch_loss = f64("loss").data<double>()[0];
  EXPECT_NEAR(st.loss(), torch_loss, 1e-12 * std::abs(torch_loss)) << "loss";
  double worst = max_rel_err(grad_context, f64("grad.context"));
  EXPECT_LE(worst, 1e-10) << "grad.context";
  for (const auto& e : grads.entries(d.config)) {
    const double err = max_rel_err(*e.tensor, f64("grad." + e.name));
    EXPECT_LE(err, 1e-10) << "grad." << e.name;
    worst = std::max(worst, err);
  }
  std::printf("drafter vs PyTorch autograd (float64): loss %.15f vs %.15f, worst gradient max rel err %.2e\n", st.loss(),
              torch_loss, worst);
}

// The FLOP count behind the MFU figures: the attention term counted key by key through the mask
// itself (mask_allows), the GEMM terms from the shapes, forward and backward multipliers as stated.
TEST(DrafterFlops, CountsMatchTheMaskAndTheShapes) {
  const DrafterConfig c = tiny_config();  // full + sliding (window 5), B = 4
  DrafterBatch b;
  b.seqs.offsets = {0, 20, 31};
  b.context = Tensor::zeros({31, c.context_dim()}, DType::F32);
  b.blocks = {{0, 0}, {0, 3}, {0, 17}, {1, 9}};
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double qd = static_cast<double>(c.q_dim()), kvd = static_cast<double>(c.kv_dim()), N = 31;
  const double R = static_cast<double>(b.blocks.size() * c.block_size);
  double fwd = 2 * N * static_cast<double>(c.context_dim()) * H + 2 * R * H * static_cast<double>(c.vocab_size);
  double bwd = 2 * fwd;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    double keys = 0;
    for (const Block& blk : b.blocks) {
      const int64_t S = b.seqs.offsets[blk.seq + 1] - b.seqs.offsets[blk.seq];
      for (int64_t j = 0; j < c.block_size; ++j) {
        for (int64_t t = 0; t < S; ++t) keys += mask_allows(c.layer_types[l], c.sliding_window, blk.anchor, j, false, t);
        for (int64_t jj = 0; jj < c.block_size; ++jj)
          keys += mask_allows(c.layer_types[l], c.sliding_window, blk.anchor, j, true, jj);
      }
    }
    const double gemm = 2 * R * H * (qd + 2 * kvd) + 2 * N * H * 2 * kvd + 2 * R * qd * H + 2 * R * H * 3 * I;
    const double attn = 4.0 * static_cast<double>(c.head_dim * c.num_attention_heads) * keys;
    fwd += gemm + attn;
    bwd += 3 * gemm + 3.5 * attn;
  }
  EXPECT_DOUBLE_EQ(step_flops(c, b, false), fwd);
  EXPECT_DOUBLE_EQ(step_flops(c, b, true), bwd);
}

// ---------------------------------------------------------------- proposer (speculative decoding)

namespace {

// The proposer's fixture: tiny_config with blocks of 8 (the sliding window of 5 then cuts inside
// the block), a pool of 4 slots; four sequences with n = 13, 6, 21 and 0 context positions in slots
// 2, 0, 3, 1 (not the identity), their features and block start tokens.
struct DecodeFixture {
  DrafterConfig c = [] {
    DrafterConfig c = tiny_config();
    c.block_size = 8;
    c.validate();
    return c;
  }();
  DrafterWeights w = tiny_weights(c);
  FrozenTarget t = tiny_target(c);
  std::vector<int32_t> slots{2, 0, 3, 1};
  std::vector<int64_t> n{13, 6, 21, 0};
  std::vector<Tensor> features;  // [n_s + 1, k·H]: the context, and the block start's own row
  std::vector<int32_t> x_start{5, 17, 30, 2};
  static constexpr int64_t kSlots = 4, kMaxLen = 40;

  DecodeFixture() {
    for (int64_t len : n) features.push_back(randn64({len + 1, c.context_dim()}));
  }
  // Every sequence's whole context in one add_context call.
  std::unique_ptr<Proposer> filled() const {
    auto p = make_cpu_proposer(c, w, t, kSlots, kMaxLen);
    ops::SeqOffsets seqs{{0}};
    std::vector<Tensor> parts;
    for (size_t s = 0; s < n.size(); ++s) {
      parts.push_back(features[s].slice(0, 0, n[s]));
      seqs.offsets.push_back(seqs.offsets.back() + n[s]);
    }
    p->add_context(slots, concat_rows(parts), seqs);
    return p;
  }
  static Tensor concat_rows(const std::vector<Tensor>& parts) {
    int64_t rows = 0;
    for (const Tensor& x : parts) rows += x.size(0);
    Tensor out = Tensor::empty({rows, parts.at(0).size(1)}, DType::F64);
    int64_t at = 0;
    for (const Tensor& x : parts) {
      if (x.size(0)) out.slice(0, at, at + x.size(0)).copy_from(x);
      at += x.size(0);
    }
    return out;
  }
  // The training forward's logits of every block row: one batch of the four sequences (context
  // rows 0..n_s, token n_s = x_start), one block per sequence at anchor n_s, blocks of Bp rows;
  // logits = final_hidden · lm_headᵀ.
  Tensor training_logits(int64_t Bp) const {
    const Tensor hf = training_hidden(Bp);
    const int64_t R = hf.size(0), H = c.hidden_size, V = c.vocab_size;
    Tensor lg = Tensor::empty({R, V}, DType::F64);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0;
        for (int64_t k = 0; k < H; ++k) acc += hf.data<double>()[r * H + k] * t.lm_head.data<double>()[v * H + k];
        lg.data<double>()[r * V + v] = acc;
      }
    return lg;
  }
  // The training forward's final hidden states of those blocks.
  Tensor training_hidden(int64_t Bp, StepOptions o = {}) const {
    DrafterConfig cb = c;
    cb.block_size = Bp;
    DrafterBatch b;
    b.seqs.offsets = {0};
    std::vector<Tensor> parts;
    for (size_t s = 0; s < n.size(); ++s) {
      parts.push_back(features[s]);
      for (int64_t i = 0; i <= n[s]; ++i) b.tokens.push_back(i == n[s] ? x_start[s] : static_cast<int32_t>((i * 5 + s) % 36));
      b.seqs.offsets.push_back(b.seqs.offsets.back() + n[s] + 1);
      b.blocks.push_back({static_cast<int64_t>(s), n[s]});
    }
    b.context = concat_rows(parts);
    b.loss_mask.assign(b.tokens.size(), 1);
    return hidden_of(cb, w, t, b, o);
  }
};

}  // namespace

// Every block row's logits (and so every draft) are the training forward's for the same block:
// full and sliding layers, blocks of 2, 4 and the drafter's 8, four slots in a permuted order, one
// of them with no context at all.
TEST(DrafterDecode, ProposeEqualsTheTrainingForward) {
  DecodeFixture f;
  auto p = f.filled();
  for (int64_t Bp : {2, 4, 8}) {
    Tensor logits;
    const auto drafts = p->propose(f.slots, f.x_start, Bp, &logits);
    const Tensor ref = f.training_logits(Bp);
    const double err = max_rel_err(logits, ref);
    std::printf("  block %ld: propose logits vs training forward, max rel err %.2e\n", static_cast<long>(Bp), err);
    EXPECT_LE(err, 1e-6) << "block " << Bp;
    std::vector<int32_t> top;
    ops::argmax_rows(ref, top);
    ASSERT_EQ(drafts.size(), f.slots.size());
    for (size_t s = 0; s < f.slots.size(); ++s) {
      ASSERT_EQ(static_cast<int64_t>(drafts[s].size()), Bp - 1);
      for (int64_t j = 1; j < Bp; ++j) EXPECT_EQ(drafts[s][j - 1], top[s * Bp + j]) << "slot " << f.slots[s] << " row " << j;
    }
    for (size_t s = 0; s < f.slots.size(); ++s) EXPECT_EQ(p->context_length(f.slots[s]), f.n[s]) << "propose changed a context";
  }
}

// The float proposer (DrafterMath::F32, the CPU default of dflash_eval) gives, bit for bit, the logits of
// the float training forward for the same blocks (its final hidden states through the same GEMM): what
// makes dflash_eval's estimate "at the same blocks" equal the measured tau on the CPU. Context in two
// pieces, blocks of 2 and 8.
TEST(DrafterDecode, F32ProposeEqualsTheF32TrainingForwardBitForBit) {
  DecodeFixture f;
  auto p = make_cpu_proposer(f.c, f.w, f.t, DecodeFixture::kSlots, DecodeFixture::kMaxLen, DrafterMath::F32);
  for (int piece = 0; piece < 2; ++piece) {
    ops::SeqOffsets seqs{{0}};
    std::vector<Tensor> parts;
    for (size_t s = 0; s < f.n.size(); ++s) {
      const int64_t half = f.n[s] / 2, b0 = piece ? half : 0, b1 = piece ? f.n[s] : half;
      parts.push_back(f.features[s].slice(0, b0, b1));
      seqs.offsets.push_back(seqs.offsets.back() + b1 - b0);
    }
    p->add_context(f.slots, DecodeFixture::concat_rows(parts), seqs);
  }
  const Tensor head = f.t.lm_head.to_dtype(DType::F32);
  for (int64_t Bp : {2, 8}) {
    Tensor logits;
    const auto drafts = p->propose(f.slots, f.x_start, Bp, &logits);
    StepOptions o;
    o.math = DrafterMath::F32;
    const Tensor hf = f.training_hidden(Bp, o).to_dtype(DType::F32);  // exact: float values held in double
    const int64_t R = hf.size(0), H = f.c.hidden_size, V = f.c.vocab_size;
    Tensor ref = Tensor::empty({R, V}, DType::F32);
    cpu::gemm_f32(cpu::Trans::N, cpu::Trans::T, R, V, H, hf.data<float>(), H, head.data<float>(), H, false,
                  ref.data<float>(), V);
    ASSERT_EQ(logits.numel(), ref.numel());
    for (int64_t i = 0; i < ref.numel(); ++i)
      ASSERT_EQ(logits.data<float>()[i], ref.data<float>()[i]) << "block " << Bp << " logit " << i;
    std::vector<int32_t> top;
    ops::argmax_rows(ref, top);
    for (size_t s = 0; s < f.slots.size(); ++s)
      for (int64_t j = 1; j < Bp; ++j) EXPECT_EQ(drafts[s][j - 1], top[s * Bp + j]) << "slot " << f.slots[s] << " row " << j;
  }
}

// Context added in pieces of 1, 2, 3, 7 and 5 rows (each call covering some of the slots, in a
// changing order) gives exactly the same proposals as the whole context at once; reset empties a
// slot, and refilling it gives the same again.
TEST(DrafterDecode, ContextInPiecesEqualsAllAtOnce) {
  DecodeFixture f;
  Tensor whole, pieces;
  f.filled()->propose(f.slots, f.x_start, 8, &whole);
  auto p = make_cpu_proposer(f.c, f.w, f.t, DecodeFixture::kSlots, DecodeFixture::kMaxLen);
  const std::vector<int64_t> sizes{1, 2, 3, 7, 5};
  std::vector<int64_t> done(f.n.size(), 0);
  for (int call = 0; done != f.n; ++call) {
    std::vector<int32_t> slots;
    std::vector<Tensor> parts;
    ops::SeqOffsets seqs{{0}};
    for (size_t k = 0; k < f.n.size(); ++k) {
      const size_t s = (k + static_cast<size_t>(call)) % f.n.size();  // a rotating slot order
      const int64_t T = std::min(sizes[(call + s) % sizes.size()], f.n[s] - done[s]);
      if (T == 0 && (call + s) % 2) continue;  // sometimes a slot with nothing left is left out, sometimes sent T = 0
      slots.push_back(f.slots[s]);
      parts.push_back(f.features[s].slice(0, done[s], done[s] + T));
      seqs.offsets.push_back(seqs.offsets.back() + T);
      done[s] += T;
    }
    p->add_context(slots, DecodeFixture::concat_rows(parts), seqs);
  }
  p->propose(f.slots, f.x_start, 8, &pieces);
  const double err = max_rel_err(pieces, whole);
  std::printf("  context in pieces vs all at once: max rel err %.2e\n", err);
  EXPECT_EQ(err, 0.0);
  p->reset(f.slots[0]);
  EXPECT_EQ(p->context_length(f.slots[0]), 0);
  p->add_context({f.slots[0]}, f.features[0].slice(0, 0, f.n[0]).contiguous(), {{0, f.n[0]}});
  Tensor again;
  p->propose(f.slots, f.x_start, 8, &again);
  EXPECT_EQ(max_rel_err(again, whole), 0.0) << "reset + refill";
}

TEST(DrafterDecode, BadInputsNameTheThing) {
  DecodeFixture f;
  auto p = f.filled();
  auto err = [](const std::function<void()>& fn, const std::string& want) {
    const std::string e = error_of(fn);
    EXPECT_NE(e.find(want), std::string::npos) << "expected '" << want << "', got '" << e << "'";
  };
  err([&] { p->propose({2}, {5}, 9); }, "block_size 9 is outside [2, 8] (the drafter's block_size)");
  err([&] { p->propose({2}, {5}, 1); }, "block_size 1 is outside [2, 8]");
  err([&] { p->propose({4}, {5}, 4); }, "propose: slot 4 is outside the pool of 4 slots");
  err([&] { p->propose({-1}, {5}, 4); }, "slot -1 is outside the pool of 4 slots");
  err([&] { p->propose({2, 2}, {5, 5}, 4); }, "slot 2 appears twice in one call");
  err([&] { p->propose({2}, {5, 6}, 4); }, "2 start tokens for 1 slots");
  err([&] { p->propose({2}, {37}, 4); }, "start token 37 of slot 2 is outside the vocabulary [0, 37)");
  err([&] { p->reset(7); }, "reset: slot 7 is outside the pool of 4 slots");
  err([&] { p->context_length(4); }, "context_length: slot 4 is outside the pool of 4 slots");
  const Tensor rows = randn64({20, f.c.context_dim()});
  err([&] { p->add_context({4}, rows, {{0, 20}}); }, "add_context: slot 4 is outside the pool of 4 slots");
  err([&] { p->add_context({3}, rows, {{0, 20}}); }, "add_context: slot 3 holds 21 context positions; 20 more exceed max_len 40");
  err([&] { p->add_context({0}, randn64({2, f.c.hidden_size}), {{0, 2}}); },
      "add_context: features must be [N, 32] (k = 2 captured layers × hidden 16), got f64[2, 16]");
  err([&] { p->add_context({0, 1}, rows, {{0, 20}}); }, "2 slots for 1 sequences");
  EXPECT_EQ(p->context_length(3), 21) << "a refused call changed the slot";
  // A block beyond max_len: slot 3 holds 21 + 16 = 37 positions; a block of 4 would end at 41 > 40.
  p->add_context({3}, rows.slice(0, 0, 16).contiguous(), {{0, 16}});
  err([&] { p->propose({3}, {5}, 4); }, "propose: slot 3 holds 37 context positions; a block of 4 beyond them exceeds max_len 40");
  EXPECT_NO_THROW(p->propose({3}, {5}, 3));
  err([&] { make_cpu_proposer(f.c, f.w, f.t, 4, 7); }, "max_len 7 must hold at least one block (block_size 8)");
}

TEST(ArgmaxRows, TiesGoToTheLowestIdAndNaNIsNeverChosen) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Row 0: a tie at 2 and 5; row 1: NaNs around a tie at 1 and 4; row 2: all NaN; row 3: all -inf;
  // row 4: equal values and a larger one at the end.
  const std::vector<float> v{0, 1, 3, -2, 1, 3, 0, 2,  nan, 4, nan, 1, 4, 0, 0, 0,  nan, nan, nan, nan, nan, nan, nan, nan,
                             -inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf,  7, 7, 7, 7, 7, 7, 7, 8};
  for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
    const Tensor x = Tensor::from_vector(v, {5, 8}, dt);
    std::vector<int32_t> out;
    ops::argmax_rows(x, out);
    EXPECT_EQ(out, (std::vector<int32_t>{2, 1, 0, 0, 7})) << dtype_name(dt);
  }
  // A strided view: the first 5 columns of each row.
  std::vector<int32_t> out;
  ops::argmax_rows(Tensor::from_vector(v, {5, 8}).slice(1, 0, 5), out);
  EXPECT_EQ(out, (std::vector<int32_t>{2, 1, 0, 0, 0}));
  EXPECT_NE(error_of([] {
              std::vector<int32_t> o;
              ops::argmax_rows(Tensor::zeros({3, 0}, DType::F32), o);
            }).find("V = 0 must be in [1, 2^31)"),
            std::string::npos);
}

// What loaders read from an exported config.json: the target's context (SGLang and vLLM size the
// drafter's RoPE from max_position_embeddings; Qwen3.6-27B has 262144), the dtype under `dtype`
// (transformers 5 warns about torch_dtype), and use_sliding_window beside sliding layers
// (transformers reads the window as None without it; SpecForge and SGLang refuse such a config).
TEST(DrafterConfigExport, CarriesTheTargetsContextTheDtypeAndTheSlidingFlag) {
  const std::string data = DFLASH_TEST_DATA_DIR;
  const target::TargetConfig t = target::TargetConfig::from_file(data + "/huge_target_config.json");
  ASSERT_EQ(t.max_position_embeddings, 262144);
  DrafterConfig c = DrafterConfig::for_target(t, 5, t.vocab_size - 1, 16);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  nlohmann::json j = c.to_json();
  EXPECT_EQ(j["max_position_embeddings"], 262144);
  EXPECT_EQ(j["dtype"], "bfloat16");
  EXPECT_FALSE(j.contains("torch_dtype"));
  EXPECT_EQ(j["use_sliding_window"], false);
  c.layer_types[1] = AttnType::Sliding;
  c.sliding_window = 2048;
  j = c.to_json();
  EXPECT_EQ(j["use_sliding_window"], true);
  EXPECT_EQ(j["sliding_window"], 2048);
  EXPECT_EQ(DrafterConfig::from_json(j, "round trip").max_position_embeddings, 262144);
  // The reference drafter (tests/reference/make_drafter_reference.py) has a sliding layer.
  std::ifstream f(data + "/drafter_ref/config.json");
  const nlohmann::json ref = nlohmann::json::parse(f);
  EXPECT_EQ(ref["use_sliding_window"], true);
  EXPECT_EQ(ref["sliding_window"], 6);
}
