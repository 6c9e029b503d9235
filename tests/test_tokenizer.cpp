// The tokenizer against Hugging Face tokenizers' own ids (goldens made by
// tests/reference/make_tokenizer_goldens.mjs with the reference engine) on the real Qwen3
// tokenizer.json, its Qwen3.5-style variant and feature variants; the decode round trip on every
// golden; the Qwen fast-path splitter against Oniguruma; and the errors for bad input.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/qwen_split.h"
#include "text/regex.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

using namespace dflash;
using namespace dflash::text;
using nlohmann::json;

namespace {

const std::string kData = DFLASH_TOKENIZER_DATA;

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Golden {
  std::string name, text, decoded;
  std::vector<uint32_t> ids;
  bool has_decoded = false;
};

std::vector<Golden> goldens(const std::string& file) {
  std::vector<Golden> out;
  std::ifstream in(kData + "/" + file);
  EXPECT_TRUE(in.good()) << file;
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    Golden g;
    g.name = j["name"];
    g.text = j["text"];
    g.ids = j["ids"].get<std::vector<uint32_t>>();
    if (j.contains("decoded")) {
      g.decoded = j["decoded"];
      g.has_decoded = true;
    }
    out.push_back(std::move(g));
  }
  return out;
}

// The Qwen3 tokenizer.json (the fixture; the variants below edit it as the goldens script does).
const std::string& qwen3_json() {
  static const std::string text = read(kData + "/tokenizer.json");
  return text;
}

// Compares every golden's ids and the decode round trip; reports the first difference of each row.
void check_goldens(const Tokenizer& tok, const std::vector<Golden>& rows, bool roundtrip = true, size_t min_tokens = 100000) {
  ASSERT_GT(rows.size(), 40u);
  size_t bad = 0, tokens = 0;
  for (const auto& g : rows) {
    const std::vector<uint32_t> ids = tok.encode(g.text);
    tokens += ids.size();
    if (ids != g.ids) {
      size_t k = 0;
      while (k < ids.size() && k < g.ids.size() && ids[k] == g.ids[k]) ++k;
      ADD_FAILURE() << g.name << ": ids differ from HF at token " << k << " (ours " << ids.size() << " tokens, HF " << g.ids.size()
                    << "; ours " << (k < ids.size() ? std::to_string(ids[k]) : "end") << ", HF "
                    << (k < g.ids.size() ? std::to_string(g.ids[k]) : "end") << ")";
      if (++bad > 10) return;
      continue;
    }
    if (!roundtrip) continue;
    const std::string back = tok.decode(ids);
    const std::string want = g.has_decoded ? g.decoded : tok.normalize(g.text);
    EXPECT_EQ(back, want) << g.name << ": decode(encode(text)) is not the normalized text";
  }
  EXPECT_GT(tokens, min_tokens);  // the real-text rows are there
}

}  // namespace

