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
#include <cstdlib>
#include <cstring>

#include "drafter/decode.h"
#include "drafter/decode_cuda.h"
#include "core/random.h"
#include "test_drafters.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::drafter;

namespace {

// rows[s] context rows of random features for the s-th slot of a call: the f32 values (normal, stream
// {seed, stream}) and their offsets.
struct RandomContext {
  Tensor f;
  ops::SeqOffsets seqs{{0}};
};
RandomContext random_context(const DrafterConfig& c, const std::vector<int64_t>& rows, uint64_t seed, uint64_t stream) {
  RandomContext rc;
  for (int64_t r : rows) rc.seqs.offsets.push_back(rc.seqs.offsets.back() + r);
  rc.f = Tensor::empty({rc.seqs.offsets.back(), c.context_dim()}, DType::F32);
  fill_normal(rc.f, {seed, stream, 0}, 0.0f, 1.0f);
  return rc;
}

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
    const RandomContext rc = random_context(c, rows, 99, stream++);
    cpu->add_context(slots, bf16_values(rc.f), rc.seqs);
    gpu->add_context(slots, rc.f.to_dtype(DType::BF16).to(Device::cuda(0)), rc.seqs);
  }
};

struct Agreement {
  double logit_err = 0;
  int64_t clear = 0, clear_equal = 0, equal = 0, rows = 0;
};

// The drafts `got` (their logits lg) against `ref`'s (logits lr) for `slots`' blocks of Bp rows: each draft
// the argmax of its own logits, and equal to ref's wherever the row's top-2 margin is wider than twice its
// logit difference (so no rounding can flip it). Adds the rows, equal drafts and clear rows to `a`.
void expect_drafts_agree(const std::vector<std::vector<int32_t>>& got, const Tensor& lg,
                         const std::vector<std::vector<int32_t>>& ref, const Tensor& lr, const std::vector<int32_t>& slots,
                         int64_t Bp, Agreement& a) {
  std::vector<int32_t> own;
  ops::argmax_rows(lg, own);
  const int64_t V = lg.size(1);
  EXPECT_EQ(got.size(), slots.size());
  for (size_t s = 0; s < std::min(got.size(), slots.size()); ++s) {
    EXPECT_EQ(static_cast<int64_t>(got[s].size()), Bp - 1);
    if (static_cast<int64_t>(got[s].size()) != Bp - 1) continue;
    for (int64_t j = 1; j < Bp; ++j) {
      const int64_t r = static_cast<int64_t>(s) * Bp + j;
      EXPECT_EQ(got[s][j - 1], own[r]) << "slot " << slots[s] << " row " << j << ": draft is not the argmax of its logits";
      const RowMargin m = row_margin(lg.data<float>() + r * V, lr.data<float>() + r * V, V);
      ++a.rows;
      a.equal += got[s][j - 1] == ref[s][j - 1];
      if (m.margin > 2 * m.err) {
        ++a.clear;
        a.clear_equal += got[s][j - 1] == ref[s][j - 1];
        EXPECT_EQ(got[s][j - 1], ref[s][j - 1]) << "slot " << slots[s] << " row " << j << ": margin " << m.margin
                                                << " > 2 x error " << m.err;
      }
    }
  }
}

