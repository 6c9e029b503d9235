// Batched generation (target_model/generate.h) and regeneration (data/regenerate.h) on the CPU
// reference, on the tiny checkpoint transformers made (tests/data/hf/tiny_a):
// - continuous batching over any slot count and prefill budget gives, per prompt, exactly the
//   tokens of decoding that prompt alone (the CPU reference computes each row on its own), also
//   with chunked prefill inside the decode steps (prompts cut into pieces that ride on decode steps);
// - stop tokens end a response (kept); sampling is reproducible whatever the batch and differs by seed;
// - regenerate writes prompt + response per input sequence in input order, counts what it skips,
//   continues from parts on disk (also another TP group's) to the same file, reuses a complete
//   output made with the same settings and refuses parts or outputs made with other ones.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "data/dataset.h"
#include "data/regenerate.h"
#include "core/rng.h"
#include "target_model/generate.h"
#include "target_model/model.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;
namespace fs = std::filesystem;

namespace {

const std::string kModel = std::string(DFLASH_TEST_DATA_DIR) + "/hf/tiny_a";

struct Loaded {
  TargetConfig cfg;
  std::unique_ptr<TargetModel> model;
};
const Loaded& tiny() {
  static Loaded l = [] {
    Loaded x;
    x.cfg = TargetConfig::from_file(kModel);
    x.model = std::make_unique<TargetModel>(x.cfg, load_weights(x.cfg, kModel, DType::F32, Device::cpu()));
    return x;
  }();
  return l;
}

// EXPECT_THROW_MSG(statement, text): the statement throws, and its message holds the text.
#define EXPECT_THROW_MSG(stmt, text)                                                           \
  do {                                                                                         \
    const std::string msg_ = error_of([&] { stmt; });                                          \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: '" << msg_ << "'\nwanted: " << (text); \
  } while (0)

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng::bits(seed, 3, static_cast<uint64_t>(i)) % vocab);
  return t;
}

std::vector<GenRequest> requests(int64_t n, int64_t vocab) {
  std::vector<GenRequest> r;
  for (int64_t i = 0; i < n; ++i) r.push_back({static_cast<uint64_t>(100 + i), random_tokens(1 + (i * 7) % 40, vocab, 50 + i)});
  return r;
}

// One prompt alone on a one-slot decoder: the plain loop.
std::vector<int32_t> alone(const std::vector<int32_t>& prompt, int64_t max_new, int64_t max_len) {
  auto dec = make_cpu_decoder(*tiny().model, 1, max_len);
  ExtendOptions o;
  o.last_only = true;
  std::vector<int32_t> out{dec->extend({0}, {prompt}, o).next.back()};
  while (static_cast<int64_t>(out.size()) < max_new) out.push_back(dec->extend({0}, {{out.back()}}, o).next.back());
  return out;
}

std::map<uint64_t, GenResult> run(const std::vector<GenRequest>& reqs, const GenerateConfig& gc, int64_t slots, int64_t max_len,
                                  GenStats* stats = nullptr) {
  auto dec = make_cpu_decoder(*tiny().model, slots, max_len);
  std::map<uint64_t, GenResult> out;
  const GenStats st = generate_batch(*dec, reqs, gc, [&](GenResult&& r) { out[r.id] = std::move(r); });
  if (stats) *stats = st;
  return out;
}

// The batching tests' requests (11 prompts of 1-36 tokens) and each one's tokens decoded alone
// (max_new 9, slots of 64 tokens), made once for the file.
constexpr int64_t kMaxNew = 9, kMaxLen = 64;
struct AloneOracle {
  std::vector<GenRequest> reqs;
  std::vector<std::vector<int32_t>> want;
};
const AloneOracle& alone_oracle() {
  static const AloneOracle o = [] {
    AloneOracle x;
    x.reqs = requests(11, tiny().cfg.vocab_size);
    for (const GenRequest& r : x.reqs) x.want.push_back(alone(r.prompt, kMaxNew, kMaxLen));
    return x;
  }();
  return o;
}