// encode_with_offsets on every golden text: the same ids as encode; ranges in bounds, on character
// boundaries, in order; and, where `full`, every byte covered, overlaps only between tokens that
// share one character (byte-level pieces of it), and each token's decoded bytes equal to its range
// of the text where the normalizer left the text as it is.
void check_offsets(const Tokenizer& tok, const std::vector<Golden>& rows, bool full) {
  size_t checked = 0, shared = 0;
  for (const auto& g : rows) {
    const Tokenizer::Encoding e = tok.encode_with_offsets(g.text);
    ASSERT_EQ(e.ids, tok.encode(g.text)) << g.name;
    ASSERT_EQ(e.offsets.size(), e.ids.size()) << g.name;
    const bool unchanged = tok.normalize(g.text) == g.text;
    auto boundary = [&](size_t i) { return i == g.text.size() || (static_cast<unsigned char>(g.text[i]) & 0xC0) != 0x80; };
    size_t covered = 0;  // bytes [0, covered) are covered by the tokens so far
    for (size_t k = 0; k < e.ids.size(); ++k) {
      const auto [b, en] = e.offsets[k];
      ASSERT_LE(b, en) << g.name << " token " << k;
      ASSERT_LE(en, g.text.size()) << g.name << " token " << k;
      ASSERT_TRUE(boundary(b) && boundary(en)) << g.name << " token " << k << " [" << b << ", " << en << ") cuts a character";
      if (k > 0) {
        ASSERT_GE(b, e.offsets[k - 1].first) << g.name << " token " << k << " starts before the previous one";
        ASSERT_GE(en, e.offsets[k - 1].second) << g.name << " token " << k << " ends before the previous one";
      }
      ++checked;
      if (!full) continue;
      ASSERT_LE(b, covered) << g.name << ": bytes [" << covered << ", " << b << ") belong to no token (token " << k << ")";
      if (b < covered) {  // an overlap: within one character (byte pieces of it) or a normalized stretch
        ++shared;
        if (unchanged) {
          size_t n;
          decode_utf8(g.text, b, n);
          ASSERT_TRUE(covered == b + n && en - b <= 4) << g.name << " token " << k << " overlaps the previous by more than one character";
        }
      } else if (unchanged && (k + 1 == e.ids.size() || e.offsets[k + 1].first >= en)) {
        const std::string piece = tok.decode(std::vector<uint32_t>{e.ids[k]});
        ASSERT_EQ(piece, g.text.substr(b, en - b)) << g.name << " token " << k;
      }
      covered = std::max(covered, en);
    }
    if (full) {
      ASSERT_EQ(covered, g.text.size()) << g.name << ": the tail is covered by no token";
    }
  }
  EXPECT_GT(checked, 1000u);
  if (full) {
    EXPECT_GT(shared, 0u) << "no golden has a character split into byte tokens: the shared-range rule went untested";
  }
}

TEST(Tokenizer, OffsetsOnTheGoldens) {
  const Tokenizer fast = Tokenizer::from_json(qwen3_json(), "qwen3");
  check_offsets(fast, goldens("qwen3.jsonl"), true);
  const Tokenizer onig = Tokenizer::from_json(qwen3_json(), "qwen3", {.fast_paths = false});
  check_offsets(onig, goldens("qwen3.jsonl"), true);
}

TEST(Tokenizer, OffsetsOfSpecialTokensAndSplitCharacters) {
  const Tokenizer tok = Tokenizer::from_json(qwen3_json(), "qwen3");
  using Off = std::vector<std::pair<size_t, size_t>>;
  {
    const auto e = tok.encode_with_offsets("<|im_start|>user\nhi<|im_end|>\n");
    EXPECT_EQ(e.ids, (std::vector<uint32_t>{151644, 872, 198, 6023, 151645, 198}));
    EXPECT_EQ(e.offsets, (Off{{0, 12}, {12, 16}, {16, 17}, {17, 19}, {19, 29}, {29, 30}}));
  }
  {
    // U+1D11E (musical G clef, 4 bytes) is not one token in Qwen3's vocab: its byte-level pieces
    // each stand for the whole character, as HF reports them.
    const std::string s = "a \xF0\x9D\x84\x9E b";
    const auto e = tok.encode_with_offsets(s);
    ASSERT_GE(e.ids.size(), 4u);
    size_t in_char = 0;
    for (const auto& o : e.offsets)
      if (o.first <= 2 && o.second >= 6) ++in_char;
    EXPECT_GE(in_char, 2u) << "the clef should be split into byte tokens, each with the range [2, 6)";
    EXPECT_EQ(e.offsets.front(), (std::pair<size_t, size_t>{0, 1}));
    EXPECT_EQ(e.offsets.back().second, s.size());
  }
  {
    // NFC composes e + U+0301 into U+00E9: the tokens of the changed stretch get its input range.
    const std::string s = "cafe\xCC\x81 ok";
    const auto e = tok.encode_with_offsets(s);
    EXPECT_EQ(e.ids, tok.encode(s));
    EXPECT_EQ(e.offsets.back(), (std::pair<size_t, size_t>{6, 9}));
    for (const auto& o : e.offsets) EXPECT_LE(o.second, s.size());
    EXPECT_EQ(e.offsets.front().first, 0u);
  }
  EXPECT_THROW(tok.encode_with_offsets("ab\xC3("), Error);
  EXPECT_TRUE(tok.encode_with_offsets("").ids.empty());
}