// Proposes on both and compares; returns the figures and fails on any inconsistency.
Agreement compare(Pair& p, const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start, int64_t Bp) {
  Tensor lc, lg;
  const auto dc = p.cpu->propose(slots, x_start, Bp, &lc);
  const auto dg = p.gpu->propose(slots, x_start, Bp, &lg);
  Agreement a;
  a.logit_err = max_rel_err(lg, lc);
  // bf16 weights and activations through 2 layers (measured 3.4e-3 .. 4.5e-3 on an H200).
  EXPECT_LE(a.logit_err, 1e-2) << "block " << Bp << ": logits vs the CPU proposer";
  expect_drafts_agree(dg, lg, dc, lc, slots, Bp, a);
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

// Propose steps as CUDA graphs (make_cuda_proposer's cuda_graphs): a proposer replaying graphs and one
// launching eagerly, on the same weights and contexts, give the same drafts call after call (bf16 and
// FP8 propose; one slot's block of 16 and two slots' blocks of 6, with context added between the calls
// so the replays read new lengths and positions from the uploaded metadata); each shape is captured
// once (at its second call) and replayed after; asking for logits runs eagerly. The add_context calls
// run as graphs too (DFLASH_CONTEXT_GRAPHS=1): shapes of 3 slots x 6 / 7 rows and 1 slot x 2 rows
// repeat, so they are captured and replayed, and the drafts read the K / V those replays wrote; the
// first, prefill-sized context (62 rows > 3 blocks of 16) runs eagerly.
TEST(CudaProposer, GraphReplaysGiveTheEagerDrafts) {
  DFLASH_REQUIRE_GPU();
  const DrafterConfig c = gpu_test_drafter(12, 16);
  const Bf16DrafterInputs in = bf16_drafter_inputs(c, 63);
  const Tensor embed = in.embed.to_dtype(DType::BF16).to(Device::cuda(0));
  const Tensor lm_head = in.lm_head.to_dtype(DType::BF16).to(Device::cuda(0));
  for (bool fp8 : {false, true}) {
    if (fp8 && cuda_device_info(0).major < 9) continue;
    SCOPED_TRACE(fp8 ? "fp8 propose" : "bf16 propose");
    setenv("DFLASH_CONTEXT_GRAPHS", "1", 1);
    auto graphs = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 256, fp8, true);
    unsetenv("DFLASH_CONTEXT_GRAPHS");
    auto eager = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 256, fp8, false);
    uint64_t stream = 1;
    auto add = [&](const std::vector<int32_t>& slots, const std::vector<int64_t>& rows) {
      const RandomContext rc = random_context(c, rows, 97, stream++);
      const Tensor fd = rc.f.to_dtype(DType::BF16).to(Device::cuda(0));
      graphs->add_context(slots, fd, rc.seqs);
      eager->add_context(slots, fd, rc.seqs);
    };
    add({0, 1, 2}, {20, 9, 33});
    int64_t differing_calls = 0;
    std::vector<std::vector<int32_t>> previous;
    for (int call = 0; call < 4; ++call) {
      for (const auto& [ss, Bp] : {std::pair{std::vector<int32_t>{1}, int64_t{16}},
                                   std::pair{std::vector<int32_t>{2, 0}, int64_t{6}}}) {
        std::vector<int32_t> x;
        for (size_t s = 0; s < ss.size(); ++s) x.push_back(static_cast<int32_t>((37 * call + 11 * s + 5) % c.vocab_size));
        const auto dg = graphs->propose(ss, x, Bp, nullptr);
        const auto de = eager->propose(ss, x, Bp, nullptr);
        EXPECT_EQ(dg, de) << "call " << call << ", " << ss.size() << " slot(s), block " << Bp;
        if (Bp == 16) {
          differing_calls += dg != previous;
          previous = dg;
        }
      }
      add({0, 1, 2}, {1 + call % 2, 2, 3});  // new context: the next replays read new lengths
      add({1}, {2});
    }
    EXPECT_GE(differing_calls, 2) << "the drafts never changed with the inputs: a weak check";
    Tensor logits;  // logits asked for: an eager call, the same drafts
    EXPECT_EQ(graphs->propose({1}, {3}, 16, &logits), eager->propose({1}, {3}, 16, nullptr));
    const std::string st = graphs->graph_stats();
    std::printf("  %s: %s\n", fp8 ? "fp8" : "bf16", st.c_str());
    EXPECT_NE(st.find("propose 2 shape(s) captured, 6 replay(s), 2 eager;"), std::string::npos) << st;
    EXPECT_NE(st.find("add_context 3 shape(s) captured, 5 replay(s), 3 eager "), std::string::npos) << st;
    EXPECT_EQ(st.find("FAILED"), std::string::npos) << st;
    EXPECT_NE(eager->graph_stats().find("off"), std::string::npos) << eager->graph_stats();
  }
}