// Every request of the oracle came back, in its place, run to max_new, with the tokens of decoding it alone.
void expect_alone(const std::map<uint64_t, GenResult>& got, const std::string& what) {
  const AloneOracle& o = alone_oracle();
  ASSERT_EQ(got.size(), o.reqs.size()) << what;
  for (size_t i = 0; i < o.reqs.size(); ++i) {
    const GenResult& g = got.at(o.reqs[i].id);
    EXPECT_EQ(g.index, i) << what;
    EXPECT_FALSE(g.stopped) << what;
    EXPECT_EQ(g.tokens, o.want[i]) << "request " << i << ", " << what;
  }
}

}  // namespace

TEST(Generate, AnySlotsAndPrefillBudgetEqualDecodingEachPromptAlone) {
  const int64_t max_new = kMaxNew, max_len = kMaxLen;
  const std::vector<GenRequest>& reqs = alone_oracle().reqs;
  for (int64_t slots : {1, 3, 16})
    for (int64_t budget : {1, 50, 100000}) {
      GenerateConfig gc;
      gc.max_new_tokens = max_new;
      gc.prefill_tokens = budget;
      GenStats st;
      expect_alone(run(reqs, gc, slots, max_len, &st),
                   "slots " + std::to_string(slots) + ", prefill budget " + std::to_string(budget));
      EXPECT_EQ(st.sequences, 11);
      EXPECT_EQ(st.generated, 11 * max_new);
      EXPECT_LE(st.occupancy(), static_cast<double>(slots));
      if (budget == 1) {
        EXPECT_GE(st.prefills, 11);  // one prompt per prefill when the budget is below a prompt
      }
    }
}

// Chunked prefill inside the decode steps: prompts cut anywhere (budgets of 1 to 64 tokens per
// step, below and above a prompt's length) and mixed with other sequences' decode rows give each
// prompt the tokens of decoding it alone; small budgets starve no prompt (it waits for decodes to end).
TEST(Generate, ChunkedPrefillInsideDecodeStepsEqualsDecodingEachPromptAlone) {
  const int64_t max_new = kMaxNew, max_len = kMaxLen;
  const std::vector<GenRequest>& reqs = alone_oracle().reqs;
  int64_t mixed = 0;
  for (int64_t slots : {1, 3, 16})
    for (int64_t budget : {1, 2, 7, 64}) {
      GenerateConfig gc;
      gc.max_new_tokens = max_new;
      gc.step_tokens = budget;
      gc.prefill_tokens = budget;  // steps with nothing decoding cut prompts too (every sequence here ends together)
      GenStats st;
      expect_alone(run(reqs, gc, slots, max_len, &st),
                   "slots " + std::to_string(slots) + ", step tokens " + std::to_string(budget));
      int64_t prompt_tokens = 0;
      for (const GenRequest& r : reqs) prompt_tokens += static_cast<int64_t>(r.prompt.size());
      EXPECT_EQ(st.prompt_tokens, prompt_tokens);
      EXPECT_EQ(st.generated, 11 * max_new);
      // Every token generated after a sequence's first is one decode row.
      EXPECT_EQ(st.decode_rows, 11 * (max_new - 1)) << "slots " << slots << ", step tokens " << budget;
      EXPECT_LE(st.mixed_prompt_tokens, prompt_tokens);
      if (slots == 1) {
        EXPECT_EQ(st.mixed_steps, 0);  // one slot: its prompt's pieces run before its decode steps
      }
      mixed += st.mixed_steps;
    }
  EXPECT_GT(mixed, 0);  // pieces did ride on decode steps
}

