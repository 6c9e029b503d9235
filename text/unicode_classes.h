#pragma once
// Per-code-point classes the hand-written Qwen splitter needs (\p{L}, \p{N}, \p{M}, \s), taken
// from Oniguruma's own Unicode tables so the fast path and the regex engine agree on every code
// point. Built once per process (~1.1 MB, a few ms), read-only after.
#include <cstdint>

namespace dflash::text {

enum UnicodeClass : uint8_t { kLetter = 1, kNumber = 2, kMark = 4, kSpace = 8 };

// Bit set of UnicodeClass for every code point 0 .. 0x10FFFF.
const uint8_t* unicode_class_table();

}  // namespace dflash::text
