#pragma once
// dflash::text conversations: the rows of a chat dataset (OpenAI "messages" or ShareGPT
// "conversations") turned into the messages a chat template renders, the way the serving stacks
// turn an OpenAI request into them. The template engine itself (chat_template.h) takes messages as
// transformers' apply_chat_template does, as they are; what differs between a dataset and a
// request is decided here, once, for every tool that renders conversations (`dflash_data prepare`,
// dflash_train's JSONL data, dflash_eval's chat prompts), so a drafter trains on the bytes its
// serving stack will render.
#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace dflash::text {

// The OpenAI role of a ShareGPT speaker: human / user -> "user"; gpt / assistant / chatgpt / bard /
// model -> "assistant"; system; tool / function / observation / function_response -> "tool";
// nullptr for any other.
const char* sharegpt_role(std::string_view from);
// The speakers sharegpt_role knows, for error hints.
extern const char* const kSharegptSpeakers;

// A ShareGPT row ({"conversations": [{"from": ..., "value": "..."}, ...], "system": "..."}) as OpenAI
// messages: each turn {"role": sharegpt_role(from), "content": value}, and the row's optional
// top-level "system" string as a leading system message (unless the turns begin with one). Errors
// name `where` and the turn: a turn that is not an object or has no string "from" / "value", an
// unknown speaker, a "conversations" that is not a list.
nlohmann::ordered_json sharegpt_messages(const nlohmann::ordered_json& row, const std::string& where);

// The messages as vLLM and SGLang pass an OpenAI request's messages to a chat template (vLLM's
// chat_utils: `_parse_chat_message_content` and `_postprocess_messages`):
//  - a message's missing or null "content" becomes "" (the OpenAI API writes null on an assistant's
//    tool-call turn; Qwen3's template fails on null, the Qwen3.5 / 3.6 templates render null, "" and []
//    alike);
//  - an assistant's "reasoning" string (the field vLLM's and OpenRouter's responses use) is copied to
//    "reasoning_content", where the Qwen3.5 / 3.6 templates read it, as vLLM copies it, unless the
//    message has a "reasoning_content" of its own (else the think block would render empty and the
//    drafter would train without the reasoning it must draft at serving time);
//  - an assistant's empty `tool_calls` list is removed (the template takes its plain assistant path);
//  - each tool call's arguments (`function.arguments`, or `arguments` of a call written without the
//    `function` wrapper) that are a JSON string are parsed into an object, keys in their written
//    order (so `tojson` prints them as Python's json.dumps prints json.loads' dict; transformers'
//    tool-use templates expect a mapping there); missing, null or "" arguments become {} (vLLM's rule);
// and, where vLLM would coerce to {} with a warning, a dataset row is refused instead (a training row
// must not silently become another one): a call that is not an object, a `function` that is not
// an object, arguments that are not valid JSON, decode to something other than an object, or are
// neither a string nor an object. `where` prefixes the errors ("IN:line"), which name the message
// and call ("messages[2].tool_calls[0].function.arguments"). Other fields (content parts included)
// are left as they are. Idempotent.
// What serving_messages changed: messages whose content was null or missing, assistant messages given
// reasoning_content from "reasoning", tool calls whose arguments were parsed or set to {}, empty
// tool_calls lists dropped.
struct ServingChanges {
  size_t content = 0, reasoning = 0, arguments = 0, empty_calls = 0;
  bool any() const { return content + reasoning + arguments + empty_calls > 0; }
};
ServingChanges serving_messages(nlohmann::ordered_json& messages, const std::string& where);

}  // namespace dflash::text