// Requests with their own caps on new tokens (1 to 9, and 0 for the config's) end at different
// steps, so slots free and refill while others decode, under both schedules: each request gets the
// first tokens of decoding it alone, as many as its cap.
TEST(Generate, PerRequestCapsEndSequencesAtTheirOwnLengths) {
  const AloneOracle& o = alone_oracle();
  std::vector<GenRequest> reqs = o.reqs;
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].max_new_tokens = static_cast<int64_t>((i * 5) % 10);  // 0, 5, 1, 6, ...
  for (int64_t step_tokens : {0, 7})
    for (int64_t slots : {1, 4}) {
      GenerateConfig gc;
      gc.max_new_tokens = kMaxNew;
      gc.step_tokens = step_tokens;
      GenStats st;
      const auto got = run(reqs, gc, slots, kMaxLen, &st);
      const std::string what = "slots " + std::to_string(slots) + ", step tokens " + std::to_string(step_tokens);
      ASSERT_EQ(got.size(), reqs.size()) << what;
      int64_t generated = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        const int64_t n = reqs[i].max_new_tokens > 0 ? reqs[i].max_new_tokens : kMaxNew;
        const std::vector<int32_t> want(o.want[i].begin(), o.want[i].begin() + n);
        EXPECT_EQ(got.at(reqs[i].id).tokens, want) << "request " << i << ", " << what;
        generated += n;
      }
      EXPECT_EQ(st.generated, generated) << what;
    }
  // A cap the slot cannot hold, or a negative one, is refused naming the request.
  auto dec = make_cpu_decoder(*tiny().model, 1, 16);
  GenerateConfig gc;
  gc.max_new_tokens = 4;
  const auto ignore = [](GenResult&&) {};
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1, 2}, 15}}, gc, ignore), "request 0 (id 7): its 2-token prompt + 15 new tokens");
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1}, -2}}, gc, ignore), "request 0 (id 7) asks for -2 new tokens");
}

// With nothing decoding (the start, or a wave that ended together), or no more sequences decoding than
// prompts waiting with none of their tokens in, a chunked-prefill step takes up to prefill_tokens, not
// step_tokens: one wave of prompts that fit is one step of pieces alone (a packed prefill), then decode
// steps without pieces, as with separate prefills; a wave larger than prefill_tokens takes a second
// such step with its first prompts' decode rows; a prompt left part-way while more sequences decode
// goes on with step_tokens.
TEST(Generate, ChunkedPrefillWithFewSequencesDecodingTakesAPackedPrefillsBudget) {
  const int64_t V = tiny().cfg.vocab_size;
  std::vector<GenRequest> reqs;
  for (int64_t i = 0; i < 4; ++i) reqs.push_back({static_cast<uint64_t>(i), random_tokens(10, V, 70 + i)});
  GenerateConfig gc;
  gc.max_new_tokens = 5;
  gc.step_tokens = 3;  // below one prompt
  gc.prefill_tokens = 100;
  GenStats st;
  const auto got = run(reqs, gc, 4, 32, &st);
  EXPECT_EQ(st.prefills, 1);      // the 40 prompt tokens in one step
  EXPECT_EQ(st.mixed_steps, 0);
  EXPECT_EQ(st.decode_steps, 4);  // then every sequence decodes together
  for (const GenRequest& r : reqs) EXPECT_EQ(got.at(r.id).tokens, alone(r.prompt, 5, 32)) << "request id " << r.id;
  // A budget of 25: the first step takes prompts 0 and 1 and 5 tokens of prompt 2; the two decoding
  // sequences outnumber the one fresh prompt (3), so they leave one token a step to prompt 2 (steps 2-5).
  // When they end nothing decodes: step 6 takes the rest, prompt 2's last token and prompt 3 whole, and
  // the two decode together (steps 7-10).
  gc.prefill_tokens = 25;
  const auto cut = run(reqs, gc, 4, 32, &st);
  EXPECT_EQ(st.prefills, 2);
  EXPECT_EQ(st.mixed_steps, 4);
  EXPECT_EQ(st.mixed_prompt_tokens, 4);
  EXPECT_EQ(st.decode_steps, 8);
  for (const GenRequest& r : reqs) EXPECT_EQ(cut.at(r.id).tokens, alone(r.prompt, 5, 32)) << "request id " << r.id;
  // Six prompts in six slots, a budget of 20 (two prompts): step 1 takes prompts 0 and 1; two sequences
  // decode and four prompts wait, so step 2 takes 18 tokens (prompt 2, 8 of prompt 3) beside the two
  // decode rows; steps 3-5 (three decoding, two fresh prompts) have step_tokens 3, no room beside their
  // decode rows; after sequences 0 and 1 end, step 6 (one decoding, two fresh) takes 19 tokens (the rest
  // of prompt 3, prompt 4, 7 of prompt 5) and steps 7-9 one token each of prompt 5.
  for (int64_t i = 4; i < 6; ++i) reqs.push_back({static_cast<uint64_t>(i), random_tokens(10, V, 70 + i)});
  gc.prefill_tokens = 20;
  const auto wave = run(reqs, gc, 6, 32, &st);
  EXPECT_EQ(st.prefills, 1);
  EXPECT_EQ(st.mixed_steps, 5);
  EXPECT_EQ(st.mixed_prompt_tokens, 18 + 19 + 3);
  for (const GenRequest& r : reqs) EXPECT_EQ(wave.at(r.id).tokens, alone(r.prompt, 5, 32)) << "request id " << r.id;
}

