// text/conversation.h: chat-dataset rows -> the messages a template renders, as vLLM / SGLang make
// them from an OpenAI request (null content as "", tool-call arguments parsed from their JSON strings, keys in order),
// and ShareGPT rows -> OpenAI messages. The rendered effect is checked in test_prepare.cpp
// (ToolCallArgumentsAreParsedAsTheServingStacksParseThem) and against jinja2 in its goldens.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_util.h"
#include "text/conversation.h"

using namespace dflash;
using ojson = nlohmann::ordered_json;

namespace {

ojson normalized(const char* messages, text::ServingChanges* changes = nullptr) {
  ojson m = ojson::parse(messages);
  const text::ServingChanges ch = text::serving_messages(m, "in.jsonl:7");
  if (changes) *changes = ch;
  return m;
}

TEST(Conversation, ToolCallArgumentsFromJsonStrings) {
  text::ServingChanges ch;
  const ojson m = normalized(R"([
    {"role": "user", "content": "q", "tool_calls": [{"function": {"name": "u", "arguments": "{\"z\": 1}"}}]},
    {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "{\"zeta\": 1, \"alpha\": [1, 2.5, \"\u00fc\"], \"n\": null}"}},
      {"type": "function", "function": {"name": "g", "arguments": {"b": 2, "a": 1}}},
      {"type": "function", "function": {"name": "h", "arguments": null}},
      {"type": "function", "function": {"name": "i", "arguments": ""}},
      {"type": "function", "function": {"name": "j"}},
      {"name": "k", "arguments": "{\"x\": true}"}]},
    {"role": "assistant", "content": "none", "tool_calls": []},
    {"role": "tool", "content": "{\"not\": \"touched\"}"}])", &ch);
  EXPECT_EQ(ch.arguments, 5u);  // calls 0, 2, 3, 4, 5 of the assistant's six
  EXPECT_EQ(ch.empty_calls, 1u);
  EXPECT_EQ(ch.content + ch.reasoning, 0u);
  const ojson& calls = m[1]["tool_calls"];
  ASSERT_EQ(calls.size(), 6u);
  // Parsed into an object, keys in their written order (tojson prints them so, as json.dumps does).
  EXPECT_EQ(calls[0]["function"]["arguments"].dump(), R"({"zeta":1,"alpha":[1,2.5,"ü"],"n":null})");
  EXPECT_EQ(calls[1]["function"]["arguments"].dump(), R"({"b":2,"a":1})");  // an object stays as it is
  for (int k : {2, 3, 4}) EXPECT_EQ(calls[k]["function"]["arguments"], ojson::object()) << "call " << k;
  EXPECT_EQ(calls[5]["arguments"].dump(), R"({"x":true})");  // a call without the "function" wrapper
  EXPECT_FALSE(m[2].contains("tool_calls")) << "an empty list is dropped";
  EXPECT_EQ(m[2]["content"], "none");
  // Only assistant turns are touched: a user's (odd) tool_calls and a tool result stay strings.
  EXPECT_TRUE(m[0]["tool_calls"][0]["function"]["arguments"].is_string());
  EXPECT_TRUE(m[3]["content"].is_string());
  // A null or missing content is "" (vLLM, SGLang); other contents stay as they are.
  const ojson c = normalized(R"([{"role": "user"}, {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f"}}]},
                                  {"role": "user", "content": [{"type": "text", "text": "part"}]}, {"role": "tool", "content": 3}])", &ch);
  EXPECT_EQ(ch.content, 2u);
  EXPECT_EQ(ch.arguments, 1u);  // the missing arguments
  EXPECT_EQ(c[0]["content"], "");
  EXPECT_EQ(c[1]["content"], "");
  EXPECT_TRUE(c[2]["content"].is_array());
  EXPECT_EQ(c[3]["content"], 3);
  // "reasoning" goes to reasoning_content (vLLM), unless the message has its own; only on assistant turns.
  const ojson r = normalized(R"([{"role": "user", "content": "q", "reasoning": "u"},
                                  {"role": "assistant", "content": "a", "reasoning": "why"},
                                  {"role": "assistant", "content": "b", "reasoning": "x", "reasoning_content": "own"}])", &ch);
  EXPECT_EQ(ch.reasoning, 1u);
  EXPECT_FALSE(r[0].contains("reasoning_content"));
  EXPECT_EQ(r[1]["reasoning_content"], "why");
  EXPECT_EQ(r[2]["reasoning_content"], "own");
  // Idempotent.
  ojson again = m;
  EXPECT_FALSE(text::serving_messages(again, "x").any());
  EXPECT_EQ(again, m);
}

