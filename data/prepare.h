#pragma once
// dflash_data prepare: a JSONL of conversations -> the target's chat template -> token ids + a loss
// mask on the assistant content -> a dflash.tokens.v1 dataset (data/dataset.h). Also what
// dflash_train uses when data.train is a JSONL of conversations.
//
// Row forms (one JSON object a line; blank lines are skipped and not counted):
//   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., ...}, ...]}  (OpenAI)
//   {"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant"|"tool"|..., "value": ...}]}  (ShareGPT)
//   {"text": "..."}   plain text, no template: every token supervised
// Rendering uses the template's own text (text/chat_template.h) with add_generation_prompt false,
// or true for a prompt-only row (no assistant message): such a row gets the generation prompt and an
// all-zero mask, ready for dflash_data regenerate. With prompts_only every row becomes such a prompt:
// a conversation's trailing assistant turns are dropped (the generation prompt follows its last
// user / tool turn) and a text row is kept as it is; every mask is zero (prompt sets for
// regenerate and dflash_eval made from the same files as the training data).
//
// Mask rule: a token is supervised iff its bytes (Tokenizer::encode_with_offsets) overlap an
// assistant span of the render (after the assistant header, through the end-of-turn marker;
// text/chat_template.h AssistantSpan), so a token straddling a span's edge is supervised, as
// transformers' return_assistant_tokens_mask (TRL) and SpecForge's offset masks mark it. With
// ThinkMode::out the <think>...</think> block (and the newlines after it) is taken out of the span;
// with last_turn_only only the last assistant message's span counts. docs/data.md "prepare".
#include <cstddef>
#include <optional>
#include <string>

namespace dflash::text {
class Tokenizer;
}

namespace dflash::data {

// The rendering rules' version, in dflash_train's key of a prepared JSONL (trainer/prepared_data.cpp), so a
// file prepared under other rules is made again. 2: the messages as the serving stacks pass them to the
// template (text/conversation.h: null content, "reasoning", tool-call arguments in JSON strings).
inline constexpr int kPrepareRules = 2;

enum class ThinkMode { in, out };  // <think>...</think> inside or outside the loss

struct PrepareOptions {
  std::string tokenizer;      // a directory (tokenizer.json + tokenizer_config.json / chat_template.jinja) or a tokenizer.json
  std::string chat_template;  // "" = the tokenizer directory's own; else a .jinja file
  ThinkMode think = ThinkMode::in;
  bool last_turn_only = false;           // supervise only the last assistant message
  bool prompts_only = false;             // every row a prompt (all-zero mask; trailing assistant turns dropped)
  std::optional<bool> enable_thinking;   // passed to the template; unset = the template's default
  size_t max_length = 0;                 // 0 = none; longer rows are truncated to it and counted
  bool skip_bad = false;                 // bad rows are counted and reported instead of stopping the run
  bool progress = true;                  // a progress bar on stderr
  unsigned threads = 0;                  // 0 = hardware concurrency
};

struct PrepareSummary {
  size_t rows = 0;         // non-blank input lines
  size_t written = 0;      // sequences in the output
  size_t bad_skipped = 0;  // bad rows skipped (skip_bad)
  size_t prompt_only = 0;  // rows without an assistant turn (all-zero mask)
  size_t truncated = 0;    // rows cut to max_length
  // Rows the serving stacks' message rules changed before the template (text/conversation.h): tool-call
  // arguments parsed from JSON strings or set to {}, a null / missing content made "", "reasoning"
  // copied to reasoning_content.
  size_t served_arguments = 0, served_content = 0, served_reasoning = 0;
  size_t tokens = 0;       // tokens written
  size_t supervised = 0;   // tokens with loss_mask 1
  std::string first_bad;   // the first bad row's error, when skip_bad skipped any
  // Several lines: rows, written, tokens, supervised share, truncated, prompt-only, bad; and the rows the
  // serving rules changed, when any.
  std::string describe() const;
};

// Reads `in_jsonl`, writes `out_h5` atomically (out_h5 + ".tmp", renamed at the end; nothing is
// left on an error). Throws dflash::Error naming the file, the row (1-based line number) and the
// field for a bad row unless skip_bad. Throws when no row is written.
PrepareSummary prepare_jsonl(const std::string& in_jsonl, const std::string& out_h5, const PrepareOptions& options);
// The same with the tokenizer already loaded (text/tokenizer.h; loading Qwen's takes a second or two):
// `tokenizer` must be what options.tokenizer names, whose directory still gives the chat template.
PrepareSummary prepare_jsonl(const std::string& in_jsonl, const std::string& out_h5, const PrepareOptions& options,
                             const text::Tokenizer& tokenizer);

}  // namespace dflash::data