TEST(Tokenizer, Qwen3GoldensFastPath) {
  const Tokenizer tok = Tokenizer::from_json(qwen3_json(), "qwen3");
  EXPECT_TRUE(tok.uses_fast_path()) << tok.describe();
  EXPECT_EQ(tok.vocab_size(), 151669u);
  check_goldens(tok, goldens("qwen3.jsonl"));
}

TEST(Tokenizer, Qwen3GoldensOniguruma) {
  const Tokenizer tok = Tokenizer::from_json(qwen3_json(), "qwen3", TokenizerOptions{.fast_paths = false});
  EXPECT_FALSE(tok.uses_fast_path());
  check_goldens(tok, goldens("qwen3.jsonl"));
}

TEST(Tokenizer, Qwen35VariantGoldens) {
  json j = json::parse(qwen3_json());
  auto& pat = j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
  ASSERT_EQ(pat.get<std::string>(), kQwen3Pattern);
  pat = kQwen35Pattern;
  const auto rows = goldens("qwen35.jsonl");
  for (bool fast : {true, false}) {
    SCOPED_TRACE(fast ? "fast path" : "Oniguruma");
    const Tokenizer tok = Tokenizer::from_json(j.dump(), "qwen35", TokenizerOptions{.fast_paths = fast});
    EXPECT_EQ(tok.uses_fast_path(), fast);
    check_goldens(tok, rows);
  }
}

// The hand-written splitter and Oniguruma give the same spans on random strings drawn from every
// class the patterns distinguish (letters, marks, digits, white space, newlines, apostrophes and
// the case-folding letters of the contractions, punctuation, emoji).
TEST(Tokenizer, QwenSplitterMatchesOniguruma) {
  const std::vector<uint32_t> pool = {'a', 'Z', 's', 'S', 't', 'r', 'E', 'v', 'm', 'l', 'L', 'd', 0x17F, 0x212A, '\'', 0x2019, '0', '7',
                                      0x0663, 0x00BD, 0x2167, ' ', ' ', '\t', '\n', '\r', 0x00A0, 0x3000, 0x2028, 0x0085, 0x000B,
                                      0x0301, 0x0308, 0x093F, 0x20DD, '.', ',', '!', '-', '(', '"', 0x1F600, 0x200D, 0xFE0F, 0x4E2D,
                                      0x0627, 0x05D0, 0x0E01, 0x0E31, 0x1100, 0x1F1E9, 0x00E9, 0x0130, 0x1E9E, 0x00DF,
                                      0x1E97, 0xFB06, 0xFB05, 0x01C9, 0x0131};
  std::mt19937 rng(1234);
  for (const char* pattern : {kQwen3Pattern, kQwen35Pattern}) {
    const Regex re(pattern);
    const auto fast = QwenSplitter::for_pattern(pattern);
    ASSERT_TRUE(fast.has_value());
    for (int trial = 0; trial < 3000; ++trial) {
      std::string s;
      const int len = static_cast<int>(rng() % 24);
      for (int k = 0; k < len; ++k) append_utf8(s, pool[rng() % pool.size()]);
      std::vector<Span> a, b;
      re.find_all(s, a);
      fast->find_all(s, b);
      ASSERT_EQ(a, b) << "pattern " << pattern << " on " << json(s).dump();
    }
  }
}

