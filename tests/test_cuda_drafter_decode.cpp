// The CUDA proposer (drafter/decode_cuda) against the CPU proposer (drafter/decode, double) on the
// same values (bf16-rounded weights, embeddings, lm_head and features, as tests/test_cuda_drafter):
// a full and a sliding layer (window 12, shorter than the block and than most contexts), four
// slots of a pool of five in a permuted order, one with no context, context added in pieces, blocks
// of 16 and 6, then a round of accepted tokens (add_context overwriting the tentative block K / V)
// and another proposal. The logits agree to bf16 accuracy; every draft is the argmax of the GPU's
// own logits, and equals the CPU's wherever the CPU's top-2 margin is wider than twice that row's
// logit error (so no rounding can flip it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "drafter/decode.h"
#include "drafter/decode_cuda.h"
#include "core/random.h"
#include "test_drafters.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::drafter;

namespace {

struct Pair {
  DrafterConfig c = gpu_test_drafter(12, 16);  // window 12, blocks of 16
  std::unique_ptr<Proposer> cpu, gpu;
  uint64_t stream = 10;

  explicit Pair(uint64_t seed, int64_t num_slots = 5, int64_t max_len = 128) {
    const Bf16DrafterInputs in = bf16_drafter_inputs(c, seed);  // the bf16 values, exactly, for both
    cpu = make_cpu_proposer(c, in.w, {bf16_values(in.embed), bf16_values(in.lm_head)}, num_slots, max_len);
    gpu = make_cuda_proposer(c, in.w, in.embed.to_dtype(DType::BF16).to(Device::cuda(0)),
                             in.lm_head.to_dtype(DType::BF16).to(Device::cuda(0)), Device::cuda(0), num_slots, max_len);
  }
  // The same random features (rows[s] of them for slots[s]) into both proposers.
  void add(const std::vector<int32_t>& slots, const std::vector<int64_t>& rows) {
    ops::SeqOffsets seqs{{0}};
    for (int64_t r : rows) seqs.offsets.push_back(seqs.offsets.back() + r);
    Tensor f = Tensor::empty({seqs.offsets.back(), c.context_dim()}, DType::F32);
    fill_normal(f, {99, stream++, 0}, 0.0f, 1.0f);
    cpu->add_context(slots, bf16_values(f), seqs);
    gpu->add_context(slots, f.to_dtype(DType::BF16).to(Device::cuda(0)), seqs);
  }
};

struct Agreement {
  double logit_err = 0;
  int64_t clear = 0, clear_equal = 0, equal = 0, rows = 0;
};

// Proposes on both and compares; returns the figures and fails on any inconsistency.
Agreement compare(Pair& p, const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start, int64_t Bp) {
  Tensor lc, lg;
  const auto dc = p.cpu->propose(slots, x_start, Bp, &lc);
  const auto dg = p.gpu->propose(slots, x_start, Bp, &lg);
  Agreement a;
  a.logit_err = max_rel_err(lg, lc);
  // bf16 weights and activations through 2 layers (measured 3.4e-3 .. 4.5e-3 on an H200).
  EXPECT_LE(a.logit_err, 1e-2) << "block " << Bp << ": logits vs the CPU proposer";
  std::vector<int32_t> own;
  ops::argmax_rows(lg, own);
  const int64_t V = p.c.vocab_size;
  EXPECT_EQ(dg.size(), slots.size());
  for (size_t s = 0; s < std::min(dg.size(), slots.size()); ++s) {
    EXPECT_EQ(static_cast<int64_t>(dg[s].size()), Bp - 1);
    if (static_cast<int64_t>(dg[s].size()) != Bp - 1) continue;
    for (int64_t j = 1; j < Bp; ++j) {
      const int64_t r = static_cast<int64_t>(s) * Bp + j;
      EXPECT_EQ(dg[s][j - 1], own[r]) << "slot " << slots[s] << " row " << j << ": draft is not the argmax of its logits";
      const float* c = lc.data<float>() + r * V;
      const float* g = lg.data<float>() + r * V;
      double err = 0, top1 = -INFINITY, top2 = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        err = std::max(err, std::abs(static_cast<double>(g[v]) - c[v]));
        if (c[v] > top1) top2 = top1, top1 = c[v];
        else if (c[v] > top2) top2 = c[v];
      }
      ++a.rows;
      a.equal += dg[s][j - 1] == dc[s][j - 1];
      if (top1 - top2 > 2 * err) {
        ++a.clear;
        a.clear_equal += dg[s][j - 1] == dc[s][j - 1];
        EXPECT_EQ(dg[s][j - 1], dc[s][j - 1]) << "slot " << slots[s] << " row " << j << ": margin " << top1 - top2
                                              << " > 2 x error " << err;
      }
    }
  }
  std::printf("  block %2ld: logits max rel err %.2e; drafts equal %ld / %ld (clear margin: %ld / %ld)\n",
              static_cast<long>(Bp), a.logit_err, static_cast<long>(a.equal), static_cast<long>(a.rows),
              static_cast<long>(a.clear_equal), static_cast<long>(a.clear));
  return a;
}

}  // namespace

