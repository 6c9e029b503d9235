#include "bench/roofline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "core/tensor.h"
#include "drafter/weights.h"
#include "target_model/weights.h"

namespace dflash::bench {

namespace {
double numel(const Shape& s) { return static_cast<double>(shape_numel(s)); }
double blocks128(int64_t n) { return static_cast<double>((n + 127) / 128); }
}  // namespace

StepBytes target_step_bytes(const target::TargetConfig& c, target::Precision precision, int64_t seqs, int64_t tokens,
                            double context, bool fp8_experts) {
  DFLASH_CHECK(seqs >= 1 && tokens >= 1 && context >= 0,
               "target_step_bytes: seqs " << seqs << ", tokens " << tokens << ", context " << context);
  const bool fp8 = target::resolve_precision(precision, c) == target::Precision::Fp8;
  const double rows = static_cast<double>(seqs * tokens);
  const double H = static_cast<double>(c.hidden_size);
  StepBytes b;
  // Of the E experts, at most rows x top-k distinct ones are read.
  const double expert_share =
      c.is_moe() ? std::min(static_cast<double>(c.num_experts), rows * static_cast<double>(c.num_experts_per_tok)) /
                       static_cast<double>(c.num_experts)
                 : 1.0;
  for (const target::TensorSpec& t : target::expected_tensors(c)) {
    if (t.name == "embed_tokens.weight") {
      b.weights += rows * H * 2.0;  // one bf16 row a token
      if (c.tie_word_embeddings) b.weights += numel(t.shape) * 2.0;  // the tied lm_head reads it all
      continue;
    }
    double bytes;
    const bool expert = t.name.find(".mlp.experts.") != std::string::npos;
    if (fp8 && target::is_fp8_projection(t.name))
      bytes = numel(t.shape) + 4.0 * blocks128(t.shape[0]) * blocks128(t.shape[1]);
    else if (fp8_experts && expert)  // [E, rows, K]: codes and block scales (gate and up rows blocked apart)
      bytes = numel(t.shape) + 4.0 * static_cast<double>(t.shape[0]) *
                                   (t.name.ends_with("gate_up_proj") ? 2.0 * blocks128(t.shape[1] / 2) : blocks128(t.shape[1])) *
                                   blocks128(t.shape[2]);
    else
      bytes = numel(t.shape) * 2.0;
    if (expert) bytes *= expert_share;
    b.weights += bytes;
  }
  const double S = static_cast<double>(seqs);
  const double gdn = static_cast<double>(c.count_layers(target::LayerType::LinearAttention));
  const double attn = static_cast<double>(c.count_layers(target::LayerType::FullAttention));
  const double rec = 4.0 * static_cast<double>(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim);
  const double conv = 2.0 * static_cast<double>((c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim());
  b.state = S * gdn * 2.0 * (rec + conv);
  const double kv_row = 2.0 * 2.0 * static_cast<double>(c.num_key_value_heads * c.head_dim);  // K and V, bf16
  b.kv = S * attn * kv_row * (context + static_cast<double>(tokens));
  return b;
}

StepBytes propose_bytes(const drafter::DrafterConfig& dc, int64_t seqs, double context, bool fp8) {
  DFLASH_CHECK(seqs >= 1 && context >= 0, "propose_bytes: seqs " << seqs << ", context " << context);
  drafter::DrafterWeights w;
  w.layers.resize(static_cast<size_t>(dc.num_hidden_layers));
  StepBytes b;
  // A [N, K] projection: bf16, or e4m3 with F32 128 x 128 block scales.
  auto matrix = [&](double N, double K) {
    return fp8 ? N * K + 4.0 * std::ceil(N / 128.0) * std::ceil(K / 128.0) : 2.0 * N * K;
  };
  for (const drafter::DrafterWeights::Entry& e : w.entries(dc)) {
    if (e.name == "fc.weight" || e.name == "hidden_norm.weight") continue;  // add_context's
    b.weights += e.is_norm || e.shape.size() != 2 ? numel(e.shape) * 2.0
                                                  : matrix(static_cast<double>(e.shape[0]), static_cast<double>(e.shape[1]));
  }
  const double H = static_cast<double>(dc.hidden_size), S = static_cast<double>(seqs);
  const double B = static_cast<double>(dc.block_size);
  b.weights += matrix(static_cast<double>(dc.vocab_size), H);  // lm_head
  b.weights += S * B * H * 2.0;                               // the block's embedding rows
  const double kv_row = 2.0 * 2.0 * static_cast<double>(dc.kv_dim());
  b.kv = S * static_cast<double>(dc.num_hidden_layers) * kv_row * (context + B);
  return b;
}

std::string describe(const StepBytes& b) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%.2f GB weights + %.3f GB state + %.3f GB KV = %.2f GB", b.weights / 1e9, b.state / 1e9,
                b.kv / 1e9, b.total() / 1e9);
  return buf;
}

}  // namespace dflash::bench
