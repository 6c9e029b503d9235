// The target's incremental decoding on the GPU (target_model/decode_cuda.cpp) and speculative
// decoding there:
//  - extending in pieces (prefill, then decode and verify steps) against the CPU reference decoder
//    on the same bf16-rounded weights (bf16 bound 3e-2, as the GPU forward), fast and fallback plans;
//  - batch invariance: a verify of B tokens gives each row's logits and features bit for bit as
//    T = 1 decode steps of the same tokens do, and after commit(n) the states continue bit for bit
//    as after n decode steps;
//  - speculative decoding on the GPU gives the GPU's own greedy output token for token, with an
//    oracle proposer (every acceptance length) and with the CUDA proposer of an untrained drafter;
//  - chunked prefill's mixed steps (decode rows beside prompt pieces of fresh and started slots);
//  - packed prefill (several empty slots in one extend, slots in and out of order, prompts of 1 to
//    200 tokens) against the CPU reference and against one-slot prefills, then decode steps of all;
//  - sampling (temperature / top-p): each draw is the reference's draw on the GPU's own logits,
//    equals the CPU decoder's where the logits' rounding cannot change it, and is the same in a
//    batch of 1 and of 5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>

#include "bench/speculative.h"
#include "drafter/decode_cuda.h"
#include "core/rng.h"
#include "oracle_proposer.h"
#include "target_model/decode.h"
#include "target_model/model.h"
#include "target_model/model_cuda.h"
#include "kernels/cuda/moe.h"
#include "real_dims.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

// bf16 weights, activations and residual stream through 8 layers against the f32 reference: the
// features (hidden states) are held to the GPU forward's 3e-2; the logits, which the bf16 final
// hidden state and the vocabulary-wide GEMM amplify, to 5e-2 (measured 3.2e-2 fast, 2.5e-2
// fallback; a wrong position or state gives O(1)).
constexpr double kBf16Bound = 3e-2, kLogitsBound = 5e-2;

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng::bits(seed, 5, static_cast<uint64_t>(i)) % vocab);
  return t;
}

struct Gpu {
  std::unique_ptr<CudaTargetModel> model;
  std::unique_ptr<Decoder> dec;
  // moe_decode: the decode plan's MoE decode kernels (FastPathPlan::DecodeFusion::moe_decode) on;
  // skinny: its skinny GEMMs on (DecodeFusion::skinny_gemm: FP8 targets' on gemm_fp8_stream);
  // unfused_gdn: the fused GatedDeltaNet chain and fused commit off (the unfused twins).
  // edit: any other change to the decode plan's fusions (after the flags above).
  Gpu(const TargetConfig& c, KernelPolicy pol, int64_t slots, int64_t max_len, uint64_t seed = 3,
      Precision precision = Precision::Bf16, bool graphs = true, bool moe_decode = false, bool skinny = false,
      bool unfused_gdn = false, const std::function<void(FastPathPlan::DecodeFusion&)>& edit = {}) {
    const int sm = cuda_device_info(0).major;
    KernelPolicies p = KernelPolicies::all(pol);
    p.cuda_graphs = graphs;
    model = std::make_unique<CudaTargetModel>(c, random_weights(c, seed, DType::BF16, Device::cuda(0), precision),
                                              make_plan(c, Device::cuda(0), p, sm, precision));
    FastPathPlan plan = make_decode_plan(c, Device::cuda(0), p, sm, precision);
    plan.fusion.moe_decode = moe_decode;
    if (skinny) plan.fusion.skinny_gemm = true;
    if (unfused_gdn) plan.fusion.gdn_chain = plan.fusion.commit = plan.fusion.commit_overlap = false;
    if (edit) edit(plan.fusion);
    dec = make_cuda_decoder(*model, slots, max_len, plan);
  }
};


Tensor rows(const Tensor& t, int64_t a, int64_t b) { return t.slice(0, a, b).contiguous(); }

// The extend options of the bit-for-bit tests: a committing step and a verify, both returning logits and
// two captured layers' features.
std::pair<ExtendOptions, ExtendOptions> commit_and_verify(const TargetConfig& c) {
  ExtendOptions commit;
  commit.capture = {1, c.num_hidden_layers - 1};
  commit.logits = true;
  ExtendOptions verify = commit;
  verify.commit = false;
  return {commit, verify};
}

// The CPU reference target on the bf16-rounded weights of Gpu(c, ..., seed).
std::unique_ptr<TargetModel> cpu_reference(const TargetConfig& c, uint64_t seed = 3) {
  return std::make_unique<TargetModel>(c, bf16_random_weights_f32(c, seed));
}

// Logits / features of two extends of the same rows (GPU `got` against `ref`), and the next tokens
// wherever ref's top-2 logit margin is wider than twice that row's logit error (so no rounding can
// flip the argmax).
struct Agreement {
  double logits = 0, features = 0;
  int64_t rows = 0, clear = 0;
  void add(const ExtendResult& got, const ExtendResult& ref, const std::string& what) {
    EXPECT_EQ(got.offsets, ref.offsets) << what;
    EXPECT_EQ(got.next.size(), ref.next.size()) << what;
    logits = std::max(logits, max_rel_err(got.logits, ref.logits));
    if (ref.features.defined()) features = std::max(features, max_rel_err(got.features, ref.features));
    const int64_t R = ref.logits.size(0), V = ref.logits.size(1);
    if (got.logits.numel() != R * V || got.next.size() != static_cast<size_t>(R)) return;
    for (int64_t j = 0; j < R; ++j) {
      const RowMargin m = row_margin(got.logits.data<float>() + j * V, ref.logits.data<float>() + j * V, V);
      ++rows;
      if (m.margin > 2 * m.err) {
        ++clear;
        EXPECT_EQ(got.next[static_cast<size_t>(j)], ref.next[static_cast<size_t>(j)])
            << what << ", row " << j << ": margin " << m.margin << " > 2 x error " << m.err;
      }
    }
  }
};

// Greedy decoding of `prompt` on g, then speculative decoding with oracle drafts of every acceptance
// length 1..8 (block 8): the same tokens, each step accepting what the oracle planted. Returns them.
std::vector<int32_t> oracle_equals_greedy(Gpu& g, const TargetConfig& c, const std::vector<int32_t>& prompt,
                                          const bench::GenerateOptions& go) {
  const bench::Generation greedy = bench::greedy_generate(*g.dec, 0, prompt, go, 8);
  const std::vector<int32_t> want(greedy.tokens.begin(), greedy.tokens.begin() + go.max_new_tokens);
  const drafter::DrafterConfig oc = drafter::DrafterConfig::for_target(c, 1, c.vocab_size - 1, 8);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), greedy.tokens.begin(), greedy.tokens.end());
  const std::vector<int64_t> good{7, 0, 3, 7, 1, 5, 2, 6, 4};
  OracleProposer oracle(oc, seq, good);
  const bench::Generation spec = bench::speculative_generate(*g.dec, oracle, 0, prompt, go);
  EXPECT_EQ(spec.tokens, want);
  for (size_t i = 0; i < spec.accept.size(); ++i)
    EXPECT_EQ(spec.accept[i], std::min<int64_t>(good[i % good.size()] + 1, 8)) << "step " << i;
  return want;
}

}  // namespace

