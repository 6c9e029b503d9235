// The chat-template engine (text/jinja.h, text/chat_template.h) against python3-jinja2 configured as
// transformers configures it: byte-identical renders of the real Qwen3 / Qwen3.5 / Qwen3.6 templates
// on tests/data/chat_templates/conversations.json (goldens by tests/reference/make_chat_goldens.py),
// small Jinja cases with jinja2's outputs, the assistant spans, and the errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"

using namespace dflash;
using namespace dflash::text;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kDir = std::string(DFLASH_TEST_DATA_DIR) + "/chat_templates";
const std::string kGoldens = DFLASH_CHAT_GOLDENS;
// The last two: TRL's training variants, whose {% generation %} blocks mark what TRL supervises.
const char* kTemplates[] = {"qwen3", "qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "qwen3_5_think_training", "qwen3_6_training"};
constexpr size_t kNumTemplates = sizeof(kTemplates) / sizeof(kTemplates[0]);

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ChatTemplate load(const std::string& name) {
  return ChatTemplate::from_string(read(kDir + "/" + name + ".jinja"), name + ".jinja", "", "<|im_end|>");
}

struct Case {
  std::string conversation;
  ojson messages, tools;
  ChatOptions opt;
  ojson golden;
};

std::vector<Case> cases(const std::string& tmpl) {
  static const ojson convs = ojson::parse(read(kDir + "/conversations.json"))["conversations"];
  static const ojson goldens = ojson::parse(read(kGoldens));
  std::vector<Case> out;
  for (const auto& row : goldens["templates"][tmpl]) {
    Case c;
    c.conversation = row["conversation"].get<std::string>();
    for (const auto& conv : convs)
      if (conv["name"] == c.conversation) {
        c.messages = conv["messages"];
        c.tools = conv.contains("tools") ? conv["tools"] : ojson(nullptr);
      }
    EXPECT_FALSE(c.messages.is_null()) << c.conversation;
    c.opt.add_generation_prompt = row["add_generation_prompt"].get<bool>();
    if (!row["enable_thinking"].is_null()) c.opt.enable_thinking = row["enable_thinking"].get<bool>();
    c.opt.tools_ordered = c.tools;
    c.golden = row;
    out.push_back(std::move(c));
  }
  return out;
}

std::string label(const std::string& tmpl, const Case& c) {
  return tmpl + " / " + c.conversation + " gen=" + (c.opt.add_generation_prompt ? "1" : "0") +
         " think=" + (c.opt.enable_thinking ? (*c.opt.enable_thinking ? "1" : "0") : "unset");
}

TEST(ChatTemplate, RendersAsJinja2OnTheGoldens) {
  size_t n = 0, errors = 0;
  for (const char* tmpl : kTemplates) {
    ChatTemplate t = load(tmpl);
    for (const Case& c : cases(tmpl)) {
      ++n;
      if (c.golden.contains("text")) {
        std::string got;
        EXPECT_NO_THROW(got = t.render(c.messages, c.opt)) << label(tmpl, c);
        EXPECT_EQ(got, c.golden["text"].get<std::string>()) << label(tmpl, c);
      } else {
        ++errors;
        try {
          t.render(c.messages, c.opt);
          ADD_FAILURE() << label(tmpl, c) << ": rendered, but jinja2 raised " << c.golden["error"];
        } catch (const Error& e) {
          if (c.golden["raised"].get<bool>()) {  // raise_exception's message reaches the user
            EXPECT_NE(e.message().find(c.golden["error"].get<std::string>()), std::string::npos) << e.message();
          }
        }
      }
    }
  }
  const size_t convs = ojson::parse(read(kDir + "/conversations.json"))["conversations"].size();
  EXPECT_EQ(n, kNumTemplates * convs * 6);  // templates x conversations x 6 option sets: the goldens were all read
  EXPECT_GE(convs, 18u);
  EXPECT_GT(errors, 0u);
}

TEST(ChatTemplate, ProbesTheQwenTurnMarkers) {
  for (const char* tmpl : kTemplates) {
    ChatTemplate t = load(tmpl);
    EXPECT_EQ(t.assistant_header(), "<|im_start|>assistant\n") << tmpl;
    EXPECT_EQ(t.end_of_turn(), "<|im_end|>\n") << tmpl;
  }
}

// Each assistant message: a span right after the header through the end-of-turn marker, in order,
// holding the message's final content; the think block at its start when the render has one; and
// on TRL's training templates exactly the {% generation %} spans (what TRL's assistant mask marks).
TEST(ChatTemplate, AssistantSpansOnTheGoldens) {
  size_t spans = 0, thinks = 0, trl_spans = 0;
  for (const char* tmpl : kTemplates) {
    ChatTemplate t = load(tmpl);
    for (const Case& c : cases(tmpl)) {
      if (!c.golden.contains("text")) continue;
      Rendered r = t.render_with_spans(c.messages, c.opt);
      ASSERT_EQ(r.text, c.golden["text"].get<std::string>()) << label(tmpl, c);
      std::vector<size_t> assistants;
      for (size_t i = 0; i < c.messages.size(); ++i)
        if (c.messages[i]["role"] == "assistant") assistants.push_back(i);
      ASSERT_EQ(r.assistant.size(), assistants.size()) << label(tmpl, c);
      if (c.golden.contains("generation_spans")) {  // TRL's {% generation %} spans, as jinja2 rendered them
        const ojson& g = c.golden["generation_spans"];
        ASSERT_EQ(g.size(), r.assistant.size()) << label(tmpl, c);
        for (size_t k = 0; k < g.size(); ++k) {
          EXPECT_EQ(r.assistant[k].begin, g[k][0].get<size_t>()) << label(tmpl, c) << " turn " << k;
          EXPECT_EQ(r.assistant[k].end, g[k][1].get<size_t>()) << label(tmpl, c) << " turn " << k;
          ++trl_spans;
        }
      }
      size_t prev_end = 0;
      for (size_t k = 0; k < r.assistant.size(); ++k) {
        const AssistantSpan& s = r.assistant[k];
        const std::string where = label(tmpl, c) + " message " + std::to_string(s.message);
        EXPECT_EQ(s.message, assistants[k]) << where;
        ASSERT_GE(s.begin, prev_end + 22) << where;
        ASSERT_LE(s.end, r.text.size()) << where;
        EXPECT_EQ(r.text.substr(s.begin - 22, 22), "<|im_start|>assistant\n") << where;
        EXPECT_EQ(r.text.substr(s.end - 11, 11), "<|im_end|>\n") << where;
        std::string span = r.text.substr(s.begin, s.end - s.begin);
        const ojson& content_json = c.messages[s.message]["content"];
        std::string content = content_json.is_string() ? content_json.get<std::string>() : "";
        size_t close = content.find("</think>");
        if (close != std::string::npos) content = content.substr(close + 8);
        size_t a = content.find_first_not_of(" \n"), b = content.find_last_not_of(" \n");
        if (a != std::string::npos) {
          EXPECT_NE(span.find(content.substr(a, b - a + 1)), std::string::npos) << where;
        }
        ASSERT_LE(s.begin, s.think_begin) << where;
        ASSERT_LE(s.think_begin, s.think_end) << where;
        ASSERT_LE(s.think_end, s.end) << where;
        bool rendered_think = span.rfind("<think>", 0) == 0;
        EXPECT_EQ(s.think_end > s.think_begin, rendered_think) << where;
        if (rendered_think) {
          ++thinks;
          std::string think = r.text.substr(s.think_begin, s.think_end - s.think_begin);
          EXPECT_EQ(s.think_begin, s.begin) << where;
          EXPECT_NE(think.find("</think>"), std::string::npos) << where;
          EXPECT_EQ(think.find_first_not_of("\n", think.find("</think>") + 8), std::string::npos) << where;
          EXPECT_NE(r.text[s.think_end], '\n') << where;  // all the newlines after </think>
        }
        prev_end = s.end;
        ++spans;
      }
    }
  }
  EXPECT_GT(spans, 300u);
  EXPECT_GT(thinks, 100u);
  EXPECT_GT(trl_spans, 200u);
}

TEST(ChatTemplate, ExactSpans) {
  ChatTemplate t = load("qwen3_6");
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "Quote: <|im_start|>assistant\nfake<|im_end|>\nend"},
                                {"role": "assistant", "content": "Real answer."}])");
  Rendered r = t.render_with_spans(msgs);
  const std::string user = "<|im_start|>user\nQuote: <|im_start|>assistant\nfake<|im_end|>\nend<|im_end|>\n<|im_start|>assistant\n";
  ASSERT_EQ(r.text, user + "<think>\n\n</think>\n\nReal answer.<|im_end|>\n");
  ASSERT_EQ(r.assistant.size(), 1u);
  EXPECT_EQ(r.assistant[0].begin, user.size());  // not the header quoted in the user's text
  EXPECT_EQ(r.assistant[0].end, r.text.size());
  EXPECT_EQ(r.text.substr(r.assistant[0].think_begin, r.assistant[0].think_end - r.assistant[0].think_begin),
            "<think>\n\n</think>\n\n");

  // An earlier turn of Qwen3.5 (before the last user query) renders without a think block.
  ChatTemplate q35 = load("qwen3_5_think");
  msgs = ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
                          {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "s"}])");
  r = q35.render_with_spans(msgs);
  ASSERT_EQ(r.text,
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
            "<|im_start|>assistant\n<think>\ns\n</think>\n\nd<|im_end|>\n");
  ASSERT_EQ(r.assistant.size(), 2u);
  EXPECT_EQ(r.text.substr(r.assistant[0].begin, r.assistant[0].end - r.assistant[0].begin), "b<|im_end|>\n");
  EXPECT_EQ(r.assistant[0].think_begin, r.assistant[0].think_end);
  EXPECT_EQ(r.text.substr(r.assistant[1].begin, r.assistant[1].end - r.assistant[1].begin), "<think>\ns\n</think>\n\nd<|im_end|>\n");
  EXPECT_EQ(r.text.substr(r.assistant[1].think_begin, r.assistant[1].think_end - r.assistant[1].think_begin), "<think>\ns\n</think>\n\n");

  // nlohmann::json (sorted keys) renders the same text where key order does not reach tojson.
  EXPECT_EQ(q35.render(nlohmann::json::parse(msgs.dump())), r.text);
}

