#include "text/conversation.h"

#include <utility>

#include "core/error.h"

namespace dflash::text {

using ojson = nlohmann::ordered_json;

const char* const kSharegptSpeakers =
    "human/user, gpt/assistant/chatgpt/bard/model, system, tool/function/observation/function_response";

const char* sharegpt_role(std::string_view from) {
  if (from == "human" || from == "user") return "user";
  if (from == "gpt" || from == "assistant" || from == "chatgpt" || from == "bard" || from == "model") return "assistant";
  if (from == "system") return "system";
  if (from == "tool" || from == "function" || from == "observation" || from == "function_response") return "tool";
  return nullptr;
}

ojson sharegpt_messages(const ojson& row, const std::string& where) {
  static const char* kTurn = "ShareGPT turns are {\"from\": \"human\" | \"gpt\" | ..., \"value\": \"...\"}";
  const auto conv = row.find("conversations");
  DFLASH_REQUIRE_HINT(conv != row.end() && conv->is_array(),
                      where << ": \"conversations\" is not a list (" << (conv == row.end() ? "missing" : conv->type_name()) << ")",
                      kTurn);
  ojson out = ojson::array();
  for (size_t i = 0; i < conv->size(); ++i) {
    const ojson& t = (*conv)[i];
    const std::string at = where + ": conversations[" + std::to_string(i) + "]";
    DFLASH_REQUIRE_HINT(t.is_object() && t.contains("from") && t["from"].is_string(), at << " has no string \"from\"", kTurn);
    const std::string& from = t["from"].get_ref<const std::string&>();
    const char* role = sharegpt_role(from);
    DFLASH_REQUIRE_HINT(role != nullptr, at << ".from = \"" << from << "\" is not a known speaker",
                        std::string("speakers: ") + kSharegptSpeakers);
    DFLASH_REQUIRE_HINT(t.contains("value") && t["value"].is_string(), at << " has no string \"value\"", kTurn);
    out.push_back(ojson{{"role", role}, {"content", t["value"]}});
  }
  // ShareGPT's optional top-level system prompt.
  const auto sys = row.find("system");
  if (sys != row.end() && sys->is_string() && !sys->get_ref<const std::string&>().empty() &&
      (out.empty() || out[0]["role"] != "system"))
    out.insert(out.begin(), ojson{{"role", "system"}, {"content", *sys}});
  return out;
}

ServingChanges serving_messages(ojson& messages, const std::string& where) {
  ServingChanges ch;
  if (!messages.is_array()) return ch;
  static const char* kCallForm =
      "a tool call is {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}} (OpenAI) or "
      "{\"name\": ..., \"arguments\": ...}";
  static const char* kArgsForm =
      "a tool call's arguments: a JSON object, or a string holding one (as the OpenAI API writes them, e.g. "
      "\"{\\\"city\\\": \\\"Paris\\\"}\"); vLLM and SGLang parse the string before the chat template sees it";
  for (size_t i = 0; i < messages.size(); ++i) {
    ojson& m = messages[i];
    if (!m.is_object()) continue;
    if (!m.contains("content") || m["content"].is_null()) {  // vLLM and SGLang: "" (or [], the same here)
      m["content"] = "";
      ++ch.content;
    }
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string() || role->get_ref<const std::string&>() != "assistant") continue;
    // The reasoning under "reasoning" (vLLM's and OpenRouter's responses) goes where the Qwen3.5 / 3.6
    // templates read it, as vLLM copies it there (a message that has reasoning_content keeps it).
    if (const auto r = m.find("reasoning"); r != m.end() && r->is_string() && !m.contains("reasoning_content")) {
      m["reasoning_content"] = *r;
      ++ch.reasoning;
    }
    const auto calls = m.find("tool_calls");
    if (calls == m.end() || !calls->is_array()) continue;
    if (calls->empty()) {  // no calls: the template's plain assistant path, as vLLM drops the empty list
      m.erase(calls);
      ++ch.empty_calls;
      continue;
    }
    for (size_t k = 0; k < calls->size(); ++k) {
      const std::string at = where + ": messages[" + std::to_string(i) + "].tool_calls[" + std::to_string(k) + "]";
      ojson& call = (*calls)[k];
      DFLASH_REQUIRE_HINT(call.is_object(), at << " is a " << call.type_name() << ", not an object", kCallForm);
      ojson* fn = &call;
      std::string fn_at = at;
      if (call.contains("function")) {
        DFLASH_REQUIRE_HINT(call["function"].is_object(),
                            at << ".function is a " << call["function"].type_name() << ", not an object", kCallForm);
        fn = &call["function"];
        fn_at += ".function";
      }
      ojson& args = (*fn)["arguments"];  // (a missing key becomes null here, then {} below, as vLLM sets it)
      if (args.is_object()) continue;
      if (args.is_null() || (args.is_string() && args.get_ref<const std::string&>().empty())) {
        args = ojson::object();
        ++ch.arguments;
        continue;
      }
      DFLASH_REQUIRE_HINT(args.is_string(), fn_at << ".arguments is a " << args.type_name() << ", not an object or a JSON string",
                          kArgsForm);
      ojson parsed;
      try {
        parsed = ojson::parse(args.get_ref<const std::string&>());
      } catch (const ojson::exception& e) {
        DFLASH_REJECT_HINT(fn_at << ".arguments is a string but not valid JSON (" << e.what() << ")", kArgsForm);
      }
      DFLASH_REQUIRE_HINT(parsed.is_object(), fn_at << ".arguments decodes to a JSON " << parsed.type_name() << ", not an object",
                          kArgsForm);
      args = std::move(parsed);
      ++ch.arguments;
    }
  }
  return ch;
}

}  // namespace dflash::text
