// dflash_train's data.train cache key (trainer/prepared_data.h): what makes a prepared file stale
// (the input's bytes, the tokenizer's files, each option) and what does not (a touched input, the
// summary), and the start-up checks of data.train and data.tokenizer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "test_util.h"
#include "trainer/config.h"
#include "trainer/prepared_data.h"

using namespace dflash;
using namespace dflash::trainer;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

struct PreparedKey : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("dflash_prepared_key_" + std::to_string(::getpid()));
  void SetUp() override {
    fs::remove_all(dir);
    fs::create_directories(dir / "tok");
    write("chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
    write("tok/tokenizer.json", "{\"model\": {}}");
    write("tok/tokenizer_config.json", "{\"chat_template\": \"{{ messages }}\"}");
  }
  void TearDown() override { fs::remove_all(dir); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir / name, std::ios::binary) << text; }
  TrainConfig config(const std::vector<std::string>& more = {}) {
    std::vector<std::string> sets = {"data.train=" + (dir / "chat.jsonl").string(), "data.tokenizer=" + (dir / "tok").string()};
    sets.insert(sets.end(), more.begin(), more.end());
    return TrainConfig::embedded_default(sets);
  }
};

}  // namespace

TEST_F(PreparedKey, ChangesOfInputTokenizerAndOptionsAreNamed) {
  const nlohmann::json k0 = prepared_key(config());
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config())), "");
  EXPECT_EQ(k0["input"]["bytes"], fs::file_size(dir / "chat.jsonl"));
  EXPECT_EQ(k0["tokenizer"]["files"]["chat_template.jinja"], nullptr);
  EXPECT_EQ(k0["options"]["max_length"], 256);  // the tiny recipe's data.max_length

  // Each option.
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.prepare.think=out"}))),
            "options.think: was \"in\", now \"out\"");
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.prepare.last_turn_only=true"}))),
            "options.last_turn_only: was false, now true");
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.prepare.enable_thinking=false"}))),
            "options.enable_thinking: was null, now false");
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.max_length=300"}))), "options.max_length: was 256, now 300");
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.prepare.skip_bad=true"}))),
            "options.skip_bad: was false, now true");
  EXPECT_EQ(prepared_key_difference(k0, prepared_key(config({"data.prepare.prompts_only=true", "data.regenerate.enabled=true"}))),
            "options.prompts_only: was false, now true");

  // Other rendering rules (a file prepared by an older dflash: no "rules", or another version).
  nlohmann::json old_rules = k0;
  old_rules.erase("rules");
  EXPECT_EQ(prepared_key_difference(old_rules, k0), "rules: not in the earlier key");
  old_rules["rules"] = 1;
  EXPECT_EQ(prepared_key_difference(old_rules, k0), "rules: was 1, now 2");

  // A template of its own: its bytes are in the key.
  write("own.jinja", "{{ messages }}?");
  const nlohmann::json own = prepared_key(config({"data.prepare.chat_template=" + (dir / "own.jinja").string()}));
  EXPECT_THAT(prepared_key_difference(k0, own), HasSubstr("options.chat_template: was null, now \""));
  write("own.jinja", "{{ messages }}?!");
  EXPECT_THAT(prepared_key_difference(own, prepared_key(config({"data.prepare.chat_template=" + (dir / "own.jinja").string()}))),
              HasSubstr("options.chat_template: was \""));

  // The tokenizer's files: a template beside it, an edited tokenizer.json.
  write("tok/chat_template.jinja", "{{ messages }}!");
  EXPECT_THAT(prepared_key_difference(k0, prepared_key(config())), HasSubstr("tokenizer.files.chat_template.jinja: was null"));
  fs::remove(dir / "tok/chat_template.jinja");
  write("tok/tokenizer.json", "{\"model\": {} }");
  EXPECT_THAT(prepared_key_difference(k0, prepared_key(config())), HasSubstr("tokenizer.files.tokenizer.json: was \""));
}

TEST_F(PreparedKey, SameSizeOtherBytesIsAChangeATouchIsNot) {
  const nlohmann::json k0 = prepared_key(config());
  const fs::path in = dir / "chat.jsonl";
  // Touched: another mtime, the same bytes: the same key (the mtime is not compared).
  fs::last_write_time(in, fs::last_write_time(in) + std::chrono::seconds(5));
  const nlohmann::json k1 = prepared_key(config(), k0);
  EXPECT_NE(k1["input"]["mtime_ns"], k0["input"]["mtime_ns"]);
  EXPECT_EQ(prepared_key_difference(k0, k1), "");
  // The same bytes under another name, the tokenizer in another directory: the same key.
  fs::copy_file(in, dir / "copy.jsonl");
  fs::copy(dir / "tok", dir / "tok2");
  EXPECT_EQ(prepared_key_difference(
                k0, prepared_key(config({"data.train=" + (dir / "copy.jsonl").string(), "data.tokenizer=" + (dir / "tok2").string()}), k0)),
            "");
  // One byte changed, same size, new mtime: hashed again, a change.
  write("chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"ho\"}]}\n");
  fs::last_write_time(in, fs::last_write_time(in) + std::chrono::seconds(10));
  EXPECT_THAT(prepared_key_difference(k0, prepared_key(config(), k0)), HasSubstr("input.sha256: was \""));
  // With the size and mtime of the previous key, its hash is trusted (as make and rsync do): only
  // what the key says is compared, so a previous key with a forged hash shows through.
  nlohmann::json forged = prepared_key(config());
  forged["input"]["sha256"] = "feed";
  EXPECT_EQ(prepared_key(config(), forged)["input"]["sha256"], "feed");
}

TEST_F(PreparedKey, StartUpChecksNameTheKeys) {
  EXPECT_THAT(error_of([&] { check_train_text(config({"data.train=" + (dir / "nope.jsonl").string()})); }),
              HasSubstr("data.train '" + (dir / "nope.jsonl").string() + "' does not exist"));
  EXPECT_THAT(error_of([&] { check_train_text(config({"data.train=" + dir.string()})); }), HasSubstr("is not a file"));
  EXPECT_THAT(error_of([&] { check_train_text(config({"data.prepare.chat_template=" + (dir / "no.jinja").string()})); }),
              HasSubstr("data.prepare.chat_template '" + (dir / "no.jinja").string() + "' does not exist"));
  EXPECT_THAT(error_of([&] { check_train_text(config({"data.tokenizer=" + dir.string()})); }),
              HasSubstr("data.tokenizer '" + dir.string() + "' holds no tokenizer.json"));
  const TrainConfig from_target = TrainConfig::embedded_default(
      {"data.train=" + (dir / "chat.jsonl").string(), "model.target.path=" + dir.string()});
  EXPECT_THAT(error_of([&] { check_train_text(from_target); }),
              HasSubstr("model.target.path (data.tokenizer is not set) '" + dir.string() + "' holds no tokenizer.json"));
}