TEST(CudaDecoder, PiecesMatchTheCpuReference) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  const std::vector<int32_t> seq = random_tokens(70, c.vocab_size, 1);
  // The CPU reference decoder on the same bf16-rounded weights.
  TargetModel cpu(c, bf16_random_weights_f32(c, 3));
  for (KernelPolicy pol : {KernelPolicy::Auto, KernelPolicy::Fallback}) {
    Gpu g(c, pol, 2, 96);
    auto ref = make_cpu_decoder(cpu, 2, 96);
    ExtendOptions eo;
    eo.capture = {0, 3, c.num_hidden_layers - 1};
    eo.logits = true;
    ExtendOptions verify = eo;
    verify.commit = false;
    double worst_l = 0, worst_f = 0;
    int64_t at = 0;
    for (int64_t p : {20, 1, 1, 7, 16, 3, 16, 6}) {
      const std::vector<int32_t> piece(seq.begin() + at, seq.begin() + at + p);
      const bool as_verify = p == 16;  // a verify committed whole equals the plain extend
      const ExtendResult rg = g.dec->extend({1}, {piece}, as_verify ? verify : eo);
      const ExtendResult rc = ref->extend({1}, {piece}, as_verify ? verify : eo);
      if (as_verify) g.dec->commit(1, p), ref->commit(1, p);
      worst_l = std::max(worst_l, max_rel_err(rg.logits, rc.logits));
      worst_f = std::max(worst_f, max_rel_err(rg.features, rc.features));
      at += p;
    }
    EXPECT_EQ(g.dec->length(1), 70);
    std::printf("cuda decoder (%s) vs cpu reference: logits %.2e, features %.2e; %s\n", policy_name(pol), worst_l, worst_f,
                g.dec->kernels_run().c_str());
    EXPECT_LE(worst_l, kLogitsBound);
    EXPECT_LE(worst_f, kBf16Bound);
  }
}

// Chunked prefill inside decode steps (generate.h step_tokens): one extend of decode rows (T = 1),
// a fresh slot's prompt piece, a later piece of a started prompt and a one-token piece after them
// (T > 16: the unfused decode kernels with the pieces' delta rule on the chunked kernel from their
// slots' states, run eagerly with graphs on) against the CPU reference, then decode steps of all four.
TEST(CudaDecoder, MixedStepsOfDecodeRowsAndPromptPiecesMatchTheCpuReference) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  TargetModel cpu(c, bf16_random_weights_f32(c, 3));
  // Every row kept, then each sequence's last row alone (last_only: the mixed step's lm_head gathers
  // its kept rows, as a prefill's).
  for (bool last_only : {false, true}) {
    SCOPED_TRACE(last_only ? "last_only" : "every row");
    Gpu g(c, KernelPolicy::Auto, 4, 128);
    auto ref = make_cpu_decoder(cpu, 4, 128);
    ExtendOptions eo;
    eo.capture = {0, c.num_hidden_layers - 1};
    eo.logits = true;
    eo.last_only = last_only;
    Agreement agree;
    const std::vector<int32_t> a = random_tokens(30, c.vocab_size, 21), b = random_tokens(40, c.vocab_size, 22),
                               p = random_tokens(55, c.vocab_size, 23);
    const std::vector<int32_t> p0(p.begin(), p.begin() + 20), p1(p.begin() + 20, p.end());
    const std::vector<std::vector<int32_t>> first{a, p0};
    agree.add(g.dec->extend({0, 2}, first, eo), ref->extend({0, 2}, first, eo), "prefill");
    // Slots 1 and 3 are empty: their pieces start their prompts; slot 3's is one token after the longer pieces.
    const std::vector<std::vector<int32_t>> mixed{{a.back()}, b, p1, {random_tokens(1, c.vocab_size, 24)[0]}};
    const ExtendResult mg = g.dec->extend({0, 1, 2, 3}, mixed, eo);
    EXPECT_EQ(mg.next.size(), last_only ? 4u : 1u + 40u + 35u + 1u);
    agree.add(mg, ref->extend({0, 1, 2, 3}, mixed, eo), "mixed step");
    for (int64_t i = 0; i < 4; ++i) {
      std::vector<std::vector<int32_t>> toks;
      for (int32_t sl = 0; sl < 4; ++sl) toks.push_back({random_tokens(1, c.vocab_size, 300 + 4 * i + sl)[0]});
      agree.add(g.dec->extend({0, 1, 2, 3}, toks, eo), ref->extend({0, 1, 2, 3}, toks, eo), "decode");
    }
    EXPECT_EQ(g.dec->length(1), 44);
    EXPECT_EQ(g.dec->length(2), 59);
    EXPECT_EQ(g.dec->length(3), 5);
    std::printf("mixed steps vs cpu reference (%s): logits %.2e, features %.2e, %lld of %lld argmax rows clear; %s\n",
                last_only ? "last_only" : "every row", agree.logits, agree.features, static_cast<long long>(agree.clear),
                static_cast<long long>(agree.rows), g.dec->kernels_run().c_str());
    EXPECT_LE(agree.logits, kLogitsBound);
    EXPECT_LE(agree.features, kBf16Bound);
    EXPECT_NE(g.dec->kernels_run().find("a step with a prompt piece"), std::string::npos) << g.dec->kernels_run();
    // The pieces ran the chunked delta rule from their slots' states (DecodeStep::piece_from).
    EXPECT_EQ(g.dec->kernels_run().find("delta_rule fast 0 fallback 0"), std::string::npos) << g.dec->kernels_run();
    EXPECT_EQ(g.dec->graph_stats().capture_failures, 0u);
  }
}

TEST(CudaDecoder, VerifyRowsEqualDecodeStepsBitForBit) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  const int64_t B = 16;
  const std::vector<int32_t> prompt = random_tokens(300, c.vocab_size, 2), block = random_tokens(B, c.vocab_size, 3);
  const std::vector<int32_t> after = random_tokens(3, c.vocab_size, 4);
  const auto [commit, verify] = commit_and_verify(c);
  for (int64_t n : {1, 5, 16}) {
    Gpu a(c, KernelPolicy::Auto, 1, 400), b(c, KernelPolicy::Auto, 1, 400);
    a.dec->extend({0}, {prompt}, commit);
    b.dec->extend({0}, {prompt}, commit);
    const ExtendResult va = a.dec->extend({0}, {block}, verify);
    a.dec->commit(0, n);
    // b: the same tokens as T = 1 decode steps.
    for (int64_t t = 0; t < n; ++t) {
      const ExtendResult sb = b.dec->extend({0}, {{block[static_cast<size_t>(t)]}}, commit);
      EXPECT_TRUE(bit_equal(rows(va.logits, t, t + 1), sb.logits)) << "logits of verify row " << t << " (n " << n << ")";
      EXPECT_TRUE(bit_equal(rows(va.features, t, t + 1), sb.features)) << "features of verify row " << t;
      EXPECT_EQ(va.next[static_cast<size_t>(t)], sb.next[0]);
    }
    // After the commit both continue alike, bit for bit.
    for (int32_t tok : after) {
      const ExtendResult na = a.dec->extend({0}, {{tok}}, commit), nb = b.dec->extend({0}, {{tok}}, commit);
      EXPECT_TRUE(bit_equal(na.logits, nb.logits)) << "after commit(" << n << ")";
    }
  }
}

