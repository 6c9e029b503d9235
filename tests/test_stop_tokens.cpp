// Stop tokens by id or text (text/stop_tokens.h) on the real Qwen3 tokenizer, and a directory's
// default end-of-turn ids from hand-written generation_config.json / config.json /
// tokenizer_config.json files: the precedence (the first file with the key decides, no union),
// each value form, and the errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/stop_tokens.h"
#include "text/tokenizer.h"

using namespace dflash;
using namespace dflash::text;
namespace fs = std::filesystem;

namespace {

const std::string kQwen3 = DFLASH_TOKENIZER_DATA;                              // tokenizer.json + tokenizer_config.json
const std::string kQwen3Small = std::string(DFLASH_TEST_DATA_DIR) + "/tokenizers/qwen3_4k";

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::from_file(kQwen3);
  return tok;
}

// The message of the error `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

// A fresh directory holding the given files.
fs::path dir_with(const std::string& name, const std::vector<std::pair<std::string, std::string>>& files) {
  const fs::path d = fs::temp_directory_path() / ("dflash_stop_tokens_" + std::to_string(::getpid())) / name;
  fs::remove_all(d);
  fs::create_directories(d);
  for (const auto& [f, text] : files) std::ofstream(d / f) << text;
  return d;
}

DefaultStopTokens defaults(const fs::path& d, const Tokenizer* tok = &qwen3()) {
  return default_stop_tokens(d.string(), [tok] { return tok; });
}

}  // namespace

TEST(StopTokens, IdsNeedNoTokenizer) {
  EXPECT_TRUE(is_token_id("151645"));
  EXPECT_FALSE(is_token_id("-1"));
  EXPECT_FALSE(is_token_id("<|im_end|>"));
  EXPECT_FALSE(is_token_id(""));
  EXPECT_EQ(resolve_stop_token("151645", nullptr, "--stop-token"), 151645);
  EXPECT_EQ(resolve_stop_tokens({"0", "7"}, nullptr, "--stop-token"), (std::vector<int32_t>{0, 7}));
  const std::string e = error_of([] { resolve_stop_token("<|im_end|>", nullptr, "--stop-token"); });
  EXPECT_NE(e.find("--stop-token '<|im_end|>' is text, and there is no tokenizer"), std::string::npos) << e;
  EXPECT_NE(error_of([] { resolve_stop_token("99999999999", nullptr, "--stop-token"); }).find("too large"), std::string::npos);
}

TEST(StopTokens, TextResolvesThroughTheTokenizer) {
  const Tokenizer& tok = qwen3();
  EXPECT_EQ(resolve_stop_token("<|im_end|>", &tok, "x"), 151645);   // added tokens
  EXPECT_EQ(resolve_stop_token("<|endoftext|>", &tok, "x"), 151643);
  const uint32_t the = tok.encode(" the").at(0);
  ASSERT_EQ(tok.encode(" the").size(), 1u);
  EXPECT_EQ(resolve_stop_token("Ġthe", &tok, "x"), static_cast<int32_t>(the));  // a vocab entry's spelling
  EXPECT_EQ(resolve_stop_token(" the", &tok, "x"), static_cast<int32_t>(the));  // text that is one token
  const std::vector<uint32_t> two = tok.encode("hello world");
  ASSERT_EQ(two.size(), 2u);
  const std::string e = error_of([&] { resolve_stop_token("hello world", &tok, "--stop-token"); });
  EXPECT_NE(e.find("--stop-token 'hello world' is not one token: the tokenizer encodes it to 2 ([" + std::to_string(two[0]) +
                   ", " + std::to_string(two[1]) + "])"),
            std::string::npos)
      << e;
  EXPECT_EQ(describe_stop_tokens({151645, 151643}, &tok), "<|im_end|> (151645), <|endoftext|> (151643)");
  EXPECT_EQ(describe_stop_tokens({151645}, nullptr), "151645");
  EXPECT_EQ(describe_stop_tokens({}, &tok), "none");
}

