#pragma once
// A drafter::Proposer for tests that knows the target's greedy continuation and gets a chosen
// number of drafts right per step: speculative decoding must then accept exactly min(good + 1, B)
// tokens each step and still give the greedy output (tests/test_speculative, test_cuda_decoder).
#include <gtest/gtest.h>

#include <vector>

#include "drafter/decode.h"

namespace dflash {

// Proposes the target's true greedy tokens for the first good(step) drafts of each block and a
// wrong token after them: the acceptance length of that step must be min(good + 1, B).
class OracleProposer final : public drafter::Proposer {
 public:
  OracleProposer(drafter::DrafterConfig c, std::vector<int32_t> sequence, std::vector<int64_t> good)
      : c_(std::move(c)), seq_(std::move(sequence)), good_(std::move(good)) {}
  const drafter::DrafterConfig& config() const override { return c_; }
  Device device() const override { return Device::cpu(); }
  int64_t num_slots() const override { return 1; }
  int64_t max_len() const override { return 1 << 20; }
  void reset(int32_t) override { len_ = 0, step_ = 0; }
  int64_t context_length(int32_t) const override { return len_; }
  void add_context(const std::vector<int32_t>&, const Tensor& f, const ops::SeqOffsets& s) override {
    EXPECT_EQ(f.size(0), s.total_tokens());
    EXPECT_EQ(f.size(1), c_.context_dim());
    len_ += s.total_tokens();
  }
  std::vector<std::vector<int32_t>> propose(const std::vector<int32_t>&, const std::vector<int32_t>& x_start, int64_t B,
                                            Tensor*) override {
    EXPECT_EQ(x_start[0], seq_[static_cast<size_t>(len_)]) << "x_start must be the greedy token at the context's end";
    const int64_t g = good_[static_cast<size_t>(step_++ % good_.size())];
    std::vector<int32_t> d;
    for (int64_t i = 1; i < B; ++i) {
      const int32_t truth = seq_[static_cast<size_t>(len_ + i)];
      d.push_back(i <= g ? truth : (truth + 1) % static_cast<int32_t>(c_.vocab_size));
    }
    return {d};
  }

 private:
  drafter::DrafterConfig c_;
  std::vector<int32_t> seq_;  // prompt + greedy continuation
  std::vector<int64_t> good_;
  int64_t len_ = 0, step_ = 0;
};


}  // namespace dflash
