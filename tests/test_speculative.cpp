// Speculative decoding (bench/speculative.h) on the CPU reference: the output equals the target's
// own greedy decoding token for token — with real drafters (untrained, random weights of two
// seeds), block sizes 2, 4 and 16, a prompt of one token and stop tokens — and with an oracle
// proposer that knows the greedy continuation and gets a chosen number of drafts right per step, so
// that every acceptance length 1..B (and so every commit(k + 1)) is exercised and measured exactly.
// The trainer's estimate at the speculative steps' blocks equals the measured acceptance length.
#include <gtest/gtest.h>

#include <numeric>

#include "bench/greedy_estimate.h"
#include "bench/speculative.h"
#include "oracle_proposer.h"
#include "core/rng.h"
#include "target_model/model.h"
#include "test_util.h"

using namespace dflash;

namespace {

const std::string kHf = std::string(DFLASH_TEST_DATA_DIR) + "/hf/";

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng::bits(seed, 9, static_cast<uint64_t>(i)) % vocab);
  return t;
}

struct Tiny {
  target::TargetConfig cfg;
  std::unique_ptr<target::TargetModel> model;
  drafter::FrozenTarget frozen;
  explicit Tiny(const std::string& name) {
    cfg = target::TargetConfig::from_file(kHf + name);
    model = std::make_unique<target::TargetModel>(cfg, target::load_weights(cfg, kHf + name, DType::F32, Device::cpu()));
    frozen = {model->weights().embed_tokens, model->weights().lm_head};
  }
};

}  // namespace

TEST(Speculative, OracleDraftsGiveExactAcceptanceAndTheGreedyOutput) {
  Tiny s("tiny_a");
  const int64_t B = 6;
  const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(s.cfg, 1, s.cfg.vocab_size - 1, B);
  auto dec = target::make_cpu_decoder(*s.model, 1, 256);
  const std::vector<int32_t> prompt = random_tokens(13, s.cfg.vocab_size, 1);
  bench::GenerateOptions go;
  go.max_new_tokens = 70;
  go.block_size = B;
  const bench::Generation greedy = bench::greedy_generate(*dec, 0, prompt, go, B);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), greedy.tokens.begin(), greedy.tokens.end());
  const std::vector<int64_t> good{0, 5, 2, 5, 1, 3, 4, 0, 5};  // every acceptance length 1..6
  OracleProposer oracle(dc, seq, good);
  const bench::Generation spec = bench::speculative_generate(*dec, oracle, 0, prompt, go);
  ASSERT_EQ(spec.tokens, std::vector<int32_t>(greedy.tokens.begin(), greedy.tokens.begin() + 70));
  ASSERT_FALSE(spec.accept.empty());
  int64_t pos = static_cast<int64_t>(prompt.size());
  for (size_t i = 0; i < spec.accept.size(); ++i) {
    EXPECT_EQ(spec.accept[i], std::min<int64_t>(good[i % good.size()] + 1, B)) << "step " << i;
    EXPECT_EQ(spec.block_starts[i], pos) << "step " << i;
    pos += spec.accept[i];
  }
}

TEST(Speculative, RealDraftersGiveTheTargetsGreedyOutput) {
  for (const char* name : {"tiny_a", "tiny_b"}) {
    Tiny s(name);
    for (int64_t B : {2, 4, 16}) {
      for (uint64_t seed : {1, 2}) {
        drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(s.cfg, 2, s.cfg.vocab_size - 1, 16);
        dc.layer_types[1] = drafter::AttnType::Sliding;
        dc.sliding_window = 5;
        const drafter::DrafterWeights w = drafter::DrafterWeights::random(dc, seed, 0.05f);
        auto dec = target::make_cpu_decoder(*s.model, 1, 128);
        auto prop = drafter::make_cpu_proposer(dc, w, s.frozen, 1, 128);
        for (int64_t plen : {1, 11}) {
          const std::vector<int32_t> prompt = random_tokens(plen, s.cfg.vocab_size, seed * 7 + plen);
          bench::GenerateOptions go;
          go.max_new_tokens = 40;
          go.block_size = B;
          const bench::Generation greedy = bench::greedy_generate(*dec, 0, prompt, go, B - 1);
          const bench::Generation spec = bench::speculative_generate(*dec, *prop, 0, prompt, go);
          ASSERT_EQ(spec.tokens, std::vector<int32_t>(greedy.tokens.begin(), greedy.tokens.begin() + 40))
              << name << " B " << B << " seed " << seed << " prompt " << plen;
          // The trainer's estimate at the same blocks is the measured acceptance, block by block.
          const bench::AcceptEstimate est = bench::greedy_training_estimate(
              *dec, dc.target_layer_ids, bench::cpu_scorer(dc, w, s.frozen, B), prompt, greedy.tokens, 40, spec.block_starts);
          const double tau = std::accumulate(spec.accept.begin(), spec.accept.end(), 0.0) / static_cast<double>(spec.accept.size());
          EXPECT_EQ(est.at_steps.num_blocks, static_cast<int64_t>(spec.accept.size()));
          EXPECT_NEAR(est.at_steps.accept_len(), tau, 1e-12) << name << " B " << B;
          EXPECT_EQ(est.at_all.num_blocks, 40);
        }
      }
    }
  }
}

TEST(Speculative, StopTokensEndBothAlike) {
  Tiny s("tiny_a");
  const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(s.cfg, 1, s.cfg.vocab_size - 1, 4);
  auto dec = target::make_cpu_decoder(*s.model, 1, 256);
  const std::vector<int32_t> prompt = random_tokens(5, s.cfg.vocab_size, 3);
  bench::GenerateOptions go;
  go.max_new_tokens = 50;
  go.block_size = 4;
  const bench::Generation free_run = bench::greedy_generate(*dec, 0, prompt, go, 4);
  go.stop_tokens = {free_run.tokens[17]};  // a token the greedy output reaches at position 17 (or earlier)
  const bench::Generation greedy = bench::greedy_generate(*dec, 0, prompt, go);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), free_run.tokens.begin(), free_run.tokens.end());
  OracleProposer oracle(dc, seq, {3, 1, 2});
  const bench::Generation spec = bench::speculative_generate(*dec, oracle, 0, prompt, go);
  EXPECT_LE(greedy.tokens.size(), 18u);
  EXPECT_EQ(greedy.tokens.back(), go.stop_tokens[0]);
  EXPECT_EQ(spec.tokens, greedy.tokens);
}

TEST(Speculative, BadBlockSizeIsRefused) {
  Tiny s("tiny_a");
  const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(s.cfg, 1, s.cfg.vocab_size - 1, 4);
  auto dec = target::make_cpu_decoder(*s.model, 1, 64);
  auto prop = drafter::make_cpu_proposer(dc, drafter::DrafterWeights::random(dc, 1), s.frozen, 1, 64);
  bench::GenerateOptions go;
  go.block_size = 5;
  EXPECT_NE(error_of([&] { bench::speculative_generate(*dec, *prop, 0, {1, 2}, go); }).find("block size 5 is outside [2, 4]"),
            std::string::npos);
  go.block_size = 4;
  go.max_new_tokens = 0;
  EXPECT_NE(error_of([&] { bench::speculative_generate(*dec, *prop, 0, {1, 2}, go); }).find("must be >= 1"), std::string::npos);
}