TEST(CudaDecoder, SpeculativeEqualsGreedyOnTheGpu) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  Gpu g(c, KernelPolicy::Auto, 1, 256);
  const std::vector<int32_t> prompt = random_tokens(40, c.vocab_size, 7);
  bench::GenerateOptions go;
  go.max_new_tokens = 90;
  go.block_size = 8;
  const std::vector<int32_t> want = oracle_equals_greedy(g, c, prompt, go);
  // The CUDA proposer of an untrained drafter (a full and a sliding layer).
  drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(c, 2, c.vocab_size - 1, 16);
  dc.layer_types[1] = drafter::AttnType::Sliding;
  dc.sliding_window = 24;
  const drafter::DrafterWeights w = drafter::DrafterWeights::random(dc, 5, 0.05f);
  auto prop = drafter::make_cuda_proposer(dc, w, g.model->weights().embed_tokens, g.model->weights().lm_head,
                                          Device::cuda(0), 1, 256);
  for (int64_t B : {2, 16}) {
    go.block_size = B;
    const bench::Generation s2 = bench::speculative_generate(*g.dec, *prop, 0, prompt, go);
    EXPECT_EQ(s2.tokens, want) << "block " << B;
  }
  go.block_size = 4;
  const bench::Generation one = bench::speculative_generate(*g.dec, *prop, 0, {prompt[0]}, go);
  const bench::Generation one_g = bench::greedy_generate(*g.dec, 0, {prompt[0]}, go);
  EXPECT_EQ(one.tokens, one_g.tokens) << "a prompt of one token";
}

// CUDA graphs (decode_cuda.cpp): a decoder that replays its decode / verify steps as graphs gives
// the logits, features and next tokens of one that launches the same kernels eagerly, bit for bit,
// over decode steps of 3 and 1 slots, verifies of block 16 with commits of different lengths, key
// bounds in two split buckets (the graph's extra splits add exact zeros), and a profiled step (eager
// with graphs on: counted). The graphs did run: shapes captured, steps replayed, no capture failed.
TEST(CudaDecoder, GraphReplayEqualsEagerLaunchesBitForBit) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  Gpu e(c, KernelPolicy::Auto, 3, 400, 3, Precision::Bf16, false), g(c, KernelPolicy::Auto, 3, 400, 3, Precision::Bf16, true);
  EXPECT_EQ(e.dec->describe().find("CUDA graphs"), std::string::npos);
  EXPECT_NE(g.dec->describe().find("decode / verify steps as CUDA graphs"), std::string::npos);
  const auto [commit, verify] = commit_and_verify(c);
  int64_t step = 0;
  auto same = [&](const ExtendResult& a, const ExtendResult& b, const std::string& what) {
    EXPECT_EQ(a.next, b.next) << what << " (step " << step << ")";
    EXPECT_TRUE(bit_equal(a.logits, b.logits)) << "logits of " << what << " (step " << step << ")";
    EXPECT_TRUE(bit_equal(a.features, b.features)) << "features of " << what << " (step " << step << ")";
    ++step;
  };
  const std::vector<int32_t> slots{0, 1, 2};
  std::vector<std::vector<int32_t>> prompts{random_tokens(100, c.vocab_size, 11), random_tokens(60, c.vocab_size, 12),
                                            random_tokens(120, c.vocab_size, 13)};
  same(e.dec->extend(slots, prompts, commit), g.dec->extend(slots, prompts, commit), "prefill");
  std::vector<std::vector<int32_t>> next(3);
  auto decode = [&](const std::vector<int32_t>& ss, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      std::vector<std::vector<int32_t>> toks;
      for (int32_t sl : ss) toks.push_back({random_tokens(1, c.vocab_size, 100 + 7 * step + sl)[0]});
      same(e.dec->extend(ss, toks, commit), g.dec->extend(ss, toks, commit), "decode");
    }
  };
  decode(slots, 5);  // key bound 126: 2 splits of 64
  for (int64_t n : {3, 16, 1, 1, 16}) {  // the key bound passes 128: 4 splits; commits replayed from the 4th
    std::vector<std::vector<int32_t>> blocks;
    for (int32_t sl : slots) blocks.push_back(random_tokens(16, c.vocab_size, 200 + step + sl));
    same(e.dec->extend(slots, blocks, verify), g.dec->extend(slots, blocks, verify), "verify");
    for (int32_t sl : slots) {
      const int64_t keep = std::max<int64_t>(1, n - sl);
      e.dec->commit(sl, keep);
      g.dec->commit(sl, keep);
    }
    decode(slots, 2);
  }
  decode({1}, 3);
  OpProfiler prof;
  g.model->set_profiler(&prof);
  decode(slots, 1);
  g.model->set_profiler(nullptr);
  (void)prof.collect();
  decode(slots, 2);
  const GraphStats gs = g.dec->graph_stats(), es = e.dec->graph_stats();
  EXPECT_EQ(gs.capture_failures, 0u);
  EXPECT_GE(gs.captures, 4u) << g.dec->kernels_run();  // decode x2 key bounds, verify, decode of one slot
  EXPECT_GE(gs.replays, 10u) << g.dec->kernels_run();
  EXPECT_GE(gs.eager, 1u);
  EXPECT_NE(g.dec->kernels_run().find("an op profiler is set"), std::string::npos) << g.dec->kernels_run();
  EXPECT_EQ(es.captures + es.replays + es.eager, 0u);
  EXPECT_EQ(e.dec->length(0), g.dec->length(0));
}

// Speculative decoding with graphs on (verify and decode steps replayed) gives the greedy output of
// the same target launched eagerly, token for token, with the CUDA proposer of an untrained drafter.
TEST(CudaDecoder, SpeculativeWithGraphsEqualsEagerGreedy) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  Gpu e(c, KernelPolicy::Auto, 1, 256, 3, Precision::Bf16, false), g(c, KernelPolicy::Auto, 1, 256, 3, Precision::Bf16, true);
  const std::vector<int32_t> prompt = random_tokens(40, c.vocab_size, 7);
  bench::GenerateOptions go;
  go.max_new_tokens = 60;
  go.block_size = 16;
  const bench::Generation want = bench::greedy_generate(*e.dec, 0, prompt, go);
  const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(c, 2, c.vocab_size - 1, 16);
  const drafter::DrafterWeights w = drafter::DrafterWeights::random(dc, 5, 0.05f);
  auto prop = drafter::make_cuda_proposer(dc, w, g.model->weights().embed_tokens, g.model->weights().lm_head,
                                          Device::cuda(0), 1, 256);
  const bench::Generation spec = bench::speculative_generate(*g.dec, *prop, 0, prompt, go);
  EXPECT_EQ(spec.tokens, want.tokens);
  EXPECT_EQ(bench::greedy_generate(*g.dec, 0, prompt, go).tokens, want.tokens) << "greedy with graphs";
  EXPECT_GT(g.dec->graph_stats().replays, 0u) << g.dec->kernels_run();
  EXPECT_EQ(g.dec->graph_stats().capture_failures, 0u);
}

