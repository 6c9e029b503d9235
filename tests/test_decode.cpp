// The target's incremental decoding (target_model/decode.h) on the CPU reference, on the two tiny
// checkpoints transformers made (tests/data/hf): extending a sequence in pieces of any sizes gives
// the hidden states and logits of one forward over the whole sequence; verify of B tokens then
// commit(n) equals extending by the n accepted tokens, for every n; several slots at once equal one
// at a time; bad input gets a clear error.
//
// Bounds: pieces vs one forward 1e-5 (max |a - b| / max |b| per captured layer and for the logits;
// the recurrent delta rule of the pool against the chunked one of the forward, and attention over
// the cache against the prefill kernel, sum in other orders); verify + commit vs plain extends 1e-6.
#include <gtest/gtest.h>

#include <numeric>

#include "core/rng.h"
#include "target_model/decode.h"
#include "target_model/model.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

const std::string kHf = std::string(DFLASH_TEST_DATA_DIR) + "/hf/";

struct Loaded {
  TargetConfig cfg;
  std::unique_ptr<TargetModel> model;
};
Loaded load(const std::string& name) {
  Loaded l;
  l.cfg = TargetConfig::from_file(kHf + name);
  l.model = std::make_unique<TargetModel>(l.cfg, load_weights(l.cfg, kHf + name, DType::F32, Device::cpu()));
  return l;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng::bits(seed, 7, static_cast<uint64_t>(i)) % vocab);
  return t;
}

std::vector<int64_t> all_layers(const TargetConfig& c) {
  std::vector<int64_t> v(static_cast<size_t>(c.num_hidden_layers));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Rows [a, b) of a 2-D host tensor.
Tensor rows(const Tensor& t, int64_t a, int64_t b) { return t.slice(0, a, b).contiguous(); }

class Decode : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(Decode, PiecesOfAnySizeEqualOneForward) {
  Loaded m = load(GetParam());
  const TargetConfig& c = m.cfg;
  const int64_t T = 60, H = c.hidden_size;
  const std::vector<int32_t> seq = random_tokens(T, c.vocab_size, 11);
  // The whole sequence at once (the forward, chunked delta rule), logits = final_norm · lm_headᵀ.
  ForwardOptions fo;
  fo.capture = all_layers(c);
  fo.final_norm = true;
  const ForwardResult full = m.model->forward({seq}, fo);
  Tensor ref_logits = Tensor::empty({T, c.vocab_size}, DType::F32);
  m.model->lm_head(full.final_hidden, ref_logits);

  for (const std::vector<int64_t>& pieces : {std::vector<int64_t>{1, 2, 7, 16, 34}, {60}, {1, 1, 1, 57}, {16, 16, 16, 12}}) {
    auto dec = make_cpu_decoder(*m.model, 2, 64);
    ExtendOptions eo;
    eo.capture = fo.capture;
    eo.logits = true;
    int64_t at = 0;
    double worst_h = 0, worst_l = 0;
    for (int64_t p : pieces) {
      const std::vector<int32_t> piece(seq.begin() + at, seq.begin() + at + p);
      const ExtendResult r = dec->extend({1}, {piece}, eo);
      ASSERT_EQ(r.offsets, (std::vector<int64_t>{0, p}));
      ASSERT_EQ(r.features.size(1), c.num_hidden_layers * H);
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const Tensor got = r.features.slice(1, l * H, (l + 1) * H).contiguous();
        worst_h = std::max(worst_h, max_rel_err(got, rows(full.layers.at(l), at, at + p)));
      }
      worst_l = std::max(worst_l, max_rel_err(r.logits, rows(ref_logits, at, at + p)));
      // The greedy next token is the argmax of those logits.
      for (int64_t j = 0; j < p; ++j) {
        const float* lj = r.logits.data<float>() + j * c.vocab_size;
        EXPECT_EQ(r.next[j], std::max_element(lj, lj + c.vocab_size) - lj);
      }
      at += p;
      EXPECT_EQ(dec->length(1), at);
      EXPECT_EQ(dec->length(0), 0);
    }
    std::printf("%s pieces of %zu: hidden %.2e, logits %.2e\n", GetParam().c_str(), pieces.size(), worst_h, worst_l);
    EXPECT_LE(worst_h, 1e-5);
    EXPECT_LE(worst_l, 1e-5);
  }
}

