// dflash_data prepare (data/prepare.h) end to end on the real Qwen3 tokenizer: for each
// configuration of tests/data/prepare/goldens.tar.xz (made by tests/reference/make_prepare_goldens.py
// from python3-jinja2 renders, TRL's {% generation %} spans or SpecForge's regex spans, and token
// offsets from tokenizer.json's own strings) the dataset's ids and loss masks equal the golden's,
// row for row, and the summary counts them; bad rows stop the run naming the line and the field, or
// are counted with skip_bad; nothing is left behind by a failed run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "text/tokenizer.h"

using namespace dflash;
using namespace dflash::data;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kTokenizer = DFLASH_TOKENIZER_DATA;       // tokenizer.json + tokenizer_config.json (Qwen3)
const std::string kGoldens = DFLASH_PREPARE_GOLDENS;        // goldens.json
const std::string kTemplates = DFLASH_TEST_DATA_DIR "/chat_templates";

// Loaded once: Qwen3's tokenizer takes a second or two to load.
const text::Tokenizer& qwen3() {
  static const text::Tokenizer t = text::Tokenizer::from_file(kTokenizer);
  return t;
}

PrepareSummary prepare(const fs::path& in, const fs::path& out, const PrepareOptions& o) {
  return prepare_jsonl(in.string(), out.string(), o, qwen3());
}

const json& goldens() {
  static const json g = [] {
    std::ifstream f(kGoldens);
    EXPECT_TRUE(f.good()) << kGoldens;
    return json::parse(f);
  }();
  return g;
}

fs::path work_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("dflash_test_prepare_" + std::to_string(::getpid())) / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_lines(const fs::path& p, const std::vector<std::string>& lines) {
  std::ofstream f(p, std::ios::binary);
  for (const auto& l : lines) f << l << '\n';
}

PrepareOptions options_of(const json& cfg) {
  PrepareOptions o;
  o.tokenizer = kTokenizer;
  if (!cfg["chat_template"].is_null()) o.chat_template = kTemplates + "/" + cfg["chat_template"].get<std::string>();
  const json& op = cfg["options"];
  if (op.contains("think")) o.think = op["think"] == "out" ? ThinkMode::out : ThinkMode::in;
  o.last_turn_only = op.value("last_turn_only", false);
  if (op.contains("enable_thinking")) o.enable_thinking = op["enable_thinking"].get<bool>();
  o.max_length = op.value("max_length", 0);
  o.progress = false;
  o.threads = 2;
  return o;
}

TEST(Prepare, MatchesTheGoldens) {
  ASSERT_EQ(goldens()["configs"].size(), 8u);
  for (const auto& [name, cfg] : goldens()["configs"].items()) {
    SCOPED_TRACE(name);
    const fs::path d = work_dir(name);
    std::vector<std::string> lines;
    for (const auto& r : cfg["rows"]) lines.push_back(r["row"]);
    write_lines(d / "in.jsonl", lines);
    PrepareOptions o = options_of(cfg);
    o.skip_bad = true;
    const PrepareSummary s = prepare(d / "in.jsonl", d / "out.h5", o);
    validate_file((d / "out.h5").string());
    const Dataset ds({(d / "out.h5").string()});
    size_t seq = 0, bad = 0, prompt_only = 0, truncated = 0, tokens = 0, supervised = 0;
    for (size_t k = 0; k < cfg["rows"].size(); ++k) {
      const json& g = cfg["rows"][k];
      if (g.contains("error")) {
        ++bad;
        continue;
      }
      ASSERT_LT(static_cast<int64_t>(seq), ds.num_sequences()) << "row " << k + 1;
      const Sequence q = ds.sequence(static_cast<int64_t>(seq++));
      const auto ids = g["ids"].get<std::vector<int32_t>>();
      const auto mask = g["mask"].get<std::vector<uint8_t>>();
      ASSERT_EQ(q.ids, ids) << "row " << k + 1 << ": " << g["row"].get<std::string>();
      if (q.mask != mask) {
        std::ostringstream diff;
        for (size_t t = 0; t < mask.size(); ++t)
          if (q.mask[t] != mask[t]) diff << " token " << t << " (id " << ids[t] << "): got " << int(q.mask[t]) << " want " << int(mask[t]) << ";";
        ADD_FAILURE() << "row " << k + 1 << " mask differs:" << diff.str() << " row " << g["row"].get<std::string>();
      }
      prompt_only += g.value("prompt_only", false);
      truncated += g.value("truncated", false);
      tokens += ids.size();
      for (uint8_t m : mask) supervised += m;
    }
    EXPECT_EQ(ds.num_sequences(), static_cast<int64_t>(seq));
    EXPECT_EQ(s.rows, cfg["rows"].size());
    EXPECT_EQ(s.written, seq);
    EXPECT_EQ(s.bad_skipped, bad);
    EXPECT_EQ(s.prompt_only, prompt_only);
    EXPECT_EQ(s.truncated, truncated);
    EXPECT_EQ(s.tokens, tokens);
    EXPECT_EQ(s.supervised, supervised);
    EXPECT_GT(seq, 15u);
    if (bad) {
      EXPECT_NE(s.first_bad.find("the chat template refused the row"), std::string::npos) << s.first_bad;
    }
    if (name == "qwen3_own_max24") {
      EXPECT_GT(truncated, 5u);
    }
    EXPECT_GT(prompt_only, 0u);
    EXPECT_FALSE(fs::exists(d / "out.h5.tmp"));
  }
}

