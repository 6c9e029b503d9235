#pragma once
// Stop tokens by id or by text, and a target's own end-of-turn ids (dflash_data regenerate,
// dflash_eval, dflash_train's data.regenerate.stop_tokens).
//
// A stop token is given as an id ("151645": all digits) or as token text ("<|im_end|>"): an added
// token's content or a vocab entry (its byte-level spelling, e.g. "Ġthe"), else text that the
// tokenizer encodes to exactly one token (" the"). Text that is not one token is an error naming it
// and the ids it encodes to. Without a tokenizer only ids are accepted.
//
// The target's defaults, in transformers' order (generate() reads model.generation_config: the
// generation_config.json beside the weights, else a GenerationConfig made from config.json; the
// tokenizer's eos_token is not consulted, and the two are not united):
//   1. generation_config.json "eos_token_id" (an int or a list)
//   2. config.json "eos_token_id" (top level, else text_config's)
//   3. tokenizer_config.json "eos_token" (a string or {"content": ...}) through the tokenizer:
//      dflash's fallback for a directory that holds only tokenizer files (not transformers').
// The first file that has the key decides; a directory with none of them has no default.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dflash::text {

class Tokenizer;

// Whether `spec` is a token id (all decimal digits).
bool is_token_id(const std::string& spec);

// One stop token: an id as is (not range-checked: the caller knows the vocabulary), else the text
// through `tok` (null: no tokenizer; text is then refused naming `what`, e.g. "--stop-token").
int32_t resolve_stop_token(const std::string& spec, const Tokenizer* tok, const std::string& what);
std::vector<int32_t> resolve_stop_tokens(const std::vector<std::string>& specs, const Tokenizer* tok,
                                         const std::string& what);

struct DefaultStopTokens {
  std::vector<int32_t> ids;  // empty: no default
  std::string source;        // the file that gave them ("generation_config.json"), empty when none
  std::string note;          // what was looked at when there is no default (for the log)
};
// The defaults of a model / tokenizer directory (`dir` may also be a tokenizer.json file: its
// directory is read). `tokenizer` is called only when tokenizer_config.json's eos_token must be
// resolved; it may return null (then that step is skipped and the note says so).
DefaultStopTokens default_stop_tokens(const std::string& dir, const std::function<const Tokenizer*()>& tokenizer);

// "<|im_end|> (151645), <|endoftext|> (151643)"; plain ids without a tokenizer.
std::string describe_stop_tokens(const std::vector<int32_t>& ids, const Tokenizer* tok);

// What a tool stops at: `specs` when there are any (the defaults are then not used; `what` names
// the option in errors, e.g. "--stop-token"), else the defaults of `defaults_dir` ("": none are
// looked for). `tokenizer` is called only when text must be resolved or described; it may return null.
struct StopTokenChoice {
  std::vector<int32_t> ids;
  // One line for the log: "stop tokens: <|im_end|> (151645) from generation_config.json",
  // "... from --stop-token", or "stop tokens: none (<why>)".
  std::string log;
};
StopTokenChoice choose_stop_tokens(const std::vector<std::string>& specs, const std::string& what,
                                   const std::string& defaults_dir, const std::function<const Tokenizer*()>& tokenizer);

}  // namespace dflash::text
