#pragma once
// The pre-tokenizers' regex engine: Oniguruma, as Hugging Face tokenizers uses it (its `onig`
// crate: Ruby syntax, UTF-8, no options), so that every split is the one HF makes.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash::text {

// A byte range [first, second) of a string.
using Span = std::pair<size_t, size_t>;

class Regex {
 public:
  // Throws dflash::Error naming the pattern and Oniguruma's message when it does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  const std::string& pattern() const { return pattern_; }

  // Every match, left to right, as the onig crate's find_iter yields them: each search starts
  // where the previous match ended (the whole string stays visible to look-around), and an empty
  // match right after the previous match is skipped by advancing one character. Thread-safe.
  void find_all(std::string_view s, std::vector<Span>& out) const;

 private:
  std::string pattern_;
  void* reg_ = nullptr;  // OnigRegex
};

// A pattern that matches `literal` exactly (Split's {"String": ...} form).
std::string regex_escape(std::string_view literal);

}  // namespace dflash::text
