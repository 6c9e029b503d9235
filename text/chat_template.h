#pragma once
// dflash::text::ChatTemplate: renders a target's own Jinja chat template (tokenizer_config.json's
// "chat_template", or chat_template.jinja beside it) as transformers' apply_chat_template(...,
// tokenize=False) does, byte for byte, and reports where each assistant turn lies in the output
// (the spans a training loss mask covers).
//
// The Jinja subset (text/jinja.h) is the one the Qwen3 / Qwen3.5 / Qwen3.6 templates use; a
// template that uses anything else is refused with the construct and its line named.
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::text {

// transformers' apply_chat_template keyword arguments.
struct ChatOptions {
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // unset: the template's own default
  nlohmann::json tools = nullptr;       // a list of tool schemas, or null
  nlohmann::json extra = nlohmann::json::object();  // any other template variable
  // The tools in their keys' written order (tojson prints keys in order, as Python's json.dumps does;
  // nlohmann::json sorts them). Takes precedence over `tools` when not null.
  nlohmann::ordered_json tools_ordered = nullptr;
};

// One assistant message's place in the rendered text: [begin, end) byte offsets.
struct AssistantSpan {
  size_t message = 0;        // index into the messages
  size_t begin = 0, end = 0; // the turn's generated part: after the assistant header, through the end-of-turn marker
  // The reasoning block inside [begin, end) (e.g. "<think>...</think>\n\n"), empty when none.
  size_t think_begin = 0, think_end = 0;
};

struct Rendered {
  std::string text;
  std::vector<AssistantSpan> assistant;  // in message order
};

class ChatTemplate {
 public:
  // `dir`: a model directory (tokenizer_config.json, optionally chat_template.jinja). Errors name the file.
  static ChatTemplate from_dir(const std::string& dir);
  // `origin` names the source in errors; bos / eos are the template's bos_token / eos_token.
  static ChatTemplate from_string(const std::string& source, const std::string& origin, const std::string& bos_token = "",
                                  const std::string& eos_token = "");

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // Rendering is const and keeps no state: one ChatTemplate may render on many threads at once.
  // messages: a JSON array of {"role": ..., "content": ..., ...} as transformers takes them.
  // Errors (a raise_exception in the template, an unsupported construct, bad messages) are
  // dflash::Error naming the template origin.
  std::string render(const nlohmann::json& messages, const ChatOptions& opt = {}) const;
  // render() plus the span of each assistant message in the text.
  Rendered render_with_spans(const nlohmann::json& messages, const ChatOptions& opt = {}) const;
  // The same on insertion-ordered JSON: a message's keys (tool-call arguments, above all) print in
  // the order they were read, byte for byte as transformers prints them. nlohmann::json sorts keys,
  // so parse conversations with nlohmann::ordered_json where tojson parity matters.
  std::string render(const nlohmann::ordered_json& messages, const ChatOptions& opt = {}) const;
  Rendered render_with_spans(const nlohmann::ordered_json& messages, const ChatOptions& opt = {}) const;

  // What probing found (see render_with_spans): the assistant header ("<|im_start|>assistant\n") and
  // the end-of-turn marker ("<|im_end|>\n"). Throws the probing error for a template it failed on.
  const std::string& assistant_header() const;
  const std::string& end_of_turn() const;

  const std::string& source() const;
  const std::string& origin() const;

 private:
  struct Impl;
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::text