TEST(Conversation, BadToolCallsAreNamed) {
  const struct {
    const char* calls;
    const char* error;
  } cases[] = {
      {R"(["f"])", "in.jsonl:7: messages[1].tool_calls[0] is a string, not an object"},
      {R"([{"type": "function", "function": "f"}])", "in.jsonl:7: messages[1].tool_calls[0].function is a string, not an object"},
      {R"([{}, {"function": {"name": "f", "arguments": "{\"a\": }"}}])",
       "in.jsonl:7: messages[1].tool_calls[1].function.arguments is a string but not valid JSON"},
      {R"([{"function": {"name": "f", "arguments": "\"text\""}}])",
       "in.jsonl:7: messages[1].tool_calls[0].function.arguments decodes to a JSON string, not an object"},
      {R"([{"function": {"name": "f", "arguments": "NaN"}}])", "messages[1].tool_calls[0].function.arguments is a string but not valid JSON"},
      {R"([{"name": "f", "arguments": [1]}])", "in.jsonl:7: messages[1].tool_calls[0].arguments is a array, not an object or a JSON string"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.calls);
    const std::string msgs =
        std::string(R"([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": )") + c.calls + "}]";
    const std::string err = error_of([&] { normalized(msgs.c_str()); });
    EXPECT_NE(err.find(c.error), std::string::npos) << err;
  }
}

TEST(Conversation, SharegptRows) {
  EXPECT_STREQ(text::sharegpt_role("human"), "user");
  EXPECT_STREQ(text::sharegpt_role("gpt"), "assistant");
  EXPECT_STREQ(text::sharegpt_role("function_response"), "tool");
  EXPECT_EQ(text::sharegpt_role("alien"), nullptr);
  const ojson m = text::sharegpt_messages(
      ojson::parse(R"({"system": "Be terse.", "conversations": [{"from": "human", "value": "a"}, {"from": "model", "value": "b"}]})"),
      "r:1");
  EXPECT_EQ(m, ojson::parse(R"([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}])"));
  // A leading system turn wins over the row's "system"; an empty "system" adds nothing.
  EXPECT_EQ(text::sharegpt_messages(ojson::parse(R"({"system": "x", "conversations": [{"from": "system", "value": "s"}]})"), "r")[0]["content"],
            "s");
  EXPECT_EQ(text::sharegpt_messages(ojson::parse(R"({"system": "", "conversations": [{"from": "human", "value": "a"}]})"), "r").size(), 1u);
  EXPECT_NE(error_of([] { text::sharegpt_messages(ojson::parse(R"({"conversations": [{"from": "alien", "value": "a"}]})"), "r:2"); })
                .find("r:2: conversations[0].from = \"alien\" is not a known speaker"),
            std::string::npos);
  EXPECT_NE(error_of([] { text::sharegpt_messages(ojson::parse(R"({"conversations": [{"from": "human"}]})"), "r:3"); })
                .find("r:3: conversations[0] has no string \"value\""),
            std::string::npos);
  EXPECT_NE(error_of([] { text::sharegpt_messages(ojson::parse(R"({"conversations": {}})"), "r:4"); })
                .find("r:4: \"conversations\" is not a list (object)"),
            std::string::npos);
}

}  // namespace
