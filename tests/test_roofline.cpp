// The one roofline's byte count (bench/roofline.h) against closed formulas on the tiny and 27B
// configs. The formulas, independent of the tensor list the code sums over:
//   bf16 weights = 2 (parameter_count - V H) + 2 H rows                 (untied; embedding: a row a token)
//   fp8 weights  = bf16 weights - sum over projections [N, K] of (N K - 4 ceil(N/128) ceil(K/128))
//   state        = seqs x GDN layers x 2 x (4 Hv dk dv + 2 (K-1) conv_dim)
//   KV           = seqs x attention layers x 2 x 2 Hkv d x (context + tokens)
//   propose      = 2 (layers (2 q_dim H + 2 kv_dim H + 3 I H + 2 d + 2 H) + H + V H + seqs B H)
//                  + seqs x layers x 2 x 2 kv_dim x (context + B)
//   fp8 propose    = the same with each projection [N, K] and the lm_head at N K + 4 ceil(N/128) ceil(K/128)
#include <gtest/gtest.h>

#include <cmath>

#include "bench/roofline.h"
#include "core/error.h"

using namespace dflash;
using target::Precision;
using target::TargetConfig;

namespace {
const std::string kConfigs = std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/";

double ceil128(int64_t n) { return static_cast<double>((n + 127) / 128); }

double fp8_saving(const TargetConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  auto save = [](int64_t n, int64_t k) { return static_cast<double>(n * k) - 4.0 * ceil128(n) * ceil128(k); };
  const double mlp = save(I, H) * 2 + save(H, I);
  const double gdn = save(c.gdn_conv_dim(), H) + save(c.gdn_value_dim(), H) + save(H, c.gdn_value_dim());
  const int64_t kvd = c.num_key_value_heads * c.head_dim;
  const double attn = save(c.attn_q_proj_rows(), H) + 2 * save(kvd, H) + save(H, c.num_attention_heads * c.head_dim);
  return static_cast<double>(c.count_layers(target::LayerType::LinearAttention)) * (gdn + mlp) +
         static_cast<double>(c.count_layers(target::LayerType::FullAttention)) * (attn + mlp);
}

void check_target(const TargetConfig& c, int64_t seqs, int64_t tokens, double ctx) {
  const double H = static_cast<double>(c.hidden_size), V = static_cast<double>(c.vocab_size);
  ASSERT_FALSE(c.tie_word_embeddings);
  const double rows = static_cast<double>(seqs * tokens);
  const double bf16 = 2.0 * (static_cast<double>(c.parameter_count()) - V * H) + 2.0 * H * rows;
  const bench::StepBytes b = bench::target_step_bytes(c, Precision::Bf16, seqs, tokens, ctx);
  EXPECT_DOUBLE_EQ(b.weights, bf16);
  EXPECT_DOUBLE_EQ(bench::target_step_bytes(c, Precision::Fp8, seqs, tokens, ctx).weights, bf16 - fp8_saving(c));
  const double gdn = static_cast<double>(c.count_layers(target::LayerType::LinearAttention));
  const double attn = static_cast<double>(c.count_layers(target::LayerType::FullAttention));
  EXPECT_DOUBLE_EQ(b.state, static_cast<double>(seqs) * gdn * 2.0 *
                                (4.0 * static_cast<double>(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim) +
                                 2.0 * static_cast<double>((c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim())));
  EXPECT_DOUBLE_EQ(b.kv, static_cast<double>(seqs) * attn * 4.0 * static_cast<double>(c.num_key_value_heads * c.head_dim) *
                             (ctx + static_cast<double>(tokens)));
}
}  // namespace

TEST(Roofline, TargetBytesMatchTheFormulaOnTinyAnd27B) {
  for (const char* name : {"tiny", "qwen3.6-27b"}) {
    SCOPED_TRACE(name);
    const TargetConfig c = TargetConfig::from_file(kConfigs + name + "/config.json");
    check_target(c, 1, 1, 4096);
    check_target(c, 64, 1, 768);
    check_target(c, 1, 16, 4096);
  }
}

TEST(Roofline, Qwen27BDecodeStepInNumbers) {
  // The figures the H200 rows are stated against (one sequence, context 4096, T = 1).
  const TargetConfig c = TargetConfig::from_file(kConfigs + "qwen3.6-27b/config.json");
  const bench::StepBytes b = bench::target_step_bytes(c, Precision::Bf16, 1, 1, 4096);
  EXPECT_DOUBLE_EQ(b.weights, 51249210368.0);  // 26.90 B parameters less the embedding table, bf16
  EXPECT_DOUBLE_EQ(b.state, 307888128.0);      // 48 GDN layers: 3 MiB fp32 state + 60 KiB conv state, read + written
  EXPECT_DOUBLE_EQ(b.kv, 268500992.0);         // 16 attention layers: 4 x 256 K and V, 4097 rows
  EXPECT_DOUBLE_EQ(bench::target_step_bytes(c, Precision::Fp8, 1, 1, 4096).weights, 26928186368.0);
  const bench::Roofline r{4000.0};
  EXPECT_NEAR(r.ms(b), b.total() / 4e12 * 1e3, 1e-9);
  EXPECT_NEAR(r.share(b, 2 * r.ms(b)), 0.5, 1e-12);
  EXPECT_EQ(bench::Roofline{}.ms(b), 0.0);  // no bandwidth measured (CPU): no roofline
}

TEST(Roofline, ProposeBytesMatchTheFormula) {
  for (const char* name : {"tiny", "qwen3.6-27b"}) {
    SCOPED_TRACE(name);
    const TargetConfig t = TargetConfig::from_file(kConfigs + name + "/config.json");
    const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(t, 5, 0, 16);
    const double H = static_cast<double>(dc.hidden_size), L = static_cast<double>(dc.num_hidden_layers);
    const double q = static_cast<double>(dc.q_dim()), kv = static_cast<double>(dc.kv_dim());
    const double I = static_cast<double>(dc.intermediate_size), d = static_cast<double>(dc.head_dim);
    for (int64_t seqs : {1, 8}) {
      const bench::StepBytes b = bench::propose_bytes(dc, seqs, 4096);
      const double S = static_cast<double>(seqs);
      EXPECT_DOUBLE_EQ(b.weights, 2.0 * (L * (2 * q * H + 2 * kv * H + 3 * I * H + 2 * d + 2 * H) + H +
                                         static_cast<double>(dc.vocab_size) * H + S * 16 * H));
      EXPECT_DOUBLE_EQ(b.state, 0.0);
      EXPECT_DOUBLE_EQ(b.kv, S * L * 4.0 * kv * (4096 + 16));
      // FP8 propose: the projections and the lm_head 1 byte a value plus their 128 x 128 block scales.
      auto blocks = [](double n) { return std::ceil(n / 128.0); };
      auto fp8 = [&](double N, double K) { return N * K + 4.0 * blocks(N) * blocks(K); };
      const bench::StepBytes b8 = bench::propose_bytes(dc, seqs, 4096, true);
      const double per_layer = fp8(q, H) + 2 * fp8(kv, H) + fp8(H, q) + 2 * fp8(I, H) + fp8(H, I) + 2.0 * (2 * d + 2 * H);
      EXPECT_DOUBLE_EQ(b8.weights, L * per_layer + 2.0 * H + fp8(static_cast<double>(dc.vocab_size), H) + 2.0 * S * 16 * H);
      EXPECT_DOUBLE_EQ(b8.kv, b.kv);
      EXPECT_LT(b8.weights, 0.55 * b.weights);
    }
  }
}

TEST(Roofline, RejectsAnEmptyStep) {
  const TargetConfig c = TargetConfig::from_file(kConfigs + "tiny/config.json");
  EXPECT_THROW((void)bench::target_step_bytes(c, Precision::Bf16, 0, 1, 0), dflash::Error);
  EXPECT_THROW((void)bench::target_step_bytes(c, Precision::Bf16, 1, 0, 0), dflash::Error);
}

// FP8 experts: the touched experts' bytes are their codes (1 byte a value) and F32 block scales.
TEST(Roofline, Fp8ExpertsReadCodesAndScales) {
  const TargetConfig c = TargetConfig::from_file(kConfigs + "qwen3.6-35b-a3b/config.json");
  const double E = static_cast<double>(c.num_experts), I = static_cast<double>(c.moe_intermediate_size);
  const double H = static_cast<double>(c.hidden_size), L = static_cast<double>(c.num_hidden_layers);
  const double touched = 8.0;  // one token, top 8
  const double codes = L * touched * 3.0 * I * H;
  const double scales = L * touched * 4.0 * (2.0 * (I / 128) * (H / 128) + (H / 128) * (I / 128));
  const double bf16 = bench::target_step_bytes(c, Precision::Bf16, 1, 1, 4096).weights;
  const double fp8x = bench::target_step_bytes(c, Precision::Bf16, 1, 1, 4096, true).weights;
  EXPECT_DOUBLE_EQ(bf16 - fp8x, 2.0 * codes - (codes + scales));
  EXPECT_EQ(E, 256.0);
}