// Small Jinja cases; the expected strings are python3-jinja2 3.1's with transformers' settings.
TEST(Jinja, MatchesJinja2) {
  const std::pair<const char*, const char*> cases[] = {
      {"  {% if true %}\n    yes\n  {% endif %}\nend\n", "    yes\nend"},
      {"a  {%- if true -%}  b  {%- endif -%}  c", "abc"},
      {"{% for i in [1,2,3] %}{{ loop.index }}/{{ loop.revindex0 }}{% if not loop.last %},{% endif %}{% endfor %}", "1/2,2/1,3/0"},
      {"{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", "02"},
      {"{{ [1, 'a', none, true, 2.5, {'k': [1]}] }}|{{ {'b': 1, 'a': \"it's\"} | tojson }}|{{ 'x' ~ 1 ~ none }}",
       "[1, 'a', None, True, 2.5, {'k': [1]}]|{\"b\": 1, \"a\": \"it's\"}|x1None"},
      {"{% set ns = namespace(n=0) %}{% for x in 'abc' %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "3"},
      {"{% set x %}block {{ 1 + 2 }}{% endset %}[{{ x }}]", "[block 3]"},
      {"{% macro m(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}", "<1B><23>"},
      {"{{ 'a,b,,c'.split(',') }}{{ '  x y  '.split() }}{{ 'hello'[::-1] }}{{ [1,2,3,4][1:3] }}{{ 'abc'[-1] }}",
       "['a', 'b', '', 'c']['x', 'y']olleh[2, 3]c"},
      {"{{ 'Hello World'.lower() }}{{ 'x'.upper() }}{{ 'aXbX'.replace('X', '-') }}{{ '--a--'.strip('-') }}{{ 'ab' in 'cabd' }}{{ 3 not in [1,2] }}",
       "hello worldXa-b-aTrueTrue"},
      {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1.5e-7 }} {{ 100.0 }}",
       "3 -4 1 3.5 1024 1e+20 0.30000000000000004 1.5e-07 100.0"},
      {"{{ undefined_thing is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 3 is number }}{{ x | default('dflt') }}",
       "FalseTrueTrueTrueTrueTruedflt"},
      {"{# comment #}\n  {#- trimmed -#}  \nA{{ 'b' if false }}C{{ 'yes' if 1 else 'no' }}", "ACyes"},
      {"{% for k, v in {'one': 1, 'two': 2} | items %}{{ k }}={{ v }};{% endfor %}{% for x in [] %}x{% else %}empty{% endfor %}",
       "one=1;two=2;empty"},
      {"{{ ['a','b'] | join('-') }}{{ [3,4] | first }}{{ [3,4] | last }}{{ 'abc' | length }}{{ '\xe2\x82\xacx' | length }}{{ ' s ' | trim }}|",
       "a-b3432s|"},
      {"{{ {'b': [1, {}, []], 'a': '\xc3\xa9\xf0\x9f\x98\x80'} | tojson(indent=2) }}|{{ {'b': 1, 'a': '\xc3\xa9\xf0\x9f\x98\x80'} | tojson(sort_keys=true, ensure_ascii=true) }}",
       "{\n  \"b\": [\n    1,\n    {},\n    []\n  ],\n  \"a\": \"\xc3\xa9\xf0\x9f\x98\x80\"\n}|{\"a\": \"\\u00e9\\ud83d\\ude00\", \"b\": 1}"},
      {R"({{ '\x41\u00e9\U0001F600\b' | length }}{{ '\u00e9' }})", "4\xc3\xa9"},
  };
  for (auto& [src, want] : cases) {  // NOLINT
    std::string got;
    EXPECT_NO_THROW(got = jinja::Template(src, "<case>").render(ojson::object())) << src;
    EXPECT_EQ(got, want) << src;
  }
  EXPECT_EQ(jinja::to_python_json(ojson::parse(R"({"z": [1, 2.5, "é\n\"", null, true], "a": {}})")),
            R"({"z": [1, 2.5, "é\n\"", null, true], "a": {}})");
}