// Speculative decoding with an FP8 proposer (make_cuda_proposer's fp8_propose: other drafts, the
// target's output unchanged) gives the target's greedy output token for token, with graphs on; on an
// FP8 target too (its decode and verify GEMMs then stream FP8 weights as well, with the plan's skinny
// GEMMs on).
TEST(CudaDecoder, Fp8ProposeStaysLossless) {
  DFLASH_REQUIRE_GPU();
  if (!fp8_gemm_supported(cuda_device_info(0).major)) GTEST_SKIP() << "FP8 GEMMs need sm_90";
  const TargetConfig c = real_dims();
  const std::vector<int32_t> prompt = random_tokens(40, c.vocab_size, 9);
  bench::GenerateOptions go;
  go.max_new_tokens = 60;
  go.block_size = 16;
  const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(c, 2, c.vocab_size - 1, 16);
  const drafter::DrafterWeights w = drafter::DrafterWeights::random(dc, 5, 0.05f);
  for (Precision p : {Precision::Bf16, Precision::Fp8}) {
    SCOPED_TRACE(p == Precision::Fp8 ? "fp8 target, skinny GEMMs" : "bf16 target");
    Gpu g(c, KernelPolicy::Auto, 1, 256, 3, p, true, false, p == Precision::Fp8);
    const bench::Generation want = bench::greedy_generate(*g.dec, 0, prompt, go);
    auto prop = drafter::make_cuda_proposer(dc, w, g.model->weights().embed_tokens, g.model->weights().lm_head,
                                            Device::cuda(0), 1, 256, true);
    const bench::Generation spec = bench::speculative_generate(*g.dec, *prop, 0, prompt, go);
    EXPECT_EQ(spec.tokens, want.tokens);
    EXPECT_EQ(g.dec->graph_stats().capture_failures, 0u);
  }
}