// Without skip_bad, the first bad row (a template raise here) stops the run: its line is named and
// no output is left.
TEST(Prepare, ATemplateErrorStopsTheRunNamingTheLine) {
  const json& cfg = goldens()["configs"]["qwen3_5_training"];
  const fs::path d = work_dir("stop");
  std::vector<std::string> lines;
  size_t first_bad = 0;
  for (const auto& r : cfg["rows"]) {
    lines.push_back(r["row"]);
    if (r.contains("error") && first_bad == 0) first_bad = lines.size();
  }
  ASSERT_GT(first_bad, 0u);
  write_lines(d / "in.jsonl", lines);
  try {
    prepare(d / "in.jsonl", d / "out.h5", options_of(cfg));
    ADD_FAILURE() << "a bad row was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("in.jsonl:" + std::to_string(first_bad) + ": the chat template refused the row"), std::string::npos)
        << e.message();
    EXPECT_NE(e.hint().find("--skip-bad"), std::string::npos) << e.hint();
  }
  EXPECT_FALSE(fs::exists(d / "out.h5"));
  EXPECT_FALSE(fs::exists(d / "out.h5.tmp"));
}

struct BadRow {
  std::string line, message;
};

TEST(Prepare, BadRowsAreNamedAndSkippedOnRequest) {
  const std::string good = R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})";
  const std::vector<BadRow> bad = {
      {R"({"messages": [{"role": "user", "content": "hi"})", "not valid JSON"},
      {R"({"prompt": "hi"})", "the row has none of \"messages\", \"conversations\", \"text\""},
      {R"([1, 2])", "the row is not a JSON object"},
      {R"({"messages": []})", "the conversation has no messages"},
      {R"({"messages": "hi"})", "\"messages\" is not a list"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]})", "messages[1].role = \"robot\" is not a known role"},
      {R"({"messages": [{"content": "a"}]})", "messages[0] has no string \"role\""},
      {R"({"conversations": [{"from": "human", "value": "a"}, {"from": "alien", "value": "b"}]})",
       "conversations[1].from = \"alien\" is not a known speaker"},
      {R"({"conversations": [{"from": "human"}]})", "conversations[0] has no string \"value\""},
      {R"({"text": 5})", "\"text\" is not a string"},
      {"{\"text\": \"bad \xC3( byte\"}", "invalid UTF-8 at byte 14 of the line (0xC3)"},
      {R"({"messages": [{"role": "assistant", "content": "no user"}], "tools": 3})", "\"tools\" is not a list"},
      // OpenAI tool calls whose arguments vLLM would coerce to {} (with a warning): refused, naming the call
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": "}}]}]})",
       "messages[1].tool_calls[0].function.arguments is a string but not valid JSON"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]})",
       "messages[1].tool_calls[0].function.arguments decodes to a JSON array, not an object"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": 7}]}]})",
       "messages[1].tool_calls[0].arguments is a number, not an object or a JSON string"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": ["f"]}]})",
       "messages[1].tool_calls[0] is a string, not an object"},
  };
  const fs::path d = work_dir("bad");
  PrepareOptions o;
  o.tokenizer = kTokenizer;
  o.progress = false;
  for (size_t k = 0; k < bad.size(); ++k) {
    SCOPED_TRACE(bad[k].line);
    write_lines(d / "in.jsonl", {good, "", bad[k].line, good});  // the blank line is skipped: the bad row is line 3
    try {
      prepare(d / "in.jsonl", d / "out.h5", o);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(e.is_user_error());
      EXPECT_NE(e.message().find("in.jsonl:3: "), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(bad[k].message), std::string::npos) << e.message();
    }
    EXPECT_FALSE(fs::exists(d / "out.h5"));
    EXPECT_FALSE(fs::exists(d / "out.h5.tmp"));
  }
  // All of them at once with skip_bad: counted, the good rows written, the first named.
  std::vector<std::string> lines{good};
  for (const auto& b : bad) lines.push_back(b.line);
  lines.push_back(good);
  write_lines(d / "all.jsonl", lines);
  o.skip_bad = true;
  const PrepareSummary s = prepare(d / "all.jsonl", d / "all.h5", o);
  EXPECT_EQ(s.rows, bad.size() + 2);
  EXPECT_EQ(s.written, 2u);
  EXPECT_EQ(s.bad_skipped, bad.size());
  EXPECT_NE(s.first_bad.find("all.jsonl:2: not valid JSON"), std::string::npos) << s.first_bad;
  EXPECT_NE(s.describe().find("bad rows:    " + std::to_string(bad.size()) + " skipped"), std::string::npos) << s.describe();
  // Nothing good at all: refused, no file.
  write_lines(d / "none.jsonl", {bad[0].line, bad[1].line});
  EXPECT_THROW(prepare(d / "none.jsonl", d / "none.h5", o), Error);
  EXPECT_FALSE(fs::exists(d / "none.h5"));
}

