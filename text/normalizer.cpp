#include "text/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include "core/error.h"
#include "text/utf8.h"

namespace dflash::text {

namespace {

void add(const nlohmann::json& j, std::vector<Normalizer::Form>& forms) {
  if (j.is_null()) return;
  DFLASH_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(),
               "tokenizer.json: normalizer must be an object with a \"type\", got " << j.dump().substr(0, 200));
  const std::string type = j["type"];
  if (type == "NFC") forms.push_back(Normalizer::Form::NFC);
  else if (type == "NFKC") forms.push_back(Normalizer::Form::NFKC);
  else if (type == "Sequence") {
    DFLASH_CHECK(j.contains("normalizers") && j["normalizers"].is_array(), "tokenizer.json: normalizer Sequence without a \"normalizers\" list");
    for (const auto& n : j["normalizers"]) add(n, forms);
  } else {
    DFLASH_FAIL_HINT("tokenizer.json: normalizer type \"" << type << "\" is not supported",
                     "supported normalizers: NFC, NFKC, Sequence of those, or none (null); the ids would differ from Hugging Face's otherwise");
  }
}

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& j) {
  Normalizer n;
  add(j, n.forms_);
  return n;
}

std::string Normalizer::describe() const {
  if (forms_.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < forms_.size(); ++i) out += std::string(i ? " > " : "") + (forms_[i] == Form::NFC ? "NFC" : "NFKC");
  return out;
}

std::string Normalizer::apply(std::string_view s) const {
  if (forms_.empty() || is_ascii(s)) return std::string(s);
  std::string cur(s);
  for (Form f : forms_) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = f == Form::NFC ? icu::Normalizer2::getNFCInstance(status) : icu::Normalizer2::getNFKCInstance(status);
    DFLASH_CHECK(U_SUCCESS(status), "ICU: no " << (f == Form::NFC ? "NFC" : "NFKC") << " normalizer: " << u_errorName(status));
    std::string next;
    icu::StringByteSink<std::string> sink(&next);
    n->normalizeUTF8(0, icu::StringPiece(cur.data(), static_cast<int32_t>(cur.size())), sink, nullptr, status);
    DFLASH_CHECK(U_SUCCESS(status), "ICU normalization failed: " << u_errorName(status));
    cur = std::move(next);
  }
  return cur;
}

std::vector<size_t> Normalizer::boundaries(std::string_view s) const {
  std::vector<size_t> out{0};
  std::vector<const icu::Normalizer2*> ns;
  for (Form f : forms_) {
    UErrorCode status = U_ZERO_ERROR;
    ns.push_back(f == Form::NFC ? icu::Normalizer2::getNFCInstance(status) : icu::Normalizer2::getNFKCInstance(status));
    DFLASH_CHECK(U_SUCCESS(status), "ICU: no normalizer: " << u_errorName(status));
  }
  size_t i = 0;
  while (i < s.size()) {
    size_t n;
    const uint32_t c = decode_utf8(s, i, n);
    if (i > 0) {
      bool all = true;
      for (const icu::Normalizer2* nz : ns) all = all && nz->hasBoundaryBefore(static_cast<UChar32>(c));
      if (all) out.push_back(i);
    }
    i += n;
  }
  if (s.size() > 0) out.push_back(s.size());
  return out;
}

}  // namespace dflash::text
