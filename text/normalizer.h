#pragma once
// tokenizer.json "normalizer": none, NFC, NFKC, or a Sequence of those (Unicode normalization by
// ICU). Anything else is refused at load, naming the type.
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::text {

class Normalizer {
 public:
  enum class Form { NFC, NFKC };

  // From the "normalizer" value (null = none). Throws naming the unsupported type.
  static Normalizer from_json(const nlohmann::json& j);

  bool empty() const { return forms_.empty(); }
  std::string describe() const;  // "none", "NFC", "NFC > NFKC", ...
  // Applies the forms in order; s must be valid UTF-8. ASCII text is left as it is (it is stable
  // under both forms), so the common case costs one scan.
  std::string apply(std::string_view s) const;
  // Byte offsets in s (valid UTF-8) where every form of the sequence has a normalization boundary
  // (ICU hasBoundaryBefore), 0 and s.size() included: normalizing the pieces between them one by
  // one gives the pieces of apply(s) (checked by the caller), so each normalized piece aligns with
  // its original. ASCII stretches are cut at every character.
  std::vector<size_t> boundaries(std::string_view s) const;

 private:
  std::vector<Form> forms_;
};

}  // namespace dflash::text
