#pragma once
// UTF-8 helpers shared by the tokenizer: strict validation (the byte offset of the first error),
// code point iteration over text already validated, and Rust's from_utf8_lossy (what HF decode
// does with a byte string that is not UTF-8).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::text {

inline constexpr size_t kValidUtf8 = static_cast<size_t>(-1);

// Byte offset of the first ill-formed sequence (its first byte: a stray continuation byte, a lead
// byte not followed by its continuations, an overlong, a surrogate or a code point past U+10FFFF),
// or kValidUtf8.
size_t invalid_utf8_offset(std::string_view s);

// Throws dflash::Error "<what>: invalid UTF-8 at byte N (0x..)" unless s is valid UTF-8.
void check_utf8(std::string_view s, const std::string& what);

// Length in bytes of the sequence whose lead byte is b (1 for ASCII and for invalid leads).
inline size_t utf8_len(unsigned char b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

// The code point at s[i] (s valid UTF-8); sets n to its byte length.
inline uint32_t decode_utf8(std::string_view s, size_t i, size_t& n) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (p[0] < 0x80) { n = 1; return p[0]; }
  if (p[0] < 0xE0) { n = 2; return (uint32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F); }
  if (p[0] < 0xF0) { n = 3; return (uint32_t(p[0] & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F); }
  n = 4;
  return (uint32_t(p[0] & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) | (uint32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

void append_utf8(std::string& out, uint32_t cp);

// Bytes -> valid UTF-8, each maximal ill-formed subpart replaced by U+FFFD (Rust's
// String::from_utf8_lossy, the Unicode "substitution of maximal subparts" practice).
std::string utf8_lossy(std::string_view bytes);

}  // namespace dflash::text