// The output does not depend on the thread count, and an existing output is replaced whole.
TEST(Prepare, ThreadsDoNotChangeTheOutput) {
  const json& cfg = goldens()["configs"]["qwen3_own"];
  const fs::path d = work_dir("threads");
  std::vector<std::string> lines;
  for (int rep = 0; rep < 60; ++rep)  // several batches' worth of rows on 1 and 3 threads
    for (const auto& r : cfg["rows"])
      if (!r.contains("error")) lines.push_back(r["row"]);
  write_lines(d / "in.jsonl", lines);
  PrepareOptions o = options_of(cfg);
  o.threads = 1;
  const PrepareSummary a = prepare(d / "in.jsonl", d / "a.h5", o);
  o.threads = 3;
  const PrepareSummary b = prepare(d / "in.jsonl", d / "b.h5", o);
  EXPECT_EQ(a.tokens, b.tokens);
  const Dataset da({(d / "a.h5").string()}), db({(d / "b.h5").string()});
  ASSERT_EQ(da.num_sequences(), static_cast<int64_t>(lines.size()));
  ASSERT_EQ(db.num_sequences(), da.num_sequences());
  for (int64_t i = 0; i < da.num_sequences(); ++i) {
    const Sequence x = da.sequence(i), y = db.sequence(i);
    ASSERT_EQ(x.ids, y.ids) << i;
    ASSERT_EQ(x.mask, y.mask) << i;
  }
}