// With step_tokens, sampling still depends on (seed, id, prompt) alone: equal to the separate prefills' draws.
TEST(Generate, ChunkedPrefillSamplesAsSeparatePrefills) {
  const int64_t V = tiny().cfg.vocab_size;
  const std::vector<GenRequest> reqs = requests(7, V);
  GenerateConfig gc;
  gc.max_new_tokens = 10;
  gc.sample = ops::SampleParams{0.9f, 0.95f, 5};
  const auto a = run(reqs, gc, 5, 64);
  gc.step_tokens = 6;
  const auto b = run(reqs, gc, 3, 64);
  for (const GenRequest& r : reqs) EXPECT_EQ(a.at(r.id).tokens, b.at(r.id).tokens) << "request id " << r.id;
}

TEST(Generate, StopTokenEndsTheResponseAndIsKept) {
  const int64_t V = tiny().cfg.vocab_size;
  const std::vector<GenRequest> reqs = requests(5, V);
  const std::vector<int32_t> ref = alone(reqs[2].prompt, 12, 64);
  GenerateConfig gc;
  gc.max_new_tokens = 12;
  gc.stop_tokens = {ref[3]};
  const auto got = run(reqs, gc, 2, 64);
  const GenResult& g = got.at(reqs[2].id);
  const size_t first = static_cast<size_t>(std::find(ref.begin(), ref.end(), ref[3]) - ref.begin());
  EXPECT_TRUE(g.stopped);
  EXPECT_EQ(g.tokens, std::vector<int32_t>(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(first) + 1));
  for (const auto& [id, r] : got) {
    if (r.stopped) EXPECT_EQ(r.tokens.back(), ref[3]);
    else EXPECT_EQ(static_cast<int64_t>(r.tokens.size()), 12);
  }
}

TEST(Generate, SamplingIsReproducibleWhateverTheBatchAndDependsOnTheSeed) {
  const int64_t V = tiny().cfg.vocab_size;
  const std::vector<GenRequest> reqs = requests(7, V);
  GenerateConfig gc;
  gc.max_new_tokens = 10;
  gc.sample = ops::SampleParams{0.9f, 0.95f, 5};
  const auto a = run(reqs, gc, 1, 64), b = run(reqs, gc, 5, 64);
  gc.prefill_tokens = 3;
  const auto c = run(reqs, gc, 7, 64);
  int64_t differs_from_greedy = 0, differs_by_seed = 0;
  gc.sample->seed = 6;
  const auto d = run(reqs, gc, 5, 64);
  for (const GenRequest& r : reqs) {
    EXPECT_EQ(a.at(r.id).tokens, b.at(r.id).tokens);
    EXPECT_EQ(a.at(r.id).tokens, c.at(r.id).tokens);
    differs_from_greedy += a.at(r.id).tokens != alone(r.prompt, 10, 64);
    differs_by_seed += a.at(r.id).tokens != d.at(r.id).tokens;
  }
  // Random-weight tiny logits are flat: 10 draws at temperature 0.9 all equal to greedy has
  // vanishing probability (and the seed must change them).
  EXPECT_GE(differs_from_greedy, 6);
  EXPECT_GE(differs_by_seed, 6);
}

