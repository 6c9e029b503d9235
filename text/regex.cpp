#include "text/regex.h"

#include <oniguruma.h>

#include <mutex>

#include "core/error.h"
#include "text/utf8.h"

namespace dflash::text {

namespace {

void init_onig() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encs[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encs, 1);
  });
}

// One region per thread, reused across searches (onig_search fills it; the regex itself is
// read-only during a search, so one compiled pattern serves every thread).
OnigRegion* thread_region() {
  struct Holder {
    OnigRegion* r = onig_region_new();
    ~Holder() { onig_region_free(r, 1); }
  };
  thread_local Holder h;
  return h.r;
}

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  init_onig();
  check_utf8(pattern, "regex pattern");
  OnigErrorInfo einfo;
  OnigRegex reg = nullptr;
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int rc = onig_new(&reg, p, p + pattern.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &einfo);
  if (rc != ONIG_NORMAL) {
    OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(msg, rc, &einfo);
    DFLASH_FAIL("regex '" << pattern << "' does not compile with Oniguruma: " << reinterpret_cast<char*>(msg));
  }
  reg_ = reg;
}

Regex::~Regex() {
  if (reg_) onig_free(static_cast<OnigRegex>(reg_));
}

void Regex::find_all(std::string_view s, std::vector<Span>& out) const {
  auto* reg = static_cast<OnigRegex>(reg_);
  OnigRegion* region = thread_region();
  const auto* str = reinterpret_cast<const OnigUChar*>(s.data());
  const OnigUChar* end = str + s.size();
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= s.size()) {
    onig_region_clear(region);
    const int r = onig_search(reg, str, end, str + pos, end, region, ONIG_OPTION_NONE);
    if (r == ONIG_MISMATCH) break;
    DFLASH_CHECK(r >= 0, "Oniguruma search failed (code " << r << ") for regex '" << pattern_ << "'");
    const size_t b = static_cast<size_t>(region->beg[0]), e = static_cast<size_t>(region->end[0]);
    if (b == e && have_last && last_end == e) {
      // An empty match where the previous one ended: step over one character and search again.
      pos += pos < s.size() ? utf8_len(static_cast<unsigned char>(s[pos])) : 1;
      continue;
    }
    pos = e;
    have_last = true;
    last_end = e;
    out.emplace_back(b, e);
  }
}

std::string regex_escape(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\.^$|?*+()[]{}-#&~ \t\n\r\f\v").find(c) != std::string_view::npos) {
      if (c == '\t') { out += "\\t"; continue; }
      if (c == '\n') { out += "\\n"; continue; }
      if (c == '\r') { out += "\\r"; continue; }
      if (c == '\f') { out += "\\f"; continue; }
      if (c == '\v') { out += "\\v"; continue; }
      out.push_back('\\');
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace dflash::text