// The commit step's context update on the FP8 copies (cuda_context_fp8, under FP8 propose): a prefill-sized
// context runs bf16 either way; the accepted tokens' contexts (1, 6 and 16 rows) then go through the FP8 fc
// and k|v GEMMs in one proposer and the bf16 ones in another (both FP8 propose, the same weights): the
// proposals over those contexts differ (the FP8 path ran) within the W8A8 error, the drafts are equal where
// the margin is clear, and a context of more than 16 rows runs the bf16 GEMMs (bit for bit the other's).
TEST(CudaProposer, Fp8ContextUpdateIsNearTheBf16One) {
  DFLASH_REQUIRE_GPU();
  if (cuda_device_info(0).major < 9) GTEST_SKIP() << "block-scaled FP8 GEMMs run on sm_90";
  const DrafterConfig c = gpu_test_drafter(12, 16);
  const Bf16DrafterInputs in = bf16_drafter_inputs(c, 64);
  const Tensor embed = in.embed.to_dtype(DType::BF16).to(Device::cuda(0));
  const Tensor lm_head = in.lm_head.to_dtype(DType::BF16).to(Device::cuda(0));
  const int saved = cuda_context_fp8;
  for (bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "context graphs" : "eager");
    if (graphs) setenv("DFLASH_CONTEXT_GRAPHS", "1", 1);
    auto ref = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 128, true, graphs);
    auto q8 = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 128, true, graphs);
    unsetenv("DFLASH_CONTEXT_GRAPHS");
    uint64_t stream = 1;
    auto add_to = [&](Proposer& a, Proposer& b, const std::vector<int32_t>& slots, const std::vector<int64_t>& rows) {
      const RandomContext rc = random_context(c, rows, 96, stream++);
      const Tensor fd = rc.f.to_dtype(DType::BF16).to(Device::cuda(0));
      cuda_context_fp8 = 0;
      a.add_context(slots, fd, rc.seqs);
      cuda_context_fp8 = 1;
      b.add_context(slots, fd, rc.seqs);
      cuda_context_fp8 = saved;
    };
    auto add = [&](const std::vector<int32_t>& slots, const std::vector<int64_t>& rows) { add_to(*ref, *q8, slots, rows); };
    constexpr int64_t kBp = 5;  // 3 slots x 5 = 15 rows: the propose GEMMs stay FP8 (<= 16 rows)
    auto logits = [&](Proposer& p, const std::vector<int32_t>& slots, std::vector<std::vector<int32_t>>* drafts) {
      Tensor l;
      *drafts = p.propose(slots, std::vector<int32_t>(slots.size(), 7), kBp, &l);
      return l;
    };
    add({0, 1, 2}, {30, 20, 25});  // 75 rows: bf16 in both
    std::vector<std::vector<int32_t>> dr, dq;
    Tensor lr = logits(*ref, {0, 1, 2}, &dr), lq = logits(*q8, {0, 1, 2}, &dq);
    EXPECT_TRUE(bit_equal(lr, lq)) << "a context of 75 rows must run the bf16 GEMMs in both";
    Agreement agree;
    for (int round = 0; round < 5; ++round) {  // accepted tokens: 1 row, 2 slots x 3, one slot's 16, 1, 1
      if (round == 1) add({0, 2}, {3, 3});
      else if (round == 2) add({2}, {16});
      else add({1}, {1});  // (rounds 0, 3, 4: the shape's eager call, capture and replay with graphs on)
      lr = logits(*ref, {0, 1, 2}, &dr), lq = logits(*q8, {0, 1, 2}, &dq);
      const double err = max_rel_err(lq, lr);
      std::printf("  fp8 context, round %d: logits max rel err %.2e vs the bf16 context update\n", round, err);
      EXPECT_GT(err, 0.0) << "round " << round << ": equal logits: the FP8 context GEMMs did not run";
      EXPECT_LE(err, 0.15) << "round " << round << ": the FP8 context update is far from the bf16 one";
      SCOPED_TRACE(testing::Message() << "round " << round);
      expect_drafts_agree(dq, lq, dr, lr, {0, 1, 2}, kBp, agree);
    }
    EXPECT_GT(agree.clear, 20) << "too few rows with a clear margin: the draft comparison is vacuous";
    std::printf("  fp8 context: drafts equal on %ld of %ld rows with a clear margin\n", long(agree.clear_equal),
                long(agree.clear));
    // 2 slots x 9 rows = 18 > 16 (and <= the 3 slots' 48 block rows) into a fresh pair: the bf16 GEMMs in both.
    auto fresh_ref = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 128, true, graphs);
    auto fresh_q8 = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 3, 128, true, graphs);
    add_to(*fresh_ref, *fresh_q8, {0, 1}, {9, 9});
    lr = logits(*fresh_ref, {0, 1}, &dr), lq = logits(*fresh_q8, {0, 1}, &dq);
    EXPECT_TRUE(bit_equal(lr, lq)) << "a context of 18 rows must run the bf16 GEMMs with cuda_context_fp8 on";
    if (graphs) {  // the 1-row shape: eager, then captured and replayed, replayed; the 6 and 16 rows: eager once each
      const std::string st = q8->graph_stats();
      std::printf("  %s\n", st.c_str());
      EXPECT_NE(st.find("add_context 1 shape(s) captured, 2 replay(s), 3 eager"), std::string::npos) << st;
      EXPECT_EQ(st.find("FAILED"), std::string::npos) << st;
    }
  }
  EXPECT_EQ(cuda_context_fp8, saved);
}