TEST(Generate, BadRequestsAndConfigsAreRefused) {
  auto dec = make_cpu_decoder(*tiny().model, 2, 16);
  GenerateConfig gc;
  gc.max_new_tokens = 8;
  const auto ignore = [](GenResult&&) {};
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, random_tokens(9, 100, 1)}}, gc, ignore),
                   "request 0 (id 7): its 9-token prompt + 8 new tokens exceed the decoder's 16 tokens per slot");
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {}}}, gc, ignore), "request 0 (id 7) has an empty prompt");
  gc.stop_tokens = {static_cast<int32_t>(tiny().cfg.vocab_size)};
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1}}}, gc, ignore), "stop token");
  gc.stop_tokens.clear();
  gc.max_new_tokens = 0;
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1}}}, gc, ignore), "max new tokens = 0 must be >= 1");
  gc.max_new_tokens = 2;
  gc.step_tokens = -1;
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1}}}, gc, ignore), "step tokens = -1 must be >= 0");
  gc.step_tokens = 0;
  gc.sample = ops::SampleParams{0.0f, 1.0f, 0};
  EXPECT_THROW_MSG(generate_batch(*dec, {{7, {1}}}, gc, ignore), "temperature = 0 must be > 0");
}

// ---- regenerate ----

namespace {

struct RegenFixture : ::testing::Test {
  fs::path dir;
  std::string input;
  std::vector<data::Sequence> seqs;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("dflash_regen_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    input = (dir / "in.h5").string();
    const int64_t V = tiny().cfg.vocab_size;
    for (int64_t i = 0; i < 10; ++i) {
      data::Sequence s;
      s.ids = random_tokens(5 + i * 3, V, 900 + i);
      const int64_t plen = i == 3 ? 0 : i == 6 ? static_cast<int64_t>(s.ids.size()) : 1 + i;  // 3: no prompt; 6: all prompt
      s.mask.assign(s.ids.size(), 0);
      for (size_t t = static_cast<size_t>(plen); t < s.ids.size(); ++t) s.mask[t] = 1;
      seqs.push_back(s);
    }
    seqs[8].ids.resize(30);  // a long prompt (max_prompt_len below skips it)
    seqs[8].mask.assign(30, 0);
    data::DatasetWriter w(input, V);
    for (const auto& s : seqs) w.append(s);
    w.finish();
  }
  void TearDown() override { fs::remove_all(dir); }

  data::RegenerateOptions options(const std::string& out) const {
    data::RegenerateOptions o;
    o.inputs = {input};
    o.out = out;
    o.gen.max_new_tokens = 6;
    o.slots = 3;
    o.part_size = 3;
    o.max_prompt_len = 25;
    o.progress = false;
    o.target_identity = "tiny_a";
    return o;
  }
  data::RegenerateSummary regen(const data::RegenerateOptions& o, data::RegenerateLayout lay = {}) const {
    auto dec = make_cpu_decoder(*tiny().model, o.slots, data::regenerate_max_len(o));
    return data::regenerate(*dec, o, lay);
  }
  static std::vector<data::Sequence> read(const std::string& path) {
    const data::Dataset ds({path});
    std::vector<data::Sequence> v;
    for (int64_t i = 0; i < ds.num_sequences(); ++i) v.push_back(ds.sequence(i));
    return v;
  }
};

}  // namespace

