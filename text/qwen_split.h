#pragma once
// A hand-written matcher for the Qwen pre-tokenizer regexes (a fast path; the Oniguruma Regex stays
// the general engine and the test suite checks the two agree on every golden text and on random
// strings):
//   Qwen2/2.5/3:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen3.5/3.6:  the same with [\p{L}\p{M}]+ for \p{L}+ and [^\s\p{L}\p{M}\p{N}] for [^\s\p{L}\p{N}]
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/regex.h"

namespace dflash::text {

extern const char* const kQwen3Pattern;
extern const char* const kQwen35Pattern;

class QwenSplitter {
 public:
  // The splitter for this exact pattern string, or nothing when it is not one of the two above.
  static std::optional<QwenSplitter> for_pattern(const std::string& pattern);

  // The same matches Regex(pattern).find_all would give, for valid UTF-8 s.
  void find_all(std::string_view s, std::vector<Span>& out) const;

 private:
  explicit QwenSplitter(bool marks_are_letters) : marks_are_letters_(marks_are_letters) {}
  bool marks_are_letters_;  // Qwen3.5: \p{M} joins \p{L} in the letter runs and leaves the punctuation class
};

}  // namespace dflash::text