TEST(CudaProposer, MatchesTheCpuProposer) {
  DFLASH_REQUIRE_GPU();
  Pair p(51);
  std::printf("attention kernel: %s\n", cuda_proposer_attention_kernel(p.c, Device::cuda(0)));
  const std::vector<int32_t> slots{3, 0, 4, 2};  // contexts 70, 23, 5 and none
  p.add({3, 0, 4}, {40, 23, 2});
  p.add({4, 3}, {3, 30});
  const std::vector<int32_t> x{17, 401, 998, 5};
  int64_t clear = 0;
  for (int64_t Bp : {16, 6}) clear += compare(p, slots, x, Bp).clear;
  // Determinism: the same proposal again (its tentative K / V rewritten) is bitwise the same.
  Tensor l1, l2;
  p.gpu->propose(slots, x, 16, &l1);
  p.gpu->propose(slots, x, 16, &l2);
  EXPECT_EQ(0, std::memcmp(l1.raw_data(), l2.raw_data(), l1.nbytes())) << "two identical proposals differ";
  // Accepted tokens: 3, all 16 (the whole tentative block overwritten), 1 and 7 positions; then a
  // proposal over the new ends.
  p.add(slots, {3, 16, 1, 7});
  for (size_t s = 0; s < slots.size(); ++s) EXPECT_EQ(p.gpu->context_length(slots[s]), p.cpu->context_length(slots[s]));
  clear += compare(p, slots, {23, 0, 640, 998}, 16).clear;
  clear += compare(p, {2, 4}, {7, 8}, 6).clear;  // a subset of the slots
  EXPECT_GT(clear, 30) << "too few rows with a clear margin: the draft comparison is vacuous";
}

TEST(CudaProposer, BadInputsAreRefused) {
  DFLASH_REQUIRE_GPU();
  Pair p(52, 2, 40);
  const DrafterConfig& c = p.c;
  Tensor f = Tensor::zeros({4, c.context_dim()}, DType::F32);
  EXPECT_NE(error_of([&] { p.gpu->add_context({0}, f, {{0, 4}}); }).find("features must be contiguous bf16 on cuda:0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { p.gpu->add_context({2}, f.to_dtype(DType::BF16).to(Device::cuda(0)), {{0, 4}}); })
                .find("slot 2 is outside the pool of 2 slots"),
            std::string::npos);
  EXPECT_NE(error_of([&] { p.gpu->propose({0}, {1}, 17); }).find("block_size 17 is outside [2, 16]"), std::string::npos);
  p.add({1}, {30});
  EXPECT_NE(error_of([&] { p.gpu->propose({1}, {1}, 16); }).find("exceeds max_len 40"), std::string::npos);
  EXPECT_NO_THROW(p.gpu->propose({1}, {1}, 10));
  DrafterWeights w = DrafterWeights::random(c, 1, 0.05f, DType::F32);
  const Tensor host_emb = Tensor::zeros({c.vocab_size, c.hidden_size}, DType::BF16);
  EXPECT_NE(error_of([&] { make_cuda_proposer(c, w, host_emb, host_emb.to(Device::cuda(0)), Device::cuda(0), 2, 40); })
                .find("embed_tokens must be bf16 [1000, 256] on cuda:0"),
            std::string::npos);
}