// FP8 propose (make_cuda_proposer's fp8_propose: e4m3 weights and lm_head, the streaming FP8 GEMM)
// against the bf16 proposer on the same weights and context: logits within the W8A8 quantization's
// error (both operands rounded to 3 mantissa bits per 128-value block: a few % of the largest logit
// through 2 layers and the lm_head; the measured value is printed), every draft the argmax of its own
// logits and equal to the bf16 proposer's wherever that one's top-2 margin is wider than twice the
// row's logit difference. A step of more than 16 rows runs the bf16 GEMMs: then bit for bit the bf16
// proposer's. A drafter whose GEMM widths are not multiples of 128 is refused by name.
TEST(CudaProposer, Fp8ProposeIsNearTheBf16Proposer) {
  DFLASH_REQUIRE_GPU();
  if (cuda_device_info(0).major < 9) GTEST_SKIP() << "the streaming FP8 GEMM runs on sm_90";
  const DrafterConfig c = gpu_test_drafter(12, 16);
  const Bf16DrafterInputs in = bf16_drafter_inputs(c, 61);
  const Tensor embed = in.embed.to_dtype(DType::BF16).to(Device::cuda(0));
  const Tensor lm_head = in.lm_head.to_dtype(DType::BF16).to(Device::cuda(0));
  auto bf = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 4, 128, false);
  auto f8 = make_cuda_proposer(c, in.w, embed, lm_head, Device::cuda(0), 4, 128, true);
  const std::vector<int32_t> slots{0, 1, 2, 3};
  const RandomContext rc = random_context(c, {30, 1, 19, 40}, 98, 1);
  const Tensor fd = rc.f.to_dtype(DType::BF16).to(Device::cuda(0));
  bf->add_context(slots, fd, rc.seqs);
  f8->add_context(slots, fd, rc.seqs);
  // One slot's block of 16 and two slots' blocks of 6: FP8 GEMMs (<= 16 rows).
  Agreement agree;
  for (const auto& [ss, x, Bp] : {std::tuple{std::vector<int32_t>{2}, std::vector<int32_t>{17}, int64_t{16}},
                                  std::tuple{std::vector<int32_t>{0, 3}, std::vector<int32_t>{401, 5}, int64_t{6}}}) {
    Tensor lb, l8;
    const auto db = bf->propose(ss, x, Bp, &lb);
    const auto d8 = f8->propose(ss, x, Bp, &l8);
    const double err = max_rel_err(l8, lb);
    std::printf("  fp8 propose, %zu slot(s), block %ld: logits max rel err %.2e vs bf16\n", ss.size(), long(Bp), err);
    EXPECT_LE(err, 0.15) << "fp8 logits far from the bf16 proposer's";
    EXPECT_GT(err, 0.0) << "fp8 logits equal to bf16: the FP8 GEMMs did not run";
    expect_drafts_agree(d8, l8, db, lb, ss, Bp, agree);
  }
  std::printf("  fp8 propose: drafts equal to bf16's on %ld of %ld rows with a clear margin\n", long(agree.clear_equal),
              long(agree.clear));
  // Four slots' blocks of 16 (64 rows): the bf16 GEMMs, bit for bit.
  Tensor lb, l8;
  const auto db = bf->propose(slots, {1, 2, 3, 4}, 16, &lb);
  const auto d8 = f8->propose(slots, {1, 2, 3, 4}, 16, &l8);
  EXPECT_EQ(db, d8);
  EXPECT_TRUE(bit_equal(lb, l8)) << "a step of 64 rows must run the bf16 GEMMs";
  // GEMM widths that are not multiples of 128 are refused by name.
  DrafterConfig odd = full_and_sliding_drafter("odd", {.hidden = 192, .intermediate = 512, .vocab = 1000, .heads = 3,
                                                       .kv_heads = 1, .head_dim = 64, .sliding_window = 12, .block_size = 16});
  const Bf16DrafterInputs oi = bf16_drafter_inputs(odd, 62);
  const std::string e = error_of([&] {
    make_cuda_proposer(odd, oi.w, oi.embed.to_dtype(DType::BF16).to(Device::cuda(0)),
                       oi.lm_head.to_dtype(DType::BF16).to(Device::cuda(0)), Device::cuda(0), 1, 64, true);
  });
  EXPECT_NE(e.find("FP8 propose needs every GEMM's K a multiple of 128"), std::string::npos) << e;
}