TEST(Tokenizer, InvalidUtf8NamesTheOffset) {
  const Tokenizer tok = Tokenizer::from_file(kData + "/byte_fallback.tokenizer.json");
  try {
    tok.encode(std::string("abc\xC3(def"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("invalid UTF-8 at byte 3 (0xC3)"), std::string::npos) << e.message();
  }
  for (const char* bad : {"\xC0\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\x80", "ab\xE2\x82"})
    EXPECT_NE(invalid_utf8_offset(bad), kValidUtf8) << json::binary_t(std::vector<uint8_t>(bad, bad + strlen(bad))).size();
  EXPECT_EQ(invalid_utf8_offset("h\xC3\xA9llo \xF0\x9F\x98\x80"), kValidUtf8);
  EXPECT_EQ(invalid_utf8_offset("ab\xE2\x82"), 2u);  // truncated at the end: where the sequence starts
  EXPECT_EQ(invalid_utf8_offset("abc\x80"), 3u);
  // Lossy decoding of bytes that are not UTF-8, as Rust's from_utf8_lossy: one U+FFFD per maximal subpart.
  EXPECT_EQ(utf8_lossy("a\xF0\x9F\x98" "b\xC3"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_THROW(tok.decode(std::vector<uint32_t>{1, 999999}), Error);
  EXPECT_THROW(tok.decode(std::vector<uint32_t>{1, static_cast<uint32_t>(tok.vocab_size())}), Error);
}

TEST(Tokenizer, UnsupportedConfigurationsAreRefusedByName) {
  const json base = json::parse(read(kData + "/byte_fallback.tokenizer.json"));
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"WordPiece model", [](json& j) { j["model"]["type"] = "WordPiece"; }, "model type \"WordPiece\" is not supported"},
      {"Unigram model", [](json& j) { j["model"]["type"] = "Unigram"; }, "model type \"Unigram\" is not supported"},
      {"Metaspace", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "pre_tokenizer type \"Metaspace\" is not supported"},
      {"Whitespace in a Sequence", [](json& j) { j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {j["pre_tokenizer"], {{"type", "Whitespace"}}}}}; },
       "pre_tokenizer type \"Whitespace\" is not supported"},
      {"Lowercase", [](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, "normalizer type \"Lowercase\" is not supported"},
      {"NFD in a Sequence", [](json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFD"}}}}}; },
       "normalizer type \"NFD\" is not supported"},
      {"decoder null", [](json& j) { j["decoder"] = nullptr; }, "decoder null is not supported"},
      {"decoder Metaspace", [](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder type \"Metaspace\" is not supported"},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout = 0.1 is not supported"},
      {"subword prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "continuing_subword_prefix = \"##\" is not supported"},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 8}}; }, "truncation = {\"max_length\":8} is not supported"},
      {"split behavior", [](json& j) { j["pre_tokenizer"]["behavior"] = "Sideways"; }, "Split behavior \"Sideways\""},
      {"bad regex", [](json& j) { j["pre_tokenizer"]["pattern"]["Regex"] = "(unclosed"; }, "does not compile with Oniguruma"},
      {"step after ByteLevel", [](json& j) { j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "ByteLevel"}}, j["pre_tokenizer"]}}}; },
       "pre_tokenizer Split comes after ByteLevel"},
      {"post_processor", [](json& j) { j["post_processor"] = {{"type", "Mystery"}}; }, "post_processor type \"Mystery\" is not supported"},
      {"merge not in vocab", [](json& j) { j["model"]["merges"][5] = "zz\xC3\xA9q x"; }, "merges[5] names a token that is not in the vocab"},
      {"merge of three", [](json& j) { j["model"]["merges"][2] = "a b c"; }, "merges[2] = \"a b c\" is not two tokens"},
      {"unk not in vocab", [](json& j) { j["model"]["unk_token"] = "<nope>"; }, "unk_token \"<nope>\" is not in model.vocab"},
      {"added token field", [](json& j) { j["added_tokens"][0]["weird"] = true; }, "has the field \"weird\""},
  };
  for (const auto& c : cases) {
    json j = base;
    c.edit(j);
    try {
      Tokenizer::from_json(j.dump(), "edited.json");
      ADD_FAILURE() << c.what << ": loaded";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(c.message), std::string::npos) << c.what << ": " << e.message();
      EXPECT_NE(e.message().find("edited.json"), std::string::npos) << c.what << ": " << e.message();
    }
  }
  EXPECT_THROW(Tokenizer::from_file(kData + "/no_such_dir"), Error);
  EXPECT_THROW(Tokenizer::from_json("{not json", "broken.json"), Error);
}