// The FP8 target decodes like the bf16 one: verify rows equal T = 1 decode steps bit for bit (the
// rows are padded to 16 and quantized per token, so a row's GEMM inputs do not depend on the others),
// and speculative decoding gives the FP8 target's own greedy output token for token.
TEST(CudaDecoder, Fp8VerifyEqualsDecodeAndSpeculativeEqualsGreedy) {
  DFLASH_REQUIRE_GPU();
  if (!fp8_gemm_supported(cuda_device_info(0).major)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  const TargetConfig c = real_dims();
  const std::vector<int32_t> prompt = random_tokens(120, c.vocab_size, 2), block = random_tokens(16, c.vocab_size, 3);
  ExtendOptions commit;
  commit.logits = true;
  ExtendOptions verify = commit;
  verify.commit = false;
  Gpu a(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8), b(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8);
  EXPECT_NE(a.model->plan().summary().find("fp8 GEMMs"), std::string::npos);
  a.dec->extend({0}, {prompt}, commit);
  b.dec->extend({0}, {prompt}, commit);
  const ExtendResult va = a.dec->extend({0}, {block}, verify);
  for (int64_t t = 0; t < 5; ++t) {
    const ExtendResult sb = b.dec->extend({0}, {{block[static_cast<size_t>(t)]}}, commit);
    EXPECT_TRUE(bit_equal(rows(va.logits, t, t + 1), sb.logits)) << "fp8 logits of verify row " << t;
  }
  Gpu g(c, KernelPolicy::Auto, 1, 256, 3, Precision::Fp8);
  bench::GenerateOptions go;
  go.max_new_tokens = 60;
  go.block_size = 8;
  oracle_equals_greedy(g, c, prompt, go);
  // What ran is the FP8 plan's: the decode counters saw only fast gemm steps.
  EXPECT_EQ(g.model->counters().get(Step::Gemm, Path::Fallback), 0u);
}

// The FP8 target's fused GatedDeltaNet chain (writing out_proj's quantized input) and its fused commit
// (on the side stream, CUDA graphs on) give the unfused kernels' logits and features bit for bit:
// prefill, a verify of 16, commits of 1 / 5 / 16 accepted tokens, then decode steps.
TEST(CudaDecoder, Fp8FusedChainAndCommitEqualTheUnfusedKernels) {
  DFLASH_REQUIRE_GPU();
  const int sm = cuda_device_info(0).major;
  if (!fp8_gemm_supported(sm)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  const TargetConfig c = real_dims();
  const std::vector<int32_t> prompt = random_tokens(200, c.vocab_size, 2), block = random_tokens(16, c.vocab_size, 3);
  const std::vector<int32_t> after = random_tokens(4, c.vocab_size, 4);
  const auto [commit, verify] = commit_and_verify(c);
  for (int64_t n : {1, 5, 16}) {
    Gpu f(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8), u(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8, true,
                                                                  false, false, true);
    ASSERT_TRUE(make_decode_plan(c, Device::cuda(0), {}, sm, Precision::Fp8).fusion.gdn_chain);
    auto same = [&](const ExtendResult& a, const ExtendResult& b, const std::string& what) {
      EXPECT_TRUE(bit_equal(a.logits, b.logits)) << "logits, " << what << " (n " << n << ")";
      EXPECT_TRUE(bit_equal(a.features, b.features)) << "features, " << what << " (n " << n << ")";
      EXPECT_EQ(a.next, b.next) << what;
    };
    same(f.dec->extend({0}, {prompt}, commit), u.dec->extend({0}, {prompt}, commit), "prefill");
    same(f.dec->extend({0}, {block}, verify), u.dec->extend({0}, {block}, verify), "verify");
    f.dec->commit(0, n);
    u.dec->commit(0, n);
    for (int32_t tok : after)
      same(f.dec->extend({0}, {{tok}}, commit), u.dec->extend({0}, {{tok}}, commit), "decode after commit");
    // Twice the same verify shape: the second replays its graph (and the commit's after it).
    same(f.dec->extend({0}, {block}, verify), u.dec->extend({0}, {block}, verify), "second verify");
    f.dec->commit(0, n);
    u.dec->commit(0, n);
    same(f.dec->extend({0}, {{after[0]}}, commit), u.dec->extend({0}, {{after[0]}}, commit), "decode after 2nd commit");
    EXPECT_EQ(f.dec->graph_stats().capture_failures, 0u);
  }
}

// Two decoders on the same weights that must compute alike: a prefill, then twice (the second round replays
// the captured graphs) a verify of `block`, a commit of 5 and decode steps of `after`, each step's logits,
// features and next tokens equal bit for bit.
void expect_every_step_bit_for_bit(Gpu& on, Gpu& off, const TargetConfig& c) {
  const std::vector<int32_t> prompt = random_tokens(200, c.vocab_size, 2), block = random_tokens(16, c.vocab_size, 3);
  const std::vector<int32_t> after = random_tokens(3, c.vocab_size, 4);
  const auto [commit, verify] = commit_and_verify(c);
  auto same = [&](const ExtendResult& a, const ExtendResult& b, const std::string& what) {
    EXPECT_TRUE(bit_equal(a.logits, b.logits)) << "logits, " << what;
    EXPECT_TRUE(bit_equal(a.features, b.features)) << "features, " << what;
    EXPECT_EQ(a.next, b.next) << what;
  };
  same(on.dec->extend({0}, {prompt}, commit), off.dec->extend({0}, {prompt}, commit), "prefill");
  for (int round = 0; round < 2; ++round) {
    same(on.dec->extend({0}, {block}, verify), off.dec->extend({0}, {block}, verify), "verify");
    on.dec->commit(0, 5);
    off.dec->commit(0, 5);
    for (int32_t tok : after) same(on.dec->extend({0}, {{tok}}, commit), off.dec->extend({0}, {{tok}}, commit), "decode");
  }
  EXPECT_EQ(on.dec->graph_stats().capture_failures, 0u);
  EXPECT_GT(on.dec->graph_stats().replays, 0u);
}

// The decode plan's L2 prefetches (DecodeFusion::prefetch: after each decode / verify GEMM the next
// GEMM's weights fetched into L2 on a side stream, cuda::prefetch_l2) change no bit: logits and
// features of a prefill, verifies, commits and decode steps (graphs captured, then replayed) equal
// the same steps without them, bf16 and FP8, with whole weights fetched (16 MiB: every projection of
// these dims fits) and with equal row prefixes (1 MiB shared by the parts of a fused projection).
TEST(CudaDecoder, L2PrefetchLeavesEveryStepBitForBit) {
  DFLASH_REQUIRE_GPU();
  const int sm = cuda_device_info(0).major;
  const TargetConfig c = real_dims();
  const int saved = cuda::tuning::decode_prefetch_mb;
  for (Precision precision : {Precision::Bf16, Precision::Fp8}) {
    if (precision == Precision::Fp8 && !fp8_gemm_supported(sm)) continue;
    for (int mb : {16, 1}) {
      SCOPED_TRACE(std::string(precision == Precision::Fp8 ? "fp8" : "bf16") + ", " + std::to_string(mb) + " MiB");
      cuda::tuning::decode_prefetch_mb = mb;
      Gpu on(c, KernelPolicy::Auto, 1, 400, 3, precision, true, false, false, false,
             [](FastPathPlan::DecodeFusion& f) { f.prefetch = true; }),
          off(c, KernelPolicy::Auto, 1, 400, 3, precision);
      ASSERT_FALSE(make_decode_plan(c, Device::cuda(0), {}, sm, precision).fusion.prefetch);  // (off by default)
      expect_every_step_bit_for_bit(on, off, c);
      // Every GEMM of a decode / verify step but the first was preceded by its prefetch (4 a layer, the
      // first layer's in-projection excepted): the steps above did prefetch.
      EXPECT_GE(on.model->l2_prefetches(), static_cast<uint64_t>(4 * c.num_hidden_layers - 1));
      EXPECT_EQ(off.model->l2_prefetches(), 0u);
    }
  }
  cuda::tuning::decode_prefetch_mb = saved;
}

// The packed FP8 decode copies (DecodeFusion::fp8_packed: the streaming kernel reads each projection in
// its packed unit layout, cuda::pack_stream_weight) change no bit: an FP8 target's prefill, verifies,
// commits and decode steps (graphs captured, then replayed) give the logits and features of the same
// steps on the row-major weights (both on the streaming kernel: DecodeFusion::skinny_gemm), and the
// steps did read the copies.
TEST(CudaDecoder, Fp8PackedWeightsLeaveEveryStepBitForBit) {
  DFLASH_REQUIRE_GPU();
  const int sm = cuda_device_info(0).major;
  if (!fp8_gemm_supported(sm)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  const TargetConfig c = real_dims();
  Gpu on(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8, true, false, false, false,
         [](FastPathPlan::DecodeFusion& f) { f.skinny_gemm = f.swiglu_gemm = f.fp8_packed = true; }),
      off(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8, true, false, false, false,
          [](FastPathPlan::DecodeFusion& f) { f.skinny_gemm = f.swiglu_gemm = true, f.fp8_packed = false; });
  ASSERT_FALSE(make_decode_plan(c, Device::cuda(0), {}, sm, Precision::Fp8).fusion.fp8_packed);  // (off by default)
  expect_every_step_bit_for_bit(on, off, c);
  // Every layer's four projections of the steps above read their packed copies (4 a layer, each step shape).
  EXPECT_GE(on.model->packed_gemms(), static_cast<uint64_t>(4 * c.num_hidden_layers));
  EXPECT_EQ(off.model->packed_gemms(), 0u);
}

// The FP8 target's bf16 GEMM parts on the side stream (DecodeFusion::fp8_side_gemms: the GatedDeltaNet in_proj's
// b|a on gemm_skinny beside the FP8 GEMM of qkv|z) change no bit against the same kernel on the main stream
// (both with the skinny GEMMs on, so the b|a GEMM is gemm_skinny either way): prefill, verifies, commits and
// decode steps, graphs captured and replayed; the steps did use the side stream (one GEMM a GatedDeltaNet layer
// and step shape). With the plan's cuBLASLt GEMMs beside it (the default), speculative decoding gives greedy's
// tokens.
TEST(CudaDecoder, Fp8SideGemmsLeaveEveryStepBitForBit) {
  DFLASH_REQUIRE_GPU();
  const int sm = cuda_device_info(0).major;
  if (!fp8_gemm_supported(sm)) GTEST_SKIP() << "block-scaled FP8 GEMMs need sm_90";
  const TargetConfig c = real_dims();
  Gpu on(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8, true, false, true),
      off(c, KernelPolicy::Auto, 1, 400, 3, Precision::Fp8, true, false, true, false,
          [](FastPathPlan::DecodeFusion& f) { f.fp8_side_gemms = false; });
  ASSERT_TRUE(make_decode_plan(c, Device::cuda(0), {}, sm, Precision::Fp8).fusion.fp8_side_gemms);  // (on by default)
  ASSERT_FALSE(make_decode_plan(c, Device::cuda(0), {}, sm, Precision::Bf16).fusion.fp8_side_gemms);
  expect_every_step_bit_for_bit(on, off, c);
  EXPECT_GE(on.model->side_gemms(), static_cast<uint64_t>(c.count_layers(LayerType::LinearAttention)));
  EXPECT_EQ(off.model->side_gemms(), 0u);
  Gpu g(c, KernelPolicy::Auto, 1, 256, 3, Precision::Fp8);
  bench::GenerateOptions go;
  go.max_new_tokens = 40;
  go.block_size = 8;
  oracle_equals_greedy(g, c, random_tokens(120, c.vocab_size, 2), go);
  EXPECT_GT(g.model->side_gemms(), 0u);
}

// An MoE target (real_dims_moe: 16 experts, top 4, a shared expert; kernels/cuda/moe.h) decodes like
// the dense one: a verify of 16 tokens gives each row's logits and features bit for bit as T = 1
// decode steps (a decode step routes its one real row, its 15 pad rows none; a verify routes 16),
// and the states continue alike after commit; speculative decoding gives the target's own greedy
// output token for token with oracle drafts of every acceptance length and with the CUDA proposer,
// CUDA graphs replaying the decode / verify steps (the grouped expert GEMMs are captured), equal to
// eager greedy decoding. All of it on the grouped GEMMs and again on the MoE decode kernels
// (cuda::MoeImpl::Decode), whose decode logits agree with the grouped path's to rounding.
TEST(CudaDecoder, MoeVerifyEqualsDecodeAndSpeculativeEqualsGreedy) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims_moe();
  const std::vector<int32_t> prompt = random_tokens(150, c.vocab_size, 2), block = random_tokens(16, c.vocab_size, 3);
  const auto [commit, verify] = commit_and_verify(c);
  const std::vector<int32_t> p40(prompt.begin(), prompt.begin() + 40);
  std::vector<int32_t> grouped_tokens;
  for (bool md : {false, true}) {
    SCOPED_TRACE(md ? "MoE decode kernels" : "grouped GEMMs");
    for (int64_t n : {1, 6, 16}) {
      Gpu a(c, KernelPolicy::Auto, 1, 400, 3, Precision::Bf16, true, md),
          b(c, KernelPolicy::Auto, 1, 400, 3, Precision::Bf16, true, md);
      EXPECT_EQ(a.model->plan().moe_kernel, "moe_grouped_mma") << a.model->plan().moe;
      a.dec->extend({0}, {prompt}, commit);
      b.dec->extend({0}, {prompt}, commit);
      const ExtendResult va = a.dec->extend({0}, {block}, verify);
      a.dec->commit(0, n);
      for (int64_t t = 0; t < n; ++t) {
        const ExtendResult sb = b.dec->extend({0}, {{block[static_cast<size_t>(t)]}}, commit);
        EXPECT_TRUE(bit_equal(rows(va.logits, t, t + 1), sb.logits)) << "moe logits of verify row " << t << " (n " << n << ")";
        EXPECT_TRUE(bit_equal(rows(va.features, t, t + 1), sb.features)) << "moe features of verify row " << t;
      }
      for (int32_t tok : random_tokens(3, c.vocab_size, 4)) {
        const ExtendResult na = a.dec->extend({0}, {{tok}}, commit), nb = b.dec->extend({0}, {{tok}}, commit);
        EXPECT_TRUE(bit_equal(na.logits, nb.logits)) << "moe, after commit(" << n << ")";
      }
    }
    if (md) {
      // The decode kernels' logits against the grouped path's: the first decode step after the same
      // prefill (the same states: the MoE blocks' rounding alone) within 2e-2; later steps continue
      // from states that already differ (and a near-tie routing may flip: on an H200 three of 16
      // steps ended 2.2e-2 .. 0.14 apart, h200-moe6-c4bc6aa), so they are printed and held finite.
      Gpu a(c, KernelPolicy::Auto, 1, 400, 3, Precision::Bf16, true, false),
          b(c, KernelPolicy::Auto, 1, 400, 3, Precision::Bf16, true, true);
      a.dec->extend({0}, {prompt}, commit);
      b.dec->extend({0}, {prompt}, commit);
      std::string errs;
      for (size_t t = 0; t < block.size(); ++t) {
        const ExtendResult ga = a.dec->extend({0}, {{block[t]}}, commit), gb = b.dec->extend({0}, {{block[t]}}, commit);
        const double e = max_rel_err(gb.logits.to(Device::cpu()), ga.logits.to(Device::cpu()));
        if (t == 0) {
          EXPECT_LE(e, 2e-2) << "decode-kernel logits vs the grouped path's, first decode step";
        }
        EXPECT_TRUE(std::isfinite(e)) << "decode step " << t;
        char buf[32];
        std::snprintf(buf, sizeof(buf), " %.2e", e);
        errs += buf;
      }
      std::printf("moe decode-kernel vs grouped logits, max rel err per decode step:%s\n", errs.c_str());
    }
    Gpu e(c, KernelPolicy::Auto, 1, 256, 3, Precision::Bf16, false, md),
        g(c, KernelPolicy::Auto, 1, 256, 3, Precision::Bf16, true, md);
    bench::GenerateOptions go;
    go.max_new_tokens = 60;
    go.block_size = 8;
    const std::vector<int32_t> want = oracle_equals_greedy(g, c, p40, go);
    EXPECT_EQ(bench::greedy_generate(*e.dec, 0, p40, go).tokens, want) << "eager greedy";
    const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(c, 2, c.vocab_size - 1, 16);
    const drafter::DrafterWeights w = drafter::DrafterWeights::random(dc, 5, 0.05f);
    auto prop = drafter::make_cuda_proposer(dc, w, g.model->weights().embed_tokens, g.model->weights().lm_head,
                                            Device::cuda(0), 1, 256);
    for (int64_t B : {4, 16}) {
      go.block_size = B;
      EXPECT_EQ(bench::speculative_generate(*g.dec, *prop, 0, p40, go).tokens, want) << "block " << B;
    }
    EXPECT_GT(g.dec->graph_stats().replays, 0u) << g.dec->kernels_run();
    EXPECT_EQ(g.dec->graph_stats().capture_failures, 0u);
    if (!md) grouped_tokens = want;
    else {
      int64_t same = 0;
      for (size_t i = 0; i < std::min(grouped_tokens.size(), want.size()) && grouped_tokens[i] == want[i]; ++i) ++same;
      std::printf("moe greedy decoding, decode kernels vs grouped: first %lld of %zu tokens equal\n",
                  static_cast<long long>(same), want.size());
    }
  }
  // Decoding on every fallback kernel (the per-expert loop reads the counts back: eager) runs its
  // steps too; its tokens follow other roundings, so only their agreement is printed.
  Gpu f(c, KernelPolicy::Fallback, 1, 256, 3, Precision::Bf16, false);
  EXPECT_EQ(f.model->plan().moe_kernel, "moe_loop_gemm_bf16");
  bench::GenerateOptions go;
  go.max_new_tokens = 60;
  go.block_size = 8;
  const std::vector<int32_t> fb = bench::greedy_generate(*f.dec, 0, p40, go).tokens;
  ASSERT_EQ(fb.size(), grouped_tokens.size());
  int64_t same = 0;
  for (size_t i = 0; i < std::min(fb.size(), grouped_tokens.size()) && fb[i] == grouped_tokens[i]; ++i) ++same;
  std::printf("moe greedy decoding, fallback kernels vs grouped: first %lld of %zu tokens equal\n",
              static_cast<long long>(same), grouped_tokens.size());
}

// FP8 experts (store_moe_experts_fp8, --fp8-experts; W8A16): a target whose routed experts are e4m3
// codes with block scales computes, bit for bit, what the same target with bf16 experts holding the
// codes' dequantized values computes: the prefill forward and the decode and verify steps, on the
// grouped GEMMs (which read the codes, or a bf16 copy for large prefills on sm_90) and on the MoE
// decode kernels (moe_decode on). The shared expert runs apart in both (its bf16 GEMMs): a step on
// bf16 experts otherwise takes it into the grouped GEMMs' launches (moe_fuse_shared), FP8 codes do
// not, and the two placements sum its products in different orders.
TEST(CudaDecoder, MoeFp8ExpertsEqualTheirBf16Values) {
  DFLASH_REQUIRE_GPU();
  struct SharedApart {
    SharedApart() { cuda::tuning::moe_fuse_shared = 0; }
    ~SharedApart() { cuda::tuning::moe_fuse_shared = -1; }
  } shared_apart;
  const TargetConfig c = real_dims_moe();
  const int sm = cuda_device_info(0).major;
  TargetWeights wq = random_weights(c, 3, DType::BF16, Device::cuda(0)), wb = random_weights(c, 3, DType::BF16, Device::cuda(0));
  store_moe_experts_fp8(wq);
  const auto stream = DeviceContext::get(0).stream();
  for (size_t i = 0; i < wq.layers.size(); ++i) {  // wb's experts: wq's codes as bf16 values
    const MoeWeights& q = wq.layers[i].moe;
    MoeWeights& b = wb.layers[i].moe;
    ASSERT_TRUE(q.experts_gate_up_scale.defined());
    ASSERT_EQ(q.experts_gate_up.dtype(), DType::F8E4M3);
    const int64_t E = q.experts_gate_up.size(0), I2 = q.experts_gate_up.size(1), H = q.experts_gate_up.size(2);
    cuda::moe_dequantize_experts(q.experts_gate_up.raw_data(), q.experts_gate_up_scale.data<float>(), E, I2, H, I2 / 2,
                                 b.experts_gate_up.raw_data(), stream);
    cuda::moe_dequantize_experts(q.experts_down.raw_data(), q.experts_down_scale.data<float>(), E, H, I2 / 2, H,
                                 b.experts_down.raw_data(), stream);
  }
  KernelPolicies pol;
  CudaTargetModel mq(c, std::move(wq), make_plan(c, Device::cuda(0), pol, sm)), mb(c, std::move(wb), make_plan(c, Device::cuda(0), pol, sm));
  ForwardOptions fo;
  fo.capture = {1, c.num_hidden_layers - 1};
  const std::vector<int32_t> prompt = random_tokens(150, c.vocab_size, 2), block = random_tokens(16, c.vocab_size, 3);
  const ForwardResult fq = mq.forward({prompt}, fo), fb = mb.forward({prompt}, fo);
  for (int64_t id : fo.capture) EXPECT_TRUE(bit_equal(fq.layers.at(id), fb.layers.at(id))) << "prefill layer " << id;
  const auto [commit, verify] = commit_and_verify(c);
  for (bool md : {false, true}) {
    SCOPED_TRACE(md ? "MoE decode kernels" : "grouped GEMMs");
    FastPathPlan dp = make_decode_plan(c, Device::cuda(0), pol, sm);
    dp.fusion.moe_decode = md;
    auto dq = make_cuda_decoder(mq, 1, 400, dp), db = make_cuda_decoder(mb, 1, 400, dp);
    dq->extend({0}, {prompt}, commit);
    db->extend({0}, {prompt}, commit);
    const ExtendResult vq = dq->extend({0}, {block}, verify), vb = db->extend({0}, {block}, verify);
    EXPECT_TRUE(bit_equal(vq.logits, vb.logits)) << "verify logits";
    for (int32_t tok : random_tokens(4, c.vocab_size, 4)) {
      const ExtendResult a = dq->extend({0}, {{tok}}, commit), b = db->extend({0}, {{tok}}, commit);
      EXPECT_TRUE(bit_equal(a.logits, b.logits)) << "decode logits";
      EXPECT_TRUE(bit_equal(a.features, b.features)) << "decode features";
    }
  }
}

// Several empty slots in one extend: one forward over the packed prompts (the forward's kernels,
// counted once per layer whatever the number of slots), the states written into each slot.
TEST(CudaDecoder, PackedPrefillMatchesTheCpuReference) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  const auto cpu = cpu_reference(c);
  int64_t gdn_layers = 0;
  for (LayerType t : c.layer_types) gdn_layers += t == LayerType::LinearAttention;
  struct Case {
    std::vector<int32_t> slots;
    std::vector<int64_t> lens;
    bool last_only;
  };
  // In order (the pool written in place), out of order (one copy per slot), runs of consecutive
  // slots (one copy per run); prompts shorter and longer than the conv's K - 1 and the 64-token chunk.
  const std::vector<Case> cases{{{2}, {200}, false},
                                {{5, 0, 3}, {3, 64, 1}, true},
                                {{5, 0, 3}, {200, 2, 17}, false},
                                {{0, 1, 2, 3, 4, 5, 6}, {1, 2, 3, 5, 64, 200, 17}, false},
                                {{0, 1, 2, 3, 4, 5, 6}, {1, 2, 3, 5, 64, 200, 17}, true},
                                {{4, 5, 0, 1, 2}, {17, 2, 200, 1, 5}, true}};
  for (KernelPolicy pol : {KernelPolicy::Auto, KernelPolicy::Fallback}) {
    Gpu g(c, pol, 8, 256), solo(c, pol, 8, 256);
    auto ref = make_cpu_decoder(*cpu, 8, 256);
    Agreement vs_cpu, vs_solo;
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& k = cases[ci];
      for (int32_t s = 0; s < 8; ++s) g.dec->reset(s), ref->reset(s), solo.dec->reset(s);
      std::vector<std::vector<int32_t>> prompts;
      for (size_t s = 0; s < k.slots.size(); ++s)
        prompts.push_back(random_tokens(k.lens[s], c.vocab_size, 100 + 10 * ci + s));
      ExtendOptions eo;
      eo.capture = {0, 3, c.num_hidden_layers - 1};
      eo.logits = true;
      eo.last_only = k.last_only;
      const std::string what = "case " + std::to_string(ci) + " (" + policy_name(pol) + ")";
      auto delta_rules = [&] {  // the forward's delta rule launches (prefill kernels), either path
        return g.model->counters().get(Step::DeltaRule, Path::Fast) + g.model->counters().get(Step::DeltaRule, Path::Fallback);
      };
      const uint64_t before = delta_rules();
      const ExtendResult rg = g.dec->extend(k.slots, prompts, eo), rc = ref->extend(k.slots, prompts, eo);
      EXPECT_EQ(delta_rules(), before + static_cast<uint64_t>(gdn_layers))
          << what << ": the prefill is not one forward";
      vs_cpu.add(rg, rc, what + " prefill");
      // The same prompts one slot at a time.
      for (size_t s = 0; s < k.slots.size(); ++s) {
        const ExtendResult one = solo.dec->extend({k.slots[s]}, {prompts[s]}, eo);
        const int64_t a = rg.offsets[s], b = rg.offsets[s + 1];
        ExtendResult part;
        part.offsets = {0, b - a};
        part.next.assign(rg.next.begin() + a, rg.next.begin() + b);
        part.logits = rows(rg.logits, a, b);
        part.features = rows(rg.features, a, b);
        vs_solo.add(part, one, what + " slot " + std::to_string(k.slots[s]) + " packed vs alone");
      }
      // Decode steps of all slots continue from the written states (the CPU's tokens fed to both).
      ExtendOptions step = eo;
      step.last_only = false;
      std::vector<std::vector<int32_t>> next;
      for (size_t s = 0; s < k.slots.size(); ++s) next.push_back({rc.next[static_cast<size_t>(rc.offsets[s + 1] - 1)]});
      for (int t = 0; t < 3; ++t) {
        const ExtendResult sg = g.dec->extend(k.slots, next, step), sc = ref->extend(k.slots, next, step);
        const ExtendResult so = solo.dec->extend(k.slots, next, step);
        vs_cpu.add(sg, sc, what + " decode step " + std::to_string(t));
        vs_solo.add(sg, so, what + " decode step " + std::to_string(t) + " after packed vs one-slot prefills");
        for (size_t s = 0; s < k.slots.size(); ++s) next[s] = {sc.next[s]};
      }
      for (size_t s = 0; s < k.slots.size(); ++s) EXPECT_EQ(g.dec->length(k.slots[s]), k.lens[s] + 3) << what;
    }
    std::printf("packed prefill (%s): vs cpu reference logits %.2e, features %.2e, next equal on %ld clear rows of %ld; "
                "vs one-slot prefills logits %.2e, features %.2e (%ld / %ld clear)\n",
                policy_name(pol), vs_cpu.logits, vs_cpu.features, static_cast<long>(vs_cpu.clear),
                static_cast<long>(vs_cpu.rows), vs_solo.logits, vs_solo.features, static_cast<long>(vs_solo.clear),
                static_cast<long>(vs_solo.rows));
    EXPECT_LE(vs_cpu.logits, kLogitsBound);
    EXPECT_LE(vs_cpu.features, kBf16Bound);
    EXPECT_LE(vs_solo.logits, kLogitsBound);
    EXPECT_LE(vs_solo.features, kBf16Bound);
    EXPECT_GT(vs_cpu.clear, vs_cpu.rows / 10) << "too few rows with a clear margin: the token comparison is vacuous";
  }
}