TEST(StopTokens, DefaultsFromTheFixtures) {
  // The Qwen3 fixture has only tokenizer files: eos_token "<|im_end|>" through the tokenizer.
  DefaultStopTokens d = defaults(kQwen3);
  EXPECT_EQ(d.ids, std::vector<int32_t>{151645});
  EXPECT_EQ(d.source, "tokenizer_config.json");
  // ... and a tokenizer.json path reads its directory.
  EXPECT_EQ(defaults(kQwen3 + "/tokenizer.json").ids, std::vector<int32_t>{151645});
  // The 4k cut has a generation_config.json with a list; its tokenizer_config.json's eos_token is
  // not consulted (generation_config.json decides, as in transformers).
  const Tokenizer small = Tokenizer::from_file(kQwen3Small);
  d = defaults(kQwen3Small, &small);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{4088, 4086}));
  EXPECT_EQ(d.source, "generation_config.json");
}

TEST(StopTokens, DefaultPrecedenceAndForms) {
  const std::string tcfg = R"({"eos_token": "<|endoftext|>"})";
  // generation_config.json wins over config.json and tokenizer_config.json (no union).
  DefaultStopTokens d = defaults(dir_with("all", {{"generation_config.json", R"({"eos_token_id": 151645})"},
                                                 {"config.json", R"({"eos_token_id": 7})"},
                                                 {"tokenizer_config.json", tcfg}}));
  EXPECT_EQ(d.ids, std::vector<int32_t>{151645});
  EXPECT_EQ(d.source, "generation_config.json");
  // A generation_config.json without the key: config.json decides (top level, else text_config).
  d = defaults(dir_with("cfg", {{"generation_config.json", R"({"pad_token_id": 1})"},
                               {"config.json", R"({"eos_token_id": [7, 8]})"}, {"tokenizer_config.json", tcfg}}));
  EXPECT_EQ(d.ids, (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(d.source, "config.json");
  d = defaults(dir_with("text_config", {{"config.json", R"({"text_config": {"eos_token_id": 9}})"}}));
  EXPECT_EQ(d.ids, std::vector<int32_t>{9});
  // tokenizer_config.json's eos_token: a string or {"content": ...}.
  d = defaults(dir_with("tok", {{"config.json", R"({"eos_token_id": null})"}, {"tokenizer_config.json", tcfg}}));
  EXPECT_EQ(d.ids, std::vector<int32_t>{151643});
  EXPECT_EQ(d.source, "tokenizer_config.json");
  d = defaults(dir_with("tok_obj", {{"tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>", "special": true}})"}}));
  EXPECT_EQ(d.ids, std::vector<int32_t>{151645});
  // ... which needs a tokenizer: without one there is no default, and the note says why.
  d = defaults(dir_with("tok_none", {{"tokenizer_config.json", tcfg}}), nullptr);
  EXPECT_TRUE(d.ids.empty());
  EXPECT_NE(d.note.find("no tokenizer to resolve it"), std::string::npos) << d.note;
  // Nothing there: no default.
  d = defaults(dir_with("empty", {{"config.json", R"({"vocab_size": 10})"}}));
  EXPECT_TRUE(d.ids.empty());
  EXPECT_TRUE(d.source.empty());
  EXPECT_NE(d.note.find("no eos_token_id in"), std::string::npos) << d.note;
}

TEST(StopTokens, BadDefaultFilesAreNamed) {
  std::string e = error_of([] { defaults(dir_with("bad_json", {{"generation_config.json", "{not json"}})); });
  EXPECT_NE(e.find("generation_config.json: not valid JSON"), std::string::npos) << e;
  e = error_of([] { defaults(dir_with("bad_id", {{"generation_config.json", R"({"eos_token_id": [1, "x"]})"}})); });
  EXPECT_NE(e.find("generation_config.json: eos_token_id holds \"x\", not a token id"), std::string::npos) << e;
  e = error_of([] { defaults(dir_with("neg_id", {{"config.json", R"({"eos_token_id": -1})"}})); });
  EXPECT_NE(e.find("config.json: eos_token_id holds -1"), std::string::npos) << e;
  e = error_of([] { defaults(dir_with("bad_eos", {{"tokenizer_config.json", R"({"eos_token": "<|no_such|>"})"}})); });
  EXPECT_NE(e.find("eos_token '<|no_such|>' is not a token of the tokenizer"), std::string::npos) << e;
  e = error_of([] { defaults(dir_with("bad_eos_form", {{"tokenizer_config.json", R"({"eos_token": 5})"}})); });
  EXPECT_NE(e.find("eos_token is 5, not a token's text"), std::string::npos) << e;
}