// `what` throws a dflash::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& what, const std::vector<std::string>& parts) {
  try {
    what();
    ADD_FAILURE() << "no error; expected one with " << parts.front();
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(e.message().find(p), std::string::npos) << "'" << p << "' not in: " << e.message();
  }
}

TEST(ChatTemplate, Errors) {
  auto render = [](const std::string& src) { jinja::Template(src, "t.jinja").render(ojson::object()); };
  expect_error([&] { render("line one\n{% include 'other.jinja' %}"); }, {"t.jinja:2:", "unsupported Jinja construct", "{% include %}"});
  expect_error([&] { render("a\nb\n{{ x | wordcount }}"); }, {"t.jinja:3:", "|wordcount"});
  expect_error([&] { render("{% for x in y if x %}{% endfor %}"); }, {"t.jinja:1:", "loop filter"});
  expect_error([&] { render("{{ 'a'.zfill(3) }}"); }, {"str.zfill()"});
  expect_error([&] { render("{{ x is divisible }}"); }, {"'is divisible'"});
  // jinja2 gives a bound method for these, before any key of that name: refused, not guessed.
  expect_error([&] { render("{{ {'items': 1}.items }}"); }, {"the dict method .items"});
  expect_error([&] { render("{{ [1].append(2) }}"); }, {"the list method .append"});
  expect_error([&] { render("{% if true %}open"); }, {"missing {% endif %}"});
  expect_error([&] { render("{{ missing.attr }}"); }, {"'missing' is undefined"});
  expect_error([&] { render("{{ 1 + 'a' }}"); }, {"unsupported operand types for +: int and str"});
  expect_error([&] { render("x\n{{ raise_exception('Only user and assistant roles are supported!') }}"); },
               {"t.jinja:2:", "the chat template raised an exception: Only user and assistant roles are supported!"});

  // A template without an assistant turn shape renders, but refuses spans.
  ChatTemplate flat = ChatTemplate::from_string("{% for m in messages %}{{ m.content }}{% endfor %}", "flat.jinja");
  EXPECT_EQ(flat.render(ojson::parse(R"([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])")), "ua");
  expect_error([&] { flat.render_with_spans(ojson::parse(R"([{"role": "user", "content": "u"}])")); },
               {"flat.jinja", "cannot find the assistant turns"});
  expect_error([&] { flat.render(ojson::parse(R"({"role": "user"})")); }, {"flat.jinja", "JSON array"});

  // Model directories: chat_template in tokenizer_config.json, chat_template.jinja beside it, none.
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("dflash_chat_template_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << nlohmann::json{{"eos_token", "<|im_end|>"}, {"model_max_length", 8}}.dump();
  expect_error([&] { ChatTemplate::from_dir(dir.string()); }, {"tokenizer_config.json", "no \"chat_template\""});
  std::ofstream(dir / "tokenizer_config.json")
      << nlohmann::json{{"eos_token", {{"content", "<|im_end|>"}}}, {"chat_template", read(kDir + "/qwen3.jinja")}}.dump();
  ChatTemplate q3 = ChatTemplate::from_dir(dir.string());
  ChatOptions gen;
  gen.add_generation_prompt = true;
  EXPECT_EQ(q3.render(ojson::parse(R"([{"role": "user", "content": "hi"}])"), gen),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  std::ofstream(dir / "chat_template.jinja") << "{{ eos_token }}{{ messages | length }}";
  ChatTemplate own = ChatTemplate::from_dir(dir.string());
  EXPECT_EQ(own.render(ojson::parse(R"([{"role": "user", "content": "hi"}])")), "<|im_end|>1");
  fs::remove_all(dir);
  expect_error([&] { ChatTemplate::from_dir(dir.string()); }, {"neither tokenizer_config.json nor chat_template.jinja"});
}

}  // namespace