TEST(Tokenizer, LoadsFromADirectory) {
  const Tokenizer tok = Tokenizer::from_file(kData);  // a directory holding tokenizer.json
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<uint32_t>{9707, 1879}));
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), std::optional<uint32_t>(151645));
  EXPECT_EQ(tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")), "<|im_start|>user\nhi<|im_end|>");
}

// Feature variants of Qwen3's tokenizer.json, built with the edits the goldens script makes.
TEST(Tokenizer, FeatureVariantGoldens) {
  const json base = json::parse(qwen3_json());
  {
    SCOPED_TRACE("features_a: NFKC, Split String / every behavior / invert, ByteLevel regex + prefix space, string merges, added-token flags");
    json c = base;
    c["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFKC"}}}}};
    auto split = [](json pattern, const char* behavior, bool invert) {
      return json{{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
    };
    c["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {split({{"String", " "}}, "MergedWithNext", false), split({{"Regex", "\\p{N}+"}}, "Contiguous", false),
                            split({{"Regex", "[.,!?]"}}, "MergedWithPrevious", false), split({{"Regex", "q"}}, "Removed", false),
                            split({{"Regex", "\\p{L}+"}}, "MergedWithPrevious", true),
                            {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}}}};
    for (auto& m : c["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
    for (auto& t : c["added_tokens"]) {
      const std::string s = t["content"];
      if (s == "<think>") t["lstrip"] = t["rstrip"] = true;
      if (s == "</think>") t["single_word"] = true;
      if (s == "<tool_call>") t["normalized"] = true;
      if (s == "<|im_end|>") t["rstrip"] = true;
      if (s == "<|im_start|>") t["lstrip"] = true;
    }
    c["added_tokens"].push_back({{"id", 151669}, {"content", "\xEF\xAC\x81ne"}, {"single_word", true}, {"lstrip", false}, {"rstrip", false},
                                 {"normalized", true}, {"special", false}});
    c["added_tokens"].push_back({{"id", 151670}, {"content", "Hello"}, {"single_word", false}, {"lstrip", true}, {"rstrip", true},
                                 {"normalized", false}, {"special", false}});
    const Tokenizer tok = Tokenizer::from_json(c.dump(), "features_a");
    check_goldens(tok, goldens("features_a.jsonl"), true, 5000);
    check_offsets(tok, goldens("features_a.jsonl"), false);  // it removes text (Split Removed): no coverage
  }
  {
    SCOPED_TRACE("features_b: ByteLevel with its GPT-2 regex, no normalizer, Split Removed + invert, single_word special token");
    json c = base;
    c["normalizer"] = nullptr;
    c["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", "\\s"}}}, {"behavior", "Removed"}, {"invert", true}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}}}};
    for (auto& t : c["added_tokens"])
      if (t["content"] == "<|endoftext|>") t["single_word"] = true;
    const Tokenizer tok = Tokenizer::from_json(c.dump(), "features_b");
    check_goldens(tok, goldens("features_b.jsonl"), true, 5000);
  }
}

// Character-level BPE models without ByteLevel: byte_fallback, unk fused or not, and neither (HF
// drops what it cannot encode). Their decode is HF's (the <0xXX> and <unk> tokens come back as text).
TEST(Tokenizer, CharacterModelGoldens) {
  for (const char* name : {"byte_fallback", "unk_fused", "unk", "dropped"}) {
    SCOPED_TRACE(name);
    const Tokenizer tok = Tokenizer::from_file(kData + "/" + name + ".tokenizer.json");
    check_goldens(tok, goldens(std::string(name) + ".jsonl"), true, 1000);
  }
}
