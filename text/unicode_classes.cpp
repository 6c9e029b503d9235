#include "text/unicode_classes.h"

#include <oniguruma.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace dflash::text {

namespace {

constexpr uint32_t kCodePoints = 0x110000;

// Marks every code point of one Oniguruma ctype (a property name such as "L", or a built-in ctype).
void mark(std::vector<uint8_t>& t, int ctype, uint8_t bit, const char* name) {
  OnigEncoding enc = ONIG_ENCODING_UTF8;
  OnigCodePoint sb_out = 0;
  const OnigCodePoint* ranges = nullptr;
  const int rc = ONIGENC_GET_CTYPE_CODE_RANGE(enc, ctype, &sb_out, &ranges);
  DFLASH_CHECK(rc == 0 && ranges != nullptr, "Oniguruma has no code ranges for the class " << name << " (code " << rc << ")");
  const OnigCodePoint n = ranges[0];
  for (OnigCodePoint k = 0; k < n; ++k) {
    const OnigCodePoint lo = ranges[1 + 2 * k], hi = ranges[2 + 2 * k];
    for (OnigCodePoint c = lo; c <= hi && c < kCodePoints; ++c) t[c] |= bit;
  }
}

int property_ctype(const char* name) {
  OnigEncoding enc = ONIG_ENCODING_UTF8;
  auto* p = reinterpret_cast<OnigUChar*>(const_cast<char*>(name));
  const int ctype = ONIGENC_PROPERTY_NAME_TO_CTYPE(enc, p, p + std::strlen(name));
  DFLASH_CHECK(ctype >= 0, "Oniguruma does not know the Unicode property " << name);
  return ctype;
}

}  // namespace

const uint8_t* unicode_class_table() {
  static std::vector<uint8_t> table;
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encs[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encs, 1);
    std::vector<uint8_t> t(kCodePoints, 0);
    mark(t, property_ctype("L"), kLetter, "\\p{L}");
    mark(t, property_ctype("N"), kNumber, "\\p{N}");
    mark(t, property_ctype("M"), kMark, "\\p{M}");
    mark(t, ONIGENC_CTYPE_SPACE, kSpace, "\\s");
    table = std::move(t);
  });
  return table.data();
}

}  // namespace dflash::text