TEST_P(Decode, VerifyThenCommitEqualsExtendingByTheAcceptedTokens) {
  Loaded m = load(GetParam());
  const TargetConfig& c = m.cfg;
  const int64_t B = 8;
  const std::vector<int32_t> prompt = random_tokens(21, c.vocab_size, 3), block = random_tokens(B, c.vocab_size, 4);
  const std::vector<int32_t> next = random_tokens(5, c.vocab_size, 5);
  ExtendOptions commit, verify;
  commit.capture = verify.capture = all_layers(c);
  commit.logits = verify.logits = true;
  verify.commit = false;
  for (int64_t n = 1; n <= B; ++n) {
    auto a = make_cpu_decoder(*m.model, 1, 64), b = make_cpu_decoder(*m.model, 1, 64);
    a->extend({0}, {prompt}, commit);
    b->extend({0}, {prompt}, commit);
    // a: verify the block, keep n of it; b: extend by those n tokens directly.
    const ExtendResult va = a->extend({0}, {block}, verify);
    EXPECT_EQ(a->length(0), 21) << "a verify must not move the slot";
    a->commit(0, n);
    const ExtendResult vb = b->extend({0}, {std::vector<int32_t>(block.begin(), block.begin() + n)}, commit);
    ASSERT_EQ(a->length(0), b->length(0));
    // The verify's rows of the accepted tokens equal the direct extend's.
    EXPECT_LE(max_rel_err(rows(va.logits, 0, n), vb.logits), 1e-6) << "n = " << n;
    EXPECT_LE(max_rel_err(rows(va.features, 0, n), vb.features), 1e-6) << "n = " << n;
    // And the states after the commit continue alike.
    const ExtendResult na = a->extend({0}, {next}, commit), nb = b->extend({0}, {next}, commit);
    EXPECT_LE(max_rel_err(na.logits, nb.logits), 1e-6) << "n = " << n;
    EXPECT_LE(max_rel_err(na.features, nb.features), 1e-6) << "n = " << n;
    EXPECT_EQ(na.next, nb.next);
  }
}

TEST_P(Decode, SeveralSlotsAtOnceEqualOneAtATime) {
  Loaded m = load(GetParam());
  const TargetConfig& c = m.cfg;
  const std::vector<int32_t> p0 = random_tokens(9, c.vocab_size, 1), p1 = random_tokens(1, c.vocab_size, 2),
                             p2 = random_tokens(17, c.vocab_size, 3);
  ExtendOptions eo;
  eo.capture = {0, c.num_hidden_layers - 1};
  eo.logits = true;
  auto batch = make_cpu_decoder(*m.model, 4, 40);
  const ExtendResult rb = batch->extend({3, 0, 2}, {p0, p1, p2}, eo);
  ASSERT_EQ(rb.offsets, (std::vector<int64_t>{0, 9, 10, 27}));
  const int32_t slots[] = {3, 0, 2};
  const std::vector<int32_t>* ps[] = {&p0, &p1, &p2};
  for (int s = 0; s < 3; ++s) {
    auto one = make_cpu_decoder(*m.model, 1, 40);
    const ExtendResult r1 = one->extend({0}, {*ps[s]}, eo);
    EXPECT_LE(max_rel_err(rows(rb.logits, rb.offsets[s], rb.offsets[s + 1]), r1.logits), 1e-6) << "slot " << slots[s];
    EXPECT_LE(max_rel_err(rows(rb.features, rb.offsets[s], rb.offsets[s + 1]), r1.features), 1e-6);
  }
  // last_only: one row per slot, the last token's.
  eo.last_only = true;
  auto lo = make_cpu_decoder(*m.model, 4, 40);
  const ExtendResult rl = lo->extend({3, 0, 2}, {p0, p1, p2}, eo);
  ASSERT_EQ(rl.offsets, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_LE(max_rel_err(rl.logits.slice(0, 2, 3).contiguous(), rows(rb.logits, 26, 27)), 1e-6);
  EXPECT_EQ(rl.next[0], rb.next[8]);
  // A reset slot starts over.
  lo->reset(2);
  EXPECT_EQ(lo->length(2), 0);
  EXPECT_EQ(lo->length(3), 9);
  const ExtendResult again = lo->extend({2}, {p2}, eo);
  EXPECT_EQ(again.next, std::vector<int32_t>{rl.next[2]});
}

INSTANTIATE_TEST_SUITE_P(TinyHf, Decode, ::testing::Values("tiny_a", "tiny_b"));

TEST(DecodeErrors, BadInputNamesTheThing) {
  Loaded m = load("tiny_a");
  auto d = make_cpu_decoder(*m.model, 2, 10);
  ExtendOptions eo;
  auto has = [](const std::string& e, const std::string& part) { return e.find(part) != std::string::npos; };
  EXPECT_TRUE(has(error_of([&] { d->extend({2}, {{1}}, eo); }), "slot 2 is outside [0, 2)"));
  EXPECT_TRUE(has(error_of([&] { d->extend({0}, {{}}, eo); }), "no tokens for slot 0 (an empty prompt?)"));
  EXPECT_TRUE(has(error_of([&] { d->extend({0, 0}, {{1}, {2}}, eo); }), "slot 0 appears twice"));
  EXPECT_TRUE(has(error_of([&] { d->extend({1}, {std::vector<int32_t>(11, 1)}, eo); }),
                  "11 more exceed the 10 the state pool was sized for"));
  EXPECT_TRUE(has(error_of([&] { d->extend({0}, {{1, static_cast<int32_t>(m.cfg.vocab_size)}}, eo); }),
                  "is outside the vocabulary"));
  eo.capture = {m.cfg.num_hidden_layers};
  EXPECT_TRUE(has(error_of([&] { d->extend({0}, {{1}}, eo); }), "capture layer id"));
  eo.capture = {};
  EXPECT_TRUE(has(error_of([&] { d->commit(0, 1); }), "has no uncommitted extend"));
  eo.commit = false;
  d->extend({0}, {{1, 2, 3}}, eo);
  EXPECT_TRUE(has(error_of([&] { d->commit(0, 4); }), "commit of 4 token(s) on slot 0, whose extend brought 3"));
  d->commit(0, 2);
  EXPECT_EQ(d->length(0), 2);
}
