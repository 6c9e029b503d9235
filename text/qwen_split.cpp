#include "text/qwen_split.h"

#include <cstdint>

#include "text/unicode_classes.h"
#include "text/utf8.h"

namespace dflash::text {

const char* const kQwen3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kQwen35Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

std::optional<QwenSplitter> QwenSplitter::for_pattern(const std::string& pattern) {
  if (pattern == kQwen3Pattern) return QwenSplitter(false);
  if (pattern == kQwen35Pattern) return QwenSplitter(true);
  return std::nullopt;
}

namespace {

// Simple case folding onto the contraction letters: ASCII both cases, and U+017F (long s), whose
// fold is 's' (Oniguruma's (?i) matches it; no other code point folds onto s, t, r, e, v, m, l or d).
uint32_t fold(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c == 0x17F) return 's';
  return c;
}

}  // namespace

void QwenSplitter::find_all(std::string_view s, std::vector<Span>& out) const {
  // Per character: its code point, class bits and byte offset (offset[n] = s.size()).
  thread_local std::vector<uint32_t> cps;
  thread_local std::vector<uint8_t> cls;
  thread_local std::vector<size_t> offset;
  const uint8_t* table = unicode_class_table();
  cps.clear();
  cls.clear();
  offset.clear();
  for (size_t i = 0; i < s.size();) {
    size_t len;
    const uint32_t c = decode_utf8(s, i, len);
    cps.push_back(c);
    cls.push_back(table[c]);
    offset.push_back(i);
    i += len;
  }
  const size_t n = cps.size();
  offset.push_back(s.size());

  const uint8_t letter = marks_are_letters_ ? (kLetter | kMark) : kLetter;
  auto is_ll = [&](size_t i) { return i < n && (cls[i] & letter); };
  auto is_num = [&](size_t i) { return i < n && (cls[i] & kNumber); };
  auto is_space = [&](size_t i) { return i < n && (cls[i] & kSpace); };
  auto is_nl = [&](size_t i) { return i < n && (cps[i] == '\r' || cps[i] == '\n'); };
  // [^\s\p{L}\p{N}] (Qwen3) / [^\s\p{L}\p{M}\p{N}] (Qwen3.5)
  auto is_punct = [&](size_t i) { return i < n && !(cls[i] & (kSpace | letter | kNumber)); };
  // [^\r\n\p{L}\p{N}]: the optional character before a letter run (marks allowed in both patterns).
  auto is_prefix = [&](size_t i) { return i < n && cps[i] != '\r' && cps[i] != '\n' && !(cls[i] & (kLetter | kNumber)); };

  size_t i = 0;
  while (i < n) {
    size_t j = 0;  // match end (characters), 0 = no match at i
    const uint32_t c = cps[i];
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (c == '\'' && i + 1 < n) {
      const uint32_t a = fold(cps[i + 1]);
      if (a == 's' || a == 't' || a == 'm' || a == 'd') j = i + 2;
      else if ((a == 'r' || a == 'v') && i + 2 < n && fold(cps[i + 2]) == 'e') j = i + 3;
      else if (a == 'l' && i + 2 < n && fold(cps[i + 2]) == 'l') j = i + 3;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (j == 0) {
      if (is_prefix(i) && is_ll(i + 1)) {
        j = i + 2;
        while (is_ll(j)) ++j;
      } else if (is_ll(i)) {
        j = i + 1;
        while (is_ll(j)) ++j;
      }
    }
    // \p{N}
    if (j == 0 && is_num(i)) j = i + 1;
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    if (j == 0) {
      size_t k = n;  // start of the punctuation run
      if (c == ' ' && is_punct(i + 1)) k = i + 1;
      else if (is_punct(i)) k = i;
      if (k != n) {
        j = k + 1;
        while (is_punct(j)) ++j;
        while (is_nl(j)) ++j;
      }
    }
    if (j == 0 && is_space(i)) {
      size_t r = i + 1;  // end of the whitespace run
      while (is_space(r)) ++r;
      size_t last_nl = n;
      for (size_t k = i; k < r; ++k)
        if (cps[k] == '\r' || cps[k] == '\n') last_nl = k;
      if (last_nl != n) j = last_nl + 1;   // \s*[\r\n]+ (backtracks to the run's last newline)
      else if (r == n) j = r;              // \s+(?!\S) at the end of the text
      else if (r - i >= 2) j = r - 1;      // \s+(?!\S): all but the run's last character
      else j = r;                          // \s+
    }
    if (j == 0) {  // nothing matches here (cannot happen for these patterns: every class is covered)
      ++i;
      continue;
    }
    out.emplace_back(offset[i], offset[j]);
    i = j;
  }
}

}  // namespace dflash::text
