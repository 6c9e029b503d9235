#include "text/utf8.h"

#include <cstdio>

#include "core/error.h"

namespace dflash::text {

namespace {

// Length of the well-formed sequence starting at s[i], or 0 with `bad` set to the offset (relative
// to i) of the first byte that breaks it. Follows Table 3-7 of the Unicode standard.
size_t well_formed(std::string_view s, size_t i, size_t& bad) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const unsigned char b0 = p[i];
  if (b0 < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) len = 2;
  else if (b0 >= 0xE0 && b0 <= 0xEF) { len = 3; if (b0 == 0xE0) lo = 0xA0; if (b0 == 0xED) hi = 0x9F; }
  else if (b0 >= 0xF0 && b0 <= 0xF4) { len = 4; if (b0 == 0xF0) lo = 0x90; if (b0 == 0xF4) hi = 0x8F; }
  else { bad = 0; return 0; }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= n) { bad = k; return 0; }
    const unsigned char b = p[i + k];
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) { bad = k; return 0; }
  }
  return len;
}

}  // namespace

size_t invalid_utf8_offset(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs dominate real text: skip 8 bytes at a time while none has the high bit.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    size_t bad = 0;
    const size_t len = well_formed(s, i, bad);
    if (len == 0) return i;  // the start of the ill-formed sequence (as Python's "position")
    i += len;
  }
  return kValidUtf8;
}

void check_utf8(std::string_view s, const std::string& what) {
  const size_t off = invalid_utf8_offset(s);
  if (off == kValidUtf8) return;
  char hex[16];
  std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(s[off]));
  DFLASH_FAIL_HINT(what << ": invalid UTF-8 at byte " << off << " (" << hex << ")",
                   "the tokenizer takes UTF-8 text; convert the input (e.g. iconv -f LATIN1 -t UTF-8) or fix that byte");
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    const size_t len = well_formed(s, i, bad);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal subpart s[i, i + max(bad, 1))
      i += bad > 0 ? bad : 1;
    }
  }
  return out;
}

}  // namespace dflash::text
