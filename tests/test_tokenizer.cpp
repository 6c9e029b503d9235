// The tokenizer against Hugging Face tokenizers' own ids (goldens made by
// tests/reference/make_tokenizer_goldens.mjs with the reference engine) on the real Qwen3
// tokenizer.json, its Qwen3.5-style variant and feature variants; the decode round trip on every
// golden; the Qwen fast-path splitter against Oniguruma; and the errors for bad input.
#include <gtest/gtest.h>

#include <fstream>
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

// The Qwen3 tokenizer.json with `edit` applied (the variants of the goldens script).
std::string qwen3_json() {
  static const std::string text = read(kData + "/tokenizer.json");
  return text;
}

// Compares every golden's ids and the decode round trip; reports the first difference of each row.
void check_goldens(const Tokenizer& tok, const std::vector<Golden>& rows, bool roundtrip = true) {
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
  EXPECT_GT(tokens, 100000u);  // the real-text rows are there
}

}  // namespace

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
                                      0x0627, 0x05D0, 0x0E01, 0x0E31, 0x1100, 0x1F1E9, 0x00E9, 0x0130, 0x1E9E, 0x00DF};
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
  const Tokenizer tok = Tokenizer::from_json(qwen3_json(), "qwen3");
  try {
    tok.encode(std::string("abc\xC3(def"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("invalid UTF-8 at byte 4"), std::string::npos) << e.message();
  }
  for (const char* bad : {"\xC0\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\x80", "ab\xE2\x82"})
    EXPECT_NE(invalid_utf8_offset(bad), kValidUtf8) << json::binary_t(std::vector<uint8_t>(bad, bad + strlen(bad))).size();
  EXPECT_EQ(invalid_utf8_offset("h\xC3\xA9llo \xF0\x9F\x98\x80"), kValidUtf8);
  EXPECT_EQ(invalid_utf8_offset("ab\xE2\x82"), 4u);  // truncated at the end: the offset of the missing byte
  // Lossy decoding of bytes that are not UTF-8, as Rust's from_utf8_lossy: one U+FFFD per maximal subpart.
  EXPECT_EQ(utf8_lossy("a\xF0\x9F\x98" "b\xC3"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_THROW(tok.decode(std::vector<uint32_t>{1, 999999}), Error);
}

TEST(Tokenizer, UnsupportedConfigurationsAreRefusedByName) {
  const json base = json::parse(qwen3_json());
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"WordPiece model", [](json& j) { j["model"]["type"] = "WordPiece"; }, "model type \"WordPiece\" is not supported"},
      {"Unigram model", [](json& j) { j["model"]["type"] = "Unigram"; }, "model type \"Unigram\" is not supported"},
      {"Metaspace", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "pre_tokenizer type \"Metaspace\" is not supported"},
      {"Lowercase", [](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, "normalizer type \"Lowercase\" is not supported"},
      {"NFD in a Sequence", [](json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFD"}}}}}; },
       "normalizer type \"NFD\" is not supported"},
      {"decoder null", [](json& j) { j["decoder"] = nullptr; }, "decoder null is not supported"},
      {"decoder Metaspace", [](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder type \"Metaspace\" is not supported"},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout = 0.1 is not supported"},
      {"subword prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "continuing_subword_prefix = \"##\" is not supported"},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 8}}; }, "truncation = {\"max_length\":8} is not supported"},
      {"split behavior", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }, "Split behavior \"Sideways\""},
      {"bad regex", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }, "does not compile with Oniguruma"},
      {"step after ByteLevel", [](json& j) { j["pre_tokenizer"]["pretokenizers"].push_back(j["pre_tokenizer"]["pretokenizers"][0]); },
       "pre_tokenizer Split comes after ByteLevel"},
      {"post_processor", [](json& j) { j["post_processor"] = {{"type", "Mystery"}}; }, "post_processor type \"Mystery\" is not supported"},
      {"merge not in vocab", [](json& j) { j["model"]["merges"][5] = "zz\xC3\xA9q x"; }, "merges[5] names a token that is not in the vocab"},
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
  Tokenizer from_dir = Tokenizer::from_file(kData);  // a directory holding tokenizer.json
  EXPECT_EQ(from_dir.encode("Hello world"), (std::vector<uint32_t>{9707, 1879}));
}