namespace {

// One row as ops::sample_rows defines its draw: z = logits / temperature, the nucleus, and
// x_v = z_v + G_v (the Gumbel-perturbed values whose argmax over the nucleus is the token).
struct Draw {
  std::vector<char> in;   // [V] in the nucleus
  std::vector<double> x;  // [V] z_v + G_v
  int64_t token = -1;
  double margin = 0;      // how far the nucleus mass is from top_p (nucleus_threshold)
};
Draw reference_draw(const float* logits, int64_t V, const ops::SampleParams& sp, uint64_t stream, int64_t pos) {
  std::vector<float> z(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) z[static_cast<size_t>(v)] = logits[v] / sp.temperature;
  Draw d;
  const float zc = ops::nucleus_threshold(z.data(), V, sp.top_p, &d.margin);
  d.in.resize(static_cast<size_t>(V));
  d.x.resize(static_cast<size_t>(V));
  double best = -INFINITY;
  for (int64_t v = 0; v < V; ++v) {
    const uint32_t bits = rng::bits(sp.seed, stream, static_cast<uint64_t>(pos * V + v));
    const double u = (static_cast<double>(bits >> 8) + 0.5) * 0x1p-24;
    d.x[static_cast<size_t>(v)] = static_cast<double>(z[static_cast<size_t>(v)]) - std::log(-std::log(u));
    d.in[static_cast<size_t>(v)] = z[static_cast<size_t>(v)] >= zc;
    if (d.in[static_cast<size_t>(v)] && d.x[static_cast<size_t>(v)] > best) best = d.x[static_cast<size_t>(v)], d.token = v;
  }
  return d;
}

// Whether two rows whose z differ by at most delta everywhere must draw the same token: the best x
// over the union of both nuclei lies in both and beats every other token of the union by > 2 delta.
bool same_draw_is_certain(const Draw& a, const Draw& b, double delta) {
  int64_t w = -1;
  double best = -INFINITY, second = -INFINITY;
  for (size_t v = 0; v < a.x.size(); ++v) {
    if (!a.in[v] && !b.in[v]) continue;
    if (a.x[v] > best) second = best, best = a.x[v], w = static_cast<int64_t>(v);
    else if (a.x[v] > second) second = a.x[v];
  }
  return w >= 0 && a.in[static_cast<size_t>(w)] && b.in[static_cast<size_t>(w)] && best - second > 2 * delta + 1e-6;
}

}  // namespace