// OpenAI rows carry tool-call arguments as a JSON string; vLLM and SGLang parse it before the chat
// template sees it, so prepare does too (text/conversation.h): the string form gives the ids and
// mask of the object form, on Qwen3's template (which would print a string as it is: the compact
// spacing here differs from tojson's) and on Qwen3.6's (which needs a mapping); an empty tool_calls
// list is the plain assistant turn, null / "" / missing arguments are {}, and a null content is "".
TEST(Prepare, ToolCallArgumentsAreParsedAsTheServingStacksParseThem) {
  const std::string head = R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking.", )";
  const std::string tail = R"(}, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]})";
  auto call = [&](const std::string& args) {
    return head + R"("tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": )" + args + "}}]" + tail;
  };
  const std::vector<std::string> lines = {
      call(R"({"city": "Z\u00fcrich", "days": [1, 2], "metric": true})"),      // 1: the object
      call(R"("{\"city\":\"Z\u00fcrich\",\"days\":[1,2],\"metric\":true}")"),  // 2: the same as an OpenAI string
      call("{}"),                                                              // 3
      call("null"),                                                            // 4: = 3
      call(R"("")"),                                                           // 5: = 3
      head + R"("tool_calls": [{"type": "function", "function": {"name": "weather"}}])" + tail,  // 6: = 3
      head + R"("tool_calls": [])" + tail,                                     // 7
      head + R"("x": 0)" + tail,                                               // 8: = 7 (no tool_calls)
      R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, )"
      R"("tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]}]})",  // 9: OpenAI's null content
      R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", )"
      R"("tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {}}}]}]})",    // 10: = 9
  };
  const fs::path d = work_dir("toolargs");
  write_lines(d / "in.jsonl", lines);
  for (const char* tmpl : {"", "qwen3_6_training.jinja"}) {
    SCOPED_TRACE(std::string("template ") + (*tmpl ? tmpl : "Qwen3's own"));
    PrepareOptions o;
    o.tokenizer = kTokenizer;
    if (*tmpl) o.chat_template = kTemplates + "/" + tmpl;
    o.progress = false;
    const PrepareSummary s = prepare(d / "in.jsonl", d / "out.h5", o);
    ASSERT_EQ(s.written, lines.size());
    // Counted: rows 2, 4, 5, 6 and 9 had their arguments parsed or set to {}, row 9 a null content.
    EXPECT_EQ(s.served_arguments, 5u);
    EXPECT_EQ(s.served_content, 1u);
    EXPECT_EQ(s.served_reasoning, 0u);
    EXPECT_NE(s.describe().find("as served:   5 rows' tool-call arguments parsed from JSON strings (or {}), 1 rows' null content"),
              std::string::npos)
        << s.describe();
    const Dataset ds({(d / "out.h5").string()});
    auto seq = [&](int64_t i) { return ds.sequence(i); };
    EXPECT_EQ(seq(1).ids, seq(0).ids) << "string arguments render otherwise than their object";
    EXPECT_EQ(seq(1).mask, seq(0).mask);
    EXPECT_NE(seq(2).ids, seq(0).ids);
    for (int64_t i : {3, 4, 5}) {
      EXPECT_EQ(seq(i).ids, seq(2).ids) << "row " << i + 1 << " is not the empty-arguments call";
      EXPECT_EQ(seq(i).mask, seq(2).mask) << "row " << i + 1;
    }
    EXPECT_EQ(seq(6).ids, seq(7).ids) << "an empty tool_calls list is not the plain assistant turn";
    EXPECT_NE(seq(6).ids, seq(2).ids);
    EXPECT_EQ(seq(8).ids, seq(9).ids) << "null content is not the empty string (Qwen3's template fails on null)";
    EXPECT_EQ(seq(8).mask, seq(9).mask);
  }
}

TEST(Prepare, OptionsAndInputsAreChecked) {
  const fs::path d = work_dir("opts");
  write_lines(d / "in.jsonl", {R"({"text": "hello"})"});
  PrepareOptions o;
  o.progress = false;
  EXPECT_THROW(prepare_jsonl((d / "in.jsonl").string(), (d / "out.h5").string(), o), Error);  // no tokenizer
  o.tokenizer = (d / "no_such").string();
  EXPECT_THROW(prepare_jsonl((d / "in.jsonl").string(), (d / "out.h5").string(), o), Error);
  o.tokenizer = kTokenizer;
  EXPECT_THROW(prepare(d / "missing.jsonl", d / "out.h5", o), Error);
  // A template file that does not exist is reported on the first chat row (text rows need none).
  o.chat_template = (d / "no_such.jinja").string();
  const PrepareSummary s = prepare(d / "in.jsonl", d / "out.h5", o);
  EXPECT_EQ(s.written, 1u);
  EXPECT_EQ(s.supervised, s.tokens);
  write_lines(d / "chat.jsonl", {R"({"messages": [{"role": "user", "content": "a"}]})"});
  try {
    prepare(d / "chat.jsonl", d / "chat.h5", o);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("chat.jsonl:1: no chat template"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("no_such.jinja"), std::string::npos) << e.message();
  }
}

}  // namespace