TEST_F(RegenFixture, WritesPromptPlusTheTargetsResponseInInputOrderAndCountsTheSkipped) {
  const data::RegenerateOptions o = options((dir / "out.h5").string());
  const data::RegenerateSummary s = regen(o);
  EXPECT_TRUE(s.joined);
  EXPECT_EQ(s.sequences, 10);
  EXPECT_EQ(s.skipped_empty, 1);  // sequence 3
  EXPECT_EQ(s.skipped_long, 1);   // sequence 8
  EXPECT_EQ(s.written, 8);
  EXPECT_EQ(s.parts, 4);
  EXPECT_FALSE(fs::exists(o.out + ".parts"));
  EXPECT_TRUE(fs::exists(o.out + ".json"));
  const std::vector<data::Sequence> got = read(o.out);
  ASSERT_EQ(got.size(), 8u);
  size_t j = 0;
  int64_t gen = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (i == 3 || i == 8) continue;
    const std::vector<int32_t> p = data::prompt_of(seqs[i]);
    const std::vector<int32_t> r = alone(p, 6, 64);
    std::vector<int32_t> ids = p;
    ids.insert(ids.end(), r.begin(), r.end());
    std::vector<uint8_t> mask(p.size(), 0);
    mask.resize(ids.size(), 1);
    EXPECT_EQ(got[j].ids, ids) << "input sequence " << i;
    EXPECT_EQ(got[j].mask, mask) << "input sequence " << i;
    gen += static_cast<int64_t>(r.size());
    ++j;
  }
  EXPECT_EQ(s.generated, gen);
  // Made again with the same settings: reused, nothing done.
  const data::RegenerateSummary again = regen(o);
  EXPECT_TRUE(again.reused);
  EXPECT_TRUE(data::regenerated_file_matches(o));
  data::RegenerateOptions other = o;
  other.gen.max_new_tokens = 7;
  EXPECT_FALSE(data::regenerated_file_matches(other));
  EXPECT_THROW_MSG(regen(other), "exists and was not made with these settings (decoding.max_new_tokens: the parts were made with 6, this run has 7)");
}

TEST_F(RegenFixture, ContinuesFromPartsOnDiskToTheSameFile) {
  const data::RegenerateOptions whole = options((dir / "whole.h5").string());
  regen(whole);
  const data::RegenerateOptions o = options((dir / "out.h5").string());
  // TP group 0 of 2 makes parts 0 and 2 and stops (as a run killed after them would).
  data::RegenerateLayout g0;
  g0.group = 0, g0.num_groups = 2, g0.leader = false;
  const data::RegenerateSummary s0 = regen(o, g0);
  EXPECT_FALSE(s0.joined);
  EXPECT_TRUE(fs::exists(o.out + ".parts/part-000000.h5"));
  EXPECT_FALSE(fs::exists(o.out + ".parts/part-000001.h5"));
  EXPECT_TRUE(fs::exists(o.out + ".parts/part-000002.h5"));
  EXPECT_FALSE(fs::exists(o.out));
  // Other settings are refused while those parts are there.
  data::RegenerateOptions other = o;
  other.gen.sample = ops::SampleParams{1.0f, 1.0f, 0};
  EXPECT_THROW_MSG(regen(other), "holds parts of another regeneration (decoding.sampling");
  // One process continues: parts 1 and 3, then the join.
  const data::RegenerateSummary s = regen(o);
  EXPECT_EQ(s.parts_resumed, 2);
  EXPECT_EQ(s.gen.sequences, 3);  // parts 1 and 3: inputs 3..5 (3 has no prompt) and 9
  const auto a = read(whole.out), b = read(o.out);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].ids, b[i].ids) << i;
    EXPECT_EQ(a[i].mask, b[i].mask) << i;
  }
}

TEST_F(RegenFixture, SampledRegenerationIsTheSameWhateverTheSlotsTheScheduleAndTheParts) {
  data::RegenerateOptions a = options((dir / "a.h5").string()), b = options((dir / "b.h5").string()),
                          c = options((dir / "c.h5").string());
  a.gen.sample = b.gen.sample = c.gen.sample = ops::SampleParams{1.0f, 0.9f, 3};
  b.slots = 1;
  regen(a);
  b.part_size = 4;  // (another part size is another regeneration: its own file)
  regen(b);
  c.gen.step_tokens = 5;  // chunked prefill inside the decode steps
  regen(c);
  const auto x = read(a.out), y = read(b.out), z = read(c.out);
  ASSERT_EQ(x.size(), y.size());
  ASSERT_EQ(x.size(), z.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].ids, y[i].ids) << i;
    EXPECT_EQ(x[i].ids, z[i].ids) << i;
  }
}
