// The dflash.tokens.v1 format (writer, multi-file reader, validator), the training loader and the
// synthetic corpus. Bad files are crafted directly with the HDF5 C API, one defect each, and must
// each raise a dflash::Error naming the file, the dataset and the sequence.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/hdf5_check.h"
#include "data/loader.h"
#include "data/synth.h"
#include "core/error.h"
#include "raw_dataset.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace dflash;
using namespace dflash::data;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A fresh directory per test, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("dflash_test_data_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

Sequence seq(std::vector<int32_t> ids, std::vector<uint8_t> mask) { return Sequence{std::move(ids), std::move(mask)}; }

void write_file(const std::string& path, int64_t vocab, const std::vector<Sequence>& seqs, WriterOptions opt = {}) {
  DatasetWriter w(path, vocab, opt);
  for (const Sequence& s : seqs) w.append(s);
  w.finish();
}

// 4 valid sequences of lengths 3, 2, 4, 3.
RawFile good_raw() {
  RawFile r;
  r.ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  r.mask = {0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0};
  r.offsets = {0, 3, 5, 9, 12};
  return r;
}

// The error of validate_file and of opening the file as a Dataset (they must agree for defects of
// the structure; content defects are validate_file's alone).
std::string validate_error(const std::string& path) { return error_of([&] { validate_file(path); }); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// format

TEST(Dataset, RoundTripAcrossTwoFiles) {
  TempDir dir;
  std::vector<Sequence> a, b;
  for (int i = 0; i < 7; ++i) {
    Sequence s;
    for (int t = 0; t < 3 + 5 * i; ++t) {  // lengths 3..33: several chunks of 4 tokens per sequence
      s.ids.push_back((i * 31 + t * 7) % 100);
      s.mask.push_back(t % 3 != 0);
    }
    (i < 4 ? a : b).push_back(s);
  }
  write_file(dir.file("a.h5"), 100, a, WriterOptions{4, 4});
  write_file(dir.file("b.h5"), 100, b, WriterOptions{1000, 0});
  EXPECT_FALSE(fs::exists(dir.file("a.h5.tmp")));

  for (const std::vector<std::string>& specs : {std::vector<std::string>{dir.file("a.h5"), dir.file("b.h5")},
                                                std::vector<std::string>{dir.path.string()},
                                                std::vector<std::string>{dir.file("*.h5")}}) {
    Dataset ds(specs);
    ASSERT_EQ(ds.num_sequences(), 7);
    ASSERT_EQ(ds.files().size(), 2u);
    EXPECT_EQ(ds.vocab_size(), 100);
    int64_t tokens = 0;
    for (int i = 0; i < 7; ++i) {
      const Sequence& want = i < 4 ? a[i] : b[i - 4];
      Sequence got = ds.sequence(i);
      EXPECT_EQ(got.ids, want.ids) << "sequence " << i;
      EXPECT_EQ(got.mask, want.mask) << "sequence " << i;
      EXPECT_EQ(ds.length(i), static_cast<int64_t>(want.ids.size()));
      tokens += ds.length(i);
    }
    EXPECT_EQ(ds.num_tokens(), tokens);
    EXPECT_EQ(ds.locate(5), (std::pair<size_t, int64_t>{1, 1}));
    Sequence head = ds.sequence(6, 5);
    EXPECT_EQ(head.ids, std::vector<int32_t>(b[2].ids.begin(), b[2].ids.begin() + 5));
    EXPECT_TRUE(has(error_of([&] { ds.sequence(7); }), "sequence index 7 is outside [0, 7)"));
  }

  DatasetStats st = validate_file(dir.file("a.h5"), 5);  // odd block size: blocks straddle sequences
  EXPECT_EQ(st.sequences, 4);
  EXPECT_EQ(st.tokens, 3 + 8 + 13 + 18);
  int64_t sup = 0;
  for (const Sequence& s : a)
    for (uint8_t m : s.mask) sup += m;
  EXPECT_EQ(st.supervised, sup);
  EXPECT_EQ(st.min_length, 3);
  EXPECT_EQ(st.max_length, 18);
  EXPECT_EQ(st.histogram, (std::map<int, int64_t>{{1, 1}, {3, 2}, {4, 1}}));  // 3 | 8, 13 | 18
}

// The trainer's access pattern: whole sequences in random order from a compressed file of many chunks
// (the reader's chunk cache holds them all: data/dataset.cpp), each read twice, from two Datasets of the
// same file open at once (HDF5 shares their dataset objects), and truncated reads.
TEST(Dataset, RandomOrderReadsOfACompressedFile) {
  TempDir dir;
  std::vector<Sequence> seqs;
  for (int i = 0; i < 300; ++i) {
    Sequence s;
    for (int t = 0; t < 1 + (i * 37) % 90; ++t) {
      s.ids.push_back((i * 131 + t * 17) % 1000);
      s.mask.push_back((i + t) % 4 != 0);
    }
    seqs.push_back(s);
  }
  write_file(dir.file("c.h5"), 1000, seqs, WriterOptions{64, 6});
  Dataset a({dir.file("c.h5")}), b({dir.file("c.h5")});
  std::vector<int64_t> order;
  for (int k = 0; k < 2 * 300; ++k) order.push_back((k * 151) % 300);  // every index twice, scattered
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t i = order[k];
    const Dataset& ds = k % 3 == 0 ? b : a;
    const Sequence got = ds.sequence(i);
    ASSERT_EQ(got.ids, seqs[i].ids) << "sequence " << i;
    ASSERT_EQ(got.mask, seqs[i].mask) << "sequence " << i;
    const Sequence head = ds.sequence(i, 5);
    const size_t n = std::min<size_t>(5, seqs[i].ids.size());
    ASSERT_EQ(head.ids, std::vector<int32_t>(seqs[i].ids.begin(), seqs[i].ids.begin() + n)) << "sequence " << i;
  }
}

TEST(Dataset, WriterRejectsBadSequencesAndLeavesNoFileWhenAbandoned) {
  TempDir dir;
  const std::string path = dir.file("w.h5");
  {
    DatasetWriter w(path, 10);
    w.append(seq({1, 2}, {1, 1}));
    EXPECT_TRUE(has(error_of([&] { w.append(seq({1, 10}, {1, 1})); }), "sequence 1, position 1: token id 10 is outside"));
    EXPECT_TRUE(has(error_of([&] { w.append(seq({1, 2}, {1, 2})); }), "loss_mask value 2 is not 0 or 1"));
    EXPECT_TRUE(has(error_of([&] { w.append(seq({}, {})); }), "sequence 1 is empty"));
    EXPECT_TRUE(has(error_of([&] { w.append(seq({1, 2}, {1})); }), "has 2 input_ids but 1 loss_mask values"));
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_TRUE(has(error_of([&] { DatasetWriter w(path, 0); }), "vocab_size = 0"));
}

TEST(Dataset, ValidateAcceptsGoodRawFile) {
  TempDir dir;
  write_raw(dir.file("ok.h5"), good_raw());
  DatasetStats st = validate_file(dir.file("ok.h5"));
  EXPECT_EQ(st.sequences, 4);
  EXPECT_EQ(st.tokens, 12);
  EXPECT_EQ(st.supervised, 8);
  EXPECT_EQ(Dataset({dir.file("ok.h5")}).sequence(2).ids, (std::vector<int32_t>{6, 7, 8, 9}));
}

TEST(Dataset, ValidateNamesFileDatasetAndSequence) {
  TempDir dir;
  struct Case {
    const char* name;
    std::function<void(RawFile&)> spoil;
    std::vector<std::string> want;  // parts of the message
    bool structural;                // also refused by Dataset's constructor
  };
  const std::vector<Case> cases = {
      {"nonmonotonic", [](RawFile& r) { r.offsets = {0, 3, 2, 9, 12}; },
       {"/offsets is not monotonic at sequence 1", "offsets[1] = 3, offsets[2] = 2"}, true},
      {"id_vocab", [](RawFile& r) { r.ids[6] = 16; },
       {"/input_ids: sequence 2, position 1: token id 16 is outside [0, vocab_size = 16)"}, false},
      {"id_negative", [](RawFile& r) { r.ids[0] = -1; }, {"/input_ids: sequence 0, position 0: token id -1"}, false},
      {"mask2", [](RawFile& r) { r.mask[10] = 2; }, {"/loss_mask: sequence 3, position 1: value 2 is not 0 or 1"}, false},
      {"empty", [](RawFile& r) { r.offsets = {0, 3, 3, 9, 12}; },
       {"sequence 1 is empty", "/offsets"}, true},
      {"format", [](RawFile& r) { r.format = "dflash.tokens.v0"; },
       {"attribute 'format' is 'dflash.tokens.v0', expected 'dflash.tokens.v1'"}, true},
      {"no_format", [](RawFile& r) { r.format.reset(); }, {"has no 'format' attribute"}, true},
      {"ids_longer", [](RawFile& r) { r.ids.push_back(1); r.mask.push_back(1); },
       {"/offsets ends at 12 (after sequence 3) but /input_ids holds 13 tokens"}, true},
      {"mask_shorter", [](RawFile& r) { r.mask.pop_back(); },
       {"/loss_mask holds 11 values but /input_ids holds 12 tokens"}, true},
      {"offsets_start", [](RawFile& r) { r.offsets[0] = 1; }, {"/offsets[0] = 1, expected 0"}, true},
  };
  for (const Case& c : cases) {
    RawFile r = good_raw();
    c.spoil(r);
    const std::string path = dir.file(std::string(c.name) + ".h5");
    write_raw(path, r);
    const std::string msg = validate_error(path);
    EXPECT_TRUE(has(msg, "dataset file '" + path + "'")) << c.name << ": " << msg;
    for (const std::string& part : c.want) EXPECT_TRUE(has(msg, part)) << c.name << ": " << msg;
    EXPECT_TRUE(has(msg, "---> HINT:")) << c.name << ": " << msg;
    const std::string open_msg = error_of([&] { Dataset ds({path}); });
    EXPECT_EQ(open_msg, c.structural ? msg : std::string()) << c.name;
  }
  // Not a dataset file at all / not there.
  EXPECT_TRUE(has(validate_error(dir.file("missing.h5")), "does not exist"));
  {
    std::FILE* f = std::fopen(dir.file("junk.h5").c_str(), "w");
    std::fputs("not hdf5", f);
    std::fclose(f);
  }
  EXPECT_TRUE(has(validate_error(dir.file("junk.h5")), "junk.h5"));
  EXPECT_TRUE(has(error_of([&] { Dataset ds({dir.file("*.nothing")}); }), "matches no file"));
}

// The trainer's start-up check: ranges of global sequences across files, each defect named with the
// file, the dataset, the sequence (in the file and globally) and the position; sequences without an
// anchor counted within the anchor window (the trainer's max_length).
TEST(Dataset, CheckContentsOfRangesNamesGlobalSequenceAndCountsAnchors) {
  TempDir dir;
  write_file(dir.file("a.h5"), 16, {seq({1, 2, 3}, {0, 1, 1}), seq({4, 5}, {1, 0})});
  RawFile bad = good_raw();  // sequences of lengths 3, 2, 4, 3; the third has mask 0 0 1 1 ... planted below
  bad.ids[7] = 16;           // sequence 2, position 2 (global sequence 4)
  write_raw(dir.file("b.h5"), bad);
  Dataset ds({dir.file("a.h5"), dir.file("b.h5")});
  ASSERT_EQ(ds.num_sequences(), 6);
  // Sequences 0..3: valid. 0 has an anchor at 1; 1 none; 2 (b's 0: mask 0 1 1) one; 3 (b's 1: 1 1) one.
  DatasetStats st = ds.check_contents(0, 4);
  EXPECT_EQ(st.sequences, 4);
  EXPECT_EQ(st.tokens, 3 + 2 + 3 + 2);
  EXPECT_EQ(st.supervised, 2 + 1 + 2 + 2);
  EXPECT_EQ(st.no_anchor, 1);
  // Within a window of 2 tokens (mask 0 1 | 1 for sequences 0 and 2) only sequence 3 (1 1) keeps its anchor.
  EXPECT_EQ(ds.check_contents(0, 4, 2).no_anchor, 3);
  // Split in two ranges (two ranks) the stats add up.
  DatasetStats lo = ds.check_contents(0, 2, 0, {}, 1), hi = ds.check_contents(2, 4, 0, {}, 1);
  lo.add(hi);
  EXPECT_EQ(lo.tokens, st.tokens);
  EXPECT_EQ(lo.supervised, st.supervised);
  EXPECT_EQ(lo.no_anchor, st.no_anchor);
  const std::string e = error_of([&] { ds.check_contents(3, 6, 0, "HINT-TEXT"); });
  EXPECT_TRUE(has(e, "b.h5': /input_ids: sequence 2 (global sequence 4), position 2: token id 16 is outside [0, vocab_size = 16)"))
      << e;
  EXPECT_TRUE(has(e, "HINT-TEXT")) << e;
  EXPECT_TRUE(has(error_of([&] { ds.check_contents(0, 7); }), "outside [0, 6)"));
}

TEST(Dataset, FilesWithDifferentVocabulariesAreRefused) {
  TempDir dir;
  write_file(dir.file("a.h5"), 10, {seq({1, 2}, {1, 1})});
  write_file(dir.file("b.h5"), 20, {seq({1, 2}, {1, 1})});
  EXPECT_TRUE(has(error_of([&] { Dataset ds({dir.path.string()}); }), "has vocab_size 20 but"));
}

// ---------------------------------------------------------------------------------------------
// loader

namespace {

std::string synth_file(const TempDir& dir, int64_t n, uint64_t seed = 1) {
  SynthOptions o;
  o.sequences = n;
  o.min_length = 4;
  o.max_length = 24;
  o.vocab_size = 50;
  o.seed = seed;
  const std::string path = dir.file("synth_" + std::to_string(n) + "_" + std::to_string(seed) + ".h5");
  write_synth(path, o);
  return path;
}

LoaderConfig config(const std::string& path, int64_t batch, int group = 0, int groups = 1, uint64_t seed = 7) {
  LoaderConfig c;
  c.files = {path};
  c.max_length = 16;
  c.seed = seed;
  c.tp_group = group;
  c.num_tp_groups = groups;
  c.batch = batch;
  return c;
}

std::vector<int64_t> take_indices(Loader& l, int batches) {
  std::vector<int64_t> out;
  for (int i = 0; i < batches; ++i) {
    Batch b = l.next_batch();
    out.insert(out.end(), b.indices.begin(), b.indices.end());
  }
  return out;
}

}  // namespace

TEST(Loader, PermutationIsDeterministicAndDiffersPerEpochAndSeed) {
  const auto p0 = epoch_permutation(1000, 3, 0);
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(p0, epoch_permutation(1000, 3, 0));
  EXPECT_NE(p0, epoch_permutation(1000, 3, 1));
  EXPECT_NE(p0, epoch_permutation(1000, 4, 0));
}

TEST(Loader, GroupsGetDisjointSequencesCoveringTheEpoch) {
  TempDir dir;
  const std::string path = synth_file(dir, 101);
  const int G = 3;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::set<int64_t> all;
    for (int g = 0; g < G; ++g) {
      Loader l(config(path, 5, g, G));
      EXPECT_EQ(l.slots_per_epoch(), 33);
      std::vector<int64_t> order = l.epoch_order(epoch);
      for (int64_t i : order) EXPECT_TRUE(all.insert(i).second) << "sequence " << i << " in two groups";
    }
    EXPECT_EQ(all.size(), 99u);  // 101 = 3 * 33 + 2 left out of this epoch
  }
  // A group's batches follow its order (synth sequences always have anchors): 33 slots, batch 5.
  Loader l(config(path, 5, 1, G));
  std::vector<int64_t> want = l.epoch_order(0), next = l.epoch_order(1);
  want.insert(want.end(), next.begin(), next.begin() + 2);
  EXPECT_EQ(take_indices(l, 7), want);  // 35 slots: the 7th batch crosses into epoch 1
  EXPECT_EQ(l.position(), (LoaderPosition{1, 2, 7}));
  EXPECT_EQ(l.counters().epochs, 1);
  EXPECT_EQ(l.counters().dropped_remainder, 4);  // 2 per epoch started
  EXPECT_EQ(l.counters().seen, 35);
}

TEST(Loader, DeterministicGivenSeedAndEpochsDiffer) {
  TempDir dir;
  const std::string path = synth_file(dir, 40);
  Loader a(config(path, 4)), b(config(path, 4)), c(config(path, 4, 0, 1, 8));
  for (int i = 0; i < 25; ++i) {  // 2.5 epochs
    Batch x = a.next_batch(), y = b.next_batch();
    ASSERT_EQ(x.indices, y.indices);
    ASSERT_EQ(x.epoch, y.epoch);
    ASSERT_EQ(x.index, i);
    for (size_t k = 0; k < x.sequences.size(); ++k) ASSERT_EQ(x.sequences[k].ids, y.sequences[k].ids);
  }
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
  // Every epoch holds every sequence once (one group).
  std::vector<int64_t> e1 = a.epoch_order(1);
  std::sort(e1.begin(), e1.end());
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(e1[i], i);
}

TEST(Loader, ResumeFromSavedPositionContinuesIdentically) {
  TempDir dir;
  const std::string path = synth_file(dir, 37);
  Loader a(config(path, 3, 1, 2));
  take_indices(a, 9);
  const std::string saved = a.state().dump();
  std::vector<Batch> want;
  for (int i = 0; i < 20; ++i) want.push_back(a.next_batch());

  Loader b(config(path, 3, 1, 2));
  b.restore(nlohmann::json::parse(saved));
  EXPECT_EQ(b.position().batches, 9);
  for (int i = 0; i < 20; ++i) {
    Batch got = b.next_batch();
    ASSERT_EQ(got.indices, want[i].indices) << "batch " << i;
    ASSERT_EQ(got.epoch, want[i].epoch);
    ASSERT_EQ(got.index, want[i].index);
    for (size_t k = 0; k < got.sequences.size(); ++k) {
      ASSERT_EQ(got.sequences[k].ids, want[i].sequences[k].ids);
      ASSERT_EQ(got.sequences[k].mask, want[i].sequences[k].mask);
    }
  }
  EXPECT_EQ(b.position(), a.position());
  EXPECT_EQ(b.counters(), a.counters());

  // A state made for other data, seed or sharding is refused.
  Loader other_seed(config(path, 3, 1, 2, 99));
  EXPECT_TRUE(has(error_of([&] { other_seed.restore(nlohmann::json::parse(saved)); }), "seed 7"));
  Loader other_groups(config(path, 3, 0, 3));
  EXPECT_TRUE(has(error_of([&] { other_groups.restore(nlohmann::json::parse(saved)); }), "for 2 TP groups"));
  Loader other_data(config(synth_file(dir, 38), 3, 1, 2));
  EXPECT_TRUE(has(error_of([&] { other_data.restore(nlohmann::json::parse(saved)); }), "37 sequences"));
  EXPECT_TRUE(has(error_of([&] { b.restore(nlohmann::json{{"seed", 1}}); }), "malformed"));
}

TEST(Loader, TruncatesAndSkipsSequencesWithoutAnchorAndCounts) {
  TempDir dir;
  const std::string path = dir.file("mixed.h5");
  std::vector<Sequence> s = {
      seq({1, 2, 3, 4}, {0, 1, 1, 0}),                       // 0: anchor at 1
      seq({1, 2, 3, 4, 5}, {1, 0, 1, 0, 1}),                 // 1: no anchor -> skipped
      seq({1, 2, 3, 4, 5, 6, 7, 8}, {0, 1, 1, 1, 1, 1, 1, 1}),  // 2: truncated to 6, kept
      seq({1, 2, 3, 4, 5, 6, 7, 8}, {0, 0, 0, 0, 0, 0, 1, 1}),  // 3: anchor only after 6 -> truncated, skipped
      seq({5}, {1}),                                         // 4: one token -> skipped
      seq({1, 2, 3, 4, 5, 6}, {1, 1, 0, 0, 0, 0}),           // 5: exactly max_length, kept
  };
  write_file(path, 10, s);
  LoaderConfig c = config(path, 6);
  c.max_length = 6;
  Loader l(c);
  Batch b = l.next_batch();  // one whole epoch
  std::vector<int64_t> idx = b.indices;
  std::sort(idx.begin(), idx.end());
  EXPECT_EQ(idx, (std::vector<int64_t>{0, 2, 5}));
  for (size_t k = 0; k < b.sequences.size(); ++k) {
    EXPECT_LE(b.sequences[k].ids.size(), 6u);
    EXPECT_EQ(b.sequences[k].ids.size(), b.sequences[k].mask.size());
    if (b.indices[k] == 2) {
      EXPECT_EQ(b.sequences[k].ids, (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
    }
  }
  const LoaderCounters& n = l.counters();
  EXPECT_EQ(n.seen, 3);
  EXPECT_EQ(n.skipped_no_anchor, 3);
  EXPECT_EQ(n.truncated, 1);  // sequence 3 was cut too, but it is counted as skipped
  EXPECT_EQ(n.truncated_tokens, 2);
  EXPECT_EQ(n.epochs, 1);
  EXPECT_EQ(n.dropped_remainder, 0);
  EXPECT_EQ(l.position(), (LoaderPosition{1, 0, 1}));

  LoaderConfig bad = c;
  bad.max_length = 1;
  EXPECT_TRUE(has(error_of([&] { Loader x(bad); }), "max_length = 1 must be >= 2"));
  bad = c;
  bad.num_tp_groups = 7;
  EXPECT_TRUE(has(error_of([&] { Loader x(bad); }), "fewer than the 7 TP groups"));
}

// ---------------------------------------------------------------------------------------------
// synthetic corpus

TEST(Synth, DeterministicValidAndStructured) {
  TempDir dir;
  const std::string a = synth_file(dir, 60, 5);
  fs::copy_file(a, dir.file("copy.h5"));
  const std::string b = synth_file(dir, 60, 5);  // same name: overwritten with the same options
  const std::string c = synth_file(dir, 60, 6);
  DatasetStats st = validate_file(b);
  EXPECT_EQ(st.sequences, 60);
  EXPECT_GE(st.min_length, 4);
  EXPECT_LE(st.max_length, 24);
  Dataset da({dir.file("copy.h5")}), db({b}), dc({c});
  int differ = 0;
  for (int64_t i = 0; i < 60; ++i) {
    Sequence x = da.sequence(i), y = db.sequence(i);
    ASSERT_EQ(x.ids, y.ids);
    ASSERT_EQ(x.mask, y.mask);
    differ += dc.sequence(i).ids != x.ids;
    EXPECT_EQ(x.mask[0], 0);
    EXPECT_TRUE(has_anchor(x.mask));
    // Masks are a 0-prefix then ones.
    EXPECT_TRUE(std::is_sorted(x.mask.begin(), x.mask.end()));
  }
  EXPECT_GT(differ, 50);
  // Learnable: the next token is predictable from earlier tokens in most positions (period <= 8
  // with a constant shift per repetition covers all three kinds).
  int64_t predictable = 0, total = 0;
  for (int64_t i = 0; i < 60; ++i) {
    Sequence x = da.sequence(i);
    for (size_t t = 16; t < x.ids.size(); ++t) {
      bool ok = false;
      for (size_t p = 1; p <= 8 && !ok; ++p) {
        const int64_t d = (x.ids[t - p] - x.ids[t - 2 * p] + 50) % 50;
        ok = (x.ids[t - p] + d) % 50 == x.ids[t];
      }
      predictable += ok;
      ++total;
    }
  }
  EXPECT_EQ(predictable, total);
  SynthOptions bad;
  bad.min_length = 2;
  EXPECT_TRUE(has(error_of([&] { check_synth_options(bad); }), "--min-len = 2 must be >= 3"));
}