// ExtendOptions::sample on the GPU: row of slot s at position p drawn with stream sample_streams[s]
// and position p (the token whose next token is drawn), as the CPU decoder draws.
TEST(CudaDecoder, SamplingMatchesTheCpuReference) {
  DFLASH_REQUIRE_GPU();
  const TargetConfig c = real_dims();
  const int64_t V = c.vocab_size;
  const auto cpu = cpu_reference(c);
  Gpu g(c, KernelPolicy::Auto, 6, 128);
  auto ref = make_cpu_decoder(*cpu, 6, 128);
  ops::SampleParams sp;
  sp.temperature = 0.8f;
  sp.top_p = 0.9f;
  sp.seed = 1234;
  const std::vector<int32_t> slots{4, 0, 2, 5, 1};
  const std::vector<int64_t> lens{7, 1, 30, 12, 3};
  const std::vector<uint64_t> streams{11, 3, 900, 42, 7};
  std::vector<std::vector<int32_t>> prompts;
  for (size_t s = 0; s < slots.size(); ++s) prompts.push_back(random_tokens(lens[s], V, 60 + s));
  ExtendOptions eo;
  eo.sample = &sp;
  eo.sample_streams = streams;
  eo.logits = true;
  eo.last_only = true;
  int64_t drawn = 0, exact = 0, clear = 0;
  // Each GPU draw against the reference draw on the GPU's own logits (exact but for a nucleus mass
  // within 1e-5 of top_p, sampling.h), and against the CPU decoder's draw where the two decoders'
  // nuclei are the same set and the Gumbel gap is wider than twice the row's logit error (z units).
  auto check = [&](const ExtendResult& rg, const ExtendResult& rc, const std::vector<int64_t>& pos_of_first,
                   const std::string& what) {
    for (size_t s = 0; s < slots.size(); ++s)
      for (int64_t j = rg.offsets[s]; j < rg.offsets[s + 1]; ++j) {
        const int64_t pos = pos_of_first[s] + (j - rg.offsets[s]);
        const float* lg = rg.logits.data<float>() + j * V;
        const float* lc = rc.logits.data<float>() + j * V;
        const Draw dg = reference_draw(lg, V, sp, streams[s], pos), dc = reference_draw(lc, V, sp, streams[s], pos);
        ++drawn;
        EXPECT_EQ(rc.next[static_cast<size_t>(j)], dc.token) << what << ": the CPU decoder's draw";
        if (dg.margin > 1e-5) {  // (a flat row's margin is at most about one token's mass: ~1e-4 at V = 4096)
          ++exact;
          EXPECT_EQ(rg.next[static_cast<size_t>(j)], dg.token) << what << ", slot " << slots[s] << " position " << pos;
        }
        double err = 0;
        for (int64_t v = 0; v < V; ++v) err = std::max(err, std::abs(static_cast<double>(lg[v]) - lc[v]) / sp.temperature);
        if (same_draw_is_certain(dc, dg, err)) {
          ++clear;
          EXPECT_EQ(rg.next[static_cast<size_t>(j)], rc.next[static_cast<size_t>(j)])
              << what << ", slot " << slots[s] << " position " << pos << ": z error " << err;
        }
      }
  };
  const ExtendResult pg = g.dec->extend(slots, prompts, eo), pc = ref->extend(slots, prompts, eo);
  std::vector<int64_t> last(slots.size());
  for (size_t s = 0; s < slots.size(); ++s) last[s] = lens[s] - 1;
  check(pg, pc, last, "prefill");
  ExtendOptions step = eo;
  step.last_only = false;
  ExtendOptions alone = step;
  alone.commit = false;
  std::vector<std::vector<int32_t>> next;
  for (size_t s = 0; s < slots.size(); ++s) next.push_back({pc.next[s]});
  for (int t = 0; t < 4; ++t) {
    // Slot slots[t % 5] alone first (a verify: nothing is written), then all five: the same stream
    // and position give the same logits bit for bit (rows padded to 16 either way) and the same draw.
    const size_t x = static_cast<size_t>(t) % slots.size();
    alone.sample_streams = {streams[x]};
    const ExtendResult one = g.dec->extend({slots[x]}, {next[x]}, alone);
    std::vector<int64_t> pos(slots.size());
    for (size_t s = 0; s < slots.size(); ++s) pos[s] = g.dec->length(slots[s]);
    const ExtendResult sg = g.dec->extend(slots, next, step), sc = ref->extend(slots, next, step);
    EXPECT_TRUE(bit_equal(one.logits, rows(sg.logits, static_cast<int64_t>(x), static_cast<int64_t>(x) + 1)))
        << "step " << t << ": slot " << slots[x] << " alone vs in a batch of 5";
    EXPECT_EQ(one.next[0], sg.next[x]) << "step " << t << ": slot " << slots[x] << " alone vs in a batch of 5";
    check(sg, sc, pos, "decode step " + std::to_string(t));
    for (size_t s = 0; s < slots.size(); ++s) next[s] = {sc.next[s]};
  }
  std::printf("sampling (T %.1f, top-p %.2f): %ld rows; GPU draw == reference draw on its logits on %ld; == CPU decoder "
              "on %ld clear rows\n",
              sp.temperature, sp.top_p, static_cast<long>(drawn), static_cast<long>(exact), static_cast<long>(clear));
  EXPECT_GT(exact, drawn * 3 / 4);
  EXPECT_GT(clear, drawn / 4) << "too few rows with a clear decision: the comparison is vacuous";
}
